/* What the benchmarks share: the clock, the best-of timing loop, medians,
   the CPU's name, random operands, a GEMM's descriptor, the last epoch's
   numbers in a model's history and the seed models' layers.

   Include after mpt.h, with _POSIX_C_SOURCE 200809L defined before mpt.h
   (clock_gettime). Only the public API, in the C that C++ compiles too
   (bench_cuda.c is built by nvcc: descriptors are zeroed and filled, not
   compound literals); the functions are static inline, so a benchmark
   that calls only some of them builds without warnings. */
#ifndef MPT_BENCH_COMMON_H
#define MPT_BENCH_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- time ------------------------------------------------------------------ */

/* Seconds on clock: CLOCK_MONOTONIC for the wall clock,
   CLOCK_PROCESS_CPUTIME_ID for the CPU time of the whole process. */
static inline double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds on the wall clock (CLOCK_MONOTONIC). */
static inline double now(void) { return clock_seconds(CLOCK_MONOTONIC); }

/* Best seconds of run(ctx, arg) over repetitions after one warm-up call
   (caches, pages, pool): at least 3, and at least min_total seconds in
   all, at most 200. The best, not the mean: interference only ever makes
   a run slower. */
static inline double best_seconds(mpt_context *ctx, void (*run)(mpt_context *, const void *),
                                  const void *arg, double min_total) {
    double best = 1e30, total = 0;
    int rep;
    run(ctx, arg);
    for (rep = 0; rep < 200 && (rep < 3 || total < min_total); rep++) {
        double t = now(), s;
        run(ctx, arg);
        s = now() - t;
        total += s;
        if (s < best) best = s;
    }
    return best;
}

/* ---- statistics ------------------------------------------------------------ */

/* qsort's order of doubles, ascending. */
static inline int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values (the mean of the middle two when n is even).
   Sorts v: v[0] and v[n - 1] are then the least and the greatest. */
static inline double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- the machine and the operands ----------------------------------------- */

/* The CPU's "model name" from /proc/cpuinfo into buf, or "?". */
static inline void cpu_name(char *buf, size_t size) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, size, "?");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(buf, size, "%s", strchr(line, ':') + 2);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    fclose(f);
}

/* n values in [-1, 1) as dtype (float32, float16 or bfloat16), in a new
   buffer to free(): the same values in every run (a fixed LCG). */
static inline void *random_values(mpt_dtype dtype, int64_t n) {
    void *p = malloc((size_t)n * mpt_dtype_size(dtype));
    int64_t i;
    uint32_t s = 12345;
    for (i = 0; i < n; i++) {
        float f;
        s = s * 1664525u + 1013904223u;
        f = (float)((s >> 8) * (1.0 / 16777216.0) * 2.0 - 1.0);
        if (dtype == MPT_FLOAT32) ((float *)p)[i] = f;
        else if (dtype == MPT_FLOAT16) ((mpt_half *)p)[i] = mpt_float_to_half(f);
        else ((mpt_bf16 *)p)[i] = mpt_float_to_bf16(f);
    }
    return p;
}

/* The product C (m×n) = op(A)·op(B) of packed row-major matrices: A is
   m×k (k×m with trans_a), B is k×n (n×k with trans_b), so the leading
   dimensions follow from the shape. */
static inline mpt_gemm_desc gemm_desc(int64_t m, int64_t n, int64_t k, int trans_a, int trans_b,
                                      mpt_dtype ab_dtype, const void *a, const void *b, float *c) {
    mpt_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.m = m;
    d.n = n;
    d.k = k;
    d.trans_a = trans_a;
    d.trans_b = trans_b;
    d.ab_dtype = ab_dtype;
    d.a = a;
    d.lda = trans_a ? m : k;
    d.b = b;
    d.ldb = trans_b ? k : n;
    d.c = c;
    d.ldc = n;
    return d;
}

/* ---- models ------------------------------------------------------------------ */

/* key's value in the model's history at its last epoch; 0 when there is
   none. */
static inline double history_last(const mpt_model *m, const char *key) {
    mpt_history h;
    int k;
    if (mpt_model_history(m, &h) != MPT_OK || h.epochs < 1) return 0;
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], key)) return h.values[k][h.epochs - 1];
    return 0;
}

/* A model for Fashion-MNIST's 28×28×1 images in policy, its weights
   drawn from seed. */
static inline mpt_status create_image_model(mpt_context *ctx, mpt_policy policy, uint64_t seed,
                                            mpt_model **out) {
    mpt_model_desc md;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 28;
    md.input_shape[1] = 28;
    md.input_shape[2] = 1;
    md.input_rank = 3;
    md.policy = policy;
    md.seed = seed;
    return mpt_model_create(ctx, &md, out);
}

static inline mpt_status add_dense(mpt_model *m, int64_t units, mpt_activation activation) {
    mpt_dense_desc d;
    memset(&d, 0, sizeof d);
    d.units = units;
    d.activation = activation;
    return mpt_model_add_dense(m, &d);
}

static inline mpt_status add_conv3x3(mpt_model *m, int64_t filters) {
    mpt_conv2d_desc c;
    memset(&c, 0, sizeof c);
    c.filters = filters;
    c.kernel_size[0] = c.kernel_size[1] = 3;
    c.activation = MPT_ACT_RELU;
    return mpt_model_add_conv2d(m, &c);
}

static inline mpt_status add_max_pool2x2(mpt_model *m) {
    mpt_pool2d_desc p;
    memset(&p, 0, sizeof p);
    p.pool_size[0] = p.pool_size[1] = 2;
    return mpt_model_add_max_pooling2d(m, &p);
}

static inline mpt_status add_dropout(mpt_model *m, float rate) {
    mpt_dropout_desc d;
    memset(&d, 0, sizeof d);
    d.rate = rate;
    return mpt_model_add_dropout(m, &d);
}

static inline mpt_status add_batch_normalization(mpt_model *m) {
    mpt_batchnorm_desc bn;
    memset(&bn, 0, sizeof bn);
    return mpt_model_add_batch_normalization(m, &bn);
}

/* examples/mlp.c's layers: Flatten -> Dense(1024, relu) -> Dense(10, softmax) */
static inline mpt_status add_mlp_layers(mpt_model *m) {
    mpt_status s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = add_dense(m, 1024, MPT_ACT_RELU);
    if (s == MPT_OK) s = add_dense(m, 10, MPT_ACT_SOFTMAX);
    return s;
}

/* examples/cnn_small.c's layers: Conv2D(32, 3, relu) -> MaxPool(2) ->
   Flatten -> Dense(128, relu) -> Dense(10, softmax) */
static inline mpt_status add_cnn_small_layers(mpt_model *m) {
    mpt_status s = add_conv3x3(m, 32);
    if (s == MPT_OK) s = add_max_pool2x2(m);
    if (s == MPT_OK) s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = add_dense(m, 128, MPT_ACT_RELU);
    if (s == MPT_OK) s = add_dense(m, 10, MPT_ACT_SOFTMAX);
    return s;
}

/* examples/cnn.c's block: Conv2D(f, 3, relu) -> BN -> Conv2D(f, 3, relu)
   -> MaxPool(2) -> Dropout(0.25) */
static inline mpt_status add_conv_block(mpt_model *m, int64_t filters) {
    mpt_status s = add_conv3x3(m, filters);
    if (s == MPT_OK) s = add_batch_normalization(m);
    if (s == MPT_OK) s = add_conv3x3(m, filters);
    if (s == MPT_OK) s = add_max_pool2x2(m);
    if (s == MPT_OK) s = add_dropout(m, 0.25f);
    return s;
}

/* examples/cnn.c's layers: two conv blocks (32, 64 filters), Flatten,
   Dense(512, relu), BN, Dropout(0.5), Dense(10, softmax) */
static inline mpt_status add_cnn_layers(mpt_model *m) {
    mpt_status s = add_conv_block(m, 32);
    if (s == MPT_OK) s = add_conv_block(m, 64);
    if (s == MPT_OK) s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = add_dense(m, 512, MPT_ACT_RELU);
    if (s == MPT_OK) s = add_batch_normalization(m);
    if (s == MPT_OK) s = add_dropout(m, 0.5f);
    if (s == MPT_OK) s = add_dense(m, 10, MPT_ACT_SOFTMAX);
    return s;
}

/* The training benchmarks' model (bench_train.c, bench_cuda.c): the
   layers add_layers adds, for 28×28×1 images, seed 42, compiled with Adam
   1e-3 and sparse categorical crossentropy on the final softmax (fit fuses
   the two), no metrics, and built for batch. */
static inline mpt_status make_train_model(mpt_context *ctx, mpt_status (*add_layers)(mpt_model *),
                                          mpt_policy policy, int64_t batch, mpt_model **out) {
    mpt_compile_desc cd;
    mpt_model *m = NULL;
    mpt_status s = create_image_model(ctx, policy, 42, &m);
    if (s != MPT_OK) return s;
    s = add_layers(m);
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.optimizer.learning_rate = 1e-3f;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    if (s == MPT_OK) s = mpt_model_compile(m, &cd);
    if (s == MPT_OK) s = mpt_model_build(m, batch);
    if (s != MPT_OK) mpt_model_destroy(m);
    else *out = m;
    return s;
}

/* examples/quantize.c's models ("mlp" or "cnn_small"), the seed cnn
   ("cnn", examples/cnn.c's layers) or ResNet-20 ("resnet",
   examples/resnet20.h's layers, as examples/resnet.c builds it; include
   that header before this one), for 28×28×1 images,
   seed 1, compiled as there (Adam at Keras' default rate, sparse
   categorical crossentropy, accuracy) and built for batch. */
static inline mpt_status make_quantize_model(mpt_context *ctx, const char *name, mpt_policy policy,
                                             int64_t batch, mpt_model **out) {
    mpt_compile_desc cd;
    mpt_model *m = NULL;
    mpt_status s = create_image_model(ctx, policy, 1, &m);
    if (s != MPT_OK) return s;
    s = !strcmp(name, "cnn_small") ? add_cnn_small_layers(m)
        : !strcmp(name, "cnn")     ? add_cnn_layers(m)
#ifdef MPT_EXAMPLES_RESNET20_H
        : !strcmp(name, "resnet")  ? add_resnet20_layers(m)
#endif
                                   : add_mlp_layers(m);
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.metrics = MPT_METRIC_ACCURACY;
    if (s == MPT_OK) s = mpt_model_compile(m, &cd);
    if (s == MPT_OK) s = mpt_model_build(m, batch);
    if (s != MPT_OK) mpt_model_destroy(m);
    else *out = m;
    return s;
}

#endif

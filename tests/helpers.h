/* What several test programs share: a context whose expected errors are
   counted instead of printed, and the double-precision references of the
   activations. Include after mpt.h. */
#ifndef MPT_TEST_HELPERS_H
#define MPT_TEST_HELPERS_H

#include "test.h"

static int count_errors; /* errors the quiet contexts have logged */

static inline void quiet_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    (void)msg;
    if (level == MPT_LOG_ERROR) count_errors++;
}

static int count_warnings; /* warnings the warning contexts have logged */

static inline void warning_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    (void)msg;
    if (level == MPT_LOG_WARNING) count_warnings++;
}

/* A context of `threads` threads (0: the default) that logs to logger and
   allocates through allocator (all zero: the default allocator). */
static inline mpt_context *test_ctx_with(int threads,
                                         void (*logger)(void *user, mpt_log_level level,
                                                        const char *msg),
                                         mpt_allocator allocator) {
    mpt_context *c = NULL;
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.logger.fn = logger;
    d.num_threads = threads;
    d.allocator = allocator;
    mpt_context_create(&d, &c);
    return c;
}

/* A context of `threads` threads (0: the default) that logs to logger. */
static inline mpt_context *test_ctx_logging(int threads,
                                            void (*logger)(void *user, mpt_log_level level,
                                                           const char *msg)) {
    mpt_allocator none;
    memset(&none, 0, sizeof none);
    return test_ctx_with(threads, logger, none);
}

/* A one-thread context for bad-input tests: errors are counted, not printed. */
static inline mpt_context *quiet_ctx(void) { return test_ctx_logging(1, quiet_logger); }

/* A context of `threads` threads whose warnings are counted (count_warnings),
   not printed. */
static inline mpt_context *warning_ctx(int threads) {
    return test_ctx_logging(threads, warning_logger);
}

/* A block of `bytes` at `alignment` (a power of two), released by
   aligned_block_free: the original pointer is kept just below the block.
   The counting allocators below go through the public API only, so that
   their tests can link the implementation compiled once. */
static inline void *aligned_block(size_t bytes, size_t alignment) {
    unsigned char *raw, *block;
    if (bytes > SIZE_MAX - alignment - sizeof(void *)) return NULL;
    raw = (unsigned char *)malloc(bytes + alignment + sizeof(void *));
    if (!raw) return NULL;
    block = raw + sizeof(void *);
    block += (alignment - (size_t)((uintptr_t)block % alignment)) % alignment;
    memcpy(block - sizeof(void *), &raw, sizeof(void *));
    return block;
}

static inline void aligned_block_free(void *block) {
    void *raw;
    if (!block) return;
    memcpy(&raw, (unsigned char *)block - sizeof(void *), sizeof(void *));
    free(raw);
}

/* An allocator that counts, and from allocation fail_after on (when it is
   not negative) fails. */
typedef struct counting_alloc {
    long allocs, frees, fail_after;
} counting_alloc;

static inline void *count_alloc(void *user, size_t bytes, size_t alignment) {
    counting_alloc *c = (counting_alloc *)user;
    void *p;
    if (c->fail_after >= 0 && c->allocs >= c->fail_after) return NULL;
    p = aligned_block(bytes, alignment);
    if (p) c->allocs++;
    return p;
}

static inline void count_free(void *user, void *ptr) {
    counting_alloc *c = (counting_alloc *)user;
    if (ptr) c->frees++;
    aligned_block_free(ptr);
}

/* A two-thread context with a counting allocator and the quiet logger. */
static inline mpt_context *counting_ctx(counting_alloc *c) {
    mpt_allocator counting;
    counting.alloc = count_alloc;
    counting.free = count_free;
    counting.user_data = c;
    return test_ctx_with(2, quiet_logger, counting);
}

/* The three policies, for the tests that run a case in each. */
static const mpt_policy test_policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                           MPT_POLICY_MIXED_BFLOAT16};

/* Optimizer `type` at learning rate lr, sparse categorical crossentropy,
   accuracy; c is m's context. */
static inline void test_compile_classifier_with(mpt_context *c, mpt_model *m,
                                                mpt_optimizer_type type, float lr) {
    mpt_compile_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = type;
    cd.optimizer.learning_rate = lr;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.metrics = MPT_METRIC_ACCURACY;
    CHECK(mpt_model_compile(m, &cd) == MPT_OK, "compile: %s", mpt_context_error(c));
}

/* Adam at 0.01, sparse categorical crossentropy, accuracy: how the test
   classifiers compile. */
static inline void test_compile_classifier(mpt_context *c, mpt_model *m) {
    test_compile_classifier_with(c, m, MPT_OPTIMIZER_ADAM, 0.01f);
}

/* Layer `layer`'s parameter `suffix` ("kernel", "gamma") of m into *info:
   1, or 0 where the layer has no such parameter. */
static inline int test_param_named(mpt_model *m, const char *layer, const char *suffix,
                                   mpt_param_info *info) {
    char name[160];
    int p;
    snprintf(name, sizeof name, "%s/%s", layer, suffix);
    for (p = 0; p < mpt_model_param_count(m); p++)
        if (mpt_model_param(m, p, info) == MPT_OK && strcmp(info->name, name) == 0) return 1;
    return 0;
}

/* Compiles a model of two outputs, a class and a number, as the tests of
   several outputs do: sparse categorical crossentropy with accuracy, and
   mean squared error with mean absolute error, their losses weighted 1 and
   0.5, optimizer o; c is m's context. */
static inline void test_compile_class_and_number(mpt_context *c, mpt_model *m,
                                                 mpt_optimizer_desc o) {
    static const float loss_weights[2] = {1.0f, 0.5f};
    mpt_compile_desc d;
    memset(&d, 0, sizeof d);
    d.optimizer = o;
    d.losses[0].type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    d.losses[1].type = MPT_LOSS_MEAN_SQUARED_ERROR;
    d.loss_weights = loss_weights;
    d.output_metrics[0] = MPT_METRIC_ACCURACY;
    d.output_metrics[1] = MPT_METRIC_MEAN_ABSOLUTE_ERROR;
    CHECK(mpt_model_compile(m, &d) == MPT_OK, "compile: %s", mpt_context_error(c));
}

/* The small classifier the fit tests train on blobs (blobs.h):
   Dense(hidden, relu) [-> Dropout(dropout), when dropout > 0] ->
   Dense(classes, softmax); Adam at 0.01 (an optimizer with state, so that
   resumed or recovered runs show a difference), sparse categorical
   crossentropy with accuracy. */
typedef struct classifier_desc {
    int64_t features, hidden, classes;
    float dropout;
    uint64_t seed;
    int64_t memory_limit;       /* mpt_model_desc's; 0: none                */
    const mpt_backend *backend; /* NULL: the context's; else set before build,
                                   so that every buffer is planned for it   */
} classifier_desc;

static inline mpt_model *small_classifier(mpt_context *c, const classifier_desc *d) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc hidden, out;
    mpt_dropout_desc drop;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = d->features;
    md.input_rank = 1;
    md.seed = d->seed;
    md.memory_limit = d->memory_limit;
    CHECK(mpt_model_create(c, &md, &m) == MPT_OK, "create: %s", mpt_context_error(c));
    if (!m) return NULL;
#ifndef MPT_NO_IMPLEMENTATION
    if (d->backend) m->be = d->backend; /* a private field */
#else
    CHECK(!d->backend, "classifier_desc.backend needs the implementation in this file");
#endif
    memset(&hidden, 0, sizeof hidden);
    hidden.units = d->hidden;
    hidden.activation = MPT_ACT_RELU;
    mpt_model_add_dense(m, &hidden);
    if (d->dropout > 0) {
        memset(&drop, 0, sizeof drop);
        drop.rate = d->dropout;
        mpt_model_add_dropout(m, &drop);
    }
    memset(&out, 0, sizeof out);
    out.units = d->classes;
    out.activation = MPT_ACT_SOFTMAX;
    mpt_model_add_dense(m, &out);
    test_compile_classifier(c, m);
    return m;
}

/* fit's defaults but for the epochs and the batch size. */
static inline mpt_fit_desc fit_for(int epochs, int64_t batch_size) {
    mpt_fit_desc f;
    memset(&f, 0, sizeof f);
    f.epochs = epochs;
    f.batch_size = batch_size;
    return f;
}

/* Keras' AUC (200 thresholds, ROC, interpolation) computed directly:
   each threshold's confusion counts from every value (p the probability,
   the sigmoid of a logit, clipped to [0, 1]; y != 0 a positive), then
   the trapezoids. w NULL: each 1; a sample's weight for its `per` values. */
static inline double auc_direct(const float *pred, const float *y, const float *w, int64_t n,
                                int64_t per, int from_logits) {
    double tpr[200], fpr[200], auc = 0;
    int64_t i;
    int t;
    for (t = 0; t < 200; t++) {
        double threshold = t == 0 ? -1e-7 : t == 199 ? 1 + 1e-7 : t / 199.0;
        double tp = 0, fp = 0, fn = 0, tn = 0;
        for (i = 0; i < n * per; i++) {
            double p = from_logits ? 1 / (1 + exp(-(double)pred[i])) : pred[i];
            double wi = w ? w[i / per] : 1.0;
            int positive = (p < 0 ? 0 : p > 1 ? 1 : p) > threshold;
            if (y[i] != 0) positive ? (tp += wi) : (fn += wi);
            else positive ? (fp += wi) : (tn += wi);
        }
        tpr[t] = tp + fn > 0 ? tp / (tp + fn) : 0;
        fpr[t] = fp + tn > 0 ? fp / (fp + tn) : 0;
    }
    for (t = 0; t < 199; t++) auc += (fpr[t] - fpr[t + 1]) * (tpr[t] + tpr[t + 1]) / 2;
    return auc;
}

/* The value of a history key (as Keras' history.history[key][epoch]) after
   fit; epoch −1: the last epoch's. NAN when the key or epoch is missing. */
static inline double history_value(const mpt_model *m, const char *key, int epoch) {
    mpt_history h;
    int k;
    mpt_model_history(m, &h);
    if (epoch < 0) epoch = h.epochs + epoch;
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], key) && epoch >= 0 && epoch < h.epochs) return h.values[k][epoch];
    return NAN;
}

static inline double ref_act(mpt_activation act, double z) {
    switch (act) {
    case MPT_ACT_RELU: return z > 0 ? z : 0;
    case MPT_ACT_GELU: return 0.5 * z * (1 + erf(z / sqrt(2.0)));
    case MPT_ACT_SIGMOID: return 1 / (1 + exp(-z));
    case MPT_ACT_TANH: return tanh(z);
    case MPT_ACT_GELU_TANH:
        return 0.5 * z * (1 + tanh(sqrt(2 / 3.14159265358979323846) * (z + 0.044715 * z * z * z)));
    default: return z;
    }
}

/* Softmax over each row of y (rows × cols), in place. */
static inline void ref_softmax_rows(double *y, int64_t rows, int64_t cols) {
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        double mx = y[r * cols], s = 0;
        for (c = 1; c < cols; c++) mx = y[r * cols + c] > mx ? y[r * cols + c] : mx;
        for (c = 0; c < cols; c++) s += (y[r * cols + c] = exp(y[r * cols + c] - mx));
        for (c = 0; c < cols; c++) y[r * cols + c] /= s;
    }
}

/* x · kernel + bias (bias may be NULL) for one sample of a Dense (in →
   out, params in Keras order), in double. */
static inline void ref_dense_sample(const double *x, const double *kernel, const double *bias,
                                    int64_t in, int64_t out, double *y) {
    int64_t i, o;
    for (o = 0; o < out; o++) {
        double s = bias ? bias[o] : 0;
        for (i = 0; i < in; i++) s += x[i] * kernel[i * out + o];
        y[o] = s;
    }
}

/* Relative norm error ‖a − b‖ / max(‖b‖, 1e-30). */
static inline double rel_err(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num) / (sqrt(den) > 1e-30 ? sqrt(den) : 1e-30);
}

/* A value rounded as the library stores it in dtype. */
static inline double round_to(mpt_dtype dtype, double v) {
    if (dtype == MPT_FLOAT16) return mpt_half_to_float(mpt_float_to_half((float)v));
    if (dtype == MPT_BFLOAT16) return mpt_bf16_to_float(mpt_float_to_bf16((float)v));
    return (float)v;
}

/* Why backend table t is not complete, or NULL when it is: a required
   slot (every one but those @backend names optional) that is NULL, the
   collectives or the timers neither all there nor all absent, or a function slot of
   mpt_backend that this list does not name (one added to the struct and
   not here). */
static inline const char *backend_table_gap(const mpt_backend *t) {
    const size_t slots = (sizeof(mpt_backend) - offsetof(mpt_backend, alloc)) / sizeof t->alloc;
    size_t named = 0;
    int collectives, timers;
    if (!t->name) return "name is NULL";
#define REQUIRED(slot)                                                                             \
    do {                                                                                           \
        named++;                                                                                   \
        if (!t->slot) return #slot " is NULL";                                                     \
    } while (0)
    REQUIRED(alloc); REQUIRED(free); REQUIRED(alloc_host); REQUIRED(free_host);
    REQUIRED(upload); REQUIRED(download); REQUIRED(upload_async); REQUIRED(upload_wait);
    REQUIRED(upload_done); REQUIRED(copy); REQUIRED(zero); REQUIRED(sync); REQUIRED(error);
    REQUIRED(destroy); REQUIRED(capture_begin); REQUIRED(capture_end); REQUIRED(replay);
    REQUIRED(graph_free); REQUIRED(gemm); REQUIRED(convert); REQUIRED(activation);
    REQUIRED(activation_grad); REQUIRED(column_sums); REQUIRED(im2col); REQUIRED(col2im);
    REQUIRED(pool_forward); REQUIRED(pool_backward); REQUIRED(pool_workspace);
    REQUIRED(batchnorm_forward); REQUIRED(batchnorm_backward); REQUIRED(batchnorm_commit);
    REQUIRED(batchnorm_workspace); REQUIRED(dropout); REQUIRED(loss); REQUIRED(grad_stats);
    REQUIRED(update); REQUIRED(loss_scale_update); REQUIRED(add); REQUIRED(scale);
    REQUIRED(elementwise); REQUIRED(copy_rows);
    REQUIRED(qgemm);
    REQUIRED(gather_rows); REQUIRED(scatter_add_rows);
    REQUIRED(layernorm_forward); REQUIRED(layernorm_backward); REQUIRED(layernorm_workspace);
    REQUIRED(attention_forward); REQUIRED(attention_backward); REQUIRED(attention_workspace);
#undef REQUIRED
    named++; /* gemm_plan: optional */
    named++; /* lookup_u8: optional */
    named++; /* conv_direct: optional */
    named++; /* dz_and_bias_grad: optional */
    named++; /* gemm_shared_a: optional */
    named++; /* activation_keep_z: optional */
    collectives = !!t->comm_id + !!t->comm_create + !!t->comm_destroy + !!t->allreduce_sum +
                  !!t->comm_error;
    named += 5;
    if (collectives != 0 && collectives != 5)
        return "comm_id, comm_create, comm_destroy, allreduce_sum, comm_error: some NULL, some not";
    timers = !!t->timer_create + !!t->timer_mark + !!t->timer_read + !!t->timer_free;
    named += 4;
    if (timers != 0 && timers != 4)
        return "timer_create, timer_mark, timer_read, timer_free: some NULL, some not";
    if (named != slots)
        return "mpt_backend has a function slot that backend_table_gap does not name";
    return NULL;
}

/* ---- contexts on one SIMD path (test_gemm, test_qgemm, test_relu) ------------- */

/* The SIMD levels the CPU dispatches on, forced by disabling the features
   above each (path_ctx's disable_cpu_features); a level runs where the
   CPU has the features it needs. */
static const struct {
    const char *name;
    int disable, needs;
} simd_levels[] = {
    {"scalar", ~0, 0},
    {"avx2", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16, MPT_CPU_AVX2},
    {"avx512", MPT_CPU_AVX512_BF16, MPT_CPU_AVX512},
    {"avx512bf16", 0, MPT_CPU_AVX512_BF16},
};
#define SIMD_LEVELS ((int)(sizeof simd_levels / sizeof simd_levels[0]))

/* A quiet context of `threads` threads with the CPU features in
   disable_cpu_features turned off (~0: the portable path); NULL when it
   cannot be made. */
static inline mpt_context *path_ctx(int threads, int disable_cpu_features) {
    mpt_context *c = NULL;
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.num_threads = threads;
    d.disable_cpu_features = disable_cpu_features;
    d.logger.fn = quiet_logger;
    if (mpt_context_create(&d, &c) != MPT_OK) return NULL;
    return c;
}

/* ---- a call's status and message (test_qat, test_quantize) ---------------------- */

/* got is want, and where it is an error, ctx's message holds words; what
   names the call in the failures. */
static inline void expect_status(mpt_context *ctx, mpt_status got, mpt_status want,
                                 const char *words, const char *what) {
    CHECK(got == want, "%s: status %d (%s), want %d", what, (int)got, mpt_context_error(ctx),
          (int)want);
    CHECK(got == MPT_OK || strstr(mpt_context_error(ctx), words),
          "%s: message \"%s\" lacks \"%s\"", what, mpt_context_error(ctx), words);
}

/* ---- a test program's main(), its scratch directory, its data ---------------------------- */

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

/* Removes path: a file, or a directory with everything below it. */
static inline void test_remove_tree(const char *path) {
    DIR *dir = opendir(path);
    struct dirent *e;
    char child[1024];
    while (dir && (e = readdir(dir)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= (int)sizeof child)
            continue; /* a name longer than the tests make */
        test_remove_tree(child);
    }
    if (dir) closedir(dir);
    remove(path);
}

/* What a test program's main() sets up around its cases (test_main). */
typedef struct test_program {
    const char *name;         /* the program's, for the summary line            */
    mpt_context **ctx;        /* NULL: none; else made before the cases and
                                 destroyed after them                            */
    int threads;              /* its num_threads (0: the default)                */
    void (*logger)(void *user, mpt_log_level level, const char *msg); /* NULL: stderr */
    unsigned long long seed;  /* test_seed(seed) first, when not 0               */
    void (*setup)(void);      /* NULL, or run once the context is made           */
    char *tmpdir;             /* NULL, or a buffer of tmpdir_size that receives a
                                 new directory /tmp/mpt_<name>_<pid> for the
                                 cases' files, removed with them at the end      */
    size_t tmpdir_size;
    const char *keep_env;     /* NULL, or a variable that, set, keeps tmpdir     */
    void (*cases)(void);      /* the cases (TEST_RUN, or loops of their own)     */
} test_program;

/* dir/name in buf, returned: a case's file in its program's tmpdir. */
static inline const char *test_file_in(char *buf, size_t size, const char *dir,
                                       const char *name) {
    snprintf(buf, size, "%s/%s", dir, name);
    return buf;
}

/* Runs a test program as p says and returns its exit status. */
static inline int test_main(const test_program *p) {
    mpt_context_desc d;
    if (p->seed) test_seed(p->seed);
    if (p->ctx) {
        memset(&d, 0, sizeof d);
        d.num_threads = p->threads;
        d.logger.fn = p->logger;
        if (mpt_context_create(&d, p->ctx) != MPT_OK) {
            printf("FAIL %s: cannot create a context\n", p->name);
            return 1;
        }
    }
    if (p->setup) p->setup();
    if (p->tmpdir) {
        snprintf(p->tmpdir, p->tmpdir_size, "/tmp/mpt_%s_%d", p->name, (int)getpid());
        test_remove_tree(p->tmpdir); /* what an earlier run of the same id left */
        if (mkdir(p->tmpdir, 0700) != 0) {
            printf("FAIL cannot create a temporary directory %s\n", p->tmpdir);
            return 1;
        }
    }
    p->cases();
    if (p->tmpdir && !(p->keep_env && getenv(p->keep_env))) test_remove_tree(p->tmpdir);
    if (p->ctx) mpt_context_destroy(*p->ctx);
    return test_summary(p->name);
}

/* A dataset over the samples of x and the labels y (NULL: none); the
   tensors' data is borrowed, not copied. */
static inline mpt_dataset *test_dataset_of(mpt_context *c, const mpt_tensor *x,
                                           const mpt_tensor *y) {
    /* no compound literals: tests/test_cuda.c includes this as C++ */
    mpt_dataset_desc desc;
    mpt_dataset *d = NULL;
    memset(&desc, 0, sizeof desc);
    desc.x = x;
    desc.y = y;
    CHECK(mpt_dataset_create(c, &desc, &d) == MPT_OK, "dataset: %s", mpt_context_error(c));
    return d;
}

/* A dataset over n samples of x (n × features floats) with the int32 class
   ids y (borrowed, not copied). */
static inline mpt_dataset *test_dataset_xy(mpt_context *c, float *x, int32_t *y, int64_t n,
                                           int64_t features) {
    int64_t x_shape[2], y_shape[1];
    mpt_tensor tx, ty;
    x_shape[0] = n;
    x_shape[1] = features;
    y_shape[0] = n;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, x_shape, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, y_shape, y);
    return test_dataset_of(c, &tx, &ty);
}

/* The bytes of the file at path (malloc'd, *n of them, and a 0 after them
   for reading it as text); NULL and *n = -1 where it cannot be read whole. */
static inline unsigned char *test_read_file(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    *n = -1;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (*n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0)
        buf = (unsigned char *)malloc((size_t)*n + 1);
    if (buf && fread(buf, 1, (size_t)*n, f) == (size_t)*n) {
        buf[*n] = 0;
    } else {
        free(buf);
        buf = NULL;
        *n = -1;
    }
    fclose(f);
    return buf;
}

/* Every parameter's float32 values, in the model's order, into w (room
   for size floats), read through context c's backend where they live in
   a device's memory (a model on a GPU); c may be NULL for a model on the
   CPU. How many there are; the test fails where they do not fit. */
static inline int64_t test_weights_in(mpt_context *c, mpt_model *m, float *w, int64_t size) {
    void *impl = NULL;
    const mpt_backend *t = c ? mpt_context_backend(c, &impl) : NULL;
    int64_t at = 0;
    int p;
    if (t) CHECK(t->sync(impl) == MPT_OK, "sync: %s", t->error(impl));
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        int64_t count;
        mpt_model_param(m, p, &info);
        count = mpt_tensor_count(&info.value);
        if (at + count <= size && info.value.device == MPT_DEVICE_CPU)
            memcpy(w + at, info.value.data, sizeof(float) * (size_t)count);
        else if (at + count <= size)
            CHECK(t && t->download(impl, w + at, info.value.data,
                                   mpt_tensor_bytes(&info.value)) == MPT_OK,
                  "download %s: %s", info.name, t ? t->error(impl) : "no context given");
        at += count;
    }
    CHECK(at <= size, "%lld weights, room for %lld", (long long)at, (long long)size);
    return at;
}

/* The same for a model on the CPU. */
static inline void test_weights_of(mpt_model *m, float *w, int64_t size) {
    test_weights_in(NULL, m, w, size);
}

/* a and b hold the same float32 weights, bit for bit, and at least one:
   a training repeated (profiled, on more threads) that must not change. */
static inline int test_same_weights(mpt_model *a, mpt_model *b) {
    int p, n = mpt_model_param_count(a);
    if (n < 1 || n != mpt_model_param_count(b)) return 0;
    for (p = 0; p < n; p++) {
        mpt_param_info ia, ib;
        int64_t count;
        mpt_model_param(a, p, &ia);
        mpt_model_param(b, p, &ib);
        count = mpt_tensor_count(&ia.value);
        if (count != mpt_tensor_count(&ib.value) ||
            memcmp(ia.value.data, ib.value.data, sizeof(float) * (size_t)count) != 0)
            return 0;
    }
    return 1;
}

/* a and b predict the same bits on d (batches of batch_size): a model and
   what was loaded from its file. */
static inline void test_same_predictions(mpt_context *c, mpt_model *a, mpt_model *b,
                                         mpt_dataset *d, int64_t batch_size) {
    mpt_tensor pa, pb;
    int64_t i = 0;
    memset(&pa, 0, sizeof pa);
    memset(&pb, 0, sizeof pb);
    CHECK(mpt_model_predict(a, d, batch_size, &pa) == MPT_OK, "predict: %s",
          mpt_context_error(c));
    CHECK(mpt_model_predict(b, d, batch_size, &pb) == MPT_OK, "predict loaded: %s",
          mpt_context_error(c));
    if (pa.data && pb.data && mpt_tensor_count(&pa) == mpt_tensor_count(&pb))
        for (; i < mpt_tensor_count(&pa); i++)
            if (((const float *)pa.data)[i] != ((const float *)pb.data)[i]) break;
    CHECK(pa.data && pb.data && i == mpt_tensor_count(&pa),
          "prediction %lld differs after loading", (long long)i);
    mpt_tensor_free(c, &pa);
    mpt_tensor_free(c, &pb);
}

/* A mirrored strategy of `replicas` logical replicas on c's device. */
static inline mpt_strategy *test_mirrored_strategy(mpt_context *c, int replicas) {
    mpt_strategy_desc sd;
    mpt_strategy *st = NULL;
    memset(&sd, 0, sizeof sd);
    sd.type = MPT_STRATEGY_MIRRORED;
    sd.num_replicas = replicas;
    CHECK(mpt_strategy_create(c, &sd, &st) == MPT_OK, "strategy: %s", mpt_context_error(c));
    return st;
}

/* A training to repeat: its model in a context and policy, its dataset,
   and fit's epochs and batch size. */
typedef struct test_training {
    mpt_model *(*model)(mpt_context *c, mpt_policy policy);
    mpt_dataset *(*data)(mpt_context *c);
    int epochs, batch_size;
} test_training;

/* The training t on 1 and on 2 threads ends with the same weights, bit for
   bit: one case a policy. */
static inline void test_threads_bit_identical_fits(const test_training *t) {
    static const mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                           MPT_POLICY_MIXED_BFLOAT16};
    int k, threads;
    for (k = 0; k < 3; k++) {
        float *w[2] = {NULL, NULL};
        int64_t size[2] = {0, 0};
        test__begin();
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *c = NULL;
            mpt_model *m;
            mpt_dataset *d;
            mpt_context_desc cd;
            mpt_fit_desc fit;
            int p;
            memset(&cd, 0, sizeof cd);
            cd.num_threads = threads;
            cd.logger.fn = quiet_logger;
            mpt_context_create(&cd, &c);
            m = t->model(c, policies[k]);
            d = t->data(c);
            memset(&fit, 0, sizeof fit);
            fit.epochs = t->epochs;
            fit.batch_size = t->batch_size;
            CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit on %d threads: %s", threads,
                  mpt_context_error(c));
            for (p = 0; p < mpt_model_param_count(m); p++) {
                mpt_param_info info;
                mpt_model_param(m, p, &info);
                size[threads - 1] += mpt_tensor_count(&info.value);
            }
            w[threads - 1] = (float *)calloc((size_t)size[threads - 1], sizeof(float));
            test_weights_of(m, w[threads - 1], size[threads - 1]);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(c);
        }
        CHECK(size[0] == size[1] &&
                  memcmp(w[0], w[1], sizeof(float) * (size_t)size[0]) == 0,
              "%s: weights after %d epochs differ between 1 and 2 threads",
              mpt_policy_name(policies[k]), t->epochs);
        free(w[0]);
        free(w[1]);
        test__end("1 and 2 threads bit-identical %s", mpt_policy_name(policies[k]));
    }
}

/* A call's status is want and the context's message (q's) holds words;
   call names it in the failure. */
static inline void test_expect_error(mpt_context *q, mpt_status got, mpt_status want,
                                     const char *words, const char *call) {
    CHECK(got == want, "%s: status %d, expected %d", call, (int)got, (int)want);
    CHECK(strstr(mpt_context_error(q), words) != NULL, "%s: message '%s' lacks '%s'", call,
          mpt_context_error(q), words);
}

/* What a printer received (mpt_printer {test_text_append, &t}): each text
   appended to buf while it fits, one that does not dropped whole. */
typedef struct test_text {
    char *buf;
    size_t size, len;
} test_text;

static inline void test_text_clear(test_text *t) {
    t->len = 0;
    t->buf[0] = 0;
}

static inline void test_text_append(void *user, const char *text) {
    test_text *t = (test_text *)user;
    size_t n = strlen(text);
    if (t->len + n < t->size) {
        memcpy(t->buf + t->len, text, n + 1);
        t->len += n;
    }
}

/* NULL when mpt_model_summary's table is aligned, else what is not: every
   layer row has each cell starting at its header's column ("Output
   Shape", "Param #", "Dtype", "Connected to") after a space, a
   "Connected to" line that goes on starts at that column, and the rules
   are as wide as the columns before "Connected to" (at least 94). */
static inline const char *test_summary_misaligned(const char *text) {
    static char why[256];
    static const char *const titles[4] = {"Output Shape", "Param #", "Dtype", "Connected to"};
    const char *header = strstr(text, "\n Layer (type)"), *line, *end;
    size_t column[4], n_columns = 0, rule = 0, k;
    int in_table = 0;
    if (!header) return "no \" Layer (type)\" header";
    header++;
    end = strchr(header, '\n');
    for (k = 0; k < 4 && end; k++) {
        const char *at = strstr(header, titles[k]);
        if (at && at < end) column[n_columns++] = (size_t)(at - header);
    }
    if (n_columns < 3) return "the header lacks a column";
    for (line = text; *line; line = *end ? end + 1 : end) {
        size_t len;
        end = strchr(line, '\n');
        if (!end) end = line + strlen(line);
        len = (size_t)(end - line);
        if (line[0] == '_' || line[0] == '=') {
            if (!rule) rule = len;
            if (len != rule || len < 94 || (n_columns == 4 && len != column[3])) {
                snprintf(why, sizeof why, "a rule of %zu characters (the first: %zu)", len, rule);
                return why;
            }
            if (line[0] == '=') in_table = !in_table && line > header;
            continue;
        }
        if (!in_table) continue;
        if (line[1] != ' ') { /* a layer's row; the graph's input row has no dtype */
            int input = strncmp(line, " input (InputLayer) ", 20) == 0;
            for (k = 0; k < n_columns; k++)
                if (len <= column[k] || line[column[k] - 1] != ' ' ||
                    (line[column[k]] == ' ' && !(input && k == 2))) {
                    snprintf(why, sizeof why, "\"%.*s\": no %s at column %zu", (int)len, line,
                             titles[k], column[k]);
                    return why;
                }
        } else if (n_columns < 4 || strspn(line, " ") != column[3]) { /* Connected to, went on */
            snprintf(why, sizeof why, "\"%.*s\" does not start at Connected to", (int)len, line);
            return why;
        }
    }
    return NULL;
}

/* m's summary, into text (size bytes), is aligned (test_summary_misaligned)
   and holds a and b. */
static inline void test_summary_holds(mpt_model *m, char *text, size_t size, const char *a,
                                      const char *b) {
    const char *why;
    mpt_model_summary(m, text, size);
    why = test_summary_misaligned(text);
    CHECK(strstr(text, a) && strstr(text, b) && !why, "%s in\n%s", why ? why : "a name missing",
          text);
}

#ifndef MPT_NO_IMPLEMENTATION
/* ‖a − b‖ / ‖b‖ over every weight of two models of one architecture (NaN
   if either has one); reads the models' private parameters. */
static inline double test_weight_diff(const mpt_model *a, const mpt_model *b) {
    double num = 0, den = 0;
    int i;
    int64_t e;
    for (i = 0; i < a->n_params; i++)
        for (e = 0; e < a->params[i].count; e++) {
            double x = a->params[i].value[e], y = b->params[i].value[e];
            num += (x - y) * (x - y);
            den += y * y;
        }
    return sqrt(num / den);
}

/* Every byte of every parameter and optimizer slot of two models of one
   architecture, and their step counters and loss scale: the same training,
   bit for bit; reads the models' private parameters. */
static inline int test_same_state(const mpt_model *a, const mpt_model *b) {
    int i, s;
    if (a->n_params != b->n_params) return 0;
    for (i = 0; i < a->n_params; i++) {
        const mpt__param *p = &a->params[i], *q = &b->params[i];
        if (memcmp(p->value, q->value, sizeof(float) * (size_t)p->count)) return 0;
        for (s = 0; s < a->n_slots; s++)
            if (p->slot[s] && memcmp(p->slot[s], q->slot[s], sizeof(float) * (size_t)p->count))
                return 0;
    }
    return a->optimizer_steps == b->optimizer_steps && a->loss_scale == b->loss_scale &&
           a->step == b->step && a->skipped_steps == b->skipped_steps;
}

/* Reads architecture JSON text as mpt_model_load reads a file's (parse,
   then rebuild): *m the model, or NULL and the status of the refusal. */
static inline mpt_status test_model_from_json(mpt_context *c, const char *doc, mpt_model **m) {
    mpt__json j;
    mpt_status s = mpt__json_parse(&j, c, "test", doc, (int64_t)strlen(doc));
    *m = NULL;
    if (s == MPT_OK) s = mpt__model_from_json(&j, c, m);
    mpt__json_free(&j);
    return s;
}

/* Case k of a table of hostile architecture JSON: refused (status s, no
   model m) with a message (q's) that holds words. */
static inline void test_json_refused(mpt_context *q, int k, mpt_status s, const mpt_model *m,
                                     const char *words) {
    CHECK(s != MPT_OK && !m, "case %d: read", k);
    CHECK(strstr(mpt_context_error(q), words) != NULL, "case %d: message '%s' lacks '%s'", k,
          mpt_context_error(q), words);
}

/* Case k of a table of architecture JSON for a float32 model of input (3):
   its layers, then the rest of the document (rest: "" or ",\"key\":..."),
   read as mpt_model_load reads a file's; refused with a message (q's)
   that holds words, or, words NULL, read into a model whose count (its
   inputs or its outputs) is 2. */
static inline void test_json_case(mpt_context *q, int k, const char *layers, const char *rest,
                                  const char *words, int (*count)(const mpt_model *m)) {
    char doc[2048];
    mpt_model *m;
    mpt_status s;
    snprintf(doc, sizeof doc, "{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[3],"
             "\"policy\":\"float32\",\"seed\":0,\"memory_limit\":0,\"max_batch\":4,"
             "\"layers\":[%s]%s}", layers, rest);
    s = test_model_from_json(q, doc, &m);
    if (!words)
        CHECK(s == MPT_OK && count(m) == 2, "case %d: %s", k, mpt_context_error(q));
    else
        test_json_refused(q, k, s, m, words);
    mpt_model_destroy(m);
}

/* Two models trained alike, `two` on a strategy of replicas: each history
   key (a NULL-ended list: "loss", "val_loss", ...) of the last epoch and
   the weights (relative norm) agree within rel. */
static inline void test_replicas_match(const mpt_model *one, const mpt_model *two,
                                       const char *const *keys, double rel) {
    int k;
    for (k = 0; keys[k]; k++) {
        double a = history_value(one, keys[k], -1), b = history_value(two, keys[k], -1);
        CHECK(fabs(b - a) <= rel * fabs(a), "%s: 2 replicas %.9g, 1 replica %.9g", keys[k], b, a);
    }
    CHECK(test_weight_diff(two, one) <= rel,
          "weights: 2 replicas differ from 1 by %.3g (relative norm)", test_weight_diff(two, one));
}
#endif

#endif

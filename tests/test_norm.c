/* BatchNormalization, Dropout and LayerNormalization: gradients against
   finite differences in double, the moving statistics against a hand
   computation, known answers, the dropout mask's rule and statistics,
   LayerNormalization's float16 and bfloat16 against float32,
   thread-count independence, and bad input. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;

/* A float32 input tensor over `data` of shape (batch, sample shape of m). */
static void wrap_input(mpt_model *m, int64_t batch, float *data, mpt_tensor *t) {
    int64_t shape[4];
    int rank = mpt_model_input_shape(m, shape + 1);
    shape[0] = batch;
    mpt_tensor_wrap(ctx, t, MPT_FLOAT32, rank + 1, shape, data);
}

static float *random_floats(int64_t n, double lo, double hi) {
    float *v = (float *)malloc(sizeof(float) * (size_t)n);
    int64_t i;
    for (i = 0; i < n; i++) v[i] = (float)test_uniform(lo, hi);
    return v;
}

/* Output of the last forward as float32 (n elements). */
static void output_f32(const mpt_tensor *y, float *out) {
    mpt_convert(ctx, MPT_FLOAT32, out, y->dtype, y->data, mpt_tensor_count(y));
}

/* ======================================================================
   BatchNormalization
   ====================================================================== */

/* What the references of both normalizations read from a gc_case's user:
   they normalise along the last axis (BatchNormalization's channels,
   LayerNormalization's features). */
typedef struct norm_ref {
    int64_t in_count, axis; /* one sample's elements; the last axis's */
    int center, scale, training; /* training: BatchNormalization's only */
    double eps;
} norm_ref;

/* y = gamma·(x − mean)/sqrt(var + eps) + beta per channel, with the batch
   statistics (biased variance) in training, the moving ones otherwise.
   Parameters come in Keras order, gamma and beta only when used. */
static void bn_forward_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const norm_ref *d = (const norm_ref *)c->user;
    int64_t C = d->axis, rows = c->batch * d->in_count / C, r, ch;
    const double *gamma = d->scale ? params[0] : NULL;
    const double *beta = d->center ? params[d->scale] : NULL;
    const double *mm = params[d->scale + d->center], *mv = params[d->scale + d->center + 1];
    for (ch = 0; ch < C; ch++) {
        double mean = 0, var = 0;
        if (d->training) {
            for (r = 0; r < rows; r++) mean += x[r * C + ch];
            mean /= (double)rows;
            for (r = 0; r < rows; r++) var += (x[r * C + ch] - mean) * (x[r * C + ch] - mean);
            var /= (double)rows;
        } else {
            mean = mm[ch];
            var = mv[ch];
        }
        for (r = 0; r < rows; r++)
            y[r * C + ch] = (gamma ? gamma[ch] : 1) * (x[r * C + ch] - mean) / sqrt(var + d->eps) +
                            (beta ? beta[ch] : 0);
    }
}

/* Begins the gradient check of one normalization `kind` of dtype on
   `batch` samples of `shape`: its label's start ("batchnorm B=5 sample
   (7,) float32 no-center"; label of 160 bytes, the caller adds the rest),
   d for its reference (along the last axis, training), and the model (its
   descriptor's other fields zero) the caller adds the layer to. */
static mpt_model *norm_case(norm_ref *d, char *label, const char *kind, int64_t batch, int rank,
                            const int64_t *shape, mpt_dtype dtype, int center, int scale,
                            double eps) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    char s[64];
    int i;
    test__begin();
    snprintf(label, 160, "%s B=%lld sample %s %s%s%s", kind, (long long)batch,
             mpt_shape_format(s, sizeof s, rank, shape), mpt_dtype_name(dtype),
             center ? "" : " no-center", scale ? "" : " no-scale");
    memset(&md, 0, sizeof md);
    md.input_rank = rank;
    memcpy(md.input_shape, shape, sizeof(int64_t) * (size_t)rank);
    d->in_count = 1;
    for (i = 0; i < rank; i++) d->in_count *= shape[i];
    d->axis = shape[rank - 1];
    d->center = center;
    d->scale = scale;
    d->training = 1;
    d->eps = eps;
    CHECK(mpt_model_create(ctx, &md, &m) == MPT_OK, "create");
    return m;
}

static void check_bn(int64_t batch, int rank, const int64_t *shape, mpt_dtype dtype, int center,
                     int scale, int training) {
    norm_ref d;
    char label[160];
    mpt_model *m =
        norm_case(&d, label, "batchnorm", batch, rank, shape, dtype, center, scale, 1e-3f);
    d.training = training;
    snprintf(label + strlen(label), sizeof label - strlen(label), " %s",
             training ? "training" : "inference");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){
              .dtype = dtype, .no_center = !center, .no_scale = !scale}) == MPT_OK,
          "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, batch + 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_param_count(m) == 2 + center + scale, "%d parameters",
          mpt_model_param_count(m));
    gc_check(ctx, &(gc_case){.model = m, .batch = batch, .training = training,
                             .ref_forward = bn_forward_ref, .user = &d}, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

static void test_bn_gradients(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const int64_t vec[1] = {7}, img[3] = {3, 2, 5}, img1[3] = {2, 3, 13};
    int t, k;
    for (t = 0; t < 3; t++) {
        for (k = 0; k < 4; k++) check_bn(5, 1, vec, dtypes[t], k & 1, k >> 1, 1);
        check_bn(3, 3, img, dtypes[t], 1, 1, 1);
        check_bn(1, 3, img1, dtypes[t], 1, 1, 1);  /* batch 1: statistics over H·W */
        check_bn(2, 3, img1, dtypes[t], 0, 1, 1);
        check_bn(4, 3, img, dtypes[t], 1, 0, 0);   /* inference: the moving statistics */
        check_bn(6, 1, vec, dtypes[t], 1, 1, 0);
    }
}

/* Parameters: Keras names and order, shapes, trainable flags, initial values. */
static void test_bn_params(void) {
    static const char *names[] = {"bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance"};
    static const float init[] = {1, 0, 0, 1};
    mpt_model *m = NULL;
    mpt_param_info info;
    int p, k;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4, 4, 3}, .input_rank = 3,
                                            .policy = MPT_POLICY_MIXED_FLOAT16}, &m);
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.name = "bn"});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.no_center = 1});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.no_scale = 1, .no_center = 1});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_param_count(m) == 4 + 3 + 2, "%d parameters", mpt_model_param_count(m));
    CHECK(mpt_model_layer_dtype(m, 0) == MPT_FLOAT16, "compute dtype %d",
          mpt_model_layer_dtype(m, 0));
    for (p = 0; p < 4; p++) {
        mpt_model_param(m, p, &info);
        CHECK(strcmp(info.name, names[p]) == 0, "param %d is %s", p, info.name);
        CHECK(info.trainable == (p < 2), "%s trainable %d", info.name, info.trainable);
        CHECK(info.value.rank == 1 && info.value.shape[0] == 3 && info.value.dtype == MPT_FLOAT32,
              "%s shape", info.name);
        CHECK((info.grad.data != NULL) == (p < 2), "%s grad", info.name);
        for (k = 0; k < 3; k++)
            CHECK(((float *)info.value.data)[k] == init[p], "%s[%d] = %g", info.name, k,
                  ((float *)info.value.data)[k]);
    }
    mpt_model_param(m, 4, &info);
    CHECK(strcmp(info.name, "batch_normalization/gamma") == 0, "%s", info.name);
    mpt_model_param(m, 5, &info);
    CHECK(strcmp(info.name, "batch_normalization/moving_mean") == 0, "%s", info.name);
    mpt_model_param(m, 7, &info);
    CHECK(strcmp(info.name, "batch_normalization_1/moving_mean") == 0, "%s", info.name);
    mpt_model_destroy(m);
}

static float *param_values(mpt_model *m, int index) {
    mpt_param_info info;
    mpt_model_param(m, index, &info);
    return (float *)info.value.data;
}

/* By hand: x = [[1, 2], [3, 6]] (B = 2, C = 2): channel 0 has mean 2 and
   variance 1, channel 1 mean 4 and variance 4. With gamma = [2, 1], beta =
   [0.5, −1] and eps = 1e-3: y[0][0] = 2·(−1)/sqrt(1.001) + 0.5, ...
   Then moving_mean = 0.01·[2, 4] = [0.02, 0.04] and moving_variance =
   0.99·1 + 0.01·[1, 4] = [1, 1.03] (momentum 0.99, biased variance), up to
   the float32 rounding of 0.99 that Keras' float32 arithmetic has too
   (1 − 0.99f = 0.0099999905: a relative 1e-6). */
static void test_bn_known_answer(void) {
    mpt_model *m = NULL;
    float x[4] = {1, 2, 3, 6}, y[4], moving[4];
    mpt_tensor tx, ty;
    double want[4], e = 1e-3f;
    int i;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2}, .input_rank = 1}, &m);
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build");
    param_values(m, 0)[0] = 2;
    param_values(m, 1)[0] = 0.5f;
    param_values(m, 1)[1] = -1;
    wrap_input(m, 2, x, &tx);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    output_f32(&ty, y);
    want[0] = 2 * -1 / sqrt(1 + e) + 0.5;
    want[1] = -2 / sqrt(4 + e) - 1;
    want[2] = 2 * 1 / sqrt(1 + e) + 0.5;
    want[3] = 2 / sqrt(4 + e) - 1;
    for (i = 0; i < 4; i++) CHECK(fabs(y[i] - want[i]) < 1e-6, "y[%d] = %.8g, want %.8g", i, y[i], want[i]);
    CHECK(fabs(param_values(m, 2)[0] - 0.02) < 1e-7 && fabs(param_values(m, 2)[1] - 0.04) < 1e-7,
          "moving_mean %.8g %.8g", param_values(m, 2)[0], param_values(m, 2)[1]);
    CHECK(fabs(param_values(m, 3)[0] - 1.0) < 1e-7 && fabs(param_values(m, 3)[1] - 1.03) < 1e-7,
          "moving_variance %.8g %.8g", param_values(m, 3)[0], param_values(m, 3)[1]);
    /* Inference: the moving statistics, unchanged by the pass. */
    memcpy(moving, param_values(m, 2), sizeof(float) * 2);
    memcpy(moving + 2, param_values(m, 3), sizeof(float) * 2);
    CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "forward");
    output_f32(&ty, y);
    want[0] = 2 * (1 - 0.02) / sqrt(1 + e) + 0.5;
    want[1] = (2 - 0.04) / sqrt(1.03 + e) - 1;
    want[2] = 2 * (3 - 0.02) / sqrt(1 + e) + 0.5;
    want[3] = (6 - 0.04) / sqrt(1.03 + e) - 1;
    for (i = 0; i < 4; i++)
        CHECK(fabs(y[i] - want[i]) < 1e-6, "inference y[%d] = %.8g, want %.8g", i, y[i], want[i]);
    CHECK(memcmp(moving, param_values(m, 2), sizeof(float) * 2) == 0 &&
              memcmp(moving + 2, param_values(m, 3), sizeof(float) * 2) == 0,
          "inference changed the moving statistics");
    mpt_model_destroy(m);
}

/* Several training forwards (rank 3, momentum 0.9, epsilon 1e-2) against the
   recurrence computed here in double; inference forwards change nothing. */
static void test_bn_moving_statistics(void) {
    enum { B = 3, H = 2, W = 2, C = 5, N = B * H * W * C };
    mpt_model *m = NULL;
    mpt_tensor tx, ty;
    double mm[C], mv[C], mom = 0.9f;
    float *x;
    int step, c, r, ok = 1;
    for (c = 0; c < C; c++) mm[c] = 0, mv[c] = 1;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                            .policy = MPT_POLICY_MIXED_BFLOAT16}, &m);
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.momentum = 0.9f,
                                                               .epsilon = 1e-2f});
    CHECK(mpt_model_build(m, B) == MPT_OK, "build");
    for (step = 0; step < 4; step++) {
        x = random_floats(N, -2 + step, 3 + 2 * step);
        for (r = 0; r < N; r++) x[r] = mpt_bf16_to_float(mpt_float_to_bf16(x[r])); /* as the layer sees it */
        wrap_input(m, B, x, &tx);
        CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
        CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "inference forward");
        for (c = 0; c < C; c++) {
            double mean = 0, var = 0;
            for (r = 0; r < N / C; r++) mean += x[r * C + c];
            mean /= N / C;
            for (r = 0; r < N / C; r++) var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
            var /= N / C; /* biased, as Keras */
            mm[c] = mm[c] * mom + mean * (1 - mom);
            mv[c] = mv[c] * mom + var * (1 - mom);
        }
        for (c = 0; c < C; c++) {
            ok &= fabs(param_values(m, 2)[c] - mm[c]) <= 1e-6 * (1 + fabs(mm[c]));
            ok &= fabs(param_values(m, 3)[c] - mv[c]) <= 1e-6 * (1 + fabs(mv[c]));
        }
        CHECK(ok, "step %d: moving_mean[0] %.8g want %.8g, moving_variance[0] %.8g want %.8g",
              step, param_values(m, 2)[0], mm[0], param_values(m, 3)[0], mv[0]);
        free(x);
    }
    mpt_model_destroy(m);
}

/* A large common offset: the two-pass variance keeps its precision. */
static void test_bn_offset_precision(void) {
    enum { B = 64, C = 3, N = B * C };
    mpt_model *m = NULL;
    mpt_tensor tx, ty;
    float *x = random_floats(N, 999, 1001), y[N];
    double yr[N];
    gc_case c;
    norm_ref d = {C, C, 1, 1, 1, 1e-3f};
    double *params[4], ones[C] = {1, 1, 1}, zeros[C] = {0, 0, 0}, e;
    int i;
    params[0] = ones, params[1] = zeros, params[2] = zeros, params[3] = ones;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {C}, .input_rank = 1}, &m);
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_build(m, B);
    wrap_input(m, B, x, &tx);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    output_f32(&ty, y);
    memset(&c, 0, sizeof c);
    c.batch = B;
    c.user = &d;
    {
        double xd[N];
        for (i = 0; i < N; i++) xd[i] = x[i];
        bn_forward_ref(&c, xd, params, yr);
    }
    for (i = 0; i < N; i++) yr[i] -= y[i];
    e = 0;
    for (i = 0; i < N; i++) e = fabs(yr[i]) > e ? fabs(yr[i]) : e;
    CHECK(e < 2e-4, "max error %g with mean 1000", e);
    free(x);
    mpt_model_destroy(m);
}

/* The same result, to the bit, with 1 and 3 threads (several chunks). */
static void test_bn_threads(void) {
    enum { B = 40, H = 8, W = 8, C = 13, N = B * H * W * C };
    float *x = random_floats(N, -1, 2), *dy = random_floats(N, -1, 1);
    float *y[2], *dx[2], *dgamma[2];
    int t;
    for (t = 0; t < 2; t++) {
        mpt_context *c = test_ctx_logging(t == 0 ? 1 : 3, NULL);
        mpt_model *m = NULL;
        mpt_tensor tx, ty, tdy, tdx;
        mpt_param_info g;
        int64_t shape[4] = {B, H, W, C};
        memset(&tdx, 0, sizeof tdx);
        memset(&ty, 0, sizeof ty); /* (forward fills it; gcc -O2 cannot tell) */
        mpt_model_create(c, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                              .policy = MPT_POLICY_MIXED_FLOAT16}, &m);
        mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
        CHECK(mpt_model_build(m, B) == MPT_OK, "build");
        mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, shape, x);
        mpt_tensor_wrap(c, &tdy, MPT_FLOAT32, 4, shape, dy);
        CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
        y[t] = (float *)malloc(sizeof(float) * N);
        mpt_convert(c, MPT_FLOAT32, y[t], ty.dtype, ty.data, N);
        CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
        dx[t] = (float *)malloc(sizeof(float) * N);
        mpt_convert(c, MPT_FLOAT32, dx[t], tdx.dtype, tdx.data, N);
        mpt_model_param(m, 0, &g);
        dgamma[t] = (float *)malloc(sizeof(float) * C);
        memcpy(dgamma[t], g.grad.data, sizeof(float) * C);
        mpt_model_destroy(m);
        mpt_context_destroy(c);
    }
    CHECK(memcmp(y[0], y[1], sizeof(float) * N) == 0, "y differs between 1 and 3 threads");
    CHECK(memcmp(dx[0], dx[1], sizeof(float) * N) == 0, "dx differs between 1 and 3 threads");
    CHECK(memcmp(dgamma[0], dgamma[1], sizeof(float) * C) == 0, "dgamma differs");
    for (t = 0; t < 2; t++) free(y[t]), free(dx[t]), free(dgamma[t]);
    free(x);
    free(dy);
}

/* One training forward, backward and inference forward of a lone
   BatchNormalization layer (random gamma and beta) under `policy`, on a
   context that may not use the CPU features in `disable`; the outputs as
   float32: y, dx, inference y (n each), then dgamma, dbeta, moving_mean,
   moving_variance (C each). NULL when the context lacks a feature in `need`. */
static float *bn_pass(int disable, int need, int threads, mpt_policy policy, int rank,
                      const int64_t *shape, const float *x, const float *dy, const float *gb) {
    mpt_context *c = NULL;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_tensor tx, ty, tdy, tdx;
    mpt_param_info g;
    int64_t n = 1, C = shape[rank - 1];
    float *out;
    int i;
    for (i = 0; i < rank; i++) n *= shape[i];
    if (mpt_context_create(&(mpt_context_desc){.num_threads = threads,
                                               .disable_cpu_features = disable}, &c) != MPT_OK)
        return NULL;
    if ((mpt_context_cpu_features(c) & need) != need) {
        mpt_context_destroy(c);
        return NULL;
    }
    out = (float *)calloc((size_t)(3 * n + 4 * C), sizeof(float));
    memset(&md, 0, sizeof md);
    md.input_rank = rank - 1;
    memcpy(md.input_shape, shape + 1, sizeof(int64_t) * (size_t)(rank - 1));
    md.policy = policy;
    mpt_model_create(c, &md, &m);
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    CHECK(mpt_model_build(m, shape[0]) == MPT_OK, "build: %s", mpt_context_error(c));
    memcpy(param_values(m, 0), gb, sizeof(float) * (size_t)C);
    memcpy(param_values(m, 1), gb + C, sizeof(float) * (size_t)C);
    mpt_model_refresh_weights(m);
    memset(&tdx, 0, sizeof tdx);
    memset(&ty, 0, sizeof ty); /* (forward fills it; gcc -O2 cannot tell) */
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, rank, shape, (void *)x);
    mpt_tensor_wrap(c, &tdy, MPT_FLOAT32, rank, shape, (void *)dy);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out, ty.dtype, ty.data, n);
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out + n, tdx.dtype, tdx.data, n);
    CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "inference: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out + 2 * n, ty.dtype, ty.data, n);
    for (i = 0; i < 2; i++) {
        mpt_model_param(m, i, &g);
        memcpy(out + 3 * n + i * C, g.grad.data, sizeof(float) * (size_t)C);
    }
    memcpy(out + 3 * n + 2 * C, param_values(m, 2), sizeof(float) * (size_t)C);
    memcpy(out + 3 * n + 3 * C, param_values(m, 3), sizeof(float) * (size_t)C);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    return out;
}

/* The AVX-512 statistics and elementwise passes give the portable loops'
   bits, for every policy, channel counts that fill no vector, one, several
   and a partial one (1, 7, 13, 32, 37, 70), rank 2 and 4, and 1 or 3
   threads; x has an offset mean so that the two-pass variance matters. */
static void test_bn_simd_matches_portable(void) {
    static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                          MPT_POLICY_MIXED_BFLOAT16};
    static const int64_t channels[] = {1, 7, 13, 32, 37, 70};
    int p, k, rank, ran = 0;
    test_seed(23);
    for (k = 0; k < (int)(sizeof channels / sizeof channels[0]); k++)
        for (rank = 2; rank <= 4; rank += 2)
            for (p = 0; p < 3; p++) {
                int64_t shape[4] = {rank == 2 ? 61 : 9, 5, 3, channels[k]}, n = 1, C, i;
                float *x, *dy, *gb, *ref, *simd;
                int threads = 1 + 2 * (k % 2);
                shape[rank - 1] = C = channels[k];
                for (i = 0; i < rank; i++) n *= shape[i];
                x = random_floats(n, 2, 5);
                dy = random_floats(n, -1, 1);
                gb = random_floats(2 * C, -2, 2);
                ref = bn_pass(~0, 0, threads, policies[p], rank, shape, x, dy, gb);
                simd = bn_pass(0, MPT_CPU_AVX512, 4 - threads, policies[p], rank, shape, x, dy, gb);
                if (simd) {
                    ran++;
                    for (i = 0; i < 3 * n + 4 * C; i++)
                        if (memcmp(ref + i, simd + i, sizeof(float)) != 0) break;
                    CHECK(i == 3 * n + 4 * C,
                          "C %lld rank %d policy %d: %s[%lld] %.9g, portable %.9g", (long long)C,
                          rank, p,
                          i < 3 * n ? (i < n ? "y" : i < 2 * n ? "dx" : "inference y")
                                    : "dgamma/dbeta/moving",
                          (long long)(i < 3 * n ? i % n : (i - 3 * n) % C), simd[i], ref[i]);
                }
                free(x), free(dy), free(gb), free(ref), free(simd);
            }
    if (!ran) SKIP("this CPU has no AVX-512");
}

/* x and dy as the layer sees them under `policy`: rounded to bfloat16 for
   mixed_bfloat16, as they are in float32. */
static double bn_seen(mpt_policy policy, float v) {
    return policy == MPT_POLICY_MIXED_BFLOAT16 ? mpt_bf16_to_float(mpt_float_to_bf16(v)) : v;
}

/* A training forward and backward of (rows, C) in double, from the values
   the layer sees (gamma = gb[c], beta = gb[C + c], epsilon 1e-3): y and dx
   (rows · C each), then dgamma, dbeta (C each). */
static double *bn_reference(mpt_policy policy, int64_t rows, int64_t C, const float *x,
                            const float *dy, const float *gb) {
    int64_t n = rows * C, r, c;
    double *ref = (double *)malloc(sizeof(double) * (size_t)(2 * n + 2 * C));
    for (c = 0; c < C; c++) {
        double mean = 0, var = 0, inv_std, sdy = 0, sdyx = 0;
        for (r = 0; r < rows; r++) mean += bn_seen(policy, x[r * C + c]);
        mean /= (double)rows;
        for (r = 0; r < rows; r++) {
            double d = bn_seen(policy, x[r * C + c]) - mean;
            var += d * d;
        }
        inv_std = 1 / sqrt(var / (double)rows + 1e-3);
        for (r = 0; r < rows; r++) {
            double xhat = (bn_seen(policy, x[r * C + c]) - mean) * inv_std;
            sdy += bn_seen(policy, dy[r * C + c]);
            sdyx += bn_seen(policy, dy[r * C + c]) * xhat;
            ref[r * C + c] = gb[c] * xhat + gb[C + c];
        }
        for (r = 0; r < rows; r++) {
            double xhat = (bn_seen(policy, x[r * C + c]) - mean) * inv_std;
            ref[n + r * C + c] = gb[c] * inv_std *
                                 (bn_seen(policy, dy[r * C + c]) - sdy / (double)rows -
                                  xhat * sdyx / (double)rows);
        }
        ref[2 * n + c] = sdyx;
        ref[2 * n + C + c] = sdy;
    }
    return ref;
}

/* The largest |got − want| over `count` values (stride apart) divided by
   the largest |want|. */
static double bn_relative_error(const float *got, const double *want, int64_t count,
                                int64_t stride) {
    double err = 0, size = 0;
    int64_t i;
    for (i = 0; i < count; i++) {
        err = fmax(err, fabs(got[i * stride] - want[i * stride]));
        size = fmax(size, fabs(want[i * stride]));
    }
    return err / size;
}

/* Several chunks of rows, the last one short, and channel counts that end
   in a partial vector (3), one lane past a vector (17) and one past a band
   of two (33), for float32 and bfloat16 on the portable and the AVX-512
   paths: y, dx, dgamma and dbeta of each channel against the formulas in
   double. x drifts along the rows, so that the chunks' means differ and
   joining their moments matters. */
static void test_bn_chunks_odd_channels(void) {
    static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_BFLOAT16};
    static const int64_t channels[] = {3, 17, 33};
    int p, k, path;
    test_seed(29);
    for (k = 0; k < 3; k++)
        for (p = 0; p < 2; p++)
            for (path = 0; path < 2; path++) {
                int64_t C = channels[k], chunk_rows = 16384 / C;
                int64_t rows = 3 * chunk_rows + chunk_rows / 3, shape[2], n = rows * C, r, c;
                float *x = random_floats(n, -1, 1), *dy = random_floats(n, -1, 1);
                float *gb = random_floats(2 * C, 0.5, 2), *out;
                double *ref, tol = p ? 6e-3 : 5e-6, worst[3] = {0, 0, 0};
                shape[0] = rows, shape[1] = C;
                for (r = 0; r < rows; r++)
                    for (c = 0; c < C; c++)
                        x[r * C + c] += 5.0f + 4.0f * (float)r / (float)rows + 0.5f * (float)c;
                out = bn_pass(path ? 0 : ~0, path ? MPT_CPU_AVX512 : 0, 3, policies[p], 2, shape,
                              x, dy, gb);
                ref = out ? bn_reference(policies[p], rows, C, x, dy, gb) : NULL;
                for (c = 0; out && c < C; c++) {
                    worst[0] = fmax(worst[0], bn_relative_error(out + c, ref + c, rows, C));
                    worst[1] = fmax(worst[1], bn_relative_error(out + n + c, ref + n + c, rows, C));
                }
                if (out) /* dgamma and dbeta, each against the largest of its kind */
                    worst[2] = fmax(bn_relative_error(out + 3 * n, ref + 2 * n, C, 1),
                                    bn_relative_error(out + 3 * n + C, ref + 2 * n + C, C, 1));
                CHECK(worst[0] < tol && worst[1] < tol && worst[2] < 1e-5,
                      "C %lld %s %s: relative error y %.3g dx %.3g dgamma/dbeta %.3g "
                      "(tolerance %.3g)",
                      (long long)C, p ? "mixed_bfloat16" : "float32",
                      path ? "AVX-512" : "portable", worst[0], worst[1], worst[2], tol);
                free(x), free(dy), free(gb), free(out), free(ref);
            }
}

/* ======================================================================
   Dropout
   ====================================================================== */

/* The documented rule: element i is kept when word i % 4 of
   Philox(key, (step, i / 4)), as a 24-bit uniform, is ≥ rate. */
static int ref_keep(uint64_t key, uint64_t step, int64_t i, float rate) {
    uint32_t r[4];
    mpt_philox4x32(key, step, (uint64_t)i / 4, r);
    return (float)(r[i % 4] >> 8) / 16777216.0f >= rate;
}

/* One Dropout in double: c->user is its rate. */
static void dropout_forward_ref(const gc_case *c, const double *x, double *const *params,
                                double *y) {
    const float rate = *(const float *)c->user;
    int64_t n = c->batch * c->model->layers[0].in_count, i;
    double scale = 1.0f / (1.0f - rate);
    (void)params;
    for (i = 0; i < n; i++)
        y[i] = ref_keep(c->model->layers[0].seed, c->model->step, i, rate) ? x[i] * scale : 0;
}

static void check_dropout(mpt_dtype dtype, float rate, int rank) {
    mpt_model *m = NULL;
    char label[96];
    test__begin();
    snprintf(label, sizeof label, "dropout rate %g rank %d %s", (double)rate, rank,
             mpt_dtype_name(dtype));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 2, 5}, .input_rank = rank,
                                            .seed = 9}, &m);
    CHECK(mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = rate, .dtype = dtype}) == MPT_OK,
          "add: %s", mpt_context_error(ctx));
    gc_check_random_layer(ctx, m, 4, 17, dropout_forward_ref, &rate, label);
}

static void test_dropout_gradients(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int t;
    for (t = 0; t < 3; t++) {
        check_dropout(dtypes[t], 0.5f, 1);
        check_dropout(dtypes[t], 0.2f, 3);
    }
    check_dropout(MPT_FLOAT32, 0, 1);
}

/* A model with one Dropout layer on (n) vectors. */
static mpt_model *dropout_model(mpt_context *c, int64_t n, float rate, uint64_t model_seed,
                                uint64_t layer_seed, mpt_dtype dtype) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {n}, .input_rank = 1,
                                          .seed = model_seed}, &m);
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = rate, .seed = layer_seed, .dtype = dtype});
    if (mpt_model_build(m, 4) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Forward (training) on x (4 × n) at `step`; y as float32 into out. */
static void dropout_run(mpt_model *m, uint64_t step, float *x, float *out, int training) {
    mpt_tensor tx, ty;
    m->step = step;
    wrap_input(m, 4, x, &tx);
    CHECK(mpt_model_forward(m, &tx, training, &ty) == MPT_OK, "forward");
    output_f32(&ty, out);
}

/* A fixed step gives the same mask; another step another; backward uses
   the mask of the forward it follows, even if the step moved since. */
static void test_dropout_mask_and_step(void) {
    enum { n = 1000, N = 4 * n };
    mpt_model *m = dropout_model(ctx, n, 0.4f, 5, 0, MPT_FLOAT32);
    float *x = random_floats(N, 0.5, 1.5), *dy = random_floats(N, 0.5, 1.5);
    float *a = (float *)malloc(sizeof(float) * N), *b = (float *)malloc(sizeof(float) * N);
    mpt_tensor tdy, tdx;
    int64_t i, shape[2] = {4, n}, same = 0, mismatch = 0;
    dropout_run(m, 3, x, a, 1);
    dropout_run(m, 3, x, b, 1);
    CHECK(memcmp(a, b, sizeof(float) * N) == 0, "step 3 twice: different masks");
    dropout_run(m, 4, x, b, 1);
    for (i = 0; i < N; i++) same += (a[i] == 0) == (b[i] == 0);
    CHECK(same < N * 3 / 4, "steps 3 and 4 agree on %lld of %d elements", (long long)same, N);
    dropout_run(m, 3, x, a, 1);
    m->step = 4; /* the training loop moved on before backward */
    mpt_tensor_wrap(ctx, &tdy, MPT_FLOAT32, 2, shape, dy);
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
    for (i = 0; i < N; i++) {
        float g = ((float *)tdx.data)[i];
        mismatch += (g == 0) != (a[i] == 0);
        if (g != 0) mismatch += g != dy[i] * (1.0f / (1.0f - 0.4f));
    }
    CHECK(mismatch == 0, "backward mask differs from forward's in %lld elements", (long long)mismatch);
    free(x), free(dy), free(a), free(b);
    mpt_model_destroy(m);
}

/* Over 2^20 elements at rate 0.3, the kept fraction is within 6 standard
   deviations (sqrt(0.3·0.7 / 2^20) ≈ 4.5e-4, so 2.7e-3) of 0.7; every kept
   value is x · (1 / (1 − rate)) exactly, and the mask follows the rule. */
static void test_dropout_statistics(void) {
    enum { n = 1 << 18, N = 4 * n };
    const float rate = 0.3f, scale = 1.0f / (1.0f - rate);
    mpt_model *m = dropout_model(ctx, n, rate, 1, 0, MPT_FLOAT32);
    float *x = random_floats(N, -1, 1), *y = (float *)malloc(sizeof(float) * N);
    int64_t i, kept = 0, wrong = 0, rule = 0;
    double frac;
    dropout_run(m, 12, x, y, 1);
    for (i = 0; i < N; i++) {
        int keep = ref_keep(m->layers[0].seed, 12, i, rate);
        rule += keep != (y[i] != 0);
        kept += y[i] != 0;
        if (y[i] != 0) wrong += y[i] != x[i] * scale;
    }
    frac = (double)kept / N;
    CHECK(fabs(frac - 0.7) < 2.7e-3, "kept fraction %.5f, want 0.7 ± 0.0027", frac);
    CHECK(wrong == 0, "%lld kept values not scaled by exactly 1/(1 - rate)", (long long)wrong);
    CHECK(rule == 0, "%lld elements differ from the Philox rule", (long long)rule);
    free(x), free(y);
    mpt_model_destroy(m);
}

/* Several chunks: 1 and 2 threads give the same mask (float16 too). */
static void test_dropout_threads(void) {
    enum { n = 50000, N = 4 * n };
    float *x = random_floats(N, -1, 1), *y[2][2];
    int t, h;
    for (t = 0; t < 2; t++) {
        mpt_context *c = test_ctx_logging(t + 1, NULL);
        for (h = 0; h < 2; h++) {
            mpt_model *m = dropout_model(c, n, 0.5f, 3, 0, h ? MPT_FLOAT16 : MPT_FLOAT32);
            mpt_tensor tx, ty;
            int64_t shape[2] = {4, n};
            m->step = 2;
            mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, shape, x);
            CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
            y[t][h] = (float *)malloc(sizeof(float) * N);
            mpt_convert(c, MPT_FLOAT32, y[t][h], ty.dtype, ty.data, N);
            mpt_model_destroy(m);
        }
        mpt_context_destroy(c);
    }
    CHECK(memcmp(y[0][0], y[1][0], sizeof(float) * N) == 0, "float32 masks differ by threads");
    CHECK(memcmp(y[0][1], y[1][1], sizeof(float) * N) == 0, "float16 masks differ by threads");
    for (t = 0; t < 2; t++) free(y[t][0]), free(y[t][1]);
    free(x);
}

/* Inference and rate 0 are the identity; desc.seed overrides the model's. */
static void test_dropout_identity_and_seed(void) {
    enum { n = 300, N = 4 * n };
    float *x = random_floats(N, -1, 1), *y = (float *)malloc(sizeof(float) * N);
    float *z = (float *)malloc(sizeof(float) * N);
    mpt_model *m = dropout_model(ctx, n, 0.5f, 1, 0, MPT_FLOAT32), *k;
    int64_t i, same = 0;
    dropout_run(m, 1, x, y, 0);
    CHECK(memcmp(x, y, sizeof(float) * N) == 0, "inference is not the identity");
    mpt_model_destroy(m);
    m = dropout_model(ctx, n, 0, 1, 0, MPT_FLOAT32);
    dropout_run(m, 1, x, y, 1);
    CHECK(memcmp(x, y, sizeof(float) * N) == 0, "rate 0 is not the identity in training");
    mpt_model_destroy(m);
    m = dropout_model(ctx, n, 0.5f, 1, 99, MPT_FLOAT32);
    k = dropout_model(ctx, n, 0.5f, 2, 99, MPT_FLOAT32);
    dropout_run(m, 6, x, y, 1);
    dropout_run(k, 6, x, z, 1);
    CHECK(memcmp(y, z, sizeof(float) * N) == 0, "same desc.seed, different masks");
    mpt_model_destroy(k);
    k = dropout_model(ctx, n, 0.5f, 1, 98, MPT_FLOAT32);
    dropout_run(k, 6, x, z, 1);
    for (i = 0; i < N; i++) same += (y[i] == 0) == (z[i] == 0);
    CHECK(same < N * 3 / 4, "desc.seed 98 and 99 agree on %lld of %d", (long long)same, N);
    mpt_model_destroy(k);
    mpt_model_destroy(m);
    free(x), free(y), free(z);
}

/* ======================================================================
   Bad input
   ====================================================================== */

/* The CPU backend's dropout keeps forward's mask as bits in the saved
   buffer (after the step) and backward applies them: with the saved step
   changed in between, backward still drops what forward dropped. Over
   three chunks and an odd tail, in float32 and bfloat16, on the portable
   path and (where the CPU has it) the AVX-512 one, bit for bit. */
static void test_dropout_backward_applies_forward_mask(void) {
    enum { N = 2 * 16384 + 1013 };
    const float rate = 0.3f, scale = 1.0f / (1.0f - rate);
    const uint64_t key = 0x5eed5eedull;
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_BFLOAT16};
    int level, t, ran = 0;
    test_seed(31);
    for (level = 0; level < 2; level++) {
        mpt_context *c = NULL;
        const mpt_backend *be;
        void *impl;
        mpt_context_create(&(mpt_context_desc){.num_threads = 3,
                                               .disable_cpu_features = level ? 0 : ~0}, &c);
        if (level && !(mpt_context_cpu_features(c) & MPT_CPU_AVX512)) {
            mpt_context_destroy(c);
            continue;
        }
        be = mpt_context_backend(c, &impl);
        for (t = 0; t < 2; t++) {
            mpt_dtype dt = dtypes[t];
            size_t es = mpt_dtype_size(dt);
            float *x = random_floats(N, -2, 2), *dy = random_floats(N, -2, 2), *ws = NULL;
            unsigned char *xin = (unsigned char *)malloc(es * N), *y = (unsigned char *)malloc(es * N);
            unsigned char *dyin = (unsigned char *)malloc(es * N), *dx = (unsigned char *)malloc(es * N);
            int64_t *saved = (int64_t *)malloc(8 + (N + 7) / 8), i, bad = -1;
            float got, want;
            mpt_step_state st;
            memset(&st, 0, sizeof st);
            st.step = 7;
            mpt_convert(c, dt, xin, MPT_FLOAT32, x, N);
            mpt_convert(c, dt, dyin, MPT_FLOAT32, dy, N);
            if (dt != MPT_FLOAT32) ws = (float *)malloc(sizeof(float) * N);
            be->dropout(impl, key, rate, dt, xin, y, N, &st, saved, ws);
            CHECK(*saved == 7, "forward saved step %lld", (long long)*saved);
            *saved = 8; /* a different step's mask, were it drawn again */
            be->dropout(impl, key, rate, dt, dyin, dx, N, NULL, saved, ws);
            mpt_convert(c, MPT_FLOAT32, x, dt, xin, N); /* the values as the layer saw them */
            mpt_convert(c, MPT_FLOAT32, dy, dt, dyin, N);
            for (i = 0; i < N && bad < 0; i++) {
                int keep = ref_keep(key, 7, i, rate);
                unsigned char w[4];
                float v;
                v = keep ? x[i] * scale : 0.0f;
                mpt_convert(c, dt, w, MPT_FLOAT32, &v, 1);
                if (memcmp(w, y + es * (size_t)i, es) != 0) bad = i;
                v = keep ? dy[i] * scale : 0.0f;
                mpt_convert(c, dt, w, MPT_FLOAT32, &v, 1);
                if (memcmp(w, dx + es * (size_t)i, es) != 0) bad = i;
            }
            if (bad >= 0) {
                mpt_convert(c, MPT_FLOAT32, &got, dt, dx + es * (size_t)bad, 1);
                want = ref_keep(key, 7, bad, rate) ? dy[bad] * scale : 0.0f;
                CHECK(0, "%s %s: element %lld: dx %g, want %g (y or dx differs)",
                      level ? "avx512" : "portable", t ? "bfloat16" : "float32", (long long)bad,
                      got, want);
            }
            ran++;
            free(x), free(dy), free(ws), free(xin), free(y), free(dyin), free(dx), free(saved);
        }
        mpt_context_destroy(c);
    }
    CHECK(ran >= 2, "%d runs", ran);
}

/* ======================================================================
   LayerNormalization
   ====================================================================== */

/* y = gamma·(x − mean)/sqrt(var + eps) + beta along each row of D, with
   the row's mean and biased variance. Parameters in Keras order, gamma
   and beta only when used. */
static void ln_forward_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const norm_ref *d = (const norm_ref *)c->user;
    int64_t D = d->axis, rows = c->batch * d->in_count / D, r, j;
    const double *gamma = d->scale ? params[0] : NULL;
    const double *beta = d->center ? params[d->scale] : NULL;
    for (r = 0; r < rows; r++) {
        const double *xr = x + r * D;
        double mean = 0, var = 0;
        for (j = 0; j < D; j++) mean += xr[j];
        mean /= (double)D;
        for (j = 0; j < D; j++) var += (xr[j] - mean) * (xr[j] - mean);
        var /= (double)D;
        for (j = 0; j < D; j++)
            y[r * D + j] = (gamma ? gamma[j] : 1) * (xr[j] - mean) / sqrt(var + d->eps) +
                           (beta ? beta[j] : 0);
    }
}

static void check_ln(int64_t batch, int rank, const int64_t *shape, mpt_dtype dtype, int center,
                     int scale, float eps) {
    norm_ref d;
    char label[160];
    mpt_model *m = norm_case(&d, label, "layernorm", batch, rank, shape, dtype, center, scale,
                             eps != 0 ? eps : 1e-3f);
    snprintf(label + strlen(label), sizeof label - strlen(label), " eps %g", (double)d.eps);
    CHECK(mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){
              .dtype = dtype, .epsilon = eps, .no_center = !center, .no_scale = !scale}) ==
              MPT_OK,
          "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, batch + 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_param_count(m) == center + scale, "%d parameters", mpt_model_param_count(m));
    gc_check(ctx, &(gc_case){.model = m, .batch = batch, .training = 1,
                             .ref_forward = ln_forward_ref, .user = &d}, label);
    /* inference normalises the same way (no moving state) */
    gc_check(ctx, &(gc_case){.model = m, .batch = batch, .training = 0,
                             .ref_forward = ln_forward_ref, .user = &d}, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

/* (B, D) and (B, T, D), with and without center and scale, each dtype
   (gradcheck.h's tolerances by dtype: 1e-5/1e-4 float32, 5e-3/1e-2
   float16, 3e-2/6e-2 bfloat16). */
static void test_ln_gradients(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const int64_t vec[1] = {7}, seq[2] = {3, 6}, img[3] = {2, 3, 5}, one[1] = {1};
    int t, k;
    for (t = 0; t < 3; t++) {
        for (k = 0; k < 4; k++) check_ln(5, 1, vec, dtypes[t], k & 1, k >> 1, 0);
        for (k = 0; k < 4; k++) check_ln(4, 2, seq, dtypes[t], k & 1, k >> 1, 0);
        check_ln(3, 3, img, dtypes[t], 1, 1, 0);
        check_ln(2, 2, seq, dtypes[t], 1, 1, 1e-5f); /* PyTorch's epsilon */
    }
    check_ln(3, 1, one, MPT_FLOAT32, 1, 1, 0); /* D = 1: x̂ = 0, y = beta */
}

/* One LayerNormalization row by row (D each) in double, gamma and beta. */
static void ln_rows_ref(const double *x, int64_t rows, int64_t D, const double *gamma,
                        const double *beta, double *y) {
    int64_t r, j;
    for (r = 0; r < rows; r++) {
        double mean = 0, var = 0;
        for (j = 0; j < D; j++) mean += x[r * D + j];
        mean /= (double)D;
        for (j = 0; j < D; j++) var += (x[r * D + j] - mean) * (x[r * D + j] - mean);
        var /= (double)D;
        for (j = 0; j < D; j++)
            y[r * D + j] = gamma[j] * (x[r * D + j] - mean) / sqrt(var + 1e-3f) + beta[j];
    }
}

/* y = ln(ln(x) + x), one layer called twice (mpt_apply_layer). */
static void ln_graph_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const norm_ref *d = (const norm_ref *)c->user;
    int64_t n = c->batch * d->in_count, i;
    double *z = (double *)malloc(sizeof(double) * (size_t)n);
    ln_rows_ref(x, n / d->axis, d->axis, params[0], params[1], z);
    for (i = 0; i < n; i++) z[i] += x[i];
    ln_rows_ref(z, n / d->axis, d->axis, params[0], params[1], y);
    free(z);
}

/* In a graph: a residual around LayerNormalization and the same layer
   applied again to the sum, its gamma and beta's gradients the sum of
   both calls'. */
static void test_ln_graph_shared(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16};
    int t;
    for (t = 0; t < 2; t++) {
        mpt_model *m = NULL;
        mpt_node x, two[2], y;
        norm_ref d = {12, 4, 1, 1, 1, 1e-3f};
        char label[96];
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 4}, .input_rank = 2,
                                                .policy = t ? MPT_POLICY_MIXED_FLOAT16
                                                            : MPT_POLICY_FLOAT32}, &m);
        x = mpt_model_input(m);
        two[0] = mpt_layer_normalization(m, x, &(mpt_layer_normalization_desc){.name = "ln"});
        two[1] = x;
        y = mpt_add(m, 2, two, NULL);
        y = mpt_apply_layer(m, "ln", 1, &y);
        CHECK(y != MPT_NODE_FAILED, "graph: %s", mpt_context_error(ctx));
        CHECK(mpt_model_build(m, 6) == MPT_OK, "build: %s", mpt_context_error(ctx));
        CHECK(mpt_model_param_count(m) == 2, "%d parameters", mpt_model_param_count(m));
        snprintf(label, sizeof label, "layernorm shared in a graph, %s", mpt_dtype_name(dtypes[t]));
        gc_check(ctx, &(gc_case){.model = m, .batch = 5, .training = 1,
                                 .ref_forward = ln_graph_ref, .user = &d}, label);
        mpt_model_destroy(m);
    }
}

/* Parameters: Keras' names, order, shapes and initial values; the summary
   counts 2·D. */
static void test_ln_params(void) {
    mpt_model *m = NULL;
    mpt_param_info info;
    char text[2048];
    float *v;
    int k;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {5, 12}, .input_rank = 2}, &m);
    CHECK(mpt_model_add_layer_normalization(m, NULL) == MPT_OK, "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){
              .gamma_initializer = MPT_INIT_ZEROS, .beta_initializer = MPT_INIT_ONES}) == MPT_OK,
          "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(strcmp(mpt_model_layer_name(m, 0), "layer_normalization") == 0 &&
              strcmp(mpt_model_layer_name(m, 1), "layer_normalization_1") == 0,
          "names %s, %s", mpt_model_layer_name(m, 0), mpt_model_layer_name(m, 1));
    CHECK(strcmp(mpt_model_layer_class_name(m, 0), "LayerNormalization") == 0, "class %s",
          mpt_model_layer_class_name(m, 0));
    CHECK(mpt_model_param_count(m) == 4, "%d parameters", mpt_model_param_count(m));
    for (k = 0; k < 4; k++) {
        static const char *names[] = {"layer_normalization/gamma", "layer_normalization/beta",
                                      "layer_normalization_1/gamma", "layer_normalization_1/beta"};
        static const float init[] = {1, 0, 0, 1};
        mpt_model_param(m, k, &info);
        v = (float *)info.value.data;
        CHECK(strcmp(info.name, names[k]) == 0, "parameter %d is %s", k, info.name);
        CHECK(info.trainable && info.value.rank == 1 && info.value.shape[0] == 12,
              "%s: shape or trainable", info.name);
        CHECK(v[0] == init[k] && v[11] == init[k], "%s starts at %g", info.name, (double)v[0]);
    }
    mpt_model_summary(m, text, sizeof text);
    CHECK(strstr(text, "LayerNormalization") && strstr(text, "(None, 5, 12)") &&
              strstr(text, " 24 "),
          "summary row: %s", text);
    CHECK(strstr(text, "Total params: 48"), "summary total: %s", text);
    mpt_model_destroy(m);
}

/* A known answer by hand: x = (1, 2, 3, 4) has mean 2.5 and biased
   variance 1.25; with epsilon 0.25 the scale is 1/sqrt(1.5), and gamma =
   (1, 2, −1, 0.5), beta = (0, 1, 0.5, −2) give y below. A second row of
   equal values gives beta (x̂ = 0). */
static void test_ln_known_answer(void) {
    mpt_model *m = NULL;
    mpt_param_info g, b;
    mpt_tensor tx, ty;
    float x[8] = {1, 2, 3, 4, 7, 7, 7, 7}, y[8];
    const double s = 1 / sqrt(1.5);
    const double want[8] = {-1.5 * s,      2 * -0.5 * s + 1, -1 * 0.5 * s + 0.5, 0.5 * 1.5 * s - 2,
                            0,             1,                0.5,                -2};
    int i;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){.epsilon = 0.25f});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_param(m, 0, &g);
    mpt_model_param(m, 1, &b);
    memcpy(g.value.data, (float[]){1, 2, -1, 0.5f}, sizeof(float) * 4);
    memcpy(b.value.data, (float[]){0, 1, 0.5f, -2}, sizeof(float) * 4);
    mpt_model_refresh_weights(m);
    wrap_input(m, 2, x, &tx);
    CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    output_f32(&ty, y);
    for (i = 0; i < 8; i++)
        CHECK(fabs(y[i] - want[i]) <= 1e-6, "y[%d] = %.8g, want %.8g", i, (double)y[i], want[i]);
    mpt_model_destroy(m);
}

/* One training forward and backward of a lone LayerNormalization (random
   gamma and beta from `seed`) on input x (B, T, D) under `policy`, on
   context c; y and dx (n each) then dgamma and dbeta (D each) as float32. */
static void ln_run(mpt_context *c, mpt_policy policy, int64_t B, int64_t T, int64_t D,
                   const float *x, const float *dy, uint64_t seed, float *out) {
    mpt_model *m = NULL;
    mpt_tensor tx, ty, tdy, tdx;
    mpt_param_info g, b;
    int64_t shape[3] = {B, T, D}, n = B * T * D, i;
    memset(&tdx, 0, sizeof tdx);
    memset(&ty, 0, sizeof ty); /* (forward fills it; gcc -O2 cannot tell) */
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {T, D}, .input_rank = 2,
                                          .policy = policy}, &m);
    mpt_model_add_layer_normalization(m, NULL);
    CHECK(mpt_model_build(m, B) == MPT_OK, "build: %s", mpt_context_error(c));
    mpt_model_param(m, 0, &g);
    mpt_model_param(m, 1, &b);
    test_seed(seed);
    for (i = 0; i < D; i++) {
        ((float *)g.value.data)[i] = (float)test_uniform(0.5, 1.5);
        ((float *)b.value.data)[i] = (float)test_uniform(-0.5, 0.5);
    }
    mpt_model_refresh_weights(m);
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 3, shape, (void *)x);
    mpt_tensor_wrap(c, &tdy, MPT_FLOAT32, 3, shape, (void *)dy);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out, ty.dtype, ty.data, n);
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out + n, tdx.dtype, tdx.data, n);
    memcpy(out + 2 * n, g.grad.data, sizeof(float) * (size_t)D);
    memcpy(out + 2 * n + D, b.grad.data, sizeof(float) * (size_t)D);
    mpt_model_destroy(m);
}

/* The largest |a − b| over n, and where. */
static double max_abs_diff(const float *a, const float *b, int64_t n, int64_t *at) {
    double worst = 0;
    int64_t i;
    *at = 0;
    for (i = 0; i < n; i++)
        if (!(fabs((double)a[i] - b[i]) <= worst)) worst = fabs((double)a[i] - b[i]), *at = i;
    return worst;
}

/* y of rows of D in double, with ln_run's gamma and beta (from `seed`). */
static void ln_reference_y(const float *x, int64_t rows, int64_t D, uint64_t seed, double *y) {
    double *gamma = (double *)malloc(sizeof(double) * (size_t)D);
    double *beta = (double *)malloc(sizeof(double) * (size_t)D);
    double *xd = (double *)malloc(sizeof(double) * (size_t)(rows * D)); /* x, exactly */
    int64_t j;
    test_seed(seed);
    for (j = 0; j < D; j++) {
        gamma[j] = (float)test_uniform(0.5, 1.5);
        beta[j] = (float)test_uniform(-0.5, 0.5);
    }
    for (j = 0; j < rows * D; j++) xd[j] = x[j];
    ln_rows_ref(xd, rows, D, gamma, beta, y);
    free(xd);
    free(gamma);
    free(beta);
}

/* float16 and bfloat16 policies against float32 on the same input (x
   rounded to the half dtype first, so that only the layer's own
   arithmetic differs). The input sits far from 0 (x = 1000 + noise for
   float16, whose Σ x² would overflow and whose Σ x² − D·mean² in float32
   would lose the variance; 100 + noise for bfloat16, whose steps at 1000
   are 8): the statistics in float32 still normalise it. y has |y| < 4,
   so rounding it to float16 errs by at most 2^-9, to bfloat16 by 2^-6;
   dx and the parameter gradients read dy rounded and the dx rounded. */
static void test_ln_mixed_policies(void) {
    enum { B = 6, T = 5, D = 40, N = B * T * D };
    static const mpt_policy policies[] = {MPT_POLICY_MIXED_FLOAT16, MPT_POLICY_MIXED_BFLOAT16};
    static const mpt_dtype dtypes[] = {MPT_FLOAT16, MPT_BFLOAT16};
    static const double centre[] = {1000, 100}, noise[] = {8, 6};
    static const double tol_y[] = {4e-3, 3e-2}, tol_dx[] = {2e-2, 1.2e-1}, tol_p[] = {2e-2, 1e-1};
    float *x = (float *)malloc(sizeof(float) * N), *dy = (float *)malloc(sizeof(float) * N);
    float *ref = (float *)malloc(sizeof(float) * (2 * N + 2 * D));
    float *half = (float *)malloc(sizeof(float) * (2 * N + 2 * D));
    double *exact = (double *)malloc(sizeof(double) * N);
    int k;
    int64_t i, at;
    for (k = 0; k < 2; k++) {
        double e;
        test__begin();
        test_seed(40 + (unsigned)k);
        for (i = 0; i < N; i++) {
            x[i] = (float)round_to(dtypes[k], centre[k] + test_uniform(-noise[k], noise[k]));
            dy[i] = (float)round_to(dtypes[k], test_uniform(-1, 1));
        }
        ln_run(ctx, MPT_POLICY_FLOAT32, B, T, D, x, dy, 7, ref);
        ln_run(ctx, policies[k], B, T, D, x, dy, 7, half);
        ln_reference_y(x, B * T, D, 7, exact);
        /* the row's mean, rounded to float32, errs by up to half a step of
           float32 at 1000 (3.1e-5), which x̂ divides by σ ≈ 4.6 and gamma
           (< 1.5) scales: up to 1e-5 in y (measured 9.4e-6) */
        for (e = 0, i = 0; i < N; i++) e = fmax(e, fabs(ref[i] - exact[i]));
        CHECK(e <= 2e-5, "float32 y differs from double's by %.3g > 2e-5", e);
        for (e = 0, i = 0; i < N; i++) e = fmax(e, fabs(half[i] - exact[i]));
        CHECK(e <= tol_y[k], "%s y differs from double's by %.3g > %.3g",
              mpt_dtype_name(dtypes[k]), e, tol_y[k]);
        for (i = 0; i < 2 * N + 2 * D; i++)
            CHECK(isfinite(half[i]), "%s: value %lld is not finite", mpt_dtype_name(dtypes[k]),
                  (long long)i);
        e = max_abs_diff(half, ref, N, &at);
        CHECK(e <= tol_y[k], "%s: y differs by %.3g > %.3g at %lld (%g vs %g)",
              mpt_dtype_name(dtypes[k]), e, tol_y[k], (long long)at, (double)half[at],
              (double)ref[at]);
        e = max_abs_diff(half + N, ref + N, N, &at);
        CHECK(e <= tol_dx[k], "%s: dx differs by %.3g > %.3g at %lld",
              mpt_dtype_name(dtypes[k]), e, tol_dx[k], (long long)at);
        e = max_abs_diff(half + 2 * N, ref + 2 * N, 2 * D, &at);
        CHECK(e <= tol_p[k], "%s: dgamma/dbeta differ by %.3g > %.3g at %lld",
              mpt_dtype_name(dtypes[k]), e, tol_p[k], (long long)at);
        /* the statistics normalised: y's spread is gamma's, not 0 or inf */
        CHECK(fabs(ref[0]) < 4 && fabs(ref[1] - ref[0]) > 1e-3, "float32 y %g %g", (double)ref[0],
              (double)ref[1]);
        test__end("layernorm %s vs float32, x = %g + noise", mpt_dtype_name(dtypes[k]),
                  centre[k]);
    }
    free(x), free(dy), free(ref), free(half), free(exact);
}

/* 1 and 2 threads give the same bits, and so does the portable path
   (no SIMD conversions) on 2: 900 rows of 300 (a row in two pieces),
   several chunks. */
static void test_ln_threads(void) {
    enum { B = 45, T = 20, D = 300, N = B * T * D, OUT = 2 * N + 2 * D };
    static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                          MPT_POLICY_MIXED_BFLOAT16};
    float *x = random_floats(N, -1, 2), *dy = random_floats(N, -1, 1);
    float *out[3];
    int t, p;
    for (p = 0; p < 3; p++) {
        for (t = 0; t < 3; t++) {
            mpt_context *c = t < 2 ? test_ctx_logging(t + 1, NULL) : path_ctx(2, ~0);
            out[t] = (float *)malloc(sizeof(float) * OUT);
            ln_run(c, policies[p], B, T, D, x, dy, 11, out[t]);
            mpt_context_destroy(c);
        }
        for (t = 1; t < 3; t++) {
            const char *what = t == 1 ? "2 threads" : "the portable path";
            CHECK(memcmp(out[0], out[t], sizeof(float) * N) == 0, "%s: y differs on %s",
                  mpt_policy_name(policies[p]), what);
            CHECK(memcmp(out[0] + N, out[t] + N, sizeof(float) * N) == 0, "%s: dx differs on %s",
                  mpt_policy_name(policies[p]), what);
            CHECK(memcmp(out[0] + 2 * N, out[t] + 2 * N, sizeof(float) * 2 * D) == 0,
                  "%s: dgamma or dbeta differs on %s", mpt_policy_name(policies[p]), what);
        }
        free(out[0]), free(out[1]), free(out[2]);
    }
    free(x);
    free(dy);
}

/* (T, D) sequences: LayerNormalization → Flatten → Dense(relu) →
   LayerNormalization → Dense(softmax) learns under mixed_float16, from
   inputs around 50 that only a per-row normalisation makes readable: the
   loss falls by half. */
/* LayerNormalization's AVX-512 forward (its row sums in 16 lanes) against
   the portable one (sums in order), each against the row in double: D of
   1 to 1000 (masked tails), x around 3 and around 500, each dtype. A row's
   mean and inv_std may differ between the two in the last bit (the sums'
   order), within 2^-22 relative; the double row is what bounds y: within
   tolerance 3e-6·(1 + |y|) in float32, one ulp of the dtype in halves. */
static void test_ln_simd_matches_portable(void) {
    static const int64_t widths[] = {1, 7, 16, 33, 256, 1000};
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_BFLOAT16, MPT_FLOAT16};
    mpt_context *plain = NULL;
    int wi, di, far;
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) {
        SKIP("no AVX-512 on this CPU");
        return;
    }
    mpt_context_create(&(mpt_context_desc){.num_threads = 1, .disable_cpu_features = ~0}, &plain);
    if (!plain) {
        CHECK(0, "context");
        return;
    }
    for (wi = 0; wi < 6; wi++)
        for (di = 0; di < 3; di++)
            for (far = 0; far < 2; far++) {
                const int64_t D = widths[wi], rows = 37, n = rows * D;
                const mpt_dtype dt = dts[di];
                const double ulp = dt == MPT_FLOAT32 ? 3e-6 : dt == MPT_BFLOAT16 ? 1.0 / 128 : 1.0 / 1024;
                void *x = malloc((size_t)n * 4), *y1 = malloc((size_t)n * 4), *y2 = malloc((size_t)n * 4);
                float *gamma = (float *)malloc(sizeof(float) * (size_t)D);
                float *beta = (float *)malloc(sizeof(float) * (size_t)D);
                float m1[37], m2[37], s1[37], s2[37];
                int64_t i, r, bad = 0;
                mpt_layernorm_args a;
                for (i = 0; i < n; i++)
                    mpt__store_f32(dt, x, i, (float)test_uniform(far ? 490 : 1, far ? 530 : 5));
                for (i = 0; i < D; i++) {
                    gamma[i] = (float)test_uniform(0.5, 1.5);
                    beta[i] = (float)test_uniform(-1, 1);
                }
                memset(&a, 0, sizeof a);
                a.dtype = dt, a.rows = rows, a.cols = D, a.epsilon = 1e-5f, a.x = x;
                a.gamma = gamma, a.beta = beta;
                a.y = y1, a.mean = m1, a.inv_std = s1;
                mpt__cpu_table.layernorm_forward(ctx, &a);
                a.y = y2, a.mean = m2, a.inv_std = s2;
                mpt__cpu_table.layernorm_forward(plain, &a);
                for (r = 0; r < rows; r++) {
                    double sum = 0, sq = 0, mean, inv;
                    bad += fabs(m1[r] - m2[r]) > fabs(m2[r]) * 0x1p-22 ||
                           fabs(s1[r] - s2[r]) > fabs(s2[r]) * 0x1p-22;
                    for (i = 0; i < D; i++) sum += mpt__load_f32(dt, x, r * D + i);
                    mean = sum / (double)D;
                    for (i = 0; i < D; i++) {
                        const double d = mpt__load_f32(dt, x, r * D + i) - mean;
                        sq += d * d;
                    }
                    inv = 1.0 / sqrt(sq / (double)D + 1e-5);
                    for (i = 0; i < D; i++) {
                        const double want =
                            (mpt__load_f32(dt, x, r * D + i) - mean) * inv * gamma[i] + beta[i];
                        const double got = mpt__load_f32(dt, y1, r * D + i);
                        bad += fabs(got - want) > ulp * (1 + fabs(want)) + 1e-4 * (far && dt != MPT_FLOAT32);
                    }
                }
                CHECK(bad == 0, "D = %lld, %s, x around %s: %lld values off", (long long)D,
                      mpt_dtype_name(dt), far ? "500" : "3", (long long)bad);
                free(x), free(y1), free(y2), free(gamma), free(beta);
            }
    mpt_context_destroy(plain);
}

/* LayerNormalization's AVX-512 backward (rows in groups, their sums side
   by side) against the portable one, bit for bit: dx, dgamma and dbeta,
   for D of 1 to 1000 (masked tails) and one past what a group's scratch
   holds (the portable rows then), rows in whole groups and a tail across
   several chunks, each dtype, with and without gamma, without dx, on 1 and
   3 threads. */
static void test_ln_backward_simd_matches_portable(void) {
    static const int64_t widths[] = {1, 7, 16, 33, 256, 1000, 30000};
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_BFLOAT16, MPT_FLOAT16};
    mpt_context *plain = NULL, *simd[2] = {NULL, NULL};
    int wi, di, variant, t;
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) {
        SKIP("no AVX-512 on this CPU");
        return;
    }
    mpt_context_create(&(mpt_context_desc){.num_threads = 1, .disable_cpu_features = ~0}, &plain);
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &simd[0]);
    mpt_context_create(&(mpt_context_desc){.num_threads = 3}, &simd[1]);
    if (!plain || !simd[0] || !simd[1]) {
        CHECK(0, "context");
        mpt_context_destroy(plain), mpt_context_destroy(simd[0]), mpt_context_destroy(simd[1]);
        return;
    }
    for (wi = 0; wi < 7; wi++)
        for (di = 0; di < 3; di++)
            for (variant = 0; variant < 3; variant++) { /* gamma; no gamma; no dx */
                const int64_t D = widths[wi], rows = D > 1000 ? 11 : 16384 / D * 2 + 13;
                const int64_t n = rows * D;
                const mpt_dtype dt = dts[di];
                const size_t es = mpt_dtype_size(dt);
                const int64_t ws = mpt__cpu_table.layernorm_workspace(plain, dt, rows, D);
                void *x = malloc((size_t)n * es), *y = malloc((size_t)n * es);
                void *dy = malloc((size_t)n * es), *dx[2] = {malloc((size_t)n * es),
                                                             malloc((size_t)n * es)};
                float *gamma = (float *)malloc(sizeof(float) * (size_t)D);
                float *beta = (float *)malloc(sizeof(float) * (size_t)D);
                float *dg[2], *db[2];
                float *mean = (float *)malloc(sizeof(float) * (size_t)rows);
                float *inv = (float *)malloc(sizeof(float) * (size_t)rows);
                void *work = malloc((size_t)ws);
                int64_t i;
                mpt_layernorm_args a;
                for (t = 0; t < 2; t++) {
                    dg[t] = (float *)malloc(sizeof(float) * (size_t)D);
                    db[t] = (float *)malloc(sizeof(float) * (size_t)D);
                }
                for (i = 0; i < n; i++) {
                    mpt__store_f32(dt, x, i, (float)test_uniform(-3, 5));
                    mpt__store_f32(dt, dy, i, (float)test_uniform(-1, 1));
                }
                for (i = 0; i < D; i++) {
                    gamma[i] = (float)test_uniform(0.5, 1.5);
                    beta[i] = (float)test_uniform(-1, 1);
                }
                memset(&a, 0, sizeof a);
                a.dtype = dt, a.rows = rows, a.cols = D, a.epsilon = 1e-5f, a.x = x, a.y = y;
                a.gamma = variant == 1 ? NULL : gamma, a.beta = beta;
                a.mean = mean, a.inv_std = inv, a.dy = dy, a.workspace = work;
                mpt__cpu_table.layernorm_forward(plain, &a);
                for (t = 0; t < 3; t++) { /* portable, then AVX-512 on 1 and 3 threads */
                    const int k = t ? 1 : 0;
                    memset(dx[k], 0xff, (size_t)n * es);
                    memset(dg[k], 0xff, sizeof(float) * (size_t)D);
                    memset(db[k], 0xff, sizeof(float) * (size_t)D);
                    a.dx = variant == 2 ? NULL : dx[k];
                    a.dgamma = a.gamma ? dg[k] : NULL, a.dbeta = db[k];
                    mpt__cpu_table.layernorm_backward(t ? simd[t - 1] : plain, &a);
                    if (!t) continue;
                    CHECK(variant == 2 || memcmp(dx[0], dx[1], (size_t)n * es) == 0,
                          "D = %lld %s variant %d, %d threads: dx differs", (long long)D,
                          mpt_dtype_name(dt), variant, t == 1 ? 1 : 3);
                    CHECK(!a.gamma || memcmp(dg[0], dg[1], sizeof(float) * (size_t)D) == 0,
                          "D = %lld %s variant %d, %d threads: dgamma differs", (long long)D,
                          mpt_dtype_name(dt), variant, t == 1 ? 1 : 3);
                    CHECK(memcmp(db[0], db[1], sizeof(float) * (size_t)D) == 0,
                          "D = %lld %s variant %d, %d threads: dbeta differs", (long long)D,
                          mpt_dtype_name(dt), variant, t == 1 ? 1 : 3);
                }
                free(x), free(y), free(dy), free(dx[0]), free(dx[1]), free(gamma), free(beta);
                free(mean), free(inv), free(work);
                for (t = 0; t < 2; t++) free(dg[t]), free(db[t]);
            }
    mpt_context_destroy(plain);
    mpt_context_destroy(simd[0]);
    mpt_context_destroy(simd[1]);
}

static void test_ln_trains_mixed_float16(void) {
    enum { N = 256, T = 4, D = 8, CLASSES = 3 };
    static float x[N * T * D];
    static int32_t y[N];
    int64_t x_shape[3] = {N, T, D}, y_shape[1] = {N}, i, j;
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_history h;
    test_seed(77);
    for (i = 0; i < N; i++) {
        y[i] = (int32_t)(i % CLASSES);
        for (j = 0; j < T * D; j++) /* the class shows in which feature stands out */
            x[i * T * D + j] = (float)(50 + test_uniform(-1, 1) + (j % D == y[i] ? 3 : 0));
    }
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 3, x_shape, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, y_shape, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {T, D}, .input_rank = 2,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 3}, &m);
    mpt_model_add_layer_normalization(m, NULL);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_layer_normalization(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 6, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_history(m, &h);
    CHECK(h.epochs == 6, "%d epochs", h.epochs);
    if (h.epochs == 6) {
        double first = -1, last = -1;
        int k;
        for (k = 0; k < h.n_keys; k++)
            if (strcmp(h.keys[k], "loss") == 0) first = h.values[k][0], last = h.values[k][5];
        CHECK(last < 0.5 * first, "loss %g -> %g: did not fall by half", first, last);
    }
    CHECK(mpt_model_layer_dtype(m, 0) == MPT_FLOAT16, "compute dtype %s",
          mpt_dtype_name(mpt_model_layer_dtype(m, 0)));
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* Bad descriptors refused with the layer and the value named;
   quantization, post-training and aware, refuses the layer by name. */
static void test_ln_refusals(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL, *qm = NULL;
    int before = count_errors;
    mpt_node x;
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1}, &m) ==
              MPT_OK, "create");
    test_expect_error(q, mpt_model_add_layer_normalization(
                             m, &(mpt_layer_normalization_desc){.epsilon = -0.5f}),
                      MPT_ERR_INVALID_ARGUMENT, "LayerNormalization: epsilon -0.5", "epsilon -0.5");
    test_expect_error(q, mpt_model_add_layer_normalization(
                             m, &(mpt_layer_normalization_desc){.epsilon = NAN}),
                      MPT_ERR_INVALID_ARGUMENT, "LayerNormalization: epsilon nan", "epsilon NaN");
    test_expect_error(q, mpt_model_add_layer_normalization(
                             m, &(mpt_layer_normalization_desc){.epsilon = INFINITY}),
                      MPT_ERR_INVALID_ARGUMENT, "LayerNormalization: epsilon inf", "epsilon inf");
    test_expect_error(q, mpt_model_add_layer_normalization(
                             m, &(mpt_layer_normalization_desc){
                                    .gamma_initializer = (mpt_initializer)42}),
                      MPT_ERR_INVALID_ARGUMENT, "unknown gamma initializer 42", "gamma init");
    test_expect_error(q, mpt_model_add_layer_normalization(
                             m, &(mpt_layer_normalization_desc){
                                    .beta_initializer = (mpt_initializer)-1}),
                      MPT_ERR_INVALID_ARGUMENT, "unknown beta initializer -1", "beta init");
    CHECK(mpt_model_add_layer_normalization(NULL, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL model");
    x = mpt_layer_normalization(m, mpt_model_input(m),
                                &(mpt_layer_normalization_desc){.epsilon = -1});
    CHECK(x == MPT_NODE_FAILED && strstr(mpt_context_error(q), "epsilon -1"),
          "functional form: node %d, %s", x, mpt_context_error(q));
    CHECK(mpt_model_layer_count(m) == 0, "%d layers after the failures", mpt_model_layer_count(m));
    CHECK(count_errors - before == 6, "%d errors logged", count_errors - before);
    mpt_model_destroy(m);

    /* a well-made one: quantized in dynamic range (float32, the float
       model's own function: tests/test_quantize.c checks its bits), full
       integer and quantization-aware training refuse it by name
       (tests/test_export.c exports it) */
    m = NULL;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4});
    mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){.name = "ln"});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_refresh_weights(m); /* its weights count as given: quantize takes them */
    CHECK(mpt_model_quantize(m, NULL, &qm) == MPT_OK && qm, "quantize: %s",
          mpt_context_error(q));
    mpt_model_destroy(qm);
    qm = NULL;
    {
        static float samples[2 * 6] = {1, 2, 3, 4, 5, 6, -1, 0, 1, 0, -1, 2};
        mpt_tensor t;
        mpt_dataset *d = NULL;
        mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, (int64_t[]){2, 6}, samples);
        CHECK(mpt_dataset_create(q, &(mpt_dataset_desc){.x = &t}, &d) == MPT_OK, "dataset");
        test_expect_error(q, mpt_model_quantize(m, &(mpt_quantize_desc){
                              .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = d}, &qm),
                          MPT_ERR_UNSUPPORTED,
                          "layer 'ln' (LayerNormalization) has no full-integer form", "quantize");
        CHECK(qm == NULL, "a quantized model was made");
        mpt_dataset_destroy(d);
    }
    test_expect_error(q, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                      "layer 'ln' (LayerNormalization)", "quantize_aware");
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m) == MPT_OK,
          "create");
    CHECK(mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 1}) == MPT_ERR_INVALID_ARGUMENT,
          "rate 1 accepted");
    CHECK(strstr(mpt_context_error(q), "rate 1") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = -0.1f}) == MPT_ERR_INVALID_ARGUMENT,
          "rate -0.1 accepted");
    CHECK(mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = NAN}) == MPT_ERR_INVALID_ARGUMENT,
          "rate NaN accepted");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.momentum = 2}) ==
              MPT_ERR_INVALID_ARGUMENT, "momentum 2 accepted");
    CHECK(strstr(mpt_context_error(q), "momentum 2") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.momentum = -0.5f}) ==
              MPT_ERR_INVALID_ARGUMENT, "momentum -0.5 accepted");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.epsilon = -1e-3f}) ==
              MPT_ERR_INVALID_ARGUMENT, "epsilon -1e-3 accepted");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.epsilon = NAN}) ==
              MPT_ERR_INVALID_ARGUMENT, "epsilon NaN accepted");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.epsilon = INFINITY}) ==
              MPT_ERR_INVALID_ARGUMENT, "epsilon inf accepted");
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.dtype = MPT_INT8}) ==
              MPT_ERR_DTYPE, "int8 compute dtype accepted");
    CHECK(mpt_model_add_batch_normalization(NULL, &(mpt_batchnorm_desc){0}) ==
              MPT_ERR_INVALID_ARGUMENT, "NULL model accepted");
    /* epsilon 0 and momentum 0 are the zero-initialised defaults (1e-3, 0.99). */
    CHECK(mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.epsilon = 0}) == MPT_OK,
          "default descriptor refused: %s", mpt_context_error(q));
    CHECK(mpt_model_layer_count(m) == 1, "%d layers after the failures", mpt_model_layer_count(m));
    CHECK(count_errors == 9, "errors were not all logged (%d)", count_errors);
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    test_seed(5);
    TEST_RUN(test_bn_known_answer);
    TEST_RUN(test_bn_params);
    test_bn_gradients();
    TEST_RUN(test_bn_moving_statistics);
    TEST_RUN(test_bn_offset_precision);
    TEST_RUN(test_bn_threads);
    TEST_RUN(test_bn_simd_matches_portable);
    TEST_RUN(test_bn_chunks_odd_channels);
    test_dropout_gradients();
    TEST_RUN(test_dropout_mask_and_step);
    TEST_RUN(test_dropout_statistics);
    TEST_RUN(test_dropout_threads);
    TEST_RUN(test_dropout_identity_and_seed);
    TEST_RUN(test_dropout_backward_applies_forward_mask);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_ln_known_answer);
    TEST_RUN(test_ln_params);
    test_ln_gradients();
    test_ln_mixed_policies();
    TEST_RUN(test_ln_graph_shared);
    TEST_RUN(test_ln_threads);
    TEST_RUN(test_ln_simd_matches_portable);
    TEST_RUN(test_ln_backward_simd_matches_portable);
    TEST_RUN(test_ln_trains_mixed_float16);
    TEST_RUN(test_ln_refusals);
    mpt_context_destroy(ctx);
    return test_summary("test_norm");
}

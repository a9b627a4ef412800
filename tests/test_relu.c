/* ReLU propagates NaN, as PyTorch and TensorFlow do: forward x <= 0 ? 0 : x
   (NaN passes, -0 gives +0), backward x <= 0 ? 0 : dy (a NaN y or dy
   passes). Checked bit for bit on every path the CPU can take — the GEMM's
   fused epilogue at each SIMD level, its epilogue-only product, the
   Activation layer forward and backward, Dense and Conv2D with a fused
   ReLU — on special values (NaN, ±inf, ±0, subnormals) and, on finite
   inputs, against the former formula x > 0 ? x : 0. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

static mpt_context *ctx;

/* mpt_gemm and the activations dispatch on helpers.h's simd_levels. */

/* A quiet context at that level, or NULL where the CPU lacks it. */
static mpt_context *level_ctx(int level, int threads) {
    mpt_context *c = path_ctx(threads, simd_levels[level].disable);
    if (c && (mpt_context_cpu_features(c) & simd_levels[level].needs) != simd_levels[level].needs) {
        mpt_context_destroy(c);
        return NULL;
    }
    return c;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float relu_ref(float x) { return x <= 0 ? 0.0f : x; }
static float relu_old(float x) { return x > 0 ? x : 0.0f; }

/* The special values every path must carry. */
static const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f,
                                 1e-40f, -1e-40f, 1.17549435e-38f, -3.0f};
#define SPECIALS ((int)(sizeof specials / sizeof specials[0]))

/* Runs body on a two-thread context of each SIMD level in turn; where
   the CPU lacks a level, body does not run there and the case skips
   (after the others passed). */
static void on_every_level(void (*body)(mpt_context *c, int level)) {
    int level, ran = 0;
    for (level = 0; level < SIMD_LEVELS; level++) {
        mpt_context *c = level_ctx(level, 2);
        if (!c) continue;
        ran++;
        body(c, level);
        mpt_context_destroy(c);
    }
    if (ran < SIMD_LEVELS) SKIP("some SIMD levels are not on this CPU (the others passed)");
}

/* test_gemm_relu_epilogue at one SIMD level, c's. */
static void gemm_relu_epilogue_on(mpt_context *c, int level) {
    enum { M = 13, N = 37, K = 5 };
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int t, alpha_sign, i;
    for (t = 0; t < 3; t++)
        for (alpha_sign = -1; alpha_sign <= 1; alpha_sign += 2) {
            unsigned char a[M * K * 4], b[K * N * 4];
            float c0[M * N], plain[M * N], fused[M * N], bias[N];
            int nans = 0, finite_same = 1, k;
            mpt_gemm_desc g;
            for (i = 0; i < M * K; i++) {
                /* rows 2 and 7 are zero: their C passes exactly (as -0 when alpha < 0) */
                float v = (i / K == 2 || i / K == 7) ? 0.0f : (float)test_uniform(-1, 1);
                if (i == 4 * K + 1) v = NAN;
                if (t == 0) memcpy(a + 4 * i, &v, 4);
                else if (t == 1) ((mpt_half *)a)[i] = mpt_float_to_half(v);
                else ((mpt_bf16 *)a)[i] = mpt_float_to_bf16(v);
            }
            for (i = 0; i < K * N; i++) {
                float v = (float)test_uniform(-1, 1);
                if (t == 0) memcpy(b + 4 * i, &v, 4);
                else if (t == 1) ((mpt_half *)b)[i] = mpt_float_to_half(v);
                else ((mpt_bf16 *)b)[i] = mpt_float_to_bf16(v);
            }
            for (i = 0; i < M * N; i++) c0[i] = (float)test_uniform(-2, 2);
            for (k = 0; k < SPECIALS; k++) {
                c0[2 * N + 3 * k] = specials[k];
                c0[7 * N + 3 * k + 1] = specials[k];
                c0[(3 + k) * N + (N - 1 - k)] = specials[k];
            }
            for (i = 0; i < N; i++) bias[i] = (float)test_uniform(-1, 1);
            bias[N - 3] = NAN;
            bias[N - 2] = -INFINITY;
            memset(&g, 0, sizeof g);
            g.m = M, g.n = N, g.k = K;
            g.a = a, g.b = b, g.lda = K, g.ldb = N, g.ldc = N;
            g.ab_dtype = dtypes[t];
            g.alpha = (float)alpha_sign, g.beta = 1.0f;
            g.bias = bias;
            memcpy(plain, c0, sizeof c0);
            g.c = plain;
            CHECK(mpt_gemm(c, &g) == MPT_OK, "gemm: %s", mpt_context_error(c));
            memcpy(fused, c0, sizeof c0);
            g.c = fused;
            g.activation = MPT_ACT_RELU;
            CHECK(mpt_gemm(c, &g) == MPT_OK, "gemm relu: %s", mpt_context_error(c));
            for (i = 0; i < M * N; i++) {
                nans += isnan(fused[i]) != 0;
                CHECK(bits(fused[i]) == bits(relu_ref(plain[i])),
                      "%s %s alpha %d: C[%d][%d] = relu(%g) gave %g (0x%08x)",
                      simd_levels[level].name, mpt_dtype_name(dtypes[t]), alpha_sign, i / N,
                      i % N, plain[i], fused[i], bits(fused[i]));
                if (!isnan(plain[i]) && bits(fused[i]) != bits(relu_old(plain[i])))
                    finite_same = 0;
            }
            CHECK(nans >= M + N, "%s: only %d NaNs came through", simd_levels[level].name,
                  nans);
            CHECK(finite_same, "%s %s: a non-NaN result differs from x > 0 ? x : 0",
                  simd_levels[level].name, mpt_dtype_name(dtypes[t]));
        }
}

/* The fused ReLU of the product equals ReLU applied to the same product
   without activation, bit for bit, at every SIMD level and dtype, with
   special values in C (beta = 1), the bias and A; on finite elements the
   former formula gives the same bits. */
static void test_gemm_relu_epilogue(void) {
    test_seed(11);
    on_every_level(gemm_relu_epilogue_on);
}

/* K = 0: C = relu(beta·C) without a product, each special value exactly. */
static void test_gemm_relu_without_product(void) {
    enum { M = 3, N = SPECIALS };
    float cm[M * N];
    mpt_gemm_desc g;
    int i;
    test_seed(12);
    for (i = 0; i < M * N; i++) cm[i] = i < N ? specials[i] : (float)test_uniform(-1, 1);
    memset(&g, 0, sizeof g);
    g.m = M, g.n = N, g.k = 0, g.ldc = N, g.c = cm, g.beta = 1.0f;
    g.activation = MPT_ACT_RELU;
    CHECK(mpt_gemm(ctx, &g) == MPT_OK, "gemm");
    for (i = 0; i < N; i++)
        CHECK(bits(cm[i]) == bits(relu_ref(specials[i])), "relu(%g) gave %g", specials[i], cm[i]);
    CHECK(isnan(cm[0]) && isnan(cm[1]) && bits(cm[5]) == 0, "NaN lost or -0 kept");
}

/* A value as dtype stores it, read back as float. */
static float stored(mpt_dtype dtype, const void *data, int64_t i) {
    if (dtype == MPT_FLOAT16) return mpt_half_to_float(((const mpt_half *)data)[i]);
    if (dtype == MPT_BFLOAT16) return mpt_bf16_to_float(((const mpt_bf16 *)data)[i]);
    return ((const float *)data)[i];
}

/* Same value: equal bits, or both NaN (a 16-bit NaN's payload is narrowed). */
static int same_value(float got, float want) {
    return isnan(want) ? isnan(got) != 0 : bits(got) == bits(want);
}

/* The Activation layer at every SIMD level and policy: forward gives
   relu(x) and backward x <= 0 ? 0 : dy, for special x and dy; on one
   thread a batch of 3, on two a batch of 1,300 (69,000 elements: several
   of the backend's tasks, which split the rows). */
static void test_activation_layer(void) {
    enum { N = 53, MOST = 1300 };
    float *x = (float *)malloc(sizeof(float) * MOST * N);
    float *dy = (float *)malloc(sizeof(float) * MOST * N);
    int level, p, i, threads, ran = 0;
    test_seed(13);
    for (level = 0; level < SIMD_LEVELS; level++)
        for (threads = 1; threads <= 2; threads++) {
            const int B = threads == 1 ? 3 : MOST;
            mpt_context *c = level_ctx(level, threads);
            if (!c) continue;
            ran++;
            for (p = 0; p < 3; p++) {
                mpt_model *m = NULL;
                mpt_tensor tx, out, dout, dx;
                const int64_t shape[2] = {B, N};
                int k;
                for (i = 0; i < B * N; i++) {
                    x[i] = (float)test_uniform(-1, 1);
                    dy[i] = (float)test_uniform(-1, 1);
                }
                for (k = 0; k < SPECIALS; k++) {
                    x[3 * k] = specials[k];
                    x[N + 2 * k] = specials[k];
                    dy[2 * N + k] = specials[k]; /* with a random x */
                    dy[3 * k + 1] = NAN;
                }
                x[3 * 3 + 1] = -1.0f; /* a NaN dy where x < 0 gives 0 */
                CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {N}, .input_rank = 1,
                                                            .policy = test_policies[p]},
                                       &m) == MPT_OK,
                      "create");
                mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
                CHECK(mpt_model_build(m, B) == MPT_OK, "build: %s", mpt_context_error(c));
                mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, shape, x);
                mpt_tensor_wrap(c, &dout, MPT_FLOAT32, 2, shape, dy);
                CHECK(mpt_model_forward(m, &tx, 1, &out) == MPT_OK, "forward: %s",
                      mpt_context_error(c));
                for (i = 0; i < B * N; i++) {
                    const mpt_dtype dt = out.dtype;
                    const float xr = (float)round_to(dt, x[i]);
                    CHECK(same_value(stored(dt, out.data, i), (float)round_to(dt, relu_ref(xr))),
                          "%s %s: relu(%g) gave %g", simd_levels[level].name,
                          mpt_dtype_name(dt), x[i], stored(dt, out.data, i));
                }
                /* dy in the output's dtype, as fit gives it */
                if (out.dtype != MPT_FLOAT32) {
                    mpt_tensor_alloc(c, &dout, out.dtype, 2, shape);
                    mpt_convert(c, out.dtype, dout.data, MPT_FLOAT32, dy, B * N);
                }
                CHECK(mpt_model_backward(m, &dout, &dx) == MPT_OK, "backward: %s",
                      mpt_context_error(c));
                for (i = 0; i < B * N; i++) {
                    const float y = stored(out.dtype, out.data, i);
                    const float d = stored(dout.dtype, dout.data, i);
                    const float want = (float)round_to(dx.dtype, y <= 0 ? 0.0f : d);
                    CHECK(same_value(stored(dx.dtype, dx.data, i), want),
                          "%s %s: gradient at y = %g, dy = %g gave %g", simd_levels[level].name,
                          mpt_dtype_name(dx.dtype), y, d, stored(dx.dtype, dx.data, i));
                }
                mpt_tensor_free(c, &dout);
                mpt_model_destroy(m);
            }
            mpt_context_destroy(c);
        }
    free(x);
    free(dy);
    if (ran < 2 * SIMD_LEVELS) SKIP("some SIMD levels are not on this CPU (the others passed)");
}

/* test_layers_propagate_nan_weights at one SIMD level, c's. */
static void nan_weights_on(mpt_context *c, int level) {
    int p, conv, i;
    for (p = 0; p < 3; p++)
        for (conv = 0; conv < 2; conv++) {
            enum { B = 2, H = 5, W = 6, C = 3, F = 7 };
            float x[B * H * W * C];
            const int64_t shape[4] = {B, H, W, C};
            mpt_model *m = NULL;
            mpt_param_info kernel;
            mpt_tensor tx, out;
            int64_t n;
            int nans = 0, negative = 0;
            for (i = 0; i < B * H * W * C; i++) x[i] = (float)test_uniform(-1, 1);
            const mpt_model_desc md = {.input_shape = {H, W, C}, .input_rank = 3,
                                       .policy = test_policies[p], .seed = 5};
            const mpt_model_desc flat = {.input_shape = {H * W * C}, .input_rank = 1,
                                         .policy = test_policies[p], .seed = 5};
            const int64_t flat_shape[2] = {B, H * W * C};
            mpt_model_create(c, conv ? &md : &flat, &m);
            if (conv)
                mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = F,
                                                           .kernel_size = {3, 3},
                                                           .activation = MPT_ACT_RELU});
            else
                mpt_model_add_dense(m, &(mpt_dense_desc){.units = F,
                                                         .activation = MPT_ACT_RELU});
            CHECK(mpt_model_build(m, B) == MPT_OK, "build: %s", mpt_context_error(c));
            mpt_model_param(m, 0, &kernel);
            ((float *)kernel.value.data)[0] = NAN; /* feeds output channel 0 */
            mpt_model_refresh_weights(m);
            if (conv) mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, shape, x);
            else mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, flat_shape, x);
            CHECK(mpt_model_forward(m, &tx, 0, &out) == MPT_OK, "forward: %s",
                  mpt_context_error(c));
            n = mpt_tensor_count(&out);
            for (i = 0; i < n; i++) {
                const float v = stored(out.dtype, out.data, i);
                if (i % F == 0) nans += isnan(v) != 0;
                else negative += !(v >= 0) || bits(v) == 0x80000000u;
            }
            CHECK(nans == n / F, "%s %s %s: %d of %lld outputs of channel 0 are NaN",
                  simd_levels[level].name, conv ? "Conv2D" : "Dense",
                  mpt_dtype_name(out.dtype), nans, (long long)(n / F));
            CHECK(negative == 0, "%d outputs below +0 in the other channels", negative);
            mpt_model_destroy(m);
        }
}

/* A NaN weight in a Dense or Conv2D layer with a fused ReLU reaches the
   output (it used to come out as 0), at every SIMD level and policy. */
static void test_layers_propagate_nan_weights(void) {
    test_seed(14);
    on_every_level(nan_weights_on);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2, .logger.fn = quiet_logger}, &ctx);
    TEST_RUN(test_gemm_relu_epilogue);
    TEST_RUN(test_gemm_relu_without_product);
    TEST_RUN(test_activation_layer);
    TEST_RUN(test_layers_propagate_nan_weights);
    mpt_context_destroy(ctx);
    return test_summary("test_relu");
}

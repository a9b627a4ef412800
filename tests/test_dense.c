/* Dense, Flatten and Activation: gradients against finite differences in
   double, known answers, and bad input. Dense on samples of more than one
   axis (B, T, D), as Keras: its kernel applied to the last axis, the same
   bits as on the rows (B·T, D). GELU's tanh form against double. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;



typedef struct dense_ref {
    int64_t in, units;
    mpt_activation act;
    int bias;
} dense_ref;

static void dense_forward_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const dense_ref *d = (const dense_ref *)c->user;
    int64_t b, i, u;
    for (b = 0; b < c->batch; b++)
        for (u = 0; u < d->units; u++) {
            double z = d->bias ? params[1][u] : 0;
            for (i = 0; i < d->in; i++) z += x[b * d->in + i] * params[0][i * d->units + u];
            y[b * d->units + u] = ref_act(d->act, z);
        }
    if (d->act == MPT_ACT_SOFTMAX) ref_softmax_rows(y, c->batch, d->units);
}


static void check_dense(int64_t batch, int64_t in, int64_t units, mpt_activation act, int bias,
                        mpt_dtype dtype) {
    mpt_model *m = NULL;
    dense_ref d;
    char label[160];
    test__begin();
    d.in = in;
    d.units = units;
    d.act = act;
    d.bias = bias;
    snprintf(label, sizeof label, "dense B=%lld in=%lld units=%lld %s%s %s", (long long)batch,
             (long long)in, (long long)units, mpt_activation_name(act), bias ? "" : " no-bias",
             mpt_dtype_name(dtype));
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {in}, .input_rank = 1, .seed = 7},
                           &m) == MPT_OK, "create");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = units, .activation = act,
                                                   .no_bias = !bias, .dtype = dtype}) == MPT_OK,
          "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, batch + 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    gc_check(ctx, &(gc_case){.model = m, .batch = batch, .training = 1,
                             .ref_forward = dense_forward_ref, .user = &d}, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

static void test_dense_gradients(void) {
    static const mpt_activation acts[] = {MPT_ACT_NONE,    MPT_ACT_RELU, MPT_ACT_GELU,
                                          MPT_ACT_SIGMOID, MPT_ACT_TANH, MPT_ACT_SOFTMAX,
                                          MPT_ACT_GELU_TANH};
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int a, t, k;
    for (t = 0; t < 3; t++)
        for (a = 0; a < 7; a++) check_dense(3, 7, 5, acts[a], 1, dtypes[t]);
    /* random shapes, batch 1, sizes not multiples of 8 */
    for (k = 0; k < 6; k++)
        check_dense(k == 0 ? 1 : test_randint(1, 9), test_randint(1, 40), test_randint(1, 37),
                    acts[test_randint(0, 5)], k & 1, dtypes[k % 3]);
}

/* ---- Dense over the last axis of (B, T, D) and (B, H, W, D) ---------------- */

typedef struct dense3_ref {
    int64_t rows, in, units; /* rows per sample: the product of the middle axes */
    mpt_activation act;
} dense3_ref;

static void dense3_forward_ref(const gc_case *c, const double *x, double *const *params,
                               double *y) {
    const dense3_ref *d = (const dense3_ref *)c->user;
    int64_t r, i, u, rows = c->batch * d->rows;
    for (r = 0; r < rows; r++)
        for (u = 0; u < d->units; u++) {
            double z = params[1][u];
            for (i = 0; i < d->in; i++) z += x[r * d->in + i] * params[0][i * d->units + u];
            y[r * d->units + u] = ref_act(d->act, z);
        }
    if (d->act == MPT_ACT_SOFTMAX) ref_softmax_rows(y, rows, d->units);
}

/* x, kernel and bias gradients of a Dense on samples of shape `shape`
   (rank 2 or 3) under `policy`, against double. */
static void check_dense_ranked(int rank, const int64_t *shape, int64_t units, mpt_activation act,
                               mpt_policy policy) {
    static const char *policies[] = {"float32", "mixed_float16", "mixed_bfloat16"};
    mpt_model *m = NULL;
    mpt_model_desc md = {.input_rank = rank, .seed = 11, .policy = policy};
    dense3_ref d = {1, shape[rank - 1], units, act};
    int64_t out[MPT_MAX_RANK];
    char label[160];
    int k;
    test__begin();
    for (k = 0; k < rank; k++) md.input_shape[k] = shape[k];
    for (k = 0; k < rank - 1; k++) d.rows *= shape[k];
    snprintf(label, sizeof label, "dense rank %d rows/sample=%lld in=%lld units=%lld %s %s",
             rank + 1, (long long)d.rows, (long long)d.in, (long long)units,
             mpt_activation_name(act), policies[policy]);
    CHECK(mpt_model_create(ctx, &md, &m) == MPT_OK, "create");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = units, .activation = act,
                                                   .bias_initializer = MPT_INIT_GLOROT_UNIFORM}) ==
              MPT_OK, "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_layer_output_shape(m, 0, out) == rank && out[rank - 1] == units &&
              out[0] == shape[0],
          "output shape of %s", label);
    gc_check(ctx, &(gc_case){.model = m, .batch = 3, .training = 1,
                             .ref_forward = dense3_forward_ref, .user = &d}, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

static void test_dense_ranked_gradients(void) {
    static const mpt_activation acts[] = {MPT_ACT_NONE,    MPT_ACT_RELU, MPT_ACT_GELU,
                                          MPT_ACT_SIGMOID, MPT_ACT_TANH, MPT_ACT_SOFTMAX,
                                          MPT_ACT_GELU_TANH};
    static const int64_t seq[2] = {4, 6}, image[3] = {2, 3, 5};
    int a, p;
    for (p = 0; p < 3; p++)
        for (a = 0; a < 7; a++) check_dense_ranked(2, seq, 5, acts[a], (mpt_policy)p);
    for (a = 0; a < 7; a++) check_dense_ranked(3, image, 7, acts[a], MPT_POLICY_FLOAT32);
}

/* A pass through m on x (rank 1 + sample rank) with output gradient dy:
   the output, dx and every parameter gradient copied out as float32. */
static void dense_pass(mpt_model *m, int rank, const int64_t *xshape, const float *x,
                       const float *dy, float *y, float *dx, float *grads) {
    mpt_tensor tx, ty, tdy, tdx;
    mpt_param_info pi;
    int64_t n, off = 0;
    int k;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, rank, xshape, (void *)x);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    n = mpt_tensor_count(&ty);
    mpt_convert(ctx, MPT_FLOAT32, y, ty.dtype, ty.data, n);
    mpt_model_output_grad(m, &tdy);
    mpt_convert(ctx, tdy.dtype, tdy.data, MPT_FLOAT32, dy, n);
    CHECK(mpt_model_backward(m, NULL, &tdx) == MPT_OK, "backward: %s", mpt_context_error(ctx));
    mpt_convert(ctx, MPT_FLOAT32, dx, tdx.dtype, tdx.data, mpt_tensor_count(&tdx));
    for (k = 0; k < mpt_model_param_count(m); k++) {
        mpt_model_param(m, k, &pi);
        memcpy(grads + off, pi.grad.data, mpt_tensor_bytes(&pi.grad));
        off += mpt_tensor_count(&pi.grad);
    }
}

/* A model of one Dense on samples of rank `rank` (shape s), policy p,
   the weights of `like` copied in when given. */
static mpt_model *dense_model(mpt_context *c, int rank, const int64_t *s, mpt_activation act,
                              mpt_policy p, mpt_model *like) {
    mpt_model *m = NULL;
    mpt_model_desc md = {.input_rank = rank, .seed = 5, .policy = p};
    int k;
    for (k = 0; k < rank; k++) md.input_shape[k] = s[k];
    mpt_model_create(c, &md, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 11, .activation = act,
                                             .bias_initializer = MPT_INIT_GLOROT_UNIFORM});
    CHECK(mpt_model_build(m, 24) == MPT_OK, "build: %s", mpt_context_error(c));
    for (k = 0; like && k < mpt_model_param_count(m); k++) {
        mpt_param_info a, b;
        mpt_model_param(like, k, &a);
        mpt_model_param(m, k, &b);
        memcpy(b.value.data, a.value.data, mpt_tensor_bytes(&a.value));
    }
    if (like) mpt_model_refresh_weights(m);
    return m;
}

/* Dense on (B, T, D) is Dense on (B·T, D): the same output, dx and
   gradients, bit for bit, for each activation and policy; and a context of
   one thread gives the bits of one of two. */
static void test_dense_ranked_is_rows(void) {
    static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU,
                                          MPT_ACT_SOFTMAX, MPT_ACT_GELU_TANH};
    enum { B = 3, T = 7, D = 13, U = 11 };
    static float x[B * T * D], dy[B * T * U];
    static float y[2][B * T * U], dx[2][B * T * D], g[2][D * U + U];
    const int64_t seq[2] = {T, D}, vec[1] = {D}, xs3[3] = {B, T, D}, xs2[2] = {B * T, D};
    mpt_context *one = NULL;
    int a, p, k, i;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &one);
    for (i = 0; i < B * T * D; i++) x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < B * T * U; i++) dy[i] = (float)test_uniform(-1, 1);
    for (p = 0; p < 3; p++)
        for (a = 0; a < 5; a++) {
            mpt_model *m3 = dense_model(ctx, 2, seq, acts[a], (mpt_policy)p, NULL);
            mpt_model *m2 = dense_model(ctx, 1, vec, acts[a], (mpt_policy)p, m3);
            mpt_model *m1 = dense_model(one, 2, seq, acts[a], (mpt_policy)p, m3);
            dense_pass(m3, 3, xs3, x, dy, y[0], dx[0], g[0]);
            dense_pass(m2, 2, xs2, x, dy, y[1], dx[1], g[1]);
            for (k = 0; k < 2; k++) {
                CHECK(!memcmp(y[0], y[1], sizeof y[0]), "%s %d: y differs from the rows'",
                      mpt_activation_name(acts[a]), p);
                CHECK(!memcmp(dx[0], dx[1], sizeof dx[0]), "%s %d: dx differs from the rows'",
                      mpt_activation_name(acts[a]), p);
                CHECK(!memcmp(g[0], g[1], sizeof g[0]), "%s %d: gradients differ from the rows'",
                      mpt_activation_name(acts[a]), p);
                if (k == 0) dense_pass(m1, 3, xs3, x, dy, y[1], dx[1], g[1]); /* one thread */
            }
            mpt_model_destroy(m1);
            mpt_model_destroy(m2);
            mpt_model_destroy(m3);
        }
    mpt_context_destroy(one);
}

/* What reads a layer's shapes: the summary prints Keras' (None, T, units)
   and the kernel's in·units + units parameters; the profiler counts
   T·in·units multiply-adds a sample; memory plans per sample. */
static void test_dense_ranked_summary(void) {
    mpt_model *m = NULL;
    char text[4096];
    const mpt__layer *L;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6, 8}, .input_rank = 2}, &m) ==
              MPT_OK, "create");
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_GELU_TANH});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_summary(m, text, sizeof text);
    CHECK(strstr(text, "(None, 6, 16)") && strstr(text, "(None, 6, 5)") &&
              strstr(text, "144") && strstr(text, "85"),
          "summary:\n%s", text);
    L = &m->layers[0];
    CHECK(mpt__profile_macs(m, 0) == 6.0 * 8 * 16 && mpt__profile_macs(m, 1) == 6.0 * 16 * 5,
          "profiler's multiply-adds %g and %g, not 768 and 480", mpt__profile_macs(m, 0),
          mpt__profile_macs(m, 1));
    CHECK(L->n_saved == 1 && L->saved_bytes[0] >= 4 * 6 * 16 * 4,
          "GELU's z not planned for 6 positions: %lld bytes", (long long)L->saved_bytes[0]);
    mpt_model_destroy(m);
}

/* GELU's tanh form, mpt.h's float rule, against double over [-12, 12] and
   beyond; its derivative against the double formula and against central
   differences of the double function. */
static void test_gelu_tanh_rule(void) {
    const double k0 = sqrt(2 / 3.14159265358979323846);
    int64_t bad = 0, bad_fd = 0, i;
    double worst = 0;
    for (i = 0; i <= 24000; i++) {
        double x = -12 + i * 1e-3 + test_uniform(0, 1e-3), h = 1e-5;
        float xf = (float)x;
        double xd = xf, t = tanh(k0 * (xd + 0.044715 * xd * xd * xd));
        double ref = 0.5 * xd * (1 + t);
        double dref = 0.5 * (1 + t) + 0.5 * xd * (1 - t * t) * k0 * (1 + 3 * 0.044715 * xd * xd);
        double fd = (ref_act(MPT_ACT_GELU_TANH, xd + h) - ref_act(MPT_ACT_GELU_TANH, xd - h)) /
                    (2 * h);
        double e = fabs(mpt__gelu_tanh(xf) - ref) / (1 + fabs(xd));
        worst = e > worst ? e : worst;
        bad += e > 1e-6;
        bad += fabs(mpt__gelu_tanh_derivative(xf) - dref) > 1e-6 * (1 + fabs(xd));
        bad_fd += fabs(dref - fd) > 1e-7;
    }
    CHECK(bad == 0 && bad_fd == 0, "%lld values off double, %lld derivatives off the differences "
          "(worst value error %.3g)", (long long)bad, (long long)bad_fd, worst);
    CHECK(mpt__gelu_tanh(0.0f) == 0.0f && mpt__gelu_tanh(60.0f) == 60.0f &&
              mpt__gelu_tanh(-60.0f) == 0.0f && mpt__gelu_tanh(1e30f) == 1e30f,
          "the ends");
    CHECK(mpt__gelu_tanh_derivative(1e30f) == 1.0f && mpt__gelu_tanh_derivative(-1e30f) == 0.0f &&
              mpt__gelu_tanh_derivative(0.0f) == 0.5f,
          "the derivative's ends (no 0·inf): %g %g", mpt__gelu_tanh_derivative(1e30f),
          mpt__gelu_tanh_derivative(-1e30f));
    CHECK(isnan(mpt__gelu_tanh(NAN)) && isnan(mpt__gelu_tanh_derivative(NAN)), "NaN passes");
    CHECK(fabs(mpt__gelu_tanh(1.0f) - 0.8411920f) < 1e-6, "gelu_tanh(1) = %.8g (Keras 0.841192)",
          mpt__gelu_tanh(1.0f));
}

/* The AVX-512 GELU (mpt__gelu_avx512 and its derivative) against double
   erf over [-16, 16] (2^22 points) and the special values, with the bounds
   its comment states (measured: 1.19e-7, 1.32e-7, 5.0e-7); the scalar
   rule's error is measured alongside, for the message. The
   passes give the same bits whatever their split: a call on part of an
   array (odd offsets, masked tails) equals the whole call's elements, and
   the pool's 1 and 2 threads agree. */
#if MPT__X86
static double gelu_ref(double x) { return 0.5 * x * erfc(-x / sqrt(2.0)); }
static double gelu_derivative_ref(double x) {
    return 0.5 * erfc(-x / sqrt(2.0)) + x * exp(-0.5 * x * x) / sqrt(2 * 3.14159265358979323846);
}
#endif

static void test_gelu_vector(void) {
#if MPT__X86
    enum { N = (1 << 22) + 7, PART = 1000 + 5 };
    float *x = (float *)malloc(sizeof(float) * N), *y = (float *)malloc(sizeof(float) * N);
    float *d = (float *)malloc(sizeof(float) * N), *ones = (float *)malloc(sizeof(float) * N);
    float *part = (float *)malloc(sizeof(float) * N), *t2 = (float *)malloc(sizeof(float) * N);
    double worst = 0, worst_d = 0, worst_tail = 0, worst_scalar = 0, worst_scalar_d = 0;
    float at = 0, at_d = 0;
    int64_t i;
    mpt_context *two = NULL;
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) {
        free(x), free(y), free(d), free(ones), free(part), free(t2);
        SKIP("no AVX-512 on this CPU");
        return;
    }
    for (i = 0; i < N; i++) {
        x[i] = (float)(-16.0 + 32.0 * (double)i / (N - 1));
        ones[i] = 1.0f;
    }
    memcpy(y, x, sizeof(float) * N);
    mpt__gelu_forward_avx512(y, N);
    mpt__gelu_backward_avx512(MPT_FLOAT32, x, ones, d, N);
    for (i = 0; i < N; i++) {
        const double xd = x[i], g = gelu_ref(xd), gd = gelu_derivative_ref(xd);
        const double e = fabs(y[i] - g) / fmax(1.0, fabs(xd)), ed = fabs(d[i] - gd);
        const double es = fabs(mpt__gelu(x[i]) - g) / fmax(1.0, fabs(xd));
        const double esd = fabs(mpt__gelu_derivative(x[i]) - gd);
        if (e > worst) worst = e, at = x[i];
        if (xd < 0 && xd > -9 && fabs(y[i] - g) / fabs(g) > worst_tail)
            worst_tail = fabs(y[i] - g) / fabs(g);
        if (ed > worst_d) worst_d = ed, at_d = x[i];
        worst_scalar = es > worst_scalar ? es : worst_scalar;
        worst_scalar_d = esd > worst_scalar_d ? esd : worst_scalar_d;
    }
    CHECK(worst <= 1.5e-7 && worst_d <= 1.5e-7 && worst_tail <= 1e-6,
          "GELU off double by %.3g·max(1, |x|) at %.9g, its derivative by %.3g at %.9g, "
          "relative %.3g on (-9, 0) (the scalar rule: %.3g, %.3g)", worst, at, worst_d, at_d,
          worst_tail, worst_scalar, worst_scalar_d);
    /* the same bits for any split: parts at odd offsets, masked tails */
    for (i = 0; i < N; i += PART) {
        const int64_t n = N - i < PART ? N - i : PART;
        memcpy(part + i, x + i, sizeof(float) * (size_t)n);
        mpt__gelu_forward_avx512(part + i, n);
        mpt__gelu_backward_avx512(MPT_FLOAT32, x + i, ones + i, t2 + i, n);
    }
    CHECK(memcmp(part, y, sizeof(float) * N) == 0 && memcmp(t2, d, sizeof(float) * N) == 0,
          "a part's GELU differs from the whole's");
    /* the pool's passes: 1 and 2 threads */
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &two);
    if (two) {
        mpt_context *one = NULL;
        mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &one);
        memcpy(part, x, sizeof(float) * N);
        memcpy(t2, x, sizeof(float) * N);
        mpt__cpu_table.activation(two, MPT_ACT_GELU, part, N / 7, 7);
        if (one) mpt__cpu_table.activation(one, MPT_ACT_GELU, t2, N / 7, 7);
        CHECK(memcmp(part, y, sizeof(float) * (N / 7 * 7)) == 0 &&
                  memcmp(t2, y, sizeof(float) * (N / 7 * 7)) == 0,
              "the backend's GELU differs from the kernel's (1 or 2 threads)");
        mpt__cpu_table.activation_grad(two, MPT_ACT_GELU, MPT_FLOAT32, x, NULL, ones, part, t2,
                                       N / 7, 7);
        CHECK(memcmp(part, d, sizeof(float) * (N / 7 * 7)) == 0,
              "the backend's GELU gradient (2 threads) differs from the kernel's");
        mpt_context_destroy(one);
        mpt_context_destroy(two);
    }
    /* bfloat16 z and dy, widened in registers: the float32 pass on the
       widened values */
    {
        mpt_bf16 zh[PART], dyh[PART];
        float zf[PART], dyf[PART], a[PART], b[PART];
        for (i = 0; i < PART; i++) {
            zh[i] = mpt_float_to_bf16((float)test_uniform(-6, 6));
            dyh[i] = mpt_float_to_bf16((float)test_uniform(-2, 2));
            zf[i] = mpt_bf16_to_float(zh[i]);
            dyf[i] = mpt_bf16_to_float(dyh[i]);
        }
        mpt__gelu_backward_avx512(MPT_BFLOAT16, zh, dyh, a, PART);
        mpt__gelu_backward_avx512(MPT_FLOAT32, zf, dyf, b, PART);
        CHECK(memcmp(a, b, sizeof a) == 0, "bfloat16 inputs: not the widened values' result");
    }
    {
        float s[6] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-30f}, sd[6], o[6] = {1, 1, 1, 1, 1, 1};
        mpt__gelu_backward_avx512(MPT_FLOAT32, s, o, sd, 6);
        mpt__gelu_forward_avx512(s, 6);
        CHECK(isnan(s[0]) && s[1] == INFINITY && isnan(s[2]) && s[3] == 0.0f && s[4] == 0.0f &&
                  s[5] == 0.5e-30f,
              "special values: %g %g %g %g %g %g", s[0], s[1], s[2], s[3], s[4], s[5]);
        CHECK(isnan(sd[0]) && isnan(sd[1]) == isnan(mpt__gelu_derivative(INFINITY)) &&
                  isnan(sd[2]) == isnan(mpt__gelu_derivative(-INFINITY)) && sd[3] == 0.5f,
              "the derivative's special values as the scalar rule's: %g %g %g %g", sd[0], sd[1],
              sd[2], sd[3]);
    }
    free(x), free(y), free(d), free(ones), free(part), free(t2);
#else
    SKIP("no x86 SIMD in this build");
#endif
}

/* Flatten + Activation chained behind a Dense, so the input gradient of
   each is exercised. */
typedef struct chain_ref {
    int64_t h, w, ch, units;
    mpt_activation act;
} chain_ref;

static void chain_forward_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const chain_ref *d = (const chain_ref *)c->user;
    int64_t in = d->h * d->w * d->ch, b, i, u;
    for (b = 0; b < c->batch; b++)
        for (u = 0; u < d->units; u++) {
            double z = params[1][u];
            for (i = 0; i < in; i++) z += x[b * in + i] * params[0][i * d->units + u];
            y[b * d->units + u] = ref_act(d->act, z);
        }
    if (d->act == MPT_ACT_SOFTMAX) ref_softmax_rows(y, c->batch, d->units);
}

static void test_flatten_activation_gradients(void) {
    static const mpt_activation acts[] = {MPT_ACT_RELU,    MPT_ACT_GELU, MPT_ACT_SIGMOID,
                                          MPT_ACT_TANH,    MPT_ACT_SOFTMAX, MPT_ACT_NONE,
                                          MPT_ACT_GELU_TANH};
    int a;
    for (a = 0; a < 7; a++) {
        mpt_model *m = NULL;
        chain_ref d = {3, 2, 2, 5, acts[a]};
        test__begin();
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 2, 2}, .input_rank = 3}, &m);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 5});
        mpt_model_add_activation(m, &(mpt_activation_desc){.activation = acts[a]});
        CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
        gc_check(ctx, &(gc_case){.model = m, .batch = 4, .training = 1,
                                 .ref_forward = chain_forward_ref, .user = &d},
                 "flatten+dense+activation");
        mpt_model_destroy(m);
        test__end("gradcheck flatten -> dense -> activation(%s)", mpt_activation_name(acts[a]));
    }
}

/* A hand-computed case: x = [1, 2], kernel = [[1, -1, 0.5], [2, 0, -3]],
   bias = [0.5, 0, 1]: x·k + b = [5.5, -1, -4.5]; relu → [5.5, 0, 0]. */
static void test_dense_known_answer(void) {
    mpt_model *m = NULL;
    mpt_param_info k, b;
    float x[2] = {1, 2}, kv[6] = {1, -1, 0.5f, 2, 0, -3}, bv[3] = {0.5f, 0, 1};
    int64_t xs[2] = {1, 2};
    mpt_tensor tx, ty;
    float *y;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_RELU});
    CHECK(mpt_model_build(m, 1) == MPT_OK, "build");
    mpt_model_param(m, 0, &k);
    mpt_model_param(m, 1, &b);
    CHECK(strcmp(k.name, "dense/kernel") == 0 && strcmp(b.name, "dense/bias") == 0,
          "names %s %s", k.name, b.name);
    CHECK(k.value.rank == 2 && k.value.shape[0] == 2 && k.value.shape[1] == 3, "kernel shape");
    memcpy(k.value.data, kv, sizeof kv);
    memcpy(b.value.data, bv, sizeof bv);
    mpt_model_refresh_weights(m);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, xs, x);
    CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "forward");
    y = (float *)ty.data;
    CHECK(ty.rank == 2 && ty.shape[0] == 1 && ty.shape[1] == 3, "output shape");
    CHECK(y[0] == 5.5f && y[1] == 0 && y[2] == 0, "y = %g %g %g", y[0], y[1], y[2]);
    mpt_model_destroy(m);
}

/* Hand-computed activation values at a few points, through the Activation
   layer: relu, sigmoid(0) = 0.5, tanh(1), gelu(1) = Φ(1) = 0.8413447,
   softmax([0, ln 3]) = [0.25, 0.75]. */
static void test_activation_known_answers(void) {
    static const struct {
        mpt_activation act;
        float x[2], y[2];
    } cases[] = {
        {MPT_ACT_RELU, {-2.0f, 3.0f}, {0.0f, 3.0f}},
        {MPT_ACT_SIGMOID, {0.0f, 2.0f}, {0.5f, 0.88079708f}},
        {MPT_ACT_TANH, {1.0f, -0.5f}, {0.76159416f, -0.46211716f}},
        {MPT_ACT_GELU, {1.0f, -1.0f}, {0.84134475f, -0.15865525f}},
        {MPT_ACT_SOFTMAX, {0.0f, 1.0986123f}, {0.25f, 0.75f}},
        {MPT_ACT_NONE, {-7.0f, 7.0f}, {-7.0f, 7.0f}},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mpt_model *m = NULL;
        mpt_tensor tx, ty;
        float x[2];
        const float *y;
        memcpy(x, cases[i].x, sizeof x);
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2}, .input_rank = 1}, &m);
        mpt_model_add_activation(m, &(mpt_activation_desc){.activation = cases[i].act});
        CHECK(mpt_model_build(m, 1) == MPT_OK, "build");
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){1, 2}, x);
        CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "forward");
        y = (const float *)ty.data;
        CHECK(fabsf(y[0] - cases[i].y[0]) <= 1e-6f && fabsf(y[1] - cases[i].y[1]) <= 1e-6f,
              "%s(%g, %g) = (%.8g, %.8g), want (%.8g, %.8g)", mpt_activation_name(cases[i].act),
              x[0], x[1], y[0], y[1], cases[i].y[0], cases[i].y[1]);
        mpt_model_destroy(m);
    }
}

/* Without a request for the input gradient, backward stops at the first
   trainable layer; the parameter gradients are the same either way. */
static void test_backward_stops_early(void) {
    mpt_model *m = NULL;
    mpt_param_info k;
    mpt_tensor tx, out, dx;
    float x[3 * 12], *first;
    int i;
    for (i = 0; i < 36; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2, 3, 2}, .input_rank = 3}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_TANH});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(m, 3) == MPT_OK, "build");
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){3, 2, 3, 2}, x);
    mpt_model_param(m, 0, &k);
    first = (float *)malloc(sizeof(float) * 48);
    mpt_model_forward(m, &tx, 1, &out);
    for (i = 0; i < 6; i++) ((float *)out.data)[i] = (float)i - 2.5f; /* any dy */
    CHECK(mpt_model_backward(m, &out, &dx) == MPT_OK, "backward to the input");
    memcpy(first, k.grad.data, sizeof(float) * 48);
    memset(k.grad.data, 0, sizeof(float) * 48);
    mpt_model_forward(m, &tx, 1, &out);
    for (i = 0; i < 6; i++) ((float *)out.data)[i] = (float)i - 2.5f;
    CHECK(mpt_model_backward(m, &out, NULL) == MPT_OK, "backward");
    CHECK(memcmp(first, k.grad.data, sizeof(float) * 48) == 0, "kernel gradients differ");
    free(first);
    mpt_model_destroy(m);
}

/* A Flatten's gradient is its dy, the same memory (nothing copied): where
   Flatten computes in another dtype than the layer before it, dx still
   reaches that layer converted to its dtype. A float32 Flatten between a
   bfloat16 Conv2D and a float32 Dense (dx converted after the Flatten)
   against a bfloat16 one (converted after the Dense, as before): the same
   input and kernel gradients, bit for bit. */
static void flatten_between(mpt_dtype flatten_dtype, const float *x, const float *dy,
                            float *dinput, float *kgrad) {
    mpt_model *m = NULL;
    mpt_param_info k;
    mpt_tensor tx, out, ddy, dx;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 5, 2}, .input_rank = 3, .seed = 4},
                     &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_TANH,
                                               .dtype = MPT_BFLOAT16});
    mpt_model_add_flatten(m, &(mpt_flatten_desc){.dtype = flatten_dtype});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .dtype = MPT_FLOAT32});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){2, 3, 5, 2}, (void *)x);
    mpt_tensor_wrap(ctx, &ddy, MPT_FLOAT32, 2, (int64_t[]){2, 4}, (void *)dy);
    CHECK(mpt_model_forward(m, &tx, 1, &out) == MPT_OK, "forward");
    CHECK(mpt_model_backward(m, &ddy, &dx) == MPT_OK, "backward");
    CHECK(mpt_tensor_count(&dx) == 60, "dx has %lld elements", (long long)mpt_tensor_count(&dx));
    mpt_convert(ctx, MPT_FLOAT32, dinput, dx.dtype, dx.data, 60);
    mpt_model_param(m, 0, &k);
    memcpy(kgrad, k.grad.data, sizeof(float) * 24);
    mpt_model_destroy(m);
}

static void test_flatten_gradient_across_dtypes(void) {
    float x[60], dy[8], dx32[60], dx16[60], k32[24], k16[24];
    int i;
    double size = 0;
    for (i = 0; i < 60; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 8; i++) dy[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 60; i++) dx32[i] = dx16[i] = NAN;
    flatten_between(MPT_FLOAT32, x, dy, dx32, k32);
    flatten_between(MPT_BFLOAT16, x, dy, dx16, k16);
    for (i = 0; i < 60; i++) size += fabs(dx16[i]);
    CHECK(size > 0 && size == size, "dx is %g in all", size);
    CHECK(memcmp(dx32, dx16, sizeof dx32) == 0, "dx differs with a float32 Flatten");
    CHECK(memcmp(k32, k16, sizeof k32) == 0, "the kernel gradient differs with a float32 Flatten");
}

/* The vector ReLU gradient gives the scalar loop's bits, NaN and ±0 too. */
static void test_relu_gradient_paths_agree(void) {
    enum { N = 1000 + 7 };
    static float y[N], dy[N], fast[N], slow[N], tmp[N];
    mpt_context *plain;
    int i;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1, .disable_cpu_features = ~0}, &plain);
    for (i = 0; i < N; i++) {
        y[i] = (float)test_uniform(-1, 1);
        dy[i] = (float)test_uniform(-3, 3);
    }
    y[3] = 0.0f;
    y[4] = -0.0f;
    y[5] = NAN;
    y[6] = INFINITY;
    dy[7] = NAN;
    y[7] = 1.0f;
    mpt__activation_grad(ctx, MPT_ACT_RELU, MPT_FLOAT32, NULL, y, dy, fast, tmp, N, N);
    mpt__activation_grad(plain, MPT_ACT_RELU, MPT_FLOAT32, NULL, y, dy, slow, tmp, N, N);
    CHECK(memcmp(fast, slow, sizeof fast) == 0, "the ReLU gradient paths differ");
    CHECK(fast[5] == dy[5] && fast[3] == 0 && fast[4] == 0 && fast[6] == dy[6] && isnan(fast[7]),
          "special values");
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) SKIP("no AVX-512 on this CPU");
    mpt_context_destroy(plain);
}

/* Keras' glorot_uniform bound and zeros for the bias; he_normal's spread. */
static void test_initializers(void) {
    mpt_model *m = NULL;
    mpt_param_info k, b, h;
    int64_t i, n;
    double limit = sqrt(6.0 / (300 + 200)), mx = 0, sum = 0, sq = 0;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {300}, .input_rank = 1, .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 200});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 400, .kernel_initializer = MPT_INIT_HE_NORMAL,
                                             .bias_initializer = MPT_INIT_ONES});
    CHECK(mpt_model_build(m, 1) == MPT_OK, "build");
    mpt_model_param(m, 0, &k);
    mpt_model_param(m, 1, &b);
    mpt_model_param(m, 2, &h);
    n = mpt_tensor_count(&k.value);
    for (i = 0; i < n; i++) {
        double v = ((float *)k.value.data)[i];
        mx = fabs(v) > mx ? fabs(v) : mx;
        sum += v;
        sq += v * v;
    }
    CHECK(mx <= limit && mx > 0.99 * limit, "glorot max %g, limit %g", mx, limit);
    CHECK(fabs(sq / n - limit * limit / 3) < 0.02 * limit * limit, "glorot variance %g", sq / n);
    for (i = 0; i < 200; i++) CHECK(((float *)b.value.data)[i] == 0, "bias not zero");
    n = mpt_tensor_count(&h.value);
    sum = sq = mx = 0;
    for (i = 0; i < n; i++) {
        double v = ((float *)h.value.data)[i];
        sum += v;
        sq += v * v;
        mx = fabs(v) > mx ? fabs(v) : mx;
    }
    /* Truncated at 2 stddev of the underlying normal: |v| ≤ 2·sqrt(2/200)/0.8796. */
    CHECK(fabs(sq / n - 2.0 / 200) < 0.05 * 2.0 / 200, "he_normal variance %g want %g", sq / n,
          2.0 / 200);
    CHECK(mx <= 2 * sqrt(2.0 / 200) / 0.87962566103423978 + 1e-6, "he_normal max %g", mx);
    CHECK(fabs(sum / n) < 0.01, "he_normal mean %g", sum / n);
    mpt_model_destroy(m);
}

/* The same seed gives the same weights; another seed other weights. */
static void test_seeded_init(void) {
    float first[4], again[4], other[4];
    uint64_t seeds[3] = {11, 11, 12};
    float *dst[3] = {first, again, other};
    int s;
    for (s = 0; s < 3; s++) {
        mpt_model *m = NULL;
        mpt_param_info k;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2}, .input_rank = 1,
                                                .seed = seeds[s]}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
        mpt_model_build(m, 1);
        mpt_model_param(m, 0, &k);
        memcpy(dst[s], k.value.data, sizeof first);
        mpt_model_destroy(m);
    }
    CHECK(memcmp(first, again, sizeof first) == 0, "same seed, different weights");
    CHECK(memcmp(first, other, sizeof first) != 0, "different seeds, same weights");
}


static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    mpt_tensor t, out;
    int64_t shape[2] = {3, 5}, shape3[MPT_MAX_RANK];
    float data[15] = {0};
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_rank = 0}, &m) == MPT_ERR_INVALID_ARGUMENT,
          "input_rank 0 accepted");
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, -1}, .input_rank = 2}, &m) ==
              MPT_ERR_SHAPE, "negative input dim accepted");
    CHECK(strstr(mpt_context_error(q), "(4, -1)") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_create(q, NULL, &m) == MPT_ERR_INVALID_ARGUMENT, "NULL desc accepted");
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1,
                                                .policy = (mpt_policy)9}, &m) ==
              MPT_ERR_INVALID_ARGUMENT, "unknown policy accepted");

    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 4, 2}, .input_rank = 3}, &m);
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 0}) == MPT_ERR_INVALID_ARGUMENT,
          "units 0 accepted");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = (mpt_activation)42}) ==
              MPT_ERR_INVALID_ARGUMENT, "unknown activation accepted");
    CHECK(strstr(mpt_context_error(q), "42") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .dtype = MPT_INT32}) ==
              MPT_ERR_DTYPE, "int32 compute dtype accepted");
    CHECK(mpt_model_add_dense(m, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL desc accepted");
    CHECK(mpt_model_add_activation(m, &(mpt_activation_desc){.activation = (mpt_activation)-1}) ==
              MPT_ERR_INVALID_ARGUMENT, "activation -1 accepted");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .name = "a/b"}) ==
              MPT_ERR_INVALID_ARGUMENT, "name with / accepted");
    CHECK(mpt_model_build(m, 4) == MPT_ERR_STATE, "built with no layers");
    /* Dense straight after an image input applies to its last axis, as
       Keras': (4, 4, 2) -> (4, 4, 3). */
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .name = "head"}) == MPT_OK, "add");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .name = "head"}) ==
              MPT_ERR_INVALID_ARGUMENT, "duplicate name accepted");
    CHECK(mpt_model_build(m, 4) == MPT_OK, "Dense on a 3-D sample: %s", mpt_context_error(q));
    CHECK(mpt_model_layer_output_shape(m, 0, shape3) == 3 && shape3[0] == 4 && shape3[1] == 4 &&
              shape3[2] == 3,
          "output (None, 4, 4, 3)");
    mpt_model_destroy(m);

    mpt_model_create(q, &(mpt_model_desc){.input_shape = {5}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_forward(m, NULL, 0, &out) == MPT_ERR_STATE, "forward before build");
    CHECK(mpt_model_build(m, 0) == MPT_ERR_INVALID_ARGUMENT, "max_batch 0 accepted");
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build");
    CHECK(mpt_model_build(m, 2) == MPT_ERR_STATE, "built twice");
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2}) == MPT_ERR_STATE, "add after build");
    CHECK(mpt_model_backward(m, NULL, NULL) == MPT_ERR_STATE, "backward before forward");
    mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, shape, data);
    CHECK(mpt_model_forward(m, &t, 1, &out) == MPT_ERR_SHAPE, "batch 3 > max_batch 2 accepted");
    shape[0] = 2;
    shape[1] = 4;
    mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, shape, data);
    CHECK(mpt_model_forward(m, &t, 1, &out) == MPT_ERR_SHAPE, "4 features for 5 accepted");
    CHECK(strstr(mpt_context_error(q), "(2, 4)") && strstr(mpt_context_error(q), "5"),
          "message: %s", mpt_context_error(q));
    shape[1] = 5;
    mpt_tensor_wrap(q, &t, MPT_INT32, 2, shape, data);
    CHECK(mpt_model_forward(m, &t, 1, &out) == MPT_ERR_DTYPE, "int32 input accepted");
    mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, shape, data);
    CHECK(mpt_model_forward(m, &t, 0, &out) == MPT_OK, "forward");
    CHECK(mpt_model_backward(m, NULL, NULL) == MPT_ERR_STATE, "backward after inference forward");
    CHECK(mpt_model_param(m, 99, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL info accepted");
    mpt_model_destroy(m);

    {   /* tensors */
        int64_t bad[2] = {INT64_MAX / 2, 4};
        int64_t neg[2] = {2, 0};
        CHECK(mpt_tensor_alloc(q, &t, MPT_FLOAT32, 2, bad) == MPT_ERR_OVERFLOW, "overflow accepted");
        CHECK(mpt_tensor_alloc(q, &t, MPT_FLOAT32, 2, neg) == MPT_ERR_SHAPE, "zero dim accepted");
        CHECK(mpt_tensor_alloc(q, &t, (mpt_dtype)99, 2, shape) == MPT_ERR_INVALID_ARGUMENT,
              "dtype 99 accepted");
        CHECK(mpt_tensor_alloc(q, &t, MPT_FLOAT32, 5, shape) == MPT_ERR_INVALID_ARGUMENT,
              "rank 5 accepted");
        CHECK(mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, shape, NULL) == MPT_ERR_INVALID_ARGUMENT,
              "NULL data accepted");
        CHECK(mpt_tensor_alloc(q, &t, MPT_UINT8, 2, shape) == MPT_OK, "alloc");
        CHECK(t.owns_data && mpt_tensor_bytes(&t) == 10, "bytes %zu", mpt_tensor_bytes(&t));
        mpt_tensor_free(q, &t);
    }
    CHECK(count_errors > 10, "errors were not all logged (%d)", count_errors);
    mpt_context_destroy(q);
}

/* Mixed dtypes in one model: a float16 Dense feeding a float32 one, the
   casts between them in both directions. */
/* A GELU Dense's training forward in one pass (the CPU backend's
   activation_keep_z: z and act(z) rounded from the float32 product)
   gives the bits of the three passes it replaces, convert, activation in
   place, convert: both GELUs, every float dtype (float32 with y in place
   of x, as Dense calls it), lengths that end inside a block, on one, and
   past the pool's chunks (on 2 threads). */
static void test_gelu_keep_z(void) {
    static const int64_t ns[] = {1, 17, 2048, 2049, (int64_t)3 << 16 | 5};
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const mpt_activation acts[] = {MPT_ACT_GELU, MPT_ACT_GELU_TANH};
    const mpt_backend *be = mpt__cpu_backend();
    int ni, di, ai, bad = 0, cases = 0;
    CHECK(be->activation_keep_z != NULL, "the CPU backend has no activation_keep_z");
    for (ni = 0; be->activation_keep_z && ni < 5; ni++)
        for (di = 0; di < 3; di++)
            for (ai = 0; ai < 2; ai++) {
                const int64_t n = ns[ni];
                const size_t es = mpt_dtype_size(dts[di]);
                float *x = (float *)malloc(sizeof(float) * (size_t)n);
                float *acc = (float *)malloc(sizeof(float) * (size_t)n);
                char *z0 = (char *)malloc(es * (size_t)n), *y0 = (char *)malloc(es * (size_t)n);
                char *z1 = (char *)malloc(es * (size_t)n), *y1 = (char *)malloc(es * (size_t)n);
                int64_t i;
                for (i = 0; i < n; i++) x[i] = (float)test_uniform(-6, 6);
                /* the three passes */
                memcpy(acc, x, sizeof(float) * (size_t)n);
                be->convert(ctx, dts[di], z0, MPT_FLOAT32, acc, n);
                be->activation(ctx, acts[ai], acc, 1, n);
                be->convert(ctx, dts[di], y0, MPT_FLOAT32, acc, n);
                /* the one */
                memcpy(acc, x, sizeof(float) * (size_t)n);
                be->activation_keep_z(ctx, acts[ai], dts[di], acc, z1,
                                      dts[di] == MPT_FLOAT32 ? (void *)acc : (void *)y1, n);
                if (dts[di] == MPT_FLOAT32) memcpy(y1, acc, sizeof(float) * (size_t)n);
                if ((memcmp(z0, z1, es * (size_t)n) || memcmp(y0, y1, es * (size_t)n)) &&
                    bad++ == 0)
                    CHECK(0, "%s over %lld %s: z %s, y %s", mpt_activation_name(acts[ai]),
                          (long long)n, mpt_dtype_name(dts[di]),
                          memcmp(z0, z1, es * (size_t)n) ? "differs" : "the same",
                          memcmp(y0, y1, es * (size_t)n) ? "differs" : "the same");
                cases++;
                free(x), free(acc), free(z0), free(y0), free(z1), free(y1);
            }
    CHECK(bad == 0, "%d of %d cases differ from the three passes", bad, cases);
}

static void test_mixed_chain(void) {
    mpt_model *m = NULL;
    chain_ref d = {1, 1, 6, 4, MPT_ACT_NONE};
    (void)d;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .dtype = MPT_FLOAT32});
    CHECK(mpt_model_build(m, 3) == MPT_OK, "build");
    CHECK(mpt_model_layer_dtype(m, 0) == MPT_FLOAT32, "override ignored");
    mpt_model_destroy(m);
    {
        dense_ref dr = {6, 4, MPT_ACT_TANH, 1};
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                                .policy = MPT_POLICY_MIXED_BFLOAT16}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_TANH});
        CHECK(mpt_model_build(m, 3) == MPT_OK, "build");
        CHECK(mpt_model_layer_dtype(m, 0) == MPT_BFLOAT16, "policy ignored");
        gc_check(ctx, &(gc_case){.model = m, .batch = 3, .training = 1,
                                 .ref_forward = dense_forward_ref, .user = &dr},
                 "mixed_bfloat16 dense");
        mpt_model_destroy(m);
    }
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    test_seed(2);
    TEST_RUN(test_dense_known_answer);
    TEST_RUN(test_activation_known_answers);
    TEST_RUN(test_backward_stops_early);
    TEST_RUN(test_flatten_gradient_across_dtypes);
    TEST_RUN(test_relu_gradient_paths_agree);
    test_dense_gradients();
    test_flatten_activation_gradients();
    test_dense_ranked_gradients();
    TEST_RUN(test_dense_ranked_is_rows);
    TEST_RUN(test_dense_ranked_summary);
    TEST_RUN(test_gelu_tanh_rule);
    TEST_RUN(test_gelu_vector);
    TEST_RUN(test_gelu_keep_z);
    TEST_RUN(test_initializers);
    TEST_RUN(test_seeded_init);
    TEST_RUN(test_mixed_chain);
    TEST_RUN(test_bad_input);
    mpt_context_destroy(ctx);
    return test_summary("test_dense");
}

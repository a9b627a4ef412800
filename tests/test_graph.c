/* Models as graphs (the functional form): gradients of residual
   connections, fan-out and every merge layer against finite differences
   in double precision, in the three policies and across dtype boundaries;
   training that repeats bit for bit on 1 and 2 threads; and the errors of
   the functional calls and of build. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"
#include "blobs.h"

static mpt_context *ctx;
static char tmpdir[512];

static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                      MPT_POLICY_MIXED_BFLOAT16};

static mpt_model *new_model(int64_t features, mpt_policy policy) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(
              ctx,
              &(mpt_model_desc){
                  .input_shape = {features}, .input_rank = 1, .policy = policy, .seed = 7},
              &m) == MPT_OK,
          "create: %s", mpt_context_error(ctx));
    return m;
}

/* ---- a residual block: y = Dense(Add(tanh(Dense(x)), x)) --------------------- */

enum { RES_F = 6, RES_OUT = 3 };

static void residual_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    int64_t b, i;
    for (b = 0; b < c->batch; b++) {
        double h[RES_F];
        ref_dense_sample(x + b * RES_F, p[0], p[1], RES_F, RES_F, h);
        for (i = 0; i < RES_F; i++) h[i] = tanh(h[i]) + x[b * RES_F + i];
        ref_dense_sample(h, p[2], p[3], RES_F, RES_OUT, y + b * RES_OUT);
    }
}

static void test_residual_gradients(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = new_model(RES_F, policies[k]);
        mpt_node x = mpt_model_input(m), both[2];
        char label[96];
        test__begin();
        both[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = RES_F, .activation = MPT_ACT_TANH});
        both[1] = x;
        mpt_dense(m, mpt_add(m, 2, both, NULL), &(mpt_dense_desc){.units = RES_OUT});
        CHECK(mpt_model_build(m, 9) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "residual %s", mpt_policy_name(policies[k]));
        gc_check(ctx,
                 &(gc_case){.model = m, .batch = 7, .training = 1, .ref_forward = residual_ref},
                 label);
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* ---- every merge: y = merge(Dense_0(x), Dense_1(x), ...), some inputs x itself ------ */

enum { MERGE_F = 5 };

typedef struct merge_ref {
    int kind;      /* 0 add, 1 subtract, 2 multiply, 3 average */
    int n;         /* inputs                                   */
    int source[4]; /* each input: the Dense of that index, or -1 for x */
    int dense_count;
} merge_ref;

static void merge_forward_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    const merge_ref *d = (const merge_ref *)c->user;
    int64_t b, i;
    int s;
    for (b = 0; b < c->batch; b++) {
        double in[4][MERGE_F];
        const double *xb = x + b * MERGE_F;
        for (s = 0; s < d->n; s++) {
            if (d->source[s] < 0)
                memcpy(in[s], xb, sizeof in[s]);
            else
                ref_dense_sample(xb, p[2 * d->source[s]], p[2 * d->source[s] + 1], MERGE_F, MERGE_F,
                          in[s]);
        }
        for (i = 0; i < MERGE_F; i++) {
            double v = in[0][i];
            for (s = 1; s < d->n; s++)
                v = d->kind == 1 ? v - in[s][i] : d->kind == 2 ? v * in[s][i] : v + in[s][i];
            y[b * MERGE_F + i] = d->kind == 3 ? v / d->n : v;
        }
    }
}

static void check_merge(const merge_ref *d, mpt_policy policy) {
    static const char *const names[] = {"Add", "Subtract", "Multiply", "Average"};
    mpt_model *m = new_model(MERGE_F, policy);
    mpt_node x = mpt_model_input(m), dense[4], in[4];
    char label[128];
    int s;
    test__begin();
    for (s = 0; s < d->dense_count; s++)
        dense[s] = mpt_dense(m, x, &(mpt_dense_desc){.units = MERGE_F});
    for (s = 0; s < d->n; s++) in[s] = d->source[s] < 0 ? x : dense[d->source[s]];
    switch (d->kind) {
    case 0:
        mpt_add(m, d->n, in, NULL);
        break;
    case 1:
        mpt_subtract(m, d->n, in, NULL);
        break;
    case 2:
        mpt_multiply(m, d->n, in, NULL);
        break;
    default:
        mpt_average(m, d->n, in, NULL);
        break;
    }
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    snprintf(label, sizeof label, "%s of %d inputs (sources %d %d %d %d) %s", names[d->kind], d->n,
             d->source[0], d->source[1], d->n > 2 ? d->source[2] : 9, d->n > 3 ? d->source[3] : 9,
             mpt_policy_name(policy));
    gc_check(ctx,
             &(gc_case){.model = m,
                        .batch = 6,
                        .training = 1,
                        .ref_forward = merge_forward_ref,
                        .user = (void *)d},
             label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

static void test_merge_gradients(void) {
    static const merge_ref cases[] = {
        {0, 2, {0, 1}, 2},  {0, 3, {0, -1, 1}, 2}, {0, 2, {0, 0}, 1},     {1, 2, {0, 1}, 2},
        {1, 2, {-1, 0}, 1}, {2, 2, {0, 1}, 2},     {2, 3, {0, -1, 1}, 2}, {2, 4, {0, 1, 2, 0}, 3},
        {2, 2, {0, 0}, 1},  {3, 2, {0, 1}, 2},     {3, 3, {1, 0, -1}, 2},
    };
    size_t c;
    int k;
    for (c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (k = 0; k < 3; k++) check_merge(&cases[c], policies[k]);
}

/* The backend's elementwise pass (the merges' arithmetic and the sums of a
   node's gradients) with AVX-512 gives the portable loop's bits: every
   op, every float dtype, n over several tasks with a tail (3 · 2^14 + 21)
   and below one vector (7), 1 and 2 threads, special values among the
   operands (NaN, ±inf, ±0, a subnormal, sums that overflow float16). */
static void test_elementwise_simd_matches_portable(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, 60000.0f};
    static const int64_t sizes[] = {3 * (1 << 14) + 21, 7};
    const int64_t most = sizes[0];
    float *a = (float *)malloc(sizeof(float) * (size_t)most);
    float *b = (float *)malloc(sizeof(float) * (size_t)most);
    unsigned char *in = (unsigned char *)malloc(8 * (size_t)most);
    unsigned char *out[2];
    int d, op, z, t, k, ran = 0;
    int64_t i;
    out[0] = (unsigned char *)malloc(4 * (size_t)most);
    out[1] = (unsigned char *)malloc(4 * (size_t)most);
    for (i = 0; i < most; i++) {
        a[i] = (float)test_uniform(-3, 3);
        b[i] = (float)test_uniform(-3, 3);
    }
    for (k = 0; k < 7; k++) { /* each special against each, at the start and the end */
        for (t = 0; t < 7; t++) {
            a[k * 7 + t] = a[most - 1 - k * 7 - t] = specials[k];
            b[k * 7 + t] = b[most - 1 - k * 7 - t] = specials[t];
        }
    }
    for (t = 1; t <= 2; t++) {
        mpt_context *portable = path_ctx(t, ~0), *simd = path_ctx(3 - t, 0);
        void *pi, *si;
        const mpt_backend *pb = portable ? mpt_context_backend(portable, &pi) : NULL;
        const mpt_backend *sb = simd ? mpt_context_backend(simd, &si) : NULL;
        if (!pb || !sb || !(mpt_context_cpu_features(simd) & MPT_CPU_AVX512)) {
            mpt_context_destroy(portable);
            mpt_context_destroy(simd);
            continue;
        }
        ran++;
        for (d = 0; d < 3; d++)
            for (z = 0; z < 2; z++)
                for (op = MPT_ELEMENTWISE_ADD; op <= MPT_ELEMENTWISE_NEGATE; op++) {
                    const int64_t n = sizes[z];
                    const size_t es = mpt_dtype_size(dtypes[d]);
                    unsigned char *ia = in, *ib = in + 4 * (size_t)most;
                    mpt_convert(simd, dtypes[d], ia, MPT_FLOAT32, a, n);
                    mpt_convert(simd, dtypes[d], ib, MPT_FLOAT32, b, n);
                    pb->elementwise(pi, (mpt_elementwise_op)op, dtypes[d], out[0], ia, ib, 3.0f,
                                    n);
                    sb->elementwise(si, (mpt_elementwise_op)op, dtypes[d], out[1], ia, ib, 3.0f,
                                    n);
                    for (i = 0; i < n; i++)
                        if (memcmp(out[0] + i * es, out[1] + i * es, es) != 0) break;
                    CHECK(i == n, "%s op %d n %lld: element %lld differs from the portable loop's",
                          mpt_dtype_name(dtypes[d]), op, (long long)n, (long long)i);
                    /* in place, as a node's gradient sum runs (y is a) */
                    memcpy(out[0], ia, (size_t)n * es);
                    sb->elementwise(si, (mpt_elementwise_op)op, dtypes[d], out[0], out[0], ib,
                                    3.0f, n);
                    CHECK(memcmp(out[0], out[1], (size_t)n * es) == 0,
                          "%s op %d n %lld: in place differs", mpt_dtype_name(dtypes[d]), op,
                          (long long)n);
                }
        mpt_context_destroy(portable);
        mpt_context_destroy(simd);
    }
    free(a), free(b), free(in), free(out[0]), free(out[1]);
    if (!ran) SKIP("this CPU has no AVX-512");
}

/* ---- fan-out across dtypes: h feeds two Dense layers of other dtypes ---------------- */

typedef struct fan_ref {
    int64_t f;
} fan_ref;

/* h = relu(x W0 + b0); y = (h W1 + b1) + (h W2 + b2), then a Dense. */
static void fan_out_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    const int64_t F = 4;
    int64_t b, i;
    (void)c;
    for (b = 0; b < c->batch; b++) {
        double h[4], u[4], v[4];
        ref_dense_sample(x + b * F, p[0], p[1], F, F, h);
        for (i = 0; i < F; i++) h[i] = h[i] > 0 ? h[i] : 0;
        ref_dense_sample(h, p[2], p[3], F, F, u);
        ref_dense_sample(h, p[4], p[5], F, F, v);
        for (i = 0; i < F; i++) u[i] += v[i];
        ref_dense_sample(u, p[6], p[7], F, 2, y + b * 2);
    }
}

/* dtypes[k]: the compute dtype given to each of the two branches, so that
   the gradient of h (float16) arrives converted first, added second, or
   both. */
static void test_fan_out_across_dtypes(void) {
    static const mpt_dtype branch[3][2] = {{MPT_FLOAT32, MPT_DTYPE_DEFAULT},
                                           {MPT_DTYPE_DEFAULT, MPT_FLOAT32},
                                           {MPT_FLOAT32, MPT_BFLOAT16}};
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = new_model(4, MPT_POLICY_MIXED_FLOAT16);
        mpt_node x = mpt_model_input(m), h, sum[2];
        char label[96];
        test__begin();
        h = mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_RELU});
        sum[0] = mpt_dense(m, h, &(mpt_dense_desc){.units = 4, .dtype = branch[k][0]});
        sum[1] = mpt_dense(m, h, &(mpt_dense_desc){.units = 4, .dtype = branch[k][1]});
        mpt_dense(m, mpt_add(m, 2, sum, NULL), &(mpt_dense_desc){.units = 2});
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "fan-out, branches %s and %s",
                 branch[k][0] ? mpt_dtype_name(branch[k][0]) : "float16 (the policy's)",
                 branch[k][1] ? mpt_dtype_name(branch[k][1]) : "float16 (the policy's)");
        gc_check(ctx,
                 &(gc_case){.model = m,
                            .batch = 5,
                            .training = 1,
                            .ref_forward = fan_out_ref,
                            .x_lo = 0.1,
                            .x_hi = 1},
                 label);
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* ---- a shared layer: y = A(x) + A(relu(B(x))), A one Dense called twice ------------- */

static void shared_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    const int64_t F = 4;
    int64_t b, i;
    for (b = 0; b < c->batch; b++) {
        double a1[4], h[4], a2[4];
        ref_dense_sample(x + b * F, p[0], p[1], F, F, a1);
        ref_dense_sample(x + b * F, p[2], p[3], F, F, h);
        for (i = 0; i < F; i++) h[i] = h[i] > 0 ? h[i] : 0;
        ref_dense_sample(h, p[0], p[1], F, F, a2);
        for (i = 0; i < F; i++) y[b * F + i] = tanh(a1[i]) + tanh(a2[i]);
    }
}

static void test_shared_layer_gradients(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = new_model(4, policies[k]);
        mpt_node x = mpt_model_input(m), h, two[2];
        char label[96], text[4096], want[192];
        test__begin();
        two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_TANH,
                                                   .name = "shared"});
        h = mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_RELU});
        two[1] = mpt_apply_layer(m, "shared", 1, &h);
        mpt_add(m, 2, two, NULL);
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        CHECK(mpt_model_param_count(m) == 4, "%d parameters (the shared layer's once)",
              mpt_model_param_count(m));
        mpt_model_summary(m, text, sizeof text);
        /* one row for the shared layer, every call's input in it, as Keras */
        snprintf(want, sizeof want, "shared[0][0],\n%94sshared[1][0]\n", "");
        CHECK(strstr(text, want) && strstr(text, "Total params: 40 "), "summary:\n%s", text);
        snprintf(want, sizeof want, " input[0][0],\n%94sdense[0][0]\n", "");
        CHECK(strstr(text, want) && strstr(text, "shared (Dense)") &&
                  !strstr(strstr(text, "shared (Dense)") + 1, "shared (Dense)"),
              "the shared layer's row:\n%s", text);
        snprintf(label, sizeof label, "shared Dense %s", mpt_policy_name(policies[k]));
        gc_check(ctx,
                 &(gc_case){.model = m, .batch = 6, .training = 1, .ref_forward = shared_ref},
                 label);
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* A shared layer whose first call's output leads nowhere, as Keras allows:
   y = A(relu(B(x))); A(x) is computed but gives A's weights no gradient. */
static void unused_first_call_ref(const gc_case *c, const double *x, double *const *p,
                                  double *y) {
    const int64_t F = 4;
    int64_t b, i;
    for (b = 0; b < c->batch; b++) {
        double h[4];
        ref_dense_sample(x + b * F, p[2], p[3], F, F, h);
        for (i = 0; i < F; i++) h[i] = h[i] > 0 ? h[i] : 0;
        ref_dense_sample(h, p[0], p[1], F, F, y + b * F);
        for (i = 0; i < F; i++) y[b * F + i] = tanh(y[b * F + i]);
    }
}

static void test_shared_layer_first_call_unused(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = new_model(4, policies[k]);
        mpt_node x = mpt_model_input(m), h;
        char label[96];
        test__begin();
        mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_TANH, .name = "a"});
        h = mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_RELU});
        mpt_apply_layer(m, "a", 1, &h);
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "shared Dense, first call unused, %s",
                 mpt_policy_name(policies[k]));
        gc_check(ctx,
                 &(gc_case){.model = m, .batch = 5, .training = 1,
                            .ref_forward = unused_first_call_ref},
                 label);
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* A shared call's inputs must fit its weights, and it must name a layer. */
static void test_shared_layer_errors(void) {
    mpt_model *m = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node x = mpt_model_input(m), wide, two[2];
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 3, .name = "d"});
    wide = mpt_dense(m, x, &(mpt_dense_desc){.units = 6});
    two[1] = mpt_apply_layer(m, "d", 1, &wide);
    mpt_add(m, 2, two, NULL);
    test_expect_error(ctx, mpt_model_build(m, 2), MPT_ERR_SHAPE,
                      "Dense 'd' applied again (layer 2) to input (6,) needs a kernel of (6, 3), "
                      "but its weights are (4, 3)",
                      "shared Dense on a wider input");
    mpt_model_destroy(m);
    m = new_model(4, MPT_POLICY_FLOAT32);
    x = mpt_model_input(m);
    CHECK(mpt_apply_layer(m, "nothing", 1, &x) == MPT_NODE_FAILED, "no such layer");
    test_expect_error(ctx, MPT_ERR_INVALID_ARGUMENT, MPT_ERR_INVALID_ARGUMENT,
                      "apply_layer: the model has no layer named \"nothing\"", "no such layer");
    mpt_model_destroy(m);
}

/* ---- Concatenate and ZeroPadding2D on images: y = Concatenate(x, pad(x)) ----------- */

enum { IMG_H = 2, IMG_W = 3, IMG_C = 2 };

typedef struct concat_ref {
    int axis;          /* 1..3 as Keras counts (the batch is 0)          */
    int64_t pad[2][2]; /* of the second input; all 0: it is x itself    */
} concat_ref;

static void pad_ref(const double *x, const concat_ref *d, double *y) {
    const int64_t(*pad)[2] = d->pad;
    int64_t H = IMG_H + pad[0][0] + pad[0][1], W = IMG_W + pad[1][0] + pad[1][1], h, w, c;
    for (h = 0; h < H; h++)
        for (w = 0; w < W; w++)
            for (c = 0; c < IMG_C; c++) {
                int64_t sh = h - pad[0][0], sw = w - pad[1][0];
                y[(h * W + w) * IMG_C + c] = sh >= 0 && sh < IMG_H && sw >= 0 && sw < IMG_W
                                                 ? x[(sh * IMG_W + sw) * IMG_C + c]
                                                 : 0;
            }
}

/* Both inputs as (outer, inner_s), their rows side by side. */
static void concat_forward_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    const concat_ref *d = (const concat_ref *)c->user;
    int64_t shape[2][3] = {
        {IMG_H, IMG_W, IMG_C},
        {IMG_H + d->pad[0][0] + d->pad[0][1], IMG_W + d->pad[1][0] + d->pad[1][1], IMG_C}};
    int64_t outer = 1, inner[2] = {1, 1}, b, o, k, at = 0;
    double second[64];
    int i;
    (void)p;
    for (i = 0; i < d->axis - 1; i++) outer *= shape[0][i];
    for (i = d->axis - 1; i < 3; i++) inner[0] *= shape[0][i], inner[1] *= shape[1][i];
    for (b = 0; b < c->batch; b++) {
        const double *xb = x + b * IMG_H * IMG_W * IMG_C;
        pad_ref(xb, d, second);
        for (o = 0; o < outer; o++) {
            for (k = 0; k < inner[0]; k++) y[at++] = xb[o * inner[0] + k];
            for (k = 0; k < inner[1]; k++) y[at++] = second[o * inner[1] + k];
        }
    }
}

static void test_concatenate_gradients(void) {
    static const concat_ref cases[] = {
        {3, {{0, 0}, {0, 0}}}, {1, {{0, 1}, {0, 0}}}, {2, {{0, 0}, {2, 1}}}, {1, {{2, 2}, {0, 0}}}};
    size_t k;
    int q;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (q = 0; q < 3; q++) {
            const concat_ref *d = &cases[k];
            mpt_model *m = NULL;
            mpt_node in[2];
            int padded = d->pad[0][0] || d->pad[0][1] || d->pad[1][0] || d->pad[1][1];
            char label[128];
            test__begin();
            CHECK(mpt_model_create(ctx,
                                   &(mpt_model_desc){.input_shape = {IMG_H, IMG_W, IMG_C},
                                                     .input_rank = 3,
                                                     .policy = policies[q]},
                                   &m) == MPT_OK,
                  "create: %s", mpt_context_error(ctx));
            in[0] = mpt_model_input(m);
            in[1] = padded ? mpt_zero_padding2d(m, in[0],
                                                &(mpt_zero_padding2d_desc){
                                                    .padding = {{d->pad[0][0], d->pad[0][1]},
                                                                {d->pad[1][0], d->pad[1][1]}}})
                           : in[0];
            /* axis as Keras' negative count in one case in two */
            mpt_concatenate(m, 2, in,
                            &(mpt_concatenate_desc){.axis = k % 2 ? d->axis : d->axis - 4});
            CHECK(mpt_model_build(m, 5) == MPT_OK, "build: %s", mpt_context_error(ctx));
            snprintf(label, sizeof label,
                     "Concatenate axis %d of x and x padded ((%lld, %lld), "
                     "(%lld, %lld)) %s",
                     d->axis, (long long)d->pad[0][0], (long long)d->pad[0][1],
                     (long long)d->pad[1][0], (long long)d->pad[1][1],
                     mpt_policy_name(policies[q]));
            gc_check(ctx,
                     &(gc_case){.model = m,
                                .batch = 3,
                                .training = 1,
                                .ref_forward = concat_forward_ref,
                                .user = (void *)d},
                     label);
            mpt_model_destroy(m);
            test__end("gradcheck %s", label);
        }
}

/* ZeroPadding2D's default is one pixel on every side; bad paddings and
   axes are refused. */
static void test_padding_and_axis_checks(void) {
    mpt_model *m = NULL;
    int64_t shape[3] = {0}; /* (gcc -O2 cannot see a failed create leave it unread) */
    mpt_node in[2];
    CHECK(mpt_model_create(ctx,
                           &(mpt_model_desc){.input_shape = {IMG_H, IMG_W, IMG_C}, .input_rank = 3},
                           &m) == MPT_OK,
          "create");
    CHECK(mpt_model_add_zero_padding2d(m, NULL) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_layer_output_shape(m, 0, shape) == 3 && shape[0] == IMG_H + 2 &&
              shape[1] == IMG_W + 2 && shape[2] == IMG_C,
          "default padding gives (%lld, %lld, %lld)", (long long)shape[0], (long long)shape[1],
          (long long)shape[2]);
    mpt_model_destroy(m);

    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {IMG_H, IMG_W, IMG_C}, .input_rank = 3},
                     &m);
    test_expect_error(
        ctx,
        mpt_model_add_zero_padding2d(m, &(mpt_zero_padding2d_desc){.padding = {{0, -1}, {0, 0}}}),
        MPT_ERR_INVALID_ARGUMENT, "padding[0][1] -1", "negative padding");
    in[0] = in[1] = mpt_model_input(m);
    mpt_concatenate(m, 2, in, &(mpt_concatenate_desc){.axis = 4});
    test_expect_error(ctx, mpt_model_build(m, 2), MPT_ERR_INVALID_ARGUMENT,
                      "Concatenate 'concatenate': axis 4 is not an axis", "axis 4");
    mpt_model_destroy(m);

    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {IMG_H, IMG_W, IMG_C}, .input_rank = 3},
                     &m);
    in[0] = mpt_model_input(m);
    in[1] = mpt_zero_padding2d(m, in[0], NULL);
    mpt_concatenate(m, 2, in, NULL);
    test_expect_error(ctx, mpt_model_build(m, 2), MPT_ERR_SHAPE, "only axis 3 may differ",
                      "concatenate (2, 3, 2) and (4, 5, 2) on the last axis");
    mpt_model_destroy(m);
}

/* ---- training: a residual MLP learns, the same bits on 1 and 2 threads ------------- */

static mpt_model *residual_mlp(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_node x, h, both[2];
    mpt_model_create(
        c,
        &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1, .policy = policy, .seed = 11},
        &m);
    x = mpt_model_input(m);
    h = mpt_dense(m, x, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    both[0] = mpt_dense(m, h, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    both[1] = h;
    h = mpt_add(m, 2, both, NULL);
    mpt_dense(m, h, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(
              m,
              &(mpt_compile_desc){.optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
                                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                  .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

/* Trains on `threads` threads; returns the final accuracy, the weights in w. */
static double train_residual(int threads, mpt_policy policy, float *w, int64_t w_size) {
    mpt_context *c = NULL;
    mpt_model *m;
    mpt_dataset *data;
    mpt_logs logs = {0}; /* read even where evaluate failed */
    double acc = -1;
    mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &c);
    m = residual_mlp(c, policy);
    data = blobs_in(c);
    CHECK(mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 8, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(c));
    CHECK(mpt_model_evaluate(m, data, NULL, &logs) == MPT_OK, "evaluate: %s", mpt_context_error(c));
    acc = mpt_logs_get(&logs, "accuracy");
    test_weights_of(m, w, w_size);
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    return acc;
}

static void test_residual_training(void) {
    static float w1[4096], w2[4096];
    int k;
    make_blobs();
    for (k = 0; k < 3; k++) {
        double a1 = train_residual(1, policies[k], w1, 4096);
        double a2 = train_residual(2, policies[k], w2, 4096);
        CHECK(a2 >= 0.9, "%s: accuracy %.3f after 8 epochs", mpt_policy_name(policies[k]), a2);
        CHECK(a1 == a2 && memcmp(w1, w2, sizeof w1) == 0,
              "%s: 1 and 2 threads train otherwise (accuracy %.4f, %.4f)",
              mpt_policy_name(policies[k]), a1, a2);
    }
}

/* The profiler's walk over a graph (its steps timed layer by layer, the
   residual Add's branch included) ends where the unprofiled fit ends, bit
   for bit, and writes its trace. */
static void test_profiled_graph(void) {
    static float plain_w[4096], profiled_w[4096];
    mpt_model *plain = residual_mlp(ctx, MPT_POLICY_MIXED_FLOAT16);
    mpt_model *profiled = residual_mlp(ctx, MPT_POLICY_MIXED_FLOAT16);
    mpt_dataset *data = blobs_in(ctx);
    mpt_fit_desc f;
    char dir[600], plugins[700];
    make_blobs();
    memset(&f, 0, sizeof f);
    f.epochs = 2;
    f.batch_size = 32;
    CHECK(mpt_model_fit(plain, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    snprintf(dir, sizeof dir, "%s/logs", tmpdir);
    f.profile_batch[0] = 3;
    f.profile_batch[1] = 9; /* into the second epoch */
    f.profile_dir = dir;
    CHECK(mpt_model_fit(profiled, data, &f) == MPT_OK, "profiled fit: %s", mpt_context_error(ctx));
    test_weights_of(plain, plain_w, 4096);
    test_weights_of(profiled, profiled_w, 4096);
    CHECK(memcmp(plain_w, profiled_w, sizeof plain_w) == 0, "profiling changed the weights");
    snprintf(plugins, sizeof plugins, "%s/plugins/profile", dir);
    CHECK(access(plugins, F_OK) == 0, "no profile written under %s", plugins);
    mpt_dataset_destroy(data);
    mpt_model_destroy(plain);
    mpt_model_destroy(profiled);
}

/* ---- errors --------------------------------------------------------------------- */

static void test_bad_nodes(void) {
    mpt_model *m = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node x = mpt_model_input(m), two[2];
    CHECK(mpt_dense(m, 5, &(mpt_dense_desc){.units = 2}) == MPT_NODE_FAILED, "node 5 accepted");
    test_expect_error(ctx, MPT_ERR_INVALID_ARGUMENT, MPT_ERR_INVALID_ARGUMENT,
                      "input 0 is node 5, not one of this model's (0..0)", "dense on node 5");
    /* later calls fail quietly; build reports the first failure */
    CHECK(mpt_dense(m, x, &(mpt_dense_desc){.units = 0}) == MPT_NODE_FAILED, "after a failure");
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_INVALID_ARGUMENT, "node 5", "build");
    mpt_model_destroy(m);

    m = new_model(4, MPT_POLICY_FLOAT32);
    x = mpt_model_input(m);
    two[0] = two[1] = x;
    CHECK(mpt_add(m, 1, two, NULL) == MPT_NODE_FAILED, "Add of one input");
    test_expect_error(ctx, MPT_ERR_INVALID_ARGUMENT, MPT_ERR_INVALID_ARGUMENT,
                      "Add: takes 2..8 input nodes, not 1", "add of 1");
    mpt_model_destroy(m);

    m = new_model(4, MPT_POLICY_FLOAT32);
    CHECK(mpt_subtract(m, 3, two, NULL) == MPT_NODE_FAILED, "Subtract of three inputs");
    test_expect_error(ctx, MPT_ERR_INVALID_ARGUMENT, MPT_ERR_INVALID_ARGUMENT,
                      "Subtract: takes 2 input nodes, not 3", "subtract of 3");
    CHECK(mpt_multiply(m, 2, NULL, NULL) == MPT_NODE_FAILED, "NULL inputs");
    mpt_model_destroy(m);

    /* a layer's own descriptor error comes back through the node */
    m = new_model(4, MPT_POLICY_FLOAT32);
    CHECK(mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 0}) == MPT_NODE_FAILED,
          "units 0");
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_INVALID_ARGUMENT, "units", "build");
    mpt_model_destroy(m);
}

static void test_bad_graphs(void) {
    mpt_model *m = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node x = mpt_model_input(m), two[2];
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 3});
    two[1] = mpt_dense(m, x, &(mpt_dense_desc){.units = 5, .name = "wide"});
    mpt_add(m, 2, two, NULL);
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_SHAPE,
                      "Add 'add': input 1 ('wide') has shape (5,), input 0 ('dense') (3,)",
                      "add of (3) and (5)");
    mpt_model_destroy(m);

    m = new_model(4, MPT_POLICY_FLOAT32);
    x = mpt_model_input(m);
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4});
    mpt_dense(m, x, &(mpt_dense_desc){.units = 4, .name = "unused"});
    mpt_dense(m, two[0], &(mpt_dense_desc){.units = 2});
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_INVALID_ARGUMENT,
                      "layer 'unused' (Dense) does not lead to the output", "dangling layer");
    mpt_model_destroy(m);
}

/* ---- the gradients' memory plan ---------------------------------------------------- */

/* A residual MLP of `blocks` blocks (Dense, BatchNormalization, ReLU,
   Dense, Add), built for batches of 32. */
static mpt_model *deep_residual(int blocks) {
    mpt_model *m = new_model(24, MPT_POLICY_MIXED_FLOAT16);
    mpt_node x = mpt_model_input(m), both[2];
    int b;
    x = mpt_dense(m, x, &(mpt_dense_desc){.units = 24, .activation = MPT_ACT_RELU});
    for (b = 0; b < blocks; b++) {
        mpt_node y = mpt_dense(m, x, &(mpt_dense_desc){.units = 24});
        y = mpt_batch_normalization(m, y, NULL);
        y = mpt_activation_layer(m, y, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
        both[0] = x;
        both[1] = mpt_dense(m, y, &(mpt_dense_desc){.units = 24});
        x = mpt_add(m, 2, both, NULL);
    }
    mpt_dense(m, x, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* Node gradients share memory only where their lives in the backward walk
   (from the backward of the last layer reading the node down to that of
   the layer giving it) do not overlap, and a deep residual graph holds a
   handful of them whatever its depth. (That sharing changes no result is
   what the gradient checks above prove: they run on the plan.) */
static void test_gradient_memory_plan(void) {
    int depths[2] = {4, 16}, d, i, j;
    for (d = 0; d < 2; d++) {
        mpt_model *m = deep_residual(depths[d]);
        const void *seen[8];
        int distinct = 0, n = m ? m->n_layers : 0;
        for (i = 0; i + 1 < n; i++) { /* the last layer's is the loss's */
            int known = 0;
            for (j = 0; j < distinct; j++) known |= seen[j] == m->layers[i].dy_buf;
            if (!known && distinct < 8) seen[distinct] = m->layers[i].dy_buf;
            distinct += !known;
            for (j = 0; j < i; j++) { /* nodes i + 1 and j + 1 */
                int ri = mpt__node_last_reader(m, i + 1), rj = mpt__node_last_reader(m, j + 1);
                CHECK(m->layers[i].dy_buf != m->layers[j].dy_buf || ri < j || rj < i,
                      "depth %d: nodes %d (read until layer %d) and %d (until %d) share a "
                      "buffer while both are alive", depths[d], i + 1, ri, j + 1, rj);
            }
        }
        CHECK(distinct <= 4, "depth %d: %d gradient buffers for %d layers", depths[d], distinct,
              n);
        mpt_model_destroy(m);
    }
}

/* An Add hands its dy to the layer just before it where that layer's
   output is the Add's input and read by nothing else (deep_residual's
   second Dense, and test_residual_gradients' tanh Dense, whose
   finite-difference checks then run through the hand-off), never the
   shortcut (read twice) nor a node the Add reads twice. */
static void test_add_hands_dy(void) {
    mpt_model *m = deep_residual(3), *twice = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node d, both[2];
    int i, adds = 0;
    for (i = 0; m && i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        if (L->ops->kind != MPT__LAYER_ADD) continue;
        adds++;
        CHECK(mpt__graph_hands_dy(m, i, 1, L->dy_buf), "Add %d keeps its copy", i);
        CHECK(!mpt__graph_hands_dy(m, i, 0, L->dy_buf), "Add %d hands dy to its shortcut", i);
    }
    CHECK(adds == 3, "%d Adds", adds);
    d = mpt_dense(twice, mpt_model_input(twice), &(mpt_dense_desc){.units = 4});
    both[0] = both[1] = d;
    mpt_dense(twice, mpt_add(twice, 2, both, NULL), &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(twice, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(!mpt__graph_hands_dy(twice, 1, 0, twice->layers[1].dy_buf),
          "Add(d, d) hands dy to d");
    mpt_model_destroy(m);
    mpt_model_destroy(twice);
}

/* Quantization-aware training takes a graph whose merges have two inputs
   (tests/test_qat.c trains one), an Add of three with a point of its own
   for the partial sum the int8 model computes ("add/1", which no layer
   outputs; tests/test_qat.c trains such merges), and a graph of several
   outputs (tests/test_qat.c trains one). */
static void test_refused_for_graphs(void) {
    mpt_model *m = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node x = mpt_model_input(m), two[2], three[3];
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4});
    two[1] = x;
    mpt_dense(m, mpt_add(m, 2, two, NULL), &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK, "quantize_aware: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
    m = new_model(4, MPT_POLICY_FLOAT32);
    x = mpt_model_input(m);
    three[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4});
    three[1] = x, three[2] = x;
    mpt_dense(m, mpt_add(m, 3, three, NULL), &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK && m->qat->n_partials == 1,
          "quantize_aware of an Add of three: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);
    m = new_model(4, MPT_POLICY_FLOAT32);
    x = mpt_model_input(m);
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4});
    two[1] = mpt_dense(m, x, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_add_output(m, two[0]) == MPT_OK && mpt_model_add_output(m, two[1]) == MPT_OK,
          "outputs: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK, "quantize_aware of two outputs: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
}

/* Keras' functional summary: an input row and the "Connected to" column,
   one input a line. */
static void test_functional_summary(void) {
    mpt_model *m = new_model(4, MPT_POLICY_FLOAT32);
    mpt_node x = mpt_model_input(m), two[2];
    char text[4096], want[256];
    two[0] = mpt_dense(m, x, &(mpt_dense_desc){.units = 4});
    two[1] = x;
    mpt_add(m, 2, two, NULL);
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_summary(m, text, sizeof text);
    CHECK(strstr(text, "Model: \"functional\"") && strstr(text, "Connected to"), "%s", text);
    CHECK(strstr(text, " input (InputLayer)") && strstr(text, "float32   input[0][0]\n"), "%s",
          text);
    snprintf(want, sizeof want, "float32   dense[0][0],\n%94sinput[0][0]\n", "");
    CHECK(strstr(text, want) != NULL, "no \"%s\" in\n%s", want, text);
    CHECK(test_summary_misaligned(text) == NULL, "%s in\n%s", test_summary_misaligned(text), text);
    mpt_model_destroy(m);
}

/* Long names widen the columns and the rules, and "Connected to" moves
   with them: global_average_pooling2d (GlobalAveragePooling2D), a long
   name of the user's, an Add whose second input goes on its own line. */
static void test_functional_summary_long_names(void) {
    mpt_model *m = NULL;
    mpt_node x, pooled, two[2];
    char text[4096];
    const char *long_name = "a_dense_layer_with_a_rather_long_name_of_its_own";
    CHECK(mpt_model_create(ctx,
                           &(mpt_model_desc){.input_shape = {6, 6, 2}, .input_rank = 3, .seed = 7},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(ctx));
    x = mpt_model_input(m);
    x = mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3}});
    pooled = mpt_global_average_pooling2d(m, x, NULL);
    two[0] = mpt_dense(m, pooled, &(mpt_dense_desc){.units = 3, .name = long_name});
    two[1] = mpt_dense(m, pooled, &(mpt_dense_desc){.units = 3});
    mpt_add(m, 2, two, NULL);
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    test_summary_holds(m, text, sizeof text, " global_average_pooling2d (GlobalAveragePooling2D) ",
                       "a_dense_layer_with_a_rather_long_name_of_its_own[0][0],\n ");
    mpt_model_destroy(m);
}

static void cases(void) {
    TEST_RUN(test_functional_summary);
    TEST_RUN(test_functional_summary_long_names);
    TEST_RUN(test_bad_nodes);
    TEST_RUN(test_bad_graphs);
    TEST_RUN(test_gradient_memory_plan);
    TEST_RUN(test_refused_for_graphs);
    TEST_RUN(test_elementwise_simd_matches_portable);
    TEST_RUN(test_add_hands_dy);
    test_residual_gradients();
    test_merge_gradients();
    test_fan_out_across_dtypes();
    test_concatenate_gradients();
    test_shared_layer_gradients();
    test_shared_layer_first_call_unused();
    TEST_RUN(test_shared_layer_errors);
    TEST_RUN(test_padding_and_axis_checks);
    TEST_RUN(test_residual_training);
    TEST_RUN(test_profiled_graph);
}

int main(void) {
    test_program p;
    memset(&p, 0, sizeof p);
    p.name = "test_graph";
    p.ctx = &ctx;
    p.threads = 2;
    p.seed = 5;
    p.tmpdir = tmpdir;
    p.tmpdir_size = sizeof tmpdir;
    p.keep_env = "MPT_KEEP_TEST_FILES";
    p.cases = cases;
    return test_main(&p);
}

/* Tests of quantization-aware training (mpt_model_quantize_aware): the
   fake quantization against a scalar reference of TFLite's int8 rule, its
   straight-through gradients against finite differences in double, a
   short fit, and the conversion to the full-integer model, whose outputs
   must stay within one output quantization step of the fake-quantized
   model's. */
#define _POSIX_C_SOURCE 200809L /* mkstemp, close */
#include <unistd.h>
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

/* ---- a scalar reference, written from the int8 spec ------------------------------ */

/* TFLite's tensor over [lo, hi] widened to hold 0: scale, zero point. */
static void ref_params(double lo, double hi, double *scale, int *zero_point) {
    double a = lo < 0 ? lo : 0, b = hi > 0 ? hi : 0, zp;
    *scale = (float)((b - a) / 255.0);
    zp = floor(-128.0 - a / *scale + 0.5);
    *zero_point = (int)(zp < -128 ? -128 : zp > 127 ? 127 : zp);
}

static double ref_round(double v) { return v < 0 ? -floor(-v + 0.5) : floor(v + 0.5); }

static float ref_fake_quant(float x, double scale, int zero_point) {
    double q = ref_round((double)(x / (float)scale)) + zero_point;
    q = q < -128 ? -128 : q > 127 ? 127 : q;
    return (float)((q - zero_point) * scale);
}

static mpt_dataset *dataset(mpt_context *ctx, int64_t n, int rank, const int64_t *sample,
                            float *x, int32_t *y) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    int64_t xs[4] = {n, 0, 0, 0}, ys[1] = {n};
    memcpy(xs + 1, sample, sizeof(int64_t) * (size_t)rank);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, rank + 1, xs, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

static void randomize(mpt_model *m, double spread) {
    int i;
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info p;
        int64_t k;
        mpt_model_param(m, i, &p);
        for (k = 0; k < mpt_tensor_count(&p.value); k++) {
            float *v = (float *)p.value.data + k;
            if (strstr(p.name, "gamma") || strstr(p.name, "variance")) *v = (float)test_uniform(0.5, 1.5);
            else *v = (float)test_uniform(-spread, spread);
        }
    }
    mpt_model_refresh_weights(m);
}

/* Dense(5, relu) -> Dense(3): small enough to check every value. */
static mpt_model *two_dense(mpt_context *ctx, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1, .policy = policy,
                                            .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* ---- the fake quantization, exact ------------------------------------------------------ */

static void test_fake_quant_scalar_reference(void) {
    mpt_context *ctx = quiet_ctx();
    float x[3000], y[3000], z[3000];
    int trial, k, off = 0;
    test_seed(11);
    for (trial = 0; trial < 20; trial++) {
        double lo = test_uniform(-4, 1), hi = test_uniform(-1, 5), scale;
        int zp;
        mpt_quant_params p;
        if (trial == 0) lo = 0.5, hi = 3; /* a range above 0: widened down to it */
        if (trial == 1) lo = -2, hi = -0.25;
        if (hi < lo) { double t = lo; lo = hi; hi = t; }
        p = mpt__q_params((float)lo, (float)hi);
        ref_params((float)lo, (float)hi, &scale, &zp);
        CHECK(p.scale == (float)scale && p.zero_point == zp, "params of [%g, %g]: %g %d vs %g %d",
              lo, hi, (double)p.scale, p.zero_point, scale, zp);
        for (k = 0; k < 3000; k++) {
            x[k] = (float)test_uniform(lo - 1, hi + 1);
            if (k % 7 == 0) x[k] = (float)((test_randint(-140, 140) + 0.5) * scale); /* ties */
            if (k % 7 == 1) x[k] = (float)((test_randint(-140, 140) + 0.5) * scale) *
                                   (k & 8 ? 0.9999999f : 1.0000001f); /* next to them */
        }
        x[1] = NAN, x[2] = INFINITY, x[3] = -INFINITY, x[4] = 3e9f, x[5] = -3e9f, x[6] = -0.0f;
        memset(y, 0x7f, sizeof y); /* poisoned: every value must be written */
        mpt__qat_apply(ctx, MPT_FLOAT32, x, y, 3000, &p, NULL, NULL);
        memcpy(z, x, sizeof z); /* the portable loop too, where SIMD ran above */
        mpt__qat_fake_quant(z, 3000, &p);
        for (k = 0; k < 3000; k++) {
            float want = x[k] == x[k] ? ref_fake_quant(x[k], scale, zp) : (float)(-zp * scale);
            off += memcmp(&y[k], &want, sizeof want) != 0; /* bits: the sign of 0 too */
            off += memcmp(&z[k], &want, sizeof want) != 0;
        }
    }
    CHECK(off == 0, "%d fake-quantized values differ from the scalar reference", off);
    mpt_context_destroy(ctx);
}

/* After a training forward: the kernels the layers read are the masters
   fake-quantized per output channel, bit for bit, and the output is the
   reference chain within float32 rounding of the products. */
static void test_forward_values(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = two_dense(ctx, MPT_POLICY_FLOAT32);
    float x[6 * 4], a[6 * 5], z[6 * 5], o[6 * 3], lo, hi;
    double scale;
    int zp, l, b, n, k, c, far = 0;
    mpt_tensor tx, out;
    test_seed(12);
    randomize(m, 0.8);
    for (k = 0; k < 24; k++) x[k] = (float)test_uniform(-2, 2);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){6, 4}, x);
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK, "qat: %s", mpt_context_error(ctx));
    CHECK(mpt_model_forward(m, &tx, 1, &out) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    for (l = 0; l < 2; l++) { /* the kernels, exact */
        mpt__param *P = m->layers[l].param[0];
        int64_t N = P->shape[1], K = P->shape[0];
        for (c = 0; c < N; c++) {
            float amax = 0;
            for (k = 0; k < K; k++) amax = fmaxf(amax, fabsf(P->value[k * N + c]));
            for (k = 0; k < K; k++) {
                float want = (float)ref_round(P->value[k * N + c] * (127.0f / amax)) * (amax / 127.0f);
                far += ((const float *)P->compute)[k * N + c] != want;
            }
        }
    }
    CHECK(far == 0, "%d kernel values differ from the per-channel reference", far);
    /* input: the first batch's range */
    lo = hi = x[0];
    for (k = 0; k < 24; k++) lo = fminf(lo, x[k]), hi = fmaxf(hi, x[k]);
    ref_params(lo, hi, &scale, &zp);
    for (k = 0; k < 24; k++) x[k] = ref_fake_quant(x[k], scale, zp);
    for (l = 0, n = 4; l < 2; l++) {
        const float *w = (const float *)m->layers[l].param[0]->compute;
        const float *bias = m->layers[l].param[1]->value;
        int units = l ? 3 : 5;
        float *dst = l ? o : a;
        const float *src = l ? a : x;
        for (b = 0; b < 6; b++)
            for (c = 0; c < units; c++) {
                double s = bias[c];
                for (k = 0; k < n; k++) s += (double)src[b * n + k] * w[k * units + c];
                z[b * units + c] = (float)(l == 0 && s < 0 ? 0 : s);
            }
        lo = hi = z[0];
        for (k = 0; k < 6 * units; k++) lo = fminf(lo, z[k]), hi = fmaxf(hi, z[k]);
        ref_params(lo, hi, &scale, &zp);
        for (k = 0; k < 6 * units; k++) dst[k] = ref_fake_quant(z[k], scale, zp);
        n = units;
    }
    for (k = 0, far = 0; k < 18; k++) far += fabsf(((float *)out.data)[k] - o[k]) > 1e-5f;
    /* a product that lands within float32 rounding of a tie may round the
       other way: one value in 18 at most, by one step */
    CHECK(far <= 1, "%d outputs differ from the reference chain", far);
    CHECK(mpt_model_qat_range(m, 1, &lo, &hi) == MPT_OK && hi > lo, "range: %s",
          mpt_context_error(ctx));
    {   /* inference leaves the ranges alone; the conversion takes them */
        float lo2, hi2, in_lo, in_hi;
        mpt_model *q = NULL;
        mpt_quantized_info info;
        mpt_quant_params want;
        for (k = 0; k < 24; k++) x[k] *= 10;
        mpt_model_forward(m, &tx, 0, NULL);
        mpt_model_qat_range(m, 1, &lo2, &hi2);
        CHECK(lo2 == lo && hi2 == hi, "an inference forward moved the range to [%g, %g]",
              (double)lo2, (double)hi2);
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
                  MPT_OK, "convert: %s", mpt_context_error(ctx));
        mpt_model_quantized_info(q, &info);
        mpt_model_qat_range(m, -1, &in_lo, &in_hi);
        want = mpt__q_params(in_lo, in_hi);
        CHECK(info.input.scale == want.scale && info.input.zero_point == want.zero_point,
              "the int8 input is quantized (%g, %d), the trained range says (%g, %d)",
              (double)info.input.scale, info.input.zero_point, (double)want.scale,
              want.zero_point);
        want = mpt__q_params(lo, hi);
        CHECK(info.output.scale == want.scale && info.output.zero_point == want.zero_point,
              "the int8 output is quantized (%g, %d), the trained range says (%g, %d)",
              (double)info.output.scale, info.output.zero_point, (double)want.scale,
              want.zero_point);
        mpt_model_destroy(q);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- gradients ------------------------------------------------------------------------------ */

static int clamp_to(double *v, const mpt_quant_params *p) {
    double lo = (-128 - p->zero_point) * (double)p->scale, hi = (127 - p->zero_point) * (double)p->scale;
    int outside = *v < lo || *v > hi;
    *v = *v < lo ? lo : *v > hi ? hi : *v;
    return outside;
}

static float fake_quant(float x, const mpt_quant_params *p) {
    mpt__qat_fake_quant(&x, 1, p);
    return x;
}

/* The fake quantization's slope: 1 inside its range, 0 outside, as a
   difference quotient over many steps shows (the function is a staircase:
   its slope is the straight-through estimator's only at that scale). */
static void test_fake_quant_slope(void) {
    mpt_quant_params p = mpt__q_params(-1.5f, 2.5f);
    float low = mpt__qat_edge(&p, -128), high = mpt__qat_edge(&p, 127);
    double h = 16 * (double)p.scale, x;
    int bad = 0;
    for (x = -1.4 + h; x < 2.4 - h; x += 0.013) {
        double slope = ((double)fake_quant((float)(x + h), &p) -
                        fake_quant((float)(x - h), &p)) / (2 * h);
        bad += fabs(slope - 1) > 1.0 / 16 || !mpt__qat_inside((float)x, low, high);
    }
    for (x = 2.6 + h; x < 4; x += 0.013) {
        double slope = ((double)fake_quant((float)(x + h), &p) -
                        fake_quant((float)(x - h), &p)) / (2 * h);
        bad += slope != 0 || mpt__qat_inside((float)x, low, high) ||
               mpt__qat_inside((float)-x, low, high);
    }
    CHECK(bad == 0, "%d points where the slope or the gradient mask is wrong", bad);
}

/* loss = Σ r·output of the straight-through surrogate: each fake
   quantization f(v) replaced by f(v0) + clamp(v) − clamp(v0) around the
   model's own values v0, each kernel by its quantized value plus the
   change. Its derivative is what backward computes, wherever no value
   sits on a clamp's edge. */
typedef struct surrogate {
    double w0[20], b0[5], w1[15], b1[3]; /* the parameters (deltas included)    */
    float wq0[20], wq1[15], master0[20], master1[15];
    float xq[24], a0[30], z0[30], y0[18], z1[18];
    mpt_quant_params p0, p1;
    double r[18];
} surrogate;

static double surrogate_loss(const surrogate *s) {
    double a[30], loss = 0, v, c0;
    int b, c, k;
    for (b = 0; b < 6; b++)
        for (c = 0; c < 5; c++) {
            for (v = s->b0[c], k = 0; k < 4; k++)
                v += s->xq[b * 4 + k] * (s->wq0[k * 5 + c] + (s->w0[k * 5 + c] - s->master0[k * 5 + c]));
            v = v > 0 ? v : 0;
            c0 = s->z0[b * 5 + c];
            clamp_to(&v, &s->p0);
            clamp_to(&c0, &s->p0);
            a[b * 5 + c] = s->a0[b * 5 + c] + v - c0;
        }
    for (b = 0; b < 6; b++)
        for (c = 0; c < 3; c++) {
            for (v = s->b1[c], k = 0; k < 5; k++)
                v += a[b * 5 + k] * (s->wq1[k * 3 + c] + (s->w1[k * 3 + c] - s->master1[k * 3 + c]));
            c0 = s->z1[b * 3 + c];
            clamp_to(&v, &s->p1);
            clamp_to(&c0, &s->p1);
            loss += s->r[b * 3 + c] * (s->y0[b * 3 + c] + v - c0);
        }
    return loss;
}

static void test_gradients_finite_differences(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = two_dense(ctx, MPT_POLICY_FLOAT32);
    float x[24], dout[18];
    surrogate s;
    double *param[4], worst = 0;
    const float *grad[4];
    int counts[4] = {20, 5, 15, 3}, i, k, outside0 = 0, outside1 = 0;
    mpt_tensor tx, td, out;
    test_seed(13);
    randomize(m, 0.8);
    CHECK(mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.5f}) == MPT_OK, "qat: %s",
          mpt_context_error(ctx));
    for (k = 0; k < 24; k++) x[k] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){6, 4}, x);
    mpt_model_forward(m, &tx, 1, NULL); /* the ranges from a small batch */
    for (k = 0; k < 24; k++) x[k] = (float)test_uniform(-2.5, 2.5);
    CHECK(mpt_model_forward(m, &tx, 1, &out) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    memset(&s, 0, sizeof s);
    for (k = 0; k < 18; k++) dout[k] = (float)(s.r[k] = test_uniform(-1, 1));
    mpt_tensor_wrap(ctx, &td, MPT_FLOAT32, 2, (int64_t[]){6, 3}, dout);
    CHECK(mpt_model_backward(m, &td, NULL) == MPT_OK, "backward: %s", mpt_context_error(ctx));
    /* the model's own values around which the surrogate is linear */
    memcpy(s.xq, m->qat->input.out, sizeof s.xq);
    memcpy(s.z0, m->layers[0].y, sizeof s.z0);
    memcpy(s.a0, m->qat->point[0].out, sizeof s.a0);
    memcpy(s.z1, m->qat->point[1].out, sizeof s.z1);
    memcpy(s.y0, m->layers[1].y, sizeof s.y0);
    memcpy(s.wq0, m->layers[0].param[0]->compute, sizeof s.wq0);
    memcpy(s.wq1, m->layers[1].param[0]->compute, sizeof s.wq1);
    memcpy(s.master0, m->layers[0].param[0]->value, sizeof s.master0);
    memcpy(s.master1, m->layers[1].param[0]->value, sizeof s.master1);
    s.p0 = m->qat->point[0].used;
    s.p1 = m->qat->point[1].used;
    for (k = 0; k < 30; k++) {
        double v = s.z0[k];
        outside0 += clamp_to(&v, &s.p0);
    }
    for (k = 0; k < 18; k++) {
        double v = s.z1[k];
        outside1 += clamp_to(&v, &s.p1);
    }
    CHECK(outside0 > 0 && outside1 > 0 && outside0 < 30 && outside1 < 18,
          "the test needs values on both sides of each range: %d of 30, %d of 18 outside",
          outside0, outside1);
    param[0] = s.w0, param[1] = s.b0, param[2] = s.w1, param[3] = s.b1;
    for (i = 0; i < 4; i++) {
        mpt_param_info p;
        mpt_model_param(m, i, &p);
        grad[i] = (const float *)p.grad.data;
        for (k = 0; k < counts[i]; k++) param[i][k] = ((const float *)p.value.data)[k];
    }
    for (i = 0; i < 4; i++)
        for (k = 0; k < counts[i]; k++) {
            double keep = param[i][k], h = 1e-6, up, down, fd;
            param[i][k] = keep + h;
            up = surrogate_loss(&s);
            param[i][k] = keep - h;
            down = surrogate_loss(&s);
            param[i][k] = keep;
            fd = (up - down) / (2 * h);
            worst = fmax(worst, fabs(fd - grad[i][k]) / fmax(1, fabs(fd)));
        }
    CHECK(worst < 1e-4, "gradients differ from finite differences by %g", worst);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- fit and conversion ------------------------------------------------------------------ */

enum { S = 8, CH = 1, CLASSES = 3, N = 384 };
static float images[N * S * S * CH];
static int32_t labels[N];

/* Bright blobs in one of three places: a problem a small CNN learns. */
static void make_images(void) {
    int i, y, x;
    test_seed(14);
    for (i = 0; i < N; i++) {
        int cls = test_randint(0, CLASSES - 1), cy = 2 + 2 * cls, cx = test_randint(2, 5);
        labels[i] = cls;
        for (y = 0; y < S; y++)
            for (x = 0; x < S; x++)
                images[(i * S + y) * S + x] = (float)(test_uniform(0, 0.3) +
                                                      ((abs(y - cy) <= 1 && abs(x - cx) <= 1) ? 0.7 : 0));
    }
}

/* m compiled as the QAT tests' classifiers (Adam at 0.01, sparse
   categorical crossentropy of logits or probabilities, accuracy) and built
   for batches of 32. */
static mpt_model *compiled_and_built(mpt_context *ctx, mpt_model *m, int from_logits) {
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                       .from_logits = from_logits},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static mpt_model *small_cnn(mpt_context *ctx, mpt_policy policy, int softmax) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {S, S, CH}, .input_rank = 3,
                                            .policy = policy, .seed = 5}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3}});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {2, 2}});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                             .activation = softmax ? MPT_ACT_SOFTMAX : MPT_ACT_NONE});
    return compiled_and_built(ctx, m, !softmax);
}

/* max |a − b| over n values, in steps of `step`. */
static double steps_apart(const float *a, const float *b, int64_t n, double step) {
    double worst = 0;
    int64_t k;
    for (k = 0; k < n; k++) worst = fmax(worst, fabs((double)a[k] - b[k]) / step);
    return worst;
}

/* The same as a graph (@layers' functional form): a residual block
   Conv2D → BatchNormalization → ReLU (a) → Conv2D → BatchNormalization,
   Add with a, ReLU (fused into the ADD), Concatenate with a, then as
   small_cnn from the pooling on, logits out: the merges' outputs are
   fake-quantized with ranges of their own. */
static mpt_model *small_graph(mpt_context *ctx) {
    mpt_model *m = NULL;
    mpt_activation_desc relu = {.activation = MPT_ACT_RELU};
    mpt_conv2d_desc conv = {.filters = 4, .kernel_size = {3, 3}, .padding = MPT_PADDING_SAME};
    mpt_node a, two[2];
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {S, S, CH}, .input_rank = 3, .seed = 5},
                     &m);
    a = mpt_conv2d(m, mpt_model_input(m), &conv);
    a = mpt_activation_layer(m, mpt_batch_normalization(m, a, NULL), &relu);
    two[0] = mpt_batch_normalization(m, mpt_conv2d(m, a, &conv), NULL), two[1] = a;
    two[0] = mpt_activation_layer(m, mpt_add(m, 2, two, NULL), &relu);
    a = mpt_concatenate(m, 2, two, NULL);
    a = mpt_flatten(m, mpt_max_pooling2d(m, a, &(mpt_pool2d_desc){.pool_size = {2, 2}}), NULL);
    a = mpt_dense(m, a, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_dense(m, a, &(mpt_dense_desc){.units = CLASSES});
    return compiled_and_built(ctx, m, 1);
}

/* After a predict of small_graph: what its Add (layer 5) and Concatenate
   (layer 7) read in the last batch is on the grid of each input's learned
   range (fake-quantizing it again changes nothing): the graph's readers
   take the fake-quantized outputs, not the layers' own. */
static void graph_reads_quantized(mpt_model *m) {
    static const int merges[2] = {5, 7};
    int k, s;
    for (k = 0; k < 2; k++) {
        const mpt__layer *L = &m->layers[merges[k]];
        for (s = 0; s < L->n_in; s++) {
            const int from = L->in_node[s] - 1;
            const float *x = (const float *)L->xs[s];
            float lo = 0, hi = 0;
            double scale;
            int zero_point;
            int64_t i, off = 0, n = m->last_batch * L->in_count;
            CHECK(mpt_model_qat_range(m, from, &lo, &hi) == MPT_OK, "layer %d: no range: %s",
                  from, mpt_context_error(m->ctx));
            ref_params(lo, hi, &scale, &zero_point);
            for (i = 0; i < n; i++) off += ref_fake_quant(x[i], scale, zero_point) != x[i];
            CHECK(off == 0, "'%s' input %d ('%s'): %lld of %lld values off the grid of its range",
                  L->name, s, m->layers[from].name, (long long)off, (long long)n);
        }
    }
}

static void fit_convert_compare(mpt_policy policy, int softmax, int graph) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = graph ? small_graph(ctx) : small_cnn(ctx, policy, softmax), *q = NULL;
    int64_t sample[3] = {S, S, CH};
    mpt_dataset *d;
    mpt_logs before, after, converted;
    mpt_tensor fq_out, int_out;
    mpt_quantized_info info;
    double apart;
    make_images();
    d = dataset(ctx, N, 3, sample, images, labels);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 6, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_evaluate(m, d, NULL, &before);
    CHECK(mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.9f}) == MPT_OK, "qat: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "qat fit: %s", mpt_context_error(ctx));
    mpt_model_evaluate(m, d, NULL, &after);
    CHECK(mpt_logs_get(&before, "accuracy") > 0.9 &&
              mpt_logs_get(&after, "accuracy") > mpt_logs_get(&before, "accuracy") - 0.03,
          "accuracy float %.3f, quantization-aware %.3f", mpt_logs_get(&before, "accuracy"),
          mpt_logs_get(&after, "accuracy"));
    /* no representative data: the trained ranges */
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK, "convert: %s", mpt_context_error(ctx));
    mpt_model_quantized_info(q, &info);
    CHECK(mpt_model_predict(m, d, 32, &fq_out) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    CHECK(mpt_model_predict(q, d, 32, &int_out) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    apart = steps_apart((const float *)fq_out.data, (const float *)int_out.data,
                        mpt_tensor_count(&fq_out), info.output.scale);
    if (graph) graph_reads_quantized(m);
    if (!softmax) {
        CHECK(apart <= 1.0 + 1e-3, "logits: the int8 model is %.3f output steps from the "
              "fake-quantized one (step %g)", apart, (double)info.output.scale);
        if (getenv("MPT_TEST_VERBOSE")) printf("  %s: %.3f output steps apart\n",
                                                graph ? "graph" : "chain", apart);
    } else {
        /* A logit one step off (scale s) moves a probability by up to s
           (softmax's slope is at most 1/2 per logit, two logits move),
           then the output rounds: the bound is s in output steps, plus one. */
        mpt_quantized_layer logits;
        mpt_model_quantized_layer(q, info.n_layers - 2, &logits);
        CHECK(apart <= logits.output.scale / info.output.scale + 1.0 + 1e-3,
              "softmax: the int8 model is %.3f output steps from the fake-quantized one "
              "(logits' step %g)", apart, (double)logits.output.scale);
    }
    mpt_model_evaluate(q, d, NULL, &converted);
    CHECK(fabs(mpt_logs_get(&converted, "accuracy") - mpt_logs_get(&after, "accuracy")) <= 0.01,
          "accuracy: int8 %.4f, fake-quantized %.4f", mpt_logs_get(&converted, "accuracy"),
          mpt_logs_get(&after, "accuracy"));
    mpt_tensor_free(ctx, &fq_out);
    mpt_tensor_free(ctx, &int_out);
    mpt_model_destroy(q);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

static void test_fit_and_conversion_logits(void) { fit_convert_compare(MPT_POLICY_FLOAT32, 0, 0); }
static void test_fit_and_conversion_softmax(void) { fit_convert_compare(MPT_POLICY_FLOAT32, 1, 0); }
static void test_fit_and_conversion_graph(void) { fit_convert_compare(MPT_POLICY_FLOAT32, 0, 1); }

/* ---- several inputs and outputs ---------------------------------------------------------- */

enum { VEC = 4 };
static float vectors[N * VEC], targets[N];

/* Keras' two-branch model: the images through Conv2D, BatchNormalization,
   ReLU, pooling and Flatten; a vector ("vector") through a Dense(8, relu);
   concatenated into a Dense(16, relu), then two outputs: "cls" (CLASSES
   logits) and "reg" (one unit, the vector's first two values summed). */
static mpt_model *two_branch(mpt_context *ctx) {
    mpt_model *m = NULL;
    mpt_node both[2], trunk;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {S, S, CH}, .input_rank = 3, .seed = 5},
                     &m);
    both[1] = mpt_model_add_input(m, &(mpt_input_desc){.shape = {VEC}, .rank = 1,
                                                       .name = "vector"});
    both[0] = mpt_conv2d(m, mpt_model_input(m), &(mpt_conv2d_desc){.filters = 4,
                                                                   .kernel_size = {3, 3}});
    both[0] = mpt_batch_normalization(m, both[0], NULL);
    both[0] = mpt_activation_layer(m, both[0], &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    both[0] = mpt_flatten(m, mpt_max_pooling2d(m, both[0], &(mpt_pool2d_desc){.pool_size = {2, 2}}),
                          NULL);
    both[1] = mpt_dense(m, both[1], &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    trunk = mpt_dense(m, mpt_concatenate(m, 2, both, NULL),
                      &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){.name = "cls",
                                                                  .units = CLASSES}));
    mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){.name = "reg", .units = 1}));
    mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
        .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1},
                   {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}});
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static mpt_dataset *two_branch_data(mpt_context *ctx) {
    mpt_tensor tx, tv, ty, tr;
    const mpt_tensor *inputs[2] = {&tx, &tv}, *outputs[2] = {&ty, &tr};
    mpt_dataset *d = NULL;
    int i, k;
    make_images();
    for (i = 0; i < N; i++) {
        for (k = 0; k < VEC; k++) vectors[i * VEC + k] = (float)test_uniform(-1, 1);
        targets[i] = vectors[i * VEC] + vectors[i * VEC + 1];
    }
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){N, S, S, CH}, images);
    mpt_tensor_wrap(ctx, &tv, MPT_FLOAT32, 2, (int64_t[]){N, VEC}, vectors);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N}, labels);
    mpt_tensor_wrap(ctx, &tr, MPT_FLOAT32, 2, (int64_t[]){N, 1}, targets);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = inputs, .input_count = 2,
                                                      .labels = outputs, .label_count = 2},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* How far one step of its input moves the int8 Dense `name` of q at most:
   the input's scale times the largest Σ|w| of an output channel. */
static double one_step_in(const mpt_model *q, const char *name) {
    mpt_quantized_info info;
    mpt_quantized_layer L;
    double worst = 0;
    int i;
    int64_t c, k;
    mpt_model_quantized_info(q, &info);
    for (i = 0; i < info.n_layers; i++) {
        mpt_model_quantized_layer(q, i, &L);
        if (strcmp(L.name, name) != 0 || L.op != MPT_QOP_FULLY_CONNECTED) continue;
        for (c = 0; c < L.out_channels; c++) {
            double sum = 0;
            for (k = 0; k < L.depth; k++) sum += abs(L.weights[c * L.depth + k]);
            worst = fmax(worst, sum * L.weight_scales[c] * L.input.scale);
        }
    }
    return worst;
}

/* The learned ranges of a model of several inputs travel in its weights
   file: a fresh two_branch made quantization-aware that loads m's file
   converts to q's int8 model, each input's quantization and every output
   byte the same (in8: q's outputs on d). */
static void converted_from_file(mpt_model *m, const mpt_model *q, const mpt_dataset *d,
                                const mpt_tensor in8[2]) {
    mpt_context *ctx = m->ctx;
    char path[] = "/tmp/mpt_test_qat_XXXXXX";
    mpt_model *fresh = two_branch(ctx), *q2 = NULL;
    mpt_tensor again[2];
    mpt_quantized_info a, b;
    int fd = mkstemp(path), k, same = 1;
    memset(again, 0, sizeof again);
    CHECK(fd >= 0, "temporary file");
    if (fd >= 0) close(fd);
    CHECK(mpt_model_save_weights(m, path) == MPT_OK &&
              mpt_model_quantize_aware(fresh, &(mpt_qat_desc){.ema_decay = 0.9f}) == MPT_OK &&
              mpt_model_load_weights(fresh, path) == MPT_OK &&
              mpt_model_quantize(fresh, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER},
                                 &q2) == MPT_OK &&
              mpt_model_predict_outputs(q2, d, 32, 2, again) == MPT_OK,
          "from the file: %s", mpt_context_error(ctx));
    if (q2) {
        mpt_model_quantized_info(q, &a);
        mpt_model_quantized_info(q2, &b);
        for (k = 0; k < 2; k++)
            CHECK(a.inputs[k].scale == b.inputs[k].scale &&
                      a.inputs[k].zero_point == b.inputs[k].zero_point,
                  "input %d from the file: (%g, %d), the converted model's (%g, %d)", k,
                  (double)b.inputs[k].scale, (int)b.inputs[k].zero_point,
                  (double)a.inputs[k].scale, (int)a.inputs[k].zero_point);
    }
    for (k = 0; k < 2; k++)
        same &= again[k].data && memcmp(again[k].data, in8[k].data, mpt_tensor_bytes(&in8[k])) == 0;
    CHECK(same, "the int8 model converted from the file predicts other bytes");
    for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &again[k]);
    remove(path);
    mpt_model_destroy(q2);
    mpt_model_destroy(fresh);
}

/* A model of two inputs and two outputs trains quantization-aware: the
   added input is fake-quantized with a range of its own (what its Dense
   reads lies on that range's grid), the conversion quantizes each input
   with its learned range, and each output of the int8 model is within one
   of its own steps of the fake-quantized model's (each output is
   quantized in place, as the losses read it), plus what one step of the
   tensor its Dense reads moves it: the two sides round that tensor alike
   but where float32 and the integer requantization round a value near a
   tie apart, one step (measured: cls 1 step, bound 3.6, 1030 of 1152 the
   same; reg, whose kernel is large against its range, 4 steps, bound
   10.2, 231 of 384 the same). The fake-quantized model's outputs lie on
   the grid of their learned ranges: both are quantized in place. */
static void test_several_inputs_and_outputs(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = two_branch(ctx), *q = NULL;
    mpt_dataset *d = two_branch_data(ctx);
    mpt_tensor fq[2], in8[2];
    mpt_quantized_info info;
    const int vec_layer = 0; /* the InputLayer, added first */
    const mpt__layer *dense = NULL;
    float lo[2] = {0, 0}, hi[2] = {0, 0};
    int k, i;
    memset(fq, 0, sizeof fq);
    memset(in8, 0, sizeof in8);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.9f}) == MPT_OK, "qat: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "qat fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_qat_range(m, -1, &lo[0], &hi[0]) == MPT_OK &&
              mpt_model_qat_range(m, vec_layer, &lo[1], &hi[1]) == MPT_OK,
          "input ranges: %s", mpt_context_error(ctx));
    CHECK(hi[1] > 0.5f && lo[1] < -0.5f && hi[0] > 0.9f,
          "the ranges learned: image [%g, %g], vector [%g, %g]", (double)lo[0], (double)hi[0],
          (double)lo[1], (double)hi[1]);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK, "convert: %s", mpt_context_error(ctx));
    CHECK(mpt_model_predict_outputs(m, d, 32, 2, fq) == MPT_OK &&
              (!q || mpt_model_predict_outputs(q, d, 32, 2, in8) == MPT_OK),
          "predict: %s", mpt_context_error(ctx));
    for (i = 0; i < m->n_layers; i++) /* the Dense that reads the vector */
        if (m->layers[i].n_in == 1 && m->layers[i].in_node[0] == vec_layer + 1) dense = &m->layers[i];
    if (dense) { /* after predict's last batch */
        const mpt_quant_params p = mpt__q_params(lo[1], hi[1]);
        const float *x = (const float *)dense->xs[0];
        int64_t n = m->last_batch * VEC, off = 0, j;
        for (j = 0; j < n; j++) off += ref_fake_quant(x[j], p.scale, p.zero_point) != x[j];
        CHECK(off == 0, "'%s': %lld of %lld values it read off the grid of the vector's range",
              dense->name, (long long)off, (long long)n);
    }
    CHECK(dense != NULL, "no Dense reads the vector");
    for (k = 0; k < 2 && fq[k].data; k++) { /* each output quantized in place */
        const mpt__layer *L = mpt__find_layer(m, k ? "reg" : "cls");
        float a = 0, b = 0;
        int64_t off = 0, j;
        mpt_quant_params p;
        CHECK(L && mpt_model_qat_range(m, (int)(L - m->layers), &a, &b) == MPT_OK,
              "output %d: no range", k);
        p = mpt__q_params(a, b);
        for (j = 0; j < mpt_tensor_count(&fq[k]); j++) {
            const float v = ((const float *)fq[k].data)[j];
            off += ref_fake_quant(v, p.scale, p.zero_point) != v;
        }
        CHECK(off == 0, "output %d: %lld of %lld values off the grid of its range", k,
              (long long)off, (long long)mpt_tensor_count(&fq[k]));
    }
    if (q && in8[1].data) {
        mpt_model_quantized_info(q, &info);
        for (k = 0; k < 2; k++) {
            const mpt_quant_params p = mpt__q_params(lo[k], hi[k]);
            CHECK(info.inputs[k].scale == p.scale && info.inputs[k].zero_point == p.zero_point,
                  "input %d: (%g, %d), its learned range's (%g, %d)", k,
                  (double)info.inputs[k].scale, (int)info.inputs[k].zero_point, (double)p.scale,
                  (int)p.zero_point);
        }
        for (k = 0; k < 2; k++) {
            double apart = steps_apart((const float *)fq[k].data, (const float *)in8[k].data,
                                       mpt_tensor_count(&fq[k]), info.outputs[k].scale);
            double bound = 1.0 + one_step_in(q, k ? "reg" : "cls") / info.outputs[k].scale;
            CHECK(apart <= bound + 1e-3, "output %d: the int8 model is %.3f steps from the "
                  "fake-quantized one (step %g, bound %.3f)", k, apart,
                  (double)info.outputs[k].scale, bound);
            if (getenv("MPT_TEST_VERBOSE"))
                printf("  output %d: %.3f steps apart (bound %.3f)\n", k, apart, bound);
        }
    }
    if (q && in8[0].data && in8[1].data) converted_from_file(m, q, d, in8);
    for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &fq[k]), mpt_tensor_free(ctx, &in8[k]);
    mpt_model_destroy(q);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

/* Mixed precision: the kernels the layers read in float16 are the
   float32 fake-quantized ones rounded once; training goes on. */
static void test_mixed_precision(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = small_cnn(ctx, MPT_POLICY_MIXED_FLOAT16, 1), *q = NULL;
    int64_t sample[3] = {S, S, CH}, k;
    mpt_dataset *d;
    mpt_logs logs;
    mpt__param *P;
    int off = 0;
    make_images();
    d = dataset(ctx, N, 3, sample, images, labels);
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK, "qat: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 4, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_evaluate(m, d, NULL, &logs);
    CHECK(mpt_logs_get(&logs, "accuracy") > 0.8, "accuracy %.3f", mpt_logs_get(&logs, "accuracy"));
    P = m->layers[5].param[0]; /* the hidden Dense, float16 */
    CHECK(P->compute_dtype == MPT_FLOAT16, "the Dense computes in %s", mpt_dtype_name(P->compute_dtype));
    mpt__qat_kernel(m, 5);
    for (k = 0; k < P->count; k++)
        off += ((const mpt_half *)P->compute)[k] != mpt_float_to_half(m->qat->scratch[k]);
    CHECK(off == 0, "%d float16 kernel values are not the float32 fake quantization rounded", off);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK, "convert: %s", mpt_context_error(ctx));
    mpt_model_destroy(q);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

/* ---- weights in files, and bad input ---------------------------------------------------- */

static void test_save_and_load(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = two_dense(ctx, MPT_POLICY_FLOAT32), *plain = two_dense(ctx, MPT_POLICY_FLOAT32);
    char path[] = "/tmp/mpt_test_qat_XXXXXX";
    float x[24];
    int fd, i, k, off = 0;
    mpt_tensor tx;
    test_seed(15);
    randomize(m, 0.8);
    for (k = 0; k < 24; k++) x[k] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){6, 4}, x);
    mpt_model_quantize_aware(m, NULL);
    mpt_model_forward(m, &tx, 1, NULL);
    fd = mkstemp(path);
    CHECK(fd >= 0, "temporary file");
    close(fd);
    /* the float32 masters, not the fake-quantized copies */
    CHECK(mpt_model_save_weights(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_weights(plain, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info a, b;
        mpt_model_param(m, i, &a);
        mpt_model_param(plain, i, &b);
        off += memcmp(a.value.data, b.value.data, mpt_tensor_bytes(&a.value)) != 0;
    }
    CHECK(off == 0, "%d parameters differ after the round trip", off);
    CHECK(mpt_model_load_weights(m, path) == MPT_OK, "load into the quantization-aware model: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_forward(m, &tx, 0, NULL) == MPT_OK, "forward after loading: %s",
          mpt_context_error(ctx));
    remove(path);
    mpt_model_destroy(m);
    mpt_model_destroy(plain);
    mpt_context_destroy(ctx);
}

/* two_dense, compiled with Adam (sparse crossentropy from logits) and made
   quantization-aware, with random weights; the first kernel's times
   kernel_scale. */
static mpt_model *two_dense_adam(mpt_context *ctx, double kernel_scale) {
    mpt_model *m = two_dense(ctx, MPT_POLICY_FLOAT32);
    mpt_param_info p;
    int64_t k;
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.001f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1}}) ==
              MPT_OK, "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK, "qat: %s", mpt_context_error(ctx));
    randomize(m, 0.8);
    mpt_model_param(m, 0, &p);
    for (k = 0; k < mpt_tensor_count(&p.value); k++)
        ((float *)p.value.data)[k] = (float)(((float *)p.value.data)[k] * kernel_scale);
    mpt_model_refresh_weights(m);
    return m;
}

/* 8 random samples of 4 features (one batch of two_dense), labels 0..2. */
static mpt_dataset *random_data(mpt_context *ctx) {
    static float x[8 * 4];
    static int32_t y[8];
    int k;
    for (k = 0; k < 8 * 4; k++) x[k] = (float)test_uniform(-1, 1);
    for (k = 0; k < 8; k++) y[k] = test_randint(0, 2);
    return dataset(ctx, 8, 1, (int64_t[]){4}, x, y);
}

/* Large finite weights (a first kernel near 1e20) make the second
   kernel's gradients near 1e20, finite, so the step is taken, but their
   squares overflow float32: Adam's v becomes inf and those weights stop
   moving (and the next step makes v NaN: inf − inf). After an epoch whose
   last step did that, fit must stop with MPT_ERR_NUMERIC naming the
   optimizer state, not return OK, and no checkpoint may be written that
   load_checkpoint would refuse. */
static void test_infinite_optimizer_state_stops_fit(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = two_dense_adam(ctx, 1e20 * test_uniform(1, 2));
    mpt_dataset *d = random_data(ctx);
    char path[] = "/tmp/mpt_test_qat_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "temporary file");
    close(fd);
    CHECK(mpt_model_save_checkpoint(m, path) == MPT_OK, "save before: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(m, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
    remove(path);
    expect_status(ctx, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}),
                  MPT_ERR_NUMERIC, "optimizer slot \"v\"", "fit into an infinite v");
    CHECK(strstr(mpt_context_error(ctx), "layer dense_1, tensor kernel") != NULL,
          "message: %s", mpt_context_error(ctx));
    expect_status(ctx, mpt_model_save_checkpoint(m, path), MPT_ERR_NUMERIC, "not written",
                  "save of an infinite v");
    {
        FILE *f = fopen(path, "rb");
        CHECK(f == NULL, "'%s' was written", path);
        if (f) fclose(f);
    }
    remove(path);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

static void test_bad_input(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = NULL, *q = NULL;
    float lo, hi;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_STATE, "build", "unbuilt");
    expect_status(ctx, mpt_model_qat_range(m, 0, &lo, &hi), MPT_ERR_STATE, "not quantization-aware",
                  "range of a float model");
    mpt_model_build(m, 4);
    expect_status(ctx, mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 1}),
                  MPT_ERR_INVALID_ARGUMENT, "ema_decay", "decay 1");
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_OK, "", "defaults");
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_STATE, "already", "twice");
    expect_status(ctx, mpt_model_qat_range(m, 0, &lo, &hi), MPT_ERR_INVALID_ARGUMENT,
                  "training batch", "range before training");
    expect_status(ctx, mpt_model_qat_range(m, 7, &lo, &hi), MPT_ERR_INVALID_ARGUMENT, "-1..0",
                  "range of no layer");
    m->weights_given = 1;
    expect_status(
        ctx, mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q),
        MPT_ERR_STATE, "not trained", "convert before training");
    CHECK(q == NULL, "no model on failure");
    mpt_model_destroy(m);

    /* a Dense whose tanh hides its input from training */
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_TANH});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    mpt_model_build(m, 4);
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                  "'dense' ends in tanh", "tanh inside a Dense");
    CHECK(m->qat == NULL, "nothing left behind");
    mpt_model_destroy(m);

    /* a layer with no integer form: BatchNormalization first */
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    mpt_model_build(m, 4);
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                  "'batch_normalization' does not directly follow", "unfoldable BatchNormalization");
    CHECK(m->qat == NULL, "nothing left behind");
    mpt_model_destroy(m);

    /* BatchNormalization after a Dense's ReLU (the seed cnn's): post-training
       quantization makes it a MUL and an ADD, whose intermediate no layer
       outputs for training to fake-quantize */
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.name = "bn_after_relu"});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    mpt_model_build(m, 4);
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                  "'bn_after_relu' does not directly follow", "BatchNormalization after a ReLU");
    CHECK(m->qat == NULL, "nothing left behind");
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* A range that becomes [−inf, inf] in training: once through the public
   API (learning rate 1e30, so that one step sends the weights past what
   the next forward can hold), once from a checkpoint the loader accepts
   (kernels near 1e20, whose logits overflow float32). The zero point of
   such a range was NaN converted to int (undefined behaviour, which
   -fsanitize=float-cast-overflow reports); now every range the model
   keeps stays finite and fit stops with MPT_ERR_NUMERIC naming the layer
   whose output overflowed. */
static void test_overflowing_range_stops_fit(void) {
    int k, i;
    for (k = 0; k < 2; k++) {
        mpt_context *ctx = quiet_ctx();
        mpt_model *m = two_dense_adam(ctx, k ? 1e20 * test_uniform(1, 2) : 1);
        mpt_dataset *d = random_data(ctx);
        mpt_status s;
        float lo, hi;
        if (k == 0) {
            CHECK(mpt_model_set_learning_rate(m, 1e30f) == MPT_OK, "learning rate: %s",
                  mpt_context_error(ctx));
        } else {
            char path[] = "/tmp/mpt_test_qat_XXXXXX";
            mpt_param_info p;
            int64_t e;
            int fd = mkstemp(path);
            CHECK(fd >= 0, "temporary file");
            close(fd);
            mpt_model_param(m, 2, &p); /* the second kernel as large as the first */
            for (e = 0; e < mpt_tensor_count(&p.value); e++)
                ((float *)p.value.data)[e] *= (float)(1e20 * test_uniform(1, 2));
            mpt_model_refresh_weights(m);
            CHECK(mpt_model_save_checkpoint(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
            CHECK(mpt_model_load_checkpoint(m, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
            remove(path);
        }
        s = mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 8});
        CHECK(s == MPT_ERR_NUMERIC, "%s: fit: status %d (%s)", k ? "checkpoint" : "learning rate",
              (int)s, mpt_context_error(ctx));
        CHECK(strstr(mpt_context_error(ctx), "overflowed float32") &&
                  strstr(mpt_context_error(ctx), k ? "layer 'dense_1'" : "layer 'dense"),
              "%s: message: %s", k ? "checkpoint" : "learning rate", mpt_context_error(ctx));
        for (i = -1; i < 2; i++)
            if (mpt_model_qat_range(m, i, &lo, &hi) == MPT_OK)
                CHECK(isfinite(lo) && isfinite(hi), "layer %d's range [%g, %g]", i, (double)lo,
                      (double)hi);
        mpt_model_destroy(m);
        mpt_dataset_destroy(d);
        mpt_context_destroy(ctx);
    }
}

/* A device backend (here the CPU's table under another address, which is
   what tells a model it is not on the CPU) is refused: fake quantization
   runs on host memory. */
static void test_refused_off_the_cpu(void) {
    static mpt_backend device;
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = NULL;
    device = *mpt__cpu_backend();
    ctx->backend = &device;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    expect_status(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED, "CUDA",
                  "a device model");
    CHECK(m->qat == NULL, "nothing left behind");
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- merges of more than two inputs, and an Average ------------------------------- */

enum { MV = 8, MN = 256 };
static float merge_x[MN * MV];
static int32_t merge_y[MN];

/* Vectors in ±1, labelled by the largest of three pair sums. */
static void make_merge_data(void) {
    int i, c;
    test_seed(61);
    for (i = 0; i < MN * MV; i++) merge_x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < MN; i++) {
        const float *x = merge_x + i * MV;
        float best = -INFINITY;
        for (c = 0; c < CLASSES; c++)
            if (x[2 * c] + x[2 * c + 1] > best) best = x[2 * c] + x[2 * c + 1], merge_y[i] = c;
    }
}

/* Three Dense branches a, b (ReLU) and c (none), an Add of all three
   ("add3", one partial), an Average of the sum, a and c ("avg3": two
   partial sums, then the MUL by 1/3), a Multiply of that, b and the sum
   ("mul3", one partial), logits; the layers in `policy`. */
static mpt_model *merge_graph(mpt_context *ctx, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_node a, b, c, sum, three[3];
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {MV}, .input_rank = 1, .seed = 9,
                                            .policy = policy}, &m);
    a = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 6, .activation = MPT_ACT_RELU});
    b = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 6, .activation = MPT_ACT_RELU});
    c = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 6});
    three[0] = a, three[1] = b, three[2] = c;
    sum = mpt_add(m, 3, three, &(mpt_merge_desc){.name = "add3"});
    three[0] = sum, three[1] = a, three[2] = c;
    three[0] = mpt_average(m, 3, three, &(mpt_merge_desc){.name = "avg3"});
    three[1] = b, three[2] = sum;
    three[0] = mpt_multiply(m, 3, three, &(mpt_merge_desc){.name = "mul3"});
    mpt_dense(m, three[0], &(mpt_dense_desc){.units = CLASSES, .name = "logits"});
    return compiled_and_built(ctx, m, 1);
}

/* Layer `name`'s index, or −1. */
static int layer_named(const mpt_model *m, const char *name) {
    int i;
    for (i = 0; i < m->n_layers; i++)
        if (!strcmp(m->layers[i].name, name)) return i;
    return -1;
}

/* The straight-through rule in double for merge layer L (n inputs of
   `count` values each) under the partials' ranges the last forward used:
   acc = x0, acc = acc op x_k, each partial fake-quantized (the reference
   quantizer) with its gradient passing only inside its range; then the
   forward's y and every dx against the library's, within float32's
   rounding. *masked: how many gradient values a partial's range stopped. */
static void merge_rule(mpt_model *m, const mpt__layer *L, float *const *xs, const float *dy,
                       float *const *dxs, const float *y, int64_t count, int64_t *masked) {
    const int n = L->n_in, mul = L->ops->kind == MPT__LAYER_MULTIPLY;
    const int avg = L->ops->kind == MPT__LAYER_AVERAGE, parts = mpt__qat_partial_count(L);
    double worst_y = 0, worst_dx = 0;
    int64_t i;
    int k;
    for (i = 0; i < count; i++) {
        double acc[MPT_MAX_MERGE_INPUTS], inside[MPT_MAX_MERGE_INPUTS], g, want;
        acc[0] = xs[0][i];
        for (k = 1; k < n; k++) {
            float v = mul ? (float)acc[k - 1] * xs[k][i] : (float)acc[k - 1] + xs[k][i];
            inside[k] = 1;
            if (k <= parts) {
                const mpt__qat_point *P = mpt__qat_partial_point(m, L, k);
                double scale;
                int zp;
                ref_params(P->min, P->max, &scale, &zp);
                inside[k] = v >= (float)((-128 - zp) * scale) && v <= (float)((127 - zp) * scale);
                v = ref_fake_quant(v, scale, zp);
            }
            acc[k] = v;
        }
        want = avg ? acc[n - 1] / n : acc[n - 1];
        worst_y = fmax(worst_y, fabs(want - y[i]) / fmax(1e-3, fabs(want)));
        g = avg ? (double)dy[i] / n : dy[i];
        for (k = n - 1; k >= 1; k--) {
            g *= inside[k];
            *masked += inside[k] == 0;
            want = mul ? g * acc[k - 1] : g;
            worst_dx = fmax(worst_dx, fabs(want - dxs[k][i]) / fmax(1e-3, fabs(want)));
            if (mul) g *= xs[k][i];
        }
        worst_dx = fmax(worst_dx, fabs(g - dxs[0][i]) / fmax(1e-3, fabs(g)));
    }
    CHECK(worst_y <= 1e-5, "'%s': y off the rule by %g (relative)", L->name, worst_y);
    CHECK(worst_dx <= 1e-5, "'%s': dx off the straight-through rule by %g (relative)", L->name,
          worst_dx);
}

/* Each merge of m with partials run by hand (its forward, then its
   backward) on inputs spread past the partials' ranges, with the ranges
   training learned, against merge_rule; some gradient is masked. */
static void merge_gradients(mpt_model *m) {
    static const char *const names[3] = {"add3", "avg3", "mul3"};
    enum { B = 16 };
    int t, k;
    test_seed(62);
    for (t = 0; t < 3; t++) {
        const int at = layer_named(m, names[t]);
        mpt__layer *L = at >= 0 ? &m->layers[at] : NULL;
        float *xs[MPT_MAX_MERGE_INPUTS], *dxs[MPT_MAX_MERGE_INPUTS], *y, *dy;
        int64_t count, i, masked = 0;
        mpt__pass p;
        CHECK(L != NULL, "no layer '%s'", names[t]);
        if (!L) continue;
        count = B * L->in_count;
        for (k = 0; k < L->n_in; k++) {
            const mpt__qat_point *P = mpt__qat_partial_point(m, L, 1);
            const double spread = 1.5 * fmax(fabs(P->min), fabs(P->max)) + 0.1;
            xs[k] = (float *)malloc(sizeof(float) * (size_t)count);
            dxs[k] = (float *)malloc(sizeof(float) * (size_t)count);
            for (i = 0; i < count; i++)
                xs[k][i] = (float)test_uniform(-spread, spread) /
                           (L->ops->kind == MPT__LAYER_MULTIPLY ? sqrt(spread) : 1.0);
        }
        y = (float *)malloc(sizeof(float) * (size_t)count);
        dy = (float *)malloc(sizeof(float) * (size_t)count);
        for (i = 0; i < count; i++) dy[i] = (float)test_uniform(-1, 1);
        memset(&p, 0, sizeof p);
        p.ctx = m->ctx, p.model = m, p.be = m->be, p.impl = m->impl, p.batch = B;
        p.n_x = L->n_in, p.xs = (const void *const *)xs, p.dxs = (void *const *)dxs;
        p.y = y, p.dy = dy;
        m->last_training = 0; /* the learned ranges as they are */
        CHECK(mpt__qat_merge_forward(L, &p) && mpt__qat_merge_backward(L, &p),
              "'%s': not run as its int8 steps", L->name);
        merge_rule(m, L, xs, dy, dxs, y, count, &masked);
        CHECK(masked > 0 && masked < count * (L->n_in - 1), "'%s': %lld of %lld gradient values "
              "masked: the rule's mask is not tested", L->name, (long long)masked,
              (long long)(count * (L->n_in - 1)));
        for (k = 0; k < L->n_in; k++) free(xs[k]), free(dxs[k]);
        free(y), free(dy);
    }
}

/* Every partial of the int8 model q ("<layer>/<k>") quantized with exactly
   the range its point in m learned; returns how many there are. */
static int partial_scales(const mpt_model *m, const mpt_model *q) {
    mpt_quantized_info info;
    int i, partials = 0;
    if (!q || mpt_model_quantized_info(q, &info) != MPT_OK) return 0;
    for (i = 0; i < info.n_layers; i++) {
        mpt_quantized_layer ql;
        const char *slash;
        const mpt__qat_point *P;
        mpt_quant_params want;
        char layer[64];
        mpt_model_quantized_layer(q, i, &ql);
        slash = strrchr(ql.name, '/');
        if (!slash) continue;
        snprintf(layer, sizeof layer, "%.*s", (int)(slash - ql.name), ql.name);
        P = mpt__qat_partial_point(m, &m->layers[layer_named(m, layer)], atoi(slash + 1));
        want = mpt__q_params(P->min, P->max);
        CHECK(ql.output.scale == want.scale && ql.output.zero_point == want.zero_point,
              "'%s': scale %g, zero point %d; its learned range [%g, %g] gives %g, %d", ql.name,
              (double)ql.output.scale, (int)ql.output.zero_point, (double)P->min,
              (double)P->max, (double)want.scale, (int)want.zero_point);
        partials++;
    }
    return partials;
}

/* The merges of merge_graph train quantization-aware: every partial has a
   learned range, the conversion quantizes each partial ("<layer>/<k>")
   with exactly its range, the int8 model's logits are within one output
   step of the fake-quantized model's, the merges' passes follow the
   straight-through rule, and a weights file carries the partials' ranges
   to a new quantization-aware model, which converts to the same bits. */
static void test_merges_of_more_inputs(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = merge_graph(ctx, MPT_POLICY_FLOAT32), *m2 = merge_graph(ctx, MPT_POLICY_FLOAT32);
    mpt_model *q = NULL, *q2 = NULL;
    int64_t sample[1] = {MV};
    mpt_dataset *d;
    mpt_tensor fq_out, int_out, int2_out;
    mpt_quantized_info info;
    char path[] = "/tmp/mpt_test_qat_merge_XXXXXX";
    int i, partials, fd;
    double apart;
    make_merge_data();
    d = dataset(ctx, MN, 1, sample, merge_x, merge_y);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 8, .batch_size = 32}) == MPT_OK &&
              mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.9f}) == MPT_OK &&
              m->qat->n_partials == 4 &&
              mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    if (!m->qat || m->qat->n_partials != 4) goto done;
    for (i = 0; i < m->qat->n_partials; i++)
        CHECK(m->qat->partial[i].seen, "partial %d has no learned range", i);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK && mpt_model_quantized_info(q, &info) == MPT_OK,
          "convert: %s", mpt_context_error(ctx));
    partials = partial_scales(m, q);
    CHECK(partials == 4, "%d partials in the int8 model, not 4", partials);
    memset(&fq_out, 0, sizeof fq_out), memset(&int_out, 0, sizeof int_out);
    memset(&int2_out, 0, sizeof int2_out);
    CHECK(q && mpt_model_predict(m, d, 32, &fq_out) == MPT_OK &&
              mpt_model_predict(q, d, 32, &int_out) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    apart = q && fq_out.data && int_out.data
                ? steps_apart((const float *)fq_out.data, (const float *)int_out.data,
                              mpt_tensor_count(&fq_out), info.output.scale)
                : 99;
    CHECK(apart <= 1.0 + 1e-3, "logits: the int8 model is %.3f output steps from the "
          "fake-quantized one (step %g)", apart, (double)info.output.scale);
    if (getenv("MPT_TEST_VERBOSE")) printf("  merges: %.3f output steps apart\n", apart);
    merge_gradients(m);
    /* the weights file: the partials' ranges go with it */
    fd = mkstemp(path);
    CHECK(fd >= 0, "temporary file");
    if (fd >= 0) close(fd);
    CHECK(mpt_model_save_weights(m, path) == MPT_OK &&
              mpt_model_quantize_aware(m2, NULL) == MPT_OK &&
              mpt_model_load_weights(m2, path) == MPT_OK &&
              mpt_model_quantize(m2, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER},
                                 &q2) == MPT_OK &&
              mpt_model_predict(q2, d, 32, &int2_out) == MPT_OK,
          "round trip: %s", mpt_context_error(ctx));
    for (i = 0; m2->qat && i < m2->qat->n_partials; i++)
        CHECK(m2->qat->partial[i].seen && m2->qat->partial[i].min == m->qat->partial[i].min &&
                  m2->qat->partial[i].max == m->qat->partial[i].max,
              "partial %d: range not carried by the weights file", i);
    CHECK(int2_out.data && int_out.data &&
              !memcmp(int2_out.data, int_out.data, mpt_tensor_bytes(&int_out)),
          "the int8 model from the weights file differs");
    remove(path);
    mpt_tensor_free(ctx, &fq_out);
    mpt_tensor_free(ctx, &int_out);
    mpt_tensor_free(ctx, &int2_out);
done:
    mpt_model_destroy(q);
    mpt_model_destroy(q2);
    mpt_model_destroy(m);
    mpt_model_destroy(m2);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

/* Mixed precision: the merges compute in float16, their partials
   fake-quantized in float32 and stored in float16 (mpt__qat_apply);
   training goes on, every partial learns a finite range, and the
   conversion quantizes each with it. */
static void test_merges_mixed_precision(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = merge_graph(ctx, MPT_POLICY_MIXED_FLOAT16), *q = NULL;
    int64_t sample[1] = {MV};
    mpt_dataset *d;
    mpt_logs logs;
    int i;
    make_merge_data();
    d = dataset(ctx, MN, 1, sample, merge_x, merge_y);
    CHECK(m->layers[layer_named(m, "avg3")].dtype == MPT_FLOAT16, "the Average computes in %s",
          mpt_dtype_name(m->layers[layer_named(m, "avg3")].dtype));
    CHECK(mpt_model_quantize_aware(m, NULL) == MPT_OK &&
              mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 6, .batch_size = 32}) == MPT_OK &&
              mpt_model_evaluate(m, d, NULL, &logs) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&logs, "accuracy") > 0.6, "accuracy %.3f",
          mpt_logs_get(&logs, "accuracy"));
    for (i = 0; m->qat && i < m->qat->n_partials; i++)
        CHECK(m->qat->partial[i].seen && isfinite(m->qat->partial[i].min) &&
                  isfinite(m->qat->partial[i].max) &&
                  m->qat->partial[i].min < m->qat->partial[i].max,
              "partial %d: range [%g, %g]", i, (double)m->qat->partial[i].min,
              (double)m->qat->partial[i].max);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK && partial_scales(m, q) == 4,
          "convert: %s", mpt_context_error(ctx));
    mpt_model_destroy(q);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

int main(void) {
    TEST_RUN(test_fake_quant_scalar_reference);
    TEST_RUN(test_forward_values);
    TEST_RUN(test_fake_quant_slope);
    TEST_RUN(test_gradients_finite_differences);
    TEST_RUN(test_fit_and_conversion_logits);
    TEST_RUN(test_fit_and_conversion_softmax);
    TEST_RUN(test_fit_and_conversion_graph);
    TEST_RUN(test_several_inputs_and_outputs);
    TEST_RUN(test_mixed_precision);
    TEST_RUN(test_save_and_load);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_infinite_optimizer_state_stops_fit);
    TEST_RUN(test_overflowing_range_stops_fit);
    TEST_RUN(test_refused_off_the_cpu);
    TEST_RUN(test_merges_of_more_inputs);
    TEST_RUN(test_merges_mixed_precision);
    return test_summary("test_qat");
}

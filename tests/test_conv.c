/* Conv2D, MaxPooling2D, AveragePooling2D and GlobalAveragePooling2D:
   gradients against finite differences of plain double-precision loops,
   known answers worked by hand, output shapes against TensorFlow's
   formulas, bad input, and bit-identical results on 1, 2 or 3 threads. */

/* A small im2col budget, so that most batches are cut into several chunks
   (and the kernel gradient is summed over chunks) even at test sizes. */
#define MPT__CONV_COLS_BUDGET 300
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;
static char tmpdir[512]; /* the cases' files: test_main makes it and removes it */

/* ---- the reference: naive loops in double ----------------------------------- */



static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* TensorFlow's documented output size and padding before the first pixel:
   valid: ceil((in − k + 1) / s);  same: ceil(in / s), padded by
   max((out − 1)·s + k − in, 0), the smaller half first. */
static int64_t tf_out(int64_t in, int64_t k, int64_t s, mpt_padding pad, int64_t *before) {
    int64_t out, total;
    *before = 0;
    if (pad == MPT_PADDING_VALID) return in >= k ? ceil_div(in - k + 1, s) : 0;
    out = ceil_div(in, s);
    total = (out - 1) * s + k - in;
    if (total < 0) total = 0;
    *before = total / 2;
    return out;
}

/* One window layer: input (h, w, c), window kh × kw, strides, padding. */
typedef struct geom {
    int64_t h, w, c, kh, kw, sh, sw;
    mpt_padding pad;
} geom;

static void geom_out(const geom *g, int64_t *oh, int64_t *ow, int64_t *top, int64_t *left) {
    *oh = tf_out(g->h, g->kh, g->sh, g->pad, top);
    *ow = tf_out(g->w, g->kw, g->sw, g->pad, left);
}

/* y (batch, oh, ow, f) = act(conv(x, kernel) + bias); kernel (kh, kw, c, f). */
static void ref_conv(const geom *g, int64_t f, mpt_activation act, int64_t batch, const double *x,
                     const double *kernel, const double *bias, double *y) {
    int64_t oh, ow, top, left, b, oy, ox, o, i, j, ch;
    geom_out(g, &oh, &ow, &top, &left);
    for (b = 0; b < batch; b++)
        for (oy = 0; oy < oh; oy++)
            for (ox = 0; ox < ow; ox++) {
                double *out = y + ((b * oh + oy) * ow + ox) * f;
                for (o = 0; o < f; o++) {
                    double z = bias ? bias[o] : 0;
                    for (i = 0; i < g->kh; i++)
                        for (j = 0; j < g->kw; j++) {
                            int64_t yy = oy * g->sh - top + i, xx = ox * g->sw - left + j;
                            if (yy < 0 || yy >= g->h || xx < 0 || xx >= g->w) continue;
                            for (ch = 0; ch < g->c; ch++)
                                z += x[((b * g->h + yy) * g->w + xx) * g->c + ch] *
                                     kernel[((i * g->kw + j) * g->c + ch) * f + o];
                        }
                    out[o] = ref_act(act, z);
                }
                if (act == MPT_ACT_SOFTMAX) ref_softmax_rows(out, 1, f);
            }
}

/* Max (first largest wins) or mean of the pixels of each window inside the
   image; y (batch, oh, ow, c). */
static void ref_pool(const geom *g, int is_max, int64_t batch, const double *x, double *y) {
    int64_t oh, ow, top, left, b, oy, ox, ch, i, j;
    geom_out(g, &oh, &ow, &top, &left);
    for (b = 0; b < batch; b++)
        for (oy = 0; oy < oh; oy++)
            for (ox = 0; ox < ow; ox++)
                for (ch = 0; ch < g->c; ch++) {
                    double best = -HUGE_VAL, sum = 0;
                    int n = 0;
                    for (i = 0; i < g->kh; i++)
                        for (j = 0; j < g->kw; j++) {
                            int64_t yy = oy * g->sh - top + i, xx = ox * g->sw - left + j;
                            double v;
                            if (yy < 0 || yy >= g->h || xx < 0 || xx >= g->w) continue;
                            v = x[((b * g->h + yy) * g->w + xx) * g->c + ch];
                            if (v > best) best = v;
                            sum += v;
                            n++;
                        }
                    y[((b * oh + oy) * ow + ox) * g->c + ch] = is_max ? best : sum / n;
                }
}

/* ---- gradient checks of single layers ---------------------------------------- */

typedef struct layer_ref {
    geom g;
    int64_t f;
    mpt_activation act;
    int bias;
    int kind; /* 0 conv, 1 max pool, 2 average pool, 3 global average pool */
} layer_ref;

static void layer_forward_ref(const gc_case *c, const double *x, double *const *params,
                              double *y) {
    const layer_ref *d = (const layer_ref *)c->user;
    if (d->kind == 0) {
        ref_conv(&d->g, d->f, d->act, c->batch, x, params[0], d->bias ? params[1] : NULL, y);
    } else if (d->kind == 3) {
        geom whole = d->g;
        whole.kh = whole.sh = d->g.h;
        whole.kw = whole.sw = d->g.w;
        whole.pad = MPT_PADDING_VALID;
        ref_pool(&whole, 0, c->batch, x, y);
    } else {
        ref_pool(&d->g, d->kind == 1, c->batch, x, y);
    }
}

static const char *pad_name(mpt_padding p) { return p == MPT_PADDING_SAME ? "same" : "valid"; }

static void add_layer(mpt_model *m, const layer_ref *d, mpt_dtype dtype) {
    mpt_status s = MPT_OK;
    if (d->kind == 0) {
        s = mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
            .filters = d->f, .kernel_size = {d->g.kh, d->g.kw}, .strides = {d->g.sh, d->g.sw},
            .padding = d->g.pad, .activation = d->act, .no_bias = !d->bias, .dtype = dtype});
    } else if (d->kind == 3) {
        s = mpt_model_add_global_average_pooling2d(m, &(mpt_global_pool2d_desc){.dtype = dtype});
    } else {
        mpt_pool2d_desc p;
        memset(&p, 0, sizeof p);
        p.pool_size[0] = d->g.kh;
        p.pool_size[1] = d->g.kw;
        p.strides[0] = d->g.sh;
        p.strides[1] = d->g.sw;
        p.padding = d->g.pad;
        p.dtype = dtype;
        s = d->kind == 1 ? mpt_model_add_max_pooling2d(m, &p)
                         : mpt_model_add_average_pooling2d(m, &p);
    }
    CHECK(s == MPT_OK, "add: %s", mpt_context_error(ctx));
}

static void check_layer(int64_t batch, layer_ref d, mpt_dtype dtype) {
    static const char *kinds[] = {"conv2d", "max_pool", "avg_pool", "global_avg_pool"};
    mpt_model *m = NULL;
    char label[200];
    test__begin();
    if (d.kind == 0)
        snprintf(label, sizeof label,
                 "conv2d B=%lld in=(%lld,%lld,%lld) f=%lld k=(%lld,%lld) s=(%lld,%lld) %s %s%s %s",
                 (long long)batch, (long long)d.g.h, (long long)d.g.w, (long long)d.g.c,
                 (long long)d.f, (long long)d.g.kh, (long long)d.g.kw, (long long)d.g.sh,
                 (long long)d.g.sw, pad_name(d.g.pad), mpt_activation_name(d.act),
                 d.bias ? "" : " no-bias", mpt_dtype_name(dtype));
    else if (d.kind == 3)
        snprintf(label, sizeof label, "%s B=%lld in=(%lld,%lld,%lld) %s", kinds[d.kind],
                 (long long)batch, (long long)d.g.h, (long long)d.g.w, (long long)d.g.c,
                 mpt_dtype_name(dtype));
    else
        snprintf(label, sizeof label, "%s B=%lld in=(%lld,%lld,%lld) k=(%lld,%lld) s=(%lld,%lld) %s %s",
                 kinds[d.kind], (long long)batch, (long long)d.g.h, (long long)d.g.w,
                 (long long)d.g.c, (long long)d.g.kh, (long long)d.g.kw, (long long)d.g.sh,
                 (long long)d.g.sw, pad_name(d.g.pad), mpt_dtype_name(dtype));
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {d.g.h, d.g.w, d.g.c},
                                                  .input_rank = 3, .seed = 5}, &m) == MPT_OK,
          "create");
    add_layer(m, &d, dtype);
    CHECK(mpt_model_build(m, batch + 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    if (!test__current_failed)
        gc_check(ctx, &(gc_case){.model = m, .batch = batch, .training = 1,
                                 .ref_forward = layer_forward_ref, .user = &d}, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

static layer_ref conv_case(int64_t h, int64_t w, int64_t c, int64_t f, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw, mpt_padding pad, mpt_activation act, int bias) {
    layer_ref d;
    memset(&d, 0, sizeof d);
    d.g.h = h, d.g.w = w, d.g.c = c, d.g.kh = kh, d.g.kw = kw, d.g.sh = sh, d.g.sw = sw;
    d.g.pad = pad;
    d.f = f;
    d.act = act;
    d.bias = bias;
    return d;
}

static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU,
                                      MPT_ACT_SIGMOID, MPT_ACT_TANH, MPT_ACT_SOFTMAX,
                                      MPT_ACT_GELU_TANH};

/* A random window that fits the image (for 'valid') or not (for 'same'). */
static void random_geom(geom *g, int max_side, int max_c, int max_k) {
    g->h = test_randint(1, max_side);
    g->w = test_randint(1, max_side);
    g->c = test_randint(1, max_c);
    g->pad = test_randint(0, 1) ? MPT_PADDING_SAME : MPT_PADDING_VALID;
    g->kh = test_randint(1, g->pad == MPT_PADDING_VALID ? (int)MPT__MIN(max_k, g->h) : max_k);
    g->kw = test_randint(1, g->pad == MPT_PADDING_VALID ? (int)MPT__MIN(max_k, g->w) : max_k);
    g->sh = test_randint(1, 3);
    g->sw = test_randint(1, 3);
}

static void test_conv_gradients(void) {
    int a, t, k;
    /* every activation in every dtype, a rectangular kernel, strides (1, 2) */
    for (t = 0; t < 3; t++)
        for (a = 0; a < 7; a++)
            check_layer(3, conv_case(6, 5, 3, 4, 3, 2, 1, 2, (a & 1) ? MPT_PADDING_SAME
                                                                     : MPT_PADDING_VALID,
                                     acts[a], 1), dtypes[t]);
    /* 1×1 kernels: stride 1 (no im2col), stride 2 (im2col) */
    for (t = 0; t < 3; t++) {
        check_layer(4, conv_case(5, 3, 5, 3, 1, 1, 1, 1, MPT_PADDING_VALID, MPT_ACT_NONE, 1),
                    dtypes[t]);
        check_layer(2, conv_case(5, 4, 3, 2, 1, 1, 2, 2, MPT_PADDING_SAME, MPT_ACT_TANH, 0),
                    dtypes[t]);
    }
    /* stride 3, a kernel larger than the image under 'same', batch 1 */
    check_layer(1, conv_case(7, 7, 2, 3, 3, 3, 3, 3, MPT_PADDING_SAME, MPT_ACT_NONE, 1),
                MPT_FLOAT32);
    check_layer(2, conv_case(2, 3, 2, 3, 4, 5, 1, 2, MPT_PADDING_SAME, MPT_ACT_SIGMOID, 1),
                MPT_FLOAT32);
    check_layer(5, conv_case(4, 4, 1, 9, 4, 4, 1, 1, MPT_PADDING_VALID, MPT_ACT_NONE, 1),
                MPT_FLOAT16);
    /* larger: the CNN's 3×3 'valid' and 'same' layers, 8+ channels */
    check_layer(2, conv_case(9, 8, 9, 10, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1),
                MPT_FLOAT32);
    check_layer(3, conv_case(10, 9, 8, 12, 3, 3, 2, 2, MPT_PADDING_SAME, MPT_ACT_TANH, 1),
                MPT_BFLOAT16);
    /* random shapes: odd sizes, channels not multiples of 8 */
    for (k = 0; k < 14; k++) {
        layer_ref d;
        memset(&d, 0, sizeof d);
        random_geom(&d.g, 7, 5, 4);
        d.f = test_randint(1, 6);
        d.act = acts[test_randint(0, 5)];
        d.bias = k % 4 != 3;
        check_layer(k < 3 ? 1 : test_randint(1, 4), d, dtypes[k % 3]);
    }
}

static void test_pool_gradients(void) {
    int t, k, kind;
    for (t = 0; t < 3; t++) {
        /* average pooling: 'same' windows cut by the border, overlapping windows */
        layer_ref d = conv_case(7, 5, 3, 0, 3, 2, 2, 1, MPT_PADDING_SAME, MPT_ACT_NONE, 0);
        d.kind = 2;
        check_layer(3, d, dtypes[t]);
        d = conv_case(6, 6, 10, 0, 2, 2, 2, 2, MPT_PADDING_VALID, MPT_ACT_NONE, 0);
        d.kind = 2;
        check_layer(1, d, dtypes[t]);
        d = conv_case(5, 3, 9, 0, 0, 0, 0, 0, MPT_PADDING_VALID, MPT_ACT_NONE, 0);
        d.kind = 3;
        check_layer(2, d, dtypes[t]);
    }
    /* Max pooling by finite differences in float32 only: random float32
       inputs are distinct (near-ties have probability ~1e-6). The half
       dtypes round inputs into many exact ties; test_max_pool_exact covers
       them with the exact gradient. */
    for (k = 0; k < 8; k++) {
        layer_ref d;
        memset(&d, 0, sizeof d);
        random_geom(&d.g, 8, 4, 3);
        kind = k < 5 ? 1 : 2;
        d.kind = kind;
        check_layer(test_randint(1, 3), d, kind == 1 ? MPT_FLOAT32 : dtypes[k % 3]);
    }
}

/* Max pooling's exact gradient in each dtype: dy goes to the first largest
   pixel of each window (TF's choice among ties), added where windows overlap.
   bfloat16 inputs in [-1, 1) hold many exact ties. */
static void check_max_pool_exact(int64_t batch, geom g, mpt_dtype dtype) {
    mpt_model *m = NULL;
    mpt_pool2d_desc p;
    int64_t oh, ow, top, left, n_in = batch * g.h * g.w * g.c, n_out, i, b, oy, ox, ch, u, v;
    int64_t xs[4];
    float *xf, *dyf, *got;
    double *x, *dx_ref, *dx_lib, *y_ref;
    mpt_tensor tx, ty, tdy, tdx;
    test__begin();
    geom_out(&g, &oh, &ow, &top, &left);
    n_out = batch * oh * ow * g.c;
    memset(&p, 0, sizeof p);
    p.pool_size[0] = g.kh, p.pool_size[1] = g.kw, p.strides[0] = g.sh, p.strides[1] = g.sw;
    p.padding = g.pad;
    p.dtype = dtype;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {g.h, g.w, g.c}, .input_rank = 3}, &m);
    CHECK(mpt_model_add_max_pooling2d(m, &p) == MPT_OK, "add");
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(ctx));
    xf = (float *)calloc((size_t)n_in, sizeof(float));
    got = (float *)calloc((size_t)(n_in > n_out ? n_in : n_out), sizeof(float));
    dyf = (float *)calloc((size_t)n_out, sizeof(float));
    x = (double *)calloc((size_t)n_in, sizeof(double));
    dx_ref = (double *)calloc((size_t)n_in, sizeof(double));
    dx_lib = (double *)calloc((size_t)n_in, sizeof(double));
    y_ref = (double *)calloc((size_t)n_out, sizeof(double));
    for (i = 0; i < n_in; i++) xf[i] = (float)(x[i] = round_to(dtype, test_uniform(-1, 1)));
    for (i = 0; i < n_out; i++) dyf[i] = (float)round_to(dtype, test_uniform(-1, 1));
    xs[0] = batch, xs[1] = g.h, xs[2] = g.w, xs[3] = g.c;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, xf);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    mpt_convert(ctx, MPT_FLOAT32, got, dtype, ty.data, n_out);
    ref_pool(&g, 1, batch, x, y_ref);
    for (i = 0; i < n_out; i++) CHECK(got[i] == y_ref[i], "y[%lld] %g != %g", (long long)i, got[i], y_ref[i]);
    /* the reference gradient: first maximum of each window, in scan order */
    for (b = 0; b < batch; b++)
        for (oy = 0; oy < oh; oy++)
            for (ox = 0; ox < ow; ox++)
                for (ch = 0; ch < g.c; ch++) {
                    int64_t at = -1;
                    for (u = 0; u < g.kh; u++)
                        for (v = 0; v < g.kw; v++) {
                            int64_t yy = oy * g.sh - top + u, xx = ox * g.sw - left + v, k;
                            if (yy < 0 || yy >= g.h || xx < 0 || xx >= g.w) continue;
                            k = ((b * g.h + yy) * g.w + xx) * g.c + ch;
                            if (at < 0 || x[k] > x[at]) at = k;
                        }
                    dx_ref[at] += dyf[((b * oh + oy) * ow + ox) * g.c + ch];
                }
    tdy = ty;
    tdy.dtype = MPT_FLOAT32;
    tdy.data = dyf;
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
    mpt_convert(ctx, MPT_FLOAT32, got, dtype, tdx.data, n_in);
    for (i = 0; i < n_in; i++) dx_lib[i] = got[i];
    {
        double e = rel_err(dx_lib, dx_ref, n_in);
        double tol = dtype == MPT_FLOAT32 ? 1e-6 : dtype == MPT_FLOAT16 ? 1e-3 : 8e-3;
        CHECK(e <= tol, "dx relative error %.3g > %.3g", e, tol);
    }
    free(xf); free(got); free(dyf); free(x); free(dx_ref); free(dx_lib); free(y_ref);
    mpt_model_destroy(m);
    test__end("max_pool exact B=%lld in=(%lld,%lld,%lld) k=(%lld,%lld) s=(%lld,%lld) %s %s",
              (long long)batch, (long long)g.h, (long long)g.w, (long long)g.c,
              (long long)g.kh, (long long)g.kw, (long long)g.sh, (long long)g.sw,
              pad_name(g.pad), mpt_dtype_name(dtype));
}

static void test_max_pool_exact(void) {
    int t, k;
    for (t = 0; t < 3; t++) {
        geom a = {9, 7, 5, 3, 3, 2, 2, MPT_PADDING_SAME};  /* overlapping windows */
        geom b = {8, 8, 16, 2, 2, 2, 2, MPT_PADDING_VALID}; /* the CNN's pooling */
        check_max_pool_exact(3, a, dtypes[t]);
        check_max_pool_exact(2, b, dtypes[t]);
        for (k = 0; k < 3; k++) {
            geom g;
            random_geom(&g, 9, 6, 4);
            check_max_pool_exact(test_randint(1, 3), g, dtypes[t]);
        }
    }
}

/* Max pooling against the plain scan, bit for bit: each window's pixels in
   order, a value taken where it is larger or NaN over a number (the first
   largest wins, the first NaN wins). Inputs hold exact ties, ±0, ±inf and
   NaN (forward and backward), or only the finite ones (predict, whose
   datasets refuse the others), all exact in the dtype; channels on both
   sides of the 16 that the kernel takes at a time. */
static float pool_value(int special) {
    static const float finite[] = {0.0f, -0.0f, 0.5f, -0.5f, 1.0f, -1.25f, 2.0f};
    int k = test_randint(0, special ? 10 : 7);
    if (k < 7) return finite[k];
    if (k == 7) return (float)test_randint(-64, 64) / 64.0f;
    return k == 8 ? NAN : k == 9 ? INFINITY : -INFINITY;
}

/* y (batch, oh, ow, c) and, where dy is given, dx (batch, h, w, c) in float32. */
static void scan_max_pool(const geom *g, int64_t batch, const float *x, const float *dy, float *y,
                          float *dx) {
    int64_t oh, ow, top, left, b, oy, ox, ch, u, v;
    geom_out(g, &oh, &ow, &top, &left);
    if (dx) memset(dx, 0, sizeof(float) * (size_t)(batch * g->h * g->w * g->c));
    for (b = 0; b < batch; b++)
        for (oy = 0; oy < oh; oy++)
            for (ox = 0; ox < ow; ox++)
                for (ch = 0; ch < g->c; ch++) {
                    const int64_t o = ((b * oh + oy) * ow + ox) * g->c + ch;
                    int64_t at = -1;
                    float best = -INFINITY;
                    for (u = 0; u < g->kh; u++)
                        for (v = 0; v < g->kw; v++) {
                            int64_t yy = oy * g->sh - top + u, xx = ox * g->sw - left + v, k;
                            if (yy < 0 || yy >= g->h || xx < 0 || xx >= g->w) continue;
                            k = ((b * g->h + yy) * g->w + xx) * g->c + ch;
                            if (at < 0) at = k; /* kept while nothing beats -inf */
                            if (x[k] > best || (x[k] != x[k] && best == best)) best = x[k], at = k;
                        }
                    y[o] = best;
                    if (dx) dx[at] += dy[o];
                }
}

/* a and b the same floats, NaN matching NaN and -0 not matching 0. */
static int same_bits(const float *a, const float *b, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (!(a[i] != a[i] && b[i] != b[i]) && memcmp(&a[i], &b[i], sizeof(float)) != 0) return 0;
    return 1;
}

static void check_max_pool_scan(int threads, int64_t batch, geom g, mpt_dtype dtype) {
    mpt_context *c = NULL;
    mpt_model *m = NULL;
    mpt_dataset *data = NULL;
    mpt_pool2d_desc p;
    int64_t oh, ow, top, left, n_in = batch * g.h * g.w * g.c, n_out, i;
    int64_t xs[4], ys[1];
    float *x, *dy, *y_ref, *dx_ref, *got;
    int32_t *labels;
    mpt_tensor tx, ty, tdy, tdx, tlabels, out;
    int pass;
    test__begin();
    geom_out(&g, &oh, &ow, &top, &left);
    n_out = batch * oh * ow * g.c;
    mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &c);
    memset(&p, 0, sizeof p);
    p.pool_size[0] = g.kh, p.pool_size[1] = g.kw, p.strides[0] = g.sh, p.strides[1] = g.sw;
    p.padding = g.pad;
    p.dtype = dtype;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {g.h, g.w, g.c}, .input_rank = 3}, &m);
    CHECK(mpt_model_add_max_pooling2d(m, &p) == MPT_OK, "add");
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(c));
    x = (float *)calloc((size_t)n_in, sizeof(float));
    dx_ref = (float *)calloc((size_t)n_in, sizeof(float));
    got = (float *)calloc((size_t)(n_in > n_out ? n_in : n_out), sizeof(float));
    dy = (float *)calloc((size_t)n_out, sizeof(float));
    y_ref = (float *)calloc((size_t)n_out, sizeof(float));
    labels = (int32_t *)calloc((size_t)batch, sizeof(int32_t));
    xs[0] = batch, xs[1] = g.h, xs[2] = g.w, xs[3] = g.c;
    ys[0] = batch;
    for (pass = 0; pass < 2; pass++) { /* 0: forward and backward; 1: predict */
        for (i = 0; i < n_in; i++) x[i] = pool_value(pass == 0);
        mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
        if (pass == 0) {
            for (i = 0; i < n_out; i++) dy[i] = (float)test_randint(-64, 64) / 16.0f;
            scan_max_pool(&g, batch, x, dy, y_ref, dx_ref);
            CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
            mpt_convert(c, MPT_FLOAT32, got, dtype, ty.data, n_out);
            CHECK(same_bits(got, y_ref, n_out), "forward: y differs from the scan");
            tdy = ty;
            tdy.dtype = MPT_FLOAT32;
            tdy.data = dy;
            CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
            /* the sums of dy where windows overlap, rounded to the dtype as the layer does */
            mpt_convert(c, dtype, got, MPT_FLOAT32, dx_ref, n_in);
            mpt_convert(c, MPT_FLOAT32, dx_ref, dtype, got, n_in);
            mpt_convert(c, MPT_FLOAT32, got, dtype, tdx.data, n_in);
            CHECK(same_bits(got, dx_ref, n_in), "backward: dx differs from the scan's argmax");
        } else {
            scan_max_pool(&g, batch, x, NULL, y_ref, NULL);
            mpt_tensor_wrap(c, &tlabels, MPT_INT32, 1, ys, labels);
            CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &tlabels}, &data) ==
                      MPT_OK, "dataset: %s", mpt_context_error(c));
            /* batches of 2: the last one short when the batch is odd */
            CHECK(mpt_model_predict(m, data, 2, &out) == MPT_OK, "predict: %s",
                  mpt_context_error(c));
            CHECK(same_bits((const float *)out.data, y_ref, n_out),
                  "predict differs from the scan");
            mpt_tensor_free(c, &out);
            mpt_dataset_destroy(data);
        }
    }
    free(x); free(dx_ref); free(got); free(dy); free(y_ref); free(labels);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    test__end("max_pool scan %d thread%s B=%lld in=(%lld,%lld,%lld) k=(%lld,%lld) s=(%lld,%lld) %s %s",
              threads, threads > 1 ? "s" : "", (long long)batch, (long long)g.h, (long long)g.w,
              (long long)g.c, (long long)g.kh, (long long)g.kw, (long long)g.sh, (long long)g.sw,
              pad_name(g.pad), mpt_dtype_name(dtype));
}

static void test_max_pool_scan(void) {
    static const int64_t channels[] = {1, 15, 16, 17, 32, 33, 47};
    int k, threads;
    for (threads = 1; threads <= 2; threads++) {
        geom cnn = {26, 26, 32, 2, 2, 2, 2, MPT_PADDING_VALID}; /* cnn_small's pooling */
        geom overlap = {9, 7, 33, 3, 3, 2, 1, MPT_PADDING_SAME};
        check_max_pool_scan(threads, 3, cnn, MPT_FLOAT32);
        check_max_pool_scan(threads, 5, overlap, MPT_FLOAT32);
        check_max_pool_scan(threads, 3, overlap, MPT_BFLOAT16);
        for (k = 0; k < 7; k++) {
            geom g;
            random_geom(&g, 9, 1, 4);
            g.c = channels[k];
            check_max_pool_scan(threads, test_randint(1, 5), g, dtypes[k % 3]);
        }
    }
}

/* ---- a chain: Conv2D -> MaxPooling2D -> Flatten -> Dense ------------------------ */

typedef struct chain_ref {
    geom conv, pool;
    int64_t f, units;
    mpt_activation act;
} chain_ref;

static void chain_forward_ref(const gc_case *c, const double *x, double *const *params,
                              double *y) {
    const chain_ref *d = (const chain_ref *)c->user;
    int64_t oh, ow, ph, pw, t, l, b, u, i, n_flat;
    double *h1, *h2;
    geom_out(&d->conv, &oh, &ow, &t, &l);
    geom_out(&d->pool, &ph, &pw, &t, &l);
    n_flat = ph * pw * d->f;
    h1 = (double *)malloc(sizeof(double) * (size_t)(c->batch * oh * ow * d->f));
    h2 = (double *)malloc(sizeof(double) * (size_t)(c->batch * n_flat));
    ref_conv(&d->conv, d->f, d->act, c->batch, x, params[0], params[1], h1);
    ref_pool(&d->pool, 1, c->batch, h1, h2);
    for (b = 0; b < c->batch; b++)
        for (u = 0; u < d->units; u++) {
            double z = params[3][u];
            for (i = 0; i < n_flat; i++) z += h2[b * n_flat + i] * params[2][i * d->units + u];
            y[b * d->units + u] = z;
        }
    free(h1);
    free(h2);
}

static void test_chain_gradients(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = NULL;
        chain_ref d;
        int64_t oh, ow, t, l;
        memset(&d, 0, sizeof d);
        d.conv.h = 7 + k, d.conv.w = 6, d.conv.c = 2 + k;
        d.conv.kh = 3, d.conv.kw = 2 + k % 2, d.conv.sh = 1, d.conv.sw = 1 + k % 2;
        d.conv.pad = k == 1 ? MPT_PADDING_VALID : MPT_PADDING_SAME;
        d.f = 3 + k;
        d.act = k == 2 ? MPT_ACT_GELU : MPT_ACT_TANH;
        geom_out(&d.conv, &oh, &ow, &t, &l);
        d.pool.h = oh, d.pool.w = ow, d.pool.c = d.f;
        d.pool.kh = d.pool.kw = d.pool.sh = d.pool.sw = 2;
        d.pool.pad = k == 0 ? MPT_PADDING_SAME : MPT_PADDING_VALID;
        d.units = 4;
        test__begin();
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {d.conv.h, d.conv.w, d.conv.c},
                                                .input_rank = 3}, &m);
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
            .filters = d.f, .kernel_size = {d.conv.kh, d.conv.kw},
            .strides = {d.conv.sh, d.conv.sw}, .padding = d.conv.pad, .activation = d.act});
        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.padding = d.pool.pad});
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = d.units});
        CHECK(mpt_model_build(m, 3) == MPT_OK, "build: %s", mpt_context_error(ctx));
        gc_check(ctx, &(gc_case){.model = m, .batch = 3, .training = 1,
                                 .ref_forward = chain_forward_ref, .user = &d},
                 "conv2d -> max_pool -> flatten -> dense");
        mpt_model_destroy(m);
        test__end("gradcheck conv2d(%s, %s) -> max_pool(%s) -> flatten -> dense",
                  pad_name(d.conv.pad), mpt_activation_name(d.act), pad_name(d.pool.pad));
    }
}

/* Two Conv2D layers in float16 around an average pooling, ending in a
   global average pooling: input gradients through every pooling kind in
   a half dtype. */
typedef struct half_chain_ref {
    geom c1, pool, c2;
    int64_t f1, f2;
} half_chain_ref;

static void half_chain_forward_ref(const gc_case *c, const double *x, double *const *params,
                                   double *y) {
    const half_chain_ref *d = (const half_chain_ref *)c->user;
    int64_t h, w, t, l, ph, pw, oh, ow;
    double *a, *b, *e;
    geom whole;
    geom_out(&d->c1, &h, &w, &t, &l);
    geom_out(&d->pool, &ph, &pw, &t, &l);
    geom_out(&d->c2, &oh, &ow, &t, &l);
    a = (double *)calloc((size_t)(c->batch * h * w * d->f1), sizeof(double));
    b = (double *)calloc((size_t)(c->batch * ph * pw * d->f1), sizeof(double));
    e = (double *)calloc((size_t)(c->batch * oh * ow * d->f2), sizeof(double));
    ref_conv(&d->c1, d->f1, MPT_ACT_TANH, c->batch, x, params[0], params[1], a);
    ref_pool(&d->pool, 0, c->batch, a, b);
    ref_conv(&d->c2, d->f2, MPT_ACT_SIGMOID, c->batch, b, params[2], params[3], e);
    whole = d->c2;
    whole.h = whole.kh = whole.sh = oh;
    whole.w = whole.kw = whole.sw = ow;
    whole.c = d->f2;
    whole.pad = MPT_PADDING_VALID;
    ref_pool(&whole, 0, c->batch, e, y);
    free(a);
    free(b);
    free(e);
}

static void test_half_chain_gradients(void) {
    int t;
    for (t = 1; t < 3; t++) {
        mpt_model *m = NULL;
        half_chain_ref d = {{7, 6, 2, 3, 3, 1, 1, MPT_PADDING_SAME},
                            {7, 6, 5, 2, 2, 2, 2, MPT_PADDING_SAME},
                            {4, 3, 5, 2, 2, 1, 1, MPT_PADDING_VALID}, 5, 3};
        test__begin();
        mpt_model_create(ctx, &(mpt_model_desc){
            .input_shape = {7, 6, 2}, .input_rank = 3,
            .policy = t == 1 ? MPT_POLICY_MIXED_FLOAT16 : MPT_POLICY_MIXED_BFLOAT16}, &m);
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 5, .kernel_size = {3, 3},
                                                   .padding = MPT_PADDING_SAME,
                                                   .activation = MPT_ACT_TANH});
        mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.padding = MPT_PADDING_SAME});
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2},
                                                   .activation = MPT_ACT_SIGMOID});
        mpt_model_add_global_average_pooling2d(m, NULL);
        CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
        gc_check(ctx, &(gc_case){.model = m, .batch = 2, .training = 1,
                                 .ref_forward = half_chain_forward_ref, .user = &d}, "half chain");
        mpt_model_destroy(m);
        test__end("gradcheck conv2d -> avg_pool -> conv2d -> global_avg_pool %s",
                  mpt_dtype_name(dtypes[t]));
    }
}

/* ---- known answers ------------------------------------------------------------- */

/* Runs a built one-layer model on x (1, h, w, 1) and backward with dy;
   returns the model (for its parameters) with y and dx copied out. */
static mpt_model *run_one(mpt_model *m, const float *x, int64_t h, int64_t w, const float *dy,
                          float *y, float *dx) {
    int64_t xs[4] = {1, h, w, 1};
    mpt_tensor tx, ty, tdy, tdx;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, (void *)x);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    memcpy(y, ty.data, sizeof(float) * (size_t)mpt_tensor_count(&ty));
    tdy = ty;
    tdy.data = (void *)dy;
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
    memcpy(dx, tdx.data, sizeof(float) * (size_t)(h * w));
    return m;
}

static int same_floats(const float *a, const float *b, int n) {
    int i;
    for (i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* x = [[1,2,3],[4,5,6],[7,8,9]], kernel [[1,2],[3,4]], bias 0.5. */
static mpt_model *conv_3x3(mpt_padding pad, int64_t stride) {
    mpt_model *m = NULL;
    mpt_param_info k, b;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 3, 1}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 1, .kernel_size = {2, 2},
                                               .strides = {stride, stride}, .padding = pad});
    CHECK(mpt_model_build(m, 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_param(m, 0, &k);
    mpt_model_param(m, 1, &b);
    CHECK(strcmp(k.name, "conv2d/kernel") == 0 && strcmp(b.name, "conv2d/bias") == 0,
          "names %s %s", k.name, b.name);
    CHECK(k.value.rank == 4 && k.value.shape[0] == 2 && k.value.shape[1] == 2 &&
          k.value.shape[2] == 1 && k.value.shape[3] == 1, "kernel shape");
    {
        float kv[4] = {1, 2, 3, 4};
        memcpy(k.value.data, kv, sizeof kv);
        ((float *)b.value.data)[0] = 0.5f;
    }
    mpt_model_refresh_weights(m);
    return m;
}

static void test_conv_known_answer(void) {
    const float x[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, ones[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    float y[9], dx[9];
    mpt_param_info k, b;
    mpt_model *m = conv_3x3(MPT_PADDING_VALID, 1);
    {   /* valid: 2×2 outputs; dy = 1 gives dkernel = window sums, dx = kernel overlaps */
        const float want_y[4] = {37.5f, 47.5f, 67.5f, 77.5f}, want_dk[4] = {12, 16, 24, 28};
        const float want_dx[9] = {1, 3, 2, 4, 10, 6, 3, 7, 4};
        int64_t xs[4] = {1, 3, 3, 1};
        mpt_tensor tx, ty, tdy, tdx;
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, (void *)x);
        CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
        CHECK(ty.rank == 4 && ty.shape[1] == 2 && ty.shape[2] == 2 && ty.shape[3] == 1, "shape");
        CHECK(same_floats((const float *)ty.data, want_y, 4), "valid y");
        tdy = ty;
        tdy.data = (void *)ones;
        CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
        /* twice: gradients are overwritten, not accumulated */
        CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
        mpt_model_param(m, 0, &k);
        mpt_model_param(m, 1, &b);
        CHECK(same_floats((const float *)k.grad.data, want_dk, 4), "dkernel");
        CHECK(((float *)b.grad.data)[0] == 4, "dbias %g", ((float *)b.grad.data)[0]);
        CHECK(same_floats((const float *)tdx.data, want_dx, 9), "dx");
    }
    mpt_model_destroy(m);
    {   /* same, stride 1: padded by one row and column at the bottom/right */
        const float want[9] = {37.5f, 47.5f, 21.5f, 67.5f, 77.5f, 33.5f, 23.5f, 26.5f, 9.5f};
        m = run_one(conv_3x3(MPT_PADDING_SAME, 1), x, 3, 3, ones, y, dx);
        CHECK(same_floats(y, want, 9), "same y = %g %g %g / %g %g %g / %g %g %g", y[0], y[1],
              y[2], y[3], y[4], y[5], y[6], y[7], y[8]);
        mpt_model_destroy(m);
    }
    {   /* same, stride 2: 2×2 outputs from windows at rows/columns 0 and 2 */
        const float want[4] = {37.5f, 21.5f, 23.5f, 9.5f}, want_dx[9] = {1, 2, 1, 3, 4, 3, 1, 2, 1};
        m = run_one(conv_3x3(MPT_PADDING_SAME, 2), x, 3, 3, ones, y, dx);
        CHECK(same_floats(y, want, 4), "same/2 y = %g %g %g %g", y[0], y[1], y[2], y[3]);
        CHECK(same_floats(dx, want_dx, 9), "same/2 dx");
        mpt_model_destroy(m);
    }
}

/* x (4×4):  1 3 2 0     with ties: 3 twice in the first window, 4 twice in
             3 1 0 2     the third, 5 twice in the last.
             4 4 5 1
             0 6 1 5 */
static const float pool_x[16] = {1, 3, 2, 0, 3, 1, 0, 2, 4, 4, 5, 1, 0, 6, 1, 5};

static mpt_model *pool_model(int is_max, int64_t k, int64_t s, mpt_padding pad) {
    mpt_model *m = NULL;
    mpt_pool2d_desc d;
    memset(&d, 0, sizeof d);
    d.pool_size[0] = d.pool_size[1] = k;
    d.strides[0] = d.strides[1] = s;
    d.padding = pad;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4, 4, 1}, .input_rank = 3}, &m);
    if (is_max)
        mpt_model_add_max_pooling2d(m, &d);
    else
        mpt_model_add_average_pooling2d(m, &d);
    CHECK(mpt_model_build(m, 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static void test_pool_known_answer(void) {
    const float dy[4] = {1, 2, 3, 4};
    float y[4], dx[16];
    mpt_model *m = NULL;
    {   /* max 2×2 (the defaults): the first 3 of the tie wins */
        const float want_y[4] = {3, 2, 6, 5};
        const float want_dx[16] = {0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 3, 0, 0};
        m = run_one(pool_model(1, 0, 0, MPT_PADDING_VALID), pool_x, 4, 4, dy, y, dx);
        CHECK(same_floats(y, want_y, 4), "max y = %g %g %g %g", y[0], y[1], y[2], y[3]);
        CHECK(same_floats(dx, want_dx, 16), "max dx");
        mpt_model_destroy(m);
    }
    {   /* max 3×3, stride 2, same: one padded row/column at the bottom/right;
           three windows share the 5 at (2, 2), whose gradients add up */
        const float want_y[4] = {5, 5, 6, 5};
        const float want_dx[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 3, 0, 0};
        m = run_one(pool_model(1, 3, 2, MPT_PADDING_SAME), pool_x, 4, 4, dy, y, dx);
        CHECK(same_floats(y, want_y, 4), "max same y = %g %g %g %g", y[0], y[1], y[2], y[3]);
        CHECK(same_floats(dx, want_dx, 16), "max same dx");
        mpt_model_destroy(m);
    }
    {   /* a NaN wins its window (so that it reaches the loss); a number elsewhere */
        float xn[16];
        memcpy(xn, pool_x, sizeof xn);
        xn[5] = NAN;
        m = run_one(pool_model(1, 0, 0, MPT_PADDING_VALID), xn, 4, 4, dy, y, dx);
        CHECK(y[0] != y[0] && y[1] == 2 && y[2] == 6 && y[3] == 5, "max NaN y = %g %g %g %g",
              y[0], y[1], y[2], y[3]);
        CHECK(dx[5] == 1 && dx[1] == 0, "max NaN dx");
        mpt_model_destroy(m);
    }
    {   /* average 2×2 */
        const float want_y[4] = {2, 1, 3.5f, 3};
        m = run_one(pool_model(0, 2, 2, MPT_PADDING_VALID), pool_x, 4, 4, dy, y, dx);
        CHECK(same_floats(y, want_y, 4), "avg y = %g %g %g %g", y[0], y[1], y[2], y[3]);
        CHECK(dx[0] == 0.25f && dx[3] == 0.5f && dx[12] == 0.75f && dx[15] == 1, "avg dx");
        mpt_model_destroy(m);
    }
    {   /* average 3×3, stride 2, same: padding is not counted (23/9, 10/6, 20/6, 12/4) */
        m = run_one(pool_model(0, 3, 2, MPT_PADDING_SAME), pool_x, 4, 4, dy, y, dx);
        CHECK(fabs(y[0] - 23.0 / 9) < 1e-6 && fabs(y[1] - 10.0 / 6) < 1e-6 &&
                  fabs(y[2] - 20.0 / 6) < 1e-6 && y[3] == 3,
              "avg same y = %g %g %g %g", y[0], y[1], y[2], y[3]);
        /* pixel (2, 2) is in all four windows: 1/9 + 2/6 + 3/6 + 4/4 */
        CHECK(fabs(dx[10] - (1.0 / 9 + 2.0 / 6 + 3.0 / 6 + 1)) < 1e-6, "avg same dx %g", dx[10]);
        CHECK(fabs(dx[0] - 1.0 / 9) < 1e-7 && fabs(dx[15] - 1) < 1e-7, "avg same dx corners");
        mpt_model_destroy(m);
    }
    {   /* global average: (1, 4, 4, 1) -> (1, 1), mean 38 / 16 */
        int64_t xs[4] = {1, 4, 4, 1}, os[1];
        mpt_tensor tx, ty;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4, 4, 1}, .input_rank = 3}, &m);
        mpt_model_add_global_average_pooling2d(m, NULL);
        CHECK(mpt_model_build(m, 1) == MPT_OK, "build");
        CHECK(mpt_model_layer_output_shape(m, 0, os) == 1 && os[0] == 1, "global shape");
        CHECK(strcmp(mpt_model_layer_name(m, 0), "global_average_pooling2d") == 0, "name %s",
              mpt_model_layer_name(m, 0));
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, (void *)pool_x);
        CHECK(mpt_model_forward(m, &tx, 0, &ty) == MPT_OK, "forward");
        CHECK(ty.rank == 2 && ((float *)ty.data)[0] == 2.375f, "global y %g", ((float *)ty.data)[0]);
        mpt_model_destroy(m);
    }
}

/* ---- output shapes against TensorFlow's formulas --------------------------------- */


/* Builds one window layer on an (h, w, 3) input; returns the build status
   and the output shape. */
static mpt_status build_window_layer(mpt_context *q, int is_pool, int64_t h, int64_t w,
                                     const int64_t k[2], const int64_t s[2], mpt_padding pad,
                                     int64_t out[3]) {
    mpt_model *m = NULL;
    mpt_status st;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {h, w, 3}, .input_rank = 3}, &m);
    if (is_pool)
        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {k[0], k[1]},
                                                          .strides = {s[0], s[1]},
                                                          .padding = pad});
    else
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {k[0], k[1]},
                                                   .strides = {s[0], s[1]}, .padding = pad});
    st = mpt_model_build(m, 1);
    if (st == MPT_OK) mpt_model_layer_output_shape(m, 0, out);
    mpt_model_destroy(m);
    return st;
}

/* TF's documented sizes: valid ceil((in − k + 1) / s), same ceil(in / s). */
static void test_output_shapes(void) {
    mpt_context *q = quiet_ctx();
    int64_t in, kk, ss;
    int pad, is_pool;
    for (is_pool = 0; is_pool < 2; is_pool++)
        for (pad = 0; pad < 2; pad++)
            for (in = 1; in <= 9; in++)
                for (kk = 1; kk <= 4; kk++)
                    for (ss = 1; ss <= 3; ss++) {
                        /* rows (in, kk, ss); columns (in + 2, 2, ss + 1) */
                        const int64_t k[2] = {kk, 2}, s[2] = {ss, ss + 1}, w = in + 2;
                        int64_t want_h = pad ? ceil_div(in, ss)
                                             : in >= kk ? ceil_div(in - kk + 1, ss) : 0;
                        int64_t want_w = pad ? ceil_div(w, ss + 1) : ceil_div(w - 1, ss + 1);
                        int64_t out[3] = {0, 0, 0};
                        mpt_status st = build_window_layer(q, is_pool, in, w, k, s,
                                                           (mpt_padding)pad, out);
                        if (want_h == 0) {
                            CHECK(st == MPT_ERR_SHAPE, "in %lld k %lld valid: status %d",
                                  (long long)in, (long long)kk, (int)st);
                            continue;
                        }
                        CHECK(st == MPT_OK, "build: %s", mpt_context_error(q));
                        CHECK(out[0] == want_h && out[1] == want_w &&
                                  out[2] == (is_pool ? 3 : 2),
                              "%s in (%lld, %lld) k (%lld, 2) s (%lld, %lld) %s: got (%lld, "
                              "%lld), want (%lld, %lld)",
                              is_pool ? "pool" : "conv", (long long)in, (long long)w,
                              (long long)kk, (long long)ss, (long long)ss + 1,
                              pad_name((mpt_padding)pad), (long long)out[0], (long long)out[1],
                              (long long)want_h, (long long)want_w);
                    }
    mpt_context_destroy(q);
}

/* ---- defaults: names, pooling defaults, initializers ----------------------------- */

static void test_defaults(void) {
    mpt_model *m = NULL;
    mpt_param_info k, b;
    int64_t shape[3] = {0, 0, 0}, i, n;
    double limit = sqrt(6.0 / (3 * 3 * 16 + 3 * 3 * 32)), mx = 0;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {12, 10, 16}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 32, .kernel_size = {3, 3}});
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {1, 1}});
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){0});
    mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {3, 1}});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(strcmp(mpt_model_layer_name(m, 0), "conv2d") == 0 &&
              strcmp(mpt_model_layer_name(m, 1), "conv2d_1") == 0 &&
              strcmp(mpt_model_layer_name(m, 2), "max_pooling2d") == 0 &&
              strcmp(mpt_model_layer_name(m, 3), "average_pooling2d") == 0, "default names");
    mpt_model_layer_output_shape(m, 0, shape);
    CHECK(shape[0] == 10 && shape[1] == 8 && shape[2] == 32, "conv shape");
    mpt_model_layer_output_shape(m, 2, shape); /* pool (2, 2), strides = pool_size */
    CHECK(shape[0] == 5 && shape[1] == 4 && shape[2] == 4, "max pool shape");
    mpt_model_layer_output_shape(m, 3, shape); /* pool (3, 1), strides (3, 1) */
    CHECK(shape[0] == 1 && shape[1] == 4 && shape[2] == 4, "avg pool shape (%lld, %lld, %lld)",
          (long long)shape[0], (long long)shape[1], (long long)shape[2]);
    /* glorot_uniform with fan_in = 3·3·16 and fan_out = 3·3·32; bias zeros */
    mpt_model_param(m, 0, &k);
    mpt_model_param(m, 1, &b);
    n = mpt_tensor_count(&k.value);
    for (i = 0; i < n; i++) {
        double v = fabs(((float *)k.value.data)[i]);
        mx = v > mx ? v : mx;
    }
    CHECK(mx <= limit && mx > 0.99 * limit, "glorot max %g, limit %g", mx, limit);
    for (i = 0; i < 32; i++) CHECK(((float *)b.value.data)[i] == 0, "bias not zero");
    mpt_model_destroy(m);
}

/* ---- bad input ---------------------------------------------------------------- */

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    const char *e;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {5, 5, 2}, .input_rank = 3}, &m);
    CHECK(mpt_model_add_conv2d(m, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL desc accepted");
    CHECK(mpt_model_add_conv2d(NULL, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL model accepted");
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 0, .kernel_size = {3, 3}}) ==
              MPT_ERR_INVALID_ARGUMENT, "filters 0 accepted");
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = -2, .kernel_size = {3, 3}}) ==
              MPT_ERR_INVALID_ARGUMENT, "filters -2 accepted");
    CHECK(strstr(mpt_context_error(q), "-2") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 0}}) ==
              MPT_ERR_INVALID_ARGUMENT, "kernel_size 0 accepted");
    CHECK(strstr(mpt_context_error(q), "(3, 0)") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 3},
                                                     .strides = {1, -1}}) ==
              MPT_ERR_INVALID_ARGUMENT, "strides -1 accepted");
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 3},
                                                     .padding = (mpt_padding)7}) ==
              MPT_ERR_INVALID_ARGUMENT, "padding 7 accepted");
    CHECK(strstr(mpt_context_error(q), "7") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 3},
                                                     .activation = (mpt_activation)42}) ==
              MPT_ERR_INVALID_ARGUMENT, "activation 42 accepted");
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
              .filters = 2, .kernel_size = {3, 3},
              .kernel_initializer = (mpt_initializer)99}) == MPT_ERR_INVALID_ARGUMENT,
          "initializer 99 accepted");
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 3},
                                                     .dtype = MPT_INT8}) == MPT_ERR_DTYPE,
          "int8 compute dtype accepted");
    CHECK(mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {-1, 2}}) ==
              MPT_ERR_INVALID_ARGUMENT, "pool_size -1 accepted");
    CHECK(mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.strides = {2, -3}}) ==
              MPT_ERR_INVALID_ARGUMENT, "pool strides -3 accepted");
    CHECK(mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.padding = (mpt_padding)-1}) ==
              MPT_ERR_INVALID_ARGUMENT, "pool padding -1 accepted");
    CHECK(mpt_model_layer_count(m) == 0, "a bad layer was added");
    /* a kernel larger than the image under 'valid' */
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {6, 3},
                                                     .name = "big"}) == MPT_OK, "add");
    CHECK(mpt_model_build(m, 2) == MPT_ERR_SHAPE, "kernel 6 on 5 rows accepted");
    e = mpt_context_error(q);
    CHECK(strstr(e, "Conv2D 'big'") && strstr(e, "(6, 3)") && strstr(e, "(5, 5, 2)"),
          "message: %s", e);
    mpt_model_destroy(m);

    /* the same under 'same' is fine */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {5, 5, 2}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {6, 3},
                                               .padding = MPT_PADDING_SAME});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "same with a big kernel: %s", mpt_context_error(q));
    mpt_model_destroy(m);

    /* a pool window larger than the image */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {3, 8, 1}, .input_rank = 3}, &m);
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {4, 4}, .name = "pool"});
    CHECK(mpt_model_build(m, 2) == MPT_ERR_SHAPE, "pool 4 on 3 rows accepted");
    e = mpt_context_error(q);
    CHECK(strstr(e, "MaxPooling2D 'pool'") && strstr(e, "(4, 4)") && strstr(e, "(3, 8, 1)"),
          "message: %s", e);
    mpt_model_destroy(m);

    /* image layers on vectors */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {784}, .input_rank = 1}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 2, .kernel_size = {3, 3}});
    CHECK(mpt_model_build(m, 2) == MPT_ERR_SHAPE, "Conv2D on vectors accepted");
    e = mpt_context_error(q);
    CHECK(strstr(e, "Conv2D 'conv2d' expects one sample to be (height, width, channels), "
                    "got (batch, 784,)") != NULL, "message: %s", e);
    mpt_model_destroy(m);
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {6, 4}, .input_rank = 2}, &m);
    mpt_model_add_global_average_pooling2d(m, NULL);
    CHECK(mpt_model_build(m, 2) == MPT_ERR_SHAPE, "GlobalAveragePooling2D on (6, 4) accepted");
    e = mpt_context_error(q);
    CHECK(strstr(e, "GlobalAveragePooling2D 'global_average_pooling2d'") &&
              strstr(e, "(batch, 6, 4)"), "message: %s", e);
    mpt_model_destroy(m);
    CHECK(count_errors >= 18, "errors were not all logged (%d)", count_errors);
    mpt_context_destroy(q);
}

/* ---- determinism: 1, 2 and 3 threads give the same bits -------------------------- */

typedef struct run_result {
    float *y, *dx, *grads;
    int64_t ny, nx, ng;
} run_result;

static void run_cnn(int threads, mpt_policy policy, run_result *r) {
    mpt_context *c;
    mpt_model *m = NULL;
    const int64_t batch = 7, in[3] = {13, 11, 3};
    int64_t xs[4] = {batch, in[0], in[1], in[2]}, i;
    int p, n_params;
    float *x;
    mpt_tensor tx, ty, tdy, tdx;
    mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &c);
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {in[0], in[1], in[2]},
                                          .input_rank = 3, .policy = policy, .seed = 9}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 8, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.padding = MPT_PADDING_SAME});
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 5, .kernel_size = {3, 2},
                                               .strides = {2, 1}, .activation = MPT_ACT_GELU});
    mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.padding = MPT_PADDING_SAME});
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 6, .kernel_size = {1, 1},
                                               .activation = MPT_ACT_SOFTMAX});
    mpt_model_add_global_average_pooling2d(m, NULL);
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(c));
    x = (float *)malloc(sizeof(float) * (size_t)(batch * in[0] * in[1] * in[2]));
    test_seed(77);
    for (i = 0; i < batch * in[0] * in[1] * in[2]; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    r->ny = mpt_tensor_count(&ty);
    r->y = (float *)malloc(sizeof(float) * (size_t)r->ny);
    mpt_convert(c, MPT_FLOAT32, r->y, ty.dtype, ty.data, r->ny);
    mpt_model_output_grad(m, &tdy);
    {
        float *dy = (float *)malloc(sizeof(float) * (size_t)r->ny);
        for (i = 0; i < r->ny; i++) dy[i] = (float)test_uniform(-1, 1);
        tdy.dtype = MPT_FLOAT32;
        tdy.data = dy;
        CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward");
        free(dy);
    }
    r->nx = mpt_tensor_count(&tdx);
    r->dx = (float *)malloc(sizeof(float) * (size_t)r->nx);
    mpt_convert(c, MPT_FLOAT32, r->dx, tdx.dtype, tdx.data, r->nx);
    n_params = mpt_model_param_count(m);
    r->ng = 0;
    for (p = 0; p < n_params; p++) {
        mpt_param_info info;
        mpt_model_param(m, p, &info);
        r->ng += mpt_tensor_count(&info.grad);
    }
    r->grads = (float *)malloc(sizeof(float) * (size_t)r->ng);
    r->ng = 0;
    for (p = 0; p < n_params; p++) {
        mpt_param_info info;
        int64_t n;
        mpt_model_param(m, p, &info);
        n = mpt_tensor_count(&info.grad);
        memcpy(r->grads + r->ng, info.grad.data, sizeof(float) * (size_t)n);
        r->ng += n;
    }
    free(x);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

static void free_result(run_result *r) {
    free(r->y);
    free(r->dx);
    free(r->grads);
}

static void test_determinism(void) {
    static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                          MPT_POLICY_MIXED_BFLOAT16};
    int p, t;
    for (p = 0; p < 3; p++) {
        run_result one, many;
        double norm = 0;
        int64_t i;
        run_cnn(1, policies[p], &one);
        for (i = 0; i < one.ng; i++) norm += fabs(one.grads[i]);
        CHECK(norm > 0 && one.ny == 7 * 6 && one.nx == 7 * 13 * 11 * 3, "policy %d: sizes", p);
        for (t = 2; t <= 3; t++) {
            run_cnn(t, policies[p], &many);
            CHECK(memcmp(one.y, many.y, sizeof(float) * (size_t)one.ny) == 0,
                  "policy %d: y differs on %d threads", p, t);
            CHECK(memcmp(one.dx, many.dx, sizeof(float) * (size_t)one.nx) == 0,
                  "policy %d: dx differs on %d threads", p, t);
            CHECK(one.ng == many.ng &&
                      memcmp(one.grads, many.grads, sizeof(float) * (size_t)one.ng) == 0,
                  "policy %d: gradients differ on %d threads", p, t);
            free_result(&many);
        }
        free_result(&one);
    }
}

/* ---- the direct convolution against im2col + GEMM + col2im ------------------ */

/* The SIMD levels: helpers.h's simd_levels (the direct convolution runs
   at the two AVX-512 ones). */

static int direct_calls;      /* conv_direct calls that did the work */
static int kernel_grad_calls; /* of them, kernel gradients          */
static int pairs_calls;       /* of those, from the pixel-pair tables */
static int forward_calls;     /* of them, forward products          */
static int wino_forward_calls; /* forward products by Winograd's transform */
static int wino_kgrad_calls;   /* kernel gradients by Winograd's transform */
static int from_dy_calls;      /* kernel gradients that made dz from dy    */

static int counting_conv_direct(void *impl, const mpt_conv_args *a) {
    int done = mpt__cpu_conv_direct(impl, a);
    direct_calls += done;
    if (a->kernel_grad) kernel_grad_calls += done;
    if (a->kernel_grad && a->dy) from_dy_calls += done;
#if MPT__X86
    if (a->kernel_grad && mpt__kgrad_pairs_takes((const mpt_context *)impl, a))
        pairs_calls += done;
#endif
    if (!a->kernel_grad && !a->input_grad) forward_calls += done;
#if MPT__X86
    if (!a->kernel_grad && !a->input_grad && mpt__wino_takes((const mpt_context *)impl, a))
        wino_forward_calls += done;
    if (mpt__wkg_takes((const mpt_context *)impl, a)) wino_kgrad_calls += done;
#endif
    return done;
}

/* One Conv2D's forward and backward (y, dx, kernel and bias gradients as
   float32), with the backend's direct convolution or without it; the
   bias random, so that the epilogue's sum is checked too. With no_dx the
   backward is asked for no input gradient (a first layer's). */
typedef struct conv_run {
    float *y, *dx, *grads;
    int64_t ny, nx, ng;
} conv_run;

static void run_conv_layer_as(int level, int threads, const layer_ref *d, int64_t batch,
                              mpt_dtype dtype, int direct, int no_dx, conv_run *r) {
    mpt_context *c = NULL;
    mpt_context_desc cd;
    mpt_model *m = NULL;
    mpt_tensor tx, ty, tdy, tdx;
    int64_t xs[4], i, n_x, p;
    float *x, *dy;
    memset(&cd, 0, sizeof cd);
    memset(r, 0, sizeof *r);
    cd.num_threads = threads;
    cd.disable_cpu_features = simd_levels[level].disable;
    mpt_context_create(&cd, &c);
    mpt__cpu_table.conv_direct = direct ? counting_conv_direct : NULL;
    xs[0] = batch, xs[1] = d->g.h, xs[2] = d->g.w, xs[3] = d->g.c;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {d->g.h, d->g.w, d->g.c},
                                          .input_rank = 3, .seed = 9}, &m);
    CHECK(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
              .filters = d->f, .kernel_size = {d->g.kh, d->g.kw}, .strides = {d->g.sh, d->g.sw},
              .padding = d->g.pad, .activation = d->act, .no_bias = !d->bias,
              .bias_initializer = MPT_INIT_GLOROT_UNIFORM, .dtype = dtype}) == MPT_OK &&
              mpt_model_build(m, batch) == MPT_OK,
          "build: %s", mpt_context_error(c));
    n_x = batch * d->g.h * d->g.w * d->g.c;
    x = (float *)malloc(sizeof(float) * (size_t)n_x);
    test_seed(41);
    for (i = 0; i < n_x; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    /* again over a poisoned output (NaN in every dtype): each element
       must be written */
    memset(ty.data, 0xFF, (size_t)mpt_tensor_count(&ty) * mpt_dtype_size(ty.dtype));
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
    r->ny = mpt_tensor_count(&ty);
    r->y = (float *)malloc(sizeof(float) * (size_t)r->ny);
    mpt_convert(c, MPT_FLOAT32, r->y, ty.dtype, ty.data, r->ny);
    mpt_model_output_grad(m, &tdy);
    dy = (float *)malloc(sizeof(float) * (size_t)r->ny);
    for (i = 0; i < r->ny; i++) dy[i] = (float)test_uniform(-1, 1);
    tdy.dtype = MPT_FLOAT32;
    tdy.data = dy;
    CHECK(mpt_model_backward(m, &tdy, no_dx ? NULL : &tdx) == MPT_OK, "backward");
    r->nx = no_dx ? 0 : mpt_tensor_count(&tdx);
    r->dx = (float *)malloc(sizeof(float) * (size_t)(r->nx + 1));
    if (!no_dx) mpt_convert(c, MPT_FLOAT32, r->dx, tdx.dtype, tdx.data, r->nx);
    r->ng = 0;
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        int64_t n;
        mpt_model_param(m, p, &info);
        n = mpt_tensor_count(&info.grad);
        r->grads = (float *)realloc(r->grads, sizeof(float) * (size_t)(r->ng + n));
        memcpy(r->grads + r->ng, info.grad.data, sizeof(float) * (size_t)n);
        r->ng += n;
    }
    mpt__cpu_table.conv_direct = mpt__cpu_conv_direct;
    free(x);
    free(dy);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

static void run_conv_layer(int level, int threads, const layer_ref *d, int64_t batch,
                           mpt_dtype dtype, int direct, conv_run *r) {
    run_conv_layer_as(level, threads, d, batch, dtype, direct, 0, r);
}

static void free_conv_run(conv_run *r) {
    free(r->y);
    free(r->dx);
    free(r->grads);
}

/* The direct path's dx and kernel gradient sum in another order than
   col2im and the GEMM: equal within the rounding of float32 sums, plus,
   for dx in bfloat16, one rounding of the result. Relative to the
   element's size plus the mean size. */
static int close_to(const float *a, const float *b, int64_t n, double tol, double *worst) {
    double scale = 0;
    int64_t i;
    *worst = 0;
    for (i = 0; i < n; i++) scale += fabs(b[i]) / (double)n;
    for (i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]) / (fabs(b[i]) + scale + 1e-30);
        if (!(e <= *worst)) *worst = e;
    }
    return *worst <= tol;
}

/* Forward: the im2col path's bits exactly (same sums in the same order),
   except where Winograd's transform takes it (float32 and float16 3×3 of
   stride 1: close, like dx; float32 within 4e-5, F(4×4, 3×3)'s error
   measured up to 1.2e-5); dx, kernel and bias gradients: close; everything the
   same bits on 1 and 2 threads. Odd shapes (tails of 12-pixel tiles
   and of 16-lane output blocks, both paddings, strides 1-3, depths over
   the GEMM's 512 block) at every SIMD level and dtype. */
static void test_direct_conv(void) {
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_BFLOAT16, MPT_FLOAT16};
    layer_ref cases[29];
    int n_cases = 0, level, k, t, ran_f32 = 0, ran_bf16 = 0, ran_shallow = 0, ran_pairs = 0;
    int ran_shallow_fwd = 0, ran_wino = 0, ran_wkg = 0, ran_from_dy = 0;
    cases[n_cases++] = conv_case(9, 7, 16, 33, 3, 3, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(8, 11, 18, 16, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_NONE, 0);
    cases[n_cases++] = conv_case(7, 9, 20, 34, 3, 2, 2, 2, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(5, 6, 64, 20, 3, 3, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(6, 5, 40, 17, 4, 4, 1, 3, MPT_PADDING_SAME, MPT_ACT_TANH, 1);
    cases[n_cases++] = conv_case(4, 4, 17, 48, 2, 2, 1, 1, MPT_PADDING_VALID, MPT_ACT_SIGMOID, 1);
    cases[n_cases++] = conv_case(5, 3, 32, 64, 1, 1, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(10, 10, 1, 32, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    /* float32's kernel gradient takes channels 8 at a time: 9 is a block
       and a shifted one, 61 filters two 32-filter blocks with a tail */
    cases[n_cases++] = conv_case(7, 8, 9, 61, 3, 3, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    /* dx of a 'valid' layer 26 pixels wide: tiles of 12 inside its border
       rows, whose taps read only dz's padding (the direct path skips them) */
    cases[n_cases++] = conv_case(16, 26, 12, 16, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    /* a shallow input's kernel gradient takes 12 rows (tap, channel) by 32
       filters at a time: 27 rows are two blocks and a tail of 3, 30 two
       and 6, 20 filters a block's first half and 4 of its second, 33 a
       block and 1; windows across the padding and strides */
    cases[n_cases++] = conv_case(9, 11, 3, 20, 3, 3, 2, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(7, 6, 5, 33, 2, 3, 1, 2, MPT_PADDING_VALID, MPT_ACT_NONE, 0);
    cases[n_cases++] = conv_case(13, 12, 7, 16, 5, 4, 3, 2, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    /* and over more pixels than MPT_CONV_SHALLOW_KGRAD_PART (1,292 a
       sample; the layer's chunks are one sample here): two parts or
       more, summed in order */
    cases[n_cases++] = conv_case(40, 36, 1, 20, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    /* bfloat16's kernel gradient from pixel-pair tables (an even number of
       output columns) takes 8 channels by 32 filters of up to 16 taps:
       13 channels are a block and a shifted one, 21 three blocks, the last
       shifted; 50 filters a block and a tail of 18, 40 one and 8; 25
       taps two groups; pairs with one pixel in the padding at both sides
       ('same', stride 2), columns skipped by stride 3 */
    cases[n_cases++] = conv_case(9, 12, 13, 50, 3, 3, 2, 2, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(7, 8, 21, 40, 5, 5, 1, 1, MPT_PADDING_SAME, MPT_ACT_NONE, 0);
    cases[n_cases++] = conv_case(6, 13, 12, 17, 2, 4, 1, 3, MPT_PADDING_VALID, MPT_ACT_TANH, 1);
    /* a one-channel image's forward gathers 12 pixels' windows per tile,
       one output row at a time (rows under 12 pixels wide: several a
       tile), windows cut by the padding on every side; height strides;
       bfloat16 pairs with an odd depth's zero (9, 25, 49 taps); filters in
       blocks of 32 with tails of 10, 8, 1, 17 */
    cases[n_cases++] = conv_case(11, 13, 1, 10, 3, 3, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(15, 9, 1, 40, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(9, 17, 1, 33, 3, 3, 2, 1, MPT_PADDING_VALID, MPT_ACT_NONE, 0);
    cases[n_cases++] = conv_case(5, 29, 1, 16, 7, 7, 3, 1, MPT_PADDING_SAME, MPT_ACT_SIGMOID, 1);
    cases[n_cases++] = conv_case(12, 7, 1, 64, 3, 2, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    cases[n_cases++] = conv_case(3, 3, 1, 17, 5, 5, 1, 1, MPT_PADDING_SAME, MPT_ACT_TANH, 1);
    cases[n_cases++] = conv_case(6, 14, 1, 49, 1, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU, 1);
    /* and more taps than the direct tiles' table holds (MPT__DCONV_MAX_TAPS:
       9 × 9 = 81), whose windows the tiles inside the image read in place */
    cases[n_cases++] = conv_case(14, 30, 1, 24, 9, 9, 1, 1, MPT_PADDING_SAME, MPT_ACT_RELU, 1);
    test_seed(23);
    while (n_cases < 29) {
        geom g;
        random_geom(&g, 9, 40, 4);
        g.c = test_randint(16, 40);
        cases[n_cases] = conv_case(g.h, g.w, g.c, test_randint(16, 40), g.kh, g.kw, g.sh, g.sw,
                                   g.pad, test_randint(0, 1) ? MPT_ACT_RELU : MPT_ACT_NONE,
                                   test_randint(0, 1));
        n_cases++;
    }
    for (level = 0; level < SIMD_LEVELS; level++) {
        mpt_context *probe = NULL;
        mpt_context_create(&(mpt_context_desc){.disable_cpu_features = simd_levels[level].disable},
                           &probe);
        k = (mpt_context_cpu_features(probe) & simd_levels[level].needs) ==
            simd_levels[level].needs;
        mpt_context_destroy(probe);
        if (!k) continue;
        for (k = 0; k < n_cases; k++)
            for (t = 0; t < 3; t++) {
                const layer_ref *d = &cases[k];
                const int64_t batch = 1 + (k + t) % 4;
                conv_run former, one, two;
                double worst = 0;
                int64_t before;
                int calls, wino;
                test__begin();
                run_conv_layer(level, 2, d, batch, dts[t], 0, &former);
                direct_calls = kernel_grad_calls = pairs_calls = forward_calls = 0;
                wino_forward_calls = wino_kgrad_calls = 0;
                run_conv_layer(level, 1, d, batch, dts[t], 1, &one);
                calls = direct_calls;
                wino = wino_forward_calls;
                if (level >= 2 && dts[t] != MPT_BFLOAT16 && d->g.kh == 3 && d->g.kw == 3 &&
                    d->g.sh == 1 && d->g.sw == 1 && d->g.c >= 8 && d->f >= 16) {
                    CHECK(wino_kgrad_calls > 0, "Winograd's kernel gradient did not run");
                    ran_wkg += wino_kgrad_calls > 0;
                }
                if (level >= 2 && dts[t] != MPT_BFLOAT16 && d->g.kh == 3 && d->g.kw == 3 &&
                    d->g.sh == 1 && d->g.sw == 1 && d->g.c >= 16 && d->f >= 16 &&
                    (d->act == MPT_ACT_RELU || d->act == MPT_ACT_NONE)) {
                    CHECK(wino > 0, "the Winograd forward did not run");
                    ran_wino += wino > 0;
                }
                if (level == 3 && dts[t] == MPT_BFLOAT16 && d->g.c >= 12 && d->f <= 64 &&
                    tf_out(d->g.w, d->g.kw, d->g.sw, d->g.pad, &before) % 2 == 0) {
                    CHECK(pairs_calls > 0, "the pixel-pair kernel gradient did not run");
                    ran_pairs += pairs_calls > 0;
                }
                if (d->g.c == 1 && d->g.sw == 1 && d->act != MPT_ACT_GELU &&
                    d->act != MPT_ACT_SOFTMAX &&
                    ((level >= 2 && dts[t] != MPT_BFLOAT16) ||
                     (level == 3 && dts[t] == MPT_BFLOAT16))) {
                    CHECK(forward_calls > 0, "the shallow forward did not run");
                    ran_shallow_fwd += forward_calls > 0;
                }
                if (level >= 2 && d->g.c < (dts[t] == MPT_BFLOAT16 ? 12 : 8)) {
                    CHECK(kernel_grad_calls > 0, "the shallow kernel gradient did not run");
                    ran_shallow += kernel_grad_calls > 0;
                }
                run_conv_layer(level, 2, d, batch, dts[t], 1, &two);
                if (level >= 2 && dts[t] == MPT_FLOAT32 && d->f >= 16 &&
                    d->g.kh * d->g.kw * d->g.c >= 32) {
                    CHECK(calls > 0, "the direct path did not run");
                    ran_f32 += calls > 0;
                }
                if (level == 3 && dts[t] == MPT_BFLOAT16 && d->g.c % 2 == 0 && d->f >= 16 &&
                    d->g.kh * d->g.kw * d->g.c >= 32) {
                    CHECK(calls > 0, "the direct path did not run");
                    ran_bf16 += calls > 0;
                }
                CHECK(one.ny == former.ny &&
                          (wino ? close_to(one.y, former.y, one.ny,
                                           dts[t] == MPT_FLOAT32 ? 4e-5 : 1.0 / 64, &worst)
                                : memcmp(one.y, former.y, sizeof(float) * (size_t)one.ny) == 0),
                      "y differs from the im2col path (by %g relative)", worst);
                CHECK(one.ng == former.ng &&
                          close_to(one.grads, former.grads, one.ng, 1e-5, &worst),
                      "kernel or bias gradient differs from the im2col path's by %g (relative)",
                      worst);
                CHECK(one.nx == former.nx &&
                          close_to(one.dx, former.dx, one.nx,
                                   dts[t] == MPT_FLOAT32 ? 4e-5 : 1.0 / 64, &worst),
                      "dx differs from col2im's by %g (relative)", worst);
                CHECK(memcmp(one.y, two.y, sizeof(float) * (size_t)one.ny) == 0 &&
                          memcmp(one.dx, two.dx, sizeof(float) * (size_t)one.nx) == 0 &&
                          memcmp(one.grads, two.grads, sizeof(float) * (size_t)one.ng) == 0,
                      "1 and 2 threads differ");
                if (level >= 2 && d->g.c < (dts[t] == MPT_BFLOAT16 ? 12 : 8) &&
                    (d->act == MPT_ACT_RELU || d->act == MPT_ACT_NONE)) {
                    /* no dx wanted: dz made from dy in the kernel gradient,
                       the same kernel gradient's bits, the bias's sums in
                       another order */
                    const int64_t nk = d->g.kh * d->g.kw * d->g.c * d->f;
                    conv_run no_dx;
                    from_dy_calls = 0;
                    run_conv_layer_as(level, 2, d, batch, dts[t], 1, 1, &no_dx);
                    CHECK(from_dy_calls > 0, "the kernel gradient did not make dz from dy");
                    ran_from_dy += from_dy_calls > 0;
                    CHECK(no_dx.ng == one.ng &&
                              memcmp(no_dx.grads, one.grads, sizeof(float) * (size_t)nk) == 0,
                          "the kernel gradient differs when dz is made from dy");
                    CHECK(close_to(no_dx.grads + nk, one.grads + nk, one.ng - nk, 1e-6, &worst),
                          "the bias gradient differs by %g (relative) when dz is made from dy",
                          worst);
                    free_conv_run(&no_dx);
                }
                test__end("direct conv %s B=%lld in=(%lld,%lld,%lld) f=%lld k=(%lld,%lld) "
                          "s=(%lld,%lld) %s %s %s",
                          simd_levels[level].name, (long long)batch, (long long)d->g.h,
                          (long long)d->g.w, (long long)d->g.c, (long long)d->f,
                          (long long)d->g.kh, (long long)d->g.kw, (long long)d->g.sh,
                          (long long)d->g.sw, pad_name(d->g.pad), mpt_activation_name(d->act),
                          mpt_dtype_name(dts[t]));
                free_conv_run(&former);
                free_conv_run(&one);
                free_conv_run(&two);
            }
    }
    printf("# direct convolution ran in %d float32 and %d bfloat16 cases; the shallow kernel "
           "gradient in %d, the pixel-pair one in %d, the one-channel forward in %d, "
           "Winograd's forward in %d, its kernel gradient in %d; dz made from dy in %d\n",
           ran_f32, ran_bf16, ran_shallow, ran_pairs, ran_shallow_fwd, ran_wino, ran_wkg,
           ran_from_dy);
}

/* ---- Winograd's F(2×2, 3×3) against double-precision sums ------------------ */

typedef struct wino_case {
    int64_t n, h, w, c, f;
    int64_t top, left, bottom, right; /* zeros around the image            */
    int input_grad, relu, bias;
} wino_case;

/* The product mpt__cpu_conv_direct computes for a: forward, y = act(Σ x·k
   + bias); input gradient, dx(y, x, ch) = Σ dz(y + top − i, x + left − j,
   o)·k(i, j, ch, o). sizes: the sum of the terms' magnitudes per element,
   which bounds a float32 sum's rounding error. */
static void wino_ref(const wino_case *w, const mpt_window *g, const float *in, const float *k,
                     const float *bias, double *out, double *sizes) {
    const int64_t ih = w->input_grad ? g->oh : g->h, iw = w->input_grad ? g->ow : g->w;
    const int64_t oh = w->input_grad ? g->h : g->oh, ow = w->input_grad ? g->w : g->ow;
    const int64_t ic = w->input_grad ? w->f : w->c, oc = w->input_grad ? w->c : w->f;
    int64_t b, y, x, o, i, j, ch;
    for (b = 0; b < w->n; b++)
        for (y = 0; y < oh; y++)
            for (x = 0; x < ow; x++)
                for (o = 0; o < oc; o++) {
                    const int64_t at = ((b * oh + y) * ow + x) * oc + o;
                    double z = bias ? bias[o] : 0, size = fabs(z);
                    for (i = 0; i < 3; i++)
                        for (j = 0; j < 3; j++) {
                            const int64_t yy = w->input_grad ? y + g->top - i : y - g->top + i;
                            const int64_t xx = w->input_grad ? x + g->left - j : x - g->left + j;
                            if (yy < 0 || yy >= ih || xx < 0 || xx >= iw) continue;
                            for (ch = 0; ch < ic; ch++) {
                                const double kv = w->input_grad
                                                      ? k[((i * 3 + j) * w->c + o) * w->f + ch]
                                                      : k[((i * 3 + j) * w->c + ch) * w->f + o];
                                const double t = in[((b * ih + yy) * iw + xx) * ic + ch] * kv;
                                z += t;
                                size += fabs(t);
                            }
                        }
                    out[at] = w->relu && z < 0 ? 0 : z;
                    sizes[at] = size;
                }
}

/* A 3×3 window of stride 1 for the case. */
static void wino_window(const wino_case *w, mpt_window *g) {
    g->h = w->h, g->w = w->w, g->c = w->c, g->kh = g->kw = 3, g->sh = g->sw = 1;
    g->top = w->top, g->left = w->left;
    g->oh = w->h + w->top + w->bottom - 2, g->ow = w->w + w->left + w->right - 2;
}

/* values (n float32) in dt: as_dt, and values themselves rounded to what
   as_dt holds (float16, bfloat16), so that the reference sums the values
   the products read. */
static void wino_round(mpt_context *c, mpt_dtype dt, float *values, void *as_dt, int64_t n) {
    mpt_convert(c, dt, as_dt, MPT_FLOAT32, values, n);
    mpt_convert(c, MPT_FLOAT32, values, dt, as_dt, n);
}

/* The largest error of got (n) against the double-precision sums ref, in
   the terms' summed sizes, less one rounding of the result to dt (half an
   ulp: 2^-11 for float16, 2^-8 for bfloat16; none for float32); *finite
   cleared where got holds a NaN or an infinity. */
static double wino_worst(const float *got, const double *ref, const double *sizes, int64_t n,
                         mpt_dtype dt, int *finite) {
    double worst = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        const double rounding = dt == MPT_FLOAT16    ? ldexp(fabs(ref[i]), -11)
                                : dt == MPT_BFLOAT16 ? ldexp(fabs(ref[i]), -8)
                                                     : 0;
        const double e = (fabs((double)got[i] - ref[i]) - rounding) / (sizes[i] + 1e-30);
        if (!isfinite(got[i])) *finite = 0;
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

/* A 1-thread context where the CPU has AVX-512; else the test named
   `name` is reported skipped and 0 returned. */
static int wino_context(mpt_context **one, const char *name) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, one);
    if (mpt_context_cpu_features(*one) & MPT_CPU_AVX512) return 1;
    test__begin();
    SKIP("no AVX-512: Winograd's transforms are not built for this CPU");
    test__end("%s", name);
    mpt_context_destroy(*one);
    return 0;
}

/* Winograd's products (forward and input gradient, float32, float16 and
   bfloat16, 2×2 and 4×4 tiles) against sums in double: within 4e-6 of the terms'
   summed sizes for F(2×2, 3×3) (measured: 1e-7 to 5e-7), 2e-5 for
   F(4×4, 3×3), whose transforms' larger coefficients cost accuracy
   (measured: 2e-8 to 8.7e-6); a wrong tap, sign or transform coefficient
   is off by a whole term, ~1e-2 of them here, and fails by 3-11
   relative); every output written (poisoned first), the same bits on 1
   and 2 threads. Odd output sizes (part tiles), batches whose tiles
   leave the last task short, channel counts off the 16-lane vectors,
   filters off the 32-filter blocks, padding of 0, 1 and 2 on each side;
   which tile a call takes (mpt__wino_tile_for). */
static void test_winograd(void) {
    static const wino_case cases[] = {
        {3, 26, 26, 32, 32, 0, 0, 0, 0, 0, 1, 1}, /* the seed cnn's second layer */
        {2, 9, 7, 16, 33, 1, 1, 1, 1, 0, 0, 1},
        {1, 5, 6, 64, 20, 1, 1, 1, 1, 0, 1, 1},
        {1, 8, 10, 24, 16, 2, 0, 0, 2, 0, 1, 0},
        {2, 26, 26, 32, 32, 0, 0, 0, 0, 1, 0, 0},
        {3, 12, 12, 17, 40, 0, 0, 0, 0, 1, 0, 0},
        {2, 7, 9, 48, 16, 1, 1, 1, 1, 1, 0, 0},
        {1, 11, 6, 20, 35, 0, 2, 2, 1, 1, 0, 0},
    };
    mpt_context *one = NULL;
    size_t q;
    int variant;
    if (!wino_context(&one, "winograd")) return;
    for (q = 0; q < sizeof cases / sizeof cases[0]; q++)
        for (variant = 0; variant < 6; variant++) {
            static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
            const wino_case *w = &cases[q];
            const int tile = variant >= 3 ? 4 : 2;
            const mpt_dtype dt = dts[variant % 3];
            mpt_window g;
            mpt_conv_args a;
            int64_t n_in, n_out, n_k = 9 * w->c * w->f, i;
            float *in, *k, *bias, *y1, *y2, *yf;
            void *in_dt, *k_dt;
            double *ref, *sizes, worst;
            void *ws;
            int taken = 0, done1, done2, finite = 1;
            wino_window(w, &g);
            n_in = w->n * (w->input_grad ? g.oh * g.ow * w->f : g.h * g.w * w->c);
            n_out = w->n * (w->input_grad ? g.h * g.w * w->c : g.oh * g.ow * w->f);
            in = (float *)malloc(sizeof(float) * (size_t)n_in);
            k = (float *)malloc(sizeof(float) * (size_t)n_k);
            bias = (float *)malloc(sizeof(float) * (size_t)w->f);
            y1 = (float *)malloc(sizeof(float) * (size_t)n_out);
            y2 = (float *)malloc(sizeof(float) * (size_t)n_out);
            yf = (float *)malloc(sizeof(float) * (size_t)n_out);
            in_dt = malloc(sizeof(float) * (size_t)n_in);
            k_dt = malloc(sizeof(float) * (size_t)n_k);
            ref = (double *)malloc(sizeof(double) * (size_t)n_out);
            sizes = (double *)malloc(sizeof(double) * (size_t)n_out);
            ws = malloc((size_t)MPT_CONV_DIRECT_WS_BYTES(9 * w->c, w->c, w->f));
            test_seed(700 + q);
            for (i = 0; i < n_in; i++) in[i] = (float)test_uniform(-1, 1);
            for (i = 0; i < n_k; i++) k[i] = (float)test_uniform(-0.3, 0.3);
            for (i = 0; i < w->f; i++) bias[i] = (float)test_uniform(-0.5, 0.5);
            wino_round(one, dt, in, in_dt, n_in);
            wino_round(one, dt, k, k_dt, n_k);
            memset(&a, 0, sizeof a);
            a.g = &g;
            a.dtype = dt;
            a.input_grad = w->input_grad;
            a.n = w->n;
            a.f = w->f;
            a.x = in_dt;
            a.kernel = k_dt;
            a.bias = w->bias ? bias : NULL;
            a.act = w->relu ? MPT_ACT_RELU : MPT_ACT_NONE;
            a.ws = ws;
            test__begin();
    #if MPT__X86
            taken = mpt__wino_takes(one, &a);
    #endif
            memset(y1, 0xFF, sizeof(float) * (size_t)n_out); /* NaN */
            memset(y2, 0xFF, sizeof(float) * (size_t)n_out);
            done1 = done2 = 0;
    #if MPT__X86
            if (taken) { /* this tile, whichever mpt__cpu_conv_direct would pick */
                a.y = y1;
                mpt__wino(one, &a, tile);
                a.y = y2;
                mpt__wino(ctx, &a, tile);
                done1 = done2 = 1;
            }
    #endif
            wino_ref(w, &g, in, k, a.bias, ref, sizes);
            mpt_convert(one, MPT_FLOAT32, yf, dt, y1, n_out);
            worst = wino_worst(yf, ref, sizes, n_out, dt, &finite);
            CHECK(taken && done1 && done2, "Winograd's products did not take the case");
            CHECK(finite, "an output was not written (NaN left)");
            CHECK(worst <= (tile == 4 ? 2e-5 : 4e-6),
                  "off the double-precision sums by %g of the terms' sizes", worst);
            CHECK(memcmp(y1, y2, mpt_dtype_size(dt) * (size_t)n_out) == 0,
                  "1 and 2 threads differ");
            test__end("winograd F(%dx%d, 3x3) %s n=%lld in=(%lld,%lld,%lld) f=%lld "
                      "pad=(%lld,%lld,%lld,%lld)%s%s %s: error %.2g of the terms' sizes",
                      tile, tile, w->input_grad ? "input_grad" : "forward", (long long)w->n,
                      (long long)w->h,
                      (long long)w->w, (long long)w->c, (long long)w->f, (long long)w->top,
                      (long long)w->left, (long long)w->bottom, (long long)w->right,
                      w->relu ? " relu" : "", w->bias ? " bias" : "", mpt_dtype_name(dt), worst);
            free(in), free(k), free(bias), free(y1), free(y2), free(yf), free(ref), free(sizes);
            free(in_dt), free(k_dt), free(ws);
        }
    /* what it leaves to the other paths */
    {
        mpt_window g = {10, 10, 32, 3, 3, 2, 2, 0, 0, 4, 4};
        mpt_conv_args a;
        test__begin();
        memset(&a, 0, sizeof a);
        a.g = &g, a.dtype = MPT_FLOAT32, a.n = 1, a.f = 32, a.act = MPT_ACT_RELU;
#if MPT__X86
        CHECK(!mpt__wino_takes(one, &a), "took stride 2");
        g.sh = g.sw = 1, g.oh = g.ow = 8;
        CHECK(mpt__wino_takes(one, &a), "declined stride 1");
        a.act = MPT_ACT_TANH;
        CHECK(!mpt__wino_takes(one, &a), "took tanh");
        a.act = MPT_ACT_RELU, a.dtype = MPT_BFLOAT16;
        CHECK(mpt__wino_takes(one, &a), "declined bfloat16");
        a.dtype = MPT_FLOAT32, a.f = 8;
        CHECK(!mpt__wino_takes(one, &a), "took 8 filters");
        a.f = 32; /* 8×8 outputs: 4 tiles of 4×4 (144 products) or 16 of 2×2 (256) */
        CHECK(mpt__wino_tile_for(&a) == 4, "8×8 outputs not in 4×4 tiles");
        g.oh = g.ow = 10; /* 9 tiles of 4×4 (324 products) or 25 of 2×2 (400) */
        CHECK(mpt__wino_tile_for(&a) == 4, "10×10 outputs not in 4×4 tiles");
        g.oh = g.ow = 6; /* 4 tiles of 4×4, half of them past the edge: 144, as 2×2's */
        CHECK(mpt__wino_tile_for(&a) == 2, "6×6 outputs not in 2×2 tiles");
        g.oh = g.ow = 8, g.c = MPT__WINO4_MAX_C + 1; /* V would not fit the scratch */
        CHECK(mpt__wino_tile_for(&a) == 2, "%d channels in 4×4 tiles", MPT__WINO4_MAX_C + 1);
#endif
        test__end("winograd declines stride 2, tanh, 8 filters; picks its tile");
    }
    mpt_context_destroy(one);
}

/* Winograd's kernel gradient (x and dz in float32, float16 and
   bfloat16, 2×2 and 4×4 tiles) against sums in double: dkernel(i, j, c, o)
   = Σ x(b, y − top + i, x − left + j, c) · dz(b, y, x, o), within 4e-6 of
   the terms' summed sizes for 2×2 tiles (measured: about 1e-7), 1e-5 for
   4×4 (measured: up to 1.5e-6), written whole (poisoned
   first) or added to what dkernel held; the same bits on 1 and 2 threads.
   Channel counts off the 8-channel blocks and the 16-lane vectors,
   filters off the 32-filter blocks, odd output sizes (half tiles), tile
   counts that leave the last span short, more spans than groups,
   paddings of 0, 1 and 2; 16 filters (one vector: ResNet-20's first
   stage) with 16 channels, with 9 and with 24 (a block of 16 partly
   empty). */
static void test_winograd_kernel_grad(void) {
    static const wino_case cases[] = {
        {3, 26, 26, 32, 32, 0, 0, 0, 0, 0, 0, 0}, /* the seed cnn's second layer */
        {5, 12, 12, 32, 64, 0, 0, 0, 0, 0, 0, 0},
        {2, 9, 7, 9, 17, 1, 1, 1, 1, 0, 0, 0},
        {1, 8, 10, 24, 40, 2, 0, 0, 2, 0, 0, 0},
        {4, 11, 6, 20, 33, 0, 2, 2, 1, 0, 0, 0},
        {2, 10, 10, 64, 64, 1, 1, 1, 1, 0, 0, 0},
        /* 34 spans of 64 tiles in 8 groups: tasks sum 4 or 5 spans each */
        {15, 26, 26, 32, 32, 0, 0, 0, 0, 0, 0, 0},
        {3, 28, 28, 16, 16, 1, 1, 1, 1, 0, 0, 0}, /* ResNet-20's first stage */
        {2, 9, 11, 9, 16, 0, 1, 2, 1, 0, 0, 0},
        {2, 12, 10, 24, 16, 1, 1, 1, 1, 0, 0, 0},
    };
    mpt_context *one = NULL;
    size_t q;
    int variant;
    if (!wino_context(&one, "winograd kernel gradient")) return;
    for (q = 0; q < sizeof cases / sizeof cases[0]; q++)
        for (variant = 0; variant < 12; variant++) {
            static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
            const int accumulate = variant & 1, tile = variant >= 6 ? 4 : 2;
            const mpt_dtype dt = dts[variant / 2 % 3];
            const wino_case *w = &cases[q];
            mpt_window g;
            mpt_conv_args a;
            int64_t n_x, n_dz, n_k = 9 * w->c * w->f, i, b, y, x, t, c, o;
            float *xs, *dz, *start, *k1, *k2;
            void *xs_dt, *dz_dt;
            double *ref, *sizes, worst;
            void *ws;
            int taken = 0, done1, done2, finite = 1;
            wino_window(w, &g);
            n_x = w->n * g.h * g.w * w->c;
            n_dz = w->n * g.oh * g.ow * w->f;
            xs = (float *)malloc(sizeof(float) * (size_t)n_x);
            dz = (float *)malloc(sizeof(float) * (size_t)n_dz);
            start = (float *)malloc(sizeof(float) * (size_t)n_k);
            k1 = (float *)malloc(sizeof(float) * (size_t)n_k);
            k2 = (float *)malloc(sizeof(float) * (size_t)n_k);
            ref = (double *)calloc((size_t)n_k, sizeof(double));
            sizes = (double *)calloc((size_t)n_k, sizeof(double));
            xs_dt = malloc(sizeof(float) * (size_t)n_x);
            dz_dt = malloc(sizeof(float) * (size_t)n_dz);
            ws = malloc((size_t)MPT_CONV_WINO_KGRAD_WS_BYTES(&g, w->n, w->f));
            test_seed(800 + 4 * q + (size_t)variant);
            for (i = 0; i < n_x; i++) xs[i] = (float)test_uniform(-1, 1);
            for (i = 0; i < n_dz; i++) dz[i] = (float)test_uniform(-1, 1);
            wino_round(one, dt, xs, xs_dt, n_x);
            wino_round(one, dt, dz, dz_dt, n_dz);
            for (i = 0; i < n_k; i++) start[i] = (float)test_uniform(-2, 2);
            for (i = 0; i < n_k; i++) {
                ref[i] = accumulate ? start[i] : 0;
                sizes[i] = fabs(ref[i]);
            }
            for (b = 0; b < w->n; b++)
                for (y = 0; y < g.oh; y++)
                    for (x = 0; x < g.ow; x++)
                        for (t = 0; t < 9; t++) {
                            const int64_t yy = y - g.top + t / 3, xx = x - g.left + t % 3;
                            if (yy < 0 || yy >= g.h || xx < 0 || xx >= g.w) continue;
                            for (c = 0; c < w->c; c++)
                                for (o = 0; o < w->f; o++) {
                                    const double term =
                                        (double)xs[((b * g.h + yy) * g.w + xx) * w->c + c] *
                                        dz[((b * g.oh + y) * g.ow + x) * w->f + o];
                                    ref[(t * w->c + c) * w->f + o] += term;
                                    sizes[(t * w->c + c) * w->f + o] += fabs(term);
                                }
                        }
            memset(&a, 0, sizeof a);
            a.g = &g;
            a.dtype = dt;
            a.kernel_grad = 1;
            a.n = w->n;
            a.f = w->f;
            a.x = xs_dt;
            a.dz = dz_dt;
            a.accumulate = accumulate;
            a.ws = ws;
            test__begin();
#if MPT__X86
            taken = mpt__wkg_takes(one, &a);
#endif
            if (accumulate) {
                memcpy(k1, start, sizeof(float) * (size_t)n_k);
                memcpy(k2, start, sizeof(float) * (size_t)n_k);
            } else {
                memset(k1, 0xFF, sizeof(float) * (size_t)n_k); /* NaN */
                memset(k2, 0xFF, sizeof(float) * (size_t)n_k);
            }
            done1 = done2 = 0;
#if MPT__X86
            if (taken) { /* this tile, whichever mpt__cpu_conv_direct would pick */
                a.dkernel = k1;
                mpt__wkg(one, &a, tile);
                a.dkernel = k2;
                mpt__wkg(ctx, &a, tile);
                done1 = done2 = 1;
            }
#endif
            worst = wino_worst(k1, ref, sizes, n_k, MPT_FLOAT32, &finite); /* dkernel: float32 */
            CHECK(taken && done1 && done2, "Winograd's kernel gradient did not take the case");
            CHECK(finite, "a kernel gradient element was not written (NaN left)");
            CHECK(worst <= (tile == 4 ? 1e-5 : 4e-6),
                  "off the double-precision sums by %g of the terms' sizes", worst);
            CHECK(memcmp(k1, k2, sizeof(float) * (size_t)n_k) == 0, "1 and 2 threads differ");
            test__end("winograd kernel_grad %dx%d tiles n=%lld in=(%lld,%lld,%lld) f=%lld "
                      "pad=(%lld,%lld,%lld,%lld)%s %s: error %.2g of the terms' sizes", tile, tile,
                      (long long)w->n, (long long)w->h, (long long)w->w, (long long)w->c,
                      (long long)w->f, (long long)w->top, (long long)w->left,
                      (long long)w->bottom, (long long)w->right,
                      accumulate ? " accumulate" : "", mpt_dtype_name(dt), worst);
            free(xs), free(dz), free(start), free(k1), free(k2), free(ref), free(sizes), free(ws);
            free(xs_dt), free(dz_dt);
        }
    {   /* what it leaves to the direct tiles */
        mpt_window g = {10, 10, 32, 3, 3, 1, 1, 0, 0, 8, 8};
        mpt_conv_args a;
        char ws[16];
        test__begin();
        memset(&a, 0, sizeof a);
        a.g = &g, a.dtype = MPT_FLOAT32, a.kernel_grad = 1, a.n = 1, a.f = 32, a.ws = ws;
#if MPT__X86
        CHECK(mpt__wkg_takes(one, &a), "declined a 3×3 of stride 1");
        a.ws = NULL;
        CHECK(!mpt__wkg_takes(one, &a), "took a call without a workspace");
        a.ws = ws, g.c = 4;
        CHECK(!mpt__wkg_takes(one, &a), "took 4 channels");
        g.c = 256, a.f = 256;
        CHECK(!mpt__wkg_takes(one, &a), "took 256 × 256 (spans under 16 tiles)");
        g.c = 32, a.f = 32, g.sh = 2;
        CHECK(!mpt__wkg_takes(one, &a), "took stride 2");
#endif
        test__end("winograd kernel gradient declines no workspace, 4 channels, 256 × 256, "
                  "stride 2");
    }
    mpt_context_destroy(one);
}

/* ---- the backward pass's elementwise work across threads -------------------- */

/* The activation gradient and the bias gradient's column sums of a
   convolution-sized dz (tens of thousands of rows: the backend splits them
   into tasks) against one call of the serial code and a plain loop over
   rows in order: the same bits, on 1 and 2 threads, at every SIMD level.
   Odd row counts and column counts off the 16-column blocks, outputs
   poisoned first. */
static void test_backward_elementwise_threads(void) {
    static const struct {
        mpt_activation act;
        mpt_dtype dtype;
        int64_t rows, cols;
    } cases[] = {
        {MPT_ACT_RELU, MPT_FLOAT32, 40007, 32},   {MPT_ACT_RELU, MPT_BFLOAT16, 9001, 37},
        {MPT_ACT_GELU, MPT_FLOAT32, 12345, 21},   {MPT_ACT_SIGMOID, MPT_FLOAT16, 3001, 53},
        {MPT_ACT_SOFTMAX, MPT_FLOAT32, 5003, 10}, {MPT_ACT_NONE, MPT_FLOAT32, 70001, 3},
        {MPT_ACT_TANH, MPT_FLOAT32, 700, 1031},
    };
    int k, threads, level;
    for (level = 0; level < SIMD_LEVELS; level++)
    for (k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++)
        for (threads = 1; threads <= 2; threads++) {
            const int64_t rows = cases[k].rows, cols = cases[k].cols, n = rows * cols;
            const mpt_dtype dt = cases[k].dtype;
            const size_t es = mpt_dtype_size(dt);
            unsigned char *z = (unsigned char *)malloc(es * (size_t)n);
            unsigned char *y = (unsigned char *)malloc(es * (size_t)n);
            unsigned char *dy = (unsigned char *)malloc(es * (size_t)n);
            float *dz = (float *)malloc(sizeof(float) * (size_t)n);
            float *want = (float *)malloc(sizeof(float) * (size_t)n);
            float *tmp = (float *)malloc(sizeof(float) * (size_t)n);
            float *sums = (float *)malloc(sizeof(float) * (size_t)cols);
            float *want_sums = (float *)malloc(sizeof(float) * (size_t)cols);
            mpt_context *c = NULL, *one = NULL;
            int64_t i, r;
            test__begin();
            mpt_context_create(
                &(mpt_context_desc){.num_threads = threads,
                                    .disable_cpu_features = simd_levels[level].disable},
                &c);
            mpt_context_create(
                &(mpt_context_desc){.num_threads = 1,
                                    .disable_cpu_features = simd_levels[level].disable},
                &one);
            test_seed(61 + (uint64_t)k);
            for (i = 0; i < n; i++) {
                mpt__store_f32(dt, z, i, (float)test_uniform(-3, 3));
                mpt__store_f32(dt, y, i, (float)test_uniform(-1, 1));
                mpt__store_f32(dt, dy, i, (float)test_uniform(-1, 1));
            }
            for (i = 0; i < n; i++) dz[i] = want[i] = NAN;
            mpt__activation_grad(one, cases[k].act, dt, z, y, dy, want, tmp, n, cols);
            mpt__cpu_table.activation_grad(c, cases[k].act, dt, z, y, dy, dz, tmp, rows, cols);
            CHECK(memcmp(dz, want, sizeof(float) * (size_t)n) == 0,
                  "activation gradient differs from one serial call");
            for (i = 0; i < cols; i++) want_sums[i] = sums[i] = (float)test_uniform(-1, 1);
            for (r = 0; r < rows; r++)
                for (i = 0; i < cols; i++) want_sums[i] += want[r * cols + i];
            mpt__cpu_table.column_sums(c, dz, rows, cols, sums, 1);
            CHECK(memcmp(sums, want_sums, sizeof(float) * (size_t)cols) == 0,
                  "accumulated column sums differ from rows added in order");
            for (i = 0; i < cols; i++) sums[i] = NAN;
            mpt__cpu_table.column_sums(c, dz, rows, cols, sums, 0);
            for (i = 0; i < cols; i++) want_sums[i] = 0;
            for (r = 0; r < rows; r++)
                for (i = 0; i < cols; i++) want_sums[i] += want[r * cols + i];
            CHECK(memcmp(sums, want_sums, sizeof(float) * (size_t)cols) == 0,
                  "column sums differ from rows added in order");
            test__end("backward elementwise %s %s %s %lldx%lld on %d threads",
                      simd_levels[level].name, mpt_activation_name(cases[k].act),
                      mpt_dtype_name(dt), (long long)rows, (long long)cols, threads);
            mpt_context_destroy(c);
            mpt_context_destroy(one);
            free(z), free(y), free(dy), free(dz), free(want), free(tmp), free(sums),
                free(want_sums);
        }
}

/* The backend's one-pass start of a layer's backward (dz in dtype and the
   bias gradient) against the three calls it replaces: dz the same bits as
   activation_grad's float32 rounded by convert, the sums those of its
   documented order (each block of mpt__elementwise_task_rows rows summed
   in row order, the blocks then added in order to what was there), on 1 and 2
   threads at every SIMD level; and within a few float32 roundings of the
   exact sums. Outputs poisoned first; a NaN y passes dy, as ReLU's
   gradient does. Activations it does not do are declined untouched (the
   GELUs': test_dz_gelu). */
static void test_dz_and_bias_grad(void) {
    static const struct {
        mpt_activation act;
        mpt_dtype dtype;
        int64_t rows, cols;
    } cases[] = {
        {MPT_ACT_RELU, MPT_FLOAT32, 40007, 32}, {MPT_ACT_RELU, MPT_BFLOAT16, 9001, 37},
        {MPT_ACT_RELU, MPT_FLOAT16, 3001, 64},  {MPT_ACT_NONE, MPT_BFLOAT16, 130, 512},
        {MPT_ACT_NONE, MPT_FLOAT32, 70001, 3},  {MPT_ACT_RELU, MPT_BFLOAT16, 50, 16},
    };
    int k, threads, level, accumulate;
    for (level = 0; level < SIMD_LEVELS; level++)
    for (k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++)
        for (threads = 1; threads <= 2; threads++)
        for (accumulate = 0; accumulate <= 1; accumulate++) {
            const int64_t rows = cases[k].rows, cols = cases[k].cols, n = rows * cols;
            const int64_t block = mpt__elementwise_task_rows(cols);
            const mpt_dtype dt = cases[k].dtype;
            const size_t es = mpt_dtype_size(dt);
            unsigned char *y = (unsigned char *)malloc(es * (size_t)n);
            unsigned char *dy = (unsigned char *)malloc(es * (size_t)n);
            unsigned char *dz = (unsigned char *)malloc(es * (size_t)n);
            unsigned char *want = (unsigned char *)malloc(es * (size_t)n);
            float *dzf = (float *)malloc(sizeof(float) * (size_t)n);
            float *tmp = (float *)malloc(sizeof(float) * (size_t)n);
            float *sums = (float *)malloc(sizeof(float) * (size_t)cols);
            float *want_sums = (float *)malloc(sizeof(float) * (size_t)cols);
            float *part = (float *)malloc(sizeof(float) * (size_t)cols);
            double *exact = (double *)malloc(sizeof(double) * (size_t)cols);
            mpt_context *c = NULL, *one = NULL;
            int64_t i, r, b;
            int close = 1;
            test__begin();
            mpt_context_create(
                &(mpt_context_desc){.num_threads = threads,
                                    .disable_cpu_features = simd_levels[level].disable},
                &c);
            mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &one);
            test_seed(71 + (uint64_t)k);
            for (i = 0; i < n; i++) {
                mpt__store_f32(dt, y, i, i == 5 ? NAN : (float)test_uniform(-1, 1));
                mpt__store_f32(dt, dy, i, (float)test_uniform(-1, 1));
            }
            memset(dz, 0xff, es * (size_t)n); /* NaN in every dtype */
            for (i = 0; i < cols; i++)
                want_sums[i] = sums[i] = accumulate ? (float)test_uniform(-1, 1) : NAN;
            mpt__activation_grad(one, cases[k].act, dt, NULL, y, dy, dzf, tmp, n, cols);
            if (dt == MPT_FLOAT32)
                memcpy(want, dzf, sizeof(float) * (size_t)n);
            else
                mpt__convert_scalar(dt, want, MPT_FLOAT32, dzf, n);
            if (!accumulate)
                for (i = 0; i < cols; i++) want_sums[i] = 0;
            for (i = 0; i < cols; i++) exact[i] = want_sums[i];
            for (b = 0; b * block < rows; b++) {
                for (i = 0; i < cols; i++) part[i] = 0;
                for (r = b * block; r < MPT__MIN(rows, (b + 1) * block); r++)
                    for (i = 0; i < cols; i++) {
                        part[i] += dzf[r * cols + i];
                        exact[i] += dzf[r * cols + i];
                    }
                for (i = 0; i < cols; i++) want_sums[i] += part[i];
            }
            CHECK(mpt__cpu_table.dz_and_bias_grad(c, cases[k].act, dt, y, dy, dz, sums,
                                                   accumulate, rows, cols, tmp) == 1,
                  "taken");
            CHECK(memcmp(dz, want, es * (size_t)n) == 0,
                  "dz differs from the activation gradient rounded to dtype");
            CHECK(memcmp(sums, want_sums, sizeof(float) * (size_t)cols) == 0,
                  "bias gradient differs from its blocks added in order");
            for (i = 0; i < cols; i++)
                close &= fabs(sums[i] - exact[i]) <= 1e-5 * (double)rows;
            CHECK(close, "bias gradient far from the exact sums");
            for (i = 0; i < cols; i++) sums[i] = 7.0f;
            CHECK(mpt__cpu_table.dz_and_bias_grad(c, MPT_ACT_SIGMOID, dt, y, dy, dz, sums, 0,
                                                   rows, cols, tmp) == 0 &&
                      sums[0] == 7.0f && memcmp(dz, want, es * (size_t)n) == 0,
                  "sigmoid declined, nothing written");
            test__end("dz and bias gradient %s %s %s %lldx%lld on %d threads%s",
                      simd_levels[level].name, mpt_activation_name(cases[k].act),
                      mpt_dtype_name(dt), (long long)rows, (long long)cols, threads,
                      accumulate ? ", accumulated" : "");
            mpt_context_destroy(c);
            mpt_context_destroy(one);
            free(y), free(dy), free(dz), free(want), free(dzf), free(tmp), free(sums),
                free(want_sums), free(part), free(exact);
        }
}

/* The same one pass for the GELUs, z (their pre-activation) in y's
   place, against the three calls it replaces, bit for bit: dz
   activation_grad's float32 rounded by convert, and the bias gradient
   column_sums' (each column's rows added in row order to what was there),
   on 1 and 3 threads at every SIMD level, with and without a bias, fresh
   and accumulated; wide enough to go to the pool, narrow and odd. z holds
   a NaN, ±inf, zeros and values past GELU's tails (a column's sum of two
   different NaNs may keep either: any NaN matches any); outputs poisoned
   first. */
static void test_dz_gelu(void) {
    static const struct {
        mpt_activation act;
        mpt_dtype dtype;
        int64_t rows, cols;
    } cases[] = {
        {MPT_ACT_GELU, MPT_FLOAT32, 300, 1024},     {MPT_ACT_GELU, MPT_BFLOAT16, 257, 1000},
        {MPT_ACT_GELU, MPT_FLOAT16, 4001, 37},      {MPT_ACT_GELU_TANH, MPT_FLOAT32, 129, 515},
        {MPT_ACT_GELU_TANH, MPT_BFLOAT16, 70, 256}, {MPT_ACT_GELU, MPT_BFLOAT16, 3, 5},
    };
    int k, threads, level, mode;
    for (level = 0; level < SIMD_LEVELS; level++)
        for (k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++)
            for (threads = 1; threads <= 3; threads += 2)
                for (mode = 0; mode < 3; mode++) { /* no bias, fresh, accumulated */
                    const int64_t rows = cases[k].rows, cols = cases[k].cols, n = rows * cols;
                    const mpt_dtype dt = cases[k].dtype;
                    const size_t es = mpt_dtype_size(dt);
                    unsigned char *z = (unsigned char *)malloc(es * (size_t)n);
                    unsigned char *dy = (unsigned char *)malloc(es * (size_t)n);
                    unsigned char *dz = (unsigned char *)malloc(es * (size_t)n);
                    unsigned char *want = (unsigned char *)malloc(es * (size_t)n);
                    float *dzf = (float *)malloc(sizeof(float) * (size_t)n);
                    float *tmp = (float *)malloc(sizeof(float) * (size_t)n);
                    float *sums = (float *)malloc(sizeof(float) * (size_t)cols);
                    float *want_sums = (float *)malloc(sizeof(float) * (size_t)cols);
                    static const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f,
                                                     9.5f, -9.5f, 30.0f, -30.0f};
                    mpt_context *c = NULL;
                    int64_t i;
                    test__begin();
                    c = path_ctx(threads, simd_levels[level].disable);
                    test_seed(91 + (uint64_t)k);
                    for (i = 0; i < n; i++) {
                        mpt__store_f32(dt, z, i,
                                       i % 97 < 9 ? specials[i % 97] : (float)test_uniform(-6, 6));
                        mpt__store_f32(dt, dy, i, (float)test_uniform(-1, 1));
                    }
                    memset(dz, 0xff, es * (size_t)n); /* NaN in every dtype */
                    for (i = 0; i < cols; i++)
                        want_sums[i] = sums[i] = mode == 2 ? (float)test_uniform(-1, 1) : NAN;
                    /* the three calls: gradient, column sums, rounding */
                    mpt__cpu_table.activation_grad(c, cases[k].act, dt, z, NULL, dy, dzf, tmp,
                                                   rows, cols);
                    if (mode) mpt__cpu_table.column_sums(c, dzf, rows, cols, want_sums, mode == 2);
                    mpt__cpu_table.convert(c, dt, want, MPT_FLOAT32, dzf, n);
                    CHECK(mpt__cpu_table.dz_and_bias_grad(c, cases[k].act, dt, z, dy, dz,
                                                           mode ? sums : NULL, mode == 2, rows,
                                                           cols, tmp) == 1,
                          "taken");
                    CHECK(memcmp(dz, want, es * (size_t)n) == 0,
                          "dz differs from the GELU's gradient rounded to dtype");
                    for (i = 0; i < cols; i++) /* a NaN's sign and payload are the compiler's */
                        if (memcmp(&sums[i], &want_sums[i], sizeof(float)) &&
                            !(isnan(sums[i]) && isnan(want_sums[i])))
                            break;
                    CHECK(i == cols, "bias gradient differs from column_sums' at column %lld",
                          (long long)i);
                    test__end("dz and bias gradient %s %s %s %lldx%lld on %d threads%s",
                              simd_levels[level].name, mpt_activation_name(cases[k].act),
                              mpt_dtype_name(dt), (long long)rows, (long long)cols, threads,
                              mode == 0 ? ", no bias" : mode == 2 ? ", accumulated" : "");
                    mpt_context_destroy(c);
                    free(z), free(dy), free(dz), free(want), free(dzf), free(tmp), free(sums),
                        free(want_sums);
                }
}

/* ---- predict's plan: BatchNormalization folded, a ReLU fused, threads by size ----
   (@impl-predict) */

/* Every parameter of m named "<layer>/<suffix>" set to uniform values in
   [lo, hi) from the test's generator, then the model told (refresh_weights). */
static void plan_set(mpt_model *m, const char *suffix, double lo, double hi) {
    int p;
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        const char *slash;
        int64_t i;
        mpt_model_param(m, p, &info);
        slash = strrchr(info.name, '/');
        if (!slash || strcmp(slash + 1, suffix) != 0) continue;
        for (i = 0; i < mpt_tensor_count(&info.value); i++)
            ((float *)info.value.data)[i] = (float)test_uniform(lo, hi);
    }
    mpt_model_refresh_weights(m);
}

/* The float32 values of layer `layer`'s parameter `suffix` as doubles
   (malloc'd); NULL where it has none. */
static double *plan_param(mpt_model *m, const char *layer, const char *suffix) {
    mpt_param_info info;
    int64_t i, n;
    double *v;
    if (!test_param_named(m, layer, suffix, &info)) return NULL;
    n = mpt_tensor_count(&info.value);
    v = (double *)malloc(sizeof(double) * (size_t)n);
    for (i = 0; i < n; i++) v[i] = ((const float *)info.value.data)[i];
    return v;
}

/* BatchNormalization's statistics and scale set to what a trained one
   holds (moving mean and beta around 0, variance and gamma around 1), and
   biases nonzero. */
static void plan_train_like(mpt_model *m, unsigned long long seed) {
    test_seed(seed);
    plan_set(m, "moving_mean", -0.5, 0.5);
    plan_set(m, "moving_variance", 0.3, 2.0);
    plan_set(m, "gamma", 0.5, 1.5);
    plan_set(m, "beta", -0.5, 0.5);
    plan_set(m, "bias", -0.3, 0.3);
}

/* What a fold case is: one layer giving a Conv2D (kernel k×k, stride s,
   padding pad) or, with k 0, a Flatten and Dense of f units, then a
   BatchNormalization, then (relu) a ReLU Activation, the model's output. */
typedef struct fold_case {
    int64_t h, w, c, f, k, s;
    mpt_padding pad;
    int bias, relu;
    const char *path; /* what the products take there, for the report */
    int packed;       /* the GEMM runs on the folded kernel packed ahead */
} fold_case;

static mpt_model *fold_model(mpt_context *c, const fold_case *fc, int64_t batch) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {fc->h, fc->w, fc->c}, .input_rank = 3,
                                          .seed = 5}, &m);
    if (fc->k) {
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = fc->f,
                                                   .kernel_size = {fc->k, fc->k},
                                                   .strides = {fc->s, fc->s}, .padding = fc->pad,
                                                   .no_bias = !fc->bias});
    } else {
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = fc->f, .no_bias = !fc->bias});
    }
    mpt_model_add_batch_normalization(m, NULL);
    if (fc->relu)
        mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(c));
    return m;
}

/* The fold's exact values in double, y = relu((z − mean)·s + beta) with z
   = x·kernel + bias and s = gamma / sqrt(variance + epsilon), and each
   element's size S = |s|·(Σ|x·kernel| + |bias|) + |mean·s| + |beta|, the
   sum of the magnitudes of what makes it. */
static void fold_ref(mpt_model *m, const fold_case *fc, int64_t batch, const float *x, double *y,
                     double *size) {
    const char *layer = mpt_model_layer_name(m, fc->k ? 0 : 1);
    const char *bn = mpt_model_layer_name(m, fc->k ? 1 : 2);
    double *kernel = plan_param(m, layer, "kernel"), *bias = plan_param(m, layer, "bias");
    double *mean = plan_param(m, bn, "moving_mean"), *var = plan_param(m, bn, "moving_variance");
    double *gamma = plan_param(m, bn, "gamma"), *beta = plan_param(m, bn, "beta");
    const int64_t n_in = batch * fc->h * fc->w * fc->c;
    int64_t n_k = fc->k ? fc->k * fc->k * fc->c * fc->f : fc->h * fc->w * fc->c * fc->f;
    double *xd = (double *)malloc(sizeof(double) * (size_t)n_in);
    double *xa = (double *)malloc(sizeof(double) * (size_t)n_in);
    double *ka = (double *)malloc(sizeof(double) * (size_t)n_k);
    double *z, *za;
    int64_t i, n_out, oh = 1, ow = 1, top, left;
    geom g = {fc->h, fc->w, fc->c, fc->k, fc->k, fc->s, fc->s, fc->pad};
    if (fc->k) geom_out(&g, &oh, &ow, &top, &left);
    n_out = batch * oh * ow * fc->f;
    z = (double *)malloc(sizeof(double) * (size_t)n_out);
    za = (double *)malloc(sizeof(double) * (size_t)n_out);
    for (i = 0; i < n_in; i++) xd[i] = x[i], xa[i] = fabs(x[i]);
    for (i = 0; i < n_k; i++) ka[i] = fabs(kernel[i]);
    if (fc->k) {
        ref_conv(&g, fc->f, MPT_ACT_NONE, batch, xd, kernel, NULL, z);
        ref_conv(&g, fc->f, MPT_ACT_NONE, batch, xa, ka, NULL, za);
    } else { /* the Dense over the flattened sample */
        geom one = {1, 1, fc->h * fc->w * fc->c, 1, 1, 1, 1, MPT_PADDING_VALID};
        ref_conv(&one, fc->f, MPT_ACT_NONE, batch, xd, kernel, NULL, z);
        ref_conv(&one, fc->f, MPT_ACT_NONE, batch, xa, ka, NULL, za);
    }
    for (i = 0; i < n_out; i++) {
        const int64_t o = i % fc->f;
        const double sc = gamma[o] / sqrt(var[o] + 1e-3);
        const double b = bias ? bias[o] : 0, v = (z[i] + b - mean[o]) * sc + beta[o];
        y[i] = fc->relu && v < 0 ? 0 : v;
        size[i] = fabs(sc) * (za[i] + fabs(b)) + fabs(mean[o] * sc) + fabs(beta[o]);
    }
    free(kernel), free(bias), free(mean), free(var), free(gamma), free(beta);
    free(xd), free(xa), free(ka), free(z), free(za);
}

/* The worst of |a − ref| / size over n values. */
static double fold_worst(const float *a, const double *ref, const double *size, int64_t n) {
    double worst = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - ref[i]) / (size[i] + 1e-30);
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

/* Predict folds a BatchNormalization into the Conv2D or Dense before it
   (and fuses the ReLU after it) and so rounds otherwise than the layers
   one by one (mpt_model_forward): each is checked against the fold's
   exact values in double, within 2.5e-5 of each element's size S (the
   sum of the magnitudes of what makes it). That is the budget of the
   worst product: Winograd's F(4×4, 3×3), within 2e-5·S (test_winograd's
   bound, the sums' error), plus the fold's own roundings (w·s and the
   bias, 2^-24 each, relative: about 1.2e-7·S) or, one by one, BN's three
   float32 operations on z (about 2e-7·S). The two then differ by at most
   twice that, 5e-5·S; a fold that forgot the mean, or the square root,
   or folded a channel's scale into another's column, is off by a whole
   term (about 0.1·S to S) and fails. Then: the plan folded what it may,
   so that predict did not simply run the layers one by one; the same
   bits on 1 and 2 threads; a batch of 1 as a batch of 5's first sample. */
static void test_predict_fold(void) {
    static const fold_case cases[] = {
        {9, 11, 8, 24, 3, 1, MPT_PADDING_SAME, 0, 1, "Winograd", 0},
        {10, 10, 16, 16, 3, 2, MPT_PADDING_SAME, 1, 0, "direct tiles", 0},
        {7, 8, 3, 20, 2, 1, MPT_PADDING_VALID, 1, 1, "im2col + GEMM, kernel packed", 1},
        {4, 5, 3, 12, 0, 1, MPT_PADDING_VALID, 1, 1, "Dense, kernel packed", 1},
    };
    const int64_t batch = 5;
    mpt_context *one;
    size_t q;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &one);
    for (q = 0; q < sizeof cases / sizeof cases[0]; q++) {
        const fold_case *fc = &cases[q];
        mpt_model *m = fold_model(ctx, fc, batch), *m1 = fold_model(one, fc, batch);
        const int64_t n_in = batch * fc->h * fc->w * fc->c;
        int64_t shape[4] = {batch, fc->h, fc->w, fc->c}, n_out = 0, i;
        float *x = (float *)malloc(sizeof(float) * (size_t)n_in);
        double *ref = NULL, *size = NULL, worst_plan = 1, worst_layers = 1, worst_apart = 1;
        mpt_tensor tx, planned, planned1, first, layers;
        mpt_dataset *d = NULL, *d1 = NULL, *head = NULL;
        int folded = 0, same_threads = 0, same_first = 0;
        test__begin();
        memset(&planned, 0, sizeof planned), memset(&planned1, 0, sizeof planned1);
        memset(&first, 0, sizeof first);
        plan_train_like(m, 40 + q);
        plan_train_like(m1, 40 + q);
        test_seed(50 + q);
        for (i = 0; i < n_in; i++) x[i] = (float)test_uniform(-1, 1);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, x);
        d = test_dataset_of(ctx, &tx, NULL);
        d1 = test_dataset_of(one, &tx, NULL);
        if (d) mpt_dataset_split(ctx, d, 1, &head, NULL);
        if (m && m1 && d && d1 && head &&
            mpt_model_predict(m, d, batch, &planned) == MPT_OK &&
            mpt_model_predict(m1, d1, batch, &planned1) == MPT_OK &&
            mpt_model_predict(m, head, 1, &first) == MPT_OK &&
            mpt_model_forward(m, &tx, 0, &layers) == MPT_OK) {
            const mpt__predict_plan *pl = m->predict_plan;
            const int w = fc->k ? 0 : 1; /* the weighted layer */
            n_out = mpt_tensor_count(&planned);
            ref = (double *)malloc(sizeof(double) * (size_t)n_out);
            size = (double *)malloc(sizeof(double) * (size_t)n_out);
            fold_ref(m, fc, batch, x, ref, size);
            worst_plan = fold_worst((const float *)planned.data, ref, size, n_out);
            worst_layers = fold_worst((const float *)layers.data, ref, size, n_out);
            for (i = 0, worst_apart = 0; i < n_out; i++)
                worst_apart = MPT__MAX(worst_apart,
                                       fabs(((const float *)planned.data)[i] -
                                            ((const float *)layers.data)[i]) / (size[i] + 1e-30));
            folded = pl && pl->layers[w].kernel && pl->layers[w + 1].skip &&
                     pl->layers[w].into == w + 1 + fc->relu &&
                     (!fc->relu || (pl->layers[w + 2].skip && pl->layers[w].act == MPT_ACT_RELU)) &&
                     (!fc->packed || pl->layers[w].packed);
            same_threads = memcmp(planned.data, planned1.data, sizeof(float) * (size_t)n_out) == 0;
            same_first = memcmp(planned.data, first.data,
                                sizeof(float) * (size_t)mpt_tensor_count(&first)) == 0;
        }
        CHECK(n_out > 0, "predict or forward failed: %s", mpt_context_error(ctx));
        CHECK(folded, "the plan did not fold the BatchNormalization%s%s",
              fc->relu ? " and the ReLU" : "", fc->packed ? " (or pack the folded kernel)" : "");
        CHECK(worst_plan <= 2.5e-5, "predict is off the fold's exact values by %g of S", worst_plan);
        CHECK(worst_layers <= 2.5e-5, "the layers one by one are off by %g of S", worst_layers);
        CHECK(worst_apart <= 5e-5, "predict and the layers one by one differ by %g of S",
              worst_apart);
        CHECK(same_threads, "1 and 2 threads predict different bits");
        CHECK(same_first, "a batch of 1 predicts other bits than a batch of 5's first sample");
        test__end("predict folds %s + BatchNormalization%s (%s): %.2g of S off the exact values, "
                  "%.2g one by one", fc->k ? "Conv2D" : "Dense", fc->relu ? " + ReLU" : "",
                  fc->path, worst_plan, worst_layers);
        free(x), free(ref), free(size);
        mpt_tensor_free(ctx, &planned), mpt_tensor_free(one, &planned1), mpt_tensor_free(ctx, &first);
        mpt_dataset_destroy(head), mpt_dataset_destroy(d), mpt_dataset_destroy(d1);
        mpt_model_destroy(m), mpt_model_destroy(m1);
    }
    mpt_context_destroy(one);
}

/* What the plan must not fold: a BatchNormalization after a Conv2D that
   ends with its own ReLU; one whose Conv2D's output another layer reads
   too (an Add); and a ReLU whose input another layer reads too (it still
   folds that input's BatchNormalization). One graph of the three, and of
   an Add with the ReLU after it, which run as one pass: where nothing was
   folded predict gives the bits of the layers one by one. */
static void test_predict_no_fold(void) {
    mpt_context *c = ctx;
    mpt_model *m = NULL;
    mpt_node x, a, b, y, both[2];
    const int64_t batch = 3, shape[4] = {batch, 6, 6, 4};
    float xs[3 * 6 * 6 * 4];
    mpt_tensor tx, planned, layers;
    mpt_dataset *d;
    int64_t i;
    int ok = 0, refused = 0, same = 0;
    test__begin();
    memset(&planned, 0, sizeof planned);
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {6, 6, 4}, .input_rank = 3, .seed = 8},
                     &m);
    x = mpt_model_input(m);
    /* layer 0: Conv2D with its own ReLU; 1: BN after it (not folded) */
    a = mpt_batch_normalization(m, mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 16,
                                                 .kernel_size = {3, 3}, .padding = MPT_PADDING_SAME,
                                                 .activation = MPT_ACT_RELU}), NULL);
    /* 2: Conv2D read by BN 3 and by Add 4 (not folded) */
    b = mpt_conv2d(m, a, &(mpt_conv2d_desc){.filters = 16, .kernel_size = {3, 3},
                                            .padding = MPT_PADDING_SAME});
    both[0] = mpt_batch_normalization(m, b, NULL);
    both[1] = b;
    /* 5: a ReLU, the Add's only reader: run with it, in one pass */
    y = mpt_activation_layer(m, mpt_add(m, 2, both, NULL),
                             &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    /* 6: Conv2D, 7: BN (folded), read by 8, a ReLU (not fused), and by 9 */
    b = mpt_batch_normalization(m, mpt_conv2d(m, y, &(mpt_conv2d_desc){
                                       .filters = 16, .kernel_size = {3, 3},
                                       .padding = MPT_PADDING_SAME}), NULL);
    both[0] = mpt_activation_layer(m, b, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    both[1] = b;
    (void)mpt_add(m, 2, both, NULL);
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(c));
    plan_train_like(m, 61);
    for (i = 0; i < batch * 6 * 6 * 4; i++) xs[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, shape, xs);
    d = test_dataset_of(c, &tx, NULL);
    if (d && mpt_model_predict(m, d, batch, &planned) == MPT_OK) {
        const mpt__predict_plan *pl = m->predict_plan;
        const size_t bytes = sizeof(float) * (size_t)(batch * 6 * 6 * 16);
        float *sum = (float *)malloc(bytes); /* relu(the first Add), as predict made it */
        memcpy(sum, m->layers[5].y, bytes);
        ok = pl != NULL && mpt_model_forward(m, &tx, 0, &layers) == MPT_OK;
        refused = ok && !pl->layers[0].kernel && !pl->layers[1].skip && !pl->layers[2].kernel &&
                  !pl->layers[3].skip && pl->layers[4].add_relu && pl->layers[4].into == 5 &&
                  pl->layers[5].skip && pl->layers[6].kernel && pl->layers[7].skip &&
                  !pl->layers[8].skip && pl->layers[6].into == 7 && !pl->layers[9].add_relu;
        /* layers 0..5 unfolded, the Add and its ReLU in one pass: the same bits */
        same = ok && memcmp(sum, m->layers[5].y, bytes) == 0;
        free(sum);
    }
    CHECK(ok, "predict or forward failed: %s", mpt_context_error(c));
    CHECK(refused, "the plan folded what it must not (or missed the one fold it may)");
    CHECK(same, "layers the plan does not fold gave other bits than one by one");
    test__end("predict does not fold a BatchNormalization after a ReLU, or one whose Conv2D's "
              "output is read twice, nor fuse a ReLU whose input is read twice; an Add and its "
              "ReLU in one pass, the same bits");
    mpt_tensor_free(c, &planned);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}


/* A model with a fold to train, evaluate and predict: Conv2D (no bias) →
   BatchNormalization → ReLU → GlobalAveragePooling2D → Dense(4, softmax),
   compiled with SGD and sparse categorical crossentropy. */
static mpt_model *plan_classifier(mpt_context *c, int64_t filters, int64_t side,
                                  int64_t batch) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {side, side, 8}, .input_rank = 3,
                                          .seed = 11}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = filters, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME, .no_bias = 1});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    mpt_model_add_global_average_pooling2d(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier_with(c, m, MPT_OPTIMIZER_SGD, 0.5f);
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(c));
    return m;
}

/* m predicts on d the bits a fresh model given m's weights (through a
   file, which reads them without touching m's plan) predicts. */
static int plan_as_fresh(mpt_context *c, mpt_model *m, mpt_dataset *d, int64_t batch) {
    char path_buf[600];
    const char *path = 
        test_file_in(path_buf, sizeof path_buf, tmpdir, "test_conv_plan.safetensors");
    mpt_model *fresh = plan_classifier(c, 16, 6, batch);
    mpt_tensor pa, pb;
    int same = 0;
    memset(&pa, 0, sizeof pa), memset(&pb, 0, sizeof pb);
    if (fresh && mpt_model_predict(m, d, batch, &pa) == MPT_OK &&
        mpt_model_save_weights(m, path) == MPT_OK && mpt_model_load_weights(fresh, path) == MPT_OK &&
        mpt_model_predict(fresh, d, batch, &pb) == MPT_OK)
        same = memcmp(pa.data, pb.data, mpt_tensor_bytes(&pa)) == 0;
    mpt_tensor_free(c, &pa), mpt_tensor_free(c, &pb);
    mpt_model_destroy(fresh);
    remove(path);
    return same;
}

/* The fold is made from the weights as they are: after a training step
   (fit), after BatchNormalization's statistics are set by hand, predict
   gives what a fresh model with those weights gives, bit for bit, not
   what it gave before; the plan is made again once a change, and kept
   while nothing changes. And evaluate runs the same plan: its loss and
   accuracy are those of predict's probabilities (the loss within 1e-6
   relative: evaluate takes the logits, fusing the softmax into the
   crossentropy, and sums in double). */
static void test_predict_plan_follows(void) {
    mpt_context *c = ctx;
    const int64_t n = 12, batch = 4;
    mpt_model *m = plan_classifier(c, 16, 6, batch);
    float x[12 * 6 * 6 * 8];
    int32_t y[12];
    mpt_tensor before, after, p;
    mpt_dataset *d;
    mpt_logs logs;
    uint64_t version = 0;
    int64_t i;
    double loss = 0, hits = 0;
    int p_ok, kept;
    test__begin();
    memset(&before, 0, sizeof before), memset(&after, 0, sizeof after), memset(&p, 0, sizeof p);
    test_seed(71);
    for (i = 0; i < n * 6 * 6 * 8; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < n; i++) y[i] = (int32_t)(i % 4);
    d = test_dataset_xy(c, x, y, n, 6 * 6 * 8);
    if (d) { /* the samples as images */
        mpt_dataset_destroy(d);
        {
            int64_t xs[4] = {n, 6, 6, 8}, ys[1] = {n};
            mpt_tensor tx, ty;
            mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
            mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
            d = test_dataset_of(c, &tx, &ty);
        }
    }
    plan_train_like(m, 72);
    CHECK(m && d && mpt_model_predict(m, d, batch, &before) == MPT_OK, "predict: %s",
          mpt_context_error(c));
    CHECK(m->predict_plan && m->predict_plan->layers[0].kernel, "the plan folded nothing");
    CHECK(plan_as_fresh(c, m, d, batch), "predict differs from a fresh model's");
    version = m->predict_plan ? m->predict_plan->version : 0;
    CHECK(mpt_model_predict(m, d, batch, &p) == MPT_OK, "predict");
    kept = m->predict_plan && m->predict_plan->version == version;
    mpt_tensor_free(c, &p);
    CHECK(kept, "a predict on unchanged weights made the plan again");
    /* one training step changes the kernel and the statistics */
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = batch,
                                              .steps_per_epoch = 1}) == MPT_OK,
          "fit: %s", mpt_context_error(c));
    CHECK(mpt_model_predict(m, d, batch, &after) == MPT_OK, "predict");
    CHECK(before.data && after.data && memcmp(before.data, after.data,
                                              mpt_tensor_bytes(&before)) != 0,
          "predict after a training step gave what it gave before it");
    CHECK(plan_as_fresh(c, m, d, batch), "after fit: predict differs from a fresh model's");
    /* the statistics set by hand */
    test_seed(73);
    plan_set(m, "moving_mean", 1.0, 2.0);
    CHECK(plan_as_fresh(c, m, d, batch), "after the mean set: predict differs from a fresh model's");
    /* evaluate: predict's plan, predict's numbers */
    p_ok = mpt_model_predict(m, d, batch, &p) == MPT_OK &&
           mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = batch}, &logs) == MPT_OK;
    for (i = 0; p_ok && i < n; i++) {
        const float *row = (const float *)p.data + i * 4;
        int k, best = 0;
        for (k = 1; k < 4; k++) best = row[k] > row[best] ? k : best;
        loss -= log((double)row[y[i]]);
        hits += best == y[i];
    }
    loss /= (double)n;
    CHECK(p_ok, "predict or evaluate: %s", mpt_context_error(c));
    CHECK(p_ok && fabs(mpt_logs_get(&logs, "loss") - loss) <= 1e-6 * loss,
          "evaluate's loss %.9g, predict's probabilities give %.9g", mpt_logs_get(&logs, "loss"),
          loss);
    CHECK(p_ok && mpt_logs_get(&logs, "accuracy") == hits / (double)n,
          "evaluate's accuracy %g, predict's %g", mpt_logs_get(&logs, "accuracy"),
          hits / (double)n);
    test__end("predict's fold follows the weights (a fit, statistics set by hand); evaluate "
              "gives predict's numbers");
    mpt_tensor_free(c, &before), mpt_tensor_free(c, &after), mpt_tensor_free(c, &p);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}

/* A Conv2D that runs the MaxPooling2D after it keeps its own forward in
   predict's plan, but the kernel its direct product prepares (Winograd's
   U here: 16 channels in and out, 3×3) is kept from call to call
   (mpt__pass.kept_ws): every predict, batches of 1 then of 3, gives the
   bits of the same weights with a Dropout between the two (the pair
   apart: the plan's own Conv2D, then the pooling), and the plan says it
   kept the kernel. */
static mpt_model *pair_model(mpt_context *c, int apart) {
    mpt_model *m = NULL;
    mpt_pool2d_desc pool;
    memset(&pool, 0, sizeof pool);
    pool.pool_size[0] = pool.pool_size[1] = 2;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {8, 8, 16}, .input_rank = 3,
                                          .seed = 5}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 16, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    if (apart) mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    mpt_model_add_max_pooling2d(m, &pool);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 5});
    if (mpt_model_build(m, 3) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

static void test_predict_pair_kept(void) {
    mpt_context *c = ctx;
    mpt_model *m = pair_model(c, 0), *apart = pair_model(c, 1);
    float x[3 * 8 * 8 * 16];
    int32_t y[3] = {0, 1, 2};
    mpt_tensor want, got;
    mpt_dataset *d;
    int64_t i;
    int call, same = 0, kept = 0, direct;
    test__begin();
    memset(&want, 0, sizeof want);
    test_seed(83);
    for (i = 0; i < 3 * 8 * 8 * 16; i++) x[i] = (float)test_uniform(-1, 1);
    {
        int64_t shape[4] = {3, 8, 8, 16}, ys[1] = {3};
        mpt_tensor tx, ty;
        mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, shape, x);
        mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
        d = test_dataset_of(c, &tx, &ty);
    }
    for (i = 0; m && apart && i < mpt_model_param_count(m); i++) {
        mpt_param_info a, b;
        mpt_model_param(m, i, &a);
        mpt_model_param(apart, i, &b);
        memcpy(b.value.data, a.value.data, mpt_tensor_bytes(&a.value));
    }
    CHECK(m && apart && d && m->layers[0].pools_next &&
              mpt_model_predict(apart, d, 3, &want) == MPT_OK,
          "the models: %s", mpt_context_error(c));
    for (call = 0; call < 3 && want.data; call++) {
        memset(&got, 0, sizeof got);
        if (mpt_model_predict(m, d, call == 2 ? 3 : 1, &got) == MPT_OK)
            same += memcmp(got.data, want.data, mpt_tensor_bytes(&want)) == 0;
        mpt_tensor_free(c, &got);
        kept += m->predict_plan && m->predict_plan->layers[0].conv_kept;
    }
    /* Only the direct tiles (AVX-512) prepare a kernel to keep: im2col's
       GEMM has none. */
    direct = (mpt_context_cpu_features(c) & MPT_CPU_AVX512) != 0;
    CHECK(same == 3 && kept == (direct ? 3 : 0),
          "%d of 3 predicts give the pair apart's bits; the kernel kept after %d (%s)", same, kept,
          direct ? "the direct tiles: 3 expected" : "no AVX-512: 0 expected");
    test__end("predict's plan keeps the prepared kernel of a Conv2D that runs its MaxPooling2D");
    mpt_tensor_free(c, &want);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_model_destroy(apart);
}

/* The thread rule (@impl-predict-plan): a batch of 1 of a small model
   (its Conv2D estimated under MPT_PREDICT_SOLO_PRODUCT_NS) runs every
   layer on the calling thread (no parallel-for handed to the pool), a
   batch of 1 of a 28 × 28 image hands its Conv2D (about 9 µs, 5 tasks
   of Winograd's tiles) to the pool, and a batch of 64 of a larger one its
   big layers (32 × 32 images: without AVX-512 the Conv2D runs im2col's
   GEMM one sample at a time under this file's small MPT__CONV_COLS_BUDGET,
   and a sample of 16 × 16 pixels is a single task); either way the bits
   are those of a 1-thread context. */
static void test_predict_threads(void) {
    mpt_context *one;
    int round;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &one);
    for (round = 0; round < 3; round++) {
        const int64_t batch = round == 2 ? 64 : 1, filters = round == 2 ? 32 : 16;
        const int64_t side = round == 0 ? 12 : round == 1 ? 28 : 32;
        const int64_t count = batch * side * side * 8;
        mpt_model *m = plan_classifier(ctx, filters, side, batch);
        mpt_model *m1 = plan_classifier(one, filters, side, batch);
        float *x = (float *)malloc(sizeof(float) * (size_t)count);
        int64_t xs[4] = {batch, side, side, 8}, i, handed = -1;
        mpt_tensor tx, p2, p1;
        mpt_dataset *d2, *d1;
        int same = 0;
        test__begin();
        memset(&p2, 0, sizeof p2), memset(&p1, 0, sizeof p1);
        plan_train_like(m, 81);
        plan_train_like(m1, 81);
        test_seed(82);
        for (i = 0; i < count; i++) x[i] = (float)test_uniform(-1, 1);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, x);
        d2 = test_dataset_of(ctx, &tx, NULL);
        d1 = test_dataset_of(one, &tx, NULL);
        if (m && m1 && d2 && d1 && mpt_model_predict(m, d2, batch, &p2) == MPT_OK) {
            const int64_t at = ctx->pool.handed;
            mpt_tensor_free(ctx, &p2);
            if (mpt_model_predict(m, d2, batch, &p2) == MPT_OK) handed = ctx->pool.handed - at;
            same = mpt_model_predict(m1, d1, batch, &p1) == MPT_OK &&
                   memcmp(p1.data, p2.data, mpt_tensor_bytes(&p1)) == 0;
        }
        CHECK(handed >= 0, "predict: %s", mpt_context_error(ctx));
        if (round == 0)
            CHECK(handed == 0, "a batch of 1 of 12 x 12 images handed %lld parallel-fors to "
                  "the pool", (long long)handed);
        else
            CHECK(handed > 0, "a batch of %lld of %lld x %lld images handed nothing to the pool",
                  (long long)batch, (long long)side, (long long)side);
        CHECK(same, "2 threads predict other bits than 1");
        test__end("predict's thread rule: a batch of %lld of %lld x %lld images hands %lld "
                  "parallel-fors to the pool, the bits of 1 thread", (long long)batch,
                  (long long)side, (long long)side, (long long)handed);
        free(x);
        mpt_tensor_free(ctx, &p2), mpt_tensor_free(one, &p1);
        mpt_dataset_destroy(d2), mpt_dataset_destroy(d1);
        mpt_model_destroy(m), mpt_model_destroy(m1);
    }
    mpt_context_destroy(one);
}

static void run_cases(void) {
    TEST_RUN(test_conv_known_answer);
    TEST_RUN(test_pool_known_answer);
    TEST_RUN(test_output_shapes);
    TEST_RUN(test_defaults);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_determinism);
    test_direct_conv();
    test_winograd();
    test_winograd_kernel_grad();
    test_backward_elementwise_threads();
    test_dz_and_bias_grad();
    test_dz_gelu();
    test_conv_gradients();
    test_pool_gradients();
    test_max_pool_exact();
    test_max_pool_scan();
    test_chain_gradients();
    test_half_chain_gradients();
    test_predict_fold();
    test_predict_no_fold();
    test_predict_plan_follows();
    test_predict_threads();
    test_predict_pair_kept();
}

int main(void) {
    static const test_program p = {.name = "test_conv", .ctx = &ctx, .threads = 2, .seed = 3,
                                   .tmpdir = tmpdir, .tmpdir_size = sizeof tmpdir,
                                   .keep_env = "MPT_KEEP_TEST_FILES", .cases = run_cases};
    return test_main(&p);
}

/* MaxPooling2D's AVX-512 forward against its portable loop, bit for bit:
   the maxima, and the pixels that won (through the gradient that backward
   routes to them), on channel counts that fill no vector, one, several and
   a partial one, overlapping and border-cut windows, every dtype, with
   ties, NaNs and -inf in the input. (tests/test_conv.c checks both against
   the double-precision reference.) */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "test.h"

typedef struct pool_case {
    int64_t batch, h, w, c, k, stride;
    mpt_padding pad;
    mpt_dtype dtype;
} pool_case;

/* y then dx (as float32) of one training forward and backward on a context
   that may not use the CPU features in `disable`; NULL when it lacks one in
   `need`. */
static float *max_pool_pass(const pool_case *pc, int disable, int need, const float *x,
                            const float *dy, int64_t n_in, int64_t *n_out) {
    mpt_context *c = NULL;
    mpt_model *m = NULL;
    mpt_pool2d_desc p;
    mpt_tensor tx, ty, tdy, tdx;
    int64_t xs[4] = {pc->batch, pc->h, pc->w, pc->c};
    float *out;
    if (mpt_context_create(&(mpt_context_desc){.num_threads = 2, .disable_cpu_features = disable},
                           &c) != MPT_OK)
        return NULL;
    if ((mpt_context_cpu_features(c) & need) != need) {
        mpt_context_destroy(c);
        return NULL;
    }
    memset(&p, 0, sizeof p);
    p.pool_size[0] = p.pool_size[1] = pc->k;
    p.strides[0] = p.strides[1] = pc->stride;
    p.padding = pc->pad;
    p.dtype = pc->dtype;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {pc->h, pc->w, pc->c}, .input_rank = 3},
                     &m);
    CHECK(mpt_model_add_max_pooling2d(m, &p) == MPT_OK, "add");
    CHECK(mpt_model_build(m, pc->batch) == MPT_OK, "build: %s", mpt_context_error(c));
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, (void *)x);
    CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward: %s", mpt_context_error(c));
    *n_out = mpt_tensor_count(&ty);
    out = (float *)calloc((size_t)(*n_out + n_in), sizeof(float));
    mpt_convert(c, MPT_FLOAT32, out, ty.dtype, ty.data, *n_out);
    tdy = ty;
    tdy.dtype = MPT_FLOAT32;
    tdy.data = (void *)dy;
    memset(&tdx, 0, sizeof tdx);
    CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward: %s", mpt_context_error(c));
    mpt_convert(c, MPT_FLOAT32, out + *n_out, tdx.dtype, tdx.data, n_in);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    return out;
}

static void test_max_pool_simd_matches_portable(void) {
    static const int64_t channels[] = {1, 5, 16, 21, 40};
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int k, t, geometry, ran = 0;
    test_seed(41);
    for (k = 0; k < (int)(sizeof channels / sizeof channels[0]); k++)
        for (t = 0; t < 3; t++)
            for (geometry = 0; geometry < 2; geometry++) {
                /* the CNN's 2×2 stride 2, and 3×3 stride 2 'same' (overlapping,
                   cut by the border) */
                pool_case pc = {3, 9, 7, channels[k], geometry ? 3 : 2, 2,
                                geometry ? MPT_PADDING_SAME : MPT_PADDING_VALID, dtypes[t]};
                int64_t n_in = pc.batch * pc.h * pc.w * pc.c, n_out = 0, n_out2 = 0, i;
                float *x = (float *)malloc(sizeof(float) * (size_t)n_in);
                float *dy = (float *)malloc(sizeof(float) * (size_t)n_in);
                float *ref, *simd;
                for (i = 0; i < n_in; i++) {
                    /* few distinct values: many ties */
                    x[i] = (float)test_randint(-4, 4) * 0.25f;
                    if (i % 23 == 5) x[i] = NAN;
                    if (i % 31 == 7) x[i] = -INFINITY;
                    dy[i] = (float)test_uniform(-1, 1);
                }
                ref = max_pool_pass(&pc, ~0, 0, x, dy, n_in, &n_out);
                simd = max_pool_pass(&pc, 0, MPT_CPU_AVX512, x, dy, n_in, &n_out2);
                if (simd && ref) {
                    ran++;
                    for (i = 0; i < n_out + n_in; i++)
                        if (memcmp(ref + i, simd + i, sizeof(float)) != 0) break;
                    CHECK(n_out == n_out2 && i == n_out + n_in,
                          "C %lld %s k %lld: %s[%lld] %g, portable %g", (long long)pc.c,
                          mpt_dtype_name(pc.dtype), (long long)pc.k, i < n_out ? "y" : "dx",
                          (long long)(i < n_out ? i : i - n_out), simd[i], ref[i]);
                }
                free(x), free(dy), free(ref), free(simd);
            }
    if (!ran) SKIP("this CPU has no AVX-512");
}

/* Inference's 2×2 stride-2 max pooling (mpt__max_pool2_avx512: a sample at
   a time, no argmax) against the window-by-window forms, bit for bit: the
   portable mpt__max_window on float32 and the AVX-512 window (the
   training forward's, whose half dtypes test_max_pool_simd_matches_portable
   holds to the portable loop) on every dtype; channel counts that fill no
   vector, one, several and a partial one; odd sizes (a row and a column no
   window reads); ties, ±0, NaNs (first in a window, later, two in one)
   and −inf. */
static void test_max_pool2_inference(void) {
#if MPT__X86
    static const int64_t channels[] = {1, 5, 16, 21, 40};
    static const int64_t sizes[][2] = {{9, 7}, {8, 6}, {2, 2}};
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    mpt_context *c = NULL;
    int k, t, z, checked = 0;
    CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &c) == MPT_OK, "context");
    if (!(mpt_context_cpu_features(c) & MPT_CPU_AVX512)) {
        mpt_context_destroy(c);
        SKIP("this CPU has no AVX-512");
        return;
    }
    test_seed(43);
    for (k = 0; k < (int)(sizeof channels / sizeof channels[0]); k++)
        for (z = 0; z < (int)(sizeof sizes / sizeof sizes[0]); z++)
            for (t = 0; t < 3; t++) {
                mpt__win g;
                const size_t es = mpt_dtype_size(dtypes[t]);
                int64_t n_in, n_out, i, oy, ox, r0, r1, c0, c1;
                float *xf, *ref;
                unsigned char *x, *fast, *win;
                memset(&g, 0, sizeof g);
                g.h = sizes[z][0], g.w = sizes[z][1], g.c = channels[k];
                g.kh = g.kw = g.sh = g.sw = 2;
                g.oh = g.h / 2, g.ow = g.w / 2;
                CHECK(mpt__max_pool2_fits(&g), "2x2/2 valid not taken");
                n_in = g.h * g.w * g.c, n_out = g.oh * g.ow * g.c;
                xf = (float *)malloc(sizeof(float) * (size_t)n_in);
                ref = (float *)malloc(sizeof(float) * (size_t)n_out);
                x = (unsigned char *)malloc(es * (size_t)n_in);
                fast = (unsigned char *)malloc(es * (size_t)n_out);
                win = (unsigned char *)malloc(es * (size_t)n_out);
                for (i = 0; i < n_in; i++) {
                    xf[i] = (float)test_randint(-3, 3) * 0.5f; /* many ties */
                    if (xf[i] == 0 && (i & 1)) xf[i] = -0.0f;
                    if (i % 13 == 4 || i % 29 == 0) xf[i] = NAN;
                    if (i % 17 == 6) xf[i] = -INFINITY;
                }
                mpt_convert(c, dtypes[t], x, MPT_FLOAT32, xf, n_in);
                mpt_convert(c, MPT_FLOAT32, xf, dtypes[t], x, n_in); /* as the dtype holds it */
                mpt__max_pool2_avx512(dtypes[t], &g, x, fast);
                for (oy = 0; oy < g.oh; oy++)
                    for (ox = 0; ox < g.ow; ox++) {
                        const int64_t at = (oy * g.ow + ox) * g.c;
                        mpt__win_span(&g, oy, ox, &r0, &r1, &c0, &c1);
                        mpt__max_window_avx512(dtypes[t], &g, x, r0, r1, c0, c1,
                                               win + (size_t)at * es, NULL);
                        mpt__max_window(&g, xf, r0, r1, c0, c1, ref + at, NULL);
                    }
                CHECK(memcmp(fast, win, es * (size_t)n_out) == 0,
                      "C %lld %lldx%lld %s: not the AVX-512 window's maxima", (long long)g.c,
                      (long long)g.h, (long long)g.w, mpt_dtype_name(dtypes[t]));
                if (dtypes[t] == MPT_FLOAT32)
                    CHECK(memcmp(fast, ref, 4 * (size_t)n_out) == 0,
                          "C %lld %lldx%lld: not the portable window's maxima", (long long)g.c,
                          (long long)g.h, (long long)g.w);
                checked++;
                free(xf), free(ref), free(x), free(fast), free(win);
            }
    CHECK(checked == 45, "%d cases", checked);
    mpt_context_destroy(c);
#else
    SKIP("no AVX-512 path on this architecture");
#endif
}

/* A float16 model's Conv2D and the MaxPooling2D that alone reads it
   (mpt__q_conv_pool_float16), run by chunks (4 input channels:
   MPT__CONV_POOL_ELEMS outputs, here 10 of 23 samples a chunk, the last
   chunk 3) or (1 channel) pooled in the direct convolution's epilogue:
   the model's pass gives the bytes of its operations run one by one over
   the whole batch (the Conv2D's direct convolution, then the pooling), on
   1 and 2 threads, and of batches of one sample. */
static void test_float16_conv_pool_chunks(void) {
    enum { N = 23, SIDE = 30, FILTERS = 32 };
    int run;
    for (run = 0; run < 4; run++) {
        const int threads = 1 + run / 2, channels = run % 2 ? 4 : 1;
        mpt_context *c = NULL;
        mpt_model *m = NULL, *q = NULL;
        mpt_conv2d_desc cd;
        mpt_pool2d_desc pd;
        mpt_dense_desc dd;
        mpt__quantized *Q;
        mpt__qwork *w = NULL;
        float *x = (float *)malloc(sizeof(float) * N * SIDE * SIDE * (size_t)channels);
        void *buf[8] = {NULL};
        const void *out = NULL;
        int64_t i, n;
        int op, ran = 0;
        CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &c) == MPT_OK,
              "context");
        if (!(mpt_context_cpu_features(c) & MPT_CPU_AVX512)) { /* the pair runs on none else */
            SKIP("this CPU lacks the direct path the pair needs");
            mpt_context_destroy(c);
            free(x);
            return;
        }
        mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, channels},
                                              .input_rank = 3, .seed = 5}, &m);
        memset(&cd, 0, sizeof cd);
        cd.filters = FILTERS, cd.kernel_size[0] = cd.kernel_size[1] = 3;
        cd.activation = MPT_ACT_RELU;
        memset(&pd, 0, sizeof pd);
        pd.pool_size[0] = pd.pool_size[1] = 2;
        memset(&dd, 0, sizeof dd);
        dd.units = 4;
        CHECK(mpt_model_add_conv2d(m, &cd) == MPT_OK && mpt_model_add_max_pooling2d(m, &pd) == MPT_OK &&
              mpt_model_add_flatten(m, NULL) == MPT_OK && mpt_model_add_dense(m, &dd) == MPT_OK &&
              mpt_model_build(m, N) == MPT_OK, "model: %s", mpt_context_error(c));
        test_seed(44 + (unsigned long long)threads);
        for (op = 0; op < mpt_model_param_count(m); op++) { /* weights of its own, biases too */
            mpt_param_info pi;
            mpt_model_param(m, op, &pi);
            for (i = 0; i < mpt_tensor_count(&pi.value); i++)
                ((float *)pi.value.data)[i] = (float)test_uniform(-0.5, 0.5);
        }
        mpt_model_refresh_weights(m);
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FLOAT16}, &q) ==
              MPT_OK, "quantize: %s", mpt_context_error(c));
        Q = q->quantized;
        CHECK(Q->n_ops == 4 && Q->ops[0].fuse_pool &&
              MPT__CONV_POOL_ELEMS / Q->ops[0].out_count == 10, "the ops: %d", Q->n_ops);
        for (i = 0; i < N * SIDE * SIDE * channels; i++)
            x[i] = i % 7 == 3 ? 0.0f : (float)test_uniform(-1, 1);
        CHECK(mpt__qwork_reuse(c, Q, N, &w) == MPT_OK, "work");
        for (n = N; w && n >= 1; n = n == 1 ? 0 : 1) {
            for (op = 0; op < Q->n_ops; op++)
                buf[op + 1] = malloc(sizeof(float) * (size_t)(n * Q->ops[op].out_count));
            for (op = 0; op < Q->n_ops; op++)
                CHECK(mpt__q_run_op(c, Q, op, MPT__QX_FLOAT16, op ? buf[op] : x, buf[op + 1], n,
                                    w) == MPT_OK, "op %d", op);
            buf[6] = malloc(sizeof(float) * (size_t)(n * Q->ops[0].out_count));
            buf[7] = malloc(sizeof(float) * (size_t)(n * Q->ops[1].out_count));
            memset(buf[6], 0x7F, sizeof(float) * (size_t)(n * Q->ops[0].out_count));
            CHECK(mpt__q_conv_pool_float16(c, Q, 0, x, (float *)buf[6], (float *)buf[7], n, w,
                                           &ran) == MPT_OK && ran, "the pair did not run");
            for (i = 0; i < 4 * n * Q->ops[0].out_count && ((unsigned char *)buf[6])[i] == 0x7F;
                 i++) {}
            CHECK((i == 4 * n * Q->ops[0].out_count) == (channels == 1),
                  "%d channels: the Conv2D's output %s", channels,
                  channels == 1 ? "written (not pooled in the epilogue)"
                                : "not written (no chunks)");
            CHECK(memcmp(buf[7], buf[2], sizeof(float) * (size_t)(n * Q->ops[1].out_count)) == 0,
                  "%d channels, %d threads, %lld samples: the pair's pooling differs", channels,
                  threads, (long long)n);
            free(buf[6]), free(buf[7]);
            CHECK(mpt__q_forward(c, Q, MPT__QX_FLOAT16, x, n, w, NULL, &out) == MPT_OK && out,
                  "forward: %s", mpt_context_error(c));
            CHECK(out && memcmp(out, buf[Q->n_ops], sizeof(float) * (size_t)(n * 4)) == 0,
                  "%d threads, %lld samples: not the operations' bytes one by one", threads,
                  (long long)n);
            for (op = 0; op < Q->n_ops; op++) free(buf[op + 1]);
        }
        free(x);
        mpt_model_destroy(q);
        mpt_model_destroy(m);
        mpt_context_destroy(c);
    }
}

/* Max pooling's gradient in float16 and bfloat16 with windows that do not
   overlap (the CNN's 2×2 stride 2), which is copied, not summed in
   float32: each winner's dx has the bits of dy after 0 + dy in float32
   rounded back (−0 becomes +0, a signaling NaN comes back quiet,
   subnormals and infinities unchanged), every other pixel +0. x increases
   along memory, so each window's last pixel wins. */
static void test_max_pool_half_gradient_bits(void) {
    enum { B = 2, H = 5, W = 6, C = 3, OH = 2, OW = 3 };
    static const uint16_t bf16_specials[] = {0x8000, 0x0000, 0x7f81, 0xffc1, 0x7f80, 0xff80,
                                             0x0001, 0x8003, 0x3f80, 0xc2f7};
    static const uint16_t f16_specials[] = {0x8000, 0x0000, 0x7c01, 0xfe01, 0x7c00, 0xfc00,
                                            0x0001, 0x8003, 0x3c00, 0xd5e0};
    static const mpt_dtype dtypes[] = {MPT_FLOAT16, MPT_BFLOAT16};
    const int64_t xs[4] = {B, H, W, C}, ys[4] = {B, OH, OW, C};
    float x[B * H * W * C];
    uint16_t dy[B * OH * OW * C];
    int t, level, i;
    for (i = 0; i < B * H * W * C; i++) x[i] = (float)(i % (H * W * C));
    for (t = 0; t < 2; t++)
        for (level = 0; level < 2; level++) {
            const uint16_t *sp = dtypes[t] == MPT_BFLOAT16 ? bf16_specials : f16_specials;
            mpt_context *c = NULL;
            mpt_model *m = NULL;
            mpt_tensor tx, ty, tdy, tdx;
            int checked = 0;
            mpt_context_create(&(mpt_context_desc){.num_threads = 2,
                                                   .disable_cpu_features = level ? 0 : ~0},
                               &c);
            mpt_model_create(c, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3},
                             &m);
            CHECK(mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {2, 2},
                                                                    .dtype = dtypes[t]}) == MPT_OK &&
                      mpt_model_build(m, B) == MPT_OK,
                  "build: %s", mpt_context_error(c));
            mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
            CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward: %s",
                  mpt_context_error(c));
            for (i = 0; i < B * OH * OW * C; i++)
                dy[i] = i < 10 ? sp[i] : (uint16_t)(sp[8] + 17 * i); /* then plain numbers */
            mpt_tensor_wrap(c, &tdy, dtypes[t], 4, ys, dy);
            CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward: %s",
                  mpt_context_error(c));
            for (i = 0; i < B * H * W * C; i++) {
                const int64_t p = i / C % (H * W), r = p / W, q = p % W, ch = i % C;
                const int wins = r % 2 == 1 && q % 2 == 1 && r < 2 * OH;
                const int64_t e = ((i / (H * W * C) * OH + r / 2) * OW + q / 2) * C + ch;
                uint16_t want = 0, got = ((const uint16_t *)tdx.data)[i];
                if (wins) { /* 0 + dy in float32, rounded back */
                    float v;
                    mpt_convert(c, MPT_FLOAT32, &v, dtypes[t], &dy[e], 1);
                    v = 0.0f + v;
                    mpt_convert(c, dtypes[t], &want, MPT_FLOAT32, &v, 1);
                    checked++;
                }
                CHECK(got == want, "%s %s: dx[%d] = 0x%04x, want 0x%04x (dy 0x%04x)",
                      level ? "simd" : "portable", mpt_dtype_name(dtypes[t]), i, got, want,
                      wins ? dy[e] : 0);
            }
            CHECK(checked == B * OH * OW * C, "%d winners checked", checked);
            mpt_model_destroy(m);
            mpt_context_destroy(c);
        }
}

/* Max pooling's gradient where windows do not overlap (strides at least
   the pool size) is written pixel by pixel in one pass: against what the
   general path computes (each pixel's gradients summed in float32 from 0,
   rounded to the dtype), bit for bit, over a poisoned dx, portable and
   with AVX-512. Gaps between windows (strides past the pool size), rows
   and columns after the last window (odd sizes under 'valid'), windows
   cut by 'same' padding, channel counts that fill no vector, one and a
   partial one; argmax anywhere in its window; dy with -0, NaN and inf. */
static void test_max_pool_gradient_one_pass(void) {
    static const struct { int64_t h, w, c, kh, kw, sh, sw; mpt_padding pad; } geoms[] = {
        {7, 9, 5, 2, 2, 2, 2, MPT_PADDING_VALID},  {9, 7, 21, 2, 3, 3, 4, MPT_PADDING_VALID},
        {5, 8, 16, 3, 2, 3, 2, MPT_PADDING_SAME},  {6, 11, 40, 1, 2, 2, 3, MPT_PADDING_SAME},
        {26, 26, 32, 2, 2, 2, 2, MPT_PADDING_VALID}, {3, 5, 1, 4, 4, 4, 5, MPT_PADDING_SAME},
    };
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    const int64_t batch = 3;
    int gi, t, level, ran_simd = 0;
    test_seed(5);
    for (gi = 0; gi < (int)(sizeof geoms / sizeof geoms[0]); gi++)
        for (t = 0; t < 3; t++)
            for (level = 0; level < 2; level++) {
                mpt_context *c = NULL;
                mpt_window g;
                int64_t n_in, n_out, b, oy, ox, e, i;
                int32_t *arg;
                float *dyf, *sum;
                unsigned char *dy, *dx, *want, *ws;
                size_t es = mpt_dtype_size(dtypes[t]);
                test__begin();
                mpt_context_create(&(mpt_context_desc){.num_threads = 2,
                                                       .disable_cpu_features = level ? 0 : ~0},
                                   &c);
                if (level && !(mpt_context_cpu_features(c) & MPT_CPU_AVX512)) {
                    mpt_context_destroy(c);
                    test__end("max_pool one pass: no AVX-512");
                    continue;
                }
                ran_simd += level;
                memset(&g, 0, sizeof g);
                g.h = geoms[gi].h, g.w = geoms[gi].w, g.c = geoms[gi].c;
                g.kh = geoms[gi].kh, g.kw = geoms[gi].kw, g.sh = geoms[gi].sh, g.sw = geoms[gi].sw;
                g.oh = mpt__win_axis(g.h, g.kh, g.sh, geoms[gi].pad, &g.top);
                g.ow = mpt__win_axis(g.w, g.kw, g.sw, geoms[gi].pad, &g.left);
                n_in = g.h * g.w * g.c, n_out = g.oh * g.ow * g.c;
                arg = (int32_t *)malloc(sizeof(int32_t) * (size_t)(batch * n_out));
                dyf = (float *)malloc(sizeof(float) * (size_t)(batch * n_out));
                sum = (float *)calloc((size_t)(batch * n_in), sizeof(float));
                dy = (unsigned char *)malloc(es * (size_t)(batch * n_out));
                dx = (unsigned char *)malloc(es * (size_t)(batch * n_in));
                want = (unsigned char *)malloc(es * (size_t)(batch * n_in));
                ws = (unsigned char *)malloc((size_t)mpt__cpu_pool_workspace(c, &g, batch));
                for (i = 0; i < batch * n_out; i++) {
                    dyf[i] = (float)test_uniform(-2, 2);
                    if (i % 17 == 3) dyf[i] = -0.0f;
                    if (i % 29 == 4) dyf[i] = NAN;
                    if (i % 31 == 5) dyf[i] = -INFINITY;
                }
                mpt_convert(c, dtypes[t], dy, MPT_FLOAT32, dyf, batch * n_out);
                mpt_convert(c, MPT_FLOAT32, dyf, dtypes[t], dy, batch * n_out);
                for (b = 0; b < batch; b++)
                    for (oy = 0; oy < g.oh; oy++)
                        for (ox = 0; ox < g.ow; ox++)
                            for (e = 0; e < g.c; e++) {
                                /* a pixel of the window inside the image */
                                const int64_t r0 = oy * g.sh - g.top, c0 = ox * g.sw - g.left;
                                int64_t r, q;
                                do {
                                    r = r0 + test_randint(0, (int)g.kh - 1);
                                    q = c0 + test_randint(0, (int)g.kw - 1);
                                } while (r < 0 || r >= g.h || q < 0 || q >= g.w);
                                i = (b * g.oh + oy) * g.ow + ox;
                                arg[i * g.c + e] = (int32_t)((r * g.w + q) * g.c + e);
                                sum[b * n_in + (r * g.w + q) * g.c + e] += dyf[i * g.c + e];
                            }
                mpt_convert(c, dtypes[t], want, MPT_FLOAT32, sum, batch * n_in);
                memset(dx, 0xFF, es * (size_t)(batch * n_in)); /* NaN in every dtype */
                mpt__cpu_pool_backward(c, MPT_POOL_MAX, &g, dtypes[t], dy, dx, arg, batch, ws);
                for (i = 0; i < batch * n_in; i++)
                    if (memcmp(dx + (size_t)i * es, want + (size_t)i * es, es) != 0) break;
                CHECK(i == batch * n_in, "dx element %lld differs from the summed gradient",
                      (long long)i);
                test__end("max_pool one pass %s in=(%lld,%lld,%lld) k=(%lld,%lld) s=(%lld,%lld) %s",
                          level ? "avx512" : "portable", (long long)g.h, (long long)g.w,
                          (long long)g.c, (long long)g.kh, (long long)g.kw, (long long)g.sh,
                          (long long)g.sw, mpt_dtype_name(dtypes[t]));
                free(arg), free(dyf), free(sum), free(dy), free(dx), free(want), free(ws);
                mpt_context_destroy(c);
            }
    if (!ran_simd) printf("# max_pool one pass: AVX-512 not checked (this CPU has none)\n");
}

/* ---- a Conv2D and the MaxPooling2D after it, run as one pass ---------------- */

typedef struct pair_case {
    int64_t batch, h, w, c, filters, k, stride;
    mpt_padding pad;        /* the pooling's                                 */
    mpt_activation act;     /* the Conv2D's                                  */
    mpt_dtype dtype;
    int conv_before;        /* a Conv2D in front, so the pair's dx is used   */
    int need;               /* CPU features the pair's direct path needs     */
    mpt_padding conv_pad;   /* the Conv2D's                                  */
    int64_t conv_sh;        /* its stride along the height                   */
} pair_case;

typedef struct pair_run {
    mpt_context *c;
    mpt_model *m;
    int pair;               /* the pair's Conv2D                             */
    int fused;              /* it ran the pooling                            */
    int y_untouched;        /* its own y kept the poison put there           */
    float *out, *dx;        /* the model's output and input gradient         */
    float *infer;           /* its output from an inference forward after    */
    int pooled2;            /* there, conv_direct pooled in its epilogue     */
} pair_run;

/* conv_direct calls that pooled in their epilogue (mpt_conv_args.max_pool2) */
static int pooled2_calls;

static int counting_conv_direct(void *impl, const mpt_conv_args *a) {
    const int done = mpt__cpu_conv_direct(impl, a);
    pooled2_calls += done && a->max_pool2;
    return done;
}

/* One training forward and backward of [Conv2D] Conv2D MaxPooling2D
   Flatten Dense, the pair fused or (unfuse) not, on `threads` threads;
   then an inference forward (the pair's pooling without an argmax). */
static void pair_pass(const pair_case *pc, int threads, int unfuse, const float *x,
                      const float *dy, pair_run *r) {
    int64_t xs[4] = {pc->batch, pc->h, pc->w, pc->c}, n_in = pc->batch * pc->h * pc->w * pc->c;
    mpt_pool2d_desc pool;
    mpt_tensor tx, ty, tdy, tdx;
    mpt__layer *L;
    unsigned char *y;
    size_t y_bytes;
    int64_t i;
    memset(r, 0, sizeof *r);
    mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &r->c);
    mpt_model_create(r->c, &(mpt_model_desc){.input_shape = {pc->h, pc->w, pc->c},
                                             .input_rank = 3, .seed = 11}, &r->m);
    if (pc->conv_before)
        mpt_model_add_conv2d(r->m, &(mpt_conv2d_desc){.filters = pc->c, .kernel_size = {1, 1},
                                                     .activation = MPT_ACT_RELU,
                                                     .dtype = pc->dtype});
    mpt_model_add_conv2d(r->m, &(mpt_conv2d_desc){.filters = pc->filters, .kernel_size = {3, 3},
                                                 .strides = {pc->conv_sh, 1},
                                                 .padding = pc->conv_pad,
                                                 .activation = pc->act, .dtype = pc->dtype,
                                                 .bias_initializer = MPT_INIT_GLOROT_UNIFORM});
    memset(&pool, 0, sizeof pool);
    pool.pool_size[0] = pool.pool_size[1] = pc->k;
    pool.strides[0] = pool.strides[1] = pc->stride;
    pool.padding = pc->pad;
    pool.dtype = pc->dtype;
    mpt_model_add_max_pooling2d(r->m, &pool);
    mpt_model_add_flatten(r->m, NULL);
    mpt_model_add_dense(r->m, &(mpt_dense_desc){.units = 7});
    CHECK(mpt_model_build(r->m, pc->batch) == MPT_OK, "build: %s", mpt_context_error(r->c));
    r->pair = pc->conv_before;
    L = &r->m->layers[r->pair];
    CHECK(L->pools_next, "the Conv2D was not planned to run the pooling");
    if (unfuse) L->pools_next = 0;
    y = (unsigned char *)L->y;
    y_bytes = mpt_dtype_size(pc->dtype) * (size_t)(pc->batch * L->out_count);
    memset(y, 0x7F, y_bytes);
    mpt_tensor_wrap(r->c, &tx, MPT_FLOAT32, 4, xs, (void *)x);
    CHECK(mpt_model_forward(r->m, &tx, 1, &ty) == MPT_OK, "forward: %s", mpt_context_error(r->c));
    r->fused = L->ran_next;
    for (i = 0; i < (int64_t)y_bytes && y[i] == 0x7F; i++) {}
    r->y_untouched = i == (int64_t)y_bytes;
    r->out = (float *)malloc(sizeof(float) * (size_t)mpt_tensor_count(&ty));
    mpt_convert(r->c, MPT_FLOAT32, r->out, ty.dtype, ty.data, mpt_tensor_count(&ty));
    tdy = ty;
    tdy.dtype = MPT_FLOAT32;
    tdy.data = (void *)dy;
    memset(&tdx, 0, sizeof tdx);
    CHECK(mpt_model_backward(r->m, &tdy, &tdx) == MPT_OK, "backward: %s",
          mpt_context_error(r->c));
    r->dx = (float *)malloc(sizeof(float) * (size_t)n_in);
    mpt_convert(r->c, MPT_FLOAT32, r->dx, tdx.dtype, tdx.data, n_in);
    pooled2_calls = 0;
    mpt__cpu_table.conv_direct = counting_conv_direct;
    CHECK(mpt_model_forward(r->m, &tx, 0, &ty) == MPT_OK, "inference: %s",
          mpt_context_error(r->c));
    mpt__cpu_table.conv_direct = mpt__cpu_conv_direct;
    r->pooled2 = pooled2_calls;
    r->infer = (float *)malloc(sizeof(float) * (size_t)mpt_tensor_count(&ty));
    mpt_convert(r->c, MPT_FLOAT32, r->infer, ty.dtype, ty.data, mpt_tensor_count(&ty));
}

static void pair_free(pair_run *r) {
    free(r->out), free(r->dx), free(r->infer);
    mpt_model_destroy(r->m);
    mpt_context_destroy(r->c);
}

/* Parameter k's gradient in a and b: the same bits (exact), or (else)
   within `tol` of the sum of the gradients' sizes. */
static int pair_same_grad(pair_run *a, pair_run *b, int k, int exact, double tol) {
    mpt_param_info pa, pb;
    const float *ga, *gb;
    double diff = 0, size = 0;
    int64_t i, n;
    mpt_model_param(a->m, k, &pa);
    mpt_model_param(b->m, k, &pb);
    ga = (const float *)pa.grad.data, gb = (const float *)pb.grad.data;
    n = mpt_tensor_count(&pa.grad);
    if (exact) return memcmp(ga, gb, sizeof(float) * (size_t)n) == 0;
    for (i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)ga[i] - gb[i]));
        size += fabs((double)ga[i]);
    }
    return diff <= tol * size;
}

/* The pair against the two layers one after the other: the same output
   and input gradient bits, the same gradients (the pair's Conv2D's up to
   the association of its chunk sums), the same bits on 1 and 2 threads,
   the same output from an inference forward (its pooling without an
   argmax, 2×2 windows a sample at a time, or for one input channel in
   the product's epilogue, where the windows read the padding in one case);
   and its own y never written, so the pair did run. Shapes give several
   chunks of the pair (MPT__CONV_POOL_ELEMS outputs), odd sizes leave
   pixels no window reads, overlapping 'same' windows share pixels. */
static void test_conv_pool_pair(void) {
    static const pair_case cases[] = {
        /* one input channel (the CNN-small's first layer) */
        {23, 30, 30, 1, 32, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_FLOAT32, 0, MPT_CPU_AVX512,
         MPT_PADDING_VALID, 1},
        {23, 30, 29, 1, 20, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_BFLOAT16, 0,
         MPT_CPU_AVX512_BF16, MPT_PADDING_VALID, 1},
        {23, 29, 30, 1, 40, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_FLOAT16, 0, MPT_CPU_AVX512,
         MPT_PADDING_VALID, 1},
        {5, 28, 27, 1, 32, 2, 2, MPT_PADDING_VALID, MPT_ACT_NONE, MPT_FLOAT32, 0, MPT_CPU_AVX512,
         MPT_PADDING_SAME, 1},
        {6, 41, 26, 1, 24, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_FLOAT32, 0, MPT_CPU_AVX512,
         MPT_PADDING_VALID, 2},
        /* Winograd's products (float32, float16), a Conv2D in front */
        {80, 15, 13, 16, 24, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_FLOAT32, 1, MPT_CPU_AVX512,
         MPT_PADDING_VALID, 1},
        {9, 15, 13, 16, 24, 3, 2, MPT_PADDING_SAME, MPT_ACT_NONE, MPT_FLOAT16, 1, MPT_CPU_AVX512,
         MPT_PADDING_VALID, 1},
        /* the direct tiles (bfloat16) */
        {17, 26, 26, 12, 32, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU, MPT_BFLOAT16, 1,
         MPT_CPU_AVX512_BF16, MPT_PADDING_VALID, 1},
    };
    int ci, k;
    for (ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++) {
        const pair_case *pc = &cases[ci];
        const int64_t n_in = pc->batch * pc->h * pc->w * pc->c, n_out = pc->batch * 7;
        float *x = (float *)malloc(sizeof(float) * (size_t)n_in);
        float *dy = (float *)malloc(sizeof(float) * (size_t)n_out);
        pair_run fused, fused1, alone;
        int64_t i;
        test__begin();
        test_seed(40 + (unsigned long long)ci);
        for (i = 0; i < n_in; i++) x[i] = (float)test_uniform(-1, 1);
        for (i = 0; i < n_out; i++) dy[i] = (float)test_uniform(-1, 1);
        pair_pass(pc, 2, 0, x, dy, &fused);
        pair_pass(pc, 1, 0, x, dy, &fused1);
        pair_pass(pc, 2, 1, x, dy, &alone);
        if ((mpt_context_cpu_features(fused.c) & pc->need) == pc->need)
            CHECK(fused.fused && fused1.fused && fused.y_untouched,
                  "the pair did not run (fused %d, y untouched %d)", fused.fused,
                  fused.y_untouched);
        else
            SKIP("this CPU lacks the direct path the pair needs");
        CHECK(!alone.fused && !alone.y_untouched, "the unfused model ran the pair");
        /* inference: a one-channel Conv2D pools its 2×2 windows in the
           product's epilogue, the whole batch in one call */
        if ((mpt_context_cpu_features(fused.c) & pc->need) == pc->need) {
            const int pools = pc->c == 1 && pc->k == 2 && pc->stride == 2;
            CHECK(fused.pooled2 == pools && fused1.pooled2 == pools && alone.pooled2 == 0,
                  "conv_direct's pooled calls: %d, %d on 1 thread, %d apart (want %d, %d, 0)",
                  fused.pooled2, fused1.pooled2, alone.pooled2, pools, pools);
        }
        CHECK(memcmp(fused.out, alone.out, sizeof(float) * (size_t)n_out) == 0, "output");
        CHECK(memcmp(fused.infer, alone.out, sizeof(float) * (size_t)n_out) == 0 &&
                  memcmp(alone.infer, alone.out, sizeof(float) * (size_t)n_out) == 0,
              "inference's output");
        CHECK(memcmp(fused.dx, alone.dx, sizeof(float) * (size_t)n_in) == 0, "input gradient");
        for (k = 0; k < mpt_model_param_count(fused.m); k++) {
            /* the pair's Conv2D holds parameters 2·pair and 2·pair + 1 */
            const int pairs = k / 2 == fused.pair;
            CHECK(pair_same_grad(&fused, &alone, k, !pairs, 1e-6), "gradient of parameter %d", k);
            CHECK(pair_same_grad(&fused, &fused1, k, 1, 0), "parameter %d's gradient on 1 thread",
                  k);
        }
        test__end("conv+pool pair in=(%lld,%lld,%lld) filters %lld%s%s pool %lld/%lld %s %s %s",
                  (long long)pc->h, (long long)pc->w, (long long)pc->c, (long long)pc->filters,
                  pc->conv_pad == MPT_PADDING_SAME ? " same" : "",
                  pc->conv_sh > 1 ? " strides (2, 1)" : "", (long long)pc->k,
                  (long long)pc->stride,
                  pc->pad == MPT_PADDING_SAME ? "same" : "valid",
                  pc->act == MPT_ACT_RELU ? "relu" : "linear", mpt_dtype_name(pc->dtype));
        pair_free(&fused), pair_free(&fused1), pair_free(&alone);
        free(x), free(dy);
    }
}

int main(void) {
    TEST_RUN(test_max_pool_simd_matches_portable);
    TEST_RUN(test_max_pool_half_gradient_bits);
    TEST_RUN(test_max_pool2_inference);
    TEST_RUN(test_float16_conv_pool_chunks);
    test_max_pool_gradient_one_pass();
    test_conv_pool_pair();
    return test_summary("test_pool");
}

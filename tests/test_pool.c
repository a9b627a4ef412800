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

int main(void) {
    TEST_RUN(test_max_pool_simd_matches_portable);
    return test_summary("test_pool");
}

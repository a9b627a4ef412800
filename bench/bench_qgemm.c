/* int8 GEMM benchmark: GOPS of mpt_qgemm (int8 × int8 → int32, and
   requantized to int8 per channel) next to the GFLOP/s of the float32
   mpt_gemm on the same shapes, on 1 and 2 threads, for every int8 path
   this CPU has (AVX-512 VNNI, AVX-512 without it, AVX2).

       gcc -std=c99 -O2 -I. bench/bench_qgemm.c -o build/bench_qgemm -lpthread -lm -lz
       ./build/bench_qgemm

   One op is a multiply or an add, so a product does 2·M·N·K of them in
   both cases and the two columns compare directly. Each result is the
   best of several timed runs after a warm-up (interference only ever
   makes a run slower). The int8 times include packing B, which mpt_qgemm
   does on every call, except the "B packed ahead" line, whose B was
   packed once by mpt_qgemm_pack_b (as a quantized model's weights are).
   Prints one JSON line per result. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

static const struct {
    const char *what;
    int64_t m, n, k;
} shapes[] = {
    {"mlp fwd 1", 128, 1024, 784},
    {"mlp fwd 2", 128, 10, 1024},
    {"conv2 fwd (im2col)", 128 * 24 * 24, 32, 288},
    {"square", 512, 512, 512},
    {"square", 1024, 1024, 1024},
};

static const struct {
    const char *name;
    int disable, needs;
} paths[] = {
    {"avx512vnni", 0, MPT_CPU_AVX512 | MPT_CPU_AVX512_VNNI},
    {"avx512", MPT_CPU_AVX512_VNNI, MPT_CPU_AVX512},
    {"avx2", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16 | MPT_CPU_AVX512_VNNI, MPT_CPU_AVX2},
};

typedef struct product {
    int is_float;
    mpt_gemm_desc f;
    mpt_qgemm_desc q;
} product;

static void run(mpt_context *ctx, const void *arg) {
    const product *p = (const product *)arg;
    if (p->is_float) mpt_gemm(ctx, &p->f);
    else mpt_qgemm(ctx, &p->q);
}

static void report(const char *what, int64_t m, int64_t n, int64_t k, const char *kind,
                   const char *path, int threads, double sec) {
    printf("{\"bench\":\"qgemm\",\"shape\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
           "\"op\":\"%s\",\"path\":\"%s\",\"threads\":%d,\"gops\":%.2f,\"seconds\":%.6f}\n",
           what, (long long)m, (long long)n, (long long)k, kind, path, threads,
           2.0 * (double)m * (double)n * (double)k / sec * 1e-9, sec);
    fflush(stdout);
}

int main(void) {
    int si, pi, t;
    for (si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
        const int64_t m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
        int8_t *a8 = (int8_t *)malloc((size_t)(m * k)), *b8 = (int8_t *)malloc((size_t)(k * n));
        float *af = (float *)malloc((size_t)(m * k) * sizeof(float));
        float *bf = (float *)malloc((size_t)(k * n) * sizeof(float));
        float *cf = (float *)malloc((size_t)(m * n) * sizeof(float));
        int32_t *c32 = (int32_t *)malloc((size_t)(m * n) * sizeof(int32_t));
        int8_t *c8 = (int8_t *)malloc((size_t)(m * n));
        int32_t *mult = (int32_t *)malloc((size_t)n * sizeof(int32_t));
        int32_t *shift = (int32_t *)malloc((size_t)n * sizeof(int32_t));
        int32_t *bias = (int32_t *)malloc((size_t)n * sizeof(int32_t));
        uint32_t s = 12345;
        int64_t i;
        product p;
        for (i = 0; i < m * k; i++) {
            s = s * 1664525u + 1013904223u;
            a8[i] = (int8_t)(s >> 24);
            af[i] = (float)a8[i] / 128.0f;
        }
        for (i = 0; i < k * n; i++) {
            s = s * 1664525u + 1013904223u;
            b8[i] = (int8_t)(s >> 24);
            bf[i] = (float)b8[i] / 128.0f;
        }
        for (i = 0; i < n; i++) {
            mult[i] = (1 << 30) + (int32_t)i * 997;
            shift[i] = -12;
            bias[i] = (int32_t)(i * 31) - 500;
        }
        for (t = 1; t <= 2; t++) {
            mpt_context *ctx = NULL;
            mpt_context_desc cd;
            memset(&cd, 0, sizeof cd);
            cd.num_threads = t;
            if (mpt_context_create(&cd, &ctx) != MPT_OK) return 1;
            memset(&p, 0, sizeof p);
            p.is_float = 1;
            p.f = gemm_desc(m, n, k, 0, 0, MPT_DTYPE_DEFAULT, af, bf, cf);
            report(shapes[si].what, m, n, k, "float32 gemm", "best", t,
                   best_seconds(ctx, run, &p, 0.3));
            mpt_context_destroy(ctx);
            for (pi = 0; pi < (int)(sizeof paths / sizeof paths[0]); pi++) {
                cd.disable_cpu_features = paths[pi].disable;
                if (mpt_context_create(&cd, &ctx) != MPT_OK) return 1;
                if ((mpt_context_cpu_features(ctx) & paths[pi].needs) == paths[pi].needs) {
                    memset(&p, 0, sizeof p);
                    p.q.m = m;
                    p.q.n = n;
                    p.q.k = k;
                    p.q.a = a8;
                    p.q.lda = k;
                    p.q.a_zero_point = -3;
                    p.q.b = b8;
                    p.q.ldb = n;
                    p.q.bias = bias;
                    p.q.c = c32;
                    p.q.ldc = n;
                    report(shapes[si].what, m, n, k, "int8 -> int32", paths[pi].name, t,
                           best_seconds(ctx, run, &p, 0.3));
                    {
                        mpt_qgemm_packed *packed = NULL;
                        if (mpt_qgemm_pack_b(ctx, &p.q, &packed) != MPT_OK) return 1;
                        p.q.b_packed = packed;
                        report(shapes[si].what, m, n, k, "int8 -> int32, B packed ahead",
                               paths[pi].name, t, best_seconds(ctx, run, &p, 0.3));
                        p.q.b_packed = NULL;
                        mpt_qgemm_packed_free(ctx, packed);
                    }
                    p.q.c = NULL;
                    p.q.c_int8 = c8;
                    p.q.multiplier = mult;
                    p.q.shift = shift;
                    p.q.per_channel = 1;
                    p.q.c_zero_point = -128;
                    p.q.c_min = -128;
                    p.q.c_max = 127;
                    report(shapes[si].what, m, n, k, "int8 -> int8 requantized", paths[pi].name, t,
                           best_seconds(ctx, run, &p, 0.3));
                }
                mpt_context_destroy(ctx);
            }
        }
        free(a8);
        free(b8);
        free(af);
        free(bf);
        free(cf);
        free(c32);
        free(c8);
        free(mult);
        free(shift);
        free(bias);
    }
    return 0;
}

/* GEMM benchmark: GFLOP/s of mpt_gemm on the shapes the models use, for
   float32, bfloat16 and float16 inputs on 1 and 2 threads, and this CPU's
   measured float32 FMA peak for comparison.

       gcc -std=c99 -O2 -I. bench/bench_gemm.c -o build/bench_gemm -lpthread -lm -lz
       ./build/bench_gemm            (all shapes; about a minute)
       ./build/bench_gemm quick      (1024³ only)
       ./build/bench_gemm gpt        (examples/gpt.c's products only, each with
                                      its share of the peak measured around it)

   Prints a Markdown table and one JSON line per result. Each result is the
   best of several timed runs after a warm-up (the best, not the mean:
   interference only ever makes a run slower).

   PEAK. Each thread runs 16 independent FMA chains (vfmadd on zmm or ymm
   registers; 16 chains cover 4 cycles of latency × 2 pipes) for a fixed
   count; peak = 2 · lanes · FMAs / seconds, summed over threads. The clock
   is measured with a chain of dependent integer adds (one per cycle), so
   the peak is also printed per cycle: 32 float32 FLOP per cycle per core
   on Zen 4 (two 256-bit FMA pipes), 64 on Zen 5 (two 512-bit ones). The
   figure is measured, not assumed: the FMA width differs between CPUs
   that report the same features. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"
#include "peak.h"

/* ---- FMA peak (bench/peak.h) ---------------------------------------------- */

#define PEAK_ITERS 20000000L

/* GFLOP/s of ctx's threads each running the peak loop PEAK_ITERS times
   (lanes: the products a vector instruction makes, as peak_job's). */
static double measure_peak(mpt_context *ctx, int lanes) {
    return measure_peak_iters(ctx, lanes, PEAK_ITERS, ctx->num_threads);
}

/* One thread's peak, as measure_peak, over the thread's CPU time
   (CLOCK_THREAD_CPUTIME_ID): on a host whose other load takes the core
   away now and then, the time this thread ran rather than the time it
   waited too. ctx has one thread: the loop runs on the caller. */
static double measure_peak_cpu(mpt_context *ctx, int lanes) {
    return measure_peak_on(ctx, lanes, PEAK_ITERS, 1, CLOCK_THREAD_CPUTIME_ID);
}

/* best_seconds over the calling thread's CPU time (a one-thread context's
   product runs on the caller). */
static double best_cpu_seconds(mpt_context *ctx, const mpt_gemm_desc *d, double min_total) {
    double best = 1e30, total = 0;
    int rep;
    mpt_gemm(ctx, d);
    for (rep = 0; rep < 200 && (rep < 3 || total < min_total); rep++) {
        double t = clock_seconds(CLOCK_THREAD_CPUTIME_ID), s;
        mpt_gemm(ctx, d);
        s = clock_seconds(CLOCK_THREAD_CPUTIME_ID) - t;
        total += s;
        if (s < best) best = s;
    }
    return best;
}

/* The core clock in GHz: 10 dependent one-cycle adds per iteration. */
static double measure_clock(void) {
    double best = 0;
    int rep;
    for (rep = 0; rep < 5; rep++) {
        unsigned long x = 0;
        long i, n = 50000000L;
        double t = now(), s;
        for (i = 0; i < n; i++) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
            __asm__ __volatile__("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                                 "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                                 "add $1, %0\n\tadd $1, %0"
                                 : "+r"(x));
#else
            x += 10;
#endif
        }
        s = now() - t;
        if (x != (unsigned long)n * 10) return 0;
        if (10.0 * (double)n / s * 1e-9 > best) best = 10.0 * (double)n / s * 1e-9;
    }
    return best;
}

/* ---- the GEMM shapes ----------------------------------------------------- */

typedef struct shape {
    const char *what;
    int64_t m, n, k;
    int ta, tb;
} shape;

/* A layer's products: the forward Y = X·W (m×n×k, "nn"), and in the
   backward pass dX = dY·Wᵀ (m×k×n, "nt") and dW = Xᵀ·dY (k×n×m, "tn");
   a product named NULL is not timed (the first layer has no dX). */
typedef struct layer {
    const char *fwd, *dx, *dw;
    int64_t m, n, k;
} layer;

static const layer layers[] = {
    {"mlp fwd 1", "mlp bwd 1 dX", "mlp bwd 1 dW", 128, 1024, 784},
    {"mlp fwd 2", "mlp bwd 2 dX", "mlp bwd 2 dW", 128, 10, 1024},
    {"conv1 fwd", NULL, "conv1 bwd dW", 128 * 26 * 26, 32, 9},
    {"conv2 fwd", "conv2 bwd dX", "conv2 bwd dW", 128 * 24 * 24, 32, 288},
    {"conv3 fwd", NULL, NULL, 128 * 10 * 10, 64, 288},
    {"conv4 fwd", "conv4 bwd dX", NULL, 128 * 8 * 8, 64, 576},
    {"square", NULL, NULL, 1024, 1024, 1024},
    {"square", NULL, NULL, 2048, 2048, 2048},
    /* examples/gpt.c: 32 windows of 128 positions, width 256, MLP 1024 */
    {"gpt proj fwd", "gpt proj bwd dX", "gpt proj bwd dW", 4096, 256, 256},
    {"gpt mlp up fwd", "gpt mlp up bwd dX", "gpt mlp up bwd dW", 4096, 1024, 256},
    {"gpt mlp down fwd", "gpt mlp down bwd dX", "gpt mlp down bwd dW", 4096, 256, 1024},
};
#define N_LAYERS ((int)(sizeof layers / sizeof layers[0]))

/* Every timed product of the layers, in their order: room for 3 a layer;
   returns how many. */
static int layer_shapes(shape *out) {
    int i, n = 0;
    for (i = 0; i < N_LAYERS; i++) {
        const layer *l = &layers[i];
        const shape fwd = {l->fwd, l->m, l->n, l->k, 0, 0}, dx = {l->dx, l->m, l->k, l->n, 0, 1},
                    dw = {l->dw, l->k, l->n, l->m, 1, 0};
        if (l->fwd) out[n++] = fwd;
        if (l->dx) out[n++] = dx;
        if (l->dw) out[n++] = dw;
    }
    return n;
}

static void run_gemm(mpt_context *ctx, const void *desc) {
    mpt_gemm(ctx, (const mpt_gemm_desc *)desc);
}

int main(int argc, char **argv) {
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_BFLOAT16, MPT_FLOAT16};
    int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    int gpt = argc > 1 && strcmp(argv[1], "gpt") == 0;
    mpt_context *ctx[2];
    double ghz, peak512[2] = {0, 0}, peak256[2] = {0, 0}, sq_f32[2] = {0, 0};
    static shape shapes[3 * N_LAYERS];
    const int n_shapes = layer_shapes(shapes);
    int t, si, di;
    char cpu[256];
    cpu_name(cpu, sizeof cpu);
    for (t = 0; t < 2; t++) {
        mpt_context_desc cd;
        memset(&cd, 0, sizeof cd);
        cd.num_threads = t + 1;
        if (mpt_context_create(&cd, &ctx[t]) != MPT_OK) return 1;
    }
    printf("# CPU: %s, features 0x%x (%s%s%s)\n", cpu, mpt_context_cpu_features(ctx[0]),
           mpt_context_cpu_features(ctx[0]) & MPT_CPU_AVX2 ? "avx2 " : "",
           mpt_context_cpu_features(ctx[0]) & MPT_CPU_AVX512 ? "avx512 " : "",
           mpt_context_cpu_features(ctx[0]) & MPT_CPU_AVX512_BF16 ? "avx512bf16" : "");
    ghz = measure_clock();
    for (t = 0; t < 2; t++) {
        if (mpt_context_cpu_features(ctx[t]) & MPT_CPU_AVX512) peak512[t] = measure_peak(ctx[t], 16);
        if (mpt_context_cpu_features(ctx[t]) & MPT_CPU_AVX2) peak256[t] = measure_peak(ctx[t], 8);
        const double best = peak512[t] > peak256[t] ? peak512[t] : peak256[t];
        const double per_cycle = ghz > 0 ? best / (ghz * (t + 1)) : 0;
        printf("# fp32 FMA peak, %d thread%s: %.1f GFLOP/s (zmm), %.1f GFLOP/s (ymm) "
               "= %.1f FLOP/cycle/core at %.2f GHz\n",
               t + 1, t ? "s" : "", peak512[t], peak256[t], per_cycle, ghz);
        printf("{\"bench\":\"fma_peak\",\"threads\":%d,\"zmm_gflops\":%.1f,\"ymm_gflops\":%.1f,"
               "\"clock_ghz\":%.3f,\"flop_per_cycle_per_core\":%.1f}\n",
               t + 1, peak512[t], peak256[t], ghz, per_cycle);
    }
    if (gpt) {
        printf("\n(in parentheses: the share of the peak of the units the dtype runs on, "
               "measured around each product; the last column times one thread by its CPU "
               "time, product and peak alike)\n");
        printf("\n| shape | M×N×K | op | dtype | 1 thread GFLOP/s | 2 threads GFLOP/s "
               "| 1 thread, CPU time |\n");
        printf("|---|---|---|---|---:|---:|---:|\n");
    } else {
        printf("\n| shape | M×N×K | op | dtype | 1 thread GFLOP/s | 2 threads GFLOP/s |\n");
        printf("|---|---|---|---|---:|---:|\n");
    }
    for (si = 0; si < n_shapes; si++) {
        const shape *s = &shapes[si];
        if (quick && (s->m != 1024 || s->n != 1024)) continue;
        if (gpt != (strncmp(s->what, "gpt", 3) == 0)) continue;
        for (di = 0; di < 3; di++) {
            mpt_dtype dt = dts[di];
            void *a = random_values(dt, s->m * s->k), *b = random_values(dt, s->k * s->n);
            float *c = (float *)calloc((size_t)(s->m * s->n), sizeof(float));
            double gf[2], frac[2], cpu_gf = 0, cpu_frac = 0;
            char tr[3] = {s->ta ? 't' : 'n', s->tb ? 't' : 'n', 0};
            const mpt_gemm_desc d = gemm_desc(s->m, s->n, s->k, s->ta, s->tb, dt, a, b, c);
            for (t = 0; t < 2; t++) {
                /* gpt: the peak of the units this dtype runs on (vdpbf16ps
                   for bfloat16 where the CPU has it, the fp32 FMA else),
                   measured just before and after the product, the better
                   of the two, so that a share of it means something on a
                   host whose load changes */
                const int lanes = dt == MPT_BFLOAT16 && (mpt_context_cpu_features(ctx[t]) &
                                                         MPT_CPU_AVX512_BF16) ? 32 : 16;
                double pk = gpt ? measure_peak(ctx[t], lanes) : 0, pk2;
                double sec = best_seconds(ctx[t], run_gemm, &d,
                                          s->m == 1024 && s->n == 1024 ? 1.5 : 0.3);
                gf[t] = 2.0 * (double)s->m * (double)s->n * (double)s->k / sec * 1e-9;
                pk2 = gpt ? measure_peak(ctx[t], lanes) : 0;
                pk = pk2 > pk ? pk2 : pk;
                printf("{\"bench\":\"gemm\",\"shape\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
                       "\"trans\":\"%s\",\"dtype\":\"%s\",\"threads\":%d,\"gflops\":%.2f,"
                       "\"seconds\":%.6f",
                       s->what, (long long)s->m, (long long)s->n, (long long)s->k, tr,
                       mpt_dtype_name(dt), t + 1, gf[t], sec);
                if (pk > 0)
                    printf(",\"peak_unit\":\"%s\",\"peak_gflops\":%.1f,\"peak_fraction\":%.3f",
                           lanes == 32 ? "vdpbf16ps" : "fma_zmm", pk, gf[t] / pk);
                if (gpt && t == 0) { /* one thread, by its CPU time as well */
                    const double pc0 = measure_peak_cpu(ctx[0], lanes);
                    const double sc = best_cpu_seconds(ctx[0], &d, 0.3);
                    const double pc1 = measure_peak_cpu(ctx[0], lanes);
                    cpu_gf = 2.0 * (double)s->m * (double)s->n * (double)s->k / sc * 1e-9;
                    cpu_frac = cpu_gf / (pc0 > pc1 ? pc0 : pc1);
                    printf(",\"cpu_time_gflops\":%.2f,\"cpu_time_peak_fraction\":%.3f", cpu_gf,
                           cpu_frac);
                }
                printf("}\n");
                frac[t] = pk > 0 ? gf[t] / pk : 0;
                if (s->m == 1024 && s->n == 1024 && s->k == 1024 && dt == MPT_FLOAT32) sq_f32[t] = gf[t];
            }
            if (gpt)
                printf("| %s | %lld×%lld×%lld | %s | %s | %.1f (%.0f %%) | %.1f (%.0f %%) "
                       "| %.1f (%.0f %%) |\n",
                       s->what, (long long)s->m, (long long)s->n, (long long)s->k, tr,
                       mpt_dtype_name(dt), gf[0], 100 * frac[0], gf[1], 100 * frac[1], cpu_gf,
                       100 * cpu_frac);
            else
                printf("| %s | %lld×%lld×%lld | %s | %s | %.1f | %.1f |\n", s->what,
                       (long long)s->m, (long long)s->n, (long long)s->k, tr,
                       mpt_dtype_name(dt), gf[0], gf[1]);
            fflush(stdout);
            free(a);
            free(b);
            free(c);
        }
    }
    /* The peak again, after the GEMMs: on a shared host (a VM) the cores
       are not always all ours, so the best of both measurements is used. */
    for (t = 0; t < 2; t++) {
        double p5 = 0, p2 = 0, g = measure_clock();
        if (mpt_context_cpu_features(ctx[t]) & MPT_CPU_AVX512) p5 = measure_peak(ctx[t], 16);
        if (mpt_context_cpu_features(ctx[t]) & MPT_CPU_AVX2) p2 = measure_peak(ctx[t], 8);
        peak512[t] = p5 > peak512[t] ? p5 : peak512[t];
        peak256[t] = p2 > peak256[t] ? p2 : peak256[t];
        ghz = g > ghz ? g : ghz;
        printf("# fp32 FMA peak again, %d thread%s: %.1f GFLOP/s (zmm), %.1f (ymm); best of both: "
               "%.1f (zmm), clock %.2f GHz\n", t + 1, t ? "s" : "", p5, p2, peak512[t], ghz);
    }
    for (t = 0; t < 2; t++) {
        /* Reference: the measured per-core peak times the threads (a
           2-thread peak measured while the host ran something on the other
           core would understate it), or the 2-thread one if higher. */
        double pk1 = peak512[0] > 0 ? peak512[0] : peak256[0];
        double pkt = peak512[t] > 0 ? peak512[t] : peak256[t];
        double pk = pk1 * (t + 1) > pkt ? pk1 * (t + 1) : pkt;
        if (pk > 0 && sq_f32[t] > 0)
            printf("# 1024^3 float32, %d thread%s: %.1f GFLOP/s = %.1f%% of the measured FMA "
                   "peak (%.1f at %.2f GHz)\n",
                   t + 1, t ? "s" : "", sq_f32[t], 100.0 * sq_f32[t] / pk, pk, ghz);
    }
    for (t = 0; t < 2; t++) mpt_context_destroy(ctx[t]);
    return 0;
}

/* The FMA peak probes that frame the CPU benchmarks' figures: each thread
   runs 16 independent chains (vfmadd on zmm or ymm registers, or
   vdpbf16ps; 16 chains cover 4 cycles of latency × 2 pipes) for a count;
   peak = 2 · lanes · instructions / seconds, summed over threads. Two
   threads reaching about twice one thread's rate says the two run on two
   cores; about once, that they share one (a virtual machine's two CPUs
   can be one core's two hardware threads, or be given one core's time,
   and that changes from minute to minute).

   Include after mpt.h's implementation (its target attributes and its
   thread pool, mpt__parallel_for) and common.h. */
#ifndef MPT_BENCH_PEAK_H
#define MPT_BENCH_PEAK_H

static volatile float peak_sink;

#if MPT__X86
#define PEAK_BODY(T, SET1, FMA, ADD, RED)                                              \
    T x = SET1(0.9999999f), y = SET1(1e-7f);                                           \
    T c0 = SET1(0), c1 = SET1(1), c2 = SET1(2), c3 = SET1(3), c4 = SET1(4), c5 = SET1(5), \
      c6 = SET1(6), c7 = SET1(7), c8 = SET1(8), c9 = SET1(9), c10 = SET1(10),          \
      c11 = SET1(11), c12 = SET1(12), c13 = SET1(13), c14 = SET1(14), c15 = SET1(15);  \
    long i;                                                                            \
    for (i = 0; i < iters; i++) {                                                      \
        c0 = FMA(c0, x, y); c1 = FMA(c1, x, y); c2 = FMA(c2, x, y); c3 = FMA(c3, x, y); \
        c4 = FMA(c4, x, y); c5 = FMA(c5, x, y); c6 = FMA(c6, x, y); c7 = FMA(c7, x, y); \
        c8 = FMA(c8, x, y); c9 = FMA(c9, x, y); c10 = FMA(c10, x, y);                 \
        c11 = FMA(c11, x, y); c12 = FMA(c12, x, y); c13 = FMA(c13, x, y);             \
        c14 = FMA(c14, x, y); c15 = FMA(c15, x, y);                                    \
        __asm__ __volatile__("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3));             \
    }                                                                                  \
    c0 = ADD(ADD(ADD(c0, c1), ADD(c2, c3)), ADD(ADD(c4, c5), ADD(c6, c7)));            \
    c8 = ADD(ADD(ADD(c8, c9), ADD(c10, c11)), ADD(ADD(c12, c13), ADD(c14, c15)));      \
    peak_sink = RED(ADD(c0, c8));

MPT__TARGET_AVX512 static void peak_avx512(long iters) {
    PEAK_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps)
}
MPT__TARGET_AVX2 static float peak_red256(__m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return f[0] + f[7];
}
MPT__TARGET_AVX2 static void peak_avx2(long iters) {
    PEAK_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, peak_red256)
}
#endif

#if MPT__X86
/* The bfloat16 peak: the same 16 chains of vdpbf16ps, each instruction 16
   lanes × 2 products × 2 FLOP = 64 FLOP (twice the fp32 FMA's, on Zen 4
   at the same rate). */
#define PEAK_DPBF16(c, x, y) _mm512_dpbf16_ps(c, x, y)
MPT__TARGET_AVX512_BF16 static void peak_avx512_bf16(long iters) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80),
                   y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
    __m512 c0 = _mm512_set1_ps(0), c1 = _mm512_set1_ps(1), c2 = _mm512_set1_ps(2),
           c3 = _mm512_set1_ps(3), c4 = _mm512_set1_ps(4), c5 = _mm512_set1_ps(5),
           c6 = _mm512_set1_ps(6), c7 = _mm512_set1_ps(7), c8 = _mm512_set1_ps(8),
           c9 = _mm512_set1_ps(9), c10 = _mm512_set1_ps(10), c11 = _mm512_set1_ps(11),
           c12 = _mm512_set1_ps(12), c13 = _mm512_set1_ps(13), c14 = _mm512_set1_ps(14),
           c15 = _mm512_set1_ps(15);
    long i;
    for (i = 0; i < iters; i++) {
        c0 = PEAK_DPBF16(c0, x, y); c1 = PEAK_DPBF16(c1, x, y); c2 = PEAK_DPBF16(c2, x, y);
        c3 = PEAK_DPBF16(c3, x, y); c4 = PEAK_DPBF16(c4, x, y); c5 = PEAK_DPBF16(c5, x, y);
        c6 = PEAK_DPBF16(c6, x, y); c7 = PEAK_DPBF16(c7, x, y); c8 = PEAK_DPBF16(c8, x, y);
        c9 = PEAK_DPBF16(c9, x, y); c10 = PEAK_DPBF16(c10, x, y); c11 = PEAK_DPBF16(c11, x, y);
        c12 = PEAK_DPBF16(c12, x, y); c13 = PEAK_DPBF16(c13, x, y);
        c14 = PEAK_DPBF16(c14, x, y); c15 = PEAK_DPBF16(c15, x, y);
        __asm__ __volatile__("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3));
    }
    c0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                       _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    c8 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)),
                       _mm512_add_ps(_mm512_add_ps(c12, c13), _mm512_add_ps(c14, c15)));
    peak_sink = _mm512_reduce_add_ps(_mm512_add_ps(c0, c8));
}
#undef PEAK_DPBF16
#endif

/* One thread's probe: lanes 16 (zmm FMA), 8 (ymm FMA) or 32 (zmm
   vdpbf16ps: 32 products a vector), iters times 16 instructions. */
typedef struct peak_job {
    int lanes;
    long iters;
} peak_job;

static void peak_task(void *arg, int64_t task, int thread) {
    const peak_job *j = (const peak_job *)arg;
    (void)task;
    (void)thread;
#if MPT__X86
    if (j->lanes == 32) peak_avx512_bf16(j->iters);
    else if (j->lanes == 16) peak_avx512(j->iters);
    else peak_avx2(j->iters);
#else
    (void)j;
#endif
}

/* GFLOP/s of `threads` threads of ctx's pool (at most its own) each
   running the probe, timed on `clock` (CLOCK_MONOTONIC; or, on one
   thread, CLOCK_THREAD_CPUTIME_ID: the time the thread ran, not the time
   it waited for a core too): the best of 3 runs, the first left out on
   more than one thread (it wakes the workers). */
static double measure_peak_on(mpt_context *ctx, int lanes, long iters, int threads,
                              clockid_t clock) {
    peak_job j;
    double best = 0;
    int rep;
    j.lanes = lanes;
    j.iters = iters;
    for (rep = 0; rep < 3; rep++) {
        double t = clock_seconds(clock), s;
        if (threads > 1) mpt__parallel_for(ctx, threads, peak_task, &j);
        else peak_task(&j, 0, 0);
        s = clock_seconds(clock) - t;
        if (rep > 0 || threads == 1) {
            double g = 2.0 * lanes * 16.0 * (double)iters * threads / s * 1e-9;
            if (g > best) best = g;
        }
    }
    return best;
}

/* The same on the wall clock. */
static double measure_peak_iters(mpt_context *ctx, int lanes, long iters, int threads) {
    return measure_peak_on(ctx, lanes, iters, threads, CLOCK_MONOTONIC);
}

#endif

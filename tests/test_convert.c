/* Tests of the float16 / bfloat16 conversions (the @impl-dtypes section of mpt.h).

   The scalar functions are checked against an independent reference that
   works in double: every half/bfloat16 value is computed as m · 2^k with
   ldexp, and rounding picks the nearer of the two neighbouring values by
   comparing with their midpoint (exact in double), ties to the even bit
   pattern. Every vector path is then checked bit for bit against the
   scalar functions over the same inputs, at odd lengths and offsets. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "test.h"

#include <stdint.h>

/* ---- the independent reference ------------------------------------------ */

/* Value of every non-negative pattern up to and including the first one
   past the largest finite (0x7c00 / 0x7f80), which stands for the next
   power of two: rounding an exponent-unbounded result up to it means
   overflow to inf, exactly as IEEE 754 defines the overflow threshold. */
static double ref_half_table[0x7c01];
static double ref_bf16_table[0x7f81];

static void ref_init(void) {
    int p;
    for (p = 0; p <= 0x7c00; p++) {
        int e = p >> 10, m = p & 0x3ff;
        /* subnormal m · 2^-24, normal (1024 + m) · 2^(e - 25) */
        ref_half_table[p] = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    }
    for (p = 0; p <= 0x7f80; p++) {
        int e = p >> 7, m = p & 0x7f;
        /* subnormal m · 2^-133, normal (128 + m) · 2^(e - 134) */
        ref_bf16_table[p] = e == 0 ? ldexp(m, -133) : ldexp(128 + m, e - 134);
    }
}

static int is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

/* Nearest-even rounding of x >= 0 to the pattern table[0..top] (top = inf). */
static unsigned ref_round(double x, const double *table, unsigned top) {
    unsigned lo = 0, hi = top, p;
    double mid;
    if (x >= table[top]) return top;
    /* Binary search: the largest p with table[p] <= x. */
    while (hi - lo > 1) {
        p = (lo + hi) / 2;
        if (table[p] <= x) lo = p;
        else hi = p;
    }
    if (table[lo] == x) return lo;
    mid = (table[lo] + table[lo + 1]) / 2; /* exact: one more bit than the format */
    if (x < mid) return lo;
    if (x > mid) return lo + 1;
    return (lo & 1) ? lo + 1 : lo;
}

/* The NaN rule the library defines (and F16C / AVX-512 implement): sign
   kept, quiet bit set, leading payload bits kept. */
static uint16_t ref_float_to_half(float f) {
    uint32_t u = mpt__f32_bits(f);
    unsigned sign = (u >> 16) & 0x8000u;
    if (is_nan_bits(u)) return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    return (uint16_t)(sign | ref_round(fabs((double)f), ref_half_table, 0x7c00));
}

static uint16_t ref_float_to_bf16(float f) {
    uint32_t u = mpt__f32_bits(f);
    unsigned sign = (u >> 16) & 0x8000u;
    if (is_nan_bits(u)) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)(sign | ref_round(fabs((double)f), ref_bf16_table, 0x7f80));
}

/* ---- inputs ---------------------------------------------------------------- */

typedef struct {
    float *v;
    size_t n, cap;
} float_list;

static void push(float_list *l, float f) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 1 << 16;
        l->v = (float *)realloc(l->v, l->cap * sizeof(float));
        if (!l->v) abort();
    }
    l->v[l->n++] = f;
}

static void push_both_signs(float_list *l, float f) {
    push(l, f);
    push(l, -f);
}

/* The float inputs every float -> half/bfloat16 check runs over. */
static float_list inputs;

static void build_inputs(void) {
    static const uint32_t special_bits[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,             /* ±0, ±inf    */
        0x00000001u, 0x80000001u, 0x007fffffu, 0x00400000u, 0x00008000u, /* subnormals  */
        0x00018000u, 0x00008001u, 0x807fffffu, 0x00800000u,
        0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu,             /* max finite  */
        0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7fc00000u, 0xffc00000u, /* NaN payloads */
        0x7fc00001u, 0x7fffffffu, 0xffffffffu, 0x7f802000u, 0x7f801fffu,
        0x7fa00000u, 0x7f810000u, 0x7f80ffffu, 0xffaaaaaau, 0x7fd55555u,
        0x477fefffu, 0x477ff000u, 0x477ff001u, 0x477fe000u, 0x47800000u, /* 65520 edge  */
        0x33000000u, 0x33000001u, 0x32ffffffu, 0x33800000u, 0x33c00000u, /* 2^-25, 2^-24 */
        0x38800000u, 0x387fc000u, 0x387fe000u, 0x387fffffu, 0x38000000u, /* 2^-14 edge  */
    };
    size_t i;
    int p;
    for (i = 0; i < sizeof special_bits / sizeof special_bits[0]; i++)
        push(&inputs, mpt__bits_f32(special_bits[i]));
    push_both_signs(&inputs, 65519.996f);
    push_both_signs(&inputs, 65520.0f);
    push_both_signs(&inputs, 65504.0f);
    /* Each finite half value and the midpoint to the next one (the next
       after 65504 being 65536, i.e. the overflow threshold), exactly and
       one float ulp either side. */
    for (p = 0; p < 0x7c00; p++) {
        float v = (float)ref_half_table[p];
        float mid = (float)((ref_half_table[p] + ref_half_table[p + 1]) / 2);
        if ((double)mid != (ref_half_table[p] + ref_half_table[p + 1]) / 2) abort();
        push_both_signs(&inputs, v);
        push_both_signs(&inputs, nextafterf(v, 0.0f));
        push_both_signs(&inputs, nextafterf(v, INFINITY));
        push_both_signs(&inputs, mid);
        push_both_signs(&inputs, nextafterf(mid, 0.0f));
        push_both_signs(&inputs, nextafterf(mid, INFINITY));
    }
    /* bfloat16 values are the floats whose low 16 bits are 0 and the
       midpoints those with 0x8000; this also walks the NaN payloads. */
    for (p = 0; p < 0x10000; p++) {
        static const uint32_t low[] = { 0, 1, 0x7fff, 0x8000, 0x8001, 0xffff };
        for (i = 0; i < 6; i++) push(&inputs, mpt__bits_f32(((uint32_t)p << 16) | low[i]));
    }
    test_seed(1234);
    for (i = 0; i < 2000000; i++) push(&inputs, mpt__bits_f32((uint32_t)test_next()));
    /* Uniform bits rarely land in float16's range: also draw exponents there. */
    for (i = 0; i < 1000000; i++) {
        uint32_t r = (uint32_t)test_next();
        uint32_t e = (uint32_t)test_randint(100, 145); /* 2^-27 .. 2^18 */
        push(&inputs, mpt__bits_f32((r & 0x807fffffu) | (e << 23)));
    }
}

/* ---- scalar functions against the reference ------------------------------ */

static void test_half_to_float_exhaustive(void) {
    uint32_t h;
    CHECK(ref_half_table[0x3c00] == 1.0 && ref_half_table[0x7bff] == 65504.0 &&
              ref_half_table[1] == ldexp(1, -24),
          "reference table is wrong");
    for (h = 0; h < 0x10000; h++) {
        float f = mpt_half_to_float((mpt_half)h);
        uint32_t u = mpt__f32_bits(f), sign = (h & 0x8000u) << 16;
        unsigned e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f && m) {
            uint32_t want = sign | 0x7fc00000u | (m << 13);
            CHECK(u == want, "half %04x -> %08x, want NaN %08x", (unsigned)h, (unsigned)u,
                  (unsigned)want);
        } else {
            double want = e == 0x1f ? INFINITY : ref_half_table[h & 0x7fff];
            CHECK((double)f == (sign ? -want : want) && (u & 0x80000000u) == sign,
                  "half %04x -> %.9g (%08x), want %s%.9g", (unsigned)h, (double)f,
                  (unsigned)u, sign ? "-" : "", want);
        }
    }
}

static void test_half_round_trip_exhaustive(void) {
    uint32_t h;
    for (h = 0; h < 0x10000; h++) {
        mpt_half back = mpt_float_to_half(mpt_half_to_float((mpt_half)h));
        int nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        /* A NaN comes back quiet with its payload; everything else exactly. */
        uint32_t want = nan ? (h | 0x200u) : h;
        CHECK(back == want, "half %04x -> float -> %04x, want %04x", (unsigned)h, back,
              (unsigned)want);
    }
}

static void test_bf16_to_float_exhaustive(void) {
    uint32_t b;
    CHECK(ref_bf16_table[0x3f80] == 1.0 && ref_bf16_table[1] == ldexp(1, -133),
          "reference table is wrong");
    for (b = 0; b < 0x10000; b++) {
        float f = mpt_bf16_to_float((mpt_bf16)b);
        uint32_t u = mpt__f32_bits(f), sign = (b & 0x8000u) << 16;
        unsigned e = (b >> 7) & 0xff, m = b & 0x7f;
        if (e == 0xff && m) {
            /* Widening bfloat16 is a shift: the NaN keeps every bit. */
            CHECK(u == b << 16, "bf16 %04x -> %08x, want %08x", (unsigned)b, (unsigned)u,
                  (unsigned)(b << 16));
        } else {
            double want = e == 0xff ? INFINITY : ref_bf16_table[b & 0x7fff];
            CHECK((double)f == (sign ? -want : want) && (u & 0x80000000u) == sign,
                  "bf16 %04x -> %.9g, want %s%.9g", (unsigned)b, (double)f, sign ? "-" : "",
                  want);
        }
    }
}

static void test_bf16_round_trip_exhaustive(void) {
    uint32_t b;
    for (b = 0; b < 0x10000; b++) {
        mpt_bf16 back = mpt_float_to_bf16(mpt_bf16_to_float((mpt_bf16)b));
        int nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f);
        uint32_t want = nan ? (b | 0x40u) : b;
        CHECK(back == want, "bf16 %04x -> float -> %04x, want %04x", (unsigned)b, back,
              (unsigned)want);
    }
}

/* convert (float to the 16-bit format named to) against ref on every
   input, each mismatch named. */
static void check_against_reference(const char *to, uint16_t (*convert)(float),
                                    uint16_t (*ref)(float)) {
    size_t i, bad = 0;
    for (i = 0; i < inputs.n; i++) {
        float f = inputs.v[i];
        uint16_t got = convert(f), want = ref(f);
        if (got != want) {
            bad++;
            CHECK(0, "float %08x (%.9g) -> %s %04x, want %04x", (unsigned)mpt__f32_bits(f),
                  (double)f, to, got, want);
        }
    }
    CHECK(bad == 0, "%zu mismatches", bad);
}

static void test_float_to_half_reference(void) {
    check_against_reference("half", mpt_float_to_half, ref_float_to_half);
}

static void test_float_to_bf16_reference(void) {
    check_against_reference("bf16", mpt_float_to_bf16, ref_float_to_bf16);
}

/* A few named cases, so a regression says plainly what broke. */
static void test_named_cases(void) {
    CHECK(mpt_float_to_half(1.0f) == 0x3c00, "1");
    CHECK(mpt_float_to_half(-2.0f) == 0xc000, "-2");
    CHECK(mpt_float_to_half(65504.0f) == 0x7bff, "max finite");
    CHECK(mpt_float_to_half(65519.996f) == 0x7bff, "just below 65520 rounds down");
    CHECK(mpt_float_to_half(65520.0f) == 0x7c00, "65520 overflows to inf");
    CHECK(mpt_float_to_half(-65520.0f) == 0xfc00, "-65520 overflows to -inf");
    CHECK(mpt_float_to_half(1e30f) == 0x7c00, "huge -> inf");
    CHECK(mpt_float_to_half(5.9604645e-8f) == 0x0001, "2^-24 is the smallest subnormal");
    CHECK(mpt_float_to_half(2.9802322e-8f) == 0x0000, "2^-25 ties to even (0)");
    CHECK(mpt_float_to_half(nextafterf(2.9802322e-8f, 1.0f)) == 0x0001, "above 2^-25 -> 1");
    CHECK(mpt_float_to_half(8.940697e-8f) == 0x0002, "1.5 · 2^-24 ties to even (2)");
    CHECK(mpt_float_to_half(-0.0f) == 0x8000, "-0");
    CHECK(mpt_float_to_half(mpt__bits_f32(0x7f800001u)) == 0x7e00, "sNaN, low payload -> quiet");
    CHECK(mpt_float_to_half(mpt__bits_f32(0xffa02001u)) == 0xff01, "sNaN payload truncated, quieted");
    CHECK(mpt_half_to_float(0x7c01) != mpt_half_to_float(0x7c01), "half NaN stays NaN");
    CHECK(mpt__f32_bits(mpt_half_to_float(0xfc01)) == 0xffc02000u, "half sNaN -> quiet float");
    CHECK(mpt_float_to_bf16(1.0f) == 0x3f80, "bf16 1");
    CHECK(mpt_float_to_bf16(mpt__bits_f32(0x3f808000u)) == 0x3f80, "bf16 tie to even (down)");
    CHECK(mpt_float_to_bf16(mpt__bits_f32(0x3f818000u)) == 0x3f82, "bf16 tie to even (up)");
    CHECK(mpt_float_to_bf16(mpt__bits_f32(0x7f7fffffu)) == 0x7f80, "bf16 overflow to inf");
    CHECK(mpt_float_to_bf16(mpt__bits_f32(0x00018000u)) == 0x0002, "bf16 of a float subnormal");
    CHECK(mpt_float_to_bf16(mpt__bits_f32(0xff800001u)) == 0xffc0, "bf16 sNaN -> quiet");
}

/* ---- vector paths against the scalar functions ---------------------------- */

static void silent_logger(void *user, mpt_log_level level, const char *message) {
    (void)user;
    (void)level;
    (void)message;
}

typedef struct {
    const char *name;
    int disable;  /* MPT_CPU_* bits turned off */
    int required; /* bits that must remain for the path to be the one named */
} cpu_config;

static const cpu_config configs[] = {
    { "avx512", 0, MPT_CPU_AVX512 },
    { "avx512 without f16c", MPT_CPU_F16C, MPT_CPU_AVX512 },
    { "avx2+f16c", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16, MPT_CPU_AVX2 | MPT_CPU_F16C },
    { "avx2 without f16c", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16 | MPT_CPU_F16C, MPT_CPU_AVX2 },
    { "portable", ~0, 0 },
};
#define N_CONFIGS ((int)(sizeof configs / sizeof configs[0]))

/* A context for one configuration with a few threads (so large
   conversions take the parallel path), or NULL when the CPU lacks it. */
static mpt_context *config_context(const cpu_config *c) {
    mpt_context_desc d;
    mpt_context *ctx = NULL;
    memset(&d, 0, sizeof d);
    d.num_threads = 3;
    d.disable_cpu_features = c->disable;
    d.logger.fn = silent_logger;
    if (mpt_context_create(&d, &ctx) != MPT_OK) return NULL;
    if ((mpt_context_cpu_features(ctx) & c->required) != c->required) {
        mpt_context_destroy(ctx);
        return NULL;
    }
    return ctx;
}

typedef struct {
    mpt_dtype dst, src;
} dtype_pair;

static const dtype_pair pairs[] = {
    { MPT_FLOAT16, MPT_FLOAT32 },  { MPT_BFLOAT16, MPT_FLOAT32 }, { MPT_FLOAT32, MPT_FLOAT16 },
    { MPT_FLOAT32, MPT_BFLOAT16 }, { MPT_BFLOAT16, MPT_FLOAT16 }, { MPT_FLOAT16, MPT_BFLOAT16 },
};
#define N_PAIRS ((int)(sizeof pairs / sizeof pairs[0]))

/* The scalar functions, element by element (f16 <-> bf16 composed). */
static void scalar_convert(dtype_pair p, void *dst, const void *src, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        float f;
        if (p.src == MPT_FLOAT32) f = ((const float *)src)[i];
        else if (p.src == MPT_FLOAT16) f = mpt_half_to_float(((const uint16_t *)src)[i]);
        else f = mpt_bf16_to_float(((const uint16_t *)src)[i]);
        if (p.dst == MPT_FLOAT32) ((float *)dst)[i] = f;
        else if (p.dst == MPT_FLOAT16) ((uint16_t *)dst)[i] = mpt_float_to_half(f);
        else ((uint16_t *)dst)[i] = mpt_float_to_bf16(f);
    }
}

/* Index of the first element whose bits differ, or n. */
static size_t first_difference(const void *a, const void *b, size_t n, size_t size) {
    size_t i;
    if (memcmp(a, b, n * size) == 0) return n;
    for (i = 0; i < n; i++)
        if (memcmp((const char *)a + i * size, (const char *)b + i * size, size)) return i;
    return n;
}

/* Every path over all float inputs above and all 65,536 half and bfloat16
   patterns. */
static void test_vector_paths_bit_identical(void) {
    int c, k;
    uint16_t *all16 = (uint16_t *)malloc(0x10000 * sizeof(uint16_t));
    size_t cap = inputs.n > 0x10000 ? inputs.n : 0x10000;
    void *want = malloc(cap * 4), *got = malloc(cap * 4);
    uint32_t i;
    for (i = 0; i < 0x10000; i++) all16[i] = (uint16_t)i;
    for (c = 0; c < N_CONFIGS; c++) {
        mpt_context *ctx = config_context(&configs[c]);
        test__begin();
        if (!ctx) {
            SKIP("this CPU lacks the features");
            test__end("vector path %s bit-identical to scalar", configs[c].name);
            continue;
        }
        for (k = 0; k < N_PAIRS; k++) {
            dtype_pair p = pairs[k];
            const void *src = p.src == MPT_FLOAT32 ? (const void *)inputs.v : (const void *)all16;
            size_t n = p.src == MPT_FLOAT32 ? inputs.n : 0x10000, dsize = mpt_dtype_size(p.dst);
            size_t at;
            mpt_status s;
            scalar_convert(p, want, src, n);
            memset(got, 0xa5, n * dsize);
            s = mpt_convert(ctx, p.dst, got, p.src, src, (int64_t)n);
            CHECK(s == MPT_OK, "mpt_convert: %s", mpt_status_string(s));
            at = first_difference(got, want, n, dsize);
            if (at < n) {
                uint32_t in = 0, g = 0, w = 0;
                memcpy(&in, (const char *)src + at * mpt_dtype_size(p.src), mpt_dtype_size(p.src));
                memcpy(&g, (char *)got + at * dsize, dsize);
                memcpy(&w, (char *)want + at * dsize, dsize);
                CHECK(0, "%s -> %s: element %zu (%x) gave %x, scalar %x", mpt_dtype_name(p.src),
                      mpt_dtype_name(p.dst), at, (unsigned)in, (unsigned)g, (unsigned)w);
            }
        }
        test__end("vector path %s bit-identical to scalar", configs[c].name);
        mpt_context_destroy(ctx);
    }
    free(all16);
    free(want);
    free(got);
}

/* Odd lengths, pointers off vector alignment, and nothing written outside
   [dst, dst + n): vector tails and chunk edges. */
static void test_vector_paths_lengths_offsets(void) {
    /* (1 << 20) + 17: split over the pool, with a short last chunk. */
    static const int64_t lengths[] = { 0, 1, 7, 8, 15, 16, 17, 33, 1000003, (1 << 20) + 17 };
    static const int offsets[] = { 0, 1, 3 };
    const size_t max_n = (1 << 20) + 17 + 3;
    int c, k, li, oi;
    uint32_t *src32 = (uint32_t *)malloc(max_n * 4);
    uint16_t *src16 = (uint16_t *)malloc(max_n * 2);
    void *want = malloc(max_n * 4), *dst = malloc((max_n + 1) * 4);
    size_t i;
    test_seed(99);
    for (i = 0; i < max_n; i++) {
        src32[i] = (uint32_t)test_next();
        /* Mostly in float16 range, with some specials mixed in. */
        if (i % 4) src32[i] = mpt__f32_bits((float)test_uniform(-70000.0, 70000.0) * (i % 3 ? 1.0f : 1e-6f));
        src16[i] = (uint16_t)test_next();
    }
    for (c = 0; c < N_CONFIGS; c++) {
        mpt_context *ctx = config_context(&configs[c]);
        test__begin();
        if (!ctx) {
            SKIP("this CPU lacks the features");
            test__end("vector path %s at odd lengths and offsets", configs[c].name);
            continue;
        }
        for (k = 0; k < N_PAIRS; k++) {
            dtype_pair p = pairs[k];
            const void *src = p.src == MPT_FLOAT32 ? (const void *)src32 : (const void *)src16;
            size_t ssize = mpt_dtype_size(p.src), dsize = mpt_dtype_size(p.dst);
            scalar_convert(p, want, src, max_n);
            for (li = 0; li < (int)(sizeof lengths / sizeof lengths[0]); li++) {
                for (oi = 0; oi < 3; oi++) {
                    size_t n = (size_t)lengths[li], o = (size_t)offsets[oi], at;
                    char *d = (char *)dst;
                    unsigned char guard[4];
                    memset(d, 0x5a, (n + o + 1) * dsize);
                    CHECK(mpt_convert(ctx, p.dst, d + o * dsize, p.src,
                                      (const char *)src + o * ssize, (int64_t)n) == MPT_OK,
                          "mpt_convert failed");
                    at = first_difference(d + o * dsize, (char *)want + o * dsize, n, dsize);
                    CHECK(at == n, "%s -> %s, n %zu, offset %zu: element %zu differs",
                          mpt_dtype_name(p.src), mpt_dtype_name(p.dst), n, o, at);
                    memset(guard, 0x5a, sizeof guard);
                    CHECK(memcmp(d + (o + n) * dsize, guard, dsize) == 0 &&
                              (o == 0 || memcmp(d + (o - 1) * dsize, guard, dsize) == 0),
                          "%s -> %s, n %zu, offset %zu: wrote outside dst",
                          mpt_dtype_name(p.src), mpt_dtype_name(p.dst), n, o);
                }
            }
        }
        test__end("vector path %s at odd lengths and offsets", configs[c].name);
        mpt_context_destroy(ctx);
    }
    free(src32);
    free(src16);
    free(want);
    free(dst);
}

/* The dispatcher picks the path each configuration names. */
static void test_kernel_choice(void) {
#if MPT__X86
    CHECK(mpt__convert_kernel(MPT_CPU_AVX512, MPT_FLOAT16, MPT_FLOAT32) == mpt__convert_avx512,
          "AVX-512 converts float16 without the F16C bit");
    CHECK(mpt__convert_kernel(MPT_CPU_AVX2 | MPT_CPU_F16C, MPT_FLOAT32, MPT_FLOAT16) ==
              mpt__convert_avx2, "AVX2 + F16C");
    CHECK(mpt__convert_kernel(MPT_CPU_AVX2, MPT_FLOAT16, MPT_FLOAT32) == mpt__convert_scalar,
          "float16 without F16C is portable");
    CHECK(mpt__convert_kernel(MPT_CPU_AVX2, MPT_BFLOAT16, MPT_FLOAT32) == mpt__convert_avx2,
          "bfloat16 needs only AVX2");
#endif
    CHECK(mpt__convert_kernel(0, MPT_FLOAT16, MPT_FLOAT32) == mpt__convert_scalar, "portable");
    { /* the same dtype twice: the values as they are, on every path */
        const float v[3] = {1.0f + 1.0f / 4096, 65520.0f, -3e-8f}; /* none a float16 */
        int paths[3] = {0, MPT_CPU_AVX2 | MPT_CPU_F16C, MPT_CPU_AVX512}, i;
        for (i = 0; i < 3; i++) {
            float out[3] = {0, 0, 0};
            mpt__convert_kernel(paths[i], MPT_FLOAT32, MPT_FLOAT32)(MPT_FLOAT32, out, MPT_FLOAT32,
                                                                    v, 3);
            CHECK(!memcmp(out, v, sizeof v), "float32 to float32 on path %d changed a value",
                  paths[i]);
        }
    }
}

/* Layers call mpt__convert from inside their own parallel tasks: a large
   conversion there must not start a second job on the busy pool. */
typedef struct {
    const mpt_context *ctx;
    const float *src;
    mpt_half *dst;
    int64_t per_task;
} nested_arg;

static void nested_task(void *arg, int64_t task, int thread) {
    const nested_arg *a = (const nested_arg *)arg;
    (void)thread;
    mpt__convert(a->ctx, MPT_FLOAT16, a->dst + task * a->per_task, MPT_FLOAT32,
                 a->src + task * a->per_task, a->per_task);
}

static void test_convert_inside_parallel_task(void) {
    const int64_t per_task = ((int64_t)1 << 20) + 5, tasks = 4; /* each big enough to split */
    const size_t n = (size_t)(per_task * tasks);
    float *src = (float *)malloc(n * sizeof(float));
    mpt_half *dst = (mpt_half *)malloc(n * sizeof(mpt_half));
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    nested_arg a;
    size_t i, bad = 0;
    memset(&d, 0, sizeof d);
    d.num_threads = 3;
    CHECK(mpt_context_create(&d, &ctx) == MPT_OK, "context");
    if (!ctx || !src || !dst) goto done;
    for (i = 0; i < n; i++) src[i] = (float)test_uniform(-1000.0, 1000.0);
    a.ctx = ctx;
    a.src = src;
    a.dst = dst;
    a.per_task = per_task;
    mpt__parallel_for(ctx, tasks, nested_task, &a);
    for (i = 0; i < n; i++) bad += dst[i] != mpt_float_to_half(src[i]);
    CHECK(bad == 0, "%zu elements wrong", bad);
done:
    mpt_context_destroy(ctx);
    free(src);
    free(dst);
}

/* ---- mpt_convert's checks ------------------------------------------------- */

static void test_convert_errors(void) {
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    float f[4] = { 1, 2, 3, 4 }, g[4];
    mpt_half h[4];
    memset(&d, 0, sizeof d);
    d.num_threads = 1;
    d.logger.fn = silent_logger;
    CHECK(mpt_context_create(&d, &ctx) == MPT_OK, "context");
    if (!ctx) return;
    CHECK(mpt_convert(ctx, MPT_INT32, h, MPT_FLOAT32, f, 4) == MPT_ERR_DTYPE, "int32 dst");
    CHECK(strstr(mpt_context_error(ctx), "convert") != NULL, "error message: %s",
          mpt_context_error(ctx));
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, MPT_UINT8, f, 4) == MPT_ERR_DTYPE, "uint8 src");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, MPT_DTYPE_DEFAULT, f, 4) == MPT_ERR_DTYPE, "default");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, (mpt_dtype)99, f, 4) == MPT_ERR_DTYPE, "unknown");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, MPT_FLOAT32, f, -1) == MPT_ERR_INVALID_ARGUMENT,
          "negative n");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, NULL, MPT_FLOAT32, f, 4) == MPT_ERR_INVALID_ARGUMENT,
          "NULL dst");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, MPT_FLOAT32, NULL, 4) == MPT_ERR_INVALID_ARGUMENT,
          "NULL src");
    CHECK(mpt_convert(NULL, MPT_FLOAT16, h, MPT_FLOAT32, f, 4) == MPT_ERR_INVALID_ARGUMENT,
          "NULL context");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, f, MPT_FLOAT32, f, 4) == MPT_ERR_INVALID_ARGUMENT,
          "in place between sizes");
    CHECK(mpt_convert(ctx, MPT_FLOAT32, f, MPT_FLOAT16, (const char *)f + 2, 4) ==
              MPT_ERR_INVALID_ARGUMENT, "overlapping");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, NULL, MPT_FLOAT32, NULL, 0) == MPT_OK, "n = 0, NULLs");
    CHECK(mpt_convert(ctx, MPT_FLOAT32, g, MPT_FLOAT32, NULL, 0) == MPT_OK, "n = 0, NULL src");
    CHECK(mpt_convert(ctx, MPT_FLOAT32, f, MPT_FLOAT32, f, 4) == MPT_OK && f[3] == 4,
          "same buffer, same dtype");
    CHECK(mpt_convert(ctx, MPT_FLOAT32, g, MPT_FLOAT32, f, 4) == MPT_OK && g[2] == 3,
          "copy");
    CHECK(mpt_convert(ctx, MPT_FLOAT16, h, MPT_FLOAT32, f, 4) == MPT_OK && h[1] == 0x4000,
          "float32 -> float16");
    mpt_context_destroy(ctx);
}

int main(void) {
    ref_init();
    build_inputs();
    printf("# %zu float inputs\n", inputs.n);
    TEST_RUN(test_named_cases);
    TEST_RUN(test_half_to_float_exhaustive);
    TEST_RUN(test_half_round_trip_exhaustive);
    TEST_RUN(test_bf16_to_float_exhaustive);
    TEST_RUN(test_bf16_round_trip_exhaustive);
    TEST_RUN(test_float_to_half_reference);
    TEST_RUN(test_float_to_bf16_reference);
    TEST_RUN(test_kernel_choice);
    test_vector_paths_bit_identical();
    test_vector_paths_lengths_offsets();
    TEST_RUN(test_convert_inside_parallel_task);
    TEST_RUN(test_convert_errors);
    free(inputs.v);
    return test_summary("test_convert");
}

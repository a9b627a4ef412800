/* Tests of the int8 matrix product (mpt_qgemm) and of the requantization
   helper (mpt_quantize_multiplier).

   Integer arithmetic leaves no tolerance: every int32 result must equal a
   plain triple loop in int64, and every int8 result a scalar reference of
   TFLite's requantization written here from the formulas (in int64, as
   floor divisions, not as the library's nudge-and-truncate), on every SIMD
   path, AMX's tiles first where the CPU has them (forced down with the
   context's feature mask), and on 1 and 2
   threads. Inputs cover the whole int8 range (−128 and 127 included),
   random zero points, padded leading dimensions and both orientations of
   B; outputs are poisoned before each call, and the padding between rows
   of C must keep its poison. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

static const struct {
    const char *name;
    int disable, needs;
} paths[] = {
    {"amx int8", 0, MPT_CPU_AVX512 | MPT_CPU_AVX512_VNNI | MPT_CPU_AMX_INT8},
    {"avx512 vnni", MPT_CPU_AMX_INT8, MPT_CPU_AVX512 | MPT_CPU_AVX512_VNNI},
    {"avx512 without vnni", MPT_CPU_AVX512_VNNI, MPT_CPU_AVX512},
    {"avx2 (no avx512)", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16 | MPT_CPU_AVX512_VNNI, MPT_CPU_AVX2},
    {"portable", ~0, 0},
};
#define N_PATHS ((int)(sizeof paths / sizeof paths[0]))

/* Whether ctx was made and this CPU has what path p needs. */
static int on_path(mpt_context *ctx, int p) {
    return ctx && (mpt_context_cpu_features(ctx) & paths[p].needs) == paths[p].needs;
}

/* A context of `threads` threads on path p for the running test; NULL
   when it cannot be made (the test fails) or this CPU lacks the path (the
   test skips). */
static mpt_context *path_ctx_for_test(int p, int threads) {
    mpt_context *ctx = path_ctx(threads, paths[p].disable);
    if (!ctx) CHECK(0, "context creation failed");
    else if (!on_path(ctx, p)) SKIP("this CPU lacks the path");
    else return ctx;
    mpt_context_destroy(ctx);
    return NULL;
}

#define POISON8 ((int8_t)0x5a)
#define POISON32 ((int32_t)0x5a5a5a5a)

/* ---- the reference, from the formulas ----------------------------------- */

static int64_t floor_div(int64_t a, int64_t b) { /* b > 0 */
    int64_t q = a / b;
    return a % b < 0 ? q - 1 : q;
}

static int32_t sat32(int64_t v) {
    return v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v;
}

/* TFLite's MultiplyByQuantizedMultiplier for m > 0: x·2^left (saturated),
   then round(x·m / 2^31) with ties toward +∞, then round(· / 2^right)
   with ties away from zero. */
static int32_t ref_requantize(int32_t acc, int32_t m, int shift) {
    int left = shift > 0 ? shift : 0, right = shift > 0 ? 0 : -shift;
    int64_t x = sat32((int64_t)acc * ((int64_t)1 << left));
    int64_t h = floor_div(x * m + ((int64_t)1 << 30), (int64_t)1 << 31);
    if (right == 0) return (int32_t)h;
    if (h >= 0) return (int32_t)((h + ((int64_t)1 << (right - 1))) / ((int64_t)1 << right));
    return (int32_t)-((-h + ((int64_t)1 << (right - 1))) / ((int64_t)1 << right));
}

/* ---- one product on every thread count ---------------------------------- */

typedef struct qcase {
    int64_t m, n, k;
    int trans_b, a_unsigned, int8_out, per_channel, bias;
    int64_t pad_a, pad_b, pad_c;
} qcase;

typedef struct qdata {
    mpt_qgemm_desc d;
    uint8_t *a;   /* m × lda bytes (int8 or uint8) */
    int8_t *b;
    int32_t *bias, *mult, *shift;
    int32_t *ref32; /* m × n */
    int8_t *ref8;
} qdata;

/* Random operands (B a copy of fixed_b with zero point fixed_zb when
   fixed_b is given), the int32 reference (int64 triple loop) and, for
   int8 output, multipliers scaled to the sums (some saturate) and the
   int8 reference. */
static void make_case_b(const qcase *q, qdata *x, const int8_t *fixed_b, int32_t fixed_zb) {
    mpt_qgemm_desc *d = &x->d;
    int64_t i, j, k, na, nb, maxabs = 1;
    int64_t b_rows = q->trans_b ? q->n : q->k, b_cols = q->trans_b ? q->k : q->n;
    memset(x, 0, sizeof *x);
    d->m = q->m;
    d->n = q->n;
    d->k = q->k;
    d->lda = q->k + q->pad_a;
    d->ldb = b_cols + q->pad_b;
    d->ldc = q->n + q->pad_c;
    d->trans_b = q->trans_b;
    d->a_unsigned = q->a_unsigned;
    d->a_zero_point = q->a_unsigned ? test_randint(0, 255) : test_randint(-128, 127);
    d->b_zero_point = test_randint(0, 3) == 0 ? 0 : test_randint(-128, 127);
    na = q->m * d->lda;
    nb = b_rows * d->ldb;
    x->a = (uint8_t *)malloc((size_t)(na > 0 ? na : 1));
    x->b = (int8_t *)malloc((size_t)(nb > 0 ? nb : 1));
    for (i = 0; i < na; i++) x->a[i] = (uint8_t)test_randint(0, 255);
    for (i = 0; i < nb; i++) x->b[i] = (int8_t)test_randint(-128, 127);
    /* the extremes of both ranges */
    if (na > 0) {
        x->a[0] = 0x80;
        x->a[(q->m - 1) * d->lda + q->k - 1] = 0x7f;
    }
    if (nb > 0) {
        x->b[0] = -128;
        x->b[nb - 1 - q->pad_b] = 127;
    }
    if (fixed_b) {
        memcpy(x->b, fixed_b, (size_t)(nb > 0 ? nb : 0));
        d->b_zero_point = fixed_zb;
    }
    d->a = x->a;
    d->b = x->b;
    if (q->bias) {
        x->bias = (int32_t *)malloc((size_t)q->n * sizeof(int32_t));
        for (j = 0; j < q->n; j++) x->bias[j] = test_randint(-100000, 100000);
        d->bias = x->bias;
    }
    x->ref32 = (int32_t *)malloc((size_t)(q->m * q->n) * sizeof(int32_t));
    for (i = 0; i < q->m; i++)
        for (j = 0; j < q->n; j++) {
            int64_t s = 0;
            for (k = 0; k < q->k; k++) {
                uint8_t byte = x->a[i * d->lda + k];
                int64_t av = q->a_unsigned ? (int64_t)byte : (int64_t)(int8_t)byte;
                int64_t bv = q->trans_b ? x->b[j * d->ldb + k] : x->b[k * d->ldb + j];
                s += (av - d->a_zero_point) * (bv - d->b_zero_point);
            }
            if (q->bias) s += x->bias[j];
            x->ref32[i * q->n + j] = sat32(s);
            if (llabs(s) > maxabs) maxabs = llabs(s);
        }
    if (!q->int8_out) return;
    {
        int64_t ch, channels = q->per_channel ? q->n : 1;
        int lo, hi, pick = test_randint(0, 2);
        x->mult = (int32_t *)malloc((size_t)channels * sizeof(int32_t));
        x->shift = (int32_t *)malloc((size_t)channels * sizeof(int32_t));
        for (ch = 0; ch < channels; ch++) {
            /* 2^shift ≈ 150 / maxabs, so the outputs span int8 and a few saturate */
            int s = 0;
            while (s > -31 && maxabs * pow(2.0, s) > 150) s--;
            while (s < 30 && maxabs * pow(2.0, s + 1) <= 150) s++;
            x->mult[ch] = (int32_t)test_randint(1 << 30, INT32_MAX);
            x->shift[ch] = s + test_randint(-1, 1);
            if (x->shift[ch] > 30) x->shift[ch] = 30;
            if (x->shift[ch] < -31) x->shift[ch] = -31;
        }
        d->multiplier = x->mult;
        d->shift = x->shift;
        d->per_channel = q->per_channel;
        d->c_zero_point = test_randint(-128, 127);
        if (pick == 1) { /* fused ReLU */
            d->c_min = d->c_zero_point;
            d->c_max = 127;
        } else if (pick == 2) {
            d->c_min = test_randint(-128, 0);
            d->c_max = test_randint(1, 127);
        }
        lo = d->c_min || d->c_max ? d->c_min : -128;
        hi = d->c_min || d->c_max ? d->c_max : 127;
        x->ref8 = (int8_t *)malloc((size_t)(q->m * q->n));
        for (i = 0; i < q->m * q->n; i++) {
            int64_t c = q->per_channel ? i % q->n : 0;
            int64_t v = (int64_t)ref_requantize(x->ref32[i], x->mult[c], x->shift[c]) +
                        d->c_zero_point;
            x->ref8[i] = (int8_t)(v < lo ? lo : v > hi ? hi : v);
        }
    }
}

static void make_case(const qcase *q, qdata *x) { make_case_b(q, x, NULL, 0); }

static void free_case(qdata *x) {
    free(x->a);
    free(x->b);
    free(x->bias);
    free(x->mult);
    free(x->shift);
    free(x->ref32);
    free(x->ref8);
}

/* Packs x's B on pack_ctx from a copy that is overwritten and freed
   right after (the packed B must not refer to it); NULL on failure. */
static mpt_qgemm_packed *pack_copy(mpt_context *pack_ctx, const qcase *q, const qdata *x) {
    mpt_qgemm_desc d = x->d;
    int64_t nb = (q->trans_b ? q->n : q->k) * d.ldb;
    int8_t *copy = (int8_t *)malloc((size_t)(nb > 0 ? nb : 1));
    mpt_qgemm_packed *packed = NULL;
    if (nb > 0) memcpy(copy, x->b, (size_t)nb);
    d.b = copy;
    if (mpt_qgemm_pack_b(pack_ctx, &d, &packed) != MPT_OK) packed = NULL;
    memset(copy, 0x33, (size_t)(nb > 0 ? nb : 1));
    free(copy);
    return packed;
}

/* Runs the product on ctx into poisoned output, with B as given or (with
   a pack_ctx) packed ahead on pack_ctx and b left NULL; 1 if every element
   equals the reference and the padding kept its poison. */
static int run_and_compare(mpt_context *ctx, mpt_context *pack_ctx, const qcase *q, qdata *x,
                           char *why, size_t size) {
    mpt_qgemm_desc d = x->d;
    int64_t i, j, nc = q->m * d.ldc;
    int ok = 1;
    void *out = malloc((size_t)(nc > 0 ? nc : 1) * 4);
    mpt_qgemm_packed *packed = NULL;
    mpt_status st;
    if (pack_ctx) {
        packed = pack_copy(pack_ctx, q, x);
        if (!packed) {
            snprintf(why, size, "mpt_qgemm_pack_b failed: %.200s", mpt_context_error(pack_ctx));
            free(out);
            return 0;
        }
        d.b_packed = packed;
        d.b = NULL;
        d.ldb = 0;
    }
    if (q->int8_out) {
        memset(out, POISON8, (size_t)(nc > 0 ? nc : 1));
        d.c_int8 = (int8_t *)out;
    } else {
        for (i = 0; i < nc; i++) ((int32_t *)out)[i] = POISON32;
        d.c = (int32_t *)out;
    }
    st = mpt_qgemm(ctx, &d);
    mpt_qgemm_packed_free(pack_ctx, packed);
    if (st != MPT_OK) {
        snprintf(why, size, "status %d: %.200s", (int)st, mpt_context_error(ctx));
        free(out);
        return 0;
    }
    for (i = 0; i < q->m && ok; i++)
        for (j = 0; j < d.ldc && ok; j++) {
            int64_t got = q->int8_out ? ((int8_t *)out)[i * d.ldc + j]
                                      : ((int32_t *)out)[i * d.ldc + j];
            int64_t want = j >= q->n ? (q->int8_out ? POISON8 : POISON32)
                           : q->int8_out ? x->ref8[i * q->n + j] : x->ref32[i * q->n + j];
            if (got != want) {
                snprintf(why, size, "C[%lld][%lld] = %lld, want %lld%s", (long long)i,
                         (long long)j, (long long)got, (long long)want,
                         j >= q->n ? " (padding overwritten)" : "");
                ok = 0;
            }
        }
    free(out);
    return ok;
}

/* ---- tests -------------------------------------------------------------- */

/* Every M, N, K in {1, 3, 7, 16, 17, 33, 64, 100, 257}, on every path and
   on 1 and 2 threads; the cases alternate int32 and int8 output, B's
   orientation, int8 and uint8 A, bias, per-channel requantization and
   padded leading dimensions. */
static void test_shapes(void) {
    static const int64_t dims[] = {1, 3, 7, 16, 17, 33, 64, 100, 257};
    const int nd = (int)(sizeof dims / sizeof dims[0]);
    mpt_context *ctx[N_PATHS][2];
    int have[N_PATHS], failed[N_PATHS], cases = 0;
    char why[N_PATHS][400];
    int p, t, mi, ni, ki;
    test_seed(77);
    for (p = 0; p < N_PATHS; p++) {
        for (t = 0; t < 2; t++) ctx[p][t] = path_ctx(t + 1, paths[p].disable);
        have[p] = ctx[p][0] && ctx[p][1] &&
                  (mpt_context_cpu_features(ctx[p][0]) & paths[p].needs) == paths[p].needs;
        failed[p] = 0;
        why[p][0] = 0;
    }
    for (mi = 0; mi < nd; mi++)
        for (ni = 0; ni < nd; ni++)
            for (ki = 0; ki < nd; ki++) {
                qcase q;
                qdata x;
                memset(&q, 0, sizeof q);
                q.m = dims[mi];
                q.n = dims[ni];
                q.k = dims[ki];
                q.int8_out = cases & 1;
                q.trans_b = (cases >> 1) & 1;
                q.a_unsigned = cases % 3 == 0;
                q.bias = cases % 5 != 0;
                q.per_channel = (cases >> 2) & 1;
                q.pad_a = cases % 7 == 0 ? test_randint(1, 9) : 0;
                q.pad_b = cases % 11 == 0 ? test_randint(1, 9) : 0;
                q.pad_c = cases % 4 == 1 ? test_randint(1, 9) : 0;
                cases++;
                make_case(&q, &x);
                for (p = 0; p < N_PATHS; p++)
                    for (t = 0; t < 4 && have[p]; t++) {
                        /* t: 1 and 2 threads, B packed by the call, then packed
                           ahead on the other thread count */
                        mpt_context *pack = t < 2 ? NULL : ctx[p][3 - t];
                        char w[256];
                        if (failed[p] || run_and_compare(ctx[p][t % 2], pack, &q, &x, w, sizeof w))
                            continue;
                        failed[p] = 1;
                        snprintf(why[p], sizeof why[p],
                                 "m %lld n %lld k %lld, %d thread(s), B %s, trans_b %d, %s A, "
                                 "%s: %.150s", (long long)q.m, (long long)q.n, (long long)q.k,
                                 t % 2 + 1, pack ? "packed ahead" : "packed by the call",
                                 q.trans_b, q.a_unsigned ? "uint8" : "int8",
                                 q.int8_out ? "int8 out" : "int32 out", w);
                    }
                free_case(&x);
            }
    for (p = 0; p < N_PATHS; p++) {
        test__begin();
        if (!ctx[p][0] || !ctx[p][1]) CHECK(0, "context creation failed");
        else if (!have[p]) SKIP("this CPU lacks the path");
        else CHECK(!failed[p], "%s", why[p]);
        test__end("qgemm %d shapes bit-exact, 1 and 2 threads, B packed by the call and "
                  "ahead, %s", cases, paths[p].name);
        for (t = 0; t < 2; t++) mpt_context_destroy(ctx[p][t]);
    }
}

/* Bigger products, split into many tasks: 1, 2 and 3 threads agree with
   the reference on every path (K past a few thousand, N past one panel
   block, M not a multiple of any tile). */
static void test_large(void) {
    static const qcase cases[] = {
        {301, 190, 2049, 1, 0, 0, 0, 1, 0, 0, 0},
        {128, 10, 1024, 0, 0, 1, 1, 1, 0, 0, 0},
        {37, 530, 300, 0, 1, 1, 0, 0, 0, 0, 3},
    };
    int p, c, t;
    for (p = 0; p < N_PATHS; p++) {
        test__begin();
        for (t = 1; t <= 3; t++) {
            mpt_context *ctx = path_ctx_for_test(p, t);
            if (!ctx) break;
            for (c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
                qdata x;
                char w[256];
                test_seed(500 + (unsigned)c);
                make_case(&cases[c], &x);
                CHECK(run_and_compare(ctx, NULL, &cases[c], &x, w, sizeof w),
                      "case %d, %d threads: %s", c, t, w);
                CHECK(run_and_compare(ctx, ctx, &cases[c], &x, w, sizeof w),
                      "case %d, %d threads, B packed ahead: %s", c, t, w);
                free_case(&x);
            }
            mpt_context_destroy(ctx);
        }
        test__end("qgemm large products, 1-3 threads, B packed by the call and ahead, %s",
                  paths[p].name);
    }
}

/* One case run on ctx and compared with the reference, B packed by the
   call or ahead on pack_ctx; a failure names the shape, the threads and
   where B was packed. */
static void check_qcase(mpt_context *ctx, mpt_context *pack_ctx, qcase *q, qdata *x,
                        int threads) {
    char w[256];
    CHECK(run_and_compare(ctx, pack_ctx, q, x, w, sizeof w),
          "m %lld n %lld k %lld, %d threads, B %s: %s", (long long)q->m, (long long)q->n,
          (long long)q->k, threads, pack_ctx ? "packed ahead" : "packed by the call", w);
}

/* Products of 1 to 4 rows (a batch of 1 to 4 samples) and those whose
   last panel of 12 rows is that short (14, 16, 28): the VNNI path runs
   those rows alone (mpt__qgemm_kernel_vnni_few), in place before the
   last panel and in it where K is whole groups of 4 (K = 4, 8, 12, 300),
   from a packed panel where it is not (K = 5, 6, 9: A's last group read
   in place would lie past A); every element equals the reference,
   for K odd and even in groups (its two sets of sums), whole and half
   panels of B, both orientations, int8 and uint8 A, on 1 and 2 threads. */
static void test_few_rows(void) {
    static const int64_t ms[] = {1, 2, 3, 4, 14, 16, 28};
    static const int64_t ns[] = {1, 16, 17, 32, 33, 100};
    static const int64_t ks[] = {1, 4, 5, 6, 8, 9, 12, 300};
    int p, t, mi, ni, ki, cases = 0;
    for (p = 0; p < N_PATHS; p++) {
        test__begin();
        for (t = 1; t <= 2; t++) {
            mpt_context *ctx = path_ctx_for_test(p, t);
            if (!ctx) break;
            test_seed(600 + (unsigned)t);
            for (mi = 0; mi < 7; mi++)
                for (ni = 0; ni < 6; ni++)
                    for (ki = 0; ki < 8; ki++) {
                        qcase q;
                        qdata x;
                        memset(&q, 0, sizeof q);
                        q.m = ms[mi], q.n = ns[ni], q.k = ks[ki];
                        q.int8_out = cases & 1;
                        q.trans_b = (cases >> 1) & 1;
                        q.a_unsigned = cases % 3 == 0;
                        q.bias = cases % 5 != 0;
                        q.per_channel = (cases >> 2) & 1;
                        q.pad_a = cases % 7 == 0 ? 3 : 0;
                        cases++;
                        make_case(&q, &x);
                        check_qcase(ctx, cases % 2 ? ctx : NULL, &q, &x, t);
                        free_case(&x);
                    }
            mpt_context_destroy(ctx);
        }
        test__end("qgemm products of few rows bit-exact, 1 and 2 threads, %s", paths[p].name);
    }
}

/* Products of 1 to 4 rows against a B of 256 KB or more (a batch of 1's
   large Dense: the mlp's 784 × 1024, one of 1000 × 300 whose columns
   end in half a panel) run as one task per thread, each its own columns
   (MPT__QGEMM_STREAM_BYTES); 5 rows and a smaller B as before. Every
   element equals the reference on 1, 2 and 3 threads, int8 and int32 C,
   B packed by the call and ahead. */
static void test_few_rows_large_b(void) {
    static const int64_t ms[] = {1, 2, 3, 4, 5};
    static const int64_t nk[][2] = {{1024, 784}, {300, 1000}, {100, 300}};
    int p, t, mi, c, cases = 0;
    for (p = 0; p < N_PATHS; p++) {
        test__begin();
        for (t = 1; t <= 3; t++) {
            mpt_context *ctx = path_ctx_for_test(p, t);
            if (!ctx) break;
            test_seed(700 + (unsigned)t);
            for (mi = 0; mi < 5; mi++)
                for (c = 0; c < 3; c++) {
                    qcase q;
                    qdata x;
                    memset(&q, 0, sizeof q);
                    q.m = ms[mi], q.n = nk[c][0], q.k = nk[c][1];
                    q.int8_out = cases & 1;
                    q.trans_b = 1;
                    q.a_unsigned = cases % 3 == 0;
                    q.bias = 1;
                    q.per_channel = (cases >> 1) & 1;
                    cases++;
                    make_case(&q, &x);
                    check_qcase(ctx, NULL, &q, &x, t);
                    check_qcase(ctx, ctx, &q, &x, t);
                    free_case(&x);
                }
            mpt_context_destroy(ctx);
        }
        test__end("qgemm few rows against a large B, a task per thread, bit-exact, 1-3 "
                  "threads, %s", paths[p].name);
    }
}

/* The dynamic-range model's activations quantized (mpt__q_symmetric_rows)
   and its products dequantized (mpt__q_dequantize_rows_task) in AVX-512
   give the portable loops' bits: row lengths on both sides of 16 (the
   masked tail), values that land exactly half-way between two integers
   after the scaling (ties away from zero), zeros, rows of zeros, a NaN
   (never the max) and an inf (the scalar path); outputs with and without
   ReLU, zero and negative-zero sums. */
static void test_dynamic_rows(void) {
    static const int64_t lens[] = {1, 5, 15, 16, 17, 31, 33, 100, 784};
    mpt_context *ctx = path_ctx(1, 0);
    int li, r, bad = 0, cases = 0;
    test__begin();
    if (!ctx) CHECK(0, "context creation failed");
    else if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) SKIP("this CPU lacks AVX-512");
    else {
#if MPT__X86
        test_seed(77);
        for (li = 0; li < 9; li++)
            for (r = 0; r < 6; r++) {
                const int64_t n = lens[li];
                float *x = (float *)malloc((size_t)n * 4), s0, s1;
                int8_t *q0 = (int8_t *)malloc((size_t)n), *q1 = (int8_t *)malloc((size_t)n);
                int64_t c;
                for (c = 0; c < n; c++)
                    /* multiples of 1/2 of a max 127: x·inv lands on every tie */
                    x[c] = r == 0 ? 0.0f : (float)test_randint(-254, 254) * 0.5f;
                if (r >= 1 && r <= 3) x[test_randint(0, (int)n - 1)] = 127.0f;
                if (r == 2) x[n - 1] = NAN;
                if (r == 3 && n > 1) x[0] = -0.0f;
                if (r == 4) x[test_randint(0, (int)n - 1)] = -INFINITY;
                if (r == 5)
                    for (c = 0; c < n; c++) x[c] = (float)test_uniform(-3e-3, 3e-3);
                memset(q0, 0x5a, (size_t)n), memset(q1, 0x5a, (size_t)n);
                mpt__q_symmetric_rows(x, 1, n, q0, &s0);
                mpt__q_symmetric_rows_avx512(x, 1, n, q1, &s1);
                bad += memcmp(&s0, &s1, 4) != 0 || memcmp(q0, q1, (size_t)n) != 0;
                cases++;
                free(x), free(q0), free(q1);
            }
        CHECK(bad == 0, "%d of %d rows quantized differently in AVX-512", bad, cases);
        for (li = 0; li < 9; li++)
            for (r = 0; r < 2; r++) {
                const int64_t n = lens[li], rows = 3;
                int32_t *acc = (int32_t *)malloc((size_t)(rows * n) * 4);
                float *ws = (float *)malloc((size_t)n * 4), *bias = (float *)malloc((size_t)n * 4);
                float *y0 = (float *)malloc((size_t)(rows * n) * 4);
                float *y1 = (float *)malloc((size_t)(rows * n) * 4);
                float row_scale[3] = {0.013f, 1.0f, 7.5e-4f};
                mpt__qop op;
                mpt__qrows_job j;
                int64_t c;
                memset(&op, 0, sizeof op);
                op.info.out_channels = n;
                op.info.activation = r ? MPT_ACT_RELU : MPT_ACT_NONE;
                op.wscale = ws, op.bias = bias;
                for (c = 0; c < n; c++) {
                    ws[c] = (float)test_uniform(1e-4, 1e-2);
                    bias[c] = c % 5 == 0 ? -0.0f : (float)test_uniform(-1, 1);
                }
                for (c = 0; c < rows * n; c++)
                    acc[c] = c % 7 == 0 ? 0 : test_randint(-2000000, 2000000);
                memset(&j, 0, sizeof j);
                j.op = &op, j.rows = rows, j.acc = acc, j.row_scale = row_scale;
                j.y = y0;
                mpt__q_dequantize_rows_task(&j, 0, 0);
                j.y = y1, j.avx512 = 1;
                mpt__q_dequantize_rows_task(&j, 0, 0);
                bad += memcmp(y0, y1, (size_t)(rows * n) * 4) != 0;
                cases++;
                free(acc), free(ws), free(bias), free(y0), free(y1);
            }
        CHECK(bad == 0, "%d cases dequantized differently in AVX-512", bad);
#else
        (void)lens, (void)li, (void)r, (void)bad, (void)cases;
#endif
    }
    if (ctx) mpt_context_destroy(ctx);
    test__end("dynamic int8 rows quantized and dequantized in AVX-512 as the portable loops");
}

/* Known answers of mpt_quantize_multiplier, derived by hand from
   real = multiplier · 2^(shift − 31), multiplier in [2^30, 2^31). */
static void test_quantize_multiplier(void) {
    static const struct {
        double real;
        int32_t m, s;
    } known[] = {
        {0.5, 1 << 30, 0},
        {1.0, 1 << 30, 1},
        {0.25, 1 << 30, -1},
        {0.75, 1610612736, 0},           /* 0.75·2^31 */
        {0.3, 1288490189, -1},           /* 0.6·2^31 = 1288490188.8, rounded up */
        {1.0 - 1.0 / 4294967296.0, 1 << 30, 1}, /* (2^31 − 0.5) rounds to 2^31: one more shift */
        {3.0, 1610612736, 2},            /* 0.75 · 2^2 */
        {1e12, INT32_MAX, 30},           /* saturated, as TFLite */
        {1.0 / 4294967296.0, 1 << 30, -31}, /* 2^-32 = 0.5·2^-31, the smallest taken */
    };
    mpt_context *ctx = path_ctx(1, 0);
    int32_t m = 0, s = 0;
    int i;
    for (i = 0; i < (int)(sizeof known / sizeof known[0]); i++) {
        mpt_status st = mpt_quantize_multiplier(ctx, known[i].real, &m, &s);
        CHECK(st == MPT_OK && m == known[i].m && s == known[i].s,
              "%.17g: status %d, (%ld, %ld), want (%ld, %ld)", known[i].real, (int)st, (long)m,
              (long)s, (long)known[i].m, (long)known[i].s);
    }
    CHECK(mpt_quantize_multiplier(ctx, 0.0, &m, &s) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "positive"), "0 accepted: %s", mpt_context_error(ctx));
    CHECK(mpt_quantize_multiplier(ctx, -0.5, &m, &s) == MPT_ERR_INVALID_ARGUMENT, "-0.5 accepted");
    CHECK(mpt_quantize_multiplier(ctx, NAN, &m, &s) == MPT_ERR_INVALID_ARGUMENT, "NaN accepted");
    CHECK(mpt_quantize_multiplier(ctx, INFINITY, &m, &s) == MPT_ERR_INVALID_ARGUMENT,
          "inf accepted");
    CHECK(mpt_quantize_multiplier(ctx, 1.0 / 8589934592.0, &m, &s) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "2^-32"), "2^-33 accepted: %s",
          mpt_context_error(ctx));
    CHECK(mpt_quantize_multiplier(ctx, 0.5, NULL, &s) == MPT_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(mpt_quantize_multiplier(NULL, 0.5, &m, &s) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    mpt_context_destroy(ctx);
}

/* One output element: a 1×1×1 product a·b + bias, requantized. */
static int requant_one(mpt_context *ctx, int8_t a, int32_t bias, int32_t m, int32_t s,
                       int32_t zp, int32_t lo, int32_t hi) {
    int8_t b = 1, out = POISON8;
    mpt_qgemm_desc d;
    memset(&d, 0, sizeof d);
    d.m = d.n = d.k = 1;
    d.a = &a;
    d.lda = 1;
    d.b = &b;
    d.ldb = 1;
    d.bias = &bias;
    d.c_int8 = &out;
    d.ldc = 1;
    d.multiplier = &m;
    d.shift = &s;
    d.c_zero_point = zp;
    d.c_min = lo;
    d.c_max = hi;
    if (mpt_qgemm(ctx, &d) != MPT_OK) return 1000;
    return out;
}

/* Rounding ties and saturation, answers worked out by hand: with
   multiplier 2^30 (0.5) the doubling high multiply rounds ties toward +∞
   (1·0.5 → 1, −1·0.5 → 0, 3·0.5 → 2, −3·0.5 → −1); a right shift rounds
   ties away from zero (shift −1: 2·0.25 → 0.5 → 1, −2·0.25 → −1,
   6·0.25 → 2, −6·0.25 → −2). */
static void test_rounding_and_saturation(void) {
    static const struct {
        int8_t a;
        int32_t bias, m, s, zp, lo, hi;
        int want;
    } cases[] = {
        {1, 0, 1 << 30, 0, 0, 0, 0, 1},
        {-1, 0, 1 << 30, 0, 0, 0, 0, 0},
        {3, 0, 1 << 30, 0, 0, 0, 0, 2},
        {-3, 0, 1 << 30, 0, 0, 0, 0, -1},
        {2, 0, 1 << 30, -1, 0, 0, 0, 1},
        {-2, 0, 1 << 30, -1, 0, 0, 0, -1},
        {6, 0, 1 << 30, -1, 0, 0, 0, 2},
        {-6, 0, 1 << 30, -1, 0, 0, 0, -2},
        {5, 0, 1 << 30, 0, 10, 0, 0, 13},         /* 2.5 → 3, + zero point 10 */
        {100, 0, 1 << 30, 1, 0, 0, 0, 100},       /* multiplier 1 exactly */
        {100, 0, 1 << 30, 2, 0, 0, 0, 127},       /* 200 saturates */
        {-100, 0, 1 << 30, 2, 0, 0, 0, -128},
        {-100, 0, 1 << 30, 2, -5, -5, 127, -5},   /* fused ReLU at the zero point */
        {100, 0, 1 << 30, 1, 0, -128, 6, 6},      /* a ReLU6-style ceiling */
        {1, INT32_MAX, INT32_MAX, 30, 0, 0, 0, 127},    /* sum and left shift saturate */
        {-1, INT32_MIN, INT32_MAX, 30, 0, 0, 0, -128},
        {1, 1 << 20, 1 << 30, -31, 0, 0, 0, 0},   /* 2^20·2^-32 rounds to 0 */
        /* multiplier 2^31 − 1, 2^30 · (1 − 2^-31) = 2^30 − 0.5 rounds up to 2^30,
           and 2^30 · 2^-31 = 0.5 rounds away to 1; negated, −2^30 + 0.5 rounds up
           to −2^30 + 1, which is less than half: 0 */
        {0, 1 << 30, INT32_MAX, -31, 0, 0, 0, 1},
        {0, -(1 << 30), INT32_MAX, -31, 0, 0, 0, 0},
    };
    mpt_context *ctx = path_ctx(1, 0);
    int i, p;
    for (p = 0; p < N_PATHS; p++) { /* each path has its own epilogue */
        mpt_context *pc = path_ctx(1, paths[p].disable);
        for (i = 0; pc && i < (int)(sizeof cases / sizeof cases[0]); i++) {
            int got = requant_one(pc, cases[i].a, cases[i].bias, cases[i].m, cases[i].s,
                                  cases[i].zp, cases[i].lo, cases[i].hi);
            CHECK(got == cases[i].want,
                  "%s, case %d (a %d, bias %ld, shift %ld): got %d, want %d", paths[p].name, i,
                  cases[i].a, (long)cases[i].bias, (long)cases[i].s, got, cases[i].want);
        }
        mpt_context_destroy(pc);
    }
    for (p = 0; p < N_PATHS; p++) { /* int32 output: the bias add saturates, both ways */
        mpt_context *pc = path_ctx(1, paths[p].disable);
        int8_t a = 127, b[2] = {127, -128};
        int32_t bias[2] = {INT32_MAX - 5, INT32_MIN + 5}, c[2] = {POISON32, POISON32};
        mpt_qgemm_desc d;
        memset(&d, 0, sizeof d);
        d.m = d.k = 1;
        d.n = 2;
        d.a = &a;
        d.lda = 1;
        d.b = b;
        d.ldb = 2;
        d.bias = bias;
        d.c = c;
        d.ldc = 2;
        CHECK(pc && mpt_qgemm(pc, &d) == MPT_OK && c[0] == INT32_MAX && c[1] == INT32_MIN,
              "%s: 127·127 + 2^31 − 6 gave %ld, 127·-128 − 2^31 + 5 gave %ld", paths[p].name,
              (long)c[0], (long)c[1]);
        mpt_context_destroy(pc);
    }
    mpt_context_destroy(ctx);
}

/* How many of d's int8 outputs (A int8, B K×N, a bias) differ from
   ref_requantize of the sums in int64 (saturated to int32), c's zero point
   added and clamped to c_min..c_max (or the int8 range). */
static int64_t requantized_off(const mpt_qgemm_desc *d) {
    const int8_t *a = (const int8_t *)d->a;
    const int64_t lo = d->c_min || d->c_max ? d->c_min : -128;
    const int64_t hi = d->c_min || d->c_max ? d->c_max : 127;
    int64_t i, j, kk, off = 0;
    for (i = 0; i < d->m; i++)
        for (j = 0; j < d->n; j++) {
            const int64_t ch = d->per_channel ? j : 0;
            int64_t sum = d->bias[j], q;
            for (kk = 0; kk < d->k; kk++)
                sum += (int64_t)(a[i * d->lda + kk] - d->a_zero_point) *
                       (d->b[kk * d->ldb + j] - d->b_zero_point);
            q = (int64_t)ref_requantize(sat32(sum), d->multiplier[ch], (int)d->shift[ch]) +
                d->c_zero_point;
            off += d->c_int8[i * d->ldc + j] != (q < lo ? lo : q > hi ? hi : q);
        }
    return off;
}

/* A context of `threads` threads on path p, or NULL (none made) when it
   cannot be made or this CPU lacks the path: the requantization tests
   pass over such a path. */
static mpt_context *path_ctx_or_null(int p, int threads) {
    mpt_context *ctx = path_ctx(threads, paths[p].disable);
    if (on_path(ctx, p)) return ctx;
    mpt_context_destroy(ctx);
    return NULL;
}

#define REQUANT_MAX_N 48

/* The buffers of the requantizing products: a (m × k), b (k × n), out
   (m × n), and n (at most REQUANT_MAX_N) biases, multipliers and shifts. */
typedef struct requant_buffers {
    int8_t *a, *b, *out;
    int32_t bias[REQUANT_MAX_N], mult[REQUANT_MAX_N], shift[REQUANT_MAX_N];
} requant_buffers;

/* Buffers for products of up to m × k by k × n. */
static void requant_buffers_init(requant_buffers *x, int64_t m, int64_t n, int64_t k) {
    x->a = (int8_t *)malloc((size_t)(m * k));
    x->b = (int8_t *)malloc((size_t)(k * n));
    x->out = (int8_t *)malloc((size_t)(m * n));
}

static void requant_buffers_free(requant_buffers *x) {
    free(x->a);
    free(x->b);
    free(x->out);
}

/* Random int8 values into a (m × k) and then b (k × n). */
static void draw_operands(const requant_buffers *x, int64_t m, int64_t n, int64_t k) {
    int64_t i;
    for (i = 0; i < m * k; i++) x->a[i] = (int8_t)test_randint(-128, 127);
    for (i = 0; i < k * n; i++) x->b[i] = (int8_t)test_randint(-128, 127);
}

/* The requantizing product of x's buffers (m × k by k × n), per channel or
   per tensor, unclamped, its zero points drawn in this order: a's from
   [a_zero_lo, a_zero_hi], b's from [-5, 5], c's from [-20, 20]. */
static mpt_qgemm_desc requant_desc(const requant_buffers *x, int64_t m, int64_t n, int64_t k,
                                   int per_channel, int a_zero_lo, int a_zero_hi) {
    mpt_qgemm_desc d;
    memset(&d, 0, sizeof d);
    d.m = m, d.n = n, d.k = k;
    d.a = x->a, d.lda = k, d.a_zero_point = test_randint(a_zero_lo, a_zero_hi);
    d.b = x->b, d.ldb = n, d.b_zero_point = test_randint(-5, 5);
    d.bias = x->bias;
    d.c_int8 = x->out, d.ldc = n;
    d.per_channel = per_channel;
    d.multiplier = x->mult, d.shift = x->shift;
    d.c_zero_point = test_randint(-20, 20);
    return d;
}

/* Runs d on ctx over poisoned outputs: how many of them differ from the
   reference. */
static int64_t requantize_off(mpt_context *ctx, const mpt_qgemm_desc *d) {
    memset(d->c_int8, POISON8, (size_t)(d->m * d->ldc));
    CHECK(mpt_qgemm(ctx, d) == MPT_OK, "%s", mpt_context_error(ctx));
    return requantized_off(d);
}

/* Runs sweep with x on every path this CPU has, with 1 and then 2
   threads, after seeding the generator with seed; x's buffers hold
   products of up to m × k by k × n. */
static void on_every_path(unsigned seed, int64_t m, int64_t n, int64_t k,
                          void (*sweep)(mpt_context *ctx, const char *path, int threads,
                                        requant_buffers *x)) {
    requant_buffers x;
    int p, t;
    requant_buffers_init(&x, m, n, k);
    test_seed(seed);
    for (p = 0; p < N_PATHS; p++)
        for (t = 1; t <= 2; t++) {
            mpt_context *ctx = path_ctx_or_null(p, t);
            if (!ctx) continue;
            sweep(ctx, paths[p].name, t, &x);
            mpt_context_destroy(ctx);
        }
    requant_buffers_free(&x);
}

/* test_requantize_columns on one context: 7 × 3 by 3 × n. */
static void requantize_columns_on(mpt_context *ctx, const char *path, int t, requant_buffers *x) {
    static const int64_t cols[] = {1, 15, 16, 17, 33};
    const int64_t m = 7, k = 3;
    int ci, per_channel;
    for (ci = 0; ci < 5; ci++)
        for (per_channel = 0; per_channel < 2; per_channel++) {
            const int64_t n = cols[ci];
            mpt_qgemm_desc d;
            int64_t j, off;
            draw_operands(x, m, n, k);
            for (j = 0; j < n; j++) {
                /* a bias anywhere in int32, or small, so every shift sees both */
                x->bias[j] = j % 2 ? (int32_t)(test_uniform(-1.0, 1.0) * 2147483647.0)
                                   : test_randint(-100000, 100000);
                x->mult[j] = (int32_t)((1u << 30) + (uint32_t)test_randint(0, (1 << 30) - 1));
                x->shift[j] = test_randint(-31, 30);
            }
            d = requant_desc(x, m, n, k, per_channel, -5, 5);
            if (ci % 2) d.c_min = test_randint(-128, -60), d.c_max = test_randint(60, 127);
            off = requantize_off(ctx, &d);
            CHECK(off == 0, "%s, %d thread(s), n %lld, %s: %lld of %lld outputs differ "
                  "from the reference", path, t, (long long)n,
                  per_channel ? "per channel" : "per tensor", (long long)off,
                  (long long)(m * n));
        }
}

/* The requantizing epilogue on every path against ref_requantize, column
   counts around its vector widths (1, 15, 16, 17, 33): sums and biases
   over the whole int32 range (some saturate), multipliers in [2^30, 2^31),
   shifts over all of [-31, 30], per channel and per tensor, zero points
   and a clamp, 1 and 2 threads. */
static void test_requantize_columns(void) { on_every_path(91, 7, 33, 3, requantize_columns_on); }

/* n biases up to edge (± edge, within it, or small), multipliers that
   make ties (0.5, 0.75) and any others in [2^30, 2^31), shifts in
   [-31, 0], into x. */
static void draw_layer_epilogue(requant_buffers *x, int64_t n, int64_t edge) {
    int64_t j;
    for (j = 0; j < n; j++) {
        x->bias[j] = j % 3 == 0   ? (int32_t)(j % 2 ? edge : -edge)
                     : j % 3 == 1 ? (int32_t)(test_uniform(-1.0, 1.0) * (double)edge)
                                  : test_randint(-1000, 1000);
        /* 0.5 and 0.75 make ties of the high multiply common */
        x->mult[j] = j % 4 == 0   ? 1 << 30
                     : j % 4 == 1 ? 3 << 29
                                  : (int32_t)((1u << 30) +
                                              (uint32_t)test_randint(0, (1 << 30) - 1));
        x->shift[j] = test_randint(-31, 0);
    }
}

/* test_requantize_plain on one context: 29 × k by k × n. */
static void requantize_plain_on(mpt_context *ctx, const char *path, int t, requant_buffers *x) {
    static const int64_t cols[] = {1, 15, 16, 17, 33, 48}, depths[] = {9, 300, 3000};
    const int64_t m = 29;
    int ci, di, per_channel;
    for (di = 0; di < 3; di++)
        for (ci = 0; ci < 6; ci++)
            for (per_channel = 0; per_channel < 2; per_channel++) {
                const int64_t n = cols[ci], k = depths[di];
                mpt_qgemm_desc d;
                int64_t off;
                draw_operands(x, m, n, k);
                draw_layer_epilogue(x, n, INT32_MAX - (int64_t)255 * 255 * k);
                d = requant_desc(x, m, n, k, per_channel, -128, 127);
                if (ci % 2) d.c_min = d.c_zero_point, d.c_max = test_randint(60, 127);
                off = requantize_off(ctx, &d);
                CHECK(off == 0, "%s, %d thread(s), k %lld, n %lld, %s: %lld of %lld "
                      "outputs differ from the reference", path, t, (long long)k,
                      (long long)n, per_channel ? "per channel" : "per tensor",
                      (long long)off, (long long)(m * n));
            }
}

/* The requantization of layers (every shift ≤ 0, biases that cannot
   saturate a sum), which the AVX-512 paths run through a whole-tile
   epilogue: on every path against ref_requantize, over several tiles of
   rows (29 = 12 + 12 + 5) and columns around the vector widths, depths
   from a 3×3 single-channel conv's 9 to 3000 (sums near ±2^31 / 8, so the
   high multiply's rounding sees large products), biases up to the edge
   past which a sum could saturate, multipliers that make ties (0.5, 0.75)
   and any others, shifts over all of [-31, 0], per
   channel and per tensor, with zero points and a clamp, 1 and 2 threads. */
static void test_requantize_plain(void) {
    on_every_path(92, 29, REQUANT_MAX_N, 3000, requantize_plain_on);
}

/* The largest sums: K = MPT_QGEMM_MAX_K with every factor at ±255
   ((127 − (−128)) · (−128 − 127) and the like), which must stay exact in
   int32 (65025 · 32768 = 2130739200 < 2^31), on every path and both
   orientations of B; the byte sums of the packers see 32768 bytes of 0xff. */
static void test_extremes(void) {
    static const struct {
        int a_unsigned, a, za, b, zb;
    } cases[] = {
        {0, 127, -128, -128, 127},
        {0, -128, 127, 127, -128},
        {1, 255, 0, -128, 127},
        {1, 0, 255, 127, -128},
    };
    const int64_t m = 3, n = 5, k = MPT_QGEMM_MAX_K;
    uint8_t *a = (uint8_t *)malloc((size_t)(m * k));
    int8_t *b = (int8_t *)malloc((size_t)(k * n));
    int32_t c[15];
    int p, ci, tb, i;
    for (p = 0; p < N_PATHS; p++) {
        mpt_context *ctx = path_ctx(2, paths[p].disable);
        test__begin();
        if (!on_path(ctx, p)) {
            SKIP("this CPU lacks the path");
        } else {
            for (ci = 0; ci < 4; ci++)
                for (tb = 0; tb < 2; tb++) {
                    const int64_t want = (int64_t)(cases[ci].a - cases[ci].za) *
                                         (cases[ci].b - cases[ci].zb) * k;
                    mpt_qgemm_desc d;
                    memset(a, (uint8_t)cases[ci].a, (size_t)(m * k));
                    memset(b, (uint8_t)cases[ci].b, (size_t)(k * n));
                    memset(&d, 0, sizeof d);
                    d.m = m;
                    d.n = n;
                    d.k = k;
                    d.a = a;
                    d.lda = k;
                    d.a_unsigned = cases[ci].a_unsigned;
                    d.a_zero_point = cases[ci].za;
                    d.b = b;
                    d.ldb = tb ? k : n;
                    d.trans_b = tb;
                    d.b_zero_point = cases[ci].zb;
                    d.c = c;
                    d.ldc = n;
                    for (i = 0; i < 15; i++) c[i] = POISON32;
                    CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "%s", mpt_context_error(ctx));
                    for (i = 0; i < 15; i++)
                        CHECK(c[i] == want, "case %d, trans_b %d: c[%d] = %ld, want %lld", ci, tb,
                              i, (long)c[i], (long long)want);
                }
        }
        test__end("qgemm K = MPT_QGEMM_MAX_K with ±255 factors exact, %s", paths[p].name);
        mpt_context_destroy(ctx);
    }
    free(a);
    free(b);
}

/* K = 0: C is the bias (or 0), requantized when asked; A and B unread. */
static void test_empty_depth(void) {
    mpt_context *ctx = path_ctx(2, 0);
    int32_t bias[3] = {7, -9, 1000}, c[6], m = 1 << 30, s = 0;
    int8_t c8[6];
    mpt_qgemm_desc d;
    int i;
    memset(&d, 0, sizeof d);
    d.m = 2;
    d.n = 3;
    d.ldc = 3;
    d.a_zero_point = 5;
    d.b_zero_point = -3;
    d.bias = bias;
    d.c = c;
    for (i = 0; i < 6; i++) c[i] = POISON32;
    CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "k = 0: %s", mpt_context_error(ctx));
    for (i = 0; i < 6; i++) CHECK(c[i] == bias[i % 3], "c[%d] = %ld", i, (long)c[i]);
    d.c = NULL;
    d.c_int8 = c8;
    d.multiplier = &m;
    d.shift = &s;
    memset(c8, POISON8, sizeof c8);
    CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "k = 0, int8: %s", mpt_context_error(ctx));
    CHECK(c8[0] == 4 && c8[1] == -4 && c8[2] == 127 && c8[3] == 4, "k = 0, int8: %d %d %d %d",
          c8[0], c8[1], c8[2], c8[3]); /* 3.5 → 4, −4.5 → −4, 500 → 127 */
    { /* a B of depth 0 packed ahead: the same */
        mpt_qgemm_packed *packed = NULL;
        CHECK(mpt_qgemm_pack_b(ctx, &d, &packed) == MPT_OK, "k = 0 pack: %s",
              mpt_context_error(ctx));
        d.b_packed = packed;
        memset(c8, POISON8, sizeof c8);
        CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "k = 0, packed: %s", mpt_context_error(ctx));
        CHECK(c8[0] == 4 && c8[1] == -4 && c8[2] == 127 && c8[3] == 4,
              "k = 0, packed: %d %d %d %d", c8[0], c8[1], c8[2], c8[3]);
        mpt_qgemm_packed_free(ctx, packed);
    }
    mpt_context_destroy(ctx);
}

/* One B packed once serves many products: new A, A's zero point and
   output kind each call, with b NULL; every result equals the reference,
   on each path. */
static void test_packed_reuse(void) {
    int p, r;
    for (p = 0; p < N_PATHS; p++) {
        mpt_context *ctx = path_ctx(2, paths[p].disable);
        mpt_qgemm_packed *packed = NULL;
        qcase q;
        qdata first;
        test__begin();
        if (!on_path(ctx, p)) {
            SKIP("this CPU lacks the path");
            test__end("qgemm one packed B over many products, %s", paths[p].name);
            mpt_context_destroy(ctx);
            continue;
        }
        memset(&q, 0, sizeof q);
        q.m = 45, q.n = 71, q.k = 203, q.trans_b = 1, q.bias = 1, q.per_channel = 1;
        test_seed(900 + (unsigned)p);
        make_case(&q, &first);
        CHECK(mpt_qgemm_pack_b(ctx, &first.d, &packed) == MPT_OK, "%s", mpt_context_error(ctx));
        for (r = 0; packed && r < 6; r++) {
            qdata x;
            char w[256];
            q.int8_out = r & 1;
            q.a_unsigned = r % 3 == 0;
            q.m = 1 + 37 * r;
            make_case_b(&q, &x, first.b, first.d.b_zero_point);
            x.d.b_packed = packed;
            x.d.b = NULL;
            CHECK(run_and_compare(ctx, NULL, &q, &x, w, sizeof w), "product %d: %s", r, w);
            free_case(&x);
        }
        test__end("qgemm one packed B over many products, %s", paths[p].name);
        mpt_qgemm_packed_free(ctx, packed);
        free_case(&first);
        mpt_context_destroy(ctx);
    }
}

static void expect_error(mpt_context *ctx, const mpt_qgemm_desc *d, mpt_status want,
                         const char *needle, const char *what) {
    mpt_status st = mpt_qgemm(ctx, d);
    CHECK(st == want, "%s: status %d, want %d (%s)", what, (int)st, (int)want,
          mpt_context_error(ctx));
    CHECK(strstr(mpt_context_error(ctx), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what,
          mpt_context_error(ctx), needle);
}

static void test_bad_arguments(void) {
    mpt_context *ctx = path_ctx(1, 0);
    int8_t a[64], b[64], c8[64];
    int32_t c[64], m[8] = {1 << 30, 1 << 30, 1 << 30, 1 << 30, -4, 0, 0, 0}, s[8] = {0};
    mpt_qgemm_desc d, good, good8;
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    good = (mpt_qgemm_desc){.m = 4, .n = 5, .k = 6, .a = a, .lda = 6, .b = b, .ldb = 5,
                            .c = c, .ldc = 5};
    good8 = good;
    good8.c = NULL;
    good8.c_int8 = c8;
    good8.multiplier = m;
    good8.shift = s;
    CHECK(mpt_qgemm(ctx, &good) == MPT_OK, "good call failed: %s", mpt_context_error(ctx));
    CHECK(mpt_qgemm(ctx, &good8) == MPT_OK, "good int8 call failed: %s", mpt_context_error(ctx));
    CHECK(mpt_qgemm(NULL, &good) == MPT_ERR_INVALID_ARGUMENT, "NULL context accepted");
    CHECK(mpt_qgemm(ctx, NULL) == MPT_OK, "NULL desc (the empty product) refused");
    d = good; d.a = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "a is NULL", "NULL a");
    d = good; d.b = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "b is NULL", "NULL b");
    d = good; d.c = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "both are NULL", "no output");
    d = good8; d.c = c;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "both are set", "two outputs");
    d = good; d.m = -3;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "m = -3", "negative m");
    d = good; d.k = MPT_QGEMM_MAX_K + 1;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "MPT_QGEMM_MAX_K", "k too large");
    d = good; d.trans_b = 2;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "trans_b = 2", "bad trans_b");
    d = good; d.a_zero_point = 128;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "a_zero_point = 128", "a zero point 128");
    d = good; d.a_unsigned = 1; d.a_zero_point = -1;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "uint8 range", "uint8 a zero point -1");
    d = good; d.b_zero_point = -129;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "b_zero_point = -129", "b zero point");
    d = good; d.lda = 5;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "lda = 5", "lda < k");
    d = good; d.ldb = 4;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldb = 4", "ldb < n");
    d = good; d.trans_b = 1; d.ldb = 5; /* B stored 5×6 */
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldb = 5", "ldb < k with trans_b");
    d = good; d.ldc = 2;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldc = 2", "ldc < n");
    d = good; d.multiplier = m; d.shift = s;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "c is int32", "multiplier with int32 c");
    d = good8; d.multiplier = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "multiplier is NULL", "no multiplier");
    d = good8; d.per_channel = 1; /* multiplier[4] = -4 */
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "multiplier[4] = -4", "negative multiplier");
    d = good8; d.multiplier = m + 5; /* 0 */
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "multiplier[0] = 0", "zero multiplier");
    s[0] = 31;
    d = good8;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "shift[0] = 31", "shift 31");
    s[0] = 0;
    d = good8; d.c_zero_point = 300;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "c_zero_point = 300", "c zero point");
    d = good8; d.c_min = 10; d.c_max = -10;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "c_min = 10 > c_max = -10", "c_min > c_max");
    d = good8; d.c_max = 200;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "c_max = 200", "c_max past int8");
    mpt_context_destroy(ctx);
}

/* mpt_qgemm_pack_b's own errors, and a packed B that does not fit the call. */
static void test_bad_packed(void) {
    mpt_context *ctx = path_ctx(1, 0), *portable = path_ctx(1, ~0);
    int8_t a[64], b[64];
    int32_t c[64];
    mpt_qgemm_desc good, d;
    mpt_qgemm_packed *packed = NULL, *other = NULL;
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    memset(&good, 0, sizeof good);
    good.m = 4, good.n = 5, good.k = 6;
    good.a = a, good.lda = 6;
    good.b = b, good.ldb = 5;
    good.c = c, good.ldc = 5;
    CHECK(mpt_qgemm_pack_b(NULL, &good, &packed) == MPT_ERR_INVALID_ARGUMENT, "NULL context");
    CHECK(mpt_qgemm_pack_b(ctx, NULL, &packed) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "desc is NULL"), "NULL desc: %s",
          mpt_context_error(ctx));
    CHECK(mpt_qgemm_pack_b(ctx, &good, NULL) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "packed is NULL"), "NULL out: %s",
          mpt_context_error(ctx));
    d = good; d.b = NULL;
    CHECK(mpt_qgemm_pack_b(ctx, &d, &packed) == MPT_ERR_INVALID_ARGUMENT && !packed &&
              strstr(mpt_context_error(ctx), "b is NULL"), "NULL b: %s", mpt_context_error(ctx));
    d = good; d.ldb = 4;
    CHECK(mpt_qgemm_pack_b(ctx, &d, &packed) == MPT_ERR_SHAPE && !packed &&
              strstr(mpt_context_error(ctx), "ldb = 4"), "ldb < n: %s", mpt_context_error(ctx));
    d = good; d.k = MPT_QGEMM_MAX_K + 1;
    CHECK(mpt_qgemm_pack_b(ctx, &d, &packed) == MPT_ERR_SHAPE && !packed &&
              strstr(mpt_context_error(ctx), "MPT_QGEMM_MAX_K"), "k too large: %s",
          mpt_context_error(ctx));
    d = good; d.trans_b = 3;
    CHECK(mpt_qgemm_pack_b(ctx, &d, &packed) == MPT_ERR_INVALID_ARGUMENT && !packed &&
              strstr(mpt_context_error(ctx), "trans_b = 3"), "bad trans_b: %s",
          mpt_context_error(ctx));
    CHECK(mpt_qgemm_pack_b(ctx, &good, &packed) == MPT_OK, "%s", mpt_context_error(ctx));
    d = good; d.b_packed = packed; d.b = NULL;
    CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "packed call: %s", mpt_context_error(ctx));
    d.n = 4, d.ldc = 4;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "b_packed holds a B of n = 5, k = 6", "packed n");
    d = good; d.b_packed = packed; d.k = 5;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "the call has n = 5, k = 5", "packed k");
    CHECK(portable && mpt_qgemm_pack_b(portable, &good, &other) == MPT_OK, "portable pack");
    d = good; d.b_packed = other;
    if (mpt_context_cpu_features(ctx) & MPT_CPU_AVX2)
        expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "packed for the portable kernels",
                     "packed for another path");
    else
        CHECK(mpt_qgemm(ctx, &d) == MPT_OK, "same path: %s", mpt_context_error(ctx));
    mpt_qgemm_packed_free(ctx, packed);
    mpt_qgemm_packed_free(portable, other);
    mpt_qgemm_packed_free(ctx, NULL);
    mpt_qgemm_packed_free(NULL, NULL);
    mpt_context_destroy(portable);
    mpt_context_destroy(ctx);
}

/* The CPU backend's table slot, mpt_backend.qgemm (what tests/test_cuda.c
   runs on the CPU and the GPU and compares): the reference's bits, int32
   and int8 output, B both ways, padding left alone. */
static void test_backend_slot(void) {
    mpt_context *ctx = path_ctx(2, 0);
    void *impl = NULL;
    const mpt_backend *t = ctx ? mpt_context_backend(ctx, &impl) : NULL;
    int c;
    CHECK(t && t->qgemm, "the CPU backend's table has no qgemm");
    for (c = 0; c < 4 && t && t->qgemm; c++) {
        qcase q;
        qdata x;
        mpt_qgemm_desc d;
        int64_t i, j, nc, bad = -1;
        void *out;
        mpt_status st;
        memset(&q, 0, sizeof q);
        q.m = 37, q.n = 19, q.k = 70, q.trans_b = c & 1, q.int8_out = (c >> 1) & 1;
        q.per_channel = 1, q.bias = 1, q.pad_a = 3, q.pad_c = 2;
        make_case(&q, &x);
        d = x.d;
        nc = q.m * d.ldc;
        out = malloc((size_t)nc * 4);
        if (q.int8_out) {
            memset(out, POISON8, (size_t)nc);
            d.c_int8 = (int8_t *)out;
        } else {
            for (i = 0; i < nc; i++) ((int32_t *)out)[i] = POISON32;
            d.c = (int32_t *)out;
        }
        st = t->qgemm(impl, &d);
        CHECK(st == MPT_OK, "table qgemm: status %d: %s", (int)st, mpt_context_error(ctx));
        for (i = 0; i < q.m && bad < 0; i++)
            for (j = 0; j < d.ldc && bad < 0; j++) {
                int64_t got = q.int8_out ? ((int8_t *)out)[i * d.ldc + j]
                                         : ((int32_t *)out)[i * d.ldc + j];
                int64_t want = j >= q.n ? (q.int8_out ? POISON8 : POISON32)
                               : q.int8_out ? x.ref8[i * q.n + j] : x.ref32[i * q.n + j];
                if (got != want) bad = i * d.ldc + j;
            }
        CHECK(bad < 0, "table qgemm trans_b %d %s: C element %lld differs from the reference",
              q.trans_b, q.int8_out ? "int8" : "int32", (long long)bad);
        free(out);
        free_case(&x);
    }
    mpt_context_destroy(ctx);
}

/* Which products the AMX path takes (mpt__qgemm_takes_amx), so that the
   "amx int8" path of the tests above runs on tiles where it claims to: a
   128 × 64 × 784 product with B packed on a context with AMX does; B
   packed without AMX (no slack past its last panel), a depth of 63 and
   four rows (the few-rows kernel's) do not. */
static void test_amx_taken(void) {
    mpt_context *amx = path_ctx_for_test(0, 1), *plain = amx ? path_ctx(1, MPT_CPU_AMX_INT8) : NULL;
    qcase q;
    qdata x;
    mpt_qgemm_packed *with = NULL, *without = NULL;
    mpt__qgemm_job job;
    if (!amx) return;
    memset(&q, 0, sizeof q);
    q.m = 128, q.n = 64, q.k = 784;
    make_case(&q, &x);
    with = pack_copy(amx, &q, &x);
    without = plain ? pack_copy(plain, &q, &x) : NULL;
    CHECK(with && without, "packing failed");
    memset(&job, 0, sizeof job);
    job.d = &x.d;
    mpt__qgemm_choose_kernel(&job, mpt_context_cpu_features(amx));
    CHECK(with && mpt__qgemm_takes_amx(amx, &job, with), "128 x 64 x 784: not on AMX");
    CHECK(without && !mpt__qgemm_takes_amx(amx, &job, without),
          "B packed without AMX's slack taken by AMX");
    x.d.k = 63;
    CHECK(with && !mpt__qgemm_takes_amx(amx, &job, with), "a depth of 63 taken by AMX");
    x.d.k = 784, x.d.m = 4;
    CHECK(with && !mpt__qgemm_takes_amx(amx, &job, with), "four rows taken by AMX");
    mpt_qgemm_packed_free(amx, with);
    mpt_qgemm_packed_free(plain, without);
    free_case(&x);
    mpt_context_destroy(plain);
    mpt_context_destroy(amx);
}

int main(void) {
    TEST_RUN(test_amx_taken);
    TEST_RUN(test_bad_arguments);
    TEST_RUN(test_bad_packed);
    TEST_RUN(test_quantize_multiplier);
    TEST_RUN(test_rounding_and_saturation);
    TEST_RUN(test_requantize_columns);
    TEST_RUN(test_requantize_plain);
    TEST_RUN(test_empty_depth);
    TEST_RUN(test_backend_slot);
    test_extremes();
    test_packed_reuse();
    test_shapes();
    test_large();
    test_few_rows();
    test_few_rows_large_b();
    test_dynamic_rows();
    return test_summary("test_qgemm");
}

/* Tests of the CPU GEMM (mpt_gemm): every transpose, dtype, epilogue and
   SIMD path against a double-precision reference, determinism across
   thread counts, and the errors of bad arguments.

   TOLERANCE. The inputs are rounded to their dtype first and the reference
   is computed in double from those rounded values, so the only error left
   is float32 accumulation. A sum of K products accumulated in float32 (in
   any order, with or without FMA, in blocks or in bfloat16 pairs) is within
   γ = (K + 2)·u·S of the exact value, u = 2^-24, S = |alpha|·Σ|a·b| +
   |beta·c| + |bias| (the classic bound for recursive summation, plus the
   epilogue's few roundings). We allow 2·γ, a bound that holds for every
   input rather than a typical (√K) error, so no seed can make it flaky,
   and it is still tight enough to catch a wrong element, a missed k or a
   swapped index (those are errors of order S/K or more). After an
   activation, whose slope is at most 1.13 (GELU), we allow 1.2× that plus
   8 ulps of the result and of the input for the float32 erff/expf/tanhf. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

static char tmpdir[512]; /* the cases' files: test_main makes it and removes it */

static const char *path_name(int cpu) {
    if (cpu & MPT_CPU_AVX512_BF16) return "avx512bf16";
    if (cpu & MPT_CPU_AVX512) return "avx512";
    if (cpu & MPT_CPU_AVX2) return "avx2";
    return "scalar";
}

/* Random matrix of rows × ld elements in dtype; vals receives the values
   as float (already rounded to dtype). */
static void *rand_matrix(mpt_dtype dt, int64_t rows, int64_t ld, float **vals) {
    int64_t i, n = rows * ld;
    void *p = malloc((size_t)(n > 0 ? n : 1) * 4);
    float *v = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (i = 0; i < n; i++) {
        float f = (float)test_uniform(-1, 1);
        if (dt == MPT_FLOAT16) {
            ((mpt_half *)p)[i] = mpt_float_to_half(f);
            f = mpt_half_to_float(((mpt_half *)p)[i]);
        } else if (dt == MPT_BFLOAT16) {
            ((mpt_bf16 *)p)[i] = mpt_float_to_bf16(f);
            f = mpt_bf16_to_float(((mpt_bf16 *)p)[i]);
        } else {
            ((float *)p)[i] = f;
        }
        v[i] = f;
    }
    *vals = v;
    return p;
}

typedef struct gemm_case {
    int64_t m, n, k;
    int ta, tb;
    mpt_dtype dt;
    int64_t pad_a, pad_b, pad_c; /* extra elements per row beyond the stored width */
    float alpha;
    int alpha_is_zero;
    float beta;
    int bias;
    mpt_activation act;
} gemm_case;

/* Runs one case on ctx and checks it against the reference. Optionally
   returns C (malloc'ed, m × ldc) for determinism comparisons. */
static void run_case(mpt_context *ctx, const gemm_case *g, float **c_out) {
    int64_t m = g->m, n = g->n, k = g->k;
    int64_t ar = g->ta ? k : m, ac = g->ta ? m : k, br = g->tb ? n : k, bc = g->tb ? k : n;
    int64_t lda = ac + g->pad_a, ldb = bc + g->pad_b, ldc = n + g->pad_c;
    float *av, *bv, *c0v, *bias = NULL, *c;
    void *a = rand_matrix(g->dt, ar, lda, &av);
    void *b = rand_matrix(g->dt, br, ldb, &bv);
    void *c0 = rand_matrix(MPT_FLOAT32, m, ldc, &c0v);
    int64_t i, j, p, bad = 0;
    double alpha = g->alpha_is_zero ? 0.0 : (g->alpha == 0 ? 1.0 : g->alpha);
    const float sentinel = 12345.0f;
    mpt_gemm_desc d;
    mpt_status s;
    free(c0);
    c = (float *)malloc((size_t)(m * ldc > 0 ? m * ldc : 1) * sizeof(float));
    for (i = 0; i < m; i++)
        for (j = 0; j < ldc; j++)
            /* beta = 0: poison C, so an output that is not written (or is
               computed as 0·old) shows up as NaN. Padding: a sentinel. */
            c[i * ldc + j] = j >= n ? sentinel : g->beta == 0 ? NAN : c0v[i * ldc + j];
    if (g->bias) {
        bias = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        for (j = 0; j < n; j++) bias[j] = (float)test_uniform(-1, 1);
    }
    memset(&d, 0, sizeof d);
    d.trans_a = g->ta;
    d.trans_b = g->tb;
    d.m = m;
    d.n = n;
    d.k = k;
    d.ab_dtype = g->dt;
    d.a = a;
    d.lda = lda;
    d.b = b;
    d.ldb = ldb;
    d.c = c;
    d.ldc = ldc;
    d.alpha = g->alpha;
    d.alpha_is_zero = g->alpha_is_zero;
    d.beta = g->beta;
    d.bias = bias;
    d.activation = g->act;
    s = mpt_gemm(ctx, &d);
    CHECK(s == MPT_OK, "mpt_gemm returned %d: %s", (int)s, mpt_context_error(ctx));
    for (i = 0; i < m && s == MPT_OK; i++) {
        for (j = 0; j < ldc; j++) {
            double sum = 0, mag = 0, x, want, tol, got = c[i * ldc + j];
            if (j >= n) {
                if (got != sentinel && bad++ == 0)
                    CHECK(0, "padding C[%lld][%lld] was written (%g)", (long long)i,
                          (long long)j, got);
                continue;
            }
            for (p = 0; p < k && alpha != 0; p++) {
                double x1 = av[g->ta ? p * lda + i : i * lda + p];
                double x2 = bv[g->tb ? j * ldb + p : p * ldb + j];
                sum += x1 * x2;
                mag += fabs(x1 * x2);
            }
            x = alpha * sum;
            mag *= fabs(alpha);
            if (g->beta != 0) {
                x += (double)g->beta * c0v[i * ldc + j];
                mag += fabs((double)g->beta * c0v[i * ldc + j]);
            }
            if (bias) {
                x += bias[j];
                mag += fabs(bias[j]);
            }
            want = ref_act(g->act, x);
            tol = 2.0 * (double)(k + 2) * ldexp(1.0, -24) * mag;
            if (g->act != MPT_ACT_NONE)
                tol = 1.2 * tol + 8 * ldexp(1.0, -24) * (fabs(want) + fabs(x)) + 1e-30;
            if (!(fabs(got - want) <= tol) && bad++ == 0)
                CHECK(0, "C[%lld][%lld] = %.9g, want %.9g (tolerance %.3g)", (long long)i,
                      (long long)j, got, want, tol);
        }
    }
    CHECK(bad == 0, "%lld bad elements", (long long)bad);
    if (c_out)
        *c_out = c;
    else
        free(c);
    free(a);
    free(b);
    free(av);
    free(bv);
    free(c0v);
    free(bias);
}

static const char *dt_name(mpt_dtype dt) { return dt ? mpt_dtype_name(dt) : "default (float32)"; }

/* ---------------------------------------------------------------------------------- */

/* The paths to run: each a set of disabled features. A path the CPU does not
   have is reported as SKIP. */
static const struct {
    const char *name;
    int disable;
    int needs;
} paths[] = {
    {"all features", 0, 0},
    {"avx512 without bf16", MPT_CPU_AVX512_BF16, MPT_CPU_AVX512},
    {"avx2 (no avx512)", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16, MPT_CPU_AVX2},
    {"avx2 without f16c", MPT_CPU_AVX512 | MPT_CPU_AVX512_BF16 | MPT_CPU_F16C, MPT_CPU_AVX2},
    {"scalar", ~0, 0},
};
#define N_PATHS ((int)(sizeof paths / sizeof paths[0]))

/* Random shapes (with 1, primes, non-multiples of 8/16, N = 10 and 32),
   every transpose and dtype, padded leading dimensions, on every path. */
static void test_random_shapes(void) {
    static const int64_t dims[] = {1, 2, 3, 5, 7, 8, 10, 13, 16, 17, 31, 32, 33, 47, 64, 97};
    const int n_dims = (int)(sizeof dims / sizeof dims[0]);
    static const mpt_dtype dts[] = {MPT_DTYPE_DEFAULT, MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int pi, rep;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx = path_ctx(2, paths[pi].disable);
        int have = ctx && (mpt_context_cpu_features(ctx) & paths[pi].needs) == paths[pi].needs;
        int di;
        for (di = 0; di < 4; di++) {
            test__begin();
            test_seed(1000 + (unsigned)(pi * 10 + di));
            if (!ctx) {
                CHECK(0, "context creation failed");
            } else if (!have) {
                SKIP("this CPU lacks the path");
            } else {
                for (rep = 0; rep < 40 && !test__current_failed; rep++) {
                    gemm_case g;
                    memset(&g, 0, sizeof g);
                    g.m = dims[test_randint(0, n_dims - 1)];
                    g.n = dims[test_randint(0, n_dims - 1)];
                    g.k = dims[test_randint(0, n_dims - 1)];
                    g.ta = rep & 1;
                    g.tb = (rep >> 1) & 1;
                    g.dt = dts[di];
                    g.pad_a = rep % 3 == 0 ? test_randint(1, 9) : 0;
                    g.pad_b = rep % 5 == 0 ? test_randint(1, 9) : 0;
                    g.pad_c = rep % 4 == 1 ? test_randint(1, 9) : 0;
                    g.beta = rep % 3 == 1 ? 0.5f : 0.0f;
                    g.alpha = rep % 7 == 3 ? -1.5f : 0.0f;
                    g.bias = rep % 2;
                    run_case(ctx, &g, NULL);
                    if (test__current_failed)
                        printf("  (case %d: m %lld n %lld k %lld ta %d tb %d)\n", rep,
                               (long long)g.m, (long long)g.n, (long long)g.k, g.ta, g.tb);
                }
            }
            test__end("gemm random shapes, %s, %s (best: %s)", dt_name(dts[di]), paths[pi].name,
                      ctx ? path_name(mpt_context_cpu_features(ctx)) : "?");
        }
        mpt_context_destroy(ctx);
    }
}

/* Which products the float32 AVX-512 path runs on 8-row panels: a batch
   of 128 (132 rows' work on 12-row panels), 100 (108), 40 or 5, not where
   12 fits (120, 12), gains nothing (65) or wastes under 1 % (86,528: a
   batch of 128 images of 26 × 26, im2col's rows); test_large_shapes and
   test_packed_b run such products. */
static void test_rows_of_8(void) {
    test__begin();
    CHECK(mpt__gemm_rows_of_8(128) && mpt__gemm_rows_of_8(100) && mpt__gemm_rows_of_8(5) &&
              mpt__gemm_rows_of_8(40),
          "a batch of 128, 100, 5 or 40 rows should take 8-row panels");
    CHECK(!mpt__gemm_rows_of_8(120) && !mpt__gemm_rows_of_8(12) && !mpt__gemm_rows_of_8(65) &&
              !mpt__gemm_rows_of_8(86528),
          "120, 12, 65 or 86,528 rows should keep 12-row panels");
    test__end("float32 AVX-512 products on 8-row panels where 12-row ones waste over 1 %%");
}

/* Larger shapes: several K blocks (K > 256, odd K for the bfloat16 pairs),
   several column blocks and tasks, the model shapes in small. A shallow K
   widens the column block (1 MiB of packed B): N = 4200 at K = 300 still
   takes several, the later ones starting past any multiple of 512. 128
   and 100 rows take the float32 AVX-512 path's 8-row panels
   (mpt__gemm_rows_of_8), 100 with a last panel of 4. */
static void test_large_shapes(void) {
    static const struct { int64_t m, n, k; } shapes[] = {
        {257, 513, 129}, {65, 600, 777}, {128, 10, 1024}, {300, 32, 9}, {9, 32, 2000},
        {20, 4200, 300}, {100, 70, 300},
    };
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int pi, si, di;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx = path_ctx(2, paths[pi].disable);
        int have = ctx && (mpt_context_cpu_features(ctx) & paths[pi].needs) == paths[pi].needs;
        if (pi == 3) { /* f16c off only changes the float16 packing; covered above */
            mpt_context_destroy(ctx);
            continue;
        }
        for (di = 0; di < 3; di++) {
            test__begin();
            test_seed(77 + (unsigned)(pi * 10 + di));
            if (!have) SKIP("this CPU lacks the path");
            for (si = 0; have && si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
                gemm_case g;
                memset(&g, 0, sizeof g);
                g.m = shapes[si].m;
                g.n = shapes[si].n;
                g.k = shapes[si].k;
                g.ta = si & 1;
                g.tb = (si + di) & 1;
                g.dt = dts[di];
                g.pad_c = si == 1 ? 3 : 0;
                g.beta = si == 2 ? 1.0f : 0.0f;
                g.bias = 1;
                g.act = si == 0 ? MPT_ACT_RELU : MPT_ACT_NONE;
                run_case(ctx, &g, NULL);
            }
            test__end("gemm large shapes (K blocks, tasks), %s, %s", dt_name(dts[di]),
                      paths[pi].name);
        }
        mpt_context_destroy(ctx);
    }
}

/* Every activation, alpha/beta combinations, alpha_is_zero, K = 0, M or
   N = 0, on the best and the scalar path. */
static void test_epilogue(void) {
    static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU,
                                          MPT_ACT_SIGMOID, MPT_ACT_TANH};
    int pi, ai;
    for (pi = 0; pi < N_PATHS; pi += N_PATHS - 1) {
        mpt_context *ctx = path_ctx(2, paths[pi].disable);
        for (ai = 0; ai < 5; ai++) {
            int rep;
            test__begin();
            test_seed(500 + (unsigned)ai);
            for (rep = 0; rep < 6; rep++) {
                gemm_case g;
                memset(&g, 0, sizeof g);
                g.m = 37;
                g.n = 45;
                g.k = rep == 5 ? 0 : 300;
                g.ta = rep & 1;
                g.tb = rep >> 1 & 1;
                g.act = acts[ai];
                g.alpha = rep == 1 ? 2.5f : 0.0f;
                g.alpha_is_zero = rep == 4;
                g.beta = rep >= 2 ? -0.75f : 0.0f;
                g.bias = rep != 3;
                g.dt = MPT_FLOAT32;
                run_case(ctx, &g, NULL);
            }
            test__end("gemm epilogue %s (alpha, beta, bias, alpha_is_zero, k = 0), %s",
                      acts[ai] == MPT_ACT_NONE ? "linear"
                      : acts[ai] == MPT_ACT_RELU ? "relu"
                      : acts[ai] == MPT_ACT_GELU ? "gelu"
                      : acts[ai] == MPT_ACT_SIGMOID ? "sigmoid" : "tanh",
                      paths[pi].name);
        }
        mpt_context_destroy(ctx);
    }
}

static void test_empty(void) {
    mpt_context *ctx = path_ctx(2, 0);
    float c[4] = {1, 2, 3, 4};
    mpt_gemm_desc d;
    d = (mpt_gemm_desc){.m = 0, .n = 2, .k = 3, .c = c, .ldc = 2};
    CHECK(mpt_gemm(ctx, &d) == MPT_OK, "m = 0: %s", mpt_context_error(ctx));
    d.m = 2;
    d.n = 0;
    d.ldc = 0;
    CHECK(mpt_gemm(ctx, &d) == MPT_OK, "n = 0: %s", mpt_context_error(ctx));
    CHECK(c[0] == 1 && c[3] == 4, "C changed by an empty product");
    mpt_context_destroy(ctx);
}

/* Each path on 1, 2 and 3 threads gives bit-identical C (work is split
   over C only, never over K). Shapes big enough to be split. */
static void test_determinism(void) {
    static const struct { int64_t m, n, k; int ta, tb; } shapes[] = {
        {300, 200, 700, 0, 0}, {128, 10, 1024, 0, 1}, {784, 100, 128, 1, 0}, {40, 600, 300, 1, 1},
    };
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_BFLOAT16};
    int pi, si, di, t;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx[3];
        int have;
        if (pi == 3) continue;
        for (t = 0; t < 3; t++) ctx[t] = path_ctx(t + 1, paths[pi].disable);
        have = ctx[0] && (mpt_context_cpu_features(ctx[0]) & paths[pi].needs) == paths[pi].needs;
        test__begin();
        if (!have) SKIP("this CPU lacks the path");
        for (si = 0; have && si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
            for (di = 0; di < 2; di++) {
                float *c[3];
                gemm_case g;
                memset(&g, 0, sizeof g);
                g.m = shapes[si].m;
                g.n = shapes[si].n;
                g.k = shapes[si].k;
                g.ta = shapes[si].ta;
                g.tb = shapes[si].tb;
                g.dt = dts[di];
                g.bias = 1;
                for (t = 0; t < 3; t++) {
                    test_seed(99 + (unsigned)si);
                    run_case(ctx[t], &g, &c[t]);
                }
                CHECK(memcmp(c[0], c[1], sizeof(float) * (size_t)(g.m * g.n)) == 0,
                      "%lldx%lldx%lld %s: 1 and 2 threads differ", (long long)g.m,
                      (long long)g.n, (long long)g.k, dt_name(g.dt));
                CHECK(memcmp(c[0], c[2], sizeof(float) * (size_t)(g.m * g.n)) == 0,
                      "%lldx%lldx%lld %s: 1 and 3 threads differ", (long long)g.m,
                      (long long)g.n, (long long)g.k, dt_name(g.dt));
                for (t = 0; t < 3; t++) free(c[t]);
            }
        }
        test__end("gemm determinism, 1/2/3 threads bit-identical, %s", paths[pi].name);
        for (t = 0; t < 3; t++) mpt_context_destroy(ctx[t]);
    }
}

/* A product of at most 4 rows with B not transposed (batch-1 inference)
   reads B unpacked (mpt__gemm_few_rows_strip): its rows must be the same
   bits as the same rows computed inside a 9-row product (the packed
   kernel): depths of one and several blocks, column tails, both A
   layouts, float32/float16/bfloat16 (on the float32 kernel), every
   epilogue, and 2 threads where the product is big enough to split. */
static void test_few_rows(void) {
    static const int64_t ks[] = {1, 37, 700, 1100}, ns[] = {1, 10, 17, 64, 100, 257};
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU};
    mpt_context *ctx = path_ctx(2, MPT_CPU_AVX512_BF16);
    int ki, ni, di, ta, m, bad = 0, cases = 0;
    test__begin();
    if (!ctx || !(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) SKIP("this CPU lacks AVX-512");
    for (ki = 0; ctx && (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512) && ki < 4; ki++)
        for (ni = 0; ni < 6; ni++)
            for (di = 0; di < 3; di++)
                for (ta = 0; ta < 2; ta++) {
                    const int64_t k = ks[ki], n = ns[ni], lda = (ta ? 9 : k) + 3, ldc = n + 2;
                    float *av, *bv, *cv, *bias, *full = NULL, *few = NULL;
                    void *a = rand_matrix(dts[di], ta ? k : 9, lda, &av);
                    void *b = rand_matrix(dts[di], k, n + 1, &bv);
                    void *c0 = rand_matrix(MPT_FLOAT32, 9, ldc, &cv);
                    void *bz = rand_matrix(MPT_FLOAT32, 1, n, &bias);
                    mpt_gemm_desc d;
                    memset(&d, 0, sizeof d);
                    d.trans_a = ta;
                    d.n = n;
                    d.k = k;
                    d.ab_dtype = dts[di];
                    d.a = a;
                    d.lda = lda;
                    d.b = b;
                    d.ldb = n + 1;
                    d.ldc = ldc;
                    d.alpha = (ki + ni) % 2 ? 0.75f : 0;
                    d.beta = (ni + di) % 2 ? 0.5f : 0;
                    d.bias = (ki + di) % 2 ? bias : NULL;
                    d.activation = acts[(ki + ni + di + ta) % 3];
                    full = (float *)malloc(sizeof(float) * (size_t)(9 * ldc));
                    few = (float *)malloc(sizeof(float) * (size_t)(9 * ldc));
                    memcpy(full, c0, sizeof(float) * (size_t)(9 * ldc));
                    d.m = 9;
                    d.c = full;
                    CHECK(mpt_gemm(ctx, &d) == MPT_OK, "9 rows: %s", mpt_context_error(ctx));
                    for (m = 1; m <= 4; m++) {
                        int64_t i;
                        memcpy(few, c0, sizeof(float) * (size_t)(9 * ldc));
                        d.m = m;
                        d.c = few;
                        CHECK(mpt_gemm(ctx, &d) == MPT_OK, "%d rows: %s", m,
                              mpt_context_error(ctx));
                        for (i = 0; i < m; i++)
                            if (memcmp(few + i * ldc, full + i * ldc, sizeof(float) * (size_t)n) &&
                                bad++ == 0)
                                CHECK(0, "%d rows of %lldx%lld (%s, %s A, %s): row %lld differs "
                                      "from the 9-row product's", m, (long long)n, (long long)k,
                                      mpt_dtype_name(dts[di]), ta ? "transposed" : "plain",
                                      mpt_activation_name(d.activation), (long long)i);
                        for (i = 0; i < m; i++)
                            CHECK(memcmp(few + i * ldc + n, (float *)c0 + i * ldc + n,
                                         sizeof(float) * 2) == 0,
                                  "%d rows: C's padding was written", m);
                        CHECK(memcmp(few + m * ldc, (float *)c0 + m * ldc,
                                     sizeof(float) * (size_t)((9 - m) * ldc)) == 0,
                              "%d rows: rows past them were written", m);
                        cases++;
                    }
                    free(full);
                    free(few);
                    free(a);
                    free(b);
                    free(c0);
                    free(bz);
                    free(av);
                    free(bv);
                    free(cv);
                    free(bias);
                }
    test__end("gemm: products of 1-4 rows (B read unpacked) equal the packed kernel's rows "
              "bit for bit (%d cases, %d differ)", cases, bad);
    mpt_context_destroy(ctx);
}

/* One set of products sharing A (widths: up to 3, a 0 ends them early),
   each part checked against its own mpt_gemm: -1 where one differs (or
   its padding was written), else 1 where the set took the shared path
   and 0 where it ran part by part. */
static int shared_a_case(mpt_context *ctx, const int64_t *widths, int64_t m, int64_t k,
                         mpt_dtype dt, int ta, int tb, int with_beta, mpt_activation act) {
    mpt_gemm_desc d[3];
    void *b[3], *c0[3];
    float *vals, *own[3], *together[3];
    const int64_t lda = (ta ? m : k) + 1;
    void *a = rand_matrix(dt, ta ? k : m, lda, &vals);
    mpt__gemm_job job;
    int count = 0, p, result;
    free(vals);
    for (p = 0; p < 3 && widths[p]; p++, count++) {
        const int64_t n = widths[p], ldb = (tb ? k : n) + 2, ldc = n + 3;
        float *bias;
        b[p] = rand_matrix(dt, tb ? n : k, ldb, &vals);
        free(vals);
        c0[p] = rand_matrix(MPT_FLOAT32, m, ldc, &vals);
        free(vals);
        bias = (float *)rand_matrix(MPT_FLOAT32, 1, n, &vals);
        free(vals);
        if (p == 1) { /* the middle part without one */
            free(bias);
            bias = NULL;
        }
        memset(&d[p], 0, sizeof d[p]);
        d[p].trans_a = ta;
        d[p].trans_b = tb;
        d[p].m = m;
        d[p].n = n;
        d[p].k = k;
        d[p].ab_dtype = dt;
        d[p].a = a;
        d[p].lda = lda;
        d[p].b = b[p];
        d[p].ldb = ldb;
        d[p].ldc = ldc;
        d[p].beta = with_beta ? 0.5f : 0;
        d[p].bias = bias;
        d[p].activation = act;
        own[p] = (float *)malloc(sizeof(float) * (size_t)(m * ldc));
        together[p] = (float *)malloc(sizeof(float) * (size_t)(m * ldc));
        memcpy(own[p], c0[p], sizeof(float) * (size_t)(m * ldc));
        memcpy(together[p], c0[p], sizeof(float) * (size_t)(m * ldc));
        d[p].c = own[p];
        CHECK(mpt_gemm(ctx, &d[p]) == MPT_OK, "own product: %s", mpt_context_error(ctx));
        d[p].c = together[p];
    }
    mpt__gemm_job_init(ctx, &d[0], MPT_DTYPE_DEFAULT, &job);
    result = mpt__gemm_shares_a(&job, d, count);
    mpt__gemm_shared_a(ctx, d, count);
    for (p = 0; p < count; p++) {
        if (memcmp(own[p], together[p], sizeof(float) * (size_t)(m * d[p].ldc))) {
            if (result >= 0)
                CHECK(0, "part %d (%lld columns) of %lldx%lld (%s, %s A, %s B, beta %g, %s) "
                      "differs from its own product", p, (long long)d[p].n, (long long)m,
                      (long long)k, mpt_dtype_name(dt), ta ? "transposed" : "plain",
                      tb ? "transposed" : "plain", (double)d[p].beta,
                      mpt_activation_name(act));
            result = -1;
        }
        free(own[p]);
        free(together[p]);
        free(b[p]);
        free(c0[p]);
        free((void *)d[p].bias);
    }
    free(a);
    return result;
}

/* Products that share A run as one (mpt__gemm_shared_a: self-attention's
   query, key and value projections of one x) and give each part the bits
   of its own mpt_gemm, C's padding untouched: parts whose widths are
   whole panels (and a last that is not), parts that are not (run one by
   one), few rows, depths of one and two blocks, both layouts of A and of
   B, every dtype, beta, bias and activations, 1 and 2 threads, on every
   path. At least some cases must take the shared path. */
static void test_shared_a(void) {
    static const int64_t widths[][3] = {{32, 32, 32}, {64, 16, 40}, {96, 33, 0}, {128, 256, 64}};
    static const int64_t ms[] = {3, 37, 300}, ks[] = {7, 600};
    static const mpt_dtype dts[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU};
    int pi, t, wi, mi, ki, di, ta, tb;
    for (pi = 0; pi < N_PATHS; pi++) {
        if (pi == 3) continue; /* f16c off only changes the float16 packing */
        for (t = 1; t <= 2; t++) {
            mpt_context *ctx = path_ctx(t, paths[pi].disable);
            int bad = 0, cases = 0, shared = 0, have;
            have = ctx && (mpt_context_cpu_features(ctx) & paths[pi].needs) == paths[pi].needs;
            test__begin();
            if (!have) SKIP("this CPU lacks the path");
            test_seed(700 + (unsigned)(pi * 10 + t));
            for (wi = 0; have && wi < 4; wi++)
                for (mi = 0; mi < 3; mi++)
                    for (ki = 0; ki < 2; ki++)
                        for (di = 0; di < 3; di++)
                            for (ta = 0; ta < 2; ta++)
                                for (tb = 0; tb < 2; tb++) {
                                    int r = shared_a_case(ctx, widths[wi], ms[mi], ks[ki],
                                                          dts[di], ta, tb, (wi + mi + di) % 2,
                                                          acts[(wi + ki + ta + tb) % 3]);
                                    bad += r < 0;
                                    shared += r == 1;
                                    cases++;
                                }
            CHECK(bad == 0, "%d of %d sets of products sharing A differ from their own "
                  "products", bad, cases);
            CHECK(!have || shared > 0, "no set of %d took the shared path", cases);
            test__end("gemm: products sharing A bit-identical to each alone, %s, %d thread%s "
                      "(%d sets, %d shared)", paths[pi].name, t, t > 1 ? "s" : "", cases,
                      shared);
            mpt_context_destroy(ctx);
        }
    }
}

/* A float32 A times a float16 B (the float16 models' weights, widened as
   B is packed or read: mpt__gemm_half_b) gives the bits of the product
   with B widened to float32 first, on every path, both B layouts, few
   rows and many. */
static void test_half_b(void) {
    static const struct { int64_t m, n, k; int tb; } shapes[] = {
        {1, 100, 700, 0}, {3, 257, 37, 0}, {1, 128, 800, 1}, {40, 100, 300, 1}, {129, 10, 600, 0},
    };
    int pi, si, bad = 0;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx = path_ctx(2, paths[pi].disable);
        int have = ctx && (mpt_context_cpu_features(ctx) & paths[pi].needs) == paths[pi].needs;
        test__begin();
        if (!have) SKIP("this CPU lacks the path");
        for (si = 0; have && si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
            const int64_t m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
            float *av, *bv, *c16, *c32, *bias;
            void *a = rand_matrix(MPT_FLOAT32, m, k, &av);
            void *b = rand_matrix(MPT_FLOAT16, shapes[si].tb ? n : k, shapes[si].tb ? k : n, &bv);
            void *bz = rand_matrix(MPT_FLOAT32, 1, n, &bias);
            mpt_gemm_desc d;
            memset(&d, 0, sizeof d);
            d.trans_b = shapes[si].tb;
            d.m = m, d.n = n, d.k = k;
            d.ab_dtype = MPT_FLOAT32;
            d.a = a, d.lda = k;
            d.ldb = shapes[si].tb ? k : n;
            d.ldc = n;
            d.bias = bias;
            d.activation = si % 2 ? MPT_ACT_RELU : MPT_ACT_GELU;
            c16 = (float *)malloc(sizeof(float) * (size_t)(m * n));
            c32 = (float *)malloc(sizeof(float) * (size_t)(m * n));
            d.b = b, d.c = c16;
            mpt__gemm_half_b(ctx, &d);
            d.b = bv, d.c = c32; /* bv: the half values widened */
            CHECK(mpt_gemm(ctx, &d) == MPT_OK, "gemm: %s", mpt_context_error(ctx));
            if (memcmp(c16, c32, sizeof(float) * (size_t)(m * n)) && bad++ == 0)
                CHECK(0, "%lldx%lldx%lld%s: float16 B differs from B widened first", (long long)m,
                      (long long)n, (long long)k, shapes[si].tb ? " (B transposed)" : "");
            free(a), free(b), free(bz), free(av), free(bv), free(bias), free(c16), free(c32);
        }
        test__end("gemm: a float16 B under a float32 A equals B widened first, bit for bit, %s",
                  paths[pi].name);
        mpt_context_destroy(ctx);
    }
}

/* A float32 product's operands, m × k by k × n, drawn in [-1, 1] (a, b
   and n biases), and two outputs (m × n) to compare. */
typedef struct f32_operands {
    int64_t m, n, k;
    float *a, *b, *bias, *c0, *c1;
} f32_operands;

static f32_operands f32_operands_new(int64_t m, int64_t n, int64_t k, unsigned seed) {
    f32_operands x;
    int64_t i;
    x.m = m, x.n = n, x.k = k;
    x.a = (float *)malloc(sizeof(float) * (size_t)(m * k));
    x.b = (float *)malloc(sizeof(float) * (size_t)(k * n));
    x.bias = (float *)malloc(sizeof(float) * (size_t)n);
    x.c0 = (float *)malloc(sizeof(float) * (size_t)(m * n));
    x.c1 = (float *)malloc(sizeof(float) * (size_t)(m * n));
    test_seed(seed);
    for (i = 0; i < m * k; i++) x.a[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < k * n; i++) x.b[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < n; i++) x.bias[i] = (float)test_uniform(-1, 1);
    return x;
}

static void f32_operands_free(f32_operands *x) {
    free(x->a), free(x->b), free(x->bias), free(x->c0), free(x->c1);
}

/* x's product with B as is, into c0: what B is packed from. */
static mpt_gemm_desc f32_desc(const f32_operands *x) {
    mpt_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.m = x->m, d.n = x->n, d.k = x->k, d.b = x->b, d.ldb = x->n, d.c = x->c0, d.ldc = x->n;
    return d;
}

/* x's product (d, from f32_desc) on B packed ahead in p against packing
   it each call, in four epilogues (v: A as is, bias + relu; A transposed,
   alpha and beta; sigmoid) on ctx[0..2]: how many of the products differ
   in a bit; *cases counts them. misfit is the failure where the packing
   does not fit d. */
/* Strips packed by the context that runs them (as predict keeps them:
   as wide as one row's task on that many threads) give the bits of d's
   product in x->c0. */
static int own_strips_differ(mpt_context *ctx, mpt_gemm_desc *d, const f32_operands *x,
                             int *cases) {
    const int64_t mn = x->m * x->n;
    int64_t i;
    int bad;
    mpt__gemm_packed *own = mpt__gemm_pack_b_strips(ctx, d);
    for (i = 0; i < mn; i++) x->c1[i] = (float)(i % 13) * 0.25f;
    d->c = x->c1;
    CHECK(own && mpt__gemm_packed_fits(ctx, d, own), "own strips %s", own ? "do not fit" : "not made");
    if (own) mpt__gemm_on_packed(ctx, d, own);
    bad = memcmp(x->c0, x->c1, sizeof(float) * (size_t)mn) != 0;
    mpt__gemm_packed_free(ctx, own);
    (*cases)++;
    return bad;
}

static int packed_products_differ(mpt_context *const ctx[3], mpt_gemm_desc *d,
                                  const mpt__gemm_packed *p, const f32_operands *x,
                                  const char *misfit, int own_strips, int *cases) {
    const int64_t m = x->m, n = x->n, k = x->k;
    int64_t i;
    int v, t, bad = 0;
    for (v = 0; v < 4; v++)
        for (t = 0; t < 3; t++) {
            d->trans_a = v == 1, d->a = x->a, d->lda = v == 1 ? m : k;
            d->bias = v == 0 || v == 3 ? x->bias : NULL;
            d->activation = v == 0 ? MPT_ACT_RELU : v == 3 ? MPT_ACT_SIGMOID : MPT_ACT_NONE;
            d->alpha = v == 1 ? 0.75f : 0.0f, d->beta = v == 2 ? -0.5f : 0.0f;
            for (i = 0; i < m * n; i++) x->c0[i] = x->c1[i] = (float)(i % 13) * 0.25f;
            d->c = x->c0;
            mpt__gemm(ctx[t], d);
            d->c = x->c1;
            CHECK(mpt__gemm_packed_fits(ctx[t], d, p), "%s", misfit);
            mpt__gemm_on_packed(ctx[t], d, p);
            bad += memcmp(x->c0, x->c1, sizeof(float) * (size_t)(m * n)) != 0;
            (*cases)++;
            if (own_strips) bad += own_strips_differ(ctx[t], d, x, cases);
        }
    return bad;
}

/* A float32 B packed once (mpt__gemm_pack_b_whole, as predict keeps a
   Dense's kernel) gives the bits of the product that packs it each call:
   depths of one and several blocks, column tails of a full and a half
   panel, rows below and above the few-rows path, both A layouts, every
   epilogue, 1 to 3 threads, on every path. */
static void test_packed_b(void) {
    static const struct { int64_t m, n, k; } shapes[] = {
        {5, 10, 7}, {12, 32, 1}, {13, 16, 8}, {40, 33, 513}, {128, 1024, 784},
        {100, 100, 1100}, {29, 47, 1025}, {3, 40, 50}, {64, 600, 96},
    };
    int pi, si, t, bad, cases;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx[3];
        int have;
        if (pi == 3) continue; /* f16c: no float16 here */
        for (t = 0; t < 3; t++) ctx[t] = path_ctx(t + 1, paths[pi].disable);
        have = ctx[0] && (mpt_context_cpu_features(ctx[0]) & paths[pi].needs) == paths[pi].needs;
        test__begin();
        if (!have) SKIP("this CPU lacks the path");
        bad = cases = 0;
        for (si = 0; have && si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
            const int64_t m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
            f32_operands x = f32_operands_new(m, n, k, 300 + (unsigned)si);
            mpt_gemm_desc d = f32_desc(&x);
            mpt__gemm_packed *p = mpt__gemm_pack_b_whole(ctx[0], &d);
            CHECK(p != NULL, "%lldx%lldx%lld: packing failed", (long long)m, (long long)n,
                  (long long)k);
            if (p)
                bad += packed_products_differ(ctx, &d, p, &x, "the packing does not fit", 0, &cases);
            /* only the AVX-512 path reads B in place, for at most 4 rows */
            CHECK(!p || mpt__gemm_packs_b(ctx[0], &d) ==
                            (m > 4 || !(mpt_context_cpu_features(ctx[0]) & MPT_CPU_AVX512)),
                  "%lld rows: whether B is packed", (long long)m);
            mpt__gemm_packed_free(ctx[0], p);
            f32_operands_free(&x);
        }
        CHECK(bad == 0, "%d of %d products on B packed ahead differ", bad, cases);
        test__end("gemm on B packed ahead bit-identical to packing it each call, %s",
                  paths[pi].name);
        for (t = 0; t < 3; t++) mpt_context_destroy(ctx[t]);
    }
}

/* A float32 B kept in strips (mpt__gemm_pack_b_strips, as predict keeps a
   Dense's kernel for a batch of 1 to 4) gives the bits of the few-rows
   product that reads B in place: 1 to 4 rows, column counts that end a
   strip of 128 short, in a 64-column strip or on a 16-lane tail, depths
   of one and several blocks, both A layouts, every epilogue, 1 to 3
   threads (on the pool from 256 KiB of B), strips packed on one thread
   (128 columns wide) and on the context that runs them (64 wide where
   128 would leave a thread without one: a one-row task's own). Only the
   AVX-512 path reads B so; elsewhere nothing is kept. */
static void test_strips_b(void) {
    static const struct { int64_t m, n, k; } shapes[] = {
        {1, 1024, 784}, {1, 128, 5408}, {1, 10, 128}, {2, 200, 33}, {3, 520, 700},
        {4, 47, 1025}, {1, 300, 513}, {2, 1024, 96}, {1, 64, 7}, {1, 200, 700},
    };
    mpt_context *ctx[3];
    int si, t, bad = 0, cases = 0;
    for (t = 0; t < 3; t++) ctx[t] = path_ctx(t + 1, 0);
    test__begin();
    for (si = 0; ctx[0] && si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
        const int64_t m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
        const int avx512 = (mpt_context_cpu_features(ctx[0]) & MPT_CPU_AVX512) != 0;
        f32_operands x = f32_operands_new(m, n, k, 400 + (unsigned)si);
        mpt_gemm_desc d = f32_desc(&x);
        mpt__gemm_packed *p;
        CHECK(mpt__gemm_strips_b(ctx[0], &d) == avx512, "%lld rows: whether B is read in strips",
              (long long)m);
        p = mpt__gemm_pack_b_strips(ctx[0], &d);
        CHECK(!p == !avx512, "%lldx%lldx%lld: strips %s", (long long)m, (long long)n,
              (long long)k, p ? "made off the few-rows path" : "not made");
        if (p) bad += packed_products_differ(ctx, &d, p, &x, "the strips do not fit", 1, &cases);
        if (p) { /* five rows are no longer a few: the panels' product, which strips do not fit */
            d.m = 5;
            CHECK(!mpt__gemm_packed_fits(ctx[0], &d, p), "strips fit a product of 5 rows");
        }
        mpt__gemm_packed_free(ctx[0], p);
        f32_operands_free(&x);
    }
    CHECK(bad == 0, "%d of %d products on B in strips differ", bad, cases);
    test__end("gemm on B kept in strips bit-identical to reading it in place (%d products)", cases);
    for (t = 0; t < 3; t++) mpt_context_destroy(ctx[t]);
}

/* A float16 B kept ahead (mpt__gemm_keep_half_b, as a float16 model
   keeps a Dense's kernel: half strips for 1 to 4 rows, float32 panels
   for more) gives the bits of mpt__gemm_half_b, which widens B as it
   reads or packs it each call, with B's memory gone (the product must not
   read it): 1 to 4, 5 and many rows, column counts that fill strips of
   128 and of 64 or end on a tail, depths of one and several blocks,
   every epilogue, 1 to 3 threads, on every path. Strips are kept only
   where the few-rows path exists (AVX-512). */
static void test_half_kept(void) {
    static const struct { int64_t m, n, k; } shapes[] = {
        {1, 1024, 784}, {1, 128, 1100}, {1, 200, 37}, {2, 10, 600}, {3, 257, 513}, {4, 64, 7},
        {5, 128, 600}, {40, 100, 300}, {129, 10, 784},
    };
    int pi, si, t, bad, cases;
    for (pi = 0; pi < N_PATHS; pi++) {
        mpt_context *ctx[3];
        int have;
        for (t = 0; t < 3; t++) ctx[t] = path_ctx(t + 1, paths[pi].disable);
        have = ctx[0] && (mpt_context_cpu_features(ctx[0]) & paths[pi].needs) == paths[pi].needs;
        bad = cases = 0;
        test__begin();
        if (!have) SKIP("this CPU lacks the path");
        for (si = 0; have && si < (int)(sizeof shapes / sizeof shapes[0]); si++)
            for (t = 0; t < 3; t++) {
                const int64_t m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
                const int avx512 = (mpt_context_cpu_features(ctx[t]) & MPT_CPU_AVX512) != 0;
                float *av, *bv, *c0, *c1, *bias;
                void *a = rand_matrix(MPT_FLOAT32, m, k, &av);
                void *b = rand_matrix(MPT_FLOAT16, k, n, &bv);
                void *bz = rand_matrix(MPT_FLOAT32, 1, n, &bias);
                mpt__gemm_half_kept *h;
                mpt_gemm_desc d;
                int64_t i;
                memset(&d, 0, sizeof d);
                d.m = m, d.n = n, d.k = k;
                d.ab_dtype = MPT_FLOAT32;
                d.a = a, d.lda = k;
                d.b = b, d.ldb = n;
                d.ldc = n;
                d.bias = si % 3 ? bias : NULL;
                d.activation = si % 3 == 1 ? MPT_ACT_RELU : si % 3 == 2 ? MPT_ACT_GELU
                                                                        : MPT_ACT_NONE;
                c0 = (float *)malloc(sizeof(float) * (size_t)(m * n));
                c1 = (float *)malloc(sizeof(float) * (size_t)(m * n));
                for (i = 0; i < m * n; i++) c0[i] = c1[i] = (float)(i % 7) * 0.5f;
                d.c = c0;
                mpt__gemm_half_b(ctx[t], &d);
                h = mpt__gemm_keep_half_b(ctx[t], &d);
                CHECK(h && h->panels && !h->strips == !avx512,
                      "%lldx%lldx%lld, %d threads: %s", (long long)m, (long long)n,
                      (long long)k, t + 1, !h ? "nothing kept" : !h->panels ? "no panels"
                                           : h->strips ? "strips off the few-rows path"
                                                       : "no strips");
                memset(b, 0xFF, sizeof(uint16_t) * (size_t)(k * n)); /* NaNs: must not be read */
                d.b = NULL, d.c = c1;
                if (h) mpt__gemm_half_on_kept(ctx[t], &d, h);
                if (!h || memcmp(c0, c1, sizeof(float) * (size_t)(m * n))) bad++;
                cases++;
                mpt__gemm_half_kept_free(ctx[t], h);
                free(a), free(b), free(bz), free(av), free(bv), free(bias), free(c0), free(c1);
            }
        CHECK(bad == 0, "%d of %d products on a kept float16 B differ", bad, cases);
        test__end("gemm on a float16 B kept ahead bit-identical to widening it each call, %s "
                  "(%d products)", paths[pi].name, cases);
        for (t = 0; t < 3; t++) mpt_context_destroy(ctx[t]);
    }
}

/* Predict keeps a float32 Dense's kernel packed (mpt__predict_gemm) only
   while the weights stay as they were: after each way they can change
   (a fit, sgd_step, a value set by hand then refresh_weights, a weights
   file, a checkpoint) the model predicts what a fresh model given the
   same weights predicts, bit for bit. */
enum { PLAN_FEATURES = 40, PLAN_SAMPLES = 64, PLAN_BATCH = 32 };

static mpt_model *plan_model(mpt_context *c, uint64_t seed) {
    classifier_desc cd;
    mpt_model *m;
    memset(&cd, 0, sizeof cd);
    cd.features = PLAN_FEATURES, cd.hidden = 72, cd.classes = 10, cd.seed = seed;
    m = small_classifier(c, &cd);
    if (m) CHECK(mpt_model_build(m, PLAN_BATCH) == MPT_OK, "build: %s", mpt_context_error(c));
    return m;
}

/* m predicts on d what a fresh model with m's weights (through a file,
   which reads them without touching m's version) predicts; a second
   predict keeps the same packed weights. */
static void plan_expect_fresh(mpt_context *c, mpt_model *m, mpt_dataset *d, const char *after) {
    char path[600];
    mpt_model *fresh = plan_model(c, 99);
    mpt_tensor pa, pb;
    uint64_t version;
    int64_t i = 0;
    snprintf(path, sizeof path, "%s/plan_fresh.safetensors", tmpdir);
    memset(&pa, 0, sizeof pa), memset(&pb, 0, sizeof pb);
    CHECK(mpt_model_predict(m, d, PLAN_BATCH, &pa) == MPT_OK, "predict: %s", mpt_context_error(c));
    CHECK(m->predict_plan != NULL, "after %s: predict kept no packed weights", after);
    version = m->predict_plan ? m->predict_plan->version : 0;
    CHECK(mpt_model_save_weights(m, path) == MPT_OK, "save: %s", mpt_context_error(c));
    CHECK(fresh && mpt_model_load_weights(fresh, path) == MPT_OK, "load: %s",
          mpt_context_error(c));
    CHECK(fresh && mpt_model_predict(fresh, d, PLAN_BATCH, &pb) == MPT_OK, "predict: %s",
          mpt_context_error(c));
    for (; pa.data && pb.data && i < mpt_tensor_count(&pa); i++)
        if (((const float *)pa.data)[i] != ((const float *)pb.data)[i]) break;
    CHECK(pa.data && pb.data && i == mpt_tensor_count(&pa),
          "after %s: prediction %lld differs from a fresh model's", after, (long long)i);
    mpt_tensor_free(c, &pa), mpt_tensor_free(c, &pb);
    CHECK(mpt_model_predict(m, d, PLAN_BATCH, &pa) == MPT_OK, "predict: %s", mpt_context_error(c));
    CHECK(m->predict_plan && m->predict_plan->version == version && version == m->weights_version,
          "after %s: a predict on unchanged weights packed them again", after);
    mpt_tensor_free(c, &pa);
    mpt_model_destroy(fresh);
    remove(path);
}

static void test_predict_plan(void) {
    mpt_context *c = path_ctx(2, 0);
    static float x[PLAN_SAMPLES * PLAN_FEATURES];
    static int32_t y[PLAN_SAMPLES];
    char wpath[600], cpath[600];
    mpt_model *m, *other;
    mpt_dataset *d;
    mpt_fit_desc f = fit_for(1, PLAN_BATCH);
    mpt_param_info info;
    int64_t i;
    snprintf(wpath, sizeof wpath, "%s/plan.safetensors", tmpdir);
    snprintf(cpath, sizeof cpath, "%s/plan.ckpt", tmpdir);
    test__begin();
    if (!c) {
        CHECK(0, "context creation failed");
        test__end("predict's packed weights follow every change of the weights");
        return;
    }
    test_seed(4242);
    for (i = 0; i < PLAN_SAMPLES * PLAN_FEATURES; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < PLAN_SAMPLES; i++) y[i] = (int32_t)(i % 10);
    d = test_dataset_xy(c, x, y, PLAN_SAMPLES, PLAN_FEATURES);
    m = plan_model(c, 1);
    other = plan_model(c, 2);
    if (d && m && other) {
        plan_expect_fresh(c, m, d, "build");
        CHECK(mpt_model_save_checkpoint(m, cpath) == MPT_OK, "checkpoint: %s", mpt_context_error(c));
        CHECK(mpt_model_fit(m, d, &f) == MPT_OK, "fit: %s", mpt_context_error(c));
        plan_expect_fresh(c, m, d, "fit");
        CHECK(mpt_model_sgd_step(m, 0.5f) == MPT_OK, "sgd_step: %s", mpt_context_error(c));
        plan_expect_fresh(c, m, d, "sgd_step");
        mpt_model_param(m, 0, &info); /* taken before a predict, written after it */
        plan_expect_fresh(c, m, d, "taking a parameter");
        for (i = 0; i < mpt_tensor_count(&info.value); i++) ((float *)info.value.data)[i] *= -1;
        mpt_model_refresh_weights(m);
        plan_expect_fresh(c, m, d, "refresh_weights");
        CHECK(mpt_model_fit(other, d, &f) == MPT_OK, "fit: %s", mpt_context_error(c));
        CHECK(mpt_model_save_weights(other, wpath) == MPT_OK, "save: %s", mpt_context_error(c));
        CHECK(mpt_model_load_weights(m, wpath) == MPT_OK, "load: %s", mpt_context_error(c));
        plan_expect_fresh(c, m, d, "load_weights");
        CHECK(mpt_model_load_checkpoint(m, cpath) == MPT_OK, "load: %s", mpt_context_error(c));
        plan_expect_fresh(c, m, d, "load_checkpoint");
    }
    remove(wpath), remove(cpath);
    mpt_model_destroy(m), mpt_model_destroy(other);
    mpt_dataset_destroy(d);
    mpt_context_destroy(c);
    test__end("predict's packed weights follow every change of the weights");
}

/* Bad arguments: a status and a message that names the value. */
static void expect_error(mpt_context *ctx, const mpt_gemm_desc *d, mpt_status want,
                         const char *needle, const char *what) {
    mpt_status s = mpt_gemm(ctx, d);
    CHECK(s == want, "%s: status %d, want %d", what, (int)s, (int)want);
    CHECK(strstr(mpt_context_error(ctx), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what,
          mpt_context_error(ctx), needle);
}

static void test_bad_arguments(void) {
    mpt_context *ctx = path_ctx(1, 0);
    float a[64], b[64], c[64];
    mpt_gemm_desc d, good;
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    good = (mpt_gemm_desc){.m = 4, .n = 5, .k = 6, .a = a, .lda = 6, .b = b, .ldb = 5,
                           .c = c, .ldc = 5};
    CHECK(mpt_gemm(ctx, &good) == MPT_OK, "good call failed: %s", mpt_context_error(ctx));
    CHECK(mpt_gemm(NULL, &good) == MPT_ERR_INVALID_ARGUMENT, "NULL context accepted");
    CHECK(mpt_gemm(ctx, NULL) == MPT_OK, "NULL desc (the empty product) refused");
    d = good; d.a = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "a is NULL", "NULL a");
    d = good; d.b = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "b is NULL", "NULL b");
    d = good; d.c = NULL;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "c is NULL", "NULL c");
    d = good; d.m = -3;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "m = -3", "negative m");
    d = good; d.k = -7;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "k = -7", "negative k");
    d = good; d.lda = 5;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "lda = 5", "lda < k");
    d = good; d.trans_a = 1; d.lda = 3; /* A stored 6×4 */
    expect_error(ctx, &d, MPT_ERR_SHAPE, "lda = 3", "lda < m with trans_a");
    d = good; d.ldb = 4;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldb = 4", "ldb < n");
    d = good; d.trans_b = 1; d.ldb = 5; /* B stored 5×6 */
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldb = 5", "ldb < k with trans_b");
    d = good; d.ldc = 2;
    expect_error(ctx, &d, MPT_ERR_SHAPE, "ldc = 2", "ldc < n");
    d = good; d.ab_dtype = (mpt_dtype)42;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "42", "unknown dtype");
    d = good; d.ab_dtype = MPT_INT32;
    expect_error(ctx, &d, MPT_ERR_DTYPE, "int32", "int32 dtype");
    d = good; d.activation = (mpt_activation)17;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "17", "unknown activation");
    d = good; d.activation = MPT_ACT_SOFTMAX;
    expect_error(ctx, &d, MPT_ERR_INVALID_ARGUMENT, "softmax", "softmax activation");
    d = good; d.m = (int64_t)1 << 40; d.n = (int64_t)1 << 40; d.ldc = d.n;
    expect_error(ctx, &d, MPT_ERR_OVERFLOW, "overflow", "m·n overflow");
    mpt_context_destroy(ctx);
}

static void cases(void) {
    TEST_RUN(test_bad_arguments);
    TEST_RUN(test_empty);
    test_random_shapes();
    test_rows_of_8();
    test_large_shapes();
    test_epilogue();
    test_determinism();
    test_few_rows();
    test_shared_a();
    test_half_b();
    test_packed_b();
    test_strips_b();
    test_half_kept();
    test_predict_plan();
}

int main(void) {
    return test_main(&(test_program){.name = "test_gemm", .tmpdir = tmpdir,
                                      .tmpdir_size = sizeof tmpdir,
                                      .keep_env = "MPT_KEEP_TEST_FILES", .cases = cases});
}

/* The CUDA backend (mpt_cuda.cu) against the CPU backend: every function of
   the mpt_backend table run on both with the same fresh random inputs, and
   whole models trained on the GPU (CUDA graphs on and off, Fashion-MNIST
   accuracy, running out of device memory, run-to-run determinism).

   Two builds:
       gcc  -std=c99 -I. tests/test_cuda.c -o test_cuda -lpthread -lm -lz
           no MPT_CUDA: every context trains on the CPU; one SKIP.
       nvcc -x cu -DMPT_CUDA -I. tests/test_cuda.c mpt_cuda.cu -o test_cuda \
            -lcublasLt -lcublas -lz
           with a device: the comparisons below. Without one, the context
           falls back to the CPU: that fallback (a warning, and a model that
           still trains) is checked, and the comparisons are one SKIP.
   With MPT_REQUIRE_GPU=1 in the environment (./build.sh gpu sets it), no
   device is one FAIL instead, saying why. `test_cuda wgmma` runs the
   Hopper GEMM's tests alone, `test_cuda qgemm` the int8 GEMM's,
   `test_cuda attention` MultiHeadAttention's (the backend functions and
   the model), `test_cuda conv` Conv2D's implicit GEMMs (conv_direct).
   `test_cuda quick` leaves out the
   whole-model trainings (for compute-sanitizer); `test_cuda layers` and
   `test_cuda gemm` are its two halves (racecheck needs more than ten
   minutes for the whole of it). Fashion-MNIST is read
   from $MPT_DATA_DIR, else /usr/share/datasets/fashion-mnist.
   So this file is C99 and C++17 at once (nvcc compiles it as C++).

   METHOD. Each output buffer is poisoned (every byte 0xFF: a NaN in each
   float dtype) before the function runs on each backend, so an element a
   backend forgets to write compares as NaN and fails. Inputs go in with
   table->upload and results come out with table->download.

   TOLERANCES (relative norm error ‖gpu − cpu‖ / ‖cpu‖, or exact):
   - float32 results: ≤ 1e-5. Both backends compute the same formulas in
     float32 (sums in a different but fixed order on the GPU, and CUDA's
     expf/erff/tanhf within 2 ulps of glibc's), an error of a few 1e-7.
   - GEMM with float16/bfloat16 operands or C: ≤ 1e-2 (tensor-core
     accumulation order and, for a half C, one rounding of a float32 that
     may differ in its last bits).
   - other functions with a float16 result: ≤ 2^-10; bfloat16: ≤ 2^-7.
     Both backends compute in float32 and round once to nearest even; when
     the float32 values differ in their last bits, a rounding can go the
     other way, by one ulp of the half dtype: at most 2^-10 (float16) or
     2^-7 (bfloat16) of the value, so of the norm too.
   - exact: convert (both round to nearest even, keep NaN payloads as the
     header says), im2col (a copy), max pooling forward (values and
     argmax), dropout (the same Philox mask), the loss's sample, correct
     and top-k counts, loss_scale_update (a few float multiplications
     by powers of two and integer counters), and qgemm (integer sums and
     @backend-shared's requantization).
   - the optimizer's Σ g² in double: ≤ 1e-12 (each g² is exact in double;
     only the order of the additions differs). */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

#include <unistd.h>
#ifdef MPT_CUDA
#include <cuda_runtime_api.h> /* cudaSetDevice, cudaGetDevice: the two-GPU test */
#endif

/* $MPT_REQUIRE_GPU=1 (./build.sh gpu sets it): a run that cannot reach a
   GPU is a failure, not a skip, so a broken driver or a missing library
   never looks like a pass; nor may the Fashion-MNIST run skip. */
static int gpu_required(void) {
    const char *env = getenv("MPT_REQUIRE_GPU");
    return env && !strcmp(env, "1");
}

/* ---- the backends under test --------------------------------------------------- */

#define MAX_BUFS 64

/* One context and its table, with the buffers a case allocated there. */
typedef struct backend {
    const char *label;
    mpt_context *ctx;
    const mpt_backend *t;
    void *impl;
    void *bufs[MAX_BUFS];
    int n_bufs;
} backend;

enum { GPU_AUTO = 0, GPU_MPT = 1, GPU_CUBLASLT = 2, GPU_WGMMA = 3, N_GPU = 4 };

static backend cpu_be;        /* the reference: a context with use_cpu        */
static backend gpu_be[N_GPU]; /* CUDA contexts, one per GEMM engine           */

static const mpt_dtype float_dtypes[3] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};

/* The harness has no way to stop a test half-way; a backend that cannot
   even allocate a test buffer ends the program, counted as a failure. */
static void fatal(const char *what, const backend *b) {
    printf("FAIL %s on %s: %s\n", what, b->label, b->t->error(b->impl));
    printf("# test_cuda: stopped\n");
    fflush(stdout);
    exit(1);
}

static void *be_alloc(backend *b, size_t bytes) {
    void *p = NULL;
    if (b->n_bufs == MAX_BUFS) fatal("too many test buffers", b);
    if (b->t->alloc(b->impl, MPT_MEMORY_WORKSPACE, bytes < 64 ? 64 : bytes, &p) != MPT_OK || !p)
        fatal("allocating a test buffer", b);
    b->bufs[b->n_bufs++] = p;
    return p;
}

/* Frees every buffer of the case. */
static void be_release(backend *b) {
    while (b->n_bufs > 0) {
        b->n_bufs--;
        b->t->free(b->impl, MPT_MEMORY_WORKSPACE, b->bufs[b->n_bufs]);
    }
}

static void be_put(backend *b, void *dst, const void *host, size_t bytes) {
    mpt_status s;
    if (bytes == 0) return;
    s = b->t->upload(b->impl, dst, host, bytes);
    CHECK(s == MPT_OK, "upload of %zu bytes to %s: %s", bytes, b->label, b->t->error(b->impl));
}

static void *be_upload(backend *b, const void *host, size_t bytes) {
    void *p = be_alloc(b, bytes);
    be_put(b, p, host, bytes);
    return p;
}

/* Fills a buffer with 0xFF bytes: NaN in float32, float16 and bfloat16. */
static void be_poison(backend *b, void *dst, size_t bytes) {
    unsigned char *host;
    if (bytes == 0) return;
    host = (unsigned char *)malloc(bytes);
    memset(host, 0xFF, bytes);
    be_put(b, dst, host, bytes);
    free(host);
}

static void *be_poisoned(backend *b, size_t bytes) {
    void *p = be_alloc(b, bytes);
    be_poison(b, p, bytes);
    return p;
}

/* Waits for the queued work; a failed kernel shows here. */
static int be_sync(backend *b, const char *what) {
    mpt_status s = b->t->sync(b->impl);
    CHECK(s == MPT_OK, "%s on %s: %s: %s", what, b->label, mpt_status_string(s),
          b->t->error(b->impl));
    return s == MPT_OK;
}

/* A malloc'ed host copy of `bytes` of backend memory (after a sync). */
static void *be_fetch(backend *b, const void *src, size_t bytes, const char *what) {
    void *host = malloc(bytes ? bytes : 1);
    mpt_status s;
    memset(host, 0xFF, bytes);
    be_sync(b, what);
    if (bytes == 0) return host;
    s = b->t->download(b->impl, host, src, bytes);
    CHECK(s == MPT_OK, "%s: download from %s: %s", what, b->label, b->t->error(b->impl));
    return host;
}

static int open_backend(backend *b, const char *label, int use_cpu, mpt_gemm_engine gemm) {
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    memset(b, 0, sizeof *b);
    d.use_cpu = use_cpu;
    d.gemm = gemm;
    d.logger.fn = quiet_logger; /* failures are read from the table's error() */
    b->label = label;
    if (mpt_context_create(&d, &b->ctx) != MPT_OK) return 0;
    b->t = mpt_context_backend(b->ctx, &b->impl);
    return b->t != NULL;
}

static void close_backend(backend *b) {
    if (b->t) be_release(b);
    mpt_context_destroy(b->ctx);
    memset(b, 0, sizeof *b);
}

/* ---- host values in any dtype ------------------------------------------------------ */

static double load_value(mpt_dtype dt, const void *p, int64_t i) {
    switch (dt) {
    case MPT_FLOAT16: return mpt_half_to_float(((const mpt_half *)p)[i]);
    case MPT_BFLOAT16: return mpt_bf16_to_float(((const mpt_bf16 *)p)[i]);
    case MPT_INT32: return ((const int32_t *)p)[i];
    default: return ((const float *)p)[i];
    }
}

static void store_value(mpt_dtype dt, void *p, int64_t i, double v) {
    switch (dt) {
    case MPT_FLOAT16: ((mpt_half *)p)[i] = mpt_float_to_half((float)v); break;
    case MPT_BFLOAT16: ((mpt_bf16 *)p)[i] = mpt_float_to_bf16((float)v); break;
    case MPT_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((float *)p)[i] = (float)v; break;
    }
}

static size_t nbytes(mpt_dtype dt, int64_t n) { return (size_t)n * mpt_dtype_size(dt); }

/* n values uniform in [lo, hi), rounded to dtype (malloc'ed). */
static void *random_values(mpt_dtype dt, int64_t n, double lo, double hi) {
    void *p = malloc(nbytes(dt, n > 0 ? n : 1));
    int64_t i;
    for (i = 0; i < n; i++) store_value(dt, p, i, test_uniform(lo, hi));
    return p;
}

/* ‖a − b‖ / ‖b‖ over n elements of two buffers. Equal values (the same
   infinity, or NaN in both: an overflow both backends saw) count as no
   error; a NaN or infinity in one only gives NaN, a failure. */
static double rel_error(mpt_dtype dta, const void *a, mpt_dtype dtb, const void *b, int64_t n) {
    double num = 0, den = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double x = load_value(dta, a, i), y = load_value(dtb, b, i);
        if (x == y || (x != x && y != y)) {
            if (isfinite(y)) den += y * y;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    if (num != num) return NAN;
    return sqrt(num) / (sqrt(den) > 1e-30 ? sqrt(den) : 1e-30);
}

/* The tolerance of a non-GEMM result in dtype (see the top of the file). */
static double tolerance(mpt_dtype dt) {
    if (dt == MPT_FLOAT16) return 1.0 / 1024;  /* 2^-10 */
    if (dt == MPT_BFLOAT16) return 1.0 / 128;  /* 2^-7  */
    return 1e-5;
}

/* The first index where two buffers differ in their bytes, or -1. */
static int64_t first_difference(const void *a, const void *b, int64_t n, size_t elem) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (memcmp((const char *)a + (size_t)i * elem, (const char *)b + (size_t)i * elem, elem))
            return i;
    return -1;
}

/* Elements of float32 arrays whose bits differ, and the largest distance in ulps. */
static int64_t bit_differences(const float *a, const float *b, int64_t n, int64_t *max_ulps) {
    int64_t i, count = 0;
    *max_ulps = 0;
    for (i = 0; i < n; i++) {
        int32_t x, y;
        int64_t d;
        memcpy(&x, a + i, 4);
        memcpy(&y, b + i, 4);
        if (x == y) continue;
        count++;
        if (x < 0) x = (int32_t)(0x80000000u - (uint32_t)x); /* sign-magnitude -> ordered */
        if (y < 0) y = (int32_t)(0x80000000u - (uint32_t)y);
        d = (int64_t)x - (int64_t)y;
        if (d < 0) d = -d;
        if (d > *max_ulps) *max_ulps = d;
    }
    return count;
}

/* ---- the GEMM, with each engine --------------------------------------------------- */

typedef struct gemm_case {
    int64_t m, n, k;
    int ta, tb;
    mpt_dtype ab, c_dtype;
    int64_t pad;             /* extra elements at the end of every row of A, B, C */
    int ld8;                 /* A's and B's rows start 16 bytes apart at least
                                (ld rounded up to 8 elements: TMA's pitch) */
    float alpha, beta;
    int alpha_is_zero, bias;
    mpt_activation act;
} gemm_case;

static void describe_gemm(char *buf, size_t size, const gemm_case *g) {
    snprintf(buf, size, "%lldx%lldx%lld %c%c %s->%s pad %lld alpha %g%s beta %g bias %d %s",
             (long long)g->m, (long long)g->n, (long long)g->k, g->ta ? 't' : 'n',
             g->tb ? 't' : 'n', mpt_dtype_name(g->ab), mpt_dtype_name(g->c_dtype),
             (long long)g->pad, (double)g->alpha, g->alpha_is_zero ? " (is zero)" : "",
             (double)g->beta, g->bias, mpt_activation_name(g->act));
}

/* The host inputs of a case. */
typedef struct gemm_inputs {
    void *a, *b;
    float *c0, *bias;
    int64_t lda, ldb, ldc, a_rows, b_rows;
} gemm_inputs;

static gemm_inputs gemm_make_inputs(const gemm_case *g) {
    gemm_inputs in;
    int64_t ac = g->ta ? g->m : g->k, bc = g->tb ? g->k : g->n;
    in.a_rows = g->ta ? g->k : g->m;
    in.b_rows = g->tb ? g->n : g->k;
    in.lda = (ac > 0 ? ac : 1) + g->pad;
    in.ldb = (bc > 0 ? bc : 1) + g->pad;
    if (g->ld8) {
        in.lda = (in.lda + 7) / 8 * 8;
        in.ldb = (in.ldb + 7) / 8 * 8;
    }
    in.ldc = g->n + g->pad;
    in.a = random_values(g->ab, in.a_rows * in.lda, -1, 1);
    in.b = random_values(g->ab, in.b_rows * in.ldb, -1, 1);
    in.c0 = (float *)random_values(MPT_FLOAT32, g->m * in.ldc, -1, 1);
    in.bias = (float *)random_values(MPT_FLOAT32, g->n, -1, 1);
    return in;
}

static void gemm_free_inputs(gemm_inputs *in) {
    free(in->a);
    free(in->b);
    free(in->c0);
    free(in->bias);
}

/* Runs a case on a backend (gemm_plan first, as a model does); returns C
   (m × ldc in c_dtype, malloc'ed). */
static void *gemm_run(backend *be, const gemm_case *g, mpt_dtype c_dtype, const gemm_inputs *in) {
    size_t c_bytes = nbytes(c_dtype, g->m * in->ldc);
    mpt_gemm_desc d;
    void *c;
    memset(&d, 0, sizeof d);
    d.trans_a = g->ta;
    d.trans_b = g->tb;
    d.m = g->m;
    d.n = g->n;
    d.k = g->k;
    d.ab_dtype = g->ab;
    d.a = be_upload(be, in->a, nbytes(g->ab, in->a_rows * in->lda));
    d.lda = in->lda;
    d.b = be_upload(be, in->b, nbytes(g->ab, in->b_rows * in->ldb));
    d.ldb = in->ldb;
    c = be_alloc(be, c_bytes);
    d.c = (float *)c;
    d.ldc = in->ldc;
    d.alpha = g->alpha;
    d.alpha_is_zero = g->alpha_is_zero;
    d.beta = g->beta;
    d.bias = g->bias ? (const float *)be_upload(be, in->bias, nbytes(MPT_FLOAT32, g->n)) : NULL;
    d.activation = g->act;
    if (be->t->gemm_plan) {
        mpt_status s = be->t->gemm_plan(be->impl, &d, c_dtype);
        CHECK(s == MPT_OK, "gemm_plan on %s: %s", be->label, be->t->error(be->impl));
    }
    /* after the plan, which may have run the product to time it */
    if (g->beta != 0) be_put(be, c, in->c0, c_bytes);
    else be_poison(be, c, c_bytes);
    be->t->gemm(be->impl, &d, c_dtype);
    c = be_fetch(be, c, c_bytes, "gemm");
    be_release(be);
    return c;
}

/* One case: the CPU in float32 against the GPU engine in the case's C dtype. */
static void gemm_compare(backend *gpu, const gemm_case *g) {
    gemm_inputs in = gemm_make_inputs(g);
    void *ref = gemm_run(&cpu_be, g, MPT_FLOAT32, &in);
    void *got = gemm_run(gpu, g, g->c_dtype, &in);
    int64_t i, j, mn = g->m * g->n;
    double *r = (double *)malloc(sizeof(double) * (size_t)(mn > 0 ? mn : 1));
    double *o = (double *)malloc(sizeof(double) * (size_t)(mn > 0 ? mn : 1));
    double err, tol = g->ab == MPT_FLOAT32 && g->c_dtype == MPT_FLOAT32 ? 1e-5 : 1e-2;
    int padding_kept = 1;
    char what[160];
    for (i = 0; i < g->m; i++) {
        for (j = 0; j < g->n; j++) {
            r[i * g->n + j] = round_to(g->c_dtype, load_value(MPT_FLOAT32, ref, i * in.ldc + j));
            o[i * g->n + j] = load_value(g->c_dtype, got, i * in.ldc + j);
        }
        for (j = g->n; j < in.ldc; j++) { /* C's padding is never written */
            unsigned char poison[4] = {0xFF, 0xFF, 0xFF, 0xFF};
            if (g->beta == 0 && memcmp((char *)got + nbytes(g->c_dtype, i * in.ldc + j), poison,
                                       mpt_dtype_size(g->c_dtype)))
                padding_kept = 0;
        }
    }
    err = rel_err(o, r, mn);
    describe_gemm(what, sizeof what, g);
    CHECK(err <= tol, "gemm %s on %s: relative error %.3g > %g (CPU float32%s)", what,
          gpu->label, err, tol, g->c_dtype == MPT_FLOAT32 ? "" : ", rounded");
    CHECK(padding_kept, "gemm %s on %s wrote into C's padding columns", what, gpu->label);
    free(r);
    free(o);
    free(ref);
    free(got);
    gemm_free_inputs(&in);
}

/* Sizes that are odd, aligned, one below and above a tile, and big. */
static const int64_t gemm_sizes[8] = {1, 7, 33, 64, 127, 128, 255, 1000};

/* Every engine: 24 shapes × 4 transposes × 3 operand dtypes, with the
   epilogue, C dtype, alpha, beta and padding varied from case to case,
   plus k = 0 and alpha_is_zero. */
static void test_gemm_engine(backend *gpu) {
    static const mpt_activation acts[7] = {MPT_ACT_NONE, MPT_ACT_NONE,      MPT_ACT_RELU,
                                           MPT_ACT_GELU, MPT_ACT_GELU_TANH, MPT_ACT_SIGMOID,
                                           MPT_ACT_TANH};
    static const int with_bias[7] = {0, 1, 1, 0, 1, 1, 0};
    static const float alphas[3] = {0.0f, 0.5f, -2.0f};
    int si, tr, di, cases = 0;
    unsigned v = 0;
    gemm_case g;
    test__begin();
    for (si = 0; si < 24; si++) {
        int i = si % 8;
        int64_t m = gemm_sizes[i], n = gemm_sizes[i], k = gemm_sizes[i];
        if (si >= 8 && si < 16) {
            n = gemm_sizes[(i + 3) % 8];
            k = gemm_sizes[(i + 5) % 8];
        } else if (si >= 16) {
            m = gemm_sizes[(i + 6) % 8];
            k = gemm_sizes[(i + 1) % 8];
        }
        for (tr = 0; tr < 4; tr++)
            for (di = 0; di < 3; di++, v++) {
                memset(&g, 0, sizeof g);
                g.m = m;
                g.n = n;
                g.k = k;
                g.ta = tr & 1;
                g.tb = tr >> 1;
                g.ab = float_dtypes[di];
                g.act = acts[v % 7];
                g.bias = with_bias[v % 7];
                g.alpha = alphas[v % 3];
                g.c_dtype = gpu->t->gemm_rounds_c ? float_dtypes[(v / 7) % 3] : MPT_FLOAT32;
                g.beta = g.c_dtype == MPT_FLOAT32 && v % 4 == 1 ? 0.75f : 0.0f;
                g.pad = v % 5 == 2 ? 3 : 0;
                gemm_compare(gpu, &g);
                cases++;
            }
    }
    /* k = 0: C = beta·C, then the epilogue; A and B are not read */
    memset(&g, 0, sizeof g);
    g.m = 7;
    g.n = 33;
    g.ab = MPT_FLOAT16;
    g.c_dtype = MPT_FLOAT32;
    g.beta = 0.5f;
    g.bias = 1;
    g.act = MPT_ACT_RELU;
    gemm_compare(gpu, &g);
    /* alpha_is_zero */
    g.m = 33;
    g.n = 7;
    g.k = 64;
    g.ab = MPT_BFLOAT16;
    g.alpha_is_zero = 1;
    g.beta = 0.25f;
    gemm_compare(gpu, &g);
    test__end("gemm on %s against the CPU: %d cases (float32 <= 1e-5, halves <= 1e-2)",
              gpu->label, cases + 2);
}

/* ReLU keeps NaN (x <= 0 ? 0 : x, as the CPU) in every engine's epilogue
   and C dtype: NaN in a bias, in A and in C (beta) reaches the same
   elements as on the CPU, and nothing else is below +0. */
static void test_gemm_relu_keeps_nan(backend *gpu) {
    int di, kept = 1, nans = 0;
    gemm_case g;
    test__begin();
    for (di = 0; di < 3; di++) {
        gemm_inputs in;
        void *ref, *got;
        int64_t i, j;
        memset(&g, 0, sizeof g);
        g.m = 37, g.n = 70, g.k = 24;
        g.ab = MPT_FLOAT16;
        g.c_dtype = gpu->t->gemm_rounds_c ? float_dtypes[di] : MPT_FLOAT32;
        g.alpha = -1.0f;
        g.beta = g.c_dtype == MPT_FLOAT32 ? 1.0f : 0.0f;
        g.bias = 1;
        g.act = MPT_ACT_RELU;
        in = gemm_make_inputs(&g);
        in.bias[3] = NAN;
        in.bias[5] = INFINITY;
        in.bias[6] = -INFINITY;
        store_value(g.ab, in.a, 9 * in.lda + 2, NAN);
        in.c0[20 * in.ldc + 40] = NAN;
        in.c0[21 * in.ldc + 41] = -0.0f;
        ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
        got = gemm_run(gpu, &g, g.c_dtype, &in);
        for (i = 0; i < g.m; i++)
            for (j = 0; j < g.n; j++) {
                double r = load_value(MPT_FLOAT32, ref, i * in.ldc + j);
                double o = load_value(g.c_dtype, got, i * in.ldc + j);
                nans += o != o;
                if ((r != r) != (o != o) || o < 0 || (o == 0 && signbit(o))) kept = 0;
            }
        free(ref);
        free(got);
        gemm_free_inputs(&in);
    }
    CHECK(kept, "relu on %s: NaN lost or added, or a result below +0", gpu->label);
    /* at least row 9 (the NaN in A) and column 3 (the NaN bias), which
       cross once, in each of the three C dtypes */
    CHECK(nans >= 3 * (37 + 70 - 1), "relu on %s: only %d NaNs", gpu->label, nans);
    test__end("gemm on %s: ReLU keeps NaN in every C dtype", gpu->label);
}

#ifdef MPT_CUDA
/* cuBLASLt may refuse a shape (a float32 bias with a 16-bit C, say); the
   hand-written engine then runs it, and the refusal is counted
   (mpt_cuda_lt_refusals) and logged once: a context that asks for cuBLASLt
   gets one warning per refused shape, and the products are right. */
static int lt_refusal_messages;
static void count_lt_refusals(void *user, mpt_log_level level, const char *message) {
    (void)user;
    if (level == MPT_LOG_WARNING && strstr(message, "cuBLASLt refused")) lt_refusal_messages++;
}

static void test_lt_refusals_are_logged(void) {
    static const int64_t sizes[4] = {7, 64, 127, 256};
    backend b;
    mpt_context_desc d;
    int si, ai, ci, act, pass, cases = 0;
    int64_t refused;
    memset(&b, 0, sizeof b);
    memset(&d, 0, sizeof d);
    d.gemm = MPT_GEMM_CUBLASLT;
    d.logger.fn = count_lt_refusals;
    lt_refusal_messages = 0;
    b.label = "cuda (gemm cublaslt, logged)";
    CHECK(mpt_context_create(&d, &b.ctx) == MPT_OK, "context: %s", mpt_context_error(b.ctx));
    if (!b.ctx) return;
    b.t = mpt_context_backend(b.ctx, &b.impl);
    for (pass = 0; pass < 2; pass++) /* the second time: no new refusal, no new message */
        for (si = 0; si < 4; si++)
            for (ai = 0; ai < 2; ai++)
                for (ci = 0; ci < 2; ci++)
                    for (act = 0; act < 2; act++) {
                        gemm_case g;
                        memset(&g, 0, sizeof g);
                        g.m = sizes[si];
                        g.n = sizes[(si + 1) % 4];
                        g.k = sizes[(si + 2) % 4];
                        g.ab = ai ? MPT_BFLOAT16 : MPT_FLOAT16;
                        g.c_dtype = ci ? MPT_BFLOAT16 : MPT_FLOAT16;
                        g.alpha = 1;
                        g.bias = 1;
                        g.act = act ? MPT_ACT_RELU : MPT_ACT_NONE;
                        gemm_compare(&b, &g);
                        cases += pass == 0;
                    }
    refused = mpt_cuda_lt_refusals(b.impl);
    CHECK(refused == lt_refusal_messages && refused <= cases,
          "%lld refusals counted, %d logged, of %d shapes", (long long)refused,
          lt_refusal_messages, cases);
    printf("# cuBLASLt refused %lld of %d shapes with a float32 bias and a 16-bit C\n",
           (long long)refused, cases);
    close_backend(&b);
}
#endif

#ifdef MPT_CUDA
/* MPT_ALLOW_TF32=1 opts cuBLASLt's float32 products in to TF32: a context
   made with it says so (mpt_cuda_allows_tf32), one made without it does
   not, and both are right within their precision against the CPU: true
   float32 to 1e-5, TF32 (operands rounded to 10 mantissa bits) to 2e-3. */
static void tf32_context(backend *b, int allow) {
    mpt_context_desc d;
    memset(b, 0, sizeof *b);
    memset(&d, 0, sizeof d);
    d.gemm = MPT_GEMM_CUBLASLT;
    if (allow) setenv("MPT_ALLOW_TF32", "1", 1);
    else unsetenv("MPT_ALLOW_TF32");
    b->label = allow ? "cuda (cublaslt, MPT_ALLOW_TF32=1)" : "cuda (cublaslt)";
    CHECK(mpt_context_create(&d, &b->ctx) == MPT_OK, "context: %s", mpt_context_error(b->ctx));
    unsetenv("MPT_ALLOW_TF32");
    if (b->ctx) b->t = mpt_context_backend(b->ctx, &b->impl);
}

static void test_tf32_opt_in(void) {
    backend plain, tf32;
    gemm_case g;
    gemm_inputs in;
    void *ref, *got[2];
    double err[2];
    int64_t i, j;
    memset(&g, 0, sizeof g);
    g.m = 192;
    g.n = 160;
    g.k = 1024;
    g.ab = MPT_FLOAT32;
    g.c_dtype = MPT_FLOAT32;
    g.alpha = 1;
    tf32_context(&plain, 0);
    tf32_context(&tf32, 1);
    if (!plain.t || !tf32.t) goto done;
    CHECK(!mpt_cuda_allows_tf32(plain.impl) && mpt_cuda_allows_tf32(tf32.impl),
          "allows_tf32: %d without the variable, %d with it", mpt_cuda_allows_tf32(plain.impl),
          mpt_cuda_allows_tf32(tf32.impl));
    in = gemm_make_inputs(&g);
    ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
    got[0] = gemm_run(&plain, &g, MPT_FLOAT32, &in);
    got[1] = gemm_run(&tf32, &g, MPT_FLOAT32, &in);
    for (i = 0; i < 2; i++) { /* C's rows are ldc apart: compare row by row */
        double num = 0, den = 0;
        for (j = 0; j < g.m * g.n; j++) {
            int64_t at = (j / g.n) * in.ldc + j % g.n;
            double r = load_value(MPT_FLOAT32, ref, at), o = load_value(MPT_FLOAT32, got[i], at);
            num += (o - r) * (o - r);
            den += r * r;
        }
        err[i] = sqrt(num) / sqrt(den > 0 ? den : 1);
    }
    printf("# float32 gemm 192x160x1024 against the CPU: %.3g true float32, %.3g with TF32\n",
           err[0], err[1]);
    CHECK(err[0] <= 1e-5, "true float32: relative error %.3g > 1e-5", err[0]);
    CHECK(err[1] <= 2e-3, "TF32: relative error %.3g > 2e-3", err[1]);
    free(ref);
    free(got[0]);
    free(got[1]);
    gemm_free_inputs(&in);
done:
    close_backend(&plain);
    close_backend(&tf32);
}
#endif

/* The elementwise ReLU and its gradient give the CPU's bits on special
   values: NaN passes, ±0 gives +0, a NaN y or dy passes dy. */
static void test_relu_special_values(void) {
    static const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f,
                                      1e-40f, -1e-40f, 2.5f, -2.5f};
    enum { S = (int)(sizeof specials / sizeof specials[0]), N = S * S };
    backend *gpu = &gpu_be[GPU_AUTO];
    float x[N], dy[N];
    void *res[2][2];
    int i, w;
    for (i = 0; i < N; i++) {
        x[i] = specials[i % S];
        dy[i] = specials[i / S];
    }
    for (w = 0; w < 2; w++) {
        backend *b = w ? gpu : &cpu_be;
        float *d = (float *)be_upload(b, x, sizeof x);
        const void *d_dy = be_upload(b, dy, sizeof dy);
        float *dz = (float *)be_poisoned(b, sizeof x), *tmp = (float *)be_poisoned(b, sizeof x);
        b->t->activation(b->impl, MPT_ACT_RELU, d, 1, N);
        b->t->activation_grad(b->impl, MPT_ACT_RELU, MPT_FLOAT32, NULL, d, d_dy, dz, tmp, 1, N);
        res[w][0] = be_fetch(b, d, sizeof x, "relu");
        res[w][1] = be_fetch(b, dz, sizeof x, "relu backward");
        be_release(b);
    }
    for (w = 0; w < 2; w++) {
        int64_t bad = first_difference(res[1][w], res[0][w], N, 4);
        uint32_t g = 0, c = 0, xb, db;
        if (bad < 0) continue;
        memcpy(&g, (float *)res[1][w] + bad, 4);
        memcpy(&c, (float *)res[0][w] + bad, 4);
        memcpy(&xb, &x[bad], 4);
        memcpy(&db, &dy[bad], 4);
        CHECK(0, "relu %s differs from the CPU's bits at %lld (x 0x%08x, dy 0x%08x): GPU 0x%08x, "
                 "CPU 0x%08x",
              w ? "backward" : "forward", (long long)bad, xb, db, g, c);
    }
    CHECK(isnan(((float *)res[1][0])[0]) && isnan(((float *)res[1][1])[8]),
          "NaN did not pass");
    for (w = 0; w < 2; w++) {
        free(res[w][0]);
        free(res[w][1]);
    }
}

/* ---- column sums, convert ------------------------------------------------------------ */

static void test_column_sums(void) {
    static const int64_t shapes[6][2] = {{1, 1}, {7, 33}, {128, 10}, {1000, 127}, {4096, 64},
                                         {33, 1000}};
    int si, acc;
    backend *gpu = &gpu_be[GPU_AUTO];
    for (si = 0; si < 6; si++)
        for (acc = 0; acc < 2; acc++) {
            int64_t rows = shapes[si][0], cols = shapes[si][1];
            float *dz = (float *)random_values(MPT_FLOAT32, rows * cols, -1, 1);
            float *out0 = (float *)random_values(MPT_FLOAT32, cols, -1, 1);
            void *res[2];
            int w;
            for (w = 0; w < 2; w++) {
                backend *b = w ? gpu : &cpu_be;
                const float *d = (const float *)be_upload(b, dz, nbytes(MPT_FLOAT32, rows * cols));
                float *out = (float *)(acc ? be_upload(b, out0, nbytes(MPT_FLOAT32, cols))
                                           : be_poisoned(b, nbytes(MPT_FLOAT32, cols)));
                b->t->column_sums(b->impl, d, rows, cols, out, acc);
                res[w] = be_fetch(b, out, nbytes(MPT_FLOAT32, cols), "column_sums");
                be_release(b);
            }
            {
                double err = rel_error(MPT_FLOAT32, res[1], MPT_FLOAT32, res[0], cols);
                CHECK(err <= 1e-5, "column_sums %lldx%lld accumulate %d: relative error %.3g > 1e-5",
                      (long long)rows, (long long)cols, acc, err);
            }
            free(res[0]);
            free(res[1]);
            free(dz);
            free(out0);
        }
}

/* Source values: random bits, so every class of float appears (NaNs with
   payloads, infinities, subnormals, zeros, halfway cases); 16-bit sources
   walk through all 65536 patterns. */
static void *convert_source(mpt_dtype dt, int64_t n) {
    void *p = malloc(nbytes(dt, n));
    int64_t i;
    for (i = 0; i < n; i++) {
        if (dt == MPT_FLOAT32) {
            uint32_t bits = (uint32_t)test_next();
            /* float16's range and below it, then halfway cases */
            if (i % 4 == 1) bits = (bits & 0x807FFFFFu) | ((uint32_t)test_randint(100, 150) << 23);
            if (i % 16 == 3) bits = (bits & 0xFFFF0000u) | 0x8000u; /* bfloat16 */
            if (i % 16 == 5) /* float16, normal */
                bits = (bits & 0x807FE000u) | ((uint32_t)test_randint(103, 142) << 23) | 0x1000u;
            memcpy((float *)p + i, &bits, 4);
        } else {
            ((uint16_t *)p)[i] = (uint16_t)(i * 40503u + 7u); /* odd step: a permutation */
        }
    }
    return p;
}

static void test_convert(void) {
    static const int64_t counts[5] = {1, 7, 33, 1000, 65536 + 5};
    backend *gpu = &gpu_be[GPU_AUTO];
    int si, di, ci, off;
    for (si = 0; si < 3; si++)
        for (di = 0; di < 3; di++)
            for (ci = 0; ci < 5; ci++)
                for (off = 0; off < 2; off++) { /* off: both pointers one element in */
                    mpt_dtype sd = float_dtypes[si], dd = float_dtypes[di];
                    int64_t n = counts[ci], bad;
                    void *src = convert_source(sd, n + off), *res[2];
                    int w;
                    for (w = 0; w < 2; w++) {
                        backend *b = w ? gpu : &cpu_be;
                        char *s = (char *)be_upload(b, src, nbytes(sd, n + off));
                        char *d = (char *)be_poisoned(b, nbytes(dd, n + off));
                        b->t->convert(b->impl, dd, d + nbytes(dd, off), sd, s + nbytes(sd, off), n);
                        res[w] = be_fetch(b, d, nbytes(dd, n + off), "convert");
                        be_release(b);
                    }
                    bad = first_difference(res[1], res[0], n + off, mpt_dtype_size(dd));
                    if (bad >= 0) {
                        uint32_t sb = 0, g = 0, c = 0;
                        memcpy(&sb, (char *)src + nbytes(sd, bad), mpt_dtype_size(sd));
                        memcpy(&g, (char *)res[1] + nbytes(dd, bad), mpt_dtype_size(dd));
                        memcpy(&c, (char *)res[0] + nbytes(dd, bad), mpt_dtype_size(dd));
                        CHECK(0, "convert %s->%s n %lld offset %d: element %lld (source bits "
                                 "0x%x): GPU 0x%x, CPU 0x%x",
                              mpt_dtype_name(sd), mpt_dtype_name(dd), (long long)n, off,
                              (long long)bad - off, sb, g, c);
                    }
                    free(src);
                    free(res[0]);
                    free(res[1]);
                }
}

/* lookup_u8: fresh random bytes through a fresh random table of each float
   dtype, odd counts, the destination one element in (unaligned): the
   CPU's bits exactly, nothing outside the destination written. */
static void test_lookup_u8(void) {
    static const int64_t counts[5] = {1, 7, 33, 1000, 65536 + 5};
    backend *gpu = &gpu_be[GPU_AUTO];
    int di, ci, off;
    for (di = 0; di < 3; di++)
        for (ci = 0; ci < 5; ci++)
            for (off = 0; off < 2; off++) {
                mpt_dtype dt = float_dtypes[di];
                int64_t n = counts[ci], i, bad;
                void *table = random_values(dt, 256, -3, 3), *res[2];
                uint8_t *src = (uint8_t *)malloc((size_t)n);
                int w;
                for (i = 0; i < n; i++) src[i] = (uint8_t)(test_uniform(0, 256));
                for (w = 0; w < 2; w++) {
                    backend *b = w ? gpu : &cpu_be;
                    const void *t = be_upload(b, table, nbytes(dt, 256));
                    const uint8_t *s = (const uint8_t *)be_upload(b, src, (size_t)n);
                    char *d = (char *)be_poisoned(b, nbytes(dt, n + off + 1));
                    b->t->lookup_u8(b->impl, dt, d + nbytes(dt, off), t, s, n);
                    res[w] = be_fetch(b, d, nbytes(dt, n + off + 1), "lookup_u8");
                    be_release(b);
                }
                bad = first_difference(res[1], res[0], n + off + 1, mpt_dtype_size(dt));
                CHECK(bad < 0, "lookup_u8 %s n %lld offset %d: element %lld differs from the CPU's",
                      mpt_dtype_name(dt), (long long)n, off, (long long)bad - off);
                free(table);
                free(src);
                free(res[0]);
                free(res[1]);
            }
}

/* ---- activations ---------------------------------------------------------------------- */

static const int64_t act_shapes[5][2] = {{1, 1}, {7, 33}, {128, 10}, {33, 1000}, {255, 127}};

static void test_activation(void) {
    backend *gpu = &gpu_be[GPU_AUTO];
    int a, si;
    for (a = 0; a < MPT_ACT_COUNT_; a++)
        for (si = 0; si < 5; si++) {
            int64_t rows = act_shapes[si][0], cols = act_shapes[si][1], n = rows * cols;
            float *x = (float *)random_values(MPT_FLOAT32, n, -6, 6);
            void *res[2];
            double err;
            int w;
            for (w = 0; w < 2; w++) {
                backend *b = w ? gpu : &cpu_be;
                float *d = (float *)be_upload(b, x, nbytes(MPT_FLOAT32, n));
                b->t->activation(b->impl, (mpt_activation)a, d, rows, cols);
                res[w] = be_fetch(b, d, nbytes(MPT_FLOAT32, n), "activation");
                be_release(b);
            }
            err = rel_error(MPT_FLOAT32, res[1], MPT_FLOAT32, res[0], n);
            CHECK(err <= 1e-5, "activation %s %lldx%lld: relative error %.3g > 1e-5",
                  mpt_activation_name((mpt_activation)a), (long long)rows, (long long)cols, err);
            free(res[0]);
            free(res[1]);
            free(x);
        }
}

/* dz from z, y = act(z) and dy, all in dtype; dz is float32 arithmetic on
   the same inputs, so 1e-5 whatever the dtype. */
static void test_activation_grad(void) {
    backend *gpu = &gpu_be[GPU_AUTO];
    int a, si, di;
    for (a = 0; a < MPT_ACT_COUNT_; a++)
        for (di = 0; di < 3; di++)
            for (si = 0; si < 5; si++) {
                mpt_dtype dt = float_dtypes[di];
                int64_t rows = act_shapes[si][0], cols = act_shapes[si][1], n = rows * cols, i;
                void *z = random_values(dt, n, -4, 4), *dy = random_values(dt, n, -1, 1);
                void *y = malloc(nbytes(dt, n)), *res[2];
                double *t = (double *)malloc(sizeof(double) * (size_t)n), err;
                int w;
                for (i = 0; i < n; i++) t[i] = ref_act((mpt_activation)a, load_value(dt, z, i));
                if (a == MPT_ACT_SOFTMAX) {
                    for (i = 0; i < n; i++) t[i] = load_value(dt, z, i);
                    ref_softmax_rows(t, rows, cols);
                }
                for (i = 0; i < n; i++) store_value(dt, y, i, t[i]);
                for (w = 0; w < 2; w++) {
                    backend *b = w ? gpu : &cpu_be;
                    const void *dz_ = be_upload(b, z, nbytes(dt, n));
                    const void *dy_ = be_upload(b, dy, nbytes(dt, n));
                    const void *y_ = be_upload(b, y, nbytes(dt, n));
                    float *out = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, n));
                    float *tmp = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, n));
                    b->t->activation_grad(b->impl, (mpt_activation)a, dt, dz_, y_, dy_, out, tmp,
                                          rows, cols);
                    res[w] = be_fetch(b, out, nbytes(MPT_FLOAT32, n), "activation_grad");
                    be_release(b);
                }
                err = rel_error(MPT_FLOAT32, res[1], MPT_FLOAT32, res[0], n);
                CHECK(err <= 1e-5, "activation_grad %s %s %lldx%lld: relative error %.3g > 1e-5",
                      mpt_activation_name((mpt_activation)a), mpt_dtype_name(dt),
                      (long long)rows, (long long)cols, err);
                free(res[0]);
                free(res[1]);
                free(z);
                free(dy);
                free(y);
                free(t);
            }
}

/* ---- windows: im2col, col2im, pooling ---------------------------------------------------- */

/* A window with TensorFlow's padding (same: out = ceil(in / stride), the
   padding split with the extra pixel after). */
static mpt_window make_window(int64_t h, int64_t w, int64_t c, int64_t k, int64_t s, int same) {
    mpt_window g;
    memset(&g, 0, sizeof g);
    g.h = h;
    g.w = w;
    g.c = c;
    g.kh = g.kw = k;
    g.sh = g.sw = s;
    if (same) {
        int64_t ph, pw;
        g.oh = (h + s - 1) / s;
        g.ow = (w + s - 1) / s;
        ph = (g.oh - 1) * s + k - h;
        pw = (g.ow - 1) * s + k - w;
        g.top = ph > 0 ? ph / 2 : 0;
        g.left = pw > 0 ? pw / 2 : 0;
    } else {
        g.oh = (h - k) / s + 1;
        g.ow = (w - k) / s + 1;
    }
    return g;
}

#define N_WINDOWS 7
static mpt_window window_case(int i) {
    switch (i) {
    case 0: return make_window(28, 28, 1, 3, 1, 0);  /* the CNN's first conv */
    case 1: return make_window(13, 11, 3, 3, 2, 1);
    case 2: return make_window(7, 7, 5, 2, 2, 0);
    case 3: return make_window(5, 6, 7, 3, 1, 1);
    case 4: return make_window(12, 12, 32, 3, 1, 0);
    case 5: return make_window(1, 1, 3, 1, 1, 0);
    default: return make_window(4, 4, 2, 5, 3, 1);   /* window beyond the image */
    }
}

static void describe_window(char *buf, size_t size, const mpt_window *g, int64_t n, mpt_dtype dt) {
    snprintf(buf, size, "n %lld (%lld,%lld,%lld) window %lldx%lld stride %lld pad %lld,%lld -> %lldx%lld %s",
             (long long)n, (long long)g->h, (long long)g->w, (long long)g->c, (long long)g->kh,
             (long long)g->kw, (long long)g->sh, (long long)g->top, (long long)g->left,
             (long long)g->oh, (long long)g->ow, mpt_dtype_name(dt));
}

static void test_im2col(void) {
    backend *gpu = &gpu_be[GPU_AUTO];
    int wi, di, ni;
    for (wi = 0; wi < N_WINDOWS; wi++)
        for (di = 0; di < 3; di++)
            for (ni = 1; ni <= 3; ni += 2) {
                mpt_window g = window_case(wi);
                mpt_dtype dt = float_dtypes[di];
                int64_t n = ni, xn = n * g.h * g.w * g.c, cn = n * g.oh * g.ow * g.kh * g.kw * g.c;
                void *x = random_values(dt, xn, -1, 1), *res[2];
                char what[160];
                int w;
                for (w = 0; w < 2; w++) {
                    backend *b = w ? gpu : &cpu_be;
                    const void *xd = be_upload(b, x, nbytes(dt, xn));
                    void *cols = be_poisoned(b, nbytes(dt, cn));
                    b->t->im2col(b->impl, &g, dt, xd, n, cols);
                    res[w] = be_fetch(b, cols, nbytes(dt, cn), "im2col");
                    be_release(b);
                }
                describe_window(what, sizeof what, &g, n, dt);
                CHECK(memcmp(res[0], res[1], nbytes(dt, cn)) == 0,
                      "im2col %s: element %lld differs (exact)", what,
                      (long long)first_difference(res[1], res[0], cn, mpt_dtype_size(dt)));
                free(res[0]);
                free(res[1]);
                free(x);
            }
}

static void test_col2im(void) {
    backend *gpu = &gpu_be[GPU_AUTO];
    int wi, di, ni;
    for (wi = 0; wi < N_WINDOWS; wi++)
        for (di = 0; di < 3; di++)
            for (ni = 1; ni <= 3; ni += 2) {
                mpt_window g = window_case(wi);
                mpt_dtype dt = float_dtypes[di];
                int64_t n = ni, xn = n * g.h * g.w * g.c, cn = n * g.oh * g.ow * g.kh * g.kw * g.c;
                float *dcols = (float *)random_values(MPT_FLOAT32, cn, -1, 1);
                void *res[2];
                char what[160];
                double err;
                int w;
                for (w = 0; w < 2; w++) {
                    backend *b = w ? gpu : &cpu_be;
                    const float *dc = (const float *)be_upload(b, dcols, nbytes(MPT_FLOAT32, cn));
                    float *dxf = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, xn));
                    void *dx = be_poisoned(b, nbytes(dt, xn));
                    b->t->col2im(b->impl, &g, dt, dc, n, dxf, dx);
                    res[w] = be_fetch(b, dx, nbytes(dt, xn), "col2im");
                    be_release(b);
                }
                describe_window(what, sizeof what, &g, n, dt);
                err = rel_error(dt, res[1], dt, res[0], xn);
                CHECK(err <= tolerance(dt), "col2im %s: relative error %.3g > %g", what, err,
                      tolerance(dt));
                free(res[0]);
                free(res[1]);
                free(dcols);
            }
}

/* Pooling inputs: random, or (ties) drawn from four values so that windows
   hold equal maxima (the first one wins), or with a NaN (it wins). */
static void *pool_input(mpt_dtype dt, int64_t n, int variant) {
    static const double few[4] = {-1, 0, 0.5, 1};
    void *x = random_values(dt, n, -2, 2);
    int64_t i;
    if (variant == 1)
        for (i = 0; i < n; i++) store_value(dt, x, i, few[test_randint(0, 3)]);
    if (variant == 2) store_value(dt, x, n / 2, NAN);
    return x;
}

static void test_pool(void) {
    static const mpt_window windows[6] = {
        {8, 8, 3, 2, 2, 2, 2, 0, 0, 4, 4},       /* the CNN's pooling, small  */
        {7, 9, 5, 3, 3, 2, 2, 1, 1, 4, 5},       /* same padding              */
        {5, 5, 16, 3, 3, 1, 1, 1, 1, 5, 5},      /* overlapping windows       */
        {24, 24, 32, 2, 2, 2, 2, 0, 0, 12, 12},  /* the CNN's first pooling   */
        {1, 1, 7, 1, 1, 1, 1, 0, 0, 1, 1},
        {6, 6, 1, 6, 6, 1, 1, 0, 0, 1, 1}};      /* one window: global        */
    backend *gpu = &gpu_be[GPU_AUTO];
    int wi, di, ni, kind, variant;
    for (kind = 0; kind < 2; kind++)
        for (wi = 0; wi < 6; wi++)
            for (di = 0; di < 3; di++)
                for (ni = 1; ni <= 5; ni += 4)
                    for (variant = 0; variant < 3; variant++) {
                        const mpt_window *g = &windows[wi];
                        mpt_dtype dt = float_dtypes[di];
                        mpt_pool_kind pk = (mpt_pool_kind)kind;
                        int64_t n = ni, xn = n * g->h * g->w * g->c, yn = n * g->oh * g->ow * g->c;
                        void *x = pool_input(dt, xn, variant), *dy = random_values(dt, yn, -1, 1);
                        void *y[2], *am[2], *dx[2];
                        int32_t *argmax_host = NULL;
                        char what[200];
                        int w;
                        if (variant == 2 && pk == MPT_POOL_AVERAGE) {
                            free(x);
                            free(dy);
                            continue;
                        }
                        for (w = 0; w < 2; w++) {
                            backend *b = w ? gpu : &cpu_be;
                            int64_t wsb = b->t->pool_workspace(b->impl, g, n);
                            void *ws = be_poisoned(b, (size_t)(wsb > 0 ? wsb : 0));
                            const void *xd = be_upload(b, x, nbytes(dt, xn));
                            void *yd = be_poisoned(b, nbytes(dt, yn));
                            int32_t *ad = pk == MPT_POOL_MAX
                                              ? (int32_t *)be_poisoned(b, nbytes(MPT_INT32, yn))
                                              : NULL;
                            b->t->pool_forward(b->impl, pk, g, dt, xd, yd, ad, n, ws);
                            y[w] = be_fetch(b, yd, nbytes(dt, yn), "pool_forward");
                            am[w] = ad ? be_fetch(b, ad, nbytes(MPT_INT32, yn), "pool_forward")
                                       : NULL;
                            /* backward from the CPU's argmax on both */
                            if (ad && w == 1) be_put(b, ad, argmax_host, nbytes(MPT_INT32, yn));
                            if (ad && w == 0) argmax_host = (int32_t *)am[0];
                            if (variant != 2) {
                                const void *dyd = be_upload(b, dy, nbytes(dt, yn));
                                void *dxd = be_poisoned(b, nbytes(dt, xn));
                                be_poison(b, ws, (size_t)(wsb > 0 ? wsb : 0));
                                b->t->pool_backward(b->impl, pk, g, dt, dyd, dxd, ad, n, ws);
                                dx[w] = be_fetch(b, dxd, nbytes(dt, xn), "pool_backward");
                            } else {
                                dx[w] = NULL;
                            }
                            be_release(b);
                        }
                        describe_window(what, sizeof what, g, n, dt);
                        if (pk == MPT_POOL_MAX) {
                            CHECK(memcmp(y[0], y[1], nbytes(dt, yn)) == 0,
                                  "max pool forward %s (inputs %d): y element %lld differs (exact)",
                                  what, variant,
                                  (long long)first_difference(y[1], y[0], yn, mpt_dtype_size(dt)));
                            CHECK(memcmp(am[0], am[1], nbytes(MPT_INT32, yn)) == 0,
                                  "max pool forward %s (inputs %d): argmax %lld differs (exact)",
                                  what, variant,
                                  (long long)first_difference(am[1], am[0], yn, 4));
                        } else {
                            double err = rel_error(dt, y[1], dt, y[0], yn);
                            CHECK(err <= tolerance(dt),
                                  "average pool forward %s: relative error %.3g > %g", what, err,
                                  tolerance(dt));
                        }
                        if (dx[0]) {
                            double err = rel_error(dt, dx[1], dt, dx[0], xn);
                            CHECK(err <= tolerance(dt),
                                  "%s pool backward %s (inputs %d): relative error %.3g > %g",
                                  pk == MPT_POOL_MAX ? "max" : "average", what, variant, err,
                                  tolerance(dt));
                        }
                        free(y[0]);
                        free(y[1]);
                        free(am[0]);
                        free(am[1]);
                        free(dx[0]);
                        free(dx[1]);
                        free(x);
                        free(dy);
                    }
}

/* ---- batch normalization ------------------------------------------------------------- */

typedef struct bn_host {
    void *x, *dy;
    float *gamma, *beta, *mean, *variance, *moving_mean, *moving_variance;
} bn_host;

/* The outputs one backend gave, all on the host. */
typedef struct bn_result {
    void *y, *dx;
    float *mean, *variance, *dgamma, *dbeta, *moving_mean, *moving_variance;
} bn_result;

static void bn_result_free(bn_result *r) {
    free(r->y);
    free(r->dx);
    free(r->mean);
    free(r->variance);
    free(r->dgamma);
    free(r->dbeta);
    free(r->moving_mean);
    free(r->moving_variance);
}

/* 0: training forward, 1: inference forward, 2: backward (with the host's
   batch statistics), 3: commit with state->finite 0, 4: commit with 1. */
static bn_result bn_run(backend *b, int what, mpt_dtype dt, int64_t rows, int64_t C,
                        const bn_host *h, int with_affine, int with_dx) {
    mpt_batchnorm_args a;
    bn_result r;
    size_t cb = nbytes(MPT_FLOAT32, C), xb = nbytes(dt, rows * C);
    int64_t wsb = b->t->batchnorm_workspace(b->impl, dt, rows, C);
    memset(&a, 0, sizeof a);
    memset(&r, 0, sizeof r);
    a.dtype = dt;
    a.rows = rows;
    a.channels = C;
    a.epsilon = 1e-3f;
    a.momentum = 0.99f;
    a.training = what == 0;
    a.x = be_upload(b, h->x, xb);
    a.y = be_poisoned(b, xb);
    a.dy = be_upload(b, h->dy, xb);
    a.dx = with_dx ? be_poisoned(b, xb) : NULL;
    a.gamma = with_affine ? (const float *)be_upload(b, h->gamma, cb) : NULL;
    a.beta = with_affine ? (const float *)be_upload(b, h->beta, cb) : NULL;
    a.dgamma = with_affine ? (float *)be_poisoned(b, cb) : NULL;
    a.dbeta = with_affine ? (float *)be_poisoned(b, cb) : NULL;
    a.mean = (float *)(what == 0 ? be_poisoned(b, cb) : be_upload(b, h->mean, cb));
    a.variance = (float *)(what == 0 ? be_poisoned(b, cb) : be_upload(b, h->variance, cb));
    a.moving_mean = (float *)be_upload(b, h->moving_mean, cb);
    a.moving_variance = (float *)be_upload(b, h->moving_variance, cb);
    a.workspace = be_poisoned(b, (size_t)(wsb > 0 ? wsb : 0));
    if (what <= 1) {
        b->t->batchnorm_forward(b->impl, &a);
        r.y = be_fetch(b, a.y, xb, "batchnorm_forward");
        if (what == 0) {
            r.mean = (float *)be_fetch(b, a.mean, cb, "batchnorm_forward");
            r.variance = (float *)be_fetch(b, a.variance, cb, "batchnorm_forward");
        }
    } else if (what == 2) {
        b->t->batchnorm_backward(b->impl, &a);
        if (a.dx) r.dx = be_fetch(b, a.dx, xb, "batchnorm_backward");
        if (a.dgamma) {
            r.dgamma = (float *)be_fetch(b, a.dgamma, cb, "batchnorm_backward");
            r.dbeta = (float *)be_fetch(b, a.dbeta, cb, "batchnorm_backward");
        }
    } else {
        mpt_step_state st;
        memset(&st, 0, sizeof st);
        st.finite = what == 4;
        st.loss_scale = 1;
        b->t->batchnorm_commit(b->impl, &a,
                               (const mpt_step_state *)be_upload(b, &st, sizeof st));
        r.moving_mean = (float *)be_fetch(b, a.moving_mean, cb, "batchnorm_commit");
        r.moving_variance = (float *)be_fetch(b, a.moving_variance, cb, "batchnorm_commit");
    }
    be_release(b);
    return r;
}

static void check_close(const char *what, mpt_dtype dt, const void *gpu, const void *cpu,
                        int64_t n, double tol) {
    double err = rel_error(dt, gpu, dt, cpu, n);
    CHECK(err <= tol, "%s: relative error %.3g > %g", what, err, tol);
}

static void test_batchnorm(void) {
    static const int64_t shapes[6][2] = {{1, 3}, {7, 1}, {128, 32}, {1000, 64}, {4096, 5},
                                         {33, 512}};
    backend *gpu = &gpu_be[GPU_AUTO];
    int si, di, what;
    for (si = 0; si < 6; si++)
        for (di = 0; di < 3; di++) {
            mpt_dtype dt = float_dtypes[di];
            int64_t rows = shapes[si][0], C = shapes[si][1];
            int affine = si != 1, with_dx = si != 4;
            bn_host h;
            char name[160];
            h.x = random_values(dt, rows * C, 1, 5); /* mean 3: the variance must subtract it */
            h.dy = random_values(dt, rows * C, -1, 1);
            h.gamma = (float *)random_values(MPT_FLOAT32, C, 0.5, 1.5);
            h.beta = (float *)random_values(MPT_FLOAT32, C, -1, 1);
            h.mean = (float *)random_values(MPT_FLOAT32, C, 2.5, 3.5);
            h.variance = (float *)random_values(MPT_FLOAT32, C, 1, 1.7);
            h.moving_mean = (float *)random_values(MPT_FLOAT32, C, -1, 1);
            h.moving_variance = (float *)random_values(MPT_FLOAT32, C, 0.5, 2);
            for (what = 0; what < 5; what++) {
                bn_result c = bn_run(&cpu_be, what, dt, rows, C, &h, affine, with_dx);
                bn_result g = bn_run(gpu, what, dt, rows, C, &h, affine, with_dx);
                snprintf(name, sizeof name, "batchnorm %s %lldx%lld %s%s",
                         what == 0 ? "forward (training)" : what == 1 ? "forward (inference)"
                         : what == 2 ? "backward" : what == 3 ? "commit (not finite)"
                                                              : "commit (finite)",
                         (long long)rows, (long long)C, mpt_dtype_name(dt),
                         affine ? "" : " without gamma/beta");
                if (what <= 1) check_close(name, dt, g.y, c.y, rows * C, tolerance(dt));
                if (what == 0) {
                    check_close(name, MPT_FLOAT32, g.mean, c.mean, C, 1e-5);
                    check_close(name, MPT_FLOAT32, g.variance, c.variance, C, 1e-5);
                }
                if (what == 2 && with_dx) check_close(name, dt, g.dx, c.dx, rows * C, tolerance(dt));
                if (what == 2 && affine) {
                    check_close(name, MPT_FLOAT32, g.dgamma, c.dgamma, C, 1e-5);
                    check_close(name, MPT_FLOAT32, g.dbeta, c.dbeta, C, 1e-5);
                }
                if (what == 3) { /* a skipped step leaves the moving statistics alone */
                    CHECK(!memcmp(g.moving_mean, h.moving_mean, nbytes(MPT_FLOAT32, C)) &&
                              !memcmp(g.moving_variance, h.moving_variance, nbytes(MPT_FLOAT32, C)),
                          "%s: the moving statistics changed", name);
                }
                if (what == 4) {
                    check_close(name, MPT_FLOAT32, g.moving_mean, c.moving_mean, C, 1e-5);
                    check_close(name, MPT_FLOAT32, g.moving_variance, c.moving_variance, C, 1e-5);
                }
                bn_result_free(&c);
                bn_result_free(&g);
            }
            free(h.x);
            free(h.dy);
            free(h.gamma);
            free(h.beta);
            free(h.mean);
            free(h.variance);
            free(h.moving_mean);
            free(h.moving_variance);
        }
}

/* ---- layer normalization -------------------------------------------------------------- */

/* What one backend gave for a LayerNormalization forward and backward,
   on the host. */
typedef struct ln_result {
    void *y, *dx;
    float *mean, *inv_std, *dgamma, *dbeta;
} ln_result;

static void ln_result_free(ln_result *r) {
    free(r->y);
    free(r->dx);
    free(r->mean);
    free(r->inv_std);
    free(r->dgamma);
    free(r->dbeta);
}

/* Forward of x, then backward of dy from the row statistics given
   (stat_mean, stat_inv_std: the CPU's forward's, so that both backends'
   backward start from the same numbers). Every output poisoned first. */
static ln_result ln_run(backend *b, mpt_dtype dt, int64_t rows, int64_t D, const void *x,
                        const void *dy, const float *gamma, const float *beta,
                        const float *stat_mean, const float *stat_inv_std, int with_dx) {
    mpt_layernorm_args a;
    ln_result r;
    size_t db = nbytes(MPT_FLOAT32, D), rb = nbytes(MPT_FLOAT32, rows), xb = nbytes(dt, rows * D);
    int64_t wsb = b->t->layernorm_workspace(b->impl, dt, rows, D);
    memset(&a, 0, sizeof a);
    memset(&r, 0, sizeof r);
    CHECK(wsb >= 0, "layernorm_workspace %lld for %lldx%lld", (long long)wsb, (long long)rows,
          (long long)D);
    a.dtype = dt;
    a.rows = rows;
    a.cols = D;
    a.epsilon = 1e-3f;
    a.x = be_upload(b, x, xb);
    a.y = be_poisoned(b, xb);
    a.gamma = gamma ? (const float *)be_upload(b, gamma, db) : NULL;
    a.beta = beta ? (const float *)be_upload(b, beta, db) : NULL;
    a.mean = (float *)be_poisoned(b, rb);
    a.inv_std = (float *)be_poisoned(b, rb);
    a.workspace = be_poisoned(b, (size_t)(wsb > 0 ? wsb : 0));
    b->t->layernorm_forward(b->impl, &a);
    r.y = be_fetch(b, a.y, xb, "layernorm_forward");
    r.mean = (float *)be_fetch(b, a.mean, rb, "layernorm_forward");
    r.inv_std = (float *)be_fetch(b, a.inv_std, rb, "layernorm_forward");
    if (stat_mean) {
        be_put(b, a.mean, stat_mean, rb);
        be_put(b, a.inv_std, stat_inv_std, rb);
        a.dy = be_upload(b, dy, xb);
        a.dx = with_dx ? be_poisoned(b, xb) : NULL;
        a.dgamma = gamma ? (float *)be_poisoned(b, db) : NULL;
        a.dbeta = beta ? (float *)be_poisoned(b, db) : NULL;
        b->t->layernorm_backward(b->impl, &a);
        if (a.dx) r.dx = be_fetch(b, a.dx, xb, "layernorm_backward");
        if (a.dgamma) r.dgamma = (float *)be_fetch(b, a.dgamma, db, "layernorm_backward");
        if (a.dbeta) r.dbeta = (float *)be_fetch(b, a.dbeta, db, "layernorm_backward");
    }
    be_release(b);
    return r;
}

/* CUDA against the CPU: y and dx within tolerance(dt) (2^-10 float16,
   2^-7 bfloat16, 1e-5 float32: the same per-element rule, only the order
   of the row sums differs), each row's mean and inv_std and dgamma, dbeta
   within 1e-5 (float32 from double sums). Rows of 1 to 1000 columns, one
   column, a row count over several chunks, x far from 0 (mean 3, and
   around 500 in one shape), with and without gamma/beta and dx. */
static void test_layernorm(void) {
    static const int64_t shapes[7][2] = {{1, 3}, {7, 1}, {128, 32}, {1000, 64}, {4096, 5},
                                         {33, 1000}, {300, 96}};
    backend *gpu = &gpu_be[GPU_AUTO];
    int si, di;
    for (si = 0; si < 7; si++)
        for (di = 0; di < 3; di++) {
            mpt_dtype dt = float_dtypes[di];
            int64_t rows = shapes[si][0], D = shapes[si][1];
            int affine = si != 1 && si != 5, with_dx = si != 4;
            double lo = si == 6 ? 490 : 1, hi = si == 6 ? 530 : 5;
            void *x = random_values(dt, rows * D, lo, hi);
            void *dy = random_values(dt, rows * D, -1, 1);
            float *gamma = (float *)random_values(MPT_FLOAT32, D, 0.5, 1.5);
            float *beta = (float *)random_values(MPT_FLOAT32, D, -1, 1);
            ln_result c, g;
            char name[160];
            snprintf(name, sizeof name, "layernorm %lldx%lld %s%s%s", (long long)rows,
                     (long long)D, mpt_dtype_name(dt), affine ? "" : " without gamma/beta",
                     with_dx ? "" : " without dx");
            c = ln_run(&cpu_be, dt, rows, D, x, dy, affine ? gamma : NULL, affine ? beta : NULL,
                       NULL, NULL, with_dx);
            g = ln_run(gpu, dt, rows, D, x, dy, affine ? gamma : NULL, affine ? beta : NULL,
                       NULL, NULL, with_dx);
            check_close(name, dt, g.y, c.y, rows * D, tolerance(dt));
            check_close(name, MPT_FLOAT32, g.mean, c.mean, rows, 1e-5);
            check_close(name, MPT_FLOAT32, g.inv_std, c.inv_std, rows, 1e-5);
            {
                ln_result cb = ln_run(&cpu_be, dt, rows, D, x, dy, affine ? gamma : NULL,
                                      affine ? beta : NULL, c.mean, c.inv_std, with_dx);
                ln_result gb = ln_run(gpu, dt, rows, D, x, dy, affine ? gamma : NULL,
                                      affine ? beta : NULL, c.mean, c.inv_std, with_dx);
                if (with_dx) check_close(name, dt, gb.dx, cb.dx, rows * D, tolerance(dt));
                if (affine) {
                    check_close(name, MPT_FLOAT32, gb.dgamma, cb.dgamma, D, 1e-5);
                    check_close(name, MPT_FLOAT32, gb.dbeta, cb.dbeta, D, 1e-5);
                }
                ln_result_free(&cb);
                ln_result_free(&gb);
            }
            ln_result_free(&c);
            ln_result_free(&g);
            free(x);
            free(dy);
            free(gamma);
            free(beta);
        }
}

/* ---- MultiHeadAttention's attention ------------------------------------------------------ */

/* A shape of mpt_attention_args. */
typedef struct attn_case {
    int64_t B, H, Tq, Tk, dk, dv, offset;
    int causal;
    float rate;
} attn_case;

/* What one backend gave: O in dtype, dQ, dK, dV in float32, and the step
   forward saved. */
typedef struct attn_result {
    void *o;
    float *dq, *dk, *dv;
    int64_t saved_step;
} attn_result;

static void attn_result_free(attn_result *r) {
    free(r->o);
    free(r->dq);
    free(r->dk);
    free(r->dv);
}

/* Forward at `step` (state in backend memory), then backward of d_o, every
   output poisoned first. Between the two the state's step moves on and the
   workspace is poisoned: backward must read the saved step and nothing
   that forward left in the workspace. */
static attn_result attn_run(backend *b, const attn_case *c, mpt_dtype dt, uint64_t key,
                            int64_t step, const void *q, const void *k, const void *v,
                            const void *d_o) {
    const int64_t nq = c->B * c->Tq * c->H * c->dk, nk = c->B * c->Tk * c->H * c->dk;
    const int64_t nv = c->B * c->Tk * c->H * c->dv, no = c->B * c->Tq * c->H * c->dv;
    mpt_attention_args a;
    mpt_step_state st;
    attn_result r;
    int64_t wsb, *saved;
    mpt_step_state *sd;
    memset(&a, 0, sizeof a);
    memset(&r, 0, sizeof r);
    memset(&st, 0, sizeof st);
    a.dtype = dt;
    a.batch = c->B;
    a.heads = c->H;
    a.q_len = c->Tq;
    a.kv_len = c->Tk;
    a.key_dim = c->dk;
    a.value_dim = c->dv;
    a.scale = (float)(1.0 / sqrt((double)c->dk));
    a.causal = c->causal;
    a.causal_offset = c->offset;
    a.dropout = c->rate;
    a.dropout_key = key;
    wsb = b->t->attention_workspace(b->impl, &a);
    CHECK(wsb >= 0, "attention_workspace %lld on %s", (long long)wsb, b->label);
    st.step = step;
    st.loss_scale = 1;
    sd = (mpt_step_state *)be_upload(b, &st, sizeof st);
    saved = (int64_t *)be_poisoned(b, sizeof(int64_t));
    a.state = sd;
    a.saved_step = saved;
    a.q = be_upload(b, q, nbytes(dt, nq));
    a.k = be_upload(b, k, nbytes(dt, nk));
    a.v = be_upload(b, v, nbytes(dt, nv));
    a.o = be_poisoned(b, nbytes(dt, no));
    a.workspace = be_poisoned(b, (size_t)(wsb > 0 ? wsb : 0));
    b->t->attention_forward(b->impl, &a);
    r.o = be_fetch(b, a.o, nbytes(dt, no), "attention_forward");
    {
        int64_t *s = (int64_t *)be_fetch(b, saved, sizeof(int64_t), "attention_forward");
        r.saved_step = *s;
        free(s);
    }
    st.step = step + 1;
    be_put(b, sd, &st, sizeof st);
    be_poison(b, a.workspace, (size_t)(wsb > 0 ? wsb : 0));
    a.state = NULL;
    a.o = NULL;
    a.d_o = be_upload(b, d_o, nbytes(dt, no));
    a.dq = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, nq));
    a.dk = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, nk));
    a.dv = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, nv));
    b->t->attention_backward(b->impl, &a);
    r.dq = (float *)be_fetch(b, a.dq, nbytes(MPT_FLOAT32, nq), "attention_backward");
    r.dk = (float *)be_fetch(b, a.dk, nbytes(MPT_FLOAT32, nk), "attention_backward");
    r.dv = (float *)be_fetch(b, a.dv, nbytes(MPT_FLOAT32, nv), "attention_backward");
    be_release(b);
    return r;
}

/* CUDA against the CPU (@impl-attention-cpu), each dtype: causal or not, one
   query and key, Tq = 130, Tq != Tk with causal_offset = Tk − Tq, key_dim
   and value_dim past the kernels' 128 threads, and keys past the 4096 that
   mpt_cuda.cu keeps in shared memory (then its rows go to the workspace).
   Both backends round P̃ and dS to dtype as operands and sum in float32 in
   different orders (CUDA's expf within 2 ulps of glibc's), so O is within
   tolerance(dt) (1e-5 in float32) and dQ, dK, dV within 1e-4 (float32),
   2^-9 (float16), 2^-6 (bfloat16): dS = P·(dP − Σ P·dP) loses a few
   bits to cancellation before its rounding to dtype. With dropout, V is
   one-hot (value_dim = Tk), so O holds P̃ itself and the weights dropped
   are O's zeros, which must be the same on both backends; both save the
   step. Two GPU runs give the same bits. */
static void test_attention(void) {
    static const attn_case cases[] = {
        /* B  H   Tq    Tk   dk    dv  offset causal rate */
        {1, 1, 1, 1, 1, 1, 0, 0, 0},
        {2, 3, 7, 7, 8, 8, 0, 1, 0},
        {2, 2, 130, 130, 16, 8, 0, 1, 0},
        {1, 2, 130, 200, 8, 16, 0, 0, 0},
        {2, 2, 5, 9, 8, 8, 4, 1, 0},
        {1, 1, 9, 17, 200, 130, 8, 1, 0},
        {1, 1, 3, 5000, 40, 33, 0, 0, 0},
        {1, 2, 130, 4500, 8, 4, 4370, 1, 0},
        {2, 2, 33, 40, 8, 40, 0, 1, 0.3f},
        {1, 2, 3, 4200, 8, 4200, 0, 0, 0.5f},
    };
    backend *gpu = &gpu_be[GPU_AUTO];
    int ci, di;
    for (ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++)
        for (di = 0; di < 3; di++) {
            const attn_case *c = &cases[ci];
            const mpt_dtype dt = float_dtypes[di];
            const int64_t nq = c->B * c->Tq * c->H * c->dk, nk = c->B * c->Tk * c->H * c->dk;
            const int64_t nv = c->B * c->Tk * c->H * c->dv, no = c->B * c->Tq * c->H * c->dv;
            const double grad_tol = dt == MPT_FLOAT32 ? 1e-4 : 2 * tolerance(dt);
            const uint64_t key = test_next();
            const int64_t step = 777 + ci;
            void *q = random_values(dt, nq, -1, 1), *k = random_values(dt, nk, -1, 1);
            void *v = random_values(dt, nv, -1, 1), *d_o = random_values(dt, no, -1, 1);
            attn_result cr, gr, again;
            char name[200];
            int64_t e;
            if (c->rate > 0) /* one-hot rows: O = P̃ */
                for (e = 0; e < nv; e++)
                    store_value(dt, v, e, e % c->dv == e / (c->H * c->dv) % c->Tk ? 1 : 0);
            snprintf(name, sizeof name,
                     "attention B %lld H %lld Tq %lld Tk %lld key_dim %lld value_dim %lld%s "
                     "offset %lld rate %g %s",
                     (long long)c->B, (long long)c->H, (long long)c->Tq, (long long)c->Tk,
                     (long long)c->dk, (long long)c->dv, c->causal ? " causal" : "",
                     (long long)c->offset, (double)c->rate, mpt_dtype_name(dt));
            cr = attn_run(&cpu_be, c, dt, key, step, q, k, v, d_o);
            gr = attn_run(gpu, c, dt, key, step, q, k, v, d_o);
            again = attn_run(gpu, c, dt, key, step, q, k, v, d_o);
            check_close(name, dt, gr.o, cr.o, no, tolerance(dt));
            check_close(name, MPT_FLOAT32, gr.dq, cr.dq, nq, grad_tol);
            check_close(name, MPT_FLOAT32, gr.dk, cr.dk, nk, grad_tol);
            check_close(name, MPT_FLOAT32, gr.dv, cr.dv, nv, grad_tol);
            CHECK(!memcmp(gr.o, again.o, nbytes(dt, no)) &&
                      !memcmp(gr.dq, again.dq, nbytes(MPT_FLOAT32, nq)) &&
                      !memcmp(gr.dk, again.dk, nbytes(MPT_FLOAT32, nk)) &&
                      !memcmp(gr.dv, again.dv, nbytes(MPT_FLOAT32, nv)),
                  "%s: two GPU runs differ", name);
            if (c->rate > 0) {
                int64_t zeros = 0, differ = -1;
                for (e = 0; e < no; e++) {
                    int cz = load_value(dt, cr.o, e) == 0, gz = load_value(dt, gr.o, e) == 0;
                    zeros += gz;
                    if (cz != gz && differ < 0) differ = e;
                }
                CHECK(differ < 0, "%s: weight %lld dropped on one backend only", name,
                      (long long)differ);
                CHECK(zeros > 0 && zeros < no, "%s: %lld of %lld weights zero", name,
                      (long long)zeros, (long long)no);
                CHECK(cr.saved_step == step && gr.saved_step == step,
                      "%s: saved step CPU %lld, GPU %lld, want %lld", name,
                      (long long)cr.saved_step, (long long)gr.saved_step, (long long)step);
            }
            attn_result_free(&cr);
            attn_result_free(&gr);
            attn_result_free(&again);
            free(q);
            free(k);
            free(v);
            free(d_o);
        }
}

/* ---- dropout --------------------------------------------------------------------------- */

/* Forward (step from the state, saved) and backward (the saved step):
   both bit-exact, since the mask is Philox on both backends and the
   scaling one float32 multiplication (rounded once for the halves). */
static void test_dropout(void) {
    static const float rates[4] = {0.0f, 0.25f, 0.5f, 0.9f};
    static const int64_t counts[5] = {1, 7, 1000, 4099, 65536 + 3};
    backend *gpu = &gpu_be[GPU_AUTO];
    int ri, di, ci, pass;
    for (ri = 0; ri < 4; ri++)
        for (di = 0; di < 3; di++)
            for (ci = 0; ci < 5; ci++) {
                mpt_dtype dt = float_dtypes[di];
                int64_t n = counts[ci], dropped = 0, i;
                uint64_t key = test_next();
                void *in = random_values(dt, n, -2, 2), *out[2][2];
                int64_t saved[2] = {-1, -1};
                mpt_step_state st;
                int w;
                memset(&st, 0, sizeof st);
                st.step = 12345 + ci;
                st.loss_scale = 1;
                for (w = 0; w < 2; w++) {
                    backend *b = w ? gpu : &cpu_be;
                    const void *ind = be_upload(b, in, nbytes(dt, n));
                    const mpt_step_state *sd = (const mpt_step_state *)be_upload(b, &st, sizeof st);
                    /* the step, then room for the mask's bits (the backend's contract) */
                    int64_t *saved_d =
                        (int64_t *)be_poisoned(b, sizeof(int64_t) + (size_t)(n + 7) / 8);
                    void *ws = be_poisoned(b, nbytes(MPT_FLOAT32, n));
                    for (pass = 0; pass < 2; pass++) { /* forward, then backward on the same in */
                        void *o = be_poisoned(b, nbytes(dt, n));
                        b->t->dropout(b->impl, key, rates[ri], dt, ind, o, n, pass ? NULL : sd,
                                      saved_d, ws);
                        out[w][pass] = be_fetch(b, o, nbytes(dt, n), "dropout");
                    }
                    {
                        int64_t *s = (int64_t *)be_fetch(b, saved_d, sizeof(int64_t), "dropout");
                        saved[w] = *s;
                        free(s);
                    }
                    be_release(b);
                }
                for (pass = 0; pass < 2; pass++)
                    CHECK(memcmp(out[0][pass], out[1][pass], nbytes(dt, n)) == 0,
                          "dropout %s rate %g n %lld %s: element %lld differs (exact)",
                          mpt_dtype_name(dt), (double)rates[ri], (long long)n,
                          pass ? "backward" : "forward",
                          (long long)first_difference(out[1][pass], out[0][pass], n,
                                                      mpt_dtype_size(dt)));
                CHECK(saved[0] == st.step && saved[1] == st.step,
                      "dropout saved step: CPU %lld, GPU %lld, want %lld", (long long)saved[0],
                      (long long)saved[1], (long long)st.step);
                for (i = 0; i < n; i++) dropped += load_value(dt, out[0][0], i) == 0;
                if (n >= 1000 && rates[ri] > 0)
                    CHECK(dropped > 0 && dropped < n, "dropout rate %g dropped %lld of %lld",
                          (double)rates[ri], (long long)dropped, (long long)n);
                free(out[0][0]);
                free(out[0][1]);
                free(out[1][0]);
                free(out[1][1]);
                free(in);
            }
}

/* ---- the graphs' element-wise operations and row moves ------------------------------------ */

/* Every op of elementwise, each dtype, odd counts, an operand one element
   off its alignment, and y written over a: the GPU's bits are the CPU's
   (both run mpt__elementwise_rule and round once). */
static void test_elementwise(void) {
    static const int64_t counts[4] = {1, 7, 1000, 65536 + 3};
    backend *gpu = &gpu_be[GPU_AUTO];
    int op, di, ci, in_place;
    for (op = MPT_ELEMENTWISE_ADD; op <= MPT_ELEMENTWISE_NEGATE; op++)
        for (di = 0; di < 3; di++)
            for (ci = 0; ci < 4; ci++)
                for (in_place = 0; in_place < 2; in_place++) {
                    mpt_dtype dt = float_dtypes[di];
                    int64_t n = counts[ci];
                    size_t es = mpt_dtype_size(dt);
                    void *a = random_values(dt, n + 1, -3, 3), *b = random_values(dt, n, -3, 3);
                    void *out[2];
                    int w;
                    for (w = 0; w < 2; w++) {
                        backend *be = w ? gpu : &cpu_be;
                        unsigned char *ad = (unsigned char *)be_upload(be, a, nbytes(dt, n + 1));
                        const void *bd = be_upload(be, b, nbytes(dt, n));
                        void *y = in_place ? (void *)(ad + es) : be_poisoned(be, nbytes(dt, n));
                        be->t->elementwise(be->impl, (mpt_elementwise_op)op, dt, y, ad + es, bd,
                                           op == MPT_ELEMENTWISE_DIVIDE ? 3.0f : 0.0f, n);
                        out[w] = be_fetch(be, y, nbytes(dt, n), "elementwise");
                        be_release(be);
                    }
                    CHECK(memcmp(out[0], out[1], nbytes(dt, n)) == 0,
                          "elementwise op %d %s n %lld%s: element %lld differs (exact)", op,
                          mpt_dtype_name(dt), (long long)n, in_place ? " in place" : "",
                          (long long)first_difference(out[1], out[0], n, es));
                    free(out[0]);
                    free(out[1]);
                    free(a);
                    free(b);
                }
}

/* copy_rows against memcpy on the host: planes of rows with pitches and
   plane steps of every alignment (each width of 1..16-byte units). */
static void test_copy_rows(void) {
    static const int64_t widths[5] = {1, 6, 32, 48, 200};
    backend *gpu = &gpu_be[GPU_AUTO];
    int wi, shift;
    for (wi = 0; wi < 5; wi++)
        for (shift = 0; shift < 3; shift++) {
            int64_t width = widths[wi], rows = 5, planes = 3, r, p;
            int64_t src_pitch = width + shift * 2, src_plane = rows * src_pitch + 16 * shift;
            int64_t dst_pitch = width * 2 + shift, dst_plane = rows * dst_pitch + 7 * shift;
            size_t src_bytes = (size_t)(planes * src_plane), dst_bytes = (size_t)(planes * dst_plane);
            unsigned char *src = (unsigned char *)random_values(MPT_FLOAT32, (int64_t)src_bytes / 4 + 1, -1, 1);
            unsigned char *want = (unsigned char *)malloc(dst_bytes), *got;
            memset(want, 0xFF, dst_bytes);
            for (p = 0; p < planes; p++)
                for (r = 0; r < rows; r++)
                    memcpy(want + p * dst_plane + r * dst_pitch, src + p * src_plane + r * src_pitch,
                           (size_t)width);
            {
                const void *sd = be_upload(gpu, src, src_bytes);
                void *dd = be_poisoned(gpu, dst_bytes);
                gpu->t->copy_rows(gpu->impl, dd, dst_pitch, dst_plane, sd, src_pitch, src_plane,
                                  width, rows, planes);
                got = (unsigned char *)be_fetch(gpu, dd, dst_bytes, "copy_rows");
                be_release(gpu);
            }
            CHECK(memcmp(got, want, dst_bytes) == 0,
                  "copy_rows width %lld pitches %lld/%lld planes %lld/%lld: byte %lld differs",
                  (long long)width, (long long)src_pitch, (long long)dst_pitch,
                  (long long)src_plane, (long long)dst_plane,
                  (long long)first_difference(got, want, (int64_t)dst_bytes, 1));
            free(got);
            free(want);
            free(src);
        }
}

/* ---- Embedding's rows of a table ---------------------------------------------------------- */

/* n ids in [0, rows) with repeats, and ids outside the table (−1, rows,
   INT32_MAX, INT32_MIN) among them. */
static int32_t *random_ids(int64_t n, int64_t rows) {
    static const int32_t bad[4] = {-1, 0, INT32_MAX, INT32_MIN};
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    int64_t i;
    for (i = 0; i < n; i++)
        ids[i] = i % 17 == 5 ? (bad[i % 4] == 0 ? (int32_t)rows : bad[i % 4])
                             : (int32_t)(test_next() % (unsigned long long)rows);
    return ids;
}

/* gather_rows and scatter_add_rows, each dtype, tables of 1 to 300 rows
   of odd widths, repeated and bad ids: the GPU's bits are the CPU's
   (gather moves bits; each gradient row adds its dy rows in the ids'
   order in float32 on both). */
static void test_gather_scatter_rows(void) {
    static const int64_t shapes[4][3] = {{1, 1, 5}, {7, 3, 40}, {300, 33, 1000}, {64, 768, 257}};
    backend *gpu = &gpu_be[GPU_AUTO];
    int di, si;
    for (di = 0; di < 3; di++)
        for (si = 0; si < 4; si++) {
            mpt_dtype dt = float_dtypes[di];
            int64_t rows = shapes[si][0], width = shapes[si][1], n = shapes[si][2];
            void *table = random_values(dt, rows * width, -2, 2);
            void *dy = random_values(dt, n * width, -1, 1);
            int32_t *ids = random_ids(n, rows);
            void *y[2], *dt_out[2];
            int w;
            for (w = 0; w < 2; w++) {
                backend *be = w ? gpu : &cpu_be;
                const void *td = be_upload(be, table, nbytes(dt, rows * width));
                const void *dyd = be_upload(be, dy, nbytes(dt, n * width));
                const int32_t *idd =
                    (const int32_t *)be_upload(be, ids, sizeof(int32_t) * (size_t)n);
                void *yd = be_poisoned(be, nbytes(dt, n * width));
                float *gd = (float *)be_poisoned(be, sizeof(float) * (size_t)(rows * width));
                be->t->gather_rows(be->impl, dt, yd, td, rows, width, idd, n);
                be->t->scatter_add_rows(be->impl, dt, gd, rows, width, dyd, idd, n);
                y[w] = be_fetch(be, yd, nbytes(dt, n * width), "gather_rows");
                dt_out[w] = be_fetch(be, gd, sizeof(float) * (size_t)(rows * width),
                                     "scatter_add_rows");
                be_release(be);
            }
            CHECK(memcmp(y[0], y[1], nbytes(dt, n * width)) == 0,
                  "gather_rows %s (%lld, %lld) n %lld: element %lld differs (exact)",
                  mpt_dtype_name(dt), (long long)rows, (long long)width, (long long)n,
                  (long long)first_difference(y[1], y[0], n * width, mpt_dtype_size(dt)));
            CHECK(memcmp(dt_out[0], dt_out[1], sizeof(float) * (size_t)(rows * width)) == 0,
                  "scatter_add_rows %s (%lld, %lld) n %lld: element %lld differs (exact)",
                  mpt_dtype_name(dt), (long long)rows, (long long)width, (long long)n,
                  (long long)first_difference(dt_out[1], dt_out[0], rows * width, 4));
            for (w = 0; w < 2; w++) {
                free(y[w]);
                free(dt_out[w]);
            }
            free(table);
            free(dy);
            free(ids);
        }
    for (si = 0; si < 4; si++) { /* uint8 rows (a resident dataset's images) */
        int64_t rows = shapes[si][0], width = shapes[si][1], n = shapes[si][2], i;
        uint8_t *table = (uint8_t *)malloc((size_t)(rows * width)), *y[2];
        int32_t *ids = random_ids(n, rows);
        int w;
        for (i = 0; i < rows * width; i++) table[i] = (uint8_t)test_uniform(0, 256);
        for (w = 0; w < 2; w++) {
            backend *be = w ? gpu : &cpu_be;
            const void *td = be_upload(be, table, (size_t)(rows * width));
            const int32_t *idd = (const int32_t *)be_upload(be, ids, sizeof(int32_t) * (size_t)n);
            void *yd = be_poisoned(be, (size_t)(n * width));
            be->t->gather_rows(be->impl, MPT_UINT8, yd, td, rows, width, idd, n);
            y[w] = (uint8_t *)be_fetch(be, yd, (size_t)(n * width), "gather_rows");
            be_release(be);
        }
        CHECK(memcmp(y[0], y[1], (size_t)(n * width)) == 0,
              "gather_rows uint8 (%lld, %lld) n %lld: byte %lld differs (exact)", (long long)rows,
              (long long)width, (long long)n, (long long)first_difference(y[1], y[0], n * width, 1));
        free(y[0]);
        free(y[1]);
        free(table);
        free(ids);
    }
}

/* ---- losses ------------------------------------------------------------------------------- */

static const char *loss_name(mpt_loss_type type) {
    switch (type) {
    case MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY: return "sparse categorical crossentropy";
    case MPT_LOSS_CATEGORICAL_CROSSENTROPY: return "categorical crossentropy";
    case MPT_LOSS_BINARY_CROSSENTROPY: return "binary crossentropy";
    default: return "mean squared error";
    }
}

/* pred for a loss: logits, probability rows (softmax, some exactly at the
   clip bounds for binary crossentropy), or plain values for MSE. */
static void *loss_pred(mpt_loss_type type, int from_logits, mpt_dtype dt, int64_t rows, int64_t K) {
    void *p = malloc(nbytes(dt, rows * K));
    double *row = (double *)malloc(sizeof(double) * (size_t)K);
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        for (c = 0; c < K; c++) row[c] = test_uniform(-4, 4);
        if (!from_logits && type != MPT_LOSS_MEAN_SQUARED_ERROR) {
            if (type == MPT_LOSS_BINARY_CROSSENTROPY)
                for (c = 0; c < K; c++) row[c] = c % 11 == 3 ? (double)(r % 2) : 1 / (1 + exp(-row[c]));
            else
                ref_softmax_rows(row, 1, K);
        }
        for (c = 0; c < K; c++) store_value(dt, p, r * K + c, row[c]);
    }
    free(row);
    return p;
}

/* Targets: class ids (sparse), soft probability rows (categorical), 0..1
   (binary) or values (MSE); float32 except the ids. */
static void *loss_target(mpt_loss_type type, int64_t rows, int64_t K) {
    int64_t r, c;
    if (type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY) {
        int32_t *t = (int32_t *)malloc(sizeof(int32_t) * (size_t)rows);
        for (r = 0; r < rows; r++) t[r] = (int32_t)test_randint(0, (int)K - 1);
        return t;
    } else {
        float *t = (float *)malloc(sizeof(float) * (size_t)(rows * K));
        for (r = 0; r < rows; r++) {
            double sum = 0;
            for (c = 0; c < K; c++) sum += (t[r * K + c] = (float)test_uniform(0, 1));
            if (type == MPT_LOSS_CATEGORICAL_CROSSENTROPY)
                for (c = 0; c < K; c++) t[r * K + c] = (float)(t[r * K + c] / sum);
            if (type == MPT_LOSS_MEAN_SQUARED_ERROR)
                for (c = 0; c < K; c++) t[r * K + c] = 4 * t[r * K + c] - 2;
        }
        return t;
    }
}

static void test_loss(void) {
    /* rows, K, rows per sample: the last two are outputs of several
       positions per sample ((8, 3, 4, 7) and (10, 6, 1) batches) */
    static const int64_t shapes[6][3] = {{1, 2, 1},   {7, 10, 1},  {128, 10, 1},
                                         {1000, 33, 1}, {96, 7, 12}, {60, 1, 6}};
    backend *gpu = &gpu_be[GPU_AUTO];
    int type, logits, di, si;
    unsigned v = 0;
    for (type = 1; type < MPT_LOSS_COUNT_; type++)
        for (logits = 0; logits < 2; logits++)
            for (di = 0; di < 3; di++)
                for (si = 0; si < 6; si++, v++) {
                    mpt_loss_type lt = (mpt_loss_type)type;
                    mpt_dtype dt = float_dtypes[di];
                    int64_t rows = shapes[si][0], K = shapes[si][1], per = shapes[si][2];
                    int sparse = lt == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
                    int grad = v % 3; /* 0: its own buffer, 1: none, 2: into pred */
                    mpt_dtype tdt = sparse ? MPT_INT32 : MPT_FLOAT32;
                    size_t tb = sparse ? nbytes(MPT_INT32, rows) : nbytes(MPT_FLOAT32, rows * K);
                    void *pred, *target, *dpred[2] = {NULL, NULL};
                    /* class weights (fit's class_weight) on every fourth case:
                       K of them, 2 for one unit */
                    float weights[40], samples_w[1000];
                    int weighted = v % 4 == 3 && lt != MPT_LOSS_MEAN_SQUARED_ERROR;
                    /* sample weights and the weighted metrics on every
                       third case (with class weights on some of them) */
                    int sample_weighted = v % 3 == 1;
                    mpt_step_state st, *res[2];
                    /* r2_score's and auc's records, filled before: the batch adds */
                    const int64_t record = mpt__metric_record_count(K);
                    double *sums_before, *sums[2] = {NULL, NULL};
                    char what[160];
                    int w;
                    int64_t i;
                    if (logits && lt == MPT_LOSS_MEAN_SQUARED_ERROR) continue;
                    sums_before = (double *)malloc(sizeof(double) * (size_t)record);
                    for (i = 0; i < record; i++) sums_before[i] = (double)(i % 5);
                    pred = loss_pred(lt, logits, dt, rows, K);
                    target = loss_target(lt, rows, K);
                    for (w = 0; w < 40; w++) weights[w] = (float)test_uniform(0, 3);
                    for (w = 0; w < 1000; w++) samples_w[w] = (float)((w * 7) % 11) * 0.25f;
                    memset(&st, 0, sizeof st);
                    st.loss_sum = 5; /* the batch adds to what is there */
                    st.correct = 3;
                    st.top_k = 4;
                    st.samples = 10;
                    st.loss_scale = 1024;
                    st.learning_rate = 0.001f;
                    for (w = 0; w < 2; w++) {
                        backend *b = w ? gpu : &cpu_be;
                        mpt_loss_args a;
                        memset(&a, 0, sizeof a);
                        a.type = lt;
                        a.from_logits = logits;
                        a.pred_dtype = dt;
                        a.pred = be_upload(b, pred, nbytes(dt, rows * K));
                        a.target_dtype = tdt;
                        a.target = be_upload(b, target, tb);
                        a.dpred = grad == 0 ? be_poisoned(b, nbytes(dt, rows * K))
                                  : grad == 2 ? (void *)a.pred : NULL;
                        a.rows = rows;
                        a.K = K;
                        a.rows_per_sample = per;
                        a.metrics = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K;
                        if (lt == MPT_LOSS_MEAN_SQUARED_ERROR) /* a regression's errors too */
                            a.metrics |= MPT_METRIC_MEAN_ABSOLUTE_ERROR |
                                         MPT_METRIC_MEAN_ABSOLUTE_PERCENTAGE_ERROR;
                        if (lt == MPT_LOSS_MEAN_SQUARED_ERROR || lt == MPT_LOSS_BINARY_CROSSENTROPY)
                            a.metrics |= MPT_METRIC_PRECISION | MPT_METRIC_RECALL | MPT_METRIC_AUC;
                        if (lt == MPT_LOSS_MEAN_SQUARED_ERROR) a.metrics |= MPT_METRIC_R2_SCORE;
                        if (a.metrics & (MPT_METRIC_R2_SCORE | MPT_METRIC_AUC)) {
                            a.metric_sums = (double *)be_upload(b, sums_before,
                                                                sizeof(double) * (size_t)record);
                            a.metric_parts = (double *)be_poisoned(
                                b, sizeof(double) * (size_t)(record * MPT__METRIC_PARTS));
                        }
                        a.top_k = 5;
                        a.scale_by_loss_scale = (int)(v % 2);
                        a.state = (mpt_step_state *)be_upload(b, &st, sizeof st);
                        if (weighted)
                            a.class_weight = (const float *)be_upload(
                                b, weights, sizeof(float) * (size_t)(K > 1 ? K : 2));
                        if (sample_weighted) {
                            a.sample_weight = (const float *)be_upload(
                                b, samples_w, sizeof(float) * (size_t)(rows / per));
                            a.weighted_metrics = a.metrics;
                        }
                        b->t->loss(b->impl, &a);
                        res[w] = (mpt_step_state *)be_fetch(b, a.state, sizeof st, "loss");
                        if (a.metric_sums)
                            sums[w] = (double *)be_fetch(b, a.metric_sums,
                                                         sizeof(double) * (size_t)record, "loss");
                        if (a.dpred) dpred[w] = be_fetch(b, a.dpred, nbytes(dt, rows * K), "loss");
                        be_release(b);
                    }
                    snprintf(what, sizeof what, "loss %s%s%s%s %s %lldx%lld (%lld a sample) dpred %s",
                             loss_name(lt), logits ? " from logits" : "",
                             weighted ? " class-weighted" : "",
                             sample_weighted ? " sample-weighted" : "", mpt_dtype_name(dt),
                             (long long)rows, (long long)K, (long long)per,
                             grad == 0 ? "apart" : grad == 1 ? "none" : "in pred");
                    CHECK(fabs(res[1]->loss_sum - res[0]->loss_sum) <= 1e-5 * fabs(res[0]->loss_sum),
                          "%s: loss_sum GPU %.9g, CPU %.9g (1e-5 relative)", what,
                          res[1]->loss_sum, res[0]->loss_sum);
                    CHECK(res[1]->samples == res[0]->samples && res[1]->correct == res[0]->correct &&
                              res[1]->top_k == res[0]->top_k,
                          "%s: samples/correct/top_k GPU %g/%g/%g, CPU %g/%g/%g (exact)", what,
                          res[1]->samples, res[1]->correct, res[1]->top_k, res[0]->samples,
                          res[0]->correct, res[0]->top_k);
                    /* sums of doubles in another order: 1e-12 relative */
                    CHECK(fabs(res[1]->abs_error - res[0]->abs_error) <=
                                  1e-12 * fabs(res[0]->abs_error) &&
                              fabs(res[1]->squared_error - res[0]->squared_error) <=
                                  1e-12 * fabs(res[0]->squared_error) &&
                              fabs(res[1]->percent_error - res[0]->percent_error) <=
                                  1e-12 * fabs(res[0]->percent_error),
                          "%s: errors GPU %.17g/%.17g/%.17g, CPU %.17g/%.17g/%.17g", what,
                          res[1]->abs_error, res[1]->squared_error, res[1]->percent_error,
                          res[0]->abs_error, res[0]->squared_error, res[0]->percent_error);
                    CHECK((lt == MPT_LOSS_MEAN_SQUARED_ERROR) == (res[0]->abs_error > 0),
                          "%s: CPU abs_error %g", what, res[0]->abs_error);
                    CHECK(res[1]->true_positives == res[0]->true_positives &&
                              res[1]->false_positives == res[0]->false_positives &&
                              res[1]->false_negatives == res[0]->false_negatives,
                          "%s: TP/FP/FN GPU %g/%g/%g, CPU %g/%g/%g (exact)", what,
                          res[1]->true_positives, res[1]->false_positives,
                          res[1]->false_negatives, res[0]->true_positives,
                          res[0]->false_positives, res[0]->false_negatives);
                    /* the weighted tallies: sums of doubles in another order */
#define WEIGHTED_CLOSE(field)                                                         \
    CHECK(fabs(res[1]->field - res[0]->field) <= 1e-12 * fabs(res[0]->field),         \
          "%s: " #field " GPU %.17g, CPU %.17g", what, res[1]->field, res[0]->field)
                    WEIGHTED_CLOSE(weight_sum);
                    WEIGHTED_CLOSE(weighted_correct);
                    WEIGHTED_CLOSE(weighted_top_k);
                    WEIGHTED_CLOSE(weighted_abs_error);
                    WEIGHTED_CLOSE(weighted_percent_error);
                    WEIGHTED_CLOSE(weighted_true_positives);
                    WEIGHTED_CLOSE(weighted_false_positives);
                    WEIGHTED_CLOSE(weighted_false_negatives);
#undef WEIGHTED_CLOSE
                    CHECK(!sample_weighted || res[0]->weight_sum > 0, "%s: no weight tallied",
                          what);
                    /* r2_score's and auc's sums: the CPU's in its order (a
                       sigmoid's last bit may differ, a bucket hardly ever) */
                    for (i = 0; sums[0] && i < record; i++)
                        if (!(fabs(sums[1][i] - sums[0][i]) <= 1e-12 * fabs(sums[0][i]))) {
                            CHECK(0, "%s: metric sum %lld GPU %.17g, CPU %.17g", what,
                                  (long long)i, sums[1][i], sums[0][i]);
                            break;
                        }
                    CHECK(!sums[0] || sums[0][0] > 0, "%s: no rows counted for auc/r2_score",
                          what);
                    free(sums[0]);
                    free(sums[1]);
                    free(sums_before);
                    if (dpred[0]) {
                        double err = rel_error(dt, dpred[1], dt, dpred[0], rows * K);
                        CHECK(err <= tolerance(dt), "%s: dpred relative error %.3g > %g", what, err,
                              tolerance(dt));
                    }
                    free(res[0]);
                    free(res[1]);
                    free(dpred[0]);
                    free(dpred[1]);
                    free(pred);
                    free(target);
                }
}

/* ---- the optimizer: grad_stats + update --------------------------------------------------- */

#define N_PARAMS 5

typedef struct opt_case {
    const char *name;
    mpt_optimizer_type type;
    float momentum;
    int nesterov;
    float weight_decay, l2, clip;
    int cosine; /* a cosine schedule with warm-up */
    int overflow; /* an inf among the gradients: nothing may change */
    int accumulate; /* gradient_accumulation_steps N: N steps from a sum
                       holding one batch, so that accumulating steps, the
                       applying one and the next cycle's first all run */
    int exclude;    /* tensors 1 and 3 excluded from weight decay (no_decay) */
} opt_case;

/* exclude_from_weight_decay's flags as a model passes them: tensors 1 and
   3 undecayed (a float16 one and the bfloat16 one, both vector paths). */
static const unsigned char opt_no_decay[N_PARAMS] = {0, 1, 0, 1, 0};

/* Everything an update reads and writes, on the host. */
typedef struct opt_host {
    int64_t count[N_PARAMS];
    mpt_dtype dtype[N_PARAMS];
    float *value[N_PARAMS], *grad[N_PARAMS], *slot0[N_PARAMS], *slot1[N_PARAMS];
    void *compute[N_PARAMS]; /* the half copies (float32 parameters have none) */
    float *accum[N_PARAMS];  /* gradient accumulation's sums; NULL: none */
    mpt_step_state state;
} opt_host;

static mpt_optimizer_desc opt_desc(const opt_case *oc) {
    mpt_optimizer_desc d;
    memset(&d, 0, sizeof d);
    d.type = oc->type;
    d.learning_rate = oc->type == MPT_OPTIMIZER_SGD ? 0.01f : 0.001f;
    d.momentum = oc->momentum;
    d.nesterov = oc->nesterov;
    d.beta_1 = 0.9f;
    d.beta_2 = 0.999f;
    d.epsilon = 1e-7f;
    d.weight_decay = oc->weight_decay;
    d.l2 = oc->l2;
    d.clip_global_norm = oc->clip;
    d.gradient_accumulation_steps = oc->accumulate;
    if (oc->cosine) {
        d.schedule.type = MPT_LR_COSINE_DECAY;
        d.schedule.decay_steps = 10;
        d.schedule.alpha = 0.1f;
        d.schedule.warmup_steps = 3;
    }
    return d;
}

/* Runs two steps (grad_stats, update) on a backend and downloads every
   buffer into *out (which starts as a copy of the inputs' shape). */
static void opt_run(backend *b, const opt_case *oc, const opt_host *in, opt_host *out) {
    float *value[N_PARAMS], *slot0[N_PARAMS], *slot1[N_PARAMS], *accum[N_PARAMS];
    const float *grad[N_PARAMS];
    void *compute[N_PARAMS];
    mpt_update_args u;
    mpt_step_state *st;
    int i, step, slots = oc->type == MPT_OPTIMIZER_SGD ? (oc->momentum != 0) : 2;
    int steps = oc->accumulate > 1 ? oc->accumulate : 2;
    for (i = 0; i < N_PARAMS; i++) {
        size_t fb = nbytes(MPT_FLOAT32, in->count[i]);
        value[i] = (float *)be_upload(b, in->value[i], fb);
        grad[i] = (const float *)be_upload(b, in->grad[i], fb);
        slot0[i] = slots >= 1 ? (float *)be_upload(b, in->slot0[i], fb) : NULL;
        slot1[i] = slots >= 2 ? (float *)be_upload(b, in->slot1[i], fb) : NULL;
        compute[i] = in->dtype[i] == MPT_FLOAT32
                         ? (void *)value[i]
                         : be_upload(b, in->compute[i], nbytes(in->dtype[i], in->count[i]));
        accum[i] = oc->accumulate > 1 ? (float *)be_upload(b, in->accum[i], fb) : NULL;
    }
    st = (mpt_step_state *)be_upload(b, &in->state, sizeof in->state);
    memset(&u, 0, sizeof u);
    u.n = N_PARAMS;
    u.value = value;
    u.grad = grad;
    u.slot0 = slot0; /* as a model passes them: NULL entries where there is no slot */
    u.slot1 = slot1;
    u.compute = compute;
    u.compute_dtype = in->dtype;
    u.count = in->count;
    u.optimizer = opt_desc(oc);
    u.state = st;
    u.accum = oc->accumulate > 1 ? accum : NULL;
    u.no_decay = oc->exclude ? opt_no_decay : NULL;
    for (step = 0; step < steps; step++) {
        b->t->grad_stats(b->impl, &u);
        b->t->update(b->impl, &u);
    }
    *out = *in;
    for (i = 0; i < N_PARAMS; i++) {
        size_t fb = nbytes(MPT_FLOAT32, in->count[i]);
        out->value[i] = (float *)be_fetch(b, value[i], fb, "update");
        out->grad[i] = NULL;
        out->slot0[i] = slots >= 1 ? (float *)be_fetch(b, slot0[i], fb, "update") : NULL;
        out->slot1[i] = slots >= 2 ? (float *)be_fetch(b, slot1[i], fb, "update") : NULL;
        out->compute[i] = in->dtype[i] == MPT_FLOAT32
                              ? NULL
                              : be_fetch(b, compute[i], nbytes(in->dtype[i], in->count[i]), "update");
        out->accum[i] = accum[i] ? (float *)be_fetch(b, accum[i], fb, "update") : NULL;
    }
    {
        mpt_step_state *s = (mpt_step_state *)be_fetch(b, st, sizeof *st, "update");
        out->state = *s;
        free(s);
    }
    be_release(b);
}

static void opt_host_free(opt_host *h) {
    int i;
    for (i = 0; i < N_PARAMS; i++) {
        free(h->value[i]);
        free(h->grad[i]);
        free(h->slot0[i]);
        free(h->slot1[i]);
        free(h->compute[i]);
        free(h->accum[i]);
    }
}

static void test_update(void) {
    static const opt_case cases[13] = {
        {"sgd", MPT_OPTIMIZER_SGD, 0, 0, 0, 0, 0, 0, 0, 0, 0},
        {"sgd momentum, weight decay", MPT_OPTIMIZER_SGD, 0.9f, 0, 0.01f, 0, 1.0f, 0, 0, 0, 0},
        {"sgd nesterov, l2", MPT_OPTIMIZER_SGD, 0.9f, 1, 0, 0.001f, 0, 0, 0, 0, 0},
        {"adam", MPT_OPTIMIZER_ADAM, 0, 0, 0, 0, 0, 0, 0, 0, 0},
        {"adam clipped, cosine schedule", MPT_OPTIMIZER_ADAM, 0, 0, 0, 0.0005f, 0.5f, 1, 0, 0, 0},
        {"adamw clipped", MPT_OPTIMIZER_ADAMW, 0, 0, 0.004f, 0, 2.0f, 0, 0, 0, 0},
        {"adam, an inf gradient", MPT_OPTIMIZER_ADAM, 0, 0, 0, 0, 1.0f, 0, 1, 0, 0},
        {"sgd momentum, a NaN gradient", MPT_OPTIMIZER_SGD, 0.9f, 0, 0, 0, 0, 0, 2, 0, 0},
        {"adam clipped, cosine, accumulating 2", MPT_OPTIMIZER_ADAM, 0, 0, 0, 0, 0.5f, 1, 0, 2, 0},
        {"sgd nesterov, decay, accumulating 3", MPT_OPTIMIZER_SGD, 0.9f, 1, 0.01f, 0, 0, 0, 0, 3, 0},
        {"adamw accumulating 2, an inf gradient", MPT_OPTIMIZER_ADAMW, 0, 0, 0.004f, 0, 0, 0, 1,
         2, 0},
        /* weight decay large enough that a tensor decayed where it should
           not be (or not where it should) is far outside the tolerance */
        {"adamw, two tensors excluded from decay", MPT_OPTIMIZER_ADAMW, 0, 0, 0.5f, 0, 0, 0, 0, 0,
         1},
        {"sgd momentum, decay, two tensors excluded, accumulating 2", MPT_OPTIMIZER_SGD, 0.9f, 0,
         0.5f, 0, 0, 0, 0, 2, 1}};
    static const int64_t counts[N_PARAMS] = {1, 7, 1000, 4099, 65536 + 3};
    static const mpt_dtype dtypes[N_PARAMS] = {MPT_FLOAT32, MPT_FLOAT16, MPT_FLOAT16,
                                               MPT_BFLOAT16, MPT_FLOAT16};
    backend *gpu = &gpu_be[GPU_AUTO];
    int ci, i;
    for (ci = 0; ci < 13; ci++) {
        const opt_case *oc = &cases[ci];
        opt_host in, cpu, got;
        int64_t total = 0, differing = 0, worst = 0;
        memset(&in, 0, sizeof in);
        for (i = 0; i < N_PARAMS; i++) {
            in.count[i] = counts[i];
            in.dtype[i] = dtypes[i];
            in.value[i] = (float *)random_values(MPT_FLOAT32, counts[i], -1, 1);
            /* gradients times the loss scale (128) */
            in.grad[i] = (float *)random_values(MPT_FLOAT32, counts[i], -128, 128);
            in.slot0[i] = (float *)random_values(MPT_FLOAT32, counts[i], -0.1, 0.1);
            in.slot1[i] = (float *)random_values(MPT_FLOAT32, counts[i], 0, 0.01);
            in.compute[i] = NULL;
            if (dtypes[i] != MPT_FLOAT32) { /* poisoned: an update rewrites all of it */
                in.compute[i] = malloc(nbytes(dtypes[i], counts[i]));
                memset(in.compute[i], 0xFF, nbytes(dtypes[i], counts[i]));
            }
            if (oc->overflow && i == 3) in.grad[i][counts[i] / 2] = oc->overflow == 1 ? INFINITY : NAN;
            /* one batch's gradients already summed, unscaled */
            in.accum[i] = oc->accumulate > 1
                              ? (float *)random_values(MPT_FLOAT32, counts[i], -1, 1)
                              : NULL;
        }
        in.state.accumulated_steps = oc->accumulate > 1 ? 1 : 0;
        in.state.learning_rate = oc->type == MPT_OPTIMIZER_SGD ? 0.01f : 0.001f;
        in.state.loss_scale = 128;
        in.state.optimizer_steps = 5;
        in.state.step = 7;
        in.state.finite = 1;
        opt_run(&cpu_be, oc, &in, &cpu);
        opt_run(gpu, oc, &in, &got);
        CHECK(got.state.finite == cpu.state.finite && cpu.state.finite == !oc->overflow,
              "%s: finite GPU %d, CPU %d", oc->name, (int)got.state.finite, (int)cpu.state.finite);
        CHECK(got.state.optimizer_steps == cpu.state.optimizer_steps,
              "%s: optimizer_steps GPU %lld, CPU %lld", oc->name,
              (long long)got.state.optimizer_steps, (long long)cpu.state.optimizer_steps);
        if (!oc->overflow)
            CHECK(fabs(got.state.sum_squares - cpu.state.sum_squares) <=
                      1e-12 * cpu.state.sum_squares,
                  "%s: sum_squares GPU %.17g, CPU %.17g (1e-12 relative)", oc->name,
                  got.state.sum_squares, cpu.state.sum_squares);
        /* N steps from one batch in the sum: one update, then one in the
           sum again; skipped steps leave the one they found */
        CHECK(got.state.accumulated_steps == cpu.state.accumulated_steps &&
                  cpu.state.accumulated_steps == (oc->accumulate > 1 ? 1 : 0),
              "%s: accumulated_steps GPU %lld, CPU %lld", oc->name,
              (long long)got.state.accumulated_steps, (long long)cpu.state.accumulated_steps);
        CHECK(fabs(got.state.accumulated_sum_squares - cpu.state.accumulated_sum_squares) <=
                  1e-12 * cpu.state.accumulated_sum_squares,
              "%s: accumulated_sum_squares GPU %.17g, CPU %.17g", oc->name,
              got.state.accumulated_sum_squares, cpu.state.accumulated_sum_squares);
        for (i = 0; i < N_PARAMS; i++) {
            char what[160];
            int64_t n = counts[i], ulps;
            snprintf(what, sizeof what, "%s: parameter %d (%lld, %s)", oc->name, i, (long long)n,
                     mpt_dtype_name(dtypes[i]));
            if (oc->overflow) { /* a skipped step changes nothing at all */
                CHECK(!memcmp(got.value[i], in.value[i], nbytes(MPT_FLOAT32, n)) &&
                          (!got.slot0[i] || !memcmp(got.slot0[i], in.slot0[i], nbytes(MPT_FLOAT32, n))) &&
                          (!got.slot1[i] || !memcmp(got.slot1[i], in.slot1[i], nbytes(MPT_FLOAT32, n))) &&
                          (!got.compute[i] || !memcmp(got.compute[i], in.compute[i], nbytes(dtypes[i], n))) &&
                          (!got.accum[i] || !memcmp(got.accum[i], in.accum[i], nbytes(MPT_FLOAT32, n))),
                      "%s: changed by a step with non-finite gradients", what);
                continue;
            }
            if (got.accum[i]) { /* the sums: the same rule, the same bits */
                int64_t sum_ulps;
                CHECK(bit_differences(got.accum[i], cpu.accum[i], n, &sum_ulps) == 0,
                      "%s: the accumulated sums differ from the CPU's (%lld ulps)", what,
                      (long long)sum_ulps);
            }
            check_close(what, MPT_FLOAT32, got.value[i], cpu.value[i], n, 1e-5);
            if (got.slot0[i]) check_close(what, MPT_FLOAT32, got.slot0[i], cpu.slot0[i], n, 1e-5);
            if (got.slot1[i]) check_close(what, MPT_FLOAT32, got.slot1[i], cpu.slot1[i], n, 1e-5);
            if (got.compute[i])
                check_close(what, dtypes[i], got.compute[i], cpu.compute[i], n, tolerance(dtypes[i]));
            differing += bit_differences(got.value[i], cpu.value[i], n, &ulps);
            worst = ulps > worst ? ulps : worst;
            total += n;
        }
        if (!oc->overflow) { /* informational: without FMA contraction the bits agree */
            if (differing == 0)
                printf("# update %s: every master weight bit-identical to the CPU's\n", oc->name);
            else
                printf("# update %s: %lld of %lld master weights differ from the CPU's "
                       "(at most %lld ulps)\n", oc->name, (long long)differing, (long long)total,
                       (long long)worst);
        }
        opt_host_free(&in);
        opt_host_free(&cpu);
        opt_host_free(&got);
    }
}

/* The multi-tensor launches: 111 parameter tensors of odd sizes (more than
   one launch's table holds), mixed dtypes, packed back to back in one
   allocation per buffer kind, so that most are not 16-byte aligned and
   aligned and unaligned tensors share a launch. Two steps on the GPU
   against the CPU (the same tolerances as above), and the GPU twice:
   the same bits, Σ g² included. */
#define MANY_PARAMS 111

typedef struct many_run {
    float *value, *slot0, *slot1; /* every tensor, back to back */
    unsigned char *compute;
    mpt_step_state state;
} many_run;

static void many_run_free(many_run *r) {
    free(r->value);
    free(r->slot0);
    free(r->slot1);
    free(r->compute);
}

static void many_step(backend *b, const opt_case *oc, const int64_t *count, const mpt_dtype *dt,
                      const int64_t *offset, const size_t *coffset, int64_t total,
                      size_t compute_bytes, const many_run *in, const float *grad, many_run *out) {
    float *value[MANY_PARAMS], *slot0[MANY_PARAMS], *slot1[MANY_PARAMS];
    const float *gradp[MANY_PARAMS];
    void *compute[MANY_PARAMS];
    size_t fb = nbytes(MPT_FLOAT32, total);
    float *v = (float *)be_upload(b, in->value, fb), *g = (float *)be_upload(b, grad, fb);
    float *s0 = (float *)be_upload(b, in->slot0, fb), *s1 = (float *)be_upload(b, in->slot1, fb);
    unsigned char *c = (unsigned char *)be_upload(b, in->compute, compute_bytes);
    mpt_step_state *st = (mpt_step_state *)be_upload(b, &in->state, sizeof in->state);
    int slots = oc->type == MPT_OPTIMIZER_SGD ? (oc->momentum != 0) : 2;
    mpt_update_args u;
    int i, step;
    for (i = 0; i < MANY_PARAMS; i++) {
        value[i] = v + offset[i];
        gradp[i] = g + offset[i];
        slot0[i] = slots >= 1 ? s0 + offset[i] : NULL;
        slot1[i] = slots >= 2 ? s1 + offset[i] : NULL;
        compute[i] = dt[i] == MPT_FLOAT32 ? (void *)value[i] : (void *)(c + coffset[i]);
    }
    memset(&u, 0, sizeof u);
    u.n = MANY_PARAMS;
    u.value = value;
    u.grad = gradp;
    u.slot0 = slot0;
    u.slot1 = slot1;
    u.compute = compute;
    u.compute_dtype = dt;
    u.count = count;
    u.optimizer = opt_desc(oc);
    u.state = st;
    for (step = 0; step < 2; step++) {
        b->t->grad_stats(b->impl, &u);
        b->t->update(b->impl, &u);
    }
    out->value = (float *)be_fetch(b, v, fb, "update");
    out->slot0 = (float *)be_fetch(b, s0, fb, "update");
    out->slot1 = (float *)be_fetch(b, s1, fb, "update");
    out->compute = (unsigned char *)be_fetch(b, c, compute_bytes, "update");
    {
        mpt_step_state *s = (mpt_step_state *)be_fetch(b, st, sizeof *st, "update");
        out->state = *s;
        free(s);
    }
    be_release(b);
}

static void test_update_many_tensors(void) {
    static const opt_case cases[3] = {
        {"adamw clipped", MPT_OPTIMIZER_ADAMW, 0, 0, 0.004f, 0, 2.0f, 0, 0, 0, 0},
        {"sgd nesterov, l2", MPT_OPTIMIZER_SGD, 0.9f, 1, 0, 0.001f, 0, 0, 0, 0, 0},
        {"sgd", MPT_OPTIMIZER_SGD, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
    static const mpt_dtype kinds[3] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int64_t count[MANY_PARAMS], offset[MANY_PARAMS], total = 0;
    size_t coffset[MANY_PARAMS], compute_bytes = 0;
    mpt_dtype dt[MANY_PARAMS];
    backend *gpu = &gpu_be[GPU_AUTO];
    int ci, i;
    for (i = 0; i < MANY_PARAMS; i++) {
        /* odd sizes, a few of them long enough for several norm blocks */
        count[i] = i % 37 == 5 ? 2 * test_randint(20000, 70000) + 1 : 2 * test_randint(0, 1500) + 1;
        dt[i] = kinds[test_randint(0, 2)];
        offset[i] = total;
        total += count[i];
        coffset[i] = compute_bytes;
        if (dt[i] != MPT_FLOAT32) compute_bytes += nbytes(dt[i], count[i]);
    }
    for (ci = 0; ci < 3; ci++) {
        const opt_case *oc = &cases[ci];
        many_run in, cpu, got, again;
        float *grad = (float *)random_values(MPT_FLOAT32, total, -128, 128);
        const char *differs;
        in.value = (float *)random_values(MPT_FLOAT32, total, -1, 1);
        in.slot0 = (float *)random_values(MPT_FLOAT32, total, -0.1, 0.1);
        in.slot1 = (float *)random_values(MPT_FLOAT32, total, 0, 0.01);
        in.compute = (unsigned char *)malloc(compute_bytes);
        memset(in.compute, 0xFF, compute_bytes); /* poisoned: an update rewrites all of it */
        memset(&in.state, 0, sizeof in.state);
        in.state.learning_rate = oc->type == MPT_OPTIMIZER_SGD ? 0.01f : 0.001f;
        in.state.loss_scale = 128;
        in.state.optimizer_steps = 5;
        in.state.step = 7;
        in.state.finite = 1;
        many_step(&cpu_be, oc, count, dt, offset, coffset, total, compute_bytes, &in, grad, &cpu);
        many_step(gpu, oc, count, dt, offset, coffset, total, compute_bytes, &in, grad, &got);
        many_step(gpu, oc, count, dt, offset, coffset, total, compute_bytes, &in, grad, &again);
        CHECK(got.state.finite && cpu.state.finite, "%s: finite GPU %d, CPU %d", oc->name,
              (int)got.state.finite, (int)cpu.state.finite);
        CHECK(got.state.optimizer_steps == cpu.state.optimizer_steps,
              "%s: optimizer_steps GPU %lld, CPU %lld", oc->name,
              (long long)got.state.optimizer_steps, (long long)cpu.state.optimizer_steps);
        CHECK(fabs(got.state.sum_squares - cpu.state.sum_squares) <= 1e-12 * cpu.state.sum_squares,
              "%s: sum_squares GPU %.17g, CPU %.17g (1e-12 relative)", oc->name,
              got.state.sum_squares, cpu.state.sum_squares);
        for (i = 0; i < MANY_PARAMS && !test__current_failed; i++) {
            char what[160];
            int64_t n = count[i], o = offset[i];
            snprintf(what, sizeof what, "%s: tensor %d of %d (%lld, %s, offset %lld)", oc->name, i,
                     MANY_PARAMS, (long long)n, mpt_dtype_name(dt[i]), (long long)o);
            check_close(what, MPT_FLOAT32, got.value + o, cpu.value + o, n, 1e-5);
            check_close(what, MPT_FLOAT32, got.slot0 + o, cpu.slot0 + o, n, 1e-5);
            check_close(what, MPT_FLOAT32, got.slot1 + o, cpu.slot1 + o, n, 1e-5);
            if (dt[i] != MPT_FLOAT32)
                check_close(what, dt[i], got.compute + coffset[i], cpu.compute + coffset[i], n,
                            tolerance(dt[i]));
        }
        differs = memcmp(&got.state, &again.state, sizeof got.state) ? "the step state"
                  : memcmp(got.value, again.value, nbytes(MPT_FLOAT32, total))
                      ? "the master weights"
                      : NULL;
        CHECK(!differs, "%s: two GPU runs differ in %s", oc->name, differs);
        free(grad);
        many_run_free(&in);
        many_run_free(&cpu);
        many_run_free(&got);
        many_run_free(&again);
    }
}

/* ---- loss scaling ---------------------------------------------------------------------------- */

static void test_loss_scale_update(void) {
    /* mode, finite, scale, good_steps: growth, plain good step, backoff,
       the FLT_MIN floor, no growth to inf, fixed, none */
    static const struct {
        mpt_loss_scale_mode mode;
        int finite;
        float scale;
        int64_t good;
    } cases[9] = {{MPT_LOSS_SCALE_DYNAMIC, 1, 1024, 2},  {MPT_LOSS_SCALE_DYNAMIC, 1, 1024, 0},
                  {MPT_LOSS_SCALE_DYNAMIC, 0, 1024, 2},  {MPT_LOSS_SCALE_DYNAMIC, 0, 2e-38f, 1},
                  {MPT_LOSS_SCALE_DYNAMIC, 1, 3e38f, 2}, {MPT_LOSS_SCALE_FIXED, 1, 64, 2},
                  {MPT_LOSS_SCALE_FIXED, 0, 64, 2},      {MPT_LOSS_SCALE_NONE, 1, 1, 0},
                  {MPT_LOSS_SCALE_NONE, 0, 1, 0}};
    backend *gpu = &gpu_be[GPU_AUTO];
    int ci, w;
    for (ci = 0; ci < 9; ci++) {
        mpt_loss_scale_desc d;
        mpt_step_state st, *res[2];
        memset(&d, 0, sizeof d);
        d.mode = cases[ci].mode;
        d.initial_scale = 32768;
        d.growth_interval = 3;
        d.growth_factor = 2;
        d.backoff_factor = 0.5f;
        memset(&st, 0, sizeof st);
        st.loss_scale = cases[ci].scale;
        st.good_steps = cases[ci].good;
        st.finite = cases[ci].finite;
        st.step = 41;
        st.skipped_steps = 2;
        st.optimizer_steps = 39;
        st.learning_rate = 0.001f;
        for (w = 0; w < 2; w++) {
            backend *b = w ? gpu : &cpu_be;
            mpt_step_state *sd = (mpt_step_state *)be_upload(b, &st, sizeof st);
            b->t->loss_scale_update(b->impl, &d, sd);
            res[w] = (mpt_step_state *)be_fetch(b, sd, sizeof st, "loss_scale_update");
            be_release(b);
        }
        CHECK(!memcmp(res[0], res[1], sizeof st),
              "loss_scale_update case %d: GPU scale %g good %lld skipped %lld step %lld, CPU "
              "scale %g good %lld skipped %lld step %lld (exact)", ci, (double)res[1]->loss_scale,
              (long long)res[1]->good_steps, (long long)res[1]->skipped_steps,
              (long long)res[1]->step, (double)res[0]->loss_scale, (long long)res[0]->good_steps,
              (long long)res[0]->skipped_steps, (long long)res[0]->step);
        free(res[0]);
        free(res[1]);
    }
}

/* ---- CUDA graphs -------------------------------------------------------------------------------- */

/* convert (float32 -> float16), gemm (bias + relu, float32 C), softmax over
   C's rows: recorded once and replayed twice, against the same calls run
   directly, bit for bit. */
static void test_graph_capture(void) {
    enum { M = 96, N = 40, K = 72 };
    backend *b = &gpu_be[GPU_AUTO];
    float *a32 = (float *)random_values(MPT_FLOAT32, M * K, -1, 1);
    void *b16 = random_values(MPT_FLOAT16, K * N, -1, 1);
    float *bias = (float *)random_values(MPT_FLOAT32, N, -1, 1);
    float *ad = (float *)be_upload(b, a32, nbytes(MPT_FLOAT32, M * K));
    void *a16 = be_poisoned(b, nbytes(MPT_FLOAT16, M * K));
    float *c = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, M * N));
    void *direct, *graph = NULL;
    mpt_gemm_desc d;
    mpt_status s;
    int replay;
    CHECK(b->t->can_capture, "the CUDA backend says it cannot capture");
    memset(&d, 0, sizeof d);
    d.m = M;
    d.n = N;
    d.k = K;
    d.ab_dtype = MPT_FLOAT16;
    d.a = a16;
    d.lda = K;
    d.b = be_upload(b, b16, nbytes(MPT_FLOAT16, K * N));
    d.ldb = N;
    d.c = c;
    d.ldc = N;
    d.bias = (const float *)be_upload(b, bias, nbytes(MPT_FLOAT32, N));
    d.activation = MPT_ACT_RELU;
    if (b->t->gemm_plan) {
        s = b->t->gemm_plan(b->impl, &d, MPT_FLOAT32);
        CHECK(s == MPT_OK, "gemm_plan: %s", b->t->error(b->impl));
    }
    be_poison(b, c, nbytes(MPT_FLOAT32, M * N));
    b->t->convert(b->impl, MPT_FLOAT16, a16, MPT_FLOAT32, ad, M * K);
    b->t->gemm(b->impl, &d, MPT_FLOAT32);
    b->t->activation(b->impl, MPT_ACT_SOFTMAX, c, M, N);
    direct = be_fetch(b, c, nbytes(MPT_FLOAT32, M * N), "the direct run");
    be_poison(b, a16, nbytes(MPT_FLOAT16, M * K));
    be_poison(b, c, nbytes(MPT_FLOAT32, M * N));
    be_sync(b, "before capture");
    s = b->t->capture_begin(b->impl);
    CHECK(s == MPT_OK, "capture_begin: %s", b->t->error(b->impl));
    if (s == MPT_OK) {
        b->t->convert(b->impl, MPT_FLOAT16, a16, MPT_FLOAT32, ad, M * K);
        b->t->gemm(b->impl, &d, MPT_FLOAT32);
        b->t->activation(b->impl, MPT_ACT_SOFTMAX, c, M, N);
        s = b->t->capture_end(b->impl, &graph);
        CHECK(s == MPT_OK && graph, "capture_end: %s", b->t->error(b->impl));
    }
    for (replay = 0; s == MPT_OK && graph && replay < 2; replay++) {
        void *got;
        be_poison(b, a16, nbytes(MPT_FLOAT16, M * K));
        be_poison(b, c, nbytes(MPT_FLOAT32, M * N));
        s = b->t->replay(b->impl, graph);
        CHECK(s == MPT_OK, "replay: %s", b->t->error(b->impl));
        got = be_fetch(b, c, nbytes(MPT_FLOAT32, M * N), "replay");
        CHECK(!memcmp(got, direct, nbytes(MPT_FLOAT32, M * N)),
              "replay %d: element %lld differs from the direct run (exact)", replay + 1,
              (long long)first_difference(got, direct, M * N, 4));
        free(got);
    }
    if (graph) b->t->graph_free(b->impl, graph);
    be_release(b);
    free(direct);
    free(a32);
    free(b16);
    free(bias);
}

/* ---- the GEMM's tiles and split-K; the layout kernels' index paths ------------------------ */

/* Opens a CUDA context (the hand-written GEMM engine, or `engine` with
   open_backend_env_engine) with the environment variable `name` set to
   `value` while it opens (as it was afterwards). */
static int open_backend_env_engine(backend *b, const char *label, const char *name,
                                   const char *value, mpt_gemm_engine engine) {
    const char *was = getenv(name);
    char *saved = was ? strdup(was) : NULL;
    int ok;
    setenv(name, value, 1);
    ok = open_backend(b, label, 0, engine) && !strcmp(b->t->name, "cuda");
    if (saved) setenv(name, saved, 1);
    else unsetenv(name);
    free(saved);
    CHECK(ok, "opening a CUDA context with %s=%s", name, value);
    if (!ok && b->ctx) close_backend(b);
    return ok;
}

static int open_backend_with_env(backend *b, const char *label, const char *name,
                                 const char *value) {
    return open_backend_env_engine(b, label, name, value, MPT_GEMM_MPT);
}

/* ‖gpu − cpu‖ / ‖cpu‖ over C (the CPU's float32 rounded to C's dtype). */
static double gemm_error(const gemm_case *g, const gemm_inputs *in, const void *ref,
                         const void *got) {
    int64_t i, j, mn = g->m * g->n;
    double *r = (double *)malloc(sizeof(double) * (size_t)mn);
    double *o = (double *)malloc(sizeof(double) * (size_t)mn);
    double err;
    for (i = 0; i < g->m; i++)
        for (j = 0; j < g->n; j++) {
            r[i * g->n + j] = round_to(g->c_dtype, load_value(MPT_FLOAT32, ref, i * in->ldc + j));
            o[i * g->n + j] = load_value(g->c_dtype, got, i * in->ldc + j);
        }
    err = rel_err(o, r, mn);
    free(r);
    free(o);
    return err;
}

/* Issue 9 A4: the 128×128 four-stage tile. mpt__gemm_tile chooses it from
   a wave of its tiles on: 1536×1600 is 12·13 = 156 tiles for the H100's
   and H200's 132 SMs. Three contexts of the hand-written engine run the
   same cases: the tile chosen, and each tile forced by
   $MPT_CUDA_GEMM_TILE. Every transpose, float16 and bfloat16 operands,
   K = 200 (a tail of 8 past the last 32-deep step), C in each dtype and
   poisoned first, epilogues varied; against the CPU in float32 rounded to
   C's dtype, relative norm error <= 1e-2 as every 16-bit GEMM. */
static void test_gemm_tiles(void) {
    static const char *const tiles[3] = {"", "64", "128"};
    static const char *const labels[3] = {"cuda (gemm mpt, tile chosen)", "cuda (gemm mpt, tile 64)",
                                          "cuda (gemm mpt, tile 128)"};
    static const mpt_activation acts[5] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU,
                                           MPT_ACT_GELU_TANH, MPT_ACT_TANH};
    backend be[3];
    int t, tr, di, v = 0;
    memset(be, 0, sizeof be);
    for (t = 0; t < 3; t++)
        if (!open_backend_with_env(&be[t], labels[t], "MPT_CUDA_GEMM_TILE", tiles[t])) {
            while (t-- > 0) close_backend(&be[t]);
            return;
        }
    for (tr = 0; tr < 4; tr++)
        for (di = 1; di < 3; di++, v++) {
            gemm_case g;
            gemm_inputs in;
            void *ref;
            char what[160];
            memset(&g, 0, sizeof g);
            g.m = 1536, g.n = 1600, g.k = 200;
            g.ta = tr & 1, g.tb = tr >> 1;
            g.ab = float_dtypes[di];
            g.c_dtype = float_dtypes[v % 3];
            g.alpha = v % 2 ? 0.5f : 0.0f;
            g.bias = v % 3 != 1;
            g.act = acts[v % 5];
            in = gemm_make_inputs(&g);
            ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
            describe_gemm(what, sizeof what, &g);
            for (t = 0; t < 3; t++) {
                void *got = gemm_run(&be[t], &g, g.c_dtype, &in);
                double err = gemm_error(&g, &in, ref, got);
                CHECK(err <= 1e-2, "gemm %s on %s: relative error %.3g > 1e-2", what,
                      be[t].label, err);
                free(got);
            }
            free(ref);
            gemm_free_inputs(&in);
        }
    for (t = 0; t < 3; t++) close_backend(&be[t]);
}

/* A split GEMM recorded in a CUDA graph and replayed gives the direct
   run's bits (its workspace exists before the capture: an allocation
   inside one would fail it). */
static void gemm_split_captured(backend *b, const gemm_case *g, const gemm_inputs *in) {
    const size_t c_bytes = nbytes(g->c_dtype, g->m * in->ldc);
    mpt_gemm_desc d;
    void *direct, *got, *graph = NULL;
    mpt_status s;
    memset(&d, 0, sizeof d);
    d.trans_a = g->ta, d.trans_b = g->tb;
    d.m = g->m, d.n = g->n, d.k = g->k;
    d.ab_dtype = g->ab;
    d.a = be_upload(b, in->a, nbytes(g->ab, in->a_rows * in->lda));
    d.lda = in->lda;
    d.b = be_upload(b, in->b, nbytes(g->ab, in->b_rows * in->ldb));
    d.ldb = in->ldb;
    d.c = (float *)be_poisoned(b, c_bytes);
    d.ldc = in->ldc;
    d.alpha = g->alpha;
    d.activation = g->act;
    s = b->t->gemm_plan(b->impl, &d, g->c_dtype);
    CHECK(s == MPT_OK, "gemm_plan: %s", b->t->error(b->impl));
    b->t->gemm(b->impl, &d, g->c_dtype);
    direct = be_fetch(b, d.c, c_bytes, "the direct split gemm");
    be_poison(b, d.c, c_bytes);
    be_sync(b, "before capture");
    s = b->t->capture_begin(b->impl);
    CHECK(s == MPT_OK, "capture_begin: %s", b->t->error(b->impl));
    if (s == MPT_OK) {
        b->t->gemm(b->impl, &d, g->c_dtype);
        s = b->t->capture_end(b->impl, &graph);
        CHECK(s == MPT_OK && graph, "capture_end of a split gemm: %s", b->t->error(b->impl));
    }
    if (s == MPT_OK && graph) {
        s = b->t->replay(b->impl, graph);
        CHECK(s == MPT_OK, "replay: %s", b->t->error(b->impl));
        got = be_fetch(b, d.c, c_bytes, "the replayed split gemm");
        CHECK(!memcmp(got, direct, c_bytes), "replayed split gemm: element %lld differs (exact)",
              (long long)first_difference(got, direct, g->m * in->ldc,
                                          mpt_dtype_size(g->c_dtype)));
        free(got);
    }
    if (graph) b->t->graph_free(b->impl, graph);
    be_release(b);
    free(direct);
}

/* Issue 9 A6: split-K (mpt__gemm_split_k: these shapes' M×N tiles fill
   at most 5 of 132 SMs) on the hand-written engine. The convolution
   weight-gradient shapes (dkernel = colsᵀ·dz: A transposed, float32 C,
   beta 0 for the first batch chunk, 1 for the next), odd K tails, and the
   other epilogues (alpha, bias, activations, 16-bit C) which the second
   pass applies; float16, bfloat16 and float32 operands (the FP32 kernel
   splits too). Against the CPU in float32: 16-bit operands or C <= 1e-2;
   float32 <= 1e-4 (two summation orders over K up to 86528 terms differ
   by about 2^-24·√K ≈ 2e-5 of the norm). Run twice: the same bits. One
   case is also recorded in a CUDA graph and replayed. */
static void test_gemm_split_k(void) {
    static const struct {
        int64_t m, n, k;
        int ta, tb;
        mpt_dtype ab, c_dtype;
        float alpha, beta;
        int bias;
        mpt_activation act;
    } cases[] = {
        {9, 32, 86528, 1, 0, MPT_FLOAT16, MPT_FLOAT32, 0, 0, 0, MPT_ACT_NONE},
        {9, 32, 86528, 1, 0, MPT_BFLOAT16, MPT_FLOAT32, 0, 1, 0, MPT_ACT_NONE},
        {288, 32, 73728, 1, 0, MPT_FLOAT16, MPT_FLOAT32, 0, 0, 0, MPT_ACT_NONE},
        {288, 32, 73728 + 17, 1, 0, MPT_BFLOAT16, MPT_FLOAT32, 0, 1, 0, MPT_ACT_NONE},
        {288, 32, 40005, 0, 1, MPT_FLOAT16, MPT_FLOAT16, 0.5f, 0, 1, MPT_ACT_GELU},
        {100, 70, 30001, 1, 1, MPT_BFLOAT16, MPT_BFLOAT16, 0, 0, 1, MPT_ACT_RELU},
        {37, 64, 20031, 0, 0, MPT_FLOAT16, MPT_FLOAT32, -2.0f, 0.75f, 1, MPT_ACT_SIGMOID},
        {9, 32, 20007, 1, 0, MPT_FLOAT32, MPT_FLOAT32, 0, 1, 0, MPT_ACT_NONE},
        {288, 32, 16415, 0, 0, MPT_FLOAT32, MPT_FLOAT32, 0, 0.5f, 1, MPT_ACT_TANH},
    };
    backend *gpu = &gpu_be[GPU_MPT];
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gemm_case g;
        gemm_inputs in;
        void *ref, *got[2];
        double err, tol;
        char what[160];
        int run;
        memset(&g, 0, sizeof g);
        g.m = cases[i].m, g.n = cases[i].n, g.k = cases[i].k;
        g.ta = cases[i].ta, g.tb = cases[i].tb;
        g.ab = cases[i].ab, g.c_dtype = cases[i].c_dtype;
        g.alpha = cases[i].alpha, g.beta = cases[i].beta;
        g.bias = cases[i].bias, g.act = cases[i].act;
        tol = g.ab == MPT_FLOAT32 && g.c_dtype == MPT_FLOAT32 ? 1e-4 : 1e-2;
        in = gemm_make_inputs(&g);
        ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
        for (run = 0; run < 2; run++) got[run] = gemm_run(gpu, &g, g.c_dtype, &in);
        describe_gemm(what, sizeof what, &g);
        err = gemm_error(&g, &in, ref, got[0]);
        CHECK(err <= tol, "split gemm %s: relative error %.3g > %g", what, err, tol);
        CHECK(!memcmp(got[0], got[1], nbytes(g.c_dtype, g.m * in.ldc)),
              "split gemm %s: two runs differ at element %lld", what,
              (long long)first_difference(got[0], got[1], g.m * in.ldc,
                                          mpt_dtype_size(g.c_dtype)));
        if (i == 0) gemm_split_captured(gpu, &g, &in);
        free(ref);
        free(got[0]);
        free(got[1]);
        gemm_free_inputs(&in);
    }
}

/* The Hopper kernel (MPT_GEMM_WGMMA) runs here: compute capability 9.0
   and an sm_90a image. On a Hopper GPU under MPT_REQUIRE_GPU=1
   (./build.sh gpu builds that image there) its absence is a failure;
   elsewhere the tests of it are skipped (its shapes then ran on the
   mma.sync kernel in test_gemm_engine). */
static int wgmma_here(void) {
#ifdef MPT_CUDA
    mpt_device_info info;
    int hopper;
    if (mpt_cuda_wgmma_ready(gpu_be[GPU_WGMMA].impl)) return 1;
    hopper = mpt_device_query(gpu_be[GPU_WGMMA].ctx, 1, &info) == MPT_OK &&
             info.compute_major == 9 && info.compute_minor == 0;
    CHECK(!(hopper && gpu_required()),
          "a Hopper GPU, but the build has no sm_90a image (-arch=sm_90a)");
    SKIP("the Hopper kernel is not here (needs compute capability 9.0 and an sm_90a image)");
#endif
    return 0;
}

/* How many GEMMs the Hopper kernel ran on b so far. */
static long long wgmma_runs(const backend *b) {
#ifdef MPT_CUDA
    return (long long)mpt_cuda_gemm_runs(b->impl, MPT_GEMM_WGMMA);
#else
    (void)b;
    return 0;
#endif
}

/* The Hopper kernel against the CPU and cuBLASLt: every transpose,
   float16 and bfloat16, odd M, N and K (tails in every dimension of
   both tile widths, 128 and 256: 2304×2560 is 18·10 = 180 tiles of
   128×256 for 132 SMs), leading dimensions rounded up to 8 elements (TMA's
   16-byte pitch; C's stays odd), each epilogue (alpha, beta·C, bias,
   ReLU, both GELUs, sigmoid, tanh), C in each dtype and poisoned first. Every
   case must have run on the Hopper kernel (its run count grows by 2),
   twice with the same bits. Relative norm error <= 1e-2 against the CPU
   in float32 rounded to C's dtype, as every 16-bit GEMM, and <= 1e-2
   against cuBLASLt's result (both accumulate in float32 in different
   orders, then round once). */
static void test_gemm_wgmma(void) {
    static const int64_t shapes[][3] = {{1, 7, 33},     {127, 129, 65},  {128, 256, 64},
                                        {255, 300, 1000}, {1000, 513, 77}, {64, 8, 4096},
                                        {2304, 2560, 256}, {333, 1030, 1}};
    static const mpt_activation acts[6] = {MPT_ACT_NONE,    MPT_ACT_RELU, MPT_ACT_GELU,
                                           MPT_ACT_SIGMOID, MPT_ACT_TANH, MPT_ACT_GELU_TANH};
    backend *w = &gpu_be[GPU_WGMMA], *lt = &gpu_be[GPU_CUBLASLT];
    size_t si;
    int tr, di, v = 0;
    if (!wgmma_here()) return;
    for (si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (tr = 0; tr < 4; tr++)
            for (di = 1; di < 3; di++, v++) {
                gemm_case g;
                gemm_inputs in;
                void *ref, *got[2], *lref;
                char what[160];
                long long before;
                size_t c_bytes;
                double err;
                memset(&g, 0, sizeof g);
                g.m = shapes[si][0], g.n = shapes[si][1], g.k = shapes[si][2];
                g.ta = tr & 1, g.tb = tr >> 1;
                g.ab = float_dtypes[di];
                g.c_dtype = float_dtypes[v % 3];
                g.alpha = v % 3 == 1 ? 0.5f : v % 3 == 2 ? -2.0f : 0.0f;
                g.beta = g.c_dtype == MPT_FLOAT32 && v % 4 == 1 ? 0.75f : 0.0f;
                g.bias = v % 2;
                g.act = acts[v % 6];
                g.pad = v % 3 == 0 ? 3 : 0;
                g.ld8 = 1;
                in = gemm_make_inputs(&g);
                c_bytes = nbytes(g.c_dtype, g.m * in.ldc);
                describe_gemm(what, sizeof what, &g);
                ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
                before = wgmma_runs(w);
                got[0] = gemm_run(w, &g, g.c_dtype, &in);
                got[1] = gemm_run(w, &g, g.c_dtype, &in);
                CHECK(wgmma_runs(w) - before == 2, "gemm %s: the Hopper kernel ran %lld of 2",
                      what, wgmma_runs(w) - before);
                err = gemm_error(&g, &in, ref, got[0]);
                CHECK(err <= 1e-2, "gemm %s on %s: relative error %.3g > 1e-2 (CPU)", what,
                      w->label, err);
                CHECK(!memcmp(got[0], got[1], c_bytes), "gemm %s on %s: two runs differ at %lld",
                      what, w->label,
                      (long long)first_difference(got[0], got[1], g.m * in.ldc,
                                                  mpt_dtype_size(g.c_dtype)));
                lref = gemm_run(lt, &g, g.c_dtype, &in);
                {
                    /* cuBLASLt's C as the reference, in float32 */
                    float *as_f32 = (float *)malloc(sizeof(float) * (size_t)(g.m * in.ldc));
                    int64_t i;
                    for (i = 0; i < g.m * in.ldc; i++)
                        as_f32[i] = (float)load_value(g.c_dtype, lref, i);
                    err = gemm_error(&g, &in, as_f32, got[0]);
                    CHECK(err <= 1e-2, "gemm %s on %s: relative error %.3g > 1e-2 (cuBLASLt)",
                          what, w->label, err);
                    free(as_f32);
                }
                free(ref);
                free(got[0]);
                free(got[1]);
                free(lref);
                gemm_free_inputs(&in);
            }
}

/* The Hopper kernel's split-K (mpt__wgmma_split_k) on weight-gradient
   shapes (A transposed, long K, one to three tiles), odd K tails, the
   epilogues the second pass applies; against the CPU (<= 1e-2), two runs
   bit-identical, and one case recorded in a CUDA graph and replayed
   (the same bits as the direct run). */
static void test_gemm_wgmma_split_k(void) {
    static const struct {
        int64_t m, n, k;
        int ta, tb;
        mpt_dtype ab, c_dtype;
        float alpha, beta;
        int bias;
        mpt_activation act;
    } cases[] = {
        {288, 32, 73728, 1, 0, MPT_FLOAT16, MPT_FLOAT32, 0, 0, 0, MPT_ACT_NONE},
        {9, 32, 86528, 1, 0, MPT_BFLOAT16, MPT_FLOAT32, 0, 1, 0, MPT_ACT_NONE},
        {288, 32, 73728 + 17, 1, 0, MPT_BFLOAT16, MPT_FLOAT32, 0, 0.5f, 1, MPT_ACT_NONE},
        {288, 40, 40005, 0, 1, MPT_FLOAT16, MPT_FLOAT16, 0.5f, 0, 1, MPT_ACT_GELU},
        {100, 72, 30001, 1, 1, MPT_BFLOAT16, MPT_BFLOAT16, 0, 0, 1, MPT_ACT_RELU},
        {37, 64, 20031, 0, 0, MPT_FLOAT16, MPT_FLOAT32, -2.0f, 0.75f, 1, MPT_ACT_SIGMOID},
    };
    backend *w = &gpu_be[GPU_WGMMA];
    size_t i;
    if (!wgmma_here()) return;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gemm_case g;
        gemm_inputs in;
        void *ref, *got[2];
        char what[160];
        long long before;
        double err;
        memset(&g, 0, sizeof g);
        g.m = cases[i].m, g.n = cases[i].n, g.k = cases[i].k;
        g.ta = cases[i].ta, g.tb = cases[i].tb;
        g.ab = cases[i].ab, g.c_dtype = cases[i].c_dtype;
        g.alpha = cases[i].alpha, g.beta = cases[i].beta;
        g.bias = cases[i].bias, g.act = cases[i].act;
        g.ld8 = 1;
        in = gemm_make_inputs(&g);
        ref = gemm_run(&cpu_be, &g, MPT_FLOAT32, &in);
        before = wgmma_runs(w);
        got[0] = gemm_run(w, &g, g.c_dtype, &in);
        got[1] = gemm_run(w, &g, g.c_dtype, &in);
        describe_gemm(what, sizeof what, &g);
        CHECK(wgmma_runs(w) - before == 2, "split gemm %s: the Hopper kernel ran %lld of 2", what,
              wgmma_runs(w) - before);
        err = gemm_error(&g, &in, ref, got[0]);
        CHECK(err <= 1e-2, "split gemm %s on %s: relative error %.3g > 1e-2", what, w->label,
              err);
        CHECK(!memcmp(got[0], got[1], nbytes(g.c_dtype, g.m * in.ldc)),
              "split gemm %s on %s: two runs differ at element %lld", what, w->label,
              (long long)first_difference(got[0], got[1], g.m * in.ldc,
                                          mpt_dtype_size(g.c_dtype)));
        if (i == 0) gemm_split_captured(w, &g, &in);
        free(ref);
        free(got[0]);
        free(got[1]);
        gemm_free_inputs(&in);
    }
}

/* One im2col and one col2im case on a backend: their outputs (malloc'ed). */
static void layout_run(backend *b, const mpt_window *g, mpt_dtype dt, int64_t n, const void *x,
                       const float *dcols, void **cols_out, void **dx_out) {
    const int64_t xn = n * g->h * g->w * g->c, cn = n * g->oh * g->ow * g->kh * g->kw * g->c;
    const void *xd = be_upload(b, x, nbytes(dt, xn));
    void *cols = be_poisoned(b, nbytes(dt, cn));
    const float *dc = (const float *)be_upload(b, dcols, nbytes(MPT_FLOAT32, cn));
    float *dxf = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, xn));
    void *dx = be_poisoned(b, nbytes(dt, xn));
    b->t->im2col(b->impl, g, dt, xd, n, cols);
    b->t->col2im(b->impl, g, dt, dc, n, dxf, dx);
    *cols_out = be_fetch(b, cols, nbytes(dt, cn), "im2col");
    *dx_out = be_fetch(b, dx, nbytes(dt, xn), "col2im");
    be_release(b);
}

/* Issue 9 A10: im2col and col2im on both index paths — 32-bit indices
   with divisions by multiply and shift (every call below 2^31, the
   default) and 64-bit ones (a context opened with $MPT_CUDA_INDEX64=1) —
   against the CPU: im2col exact, col2im within the tolerance of its
   dtype. The windows of test_im2col, and larger batches whose indices
   reach past 2^20, over divisors that are not powers of two. */
static void test_layout_index_paths(void) {
    backend wide;
    backend *paths[2];
    int wi, di, p;
    if (!open_backend_with_env(&wide, "cuda (64-bit indices)", "MPT_CUDA_INDEX64", "1")) return;
    paths[0] = &gpu_be[GPU_AUTO];
    paths[1] = &wide;
    for (wi = 0; wi < N_WINDOWS + 3; wi++)
        for (di = 0; di < 3; di++) {
            mpt_window g = wi < N_WINDOWS ? window_case(wi)
                           : wi == N_WINDOWS ? make_window(28, 28, 1, 3, 1, 0)
                           : wi == N_WINDOWS + 1 ? make_window(30, 29, 3, 5, 2, 1)
                                                 : make_window(13, 13, 12, 3, 1, 1);
            const int64_t n = wi < N_WINDOWS ? 3 : wi == N_WINDOWS ? 128 : 37;
            const mpt_dtype dt = float_dtypes[di];
            const int64_t xn = n * g.h * g.w * g.c, cn = n * g.oh * g.ow * g.kh * g.kw * g.c;
            void *x = random_values(dt, xn, -1, 1);
            float *dcols = (float *)random_values(MPT_FLOAT32, cn, -1, 1);
            void *cols_cpu, *dx_cpu;
            char what[160];
            describe_window(what, sizeof what, &g, n, dt);
            layout_run(&cpu_be, &g, dt, n, x, dcols, &cols_cpu, &dx_cpu);
            for (p = 0; p < 2; p++) {
                void *cols, *dx;
                double err;
                layout_run(paths[p], &g, dt, n, x, dcols, &cols, &dx);
                CHECK(memcmp(cols, cols_cpu, nbytes(dt, cn)) == 0,
                      "im2col %s on %s: element %lld differs (exact)", what, paths[p]->label,
                      (long long)first_difference(cols, cols_cpu, cn, mpt_dtype_size(dt)));
                err = rel_error(dt, dx, dt, dx_cpu, xn);
                CHECK(err <= tolerance(dt), "col2im %s on %s: relative error %.3g > %g", what,
                      paths[p]->label, err, tolerance(dt));
                free(cols);
                free(dx);
            }
            free(cols_cpu);
            free(dx_cpu);
            free(x);
            free(dcols);
        }
    close_backend(&wide);
}

/* ---- Conv2D's implicit GEMMs (conv_direct) ------------------------------------------------ */

/* issue 35 A.4: the CUDA backend's conv_direct (mpt_cuda.cu @cuda-conv)
   against the CPU backend's im2col path (im2col, gemm, col2im), each
   direction, float16 and bfloat16, fresh random inputs, outputs poisoned
   first. The CPU's results stay float32; the GPU's y and dx are rounded
   to the dtype once, so y and dx <= tolerance(dt) of the norm (half an
   ulp, plus float32 sums in another order); dkernel (float32, sums over
   up to 32768 pixels in another order and split along them) <= 1e-4, and
   two runs give the same bits. */
typedef struct conv_direct_case {
    int64_t n, h, w, c, f, kh, kw, s;
    int same;
    mpt_activation act;
    int bias;
    const char *why;
} conv_direct_case;

static const conv_direct_case conv_direct_cases[] = {
    {3, 13, 11, 16, 24, 3, 3, 2, 1, MPT_ACT_RELU, 1, "stride 2, same"},
    {2, 12, 12, 8, 32, 3, 3, 1, 0, MPT_ACT_NONE, 0, "valid, no bias"},
    {3, 9, 10, 32, 8, 1, 1, 2, 0, MPT_ACT_SIGMOID, 1, "1x1 of stride 2"},
    {2, 7, 7, 8, 16, 5, 5, 3, 1, MPT_ACT_TANH, 1, "5x5 of stride 3, past the image"},
    {2, 9, 8, 8, 8, 2, 3, 1, 1, MPT_ACT_RELU, 1, "2x3, same"},
    {64, 12, 12, 8, 32, 3, 3, 1, 1, MPT_ACT_RELU, 1, "kernel gradient split along K"},
    {32, 32, 32, 16, 64, 3, 3, 1, 1, MPT_ACT_RELU, 1, "128-wide tiles"},
};

static mpt_window conv_direct_window(const conv_direct_case *k) {
    mpt_window g = make_window(k->h, k->w, k->c, k->kh, k->s, k->same);
    if (k->kw != k->kh) { /* make_window's is square: the columns again */
        mpt_window cols = make_window(k->w, k->w, k->c, k->kw, k->s, k->same);
        g.kw = cols.kw, g.ow = cols.ow, g.left = cols.left;
    }
    return g;
}

/* Inputs in dt (x, kernel, dz), the bias and a dkernel to add to. */
typedef struct conv_inputs {
    void *x, *kernel, *dz;
    float *bias, *dkernel0;
    int64_t xn, kn, yn, kk, rows;
} conv_inputs;

static conv_inputs conv_make_inputs(const conv_direct_case *k, const mpt_window *g,
                                    mpt_dtype dt) {
    conv_inputs in;
    in.kk = g->kh * g->kw * g->c;
    in.rows = k->n * g->oh * g->ow;
    in.xn = k->n * g->h * g->w * g->c;
    in.kn = in.kk * k->f;
    in.yn = in.rows * k->f;
    in.x = random_values(dt, in.xn, -1, 1);
    in.kernel = random_values(dt, in.kn, -0.5, 0.5);
    in.dz = random_values(dt, in.yn, -1, 1);
    in.bias = (float *)random_values(MPT_FLOAT32, k->f, -0.5, 0.5);
    in.dkernel0 = (float *)random_values(MPT_FLOAT32, in.kn, -1, 1);
    return in;
}

static void conv_free_inputs(conv_inputs *in) {
    free(in->x), free(in->kernel), free(in->dz), free(in->bias), free(in->dkernel0);
}

enum { CONV_FORWARD, CONV_INPUT_GRAD, CONV_KERNEL_GRAD, CONV_KERNEL_GRAD_ADD, CONV_DIRECTIONS };
static const char *const conv_direction_names[CONV_DIRECTIONS] = {
    "forward", "input gradient", "kernel gradient", "kernel gradient added"};

/* The CPU's im2col path for one direction: y (rows, F), dx (n, H, W, C)
   or dkernel (kk, F), float32 (malloc'ed). */
static float *conv_cpu_reference(const conv_direct_case *k, const mpt_window *g, mpt_dtype dt,
                                 const conv_inputs *in, int dir) {
    backend *b = &cpu_be;
    const void *x = be_upload(b, in->x, nbytes(dt, in->xn));
    const void *kernel = be_upload(b, in->kernel, nbytes(dt, in->kn));
    const void *dz = be_upload(b, in->dz, nbytes(dt, in->yn));
    void *cols = be_poisoned(b, nbytes(dt, in->rows * in->kk));
    int64_t out_n = dir == CONV_FORWARD ? in->yn : dir == CONV_INPUT_GRAD ? in->xn : in->kn;
    float *out = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, out_n)), *host;
    mpt_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.ab_dtype = dt;
    b->t->im2col(b->impl, g, dt, x, k->n, cols);
    if (dir == CONV_FORWARD) { /* y = act(cols · kernel + bias) */
        d.m = in->rows, d.n = k->f, d.k = in->kk;
        d.a = cols, d.lda = in->kk, d.b = kernel, d.ldb = k->f, d.c = out, d.ldc = k->f;
        d.bias = k->bias ? (const float *)be_upload(b, in->bias, nbytes(MPT_FLOAT32, k->f)) : NULL;
        d.activation = k->act;
        b->t->gemm(b->impl, &d, MPT_FLOAT32);
    } else if (dir == CONV_INPUT_GRAD) { /* dcols = dz · kernelᵀ, then col2im */
        float *dcols = (float *)be_poisoned(b, nbytes(MPT_FLOAT32, in->rows * in->kk));
        d.trans_b = 1;
        d.m = in->rows, d.n = in->kk, d.k = k->f;
        d.a = dz, d.lda = k->f, d.b = kernel, d.ldb = k->f, d.c = dcols, d.ldc = in->kk;
        b->t->gemm(b->impl, &d, MPT_FLOAT32);
        b->t->col2im(b->impl, g, MPT_FLOAT32, dcols, k->n, NULL, out);
    } else { /* dkernel (+)= colsᵀ · dz */
        if (dir == CONV_KERNEL_GRAD_ADD) be_put(b, out, in->dkernel0, nbytes(MPT_FLOAT32, in->kn));
        d.trans_a = 1;
        d.m = in->kk, d.n = k->f, d.k = in->rows;
        d.a = cols, d.lda = in->kk, d.b = dz, d.ldb = k->f, d.c = out, d.ldc = k->f;
        d.beta = dir == CONV_KERNEL_GRAD_ADD ? 1.0f : 0.0f;
        b->t->gemm(b->impl, &d, MPT_FLOAT32);
    }
    host = (float *)be_fetch(b, out, nbytes(MPT_FLOAT32, out_n), "the CPU's im2col path");
    be_release(b);
    return host;
}

/* conv_direct on b for one direction: *taken its answer, the result
   (malloc'ed; y and dx in dt, dkernel float32), poisoned beforehand. */
static void *conv_direct_run(backend *b, const conv_direct_case *k, const mpt_window *g,
                             mpt_dtype dt, const conv_inputs *in, int dir, int *taken) {
    mpt_conv_args a;
    int64_t out_n = dir == CONV_FORWARD ? in->yn : dir == CONV_INPUT_GRAD ? in->xn : in->kn;
    mpt_dtype out_dt = dir >= CONV_KERNEL_GRAD ? MPT_FLOAT32 : dt;
    void *out = be_poisoned(b, nbytes(out_dt, out_n)), *host;
    memset(&a, 0, sizeof a);
    a.g = g;
    a.dtype = dt;
    a.n = k->n;
    a.f = k->f;
    a.kernel = be_upload(b, in->kernel, nbytes(dt, in->kn));
    /* the layer's workspace contract (the kernel gradient's may be NULL) */
    if (dir < CONV_KERNEL_GRAD)
        a.ws = be_alloc(b, (size_t)MPT_CONV_DIRECT_WS_BYTES(in->kk, g->c, k->f));
    if (dir == CONV_FORWARD) {
        a.x = be_upload(b, in->x, nbytes(dt, in->xn));
        a.bias = k->bias ? (const float *)be_upload(b, in->bias, nbytes(MPT_FLOAT32, k->f)) : NULL;
        a.act = k->act;
        a.y = out;
    } else if (dir == CONV_INPUT_GRAD) {
        a.input_grad = 1;
        a.x = be_upload(b, in->dz, nbytes(dt, in->yn)); /* the layer passes dz as x */
        a.y = out;
    } else {
        a.kernel_grad = 1;
        a.x = be_upload(b, in->x, nbytes(dt, in->xn));
        a.dz = be_upload(b, in->dz, nbytes(dt, in->yn));
        a.dkernel = (float *)out;
        a.accumulate = dir == CONV_KERNEL_GRAD_ADD;
        if (a.accumulate) be_put(b, out, in->dkernel0, nbytes(MPT_FLOAT32, in->kn));
    }
    *taken = b->t->conv_direct && b->t->conv_direct(b->impl, &a);
    host = be_fetch(b, out, nbytes(out_dt, out_n), "conv_direct");
    be_release(b);
    return host;
}

static void test_conv_direct(void) {
    backend *gpu = &gpu_be[GPU_AUTO];
    size_t ci;
    int di, dir;
    for (ci = 0; ci < sizeof conv_direct_cases / sizeof conv_direct_cases[0]; ci++)
        for (di = 1; di < 3; di++) {
            const conv_direct_case *k = &conv_direct_cases[ci];
            const mpt_window g = conv_direct_window(k);
            const mpt_dtype dt = float_dtypes[di];
            conv_inputs in = conv_make_inputs(k, &g, dt);
            char what[200], win[160];
            describe_window(win, sizeof win, &g, k->n, dt);
            for (dir = 0; dir < CONV_DIRECTIONS; dir++) {
                float *ref = conv_cpu_reference(k, &g, dt, &in, dir);
                int64_t out_n = dir == CONV_FORWARD ? in.yn : dir == CONV_INPUT_GRAD ? in.xn : in.kn;
                int taken[2], run;
                void *got[2];
                double err, tol = dir >= CONV_KERNEL_GRAD ? 1e-4 : tolerance(dt);
                snprintf(what, sizeof what, "%s (%s) F %lld %s", conv_direction_names[dir], k->why,
                         (long long)k->f, win);
                for (run = 0; run < 2; run++)
                    got[run] = conv_direct_run(gpu, k, &g, dt, &in, dir, &taken[run]);
                CHECK(taken[0] && taken[1], "conv_direct declined %s", what);
                err = rel_error(dir >= CONV_KERNEL_GRAD ? MPT_FLOAT32 : dt, got[0], MPT_FLOAT32, ref,
                                out_n);
                CHECK(err <= tol, "conv_direct %s: relative error %.3g > %g", what, err, tol);
                CHECK(!memcmp(got[0], got[1], nbytes(dir >= CONV_KERNEL_GRAD ? MPT_FLOAT32 : dt,
                                                     out_n)),
                      "conv_direct %s: two runs differ", what);
                free(ref);
                free(got[0]);
                free(got[1]);
            }
            conv_free_inputs(&in);
        }
}

/* What conv_direct declines does nothing (the output keeps its poison):
   a first layer's 3 channels, 12 filters, float32, a 1×1 window of
   stride 1 (a plain GEMM already), the kernel gradient from out and dy
   (dz NULL), softmax; and with $MPT_CUDA_CONV=im2col a case it takes. */
static void test_conv_direct_declines(void) {
    static const conv_direct_case cases[] = {
        {2, 8, 8, 3, 16, 3, 3, 1, 1, MPT_ACT_RELU, 1, "3 channels"},
        {2, 8, 8, 8, 12, 3, 3, 1, 1, MPT_ACT_RELU, 1, "12 filters"},
        {2, 8, 8, 8, 16, 1, 1, 1, 0, MPT_ACT_RELU, 1, "1x1 of stride 1"},
    };
    backend *gpu = &gpu_be[GPU_AUTO];
    backend im2col_be;
    size_t ci;
    int dir, taken;
    for (ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const mpt_window g = conv_direct_window(&cases[ci]);
        conv_inputs in = conv_make_inputs(&cases[ci], &g, MPT_FLOAT16);
        for (dir = 0; dir < CONV_KERNEL_GRAD_ADD; dir++) {
            void *got = conv_direct_run(gpu, &cases[ci], &g, MPT_FLOAT16, &in, dir, &taken);
            CHECK(!taken, "%s: %s taken", cases[ci].why, conv_direction_names[dir]);
            free(got);
        }
        conv_free_inputs(&in);
    }
    {
        const conv_direct_case *k = &conv_direct_cases[0];
        const mpt_window g = conv_direct_window(k);
        conv_inputs in = conv_make_inputs(k, &g, MPT_FLOAT32);
        mpt_conv_args a;
        unsigned char *got;
        int64_t i, poisoned = 0;
        got = (unsigned char *)conv_direct_run(gpu, k, &g, MPT_FLOAT32, &in, CONV_FORWARD, &taken);
        CHECK(!taken, "float32 taken");
        for (i = 0; i < (int64_t)nbytes(MPT_FLOAT32, in.yn); i++) poisoned += got[i] == 0xFF;
        CHECK(poisoned == (int64_t)nbytes(MPT_FLOAT32, in.yn), "a declined call wrote y");
        free(got);
        conv_free_inputs(&in);
        in = conv_make_inputs(k, &g, MPT_FLOAT16);
        memset(&a, 0, sizeof a);
        a.g = &g, a.dtype = MPT_FLOAT16, a.n = k->n, a.f = k->f, a.kernel_grad = 1;
        a.x = be_upload(gpu, in.x, nbytes(MPT_FLOAT16, in.xn));
        a.out = be_upload(gpu, in.dz, nbytes(MPT_FLOAT16, in.yn));
        a.dy = be_upload(gpu, in.dz, nbytes(MPT_FLOAT16, in.yn));
        a.act = MPT_ACT_RELU;
        a.dkernel = (float *)be_poisoned(gpu, nbytes(MPT_FLOAT32, in.kn));
        CHECK(!gpu->t->conv_direct(gpu->impl, &a), "the kernel gradient from out and dy taken");
        a.kernel_grad = 0, a.act = MPT_ACT_SOFTMAX, a.y = be_poisoned(gpu, nbytes(MPT_FLOAT16, in.yn));
        a.kernel = be_upload(gpu, in.kernel, nbytes(MPT_FLOAT16, in.kn));
        CHECK(!gpu->t->conv_direct(gpu->impl, &a), "a forward with softmax taken");
        be_release(gpu);
        if (open_backend_env_engine(&im2col_be, "MPT_CUDA_CONV=im2col", "MPT_CUDA_CONV", "im2col",
                                    MPT_GEMM_AUTO)) {
            for (dir = 0; dir < CONV_DIRECTIONS; dir++) {
                void *out = conv_direct_run(&im2col_be, k, &g, MPT_FLOAT16, &in, dir, &taken);
                CHECK(!taken, "MPT_CUDA_CONV=im2col: %s taken", conv_direction_names[dir]);
                free(out);
            }
            close_backend(&im2col_be);
        }
        conv_free_inputs(&in);
    }
}


/* ---- whole models ---------------------------------------------------------------------------------- */

enum { N_BLOBS = 1024, FEATURES = 12, CLASSES = 4 };
static float blob_x[N_BLOBS * FEATURES];
static int32_t blob_y[N_BLOBS];

/* Four classes separated along different feature directions. */
static void make_blobs(void) {
    int i, j;
    for (i = 0; i < N_BLOBS; i++) {
        uint32_t r[4];
        blob_y[i] = i % CLASSES;
        for (j = 0; j < FEATURES; j++) {
            mpt_philox4x32(7, (uint64_t)i, (uint64_t)j, r);
            blob_x[i * FEATURES + j] =
                (float)(r[0] / 4294967296.0 - 0.5) + (j == blob_y[i] ? 1.5f : 0.0f);
        }
    }
}

static mpt_dataset *blob_dataset(mpt_context *ctx) {
    return test_dataset_xy(ctx, blob_x, blob_y, N_BLOBS, FEATURES);
}

/* 1: blob_model is a graph (test_model_graph_on_the_gpu). */
static int blobs_graph;
/* blob_model's gradient_accumulation_steps, its mean clipped at 1 when set
   (test_model_accumulation_graphs). */
static int blobs_accumulate;

/* Dense(64, relu) -> BatchNormalization -> Dropout(0.2) -> Dense(4, softmax),
   Adam, built for batches of 64. With blobs_graph: h = Dense(64, relu);
   Concatenate(Add(BatchNormalization(Dense(64, relu)(h)), h), h) ->
   Dropout(0.2) -> Dense(4, softmax): fan-out, a merge's casts and sums. */
static mpt_model *blob_model(mpt_context *ctx, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    mpt_batchnorm_desc bd;
    mpt_dropout_desc od;
    mpt_compile_desc cd;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = FEATURES;
    md.input_rank = 1;
    md.policy = policy;
    md.seed = 5;
    if (mpt_model_create(ctx, &md, &m) != MPT_OK) {
        CHECK(0, "model: %s", mpt_context_error(ctx));
        return NULL;
    }
    memset(&dd, 0, sizeof dd);
    dd.units = 64;
    dd.activation = MPT_ACT_RELU;
    memset(&bd, 0, sizeof bd);
    memset(&od, 0, sizeof od);
    od.rate = 0.2f;
    if (blobs_graph) {
        mpt_node h = mpt_dense(m, mpt_model_input(m), &dd), two[2];
        two[0] = mpt_batch_normalization(m, mpt_dense(m, h, &dd), &bd);
        two[1] = h;
        two[0] = mpt_add(m, 2, two, NULL);
        mpt_dropout(m, mpt_concatenate(m, 2, two, NULL), &od);
    } else {
        mpt_model_add_dense(m, &dd);
        mpt_model_add_batch_normalization(m, &bd);
        mpt_model_add_dropout(m, &od);
    }
    dd.units = CLASSES;
    dd.activation = MPT_ACT_SOFTMAX;
    mpt_model_add_dense(m, &dd);
    memset(&cd, 0, sizeof cd);
    cd.optimizer.learning_rate = 0.01f;
    cd.optimizer.gradient_accumulation_steps = blobs_accumulate;
    cd.optimizer.clip_global_norm = blobs_accumulate ? 1.0f : 0.0f;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.metrics = MPT_METRIC_ACCURACY;
    CHECK(mpt_model_compile(m, &cd) == MPT_OK, "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 64) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* A line saying how many GEMMs each engine ran in context c's life so
   far: when two runs' bits differ, whether their engines did. */
static void print_gemm_engines(mpt_context *c, const char *run) {
#ifdef MPT_CUDA
    void *impl;
    const mpt_backend *t = mpt_context_backend(c, &impl);
    if (strcmp(t->name, "cuda") != 0) return;
    printf("# %s: GEMMs mpt %lld, wgmma %lld, cublaslt %lld\n", run,
           (long long)mpt_cuda_gemm_runs(impl, MPT_GEMM_MPT),
           (long long)mpt_cuda_gemm_runs(impl, MPT_GEMM_WGMMA),
           (long long)mpt_cuda_gemm_runs(impl, MPT_GEMM_CUBLASLT));
#else
    (void)c, (void)run;
#endif
}

/* Where train_blobs has fit profile steps 2..20 (NULL: no profiling). */
static const char *blobs_profile_dir;

/* Trains the blob model for `epochs` on a fresh context with
   MPT_CUDA_GRAPHS set to `graphs` (unset for NULL) throughout, saves its
   weights to path; returns the last epoch's accuracy (NAN on failure). */
static double train_blobs(const char *graphs, mpt_policy policy, int epochs, const char *path,
                          const char **device) {
    mpt_context *ctx = NULL;
    mpt_context_desc cd;
    mpt_dataset *data;
    mpt_model *m;
    mpt_fit_desc fd;
    double acc = NAN;
    if (graphs) setenv("MPT_CUDA_GRAPHS", graphs, 1);
    else unsetenv("MPT_CUDA_GRAPHS");
    memset(&cd, 0, sizeof cd);
    cd.logger.fn = quiet_logger;
    if (mpt_context_create(&cd, &ctx) != MPT_OK) {
        CHECK(0, "context: cannot be created");
        unsetenv("MPT_CUDA_GRAPHS");
        return NAN;
    }
    if (device) *device = mpt_context_backend(ctx, NULL)->name;
    data = blob_dataset(ctx);
    m = data ? blob_model(ctx, policy) : NULL;
    if (m) {
        memset(&fd, 0, sizeof fd);
        fd.epochs = epochs;
        fd.batch_size = 64;
        if (blobs_profile_dir) {
            fd.profile_batch[0] = 2;
            fd.profile_batch[1] = 20; /* 16 steps an epoch: into the second */
            fd.profile_dir = blobs_profile_dir;
        }
        if (mpt_model_fit(m, data, &fd) == MPT_OK) acc = history_value(m, "accuracy", -1);
        else CHECK(0, "fit: %s", mpt_context_error(ctx));
        if (path)
            CHECK(mpt_model_save_weights(m, path) == MPT_OK, "save_weights: %s",
                  mpt_context_error(ctx));
        if (path) print_gemm_engines(ctx, path);
    }
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(ctx);
    unsetenv("MPT_CUDA_GRAPHS"); /* read by fit, so set until here */
    return acc;
}

/* Whether two files hold the same bytes. */
static int same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb, ca, cb;
    while (same) {
        ca = getc(fa);
        cb = getc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

static void temp_path(char *buf, size_t size, const char *name) {
    const char *dir = getenv("TMPDIR");
    snprintf(buf, size, "%s/mpt_test_cuda_%ld_%s.safetensors", dir && *dir ? dir : "/tmp",
             (long)getpid(), name);
}

/* Under MPT_GEMM_AUTO each new context times the engines again, and a
   near tie (a GEMM of a few microseconds) may go the other way: other
   engines, other bits. A test that compares the bits of several contexts
   gives them one $MPT_GEMM_CHOICES file, as a user who wants repeatable
   runs does; gemm_choices_end removes it. */
static char gemm_choices[512];

static void gemm_choices_begin(const char *name) {
    char base[128];
    snprintf(base, sizeof base, "%s_choices", name);
    temp_path(gemm_choices, sizeof gemm_choices, base);
    remove(gemm_choices);
    setenv("MPT_GEMM_CHOICES", gemm_choices, 1);
}

static void gemm_choices_end(void) {
    unsetenv("MPT_GEMM_CHOICES");
    remove(gemm_choices);
}

/* Trains the blob model (a graph with `graph`) three epochs on the GPU
   with CUDA graphs off, on, and on again: it learns, and all three give
   the same bits. `name` tells the weight files apart. */
static void check_gpu_determinism(int graph, const char *name) {
    char off[512], on[512], again[512], base[128];
    double acc_off, acc_on;
    const char *dev = "?";
    snprintf(base, sizeof base, "%s_off", name);
    temp_path(off, sizeof off, base);
    snprintf(base, sizeof base, "%s_on", name);
    temp_path(on, sizeof on, base);
    snprintf(base, sizeof base, "%s_on_again", name);
    temp_path(again, sizeof again, base);
    make_blobs();
    blobs_graph = graph;
    gemm_choices_begin(name);
    acc_off = train_blobs("0", MPT_POLICY_MIXED_FLOAT16, 3, off, NULL);
    acc_on = train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, on, &dev);
    train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, again, NULL);
    gemm_choices_end();
    blobs_graph = 0;
    CHECK(!strcmp(dev, "cuda"), "the model trained on '%s'", dev);
    CHECK(acc_on >= 0.9, "the blobs are not learnt: accuracy %g", acc_on);
    CHECK(acc_on == acc_off, "accuracy with CUDA graphs %.9g, without %.9g", acc_on, acc_off);
    CHECK(same_file(off, on), "weights with CUDA graphs differ from those without (%s, %s)", on,
          off);
    CHECK(same_file(on, again), "two runs on the GPU gave different weights (%s, %s)", on, again);
    if (!test__current_failed) {
        remove(off);
        remove(on);
        remove(again);
    }
}

static void test_model_graphs_and_determinism(void) { check_gpu_determinism(0, "graphs"); }

/* A model graph on the GPU (fan-out, Add, Concatenate), as a chain. */
static void test_model_graph_on_the_gpu(void) { check_gpu_determinism(1, "graph_model"); }

/* ---- a model of token ids on the GPU --------------------------------------------------- */

enum { IDS_V = 10, IDS_T = 6, IDS_N = 512 };

/* Samples of 4 distinct ids repeated (a b c d a b); the next id is c. */
static void ids_pattern(int32_t *x, int32_t *y, int n) {
    int i, t, k, j;
    for (i = 0; i < n; i++) {
        int32_t sym[4];
        for (k = 0; k < 4; k++)
            do {
                sym[k] = test_randint(0, IDS_V - 1);
                for (j = 0; j < k && sym[j] != sym[k]; j++) continue;
            } while (j < k);
        for (t = 0; t < IDS_T; t++) x[i * IDS_T + t] = sym[t % 4];
        y[i] = sym[IDS_T % 4];
    }
}

/* With ids_attention, a MultiHeadAttention (2 heads of 8, causal,
   dropout 0.1 on the weights) over the sum before Flatten; with
   ids_on_cpu, the context is the CPU's. */
static int ids_attention, ids_on_cpu;

/* Embedding → PositionEmbedding + Add → Flatten → Dense(softmax) fit on
   x, y under mixed_float16 (CUDA graphs as `graphs` says); its weights
   into path; the final accuracy (NaN when fit fails, with the status in
   *status and the message in why). */
static double train_ids(const char *graphs, int32_t *x, int32_t *y, const char *path,
                        mpt_status *status, char *why, size_t why_size) {
    mpt_context *c = NULL;
    mpt_context_desc cd;
    mpt_model_desc md;
    mpt_embedding_desc ed;
    mpt_position_embedding_desc pd;
    mpt_dense_desc dd;
    mpt_multi_head_attention_desc ad;
    mpt_compile_desc comp;
    mpt_fit_desc fd;
    mpt_dataset_desc ds;
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_node tok, both[2], sum;
    int64_t xs[2] = {IDS_N, IDS_T}, ys[1] = {IDS_N};
    double acc = NAN;
    if (graphs) setenv("MPT_CUDA_GRAPHS", graphs, 1);
    else unsetenv("MPT_CUDA_GRAPHS");
    memset(&cd, 0, sizeof cd);
    cd.logger.fn = quiet_logger;
    cd.use_cpu = ids_on_cpu;
    *status = mpt_context_create(&cd, &c);
    if (*status != MPT_OK) return NAN;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = IDS_T;
    md.input_rank = 1;
    md.input_dtype = MPT_INT32;
    md.policy = MPT_POLICY_MIXED_FLOAT16;
    md.seed = 11;
    memset(&ed, 0, sizeof ed);
    ed.input_dim = IDS_V;
    ed.output_dim = 16;
    memset(&pd, 0, sizeof pd);
    pd.sequence_length = 8;
    memset(&dd, 0, sizeof dd);
    dd.units = IDS_V;
    dd.activation = MPT_ACT_SOFTMAX;
    memset(&ad, 0, sizeof ad);
    ad.num_heads = 2;
    ad.key_dim = 8;
    ad.dropout = 0.1f;
    ad.use_causal_mask = 1;
    memset(&comp, 0, sizeof comp);
    comp.optimizer.type = MPT_OPTIMIZER_ADAM;
    comp.optimizer.learning_rate = 1e-2f;
    comp.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    comp.metrics = MPT_METRIC_ACCURACY;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 15;
    fd.batch_size = 32;
    mpt_tensor_wrap(c, &tx, MPT_INT32, 2, xs, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
    memset(&ds, 0, sizeof ds);
    ds.x = &tx;
    ds.y = &ty;
    *status = mpt_model_create(c, &md, &m);
    if (*status == MPT_OK) {
        tok = mpt_embedding(m, mpt_model_input(m), &ed);
        both[0] = tok;
        both[1] = mpt_position_embedding(m, tok, &pd);
        sum = mpt_add(m, 2, both, NULL);
        if (ids_attention) sum = mpt_multi_head_attention(m, sum, sum, &ad);
        mpt_dense(m, mpt_flatten(m, sum, NULL), &dd);
        *status = mpt_model_compile(m, &comp);
    }
    if (*status == MPT_OK) *status = mpt_dataset_create(c, &ds, &d);
    if (*status == MPT_OK) *status = mpt_model_fit(m, d, &fd);
    if (*status == MPT_OK) acc = history_value(m, "accuracy", -1);
    if (*status == MPT_OK && path) *status = mpt_model_save_weights(m, path);
    if (*status == MPT_OK && path) print_gemm_engines(c, path);
    snprintf(why, why_size, "%.900s (%.60s)", mpt_context_error(c),
             mpt_context_backend(c, NULL)->name); /* each part bounded: both fit in why */
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(c);
    unsetenv("MPT_CUDA_GRAPHS");
    return acc;
}

/* The ids model on the GPU learns the pattern; CUDA graphs on and off and
   two runs give the same weights; an id past the table is refused by fit
   with the layer and the id. */
static void test_model_of_ids_on_the_gpu(void) {
    static int32_t x[IDS_N * IDS_T], y[IDS_N];
    char off[512], on[512], again[512], why[1024];
    mpt_status st;
    double acc_off, acc_on = NAN;
    ids_pattern(x, y, IDS_N);
    temp_path(off, sizeof off, "ids_off");
    temp_path(on, sizeof on, "ids_on");
    temp_path(again, sizeof again, "ids_on_again");
    gemm_choices_begin("ids");
    acc_off = train_ids("0", x, y, off, &st, why, sizeof why);
    if (st == MPT_OK) acc_on = train_ids(NULL, x, y, on, &st, why, sizeof why);
    if (st == MPT_OK) train_ids(NULL, x, y, again, &st, why, sizeof why);
    gemm_choices_end();
    CHECK(st == MPT_OK && strstr(why, "(cuda)"), "fit: %s", why);
    CHECK(acc_on >= 0.9, "the pattern is not learnt: accuracy %g", acc_on);
    CHECK(acc_on == acc_off, "accuracy with CUDA graphs %.9g, without %.9g", acc_on, acc_off);
    CHECK(same_file(off, on), "weights with CUDA graphs differ from those without");
    CHECK(same_file(on, again), "two runs on the GPU gave different weights");
    x[3 * IDS_T + 1] = IDS_V;
    train_ids(NULL, x, y, NULL, &st, why, sizeof why);
    CHECK(st == MPT_ERR_INVALID_ARGUMENT && strstr(why, "Embedding 'embedding' got id 10"),
          "a bad id: status %d, %s", (int)st, why);
    if (!test__current_failed) {
        remove(off);
        remove(on);
        remove(again);
    }
}

/* ---- a model of two inputs on the GPU ------------------------------------------------ */

enum { TWO_N = 256, TWO_F = 6, TWO_V = 3 };

/* Input 0 (6) numbers and input 1 (3) ids into an Embedding: Dense(8,
   relu) and Flatten(Embedding(5, 2)) joined by a Concatenate, Dense(2,
   softmax); three epochs in float32 on the context `c` (a dataset of
   both inputs, each step's inputs uploaded before it runs); its weights
   into w (room for `room` floats). The status. */
static mpt_status train_two_inputs(mpt_context *c, float *w, int64_t room) {
    static float x[TWO_N * TWO_F];
    static int32_t ids[TWO_N * TWO_V], y[TWO_N];
    int64_t xs[2] = {TWO_N, TWO_F}, is[2] = {TWO_N, TWO_V}, ys[1] = {TWO_N};
    mpt_tensor tx, ti, ty;
    const mpt_tensor *inputs[2];
    mpt_model_desc md;
    mpt_input_desc in;
    mpt_dense_desc hidden, out;
    mpt_embedding_desc ed;
    mpt_compile_desc comp;
    mpt_fit_desc fd;
    mpt_dataset_desc ds;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_node both[2];
    mpt_status st;
    int64_t i;
    test_seed(21);
    for (i = 0; i < TWO_N * TWO_F; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < TWO_N * TWO_V; i++) ids[i] = test_randint(0, 4);
    for (i = 0; i < TWO_N; i++) y[i] = (x[i * TWO_F] > 0) ^ (ids[i * TWO_V] > 2);
    memset(&md, 0, sizeof md);
    md.input_shape[0] = TWO_F;
    md.input_rank = 1;
    md.seed = 3;
    memset(&in, 0, sizeof in);
    in.shape[0] = TWO_V;
    in.rank = 1;
    in.dtype = MPT_INT32;
    memset(&hidden, 0, sizeof hidden);
    hidden.units = 8;
    hidden.activation = MPT_ACT_RELU;
    memset(&out, 0, sizeof out);
    out.units = 2;
    out.activation = MPT_ACT_SOFTMAX;
    memset(&ed, 0, sizeof ed);
    ed.input_dim = 5;
    ed.output_dim = 2;
    memset(&comp, 0, sizeof comp);
    comp.optimizer.type = MPT_OPTIMIZER_ADAM;
    comp.optimizer.learning_rate = 1e-2f;
    comp.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 3;
    fd.batch_size = 32;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, xs, x);
    mpt_tensor_wrap(c, &ti, MPT_INT32, 2, is, ids);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
    inputs[0] = &tx;
    inputs[1] = &ti;
    memset(&ds, 0, sizeof ds);
    ds.inputs = inputs;
    ds.input_count = 2;
    ds.y = &ty;
    st = mpt_model_create(c, &md, &m);
    if (st == MPT_OK) {
        both[1] = mpt_flatten(m, mpt_embedding(m, mpt_model_add_input(m, &in), &ed), NULL);
        both[0] = mpt_dense(m, mpt_model_input(m), &hidden);
        mpt_dense(m, mpt_concatenate(m, 2, both, NULL), &out);
        st = mpt_model_compile(m, &comp);
    }
    if (st == MPT_OK) st = mpt_dataset_create(c, &ds, &d);
    if (st == MPT_OK) st = mpt_model_fit(m, d, &fd);
    if (st == MPT_OK) test_weights_in(c, m, w, room);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    return st;
}

/* The two-input model trains on the GPU to the CPU's weights (1e-4
   relative: the GEMMs' sums in another order) and, run twice, to the
   same weights bit for bit. */
static void test_model_two_inputs_on_the_gpu(void) {
    static float w[3][256];
    double num = 0, den = 0;
    int i;
    CHECK(train_two_inputs(cpu_be.ctx, w[0], 256) == MPT_OK, "CPU: %s",
          mpt_context_error(cpu_be.ctx));
    CHECK(train_two_inputs(gpu_be[GPU_AUTO].ctx, w[1], 256) == MPT_OK, "GPU: %s",
          mpt_context_error(gpu_be[GPU_AUTO].ctx));
    CHECK(train_two_inputs(gpu_be[GPU_AUTO].ctx, w[2], 256) == MPT_OK, "GPU again: %s",
          mpt_context_error(gpu_be[GPU_AUTO].ctx));
    for (i = 0; i < 256; i++) {
        num += ((double)w[1][i] - w[0][i]) * ((double)w[1][i] - w[0][i]);
        den += (double)w[0][i] * w[0][i];
    }
    CHECK(den > 0 && sqrt(num / den) <= 1e-4, "GPU against CPU: relative norm error %.3g",
          sqrt(num / den));
    CHECK(memcmp(w[1], w[2], sizeof w[1]) == 0, "two runs on the GPU gave different weights");
}

/* ---- a small CNN on the GPU: Conv2D through conv_direct -------------------------------- */

#define CNN_N 96
#define CNN_HW 8
#define CNN_C 8
#define CNN_WEIGHTS 4096

/* Images (8, 8, 8) -> Conv2D(16, 3×3, same, relu) -> Conv2D(16, 3×3,
   strides 2, same, relu) -> Flatten -> Dense(2, softmax), mixed_float16
   (both Conv2Ds have channels and filters in multiples of 8: conv_direct
   takes all three products of each on a GPU), plain SGD so that the
   weights' change is linear in the gradients, two epochs of batch 32 on
   the context c. Its weights before (w0) and after (w) fit. */
static mpt_status train_cnn(mpt_context *c, float *w0, float *w) {
    static float x[CNN_N * CNN_HW * CNN_HW * CNN_C];
    static int32_t y[CNN_N];
    int64_t xs[4] = {CNN_N, CNN_HW, CNN_HW, CNN_C}, ys[1] = {CNN_N}, i;
    mpt_tensor tx, ty;
    mpt_model_desc md;
    mpt_conv2d_desc cd;
    mpt_dense_desc dd;
    mpt_compile_desc comp;
    mpt_fit_desc fd;
    mpt_dataset_desc ds;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_status st;
    test_seed(35);
    for (i = 0; i < CNN_N * CNN_HW * CNN_HW * CNN_C; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < CNN_N; i++) { /* channel 0's top-left quadrant, summed */
        double s = 0;
        int64_t r, q;
        for (r = 0; r < CNN_HW / 2; r++)
            for (q = 0; q < CNN_HW / 2; q++) s += x[((i * CNN_HW + r) * CNN_HW + q) * CNN_C];
        y[i] = s > 0;
    }
    memset(&md, 0, sizeof md);
    md.input_shape[0] = md.input_shape[1] = CNN_HW;
    md.input_shape[2] = CNN_C;
    md.input_rank = 3;
    md.policy = MPT_POLICY_MIXED_FLOAT16;
    md.seed = 9;
    memset(&cd, 0, sizeof cd);
    cd.filters = 16;
    cd.kernel_size[0] = cd.kernel_size[1] = 3;
    cd.padding = MPT_PADDING_SAME;
    cd.activation = MPT_ACT_RELU;
    memset(&dd, 0, sizeof dd);
    dd.units = 2;
    dd.activation = MPT_ACT_SOFTMAX;
    memset(&comp, 0, sizeof comp);
    comp.optimizer.type = MPT_OPTIMIZER_SGD;
    comp.optimizer.learning_rate = 0.05f;
    comp.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 2;
    fd.batch_size = 32;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, xs, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
    st = mpt_model_create(c, &md, &m);
    if (st == MPT_OK) {
        mpt_model_add_conv2d(m, &cd);
        cd.strides[0] = cd.strides[1] = 2;
        mpt_model_add_conv2d(m, &cd);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &dd);
        st = mpt_model_compile(m, &comp);
    }
    if (st == MPT_OK) st = mpt_model_build(m, 32);
    if (st == MPT_OK) test_weights_in(c, m, w0, CNN_WEIGHTS);
    memset(&ds, 0, sizeof ds);
    ds.x = &tx;
    ds.y = &ty;
    if (st == MPT_OK) st = mpt_dataset_create(c, &ds, &d);
    if (st == MPT_OK) st = mpt_model_fit(m, d, &fd);
    if (st == MPT_OK) test_weights_in(c, m, w, CNN_WEIGHTS);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    return st;
}

/* ‖(b − b0) − (a − a0)‖ / ‖a − a0‖: how far b's change is from a's. */
static double change_error(const float *a0, const float *a, const float *b0, const float *b) {
    double num = 0, den = 0;
    int i;
    for (i = 0; i < CNN_WEIGHTS; i++) {
        const double da = (double)a[i] - a0[i], db = (double)b[i] - b0[i];
        num += (db - da) * (db - da);
        den += da * da;
    }
    return den > 0 ? sqrt(num / den) : INFINITY;
}

/* The CNN trains on the GPU (the hand-written GEMM engine, so that only
   the convolutions' path differs between the contexts) as on the CPU:
   the weights' change within 2e-2 of the CPU's (float16 activations
   rounded at other points: the CPU's 3×3 products run Winograd's
   transform; an unmeasured bound, to be settled on a GPU); two runs give
   the same bits; under MPT_CUDA_CONV=im2col within the same bound, but
   not the same bits (where conv_direct never ran the two contexts would
   run the same kernels). */
static void test_model_cnn_on_the_gpu(void) {
    static float w0[4][CNN_WEIGHTS], w[4][CNN_WEIGHTS];
    backend im2col_be;
    double err;
    CHECK(train_cnn(cpu_be.ctx, w0[0], w[0]) == MPT_OK, "CPU: %s", mpt_context_error(cpu_be.ctx));
    CHECK(train_cnn(gpu_be[GPU_MPT].ctx, w0[1], w[1]) == MPT_OK, "GPU: %s",
          mpt_context_error(gpu_be[GPU_MPT].ctx));
    CHECK(train_cnn(gpu_be[GPU_MPT].ctx, w0[2], w[2]) == MPT_OK, "GPU again: %s",
          mpt_context_error(gpu_be[GPU_MPT].ctx));
    CHECK(!memcmp(w0[0], w0[1], sizeof w0[0]), "the initial weights differ");
    err = change_error(w0[0], w[0], w0[1], w[1]);
    CHECK(err <= 2e-2, "GPU against CPU: the weights' change off by %.3g of its norm", err);
    CHECK(!memcmp(w[1], w[2], sizeof w[1]), "two runs on the GPU gave different weights");
    if (!open_backend_with_env(&im2col_be, "MPT_CUDA_CONV=im2col", "MPT_CUDA_CONV", "im2col"))
        return;
    CHECK(train_cnn(im2col_be.ctx, w0[3], w[3]) == MPT_OK, "GPU, im2col: %s",
          mpt_context_error(im2col_be.ctx));
    err = change_error(w0[0], w[0], w0[3], w[3]);
    CHECK(err <= 2e-2, "GPU (im2col) against CPU: the weights' change off by %.3g", err);
    CHECK(memcmp(w[1], w[3], sizeof w[1]) != 0,
          "the implicit GEMMs and im2col gave the same bits: conv_direct never ran");
    close_backend(&im2col_be);
}

/* ---- a model of two outputs on the GPU ----------------------------------------------- */

/* x (6) -> Dense(8, relu) -> a classifier Dense(2, softmax) and a
   regression Dense(1), both outputs, loss weights 1 and 0.5; three epochs
   in float32 on the context `c` (fit's feed uploading both labels ahead
   of each step); its weights into w (room for `room` floats) and
   evaluate's values of the training data under `keys` into values (the
   logs' names live with the model). The status. */
static const char *const two_output_keys[] = {"loss", "dense_1_loss", "dense_2_loss",
                                              "dense_1_accuracy", "dense_2_mean_absolute_error"};

static mpt_status train_two_outputs(mpt_context *c, float *w, int64_t room, double *values) {
    static float x[TWO_N * TWO_F], t[TWO_N];
    static int32_t y[TWO_N];
    static const float weights[2] = {1.0f, 0.5f};
    int64_t xs[2] = {TWO_N, TWO_F}, ys[1] = {TWO_N}, ts[2] = {TWO_N, 1};
    mpt_tensor tx, ty, tt;
    const mpt_tensor *labels[2];
    mpt_model_desc md;
    mpt_dense_desc hidden, cls, reg;
    mpt_compile_desc comp;
    mpt_fit_desc fd;
    mpt_dataset_desc ds;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_node h;
    mpt_logs logs;
    mpt_status st;
    int64_t i;
    test_seed(23);
    for (i = 0; i < TWO_N * TWO_F; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < TWO_N; i++) {
        y[i] = x[i * TWO_F] + x[i * TWO_F + 1] > 0;
        t[i] = x[i * TWO_F + 2] * x[i * TWO_F + 3];
    }
    memset(&md, 0, sizeof md);
    md.input_shape[0] = TWO_F;
    md.input_rank = 1;
    md.seed = 5;
    memset(&hidden, 0, sizeof hidden);
    hidden.units = 8;
    hidden.activation = MPT_ACT_RELU;
    memset(&cls, 0, sizeof cls);
    cls.units = 2;
    cls.activation = MPT_ACT_SOFTMAX;
    memset(&reg, 0, sizeof reg);
    reg.units = 1;
    memset(&comp, 0, sizeof comp);
    comp.optimizer.type = MPT_OPTIMIZER_ADAM;
    comp.optimizer.learning_rate = 1e-2f;
    comp.losses[0].type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    comp.losses[1].type = MPT_LOSS_MEAN_SQUARED_ERROR;
    comp.loss_weights = weights;
    comp.output_metrics[0] = MPT_METRIC_ACCURACY;
    comp.output_metrics[1] = MPT_METRIC_MEAN_ABSOLUTE_ERROR;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 3;
    fd.batch_size = 32;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, xs, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, ys, y);
    mpt_tensor_wrap(c, &tt, MPT_FLOAT32, 2, ts, t);
    labels[0] = &ty;
    labels[1] = &tt;
    memset(&ds, 0, sizeof ds);
    ds.x = &tx;
    ds.labels = labels;
    ds.label_count = 2;
    st = mpt_model_create(c, &md, &m);
    if (st == MPT_OK) {
        h = mpt_dense(m, mpt_model_input(m), &hidden);
        mpt_model_add_output(m, mpt_dense(m, h, &cls));
        st = mpt_model_add_output(m, mpt_dense(m, h, &reg));
    }
    if (st == MPT_OK) st = mpt_model_compile(m, &comp);
    if (st == MPT_OK) st = mpt_dataset_create(c, &ds, &d);
    if (st == MPT_OK) st = mpt_model_fit(m, d, &fd);
    if (st == MPT_OK) st = mpt_model_evaluate(m, d, NULL, &logs);
    for (i = 0; st == MPT_OK && i < 5; i++) values[i] = mpt_logs_get(&logs, two_output_keys[i]);
    if (st == MPT_OK) test_weights_in(c, m, w, room);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    return st;
}

/* The two-output model trains on the GPU to the CPU's weights and logs
   (1e-4 relative: the GEMMs' sums in another order) and, run twice, to
   the same weights bit for bit. */
static void test_model_two_outputs_on_the_gpu(void) {
    static float w[3][256];
    double logs[3][5], num = 0, den = 0;
    int i;
    CHECK(train_two_outputs(cpu_be.ctx, w[0], 256, logs[0]) == MPT_OK, "CPU: %s",
          mpt_context_error(cpu_be.ctx));
    CHECK(train_two_outputs(gpu_be[GPU_AUTO].ctx, w[1], 256, logs[1]) == MPT_OK, "GPU: %s",
          mpt_context_error(gpu_be[GPU_AUTO].ctx));
    CHECK(train_two_outputs(gpu_be[GPU_AUTO].ctx, w[2], 256, logs[2]) == MPT_OK, "GPU again: %s",
          mpt_context_error(gpu_be[GPU_AUTO].ctx));
    for (i = 0; i < 256; i++) {
        num += ((double)w[1][i] - w[0][i]) * ((double)w[1][i] - w[0][i]);
        den += (double)w[0][i] * w[0][i];
    }
    CHECK(den > 0 && sqrt(num / den) <= 1e-4, "GPU against CPU: relative norm error %.3g",
          sqrt(num / den));
    CHECK(memcmp(w[1], w[2], sizeof w[1]) == 0, "two runs on the GPU gave different weights");
    for (i = 0; i < 5; i++)
        CHECK(fabs(logs[1][i] - logs[0][i]) <= 1e-4 * fabs(logs[0][i]) + 1e-6,
              "%s: GPU %.7g, CPU %.7g", two_output_keys[i], logs[1][i], logs[0][i]);
}

/* The ids model with a MultiHeadAttention (causal, dropout on the weights:
   the mask keyed by the step in device memory, which a replayed graph
   reads anew) learns the pattern on the GPU as on the CPU; CUDA graphs on
   and off and two runs on the GPU give the same weights. */
static void test_model_attention_on_the_gpu(void) {
    static int32_t x[IDS_N * IDS_T], y[IDS_N];
    char off[512], on[512], again[512], why[1024];
    mpt_status st;
    double acc_cpu, acc_off, acc_on = NAN;
    ids_pattern(x, y, IDS_N);
    temp_path(off, sizeof off, "attention_off");
    temp_path(on, sizeof on, "attention_on");
    temp_path(again, sizeof again, "attention_on_again");
    ids_attention = 1;
    ids_on_cpu = 1;
    acc_cpu = train_ids("0", x, y, NULL, &st, why, sizeof why);
    CHECK(st == MPT_OK, "fit on the CPU: %s", why);
    ids_on_cpu = 0;
    gemm_choices_begin("attention");
    acc_off = train_ids("0", x, y, off, &st, why, sizeof why);
    if (st == MPT_OK) acc_on = train_ids(NULL, x, y, on, &st, why, sizeof why);
    if (st == MPT_OK) train_ids(NULL, x, y, again, &st, why, sizeof why);
    gemm_choices_end();
    ids_attention = 0;
    CHECK(st == MPT_OK && strstr(why, "(cuda)"), "fit on the GPU: %s", why);
    CHECK(acc_cpu >= 0.9, "the pattern is not learnt on the CPU: accuracy %g", acc_cpu);
    CHECK(acc_on >= 0.9, "the pattern is not learnt on the GPU: accuracy %g", acc_on);
    CHECK(acc_on == acc_off, "accuracy with CUDA graphs %.9g, without %.9g", acc_on, acc_off);
    CHECK(same_file(off, on), "weights with CUDA graphs differ from those without");
    CHECK(same_file(on, again), "two runs on the GPU gave different weights");
    if (!test__current_failed) {
        remove(off);
        remove(on);
        remove(again);
    }
}

/* Gradient accumulation over 3 batches, the mean clipped: one recorded
   step serves the accumulating and the applying steps alike (the device
   decides which from the step's record), so CUDA graphs on and off, and
   two runs, end on the same bits after 48 batches (16 updates). */
static void test_model_accumulation_graphs(void) {
    char off[512], on[512], again[512];
    const char *dev = "?";
    double acc_off, acc_on;
    temp_path(off, sizeof off, "accumulating_off");
    temp_path(on, sizeof on, "accumulating_on");
    temp_path(again, sizeof again, "accumulating_on_again");
    make_blobs();
    blobs_accumulate = 3;
    gemm_choices_begin("accumulating");
    acc_off = train_blobs("0", MPT_POLICY_MIXED_FLOAT16, 3, off, NULL);
    acc_on = train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, on, &dev);
    train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, again, NULL);
    gemm_choices_end();
    blobs_accumulate = 0;
    CHECK(!strcmp(dev, "cuda"), "the model trained on '%s'", dev);
    CHECK(acc_on == acc_off, "accuracy with CUDA graphs %.9g, without %.9g", acc_on, acc_off);
    CHECK(same_file(off, on), "accumulating: weights with CUDA graphs differ from those without "
          "(%s, %s)", on, off);
    CHECK(same_file(on, again), "accumulating: two runs gave different weights (%s, %s)", on,
          again);
    if (!test__current_failed) {
        remove(off);
        remove(on);
        remove(again);
    }
}

/* Occurrences of `needle` in the file `path`'s first MiB; -1 if unreadable. */
static long count_in_file(const char *path, const char *needle) {
    static char text[1 << 20];
    FILE *f = fopen(path, "rb");
    size_t n;
    long count = 0;
    const char *p;
    if (!f) return -1;
    n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    for (p = strstr(text, needle); p; p = strstr(p + 1, needle)) count++;
    return count;
}

/* The profiler on the GPU: steps 2..20 run as they are queued, with CUDA
   events between their pieces and the update layer by layer, and end
   where the unprofiled run (its steps replayed from CUDA graphs) ends, bit
   for bit; the trace has every layer's forward and backward in each of
   the 19 steps, and an update for each of the 3 layers with weights. */
static void test_model_profiled(void) {
    char off[512], on[512], dir[512], cmd[1200], trace[1024] = "";
    const char *tmp = getenv("TMPDIR");
    FILE *p;
    temp_path(off, sizeof off, "profile_off");
    temp_path(on, sizeof on, "profile_on");
    snprintf(dir, sizeof dir, "%s/mpt_test_cuda_%ld_profile", tmp && *tmp ? tmp : "/tmp",
             (long)getpid());
    make_blobs();
    gemm_choices_begin("profile");
    train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, off, NULL);
    blobs_profile_dir = dir;
    train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 3, on, NULL);
    blobs_profile_dir = NULL;
    gemm_choices_end();
    CHECK(same_file(off, on), "profiled weights differ from unprofiled ones (%s, %s)", on, off);
    snprintf(cmd, sizeof cmd, "find '%s' -name '*.trace.json'", dir);
    p = popen(cmd, "r");
    if (p) {
        if (fgets(trace, sizeof trace, p)) trace[strcspn(trace, "\n")] = 0;
        pclose(p);
    }
    CHECK(count_in_file(trace, "\"phase\": \"forward\"") == 19 * 4 &&
              count_in_file(trace, "\"phase\": \"backward\"") == 19 * 4 &&
              count_in_file(trace, "\"phase\": \"update\"") == 19 * 3,
          "trace '%s': %ld forward, %ld backward, %ld update events", trace,
          count_in_file(trace, "\"phase\": \"forward\""),
          count_in_file(trace, "\"phase\": \"backward\""),
          count_in_file(trace, "\"phase\": \"update\""));
    if (!test__current_failed) {
        remove(off);
        remove(on);
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) CHECK(0, "cannot remove %s", dir);
    }
}

/* (b) examples/mlp.c on the GPU: Flatten -> Dense(1024, relu) ->
   Dense(10, softmax), Adam 1e-3, batch 128, mixed_float16, seed 1, the
   example's default 20 epochs. bench/RESULTS.md ("Fashion-MNIST accuracy
   (CPU)") records a test accuracy of 0.8939 for this run on the CPU; the
   GPU sums in another order, so it trains along a slightly different path
   and must land within ±0.5 points of that. */
static void test_model_mlp_fashion_mnist(void) {
    const double cpu_accuracy = 0.8939;
    const char *dir = getenv("MPT_DATA_DIR") && *getenv("MPT_DATA_DIR")
                          ? getenv("MPT_DATA_DIR")
                          : "/usr/share/datasets/fashion-mnist";
    static char why[600];
    mpt_context *ctx = gpu_be[GPU_AUTO].ctx;
    mpt_dataset *train = NULL, *test = NULL;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    mpt_compile_desc cd;
    mpt_fit_desc fd;
    mpt_evaluate_desc ed;
    mpt_logs logs;
    double acc;
    if (mpt_dataset_load_mnist(ctx, dir, 0, &train) != MPT_OK ||
        mpt_dataset_load_mnist(ctx, dir, 1, &test) != MPT_OK) {
        snprintf(why, sizeof why, "no Fashion-MNIST (from $MPT_DATA_DIR or the default): %.500s",
                 mpt_context_error(ctx));
        if (gpu_required()) CHECK(0, "MPT_REQUIRE_GPU=1: %s", why);
        else SKIP(why);
        mpt_dataset_destroy(train);
        return;
    }
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 28;
    md.input_shape[1] = 28;
    md.input_shape[2] = 1;
    md.input_rank = 3;
    md.policy = MPT_POLICY_MIXED_FLOAT16;
    md.seed = 1;
    CHECK(mpt_model_create(ctx, &md, &m) == MPT_OK, "model: %s", mpt_context_error(ctx));
    if (m) {
        mpt_model_add_flatten(m, NULL);
        memset(&dd, 0, sizeof dd);
        dd.units = 1024;
        dd.activation = MPT_ACT_RELU;
        mpt_model_add_dense(m, &dd);
        dd.units = 10;
        dd.activation = MPT_ACT_SOFTMAX;
        mpt_model_add_dense(m, &dd);
        memset(&cd, 0, sizeof cd);
        cd.optimizer.type = MPT_OPTIMIZER_ADAM;
        cd.optimizer.learning_rate = 1e-3f;
        cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
        cd.metrics = MPT_METRIC_ACCURACY;
        CHECK(mpt_model_compile(m, &cd) == MPT_OK, "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_build(m, 128) == MPT_OK, "build: %s", mpt_context_error(ctx));
        memset(&fd, 0, sizeof fd);
        fd.epochs = 20;
        fd.batch_size = 128;
        CHECK(mpt_model_fit(m, train, &fd) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        memset(&ed, 0, sizeof ed);
        ed.batch_size = 128;
        CHECK(mpt_model_evaluate(m, test, &ed, &logs) == MPT_OK, "evaluate: %s",
              mpt_context_error(ctx));
        acc = mpt_logs_get(&logs, "accuracy");
        printf("# mlp mixed_float16 on the GPU: test accuracy %.4f (CPU: %.4f), %.0f samples/s\n",
               acc, cpu_accuracy, history_value(m, "samples_per_second", -1));
        CHECK(fabs(acc - cpu_accuracy) <= 0.005,
              "test accuracy %.4f is not within 0.5 points of the CPU's %.4f", acc, cpu_accuracy);
    }
    mpt_model_destroy(m);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
}

/* (c) A context allowed 1 MiB of device memory: building a model that
   needs far more fails with MPT_ERR_OUT_OF_MEMORY and a message giving
   the bytes, and everything is still released cleanly. */
static void test_model_out_of_memory(void) {
    mpt_context *ctx = NULL;
    mpt_context_desc cd;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    mpt_compile_desc cpl;
    mpt_status s;
    int i;
    memset(&cd, 0, sizeof cd);
    cd.device_memory_limit = (int64_t)1 << 20;
    cd.logger.fn = quiet_logger; /* the error is expected */
    if (mpt_context_create(&cd, &ctx) != MPT_OK) {
        CHECK(0, "a context with a 1 MiB limit cannot be created");
        return;
    }
    CHECK(!strcmp(mpt_context_backend(ctx, NULL)->name, "cuda"), "the context is on '%s'",
          mpt_context_backend(ctx, NULL)->name);
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 784;
    md.input_rank = 1;
    md.policy = MPT_POLICY_MIXED_FLOAT16;
    s = mpt_model_create(ctx, &md, &m);
    CHECK(s == MPT_OK, "model: %s", mpt_context_error(ctx));
    if (s == MPT_OK) {
        memset(&dd, 0, sizeof dd);
        dd.units = 4096;
        dd.activation = MPT_ACT_RELU;
        for (i = 0; i < 2; i++) mpt_model_add_dense(m, &dd);
        dd.units = 10;
        dd.activation = MPT_ACT_SOFTMAX;
        mpt_model_add_dense(m, &dd);
        memset(&cpl, 0, sizeof cpl);
        cpl.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
        mpt_model_compile(m, &cpl);
        s = mpt_model_build(m, 1024);
        CHECK(s == MPT_ERR_OUT_OF_MEMORY, "build under a 1 MiB limit returned %s, not out of "
              "memory", mpt_status_string(s));
        CHECK(strstr(mpt_context_error(ctx), "bytes") != NULL,
              "the message does not give the bytes: \"%s\"", mpt_context_error(ctx));
        printf("# out of device memory says: %s\n", mpt_context_error(ctx));
    }
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- choosing the device ---------------------------------------------------------------------------- */

#ifdef MPT_CUDA
static char last_warning[1024];
static void keep_warning(void *user, mpt_log_level level, const char *message) {
    (void)user;
    if (level == MPT_LOG_WARNING) snprintf(last_warning, sizeof last_warning, "%s", message);
}

static mpt_context *context_with_warnings(void) {
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.logger.fn = keep_warning;
    last_warning[0] = 0;
    if (mpt_context_create(&d, &ctx) != MPT_OK) return NULL;
    return ctx;
}

/* A CUDA build on a machine without a device: the context says so (a
   warning) and uses the CPU. */
static void test_fallback_warns(void) {
    mpt_context *ctx = context_with_warnings();
    CHECK(ctx != NULL, "the context was not created");
    if (!ctx) return;
    CHECK(!strcmp(mpt_context_backend(ctx, NULL)->name, "cpu"), "backend '%s'",
          mpt_context_backend(ctx, NULL)->name);
    CHECK(strstr(last_warning, "CPU") != NULL, "no warning about training on the CPU (got \"%s\")",
          last_warning);
    mpt_context_destroy(ctx);
}

/* ... and a model still trains there. */
static void test_fallback_trains(void) {
    double acc;
    const char *dev = "?";
    make_blobs();
    acc = train_blobs(NULL, MPT_POLICY_MIXED_FLOAT16, 4, NULL, &dev);
    CHECK(!strcmp(dev, "cpu"), "trained on '%s'", dev);
    CHECK(acc >= 0.9, "the blobs are not learnt on the CPU: accuracy %g", acc);
}

/* With a device, $MPT_DEVICE=cpu still chooses the CPU, without a warning. */
static void test_device_env_cpu(void) {
    mpt_context *ctx;
    setenv("MPT_DEVICE", "cpu", 1);
    ctx = context_with_warnings();
    unsetenv("MPT_DEVICE");
    CHECK(ctx != NULL, "the context was not created");
    if (!ctx) return;
    CHECK(!strcmp(mpt_context_backend(ctx, NULL)->name, "cpu"), "MPT_DEVICE=cpu gave '%s'",
          mpt_context_backend(ctx, NULL)->name);
    CHECK(last_warning[0] == 0, "unexpected warning \"%s\"", last_warning);
    mpt_context_destroy(ctx);
}
#endif

#ifdef MPT_CUDA
#define PROGRAM "test_cuda (MPT_CUDA)"
#else
#define PROGRAM "test_cuda (without MPT_CUDA)"
#endif

/* ---- main ---------------------------------------------------------------------------------------------- */

/* Opens the CPU reference and the CUDA contexts; 0 when there is no CUDA
   device (then nothing is left open). */
static int open_backends(void) {
    const char *env = getenv("MPT_DEVICE");
    if (env && !strcmp(env, "cpu")) return 0;
    if (!open_backend(&gpu_be[GPU_AUTO], "cuda (gemm auto)", 0, MPT_GEMM_AUTO)) return 0;
    if (strcmp(gpu_be[GPU_AUTO].t->name, "cuda") != 0) {
        close_backend(&gpu_be[GPU_AUTO]);
        return 0;
    }
    if (!open_backend(&cpu_be, "cpu", 1, MPT_GEMM_AUTO) ||
        !open_backend(&gpu_be[GPU_MPT], "cuda (gemm mpt)", 0, MPT_GEMM_MPT) ||
        !open_backend(&gpu_be[GPU_CUBLASLT], "cuda (gemm cublaslt)", 0, MPT_GEMM_CUBLASLT) ||
        !open_backend(&gpu_be[GPU_WGMMA], "cuda (gemm wgmma)", 0, MPT_GEMM_WGMMA)) {
        printf("FAIL opening the CPU and CUDA contexts\n");
        exit(1);
    }
    return 1;
}

/* Issue 5 (c): the mirrored strategy on a GPU — over all visible GPUs
   (one replica per GPU: here the lent machine's one) and over two logical
   replicas on one GPU — ends where the same strategy ends on the CPU.
   float32, SGD, one epoch: the GPU sums in another order, so the weights
   may differ by rounding only; allowed 1e-4 relative norm error. */
static mpt_model *mirrored_model(mpt_context *ctx, mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    mpt_batchnorm_desc bd;
    mpt_compile_desc cd;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = FEATURES;
    md.input_rank = 1;
    md.seed = 9;
    md.strategy = s;
    if (mpt_model_create(ctx, &md, &m) != MPT_OK) return NULL;
    memset(&dd, 0, sizeof dd);
    dd.units = 32;
    dd.activation = MPT_ACT_RELU;
    mpt_model_add_dense(m, &dd);
    memset(&bd, 0, sizeof bd);
    mpt_model_add_batch_normalization(m, &bd);
    dd.units = CLASSES;
    dd.activation = MPT_ACT_SOFTMAX;
    mpt_model_add_dense(m, &dd);
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_SGD;
    cd.optimizer.learning_rate = 0.05f;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    mpt_model_compile(m, &cd);
    return m;
}

static void test_mirrored_on_the_gpu(void) {
    int counts[2] = {1, 2}, c;
    make_blobs();
    for (c = 0; c < 2; c++) {
        mpt_context *ctxs[2] = {cpu_be.ctx, gpu_be[GPU_AUTO].ctx};
        float *w[2] = {NULL, NULL};
        int64_t n = 0;
        int k;
        for (k = 0; k < 2; k++) {
            mpt_strategy *s = NULL;
            mpt_strategy_desc sd;
            mpt_dataset *data = blob_dataset(ctxs[k]);
            mpt_model *m;
            mpt_fit_desc fd;
            int i;
            memset(&sd, 0, sizeof sd);
            sd.type = MPT_STRATEGY_MIRRORED;
            sd.num_replicas = counts[c];
            CHECK(mpt_strategy_create(ctxs[k], &sd, &s) == MPT_OK, "strategy: %s",
                  mpt_context_error(ctxs[k]));
            m = mirrored_model(ctxs[k], s);
            memset(&fd, 0, sizeof fd);
            fd.epochs = 1;
            fd.batch_size = 64;
            CHECK(m && mpt_model_fit(m, data, &fd) == MPT_OK, "%d replicas on %s: %s", counts[c],
                  k ? "the GPU" : "the CPU", mpt_context_error(ctxs[k]));
            n = 0;
            for (i = 0; m && i < mpt_model_param_count(m); i++) {
                mpt_param_info info;
                mpt_model_param(m, i, &info);
                n += mpt_tensor_count(&info.value);
            }
            w[k] = (float *)malloc(sizeof(float) * (size_t)(n + 1));
            for (i = 0, n = 0; m && w[k] && i < mpt_model_param_count(m); i++) {
                mpt_param_info info;
                const mpt_backend *t = mpt_context_backend(ctxs[k], NULL);
                void *impl;
                mpt_context_backend(ctxs[k], &impl);
                mpt_model_param(m, i, &info);
                t->download(impl, w[k] + n, info.value.data, mpt_tensor_bytes(&info.value));
                n += mpt_tensor_count(&info.value);
            }
            mpt_model_destroy(m);
            mpt_dataset_destroy(data);
            mpt_strategy_destroy(s);
        }
        if (w[0] && w[1]) {
            double num = 0, den = 0;
            int64_t e;
            for (e = 0; e < n; e++) {
                num += ((double)w[1][e] - w[0][e]) * ((double)w[1][e] - w[0][e]);
                den += (double)w[0][e] * w[0][e];
            }
            CHECK(sqrt(num / den) <= 1e-4, "%d replicas: GPU vs CPU weights, relative norm "
                  "error %.3g (allowed 1e-4)", counts[c], sqrt(num / den));
        }
        free(w[0]);
        free(w[1]);
    }
}

/* A fresh context on the GPU (one GEMM engine, so that no timing picks
   another between two runs) fits mirrored_model on the blobs, 2 epochs of
   64 (16 full batches: every step but the first two replayed), under a
   strategy of sd (NULL: none), and saves the weights to path. Returns
   whether the strategy has a communicator. */
static int fit_blobs_to_file(const mpt_strategy_desc *sd, const char *path) {
    mpt_context *ctx = NULL;
    mpt_context_desc cd;
    mpt_strategy *s = NULL;
    mpt_dataset *data;
    mpt_model *m;
    mpt_fit_desc fd;
    int comm;
    memset(&cd, 0, sizeof cd);
    cd.logger.fn = quiet_logger;
    cd.gemm = MPT_GEMM_MPT;
    if (mpt_context_create(&cd, &ctx) != MPT_OK) {
        CHECK(0, "context: cannot be created");
        return 0;
    }
    if (sd) CHECK(mpt_strategy_create(ctx, sd, &s) == MPT_OK, "strategy: %s", mpt_context_error(ctx));
    comm = s && s->comm;
    data = blob_dataset(ctx);
    m = !sd || s ? mirrored_model(ctx, s) : NULL;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 2;
    fd.batch_size = 64;
    CHECK(m && mpt_model_fit(m, data, &fd) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    if (m)
        CHECK(mpt_model_save_weights(m, path) == MPT_OK, "save_weights: %s",
              mpt_context_error(ctx));
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_strategy_destroy(s);
    mpt_context_destroy(ctx);
    return comm;
}

/* Two logical replicas on the GPU: fit records their step (one device, no
   collectives) in CUDA graphs and replays it, BatchNormalization's
   averaged statistics included; the weights equal, bit for bit, those of
   the same fit unrecorded (MPT_CUDA_GRAPHS=0). */
static void test_mirrored_graphs_change_nothing(void) {
    const mpt_strategy_desc sd = {.type = MPT_STRATEGY_MIRRORED, .num_replicas = 2};
    char path[2][512];
    int pass;
    temp_path(path[0], sizeof path[0], "mirrored_graphs_off");
    temp_path(path[1], sizeof path[1], "mirrored_graphs_on");
    make_blobs();
    for (pass = 0; pass < 2; pass++) {
        if (pass == 0) setenv("MPT_CUDA_GRAPHS", "0", 1);
        else unsetenv("MPT_CUDA_GRAPHS");
        fit_blobs_to_file(&sd, path[pass]);
    }
    unsetenv("MPT_CUDA_GRAPHS");
    CHECK(same_file(path[0], path[1]),
          "two replicas: weights with CUDA graphs differ from those without (%s, %s)", path[1],
          path[0]);
    if (!test__current_failed) {
        remove(path[0]);
        remove(path[1]);
    }
}

/* The hand step functions (mpt_model_compute_loss, _grad_stats,
   _scale_grads, _sgd_step) on the GPU against the CPU: the same model
   (seed), batch and calls on both; float32, so that both run the same
   formulas and differ by the order of their sums only (<= 1e-4 relative
   over a whole forward, backward and update). Then an inf and a NaN put
   into one gradient on the GPU make grad_stats report them. */
typedef struct hand_run {
    mpt_model *m;
    double loss, norm;
    int finite;
} hand_run;

static mpt_model *hand_model(mpt_context *ctx) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = FEATURES;
    md.input_rank = 1;
    md.seed = 9;
    if (mpt_model_create(ctx, &md, &m) != MPT_OK) {
        CHECK(0, "model: %s", mpt_context_error(ctx));
        return NULL;
    }
    memset(&dd, 0, sizeof dd);
    dd.units = 32;
    dd.activation = MPT_ACT_RELU;
    mpt_model_add_dense(m, &dd);
    dd.units = CLASSES;
    dd.activation = MPT_ACT_NONE;
    mpt_model_add_dense(m, &dd);
    CHECK(mpt_model_build(m, 64) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* forward, loss (times scale), backward, grad_stats, unscale, SGD. */
static void hand_step(backend *b, hand_run *r, float scale, float lr) {
    mpt_tensor x, y;
    mpt_loss_desc d;
    int64_t xs[2] = {64, FEATURES}, ys[1] = {64};
    memset(r, 0, sizeof *r);
    r->m = hand_model(b->ctx);
    if (!r->m) return;
    mpt_tensor_wrap(b->ctx, &x, MPT_FLOAT32, 2, xs, blob_x);
    mpt_tensor_wrap(b->ctx, &y, MPT_INT32, 1, ys, blob_y);
    memset(&d, 0, sizeof d);
    d.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    d.from_logits = 1;
    d.grad_scale = scale;
    CHECK(mpt_model_forward(r->m, &x, 1, NULL) == MPT_OK &&
              mpt_model_compute_loss(r->m, &d, &y, &r->loss) == MPT_OK &&
              mpt_model_backward(r->m, NULL, NULL) == MPT_OK &&
              mpt_model_grad_stats(r->m, &r->finite, &r->norm) == MPT_OK &&
              mpt_model_scale_grads(r->m, 1.0f / scale) == MPT_OK &&
              mpt_model_sgd_step(r->m, lr) == MPT_OK,
          "hand step on %s: %s", b->label, mpt_context_error(b->ctx));
}

/* An inf, then a NaN, uploaded into one element of the first gradient. */
static void hand_bad_gradient(backend *b, mpt_model *m) {
    const float bad[2] = {INFINITY, NAN};
    mpt_param_info w;
    int k;
    if (mpt_model_param(m, 0, &w) != MPT_OK) {
        CHECK(0, "param: %s", mpt_context_error(b->ctx));
        return;
    }
    for (k = 0; k < 2; k++) {
        int finite = -1;
        double norm = 0;
        int64_t at = test_randint(0, (int)mpt_tensor_count(&w.grad) - 1);
        be_put(b, (float *)w.grad.data + at, &bad[k], sizeof(float));
        CHECK(mpt_model_grad_stats(m, &finite, &norm) == MPT_OK, "grad_stats: %s",
              mpt_context_error(b->ctx));
        CHECK(finite == 0 && (k == 0 ? norm == INFINITY : norm != norm),
              "%g in %s[%lld] on %s: finite %d, norm %g", (double)bad[k], w.name, (long long)at,
              b->label, finite, norm);
    }
}

static void test_hand_step_functions(void) {
    hand_run cpu, gpu;
    int p;
    make_blobs();
    hand_step(&cpu_be, &cpu, 1024.0f, 0.1f);
    hand_step(&gpu_be[GPU_AUTO], &gpu, 1024.0f, 0.1f);
    if (!cpu.m || !gpu.m) {
        mpt_model_destroy(cpu.m);
        mpt_model_destroy(gpu.m);
        return;
    }
    CHECK(fabs(gpu.loss - cpu.loss) <= 1e-5 * cpu.loss, "loss %.9g on the GPU, %.9g on the CPU",
          gpu.loss, cpu.loss);
    CHECK(gpu.finite == 1 && cpu.finite == 1, "finite: GPU %d, CPU %d", gpu.finite, cpu.finite);
    CHECK(fabs(gpu.norm - cpu.norm) <= 1e-4 * cpu.norm,
          "gradient norm %.9g on the GPU, %.9g on the CPU", gpu.norm, cpu.norm);
    for (p = 0; p < mpt_model_param_count(cpu.m); p++) {
        mpt_param_info wc, wg;
        void *host;
        double err;
        mpt_model_param(cpu.m, p, &wc);
        mpt_model_param(gpu.m, p, &wg);
        host = be_fetch(&gpu_be[GPU_AUTO], wg.value.data, mpt_tensor_bytes(&wg.value), "sgd_step");
        err = rel_error(MPT_FLOAT32, host, MPT_FLOAT32, wc.value.data, mpt_tensor_count(&wc.value));
        CHECK(err <= 1e-4, "%s after the step: GPU against CPU %g", wc.name, err);
        free(host);
    }
    hand_bad_gradient(&gpu_be[GPU_AUTO], gpu.m);
    mpt_model_destroy(cpu.m);
    mpt_model_destroy(gpu.m);
}

/* ---- kernels loaded before any capture ------------------------------------------ */

/* Once a context exists on the device, every kernel of the CUDA backend is
   loaded there, though main asked for lazy loading (CUDA_MODULE_LOADING=
   LAZY, unless set otherwise) before the first CUDA call: no graph capture
   meets a kernel's first launch. Runs before any other test launches one. */
static void test_kernels_loaded_at_creation(void) {
#ifdef MPT_CUDA
    int unloaded;
    cudaSetDevice(0); /* the contexts' device */
    unloaded = mpt_cuda_kernels_unloaded();
    CHECK(unloaded == 0, "%d of the backend's kernels are not loaded (-1: the driver cannot tell)",
          unloaded);
#else
    SKIP("built without MPT_CUDA");
#endif
}

/* ---- two GPUs from one thread --------------------------------------------------- */

#ifdef MPT_CUDA
/* Table call `which` (0..N_DEVICE_CALLS-1) of b on its buffers a and c
   (256 floats each) and host (256 floats); returns its name. */
enum { N_DEVICE_CALLS = 14 };

static const char *device_call(const mpt_backend *t, void *impl, int which, float *a, float *c,
                               float *host) {
    void *more = NULL;
    switch (which) {
    case 0: t->zero(impl, a, 1024); return "zero";
    case 1: t->copy(impl, c, a, 1024); return "copy";
    case 2: t->scale(impl, a, 2.0f, 256); return "scale";
    case 3: t->add(impl, a, c, 256); return "add";
    case 4: t->convert(impl, MPT_FLOAT16, c, MPT_FLOAT32, a, 256); return "convert";
    case 5: t->activation(impl, MPT_ACT_RELU, a, 16, 16); return "activation";
    case 6: t->column_sums(impl, a, 16, 16, c, 0); return "column_sums";
    case 7: t->upload(impl, a, host, 1024); return "upload";
    case 8: t->download(impl, host, a, 1024); return "download";
    case 9: t->sync(impl); return "sync";
    case 10: t->upload_wait(impl); return "upload_wait";
    case 11: t->upload_done(impl); return "upload_done";
    case 12: t->batchnorm_workspace(impl, MPT_FLOAT32, 16, 16); return "batchnorm_workspace";
    default:
        if (t->alloc(impl, MPT_MEMORY_WORKSPACE, 256, &more) == MPT_OK) t->free(impl, 0, more);
        return "alloc and free";
    }
}

/* Each model's steps, two models on two GPUs in turn (a backward queued
   right after the other GPU's loss), then the gradients of model k into
   grads[k] (n floats each). */
static void interleaved_steps(mpt_model *const *m, int n_models, float **grads) {
    mpt_tensor x, y;
    mpt_loss_desc d;
    int64_t xs[2] = {64, FEATURES}, ys[1] = {64};
    double loss;
    int k, i;
    memset(&d, 0, sizeof d);
    d.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    d.from_logits = 1;
    for (k = 0; k < n_models; k++) {
        mpt_context *ctx = m[k]->ctx;
        mpt_tensor_wrap(ctx, &x, MPT_FLOAT32, 2, xs, blob_x);
        mpt_tensor_wrap(ctx, &y, MPT_INT32, 1, ys, blob_y);
        CHECK(mpt_model_forward(m[k], &x, 1, NULL) == MPT_OK &&
                  mpt_model_compute_loss(m[k], &d, &y, &loss) == MPT_OK,
              "model %d forward: %s", k, mpt_context_error(ctx));
    }
    for (k = 0; k < n_models; k++)
        CHECK(mpt_model_backward(m[k], NULL, NULL) == MPT_OK, "model %d backward: %s", k,
              mpt_context_error(m[k]->ctx));
    for (k = 0; k < n_models; k++) {
        void *impl;
        const mpt_backend *t = mpt_context_backend(m[k]->ctx, &impl);
        int64_t at = 0;
        for (i = 0; i < mpt_model_param_count(m[k]); i++) {
            mpt_param_info info;
            mpt_model_param(m[k], i, &info);
            CHECK(t->download(impl, grads[k] + at, info.grad.data, mpt_tensor_bytes(&info.grad)) ==
                      MPT_OK,
                  "model %d: downloading %s: %s", k, info.name, t->error(impl));
            at += mpt_tensor_count(&info.grad);
        }
    }
}

static int64_t grad_count(mpt_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info info;
        mpt_model_param(m, i, &info);
        n += mpt_tensor_count(&info.grad);
    }
    return n;
}
#endif

/* Replicas on several GPUs run from one thread. Two contexts on GPUs 0
   and 1: (a) each table call, made with the other GPU current, leaves its
   own GPU current; (b) two models stepped call by call in turn have the
   gradients, bit for bit, of the same model stepped alone on the same GPU
   (one GEMM engine, so that no timing picks another). Needs two GPUs. */
static void test_two_devices_from_one_thread(void) {
#ifdef MPT_CUDA
    mpt_context *ctx[2] = {NULL, NULL};
    mpt_model *m[4] = {NULL, NULL, NULL, NULL};
    float *grads[4] = {NULL, NULL, NULL, NULL}, host[256];
    int k, which, i;
    int64_t n;
    if (mpt_device_count(gpu_be[GPU_AUTO].ctx) - 1 < 2) {
        SKIP("one GPU: this needs two");
        return;
    }
    for (i = 0; i < 256; i++) host[i] = (float)test_uniform(-1, 1);
    for (k = 0; k < 2; k++) {
        mpt_context_desc d;
        memset(&d, 0, sizeof d);
        d.cuda_device = k;
        d.gemm = MPT_GEMM_MPT;
        d.logger.fn = quiet_logger;
        CHECK(mpt_context_create(&d, &ctx[k]) == MPT_OK &&
                  !strcmp(mpt_context_backend(ctx[k], NULL)->name, "cuda"),
              "no CUDA context on device %d", k);
    }
    for (k = 0; k < 2 && !test__current_failed; k++) {
        void *impl, *a = NULL, *c = NULL;
        const mpt_backend *t = mpt_context_backend(ctx[k], &impl);
        t->alloc(impl, MPT_MEMORY_WORKSPACE, 1024, &a);
        t->alloc(impl, MPT_MEMORY_WORKSPACE, 1024, &c);
        t->upload(impl, a, host, 1024);
        for (which = 0; which < N_DEVICE_CALLS; which++) {
            int current = -1;
            const char *name;
            cudaSetDevice(1 - k);
            name = device_call(t, impl, which, (float *)a, (float *)c, host);
            cudaGetDevice(&current);
            CHECK(current == k, "%s on GPU %d left GPU %d current", name, k, current);
        }
        CHECK(t->sync(impl) == MPT_OK, "GPU %d: %s", k, t->error(impl));
        t->free(impl, 0, a);
        t->free(impl, 0, c);
    }
    make_blobs();
    for (k = 0; k < 4 && !test__current_failed; k++) m[k] = hand_model(ctx[k % 2]);
    n = m[3] ? grad_count(m[3]) : 0;
    for (k = 0; k < 4 && n > 0; k++) grads[k] = (float *)calloc((size_t)n, sizeof(float));
    if (n > 0 && grads[3]) {
        interleaved_steps(m, 2, grads);
        interleaved_steps(m + 2, 1, grads + 2); /* alone on GPU 0 */
        interleaved_steps(m + 3, 1, grads + 3); /* alone on GPU 1 */
        for (k = 0; k < 2; k++)
            CHECK(!memcmp(grads[k], grads[k + 2], sizeof(float) * (size_t)n),
                  "GPU %d's gradients differ from those of the model alone there: element %lld",
                  k, (long long)first_difference(grads[k], grads[k + 2], n, 4));
    }
    for (k = 0; k < 4; k++) {
        mpt_model_destroy(m[k]);
        free(grads[k]);
    }
    mpt_context_destroy(ctx[0]);
    mpt_context_destroy(ctx[1]);
#else
    SKIP("built without MPT_CUDA");
#endif
}

#if defined(MPT_CUDA) && defined(MPT_NCCL)
/* The weights (replica 0's, n floats: malloc'd) after one epoch of the
   mirrored model of test_mirrored_on_the_gpu under strategy sd on ctx;
   NULL on failure. */
static float *mirrored_weights(mpt_context *ctx, const mpt_strategy_desc *sd, int64_t *n) {
    mpt_strategy *s = NULL;
    mpt_dataset *data = blob_dataset(ctx);
    mpt_model *m = NULL;
    mpt_fit_desc fd;
    float *w = NULL;
    int i;
    void *impl;
    const mpt_backend *t = mpt_context_backend(ctx, &impl);
    CHECK(mpt_strategy_create(ctx, sd, &s) == MPT_OK, "strategy: %s", mpt_context_error(ctx));
    if (s) m = mirrored_model(ctx, s);
    memset(&fd, 0, sizeof fd);
    fd.epochs = 1;
    fd.batch_size = 64;
    if (m && mpt_model_fit(m, data, &fd) == MPT_OK) {
        for (i = 0, *n = 0; i < mpt_model_param_count(m); i++) {
            mpt_param_info info;
            mpt_model_param(m, i, &info);
            *n += mpt_tensor_count(&info.value);
        }
        w = (float *)malloc(sizeof(float) * (size_t)(*n + 1));
        for (i = 0, *n = 0; w && i < mpt_model_param_count(m); i++) {
            mpt_param_info info;
            mpt_model_param(m, i, &info);
            t->download(impl, w + *n, info.value.data, mpt_tensor_bytes(&info.value));
            *n += mpt_tensor_count(&info.value);
        }
    } else {
        CHECK(0, "mirrored fit: %s", mpt_context_error(ctx));
    }
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_strategy_destroy(s);
    return w;
}
#endif

/* A mirrored model with one replica on each of two GPUs (NCCL sums their
   gradients and statistics, every call entering its replica's GPU from
   the one thread) ends where two logical replicas on GPU 0 end: the same
   sums in the same order, up to the GEMMs of two GPUs (<= 1e-5 relative
   norm). Needs two GPUs and mpt_cuda.cu built with -DMPT_NCCL. */
static void test_mirrored_on_two_gpus(void) {
#if defined(MPT_CUDA) && defined(MPT_NCCL)
    mpt_context *ctx = NULL;
    mpt_context_desc cd;
    mpt_strategy_desc sd;
    const int devices[2] = {0, 1};
    float *w[2] = {NULL, NULL};
    int64_t n[2] = {0, 0}, e;
    int k;
    if (mpt_device_count(gpu_be[GPU_AUTO].ctx) - 1 < 2) {
        SKIP("one GPU: this needs two");
        return;
    }
    memset(&cd, 0, sizeof cd);
    cd.logger.fn = quiet_logger;
    cd.gemm = MPT_GEMM_MPT;
    if (mpt_context_create(&cd, &ctx) != MPT_OK) {
        CHECK(0, "context: cannot be created");
        return;
    }
    make_blobs();
    for (k = 0; k < 2; k++) {
        memset(&sd, 0, sizeof sd);
        sd.type = MPT_STRATEGY_MIRRORED;
        if (k == 0) sd.num_replicas = 2; /* logical, on GPU 0 */
        else sd.devices = devices, sd.n_devices = 2;
        w[k] = mirrored_weights(ctx, &sd, &n[k]);
    }
    if (w[0] && w[1] && n[0] == n[1]) {
        double num = 0, den = 0;
        for (e = 0; e < n[0]; e++) {
            num += ((double)w[1][e] - w[0][e]) * ((double)w[1][e] - w[0][e]);
            den += (double)w[0][e] * w[0][e];
        }
        CHECK(sqrt(num / den) <= 1e-5, "two GPUs vs two replicas on one: relative norm error "
              "%.3g (allowed 1e-5)", sqrt(num / den));
    }
    free(w[0]);
    free(w[1]);
    mpt_context_destroy(ctx);
#else
    SKIP("needs mpt_cuda.cu built with -DMPT_NCCL");
#endif
}

/* Every required slot of the CUDA table is filled (@backend), and the
   collectives are there exactly when mpt_cuda.cu was built with NCCL. */
static void test_table_is_complete(void) {
    const mpt_backend *t = gpu_be[GPU_AUTO].t;
    const char *gap = backend_table_gap(t);
    CHECK(!gap, "the CUDA table: %s", gap);
#ifdef MPT_NCCL
    CHECK(t->comm_create != NULL, "built with MPT_NCCL, but the table has no collectives");
#endif
}

#ifdef MPT_NCCL
/* The NCCL path on one GPU: a communicator of one member (this context),
   whose all-reduce of fresh random floats gives them back unchanged (a
   sum over one member), queued on the backend's stream. */
static void test_nccl_one_member(void) {
    enum { COUNT = 4099 };
    backend *b = &gpu_be[GPU_AUTO];
    void *impls[1] = {b->impl};
    void *comm = NULL;
    float *host = (float *)random_values(MPT_FLOAT32, COUNT, -3, 3);
    float *dev = (float *)be_upload(b, host, nbytes(MPT_FLOAT32, COUNT));
    float *got;
    mpt_status s = b->t->comm_create(impls, 1, 0, 1, NULL, &comm);
    CHECK(s == MPT_OK && comm, "comm_create of one member: %s: %s", mpt_status_string(s),
          b->t->error(b->impl));
    if (s == MPT_OK && comm) {
        s = b->t->allreduce_sum(comm, &dev, COUNT);
        CHECK(s == MPT_OK, "allreduce_sum: %s", b->t->comm_error(comm));
        got = (float *)be_fetch(b, dev, nbytes(MPT_FLOAT32, COUNT), "allreduce_sum");
        CHECK(!memcmp(got, host, nbytes(MPT_FLOAT32, COUNT)),
              "the sum over one member changed element %lld",
              (long long)first_difference(got, host, COUNT, sizeof(float)));
        free(got);
        b->t->comm_destroy(comm);
    }
    free(host);
    be_release(b);
}

/* The collectives on one GPU: MPT_NCCL_ONE_GPU=1 gives a mirrored strategy
   of this GPU a communicator of one member, so the step's gradient sum
   and BatchNormalization's averaged statistics go through NCCL (sums over
   one member) inside the recorded step; the weights equal, bit for bit,
   those of the same fit with no strategy. */
static void test_one_member_strategy(void) {
    const mpt_strategy_desc sd = {.type = MPT_STRATEGY_MIRRORED};
    char path[2][512];
    temp_path(path[0], sizeof path[0], "no_strategy");
    temp_path(path[1], sizeof path[1], "one_member_comm");
    make_blobs();
    fit_blobs_to_file(NULL, path[0]);
    setenv("MPT_NCCL_ONE_GPU", "1", 1);
    CHECK(fit_blobs_to_file(&sd, path[1]), "no communicator under MPT_NCCL_ONE_GPU=1");
    unsetenv("MPT_NCCL_ONE_GPU");
    CHECK(same_file(path[0], path[1]),
          "weights through a one-member communicator differ from those with no strategy (%s, "
          "%s)", path[1], path[0]);
    if (!test__current_failed) {
        remove(path[0]);
        remove(path[1]);
    }
}
#endif

/* mpt_device_query on the GPU this test runs on: device 1 is CUDA device
   0 (the contexts above took cuda_device 0), a bfloat16-capable one. */
static void test_device_info_of_the_gpu(void) {
    mpt_context *ctx = gpu_be[GPU_AUTO].ctx;
    mpt_device_info d;
    int n = mpt_device_count(ctx);
    CHECK(n >= 2, "%d devices: no GPU after the CPU", n);
    if (n < 2) return;
    CHECK(mpt_device_query(ctx, 1, &d) == MPT_OK, "query: %s", mpt_context_error(ctx));
    CHECK(d.kind == MPT_DEVICE_CUDA && d.ordinal == 0, "kind %d ordinal %d", d.kind, d.ordinal);
    CHECK(d.name[0] != 0, "no name");
    CHECK(d.compute_major >= 8, "compute capability %d.%d", d.compute_major, d.compute_minor);
    CHECK(d.sm_count > 0, "%d SMs", d.sm_count);
    CHECK(d.memory_total > 0 && d.memory_free > 0 && d.memory_free <= d.memory_total,
          "%lld of %lld bytes free", (long long)d.memory_free, (long long)d.memory_total);
    CHECK(d.driver_version > 0 && d.runtime_version > 0, "driver %d runtime %d",
          d.driver_version, d.runtime_version);
    printf("# device 1: %s, sm_%d%d, %d SMs, %.1f of %.1f GiB free, driver %d, runtime %d\n",
           d.name, d.compute_major, d.compute_minor, d.sm_count,
           (double)d.memory_free / (1 << 30), (double)d.memory_total / (1 << 30),
           d.driver_version, d.runtime_version);
    CHECK(mpt_device_query(ctx, n, &d) == MPT_ERR_INVALID_ARGUMENT, "index %d accepted", n);
}

/* A model's memory_limit holds on the GPU too: below the plan, build
   fails naming the category; the report's categories sum to its total. */
/* no_flash_attention (the attention's weights kept for backward) is the
   CPU backend's alone: build on the GPU refuses it, naming the layer and
   the field. */
static void test_model_attention_kept_refused(void) {
    mpt_context *ctx = gpu_be[GPU_AUTO].ctx;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_multi_head_attention_desc ad;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 6;
    md.input_shape[1] = 4;
    md.input_rank = 2;
    if (mpt_model_create(ctx, &md, &m) != MPT_OK) {
        CHECK(0, "model: %s", mpt_context_error(ctx));
        return;
    }
    memset(&ad, 0, sizeof ad);
    ad.num_heads = 2;
    ad.key_dim = 2;
    ad.no_flash_attention = 1;
    CHECK(mpt_model_add_multi_head_attention(m, &ad) == MPT_OK, "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 4) == MPT_ERR_UNSUPPORTED &&
              strstr(mpt_context_error(ctx), "'multi_head_attention': no_flash_attention"),
          "build: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);
}

static void test_model_memory_limit_on_the_gpu(void) {
    mpt_context *ctx = gpu_be[GPU_AUTO].ctx;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_dense_desc dd;
    mpt_memory_report r;
    int64_t limit;
    int pass;
    memset(&r, 0, sizeof r);
    for (pass = 0; pass < 2; pass++) {
        memset(&md, 0, sizeof md);
        md.input_shape[0] = 37;
        md.input_rank = 1;
        md.policy = MPT_POLICY_MIXED_BFLOAT16;
        md.memory_limit = limit = pass == 0 ? 0 : r.parameters + r.gradients / 2;
        if (mpt_model_create(ctx, &md, &m) != MPT_OK) {
            CHECK(0, "model: %s", mpt_context_error(ctx));
            return;
        }
        memset(&dd, 0, sizeof dd);
        dd.units = 29;
        mpt_model_add_dense(m, &dd);
        if (pass == 0) {
            CHECK(mpt_model_build(m, 16) == MPT_OK, "build: %s", mpt_context_error(ctx));
            CHECK(mpt_model_memory(m, &r) == MPT_OK, "memory: %s", mpt_context_error(ctx));
            CHECK(r.parameters == (37 * 29 * 4 + 63) / 64 * 64 + (29 * 4 + 63) / 64 * 64 &&
                      r.total == r.parameters + r.gradients + r.optimizer + r.weight_copies +
                                     r.activations + r.workspace,
                  "parameters %lld, total %lld", (long long)r.parameters, (long long)r.total);
        } else {
            CHECK(mpt_model_build(m, 16) == MPT_ERR_OUT_OF_MEMORY, "built over %lld bytes",
                  (long long)limit);
            CHECK(strstr(mpt_context_error(ctx), "gradients") != NULL, "error: %s",
                  mpt_context_error(ctx));
        }
        mpt_model_destroy(m);
    }
}

/* Lines of a text file; -1 when it cannot be read. */
static int count_lines(const char *path) {
    FILE *f = fopen(path, "r");
    int lines = 0, ch;
    if (!f) return -1;
    while ((ch = fgetc(f)) != EOF) lines += ch == '\n';
    fclose(f);
    return lines;
}

/* Issue 9 A5: $MPT_GEMM_CHOICES carries MPT_GEMM_AUTO's engine choices
   from run to run. A context measures three shapes and writes one line
   each; a second context, opened on the same file (with a line that does
   not parse added), measures nothing (the file keeps its lines) and gives
   the first context's bits. */
static void test_gemm_choices_file(void) {
    static const int64_t shapes[3][3] = {{256, 512, 384}, {1000, 64, 2048}, {96, 4096, 512}};
    char path[512];
    backend runs[2];
    void *out[2][3];
    gemm_inputs in[3];
    gemm_case g[3];
    int r, i;
    FILE *f;
    temp_path(path, sizeof path, "gemm_choices");
    remove(path);
    for (i = 0; i < 3; i++) {
        memset(&g[i], 0, sizeof g[i]);
        g[i].m = shapes[i][0], g[i].n = shapes[i][1], g[i].k = shapes[i][2];
        g[i].tb = i == 1;
        g[i].ab = i == 2 ? MPT_BFLOAT16 : MPT_FLOAT16;
        g[i].c_dtype = MPT_FLOAT32;
        in[i] = gemm_make_inputs(&g[i]);
    }
    for (r = 0; r < 2; r++) {
        if (!open_backend_env_engine(&runs[r], r ? "cuda (gemm auto, choices read)"
                                                 : "cuda (gemm auto, choices written)",
                                     "MPT_GEMM_CHOICES", path, MPT_GEMM_AUTO)) {
            while (r-- > 0)
                for (i = 0; i < 3; i++) free(out[r][i]);
            for (i = 0; i < 3; i++) gemm_free_inputs(&in[i]);
            remove(path);
            return;
        }
        for (i = 0; i < 3; i++) out[r][i] = gemm_run(&runs[r], &g[i], MPT_FLOAT32, &in[i]);
        close_backend(&runs[r]);
        CHECK(count_lines(path) == 3 + r, "run %d: the choices file has %d lines, expected %d",
              r + 1, count_lines(path), 3 + r);
        if (r == 0 && (f = fopen(path, "a")) != NULL) {
            fputs("gemm sm_90 sms 132 m 256 n 5\n", f); /* cut short: skipped */
            fclose(f);
        }
    }
    for (i = 0; i < 3; i++) {
        CHECK(!memcmp(out[0][i], out[1][i], nbytes(MPT_FLOAT32, g[i].m * in[i].ldc)),
              "shape %d: the second run differs from the first at element %lld", i,
              (long long)first_difference(out[0][i], out[1][i], g[i].m * in[i].ldc, 4));
        free(out[0][i]);
        free(out[1][i]);
        gemm_free_inputs(&in[i]);
    }
    remove(path);
}

/* ---- the int8 GEMM (qgemm) ------------------------------------------------------ */

/* One qgemm case: the descriptor (pointers unset) and the bytes of its
   operands, fresh random for each case. */
typedef struct qgemm_case {
    mpt_qgemm_desc d;
    int8_t *a, *b;
    int32_t *bias, *multiplier, *shift;
    size_t a_bytes, b_bytes, c_bytes;
} qgemm_case;

static int8_t *random_bytes(size_t n) {
    int8_t *p = (int8_t *)malloc(n ? n : 1);
    size_t i;
    for (i = 0; i < n; i++) p[i] = (int8_t)test_randint(-128, 127);
    return p;
}

/* A random zero point: 0 (the common case) a third of the time. */
static int32_t random_zero_point(int lo, int hi) {
    return test_randint(0, 2) ? test_randint(lo, hi) : 0;
}

/* A leading dimension for rows of len bytes: len, len + 3 (the byte
   path), len + 16, or len rounded up to 16 (16-byte loads whose last one
   reads a part and zero-fills the rest). */
static int64_t random_ld(int64_t len) {
    switch (test_randint(0, 4)) {
    case 2: return len + 3;
    case 3: return len + 16;
    case 4: return (len + 15) / 16 * 16;
    default: return len;
    }
}

/* variant bit 0: uint8 A; bit 1: B transposed (N×K); bit 2: int32 C. The
   rest random: leading dimensions (random_ld), zero points, per-channel
   requantization, a bias (now and then near INT32_MAX, to saturate),
   shifts left and right, a ReLU-like clamp. */
static qgemm_case qgemm_case_make(int64_t m, int64_t n, int64_t k, int variant) {
    qgemm_case q;
    mpt_qgemm_desc *d = &q.d;
    int64_t j, channels;
    memset(&q, 0, sizeof q);
    d->m = m, d->n = n, d->k = k;
    d->a_unsigned = variant & 1;
    d->trans_b = (variant >> 1) & 1;
    d->lda = random_ld(k);
    d->ldb = random_ld(d->trans_b ? k : n);
    d->ldc = random_ld(n);
    d->a_zero_point = d->a_unsigned ? random_zero_point(0, 255) : random_zero_point(-128, 127);
    d->b_zero_point = random_zero_point(-128, 127);
    q.a_bytes = (size_t)(m * d->lda);
    q.b_bytes = (size_t)((d->trans_b ? n : k) * d->ldb);
    q.a = random_bytes(q.a_bytes);
    q.b = random_bytes(q.b_bytes);
    if (test_randint(0, 3)) {
        const int saturating = !test_randint(0, 3);
        q.bias = (int32_t *)malloc((size_t)n * 4);
        for (j = 0; j < n; j++)
            q.bias[j] = !saturating ? test_randint(-(1 << 20), 1 << 20)
                        : test_randint(0, 1) ? INT32_MAX - test_randint(0, 1000)
                                             : INT32_MIN + test_randint(0, 1000);
    }
    if (variant & 4) {
        q.c_bytes = (size_t)(m * d->ldc) * 4;
        return q;
    }
    q.c_bytes = (size_t)(m * d->ldc);
    d->per_channel = test_randint(0, 1);
    channels = d->per_channel ? n : 1;
    q.multiplier = (int32_t *)malloc((size_t)channels * 4);
    q.shift = (int32_t *)malloc((size_t)channels * 4);
    for (j = 0; j < channels; j++) {
        q.multiplier[j] = (int32_t)((1u << 30) + (uint32_t)test_randint(0, (1 << 30) - 1));
        q.shift[j] = test_randint(0, 7) ? test_randint(-20, -6) : test_randint(-31, 30);
    }
    d->c_zero_point = test_randint(-128, 127);
    if (test_randint(0, 1)) d->c_min = d->c_zero_point, d->c_max = 127; /* fused ReLU */
    return q;
}

static void qgemm_case_free(qgemm_case *q) {
    free(q->a);
    free(q->b);
    free(q->bias);
    free(q->multiplier);
    free(q->shift);
}

/* Runs q on backend b into C poisoned with the byte `poison`; returns C's
   bytes (malloc'ed). */
static void *qgemm_run(backend *b, const qgemm_case *q, int poison) {
    mpt_qgemm_desc d = q->d;
    const int64_t channels = d.per_channel ? d.n : 1;
    unsigned char *fill = (unsigned char *)malloc(q->c_bytes);
    void *c, *out;
    mpt_status s;
    d.a = be_upload(b, q->a, q->a_bytes);
    d.b = (const int8_t *)be_upload(b, q->b, q->b_bytes);
    if (q->bias) d.bias = (const int32_t *)be_upload(b, q->bias, (size_t)d.n * 4);
    if (q->multiplier) {
        d.multiplier = (const int32_t *)be_upload(b, q->multiplier, (size_t)channels * 4);
        d.shift = (const int32_t *)be_upload(b, q->shift, (size_t)channels * 4);
    }
    c = be_alloc(b, q->c_bytes);
    memset(fill, poison, q->c_bytes);
    be_put(b, c, fill, q->c_bytes);
    free(fill);
    if (q->multiplier) d.c_int8 = (int8_t *)c;
    else d.c = (int32_t *)c;
    s = b->t->qgemm(b->impl, &d);
    CHECK(s == MPT_OK, "qgemm on %s: %s: %s", b->label, mpt_status_string(s), b->t->error(b->impl));
    out = be_fetch(b, c, q->c_bytes, "qgemm");
    be_release(b);
    return out;
}

/* The CUDA int8 GEMM against the CPU's mpt_qgemm, bit for bit, C and the
   padding between its rows: odd shapes (tails in M, N and K, K = 0, K
   past one 64-deep step), every variant. C is poisoned with two
   different bytes on two runs, so that an element the kernel forgets
   cannot match the CPU's by chance on both. */
static void test_qgemm(void) {
    static const int64_t shapes[][3] = {{1, 1, 1},     {3, 5, 0},     {17, 13, 33},
                                        {64, 64, 64},  {65, 67, 129}, {130, 9, 5},
                                        {7, 200, 1000}, {128, 128, 256}, {33, 100, 4099},
                                        {300, 70, 31}, {1, 257, 96},  {257, 1, 97}};
    backend *gpu = &gpu_be[GPU_AUTO];
    size_t si;
    int variant, pass;
    for (si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (variant = 0; variant < 8; variant++) {
            qgemm_case q = qgemm_case_make(shapes[si][0], shapes[si][1], shapes[si][2], variant);
            for (pass = 0; pass < 2; pass++) {
                const int poison = pass ? 0x5A : 0xA5;
                unsigned char *want = (unsigned char *)qgemm_run(&cpu_be, &q, poison);
                unsigned char *got = (unsigned char *)qgemm_run(gpu, &q, poison);
                const size_t elem = q.multiplier ? 1 : 4;
                const int64_t bad = first_difference(got, want, (int64_t)(q.c_bytes / elem), elem);
                CHECK(bad < 0,
                      "qgemm %lldx%lldx%lld a_unsigned %d trans_b %d %s (zero points %ld %ld, "
                      "lda %lld ldb %lld ldc %lld, poison 0x%X): element (%lld, %lld) differs "
                      "from the CPU's",
                      (long long)q.d.m, (long long)q.d.n, (long long)q.d.k, q.d.a_unsigned,
                      q.d.trans_b, q.multiplier ? (q.d.per_channel ? "int8 per-channel" : "int8")
                                                : "int32",
                      (long)q.d.a_zero_point, (long)q.d.b_zero_point, (long long)q.d.lda,
                      (long long)q.d.ldb, (long long)q.d.ldc, poison,
                      bad < 0 ? -1LL : (long long)(bad / q.d.ldc),
                      bad < 0 ? -1LL : (long long)(bad % q.d.ldc));
                free(want);
                free(got);
            }
            qgemm_case_free(&q);
        }
}

/* Why no CUDA context opened, as the context's warning says it. */
static void test_gpu_was_reached(void) {
#ifdef MPT_CUDA
    const char *env = getenv("MPT_DEVICE");
    mpt_context *ctx = env && !strcmp(env, "cpu") ? NULL : context_with_warnings();
    mpt_context_destroy(ctx);
    CHECK(0, "MPT_REQUIRE_GPU=1, but the CUDA backend did not open: %s",
          env && !strcmp(env, "cpu") ? "MPT_DEVICE=cpu"
          : last_warning[0]          ? last_warning
                                     : "no reason given");
#else
    CHECK(0, "MPT_REQUIRE_GPU=1, but this program was built without MPT_CUDA");
#endif
}

/* Conv2D's implicit GEMMs (also `test_cuda conv`, the first look on a GPU:
   a failure here points at mpt_cuda.cu's @cuda-conv or the gather rule,
   and MPT_CUDA_CONV=im2col takes them out of a model's way). */
static void run_conv_tests(void) {
    test__run("conv_direct: Conv2D's forward, input and kernel gradients as implicit GEMMs, "
              "f16/bf16, strides 1-3, same/valid, 1x1 to 5x5, vs the CPU's im2col path (y, dx <= "
              "tolerance(dt); dkernel <= 1e-4), two runs identical",
              test_conv_direct);
    test__run("conv_direct: 3 channels, 12 filters, float32, 1x1 of stride 1, dz from out and dy, "
              "softmax and MPT_CUDA_CONV=im2col decline and write nothing",
              test_conv_direct_declines);
}

/* A CNN trained through them (also `test_cuda conv`). */
static void run_conv_model_test(void) {
    test__run("model: a mixed_float16 CNN (Conv2D of 8 and 16 channels) trains on the GPU as on "
              "the CPU (the weights' change <= 2e-2), two runs identical, MPT_CUDA_CONV=im2col "
              "other bits", test_model_cnn_on_the_gpu);
}

/* The Hopper GEMM's own tests (also `test_cuda wgmma`). */
static void run_wgmma_tests(void) {
    test__run("gemm wgmma: every transpose, f16/bf16, odd M/N/K, each epilogue, vs CPU and "
              "cuBLASLt (<= 1e-2), repeatable",
              test_gemm_wgmma);
    test__run("gemm wgmma: split-K on weight-gradient shapes, bit-repeatable, captured (<= 1e-2)",
              test_gemm_wgmma_split_k);
}

/* Every function of the table but the GEMM (`test_cuda layers`, a part of
   `quick` that compute-sanitizer's racecheck finishes in minutes). */
/* MultiHeadAttention's backend functions (also `test_cuda attention`). */
static void run_attention_test(void) {
    test__run("attention forward and backward: causal, Tq != Tk, the workspace path, the "
              "dropout mask (O <= tolerance(dt); dq, dk, dv <= 1e-4, 2^-9, 2^-6)",
              test_attention);
}

/* MultiHeadAttention in a model (also `test_cuda attention`). */
static void run_attention_model_test(void) {
    test__run("model: token ids through MultiHeadAttention (causal, dropout) learn on the GPU "
              "as on the CPU; CUDA graphs on and off and two runs identical",
              test_model_attention_on_the_gpu);
}

static void run_layer_tests(void) {
    test__run("kernels: all loaded when the context is created (lazy loading)",
              test_kernels_loaded_at_creation);
    test__run("the table: every required slot filled", test_table_is_complete);
    test__run("devices: the GPU's compute capability >= 8, free <= total memory",
              test_device_info_of_the_gpu);
    test__run("model: memory_limit below the plan refuses build on the GPU",
              test_model_memory_limit_on_the_gpu);
    test__run("model: MultiHeadAttention's no_flash_attention refused on the GPU, named",
              test_model_attention_kept_refused);
    test__run("relu and its gradient on NaN, inf, ±0, subnormals (CPU's bits)",
              test_relu_special_values);
    test__run("column_sums (float32 <= 1e-5)", test_column_sums);
    test__run("convert: every pair of float dtypes (exact)", test_convert);
    test__run("lookup_u8: bytes through a table, each float dtype (exact)", test_lookup_u8);
    test__run("activation: each one incl. softmax (<= 1e-5)", test_activation);
    test__run("activation_grad: each one, each dtype (<= 1e-5)", test_activation_grad);
    test__run("im2col (exact)", test_im2col);
    test__run("col2im (float32 <= 1e-5, float16 <= 2^-10, bfloat16 <= 2^-7)", test_col2im);
    test__run("pool forward and backward, max and average (max forward exact)", test_pool);
    test__run("batchnorm forward, backward, commit", test_batchnorm);
    test__run("dropout forward and backward (bit-exact mask)", test_dropout);
    test__run("elementwise: every op, each dtype, in place and unaligned (exact)",
              test_elementwise);
    test__run("copy_rows: planes of rows, every alignment (exact)", test_copy_rows);
    test__run("gather_rows, scatter_add_rows: each dtype (gather: uint8 too), repeated and bad "
              "ids (exact)",
              test_gather_scatter_rows);
    test__run("loss: every type, logits and probabilities, with metrics", test_loss);
    test__run("grad_stats + update: SGD, momentum, nesterov, Adam, AdamW, clipping", test_update);
    test__run("grad_stats + update over 111 odd-sized tensors, packed unaligned, in tables",
              test_update_many_tensors);
    test__run("loss_scale_update (exact)", test_loss_scale_update);
    test__run("graph capture and replay: bit-identical to direct calls", test_graph_capture);
    test__run("hand step: compute_loss, grad_stats, scale_grads, sgd_step as on the CPU (<= 1e-4)",
              test_hand_step_functions);
    test__run("im2col (exact) and col2im on the 32-bit and 64-bit index paths",
              test_layout_index_paths);
    run_conv_tests();
    test__run("layernorm forward and backward (y, dx <= tolerance(dt); statistics, dgamma, "
              "dbeta <= 1e-5)",
              test_layernorm);
    run_attention_test();
}

/* The int8 GEMM (also `test_cuda qgemm`). */
static void run_qgemm_test(void) {
    test__run("qgemm: int8 tensor cores against the CPU's mpt_qgemm, odd shapes, every "
              "variant (exact)",
              test_qgemm);
}

/* The GEMM engines (`test_cuda gemm`, the other part of `quick`). */
static void run_gemm_tests(void) {
    int e;
    for (e = 0; e < N_GPU; e++) test_gemm_engine(&gpu_be[e]);
    for (e = 0; e < N_GPU; e++) test_gemm_relu_keeps_nan(&gpu_be[e]);
#ifdef MPT_CUDA
    test__run("gemm: a shape cuBLASLt refuses is counted, logged once, and still right",
              test_lt_refusals_are_logged);
    test__run("gemm: MPT_ALLOW_TF32=1 opts float32 in to TF32 (<= 2e-3; off: <= 1e-5)",
              test_tf32_opt_in);
#endif
    test__run("gemm: 128x128 and 64x64 tiles, chosen and forced, 1536x1600x200 (<= 1e-2)",
              test_gemm_tiles);
    test__run("gemm: split-K on weight-gradient shapes, bit-repeatable, captured (<= 1e-2, 1e-4)",
              test_gemm_split_k);
    run_wgmma_tests();
    run_qgemm_test();
    test__run("gemm auto: $MPT_GEMM_CHOICES carries the engines to the next run (same bits)",
              test_gemm_choices_file);
}

/* `test_cuda quick` (what ./build.sh gpu sanitize runs under
   compute-sanitizer, many times slower): the table's functions only, none
   of the whole-model trainings. */
/* Every context closed, then the counts (each way out of main). */
static int closed_summary(void) {
    int e;
    for (e = 0; e < N_GPU; e++) close_backend(&gpu_be[e]);
    close_backend(&cpu_be);
    return test_summary(PROGRAM);
}

int main(int argc, char **argv) {
    int have_gpu, quick = argc > 1 && !strcmp(argv[1], "quick");
    int wgmma_only = argc > 1 && !strcmp(argv[1], "wgmma");
    int gemm_only = argc > 1 && !strcmp(argv[1], "gemm");
    int layers_only = argc > 1 && !strcmp(argv[1], "layers");
    int qgemm_only = argc > 1 && !strcmp(argv[1], "qgemm");
    int attention_only = argc > 1 && !strcmp(argv[1], "attention");
    int conv_only = argc > 1 && !strcmp(argv[1], "conv");
    test_seed(2024);
#ifdef MPT_CUDA
    setenv("CUDA_MODULE_LOADING", "LAZY", 0); /* what test_kernels_loaded_at_creation needs */
#endif
    have_gpu = open_backends();
    if (!have_gpu && gpu_required()) {
        test__run("a CUDA device is reached (MPT_REQUIRE_GPU=1)", test_gpu_was_reached);
        return test_summary(PROGRAM);
    }
#ifdef MPT_CUDA
    if (!have_gpu && !(getenv("MPT_DEVICE") && !strcmp(getenv("MPT_DEVICE"), "cpu"))) {
        test__run("no CUDA device: the context warns and uses the CPU", test_fallback_warns);
        test__run("no CUDA device: a model still trains on the CPU", test_fallback_trains);
    }
    if (have_gpu) test__run("MPT_DEVICE=cpu chooses the CPU", test_device_env_cpu);
#endif
    if (!have_gpu) {
        test__begin();
#ifdef MPT_CUDA
        SKIP("no CUDA device");
#else
        SKIP("no CUDA device (built without MPT_CUDA)");
#endif
        test__end("the CUDA backend against the CPU backend");
        return test_summary(PROGRAM);
    }
    printf("# CPU reference against the CUDA contexts; gemm_rounds_c %d, can_capture %d\n",
           gpu_be[GPU_AUTO].t->gemm_rounds_c, gpu_be[GPU_AUTO].t->can_capture);
    if (wgmma_only) {
        /* `test_cuda wgmma`: the Hopper GEMM's tests alone (a first look on a
           new machine, and what compute-sanitizer runs on it) */
        test_gemm_engine(&gpu_be[GPU_WGMMA]);
        run_wgmma_tests();
        return closed_summary();
    }
    if (qgemm_only) {
        /* `test_cuda qgemm`: the int8 GEMM's test alone */
        run_qgemm_test();
        return closed_summary();
    }
    if (conv_only) {
        /* `test_cuda conv`: Conv2D's implicit GEMMs alone */
        run_conv_tests();
        run_conv_model_test();
        return closed_summary();
    }
    if (attention_only) {
        /* `test_cuda attention`: MultiHeadAttention's tests alone */
        run_attention_test();
        run_attention_model_test();
        return closed_summary();
    }
    if (!gemm_only) run_layer_tests();
    if (!layers_only) run_gemm_tests();
    if (!quick && !gemm_only && !layers_only) {
        test__run("model: graphs on and off, and two runs, give identical weights",
                  test_model_graphs_and_determinism);
        test__run("model: a graph (fan-out, Add, Concatenate) learns, CUDA graphs on and off "
                  "and two runs identical", test_model_graph_on_the_gpu);
        test__run("model: token ids (Embedding, PositionEmbedding) learn; CUDA graphs on and off "
                  "and two runs identical; a bad id refused", test_model_of_ids_on_the_gpu);
        run_attention_model_test();
        run_conv_model_test();
        test__run("model: two inputs (numbers, ids) train on the GPU to the CPU's weights "
                  "(<= 1e-4), two runs identical", test_model_two_inputs_on_the_gpu);
        test__run("model: two outputs (a classifier, a regression) train on the GPU to the "
                  "CPU's weights and logs (<= 1e-4), two runs identical",
                  test_model_two_outputs_on_the_gpu);
        test__run("model: profiled steps (CUDA events) end where unprofiled ones do, bit for bit",
                  test_model_profiled);
        test__run("model: examples/mlp.c mixed_float16 on Fashion-MNIST within 0.5 points of "
                  "the CPU", test_model_mlp_fashion_mnist);
        test__run("model: a 1 MiB device limit gives out of memory, with the bytes",
                  test_model_out_of_memory);
        test__run("mirrored: 1 and 2 replicas on the GPU end where they end on the CPU (<= 1e-4)",
                  test_mirrored_on_the_gpu);
        test__run("mirrored: two replicas' steps recorded in CUDA graphs equal them unrecorded "
                  "(exact)",
                  test_mirrored_graphs_change_nothing);
        test__run("two GPUs from one thread: every call on its own GPU, results as alone",
                  test_two_devices_from_one_thread);
        test__run("mirrored: one replica on each of two GPUs (NCCL) as two on one (<= 1e-5)",
                  test_mirrored_on_two_gpus);
        test__run("model: accumulating 3 batches, CUDA graphs on and off and two runs identical",
                  test_model_accumulation_graphs);
    }
#ifdef MPT_NCCL
    test__run("NCCL: a communicator of one GPU, its all-reduce leaves the floats as they are",
              test_nccl_one_member);
    test__run("NCCL: a mirrored strategy of one GPU through a one-member communicator "
              "(MPT_NCCL_ONE_GPU=1) trains to the weights of no strategy (same bits)",
              test_one_member_strategy);
#endif
#ifdef MPT_CUDA
    printf("# cuBLASLt refusals: gemm auto %lld, mpt %lld, cublaslt %lld (each logged once)\n",
           (long long)mpt_cuda_lt_refusals(gpu_be[GPU_AUTO].impl),
           (long long)mpt_cuda_lt_refusals(gpu_be[GPU_MPT].impl),
           (long long)mpt_cuda_lt_refusals(gpu_be[GPU_CUBLASLT].impl));
    printf("# GEMMs per engine in gemm auto: mpt %lld, wgmma %lld, cublaslt %lld; the Hopper "
           "kernel %s\n",
           (long long)mpt_cuda_gemm_runs(gpu_be[GPU_AUTO].impl, MPT_GEMM_MPT),
           (long long)mpt_cuda_gemm_runs(gpu_be[GPU_AUTO].impl, MPT_GEMM_WGMMA),
           (long long)mpt_cuda_gemm_runs(gpu_be[GPU_AUTO].impl, MPT_GEMM_CUBLASLT),
           mpt_cuda_wgmma_ready(gpu_be[GPU_AUTO].impl) ? "runs here" : "is not here");
#endif
    return closed_summary();
}

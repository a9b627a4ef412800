/* CUDA benchmarks: the hand-written GEMM against cuBLASLt's, training speed
   of the example models on the GPU, and a large MLP in float32 against
   mixed_float16 (speed and memory).

       nvcc -std=c++17 -O2 -arch=native -DMPT_CUDA -x cu -I. bench/bench_cuda.c mpt_cuda.cu \
            -o build/bench_cuda -lcublasLt -lcublas -lz
       ./build/bench_cuda                 (everything; a few minutes)
       ./build/bench_cuda gemm|train|large|int8   (one part)

   Built without MPT_CUDA, or run where there is no CUDA device, it prints
   one line saying that it needs one and exits with 0; with
   MPT_REQUIRE_GPU=1 in the environment (./build.sh gpu) it exits with 1.
   The data: Fashion-MNIST from $MPT_DATA_DIR, else
   /usr/share/datasets/fashion-mnist.

   (a) GEMM. Three contexts, with gemm = MPT_GEMM_MPT (the mma.sync
       kernel), MPT_GEMM_WGMMA (the Hopper kernel, where the GPU, the build
       and the shape allow; else the mma.sync kernel ran, and the line's
       "hopper_kernel" says 0) and MPT_GEMM_CUBLASLT, run the same products
       one after another: 4096³ and the shapes the mlp and cnn train with
       (batch 128), for float16 and bfloat16 operands.
       C is in the dtype training stores it in: the operands' dtype for the
       forward products, float32 for the input gradients (Dense's dx and
       Conv2D's dcols are float32 before any conversion) and the weight
       gradients. Each product is
       planned (gemm_plan), run 3 times to warm up, then N times between two
       syncs, timed with clock_gettime; N is chosen so that the timed run
       takes about 0.2 s. TFLOP/s = 2·M·N·K / seconds per product. One
       JSON line per engine and product ("bench":"gemm"), with its ratio to
       cuBLASLt's time measured just after it in the same run.
   (b) Training. samples/s of mpt_model_fit (verbose 0) over one epoch, the
       history's "samples_per_second" (wall time of the epoch), median of 3
       epochs after a warm-up fit (which also records the CUDA graphs), for
       the examples' mlp and cnn at batch 128 and 1024, float32 and
       mixed_float16, on Fashion-MNIST (synthetic images of the same shape
       when it is not installed). Sample counts are whole batches: mlp
       59,392 (58 × 1024), cnn 25,600 (25 × 1024).
   (c) Large MLP. Flatten -> 4 × Dense(4096, relu) -> Dense(10, softmax) at
       batch 4096: samples/s in float32 and mixed_float16, the ratio, and
       the device memory of each category as mpt_model_summary reports it.
   (d) int8 GEMM (`int8`). The table's qgemm (mma.sync s8) against
       cublasLtMatmul with CUDA_R_8I operands and CUBLAS_COMPUTE_32I, both
       to int32 C with no zero points, timed as (a) times them; the two
       results must be the same bits ("same_bits"). Then the qgemm's int8
       output (zero points, bias, per-channel requantization), which
       cuBLASLt has no int8 form for. TOPS = 2·M·N·K / seconds.

   Prints Markdown tables and one JSON line per result. Every JSON line
   opens with where it came from: "commit" and "arch" (the build's:
   -DMPT_BENCH_COMMIT and -DMPT_BENCH_ARCH, which ./build.sh gpu passes;
   "unknown" otherwise), "device", "compute", "driver" and "runtime" (the
   GPU's, as the driver reports them), "date" (UTC, when the run began)
   and "tf32" (1 when MPT_ALLOW_TF32=1 let float32 products run in TF32).
   Each GEMM shape cuBLASLt refused gets a line of its own
   ("bench":"cuda_lt_refused", with the shape as the library logged it),
   and a last line counts them. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

#ifdef MPT_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

#ifndef MPT_BENCH_COMMIT
#define MPT_BENCH_COMMIT "unknown"
#endif
#ifndef MPT_BENCH_ARCH
#define MPT_BENCH_ARCH "unknown"
#endif

/* "commit":...,"date":... : what every JSON line opens with (main fills it). */
static char provenance[512] = "\"commit\":\"" MPT_BENCH_COMMIT "\",\"arch\":\"" MPT_BENCH_ARCH "\"";

/* A JSON line as the program built it ("{\"bench\":..."), printed with the
   provenance first. */
static void print_json(const char *line) {
    printf("{%s,%s\n", provenance, line + 1);
}

/* The shapes cuBLASLt refused, from the library's log message (said once
   per shape and context): "cuBLASLt refused gemm m=.. n=.. k=.. (...)". */
enum { MAX_REFUSED = 64 };
static char refused[MAX_REFUSED][256];
static int n_refused;

static void refusal_logger(void *user, mpt_log_level level, const char *msg) {
    static const char head[] = "cuBLASLt refused gemm ";
    const char *end;
    size_t n;
    (void)user;
    if (strncmp(msg, head, sizeof head - 1) != 0) {
        if (level <= MPT_LOG_WARNING) /* as the default logger would */
            fprintf(stderr, "mpt %s: %s\n", level == MPT_LOG_ERROR ? "error" : "warning", msg);
        return;
    }
    msg += sizeof head - 1;
    end = strstr(msg, "):"); /* the shape, up to the reason */
    n = end ? (size_t)(end - msg) + 1 : strlen(msg);
    if (n_refused < MAX_REFUSED)
        snprintf(refused[n_refused++], sizeof refused[0], "%.*s", (int)n, msg);
}

static int open_context(mpt_gemm_engine gemm, mpt_context **ctx) {
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.gemm = gemm;
    d.logger.fn = refusal_logger;
    *ctx = NULL;
    if (mpt_context_create(&d, ctx) != MPT_OK) return 0;
    return !strcmp(mpt_context_backend(*ctx, NULL)->name, "cuda");
}

/* The GPU the contexts took (mpt device 1: CUDA device 0), with the
   driver and runtime versions, for the header and the results' record. */
static void device_name(mpt_context *ctx, char *buf, size_t size) {
    mpt_device_info d;
    snprintf(buf, size, "?");
    if (mpt_device_query(ctx, 1, &d) != MPT_OK) return;
    snprintf(buf, size, "%s (sm_%d%d, %d SMs, %.1f GiB, driver %d, runtime %d)", d.name,
             d.compute_major, d.compute_minor, d.sm_count, (double)d.memory_total / (1 << 30),
             d.driver_version, d.runtime_version);
}

/* Whether float32 products ran in TF32 (MPT_ALLOW_TF32=1; else true float32). */
static int allows_tf32(const mpt_context *ctx) {
#ifdef MPT_CUDA
    void *impl = NULL;
    const mpt_backend *t = mpt_context_backend(ctx, &impl);
    return t && !strcmp(t->name, "cuda") ? mpt_cuda_allows_tf32(impl) : 0;
#else
    (void)ctx;
    return 0;
#endif
}

/* The settings that change which path a measurement took, as
   "NAME=value" separated by spaces ("" when none is set). */
static void path_settings(char *out, size_t size) {
    static const char *const names[] = {"MPT_CUDA_CONV", "MPT_CUDA_GRAPHS", "MPT_RESIDENT",
                                        "MPT_UPLOAD_BYTES", "MPT_GEMM", "MPT_GEMM_AUTO_WGMMA",
                                        "MPT_GEMM_CHOICES", "MPT_ALLOW_TF32", "MPT_CUDA_GEMM_TILE",
                                        "MPT_CUDA_INDEX64"};
    size_t i, n = 0;
    out[0] = '\0';
    for (i = 0; i < sizeof names / sizeof names[0] && n < size; i++) {
        const char *v = getenv(names[i]);
        if (v) n += (size_t)snprintf(out + n, size - n, "%s%s=%.40s", n ? " " : "", names[i], v);
    }
    for (i = 0; out[i]; i++) /* kept a JSON string whatever the values hold */
        if (out[i] == '"' || out[i] == '\\' || (unsigned char)out[i] < 0x20) out[i] = '?';
}

/* The rest of the provenance: the GPU (mpt device 1), the date, whether
   float32 ran in TF32, and the path settings (path_settings). */
static void record_provenance(mpt_context *ctx) {
    char settings[256];
    mpt_device_info d;
    char date[32];
    time_t now = time(NULL);
    size_t n = strlen(provenance);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    path_settings(settings, sizeof settings);
    if (mpt_device_query(ctx, 1, &d) != MPT_OK) {
        memset(&d, 0, sizeof d);
        snprintf(d.name, sizeof d.name, "?");
    }
    snprintf(provenance + n, sizeof provenance - n,
             ",\"device\":\"%s\",\"compute\":\"sm_%d%d\",\"driver\":%d,\"runtime\":%d,"
             "\"date\":\"%s\",\"tf32\":%d,\"settings\":\"%s\"", d.name, d.compute_major,
             d.compute_minor, d.driver_version, d.runtime_version, date, allows_tf32(ctx),
             settings);
}

/* GEMM shapes cuBLASLt refused on ctx's CUDA backend (each logged once
   when it happened); 0 when ctx is not on one. */
static long long lt_refusals(const mpt_context *ctx) {
#ifdef MPT_CUDA
    void *impl = NULL;
    const mpt_backend *t = ctx ? mpt_context_backend(ctx, &impl) : NULL;
    if (t && !strcmp(t->name, "cuda")) return (long long)mpt_cuda_lt_refusals(impl);
#else
    (void)ctx;
#endif
    return 0;
}

/* ---- (a) GEMM: hand-written against cuBLASLt ------------------------------------ */

typedef struct shape {
    const char *what;
    int64_t m, n, k;
    int ta, tb;
    int c_half; /* C in the operands' dtype (else float32, as training's dx) */
} shape;

static const shape gemm_shapes[] = {
    {"square", 4096, 4096, 4096, 0, 0, 1},
    {"mlp fwd 1", 128, 1024, 784, 0, 0, 1},
    {"mlp bwd 1 dX", 128, 784, 1024, 0, 1, 0},
    {"mlp bwd 1 dW", 784, 1024, 128, 1, 0, 0},
    {"mlp fwd 2", 128, 10, 1024, 0, 0, 1},
    {"mlp bwd 2 dX", 128, 1024, 10, 0, 1, 0},
    {"mlp bwd 2 dW", 1024, 10, 128, 1, 0, 0},
    {"mlp fwd 1, batch 1024", 1024, 1024, 784, 0, 0, 1},
    {"cnn conv1 fwd", 128 * 26 * 26, 32, 9, 0, 0, 1},
    {"cnn conv1 bwd dW", 9, 32, 128 * 26 * 26, 1, 0, 0},
    {"cnn conv2 fwd", 128 * 24 * 24, 32, 288, 0, 0, 1},
    {"cnn conv2 bwd dX", 128 * 24 * 24, 288, 32, 0, 1, 0},
    {"cnn conv2 bwd dW", 288, 32, 128 * 24 * 24, 1, 0, 0},
    {"cnn conv3 fwd", 128 * 10 * 10, 64, 288, 0, 0, 1},
    {"cnn conv4 fwd", 128 * 8 * 8, 64, 576, 0, 0, 1},
    {"cnn conv4 bwd dX", 128 * 8 * 8, 576, 64, 0, 1, 0},
    {"cnn dense fwd", 128, 512, 1024, 0, 0, 1},
    {"cnn dense bwd dW", 1024, 512, 128, 1, 0, 0},
    {"large mlp fwd", 4096, 4096, 4096, 0, 0, 1},
    {"large mlp bwd dW", 4096, 4096, 4096, 1, 0, 0},
};

/* Random values in [-1, 1) in dtype, uploaded to a new buffer. */
static void *device_random(const mpt_backend *t, void *impl, mpt_dtype dt, int64_t n) {
    size_t bytes = (size_t)n * mpt_dtype_size(dt);
    void *host = random_values(dt, n), *dev = NULL;
    if (t->alloc(impl, MPT_MEMORY_WORKSPACE, bytes, &dev) != MPT_OK ||
        t->upload(impl, dev, host, bytes) != MPT_OK) {
        if (dev) t->free(impl, MPT_MEMORY_WORKSPACE, dev);
        dev = NULL;
    }
    free(host);
    return dev;
}

/* Seconds per product on ctx's GEMM engine; a negative value on failure
   (the message then printed). */
static double time_gemm(mpt_context *ctx, const shape *s, mpt_dtype dt) {
    void *impl;
    const mpt_backend *t = mpt_context_backend(ctx, &impl);
    mpt_dtype c_dtype = s->c_half ? dt : MPT_FLOAT32;
    void *a = device_random(t, impl, dt, s->m * s->k), *b = device_random(t, impl, dt, s->k * s->n);
    void *c = NULL;
    double seconds = -1;
    int reps = 10, i;
    if (a && b && t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)(s->m * s->n) * 4, &c) == MPT_OK) {
        const mpt_gemm_desc d = gemm_desc(s->m, s->n, s->k, s->ta, s->tb, dt, a, b, (float *)c);
        if (!t->gemm_plan || t->gemm_plan(impl, &d, c_dtype) == MPT_OK) {
            double t0, dt_s;
            for (i = 0; i < 3; i++) t->gemm(impl, &d, c_dtype);
            t->sync(impl);
            t0 = now();
            for (i = 0; i < reps; i++) t->gemm(impl, &d, c_dtype);
            t->sync(impl);
            dt_s = (now() - t0) / reps;
            /* the timed run: about 0.2 s */
            reps = dt_s > 0 ? (int)(0.2 / dt_s) : 1000;
            reps = reps < 10 ? 10 : reps > 100000 ? 100000 : reps;
            t0 = now();
            for (i = 0; i < reps; i++) t->gemm(impl, &d, c_dtype);
            if (t->sync(impl) == MPT_OK) seconds = (now() - t0) / reps;
        }
    }
    if (seconds < 0) fprintf(stderr, "bench_cuda: gemm %s: %s\n", s->what, t->error(impl));
    if (a) t->free(impl, MPT_MEMORY_WORKSPACE, a);
    if (b) t->free(impl, MPT_MEMORY_WORKSPACE, b);
    if (c) t->free(impl, MPT_MEMORY_WORKSPACE, c);
    return seconds;
}

/* GEMMs the Hopper kernel ran on ctx so far (0 off a CUDA backend). */
static long long hopper_runs(const mpt_context *ctx) {
#ifdef MPT_CUDA
    void *impl = NULL;
    const mpt_backend *t = ctx ? mpt_context_backend(ctx, &impl) : NULL;
    if (t && !strcmp(t->name, "cuda")) return (long long)mpt_cuda_gemm_runs(impl, MPT_GEMM_WGMMA);
#else
    (void)ctx;
#endif
    return 0;
}

static void bench_gemm(mpt_context *ctxs[3]) {
    static const mpt_dtype dts[2] = {MPT_FLOAT16, MPT_BFLOAT16};
    static const char *const engines[3] = {"mpt", "wgmma", "cublaslt"};
    static char json[3 * 64][512];
    int n_json = 0, si, di, e;
    printf("\n## GEMM: the mma.sync kernel (mpt) and the Hopper kernel (wgmma) against "
           "cuBLASLt\n\n");
    printf("| shape | M×N×K | op | dtype | C | mpt TFLOP/s | wgmma TFLOP/s (ran) | cuBLASLt "
           "TFLOP/s | mpt / cuBLASLt | wgmma / cuBLASLt |\n");
    printf("|---|---|---|---|---|---:|---:|---:|---:|---:|\n");
    for (si = 0; si < (int)(sizeof gemm_shapes / sizeof gemm_shapes[0]); si++)
        for (di = 0; di < 2; di++) {
            const shape *s = &gemm_shapes[si];
            double flop = 2.0 * (double)s->m * (double)s->n * (double)s->k;
            double secs[3], tf[3];
            long long before = hopper_runs(ctxs[1]), hopper = 0;
            char tr[3] = {s->ta ? 't' : 'n', s->tb ? 't' : 'n', 0};
            const char *c_name = s->c_half ? mpt_dtype_name(dts[di]) : "float32";
            for (e = 0; e < 3; e++) {
                secs[e] = time_gemm(ctxs[e], s, dts[di]);
                tf[e] = secs[e] > 0 ? flop / secs[e] * 1e-12 : 0;
                if (e == 1) hopper = hopper_runs(ctxs[1]) - before > 0;
            }
            printf("| %s | %lld×%lld×%lld | %s | %s | %s | %.2f | %.2f (%s) | %.2f | %.2f | %.2f "
                   "|\n",
                   s->what, (long long)s->m, (long long)s->n, (long long)s->k, tr,
                   mpt_dtype_name(dts[di]), c_name, tf[0], tf[1], hopper ? "wgmma" : "mma.sync",
                   tf[2], tf[2] > 0 ? tf[0] / tf[2] : 0, tf[2] > 0 ? tf[1] / tf[2] : 0);
            fflush(stdout);
            for (e = 0; e < 3 && n_json < 3 * 64; e++)
                snprintf(json[n_json++], sizeof json[0],
                         "{\"bench\":\"gemm\",\"engine\":\"%s\",\"shape\":\"%s\",\"m\":%lld,"
                         "\"n\":%lld,\"k\":%lld,\"trans\":\"%s\",\"dtype\":\"%s\","
                         "\"c_dtype\":\"%s\",\"tflops\":%.3f,\"seconds\":%.6g,"
                         "\"cublaslt_tflops\":%.3f,\"ratio_to_cublaslt\":%.3f,"
                         "\"hopper_kernel\":%d}",
                         engines[e], s->what, (long long)s->m, (long long)s->n, (long long)s->k,
                         tr, mpt_dtype_name(dts[di]), c_name, tf[e], secs[e], tf[2],
                         tf[2] > 0 ? tf[e] / tf[2] : 0, e == 1 ? (int)hopper : 0);
        }
    printf("\n");
    for (si = 0; si < n_json; si++) print_json(json[si]);
}

/* ---- (d) the int8 GEMM: mma.sync s8 against cuBLASLt's int8 ------------------------ */

#ifdef MPT_CUDA
typedef struct qshape {
    const char *what;
    int64_t m, n, k;
} qshape;

/* K a multiple of 4 and 16-byte rows throughout: cuBLASLt's int8 kernels
   want them, and they keep ours on its 16-byte loads. */
static const qshape qgemm_shapes[] = {
    {"square", 4096, 4096, 4096},
    {"square 1024", 1024, 1024, 1024},
    {"mlp dense 1, batch 128", 128, 1024, 784},
    {"mlp dense 1, batch 1024", 1024, 1024, 784},
    {"cnn conv2 (im2col), batch 128", 128 * 24 * 24, 32, 288},
};

/* Random bytes, uploaded to a new buffer (NULL on failure). */
static void *device_bytes(const mpt_backend *t, void *impl, int64_t n, uint32_t seed) {
    unsigned char *host = (unsigned char *)malloc((size_t)n);
    void *dev = NULL;
    int64_t i;
    for (i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        host[i] = (unsigned char)(seed >> 24);
    }
    if (t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)n, &dev) != MPT_OK ||
        t->upload(impl, dev, host, (size_t)n) != MPT_OK) {
        if (dev) t->free(impl, MPT_MEMORY_WORKSPACE, dev);
        dev = NULL;
    }
    free(host);
    return dev;
}

/* cuBLASLt's C (M×N row-major int32) = A (M×K row-major int8) · Bᵀ (B N×K
   row-major): in its column-major terms Cᵀ (N×M) = op(B')ᵀ·A' with B'
   the K×N matrix B's bytes are, A' the K×M one: its "TN" int8 form. */
typedef struct lt_int8 {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulHeuristicResult_t heur;
    void *ws;
    size_t ws_bytes;
} lt_int8;

static void lt_int8_free(lt_int8 *l) {
    if (l->op) cublasLtMatmulDescDestroy(l->op);
    if (l->la) cublasLtMatrixLayoutDestroy(l->la);
    if (l->lb) cublasLtMatrixLayoutDestroy(l->lb);
    if (l->lc) cublasLtMatrixLayoutDestroy(l->lc);
    if (l->ws) cudaFree(l->ws);
    if (l->lt) cublasLtDestroy(l->lt);
}

static int lt_int8_plan(lt_int8 *l, const qshape *s) {
    const cublasOperation_t trans = CUBLAS_OP_T, none = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    int found = 0;
    memset(l, 0, sizeof *l);
    l->ws_bytes = (size_t)32 << 20;
    if (cublasLtCreate(&l->lt) != CUBLAS_STATUS_SUCCESS || cudaMalloc(&l->ws, l->ws_bytes))
        return 0;
    if (cublasLtMatmulDescCreate(&l->op, CUBLAS_COMPUTE_32I, CUDA_R_32I) ||
        cublasLtMatmulDescSetAttribute(l->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans) ||
        cublasLtMatmulDescSetAttribute(l->op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none) ||
        cublasLtMatrixLayoutCreate(&l->la, CUDA_R_8I, (uint64_t)s->k, (uint64_t)s->n, s->k) ||
        cublasLtMatrixLayoutCreate(&l->lb, CUDA_R_8I, (uint64_t)s->k, (uint64_t)s->m, s->k) ||
        cublasLtMatrixLayoutCreate(&l->lc, CUDA_R_32I, (uint64_t)s->n, (uint64_t)s->m, s->n) ||
        cublasLtMatmulPreferenceCreate(&pref))
        return 0;
    if (!cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &l->ws_bytes, sizeof l->ws_bytes))
        cublasLtMatmulAlgoGetHeuristic(l->lt, l->op, l->la, l->lb, l->lc, l->lc, pref, 1,
                                       &l->heur, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    return found > 0;
}

static int lt_int8_run(lt_int8 *l, const void *a, const void *b, int32_t *c) {
    const int32_t one = 1, zero = 0;
    return cublasLtMatmul(l->lt, l->op, &one, b, l->la, a, l->lb, &zero, c, l->lc, c, l->lc,
                          &l->heur.algo, l->ws, l->ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
}

/* Seconds per call of run(arg) (which queues one product and returns
   nonzero), after 3 warm-up calls, over a run of about 0.2 s; wait()
   waits for the queue. Negative on failure. */
static double time_calls(int (*run)(void *), int (*wait)(void *), void *arg) {
    int reps = 10, i, ok = 1;
    double t0, dt_s;
    for (i = 0; i < 3; i++) ok &= run(arg);
    if (!ok || !wait(arg)) return -1;
    t0 = now();
    for (i = 0; i < reps; i++) run(arg);
    wait(arg);
    dt_s = (now() - t0) / reps;
    reps = dt_s > 0 ? (int)(0.2 / dt_s) : 1000;
    reps = reps < 10 ? 10 : reps > 100000 ? 100000 : reps;
    t0 = now();
    for (i = 0; i < reps; i++) run(arg);
    return wait(arg) ? (now() - t0) / reps : -1;
}

typedef struct qrun {
    const mpt_backend *t;
    void *impl;
    mpt_qgemm_desc d;
    lt_int8 *lt;
    int32_t *lt_c;
} qrun;

static int qrun_mpt(void *p) {
    qrun *q = (qrun *)p;
    return q->t->qgemm(q->impl, &q->d) == MPT_OK;
}
static int qrun_mpt_wait(void *p) {
    qrun *q = (qrun *)p;
    return q->t->sync(q->impl) == MPT_OK;
}
static int qrun_lt(void *p) {
    qrun *q = (qrun *)p;
    return lt_int8_run(q->lt, q->d.a, q->d.b, q->lt_c);
}
static int qrun_lt_wait(void *p) {
    (void)p;
    return cudaDeviceSynchronize() == cudaSuccess;
}

/* Whether two device int32 buffers of n values hold the same bits. */
static int same_int32(const mpt_backend *t, void *impl, const int32_t *x, const int32_t *y,
                      int64_t n) {
    int32_t *hx = (int32_t *)malloc((size_t)n * 4), *hy = (int32_t *)malloc((size_t)n * 4);
    int same = t->download(impl, hx, x, (size_t)n * 4) == MPT_OK &&
               t->download(impl, hy, y, (size_t)n * 4) == MPT_OK &&
               !memcmp(hx, hy, (size_t)n * 4);
    free(hx);
    free(hy);
    return same;
}

/* Each shape: mpt's int32 result (no zero points, as cuBLASLt's), checked
   equal to cuBLASLt's bit for bit, its time against cuBLASLt's measured
   right after it; then mpt's int8 output (per-channel requantization,
   zero points, a bias), which cuBLASLt's int8 GEMM has no form for. */
static void bench_qgemm(mpt_context *ctx) {
    void *impl;
    const mpt_backend *t = mpt_context_backend(ctx, &impl);
    static char json[16][512];
    int n_json = 0, si;
    printf("\n## int8 GEMM: mma.sync s8 (mpt) against cuBLASLt (CUDA_R_8I, "
           "CUBLAS_COMPUTE_32I)\n\n");
    printf("| shape | M×N×K | mpt int32 TOPS | cuBLASLt int32 TOPS | mpt / cuBLASLt | same bits "
           "| mpt requantized int8 TOPS |\n|---|---|---:|---:|---:|---|---:|\n");
    for (si = 0; si < (int)(sizeof qgemm_shapes / sizeof qgemm_shapes[0]); si++) {
        const qshape *s = &qgemm_shapes[si];
        const double ops = 2.0 * (double)s->m * (double)s->n * (double)s->k;
        void *a = device_bytes(t, impl, s->m * s->k, 7), *b = device_bytes(t, impl, s->n * s->k, 11);
        void *c = NULL, *lt_c = NULL, *c8 = NULL, *scale = NULL;
        double secs[3] = {-1, -1, -1};
        int same = 0, planned = 0;
        lt_int8 lt;
        qrun q;
        memset(&q, 0, sizeof q);
        memset(&lt, 0, sizeof lt);
        if (a && b && t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)(s->m * s->n) * 4, &c) == MPT_OK &&
            t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)(s->m * s->n) * 4, &lt_c) == MPT_OK &&
            t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)(s->m * s->n), &c8) == MPT_OK &&
            t->alloc(impl, MPT_MEMORY_WORKSPACE, (size_t)s->n * 12, &scale) == MPT_OK) {
            int32_t *host = (int32_t *)malloc((size_t)s->n * 12);
            int64_t j;
            for (j = 0; j < s->n; j++) {
                host[j] = (int32_t)((1u << 30) + (uint32_t)(j * 7919 % 100000)); /* multiplier */
                host[s->n + j] = -12;                                           /* shift */
                host[2 * s->n + j] = (int32_t)(j % 201) - 100;                  /* bias */
            }
            t->upload(impl, scale, host, (size_t)s->n * 12);
            free(host);
            q.t = t, q.impl = impl, q.lt = &lt, q.lt_c = (int32_t *)lt_c;
            q.d.m = s->m, q.d.n = s->n, q.d.k = s->k;
            q.d.a = a, q.d.lda = s->k, q.d.b = (const int8_t *)b, q.d.ldb = s->k, q.d.trans_b = 1;
            q.d.c = (int32_t *)c, q.d.ldc = s->n;
            secs[0] = time_calls(qrun_mpt, qrun_mpt_wait, &q);
            planned = lt_int8_plan(&lt, s);
            if (planned) secs[1] = time_calls(qrun_lt, qrun_lt_wait, &q);
            if (secs[0] > 0 && secs[1] > 0)
                same = same_int32(t, impl, (const int32_t *)c, (const int32_t *)lt_c, s->m * s->n);
            q.d.c = NULL, q.d.c_int8 = (int8_t *)c8;
            q.d.multiplier = (const int32_t *)scale, q.d.shift = (const int32_t *)scale + s->n;
            q.d.bias = (const int32_t *)scale + 2 * s->n, q.d.per_channel = 1;
            q.d.a_zero_point = 3, q.d.b_zero_point = -2, q.d.c_zero_point = -5;
            secs[2] = time_calls(qrun_mpt, qrun_mpt_wait, &q);
        }
        if (!planned) fprintf(stderr, "bench_cuda: cuBLASLt has no int8 algorithm for %s\n", s->what);
        if (secs[0] < 0 || secs[2] < 0) fprintf(stderr, "bench_cuda: qgemm %s: %s\n", s->what, t->error(impl));
        printf("| %s | %lld×%lld×%lld | %.1f | %.1f | %.2f | %s | %.1f |\n", s->what,
               (long long)s->m, (long long)s->n, (long long)s->k,
               secs[0] > 0 ? ops / secs[0] * 1e-12 : 0, secs[1] > 0 ? ops / secs[1] * 1e-12 : 0,
               secs[0] > 0 && secs[1] > 0 ? secs[1] / secs[0] : 0, same ? "yes" : "NO",
               secs[2] > 0 ? ops / secs[2] * 1e-12 : 0);
        fflush(stdout);
        if (n_json < 16)
            snprintf(json[n_json++], sizeof json[0],
                     "{\"bench\":\"qgemm\",\"shape\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
                     "\"mpt_int32_tops\":%.3f,\"cublaslt_int32_tops\":%.3f,"
                     "\"ratio_to_cublaslt\":%.3f,\"same_bits\":%d,\"mpt_int8_tops\":%.3f}",
                     s->what, (long long)s->m, (long long)s->n, (long long)s->k,
                     secs[0] > 0 ? ops / secs[0] * 1e-12 : 0,
                     secs[1] > 0 ? ops / secs[1] * 1e-12 : 0,
                     secs[0] > 0 && secs[1] > 0 ? secs[1] / secs[0] : 0, same,
                     secs[2] > 0 ? ops / secs[2] * 1e-12 : 0);
        lt_int8_free(&lt);
        if (a) t->free(impl, MPT_MEMORY_WORKSPACE, a);
        if (b) t->free(impl, MPT_MEMORY_WORKSPACE, b);
        if (c) t->free(impl, MPT_MEMORY_WORKSPACE, c);
        if (lt_c) t->free(impl, MPT_MEMORY_WORKSPACE, lt_c);
        if (c8) t->free(impl, MPT_MEMORY_WORKSPACE, c8);
        if (scale) t->free(impl, MPT_MEMORY_WORKSPACE, scale);
    }
    printf("\n");
    for (si = 0; si < n_json; si++) print_json(json[si]);
}
#endif /* MPT_CUDA */

/* ---- models ------------------------------------------------------------------------- */

typedef enum model_kind { MLP = 0, CNN = 1, LARGE_MLP = 2 } model_kind;
static const char *const model_names[3] = {"mlp", "cnn", "large_mlp"};

/* Flatten -> 4 × Dense(4096, relu) -> Dense(10, softmax) */
static mpt_status add_large_mlp_layers(mpt_model *m) {
    mpt_status s = mpt_model_add_flatten(m, NULL);
    int i;
    for (i = 0; s == MPT_OK && i < 4; i++) s = add_dense(m, 4096, MPT_ACT_RELU);
    if (s == MPT_OK) s = add_dense(m, 10, MPT_ACT_SOFTMAX);
    return s;
}

/* examples/mlp.c's, examples/cnn.c's or the large MLP's layers, as
   make_train_model (common.h) compiles them for bench_train.c too. */
static mpt_status (*const add_model[3])(mpt_model *) = {add_mlp_layers, add_cnn_layers,
                                                        add_large_mlp_layers};

#define REPEATS 3

/* Fits the model on `warmup`, then REPEATS one-epoch fits on `data`:
   their samples/s, sorted, into sps[]. */
static mpt_status measure(mpt_model *m, const mpt_dataset *warmup, const mpt_dataset *data,
                          int64_t batch, double *sps) {
    mpt_fit_desc fd;
    mpt_status s;
    int r;
    for (r = 0; r < REPEATS; r++) sps[r] = 0;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 1;
    fd.batch_size = batch;
    s = mpt_model_fit(m, warmup, &fd);
    for (r = 0; s == MPT_OK && r < REPEATS; r++) {
        s = mpt_model_fit(m, data, &fd);
        sps[r] = history_last(m, "samples_per_second");
    }
    qsort(sps, REPEATS, sizeof *sps, compare_doubles);
    return s;
}

/* The first n samples of d (a view, or d itself when n covers it). */
static const mpt_dataset *first_samples(mpt_context *ctx, const mpt_dataset *d, int64_t n,
                                        mpt_dataset **view) {
    *view = NULL;
    if (n >= mpt_dataset_count(d)) return d;
    if (mpt_dataset_split(ctx, d, n, view, NULL) != MPT_OK) return d;
    return *view;
}

/* Fashion-MNIST's training images, or n synthetic ones of the same shape. */
static mpt_dataset *training_data(mpt_context *ctx, const char *dir, int *synthetic) {
    mpt_dataset *d = NULL;
    mpt_tensor x, y;
    mpt_dataset_desc dd;
    int64_t n = 60000, xs[4] = {60000, 28, 28, 1}, ys[1] = {60000}, i;
    *synthetic = 0;
    if (mpt_dataset_load_mnist(ctx, dir, 0, &d) == MPT_OK) return d;
    *synthetic = 1;
    if (mpt_tensor_alloc(ctx, &x, MPT_UINT8, 4, xs) != MPT_OK) return NULL;
    if (mpt_tensor_alloc(ctx, &y, MPT_INT32, 1, ys) != MPT_OK) {
        mpt_tensor_free(ctx, &x);
        return NULL;
    }
    for (i = 0; i < n * 784; i++) ((uint8_t *)x.data)[i] = (uint8_t)((i * 2654435761u) >> 24);
    for (i = 0; i < n; i++) ((int32_t *)y.data)[i] = (int32_t)(i % 10);
    memset(&dd, 0, sizeof dd);
    dd.x = &x;
    dd.y = &y;
    dd.copy = 1;
    if (mpt_dataset_create(ctx, &dd, &d) != MPT_OK) d = NULL;
    mpt_tensor_free(ctx, &x);
    mpt_tensor_free(ctx, &y);
    return d;
}

/* ---- (b) training speed --------------------------------------------------------------- */

static void bench_train(mpt_context *ctx, const mpt_dataset *all, int synthetic) {
    static const int64_t batches[2] = {128, 1024};
    static const mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    static const char *const policy_names[2] = {"float32", "mixed_float16"};
    static const int64_t samples[2] = {59392, 25600}; /* mlp, cnn: whole batches */
    char json[8][512];
    int n_json = 0, mi, bi, pi, j;
    printf("\n## Training speed on the GPU (%s, one epoch, median of %d)\n\n",
           synthetic ? "synthetic 28×28 images" : "Fashion-MNIST", REPEATS);
    printf("| model | policy | batch | samples | samples/s | min..max |\n");
    printf("|---|---|---:|---:|---:|---:|\n");
    for (mi = 0; mi < 2; mi++)
        for (bi = 0; bi < 2; bi++)
            for (pi = 0; pi < 2; pi++) {
                mpt_dataset *view = NULL, *warm_view = NULL;
                const mpt_dataset *data = first_samples(ctx, all, samples[mi], &view);
                const mpt_dataset *warmup = first_samples(ctx, all, 8 * batches[bi], &warm_view);
                mpt_model *m = NULL;
                double sps[REPEATS];
                mpt_status s = make_train_model(ctx, add_model[mi], policies[pi], batches[bi], &m);
                if (s == MPT_OK) s = measure(m, warmup, data, batches[bi], sps);
                if (s != MPT_OK) {
                    fprintf(stderr, "bench_cuda: %s %s batch %lld: %s\n", model_names[mi],
                            policy_names[pi], (long long)batches[bi], mpt_context_error(ctx));
                    for (j = 0; j < REPEATS; j++) sps[j] = 0;
                }
                printf("| %s | %s | %lld | %lld | %.0f | %.0f..%.0f |\n", model_names[mi],
                       policy_names[pi], (long long)batches[bi],
                       (long long)mpt_dataset_count(data), sps[REPEATS / 2], sps[0],
                       sps[REPEATS - 1]);
                fflush(stdout);
                snprintf(json[n_json++], sizeof json[0],
                         "{\"bench\":\"cuda_train\",\"framework\":\"mpt\",\"model\":\"%s\","
                         "\"policy\":\"%s\",\"batch\":%lld,\"samples\":%lld,\"data\":\"%s\","
                         "\"repeats\":%d,\"samples_per_s\":%.1f,\"samples_per_s_min\":%.1f,"
                         "\"samples_per_s_max\":%.1f}",
                         model_names[mi], policy_names[pi], (long long)batches[bi],
                         (long long)mpt_dataset_count(data),
                         synthetic ? "synthetic" : "fashion-mnist", REPEATS, sps[REPEATS / 2],
                         sps[0], sps[REPEATS - 1]);
                mpt_model_destroy(m);
                mpt_dataset_destroy(view);
                mpt_dataset_destroy(warm_view);
            }
    printf("\n");
    for (j = 0; j < n_json; j++) print_json(json[j]);
}

/* ---- (b2) Conv2D's two paths side by side ---------------------------------------------- */

/* The cnn in mixed_float16, trained on two contexts: one with Conv2D's
   implicit GEMMs (the default), one with $MPT_CUDA_CONV=im2col (read when
   a context opens). ROUNDS one-epoch fits each, the first path of a round
   alternating, so that a drift of the GPU's clocks falls on both: each
   path's median samples/s and implicit / im2col. */
#define ROUNDS 5

static void bench_conv_paths(const char *dir) {
    static const char *const paths[2] = {"implicit", "im2col"};
    static const int64_t batches[2] = {128, 1024};
    const char *env = getenv("MPT_CUDA_CONV");
    char *saved = env ? strdup(env) : NULL;
    mpt_context *c[2] = {NULL, NULL};
    mpt_dataset *all[2] = {NULL, NULL};
    char json[2][512];
    int synthetic = 0, p, bi, r, n_json = 0;
    for (p = 0; p < 2; p++) {
        setenv("MPT_CUDA_CONV", paths[p], 1);
        if (open_context(MPT_GEMM_AUTO, &c[p])) all[p] = training_data(c[p], dir, &synthetic);
    }
    if (saved) setenv("MPT_CUDA_CONV", saved, 1);
    else unsetenv("MPT_CUDA_CONV");
    free(saved);
    if (!all[0] || !all[1]) {
        fprintf(stderr, "bench_cuda: conv: cannot open the two contexts or their data\n");
        goto done;
    }
    printf("\n## Conv2D's implicit GEMMs against im2col (cnn, mixed_float16, median of %d)\n\n",
           ROUNDS);
    printf("| batch | implicit samples/s | im2col samples/s | implicit / im2col |\n");
    printf("|---:|---:|---:|---:|\n");
    for (bi = 0; bi < 2; bi++) {
        mpt_dataset *view[2] = {NULL, NULL}, *warm_view[2] = {NULL, NULL};
        const mpt_dataset *data[2], *warmup[2];
        mpt_model *m[2] = {NULL, NULL};
        double sps[2][ROUNDS], med[2];
        mpt_fit_desc fd;
        mpt_status s = MPT_OK;
        memset(&fd, 0, sizeof fd);
        fd.epochs = 1;
        fd.batch_size = batches[bi];
        for (p = 0; p < 2; p++) {
            data[p] = first_samples(c[p], all[p], 25600, &view[p]);
            warmup[p] = first_samples(c[p], all[p], 8 * batches[bi], &warm_view[p]);
            if (s == MPT_OK)
                s = make_train_model(c[p], add_model[1], MPT_POLICY_MIXED_FLOAT16, batches[bi],
                                     &m[p]);
            if (s == MPT_OK) s = mpt_model_fit(m[p], warmup[p], &fd);
        }
        for (r = 0; s == MPT_OK && r < ROUNDS; r++)
            for (p = 0; s == MPT_OK && p < 2; p++) {
                const int q = (r + p) % 2;
                s = mpt_model_fit(m[q], data[q], &fd);
                sps[q][r] = history_last(m[q], "samples_per_second");
            }
        if (s != MPT_OK) {
            fprintf(stderr, "bench_cuda: conv batch %lld: %s / %s\n", (long long)batches[bi],
                    mpt_context_error(c[0]), mpt_context_error(c[1]));
        } else {
            for (p = 0; p < 2; p++) med[p] = median(sps[p], ROUNDS);
            printf("| %lld | %.0f | %.0f | %.3f |\n", (long long)batches[bi], med[0], med[1],
                   med[0] / med[1]);
            snprintf(json[n_json++], sizeof json[0],
                     "{\"bench\":\"cuda_conv_paths\",\"model\":\"cnn\",\"policy\":"
                     "\"mixed_float16\",\"batch\":%lld,\"samples\":%lld,\"data\":\"%s\","
                     "\"rounds\":%d,\"implicit_samples_per_s\":%.1f,"
                     "\"im2col_samples_per_s\":%.1f,\"implicit_over_im2col\":%.3f}",
                     (long long)batches[bi], (long long)mpt_dataset_count(data[0]),
                     synthetic ? "synthetic" : "fashion-mnist", ROUNDS, med[0], med[1],
                     med[0] / med[1]);
        }
        for (p = 0; p < 2; p++) {
            mpt_model_destroy(m[p]);
            mpt_dataset_destroy(view[p]);
            mpt_dataset_destroy(warm_view[p]);
        }
    }
    printf("\n");
    for (r = 0; r < n_json; r++) print_json(json[r]);
done:
    for (p = 0; p < 2; p++) {
        mpt_dataset_destroy(all[p]);
        mpt_context_destroy(c[p]);
    }
}

/* ---- (c) the large MLP: speed and memory ------------------------------------------------- */

#define MAX_CATEGORIES 8

/* The "Memory for batches of N:" lines of a model's summary: names and sizes. */
static int memory_lines(const mpt_model *m, char names[][32], char sizes[][32]) {
    char buf[16384], *p, *line;
    int n = 0;
    if (mpt_model_summary(m, buf, sizeof buf) == 0) return 0;
    p = strstr(buf, "Memory for batches");
    if (!p) return 0;
    p = strchr(p, '\n');
    while (p && n < MAX_CATEGORIES) {
        char *end, *gap;
        line = p + 1;
        end = strchr(line, '\n');
        if (!end || strncmp(line, "  ", 2) != 0) break;
        *end = 0;
        while (*line == ' ') line++;
        gap = strstr(line, "  "); /* the name ends at a run of spaces */
        if (gap) {
            *gap = 0;
            gap += 2;
            while (*gap == ' ') gap++;
            snprintf(names[n], 32, "%s", line);
            snprintf(sizes[n], 32, "%s", gap);
            n++;
        }
        p = end;
    }
    return n;
}

static void bench_large(mpt_context *ctx, const mpt_dataset *all) {
    static const mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    static const char *const policy_names[2] = {"float32", "mixed_float16"};
    const int64_t batch = 4096;
    char names[2][MAX_CATEGORIES][32], sizes[2][MAX_CATEGORIES][32];
    double sps[2][REPEATS];
    int n_lines[2] = {0, 0}, pi, i;
    mpt_dataset *view = NULL, *warm_view = NULL;
    const mpt_dataset *data = first_samples(ctx, all, 10 * batch, &view);
    const mpt_dataset *warmup = first_samples(ctx, all, 2 * batch, &warm_view);
    for (pi = 0; pi < 2; pi++) {
        mpt_model *m = NULL;
        mpt_status s = make_train_model(ctx, add_model[LARGE_MLP], policies[pi], batch, &m);
        if (s == MPT_OK) {
            n_lines[pi] = memory_lines(m, names[pi], sizes[pi]);
            s = measure(m, warmup, data, batch, sps[pi]);
        }
        if (s != MPT_OK) {
            fprintf(stderr, "bench_cuda: large mlp %s: %s\n", policy_names[pi],
                    mpt_context_error(ctx));
            for (i = 0; i < REPEATS; i++) sps[pi][i] = 0;
        }
        mpt_model_destroy(m);
    }
    printf("\n## Large MLP: Flatten -> 4 × Dense(4096, relu) -> Dense(10), batch %lld, %lld "
           "samples per epoch\n\n", (long long)batch, (long long)mpt_dataset_count(data));
    printf("| | float32 | mixed_float16 | mixed / float32 |\n|---|---:|---:|---:|\n");
    printf("| samples/s (median of %d) | %.0f | %.0f | %.2f |\n", REPEATS, sps[0][REPEATS / 2],
           sps[1][REPEATS / 2],
           sps[0][REPEATS / 2] > 0 ? sps[1][REPEATS / 2] / sps[0][REPEATS / 2] : 0);
    for (i = 0; i < n_lines[0] && i < n_lines[1]; i++)
        printf("| device memory: %s | %s | %s | |\n", names[0][i], sizes[0][i], sizes[1][i]);
    printf("\n");
    for (pi = 0; pi < 2; pi++) {
        printf("{%s,\"bench\":\"cuda_large_mlp\",\"policy\":\"%s\",\"batch\":%lld,"
               "\"samples_per_s\":%.1f,\"samples_per_s_min\":%.1f,\"samples_per_s_max\":%.1f,"
               "\"speedup_vs_float32\":%.3f,\"memory\":{",
               provenance, policy_names[pi], (long long)batch, sps[pi][REPEATS / 2], sps[pi][0],
               sps[pi][REPEATS - 1],
               sps[0][REPEATS / 2] > 0 ? sps[pi][REPEATS / 2] / sps[0][REPEATS / 2] : 0);
        for (i = 0; i < n_lines[pi]; i++)
            printf("%s\"%s\":\"%s\"", i ? "," : "", names[pi][i], sizes[pi][i]);
        printf("}}\n");
    }
    mpt_dataset_destroy(view);
    mpt_dataset_destroy(warm_view);
}

int main(int argc, char **argv) {
    const char *part = argc > 1 ? argv[1] : "all";
    const char *dir = getenv("MPT_DATA_DIR") && *getenv("MPT_DATA_DIR")
                          ? getenv("MPT_DATA_DIR")
                          : "/usr/share/datasets/fashion-mnist";
    const char *required = getenv("MPT_REQUIRE_GPU");
    mpt_context *ctx = NULL, *gemm_ctx[3] = {NULL, NULL, NULL};
    mpt_dataset *all = NULL;
    long long refused_gemm = 0;
    char dev[512];
    int synthetic = 0, i;
    if (strcmp(part, "all") && strcmp(part, "gemm") && strcmp(part, "train") &&
        strcmp(part, "conv") && strcmp(part, "large") && strcmp(part, "int8")) {
        fprintf(stderr, "usage: %s [all|gemm|train|conv|large|int8]\n", argv[0]);
        return 2;
    }
    if (!open_context(MPT_GEMM_AUTO, &ctx)) {
#ifdef MPT_CUDA
        printf("# bench_cuda: needs a CUDA device (none was found); nothing measured\n");
#else
        printf("# bench_cuda: needs a CUDA device (this build has no MPT_CUDA); nothing measured\n");
#endif
        mpt_context_destroy(ctx);
        if (required && !strcmp(required, "1")) {
            fprintf(stderr, "bench_cuda: MPT_REQUIRE_GPU=1, but the CUDA backend did not open "
                            "(the context's warning above says why)\n");
            return 1;
        }
        return 0;
    }
    device_name(ctx, dev, sizeof dev);
    record_provenance(ctx);
    printf("# mpt.h %s CUDA benchmarks: %s\n", MPT_VERSION, dev);
    printf("# built at commit %s for %s\n", MPT_BENCH_COMMIT, MPT_BENCH_ARCH);
    if (!strcmp(part, "all") || !strcmp(part, "gemm")) {
        if (open_context(MPT_GEMM_MPT, &gemm_ctx[0]) &&
            open_context(MPT_GEMM_WGMMA, &gemm_ctx[1]) &&
            open_context(MPT_GEMM_CUBLASLT, &gemm_ctx[2]))
            bench_gemm(gemm_ctx);
        else
            fprintf(stderr, "bench_cuda: cannot open the GEMM contexts\n");
        refused_gemm =
            lt_refusals(gemm_ctx[0]) + lt_refusals(gemm_ctx[1]) + lt_refusals(gemm_ctx[2]);
        mpt_context_destroy(gemm_ctx[0]);
        mpt_context_destroy(gemm_ctx[1]);
        mpt_context_destroy(gemm_ctx[2]);
    }
#ifdef MPT_CUDA
    if (!strcmp(part, "all") || !strcmp(part, "int8")) bench_qgemm(ctx);
#endif
    if (strcmp(part, "gemm") && strcmp(part, "int8")) {
        all = training_data(ctx, dir, &synthetic);
        if (!all) {
            fprintf(stderr, "bench_cuda: no training data: %s\n", mpt_context_error(ctx));
            mpt_context_destroy(ctx);
            return 1;
        }
        if (!strcmp(part, "all") || !strcmp(part, "train")) bench_train(ctx, all, synthetic);
        if (!strcmp(part, "all") || !strcmp(part, "conv")) bench_conv_paths(dir);
        if (!strcmp(part, "all") || !strcmp(part, "large")) bench_large(ctx, all);
    }
    /* a shape cuBLASLt refused ran on the hand-written engine instead */
    for (i = 0; i < n_refused; i++) {
        char line[512];
        snprintf(line, sizeof line, "{\"bench\":\"cuda_lt_refused\",\"part\":\"%s\","
                 "\"gemm\":\"%s\"}", part, refused[i]);
        print_json(line);
    }
    {
        char line[512];
        snprintf(line, sizeof line, "{\"bench\":\"cuda_lt_refusals\",\"part\":\"%s\","
                 "\"gemm_contexts\":%lld,\"training_context\":%lld,\"logged\":%d}", part,
                 refused_gemm, lt_refusals(ctx), n_refused);
        print_json(line);
    }
    mpt_dataset_destroy(all);
    mpt_context_destroy(ctx);
    return 0;
}

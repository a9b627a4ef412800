/* mpt_cuda.cu — the CUDA backend of mpt.h.

   mpt.h keeps a model's buffers in one backend's memory and reaches them
   only through the function table `mpt_backend` (mpt.h, @backend). This
   file implements that table for one NVIDIA GPU of compute capability 8.0
   or newer (bfloat16 tensor cores): device memory with per-category
   accounting, host<->device copies, CUDA-graph capture and replay of a
   training step, and the compute functions (GEMMs, layers, losses,
   optimizers) as CUDA kernels. Every compute call is queued on one stream
   and returns at once; a failed launch is reported by the next sync.

   Build: compile this file next to the one C file that defines
   MPT_IMPLEMENTATION, with -DMPT_CUDA there so that mpt_context_create
   takes a CUDA device:

       nvcc -O3 -arch=sm_90 -DMPT_CUDA examples/mlp.c mpt_cuda.cu \
            -lcublasLt -lcublas -lz

   On Hopper (H100, H200) build with -arch=sm_90a instead, which adds the
   wgmma/TMA GEMM (MPT_GEMM=wgmma; a candidate of AUTO only with
   MPT_GEMM_AUTO_WGMMA=1 while it is slower than cuBLASLt); without it
   the mma.sync kernel runs every hand-written GEMM there too.

   Several GPUs, in one process or across processes, sum their replicas'
   gradients over NCCL: add -DMPT_NCCL (for this file) and -lnccl:

       nvcc -O3 -arch=sm_90 -DMPT_CUDA -DMPT_NCCL examples/mlp.c mpt_cuda.cu \
            -lcublasLt -lcublas -lnccl -lz

   This file includes mpt.h for its API and the rules both backends share
   (MPT_BACKEND_SHARED, mpt.h @backend-shared), not the implementation.

   CONTENTS (grep an anchor to reach its section; mpt.h's @impl- sections
   are the CPU code each one mirrors)
       @cuda-state        mpt__cuda (the `impl` of every table function), the
                          checked-call macros MPT__CU / MPT__LT, and the
                          element rules every kernel shares: conversions and
                          activations with the CPU's bits
       @cuda-gemm         the matrix products (mpt.h @impl-gemm):
         @cuda-gemm-epilogue  alpha, beta·C, bias, activation, store; staged
                          through shared memory for the tensor-core kernels
         @cuda-gemm-fp32  the plain FP32-arithmetic kernel
         @cuda-gemm-mma   the tensor-core kernel (mma.sync, sm_80 and later)
         @cuda-gemm-wgmma the Hopper kernel (sm_90a: TMA, mbarriers, wgmma)
         @cuda-gemm-cache the per-shape cache: chosen engine, cuBLASLt plan
         @cuda-cublaslt   cuBLASLt
         @cuda-gemm-engine  launching the hand-written kernels
         @cuda-wgmma-launch the Hopper kernel's tensor maps and launch
         @cuda-gemm-choice  engine choice and the table's GEMM functions
         @cuda-colsums    column sums (bias gradients)
       @cuda-layers       dtype conversion, activations, im2col/col2im,
                          pooling, BatchNormalization, LayerNormalization,
                          MultiHeadAttention's attention, Dropout (mpt.h's
                          @impl-activations and the layers' sections,
                          @impl-dense .. @impl-attention)
         @cuda-conv       Conv2D as implicit GEMMs (conv_direct): the
                          tensor-core kernel reading its operands from x,
                          dz and the kernel by mpt.h's gather rule
       @cuda-training     the loss with its metrics, gradient statistics, the
                          fused optimizer update, loss scaling (mpt.h's
                          @impl-losses, @impl-optimizers)
       @cuda-qgemm        mpt_qgemm's product on int8 tensor cores (mma.sync
                          s8), the CPU's bits (mpt.h @impl-qgemm)
       @cuda-preload      every kernel loaded when the backend is created
       @cuda-core         memory, copies, synchronisation, graphs, creation
       @cuda-nccl         (-DMPT_NCCL) communicators and the all-reduce
       @cuda-table        every entry on its context's device, the profiler's
                          timers, devices, the table and
                          mpt_cuda_backend_create (mpt.h @impl-cpu-backend is
                          the CPU's) */

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cudaTypedefs.h> /* the driver's types, for the entry points the runtime hands out */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#define MPT_BACKEND_SHARED /* the rules both backends compute alike */
#include "mpt.h"

/* =============================================================================
   @cuda-state  The shared state and the checks
   ============================================================================= */

struct mpt__gemm_cache; /* the GEMM part's: chosen engine + cuBLASLt plan per shape */

/* The CUDA backend's state: the `impl` every table function receives. */
typedef struct mpt__cuda {
    int device;
    int sm_count;
    cudaStream_t stream;        /* every compute call, in order          */
    cudaStream_t copy_stream;   /* upload_async                          */
    cudaEvent_t copy_done;      /* recorded after each upload_async       */
    int capturing;              /* inside capture_begin/capture_end      */
    cublasLtHandle_t lt;
    void *lt_workspace;         /* 32 MiB for cuBLASLt                    */
    size_t lt_workspace_bytes;
    mpt_gemm_engine gemm_engine;        /* from the context desc / $MPT_GEMM */
    struct mpt__gemm_cache *gemm_cache; /* the GEMM part's                  */
    int index64;                /* $MPT_CUDA_INDEX64=1: im2col/col2im index in 64 bits */
    int allow_tf32;             /* $MPT_ALLOW_TF32=1: cuBLASLt's float32 products in TF32 */
    int conv_implicit;          /* conv_direct runs (not under $MPT_CUDA_CONV=im2col) */
    int64_t used[MPT_MEMORY_COUNT_];    /* bytes allocated per category     */
    int64_t peak[MPT_MEMORY_COUNT_];
    int64_t limit;                      /* 0: none                          */
    cudaError_t pending;        /* first failed launch, reported at sync  */
    char pending_what[128];     /* which kernel                           */
    char error[512];            /* error()'s message                      */
    /* The live device allocations (free needs each one's size and
       category); a model has a handful, so a plain array. */
    struct mpt__cuda_allocation *allocations;
    int allocation_count, allocation_capacity;
    cudaEvent_t compute_mark;   /* upload_async: the copy waits for it    */
    struct mpt__cuda_train_scratch *train_scratch; /* the training part's  */
    mpt_logger logger;          /* the context's (desc->logger)          */
    int64_t lt_refusals;        /* GEMM shapes cuBLASLt refused (logged)  */
    int64_t gemm_runs[4];       /* GEMMs run per mpt_gemm_engine (MPT, CUBLASLT, WGMMA) */
} mpt__cuda;

/* "<what> (file:line)" into error: the form of every message this
   backend leaves. */
static void mpt__cuda_vsay_at(char *error, size_t size, const char *file, int line,
                              const char *fmt, va_list ap) {
    char what[384];
    vsnprintf(what, sizeof what, fmt, ap);
    snprintf(error, size, "%s (%s:%d)", what, file, line);
}

/* Records a failure in c->error ("<what> (file:line)") and returns
   status. */
static mpt_status mpt__cuda_fail(mpt__cuda *c, mpt_status status, const char *file, int line,
                                 const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mpt__cuda_vsay_at(c->error, sizeof c->error, file, line, fmt, ap);
    va_end(ap);
    return status;
}

/* A message for the context's logger; without one, warnings and errors
   go to stderr, as mpt.h's default logger does. */
static void mpt__cuda_log(const mpt__cuda *c, mpt_log_level level, const char *message) {
    if (c->logger.fn) c->logger.fn(c->logger.user_data, level, message);
    else if (level <= MPT_LOG_WARNING)
        fprintf(stderr, "mpt %s: %s\n", level == MPT_LOG_ERROR ? "error" : "warning", message);
}

/* Runs a CUDA runtime call; on failure returns an mpt status from the
   enclosing function with the call, file, line and CUDA's message. */
#define MPT__CU(c, call)                                                                  \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess)                                                            \
            return (void)cudaGetLastError(), /* not to be blamed on the next launch */     \
                   mpt__cuda_fail((c), e_ == cudaErrorMemoryAllocation                    \
                                           ? MPT_ERR_OUT_OF_MEMORY : MPT_ERR_UNSUPPORTED, \
                                  __FILE__, __LINE__, "%s: %s", #call,                   \
                                  cudaGetErrorString(e_));                                \
    } while (0)

/* The same for cuBLASLt calls. */
#define MPT__LT(c, call)                                                                  \
    do {                                                                                  \
        cublasStatus_t e_ = (call);                                                       \
        if (e_ != CUBLAS_STATUS_SUCCESS)                                                  \
            return mpt__cuda_fail((c), e_ == CUBLAS_STATUS_ALLOC_FAILED                   \
                                           ? MPT_ERR_OUT_OF_MEMORY : MPT_ERR_UNSUPPORTED, \
                                  __FILE__, __LINE__, "%s: %s (%d)", #call,              \
                                  cublasGetStatusString(e_), (int)e_);                    \
    } while (0)

/* After a kernel launch inside a function that returns nothing: keeps the
   first launch error, which sync() then reports with the kernel's name. */
static void mpt__cuda_launched(mpt__cuda *c, const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess && c->pending == cudaSuccess) {
        c->pending = e;
        snprintf(c->pending_what, sizeof c->pending_what, "%s", what);
    }
}

/* Blocks of `threads` covering n items, capped for grid-stride loops. */
static unsigned mpt__cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > 65535LL * 32) b = 65535LL * 32;
    return (unsigned)b;
}

/* ---- conversions and activations, bit for bit as the CPU's ----------------- */

/* The hardware conversions round like the CPU's but give one canonical
   NaN; mpt.h's NaN rules (@backend-shared) keep a NaN's sign and payload,
   so every kernel that widens or narrows goes through these. */
static __device__ __forceinline__ float mpt__cuda_half_to_float(uint16_t h) {
    if (mpt__half_bits_is_nan(h)) return __uint_as_float(mpt__half_nan_to_f32(h));
    return __half2float(__ushort_as_half(h));
}

static __device__ __forceinline__ uint16_t mpt__cuda_float_to_half(float f) {
    uint32_t x = __float_as_uint(f);
    if (mpt__f32_bits_is_nan(x)) return mpt__nan_to_half(x);
    return __half_as_ushort(__float2half_rn(f));
}

/* mpt.h's rounding (@backend-shared), which mpt_float_to_bf16 runs too. */
static __device__ __forceinline__ uint16_t mpt__cuda_float_to_bf16(float f) {
    return mpt__f32_bits_to_bf16(__float_as_uint(f));
}

static __device__ __forceinline__ float mpt__cuda_bf16_to_float(uint16_t b) {
    return __uint_as_float((uint32_t)b << 16);
}

/* ReLU with the CPU's bits: 0 where x <= 0 (-0 and -inf too), x itself
   elsewhere, a NaN with its payload. Written on the bits because ptxas
   turns `x <= 0 ? 0 : x` (a selp in the PTX) into FMNMX.NAN, which gives
   NaNs one canonical payload: negative and not NaN is bits in [0x80000000,
   0xff800000]. */
static __device__ __forceinline__ float mpt__cuda_relu(float x) {
    return __float_as_uint(x) - 0x80000000u <= 0x7f800000u ? 0.0f : x;
}

/* The elementwise activations, the GELUs and the sigmoid by mpt.h's rules
   (@backend-shared, which the CPU runs too): the layers' kernels and every
   GEMM epilogue apply them through this one function. */
static __device__ __forceinline__ float mpt__cuda_act_apply(int act, float x) {
    switch (act) {
    case MPT_ACT_RELU: return mpt__cuda_relu(x);
    case MPT_ACT_GELU: return mpt__gelu(x);
    case MPT_ACT_SIGMOID: return mpt__sigmoid(x);
    case MPT_ACT_TANH: return tanhf(x);
    case MPT_ACT_GELU_TANH: return mpt__gelu_tanh(x);
    default: return x;
    }
}

/* Register q of N, picked at run time: get(r) for the r == q of an
   unrolled loop, so that each get reads a register by a compile-time index
   (an array indexed at run time would live in local memory). Lets an
   epilogue be one rolled loop over its sums instead of N inlined copies. */
template <int N, class GET>
static __device__ __forceinline__ auto mpt__cuda_pick(int q, GET get) -> decltype(get(0)) {
    decltype(get(0)) v = get(0);
#pragma unroll
    for (int r = 1; r < N; r++)
        if (r == q) v = get(r);
    return v;
}

/* =============================================================================
   @cuda-gemm  The GEMMs
   ============================================================================= */

/* The CUDA backend's matrix products: a hand-written tensor-core GEMM for
   float16/bfloat16, cuBLASLt for the same products, a plain FP32 kernel,
   the per-shape choice between the engines, and the bias-gradient column
   sums.

   Every engine computes, for C (M×N, row-major, leading dimension ldc):
       C = act(alpha·op(A)·op(B) + beta·C + bias)
   accumulating in float32 and rounding once when C is float16/bfloat16. */

/* -----------------------------------------------------------------------------
   @cuda-gemm-epilogue  The epilogue shared by every kernel
   ----------------------------------------------------------------------------- */

/* What a GEMM kernel needs, passed by value. */
typedef struct mpt__cuda_gemm_args {
    const void *a, *b;
    void *c;                  /* float, __half or __nv_bfloat16 (c_dtype)  */
    const float *bias;        /* NULL or n floats                          */
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;        /* alpha already resolved (0 → 1)            */
    int act;                  /* mpt_activation, never softmax             */
    int c_dtype;              /* MPT_FLOAT32, MPT_FLOAT16 or MPT_BFLOAT16   */
    int c_pairs;              /* C's pairs (even column) are vector-aligned */
    /* Split-K (mpt__gemm_split_k): block row blockIdx.y sums K slice
       [blockIdx.y·depth, +depth) into partials + blockIdx.y·m·n (M×N,
       row-major, float32) and a second pass adds the slices and applies
       the epilogue. Unsplit: partials NULL, depth = k, one block row. */
    float *partials;
    int64_t depth;
} mpt__cuda_gemm_args;

static __device__ __forceinline__ float mpt__cuda_gemm_load_c(const mpt__cuda_gemm_args &p,
                                                              int64_t i) {
    if (p.c_dtype == MPT_FLOAT16) return mpt__cuda_half_to_float(((const uint16_t *)p.c)[i]);
    if (p.c_dtype == MPT_BFLOAT16) return mpt__cuda_bf16_to_float(((const uint16_t *)p.c)[i]);
    return ((const float *)p.c)[i];
}

static __device__ __forceinline__ void mpt__cuda_gemm_store_c(const mpt__cuda_gemm_args &p,
                                                              int64_t i, float v) {
    if (p.c_dtype == MPT_FLOAT16) ((uint16_t *)p.c)[i] = mpt__cuda_float_to_half(v);
    else if (p.c_dtype == MPT_BFLOAT16) ((uint16_t *)p.c)[i] = mpt__cuda_float_to_bf16(v);
    else ((float *)p.c)[i] = v;
}

/* Two adjacent columns at once (i even, c_pairs set). */
static __device__ __forceinline__ void mpt__cuda_gemm_store_c2(const mpt__cuda_gemm_args &p,
                                                               int64_t i, float v0, float v1) {
    if (p.c_dtype == MPT_FLOAT16)
        *(uint32_t *)((uint16_t *)p.c + i) =
            mpt__cuda_float_to_half(v0) | (uint32_t)mpt__cuda_float_to_half(v1) << 16;
    else if (p.c_dtype == MPT_BFLOAT16)
        *(uint32_t *)((uint16_t *)p.c + i) =
            mpt__cuda_float_to_bf16(v0) | (uint32_t)mpt__cuda_float_to_bf16(v1) << 16;
    else *(float2 *)((float *)p.c + i) = make_float2(v0, v1);
}

/* act(alpha·acc + beta·C + bias) for element i (column col) of C; the old
   C is read only when beta != 0, as on the CPU. */
static __device__ __forceinline__ float mpt__cuda_gemm_epilogue(const mpt__cuda_gemm_args &p,
                                                                float acc, int64_t i,
                                                                int64_t col) {
    float v = p.alpha * acc;
    if (p.beta != 0.0f) v = fmaf(p.beta, mpt__cuda_gemm_load_c(p, i), v);
    if (p.bias) v += p.bias[col];
    return mpt__cuda_act_apply(p.act, v);
}

/* Finishes C[row][col] and C[row][col + 1] (the latter when inside C). */
static __device__ __forceinline__ void mpt__cuda_gemm_finish2(const mpt__cuda_gemm_args &p,
                                                              int64_t row, int64_t col,
                                                              float acc0, float acc1) {
    const int64_t i = row * p.ldc + col;
    const float v0 = mpt__cuda_gemm_epilogue(p, acc0, i, col);
    if (col + 1 < p.n) {
        const float v1 = mpt__cuda_gemm_epilogue(p, acc1, i + 1, col + 1);
        if (p.c_pairs) {
            mpt__cuda_gemm_store_c2(p, i, v0, v1);
        } else {
            mpt__cuda_gemm_store_c(p, i, v0);
            mpt__cuda_gemm_store_c(p, i + 1, v1);
        }
    } else {
        mpt__cuda_gemm_store_c(p, i, v0);
    }
}

/* Split-K: stores the float32 sums of C[row][col] and C[row][col + 1]
   (the latter when inside C) as K slice `slice`'s partial sums. */
static __device__ __forceinline__ void mpt__cuda_gemm_keep2_at(const mpt__cuda_gemm_args &p,
                                                               int64_t slice, int64_t row,
                                                               int64_t col, float acc0,
                                                               float acc1) {
    float *to = p.partials + (slice * p.m + row) * p.n + col;
    to[0] = acc0;
    if (col + 1 < p.n) to[1] = acc1;
}

/* Finishes a warp's sums through shared memory (mpt.h, "the CUDA GEMMs'
   epilogue, staged"): BANDS bands of 16 rows, band b at row row0 + 16b,
   each NB 8-column blocks from column col0, sums(b, j, e) the value of
   element e (the accumulator layout's four) of block j. stage: the warp's
   own MPT__CUDA_EPI_WARP_FLOATS floats of shared memory. Split-K (p.partials):
   the float32 sums go to K slice `slice`'s partials instead. The chunk
   loop is rolled, so the epilogue's code exists once; a chunk's writes
   pick their registers with compile-time indices under a run-time test. */
template <int BANDS, int NB, class SUMS>
static __device__ __forceinline__ void mpt__cuda_gemm_finish_staged(
    const mpt__cuda_gemm_args &p, int64_t slice, float *stage, SUMS sums, int64_t row0,
    int64_t col0, int lane) {
    constexpr int CHUNKS_PER_BAND = NB * 8 / MPT__CUDA_EPI_COLS;
    static_assert(CHUNKS_PER_BAND * MPT__CUDA_EPI_COLS == NB * 8, "bands of whole chunks");
#pragma unroll 1
    for (int c = 0; c < BANDS * CHUNKS_PER_BAND; c++) {
        __syncwarp(); /* the warp has read the last chunk */
#pragma unroll
        for (int b = 0; b < BANDS; b++)
#pragma unroll
            for (int j = 0; j < NB; j++) {
                if (b * CHUNKS_PER_BAND + j / 4 != c) continue;
#pragma unroll
                for (int h = 0; h < 2; h++)
                    *(float2 *)(stage + mpt__cuda_epi_put(lane, j % 4, h)) =
                        make_float2(sums(b, j, 2 * h), sums(b, j, 2 * h + 1));
            }
        __syncwarp();
        const int lane_col = mpt__cuda_epi_get_col(lane);
        const int64_t band_row = row0 + 16 * (c / CHUNKS_PER_BAND);
        const int64_t col = col0 + (c % CHUNKS_PER_BAND) * MPT__CUDA_EPI_COLS + lane_col;
#pragma unroll 1
        for (int s = 0; s < 8; s++) {
            const int r = mpt__cuda_epi_get_row(lane, s);
            const float2 v = *(const float2 *)(stage + r * MPT__CUDA_EPI_PITCH + lane_col);
            const int64_t row = band_row + r;
            if (row >= p.m || col >= p.n) continue;
            if (p.partials) mpt__cuda_gemm_keep2_at(p, slice, row, col, v.x, v.y);
            else mpt__cuda_gemm_finish2(p, row, col, v.x, v.y);
        }
    }
}

/* Split-K's second pass: C = act(alpha·Σ slices + beta·C + bias), the
   slices added in order 0, 1, ... in float32 (the same bits every run),
   then the unsplit kernels' epilogue. One thread per element of C,
   grid-stride. */
static __global__ void mpt__cuda_gemm_split_sum_kernel(mpt__cuda_gemm_args p, int64_t splits) {
    const int64_t total = p.m * p.n;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = e / p.n, col = e % p.n, i = row * p.ldc + col;
        float acc = 0.0f;
        for (int64_t s = 0; s < splits; s++) acc += p.partials[s * total + e];
        mpt__cuda_gemm_store_c(p, i, mpt__cuda_gemm_epilogue(p, acc, i, col));
    }
}

/* K = 0 or alpha = 0: C = act(beta·C + bias), A and B unread. One thread
   per element of C, grid-stride. */
static __global__ void mpt__cuda_gemm_scale_c_kernel(mpt__cuda_gemm_args p) {
    const int64_t total = p.m * p.n;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = e / p.n, col = e % p.n, i = row * p.ldc + col;
        float v = p.beta != 0.0f ? p.beta * mpt__cuda_gemm_load_c(p, i) : 0.0f;
        if (p.bias) v += p.bias[col];
        mpt__cuda_gemm_store_c(p, i, mpt__cuda_act_apply(p.act, v));
    }
}

/* After cuBLASLt: C = act(C) in place, for the activations its epilogues
   do not compute exactly (p.c, p.m, p.n, p.ldc, p.act, p.c_dtype used). C
   is float32, or 16-bit for ReLU alone, which commutes with rounding. */
static __global__ void mpt__cuda_gemm_activate_kernel(mpt__cuda_gemm_args p) {
    const int64_t total = p.m * p.n;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = (e / p.n) * p.ldc + e % p.n;
        mpt__cuda_gemm_store_c(p, i, mpt__cuda_act_apply(p.act, mpt__cuda_gemm_load_c(p, i)));
    }
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-fp32  The plain FP32-arithmetic kernel (float32 A and B, and the
   fallback on GPUs without mma.sync for 16-bit types)
   ----------------------------------------------------------------------------- */

static __device__ __forceinline__ float mpt__cuda_gemm_f32(float x) { return x; }
static __device__ __forceinline__ float mpt__cuda_gemm_f32(__half x) { return __half2float(x); }
static __device__ __forceinline__ float mpt__cuda_gemm_f32(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

/* Tiling: a block of 256 threads owns a 64×64 tile of C and walks K in
   steps of 16, staging op(A) (16×64, k-major) and op(B) (16×64) in shared
   memory. Loads are guarded element by element (any alignment, any tail);
   consecutive threads read along whichever dimension is contiguous in
   memory. Thread (tx, ty) of the 16×16 grid computes the 4×4 outputs at
   rows ty + 16·i and columns tx + 16·j, summing k in order (over its K
   slice, when split: slices start at multiples of 32). */
template <typename T>
static __global__ void __launch_bounds__(256)
    mpt__cuda_gemm_simt_kernel(mpt__cuda_gemm_args p, int trans_a, int trans_b) {
    __shared__ float as[16][64 + 4], bs[16][64 + 4];
    const T *a = (const T *)p.a, *b = (const T *)p.b;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int64_t tiles_m = (p.m + 63) / 64;
    const int64_t m0 = (blockIdx.x % tiles_m) * 64, n0 = (blockIdx.x / tiles_m) * 64;
    const int64_t k_begin = blockIdx.y * p.depth;
    const int64_t k_end = p.k - k_begin < p.depth ? p.k : k_begin + p.depth;
    float acc[4][4] = {};
    for (int64_t k0 = k_begin; k0 < k_end; k0 += 16) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int e = tid + 256 * r;
            /* op(A)(mm, kk): k contiguous unless A is stored transposed. */
            const int mm = trans_a ? e & 63 : e >> 4, ka = trans_a ? e >> 6 : e & 15;
            /* op(B)(kk, nn): n contiguous unless B is stored transposed. */
            const int nn = trans_b ? e >> 4 : e & 63, kb = trans_b ? e & 15 : e >> 6;
            const int64_t gm = m0 + mm, gka = k0 + ka, gn = n0 + nn, gkb = k0 + kb;
            float va = 0.0f, vb = 0.0f;
            if (gm < p.m && gka < p.k)
                va = mpt__cuda_gemm_f32(trans_a ? a[gka * p.lda + gm] : a[gm * p.lda + gka]);
            if (gn < p.n && gkb < p.k)
                vb = mpt__cuda_gemm_f32(trans_b ? b[gn * p.ldb + gkb] : b[gkb * p.ldb + gn]);
            as[ka][mm] = va;
            bs[kb][nn] = vb;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = as[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    /* The epilogue in a rolled loop, so that its code exists once (16
       inlined copies made this kernel 500 KB; mpt__cuda_pick). */
#pragma unroll 1
    for (int q = 0; q < 16; q++) {
        const int64_t row = m0 + ty + 16 * (q / 4), col = n0 + tx + 16 * (q % 4);
        const float sum = mpt__cuda_pick<16>(q, [&](int r) { return acc[r / 4][r % 4]; });
        if (row < p.m && col < p.n) {
            const int64_t ci = row * p.ldc + col;
            if (p.partials) p.partials[(blockIdx.y * p.m + row) * p.n + col] = sum;
            else mpt__cuda_gemm_store_c(p, ci, mpt__cuda_gemm_epilogue(p, sum, ci, col));
        }
    }
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-mma  The tensor-core kernel (float16/bfloat16 A and B, sm_80 and later)
   ----------------------------------------------------------------------------- */

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define MPT__CUDA_GEMM_MMA 1 /* mma.sync m16n8k16, ldmatrix and cp.async exist */
#else
#define MPT__CUDA_GEMM_MMA 0
#endif

/* A block tile: BM×BN of C, BK of depth per stage, WARPS_M×WARPS_N warps,
   STAGES buffers in flight. Shared-memory rows are padded by 8 elements
   (16 bytes) so that the 8 rows one ldmatrix phase reads fall in 8
   different 16-byte bank groups: the row pitch is 80 bytes (BK = 32) or
   16 mod 128 bytes (64 or 128 wide), never a multiple of 128. */
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_>
struct mpt__cuda_gemm_tile {
    static constexpr int BM = BM_, BN = BN_, BK = 32, PAD = 8;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N, MIN_BLOCKS = MIN_BLOCKS_;
    static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N; /* warp tile */
    static constexpr int MT = WTM / 16, NT = WTN / 8;            /* mma tiles */
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile: 16-row mma, pairs of 8-col mma");
    /* One operand tile: MN×BK stored K-contiguous, or BK×MN MN-contiguous. */
    __host__ __device__ static constexpr int a_elems(bool k_contiguous) {
        return k_contiguous ? BM * (BK + PAD) : BK * (BM + PAD);
    }
    __host__ __device__ static constexpr int b_elems(bool k_contiguous) {
        return k_contiguous ? BN * (BK + PAD) : BK * (BN + PAD);
    }
};
/* Large problems: 128×128 tiles, 8 warps of 64×32, 4 stages (80 KiB). */
typedef mpt__cuda_gemm_tile<128, 128, 2, 4, 4, 2> mpt__cuda_gemm_tile_big;
/* Small problems (more blocks to fill the GPU) and the unaligned path:
   64×64 tiles, 4 warps of 32×32, 3 stages (30 KiB). */
typedef mpt__cuda_gemm_tile<64, 64, 2, 2, 3, 4> mpt__cuda_gemm_tile_small;

/* Copies 16 bytes global → shared without going through registers; only
   `bytes` (0..16) are read, the rest of the 16 is zero-filled. */
static __device__ __forceinline__ void mpt__cuda_gemm_cp_async(void *smem, const void *global,
                                                               int bytes) {
#if MPT__CUDA_GEMM_MMA
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global),
                 "r"(bytes)
                 : "memory");
#else
    (void)smem, (void)global, (void)bytes;
#endif
}

static __device__ __forceinline__ void mpt__cuda_gemm_cp_commit() {
#if MPT__CUDA_GEMM_MMA
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Waits until at most N of this thread's copy groups are still in flight. */
template <int N>
static __device__ __forceinline__ void mpt__cuda_gemm_cp_wait() {
#if MPT__CUDA_GEMM_MMA
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* Four 8×8 b16 matrices from shared memory; lane l gives the address of
   row l % 8 of matrix l / 8. Without .trans thread t receives, of each
   matrix, row t/4, elements 2(t%4) and 2(t%4)+1; with .trans the same of
   the transposed matrix. */
template <bool TRANS>
static __device__ __forceinline__ void mpt__cuda_gemm_ldmatrix4(uint32_t r[4], const void *smem) {
#if MPT__CUDA_GEMM_MMA
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
#else
    (void)smem;
    r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

/* One mma.sync, d[0..3] += a[0..3]·b[0..1] in place, as this GEMM and the
   int8 one (@cuda-qgemm) issue it: SHAPE_TYPES names the shape and the
   types of D, A, B and C ("m16n8k16.row.col.f32.bf16.bf16.f32"), D_REG the
   accumulators' constraint ("+f" float32, "+r" int32). Device code below
   sm_80, where mma.sync does not exist, leaves d as it is. */
#if MPT__CUDA_GEMM_MMA
#define MPT__CUDA_MMA_SYNC(SHAPE_TYPES, D_REG)                                             \
    asm volatile("mma.sync.aligned." SHAPE_TYPES " "                                       \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                  \
                 : D_REG(d[0]), D_REG(d[1]), D_REG(d[2]), D_REG(d[3])                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
#else
#define MPT__CUDA_MMA_SYNC(SHAPE_TYPES, D_REG) ((void)d, (void)a, (void)b)
#endif

/* d += a·b for one 16×8×16 step, float32 accumulators. */
template <bool BF16>
static __device__ __forceinline__ void mpt__cuda_gemm_mma(float d[4], const uint32_t a[4],
                                                          const uint32_t b[2]) {
    if (BF16) MPT__CUDA_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32", "+f");
    else MPT__CUDA_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32", "+f");
}

/* Loads a ROWS×COLS tile of a stored row-major matrix (rows × cols, leading
   dimension ld) starting at (row0, col0) into shared memory with row pitch
   COLS + PAD, in 16-byte chunks of 8 elements. Outside the matrix reads as
   zero, so K tails add nothing and M/N tails compute unused values.
   ASYNC: cp.async (pointer and ld 16-byte aligned); else guarded 2-byte
   loads, for any alignment. */
template <int ROWS, int COLS, int PAD, int THREADS, bool ASYNC>
static __device__ __forceinline__ void mpt__cuda_gemm_load_tile(uint16_t *smem,
                                                                const uint16_t *g, int64_t ld,
                                                                int64_t row0, int64_t col0,
                                                                int64_t rows, int64_t cols,
                                                                int tid) {
    constexpr int CHUNKS_PER_ROW = COLS / 8, CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; i++) {
        const int chunk = tid + i * THREADS;
        const int r = chunk / CHUNKS_PER_ROW, cc = (chunk % CHUNKS_PER_ROW) * 8;
        const int64_t gr = row0 + r, gc = col0 + cc;
        uint16_t *dst = smem + r * (COLS + PAD) + cc;
        const int64_t valid = gr < rows && gc < cols ? (cols - gc < 8 ? cols - gc : 8) : 0;
        if (ASYNC) {
            /* With nothing to read, the source is never dereferenced but must
               still be a valid address: the matrix's first element. */
            mpt__cuda_gemm_cp_async(dst, valid ? g + gr * ld + gc : g, (int)valid * 2);
        } else {
            uint16_t v[8];
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = e < valid ? g[gr * ld + gc + e] : (uint16_t)0;
            uint4 packed;
            packed.x = v[0] | (uint32_t)v[1] << 16;
            packed.y = v[2] | (uint32_t)v[3] << 16;
            packed.z = v[4] | (uint32_t)v[5] << 16;
            packed.w = v[6] | (uint32_t)v[7] << 16;
            *(uint4 *)dst = packed;
        }
    }
}

/* The same tile of one of Conv2D's matrices (mpt__conv_gather_at's
   KIND, mpt.h @backend-shared-cuda), stored nowhere: each 16-byte chunk
   is copied from where the rule finds it in the tensor g, or zero-filled
   where the rule gives -1 or the chunk lies past the matrix. Needs cols a
   multiple of 8 and g 16-byte aligned (mpt__conv_gather_fits). */
template <int ROWS, int COLS, int PAD, int THREADS, int KIND>
static __device__ __forceinline__ void mpt__cuda_gemm_gather_tile(uint16_t *smem,
                                                                  const uint16_t *g,
                                                                  const mpt__conv_gather &q,
                                                                  int64_t row0, int64_t col0,
                                                                  int64_t rows, int64_t cols,
                                                                  int tid) {
    constexpr int CHUNKS_PER_ROW = COLS / 8, CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; i++) {
        const int chunk = tid + i * THREADS;
        const int r = chunk / CHUNKS_PER_ROW, cc = (chunk % CHUNKS_PER_ROW) * 8;
        const int64_t gr = row0 + r, gc = col0 + cc;
        const int64_t at = gr < rows && gc < cols ? mpt__conv_gather_at(&q, KIND, gr, gc) : -1;
        /* nothing to read: a valid address all the same (as load_tile's) */
        mpt__cuda_gemm_cp_async(smem + r * (COLS + PAD) + cc, at >= 0 ? g + at : g,
                                at >= 0 ? 16 : 0);
    }
}

/* The A fragment of one 16×16 mma tile (rows m, depths kk..kk+15) as
   mma.m16n8k16 wants it: a0 = rows 0-7 × k 0-7, a1 = rows 8-15 × k 0-7,
   a2 = rows 0-7 × k 8-15, a3 = rows 8-15 × k 8-15.
   K-contiguous tile [m][k]: matrix j = lane/8 starts at row 8(j%2), k 8(j/2).
   M-contiguous tile [k][m] (A stored transposed): the same four matrices
   read as k-rows and transposed by ldmatrix.trans. */
template <class TILE, bool A_K_CONTIGUOUS>
static __device__ __forceinline__ void mpt__cuda_gemm_frag_a(uint32_t r[4], const uint16_t *sa,
                                                             int m, int kk, int lane) {
    if (A_K_CONTIGUOUS) {
        const int row = m + (lane & 15), k = kk + (lane >> 4) * 8;
        mpt__cuda_gemm_ldmatrix4<false>(r, sa + row * (TILE::BK + TILE::PAD) + k);
    } else {
        const int k = kk + (lane & 7) + ((lane >> 4) & 1) * 8, col = m + ((lane >> 3) & 1) * 8;
        mpt__cuda_gemm_ldmatrix4<true>(r, sa + k * (TILE::BM + TILE::PAD) + col);
    }
}

/* The B fragments of two adjacent 16×8 mma tiles (columns n..n+15): each
   thread holds b0 = B[k 2(t%4), +1][n t/4] and b1 the same 8 deeper.
   r[0], r[1] serve columns n..n+7 and r[2], r[3] columns n+8..n+15.
   N-contiguous tile [k][n]: matrix j covers k 8(j%2), n 8(j/2), transposed.
   K-contiguous tile [n][k] (B stored transposed): matrix j covers n 8(j/2),
   k 8(j%2), read as is (its rows are columns of B). */
template <class TILE, bool B_K_CONTIGUOUS>
static __device__ __forceinline__ void mpt__cuda_gemm_frag_b(uint32_t r[4], const uint16_t *sb,
                                                             int n, int kk, int lane) {
    if (B_K_CONTIGUOUS) {
        const int row = n + (lane & 7) + ((lane >> 4) & 1) * 8, k = kk + ((lane >> 3) & 1) * 8;
        mpt__cuda_gemm_ldmatrix4<false>(r, sb + row * (TILE::BK + TILE::PAD) + k);
    } else {
        const int k = kk + (lane & 7) + ((lane >> 3) & 1) * 8, col = n + ((lane >> 4) & 1) * 8;
        mpt__cuda_gemm_ldmatrix4<true>(r, sb + k * (TILE::BN + TILE::PAD) + col);
    }
}

/* What the kernel's operands are: stored matrices (every GEMM), or
   Conv2D's (@cuda-conv), whose A (and, for the input gradient, B) are
   gathered from the tensors by mpt.h's rule. */
enum {
    MPT__CUDA_CONV_NONE = 0,
    MPT__CUDA_CONV_FORWARD = 1,     /* A = cols; B the kernel, stored     */
    MPT__CUDA_CONV_INPUT_GRAD = 2,  /* A from dz; B the kernel, gathered */
    MPT__CUDA_CONV_KERNEL_GRAD = 3  /* A = colsᵀ; B dz, stored            */
};

/* A Conv2D product's arguments: the GEMM's, and the rule's window. A
   type of its own, so that the plain GEMMs' kernels keep theirs. */
struct mpt__cuda_conv_gemm_args : mpt__cuda_gemm_args {
    mpt__conv_gather gather;
};
template <int CONV>
using mpt__cuda_tc_args =
    typename std::conditional<CONV == MPT__CUDA_CONV_NONE, mpt__cuda_gemm_args,
                              mpt__cuda_conv_gemm_args>::type;
__host__ __device__ static constexpr int mpt__cuda_conv_a_kind(int conv) {
    return conv == MPT__CUDA_CONV_NONE         ? 0
           : conv == MPT__CUDA_CONV_INPUT_GRAD ? MPT__CONV_GATHER_DZ
                                               : MPT__CONV_GATHER_COLS;
}
__host__ __device__ static constexpr int mpt__cuda_conv_b_kind(int conv) {
    return conv == MPT__CUDA_CONV_INPUT_GRAD ? MPT__CONV_GATHER_KERNEL : 0;
}

/* One stage: the A and B tiles for depth k0. A is stored M×K (K contiguous)
   or, transposed, K×M; B is stored K×N or, transposed, N×K. An operand
   Conv2D gathers (CONV) is read through its rule in the same layout. */
template <class TILE, bool TA, bool TB, bool ASYNC, int CONV>
static __device__ __forceinline__ void mpt__cuda_gemm_load_stage(const mpt__cuda_tc_args<CONV> &p,
                                                                 uint16_t *sa, uint16_t *sb,
                                                                 int64_t m0, int64_t n0,
                                                                 int64_t k0, int tid) {
    const uint16_t *a = (const uint16_t *)p.a, *b = (const uint16_t *)p.b;
    constexpr int BM = TILE::BM, BN = TILE::BN, BK = TILE::BK, PAD = TILE::PAD;
    constexpr int TH = TILE::THREADS;
    constexpr int A_KIND = mpt__cuda_conv_a_kind(CONV), B_KIND = mpt__cuda_conv_b_kind(CONV);
    if constexpr (A_KIND != 0) {
        static_assert(ASYNC, "a gathered operand is read by cp.async");
        if (!TA)
            mpt__cuda_gemm_gather_tile<BM, BK, PAD, TH, A_KIND>(sa, a, p.gather, m0, k0, p.m,
                                                                p.k, tid);
        else
            mpt__cuda_gemm_gather_tile<BK, BM, PAD, TH, A_KIND>(sa, a, p.gather, k0, m0, p.k,
                                                                p.m, tid);
    } else {
        if (!TA)
            mpt__cuda_gemm_load_tile<BM, BK, PAD, TH, ASYNC>(sa, a, p.lda, m0, k0, p.m, p.k, tid);
        else mpt__cuda_gemm_load_tile<BK, BM, PAD, TH, ASYNC>(sa, a, p.lda, k0, m0, p.k, p.m, tid);
    }
    if constexpr (B_KIND != 0) {
        static_assert(TB, "the gathered kernel is B stored transposed");
        mpt__cuda_gemm_gather_tile<BN, BK, PAD, TH, B_KIND>(sb, b, p.gather, n0, k0, p.n, p.k,
                                                            tid);
    } else {
        if (TB)
            mpt__cuda_gemm_load_tile<BN, BK, PAD, TH, ASYNC>(sb, b, p.ldb, n0, k0, p.n, p.k, tid);
        else mpt__cuda_gemm_load_tile<BK, BN, PAD, TH, ASYNC>(sb, b, p.ldb, k0, n0, p.k, p.n, tid);
    }
}

/* The ring's bytes (and, after the loop, the warps' staging blocks). */
template <class TILE, bool TA, bool TB>
__host__ __device__ static constexpr int mpt__cuda_gemm_tc_smem() {
    return TILE::STAGES * (TILE::a_elems(!TA) + TILE::b_elems(TB)) * 2;
}

/* C = act(alpha·op(A)·op(B) + beta·C + bias) with mma.sync tensor cores.

   Tiling. Block b owns the BM×BN tile of C at (m0, n0) (M tiles vary
   fastest, so neighbouring blocks share B's columns in L2). Its depth loop
   walks K in BK = 32 steps through a ring of STAGES shared-memory buffers:
   cp.async fills buffer (t + STAGES-1) % STAGES while the warps multiply
   buffer t % STAGES, so up to STAGES-1 tiles are in flight. Each operand
   tile is kept as it lies in memory ([mn][k] when K is contiguous, [k][mn]
   when the operand is stored transposed) and ldmatrix (.trans for [k][mn])
   turns either layout into mma fragments, so one kernel with two template
   flags serves all four transpose cases. Warps form a WARPS_M×WARPS_N grid;
   each owns a WTM×WTN sub-tile = MT×NT mma tiles of 16×8, whose float32
   accumulators stay in registers (thread t holds rows t/4 and t/4 + 8,
   columns 2(t%4) and +1 of each), and each BK step issues 2·MT·NT mmas.
   The epilogue passes the sums through the emptied ring, a block per
   warp (mpt__cuda_gemm_finish_staged), applies alpha, beta·C, bias and
   the activation and stores C (float32 or rounded once to 16 bits).
   Split-K: block row blockIdx.y walks only its slice of K (whole BK
   steps) and stores its float32 sums for the second pass instead.
   CONV: a Conv2D product whose operands are gathered (@cuda-conv); only
   the stage loads differ. */
template <class TILE, bool BF16, bool TA, bool TB, bool ASYNC, int CONV = MPT__CUDA_CONV_NONE>
static __global__ void __launch_bounds__(TILE::THREADS, TILE::MIN_BLOCKS)
    mpt__cuda_gemm_tc_kernel(mpt__cuda_tc_args<CONV> p) {
#if MPT__CUDA_GEMM_MMA
    constexpr int BM = TILE::BM, BN = TILE::BN, BK = TILE::BK, STAGES = TILE::STAGES;
    constexpr int MT = TILE::MT, NT = TILE::NT;
    constexpr int A_ELEMS = TILE::a_elems(!TA), B_ELEMS = TILE::b_elems(TB);
    extern __shared__ uint4 mpt__cuda_gemm_smem[];
    uint16_t *const sa = (uint16_t *)mpt__cuda_gemm_smem;
    uint16_t *const sb = sa + STAGES * A_ELEMS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp % TILE::WARPS_M) * TILE::WTM, wn = (warp / TILE::WARPS_M) * TILE::WTN;
    const int64_t tiles_m = (p.m + BM - 1) / BM;
    const int64_t m0 = (blockIdx.x % tiles_m) * BM, n0 = (blockIdx.x / tiles_m) * BN;
    const int64_t kt0 = blockIdx.y * p.depth / BK; /* the slice's first BK step */
    const int64_t k_end = p.k - blockIdx.y * p.depth < p.depth ? p.k : (blockIdx.y + 1) * p.depth;
    const int64_t ktiles = (k_end + BK - 1) / BK - kt0;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0;

    /* Prologue: the first STAGES-1 tiles (one commit group each, empty
       past the end, so the group count stays in step with t). */
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles)
            mpt__cuda_gemm_load_stage<TILE, TA, TB, ASYNC, CONV>(
                p, sa + s * A_ELEMS, sb + s * B_ELEMS, m0, n0, (kt0 + s) * BK, tid);
        mpt__cuda_gemm_cp_commit();
    }
    for (int64_t t = 0; t < ktiles; t++) {
        /* Tile t has landed (this thread's copies), and after the barrier
           everyone's has; the barrier also ends every warp's reads of the
           buffer refilled next, which held tile t - 1. */
        mpt__cuda_gemm_cp_wait<STAGES - 2>();
        __syncthreads();
        const int64_t next = t + STAGES - 1;
        if (next < ktiles) {
            const int s = (int)(next % STAGES);
            mpt__cuda_gemm_load_stage<TILE, TA, TB, ASYNC, CONV>(
                p, sa + s * A_ELEMS, sb + s * B_ELEMS, m0, n0, (kt0 + next) * BK, tid);
        }
        mpt__cuda_gemm_cp_commit();

        const uint16_t *a = sa + (int)(t % STAGES) * A_ELEMS;
        const uint16_t *b = sb + (int)(t % STAGES) * B_ELEMS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; i++)
                mpt__cuda_gemm_frag_a<TILE, !TA>(af[i], a, wm + i * 16, kk, lane);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                uint32_t r[4];
                mpt__cuda_gemm_frag_b<TILE, TB>(r, b, wn + j * 8, kk, lane);
                bf[j][0] = r[0];
                bf[j][1] = r[1];
                bf[j + 1][0] = r[2];
                bf[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) mpt__cuda_gemm_mma<BF16>(acc[i][j], af[i], bf[j]);
        }
    }
    mpt__cuda_gemm_cp_wait<0>();
    /* every warp is done with the ring: its start becomes the staging */
    __syncthreads();
    static_assert(TILE::THREADS / 32 * MPT__CUDA_EPI_WARP_FLOATS * 4 <=
                      mpt__cuda_gemm_tc_smem<TILE, TA, TB>(),
                  "the ring holds every warp's staging block");
    mpt__cuda_gemm_finish_staged<MT, NT>(
        p, blockIdx.y, (float *)mpt__cuda_gemm_smem + warp * MPT__CUDA_EPI_WARP_FLOATS,
        [&](int i, int j, int e) { return acc[i][j][e]; }, m0 + wm, n0 + wn, lane);
#else
    (void)p;
#endif
}

/* Launches one instantiation, or (prepare) raises its shared-memory limit,
   which the 4-stage tiles need above the default 48 KiB. */
template <class TILE, bool BF16, bool TA, bool TB, bool ASYNC, int CONV = MPT__CUDA_CONV_NONE>
static cudaError_t mpt__cuda_gemm_tc_go(const mpt__cuda_tc_args<CONV> *p, cudaStream_t stream,
                                        int prepare) {
    constexpr int smem = mpt__cuda_gemm_tc_smem<TILE, TA, TB>();
    if (prepare)
        return cudaFuncSetAttribute(mpt__cuda_gemm_tc_kernel<TILE, BF16, TA, TB, ASYNC, CONV>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int64_t tiles = ((p->m + TILE::BM - 1) / TILE::BM) * ((p->n + TILE::BN - 1) / TILE::BN);
    const int64_t slices = (p->k + p->depth - 1) / p->depth;
    mpt__cuda_gemm_tc_kernel<TILE, BF16, TA, TB, ASYNC, CONV>
        <<<dim3((unsigned)tiles, (unsigned)slices), TILE::THREADS, smem, stream>>>(*p);
    return cudaSuccess;
}

template <class TILE, bool BF16, bool ASYNC>
static cudaError_t mpt__cuda_gemm_tc_trans(int ta, int tb, const mpt__cuda_gemm_args *p,
                                           cudaStream_t stream, int prepare) {
    if (ta) {
        if (tb) return mpt__cuda_gemm_tc_go<TILE, BF16, true, true, ASYNC>(p, stream, prepare);
        return mpt__cuda_gemm_tc_go<TILE, BF16, true, false, ASYNC>(p, stream, prepare);
    }
    if (tb) return mpt__cuda_gemm_tc_go<TILE, BF16, false, true, ASYNC>(p, stream, prepare);
    return mpt__cuda_gemm_tc_go<TILE, BF16, false, false, ASYNC>(p, stream, prepare);
}

/* The tensor-core variants: big tiles (aligned only), small tiles aligned,
   small tiles with guarded loads. */
enum { MPT__CUDA_GEMM_BIG = 0, MPT__CUDA_GEMM_SMALL = 1, MPT__CUDA_GEMM_SMALL_GUARDED = 2 };

static cudaError_t mpt__cuda_gemm_tc_dispatch(int variant, int bf16, int ta, int tb,
                                              const mpt__cuda_gemm_args *p, cudaStream_t stream,
                                              int prepare) {
    typedef mpt__cuda_gemm_tile_big big;
    typedef mpt__cuda_gemm_tile_small small;
    switch (variant) {
    case MPT__CUDA_GEMM_BIG:
        return bf16 ? mpt__cuda_gemm_tc_trans<big, true, true>(ta, tb, p, stream, prepare)
                    : mpt__cuda_gemm_tc_trans<big, false, true>(ta, tb, p, stream, prepare);
    case MPT__CUDA_GEMM_SMALL:
        return bf16 ? mpt__cuda_gemm_tc_trans<small, true, true>(ta, tb, p, stream, prepare)
                    : mpt__cuda_gemm_tc_trans<small, false, true>(ta, tb, p, stream, prepare);
    default:
        return bf16 ? mpt__cuda_gemm_tc_trans<small, true, false>(ta, tb, p, stream, prepare)
                    : mpt__cuda_gemm_tc_trans<small, false, false>(ta, tb, p, stream, prepare);
    }
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-wgmma  The Hopper kernel (sm_90a: TMA, mbarriers, wgmma, setmaxnreg)
   ----------------------------------------------------------------------------- */

/* C = act(alpha·op(A)·op(B) + beta·C + bias), the same product and
   epilogue as the mma.sync kernel above, shaped for Hopper's tensor cores.
   It exists only in an sm_90a image (-gencode arch=compute_90a,code=
   sm_90a: wgmma and setmaxnreg are not in plain sm_90); elsewhere its body
   is empty, the host learns so from mpt__cuda_wgmma_built, and every
   product takes the mma.sync kernel. Host rules: mpt.h, @backend-shared
   (mpt__wgmma_*).

   Tiling. A CTA computes 128×BN tiles of C (BN = 256 or 128,
   mpt__wgmma_tile_n), walking K in stages of BK = 64: 64 16-bit values
   are 128 bytes, exactly the span of the 128-byte shared-memory swizzle.
   Its 384 threads are three warpgroups (4 warps each, 128 threads):
   warpgroup 0 is the producer, 1 and 2 the consumers, each owning 64 rows
   of the tile. Per stage a consumer issues four wgmma m64nBNk16 (K = 16
   each), whose float32 sums (64×BN, BN/2 registers per thread) stay in
   its registers from the first stage of a tile to its epilogue.

   Why each piece:
   - TMA (cp.async.bulk.tensor): one thread of the producer copies a whole
     stage (A: 128×64, B: BN×64) with a handful of instructions; the copy
     engine does the address arithmetic, the bounds (outside the matrix
     reads as zero, so M, N and K tails need no code) and the swizzle. Its
     tensor maps describe A and B in global memory; they are encoded on
     the host once per shape and pointer (the plan cache keeps them) and
     passed by value as __grid_constant__ parameters, which TMA reads in
     place.
   - The 128-byte swizzle: a tile row is 128 bytes, so an unswizzled
     column of 16-byte chunks would sit in one bank group; TMA XORs the
     chunk index with the row index mod 8 while writing, and the wgmma
     descriptors below declare the same swizzle, so the tensor cores read
     conflict-free. It needs 1024-byte aligned tiles (8 rows × 128 bytes).
   - The mbarrier ring: STAGES buffers, each with a `full` barrier (the
     producer arms it with the stage's byte count; TMA completes it when
     the bytes have landed) and an `empty` barrier (each consumer warp
     arrives once its wgmmas have read the stage). Phases alternate 0, 1,
     0, ... per use of a buffer, so a running stage counter gives both
     the buffer (counter % STAGES) and the parity to wait for.
   - Warp specialisation with setmaxnreg: the producer needs a few
     registers, the consumers 64·BN/128 sums each, so after the role
     split the producer gives registers back (40 per thread) and the
     consumers take them (232): with 384 threads the kernel starts
     capped at 168 per thread, and 128×256 float32 sums need 128 each
     plus addresses and the epilogue.
   - wgmma.mma_async: a warpgroup-wide matrix multiply reading A and B
     from shared memory through descriptors (start address, the strides
     between 8-row core-matrix groups, the swizzle). K-major operands (A
     untransposed, B transposed) and M/N-major ones (A transposed, B
     untransposed) both exist for 16-bit types: the transpose bits of the
     instruction pick the layout, so the four transpose cases are one
     kernel with two template flags, as for mma.sync. A consumer issues a
     stage's four wgmmas, commits them as a group and waits until at most
     one group is pending: the previous stage's reads are then complete
     and its buffer goes back to the producer while this stage computes.
   - The persistent scheduler: min(work, SMs) CTAs, one per SM (the ring
     takes ~192 KiB of shared memory), each walking work items in a fixed
     order (mpt__wgmma_work_at: bands of tile rows, for L2 reuse). The
     producer runs ahead into the next tile while the consumers finish
     the last one's epilogue, so loads overlap the stores.
   - Split-K (mpt__wgmma_split_k) for products with few tiles and a long
     K (convolution weight gradients): a work item is a tile of one K
     slice, its float32 sums go to the slice's partials and the second
     pass (mpt__cuda_gemm_split_sum_kernel) adds the slices in order, so
     the bits repeat from run to run; no atomics anywhere.
   - The epilogue: the sums are in the mma.sync accumulator layout (thread
     t of warp w holds rows 16w + t/4 and +8, columns 2(t%4), +1 of each
     8-column block), so the same staged epilogue stores C: each warp
     passes its sums through its own block of shared memory, beside the
     ring (the producer may already be filling the ring for the next
     tile), and one rolled copy of the epilogue's code finishes them. */

/* MPT__CUDA_WGMMA: the code below is compiled (the sm_90a pass, and the
   host pass, which only parses it); the other device passes get empty
   bodies. MPT__CUDA_WGMMA_IMAGE: this pass makes the sm_90a image. */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MPT__CUDA_WGMMA_IMAGE 1
#else
#define MPT__CUDA_WGMMA_IMAGE 0
#endif
#if !defined(__CUDA_ARCH__) || MPT__CUDA_WGMMA_IMAGE
#define MPT__CUDA_WGMMA 1
#else
#define MPT__CUDA_WGMMA 0
#endif

/* 1 in the sm_90a image, 0 in the others: the host reads the loaded
   image's copy to learn whether the kernel below has a body. */
static __device__ int mpt__cuda_wgmma_built = MPT__CUDA_WGMMA_IMAGE;

template <int BN_>
struct mpt__cuda_wgmma_tile {
    static constexpr int BM = MPT__WGMMA_BM, BN = BN_, BK = MPT__WGMMA_BK;
    static constexpr int STAGES = BN == 256 ? 4 : 6;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES; /* a multiple of 1024 */
    static constexpr int THREADS = 384, CONSUMER_WARPS = 8;
    /* The stages, their 2·STAGES barriers, the consumer warps' staging
       blocks for the epilogue, and up to 1023 bytes to align. */
    static constexpr int SMEM = STAGES * STAGE_BYTES + 16 * STAGES +
                                CONSUMER_WARPS * MPT__CUDA_EPI_WARP_FLOATS * 4 + 1024;
    static_assert(STAGE_BYTES % 1024 == 0, "every stage 1024-byte aligned for the swizzle");
    static_assert(SMEM <= 227 * 1024, "over Hopper's 227 KiB per block");
};

/* The helpers exist where the kernel has a body (MPT__CUDA_WGMMA). */
#if MPT__CUDA_WGMMA
static __device__ __forceinline__ void mpt__cuda_mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* Arms a barrier's phase with the bytes TMA will deliver (and arrives). */
static __device__ __forceinline__ void mpt__cuda_mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void mpt__cuda_mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                     bar)
                 : "memory");
}

/* Waits until the barrier's phase of this parity has completed. */
static __device__ __forceinline__ void mpt__cuda_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

/* One TMA box: tensor map `map` at (inner, outer) into shared memory at
   dst, completing `bar`'s transaction bytes. */
static __device__ __forceinline__ void mpt__cuda_tma_load(uint32_t dst, const CUtensorMap *map,
                                                          int32_t inner, int32_t outer,
                                                          uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)(uintptr_t)map), "r"(inner), "r"(outer), "r"(bar)
                 : "memory");
}

/* A wgmma shared-memory descriptor for a 128-byte-swizzled operand tile
   at shared address addr: bits 0-13 the address / 16, 16-29 the leading
   byte offset / 16, 32-45 the stride byte offset / 16, 62-63 the swizzle
   (1: 128 bytes). K-major: rows of 128 bytes (64 values of K), 8-row
   groups 1024 bytes apart (stride), the leading offset unused (1 by
   convention). M/N-major: K rows of 128 bytes (64 values of M or N), 8-row
   groups 1024 bytes apart (stride), the next 64 of M or N 8 KiB further
   (leading: one 64×64 TMA box). */
static __device__ __forceinline__ uint64_t mpt__cuda_wgmma_desc(uint32_t addr, bool k_major) {
    const uint64_t leading = k_major ? 16 : 8192, stride = 1024;
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (leading >> 4) << 16 | (stride >> 4) << 32 |
           (uint64_t)1 << 62;
}

static __device__ __forceinline__ void mpt__cuda_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void mpt__cuda_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until at most N of this warpgroup's committed groups are pending. */
template <int N>
static __device__ __forceinline__ void mpt__cuda_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving reads or writes of r across this point
   (the wgmma writing r runs asynchronously: its results exist only after
   the wait). */
static __device__ __forceinline__ void mpt__cuda_wgmma_hold(float &r) {
    asm volatile("" : "+f"(r)::"memory");
}

#endif /* MPT__CUDA_WGMMA */

/* Accumulators d[i..i+7], and d[i..i+63], as operands that wgmma reads and writes. */
#define MPT__WGMMA_D8(i)                                                                     \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define MPT__WGMMA_D64(i)                                                                    \
    MPT__WGMMA_D8(i), MPT__WGMMA_D8(i + 8), MPT__WGMMA_D8(i + 16), MPT__WGMMA_D8(i + 24),    \
        MPT__WGMMA_D8(i + 32), MPT__WGMMA_D8(i + 40), MPT__WGMMA_D8(i + 48), MPT__WGMMA_D8(i + 56)

/* Those operands' numbers in the instruction's text: the first 64
   accumulators (all of n128's), and n256's other 64. */
#define MPT__WGMMA_REGS_0_63 \
    "%0, %1, %2, %3, %4, %5, %6, %7, " \
    "%8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define MPT__WGMMA_REGS_64_127 \
    "%64, %65, %66, %67, %68, %69, %70, %71, " \
    "%72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, " \
    "%104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127"

/* One wgmma.mma_async of SHAPE on TYPE inputs, into the accumulators
   listed last (the outputs). Operands are numbered outputs first: the
   accumulators (ACC_REGS), then desc_a, desc_b, the scale-d flag (1: add
   to d) and TRANS_A, TRANS_B. SCALE_D names the flag's operand, REST the
   instruction's operands after the accumulators: n128 has 64 accumulators,
   so its desc_a is %64; n256 has 128. */
#define MPT__WGMMA_ASYNC(SHAPE, TYPE, ACC_REGS, SCALE_D, REST, ...)                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                    \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {"         \
                 ACC_REGS "}, " REST ";\n}\n"                                            \
                 : __VA_ARGS__                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_A), "n"(TRANS_B))
#define MPT__WGMMA_N128(TYPE)                                                            \
    MPT__WGMMA_ASYNC("m64n128k16", TYPE, MPT__WGMMA_REGS_0_63, "%66",                    \
                     "%64, %65, p, 1, 1, %67, %68", MPT__WGMMA_D64(0))
#define MPT__WGMMA_N256(TYPE)                                                            \
    MPT__WGMMA_ASYNC("m64n256k16", TYPE, MPT__WGMMA_REGS_0_63 ", " MPT__WGMMA_REGS_64_127, \
                     "%130", "%128, %129, p, 1, 1, %131, %132", MPT__WGMMA_D64(0),       \
                     MPT__WGMMA_D64(64))

/* d (64×BN float32 sums, BN/2 per thread; BN 128 or 256) += A (64×16,
   descriptor desc_a) · B (16×BN, desc_b); TRANS_A, TRANS_B: 0 for a
   K-major operand, 1 for an M- or N-major one. Asynchronous: the sums may
   be read only after wgmma.commit_group and wgmma.wait_group. */
template <int BN, bool BF16, int TRANS_A, int TRANS_B>
static __device__ __forceinline__ void mpt__cuda_wgmma(float (&d)[BN / 2], uint64_t desc_a,
                                                      uint64_t desc_b) {
#if MPT__CUDA_WGMMA
    if constexpr (BN == 256) {
        if (BF16) MPT__WGMMA_N256("bf16");
        else MPT__WGMMA_N256("f16");
    } else {
        if (BF16) MPT__WGMMA_N128("bf16");
        else MPT__WGMMA_N128("f16");
    }
#else
    (void)d, (void)desc_a, (void)desc_b;
#endif
}
#undef MPT__WGMMA_N256
#undef MPT__WGMMA_N128
#undef MPT__WGMMA_ASYNC
#undef MPT__WGMMA_REGS_64_127
#undef MPT__WGMMA_REGS_0_63
#undef MPT__WGMMA_D64
#undef MPT__WGMMA_D8

/* d (64×BN) += one 64-deep stage: four wgmma of K = 16. a: the stage's A
   rows of this consumer (64×64), b: the stage's B (BN×64 or 64×BN). A
   K-major step of 16 values is 32 bytes along a 128-byte row (the swizzle
   is applied to the whole address, so a start 32 bytes in is right); an
   M/N-major step is 16 rows of 128 bytes. */
template <int BN, bool BF16, bool TA, bool TB>
static __device__ __forceinline__ void mpt__cuda_wgmma_stage(float (&d)[BN / 2], uint32_t a,
                                                             uint32_t b) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint64_t da = mpt__cuda_wgmma_desc(a + (TA ? kk * 2048 : kk * 32), !TA);
        const uint64_t db = mpt__cuda_wgmma_desc(b + (TB ? kk * 32 : kk * 2048), TB);
        mpt__cuda_wgmma<BN, BF16, TA ? 1 : 0, TB ? 0 : 1>(d, da, db);
    }
}

#if MPT__CUDA_WGMMA
/* The first K step and the number of steps of slice `slice`. */
static __device__ __forceinline__ void mpt__cuda_wgmma_slice(const mpt__cuda_gemm_args &p,
                                                             int64_t slice, int64_t *kt0,
                                                             int64_t *ktiles) {
    const int64_t begin = slice * p.depth;
    const int64_t end = p.k - begin < p.depth ? p.k : begin + p.depth;
    *kt0 = begin / MPT__WGMMA_BK;
    *ktiles = (end - begin + MPT__WGMMA_BK - 1) / MPT__WGMMA_BK;
}
#endif

template <int BN, bool BF16, bool TA, bool TB>
static __global__ void __launch_bounds__(384, 1)
    mpt__cuda_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                           const __grid_constant__ CUtensorMap map_b, mpt__cuda_gemm_args p,
                           int64_t tiles_m, int64_t tiles_n, int64_t work) {
#if MPT__CUDA_WGMMA
    typedef mpt__cuda_wgmma_tile<BN> T;
    extern __shared__ __align__(1024) uint8_t mpt__cuda_wgmma_smem[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(mpt__cuda_wgmma_smem);
    const uint32_t tiles = (raw + 1023) & ~1023u; /* stage s at tiles + s·STAGE_BYTES */
    const uint32_t full = tiles + T::STAGES * T::STAGE_BYTES, empty = full + 8 * T::STAGES;
    float *const stage = (float *)(mpt__cuda_wgmma_smem + (empty + 8 * T::STAGES - raw));
    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < T::STAGES; s++) {
            mpt__cuda_mbar_init(full + 8 * s, 1);
            mpt__cuda_mbar_init(empty + 8 * s, T::CONSUMER_WARPS);
        }
        /* the initialised barriers visible to the copy engine too */
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        /* The producer: one thread issues every copy. */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 0) {
            uint32_t use = 0; /* stages filled so far, over all work items */
            for (int64_t w = blockIdx.x; w < work; w += gridDim.x) {
                const mpt__wgmma_work at = mpt__wgmma_work_at(w, tiles_m, tiles_n);
                const int32_t m0 = (int32_t)(at.tile_m * T::BM), n0 = (int32_t)(at.tile_n * BN);
                int64_t kt0, ktiles;
                mpt__cuda_wgmma_slice(p, at.slice, &kt0, &ktiles);
                for (int64_t t = 0; t < ktiles; t++, use++) {
                    const uint32_t s = use % T::STAGES, parity = (use / T::STAGES) & 1;
                    const uint32_t a = tiles + s * T::STAGE_BYTES, b = a + T::A_BYTES;
                    const int32_t k0 = (int32_t)((kt0 + t) * T::BK);
                    /* the consumers have released this buffer's last use
                       (the first use waits for parity 1: passes at once) */
                    mpt__cuda_mbar_wait(empty + 8 * s, parity ^ 1);
                    mpt__cuda_mbar_expect(full + 8 * s, T::STAGE_BYTES);
                    if (!TA) {
                        mpt__cuda_tma_load(a, &map_a, k0, m0, full + 8 * s);
                    } else {
#pragma unroll
                        for (int i = 0; i < T::BM / 64; i++)
                            mpt__cuda_tma_load(a + i * 8192, &map_a, m0 + 64 * i, k0, full + 8 * s);
                    }
                    if (TB) {
                        mpt__cuda_tma_load(b, &map_b, k0, n0, full + 8 * s);
                    } else {
#pragma unroll
                        for (int i = 0; i < BN / 64; i++)
                            mpt__cuda_tma_load(b + i * 8192, &map_b, n0 + 64 * i, k0, full + 8 * s);
                    }
                }
            }
        }
    } else {
        /* A consumer: rows 64·(warpgroup − 1) of each tile. */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int half = warpgroup - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
        uint32_t use = 0;
        float d[BN / 2];
        for (int64_t w = blockIdx.x; w < work; w += gridDim.x) {
            const mpt__wgmma_work at = mpt__wgmma_work_at(w, tiles_m, tiles_n);
            int64_t kt0, ktiles;
            mpt__cuda_wgmma_slice(p, at.slice, &kt0, &ktiles);
#pragma unroll
            for (int i = 0; i < BN / 2; i++) d[i] = 0.0f;
            for (int64_t t = 0; t < ktiles; t++, use++) {
                const uint32_t s = use % T::STAGES, parity = (use / T::STAGES) & 1;
                const uint32_t a = tiles + s * T::STAGE_BYTES, b = a + T::A_BYTES;
                mpt__cuda_mbar_wait(full + 8 * s, parity);
                /* the sums' registers written before (zeroing, the last
                   tile's epilogue) are ordered before the wgmmas */
#pragma unroll
                for (int i = 0; i < BN / 2; i++) mpt__cuda_wgmma_hold(d[i]);
                mpt__cuda_wgmma_fence();
                mpt__cuda_wgmma_stage<BN, BF16, TA, TB>(d, a + half * 8192, b);
                mpt__cuda_wgmma_commit();
                /* At most this stage's group pending: the previous stage
                   has been read, its buffer goes back to the producer. */
                mpt__cuda_wgmma_wait<1>();
                if (t > 0 && lane == 0) mpt__cuda_mbar_arrive(empty + 8 * ((use - 1) % T::STAGES));
            }
            mpt__cuda_wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < BN / 2; i++) mpt__cuda_wgmma_hold(d[i]);
            if (lane == 0) mpt__cuda_mbar_arrive(empty + 8 * ((use - 1) % T::STAGES));

            /* The epilogue, through this warp's staging block. */
            mpt__cuda_gemm_finish_staged<1, BN / 8>(
                p, at.slice, stage + (4 * half + warp) * MPT__CUDA_EPI_WARP_FLOATS,
                [&](int, int j, int e) { return d[4 * j + e]; },
                at.tile_m * T::BM + half * 64 + warp * 16, at.tile_n * BN, lane);
        }
    }
#else
    (void)map_a, (void)map_b, (void)p, (void)tiles_m, (void)tiles_n, (void)work;
#endif
}

/* What one launch of the Hopper kernel needs (host side). */
typedef struct mpt__cuda_wgmma_launch {
    const CUtensorMap *map_a, *map_b;
    mpt__cuda_gemm_args p;
    int64_t tiles_m, tiles_n, work;
    unsigned grid;
    cudaStream_t stream;
} mpt__cuda_wgmma_launch;

/* Launches one instantiation, or (prepare) raises its shared-memory
   limit to the ring's size. */
template <int BN, bool BF16, bool TA, bool TB>
static cudaError_t mpt__cuda_wgmma_go(const mpt__cuda_wgmma_launch *l, int prepare) {
    typedef mpt__cuda_wgmma_tile<BN> T;
    if (prepare)
        return cudaFuncSetAttribute(mpt__cuda_wgmma_kernel<BN, BF16, TA, TB>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, T::SMEM);
    mpt__cuda_wgmma_kernel<BN, BF16, TA, TB><<<l->grid, T::THREADS, T::SMEM, l->stream>>>(
        *l->map_a, *l->map_b, l->p, l->tiles_m, l->tiles_n, l->work);
    return cudaSuccess;
}

template <int BN, bool BF16>
static cudaError_t mpt__cuda_wgmma_trans(int ta, int tb, const mpt__cuda_wgmma_launch *l,
                                         int prepare) {
    if (ta) {
        if (tb) return mpt__cuda_wgmma_go<BN, BF16, true, true>(l, prepare);
        return mpt__cuda_wgmma_go<BN, BF16, true, false>(l, prepare);
    }
    if (tb) return mpt__cuda_wgmma_go<BN, BF16, false, true>(l, prepare);
    return mpt__cuda_wgmma_go<BN, BF16, false, false>(l, prepare);
}

static cudaError_t mpt__cuda_wgmma_dispatch(int bn, int bf16, int ta, int tb,
                                            const mpt__cuda_wgmma_launch *l, int prepare) {
    if (bn == 256)
        return bf16 ? mpt__cuda_wgmma_trans<256, true>(ta, tb, l, prepare)
                    : mpt__cuda_wgmma_trans<256, false>(ta, tb, l, prepare);
    return bf16 ? mpt__cuda_wgmma_trans<128, true>(ta, tb, l, prepare)
                : mpt__cuda_wgmma_trans<128, false>(ta, tb, l, prepare);
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-cache  The per-shape cache: chosen engine and cuBLASLt plan
   ----------------------------------------------------------------------------- */

/* Everything that changes the chosen algorithm. All fields are 8 or 4 bytes
   with no padding, so keys hash and compare as bytes. */
typedef struct mpt__cuda_gemm_key {
    int64_t m, n, k, lda, ldb, ldc;
    int32_t trans_a, trans_b, ab_dtype, c_dtype;
    int32_t act, has_bias, beta_nonzero;
    int32_t align; /* log2 of the alignment of a, b, c, bias (≤ 256 B), a byte each */
} mpt__cuda_gemm_key;

/* A cuBLASLt plan: descriptors, layouts, and the heuristic's algorithm. */
typedef struct mpt__cuda_gemm_lt {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc; /* Lt's A (our B), Lt's B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
    int post_act; /* our kernel applies the activation after (see mpt__cuda_gemm_lt_can) */
} mpt__cuda_gemm_lt;

typedef struct mpt__cuda_gemm_entry {
    int used;
    int lt_state;  /* 0: not built; 1: ready; -1: cuBLASLt cannot (or failed) */
    int timed;     /* AUTO: engine was measured on this shape            */
    int engine;    /* MPT_GEMM_MPT, _CUBLASLT or _WGMMA, when timed        */
    mpt__cuda_gemm_key key;
    mpt__cuda_gemm_lt lt;
    /* The Hopper kernel's tensor maps for A and B (CUtensorMap, 128 bytes
       each, kept as words: entries are calloc'ed, not 64-byte aligned),
       encoded for the pointers beside them and re-encoded when a call
       brings others (host work, a few microseconds). */
    int wgmma_state; /* 0: not encoded; 1: ready; -1: the driver refused */
    const void *wgmma_a, *wgmma_b;
    uint64_t wgmma_map_a[16], wgmma_map_b[16];
} mpt__cuda_gemm_entry;

/* The column sums' scratch: 1 MiB of float partial sums (see "Column sums"). */
#define MPT__CUDA_COLSUM_PARTIALS ((int64_t)1 << 18)
/* Split-K's partial sums: 8 MiB of floats. The products split are those
   with few tiles (under half the SMs' worth, so M·N < 66·128² ≈ 2^20 at
   most), and mpt__gemm_split_k gives fewer slices where they would not
   fit; a fixed size, so that the slices depend on the shape alone. */
#define MPT__CUDA_SPLIT_PARTIALS ((int64_t)1 << 21)

struct mpt__gemm_cache {
    mpt__cuda_gemm_entry *entries; /* open addressing, linear probing     */
    int64_t capacity, count;       /* capacity: a power of two            */
    int tensor_cores;              /* sm_80+: the mma.sync kernel runs    */
    int big_tiles;                 /* the 80 KiB configuration fits       */
    int forced_tile;               /* $MPT_CUDA_GEMM_TILE: 64, 128; 0: choose */
    float *colsum_partials;        /* column sums' per-chunk partial sums */
    int64_t colsum_partials_count; /* its size in floats                  */
    float *split_partials;         /* split-K's slices' sums (float32)    */
    int64_t split_partials_count;  /* its size in floats                  */
    char *choices_path;            /* $MPT_GEMM_CHOICES (malloc'ed) or NULL */
    int gpu;                       /* compute capability, 10·major + minor */
    int wgmma;                     /* the Hopper kernel runs here (sm_90a image, 9.0) */
    int wgmma_in_auto;             /* $MPT_GEMM_AUTO_WGMMA=1: AUTO may pick it */
    PFN_cuTensorMapEncodeTiled_v12000 encode_tiled; /* the driver's, when wgmma */
};

static int mpt__cuda_gemm_log2_align(const void *ptr) {
    uintptr_t x = (uintptr_t)ptr;
    int l = 0;
    while (l < 8 && !(x & ((uintptr_t)1 << l))) l++;
    return l; /* NULL (no bias) counts as 256-byte aligned */
}

static mpt__cuda_gemm_key mpt__cuda_gemm_make_key(const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    mpt__cuda_gemm_key k;
    memset(&k, 0, sizeof k);
    k.m = d->m, k.n = d->n, k.k = d->k;
    k.lda = d->lda, k.ldb = d->ldb, k.ldc = d->ldc;
    k.trans_a = d->trans_a != 0, k.trans_b = d->trans_b != 0;
    k.ab_dtype = d->ab_dtype ? (int32_t)d->ab_dtype : (int32_t)MPT_FLOAT32;
    k.c_dtype = (int32_t)c_dtype;
    k.act = (int32_t)d->activation;
    k.has_bias = d->bias != NULL;
    k.beta_nonzero = d->beta != 0.0f;
    k.align = mpt__cuda_gemm_log2_align(d->a) | mpt__cuda_gemm_log2_align(d->b) << 8 |
              mpt__cuda_gemm_log2_align(d->c) << 16 | mpt__cuda_gemm_log2_align(d->bias) << 24;
    return k;
}

static uint64_t mpt__cuda_gemm_hash(const mpt__cuda_gemm_key *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static mpt__cuda_gemm_entry *mpt__cuda_gemm_find(struct mpt__gemm_cache *cache,
                                                 const mpt__cuda_gemm_key *k) {
    const uint64_t mask = (uint64_t)cache->capacity - 1;
    for (uint64_t i = mpt__cuda_gemm_hash(k) & mask;; i = (i + 1) & mask) {
        mpt__cuda_gemm_entry *e = &cache->entries[i];
        if (!e->used) return NULL;
        if (!memcmp(&e->key, k, sizeof *k)) return e;
    }
}

/* The slot for k, which must not be in the table (the table never fills:
   it doubles at half load). */
static mpt__cuda_gemm_entry *mpt__cuda_gemm_slot(mpt__cuda_gemm_entry *entries, int64_t capacity,
                                                 const mpt__cuda_gemm_key *k) {
    const uint64_t mask = (uint64_t)capacity - 1;
    uint64_t i = mpt__cuda_gemm_hash(k) & mask;
    while (entries[i].used) i = (i + 1) & mask;
    return &entries[i];
}

/* Adds a fresh entry for k (not present); NULL when out of host memory.
   Earlier entry pointers are invalid afterwards. */
static mpt__cuda_gemm_entry *mpt__cuda_gemm_insert(struct mpt__gemm_cache *cache,
                                                   const mpt__cuda_gemm_key *k) {
    mpt__cuda_gemm_entry *e;
    if ((cache->count + 1) * 2 > cache->capacity) {
        const int64_t capacity = cache->capacity * 2;
        mpt__cuda_gemm_entry *grown =
            (mpt__cuda_gemm_entry *)calloc((size_t)capacity, sizeof *grown);
        if (!grown) return NULL;
        for (int64_t i = 0; i < cache->capacity; i++)
            if (cache->entries[i].used)
                *mpt__cuda_gemm_slot(grown, capacity, &cache->entries[i].key) = cache->entries[i];
        free(cache->entries);
        cache->entries = grown;
        cache->capacity = capacity;
    }
    e = mpt__cuda_gemm_slot(cache->entries, cache->capacity, k);
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->key = *k;
    cache->count++;
    return e;
}

/* -----------------------------------------------------------------------------
   @cuda-cublaslt  cuBLASLt
   ----------------------------------------------------------------------------- */

static cudaDataType_t mpt__cuda_gemm_lt_type(mpt_dtype t) {
    return t == MPT_FLOAT16 ? CUDA_R_16F : t == MPT_BFLOAT16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* Whether cuBLASLt can give exactly our result: its GELU is the tanh
   approximation and it has no sigmoid or tanh, so those run as a second
   pass over C, which must then be float32 to round only once. Its ReLU is
   max(x, 0), which need not keep NaN, so ReLU too runs as a second pass;
   ReLU commutes with rounding, so that pass may read a 16-bit C. */
static int mpt__cuda_gemm_lt_can(const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    return c_dtype == MPT_FLOAT32 || d->activation == MPT_ACT_NONE ||
           d->activation == MPT_ACT_RELU;
}

static void mpt__cuda_gemm_lt_free(mpt__cuda_gemm_lt *lt) {
    if (lt->op) cublasLtMatmulDescDestroy(lt->op);
    if (lt->la) cublasLtMatrixLayoutDestroy(lt->la);
    if (lt->lb) cublasLtMatrixLayoutDestroy(lt->lb);
    if (lt->lc) cublasLtMatrixLayoutDestroy(lt->lc);
    memset(lt, 0, sizeof *lt);
}

/* Builds lt for d's shape.

   cuBLASLt is column-major; our matrices are row-major. A row-major X
   (r×c, leading dimension ld) is the same memory as a column-major X^T
   (c×r, same ld). So our C = op(A)·op(B) (M×N) is, read column-major,
   C^T = op(B)^T · op(A)^T (N×M): cuBLASLt's "A" is our B, its "B" our A,
   its m = N, n = M, k = K, and it needs no transposition of C.
   - Our B untransposed is stored K×N row-major = N×K column-major, which
     already is op(B)^T: Lt's A, op N, layout N×K (ld ldb). Transposed
     (stored N×K) it is K×N column-major: op T, layout K×N.
   - Our A untransposed is stored M×K = K×M column-major = op(A)^T: Lt's
     B, op N, layout K×M (ld lda). Transposed: op T, layout M×K.
   - D = C: N×M column-major, ld ldc. Lt's bias has one value per row of
     D, i.e. per column of our C: exactly our per-column bias. */
static mpt_status mpt__cuda_gemm_lt_build(mpt__cuda *c, mpt__cuda_gemm_lt *lt,
                                          const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    const mpt_dtype ab = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    const cudaDataType_t ab_type = mpt__cuda_gemm_lt_type(ab);
    const cudaDataType_t c_type = mpt__cuda_gemm_lt_type(c_dtype);
    const cublasOperation_t op_b = d->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = d->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint64_t m = (uint64_t)d->m, n = (uint64_t)d->n, k = (uint64_t)d->k;
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t found;
    int count = 0;
    mpt_status st = MPT_OK;
    memset(lt, 0, sizeof *lt);
    memset(&found, 0, sizeof found);
    if (d->bias) epi = CUBLASLT_EPILOGUE_BIAS;
    lt->post_act = d->activation != MPT_ACT_NONE;
    do {
        const cublasLtPointerMode_t host = CUBLASLT_POINTER_MODE_HOST;
        const uint64_t workspace = c->lt_workspace_bytes;
        const cudaDataType_t bias_type = CUDA_R_32F; /* our bias is float32 for every C */
        const uint32_t align_a = 1u << mpt__cuda_gemm_log2_align(d->b); /* Lt's A is our B */
        const uint32_t align_b = 1u << mpt__cuda_gemm_log2_align(d->a);
        const uint32_t align_c = 1u << mpt__cuda_gemm_log2_align(d->c);
#define MPT__LT_TRY(call)                                                                   \
    {                                                                                       \
        cublasStatus_t e_ = (call);                                                         \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                                  \
            st = mpt__cuda_fail(c, e_ == CUBLAS_STATUS_ALLOC_FAILED ? MPT_ERR_OUT_OF_MEMORY \
                                                                    : MPT_ERR_UNSUPPORTED,  \
                                __FILE__, __LINE__, "%s: %s (%d)", #call,                   \
                                cublasGetStatusString(e_), (int)e_);                        \
            break;                                                                          \
        }                                                                                   \
    }
        /* float32 is true float32 unless the user opted in to TF32 (its
           operands rounded to 10 mantissa bits, as PyTorch's allow_tf32) */
        MPT__LT_TRY(cublasLtMatmulDescCreate(
            &lt->op, ab == MPT_FLOAT32 && c->allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                          : CUBLAS_COMPUTE_32F,
            CUDA_R_32F));
        MPT__LT_TRY(cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                                   &host, sizeof host));
        MPT__LT_TRY(cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b,
                                                   sizeof op_b));
        MPT__LT_TRY(cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a,
                                                   sizeof op_a));
        MPT__LT_TRY(cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                   sizeof epi));
        if (d->bias) {
            /* The heuristic reads the pointer's alignment (part of the key). */
            MPT__LT_TRY(cublasLtMatmulDescSetAttribute(
                lt->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
            MPT__LT_TRY(cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &d->bias, sizeof d->bias));
        }
        MPT__LT_TRY(cublasLtMatrixLayoutCreate(&lt->la, ab_type, d->trans_b ? k : n,
                                               d->trans_b ? n : k, d->ldb));
        MPT__LT_TRY(cublasLtMatrixLayoutCreate(&lt->lb, ab_type, d->trans_a ? m : k,
                                               d->trans_a ? k : m, d->lda));
        MPT__LT_TRY(cublasLtMatrixLayoutCreate(&lt->lc, c_type, n, m, d->ldc));
        MPT__LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
        MPT__LT_TRY(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
        /* The default assumes 256-byte aligned matrices; ours may be views. */
        MPT__LT_TRY(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a));
        MPT__LT_TRY(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b));
        MPT__LT_TRY(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
        MPT__LT_TRY(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));
        MPT__LT_TRY(cublasLtMatmulAlgoGetHeuristic(c->lt, lt->op, lt->la, lt->lb, lt->lc, lt->lc,
                                                   pref, 1, &found, &count));
#undef MPT__LT_TRY
        if (count < 1 || found.state != CUBLAS_STATUS_SUCCESS)
            st = mpt__cuda_fail(c, MPT_ERR_UNSUPPORTED, __FILE__, __LINE__,
                                "cuBLASLt has no algorithm for gemm m=%lld n=%lld k=%lld",
                                (long long)d->m, (long long)d->n, (long long)d->k);
    } while (0);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (st != MPT_OK) mpt__cuda_gemm_lt_free(lt);
    else lt->algo = found.algo;
    return st;
}

/* cuBLASLt refused the entry's shape (its plan, or a run: a float32 bias
   with a 16-bit C, say). Not an error, the hand-written engine runs the
   shape from now on, but not silent either: counted (mpt_cuda_lt_refusals)
   and said once per shape, the entry staying refused. A warning when
   cuBLASLt was asked for (MPT_GEMM_CUBLASLT), else information (the
   engine was the backend's choice). */
static void mpt__cuda_gemm_lt_refused(mpt__cuda *c, mpt__cuda_gemm_entry *e, const char *why) {
    const mpt__cuda_gemm_key *k = &e->key;
    char message[1024];
    e->lt_state = -1;
    c->lt_refusals++;
    snprintf(message, sizeof message,
             "cuBLASLt refused gemm m=%lld n=%lld k=%lld (trans %d%d, %s operands, %s C%s, "
             "activation %d): %s; the hand-written engine runs this shape",
             (long long)k->m, (long long)k->n, (long long)k->k, (int)k->trans_a, (int)k->trans_b,
             mpt_dtype_name((mpt_dtype)k->ab_dtype), mpt_dtype_name((mpt_dtype)k->c_dtype),
             k->has_bias ? ", float32 bias" : "", (int)k->act, why);
    mpt__cuda_log(c, c->gemm_engine == MPT_GEMM_CUBLASLT ? MPT_LOG_WARNING : MPT_LOG_INFO, message);
}

/* Builds the entry's plan once; 1 if cuBLASLt can run it. */
static int mpt__cuda_gemm_lt_ready(mpt__cuda *c, mpt__cuda_gemm_entry *e, const mpt_gemm_desc *d,
                                   mpt_dtype c_dtype) {
    if (e->lt_state == 0) {
        /* Keep error() as it was: a shape cuBLASLt declines is not an error. */
        char saved[sizeof c->error];
        memcpy(saved, c->error, sizeof saved);
        if (mpt__cuda_gemm_lt_build(c, &e->lt, d, c_dtype) == MPT_OK) e->lt_state = 1;
        else mpt__cuda_gemm_lt_refused(c, e, c->error);
        memcpy(c->error, saved, sizeof saved);
    }
    return e->lt_state == 1;
}

/* Runs the plan into cptr (d->c or a scratch copy); 0 if cuBLASLt refused
   (nothing was queued; the caller runs the hand-written engine). */
static int mpt__cuda_gemm_lt_run(mpt__cuda *c, mpt__cuda_gemm_entry *e, const mpt_gemm_desc *d,
                                 void *cptr) {
    mpt__cuda_gemm_lt *lt = &e->lt;
    const float alpha = d->alpha == 0.0f ? 1.0f : d->alpha, beta = d->beta;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (d->bias)
        st = cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d->bias,
                                            sizeof d->bias);
    if (st != CUBLAS_STATUS_SUCCESS) {
        mpt__cuda_gemm_lt_refused(c, e, cublasGetStatusString(st));
        return 0;
    }
    st = cublasLtMatmul(c->lt, lt->op, &alpha, d->b, lt->la, d->a, lt->lb, &beta, cptr, lt->lc,
                        cptr, lt->lc, &lt->algo, c->lt_workspace, c->lt_workspace_bytes,
                        c->stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
        mpt__cuda_gemm_lt_refused(c, e, cublasGetStatusString(st));
        return 0;
    }
    c->gemm_runs[MPT_GEMM_CUBLASLT]++;
    if (lt->post_act) {
        mpt__cuda_gemm_args p;
        memset(&p, 0, sizeof p);
        p.c = cptr, p.m = d->m, p.n = d->n, p.ldc = d->ldc;
        p.act = (int)d->activation;
        p.c_dtype = e->key.c_dtype;
        mpt__cuda_gemm_activate_kernel<<<mpt__cuda_blocks(d->m * d->n, 256), 256, 0,
                                         c->stream>>>(p);
        mpt__cuda_launched(c, "mpt__cuda_gemm_activate_kernel");
    }
    return 1;
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-engine  The hand-written engine
   ----------------------------------------------------------------------------- */

static mpt__cuda_gemm_args mpt__cuda_gemm_make_args(const mpt_gemm_desc *d, mpt_dtype c_dtype,
                                                    void *cptr) {
    mpt__cuda_gemm_args p;
    const uintptr_t pair_bytes = c_dtype == MPT_FLOAT32 ? 8 : 4;
    memset(&p, 0, sizeof p);
    p.a = d->a, p.b = d->b, p.c = cptr, p.bias = d->bias;
    p.m = d->m, p.n = d->n, p.k = d->k;
    p.lda = d->lda, p.ldb = d->ldb, p.ldc = d->ldc;
    p.alpha = d->alpha == 0.0f ? 1.0f : d->alpha;
    p.beta = d->beta;
    p.act = (int)d->activation;
    p.c_dtype = (int)c_dtype;
    p.c_pairs = (uintptr_t)cptr % pair_bytes == 0 && d->ldc % 2 == 0;
    p.partials = NULL;
    p.depth = d->k > 0 ? d->k : 1;
    return p;
}

/* The hand-written engine into cptr: the tensor-core kernel for 16-bit
   operands (from sm_80), else the FP32-arithmetic one; tile and K split
   by the rules in mpt.h (@backend-shared), a function of the shape and
   the SM count, so a shape always takes the same path. */
static void mpt__cuda_gemm_run_mpt(mpt__cuda *c, const mpt_gemm_desc *d, mpt_dtype c_dtype,
                                   void *cptr) {
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    mpt__cuda_gemm_args p = mpt__cuda_gemm_make_args(d, c_dtype, cptr);
    const mpt_dtype ab = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    const int tensor_cores = ab != MPT_FLOAT32 && cache->tensor_cores;
    /* cp.async copies 16 bytes: every row start of A and B must be 16-byte
       aligned, i.e. the pointers and the leading dimensions (×2 bytes). */
    const int aligned = (uintptr_t)d->a % 16 == 0 && (uintptr_t)d->b % 16 == 0 &&
                        d->lda % 8 == 0 && d->ldb % 8 == 0;
    const int tile = tensor_cores ? mpt__gemm_tile(d->m, d->n, c->sm_count,
                                                   aligned && cache->big_tiles, cache->forced_tile)
                                  : 64; /* the FP32 kernel's */
    const mpt__gemm_split split = mpt__gemm_split_k(d->m, d->n, d->k, tile, c->sm_count,
                                                    cache->split_partials_count);
    c->gemm_runs[MPT_GEMM_MPT]++;
    if (split.splits > 1) {
        p.partials = cache->split_partials;
        p.depth = split.depth;
    }
    if (tensor_cores) {
        const int variant = tile == 128 ? MPT__CUDA_GEMM_BIG
                            : aligned   ? MPT__CUDA_GEMM_SMALL
                                        : MPT__CUDA_GEMM_SMALL_GUARDED;
        mpt__cuda_gemm_tc_dispatch(variant, ab == MPT_BFLOAT16, d->trans_a != 0, d->trans_b != 0,
                                   &p, c->stream, 0);
        mpt__cuda_launched(c, "mpt__cuda_gemm_tc_kernel");
    } else {
        const dim3 grid((unsigned)(((d->m + 63) / 64) * ((d->n + 63) / 64)),
                        (unsigned)split.splits);
        const int ta = d->trans_a != 0, tb = d->trans_b != 0;
        if (ab == MPT_FLOAT16)
            mpt__cuda_gemm_simt_kernel<__half><<<grid, 256, 0, c->stream>>>(p, ta, tb);
        else if (ab == MPT_BFLOAT16)
            mpt__cuda_gemm_simt_kernel<__nv_bfloat16><<<grid, 256, 0, c->stream>>>(p, ta, tb);
        else mpt__cuda_gemm_simt_kernel<float><<<grid, 256, 0, c->stream>>>(p, ta, tb);
        mpt__cuda_launched(c, "mpt__cuda_gemm_simt_kernel");
    }
    if (split.splits > 1) {
        mpt__cuda_gemm_split_sum_kernel<<<mpt__cuda_blocks(d->m * d->n, 256), 256, 0,
                                          c->stream>>>(p, split.splits);
        mpt__cuda_launched(c, "mpt__cuda_gemm_split_sum_kernel");
    }
}

/* -----------------------------------------------------------------------------
   @cuda-wgmma-launch  The Hopper engine: tensor maps and launch
   ----------------------------------------------------------------------------- */

/* Whether d can take the Hopper kernel here (mpt__wgmma_eligible). */
static int mpt__cuda_wgmma_can(const mpt__cuda *c, const mpt_gemm_desc *d) {
    const mpt_dtype ab = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    return mpt__wgmma_eligible(d->m, d->n, d->k, d->lda, d->ldb, (uintptr_t)d->a,
                               (uintptr_t)d->b, ab, c->gemm_cache->wgmma);
}

/* One operand's tensor map into words; 0 if the driver refused it. */
static int mpt__cuda_wgmma_encode(const struct mpt__gemm_cache *cache, const void *ptr,
                                  const mpt__wgmma_map *m, int bf16, uint64_t words[16]) {
    CUtensorMap map; /* 64-byte aligned by its type */
    const cuuint64_t dims[2] = {m->dims[0], m->dims[1]};
    const cuuint64_t strides[1] = {m->row_bytes};
    const cuuint32_t box[2] = {m->box[0], m->box[1]};
    const cuuint32_t steps[2] = {1, 1};
    static_assert(sizeof map == 16 * sizeof(uint64_t), "a CUtensorMap is 128 bytes");
    memset(&map, 0, sizeof map);
    const CUtensorMapDataType type =
        bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    if (cache->encode_tiled(&map, type, 2, (void *)ptr, dims, strides, box, steps,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return 0;
    memcpy(words, &map, sizeof map);
    return 1;
}

/* The entry's tensor maps for d's pointers (encoded when new); 1 if the
   Hopper kernel can run d. A refusal is logged once and the shape stays
   on the mma.sync kernel. */
static int mpt__cuda_wgmma_ready_for(mpt__cuda *c, mpt__cuda_gemm_entry *e,
                                     const mpt_gemm_desc *d) {
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    if (e->wgmma_state < 0) return 0;
    if (e->wgmma_state == 0 || e->wgmma_a != d->a || e->wgmma_b != d->b) {
        const int bn = mpt__wgmma_tile_n(d->m, d->n, c->sm_count);
        const int bf16 = d->ab_dtype == MPT_BFLOAT16;
        /* A stored M×K (K contiguous) or K×M; B stored K×N or N×K (K contiguous). */
        const int bm = MPT__WGMMA_BM;
        const mpt__wgmma_map ma = d->trans_a ? mpt__wgmma_operand_map(d->k, d->m, d->lda, 0, bm)
                                             : mpt__wgmma_operand_map(d->m, d->k, d->lda, 1, bm);
        const mpt__wgmma_map mb = d->trans_b ? mpt__wgmma_operand_map(d->n, d->k, d->ldb, 1, bn)
                                             : mpt__wgmma_operand_map(d->k, d->n, d->ldb, 0, bn);
        if (!mpt__cuda_wgmma_encode(cache, d->a, &ma, bf16, e->wgmma_map_a) ||
            !mpt__cuda_wgmma_encode(cache, d->b, &mb, bf16, e->wgmma_map_b)) {
            char message[256];
            e->wgmma_state = -1;
            snprintf(message, sizeof message,
                     "cuTensorMapEncodeTiled refused gemm m=%lld n=%lld k=%lld lda=%lld "
                     "ldb=%lld (trans %d%d); the mma.sync kernel runs this shape",
                     (long long)d->m, (long long)d->n, (long long)d->k, (long long)d->lda,
                     (long long)d->ldb, d->trans_a != 0, d->trans_b != 0);
            mpt__cuda_log(c, MPT_LOG_WARNING, message);
            return 0;
        }
        e->wgmma_a = d->a;
        e->wgmma_b = d->b;
        e->wgmma_state = 1;
    }
    return 1;
}

/* The Hopper kernel into cptr (d->c or a scratch copy), with the entry's
   maps (mpt__cuda_wgmma_ready_for returned 1); its K split, if any, is
   added by the same second pass as the mma.sync kernel's. */
static void mpt__cuda_gemm_run_wgmma(mpt__cuda *c, const mpt__cuda_gemm_entry *e,
                                     const mpt_gemm_desc *d, mpt_dtype c_dtype, void *cptr) {
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    const int bn = mpt__wgmma_tile_n(d->m, d->n, c->sm_count);
    const mpt__gemm_split split =
        mpt__wgmma_split_k(d->m, d->n, d->k, bn, c->sm_count, cache->split_partials_count);
    CUtensorMap map_a, map_b;
    mpt__cuda_wgmma_launch l;
    memcpy(&map_a, e->wgmma_map_a, sizeof map_a);
    memcpy(&map_b, e->wgmma_map_b, sizeof map_b);
    l.map_a = &map_a;
    l.map_b = &map_b;
    l.p = mpt__cuda_gemm_make_args(d, c_dtype, cptr);
    if (split.splits > 1) {
        l.p.partials = cache->split_partials;
        l.p.depth = split.depth;
    }
    l.tiles_m = (d->m + MPT__WGMMA_BM - 1) / MPT__WGMMA_BM;
    l.tiles_n = (d->n + bn - 1) / bn;
    l.work = l.tiles_m * l.tiles_n * split.splits;
    l.grid = (unsigned)mpt__wgmma_grid(l.work, c->sm_count);
    l.stream = c->stream;
    c->gemm_runs[MPT_GEMM_WGMMA]++;
    mpt__cuda_wgmma_dispatch(bn, d->ab_dtype == MPT_BFLOAT16, d->trans_a != 0, d->trans_b != 0,
                             &l, 0);
    mpt__cuda_launched(c, "mpt__cuda_wgmma_kernel");
    if (split.splits > 1) {
        mpt__cuda_gemm_split_sum_kernel<<<mpt__cuda_blocks(d->m * d->n, 256), 256, 0,
                                          c->stream>>>(l.p, split.splits);
        mpt__cuda_launched(c, "mpt__cuda_gemm_split_sum_kernel");
    }
}

/* Learns whether the Hopper kernel runs on this device: compute
   capability 9.0, an sm_90a image loaded (mpt__cuda_wgmma_built), the
   driver's cuTensorMapEncodeTiled (through the runtime: no -lcuda), and
   the ring's shared memory granted to every instance. Anything missing
   leaves cache->wgmma 0: the mma.sync kernel runs. */
static void mpt__cuda_wgmma_setup(struct mpt__gemm_cache *cache) {
    int built = 0;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    void *fn = NULL;
    cache->wgmma = 0;
    if (cache->gpu != 90) return;
    if (cudaMemcpyFromSymbol(&built, mpt__cuda_wgmma_built, sizeof built) != cudaSuccess ||
        !built) {
        (void)cudaGetLastError();
        return;
    }
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess || !fn) {
        (void)cudaGetLastError();
        return;
    }
    cache->encode_tiled = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    for (int combo = 0; combo < 16; combo++)
        if (mpt__cuda_wgmma_dispatch(combo & 8 ? 256 : 128, combo & 1, (combo >> 1) & 1,
                                     (combo >> 2) & 1, NULL, 1) != cudaSuccess) {
            (void)cudaGetLastError();
            return;
        }
    cache->wgmma = 1;
}

/* -----------------------------------------------------------------------------
   @cuda-gemm-choice  Engine choice and the table functions
   ----------------------------------------------------------------------------- */

/* C's dtype as stored: float16/bfloat16 when asked, else float32. */
static mpt_dtype mpt__cuda_gemm_c_dtype(mpt_dtype c_dtype) {
    return c_dtype == MPT_FLOAT16 || c_dtype == MPT_BFLOAT16 ? c_dtype : MPT_FLOAT32;
}

/* What repeats bit for bit: the hand-written engine's results depend on
   the shape and the SM count alone (tile and K split by mpt__gemm_tile and
   mpt__gemm_split_k, sums in a fixed order, no atomics), and cuBLASLt's,
   by NVIDIA's design, on the toolkit version, the architecture and the SM
   count (one stream, our own workspace). So a shape's bits repeat once its
   engine is settled: always with MPT_GEMM=mpt or cublaslt; under AUTO the
   engine is measured in each new context and kept as below, a margin
   making a flip between runs unlikely but not impossible, unless
   $MPT_GEMM_CHOICES carries the first run's choices to the next ones. */

/* The engine a shape runs untimed, and that timing must beat by a margin
   (mpt__gemm_engine_choose): the hand-written kernel for 16-bit operands,
   cuBLASLt for float32. */
static mpt_gemm_engine mpt__cuda_gemm_usual(int32_t ab_dtype) {
    return ab_dtype == MPT_FLOAT32 ? MPT_GEMM_CUBLASLT : MPT_GEMM_MPT;
}

/* The engine for d: forced, measured by gemm_plan, or (never planned) the
   usual one (mpt__cuda_gemm_usual), as far as it can run d: cuBLASLt
   with a ready plan, the Hopper kernel with ready tensor maps, else the
   mma.sync kernel. *entry: the cache entry (plan and maps), NULL for the
   mma.sync kernel. Never measures; may build a plan or maps (host work
   only). */
static mpt_gemm_engine mpt__cuda_gemm_pick(mpt__cuda *c, const mpt_gemm_desc *d,
                                           mpt_dtype c_dtype, mpt__cuda_gemm_entry **entry) {
    const mpt__cuda_gemm_key key = mpt__cuda_gemm_make_key(d, c_dtype);
    mpt__cuda_gemm_entry *e = mpt__cuda_gemm_find(c->gemm_cache, &key);
    mpt_gemm_engine engine = c->gemm_engine;
    *entry = NULL;
    if (engine == MPT_GEMM_AUTO) {
        if (e && e->timed) engine = (mpt_gemm_engine)e->engine;
        else engine = mpt__cuda_gemm_usual(key.ab_dtype);
    }
    if (engine == MPT_GEMM_CUBLASLT && !mpt__cuda_gemm_lt_can(d, c_dtype)) return MPT_GEMM_MPT;
    if (engine == MPT_GEMM_WGMMA && !mpt__cuda_wgmma_can(c, d)) return MPT_GEMM_MPT;
    if (engine == MPT_GEMM_MPT) return MPT_GEMM_MPT;
    if (!e && !(e = mpt__cuda_gemm_insert(c->gemm_cache, &key))) return MPT_GEMM_MPT;
    *entry = e;
    if (engine == MPT_GEMM_CUBLASLT)
        return mpt__cuda_gemm_lt_ready(c, e, d, c_dtype) ? MPT_GEMM_CUBLASLT : MPT_GEMM_MPT;
    return mpt__cuda_wgmma_ready_for(c, e, d) ? MPT_GEMM_WGMMA : MPT_GEMM_MPT;
}

static void mpt__cuda_gemm_scale_c(mpt__cuda *c, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    const mpt__cuda_gemm_args p = mpt__cuda_gemm_make_args(d, c_dtype, d->c);
    mpt__cuda_gemm_scale_c_kernel<<<mpt__cuda_blocks(d->m * d->n, 256), 256, 0, c->stream>>>(p);
    mpt__cuda_launched(c, "mpt__cuda_gemm_scale_c_kernel");
}

static void mpt__cuda_gemm(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_gemm_entry *e;
    if (d->m <= 0 || d->n <= 0) return;
    c_dtype = mpt__cuda_gemm_c_dtype(c_dtype);
    if (d->k <= 0 || d->alpha_is_zero) {
        mpt__cuda_gemm_scale_c(c, d, c_dtype);
        return;
    }
    switch (mpt__cuda_gemm_pick(c, d, c_dtype, &e)) {
    case MPT_GEMM_CUBLASLT:
        if (mpt__cuda_gemm_lt_run(c, e, d, d->c)) return;
        break; /* refused: the hand-written engine */
    case MPT_GEMM_WGMMA: mpt__cuda_gemm_run_wgmma(c, e, d, c_dtype, d->c); return;
    default: break;
    }
    mpt__cuda_gemm_run_mpt(c, d, c_dtype, d->c);
}

/* Milliseconds per run of one engine into d->c (a scratch C), after warm-up
   runs; *refused when cuBLASLt declined. The Hopper kernel needs the
   entry's maps ready (mpt__cuda_wgmma_ready_for). */
static mpt_status mpt__cuda_gemm_time(mpt__cuda *c, const mpt_gemm_desc *d, mpt_dtype c_dtype,
                                      mpt__cuda_gemm_entry *e, mpt_gemm_engine engine,
                                      cudaEvent_t start, cudaEvent_t stop, float *ms,
                                      int *refused) {
    enum { WARM = 2, RUNS = 5 };
    *refused = 0;
    for (int i = 0; i < WARM + RUNS; i++) {
        if (i == WARM) MPT__CU(c, cudaEventRecord(start, c->stream));
        if (engine == MPT_GEMM_MPT) mpt__cuda_gemm_run_mpt(c, d, c_dtype, d->c);
        else if (engine == MPT_GEMM_WGMMA) mpt__cuda_gemm_run_wgmma(c, e, d, c_dtype, d->c);
        else if (!mpt__cuda_gemm_lt_run(c, e, d, d->c)) {
            *refused = 1;
            return MPT_OK;
        }
    }
    MPT__CU(c, cudaEventRecord(stop, c->stream));
    MPT__CU(c, cudaEventSynchronize(stop));
    if (c->pending != cudaSuccess)
        return mpt__cuda_fail(c, MPT_ERR_UNSUPPORTED, __FILE__, __LINE__, "%s failed: %s",
                              c->pending_what, cudaGetErrorString(c->pending));
    MPT__CU(c, cudaEventElapsedTime(ms, start, stop));
    *ms /= RUNS;
    return MPT_OK;
}

/* AUTO's choices carried from run to run. AUTO measures each shape again
   in every new context, and a shape whose engines are close may go the
   other way in another run (see mpt__gemm_engine_choose). With
   $MPT_GEMM_CHOICES naming a text file, a context reads the file's lines
   for its GPU model (compute capability and SM count) when it starts and
   appends one line for each shape it measures: a program's later runs
   take its first run's engines, hence its bits. A line that does not
   parse (a run killed while writing it) is skipped; a file that cannot be
   read or written leaves AUTO measuring, as without it. */
#define MPT__CUDA_CHOICE_FORMAT                                                           \
    "gemm sm_%lld sms %lld m %lld n %lld k %lld lda %lld ldb %lld ldc %lld ta %lld tb %lld " \
    "ab %lld c %lld act %lld bias %lld beta %lld align %lld engine %lld"

static void mpt__cuda_gemm_choices_load(mpt__cuda *c) {
    struct mpt__gemm_cache *cache = c->gemm_cache;
    char line[512];
    FILE *f = cache->choices_path ? fopen(cache->choices_path, "r") : NULL;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        long long v[17];
        mpt__cuda_gemm_key k;
        mpt__cuda_gemm_entry *e;
        if (sscanf(line, MPT__CUDA_CHOICE_FORMAT, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14], &v[15],
                   &v[16]) != 17 ||
            v[0] != cache->gpu || v[1] != c->sm_count ||
            (v[16] != MPT_GEMM_MPT && v[16] != MPT_GEMM_CUBLASLT && v[16] != MPT_GEMM_WGMMA))
            continue;
        memset(&k, 0, sizeof k);
        k.m = v[2], k.n = v[3], k.k = v[4], k.lda = v[5], k.ldb = v[6], k.ldc = v[7];
        k.trans_a = (int32_t)v[8], k.trans_b = (int32_t)v[9];
        k.ab_dtype = (int32_t)v[10], k.c_dtype = (int32_t)v[11], k.act = (int32_t)v[12];
        k.has_bias = (int32_t)v[13], k.beta_nonzero = (int32_t)v[14], k.align = (int32_t)v[15];
        e = mpt__cuda_gemm_find(cache, &k);
        if (!e && !(e = mpt__cuda_gemm_insert(cache, &k))) break; /* no host memory: measure */
        e->engine = (int)v[16];
        e->timed = 1;
    }
    fclose(f);
}

static void mpt__cuda_gemm_choice_save(const mpt__cuda *c, const mpt__cuda_gemm_entry *e) {
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    const mpt__cuda_gemm_key *k = &e->key;
    FILE *f = cache->choices_path ? fopen(cache->choices_path, "a") : NULL;
    if (!f) return;
    fprintf(f, MPT__CUDA_CHOICE_FORMAT "\n", (long long)cache->gpu, (long long)c->sm_count,
            (long long)k->m, (long long)k->n, (long long)k->k, (long long)k->lda,
            (long long)k->ldb, (long long)k->ldc, (long long)k->trans_a, (long long)k->trans_b,
            (long long)k->ab_dtype, (long long)k->c_dtype, (long long)k->act,
            (long long)k->has_bias, (long long)k->beta_nonzero, (long long)k->align,
            (long long)e->engine);
    fclose(f);
}

/* Measures the engines that can run d's shape (the hand-written one;
   cuBLASLt with a plan; the Hopper kernel with maps) and records in e
   the usual one unless another is clearly faster
   (mpt__gemm_engine_choose_among: a margin, so that near ties do not flip
   from run to run). The runs write a scratch copy of C (a copy, so that
   beta·C reads real values), never the caller's C. */
static mpt_status mpt__cuda_gemm_race(mpt__cuda *c, const mpt_gemm_desc *d, mpt_dtype c_dtype,
                                      mpt__cuda_gemm_entry *e) {
    const size_t c_bytes = (size_t)((d->m - 1) * d->ldc + d->n) * mpt_dtype_size(c_dtype);
    const mpt_gemm_engine usual = mpt__cuda_gemm_usual(e->key.ab_dtype);
    mpt_gemm_engine engines[3];
    double ms[3] = {-1, -1, -1};
    mpt_gemm_desc t = *d;
    cudaEvent_t start = NULL, stop = NULL;
    void *scratch = NULL;
    const int count = mpt__gemm_race_engines(usual, c->gemm_cache->wgmma_in_auto, engines);
    int refused = 0;
    mpt_status st = MPT_OK;
    if (cudaMalloc(&scratch, c_bytes) != cudaSuccess) {
        /* No room to measure: keep the hand-written engine, not an error. */
        (void)cudaGetLastError();
        e->engine = MPT_GEMM_MPT;
        e->timed = 1;
        return MPT_OK;
    }
    t.c = (float *)scratch;
    if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess)
        st = mpt__cuda_fail(c, MPT_ERR_UNSUPPORTED, __FILE__, __LINE__, "cudaEventCreate failed");
    else if (d->beta != 0.0f &&
             cudaMemcpyAsync(scratch, d->c, c_bytes, cudaMemcpyDeviceToDevice, c->stream) !=
                 cudaSuccess)
        st = mpt__cuda_fail(c, MPT_ERR_UNSUPPORTED, __FILE__, __LINE__, "cudaMemcpyAsync failed");
    for (int i = 0; i < count && st == MPT_OK; i++) {
        float one = 0;
        int declined = 0;
        ms[i] = -1; /* cannot run the shape, or refused it */
        if (engines[i] == MPT_GEMM_CUBLASLT && e->lt_state != 1) continue;
        if (engines[i] == MPT_GEMM_WGMMA &&
            !(mpt__cuda_wgmma_can(c, &t) && mpt__cuda_wgmma_ready_for(c, e, &t)))
            continue;
        st = mpt__cuda_gemm_time(c, &t, c_dtype, e, engines[i], start, stop, &one, &declined);
        if (declined) refused = 1;
        else ms[i] = one;
    }
    if (st == MPT_OK) {
        /* cuBLASLt usual (float32) but refused: the hand-written engine */
        if (refused && usual == MPT_GEMM_CUBLASLT) e->engine = MPT_GEMM_MPT;
        else e->engine = mpt__gemm_engine_choose_among(engines, ms, count);
        e->timed = 1;
        mpt__cuda_gemm_choice_save(c, e);
    }
    /* The scratch C may still be in use by a refused or failed run's queue. */
    cudaStreamSynchronize(c->stream);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    cudaFree(scratch);
    return st;
}

static mpt_status mpt__cuda_gemm_plan(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_gemm_key key;
    mpt__cuda_gemm_entry *e;
    int lt, wgmma;
    if (d->m <= 0 || d->n <= 0 || d->k <= 0 || d->alpha_is_zero) return MPT_OK; /* no product */
    c_dtype = mpt__cuda_gemm_c_dtype(c_dtype);
    if (c->gemm_engine == MPT_GEMM_MPT) return MPT_OK;
    lt = c->gemm_engine != MPT_GEMM_WGMMA && mpt__cuda_gemm_lt_can(d, c_dtype);
    /* AUTO times the Hopper kernel only when asked: it is correct (tested
       on an H200) but slower than cuBLASLt, so timing it costs a plan's
       warm-up for nothing. */
    wgmma = (c->gemm_engine == MPT_GEMM_WGMMA ||
             (c->gemm_engine == MPT_GEMM_AUTO && c->gemm_cache->wgmma_in_auto)) &&
            mpt__cuda_wgmma_can(c, d);
    if (!lt && !wgmma) return MPT_OK;
    key = mpt__cuda_gemm_make_key(d, c_dtype);
    e = mpt__cuda_gemm_find(c->gemm_cache, &key);
    if (!e && !(e = mpt__cuda_gemm_insert(c->gemm_cache, &key)))
        return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "gemm_plan: no host memory for the plan cache");
    if (lt) mpt__cuda_gemm_lt_ready(c, e, d, c_dtype);
    if (wgmma) wgmma = mpt__cuda_wgmma_ready_for(c, e, d);
    if (c->gemm_engine != MPT_GEMM_AUTO || e->timed || c->capturing) return MPT_OK;
    if (e->lt_state != 1 && !wgmma) {
        e->engine = MPT_GEMM_MPT;
        e->timed = 1;
        return MPT_OK;
    }
    return mpt__cuda_gemm_race(c, d, c_dtype, e);
}

static void mpt__cuda_gemm_destroy(mpt__cuda *c) {
    struct mpt__gemm_cache *cache = c->gemm_cache;
    if (cache) {
        for (int64_t i = 0; i < cache->capacity; i++)
            if (cache->entries[i].used) mpt__cuda_gemm_lt_free(&cache->entries[i].lt);
        if (cache->colsum_partials) cudaFree(cache->colsum_partials);
        if (cache->split_partials) cudaFree(cache->split_partials);
        free(cache->choices_path);
        free(cache->entries);
        free(cache);
        c->gemm_cache = NULL;
    }
    if (c->lt_workspace) cudaFree(c->lt_workspace);
    c->lt_workspace = NULL;
    c->lt_workspace_bytes = 0;
    if (c->lt) cublasLtDestroy(c->lt);
    c->lt = NULL;
}

/* Defined below, in @cuda-conv: Conv2D's instantiations of the kernel. */
static cudaError_t mpt__cuda_conv_dispatch(int big, int bf16, int conv,
                                           const mpt__cuda_conv_gemm_args *p, cudaStream_t stream,
                                           int prepare);

/* Raises the shared-memory limit of every tensor-core kernel (host setup,
   so that launches inside a graph capture need nothing more), Conv2D's
   too: they share the tiles' configurations, so they fail alike. */
static void mpt__cuda_gemm_prepare_kernels(struct mpt__gemm_cache *cache) {
    for (int variant = 0; variant < 3; variant++)
        for (int combo = 0; combo < 8; combo++) {
            cudaError_t e = mpt__cuda_gemm_tc_dispatch(variant, combo & 1, (combo >> 1) & 1,
                                                       (combo >> 2) & 1, NULL, 0, 1);
            if (e != cudaSuccess) {
                (void)cudaGetLastError(); /* not a sticky error: clear it */
                if (variant == MPT__CUDA_GEMM_BIG) cache->big_tiles = 0;
                else cache->tensor_cores = 0;
            }
        }
    for (int big = 0; big < 2; big++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int conv = MPT__CUDA_CONV_FORWARD; conv <= MPT__CUDA_CONV_KERNEL_GRAD; conv++)
                if (mpt__cuda_conv_dispatch(big, bf16, conv, NULL, 0, 1) != cudaSuccess) {
                    (void)cudaGetLastError();
                    if (big) cache->big_tiles = 0;
                    else cache->tensor_cores = 0;
                }
}

static mpt_status mpt__cuda_gemm_init_parts(mpt__cuda *c) {
    struct mpt__gemm_cache *cache;
    const char *tile_env = getenv("MPT_CUDA_GEMM_TILE");
    const char *choices = getenv("MPT_GEMM_CHOICES");
    int major = 0, minor = 0;
    c->gemm_cache = cache = (struct mpt__gemm_cache *)calloc(1, sizeof *cache);
    if (!cache)
        return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "no host memory for the GEMM plan cache");
    /* The capacity is set only once the entries exist: on failure destroy()
       walks `capacity` entries. */
    cache->entries = (mpt__cuda_gemm_entry *)calloc(64, sizeof *cache->entries);
    if (!cache->entries)
        return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "no host memory for the GEMM plan cache");
    cache->capacity = 64;
    cache->forced_tile = mpt__gemm_tile_from_env(tile_env);
    cache->wgmma_in_auto = getenv("MPT_GEMM_AUTO_WGMMA") &&
                           strcmp(getenv("MPT_GEMM_AUTO_WGMMA"), "1") == 0;
    if (cache->forced_tile < 0)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "MPT_CUDA_GEMM_TILE=\"%s\": expected \"64\" or \"128\"", tile_env);
    MPT__CU(c, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device));
    MPT__CU(c, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->device));
    cache->gpu = 10 * major + minor;
    if (choices && *choices) {
        if (!(cache->choices_path = strdup(choices)))
            return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                                  "no host memory for $MPT_GEMM_CHOICES");
        mpt__cuda_gemm_choices_load(c);
    }
    cache->tensor_cores = major >= 8;
    cache->big_tiles = 1;
    if (cache->tensor_cores) mpt__cuda_gemm_prepare_kernels(cache);
    mpt__cuda_wgmma_setup(cache);
    if (c->gemm_engine == MPT_GEMM_WGMMA && !cache->wgmma)
        mpt__cuda_log(c, MPT_LOG_WARNING,
                      "MPT_GEMM=wgmma: the Hopper kernel needs compute capability 9.0 and a "
                      "build with an sm_90a image (-gencode arch=compute_90a,code=sm_90a); "
                      "the mma.sync kernel runs every GEMM");
    MPT__LT(c, cublasLtCreate(&c->lt));
    c->lt_workspace_bytes = (size_t)32 << 20;
    MPT__CU(c, cudaMalloc(&c->lt_workspace, c->lt_workspace_bytes));
    /* The column sums' scratch, allocated here once because column_sums
       may run inside a graph capture. */
    MPT__CU(c, cudaMalloc((void **)&cache->colsum_partials,
                          sizeof(float) * MPT__CUDA_COLSUM_PARTIALS));
    cache->colsum_partials_count = MPT__CUDA_COLSUM_PARTIALS;
    /* Split-K's too: a GEMM may run inside a graph capture. */
    MPT__CU(c, cudaMalloc((void **)&cache->split_partials,
                          sizeof(float) * MPT__CUDA_SPLIT_PARTIALS));
    cache->split_partials_count = MPT__CUDA_SPLIT_PARTIALS;
    return MPT_OK;
}

static mpt_status mpt__cuda_gemm_init(mpt__cuda *c) {
    mpt_status st;
    c->gemm_cache = NULL;
    c->lt = NULL;
    c->lt_workspace = NULL;
    c->lt_workspace_bytes = 0;
    st = mpt__cuda_gemm_init_parts(c);
    if (st != MPT_OK) mpt__cuda_gemm_destroy(c);
    return st;
}

/* -----------------------------------------------------------------------------
   @cuda-colsums  Column sums (bias gradients)
   ----------------------------------------------------------------------------- */

/* out[j] (+)= Σ_r dz[r][j], in a fixed order chosen from rows and cols only
   (never from the GPU), so results repeat bit for bit, with no atomics.

   One block sums 32 columns over a run of rows; one block per 32 columns
   would put a tall, narrow matrix (a convolution's bias gradient: ~10^5
   rows, 32 columns) on one SM. So tall matrices take two passes: first
   the rows are cut into chunks, one block per (32 columns, chunk), each
   writing its chunk's sums into row `chunk` of a chunks×cols scratch
   matrix; then the same kernel sums that matrix's rows (one chunk per
   row, all rows in one block) into out. Short matrices take one pass.
   The scratch (c->gemm_cache->colsum_partials, allocated with the
   backend) is shared by every call: they are ordered on c->stream. */
#define MPT__CUDA_COLSUM_CHUNK_ROWS 512 /* the fewest rows worth a block     */
#define MPT__CUDA_COLSUM_MAX_CHUNKS 256 /* about two blocks per SM on H100  */

/* Block (32, 32) owns 32 columns and rows [chunk·chunk_rows, +chunk_rows)
   of dz, chunk = blockIdx.y: thread (x, y) reads column x of the chunk's
   rows y, y + 32, y + 64, ... (a warp reads 128 contiguous bytes of one
   row), into four accumulators in turn (rows y + 128·i + 32·s go to
   accumulator s) to keep four loads in flight; then the 32 partial sums
   of each column are added in a fixed tree in shared memory and written
   to sums[chunk·cols + column] (added to it when accumulate). Two blocks
   fit on an SM (32 registers a thread). */
static __global__ void __launch_bounds__(1024, 2)
    mpt__cuda_colsum_kernel(const float *dz, int64_t rows, int64_t cols, int64_t chunk_rows,
                            float *sums, int accumulate) {
    __shared__ float partial[32][33];
    const int x = threadIdx.x, y = threadIdx.y;
    const int64_t col = blockIdx.x * (int64_t)32 + x;
    const int64_t first = blockIdx.y * chunk_rows;
    const int64_t n = rows - first < chunk_rows ? rows - first : chunk_rows;
    const float *chunk = dz + first * cols;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) {
        int64_t r = y;
        for (; r + 96 < n; r += 128) {
#pragma unroll
            for (int u = 0; u < 4; u++) s[u] += chunk[(r + 32 * u) * cols + col];
        }
#pragma unroll
        for (int u = 0; u < 3; u++) /* the rest: fewer than 4 rows of 32 */
            if (r + 32 * u < n) s[u] += chunk[(r + 32 * u) * cols + col];
    }
    partial[y][x] = (s[0] + s[1]) + (s[2] + s[3]);
    __syncthreads();
    for (int half = 16; half > 0; half >>= 1) {
        if (y < half) partial[y][x] += partial[y + half][x];
        __syncthreads();
    }
    if (y == 0 && col < cols) {
        float *to = sums + blockIdx.y * cols + col;
        *to = accumulate ? *to + partial[0][x] : partial[0][x];
    }
}

/* How many chunks the rows are cut into: one per CHUNK_ROWS rows, at most
   MAX_CHUNKS, and no more than the scratch holds (fewer, longer chunks
   instead). 1: a single pass. */
static int64_t mpt__cuda_colsum_chunks(int64_t rows, int64_t cols, int64_t capacity) {
    int64_t chunks = (rows + MPT__CUDA_COLSUM_CHUNK_ROWS - 1) / MPT__CUDA_COLSUM_CHUNK_ROWS;
    if (chunks > MPT__CUDA_COLSUM_MAX_CHUNKS) chunks = MPT__CUDA_COLSUM_MAX_CHUNKS;
    if (chunks > capacity / cols) chunks = capacity / cols;
    return chunks < 1 ? 1 : chunks;
}

static void mpt__cuda_column_sums(void *impl, const float *dz, int64_t rows, int64_t cols,
                                  float *out, int accumulate) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    if (cols <= 0) return;
    if (rows < 0) rows = 0;
    const unsigned col_blocks = (unsigned)((cols + 31) / 32);
    int64_t chunks = mpt__cuda_colsum_chunks(rows, cols, cache->colsum_partials_count);
    if (chunks == 1) {
        mpt__cuda_colsum_kernel<<<col_blocks, dim3(32, 32), 0, c->stream>>>(dz, rows, cols, rows,
                                                                             out, accumulate);
        mpt__cuda_launched(c, "mpt__cuda_colsum_kernel");
        return;
    }
    /* Equal chunks (the last one shorter), none of them empty. */
    const int64_t chunk_rows = (rows + chunks - 1) / chunks;
    chunks = (rows + chunk_rows - 1) / chunk_rows;
    mpt__cuda_colsum_kernel<<<dim3(col_blocks, (unsigned)chunks), dim3(32, 32), 0, c->stream>>>(
        dz, rows, cols, chunk_rows, cache->colsum_partials, 0);
    mpt__cuda_launched(c, "mpt__cuda_colsum_kernel (chunks)");
    mpt__cuda_colsum_kernel<<<col_blocks, dim3(32, 32), 0, c->stream>>>(
        cache->colsum_partials, chunks, cols, chunks, out, accumulate);
    mpt__cuda_launched(c, "mpt__cuda_colsum_kernel (chunk sums)");
}

/* =============================================================================
   @cuda-layers  The layers' kernels
   ============================================================================= */

/* The CUDA backend's layer kernels: dtype conversion, activations and their
   gradients, im2col/col2im, pooling, BatchNormalization, LayerNormalization,
   MultiHeadAttention's scaled dot-product attention and Dropout; and
   Conv2D without im2col where it can (@cuda-conv: implicit GEMMs, no cols
   or float32 dcols in memory; their address rule is mpt.h's
   mpt__conv_gather_at).

   Each follows the CPU code in mpt.h (same formulas, same rounding points:
   float32 arithmetic, one rounding to the storage dtype at the end).
   Where the CPU multiplies and then adds, the kernels use __fmul_rn /
   __fadd_rn so that nvcc does not fuse them into an FMA (which rounds
   once instead of twice and would change the last bit). Sums that are not
   reductions (col2im, pooling backward, average pooling) are gathers in the
   CPU's own order, so they repeat the CPU's results bit for bit; the
   BatchNormalization statistics are reductions in a fixed tree order.

   Memory-bound kernels move 8 elements per thread (two or one 128-bit
   accesses) when every pointer involved is 16-byte aligned; the elements
   past the last full group of 8 are done one by one. */

/* ---- element types ----------------------------------------------------- */

/* float32 <-> storage dtype: widening is exact, narrowing rounds to nearest
   even, and a NaN keeps the bits the CPU gives it. */
template <typename T> struct mpt__cuda_layers_num;
template <> struct mpt__cuda_layers_num<float> {
    static __device__ __forceinline__ float widen(float v) { return v; }
    static __device__ __forceinline__ float narrow(float v) { return v; }
};
template <> struct mpt__cuda_layers_num<__half> {
    static __device__ __forceinline__ float widen(__half v) {
        return mpt__cuda_half_to_float(__half_as_ushort(v));
    }
    static __device__ __forceinline__ __half narrow(float v) {
        return __ushort_as_half(mpt__cuda_float_to_half(v));
    }
};
template <> struct mpt__cuda_layers_num<__nv_bfloat16> {
    static __device__ __forceinline__ float widen(__nv_bfloat16 v) {
        return mpt__cuda_bf16_to_float(__bfloat16_as_ushort(v));
    }
    static __device__ __forceinline__ __nv_bfloat16 narrow(float v) {
        return __ushort_as_bfloat16(mpt__cuda_float_to_bf16(v));
    }
};

template <typename T> static __device__ __forceinline__ float mpt__cuda_layers_widen(T v) {
    return mpt__cuda_layers_num<T>::widen(v);
}
template <typename T> static __device__ __forceinline__ T mpt__cuda_layers_narrow(float v) {
    return mpt__cuda_layers_num<T>::narrow(v);
}

/* N consecutive elements moved as one access: a 16-byte pack compiles to
   one 128-bit load/store, a 32-byte one (8 floats) to two. The alignment
   is capped at 16 bytes, the most the callers check for. */
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) mpt__cuda_layers_pack {
    T v[N];
};

template <int N, typename T>
static __device__ __forceinline__ mpt__cuda_layers_pack<T, N> mpt__cuda_layers_load(const T *p) {
    return *reinterpret_cast<const mpt__cuda_layers_pack<T, N> *>(p);
}
template <int N, typename T>
static __device__ __forceinline__ void mpt__cuda_layers_store(
    T *p, const mpt__cuda_layers_pack<T, N> &v) {
    *reinterpret_cast<mpt__cuda_layers_pack<T, N> *>(p) = v;
}

/* Elements per thread in the elementwise kernels. */
static const int mpt__cuda_layers_vec = 8;
static const int mpt__cuda_layers_threads = 256;

static bool mpt__cuda_layers_aligned(const void *p, size_t bytes) {
    return (uintptr_t)p % bytes == 0;
}

/* Calls f with a value of the C++ type of a float dtype (float32 for
   anything else, which the model never passes here). */
template <typename F> static void mpt__cuda_layers_dispatch(mpt_dtype dtype, F &&f) {
    switch (dtype) {
    case MPT_FLOAT16: f(__half()); break;
    case MPT_BFLOAT16: f(__nv_bfloat16()); break;
    default: f(0.0f); break;
    }
}

/* A device-to-device copy on the compute stream (failures reported at sync). */
static void mpt__cuda_layers_copy(mpt__cuda *c, void *dst, const void *src, size_t bytes,
                                  const char *what) {
    if (dst == src || bytes == 0) return;
    (void)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream);
    mpt__cuda_launched(c, what);
}

/* ---- the elementwise driver --------------------------------------------- */

/* Grid-stride loop over n elements: op.run<8>(i) for each full group of 8
   when `vectorized` (every pointer 16-byte aligned), then op.run<1>(i) for
   the rest (everything when not vectorized). */
template <typename Op>
static __device__ __forceinline__ void mpt__cuda_layers_for_each(const Op &op, int64_t n,
                                                                 int vectorized) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t start = 0;
    if (vectorized) {
        const int64_t groups = n / mpt__cuda_layers_vec;
        for (int64_t g = tid; g < groups; g += stride)
            op.template run<mpt__cuda_layers_vec>(g * mpt__cuda_layers_vec);
        start = groups * mpt__cuda_layers_vec;
    }
    for (int64_t i = start + tid; i < n; i += stride) op.template run<1>(i);
}

template <typename Op>
static __global__ void __launch_bounds__(256)
    mpt__cuda_layers_elementwise_kernel(Op op, int64_t n, int vectorized) {
    mpt__cuda_layers_for_each(op, n, vectorized);
}

/* Launches op over n elements; `vectorized`: all its pointers are aligned. */
template <typename Op>
static void mpt__cuda_layers_launch(mpt__cuda *c, const Op &op, int64_t n, bool vectorized,
                                    const char *what) {
    int64_t units = vectorized ? n / mpt__cuda_layers_vec + n % mpt__cuda_layers_vec : n;
    if (n <= 0) return;
    mpt__cuda_layers_elementwise_kernel<Op>
        <<<mpt__cuda_blocks(units, mpt__cuda_layers_threads), mpt__cuda_layers_threads, 0,
           c->stream>>>(op, n, vectorized ? 1 : 0);
    mpt__cuda_launched(c, what);
}

/* ---- convert ------------------------------------------------------------ */

/* dst = src through float32: at most one rounding (float16 <-> bfloat16
   widens exactly, then rounds once), as the CPU. */
template <typename D, typename S> struct mpt__cuda_convert_op {
    D *dst;
    const S *src;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<S, N> in = mpt__cuda_layers_load<N>(src + i);
        mpt__cuda_layers_pack<D, N> out;
#pragma unroll
        for (int e = 0; e < N; e++)
            out.v[e] = mpt__cuda_layers_narrow<D>(mpt__cuda_layers_widen(in.v[e]));
        mpt__cuda_layers_store<N>(dst + i, out);
    }
};

template <typename D, typename S>
static void mpt__cuda_layers_convert_typed(mpt__cuda *c, D *dst, const S *src, int64_t n) {
    mpt__cuda_convert_op<D, S> op = {dst, src};
    bool vec = mpt__cuda_layers_aligned(dst, 16) && mpt__cuda_layers_aligned(src, 16);
    mpt__cuda_layers_launch(c, op, n, vec, "convert");
}

static void mpt__cuda_convert(void *impl, mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                              const void *src, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (n <= 0) return;
    if (dst_dtype == src_dtype) {
        mpt__cuda_layers_copy(c, dst, src, (size_t)n * mpt_dtype_size(src_dtype), "convert (copy)");
        return;
    }
    mpt__cuda_layers_dispatch(dst_dtype, [&](auto d) {
        typedef decltype(d) D;
        mpt__cuda_layers_dispatch(src_dtype, [&](auto s) {
            typedef decltype(s) S;
            mpt__cuda_layers_convert_typed(c, (D *)dst, (const S *)src, n);
        });
    });
}

/* ---- bytes looked up ----------------------------------------------------- */

/* dst[i] = table[src[i]]: a batch of uint8 images normalised on the device
   by the dataset's own table (256 values in D, made on the host), so the
   values are the bits the host would have uploaded. */
template <typename D> struct mpt__cuda_lookup_u8_op {
    D *dst;
    const D *table;
    const uint8_t *src;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<D, N> out;
#pragma unroll
        for (int e = 0; e < N; e++) out.v[e] = table[src[i + e]];
        mpt__cuda_layers_store<N>(dst + i, out);
    }
};

static void mpt__cuda_lookup_u8(void *impl, mpt_dtype dtype, void *dst, const void *table,
                                const uint8_t *src, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (n <= 0) return;
    mpt__cuda_layers_dispatch(dtype, [&](auto d) {
        typedef decltype(d) D;
        mpt__cuda_lookup_u8_op<D> op = {(D *)dst, (const D *)table, src};
        mpt__cuda_layers_launch(c, op, n, mpt__cuda_layers_aligned(dst, 16), "lookup_u8");
    });
}

/* ---- activations -------------------------------------------------------- */

/* dy · act'(.) where `kept` is z for the GELUs and y for the others. */
static __device__ __forceinline__ float mpt__cuda_act_derivative(int act, float dy, float kept) {
    switch (act) {
    case MPT_ACT_RELU: return kept <= 0 ? 0.0f : dy; /* a NaN y passes dy, as the CPU */
    case MPT_ACT_GELU: return dy * mpt__gelu_derivative(kept); /* mpt.h's */
    case MPT_ACT_SIGMOID: return mpt__sigmoid_grad(kept, dy); /* mpt.h's */
    case MPT_ACT_TANH: return mpt__tanh_grad(kept, dy);
    case MPT_ACT_GELU_TANH: return dy * mpt__gelu_tanh_derivative(kept); /* mpt.h's */
    default: return dy;
    }
}

/* In place on float32; ACT is a template argument so the switch folds. */
template <int ACT> struct mpt__cuda_act_forward_op {
    float *x;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<float, N> v = mpt__cuda_layers_load<N>(x + i);
#pragma unroll
        for (int e = 0; e < N; e++) v.v[e] = mpt__cuda_act_apply(ACT, v.v[e]);
        mpt__cuda_layers_store<N>(x + i, v);
    }
};

template <int ACT, typename T> struct mpt__cuda_act_grad_op {
    const T *kept, *dy;
    float *dz;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<T, N> k = mpt__cuda_layers_load<N>(kept + i);
        mpt__cuda_layers_pack<T, N> d = mpt__cuda_layers_load<N>(dy + i);
        mpt__cuda_layers_pack<float, N> out;
#pragma unroll
        for (int e = 0; e < N; e++)
            out.v[e] = mpt__cuda_act_derivative(ACT, mpt__cuda_layers_widen(d.v[e]),
                                                mpt__cuda_layers_widen(k.v[e]));
        mpt__cuda_layers_store<N>(dz + i, out);
    }
};

/* Warp reductions by xor butterfly: a fixed order, and every lane ends with
   the same value (each pairwise sum is the same two operands). The max
   keeps the CPU's comparison (a NaN makes the whole row NaN either way). */
static __device__ __forceinline__ float mpt__cuda_layers_warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, v, m);
        v = o > v ? o : v;
    }
    return v;
}
static __device__ __forceinline__ float mpt__cuda_layers_warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

/* Softmax over each row: one warp per row (grid-stride over rows); lane l
   handles columns l, l + 32, ...; max and sum are warp reductions. */
static __global__ void __launch_bounds__(256)
    mpt__cuda_act_softmax_kernel(float *x, int64_t rows, int64_t cols) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        float *row = x + r * cols, max = row[0], sum = 0;
        for (int64_t k = lane; k < cols; k += 32) max = row[k] > max ? row[k] : max;
        max = mpt__cuda_layers_warp_max(max);
        for (int64_t k = lane; k < cols; k += 32) sum += (row[k] = expf(row[k] - max));
        sum = mpt__cuda_layers_warp_sum(sum);
        for (int64_t k = lane; k < cols; k += 32) row[k] = row[k] / sum;
    }
}

/* Softmax backward, one warp per row: dz = y · (dy − Σ dy·y). Each lane
   writes only the columns it read, so dz may be dy (float32). */
template <typename T>
static __global__ void __launch_bounds__(256)
    mpt__cuda_act_softmax_grad_kernel(const T *y, const T *dy, float *dz, int64_t rows,
                                      int64_t cols) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const int64_t at = r * cols;
        float dot = 0;
        for (int64_t k = lane; k < cols; k += 32)
            dot = __fadd_rn(dot, __fmul_rn(mpt__cuda_layers_widen(dy[at + k]),
                                           mpt__cuda_layers_widen(y[at + k])));
        dot = mpt__cuda_layers_warp_sum(dot);
        for (int64_t k = lane; k < cols; k += 32)
            dz[at + k] = mpt__cuda_layers_widen(y[at + k]) *
                         (mpt__cuda_layers_widen(dy[at + k]) - dot);
    }
}

static unsigned mpt__cuda_layers_row_blocks(int64_t rows) {
    return mpt__cuda_blocks(rows, mpt__cuda_layers_threads / 32); /* a warp per row */
}

/* One elementwise activation over n floats in place, named as mpt.h names it. */
template <mpt_activation ACT>
static void mpt__cuda_act_forward(mpt__cuda *c, float *x, int64_t n, bool vec) {
    mpt__cuda_layers_launch(c, mpt__cuda_act_forward_op<ACT>{x}, n, vec, mpt_activation_name(ACT));
}

static void mpt__cuda_activation(void *impl, mpt_activation act, float *x, int64_t rows,
                                 int64_t cols) {
    mpt__cuda *c = (mpt__cuda *)impl;
    int64_t n = rows * cols;
    bool vec = mpt__cuda_layers_aligned(x, 16);
    if (n <= 0) return;
    switch (act) {
    case MPT_ACT_RELU: mpt__cuda_act_forward<MPT_ACT_RELU>(c, x, n, vec); break;
    case MPT_ACT_GELU: mpt__cuda_act_forward<MPT_ACT_GELU>(c, x, n, vec); break;
    case MPT_ACT_SIGMOID: mpt__cuda_act_forward<MPT_ACT_SIGMOID>(c, x, n, vec); break;
    case MPT_ACT_TANH: mpt__cuda_act_forward<MPT_ACT_TANH>(c, x, n, vec); break;
    case MPT_ACT_GELU_TANH: mpt__cuda_act_forward<MPT_ACT_GELU_TANH>(c, x, n, vec); break;
    case MPT_ACT_SOFTMAX:
        mpt__cuda_act_softmax_kernel<<<mpt__cuda_layers_row_blocks(rows), mpt__cuda_layers_threads,
                                       0, c->stream>>>(x, rows, cols);
        mpt__cuda_launched(c, "softmax");
        break;
    default: break;
    }
}

template <int ACT, typename T>
static void mpt__cuda_act_grad_typed(mpt__cuda *c, const T *kept, const T *dy, float *dz,
                                     int64_t n, const char *what) {
    mpt__cuda_act_grad_op<ACT, T> op = {kept, dy, dz};
    bool vec = mpt__cuda_layers_aligned(kept, 16) && mpt__cuda_layers_aligned(dy, 16) &&
               mpt__cuda_layers_aligned(dz, 16);
    mpt__cuda_layers_launch(c, op, n, vec, what);
}

/* tmp is not needed: the kernels read dy, y and z in their dtype. */
static void mpt__cuda_activation_grad(void *impl, mpt_activation act, mpt_dtype dtype,
                                      const void *z, const void *y, const void *dy, float *dz,
                                      float *tmp, int64_t rows, int64_t cols) {
    mpt__cuda *c = (mpt__cuda *)impl;
    int64_t n = rows * cols;
    (void)tmp;
    if (n <= 0) return;
    if (act != MPT_ACT_RELU && act != MPT_ACT_GELU && act != MPT_ACT_SIGMOID &&
        act != MPT_ACT_TANH && act != MPT_ACT_SOFTMAX &&
        act != MPT_ACT_GELU_TANH) { /* linear: dz = dy */
        mpt__cuda_convert(impl, MPT_FLOAT32, dz, dtype, dy, n);
        return;
    }
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        const T *kept = (const T *)y, *d = (const T *)dy;
        switch (act) {
        case MPT_ACT_RELU:
            mpt__cuda_act_grad_typed<MPT_ACT_RELU>(c, kept, d, dz, n, "relu backward");
            break;
        case MPT_ACT_GELU:
            mpt__cuda_act_grad_typed<MPT_ACT_GELU>(c, (const T *)z, d, dz, n, "gelu backward");
            break;
        case MPT_ACT_SIGMOID:
            mpt__cuda_act_grad_typed<MPT_ACT_SIGMOID>(c, kept, d, dz, n, "sigmoid backward");
            break;
        case MPT_ACT_TANH:
            mpt__cuda_act_grad_typed<MPT_ACT_TANH>(c, kept, d, dz, n, "tanh backward");
            break;
        case MPT_ACT_GELU_TANH:
            mpt__cuda_act_grad_typed<MPT_ACT_GELU_TANH>(c, (const T *)z, d, dz, n,
                                                        "gelu_tanh backward");
            break;
        default: /* softmax */
            mpt__cuda_act_softmax_grad_kernel<T><<<mpt__cuda_layers_row_blocks(rows),
                                                   mpt__cuda_layers_threads, 0, c->stream>>>(
                kept, d, dz, rows, cols);
            mpt__cuda_launched(c, "softmax backward");
            break;
        }
    });
}

/* ---- im2col / col2im ---------------------------------------------------- */

/* The index arithmetic below splits a thread's linear index into (b, y,
   x, ...) by divisions by the window's sizes, several per 16-byte unit
   moved: as 64-bit divisions (a long subroutine on a GPU) they cost more
   than the copy. When every index of a call is below 2^31 the kernels
   divide 32-bit indices by multiply and shift instead, with the magic
   numbers computed on the host (mpt__fastdiv, mpt.h @backend-shared);
   else, or with $MPT_CUDA_INDEX64=1 (which tests that path), in 64 bits.
   Both paths give the same indices, so the same results. */
typedef struct mpt__cuda_div64 {
    int64_t d;
} mpt__cuda_div64;

static __host__ __device__ mpt__cuda_div64 mpt__cuda_div64_make(int64_t d) {
    mpt__cuda_div64 f;
    f.d = d;
    return f;
}

static __device__ __forceinline__ int64_t mpt__cuda_div(mpt__cuda_div64 f, int64_t n) {
    return n / f.d;
}
static __device__ __forceinline__ uint32_t mpt__cuda_div(mpt__fastdiv f, uint32_t n) {
    return mpt__fastdiv_div(f, n);
}

/* *t = *t / f; returns the remainder. */
template <typename DIV, typename I>
static __device__ __forceinline__ I mpt__cuda_divmod(DIV f, I *t) {
    const I q = mpt__cuda_div(f, *t), r = *t - q * (I)f.d;
    *t = q;
    return r;
}

/* Whether a call's indices (below `total`) and window sizes fit the
   32-bit path: every index and divisor below 2^31, and the covering
   rows' sums (y + pad + stride, below 2^31 + 2^30 + 2^30) below 2^32. */
static bool mpt__cuda_layers_index32(const mpt__cuda *c, const mpt_window *g, int64_t total) {
    const int64_t small = (int64_t)1 << 30;
    return !c->index64 && total < ((int64_t)1 << 31) && g->sh < small && g->sw < small &&
           g->top < small && g->left < small && g->kh < small && g->kw < small &&
           g->oh < small && g->ow < small;
}

/* The output rows (or columns) whose windows cover input row y:
   o·s − pad ≤ y < o·s − pad + k, clipped to [0, out). Empty when o0 > o1. */
template <typename DIV>
static __device__ __forceinline__ void mpt__cuda_layers_covering(int64_t y, int64_t k, DIV s,
                                                                 int64_t pad, int64_t out,
                                                                 int64_t *o0, int64_t *o1) {
    typedef decltype(s.d) I; /* the path's index type; the values are >= 0 */
    const int64_t lo = y + pad - k + 1;
    const int64_t hi = (int64_t)mpt__cuda_div(s, (I)(y + pad)); /* y + pad >= 0 */
    *o0 = lo <= 0 ? 0 : (int64_t)mpt__cuda_div(s, (I)(lo + (int64_t)s.d - 1));
    *o1 = hi < out - 1 ? hi : out - 1;
}

/* The same with a plain stride (pooling: one window per thread). */
static __device__ __forceinline__ void mpt__cuda_layers_covering(int64_t y, int64_t k, int64_t s,
                                                                 int64_t pad, int64_t out,
                                                                 int64_t *o0, int64_t *o1) {
    mpt__cuda_layers_covering(y, k, mpt__cuda_div64_make(s), pad, out, o0, o1);
}

/* im2col is a copy: the kernel moves units U (2 to 16 bytes) of a pixel's
   C·es bytes. One thread per unit of cols, index (b, oy, ox, i, j, q) with
   q (the unit within the pixel) fastest, so a warp reads and writes
   consecutive bytes; pixels outside the image are zeros. I and DIV: the
   index path (uint32_t with mpt__fastdiv, or int64_t). */
template <typename U, typename I, typename DIV>
static __global__ void __launch_bounds__(256)
    mpt__cuda_im2col_kernel(mpt_window g, const U *x, U *cols, DIV units_per_pixel, DIV kw, DIV kh,
                            DIV ow, DIV oh, I total) {
    const I stride = (I)gridDim.x * blockDim.x;
    for (I u = (I)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
        I t = u;
        const int64_t q = mpt__cuda_divmod(units_per_pixel, &t);
        const int64_t j = mpt__cuda_divmod(kw, &t);
        const int64_t i = mpt__cuda_divmod(kh, &t);
        const int64_t ox = mpt__cuda_divmod(ow, &t);
        const int64_t oy = mpt__cuda_divmod(oh, &t);
        const int64_t b = t;
        const int64_t y = oy * g.sh - g.top + i, xx = ox * g.sw - g.left + j;
        U v = U();
        if (y >= 0 && y < g.h && xx >= 0 && xx < g.w)
            v = x[((b * g.h + y) * g.w + xx) * (int64_t)units_per_pixel.d + q];
        cols[u] = v;
    }
}

template <typename U>
static void mpt__cuda_im2col_units(mpt__cuda *c, const mpt_window *g, const void *x, void *cols,
                                   int64_t pixel_bytes, int64_t n) {
    const int64_t upp = pixel_bytes / (int64_t)sizeof(U);
    const int64_t total = n * g->oh * g->ow * g->kh * g->kw * upp;
    const unsigned blocks = mpt__cuda_blocks(total, mpt__cuda_layers_threads);
    if (total <= 0) return;
    /* Every divisor is a factor of total, so below 2^31 with it. */
    if (mpt__cuda_layers_index32(c, g, total))
        mpt__cuda_im2col_kernel<U, uint32_t, mpt__fastdiv>
            <<<blocks, mpt__cuda_layers_threads, 0, c->stream>>>(
                *g, (const U *)x, (U *)cols, mpt__fastdiv_make((uint32_t)upp),
                mpt__fastdiv_make((uint32_t)g->kw), mpt__fastdiv_make((uint32_t)g->kh),
                mpt__fastdiv_make((uint32_t)g->ow), mpt__fastdiv_make((uint32_t)g->oh),
                (uint32_t)total);
    else
        mpt__cuda_im2col_kernel<U, int64_t, mpt__cuda_div64>
            <<<blocks, mpt__cuda_layers_threads, 0, c->stream>>>(
                *g, (const U *)x, (U *)cols, mpt__cuda_div64_make(upp),
                mpt__cuda_div64_make(g->kw), mpt__cuda_div64_make(g->kh),
                mpt__cuda_div64_make(g->ow), mpt__cuda_div64_make(g->oh), total);
    mpt__cuda_launched(c, "im2col");
}

static void mpt__cuda_im2col(void *impl, const mpt_window *g, mpt_dtype dtype, const void *x,
                             int64_t n, void *cols) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const int64_t pb = g->c * (int64_t)mpt_dtype_size(dtype); /* bytes of one pixel */
    /* The widest unit that divides a pixel and that both buffers are aligned to. */
    auto fits = [&](int64_t bytes) {
        return pb % bytes == 0 && mpt__cuda_layers_aligned(x, (size_t)bytes) &&
               mpt__cuda_layers_aligned(cols, (size_t)bytes);
    };
    if (fits(16))
        mpt__cuda_im2col_units<uint4>(c, g, x, cols, pb, n);
    else if (fits(8))
        mpt__cuda_im2col_units<uint2>(c, g, x, cols, pb, n);
    else if (fits(4))
        mpt__cuda_im2col_units<uint32_t>(c, g, x, cols, pb, n);
    else
        mpt__cuda_im2col_units<uint16_t>(c, g, x, cols, pb, n);
}

/* col2im as a gather: one thread per V channels of one input pixel
   (b, y, x), index with the channels fastest. It adds the dcols entries
   that came from it, output row by output row and within a row output
   column by column, from 0: the CPU's order, so the same float sums. Then
   one rounding to dtype; no atomics, every output written once. I and
   DIV: the index path, as im2col's. */
template <typename T, int V, typename I, typename DIV>
static __global__ void __launch_bounds__(256)
    mpt__cuda_col2im_kernel(mpt_window g, const float *dcols, T *dx, DIV channel_groups, DIV w,
                            DIV h, DIV sh, DIV sw, I total) {
    const I stride = (I)gridDim.x * blockDim.x;
    for (I u = (I)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
        I t = u;
        const int64_t ch = (int64_t)mpt__cuda_divmod(channel_groups, &t) * V;
        const int64_t x = mpt__cuda_divmod(w, &t);
        const int64_t y = mpt__cuda_divmod(h, &t);
        const int64_t b = t;
        int64_t oy0, oy1, ox0, ox1;
        float sum[V];
#pragma unroll
        for (int e = 0; e < V; e++) sum[e] = 0.0f;
        mpt__cuda_layers_covering(y, g.kh, sh, g.top, g.oh, &oy0, &oy1);
        mpt__cuda_layers_covering(x, g.kw, sw, g.left, g.ow, &ox0, &ox1);
        for (int64_t oy = oy0; oy <= oy1; oy++) {
            const int64_t i = y - (oy * g.sh - g.top); /* the window row y is */
            for (int64_t ox = ox0; ox <= ox1; ox++) {
                const int64_t j = x - (ox * g.sw - g.left);
                const int64_t row = (b * g.oh + oy) * g.ow + ox; /* the row of cols */
                const int64_t at = ((row * g.kh + i) * g.kw + j) * g.c + ch;
                mpt__cuda_layers_pack<float, V> d = mpt__cuda_layers_load<V>(dcols + at);
#pragma unroll
                for (int e = 0; e < V; e++) sum[e] += d.v[e];
            }
        }
        mpt__cuda_layers_pack<T, V> out;
#pragma unroll
        for (int e = 0; e < V; e++) out.v[e] = mpt__cuda_layers_narrow<T>(sum[e]);
        mpt__cuda_layers_store<V>(dx + (int64_t)u * V, out);
    }
}

template <typename T, int V>
static void mpt__cuda_col2im_typed(mpt__cuda *c, const mpt_window *g, const float *dcols,
                                   int64_t n, T *dx) {
    const int64_t total = n * g->h * g->w * (g->c / V);
    const unsigned blocks = mpt__cuda_blocks(total, mpt__cuda_layers_threads);
    if (total <= 0) return;
    if (mpt__cuda_layers_index32(c, g, total))
        mpt__cuda_col2im_kernel<T, V, uint32_t, mpt__fastdiv>
            <<<blocks, mpt__cuda_layers_threads, 0, c->stream>>>(
                *g, dcols, dx, mpt__fastdiv_make((uint32_t)(g->c / V)),
                mpt__fastdiv_make((uint32_t)g->w), mpt__fastdiv_make((uint32_t)g->h),
                mpt__fastdiv_make((uint32_t)g->sh), mpt__fastdiv_make((uint32_t)g->sw),
                (uint32_t)total);
    else
        mpt__cuda_col2im_kernel<T, V, int64_t, mpt__cuda_div64>
            <<<blocks, mpt__cuda_layers_threads, 0, c->stream>>>(
                *g, dcols, dx, mpt__cuda_div64_make(g->c / V), mpt__cuda_div64_make(g->w),
                mpt__cuda_div64_make(g->h), mpt__cuda_div64_make(g->sh),
                mpt__cuda_div64_make(g->sw), total);
    mpt__cuda_launched(c, "col2im");
}

/* dxf is not needed: the gather rounds each sum straight into dx. */
static void mpt__cuda_col2im(void *impl, const mpt_window *g, mpt_dtype dtype, const float *dcols,
                             int64_t n, float *dxf, void *dx) {
    mpt__cuda *c = (mpt__cuda *)impl;
    (void)dxf;
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        /* 4 channels a thread: dcols in 16 bytes, dx in 4 elements. */
        if (g->c % 4 == 0 && mpt__cuda_layers_aligned(dcols, 16) &&
            mpt__cuda_layers_aligned(dx, 4 * sizeof(T)))
            mpt__cuda_col2im_typed<T, 4>(c, g, dcols, n, (T *)dx);
        else
            mpt__cuda_col2im_typed<T, 1>(c, g, dcols, n, (T *)dx);
    });
}

/* -----------------------------------------------------------------------------
   @cuda-conv  Conv2D as implicit GEMMs (mpt_backend.conv_direct)
   -----------------------------------------------------------------------------
   im2col + GEMM + col2im moves cols (dtype) through memory and, for the
   input gradient, dcols in float32: about 0.4 GB per 4 GFLOP at batch
   128. Here the tensor-core GEMM (@cuda-gemm-mma) reads its operands'
   16-byte chunks straight from x, dz and the kernel instead, where mpt.h's
   rule finds them (mpt__conv_gather_at, @backend-shared-cuda, tested on
   the host by tests/test_cuda_rules.c); its ring, mma.sync, epilogue and
   split-K are the GEMM's own:
     forward      y (n·OH·OW, F) = act(cols · kernel + bias) in dtype;
     input_grad   dx (n·H·W, C) = A_dz · kernelᵀ (both gathered), beta 0,
                  in dtype: one rounding of a float32 sum, as col2im's,
                  whose sums run in another order (not its bits);
     kernel_grad  dkernel (kh·kw·C, F) (+)= colsᵀ · dz in float32, split
                  along the pixels as a GEMM of that shape is
                  (mpt__gemm_split_k: slices added in a fixed order).
   Declined (0, nothing done; the layer runs im2col): float32 (the kernel
   is 16-bit), C or F not a multiple of 8 (a first layer's 1 or 3
   channels), tensors not 16-byte aligned, indices past 2^31, a 1×1
   window of stride 1 that pads nothing (a plain GEMM already), the
   kernel gradient from out and dy (dz NULL: the layer makes dz and calls
   again), an activation that is not elementwise, a forward max-pooled
   in the same call (max_pool2: the CPU's), no tensor cores, and
   every call under $MPT_CUDA_CONV=im2col (to tell this path's failures
   from the rest). No workspace: split-K's partials are the GEMM's. */

/* One instantiation of the tensor-core kernel for direction CONV (A and
   B transposed as that product stores them), or (prepare) its
   shared-memory limit raised. */
template <class TILE, bool BF16>
static cudaError_t mpt__cuda_conv_go(int conv, const mpt__cuda_conv_gemm_args *p,
                                     cudaStream_t stream, int prepare) {
    switch (conv) {
    case MPT__CUDA_CONV_FORWARD:
        return mpt__cuda_gemm_tc_go<TILE, BF16, false, false, true, MPT__CUDA_CONV_FORWARD>(
            p, stream, prepare);
    case MPT__CUDA_CONV_INPUT_GRAD:
        return mpt__cuda_gemm_tc_go<TILE, BF16, false, true, true, MPT__CUDA_CONV_INPUT_GRAD>(
            p, stream, prepare);
    default:
        return mpt__cuda_gemm_tc_go<TILE, BF16, true, false, true, MPT__CUDA_CONV_KERNEL_GRAD>(
            p, stream, prepare);
    }
}

static cudaError_t mpt__cuda_conv_dispatch(int big, int bf16, int conv,
                                           const mpt__cuda_conv_gemm_args *p, cudaStream_t stream,
                                           int prepare) {
    typedef mpt__cuda_gemm_tile_big big_tile;
    typedef mpt__cuda_gemm_tile_small small_tile;
    if (big)
        return bf16 ? mpt__cuda_conv_go<big_tile, true>(conv, p, stream, prepare)
                    : mpt__cuda_conv_go<big_tile, false>(conv, p, stream, prepare);
    return bf16 ? mpt__cuda_conv_go<small_tile, true>(conv, p, stream, prepare)
                : mpt__cuda_conv_go<small_tile, false>(conv, p, stream, prepare);
}

/* Whether conv_direct takes a (the list above). */
static bool mpt__cuda_conv_takes(const mpt__cuda *c, const mpt_conv_args *a) {
    const mpt_window *g = a->g;
    const bool identity = g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 &&
                          g->oh == g->h && g->ow == g->w;
    if (!c->conv_implicit || !c->gemm_cache || !c->gemm_cache->tensor_cores) return false;
    if (a->max_pool2) return false;
    if (a->dtype != MPT_FLOAT16 && a->dtype != MPT_BFLOAT16) return false;
    if (identity || !mpt__conv_gather_fits(g, a->n, a->f)) return false;
    if (a->kernel_grad)
        return a->dz && a->dkernel && mpt__cuda_layers_aligned(a->x, 16) &&
               mpt__cuda_layers_aligned(a->dz, 16);
    if (!a->input_grad && (!mpt__activation_fuses(a->act) || a->act < 0 ||
                           a->act >= MPT_ACT_COUNT_))
        return false;
    return mpt__cuda_layers_aligned(a->x, 16) && mpt__cuda_layers_aligned(a->kernel, 16);
}

/* The product a asks for as the GEMM it is (mpt_gemm_desc's fields: the
   shape, B's and C's pointers and leading dimensions, the epilogue); A
   and, for the input gradient, B are read by the gather, not by lda/ldb.
   *conv: the kernel's direction; *c_dtype: C's. */
static mpt_gemm_desc mpt__cuda_conv_gemm(const mpt_conv_args *a, int *conv, mpt_dtype *c_dtype) {
    const mpt_window *g = a->g;
    const int64_t taps = g->kh * g->kw, pixels = a->n * g->oh * g->ow;
    mpt_gemm_desc d;
    memset(&d, 0, sizeof d);
    d.ab_dtype = a->dtype;
    d.a = a->x; /* the forward's x, the input gradient's dz, the kernel gradient's x */
    if (a->kernel_grad) { /* dkernel (taps·C, F) (+)= colsᵀ · dz */
        *conv = MPT__CUDA_CONV_KERNEL_GRAD;
        *c_dtype = MPT_FLOAT32;
        d.trans_a = 1;
        d.m = taps * g->c, d.n = a->f, d.k = pixels;
        d.b = a->dz, d.ldb = a->f;
        d.c = a->dkernel, d.ldc = a->f;
        d.beta = a->accumulate ? 1.0f : 0.0f;
    } else if (a->input_grad) { /* dx (n·H·W, C) = A_dz · kernelᵀ */
        *conv = MPT__CUDA_CONV_INPUT_GRAD;
        *c_dtype = a->dtype;
        d.trans_b = 1;
        d.m = a->n * g->h * g->w, d.n = g->c, d.k = taps * a->f;
        d.b = a->kernel;
        d.c = (float *)a->y, d.ldc = g->c;
    } else { /* y (n·OH·OW, F) = act(cols · kernel + bias) */
        *conv = MPT__CUDA_CONV_FORWARD;
        *c_dtype = a->dtype;
        d.m = pixels, d.n = a->f, d.k = taps * g->c;
        d.b = a->kernel, d.ldb = a->f;
        d.c = (float *)a->y, d.ldc = a->f;
        d.bias = a->bias;
        d.activation = a->act;
    }
    return d;
}

/* The CUDA backend's conv_direct: 1 when it queued the product, 0 when
   it declines (nothing done). The tile and the K split follow the GEMM's
   rules for the product's shape, so a shape always takes the same path. */
static int mpt__cuda_conv_direct(void *impl, const mpt_conv_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const struct mpt__gemm_cache *cache = c->gemm_cache;
    mpt_dtype c_dtype;
    int conv, tile;
    if (!mpt__cuda_conv_takes(c, a)) return 0;
    const mpt_gemm_desc d = mpt__cuda_conv_gemm(a, &conv, &c_dtype);
    mpt__cuda_conv_gemm_args p;
    static_cast<mpt__cuda_gemm_args &>(p) = mpt__cuda_gemm_make_args(&d, c_dtype, d.c);
    p.gather = mpt__conv_gather_make(a->g, a->f);
    tile = mpt__gemm_tile(d.m, d.n, c->sm_count, cache->big_tiles, cache->forced_tile);
    const mpt__gemm_split split = mpt__gemm_split_k(d.m, d.n, d.k, tile, c->sm_count,
                                                    cache->split_partials_count);
    if (split.splits > 1) {
        p.partials = cache->split_partials;
        p.depth = split.depth;
    }
    mpt__cuda_conv_dispatch(tile == 128, a->dtype == MPT_BFLOAT16, conv, &p, c->stream, 0);
    mpt__cuda_launched(c, "mpt__cuda_gemm_tc_kernel (Conv2D)");
    if (split.splits > 1) {
        mpt__cuda_gemm_split_sum_kernel<<<mpt__cuda_blocks(d.m * d.n, 256), 256, 0, c->stream>>>(
            p, split.splits);
        mpt__cuda_launched(c, "mpt__cuda_gemm_split_sum_kernel (Conv2D)");
    }
    return 1;
}

/* ---- pooling ------------------------------------------------------------ */

/* Pooling kernels give each thread V consecutive channels of one pixel
   (V = 16 bytes of the dtype when the channels and pointers allow, else
   1), index with the channel groups fastest so a warp's accesses are
   contiguous. Forward: one thread per output pixel's channel group, the
   window's pixels in the CPU's order (rows, then columns). */

/* The input rows [r0, r1) and columns [c0, c1) of output (oy, ox)'s window
   inside the image. */
static __device__ __forceinline__ void mpt__cuda_pool_span(const mpt_window &g, int64_t oy,
                                                           int64_t ox, int64_t *r0, int64_t *r1,
                                                           int64_t *c0, int64_t *c1) {
    const int64_t y = oy * g.sh - g.top, x = ox * g.sw - g.left;
    *r0 = y > 0 ? y : 0;
    *r1 = y + g.kh < g.h ? y + g.kh : g.h;
    *c0 = x > 0 ? x : 0;
    *c1 = x + g.kw < g.w ? x + g.kw : g.w;
}

/* 1 / (pixels of the window inside the image), as the CPU. */
static __device__ __forceinline__ float mpt__cuda_pool_inv_count(int64_t r0, int64_t r1,
                                                                 int64_t c0, int64_t c1) {
    return 1.0f / (float)((r1 - r0) * (c1 - c0));
}

/* Splits thread unit u of a (b, row, col, channel group) grid. */
static __device__ __forceinline__ void mpt__cuda_pool_unit(int64_t u, int64_t groups,
                                                           int64_t cols, int64_t rows,
                                                           int64_t *b, int64_t *row,
                                                           int64_t *col, int64_t *group) {
    int64_t t = u / groups;
    *group = u - t * groups;
    *col = t % cols;
    t /= cols;
    *row = t % rows;
    *b = t / rows;
}

/* Max: the first largest wins, a NaN wins over numbers; argmax is the
   index within the sample. Average: Σ in window order, times 1/count. */
template <typename T, int V, bool MAX>
static __global__ void __launch_bounds__(256)
    mpt__cuda_pool_forward_kernel(mpt_window g, const T *x, T *y, int32_t *argmax, int64_t total) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, groups = g.c / V;
    const int64_t n_in = g.h * g.w * g.c, n_out = g.oh * g.ow * g.c;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
        int64_t b, oy, ox, grp, r0, r1, c0, c1;
        mpt__cuda_pool_unit(u, groups, g.ow, g.oh, &b, &oy, &ox, &grp);
        mpt__cuda_pool_span(g, oy, ox, &r0, &r1, &c0, &c1);
        const int64_t ch = grp * V;
        const T *xs = x + b * n_in;
        float acc[V];
        int32_t arg[V];
#pragma unroll
        for (int e = 0; e < V; e++) {
            acc[e] = MAX ? -INFINITY : 0.0f;
            arg[e] = (int32_t)((r0 * g.w + c0) * g.c + ch + e);
        }
        for (int64_t r = r0; r < r1; r++)
            for (int64_t q = c0; q < c1; q++) {
                const int64_t at = (r * g.w + q) * g.c + ch;
                mpt__cuda_layers_pack<T, V> p = mpt__cuda_layers_load<V>(xs + at);
#pragma unroll
                for (int e = 0; e < V; e++) {
                    const float v = mpt__cuda_layers_widen(p.v[e]);
                    if (!MAX) {
                        acc[e] += v;
                    } else if (v > acc[e] || (v != v && acc[e] == acc[e])) {
                        acc[e] = v;
                        arg[e] = (int32_t)(at + e);
                    }
                }
            }
        const int64_t out_at = b * n_out + (oy * g.ow + ox) * g.c + ch;
        const float inv = MAX ? 1.0f : mpt__cuda_pool_inv_count(r0, r1, c0, c1);
        mpt__cuda_layers_pack<T, V> out;
#pragma unroll
        for (int e = 0; e < V; e++)
            out.v[e] = mpt__cuda_layers_narrow<T>(MAX ? acc[e] : acc[e] * inv);
        mpt__cuda_layers_store<V>(y + out_at, out);
        if (MAX) {
            mpt__cuda_layers_pack<int32_t, V> a;
#pragma unroll
            for (int e = 0; e < V; e++) a.v[e] = arg[e];
            mpt__cuda_layers_store<V>(argmax + out_at, a);
        }
    }
}

/* Backward as a gather: one thread per input pixel's channel group sums
   the gradients of the outputs whose windows cover it, output rows then
   columns, from 0: the CPU's order. Max takes dy where that output's argmax
   is this element; average takes dy · 1/count. Windows may overlap (stride
   < size) or leave pixels out (stride > size: their dx is 0). */
template <typename T, int V, bool MAX>
static __global__ void __launch_bounds__(256)
    mpt__cuda_pool_backward_kernel(mpt_window g, const T *dy, T *dx, const int32_t *argmax,
                                   int64_t total) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, groups = g.c / V;
    const int64_t n_out = g.oh * g.ow * g.c;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
        int64_t b, y, x, grp, oy0, oy1, ox0, ox1;
        mpt__cuda_pool_unit(u, groups, g.w, g.h, &b, &y, &x, &grp);
        mpt__cuda_layers_covering(y, g.kh, g.sh, g.top, g.oh, &oy0, &oy1);
        mpt__cuda_layers_covering(x, g.kw, g.sw, g.left, g.ow, &ox0, &ox1);
        const int64_t ch = grp * V;
        const int32_t self = (int32_t)((y * g.w + x) * g.c + ch); /* index within the sample */
        float sum[V];
#pragma unroll
        for (int e = 0; e < V; e++) sum[e] = 0.0f;
        for (int64_t oy = oy0; oy <= oy1; oy++)
            for (int64_t ox = ox0; ox <= ox1; ox++) {
                const int64_t at = b * n_out + (oy * g.ow + ox) * g.c + ch;
                mpt__cuda_layers_pack<T, V> d = mpt__cuda_layers_load<V>(dy + at);
                if (MAX) {
                    mpt__cuda_layers_pack<int32_t, V> a = mpt__cuda_layers_load<V>(argmax + at);
#pragma unroll
                    for (int e = 0; e < V; e++)
                        if (a.v[e] == self + e) sum[e] += mpt__cuda_layers_widen(d.v[e]);
                } else {
                    int64_t r0, r1, c0, c1;
                    mpt__cuda_pool_span(g, oy, ox, &r0, &r1, &c0, &c1);
                    const float inv = mpt__cuda_pool_inv_count(r0, r1, c0, c1);
#pragma unroll
                    for (int e = 0; e < V; e++)
                        sum[e] = __fadd_rn(sum[e], __fmul_rn(mpt__cuda_layers_widen(d.v[e]), inv));
                }
            }
        mpt__cuda_layers_pack<T, V> out;
#pragma unroll
        for (int e = 0; e < V; e++) out.v[e] = mpt__cuda_layers_narrow<T>(sum[e]);
        mpt__cuda_layers_store<V>(dx + u * V, out);
    }
}

/* Whether V channels a thread fit: C a multiple of V, every pointer aligned
   to its pack (argmax packs are V int32s, capped at 16 bytes). */
template <typename T>
static bool mpt__cuda_pool_vectorizable(const mpt_window *g, const void *a, const void *b,
                                        const int32_t *argmax) {
    const int v = 16 / (int)sizeof(T);
    return g->c % v == 0 && mpt__cuda_layers_aligned(a, 16) && mpt__cuda_layers_aligned(b, 16) &&
           mpt__cuda_layers_aligned(argmax, 16);
}

template <typename T, int V, bool MAX>
static void mpt__cuda_pool_forward_typed(mpt__cuda *c, const mpt_window *g, const T *x, T *y,
                                         int32_t *argmax, int64_t n) {
    const int64_t total = n * g->oh * g->ow * (g->c / V);
    if (total <= 0) return;
    mpt__cuda_pool_forward_kernel<T, V, MAX><<<mpt__cuda_blocks(total, mpt__cuda_layers_threads),
                                               mpt__cuda_layers_threads, 0, c->stream>>>(
        *g, x, y, argmax, total);
    mpt__cuda_launched(c, MAX ? "max pooling" : "average pooling");
}

template <typename T, int V, bool MAX>
static void mpt__cuda_pool_backward_typed(mpt__cuda *c, const mpt_window *g, const T *dy, T *dx,
                                          const int32_t *argmax, int64_t n) {
    const int64_t total = n * g->h * g->w * (g->c / V);
    if (total <= 0) return;
    mpt__cuda_pool_backward_kernel<T, V, MAX><<<mpt__cuda_blocks(total, mpt__cuda_layers_threads),
                                                mpt__cuda_layers_threads, 0, c->stream>>>(
        *g, dy, dx, argmax, total);
    mpt__cuda_launched(c, MAX ? "max pooling backward" : "average pooling backward");
}

/* Forward's and backward's one dispatch: calls launch(T(), V, MAX) with T
   the dtype's element type, V (std::integral_constant) the channels a
   thread handles (a 16-byte pack's where in, out and argmax allow it, else
   1) and MAX (std::true_type or std::false_type) the kind. */
template <typename F>
static void mpt__cuda_pool_dispatch(mpt_pool_kind kind, const mpt_window *g, mpt_dtype dtype,
                                    const void *in, const void *out, const int32_t *argmax,
                                    F &&launch) {
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        typedef std::integral_constant<int, 16 / (int)sizeof(T)> pack;
        typedef std::integral_constant<int, 1> one;
        const bool vec = mpt__cuda_pool_vectorizable<T>(g, in, out, argmax);
        if (kind == MPT_POOL_MAX) {
            if (vec) launch(tag, pack(), std::true_type());
            else launch(tag, one(), std::true_type());
        } else {
            if (vec) launch(tag, pack(), std::false_type());
            else launch(tag, one(), std::false_type());
        }
    });
}

/* ws is not needed (pool_workspace is 0). */
static void mpt__cuda_pool_forward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                                   mpt_dtype dtype, const void *x, void *y, int32_t *argmax,
                                   int64_t n, void *ws) {
    mpt__cuda *c = (mpt__cuda *)impl;
    (void)ws;
    mpt__cuda_pool_dispatch(kind, g, dtype, x, y, argmax, [&](auto tag, auto v, auto max) {
        typedef decltype(tag) T;
        mpt__cuda_pool_forward_typed<T, decltype(v)::value, decltype(max)::value>(
            c, g, (const T *)x, (T *)y, max ? argmax : NULL, n);
    });
}

static void mpt__cuda_pool_backward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                                    mpt_dtype dtype, const void *dy, void *dx,
                                    const int32_t *argmax, int64_t n, void *ws) {
    mpt__cuda *c = (mpt__cuda *)impl;
    (void)ws;
    mpt__cuda_pool_dispatch(kind, g, dtype, dy, dx, argmax, [&](auto tag, auto v, auto max) {
        typedef decltype(tag) T;
        mpt__cuda_pool_backward_typed<T, decltype(v)::value, decltype(max)::value>(
            c, g, (const T *)dy, (T *)dx, max ? argmax : NULL, n);
    });
}

static int64_t mpt__cuda_pool_workspace(void *impl, const mpt_window *g, int64_t n) {
    (void)impl;
    (void)g;
    (void)n;
    return 0;
}

/* ---- BatchNormalization ------------------------------------------------- */

/* Per-channel sums over the rows in two fixed-order stages: the rows are
   cut into chunks (their number depends only on `rows`); a block of 32
   channels × 8 row-threads sums one chunk (each thread its rows in order,
   then a tree over the 8 in shared memory) into part[chunk]; a second
   kernel adds the chunks in order, one thread per channel. Sums in double,
   as the CPU.

   Workspace: part (n_chunks, 2, C) doubles, then 4 (C) floats: scale
   (gamma · inv_std), inv_std, mean(dy), mean(dy · x̂). */

static const int64_t mpt__cuda_bn_chunk_rows_min = 256;
static const int64_t mpt__cuda_bn_chunks_max = 512;
static const int mpt__cuda_bn_tile_channels = 32;
static const int mpt__cuda_bn_tile_rows = 8;

static int64_t mpt__cuda_bn_chunks(int64_t rows) { /* non-decreasing in rows */
    int64_t k = (rows + mpt__cuda_bn_chunk_rows_min - 1) / mpt__cuda_bn_chunk_rows_min;
    return k < 1 ? 1 : k > mpt__cuda_bn_chunks_max ? mpt__cuda_bn_chunks_max : k;
}

typedef struct mpt__cuda_bn_ws {
    int64_t n_chunks, chunk_rows;
    double *part;
    float *scale, *inv_std, *mean_dy, *mean_dy_xhat;
} mpt__cuda_bn_ws;

/* The chunks of `rows`, and part at the workspace's start: all that
   LayerNormalization's column sums use of it. */
static mpt__cuda_bn_ws mpt__cuda_bn_chunking(int64_t rows, void *workspace) {
    mpt__cuda_bn_ws w;
    w.n_chunks = mpt__cuda_bn_chunks(rows);
    w.chunk_rows = (rows + w.n_chunks - 1) / w.n_chunks;
    w.part = (double *)workspace;
    w.scale = w.inv_std = w.mean_dy = w.mean_dy_xhat = NULL;
    return w;
}

static mpt__cuda_bn_ws mpt__cuda_bn_carve(const mpt_batchnorm_args *a) {
    mpt__cuda_bn_ws w = mpt__cuda_bn_chunking(a->rows, a->workspace);
    const int64_t C = a->channels;
    w.scale = (float *)(w.part + 2 * w.n_chunks * C);
    w.inv_std = w.scale + C;
    w.mean_dy = w.inv_std + C;
    w.mean_dy_xhat = w.mean_dy + C;
    return w;
}

static int64_t mpt__cuda_batchnorm_workspace(void *impl, mpt_dtype dtype, int64_t rows,
                                             int64_t channels) {
    (void)impl;
    (void)dtype;
    return 16 * mpt__cuda_bn_chunks(rows) * channels + 16 * channels;
}

enum {
    MPT__CUDA_BN_SUM_X,
    MPT__CUDA_BN_SUM_SQDEV,
    MPT__CUDA_BN_SUM_GRADS,
    MPT__CUDA_BN_SUM_ROW_GRADS /* LayerNormalization's dgamma and dbeta */
};

/* part[chunk][0][c] and part[chunk][1][c] for one chunk and 32 channels:
   SUM_X Σ x into slot 0; SUM_SQDEV Σ (x − mean)² into slot 1; SUM_GRADS
   Σ dy into 0 and Σ dy · x̂ into 1 (x̂ in float32, as the CPU, from the
   channel's mean and inv_std); SUM_ROW_GRADS the same with x̂ from the
   row's (mpt__ln_xhat's steps: a (rows, D) LayerNormalization's columns).
   grid (channel tiles, chunks), block (32, 8). */
template <typename T, int MODE>
static __global__ void __launch_bounds__(256)
    mpt__cuda_bn_partials_kernel(const T *x, const T *dy, int64_t rows, int64_t C,
                                 int64_t chunk_rows, const float *mean, const float *inv_std,
                                 double *part) {
    __shared__ double s0[mpt__cuda_bn_tile_rows][mpt__cuda_bn_tile_channels];
    __shared__ double s1[mpt__cuda_bn_tile_rows][mpt__cuda_bn_tile_channels];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t c = (int64_t)blockIdx.x * mpt__cuda_bn_tile_channels + tx;
    const int64_t chunk = blockIdx.y;
    const int64_t r_end = (chunk + 1) * chunk_rows < rows ? (chunk + 1) * chunk_rows : rows;
    double a0 = 0, a1 = 0;
    if (c < C) {
        const bool per_row = MODE == MPT__CUDA_BN_SUM_ROW_GRADS;
        float m = MODE == MPT__CUDA_BN_SUM_X || per_row ? 0.0f : mean[c];
        float is = MODE == MPT__CUDA_BN_SUM_GRADS ? inv_std[c] : 0.0f;
        for (int64_t r = chunk * chunk_rows + ty; r < r_end; r += mpt__cuda_bn_tile_rows) {
            const float v = mpt__cuda_layers_widen(x[r * C + c]);
            if (MODE == MPT__CUDA_BN_SUM_X) {
                a0 += (double)v;
            } else if (MODE == MPT__CUDA_BN_SUM_SQDEV) {
                const double d = (double)v - (double)m;
                a1 = __dadd_rn(a1, __dmul_rn(d, d));
            } else {
                const float g = mpt__cuda_layers_widen(dy[r * C + c]);
                if (per_row) {
                    m = mean[r];
                    is = inv_std[r];
                }
                const float xhat = __fmul_rn(v - m, is);
                a0 += (double)g;
                a1 = __dadd_rn(a1, __dmul_rn((double)g, (double)xhat));
            }
        }
    }
    s0[ty][tx] = a0;
    s1[ty][tx] = a1;
    __syncthreads();
    for (int half = mpt__cuda_bn_tile_rows / 2; half > 0; half >>= 1) {
        if (ty < half) {
            s0[ty][tx] += s0[ty + half][tx];
            s1[ty][tx] += s1[ty + half][tx];
        }
        __syncthreads();
    }
    if (ty == 0 && c < C) {
        double *p = part + 2 * chunk * C;
        if (MODE != MPT__CUDA_BN_SUM_SQDEV) p[c] = s0[0][tx];
        if (MODE != MPT__CUDA_BN_SUM_X) p[C + c] = s1[0][tx];
    }
}

/* Σ over chunks, in order, of part[chunk][which][c]. */
static __device__ __forceinline__ double mpt__cuda_bn_total(const double *part, int64_t n_chunks,
                                                            int which, int64_t C, int64_t c) {
    double s = 0;
    for (int64_t k = 0; k < n_chunks; k++) s += part[(2 * k + which) * C + c];
    return s;
}

/* out[c] = (float)(Σ part[.][which][c] / rows): the batch mean (which 0)
   or the biased variance (which 1). One thread per channel. */
static __global__ void __launch_bounds__(256)
    mpt__cuda_bn_stat_kernel(const double *part, int64_t n_chunks, int which, int64_t rows,
                             int64_t C, float *out) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c < C) out[c] = (float)(mpt__cuda_bn_total(part, n_chunks, which, C, c) / (double)rows);
}

/* inv_std = 1 / sqrt(var + eps) by mpt.h's mpt__bn_inv_std (the CPU's, in
   forward and backward); scale = gamma · inv_std in float32. */
static __global__ void __launch_bounds__(256)
    mpt__cuda_bn_scale_kernel(const float *var, const float *gamma, float eps, int64_t C,
                              float *inv_std, float *scale) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float is = mpt__bn_inv_std((double)var[c], eps);
    inv_std[c] = is;
    scale[c] = (gamma ? gamma[c] : 1.0f) * is;
}

/* dbeta = Σ dy, dgamma = Σ dy · x̂ (each when wanted), and their means. */
static __global__ void __launch_bounds__(256)
    mpt__cuda_bn_grad_stats_kernel(const double *part, int64_t n_chunks, int64_t rows, int64_t C,
                                   float *dbeta, float *dgamma, float *mean_dy, float *mean_dy_xhat,
                                   const float *sum_dy, const float *sum_dy_xhat,
                                   int64_t total_rows) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const double sdy = mpt__cuda_bn_total(part, n_chunks, 0, C, c);
    const double sdyx = mpt__cuda_bn_total(part, n_chunks, 1, C, c);
    if (dbeta) dbeta[c] = (float)sdy;
    if (dgamma) dgamma[c] = (float)sdyx;
    if (sum_dy) { /* synchronized: the means over every replica's rows */
        mean_dy[c] = (float)((double)sum_dy[c] / (double)total_rows);
        mean_dy_xhat[c] = (float)((double)sum_dy_xhat[c] / (double)total_rows);
    } else {
        mean_dy[c] = (float)(sdy / (double)rows);
        mean_dy_xhat[c] = (float)(sdyx / (double)rows);
    }
}

/* Elementwise passes over (rows, C): channel = index % C, stepped with a
   wrap inside a pack. */

/* y = (x − mean) · scale + beta, each step rounded in float32. */
template <typename T> struct mpt__cuda_bn_normalize_op {
    const T *x;
    T *y;
    int64_t C;
    const float *mean, *scale, *beta;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<T, N> in = mpt__cuda_layers_load<N>(x + i);
        mpt__cuda_layers_pack<T, N> out;
        int64_t c = i % C;
#pragma unroll
        for (int e = 0; e < N; e++) {
            const float v = __fmul_rn(mpt__cuda_layers_widen(in.v[e]) - mean[c], scale[c]);
            out.v[e] = mpt__cuda_layers_narrow<T>(__fadd_rn(v, beta ? beta[c] : 0.0f));
            if (++c == C) c = 0;
        }
        mpt__cuda_layers_store<N>(y + i, out);
    }
};

/* dx = scale · (dy − mean(dy) − x̂ · mean(dy · x̂)), x̂ = (x − mean) · inv_std. */
template <typename T> struct mpt__cuda_bn_dx_op {
    const T *x, *dy;
    T *dx;
    int64_t C;
    const float *mean, *inv_std, *scale, *mean_dy, *mean_dy_xhat;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<T, N> xv = mpt__cuda_layers_load<N>(x + i);
        mpt__cuda_layers_pack<T, N> dv = mpt__cuda_layers_load<N>(dy + i);
        mpt__cuda_layers_pack<T, N> out;
        int64_t c = i % C;
#pragma unroll
        for (int e = 0; e < N; e++) {
            const float xhat = __fmul_rn(mpt__cuda_layers_widen(xv.v[e]) - mean[c], inv_std[c]);
            const float t = mpt__cuda_layers_widen(dv.v[e]) - mean_dy[c];
            const float g = __fsub_rn(t, __fmul_rn(xhat, mean_dy_xhat[c]));
            out.v[e] = mpt__cuda_layers_narrow<T>(scale[c] * g);
            if (++c == C) c = 0;
        }
        mpt__cuda_layers_store<N>(dx + i, out);
    }
};

/* Launches the partial sums of one mode over x's (and dy's) rows of C
   channels into w->part. */
template <typename T, int MODE>
static void mpt__cuda_bn_partials(mpt__cuda *c, const void *x, const void *dy, int64_t rows,
                                  int64_t C, const mpt__cuda_bn_ws *w, const float *mean,
                                  const float *inv_std, const char *what) {
    const int64_t tiles = (C + mpt__cuda_bn_tile_channels - 1) / mpt__cuda_bn_tile_channels;
    dim3 grid((unsigned)tiles, (unsigned)w->n_chunks);
    dim3 block(mpt__cuda_bn_tile_channels, mpt__cuda_bn_tile_rows);
    mpt__cuda_bn_partials_kernel<T, MODE><<<grid, block, 0, c->stream>>>(
        (const T *)x, (const T *)dy, rows, C, w->chunk_rows, mean, inv_std, w->part);
    mpt__cuda_launched(c, what);
}

static unsigned mpt__cuda_bn_channel_blocks(int64_t C) {
    return mpt__cuda_blocks(C, mpt__cuda_layers_threads);
}

/* w->inv_std and w->scale from the variance var (forward's batch or
   moving one, backward's batch one). */
static void mpt__cuda_bn_scale(mpt__cuda *c, const mpt_batchnorm_args *a,
                               const mpt__cuda_bn_ws *w, const float *var) {
    const unsigned cb = mpt__cuda_bn_channel_blocks(a->channels);
    mpt__cuda_bn_scale_kernel<<<cb, mpt__cuda_layers_threads, 0, c->stream>>>(
        var, a->gamma, a->epsilon, a->channels, w->inv_std, w->scale);
    mpt__cuda_launched(c, "batchnorm scale");
}

/* The batch mean into a->mean, then Σ (x − mean)² with that (float) mean
   for the biased variance in a->variance (two passes, as the CPU). */
template <typename T>
static void mpt__cuda_bn_batch_stats(mpt__cuda *c, const mpt_batchnorm_args *a,
                                     const mpt__cuda_bn_ws *w) {
    const unsigned cb = mpt__cuda_bn_channel_blocks(a->channels);
    mpt__cuda_bn_partials<T, MPT__CUDA_BN_SUM_X>(c, a->x, a->dy, a->rows, a->channels, w, NULL,
                                                 NULL, "batchnorm sum");
    mpt__cuda_bn_stat_kernel<<<cb, mpt__cuda_layers_threads, 0, c->stream>>>(
        w->part, w->n_chunks, 0, a->rows, a->channels, a->mean);
    mpt__cuda_launched(c, "batchnorm mean");
    mpt__cuda_bn_partials<T, MPT__CUDA_BN_SUM_SQDEV>(c, a->x, a->dy, a->rows, a->channels, w,
                                                     a->mean, NULL,
                                                     "batchnorm squared deviations");
    mpt__cuda_bn_stat_kernel<<<cb, mpt__cuda_layers_threads, 0, c->stream>>>(
        w->part, w->n_chunks, 1, a->rows, a->channels, a->variance);
    mpt__cuda_launched(c, "batchnorm variance");
}

/* dbeta, dgamma and the means dx needs (w->mean_dy, w->mean_dy_xhat), with
   w->inv_std already made from the batch variance. */
template <typename T>
static void mpt__cuda_bn_grad_stats(mpt__cuda *c, const mpt_batchnorm_args *a,
                                    const mpt__cuda_bn_ws *w) {
    const unsigned cb = mpt__cuda_bn_channel_blocks(a->channels);
    mpt__cuda_bn_partials<T, MPT__CUDA_BN_SUM_GRADS>(c, a->x, a->dy, a->rows, a->channels, w,
                                                     a->mean, w->inv_std,
                                                     "batchnorm gradient sums");
    mpt__cuda_bn_grad_stats_kernel<<<cb, mpt__cuda_layers_threads, 0, c->stream>>>(
        w->part, w->n_chunks, a->rows, a->channels, a->dbeta, a->dgamma, w->mean_dy,
        w->mean_dy_xhat, a->sum_dy, a->sum_dy_xhat, a->total_rows);
    mpt__cuda_launched(c, "batchnorm gradient statistics");
}

/* Training: the batch statistics; inference: the moving ones. Then y. */
static void mpt__cuda_batchnorm_forward(void *impl, const mpt_batchnorm_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const mpt__cuda_bn_ws w = mpt__cuda_bn_carve(a);
    if (a->rows <= 0 || a->channels <= 0) return;
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        const float *mean = a->moving_mean, *var = a->moving_variance;
        if (a->training) {
            mpt__cuda_bn_batch_stats<T>(c, a, &w);
            mean = a->mean;
            var = a->variance;
        }
        mpt__cuda_bn_scale(c, a, &w, var);
        mpt__cuda_bn_normalize_op<T> op = {(const T *)a->x, (T *)a->y, a->channels,
                                           mean, w.scale, a->beta};
        bool vec = mpt__cuda_layers_aligned(a->x, 16) && mpt__cuda_layers_aligned(a->y, 16);
        mpt__cuda_layers_launch(c, op, a->rows * a->channels, vec, "batchnorm normalize");
    });
}

/* With the batch statistics of forward (a->mean, a->variance). */
static void mpt__cuda_batchnorm_backward(void *impl, const mpt_batchnorm_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const mpt__cuda_bn_ws w = mpt__cuda_bn_carve(a);
    if (a->rows <= 0 || a->channels <= 0) return;
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_bn_scale(c, a, &w, a->variance);
        mpt__cuda_bn_grad_stats<T>(c, a, &w);
        if (!a->dx) return;
        mpt__cuda_bn_dx_op<T> op = {(const T *)a->x, (const T *)a->dy, (T *)a->dx, a->channels,
                                    a->mean, w.inv_std, w.scale, w.mean_dy, w.mean_dy_xhat};
        bool vec = mpt__cuda_layers_aligned(a->x, 16) && mpt__cuda_layers_aligned(a->dy, 16) &&
                   mpt__cuda_layers_aligned(a->dx, 16);
        mpt__cuda_layers_launch(c, op, a->rows * a->channels, vec, "batchnorm dx");
    });
}

/* moving = moving · m + batch · (1 − m) in double, rounded to float; only
   after a step whose gradients were finite (read here, on the device). */
static __global__ void __launch_bounds__(256)
    mpt__cuda_bn_commit_kernel(const float *mean, const float *var, float *moving_mean,
                               float *moving_var, double momentum, int64_t C,
                               const mpt_step_state *state) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C || !state->finite) return;
    const double keep = 1 - momentum;
    moving_mean[c] = (float)__dadd_rn(__dmul_rn((double)moving_mean[c], momentum),
                                      __dmul_rn((double)mean[c], keep));
    moving_var[c] = (float)__dadd_rn(__dmul_rn((double)moving_var[c], momentum),
                                     __dmul_rn((double)var[c], keep));
}

static void mpt__cuda_batchnorm_commit(void *impl, const mpt_batchnorm_args *a,
                                       const mpt_step_state *state) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (a->channels <= 0) return;
    mpt__cuda_bn_commit_kernel<<<mpt__cuda_bn_channel_blocks(a->channels),
                                 mpt__cuda_layers_threads, 0, c->stream>>>(
        a->mean, a->variance, a->moving_mean, a->moving_variance, (double)a->momentum,
        a->channels, state);
    mpt__cuda_launched(c, "batchnorm commit");
}

/* ---- LayerNormalization ------------------------------------------------- */

/* One warp per row, 8 rows to a block of 32 × 8 threads, the rows in a
   grid-stride loop: each lane takes the row's columns lane, lane + 32, ...
   in order, summing in double, and a butterfly of shuffles adds the 32
   lanes' sums (each lane adds the same two numbers, so all hold the same
   total, whatever the launch). The per-element steps and the statistics'
   rounding are mpt.h's mpt__ln_* and mpt__bn_inv_std (@backend-shared),
   as the CPU's; only the order of the row sums differs from the CPU's.
   dgamma and dbeta, sums over every row, are BatchNormalization's column
   sums (mpt__cuda_bn_partials_kernel's SUM_ROW_GRADS, mpt__cuda_bn_total):
   chunks of rows (mpt__cuda_bn_chunks, a function of rows alone) by tiles
   of 32 columns into part, then the chunks added in order.

   Workspace: part (n_chunks, 2, D) doubles: Σ dy and Σ dy · x̂. */

static const int mpt__cuda_ln_rows_per_block = 8;

static int64_t mpt__cuda_layernorm_workspace(void *impl, mpt_dtype dtype, int64_t rows,
                                             int64_t cols) {
    (void)impl;
    (void)dtype;
    if (cols <= 0 || cols > INT64_MAX / (16 * mpt__cuda_bn_chunks_max)) return -1;
    return 16 * mpt__cuda_bn_chunks(rows) * cols;
}

/* Σ of the 32 lanes' v, in every lane. */
static __device__ __forceinline__ double mpt__cuda_ln_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* y, and each row's mean and inv_std. A warp's rows are the same for its
   32 lanes, so a warp leaves the loop whole (the shuffles need it). */
template <typename T>
static __global__ void __launch_bounds__(256)
    mpt__cuda_ln_forward_kernel(const T *x, T *y, int64_t rows, int64_t D, float eps,
                                const float *gamma, const float *beta, float *mean_out,
                                float *inv_std_out) {
    const int lane = threadIdx.x;
    for (int64_t r = (int64_t)blockIdx.x * mpt__cuda_ln_rows_per_block + threadIdx.y; r < rows;
         r += (int64_t)gridDim.x * mpt__cuda_ln_rows_per_block) {
        const T *xr = x + r * D;
        T *yr = y + r * D;
        double sum = 0, sq = 0;
        for (int64_t c = lane; c < D; c += 32)
            sum = __dadd_rn(sum, (double)mpt__cuda_layers_widen(xr[c]));
        const float mean = mpt__ln_row_mean(mpt__cuda_ln_warp_sum(sum), D);
        for (int64_t c = lane; c < D; c += 32) {
            const double d = __dsub_rn((double)mpt__cuda_layers_widen(xr[c]), (double)mean);
            sq = __dadd_rn(sq, __dmul_rn(d, d));
        }
        const float inv_std = mpt__ln_row_inv_std(mpt__cuda_ln_warp_sum(sq), D, eps);
        if (lane == 0) {
            mean_out[r] = mean;
            inv_std_out[r] = inv_std;
        }
        for (int64_t c = lane; c < D; c += 32) {
            const float xhat = mpt__ln_xhat(mpt__cuda_layers_widen(xr[c]), mean, inv_std);
            yr[c] = mpt__cuda_layers_narrow<T>(
                mpt__ln_output(xhat, gamma ? gamma[c] : 1.0f, beta ? beta[c] : 0.0f));
        }
    }
}

/* dx from the row's Σ ĝ and Σ ĝ · x̂, ĝ = dy · gamma. */
template <typename T>
static __global__ void __launch_bounds__(256)
    mpt__cuda_ln_dx_kernel(const T *x, const T *dy, T *dx, int64_t rows, int64_t D,
                           const float *gamma, const float *mean, const float *inv_std) {
    const int lane = threadIdx.x;
    for (int64_t r = (int64_t)blockIdx.x * mpt__cuda_ln_rows_per_block + threadIdx.y; r < rows;
         r += (int64_t)gridDim.x * mpt__cuda_ln_rows_per_block) {
        const T *xr = x + r * D, *dyr = dy + r * D;
        T *dxr = dx + r * D;
        const float m = mean[r], is = inv_std[r];
        double sum_g = 0, sum_gx = 0;
        for (int64_t c = lane; c < D; c += 32) {
            const float xhat = mpt__ln_xhat(mpt__cuda_layers_widen(xr[c]), m, is);
            const float g = mpt__fmul_rn(mpt__cuda_layers_widen(dyr[c]), gamma ? gamma[c] : 1.0f);
            sum_g = __dadd_rn(sum_g, (double)g);
            sum_gx = __dadd_rn(sum_gx, __dmul_rn((double)g, (double)xhat));
        }
        const float mean_g = mpt__ln_row_mean(mpt__cuda_ln_warp_sum(sum_g), D);
        const float mean_gx = mpt__ln_row_mean(mpt__cuda_ln_warp_sum(sum_gx), D);
        for (int64_t c = lane; c < D; c += 32) {
            const float xhat = mpt__ln_xhat(mpt__cuda_layers_widen(xr[c]), m, is);
            const float g = mpt__fmul_rn(mpt__cuda_layers_widen(dyr[c]), gamma ? gamma[c] : 1.0f);
            dxr[c] = mpt__cuda_layers_narrow<T>(mpt__ln_dx(g, xhat, mean_g, mean_gx, is));
        }
    }
}

/* dbeta = Σ dy, dgamma = Σ dy · x̂: the chunks added in order, one thread
   per column. */
static __global__ void __launch_bounds__(256)
    mpt__cuda_ln_param_grads_kernel(const double *part, int64_t n_chunks, int64_t D,
                                    float *dgamma, float *dbeta) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    if (dbeta) dbeta[c] = (float)mpt__cuda_bn_total(part, n_chunks, 0, D, c);
    if (dgamma) dgamma[c] = (float)mpt__cuda_bn_total(part, n_chunks, 1, D, c);
}

static unsigned mpt__cuda_ln_row_blocks(int64_t rows) {
    return mpt__cuda_blocks(rows, mpt__cuda_ln_rows_per_block);
}

static void mpt__cuda_layernorm_forward(void *impl, const mpt_layernorm_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (a->rows <= 0 || a->cols <= 0) return;
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_ln_forward_kernel<T><<<mpt__cuda_ln_row_blocks(a->rows),
                                         dim3(32, mpt__cuda_ln_rows_per_block), 0, c->stream>>>(
            (const T *)a->x, (T *)a->y, a->rows, a->cols, a->epsilon, a->gamma, a->beta,
            a->mean, a->inv_std);
        mpt__cuda_launched(c, "layernorm forward");
    });
}

/* With the rows' mean and inv_std of forward: dx, then dgamma and dbeta. */
static void mpt__cuda_layernorm_backward(void *impl, const mpt_layernorm_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (a->rows <= 0 || a->cols <= 0) return;
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        const int64_t D = a->cols;
        const mpt__cuda_bn_ws w = mpt__cuda_bn_chunking(a->rows, a->workspace);
        if (a->dx) {
            mpt__cuda_ln_dx_kernel<T><<<mpt__cuda_ln_row_blocks(a->rows),
                                        dim3(32, mpt__cuda_ln_rows_per_block), 0, c->stream>>>(
                (const T *)a->x, (const T *)a->dy, (T *)a->dx, a->rows, D, a->gamma, a->mean,
                a->inv_std);
            mpt__cuda_launched(c, "layernorm dx");
        }
        if (!a->dgamma && !a->dbeta) return;
        mpt__cuda_bn_partials<T, MPT__CUDA_BN_SUM_ROW_GRADS>(c, a->x, a->dy, a->rows, D, &w,
                                                         a->mean, a->inv_std,
                                                         "layernorm parameter gradient sums");
        mpt__cuda_ln_param_grads_kernel<<<mpt__cuda_blocks(D, mpt__cuda_layers_threads),
                                          mpt__cuda_layers_threads, 0, c->stream>>>(
            w.part, w.n_chunks, D, a->dgamma, a->dbeta);
        mpt__cuda_launched(c, "layernorm parameter gradients");
    });
}

/* ---- MultiHeadAttention's scaled dot-product attention ----------------------

   mpt_attention_args (mpt.h) for every sample b and head h at once; the
   CPU's @impl-attention-cpu is the reference. Three kernels of 128 threads,
   no atomics: every sum runs in an order fixed by the shapes alone, so two
   runs give the same bits. Rows are numbered r = (b·H + h)·Tq + i (query
   rows) and keys r = (b·H + h)·Tk + j, as dropout numbers the weights.

   forward, a block per query row (a grid-stride loop over them): the
   row's n scores (n keys seen: all Tk, or j <= i + causal_offset), each a
   dot product over key_dim taken by a group of G lanes (G the power of two
   covering max(key_dim, value_dim), at most 32: each lane its strided
   share with fmaf, then a butterfly of shuffles), times scale; the row's
   max (float) and Σ exp(s − max) (double), each thread its keys in order,
   then a butterfly per warp and the 4 warps in order; P from
   mpt__attn_weight, P̃ with dropout (mpt__attn_keep, the step read on the
   device from state->step, which one thread saves to *saved_step);
   O = P̃ · V. O's columns go to the threads; when value_dim < 128 each
   column's keys are split over 128 / value_dim threads (strided) whose
   sums are added in order.

   backward A, a block per query row: the scores, max and Σ again; P;
   dP̃_j = dO_i · V_j (a group's dot product), dP through the mask; the
   row's Σ P·dP (double); dS = mpt__attn_dscore; dQ_i = scale · dS · K (as
   O above). The row's max, 1/Σ and Σ P·dP go to the workspace for B.

   backward B, a block per key: the query rows that see key j (all, or
   i >= j − causal_offset) in order, mpt__cuda_attn_chunk at a time: each
   group computes P_ij and dS_ij from A's row statistics (the same dot
   products and rules as A, so the same bits), then each thread adds them
   into its columns, dK_j += dS_ij · q_i and dV_j += P̃_ij · dO_i, the
   rows in order; dK_j times scale at the end.

   Rounding, as the CPU's: scores, weights and products in float32 (Σ exp
   and Σ P·dP in double, rounded once); P̃ and dS rounded to dtype before
   they multiply (the CPU's GEMM operands); O rounded once to dtype; dQ,
   dK, dV float32. Only the order of the float32 sums (and CUDA's expf,
   within 2 ulps of glibc's) differ from the CPU.

   A row's scores (forward) or its P and dP (backward A) stay in shared
   memory while the last query sees at most mpt__cuda_attn_smem_keys keys;
   past that they go to the workspace, one slot per block, and the grid
   has mpt__cuda_attn_slots(c) blocks. Workspace: the row statistics
   (B·H·Tq × 3 floats), then the slots when needed. Backward reads nothing
   forward left there. */

static const int mpt__cuda_attn_threads = 128;
static const int64_t mpt__cuda_attn_smem_keys = 4096; /* two rows of them: 32 KiB */
static const int mpt__cuda_attn_chunk = 32;           /* backward B's rows at a time */

/* The shapes and constants every attention kernel reads. */
typedef struct mpt__cuda_attn_shape {
    int64_t batch, heads, q_len, kv_len, key_dim, value_dim, causal_offset;
    int64_t most_keys;  /* the keys the last query sees: a row buffer's floats */
    int causal, dropout;
    int group;          /* G: lanes per dot product                           */
    float scale, rate, keep_scale;
    uint64_t key;
} mpt__cuda_attn_shape;

/* The keys query i sees (none where a negative offset leaves none). */
static __host__ __device__ __forceinline__ int64_t mpt__cuda_attn_keys(int64_t i, int64_t kv_len,
                                                                       int causal, int64_t offset) {
    const int64_t n = mpt__attn_keys_seen(i, kv_len, causal, offset);
    return n > 0 ? n : 0;
}

/* x · y over n elements by a group's G lanes (lane l: l, l + G, ..., with
   fmaf), then a butterfly inside the group, so each of its lanes holds the
   same sum. Every lane of the warp calls it; an inactive group adds zeros. */
template <typename T>
static __device__ __forceinline__ float mpt__cuda_attn_dot(const T *x, const T *y, int64_t n,
                                                           bool active, int lane, int G) {
    float s = 0;
    if (active)
        for (int64_t d = lane; d < n; d += G)
            s = fmaf(mpt__cuda_layers_widen(x[d]), mpt__cuda_layers_widen(y[d]), s);
    for (int o = G / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
}

/* The block's Σ of v (double) and max of v (float, NaN ignored as the
   CPU's comparison ignores it), in every thread: a butterfly per warp,
   then the warps in order. The whole block calls them. */
static __device__ double mpt__cuda_attn_block_sum(double v, double *red) {
    v = mpt__cuda_ln_warp_sum(v);
    __syncthreads(); /* red's last readers are done */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    double total = 0;
    for (int w = 0; w < mpt__cuda_attn_threads / 32; w++) total = __dadd_rn(total, red[w]);
    return total;
}
static __device__ float mpt__cuda_attn_block_max(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float most = -INFINITY;
    for (int w = 0; w < mpt__cuda_attn_threads / 32; w++) most = fmaxf(most, red[w]);
    return most;
}

/* row[j] = scale · (q_i · k_j) for the n keys, each by one group. */
template <typename T>
static __device__ void mpt__cuda_attn_scores(const mpt__cuda_attn_shape &s, const T *qi,
                                             const T *k0, int64_t n, float *row) {
    const int G = s.group, lane = threadIdx.x % G, group = threadIdx.x / G;
    const int groups = mpt__cuda_attn_threads / G;
    const int64_t ld = s.heads * s.key_dim;
    for (int64_t base = 0; base < n; base += groups) { /* the same trips in every lane */
        const int64_t j = base + group;
        const float dot = mpt__cuda_attn_dot(qi, j < n ? k0 + j * ld : k0, s.key_dim, j < n,
                                             lane, G);
        if (j < n && lane == 0) row[j] = mpt__fmul_rn(dot, s.scale);
    }
}

/* out_d = Σ_{j<n} w[j] · m[j·ld + d] for d < width, in float32, handed to
   store(d, out_d). width >= 128: a thread per column, the keys in order.
   Narrower: each column's keys split over parts = 128 / width threads
   (thread p: j = p, p + parts, ...), their sums added in order through
   part (128 floats of shared memory). The whole block calls it. */
template <typename T, typename Store>
static __device__ void mpt__cuda_attn_row_times(const float *w, int64_t n, const T *m, int64_t ld,
                                                int64_t width, float *part, const Store &store) {
    const int t = threadIdx.x;
    if (width >= mpt__cuda_attn_threads) {
        for (int64_t d = t; d < width; d += mpt__cuda_attn_threads) {
            float acc = 0;
            for (int64_t j = 0; j < n; j++)
                acc = fmaf(w[j], mpt__cuda_layers_widen(m[j * ld + d]), acc);
            store(d, acc);
        }
        return;
    }
    const int parts = mpt__cuda_attn_threads / (int)width, d = t % (int)width, p = t / (int)width;
    float acc = 0;
    if (p < parts)
        for (int64_t j = p; j < n; j += parts)
            acc = fmaf(w[j], mpt__cuda_layers_widen(m[j * ld + d]), acc);
    __syncthreads(); /* part's last readers are done */
    if (p < parts) part[p * width + d] = acc;
    __syncthreads();
    if (t < width) {
        float sum = 0;
        for (int k = 0; k < parts; k++) sum = __fadd_rn(sum, part[k * width + t]);
        store(t, sum);
    }
}

/* A float32 value rounded to T and back: the CPU's GEMM operand. */
template <typename T> static __device__ __forceinline__ float mpt__cuda_attn_operand(float v) {
    return mpt__cuda_layers_widen(mpt__cuda_layers_narrow<T>(v));
}

template <typename T> struct mpt__cuda_attn_store_o {
    T *o;
    __device__ void operator()(int64_t d, float v) const { o[d] = mpt__cuda_layers_narrow<T>(v); }
};
struct mpt__cuda_attn_store_dq {
    float *dq;
    float scale;
    __device__ void operator()(int64_t d, float v) const { dq[d] = mpt__fmul_rn(scale, v); }
};

/* Query row r: where its row of q (o, d_o, dq) and row 0 of its k (v)
   are, its n keys, and its softmax's max and 1 / Σ exp(s − max) over
   its scores s. */
struct mpt__cuda_attn_query {
    int64_t q_at, kv_at, n;
    float most, inv_sum;
};

/* Query row r's scores into row (mpt__cuda_attn_scores) and its softmax
   statistics, each thread its keys in order, then the block's max and sum
   (red_max, red). The whole block calls it. */
template <typename T>
static __device__ __forceinline__ mpt__cuda_attn_query
mpt__cuda_attn_softmax_row(const mpt__cuda_attn_shape &s, const T *q, const T *k, int64_t r,
                           float *row, float *red_max, double *red) {
    mpt__cuda_attn_query a;
    const int t = threadIdx.x;
    const int64_t i = r % s.q_len, b = r / s.q_len / s.heads, h = r / s.q_len % s.heads;
    a.q_at = (b * s.q_len + i) * s.heads + h;
    a.kv_at = b * s.kv_len * s.heads + h;
    a.n = mpt__cuda_attn_keys(i, s.kv_len, s.causal, s.causal_offset);
    mpt__cuda_attn_scores(s, q + a.q_at * s.key_dim, k + a.kv_at * s.key_dim, a.n, row);
    __syncthreads();
    float most = -INFINITY;
    for (int64_t j = t; j < a.n; j += mpt__cuda_attn_threads) most = fmaxf(most, row[j]);
    a.most = mpt__cuda_attn_block_max(most, red_max);
    double sum = 0;
    for (int64_t j = t; j < a.n; j += mpt__cuda_attn_threads)
        sum = __dadd_rn(sum, (double)expf(mpt__fsub_rn(row[j], a.most)));
    a.inv_sum = (float)(1.0 / mpt__cuda_attn_block_sum(sum, red));
    return a;
}

/* Forward; slots: the workspace's rows (NULL: shared memory holds them). */
template <typename T>
static __global__ void __launch_bounds__(128)
    mpt__cuda_attn_forward_kernel(mpt__cuda_attn_shape s, const T *q, const T *k, const T *v,
                                  T *o, const int64_t *step_src, int64_t *step_save,
                                  float *slots) {
    extern __shared__ float mpt__cuda_attn_rows[];
    __shared__ float part[mpt__cuda_attn_threads], red_max[mpt__cuda_attn_threads / 32];
    __shared__ double red[mpt__cuda_attn_threads / 32];
    const uint64_t step = step_src ? (uint64_t)*step_src : 0;
    if (step_save && blockIdx.x == 0 && threadIdx.x == 0) *step_save = (int64_t)step;
    float *row = slots ? slots + (int64_t)blockIdx.x * 2 * s.most_keys : mpt__cuda_attn_rows;
    const int64_t rows = s.batch * s.heads * s.q_len;
    const int t = threadIdx.x;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const mpt__cuda_attn_query a = mpt__cuda_attn_softmax_row(s, q, k, r, row, red_max, red);
        const int64_t n = a.n;
        for (int64_t j = t; j < n; j += mpt__cuda_attn_threads) {
            float p = mpt__attn_weight(row[j], a.most, a.inv_sum);
            if (s.dropout)
                p = mpt__attn_keep(s.key, step, s.rate, (uint64_t)(r * s.kv_len + j))
                        ? mpt__fmul_rn(p, s.keep_scale)
                        : 0.0f;
            row[j] = mpt__cuda_attn_operand<T>(p);
        }
        __syncthreads();
        mpt__cuda_attn_store_o<T> store = {o + a.q_at * s.value_dim};
        mpt__cuda_attn_row_times(row, n, v + a.kv_at * s.value_dim, s.heads * s.value_dim,
                                 s.value_dim, part, store);
        __syncthreads(); /* row is the next row's */
    }
}

/* Backward A: dQ, and each query row's max, 1/Σ and Σ P·dP into stats. */
template <typename T>
static __global__ void __launch_bounds__(128)
    mpt__cuda_attn_rows_backward_kernel(mpt__cuda_attn_shape s, const T *q, const T *k,
                                        const T *v, const T *d_o, float *dq,
                                        const int64_t *step_src, float *stats, float *slots) {
    extern __shared__ float mpt__cuda_attn_rows[];
    __shared__ float part[mpt__cuda_attn_threads], red_max[mpt__cuda_attn_threads / 32];
    __shared__ double red[mpt__cuda_attn_threads / 32];
    const uint64_t step = step_src ? (uint64_t)*step_src : 0;
    float *pr = slots ? slots + (int64_t)blockIdx.x * 2 * s.most_keys : mpt__cuda_attn_rows;
    float *dpr = pr + s.most_keys;
    const int64_t rows = s.batch * s.heads * s.q_len, vld = s.heads * s.value_dim;
    const int t = threadIdx.x, G = s.group, lane = t % G, group = t / G;
    const int groups = mpt__cuda_attn_threads / G;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const mpt__cuda_attn_query a = mpt__cuda_attn_softmax_row(s, q, k, r, pr, red_max, red);
        const int64_t n = a.n;
        const T *doi = d_o + a.q_at * s.value_dim, *v0 = v + a.kv_at * s.value_dim;
        /* P, and dP = dO_i · V_j through the forward's mask */
        for (int64_t base = 0; base < n; base += groups) {
            const int64_t j = base + group;
            const float dpt = mpt__cuda_attn_dot(doi, j < n ? v0 + j * vld : v0, s.value_dim,
                                                 j < n, lane, G);
            if (j < n && lane == 0) {
                const float p = mpt__attn_weight(pr[j], a.most, a.inv_sum);
                float dp = dpt;
                if (s.dropout)
                    dp = p != 0 && mpt__attn_keep(s.key, step, s.rate, (uint64_t)(r * s.kv_len + j))
                             ? mpt__fmul_rn(dpt, s.keep_scale)
                             : 0.0f;
                pr[j] = p;
                dpr[j] = dp;
            }
        }
        __syncthreads();
        double dot = 0;
        for (int64_t j = t; j < n; j += mpt__cuda_attn_threads)
            dot = __dadd_rn(dot, __dmul_rn((double)pr[j], (double)dpr[j]));
        const float row_dot = (float)mpt__cuda_attn_block_sum(dot, red);
        for (int64_t j = t; j < n; j += mpt__cuda_attn_threads)
            dpr[j] = mpt__cuda_attn_operand<T>(mpt__attn_dscore(pr[j], dpr[j], row_dot));
        __syncthreads();
        mpt__cuda_attn_store_dq store = {dq + a.q_at * s.key_dim, s.scale};
        mpt__cuda_attn_row_times(dpr, n, k + a.kv_at * s.key_dim, s.heads * s.key_dim, s.key_dim,
                                 part, store);
        if (t == 0) {
            stats[3 * r] = a.most;
            stats[3 * r + 1] = a.inv_sum;
            stats[3 * r + 2] = row_dot;
        }
        __syncthreads(); /* pr, dpr are the next row's */
    }
}

/* Backward B: dK and dV, a key at a time, from A's row statistics. */
template <typename T>
static __global__ void __launch_bounds__(128)
    mpt__cuda_attn_keys_backward_kernel(mpt__cuda_attn_shape s, const T *q, const T *k,
                                        const T *v, const T *d_o, float *dk, float *dv,
                                        const int64_t *step_src, const float *stats) {
    __shared__ float pt[mpt__cuda_attn_chunk], ds[mpt__cuda_attn_chunk];
    const uint64_t step = step_src ? (uint64_t)*step_src : 0;
    const int64_t keys = s.batch * s.heads * s.kv_len;
    const int64_t qld = s.heads * s.key_dim, vld = s.heads * s.value_dim;
    const int t = threadIdx.x, G = s.group, lane = t % G, group = t / G;
    const int groups = mpt__cuda_attn_threads / G;
    for (int64_t r = blockIdx.x; r < keys; r += gridDim.x) {
        const int64_t j = r % s.kv_len, bh = r / s.kv_len, b = bh / s.heads, h = bh % s.heads;
        const int64_t kv_at = (b * s.kv_len + j) * s.heads + h;
        const T *kj = k + kv_at * s.key_dim, *vj = v + kv_at * s.value_dim;
        const T *q0 = q + (b * s.q_len * s.heads + h) * s.key_dim;
        const T *do0 = d_o + (b * s.q_len * s.heads + h) * s.value_dim;
        float *dkj = dk + kv_at * s.key_dim, *dvj = dv + kv_at * s.value_dim;
        /* the rows that see key j: i + offset + 1 > j */
        int64_t first = s.causal ? j - s.causal_offset : 0;
        if (first < 0) first = 0;
        for (int64_t d = t; d < s.key_dim; d += mpt__cuda_attn_threads) dkj[d] = 0;
        for (int64_t d = t; d < s.value_dim; d += mpt__cuda_attn_threads) dvj[d] = 0;
        for (int64_t i0 = first; i0 < s.q_len; i0 += mpt__cuda_attn_chunk) {
            const int64_t here = s.q_len - i0 < mpt__cuda_attn_chunk ? s.q_len - i0
                                                                      : mpt__cuda_attn_chunk;
            for (int c0 = 0; c0 < mpt__cuda_attn_chunk; c0 += groups) {
                const int c = c0 + group;
                const bool on = c < here;
                const int64_t i = i0 + c, row = bh * s.q_len + i;
                const float sd = mpt__cuda_attn_dot(on ? q0 + i * qld : q0, kj, s.key_dim, on,
                                                    lane, G);
                const float dpt = mpt__cuda_attn_dot(on ? do0 + i * vld : do0, vj, s.value_dim,
                                                     on, lane, G);
                if (on && lane == 0) {
                    const float *st = stats + 3 * row;
                    const float p = mpt__attn_weight(mpt__fmul_rn(sd, s.scale), st[0], st[1]);
                    float kept = p, dp = dpt;
                    if (s.dropout) {
                        const int keep =
                            mpt__attn_keep(s.key, step, s.rate, (uint64_t)(row * s.kv_len + j));
                        kept = keep ? mpt__fmul_rn(p, s.keep_scale) : 0.0f;
                        dp = p != 0 && keep ? mpt__fmul_rn(dpt, s.keep_scale) : 0.0f;
                    }
                    pt[c] = mpt__cuda_attn_operand<T>(kept);
                    ds[c] = mpt__cuda_attn_operand<T>(mpt__attn_dscore(p, dp, st[2]));
                }
            }
            __syncthreads();
            for (int64_t d = t; d < s.key_dim; d += mpt__cuda_attn_threads) {
                float acc = dkj[d];
                for (int c = 0; c < here; c++)
                    acc = fmaf(ds[c], mpt__cuda_layers_widen(q0[(i0 + c) * qld + d]), acc);
                dkj[d] = acc;
            }
            for (int64_t d = t; d < s.value_dim; d += mpt__cuda_attn_threads) {
                float acc = dvj[d];
                for (int c = 0; c < here; c++)
                    acc = fmaf(pt[c], mpt__cuda_layers_widen(do0[(i0 + c) * vld + d]), acc);
                dvj[d] = acc;
            }
            __syncthreads(); /* pt, ds are the next chunk's */
        }
        for (int64_t d = t; d < s.key_dim; d += mpt__cuda_attn_threads)
            dkj[d] = mpt__fmul_rn(s.scale, dkj[d]);
    }
}

/* The slots of the workspace path: blocks in flight, a few per SM. */
static int64_t mpt__cuda_attn_slots(const mpt__cuda *c) {
    return 4 * (int64_t)(c->sm_count > 0 ? c->sm_count : 1);
}

static int64_t mpt__cuda_attn_most_keys(const mpt_attention_args *a) {
    return a->q_len > 0
               ? mpt__cuda_attn_keys(a->q_len - 1, a->kv_len, a->causal, a->causal_offset)
               : 0;
}

/* x · y into *out unless it overflows (both >= 0). */
static bool mpt__cuda_attn_mul(int64_t x, int64_t y, int64_t *out) {
    if (x < 0 || y < 0 || (y > 0 && x > INT64_MAX / y)) return false;
    *out = x * y;
    return true;
}

/* The workspace's parts: the row statistics' bytes (rounded up to 256)
   and the slots' (0 when shared memory holds the rows); false on
   overflow. */
static bool mpt__cuda_attn_plan(const mpt__cuda *c, const mpt_attention_args *a,
                                int64_t *stats_bytes, int64_t *slot_bytes) {
    int64_t rows, n = mpt__cuda_attn_most_keys(a);
    if (!mpt__cuda_attn_mul(a->batch, a->heads, &rows) ||
        !mpt__cuda_attn_mul(rows, a->q_len, &rows) || !mpt__cuda_attn_mul(rows, 12, &rows) ||
        rows > INT64_MAX - 255)
        return false;
    *stats_bytes = (rows + 255) / 256 * 256;
    *slot_bytes = 0;
    return n <= mpt__cuda_attn_smem_keys ||
           (mpt__cuda_attn_mul(mpt__cuda_attn_slots(c), 8, slot_bytes) &&
            mpt__cuda_attn_mul(*slot_bytes, n, slot_bytes));
}

static int64_t mpt__cuda_attention_workspace(void *impl, const mpt_attention_args *a) {
    int64_t stats, slots;
    if (!mpt__cuda_attn_plan((const mpt__cuda *)impl, a, &stats, &slots) ||
        stats > INT64_MAX - slots)
        return -1;
    return stats + slots;
}

static mpt__cuda_attn_shape mpt__cuda_attn_shape_of(const mpt_attention_args *a, int dropout) {
    mpt__cuda_attn_shape s;
    int64_t widest = a->key_dim > a->value_dim ? a->key_dim : a->value_dim;
    memset(&s, 0, sizeof s);
    s.batch = a->batch;
    s.heads = a->heads;
    s.q_len = a->q_len;
    s.kv_len = a->kv_len;
    s.key_dim = a->key_dim;
    s.value_dim = a->value_dim;
    s.causal_offset = a->causal_offset;
    s.most_keys = mpt__cuda_attn_most_keys(a);
    s.causal = a->causal;
    s.dropout = dropout;
    for (s.group = 1; s.group < 32 && s.group < widest;) s.group *= 2;
    s.scale = a->scale;
    s.rate = a->dropout;
    s.keep_scale = 1.0f / (1.0f - a->dropout); /* in float, as the CPU */
    s.key = a->dropout_key;
    return s;
}

/* The grid and the rows' home of a kernel over `rows` query rows keeping
   `buffers` rows of keys each: shared memory (bytes in *smem, *slots
   NULL), or the workspace's slots past the statistics. */
static unsigned mpt__cuda_attn_grid(const mpt__cuda *c, const mpt_attention_args *a,
                                    int64_t rows, int buffers, size_t *smem, float **slots) {
    const int64_t n = mpt__cuda_attn_most_keys(a);
    int64_t stats = 0, slot_bytes = 0;
    *smem = 0;
    *slots = NULL;
    if (n <= mpt__cuda_attn_smem_keys) {
        *smem = (size_t)(buffers * n) * sizeof(float);
        return mpt__cuda_blocks(rows, 1);
    }
    (void)mpt__cuda_attn_plan(c, a, &stats, &slot_bytes);
    *slots = (float *)((char *)a->workspace + stats);
    return (unsigned)(rows < mpt__cuda_attn_slots(c) ? rows : mpt__cuda_attn_slots(c));
}

static void mpt__cuda_attention_forward(void *impl, const mpt_attention_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    /* dropout in training only (state), as the CPU; the step kept for backward */
    const int dropout = a->dropout > 0 && a->state && a->saved_step;
    const int64_t rows = a->batch * a->heads * a->q_len;
    if (rows <= 0 || a->key_dim <= 0 || a->value_dim <= 0) {
        if (dropout)
            mpt__cuda_layers_copy(c, a->saved_step, &a->state->step, sizeof(int64_t),
                                  "attention forward (step)");
        return;
    }
    const mpt__cuda_attn_shape s = mpt__cuda_attn_shape_of(a, dropout);
    size_t smem;
    float *slots;
    const unsigned grid = mpt__cuda_attn_grid(c, a, rows, 1, &smem, &slots);
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_attn_forward_kernel<T><<<grid, mpt__cuda_attn_threads, smem, c->stream>>>(
            s, (const T *)a->q, (const T *)a->k, (const T *)a->v, (T *)a->o,
            dropout ? &a->state->step : NULL, dropout ? a->saved_step : NULL, slots);
        mpt__cuda_launched(c, "attention forward");
    });
}

/* dQ by query rows (A), then dK and dV by keys (B) from A's statistics. */
static void mpt__cuda_attention_backward(void *impl, const mpt_attention_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const int dropout = a->dropout > 0 && a->saved_step; /* the forward's mask */
    const int64_t rows = a->batch * a->heads * a->q_len, keys = a->batch * a->heads * a->kv_len;
    if (a->key_dim <= 0 || a->value_dim <= 0) return;
    const mpt__cuda_attn_shape s = mpt__cuda_attn_shape_of(a, dropout);
    const int64_t *step = dropout ? a->saved_step : NULL;
    float *stats = (float *)a->workspace;
    mpt__cuda_layers_dispatch(a->dtype, [&](auto tag) {
        typedef decltype(tag) T;
        if (rows > 0) {
            size_t smem;
            float *slots;
            const unsigned grid = mpt__cuda_attn_grid(c, a, rows, 2, &smem, &slots);
            mpt__cuda_attn_rows_backward_kernel<T>
                <<<grid, mpt__cuda_attn_threads, smem, c->stream>>>(
                    s, (const T *)a->q, (const T *)a->k, (const T *)a->v, (const T *)a->d_o,
                    a->dq, step, stats, slots);
            mpt__cuda_launched(c, "attention backward (dq)");
        }
        if (keys > 0) {
            mpt__cuda_attn_keys_backward_kernel<T>
                <<<mpt__cuda_blocks(keys, 1), mpt__cuda_attn_threads, 0, c->stream>>>(
                    s, (const T *)a->q, (const T *)a->k, (const T *)a->v, (const T *)a->d_o,
                    a->dk, a->dv, step, stats);
            mpt__cuda_launched(c, "attention backward (dk, dv)");
        }
    });
}

/* ---- Dropout ------------------------------------------------------------ */

/* out[i] = in[i] · scale where uniform01(word i%4 of philox(key, step, i/4))
   ≥ rate, else 0. The step is read on the device: from state->step in
   forward, which one thread also saves into *step_save for backward; from
   the saved step in backward (step_save NULL). */
template <typename T> struct mpt__cuda_dropout_op {
    uint64_t key, step;
    float rate, scale;
    const T *in;
    T *out;
    __device__ __forceinline__ T keep_or_drop(uint32_t bits, T v) const {
        const float u = mpt__uniform01(bits);
        return mpt__cuda_layers_narrow<T>(u >= rate ? mpt__cuda_layers_widen(v) * scale : 0.0f);
    }
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<T, N> v = mpt__cuda_layers_load<N>(in + i);
        uint32_t r[4];
        if constexpr (N == 1) {
            mpt__philox4x32_10(key, step, (uint64_t)i / 4, r);
            const int w = (int)(i & 3);
            v.v[0] = keep_or_drop(w == 0 ? r[0] : w == 1 ? r[1] : w == 2 ? r[2] : r[3], v.v[0]);
        } else { /* i is a multiple of N, N of 4: whole groups of four */
#pragma unroll
            for (int g = 0; g < N / 4; g++) {
                mpt__philox4x32_10(key, step, (uint64_t)i / 4 + g, r);
#pragma unroll
                for (int k = 0; k < 4; k++) v.v[4 * g + k] = keep_or_drop(r[k], v.v[4 * g + k]);
            }
        }
        mpt__cuda_layers_store<N>(out + i, v);
    }
};

template <typename T>
static __global__ void __launch_bounds__(256)
    mpt__cuda_dropout_kernel(mpt__cuda_dropout_op<T> op, int64_t n, int vectorized,
                             const int64_t *step_src, int64_t *step_save) {
    op.step = (uint64_t)*step_src;
    if (step_save && blockIdx.x == 0 && threadIdx.x == 0) *step_save = (int64_t)op.step;
    mpt__cuda_layers_for_each(op, n, vectorized);
}

static void mpt__cuda_dropout(void *impl, uint64_t key, float rate, mpt_dtype dtype,
                              const void *in, void *out, int64_t n, const mpt_step_state *state,
                              int64_t *saved_step, void *ws) {
    mpt__cuda *c = (mpt__cuda *)impl;
    (void)ws;
    if (rate == 0 || n <= 0) { /* the identity; forward still saves the step, as the CPU */
        if (state)
            mpt__cuda_layers_copy(c, saved_step, &state->step, sizeof(int64_t), "dropout (step)");
        if (n > 0)
            mpt__cuda_layers_copy(c, out, in, (size_t)n * mpt_dtype_size(dtype), "dropout (copy)");
        return;
    }
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_dropout_op<T> op;
        op.key = key;
        op.step = 0; /* read on the device */
        op.rate = rate;
        op.scale = 1.0f / (1.0f - rate); /* in float, as the CPU */
        op.in = (const T *)in;
        op.out = (T *)out;
        const bool vec = mpt__cuda_layers_aligned(in, 16) && mpt__cuda_layers_aligned(out, 16);
        const int64_t units = vec ? n / mpt__cuda_layers_vec + n % mpt__cuda_layers_vec : n;
        const int64_t *step_src = state ? &state->step : saved_step;
        mpt__cuda_dropout_kernel<T><<<mpt__cuda_blocks(units, mpt__cuda_layers_threads),
                                      mpt__cuda_layers_threads, 0, c->stream>>>(
            op, n, vec ? 1 : 0, step_src, state ? saved_step : NULL);
        mpt__cuda_launched(c, state ? "dropout" : "dropout backward");
    });
}

/* ---- the merge layers' arithmetic (mpt.h's @impl-merge) -------------------- */

/* y = a op b, element by element: mpt.h's mpt__elementwise_rule in float32,
   rounded to T once, as the CPU backend. y may be a or b. */
template <typename T> struct mpt__cuda_elementwise_op {
    mpt_elementwise_op op;
    float alpha;
    const T *a, *b; /* b NULL where op reads one operand */
    T *y;
    template <int N> __device__ __forceinline__ void run(int64_t i) const {
        mpt__cuda_layers_pack<T, N> va = mpt__cuda_layers_load<N>(a + i), vb = va;
        if (b) vb = mpt__cuda_layers_load<N>(b + i);
#pragma unroll
        for (int k = 0; k < N; k++)
            va.v[k] = mpt__cuda_layers_narrow<T>(
                mpt__elementwise_rule(op, mpt__cuda_layers_widen(va.v[k]),
                                      b ? mpt__cuda_layers_widen(vb.v[k]) : 0.0f, alpha));
        mpt__cuda_layers_store<N>(y + i, va);
    }
};

static void mpt__cuda_elementwise(void *impl, mpt_elementwise_op op, mpt_dtype dtype, void *y,
                                  const void *a, const void *b, float alpha, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const bool two = op == MPT_ELEMENTWISE_ADD || op == MPT_ELEMENTWISE_SUBTRACT ||
                     op == MPT_ELEMENTWISE_MULTIPLY;
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_elementwise_op<T> e;
        e.op = op;
        e.alpha = alpha;
        e.a = (const T *)a;
        e.b = two ? (const T *)b : NULL;
        e.y = (T *)y;
        const bool vec = mpt__cuda_layers_aligned(y, 16) && mpt__cuda_layers_aligned(a, 16) &&
                         (!two || mpt__cuda_layers_aligned(b, 16));
        mpt__cuda_layers_launch(c, e, n, vec, "elementwise");
    });
}

/* =============================================================================
   @cuda-training  Training: the loss, the optimizer's passes, loss scaling
   ============================================================================= */

/* The training kernels of the CUDA backend: the loss with its metrics, the
   optimizer's two passes (sum of squares, fused update) and loss scaling.

   Everything a step decides (the learning rate, the clipping factor, Adam's
   bias correction, whether the gradients are finite, the new loss scale)
   is computed on the device from the mpt_step_state the backend keeps
   there, so a whole step can be recorded once in a CUDA graph and replayed:
   the host never reads a device value here, and nothing is allocated after
   mpt__cuda_train_init.

   Determinism: no atomics. Every reduction has a fixed shape (grids sized
   from the element counts alone, fixed per-thread strides, fixed trees),
   so a result repeats bit for bit on the same GPU. The element-wise float
   math uses the round-to-nearest intrinsics (__fmul_rn, __fadd_rn, ...) so
   that the compiler cannot contract a multiply and an add into an FMA:
   each operation rounds where the CPU's does, and an update gives the CPU's
   bits (the transcendental functions of the loss may differ in the last
   place from the C library's, and sums are taken in another order). */


/* ---- sizes ---------------------------------------------------------------- */

static constexpr int mpt__cuda_train_threads = 256;                       /* every kernel's block */
static constexpr int mpt__cuda_train_warps = mpt__cuda_train_threads / 32;
static constexpr int mpt__cuda_loss_max_blocks = 1024;      /* loss partials               */
static constexpr int64_t mpt__cuda_norm_min_per_block = 8192; /* gradients per norm block  */
static constexpr int64_t mpt__cuda_norm_max_blocks = 1024;  /* norm blocks per tensor      */
static constexpr int mpt__cuda_norm_slots = 8192;           /* norm partials held at once  */
static constexpr int mpt__cuda_tensors_per_launch = 48;     /* multi-tensor tables         */

/* ---- device scratch -------------------------------------------------------- */

/* One loss block's sums over its rows. */
typedef struct mpt__cuda_loss_partial {
    double loss, correct, top_k;
    mpt__value_sums values; /* sums over output values (mpt.h's mpt__value_add) */
    mpt__weighted_sums weighted; /* weighted_metrics' (mpt.h's mpt__weighted_add) */
} mpt__cuda_loss_partial;

/* Device buffers of the training kernels, allocated once per backend. */
typedef struct mpt__cuda_train_scratch {
    void *base;                            /* the one allocation              */
    double *norm_partials;                 /* (mpt__cuda_norm_slots)          */
    double *norm_carry;                    /* Σ of partials already folded    */
    mpt__cuda_loss_partial *loss_partials; /* (mpt__cuda_loss_max_blocks)     */
    mpt__update_coefs *coefs;              /* mpt.h's mpt__update_coefs_at      */
} mpt__cuda_train_scratch;

/* The scratch of c, or NULL (and a pending error) if init never ran. */
static mpt__cuda_train_scratch *mpt__cuda_train_scratch_of(mpt__cuda *c, const char *what) {
    if (!c->train_scratch && c->pending == cudaSuccess) {
        c->pending = cudaErrorInvalidValue;
        snprintf(c->pending_what, sizeof c->pending_what,
                 "%s: training scratch missing (mpt__cuda_train_init not run)", what);
    }
    return c->train_scratch;
}

static size_t mpt__cuda_train_round_up(size_t n) { return (n + 255) & ~(size_t)255; }

static mpt_status mpt__cuda_train_init(mpt__cuda *c) {
    size_t norm = mpt__cuda_train_round_up(sizeof(double) * mpt__cuda_norm_slots);
    size_t carry = mpt__cuda_train_round_up(sizeof(double));
    size_t loss = mpt__cuda_train_round_up(sizeof(mpt__cuda_loss_partial) * mpt__cuda_loss_max_blocks);
    size_t coefs = mpt__cuda_train_round_up(sizeof(mpt__update_coefs));
    size_t bytes = norm + carry + loss + coefs;
    mpt__cuda_train_scratch *s = (mpt__cuda_train_scratch *)calloc(1, sizeof *s);
    char *p;
    cudaError_t e;
    if (!s) return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__, "out of memory");
    e = cudaMalloc(&s->base, bytes);
    /* on the backend's stream: it does not wait for the legacy default one */
    if (e == cudaSuccess) e = cudaMemsetAsync(s->base, 0, bytes, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(s->base);
        free(s);
        return mpt__cuda_fail(c, e == cudaErrorMemoryAllocation ? MPT_ERR_OUT_OF_MEMORY
                                                                : MPT_ERR_UNSUPPORTED,
                              __FILE__, __LINE__, "training scratch (%zu bytes): %s", bytes,
                              cudaGetErrorString(e));
    }
    p = (char *)s->base;
    s->norm_partials = (double *)p;
    s->norm_carry = (double *)(p + norm);
    s->loss_partials = (mpt__cuda_loss_partial *)(p + norm + carry);
    s->coefs = (mpt__update_coefs *)(p + norm + carry + loss);
    c->train_scratch = s;
    return MPT_OK;
}

static void mpt__cuda_train_destroy(mpt__cuda *c) {
    if (!c->train_scratch) return;
    cudaFree(c->train_scratch->base);
    free(c->train_scratch);
    c->train_scratch = NULL;
}

/* ---- loads and stores of any float dtype -------------------------------- */

static __device__ __forceinline__ float mpt__cuda_train_load(mpt_dtype dtype, const void *data,
                                                             int64_t i) {
    switch (dtype) {
    case MPT_FLOAT16: return mpt__cuda_half_to_float(((const uint16_t *)data)[i]);
    case MPT_BFLOAT16: return mpt__cuda_bf16_to_float(((const uint16_t *)data)[i]);
    /* int32 targets of a non-sparse loss: the value, never the bits */
    case MPT_INT32: return (float)((const int32_t *)data)[i];
    default: return ((const float *)data)[i];
    }
}

static __device__ __forceinline__ void mpt__cuda_train_store(mpt_dtype dtype, void *data,
                                                             int64_t i, float v) {
    switch (dtype) {
    case MPT_FLOAT16: ((uint16_t *)data)[i] = mpt__cuda_float_to_half(v); break;
    case MPT_BFLOAT16: ((uint16_t *)data)[i] = mpt__cuda_float_to_bf16(v); break;
    default: ((float *)data)[i] = v; break;
    }
}

/* ---- warp and block reductions ------------------------------------------- */

/* Butterfly sums: lane i adds lane i^m's value and lane i^m adds lane i's,
   the same two numbers, so every lane ends with the same bits. */
static __device__ __forceinline__ double mpt__cuda_train_warp_sum(double v) {
    for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

static __device__ __forceinline__ int mpt__cuda_train_warp_sum_int(int v) {
    for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

/* The row maximum, lane 0's taken so that every lane has the same (even
   the same sign of a zero maximum). */
static __device__ __forceinline__ float mpt__cuda_train_warp_max(float v) {
    for (int m = 16; m; m >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, v, m);
        v = o > v ? o : v;
    }
    return __shfl_sync(0xffffffffu, v, 0);
}

/* Argmax with the first maximum winning (the CPU's sequential `v > best`):
   the larger value, or on a tie the smaller index. */
static __device__ __forceinline__ int64_t mpt__cuda_train_warp_argmax(float v, int64_t i) {
    for (int m = 16; m; m >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, m);
        int64_t oi = __shfl_xor_sync(0xffffffffu, i, m);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    return __shfl_sync(0xffffffffu, i, 0);
}

/* A block's sum of one double per thread, in a fixed tree; the result is
   valid in thread 0. The block has mpt__cuda_train_threads threads. */
static __device__ double mpt__cuda_train_block_sum(double v) {
    __shared__ double warp_sums[mpt__cuda_train_warps];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = 16; m; m >>= 1) v += __shfl_down_sync(0xffffffffu, v, m);
    __syncthreads(); /* warp_sums may still be read by a previous call */
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        v = 0;
        for (int w = 0; w < mpt__cuda_train_warps; w++) v += warp_sums[w];
    }
    return v;
}

/* ---- the loss ------------------------------------------------------------- */

/* Everything the loss kernel reads, by value. */
typedef struct mpt__cuda_loss_params {
    mpt_loss_type type;
    int from_logits, metrics, top_k, scale_by_loss_scale;
    float grad_weight; /* a replica's share of the global batch (1 alone) */
    mpt_dtype pred_dtype, target_dtype; /* dpred has pred's dtype */
    const void *pred, *target;
    void *dpred;
    int64_t rows, K;
    int64_t rows_per_sample; /* positions of one sample (mpt_loss_args) */
    double count; /* the loss is a mean over rows (crossentropy) or elements */
    mpt_step_state *state; /* loss_scale read, the tallies written        */
    mpt__cuda_loss_partial *partials;
    const float *class_weight; /* NULL, or a row's weight by its class    */
    const float *sample_weight; /* NULL, or (rows / rows_per_sample)     */
    int weighted_metrics;      /* MPT_METRIC_* bits tallied with weights */
} mpt__cuda_loss_params;

static __device__ __forceinline__ bool mpt__cuda_loss_sparse(const mpt__cuda_loss_params &p) {
    return p.type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
}

/* The target of row r, class c: one-hot for a class id (`label`). */
static __device__ __forceinline__ float mpt__cuda_loss_target(const mpt__cuda_loss_params &p,
                                                              int64_t r, int64_t c, int label) {
    if (mpt__cuda_loss_sparse(p)) return label == c ? 1.0f : 0.0f;
    return mpt__cuda_train_load(p.target_dtype, p.target, r * p.K + c);
}

static __device__ __forceinline__ float mpt__cuda_loss_pred(const mpt__cuda_loss_params &p,
                                                            int64_t i) {
    return mpt__cuda_train_load(p.pred_dtype, p.pred, i);
}

static __device__ __forceinline__ void mpt__cuda_loss_grad(const mpt__cuda_loss_params &p,
                                                           int64_t i, float g, float gscale) {
    mpt__cuda_train_store(p.pred_dtype, p.dpred, i, __fmul_rn(g, gscale));
}

/* Crossentropy of softmax(z) for row r, one warp: Σ t·(lse − z) with lse
   taken around the row's max; gradient softmax(z)·Σt − t. */
static __device__ double mpt__cuda_xent_logits_row(const mpt__cuda_loss_params &p, int64_t r,
                                                   int label, int lane, float gscale) {
    const int64_t K = p.K, base = r * K;
    float mx = -INFINITY;
    double sum = 0, loss = 0, tsum = 0, lse;
    for (int64_t c = lane; c < K; c += 32) {
        float x = mpt__cuda_loss_pred(p, base + c);
        mx = x > mx ? x : mx;
    }
    mx = mpt__cuda_train_warp_max(mx);
    for (int64_t c = lane; c < K; c += 32)
        sum += (double)expf(__fsub_rn(mpt__cuda_loss_pred(p, base + c), mx));
    sum = mpt__cuda_train_warp_sum(sum);
    lse = __dadd_rn((double)mx, log(sum));
    for (int64_t c = lane; c < K; c += 32) {
        float t = mpt__cuda_loss_target(p, r, c, label);
        if (t != 0)
            loss = __dadd_rn(loss, mpt__xent_logit_term(mpt__cuda_loss_pred(p, base + c), t, lse));
        tsum += (double)t;
    }
    loss = mpt__cuda_train_warp_sum(loss);
    tsum = mpt__cuda_train_warp_sum(tsum);
    if (p.dpred)
        for (int64_t c = lane; c < K; c += 32) {
            float g = mpt__xent_logit_grad(mpt__cuda_loss_pred(p, base + c),
                                           mpt__cuda_loss_target(p, r, c, label), lse, (float)tsum);
            mpt__cuda_loss_grad(p, base + c, g, gscale);
        }
    return loss;
}

/* Crossentropy of a probability row (divided by its sum, clipped), one
   warp, by mpt.h's mpt__xent_prob_term and mpt__xent_prob_grad. */
static __device__ double mpt__cuda_xent_probs_row(const mpt__cuda_loss_params &p, int64_t r,
                                                  int label, int lane, float gscale) {
    const int64_t K = p.K, base = r * K;
    double sum = 0, loss = 0, dot = 0;
    float S, g;
    for (int64_t c = lane; c < K; c += 32) sum += (double)mpt__cuda_loss_pred(p, base + c);
    S = (float)mpt__cuda_train_warp_sum(sum);
    for (int64_t c = lane; c < K; c += 32) {
        float x = mpt__cuda_loss_pred(p, base + c);
        loss += (double)mpt__xent_prob_term(x, S, mpt__cuda_loss_target(p, r, c, label), &g);
        dot = __dadd_rn(dot, __dmul_rn((double)g, (double)__fdiv_rn(x, S)));
    }
    loss = mpt__cuda_train_warp_sum(loss);
    dot = mpt__cuda_train_warp_sum(dot);
    if (p.dpred)
        for (int64_t c = lane; c < K; c += 32) {
            mpt__xent_prob_term(mpt__cuda_loss_pred(p, base + c), S,
                                mpt__cuda_loss_target(p, r, c, label), &g);
            mpt__cuda_loss_grad(p, base + c, mpt__xent_prob_grad(g, dot, S), gscale);
        }
    return loss;
}

/* Binary crossentropy or squared error summed over row r, one warp, by
   mpt.h's mpt__bce_term and mpt__squared_error_term. */
static __device__ double mpt__cuda_elementwise_row(const mpt__cuda_loss_params &p, int64_t r,
                                                   int lane, float gscale) {
    const int64_t K = p.K, base = r * K;
    double loss = 0;
    for (int64_t c = lane; c < K; c += 32) {
        float x = mpt__cuda_loss_pred(p, base + c), t = mpt__cuda_loss_target(p, r, c, 0), g;
        if (p.type == MPT_LOSS_BINARY_CROSSENTROPY)
            loss += (double)mpt__bce_term(p.from_logits, x, t, &g);
        else
            loss = __dadd_rn(loss, mpt__squared_error_term(x, t, &g));
        if (p.dpred) mpt__cuda_loss_grad(p, base + c, g, gscale);
    }
    return mpt__cuda_train_warp_sum(loss);
}

/* Accuracy and top-k of row r, one warp, as the CPU's tally: one output
   unit is a binary prediction against a threshold; otherwise argmax ==
   label (or == argmax of the target), and the label is in the top k when
   fewer than k classes score strictly higher. Reads pred only. */
static __device__ void mpt__cuda_loss_tally_row(const mpt__cuda_loss_params &p, int64_t r,
                                                int label, int lane, int *correct, int *top_k) {
    const int64_t K = p.K, base = r * K;
    if (K == 1) {
        float v = mpt__cuda_loss_pred(p, base);
        float threshold = p.from_logits ? 0.0f : 0.5f;
        float t = mpt__cuda_loss_sparse(p) ? (float)label
                                           : mpt__cuda_train_load(p.target_dtype, p.target, r);
        *correct = (v > threshold) == (t > 0.5f);
        return;
    }
    float best = -INFINITY, best_t = -INFINITY;
    int64_t guess = INT64_MAX, truth = INT64_MAX;
    for (int64_t c = lane; c < K; c += 32) {
        float v = mpt__cuda_loss_pred(p, base + c);
        if (guess == INT64_MAX || v > best) best = v, guess = c;
        if (!mpt__cuda_loss_sparse(p)) {
            float t = mpt__cuda_train_load(p.target_dtype, p.target, base + c);
            if (truth == INT64_MAX || t > best_t) best_t = t, truth = c;
        }
    }
    guess = mpt__cuda_train_warp_argmax(best, guess);
    truth = mpt__cuda_loss_sparse(p) ? (int64_t)label : mpt__cuda_train_warp_argmax(best_t, truth);
    *correct = guess == truth;
    if ((p.metrics | p.weighted_metrics) & MPT_METRIC_SPARSE_TOP_K) {
        float tv = mpt__cuda_loss_pred(p, base + truth);
        int above = 0;
        for (int64_t c = lane; c < K; c += 32) above += mpt__cuda_loss_pred(p, base + c) > tv;
        *top_k = mpt__cuda_train_warp_sum_int(above) < p.top_k;
    }
}

/* The sums over row r's values (mpt.h's mpt__value_add, each lane its
   every 32nd value, then the lanes' sums added), for lane 0. Reads pred
   only. */

static __device__ mpt__value_sums mpt__cuda_loss_values_row(const mpt__cuda_loss_params &p,
                                                            int64_t r, int lane) {
    mpt__value_sums e = {{0}};
    for (int64_t c = lane; c < p.K; c += 32)
        mpt__value_add(&e, mpt__cuda_loss_pred(p, r * p.K + c), mpt__cuda_loss_target(p, r, c, 0),
                       p.from_logits);
    for (int i = 0; i < MPT__VALUE_SUMS; i++) e.sum[i] = mpt__cuda_train_warp_sum(e.sum[i]);
    return e;
}

static __device__ __forceinline__ void mpt__cuda_values_add(mpt__value_sums *to,
                                                            const mpt__value_sums &e) {
    for (int i = 0; i < MPT__VALUE_SUMS; i++) to->sum[i] += e.sum[i];
}

/* Row r's class weight (1 without class weights), for every lane: mpt.h's
   mpt__row_class_weight of its label, the argmax of its target (the first
   of equal ones, as the CPU's), or its binary target. */
static __device__ float mpt__cuda_loss_row_class_weight(const mpt__cuda_loss_params &p,
                                                        int64_t r, int label, int lane) {
    float best_t = -INFINITY;
    int64_t best = INT64_MAX;
    if (!p.class_weight) return 1.0f;
    if (!mpt__cuda_loss_sparse(p) && p.K > 1) {
        for (int64_t c = lane; c < p.K; c += 32) {
            float t = mpt__cuda_loss_target(p, r, c, 0);
            if (best == INT64_MAX || t > best_t) best_t = t, best = c;
        }
        best = mpt__cuda_train_warp_argmax(best_t, best);
    }
    return mpt__row_class_weight(p.class_weight, p.K, mpt__cuda_loss_sparse(p) ? label : best,
                                 mpt__cuda_loss_target(p, r, 0, label));
}

/* Row r's weight, for every lane: its class's times its sample's (mpt.h's
   mpt__row_weight; 1 without either). */
static __device__ float mpt__cuda_loss_row_weight(const mpt__cuda_loss_params &p, int64_t r,
                                                  int label, int lane) {
    return mpt__row_weight(mpt__cuda_loss_row_class_weight(p, r, label, lane), p.sample_weight, r,
                           p.rows_per_sample);
}

/* The row losses and gradients. One warp per row; block b takes the rows
   [rows·b/G, rows·(b+1)/G) of a grid of G blocks (G depends on rows only)
   and its warps take every 8th of them. Each warp's lane 0 adds its rows'
   losses in row order; thread 0 adds the warps' sums in warp order into
   the block's partial. dpred may be pred: every lane reads the whole row's
   values it needs before the __syncwarp that precedes the first write. */
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_loss_kernel(mpt__cuda_loss_params p) {
    __shared__ double warp_loss[mpt__cuda_train_warps];
    __shared__ int warp_correct[mpt__cuda_train_warps], warp_top_k[mpt__cuda_train_warps];
    __shared__ mpt__value_sums warp_values[mpt__cuda_train_warps];
    __shared__ mpt__weighted_sums warp_weighted[mpt__cuda_train_warps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r0 = p.rows * blockIdx.x / gridDim.x, r1 = p.rows * (blockIdx.x + 1) / gridDim.x;
    const int either = p.metrics | p.weighted_metrics;
    const bool tally = (either & (MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K)) != 0;
    const bool values = (either & MPT__METRICS_VALUES) != 0;
    const bool categorical = p.type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
                             p.type == MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    float scale = p.scale_by_loss_scale ? p.state->loss_scale : 1.0f;
    const float gscale =
        (float)((scale != 0 ? (double)scale : 1.0) * (double)p.grad_weight / p.count);
    double loss_sum = 0;
    int correct_sum = 0, top_k_sum = 0;
    mpt__value_sums values_sum = {{0}};
    mpt__weighted_sums weighted_sum = {0, 0, 0, {{0}}};
    for (int64_t r = r0 + warp; r < r1; r += mpt__cuda_train_warps) {
        int label = mpt__cuda_loss_sparse(p) ? ((const int32_t *)p.target)[r] : 0;
        int correct = 0, top_k = 0;
        mpt__value_sums row_values = {{0}};
        double loss;
        if (tally) mpt__cuda_loss_tally_row(p, r, label, lane, &correct, &top_k);
        if (values) row_values = mpt__cuda_loss_values_row(p, r, lane);
        mpt__cuda_values_add(&values_sum, row_values);
        /* times 1 exactly without weights */
        const float w = mpt__cuda_loss_row_weight(p, r, label, lane), row_scale = __fmul_rn(gscale, w);
        if (p.weighted_metrics) mpt__weighted_add(&weighted_sum, w, correct, top_k, &row_values);
        __syncwarp(); /* the tally's reads of other lanes' classes come before any write */
        if (!categorical) loss = mpt__cuda_elementwise_row(p, r, lane, row_scale);
        else if (p.from_logits) loss = mpt__cuda_xent_logits_row(p, r, label, lane, row_scale);
        else loss = mpt__cuda_xent_probs_row(p, r, label, lane, row_scale);
        loss_sum += __dmul_rn(loss, (double)w);
        correct_sum += correct;
        top_k_sum += top_k;
    }
    if (lane == 0) {
        warp_loss[warp] = loss_sum;
        warp_correct[warp] = correct_sum;
        warp_top_k[warp] = top_k_sum;
        warp_values[warp] = values_sum;
        warp_weighted[warp] = weighted_sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mpt__cuda_loss_partial out = {0, 0, 0, {{0}}, {0, 0, 0, {{0}}}};
        for (int w = 0; w < mpt__cuda_train_warps; w++) {
            out.loss += warp_loss[w];
            out.correct += (double)warp_correct[w];
            out.top_k += (double)warp_top_k[w];
            mpt__cuda_values_add(&out.values, warp_values[w]);
            mpt__weighted_sums_add(&out.weighted, &warp_weighted[w]);
        }
        p.partials[blockIdx.x] = out;
    }
}

/* One block: the blocks' partials added in a fixed tree (thread t takes
   partials t, t + 256, ... in order), then the batch into the step state
   by the CPU's rule (mpt__loss_tally): loss_sum += mean loss × samples. */
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_loss_finish_kernel(mpt__cuda_loss_params p, int n_partials) {
    double loss = 0, correct = 0, top_k = 0;
    mpt__value_sums e = {{0}};
    mpt__weighted_sums weighted = {0, 0, 0, {{0}}};
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) {
        loss += p.partials[i].loss;
        correct += p.partials[i].correct;
        top_k += p.partials[i].top_k;
        mpt__cuda_values_add(&e, p.partials[i].values);
        mpt__weighted_sums_add(&weighted, &p.partials[i].weighted);
    }
    loss = mpt__cuda_train_block_sum(loss);
    correct = mpt__cuda_train_block_sum(correct);
    top_k = mpt__cuda_train_block_sum(top_k);
    for (int k = 0; k < MPT__VALUE_SUMS; k++) e.sum[k] = mpt__cuda_train_block_sum(e.sum[k]);
    if (p.weighted_metrics) { /* each block sum syncs the block: all threads or none */
        weighted.weight = mpt__cuda_train_block_sum(weighted.weight);
        weighted.correct = mpt__cuda_train_block_sum(weighted.correct);
        weighted.top_k = mpt__cuda_train_block_sum(weighted.top_k);
        for (int k = 0; k < MPT__VALUE_SUMS; k++)
            weighted.values.sum[k] = mpt__cuda_train_block_sum(weighted.values.sum[k]);
    }
    if (threadIdx.x == 0)
        mpt__loss_tally(p.state, p.metrics, p.weighted_metrics, p.rows, p.rows_per_sample, p.K,
                        loss / p.count, correct, top_k, &e, &weighted);
}

/* ---- r2_score's and auc's sums --------------------------------------------
   mpt.h's @backend-shared record: block k of MPT__METRIC_PARTS takes the
   rows [rows·k/PARTS, rows·(k+1)/PARTS) and writes the whole of its
   partial record; a second kernel adds the partials, in part order, into
   the epoch's record. The rows go through shared memory a tile at a time
   (each row's weight, each value's auc slot); then thread c sums column c
   over the tile's rows in order (r2_score: Σ w·y, Σ w·y², Σ w·(y − p)²),
   and thread b bucket b's weights over the tile's values in order (auc):
   each sum is added in the CPU's order (mpt.h's mpt__metric_part), with
   no atomics. Reads pred before the loss kernel, which may write the
   gradient over it. */
static constexpr int mpt__cuda_metric_tile = 256; /* values of a tile: rows · K <= this, or one row */

static __device__ float mpt__cuda_metric_row_weight(const mpt__cuda_loss_params &p, int64_t r) {
    float cw = 1.0f;
    if (p.class_weight) { /* the first maximum of the target, as the CPU's */
        int64_t best = 0;
        for (int64_t c = 1; c < p.K; c++)
            best = mpt__cuda_loss_target(p, r, c, 0) > mpt__cuda_loss_target(p, r, best, 0) ? c : best;
        cw = mpt__row_class_weight(p.class_weight, p.K, best, mpt__cuda_loss_target(p, r, 0, 0));
    }
    return mpt__row_weight(cw, p.sample_weight, r, p.rows_per_sample);
}

static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_metric_kernel(mpt__cuda_loss_params p, double *parts, int64_t list) {
    __shared__ double row_w[mpt__cuda_metric_tile];  /* the tile's rows' weights  */
    __shared__ int slot[mpt__cuda_metric_tile];      /* its values' auc slots − (1 + 3K) */
    const int64_t K = p.K, r0 = p.rows * blockIdx.x / gridDim.x,
                  r1 = p.rows * (blockIdx.x + 1) / gridDim.x;
    const int64_t tile_rows = K <= mpt__cuda_metric_tile ? mpt__cuda_metric_tile / K : 1;
    for (int l = 0; l < 2; l++) {
        const int bits = mpt__metric_list_bits(l, p.metrics, p.weighted_metrics);
        double *out = parts + (2 * (int64_t)blockIdx.x + l) * list;
        double count = 0, auc[2] = {0, 0}; /* thread b < 200: bucket b's positives, negatives */
        if (!bits) continue;
        for (int64_t c = threadIdx.x; c < K; c += blockDim.x) /* r2: thread c, columns c + 256·j */
            out[1 + c] = out[1 + K + c] = out[1 + 2 * K + c] = 0;
        for (int64_t t0 = r0; t0 < r1; t0 += tile_rows) {
            const int64_t t1 = t0 + tile_rows < r1 ? t0 + tile_rows : r1, n = (t1 - t0) * K;
            __syncthreads(); /* the last tile's reads are done */
            for (int64_t i = threadIdx.x; i < t1 - t0; i += blockDim.x)
                row_w[i] = l ? (double)mpt__cuda_metric_row_weight(p, t0 + i) : 1.0;
            if (bits & MPT_METRIC_AUC)
                for (int64_t i = threadIdx.x; i < n && i < mpt__cuda_metric_tile; i += blockDim.x)
                    slot[i] = (int)(mpt__auc_slot(K, mpt__cuda_loss_pred(p, t0 * K + i),
                                                  mpt__cuda_loss_target(p, t0 + i / K, i % K, 0),
                                                  p.from_logits) - (1 + 3 * K));
            __syncthreads();
            if (threadIdx.x == 0)
                for (int64_t i = 0; i < t1 - t0; i++) count = __dadd_rn(count, row_w[i]);
            if (bits & MPT_METRIC_R2_SCORE)
                for (int64_t c = threadIdx.x; c < K; c += blockDim.x) {
                    double s0 = out[1 + c], s1 = out[1 + K + c], s2 = out[1 + 2 * K + c], t[3];
                    for (int64_t r = t0; r < t1; r++) {
                        mpt__r2_terms(mpt__cuda_loss_pred(p, r * K + c),
                                      mpt__cuda_loss_target(p, r, c, 0), row_w[r - t0], t);
                        s0 = __dadd_rn(s0, t[0]);
                        s1 = __dadd_rn(s1, t[1]);
                        s2 = __dadd_rn(s2, t[2]);
                    }
                    out[1 + c] = s0;
                    out[1 + K + c] = s1;
                    out[1 + 2 * K + c] = s2;
                }
            if ((bits & MPT_METRIC_AUC) && threadIdx.x < MPT__AUC_THRESHOLDS)
                for (int64_t i = 0; i < n; i++) { /* a row past the tile (K > 256) reads its own */
                    int v = i < mpt__cuda_metric_tile
                                ? slot[i]
                                : (int)(mpt__auc_slot(K, mpt__cuda_loss_pred(p, t0 * K + i),
                                                      mpt__cuda_loss_target(p, t0 + i / K, i % K, 0),
                                                      p.from_logits) - (1 + 3 * K));
                    const double w = row_w[i / K];
                    if (v == (int)threadIdx.x) auc[0] = __dadd_rn(auc[0], w);
                    else if (v == (int)threadIdx.x + MPT__AUC_THRESHOLDS) auc[1] = __dadd_rn(auc[1], w);
                }
        }
        if (threadIdx.x == 0) out[0] = count;
        if (threadIdx.x < MPT__AUC_THRESHOLDS) { /* zeros without auc, as the CPU's */
            out[1 + 3 * K + threadIdx.x] = auc[0];
            out[1 + 3 * K + MPT__AUC_THRESHOLDS + threadIdx.x] = auc[1];
        }
    }
}

/* sums[i] += Σ_k parts[k][i], k in order, for each value i of the lists
   in use (thread i; two lists of `list` values). */
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_metric_finish_kernel(mpt__cuda_loss_params p, double *sums, const double *parts,
                               int64_t list) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int l = i < list ? 0 : 1;
    double sum = 0;
    if (i >= 2 * list || !mpt__metric_list_bits(l, p.metrics, p.weighted_metrics)) return;
    for (int k = 0; k < MPT__METRIC_PARTS; k++) sum = __dadd_rn(sum, parts[k * 2 * list + i]);
    sums[i] = __dadd_rn(sums[i], sum);
}

static void mpt__cuda_loss(void *impl, const mpt_loss_args *a) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_train_scratch *s = mpt__cuda_train_scratch_of(c, "loss");
    mpt__cuda_loss_params p;
    int categorical = a->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
                      a->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    int64_t blocks;
    if (!s || a->rows <= 0 || a->K <= 0) return;
    p.type = a->type;
    p.from_logits = a->from_logits != 0;
    p.metrics = a->metrics;
    p.top_k = a->top_k;
    p.scale_by_loss_scale = a->scale_by_loss_scale;
    p.grad_weight = a->grad_weight != 0 ? a->grad_weight : 1.0f;
    p.pred_dtype = a->pred_dtype;
    p.target_dtype = a->target_dtype;
    p.pred = a->pred;
    p.target = a->target;
    p.dpred = a->dpred;
    p.rows = a->rows;
    p.K = a->K;
    p.rows_per_sample = a->rows_per_sample;
    /* The mean is over rows for crossentropies, over elements otherwise. */
    p.count = categorical ? (double)a->rows : (double)a->rows * (double)a->K;
    p.state = a->state;
    p.partials = s->loss_partials;
    p.class_weight = a->class_weight;
    p.sample_weight = a->sample_weight;
    p.weighted_metrics = a->weighted_metrics;
    if (a->metric_sums && ((a->metrics | a->weighted_metrics) & MPT__METRICS_EPOCH)) {
        /* before the loss: dpred may be pred */
        const int64_t list = mpt__metric_list_count(a->K);
        mpt__cuda_metric_kernel<<<MPT__METRIC_PARTS, mpt__cuda_train_threads, 0, c->stream>>>(
            p, a->metric_parts, list);
        mpt__cuda_launched(c, "mpt__cuda_metric_kernel");
        mpt__cuda_metric_finish_kernel<<<(unsigned)((2 * list + mpt__cuda_train_threads - 1) /
                                                    mpt__cuda_train_threads),
                                         mpt__cuda_train_threads, 0, c->stream>>>(
            p, a->metric_sums, a->metric_parts, list);
        mpt__cuda_launched(c, "mpt__cuda_metric_finish_kernel");
    }
    blocks = (a->rows + mpt__cuda_train_warps - 1) / mpt__cuda_train_warps;
    if (blocks > mpt__cuda_loss_max_blocks) blocks = mpt__cuda_loss_max_blocks;
    mpt__cuda_loss_kernel<<<(unsigned)blocks, mpt__cuda_train_threads, 0, c->stream>>>(p);
    mpt__cuda_launched(c, "mpt__cuda_loss_kernel");
    mpt__cuda_loss_finish_kernel<<<1, mpt__cuda_train_threads, 0, c->stream>>>(p, (int)blocks);
    mpt__cuda_launched(c, "mpt__cuda_loss_finish_kernel");
}

/* ---- pass 1: the sum of squares of the gradients --------------------------- */

/* The multi-tensor kernels (the norm's and the update's) take their table
   of tensors by value, as kernel parameters (under 4 KB, so any driver
   takes it): a captured graph keeps the values of its launch, so replaying
   it never reads a table another model or step has since rewritten. Block
   b of a launch belongs to entry i where first_block[i] <= b <
   first_block[i + 1]. */
static __device__ __forceinline__ int mpt__cuda_table_entry(const int *first_block, int count,
                                                            int block) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first_block[mid] <= block) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Up to mpt__cuda_tensors_per_launch gradients of one norm launch. */
typedef struct mpt__cuda_norm_table {
    const float *g[mpt__cuda_tensors_per_launch];
    const float *acc[mpt__cuda_tensors_per_launch]; /* MEAN: the accumulated sums */
    int64_t n[mpt__cuda_tensors_per_launch];
    int64_t chunk[mpt__cuda_tensors_per_launch]; /* a multiple of 4               */
    int first_block[mpt__cuda_tensors_per_launch + 1];
    int vec[mpt__cuda_tensors_per_launch];       /* g is 16-byte aligned          */
    int count;
} mpt__cuda_norm_table;
static_assert(sizeof(mpt__cuda_norm_table) + 2 * sizeof(void *) <= 4096,
              "the norm table is a kernel parameter");

/* The value whose square the norm sums: the gradient, or (MEAN, gradient
   accumulation's applying step) the cycle's mean, mpt.h's mpt__accum_mean
   from the sum a and the gradient g. */
template <bool MEAN>
static __device__ __forceinline__ double mpt__cuda_norm_value(float g, float a, float unscale,
                                                              float steps) {
    return MEAN ? (double)mpt__accum_mean(unscale, steps, g, a) : (double)g;
}

/* Σ g² in double over one chunk of a gradient per block: block j of a
   gradient takes [j·chunk, min(n, (j + 1)·chunk)), thread t every 256th
   float4 of it from the t-th (vec) or every 256th float, then the block's
   fixed tree; the launch's block b writes partials[b]. The same partials,
   in the same slots, as one launch per gradient would give. MEAN: the
   squares of the accumulated mean instead, unscaled by the state's scale,
   steps = N. */
template <bool MEAN>
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_norm_kernel(mpt__cuda_norm_table T, double *partials, const mpt_step_state *state,
                      float steps) {
    const int e = mpt__cuda_table_entry(T.first_block, T.count, (int)blockIdx.x);
    const float *g = T.g[e], *a = T.acc[e];
    const int64_t n = T.n[e];
    const int64_t begin = (int64_t)(blockIdx.x - T.first_block[e]) * T.chunk[e];
    const int64_t end = begin + T.chunk[e] < n ? begin + T.chunk[e] : n;
    const float unscale = MEAN ? mpt__accum_unscale(state) : 1.0f;
    double sum = 0; /* a float's square is exact in double: fused or not, the same sum */
    int64_t i = begin + threadIdx.x;
    if (T.vec[e] && begin < end) {
        const float4 *g4 = (const float4 *)(g + begin);
        const int64_t n4 = (end - begin) / 4;
        for (int64_t k = threadIdx.x; k < n4; k += blockDim.x) {
            float4 v = g4[k], s = MEAN ? ((const float4 *)(a + begin))[k] : v;
            double x = mpt__cuda_norm_value<MEAN>(v.x, s.x, unscale, steps);
            double y = mpt__cuda_norm_value<MEAN>(v.y, s.y, unscale, steps);
            double z = mpt__cuda_norm_value<MEAN>(v.z, s.z, unscale, steps);
            double w = mpt__cuda_norm_value<MEAN>(v.w, s.w, unscale, steps);
            sum += x * x;
            sum += y * y;
            sum += z * z;
            sum += w * w;
        }
        i = begin + n4 * 4 + threadIdx.x;
    }
    for (; i < end; i += blockDim.x) {
        double v = mpt__cuda_norm_value<MEAN>(g[i], MEAN ? a[i] : 0.0f, unscale, steps);
        sum += v * v;
    }
    sum = mpt__cuda_train_block_sum(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

/* One block: partials[0, n) added in a fixed tree onto what earlier folds
   carried (none when first); the last fold writes the step state's
   sum_squares and finite, or (mean, after them) accumulated_sum_squares:
   the mean's sum at a finite applying step of gradient accumulation, 0
   otherwise, as the CPU's grad_stats leaves it. */
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_norm_fold_kernel(const double *partials, int n, double *carry, int first, int last,
                           int mean, mpt_optimizer_desc d, mpt_step_state *state) {
    double sum = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
    sum = mpt__cuda_train_block_sum(sum);
    if (threadIdx.x == 0) {
        double total = (first ? 0.0 : *carry) + sum;
        if (!last) {
            *carry = total;
        } else if (mean) {
            int applying = state->finite && mpt__accum_mode(&d, state) == MPT__ACCUM_APPLY;
            state->accumulated_sum_squares = applying ? total : 0.0;
        } else {
            state->sum_squares = total;
            state->finite = isfinite(total) ? 1 : 0;
        }
    }
}

static void mpt__cuda_norm_fold(mpt__cuda *c, mpt__cuda_train_scratch *s, int n, int first,
                                int last, const mpt_update_args *u, int mean) {
    mpt__cuda_norm_fold_kernel<<<1, mpt__cuda_train_threads, 0, c->stream>>>(
        s->norm_partials, n, s->norm_carry, first, last, mean, u->optimizer, u->state);
    mpt__cuda_launched(c, "mpt__cuda_norm_fold_kernel");
}

/* The table's gradients into the next slots (from `used`); empties it. */
static void mpt__cuda_norm_launch(mpt__cuda *c, mpt__cuda_train_scratch *s,
                                  mpt__cuda_norm_table *T, int *used, const mpt_update_args *u,
                                  int mean) {
    int blocks = T->first_block[T->count];
    float steps = (float)mpt__accum_steps(&u->optimizer);
    if (T->count == 0) return;
    if (mean)
        mpt__cuda_norm_kernel<true><<<(unsigned)blocks, mpt__cuda_train_threads, 0, c->stream>>>(
            *T, s->norm_partials + *used, u->state, steps);
    else
        mpt__cuda_norm_kernel<false><<<(unsigned)blocks, mpt__cuda_train_threads, 0, c->stream>>>(
            *T, s->norm_partials + *used, u->state, steps);
    mpt__cuda_launched(c, "mpt__cuda_norm_kernel");
    *used += blocks;
    T->count = 0;
    T->first_block[0] = 0;
}

/* Every gradient's blocks write their partials into the next slots, in
   the gradients' order, one launch per table of gradients; when the slots
   would run out, the ones filled are folded into a carried sum first.
   Each gradient's blocks depend on its count only, so the sum is the same
   whatever the launches. */
static void mpt__cuda_norm_pass(mpt__cuda *c, mpt__cuda_train_scratch *s,
                                const mpt_update_args *u, int mean) {
    mpt__cuda_norm_table T;
    int used = 0, first = 1;
    T.count = 0;
    T.first_block[0] = 0;
    for (int i = 0; i < u->n; i++) {
        int64_t n = u->count[i], blocks, chunk;
        if (n <= 0) continue;
        blocks = (n + mpt__cuda_norm_min_per_block - 1) / mpt__cuda_norm_min_per_block;
        if (blocks > mpt__cuda_norm_max_blocks) blocks = mpt__cuda_norm_max_blocks;
        chunk = ((n + blocks - 1) / blocks + 3) & ~(int64_t)3;
        blocks = (n + chunk - 1) / chunk;
        if (used + T.first_block[T.count] + blocks > mpt__cuda_norm_slots) {
            mpt__cuda_norm_launch(c, s, &T, &used, u, mean);
            mpt__cuda_norm_fold(c, s, used, first, 0, u, mean);
            used = 0;
            first = 0;
        }
        if (T.count == mpt__cuda_tensors_per_launch)
            mpt__cuda_norm_launch(c, s, &T, &used, u, mean);
        T.g[T.count] = u->grad[i];
        T.acc[T.count] = mean ? u->accum[i] : NULL;
        T.n[T.count] = n;
        T.chunk[T.count] = chunk;
        T.vec[T.count] = ((uintptr_t)u->grad[i] & 15) == 0 &&
                         (!mean || ((uintptr_t)u->accum[i] & 15) == 0);
        T.first_block[T.count + 1] = T.first_block[T.count] + (int)blocks;
        T.count++;
    }
    mpt__cuda_norm_launch(c, s, &T, &used, u, mean);
    mpt__cuda_norm_fold(c, s, used, first, 1, u, mean);
}

/* The gradients' sum of squares; with gradient accumulation and clipping,
   a second pass over the cycle's mean, which its fold keeps only at a
   finite applying step: the device decides, so one recorded step serves
   every step of the cycle. */
static void mpt__cuda_grad_stats(void *impl, const mpt_update_args *u) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_train_scratch *s = mpt__cuda_train_scratch_of(c, "grad_stats");
    if (!s) return;
    mpt__cuda_norm_pass(c, s, u, 0);
    if (u->accum && u->optimizer.clip_global_norm > 0 && mpt__accum_steps(&u->optimizer) > 1)
        mpt__cuda_norm_pass(c, s, u, 1);
}

/* ---- pass 2: the fused update ---------------------------------------------- */

/* One thread: the step's coefficients from the state (mpt.h's
   mpt__update_coefs_at, @backend-shared, which the CPU runs too) and, the
   step being applied, optimizer_steps + 1, or with gradient accumulation
   the cycle's count moved on (mpt__accum_advance; the update kernels after
   it read only the coefficients, so counting it here saves a launch).
   Nothing when the gradients are not finite. */
static __global__ void mpt__cuda_update_coefs_kernel(mpt_optimizer_desc d, mpt_step_state *state,
                                                     mpt__update_coefs *out) {
    if (!state->finite) return;
    *out = mpt__update_coefs_at(&d, state);
    mpt__accum_advance(&d, state);
}

/* The update rules, chosen per launch. */
enum {
    MPT__CUDA_RULE_ADAM = 0,     /* Adam and AdamW: s0 = m, s1 = v      */
    MPT__CUDA_RULE_SGD,          /* no momentum: no slot               */
    MPT__CUDA_RULE_MOMENTUM,     /* s0 = velocity                      */
    MPT__CUDA_RULE_NESTEROV
};

/* One element by the rule (mpt.h's, @backend-shared, which the CPU's
   block loops run too). Returns the new master; s0/s1 are updated in
   place. */
template <int RULE>
static __device__ __forceinline__ float mpt__cuda_update_one(const mpt__update_coefs &k,
                                                             float w, float g, float &s0,
                                                             float &s1) {
    if (RULE == MPT__CUDA_RULE_ADAM) return mpt__adam_update(&k, w, g, &s0, &s1);
    if (RULE == MPT__CUDA_RULE_SGD) return mpt__sgd_update(&k, w, g);
    return mpt__momentum_update(&k, w, g, &s0, RULE == MPT__CUDA_RULE_NESTEROV);
}

/* One parameter tensor's pointers, by value. */
typedef struct mpt__cuda_update_tensor {
    float *w;
    const float *g;
    float *s0, *s1;   /* NULL where the rule has none              */
    float *acc;       /* gradient accumulation's sum; NULL: none   */
    void *compute;    /* NULL: no separate compute copy            */
    mpt_dtype compute_dtype;
    int no_decay;     /* exclude_from_weight_decay: no decay       */
    int64_t n;
} mpt__cuda_update_tensor;
static_assert(sizeof(mpt__cuda_update_tensor) == 64, "a table entry is read whole into registers");

/* Gradient accumulation on one element (mpt.h's rules, as the CPU's
   mpt__accum_block): accumulating, the sum takes the gradient and false is
   returned (nothing else changes); applying, g becomes the cycle's mean
   and the sum is emptied. */
static __device__ __forceinline__ bool mpt__cuda_accum_one(const mpt__update_coefs &k, float &g,
                                                           float &sum) {
    if (k.mode == MPT__ACCUM_ADD) {
        sum = mpt__accum_sum(k.unscale, g, sum);
        return false;
    }
    g = mpt__accum_mean(k.unscale, k.steps, g, sum);
    sum = 0.0f;
    return true;
}

/* Element i, scalar. */
template <int RULE>
static __device__ __forceinline__ void mpt__cuda_update_scalar(const mpt__cuda_update_tensor &T,
                                                               const mpt__update_coefs &k,
                                                               int64_t i) {
    float g = T.g[i];
    if (k.mode != MPT__ACCUM_OFF) {
        float sum = T.acc[i];
        bool apply = mpt__cuda_accum_one(k, g, sum);
        T.acc[i] = sum;
        if (!apply) return;
    }
    float s0 = RULE == MPT__CUDA_RULE_SGD ? 0.0f : T.s0[i];
    float s1 = RULE == MPT__CUDA_RULE_ADAM ? T.s1[i] : 0.0f;
    float w = mpt__cuda_update_one<RULE>(k, T.w[i], g, s0, s1);
    T.w[i] = w;
    if (RULE != MPT__CUDA_RULE_SGD) T.s0[i] = s0;
    if (RULE == MPT__CUDA_RULE_ADAM) T.s1[i] = s1;
    if (T.compute) mpt__cuda_train_store(T.compute_dtype, T.compute, i, w);
}

/* Elements 4q .. 4q+3 with 128-bit loads and stores (the compute copy:
   128 bits in float32, 64 in float16/bfloat16). */
template <int RULE>
static __device__ __forceinline__ void mpt__cuda_update_vec4(const mpt__cuda_update_tensor &T,
                                                             const mpt__update_coefs &k,
                                                             int64_t q) {
    float4 w = ((const float4 *)T.w)[q], g = ((const float4 *)T.g)[q];
    float4 s0 = make_float4(0, 0, 0, 0), s1 = make_float4(0, 0, 0, 0);
    if (k.mode != MPT__ACCUM_OFF) { /* the mode is the launch's: no lane diverges */
        float4 sum = ((const float4 *)T.acc)[q];
        bool apply = mpt__cuda_accum_one(k, g.x, sum.x);
        mpt__cuda_accum_one(k, g.y, sum.y);
        mpt__cuda_accum_one(k, g.z, sum.z);
        mpt__cuda_accum_one(k, g.w, sum.w);
        ((float4 *)T.acc)[q] = sum;
        if (!apply) return;
    }
    if (RULE != MPT__CUDA_RULE_SGD) s0 = ((const float4 *)T.s0)[q];
    if (RULE == MPT__CUDA_RULE_ADAM) s1 = ((const float4 *)T.s1)[q];
    w.x = mpt__cuda_update_one<RULE>(k, w.x, g.x, s0.x, s1.x);
    w.y = mpt__cuda_update_one<RULE>(k, w.y, g.y, s0.y, s1.y);
    w.z = mpt__cuda_update_one<RULE>(k, w.z, g.z, s0.z, s1.z);
    w.w = mpt__cuda_update_one<RULE>(k, w.w, g.w, s0.w, s1.w);
    ((float4 *)T.w)[q] = w;
    if (RULE != MPT__CUDA_RULE_SGD) ((float4 *)T.s0)[q] = s0;
    if (RULE == MPT__CUDA_RULE_ADAM) ((float4 *)T.s1)[q] = s1;
    if (!T.compute) return;
    if (T.compute_dtype == MPT_FLOAT16 || T.compute_dtype == MPT_BFLOAT16) {
        bool h = T.compute_dtype == MPT_FLOAT16;
        uint16_t a = h ? mpt__cuda_float_to_half(w.x) : mpt__cuda_float_to_bf16(w.x);
        uint16_t b = h ? mpt__cuda_float_to_half(w.y) : mpt__cuda_float_to_bf16(w.y);
        uint16_t c = h ? mpt__cuda_float_to_half(w.z) : mpt__cuda_float_to_bf16(w.z);
        uint16_t d = h ? mpt__cuda_float_to_half(w.w) : mpt__cuda_float_to_bf16(w.w);
        ((uint2 *)T.compute)[q] = make_uint2((uint32_t)a | ((uint32_t)b << 16),
                                             (uint32_t)c | ((uint32_t)d << 16));
    } else {
        ((float4 *)T.compute)[q] = w;
    }
}

/* Up to mpt__cuda_tensors_per_launch parameter tensors of one update
   launch, all with the same rule. */
typedef struct mpt__cuda_update_table {
    mpt__cuda_update_tensor t[mpt__cuda_tensors_per_launch];
    int first_block[mpt__cuda_tensors_per_launch + 1];
    int vec[mpt__cuda_tensors_per_launch]; /* every pointer 16-byte aligned
                                              (the compute copy: 8 in half) */
    int count;
} mpt__cuda_update_table;
static_assert(sizeof(mpt__cuda_update_table) + 3 * sizeof(void *) + sizeof(int) <= 4096,
              "the update table is a kernel parameter");

/* The fused update of the table's tensors: a tensor's blocks run a
   grid-stride loop over it alone: with vec, over its n/4 float4s and then
   the last n % 4 elements by the first threads; else element by element.
   Returns at once when the step is skipped. */
template <int RULE>
static __global__ void __launch_bounds__(mpt__cuda_train_threads)
mpt__cuda_update_kernel(mpt__cuda_update_table U, const mpt__update_coefs *coefs,
                        const mpt_step_state *state) {
    if (!state->finite) return;
    const int e = mpt__cuda_table_entry(U.first_block, U.count, (int)blockIdx.x);
    const mpt__cuda_update_tensor T = U.t[e]; /* 64 bytes, into registers */
    const mpt__update_coefs k = mpt__update_coefs_for(coefs, T.no_decay);
    const int blocks = U.first_block[e + 1] - U.first_block[e];
    const int64_t first = (int64_t)(blockIdx.x - U.first_block[e]) * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)blocks * blockDim.x;
    if (U.vec[e]) {
        const int64_t n4 = T.n / 4;
        for (int64_t q = first; q < n4; q += stride) mpt__cuda_update_vec4<RULE>(T, k, q);
        if (first < T.n - n4 * 4) mpt__cuda_update_scalar<RULE>(T, k, n4 * 4 + first);
    } else {
        for (int64_t i = first; i < T.n; i += stride) mpt__cuda_update_scalar<RULE>(T, k, i);
    }
}

static bool mpt__cuda_train_aligned(const void *p, uintptr_t bytes) {
    return ((uintptr_t)p & (bytes - 1)) == 0;
}

/* The table's tensors, one launch; empties it. */
static void mpt__cuda_update_launch(mpt__cuda *c, mpt__cuda_train_scratch *s,
                                    mpt__cuda_update_table *U, int rule, mpt_step_state *state) {
    unsigned blocks = (unsigned)U->first_block[U->count];
    if (U->count == 0) return;
    switch (rule) {
    case MPT__CUDA_RULE_ADAM:
        mpt__cuda_update_kernel<MPT__CUDA_RULE_ADAM>
            <<<blocks, mpt__cuda_train_threads, 0, c->stream>>>(*U, s->coefs, state);
        break;
    case MPT__CUDA_RULE_SGD:
        mpt__cuda_update_kernel<MPT__CUDA_RULE_SGD>
            <<<blocks, mpt__cuda_train_threads, 0, c->stream>>>(*U, s->coefs, state);
        break;
    case MPT__CUDA_RULE_MOMENTUM:
        mpt__cuda_update_kernel<MPT__CUDA_RULE_MOMENTUM>
            <<<blocks, mpt__cuda_train_threads, 0, c->stream>>>(*U, s->coefs, state);
        break;
    default:
        mpt__cuda_update_kernel<MPT__CUDA_RULE_NESTEROV>
            <<<blocks, mpt__cuda_train_threads, 0, c->stream>>>(*U, s->coefs, state);
        break;
    }
    mpt__cuda_launched(c, "mpt__cuda_update_kernel");
    U->count = 0;
    U->first_block[0] = 0;
}

/* The coefficients, then every tensor in tables of tensors with one rule
   (a model's tensors share one: one launch for up to
   mpt__cuda_tensors_per_launch of them). */
static void mpt__cuda_update(void *impl, const mpt_update_args *u) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_train_scratch *s = mpt__cuda_train_scratch_of(c, "update");
    const mpt_optimizer_desc *d = &u->optimizer;
    mpt__cuda_update_table U;
    int table_rule = MPT__CUDA_RULE_ADAM;
    if (!s) return;
    mpt__cuda_update_coefs_kernel<<<1, 1, 0, c->stream>>>(*d, u->state, s->coefs);
    mpt__cuda_launched(c, "mpt__cuda_update_coefs_kernel");
    U.count = 0;
    U.first_block[0] = 0;
    for (int i = 0; i < u->n; i++) {
        mpt__cuda_update_tensor T;
        int rule, vec;
        if (u->count[i] <= 0) continue;
        T.w = u->value[i];
        T.g = u->grad[i];
        T.s0 = u->slot0 ? u->slot0[i] : NULL;
        T.s1 = u->slot1 ? u->slot1[i] : NULL;
        T.acc = u->accum ? u->accum[i] : NULL;
        T.compute = u->compute && u->compute[i] != (void *)u->value[i] ? u->compute[i] : NULL;
        T.compute_dtype = u->compute_dtype ? u->compute_dtype[i] : MPT_FLOAT32;
        T.no_decay = u->no_decay ? u->no_decay[i] : 0;
        T.n = u->count[i];
        if (d->type != MPT_OPTIMIZER_SGD) rule = MPT__CUDA_RULE_ADAM;
        else if (!T.s0) rule = MPT__CUDA_RULE_SGD;
        else rule = d->nesterov ? MPT__CUDA_RULE_NESTEROV : MPT__CUDA_RULE_MOMENTUM;
        vec = mpt__cuda_train_aligned(T.w, 16) && mpt__cuda_train_aligned(T.g, 16) &&
              mpt__cuda_train_aligned(T.s0, 16) && mpt__cuda_train_aligned(T.s1, 16) &&
              mpt__cuda_train_aligned(T.acc, 16) &&
              mpt__cuda_train_aligned(T.compute, T.compute_dtype == MPT_FLOAT32 ? 16 : 8);
        if (U.count == mpt__cuda_tensors_per_launch || (U.count > 0 && rule != table_rule))
            mpt__cuda_update_launch(c, s, &U, table_rule, u->state);
        table_rule = rule;
        U.t[U.count] = T;
        U.vec[U.count] = vec;
        U.first_block[U.count + 1] =
            U.first_block[U.count] + (int)mpt__cuda_blocks(vec ? (T.n + 3) / 4 : T.n,
                                                            mpt__cuda_train_threads);
        U.count++;
    }
    mpt__cuda_update_launch(c, s, &U, table_rule, u->state);
}

/* ---- loss scaling ------------------------------------------------------------ */

/* One thread: mpt.h's mpt__loss_scale_next (@backend-shared), the rule the
   CPU backend runs too. */
static __global__ void mpt__cuda_loss_scale_kernel(mpt_loss_scale_desc d, mpt_step_state *state) {
    mpt__loss_scale_next(&d, state);
}

static void mpt__cuda_loss_scale_update(void *impl, const mpt_loss_scale_desc *d,
                                        mpt_step_state *state) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_loss_scale_kernel<<<1, 1, 0, c->stream>>>(*d, state);
    mpt__cuda_launched(c, "mpt__cuda_loss_scale_kernel");
}

/* dst += src: four floats per thread and step where both are 16-byte
   aligned (a grid-stride loop), one at a time otherwise. */
static __global__ void mpt__cuda_add_kernel(float *dst, const float *src, int64_t n, int vec) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        for (; i < n / 4; i += stride) {
            float4 a = ((const float4 *)dst)[i], b = ((const float4 *)src)[i];
            a.x = __fadd_rn(a.x, b.x);
            a.y = __fadd_rn(a.y, b.y);
            a.z = __fadd_rn(a.z, b.z);
            a.w = __fadd_rn(a.w, b.w);
            ((float4 *)dst)[i] = a;
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    }
    for (; i < n; i += stride) dst[i] = __fadd_rn(dst[i], src[i]);
}

/* x *= alpha: four floats per thread and step where x is 16-byte aligned
   (a grid-stride loop), one at a time otherwise. */
static __global__ void mpt__cuda_scale_kernel(float *x, float alpha, int64_t n, int vec) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        for (; i < n / 4; i += stride) {
            float4 a = ((const float4 *)x)[i];
            a.x = __fmul_rn(a.x, alpha);
            a.y = __fmul_rn(a.y, alpha);
            a.z = __fmul_rn(a.z, alpha);
            a.w = __fmul_rn(a.w, alpha);
            ((float4 *)x)[i] = a;
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    }
    for (; i < n; i += stride) x[i] = __fmul_rn(x[i], alpha);
}

static void mpt__cuda_scale(void *impl, float *x, float alpha, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    int vec = (uintptr_t)x % 16 == 0;
    if (n <= 0) return;
    mpt__cuda_scale_kernel<<<mpt__cuda_blocks(vec ? (n + 3) / 4 : n, 256), 256, 0, c->stream>>>(
        x, alpha, n, vec);
    mpt__cuda_launched(c, "mpt__cuda_scale_kernel");
}

static void mpt__cuda_add(void *impl, float *dst, const float *src, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    int vec = ((uintptr_t)dst % 16 == 0) && ((uintptr_t)src % 16 == 0);
    if (n <= 0) return;
    mpt__cuda_add_kernel<<<mpt__cuda_blocks(vec ? (n + 3) / 4 : n, 256), 256, 0, c->stream>>>(
        dst, src, n, vec);
    mpt__cuda_launched(c, "mpt__cuda_add_kernel");
}

/* =============================================================================
   @cuda-qgemm  The int8 GEMM (mpt_qgemm's semantics, mpt.h @qgemm), on int8
   tensor cores
   =============================================================================

   C = Σ_k (A − a_zero_point)(B − b_zero_point) + bias, stored as int32 or
   requantized to int8 by @backend-shared's mpt__requantize_int8, the rule
   the CPU's mpt_qgemm runs: the same bits on both backends.

   THE SUMS. mma.sync m16n8k32 multiplies the raw bytes (s8·s8, or u8·s8
   for a uint8 A) into int32, exactly: |a·b| ≤ 255·128 and K ≤
   MPT_QGEMM_MAX_K keep Σ below 2^31. The zero points come in after, from
   each row's Σ A and each column's Σ B, summed (dp4a) from the tiles in
   shared memory while they are there:
       Σ (A − za)(B − zb) = Σ A·B − za·Σ B − zb·Σ A + K·za·zb,
   in int64, exact, before the bias and the one saturation to int32, so the
   int32 handed to the requantization is the CPU's to the bit. A tile's
   bytes past M, N or K are zeros and add nothing to any of these sums.

   THE TILES. A block of 4 warps computes 64×64 of C, 64 of depth per
   step, in two shared-memory stages (the next step's copies in flight
   while the warps multiply); each warp 32×32, as 2×4 mma tiles of 16×8.
   Both operands sit in shared memory depth-contiguous (A's rows, B's
   columns), rows padded to 80 bytes so that the 8 rows of 16 bytes one
   ldmatrix phase reads fall in 8 different 16-byte bank groups. A, and a
   transposed B (N×K), come by 16-byte cp.async where the pointer and the
   leading dimension allow; a K×N B comes in 16-byte rows of N and is
   turned around byte by byte on its way into shared memory. Unaligned
   operands go byte by byte. */

static constexpr int mpt__cuda_qgemm_tile = 64;    /* BM = BN = BK            */
static constexpr int mpt__cuda_qgemm_pitch = MPT__CUDA_QGEMM_PITCH; /* mpt.h */
static constexpr int mpt__cuda_qgemm_threads = 128;

typedef struct mpt__cuda_qgemm_args {
    mpt_qgemm_desc d;
    int32_t lo, hi;      /* the clamp, c_min/c_max resolved                 */
    int a_vec, b_vec;    /* 16-byte loads: pointer and leading dimension    */
} mpt__cuda_qgemm_args;

/* d += a·b for one 16×8×32 step, int32 accumulators; A's bytes as uint8
   when A_UNSIGNED, else int8; B's as int8. */
template <bool A_UNSIGNED>
static __device__ __forceinline__ void mpt__cuda_qgemm_mma(int32_t d[4], const uint32_t a[4],
                                                           const uint32_t b[2]) {
    if (A_UNSIGNED) MPT__CUDA_MMA_SYNC("m16n8k32.row.col.s32.u8.s8.s32", "+r");
    else MPT__CUDA_MMA_SYNC("m16n8k32.row.col.s32.s8.s8.s32", "+r");
}

/* A 64×64 byte tile of a depth-contiguous operand (rows × depth, leading
   dimension ld) from (r0, k0) into shared memory, zeros outside it: with
   vec, 16-byte cp.async copies (in flight until the caller waits; a
   depth tail reads only its bytes and zero-fills the rest), else byte by
   byte. */
static __device__ __forceinline__ void mpt__cuda_qgemm_load_rows(uint8_t *s, const uint8_t *g,
                                                                 int64_t rows, int64_t depth,
                                                                 int64_t ld, int64_t r0,
                                                                 int64_t k0, int vec) {
    constexpr int T = mpt__cuda_qgemm_tile, P = mpt__cuda_qgemm_pitch;
    for (int c = threadIdx.x; c < T * T / 16; c += mpt__cuda_qgemm_threads) {
        const int r = c / (T / 16), kc = (c % (T / 16)) * 16;
        const int64_t gr = r0 + r, gk = k0 + kc;
        uint8_t *dst = s + r * P + kc;
        if (vec) {
            const int64_t left = gr < rows && gk < depth ? depth - gk : 0;
            const int bytes = left < 16 ? (int)left : 16;
            mpt__cuda_gemm_cp_async(dst, bytes ? g + gr * ld + gk : g, bytes);
            continue;
        }
        for (int j = 0; j < 16; j++)
            dst[j] = gr < rows && gk + j < depth ? g[gr * ld + gk + j] : (uint8_t)0;
    }
}

/* A 64(depth)×64(columns) tile of a K×N row-major B from (k0, n0), stored
   turned around: shared row n holds column n's 64 depths. */
static __device__ __forceinline__ void mpt__cuda_qgemm_load_cols(uint8_t *s, const uint8_t *g,
                                                                 int64_t depth, int64_t cols,
                                                                 int64_t ld, int64_t k0,
                                                                 int64_t n0, int vec) {
    constexpr int T = mpt__cuda_qgemm_tile, P = mpt__cuda_qgemm_pitch;
    for (int c = threadIdx.x; c < T * T / 16; c += mpt__cuda_qgemm_threads) {
        const int kr = c / (T / 16), nc = (c % (T / 16)) * 16;
        const int64_t gk = k0 + kr, gn = n0 + nc;
        uint8_t v[16];
        if (vec && gk < depth && gn + 16 <= cols) {
            const uint4 w = *(const uint4 *)(g + gk * ld + gn);
            memcpy(v, &w, 16);
        } else {
            for (int j = 0; j < 16; j++)
                v[j] = gk < depth && gn + j < cols ? g[gk * ld + gn + j] : (uint8_t)0;
        }
        for (int j = 0; j < 16; j++) s[(nc + j) * P + kr] = v[j];
    }
}

/* Σ of one shared row's 64 bytes (uint8 when UNSIGNED, else int8), four
   at a time; each thread starts at its own word, spreading the banks. */
template <bool UNSIGNED>
static __device__ __forceinline__ int32_t mpt__cuda_qgemm_row_sum(const uint8_t *row, int t) {
    int32_t sum = 0;
#pragma unroll
    for (int j = 0; j < mpt__cuda_qgemm_tile / 4; j++) {
        const uint32_t w = ((const uint32_t *)row)[(j + t) % (mpt__cuda_qgemm_tile / 4)];
        if (UNSIGNED) sum = (int32_t)__dp4a(w, 0x01010101u, (uint32_t)sum);
        else sum = __dp4a((int)w, 0x01010101, sum);
    }
    return sum;
}

/* One stage of operands, A's and B's 64×64 bytes, into shared memory. */
template <bool TRANS_B>
static __device__ __forceinline__ void mpt__cuda_qgemm_load_stage(const mpt__cuda_qgemm_args &p,
                                                                  uint8_t *sa, uint8_t *sb,
                                                                  int64_t i0, int64_t j0,
                                                                  int64_t k0) {
    const mpt_qgemm_desc &d = p.d;
    mpt__cuda_qgemm_load_rows(sa, (const uint8_t *)d.a, d.m, d.k, d.lda, i0, k0, p.a_vec);
    if (TRANS_B)
        mpt__cuda_qgemm_load_rows(sb, (const uint8_t *)d.b, d.n, d.k, d.ldb, j0, k0, p.b_vec);
    else
        mpt__cuda_qgemm_load_cols(sb, (const uint8_t *)d.b, d.k, d.n, d.ldb, k0, j0, p.b_vec);
}

/* One 64×64 block of C: blockIdx.x the rows, blockIdx.y the columns. Two
   stages: the copies of depth step s + 1 are in flight while the warps
   multiply step s. Fragments come by ldmatrix (b16 matrices of 8 rows ×
   16 bytes: of each, thread t gets row t/4's bytes 4(t%4)..+3, which is
   the m16n8k32 s8 fragment's layout), at mpt.h's lane offsets, which
   tests/test_cuda_rules.c runs through ldmatrix and mma.sync emulated. */
template <bool A_UNSIGNED, bool TRANS_B>
static __global__ void __launch_bounds__(mpt__cuda_qgemm_threads)
    mpt__cuda_qgemm_kernel(mpt__cuda_qgemm_args p) {
    constexpr int T = mpt__cuda_qgemm_tile, P = mpt__cuda_qgemm_pitch;
    __shared__ __align__(16) uint8_t sa[2][T * P], sb[2][T * P];
    __shared__ int32_t row_sum[T], col_sum[T];
    const mpt_qgemm_desc &d = p.d;
    const int64_t i0 = (int64_t)blockIdx.x * T, j0 = (int64_t)blockIdx.y * T;
    const int64_t steps = (d.k + T - 1) / T;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int a_lane = mpt__cuda_qgemm_a_lane(lane), b_lane = mpt__cuda_qgemm_b_lane(lane);
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const bool want_row_sums = d.b_zero_point != 0, want_col_sums = d.a_zero_point != 0;
    int32_t acc[2][4][4] = {};
    int32_t my_sum = 0; /* thread t < 64: row t's Σ A; else column t − 64's Σ B */
    if (steps > 0) mpt__cuda_qgemm_load_stage<TRANS_B>(p, sa[0], sb[0], i0, j0, 0);
    mpt__cuda_gemm_cp_commit();
    for (int64_t step = 0; step < steps; step++) {
        const uint8_t *ca = sa[step & 1], *cb = sb[step & 1];
        if (step + 1 < steps)
            mpt__cuda_qgemm_load_stage<TRANS_B>(p, sa[(step + 1) & 1], sb[(step + 1) & 1], i0,
                                                j0, (step + 1) * T);
        mpt__cuda_gemm_cp_commit(); /* perhaps empty: the wait below counts groups */
        mpt__cuda_gemm_cp_wait<1>();
        __syncthreads();
        if (t < T && want_row_sums) my_sum += mpt__cuda_qgemm_row_sum<A_UNSIGNED>(ca + t * P, t);
        if (t >= T && want_col_sums) my_sum += mpt__cuda_qgemm_row_sum<false>(cb + (t - T) * P, t);
#pragma unroll
        for (int kk = 0; kk < T; kk += 32) {
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                mpt__cuda_gemm_ldmatrix4<false>(
                    a[mt], ca + (wm + mt * 16) * P + kk + a_lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt += 2) {
                uint32_t r[4];
                mpt__cuda_gemm_ldmatrix4<false>(r, cb + (wn + nt * 8) * P + kk + b_lane);
                b[nt][0] = r[0], b[nt][1] = r[1], b[nt + 1][0] = r[2], b[nt + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) mpt__cuda_qgemm_mma<A_UNSIGNED>(acc[mt][nt], a[mt], b[nt]);
        }
        __syncthreads(); /* before step + 2's copies overwrite this stage */
    }
    if (t < T) row_sum[t] = my_sum;
    else col_sum[t - T] = my_sum;
    __syncthreads();
    const int64_t za = d.a_zero_point, zb = d.b_zero_point;
    /* A rolled loop over the 2×4 mma tiles, so that the requantization's
       code exists four times, not 32 (mpt__cuda_pick). */
#pragma unroll 1
    for (int q = 0; q < 8; q++) {
        const int mt = q / 4, nt = q % 4;
        int32_t sums[4];
#pragma unroll
        for (int e = 0; e < 4; e++)
            sums[e] = mpt__cuda_pick<8>(q, [&](int r) { return acc[r / 4][r % 4][e]; });
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int li = wm + mt * 16 + mpt__cuda_qgemm_acc_row(lane, e);
            const int lj = wn + nt * 8 + mpt__cuda_qgemm_acc_col(lane, e);
            const int64_t i = i0 + li, j = j0 + lj;
            if (i >= d.m || j >= d.n) continue;
            int64_t v =
                (int64_t)sums[e] - za * col_sum[lj] - zb * row_sum[li] + d.k * za * zb;
            if (d.bias) v += d.bias[j];
            const int32_t sum = mpt__saturate_i32(v);
            if (d.c) {
                d.c[i * d.ldc + j] = sum;
            } else {
                const int64_t ch = d.per_channel ? j : 0;
                d.c_int8[i * d.ldc + j] = mpt__requantize_int8(
                    sum, d.multiplier[ch], (int)d.shift[ch], d.c_zero_point, p.lo, p.hi);
            }
        }
    }
}

template <bool A_UNSIGNED, bool TRANS_B>
static void mpt__cuda_qgemm_go(mpt__cuda *c, dim3 grid, const mpt__cuda_qgemm_args &p) {
    mpt__cuda_qgemm_kernel<A_UNSIGNED, TRANS_B><<<grid, mpt__cuda_qgemm_threads, 0, c->stream>>>(p);
}

static bool mpt__cuda_qgemm_aligned(const void *p, int64_t ld) {
    return (uintptr_t)p % 16 == 0 && ld % 16 == 0;
}

/* The table's qgemm: d checked as mpt_qgemm checks it (@backend). */
static mpt_status mpt__cuda_qgemm(void *impl, const mpt_qgemm_desc *d) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_qgemm_args p;
    const int64_t T = mpt__cuda_qgemm_tile;
    if (d->m <= 0 || d->n <= 0) return MPT_OK;
    if (d->b_packed)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "qgemm: b_packed is a CPU layout (mpt_qgemm_pack_b); the CUDA "
                              "backend reads b itself");
    if ((d->n + T - 1) / T > 65535)
        return mpt__cuda_fail(c, MPT_ERR_SHAPE, __FILE__, __LINE__,
                              "qgemm: n = %lld is more than the %lld columns one launch covers",
                              (long long)d->n, (long long)(65535 * T));
    memset(&p, 0, sizeof p);
    p.d = *d;
    p.lo = d->c_min || d->c_max ? d->c_min : -128;
    p.hi = d->c_min || d->c_max ? d->c_max : 127;
    p.a_vec = mpt__cuda_qgemm_aligned(d->a, d->lda);
    p.b_vec = mpt__cuda_qgemm_aligned(d->b, d->ldb);
    const dim3 grid((unsigned)((d->m + T - 1) / T), (unsigned)((d->n + T - 1) / T));
    if (d->a_unsigned) {
        if (d->trans_b) mpt__cuda_qgemm_go<true, true>(c, grid, p);
        else mpt__cuda_qgemm_go<true, false>(c, grid, p);
    } else {
        if (d->trans_b) mpt__cuda_qgemm_go<false, true>(c, grid, p);
        else mpt__cuda_qgemm_go<false, false>(c, grid, p);
    }
    mpt__cuda_launched(c, "mpt__cuda_qgemm_kernel");
    return MPT_OK;
}

/* =============================================================================
   @cuda-preload  Every kernel loaded when the backend is created
   =============================================================================

   Under lazy loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA
   12.2) a kernel is loaded at its first launch. The loss, norm, update,
   loss-scale and BatchNormalization-commit kernels first run in a
   training step, which fit records in a CUDA graph: their loading would
   fall inside the capture. So the backend loads all of this file's
   kernels when it is created on a device. The driver lists them (the
   module of any one of them holds every one, template instances
   included), so no list here can miss a new kernel. The driver functions
   come through the runtime (cudaGetDriverEntryPointByVersion): no -lcuda. */

typedef struct mpt__cuda_module_api {
    PFN_cuFuncGetModule_v11000 get_module;
    PFN_cuModuleGetFunctionCount_v12040 count;
    PFN_cuModuleEnumerateFunctions_v12040 enumerate;
    PFN_cuFuncIsLoaded_v12040 is_loaded;
    PFN_cuFuncLoad_v12040 load;
} mpt__cuda_module_api;

/* The five driver functions (CUDA 12.4 or newer); false when one is missing. */
static bool mpt__cuda_module_api_find(mpt__cuda_module_api *api) {
    struct {
        const char *name;
        void **fn;
        unsigned version;
    } want[5] = {{"cuFuncGetModule", (void **)&api->get_module, 11000},
                 {"cuModuleGetFunctionCount", (void **)&api->count, 12040},
                 {"cuModuleEnumerateFunctions", (void **)&api->enumerate, 12040},
                 {"cuFuncIsLoaded", (void **)&api->is_loaded, 12040},
                 {"cuFuncLoad", (void **)&api->load, 12040}};
    for (int i = 0; i < 5; i++) {
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        *want[i].fn = NULL;
        if (cudaGetDriverEntryPointByVersion(want[i].name, want[i].fn, want[i].version,
                                             cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess || !*want[i].fn) {
            (void)cudaGetLastError();
            return false;
        }
    }
    return true;
}

/* This file's kernels in the current device's context: *out (malloc'd,
   *n of them). Returns the name of the step that failed, or NULL. */
static const char *mpt__cuda_module_functions(const mpt__cuda_module_api *api, CUfunction **out,
                                              unsigned *n) {
    cudaFunction_t any = NULL;
    CUmodule module = NULL;
    *out = NULL;
    *n = 0;
    if (cudaGetFuncBySymbol(&any, (const void *)mpt__cuda_scale_kernel) != cudaSuccess) {
        (void)cudaGetLastError();
        return "cudaGetFuncBySymbol";
    }
    if (api->get_module(&module, (CUfunction)any) != CUDA_SUCCESS) return "cuFuncGetModule";
    if (api->count(n, module) != CUDA_SUCCESS) return "cuModuleGetFunctionCount";
    *out = (CUfunction *)calloc(*n ? *n : 1, sizeof(CUfunction));
    if (!*out) return "no host memory for the list of kernels";
    if (api->enumerate(*out, *n, module) != CUDA_SUCCESS) return "cuModuleEnumerateFunctions";
    return NULL;
}

/* Loads every kernel of this file on the current device. Best effort:
   where the driver cannot (false), each kernel still loads at its first
   launch, as before; test_cuda's count of unloaded kernels shows it. */
static bool mpt__cuda_load_kernels(void) {
    mpt__cuda_module_api api;
    CUfunction *functions = NULL;
    unsigned n = 0;
    if (!mpt__cuda_module_api_find(&api)) return false;
    bool loaded = !mpt__cuda_module_functions(&api, &functions, &n);
    for (unsigned i = 0; loaded && i < n; i++) loaded = api.load(functions[i]) == CUDA_SUCCESS;
    free(functions);
    return loaded;
}

/* mpt.h's declaration says what it counts. */
int mpt_cuda_kernels_unloaded(void) {
    mpt__cuda_module_api api;
    CUfunction *functions = NULL;
    unsigned n = 0;
    int unloaded = 0;
    if (!mpt__cuda_module_api_find(&api) || mpt__cuda_module_functions(&api, &functions, &n)) {
        free(functions);
        return -1;
    }
    for (unsigned i = 0; i < n && unloaded >= 0; i++) {
        CUfunctionLoadingState state = CU_FUNCTION_LOADING_STATE_UNLOADED;
        if (api.is_loaded(&state, functions[i]) != CUDA_SUCCESS) unloaded = -1;
        else unloaded += state != CU_FUNCTION_LOADING_STATE_LOADED;
    }
    free(functions);
    return unloaded;
}

/* =============================================================================
   @cuda-core  The core: memory, copies, synchronisation, graphs
   ============================================================================= */

/* One live device allocation: free() needs its size and category. */
struct mpt__cuda_allocation {
    void *ptr;
    size_t bytes;
    int category;
};

static const char *const mpt__cuda_category_name[MPT_MEMORY_COUNT_] = {
    "parameters", "gradients", "optimizer state", "weight copies", "activations", "workspace"};

/* "1.50 GiB", "12.0 MiB", "512 B": sizes in messages. */
static const char *mpt__cuda_bytes_text(char *buf, size_t size, double bytes) {
    const double kib = 1024.0, mib = kib * 1024, gib = mib * 1024;
    if (bytes >= gib) snprintf(buf, size, "%.2f GiB", bytes / gib);
    else if (bytes >= mib) snprintf(buf, size, "%.1f MiB", bytes / mib);
    else if (bytes >= kib) snprintf(buf, size, "%.1f KiB", bytes / kib);
    else snprintf(buf, size, "%.0f B", bytes);
    return buf;
}

/* A failed runtime call outside MPT__CU: the call's error is also CUDA's
   "last error", which would otherwise be blamed on the next kernel launch,
   so it is cleared here. */
static mpt_status mpt__cuda_call_failed(mpt__cuda *c, cudaError_t e, const char *call, int line) {
    (void)cudaGetLastError();
    return mpt__cuda_fail(c, e == cudaErrorMemoryAllocation ? MPT_ERR_OUT_OF_MEMORY
                                                            : MPT_ERR_UNSUPPORTED,
                          __FILE__, line, "%s: %s", call, cudaGetErrorString(e));
}

/* For the functions that return nothing (they only queue work): keeps the
   first failure for sync() to report, as a failed launch is kept. */
static void mpt__cuda_keep_error(mpt__cuda *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();
    if (c->pending == cudaSuccess) {
        c->pending = e;
        snprintf(c->pending_what, sizeof c->pending_what, "%s", what);
    }
}

/* Reports, once, the first failure kept since the last report. */
static mpt_status mpt__cuda_take_pending(mpt__cuda *c) {
    cudaError_t e = c->pending;
    if (e == cudaSuccess) return MPT_OK;
    c->pending = cudaSuccess;
    return mpt__cuda_fail(c, e == cudaErrorMemoryAllocation ? MPT_ERR_OUT_OF_MEMORY
                                                            : MPT_ERR_UNSUPPORTED,
                          __FILE__, __LINE__, "%s failed: %s", c->pending_what,
                          cudaGetErrorString(e));
}

/* Calls that wait for the device or allocate cannot be recorded in a graph. */
static mpt_status mpt__cuda_not_capturing(mpt__cuda *c, const char *what) {
    if (!c->capturing) return MPT_OK;
    return mpt__cuda_fail(c, MPT_ERR_STATE, __FILE__, __LINE__,
                          "%s: not allowed while a step is being captured", what);
}

static int64_t mpt__cuda_total_used(const mpt__cuda *c) {
    int64_t total = 0;
    for (int i = 0; i < MPT_MEMORY_COUNT_; i++) total += c->used[i];
    return total;
}

/* Whether `bytes` more stay within c->limit (0: no limit). */
static int mpt__cuda_within_limit(const mpt__cuda *c, size_t bytes) {
    int64_t headroom = c->limit - mpt__cuda_total_used(c);
    return c->limit <= 0 || (headroom >= 0 && (uint64_t)bytes <= (uint64_t)headroom);
}

/* MPT_ERR_OUT_OF_MEMORY with what was asked for, for what, and what is
   left: free device memory and, with a limit, the limit's headroom. */
static mpt_status mpt__cuda_out_of_memory(mpt__cuda *c, int category, size_t bytes, int line) {
    size_t free_bytes = 0, total_bytes = 0;
    char want[32], free_text[32], left[32], limit[32], limit_part[128] = "";
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    if (c->limit > 0) {
        int64_t headroom = c->limit - mpt__cuda_total_used(c);
        snprintf(limit_part, sizeof limit_part, "; %s left of the %s device_memory_limit",
                 mpt__cuda_bytes_text(left, sizeof left, (double)(headroom > 0 ? headroom : 0)),
                 mpt__cuda_bytes_text(limit, sizeof limit, (double)c->limit));
    }
    return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, line,
                          "out of memory on CUDA device %d: %s asked for %s (%llu bytes); "
                          "%s free on the device%s",
                          c->device, mpt__cuda_category_name[category],
                          mpt__cuda_bytes_text(want, sizeof want, (double)bytes),
                          (unsigned long long)bytes,
                          mpt__cuda_bytes_text(free_text, sizeof free_text, (double)free_bytes),
                          limit_part);
}

/* Room for one more entry in the allocation table (before cudaMalloc, so
   that a failure here leaves nothing allocated). */
static int mpt__cuda_reserve_entry(mpt__cuda *c) {
    if (c->allocation_count < c->allocation_capacity) return 1;
    int capacity = c->allocation_capacity ? 2 * c->allocation_capacity : 16;
    void *grown = realloc(c->allocations, sizeof(mpt__cuda_allocation) * (size_t)capacity);
    if (!grown) return 0;
    c->allocations = (mpt__cuda_allocation *)grown;
    c->allocation_capacity = capacity;
    return 1;
}

static int mpt__cuda_find_entry(const mpt__cuda *c, const void *ptr) {
    for (int i = 0; i < c->allocation_count; i++)
        if (c->allocations[i].ptr == ptr) return i;
    return -1;
}

static mpt_status mpt__cuda_alloc(void *impl, int category, size_t bytes, void **out) {
    mpt__cuda *c = (mpt__cuda *)impl;
    void *ptr = NULL;
    *out = NULL;
    if (category < 0 || category >= MPT_MEMORY_COUNT_)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "alloc: unknown memory category %d", category);
    if (bytes == 0) return MPT_OK;
    mpt_status s = mpt__cuda_not_capturing(c, "alloc");
    if (s != MPT_OK) return s;
    if (!mpt__cuda_within_limit(c, bytes))
        return mpt__cuda_out_of_memory(c, category, bytes, __LINE__);
    if (!mpt__cuda_reserve_entry(c))
        return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "alloc: no host memory for the table of device allocations");
    cudaError_t e = cudaMalloc(&ptr, bytes); /* 256-byte aligned */
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return mpt__cuda_out_of_memory(c, category, bytes, __LINE__);
    }
    if (e != cudaSuccess) return mpt__cuda_call_failed(c, e, "cudaMalloc", __LINE__);
    mpt__cuda_allocation *entry = &c->allocations[c->allocation_count++];
    entry->ptr = ptr;
    entry->bytes = bytes;
    entry->category = category;
    c->used[category] += (int64_t)bytes;
    if (c->used[category] > c->peak[category]) c->peak[category] = c->used[category];
    *out = ptr;
    return MPT_OK;
}

/* Frees what alloc returned (NULL and unknown pointers are ignored). The
   category of the allocation itself is the one credited back. While
   capturing, freeing would break the capture: the buffer is kept (destroy
   frees it) and capture_end reports the mistake. */
static void mpt__cuda_free(void *impl, int category, void *ptr) {
    mpt__cuda *c = (mpt__cuda *)impl;
    (void)category;
    int i = ptr ? mpt__cuda_find_entry(c, ptr) : -1;
    if (i < 0) return;
    if (c->capturing) {
        mpt__cuda_keep_error(c, cudaErrorStreamCaptureUnsupported, "free while capturing");
        return;
    }
    /* Work still queued may read the buffer: let it finish first. */
    mpt__cuda_keep_error(c, cudaStreamSynchronize(c->stream), "free (waiting for the stream)");
    mpt__cuda_keep_error(c, cudaStreamSynchronize(c->copy_stream), "free (waiting for copies)");
    mpt__cuda_keep_error(c, cudaFree(ptr), "cudaFree");
    c->used[c->allocations[i].category] -= (int64_t)c->allocations[i].bytes;
    c->allocations[i] = c->allocations[--c->allocation_count];
}

/* Pinned host memory: upload_async copies from it while the host goes on. */
static mpt_status mpt__cuda_alloc_host(void *impl, size_t bytes, void **out) {
    mpt__cuda *c = (mpt__cuda *)impl;
    *out = NULL;
    if (bytes == 0) return MPT_OK;
    mpt_status s = mpt__cuda_not_capturing(c, "alloc_host");
    if (s != MPT_OK) return s;
    cudaError_t e = cudaMallocHost(out, bytes);
    if (e == cudaSuccess) return MPT_OK;
    *out = NULL;
    (void)cudaGetLastError();
    char want[32];
    return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                          "cudaMallocHost of %s (%llu bytes) of pinned host memory: %s",
                          mpt__cuda_bytes_text(want, sizeof want, (double)bytes),
                          (unsigned long long)bytes, cudaGetErrorString(e));
}

static void mpt__cuda_free_host(void *impl, void *ptr) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (!ptr) return;
    if (c->capturing) { /* as in free: not freed, reported by capture_end */
        mpt__cuda_keep_error(c, cudaErrorStreamCaptureUnsupported, "free_host while capturing");
        return;
    }
    mpt__cuda_keep_error(c, cudaFreeHost(ptr), "cudaFreeHost");
}

/* A copy between host and device queued on the compute stream after
   everything before it, returning once it is done (the host side may be
   pageable memory). what: "upload" or "download". */
static mpt_status mpt__cuda_copy_now(mpt__cuda *c, void *dst, const void *src, size_t bytes,
                                     cudaMemcpyKind kind, const char *what) {
    mpt_status s = mpt__cuda_not_capturing(c, what);
    if (s != MPT_OK) return s;
    MPT__CU(c, cudaMemcpyAsync(dst, src, bytes, kind, c->stream));
    MPT__CU(c, cudaStreamSynchronize(c->stream));
    return MPT_OK;
}

/* Synchronous: returns once host_src may be reused (it may be pageable). */
static mpt_status mpt__cuda_upload(void *impl, void *dst, const void *host_src, size_t bytes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (bytes == 0) return MPT_OK;
    return mpt__cuda_copy_now(c, dst, host_src, bytes, cudaMemcpyHostToDevice, "upload");
}

/* Waits for everything queued before it, so it also reports a failed
   launch, as sync does: the bytes would not mean anything otherwise. */
static mpt_status mpt__cuda_download(void *impl, void *host_dst, const void *src, size_t bytes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (bytes == 0) return MPT_OK;
    mpt_status s = mpt__cuda_copy_now(c, host_dst, src, bytes, cudaMemcpyDeviceToHost, "download");
    return s != MPT_OK ? s : mpt__cuda_take_pending(c);
}

/* A copy on the second stream, overlapping with compute queued after it.
   It is ordered after every compute call queued before it (the copy
   stream waits on a mark recorded on the compute stream), so it never
   overwrites a buffer an earlier kernel still reads. Not while capturing:
   the copy would not be part of the graph. */
static void mpt__cuda_upload_async(void *impl, void *dst, const void *host_src, size_t bytes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (bytes == 0) return;
    if (c->capturing) {
        mpt__cuda_keep_error(c, cudaErrorStreamCaptureUnsupported, "upload_async while capturing");
        return;
    }
    mpt__cuda_keep_error(c, cudaEventRecord(c->compute_mark, c->stream), "upload_async");
    mpt__cuda_keep_error(c, cudaStreamWaitEvent(c->copy_stream, c->compute_mark, 0),
                         "upload_async");
    mpt__cuda_keep_error(c, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice,
                                            c->copy_stream),
                         "upload_async");
    mpt__cuda_keep_error(c, cudaEventRecord(c->copy_done, c->copy_stream), "upload_async");
}

/* Compute queued after this waits for the last upload_async. Inside a
   capture the wait becomes an event-wait node of the graph, so that each
   replay waits for the upload_async issued before it. */
static void mpt__cuda_upload_wait(void *impl) {
    mpt__cuda *c = (mpt__cuda *)impl;
    unsigned flags = c->capturing ? cudaEventWaitExternal : cudaEventWaitDefault;
    mpt__cuda_keep_error(c, cudaStreamWaitEvent(c->stream, c->copy_done, flags), "upload_wait");
}

/* The host waits until the last upload_async has read its host buffer. */
static mpt_status mpt__cuda_upload_done(void *impl) {
    mpt__cuda *c = (mpt__cuda *)impl;
    MPT__CU(c, cudaEventSynchronize(c->copy_done));
    return MPT_OK;
}

static void mpt__cuda_copy(void *impl, void *dst, const void *src, size_t bytes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (bytes == 0) return;
    mpt__cuda_keep_error(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream),
                         "copy (cudaMemcpyAsync)");
}

/* mpt_backend.copy_rows: one thread a unit of U bytes, U the widest of
   16, 4, 2, 1 that every pointer, pitch and width is a multiple of. */
template <typename U>
static __global__ void mpt__cuda_copy_rows_kernel(unsigned char *dst, int64_t dst_pitch,
                                                  int64_t dst_plane, const unsigned char *src,
                                                  int64_t src_pitch, int64_t src_plane,
                                                  int64_t units, int64_t rows, int64_t total) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t u = i % units, r = i / units % rows, p = i / units / rows;
        *(U *)(dst + p * dst_plane + r * dst_pitch + u * (int64_t)sizeof(U)) =
            *(const U *)(src + p * src_plane + r * src_pitch + u * (int64_t)sizeof(U));
    }
}

/* Launches the kernel for units of U. */
template <typename U>
static void mpt__cuda_copy_rows_as(mpt__cuda *c, void *dst, int64_t dst_pitch, int64_t dst_plane,
                                   const void *src, int64_t src_pitch, int64_t src_plane,
                                   int64_t width, int64_t rows, int64_t planes) {
    const int64_t units = width / (int64_t)sizeof(U), total = units * rows * planes;
    if (total <= 0) return;
    mpt__cuda_copy_rows_kernel<U><<<mpt__cuda_blocks(total, 256), 256, 0, c->stream>>>(
        (unsigned char *)dst, dst_pitch, dst_plane, (const unsigned char *)src, src_pitch,
        src_plane, units, rows, total);
    mpt__cuda_launched(c, "copy_rows");
}

static void mpt__cuda_copy_rows(void *impl, void *dst, int64_t dst_pitch, int64_t dst_plane,
                                const void *src, int64_t src_pitch, int64_t src_plane,
                                int64_t width, int64_t rows, int64_t planes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const uint64_t all = (uint64_t)(uintptr_t)dst | (uint64_t)(uintptr_t)src |
                         (uint64_t)dst_pitch | (uint64_t)dst_plane | (uint64_t)src_pitch |
                         (uint64_t)src_plane | (uint64_t)width;
    if (all % 16 == 0)
        mpt__cuda_copy_rows_as<uint4>(c, dst, dst_pitch, dst_plane, src, src_pitch, src_plane,
                                      width, rows, planes);
    else if (all % 4 == 0)
        mpt__cuda_copy_rows_as<uint32_t>(c, dst, dst_pitch, dst_plane, src, src_pitch, src_plane,
                                         width, rows, planes);
    else if (all % 2 == 0)
        mpt__cuda_copy_rows_as<uint16_t>(c, dst, dst_pitch, dst_plane, src, src_pitch, src_plane,
                                         width, rows, planes);
    else
        mpt__cuda_copy_rows_as<uint8_t>(c, dst, dst_pitch, dst_plane, src, src_pitch, src_plane,
                                        width, rows, planes);
}

/* mpt_backend.gather_rows: one thread an element of y, moved as its bits
   (U the element's size); an id outside the table gives zeros, as the
   CPU's, and nothing outside the table is read. */
template <typename U>
static __global__ void mpt__cuda_gather_rows_kernel(U *y, const U *table, int64_t rows,
                                                    int64_t width, const int32_t *ids,
                                                    int64_t total) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t id = ids[i / width];
        y[i] = id >= 0 && id < rows ? table[id * width + i % width] : (U)0;
    }
}

static void mpt__cuda_gather_rows(void *impl, mpt_dtype dtype, void *y, const void *table,
                                  int64_t rows, int64_t width, const int32_t *ids, int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    const int64_t total = n * width;
    if (total <= 0) return;
    if (mpt_dtype_size(dtype) == 4)
        mpt__cuda_gather_rows_kernel<uint32_t><<<mpt__cuda_blocks(total, 256), 256, 0, c->stream>>>(
            (uint32_t *)y, (const uint32_t *)table, rows, width, ids, total);
    else if (mpt_dtype_size(dtype) == 2)
        mpt__cuda_gather_rows_kernel<uint16_t><<<mpt__cuda_blocks(total, 256), 256, 0, c->stream>>>(
            (uint16_t *)y, (const uint16_t *)table, rows, width, ids, total);
    else /* a resident dataset's uint8 images */
        mpt__cuda_gather_rows_kernel<uint8_t><<<mpt__cuda_blocks(total, 256), 256, 0, c->stream>>>(
            (uint8_t *)y, (const uint8_t *)table, rows, width, ids, total);
    mpt__cuda_launched(c, "gather_rows");
}

/* mpt_backend.scatter_add_rows: a thread owns one column of a range of
   table rows (blockIdx.y the range): it zeroes it, then adds the column
   of every dy row whose id falls in the range, in the order of the ids.
   So each sum is the CPU's, in its order and bits, with no atomics. */
template <typename T>
static __global__ void mpt__cuda_scatter_add_rows_kernel(float *dtable, int64_t rows,
                                                         int64_t width, const T *dy,
                                                         const int32_t *ids, int64_t n,
                                                         int64_t per_range) {
    const int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t r0 = (int64_t)blockIdx.y * per_range;
    const int64_t r1 = r0 + per_range < rows ? r0 + per_range : rows;
    if (col >= width) return;
    for (int64_t r = r0; r < r1; r++) dtable[r * width + col] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (id < r0 || id >= r1) continue;
        float *d = dtable + id * width + col;
        *d = __fadd_rn(*d, mpt__cuda_layers_widen(dy[i * width + col]));
    }
}

/* Ranges of table rows, at most: each range's threads scan every id. */
#define MPT__CUDA_SCATTER_RANGES 256

static void mpt__cuda_scatter_add_rows(void *impl, mpt_dtype dtype, float *dtable, int64_t rows,
                                       int64_t width, const void *dy, const int32_t *ids,
                                       int64_t n) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (rows <= 0 || width <= 0) return;
    const int64_t per = (rows + MPT__CUDA_SCATTER_RANGES - 1) / MPT__CUDA_SCATTER_RANGES;
    const dim3 grid((unsigned)((width + 127) / 128), (unsigned)((rows + per - 1) / per));
    mpt__cuda_layers_dispatch(dtype, [&](auto tag) {
        typedef decltype(tag) T;
        mpt__cuda_scatter_add_rows_kernel<T>
            <<<grid, 128, 0, c->stream>>>(dtable, rows, width, (const T *)dy, ids, n, per);
    });
    mpt__cuda_launched(c, "scatter_add_rows");
}

static void mpt__cuda_zero(void *impl, void *dst, size_t bytes) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (bytes == 0) return;
    mpt__cuda_keep_error(c, cudaMemsetAsync(dst, 0, bytes, c->stream), "zero (cudaMemsetAsync)");
}

/* Waits for the stream, then reports the first failed launch since the
   last report, by the kernel's name. */
static mpt_status mpt__cuda_sync(void *impl) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt_status s = mpt__cuda_not_capturing(c, "sync");
    if (s != MPT_OK) return s;
    MPT__CU(c, cudaStreamSynchronize(c->stream));
    return mpt__cuda_take_pending(c);
}

static const char *mpt__cuda_error(void *impl) {
    return ((mpt__cuda *)impl)->error;
}

/* ---- graphs: a training step recorded once, replayed every step --------------------------

   capture_begin..capture_end records what the compute calls queue on the
   stream instead of running it (thread-local mode: this thread may not
   allocate, free or synchronise meanwhile, which the not-capturing checks
   above turn into errors). upload_async must not be called inside. */

static mpt_status mpt__cuda_capture_begin(void *impl) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt_status s = mpt__cuda_not_capturing(c, "capture_begin");
    if (s != MPT_OK) return s;
    s = mpt__cuda_take_pending(c); /* an earlier failure is not the graph's */
    if (s != MPT_OK) return s;
    MPT__CU(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = 1;
    return MPT_OK;
}

/* Ends the capture (whatever fails, the stream is no longer capturing),
   and returns the instantiated graph (cudaGraphExec_t) as *graph. */
static mpt_status mpt__cuda_capture_end(void *impl, void **graph) {
    mpt__cuda *c = (mpt__cuda *)impl;
    cudaGraph_t recorded = NULL;
    cudaGraphExec_t exec = NULL;
    *graph = NULL;
    if (!c->capturing)
        return mpt__cuda_fail(c, MPT_ERR_STATE, __FILE__, __LINE__,
                              "capture_end: no capture_begin before it");
    cudaError_t e = cudaStreamEndCapture(c->stream, &recorded);
    c->capturing = 0;
    /* A launch that failed while recording invalidates the capture; its
       name says more than "capture invalidated". */
    if (c->pending != cudaSuccess || e != cudaSuccess) {
        if (recorded) cudaGraphDestroy(recorded);
        (void)cudaGetLastError();
        if (c->pending != cudaSuccess) return mpt__cuda_take_pending(c);
        return mpt__cuda_call_failed(c, e, "cudaStreamEndCapture", __LINE__);
    }
    e = cudaGraphInstantiate(&exec, recorded, 0);
    cudaGraphDestroy(recorded); /* the executable graph keeps its own copy */
    if (e != cudaSuccess) return mpt__cuda_call_failed(c, e, "cudaGraphInstantiate", __LINE__);
    *graph = (void *)exec;
    return MPT_OK;
}

static mpt_status mpt__cuda_replay(void *impl, void *graph) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (!graph)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "replay: no graph (NULL)");
    MPT__CU(c, cudaGraphLaunch((cudaGraphExec_t)graph, c->stream));
    return MPT_OK;
}

/* A graph still running is freed when it finishes. */
static void mpt__cuda_graph_free(void *impl, void *graph) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (graph) mpt__cuda_keep_error(c, cudaGraphExecDestroy((cudaGraphExec_t)graph), "graph_free");
}

/* ---- creation and destruction ------------------------------------------------------------ */

/* Frees what mpt__cuda_open created, the live allocations and c itself
   (the GEMM and training parts are torn down before). */
static void mpt__cuda_release(mpt__cuda *c) {
    for (int i = 0; i < c->allocation_count; i++) cudaFree(c->allocations[i].ptr);
    free(c->allocations);
    if (c->compute_mark) cudaEventDestroy(c->compute_mark);
    if (c->copy_done) cudaEventDestroy(c->copy_done);
    if (c->copy_stream) cudaStreamDestroy(c->copy_stream);
    if (c->stream) cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    free(c);
}

static void mpt__cuda_destroy(void *impl) {
    mpt__cuda *c = (mpt__cuda *)impl;
    if (!c) return;
    if (c->capturing) { /* abandoned mid-capture: end it, drop the graph */
        cudaGraph_t recorded = NULL;
        if (cudaStreamEndCapture(c->stream, &recorded) == cudaSuccess && recorded)
            cudaGraphDestroy(recorded);
        c->capturing = 0;
    }
    cudaStreamSynchronize(c->stream);
    cudaStreamSynchronize(c->copy_stream);
    mpt__cuda_train_destroy(c);
    mpt__cuda_gemm_destroy(c);
    mpt__cuda_release(c);
}

/* Formats a message into the caller's buffer (which may be absent). */
static void mpt__cuda_say(char *message, size_t size, const char *fmt, ...) {
    va_list ap;
    if (!message || size == 0) return;
    va_start(ap, fmt);
    vsnprintf(message, size, fmt, ap);
    va_end(ap);
}

/* Checks that desc->cuda_device exists and has bfloat16 tensor cores,
   makes it current and reads its properties. */
static mpt_status mpt__cuda_find_device(const mpt_context_desc *desc, cudaDeviceProp *prop,
                                        char *message, size_t size) {
    int count = 0, dev = desc->cuda_device;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        mpt__cuda_say(message, size, "no CUDA device (%s)",
                      e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports none");
        return MPT_ERR_UNSUPPORTED;
    }
    if (dev < 0 || dev >= count) {
        mpt__cuda_say(message, size, "cuda_device %d does not exist: %d CUDA device%s (0..%d)",
                      dev, count, count == 1 ? "" : "s", count - 1);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    if ((e = cudaSetDevice(dev)) != cudaSuccess ||
        (e = cudaGetDeviceProperties(prop, dev)) != cudaSuccess) {
        (void)cudaGetLastError();
        mpt__cuda_say(message, size, "CUDA device %d cannot be used (%s)", dev,
                      cudaGetErrorString(e));
        return MPT_ERR_UNSUPPORTED;
    }
    if (prop->major < 8) {
        mpt__cuda_say(message, size,
                      "CUDA device %d (%s) has compute capability %d.%d; the CUDA backend "
                      "needs 8.0 or newer (bfloat16 tensor cores)",
                      dev, prop->name, prop->major, prop->minor);
        return MPT_ERR_UNSUPPORTED;
    }
    return MPT_OK;
}

/* desc->gemm, unless $MPT_GEMM names another engine. */
static mpt_status mpt__cuda_choose_gemm(const mpt_context_desc *desc, mpt_gemm_engine *engine,
                                        char *message, size_t size) {
    const char *env = getenv("MPT_GEMM");
    if (desc->gemm != MPT_GEMM_AUTO && desc->gemm != MPT_GEMM_MPT &&
        desc->gemm != MPT_GEMM_CUBLASLT && desc->gemm != MPT_GEMM_WGMMA) {
        mpt__cuda_say(message, size, "unknown gemm engine %d in the context descriptor",
                      (int)desc->gemm);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    *engine = desc->gemm;
    if (!env || !*env) return MPT_OK;
    if (strcmp(env, "mpt") == 0) *engine = MPT_GEMM_MPT;
    else if (strcmp(env, "cublaslt") == 0) *engine = MPT_GEMM_CUBLASLT;
    else if (strcmp(env, "wgmma") == 0) *engine = MPT_GEMM_WGMMA;
    else if (strcmp(env, "auto") == 0) *engine = MPT_GEMM_AUTO;
    else {
        mpt__cuda_say(message, size,
                      "MPT_GEMM=\"%s\": expected \"mpt\", \"wgmma\", \"cublaslt\" or \"auto\"",
                      env);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    return MPT_OK;
}

/* The state, its two streams (neither synchronises with the legacy
   default stream) and its two events; on failure, why not in *message. */
static mpt_status mpt__cuda_open(const mpt_context_desc *desc, const cudaDeviceProp *prop,
                                 mpt_gemm_engine engine, mpt__cuda **out, char *message,
                                 size_t size) {
    const char *conv_env = getenv("MPT_CUDA_CONV");
    mpt__cuda *c;
    cudaError_t e;
    *out = NULL;
    if (conv_env && *conv_env && strcmp(conv_env, "im2col") != 0 &&
        strcmp(conv_env, "implicit") != 0) {
        mpt__cuda_say(message, size, "MPT_CUDA_CONV=\"%s\": expected \"implicit\" or \"im2col\"",
                      conv_env);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    c = (mpt__cuda *)calloc(1, sizeof(mpt__cuda));
    if (!c) {
        mpt__cuda_say(message, size, "no host memory for the CUDA backend's state");
        return MPT_ERR_OUT_OF_MEMORY;
    }
    c->device = desc->cuda_device;
    c->sm_count = prop->multiProcessorCount;
    c->gemm_engine = engine;
    c->limit = desc->device_memory_limit;
    c->index64 = getenv("MPT_CUDA_INDEX64") && !strcmp(getenv("MPT_CUDA_INDEX64"), "1");
    c->allow_tf32 = getenv("MPT_ALLOW_TF32") && !strcmp(getenv("MPT_ALLOW_TF32"), "1");
    c->conv_implicit = !conv_env || strcmp(conv_env, "im2col") != 0;
    c->logger = desc->logger;
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->copy_done, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->compute_mark, cudaEventDisableTiming)) != cudaSuccess) {
        mpt_status s = mpt__cuda_call_failed(c, e, "creating the streams and events", __LINE__);
        mpt__cuda_say(message, size, "CUDA device %d: %s", c->device, c->error);
        mpt__cuda_release(c);
        return s;
    }
    *out = c;
    return MPT_OK;
}

/* =============================================================================
   @cuda-nccl  Collectives over NCCL (built with -DMPT_NCCL, linked with -lnccl)
   =============================================================================

   A communicator joins replicas on different devices, in this process and
   possibly in others: each of this process's backends is one NCCL rank of
   its own (NCCL wants one device per rank). The all-reduce is queued on
   each backend's stream like any compute call, so it takes its place
   between the backward pass and the update, and it can be recorded in a
   CUDA graph: NCCL's collectives are capturable (all members must then be
   captured alike, and each replay runs them again on all of them).

   The sum is done in the order NCCL's algorithm (ring or tree, chosen by
   size and topology) takes; for one communicator and one count that
   choice is the same on every call, so a step repeats bit for bit. Every
   member receives the same bits. */

#ifdef MPT_NCCL
#include <nccl.h>

static_assert(sizeof(ncclUniqueId) == MPT_COMM_ID_BYTES,
              "mpt.h's MPT_COMM_ID_BYTES must hold NCCL's ncclUniqueId");

/* This process's part of a communicator: member first + k is impls[k],
   with its NCCL communicator comms[k]. */
typedef struct mpt__cuda_comm {
    int n;                      /* this process's members                  */
    int first;                  /* the member number of impls[0]           */
    int members;                /* members in all                          */
    mpt__cuda **impls;          /* (n)                                     */
    ncclComm_t *comms;          /* (n)                                     */
    char error[512];            /* comm_error()'s message                  */
} mpt__cuda_comm;

/* NCCL's result as an mpt status: a misuse is the caller's, the rest
   (CUDA, system, network, internal errors) the platform's. */
static mpt_status mpt__cuda_nccl_status(ncclResult_t r) {
    return r == ncclInvalidArgument || r == ncclInvalidUsage ? MPT_ERR_INVALID_ARGUMENT
                                                             : MPT_ERR_UNSUPPORTED;
}

/* Writes "<what>: <NCCL's words>; NCCL's last message: <...> (file:line)"
   into error and returns the matching status. NCCL's generic words for a
   result ("unhandled system error") say little; its last message names
   the cause, though it may be left over from an earlier failure. */
static mpt_status mpt__cuda_nccl_failed(char *error, size_t size, ncclResult_t r, int line,
                                        const char *what) {
    const char *last = ncclGetLastError(NULL);
    int has_last = last && *last;
    snprintf(error, size, "%s: %s%s%s (%s:%d)", what, ncclGetErrorString(r),
             has_last ? "; NCCL's last message: " : "", has_last ? last : "", __FILE__, line);
    (void)cudaGetLastError(); /* a CUDA failure inside NCCL: not the next kernel's */
    return mpt__cuda_nccl_status(r);
}

/* A failure found before NCCL was called, into the communicator's message. */
static mpt_status mpt__cuda_comm_fail(mpt__cuda_comm *m, mpt_status status, int line,
                                      const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mpt__cuda_vsay_at(m->error, sizeof m->error, __FILE__, line, fmt, ap);
    va_end(ap);
    return status;
}

/* Made on the process of member 0 and sent to the others: NCCL's unique id,
   whose bytes also name where that process listens for the others. */
static mpt_status mpt__cuda_comm_id(void *impl, void *id) {
    mpt__cuda *c = (mpt__cuda *)impl;
    ncclUniqueId unique;
    if (!id)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "comm_id: id is NULL");
    ncclResult_t r = ncclGetUniqueId(&unique);
    if (r != ncclSuccess)
        return mpt__cuda_nccl_failed(c->error, sizeof c->error, r, __LINE__, "ncclGetUniqueId");
    memcpy(id, &unique, sizeof unique);
    return MPT_OK;
}

/* The arguments of comm_create that NCCL would otherwise reject with a
   vaguer message (or a hang: two ranks on one device). */
static mpt_status mpt__cuda_comm_check(const mpt__cuda_comm *m, const void *id) {
    mpt__cuda *c0 = m->impls[0];
    if (!id && (m->first != 0 || m->members != m->n))
        return mpt__cuda_fail(c0, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "comm_create without an id joins this process's %d backends "
                              "alone (first 0, members %d), not members %d..%d of %d",
                              m->n, m->n, m->first, m->first + m->n - 1, m->members);
    for (int k = 0; k < m->n; k++) {
        const mpt__cuda *c = m->impls[k];
        if (c->capturing)
            return mpt__cuda_fail(c0, MPT_ERR_STATE, __FILE__, __LINE__,
                                  "comm_create: not allowed while a step is being captured "
                                  "(on CUDA device %d)",
                                  c->device);
        for (int j = 0; j < k; j++)
            if (m->impls[j]->device == c->device)
                return mpt__cuda_fail(c0, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                                      "comm_create: impls[%d] and impls[%d] are both CUDA "
                                      "device %d; each member needs a device of its own",
                                      j, k, c->device);
        /* Here, not inside the NCCL group below, where a failure would
           leave the ranks already queued waiting for the missing ones. */
        MPT__CU(c0, cudaSetDevice(c->device));
    }
    return MPT_OK;
}

/* Frees the object; its NCCL communicators are already gone or NULL. */
static void mpt__cuda_comm_free(mpt__cuda_comm *m) {
    if (!m) return;
    free(m->impls);
    free(m->comms);
    free(m);
}

/* The object for impls[0..n) (each an mpt__cuda *), comms all NULL. */
static mpt__cuda_comm *mpt__cuda_comm_new(void *const *impls, int n, int first, int members) {
    mpt__cuda_comm *m = (mpt__cuda_comm *)calloc(1, sizeof(mpt__cuda_comm));
    if (!m) return NULL;
    m->impls = (mpt__cuda **)calloc((size_t)n, sizeof(mpt__cuda *));
    m->comms = (ncclComm_t *)calloc((size_t)n, sizeof(ncclComm_t));
    if (!m->impls || !m->comms) {
        mpt__cuda_comm_free(m);
        return NULL;
    }
    m->n = n;
    m->first = first;
    m->members = members;
    for (int k = 0; k < n; k++) m->impls[k] = (mpt__cuda *)impls[k];
    return m;
}

/* One process alone: ncclCommInitAll makes the n ranks over the n devices
   at once (it needs no id). */
static mpt_status mpt__cuda_comm_init_all(mpt__cuda_comm *m) {
    mpt__cuda *c0 = m->impls[0];
    int *devices = (int *)malloc(sizeof(int) * (size_t)m->n);
    if (!devices)
        return mpt__cuda_fail(c0, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "comm_create: no host memory for the device list");
    for (int k = 0; k < m->n; k++) devices[k] = m->impls[k]->device;
    ncclResult_t r = ncclCommInitAll(m->comms, m->n, devices);
    free(devices);
    if (r == ncclSuccess) return MPT_OK;
    char what[96];
    snprintf(what, sizeof what, "ncclCommInitAll over %d devices", m->n);
    return mpt__cuda_nccl_failed(c0->error, sizeof c0->error, r, __LINE__, what);
}

/* Several processes: this process's ranks first .. first + n − 1, each
   created on its device. ncclCommInitRank blocks until every rank has
   joined, so this process's ranks are created together in one group. */
static mpt_status mpt__cuda_comm_init_ranks(mpt__cuda_comm *m, const void *id) {
    mpt__cuda *c0 = m->impls[0];
    ncclUniqueId unique;
    char what[128];
    memcpy(&unique, id, sizeof unique);
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return mpt__cuda_nccl_failed(c0->error, sizeof c0->error, r, __LINE__, "ncclGroupStart");
    snprintf(what, sizeof what, "ncclCommInitRank (members %d..%d of %d)", m->first,
             m->first + m->n - 1, m->members);
    cudaError_t e = cudaSuccess;
    for (int k = 0; k < m->n && r == ncclSuccess; k++) {
        /* NCCL takes the rank's device from the current one. */
        e = cudaSetDevice(m->impls[k]->device);
        if (e != cudaSuccess) break;
        r = ncclCommInitRank(&m->comms[k], m->members, unique, m->first + k);
        if (r != ncclSuccess)
            snprintf(what, sizeof what, "ncclCommInitRank (member %d of %d, CUDA device %d)",
                     m->first + k, m->members, m->impls[k]->device);
    }
    /* Always ends the group: after a failure inside it, the group is
       cancelled and reports that failure. */
    ncclResult_t end = ncclGroupEnd();
    if (e != cudaSuccess) return mpt__cuda_call_failed(c0, e, "cudaSetDevice", __LINE__);
    if (r == ncclSuccess) r = end;
    if (r == ncclSuccess) return MPT_OK;
    return mpt__cuda_nccl_failed(c0->error, sizeof c0->error, r, __LINE__, what);
}

/* impls[k] (mpt__cuda *) becomes member first + k of `members`. id NULL:
   this process's backends are all the members. On failure nothing is
   left behind and the message is in impls[0]'s error(). The current
   device is the caller's again on return. */
static mpt_status mpt__cuda_comm_create(void *const *impls, int n, int first, int members,
                                        const void *id, void **comm) {
    int caller_device = 0;
    if (comm) *comm = NULL;
    if (!impls || n < 1 || !impls[0]) return MPT_ERR_INVALID_ARGUMENT; /* nowhere to say why */
    mpt__cuda *c0 = (mpt__cuda *)impls[0];
    if (!comm)
        return mpt__cuda_fail(c0, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "comm_create: comm is NULL");
    if (first < 0 || members < 1 || n > members || first > members - n)
        return mpt__cuda_fail(c0, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "comm_create: members %d..%d of %d do not exist", first,
                              first + n - 1, members);
    for (int k = 1; k < n; k++)
        if (!impls[k])
            return mpt__cuda_fail(c0, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                                  "comm_create: impls[%d] is NULL", k);
    MPT__CU(c0, cudaGetDevice(&caller_device));
    mpt__cuda_comm *m = mpt__cuda_comm_new(impls, n, first, members);
    if (!m)
        return mpt__cuda_fail(c0, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "comm_create: no host memory for the communicator");
    mpt_status s = mpt__cuda_comm_check(m, id);
    if (s == MPT_OK) s = id ? mpt__cuda_comm_init_ranks(m, id) : mpt__cuda_comm_init_all(m);
    if (s != MPT_OK) {
        /* Ranks NCCL created before the failure (a failed group may leave
           some) are torn down without waiting for the others. */
        for (int k = 0; k < n; k++)
            if (m->comms[k]) (void)ncclCommAbort(m->comms[k]);
        mpt__cuda_comm_free(m);
        m = NULL;
    }
    if (cudaSetDevice(caller_device) != cudaSuccess) (void)cudaGetLastError();
    *comm = m;
    return s;
}

/* Waits for the work queued on every member (an all-reduce may still run),
   then finalises the ranks together (a single thread finalising its ranks
   one by one could wait on the next) and frees them; if finalising fails,
   they are aborted instead. */
static void mpt__cuda_comm_destroy(void *comm) {
    mpt__cuda_comm *m = (mpt__cuda_comm *)comm;
    int caller_device = 0;
    if (!m) return;
    if (cudaGetDevice(&caller_device) != cudaSuccess) (void)cudaGetLastError();
    for (int k = 0; k < m->n; k++)
        if (!m->impls[k]->capturing) (void)cudaStreamSynchronize(m->impls[k]->stream);
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
        for (int k = 0; k < m->n && r == ncclSuccess; k++)
            if (m->comms[k]) r = ncclCommFinalize(m->comms[k]);
        ncclResult_t end = ncclGroupEnd();
        if (r == ncclSuccess) r = end;
    }
    for (int k = 0; k < m->n; k++) {
        if (!m->comms[k]) continue;
        if (r == ncclSuccess) (void)ncclCommDestroy(m->comms[k]);
        else (void)ncclCommAbort(m->comms[k]);
    }
    (void)cudaGetLastError();
    if (cudaSetDevice(caller_device) != cudaSuccess) (void)cudaGetLastError();
    mpt__cuda_comm_free(m);
}

/* bufs[k] (count floats on impls[k]'s device) becomes the sum over all
   members, in place, queued on impls[k]'s stream: one group, so that NCCL
   launches this process's ranks together. Every member must call it with
   the same count. Returns once queued; a failure while running shows at
   the next sync. Inside a capture it becomes part of each member's graph
   (every member of this process must then be capturing). With several
   devices in one process, NCCL's manual warns that replaying graphs that
   hold collectives from one thread can deadlock (NCCL_GRAPH_MIXING_SUPPORT);
   one process per device is the safe way to combine the two. */
static mpt_status mpt__cuda_allreduce_sum(void *comm, float *const *bufs, int64_t count) {
    mpt__cuda_comm *m = (mpt__cuda_comm *)comm;
    if (!m) return MPT_ERR_INVALID_ARGUMENT; /* nowhere to say why */
    if (!bufs || count < 0)
        return mpt__cuda_comm_fail(m, MPT_ERR_INVALID_ARGUMENT, __LINE__,
                                   "allreduce_sum: %s", !bufs ? "bufs is NULL"
                                                              : "count is negative");
    if (count == 0) return MPT_OK; /* the same on every member: none calls NCCL */
    for (int k = 0; k < m->n; k++) {
        if (!bufs[k])
            return mpt__cuda_comm_fail(m, MPT_ERR_INVALID_ARGUMENT, __LINE__,
                                       "allreduce_sum: bufs[%d] is NULL", k);
        if (m->impls[k]->capturing != m->impls[0]->capturing)
            return mpt__cuda_comm_fail(m, MPT_ERR_STATE, __LINE__,
                                       "allreduce_sum: CUDA device %d is capturing a step and "
                                       "CUDA device %d is not; this process's members must "
                                       "be captured alike",
                                       m->impls[0]->capturing ? m->impls[0]->device
                                                              : m->impls[k]->device,
                                       m->impls[0]->capturing ? m->impls[k]->device
                                                              : m->impls[0]->device);
    }
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return mpt__cuda_nccl_failed(m->error, sizeof m->error, r, __LINE__, "ncclGroupStart");
    int failed = -1;
    for (int k = 0; k < m->n; k++) {
        /* Count is a size_t for NCCL: no 2^31 limit. */
        r = ncclAllReduce(bufs[k], bufs[k], (size_t)count, ncclFloat, ncclSum, m->comms[k],
                          m->impls[k]->stream);
        if (r != ncclSuccess) {
            failed = k;
            break;
        }
    }
    ncclResult_t end = ncclGroupEnd(); /* cancels the group after a failure */
    if (r == ncclSuccess) r = end;
    if (r == ncclSuccess) return MPT_OK;
    char what[160];
    if (failed >= 0)
        snprintf(what, sizeof what, "ncclAllReduce of %lld floats (member %d, CUDA device %d)",
                 (long long)count, m->first + failed, m->impls[failed]->device);
    else
        snprintf(what, sizeof what, "ncclGroupEnd (all-reduce of %lld floats over %d members)",
                 (long long)count, m->members);
    return mpt__cuda_nccl_failed(m->error, sizeof m->error, r, __LINE__, what);
}

static const char *mpt__cuda_comm_error(void *comm) {
    return comm ? ((mpt__cuda_comm *)comm)->error : "no communicator (NULL)";
}
#endif /* MPT_NCCL */

/* =============================================================================
   @cuda-table  The table: every entry on its device, timers, devices
   ============================================================================= */

/* ---- every entry on its context's device ---------------------------------------------------

   The runtime queues work on the calling thread's current device, and the
   replicas of a mirrored model on several GPUs all run from one thread: a
   kernel launched for device 1 while device 0 is current would go to the
   wrong device (a launch into another device's stream fails). So each
   table function that takes an impl enters impl's device first: one
   cudaGetDevice (the runtime's thread-local record) and a cudaSetDevice
   only when the device differs. A failed switch is kept for the next sync
   like a failed launch. */
static void mpt__cuda_enter(mpt__cuda *c) {
    int current = -1;
    if (!c || (cudaGetDevice(&current) == cudaSuccess && current == c->device)) return;
    mpt__cuda_keep_error(c, cudaSetDevice(c->device), "cudaSetDevice (entering the device)");
}

/* mpt__cuda_entered<f>::call: f behind mpt__cuda_enter, for every slot
   whose first argument is the impl; the table holds only these. */
template <auto F> struct mpt__cuda_entered;
template <typename R, typename... Args, R (*F)(void *, Args...)>
struct mpt__cuda_entered<F> {
    static R call(void *impl, Args... args) {
        mpt__cuda_enter((mpt__cuda *)impl);
        return F(impl, args...);
    }
};
#define MPT__CUDA_ENTRY(f) (&mpt__cuda_entered<f>::call)

/* ---- timing markers (the profiler's) ------------------------------------------

   A timer is `count` events, recorded on the compute stream as the steps
   are queued and read once after the last: nothing in between waits. */
typedef struct mpt__cuda_timer {
    int count;
    cudaEvent_t *events; /* (count) */
} mpt__cuda_timer;

static void mpt__cuda_timer_free(void *impl, void *timer) {
    mpt__cuda_timer *t = (mpt__cuda_timer *)timer;
    (void)impl;
    if (!t) return;
    for (int i = 0; i < t->count; i++)
        if (t->events[i]) cudaEventDestroy(t->events[i]);
    free(t->events);
    free(t);
}

static mpt_status mpt__cuda_timer_create(void *impl, int count, void **timer) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_timer *t = (mpt__cuda_timer *)calloc(1, sizeof *t);
    *timer = NULL;
    if (t) t->events = (cudaEvent_t *)calloc(count > 0 ? (size_t)count : 1, sizeof(cudaEvent_t));
    if (!t || !t->events) {
        free(t);
        return mpt__cuda_fail(c, MPT_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                              "timer_create: %d events", count);
    }
    t->count = count;
    MPT__CU(c, cudaSetDevice(c->device));
    for (int i = 0; i < count; i++) {
        cudaError_t e = cudaEventCreate(&t->events[i]);
        if (e != cudaSuccess) {
            t->events[i] = NULL;
            mpt__cuda_timer_free(impl, t);
            return mpt__cuda_call_failed(c, e, "cudaEventCreate", __LINE__);
        }
    }
    *timer = t;
    return MPT_OK;
}

static void mpt__cuda_timer_mark(void *impl, void *timer, int index) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_timer *t = (mpt__cuda_timer *)timer;
    if (!t || index < 0 || index >= t->count) return;
    (void)cudaEventRecord(t->events[index], c->stream);
    mpt__cuda_launched(c, "cudaEventRecord (a profiler marker)");
}

static mpt_status mpt__cuda_timer_read(void *impl, void *timer, int count, double *seconds) {
    mpt__cuda *c = (mpt__cuda *)impl;
    mpt__cuda_timer *t = (mpt__cuda_timer *)timer;
    if (!t || count < 1 || count > t->count)
        return mpt__cuda_fail(c, MPT_ERR_INVALID_ARGUMENT, __FILE__, __LINE__,
                              "timer_read: %d markers of %d", count, t ? t->count : 0);
    MPT__CU(c, cudaEventSynchronize(t->events[count - 1]));
    for (int i = 0; i < count; i++) {
        float ms = 0;
        MPT__CU(c, cudaEventElapsedTime(&ms, t->events[0], t->events[i]));
        seconds[i] = 1e-3 * (double)ms;
    }
    return MPT_OK;
}

/* The table, filled by name (C++17 has no designated initializers), so
   that a member added to mpt_backend cannot shift the others. Every slot
   that takes an impl first enters its device (error only reads a string;
   the collectives take several devices and switch between them). */
static mpt_backend mpt__cuda_table_filled(void) {
    mpt_backend t;
    memset(&t, 0, sizeof t);
    t.name = "cuda";
    t.gemm_rounds_c = 1;
    t.can_capture = 1;
    /* Conv2D's im2col chunks: each costs a few launches, so few and large
       (on an H200, the CNN's 32->32 3x3 Conv2D at batch 1024 took 8.4 ms
       a step in the CPU's 2^20-element chunks: 171 of them). 2^26
       elements are 128 MiB of float16 cols: batch 128 in one chunk. */
    t.conv_cols_budget = (int64_t)1 << 26;
    t.alloc = MPT__CUDA_ENTRY(mpt__cuda_alloc);
    t.free = MPT__CUDA_ENTRY(mpt__cuda_free);
    t.alloc_host = MPT__CUDA_ENTRY(mpt__cuda_alloc_host);
    t.free_host = MPT__CUDA_ENTRY(mpt__cuda_free_host);
    t.upload = MPT__CUDA_ENTRY(mpt__cuda_upload);
    t.download = MPT__CUDA_ENTRY(mpt__cuda_download);
    t.upload_async = MPT__CUDA_ENTRY(mpt__cuda_upload_async);
    t.upload_wait = MPT__CUDA_ENTRY(mpt__cuda_upload_wait);
    t.upload_done = MPT__CUDA_ENTRY(mpt__cuda_upload_done);
    t.copy = MPT__CUDA_ENTRY(mpt__cuda_copy);
    t.zero = MPT__CUDA_ENTRY(mpt__cuda_zero);
    t.sync = MPT__CUDA_ENTRY(mpt__cuda_sync);
    t.error = mpt__cuda_error;
    t.destroy = MPT__CUDA_ENTRY(mpt__cuda_destroy);
    t.capture_begin = MPT__CUDA_ENTRY(mpt__cuda_capture_begin);
    t.capture_end = MPT__CUDA_ENTRY(mpt__cuda_capture_end);
    t.replay = MPT__CUDA_ENTRY(mpt__cuda_replay);
    t.graph_free = MPT__CUDA_ENTRY(mpt__cuda_graph_free);
    t.gemm = MPT__CUDA_ENTRY(mpt__cuda_gemm);
    t.gemm_plan = MPT__CUDA_ENTRY(mpt__cuda_gemm_plan);
    t.convert = MPT__CUDA_ENTRY(mpt__cuda_convert);
    t.lookup_u8 = MPT__CUDA_ENTRY(mpt__cuda_lookup_u8);
    t.activation = MPT__CUDA_ENTRY(mpt__cuda_activation);
    t.activation_grad = MPT__CUDA_ENTRY(mpt__cuda_activation_grad);
    t.column_sums = MPT__CUDA_ENTRY(mpt__cuda_column_sums);
    t.im2col = MPT__CUDA_ENTRY(mpt__cuda_im2col);
    t.col2im = MPT__CUDA_ENTRY(mpt__cuda_col2im);
    t.conv_direct = MPT__CUDA_ENTRY(mpt__cuda_conv_direct);
    t.pool_forward = MPT__CUDA_ENTRY(mpt__cuda_pool_forward);
    t.pool_backward = MPT__CUDA_ENTRY(mpt__cuda_pool_backward);
    t.pool_workspace = MPT__CUDA_ENTRY(mpt__cuda_pool_workspace);
    t.batchnorm_forward = MPT__CUDA_ENTRY(mpt__cuda_batchnorm_forward);
    t.batchnorm_backward = MPT__CUDA_ENTRY(mpt__cuda_batchnorm_backward);
    t.batchnorm_commit = MPT__CUDA_ENTRY(mpt__cuda_batchnorm_commit);
    t.batchnorm_workspace = MPT__CUDA_ENTRY(mpt__cuda_batchnorm_workspace);
    t.dropout = MPT__CUDA_ENTRY(mpt__cuda_dropout);
    t.loss = MPT__CUDA_ENTRY(mpt__cuda_loss);
    t.grad_stats = MPT__CUDA_ENTRY(mpt__cuda_grad_stats);
    t.update = MPT__CUDA_ENTRY(mpt__cuda_update);
    t.loss_scale_update = MPT__CUDA_ENTRY(mpt__cuda_loss_scale_update);
    t.add = MPT__CUDA_ENTRY(mpt__cuda_add);
    t.elementwise = MPT__CUDA_ENTRY(mpt__cuda_elementwise);
    t.copy_rows = MPT__CUDA_ENTRY(mpt__cuda_copy_rows);
    t.scale = MPT__CUDA_ENTRY(mpt__cuda_scale);
    t.qgemm = MPT__CUDA_ENTRY(mpt__cuda_qgemm);
#ifdef MPT_NCCL
    t.comm_id = mpt__cuda_comm_id;
    t.comm_create = mpt__cuda_comm_create;
    t.comm_destroy = mpt__cuda_comm_destroy;
    t.allreduce_sum = mpt__cuda_allreduce_sum;
    t.comm_error = mpt__cuda_comm_error;
#endif /* without NCCL the collectives stay NULL */
    t.timer_create = MPT__CUDA_ENTRY(mpt__cuda_timer_create);
    t.timer_mark = MPT__CUDA_ENTRY(mpt__cuda_timer_mark);
    t.timer_read = MPT__CUDA_ENTRY(mpt__cuda_timer_read);
    t.timer_free = MPT__CUDA_ENTRY(mpt__cuda_timer_free);
    t.gather_rows = MPT__CUDA_ENTRY(mpt__cuda_gather_rows);
    t.scatter_add_rows = MPT__CUDA_ENTRY(mpt__cuda_scatter_add_rows);
    t.layernorm_forward = MPT__CUDA_ENTRY(mpt__cuda_layernorm_forward);
    t.layernorm_backward = MPT__CUDA_ENTRY(mpt__cuda_layernorm_backward);
    t.layernorm_workspace = MPT__CUDA_ENTRY(mpt__cuda_layernorm_workspace);
    t.attention_forward = MPT__CUDA_ENTRY(mpt__cuda_attention_forward);
    t.attention_backward = MPT__CUDA_ENTRY(mpt__cuda_attention_backward);
    t.attention_workspace = MPT__CUDA_ENTRY(mpt__cuda_attention_workspace);
    return t;
}

/* One table for every device, filled once (a function-local static is
   initialized once even when several threads ask at the same time). */
static const mpt_backend *mpt__cuda_backend(void) {
    static const mpt_backend table = mpt__cuda_table_filled();
    return &table;
}

/* Takes desc->cuda_device. On success *message holds one line about the
   device for the log; on failure, why not (MPT_ERR_UNSUPPORTED: no usable
   device, the caller may fall back to the CPU). */
mpt_status mpt_cuda_backend_create(const mpt_context_desc *desc, const mpt_backend **table,
                                   void **impl, char *message, size_t message_size) {
    static const mpt_context_desc defaults = {};
    cudaDeviceProp prop;
    mpt_gemm_engine engine = MPT_GEMM_AUTO;
    mpt__cuda *c = NULL;
    mpt_status s;
    mpt__cuda_say(message, message_size, "%s", "");
    if (!table || !impl) {
        mpt__cuda_say(message, message_size, "mpt_cuda_backend_create: table or impl is NULL");
        return MPT_ERR_INVALID_ARGUMENT;
    }
    *table = NULL;
    *impl = NULL;
    if (!desc) desc = &defaults;
    if (desc->device_memory_limit < 0) {
        mpt__cuda_say(message, message_size, "device_memory_limit %lld is negative",
                      (long long)desc->device_memory_limit);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    if ((s = mpt__cuda_find_device(desc, &prop, message, message_size)) != MPT_OK) return s;
    if ((s = mpt__cuda_choose_gemm(desc, &engine, message, message_size)) != MPT_OK) return s;
    if ((s = mpt__cuda_open(desc, &prop, engine, &c, message, message_size)) != MPT_OK)
        return s;
    if ((s = mpt__cuda_gemm_init(c)) != MPT_OK) {
        mpt__cuda_say(message, message_size, "%s", c->error);
        mpt__cuda_release(c);
        return s;
    }
    if ((s = mpt__cuda_train_init(c)) != MPT_OK) {
        mpt__cuda_say(message, message_size, "%s", c->error);
        mpt__cuda_gemm_destroy(c);
        mpt__cuda_release(c);
        return s;
    }
    (void)mpt__cuda_load_kernels(); /* the device is current (find_device) */
    mpt__cuda_say(message, message_size, "CUDA device %d: %s (sm_%d%d, %d SMs, %.1f GiB)",
                  c->device, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                  (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
    *table = mpt__cuda_backend();
    *impl = c;
    return MPT_OK;
}

int mpt_cuda_allows_tf32(const void *impl) {
    return impl ? ((const mpt__cuda *)impl)->allow_tf32 : 0;
}

int64_t mpt_cuda_lt_refusals(const void *impl) {
    return impl ? ((const mpt__cuda *)impl)->lt_refusals : 0;
}

int64_t mpt_cuda_gemm_runs(const void *impl, mpt_gemm_engine engine) {
    if (!impl || engine < MPT_GEMM_MPT || engine > MPT_GEMM_WGMMA) return 0;
    return ((const mpt__cuda *)impl)->gemm_runs[engine];
}

int mpt_cuda_wgmma_ready(const void *impl) {
    const mpt__cuda *c = (const mpt__cuda *)impl;
    return c && c->gemm_cache && c->gemm_cache->wgmma;
}

/* ---- devices: what mpt_device_count and mpt_device_query report ---------- */

int mpt_cuda_device_count(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver, no device: nothing to list */
        return 0;
    }
    return count;
}

/* Free memory is the device's to say, so this makes `device` current for
   a moment (starting its primary context, as any use of it would) and then
   gives the calling thread its device back. */
mpt_status mpt_cuda_device_query(int device, mpt_device_info *out, char *message,
                                 size_t message_size) {
    cudaDeviceProp prop;
    size_t free_bytes = 0, total_bytes = 0;
    int previous = 0;
    cudaError_t e;
    mpt__cuda_say(message, message_size, "%s", "");
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess ||
        (e = cudaDriverGetVersion(&out->driver_version)) != cudaSuccess ||
        (e = cudaRuntimeGetVersion(&out->runtime_version)) != cudaSuccess ||
        (e = cudaGetDevice(&previous)) != cudaSuccess) {
        (void)cudaGetLastError();
        mpt__cuda_say(message, message_size, "CUDA device %d cannot be asked (%s)", device,
                      cudaGetErrorString(e));
        return MPT_ERR_UNSUPPORTED;
    }
    if ((e = cudaSetDevice(device)) == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mpt__cuda_say(message, message_size, "CUDA device %d (%s): no memory information (%s)",
                      device, prop.name, cudaGetErrorString(e));
        return MPT_ERR_UNSUPPORTED;
    }
    out->kind = MPT_DEVICE_CUDA;
    out->ordinal = device;
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->compute_major = prop.major;
    out->compute_minor = prop.minor;
    out->sm_count = prop.multiProcessorCount;
    out->memory_total = (int64_t)total_bytes;
    out->memory_free = (int64_t)free_bytes;
    return MPT_OK;
}

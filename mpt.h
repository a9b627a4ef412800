/* mpt.h — mixed-precision training of neural networks in one C header.

   FP16/BF16 compute, FP32 master weights, dynamic loss scaling, Keras-style
   layers, fit, callbacks and safetensors checkpoints, on the CPU or, with
   mpt_cuda.cu, on NVIDIA GPUs, and a mirrored (synchronous data-parallel)
   strategy over replicas, GPUs and MPI processes.

   Do this:
       #define MPT_IMPLEMENTATION
   before you include this file in *one* C or C++ file to create the
   implementation. Every other file includes it for the API alone.

       #include ...
       #define MPT_IMPLEMENTATION
       #include "mpt.h"

   Build line (pthreads, libm, zlib):
       cc -O2 my_trainer.c -lpthread -lm -lz -o my_trainer
   and for an NVIDIA GPU (compute capability 8.0 or later), the same file
   with the CUDA backend:
       nvcc -O3 -arch=sm_90 -DMPT_CUDA my_trainer.c mpt_cuda.cu \
            -lcublasLt -lcublas -lz -o my_trainer
   A program built so that finds no GPU says so and trains on the CPU.

   OPTIONAL DEFINES
       MPT_STATIC     make every function static to the implementing file.
       MPT_NO_SIMD    compile only the portable paths (no AVX2/AVX-512/F16C);
                      without it those paths are chosen at run time by CPUID.
       MPT_NO_ZLIB    build without zlib (no -lz): gzip-compressed IDX files
                      then give MPT_ERR_UNSUPPORTED; plain ones still load.
       MPT_CUDA       with mpt_cuda.cu: contexts take a CUDA device.
       MPT_MPI        multi-worker strategies over MPI (build with mpicc).

   ENVIRONMENT
       MPT_NUM_THREADS   threads of a context whose descriptor leaves
                         num_threads at 0 (default: the online CPUs).
       MPT_DEVICE        "cpu": train on the CPU even in a CUDA build.
       MPT_GEMM          "mpt" or "cublaslt": the GEMM a CUDA context runs
                         (default: per shape, measured once, the usual one
                         unless the other is more than 10% faster).
       MPT_GEMM_CHOICES  a file: AUTO's engine per shape and GPU model, read
                         by each CUDA context and appended to for each
                         shape it measures, so later runs take the same.
       MPT_CUDA_GEMM_TILE "64" or "128": the hand-written GEMM's tile
                         (default: 128 once its tiles fill the SMs).
       MPT_CUDA_INDEX64  "1": im2col/col2im index in 64 bits even below
                         2^31 elements (the same results; for tests).
       MPT_CUDA_GRAPHS   "0": fit queues every step's kernels instead of
                         recording the step once and replaying it.

   ONE COMPLETE EXAMPLE (an MLP on Fashion-MNIST, in mixed precision)

       mpt_context *ctx;
       mpt_context_create(&(mpt_context_desc){ 0 }, &ctx);
       mpt_dataset *train;
       mpt_dataset_load_mnist(ctx, "/usr/share/datasets/fashion-mnist", 0, &train);
       mpt_model *m;
       mpt_model_create(ctx, &(mpt_model_desc){
           .input_shape = { 28, 28, 1 }, .input_rank = 3,
           .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 42 }, &m);
       mpt_model_add_flatten(m, NULL);
       mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 1024,
                                                 .activation = MPT_ACT_RELU });
       mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10,
                                                 .activation = MPT_ACT_SOFTMAX });
       mpt_model_compile(m, &(mpt_compile_desc){
           .optimizer = { .type = MPT_OPTIMIZER_ADAM },
           .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
           .metrics = MPT_METRIC_ACCURACY });
       if (mpt_model_fit(m, train, &(mpt_fit_desc){
               .epochs = 20, .batch_size = 128, .verbose = 1 }) != MPT_OK)
           fprintf(stderr, "%s\n", mpt_context_error(ctx));
       mpt_model_save_weights(m, "mlp.safetensors");
       mpt_model_destroy(m);
       mpt_dataset_destroy(train);
       mpt_context_destroy(ctx);

   Underneath fit, the same steps are public: mpt_model_forward,
   mpt_loss_compute, mpt_model_backward, and every parameter's float32
   master and gradient (mpt_model_param); and, in the model's own memory
   (so on a GPU too), the pieces of fit's step: mpt_model_compute_loss,
   mpt_model_grad_stats, mpt_model_scale_grads, mpt_model_sgd_step.

   MIXED PRECISION IN ONE PAGE
   Under MPT_POLICY_MIXED_FLOAT16 (MIXED_BFLOAT16 alike, with bfloat16 for
   float16), the buffers of one training step and their dtypes:
       inputs               the first layer's compute dtype: the batch loader
                            converts each sample as it gathers it (uint8
                            pixels become x·scale + offset on the way)
       activations          each layer's compute dtype (float16); a layer
                            whose neighbour differs converts on the way in
       GEMMs, convolutions  float16 operands, float32 accumulation, then
                            rounded once to float16
       activation gradients float16 between layers (each layer's dtype);
                            inside a layer, dz = dy·act'(z) in float32, then
                            rounded once for the weight and input products
       parameter gradients  float32 (MPT_MEMORY_GRADS), times the loss scale
       masters              float32 (MPT_MEMORY_PARAMS): what the optimizer
                            updates and checkpoints store
       compute copies       float16 kernels (MPT_MEMORY_WEIGHT_COPY), what
                            the layers read; biases and BatchNormalization's
                            gamma and beta are read as float32
       optimizer moments    float32 (SGD's momentum, Adam's m and v)
       BatchNormalization   statistics, moving averages and arithmetic in
                            float32; x, y, dy, dx in float16
       the final softmax    float32 (Keras' advice, taken by default), so
                            the loss reads float32 probabilities or logits
       the loss             float32 math whatever the prediction's dtype;
                            sums in double
   Why scale the loss. The activation gradients between layers are stored
   in float16, whose smallest subnormal is 2^-24 ≈ 6e-8 (smallest normal
   2^-14 ≈ 6e-5) and largest finite value 65504: small gradients flush to
   zero. Multiplying the loss's gradient by the loss scale S (default 2^15)
   lifts them into range; every gradient after it carries the factor S,
   and the optimizer divides it out in float32. Dynamic loss scaling (the
   default with float16) finds the largest S that does not overflow: a step
   whose gradients hold inf or NaN is skipped (no weight, moment or
   statistic changes) and S halves; after 2000 finite steps in a row S
   doubles. Powers of two keep the scaling exact.
   Why float32 masters. An update lr·g smaller than half an ulp of w is
   lost when w is float16: at w = 1 the ulp is 2^-10 ≈ 1e-3, so an update
   of 1e-4 leaves w at 1, every step. The float32 master keeps it (its ulp
   at 1 is 2^-23), and the float16 copy is rewritten from the master after
   each update.
   Why bfloat16 needs no scaling. bfloat16 has float32's 8-bit exponent
   (the same range, down to about 1e-38) and 8 significant bits: gradients
   do not underflow, so the default loss-scale mode there is none; the
   float32 masters are still needed, as bfloat16's ulp is coarser still.
   Three different "scales", kept apart:
       the loss scale       S above, dynamic or fixed (mpt_loss_scale_desc),
                            read on the device from mpt_step_state
       the gradient weight  mpt_loss_args.grad_weight: under a strategy, a
                            replica's rows / the global batch, so that with
                            the mean over its own rows every sample weighs
                            1/global batch and the replicas' sum is the
                            mean's gradient; 1 without one (a step by
                            hand's mpt_model_compute_loss passes its
                            grad_scale in it)
       grad_scale           mpt_loss_desc.grad_scale: what the caller of
                            mpt_loss_compute (or mpt_model_compute_loss)
                            has the gradient multiplied by, e.g. its own
                            loss scale in a step by hand
   Where each step happens (CPU in this file; CUDA in mpt_cuda.cu):
       the step's order     mpt__queue_step, its tail mpt__queue_update
                            (@impl-training; the strategy's step too)
       inputs converted     mpt__dataset_gather (@impl-data),
                            mpt__forward_prepare (@impl-passes)
       final softmax        mpt__final_softmax_in_float32 (@impl-layers)
       loss × S × weight    mpt__cpu_loss (@impl-losses); mpt__cuda_loss
       finiteness check     mpt__cpu_grad_stats (@impl-optimizers);
                            mpt__cuda_grad_stats, mpt__cuda_norm_fold_kernel
       unscale and update   mpt__update_job_init, mpt__cpu_update
                            (@impl-optimizers); mpt__cuda_update_coefs_kernel,
                            mpt__cuda_update
       compute copies       mpt__update_span (@impl-optimizers);
                            mpt__cuda_update_scalar/_vec4; after loading or
                            editing a master: mpt_model_refresh_weights
       loss-scale rule      mpt__loss_scale_next (@backend-shared), run by
                            mpt__cpu_loss_scale_update and by
                            mpt__cuda_loss_scale_kernel; its defaults in
                            mpt__loss_scale_resolve (@impl-optimizers)
       statistics committed mpt__model_commit (@impl-passes), only when the
                            step was finite

   CONTENTS (each section has a banner; grep for "@section-name")
       @status       status codes, error strings, logging
       @context      the context: allocator, logger, thread pool, CPU features,
                     devices (mpt_device_count, mpt_device_query)
       @dtypes       dtypes, float16/bfloat16 conversions
       @tensors      shapes and tensors
       @gemm         the CPU matrix product
       @qgemm        the int8 matrix product (quantized inference)
       @rng          the counter-based random numbers
       @layers       layer descriptors and the sequential model
       @losses       loss functions
       @optimizers   optimizers, learning-rate schedules, loss scaling
       @training     compile, fit (its profiler, its out-of-memory recovery),
                     evaluate, predict, summary, history and its SVG plot
       @data         datasets: caller arrays, IDX files
       @callbacks    EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger,
                     TensorBoard
       @checkpoints  safetensors weights and full training state
       @strategy     data parallelism: mirrored replicas, MPI workers
       @quantize     post-training quantization: dynamic-range, full-integer
                     (calibrated), float16; the quantized model's layers
       @export       a model as a TFLite or ONNX file
     for backend implementers (mpt_cuda.cu sees these too):
       @backend      the table a compute backend implements (CPU, CUDA)
       @backend-shared  the rules both backends run: Philox, loss scaling (internal)
     implementation (MPT_IMPLEMENTATION), along the data flow:
       @impl-status       the status codes' strings
       @impl-context      thread pool, allocator, logging and errors, CPU features,
                          the devices
       @impl-dtypes       float16/bfloat16 conversions, scalar and SIMD
       @impl-tensors      tensors: allocation, wrapping, shapes
       @impl-activations  the activations the GEMM epilogue and layers share
       @impl-gemm         the CPU GEMM: blocking, packing, micro-kernels
       @impl-qgemm        the int8 GEMM: zero points, VNNI/AVX-512/AVX2, requantization
       @impl-rng          Philox for dropout masks and initial weights
       @impl-layers       the layer interface, the model: create, add, build
       @impl-passes       a batch in, forward and backward, a step by hand
       @impl-layer-helpers  what the layers share: workspace, GEMM, gradients
       @impl-dense        Dense
       @impl-flatten      Flatten
       @impl-activation   Activation
       @impl-windows      the window geometry of Conv2D and pooling
       @impl-conv2d       Conv2D
       @impl-pooling      MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D
       @impl-batchnorm    BatchNormalization
       @impl-dropout      Dropout
       @impl-losses       the losses, their gradients and metrics
       @impl-optimizers   descriptors, the fused update, loss scaling, compile
       @impl-data         datasets, IDX files, the batch loader
       @impl-training     the training loop, evaluate, predict, summary, history,
                          the end-of-fit summary, the history's SVG plot
       @impl-callbacks    the callbacks of @callbacks
       @impl-profiler     fit's profile_batch: steps timed piece by piece, a
                          Chrome trace, the per-layer table
       @impl-safetensors  the file format: dtypes, byte order, the JSON header
       @impl-checkpoints  the model in a file: what is saved, staging, loading
       @impl-strategy     replicas in this process, workers over MPI
       @impl-quantize     the quantized model's operations from the float
                          layers, BatchNormalization folded
       @impl-quantized-passes  a batch through them: float32, float16,
                          dynamic-range, int8
       @impl-quantized-model  calibration, mpt_model_quantize, predict,
                          evaluate, invoke, summary
       @impl-export       the plan both formats read: layers as steps, BN folded
       @impl-export-tflite  FlatBuffers, the TFLite graph and file
       @impl-export-onnx  the ONNX graph in protobuf (@impl-callbacks' encoder)
       @impl-cpu-backend  the CPU's implementation of the @backend table

   CONVENTIONS
       Public names start with mpt_, private ones with mpt__, macros and enum
       values with MPT_. Functions that can fail return mpt_status; on failure
       the context holds a message naming the layer, file, shape or value
       (mpt_context_error) and the logger has been told. Nothing aborts or
       exits on a caller's mistake. Sizes are int64_t. Images are NHWC.
       Descriptor structs are zero-initialised for defaults; each field's
       comment gives its default. A NULL descriptor means all defaults,
       everywhere; where a field is required, the error names it.

   LICENSE: MIT, at the end of this file.
*/
#ifndef MPT_H
#define MPT_H

#include <stddef.h>
#include <stdint.h>

#define MPT_VERSION "0.1.0"

#ifdef MPT_STATIC
#define MPTDEF static
#else
#define MPTDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* =============================================================================
   @status: status codes, error strings, logging
   ============================================================================= */

typedef enum mpt_status {
    MPT_OK = 0,
    MPT_ERR_INVALID_ARGUMENT = -1, /* a NULL, an unknown enum value, a bad number */
    MPT_ERR_SHAPE = -2,            /* shapes that do not fit together              */
    MPT_ERR_DTYPE = -3,            /* a dtype the operation does not take          */
    MPT_ERR_OUT_OF_MEMORY = -4,    /* an allocation failed                          */
    MPT_ERR_OVERFLOW = -5,         /* a size that does not fit in int64/size_t      */
    MPT_ERR_STATE = -6,            /* called in the wrong order (e.g. before build) */
    MPT_ERR_IO = -7,               /* a file could not be opened, read or written   */
    MPT_ERR_FORMAT = -8,           /* a file's contents are malformed               */
    MPT_ERR_UNSUPPORTED = -9,      /* valid, but not implemented by this build      */
    MPT_ERR_NUMERIC = -10          /* NaN or inf where a finite value is required   */
} mpt_status;

/* A short fixed description of a status ("shape mismatch"). */
MPTDEF const char *mpt_status_string(mpt_status status);

typedef enum mpt_log_level {
    MPT_LOG_ERROR = 0,
    MPT_LOG_WARNING = 1,
    MPT_LOG_INFO = 2
} mpt_log_level;

/* Receives every error and warning message. Default (fn NULL): errors and
   warnings go to stderr. */
typedef struct mpt_logger {
    void (*fn)(void *user_data, mpt_log_level level, const char *message);
    void *user_data;
} mpt_logger;

/* Memory for everything the context and its models own. Default (alloc
   NULL): malloc/free. alloc must return memory aligned to `alignment`
   (a power of two ≤ 4096) or NULL. */
typedef struct mpt_allocator {
    void *(*alloc)(void *user_data, size_t bytes, size_t alignment);
    void (*free)(void *user_data, void *ptr);
    void *user_data;
} mpt_allocator;

/* =============================================================================
   @context: allocator, logger, thread pool, CPU features
   ============================================================================= */

/* CPU features mpt.h may use; detected at run time. */
enum {
    MPT_CPU_AVX2 = 1 << 0,        /* AVX2 + FMA                    */
    MPT_CPU_F16C = 1 << 1,        /* float16 <-> float32 conversion */
    MPT_CPU_AVX512 = 1 << 2,      /* AVX-512 F, BW, DQ, VL          */
    MPT_CPU_AVX512_BF16 = 1 << 3, /* AVX-512 BF16 dot products      */
    MPT_CPU_AVX512_VNNI = 1 << 4  /* AVX-512 int8 dot products      */
};

/* Which GEMM a CUDA context runs: the hand-written tensor-core kernel in
   mpt_cuda.cu, or cuBLASLt's. */
typedef enum mpt_gemm_engine {
    MPT_GEMM_AUTO = 0,
    MPT_GEMM_MPT = 1,
    MPT_GEMM_CUBLASLT = 2
} mpt_gemm_engine;

typedef struct mpt_context_desc {
    int num_threads;         /* default 0: $MPT_NUM_THREADS, else the online CPUs */
    int disable_cpu_features;/* default 0: MPT_CPU_* bits never to use (tests use
                                this to run the portable paths)                */
    mpt_allocator allocator; /* default: malloc/free                          */
    mpt_logger logger;       /* default: errors and warnings to stderr        */
    /* Where models train. A build with -DMPT_CUDA takes a CUDA device unless
       use_cpu is set or $MPT_DEVICE is "cpu"; finding none, it says so and
       uses the CPU. Other builds always use the CPU. */
    int use_cpu;             /* default 0                                     */
    int cuda_device;         /* default 0: the first device                   */
    int64_t device_memory_limit; /* default 0: no limit but the device's;
                                    else bytes a context may allocate there   */
    mpt_gemm_engine gemm;    /* CUDA GEMMs; default (auto): $MPT_GEMM
                                ("mpt" or "cublaslt"), else per shape,
                                measured once, the usual engine unless the
                                other is more than 10% faster              */
} mpt_context_desc;

/* A context owns the thread pool, the allocator, the logger and the last
   error message. Use one context per host thread. */
typedef struct mpt_context mpt_context;

MPTDEF mpt_status mpt_context_create(const mpt_context_desc *desc, mpt_context **out);
MPTDEF void mpt_context_destroy(mpt_context *ctx);
/* The message of the last failure ("" if none). Valid until the next call. */
MPTDEF const char *mpt_context_error(const mpt_context *ctx);
MPTDEF int mpt_context_num_threads(const mpt_context *ctx);
/* The MPT_CPU_* bits this context uses (detected, minus the disabled ones). */
MPTDEF int mpt_context_cpu_features(const mpt_context *ctx);

/* ---- devices: what this build can train on ----------------------------------
   Device 0 is always the CPU; in a build with -DMPT_CUDA, devices 1..n are
   the CUDA devices the driver shows (mpt device i is cuda_device i - 1).
   A build without MPT_CUDA, or a machine without a GPU, has one device. */
typedef struct mpt_device_info {
    int kind;                  /* MPT_DEVICE_CPU or MPT_DEVICE_CUDA (the
                                  mpt_device of @tensors)                   */
    int ordinal;               /* CUDA's device number; 0 for the CPU      */
    char name[256];            /* "Intel(R) Xeon(R) ...", "NVIDIA H100 ..." */
    int64_t memory_total;      /* bytes: RAM for the CPU, the GPU's own    */
    int64_t memory_free;       /* bytes available now (MemAvailable for the
                                  CPU, cudaMemGetInfo's free for a GPU)    */
    /* the CPU */
    int cores;                 /* logical cores online                      */
    int cpu_features;          /* the MPT_CPU_* bits the CPU has (a context
                                  may use fewer: disable_cpu_features)     */
    char features[128];        /* the same as words: "avx2 fma f16c avx512f
                                  avx512bw avx512dq avx512vl avx512bf16
                                  avx512vnni"                              */
    /* a CUDA device */
    int compute_major, compute_minor; /* compute capability, e.g. 9, 0     */
    int sm_count;              /* streaming multiprocessors                 */
    int driver_version;        /* CUDA's encoding: 12040 is 12.4            */
    int runtime_version;       /* the runtime mpt_cuda.cu was built with    */
} mpt_device_info;

/* How many devices this build sees: 1 (the CPU) plus the CUDA devices. */
MPTDEF int mpt_device_count(const mpt_context *ctx);
/* Fills *out for device `index` (0: the CPU). A bad index or a device
   that cannot be asked fails with a message naming it. */
MPTDEF mpt_status mpt_device_query(mpt_context *ctx, int index, mpt_device_info *out);

/* =============================================================================
   @dtypes: dtypes, float16/bfloat16 conversions
   ============================================================================= */

typedef enum mpt_dtype {
    MPT_DTYPE_DEFAULT = 0, /* in descriptors: "inherit" (e.g. from the policy) */
    MPT_FLOAT32 = 1,
    MPT_FLOAT16 = 2,
    MPT_BFLOAT16 = 3,
    MPT_INT32 = 4,
    MPT_UINT8 = 5,
    MPT_INT8 = 6,
    MPT_DTYPE_COUNT_ = 7
} mpt_dtype;

MPTDEF const char *mpt_dtype_name(mpt_dtype dtype); /* "float16"; "?" if unknown */
MPTDEF size_t mpt_dtype_size(mpt_dtype dtype);      /* bytes; 0 if unknown      */
MPTDEF int mpt_dtype_is_float(mpt_dtype dtype);

/* IEEE binary16 and bfloat16 bit patterns. Conversions from float round to
   nearest even, keep subnormals, ±inf and NaN, and overflow to ±inf. A NaN
   keeps its sign, gets the quiet bit, and keeps its leading payload bits
   (cut when narrowing, zero-filled when widening), as the F16C and AVX-512
   instructions do; bfloat16 -> float is exact, bits and all. */
typedef uint16_t mpt_half;
typedef uint16_t mpt_bf16;

MPTDEF mpt_half mpt_float_to_half(float f);
MPTDEF float mpt_half_to_float(mpt_half h);
MPTDEF mpt_bf16 mpt_float_to_bf16(float f);
MPTDEF float mpt_bf16_to_float(mpt_bf16 b);

/* Converts n floating-point elements between any two of float32, float16
   and bfloat16 (vectorised where the context's CPU allows; bit-identical to
   the scalar functions above). dst and src must not overlap, unless they
   are the same buffer and the same dtype. */
MPTDEF mpt_status mpt_convert(mpt_context *ctx, mpt_dtype dst_dtype, void *dst,
                              mpt_dtype src_dtype, const void *src, int64_t n);

/* =============================================================================
   @tensors: shapes and tensors
   ============================================================================= */

#define MPT_MAX_RANK 4

typedef enum mpt_device { MPT_DEVICE_CPU = 0, MPT_DEVICE_CUDA = 1 } mpt_device;

/* A dense, row-major tensor. Images are NHWC. `owns_data` says whether
   mpt_tensor_free releases data; a borrowed tensor only points at it. */
typedef struct mpt_tensor {
    mpt_dtype dtype;
    int rank;                   /* 0..MPT_MAX_RANK                      */
    int64_t shape[MPT_MAX_RANK];
    mpt_device device;
    int device_index;
    void *data;
    int owns_data;
} mpt_tensor;

/* Allocates an owned, zero-filled tensor. Checks sizes for overflow. */
MPTDEF mpt_status mpt_tensor_alloc(mpt_context *ctx, mpt_tensor *t, mpt_dtype dtype,
                                   int rank, const int64_t *shape);
/* Makes a borrowed tensor over caller memory (nothing is copied). */
MPTDEF mpt_status mpt_tensor_wrap(mpt_context *ctx, mpt_tensor *t, mpt_dtype dtype,
                                  int rank, const int64_t *shape, void *data);
/* Frees an owned tensor's data and zeroes the struct; borrowed: zeroes only. */
MPTDEF void mpt_tensor_free(mpt_context *ctx, mpt_tensor *t);
MPTDEF int64_t mpt_tensor_count(const mpt_tensor *t); /* number of elements */
MPTDEF size_t mpt_tensor_bytes(const mpt_tensor *t);
/* Writes "(128, 28, 28, 1)" into buf (at most size bytes); returns buf. */
MPTDEF char *mpt_shape_format(char *buf, size_t size, int rank, const int64_t *shape);

/* =============================================================================
   @gemm: the CPU matrix product
   ============================================================================= */

typedef enum mpt_activation {
    MPT_ACT_NONE = 0, /* linear */
    MPT_ACT_RELU,
    MPT_ACT_GELU,     /* exact: x·Φ(x), as Keras' default (approximate=False) */
    MPT_ACT_SIGMOID,
    MPT_ACT_TANH,
    MPT_ACT_SOFTMAX,  /* over the last axis; computed in float32 */
    MPT_ACT_COUNT_
} mpt_activation;

/* "relu", "softmax", ...: the Keras name; "?" if unknown. */
MPTDEF const char *mpt_activation_name(mpt_activation act);

/* C = alpha · op(A) · op(B) + beta · C, then C = act(C + bias) when asked.
   op(A) is M×K, op(B) is K×N, C is M×N, all row-major with leading
   dimensions lda, ldb, ldc (in elements). A and B may be float32, float16
   or bfloat16 (both the same dtype); accumulation and C are float32.
   Work is split over rows and columns of C, never over K, so the result is
   the same whatever the thread count. */
typedef struct mpt_gemm_desc {
    int trans_a, trans_b;      /* default 0: A is M×K, B is K×N            */
    int64_t m, n, k;
    mpt_dtype ab_dtype;        /* default (0): float32                     */
    const void *a; int64_t lda;
    const void *b; int64_t ldb;
    float *c; int64_t ldc;
    float alpha;               /* default 0 is taken as 1 unless alpha_is_zero */
    int alpha_is_zero;         /* with it (or k = 0) A and B are not read  */
    float beta;                /* default 0: C is overwritten              */
    const float *bias;         /* default NULL; else n values added per row */
    mpt_activation activation; /* default none; softmax is not allowed here */
} mpt_gemm_desc;

MPTDEF mpt_status mpt_gemm(mpt_context *ctx, const mpt_gemm_desc *desc);

/* =============================================================================
   @qgemm: the int8 matrix product (integer inference, as TFLite and gemmlowp do it)
   =============================================================================

       C[m][n] = Σ_k (A[m][k] − a_zero_point) · (B[k][n] − b_zero_point) + bias[n]

   A is M×K row-major, int8 (or uint8 with a_unsigned), the activations;
   B holds the weights, K×N (a Dense kernel, in × units) or, with trans_b,
   N×K (TFLite's FULLY_CONNECTED weights [out, in], or Conv2D filters
   [out, h·w·in] against an im2col A). The sum is exact in int32: K is at
   most MPT_QGEMM_MAX_K, which keeps |Σ| ≤ 255·255·K below 2^31 for every
   pair of zero points; adding the bias saturates to int32.

   The result is stored as int32 in c, or requantized into int8 in c_int8:
       q = clamp(MultiplyByQuantizedMultiplier(acc, multiplier, shift)
                 + c_zero_point, c_min, c_max)
   with TFLite's rounding (a doubling high multiply that rounds ties up,
   then a right shift that rounds ties away from zero); multiplier and shift come
   from mpt_quantize_multiplier(input_scale · weight_scale / output_scale).
   c_min/c_max give fused ReLU (c_min = c_zero_point) and ReLU6. Work is
   split over rows and columns, never over K, and the arithmetic is
   integer, so the result is the same bit for bit on every thread count
   and SIMD path (AVX-512 VNNI, AVX-512, AVX2, portable C). A call
   allocates the packed copy of B (K·N bytes, twice that without VNNI).
   ----------------------------------------------------------------------------- */

#define MPT_QGEMM_MAX_K 32768 /* 255·255·32768 < 2^31 */

typedef struct mpt_qgemm_desc {
    int64_t m, n, k;
    const void *a; int64_t lda;   /* M×K int8 (uint8 with a_unsigned), row-major */
    int a_unsigned;               /* default 0: A is int8                       */
    int32_t a_zero_point;         /* default 0; in [-128, 127] ([0, 255] uint8)  */
    const int8_t *b; int64_t ldb; /* K×N, or N×K with trans_b                   */
    int trans_b;                  /* default 0: B is K×N                        */
    int32_t b_zero_point;         /* default 0 (symmetric weights); [-128, 127]  */
    const int32_t *bias;          /* default NULL; else n values added per row   */
    /* Exactly one of c and c_int8, both with leading dimension ldc. */
    int32_t *c;                   /* default NULL; the int32 result             */
    int8_t *c_int8;               /* default NULL; the requantized result       */
    int64_t ldc;
    /* Requantization (c_int8 only): positive multipliers, shifts in
       [-31, 30] (positive: left), one per column with per_channel. */
    const int32_t *multiplier;    /* default NULL (required with c_int8)        */
    const int32_t *shift;         /* default NULL (required with c_int8)        */
    int per_channel;              /* default 0: multiplier[0], shift[0] for all  */
    int32_t c_zero_point;         /* default 0; in [-128, 127]                  */
    int32_t c_min, c_max;         /* default (both 0): [-128, 127]              */
} mpt_qgemm_desc;

MPTDEF mpt_status mpt_qgemm(mpt_context *ctx, const mpt_qgemm_desc *desc);

/* TFLite's QuantizeMultiplier: real ≈ multiplier · 2^(shift − 31), with
   multiplier in [2^30, 2^31) rounded to nearest (ties away from zero) and
   shift ≤ 30 (larger reals saturate to 2^31 − 1, 30). 0.5 gives (2^30, 0),
   1 gives (2^30, 1), 0.25 gives (2^30, -1). A real that is not positive
   and finite, or so small (below about 2^-32) that it would round to a zero
   multiplier, is refused. */
MPTDEF mpt_status mpt_quantize_multiplier(mpt_context *ctx, double real, int32_t *multiplier,
                                          int32_t *shift);

/* =============================================================================
   @rng: counter-based random numbers (Philox4x32-10)
   ============================================================================= */

/* Four 32-bit random words for (key, counter): the same inputs give the same
   words on every machine, in any order, on any thread. */
MPTDEF void mpt_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo,
                           uint32_t out[4]);

/* =============================================================================
   @layers: layer descriptors and the sequential model
   ============================================================================= */

/* The Keras precision policies: variables are float32; the compute dtype
   is the policy's; a layer's `dtype` field overrides it. */
typedef enum mpt_policy {
    MPT_POLICY_FLOAT32 = 0,
    MPT_POLICY_MIXED_FLOAT16 = 1,
    MPT_POLICY_MIXED_BFLOAT16 = 2
} mpt_policy;

typedef enum mpt_initializer {
    MPT_INIT_DEFAULT = 0,      /* the layer's Keras default                  */
    MPT_INIT_GLOROT_UNIFORM,   /* U(±sqrt(6 / (fan_in + fan_out)))           */
    MPT_INIT_HE_NORMAL,        /* truncated normal, stddev sqrt(2 / fan_in)  */
    MPT_INIT_ZEROS,
    MPT_INIT_ONES,
    MPT_INIT_COUNT_
} mpt_initializer;

typedef enum mpt_padding { MPT_PADDING_VALID = 0, MPT_PADDING_SAME = 1 } mpt_padding;

/* Fields common to every layer descriptor come first in each. */
#define MPT_LAYER_COMMON_FIELDS                                                  \
    const char *name;   /* default: "dense", "dense_1", ... as Keras         */ \
    mpt_dtype dtype     /* compute dtype; default: the model's policy        */

typedef struct mpt_dense_desc {
    MPT_LAYER_COMMON_FIELDS;
    int64_t units;                      /* required, > 0                    */
    mpt_activation activation;          /* default none                     */
    int no_bias;                        /* default 0: a bias is used        */
    mpt_initializer kernel_initializer; /* default glorot_uniform          */
    mpt_initializer bias_initializer;   /* default zeros                    */
} mpt_dense_desc;

typedef struct mpt_conv2d_desc {
    MPT_LAYER_COMMON_FIELDS;
    int64_t filters;                    /* required, > 0                    */
    int64_t kernel_size[2];             /* required (kh, kw), > 0           */
    int64_t strides[2];                 /* default (1, 1)                   */
    mpt_padding padding;                /* default valid                    */
    mpt_activation activation;          /* default none                     */
    int no_bias;                        /* default 0: a bias is used        */
    mpt_initializer kernel_initializer; /* default glorot_uniform          */
    mpt_initializer bias_initializer;   /* default zeros                    */
} mpt_conv2d_desc;

typedef struct mpt_pool2d_desc {
    MPT_LAYER_COMMON_FIELDS;
    int64_t pool_size[2];               /* default (2, 2)                   */
    int64_t strides[2];                 /* default: pool_size               */
    mpt_padding padding;                /* default valid                    */
} mpt_pool2d_desc;

/* GlobalAveragePooling2D: the mean over each channel's whole image,
   (H, W, C) to (C); it has only the common fields. */
typedef struct mpt_global_pool2d_desc {
    MPT_LAYER_COMMON_FIELDS;
} mpt_global_pool2d_desc;

typedef struct mpt_batchnorm_desc {
    MPT_LAYER_COMMON_FIELDS;
    float momentum;                     /* default (0) 0.99; for a momentum of
                                           exactly 0 give a tiny value       */
    float epsilon;                      /* default (0) 1e-3; must be > 0     */
    int no_center;                      /* default 0: beta is used          */
    int no_scale;                       /* default 0: gamma is used         */
    int synchronized;                   /* default 0: under a strategy, each
                                           replica normalises with its own
                                           batch's statistics; 1: with those
                                           of the global batch (Keras'
                                           synchronized=True)              */
} mpt_batchnorm_desc;

typedef struct mpt_dropout_desc {
    MPT_LAYER_COMMON_FIELDS;
    float rate;                         /* required, in [0, 1)              */
    uint64_t seed;                      /* default 0: derived from the model's seed.
                                           The mask is a function of the seed,
                                           the model's step and the element. */
} mpt_dropout_desc;

typedef struct mpt_activation_desc {
    MPT_LAYER_COMMON_FIELDS;
    mpt_activation activation;          /* default none (identity)          */
} mpt_activation_desc;

typedef struct mpt_flatten_desc {
    MPT_LAYER_COMMON_FIELDS;
} mpt_flatten_desc;

/* Data parallelism (@strategy). */
typedef struct mpt_strategy mpt_strategy;

typedef struct mpt_model_desc {
    int64_t input_shape[MPT_MAX_RANK - 1]; /* required: one sample's shape,
                                              e.g. {28, 28, 1} (HWC)         */
    int input_rank;                         /* required: 1..3                 */
    mpt_policy policy;                      /* default float32                */
    uint64_t seed;                          /* default 0; weights and dropout
                                               masks follow from it          */
    mpt_strategy *strategy;                 /* default NULL: one replica      */
    /* Memory, as Keras' two ways with a GPU: by default (0) a model takes
       what its plan needs and no more (build plans every buffer once, see
       mpt_model_memory), the way memory_growth does; a limit caps it, like
       a memory_limit, on any backend: build (or compile, for the optimizer
       state) fails with MPT_ERR_OUT_OF_MEMORY, naming the category that
       would cross it, rather than take more. With a strategy each replica
       has this limit. The context's device_memory_limit caps a whole CUDA
       context besides. */
    int64_t memory_limit;                   /* default 0: no limit; else bytes */
} mpt_model_desc;

typedef struct mpt_model mpt_model;

MPTDEF mpt_status mpt_model_create(mpt_context *ctx, const mpt_model_desc *desc,
                                   mpt_model **out);
MPTDEF void mpt_model_destroy(mpt_model *model);

MPTDEF mpt_status mpt_model_add_dense(mpt_model *m, const mpt_dense_desc *desc);
MPTDEF mpt_status mpt_model_add_conv2d(mpt_model *m, const mpt_conv2d_desc *desc);
MPTDEF mpt_status mpt_model_add_max_pooling2d(mpt_model *m, const mpt_pool2d_desc *desc);
MPTDEF mpt_status mpt_model_add_average_pooling2d(mpt_model *m, const mpt_pool2d_desc *desc);
MPTDEF mpt_status mpt_model_add_global_average_pooling2d(mpt_model *m,
                                                         const mpt_global_pool2d_desc *desc);
MPTDEF mpt_status mpt_model_add_batch_normalization(mpt_model *m,
                                                    const mpt_batchnorm_desc *desc);
MPTDEF mpt_status mpt_model_add_dropout(mpt_model *m, const mpt_dropout_desc *desc);
MPTDEF mpt_status mpt_model_add_flatten(mpt_model *m, const mpt_flatten_desc *desc);
MPTDEF mpt_status mpt_model_add_activation(mpt_model *m, const mpt_activation_desc *desc);

/* Checks every layer's shapes, plans and allocates every buffer for batches
   of up to max_batch samples, and initialises the weights. After this, a
   forward or backward pass allocates nothing. */
MPTDEF mpt_status mpt_model_build(mpt_model *m, int64_t max_batch);

/* Runs the layers on x (batch, input_shape...), float32/float16/bfloat16.
   `out` receives a borrowed view of the last layer's output (its compute
   dtype), valid until the next forward. training: dropout active and
   BatchNormalization on batch statistics (updating its moving ones). */
MPTDEF mpt_status mpt_model_forward(mpt_model *m, const mpt_tensor *x, int training,
                                    mpt_tensor *out);
/* A borrowed view of the buffer that receives the gradient of the loss with
   respect to the output (same shape and dtype as forward's out). */
MPTDEF mpt_status mpt_model_output_grad(mpt_model *m, mpt_tensor *dout);
/* Backpropagates the output gradient (from dout, or NULL for what is already
   in mpt_model_output_grad's buffer) through every layer, overwriting each
   parameter's gradient. Requires a forward pass with training = 1.
   dinput (optional) receives a borrowed view of the gradient w.r.t. x, in
   the first layer's compute dtype. */
MPTDEF mpt_status mpt_model_backward(mpt_model *m, const mpt_tensor *dout,
                                     mpt_tensor *dinput);

/* Parameters (trainable and not), in layer order: "dense/kernel",
   "dense/bias", "batch_normalization/moving_mean", ... */
typedef struct mpt_param_info {
    const char *name;
    const char *layer_name;
    int trainable;
    mpt_tensor value;     /* float32 master copy, borrowed                 */
    mpt_tensor grad;      /* float32, borrowed; data NULL if not trainable */
} mpt_param_info;

MPTDEF int mpt_model_param_count(const mpt_model *m);
MPTDEF mpt_status mpt_model_param(mpt_model *m, int index, mpt_param_info *info);
/* Copies the float32 master weights into the compute-dtype copies the layers
   read. Call after changing a value tensor by hand. */
MPTDEF void mpt_model_refresh_weights(mpt_model *m);

/* A training step by hand, in the model's own memory (so also on a GPU):
   the pieces fit runs fused on the device, one call each, for a loop that
   shows them (examples/hand_loss_scaling.c). Each waits for the device
   where it returns a number (a host sync: fine for teaching, slow for a
   real loop). Not under a strategy (MPT_ERR_UNSUPPORTED). The loss is
   mpt_model_compute_loss (@losses).

   Whether every trainable gradient is finite (*all_finite, 1 or 0) and
   their global L2 norm √Σg² (*global_norm, inf or NaN when one is not),
   as they stand: with a loss scale in them, the norm is scale × the true
   one. Either output may be NULL. fit makes the same test, on the device,
   to skip a step and back the loss scale off. */
MPTDEF mpt_status mpt_model_grad_stats(mpt_model *m, int *all_finite, double *global_norm);
/* Every trainable gradient multiplied by factor (finite): 1/scale unscales
   them. fit folds this into its fused update, on the device. */
MPTDEF mpt_status mpt_model_scale_grads(mpt_model *m, float factor);
/* Plain SGD on every trainable parameter: w −= learning_rate · g on the
   float32 master (learning_rate finite, >= 0), then its compute-dtype copy
   rewritten from it. fit's update does this fused with the unscaling, the
   clipping and the other optimizers; this one takes no optimizer state. */
MPTDEF mpt_status mpt_model_sgd_step(mpt_model *m, float learning_rate);

/* One sample's input shape (as given to mpt_model_create); returns its rank. */
MPTDEF int mpt_model_input_shape(const mpt_model *m, int64_t *shape);
MPTDEF int mpt_model_layer_count(const mpt_model *m);
MPTDEF const char *mpt_model_layer_name(const mpt_model *m, int index);
/* The compute dtype a layer resolved to (after build). */
MPTDEF mpt_dtype mpt_model_layer_dtype(const mpt_model *m, int index);
/* One sample's output shape of a layer (after build); returns its rank. */
MPTDEF int mpt_model_layer_output_shape(const mpt_model *m, int index, int64_t *shape);
/* A layer's Keras class name ("Dense", "Conv2D", ...); NULL if no such layer. */
MPTDEF const char *mpt_model_layer_class_name(const mpt_model *m, int index);
/* The dtype of a layer's variables (Keras' variable_dtype): float32, the
   masters', under every policy; MPT_DTYPE_DEFAULT if no such layer. The
   compute dtype is mpt_model_layer_dtype's. */
MPTDEF mpt_dtype mpt_model_layer_variable_dtype(const mpt_model *m, int index);
/* The model's precision policy, as given to mpt_model_create. */
MPTDEF mpt_policy mpt_model_policy(const mpt_model *m);

/* The bytes a built model holds in its backend's memory, per category
   (@backend's MPT_MEMORY_*), each buffer rounded up to 64 bytes. Build
   plans and allocates them once (compile: the optimizer state) and
   training allocates no more, so this is also their peak during fit.
   With a strategy: one replica's. */
typedef struct mpt_memory_report {
    int64_t parameters;    /* float32 masters                                */
    int64_t gradients;     /* float32, of the trainable parameters           */
    int64_t optimizer;     /* optimizer state; 0 until compiled              */
    int64_t weight_copies; /* compute-dtype copies of the weights (mixed)    */
    int64_t activations;   /* outputs, saved buffers, gradients, batches     */
    int64_t workspace;     /* scratch the layers share                       */
    int64_t total;         /* the sum of the six                             */
    int64_t limit;         /* the model's memory_limit; 0: none              */
    int64_t host;          /* mpt_model_memory_peak only (else 0): the most
                              host memory the context held through its
                              allocator (batches, staging, history; on the
                              CPU backend the six categories' too)          */
} mpt_memory_report;

/* Fills *out; MPT_ERR_STATE before build. */
MPTDEF mpt_status mpt_model_memory(const mpt_model *m, mpt_memory_report *out);
/* The most each category held during the last fit, from its start to its
   end: more than mpt_model_memory's when fit halved its batch after
   running out of memory (the larger plan's), or profiled (its records are
   workspace); and `host`, the context's peak host bytes. MPT_ERR_STATE
   before a fit. */
MPTDEF mpt_status mpt_model_memory_peak(const mpt_model *m, mpt_memory_report *out);
/* The policy's Keras name: "float32", "mixed_float16", "mixed_bfloat16";
   "?" if unknown. */
MPTDEF const char *mpt_policy_name(mpt_policy policy);

/* =============================================================================
   @losses: loss functions
   ============================================================================= */

typedef enum mpt_loss_type {
    MPT_LOSS_NONE = 0,
    MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, /* target: int32 class ids (batch) */
    MPT_LOSS_CATEGORICAL_CROSSENTROPY,        /* target: one-hot/probabilities   */
    MPT_LOSS_BINARY_CROSSENTROPY,             /* target: 0..1, same shape (or
                                                 without a last axis of 1)      */
    MPT_LOSS_MEAN_SQUARED_ERROR,              /* target: as binary crossentropy */
    MPT_LOSS_COUNT_
} mpt_loss_type;

typedef struct mpt_loss_desc {
    mpt_loss_type type;      /* required                                      */
    int from_logits;         /* default 0: predictions are probabilities (as
                                Keras); 1: logits, with the softmax/sigmoid
                                fused into the loss for stability            */
    float grad_scale;        /* default 0 taken as 1: the gradient is
                                multiplied by it (the loss scale)            */
} mpt_loss_desc;

/* The mean loss over the batch (Keras' sum_over_batch_size), computed in
   float32 whatever the prediction dtype, into *loss (required). If dpred is
   not NULL it receives grad_scale · d(loss)/d(pred), in dpred's dtype and
   pred's shape; dpred may be pred itself. */
MPTDEF mpt_status mpt_loss_compute(mpt_context *ctx, const mpt_loss_desc *desc,
                                   const mpt_tensor *pred, const mpt_tensor *target,
                                   double *loss, mpt_tensor *dpred);
/* The same on a model's last forward output, in the model's memory (so on a
   GPU too): the loss against target (host memory, as above) into *loss,
   and grad_scale · d(loss)/d(output) into the buffer of
   mpt_model_output_grad, ready for mpt_model_backward(m, NULL, NULL). fit
   runs the same loss on the device, with the loss scale read there. A step
   by hand (see mpt_model_grad_stats); not under a strategy. */
MPTDEF mpt_status mpt_model_compute_loss(mpt_model *m, const mpt_loss_desc *desc,
                                         const mpt_tensor *target, double *loss);

/* =============================================================================
   @optimizers: optimizers, learning-rate schedules, loss scaling
   ============================================================================= */

typedef enum mpt_optimizer_type {
    MPT_OPTIMIZER_ADAM = 0, /* the default */
    MPT_OPTIMIZER_SGD = 1,
    MPT_OPTIMIZER_ADAMW = 2,
    MPT_OPTIMIZER_COUNT_
} mpt_optimizer_type;

typedef enum mpt_lr_schedule_type {
    MPT_LR_CONSTANT = 0,
    MPT_LR_EXPONENTIAL_DECAY, /* lr · rate^(t / decay_steps)                  */
    MPT_LR_STEP_DECAY,        /* lr · rate^floor(t / decay_steps)             */
    MPT_LR_COSINE_DECAY,      /* lr · ((1 − α)·½(1 + cos(π·min(t, D)/D)) + α) */
    MPT_LR_SCHEDULE_COUNT_
} mpt_lr_schedule_type;

/* t counts optimizer steps taken (skipped steps do not count). With
   warmup_steps W > 0 the rate rises linearly from lr/W at t = 0 to lr at
   t = W − 1, and the schedule then runs on t − W. */
typedef struct mpt_lr_schedule {
    mpt_lr_schedule_type type; /* default constant                          */
    int64_t decay_steps;       /* required > 0 for the decays                 */
    float decay_rate;          /* exponential/step: required, in (0, 1]       */
    float alpha;               /* cosine: the floor, a fraction of lr; default 0 */
    int64_t warmup_steps;      /* default 0                                   */
} mpt_lr_schedule;

typedef struct mpt_optimizer_desc {
    mpt_optimizer_type type;   /* default Adam                                */
    float learning_rate;       /* default 0.001 (Adam, AdamW), 0.01 (SGD)     */
    float momentum;            /* SGD; default 0                              */
    int nesterov;              /* SGD; default 0                              */
    float beta_1, beta_2;      /* Adam(W); default 0.9, 0.999                 */
    float epsilon;             /* Adam(W); default 1e-7 (Keras)               */
    float weight_decay;        /* decoupled (w -= lr·wd·w); AdamW default 0.004
                                  (Keras), others 0                          */
    float l2;                  /* L2 penalty: l2·w added to the gradient;
                                  default 0                                  */
    float clip_global_norm;    /* default 0: none; else the gradients are
                                  scaled so that their global norm is at most
                                  this (after unscaling)                     */
    mpt_lr_schedule schedule;
} mpt_optimizer_desc;

typedef enum mpt_loss_scale_mode {
    MPT_LOSS_SCALE_DEFAULT = 0, /* dynamic when any layer computes in float16,
                                   none otherwise (bfloat16 needs none)      */
    MPT_LOSS_SCALE_DYNAMIC,
    MPT_LOSS_SCALE_FIXED,
    MPT_LOSS_SCALE_NONE,
    MPT_LOSS_SCALE_COUNT_
} mpt_loss_scale_mode;

/* Dynamic loss scaling as Keras' LossScaleOptimizer: the loss is multiplied
   by the scale before backward and the gradients divided by it before the
   update; a step whose gradients hold inf or NaN is skipped (no weight,
   moment or statistic changes), the scale is multiplied by backoff_factor;
   after growth_interval finite steps in a row it is multiplied by
   growth_factor. */
typedef struct mpt_loss_scale_desc {
    mpt_loss_scale_mode mode;
    float initial_scale;        /* default 32768 (2^15); fixed mode: the scale */
    int64_t growth_interval;    /* default 2000                                 */
    float growth_factor;        /* default 2                                    */
    float backoff_factor;       /* default 0.5                                  */
} mpt_loss_scale_desc;

/* =============================================================================
   @training: compile, fit, evaluate, predict, summary, history
   ============================================================================= */

enum {
    MPT_METRIC_ACCURACY = 1 << 0,         /* "accuracy": argmax == label (sparse
                                              labels) or == argmax of target     */
    MPT_METRIC_SPARSE_TOP_K = 1 << 1      /* "sparse_top_k_categorical_accuracy" */
};

typedef struct mpt_compile_desc {
    mpt_optimizer_desc optimizer;
    mpt_loss_desc loss;                  /* required: loss.type               */
    int metrics;                         /* MPT_METRIC_* bits; default none    */
    int top_k;                           /* default 5                          */
    mpt_loss_scale_desc loss_scale;
} mpt_compile_desc;

/* Sets the optimizer, loss, metrics and loss scaling. May be called before
   or after build; the optimizer state is allocated with the other buffers. */
MPTDEF mpt_status mpt_model_compile(mpt_model *m, const mpt_compile_desc *desc);

/* Up to MPT_MAX_LOGS named values: one epoch's results, or one batch's. */
#define MPT_MAX_LOGS 16
typedef struct mpt_logs {
    int count;
    const char *names[MPT_MAX_LOGS];   /* "loss", "accuracy", "val_loss", ... */
    double values[MPT_MAX_LOGS];
} mpt_logs;

/* The value named `name`, or NAN when it is not there. */
MPTDEF double mpt_logs_get(const mpt_logs *logs, const char *name);

/* A callback: any of the functions may be NULL. Setting *stop asks fit to
   end after this batch or epoch (as Keras' model.stop_training). A status
   other than MPT_OK ends fit with that status. Epochs count from 0. */
typedef struct mpt_callback {
    mpt_status (*on_train_begin)(void *user_data, mpt_model *m);
    mpt_status (*on_epoch_begin)(void *user_data, mpt_model *m, int epoch);
    mpt_status (*on_batch_end)(void *user_data, mpt_model *m, int64_t batch,
                               const mpt_logs *logs, int *stop);
    mpt_status (*on_epoch_end)(void *user_data, mpt_model *m, int epoch,
                               const mpt_logs *logs, int *stop);
    mpt_status (*on_train_end)(void *user_data, mpt_model *m, const mpt_logs *logs);
    void *user_data;
} mpt_callback;

/* Where progress and summaries go. Default (fn NULL): stdout. */
typedef struct mpt_printer {
    void (*fn)(void *user_data, const char *text);
    void *user_data;
} mpt_printer;

typedef struct mpt_dataset mpt_dataset;

typedef struct mpt_fit_desc {
    int epochs;                         /* default 1                           */
    int initial_epoch;                  /* default 0; resuming: the first epoch */
    int64_t batch_size;                 /* default 32: the global batch        */
    int no_shuffle;                     /* default 0: reshuffled every epoch   */
    const mpt_dataset *validation_data; /* default none                        */
    float validation_split;             /* default 0; the last fraction of the
                                           training data, taken before shuffling;
                                           Keras' cut: training keeps
                                           int(n · (1 − split)) for the split as
                                           written (0.1 of 60,000: 6,000 left) */
    int verbose;                        /* 0 silent (default), 1 progress bar,
                                           2 one line per epoch (Keras)        */
    const mpt_callback *callbacks;      /* default none                        */
    int n_callbacks;
    mpt_printer printer;                /* default stdout                      */
    /* The profiler, Keras' profile_batch: steps first..last (inclusive),
       counted from 1 at the start of this fit and on across its epochs, as
       Keras counts its train batches. Each of those steps is timed layer by
       layer (see mpt_model_fit) and written to profile_dir as a Chrome
       trace. A pair that is not 1 <= first <= last, or that reaches past
       the run's epochs · steps per epoch, is refused before training
       (Keras raises on the first and silently profiles nothing on the
       second); so is a model under a strategy. */
    int64_t profile_batch[2];           /* default {0, 0}: no profiling       */
    const char *profile_dir;            /* required with profile_batch; made
                                           with its parents (mkdir -p)       */
    int profile_fail_on_error;          /* default 0: a trace that cannot be
                                           written is a warning and training
                                           goes on; 1: fit stops, MPT_ERR_IO  */
    /* Out-of-memory recovery (Keras users catch ResourceExhaustedError and
       halve the batch): MPT_OOM_HALVE_BATCH makes fit, when building the
       model or preparing or running a step fails with
       MPT_ERR_OUT_OF_MEMORY, halve the batch (not below min_batch_size),
       plan the model's memory again for it and go on from the sample it
       had reached, keeping the weights, the optimizer state and the
       epoch's tallies; each halving is logged as a warning and printed. */
    int on_out_of_memory;               /* default MPT_OOM_FAIL              */
    int64_t min_batch_size;             /* default 0: 1                       */
} mpt_fit_desc;

/* mpt_fit_desc.on_out_of_memory. */
enum {
    MPT_OOM_FAIL = 0,          /* fit returns MPT_ERR_OUT_OF_MEMORY            */
    MPT_OOM_HALVE_BATCH = 1    /* halve the batch down to min_batch_size       */
};

/* Trains on `train` (builds the model for batch_size first if it is not
   built). Shuffling follows the model's seed and the epoch, so a run is
   reproducible. The history of every epoch is kept (mpt_model_history).
   After an epoch whose loss or trainable weights hold inf or NaN, fit
   stops with MPT_ERR_NUMERIC before that epoch's callbacks; the message
   names the epoch and the first such weight's layer, tensor and element.
   With verbose >= 1, fit ends with a summary of the run: time, samples/s,
   the mean step's parts, the loss scale's changes and the skipped steps.
   Profiling (profile_batch): each profiled step's layers are timed one by
   one, forward, loss, backward, the gradients' check, each layer's update
   and the loss-scale bookkeeping (on a GPU by events on its queue, read
   once after the last profiled step; on the CPU by the monotonic clock),
   with the step's data wait and host work, its loss and loss scale. The
   trace goes to profile_dir/plugins/profile/<run>/<host>.trace.json (and
   .trace.json.gz where zlib is built in, the file TensorBoard's profile
   plugin reads), <run> the date and time ("2026_11_23_17_05_09"), as a
   JSON array of Chrome trace events ({"name", "ph": "X", "ts", "dur",
   "pid", "tid", "args"}, microseconds) that Perfetto and chrome://tracing
   open; the per-layer table (ms, % of the step, GFLOP/s) goes beside it
   as <host>.layers.txt and, with verbose >= 1, to the printer at the end.
   Profiled steps run as they are queued, never replayed from a recorded
   CUDA graph; with profiling off a step is unchanged. */
MPTDEF mpt_status mpt_model_fit(mpt_model *m, const mpt_dataset *train,
                                const mpt_fit_desc *desc);

typedef struct mpt_evaluate_desc {
    int64_t batch_size;                 /* default 32                          */
    int verbose;                        /* default 0                           */
    mpt_printer printer;
} mpt_evaluate_desc;

/* The loss and the compiled metrics over a whole dataset, into *logs. */
MPTDEF mpt_status mpt_model_evaluate(mpt_model *m, const mpt_dataset *data,
                                     const mpt_evaluate_desc *desc, mpt_logs *logs);

/* The model's float32 outputs for every sample of `data`, in order, into
   out (an owned tensor of shape (n, output shape...); free it with
   mpt_tensor_free). batch_size 0 means 32. */
MPTDEF mpt_status mpt_model_predict(mpt_model *m, const mpt_dataset *data,
                                    int64_t batch_size, mpt_tensor *out);

/* Writes a Keras-like table (the dtype policy, then per layer its output
   shape, parameters and compute dtype, then memory per category, as
   mpt_model_memory reports it, and the memory_limit if one is set) into buf;
   returns the length it needs, like snprintf. Before build the text is, as
   Keras raises, that the model has not yet been built and what builds it. */
MPTDEF size_t mpt_model_summary(const mpt_model *m, char *buf, size_t size);

/* The per-epoch history of the last fit: for each key ("loss", "accuracy",
   "val_loss", "val_accuracy", "learning_rate", "loss_scale",
   "skipped_steps", "epoch_seconds", "samples_per_second", ...), one value
   per epoch. */
typedef struct mpt_history {
    int epochs;                       /* epochs recorded                */
    int n_keys;
    const char *keys[MPT_MAX_LOGS];
    const double *values[MPT_MAX_LOGS]; /* values[k][e]: key k, epoch e  */
} mpt_history;

MPTDEF mpt_status mpt_model_history(const mpt_model *m, mpt_history *out);

typedef struct mpt_plot_desc {
    int width;            /* default 0: 1000 pixels (at least 320)         */
    int height;           /* default 0: 60 + 320 per row of two panels
                             (at least 200)                               */
    const char *title;    /* default "Training history"                   */
    mpt_context *ctx;     /* default NULL: a failure's message goes to
                             stderr; else to this context's error message
                             and logger, and memory comes from its
                             allocator                                    */
} mpt_plot_desc;

/* Draws a history as an SVG file a browser opens (no scripts, no external
   fonts): one panel per quantity against the epoch (loss, then each
   metric, training and validation ("val_") curves together; the learning
   rate; the loss scale, on a log axis when it varies by more than 10×),
   with axes, tick labels and a legend. Every series is a <g> with a
   data-key attribute (its history key) holding one <polyline> per run of
   finite values: a NaN or inf breaks the curve. The file is written whole
   to "<path>.tmp-<pid>" and renamed over path, so a crash leaves the old
   file or the new one. An empty history (0 epochs) is an error. */
MPTDEF mpt_status mpt_history_plot_svg(const mpt_history *history, const char *path,
                                       const mpt_plot_desc *desc);

/* The learning rate's base value (what the schedule scales), e.g. for a
   callback that lowers it. The history's "learning_rate" is the rate the
   schedule gave at the end of each epoch. */
MPTDEF float mpt_model_learning_rate(const mpt_model *m);
MPTDEF mpt_status mpt_model_set_learning_rate(mpt_model *m, float learning_rate);
MPTDEF float mpt_model_loss_scale(const mpt_model *m);

/* =============================================================================
   @data: datasets
   ============================================================================= */

typedef struct mpt_dataset_desc {
    const mpt_tensor *x;   /* required: (n, sample shape...) uint8, float32,
                              float16 or bfloat16                         */
    const mpt_tensor *y;   /* required: (n,) int32 class ids, or (n, ...)
                              float32 targets; (n,) targets fit an output
                              of one unit, as (n, 1) do (Keras)            */
    float scale;           /* uint8 x becomes x·scale + offset as it is
                              batched; default (0) 1/255                  */
    float offset;          /* default 0                                   */
    int copy;              /* default 0: x and y are borrowed and must
                              outlive the dataset; 1: copied               */
} mpt_dataset_desc;

/* A dataset over caller arrays. Float inputs are checked for NaN and inf,
   and the counts of x and y must agree. */
MPTDEF mpt_status mpt_dataset_create(mpt_context *ctx, const mpt_dataset_desc *desc,
                                     mpt_dataset **out);
/* Reads an IDX (MNIST-format) image file and label file, plain or gzip
   (zlib): uint8 images (n, rows, cols, 1), int32 labels; checks the magic
   numbers, dimensions, counts, truncation, and that nothing follows the
   data (nor a gzip file's last member). mpt_dataset_reshape flattens the
   images for a model whose input is (rows·cols,). */
MPTDEF mpt_status mpt_dataset_load_idx(mpt_context *ctx, const char *images_path,
                                       const char *labels_path, mpt_dataset **out);
/* The training or test part of an MNIST-format directory (Fashion-MNIST's
   train-images-idx3-ubyte.gz, t10k-..., with or without .gz). */
MPTDEF mpt_status mpt_dataset_load_mnist(mpt_context *ctx, const char *dir, int test,
                                         mpt_dataset **out);
MPTDEF int64_t mpt_dataset_count(const mpt_dataset *d);
/* One sample's shape; returns its rank. */
MPTDEF int mpt_dataset_sample_shape(const mpt_dataset *d, int64_t *shape);
/* Gives d's samples a new shape (rank 1..3) with the same number of
   elements, e.g. IDX images (28, 28, 1) -> (784,) for a model whose input
   is (784,). The data is not touched; views split from d keep theirs. */
MPTDEF mpt_status mpt_dataset_reshape(mpt_context *ctx, mpt_dataset *d, int rank,
                                      const int64_t *shape);
/* One sample's target shape: its rank, 0 for class ids and for (n,) float
   targets. */
MPTDEF int mpt_dataset_target_shape(const mpt_dataset *d, int64_t *shape);
/* The class ids of samples [first, first + count), e.g. all of them
   (0, mpt_dataset_count(d)) for a confusion matrix after predict, into
   labels (count int32). For a dataset of class ids only. */
MPTDEF mpt_status mpt_dataset_labels(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                     int64_t count, int32_t *labels);
/* The float32 targets of samples [first, first + count) into targets
   (count times the elements of one target). For a dataset of float
   targets only. */
MPTDEF mpt_status mpt_dataset_targets(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                      int64_t count, float *targets);
/* Two views sharing d's data: samples [0, first) and [first, n), with
   first in 1..n-1; head or tail may be NULL. The views and d may be
   destroyed in any order. */
MPTDEF mpt_status mpt_dataset_split(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                    mpt_dataset **head, mpt_dataset **tail);
MPTDEF void mpt_dataset_destroy(mpt_dataset *d);

/* =============================================================================
   @callbacks: EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger, TensorBoard
   ============================================================================= */

typedef enum mpt_monitor_mode {
    MPT_MODE_AUTO = 0, /* min for names ending in "loss", max otherwise */
    MPT_MODE_MIN,
    MPT_MODE_MAX
} mpt_monitor_mode;

typedef struct mpt_early_stopping_desc {
    const char *monitor;        /* default "val_loss"                      */
    float min_delta;            /* default 0                               */
    int patience;               /* default 0                               */
    mpt_monitor_mode mode;
    int restore_best_weights;   /* default 0                               */
    double baseline;            /* used when has_baseline                  */
    int has_baseline;
    int start_from_epoch;       /* default 0                               */
    int verbose;                /* default 0; 1 prints "Epoch N: early stopping" */
} mpt_early_stopping_desc;

typedef struct mpt_reduce_lr_desc {
    const char *monitor;        /* default "val_loss"                      */
    float factor;               /* default 0.1; must be < 1                */
    int patience;               /* default 10 (0 is taken as the default;
                                   use has_patience for 0)                 */
    int has_patience;
    float min_delta;            /* default (0) 1e-4; for 0 give a tiny value */
    int cooldown;               /* default 0                               */
    float min_lr;               /* default 0                               */
    mpt_monitor_mode mode;
    int verbose;
} mpt_reduce_lr_desc;

typedef struct mpt_model_checkpoint_desc {
    const char *filepath;       /* required; "{epoch}" or "{epoch:02d}" becomes
                                   the 1-based epoch, "{val_loss:.2f}" any log
                                   value (e.g. "ckpt-{epoch:02d}.safetensors") */
    const char *monitor;        /* default "val_loss"                      */
    int save_best_only;         /* default 0                               */
    int save_weights_only;      /* default 0: the full training state      */
    mpt_monitor_mode mode;
    int verbose;                /* 1: Keras' "Epoch 3: val_loss improved from
                                   0.51234 to 0.49000, saving model to ..." */
} mpt_model_checkpoint_desc;

typedef struct mpt_csv_logger_desc {
    const char *filename;       /* required                                 */
    char separator;             /* default ','                              */
    int append;                 /* default 0                                */
} mpt_csv_logger_desc;

typedef struct mpt_tensorboard_desc {
    const char *log_dir;        /* required; created with its parents
                                   (mkdir -p); the events go to
                                   log_dir/train and log_dir/validation   */
    int histogram_freq;         /* default 0: no histograms; N: every N
                                   epochs, each parameter's values
                                   ("dense/kernel") and its last batch's
                                   gradient ("dense/kernel_grad")         */
    int64_t update_freq_batches; /* default 0: scalars once per epoch; N:
                                   also every N batches ("batch_loss", ...,
                                   at the fit's 1-based batch count)      */
    int fail_on_error;          /* default 0: a write that fails during
                                   training logs a warning and the events
                                   stop; 1: fit stops with MPT_ERR_IO     */
} mpt_tensorboard_desc;

/* Each creates a callback whose state it owns; pass *out in fit's callbacks
   and free it with mpt_callback_destroy (which takes only callbacks made by
   these functions, or zeroed ones). Messages go to fit's printer.
   Auto mode minimises names ending in "loss" and maximises the others. */
MPTDEF mpt_status mpt_callback_early_stopping(mpt_context *ctx, const mpt_early_stopping_desc *d,
                                              mpt_callback *out);
MPTDEF mpt_status mpt_callback_reduce_lr_on_plateau(mpt_context *ctx,
                                                    const mpt_reduce_lr_desc *d,
                                                    mpt_callback *out);
MPTDEF mpt_status mpt_callback_model_checkpoint(mpt_context *ctx,
                                                const mpt_model_checkpoint_desc *d,
                                                mpt_callback *out);
MPTDEF mpt_status mpt_callback_csv_logger(mpt_context *ctx, const mpt_csv_logger_desc *d,
                                          mpt_callback *out);
/* TensorBoard event files as Keras' TensorBoard callback writes them, read
   by `tensorboard --logdir log_dir`: every epoch, each training log as
   "epoch_<name>" (epoch_loss, epoch_accuracy, epoch_learning_rate,
   epoch_loss_scale, ...) in train/ and each "val_<name>" as "epoch_<name>"
   in validation/, at step = the 0-based epoch; the model summary as the
   text "model_summary" at step 0; histograms and batch scalars as the
   descriptor asks. Worker 0 writes; a killed run leaves files that read up
   to its last whole event. Freed by mpt_callback_destroy like the others. */
MPTDEF mpt_status mpt_callback_tensorboard(mpt_context *ctx, const mpt_tensorboard_desc *d,
                                           mpt_callback *out);
MPTDEF void mpt_callback_destroy(mpt_callback *cb);

/* =============================================================================
   @checkpoints: safetensors files
   ============================================================================= */

/* The float32 weights (every parameter, trainable or not) as a safetensors
   file, written to a temporary file, fsync'ed, then renamed into place.
   Temporary files of earlier saves to the same path that were killed
   mid-write are removed first; those of saves still running are not. */
MPTDEF mpt_status mpt_model_save_weights(mpt_model *m, const char *path);
/* Loads weights saved by save_weights or save_checkpoint; every name,
   dtype and shape must match the model, and every value must be finite
   (the model is left unchanged if anything does not). path must name a
   regular file: a FIFO or a device is refused, never waited on. The file
   holds the float32 masters, so it loads into a model of any policy: this
   is how a mixed_float16 run's weights go on in mixed_bfloat16 or
   float32. */
MPTDEF mpt_status mpt_model_load_weights(mpt_model *m, const char *path);
/* The full training state: weights ("dense/kernel", ...), optimizer moments
   ("optimizer/dense/kernel/m", ...), step counters, loss scale and its
   counter, learning rate and epoch ("train/..."), and the model's
   description, policy and seed in __metadata__. Loaded into a model built
   the same way with the same seed (a different seed is only warned about:
   the seed orders the data and keys dropout), fit continues from it
   bit-identically on the CPU (pass initial_epoch = mpt_model_epoch).
   load_checkpoint refuses (MPT_ERR_DTYPE) a checkpoint saved under another
   policy than the model's: its loss scale and optimizer state belong to
   that policy's arithmetic; mpt_model_load_weights takes the weights alone
   into any policy. It also refuses values training cannot produce: a step
   counter past 2^62, an epoch past INT_MAX, a negative or non-finite
   learning rate, a loss scale that the model's loss-scale mode does not
   allow (dynamic: a finite float >= FLT_MIN; fixed: compile's; none: 1),
   a non-finite weight or moment, a negative second moment. The model is
   unchanged when anything fails, a read error included (only a device
   failing as it takes the checked values can leave it partly loaded, and
   the error says so). */
MPTDEF mpt_status mpt_model_save_checkpoint(mpt_model *m, const char *path);
MPTDEF mpt_status mpt_model_load_checkpoint(mpt_model *m, const char *path);
/* Epochs completed, as recorded by fit and restored by load_checkpoint. */
MPTDEF int mpt_model_epoch(const mpt_model *m);

/* =============================================================================
   @strategy: synchronous data parallelism, as TensorFlow's MirroredStrategy
   =============================================================================

   A model created with a strategy is replicated: every replica holds the
   same weights (replica 0's, copied to the others when the model is built)
   and takes an equal share of each batch that fit, evaluate and predict
   are given (the global batch). After the backward pass the gradients are
   summed over the replicas, each replica's loss having been divided by
   the global batch, so the sum is the gradient of the mean; every replica
   then applies the same update and the replicas stay identical. A step
   that is not finite on one replica is not finite on any (the check runs
   on the summed gradients), so loss scaling decides the same everywhere.
   BatchNormalization uses each replica's own batch statistics (their
   moving averages averaged over the replicas), or with `synchronized` set
   those of the whole global batch. Loss and metrics are summed over the replicas before anything reads them, so
   progress, history and every callback's decision are the same on every
   worker; progress is printed and files are written by worker 0 alone.

   Mirrored: replicas inside this process — num_replicas logical replicas
   sharing the context's device (the CPU, or one GPU), as TensorFlow's
   virtual devices; or, on a GPU context, one replica on each of the listed
   (default: every visible) GPUs, summed by NCCL. Multi-worker: one replica per process, the processes
   started by mpirun on one or many nodes; the gradients are summed with
   MPI_Allreduce, in buckets started as soon as the layers that fill them
   have finished their backward pass, so that the exchange overlaps the
   rest of it. Multi-worker needs a build with -DMPT_MPI (and mpicc); every
   worker runs the same program, and building a model checks that all of
   them built the same one. A worker that stops answering makes the others
   fail with MPT_ERR_STATE after timeout_seconds instead of waiting
   forever. */

typedef enum mpt_strategy_type {
    MPT_STRATEGY_DEFAULT = 0,      /* one replica                              */
    MPT_STRATEGY_MIRRORED = 1,     /* num_replicas replicas in this process    */
    MPT_STRATEGY_MULTI_WORKER = 2  /* one replica per MPI process              */
} mpt_strategy_type;

typedef struct mpt_strategy_desc {
    mpt_strategy_type type;
    int num_replicas;         /* mirrored: logical replicas sharing the
                                 context's device, at most 64
                                 (MPT__MAX_REPLICAS); default 0: 1 (on a
                                 GPU context: one per device, below)       */
    const int *devices;       /* mirrored on a GPU context: the CUDA devices
                                 to put one replica on each, the context's
                                 first; default NULL: every visible one.
                                 Needs mpt_cuda.cu built with -DMPT_NCCL
                                 when more than one                        */
    int n_devices;
    double timeout_seconds;   /* multi-worker: how long a collective may wait
                                 for the others; default 0: 60 s           */
    int64_t bucket_bytes;     /* multi-worker: gradient bytes per all-reduce;
                                 default 0: 4 MiB                          */
} mpt_strategy_desc;

MPTDEF mpt_status mpt_strategy_create(mpt_context *ctx, const mpt_strategy_desc *desc,
                                      mpt_strategy **out);
/* After every model that uses it. Ends MPI if creating the strategy began it. */
MPTDEF void mpt_strategy_destroy(mpt_strategy *s);
/* Replicas over every worker. */
MPTDEF int mpt_strategy_num_replicas(const mpt_strategy *s);
/* This process's worker index (0 without MPI) and the number of workers. */
MPTDEF int mpt_strategy_worker(const mpt_strategy *s);
MPTDEF int mpt_strategy_num_workers(const mpt_strategy *s);

/* =============================================================================
   @quantize: post-training quantization (TFLite's converter, in C)
   =============================================================================

   mpt_model_quantize turns a trained model into a quantized one, as
   TFLiteConverter does; the result is an mpt_model that mpt_model_predict
   and mpt_model_evaluate take like any other (fit, forward, build and
   adding layers refuse it), destroyed with mpt_model_destroy. Three modes:
     dynamic-range  int8 weights, symmetric per output channel ([-127, 127],
                    scale max|w|/127); each batch's activations are
                    quantized as they arrive (symmetric, one scale per
                    sample), the products run in int8 (mpt_qgemm) and are
                    scaled back to float32, where the biases, pooling and
                    activations stay (TFLite's Optimize.DEFAULT alone).
     full-integer   int8 weights as above; int8 activations per tensor,
                    asymmetric (real = (q − zero_point)·scale), their ranges
                    calibrated on a representative dataset; int32 biases of
                    scale input_scale·weight_scale[c]; every product
                    requantized with integer multipliers and shifts
                    (mpt_quantize_multiplier); sigmoid, tanh, GELU through a
                    256-entry table; softmax out at scale 1/256, zero point
                    −128, sigmoid likewise, tanh at 1/128, 0 (TFLite's
                    TFLITE_BUILTINS_INT8). The model's input and output are
                    float32 (quantized and dequantized at the ends) or, with
                    io_dtype, int8 or uint8 (mpt_model_quantized_invoke).
     float16        weights stored as float16, computed in float32.
   Every layer with weights (Dense, Conv2D) is quantized, with a
   BatchNormalization right after it (a Dropout between is fine) folded
   into its kernel and bias first: w'[c] = w[c]·s[c], b'[c] = (b[c] −
   mean[c])·s[c] + beta[c], s = gamma / sqrt(moving_variance + epsilon).
   Pooling, Flatten and activations are carried over; Dropout vanishes. A
   Dense or Conv2D's ReLU (or an Activation ReLU right after it, past a
   folded BatchNormalization) stays fused into the product; its other
   activations become a layer of their own (TFLite's LOGISTIC, TANH, GELU,
   SOFTMAX). A layer that has no quantized form, or a BatchNormalization
   that does not follow a Dense or Conv2D without activation, is refused
   with MPT_ERR_UNSUPPORTED naming it. Every step is deterministic: the
   results are the same bit for bit on every thread count. */

typedef enum mpt_quantize_mode {
    MPT_QUANTIZE_DYNAMIC_RANGE = 0, /* the default */
    MPT_QUANTIZE_FULL_INTEGER = 1,
    MPT_QUANTIZE_FLOAT16 = 2,
    MPT_QUANTIZE_MODE_COUNT_
} mpt_quantize_mode;

/* How a tensor's range is taken from the calibration samples. */
typedef enum mpt_calibration {
    MPT_CALIBRATION_MIN_MAX = 0,    /* the smallest and largest value seen  */
    MPT_CALIBRATION_PERCENTILE = 1, /* the (100 − p) and p percentiles of
                                       the values seen (a histogram of 2048
                                       bins over min..max): outliers clipped */
    MPT_CALIBRATION_COUNT_
} mpt_calibration;

typedef struct mpt_quantize_desc {
    mpt_quantize_mode mode;                 /* default dynamic-range           */
    /* Full integer only: */
    const mpt_dataset *representative_data; /* required: samples shaped as the
                                               model's input (labels unread) */
    int64_t calibration_samples;            /* default 0: every sample; else
                                               the first this many (TFLite's
                                               guides take 100..500)         */
    mpt_calibration calibration;            /* default min/max                */
    double percentile;                      /* percentile: default 0: 99.99;
                                               else in [50, 100]             */
    mpt_dtype io_dtype;                     /* the model's input and output:
                                               default float32; MPT_INT8 or
                                               MPT_UINT8 (TFLite's
                                               inference_input_type)         */
    int64_t batch_size;                     /* calibration batches; default 32 */
} mpt_quantize_desc;

/* Quantizes m (built, and trained or given weights: by fit, a loaded
   checkpoint, or mpt_model_refresh_weights after editing the masters)
   into *out, a new model that shares nothing with m. A compiled m's loss
   and metrics go with it, for mpt_model_evaluate (or compile *out).
   Errors: MPT_ERR_STATE for an unbuilt or untrained m; for full integer,
   MPT_ERR_INVALID_ARGUMENT without representative_data or with an empty
   one, MPT_ERR_SHAPE for samples of the wrong shape; MPT_ERR_UNSUPPORTED
   for a layer it cannot quantize; MPT_ERR_NUMERIC for a weight or a
   calibrated value that is not finite. */
MPTDEF mpt_status mpt_model_quantize(mpt_model *m, const mpt_quantize_desc *desc,
                                     mpt_model **out);

/* An int8 tensor's quantization: real = (q − zero_point) · scale. */
typedef struct mpt_quant_params {
    float scale;
    int32_t zero_point;
    float min, max;       /* the range it was made from (calibrated, or the
                             fixed one of softmax, sigmoid and tanh)       */
} mpt_quant_params;

/* The operations of a quantized model, in TFLite's terms. */
typedef enum mpt_quantized_op {
    MPT_QOP_FULLY_CONNECTED = 0, /* a Dense                                  */
    MPT_QOP_CONV_2D,             /* a Conv2D                                 */
    MPT_QOP_MAX_POOL_2D,         /* in and out share their quantization     */
    MPT_QOP_AVERAGE_POOL_2D,     /* likewise; 'same' padding not counted    */
    MPT_QOP_GLOBAL_AVERAGE_POOL_2D, /* (H, W, C) -> (C), TFLite's MEAN; likewise */
    MPT_QOP_RESHAPE,             /* Flatten; likewise                        */
    MPT_QOP_ACTIVATION,          /* activation: relu, gelu, sigmoid, tanh,
                                    softmax (over the last axis)            */
    MPT_QOP_COUNT_
} mpt_quantized_op;

/* One operation of a quantized model, as an exporter reads it. Pointers
   are borrowed from the model; fields that do not apply are 0 or NULL. */
typedef struct mpt_quantized_layer {
    const char *name;              /* the float model's layer ("dense_1"); an
                                      activation split off a Dense or Conv2D
                                      carries that layer's name              */
    const char *folded_batchnorm;  /* the BatchNormalization folded in; NULL   */
    mpt_quantized_op op;
    int in_rank, out_rank;         /* one sample, without the batch            */
    int64_t in_shape[MPT_MAX_RANK - 1], out_shape[MPT_MAX_RANK - 1];
    mpt_activation activation;     /* fully connected, conv: fused, none or
                                      relu; ACTIVATION: which one             */
    int64_t kernel_size[2];        /* conv, pooling: the window (kh, kw)      */
    int64_t strides[2];
    mpt_padding padding;
    /* Fully connected and conv: out_channels rows of depth weights each:
       fully connected [units, in] (TFLite's [out, in]); conv [filters, kh,
       kw, in_channels] (TFLite's OHWI). */
    int64_t out_channels, depth;
    const int8_t *weights;         /* int8 modes: symmetric, zero point 0      */
    const mpt_half *weights_float16; /* float16 mode                           */
    const float *weight_scales;    /* int8 modes: (out_channels)               */
    const float *bias;             /* dynamic-range, float16: (out_channels)
                                      float32, BatchNormalization folded in   */
    const int32_t *bias_int32;     /* full integer: (out_channels), scale
                                      input.scale · weight_scales[c], zero 0  */
    const int32_t *multiplier;     /* full integer: (out_channels), with shift:
                                      input.scale · weight_scales[c] /
                                      output.scale (mpt_quantize_multiplier)  */
    const int32_t *shift;
    mpt_quant_params input, output; /* full integer: the int8 tensors         */
} mpt_quantized_layer;

typedef struct mpt_quantized_info {
    mpt_quantize_mode mode;
    mpt_dtype io_dtype;            /* float32, int8 or uint8                   */
    mpt_quant_params input, output; /* full integer: the model's input and
                                      output tensors in io_dtype (uint8: the
                                      zero point + 128); float32 io: the int8
                                      tensors the ends quantize to and from */
    int n_layers;                  /* the operations                           */
    /* What a file holds: weights (1 byte each, 2 in float16), biases (4),
       and per channel scales (4) in the int8 modes. */
    int64_t size_bytes;
} mpt_quantized_info;

/* MPT_ERR_STATE when m is not quantized. */
MPTDEF mpt_status mpt_model_quantized_info(const mpt_model *m, mpt_quantized_info *out);
MPTDEF mpt_status mpt_model_quantized_layer(const mpt_model *m, int index,
                                            mpt_quantized_layer *out);

/* Runs a quantized model on one batch, as an interpreter's invoke: x is
   (batch, input shape...) in the model's io_dtype, y is filled with
   (batch, output shape...) in io_dtype (float32: dequantized). y is
   allocated here (owned; mpt_tensor_free). Any batch size. */
MPTDEF mpt_status mpt_model_quantized_invoke(mpt_model *m, const mpt_tensor *x, mpt_tensor *y);

/* ============================================================================
   ============================================================================
     FOR BACKEND IMPLEMENTERS: the interface between the library and a
     compute backend
   ============================================================================
   ============================================================================

   Nothing above needs what follows to train a model. @backend is the table
   of functions the CPU backend (@impl-cpu-backend) and the CUDA one
   (mpt_cuda.cu) fill in, and @backend-shared the rules both run alike. It
   stays in this half of the file, outside MPT_IMPLEMENTATION, because
   mpt_cuda.cu includes the header without MPT_IMPLEMENTATION and needs
   both. */

/* =============================================================================
   @export: a model as a TFLite or ONNX file, for the runtimes people deploy with
   =============================================================================

   Both files take what the model takes: float32 samples (N, input shape...),
   NHWC, scaled as in training, with N free; they return the last layer's
   float32 outputs. What goes where:
       Dense                  TFLite FULLY_CONNECTED     ONNX Gemm
       Conv2D                 CONV_2D (NHWC)             Conv (NCHW, with a
                                                         Transpose from NHWC)
       MaxPooling2D           MAX_POOL_2D                MaxPool
       AveragePooling2D       AVERAGE_POOL_2D            AveragePool
       GlobalAveragePooling2D AVERAGE_POOL_2D + RESHAPE  GlobalAveragePool +
                                                         Flatten
       Flatten                RESHAPE                    Flatten (after a
                                                         Transpose to NHWC)
       relu                   the op's fused activation  Relu
                              (else RELU)
       tanh, sigmoid, softmax TANH, LOGISTIC, SOFTMAX    Tanh, Sigmoid, Softmax
       gelu (exact)           GELU                       Mul, Erf, Add, Mul, Mul
       BatchNormalization     folded into the Dense or Conv2D before it when
                              nothing comes between them (its activation
                              none); else a per-channel MUL and ADD (Mul, Add)
       Dropout                nothing (inference)
   The weights are the float32 masters whatever the policy, so a model
   trained in mixed precision computes in float32 in the file (its outputs
   differ from a float16 predict's by float16's rounding).
   A layer the export has no counterpart for gives MPT_ERR_UNSUPPORTED,
   naming the layer, and nothing is written. The file is written as
   checkpoints are (a temporary file renamed over path), so a failure leaves
   path as it was. With a strategy, worker 0 writes the file. */

typedef struct mpt_export_desc {
    mpt_dtype weight_dtype; /* default (MPT_DTYPE_DEFAULT) float32; MPT_FLOAT16:
                               every constant stored as float16 and turned
                               back into float32 in the graph (TFLite
                               DEQUANTIZE, as its converter's float16
                               quantization writes; ONNX Cast), so the
                               file is half the size and computes in float32 */
} mpt_export_desc;

/* A built model (its float32 masters, with BatchNormalization's moving
   statistics) as a TFLite FlatBuffer (schema version 3, "TFL3") at path. */
MPTDEF mpt_status mpt_model_export_tflite(mpt_model *m, const char *path,
                                          const mpt_export_desc *desc);
/* The same model as an ONNX protobuf (IR version 7, opset 13) at path; the
   input is "input", float32 (N, input shape...), the output "output". */
MPTDEF mpt_status mpt_model_export_onnx(mpt_model *m, const char *path,
                                        const mpt_export_desc *desc);

/* ============================================================================
   ============================================================================
     FOR BACKEND IMPLEMENTERS: the interface between the library and a
     compute backend
   ============================================================================
   ============================================================================

   Nothing above needs what follows to train a model. @backend is the table
   of functions the CPU backend (@impl-cpu-backend) and the CUDA one
   (mpt_cuda.cu) fill in, and @backend-shared the rules both run alike. It
   stays in this half of the file, outside MPT_IMPLEMENTATION, because
   mpt_cuda.cu includes the header without MPT_IMPLEMENTATION and needs
   both. */

/* =============================================================================
   @backend: the table of functions a compute backend implements
   =============================================================================

   A built model keeps every buffer (weights, gradients, optimizer state,
   activations, workspace) in the memory of one backend: the CPU's, built
   into this file, or one CUDA device's, in mpt_cuda.cu (compiled with
   -DMPT_CUDA). The layers, losses and optimizers in this file reach that
   memory only through the functions below, so one piece of code drives
   both, and a test can run each function on both backends and compare.

   Rules every function keeps:
   - Pointers point into the backend's memory, except where a name says
     `host`. `impl` is the backend's own state (for the CPU: the context).
   - Compute functions are queued in call order (on a GPU: on one stream)
     and return at once; only download, sync and the capture functions wait.
     Their arguments were checked when the model was built, so they return
     nothing; a GPU backend reports a failed kernel at the next sync.
   - Reductions are done in a fixed order (no atomics), so a result depends
     only on the inputs: a training run repeats bit for bit on the same
     device, whatever the thread count.
   - A failing function returns a status and leaves a message naming the
     call, the file and line and the library's own words in error(impl).
   - Scalars that change from step to step (learning rate, loss scale,
     step counter, the finiteness of the gradients) live in the backend's
     memory, in mpt_step_state: a step reads and writes them there, so a
     whole training step can be recorded once and replayed (CUDA graphs).
   - Every slot is required except these, NULL where a backend has nothing
     to offer: gemm_plan (no algorithms to choose between), conv_direct
     (no convolution without im2col), the collectives comm_id,
     comm_create, comm_destroy, allreduce_sum and comm_error (all five or
     none: no replicas on other devices), and the timer's timer_create,
     timer_mark, timer_read and timer_free (all four or none: the profiler
     then times the calls by the host's clock, right where compute runs as
     it is called, as on the CPU). A table is filled member by member, by
     name, so that a member added here cannot shift the others. */

/* A window sliding over (H, W, C) samples (Conv2D, pooling). Padding is
   TensorFlow's; pixels outside the image are zeros for a convolution and
   absent for pooling. */
typedef struct mpt_window {
    int64_t h, w, c;     /* one input sample (H, W, C)                  */
    int64_t kh, kw;      /* window size                                 */
    int64_t sh, sw;      /* strides                                     */
    int64_t top, left;   /* padding before the first row / column       */
    int64_t oh, ow;      /* output rows and columns                     */
} mpt_window;

typedef enum mpt_pool_kind {
    MPT_POOL_MAX = 0,     /* first largest wins, a NaN wins over numbers; int32
                             argmax within the sample saved for backward   */
    MPT_POOL_AVERAGE = 1  /* mean over the window's pixels inside the image */
} mpt_pool_kind;

/* A Conv2D product computed straight from the images, without cols
   (mpt_backend.conv_direct). kernel (kh, kw, C, F) in dtype, as the layer
   keeps it.
     forward:    y (n, OH, OW, F) = act(conv(x, kernel) + bias),
                 x (n, H, W, C); act is elementwise (not GELU, whose
                 pre-activation the layer keeps, nor softmax);
     input_grad: y (n, H, W, C) = dx from x = dz (n, OH, OW, F): each
                 pixel's sum over the taps and filters that read it (the
                 convolution of dz with the kernel turned around), bias
                 and act unused;
     kernel_grad: dkernel (kh, kw, C, F) float32 = Σ over the output
                 pixels of x's window ⊗ dz (n, OH, OW, F), added to what
                 dkernel holds when accumulate; kernel, bias, act, y, ws
                 unused.
   x and y in dtype, sums in float32. ws: MPT_CONV_DIRECT_WS_BYTES. */
typedef struct mpt_conv_args {
    const mpt_window *g;
    mpt_dtype dtype;
    int input_grad;
    int kernel_grad;
    int64_t n, f;               /* samples, filters                         */
    const void *x;
    const void *kernel;
    const float *bias;          /* (F) or NULL                              */
    mpt_activation act;
    void *y;
    void *ws;
    const void *dz;             /* kernel_grad                              */
    float *dkernel;             /* kernel_grad                              */
    int accumulate;             /* kernel_grad: add to dkernel              */
} mpt_conv_args;

/* Workspace bytes of conv_direct for kk = kh·kw·C and F filters: the
   kernel repacked (at most 4 bytes an element) and one zero pixel. */
#define MPT_CONV_DIRECT_WS_BYTES(kk, c, f) \
    (4 * (kk) * (f) + 4 * ((c) > (f) ? (c) : (f)) + 128)

/* BatchNormalization over rows × channels (rows = batch · positions).
   Statistics and arithmetic in float32; x, y, dy, dx in dtype. */
typedef struct mpt_batchnorm_args {
    mpt_dtype dtype;
    int64_t rows, channels;
    float epsilon;
    float momentum;             /* commit: moving = moving·m + batch·(1 − m) */
    int training;               /* forward: batch statistics (saved into
                                   mean/variance) or the moving ones          */
    const void *x;              /* (rows, C)                                  */
    void *y;                    /* forward: (rows, C)                         */
    const void *dy;             /* backward: (rows, C)                        */
    void *dx;                   /* backward: (rows, C); NULL: not wanted      */
    const float *gamma, *beta;  /* (C) each; NULL: 1 and 0                    */
    float *dgamma, *dbeta;      /* backward: (C) each, overwritten; NULL: none */
    float *mean, *variance;     /* (C) each: the batch statistics (biased
                                   variance) a training forward measured      */
    float *moving_mean, *moving_variance; /* (C) each                         */
    void *workspace;            /* batchnorm_workspace bytes                  */
    /* backward over several replicas (synchronized statistics): Σ dy and
       Σ dy·x̂ (C each) over all their rows, total_rows of them, replace
       this call's own in dx; NULL: this call's rows alone */
    const float *sum_dy, *sum_dy_xhat;
    int64_t total_rows;
} mpt_batchnorm_args;

/* The numbers a training step reads and writes in the backend's memory.
   The host reads them back (download) only to print or decide between
   epochs, and writes learning_rate or loss_scale when a callback or a
   checkpoint changes them. */
typedef struct mpt_step_state {
    double loss_sum;          /* Σ over samples of this epoch's batch losses */
    double correct;           /* samples whose prediction was right        */
    double top_k;             /* samples whose label was in the top k      */
    double samples;           /* samples tallied                           */
    double sum_squares;       /* Σ g² of the last step's gradients (scaled) */
    int64_t step;             /* training steps taken (keys dropout masks)  */
    int64_t optimizer_steps;  /* updates applied (Adam's t, the schedule's) */
    int64_t good_steps;       /* finite steps in a row (dynamic scaling)    */
    int64_t skipped_steps;    /* steps skipped for inf/NaN gradients        */
    float learning_rate;      /* the base rate the schedule scales          */
    float loss_scale;         /* 1 when not scaling                         */
    int32_t finite;           /* whether the last step's gradients were     */
    int32_t pad_;
} mpt_step_state;

/* One loss over a batch: the mean over rows of the row losses, float32
   math whatever pred's dtype. Adds the batch's Σ row losses to
   state->loss_sum, its rows to state->samples, and (metrics) its correct
   and top-k counts; writes grad_scale_by_state · d(mean loss)/d(pred) into
   dpred (which may be pred). Sparse targets are int32 class ids, checked
   in range beforehand. */
typedef struct mpt_loss_args {
    mpt_loss_type type;
    int from_logits;            /* softmax/sigmoid fused into the loss      */
    mpt_dtype pred_dtype;
    const void *pred;           /* (rows, K)                                */
    mpt_dtype target_dtype;     /* int32 (sparse) or float32                */
    const void *target;         /* (rows) or (rows, K)                      */
    void *dpred;                /* (rows, K) pred_dtype; NULL: no gradient  */
    int64_t rows, K;
    int metrics;                /* MPT_METRIC_* bits to tally               */
    int top_k;
    int scale_by_loss_scale;    /* multiply dpred by state->loss_scale      */
    float grad_weight;          /* and by this: a replica's share of the
                                   global batch (its rows / all rows, so
                                   that the replicas' gradients sum to the
                                   mean's); default 0: 1                    */
    mpt_step_state *state;
} mpt_loss_args;

/* The trainable parameters, as arrays of n pointers (host arrays of
   backend pointers), for the optimizer's two passes. */
typedef struct mpt_update_args {
    int n;
    float *const *value;        /* float32 masters                          */
    const float *const *grad;   /* float32 gradients (times the loss scale) */
    float *const *slot0;        /* SGD's velocity or Adam's m; NULL: none   */
    float *const *slot1;        /* Adam's v; NULL: none                     */
    void *const *compute;       /* compute-dtype copies; == value if float32 */
    const mpt_dtype *compute_dtype;
    const int64_t *count;
    mpt_optimizer_desc optimizer; /* every default resolved                 */
    mpt_step_state *state;
} mpt_update_args;

typedef struct mpt_backend {
    const char *name;           /* "cpu", "cuda"                           */
    int gemm_rounds_c;          /* gemm can store C in float16/bfloat16    */
    int can_capture;            /* capture_begin/end and replay work       */

    /* -- memory: `category` is one of MPT_MEMORY_* (accounting and limit) */
    mpt_status (*alloc)(void *impl, int category, size_t bytes, void **out);
    void (*free)(void *impl, int category, void *ptr);
    mpt_status (*alloc_host)(void *impl, size_t bytes, void **out); /* pinned */
    void (*free_host)(void *impl, void *ptr);
    mpt_status (*upload)(void *impl, void *dst, const void *host_src, size_t bytes);
    mpt_status (*download)(void *impl, void *host_dst, const void *src, size_t bytes);
    /* Starts a copy from pinned host memory on a second queue; the next
       compute call waits for it (upload_wait). The host buffer must stay
       untouched until upload_done returns. */
    void (*upload_async)(void *impl, void *dst, const void *host_src, size_t bytes);
    void (*upload_wait)(void *impl);
    mpt_status (*upload_done)(void *impl);
    void (*copy)(void *impl, void *dst, const void *src, size_t bytes);
    void (*zero)(void *impl, void *dst, size_t bytes);
    mpt_status (*sync)(void *impl);
    const char *(*error)(void *impl);
    void (*destroy)(void *impl);

    /* -- recording a step once and replaying it (CUDA graphs) */
    mpt_status (*capture_begin)(void *impl);
    mpt_status (*capture_end)(void *impl, void **graph);
    mpt_status (*replay)(void *impl, void *graph);
    void (*graph_free)(void *impl, void *graph);

    /* -- compute. gemm: as mpt_gemm; with gemm_rounds_c, c_dtype may be
       float16/bfloat16 (C then holds that dtype and beta must be 0). */
    void (*gemm)(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype);
    /* Before a model's first step: the GEMM shapes it will run, so a
       backend can choose and cache an algorithm per shape (may be NULL). */
    mpt_status (*gemm_plan)(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype);
    void (*convert)(void *impl, mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                    const void *src, int64_t n);
    /* x (rows, cols) float32, in place: act(x); softmax over each row. */
    void (*activation)(void *impl, mpt_activation act, float *x, int64_t rows, int64_t cols);
    /* dz = dy · act'(z) in float32 for n = rows·cols elements; dy, y and
       (GELU) z in dtype; tmp holds n floats. */
    void (*activation_grad)(void *impl, mpt_activation act, mpt_dtype dtype, const void *z,
                            const void *y, const void *dy, float *dz, float *tmp, int64_t rows,
                            int64_t cols);
    /* out[j] (+)= Σ_r dz[r][j], rows in order: a bias gradient. */
    void (*column_sums)(void *impl, const float *dz, int64_t rows, int64_t cols, float *out,
                        int accumulate);
    /* cols (n·OH·OW, kh·kw·C) from x (n, H, W, C), both in dtype. */
    void (*im2col)(void *impl, const mpt_window *g, mpt_dtype dtype, const void *x, int64_t n,
                   void *cols);
    /* dx (n, H, W, C) in dtype = the entries of dcols (float32) added back
       to the pixels they came from; dxf (n, H, W, C) float32 scratch
       (unused when dtype is float32). */
    void (*col2im)(void *impl, const mpt_window *g, mpt_dtype dtype, const float *dcols,
                   int64_t n, float *dxf, void *dx);
    /* Returns 0, having done nothing, where it cannot (this dtype, CPU or
       shape); the layer then uses im2col, gemm and col2im. May be NULL. */
    int (*conv_direct)(void *impl, const mpt_conv_args *a);
    /* y (n, OH, OW, C) from x (n, H, W, C), in dtype; argmax (n, OH, OW, C)
       int32 for max pooling; ws: pool_workspace bytes. */
    void (*pool_forward)(void *impl, mpt_pool_kind kind, const mpt_window *g, mpt_dtype dtype,
                         const void *x, void *y, int32_t *argmax, int64_t n, void *ws);
    void (*pool_backward)(void *impl, mpt_pool_kind kind, const mpt_window *g, mpt_dtype dtype,
                          const void *dy, void *dx, const int32_t *argmax, int64_t n, void *ws);
    int64_t (*pool_workspace)(void *impl, const mpt_window *g, int64_t n);
    void (*batchnorm_forward)(void *impl, const mpt_batchnorm_args *a);
    void (*batchnorm_backward)(void *impl, const mpt_batchnorm_args *a);
    /* The moving statistics from the batch ones, when state->finite. */
    void (*batchnorm_commit)(void *impl, const mpt_batchnorm_args *a,
                             const mpt_step_state *state);
    int64_t (*batchnorm_workspace)(void *impl, mpt_dtype dtype, int64_t rows, int64_t channels);
    /* Inverted dropout of n elements in dtype: out[i] = in[i]/(1 − rate)
       where uniform01(philox(key, step, i/4)[i%4]) ≥ rate, else 0.
       forward: step = state->step, saved into *saved_step; backward
       (state NULL): step = *saved_step. */
    void (*dropout)(void *impl, uint64_t key, float rate, mpt_dtype dtype, const void *in,
                    void *out, int64_t n, const mpt_step_state *state, int64_t *saved_step,
                    void *ws);
    void (*loss)(void *impl, const mpt_loss_args *a);
    /* Pass 1: state->sum_squares = Σ g² (double, fixed order) and
       state->finite. Pass 2: if finite, the fused update of every
       parameter (unscale, clip, l2, decay, SGD/Adam(W)), the compute copies
       rewritten, optimizer_steps + 1. */
    void (*grad_stats)(void *impl, const mpt_update_args *u);
    void (*update)(void *impl, const mpt_update_args *u);
    /* Dynamic or fixed loss scaling after a step, from state->finite; then
       state->step + 1. */
    void (*loss_scale_update)(void *impl, const mpt_loss_scale_desc *d, mpt_step_state *state);
    /* dst[i] += src[i] for n floats (replicas' gradients summed in order). */
    void (*add)(void *impl, float *dst, const float *src, int64_t n);
    /* x[i] *= alpha for n floats (a sum over replicas made a mean). */
    void (*scale)(void *impl, float *x, float alpha, int64_t n);

    /* -- collectives between replicas on different devices, NULL where the
       backend has none (mpt_cuda.cu built with -DMPT_NCCL has them, over
       NCCL). A communicator joins `members` replicas in all: this
       process's backends impls[0..n) are members first .. first + n − 1.
       Several processes share one id, made by comm_id on the process of
       member 0 and sent to the others (the strategy sends it by MPI); a
       single process passes id NULL. */
    mpt_status (*comm_id)(void *impl, void *id /* MPT_COMM_ID_BYTES */);
    mpt_status (*comm_create)(void *const *impls, int n, int first, int members,
                              const void *id, void **comm);
    void (*comm_destroy)(void *comm);
    /* bufs[k] (count floats in impls[k]'s memory) replaced by their sum
       over every member, queued on each backend's queue like any compute
       call. Fails (with the library's message) only when the call cannot
       be queued. */
    mpt_status (*allreduce_sum)(void *comm, float *const *bufs, int64_t count);
    const char *(*comm_error)(void *comm);

    /* -- timing markers for the profiler, NULL where the backend has none
       (the CUDA backend's are events). timer_mark queues marker `index`
       (0 .. count − 1) on the compute queue: it takes the time when the
       queue reaches it, and nothing waits. timer_read waits for marker
       count − 1 and gives every marker's time in seconds after marker 0. */
    mpt_status (*timer_create)(void *impl, int count, void **timer);
    void (*timer_mark)(void *impl, void *timer, int index);
    mpt_status (*timer_read)(void *impl, void *timer, int count, double *seconds);
    void (*timer_free)(void *impl, void *timer);
} mpt_backend;

#define MPT_COMM_ID_BYTES 128

/* Memory categories (the model's arenas). */
enum {
    MPT_MEMORY_PARAMS = 0,      /* float32 master weights                    */
    MPT_MEMORY_GRADS,           /* float32 gradients                         */
    MPT_MEMORY_OPTIMIZER,       /* optimizer state                           */
    MPT_MEMORY_WEIGHT_COPY,     /* compute-dtype copies of the weights       */
    MPT_MEMORY_ACTIVATIONS,     /* outputs, saved buffers, gradients         */
    MPT_MEMORY_WORKSPACE,       /* scratch shared by all layers              */
    MPT_MEMORY_COUNT_
};

/* The backend a context's models use (the CPU's unless a CUDA device was
   taken), and its implementation state. */
MPTDEF const mpt_backend *mpt_context_backend(const mpt_context *ctx, void **impl);

/* The CUDA backend (mpt_cuda.cu, built with -DMPT_CUDA): takes the device
   desc->cuda_device, or fails with MPT_ERR_UNSUPPORTED and a message when
   there is none (mpt_context_create then falls back to the CPU). */
extern mpt_status mpt_cuda_backend_create(const mpt_context_desc *desc,
                                          const mpt_backend **table, void **impl,
                                          char *message, size_t message_size);

/* mpt_device_count's and mpt_device_query's CUDA part (mpt_cuda.cu):
   the devices the driver shows (0 when there is no driver or no device,
   which is no error), and one device's properties, free memory and the
   driver's and runtime's versions. On failure *message says why. */
extern int mpt_cuda_device_count(void);
extern mpt_status mpt_cuda_device_query(int device, mpt_device_info *out, char *message,
                                        size_t message_size);

/* How many of the CUDA backend's kernels the current device has not
   loaded yet, -1 when the driver cannot tell (before CUDA 12.4). Creating
   the backend on a device loads them all there, so that under lazy module
   loading no kernel is first loaded inside a step's graph capture; a
   check for tests. */
extern int mpt_cuda_kernels_unloaded(void);

/* How many GEMM shapes cuBLASLt refused so far on a CUDA backend (impl
   from mpt_context_backend, whose name is "cuda"): its plan or its run
   failed, and the hand-written engine runs the shape instead. Each
   refusal is logged once, when it happens (a warning under
   MPT_GEMM_CUBLASLT, else MPT_LOG_INFO). */
extern int64_t mpt_cuda_lt_refusals(const void *impl);

/* =============================================================================
   @backend-shared: the rules both backends run (internal)
   =============================================================================

   What the CPU backend (below, in MPT_IMPLEMENTATION) and the CUDA one
   (mpt_cuda.cu, which includes this header without MPT_IMPLEMENTATION)
   must compute alike, bit for bit, written once here: plain C99 that
   also compiles as C++17 and, marked MPT__HD, as CUDA host and device
   code. Not part of the API. */

#include <float.h> /* FLT_MIN, FLT_MAX */

#if defined(__CUDACC__)
#define MPT__HD __host__ __device__
#else
#define MPT__HD
#endif

/* Replicas a model can have (in this process or over every worker): the
   size of the strategy's per-replica arrays. */
#define MPT__MAX_REPLICAS 64

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
   3", SC 2011): ten rounds of multiply-xor over a 128-bit counter keyed by
   64 bits; mpt_philox4x32's words. The counter is Random123's ctr[0..3] =
   the low and high halves of counter_lo, then of counter_hi; the key's
   halves are key[0..1]; out[0..3] is Random123's result. The high halves
   of the 32×32 products come from a 64-bit product (a GPU's mul.hi). */
static inline MPT__HD void mpt__philox4x32_10(uint64_t key, uint64_t counter_hi,
                                              uint64_t counter_lo, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter_lo, c1 = (uint32_t)(counter_lo >> 32);
    uint32_t c2 = (uint32_t)counter_hi, c3 = (uint32_t)(counter_hi >> 32);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    int round;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* A uniform float in [0, 1) from the top 24 of 32 random bits. */
static inline MPT__HD float mpt__uniform01(uint32_t bits) {
    return (float)(bits >> 8) * (1.0f / 16777216.0f);
}

/* The loss scale after a step, from state->finite; then state->step + 1.
   A non-finite step has been skipped whatever the mode (an update from
   inf or NaN gradients would destroy the weights), so skipped_steps
   counts it in every mode. Dynamic mode, as Keras' LossScaleOptimizer: a
   skipped step multiplies the scale by backoff_factor and restarts the
   count of finite steps; growth_interval finite steps in a row multiply
   it by growth_factor. Power-of-two factors keep a power-of-two scale
   exact. Two guards Keras lacks: the scale never grows to inf (as
   PyTorch's newer kernels) nor shrinks below FLT_MIN, where 1/scale would
   be inf. Each product is one rounding (no fused multiply-add can form),
   so both backends get the same bits. */
static inline MPT__HD void mpt__loss_scale_next(const mpt_loss_scale_desc *d,
                                                mpt_step_state *state) {
    int dynamic = d->mode == MPT_LOSS_SCALE_DYNAMIC;
    state->step++;
    if (!state->finite) {
        float scaled = state->loss_scale * d->backoff_factor;
        state->skipped_steps++;
        if (!dynamic) return;
        state->good_steps = 0;
        if (scaled >= FLT_MIN) state->loss_scale = scaled;
        return;
    }
    if (!dynamic) return;
    if (++state->good_steps >= d->growth_interval) {
        float grown = state->loss_scale * d->growth_factor;
        if (grown <= FLT_MAX) state->loss_scale = grown; /* not inf */
        state->good_steps = 0;
    }
}

/* ---- the CUDA GEMM's choices --------------------------------------------
   mpt_cuda.cu picks a tile, a K split and (in MPT_GEMM_AUTO) an engine for
   each GEMM shape by the rules below. The tile and the split are functions
   of the shape and the GPU's SM count, never of the run, so a shape takes
   the same path, hence gives the same bits, on every run on the same GPU
   model; the engine comes from measured times, kept with a margin
   (mpt__gemm_engine_choose). Here, rather than in mpt_cuda.cu, so that
   they are tested without a GPU. */

/* The hand-written tensor-core GEMM's tiles: 64×64 (3 stages) or 128×128
   (4 stages, 16-byte aligned A and B only). 128 once those tiles alone
   make a wave (one per SM), else 64: small problems need more blocks.
   forced: 64 or 128 ($MPT_CUDA_GEMM_TILE), 0 to choose; 128 is given only
   where it can run (big_ok: aligned operands, and the GPU has the shared
   memory), else 64. */
static inline int mpt__gemm_tile(int64_t m, int64_t n, int sm_count, int big_ok, int forced) {
    if (!big_ok || forced == 64) return 64;
    if (forced == 128) return 128;
    return ((m + 127) / 128) * ((n + 127) / 128) >= sm_count ? 128 : 64;
}

/* $MPT_CUDA_GEMM_TILE: NULL or "" gives 0 (choose), "64" or "128" that
   tile; anything else -1. */
static inline int mpt__gemm_tile_from_env(const char *value) {
    if (!value || !value[0]) return 0;
    if (value[0] == '6' && value[1] == '4' && !value[2]) return 64;
    if (value[0] == '1' && value[1] == '2' && value[2] == '8' && !value[3]) return 128;
    return -1;
}

/* Split-K. A product with few M×N tiles and a long K (a convolution's
   weight gradient: 288×32×73728 is 5 tiles of 64×64 for 132 SMs) is cut
   along K into `splits` slices of `depth` (a multiple of 32, the last
   slice shorter), computed as separate blocks into float32 partial sums
   (splits × M × N, in a workspace of `capacity` floats), then added in
   slice order by a second pass that applies the epilogue. The slices are
   a function of the shape, the tile and the SM count, so the sums repeat
   bit for bit. Split only where the tiles fill less than half the SMs and
   every slice gets at least MPT__GEMM_SPLIT_MIN_DEPTH of K; at most
   MPT__GEMM_SPLIT_MAX slices, and about one block per SM in all. */
#define MPT__GEMM_SPLIT_MIN_DEPTH 512
#define MPT__GEMM_SPLIT_MAX 64
typedef struct mpt__gemm_split {
    int64_t splits; /* 1: no split */
    int64_t depth;  /* K per slice (K itself when splits is 1) */
} mpt__gemm_split;

static inline mpt__gemm_split mpt__gemm_split_k(int64_t m, int64_t n, int64_t k, int tile,
                                                int sm_count, int64_t capacity) {
    const int64_t tiles = ((m + tile - 1) / tile) * ((n + tile - 1) / tile);
    mpt__gemm_split s;
    int64_t want, steps;
    s.splits = 1;
    s.depth = k;
    if (m <= 0 || n <= 0 || k <= 0) return s;
    want = sm_count / tiles; /* < 2 where the tiles fill half the SMs */
    if (want > k / MPT__GEMM_SPLIT_MIN_DEPTH) want = k / MPT__GEMM_SPLIT_MIN_DEPTH;
    if (want > MPT__GEMM_SPLIT_MAX) want = MPT__GEMM_SPLIT_MAX;
    if (want > capacity / (m * n)) want = capacity / (m * n);
    if (want < 2) return s;
    /* Equal slices of whole 32-deep steps; the count again, so none is empty. */
    steps = (k + 31) / 32;
    s.depth = (steps + want - 1) / want * 32;
    s.splits = (k + s.depth - 1) / s.depth;
    if (s.splits < 2) s.depth = k, s.splits = 1;
    return s;
}

/* MPT_GEMM_AUTO's engine for a shape it has timed: the engine the shape
   runs untimed (`usual`: the hand-written one for 16-bit operands,
   cuBLASLt for float32) stays unless the other one (`other`, when it did
   not refuse the shape) is faster by more than MPT__GEMM_SWITCH_MARGIN,
   a tie keeping `usual`. Times vary by a few per cent from run to run;
   without a margin a near tie would flip from run to run, and with it
   the bits. */
#define MPT__GEMM_SWITCH_MARGIN 0.10
static inline mpt_gemm_engine mpt__gemm_engine_choose(mpt_gemm_engine usual, double ms_usual,
                                                      mpt_gemm_engine other, double ms_other,
                                                      int other_refused) {
    if (other_refused || !(ms_other < ms_usual * (1.0 - MPT__GEMM_SWITCH_MARGIN))) return usual;
    return other;
}

/* ---- kernels' index arithmetic ------------------------------------------ */

/* Division by an invariant divisor with a multiply and a shift, for index
   arithmetic in kernels (a 64-bit division is a long subroutine on a
   GPU): Granlund and Montgomery, "Division by invariant integers using
   multiplication" (PLDI 1994), figure 4.1, with N = 32. For a divisor
   1 ≤ d ≤ 2^31: shift = ⌈log2 d⌉, mul = ⌊2^32·(2^shift − d)/d⌋ + 1, and
   then n / d = (⌊n·mul / 2^32⌋ + n) >> shift for every n < 2^32. */
typedef struct mpt__fastdiv {
    uint32_t d, mul, shift;
} mpt__fastdiv;

static inline mpt__fastdiv mpt__fastdiv_make(uint32_t d) {
    mpt__fastdiv f;
    f.d = d;
    f.shift = 0;
    while (f.shift < 31 && ((uint64_t)1 << f.shift) < d) f.shift++;
    f.mul = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << f.shift) - d)) / d + 1);
    return f;
}

static inline MPT__HD uint32_t mpt__fastdiv_div(mpt__fastdiv f, uint32_t n) {
    return (uint32_t)((((uint64_t)n * f.mul >> 32) + n) >> f.shift);
}

#ifdef __cplusplus
}
#endif
#endif /* MPT_H */

/* ============================================================================
   ============================================================================
                               IMPLEMENTATION
   ============================================================================
   ============================================================================ */
#ifdef MPT_IMPLEMENTATION
#ifndef MPT__IMPLEMENTED
#define MPT__IMPLEMENTED

#include <dirent.h> /* sweeping a checkpoint's directory */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/utsname.h> /* TensorBoard's file names: the host */
#include <time.h>        /* the profiler's clock and its run's name */
#include <unistd.h>
#ifndef MPT_NO_ZLIB
#include <zlib.h> /* gzip-compressed IDX files */
#endif
#ifdef MPT_MPI
#include <mpi.h> /* multi-worker strategies */
#include <sched.h>
#endif

#if !defined(MPT_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || defined(__i386__))
#define MPT__X86 1
#include <immintrin.h>
/* Functions with these attributes may use the named instructions; they are
   only ever called after a run-time CPUID check. */
#define MPT__TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MPT__TARGET_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define MPT__TARGET_AVX512_BF16 \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")))
#else
#define MPT__X86 0
#endif

#define MPT__MIN(a, b) ((a) < (b) ? (a) : (b))
#define MPT__MAX(a, b) ((a) > (b) ? (a) : (b))
#define MPT__ALIGN 64
/* Scratch memory each pool thread owns for the length of the context, so
   that a training step allocates nothing. The GEMM packs its panels there
   (about 1 MiB); a caller must not keep a GEMM operand in it. */
#define MPT__THREAD_SCRATCH_BYTES ((size_t)2 << 20)

/* =============================================================================
   @impl-status
   ============================================================================= */

MPTDEF const char *mpt_status_string(mpt_status status) {
    switch (status) {
    case MPT_OK: return "ok";
    case MPT_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MPT_ERR_SHAPE: return "shape mismatch";
    case MPT_ERR_DTYPE: return "unsupported dtype";
    case MPT_ERR_OUT_OF_MEMORY: return "out of memory";
    case MPT_ERR_OVERFLOW: return "size overflow";
    case MPT_ERR_STATE: return "wrong state";
    case MPT_ERR_IO: return "i/o error";
    case MPT_ERR_FORMAT: return "malformed file";
    case MPT_ERR_UNSUPPORTED: return "unsupported";
    case MPT_ERR_NUMERIC: return "non-finite value";
    }
    return "unknown status";
}

/* =============================================================================
   @impl-context
   ============================================================================= */

typedef void (*mpt__task_fn)(void *arg, int64_t task, int thread);

/* A fixed set of worker threads that run the tasks of one parallel-for at
   a time; the calling thread works too and is thread 0. Which thread runs
   which task varies, so every task must write its own part of the output:
   that is what keeps results independent of scheduling. */
typedef struct mpt__pool {
    pthread_t *threads;
    int n_workers;          /* threads besides the caller */
    int started;            /* workers actually running   */
    pthread_mutex_t mutex;
    pthread_cond_t wake, done;
    uint64_t generation;    /* bumped for each parallel-for */
    int stop;
    mpt__task_fn fn;
    void *arg;
    int64_t n_tasks, next_task;
    int busy;               /* workers still inside the current job */
    int in_job;             /* a parallel-for is running; only the caller
                               writes it, before waking and after joining
                               the workers */
} mpt__pool;

typedef struct mpt__worker_arg {
    mpt__pool *pool;
    int thread;
} mpt__worker_arg;

struct mpt_context {
    const mpt_backend *backend; /* where models train (@impl-cpu-backend) */
    void *backend_impl;         /* its state; the context itself for the CPU */
    mpt_allocator allocator;
    mpt_logger logger;
    int num_threads;
    int cpu;                    /* MPT_CPU_* in use */
    mpt__pool pool;
    mpt__worker_arg *worker_args;
    void **scratch;             /* [num_threads] × MPT__THREAD_SCRATCH_BYTES */
    mpt_context_desc desc;      /* as given: a strategy opens the other GPUs so */
    char error[1024];
    int64_t host_bytes;         /* held through mpt__alloc now            */
    int64_t host_peak;          /* their most since fit last reset it      */
};

static void *mpt__default_alloc(void *user, size_t bytes, size_t alignment) {
    /* Over-allocate and keep the original pointer just below the aligned
       block: portable C99, no posix_memalign needed. */
    unsigned char *raw, *aligned;
    (void)user;
    if (bytes > SIZE_MAX - alignment - sizeof(void *)) return NULL;
    raw = (unsigned char *)malloc(bytes + alignment + sizeof(void *));
    if (!raw) return NULL;
    aligned = (unsigned char *)(((uintptr_t)(raw + sizeof(void *)) + alignment - 1) &
                                ~(uintptr_t)(alignment - 1));
    memcpy(aligned - sizeof(void *), &raw, sizeof(void *));
    return aligned;
}

static void mpt__default_free(void *user, void *ptr) {
    void *raw;
    (void)user;
    if (!ptr) return;
    memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof(void *));
    free(raw);
}

/* The host bytes a context holds, and their peak (fit's memory report).
   Counted atomically where the compiler can: replicas may allocate from
   their own threads. */
static void mpt__count_host(const mpt_context *ctx, int64_t delta) {
    mpt_context *c = (mpt_context *)ctx; /* bookkeeping, not the context's meaning */
#if defined(__GNUC__) || defined(__clang__)
    int64_t now = __atomic_add_fetch(&c->host_bytes, delta, __ATOMIC_RELAXED);
    int64_t peak = __atomic_load_n(&c->host_peak, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&c->host_peak, &peak, now, 1,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
#else
    c->host_bytes += delta;
    if (c->host_bytes > c->host_peak) c->host_peak = c->host_bytes;
#endif
}

/* Every block carries its size in the MPT__ALIGN bytes before it, so that
   mpt__free can count it off. */
static void *mpt__alloc(const mpt_context *ctx, size_t bytes) {
    unsigned char *p;
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - MPT__ALIGN) return NULL;
    p = (unsigned char *)ctx->allocator.alloc(ctx->allocator.user_data, bytes + MPT__ALIGN,
                                              MPT__ALIGN);
    if (!p) return NULL;
    memcpy(p, &bytes, sizeof bytes);
    mpt__count_host(ctx, (int64_t)bytes);
    return p + MPT__ALIGN;
}

static void *mpt__calloc(const mpt_context *ctx, size_t bytes) {
    void *p = mpt__alloc(ctx, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

static void mpt__free(const mpt_context *ctx, void *ptr) {
    unsigned char *p;
    size_t bytes;
    if (!ptr) return;
    p = (unsigned char *)ptr - MPT__ALIGN;
    memcpy(&bytes, p, sizeof bytes);
    mpt__count_host(ctx, -(int64_t)bytes);
    ctx->allocator.free(ctx->allocator.user_data, p);
}

static void mpt__log(const mpt_context *ctx, mpt_log_level level, const char *fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    if (ctx && ctx->logger.fn) {
        ctx->logger.fn(ctx->logger.user_data, level, message);
    } else if (level <= MPT_LOG_WARNING) {
        fprintf(stderr, "mpt %s: %s\n", level == MPT_LOG_ERROR ? "error" : "warning",
                message);
    }
}

/* Records why a call failed, tells the logger, and returns the status, so
   that error paths read `return mpt__fail(ctx, MPT_ERR_SHAPE, "...", ...);`.
   The arguments may be the context's own message (the CPU backend's error
   is): it is formatted aside first, as vsnprintf must not read what it writes. */
static mpt_status mpt__fail(mpt_context *ctx, mpt_status status, const char *fmt, ...) {
    char message[sizeof ctx->error];
    va_list ap;
    if (!ctx) return status;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    memcpy(ctx->error, message, sizeof message);
    mpt__log(ctx, MPT_LOG_ERROR, "%s (%s)", ctx->error, mpt_status_string(status));
    return status;
}

#define MPT__CHECK(expr)                         \
    do {                                         \
        mpt_status mpt__s_ = (expr);             \
        if (mpt__s_ != MPT_OK) return mpt__s_;   \
    } while (0)

static int mpt__detect_cpu(void) {
    int f = 0;
#if MPT__X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= MPT_CPU_AVX2;
    {
        /* F16C: CPUID leaf 1, ECX bit 29 (needs the OS to save AVX state,
           which avx2 above already implies where it is set). */
        unsigned r[4]; /* eax, ebx, ecx, edx */
        __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                             : "a"(1), "c"(0));
        if ((r[2] >> 29) & 1u && (f & MPT_CPU_AVX2)) f |= MPT_CPU_F16C;
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        (f & MPT_CPU_AVX2) && (f & MPT_CPU_F16C))
        f |= MPT_CPU_AVX512;
    if ((f & MPT_CPU_AVX512) && __builtin_cpu_supports("avx512bf16")) f |= MPT_CPU_AVX512_BF16;
    if ((f & MPT_CPU_AVX512) && __builtin_cpu_supports("avx512vnni")) f |= MPT_CPU_AVX512_VNNI;
#endif
    return f;
}

static void mpt__pool_run_tasks(mpt__pool *pool, int thread) {
    for (;;) {
        int64_t task;
        pthread_mutex_lock(&pool->mutex);
        task = pool->next_task++;
        pthread_mutex_unlock(&pool->mutex);
        if (task >= pool->n_tasks) return;
        pool->fn(pool->arg, task, thread);
    }
}

static void *mpt__pool_worker(void *p) {
    mpt__worker_arg *wa = (mpt__worker_arg *)p;
    mpt__pool *pool = wa->pool;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->mutex);
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->wake, &pool->mutex);
        if (pool->stop) {
            pthread_mutex_unlock(&pool->mutex);
            return NULL;
        }
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mutex);
        mpt__pool_run_tasks(pool, wa->thread);
        pthread_mutex_lock(&pool->mutex);
        if (--pool->busy == 0) pthread_cond_signal(&pool->done);
        pthread_mutex_unlock(&pool->mutex);
    }
}

/* The pool index of the calling thread: 0 for the thread that created the
   context (or any other), i + 1 for worker i. */
static int mpt__pool_thread_index(const mpt__pool *pool) {
    pthread_t self = pthread_self();
    int i;
    for (i = 0; i < pool->started; i++)
        if (pthread_equal(pool->threads[i], self)) return i + 1;
    return 0;
}

/* Runs fn(arg, task, thread) for task = 0..n_tasks-1 on the pool. */
static void mpt__parallel_for(mpt_context *ctx, int64_t n_tasks, mpt__task_fn fn, void *arg) {
    mpt__pool *pool = &ctx->pool;
    if (n_tasks <= 0) return;
    /* A parallel-for inside a task (a GEMM called per image, say) runs on
       the thread that asked, under that thread's index, so that it uses
       that thread's scratch: the pool serves one job at a time. */
    if (pool->started == 0 || n_tasks == 1 || pool->in_job) {
        int64_t t;
        int self = pool->in_job ? mpt__pool_thread_index(pool) : 0;
        for (t = 0; t < n_tasks; t++) fn(arg, t, self);
        return;
    }
    pthread_mutex_lock(&pool->mutex);
    pool->in_job = 1;
    pool->fn = fn;
    pool->arg = arg;
    pool->n_tasks = n_tasks;
    pool->next_task = 0;
    pool->busy = pool->started;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    mpt__pool_run_tasks(pool, 0);
    pthread_mutex_lock(&pool->mutex);
    while (pool->busy > 0) pthread_cond_wait(&pool->done, &pool->mutex);
    pool->in_job = 0;
    pthread_mutex_unlock(&pool->mutex);
}

/* This thread's scratch buffer (MPT__THREAD_SCRATCH_BYTES, 64-byte aligned). */
static void *mpt__thread_scratch(const mpt_context *ctx, int thread) {
    return ctx->scratch[thread];
}

static int mpt__default_threads(void) {
    const char *env = getenv("MPT_NUM_THREADS");
    long n;
    if (env && *env) {
        n = strtol(env, NULL, 10);
        if (n > 0 && n <= 1024) return (int)n;
    }
    n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)MPT__MIN(n, 256) : 1;
}

static void mpt__pool_stop(mpt_context *ctx) {
    mpt__pool *pool = &ctx->pool;
    int i;
    if (!pool->threads) return;
    pthread_mutex_lock(&pool->mutex);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (i = 0; i < pool->started; i++) pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    mpt__free(ctx, pool->threads);
    pool->threads = NULL;
}

static mpt_status mpt__pool_start(mpt_context *ctx) {
    mpt__pool *pool = &ctx->pool;
    int i, n = ctx->num_threads - 1;
    if (n <= 0) return MPT_OK;
    pool->threads = (pthread_t *)mpt__calloc(ctx, sizeof(pthread_t) * (size_t)n);
    ctx->worker_args = (mpt__worker_arg *)mpt__calloc(ctx, sizeof(mpt__worker_arg) * (size_t)n);
    if (!pool->threads || !ctx->worker_args)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "context: cannot allocate %d threads", n);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->n_workers = n;
    for (i = 0; i < n; i++) {
        ctx->worker_args[i].pool = pool;
        ctx->worker_args[i].thread = i + 1;
        if (pthread_create(&pool->threads[i], NULL, mpt__pool_worker, &ctx->worker_args[i]) != 0)
            return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY,
                             "context: could only start %d of %d worker threads", i, n);
        pool->started++;
    }
    return MPT_OK;
}

static const mpt_backend *mpt__cpu_backend(void);

/* The CUDA device when this build has one and the descriptor and
   $MPT_DEVICE allow it; the CPU otherwise (saying why when a GPU was
   wanted but not found). */
static mpt_status mpt__choose_backend(mpt_context *ctx, const mpt_context_desc *d) {
    const char *env = getenv("MPT_DEVICE");
    ctx->backend = mpt__cpu_backend();
    ctx->backend_impl = ctx;
    if (env && *env && strcmp(env, "cpu") != 0 && strcmp(env, "cuda") != 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "context: MPT_DEVICE=\"%s\" is neither \"cpu\" nor \"cuda\"", env);
    if (d->use_cpu || (env && strcmp(env, "cpu") == 0)) return MPT_OK;
#ifdef MPT_CUDA
    {
        char message[512] = "";
        const mpt_backend *table = NULL;
        void *impl = NULL;
        mpt_status s = mpt_cuda_backend_create(d, &table, &impl, message, sizeof message);
        if (s == MPT_ERR_UNSUPPORTED) {
            mpt__log(ctx, MPT_LOG_WARNING, "%s: training on the CPU", message);
            return MPT_OK;
        }
        if (s != MPT_OK) return mpt__fail(ctx, s, "context: %s", message);
        ctx->backend = table;
        ctx->backend_impl = impl;
        mpt__log(ctx, MPT_LOG_INFO, "%s", message);
    }
#endif
    return MPT_OK;
}

MPTDEF const mpt_backend *mpt_context_backend(const mpt_context *ctx, void **impl) {
    if (impl) *impl = ctx ? ctx->backend_impl : NULL;
    return ctx ? ctx->backend : NULL;
}

MPTDEF void mpt_context_destroy(mpt_context *ctx) {
    int i;
    if (!ctx) return;
    if (ctx->backend && ctx->backend_impl != (void *)ctx) ctx->backend->destroy(ctx->backend_impl);
    mpt__pool_stop(ctx);
    mpt__free(ctx, ctx->worker_args);
    if (ctx->scratch) {
        for (i = 0; i < ctx->num_threads; i++) mpt__free(ctx, ctx->scratch[i]);
        mpt__free(ctx, ctx->scratch);
    }
    ctx->allocator.free(ctx->allocator.user_data, ctx);
}

MPTDEF mpt_status mpt_context_create(const mpt_context_desc *desc, mpt_context **out) {
    mpt_context_desc d;
    mpt_context *ctx, early;
    int i;
    mpt_status s;
    if (!out) return MPT_ERR_INVALID_ARGUMENT;
    *out = NULL;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    /* Until the context exists, messages go to the descriptor's logger. */
    memset(&early, 0, sizeof early);
    early.logger = d.logger;
    if ((d.allocator.alloc == NULL) != (d.allocator.free == NULL)) {
        mpt__log(&early, MPT_LOG_ERROR, "context: allocator needs both alloc and free");
        return MPT_ERR_INVALID_ARGUMENT;
    }
    if (!d.allocator.alloc) {
        d.allocator.alloc = mpt__default_alloc;
        d.allocator.free = mpt__default_free;
    }
    if (d.num_threads < 0 || d.num_threads > 1024) {
        mpt__log(&early, MPT_LOG_ERROR, "context: num_threads %d is not in 0..1024",
                 d.num_threads);
        return MPT_ERR_INVALID_ARGUMENT;
    }
    ctx = (mpt_context *)d.allocator.alloc(d.allocator.user_data, sizeof *ctx, MPT__ALIGN);
    if (!ctx) return MPT_ERR_OUT_OF_MEMORY;
    memset(ctx, 0, sizeof *ctx);
    ctx->allocator = d.allocator;
    ctx->logger = d.logger;
    ctx->num_threads = d.num_threads ? d.num_threads : mpt__default_threads();
    ctx->cpu = mpt__detect_cpu() & ~d.disable_cpu_features;
    ctx->scratch = (void **)mpt__calloc(ctx, sizeof(void *) * (size_t)ctx->num_threads);
    if (!ctx->scratch) {
        s = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "context: out of memory");
        goto fail;
    }
    for (i = 0; i < ctx->num_threads; i++) {
        ctx->scratch[i] = mpt__alloc(ctx, MPT__THREAD_SCRATCH_BYTES);
        if (!ctx->scratch[i]) {
            s = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY,
                          "context: cannot allocate %zu bytes of scratch for thread %d",
                          (size_t)MPT__THREAD_SCRATCH_BYTES, i);
            goto fail;
        }
    }
    s = mpt__pool_start(ctx);
    if (s != MPT_OK) goto fail;
    ctx->desc = d;
    s = mpt__choose_backend(ctx, &d);
    if (s != MPT_OK) goto fail;
    *out = ctx;
    return MPT_OK;
fail:
    mpt_context_destroy(ctx);
    return s;
}

MPTDEF const char *mpt_context_error(const mpt_context *ctx) { return ctx ? ctx->error : ""; }
MPTDEF int mpt_context_num_threads(const mpt_context *ctx) { return ctx ? ctx->num_threads : 0; }
MPTDEF int mpt_context_cpu_features(const mpt_context *ctx) { return ctx ? ctx->cpu : 0; }

/* ---- devices: the CPU as device 0, then the CUDA devices ------------------- */

/* Copies text without its leading and trailing blanks (the brand string
   pads with spaces); returns whether anything was left. */
static int mpt__trimmed_copy(char *out, size_t size, const char *text) {
    size_t n;
    while (*text == ' ' || *text == '\t') text++;
    n = strlen(text);
    while (n > 0 && (text[n - 1] == ' ' || text[n - 1] == '\t')) n--;
    if (n == 0) return 0;
    snprintf(out, size, "%.*s", (int)n, text);
    return 1;
}

/* The CPU's model name: CPUID's brand string (leaves 0x80000002..4) where
   there is one, else /proc/cpuinfo's "model name", else "CPU". */
static void mpt__cpu_name(char *name, size_t size) {
    FILE *f;
    char line[512];
    snprintf(name, size, "CPU");
#if MPT__X86
    {
        unsigned r[12], leaf;
        char brand[49];
        __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                             : "a"(0x80000000u), "c"(0));
        if (r[0] >= 0x80000004u) {
            for (leaf = 0; leaf < 3; leaf++)
                __asm__ __volatile__("cpuid"
                                     : "=a"(r[4 * leaf]), "=b"(r[4 * leaf + 1]),
                                       "=c"(r[4 * leaf + 2]), "=d"(r[4 * leaf + 3])
                                     : "a"(0x80000002u + leaf), "c"(0));
            memcpy(brand, r, 48);
            brand[48] = 0;
            if (mpt__trimmed_copy(name, size, brand)) return;
        }
    }
#endif
    f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon) {
            line[strcspn(line, "\n")] = 0;
            mpt__trimmed_copy(name, size, colon + 1);
            break;
        }
    }
    fclose(f);
}

/* The MPT_CPU_* bits as the instruction-set names they stand for. */
static void mpt__cpu_feature_words(int features, char *out, size_t size) {
    static const struct { int bit; const char *words; } names[] = {
        {MPT_CPU_AVX2, "avx2 fma"},
        {MPT_CPU_F16C, "f16c"},
        {MPT_CPU_AVX512, "avx512f avx512bw avx512dq avx512vl"},
        {MPT_CPU_AVX512_BF16, "avx512bf16"},
        {MPT_CPU_AVX512_VNNI, "avx512vnni"}};
    size_t used = 0, i;
    out[0] = 0;
    for (i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(features & names[i].bit) || used >= size) continue;
        snprintf(out + used, size - used, "%s%s", used ? " " : "", names[i].words);
        used += strlen(out + used);
    }
}

/* RAM in bytes from /proc/meminfo (MemTotal, MemAvailable); without it,
   sysconf's page counts (whose "available" is the free pages only). */
static void mpt__cpu_memory(int64_t *total, int64_t *available) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kib;
    *total = *available = 0;
#if defined(_SC_PHYS_PAGES) && defined(_SC_AVPHYS_PAGES) /* not in POSIX: glibc's */
    {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        *total = pages > 0 && page > 0 ? (int64_t)pages * page : 0;
        pages = sysconf(_SC_AVPHYS_PAGES);
        *available = pages > 0 && page > 0 ? (int64_t)pages * page : 0;
    }
#endif
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %lld kB", &kib) == 1) *total = (int64_t)kib * 1024;
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) *available = (int64_t)kib * 1024;
    }
    fclose(f);
}

static void mpt__cpu_device_info(mpt_device_info *out) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    out->kind = MPT_DEVICE_CPU;
    mpt__cpu_name(out->name, sizeof out->name);
    out->cores = cores > 0 ? (int)cores : 1;
    out->cpu_features = mpt__detect_cpu();
    mpt__cpu_feature_words(out->cpu_features, out->features, sizeof out->features);
    mpt__cpu_memory(&out->memory_total, &out->memory_free);
}

MPTDEF int mpt_device_count(const mpt_context *ctx) {
    (void)ctx;
#ifdef MPT_CUDA
    return 1 + mpt_cuda_device_count();
#else
    return 1;
#endif
}

MPTDEF mpt_status mpt_device_query(mpt_context *ctx, int index, mpt_device_info *out) {
    int count;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "device: NULL out");
    memset(out, 0, sizeof *out);
    count = mpt_device_count(ctx);
    if (index < 0 || index >= count)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "device: index %d is not in 0..%d (0 is the CPU%s)", index, count - 1,
                         count > 1 ? ", 1.. the CUDA devices" : "; this build sees no other");
    if (index == 0) {
        mpt__cpu_device_info(out);
        return MPT_OK;
    }
#ifdef MPT_CUDA
    {
        char message[512] = "";
        mpt_status s = mpt_cuda_device_query(index - 1, out, message, sizeof message);
        if (s != MPT_OK) return mpt__fail(ctx, s, "device %d: %s", index, message);
    }
#endif
    return MPT_OK;
}

/* Overflow-checked arithmetic for sizes: every size that reaches an
   allocation goes through these. */
static int mpt__mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return 0;
    if (a != 0 && b > INT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

static int mpt__add_ok(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || a > INT64_MAX - b) return 0;
    *out = a + b;
    return 1;
}

/* What a file that is not a regular one is, for messages. */
static const char *mpt__file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    return "a socket or another special file";
}

/* Opens a file the caller named (a checkpoint, a dataset) for reading, and
   only a regular file: a plain open() of a FIFO waits for a writer, maybe
   forever, and a device or directory is never what was meant. So the open
   does not wait (O_NONBLOCK), fstat says what was opened, and only then
   does the descriptor go back to blocking reads. prefix starts messages
   ("checkpoint: " or ""); *size, when wanted, gets the file's size. On
   failure *fd is -1 and nothing is left open. */
static mpt_status mpt__open_regular(mpt_context *ctx, const char *prefix, const char *path,
                                    int *fd, int64_t *size) {
    struct stat st;
    int flags;
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY);
    if (*fd < 0)
        return mpt__fail(ctx, MPT_ERR_IO, "%scannot open '%s': %s", prefix, path,
                         strerror(errno));
    if (fstat(*fd, &st) != 0) {
        int err = errno;
        close(*fd);
        *fd = -1;
        return mpt__fail(ctx, MPT_ERR_IO, "%scannot stat '%s': %s", prefix, path, strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
        close(*fd);
        *fd = -1;
        return mpt__fail(ctx, MPT_ERR_IO, "%scannot read '%s': it is %s, not a regular file",
                         prefix, path, mpt__file_kind(st.st_mode));
    }
    flags = fcntl(*fd, F_GETFL);
    if (flags < 0 || fcntl(*fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        int err = errno;
        close(*fd);
        *fd = -1;
        return mpt__fail(ctx, MPT_ERR_IO, "%scannot read '%s': %s", prefix, path, strerror(err));
    }
    if (size) *size = (int64_t)st.st_size;
    return MPT_OK;
}

/* =============================================================================
   @impl-dtypes
   ============================================================================= */

MPTDEF const char *mpt_dtype_name(mpt_dtype dtype) {
    switch (dtype) {
    case MPT_FLOAT32: return "float32";
    case MPT_FLOAT16: return "float16";
    case MPT_BFLOAT16: return "bfloat16";
    case MPT_INT32: return "int32";
    case MPT_UINT8: return "uint8";
    case MPT_INT8: return "int8";
    default: return "?";
    }
}

MPTDEF size_t mpt_dtype_size(mpt_dtype dtype) {
    switch (dtype) {
    case MPT_FLOAT32: case MPT_INT32: return 4;
    case MPT_FLOAT16: case MPT_BFLOAT16: return 2;
    case MPT_UINT8: case MPT_INT8: return 1;
    default: return 0;
    }
}

MPTDEF int mpt_dtype_is_float(mpt_dtype dtype) {
    return dtype == MPT_FLOAT32 || dtype == MPT_FLOAT16 || dtype == MPT_BFLOAT16;
}

/* float <-> float16 / bfloat16.

   The scalar functions are the definition; every vector path (F16C, AVX2,
   AVX-512) gives the same bits for every input, which tests/test_convert.c
   checks over all 65,536 half and bfloat16 patterns and their rounding
   boundaries. Narrowing rounds to nearest even, keeps subnormals, and
   overflows to ±inf (float16: from |x| >= 65520, the midpoint between
   65504 and 2^16).

   NaN: the result is a quiet NaN of the same sign whose payload is the
   leading payload bits of the input (truncated when narrowing, zero-filled
   when widening), with the quiet bit set. That is exactly what
   vcvtps2ph / vcvtph2ps / vcvtneps2bf16 produce, so hardware and portable
   paths agree; the one exception is bfloat16 -> float, a plain shift, which
   keeps a signalling NaN signalling (it is exact, so no instruction is
   involved and nothing needs quieting). */

static uint32_t mpt__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float mpt__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

MPTDEF mpt_half mpt_float_to_half(float f) {
    uint32_t x = mpt__f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) /* NaN: quiet bit set, top 10 payload bits kept (as vcvtps2ph) */
        return (mpt_half)(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));
    if (absx >= 0x477ff000u) /* inf, or rounds to >= 65520: overflow to inf */
        return (mpt_half)(sign | 0x7c00u);
    if (absx < 0x38800000u) {
        /* Result is subnormal (or zero): shift the 24-bit significand right
           and round to nearest even on the bits shifted out. A carry out of
           0x3ff gives 0x400, the smallest normal, which is right. */
        uint32_t e = absx >> 23;
        uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* >= 14 */
        uint32_t q, rem, half;
        /* Below 2^-25 (half the smallest subnormal) everything rounds to 0;
           this also covers float subnormals (e == 0). */
        if (e < 102) return (mpt_half)sign;
        q = mant >> shift;
        rem = mant & ((1u << shift) - 1);
        half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (mpt_half)(sign | q);
    }
    {
        /* Normal: rebias the exponent, round the 13 dropped bits to nearest
           even; a carry into the exponent is the right answer. */
        uint32_t r = absx - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (mpt_half)(sign | (r >> 13));
    }
}

MPTDEF float mpt_half_to_float(mpt_half h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t m = (uint32_t)h & 0x3ffu;
    if (e == 0x1f) /* inf; NaN gets the quiet bit, as vcvtph2ps sets it */
        return mpt__bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e == 0) {
        /* Subnormal m · 2^-24: normalise so the leading 1 becomes implicit. */
        uint32_t exp = 113; /* float exponent of 2^-14, the half subnormal scale */
        if (m == 0) return mpt__bits_f32(sign);
        while (!(m & 0x400u)) {
            m <<= 1;
            exp--;
        }
        return mpt__bits_f32(sign | (exp << 23) | ((m & 0x3ffu) << 13));
    }
    return mpt__bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

MPTDEF mpt_bf16 mpt_float_to_bf16(float f) {
    uint32_t x = mpt__f32_bits(f);
    /* NaN: quiet bit set, top 7 payload bits kept (as vcvtneps2bf16). */
    if ((x & 0x7fffffffu) > 0x7f800000u) return (mpt_bf16)((x >> 16) | 0x40u);
    /* Round to nearest even on the low 16 bits; float subnormals round like
       any other value and a carry out of the largest finite gives inf. */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (mpt_bf16)(x >> 16);
}

MPTDEF float mpt_bf16_to_float(mpt_bf16 b) { return mpt__bits_f32((uint32_t)b << 16); }

/* A conversion kernel: n elements from src to dst. The dtypes are any two
   different float dtypes. */
typedef void (*mpt__convert_fn)(mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                                const void *src, int64_t n);

static void mpt__convert_scalar(mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                                const void *src, int64_t n) {
    const float *sf = (const float *)src;
    const uint16_t *s16 = (const uint16_t *)src;
    float *df = (float *)dst;
    uint16_t *d16 = (uint16_t *)dst;
    int64_t i;
    /* One loop per pair so nothing is decided per element. */
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_half(sf[i]);
    } else if (src_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_bf16(sf[i]);
    } else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) df[i] = mpt_half_to_float(s16[i]);
    } else if (src_dtype == MPT_FLOAT16) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_bf16(mpt_half_to_float(s16[i]));
    } else if (dst_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) df[i] = mpt_bf16_to_float(s16[i]);
    } else {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_half(mpt_bf16_to_float(s16[i]));
    }
}

#if MPT__X86
/* The vector kernels load a register of any float dtype as float32 and store
   float32 as any dtype; a float16 <-> bfloat16 conversion goes through
   float32, which is exact one way and rounds once the other, so it equals
   the scalar composition. One generic loop is forced inline into a kernel
   per dtype pair, so the dtype switches fold away at compile time. */
#define MPT__ALWAYS_INLINE __attribute__((always_inline)) inline
#if defined(__GNUC__) && !defined(__clang__)
/* GCC 12's AVX-512 headers start "undefined" vectors as `__Y = __Y`, which
   g++ reports as maybe-uninitialized once they are inlined here. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/* bfloat16 rounding in integer arithmetic, the scalar function lane by lane.
   (vcvtneps2bf16 is not used: it flushes float32 subnormal inputs to zero,
   which the scalar function does not.) */
static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE __m256i mpt__avx2_bf16_bits(__m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    /* |x| > inf as signed int32 compares: both sides are non-negative. */
    __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                        _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, qnan, is_nan);
}

static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE __m256 mpt__avx2_load(mpt_dtype t, const void *p) {
    switch (t) {
    case MPT_FLOAT16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case MPT_BFLOAT16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE void mpt__avx2_store(mpt_dtype t, void *p, __m256 v) {
    switch (t) {
    case MPT_FLOAT16:
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        break;
    case MPT_BFLOAT16: {
        /* Lanes hold values <= 0xffff, so the saturating pack is exact. */
        __m256i b = mpt__avx2_bf16_bits(v);
        _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b),
                                                        _mm256_extracti128_si256(b, 1)));
        break;
    }
    default: _mm256_storeu_ps((float *)p, v); break;
    }
}

/* 8 elements a step; the last n % 8 go through the scalar kernel. */
static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE void mpt__avx2_loop(mpt_dtype dt, void *dst,
                                                               mpt_dtype st, const void *src,
                                                               int64_t n) {
    size_t ds = dt == MPT_FLOAT32 ? 4 : 2, ss = st == MPT_FLOAT32 ? 4 : 2;
    int64_t i;
    for (i = 0; i + 8 <= n; i += 8)
        mpt__avx2_store(dt, (char *)dst + (size_t)i * ds,
                        mpt__avx2_load(st, (const char *)src + (size_t)i * ss));
    if (i < n)
        mpt__convert_scalar(dt, (char *)dst + (size_t)i * ds, st,
                            (const char *)src + (size_t)i * ss, n - i);
}

/* Calls loop(dst_dtype, dst, src_dtype, src, n) with the pair's dtypes as
   constants, so that each always-inline loop is compiled once per pair of
   different dtypes with its loads' and stores' switches folded away; the
   one list of pairs for the AVX2 and the AVX-512 kernels. */
#define MPT__CONVERT_PAIRS(loop, dst_dtype, dst, src_dtype, src, n)                                \
    do {                                                                                           \
        if ((src_dtype) == MPT_FLOAT32 && (dst_dtype) == MPT_FLOAT16)                              \
            loop(MPT_FLOAT16, dst, MPT_FLOAT32, src, n);                                           \
        else if ((src_dtype) == MPT_FLOAT32)                                                       \
            loop(MPT_BFLOAT16, dst, MPT_FLOAT32, src, n);                                          \
        else if ((src_dtype) == MPT_FLOAT16 && (dst_dtype) == MPT_FLOAT32)                         \
            loop(MPT_FLOAT32, dst, MPT_FLOAT16, src, n);                                           \
        else if ((src_dtype) == MPT_FLOAT16)                                                       \
            loop(MPT_BFLOAT16, dst, MPT_FLOAT16, src, n);                                          \
        else if ((dst_dtype) == MPT_FLOAT32)                                                       \
            loop(MPT_FLOAT32, dst, MPT_BFLOAT16, src, n);                                          \
        else                                                                                       \
            loop(MPT_FLOAT16, dst, MPT_BFLOAT16, src, n);                                          \
    } while (0)

/* Needs AVX2, and F16C for the pairs that involve float16. */
static MPT__TARGET_AVX2 void mpt__convert_avx2(mpt_dtype dst_dtype, void *dst,
                                              mpt_dtype src_dtype, const void *src,
                                              int64_t n) {
    MPT__CONVERT_PAIRS(mpt__avx2_loop, dst_dtype, dst, src_dtype, src, n);
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE __m512i mpt__avx512_bf16_bits(__m512 v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, is_nan, qnan);
}

/* Masked loads and stores touch only the lanes in m, so the tail needs no
   scalar loop and never reads past the end. */
static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE __m512 mpt__avx512_load(mpt_dtype t, const void *p,
                                                                     __mmask16 m) {
    switch (t) {
    case MPT_FLOAT16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case MPT_BFLOAT16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    default: return _mm512_maskz_loadu_ps(m, p);
    }
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE void mpt__avx512_store(mpt_dtype t, void *p,
                                                                    __m512 v, __mmask16 m) {
    switch (t) {
    case MPT_FLOAT16:
        _mm256_mask_storeu_epi16(p, m,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
    case MPT_BFLOAT16: /* vpmovdw truncates each lane to its low 16 bits */
        _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(mpt__avx512_bf16_bits(v)));
        break;
    default: _mm512_mask_storeu_ps(p, m, v); break;
    }
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE void mpt__avx512_loop(mpt_dtype dt, void *dst,
                                                                   mpt_dtype st, const void *src,
                                                                   int64_t n) {
    size_t ds = dt == MPT_FLOAT32 ? 4 : 2, ss = st == MPT_FLOAT32 ? 4 : 2;
    int64_t i;
    for (i = 0; i + 16 <= n; i += 16)
        mpt__avx512_store(dt, (char *)dst + (size_t)i * ds,
                          mpt__avx512_load(st, (const char *)src + (size_t)i * ss, 0xffff),
                          0xffff);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (unsigned)(n - i)) - 1);
        mpt__avx512_store(dt, (char *)dst + (size_t)i * ds,
                          mpt__avx512_load(st, (const char *)src + (size_t)i * ss, m), m);
    }
}

static MPT__TARGET_AVX512 void mpt__convert_avx512(mpt_dtype dst_dtype, void *dst,
                                                  mpt_dtype src_dtype, const void *src,
                                                  int64_t n) {
    MPT__CONVERT_PAIRS(mpt__avx512_loop, dst_dtype, dst, src_dtype, src, n);
}
#undef MPT__CONVERT_PAIRS
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif /* MPT__X86 */

/* The fastest kernel the CPU bits allow for this dtype pair. */
static mpt__convert_fn mpt__convert_kernel(int cpu, mpt_dtype dst_dtype, mpt_dtype src_dtype) {
#if MPT__X86
    int f16 = dst_dtype == MPT_FLOAT16 || src_dtype == MPT_FLOAT16;
    /* The EVEX vcvtps2ph/vcvtph2ps belong to AVX-512F: no F16C bit needed. */
    if (cpu & MPT_CPU_AVX512) return mpt__convert_avx512;
    if ((cpu & MPT_CPU_AVX2) && (!f16 || (cpu & MPT_CPU_F16C))) return mpt__convert_avx2;
#else
    (void)cpu;
    (void)dst_dtype;
    (void)src_dtype;
#endif
    return mpt__convert_scalar;
}

/* Large conversions are cut into fixed chunks, one task each; every element
   is converted on its own, so the split never changes a result. One core
   converts ~10^10 elements/s while the data sit in cache, faster than
   waking the pool pays back, so only conversions that stream from memory
   (a few MB and up) are split. */
#define MPT__CONVERT_CHUNK ((int64_t)1 << 16)
#define MPT__CONVERT_PARALLEL_MIN ((int64_t)1 << 20)

typedef struct mpt__convert_job {
    mpt__convert_fn fn;
    mpt_dtype dst_dtype, src_dtype;
    char *dst;
    const char *src;
    int64_t n;
} mpt__convert_job;

static void mpt__convert_task(void *arg, int64_t task, int thread) {
    const mpt__convert_job *job = (const mpt__convert_job *)arg;
    int64_t begin = task * MPT__CONVERT_CHUNK;
    int64_t count = MPT__MIN(MPT__CONVERT_CHUNK, job->n - begin);
    (void)thread;
    job->fn(job->dst_dtype, job->dst + (size_t)begin * mpt_dtype_size(job->dst_dtype),
            job->src_dtype, job->src + (size_t)begin * mpt_dtype_size(job->src_dtype), count);
}

/* Unchecked conversion of n elements between float dtypes (ctx may be NULL:
   portable path, one thread). Bit-identical to the scalar functions on
   every path. dst and src must not overlap unless they are the same buffer
   of the same dtype. */
static void mpt__convert(const mpt_context *ctx, mpt_dtype dst_dtype, void *dst,
                         mpt_dtype src_dtype, const void *src, int64_t n) {
    mpt__convert_job job;
    if (n <= 0) return; /* also keeps NULL pointers away from memmove */
    if (dst_dtype == src_dtype) {
        if (dst != src) memmove(dst, src, (size_t)n * mpt_dtype_size(src_dtype));
        return;
    }
    job.fn = mpt__convert_kernel(ctx ? ctx->cpu : 0, dst_dtype, src_dtype);
    job.dst_dtype = dst_dtype;
    job.src_dtype = src_dtype;
    job.dst = (char *)dst;
    job.src = (const char *)src;
    job.n = n;
    if (ctx && n >= MPT__CONVERT_PARALLEL_MIN) {
        /* The pool is the only part of the context this touches. Called
           from inside a task (a layer's own parallel-for), this runs
           inline on that thread. */
        mpt__parallel_for((mpt_context *)ctx, (n + MPT__CONVERT_CHUNK - 1) / MPT__CONVERT_CHUNK,
                          mpt__convert_task, &job);
        return;
    }
    job.fn(dst_dtype, dst, src_dtype, src, n);
}

MPTDEF mpt_status mpt_convert(mpt_context *ctx, mpt_dtype dst_dtype, void *dst,
                              mpt_dtype src_dtype, const void *src, int64_t n) {
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!mpt_dtype_is_float(dst_dtype) || !mpt_dtype_is_float(src_dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "convert: %s -> %s is not between float dtypes",
                         mpt_dtype_name(src_dtype), mpt_dtype_name(dst_dtype));
    if (n < 0) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "convert: count %lld < 0", (long long)n);
    if (n > 0 && (!dst || !src))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "convert: NULL %s", dst ? "src" : "dst");
    if (n > 0 && dst_dtype != src_dtype) {
        /* Elements of different sizes: an overlap would read what was just written. */
        uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
        if (d < s + (uintptr_t)n * mpt_dtype_size(src_dtype) &&
            s < d + (uintptr_t)n * mpt_dtype_size(dst_dtype))
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "convert: dst and src overlap (%s -> %s)",
                             mpt_dtype_name(src_dtype), mpt_dtype_name(dst_dtype));
    }
    mpt__convert(ctx, dst_dtype, dst, src_dtype, src, n);
    return MPT_OK;
}

/* Element i of an array of any float dtype, as float32, and back (for the
   few places that touch single elements; bulk work uses mpt__convert). */
static float mpt__load_f32(mpt_dtype dtype, const void *data, int64_t i) {
    switch (dtype) {
    case MPT_FLOAT16: return mpt_half_to_float(((const mpt_half *)data)[i]);
    case MPT_BFLOAT16: return mpt_bf16_to_float(((const mpt_bf16 *)data)[i]);
    default: return ((const float *)data)[i];
    }
}

static void mpt__store_f32(mpt_dtype dtype, void *data, int64_t i, float v) {
    switch (dtype) {
    case MPT_FLOAT16: ((mpt_half *)data)[i] = mpt_float_to_half(v); break;
    case MPT_BFLOAT16: ((mpt_bf16 *)data)[i] = mpt_float_to_bf16(v); break;
    default: ((float *)data)[i] = v; break;
    }
}

/* =============================================================================
   @impl-tensors
   ============================================================================= */

MPTDEF char *mpt_shape_format(char *buf, size_t size, int rank, const int64_t *shape) {
    size_t used = 0;
    int i;
    if (!buf || size == 0) return buf;
    buf[0] = 0;
    used += (size_t)snprintf(buf + used, size - MPT__MIN(used, size), "(");
    for (i = 0; i < rank && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "",
                                 (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, rank == 1 ? ",)" : ")");
    return buf;
}

/* Elements of a shape, or -1 when a dimension is not positive or the
   product overflows. */
static int64_t mpt__shape_count(int rank, const int64_t *shape) {
    int64_t n = 1;
    int i;
    for (i = 0; i < rank; i++)
        if (shape[i] <= 0 || !mpt__mul_ok(n, shape[i], &n)) return -1;
    return n;
}

static mpt_status mpt__tensor_init(mpt_context *ctx, mpt_tensor *t, mpt_dtype dtype, int rank,
                                   const int64_t *shape, int64_t *bytes) {
    int64_t n;
    int i;
    char s[96];
    if (!t) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "tensor: NULL tensor");
    if (mpt_dtype_size(dtype) == 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "tensor: unknown dtype %d", (int)dtype);
    if (rank < 0 || rank > MPT_MAX_RANK)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "tensor: rank %d is not in 0..%d",
                         rank, MPT_MAX_RANK);
    if (rank > 0 && !shape)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "tensor: NULL shape");
    for (i = 0; i < rank; i++)
        if (shape[i] <= 0)
            return mpt__fail(ctx, MPT_ERR_SHAPE, "tensor: shape %s has a dimension <= 0",
                             mpt_shape_format(s, sizeof s, rank, shape));
    n = mpt__shape_count(rank, shape);
    if (n < 0 || !mpt__mul_ok(n, (int64_t)mpt_dtype_size(dtype), bytes) ||
        (uint64_t)*bytes > (uint64_t)SIZE_MAX)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "tensor: shape %s of %s is too large",
                         mpt_shape_format(s, sizeof s, rank, shape), mpt_dtype_name(dtype));
    memset(t, 0, sizeof *t);
    t->dtype = dtype;
    t->rank = rank;
    if (rank > 0) memcpy(t->shape, shape, sizeof(int64_t) * (size_t)rank);
    t->device = MPT_DEVICE_CPU;
    return MPT_OK;
}

MPTDEF mpt_status mpt_tensor_alloc(mpt_context *ctx, mpt_tensor *t, mpt_dtype dtype, int rank,
                                   const int64_t *shape) {
    int64_t bytes = 0;
    MPT__CHECK(mpt__tensor_init(ctx, t, dtype, rank, shape, &bytes));
    t->data = mpt__calloc(ctx, (size_t)bytes);
    if (!t->data)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "tensor: cannot allocate %lld bytes",
                         (long long)bytes);
    t->owns_data = 1;
    return MPT_OK;
}

MPTDEF mpt_status mpt_tensor_wrap(mpt_context *ctx, mpt_tensor *t, mpt_dtype dtype, int rank,
                                  const int64_t *shape, void *data) {
    int64_t bytes = 0;
    MPT__CHECK(mpt__tensor_init(ctx, t, dtype, rank, shape, &bytes));
    if (!data) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "tensor: NULL data to wrap");
    t->data = data;
    return MPT_OK;
}

/* A borrowed tensor over data of `batch` samples of one sample's shape
   (rank, shape), on device. Nothing is checked: the sample shape is a
   model's or a dataset's, checked when it was made. */
static void mpt__batch_view(mpt_tensor *t, mpt_dtype dtype, int64_t batch, int rank,
                            const int64_t *shape, void *data, mpt_device device) {
    memset(t, 0, sizeof *t);
    t->dtype = dtype;
    t->rank = rank + 1;
    t->shape[0] = batch;
    memcpy(t->shape + 1, shape, sizeof(int64_t) * (size_t)rank);
    t->data = data;
    t->device = device;
}

MPTDEF void mpt_tensor_free(mpt_context *ctx, mpt_tensor *t) {
    if (!t) return;
    if (t->owns_data && ctx) mpt__free(ctx, t->data);
    memset(t, 0, sizeof *t);
}

MPTDEF int64_t mpt_tensor_count(const mpt_tensor *t) {
    int64_t n = 1;
    int i;
    if (!t) return 0;
    for (i = 0; i < t->rank; i++) n *= t->shape[i];
    return n;
}

MPTDEF size_t mpt_tensor_bytes(const mpt_tensor *t) {
    return t ? (size_t)mpt_tensor_count(t) * mpt_dtype_size(t->dtype) : 0;
}

/* =============================================================================
   @impl-activations (shared by the GEMM epilogue, Dense, Conv2D, Activation)
   ============================================================================= */

/* ReLU and its gradient, written so that NaN passes through (x <= 0 is
   false for NaN), as in PyTorch and TensorFlow: a NaN in a weight or an
   activation must show, not turn into 0. -0 gives +0. Every SIMD path and
   the CUDA kernels compute the same. */
static float mpt__relu(float x) { return x <= 0 ? 0.0f : x; }
static float mpt__relu_grad(float y, float dy) { return y <= 0 ? 0.0f : dy; }

static float mpt__gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

static float mpt__sigmoid(float x) {
    /* Two forms, so that exp never overflows. */
    if (x >= 0) return 1.0f / (1.0f + expf(-x));
    {
        float e = expf(x);
        return e / (1.0f + e);
    }
}

/* Softmax of each row of x (rows × cols), in place, in float32. */
static void mpt__softmax_rows(float *x, int64_t rows, int64_t cols) {
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        float *row = x + r * cols, max = row[0], sum = 0;
        for (c = 1; c < cols; c++) max = row[c] > max ? row[c] : max;
        for (c = 0; c < cols; c++) sum += (row[c] = expf(row[c] - max));
        for (c = 0; c < cols; c++) row[c] /= sum;
    }
}

/* y = act(x) in place on n floats (elementwise activations only). */
static void mpt__activation_forward(mpt_activation act, float *x, int64_t n) {
    int64_t i;
    switch (act) {
    case MPT_ACT_RELU: for (i = 0; i < n; i++) x[i] = mpt__relu(x[i]); break;
    case MPT_ACT_GELU: for (i = 0; i < n; i++) x[i] = mpt__gelu(x[i]); break;
    case MPT_ACT_SIGMOID: for (i = 0; i < n; i++) x[i] = mpt__sigmoid(x[i]); break;
    case MPT_ACT_TANH: for (i = 0; i < n; i++) x[i] = tanhf(x[i]); break;
    default: break;
    }
}

/* dz = dy · act'(z) for n elements. `z` is the pre-activation input (needed
   by GELU) and `y` the output (enough for the others); either may be NULL
   where the activation does not need it. Softmax: rows × cols with
   dz = y ⊙ (dy − Σ dy·y) per row. */
static void mpt__activation_backward(mpt_activation act, const float *z, const float *y,
                                     const float *dy, float *dz, int64_t n, int64_t cols) {
    int64_t i, c;
    switch (act) {
    case MPT_ACT_NONE:
        if (dz != dy) memcpy(dz, dy, sizeof(float) * (size_t)n);
        break;
    case MPT_ACT_RELU: for (i = 0; i < n; i++) dz[i] = mpt__relu_grad(y[i], dy[i]); break;
    case MPT_ACT_GELU:
        for (i = 0; i < n; i++) {
            float x = z[i];
            float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
            float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
            dz[i] = dy[i] * (cdf + x * pdf);
        }
        break;
    case MPT_ACT_SIGMOID: for (i = 0; i < n; i++) dz[i] = dy[i] * y[i] * (1 - y[i]); break;
    case MPT_ACT_TANH: for (i = 0; i < n; i++) dz[i] = dy[i] * (1 - y[i] * y[i]); break;
    case MPT_ACT_SOFTMAX:
        for (i = 0; i < n; i += cols) {
            float dot = 0;
            for (c = 0; c < cols; c++) dot += dy[i + c] * y[i + c];
            for (c = 0; c < cols; c++) dz[i + c] = y[i + c] * (dy[i + c] - dot);
        }
        break;
    default: break;
    }
}

static int mpt__activation_valid(mpt_activation act) { return act >= 0 && act < MPT_ACT_COUNT_; }

MPTDEF const char *mpt_activation_name(mpt_activation act) {
    static const char *names[] = {"linear", "relu", "gelu", "sigmoid", "tanh", "softmax"};
    return mpt__activation_valid(act) ? names[act] : "?";
}

/* =============================================================================
   @impl-gemm
   ============================================================================= */

/* The CPU matrix product: C = alpha · op(A) · op(B) + beta · C, then
   C = act(C + bias), with op(A) M×K, op(B) K×N, C M×N, all row-major.

   HOW IT IS TILED (Goto/BLIS blocking, seen from row-major C)

       split C into T rectangles, T = threads            (one task each)
       task: for jc over its columns, NC at a time
               for pc over K, KC at a time
                 pack B[pc.., jc..] into KC×NC panels      (L2-resident)
                 for ir over its rows, MR at a time
                   pack A[ir.., pc..] into a KC×MR panel   (L1-resident)
                   for jr over the NC columns, NR at a time
                     micro-kernel: an MR×NR tile of C in registers,
                     KC rank-1 updates, then the epilogue

   The micro-kernel holds its MR×NR accumulators in registers and, per k,
   loads NR/16 vectors of B and broadcasts MR values of A, so each loaded
   value feeds several FMAs. With AVX-512 it is 12×32: 24 zmm accumulators,
   2 B vectors and a broadcast (27 of 32 registers); Zen 4 retires one
   512-bit FMA per cycle at 4 cycles latency, so 24 independent chains keep
   it busy, and 14 loads per 24 FMAs stay within its two load ports.
   AVX2 uses 6×16 (12 ymm accumulators), the portable C path 4×8.

   KC = 512 makes an A panel 24 KiB, which stays in the 32 KiB L1 while
   the B panels (64 KiB each) stream past it from L2; NC = 512 makes a B
   block 1 MiB, Zen 4's L2 per core. (Measured on Zen 4: KC 512 / NC 512
   beat 256 and 384 by 3-10%, mostly by writing C fewer times.) K is cut
   into equal blocks of at most KC (a multiple of 8), which depends on K
   only, never on the thread count.

   PACKING. Everything is packed into the thread's scratch memory (1 MiB
   of B block and a 24 KiB A panel out of MPT__THREAD_SCRATCH_BYTES; a
   product allocates nothing), converting float16/bfloat16 to float32 on
   the way. Where the depth is contiguous in memory (A not transposed, B
   transposed) packing is a transpose, done 8×8 in registers. With AVX-512
   BF16 and bfloat16 inputs, pairs of k stay bfloat16 side by side (a
   32-bit lane holds k and k+1) for vdpbf16ps, which does two k per
   instruction; an odd K is padded with a zero half. Edges are padded with
   zeros in the panels and stored with masks; a last B panel of at most
   NR/2 columns runs a half-width kernel, so N = 10 does 16 columns of
   work, not 32.

   WORK SPLIT. Tasks are rectangles of C, never slices of K: every element
   of C is computed by one thread with the same sequence of operations
   whatever the thread count, so results are bit-identical for 1 or 64
   threads. The rectangles are chosen to repack the least (splitting rows
   repacks B, splitting columns repacks A). Small products run as one task
   on the calling thread, where waking the pool would cost more than it
   saves.

   EPILOGUE. The first K block computes alpha·AB + beta·C (the old C is not
   read when beta is 0, so NaN garbage there is ignored), the later blocks
   add alpha·AB, and the last also adds the bias and applies the
   activation, while the tile is still in cache. alpha = 0 (alpha_is_zero)
   or K = 0 reads neither A nor B, as BLAS does. */

#define MPT__GEMM_KC 512 /* depth block (max)                    */
#define MPT__GEMM_NC 512 /* columns of C per packed B block (max) */
/* Below this many multiply-adds a product runs on the calling thread. */
#define MPT__GEMM_SERIAL_FMAS ((int64_t)1 << 20)

typedef enum mpt__gemm_path {
    MPT__GEMM_SCALAR = 0,   /* portable C, 4×8                          */
    MPT__GEMM_AVX2 = 1,     /* AVX2 + FMA, 6×16                         */
    MPT__GEMM_AVX512 = 2,   /* AVX-512, 12×32                           */
    MPT__GEMM_AVX512_BF16 = 3 /* AVX-512 BF16 dot products, 12×32 pairs */
} mpt__gemm_path;

/* What the micro-kernel does when it stores its tile. */
typedef struct mpt__gemm_epi {
    float alpha;
    float beta;         /* multiplies the old C when load_c              */
    int load_c;         /* 0: C = alpha·AB (old C never read)            */
    const float *bias;  /* NULL, or the bias of the tile's first column */
    int relu;           /* fused here; other activations run after      */
} mpt__gemm_epi;

/* kc: depth; a: packed A panel (kc × MR); b: packed B panel (kc × bw),
   bw = NR or NR/2; c: the tile's first element; m ≤ MR, n ≤ bw valid. */
typedef void (*mpt__gemm_kernel_fn)(int64_t kc, const void *a, const void *b, int bw, float *c,
                                    int64_t ldc, int m, int n, const mpt__gemm_epi *e);

typedef struct mpt__gemm_job {
    const mpt_gemm_desc *d;
    mpt_context *ctx;
    mpt_dtype dtype;
    mpt__gemm_path path;
    mpt__gemm_kernel_fn kernel;
    int mr, nr;        /* micro-tile                                  */
    int pairs;         /* panels hold bfloat16 k-pairs (uint32 lanes)  */
    int64_t kc, nc;    /* depth block, column block                   */
    int64_t task_rows, task_cols, tasks_n; /* the task grid           */
    float alpha;
} mpt__gemm_job;

/* -----------------------------------------------------------------------------
   Packing. A panel is `w` lanes (rows of A or columns of B) by kc depth;
   element (lane l, depth k) of the source is at index off + l·ls + k·ks,
   where either ls = 1 (lanes contiguous: A transposed, B not) or ks = 1
   (depth contiguous: A not transposed, B transposed). float32 panels are
   laid out [k][w]; bfloat16-pair panels [k/2][w] of uint32 (k low, k+1 high).
   Lanes ≥ `lanes` and the half of a last odd pair are zero.
   ----------------------------------------------------------------------------- */

#if MPT__X86
MPT__TARGET_AVX2 static void mpt__gemm_f16_to_f32_avx2(const mpt_half *s, float *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = mpt_half_to_float(s[i]);
}
#endif

/* n contiguous source elements from index i on, as float32. */
static void mpt__gemm_row_f32(const mpt__gemm_job *job, const void *src, int64_t i, int64_t n,
                              float *d) {
    int64_t t;
    if (job->dtype == MPT_FLOAT32) {
        memcpy(d, (const float *)src + i, sizeof(float) * (size_t)n);
    } else if (job->dtype == MPT_BFLOAT16) {
        const mpt_bf16 *s = (const mpt_bf16 *)src + i;
        for (t = 0; t < n; t++) d[t] = mpt_bf16_to_float(s[t]);
    } else {
#if MPT__X86
        if (job->ctx->cpu & MPT_CPU_F16C) {
            mpt__gemm_f16_to_f32_avx2((const mpt_half *)src + i, d, n);
            return;
        }
#endif
        for (t = 0; t < n; t++) d[t] = mpt__load_f32(MPT_FLOAT16, src, i + t);
    }
}

static void mpt__gemm_pack_f32(const mpt__gemm_job *job, float *dst, int w, const void *src,
                               int64_t off, int64_t ls, int64_t ks, int lanes, int64_t kc) {
    int64_t k, l;
    if (ls == 1) {
        for (k = 0; k < kc; k++) {
            float *d = dst + k * w;
            mpt__gemm_row_f32(job, src, off + k * ks, lanes, d);
            for (l = lanes; l < w; l++) d[l] = 0;
        }
    } else if (job->dtype == MPT_FLOAT32) {
        /* A transpose: 8 depths of each lane at a time, so the reads are
           runs of 32 bytes and the writes stay within a few cache lines. */
        const float *s = (const float *)src + off;
        int64_t k0;
        for (k0 = 0; k0 < kc; k0 += 8) {
            int64_t kn = MPT__MIN(8, kc - k0);
            for (l = 0; l < lanes; l++) {
                const float *sl = s + l * ls + k0;
                float *d = dst + k0 * w + l;
                for (k = 0; k < kn; k++) d[k * w] = sl[k];
            }
        }
        for (l = lanes; l < w; l++)
            for (k = 0; k < kc; k++) dst[k * w + l] = 0;
    } else {
        float tmp[64];
        int64_t k0;
        for (l = 0; l < w; l++) {
            for (k0 = 0; k0 < kc; k0 += 64) {
                int64_t kn = MPT__MIN(64, kc - k0);
                if (l < lanes) mpt__gemm_row_f32(job, src, off + l * ls + k0, kn, tmp);
                for (k = 0; k < kn; k++) dst[(k0 + k) * w + l] = l < lanes ? tmp[k] : 0.0f;
            }
        }
    }
}

static void mpt__gemm_pack_pairs(float *dst_f, int w, const void *src, int64_t off, int64_t ls,
                                 int64_t ks, int lanes, int64_t kc) {
    uint32_t *dst = (uint32_t *)(void *)dst_f;
    const mpt_bf16 *s = (const mpt_bf16 *)src + off;
    int64_t kp, l, npairs = (kc + 1) / 2;
    for (kp = 0; kp < npairs; kp++) {
        int64_t k = 2 * kp;
        int odd_end = k + 1 >= kc;
        uint32_t *d = dst + kp * w;
        if (ls == 1) {
            const mpt_bf16 *s0 = s + k * ks, *s1 = odd_end ? s0 : s0 + ks;
            for (l = 0; l < lanes; l++)
                d[l] = (uint32_t)s0[l] | (odd_end ? 0u : (uint32_t)s1[l] << 16);
        } else {
            for (l = 0; l < lanes; l++) {
                const mpt_bf16 *sl = s + l * ls + k;
                d[l] = (uint32_t)sl[0] | (odd_end ? 0u : (uint32_t)sl[1] << 16);
            }
        }
        for (l = lanes; l < w; l++) d[l] = 0;
    }
}

#if MPT__X86
static __mmask16 mpt__gemm_mask16(int n) {
    return (__mmask16)(n >= 16 ? 0xffffu : n <= 0 ? 0u : (1u << n) - 1u);
}

/* 16 elements of dtype dt at p (lanes outside m read as 0), as float32. */
MPT__TARGET_AVX512 static inline __m512 mpt__gemm_load16(mpt_dtype dt, const void *p,
                                                         __mmask16 m) {
    __m256i h;
    if (dt == MPT_FLOAT32) return _mm512_maskz_loadu_ps(m, p);
    h = _mm256_maskz_loadu_epi16(m, p);
    /* (maskz forms: g++ 12 warns about the _mm512_undefined_* in the plain ones) */
    if (dt == MPT_FLOAT16) return _mm512_maskz_cvtph_ps(m, h);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(m, _mm512_maskz_cvtepu16_epi32(m, h), 16));
}

/* The AVX-512 packer for contiguous lanes (A transposed, B not): one
   masked load and store per 16 lanes and depth, converting to float32 or
   interleaving two depths into bfloat16 pairs. */
MPT__TARGET_AVX512 static void mpt__gemm_pack_lanes_avx512(const mpt__gemm_job *job, float *dst,
                                                           int w, const void *src, int64_t off,
                                                           int64_t ks, int lanes, int64_t kc) {
    const mpt_dtype dt = job->dtype;
    const int64_t es = (int64_t)mpt_dtype_size(dt);
    const char *s = (const char *)src + off * es;
    const int nch = (w + 15) / 16;
    uint32_t *d32 = (uint32_t *)(void *)dst;
    __mmask16 lm[2], wm[2];
    int64_t k;
    int c;
    for (c = 0; c < 2; c++) {
        lm[c] = mpt__gemm_mask16(lanes - 16 * c);
        wm[c] = mpt__gemm_mask16(w - 16 * c);
    }
    if (!job->pairs) {
        for (k = 0; k < kc; k++)
            for (c = 0; c < nch; c++)
                _mm512_mask_storeu_ps(dst + k * w + 16 * c, wm[c],
                                      mpt__gemm_load16(dt, s + (k * ks + 16 * c) * es, lm[c]));
        return;
    }
    for (k = 0; k < kc; k += 2)
        for (c = 0; c < nch; c++) {
            const char *r0 = s + (k * ks + 16 * c) * 2;
            __m256i h0 = _mm256_maskz_loadu_epi16(lm[c], r0);
            __m256i h1 = k + 1 < kc ? _mm256_maskz_loadu_epi16(lm[c], r0 + ks * 2)
                                    : _mm256_setzero_si256();
            __m512i lo = _mm512_maskz_cvtepu16_epi32(lm[c], h0);
            __m512i hi = _mm512_maskz_slli_epi32(lm[c], _mm512_maskz_cvtepu16_epi32(lm[c], h1), 16);
            _mm512_mask_storeu_epi32(d32 + (k / 2) * w + 16 * c, wm[c], _mm512_or_si512(lo, hi));
        }
}

/* The transposing packer for contiguous depth (A not transposed, B
   transposed): 8 depths of 8 lanes are loaded as 8 vectors (converted to
   float32, or 8 bfloat16 pairs as 32-bit units), transposed in registers
   and stored with masks; depths after the last full 8 (and an odd last
   half pair) are left to the portable packer. Returns the depths done. */
MPT__TARGET_AVX512 static int64_t mpt__gemm_pack_depth_avx512(const mpt__gemm_job *job,
                                                              float *dst, int w, const void *src,
                                                              int64_t off, int64_t ls, int lanes,
                                                              int64_t kc) {
    const mpt_dtype dt = job->dtype;
    const int64_t units = job->pairs ? kc / 2 : kc; /* 32-bit depth units */
    const int mode = dt == MPT_FLOAT32 || job->pairs ? 0 : dt == MPT_FLOAT16 ? 1 : 2;
    const float *sf = (const float *)src + off;
    const uint16_t *sh = (const uint16_t *)src + off;
    const int64_t step = mode == 0 && dt != MPT_FLOAT32 ? 2 : 1; /* source elements per unit */
    int64_t u0;
    int l0;
    for (l0 = 0; l0 < w; l0 += 8) {
        const __mmask8 wm = (__mmask8)(w - l0 >= 8 ? 0xff : (1u << (w - l0)) - 1u);
        const float *pf[8];
        const uint16_t *ph[8];
        int i;
        for (i = 0; i < 8; i++) {
            /* Lanes past the valid ones read lane 0 again; zeroed below. */
            int64_t l = l0 + i < lanes ? l0 + i : 0;
            pf[i] = sf + l * ls;
            ph[i] = sh + l * ls;
        }
        for (u0 = 0; u0 + 8 <= units; u0 += 8) {
            __m256 r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7;
#define MPT__LD(i)                                                                          \
    if (mode == 0)                                                                          \
        r##i = step == 1 ? _mm256_loadu_ps(pf[i] + u0)                                      \
                         : _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(ph[i] + 2 * u0))); \
    else if (mode == 1)                                                                     \
        r##i = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ph[i] + u0)));             \
    else                                                                                    \
        r##i = _mm256_castsi256_ps(_mm256_slli_epi32(                                       \
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(ph[i] + u0))), 16));     \
    if (l0 + i >= lanes) r##i = _mm256_setzero_ps();
            MPT__LD(0) MPT__LD(1) MPT__LD(2) MPT__LD(3) MPT__LD(4) MPT__LD(5) MPT__LD(6) MPT__LD(7)
#undef MPT__LD
            t0 = _mm256_unpacklo_ps(r0, r1);
            t1 = _mm256_unpackhi_ps(r0, r1);
            t2 = _mm256_unpacklo_ps(r2, r3);
            t3 = _mm256_unpackhi_ps(r2, r3);
            t4 = _mm256_unpacklo_ps(r4, r5);
            t5 = _mm256_unpackhi_ps(r4, r5);
            t6 = _mm256_unpacklo_ps(r6, r7);
            t7 = _mm256_unpackhi_ps(r6, r7);
            r0 = _mm256_shuffle_ps(t0, t2, 0x44);
            r1 = _mm256_shuffle_ps(t0, t2, 0xee);
            r2 = _mm256_shuffle_ps(t1, t3, 0x44);
            r3 = _mm256_shuffle_ps(t1, t3, 0xee);
            r4 = _mm256_shuffle_ps(t4, t6, 0x44);
            r5 = _mm256_shuffle_ps(t4, t6, 0xee);
            r6 = _mm256_shuffle_ps(t5, t7, 0x44);
            r7 = _mm256_shuffle_ps(t5, t7, 0xee);
            {
                float *d = dst + u0 * w + l0;
                _mm256_mask_storeu_ps(d + 0 * w, wm, _mm256_permute2f128_ps(r0, r4, 0x20));
                _mm256_mask_storeu_ps(d + 1 * w, wm, _mm256_permute2f128_ps(r1, r5, 0x20));
                _mm256_mask_storeu_ps(d + 2 * w, wm, _mm256_permute2f128_ps(r2, r6, 0x20));
                _mm256_mask_storeu_ps(d + 3 * w, wm, _mm256_permute2f128_ps(r3, r7, 0x20));
                _mm256_mask_storeu_ps(d + 4 * w, wm, _mm256_permute2f128_ps(r0, r4, 0x31));
                _mm256_mask_storeu_ps(d + 5 * w, wm, _mm256_permute2f128_ps(r1, r5, 0x31));
                _mm256_mask_storeu_ps(d + 6 * w, wm, _mm256_permute2f128_ps(r2, r6, 0x31));
                _mm256_mask_storeu_ps(d + 7 * w, wm, _mm256_permute2f128_ps(r3, r7, 0x31));
            }
        }
    }
    u0 = units / 8 * 8;
    return job->pairs ? 2 * u0 : u0;
}
#endif

static void mpt__gemm_pack(const mpt__gemm_job *job, float *dst, int w, const void *src,
                           int64_t off, int64_t ls, int64_t ks, int lanes, int64_t kc) {
#if MPT__X86
    if (job->path >= MPT__GEMM_AVX512 && ls == 1) {
        mpt__gemm_pack_lanes_avx512(job, dst, w, src, off, ks, lanes, kc);
        return;
    }
    if (job->path >= MPT__GEMM_AVX512 && ks == 1) {
        int64_t done = mpt__gemm_pack_depth_avx512(job, dst, w, src, off, ls, lanes, kc);
        if (done == kc) return;
        dst += (job->pairs ? done / 2 : done) * w;
        off += done;
        kc -= done;
    }
#endif
    if (job->pairs)
        mpt__gemm_pack_pairs(dst, w, src, off, ls, ks, lanes, kc);
    else
        mpt__gemm_pack_f32(job, dst, w, src, off, ls, ks, lanes, kc);
}

/* -----------------------------------------------------------------------------
   Micro-kernels
   ----------------------------------------------------------------------------- */

static void mpt__gemm_kernel_scalar(int64_t kc, const void *av, const void *bv, int bw,
                                    float *c, int64_t ldc, int m, int n,
                                    const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    float acc[4][8];
    int64_t p;
    int i, j;
    memset(acc, 0, sizeof acc);
    for (p = 0; p < kc; p++, a += 4, b += bw)
        for (i = 0; i < 4; i++)
            for (j = 0; j < bw; j++) acc[i][j] += a[i] * b[j];
    for (i = 0; i < m; i++) {
        float *ci = c + i * ldc;
        for (j = 0; j < n; j++) {
            float v = e->alpha * acc[i][j];
            if (e->load_c) v += e->beta * ci[j];
            if (e->bias) v += e->bias[j];
            if (e->relu) v = mpt__relu(v);
            ci[j] = v;
        }
    }
}

/* Row lists for the register-blocked kernels: X(row) for each row. */
#define MPT__ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define MPT__ROWS12(X) MPT__ROWS6(X) X(6) X(7) X(8) X(9) X(10) X(11)

#if MPT__X86

MPT__TARGET_AVX2 static inline void mpt__gemm_store_avx2(float *c, __m256 acc, __m256i mask,
                                                         const float *bias,
                                                         const mpt__gemm_epi *e) {
    __m256 v = _mm256_mul_ps(acc, _mm256_set1_ps(e->alpha));
    if (e->load_c)
        v = _mm256_fmadd_ps(_mm256_maskload_ps(c, mask), _mm256_set1_ps(e->beta), v);
    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias, mask));
    /* mpt__relu: zero where v <= 0 (ordered, so NaN stays); max_ps would
       turn NaN into 0. */
    if (e->relu) v = _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LE_OQ), v);
    _mm256_maskstore_ps(c, mask, v);
}

MPT__TARGET_AVX2 static inline __m256i mpt__gemm_mask_avx2(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

MPT__TARGET_AVX2 static void mpt__gemm_kernel_avx2(int64_t kc, const void *av, const void *bv,
                                                   int bw, float *c, int64_t ldc, int m, int n,
                                                   const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 8 : NULL;
    __m256i k0 = mpt__gemm_mask_avx2(n), k1 = mpt__gemm_mask_avx2(n - 8);
    int64_t p;
#define MPT__D(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
    MPT__ROWS6(MPT__D)
#undef MPT__D
    if (bw == 16) {
        for (p = 0; p < kc; p++, a += 6, b += 16) {
            __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8), ai;
#define MPT__F(i)                                  \
    ai = _mm256_broadcast_ss(a + i);               \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);    \
    c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < kc; p++, a += 6, b += 8) {
            __m256 b0 = _mm256_load_ps(b), ai;
#define MPT__F(i)                                  \
    ai = _mm256_broadcast_ss(a + i);               \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    }
#define MPT__S(i)                                                              \
    if (i < m) {                                                               \
        mpt__gemm_store_avx2(c + i * ldc, c##i##0, k0, bias0, e);              \
        if (n > 8) mpt__gemm_store_avx2(c + i * ldc + 8, c##i##1, k1, bias1, e); \
    }
    MPT__ROWS6(MPT__S)
#undef MPT__S
}

MPT__TARGET_AVX512 static inline void mpt__gemm_store_avx512(float *c, __m512 acc,
                                                             __mmask16 mask, const float *bias,
                                                             const mpt__gemm_epi *e) {
    __m512 v = _mm512_mul_ps(acc, _mm512_set1_ps(e->alpha));
    if (e->load_c)
        v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, c), _mm512_set1_ps(e->beta), v);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    /* mpt__relu: keep v where !(v <= 0), so NaN stays and -0 gives +0. */
    if (e->relu) v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NLE_UQ), v);
    _mm512_mask_storeu_ps(c, mask, v);
}

#define MPT__STORE512(i)                                                           \
    if (i < m) {                                                                   \
        mpt__gemm_store_avx512(c + i * ldc, c##i##0, k0, bias0, e);                \
        if (n > 16) mpt__gemm_store_avx512(c + i * ldc + 16, c##i##1, k1, bias1, e); \
    }

MPT__TARGET_AVX512 static void mpt__gemm_kernel_avx512(int64_t kc, const void *av,
                                                       const void *bv, int bw, float *c,
                                                       int64_t ldc, int m, int n,
                                                       const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 16 : NULL;
    __mmask16 k0 = mpt__gemm_mask16(n), k1 = mpt__gemm_mask16(n - 16);
    int64_t p;
#define MPT__D(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (p = 0; p < kc; p++, a += 12, b += 32) {
            __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16), ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(a[i]);                     \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);    \
    c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < kc; p++, a += 12, b += 16) {
            __m512 b0 = _mm512_load_ps(b), ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(a[i]);                     \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__STORE512)
}

/* bfloat16 pairs: each 32-bit lane of A and B holds (k, k+1); one
   vdpbf16ps adds a[k]·b[k] + a[k+1]·b[k+1] to each float32 lane. */
MPT__TARGET_AVX512_BF16 static void mpt__gemm_kernel_avx512_bf16(int64_t kc, const void *av,
                                                                 const void *bv, int bw,
                                                                 float *c, int64_t ldc, int m,
                                                                 int n, const mpt__gemm_epi *e) {
    const uint32_t *a = (const uint32_t *)av;
    const uint32_t *b = (const uint32_t *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 16 : NULL;
    __mmask16 k0 = mpt__gemm_mask16(n), k1 = mpt__gemm_mask16(n - 16);
    int64_t p, npairs = (kc + 1) / 2;
#define MPT__D(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (p = 0; p < npairs; p++, a += 12, b += 32) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(b);
            __m512bh b1 = (__m512bh)_mm512_load_si512(b + 16);
            __m512bh ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)a[i]);             \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);             \
    c##i##1 = _mm512_dpbf16_ps(c##i##1, ai, b1);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < npairs; p++, a += 12, b += 16) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(b), ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)a[i]);             \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__STORE512)
}
#undef MPT__STORE512

#endif /* MPT__X86 */

/* -----------------------------------------------------------------------------
   The driver
   ----------------------------------------------------------------------------- */

/* Epilogue-only product (K = 0 or alpha = 0): C = beta·C, + bias, act. */
static void mpt__gemm_scale_c(const mpt_gemm_desc *d) {
    int64_t i, j;
    for (i = 0; i < d->m; i++) {
        float *c = d->c + i * d->ldc;
        for (j = 0; j < d->n; j++) {
            float v = d->beta != 0 ? d->beta * c[j] : 0.0f;
            c[j] = d->bias ? v + d->bias[j] : v;
        }
        mpt__activation_forward(d->activation, c, d->n);
    }
}

/* The depth block for K: equal blocks of at most KC, a multiple of 8 (so
   pairs never straddle blocks); this depends on K only. The direct
   convolution sums in the same blocks, so that its results are the
   GEMM's bit for bit. */
static int64_t mpt__gemm_depth_block(int64_t k) {
    int64_t nkb = (k + MPT__GEMM_KC - 1) / MPT__GEMM_KC;
    return ((k + nkb - 1) / nkb + 7) / 8 * 8;
}

static void mpt__gemm_task(void *arg, int64_t task, int thread) {
    const mpt__gemm_job *job = (const mpt__gemm_job *)arg;
    const mpt_gemm_desc *d = job->d;
    const int mr = job->mr, nr = job->nr;
    const int64_t i0 = (task / job->tasks_n) * job->task_rows;
    const int64_t j0 = (task % job->tasks_n) * job->task_cols;
    const int64_t i1 = MPT__MIN(d->m, i0 + job->task_rows);
    const int64_t j1 = MPT__MIN(d->n, j0 + job->task_cols);
    /* Scratch: the B block (kc × nc), then one A panel (kc × mr). */
    float *bpack = (float *)mpt__thread_scratch(job->ctx, thread);
    float *apack = bpack + job->kc * job->nc;
    /* Element (i, k) of op(A) is at i·a_ls + k·a_ks; (k, j) of op(B) at
       j·b_ls + k·b_ks. */
    const int64_t a_ls = d->trans_a ? 1 : d->lda, a_ks = d->trans_a ? d->lda : 1;
    const int64_t b_ls = d->trans_b ? d->ldb : 1, b_ks = d->trans_b ? 1 : d->ldb;
    /* In pair mode a packed depth is a pair of halves, two per uint32. */
    int64_t jc, pc, ir, jr;
    if (i0 >= i1 || j0 >= j1) return;
    for (jc = j0; jc < j1; jc += job->nc) {
        const int64_t nb = MPT__MIN(job->nc, j1 - jc);
        for (pc = 0; pc < d->k; pc += job->kc) {
            const int64_t kb = MPT__MIN(job->kc, d->k - pc);
            const int64_t kstore = job->pairs ? (kb + 1) / 2 : kb; /* packed depth */
            const int first = pc == 0, last = pc + kb >= d->k;
            mpt__gemm_epi e;
            e.alpha = job->alpha;
            e.beta = first ? d->beta : 1.0f;
            e.load_c = !first || d->beta != 0;
            e.relu = last && d->activation == MPT_ACT_RELU;
            /* Pack the B block: panels of nr columns, the last one nr/2
               wide when that is enough. */
            for (jr = 0; jr < nb; jr += nr) {
                int w = nb - jr <= nr / 2 ? nr / 2 : nr;
                int lanes = (int)MPT__MIN(nr, nb - jr);
                mpt__gemm_pack(job, bpack + jr * kstore, w, d->b, (jc + jr) * b_ls + pc * b_ks,
                               b_ls, b_ks, lanes, kb);
            }
            for (ir = i0; ir < i1; ir += mr) {
                const int mb = (int)MPT__MIN(mr, i1 - ir);
                mpt__gemm_pack(job, apack, mr, d->a, ir * a_ls + pc * a_ks, a_ls, a_ks, mb, kb);
                for (jr = 0; jr < nb; jr += nr) {
                    int w = nb - jr <= nr / 2 ? nr / 2 : nr;
                    int n = (int)MPT__MIN(nr, nb - jr);
                    float *c = d->c + ir * d->ldc + jc + jr;
                    e.bias = last && d->bias ? d->bias + jc + jr : NULL;
                    job->kernel(kb, apack, bpack + jr * kstore, w, c, d->ldc, mb, n, &e);
                    if (last && d->activation != MPT_ACT_NONE && d->activation != MPT_ACT_RELU) {
                        int i;
                        for (i = 0; i < mb; i++)
                            mpt__activation_forward(d->activation, c + i * d->ldc, n);
                    }
                }
            }
        }
    }
}

/* Cuts C into tasks: at least one per thread when the product is big
   enough, in the grid that repacks least. Splitting the rows in tm parts
   packs B tm times; splitting the columns in tn parts packs A once per
   NC-block of each part. */
static void mpt__gemm_plan_tasks(mpt__gemm_job *job, int threads) {
    const mpt_gemm_desc *d = job->d;
    int64_t units_m = (d->m + job->mr - 1) / job->mr, units_n = (d->n + job->nr - 1) / job->nr;
    int64_t best_tm = 1, best_tn = 1, tm;
    double best = -1;
    int64_t fmas = d->m * d->n;
    int64_t target = threads;
    if (fmas > INT64_MAX / MPT__MAX(d->k, 1)) fmas = INT64_MAX;
    else fmas *= d->k;
    if (fmas < MPT__GEMM_SERIAL_FMAS || threads <= 1) target = 1;
    for (tm = 1; tm <= target; tm++) {
        int64_t tn = target / tm, cols, nblocks;
        double cost;
        if (target % tm || tm > units_m || tn > units_n) continue;
        cols = ((units_n + tn - 1) / tn) * job->nr;
        nblocks = (cols + job->nc - 1) / job->nc;
        cost = (double)d->m * (double)d->k * (double)(tn * nblocks) +
               (double)d->n * (double)d->k * (double)tm; /* elements packed */
        if (best < 0 || cost < best) {
            best = cost;
            best_tm = tm;
            best_tn = tn;
        }
    }
    job->task_rows = ((units_m + best_tm - 1) / best_tm) * job->mr;
    job->task_cols = ((units_n + best_tn - 1) / best_tn) * job->nr;
    job->tasks_n = (d->n + job->task_cols - 1) / job->task_cols;
    if (job->tasks_n < 1) job->tasks_n = 1;
}

static void mpt__gemm(mpt_context *ctx, const mpt_gemm_desc *d) {
    mpt__gemm_job job;
    int64_t tasks_m;
    if (d->m <= 0 || d->n <= 0) return;
    if (d->k <= 0 || d->alpha_is_zero) {
        mpt__gemm_scale_c(d);
        return;
    }
    memset(&job, 0, sizeof job);
    job.d = d;
    job.ctx = ctx;
    job.dtype = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    job.alpha = d->alpha == 0 ? 1.0f : d->alpha;
    job.path = MPT__GEMM_SCALAR;
    job.kernel = mpt__gemm_kernel_scalar;
    job.mr = 4;
    job.nr = 8;
#if MPT__X86
    if ((ctx->cpu & MPT_CPU_AVX512_BF16) && job.dtype == MPT_BFLOAT16) {
        job.path = MPT__GEMM_AVX512_BF16;
        job.kernel = mpt__gemm_kernel_avx512_bf16;
        job.mr = 12;
        job.nr = 32;
        job.pairs = 1;
    } else if (ctx->cpu & MPT_CPU_AVX512) {
        job.path = MPT__GEMM_AVX512;
        job.kernel = mpt__gemm_kernel_avx512;
        job.mr = 12;
        job.nr = 32;
    } else if (ctx->cpu & MPT_CPU_AVX2) {
        job.path = MPT__GEMM_AVX2;
        job.kernel = mpt__gemm_kernel_avx2;
        job.mr = 6;
        job.nr = 16;
    }
#endif
    job.kc = mpt__gemm_depth_block(d->k);
    job.nc = MPT__GEMM_NC;
    mpt__gemm_plan_tasks(&job, ctx->num_threads);
    tasks_m = (d->m + job.task_rows - 1) / job.task_rows;
    mpt__parallel_for(ctx, tasks_m * job.tasks_n, mpt__gemm_task, &job);
}

/* -----------------------------------------------------------------------------
   The checked entry point
   ----------------------------------------------------------------------------- */

/* Checks one operand: stored rows × cols with leading dimension ld. */
static mpt_status mpt__gemm_check_operand(mpt_context *ctx, const char *name, const void *p,
                                          int trans, int64_t rows, int64_t cols, int64_t ld,
                                          const char *ld_name) {
    int64_t last;
    if (rows == 0 || cols == 0) return MPT_OK; /* not referenced */
    if (!p) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: %s is NULL", name);
    if (ld < cols)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "gemm: %s = %lld is less than the %lld columns of %s as stored "
                         "(%lld×%lld%s)",
                         ld_name, (long long)ld, (long long)cols, name, (long long)rows,
                         (long long)cols, trans ? ", transposed" : "");
    if (!mpt__mul_ok(rows - 1, ld, &last) || !mpt__add_ok(last, cols, &last))
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "gemm: %s (%lld×%lld, %s = %lld) overflows",
                         name, (long long)rows, (long long)cols, ld_name, (long long)ld);
    return MPT_OK;
}

MPTDEF mpt_status mpt_gemm(mpt_context *ctx, const mpt_gemm_desc *d) {
    mpt_dtype dt;
    int64_t fmas;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!d) return MPT_OK; /* NULL: every default, the empty product */
    if (d->m < 0 || d->n < 0 || d->k < 0)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "gemm: m = %lld, n = %lld, k = %lld (negative)",
                         (long long)d->m, (long long)d->n, (long long)d->k);
    dt = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    if ((int)dt < 0 || dt >= MPT_DTYPE_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: unknown ab_dtype %d", (int)dt);
    if (!mpt_dtype_is_float(dt))
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "gemm: ab_dtype %s (%d) is not float32, float16 or bfloat16",
                         mpt_dtype_name(dt), (int)dt);
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: unknown activation %d",
                         (int)d->activation);
    if (d->activation == MPT_ACT_SOFTMAX)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "gemm: activation softmax (%d) is not elementwise; apply it after "
                         "the product", (int)d->activation);
    if (!mpt__mul_ok(d->m, d->n, &fmas))
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "gemm: m·n = %lld·%lld overflows",
                         (long long)d->m, (long long)d->n);
    if (d->m == 0 || d->n == 0) return MPT_OK;
    if (!d->c) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: c is NULL");
    if (d->ldc < d->n)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "gemm: ldc = %lld is less than n = %lld",
                         (long long)d->ldc, (long long)d->n);
    MPT__CHECK(mpt__gemm_check_operand(ctx, "c", d->c, 0, d->m, d->n, d->ldc, "ldc"));
    if (!d->alpha_is_zero) {
        MPT__CHECK(mpt__gemm_check_operand(ctx, "a", d->a, d->trans_a,
                                           d->trans_a ? d->k : d->m, d->trans_a ? d->m : d->k,
                                           d->lda, "lda"));
        MPT__CHECK(mpt__gemm_check_operand(ctx, "b", d->b, d->trans_b,
                                           d->trans_b ? d->n : d->k, d->trans_b ? d->k : d->n,
                                           d->ldb, "ldb"));
    }
    mpt__gemm(ctx, d);
    return MPT_OK;
}

/* =============================================================================
   @impl-qgemm  the int8 matrix product (mpt_qgemm)
   =============================================================================

   ZERO POINTS. The fast kernels multiply unsigned by signed bytes (the
   operand types of vpdpbusd), so A is shifted to u = A + o, o = 128 for
   int8 A (the byte with its top bit flipped) and 0 for uint8, and its zero
   point with it: zu = a_zero_point + o, in [0, 255]. With zb = b_zero_point,

       Σ_k (A − a_zero_point)(B − zb) = Σ_k (u − zu)(B − zb)
                                      = Σ_k u·B − zu·Σ_k B − zb·Σ_k u + K·zu·zb

   so the kernels compute only the raw Σ u·B (|u·B| ≤ 255·128, exact in
   int32 up to K = 2^16), and the epilogue adds the rest from the column
   sums of B (taken while packing B) and the row sums of u (taken while
   packing A), in int64, or in wrapping int32 arithmetic, which is exact
   because the result fits (MPT_QGEMM_MAX_K). Nothing is rounded before
   the requantization, and it does the same integer steps on every path.

   PACKING. The depth is cut into groups that fill a 32-bit lane: 4 k as
   bytes for vpdpbusd (and the portable kernel), 2 k as int16 for the
   AVX-512 and AVX2 kernels, whose vpmaddwd multiplies and adds pairs of
   int16 exactly (vpmaddubsw would saturate its int16 pair sums). B is
   packed once per call, whole (K ≤ MPT_QGEMM_MAX_K), in panels of NR
   columns × every group, [group][column][4 bytes | 2 int16], zero-padded;
   a last panel of at most NR/2 columns is packed NR/2 wide. Each task
   packs an MR-row panel of A, [group][row][...], into its thread's scratch
   (at most 768 KiB) and runs the micro-kernel over its columns.

   TILES. Per group the micro-kernel broadcasts one row's 32-bit group and
   multiplies it into NR/16 (or NR/8) vectors of B: VNNI and AVX-512 tiles
   are 12×32 (24 zmm accumulators, as the float kernel), AVX2 6×16, the
   portable C 4×8. The raw sums go to an MR×NR int32 tile on the stack and
   the epilogue (zero points, bias, requantization) stores them, 8 columns
   at a time with AVX-512 (in 64-bit lanes) or AVX2 (in 32-bit lanes),
   else one by one.

   WORK SPLIT. Tasks are rectangles of C, pulled by the pool's threads; B
   is packed before them, so splitting rows costs nothing, and splitting
   columns repacks A. Every element is computed by one task with integer
   steps, so the thread count cannot change a bit. */

#define MPT__QGEMM_SERIAL_MACS ((int64_t)1 << 20) /* below: one task */

#if MPT__X86
#define MPT__TARGET_AVX512_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))
#endif

/* kg: depth groups; a: packed A panel (kg × MR groups); b: packed B panel
   (kg × bw groups), bw = NR or NR/2; tile: MR×NR raw int32 sums, row-major. */
typedef void (*mpt__qgemm_kernel_fn)(int64_t kg, const uint8_t *a, const uint8_t *b, int bw,
                                     int32_t *tile);

typedef struct mpt__qgemm_job {
    const mpt_qgemm_desc *d;
    mpt_context *ctx;
    mpt__qgemm_kernel_fn kernel;
    int mr, nr;        /* micro-tile                                        */
    int quads;         /* groups of 4 bytes; else of 2 int16                */
    int64_t kg;        /* depth groups                                      */
    int64_t zu;        /* A's zero point, shifted with A to uint8           */
    uint8_t *bpack;    /* packed B: the panel of column j starts at j·kg·4  */
    int32_t *colsum;   /* (n) Σ_k B[k][n]                                   */
    int64_t task_rows, task_cols, tasks_n;
} mpt__qgemm_job;

/* -----------------------------------------------------------------------------
   TFLite's fixed-point requantization (gemmlowp's rounding rules)
   ----------------------------------------------------------------------------- */

static int32_t mpt__saturate_i32(int64_t v) {
    return v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v;
}

/* SaturatingRoundingDoublingHighMul: (a·b + 2^30) / 2^31 rounded to
   nearest, ties toward +∞ (the nudge, then C's truncating division); the
   one overflowing case, INT32_MIN², saturates. */
static int32_t mpt__rounding_doubling_high_mul(int32_t a, int32_t b) {
    const int64_t ab = (int64_t)a * b;
    const int64_t nudge = ab >= 0 ? (int64_t)1 << 30 : 1 - ((int64_t)1 << 30);
    if (a == INT32_MIN && b == INT32_MIN) return INT32_MAX;
    return (int32_t)((ab + nudge) / ((int64_t)1 << 31)); /* a constant: no division */
}

/* RoundingDivideByPOT: x / 2^e rounded to nearest, ties away from zero
   (the floor quotient, plus one when the remainder passes the threshold). */
static int32_t mpt__rounding_divide_by_pot(int32_t x, int e) {
    const int64_t p = (int64_t)1 << e;
    /* floor(x / 2^e), shifting the non-negative x + 2^31 (e ≤ 31): no branch */
    const int64_t q = (((int64_t)x + ((int64_t)1 << 31)) >> e) - (((int64_t)1 << 31) >> e);
    const int64_t rem = x - q * p;
    return (int32_t)(q + (rem > ((p - 1) >> 1) + (x < 0 ? 1 : 0)));
}

/* MultiplyByQuantizedMultiplier: x · m · 2^(shift − 31), shift in [-31, 30].
   Where TFLite's x·2^shift would overflow int32, it saturates here. */
static int32_t mpt__multiply_by_quantized_multiplier(int32_t x, int32_t m, int shift) {
    const int left = shift > 0 ? shift : 0, right = shift > 0 ? 0 : -shift;
    const int32_t xl = mpt__saturate_i32((int64_t)x * ((int64_t)1 << left));
    return mpt__rounding_divide_by_pot(mpt__rounding_doubling_high_mul(xl, m), right);
}

/* -----------------------------------------------------------------------------
   Packing and the epilogue
   ----------------------------------------------------------------------------- */

/* Σ of the n bytes s[k] ^ x, as unsigned: eight at a time in a uint64
   whose four 16-bit fields gain at most 2·255 per word, folded every 128
   words before they can overflow. */
static int64_t mpt__qgemm_byte_sum(const uint8_t *s, int64_t n, int x) {
    const uint64_t lo = 0x00ff00ff00ff00ffull, x8 = (uint64_t)x * 0x0101010101010101ull;
    int64_t k = 0, total = 0;
    while (n - k >= 8) {
        const int64_t stop = k + 8 * MPT__MIN(128, (n - k) / 8);
        uint64_t acc = 0;
        for (; k < stop; k += 8) {
            uint64_t w;
            memcpy(&w, s + k, 8);
            w ^= x8;
            acc += (w & lo) + ((w >> 8) & lo);
        }
        total += (int64_t)((acc & 0xffff) + ((acc >> 16) & 0xffff) + ((acc >> 32) & 0xffff) +
                           (acc >> 48));
    }
    for (; k < n; k++) total += s[k] ^ x;
    return total;
}

/* Packs one lane whose n depths are contiguous (a row of A, a column of a
   transposed B), bytes s[k] ^ flip, into lane l of a panel w lanes wide;
   returns their sum, as int8 values when is_signed, else as uint8. */
static int32_t mpt__qgemm_pack_lane(uint8_t *panel, int quads, int w, int l, const uint8_t *s,
                                    int64_t n, int flip, int is_signed) {
    const int sign = is_signed ? 0x80 : 0; /* (v ^ sign) − sign is the byte v as int8 */
    int64_t k;
    if (quads) { /* whole groups of 4 bytes */
        const uint32_t flip4 = (uint32_t)flip * 0x01010101u;
        const int64_t step = 4 * (int64_t)w, whole = n / 4; /* bytes per group of the panel */
        uint8_t *d = panel + 4 * l;
        int64_t g;
        for (g = 0; g < whole; g++) {
            uint32_t v;
            memcpy(&v, s + 4 * g, 4);
            v ^= flip4;
            memcpy(d + g * step, &v, 4);
        }
        for (k = 4 * whole; k < n; k++) d[whole * step + (k & 3)] = (uint8_t)(s[k] ^ flip);
    } else { /* pairs of int16 */
        int16_t *d = (int16_t *)(void *)panel + 2 * l;
        const int64_t step = 2 * (int64_t)w; /* int16 per group of the panel */
        for (k = 0; k + 1 < n; k += 2) {
            d[(k >> 1) * step] = (int16_t)(((s[k] ^ flip) ^ sign) - sign);
            d[(k >> 1) * step + 1] = (int16_t)(((s[k + 1] ^ flip) ^ sign) - sign);
        }
        if (k < n) d[(k >> 1) * step] = (int16_t)(((s[k] ^ flip) ^ sign) - sign);
    }
    return (int32_t)(mpt__qgemm_byte_sum(s, n, flip ^ sign) - (sign ? 128 * n : 0));
}

/* Packs the B panel that starts at column panel·NR, and its column sums. */
static void mpt__qgemm_pack_b_task(void *arg, int64_t panel, int thread) {
    const mpt__qgemm_job *job = (const mpt__qgemm_job *)arg;
    const mpt_qgemm_desc *d = job->d;
    const int64_t j0 = panel * job->nr;
    const int lanes = (int)MPT__MIN(job->nr, d->n - j0);
    const int w = lanes <= job->nr / 2 ? job->nr / 2 : job->nr;
    uint8_t *dst = job->bpack + j0 * job->kg * 4;
    int l;
    (void)thread;
    memset(dst, 0, (size_t)(job->kg * w * 4));
    if (d->k && !d->trans_b) { /* rows of B are contiguous: read them in order */
        int32_t sum[32] = {0}; /* NR ≤ 32 */
        int64_t k;
        for (k = 0; k < d->k; k++) {
            const int8_t *row = d->b + k * d->ldb + j0;
            if (job->quads) {
                uint8_t *g = dst + (k >> 2) * w * 4 + (k & 3);
                for (l = 0; l < lanes; l++) {
                    g[4 * l] = (uint8_t)row[l];
                    sum[l] += row[l];
                }
            } else {
                int16_t *g = (int16_t *)(void *)dst + (k >> 1) * w * 2 + (k & 1);
                for (l = 0; l < lanes; l++) {
                    g[2 * l] = row[l];
                    sum[l] += row[l];
                }
            }
        }
        for (l = 0; l < lanes; l++) job->colsum[j0 + l] = sum[l];
        return;
    }
    for (l = 0; l < lanes; l++) /* transposed B: its columns are contiguous */
        job->colsum[j0 + l] =
            d->k ? mpt__qgemm_pack_lane(dst, job->quads, w, l,
                                        (const uint8_t *)d->b + (j0 + l) * d->ldb, d->k, 0, 1)
                 : 0;
}

/* Packs rows ir .. ir+mb−1 of A as u = A + o into an MR-wide panel. */
static void mpt__qgemm_pack_a(const mpt__qgemm_job *job, uint8_t *dst, int64_t ir, int mb,
                              int32_t *rowsum) {
    const mpt_qgemm_desc *d = job->d;
    const int flip = d->a_unsigned ? 0 : 0x80; /* int8 a + 128 = its byte ^ 0x80 */
    int i;
    memset(dst, 0, (size_t)(job->kg * job->mr * 4));
    for (i = 0; i < mb; i++)
        rowsum[i] = d->k ? mpt__qgemm_pack_lane(dst, job->quads, job->mr, i,
                                                (const uint8_t *)d->a + (ir + i) * d->lda,
                                                d->k, flip, 0)
                         : 0;
}

#if MPT__X86
/* (The maskz forms with every lane set: g++ 12 warns about the
   _mm512_undefined_* inside the plain vpmaxsq, vpsllvq, vpmuldq, ... ) */
#define MPT__QGEMM_ALL ((__mmask8)0xff)

MPT__TARGET_AVX512 static MPT__ALWAYS_INLINE __m512i mpt__qgemm_clamp_epi64(__m512i v, int64_t lo,
                                                                            int64_t hi) {
    v = _mm512_maskz_max_epi64(MPT__QGEMM_ALL, v, _mm512_set1_epi64(lo));
    return _mm512_maskz_min_epi64(MPT__QGEMM_ALL, v, _mm512_set1_epi64(hi));
}

/* The int32 at p in the lanes of k (the others 0), widened to 64 bits. */
MPT__TARGET_AVX512 static MPT__ALWAYS_INLINE __m512i mpt__qgemm_load8(__mmask8 k,
                                                                      const int32_t *p) {
    return _mm512_maskz_cvtepi32_epi64(k, _mm256_maskz_loadu_epi32(k, p));
}

/* The epilogue below for 8 columns of one row, in 64-bit lanes: the same
   integer steps, with vpsravq as the floor shifts and masks as the
   branches (multipliers are positive, so INT32_MIN² never arises). */
MPT__TARGET_AVX512 static void mpt__qgemm_store8_avx512(const mpt__qgemm_job *job,
                                                        const int32_t *raw, int64_t row_term,
                                                        int64_t i, int64_t n, int cnt) {
    const mpt_qgemm_desc *d = job->d;
    const __mmask8 k = (__mmask8)((1u << cnt) - 1u), all = MPT__QGEMM_ALL;
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi64(1);
    const __m512i zu = _mm512_set1_epi64(job->zu);
    __m512i v = mpt__qgemm_load8(k, raw), m, sh, left, right, t, h, q, rem, half;
    __mmask8 up;
    v = _mm512_add_epi64(v, _mm512_set1_epi64(row_term));
    v = _mm512_sub_epi64(v, _mm512_maskz_mul_epi32(all, mpt__qgemm_load8(k, job->colsum + n), zu));
    if (d->bias) v = _mm512_add_epi64(v, mpt__qgemm_load8(k, d->bias + n));
    v = mpt__qgemm_clamp_epi64(v, INT32_MIN, INT32_MAX);
    if (d->c) {
        _mm256_mask_storeu_epi32(d->c + i * d->ldc + n, k, _mm512_maskz_cvtepi64_epi32(k, v));
        return;
    }
    m = d->per_channel ? mpt__qgemm_load8(k, d->multiplier + n)
                       : _mm512_set1_epi64(d->multiplier[0]);
    sh = d->per_channel ? mpt__qgemm_load8(k, d->shift + n) : _mm512_set1_epi64(d->shift[0]);
    left = _mm512_maskz_max_epi64(all, sh, zero);
    right = _mm512_maskz_max_epi64(all, _mm512_sub_epi64(zero, sh), zero);
    /* x·2^left, saturated; then the doubling high multiply: the nudge, and
       t / 2^31 truncated (2^31 − 1 added to a negative t before the shift) */
    v = mpt__qgemm_clamp_epi64(_mm512_maskz_sllv_epi64(all, v, left), INT32_MIN, INT32_MAX);
    t = _mm512_maskz_mul_epi32(all, v, m);
    t = _mm512_add_epi64(t, _mm512_mask_blend_epi64(_mm512_cmplt_epi64_mask(t, zero),
                                                    _mm512_set1_epi64((int64_t)1 << 30),
                                                    _mm512_set1_epi64(1 - ((int64_t)1 << 30))));
    t = _mm512_add_epi64(t, _mm512_and_si512(_mm512_maskz_srai_epi64(all, t, 63),
                                             _mm512_set1_epi64(((int64_t)1 << 31) - 1)));
    h = _mm512_maskz_srai_epi64(all, t, 31);
    /* the rounding divide by 2^right: the floor, plus one past the
       threshold (2^right − 1) / 2, + 1 for a negative h */
    q = _mm512_maskz_srav_epi64(all, h, right);
    rem = _mm512_sub_epi64(h, _mm512_maskz_sllv_epi64(all, q, right));
    half = _mm512_sub_epi64(_mm512_maskz_sllv_epi64(all, one, right), one);
    half = _mm512_maskz_srli_epi64(all, half, 1);
    up = _mm512_cmpgt_epi64_mask(rem,
                                 _mm512_add_epi64(half, _mm512_maskz_srli_epi64(all, h, 63)));
    q = _mm512_mask_add_epi64(q, up, q, one);
    q = _mm512_add_epi64(q, _mm512_set1_epi64(d->c_zero_point));
    q = mpt__qgemm_clamp_epi64(q, d->c_min || d->c_max ? d->c_min : -128,
                               d->c_min || d->c_max ? d->c_max : 127);
    _mm_mask_storeu_epi8(d->c_int8 + i * d->ldc + n, k, _mm512_maskz_cvtepi64_epi8(k, q));
}
#undef MPT__QGEMM_ALL

/* The signed product of the even 32-bit lanes of a and b, +nudge, / 2^31
   truncated, in the low half of each 64-bit lane (a logical shift gives
   the right low half, as the quotient fits in int32). */
MPT__TARGET_AVX2 static MPT__ALWAYS_INLINE __m256i mpt__qgemm_high_mul_even_avx2(__m256i a,
                                                                                  __m256i b) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i t = _mm256_mul_epi32(a, b);
    t = _mm256_add_epi64(t, _mm256_blendv_epi8(_mm256_set1_epi64x((int64_t)1 << 30),
                                               _mm256_set1_epi64x(1 - ((int64_t)1 << 30)),
                                               _mm256_cmpgt_epi64(zero, t)));
    t = _mm256_add_epi64(t, _mm256_and_si256(_mm256_cmpgt_epi64(zero, t),
                                             _mm256_set1_epi64x(((int64_t)1 << 31) - 1)));
    return _mm256_srli_epi64(t, 31);
}

/* The epilogue for 8 columns of one row with AVX2, in 32-bit lanes: the
   sum without bias fits in int32, so wrapping arithmetic gets it exactly,
   and the bias add saturates where the signs say it overflowed. */
MPT__TARGET_AVX2 static void mpt__qgemm_store8_avx2(const mpt__qgemm_job *job, const int32_t *raw,
                                                    int64_t row_term, int64_t i, int64_t n,
                                                    int cnt) {
    const mpt_qgemm_desc *d = job->d;
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    const uint32_t row_low = (uint32_t)(uint64_t)row_term; /* row_term mod 2^32 */
    int32_t row32, out[8];
    __m256i x, m, sh, left, right, xl, h, q, mask, up;
    int lo, hi, j;
    memcpy(&row32, &row_low, 4);
    x = _mm256_add_epi32(_mm256_maskload_epi32(raw, lanes), _mm256_set1_epi32(row32));
    x = _mm256_sub_epi32(x, _mm256_mullo_epi32(_mm256_maskload_epi32(job->colsum + n, lanes),
                                               _mm256_set1_epi32((int)job->zu)));
    if (d->bias) {
        const __m256i b = _mm256_maskload_epi32(d->bias + n, lanes);
        const __m256i sum = _mm256_add_epi32(x, b);
        const __m256i ovf = _mm256_and_si256(_mm256_xor_si256(x, sum), _mm256_xor_si256(b, sum));
        const __m256i sat = _mm256_xor_si256(_mm256_srai_epi32(x, 31),
                                             _mm256_set1_epi32(INT32_MAX));
        x = _mm256_blendv_epi8(sum, sat, _mm256_srai_epi32(ovf, 31));
    }
    if (d->c) {
        _mm256_maskstore_epi32(d->c + i * d->ldc + n, lanes, x);
        return;
    }
    m = d->per_channel ? _mm256_maskload_epi32(d->multiplier + n, lanes)
                       : _mm256_set1_epi32(d->multiplier[0]);
    sh = d->per_channel ? _mm256_maskload_epi32(d->shift + n, lanes)
                        : _mm256_set1_epi32(d->shift[0]);
    left = _mm256_max_epi32(sh, zero);
    right = _mm256_max_epi32(_mm256_sub_epi32(zero, sh), zero);
    /* x·2^left, saturated where shifting back does not give x */
    xl = _mm256_sllv_epi32(x, left);
    xl = _mm256_blendv_epi8(
        xl, _mm256_xor_si256(_mm256_srai_epi32(x, 31), _mm256_set1_epi32(INT32_MAX)),
        _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_srav_epi32(xl, left), x),
                         _mm256_set1_epi32(-1)));
    /* the doubling high multiply, even lanes and odd lanes */
    h = _mm256_blend_epi32(
        mpt__qgemm_high_mul_even_avx2(xl, m),
        _mm256_slli_epi64(mpt__qgemm_high_mul_even_avx2(_mm256_srli_epi64(xl, 32),
                                                        _mm256_srli_epi64(m, 32)), 32),
        0xaa);
    /* the rounding divide by 2^right: the floor, plus one past the
       threshold (2^right − 1) / 2, + 1 for a negative h */
    q = _mm256_srav_epi32(h, right);
    mask = _mm256_sub_epi32(_mm256_sllv_epi32(one, right), one);
    up = _mm256_cmpgt_epi32(_mm256_and_si256(h, mask),
                            _mm256_add_epi32(_mm256_srli_epi32(mask, 1), _mm256_srli_epi32(h, 31)));
    q = _mm256_sub_epi32(q, up);
    /* clamp(q + c_zero_point, lo, hi), clamping first so the add cannot wrap */
    lo = d->c_min || d->c_max ? d->c_min : -128;
    hi = d->c_min || d->c_max ? d->c_max : 127;
    q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(lo - d->c_zero_point)),
                         _mm256_set1_epi32(hi - d->c_zero_point));
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(q, _mm256_set1_epi32(d->c_zero_point)));
    for (j = 0; j < cnt; j++) d->c_int8[i * d->ldc + n + j] = (int8_t)out[j];
}
#endif

/* Adds the zero-point terms and the bias to an mb×nb tile of raw sums
   (row-major, NR wide) and stores it at C[i0..][j0..], as int32 or
   requantized to int8. */
static void mpt__qgemm_store(const mpt__qgemm_job *job, const int32_t *tile,
                             const int32_t *rowsum, int64_t i0, int64_t j0, int mb, int nb) {
    const mpt_qgemm_desc *d = job->d;
    const int64_t zu = job->zu, zb = d->b_zero_point;
    const int32_t lo = d->c_min || d->c_max ? d->c_min : -128;
    const int32_t hi = d->c_min || d->c_max ? d->c_max : 127;
    int i, j;
    for (i = 0; i < mb; i++) {
        const int64_t row_term = d->k * zu * zb - zb * rowsum[i];
#if MPT__X86
        if (job->ctx->cpu & (MPT_CPU_AVX512 | MPT_CPU_AVX2)) {
            for (j = 0; j < nb; j += 8) {
                if (job->ctx->cpu & MPT_CPU_AVX512)
                    mpt__qgemm_store8_avx512(job, tile + i * job->nr + j, row_term, i0 + i,
                                             j0 + j, MPT__MIN(8, nb - j));
                else
                    mpt__qgemm_store8_avx2(job, tile + i * job->nr + j, row_term, i0 + i,
                                           j0 + j, MPT__MIN(8, nb - j));
            }
            continue;
        }
#endif
        for (j = 0; j < nb; j++) {
            const int64_t n = j0 + j;
            int64_t v = tile[i * job->nr + j] + row_term - zu * job->colsum[n];
            int32_t acc;
            if (d->bias) v += d->bias[n];
            acc = mpt__saturate_i32(v);
            if (d->c) {
                d->c[(i0 + i) * d->ldc + n] = acc;
            } else {
                const int64_t ch = d->per_channel ? n : 0;
                int64_t q = (int64_t)mpt__multiply_by_quantized_multiplier(
                                acc, d->multiplier[ch], (int)d->shift[ch]) + d->c_zero_point;
                d->c_int8[(i0 + i) * d->ldc + n] = (int8_t)(q < lo ? lo : q > hi ? hi : q);
            }
        }
    }
}

/* -----------------------------------------------------------------------------
   Micro-kernels: raw Σ u·B over kg groups into an MR×NR tile
   ----------------------------------------------------------------------------- */

/* Portable: 4×8, groups of 4 bytes. */
static void mpt__qgemm_kernel_scalar(int64_t kg, const uint8_t *a, const uint8_t *bv, int bw,
                                     int32_t *tile) {
    const int8_t *b = (const int8_t *)bv;
    int32_t acc[4][8];
    int64_t g;
    int i, j;
    memset(acc, 0, sizeof acc);
    for (g = 0; g < kg; g++, a += 16, b += bw * 4)
        for (i = 0; i < 4; i++) {
            const uint8_t *ai = a + 4 * i;
            for (j = 0; j < bw; j++) {
                const int8_t *bj = b + 4 * j;
                acc[i][j] += ai[0] * bj[0] + ai[1] * bj[1] + ai[2] * bj[2] + ai[3] * bj[3];
            }
        }
    for (i = 0; i < 4; i++) memcpy(tile + i * 8, acc[i], sizeof acc[i]);
}

#if MPT__X86
/* The 32-bit group at p (packed panels are byte arrays: memcpy, not a cast). */
static inline int32_t mpt__qgemm_group(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* AVX2: 6×16, groups of 2 int16; vpmaddwd gives a[k]·b[k] + a[k+1]·b[k+1]
   per 32-bit lane. */
MPT__TARGET_AVX2 static void mpt__qgemm_kernel_avx2(int64_t kg, const uint8_t *a,
                                                    const uint8_t *b, int bw, int32_t *tile) {
    int64_t g;
#define MPT__D(i) __m256i c##i##0 = _mm256_setzero_si256(), c##i##1 = _mm256_setzero_si256();
    MPT__ROWS6(MPT__D)
#undef MPT__D
    if (bw == 16) {
        for (g = 0; g < kg; g++, a += 24, b += 64) {
            __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 32)), ai;
#define MPT__F(i)                                                          \
    ai = _mm256_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm256_add_epi32(c##i##0, _mm256_madd_epi16(ai, b0));        \
    c##i##1 = _mm256_add_epi32(c##i##1, _mm256_madd_epi16(ai, b1));
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    } else {
        for (g = 0; g < kg; g++, a += 24, b += 32) {
            __m256i b0 = _mm256_loadu_si256((const __m256i *)b), ai;
#define MPT__F(i)                                                          \
    ai = _mm256_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm256_add_epi32(c##i##0, _mm256_madd_epi16(ai, b0));
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    }
#define MPT__S(i)                                                          \
    _mm256_storeu_si256((__m256i *)(tile + 16 * i), c##i##0);              \
    _mm256_storeu_si256((__m256i *)(tile + 16 * i + 8), c##i##1);
    MPT__ROWS6(MPT__S)
#undef MPT__S
}

#define MPT__QGEMM_STORE512(i)                                             \
    _mm512_storeu_si512(tile + 32 * i, c##i##0);                           \
    _mm512_storeu_si512(tile + 32 * i + 16, c##i##1);

/* AVX-512 without VNNI: 12×32, groups of 2 int16, vpmaddwd as in AVX2. */
MPT__TARGET_AVX512 static void mpt__qgemm_kernel_avx512(int64_t kg, const uint8_t *a,
                                                        const uint8_t *b, int bw, int32_t *tile) {
    int64_t g;
#define MPT__D(i) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = _mm512_setzero_si512();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (g = 0; g < kg; g++, a += 48, b += 128) {
            __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64), ai;
#define MPT__F(i)                                                          \
    ai = _mm512_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm512_add_epi32(c##i##0, _mm512_madd_epi16(ai, b0));        \
    c##i##1 = _mm512_add_epi32(c##i##1, _mm512_madd_epi16(ai, b1));
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (g = 0; g < kg; g++, a += 48, b += 64) {
            __m512i b0 = _mm512_loadu_si512(b), ai;
#define MPT__F(i)                                                          \
    ai = _mm512_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm512_add_epi32(c##i##0, _mm512_madd_epi16(ai, b0));
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__QGEMM_STORE512)
}

/* AVX-512 VNNI: 12×32, groups of 4 bytes; vpdpbusd adds four u8·s8
   products to each int32 lane (without saturation): u = A + 128 times B,
   whose zero points the epilogue takes out (ZERO POINTS above). */
MPT__TARGET_AVX512_VNNI static void mpt__qgemm_kernel_vnni(int64_t kg, const uint8_t *a,
                                                           const uint8_t *b, int bw,
                                                           int32_t *tile) {
    int64_t g;
#define MPT__D(i) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = _mm512_setzero_si512();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (g = 0; g < kg; g++, a += 48, b += 128) {
            __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64), ai;
#define MPT__F(i)                                                          \
    ai = _mm512_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm512_dpbusd_epi32(c##i##0, ai, b0);                        \
    c##i##1 = _mm512_dpbusd_epi32(c##i##1, ai, b1);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (g = 0; g < kg; g++, a += 48, b += 64) {
            __m512i b0 = _mm512_loadu_si512(b), ai;
#define MPT__F(i)                                                          \
    ai = _mm512_set1_epi32(mpt__qgemm_group(a + 4 * i));                   \
    c##i##0 = _mm512_dpbusd_epi32(c##i##0, ai, b0);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__QGEMM_STORE512)
}
#undef MPT__QGEMM_STORE512
#endif /* MPT__X86 */

/* -----------------------------------------------------------------------------
   The driver
   ----------------------------------------------------------------------------- */

static void mpt__qgemm_task(void *arg, int64_t task, int thread) {
    const mpt__qgemm_job *job = (const mpt__qgemm_job *)arg;
    const mpt_qgemm_desc *d = job->d;
    const int mr = job->mr, nr = job->nr;
    const int64_t i0 = (task / job->tasks_n) * job->task_rows;
    const int64_t j0 = (task % job->tasks_n) * job->task_cols;
    const int64_t i1 = MPT__MIN(d->m, i0 + job->task_rows);
    const int64_t j1 = MPT__MIN(d->n, j0 + job->task_cols);
    uint8_t *apack = (uint8_t *)mpt__thread_scratch(job->ctx, thread); /* kg × mr groups */
    int32_t tile[12 * 32], rowsum[12];                                   /* MR×NR, MR     */
    int64_t ir, jr;
    for (ir = i0; ir < i1; ir += mr) {
        const int mb = (int)MPT__MIN(mr, i1 - ir);
        mpt__qgemm_pack_a(job, apack, ir, mb, rowsum);
        for (jr = j0; jr < j1; jr += nr) {
            const int w = d->n - jr <= nr / 2 ? nr / 2 : nr; /* as packed */
            job->kernel(job->kg, apack, job->bpack + jr * job->kg * 4, w, tile);
            mpt__qgemm_store(job, tile, rowsum, ir, jr, mb, (int)MPT__MIN(nr, j1 - jr));
        }
    }
}

/* Tasks: up to 4 per thread (the pool hands them out as threads free up),
   rows first, as splitting rows repacks nothing. */
static void mpt__qgemm_plan_tasks(mpt__qgemm_job *job, int threads, int serial) {
    const mpt_qgemm_desc *d = job->d;
    const int64_t units_m = (d->m + job->mr - 1) / job->mr;
    const int64_t units_n = (d->n + job->nr - 1) / job->nr;
    const int64_t target = serial ? 1 : 4 * (int64_t)threads;
    const int64_t tm = MPT__MIN(units_m, target);
    const int64_t tn = MPT__MIN(units_n, (target + tm - 1) / tm);
    job->task_rows = ((units_m + tm - 1) / tm) * job->mr;
    job->task_cols = ((units_n + tn - 1) / tn) * job->nr;
    job->tasks_n = (d->n + job->task_cols - 1) / job->task_cols;
}

static void mpt__qgemm_choose_kernel(mpt__qgemm_job *job, int cpu) {
    job->kernel = mpt__qgemm_kernel_scalar;
    job->mr = 4;
    job->nr = 8;
    job->quads = 1;
#if MPT__X86
    if ((cpu & MPT_CPU_AVX512) && (cpu & MPT_CPU_AVX512_VNNI)) {
        job->kernel = mpt__qgemm_kernel_vnni;
        job->mr = 12;
        job->nr = 32;
    } else if (cpu & MPT_CPU_AVX512) {
        job->kernel = mpt__qgemm_kernel_avx512;
        job->mr = 12;
        job->nr = 32;
        job->quads = 0;
    } else if (cpu & MPT_CPU_AVX2) {
        job->kernel = mpt__qgemm_kernel_avx2;
        job->mr = 6;
        job->nr = 16;
        job->quads = 0;
    }
#else
    (void)cpu;
#endif
}

/* The product of a checked descriptor with m, n > 0. */
static mpt_status mpt__qgemm(mpt_context *ctx, const mpt_qgemm_desc *d) {
    mpt__qgemm_job job;
    int64_t panels, bbytes, macs;
    int serial;
    memset(&job, 0, sizeof job);
    job.d = d;
    job.ctx = ctx;
    mpt__qgemm_choose_kernel(&job, ctx->cpu);
    job.kg = job.quads ? (d->k + 3) / 4 : (d->k + 1) / 2;
    job.zu = (int64_t)d->a_zero_point + (d->a_unsigned ? 0 : 128);
    panels = (d->n + job.nr - 1) / job.nr;
    if (!mpt__mul_ok(panels * job.nr, job.kg * 4, &bbytes) ||
        !mpt__add_ok((bbytes + 63) / 64 * 64, d->n * 4, &bbytes) || (uint64_t)bbytes > SIZE_MAX)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "qgemm: the packed B (k = %lld, n = %lld) "
                         "overflows", (long long)d->k, (long long)d->n);
    job.bpack = (uint8_t *)mpt__alloc(ctx, (size_t)bbytes);
    if (!job.bpack)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY,
                         "qgemm: cannot allocate %lld bytes for the packed B (k = %lld, n = %lld)",
                         (long long)bbytes, (long long)d->k, (long long)d->n);
    job.colsum = (int32_t *)(void *)(job.bpack + (panels * job.nr * job.kg * 4 + 63) / 64 * 64);
    macs = (double)d->m * (double)d->n * (double)MPT__MAX(d->k, 1) < (double)INT64_MAX / 2
               ? d->m * d->n * MPT__MAX(d->k, 1) : INT64_MAX;
    serial = ctx->num_threads <= 1 || macs < MPT__QGEMM_SERIAL_MACS;
    if (serial) {
        int64_t p;
        for (p = 0; p < panels; p++) mpt__qgemm_pack_b_task(&job, p, 0);
    } else {
        mpt__parallel_for(ctx, panels, mpt__qgemm_pack_b_task, &job);
    }
    mpt__qgemm_plan_tasks(&job, ctx->num_threads, serial);
    mpt__parallel_for(ctx, ((d->m + job.task_rows - 1) / job.task_rows) * job.tasks_n,
                      mpt__qgemm_task, &job);
    mpt__free(ctx, job.bpack);
    return MPT_OK;
}

/* -----------------------------------------------------------------------------
   The checked entry points
   ----------------------------------------------------------------------------- */

/* Checks one operand: stored rows × cols with leading dimension ld. */
static mpt_status mpt__qgemm_check_operand(mpt_context *ctx, const char *name, const void *p,
                                           int64_t rows, int64_t cols, int64_t ld,
                                           const char *ld_name) {
    int64_t last;
    if (rows == 0 || cols == 0) return MPT_OK; /* not referenced */
    if (!p) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "qgemm: %s is NULL", name);
    if (ld < cols)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "qgemm: %s = %lld is less than the %lld columns of %s as stored "
                         "(%lld×%lld)", ld_name, (long long)ld, (long long)cols, name,
                         (long long)rows, (long long)cols);
    if (!mpt__mul_ok(rows - 1, ld, &last) || !mpt__add_ok(last, cols, &last))
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "qgemm: %s (%lld×%lld, %s = %lld) overflows",
                         name, (long long)rows, (long long)cols, ld_name, (long long)ld);
    return MPT_OK;
}

static mpt_status mpt__qgemm_check_int8(mpt_context *ctx, const char *name, int64_t v) {
    if (v < -128 || v > 127)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "qgemm: %s = %lld is outside the int8 "
                         "range [-128, 127]", name, (long long)v);
    return MPT_OK;
}

/* The requantization fields of an int8 output. */
static mpt_status mpt__qgemm_check_requant(mpt_context *ctx, const mpt_qgemm_desc *d) {
    const int64_t channels = d->per_channel ? d->n : 1;
    int64_t ch;
    if (!d->multiplier || !d->shift)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "qgemm: c_int8 needs multiplier and shift (%s is NULL)",
                         d->multiplier ? "shift" : "multiplier");
    for (ch = 0; ch < channels; ch++) {
        if (d->multiplier[ch] <= 0)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "qgemm: multiplier[%lld] = %ld is not positive", (long long)ch,
                             (long)d->multiplier[ch]);
        if (d->shift[ch] < -31 || d->shift[ch] > 30)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "qgemm: shift[%lld] = %ld is outside [-31, 30]", (long long)ch,
                             (long)d->shift[ch]);
    }
    MPT__CHECK(mpt__qgemm_check_int8(ctx, "c_zero_point", d->c_zero_point));
    if (d->c_min || d->c_max) {
        MPT__CHECK(mpt__qgemm_check_int8(ctx, "c_min", d->c_min));
        MPT__CHECK(mpt__qgemm_check_int8(ctx, "c_max", d->c_max));
        if (d->c_min > d->c_max)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "qgemm: c_min = %ld > c_max = %ld",
                             (long)d->c_min, (long)d->c_max);
    }
    return MPT_OK;
}

MPTDEF mpt_status mpt_qgemm(mpt_context *ctx, const mpt_qgemm_desc *d) {
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!d) return MPT_OK; /* NULL: every default, the empty product */
    if (d->m < 0 || d->n < 0 || d->k < 0)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "qgemm: m = %lld, n = %lld, k = %lld (negative)",
                         (long long)d->m, (long long)d->n, (long long)d->k);
    if (d->k > MPT_QGEMM_MAX_K)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "qgemm: k = %lld is more than MPT_QGEMM_MAX_K = %d, past which the "
                         "int32 sums could overflow", (long long)d->k, MPT_QGEMM_MAX_K);
    if ((d->trans_b != 0 && d->trans_b != 1) || (d->a_unsigned != 0 && d->a_unsigned != 1) ||
        (d->per_channel != 0 && d->per_channel != 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "qgemm: trans_b = %d, a_unsigned = %d, per_channel = %d (each 0 or 1)",
                         d->trans_b, d->a_unsigned, d->per_channel);
    if (d->a_unsigned ? d->a_zero_point < 0 || d->a_zero_point > 255
                      : d->a_zero_point < -128 || d->a_zero_point > 127)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "qgemm: a_zero_point = %ld is outside the %s range %s",
                         (long)d->a_zero_point, d->a_unsigned ? "uint8" : "int8",
                         d->a_unsigned ? "[0, 255]" : "[-128, 127]");
    MPT__CHECK(mpt__qgemm_check_int8(ctx, "b_zero_point", d->b_zero_point));
    if (d->m == 0 || d->n == 0) return MPT_OK;
    if (!d->c == !d->c_int8)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "qgemm: give exactly one of c (int32) and c_int8 (%s)",
                         d->c ? "both are set" : "both are NULL");
    if (d->c && (d->multiplier || d->shift))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "qgemm: multiplier and shift requantize c_int8; c is int32");
    if (d->c_int8) MPT__CHECK(mpt__qgemm_check_requant(ctx, d));
    MPT__CHECK(mpt__qgemm_check_operand(ctx, d->c ? "c" : "c_int8",
                                        d->c ? (const void *)d->c : (const void *)d->c_int8,
                                        d->m, d->n, d->ldc, "ldc"));
    MPT__CHECK(mpt__qgemm_check_operand(ctx, "a", d->a, d->m, d->k, d->lda, "lda"));
    MPT__CHECK(mpt__qgemm_check_operand(ctx, "b", d->b, d->trans_b ? d->n : d->k,
                                        d->trans_b ? d->k : d->n, d->ldb, "ldb"));
    return mpt__qgemm(ctx, d);
}

MPTDEF mpt_status mpt_quantize_multiplier(mpt_context *ctx, double real, int32_t *multiplier,
                                          int32_t *shift) {
    int e;
    int64_t q;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!multiplier || !shift)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize_multiplier: %s is NULL",
                         multiplier ? "shift" : "multiplier");
    if (!(real > 0) || !isfinite(real))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "quantize_multiplier: %g is not a positive finite number", real);
    /* real = f·2^e, f in [0.5, 1): the multiplier is f in Q0.31. */
    q = (int64_t)round(ldexp(frexp(real, &e), 31));
    if (q == (int64_t)1 << 31) { /* f rounded up to 1 */
        q /= 2;
        e++;
    }
    if (e < -31)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "quantize_multiplier: %g is below 2^-32; every output would be the "
                         "zero point", real);
    if (e > 30) { /* as TFLite: the largest multiplier MultiplyByQuantizedMultiplier takes */
        q = INT32_MAX;
        e = 30;
    }
    *multiplier = (int32_t)q;
    *shift = e;
    return MPT_OK;
}


/* =============================================================================
   @impl-rng
   ============================================================================= */

/* Counter-based, so element i of a dropout mask or of an initial weight
   tensor is the same however the work is split (@backend-shared). */
MPTDEF void mpt_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo,
                           uint32_t out[4]) {
    mpt__philox4x32_10(key, counter_hi, counter_lo, out);
}

/* SplitMix64, to derive independent keys (one per parameter, per layer) from
   the model's seed. */
static uint64_t mpt__mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* =============================================================================
   @impl-layers: the layer interface and the sequential model: create, add,
   initialise, lay out in memory, build
   =============================================================================

   Every layer is a descriptor plus a table of three functions:
     build    — checks the input shape, sets the output shape, and declares
                its parameters, the buffers it saves for backward, and the
                workspace it needs. Nothing is allocated yet.
     forward  — y = f(x) for one batch.
     backward — dx and the parameter gradients from dy.
   mpt_model_build walks the layers once, then allocates one block per
   category (parameters, gradients, compute-dtype weight copies,
   activations, workspace) and hands out pieces of it. Once built, forward
   and backward cannot fail and allocate nothing: every shape was checked.

   A forward pass with training = 1 also commits each layer's state (the
   moving statistics of BatchNormalization), as calling a Keras model with
   training=True does. */

typedef struct mpt__layer mpt__layer;

/* What one layer's forward or backward pass is given. Tensors are in the
   layer's compute dtype; shapes are (batch, ...one sample's shape). */
typedef struct mpt__pass {
    mpt_context *ctx;
    struct mpt_model *model;
    const mpt_backend *be; /* every buffer below is in its memory         */
    void *impl;            /* the backend's state                         */
    mpt_step_state *state; /* the step's scalars, in the backend's memory */
    int64_t batch;
    int training;
    const void *x;   /* (batch, in_shape)                                   */
    void *y;         /* (batch, out_shape)                                  */
    const void *dy;  /* backward: (batch, out_shape)                        */
    void *dx;        /* backward: (batch, in_shape); NULL when nobody needs it */
    void *workspace; /* L->workspace_bytes, free for this call's use          */
    int logits_only; /* the last layer's softmax is left to the loss (fit
                        fuses softmax and crossentropy): forward and
                        backward skip it                                     */
} mpt__pass;

typedef struct mpt__layer_ops {
    const char *class_name;   /* "Dense", as Keras' summary prints it     */
    const char *default_name; /* "dense"; then "dense_1", "dense_2", ... */
    mpt_status (*build)(struct mpt_model *m, mpt__layer *L);
    void (*forward)(mpt__layer *L, const mpt__pass *p);
    void (*backward)(mpt__layer *L, const mpt__pass *p);
    /* Optional: folds what a training forward measured into the layer's
       state (BatchNormalization's moving statistics). Kept apart from
       forward so that a training step that is skipped changes nothing. */
    void (*commit)(mpt__layer *L, const mpt__pass *p);
    /* Optional: the activation the layer ends with (Dense's, Activation's);
       NULL: none. */
    mpt_activation (*activation)(const mpt__layer *L);
} mpt__layer_ops;

#define MPT__MAX_LAYER_PARAMS 4
#define MPT__MAX_LAYER_SAVED 4

typedef struct mpt__param {
    char name[144];          /* "dense/kernel"                                */
    int layer;
    int trainable;
    int rank;
    int64_t shape[MPT_MAX_RANK];
    int64_t count;
    mpt_initializer init;
    int64_t fan_in, fan_out; /* for glorot/he                                 */
    mpt_dtype compute_dtype; /* dtype the layer reads it in                   */
    float *value;            /* (count) float32 master copy                   */
    float *grad;             /* (count) float32; NULL when not trainable      */
    void *compute;           /* (count) compute_dtype copy; == value if float32 */
    float *slot[2];          /* (count) optimizer state: SGD's momentum, or
                                Adam's m and v; NULL where unused             */
    int non_negative;        /* a variance: a file holding a value < 0 is
                                refused (its square root would be NaN)       */
} mpt__param;

/* The fields every layer descriptor begins with (MPT_LAYER_COMMON_FIELDS). */
typedef struct mpt__layer_common_desc {
    MPT_LAYER_COMMON_FIELDS;
} mpt__layer_common_desc;

/* Any layer's descriptor; its name and dtype are read through `common`
   whatever the layer (the members share those first fields). */
typedef union mpt__layer_desc {
    mpt__layer_common_desc common;
    mpt_dense_desc dense;
    mpt_conv2d_desc conv2d;
    mpt_pool2d_desc pool2d;
    mpt_global_pool2d_desc global_pool2d;
    mpt_batchnorm_desc batchnorm;
    mpt_dropout_desc dropout;
    mpt_activation_desc activation;
    mpt_flatten_desc flatten;
} mpt__layer_desc;

struct mpt__layer {
    const mpt__layer_ops *ops;
    mpt__layer_desc desc;
    char name[64];
    mpt_dtype dtype;                        /* resolved compute dtype        */
    int in_rank, out_rank;                  /* one sample's rank: 1..3       */
    int64_t in_shape[MPT_MAX_RANK - 1];
    int64_t out_shape[MPT_MAX_RANK - 1];
    int64_t in_count, out_count;            /* elements in one sample        */
    int output_is_input;                    /* y is x seen with another shape */
    int n_params;
    int param_index[MPT__MAX_LAYER_PARAMS];
    mpt__param *param[MPT__MAX_LAYER_PARAMS];  /* valid after build           */
    int n_saved;
    int64_t saved_bytes[MPT__MAX_LAYER_SAVED]; /* for max_batch samples       */
    void *saved[MPT__MAX_LAYER_SAVED];         /* kept from forward to backward */
    int64_t workspace_bytes;                   /* for max_batch samples       */
    uint64_t seed;                             /* this layer's random key     */
    /* Set by the model: */
    const void *x;                          /* input of the last forward      */
    void *x_cast;                           /* input converted to dtype       */
    void *y;                                /* output of the last forward     */
};

/* fit's per-epoch history: values[k][e] for key k, epoch e. */
typedef struct mpt__history_store {
    int epochs, cap, n_keys;
    char keys[MPT_MAX_LOGS][40];
    double *values[MPT_MAX_LOGS];        /* [cap] each */
} mpt__history_store;

/* The arenas, one per memory category (@backend's MPT_MEMORY_*). */
enum {
    MPT__MEM_PARAMS = MPT_MEMORY_PARAMS,
    MPT__MEM_GRADS = MPT_MEMORY_GRADS,
    MPT__MEM_OPTIMIZER = MPT_MEMORY_OPTIMIZER,
    MPT__MEM_WEIGHT_COPY = MPT_MEMORY_WEIGHT_COPY,
    MPT__MEM_ACTIVATIONS = MPT_MEMORY_ACTIVATIONS,
    MPT__MEM_WORKSPACE = MPT_MEMORY_WORKSPACE,
    MPT__MEM_COUNT_ = MPT_MEMORY_COUNT_
};

/* The categories in messages (memory_limit's). */
static const char *const mpt__memory_category[MPT__MEM_COUNT_] = {
    "parameters", "gradients", "optimizer state", "weight copies", "activations", "workspace"};

struct mpt_model {
    mpt_context *ctx;
    const mpt_backend *be;               /* the context's: holds every buffer */
    void *impl;
    mpt_model_desc desc;
    mpt_dtype policy_dtype;
    mpt__layer *layers;
    int n_layers, cap_layers;
    mpt__param *params;
    int n_params, cap_params;
    int built;
    int64_t max_batch;
    uint64_t step;                       /* training steps taken; keys dropout */
    void *arena[MPT__MEM_COUNT_];
    int64_t arena_bytes[MPT__MEM_COUNT_];
    int64_t memory_peak[MPT__MEM_COUNT_]; /* the most arena_bytes during fit */
    int64_t host_peak;                   /* the context's, during fit; −1:
                                            no fit yet                       */
    void *grad_buf[2];                   /* ping-pong activation gradients */
    void *input_buf[2];                  /* (max_batch, in) batches copied in from
                                            the host (two: one is filled while
                                            the other is read); NULL on the CPU */
    void *target_buf[2];                 /* (max_batch, out) float32 or int32
                                            targets, likewise                */
    mpt_step_state *state;               /* [2] in the backend's memory: the
                                            training step's, evaluation's     */
    mpt_update_args update;              /* the trainable parameters' buffers */
    int64_t last_batch;                  /* of the last forward, 0 if none */
    int last_training;
    int emit_logits;                     /* the last layer skips its softmax */
    int planning;                        /* GEMMs are being timed (fit's first step) */
    int64_t planned_batch;               /* the batch size they were timed at */
    /* Training: set by compile, advanced by fit, saved in checkpoints. */
    int compiled;
    mpt_compile_desc compile;            /* every default resolved          */
    int n_slots;                         /* optimizer state per parameter   */
    int64_t optimizer_steps;             /* updates applied (Adam's t)      */
    float learning_rate;                 /* base rate the schedule scales   */
    float loss_scale;                    /* 1 when not scaling              */
    int64_t good_steps;                  /* finite steps in a row           */
    int64_t skipped_steps;               /* steps skipped for inf/NaN       */
    int epoch;                           /* epochs completed                */
    mpt__history_store history;
    mpt_printer printer;                 /* progress and messages (fit's)   */
    /* Data parallelism (@impl-strategy): */
    mpt_strategy *strategy;              /* NULL: one replica                */
    int n_replicas;                      /* replicas in this process (>= 1)  */
    struct mpt_model **replica;          /* [n_replicas]: [0] is this model; the
                                            others are built and compiled with it */
    int replica_index;                   /* over every worker: keys dropout  */
    struct mpt__exchange *exchange;      /* gradients in flight between workers
                                            during fit's backward passes       */
    double *sync_scratch;                /* host sums of synchronized statistics:
                                            (2·C + 1) doubles, then 2·C floats,
                                            C the widest such layer's          */
    /* Post-training quantization (@impl-quantize): */
    int weights_given;                   /* masters loaded or edited (through
                                            mpt_model_refresh_weights): not
                                            only the initial ones            */
    struct mpt__quantized *quantized;    /* NULL; a quantized model's operations */
};

typedef struct mpt__quantized mpt__quantized;
static void mpt__quantized_free(const mpt_context *ctx, mpt__quantized *Q);
static mpt_status mpt__refuse_quantized(mpt_model *m, const char *what);
static mpt_status mpt__quantized_predict(mpt_model *m, const mpt_dataset *data,
                                         int64_t batch_size, mpt_tensor *out);
static mpt_status mpt__quantized_evaluate(mpt_model *m, const mpt_dataset *data,
                                          const mpt_evaluate_desc *desc, mpt_logs *logs);
static size_t mpt__quantized_summary(const mpt_model *m, char *buf, size_t size);

static int mpt__strategy_total(const mpt_strategy *s);
static int mpt__strategy_is_chief(const mpt_strategy *s);
static mpt_status mpt__replicas_build(mpt_model *m);
static mpt_status mpt__workers_agree(mpt_model *m);
static void mpt__exchange_layer_done(mpt_model *m, int layer);
static mpt_status mpt__workers_sum(mpt_model *m, void *v, int64_t n, int doubles,
                                   const char *what);
static mpt_status mpt__exchange_open(mpt_model *m);
static void mpt__exchange_free(mpt_model *m);

/* Where a model's buffers are, for the tensors that show them. */
static mpt_device mpt__model_device(const mpt_model *m) {
    return m->be == mpt__cpu_backend() ? MPT_DEVICE_CPU : MPT_DEVICE_CUDA;
}

/* Prints through the model's printer (stdout by default): progress bars,
   summaries, callbacks' messages. */
static void mpt__print(const mpt_model *m, const char *fmt, ...) {
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (m->printer.fn) {
        m->printer.fn(m->printer.user_data, text);
    } else {
        fputs(text, stdout);
        fflush(stdout);
    }
}

MPTDEF double mpt_logs_get(const mpt_logs *logs, const char *name) {
    int i;
    for (i = 0; logs && name && i < logs->count; i++)
        if (strcmp(logs->names[i], name) == 0) return logs->values[i];
    return NAN;
}

/* ---- declaring what a layer needs (called from its build) ---------------- */

static mpt_status mpt__layer_add_param(struct mpt_model *m, mpt__layer *L, const char *name,
                                       int rank, const int64_t *shape, mpt_initializer init,
                                       int64_t fan_in, int64_t fan_out, int trainable,
                                       mpt_dtype compute_dtype) {
    mpt__param *P;
    int64_t count = mpt__shape_count(rank, shape);
    char s[96];
    if (count < 0)
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "%s '%s': %s of shape %s is too large",
                         L->ops->class_name, L->name, name,
                         mpt_shape_format(s, sizeof s, rank, shape));
    if (m->n_params == m->cap_params) {
        int cap = m->cap_params ? 2 * m->cap_params : 16;
        mpt__param *grown = (mpt__param *)mpt__calloc(m->ctx, sizeof *grown * (size_t)cap);
        if (!grown) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
        if (m->params) memcpy(grown, m->params, sizeof *grown * (size_t)m->n_params);
        mpt__free(m->ctx, m->params);
        m->params = grown;
        m->cap_params = cap;
    }
    P = &m->params[m->n_params];
    memset(P, 0, sizeof *P);
    snprintf(P->name, sizeof P->name, "%s/%s", L->name, name);
    P->layer = (int)(L - m->layers);
    P->trainable = trainable;
    P->rank = rank;
    memcpy(P->shape, shape, sizeof(int64_t) * (size_t)rank);
    P->count = count;
    P->init = init;
    P->fan_in = fan_in;
    P->fan_out = fan_out;
    P->compute_dtype = compute_dtype;
    L->param_index[L->n_params++] = m->n_params++;
    return MPT_OK;
}

/* Bytes for `per_sample` bytes times max_batch plus `fixed`, overflow-checked. */
static mpt_status mpt__batch_bytes(struct mpt_model *m, mpt__layer *L, int64_t per_sample,
                                   int64_t fixed, int64_t *out) {
    int64_t b = 0;
    if (!mpt__mul_ok(per_sample, m->max_batch, &b) || !mpt__add_ok(b, fixed, out))
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                         "%s '%s': buffers for a batch of %lld overflow", L->ops->class_name,
                         L->name, (long long)m->max_batch);
    return MPT_OK;
}

/* A buffer kept from forward to backward (L->saved[k] after build). */
static mpt_status mpt__layer_add_saved(struct mpt_model *m, mpt__layer *L, int64_t per_sample,
                                       int64_t fixed) {
    int k = L->n_saved;
    MPT__CHECK(mpt__batch_bytes(m, L, per_sample, fixed, &L->saved_bytes[k]));
    L->n_saved++;
    return MPT_OK;
}

/* Scratch for one forward or backward call (shared between layers). */
static mpt_status mpt__layer_set_workspace(struct mpt_model *m, mpt__layer *L,
                                           int64_t per_sample, int64_t fixed) {
    return mpt__batch_bytes(m, L, per_sample, fixed, &L->workspace_bytes);
}

/* Bytes of n elements of the layer's dtype. */
static int64_t mpt__dbytes(mpt_dtype dtype, int64_t n) { return n * (int64_t)mpt_dtype_size(dtype); }

/* A parameter as the layer reads it (its compute-dtype copy), its float32
   master and its float32 gradient. */
static const void *mpt__param_compute_copy(const mpt__layer *L, int k) { return L->param[k]->compute; }
static float *mpt__param_master(const mpt__layer *L, int k) { return L->param[k]->value; }
static float *mpt__param_grad(const mpt__layer *L, int k) { return L->param[k]->grad; }

/* ---- building a model ----------------------------------------------------- */

MPTDEF mpt_status mpt_model_create(mpt_context *ctx, const mpt_model_desc *desc,
                                   mpt_model **out) {
    mpt_model *m;
    int i;
    char s[96];
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL out");
    *out = NULL;
    if (!desc) /* NULL: every default, but the input's shape is required */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "model: input_shape and input_rank are "
                         "required (NULL descriptor)");
    if (desc->input_rank < 1 || desc->input_rank > MPT_MAX_RANK - 1)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "model: input_rank %d is not in 1..%d (one sample, without the batch; "
                         "required)", desc->input_rank, MPT_MAX_RANK - 1);
    for (i = 0; i < desc->input_rank; i++)
        if (desc->input_shape[i] <= 0)
            return mpt__fail(ctx, MPT_ERR_SHAPE, "model: input_shape %s has a dimension <= 0",
                             mpt_shape_format(s, sizeof s, desc->input_rank, desc->input_shape));
    if (mpt__shape_count(desc->input_rank, desc->input_shape) < 0)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "model: input_shape %s overflows",
                         mpt_shape_format(s, sizeof s, desc->input_rank, desc->input_shape));
    if (desc->policy < MPT_POLICY_FLOAT32 || desc->policy > MPT_POLICY_MIXED_BFLOAT16)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "model: unknown policy %d",
                         (int)desc->policy);
    if (desc->memory_limit < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "model: memory_limit %lld is negative (0: no limit)",
                         (long long)desc->memory_limit);
    m = (mpt_model *)mpt__calloc(ctx, sizeof *m);
    if (!m) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
    m->ctx = ctx;
    m->host_peak = -1;
    m->be = mpt_context_backend(ctx, &m->impl);
    m->desc = *desc;
    m->strategy = desc->strategy;
    m->n_replicas = 1;
    m->policy_dtype = desc->policy == MPT_POLICY_MIXED_FLOAT16    ? MPT_FLOAT16
                      : desc->policy == MPT_POLICY_MIXED_BFLOAT16 ? MPT_BFLOAT16
                                                                  : MPT_FLOAT32;
    *out = m;
    return MPT_OK;
}

static void mpt__free_update_args(mpt_model *m);

MPTDEF void mpt_model_destroy(mpt_model *m) {
    int c;
    if (!m) return;
    for (c = 1; c < m->n_replicas; c++) mpt_model_destroy(m->replica[c]);
    mpt__free(m->ctx, m->replica);
    mpt__free(m->ctx, m->sync_scratch);
    for (c = 0; c < MPT__MEM_COUNT_; c++) m->be->free(m->impl, c, m->arena[c]);
    m->be->free(m->impl, MPT__MEM_WORKSPACE, m->state);
    mpt__free_update_args(m);
    for (c = 0; c < MPT_MAX_LOGS; c++) mpt__free(m->ctx, m->history.values[c]);
    mpt__free(m->ctx, m->layers);
    mpt__free(m->ctx, m->params);
    mpt__quantized_free(m->ctx, m->quantized);
    mpt__free(m->ctx, m);
}

static const mpt__layer *mpt__find_layer(const mpt_model *m, const char *name) {
    int i;
    for (i = 0; i < m->n_layers; i++)
        if (strcmp(m->layers[i].name, name) == 0) return &m->layers[i];
    return NULL;
}

/* Appends a layer whose descriptor the caller has already checked. */
static mpt_status mpt__model_add(mpt_model *m, const mpt__layer_ops *ops,
                                 const mpt__layer_desc *desc, const char *name, mpt_dtype dtype) {
    mpt__layer *L;
    MPT__CHECK(mpt__refuse_quantized(m, "add a layer"));
    if (m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "model: cannot add a %s layer after build",
                         ops->class_name);
    if (dtype != MPT_DTYPE_DEFAULT && !mpt_dtype_is_float(dtype))
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "%s: compute dtype must be float32, float16 "
                         "or bfloat16, not %s (%d)", ops->class_name, mpt_dtype_name(dtype),
                         (int)dtype);
    if (name && (strlen(name) == 0 || strlen(name) >= sizeof L->name || strchr(name, '/')))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: name \"%s\" must have 1..%d characters and no '/'",
                         ops->class_name, name, (int)sizeof L->name - 1);
    if (name && mpt__find_layer(m, name))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: the model already has a layer named \"%s\"", ops->class_name, name);
    if (m->n_layers == m->cap_layers) {
        int cap = m->cap_layers ? 2 * m->cap_layers : 8;
        mpt__layer *grown = (mpt__layer *)mpt__calloc(m->ctx, sizeof *grown * (size_t)cap);
        if (!grown) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
        if (m->layers) memcpy(grown, m->layers, sizeof *grown * (size_t)m->n_layers);
        mpt__free(m->ctx, m->layers);
        m->layers = grown;
        m->cap_layers = cap;
    }
    L = &m->layers[m->n_layers];
    memset(L, 0, sizeof *L);
    L->ops = ops;
    L->desc = *desc;
    L->dtype = dtype ? dtype : m->policy_dtype;
    if (name) {
        snprintf(L->name, sizeof L->name, "%s", name);
    } else {
        /* Keras naming: dense, dense_1, dense_2, ... skipping names taken. */
        int k = 0;
        snprintf(L->name, sizeof L->name, "%s", ops->default_name);
        while (mpt__find_layer(m, L->name))
            snprintf(L->name, sizeof L->name, "%s_%d", ops->default_name, ++k);
    }
    L->seed = mpt__mix64(m->desc.seed ^ mpt__mix64((uint64_t)m->n_layers + 1));
    m->n_layers++;
    return MPT_OK;
}

/* Initial values, keyed by (model seed, parameter index, element), so they
   do not depend on threads or on the order of anything else. */
static void mpt__init_param(const mpt_model *m, int index, float *value) {
    const mpt__param *P = &m->params[index];
    uint64_t key = mpt__mix64(m->desc.seed ^ (0x5EEDull << 32) ^ (uint64_t)index);
    int64_t i;
    uint32_t r[4];
    switch (P->init) {
    case MPT_INIT_ONES:
        for (i = 0; i < P->count; i++) value[i] = 1.0f;
        break;
    case MPT_INIT_GLOROT_UNIFORM: {
        double limit = sqrt(6.0 / (double)(P->fan_in + P->fan_out));
        for (i = 0; i < P->count; i++) {
            mpt_philox4x32(key, 0, (uint64_t)i, r);
            value[i] = (float)((2.0 * mpt__uniform01(r[0]) - 1.0) * limit);
        }
        break;
    }
    case MPT_INIT_HE_NORMAL: {
        /* Keras: a normal truncated at two standard deviations, its stddev
           divided by 0.8796 (the truncated normal's own stddev) so that the
           values end up with variance 2 / fan_in. */
        double stddev = sqrt(2.0 / (double)P->fan_in) / 0.87962566103423978;
        for (i = 0; i < P->count; i++) {
            uint64_t attempt;
            double z = 0;
            for (attempt = 0; attempt < 64; attempt++) {
                double u1, u2;
                mpt_philox4x32(key, attempt, (uint64_t)i, r);
                u1 = ((double)r[0] + 1.0) / 4294967296.0; /* (0, 1] */
                u2 = (double)r[1] / 4294967296.0;
                z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
                if (fabs(z) <= 2.0) break;
            }
            if (fabs(z) > 2.0) z = 0; /* 64 rejections in a row: p < 1e-80 */
            value[i] = (float)(z * stddev);
        }
        break;
    }
    default: /* zeros */
        memset(value, 0, sizeof(float) * (size_t)P->count);
        break;
    }
}

/* Every parameter's initial value, made on the host and copied in. */
static mpt_status mpt__init_params(mpt_model *m) {
    int64_t most = 1;
    float *host;
    int i;
    mpt_status s = MPT_OK;
    for (i = 0; i < m->n_params; i++) most = MPT__MAX(most, m->params[i].count);
    host = (float *)mpt__alloc(m->ctx, sizeof(float) * (size_t)most);
    if (!host) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
    for (i = 0; i < m->n_params && s == MPT_OK; i++) {
        mpt__init_param(m, i, host);
        s = m->be->upload(m->impl, m->params[i].value, host,
                          sizeof(float) * (size_t)m->params[i].count);
    }
    mpt__free(m->ctx, host);
    return s == MPT_OK ? s : mpt__fail(m->ctx, s, "model: %s", m->be->error(m->impl));
}

/* The compute-dtype copies rewritten from the masters. */
static void mpt__copy_masters(mpt_model *m) {
    int i;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        if (P->compute != (void *)P->value)
            m->be->convert(m->impl, P->compute_dtype, P->compute, MPT_FLOAT32, P->value,
                           P->count);
    }
}

MPTDEF void mpt_model_refresh_weights(mpt_model *m) {
    if (!m || !m->built) return;
    mpt__copy_masters(m);
    m->weights_given = 1;
}

/* Hands out 64-byte-aligned pieces of one arena. */
typedef struct mpt__carver {
    unsigned char *base;
    int64_t used;
} mpt__carver;

static void *mpt__carve(mpt__carver *c, int64_t bytes) {
    void *p = c->base ? c->base + c->used : NULL;
    c->used += (bytes + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    return p;
}

/* Lays out every buffer. Run twice: first with NULL bases to measure each
   arena, then with the allocated ones to assign the pointers. */
static void mpt__layout(mpt_model *m, mpt__carver *c, int64_t grad_buf_bytes) {
    int i, k;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        P->value = (float *)mpt__carve(&c[MPT__MEM_PARAMS], 4 * P->count);
        P->grad = P->trainable ? (float *)mpt__carve(&c[MPT__MEM_GRADS], 4 * P->count) : NULL;
        P->compute = P->compute_dtype == MPT_FLOAT32
                         ? (void *)P->value
                         : mpt__carve(&c[MPT__MEM_WEIGHT_COPY],
                                      mpt__dbytes(P->compute_dtype, P->count));
    }
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = &m->layers[i];
        mpt_dtype in_dtype = i == 0 ? MPT_DTYPE_DEFAULT : m->layers[i - 1].dtype;
        /* The first layer always gets a cast buffer: the caller's dtype is
           only known at forward time. */
        L->x_cast = in_dtype != L->dtype
                        ? mpt__carve(&c[MPT__MEM_ACTIVATIONS],
                                     mpt__dbytes(L->dtype, L->in_count * m->max_batch))
                        : NULL;
        L->y = L->output_is_input ? NULL
                                  : mpt__carve(&c[MPT__MEM_ACTIVATIONS],
                                               mpt__dbytes(L->dtype, L->out_count * m->max_batch));
        for (k = 0; k < L->n_saved; k++)
            L->saved[k] = mpt__carve(&c[MPT__MEM_ACTIVATIONS], L->saved_bytes[k]);
        for (k = 0; k < L->n_params; k++) L->param[k] = &m->params[L->param_index[k]];
    }
    m->grad_buf[0] = mpt__carve(&c[MPT__MEM_ACTIVATIONS], grad_buf_bytes);
    m->grad_buf[1] = mpt__carve(&c[MPT__MEM_ACTIVATIONS], grad_buf_bytes);
    if (mpt__model_device(m) != MPT_DEVICE_CPU) { /* the CPU reads the host's batches in place */
        const mpt__layer *last = &m->layers[m->n_layers - 1];
        for (i = 0; i < 2; i++) {
            m->input_buf[i] = mpt__carve(&c[MPT__MEM_ACTIVATIONS],
                                         4 * m->layers[0].in_count * m->max_batch);
            m->target_buf[i] = mpt__carve(&c[MPT__MEM_ACTIVATIONS],
                                          4 * last->out_count * m->max_batch);
        }
    }
}

/* Checks each layer against its input shape and declares its buffers. */
static mpt_status mpt__build_layers(mpt_model *m, int64_t *grad_buf_bytes,
                                    int64_t *workspace_bytes) {
    int i, rank = m->desc.input_rank;
    int64_t shape[MPT_MAX_RANK - 1];
    memcpy(shape, m->desc.input_shape, sizeof shape);
    *grad_buf_bytes = *workspace_bytes = 0;
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = &m->layers[i];
        int64_t grad_bytes = 0;
        L->in_rank = rank;
        memcpy(L->in_shape, shape, sizeof shape);
        L->in_count = mpt__shape_count(rank, shape);
        L->n_params = L->n_saved = 0;
        L->workspace_bytes = 0;
        MPT__CHECK(L->ops->build(m, L));
        L->out_count = mpt__shape_count(L->out_rank, L->out_shape);
        if (L->out_count < 0) {
            char s[96];
            return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "%s '%s': output shape %s is too large",
                             L->ops->class_name, L->name,
                             mpt_shape_format(s, sizeof s, L->out_rank, L->out_shape));
        }
        /* The gradient buffers hold this layer's dy and dx in its dtype, and
           dx again in the previous layer's dtype when the two differ. */
        {
            int64_t size = (int64_t)mpt_dtype_size(L->dtype);
            int64_t prev = i > 0 ? (int64_t)mpt_dtype_size(m->layers[i - 1].dtype) : size;
            MPT__CHECK(mpt__batch_bytes(m, L, MPT__MAX(size * L->out_count,
                                                       MPT__MAX(size, prev) * L->in_count),
                                        0, &grad_bytes));
        }
        *grad_buf_bytes = MPT__MAX(*grad_buf_bytes, grad_bytes);
        *workspace_bytes = MPT__MAX(*workspace_bytes, L->workspace_bytes);
        rank = L->out_rank;
        memcpy(shape, L->out_shape, sizeof shape);
    }
    return MPT_OK;
}

/* In @impl-optimizers, with what uses it: build allocates the state when
   the model was compiled first, compile when it was built first. */
static mpt_status mpt__alloc_optimizer_state(mpt_model *m);

/* The activation a layer ends with (none for most). */
static mpt_activation mpt__layer_activation(const mpt__layer *L) {
    return L->ops->activation ? L->ops->activation(L) : MPT_ACT_NONE;
}

/* Keras' advice for mixed precision, followed by default: the final
   softmax computes in float32, so the probabilities (and the logits the
   loss reads) are float32. A dtype given for that layer wins. */
static void mpt__final_softmax_in_float32(mpt_model *m) {
    mpt__layer *L = &m->layers[m->n_layers - 1];
    if (mpt__layer_activation(L) == MPT_ACT_SOFTMAX && L->desc.common.dtype == MPT_DTYPE_DEFAULT)
        L->dtype = MPT_FLOAT32;
}

static int64_t mpt__optimizer_state_bytes(const mpt_model *m);

/* memory_limit: whether the model may hold `bytes` more of `category` on
   top of `held`; if not, fails naming the category, the bytes and the
   limit. */
static mpt_status mpt__within_memory_limit(mpt_model *m, int category, int64_t held,
                                           int64_t bytes) {
    int64_t limit = m->desc.memory_limit;
    if (limit <= 0 || bytes <= limit - held) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                     "model: %s for batches of %lld needs %lld bytes, on top of %lld already "
                     "planned: over the model's memory_limit of %lld bytes",
                     mpt__memory_category[category], (long long)m->max_batch, (long long)bytes,
                     (long long)held, (long long)limit);
}

/* Checks the whole plan, category by category (MPT_MEMORY_* order), before
   anything is allocated. */
static mpt_status mpt__plan_within_memory_limit(mpt_model *m, const mpt__carver *c) {
    int64_t held = 0, bytes;
    int i;
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
        bytes = i == MPT__MEM_OPTIMIZER ? (m->compiled ? mpt__optimizer_state_bytes(m) : 0)
                                        : c[i].used;
        MPT__CHECK(mpt__within_memory_limit(m, i, held, bytes));
        held += bytes;
    }
    return MPT_OK;
}

/* Gives back every buffer of a build that failed half-way. */
static void mpt__free_arenas(mpt_model *m) {
    int i;
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
        m->be->free(m->impl, i, m->arena[i]);
        m->arena[i] = NULL;
    }
    m->be->free(m->impl, MPT__MEM_WORKSPACE, m->state);
    m->state = NULL;
}

/* Builds this replica for batches of max_batch. */
static mpt_status mpt__build_one(mpt_model *m, int64_t max_batch) {
    mpt__carver c[MPT__MEM_COUNT_];
    int64_t grad_buf_bytes, workspace_bytes;
    int i;
    m->max_batch = max_batch;
    m->n_params = 0;
    mpt__final_softmax_in_float32(m);
    MPT__CHECK(mpt__build_layers(m, &grad_buf_bytes, &workspace_bytes));
    memset(c, 0, sizeof c);
    mpt__layout(m, c, grad_buf_bytes);
    c[MPT__MEM_WORKSPACE].used = workspace_bytes;
    MPT__CHECK(mpt__plan_within_memory_limit(m, c));
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
        if (i == MPT__MEM_OPTIMIZER) continue; /* mpt__alloc_optimizer_state's */
        m->arena_bytes[i] = c[i].used;
        if (m->be->alloc(m->impl, i, (size_t)c[i].used, &m->arena[i]) != MPT_OK) {
            mpt__free_arenas(m);
            return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                             "model: cannot allocate %lld bytes for batches of %lld: %s",
                             (long long)c[i].used, (long long)max_batch,
                             m->be->error(m->impl));
        }
        /* Zeroed, so that nothing ever reads garbage (a gradient buffer
           read before it is written would turn into NaN in a product). */
        m->be->zero(m->impl, m->arena[i], (size_t)c[i].used);
        c[i].base = (unsigned char *)m->arena[i];
        c[i].used = 0;
    }
    if (m->be->alloc(m->impl, MPT__MEM_WORKSPACE, 2 * sizeof(mpt_step_state),
                     (void **)&m->state) != MPT_OK) {
        mpt__free_arenas(m);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: %s", m->be->error(m->impl));
    }
    m->be->zero(m->impl, m->state, 2 * sizeof(mpt_step_state));
    mpt__layout(m, c, grad_buf_bytes);
    if (mpt__init_params(m) != MPT_OK) {
        mpt__free_arenas(m);
        return MPT_ERR_OUT_OF_MEMORY;
    }
    m->built = 1;
    mpt__copy_masters(m);
    if (m->compiled && mpt__alloc_optimizer_state(m) != MPT_OK) {
        /* unbuilt again: a model without its optimizer state must not train */
        mpt__free_update_args(m);
        mpt__free_arenas(m);
        m->built = 0;
        return MPT_ERR_OUT_OF_MEMORY;
    }
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_build(mpt_model *m, int64_t max_batch) {
    int replicas;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: already built");
    MPT__CHECK(mpt__refuse_quantized(m, "build"));
    if (m->n_layers == 0) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: no layers to build");
    if (max_batch <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: max_batch %lld must be > 0",
                         (long long)max_batch);
    /* With a strategy, max_batch is the global batch: each replica is
       built for its share. */
    replicas = m->strategy ? mpt__strategy_total(m->strategy) : 1;
    MPT__CHECK(mpt__build_one(m, (max_batch + replicas - 1) / replicas));
    return m->strategy ? mpt__replicas_build(m) : MPT_OK;
}

/* ---- looking inside a model ------------------------------------------------ */

MPTDEF int mpt_model_param_count(const mpt_model *m) { return m && m->built ? m->n_params : 0; }

MPTDEF mpt_status mpt_model_param(mpt_model *m, int index, mpt_param_info *info) {
    mpt__param *P;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!info) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL info");
    if (!m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: parameters exist after build");
    if (index < 0 || index >= m->n_params)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: parameter %d not in 0..%d",
                         index, m->n_params - 1);
    P = &m->params[index];
    memset(info, 0, sizeof *info);
    info->name = P->name;
    info->layer_name = m->layers[P->layer].name;
    info->trainable = P->trainable;
    info->value.dtype = info->grad.dtype = MPT_FLOAT32;
    info->value.rank = info->grad.rank = P->rank;
    memcpy(info->value.shape, P->shape, sizeof P->shape);
    memcpy(info->grad.shape, P->shape, sizeof P->shape);
    info->value.data = P->value;
    info->grad.data = P->grad;
    info->value.device = info->grad.device = mpt__model_device(m);
    return MPT_OK;
}

MPTDEF int mpt_model_input_shape(const mpt_model *m, int64_t *shape) {
    if (!m || !shape) return 0;
    memcpy(shape, m->desc.input_shape, sizeof(int64_t) * (size_t)m->desc.input_rank);
    return m->desc.input_rank;
}

MPTDEF int mpt_model_layer_count(const mpt_model *m) { return m ? m->n_layers : 0; }

MPTDEF const char *mpt_model_layer_name(const mpt_model *m, int index) {
    return m && index >= 0 && index < m->n_layers ? m->layers[index].name : NULL;
}

MPTDEF mpt_dtype mpt_model_layer_dtype(const mpt_model *m, int index) {
    return m && index >= 0 && index < m->n_layers ? m->layers[index].dtype : MPT_DTYPE_DEFAULT;
}

MPTDEF int mpt_model_layer_output_shape(const mpt_model *m, int index, int64_t *shape) {
    const mpt__layer *L;
    if (!m || !m->built || index < 0 || index >= m->n_layers || !shape) return 0;
    L = &m->layers[index];
    memcpy(shape, L->out_shape, sizeof(int64_t) * (size_t)L->out_rank);
    return L->out_rank;
}

MPTDEF const char *mpt_model_layer_class_name(const mpt_model *m, int index) {
    return m && index >= 0 && index < m->n_layers ? m->layers[index].ops->class_name : NULL;
}

MPTDEF mpt_dtype mpt_model_layer_variable_dtype(const mpt_model *m, int index) {
    return m && index >= 0 && index < m->n_layers ? MPT_FLOAT32 : MPT_DTYPE_DEFAULT;
}

MPTDEF mpt_policy mpt_model_policy(const mpt_model *m) {
    return m ? m->desc.policy : MPT_POLICY_FLOAT32;
}

/* Raises the peaks to what the model holds now, `extra` bytes of
   workspace besides (the profiler's records). */
static void mpt__memory_peak_note(mpt_model *m, int64_t extra_workspace) {
    int i;
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
        int64_t held = m->arena_bytes[i] + (i == MPT__MEM_WORKSPACE ? extra_workspace : 0);
        m->memory_peak[i] = MPT__MAX(m->memory_peak[i], held);
    }
}

/* fit's start: the peaks start from what is held now. */
static void mpt__memory_peak_reset(mpt_model *m) {
    memset(m->memory_peak, 0, sizeof m->memory_peak);
    mpt__memory_peak_note(m, 0);
    m->ctx->host_peak = m->ctx->host_bytes;
}

static void mpt__memory_report_fill(const int64_t *b, mpt_memory_report *out) {
    out->parameters = b[MPT__MEM_PARAMS];
    out->gradients = b[MPT__MEM_GRADS];
    out->optimizer = b[MPT__MEM_OPTIMIZER];
    out->weight_copies = b[MPT__MEM_WEIGHT_COPY];
    out->activations = b[MPT__MEM_ACTIVATIONS];
    out->workspace = b[MPT__MEM_WORKSPACE];
    out->total = out->parameters + out->gradients + out->optimizer + out->weight_copies +
                 out->activations + out->workspace;
}

MPTDEF mpt_status mpt_model_memory(const mpt_model *m, mpt_memory_report *out) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model_memory: NULL out");
    memset(out, 0, sizeof *out);
    out->limit = m->desc.memory_limit;
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "model_memory: build the model first (build "
                         "plans its memory)");
    mpt__memory_report_fill(m->arena_bytes, out);
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_memory_peak(const mpt_model *m, mpt_memory_report *out) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model_memory_peak: NULL out");
    memset(out, 0, sizeof *out);
    out->limit = m->desc.memory_limit;
    if (m->host_peak < 0)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "model_memory_peak: no fit yet (the peaks are "
                         "a fit's)");
    mpt__memory_report_fill(m->memory_peak, out);
    out->host = m->host_peak;
    return MPT_OK;
}

MPTDEF const char *mpt_policy_name(mpt_policy policy) {
    switch (policy) {
    case MPT_POLICY_FLOAT32: return "float32";
    case MPT_POLICY_MIXED_FLOAT16: return "mixed_float16";
    case MPT_POLICY_MIXED_BFLOAT16: return "mixed_bfloat16";
    }
    return "?";
}

/* =============================================================================
   @impl-passes: a batch onto the backend, the forward and backward walks over
   the layers, and fit's step one public piece at a time
   ============================================================================= */

/* ---- running a model ------------------------------------------------------ */

/* The one rule for data given to a model (forward, fit, evaluate, predict):
   each sample's shape is the model's input shape. A wrong one would make
   the layers read past the end of the batch or misalign its samples. */
static mpt_status mpt__check_sample_shape(mpt_model *m, int rank, const int64_t *shape,
                                          const char *what) {
    char got[96], want[96];
    int i, ok = rank == m->desc.input_rank;
    for (i = 0; ok && i < rank; i++) ok = shape[i] == m->desc.input_shape[i];
    if (ok) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                     "%s: samples of shape %s do not fit the model's input %s", what,
                     mpt_shape_format(got, sizeof got, rank, shape),
                     mpt_shape_format(want, sizeof want, m->desc.input_rank, m->desc.input_shape));
}

static mpt_status mpt__check_input(mpt_model *m, const mpt_tensor *x) {
    char got[96], what[128];
    if (!x || !x->data)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL input tensor%s",
                         x ? " data" : "");
    if (!mpt_dtype_is_float(x->dtype))
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "model: input dtype %s is not a float dtype",
                         mpt_dtype_name(x->dtype));
    if (x->rank < 1 || x->rank > MPT_MAX_RANK || x->shape[0] < 1 || x->shape[0] > m->max_batch)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                         "model: input shape %s is not (batch, sample...) with batch in 1..%lld",
                         mpt_shape_format(got, sizeof got, x->rank, x->shape),
                         (long long)m->max_batch);
    snprintf(what, sizeof what, "model: input %s",
             mpt_shape_format(got, sizeof got, x->rank, x->shape));
    return mpt__check_sample_shape(m, x->rank - 1, x->shape + 1, what);
}

/* Copies host memory into the backend's, turning a failure into a status. */
static mpt_status mpt__upload(mpt_model *m, void *dst, const void *src, size_t bytes) {
    mpt_status s = m->be->upload(m->impl, dst, src, bytes);
    return s == MPT_OK ? s : mpt__fail(m->ctx, s, "model: %s", m->be->error(m->impl));
}

static mpt_status mpt__download(mpt_model *m, void *dst, const void *src, size_t bytes) {
    mpt_status s = m->be->download(m->impl, dst, src, bytes);
    return s == MPT_OK ? s : mpt__fail(m->ctx, s, "model: %s", m->be->error(m->impl));
}

/* A batch tensor (inputs or targets) as the backend can read it: itself on
   the CPU backend or when it is already in the device's memory, else
   copied into buf (input_buf[0] or target_buf[0]). */
static mpt_status mpt__batch_on_backend(mpt_model *m, const mpt_tensor *t, void *buf,
                                        mpt_tensor *out) {
    *out = *t;
    if (mpt__model_device(m) == MPT_DEVICE_CPU || t->device != MPT_DEVICE_CPU) return MPT_OK;
    out->data = buf;
    out->device = MPT_DEVICE_CUDA;
    return mpt__upload(m, buf, t->data, mpt_tensor_bytes(t));
}

static mpt_status mpt__input_on_backend(mpt_model *m, const mpt_tensor *x, mpt_tensor *in) {
    return mpt__batch_on_backend(m, x, m->input_buf[0], in);
}

/* In @impl-training, with the other training scalars' code; forward's
   training mode pushes them first. */
static mpt_status mpt__state_push(mpt_model *m);

static void mpt__layer_view(const mpt_model *m, const mpt__layer *L, void *data, int use_input,
                            mpt_tensor *t) {
    mpt__batch_view(t, L->dtype, m->last_batch, use_input ? L->in_rank : L->out_rank,
                    use_input ? L->in_shape : L->out_shape, data, mpt__model_device(m));
}

static void mpt__pass_init(mpt_model *m, int64_t batch, int training, mpt__pass *p) {
    memset(p, 0, sizeof *p);
    p->ctx = m->ctx;
    p->model = m;
    p->be = m->be;
    p->impl = m->impl;
    p->state = m->state;
    p->batch = batch;
    p->training = training != 0;
    p->workspace = m->arena[MPT__MEM_WORKSPACE];
}

/* Folds what the last training forward measured into each layer's state
   (BatchNormalization's moving statistics). fit calls it only for steps
   that are applied, so a skipped step leaves every statistic as it was. */
static void mpt__model_commit(mpt_model *m) {
    mpt__pass p;
    int i;
    mpt__pass_init(m, m->last_batch, 1, &p);
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = &m->layers[i];
        p.x = L->x;
        p.y = L->y;
        if (L->ops->commit) L->ops->commit(L, &p);
    }
}

/* A forward pass in progress, one layer at a time (replicas run theirs in
   step, layer by layer, when a layer synchronizes them). */
typedef struct mpt__forward_walk {
    mpt__pass p;
    const void *cur;     /* the next layer's input  */
    mpt_dtype cur_dtype;
} mpt__forward_walk;

static void mpt__forward_begin(mpt_model *m, const mpt_tensor *x, int training,
                               mpt__forward_walk *w) {
    mpt__pass_init(m, x->shape[0], training, &w->p);
    w->cur = x->data;
    w->cur_dtype = x->dtype;
    m->last_batch = w->p.batch;
    m->last_training = w->p.training;
}

/* Layer i's input in its dtype, and its pass set up (not yet run). */
static mpt__layer *mpt__forward_prepare(mpt_model *m, int i, mpt__forward_walk *w) {
    mpt__layer *L = &m->layers[i];
    if (w->cur_dtype != L->dtype) {
        m->be->convert(m->impl, L->dtype, L->x_cast, w->cur_dtype, w->cur,
                       w->p.batch * L->in_count);
        w->cur = L->x_cast;
    }
    L->x = w->cur;
    if (L->output_is_input) L->y = (void *)w->cur;
    w->p.x = L->x;
    w->p.y = L->y;
    w->p.logits_only = m->emit_logits && i == m->n_layers - 1;
    return L;
}

static void mpt__forward_finish(mpt__layer *L, mpt__forward_walk *w) {
    w->cur = L->y;
    w->cur_dtype = L->dtype;
}

static void mpt__model_forward(mpt_model *m, const mpt_tensor *x, int training) {
    mpt__forward_walk w;
    int i;
    mpt__forward_begin(m, x, training, &w);
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = mpt__forward_prepare(m, i, &w);
        L->ops->forward(L, &w.p);
        mpt__forward_finish(L, &w);
    }
}

MPTDEF mpt_status mpt_model_forward(mpt_model *m, const mpt_tensor *x, int training,
                                    mpt_tensor *out) {
    mpt_tensor in;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    MPT__CHECK(mpt__refuse_quantized(m, "forward"));
    if (!m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: forward before build");
    MPT__CHECK(mpt__check_input(m, x));
    MPT__CHECK(mpt__input_on_backend(m, x, &in));
    if (training) MPT__CHECK(mpt__state_push(m)); /* the step keys dropout's masks */
    mpt__model_forward(m, &in, training);
    if (training) mpt__model_commit(m);
    if (out) mpt__layer_view(m, &m->layers[m->n_layers - 1], m->layers[m->n_layers - 1].y, 0, out);
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_output_grad(mpt_model *m, mpt_tensor *dout) {
    if (!m || !dout) return m ? mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL dout")
                              : MPT_ERR_INVALID_ARGUMENT;
    if (!m->last_batch)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "model: output_grad before a forward pass");
    mpt__layer_view(m, &m->layers[m->n_layers - 1], m->grad_buf[0], 0, dout);
    return MPT_OK;
}

/* The first layer with a trainable parameter (n_layers if none). */
static int mpt__first_trainable_layer(const mpt_model *m) {
    int i, k;
    for (i = 0; i < m->n_layers; i++)
        for (k = 0; k < m->layers[i].n_params; k++)
            if (m->layers[i].param[k]->trainable) return i;
    return m->n_layers;
}

/* A backward pass in progress, one layer at a time, from the last. Unless
   the caller wants the input's gradient, it ends at the first layer with
   trainable parameters, and that layer skips its input gradient: below it
   nothing needs one (a Flatten in front of a Dense, say, would otherwise
   cost a third of the Dense's backward). */
typedef struct mpt__backward_walk {
    mpt__pass p;
    int first;     /* the last layer to run      */
    int cur;       /* grad_buf[cur] holds dy     */
    int want_dinput;
} mpt__backward_walk;

static void mpt__backward_begin(mpt_model *m, int want_dinput, mpt__backward_walk *w) {
    w->first = want_dinput ? 0 : mpt__first_trainable_layer(m);
    w->cur = 0;
    w->want_dinput = want_dinput;
    mpt__pass_init(m, m->last_batch, 1, &w->p);
}

static mpt__layer *mpt__backward_prepare(mpt_model *m, int i, mpt__backward_walk *w) {
    mpt__layer *L = &m->layers[i];
    w->p.x = L->x;
    w->p.y = L->y;
    w->p.dy = m->grad_buf[w->cur];
    w->p.dx = (i > w->first || w->want_dinput) ? m->grad_buf[1 - w->cur] : NULL;
    w->p.logits_only = m->emit_logits && i == m->n_layers - 1;
    return L;
}

static void mpt__backward_finish(mpt_model *m, int i, mpt__backward_walk *w) {
    mpt__layer *L = &m->layers[i];
    if (m->exchange) mpt__exchange_layer_done(m, i);
    if (i > w->first && m->layers[i - 1].dtype != L->dtype) {
        /* dy is spent: the converted gradient goes back into its buffer. */
        m->be->convert(m->impl, m->layers[i - 1].dtype, m->grad_buf[w->cur], L->dtype,
                       m->grad_buf[1 - w->cur], w->p.batch * L->in_count);
    } else if (w->p.dx) {
        w->cur = 1 - w->cur;
    }
}

MPTDEF mpt_status mpt_model_backward(mpt_model *m, const mpt_tensor *dout, mpt_tensor *dinput) {
    mpt__backward_walk w;
    int i;
    mpt__layer *last;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!m->last_batch || !m->last_training)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "model: backward needs a forward pass with training = 1 first");
    last = &m->layers[m->n_layers - 1];
    if (dout) {
        mpt_tensor want;
        int ok, d;
        mpt__layer_view(m, last, NULL, 0, &want);
        ok = dout->data && mpt_dtype_is_float(dout->dtype) && dout->rank == want.rank;
        for (d = 0; ok && d < want.rank; d++) ok = dout->shape[d] == want.shape[d];
        if (!ok) {
            char got[96], exp[96];
            return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                             "model: output gradient %s %s does not match the output %s",
                             mpt_dtype_name(dout->dtype),
                             mpt_shape_format(got, sizeof got, dout->rank, dout->shape),
                             mpt_shape_format(exp, sizeof exp, want.rank, want.shape));
        }
        if (dout->data != m->grad_buf[0]) {
            const void *src = dout->data;
            if (dout->device != mpt__model_device(m)) { /* in from the host */
                MPT__CHECK(mpt__upload(m, m->target_buf[0], src, mpt_tensor_bytes(dout)));
                src = m->target_buf[0];
            }
            m->be->convert(m->impl, last->dtype, m->grad_buf[0], dout->dtype, src,
                           mpt_tensor_count(dout));
        }
    }
    mpt__backward_begin(m, dinput != NULL, &w);
    for (i = m->n_layers - 1; i >= w.first; i--) {
        mpt__layer *L = mpt__backward_prepare(m, i, &w);
        L->ops->backward(L, &w.p);
        mpt__backward_finish(m, i, &w);
    }
    if (dinput) mpt__layer_view(m, &m->layers[0], m->grad_buf[w.cur], 1, dinput);
    return MPT_OK;
}

/* ---- a training step by hand: fit's step, one public piece at a time ---------
   The pieces reach the weights and gradients through the backend, as fit
   does, so a hand-written loop runs on a GPU too. The numbers a piece
   hands back pass through the evaluation record (m->state[1]): fit and
   evaluate reset what they read of it before they read it. */

/* A model a hand step can run on: built, and one replica. */
static mpt_status mpt__hand_check(mpt_model *m, const char *what) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "%s: build the model first", what);
    if (m->n_replicas > 1 || m->strategy)
        return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                         "%s: not under a strategy (use fit, which sums the replicas' gradients)",
                         what);
    return MPT_OK;
}

/* The trainable parameters as the backend's optimizer passes take them,
   with no optimizer slots (one allocation, *block, for the caller to free). */
static mpt_status mpt__hand_update_args(mpt_model *m, mpt_update_args *u, void **block) {
    size_t n = 0;
    int i, k = 0;
    float **value, **grad, **no_slot;
    void **compute;
    int64_t *count;
    mpt_dtype *dtype;
    for (i = 0; i < m->n_params; i++) n += m->params[i].trainable != 0;
    /* value, grad, the slots (all NULL), compute; then count and dtype */
    *block = mpt__calloc(m->ctx, 4 * n * sizeof(void *) +
                                     n * (sizeof(int64_t) + sizeof(mpt_dtype)) + 1);
    if (!*block) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
    value = (float **)*block;
    grad = value + n;
    no_slot = grad + n;
    compute = (void **)(no_slot + n);
    count = (int64_t *)(compute + n);
    dtype = (mpt_dtype *)(count + n);
    for (i = 0; i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        if (!P->trainable) continue;
        value[k] = P->value;
        grad[k] = P->grad;
        compute[k] = P->compute;
        count[k] = P->count;
        dtype[k] = P->compute_dtype;
        k++;
    }
    memset(u, 0, sizeof *u);
    u->n = (int)n;
    u->value = value;
    u->grad = (const float *const *)grad;
    u->slot0 = u->slot1 = no_slot;
    u->compute = compute;
    u->compute_dtype = dtype;
    u->count = count;
    u->state = &m->state[1];
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_grad_stats(mpt_model *m, int *all_finite, double *global_norm) {
    mpt_update_args u;
    mpt_step_state st;
    void *block;
    mpt_status s;
    MPT__CHECK(mpt__hand_check(m, "grad_stats"));
    MPT__CHECK(mpt__hand_update_args(m, &u, &block));
    m->be->grad_stats(m->impl, &u); /* Σg² and its finiteness, into state[1] */
    s = mpt__download(m, &st, &m->state[1], sizeof st);
    mpt__free(m->ctx, block);
    if (s != MPT_OK) return s;
    if (all_finite) *all_finite = st.finite != 0;
    if (global_norm) *global_norm = sqrt(st.sum_squares);
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_scale_grads(mpt_model *m, float factor) {
    int i;
    MPT__CHECK(mpt__hand_check(m, "scale_grads"));
    if (!isfinite(factor))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "scale_grads: factor %g must be finite",
                         (double)factor);
    for (i = 0; i < m->n_params; i++)
        if (m->params[i].trainable)
            m->be->scale(m->impl, m->params[i].grad, factor, m->params[i].count);
    return MPT_OK;
}

/* The backend's fused update with plain SGD at this rate, on a record that
   says: gradients finite, no loss scale, optimizer step 0. */
MPTDEF mpt_status mpt_model_sgd_step(mpt_model *m, float learning_rate) {
    mpt_update_args u;
    mpt_step_state st;
    void *block;
    MPT__CHECK(mpt__hand_check(m, "sgd_step"));
    if (!(learning_rate >= 0 && learning_rate < INFINITY))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "sgd_step: learning_rate %g must be finite and >= 0",
                         (double)learning_rate);
    memset(&st, 0, sizeof st);
    st.learning_rate = learning_rate;
    st.loss_scale = 1;
    st.finite = 1;
    MPT__CHECK(mpt__upload(m, &m->state[1], &st, sizeof st));
    MPT__CHECK(mpt__hand_update_args(m, &u, &block));
    u.optimizer.type = MPT_OPTIMIZER_SGD; /* no momentum, decay, L2 or clipping */
    u.optimizer.learning_rate = learning_rate;
    m->be->update(m->impl, &u);
    /* the backend reads u's arrays while queueing, not after */
    mpt__free(m->ctx, block);
    return MPT_OK;
}

/* =============================================================================
   @impl-layer-helpers: what the layers below (@impl-dense .. @impl-dropout) share
   ============================================================================= */

/* ---- helpers shared by the layers ----------------------------------------- */

/* Carves 64-byte-aligned pieces out of a pass's workspace, in order. */
typedef struct mpt__ws {
    unsigned char *next;
} mpt__ws;

static void *mpt__ws_take(mpt__ws *w, int64_t bytes) {
    void *p = w->next;
    w->next += (bytes + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    return p;
}

/* Workspace bytes for `pieces` pieces whose sizes add up to `bytes`. */
static int64_t mpt__ws_bytes(int64_t bytes, int pieces) { return bytes + (int64_t)pieces * MPT__ALIGN; }

static int mpt__initializer_valid(mpt_initializer init) {
    return init >= MPT_INIT_DEFAULT && init < MPT_INIT_COUNT_;
}

#if MPT__X86
/* ReLU's gradient 16 lanes at a time: mpt__relu_grad, dy where !(y <= 0)
   (a NaN y passes dy, as the scalar loop does). The compiler does not
   vectorise that loop itself, and it is a tenth of an MLP's step. */
MPT__TARGET_AVX512 static void mpt__relu_backward_avx512(const float *y, const float *dy,
                                                        float *dz, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __mmask16 passed = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), _mm512_setzero_ps(),
                                              _CMP_NLE_UQ);
        _mm512_storeu_ps(dz + i, _mm512_maskz_mov_ps(passed, _mm512_loadu_ps(dy + i)));
    }
    for (; i < n; i++) dz[i] = mpt__relu_grad(y[i], dy[i]);
}
#endif

/* dz = dy · act'(...) in float32, reading dy, the output y and (for GELU)
   the pre-activation z in `dtype`. tmp holds n floats. */
static void mpt__activation_grad(mpt_context *ctx, mpt_activation act, mpt_dtype dtype,
                                 const void *z, const void *y, const void *dy, float *dz,
                                 float *tmp, int64_t n, int64_t cols) {
    const float *dyf = (const float *)dy, *kept = (const float *)(act == MPT_ACT_GELU ? z : y);
    if (dtype != MPT_FLOAT32) { /* float32 is read in place, halves are widened */
        mpt__convert(ctx, MPT_FLOAT32, dz, dtype, dy, n);
        dyf = dz;
        if (act != MPT_ACT_NONE) {
            mpt__convert(ctx, MPT_FLOAT32, tmp, dtype, act == MPT_ACT_GELU ? z : y, n);
            kept = tmp;
        }
    }
#if MPT__X86
    if (act == MPT_ACT_RELU && (ctx->cpu & MPT_CPU_AVX512)) {
        mpt__relu_backward_avx512(kept, dyf, dz, n);
        return;
    }
#endif
    mpt__activation_backward(act, act == MPT_ACT_GELU ? kept : NULL,
                             act == MPT_ACT_GELU ? NULL : kept, dyf, dz, n, cols);
}

/* to[0..n) += from[0..n). In blocks of 16 through a local array, which
   tells the compiler the two do not overlap: at -O2 its cheap cost model
   vectorises only loops like these (fixed length, no overlap checks). */
static void mpt__add_f32(float *to, const float *from, int64_t n) {
    int64_t i = 0;
    int k;
    for (; i + 16 <= n; i += 16) {
        float t[16];
        for (k = 0; k < 16; k++) t[k] = to[i + k] + from[i + k];
        for (k = 0; k < 16; k++) to[i + k] = t[k];
    }
    for (; i < n; i++) to[i] += from[i];
}

/* out[j] += Σ_r dz[r][j]: a bias gradient, rows in order
   (Conv2D adds chunk after chunk; Dense zeroes out first). */
static void mpt__add_column_sums(const float *dz, int64_t rows, int64_t cols, float *out) {
    int64_t r;
    for (r = 0; r < rows; r++) mpt__add_f32(out, dz + r * cols, cols);
}

/* Every layer's GEMM goes through here. While a model is planned (before
   its first training step on a backend that measures its GEMM engines),
   the backend first times each engine on the shape and keeps the faster;
   a shape it cannot time keeps the default engine. */
static void mpt__layer_gemm(const mpt__pass *p, const mpt_gemm_desc *g, mpt_dtype c_dtype) {
    if (p->model->planning && p->be->gemm_plan) (void)p->be->gemm_plan(p->impl, g, c_dtype);
    p->be->gemm(p->impl, g, c_dtype);
}

/* A layer's product of packed row-major matrices in its compute dtype:
   c (m×n, float32) = op(a)·op(b), op(a) m×k and op(b) k×n, where a is
   stored k×m when trans_a and b n×k when trans_b, each row after row. The
   rest (bias, activation, beta) is the caller's to set. */
static mpt_gemm_desc mpt__layer_gemm_desc(const mpt__layer *L, int trans_a, int trans_b,
                                          int64_t m, int64_t n, int64_t k, const void *a,
                                          const void *b, float *c) {
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.trans_a = trans_a;
    g.trans_b = trans_b;
    g.m = m;
    g.n = n;
    g.k = k;
    g.ab_dtype = L->dtype;
    g.a = a;
    g.lda = trans_a ? m : k;
    g.b = b;
    g.ldb = trans_b ? k : n;
    g.c = c;
    g.ldc = n;
    return g;
}

/* Appends a layer of `ops` described by desc (one of the descriptor
   structs, `size` bytes; each starts with the common name and dtype). */
static mpt_status mpt__add_layer(mpt_model *m, const mpt__layer_ops *ops, const void *desc,
                                 size_t size) {
    mpt__layer_desc ld;
    memset(&ld, 0, sizeof ld);
    memcpy(&ld, desc, size);
    return mpt__model_add(m, ops, &ld, ld.common.name, ld.common.dtype);
}

/* Before the checks of a layer's descriptor, which the caller has made
   its zero defaults when NULL (a required field's own check names it). */
static mpt_status mpt__check_add(mpt_model *m) { return m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT; }

/* =============================================================================
   @impl-dense  Dense: y = act(x · kernel + bias)                x: (B, in)  y: (B, units)
   ============================================================================= */

static mpt_status mpt__dense_build(mpt_model *m, mpt__layer *L) {
    const mpt_dense_desc *d = &L->desc.dense;
    int64_t in = L->in_shape[L->in_rank - 1], units = d->units;
    int64_t kshape[2];
    if (L->in_rank != 1) {
        char s[96];
        return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                         "Dense '%s' expects one sample to be a vector (batch, features), got "
                         "(batch, %s; add a Flatten layer before it",
                         L->name, mpt_shape_format(s, sizeof s, L->in_rank, L->in_shape) + 1);
    }
    kshape[0] = in;
    kshape[1] = units;
    L->out_rank = 1;
    L->out_shape[0] = units;
    MPT__CHECK(mpt__layer_add_param(m, L, "kernel", 2, kshape,
                                    d->kernel_initializer ? d->kernel_initializer
                                                          : MPT_INIT_GLOROT_UNIFORM,
                                    in, units, 1, L->dtype));
    if (!d->no_bias)
        MPT__CHECK(mpt__layer_add_param(m, L, "bias", 1, &units,
                                        d->bias_initializer ? d->bias_initializer
                                                            : MPT_INIT_ZEROS,
                                        in, units, 1, MPT_FLOAT32));
    if (d->activation == MPT_ACT_GELU)
        MPT__CHECK(mpt__layer_add_saved(m, L, mpt__dbytes(L->dtype, units), 0)); /* z (B, units) */
    /* forward: acc (B, units) f32; backward: dz, tmp (B, units) f32, dz in
       dtype (B, units), dx (B, in) f32 */
    return mpt__layer_set_workspace(m, L, 12 * units + 2 * units + 4 * in, 5 * MPT__ALIGN);
}

/* The activation a pass applies: none where the loss takes the logits. */
static mpt_activation mpt__pass_activation(const mpt__pass *p, mpt_activation act) {
    return p->logits_only && act == MPT_ACT_SOFTMAX ? MPT_ACT_NONE : act;
}

static void mpt__dense_forward(mpt__layer *L, const mpt__pass *p) {
    const mpt_dense_desc *d = &L->desc.dense;
    int64_t B = p->batch, in = L->in_count, units = d->units, n = B * units;
    mpt_activation act = mpt__pass_activation(p, d->activation);
    int fused = act != MPT_ACT_GELU && act != MPT_ACT_SOFTMAX;
    /* A backend that rounds C in its epilogue writes y in the compute
       dtype directly; otherwise the product lands in float32 first. */
    int rounds_c = fused && L->dtype != MPT_FLOAT32 && p->be->gemm_rounds_c;
    mpt__ws w = {(unsigned char *)p->workspace};
    float *acc = ((L->dtype == MPT_FLOAT32 || rounds_c) && fused)
                     ? (float *)p->y
                     : (float *)mpt__ws_take(&w, 4 * n);
    /* acc (B, units) = x · kernel */
    mpt_gemm_desc g = mpt__layer_gemm_desc(L, 0, 0, B, units, in, p->x,
                                           mpt__param_compute_copy(L, 0), acc);
    g.bias = d->no_bias ? NULL : mpt__param_master(L, 1);
    g.activation = fused ? act : MPT_ACT_NONE;
    mpt__layer_gemm(p, &g, rounds_c ? L->dtype : MPT_FLOAT32);
    if (act == MPT_ACT_GELU) {
        p->be->convert(p->impl, L->dtype, L->saved[0], MPT_FLOAT32, acc, n);
        p->be->activation(p->impl, MPT_ACT_GELU, acc, B, units);
    } else if (act == MPT_ACT_SOFTMAX) {
        p->be->activation(p->impl, MPT_ACT_SOFTMAX, acc, B, units);
    }
    if (acc != p->y) p->be->convert(p->impl, L->dtype, p->y, MPT_FLOAT32, acc, n);
}

static void mpt__dense_backward(mpt__layer *L, const mpt__pass *p) {
    const mpt_dense_desc *d = &L->desc.dense;
    int64_t B = p->batch, in = L->in_count, units = d->units, n = B * units;
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * n);
    float *tmp = (float *)mpt__ws_take(&w, 4 * n);
    void *dz_c = L->dtype == MPT_FLOAT32 ? (void *)dz : mpt__ws_take(&w, mpt__dbytes(L->dtype, n));
    mpt_gemm_desc g;
    p->be->activation_grad(p->impl, mpt__pass_activation(p, d->activation), L->dtype,
                           L->saved[0], p->y, p->dy, dz, tmp, B, units);
    if (!d->no_bias) p->be->column_sums(p->impl, dz, B, units, mpt__param_grad(L, 1), 0);
    /* The weight and input gradients are products in the compute dtype,
       as the forward was: dz is rounded to it once. */
    if (dz_c != (void *)dz) p->be->convert(p->impl, L->dtype, dz_c, MPT_FLOAT32, dz, n);
    /* dkernel (in, units) = xᵀ · dz */
    g = mpt__layer_gemm_desc(L, 1, 0, in, units, B, p->x, dz_c, mpt__param_grad(L, 0));
    mpt__layer_gemm(p, &g, MPT_FLOAT32);
    if (p->dx) { /* dx (B, in) = dz · kernelᵀ */
        float *dxf = L->dtype == MPT_FLOAT32 ? (float *)p->dx
                                             : (float *)mpt__ws_take(&w, 4 * B * in);
        g = mpt__layer_gemm_desc(L, 0, 1, B, in, units, dz_c, mpt__param_compute_copy(L, 0),
                                 dxf);
        mpt__layer_gemm(p, &g, MPT_FLOAT32);
        if ((void *)dxf != p->dx)
            p->be->convert(p->impl, L->dtype, p->dx, MPT_FLOAT32, dxf, B * in);
    }
}

static mpt_activation mpt__dense_activation(const mpt__layer *L) {
    return L->desc.dense.activation;
}

static const mpt__layer_ops mpt__dense_ops = {"Dense", "dense", mpt__dense_build,
                                              mpt__dense_forward, mpt__dense_backward, NULL,
                                              mpt__dense_activation};

MPTDEF mpt_status mpt_model_add_dense(mpt_model *m, const mpt_dense_desc *d) {
    mpt_dense_desc defaults;
    MPT__CHECK(mpt__check_add(m));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    if (d->units <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Dense: units %lld must be > 0",
                         (long long)d->units);
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Dense: unknown activation %d",
                         (int)d->activation);
    if (!mpt__initializer_valid(d->kernel_initializer) ||
        !mpt__initializer_valid(d->bias_initializer))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Dense: unknown initializer %d",
                         (int)(mpt__initializer_valid(d->kernel_initializer)
                                   ? d->bias_initializer
                                   : d->kernel_initializer));
    return mpt__add_layer(m, &mpt__dense_ops, d, sizeof(mpt_dense_desc));
}

/* =============================================================================
   @impl-flatten  Flatten: (B, h, w, c) -> (B, h·w·c), the same memory as vectors
   ============================================================================= */

static mpt_status mpt__flatten_build(mpt_model *m, mpt__layer *L) {
    (void)m;
    L->out_rank = 1;
    L->out_shape[0] = L->in_count;
    L->output_is_input = 1;
    return MPT_OK;
}

static void mpt__flatten_forward(mpt__layer *L, const mpt__pass *p) {
    (void)L;
    (void)p; /* y is x */
}

static void mpt__flatten_backward(mpt__layer *L, const mpt__pass *p) {
    if (p->dx)
        p->be->copy(p->impl, p->dx, p->dy, (size_t)mpt__dbytes(L->dtype, p->batch * L->in_count));
}

static const mpt__layer_ops mpt__flatten_ops = {"Flatten", "flatten", mpt__flatten_build,
                                                mpt__flatten_forward, mpt__flatten_backward, NULL,
                                                NULL};

MPTDEF mpt_status mpt_model_add_flatten(mpt_model *m, const mpt_flatten_desc *d) {
    mpt_flatten_desc none;
    MPT__CHECK(m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT);
    memset(&none, 0, sizeof none);
    return mpt__add_layer(m, &mpt__flatten_ops, d ? d : &none, sizeof(mpt_flatten_desc));
}

/* =============================================================================
   @impl-activation  Activation: y = act(x) (softmax: over the last axis)
   ============================================================================= */

static mpt_status mpt__activation_build(mpt_model *m, mpt__layer *L) {
    L->out_rank = L->in_rank;
    memcpy(L->out_shape, L->in_shape, sizeof L->in_shape);
    return mpt__layer_set_workspace(m, L, 8 * L->in_count, 2 * MPT__ALIGN);
}

static void mpt__activation_layer_forward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count, cols = L->in_shape[L->in_rank - 1];
    float *t = (float *)p->workspace;
    mpt_activation act = mpt__pass_activation(p, L->desc.activation.activation);
    p->be->convert(p->impl, MPT_FLOAT32, t, L->dtype, p->x, n);
    p->be->activation(p->impl, act, t, n / cols, cols);
    p->be->convert(p->impl, L->dtype, p->y, MPT_FLOAT32, t, n);
}

static void mpt__activation_layer_backward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count, cols = L->in_shape[L->in_rank - 1];
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * n);
    float *tmp = (float *)mpt__ws_take(&w, 4 * n);
    if (!p->dx) return;
    p->be->activation_grad(p->impl, mpt__pass_activation(p, L->desc.activation.activation),
                           L->dtype, p->x, p->y, p->dy, dz, tmp, n / cols, cols);
    p->be->convert(p->impl, L->dtype, p->dx, MPT_FLOAT32, dz, n);
}

static mpt_activation mpt__activation_layer_activation(const mpt__layer *L) {
    return L->desc.activation.activation;
}

static const mpt__layer_ops mpt__activation_ops = {"Activation", "activation",
                                                   mpt__activation_build,
                                                   mpt__activation_layer_forward,
                                                   mpt__activation_layer_backward, NULL,
                                                   mpt__activation_layer_activation};

MPTDEF mpt_status mpt_model_add_activation(mpt_model *m, const mpt_activation_desc *d) {
    mpt_activation_desc defaults;
    MPT__CHECK(mpt__check_add(m));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Activation: unknown activation %d",
                         (int)d->activation);
    return mpt__add_layer(m, &mpt__activation_ops, d, sizeof(mpt_activation_desc));
}
/* =============================================================================
   @impl-windows  the geometry Conv2D and the pooling layers share
   =============================================================================

   One sample is (H, W, C), NHWC. A window of kh × kw pixels slides with
   strides (sh, sw). Padding follows TensorFlow:
     valid: only whole windows, out = floor((in − k) / s) + 1;
     same:  out = ceil(in / s), padded by max((out − 1)·s + k − in, 0)
            pixels, half of them (rounded down) at the top/left, the rest
            at the bottom/right.
   Padding is never materialised: the loops skip pixels outside the image
   (zeros for a convolution, "not there" for pooling). */

typedef mpt_window mpt__win; /* (0 output rows or columns: no window fits) */

/* Outputs along one axis, and the padding before the first input. */
static int64_t mpt__win_axis(int64_t in, int64_t k, int64_t s, mpt_padding padding,
                             int64_t *before) {
    int64_t out;
    *before = 0;
    if (padding == MPT_PADDING_VALID) return in < k ? 0 : (in - k) / s + 1;
    out = (in - 1) / s + 1;                             /* ceil(in / s), no overflow  */
    *before = MPT__MAX(k - (in - (out - 1) * s), 0) / 2; /* (out−1)·s + k − in, halved */
    return out;
}

static void mpt__win_init(mpt__win *g, const mpt__layer *L, const int64_t size[2],
                          const int64_t strides[2], mpt_padding padding) {
    g->h = L->in_shape[0];
    g->w = L->in_shape[1];
    g->c = L->in_shape[2];
    g->kh = size[0];
    g->kw = size[1];
    g->sh = strides[0];
    g->sw = strides[1];
    g->oh = mpt__win_axis(g->h, g->kh, g->sh, padding, &g->top);
    g->ow = mpt__win_axis(g->w, g->kw, g->sw, padding, &g->left);
}

/* The rows [*r0, *r1) and columns [*c0, *c1) of the input that output
   pixel (oy, ox)'s window covers, padding cut off. */
static void mpt__win_span(const mpt__win *g, int64_t oy, int64_t ox, int64_t *r0, int64_t *r1,
                          int64_t *c0, int64_t *c1) {
    int64_t y = oy * g->sh - g->top, x = ox * g->sw - g->left;
    *r0 = MPT__MAX(y, 0);
    *r1 = MPT__MIN(y + g->kh, g->h);
    *c0 = MPT__MAX(x, 0);
    *c1 = MPT__MIN(x + g->kw, g->w);
}

/* Image layers take (H, W, C) samples. */
static mpt_status mpt__expect_image(mpt_model *m, const mpt__layer *L) {
    char s[96];
    if (L->in_rank == 3) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                     "%s '%s' expects one sample to be (height, width, channels), got (batch, %s",
                     L->ops->class_name, L->name,
                     mpt_shape_format(s, sizeof s, L->in_rank, L->in_shape) + 1);
}

/* Under 'valid' padding a window larger than the image leaves no output. */
static mpt_status mpt__expect_window_fits(mpt_model *m, const mpt__layer *L, const mpt__win *g,
                                          const char *what) {
    char s[96];
    if (g->oh > 0 && g->ow > 0) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                     "%s '%s': %s (%lld, %lld) is larger than the input %s with padding 'valid'",
                     L->ops->class_name, L->name, what, (long long)g->kh, (long long)g->kw,
                     mpt_shape_format(s, sizeof s, L->in_rank, L->in_shape));
}

/* Checks what a window descriptor gives: each of size and strides must be
   > 0, or 0 for its default; `size_required` makes 0 an error. */
static mpt_status mpt__check_window_desc(mpt_model *m, const char *cls, const char *size_name,
                                         const int64_t size[2], int size_required,
                                         const int64_t strides[2], mpt_padding padding) {
    /* Bounded so that no index arithmetic on a window can overflow. */
    const int64_t limit = (int64_t)1 << 30;
    int i;
    for (i = 0; i < 2; i++) {
        if (size[i] < (size_required ? 1 : 0) || size[i] > limit)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: %s (%lld, %lld) must be in 1..%lld%s", cls, size_name,
                             (long long)size[0], (long long)size[1], (long long)limit,
                             size_required ? "" : " (or 0 for the default)");
        if (strides[i] < 0 || strides[i] > limit)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: strides (%lld, %lld) must be in 1..%lld (or 0 for the default)",
                             cls, (long long)strides[0], (long long)strides[1], (long long)limit);
    }
    if (padding != MPT_PADDING_VALID && padding != MPT_PADDING_SAME)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: unknown padding %d (MPT_PADDING_VALID or MPT_PADDING_SAME)", cls,
                         (int)padding);
    return MPT_OK;
}


/* *acc += a·b, overflow-checked; *acc stays -1 once anything overflowed. */
static void mpt__acc_mul(int64_t *acc, int64_t a, int64_t b) {
    int64_t ab;
    if (*acc < 0 || !mpt__mul_ok(a, b, &ab) || !mpt__add_ok(*acc, ab, acc)) *acc = -1;
}

/* =============================================================================
   @impl-conv2d  Conv2D: y = act(conv(x, kernel) + bias)
           x: (B, H, W, C)  kernel: (kh, kw, C, F)  y: (B, OH, OW, F)
   =============================================================================

   As a matrix product (im2col): each output pixel's window, read in
   (kh, kw, C) order, is one row of a matrix `cols`, (B·OH·OW) × (kh·kw·C).
   Keras' kernel layout, row-major, is already the (kh·kw·C) × F matrix, so
       forward:  y  = act(cols · kernel + bias)            (B·OH·OW) × F
       backward: dkernel = colsᵀ · dz,  dcols = dz · kernelᵀ,
                 dx = col2im(dcols): each entry of dcols added back to the
                 pixel it was copied from (float32, a fixed order).
   The whole batch's cols can be large (128 × 24·24 × 288 floats is 85 MB
   in float32), so the batch is cut into chunks of samples whose cols hold
   about MPT__CONV_COLS_BUDGET elements (2^20: 4 MiB in float32): the
   products keep thousands of rows, the workspace stays small, and what
   im2col writes is still in cache when the GEMM packs it (measured on the
   CNN above: 2^20 beat 2^22 by 20-30%). The chunk size depends on the
   layer alone, and kernel gradients are summed chunk after chunk (beta =
   1), so results do not depend on the thread count. A 1×1 kernel with
   stride 1 needs no im2col: the image, seen as (B·H·W) × C, is its own
   cols. A backend with a direct convolution (conv_direct: the CPU's with
   AVX-512) runs the forward product, the input gradient and the kernel
   gradient without cols, dcols or col2im where it takes the case (see
   mpt__cpu_conv_direct for which). */

#ifndef MPT__CONV_COLS_BUDGET
#define MPT__CONV_COLS_BUDGET ((int64_t)1 << 20) /* elements of cols per chunk */
#endif

/* What a Conv2D pass needs, derived from the layer. */
typedef struct mpt__conv_plan {
    mpt__win g;
    int64_t f;      /* filters                                          */
    int64_t kk;     /* kh·kw·C: the length of one row of cols            */
    int64_t pix;    /* OH·OW: output pixels (rows of cols) per sample    */
    int64_t chunk;  /* samples per chunk                                 */
    int identity;   /* 1×1 kernel, stride 1: cols is the image itself    */
    size_t es;      /* bytes of one element of the compute dtype         */
} mpt__conv_plan;

static void mpt__conv_plan_init(mpt__conv_plan *c, const mpt__layer *L, int64_t max_batch) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    int64_t strides[2];
    strides[0] = d->strides[0] ? d->strides[0] : 1;
    strides[1] = d->strides[1] ? d->strides[1] : 1;
    mpt__win_init(&c->g, L, d->kernel_size, strides, d->padding);
    c->f = d->filters;
    c->kk = c->g.kh * c->g.kw * c->g.c;
    c->pix = c->g.oh * c->g.ow;
    /* budget / (pix · kk), divided in two steps so that nothing overflows */
    c->chunk = MPT__CONV_COLS_BUDGET / MPT__MAX(c->pix, 1) / c->kk;
    c->chunk = MPT__MAX(1, MPT__MIN(max_batch, c->chunk));
    c->identity = c->g.kh == 1 && c->g.kw == 1 && c->g.sh == 1 && c->g.sw == 1;
    c->es = mpt_dtype_size(L->dtype);
}

/* ---- im2col and col2im, one task per image row ---------------------------- */

typedef struct mpt__im2col_job {
    const mpt_context *ctx;
    const mpt__win *g;
    size_t es;                /* bytes per element                            */
    const unsigned char *x;   /* (n, H, W, C) compute dtype                   */
    unsigned char *cols;      /* im2col: (n·OH·OW, kh·kw·C) compute dtype      */
    const float *dcols;       /* col2im: (n·OH·OW, kh·kw·C) float32            */
    float *dx;                /* col2im: (n, H, W, C) float32                  */
    mpt_dtype dtype;          /* col2im: dtype of out (float32: out is dx)     */
    void *out;                /* col2im: (n, H, W, C) the result, in dtype     */
} mpt__im2col_job;

/* Output row oy of sample b: copies its windows into their rows of cols.
   A window row inside the image is kw·C contiguous elements: one memcpy. */
static void mpt__im2col_task(void *arg, int64_t task, int thread) {
    const mpt__im2col_job *j = (const mpt__im2col_job *)arg;
    const mpt__win *g = j->g;
    const int64_t b = task / g->oh, oy = task % g->oh, y0 = oy * g->sh - g->top;
    const size_t pixel = (size_t)g->c * j->es, run = (size_t)g->kw * pixel;
    const unsigned char *x = j->x + (size_t)(b * g->h * g->w) * pixel;
    unsigned char *dst = j->cols + (size_t)(task * g->ow * g->kh) * run;
    int64_t ox, i, k;
    (void)thread;
    for (ox = 0; ox < g->ow; ox++) {
        const int64_t x0 = ox * g->sw - g->left;
        for (i = 0; i < g->kh; i++, dst += run) {
            const int64_t y = y0 + i;
            if (y < 0 || y >= g->h) {
                memset(dst, 0, run);
            } else if (x0 >= 0 && x0 + g->kw <= g->w) {
                memcpy(dst, x + (size_t)(y * g->w + x0) * pixel, run);
            } else {
                for (k = 0; k < g->kw; k++) {
                    const int64_t xx = x0 + k;
                    if (xx < 0 || xx >= g->w)
                        memset(dst + (size_t)k * pixel, 0, pixel);
                    else
                        memcpy(dst + (size_t)k * pixel, x + (size_t)(y * g->w + xx) * pixel,
                               pixel);
                }
            }
        }
    }
}

/* Input row y of sample b's dx: the entries of dcols copied from it, added
   output pixel after output pixel (the same sums whichever thread runs
   it), then stored in the compute dtype. Row by row, not window by window,
   so that tasks never write the same pixel. */
static void mpt__col2im_task(void *arg, int64_t task, int thread) {
    const mpt__im2col_job *j = (const mpt__im2col_job *)arg;
    const mpt__win *g = j->g;
    const int64_t b = task / g->h, y = task % g->h, run = g->kw * g->c, n_row = g->w * g->c;
    /* the output rows whose windows cover y: oy·sh − top ≤ y < oy·sh − top + kh */
    const int64_t lo = y + g->top - g->kh + 1;
    const int64_t oy0 = lo <= 0 ? 0 : (lo + g->sh - 1) / g->sh;
    const int64_t oy1 = MPT__MIN(g->oh - 1, (y + g->top) / g->sh);
    float *dx = j->dx + task * n_row; /* (W, C) */
    int64_t oy, ox, k;
    (void)thread;
    memset(dx, 0, sizeof(float) * (size_t)n_row);
    for (oy = oy0; oy <= oy1; oy++) {
        const int64_t i = y - (oy * g->sh - g->top); /* which row of the window y is */
        for (ox = 0; ox < g->ow; ox++) {
            const float *src = j->dcols + (((b * g->oh + oy) * g->ow + ox) * g->kh + i) * run;
            const int64_t x0 = ox * g->sw - g->left;
            if (x0 >= 0 && x0 + g->kw <= g->w) { /* the window row lies inside the image */
                mpt__add_f32(dx + x0 * g->c, src, run);
                continue;
            }
            for (k = 0; k < g->kw; k++)
                if (x0 + k >= 0 && x0 + k < g->w)
                    mpt__add_f32(dx + (x0 + k) * g->c, src + k * g->c, g->c);
        }
    }
    if (j->dtype != MPT_FLOAT32)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->out + (size_t)(task * n_row) * j->es,
                     MPT_FLOAT32, dx, n_row);
}

/* The CPU backend's im2col (mpt_backend.im2col). */
static void mpt__cpu_im2col(void *impl, const mpt_window *g, mpt_dtype dtype, const void *x,
                            int64_t n, void *cols) {
    mpt_context *ctx = (mpt_context *)impl;
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = g;
    j.es = mpt_dtype_size(dtype);
    j.x = (const unsigned char *)x;
    j.cols = (unsigned char *)cols;
    mpt__parallel_for(ctx, n * g->oh, mpt__im2col_task, &j);
}

/* The CPU backend's col2im: dx (n, H, W, C) in dtype from dcols
   (n·OH·OW, kh·kw·C) float32; dxf (n, H, W, C) float32 is where the sums
   are made (dx itself if float32). */
static void mpt__cpu_col2im(void *impl, const mpt_window *g, mpt_dtype dtype, const float *dcols,
                            int64_t n, float *dxf, void *dx) {
    mpt_context *ctx = (mpt_context *)impl;
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = g;
    j.es = mpt_dtype_size(dtype);
    j.dcols = dcols;
    j.dx = dtype == MPT_FLOAT32 ? (float *)dx : dxf;
    j.dtype = dtype;
    j.out = dx;
    mpt__parallel_for(ctx, n * g->h, mpt__col2im_task, &j);
}

/* ---- direct convolution: no cols (AVX-512) -----------------------------------
   The GEMM's 12×32 micro-kernel, reading its A straight from the images: a
   tile is 12 output pixels in a row of the batch (across image rows and
   samples), and a table holds, for each pixel and tap, where that pixel's
   input channels start, or a zero pixel where the tap lies in the
   padding. The kernel broadcasts from there as the GEMM does from its
   packed A panel, so cols is never written (for a 3×3 kernel, 9 times the
   image). The sum over k = (tap, channel) runs in the GEMM's order and
   depth blocks (mpt__gemm_depth_block), the padding's zeros included, and
   the epilogue (bias, activation, conversion) is the GEMM path's: the
   forward pass gives the im2col path's bits exactly.
   The input gradient is the same product over dz with the kernel turned
   around (taps reversed, C and F swapped): dx pixel (y, x) reads at tap
   (i, j) the dz pixel ((y + top − i)/sh, (x + left − j)/sw) where both
   divide exactly and lie inside, else zero. That replaces dcols = dz ·
   kernelᵀ and col2im's scatter-adds by one sum per dx element, in another
   order than col2im's (not the former path's bits).
   Each output pixel is one tile's, whatever the thread count. */

#define MPT__DCONV_MR 12       /* output pixels per tile                  */
#define MPT__DCONV_MAX_TAPS 64 /* larger kernels take the im2col path     */
#define MPT__DCONV_TILES_PER_TASK 8 /* tiles per parallel-for task    */

struct mpt__dconv_job;
/* tile (MR × 32 float32) = the sums of output channels [o0, o0 + nb)
   for the tile's pixels; src: [taps][MR] where each pixel's taps start. */
typedef void (*mpt__dconv_tile_fn)(const struct mpt__dconv_job *j,
                                   const unsigned char *const *src, int64_t o0, int nb,
                                   float *tile);

typedef struct mpt__dconv_job {
    mpt_context *ctx;
    const mpt_conv_args *a;
    const mpt_window *g;
    const unsigned char *x;    /* the image read: x, or dz for input_grad       */
    int64_t ih, iw, ic;        /* its sample shape                              */
    int64_t oh, ow, oc;        /* the output's: y, or dx for input_grad         */
    int64_t taps, kk, kc;      /* kh·kw, taps·ic, depth block                   */
    int64_t pixels;            /* n·oh·ow                                       */
    size_t es;                 /* bytes per element of dtype                    */
    const void *w;             /* kernel packed as the product's (kk, oc) B:
                                  float32, or bfloat16 k-pairs (kk/2, oc) uint32 */
    const unsigned char *zero; /* ic zero elements                              */
    mpt__dconv_tile_fn tile;
    mpt__convert_fn convert;   /* float32 to dtype                              */
} mpt__dconv_job;

/* The input row or column that output row or column o reads at window
   offset i along an axis of stride s and padding `before`; −1 where it
   reads none. input_grad: the forward's offset is k − 1 − i, and the dz
   row is (o + before − (k − 1 − i)) / s where that divides exactly. */
static int64_t mpt__dconv_axis(int input_grad, int64_t o, int64_t i, int64_t k, int64_t s,
                               int64_t before, int64_t in) {
    int64_t v;
    if (!input_grad) {
        v = o * s - before + i;
    } else {
        v = o + before - (k - 1 - i);
        if (s != 1) v = v >= 0 && v % s == 0 ? v / s : -1; /* divides only where it must */
    }
    return v >= 0 && v < in ? v : -1;
}

/* Where output pixel (b, oy, ox)'s taps read their ic channels: src[t·MR]
   for tap t = i·kw + k, a zero pixel where the tap lies in the padding. */
static void mpt__dconv_taps(const mpt__dconv_job *j, int64_t b, int64_t oy, int64_t ox,
                            const unsigned char **src) {
    const mpt_window *g = j->g;
    const int grad = j->a->input_grad;
    const unsigned char *image = j->x + (size_t)(b * j->ih * j->iw * j->ic) * j->es;
    const size_t pixel = (size_t)j->ic * j->es;
    int64_t i, k;
    for (i = 0; i < g->kh; i++) {
        const int64_t y = mpt__dconv_axis(grad, oy, i, g->kh, g->sh, g->top, j->ih);
        for (k = 0; k < g->kw; k++, src += MPT__DCONV_MR) {
            const int64_t x = mpt__dconv_axis(grad, ox, k, g->kw, g->sw, g->left, j->iw);
            *src = y < 0 || x < 0 ? j->zero : image + (size_t)(y * j->iw + x) * pixel;
        }
    }
}

/* The kernel (kh, kw, C, F) as the product's B, (kk, oc), into ws, then
   the zero pixel after it. Forward: the kernel as (kk, F); input_grad:
   row k = (tap, f) of the kernel turned around is column f of the
   forward's tap taps − 1 − tap, o = c. bfloat16 keeps rows k and k + 1
   side by side in 32-bit lanes (kk is even). */
static void mpt__dconv_pack(mpt__dconv_job *j, unsigned char *ws) {
    const int64_t c = j->g->c, f = j->a->f, oc = j->oc;
    const int pairs = j->a->dtype != MPT_FLOAT32;
    const float *src32 = (const float *)j->a->kernel;
    const mpt_bf16 *src16 = (const mpt_bf16 *)j->a->kernel;
    float *dst32 = (float *)(void *)ws;
    uint32_t *dst16 = (uint32_t *)(void *)ws;
    int64_t k, o;
    for (k = 0; k < j->kk; k++) {
        /* element (k, o) of B is kernel[row + o·step] */
        const int64_t row = j->a->input_grad ? (j->taps - 1 - k / f) * c * f + k % f : k * f;
        const int64_t step = j->a->input_grad ? f : 1;
        for (o = 0; o < oc; o++) {
            if (!pairs)
                dst32[k * oc + o] = src32[row + o * step];
            else if (k % 2 == 0)
                dst16[k / 2 * oc + o] = src16[row + o * step];
            else
                dst16[k / 2 * oc + o] |= (uint32_t)src16[row + o * step] << 16;
        }
    }
    j->w = ws;
    ws += (4 * j->kk * oc + 63) / 64 * 64;
    memset(ws, 0, (size_t)j->ic * j->es);
    j->zero = ws;
}

#if MPT__X86
/* The twelve accumulator pairs and the depth blocks' running sums in
   tile: the first block stores, the later ones add (the GEMM's
   C = C + alpha·AB with alpha 1). */
#define MPT__DCONV_ACC(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
#define MPT__DCONV_FOLD(i)                                                                 \
    if (first) {                                                                           \
        _mm512_storeu_ps(tile + 32 * i, c##i##0);                                           \
        _mm512_storeu_ps(tile + 32 * i + 16, c##i##1);                                      \
    } else {                                                                               \
        _mm512_storeu_ps(tile + 32 * i, _mm512_add_ps(_mm512_loadu_ps(tile + 32 * i), c##i##0)); \
        _mm512_storeu_ps(tile + 32 * i + 16,                                                \
                        _mm512_add_ps(_mm512_loadu_ps(tile + 32 * i + 16), c##i##1));       \
    }                                                                                      \
    c##i##0 = _mm512_setzero_ps();                                                         \
    c##i##1 = _mm512_setzero_ps();
#define MPT__DCONV_SRC(i, T) const T *s##i = (const T *)(const void *)src[t * MPT__DCONV_MR + i];

MPT__TARGET_AVX512 static void mpt__dconv_tile_f32(const mpt__dconv_job *j,
                                                   const unsigned char *const *src, int64_t o0,
                                                   int nb, float *tile) {
    const int64_t ic = j->ic, oc = j->oc, kc = j->kc;
    const float *w = (const float *)j->w + o0;
    const __mmask16 k0 = mpt__gemm_mask16(nb), k1 = mpt__gemm_mask16(nb - 16);
    int64_t t, c;
    int first = 1;
    MPT__ROWS12(MPT__DCONV_ACC)
    for (t = 0; t < j->taps; t++) {
#define MPT__S(i) MPT__DCONV_SRC(i, float)
        MPT__ROWS12(MPT__S)
#undef MPT__S
        for (c = 0; c < ic;) {
            const int64_t stop = MPT__MIN(ic, c + kc - (t * ic + c) % kc);
            if (nb > 16) {
                for (; c < stop; c++) {
                    const float *wr = w + (t * ic + c) * oc;
                    __m512 b0 = _mm512_maskz_loadu_ps(k0, wr), b1 = _mm512_maskz_loadu_ps(k1, wr + 16);
                    __m512 ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(s##i[c]);                  \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);    \
    c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);
                    MPT__ROWS12(MPT__F)
#undef MPT__F
                }
            } else {
                for (; c < stop; c++) {
                    __m512 b0 = _mm512_maskz_loadu_ps(k0, w + (t * ic + c) * oc), ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(s##i[c]);                  \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);
                    MPT__ROWS12(MPT__F)
#undef MPT__F
                }
            }
            if ((t * ic + c) % kc == 0 || t * ic + c == j->kk) {
                MPT__ROWS12(MPT__DCONV_FOLD)
                first = 0;
            }
        }
    }
}

/* bfloat16 pairs of channels (ic is even), one vdpbf16ps per pair. */
MPT__TARGET_AVX512_BF16 static void mpt__dconv_tile_bf16(const mpt__dconv_job *j,
                                                         const unsigned char *const *src,
                                                         int64_t o0, int nb, float *tile) {
    const int64_t ic = j->ic, oc = j->oc, kc = j->kc;
    const uint32_t *w = (const uint32_t *)j->w + o0;
    const __mmask16 k0 = mpt__gemm_mask16(nb), k1 = mpt__gemm_mask16(nb - 16);
    int64_t t, c;
    int first = 1;
    MPT__ROWS12(MPT__DCONV_ACC)
    for (t = 0; t < j->taps; t++) {
#define MPT__S(i) MPT__DCONV_SRC(i, uint32_t)
        MPT__ROWS12(MPT__S)
#undef MPT__S
        for (c = 0; c < ic;) { /* c counts channels, two at a time */
            const int64_t stop = MPT__MIN(ic, c + kc - (t * ic + c) % kc);
            if (nb > 16) {
                for (; c < stop; c += 2) {
                    const uint32_t *wr = w + (t * ic + c) / 2 * oc;
                    __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(k0, wr);
                    __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(k1, wr + 16);
                    __m512bh ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)s##i[c / 2]);      \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);             \
    c##i##1 = _mm512_dpbf16_ps(c##i##1, ai, b1);
                    MPT__ROWS12(MPT__F)
#undef MPT__F
                }
            } else {
                for (; c < stop; c += 2) {
                    __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(k0, w + (t * ic + c) / 2 * oc);
                    __m512bh ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)s##i[c / 2]);      \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);
                    MPT__ROWS12(MPT__F)
#undef MPT__F
                }
            }
            if ((t * ic + c) % kc == 0 || t * ic + c == j->kk) {
                MPT__ROWS12(MPT__DCONV_FOLD)
                first = 0;
            }
        }
    }
}

/* + bias, then ReLU, on the tile's 12 × 32 sums. */
MPT__TARGET_AVX512 static void mpt__dconv_finish_avx512(float *tile, const float *bias, int relu,
                                                        int nb) {
    const __mmask16 k0 = mpt__gemm_mask16(nb), k1 = mpt__gemm_mask16(nb - 16);
    const __m512 b0 = _mm512_maskz_loadu_ps(bias ? k0 : 0, bias);
    const __m512 b1 = _mm512_maskz_loadu_ps(bias ? k1 : 0, bias ? bias + 16 : NULL);
    int i, h;
    for (i = 0; i < MPT__DCONV_MR; i++)
        for (h = 0; h < 2; h++) {
            float *t = tile + 32 * i + 16 * h;
            __m512 v = _mm512_loadu_ps(t);
            if (bias) v = _mm512_add_ps(v, h ? b1 : b0);
            if (relu)
                v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NLE_UQ), v);
            _mm512_storeu_ps(t, v);
        }
}
#undef MPT__DCONV_FOLD
#undef MPT__DCONV_SRC
#endif /* MPT__X86 */

/* The GEMM path's epilogue for the tile's first m pixels: + bias, the
   activation (forward only; ReLU and the bias as mpt__gemm_store_avx512
   does them), stored in dtype. */
static void mpt__dconv_store(const mpt__dconv_job *j, float *tile, int64_t p0, int m, int64_t o0,
                             int nb) {
    const mpt_conv_args *a = j->a;
    const int other_act = !a->input_grad && a->act != MPT_ACT_NONE && a->act != MPT_ACT_RELU;
    int p;
#if MPT__X86
    if (!a->input_grad)
        mpt__dconv_finish_avx512(tile, a->bias ? a->bias + o0 : NULL, a->act == MPT_ACT_RELU, nb);
#endif
    for (p = 0; p < m; p++) {
        float *row = tile + 32 * p;
        unsigned char *dst = (unsigned char *)a->y + (size_t)((p0 + p) * j->oc + o0) * j->es;
        if (other_act) mpt__activation_forward(a->act, row, nb);
        if (a->dtype == MPT_FLOAT32)
            memcpy(dst, row, sizeof(float) * (size_t)nb);
        else
            j->convert(a->dtype, dst, MPT_FLOAT32, row, nb);
    }
}

/* Tiles [task·TILES_PER_TASK, ...) of the output pixels. */
static void mpt__dconv_task(void *arg, int64_t task, int thread) {
    const mpt__dconv_job *j = (const mpt__dconv_job *)arg;
    const unsigned char *src[MPT__DCONV_MAX_TAPS * MPT__DCONV_MR];
    float tile[MPT__DCONV_MR * 32];
    int64_t tile_i = task * MPT__DCONV_TILES_PER_TASK, o0;
    (void)thread;
    for (; tile_i < (task + 1) * MPT__DCONV_TILES_PER_TASK; tile_i++) {
        const int64_t p0 = tile_i * MPT__DCONV_MR;
        int64_t b = p0 / (j->oh * j->ow), oy = p0 / j->ow % j->oh, ox = p0 % j->ow;
        int m, p;
        if (p0 >= j->pixels) return;
        m = (int)MPT__MIN(MPT__DCONV_MR, j->pixels - p0);
        for (p = 0; p < MPT__DCONV_MR; p++) { /* past the end: the last pixel again */
            mpt__dconv_taps(j, b, oy, ox, src + p);
            if (p + 1 >= m) continue;
            if (++ox == j->ow) {
                ox = 0;
                if (++oy == j->oh) oy = 0, b++;
            }
        }
        for (o0 = 0; o0 < j->oc; o0 += 32) {
            const int nb = (int)MPT__MIN(32, j->oc - o0);
            j->tile(j, src, o0, nb, tile);
            mpt__dconv_store(j, tile, p0, m, o0, nb);
        }
    }
}

/* The kernel gradient without cols: dkernel row k = (tap, c) is the sum
   over the output pixels of x's channel c at that tap times the pixel's
   dz row. A task owns a block of 12 rows (channels c0.. of one tap) by 32
   filters and runs over every pixel in order, so nothing depends on the
   thread count; taps in the padding add nothing and are skipped. Per
   pixel: the 12 channels (bfloat16 widened, exactly) stored once for the
   broadcasts, dz's row (widened) loaded, 24 FMAs. The sums are float32 in
   another order than the GEMM's (not its bits). */
typedef struct mpt__dconv_kgrad_job {
    const mpt_conv_args *a;
    const mpt_window *g;
    int64_t cblocks, fblocks; /* 12-channel and 32-filter blocks */
} mpt__dconv_kgrad_job;

#if MPT__X86
/* 16 bfloat16 (lanes under k; the others 0) as float32: exact. The masked
   forms, as the GEMM's packing writes them (g++ warns of the unmasked
   ones' undefined source). */
MPT__TARGET_AVX512 static __m512 mpt__bf16_widen_avx512(__mmask16 k, const mpt_bf16 *p) {
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(
        k, _mm512_maskz_cvtepu16_epi32(k, _mm256_maskz_loadu_epi16(k, p)), 16));
}

MPT__TARGET_AVX512 static void mpt__dconv_kgrad_tile(const mpt__dconv_kgrad_job *j, int64_t t,
                                                     int64_t c0, int m, int64_t f0, int nb,
                                                     float *tile) {
    const mpt_conv_args *a = j->a;
    const mpt_window *g = j->g;
    const int64_t i = t / g->kw, k = t % g->kw, f = a->f;
    const int bf16 = a->dtype == MPT_BFLOAT16;
    const __mmask16 km = mpt__gemm_mask16(m), k0 = mpt__gemm_mask16(nb),
                    k1 = mpt__gemm_mask16(nb - 16);
    float chans[16];
    int64_t b, oy, ox;
    MPT__ROWS12(MPT__DCONV_ACC)
    for (b = 0; b < a->n; b++)
        for (oy = 0; oy < g->oh; oy++) {
            const int64_t y = oy * g->sh - g->top + i;
            if (y < 0 || y >= g->h) continue;
            for (ox = 0; ox < g->ow; ox++) {
                const int64_t x = ox * g->sw - g->left + k;
                const int64_t src = ((b * g->h + y) * g->w + x) * g->c + c0;
                const int64_t dst = ((b * g->oh + oy) * g->ow + ox) * f + f0;
                __m512 d0, d1, ai;
                if (x < 0 || x >= g->w) continue;
                if (bf16) {
                    _mm512_storeu_ps(chans, mpt__bf16_widen_avx512(km, (const mpt_bf16 *)a->x + src));
                    d0 = mpt__bf16_widen_avx512(k0, (const mpt_bf16 *)a->dz + dst);
                    d1 = mpt__bf16_widen_avx512(k1, (const mpt_bf16 *)a->dz + dst + 16);
                } else {
                    _mm512_storeu_ps(chans, _mm512_maskz_loadu_ps(km, (const float *)a->x + src));
                    d0 = _mm512_maskz_loadu_ps(k0, (const float *)a->dz + dst);
                    d1 = _mm512_maskz_loadu_ps(k1, (const float *)a->dz + dst + 16);
                }
#define MPT__F(r)                                  \
    ai = _mm512_set1_ps(chans[r]);                 \
    c##r##0 = _mm512_fmadd_ps(ai, d0, c##r##0);    \
    c##r##1 = _mm512_fmadd_ps(ai, d1, c##r##1);
                MPT__ROWS12(MPT__F)
#undef MPT__F
            }
        }
#define MPT__S(r)                                  \
    _mm512_storeu_ps(tile + 32 * r, c##r##0);      \
    _mm512_storeu_ps(tile + 32 * r + 16, c##r##1);
    MPT__ROWS12(MPT__S)
#undef MPT__S
}
#undef MPT__DCONV_ACC
#endif

static void mpt__dconv_kgrad_task(void *arg, int64_t task, int thread) {
    const mpt__dconv_kgrad_job *j = (const mpt__dconv_kgrad_job *)arg;
    const mpt_conv_args *a = j->a;
    const int64_t per_tap = j->cblocks * j->fblocks, t = task / per_tap;
    const int64_t c0 = task % per_tap / j->fblocks * MPT__DCONV_MR;
    const int64_t f0 = task % j->fblocks * 32;
    const int m = (int)MPT__MIN(MPT__DCONV_MR, j->g->c - c0), nb = (int)MPT__MIN(32, a->f - f0);
    float tile[MPT__DCONV_MR * 32];
    int r, o;
    (void)thread;
#if MPT__X86
    mpt__dconv_kgrad_tile(j, t, c0, m, f0, nb, tile);
#else
    memset(tile, 0, sizeof tile); /* never called: conv_direct declines first */
#endif
    for (r = 0; r < m; r++) {
        float *row = a->dkernel + (t * j->g->c + c0 + r) * a->f + f0;
        for (o = 0; o < nb; o++) row[o] = a->accumulate ? row[o] + tile[32 * r + o] : tile[32 * r + o];
    }
}

/* conv_direct's kernel_grad: float32 and bfloat16 with AVX-512, at least
   12 channels (fewer would leave most of each tile idle) and at most 32
   filters (with more, each pixel's channels are read once per 32 filters,
   and bench/bench_conv.c measured 0.8-1.0× the GEMM's speed at 64). */
static int mpt__cpu_conv_kernel_grad(mpt_context *ctx, const mpt_conv_args *a) {
    mpt__dconv_kgrad_job j;
    if (!(ctx->cpu & MPT_CPU_AVX512) || a->g->c < MPT__DCONV_MR || a->f > 32 ||
        (a->dtype != MPT_FLOAT32 && a->dtype != MPT_BFLOAT16))
        return 0;
    j.a = a;
    j.g = a->g;
    j.cblocks = (a->g->c + MPT__DCONV_MR - 1) / MPT__DCONV_MR;
    j.fblocks = (a->f + 31) / 32;
    mpt__parallel_for(ctx, a->g->kh * a->g->kw * j.cblocks * j.fblocks, mpt__dconv_kgrad_task, &j);
    return 1;
}

/* The CPU backend's conv_direct: with AVX-512 for float32, with AVX-512
   BF16 for bfloat16 when the channels summed over come in pairs. */
static int mpt__cpu_conv_direct(void *impl, const mpt_conv_args *a) {
    mpt_context *ctx = (mpt_context *)impl;
    const mpt_window *g = a->g;
    mpt__dconv_job j;
    if (a->kernel_grad) return mpt__cpu_conv_kernel_grad(ctx, a);
    memset(&j, 0, sizeof j);
    j.ic = a->input_grad ? a->f : g->c;
#if MPT__X86
    if (a->dtype == MPT_FLOAT32 && (ctx->cpu & MPT_CPU_AVX512))
        j.tile = mpt__dconv_tile_f32;
    else if (a->dtype == MPT_BFLOAT16 && (ctx->cpu & MPT_CPU_AVX512_BF16) && j.ic % 2 == 0)
        j.tile = mpt__dconv_tile_bf16;
#endif
    /* Fewer than 16 outputs per pixel would leave most of each vector idle
       (a first layer's one-channel dx): the GEMM path does better there.
       The input gradient multiplies the zeros of its padding and strides
       too: where dz has under 4/5 of dx's pixels (a small image under
       'valid' padding, any stride 2) col2im, which adds only what is
       there, was as fast or faster in bench/bench_conv.c. */
    if (a->input_grad && 5 * g->oh * g->ow < 4 * g->h * g->w) return 0;
    /* A depth under 32 (a first layer's one-channel 3×3: 9) gives each
       tile's table and epilogue too few multiply-adds to pay for; im2col
       is cheap there (0.9× in bench/bench_conv.c). */
    if (g->kh * g->kw * j.ic < 32) return 0;
    if (!j.tile || (a->input_grad ? g->c : a->f) < 16 || g->kh * g->kw > MPT__DCONV_MAX_TAPS ||
        (!a->input_grad && (a->act == MPT_ACT_GELU || a->act == MPT_ACT_SOFTMAX)))
        return 0;
    j.ctx = ctx;
    j.a = a;
    j.g = g;
    j.x = (const unsigned char *)a->x;
    j.ih = a->input_grad ? g->oh : g->h;
    j.iw = a->input_grad ? g->ow : g->w;
    j.oh = a->input_grad ? g->h : g->oh;
    j.ow = a->input_grad ? g->w : g->ow;
    j.oc = a->input_grad ? g->c : a->f;
    j.taps = g->kh * g->kw;
    j.kk = j.taps * j.ic;
    j.kc = mpt__gemm_depth_block(j.kk);
    j.pixels = a->n * j.oh * j.ow;
    j.es = mpt_dtype_size(a->dtype);
    j.convert = mpt__convert_kernel(ctx->cpu, a->dtype, MPT_FLOAT32);
    mpt__dconv_pack(&j, (unsigned char *)a->ws);
    mpt__parallel_for(ctx,
                      (j.pixels + MPT__DCONV_MR * MPT__DCONV_TILES_PER_TASK - 1) /
                          (MPT__DCONV_MR * MPT__DCONV_TILES_PER_TASK),
                      mpt__dconv_task, &j);
    return 1;
}

/* ---- Conv2D build, forward, backward -------------------------------------- */

static mpt_status mpt__conv2d_build(mpt_model *m, mpt__layer *L) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    mpt__conv_plan c;
    int64_t kshape[4], row_bytes = 0, sample_bytes = 0, direct_bytes = 0, chunk_bytes;
    char s[96];
    MPT__CHECK(mpt__expect_image(m, L));
    kshape[0] = d->kernel_size[0];
    kshape[1] = d->kernel_size[1];
    kshape[2] = L->in_shape[2];
    kshape[3] = d->filters;
    if (mpt__shape_count(4, kshape) < 0) /* checked first: the plan multiplies them */
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "Conv2D '%s': kernel %s is too large",
                         L->name, mpt_shape_format(s, sizeof s, 4, kshape));
    mpt__conv_plan_init(&c, L, m->max_batch);
    MPT__CHECK(mpt__expect_window_fits(m, L, &c.g, "kernel"));
    L->out_rank = 3;
    L->out_shape[0] = c.g.oh;
    L->out_shape[1] = c.g.ow;
    L->out_shape[2] = c.f;
    /* Keras' fans for a conv kernel: the receptive field times channels. */
    MPT__CHECK(mpt__layer_add_param(m, L, "kernel", 4, kshape,
                                    d->kernel_initializer ? d->kernel_initializer
                                                          : MPT_INIT_GLOROT_UNIFORM,
                                    c.kk, c.g.kh * c.g.kw * c.f, 1, L->dtype));
    if (!d->no_bias)
        MPT__CHECK(mpt__layer_add_param(m, L, "bias", 1, &c.f,
                                        d->bias_initializer ? d->bias_initializer
                                                            : MPT_INIT_ZEROS,
                                        c.kk, c.g.kh * c.g.kw * c.f, 1, MPT_FLOAT32));
    if (d->activation == MPT_ACT_GELU) /* z (B, OH, OW, F) */
        MPT__CHECK(mpt__layer_add_saved(m, L, mpt__dbytes(L->dtype, c.pix * c.f), 0));
    /* Per chunk (backward needs the most): dz, tmp (rows, F) f32; dz in
       dtype (rows, F); cols (rows, kk) dtype; dcols (rows, kk) f32; dx
       (chunk, H, W, C) f32; rows = chunk·OH·OW. */
    mpt__acc_mul(&row_bytes, c.f, 8 + (int64_t)c.es);
    mpt__acc_mul(&row_bytes, c.kk, 4 + (int64_t)c.es);
    mpt__acc_mul(&sample_bytes, c.pix, row_bytes);
    mpt__acc_mul(&sample_bytes, L->in_count, 4);
    /* and the backend's direct convolution (MPT_CONV_DIRECT_WS_BYTES) */
    mpt__acc_mul(&direct_bytes, c.kk * c.f, 4); /* kk·F: the kernel, counted above */
    mpt__acc_mul(&direct_bytes, MPT__MAX(c.g.c, c.f), 4);
    mpt__acc_mul(&direct_bytes, 128, 1);
    if (sample_bytes < 0 || direct_bytes < 0 ||
        !mpt__mul_ok(sample_bytes, c.chunk, &chunk_bytes) ||
        !mpt__add_ok(chunk_bytes, direct_bytes, &chunk_bytes))
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "Conv2D '%s': buffers for input %s overflow",
                         L->name, mpt_shape_format(s, sizeof s, 3, L->in_shape));
    return mpt__layer_set_workspace(m, L, 0, mpt__ws_bytes(chunk_bytes, 7));
}

/* The backend's direct convolution (mpt_conv_args) of n samples, where it
   has one for this case; 0: nothing done. */
static int mpt__conv2d_direct(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                              int input_grad, const void *x, void *y, int64_t n, void *ws) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    mpt_conv_args a;
    if (!p->be->conv_direct) return 0;
    memset(&a, 0, sizeof a);
    a.g = &c->g;
    a.dtype = L->dtype;
    a.input_grad = input_grad;
    a.n = n;
    a.f = c->f;
    a.x = x;
    a.kernel = mpt__param_compute_copy(L, 0);
    a.bias = input_grad || d->no_bias ? NULL : mpt__param_master(L, 1);
    a.act = d->activation;
    a.y = y;
    a.ws = ws;
    return p->be->conv_direct(p->impl, &a);
}

/* y rows [b0·pix, (b0 + n)·pix) of the batch. */
static void mpt__conv2d_forward_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                      int64_t b0, int64_t n) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    const int64_t rows = n * c->pix, ny = rows * c->f;
    const int fused = d->activation != MPT_ACT_GELU && d->activation != MPT_ACT_SOFTMAX;
    const unsigned char *x = (const unsigned char *)p->x + (size_t)(b0 * L->in_count) * c->es;
    unsigned char *y = (unsigned char *)p->y + (size_t)(b0 * c->pix * c->f) * c->es;
    mpt__ws w = {(unsigned char *)p->workspace};
    void *cols = c->identity ? NULL : mpt__ws_take(&w, rows * c->kk * (int64_t)c->es);
    const int rounds_c = fused && L->dtype != MPT_FLOAT32 && p->be->gemm_rounds_c;
    float *acc = ((L->dtype == MPT_FLOAT32 || rounds_c) && fused)
                     ? (float *)y
                     : (float *)mpt__ws_take(&w, 4 * ny);
    mpt_gemm_desc g;
    if (fused && mpt__conv2d_direct(L, p, c, 0, x, y, n, p->workspace)) return;
    if (cols) p->be->im2col(p->impl, &c->g, L->dtype, x, n, cols); /* (rows, kk) */
    /* acc (rows, F) = cols · kernel */
    g = mpt__layer_gemm_desc(L, 0, 0, rows, c->f, c->kk,
                             cols ? (const void *)cols : (const void *)x,
                             mpt__param_compute_copy(L, 0), acc);
    g.bias = d->no_bias ? NULL : mpt__param_master(L, 1);
    g.activation = fused ? d->activation : MPT_ACT_NONE;
    mpt__layer_gemm(p, &g, rounds_c ? L->dtype : MPT_FLOAT32);
    if (d->activation == MPT_ACT_GELU) {
        unsigned char *z = (unsigned char *)L->saved[0] + (size_t)(b0 * c->pix * c->f) * c->es;
        p->be->convert(p->impl, L->dtype, z, MPT_FLOAT32, acc, ny);
        p->be->activation(p->impl, MPT_ACT_GELU, acc, rows, c->f);
    } else if (d->activation == MPT_ACT_SOFTMAX) {
        /* over the channels of each pixel */
        p->be->activation(p->impl, MPT_ACT_SOFTMAX, acc, rows, c->f);
    }
    if ((void *)acc != (void *)y) p->be->convert(p->impl, L->dtype, y, MPT_FLOAT32, acc, ny);
}

/* Forward's or backward's chunk function over samples [b0, b0 + n). */
typedef void (*mpt__conv_chunk_fn)(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                   int64_t b0, int64_t n);

/* The batch in chunks of the plan's size, in order. */
static void mpt__conv2d_by_chunks(mpt__layer *L, const mpt__pass *p, mpt__conv_chunk_fn run) {
    mpt__conv_plan c;
    int64_t b0;
    mpt__conv_plan_init(&c, L, p->model->max_batch);
    for (b0 = 0; b0 < p->batch; b0 += c.chunk) run(L, p, &c, b0, MPT__MIN(c.chunk, p->batch - b0));
}

static void mpt__conv2d_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv2d_by_chunks(L, p, mpt__conv2d_forward_chunk);
}


/* dkernel (kk, F) = colsᵀ · dz, added to what the earlier chunks left
   unless this is the first. cols (rows, kk) and dz (rows, F) in dtype. */
static void mpt__conv2d_kernel_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                    const void *cols, const void *dz, int64_t rows, int first) {
    mpt_gemm_desc g = mpt__layer_gemm_desc(L, 1, 0, c->kk, c->f, rows, cols, dz,
                                           mpt__param_grad(L, 0));
    g.beta = first ? 0.0f : 1.0f;
    mpt__layer_gemm(p, &g, MPT_FLOAT32);
}

/* The kernel gradient by the backend's direct convolution, where it has
   one for this case; 0: nothing done. */
static int mpt__conv2d_direct_kernel_grad(mpt__layer *L, const mpt__pass *p,
                                          const mpt__conv_plan *c, const void *x, const void *dz,
                                          int64_t n, int first) {
    mpt_conv_args a;
    if (!p->be->conv_direct) return 0;
    memset(&a, 0, sizeof a);
    a.g = &c->g;
    a.dtype = L->dtype;
    a.kernel_grad = 1;
    a.n = n;
    a.f = c->f;
    a.x = x;
    a.dz = dz;
    a.dkernel = mpt__param_grad(L, 0);
    a.accumulate = !first;
    return p->be->conv_direct(p->impl, &a);
}

/* dcols (rows, kk) float32 = dz · kernelᵀ; dz (rows, F) in dtype. */
static void mpt__conv2d_cols_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                  const void *dz, int64_t rows, float *dcols) {
    mpt_gemm_desc g = mpt__layer_gemm_desc(L, 0, 1, rows, c->kk, c->f, dz,
                                           mpt__param_compute_copy(L, 0), dcols);
    mpt__layer_gemm(p, &g, MPT_FLOAT32);
}

/* Adds this chunk's share to the kernel and bias gradients (the first
   chunk overwrites them) and writes its samples' dx. */
static void mpt__conv2d_backward_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                       int64_t b0, int64_t n) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    const int64_t rows = n * c->pix, ny = rows * c->f, y_off = b0 * c->pix * c->f;
    const int f32 = L->dtype == MPT_FLOAT32;
    const unsigned char *x = (const unsigned char *)p->x + (size_t)(b0 * L->in_count) * c->es;
    unsigned char *dx = p->dx ? (unsigned char *)p->dx + (size_t)(b0 * L->in_count) * c->es : NULL;
    const void *z = d->activation == MPT_ACT_GELU
                        ? (const unsigned char *)L->saved[0] + (size_t)y_off * c->es : NULL;
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * ny);                          /* (rows, F) */
    float *tmp = (float *)mpt__ws_take(&w, 4 * ny);                         /* (rows, F) */
    void *dz_c = f32 ? (void *)dz : mpt__ws_take(&w, ny * (int64_t)c->es); /* (rows, F) */
    void *cols = c->identity ? NULL : mpt__ws_take(&w, rows * c->kk * (int64_t)c->es);
    float *dcols = (float *)mpt__ws_take(&w, 4 * rows * c->kk);  /* (rows, kk) */
    float *dxf = (float *)mpt__ws_take(&w, 4 * n * L->in_count); /* (n, H, W, C) */
    void *direct_ws = mpt__ws_take(&w, MPT_CONV_DIRECT_WS_BYTES(c->kk, c->g.c, c->f));
    p->be->activation_grad(p->impl, d->activation, L->dtype, z,
                           (const unsigned char *)p->y + (size_t)y_off * c->es,
                           (const unsigned char *)p->dy + (size_t)y_off * c->es, dz, tmp, rows,
                           c->f);
    if (!d->no_bias) p->be->column_sums(p->impl, dz, rows, c->f, mpt__param_grad(L, 1), b0 != 0);
    /* The products run in the compute dtype, as the forward did. */
    if (dz_c != (void *)dz) p->be->convert(p->impl, L->dtype, dz_c, MPT_FLOAT32, dz, ny);
    if (!mpt__conv2d_direct_kernel_grad(L, p, c, x, dz_c, n, b0 == 0)) {
        if (cols) /* recomputed: cheaper than keeping it */
            p->be->im2col(p->impl, &c->g, L->dtype, x, n, cols);
        mpt__conv2d_kernel_grad(L, p, c, cols ? (const void *)cols : (const void *)x, dz_c, rows,
                                b0 == 0);
    }
    if (!dx || mpt__conv2d_direct(L, p, c, 1, dz_c, dx, n, direct_ws)) return;
    if (!c->identity) {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        p->be->col2im(p->impl, &c->g, L->dtype, dcols, n, dxf, dx);
    } else if (f32) { /* dcols is dx */
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, (float *)dx);
    } else {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        p->be->convert(p->impl, L->dtype, dx, MPT_FLOAT32, dcols, n * L->in_count);
    }
}

static void mpt__conv2d_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv2d_by_chunks(L, p, mpt__conv2d_backward_chunk);
}

static const mpt__layer_ops mpt__conv2d_ops = {"Conv2D", "conv2d", mpt__conv2d_build,
                                               mpt__conv2d_forward, mpt__conv2d_backward, NULL,
                                               NULL};

MPTDEF mpt_status mpt_model_add_conv2d(mpt_model *m, const mpt_conv2d_desc *d) {
    mpt_conv2d_desc defaults;
    MPT__CHECK(mpt__check_add(m));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    if (d->filters <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: filters %lld must be > 0",
                         (long long)d->filters);
    MPT__CHECK(mpt__check_window_desc(m, "Conv2D", "kernel_size", d->kernel_size, 1, d->strides,
                                      d->padding));
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: unknown activation %d",
                         (int)d->activation);
    if (!mpt__initializer_valid(d->kernel_initializer) ||
        !mpt__initializer_valid(d->bias_initializer))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: unknown initializer %d",
                         (int)(mpt__initializer_valid(d->kernel_initializer)
                                   ? d->bias_initializer
                                   : d->kernel_initializer));
    return mpt__add_layer(m, &mpt__conv2d_ops, d, sizeof(mpt_conv2d_desc));
}

/* =============================================================================
   @impl-pooling  MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D
           x: (B, H, W, C)  y: (B, OH, OW, C)   (global: y (B, C))
   =============================================================================

   One task per sample; each reads its sample in float32 (converted into
   its own part of the workspace unless the layer is float32) and writes
   only its own output, so nothing depends on the thread count.
   Max: the first largest value of each window wins (as TensorFlow), a NaN
   wins over any number (so non-finite values reach the loss), and its
   index within the sample is saved (int32) for backward.
   Average: the mean of the window's pixels inside the image (Keras does
   not count 'same' padding). Global average pooling is average pooling
   with one window the size of the image. */

/* The window of MaxPooling2D and AveragePooling2D, from their descriptor. */
static void mpt__pool_win(mpt__win *g, const mpt__layer *L) {
    const mpt_pool2d_desc *d = &L->desc.pool2d;
    int64_t size[2], strides[2];
    size[0] = d->pool_size[0] ? d->pool_size[0] : 2;
    size[1] = d->pool_size[1] ? d->pool_size[1] : 2;
    strides[0] = d->strides[0] ? d->strides[0] : size[0];
    strides[1] = d->strides[1] ? d->strides[1] : size[1];
    mpt__win_init(g, L, size, strides, d->padding);
}

/* GlobalAveragePooling2D's: one window the size of the image. */
static void mpt__global_pool_win(mpt__win *g, const mpt__layer *L) {
    int64_t size[2];
    size[0] = L->in_shape[0];
    size[1] = L->in_shape[1];
    mpt__win_init(g, L, size, size, MPT_PADDING_VALID);
}

/* The window of a pooling layer (mpt__pool_win or mpt__global_pool_win). */
typedef void (*mpt__pool_window_fn)(mpt__win *g, const mpt__layer *L);

/* Every pooling layer's build: its window checked, its (OH, OW, C)
   output, max's saved argmax and the backend's workspace. */
static mpt_status mpt__pool_build(mpt_model *m, mpt__layer *L, mpt_pool_kind kind,
                                  mpt__pool_window_fn window) {
    mpt__win g;
    int64_t out_count;
    MPT__CHECK(mpt__expect_image(m, L));
    window(&g, L);
    MPT__CHECK(mpt__expect_window_fits(m, L, &g, "pool_size"));
    L->out_rank = 3;
    L->out_shape[0] = g.oh;
    L->out_shape[1] = g.ow;
    L->out_shape[2] = g.c;
    out_count = g.oh * g.ow * g.c; /* ≤ in_count: windows start inside the image */
    if (kind == MPT_POOL_MAX) {
        if (L->in_count > INT32_MAX)
            return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                             "MaxPooling2D '%s': %lld elements per sample do not fit the int32 "
                             "indices it saves", L->name, (long long)L->in_count);
        MPT__CHECK(mpt__layer_add_saved(m, L, 4 * out_count, 0)); /* argmax (B, OH, OW, C) */
    }
    {
        void *impl;
        const mpt_backend *be = mpt_context_backend(m->ctx, &impl);
        /* the backend's need for one sample, times the batch (overflow-checked) */
        return mpt__layer_set_workspace(m, L, be->pool_workspace(impl, &g, 1), 0);
    }
}

static mpt_status mpt__max_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT_POOL_MAX, mpt__pool_win);
}
static mpt_status mpt__avg_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT_POOL_AVERAGE, mpt__pool_win);
}
/* Its one window leaves (1, 1, C): the layer gives (C). */
static mpt_status mpt__global_pool_build(mpt_model *m, mpt__layer *L) {
    MPT__CHECK(mpt__pool_build(m, L, MPT_POOL_AVERAGE, mpt__global_pool_win));
    L->out_rank = 1;
    L->out_shape[0] = L->out_shape[2];
    L->out_shape[1] = L->out_shape[2] = 0; /* past the rank */
    return MPT_OK;
}

typedef struct mpt__pool_job {
    const mpt_context *ctx;
    mpt__win g;
    mpt_pool_kind kind;
    mpt_dtype dtype;
    size_t es;
    int64_t n_in, n_out;     /* elements of one input / output sample      */
    const void *x;           /* forward: (B, H, W, C) dtype                 */
    void *y;                 /* forward: (B, OH, OW, C) dtype               */
    const void *dy;          /* backward: (B, OH, OW, C) dtype              */
    void *dx;                /* backward: (B, H, W, C) dtype                */
    int32_t *argmax;         /* max: (B, OH, OW, C) index into the sample   */
    float *ws;               /* (B, n_in + n_out) float32                   */
} mpt__pool_job;

static void mpt__pool_job_init(mpt__pool_job *j, void *impl, mpt_pool_kind kind,
                               const mpt_window *g, mpt_dtype dtype, int32_t *argmax, void *ws) {
    memset(j, 0, sizeof *j);
    j->ctx = (const mpt_context *)impl;
    j->g = *g;
    j->kind = kind;
    j->dtype = dtype;
    j->es = mpt_dtype_size(dtype);
    j->n_in = g->h * g->w * g->c;
    j->n_out = g->oh * g->ow * g->c;
    j->argmax = kind == MPT_POOL_MAX ? argmax : NULL;
    j->ws = (float *)ws;
}

/* Element `at` of a dtype array, as a byte pointer. */
static const void *mpt__elem(const void *base, int64_t at, size_t es) {
    return (const unsigned char *)base + (size_t)at * es;
}

/* Sample b of `src` (n elements of dtype) in float32: src itself when the
   dtype is float32, else converted into buf. */
static const float *mpt__as_f32(const mpt_context *ctx, mpt_dtype dtype, const void *src,
                                int64_t b, int64_t n, float *buf) {
    const void *s = mpt__elem(src, b * n, mpt_dtype_size(dtype));
    if (dtype == MPT_FLOAT32) return (const float *)s;
    mpt__convert(ctx, MPT_FLOAT32, buf, dtype, s, n);
    return buf;
}

/* Whether v replaces best as a window's maximum: larger, or NaN over a
   number (the first largest wins; the first NaN wins). */
static int mpt__max_takes(float v, float best) {
    return (v > best) | ((v != v) & (best == best));
}

/* Max pooling takes the channels this many at a time in fixed-length loops
   without branches, which -O2 vectorizes: a branch on each element
   mispredicts on about half of ReLU's outputs and used to cost more than
   the convolution before it. */
#define MPT__POOL_LANES 16

/* mpt__max_window's channels [e0, e0 + MPT__POOL_LANES). */
static void mpt__max_window_lanes(const mpt__win *g, const float *x, int64_t r0, int64_t r1,
                                  int64_t c0, int64_t c1, int64_t e0, float *y, int32_t *arg) {
    float best[MPT__POOL_LANES];
    int32_t where[MPT__POOL_LANES];
    int64_t r, q;
    int k;
    for (k = 0; k < MPT__POOL_LANES; k++) {
        best[k] = -INFINITY;
        where[k] = (int32_t)((r0 * g->w + c0) * g->c + e0 + k);
    }
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++) {
            const int64_t at = (r * g->w + q) * g->c + e0;
            const float *px = x + at;
            for (k = 0; k < MPT__POOL_LANES; k++) {
                const int take = mpt__max_takes(px[k], best[k]);
                best[k] = take ? px[k] : best[k];
                where[k] = take ? (int32_t)(at + k) : where[k];
            }
        }
    memcpy(y + e0, best, sizeof best);
    memcpy(arg + e0, where, sizeof where);
}

/* y[c] = max of the window's pixels (first wins; NaN wins), arg[c] = where. */
static void mpt__max_window(const mpt__win *g, const float *x, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, float *y, int32_t *arg) {
    int64_t r, q, e, e0;
    for (e0 = 0; e0 + MPT__POOL_LANES <= g->c; e0 += MPT__POOL_LANES)
        mpt__max_window_lanes(g, x, r0, r1, c0, c1, e0, y, arg);
    for (e = e0; e < g->c; e++) { /* the channels left over */
        y[e] = -INFINITY;
        arg[e] = (int32_t)((r0 * g->w + c0) * g->c + e);
    }
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++) {
            const int64_t at = (r * g->w + q) * g->c;
            for (e = e0; e < g->c; e++) {
                const int take = mpt__max_takes(x[at + e], y[e]);
                y[e] = take ? x[at + e] : y[e];
                arg[e] = take ? (int32_t)(at + e) : arg[e];
            }
        }
}

/* y[c] = mean of the window's pixels inside the image. */
static void mpt__avg_window(const mpt__win *g, const float *x, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, float *y) {
    const float inv = 1.0f / (float)((r1 - r0) * (c1 - c0));
    int64_t r, q, e;
    for (e = 0; e < g->c; e++) y[e] = 0;
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++)
            for (e = 0; e < g->c; e++) y[e] += x[(r * g->w + q) * g->c + e];
    for (e = 0; e < g->c; e++) y[e] *= inv;
}

static void mpt__pool_forward_task(void *arg, int64_t b, int thread) {
    const mpt__pool_job *j = (const mpt__pool_job *)arg;
    const mpt__win *g = &j->g;
    float *xbuf = j->ws + b * (j->n_in + j->n_out); /* (H, W, C)    */
    float *ybuf = xbuf + j->n_in;                   /* (OH, OW, C) */
    const float *x = mpt__as_f32(j->ctx, j->dtype, j->x, b, j->n_in, xbuf);
    float *y = j->dtype == MPT_FLOAT32 ? (float *)j->y + b * j->n_out : ybuf;
    int64_t oy, ox, r0, r1, c0, c1;
    (void)thread;
    for (oy = 0; oy < g->oh; oy++)
        for (ox = 0; ox < g->ow; ox++) {
            const int64_t at = (oy * g->ow + ox) * g->c;
            mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
            if (j->kind == MPT_POOL_MAX)
                mpt__max_window(g, x, r0, r1, c0, c1, y + at, j->argmax + b * j->n_out + at);
            else
                mpt__avg_window(g, x, r0, r1, c0, c1, y + at);
        }
    if (y == ybuf)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->y + (size_t)(b * j->n_out) * j->es,
                     MPT_FLOAT32, ybuf, j->n_out);
}

/* dx of sample b: each output's gradient goes back to the pixel that won
   (max) or is shared by the window's pixels (average), outputs in order. */
static void mpt__pool_backward_task(void *arg, int64_t b, int thread) {
    const mpt__pool_job *j = (const mpt__pool_job *)arg;
    const mpt__win *g = &j->g;
    float *dybuf = j->ws + b * (j->n_in + j->n_out); /* (OH, OW, C) */
    float *dxbuf = dybuf + j->n_out;                 /* (H, W, C)   */
    const float *dy = mpt__as_f32(j->ctx, j->dtype, j->dy, b, j->n_out, dybuf);
    float *dx = j->dtype == MPT_FLOAT32 ? (float *)j->dx + b * j->n_in : dxbuf;
    int64_t oy, ox, r0, r1, c0, c1, r, q, e;
    (void)thread;
    memset(dx, 0, sizeof(float) * (size_t)j->n_in);
    if (j->kind == MPT_POOL_MAX) {
        const int32_t *arg_b = j->argmax + b * j->n_out;
        for (e = 0; e < j->n_out; e++) dx[arg_b[e]] += dy[e];
    } else {
        for (oy = 0; oy < g->oh; oy++)
            for (ox = 0; ox < g->ow; ox++) {
                const float *d = dy + (oy * g->ow + ox) * g->c;
                float inv;
                mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
                inv = 1.0f / (float)((r1 - r0) * (c1 - c0));
                for (r = r0; r < r1; r++)
                    for (q = c0; q < c1; q++)
                        for (e = 0; e < g->c; e++) dx[(r * g->w + q) * g->c + e] += d[e] * inv;
            }
    }
    if (dx == dxbuf)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->dx + (size_t)(b * j->n_in) * j->es,
                     MPT_FLOAT32, dxbuf, j->n_in);
}

/* The CPU backend's pooling (mpt_backend.pool_forward, pool_backward,
   pool_workspace): one task per sample. */
static void mpt__cpu_pool_forward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                                  mpt_dtype dtype, const void *x, void *y, int32_t *argmax,
                                  int64_t n, void *ws) {
    mpt__pool_job j;
    mpt__pool_job_init(&j, impl, kind, g, dtype, argmax, ws);
    j.x = x;
    j.y = y;
    mpt__parallel_for((mpt_context *)impl, n, mpt__pool_forward_task, &j);
}

static void mpt__cpu_pool_backward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                                   mpt_dtype dtype, const void *dy, void *dx,
                                   const int32_t *argmax, int64_t n, void *ws) {
    mpt__pool_job j;
    mpt__pool_job_init(&j, impl, kind, g, dtype, (int32_t *)argmax, ws);
    j.dy = dy;
    j.dx = dx;
    mpt__parallel_for((mpt_context *)impl, n, mpt__pool_backward_task, &j);
}

/* Per sample, float32: forward x and y, backward dy and dx. */
static int64_t mpt__cpu_pool_workspace(void *impl, const mpt_window *g, int64_t n) {
    (void)impl;
    return 4 * n * (g->h * g->w * g->c + g->oh * g->ow * g->c) + MPT__ALIGN;
}

/* Forward and backward of any pooling layer over the window that `window`
   gives it. */
static void mpt__pool_forward(mpt__layer *L, const mpt__pass *p, mpt_pool_kind kind,
                              mpt__pool_window_fn window) {
    mpt__win g;
    window(&g, L);
    p->be->pool_forward(p->impl, kind, &g, L->dtype, p->x, p->y,
                        kind == MPT_POOL_MAX ? (int32_t *)L->saved[0] : NULL, p->batch,
                        p->workspace);
}

static void mpt__pool_backward(mpt__layer *L, const mpt__pass *p, mpt_pool_kind kind,
                               mpt__pool_window_fn window) {
    mpt__win g;
    if (!p->dx) return; /* no parameters: only dx to compute */
    window(&g, L);
    p->be->pool_backward(p->impl, kind, &g, L->dtype, p->dy, p->dx,
                         kind == MPT_POOL_MAX ? (const int32_t *)L->saved[0] : NULL, p->batch,
                         p->workspace);
}

static void mpt__max_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT_POOL_MAX, mpt__pool_win);
}
static void mpt__max_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT_POOL_MAX, mpt__pool_win);
}
static void mpt__avg_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT_POOL_AVERAGE, mpt__pool_win);
}
static void mpt__avg_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT_POOL_AVERAGE, mpt__pool_win);
}
static void mpt__global_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT_POOL_AVERAGE, mpt__global_pool_win);
}
static void mpt__global_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT_POOL_AVERAGE, mpt__global_pool_win);
}

static const mpt__layer_ops mpt__max_pool_ops = {"MaxPooling2D", "max_pooling2d",
                                                 mpt__max_pool_build, mpt__max_pool_forward,
                                                 mpt__max_pool_backward, NULL, NULL};
static const mpt__layer_ops mpt__avg_pool_ops = {"AveragePooling2D", "average_pooling2d",
                                                 mpt__avg_pool_build, mpt__avg_pool_forward,
                                                 mpt__avg_pool_backward, NULL, NULL};
static const mpt__layer_ops mpt__global_pool_ops = {
    "GlobalAveragePooling2D", "global_average_pooling2d", mpt__global_pool_build,
    mpt__global_pool_forward, mpt__global_pool_backward, NULL, NULL};

/* MaxPooling2D or AveragePooling2D (ops), its descriptor checked. */
static mpt_status mpt__add_pool(mpt_model *m, const mpt__layer_ops *ops, const mpt_pool2d_desc *d) {
    mpt_pool2d_desc defaults;
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    MPT__CHECK(mpt__check_add(m));
    MPT__CHECK(mpt__check_window_desc(m, ops->class_name, "pool_size", d->pool_size, 0, d->strides,
                                      d->padding));
    return mpt__add_layer(m, ops, d, sizeof(mpt_pool2d_desc));
}

MPTDEF mpt_status mpt_model_add_max_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    return mpt__add_pool(m, &mpt__max_pool_ops, d);
}

MPTDEF mpt_status mpt_model_add_average_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    return mpt__add_pool(m, &mpt__avg_pool_ops, d);
}

MPTDEF mpt_status mpt_model_add_global_average_pooling2d(mpt_model *m,
                                                         const mpt_global_pool2d_desc *d) {
    mpt_global_pool2d_desc none;
    MPT__CHECK(m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT);
    memset(&none, 0, sizeof none);
    return mpt__add_layer(m, &mpt__global_pool_ops, d ? d : &none,
                          sizeof(mpt_global_pool2d_desc));
}
/* =============================================================================
   @impl-batchnorm  BatchNormalization: each channel (the last axis)
   normalised over the batch and every spatial position
                                         x, y: (B, ..., C)   parameters: (C)
   =============================================================================

   As Keras 3: the statistics and the arithmetic are float32 whatever the
   layer's dtype ("BN is prone to overflow" in float16); only x and y are
   stored in the compute dtype. Training normalises with the batch mean and
   the biased batch variance; `commit` then folds them into the moving ones
       moving = moving · momentum + batch · (1 − momentum),
   kept out of forward so that a skipped training step changes nothing.
   Inference normalises with the moving statistics.

   The rows (B · positions, C) are summed in chunks of a fixed number of rows,
   one task per chunk; each chunk keeps its own per-channel sums (in double)
   and the chunks are added in order, so the statistics are the same whatever
   the thread count. */

#define MPT__BN_CHUNK ((int64_t)1 << 14) /* elements one task sums (whole rows) */

/* Parameter slots (Keras order: gamma, beta, moving_mean, moving_variance;
   gamma and beta only when used). */
static int mpt__bn_gamma_slot(const mpt__layer *L) { return L->desc.batchnorm.no_scale ? -1 : 0; }
static int mpt__bn_beta_slot(const mpt__layer *L) {
    return L->desc.batchnorm.no_center ? -1 : !L->desc.batchnorm.no_scale;
}
static int mpt__bn_moving_slot(const mpt__layer *L) { /* moving_variance is the next one */
    return !L->desc.batchnorm.no_scale + !L->desc.batchnorm.no_center;
}

static float mpt__bn_momentum(const mpt__layer *L) {
    return L->desc.batchnorm.momentum != 0 ? L->desc.batchnorm.momentum : 0.99f;
}
static float mpt__bn_epsilon(const mpt__layer *L) {
    return L->desc.batchnorm.epsilon != 0 ? L->desc.batchnorm.epsilon : 1e-3f;
}

/* 1 / sqrt(var + eps), the same in forward and backward. */
static float mpt__bn_inv_std(double var, float epsilon) {
    return (float)(1.0 / sqrt(var + (double)epsilon));
}

/* How the rows of one batch are split into tasks. */
typedef struct mpt__bn_plan {
    int64_t channels;   /* C                                   */
    int64_t rows;       /* B · positions                       */
    int64_t chunk_rows; /* rows per task: about MPT__BN_CHUNK elements */
    int64_t n_chunks;
} mpt__bn_plan;

static mpt__bn_plan mpt__bn_plan_rows(int64_t rows, int64_t channels) {
    mpt__bn_plan pl;
    pl.channels = channels;
    pl.rows = rows;
    pl.chunk_rows = MPT__MAX(1, MPT__BN_CHUNK / pl.channels);
    pl.n_chunks = (pl.rows + pl.chunk_rows - 1) / pl.chunk_rows;
    return pl;
}

/* The pieces of the workspace, in the order they are carved. */
typedef struct mpt__bn_ws {
    float *xf;    /* (rows, C) x in float32; the input itself when float32 */
    float *dyf;   /* (rows, C) dy in float32; likewise                      */
    double *part; /* (n_chunks, 2, C) each chunk's two per-channel sums      */
    double *sum;  /* (2, C) the chunks' sums added in order                  */
    float *coef;  /* (4, C) per-channel coefficients of the elementwise pass */
} mpt__bn_ws;

#define MPT__BN_WS_PIECES 5

static mpt__bn_ws mpt__bn_ws_carve(const mpt_batchnorm_args *a, const mpt__bn_plan *pl) {
    mpt__ws w = {(unsigned char *)a->workspace};
    int64_t n = pl->rows * pl->channels;
    int copy = a->dtype != MPT_FLOAT32; /* float32 is read where it lies (never written) */
    mpt__bn_ws b;
    b.xf = copy ? (float *)mpt__ws_take(&w, 4 * n) : (float *)a->x;
    b.dyf = copy ? (float *)mpt__ws_take(&w, 4 * n) : (float *)a->dy;
    b.part = (double *)mpt__ws_take(&w, 16 * pl->n_chunks * pl->channels);
    b.sum = (double *)mpt__ws_take(&w, 16 * pl->channels);
    b.coef = (float *)mpt__ws_take(&w, 16 * pl->channels);
    return b;
}

/* One pass over the rows, chunk by chunk. Reductions write part[chunk];
   elementwise passes write out. */
typedef struct mpt__bn_job {
    mpt__bn_plan plan;
    const float *x;            /* (rows, C)                                   */
    const float *dy;           /* (rows, C) backward only                     */
    float *out;                /* (rows, C) y or dx; may be x or dy (in place) */
    double *part;              /* (n_chunks, 2, C)                            */
    const float *mean;         /* (C) the mean subtracted from x              */
    const float *scale;        /* (C) gamma · inv_std                         */
    const float *beta;         /* (C) forward: added last (0 without beta)    */
    const float *inv_std;      /* (C) backward: 1 / sqrt(var + eps)           */
    const float *mean_dy;      /* (C) backward: mean of dy                    */
    const float *mean_dy_xhat; /* (C) backward: mean of dy · x̂                */
} mpt__bn_job;

/* The rows [*r0, *r1) of a chunk. */
static void mpt__bn_chunk(const mpt__bn_plan *pl, int64_t chunk, int64_t *r0, int64_t *r1) {
    *r0 = chunk * pl->chunk_rows;
    *r1 = MPT__MIN(pl->rows, *r0 + pl->chunk_rows);
}

/* part[chunk][0][c] = Σ x. */
static void mpt__bn_sum_task(void *arg, int64_t chunk, int thread) {
    const mpt__bn_job *j = (const mpt__bn_job *)arg;
    int64_t C = j->plan.channels, r, r0, r1, c;
    double *s = j->part + 2 * C * chunk;
    (void)thread;
    mpt__bn_chunk(&j->plan, chunk, &r0, &r1);
    for (c = 0; c < C; c++) s[c] = 0;
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c++) s[c] += j->x[r * C + c];
}

/* part[chunk][1][c] = Σ (x − mean)²: the second pass of a two-pass variance,
   which keeps its precision when |mean| is large against the spread. */
static void mpt__bn_sqdev_task(void *arg, int64_t chunk, int thread) {
    const mpt__bn_job *j = (const mpt__bn_job *)arg;
    int64_t C = j->plan.channels, r, r0, r1, c;
    double *s = j->part + 2 * C * chunk + C;
    (void)thread;
    mpt__bn_chunk(&j->plan, chunk, &r0, &r1);
    for (c = 0; c < C; c++) s[c] = 0;
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c++) {
            double d = (double)j->x[r * C + c] - j->mean[c];
            s[c] += d * d;
        }
}

/* y = (x − mean) · gamma · inv_std + beta. */
static void mpt__bn_normalize_task(void *arg, int64_t chunk, int thread) {
    const mpt__bn_job *j = (const mpt__bn_job *)arg;
    int64_t C = j->plan.channels, r, r0, r1, c;
    (void)thread;
    mpt__bn_chunk(&j->plan, chunk, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c++)
            j->out[r * C + c] = (j->x[r * C + c] - j->mean[c]) * j->scale[c] + j->beta[c];
}

/* part[chunk][0][c] = Σ dy, part[chunk][1][c] = Σ dy · x̂. */
static void mpt__bn_grad_sums_task(void *arg, int64_t chunk, int thread) {
    const mpt__bn_job *j = (const mpt__bn_job *)arg;
    int64_t C = j->plan.channels, r, r0, r1, c;
    double *s = j->part + 2 * C * chunk;
    (void)thread;
    mpt__bn_chunk(&j->plan, chunk, &r0, &r1);
    for (c = 0; c < 2 * C; c++) s[c] = 0;
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c++) {
            float dy = j->dy[r * C + c], xhat = (j->x[r * C + c] - j->mean[c]) * j->inv_std[c];
            s[c] += dy;
            s[C + c] += (double)dy * xhat;
        }
}

/* dx = gamma · inv_std · (dy − mean(dy) − x̂ · mean(dy · x̂)): the batch
   statistics depend on x too, which gives the two subtracted terms. */
static void mpt__bn_dx_task(void *arg, int64_t chunk, int thread) {
    const mpt__bn_job *j = (const mpt__bn_job *)arg;
    int64_t C = j->plan.channels, r, r0, r1, c;
    (void)thread;
    mpt__bn_chunk(&j->plan, chunk, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c++) {
            float xhat = (j->x[r * C + c] - j->mean[c]) * j->inv_std[c];
            j->out[r * C + c] =
                j->scale[c] * (j->dy[r * C + c] - j->mean_dy[c] - xhat * j->mean_dy_xhat[c]);
        }
}

/* sum[c] = Σ over chunks, in chunk order, of part[chunk][which][c]. */
static void mpt__bn_combine(const mpt__bn_plan *pl, const double *part, int which, double *sum) {
    int64_t C = pl->channels, k, c;
    for (c = 0; c < C; c++) sum[c] = 0;
    for (k = 0; k < pl->n_chunks; k++)
        for (c = 0; c < C; c++) sum[c] += part[(2 * k + which) * C + c];
}

/* The batch mean and biased variance into a->mean and a->variance. */
static void mpt__bn_batch_stats(mpt_context *ctx, const mpt_batchnorm_args *a, mpt__bn_job *j,
                                const mpt__bn_ws *w) {
    int64_t C = j->plan.channels, c;
    mpt__parallel_for(ctx, j->plan.n_chunks, mpt__bn_sum_task, j);
    mpt__bn_combine(&j->plan, w->part, 0, w->sum);
    for (c = 0; c < C; c++) a->mean[c] = (float)(w->sum[c] / (double)j->plan.rows);
    j->mean = a->mean;
    mpt__parallel_for(ctx, j->plan.n_chunks, mpt__bn_sqdev_task, j);
    mpt__bn_combine(&j->plan, w->part, 1, w->sum + C);
    for (c = 0; c < C; c++) a->variance[c] = (float)(w->sum[C + c] / (double)j->plan.rows);
}

/* The CPU backend's BatchNormalization forward (mpt_backend.batchnorm_forward). */
static void mpt__cpu_batchnorm_forward(void *impl, const mpt_batchnorm_args *a) {
    mpt_context *ctx = (mpt_context *)impl;
    mpt__bn_plan pl = mpt__bn_plan_rows(a->rows, a->channels);
    mpt__bn_ws w = mpt__bn_ws_carve(a, &pl);
    int64_t C = pl.channels, n = pl.rows * C, c;
    float *scale = w.coef, *beta = w.coef + C; /* (C) each */
    const float *mean, *var;
    mpt__bn_job j;
    memset(&j, 0, sizeof j);
    j.plan = pl;
    j.part = w.part;
    if ((void *)w.xf != a->x) mpt__convert(ctx, MPT_FLOAT32, w.xf, a->dtype, a->x, n);
    j.x = w.xf;
    if (a->training) {
        mpt__bn_batch_stats(ctx, a, &j, &w);
        mean = a->mean;
        var = a->variance;
    } else {
        mean = a->moving_mean;
        var = a->moving_variance;
    }
    for (c = 0; c < C; c++) {
        scale[c] = (a->gamma ? a->gamma[c] : 1.0f) * mpt__bn_inv_std(var[c], a->epsilon);
        beta[c] = a->beta ? a->beta[c] : 0.0f;
    }
    j.mean = mean;
    j.scale = scale;
    j.beta = beta;
    /* float32 writes y directly; otherwise y goes over the float32 copy of
       x (backward reads the layer's input, not this copy) and is rounded. */
    j.out = a->dtype == MPT_FLOAT32 ? (float *)a->y : w.xf;
    mpt__parallel_for(ctx, pl.n_chunks, mpt__bn_normalize_task, &j);
    if ((void *)j.out != a->y) mpt__convert(ctx, a->dtype, a->y, MPT_FLOAT32, j.out, n);
}

/* Folds the batch statistics of the last training forward into the moving
   ones (Keras: the biased batch variance, as measured), if the step that
   measured them was applied. */
static void mpt__cpu_batchnorm_commit(void *impl, const mpt_batchnorm_args *a,
                                      const mpt_step_state *state) {
    double mom = a->momentum;
    int64_t c;
    (void)impl;
    if (!state->finite) return;
    for (c = 0; c < a->channels; c++) {
        a->moving_mean[c] = (float)(a->moving_mean[c] * mom + a->mean[c] * (1 - mom));
        a->moving_variance[c] = (float)(a->moving_variance[c] * mom + a->variance[c] * (1 - mom));
    }
}

static void mpt__cpu_batchnorm_backward(void *impl, const mpt_batchnorm_args *a) {
    mpt_context *ctx = (mpt_context *)impl;
    mpt__bn_plan pl = mpt__bn_plan_rows(a->rows, a->channels);
    mpt__bn_ws w = mpt__bn_ws_carve(a, &pl);
    int64_t C = pl.channels, n = pl.rows * C, c;
    float *scale = w.coef, *inv_std = w.coef + C, *mdy = inv_std + C, *mdyx = mdy + C; /* (C) */
    mpt__bn_job j;
    memset(&j, 0, sizeof j);
    j.plan = pl;
    j.part = w.part;
    if ((void *)w.xf != a->x) mpt__convert(ctx, MPT_FLOAT32, w.xf, a->dtype, a->x, n);
    if ((void *)w.dyf != a->dy) mpt__convert(ctx, MPT_FLOAT32, w.dyf, a->dtype, a->dy, n);
    j.x = w.xf;
    j.dy = w.dyf;
    j.mean = a->mean;
    for (c = 0; c < C; c++) {
        inv_std[c] = mpt__bn_inv_std(a->variance[c], a->epsilon);
        scale[c] = (a->gamma ? a->gamma[c] : 1.0f) * inv_std[c];
    }
    j.inv_std = inv_std;
    mpt__parallel_for(ctx, pl.n_chunks, mpt__bn_grad_sums_task, &j);
    mpt__bn_combine(&pl, w.part, 0, w.sum);
    mpt__bn_combine(&pl, w.part, 1, w.sum + C);
    for (c = 0; c < C; c++) { /* dbeta = Σ dy, dgamma = Σ dy · x̂ */
        if (a->dbeta) a->dbeta[c] = (float)w.sum[c];
        if (a->dgamma) a->dgamma[c] = (float)w.sum[C + c];
        if (a->sum_dy) { /* the means over every replica's rows */
            mdy[c] = (float)((double)a->sum_dy[c] / (double)a->total_rows);
            mdyx[c] = (float)((double)a->sum_dy_xhat[c] / (double)a->total_rows);
        } else {
            mdy[c] = (float)(w.sum[c] / (double)pl.rows);
            mdyx[c] = (float)(w.sum[C + c] / (double)pl.rows);
        }
    }
    if (!a->dx) return;
    j.scale = scale;
    j.mean_dy = mdy;
    j.mean_dy_xhat = mdyx;
    j.out = a->dtype == MPT_FLOAT32 ? (float *)a->dx : w.dyf; /* in place over dy's copy */
    mpt__parallel_for(ctx, pl.n_chunks, mpt__bn_dx_task, &j);
    if ((void *)j.out != a->dx) mpt__convert(ctx, a->dtype, a->dx, MPT_FLOAT32, j.out, n);
}

/* Workspace: float32 copies of x and dy for the half dtypes, the chunk
   sums (at most rows / chunk_rows + 1 chunks), sum and coef; -1 on
   overflow. */
static int64_t mpt__cpu_batchnorm_workspace(void *impl, mpt_dtype dtype, int64_t rows,
                                            int64_t channels) {
    mpt__bn_plan pl = mpt__bn_plan_rows(rows, channels);
    int64_t elems, sums, copies = 0;
    (void)impl;
    if (!mpt__mul_ok(rows / pl.chunk_rows + 1 + 2, channels, &elems) ||
        !mpt__mul_ok(elems, 16, &sums) ||
        (dtype != MPT_FLOAT32 && !mpt__mul_ok(rows, 8 * channels, &copies)) ||
        !mpt__add_ok(sums, copies, &sums) || !mpt__add_ok(sums, MPT__BN_WS_PIECES * MPT__ALIGN, &sums))
        return -1;
    return sums;
}

/* The arguments of a BatchNormalization layer's pass. */
static mpt_batchnorm_args mpt__bn_args(const mpt__layer *L, const mpt__pass *p) {
    mpt_batchnorm_args a;
    int gamma = mpt__bn_gamma_slot(L), beta = mpt__bn_beta_slot(L), moving = mpt__bn_moving_slot(L);
    memset(&a, 0, sizeof a);
    a.dtype = L->dtype;
    a.channels = L->in_shape[L->in_rank - 1];
    a.rows = p->batch * (L->in_count / a.channels);
    a.epsilon = mpt__bn_epsilon(L);
    a.momentum = mpt__bn_momentum(L);
    a.training = p->training;
    a.x = p->x;
    a.y = p->y;
    a.dy = p->dy;
    a.dx = p->dx;
    a.gamma = gamma >= 0 ? mpt__param_master(L, gamma) : NULL;
    a.beta = beta >= 0 ? mpt__param_master(L, beta) : NULL;
    a.dgamma = gamma >= 0 ? mpt__param_grad(L, gamma) : NULL;
    a.dbeta = beta >= 0 ? mpt__param_grad(L, beta) : NULL;
    a.mean = (float *)L->saved[0];
    a.variance = (float *)L->saved[1];
    a.moving_mean = mpt__param_master(L, moving);
    a.moving_variance = mpt__param_master(L, moving + 1);
    a.workspace = p->workspace;
    return a;
}

static void mpt__bn_forward(mpt__layer *L, const mpt__pass *p) {
    mpt_batchnorm_args a = mpt__bn_args(L, p);
    p->be->batchnorm_forward(p->impl, &a);
}

static void mpt__bn_commit(mpt__layer *L, const mpt__pass *p) {
    mpt_batchnorm_args a = mpt__bn_args(L, p);
    p->be->batchnorm_commit(p->impl, &a, p->state);
}

static void mpt__bn_backward(mpt__layer *L, const mpt__pass *p) {
    mpt_batchnorm_args a = mpt__bn_args(L, p);
    p->be->batchnorm_backward(p->impl, &a);
}

static mpt_status mpt__bn_build(mpt_model *m, mpt__layer *L) {
    const mpt_batchnorm_desc *d = &L->desc.batchnorm;
    int64_t C = L->in_shape[L->in_rank - 1], fixed = 0;
    L->out_rank = L->in_rank;
    memcpy(L->out_shape, L->in_shape, sizeof L->in_shape);
    /* Statistics always in float32: every parameter's compute dtype is. */
    if (!d->no_scale)
        MPT__CHECK(mpt__layer_add_param(m, L, "gamma", 1, &C, MPT_INIT_ONES, C, C, 1, MPT_FLOAT32));
    if (!d->no_center)
        MPT__CHECK(mpt__layer_add_param(m, L, "beta", 1, &C, MPT_INIT_ZEROS, C, C, 1, MPT_FLOAT32));
    MPT__CHECK(mpt__layer_add_param(m, L, "moving_mean", 1, &C, MPT_INIT_ZEROS, C, C, 0,
                                    MPT_FLOAT32));
    MPT__CHECK(mpt__layer_add_param(m, L, "moving_variance", 1, &C, MPT_INIT_ONES, C, C, 0,
                                    MPT_FLOAT32));
    m->params[m->n_params - 1].non_negative = 1;
    MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C)); /* batch mean (C) f32     */
    MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C)); /* batch variance (C) f32 */
    if (d->synchronized) { /* Σ dy, Σ dy·x̂ over the replicas (C) f32 each */
        MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C));
        MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C));
    }
    {
        void *impl;
        const mpt_backend *be = mpt_context_backend(m->ctx, &impl);
        int64_t rows = 0;
        fixed = mpt__mul_ok(m->max_batch, L->in_count / C, &rows)
                    ? be->batchnorm_workspace(impl, L->dtype, rows, C)
                    : -1;
        if (fixed < 0)
            return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                             "BatchNormalization '%s': workspace for a batch of %lld overflows",
                             L->name, (long long)m->max_batch);
    }
    return mpt__layer_set_workspace(m, L, 0, fixed);
}

static const mpt__layer_ops mpt__bn_ops = {"BatchNormalization", "batch_normalization",
                                           mpt__bn_build, mpt__bn_forward, mpt__bn_backward,
                                           mpt__bn_commit, NULL};

MPTDEF mpt_status mpt_model_add_batch_normalization(mpt_model *m, const mpt_batchnorm_desc *d) {
    mpt_batchnorm_desc defaults;
    MPT__CHECK(mpt__check_add(m));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    if (!(d->momentum >= 0 && d->momentum <= 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "BatchNormalization: momentum %g is not in [0, 1]", (double)d->momentum);
    if (!(d->epsilon >= 0 && d->epsilon < INFINITY))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "BatchNormalization: epsilon %g must be > 0 and finite (0: 1e-3)",
                         (double)d->epsilon);
    return mpt__add_layer(m, &mpt__bn_ops, d, sizeof(mpt_batchnorm_desc));
}

/* =============================================================================
   @impl-dropout  Dropout: inverted dropout                  x, y: (B, ...)
   =============================================================================

   In training each element is kept with probability 1 − rate and scaled by
   1 / (1 − rate), so that inference is the identity. The mask is never
   stored: element i is kept when the uniform number
       Philox(key, counter = (step, i / 4)) word i % 4
   is ≥ rate, with the layer's key and the model's training step. Backward
   regenerates it from the step saved by forward; any split of the work over
   threads gives the same mask. */

#define MPT__DROPOUT_CHUNK ((int64_t)1 << 14) /* elements per task; a multiple of 4 */

/* Replicas draw different masks: each mixes its index into the key. */
static uint64_t mpt__dropout_key(const mpt__layer *L, int replica) {
    uint64_t key = L->desc.dropout.seed ? mpt__mix64(L->desc.dropout.seed) : L->seed;
    return replica ? mpt__mix64(key ^ (uint64_t)replica) : key;
}

typedef struct mpt__dropout_job {
    mpt_context *ctx;
    uint64_t key;      /* the layer's random key                    */
    uint64_t step;     /* the training step the mask belongs to      */
    float rate;
    mpt_dtype dtype;
    const void *in;    /* (n) x (forward) or dy (backward), dtype    */
    void *out;         /* (n) y or dx, dtype                         */
    float *tmp;        /* (n) float32 scratch; NULL when dtype is    */
    int64_t n;
} mpt__dropout_job;

/* out[i] = in[i] · scale where element i is kept, else 0, for i in [i0, i1)
   (i0 a multiple of 4; both arrays start at element i0). */
static void mpt__dropout_mask(uint64_t key, uint64_t step, float rate, const float *in,
                              float *out, int64_t i0, int64_t i1) {
    float scale = 1.0f / (1.0f - rate);
    int64_t i, k;
    for (i = i0; i < i1; i += 4) {
        uint32_t r[4];
        mpt_philox4x32(key, step, (uint64_t)i / 4, r);
        for (k = 0; k < 4 && i + k < i1; k++)
            out[i - i0 + k] = mpt__uniform01(r[k]) >= rate ? in[i - i0 + k] * scale : 0.0f;
    }
}

static void mpt__dropout_task(void *arg, int64_t chunk, int thread) {
    const mpt__dropout_job *j = (const mpt__dropout_job *)arg;
    mpt_dtype dt = j->dtype;
    int64_t i0 = chunk * MPT__DROPOUT_CHUNK, i1 = MPT__MIN(j->n, i0 + MPT__DROPOUT_CHUNK);
    size_t offset = (size_t)i0 * mpt_dtype_size(dt);
    const void *in = (const char *)j->in + offset; /* (i1 − i0) this chunk's part */
    void *out = (char *)j->out + offset;
    (void)thread;
    if (j->tmp) { /* half dtypes: through this chunk's float32 slice */
        float *t = j->tmp + i0;
        mpt__convert(j->ctx, MPT_FLOAT32, t, dt, in, i1 - i0);
        mpt__dropout_mask(j->key, j->step, j->rate, t, t, i0, i1);
        mpt__convert(j->ctx, dt, out, MPT_FLOAT32, t, i1 - i0);
    } else {
        mpt__dropout_mask(j->key, j->step, j->rate, (const float *)in, (float *)out, i0, i1);
    }
}

/* The CPU backend's dropout (mpt_backend.dropout). ws: n floats for the
   half dtypes. */
static void mpt__cpu_dropout(void *impl, uint64_t key, float rate, mpt_dtype dtype,
                             const void *in, void *out, int64_t n, const mpt_step_state *state,
                             int64_t *saved_step, void *ws) {
    mpt__dropout_job j;
    if (state) *saved_step = state->step;
    if (rate == 0) { /* the identity, in training too */
        if (out != in) memcpy(out, in, (size_t)mpt__dbytes(dtype, n));
        return;
    }
    j.ctx = (mpt_context *)impl;
    j.key = key;
    j.step = (uint64_t)*saved_step;
    j.rate = rate;
    j.dtype = dtype;
    j.in = in;
    j.out = out;
    j.tmp = dtype == MPT_FLOAT32 ? NULL : (float *)ws;
    j.n = n;
    mpt__parallel_for(j.ctx, (n + MPT__DROPOUT_CHUNK - 1) / MPT__DROPOUT_CHUNK, mpt__dropout_task,
                      &j);
}

static void mpt__dropout_forward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count;
    if (!p->training) {
        p->be->copy(p->impl, p->y, p->x, (size_t)mpt__dbytes(L->dtype, n));
        return;
    }
    /* saved[0]: the step of this mask (1) int64, for backward */
    p->be->dropout(p->impl, mpt__dropout_key(L, p->model->replica_index), L->desc.dropout.rate,
                   L->dtype, p->x, p->y, n, p->state, (int64_t *)L->saved[0], p->workspace);
}

static void mpt__dropout_backward(mpt__layer *L, const mpt__pass *p) {
    if (p->dx)
        p->be->dropout(p->impl, mpt__dropout_key(L, p->model->replica_index),
                       L->desc.dropout.rate, L->dtype, p->dy, p->dx, p->batch * L->in_count,
                       NULL, (int64_t *)L->saved[0], p->workspace);
}

static mpt_status mpt__dropout_build(mpt_model *m, mpt__layer *L) {
    L->out_rank = L->in_rank;
    memcpy(L->out_shape, L->in_shape, sizeof L->in_shape);
    MPT__CHECK(mpt__layer_add_saved(m, L, 0, 8)); /* the step forward used (1) u64 */
    /* half dtypes: x or dy in float32 (B, ...) */
    return mpt__layer_set_workspace(m, L, L->dtype == MPT_FLOAT32 ? 0 : 4 * L->in_count, 0);
}

static const mpt__layer_ops mpt__dropout_ops = {"Dropout", "dropout", mpt__dropout_build,
                                                mpt__dropout_forward, mpt__dropout_backward,
                                                NULL, NULL};

MPTDEF mpt_status mpt_model_add_dropout(mpt_model *m, const mpt_dropout_desc *d) {
    mpt_dropout_desc defaults;
    MPT__CHECK(mpt__check_add(m));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* NULL: every default */
    if (!(d->rate >= 0 && d->rate < 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Dropout: rate %g is not in [0, 1)",
                         (double)d->rate);
    return mpt__add_layer(m, &mpt__dropout_ops, d, sizeof(mpt_dropout_desc));
}
/* =============================================================================
   @impl-losses
   =============================================================================

   Each loss sees pred as rows of K values, K = its last axis: (rows, K).
   Crossentropies give one loss per row (over its K classes) and average
   over the rows; binary crossentropy and mean squared error average over
   the last axis and then over the rows, i.e. over every element. That is
   Keras' sum_over_batch_size.

   Arithmetic is float32 (the prediction is read in float32 whatever its
   dtype); sums over a row and over the batch are double. The rows are split
   into a fixed number of tasks, each keeping its own partial sum, added in
   task order: the loss does not depend on the thread count.

   With from_logits = 0 the predictions are probabilities, treated as Keras
   3 does: crossentropy divides each row by its sum and clips to
   [1e-7, 1 − 1e-7] before the log; binary crossentropy clips alike. The
   gradient is that of those formulas, so it is zero through a clipped
   value. */

#define MPT__LOSS_TASKS 64   /* tasks the rows are split into (at most) */
#define MPT__LOSS_EPS 1e-7f  /* Keras' backend.epsilon()                */

static const char *mpt__loss_name(mpt_loss_type type) {
    switch (type) {
    case MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY: return "sparse_categorical_crossentropy";
    case MPT_LOSS_CATEGORICAL_CROSSENTROPY: return "categorical_crossentropy";
    case MPT_LOSS_BINARY_CROSSENTROPY: return "binary_crossentropy";
    case MPT_LOSS_MEAN_SQUARED_ERROR: return "mean_squared_error";
    default: return "loss";
    }
}

typedef struct mpt__loss_job {
    mpt_loss_type type;
    int from_logits;
    const mpt_tensor *pred;   /* (rows, K) any float dtype                     */
    const mpt_tensor *target; /* (rows, K) float, or (rows) int32 class ids    */
    mpt_tensor *dpred;        /* (rows, K) any float dtype, or NULL            */
    int64_t rows, K;
    float gscale;             /* grad_scale / the count the loss is a mean over */
    int n_tasks;
    double partial[MPT__LOSS_TASKS]; /* each task's sum of row losses           */
} mpt__loss_job;

static int mpt__loss_sparse(const mpt__loss_job *j) {
    return j->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
}

/* The target of row r, class c: one-hot for class ids. */
static float mpt__loss_target(const mpt__loss_job *j, int64_t r, int64_t c) {
    if (mpt__loss_sparse(j)) return ((const int32_t *)j->target->data)[r] == c ? 1.0f : 0.0f;
    return mpt__load_f32(j->target->dtype, j->target->data, r * j->K + c);
}

static float mpt__loss_pred(const mpt__loss_job *j, int64_t i) {
    return mpt__load_f32(j->pred->dtype, j->pred->data, i);
}

static void mpt__loss_grad(const mpt__loss_job *j, int64_t i, float g) {
    mpt__store_f32(j->dpred->dtype, j->dpred->data, i, g * j->gscale);
}

/* Crossentropy of softmax(z) for row r: Σ t·(lse − z), lse = log Σ exp z
   taken around the row's max so that no exp overflows. The gradient
   softmax(z)·Σt − t is written after every read of the row, so dpred may
   be pred itself. */
static double mpt__xent_logits_row(const mpt__loss_job *j, int64_t r) {
    int64_t K = j->K, base = r * K, c;
    float mx = mpt__loss_pred(j, base);
    double sum = 0, loss = 0, tsum = 0, lse;
    for (c = 1; c < K; c++) mx = MPT__MAX(mx, mpt__loss_pred(j, base + c));
    for (c = 0; c < K; c++) sum += expf(mpt__loss_pred(j, base + c) - mx);
    lse = mx + log(sum);
    for (c = 0; c < K; c++) {
        float t = mpt__loss_target(j, r, c);
        if (t != 0) loss += t * (lse - mpt__loss_pred(j, base + c));
        tsum += t;
    }
    if (j->dpred)
        for (c = 0; c < K; c++) {
            float p = expf((float)(mpt__loss_pred(j, base + c) - lse));
            mpt__loss_grad(j, base + c, p * (float)tsum - mpt__loss_target(j, r, c));
        }
    return loss;
}

/* One class of a probability row: q = p / S clipped to c; the loss term
   −t·log c, and g = d(−t·log c)/dq, zero where the clip holds q. */
static float mpt__xent_prob_term(float p, float S, float t, float *g) {
    float q = p / S, c = MPT__MIN(MPT__MAX(q, MPT__LOSS_EPS), 1.0f - MPT__LOSS_EPS);
    *g = (q < MPT__LOSS_EPS || q > 1.0f - MPT__LOSS_EPS) ? 0.0f : -t / c;
    return t != 0 ? -t * logf(c) : 0.0f;
}

/* Crossentropy of a probability row (Keras: divided by its sum, clipped).
   Through q_k = p_k / S the gradient is dL/dp_k = (g_k − Σ_c g_c·q_c) / S. */
static double mpt__xent_probs_row(const mpt__loss_job *j, int64_t r) {
    int64_t K = j->K, base = r * K, c;
    double sum = 0, loss = 0, dot = 0;
    float S, g;
    for (c = 0; c < K; c++) sum += mpt__loss_pred(j, base + c);
    S = (float)sum;
    for (c = 0; c < K; c++) {
        float p = mpt__loss_pred(j, base + c);
        loss += mpt__xent_prob_term(p, S, mpt__loss_target(j, r, c), &g);
        dot += (double)g * (p / S);
    }
    if (j->dpred)
        for (c = 0; c < K; c++) {
            mpt__xent_prob_term(mpt__loss_pred(j, base + c), S, mpt__loss_target(j, r, c), &g);
            mpt__loss_grad(j, base + c, (float)((g - dot) / S));
        }
    return loss;
}

/* Binary crossentropy of one element, and d/dpred into *g. */
static float mpt__bce_term(int from_logits, float x, float t, float *g) {
    if (from_logits) { /* max(x, 0) − x·t + log(1 + exp(−|x|)): no overflow */
        *g = mpt__sigmoid(x) - t;
        return MPT__MAX(x, 0.0f) - x * t + log1pf(expf(-fabsf(x)));
    } else {
        float c = MPT__MIN(MPT__MAX(x, MPT__LOSS_EPS), 1.0f - MPT__LOSS_EPS);
        *g = (x < MPT__LOSS_EPS || x > 1.0f - MPT__LOSS_EPS) ? 0.0f : (1 - t) / (1 - c) - t / c;
        return -(t * logf(c) + (1 - t) * logf(1 - c));
    }
}

/* Binary crossentropy or squared error, summed over the row's elements. */
static double mpt__elementwise_row(const mpt__loss_job *j, int64_t r) {
    int64_t K = j->K, base = r * K, c;
    double loss = 0;
    for (c = 0; c < K; c++) {
        float x = mpt__loss_pred(j, base + c), t = mpt__loss_target(j, r, c), g;
        if (j->type == MPT_LOSS_BINARY_CROSSENTROPY) {
            loss += mpt__bce_term(j->from_logits, x, t, &g);
        } else {
            loss += (double)(x - t) * (x - t);
            g = 2 * (x - t);
        }
        if (j->dpred) mpt__loss_grad(j, base + c, g);
    }
    return loss;
}

static void mpt__loss_task(void *arg, int64_t task, int thread) {
    mpt__loss_job *j = (mpt__loss_job *)arg;
    int64_t r0 = j->rows * task / j->n_tasks, r1 = j->rows * (task + 1) / j->n_tasks, r;
    double sum = 0;
    (void)thread;
    for (r = r0; r < r1; r++) {
        if (j->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
            j->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY)
            sum += j->from_logits ? mpt__xent_logits_row(j, r) : mpt__xent_probs_row(j, r);
        else
            sum += mpt__elementwise_row(j, r);
    }
    j->partial[task] = sum;
}

/* ---- checking the arguments ------------------------------------------------ */

static mpt_status mpt__loss_check_desc(mpt_context *ctx, const mpt_loss_desc *d) {
    const char *name = mpt__loss_name(d->type);
    if (d->type == MPT_LOSS_NONE)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss: type is required (MPT_LOSS_NONE given)");
    if (d->type < MPT_LOSS_NONE || d->type >= MPT_LOSS_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loss: unknown loss type %d", (int)d->type);
    if (d->from_logits && d->type == MPT_LOSS_MEAN_SQUARED_ERROR)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: from_logits applies to the crossentropy losses only", name);
    if (!(d->grad_scale >= 0 && d->grad_scale < INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: grad_scale %g must be finite and >= 0 (0: 1)", name,
                         (double)d->grad_scale);
    return MPT_OK;
}

/* A float tensor with data and a valid shape of rank min_rank..MPT_MAX_RANK. */
static mpt_status mpt__loss_check_tensor(mpt_context *ctx, const char *name, const char *what,
                                         const mpt_tensor *t, int min_rank) {
    char s[96];
    if (!t->data) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "%s: %s has NULL data", name, what);
    if (t->rank < min_rank || t->rank > MPT_MAX_RANK)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "%s: %s has rank %d, not %d..%d", name, what,
                         t->rank, min_rank, MPT_MAX_RANK);
    if (mpt__shape_count(t->rank, t->shape) < 0)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "%s: %s shape %s has a dimension <= 0", name, what,
                         mpt_shape_format(s, sizeof s, t->rank, t->shape));
    return MPT_OK;
}

static int mpt__same_shape(const mpt_tensor *a, const mpt_tensor *b) {
    int i;
    if (a->rank != b->rank) return 0;
    for (i = 0; i < a->rank; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

/* Class ids: pred's shape without its last axis, or with that axis 1. */
static mpt_status mpt__loss_check_labels_shape(mpt_context *ctx, const char *name,
                                               const mpt_tensor *pred, const mpt_tensor *target) {
    char p[96], t[96];
    int i, r = pred->rank - 1, ok;
    if (target->dtype != MPT_INT32)
        return mpt__fail(ctx, MPT_ERR_DTYPE, "%s: target (class ids) must be int32, not %s", name,
                         mpt_dtype_name(target->dtype));
    ok = target->rank == r || (target->rank == r + 1 && target->shape[r] == 1);
    for (i = 0; ok && i < r; i++) ok = target->shape[i] == pred->shape[i];
    if (!ok)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "%s: target shape %s does not fit pred %s: want pred's shape without "
                         "its last axis (class ids), or with it 1", name,
                         mpt_shape_format(t, sizeof t, target->rank, target->shape),
                         mpt_shape_format(p, sizeof p, pred->rank, pred->shape));
    return MPT_OK;
}

/* A float target has pred's shape, or pred's without a last axis of 1:
   (n,) targets for an (n, 1) output, as Keras expands them. The memory is
   the same either way. Also the rule fit applies to one sample's shapes. */
static int mpt__target_shape_fits(int target_rank, const int64_t *target_shape, int pred_rank,
                                  const int64_t *pred_shape) {
    int i;
    if (target_rank == pred_rank - 1 && pred_rank >= 1 && pred_shape[pred_rank - 1] == 1)
        pred_rank--;
    if (target_rank != pred_rank) return 0;
    for (i = 0; i < pred_rank; i++)
        if (target_shape[i] != pred_shape[i]) return 0;
    return 1;
}

static mpt_status mpt__loss_check_target(mpt_context *ctx, const mpt_loss_desc *d,
                                         const mpt_tensor *pred, const mpt_tensor *target) {
    const char *name = mpt__loss_name(d->type);
    char p[96], t[96];
    MPT__CHECK(mpt__loss_check_tensor(ctx, name, "target", target, 0));
    if (d->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY)
        return mpt__loss_check_labels_shape(ctx, name, pred, target);
    if (!mpt_dtype_is_float(target->dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "%s: target must be float32, float16 or bfloat16, "
                         "not %s", name, mpt_dtype_name(target->dtype));
    if (!mpt__target_shape_fits(target->rank, target->shape, pred->rank, pred->shape))
        return mpt__fail(ctx, MPT_ERR_SHAPE, "%s: target shape %s is not pred's %s (or pred's "
                         "without a last axis of 1)", name,
                         mpt_shape_format(t, sizeof t, target->rank, target->shape),
                         mpt_shape_format(p, sizeof p, pred->rank, pred->shape));
    return MPT_OK;
}

static int mpt__overlap(const mpt_tensor *a, const mpt_tensor *b) {
    uintptr_t pa = (uintptr_t)a->data, pb = (uintptr_t)b->data;
    return pa < pb + mpt_tensor_bytes(b) && pb < pa + mpt_tensor_bytes(a);
}

/* dpred: pred's shape, any float dtype; it may be pred itself (the
   gradient replaces the logits) but must not partly overlap it. */
static mpt_status mpt__loss_check_dpred(mpt_context *ctx, const char *name,
                                        const mpt_tensor *pred, const mpt_tensor *target,
                                        const mpt_tensor *dpred) {
    char p[96], g[96];
    MPT__CHECK(mpt__loss_check_tensor(ctx, name, "dpred", dpred, 1));
    if (!mpt_dtype_is_float(dpred->dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "%s: dpred must be float32, float16 or bfloat16, "
                         "not %s", name, mpt_dtype_name(dpred->dtype));
    if (!mpt__same_shape(pred, dpred))
        return mpt__fail(ctx, MPT_ERR_SHAPE, "%s: dpred shape %s is not pred's %s", name,
                         mpt_shape_format(g, sizeof g, dpred->rank, dpred->shape),
                         mpt_shape_format(p, sizeof p, pred->rank, pred->shape));
    if ((mpt__overlap(dpred, pred) && !(dpred->data == pred->data && dpred->dtype == pred->dtype)) ||
        mpt__overlap(dpred, target))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: dpred overlaps %s (only pred itself, same dtype, may be reused)",
                         name, mpt__overlap(dpred, target) ? "target" : "pred");
    return MPT_OK;
}

/* NaN or inf anywhere in a float tensor: the first index. */
static mpt_status mpt__loss_check_finite(mpt_context *ctx, const char *name, const char *what,
                                         const mpt_tensor *t) {
    int64_t n = mpt_tensor_count(t), per_sample = t->rank ? n / t->shape[0] : 1, i;
    for (i = 0; i < n; i++) {
        float v = mpt__load_f32(t->dtype, t->data, i);
        if (!isfinite(v))
            return mpt__fail(ctx, MPT_ERR_NUMERIC,
                             "%s: %s element %lld (sample %lld) is %g; it must be finite", name,
                             what, (long long)i, (long long)(i / per_sample), (double)v);
    }
    return MPT_OK;
}

/* Every class id in 0..K−1. */
static mpt_status mpt__loss_check_labels(mpt_context *ctx, const mpt__loss_job *j) {
    const int32_t *label = (const int32_t *)j->target->data; /* (rows) */
    int64_t r;
    for (r = 0; r < j->rows; r++)
        if (label[r] < 0 || label[r] >= j->K)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: label %d of sample %lld is not a class id in 0..%lld",
                             mpt__loss_name(j->type), (int)label[r], (long long)r,
                             (long long)(j->K - 1));
    return MPT_OK;
}

/* Probability rows are divided by their sum, which must be positive. */
static mpt_status mpt__loss_check_prob_rows(mpt_context *ctx, const mpt__loss_job *j) {
    int64_t r, c;
    for (r = 0; r < j->rows; r++) {
        double sum = 0;
        for (c = 0; c < j->K; c++) sum += mpt__loss_pred(j, r * j->K + c);
        if (!((float)sum > 0))
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: pred row %lld sums to %g; probabilities (from_logits = 0) "
                             "need a positive sum", mpt__loss_name(j->type), (long long)r, sum);
    }
    return MPT_OK;
}

/* ---- the loss ---------------------------------------------------------------- */

static mpt_status mpt__loss_check(mpt_context *ctx, const mpt_loss_desc *d, const mpt_tensor *pred,
                                  const mpt_tensor *target, const double *loss,
                                  const mpt_tensor *dpred) {
    const char *name;
    if (!pred || !target || !loss)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loss: NULL %s",
                         !pred ? "pred" : !target ? "target" : "loss");
    MPT__CHECK(mpt__loss_check_desc(ctx, d));
    name = mpt__loss_name(d->type);
    MPT__CHECK(mpt__loss_check_tensor(ctx, name, "pred", pred, 1));
    if (!mpt_dtype_is_float(pred->dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "%s: pred must be float32, float16 or bfloat16, "
                         "not %s", name, mpt_dtype_name(pred->dtype));
    MPT__CHECK(mpt__loss_check_target(ctx, d, pred, target));
    if (dpred) MPT__CHECK(mpt__loss_check_dpred(ctx, name, pred, target, dpred));
    MPT__CHECK(mpt__loss_check_finite(ctx, name, "pred", pred));
    if (d->type != MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY)
        MPT__CHECK(mpt__loss_check_finite(ctx, name, "target", target));
    return MPT_OK;
}

/* The mean loss of a checked job, its gradient (times grad_scale) written
   when j->dpred is set. */
static double mpt__loss_run(mpt_context *ctx, mpt__loss_job *j, double grad_scale) {
    int categorical = j->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
                      j->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    /* The mean is over rows for crossentropies, over elements otherwise. */
    double count = categorical ? (double)j->rows : (double)j->rows * (double)j->K, sum = 0;
    int t;
    j->gscale = (float)(grad_scale / count);
    j->n_tasks = (int)MPT__MIN(j->rows, (int64_t)MPT__LOSS_TASKS);
    mpt__parallel_for(ctx, j->n_tasks, mpt__loss_task, j);
    for (t = 0; t < j->n_tasks; t++) sum += j->partial[t];
    return sum / count;
}

static int64_t mpt__argmax(mpt_dtype dtype, const void *row0, int64_t offset, int64_t n) {
    int64_t j, best = 0;
    float bv = mpt__load_f32(dtype, row0, offset);
    for (j = 1; j < n; j++) {
        float v = mpt__load_f32(dtype, row0, offset + j);
        if (v > bv) bv = v, best = j;
    }
    return best;
}

/* Accuracy as Keras counts it: for sparse labels argmax == label, for
   one-hot targets argmax == argmax(target), for one output unit (binary)
   prediction > threshold (0.5 for probabilities, 0 for logits). Top k:
   fewer than k classes score strictly higher than the true one. */
static void mpt__count_hits(int metrics, int k, int from_logits, const mpt_tensor *out,
                            const mpt_tensor *y, int64_t *correct, int64_t *top_k) {
    int64_t b, B = out->shape[0], classes = mpt_tensor_count(out) / B;
    if (!(metrics & (MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K))) return;
    for (b = 0; b < B; b++) {
        int64_t guess, truth, j, above = 0;
        if (classes == 1) {
            float v = mpt__load_f32(out->dtype, out->data, b);
            float threshold = from_logits ? 0.0f : 0.5f;
            float target = y->dtype == MPT_INT32 ? (float)((const int32_t *)y->data)[b]
                                                 : ((const float *)y->data)[b];
            *correct += (v > threshold) == (target > 0.5f);
            continue;
        }
        guess = mpt__argmax(out->dtype, out->data, b * classes, classes);
        truth = y->dtype == MPT_INT32 ? ((const int32_t *)y->data)[b]
                                      : mpt__argmax(MPT_FLOAT32, y->data, b * classes, classes);
        *correct += guess == truth;
        if (metrics & MPT_METRIC_SPARSE_TOP_K) {
            float tv = mpt__load_f32(out->dtype, out->data, b * classes + truth);
            for (j = 0; j < classes; j++)
                above += mpt__load_f32(out->dtype, out->data, b * classes + j) > tv;
            *top_k += above < k;
        }
    }
}

MPTDEF mpt_status mpt_loss_compute(mpt_context *ctx, const mpt_loss_desc *desc,
                                   const mpt_tensor *pred, const mpt_tensor *target,
                                   double *loss, mpt_tensor *dpred) {
    mpt__loss_job j;
    int categorical;
    mpt_loss_desc defaults;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    memset(&defaults, 0, sizeof defaults);
    if (!desc) desc = &defaults; /* NULL: every default; type is required */
    MPT__CHECK(mpt__loss_check(ctx, desc, pred, target, loss, dpred));
    memset(&j, 0, sizeof j);
    j.type = desc->type;
    j.from_logits = desc->from_logits != 0;
    j.pred = pred;
    j.target = target;
    j.dpred = dpred;
    j.K = pred->shape[pred->rank - 1];
    j.rows = mpt_tensor_count(pred) / j.K;
    categorical = j.type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
                  j.type == MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    if (j.type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY) MPT__CHECK(mpt__loss_check_labels(ctx, &j));
    if (categorical && !j.from_logits) MPT__CHECK(mpt__loss_check_prob_rows(ctx, &j));
    *loss = mpt__loss_run(ctx, &j, desc->grad_scale != 0 ? desc->grad_scale : 1.0);
    return MPT_OK;
}

/* The CPU backend's loss (mpt_backend.loss): as mpt_loss_compute without
   the checks (fit made them once), and the batch tallied into the state. */
static void mpt__cpu_loss(void *impl, const mpt_loss_args *a) {
    mpt_context *ctx = (mpt_context *)impl;
    mpt_tensor pred, target, dpred;
    int64_t shape[2], correct = 0, top_k = 0;
    mpt__loss_job j;
    double loss;
    shape[0] = a->rows;
    shape[1] = a->K;
    mpt_tensor_wrap(ctx, &pred, a->pred_dtype, 2, shape, (void *)a->pred);
    mpt_tensor_wrap(ctx, &target, a->target_dtype, a->target_dtype == MPT_INT32 ? 1 : 2, shape,
                    (void *)a->target);
    if (a->dpred) mpt_tensor_wrap(ctx, &dpred, a->pred_dtype, 2, shape, a->dpred);
    memset(&j, 0, sizeof j);
    j.type = a->type;
    j.from_logits = a->from_logits != 0;
    j.pred = &pred;
    j.target = &target;
    j.dpred = a->dpred ? &dpred : NULL;
    j.K = a->K;
    j.rows = a->rows;
    /* counted first: dpred may be pred, which the gradient then replaces */
    mpt__count_hits(a->metrics, a->top_k, a->from_logits, &pred, &target, &correct, &top_k);
    loss = mpt__loss_run(ctx, &j,
                         (a->scale_by_loss_scale ? (double)a->state->loss_scale : 1.0) *
                             (a->grad_weight != 0 ? (double)a->grad_weight : 1.0));
    a->state->loss_sum += loss * (double)a->rows;
    a->state->samples += (double)a->rows;
    a->state->correct += (double)correct;
    a->state->top_k += (double)top_k;
}

/* ---- the loss of a model's output, for a step by hand ---------------------
   mpt_loss_compute on the model's own buffers: the backend's loss (fit's),
   tallied into the evaluation record, whose two sums give the mean back. */

/* The target of mpt_model_compute_loss: pred's rows, in host memory,
   class ids in range or float32 values that are finite. */
static mpt_status mpt__check_model_target(mpt_model *m, const mpt_loss_desc *d,
                                          const mpt_tensor *pred, const mpt_tensor *target) {
    const char *name = mpt__loss_name(d->type);
    MPT__CHECK(mpt__loss_check_target(m->ctx, d, pred, target));
    if (target->device != MPT_DEVICE_CPU)
        return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED, "%s: target must be in host memory", name);
    if (d->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY) {
        mpt__loss_job j;
        memset(&j, 0, sizeof j);
        j.type = d->type;
        j.target = target;
        j.rows = mpt_tensor_count(target);
        j.K = pred->shape[pred->rank - 1];
        return mpt__loss_check_labels(m->ctx, &j);
    }
    if (target->dtype != MPT_FLOAT32)
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "%s: target must be float32, not %s", name,
                         mpt_dtype_name(target->dtype));
    return mpt__loss_check_finite(m->ctx, name, "target", target);
}

MPTDEF mpt_status mpt_model_compute_loss(mpt_model *m, const mpt_loss_desc *desc,
                                         const mpt_tensor *target, double *loss) {
    const mpt__layer *last;
    mpt_tensor pred, on_backend;
    mpt_loss_args a;
    mpt_step_state st;
    MPT__CHECK(mpt__hand_check(m, "compute_loss"));
    if (!desc || !target || !loss)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "compute_loss: NULL %s",
                         !desc ? "desc" : !target ? "target" : "loss");
    if (!m->last_batch)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "compute_loss: before a forward pass");
    MPT__CHECK(mpt__loss_check_desc(m->ctx, desc));
    last = &m->layers[m->n_layers - 1];
    mpt__layer_view(m, last, last->y, 0, &pred);
    MPT__CHECK(mpt__check_model_target(m, desc, &pred, target));
    MPT__CHECK(mpt__batch_on_backend(m, target, m->target_buf[0], &on_backend));
    memset(&a, 0, sizeof a);
    a.type = desc->type;
    a.from_logits = desc->from_logits || m->emit_logits;
    a.pred_dtype = last->dtype;
    a.pred = last->y;
    a.target_dtype = target->dtype;
    a.target = on_backend.data;
    a.dpred = m->grad_buf[0];
    a.rows = m->last_batch;
    a.K = last->out_count;
    a.grad_weight = desc->grad_scale; /* the gradient's multiplier; 0: 1 */
    a.state = &m->state[1];
    m->be->zero(m->impl, &m->state[1], 4 * sizeof(double)); /* loss_sum .. samples */
    m->be->loss(m->impl, &a);
    MPT__CHECK(mpt__download(m, &st, &m->state[1], sizeof st));
    *loss = st.loss_sum / st.samples;
    return MPT_OK;
}

/* =============================================================================
   @impl-optimizers  optimizers, learning-rate schedules, loss scaling, compile
   =============================================================================

   One optimizer step, given the float32 gradients backward left in P->grad
   (multiplied by the loss scale):

     pass 1  reads every gradient once and sums the squares in double. The
             sum is finite exactly when every gradient is: a float squared
             is at most ~1.2e77, so no realistic count of finite gradients
             overflows a double, while one inf or NaN makes the sum inf or
             NaN. So the one read gives both the overflow test of loss
             scaling and the global norm for clipping.
     pass 2  (only when the gradients are finite) one fused sweep per piece
             of parameter memory: unscale and clip (one multiplier), add the
             L2 term, decay the weight, update the slots and the float32
             master, and write the compute-dtype copy from the new master
             while it is still in cache.

   A step whose gradients are not finite changes nothing: no weight, slot,
   compute copy or counter (pytorch #88474 is what happens otherwise).

   Both passes split the trainable parameters, seen as one concatenated
   vector, into the same fixed ranges, which depend on the element count
   only. Pass 1 keeps one partial sum per range and adds them in range
   order, so the norm, and with it every result, is the same whatever the
   thread count. Nothing is allocated: the partial sums live in the job on
   the stack. The element loops have AVX2 versions that give the same bits
   as the portable ones (about 2 ns per Adam parameter on one core, near
   memory speed; the portable loops take 3 times as long).

   Keras 3 is followed in the details: decoupled weight decay
   (w −= lr·wd·w, with the scheduled rate) is applied by every optimizer
   that has one, to every trainable variable, before the update; clipping
   is applied to the unscaled gradients, and the L2 term added after it. */


#define MPT__OPT_TASKS 256 /* ranges the parameters are split into, at most       */
/* Elements per range, at least: a smaller piece is not worth waking the pool. */
#define MPT__OPT_MIN_RANGE ((int64_t)1 << 15)
/* Elements updated before their compute copy is written (they are still in L1). */
#define MPT__OPT_BLOCK 512

/* ---- resolving the descriptors -------------------------------------------- */

/* x in [lo, hi) (NaN is never in range). */
static int mpt__in_range(double x, double lo, double hi) { return x >= lo && x < hi; }

static mpt_status mpt__schedule_resolve(mpt_context *ctx, mpt_lr_schedule *s) {
    int decays = s->type != MPT_LR_CONSTANT;
    int rated = s->type == MPT_LR_EXPONENTIAL_DECAY || s->type == MPT_LR_STEP_DECAY;
    if (s->type < MPT_LR_CONSTANT || s->type >= MPT_LR_SCHEDULE_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: schedule.type %d is not a known learning-rate schedule "
                         "(0 constant, 1 exponential, 2 step, 3 cosine)", (int)s->type);
    if (decays && s->decay_steps <= 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: schedule.decay_steps %lld must be > 0 for a decay",
                         (long long)s->decay_steps);
    if (rated && !(s->decay_rate > 0 && s->decay_rate <= 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: schedule.decay_rate %g is not in (0, 1]",
                         (double)s->decay_rate);
    if (!(s->alpha >= 0 && s->alpha <= 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: schedule.alpha %g is not in [0, 1]", (double)s->alpha);
    if (s->warmup_steps < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: schedule.warmup_steps %lld must be >= 0",
                         (long long)s->warmup_steps);
    return MPT_OK;
}

/* A field that must be finite and >= 0. */
static mpt_status mpt__check_nonneg(mpt_context *ctx, const char *field, float v) {
    if (!mpt__in_range(v, 0, INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: %s %g must be finite and >= 0", field, (double)v);
    return MPT_OK;
}

/* Checks an optimizer descriptor and fills in the documented defaults
   (zero fields), so that *out holds every value a step uses. */
static mpt_status mpt__optimizer_resolve(mpt_context *ctx, const mpt_optimizer_desc *in,
                                         mpt_optimizer_desc *out) {
    mpt_optimizer_desc d = *in;
    int adamw = d.type == MPT_OPTIMIZER_ADAMW;
    if (d.type < 0 || d.type >= MPT_OPTIMIZER_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: type %d is not a known optimizer (0 Adam, 1 SGD, 2 AdamW)",
                         (int)d.type);
    MPT__CHECK(mpt__check_nonneg(ctx, "learning_rate", d.learning_rate));
    if (!mpt__in_range(d.momentum, 0, 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "optimizer: momentum %g is not in [0, 1)",
                         (double)d.momentum);
    if (!mpt__in_range(d.beta_1, 0, 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "optimizer: beta_1 %g is not in [0, 1)",
                         (double)d.beta_1);
    if (!mpt__in_range(d.beta_2, 0, 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "optimizer: beta_2 %g is not in [0, 1)",
                         (double)d.beta_2);
    MPT__CHECK(mpt__check_nonneg(ctx, "weight_decay", d.weight_decay));
    MPT__CHECK(mpt__check_nonneg(ctx, "l2", d.l2));
    MPT__CHECK(mpt__check_nonneg(ctx, "clip_global_norm", d.clip_global_norm));
    if (d.learning_rate == 0) d.learning_rate = d.type == MPT_OPTIMIZER_SGD ? 0.01f : 0.001f;
    if (d.beta_1 == 0) d.beta_1 = 0.9f;
    if (d.beta_2 == 0) d.beta_2 = 0.999f;
    if (d.epsilon == 0) d.epsilon = 1e-7f;
    if (adamw && d.weight_decay == 0) d.weight_decay = 0.004f;
    if (!(d.epsilon > 0 && d.epsilon < INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "optimizer: epsilon %g must be finite and > 0", (double)d.epsilon);
    MPT__CHECK(mpt__schedule_resolve(ctx, &d.schedule));
    *out = d;
    return MPT_OK;
}

/* Checks a loss-scale descriptor and fills its defaults; DEFAULT becomes
   DYNAMIC when some layer computes in float16 (its range is what needs
   the scale) and NONE otherwise (bfloat16 has float32's range). */
static mpt_status mpt__loss_scale_resolve(mpt_context *ctx, const mpt_loss_scale_desc *in,
                                          int any_float16, mpt_loss_scale_desc *out) {
    mpt_loss_scale_desc d = *in;
    if (d.mode < MPT_LOSS_SCALE_DEFAULT || d.mode >= MPT_LOSS_SCALE_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss_scale: mode %d is not known (0 default, 1 dynamic, 2 fixed, 3 none)",
                         (int)d.mode);
    if (d.mode == MPT_LOSS_SCALE_DEFAULT)
        d.mode = any_float16 ? MPT_LOSS_SCALE_DYNAMIC : MPT_LOSS_SCALE_NONE;
    if (d.initial_scale == 0) d.initial_scale = 32768.0f;
    if (d.growth_interval == 0) d.growth_interval = 2000;
    if (d.growth_factor == 0) d.growth_factor = 2.0f;
    if (d.backoff_factor == 0) d.backoff_factor = 0.5f;
    /* A subnormal scale would make 1/scale inf. */
    if (!mpt__in_range(d.initial_scale, FLT_MIN, INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss_scale: initial_scale %g must be finite and > 0 (at least %g)",
                         (double)d.initial_scale, (double)FLT_MIN);
    if (d.growth_interval < 1)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss_scale: growth_interval %lld must be >= 1",
                         (long long)d.growth_interval);
    if (!(d.growth_factor > 1 && d.growth_factor < INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss_scale: growth_factor %g must be finite and > 1",
                         (double)d.growth_factor);
    if (!(d.backoff_factor > 0 && d.backoff_factor < 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "loss_scale: backoff_factor %g is not in (0, 1)",
                         (double)d.backoff_factor);
    *out = d;
    return MPT_OK;
}

/* Float32 tensors of optimizer state per trainable parameter. Keras' SGD
   keeps a velocity only when it has a momentum. */
static int mpt__optimizer_slot_count(const mpt_optimizer_desc *d) {
    if (d->type == MPT_OPTIMIZER_SGD) return d->momentum != 0 ? 1 : 0;
    return 2;
}

/* ---- learning-rate schedules ---------------------------------------------- */

/* The rate at optimizer step t (steps taken so far) for a base rate: a
   linear warm-up over the first W steps, lr·(t + 1)/W, then the decay run
   on t − W, as the header's mpt_lr_schedule describes. */
static double mpt__learning_rate_at(const mpt_optimizer_desc *d, double base_lr, int64_t t) {
    const mpt_lr_schedule *s = &d->schedule;
    double D = (double)s->decay_steps;
    int64_t W = s->warmup_steps;
    if (t < 0) t = 0;
    if (t < W) return base_lr * (double)(t + 1) / (double)W;
    t -= W;
    switch (s->type) {
    case MPT_LR_EXPONENTIAL_DECAY: return base_lr * pow(s->decay_rate, (double)t / D);
    case MPT_LR_STEP_DECAY: return base_lr * pow(s->decay_rate, (double)(t / s->decay_steps));
    case MPT_LR_COSINE_DECAY: {
        double progress = (double)MPT__MIN(t, s->decay_steps) / D; /* 0..1 */
        double cosine = 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
        return base_lr * ((1.0 - s->alpha) * cosine + s->alpha);
    }
    default: return base_lr;
    }
}


/* ---- walking the trainable parameters as one vector ----------------------- */

typedef void (*mpt__span_fn)(void *arg, const mpt_update_args *u, int k, int64_t begin,
                             int64_t end);

/* Calls fn on each parameter's part of the elements [begin, end) of all
   the trainable parameters of u laid end to end, in order. */
static void mpt__for_spans(const mpt_update_args *u, int64_t begin, int64_t end, mpt__span_fn fn,
                           void *arg) {
    int64_t offset = 0;
    int k;
    for (k = 0; k < u->n && offset < end; k++) {
        int64_t lo = MPT__MAX(begin, offset), hi = MPT__MIN(end, offset + u->count[k]);
        if (lo < hi) fn(arg, u, k, lo - offset, hi - offset);
        offset += u->count[k];
    }
}

static int64_t mpt__trainable_count(const mpt_update_args *u) {
    int64_t n = 0;
    int k;
    for (k = 0; k < u->n; k++) n += u->count[k];
    return n;
}

/* ---- the ranges ------------------------------------------------------------ */

/* The split of the trainable parameters (end to end) into ranges, one task
   each: a function of the element count only, never of the thread count. */
typedef struct mpt__ranges {
    int64_t total;   /* trainable elements                          */
    int64_t n_tasks; /* ranges: 1..MPT__OPT_TASKS                   */
    int64_t range;   /* elements per range (the last may be short)  */
} mpt__ranges;

static mpt__ranges mpt__opt_ranges(const mpt_update_args *u) {
    mpt__ranges r;
    r.total = mpt__trainable_count(u);
    r.n_tasks = MPT__MIN((int64_t)MPT__OPT_TASKS,
                         (r.total + MPT__OPT_MIN_RANGE - 1) / MPT__OPT_MIN_RANGE);
    r.n_tasks = MPT__MAX(r.n_tasks, 1);
    r.range = (r.total + r.n_tasks - 1) / r.n_tasks;
    return r;
}

/* The element loops below come in a portable version and an AVX2 one that
   does the same float operations in the same order, without FMA, so both
   give the same bits (unless the compiler fuses multiply-adds itself, as
   GNU dialects such as gnu99 allow and ISO ones such as -std=c99 do not:
   then they may differ in the last bit, each still deterministic). The
   AVX2 one is chosen when the context's CPU has it. The pointers are
   restrict-qualified: a store to w[i] changes nothing else, so the
   portable loops keep everything in registers. */
#ifdef __cplusplus
#define MPT__RESTRICT __restrict
#else
#define MPT__RESTRICT restrict
#endif

/* ---- pass 1: the sum of squares (finiteness and the global norm) ---------- */

/* Σ g² over n floats in double. Eight running sums, not one (a single
   chain of dependent adds runs at a fraction of memory speed): element k
   goes to sum k mod 8 and the sums are combined in one fixed order. */
static double mpt__sum8(const double s[8]) {
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static double mpt__sum_squares(const float *MPT__RESTRICT g, int64_t n) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) s[k] += (double)g[i + k] * (double)g[i + k];
    for (k = 0; i < n; i++, k++) s[k] += (double)g[i] * (double)g[i];
    return mpt__sum8(s);
}

#if MPT__X86
static MPT__TARGET_AVX2 double mpt__sum_squares_avx2(const float *g, int64_t n) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd(); /* sums 0-3, 4-7 */
    double s[8];
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(g + i));
        __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    _mm256_storeu_pd(s, lo);
    _mm256_storeu_pd(s + 4, hi);
    for (k = 0; i < n; i++, k++) s[k] += (double)g[i] * (double)g[i];
    return mpt__sum8(s);
}
#endif

typedef double (*mpt__sum_squares_fn)(const float *g, int64_t n);

typedef struct mpt__norm_job {
    const mpt_update_args *u;
    mpt__ranges r;
    mpt__sum_squares_fn sum_squares;
    double partial[MPT__OPT_TASKS]; /* (n_tasks) each range's sum of g² */
} mpt__norm_job;

/* One task's running sum over the spans of its range. */
typedef struct mpt__norm_acc {
    mpt__sum_squares_fn sum_squares;
    double sum;
} mpt__norm_acc;

static void mpt__norm_span(void *arg, const mpt_update_args *u, int k, int64_t begin,
                           int64_t end) {
    mpt__norm_acc *a = (mpt__norm_acc *)arg;
    a->sum += a->sum_squares(u->grad[k] + begin, end - begin);
}

static void mpt__norm_task(void *arg, int64_t task, int thread) {
    mpt__norm_job *j = (mpt__norm_job *)arg;
    int64_t begin = task * j->r.range;
    mpt__norm_acc a;
    (void)thread;
    a.sum_squares = j->sum_squares;
    a.sum = 0;
    mpt__for_spans(j->u, begin, MPT__MIN(begin + j->r.range, j->r.total), mpt__norm_span, &a);
    j->partial[task] = a.sum;
}

/* Σ g² over every trainable gradient as it stands (loss scale included), in
   double, the ranges' sums added in range order: inf or NaN exactly when
   some gradient is, and the same bits for any thread count. */
static double mpt__gradient_sum_squares(mpt_context *ctx, const mpt_update_args *u,
                                        const mpt__ranges *r) {
    mpt__norm_job j;
    double sum = 0;
    int64_t t;
    j.u = u;
    j.r = *r;
    j.sum_squares = mpt__sum_squares;
#if MPT__X86
    if (ctx->cpu & MPT_CPU_AVX2) j.sum_squares = mpt__sum_squares_avx2;
#endif
    mpt__parallel_for(ctx, r->n_tasks, mpt__norm_task, &j);
    for (t = 0; t < r->n_tasks; t++) sum += j.partial[t];
    return sum;
}

/* The CPU backend's first pass (mpt_backend.grad_stats). */
static void mpt__cpu_grad_stats(void *impl, const mpt_update_args *u) {
    mpt__ranges r = mpt__opt_ranges(u);
    double sum = mpt__gradient_sum_squares((mpt_context *)impl, u, &r);
    u->state->sum_squares = sum;
    u->state->finite = isfinite(sum) != 0;
}

/* ---- pass 2: the fused update --------------------------------------------- */

typedef struct mpt__update_job mpt__update_job;

/* Updates n elements of the master w from the gradient g and the slots s0,
   s1 (NULL where the optimizer has none). */
typedef void (*mpt__block_fn)(const mpt__update_job *j, float *w, const float *g, float *s0,
                              float *s1, int64_t n);

/* Every number the element loops use, in float32 as Keras computes. */
struct mpt__update_job {
    const mpt_context *ctx;
    const mpt_update_args *u;
    mpt__ranges r;
    mpt__block_fn block; /* the optimizer's loop, for this CPU           */
    int nesterov;
    float gscale;        /* 1 / loss scale × the clipping factor            */
    float l2;            /* coupled: added to the gradient as l2·w           */
    float decay;         /* decoupled: w −= w·(lr·weight_decay)              */
    float lr;            /* this step's scheduled rate                       */
    float momentum;      /* SGD                                              */
    float one_minus_b1, one_minus_b2, alpha, epsilon; /* Adam(W)             */
};

/* SGD (Keras 3): with a momentum, velocity = momentum·velocity − lr·g and
   w += velocity (nesterov: w += momentum·velocity − lr·g); without one,
   w −= lr·g. s0 is the velocity (NULL without momentum). */
static void mpt__sgd_block(const mpt__update_job *j, float *MPT__RESTRICT w,
                           const float *MPT__RESTRICT g, float *MPT__RESTRICT s0, float *s1,
                           int64_t n) {
    const float gscale = j->gscale, l2 = j->l2, decay = j->decay, lr = j->lr;
    const float mu = j->momentum;
    int64_t i;
    (void)s1;
    if (!s0) {
        for (i = 0; i < n; i++) {
            float gi = g[i] * gscale + l2 * w[i];
            float wi = w[i] - w[i] * decay;
            w[i] = wi - gi * lr;
        }
    } else if (!j->nesterov) {
        for (i = 0; i < n; i++) {
            float gi = g[i] * gscale + l2 * w[i];
            float wi = w[i] - w[i] * decay;
            float v = s0[i] * mu - gi * lr;
            s0[i] = v;
            w[i] = wi + v;
        }
    } else {
        for (i = 0; i < n; i++) {
            float gi = g[i] * gscale + l2 * w[i];
            float wi = w[i] - w[i] * decay;
            float v = s0[i] * mu - gi * lr;
            s0[i] = v;
            w[i] = wi + (v * mu - gi * lr);
        }
    }
}

/* Adam (Keras 3): m += (g − m)(1 − β1), v += (g² − v)(1 − β2), i.e.
   m = β1·m + (1 − β1)·g and v = β2·v + (1 − β2)·g² in the order Keras
   rounds them; w −= α·m / (sqrt(v) + ε) with the bias correction folded
   into α. s0 is m, s1 is v. */
static void mpt__adam_block(const mpt__update_job *j, float *MPT__RESTRICT w,
                            const float *MPT__RESTRICT g, float *MPT__RESTRICT s0,
                            float *MPT__RESTRICT s1, int64_t n) {
    const float gscale = j->gscale, l2 = j->l2, decay = j->decay;
    const float c1 = j->one_minus_b1, c2 = j->one_minus_b2, alpha = j->alpha, eps = j->epsilon;
    int64_t i;
    for (i = 0; i < n; i++) {
        float gi = g[i] * gscale + l2 * w[i];
        float mi = s0[i] + (gi - s0[i]) * c1;
        float vi = s1[i] + (gi * gi - s1[i]) * c2;
        float wi = w[i] - w[i] * decay;
        s0[i] = mi;
        s1[i] = vi;
        w[i] = wi - (mi * alpha) / (sqrtf(vi) + eps);
    }
}

#if MPT__X86
/* The loops above, 8 lanes at a time; the last n % 8 elements go through
   the portable loop. */
static MPT__TARGET_AVX2 void mpt__sgd_block_avx2(const mpt__update_job *j, float *w,
                                                 const float *g, float *s0, float *s1,
                                                 int64_t n) {
    const __m256 gscale = _mm256_set1_ps(j->gscale), l2 = _mm256_set1_ps(j->l2);
    const __m256 decay = _mm256_set1_ps(j->decay), lr = _mm256_set1_ps(j->lr);
    const __m256 mu = _mm256_set1_ps(j->momentum);
    int64_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 w0 = _mm256_loadu_ps(w + i);
        __m256 gi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(g + i), gscale),
                                  _mm256_mul_ps(l2, w0));
        __m256 wi = _mm256_sub_ps(w0, _mm256_mul_ps(w0, decay));
        __m256 step = _mm256_mul_ps(gi, lr);
        if (!s0) {
            wi = _mm256_sub_ps(wi, step);
        } else {
            __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(s0 + i), mu), step);
            _mm256_storeu_ps(s0 + i, v);
            wi = _mm256_add_ps(wi, j->nesterov ? _mm256_sub_ps(_mm256_mul_ps(v, mu), step) : v);
        }
        _mm256_storeu_ps(w + i, wi);
    }
    if (i < n) mpt__sgd_block(j, w + i, g + i, s0 ? s0 + i : NULL, s1, n - i);
}

static MPT__TARGET_AVX2 void mpt__adam_block_avx2(const mpt__update_job *j, float *w,
                                                  const float *g, float *s0, float *s1,
                                                  int64_t n) {
    const __m256 gscale = _mm256_set1_ps(j->gscale), l2 = _mm256_set1_ps(j->l2);
    const __m256 decay = _mm256_set1_ps(j->decay), alpha = _mm256_set1_ps(j->alpha);
    const __m256 c1 = _mm256_set1_ps(j->one_minus_b1), c2 = _mm256_set1_ps(j->one_minus_b2);
    const __m256 eps = _mm256_set1_ps(j->epsilon);
    int64_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 w0 = _mm256_loadu_ps(w + i), m0 = _mm256_loadu_ps(s0 + i);
        __m256 v0 = _mm256_loadu_ps(s1 + i);
        __m256 gi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(g + i), gscale),
                                  _mm256_mul_ps(l2, w0));
        __m256 mi = _mm256_add_ps(m0, _mm256_mul_ps(_mm256_sub_ps(gi, m0), c1));
        __m256 vi = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(gi, gi), v0), c2));
        __m256 wi = _mm256_sub_ps(w0, _mm256_mul_ps(w0, decay));
        __m256 den = _mm256_add_ps(_mm256_sqrt_ps(vi), eps);
        _mm256_storeu_ps(s0 + i, mi);
        _mm256_storeu_ps(s1 + i, vi);
        _mm256_storeu_ps(w + i, _mm256_sub_ps(wi, _mm256_div_ps(_mm256_mul_ps(mi, alpha), den)));
    }
    if (i < n) mpt__adam_block(j, w + i, g + i, s0 + i, s1 + i, n - i);
}
#endif

/* Updates elements [begin, end) of P, a block at a time, and converts each
   updated block of the master into the compute copy right away. */
static void mpt__update_span(void *arg, const mpt_update_args *u, int k, int64_t begin,
                             int64_t end) {
    const mpt__update_job *j = (const mpt__update_job *)arg;
    float *value = u->value[k], *s0 = u->slot0[k], *s1 = u->slot1[k];
    mpt_dtype cdt = u->compute_dtype[k];
    int copy = u->compute[k] != (void *)value;
    mpt__convert_fn convert = mpt__convert_kernel(j->ctx->cpu, cdt, MPT_FLOAT32);
    size_t csize = mpt_dtype_size(cdt);
    int64_t b;
    for (b = begin; b < end; b += MPT__OPT_BLOCK) {
        int64_t n = MPT__MIN((int64_t)MPT__OPT_BLOCK, end - b);
        j->block(j, value + b, u->grad[k] + b, s0 ? s0 + b : NULL, s1 ? s1 + b : NULL, n);
        if (copy)
            convert(cdt, (char *)u->compute[k] + (size_t)b * csize, MPT_FLOAT32, value + b, n);
    }
}

static void mpt__update_task(void *arg, int64_t task, int thread) {
    mpt__update_job *j = (mpt__update_job *)arg;
    int64_t begin = task * j->r.range;
    (void)thread;
    mpt__for_spans(j->u, begin, MPT__MIN(begin + j->r.range, j->r.total), mpt__update_span, j);
}

/* The per-step numbers of the update: the scheduled rate, Adam's α with
   its bias correction for t = optimizer_steps + 1, and the gradient
   multiplier, 1/scale (a reciprocal in double, as PyTorch; exact for a
   power of two) times min(1, c/‖g‖), ‖g‖ the global norm after unscaling. */
static void mpt__update_job_init(const mpt_update_args *u, mpt__update_job *j) {
    const mpt_optimizer_desc *d = &u->optimizer;
    const mpt_step_state *st = u->state;
    double lr = mpt__learning_rate_at(d, st->learning_rate, st->optimizer_steps);
    double inv_scale = 1.0 / (double)st->loss_scale;
    double norm = sqrt(st->sum_squares) * inv_scale, clip = 1.0;
    double t = (double)(st->optimizer_steps + 1);
    int sgd = d->type == MPT_OPTIMIZER_SGD;
    if (d->clip_global_norm > 0 && norm > d->clip_global_norm) clip = d->clip_global_norm / norm;
    j->block = sgd ? mpt__sgd_block : mpt__adam_block;
#if MPT__X86
    if (j->ctx->cpu & MPT_CPU_AVX2) j->block = sgd ? mpt__sgd_block_avx2 : mpt__adam_block_avx2;
#endif
    j->nesterov = d->nesterov != 0;
    j->gscale = (float)(inv_scale * clip);
    j->l2 = d->l2;
    j->decay = (float)(lr * d->weight_decay);
    j->lr = (float)lr;
    j->momentum = d->momentum;
    j->one_minus_b1 = (float)(1.0 - d->beta_1);
    j->one_minus_b2 = (float)(1.0 - d->beta_2);
    j->alpha = (float)(lr * sqrt(1.0 - pow(d->beta_2, t)) / (1.0 - pow(d->beta_1, t)));
    j->epsilon = d->epsilon;
}

/* The CPU backend's second pass (mpt_backend.update): when the first found
   every gradient finite, one update of every parameter, else nothing at
   all changes. Allocates nothing. */
static void mpt__cpu_update(void *impl, const mpt_update_args *u) {
    mpt__update_job j;
    if (!u->state->finite) return;
    memset(&j, 0, sizeof j);
    j.ctx = (const mpt_context *)impl;
    j.u = u;
    j.r = mpt__opt_ranges(u);
    mpt__update_job_init(u, &j);
    mpt__parallel_for((mpt_context *)impl, j.r.n_tasks, mpt__update_task, &j);
    u->state->optimizer_steps++;
}

/* ---- loss scaling ----------------------------------------------------------- */

/* @backend-shared's mpt__loss_scale_next, the rule the CUDA backend runs too. */
static void mpt__cpu_loss_scale_update(void *impl, const mpt_loss_scale_desc *d,
                                       mpt_step_state *st) {
    (void)impl;
    mpt__loss_scale_next(d, st);
}

/* ---- the optimizer's state, and the arrays of it the backend walks -------- */

static void mpt__free_update_args(mpt_model *m) {
    mpt__free(m->ctx, (void *)m->update.value);
    memset(&m->update, 0, sizeof m->update);
}

/* The arrays of pointers the backend's optimizer walks (one allocation:
   value, grad, slot0, slot1, compute, then compute_dtype and count). */
static mpt_status mpt__build_update_args(mpt_model *m) {
    mpt_update_args *u = &m->update;
    size_t n = 0, ptrs;
    unsigned char *block;
    int i;
    mpt__free_update_args(m);
    for (i = 0; i < m->n_params; i++) n += m->params[i].trainable != 0;
    ptrs = 5 * n * sizeof(void *);
    block = (unsigned char *)mpt__calloc(m->ctx, ptrs + n * (sizeof(mpt_dtype) + sizeof(int64_t)) + 1);
    if (!block) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
    {
        float **value = (float **)block, **grad = value + n, **slot0 = grad + n;
        float **slot1 = slot0 + n;
        void **compute = (void **)(slot1 + n);
        int64_t *count = (int64_t *)(block + ptrs);
        mpt_dtype *dtype = (mpt_dtype *)(count + n);
        int k = 0;
        for (i = 0; i < m->n_params; i++) {
            const mpt__param *P = &m->params[i];
            if (!P->trainable) continue;
            value[k] = P->value;
            grad[k] = P->grad;
            slot0[k] = P->slot[0];
            slot1[k] = P->slot[1];
            compute[k] = P->compute;
            count[k] = P->count;
            dtype[k] = P->compute_dtype;
            k++;
        }
        u->n = (int)n;
        u->value = value;
        u->grad = (const float *const *)grad;
        u->slot0 = slot0;
        u->slot1 = slot1;
        u->compute = compute;
        u->compute_dtype = dtype;
        u->count = count;
    }
    u->optimizer = m->compile.optimizer;
    u->state = m->state;
    return MPT_OK;
}

/* The optimizer's state, m->n_slots float32 tensors per trainable
   parameter, zero-filled: allocated by build when the model is compiled
   first, or by compile when it is built first (and again on recompiling,
   which starts the optimizer afresh, as in Keras). */
static int64_t mpt__optimizer_state_bytes(const mpt_model *m) {
    int64_t floats = 0;
    int i;
    for (i = 0; i < m->n_params; i++)
        if (m->params[i].trainable) floats += m->params[i].count * m->n_slots;
    return floats * (int64_t)sizeof(float);
}

static mpt_status mpt__alloc_optimizer_state(mpt_model *m) {
    int64_t floats = mpt__optimizer_state_bytes(m) / (int64_t)sizeof(float), held = 0;
    float *next;
    void *block = NULL;
    int i, s;
    m->be->free(m->impl, MPT__MEM_OPTIMIZER, m->arena[MPT__MEM_OPTIMIZER]);
    m->arena[MPT__MEM_OPTIMIZER] = NULL;
    m->arena_bytes[MPT__MEM_OPTIMIZER] = 0;
    for (i = 0; i < m->n_params; i++) m->params[i].slot[0] = m->params[i].slot[1] = NULL;
    for (i = 0; i < MPT__MEM_COUNT_; i++) held += m->arena_bytes[i];
    MPT__CHECK(mpt__within_memory_limit(m, MPT__MEM_OPTIMIZER, held, floats * 4));
    if (floats == 0) return mpt__build_update_args(m);
    if (m->be->alloc(m->impl, MPT__MEM_OPTIMIZER, (size_t)floats * sizeof(float), &block) != MPT_OK)
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "model: cannot allocate %lld bytes of optimizer state: %s",
                         (long long)floats * 4, m->be->error(m->impl));
    m->be->zero(m->impl, block, (size_t)floats * sizeof(float));
    next = (float *)block;
    m->arena[MPT__MEM_OPTIMIZER] = next;
    m->arena_bytes[MPT__MEM_OPTIMIZER] = floats * 4;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        for (s = 0; P->trainable && s < m->n_slots; s++) {
            P->slot[s] = next;
            next += P->count;
        }
    }
    return mpt__build_update_args(m);
}

/* ---- compile and the public accessors --------------------------------------- */

/* Whether a float16 layer will need loss scaling: the policy says so, or a
   layer added so far overrides its dtype to float16. */
static int mpt__model_any_float16(const mpt_model *m) {
    int i;
    if (m->policy_dtype == MPT_FLOAT16) return 1;
    for (i = 0; i < m->n_layers; i++)
        if (m->layers[i].dtype == MPT_FLOAT16) return 1;
    return 0;
}

static mpt_status mpt__compile_check(mpt_model *m, const mpt_compile_desc *d) {
    const int known_metrics = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K;
    if (d->loss.type == MPT_LOSS_NONE)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "compile: loss.type is required (MPT_LOSS_NONE given)");
    MPT__CHECK(mpt__loss_check_desc(m->ctx, &d->loss));
    if (d->metrics & ~known_metrics)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "compile: metrics 0x%x has unknown bits 0x%x (known: 0x%x)",
                         (unsigned)d->metrics, (unsigned)(d->metrics & ~known_metrics),
                         (unsigned)known_metrics);
    if (d->top_k < 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "compile: top_k %d must be >= 0 (0: 5)",
                         d->top_k);
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_compile(mpt_model *m, const mpt_compile_desc *desc) {
    mpt_compile_desc r, defaults;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    memset(&defaults, 0, sizeof defaults);
    if (!desc) desc = &defaults; /* NULL: every default; loss.type is required */
    /* Everything is checked before anything changes: a compile refused
       for its arguments leaves the model as it was. One that runs out of
       memory for the optimizer state of a built model has already dropped
       the old state: the model is then not compiled (compile it again). */
    MPT__CHECK(mpt__compile_check(m, desc));
    r = *desc;
    if (r.top_k == 0) r.top_k = 5;
    MPT__CHECK(mpt__optimizer_resolve(m->ctx, &desc->optimizer, &r.optimizer));
    MPT__CHECK(mpt__loss_scale_resolve(m->ctx, &desc->loss_scale, mpt__model_any_float16(m),
                                       &r.loss_scale));
    m->compile = r;
    m->n_slots = mpt__optimizer_slot_count(&r.optimizer);
    m->learning_rate = r.optimizer.learning_rate;
    m->loss_scale = r.loss_scale.mode == MPT_LOSS_SCALE_NONE ? 1.0f : r.loss_scale.initial_scale;
    m->optimizer_steps = m->good_steps = m->skipped_steps = 0;
    m->compiled = 1;
    /* Recompiling starts the optimizer afresh (zeroed slots), as in Keras. */
    if (m->built && mpt__alloc_optimizer_state(m) != MPT_OK) {
        m->compiled = 0; /* no slots to step with */
        return MPT_ERR_OUT_OF_MEMORY;
    }
    {
        int k;
        for (k = 1; k < m->n_replicas; k++) MPT__CHECK(mpt_model_compile(m->replica[k], &r));
    }
    return MPT_OK;
}

MPTDEF float mpt_model_learning_rate(const mpt_model *m) { return m ? m->learning_rate : 0.0f; }

MPTDEF mpt_status mpt_model_set_learning_rate(mpt_model *m, float learning_rate) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "set_learning_rate: compile the model first (compile sets the rate)");
    if (!mpt__in_range(learning_rate, 0, INFINITY))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "set_learning_rate: learning_rate %g must be finite and >= 0",
                         (double)learning_rate);
    m->learning_rate = learning_rate;
    return MPT_OK;
}

/* 1 before compile and when not scaling. */
MPTDEF float mpt_model_loss_scale(const mpt_model *m) {
    if (!m) return 0.0f;
    return m->compiled ? m->loss_scale : 1.0f;
}
/* =============================================================================
   @impl-data: datasets over caller arrays and IDX files, and the batch loader
   =============================================================================

   A dataset is x (n, sample shape...) in uint8, float32, float16 or
   bfloat16, and y: int32 class ids (n,) or float32 targets (n, ...). uint8
   images stay uint8 in memory (a quarter of float32) and are normalised
   (x·scale + offset) only when a batch is gathered, through a 256-entry
   table per dtype, so every value is rounded exactly once, as mpt__convert
   rounds it.

   A view (mpt_dataset_split) points into its root's buffers. The root
   counts its live views and frees its buffers when the last of itself and
   its views is destroyed, so destroying them in any order is safe. (The
   count is not atomic: a dataset and its views are split and destroyed on
   one thread at a time, as a context is used.)

   The loader gathers batch i + 1 on its own thread (not the pool, which
   serves one job at a time and is busy with batch i) into the second of
   two buffers allocated up front: fit allocates nothing per batch.

   Internal API for the training loop (train.h):
     mpt__dataset_label_dtype / _label_range / _label_shape
     mpt__dataset_gather                   samples in any order, normalised
     mpt__loader_create / _start_epoch / _next / _destroy   prefetching */



struct mpt_dataset {
    mpt_context *ctx;             /* allocated this struct                       */
    mpt_dataset *root;            /* owner of the buffers: itself, or a view's root */
    int refs;                     /* root: itself + its live views               */
    int64_t n;                    /* samples                                     */
    mpt_dtype x_dtype;            /* uint8, float32, float16 or bfloat16         */
    int x_rank;                   /* one sample's rank, 1..3                     */
    int64_t x_shape[MPT_MAX_RANK - 1];
    int64_t x_count;              /* elements of one sample                      */
    const void *x;                /* (n, x_shape) x_dtype, this dataset's sample 0 */
    mpt_dtype y_dtype;            /* int32 class ids or float32 targets          */
    int y_rank;                   /* one target's rank: 0 for class ids          */
    int64_t y_shape[MPT_MAX_RANK - 1];
    int64_t y_count;              /* elements of one target: 1 for class ids     */
    const void *y;                /* (n, y_shape) y_dtype                        */
    int32_t label_min, label_max; /* class ids: their range over these n samples */
    float scale, offset;          /* uint8 x: x·scale + offset                   */
    float u8_f32[256];            /* uint8 x: each byte value normalised         */
    mpt_half u8_f16[256];         /*   the same, rounded to float16              */
    mpt_bf16 u8_bf16[256];        /*   the same, rounded to bfloat16             */
    void *owned_x, *owned_y;      /* root: buffers freed with it; NULL if borrowed */
};

/* ---- the dataset object --------------------------------------------------- */

static mpt_dataset *mpt__dataset_new(mpt_context *ctx) {
    mpt_dataset *d = (mpt_dataset *)mpt__calloc(ctx, sizeof *d);
    if (!d) return NULL;
    d->ctx = ctx;
    d->root = d;
    d->refs = 1;
    return d;
}

/* The normalisation tables. fmaf rounds x·scale + offset once, whatever
   the compiler's contraction settings, so every build agrees. */
static void mpt__dataset_set_scale(mpt_dataset *d, float scale, float offset) {
    int i;
    d->scale = scale;
    d->offset = offset;
    for (i = 0; i < 256; i++) {
        d->u8_f32[i] = fmaf((float)i, scale, offset);
        d->u8_f16[i] = mpt_float_to_half(d->u8_f32[i]);
        d->u8_bf16[i] = mpt_float_to_bf16(d->u8_f32[i]);
    }
}

static void mpt__dataset_find_label_range(mpt_dataset *d) {
    const int32_t *y = (const int32_t *)d->y; /* (n) */
    int64_t i;
    if (d->y_dtype != MPT_INT32) return;
    d->label_min = d->label_max = y[0];
    for (i = 1; i < d->n; i++) {
        d->label_min = MPT__MIN(d->label_min, y[i]);
        d->label_max = MPT__MAX(d->label_max, y[i]);
    }
}

static void mpt__dataset_release(mpt_dataset *root) {
    if (--root->refs > 0) return;
    mpt__free(root->ctx, root->owned_x);
    mpt__free(root->ctx, root->owned_y);
    mpt__free(root->ctx, root);
}

MPTDEF void mpt_dataset_destroy(mpt_dataset *d) {
    mpt_dataset *root;
    if (!d) return;
    root = d->root;
    if (d != root) mpt__free(d->ctx, d);
    mpt__dataset_release(root);
}

MPTDEF int64_t mpt_dataset_count(const mpt_dataset *d) { return d ? d->n : 0; }

MPTDEF int mpt_dataset_sample_shape(const mpt_dataset *d, int64_t *shape) {
    if (!d) return 0;
    if (shape) memcpy(shape, d->x_shape, sizeof(int64_t) * (size_t)d->x_rank);
    return d->x_rank;
}

/* ---- mpt_dataset_create: checking caller arrays --------------------------- */

/* Index of the first NaN or inf among n elements of a float dtype, or -1. */
static int64_t mpt__first_nonfinite(mpt_dtype dtype, const void *data, int64_t n) {
    int64_t i;
    if (dtype == MPT_FLOAT32) {
        /* The bits, through memcpy (one load): no aliasing question, and
           no -ffast-math that could fold isfinite() to 1. */
        const float *f = (const float *)data; /* (n) */
        for (i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, f + i, 4);
            if ((u & 0x7f800000u) == 0x7f800000u) return i;
        }
    } else {
        /* float16: exponent 0x7c00; bfloat16: 0x7f80 */
        const uint16_t *u = (const uint16_t *)data; /* (n) half bits */
        uint16_t e = dtype == MPT_FLOAT16 ? 0x7c00u : 0x7f80u;
        for (i = 0; i < n; i++)
            if ((u[i] & e) == e) return i;
    }
    return -1;
}

/* NaN and inf in x or y, named by sample and element. */
static mpt_status mpt__check_finite(mpt_context *ctx, const char *what, const mpt_tensor *t) {
    int64_t n = mpt_tensor_count(t), per = n / t->shape[0];
    int64_t bad = mpt__first_nonfinite(t->dtype, t->data, n);
    if (bad < 0) return MPT_OK;
    return mpt__fail(ctx, MPT_ERR_NUMERIC,
                     "dataset: %s sample %lld holds %g (element %lld of the sample, %s)", what,
                     (long long)(bad / per), (double)mpt__load_f32(t->dtype, t->data, bad),
                     (long long)(bad % per), mpt_dtype_name(t->dtype));
}

static mpt_status mpt__check_dataset_tensor(mpt_context *ctx, const char *what,
                                            const mpt_tensor *t) {
    char s[96];
    int64_t count, bytes;
    int i;
    if (!t) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: NULL %s", what);
    if (mpt_dtype_size(t->dtype) == 0)
        return mpt__fail(ctx, MPT_ERR_DTYPE, "dataset: %s has unknown dtype %d", what,
                         (int)t->dtype);
    if (t->rank < 1 || t->rank > MPT_MAX_RANK)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "dataset: %s has rank %d, not 1..%d", what, t->rank,
                         MPT_MAX_RANK);
    mpt_shape_format(s, sizeof s, t->rank, t->shape);
    for (i = 0; i < t->rank; i++)
        if (t->shape[i] <= 0)
            return mpt__fail(ctx, MPT_ERR_SHAPE, "dataset: %s shape %s has a dimension <= 0",
                             what, s);
    count = mpt__shape_count(t->rank, t->shape);
    if (count < 0 || !mpt__mul_ok(count, (int64_t)mpt_dtype_size(t->dtype), &bytes) ||
        (uint64_t)bytes > (uint64_t)SIZE_MAX)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "dataset: %s shape %s is too large", what, s);
    if (!t->data)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: %s has NULL data", what);
    if (t->device != MPT_DEVICE_CPU)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED, "dataset: %s must be in CPU memory", what);
    return MPT_OK;
}

static mpt_status mpt__check_dataset_x(mpt_context *ctx, const mpt_tensor *x) {
    char s[96];
    if (x->dtype != MPT_UINT8 && !mpt_dtype_is_float(x->dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "dataset: x dtype %s is not uint8, float32, float16 or bfloat16",
                         mpt_dtype_name(x->dtype));
    if (x->rank < 2)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: x shape %s needs rank >= 2: (n, sample...)",
                         mpt_shape_format(s, sizeof s, x->rank, x->shape));
    return mpt_dtype_is_float(x->dtype) ? mpt__check_finite(ctx, "x", x) : MPT_OK;
}

/* y: int32 class ids (n,) or (n, 1), each >= 0; or float32 targets (n, ...),
   (n,) being one number per sample (for an output of one unit). */
static mpt_status mpt__check_dataset_y(mpt_context *ctx, const mpt_tensor *y) {
    char s[96];
    int64_t i;
    mpt_shape_format(s, sizeof s, y->rank, y->shape);
    if (y->dtype == MPT_FLOAT32) return mpt__check_finite(ctx, "y", y);
    if (y->dtype != MPT_INT32)
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "dataset: y dtype %s is neither int32 (class ids) nor float32 (targets)",
                         mpt_dtype_name(y->dtype));
    if (y->rank > 2 || (y->rank == 2 && y->shape[1] != 1))
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: int32 class ids y %s must be (n,) or (n, 1); one-hot or "
                         "other targets are float32", s);
    for (i = 0; i < y->shape[0]; i++)
        if (((const int32_t *)y->data)[i] < 0)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "dataset: y sample %lld is class id %d, which is negative",
                             (long long)i, (int)((const int32_t *)y->data)[i]);
    return MPT_OK;
}

static mpt_status mpt__check_dataset_desc(mpt_context *ctx, const mpt_dataset_desc *desc) {
    char sx[96], sy[96];
    if (!desc) /* NULL: every default, but x and y are required */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: x and y are required (NULL "
                         "descriptor)");
    MPT__CHECK(mpt__check_dataset_tensor(ctx, "x", desc->x));
    MPT__CHECK(mpt__check_dataset_tensor(ctx, "y", desc->y));
    if (desc->x->shape[0] != desc->y->shape[0])
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: x %s has %lld samples but y %s has %lld",
                         mpt_shape_format(sx, sizeof sx, desc->x->rank, desc->x->shape),
                         (long long)desc->x->shape[0],
                         mpt_shape_format(sy, sizeof sy, desc->y->rank, desc->y->shape),
                         (long long)desc->y->shape[0]);
    if (!isfinite(desc->scale) || !isfinite(desc->offset))
        return mpt__fail(ctx, MPT_ERR_NUMERIC, "dataset: scale %g and offset %g must be finite",
                         (double)desc->scale, (double)desc->offset);
    MPT__CHECK(mpt__check_dataset_x(ctx, desc->x));
    return mpt__check_dataset_y(ctx, desc->y);
}

/* d->x or d->y: the caller's buffer, or an owned copy of it. */
static mpt_status mpt__dataset_take(mpt_context *ctx, const mpt_tensor *t, int copy,
                                    const void **data, void **owned) {
    size_t bytes = mpt_tensor_bytes(t);
    *data = t->data;
    if (!copy) return MPT_OK;
    *owned = mpt__alloc(ctx, bytes);
    if (!*owned)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset: cannot allocate %zu bytes to copy",
                         bytes);
    memcpy(*owned, t->data, bytes);
    *data = *owned;
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_create(mpt_context *ctx, const mpt_dataset_desc *desc,
                                     mpt_dataset **out) {
    mpt_dataset *d;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: NULL out");
    *out = NULL;
    MPT__CHECK(mpt__check_dataset_desc(ctx, desc));
    d = mpt__dataset_new(ctx);
    if (!d) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset: out of memory");
    d->n = desc->x->shape[0];
    d->x_dtype = desc->x->dtype;
    d->x_rank = desc->x->rank - 1;
    memcpy(d->x_shape, desc->x->shape + 1, sizeof(int64_t) * (size_t)d->x_rank);
    d->x_count = mpt__shape_count(d->x_rank, d->x_shape);
    d->y_dtype = desc->y->dtype;
    d->y_rank = d->y_dtype == MPT_INT32 ? 0 : desc->y->rank - 1;
    memcpy(d->y_shape, desc->y->shape + 1, sizeof(int64_t) * (size_t)d->y_rank);
    d->y_count = mpt__shape_count(d->y_rank, d->y_shape);
    s = mpt__dataset_take(ctx, desc->x, desc->copy, &d->x, &d->owned_x);
    if (s == MPT_OK) s = mpt__dataset_take(ctx, desc->y, desc->copy, &d->y, &d->owned_y);
    if (s != MPT_OK) {
        mpt_dataset_destroy(d);
        return s;
    }
    mpt__dataset_set_scale(d, desc->scale != 0 ? desc->scale : 1.0f / 255.0f, desc->offset);
    mpt__dataset_find_label_range(d);
    *out = d;
    return MPT_OK;
}

/* ---- views ---------------------------------------------------------------- */

static mpt_dataset *mpt__dataset_view(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                      int64_t n) {
    mpt_dataset *v = (mpt_dataset *)mpt__alloc(ctx, sizeof *v);
    if (!v) return NULL;
    *v = *d;
    v->ctx = ctx;
    v->refs = 0;
    v->owned_x = v->owned_y = NULL;
    v->n = n;
    v->x = (const char *)d->x +
           (size_t)first * (size_t)d->x_count * mpt_dtype_size(d->x_dtype);
    v->y = (const char *)d->y +
           (size_t)first * (size_t)d->y_count * mpt_dtype_size(d->y_dtype);
    mpt__dataset_find_label_range(v);
    /* The one change split makes to its const argument: the root counts
       the view, so that it outlives it whatever the order of destroys. */
    v->root->refs++;
    return v;
}

MPTDEF mpt_status mpt_dataset_split(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                    mpt_dataset **head, mpt_dataset **tail) {
    mpt_dataset *h = NULL, *t = NULL;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (head) *head = NULL;
    if (tail) *tail = NULL;
    if (!d || (!head && !tail))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset split: NULL %s",
                         d ? "head and tail" : "dataset");
    if (first <= 0 || first >= d->n)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "dataset split: first %lld leaves a part empty (the dataset has %lld "
                         "samples; first must be in 1..%lld)",
                         (long long)first, (long long)d->n, (long long)d->n - 1);
    if (head && !(h = mpt__dataset_view(ctx, d, 0, first)))
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset split: out of memory");
    if (tail && !(t = mpt__dataset_view(ctx, d, first, d->n - first))) {
        mpt_dataset_destroy(h);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset split: out of memory");
    }
    if (head) *head = h;
    if (tail) *tail = t;
    return MPT_OK;
}

/* ---- reshape, and reading the labels back ---------------------------------- */

MPTDEF mpt_status mpt_dataset_reshape(mpt_context *ctx, mpt_dataset *d, int rank,
                                      const int64_t *shape) {
    char want[96], got[96];
    int64_t count;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!d || !shape)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset reshape: NULL %s",
                         d ? "shape" : "dataset");
    if (rank < 1 || rank > MPT_MAX_RANK - 1)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "dataset reshape: rank %d is not 1..%d", rank,
                         MPT_MAX_RANK - 1);
    mpt_shape_format(want, sizeof want, rank, shape);
    mpt_shape_format(got, sizeof got, d->x_rank, d->x_shape);
    count = mpt__shape_count(rank, shape); /* -1 for a dimension <= 0 or an overflow */
    if (count != d->x_count)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset reshape: samples of shape %s (%lld elements) cannot become %s",
                         got, (long long)d->x_count, want);
    d->x_rank = rank;
    memcpy(d->x_shape, shape, sizeof(int64_t) * (size_t)rank);
    return MPT_OK;
}

MPTDEF int mpt_dataset_target_shape(const mpt_dataset *d, int64_t *shape) {
    if (!d) return 0;
    if (shape) memcpy(shape, d->y_shape, sizeof(int64_t) * (size_t)d->y_rank);
    return d->y_rank;
}

/* The checks mpt_dataset_labels and _targets share: d holds `dtype`
   targets (the other kind is named), and [first, first + count) are
   samples of d. */
static mpt_status mpt__check_label_range(mpt_context *ctx, const char *what,
                                         const mpt_dataset *d, mpt_dtype dtype, int64_t first,
                                         int64_t count, const void *out) {
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!d || !out)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset %s: NULL %s", what,
                         d ? what : "dataset");
    if (d->y_dtype != dtype)
        return mpt__fail(ctx, MPT_ERR_DTYPE, "dataset %s: the dataset holds %s; use "
                         "mpt_dataset_%s", what,
                         d->y_dtype == MPT_INT32 ? "int32 class ids" : "float32 targets",
                         d->y_dtype == MPT_INT32 ? "labels" : "targets");
    if (first < 0 || first >= d->n || count < 0 || count > d->n - first)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "dataset %s: %lld samples from sample %lld are not all there (the "
                         "dataset has %lld: 0..%lld)", what, (long long)count, (long long)first,
                         (long long)d->n, (long long)d->n - 1);
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_labels(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                     int64_t count, int32_t *labels) {
    MPT__CHECK(mpt__check_label_range(ctx, "labels", d, MPT_INT32, first, count, labels));
    memcpy(labels, (const int32_t *)d->y + first, sizeof(int32_t) * (size_t)count);
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_targets(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                      int64_t count, float *targets) {
    MPT__CHECK(mpt__check_label_range(ctx, "targets", d, MPT_FLOAT32, first, count, targets));
    memcpy(targets, (const float *)d->y + first * d->y_count,
           sizeof(float) * (size_t)(count * d->y_count));
    return MPT_OK;
}

/* ---- what the training loop reads ----------------------------------------- */

/* MPT_INT32 (class ids) or MPT_FLOAT32 (targets). */
static mpt_dtype mpt__dataset_label_dtype(const mpt_dataset *d) { return d->y_dtype; }

/* 1 and the smallest and largest class id for class ids; 0 for targets. */
static int mpt__dataset_label_range(const mpt_dataset *d, int32_t *min, int32_t *max) {
    if (d->y_dtype != MPT_INT32) return 0;
    if (min) *min = d->label_min;
    if (max) *max = d->label_max;
    return 1;
}

/* One sample's target shape (for comparing with the model's output); returns
   its rank, 0 for class ids. */
static int mpt__dataset_label_shape(const mpt_dataset *d, int64_t *shape) {
    return mpt_dataset_target_shape(d, shape);
}

/* n uint8 values normalised into dtype through the dataset's tables. */
static void mpt__expand_u8(const mpt_dataset *d, mpt_dtype dtype, void *dst, const uint8_t *src,
                           int64_t n) {
    int64_t i;
    if (dtype == MPT_FLOAT32) {
        float *o = (float *)dst; /* (n) */
        for (i = 0; i < n; i++) o[i] = d->u8_f32[src[i]];
    } else {
        const uint16_t *table = dtype == MPT_FLOAT16 ? d->u8_f16 : d->u8_bf16;
        uint16_t *o = (uint16_t *)dst; /* (n) */
        for (i = 0; i < n; i++) o[i] = table[src[i]];
    }
}

/* Writes samples indices[0..n) (each in [0, count)) of d, in that order,
   into x (n, sample shape) in x_dtype (float32, float16 or bfloat16) and y
   (n, label count) int32 or float32; either may be NULL when not wanted.
   Serial and never uses the pool, so the loader's thread may call it while
   the pool works; ctx only picks the vector conversion (NULL: portable). */
static void mpt__dataset_gather(mpt_context *ctx, const mpt_dataset *d,
                                       const int64_t *indices, int64_t n, mpt_dtype x_dtype,
                                       void *x, void *y) {
    size_t x_in = (size_t)d->x_count * mpt_dtype_size(d->x_dtype);
    size_t x_out = (size_t)d->x_count * mpt_dtype_size(x_dtype);
    size_t y_bytes = (size_t)d->y_count * 4; /* int32 or float32 */
    mpt__convert_fn convert = NULL;
    int64_t i;
    if (d->x_dtype != MPT_UINT8 && d->x_dtype != x_dtype)
        convert = mpt__convert_kernel(ctx ? ctx->cpu : 0, x_dtype, d->x_dtype);
    for (i = 0; x && i < n; i++) {
        const char *src = (const char *)d->x + (size_t)indices[i] * x_in;
        char *dst = (char *)x + (size_t)i * x_out;
        if (d->x_dtype == MPT_UINT8)
            mpt__expand_u8(d, x_dtype, dst, (const uint8_t *)src, d->x_count);
        else if (convert)
            convert(x_dtype, dst, d->x_dtype, src, d->x_count);
        else
            memcpy(dst, src, x_in);
    }
    for (i = 0; y && i < n; i++)
        memcpy((char *)y + (size_t)i * y_bytes, (const char *)d->y + (size_t)indices[i] * y_bytes,
               y_bytes);
}

/* ---- files: gzip through zlib, or plain -----------------------------------

   A file that starts with gzip's magic bytes (1f 8b) is inflated member
   after member (concatenated members are one stream, as gzip -d reads
   them); any other file is read as it is. After the last member the file
   must end: zlib's gzread would skip bytes there that do not start another
   member ("trailing garbage"), so a damaged .gz file would load where the
   same damage to a plain one is refused. */

#define MPT__FILE_CHUNK ((size_t)1 << 17) /* bytes read at a time: fewer reads of 26 MB */

typedef struct mpt__file {
    const char *path;
    FILE *f;
    int cut;              /* the gzip stream ended early: a truncated .gz file */
#ifndef MPT_NO_ZLIB
    mpt_context *ctx;     /* allocated `in`                                 */
    int started;          /* the first bytes were looked at                 */
    int gz;               /* gzip: read through inflate                     */
    int inflating;        /* inflateInit2 succeeded: inflateEnd is due      */
    int member_ended;     /* a member's CRC and length checked, no next yet */
    int eof;              /* fread reached the end of the file              */
    int64_t file_bytes;   /* bytes read from the file so far                */
    z_stream z;           /* z.next_in, z.avail_in: the unused part of in   */
    unsigned char *in;    /* (MPT__FILE_CHUNK) the file's bytes read ahead  */
#endif
} mpt__file;

static mpt_status mpt__file_open(mpt_context *ctx, mpt__file *f, const char *path) {
    int fd;
    f->path = path;
    MPT__CHECK(mpt__open_regular(ctx, "", path, &fd, NULL));
    /* ISO C has no fdopen: the path is opened again, now known to be a
       regular file (only a rename in between could swap it). */
    close(fd);
    errno = 0;
    f->f = fopen(path, "rb");
    if (!f->f)
        return mpt__fail(ctx, MPT_ERR_IO, "cannot open '%s': %s", path,
                         errno ? strerror(errno) : "out of memory");
    return MPT_OK;
}

static void mpt__file_close(mpt__file *f) {
#ifndef MPT_NO_ZLIB
    if (f->inflating) inflateEnd(&f->z);
    f->inflating = 0;
    if (f->in) mpt__free(f->ctx, f->in);
    f->in = NULL;
#endif
    if (f->f) fclose(f->f);
    f->f = NULL;
}

static mpt_status mpt__file_read_error(mpt_context *ctx, const mpt__file *f) {
    return mpt__fail(ctx, MPT_ERR_IO, "cannot read '%s': %s", f->path, strerror(errno));
}

/* Up to n bytes as they are in the file (what was read ahead first). */
static mpt_status mpt__file_read_plain(mpt_context *ctx, mpt__file *f, void *buf, int64_t n,
                                       int64_t *got) {
    size_t r;
#ifndef MPT_NO_ZLIB
    size_t ahead = (size_t)MPT__MIN(n, (int64_t)f->z.avail_in);
    memcpy(buf, f->z.next_in, ahead);
    f->z.next_in += ahead;
    f->z.avail_in -= (uInt)ahead;
    *got = (int64_t)ahead;
#endif
    r = fread((char *)buf + *got, 1, (size_t)(n - *got), f->f);
    *got += (int64_t)r;
    if (*got < n && ferror(f->f)) return mpt__file_read_error(ctx, f);
    return MPT_OK;
}

#ifndef MPT_NO_ZLIB

/* Reads more of the file behind the bytes inflate has not used yet. */
static mpt_status mpt__gz_fill(mpt_context *ctx, mpt__file *f) {
    size_t keep = f->z.avail_in, r;
    if (f->eof) return MPT_OK;
    memmove(f->in, f->z.next_in, keep);
    r = fread(f->in + keep, 1, MPT__FILE_CHUNK - keep, f->f);
    if (r < MPT__FILE_CHUNK - keep) {
        if (ferror(f->f)) return mpt__file_read_error(ctx, f);
        f->eof = 1;
    }
    f->file_bytes += (int64_t)r;
    f->z.next_in = f->in;
    f->z.avail_in = (uInt)(keep + r);
    return MPT_OK;
}

/* The first read: the buffer, and gzip or not by the first two bytes. */
static mpt_status mpt__file_start(mpt_context *ctx, mpt__file *f) {
    f->started = 1;
    f->ctx = ctx;
    f->in = (unsigned char *)mpt__alloc(ctx, MPT__FILE_CHUNK);
    if (!f->in) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': out of memory", f->path);
    f->z.next_in = f->in;
    f->z.avail_in = 0;
    MPT__CHECK(mpt__gz_fill(ctx, f));
    f->gz = f->z.avail_in >= 2 && f->in[0] == 0x1f && f->in[1] == 0x8b;
    if (!f->gz) return MPT_OK;
    if (inflateInit2(&f->z, 16 + MAX_WBITS) != Z_OK) /* 16: the gzip wrapper only */
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': zlib is out of memory",
                         f->path);
    f->inflating = 1;
    return MPT_OK;
}

/* After a member: the end of the file, or the next member (*more). */
static mpt_status mpt__gz_next_member(mpt_context *ctx, mpt__file *f, int *more) {
    struct stat st;
    int64_t at;
    *more = 0;
    if (f->z.avail_in < 2) MPT__CHECK(mpt__gz_fill(ctx, f));
    if (f->z.avail_in == 0) return MPT_OK;
    if (f->z.avail_in >= 2 && f->z.next_in[0] == 0x1f && f->z.next_in[1] == 0x8b) {
        inflateReset(&f->z);
        *more = 1;
        return MPT_OK;
    }
    at = f->file_bytes - (int64_t)f->z.avail_in;
    if (stat(f->path, &st) != 0 || (int64_t)st.st_size <= at)
        return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' has bytes after the end of its gzip data "
                         "(at byte %lld) that are not another gzip member", f->path,
                         (long long)at);
    return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' has %lld byte%s after the end of its gzip data "
                     "(at byte %lld of %lld) that %s not another gzip member", f->path,
                     (long long)(st.st_size - at), st.st_size - at == 1 ? "" : "s",
                     (long long)at, (long long)st.st_size, st.st_size - at == 1 ? "is" : "are");
}

static mpt_status mpt__gz_error(mpt_context *ctx, const mpt__file *f, int err) {
    if (err == Z_MEM_ERROR)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': zlib is out of memory",
                         f->path);
    /* zlib decompresses ahead of what was asked, so where the damage is
       cannot be told. */
    return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' is corrupted: bad gzip data (zlib: %s)", f->path,
                     f->z.msg ? f->z.msg : "inflate failed");
}

/* Up to n decompressed bytes; fewer at the end of the last member, or
   where the file ends inside a member (f->cut). */
static mpt_status mpt__gz_read(mpt_context *ctx, mpt__file *f, void *buf, int64_t n,
                               int64_t *got) {
    while (*got < n) {
        int more, err;
        /* avail_out counts in unsigned int: at most 1 GiB at a time */
        uInt ask = (uInt)MPT__MIN(n - *got, (int64_t)1 << 30);
        if (f->member_ended) {
            MPT__CHECK(mpt__gz_next_member(ctx, f, &more));
            if (!more) return MPT_OK;
            f->member_ended = 0;
        }
        if (f->z.avail_in == 0) MPT__CHECK(mpt__gz_fill(ctx, f));
        if (f->z.avail_in == 0) {
            f->cut = 1;
            return MPT_OK;
        }
        f->z.next_out = (Bytef *)buf + *got;
        f->z.avail_out = ask;
        err = inflate(&f->z, Z_NO_FLUSH);
        *got += (int64_t)(ask - f->z.avail_out);
        if (err == Z_STREAM_END) f->member_ended = 1;
        else if (err != Z_OK) return mpt__gz_error(ctx, f, err);
    }
    return MPT_OK;
}

#endif /* MPT_NO_ZLIB */

/* Reads up to n bytes; *got is less than n only at the end of the file,
   where f->cut tells a gzip stream cut short (the caller, which knows how
   many bytes it expected, words that error). */
static mpt_status mpt__file_read(mpt_context *ctx, mpt__file *f, void *buf, int64_t n,
                                 int64_t *got) {
    *got = 0;
#ifndef MPT_NO_ZLIB
    if (!f->started) MPT__CHECK(mpt__file_start(ctx, f));
    if (f->gz) return mpt__gz_read(ctx, f, buf, n, got);
#endif
    return mpt__file_read_plain(ctx, f, buf, n, got);
}

/* ---- IDX (MNIST-format) files --------------------------------------------

   Big-endian: bytes 0 and 1 zero, byte 2 the element type (0x08 unsigned
   byte), byte 3 the number of dimensions; then each dimension as a u32;
   then the elements, row-major. Images are 0x00000803 (n, rows, cols),
   labels 0x00000801 (n). */

typedef struct mpt__idx {
    mpt__file file;
    int n_dims;
    int64_t dims[3];
    int64_t header_bytes;  /* 4 + 4 · n_dims                   */
    int64_t data_bytes;    /* the product of dims (uint8 data) */
} mpt__idx;

static uint32_t mpt__be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static const char *mpt__idx_type_name(int code) {
    switch (code) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0b: return "int16";
    case 0x0c: return "int32";
    case 0x0d: return "float32";
    case 0x0e: return "float64";
    default: return NULL;
    }
}

static mpt_status mpt__idx_check_magic(mpt_context *ctx, const mpt__idx *idx,
                                       const unsigned char *m, const char *what, int dims) {
    const char *path = idx->file.path;
    const char *type = mpt__idx_type_name(m[2]);
#ifdef MPT_NO_ZLIB
    if (m[0] == 0x1f && m[1] == 0x8b)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED,
                         "'%s' is gzip-compressed, and this build has no zlib (MPT_NO_ZLIB): "
                         "gunzip it first", path);
#endif
    if (m[0] != 0 || m[1] != 0 || !type)
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' is not an IDX file: magic number 0x%08x (an IDX %s file starts "
                         "with 0x%08x)",
                         path, (unsigned)mpt__be32(m), what, 0x800u + (unsigned)dims);
    if (m[2] != 0x08)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED,
                         "'%s' holds IDX elements of type 0x%02x (%s); only 0x08 (unsigned "
                         "byte) is supported", path, m[2], type);
    if (m[3] != dims)
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' has %d dimension%s (magic 0x%08x); an IDX %s file has %d (0x%08x)",
                         path, m[3], m[3] == 1 ? "" : "s", (unsigned)mpt__be32(m), what, dims,
                         0x800u + (unsigned)dims);
    return MPT_OK;
}

/* The header's sizes: each > 0, and their product (the data bytes) must
   fit in memory's sizes. */
static mpt_status mpt__idx_check_dims(mpt_context *ctx, mpt__idx *idx) {
    int i;
    idx->data_bytes = 1;
    for (i = 0; i < idx->n_dims; i++) {
        if (idx->dims[i] == 0)
            return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s': IDX dimension %d of %d is 0",
                             idx->file.path, i, idx->n_dims);
        if (!mpt__mul_ok(idx->data_bytes, idx->dims[i], &idx->data_bytes) ||
            (uint64_t)idx->data_bytes > (uint64_t)SIZE_MAX / 4)
            return mpt__fail(ctx, MPT_ERR_OVERFLOW,
                             "'%s': IDX dimensions %lld x %lld x %lld are too large",
                             idx->file.path, (long long)idx->dims[0],
                             (long long)(idx->n_dims > 1 ? idx->dims[1] : 1),
                             (long long)(idx->n_dims > 2 ? idx->dims[2] : 1));
    }
    return MPT_OK;
}

/* "'f' is truncated: its IDX header promises 7856 bytes, the file has 7000". */
static mpt_status mpt__idx_truncated(mpt_context *ctx, const mpt__idx *idx, const char *part,
                                     int64_t expected, int64_t actual) {
    const char *how = "";
#ifndef MPT_NO_ZLIB
    if (idx->file.cut)
        how = " (uncompressed; its gzip stream is cut short)";
    else if (idx->file.gz)
        how = " (uncompressed)";
#endif
    return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' is truncated: %s %lld bytes, the file has %lld%s",
                     idx->file.path, part, (long long)expected, (long long)actual, how);
}

/* Opens path and reads its header: `dims` dimensions of IDX unsigned bytes. */
static mpt_status mpt__idx_open(mpt_context *ctx, mpt__idx *idx, const char *path,
                                const char *what, int dims) {
    unsigned char h[16]; /* magic + up to 3 dimensions */
    int64_t got;
    int i;
    memset(idx, 0, sizeof *idx);
    MPT__CHECK(mpt__file_open(ctx, &idx->file, path));
    MPT__CHECK(mpt__file_read(ctx, &idx->file, h, 4, &got));
    if (got < 4) return mpt__idx_truncated(ctx, idx, "an IDX magic number needs", 4, got);
    MPT__CHECK(mpt__idx_check_magic(ctx, idx, h, what, dims));
    idx->n_dims = dims;
    idx->header_bytes = 4 + 4 * (int64_t)dims;
    MPT__CHECK(mpt__file_read(ctx, &idx->file, h + 4, 4 * (int64_t)dims, &got));
    if (got < 4 * dims)
        return mpt__idx_truncated(ctx, idx, "its IDX header needs", idx->header_bytes, 4 + got);
    for (i = 0; i < dims; i++) idx->dims[i] = mpt__be32(h + 4 + 4 * i);
    return mpt__idx_check_dims(ctx, idx);
}

/* After the data: anything left is an error (a file that does not match its
   header); reading on also makes zlib check the gzip CRC and length. */
static mpt_status mpt__idx_expect_end(mpt_context *ctx, mpt__idx *idx) {
    unsigned char rest[4096];
    int64_t got, extra = 0, end = idx->header_bytes + idx->data_bytes;
    do {
        MPT__CHECK(mpt__file_read(ctx, &idx->file, rest, sizeof rest, &got));
        extra += got;
    } while (got == (int64_t)sizeof rest && extra < ((int64_t)1 << 20));
    if (extra == 0 && idx->file.cut) /* all the data, but no CRC to check it by */
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' is truncated: its gzip stream ends before its CRC and length",
                         idx->file.path);
    if (extra == 0) return MPT_OK;
    return mpt__fail(ctx, MPT_ERR_FORMAT,
                     "'%s' has %s%lld trailing byte%s after the %lld bytes its IDX header "
                     "describes",
                     idx->file.path, got == (int64_t)sizeof rest ? "more than " : "",
                     (long long)extra, extra == 1 ? "" : "s", (long long)end);
}

/* The first buffer for the data; it doubles as data arrives, up to what
   the header promises, so a corrupted header that promises terabytes ends
   as a truncated file rather than as a huge allocation. */
#define MPT__IDX_FIRST_CHUNK ((int64_t)64 << 20)

static mpt_status mpt__idx_grow(mpt_context *ctx, const mpt__idx *idx, unsigned char **buf,
                                int64_t have, int64_t *cap) {
    int64_t next = MPT__MIN(*cap * 2, idx->data_bytes);
    unsigned char *bigger = (unsigned char *)mpt__alloc(ctx, (size_t)next);
    if (!bigger)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY,
                         "reading '%s': cannot allocate %lld bytes", idx->file.path,
                         (long long)next);
    memcpy(bigger, *buf, (size_t)have);
    mpt__free(ctx, *buf);
    *buf = bigger;
    *cap = next;
    return MPT_OK;
}

/* Reads the data (idx->data_bytes) into *out, a new buffer, and checks that
   the file ends there. */
static mpt_status mpt__idx_read_data(mpt_context *ctx, mpt__idx *idx, unsigned char **out) {
    int64_t cap = MPT__MIN(idx->data_bytes, MPT__IDX_FIRST_CHUNK), have = 0, got;
    unsigned char *buf = (unsigned char *)mpt__alloc(ctx, (size_t)cap); /* (data_bytes) */
    mpt_status s = MPT_OK;
    if (!buf)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': cannot allocate %lld bytes",
                         idx->file.path, (long long)cap);
    for (;;) {
        s = mpt__file_read(ctx, &idx->file, buf + have, cap - have, &got);
        have += got;
        if (s != MPT_OK) break;
        if (have < cap) {
            s = mpt__idx_truncated(ctx, idx, "its IDX header promises",
                                   idx->header_bytes + idx->data_bytes, idx->header_bytes + have);
            break;
        }
        if (have == idx->data_bytes) {
            s = mpt__idx_expect_end(ctx, idx);
            break;
        }
        s = mpt__idx_grow(ctx, idx, &buf, have, &cap);
        if (s != MPT_OK) break;
    }
    if (s != MPT_OK) {
        mpt__free(ctx, buf);
        return s;
    }
    *out = buf;
    return MPT_OK;
}

/* Labels: n unsigned bytes widened to int32 class ids. */
static mpt_status mpt__idx_read_labels(mpt_context *ctx, mpt__idx *idx, int32_t **out) {
    unsigned char *bytes = NULL; /* (n) */
    int32_t *labels;             /* (n) */
    int64_t i;
    MPT__CHECK(mpt__idx_read_data(ctx, idx, &bytes));
    labels = (int32_t *)mpt__alloc(ctx, (size_t)idx->data_bytes * sizeof(int32_t));
    if (!labels) {
        mpt__free(ctx, bytes);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': out of memory",
                         idx->file.path);
    }
    for (i = 0; i < idx->data_bytes; i++) labels[i] = bytes[i];
    mpt__free(ctx, bytes);
    *out = labels;
    return MPT_OK;
}

/* Both headers first, so that a count mismatch is found before any data is
   read; then images, then labels. */
static mpt_status mpt__load_idx(mpt_context *ctx, mpt__idx *img, mpt__idx *lab,
                                const char *images_path, const char *labels_path,
                                mpt_dataset *d) {
    unsigned char *x = NULL;
    int32_t *y = NULL;
    MPT__CHECK(mpt__idx_open(ctx, img, images_path, "image", 3));
    MPT__CHECK(mpt__idx_open(ctx, lab, labels_path, "label", 1));
    if (img->dims[0] != lab->dims[0])
        return mpt__fail(ctx, MPT_ERR_SHAPE, "'%s' holds %lld images but '%s' holds %lld labels",
                         images_path, (long long)img->dims[0], labels_path,
                         (long long)lab->dims[0]);
    MPT__CHECK(mpt__idx_read_data(ctx, img, &x));
    d->owned_x = x;
    MPT__CHECK(mpt__idx_read_labels(ctx, lab, &y));
    d->owned_y = y;
    d->n = img->dims[0];
    d->x_dtype = MPT_UINT8;
    d->x_rank = 3;
    d->x_shape[0] = img->dims[1];
    d->x_shape[1] = img->dims[2];
    d->x_shape[2] = 1;
    d->x_count = img->dims[1] * img->dims[2];
    d->x = x;
    d->y_dtype = MPT_INT32;
    d->y_count = 1;
    d->y = y;
    mpt__dataset_set_scale(d, 1.0f / 255.0f, 0.0f);
    mpt__dataset_find_label_range(d);
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_load_idx(mpt_context *ctx, const char *images_path,
                                       const char *labels_path, mpt_dataset **out) {
    mpt__idx img, lab;
    mpt_dataset *d;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !images_path || !labels_path)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_idx: NULL %s",
                         !out ? "out" : !images_path ? "images_path" : "labels_path");
    *out = NULL;
    d = mpt__dataset_new(ctx);
    if (!d) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "load_idx: out of memory");
    memset(&img, 0, sizeof img);
    memset(&lab, 0, sizeof lab);
    s = mpt__load_idx(ctx, &img, &lab, images_path, labels_path, d);
    mpt__file_close(&img.file);
    mpt__file_close(&lab.file);
    if (s != MPT_OK) {
        mpt_dataset_destroy(d);
        return s;
    }
    *out = d;
    return MPT_OK;
}

/* dir/name, compressed first (then plain) where zlib is there, plain
   first otherwise so that a plain copy beside a .gz one still loads. */
static mpt_status mpt__mnist_path(mpt_context *ctx, const char *dir, const char *name,
                                  char *path, size_t size) {
    struct stat st;
    int k;
    for (k = 0; k < 2; k++) {
#ifndef MPT_NO_ZLIB
        int gz = k == 0;
#else
        int gz = k == 1;
#endif
        int len = snprintf(path, size, "%s/%s%s", dir, name, gz ? ".gz" : "");
        if (len < 0 || (size_t)len >= size)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_mnist: directory name '%s' is "
                             "too long", dir);
        if (stat(path, &st) == 0) return MPT_OK;
    }
    return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: neither '%s/%s.gz' nor '%s/%s' exists", dir,
                     name, dir, name);
}

MPTDEF mpt_status mpt_dataset_load_mnist(mpt_context *ctx, const char *dir, int test,
                                         mpt_dataset **out) {
    char images[4096], labels[4096];
    const char *part = test ? "t10k" : "train";
    char name[64];
    struct stat st;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !dir)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_mnist: NULL %s", dir ? "out" : "dir");
    *out = NULL;
    if (stat(dir, &st) != 0)
        return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: cannot open directory '%s': %s", dir,
                         strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: '%s' is not a directory", dir);
    snprintf(name, sizeof name, "%s-images-idx3-ubyte", part);
    MPT__CHECK(mpt__mnist_path(ctx, dir, name, images, sizeof images));
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte", part);
    MPT__CHECK(mpt__mnist_path(ctx, dir, name, labels, sizeof labels));
    return mpt_dataset_load_idx(ctx, images, labels, out);
}

/* ---- the prefetching batch loader -----------------------------------------

   Two slots, batch b in slot b % 2. The consumer (fit's thread) holds the
   batch it last received until its next call; meanwhile the loader thread
   fills the other slot with the batch after. So loading b + 1 overlaps
   computing on b, and a slot is never written while it is being read. */

typedef struct mpt__loader {
    mpt_context *ctx;
    const mpt_dataset *d;
    mpt_dtype x_dtype;
    int64_t max_batch;
    void *block;            /* the one allocation behind the four buffers */
    void *x_buf[2];         /* (max_batch, sample shape) x_dtype          */
    void *y_buf[2];         /* (max_batch, label count) int32 or float32  */
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t cond;    /* any change of the state below              */
    int stop;
    /* The epoch; reset only while no batch is being loaded. */
    const int64_t *order;   /* (n) sample indices, borrowed               */
    int64_t n, batch_size, n_batches;
    int64_t produce;        /* next batch the thread loads                */
    int64_t consume;        /* next batch next() returns                  */
    int64_t held;           /* batch the consumer holds, -1 if none       */
    int64_t slot_batch[2];  /* batch ready in each slot, -1 if free       */
    int loading;            /* the thread is filling slot produce % 2     */
} mpt__loader;

static int mpt__loader_can_load(const mpt__loader *l) {
    return l->produce < l->n_batches && l->slot_batch[l->produce & 1] < 0;
}

static void *mpt__loader_main(void *arg) {
    mpt__loader *l = (mpt__loader *)arg;
    pthread_mutex_lock(&l->mutex);
    for (;;) {
        int64_t b, first, count;
        const int64_t *indices;
        int slot;
        while (!l->stop && !mpt__loader_can_load(l)) pthread_cond_wait(&l->cond, &l->mutex);
        if (l->stop) break;
        b = l->produce;
        slot = (int)(b & 1);
        first = b * l->batch_size;
        count = MPT__MIN(l->batch_size, l->n - first);
        indices = l->order + first;
        l->loading = 1; /* start_epoch waits for this to clear */
        pthread_mutex_unlock(&l->mutex);
        mpt__dataset_gather(l->ctx, l->d, indices, count, l->x_dtype, l->x_buf[slot],
                            l->y_buf[slot]);
        pthread_mutex_lock(&l->mutex);
        l->loading = 0;
        l->slot_batch[slot] = b;
        l->produce = b + 1;
        pthread_cond_broadcast(&l->cond);
    }
    pthread_mutex_unlock(&l->mutex);
    return NULL;
}

/* Carves the four batch buffers out of one block, each 64-byte aligned. */
static mpt_status mpt__loader_alloc(mpt__loader *l) {
    int64_t xb, yb, total;
    int k;
    if (!mpt__mul_ok(l->max_batch, l->d->x_count * (int64_t)mpt_dtype_size(l->x_dtype), &xb) ||
        !mpt__mul_ok(l->max_batch, l->d->y_count * 4, &yb) ||
        !mpt__add_ok(xb, yb, &total) || !mpt__add_ok(total, 2 * MPT__ALIGN, &total) ||
        !mpt__mul_ok(total, 2, &total) || (uint64_t)total > (uint64_t)SIZE_MAX)
        return mpt__fail(l->ctx, MPT_ERR_OVERFLOW, "loader: batches of %lld samples are too large",
                         (long long)l->max_batch);
    xb = (xb + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    yb = (yb + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    l->block = mpt__alloc(l->ctx, (size_t)total);
    if (!l->block)
        return mpt__fail(l->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "loader: cannot allocate %lld bytes for two batches of %lld samples",
                         (long long)total, (long long)l->max_batch);
    for (k = 0; k < 2; k++) {
        l->x_buf[k] = (char *)l->block + (size_t)k * (size_t)(xb + yb);
        l->y_buf[k] = (char *)l->x_buf[k] + (size_t)xb;
    }
    return MPT_OK;
}

/* A loader of batches of up to max_batch samples of d, x in x_dtype (a
   float dtype), with its thread started and no epoch yet. d must outlive it. */
static mpt_status mpt__loader_create(mpt_context *ctx, const mpt_dataset *d,
                                            int64_t max_batch, mpt_dtype x_dtype,
                                            mpt__loader **out) {
    mpt__loader *l;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !d)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loader: NULL %s", d ? "out" : "dataset");
    *out = NULL;
    if (max_batch <= 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loader: max_batch %lld must be > 0",
                         (long long)max_batch);
    if (!mpt_dtype_is_float(x_dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "loader: batch dtype %s is not a float dtype",
                         mpt_dtype_name(x_dtype));
    l = (mpt__loader *)mpt__calloc(ctx, sizeof *l);
    if (!l) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "loader: out of memory");
    l->ctx = ctx;
    l->d = d;
    l->x_dtype = x_dtype;
    l->max_batch = max_batch;
    l->held = l->slot_batch[0] = l->slot_batch[1] = -1;
    s = mpt__loader_alloc(l);
    if (s != MPT_OK) {
        mpt__free(ctx, l);
        return s;
    }
    pthread_mutex_init(&l->mutex, NULL);
    pthread_cond_init(&l->cond, NULL);
    if (pthread_create(&l->thread, NULL, mpt__loader_main, l) != 0) {
        pthread_mutex_destroy(&l->mutex);
        pthread_cond_destroy(&l->cond);
        mpt__free(ctx, l->block);
        mpt__free(ctx, l);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "loader: cannot start its thread");
    }
    *out = l;
    return MPT_OK;
}

/* Every index must name a sample: a wrong one would read outside x. */
static int mpt__loader_epoch_ok(mpt__loader *l, const int64_t *order, int64_t n,
                                int64_t batch_size) {
    int64_t i;
    if (n < 0 || (n > 0 && !order) || batch_size <= 0 || batch_size > l->max_batch) {
        mpt__fail(l->ctx, MPT_ERR_INVALID_ARGUMENT,
                  "loader: epoch of %lld samples in batches of %lld (max %lld)%s", (long long)n,
                  (long long)batch_size, (long long)l->max_batch, order ? "" : ", NULL order");
        return 0;
    }
    for (i = 0; i < n; i++)
        if (order[i] < 0 || order[i] >= l->d->n) {
            mpt__fail(l->ctx, MPT_ERR_INVALID_ARGUMENT,
                      "loader: order[%lld] = %lld is not a sample of this dataset (0..%lld)",
                      (long long)i, (long long)order[i], (long long)l->d->n - 1);
            return 0;
        }
    return 1;
}

/* Starts an epoch over order[0..n) (kept by pointer until the next epoch or
   destroy) in batches of batch_size, the last one partial; loading batch 0
   begins now. Ends any epoch in progress. Bad arguments (recorded in the
   context's error) give an epoch with no batches. */
static void mpt__loader_start_epoch(mpt__loader *l, const int64_t *order, int64_t n,
                                           int64_t batch_size) {
    int ok = mpt__loader_epoch_ok(l, order, n, batch_size);
    pthread_mutex_lock(&l->mutex);
    while (l->loading) pthread_cond_wait(&l->cond, &l->mutex);
    l->order = order;
    l->n = ok ? n : 0;
    l->batch_size = ok ? batch_size : 1;
    l->n_batches = ok ? (n + batch_size - 1) / batch_size : 0;
    l->produce = l->consume = 0;
    l->held = l->slot_batch[0] = l->slot_batch[1] = -1;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mutex);
}

/* Waits for the next batch and points x (b, sample shape...) in x_dtype
   and y ((b,) int32 or (b, target shape...) float32) at it: borrowed,
   valid until the next call. Returns 0 when the epoch has no more. */
static int mpt__loader_next(mpt__loader *l, mpt_tensor *x, mpt_tensor *y) {
    const mpt_dataset *d = l->d;
    int64_t b, count;
    int slot;
    pthread_mutex_lock(&l->mutex);
    if (l->held >= 0) { /* the caller is done with it: the thread may refill it */
        l->slot_batch[l->held & 1] = -1;
        l->held = -1;
        pthread_cond_broadcast(&l->cond);
    }
    if (l->consume >= l->n_batches) {
        pthread_mutex_unlock(&l->mutex);
        return 0;
    }
    b = l->consume++;
    slot = (int)(b & 1);
    while (l->slot_batch[slot] != b) pthread_cond_wait(&l->cond, &l->mutex);
    l->held = b;
    count = MPT__MIN(l->batch_size, l->n - b * l->batch_size);
    pthread_mutex_unlock(&l->mutex);
    mpt__batch_view(x, l->x_dtype, count, d->x_rank, d->x_shape, l->x_buf[slot], MPT_DEVICE_CPU);
    mpt__batch_view(y, d->y_dtype, count, d->y_rank, d->y_shape, l->y_buf[slot], MPT_DEVICE_CPU);
    return 1;
}

/* Stops and joins the thread (at once, also mid-epoch) and frees the loader. */
static void mpt__loader_destroy(mpt__loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mutex);
    l->stop = 1;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mutex);
    pthread_join(l->thread, NULL);
    pthread_mutex_destroy(&l->mutex);
    pthread_cond_destroy(&l->cond);
    mpt__free(l->ctx, l->block);
    mpt__free(l->ctx, l);
}
/* =============================================================================
   @impl-training: the training loop, evaluate, predict, summary, history
   =============================================================================

   One training step is, in order:
     forward (training mode, layer state not yet committed)
     loss and its gradient, multiplied by the loss scale, in float32
     backward: every parameter's gradient
     optimizer step: unscale, check finiteness, update — or skip the step
     loss-scale bookkeeping; commit BatchNormalization's statistics only if
     the step was applied
   so a skipped step changes no state at all. When the model ends in a
   softmax and the loss is a crossentropy on probabilities, the softmax is
   fused into the loss: the last layer hands over its logits and the loss
   computes log-softmax, which is exact where log(softmax) would underflow. */

static double mpt__now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

/* ---- the training scalars between the host and the backend ------------- */

/* The training scalars: the model keeps the host's copy (what checkpoints,
   callbacks and accessors read), the backend the one a step updates.
   push copies the host's over both of the backend's records of every
   replica (their tallies zeroed); pull copies the training record back,
   with the tallies summed over the replicas of this process. */
static mpt_status mpt__state_push(mpt_model *m) {
    mpt_step_state st[2];
    int k;
    memset(st, 0, sizeof st);
    st[0].step = (int64_t)m->step;
    st[0].optimizer_steps = m->optimizer_steps;
    st[0].good_steps = m->good_steps;
    st[0].skipped_steps = m->skipped_steps;
    st[0].learning_rate = m->learning_rate;
    st[0].loss_scale = m->compiled ? m->loss_scale : 1.0f;
    st[0].finite = 1;
    st[1] = st[0];
    for (k = 1; k < m->n_replicas; k++)
        MPT__CHECK(mpt__upload(m->replica[k], m->replica[k]->state, st, sizeof st));
    return mpt__upload(m, m->state, st, sizeof st);
}

/* The host's copy of the scalars from a training record. */
static void mpt__state_to_host(mpt_model *m, const mpt_step_state *st) {
    m->step = (uint64_t)st->step;
    m->optimizer_steps = st->optimizer_steps;
    m->good_steps = st->good_steps;
    m->skipped_steps = st->skipped_steps;
    m->loss_scale = st->loss_scale;
}

static mpt_status mpt__state_pull(mpt_model *m, mpt_step_state *st) {
    float scale_before = m->loss_scale;
    int k;
    MPT__CHECK(mpt__download(m, st, m->state, sizeof *st));
    for (k = 1; k < m->n_replicas; k++) { /* the same scalars; their tallies add up */
        mpt_model *r = m->replica[k];
        mpt_step_state rs;
        MPT__CHECK(mpt__download(r, &rs, r->state, sizeof rs));
        mpt__state_to_host(r, &rs);
        st->loss_sum += rs.loss_sum;
        st->correct += rs.correct;
        st->top_k += rs.top_k;
        st->samples += rs.samples;
    }
    mpt__state_to_host(m, st);
    /* Warned on the way down through 1, so once per collapse. */
    if (scale_before >= 1 && m->loss_scale < 1)
        mpt__log(m->ctx, MPT_LOG_WARNING,
                 "loss scale collapsed to %g: gradients overflow even unscaled — "
                 "check for inf/NaN in the model or data", (double)m->loss_scale);
    return MPT_OK;
}

/* ---- logs and history ------------------------------------------------------ */

static void mpt__logs_set(mpt_logs *logs, const char *name, double value) {
    int i;
    for (i = 0; i < logs->count; i++)
        if (strcmp(logs->names[i], name) == 0) break;
    if (i == MPT_MAX_LOGS) return;
    logs->names[i] = name;
    logs->values[i] = value;
    if (i == logs->count) logs->count++;
}

static void mpt__history_reset(mpt_model *m) {
    m->history.epochs = 0;
    m->history.n_keys = 0;
}

static mpt_status mpt__history_append(mpt_model *m, const mpt_logs *logs) {
    mpt__history_store *h = &m->history;
    int i, k;
    if (h->epochs == h->cap) {
        int cap = h->cap ? 2 * h->cap : 16;
        for (k = 0; k < MPT_MAX_LOGS; k++) {
            double *grown = (double *)mpt__alloc(m->ctx, sizeof(double) * (size_t)cap);
            if (!grown)
                return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                                 "fit: out of memory for the history of %d epochs", cap);
            if (h->values[k]) memcpy(grown, h->values[k], sizeof(double) * (size_t)h->epochs);
            mpt__free(m->ctx, h->values[k]);
            h->values[k] = grown;
        }
        h->cap = cap;
    }
    for (i = 0; i < logs->count; i++) {
        for (k = 0; k < h->n_keys; k++)
            if (strcmp(h->keys[k], logs->names[i]) == 0) break;
        if (k == h->n_keys) {
            int e;
            if (k == MPT_MAX_LOGS) continue;
            snprintf(h->keys[k], sizeof h->keys[k], "%s", logs->names[i]);
            for (e = 0; e < h->epochs; e++) h->values[k][e] = NAN;
            h->n_keys++;
        }
        h->values[k][h->epochs] = logs->values[i];
    }
    for (k = 0; k < h->n_keys; k++) { /* keys this epoch did not report */
        for (i = 0; i < logs->count; i++)
            if (strcmp(h->keys[k], logs->names[i]) == 0) break;
        if (i == logs->count) h->values[k][h->epochs] = NAN;
    }
    h->epochs++;
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_history(const mpt_model *m, mpt_history *out) {
    int k;
    if (!m || !out) return MPT_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->epochs = m->history.epochs;
    out->n_keys = m->history.n_keys;
    for (k = 0; k < m->history.n_keys; k++) {
        out->keys[k] = m->history.keys[k];
        out->values[k] = m->history.values[k];
    }
    return MPT_OK;
}

/* ---- metrics ----------------------------------------------------------------- */

/* Running sums of one pass over data. */
typedef struct mpt__tally {
    double loss_sum;     /* Σ batch mean loss · batch size */
    int64_t samples;
    int64_t correct;     /* accuracy                       */
    int64_t top_k;       /* sparse top-k accuracy          */
} mpt__tally;

/* A tally from the backend's record of it. */
static void mpt__tally_from_state(const mpt_step_state *st, mpt__tally *t) {
    t->loss_sum = st->loss_sum;
    t->samples = (int64_t)st->samples;
    t->correct = (int64_t)st->correct;
    t->top_k = (int64_t)st->top_k;
}

/* Loss, accuracy and top-k of a tally into logs, names prefixed ("val_"). */
static void mpt__tally_logs(const mpt_model *m, const mpt__tally *t, int validation,
                            mpt_logs *logs) {
    double n = t->samples ? (double)t->samples : 1.0;
    mpt__logs_set(logs, validation ? "val_loss" : "loss", t->loss_sum / n);
    if (m->compile.metrics & MPT_METRIC_ACCURACY)
        mpt__logs_set(logs, validation ? "val_accuracy" : "accuracy", (double)t->correct / n);
    if (m->compile.metrics & MPT_METRIC_SPARSE_TOP_K)
        mpt__logs_set(logs,
                      validation ? "val_sparse_top_k_categorical_accuracy"
                                 : "sparse_top_k_categorical_accuracy",
                      (double)t->top_k / n);
}

/* ---- one step ------------------------------------------------------------------ */

/* During fit the last layer leaves its softmax to the loss, on every replica. */
static void mpt__set_emit_logits(mpt_model *m, int on) {
    int k;
    m->emit_logits = on;
    for (k = 1; k < m->n_replicas; k++) m->replica[k]->emit_logits = on;
}

/* Whether the final softmax can be fused into the compiled loss. */
static int mpt__can_fuse_softmax(const mpt_model *m) {
    const mpt_loss_desc *l = &m->compile.loss;
    return !l->from_logits &&
           (l->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
            l->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY) &&
           mpt__layer_activation(&m->layers[m->n_layers - 1]) == MPT_ACT_SOFTMAX;
}

typedef struct mpt__step_times {
    double forward, backward, update; /* seconds, summed over an epoch */
} mpt__step_times;

static mpt_status mpt__target_on_backend(mpt_model *m, const mpt_tensor *y, mpt_tensor *t) {
    return mpt__batch_on_backend(m, y, m->target_buf[0], t);
}

/* The compiled loss of the last forward's output against y (in the
   backend's memory), tallied into the training record (with its gradient,
   times the loss scale) or into evaluation's. */
static mpt_loss_args mpt__loss_args(mpt_model *m, const mpt_tensor *y, int training) {
    const mpt__layer *last = &m->layers[m->n_layers - 1];
    mpt_loss_args a;
    memset(&a, 0, sizeof a);
    a.type = m->compile.loss.type;
    a.from_logits = m->compile.loss.from_logits || m->emit_logits;
    a.pred_dtype = last->dtype;
    a.pred = last->y;
    a.target_dtype = y->dtype;
    a.target = y->data;
    a.dpred = training ? m->grad_buf[0] : NULL;
    a.rows = m->last_batch;
    a.K = last->out_count;
    a.metrics = m->compile.metrics;
    a.top_k = m->compile.top_k;
    a.scale_by_loss_scale = training;
    a.state = &m->state[training ? 0 : 1];
    return a;
}

/* The tail of every training step, after backward, queued on the backend:
   the gradients' finiteness and Σg², the update (skipped unless finite),
   the loss-scale bookkeeping, and the layers' state committed (only if the
   step was applied: state->finite). */
static void mpt__queue_update(mpt_model *m) {
    m->be->grad_stats(m->impl, &m->update);
    m->be->update(m->impl, &m->update);
    m->be->loss_scale_update(m->impl, &m->compile.loss_scale, m->state);
    mpt__model_commit(m);
}

/* One training step on a batch, queued on the backend: forward, loss,
   backward, the finiteness check, the update and the loss-scale
   bookkeeping, with no decision taken on the host. A step whose forward
   pass or gradients hold inf or NaN changes nothing but the loss scale
   and the count of skipped steps. */
static void mpt__queue_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                            mpt__step_times *times) {
    mpt_loss_args loss;
    double t0 = mpt__now(), t1, t2;
    mpt__model_forward(m, x, 1);
    loss = mpt__loss_args(m, y, 1);
    m->be->loss(m->impl, &loss);
    t1 = mpt__now();
    mpt_model_backward(m, NULL, NULL); /* cannot fail after a training forward */
    t2 = mpt__now();
    mpt__queue_update(m);
    times->forward += t1 - t0;
    times->backward += t2 - t1;
    times->update += mpt__now() - t2;
}

/* A step on a batch in host memory (copied in first on a GPU). */
static mpt_status mpt__train_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                                  mpt__step_times *times) {
    mpt_tensor in, target;
    MPT__CHECK(mpt__input_on_backend(m, x, &in));
    MPT__CHECK(mpt__target_on_backend(m, y, &target));
    mpt__queue_step(m, &in, &target, times);
    return MPT_OK;
}

/* Before the first step at a batch size, on a backend that chooses its
   GEMM engine per shape: one forward and backward pass on whatever the
   input buffer holds, with every GEMM timed. Nothing is committed or
   updated, so the model is unchanged (the gradients are overwritten by
   the next step anyway). */
static mpt_status mpt__plan_gemms(mpt_model *m, int64_t batch) {
    mpt_tensor x;
    mpt_status s;
    if (!m->be->gemm_plan || m->planned_batch == batch) return MPT_OK;
    mpt__batch_view(&x, m->layers[0].dtype, batch, m->desc.input_rank, m->desc.input_shape,
                    m->input_buf[0], mpt__model_device(m));
    m->planning = 1;
    mpt__model_forward(m, &x, 1);
    mpt_model_backward(m, NULL, NULL);
    m->planning = 0;
    s = m->be->sync(m->impl);
    if (s != MPT_OK) return mpt__fail(m->ctx, s, "fit: timing the GEMMs: %s", m->be->error(m->impl));
    m->planned_batch = batch;
    return MPT_OK;
}

/* ---- feeding a GPU: uploads that overlap the steps, steps replayed -------------- */

/* On a GPU, batch i+1's copy to the device runs while step i computes:
   it is staged in pinned host memory and copied on the backend's second
   queue into the other of two device buffers. Each full-size step is
   recorded once per buffer (a CUDA graph) and then replayed, so a small
   model is not held back by hundreds of kernel launches per step. The
   replicas of a replicated model are fed their rows the same way, each on
   its own device, and their step is recorded where
   mpt__replicas_capturable allows.
   MPT_CUDA_GRAPHS=0 in the environment turns the recording off. */
typedef struct mpt__feed_slot { /* one model's (or replica's) */
    void *host[2][2];        /* [buffer][x, y] pinned staging, a full batch  */
    mpt_tensor x[2], y[2];   /* [buffer] its rows uploaded there (0: none)   */
} mpt__feed_slot;

typedef struct mpt__feed {
    int on;                  /* the model is on a GPU                       */
    int graphs;              /* steps are recorded and replayed             */
    int n;                   /* slots: the model's replicas in this process */
    mpt__feed_slot *slot;    /* [n], slot k replica k's (0: the model's)    */
    int64_t global_rows[2];  /* [buffer] the batch's rows on every worker   */
    void *graph[2];          /* the step recorded over buffer k, or NULL     */
    int next;                /* the buffer the next upload fills            */
    int have;                /* whether there is one                        */
} mpt__feed;

/* In @impl-strategy: the replicas' step over their rows, already in their
   memory; each replica's rows of a batch; whether that step may be
   recorded. */
static mpt_status mpt__replicas_step(mpt_model *m, const mpt_tensor *xs, const mpt_tensor *ys,
                                     int64_t global_rows, mpt__step_times *times);
static void mpt__replica_rows(const mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                              int64_t rows, mpt_tensor *xs, mpt_tensor *ys);
static int mpt__replicas_capturable(const mpt_model *m);

/* The model slot k feeds: replica k, or the model itself. */
static mpt_model *mpt__feed_model(mpt_model *m, int k) {
    return m->replica ? m->replica[k] : m;
}

/* Whether slot k's device is an earlier slot's too (logical replicas
   share one): its queues need one wait, not one per replica. */
static int mpt__feed_device_seen(mpt_model *m, int k) {
    int j;
    for (j = 0; j < k; j++)
        if (mpt__feed_model(m, j)->impl == mpt__feed_model(m, k)->impl) return 1;
    return 0;
}

static void mpt__feed_close(mpt_model *m, mpt__feed *f) {
    int k, b;
    if (!f->on) return;
    for (k = 0; k < f->n; k++) { /* nothing may still read what is freed below */
        mpt_model *r = mpt__feed_model(m, k);
        if (!mpt__feed_device_seen(m, k)) r->be->sync(r->impl);
    }
    for (k = 0; f->slot && k < f->n; k++) {
        mpt_model *r = mpt__feed_model(m, k);
        for (b = 0; b < 2; b++) {
            r->be->free_host(r->impl, f->slot[k].host[b][0]);
            r->be->free_host(r->impl, f->slot[k].host[b][1]);
        }
    }
    for (b = 0; b < 2; b++)
        if (f->graph[b]) m->be->graph_free(m->impl, f->graph[b]);
    mpt__free(m->ctx, f->slot);
    memset(f, 0, sizeof *f);
}

static mpt_status mpt__feed_open(mpt_model *m, mpt__feed *f) {
    const char *env = getenv("MPT_CUDA_GRAPHS");
    int k, b, j;
    memset(f, 0, sizeof *f);
    if (mpt__model_device(m) == MPT_DEVICE_CPU) return MPT_OK;
    f->on = 1;
    f->graphs = m->be->can_capture && !(env && strcmp(env, "0") == 0) &&
                (!m->strategy || mpt__replicas_capturable(m));
    f->n = m->n_replicas;
    f->slot = (mpt__feed_slot *)mpt__calloc(m->ctx, sizeof(mpt__feed_slot) * (size_t)f->n);
    if (!f->slot) {
        f->on = 0;
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    }
    for (k = 0; k < f->n; k++) {
        mpt_model *r = mpt__feed_model(m, k);
        size_t bytes[2];
        bytes[0] = (size_t)(4 * r->layers[0].in_count * r->max_batch);
        bytes[1] = (size_t)(4 * r->layers[r->n_layers - 1].out_count * r->max_batch);
        for (b = 0; b < 2; b++)
            for (j = 0; j < 2; j++)
                if (r->be->alloc_host(r->impl, bytes[j], &f->slot[k].host[b][j]) != MPT_OK) {
                    mpt_status s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: %s",
                                             r->be->error(r->impl));
                    mpt__feed_close(m, f);
                    return s;
                }
    }
    return MPT_OK;
}

/* Starts copying a batch to the device: each slot's rows (this worker's
   `rows` of the batch, shared out as the replicas' step shares them)
   into pinned memory once the upload before last (which read it) is
   done, then on the copy queue. */
static mpt_status mpt__feed_upload(mpt_model *m, mpt__feed *f, const mpt_tensor *x,
                                   const mpt_tensor *y, int64_t rows, int64_t global_rows) {
    mpt_tensor xs[MPT__MAX_REPLICAS], ys[MPT__MAX_REPLICAS];
    int b = f->next, k;
    for (k = 0; k < f->n; k++) {
        mpt_model *r = mpt__feed_model(m, k);
        mpt_status s = mpt__feed_device_seen(m, k) ? MPT_OK : r->be->upload_done(r->impl);
        if (s != MPT_OK) return mpt__fail(m->ctx, s, "fit: %s", r->be->error(r->impl));
    }
    mpt__replica_rows(m, x, y, rows, xs, ys);
    for (k = 0; k < f->n; k++) {
        mpt_model *r = mpt__feed_model(m, k);
        mpt__feed_slot *slot = &f->slot[k];
        slot->x[b] = xs[k];
        slot->y[b] = ys[k];
        if (xs[k].shape[0] == 0) continue; /* no rows for this replica */
        memcpy(slot->host[b][0], xs[k].data, mpt_tensor_bytes(&xs[k]));
        memcpy(slot->host[b][1], ys[k].data, mpt_tensor_bytes(&ys[k]));
        r->be->upload_async(r->impl, r->input_buf[b], slot->host[b][0], mpt_tensor_bytes(&xs[k]));
        r->be->upload_async(r->impl, r->target_buf[b], slot->host[b][1], mpt_tensor_bytes(&ys[k]));
        slot->x[b].data = r->input_buf[b];
        slot->y[b].data = r->target_buf[b];
        slot->x[b].device = slot->y[b].device = MPT_DEVICE_CUDA;
    }
    f->global_rows[b] = global_rows;
    f->have = 1;
    f->next = 1 - b;
    return MPT_OK;
}

/* The compute queues wait for the last uploads (one wait per device). */
static void mpt__feed_wait(mpt_model *m, const mpt__feed *f) {
    int k;
    for (k = 0; k < f->n; k++)
        if (!mpt__feed_device_seen(m, k))
            mpt__feed_model(m, k)->be->upload_wait(mpt__feed_model(m, k)->impl);
}

/* Queues the step on the batch in buffer b, unrecorded. */
static mpt_status mpt__feed_queue(mpt_model *m, const mpt__feed *f, int b,
                                  mpt__step_times *times) {
    mpt_tensor xs[MPT__MAX_REPLICAS], ys[MPT__MAX_REPLICAS];
    int k;
    if (!m->strategy) {
        mpt__queue_step(m, &f->slot[0].x[b], &f->slot[0].y[b], times);
        return MPT_OK;
    }
    for (k = 0; k < f->n; k++) {
        xs[k] = f->slot[k].x[b];
        ys[k] = f->slot[k].y[b];
    }
    return mpt__replicas_step(m, xs, ys, f->global_rows[b], times);
}

/* Whether buffer b holds a full batch for every slot (the shape recorded). */
static int mpt__feed_full(mpt_model *m, const mpt__feed *f, int b) {
    int k;
    for (k = 0; k < f->n; k++)
        if (f->slot[k].x[b].shape[0] != mpt__feed_model(m, k)->max_batch) return 0;
    return 1;
}

/* Queues the step on the batch in buffer b: replays its recording,
   records it first when there is none (full batches only; the last,
   shorter one runs as it is). */
static mpt_status mpt__feed_step(mpt_model *m, mpt__feed *f, int b, mpt__step_times *times) {
    mpt_status s = MPT_OK, queued;
    if (!f->graphs || !mpt__feed_full(m, f, b)) return mpt__feed_queue(m, f, b, times);
    if (!f->graph[b]) {
        s = m->be->capture_begin(m->impl);
        if (s == MPT_OK) {
            queued = mpt__feed_queue(m, f, b, times);
            s = m->be->capture_end(m->impl, &f->graph[b]);
            if (queued != MPT_OK) { /* its message is set; the recording is partial */
                if (f->graph[b]) m->be->graph_free(m->impl, f->graph[b]);
                f->graph[b] = NULL;
                return queued;
            }
        }
    }
    if (s == MPT_OK) s = m->be->replay(m->impl, f->graph[b]);
    return s == MPT_OK ? s : mpt__fail(m->ctx, s, "fit: recording a step: %s",
                                        m->be->error(m->impl));
}

/* The tally of the steps since the last push, and the host's copy of the
   training scalars brought up to date. */
static mpt_status mpt__training_tally(mpt_model *m, mpt__tally *t) {
    mpt_step_state st;
    double sum[4];
    MPT__CHECK(mpt__state_pull(m, &st)); /* summed over this process's replicas */
    sum[0] = st.loss_sum;
    sum[1] = st.correct;
    sum[2] = st.top_k;
    sum[3] = st.samples;
    MPT__CHECK(mpt__workers_sum(m, sum, 4, 1, "summing the metrics")); /* and the workers' */
    st.loss_sum = sum[0];
    st.correct = sum[1];
    st.top_k = sum[2];
    st.samples = sum[3];
    mpt__tally_from_state(&st, t);
    return MPT_OK;
}

/* ---- progress output, as Keras 2 prints it ---------------------------------------- */

static void mpt__format_value(char *buf, size_t size, double v) {
    snprintf(buf, size, fabs(v) > 1e-3 || v == 0 ? "%.4f" : "%.4e", v);
}

static void mpt__format_seconds(char *buf, size_t size, double s) {
    if (s >= 3600)
        snprintf(buf, size, "%d:%02d:%02d", (int)(s / 3600), (int)fmod(s / 60, 60), (int)fmod(s, 60));
    else if (s >= 60)
        snprintf(buf, size, "%d:%02d", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, size, "%.0fs", s);
}

/* The logs that measure the run itself rather than the model: left out of
   the progress line and of the plot's metric panels (the learning rate and
   the loss scale get panels of their own). */
static int mpt__log_is_measurement(const char *name) {
    static const char *const names[] = {"learning_rate", "loss_scale", "skipped_steps",
                                        "epoch_seconds", "samples_per_second",
                                        "forward_ms_per_step", "backward_ms_per_step",
                                        "update_ms_per_step"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(name, names[i]) == 0) return 1;
    return 0;
}

static void mpt__format_logs(char *buf, size_t size, const mpt_logs *logs, int skip_extras) {
    size_t used = 0;
    int i;
    buf[0] = 0;
    for (i = 0; i < logs->count && used < size; i++) {
        char v[32];
        const char *n = logs->names[i];
        if (skip_extras && mpt__log_is_measurement(n)) continue;
        mpt__format_value(v, sizeof v, logs->values[i]);
        used += (size_t)snprintf(buf + used, size - used, " - %s: %s", n, v);
    }
}

/* "123/469 [=====>........................] - ETA: 3s - loss: 0.5000" while
   running, "469/469 [==============================] - 2s 4ms/step - ..." at
   the end (verbose 1); verbose 2 prints only "469/469 - 2s - 4ms/step - ...". */
static void mpt__progress(const mpt_model *m, int verbose, int64_t done, int64_t total,
                          double elapsed, const mpt_logs *logs, int final) {
    char bar[40], values[512], t[32], per[32];
    double per_step = done ? elapsed / (double)done : 0;
    int width = 30, filled = total ? (int)(width * done / total) : width, i;
    mpt__format_logs(values, sizeof values, logs, 1);
    if (per_step >= 1)
        snprintf(per, sizeof per, "%.0fs/step", per_step);
    else if (per_step >= 1e-3)
        snprintf(per, sizeof per, "%.0fms/step", per_step * 1e3);
    else
        snprintf(per, sizeof per, "%.0fus/step", per_step * 1e6);
    if (verbose == 2) {
        if (!final) return;
        mpt__format_seconds(t, sizeof t, elapsed);
        mpt__print(m, "%lld/%lld - %s - %s%s\n", (long long)done, (long long)total, t, per,
                   values);
        return;
    }
    for (i = 0; i < width; i++)
        bar[i] = i < filled - 1 ? '=' : (i == filled - 1 ? (done < total ? '>' : '=') : '.');
    bar[width] = 0;
    if (final) {
        mpt__format_seconds(t, sizeof t, elapsed);
        mpt__print(m, "\r%lld/%lld [%s] - %s %s%s\n", (long long)done, (long long)total, bar, t,
                   per, values);
    } else {
        mpt__format_seconds(t, sizeof t, per_step * (double)(total - done));
        mpt__print(m, "\r%lld/%lld [%s] - ETA: %s%s", (long long)done, (long long)total, bar, t,
                   values);
    }
}

/* ---- fit ------------------------------------------------------------------------------ */

/* The order of epoch e: a Fisher–Yates shuffle drawn from Philox keyed by
   the model's seed, so epoch e's order is the same in a resumed run. */
static void mpt__epoch_order(const mpt_model *m, int epoch, int shuffle, int64_t *order,
                             int64_t n) {
    uint64_t key = mpt__mix64(m->desc.seed ^ 0x5AFF1E5ull);
    int64_t i;
    for (i = 0; i < n; i++) order[i] = i;
    if (!shuffle) return;
    for (i = n - 1; i > 0; i--) {
        uint32_t r[4];
        uint64_t draw;
        int64_t j, tmp;
        mpt_philox4x32(key, (uint64_t)epoch, (uint64_t)i, r);
        draw = ((uint64_t)r[0] << 32) | r[1];
        j = (int64_t)(draw % (uint64_t)(i + 1));
        tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

/* A dataset's samples fit the model (predict needs no more). */
static mpt_status mpt__check_samples(mpt_model *m, const mpt_dataset *d, const char *what) {
    int64_t shape[MPT_MAX_RANK];
    int rank = mpt_dataset_sample_shape(d, shape);
    return mpt__check_sample_shape(m, rank, shape, what);
}

/* Checks that data fits the model: sample shape, target kind and labels. */
static mpt_status mpt__check_data(mpt_model *m, const mpt_dataset *d, const char *what) {
    int64_t shape[MPT_MAX_RANK], out_count = 1;
    int rank, i;
    int32_t lo, hi;
    const mpt__layer *last = &m->layers[m->n_layers - 1];
    char a[96], b[96];
    MPT__CHECK(mpt__check_samples(m, d, what));
    for (i = 0; i < last->out_rank; i++) out_count *= last->out_shape[i];
    if (mpt__dataset_label_dtype(d) == MPT_INT32) {
        mpt__dataset_label_range(d, &lo, &hi);
        if (m->compile.loss.type != MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY && out_count > 1)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: integer class labels need the sparse categorical "
                             "crossentropy loss (or one-hot float targets)", what);
        if (out_count > 1 && (lo < 0 || hi >= out_count))
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: labels range over %d..%d but the model has %lld classes "
                             "(0..%lld)", what, (int)lo, (int)hi, (long long)out_count,
                             (long long)out_count - 1);
        return MPT_OK;
    }
    rank = mpt__dataset_label_shape(d, shape);
    if (!mpt__target_shape_fits(rank, shape, last->out_rank, last->out_shape))
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "%s: targets of shape %s for a model output of "
                         "shape %s", what, mpt_shape_format(a, sizeof a, rank, shape),
                         mpt_shape_format(b, sizeof b, last->out_rank, last->out_shape));
    return MPT_OK;
}

/* batch_size 0 means Keras' default, 32, in fit, evaluate and predict. */
#define MPT__DEFAULT_BATCH_SIZE 32

static int64_t mpt__batch_size_or_default(int64_t batch_size) {
    return batch_size == 0 ? MPT__DEFAULT_BATCH_SIZE : batch_size;
}

/* Makes the model ready to train or run on batches of batch_size. */
static mpt_status mpt__prepare(mpt_model *m, int64_t batch_size, int need_compile,
                               const char *what) {
    /* with a strategy, the global batch: every replica's share */
    int64_t per = m->strategy ? mpt__strategy_total(m->strategy) : 1;
    if (!need_compile && m->built && batch_size > m->max_batch * per)
        batch_size = m->max_batch * per;
    if (batch_size <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "%s: batch_size %lld must be > 0",
                         what, (long long)batch_size);
    if (need_compile && !m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "%s: compile the model first", what);
    if (!m->built) MPT__CHECK(mpt_model_build(m, batch_size));
    if (batch_size > m->max_batch * per)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: batch_size %lld is larger than the %lld the model was built for",
                         what, (long long)batch_size, (long long)(m->max_batch * per));
    return MPT_OK;
}

/* Evaluation's record on the backend: tallies zeroed. */
static mpt_status mpt__state_reset_evaluation(mpt_model *m) {
    m->be->zero(m->impl, &m->state[1], 4 * sizeof(double)); /* loss_sum .. samples */
    return MPT_OK;
}

static mpt_status mpt__evaluation_tally(mpt_model *m, mpt__tally *t) {
    mpt_step_state st;
    MPT__CHECK(mpt__download(m, &st, &m->state[1], sizeof st));
    mpt__tally_from_state(&st, t);
    return MPT_OK;
}

/* Loss and metrics over a whole dataset, in order (evaluate, validation). */
static mpt_status mpt__evaluate(mpt_model *m, const mpt_dataset *d, int64_t batch_size,
                                int verbose, mpt__tally *t) {
    mpt__loader *loader = NULL;
    int64_t n = mpt_dataset_count(d), done = 0, *order;
    mpt_tensor x, y;
    double start = mpt__now(), last_print = 0;
    mpt_status s = MPT_OK;
    memset(t, 0, sizeof *t);
    /* a replicated model evaluates on replica 0, in pieces it was built for */
    batch_size = MPT__MIN(batch_size, m->max_batch);
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)n);
    if (!order) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "evaluate: out of memory");
    mpt__epoch_order(m, 0, 0, order, n);
    s = mpt__loader_create(m->ctx, d, batch_size, m->layers[0].dtype, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch_size);
    if (s == MPT_OK) s = mpt__state_reset_evaluation(m);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        mpt_tensor in, target;
        mpt_loss_args loss;
        s = mpt__input_on_backend(m, &x, &in);
        if (s == MPT_OK) s = mpt__target_on_backend(m, &y, &target);
        if (s != MPT_OK) break;
        mpt__model_forward(m, &in, 0);
        loss = mpt__loss_args(m, &target, 0);
        m->be->loss(m->impl, &loss);
        done++;
        if (done * batch_size >= n) s = mpt__evaluation_tally(m, t);
        if (s == MPT_OK && verbose == 1 &&
            (mpt__now() - last_print > 0.1 || done * batch_size >= n)) {
            mpt_logs logs;
            memset(&logs, 0, sizeof logs);
            if (done * batch_size < n) s = mpt__evaluation_tally(m, t);
            mpt__tally_logs(m, t, 0, &logs);
            mpt__progress(m, 1, done, (n + batch_size - 1) / batch_size, mpt__now() - start,
                          &logs, done * batch_size >= n);
            last_print = mpt__now();
        }
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    return s;
}

/* Calls one function of every callback in turn, while the status `s` of
   the calling function is MPT_OK: the first error ends the round. */
#define MPT__EACH_CALLBACK(d, fn, ...)                                           \
    do {                                                                         \
        int cb_;                                                                 \
        for (cb_ = 0; s == MPT_OK && cb_ < (d)->n_callbacks; cb_++)              \
            if ((d)->callbacks[cb_].fn)                                          \
                s = (d)->callbacks[cb_].fn((d)->callbacks[cb_].user_data, __VA_ARGS__); \
    } while (0)

/* What fit's closing summary (verbose >= 1) adds up over the epochs,
   from the measurements the epochs' logs are made of. */
typedef struct mpt__fit_totals {
    double start;              /* mpt__now() when fit began               */
    float first_scale;         /* the loss scale when fit began           */
    int64_t first_skipped;     /* the model's skipped steps then          */
    int epochs;
    int64_t steps, samples;
    double epoch_seconds;      /* the epochs' training, validation apart  */
    mpt__step_times times;     /* forward, backward, update: their sums   */
} mpt__fit_totals;

typedef struct mpt__fit_run {
    mpt_model *m;
    mpt_fit_desc *d;             /* batch_size: halved on running out of memory */
    const mpt_dataset *train, *val;
    int64_t n, steps;            /* samples and batches per epoch */
    int64_t *order;              /* (n) this epoch's sample order */
    mpt__loader *loader;
    int batch_callbacks;         /* some callback has on_batch_end */
    mpt__feed feed;              /* a model on a GPU: its uploads  */
    int64_t *mine;               /* (n) with several workers: this one's share */
    int64_t step;                /* the epoch's next global batch  */
    int64_t done;                /* samples the epoch's steps have taken */
    int64_t rows, global_rows;   /* of the batch fit_take gave      */
    mpt__fit_totals totals;      /* for the summary after the last epoch */
    struct mpt__profile *profile;  /* profile_batch's, until its range is
                                      written; NULL: steps are not timed */
    struct mpt__profile *profiled; /* then: its table, for fit's end     */
} mpt__fit_run;

/* In @impl-profiler. */
typedef struct mpt__profile mpt__profile;
static mpt_status mpt__profile_open(mpt_model *m, const mpt_fit_desc *d, int64_t run_steps,
                                    mpt__profile **out);
static int mpt__profile_fit_step(mpt__fit_run *r, mpt_tensor *x, mpt_tensor *y,
                                 mpt__step_times *times, mpt_status *s);
static void mpt__profile_loop_end(mpt__fit_run *r);
static mpt_status mpt__profile_write_pending(mpt__fit_run *r);
static mpt_status mpt__profile_close(mpt__fit_run *r, int verbose);
static void mpt__profile_free(mpt__profile *P);

static void mpt__fit_totals_add(mpt__fit_totals *t, int64_t steps, int64_t samples,
                                double seconds, const mpt__step_times *times);
static void mpt__fit_print_summary(const mpt_model *m, const mpt__fit_totals *t);

static mpt_status mpt__replicated_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                                       int64_t rows, int64_t global_rows,
                                       mpt__step_times *times);
static int64_t mpt__worker_order(const mpt_model *m, const int64_t *order, int64_t n,
                                 int64_t batch, int64_t *mine);

/* The loader's next batch, 0 at the epoch's end: with a strategy, this
   worker's rows of the next global batch (there may be none when the last
   batch is shorter than the workers are many). r->rows and r->global_rows
   say how many rows it has here and on every worker. */
static int mpt__fit_take(mpt__fit_run *r, mpt_tensor *x, mpt_tensor *y) {
    const mpt_strategy *st = r->m->strategy;
    int64_t g;
    if (!st) {
        if (!mpt__loader_next(r->loader, x, y)) return 0;
        r->rows = r->global_rows = x->shape[0];
        return 1;
    }
    if (r->step >= r->steps) return 0;
    g = MPT__MIN(r->d->batch_size, r->n - r->step * r->d->batch_size);
    r->step++;
    r->global_rows = g;
    {
        int64_t w = mpt_strategy_worker(st), W = mpt_strategy_num_workers(st);
        r->rows = g * (w + 1) / W - g * w / W;
    }
    if (r->rows > 0) return mpt__loader_next(r->loader, x, y);
    memset(x, 0, sizeof *x);
    memset(y, 0, sizeof *y);
    return 1;
}

/* The epoch's next batch, 0 at its end: on a GPU the one uploaded, else
   the loader's. */
static int mpt__fit_next(mpt__fit_run *r, mpt_tensor *x, mpt_tensor *y) {
    return r->feed.on ? r->feed.have : mpt__fit_take(r, x, y);
}

/* Starts an epoch's order on the loader: this worker's share of it. */
static void mpt__fit_start_epoch(mpt__fit_run *r) {
    const mpt_strategy *st = r->m->strategy;
    r->step = 0;
    if (st && mpt_strategy_num_workers(st) > 1) {
        int64_t n = mpt__worker_order(r->m, r->order, r->n, r->d->batch_size, r->mine);
        mpt__loader_start_epoch(r->loader, r->mine, n,
                                r->d->batch_size / mpt_strategy_num_workers(st));
    } else {
        mpt__loader_start_epoch(r->loader, r->order, r->n, r->d->batch_size);
    }
}

/* The next step on a GPU: the compute queues wait for its batch's upload,
   the batch after it starts uploading, then the step is queued. */
static mpt_status mpt__fit_feed_step(mpt__fit_run *r, mpt__step_times *times) {
    mpt_model *m = r->m;
    mpt_tensor nx, ny;
    int b = 1 - r->feed.next; /* the buffer the step's batch is in */
    mpt__feed_wait(m, &r->feed);
    r->feed.have = 0;
    if (mpt__fit_take(r, &nx, &ny))
        MPT__CHECK(mpt__feed_upload(m, &r->feed, &nx, &ny, r->rows, r->global_rows));
    return mpt__feed_step(m, &r->feed, b, times);
}

/* ---- out of memory: the batch halved, the memory planned again ------------------- */

/* What fit holds for its batches: the loader and, on a GPU, the pinned
   staging and the GEMMs planned for the batch size. */
static mpt_status mpt__fit_open_batches(mpt__fit_run *r) {
    mpt_model *m = r->m;
    int workers = m->strategy ? mpt_strategy_num_workers(m->strategy) : 1;
    mpt_status s = mpt__loader_create(m->ctx, r->train, r->d->batch_size / workers,
                                      m->layers[0].dtype, &r->loader);
    if (s == MPT_OK) s = mpt__feed_open(m, &r->feed);
    if (s == MPT_OK && r->feed.on && !m->strategy)
        s = mpt__plan_gemms(m, MPT__MIN(r->d->batch_size, r->n));
    return s;
}

static void mpt__fit_close_batches(mpt__fit_run *r) {
    mpt__feed_close(r->m, &r->feed);
    mpt__loader_destroy(r->loader);
    r->loader = NULL;
}

/* Whether fit may answer a failure `s` by halving its batch. */
static int mpt__fit_may_halve(const mpt_model *m, const mpt_fit_desc *d, mpt_status s) {
    int64_t min = d->min_batch_size > 0 ? d->min_batch_size : 1;
    return s == MPT_ERR_OUT_OF_MEMORY && d->on_out_of_memory == MPT_OOM_HALVE_BATCH &&
           !m->strategy && d->batch_size > min;
}

/* The next batch size down: half, not below the minimum. */
static int64_t mpt__fit_halved(const mpt_fit_desc *d) {
    int64_t min = d->min_batch_size > 0 ? d->min_batch_size : 1;
    return MPT__MAX(d->batch_size / 2, min);
}

static void mpt__fit_log_halving(mpt_model *m, const mpt_fit_desc *d, int64_t to,
                                 const char *when) {
    char why[sizeof m->ctx->error];
    snprintf(why, sizeof why, "%s", m->ctx->error);
    mpt__log(m->ctx, MPT_LOG_WARNING, "fit: out of memory %s at batch_size %lld (%s); halving "
             "the batch to %lld", when, (long long)d->batch_size, why, (long long)to);
    if (d->verbose)
        mpt__print(m, "Out of memory %s at batch_size %lld: continuing with batch_size %lld\n",
                   when, (long long)d->batch_size, (long long)to);
}

/* Builds a built model again for batches of max_batch (a smaller one:
   its activations and workspace shrink), keeping every parameter's value,
   the optimizer's slots and the backend's training record (the step
   counters, the loss scale and the epoch's tallies). On failure the model
   is built again at `fallback`, the batch it had, so nothing is lost. */
static mpt_status mpt__model_replan(mpt_model *m, int64_t max_batch, int64_t fallback) {
    size_t floats = 0, at = 0;
    float *saved;
    mpt_step_state record;
    mpt_status s = MPT_OK, rebuilt;
    int i, k;
    for (i = 0; i < m->n_params; i++)
        floats += (size_t)m->params[i].count * (1 + (m->params[i].trainable ? (size_t)m->n_slots : 0));
    saved = (float *)mpt__alloc(m->ctx, sizeof(float) * (floats ? floats : 1));
    if (!saved) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory saving the "
                                 "weights to plan a smaller batch");
    for (i = 0; s == MPT_OK && i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        size_t bytes = sizeof(float) * (size_t)P->count;
        s = mpt__download(m, saved + at, P->value, bytes);
        at += (size_t)P->count;
        for (k = 0; s == MPT_OK && P->trainable && k < m->n_slots; k++, at += (size_t)P->count)
            s = mpt__download(m, saved + at, P->slot[k], bytes);
    }
    if (s == MPT_OK) s = mpt__download(m, &record, m->state, sizeof record);
    if (s != MPT_OK) {
        mpt__free(m->ctx, saved);
        return s;
    }
    mpt__free_update_args(m);
    mpt__free_arenas(m);
    m->built = 0;
    m->planned_batch = 0;
    s = rebuilt = mpt__build_one(m, max_batch);
    if (rebuilt != MPT_OK) rebuilt = mpt__build_one(m, fallback);
    for (i = 0, at = 0; rebuilt == MPT_OK && i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        size_t bytes = sizeof(float) * (size_t)P->count;
        if (rebuilt == MPT_OK) rebuilt = mpt__upload(m, P->value, saved + at, bytes);
        at += (size_t)P->count;
        for (k = 0; rebuilt == MPT_OK && P->trainable && k < m->n_slots; k++, at += (size_t)P->count)
            rebuilt = mpt__upload(m, P->slot[k], saved + at, bytes);
    }
    if (rebuilt == MPT_OK) rebuilt = mpt__upload(m, m->state, &record, sizeof record);
    if (rebuilt == MPT_OK) mpt_model_refresh_weights(m);
    mpt__free(m->ctx, saved);
    return s != MPT_OK ? s : rebuilt;
}

/* After running out of memory with `done` samples of the epoch trained
   (−1: before the first epoch): the batch halved (again while even that
   does not fit, down to the minimum), the model planned for it, and the
   epoch's order taken up from sample `done`. */
static mpt_status mpt__fit_halve(mpt__fit_run *r, int64_t done, const char *when) {
    mpt_model *m = r->m;
    mpt_status s = MPT_ERR_OUT_OF_MEMORY;
    int64_t had = m->max_batch;
    mpt__fit_close_batches(r);
    while (mpt__fit_may_halve(m, r->d, s)) {
        int64_t to = mpt__fit_halved(r->d);
        mpt__fit_log_halving(m, r->d, to, when);
        r->d->batch_size = to;
        s = mpt__model_replan(m, to, had);
        mpt__memory_peak_note(m, 0);
        if (s == MPT_OK) s = mpt__fit_open_batches(r);
        if (s != MPT_OK) mpt__fit_close_batches(r);
        when = "planning the smaller batch";
    }
    if (s != MPT_OK) return s;
    if (done >= 0) {
        mpt_tensor x, y;
        mpt__loader_start_epoch(r->loader, r->order + done, r->n - done, r->d->batch_size);
        if (r->feed.on && mpt__fit_take(r, &x, &y))
            s = mpt__feed_upload(m, &r->feed, &x, &y, r->rows, r->global_rows);
    }
    return s;
}

/* A failure of the epoch's steps answered, where fit may, by halving. */
static mpt_status mpt__fit_recover(mpt__fit_run *r, mpt_status s, int64_t done) {
    while (mpt__fit_may_halve(r->m, r->d, s)) s = mpt__fit_halve(r, done, "running a step");
    return s;
}

/* The epoch's next batch and its step; 0 at the epoch's end. */
static int mpt__fit_next_step(mpt__fit_run *r, mpt_tensor *x, mpt_tensor *y,
                              mpt__step_times *times, mpt_status *s) {
    mpt_model *m = r->m;
    int64_t rows;
    if (!mpt__fit_next(r, x, y)) return 0;
    rows = r->feed.on ? r->feed.slot[0].x[1 - r->feed.next].shape[0] : x->shape[0];
    if (r->feed.on)
        *s = mpt__fit_feed_step(r, times);
    else if (m->strategy)
        *s = mpt__replicated_step(m, x, y, r->rows, r->global_rows, times);
    else
        *s = mpt__train_step(m, x, y, times);
    if (*s == MPT_OK) r->done += rows;
    return 1;
}

/* One epoch: every batch, then validation; fills the epoch's logs. */
static mpt_status mpt__fit_epoch(mpt__fit_run *r, int epoch, mpt_logs *logs, int *stop) {
    mpt_model *m = r->m;
    const mpt_fit_desc *d = r->d;
    mpt__tally tally;
    mpt__step_times times = {0, 0, 0};
    int64_t batch = 0;
    int64_t skipped_before = m->skipped_steps;
    /* A tally sums over the workers, so all must take part in each: the
       live bar (worker 0's alone, on a timer) is left out with several
       workers; the epoch's line still ends every epoch. */
    int live_bar = d->verbose == 1 && mpt_strategy_num_workers(m->strategy) <= 1;
    double start = mpt__now(), last_print = 0, seconds;
    mpt_tensor x, y;
    mpt_status s = MPT_OK;
    memset(&tally, 0, sizeof tally);
    memset(logs, 0, sizeof *logs);
    if (d->verbose) mpt__print(m, "Epoch %d/%d\n", epoch + 1, d->epochs);
    mpt__epoch_order(m, epoch, !d->no_shuffle, r->order, r->n);
    r->steps = (r->n + d->batch_size - 1) / d->batch_size;
    r->done = 0;
    mpt__fit_start_epoch(r);
    MPT__CHECK(mpt__state_push(m));
    if (r->feed.on && mpt__fit_take(r, &x, &y))
        s = mpt__fit_recover(r, mpt__feed_upload(m, &r->feed, &x, &y, r->rows, r->global_rows),
                             0);
    while (s == MPT_OK && !*stop) {
        mpt_logs batch_logs;
        int print = live_bar && mpt__now() - last_print > 0.1;
        int more = r->profile ? mpt__profile_fit_step(r, &x, &y, &times, &s)
                              : mpt__fit_next_step(r, &x, &y, &times, &s);
        if (more && s != MPT_OK && mpt__fit_may_halve(m, d, s)) {
            s = mpt__fit_recover(r, s, r->done); /* this step again, on a smaller batch */
            r->steps = batch + (r->n - r->done + d->batch_size - 1) / d->batch_size;
            continue;
        }
        if (!more || s != MPT_OK) break;
        batch++;
        /* The running values are read back only when someone looks at
           them: on a GPU each read waits for the queued steps. */
        if (!print && !r->batch_callbacks) continue;
        s = mpt__training_tally(m, &tally);
        if (s != MPT_OK) break;
        memset(&batch_logs, 0, sizeof batch_logs);
        mpt__tally_logs(m, &tally, 0, &batch_logs);
        MPT__EACH_CALLBACK(d, on_batch_end, m, batch - 1, &batch_logs, stop);
        if (print && batch < r->steps) {
            mpt__progress(m, 1, batch, r->steps, mpt__now() - start, &batch_logs, 0);
            last_print = mpt__now();
        }
    }
    if (r->profile) mpt__profile_loop_end(r);
    if (s != MPT_OK) return s;
    MPT__CHECK(mpt__training_tally(m, &tally));
    seconds = mpt__now() - start;
    MPT__CHECK(mpt__profile_write_pending(r));
    mpt__tally_logs(m, &tally, 0, logs);
    if (r->val) {
        mpt__tally vt;
        MPT__CHECK(mpt__evaluate(m, r->val, d->batch_size, 0, &vt));
        mpt__tally_logs(m, &vt, 1, logs);
    }
    if (d->verbose) mpt__progress(m, d->verbose, batch, r->steps, seconds, logs, 1);
    mpt__logs_set(logs, "learning_rate",
                  mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate,
                                        m->optimizer_steps));
    mpt__logs_set(logs, "loss_scale", m->loss_scale);
    mpt__logs_set(logs, "skipped_steps", (double)(m->skipped_steps - skipped_before));
    mpt__logs_set(logs, "epoch_seconds", seconds);
    mpt__logs_set(logs, "samples_per_second", seconds > 0 ? (double)tally.samples / seconds : 0);
    mpt__logs_set(logs, "forward_ms_per_step", batch ? 1e3 * times.forward / (double)batch : 0);
    mpt__logs_set(logs, "backward_ms_per_step", batch ? 1e3 * times.backward / (double)batch : 0);
    mpt__logs_set(logs, "update_ms_per_step", batch ? 1e3 * times.update / (double)batch : 0);
    mpt__fit_totals_add(&r->totals, batch, tally.samples, seconds, &times);
    return MPT_OK;
}

/* The decimal a float was written as: the shortest that rounds to it (0.1
   for 0.1f, not 0.100000001490116). */
static double mpt__float_as_written(float f) {
    char text[32];
    int digits;
    for (digits = 1; digits < 9; digits++) {
        double v;
        snprintf(text, sizeof text, "%.*g", digits, (double)f);
        v = strtod(text, NULL);
        if ((float)v == f) return v;
    }
    return (double)f; /* 9 digits always round-trip */
}

/* Where validation_split cuts n samples: Keras' split_at = int(n · (1 −
   validation_split)), the training part truncated and the validation part
   the rest, in double on the split as written. Widening the float itself
   would take one sample too many: 0.1f of 60,000 would give 6,001. */
static int64_t mpt__validation_split_at(int64_t n, float validation_split) {
    return (int64_t)((double)n * (1.0 - mpt__float_as_written(validation_split)));
}

/* d: the caller's descriptor with its defaults filled in. */
static mpt_status mpt__fit_check(mpt_model *m, const mpt_dataset *train, const mpt_fit_desc *d) {
    if (!train) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: NULL training data");
    if (d->epochs < 0 || d->initial_epoch < 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: epochs %d and initial_epoch %d "
                         "must not be negative", d->epochs, d->initial_epoch);
    if (!(d->validation_split >= 0 && d->validation_split < 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: validation_split %g is not in [0, 1)", d->validation_split);
    if (d->validation_split > 0 && d->validation_data)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: give validation_data or validation_split, not both");
    if (d->verbose < 0 || d->verbose > 2)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: verbose %d is not 0, 1 or 2",
                         d->verbose);
    if (d->n_callbacks < 0 || (d->n_callbacks > 0 && !d->callbacks))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: %d callbacks but no array",
                         d->n_callbacks);
    if (m->strategy && d->batch_size % mpt__strategy_total(m->strategy) != 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: batch_size %lld (the global batch) does not split evenly over "
                         "%d replicas", (long long)d->batch_size,
                         mpt__strategy_total(m->strategy));
    return mpt__prepare(m, d->batch_size, 1, "fit");
}

/* The first trainable weight holding inf or NaN: its index in m->params
   and element, read back one tensor at a time (only once something is
   known to be wrong). *param is -1 when every one is finite. */
static mpt_status mpt__first_nonfinite_weight(mpt_model *m, int *param, int64_t *element,
                                              float *value) {
    int i;
    *param = -1;
    for (i = 0; i < m->n_params && *param < 0; i++) {
        const mpt__param *P = &m->params[i];
        float *host;
        int64_t e;
        mpt_status s;
        if (!P->trainable || P->count <= 0) continue;
        host = (float *)mpt__alloc(m->ctx, sizeof(float) * (size_t)P->count);
        if (!host) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
        s = mpt__download(m, host, P->value, sizeof(float) * (size_t)P->count);
        for (e = 0; s == MPT_OK && e < P->count && *param < 0; e++)
            if (!isfinite(host[e])) *param = i, *element = e, *value = host[e];
        mpt__free(m->ctx, host);
        MPT__CHECK(s);
    }
    return MPT_OK;
}

/* After each epoch of fit: training stops with MPT_ERR_NUMERIC once a
   trainable weight or the epoch's loss is inf or NaN, since no later step
   can recover (every step after it is skipped, or it goes on from a broken
   model) and callbacks would save it. A step skipped for overflowing
   gradients (dynamic loss scaling) changes no weight and its loss is
   finite, so it never stops training. The weights are checked by the
   backend's grad_stats pass run over the masters instead of the
   gradients, into evaluation's record of the scalars (unused between
   evaluations). */
static void mpt__cb_repr(char *buf, size_t size, double v, int single);

static mpt_status mpt__fit_check_finite(mpt_model *m, int epoch, int epochs,
                                        const mpt_logs *logs) {
    const double loss = mpt_logs_get(logs, "loss");
    mpt_update_args u = m->update;
    mpt_step_state st;
    int param = -1;
    int64_t element = 0;
    float value = 0;
    char loss_text[40], value_text[40];
    u.grad = (const float *const *)u.value;
    u.state = &m->state[1];
    m->be->grad_stats(m->impl, &u);
    MPT__CHECK(mpt__download(m, &st, u.state, sizeof st));
    if (st.finite && isfinite(loss)) return MPT_OK;
    if (!st.finite) MPT__CHECK(mpt__first_nonfinite_weight(m, &param, &element, &value));
    mpt__cb_repr(loss_text, sizeof loss_text, loss, 0);
    mpt__cb_repr(value_text, sizeof value_text, value, 1);
    if (param >= 0) {
        const mpt__param *P = &m->params[param];
        const char *slash = strrchr(P->name, '/');
        return mpt__fail(m->ctx, MPT_ERR_NUMERIC,
                         "fit: epoch %d/%d: the weights became non-finite: layer %s, tensor "
                         "%s, element %lld is %s (loss %s); training stopped — lower the "
                         "learning rate, clip the gradients, or check the data",
                         epoch + 1, epochs, m->layers[P->layer].name, slash ? slash + 1 : P->name,
                         (long long)element, value_text, loss_text);
    }
    return mpt__fail(m->ctx, MPT_ERR_NUMERIC,
                     "fit: epoch %d/%d: the loss is %s (the weights are finite); training "
                     "stopped — lower the learning rate, or check the data and the model's "
                     "outputs for overflow", epoch + 1, epochs, loss_text);
}

MPTDEF mpt_status mpt_model_fit(mpt_model *m, const mpt_dataset *train, const mpt_fit_desc *desc) {
    mpt_fit_desc d;
    mpt__fit_run r;
    mpt_dataset *head = NULL, *tail = NULL;
    mpt_logs logs;
    mpt_status s = MPT_OK;
    int epoch, i, stop = 0, workers;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    MPT__CHECK(mpt__refuse_quantized(m, "fit"));
    memset(&d, 0, sizeof d);
    if (desc) d = *desc; /* NULL: every default */
    if (d.epochs == 0 && d.initial_epoch == 0) d.epochs = 1;
    d.batch_size = mpt__batch_size_or_default(d.batch_size);
    s = mpt__fit_check(m, train, &d);
    while (!m->built && mpt__fit_may_halve(m, &d, s)) { /* building failed: no state to keep */
        int64_t to = mpt__fit_halved(&d);
        m->printer = d.printer; /* the message goes where fit's output goes */
        mpt__fit_log_halving(m, &d, to, "building the model");
        d.batch_size = to;
        s = mpt__fit_check(m, train, &d);
    }
    MPT__CHECK(s);
    mpt__memory_peak_reset(m);
    workers = m->strategy ? mpt_strategy_num_workers(m->strategy) : 1;
    if (!mpt__strategy_is_chief(m->strategy)) d.verbose = 0; /* worker 0 prints */
    memset(&r, 0, sizeof r);
    r.totals.start = mpt__now();
    r.totals.first_scale = m->loss_scale;
    r.totals.first_skipped = m->skipped_steps;
    r.m = m;
    r.d = &d;
    r.train = train;
    r.val = d.validation_data;
    for (i = 0; i < d.n_callbacks; i++) r.batch_callbacks |= d.callbacks[i].on_batch_end != NULL;
    if (d.validation_split > 0) { /* Keras: the last part, before shuffling */
        int64_t n = mpt_dataset_count(train);
        int64_t keep = mpt__validation_split_at(n, d.validation_split);
        if (keep <= 0 || keep >= n)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "fit: validation_split %g of %lld samples leaves one side empty",
                             d.validation_split, (long long)n);
        MPT__CHECK(mpt_dataset_split(m->ctx, train, keep, &head, &tail));
        r.train = head;
        r.val = tail;
    }
    s = mpt__check_data(m, r.train, "fit");
    if (s == MPT_OK && r.val) s = mpt__check_data(m, r.val, "fit: validation data");
    r.n = mpt_dataset_count(r.train);
    r.steps = (r.n + d.batch_size - 1) / d.batch_size;
    r.order = s == MPT_OK ? (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)r.n) : NULL;
    if (s == MPT_OK && !r.order) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    if (s == MPT_OK && workers > 1) {
        r.mine = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)r.n);
        if (!r.mine) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    }
    if (s == MPT_OK) s = mpt__fit_open_batches(&r);
    if (mpt__fit_may_halve(m, &d, s)) s = mpt__fit_halve(&r, -1, "preparing the batches");
    if (s == MPT_OK && m->strategy && mpt__model_device(m) != MPT_DEVICE_CPU) {
        int64_t share = MPT__MIN(d.batch_size, r.n) / mpt__strategy_total(m->strategy);
        for (i = 0; s == MPT_OK && i < m->n_replicas && share > 0; i++) /* each its device */
            s = mpt__plan_gemms(m->replica[i], share);
    }
    if (s == MPT_OK) s = mpt__exchange_open(m);
    if (s == MPT_OK)
        s = mpt__profile_open(m, &d, (int64_t)(d.epochs - d.initial_epoch) * r.steps, &r.profile);
    if (s == MPT_OK) {
        m->printer = d.printer;
        mpt__set_emit_logits(m, mpt__can_fuse_softmax(m));
        mpt__history_reset(m);
        MPT__EACH_CALLBACK(&d, on_train_begin, m);
    }
    memset(&logs, 0, sizeof logs);
    for (epoch = d.initial_epoch; s == MPT_OK && !stop && epoch < d.epochs; epoch++) {
        MPT__EACH_CALLBACK(&d, on_epoch_begin, m, epoch);
        if (s == MPT_OK) s = mpt__fit_epoch(&r, epoch, &logs, &stop);
        if (s != MPT_OK) break;
        m->epoch = epoch + 1;
        s = mpt__history_append(m, &logs);
        if (s == MPT_OK) s = mpt__fit_check_finite(m, epoch, d.epochs, &logs);
        MPT__EACH_CALLBACK(&d, on_epoch_end, m, epoch, &logs, &stop);
    }
    if (s == MPT_OK) MPT__EACH_CALLBACK(&d, on_train_end, m, &logs);
    m->host_peak = m->ctx->host_peak;
    if (s == MPT_OK && d.verbose) mpt__fit_print_summary(m, &r.totals);
    if (s == MPT_OK) s = mpt__profile_close(&r, d.verbose);
    mpt__profile_free(r.profile ? r.profile : r.profiled);
    mpt__set_emit_logits(m, 0);
    mpt__exchange_free(m);
    mpt__fit_close_batches(&r);
    mpt__free(m->ctx, r.order);
    mpt__free(m->ctx, r.mine);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    return s;
}

/* ---- evaluate, predict --------------------------------------------------------------- */

MPTDEF mpt_status mpt_model_evaluate(mpt_model *m, const mpt_dataset *data,
                                     const mpt_evaluate_desc *desc, mpt_logs *logs) {
    mpt_evaluate_desc d;
    mpt__tally t;
    mpt_status s;
    int64_t batch;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (m->quantized) return mpt__quantized_evaluate(m, data, desc, logs);
    if (!data || !logs)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "evaluate: NULL %s",
                         !data ? "data" : "logs");
    memset(&d, 0, sizeof d);
    if (desc) d = *desc; /* NULL: every default */
    d.batch_size = mpt__batch_size_or_default(d.batch_size);
    memset(logs, 0, sizeof *logs);
    MPT__CHECK(mpt__prepare(m, d.batch_size, 0, "evaluate"));
    if (!m->compiled) return mpt__fail(m->ctx, MPT_ERR_STATE, "evaluate: compile the model first");
    /* Larger batches than the model was built for run in pieces: the
       result is the same, the loss being a mean over samples. */
    batch = MPT__MIN(d.batch_size, m->max_batch);
    MPT__CHECK(mpt__check_data(m, data, "evaluate"));
    m->printer = d.printer;
    m->emit_logits = mpt__can_fuse_softmax(m);
    s = mpt__evaluate(m, data, batch, d.verbose, &t);
    m->emit_logits = 0;
    if (s == MPT_OK) mpt__tally_logs(m, &t, 0, logs);
    return s;
}

/* The last forward's first n outputs, as float32, into host memory. */
static mpt_status mpt__output_to_host(mpt_model *m, float *dst, int64_t n) {
    const mpt__layer *last = &m->layers[m->n_layers - 1];
    if (mpt__model_device(m) == MPT_DEVICE_CPU) { /* in place */
        mpt__convert(m->ctx, MPT_FLOAT32, dst, last->dtype, last->y, n);
        return MPT_OK;
    }
    /* through the target buffer, which holds a batch of float32 outputs */
    m->be->convert(m->impl, MPT_FLOAT32, m->target_buf[0], last->dtype, last->y, n);
    return mpt__download(m, dst, m->target_buf[0], sizeof(float) * (size_t)n);
}

MPTDEF mpt_status mpt_model_predict(mpt_model *m, const mpt_dataset *data, int64_t batch_size,
                                    mpt_tensor *out) {
    const mpt__layer *last;
    mpt__loader *loader = NULL;
    int64_t n, shape[MPT_MAX_RANK], per_sample, done = 0, *order;
    mpt_tensor x, y;
    mpt_status s;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (m->quantized) return mpt__quantized_predict(m, data, batch_size, out);
    if (!data || !out)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "predict: NULL %s",
                         data ? "out" : "data");
    memset(out, 0, sizeof *out);
    batch_size = mpt__batch_size_or_default(batch_size);
    MPT__CHECK(mpt__prepare(m, batch_size, 0, "predict"));
    MPT__CHECK(mpt__check_samples(m, data, "predict"));
    batch_size = MPT__MIN(batch_size, m->max_batch); /* in pieces, as evaluate */
    last = &m->layers[m->n_layers - 1];
    n = mpt_dataset_count(data);
    shape[0] = n;
    memcpy(shape + 1, last->out_shape, sizeof(int64_t) * (size_t)last->out_rank);
    per_sample = last->out_count;
    MPT__CHECK(mpt_tensor_alloc(m->ctx, out, MPT_FLOAT32, last->out_rank + 1, shape));
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)n);
    if (!order) {
        mpt_tensor_free(m->ctx, out);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "predict: out of memory");
    }
    mpt__epoch_order(m, 0, 0, order, n);
    s = mpt__loader_create(m->ctx, data, batch_size, m->layers[0].dtype, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch_size);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        int64_t b = x.shape[0];
        mpt_tensor in;
        s = mpt__input_on_backend(m, &x, &in);
        if (s != MPT_OK) break;
        mpt__model_forward(m, &in, 0);
        s = mpt__output_to_host(m, (float *)out->data + done * per_sample, b * per_sample);
        done += b;
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    if (s != MPT_OK) mpt_tensor_free(m->ctx, out);
    return s;
}

/* ---- summary -------------------------------------------------------------------------- */

static const char *mpt__bytes_text(char *buf, size_t size, double bytes) {
    if (bytes >= 1 << 30) snprintf(buf, size, "%.2f GB", bytes / (1 << 30));
    else if (bytes >= 1 << 20) snprintf(buf, size, "%.2f MB", bytes / (1 << 20));
    else if (bytes >= 1 << 10) snprintf(buf, size, "%.2f KB", bytes / (1 << 10));
    else snprintf(buf, size, "%.0f B", bytes);
    return buf;
}

/* snprintf that keeps counting past the end of buf (for the needed size). */
static void mpt__append(char *buf, size_t size, size_t *used, const char *fmt, ...) {
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(*used < size ? buf + *used : NULL, *used < size ? size - *used : 0, fmt, ap);
    va_end(ap);
    if (n > 0) *used += (size_t)n;
}

MPTDEF size_t mpt_model_summary(const mpt_model *m, char *buf, size_t size) {
    static const char *const category[MPT__MEM_COUNT_] = {
        "parameters (float32)", "gradients", "optimizer state", "weight copies",
        "activations", "workspace"};
    const char *rule = "______________________________________________________________________________________________\n";
    const char *bold = "==============================================================================================\n";
    size_t used = 0;
    int64_t total = 0, trainable = 0, bytes = 0;
    int i, k;
    char a[96], b[96], c[96];
    if (!m) return 0;
    if (size) buf[0] = 0;
    if (m->quantized) return mpt__quantized_summary(m, buf, size);
    if (!m->built) {
        mpt__append(buf, size, &used,
                    "Model: \"sequential\": this model has not yet been built. Build it "
                    "first with mpt_model_build(), or train it with mpt_model_fit() (which "
                    "builds it for its batch size).\n");
        return used;
    }
    mpt__append(buf, size, &used, "Model: \"sequential\"\n");
    mpt__append(buf, size, &used, "Dtype policy: \"%s\" (variables float32, compute %s)\n%s",
                mpt_policy_name(m->desc.policy), mpt_dtype_name(m->policy_dtype), rule);
    mpt__append(buf, size, &used, " %-44s %-24s %-12s %s\n%s", "Layer (type)", "Output Shape",
                "Param #", "Dtype", bold);
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        int64_t count = 0, shape[MPT_MAX_RANK];
        for (k = 0; k < L->n_params; k++) {
            count += L->param[k]->count;
            if (L->param[k]->trainable) trainable += L->param[k]->count;
        }
        total += count;
        snprintf(a, sizeof a, "%s (%s)", L->name, L->ops->class_name);
        /* "(None, 26, 26, 32)": Keras' way of saying "any batch size" */
        shape[0] = 1;
        memcpy(shape + 1, L->out_shape, sizeof(int64_t) * (size_t)L->out_rank);
        mpt_shape_format(b, sizeof b, L->out_rank + 1, shape);
        snprintf(c, sizeof c, "(None%s", strchr(b, ','));
        mpt__append(buf, size, &used, " %-44s %-24s %-12lld %s\n", a, c, (long long)count,
                    mpt_dtype_name(L->dtype));
    }
    mpt__append(buf, size, &used, "%s", bold);
    mpt__append(buf, size, &used, "Total params: %lld (%s)\n", (long long)total,
                mpt__bytes_text(c, sizeof c, 4.0 * (double)total));
    mpt__append(buf, size, &used, "Trainable params: %lld (%s)\n", (long long)trainable,
                mpt__bytes_text(c, sizeof c, 4.0 * (double)trainable));
    mpt__append(buf, size, &used, "Non-trainable params: %lld (%s)\n%s",
                (long long)(total - trainable),
                mpt__bytes_text(c, sizeof c, 4.0 * (double)(total - trainable)), rule);
    mpt__append(buf, size, &used, "Memory for batches of %lld:\n", (long long)m->max_batch);
    for (k = 0; k < MPT__MEM_COUNT_; k++) {
        bytes += m->arena_bytes[k];
        mpt__append(buf, size, &used, "  %-22s %s\n", category[k],
                    mpt__bytes_text(c, sizeof c, (double)m->arena_bytes[k]));
    }
    mpt__append(buf, size, &used, "  %-22s %s\n", "total",
                mpt__bytes_text(c, sizeof c, (double)bytes));
    if (m->desc.memory_limit > 0)
        mpt__append(buf, size, &used, "  %-22s %s\n", "memory_limit",
                    mpt__bytes_text(c, sizeof c, (double)m->desc.memory_limit));
    mpt__append(buf, size, &used, "%s", rule);
    return used;
}
/* ---- fit's closing summary ---------------------------------------------------------------

   With verbose >= 1, fit ends with a few lines on the run as a whole, from
   the measurements its epochs' logs are made of (nothing more is timed):
       Fit: 3 epochs, 1407 steps in 12.41s (training 11.93s) - 15123 samples/s
       Step: 8.48ms - forward: 3.10ms - backward: 4.02ms - update: 0.85ms - data and host: 0.51ms
       Loss scale: 32768 -> 65536 (dynamic) - grew: 1 - shrank: 0 - skipped steps: 0
   "training" is the epochs' own time (their steps, batch callbacks and
   progress bar; not validation, nor the epoch-end callbacks), and what it
   holds beyond the forward, backward and update calls is the batches'
   loading and copying and the host's bookkeeping. On a GPU the
   three are the host's time to queue the work, and the wait for the GPU
   falls into the rest. */

static void mpt__fit_totals_add(mpt__fit_totals *t, int64_t steps, int64_t samples,
                                double seconds, const mpt__step_times *times) {
    t->epochs++;
    t->steps += steps;
    t->samples += samples;
    t->epoch_seconds += seconds;
    t->times.forward += times->forward;
    t->times.backward += times->backward;
    t->times.update += times->update;
}

/* How many times dynamic loss scaling grew the scale. Every skipped step
   shrank it by backoff_factor (mpt__loss_scale_next), so the rest of the
   change from the first scale to the final one is growth:
   final = first · growth_factor^grew · backoff_factor^shrank. (A skip at
   the smallest normal scale, which leaves it there, still counts as a
   shrink: a collapse the warning in mpt__state_pull has reported.) */
static int64_t mpt__loss_scale_growths(const mpt_loss_scale_desc *d, double first, double final,
                                       int64_t shrank) {
    double grew;
    if (d->mode != MPT_LOSS_SCALE_DYNAMIC || !(first > 0) || !(final > 0)) return 0;
    grew = (log(final / first) - (double)shrank * log((double)d->backoff_factor)) /
           log((double)d->growth_factor);
    return grew > 0.5 ? (int64_t)floor(grew + 0.5) : 0;
}

/* Milliseconds with three significant digits ("0.0123ms", "8.46ms", "123.4ms"). */
static void mpt__format_ms(char *buf, size_t size, double ms) {
    snprintf(buf, size, ms >= 100 ? "%.1fms" : "%.3gms", ms);
}

/* "Memory peak: parameters 1.2 MiB - ... - host 8.0 MiB": each
   category's most during fit (mpt_model_memory_peak). */
static void mpt__fit_print_memory_peak(const mpt_model *m) {
    mpt_memory_report p;
    char text[512], a[32];
    size_t used = 0;
    int i;
    const int64_t *b = m->memory_peak;
    if (mpt_model_memory_peak(m, &p) != MPT_OK) return;
    text[0] = 0;
    for (i = 0; i < MPT__MEM_COUNT_; i++)
        mpt__append(text, sizeof text, &used, "%s%s %s", i ? " - " : "", mpt__memory_category[i],
                    mpt__bytes_text(a, sizeof a, (double)b[i]));
    mpt__append(text, sizeof text, &used, " - host %s", mpt__bytes_text(a, sizeof a, (double)p.host));
    mpt__print(m, "Memory peak: %s\n", text);
}

static void mpt__fit_print_summary(const mpt_model *m, const mpt__fit_totals *t) {
    const mpt_loss_scale_desc *ls = &m->compile.loss_scale;
    double steps = t->steps > 0 ? (double)t->steps : 1;
    double forward = 1e3 * t->times.forward / steps, backward = 1e3 * t->times.backward / steps;
    double update = 1e3 * t->times.update / steps, step = 1e3 * t->epoch_seconds / steps;
    double rest = MPT__MAX(step - forward - backward - update, 0.0);
    int64_t skipped = m->skipped_steps - t->first_skipped;
    int64_t shrank = ls->mode == MPT_LOSS_SCALE_DYNAMIC ? skipped : 0;
    char a[32], b[32], c[32], d[32], e[32];
    if (t->epochs == 0) return;
    mpt__print(m, "Fit: %d epoch%s, %lld steps in %.2fs (training %.2fs) - %.0f samples/s\n",
               t->epochs, t->epochs == 1 ? "" : "s", (long long)t->steps,
               mpt__now() - t->start, t->epoch_seconds,
               t->epoch_seconds > 0 ? (double)t->samples / t->epoch_seconds : 0.0);
    mpt__format_ms(a, sizeof a, step);
    mpt__format_ms(b, sizeof b, forward);
    mpt__format_ms(c, sizeof c, backward);
    mpt__format_ms(d, sizeof d, update);
    mpt__format_ms(e, sizeof e, rest);
    mpt__print(m, "Step: %s - forward: %s - backward: %s - update: %s - data and host: %s\n",
               a, b, c, d, e);
    if (ls->mode == MPT_LOSS_SCALE_DYNAMIC)
        mpt__print(m, "Loss scale: %.9g -> %.9g (dynamic) - grew: %lld - shrank: %lld - "
                   "skipped steps: %lld\n", (double)t->first_scale, (double)m->loss_scale,
                   (long long)mpt__loss_scale_growths(ls, t->first_scale, m->loss_scale, shrank),
                   (long long)shrank, (long long)skipped);
    else if (ls->mode == MPT_LOSS_SCALE_FIXED)
        mpt__print(m, "Loss scale: %.9g (fixed) - skipped steps: %lld\n", (double)m->loss_scale,
                   (long long)skipped);
    else
        mpt__print(m, "Loss scale: none - skipped steps: %lld\n", (long long)skipped);
    mpt__fit_print_memory_peak(m);
}

/* ---- the history as an SVG plot ------------------------------------------------------------

   A grid of panels, two across, one per quantity: the loss, each metric
   (with their "val_" twins on the same axes), the learning rate, the loss
   scale. Each panel is a frame with its ticks, labels and legend, and a
   <g data-key="..."> per series holding a <polyline> per run of finite
   values (and a dot per point when there are few epochs, or when a run is
   one point long and would otherwise not show). Coordinates are written
   with integer arithmetic, so no locale can put a comma in them; every
   caller's string goes through mpt__svg_escaped. */

/* The SVG text, grown as it is written; oom once an allocation failed. */
typedef struct mpt__svg {
    mpt_context *ctx; /* whose allocator; NULL: malloc */
    char *text;       /* (cap) */
    size_t len, cap;
    int oom;
} mpt__svg;

static void *mpt__svg_alloc(mpt_context *ctx, size_t bytes) {
    return ctx ? mpt__alloc(ctx, bytes) : mpt__default_alloc(NULL, bytes, MPT__ALIGN);
}

static void mpt__svg_free(mpt_context *ctx, void *ptr) {
    if (ctx) mpt__free(ctx, ptr);
    else mpt__default_free(NULL, ptr);
}

/* Room for `more` bytes and a terminating 0. */
static int mpt__svg_reserve(mpt__svg *b, size_t more) {
    size_t cap = b->cap ? b->cap : 16384;
    char *grown;
    if (b->oom) return 0;
    if (more > SIZE_MAX / 4 - b->len) {
        b->oom = 1;
        return 0;
    }
    if (b->len + more < b->cap) return 1;
    while (cap <= b->len + more) cap *= 2;
    grown = (char *)mpt__svg_alloc(b->ctx, cap);
    if (!grown) {
        b->oom = 1;
        return 0;
    }
    if (b->len) memcpy(grown, b->text, b->len);
    mpt__svg_free(b->ctx, b->text);
    b->text = grown;
    b->cap = cap;
    return 1;
}

static void mpt__svg_printf(mpt__svg *b, const char *fmt, ...) {
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) b->oom = 1;
    if (n < 0 || !mpt__svg_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->text + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

static int mpt__st_utf8_len(const unsigned char *p, int64_t avail);

/* A caller's string as XML character data or an attribute's value: the
   five special characters escaped; a byte that is not UTF-8, a control
   character, U+FFFE or U+FFFF (none of which XML 1.0 allows, escaped or
   not) written as '?'. */
static void mpt__svg_escaped(mpt__svg *b, const char *text) {
    const unsigned char *p = (const unsigned char *)text;
    int64_t left = (int64_t)strlen(text);
    while (left > 0) {
        int len = mpt__st_utf8_len(p, left);
        const char *entity = *p == '&' ? "&amp;" : *p == '<' ? "&lt;" : *p == '>' ? "&gt;"
                           : *p == '"' ? "&quot;" : *p == '\'' ? "&apos;" : NULL;
        int forbidden = len == 0 || (*p < 0x20 && *p != '\t' && *p != '\n') || *p == 0x7f ||
                        (len == 3 && p[0] == 0xef && p[1] == 0xbf && p[2] >= 0xbe);
        if (entity) mpt__svg_printf(b, "%s", entity);
        else if (forbidden) mpt__svg_printf(b, "?");
        else mpt__svg_printf(b, "%.*s", len, (const char *)p);
        p += len ? len : 1;
        left -= len ? len : 1;
    }
}

/* A coordinate with one decimal, whatever the locale's decimal point. */
static void mpt__svg_number(mpt__svg *b, double v) {
    long long tenths = llround(MPT__MIN(MPT__MAX(v, -1e6), 1e6) * 10);
    long long whole = tenths < 0 ? -tenths : tenths;
    mpt__svg_printf(b, "%s%lld.%lld", tenths < 0 ? "-" : "", whole / 10, whole % 10);
}

/* "x,y" for polyline points. */
static void mpt__svg_point(mpt__svg *b, double x, double y) {
    mpt__svg_number(b, x);
    mpt__svg_printf(b, ",");
    mpt__svg_number(b, y);
}

/* <text x y ...>escaped text</text>; attributes: e.g. "text-anchor=\"end\"". */
static void mpt__svg_text(mpt__svg *b, double x, double y, const char *attributes,
                          const char *text) {
    mpt__svg_printf(b, "<text x=\"");
    mpt__svg_number(b, x);
    mpt__svg_printf(b, "\" y=\"");
    mpt__svg_number(b, y);
    mpt__svg_printf(b, "\" %s>", attributes);
    mpt__svg_escaped(b, text);
    mpt__svg_printf(b, "</text>\n");
}

static void mpt__svg_line(mpt__svg *b, double x0, double y0, double x1, double y1,
                          const char *attributes) {
    mpt__svg_printf(b, "<line x1=\"");
    mpt__svg_number(b, x0);
    mpt__svg_printf(b, "\" y1=\"");
    mpt__svg_number(b, y0);
    mpt__svg_printf(b, "\" x2=\"");
    mpt__svg_number(b, x1);
    mpt__svg_printf(b, "\" y2=\"");
    mpt__svg_number(b, y1);
    mpt__svg_printf(b, "\" %s/>\n", attributes);
}

/* One panel: up to two series on one y axis. */
typedef struct mpt__plot_panel {
    const char *title;
    int key[2];            /* history keys: the training series, the validation
                              one ("val_"); -1: none                          */
    const char *color[2];
    int log_scale;         /* log2 axis                                      */
} mpt__plot_panel;

/* A value the plot can place: finite, and on a log axis positive. Beyond
   ±1e300 the axis arithmetic would overflow, so those count as inf. */
static int mpt__plot_drawable(double v, int log_scale) {
    return isfinite(v) && fabs(v) <= 1e300 && (!log_scale || v >= 1e-300);
}

static int mpt__plot_find_key(const mpt_history *h, const char *prefix, const char *name) {
    size_t n = strlen(prefix);
    int k;
    for (k = 0; k < h->n_keys; k++)
        if (strncmp(h->keys[k], prefix, n) == 0 && strcmp(h->keys[k] + n, name) == 0) return k;
    return -1;
}

/* Whether key k's drawable values span more than a factor of 10, all > 0. */
static int mpt__plot_wants_log(const mpt_history *h, int k) {
    double lo = INFINITY, hi = 0;
    int e;
    for (e = 0; e < h->epochs; e++) {
        double v = h->values[k][e];
        if (!mpt__plot_drawable(v, 0)) continue;
        if (v <= 0) return 0;
        lo = MPT__MIN(lo, v);
        hi = MPT__MAX(hi, v);
    }
    return hi > 10 * lo;
}

static int mpt__plot_add_single(const mpt_history *h, const char *key, const char *title,
                                const char *color, mpt__plot_panel *p) {
    int k = mpt__plot_find_key(h, "", key);
    if (k < 0) return 0;
    memset(p, 0, sizeof *p);
    p->title = title;
    p->key[0] = k;
    p->key[1] = -1;
    p->color[0] = color;
    p->log_scale = strcmp(key, "loss_scale") == 0 && mpt__plot_wants_log(h, k);
    return 1;
}

/* The panels, in order: the loss and the metrics as the history has them,
   then the learning rate and the loss scale. */
static int mpt__plot_panels(const mpt_history *h, mpt__plot_panel *panels) {
    int n = 0, k;
    for (k = 0; k < h->n_keys; k++) {
        const char *key = h->keys[k];
        int validation = strncmp(key, "val_", 4) == 0;
        mpt__plot_panel *p = &panels[n];
        if (mpt__log_is_measurement(key)) continue;
        if (validation && mpt__plot_find_key(h, "", key + 4) >= 0) continue; /* with its twin */
        memset(p, 0, sizeof *p);
        p->title = validation ? key + 4 : key;
        p->key[0] = validation ? -1 : k;
        p->key[1] = validation ? k : mpt__plot_find_key(h, "val_", key);
        p->color[0] = "#1f77b4";
        p->color[1] = "#ff7f0e";
        n++;
    }
    n += mpt__plot_add_single(h, "learning_rate", "learning rate", "#2ca02c", &panels[n]);
    n += mpt__plot_add_single(h, "loss_scale", "loss scale", "#9467bd", &panels[n]);
    return n;
}

/* A y axis: its ends and tick step, in the axis' units (log2 of the value
   on a log axis). */
typedef struct mpt__plot_axis {
    double lo, hi, step;
    int log_scale;
} mpt__plot_axis;

/* 1, 2 or 5 times a power of ten, near x > 0. */
static double mpt__plot_nice(double x) {
    double p = pow(10, floor(log10(x))), f = x / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}

static mpt__plot_axis mpt__plot_y_axis(const mpt_history *h, const mpt__plot_panel *p) {
    mpt__plot_axis a;
    double lo = INFINITY, hi = -INFINITY;
    int i, e;
    a.log_scale = p->log_scale;
    for (i = 0; i < 2; i++)
        for (e = 0; p->key[i] >= 0 && e < h->epochs; e++) {
            double v = h->values[p->key[i]][e];
            if (!mpt__plot_drawable(v, a.log_scale)) continue;
            if (a.log_scale) v = log2(v);
            lo = MPT__MIN(lo, v);
            hi = MPT__MAX(hi, v);
        }
    if (lo > hi) lo = 0, hi = 1; /* nothing drawable: an empty frame */
    if (a.log_scale) {
        lo = floor(lo);
        hi = MPT__MAX(ceil(hi), lo + 1);
        a.step = ceil((hi - lo) / 6);
        a.lo = lo;
        a.hi = lo + a.step * ceil((hi - lo) / a.step);
        return a;
    }
    if (lo == hi) { /* a constant: a band around it */
        double pad = lo != 0 ? fabs(lo) * 0.1 : 1;
        lo -= pad;
        hi += pad;
    }
    a.step = mpt__plot_nice((hi - lo) / 4);
    a.lo = floor(lo / a.step) * a.step;
    a.hi = ceil(hi / a.step) * a.step;
    return a;
}

static void mpt__plot_tick_label(char *buf, size_t size, const mpt__plot_axis *a, double u) {
    if (!a->log_scale)
        snprintf(buf, size, "%g", fabs(u) < a->step * 1e-6 ? 0.0 : u);
    else if (u >= 0 && u <= 20)
        snprintf(buf, size, "%.0f", ldexp(1, (int)u));
    else
        snprintf(buf, size, "2^%d", (int)u);
}

/* Where a panel's data goes on the page. */
typedef struct mpt__plot_area {
    double x0, y0, x1, y1;
    int epochs;
} mpt__plot_area;

/* Epoch e (from 0) is drawn at e + 1 on an axis over 1..epochs; a single
   epoch in the middle of 0..2. */
static double mpt__plot_x(const mpt__plot_area *r, int e) {
    double lo = r->epochs > 1 ? 1 : 0, hi = r->epochs > 1 ? r->epochs : 2;
    return r->x0 + ((double)e + 1 - lo) / (hi - lo) * (r->x1 - r->x0);
}

static double mpt__plot_y(const mpt__plot_area *r, const mpt__plot_axis *a, double v) {
    double u = a->log_scale ? log2(v) : v;
    return r->y1 - (u - a->lo) / (a->hi - a->lo) * (r->y1 - r->y0);
}

/* The frame, grid, ticks and their labels of a panel. */
static void mpt__plot_axes(mpt__svg *b, const mpt__plot_area *r, const mpt__plot_axis *a) {
    int ticks = (int)floor((a->hi - a->lo) / a->step + 0.5), i;
    int x_step = r->epochs > 8 ? (int)mpt__plot_nice((r->epochs - 1) / 8.0) : 1, e;
    char label[48];
    for (i = 0; i <= ticks; i++) {
        double u = a->lo + i * a->step;
        double y = r->y1 - (u - a->lo) / (a->hi - a->lo) * (r->y1 - r->y0);
        mpt__svg_line(b, r->x0, y, r->x1, y, "stroke=\"#e6e6e6\"");
        mpt__plot_tick_label(label, sizeof label, a, u);
        mpt__svg_text(b, r->x0 - 6, y + 4, "text-anchor=\"end\"", label);
    }
    for (e = 1; e <= r->epochs; e = e < x_step ? x_step : e + x_step) { /* 1, then steps */
        double x = mpt__plot_x(r, e - 1);
        mpt__svg_line(b, x, r->y0, x, r->y1, "stroke=\"#e6e6e6\"");
        snprintf(label, sizeof label, "%d", e);
        mpt__svg_text(b, x, r->y1 + 16, "text-anchor=\"middle\"", label);
    }
    mpt__svg_printf(b, "<rect x=\"");
    mpt__svg_number(b, r->x0);
    mpt__svg_printf(b, "\" y=\"");
    mpt__svg_number(b, r->y0);
    mpt__svg_printf(b, "\" width=\"");
    mpt__svg_number(b, r->x1 - r->x0);
    mpt__svg_printf(b, "\" height=\"");
    mpt__svg_number(b, r->y1 - r->y0);
    mpt__svg_printf(b, "\" fill=\"none\" stroke=\"#888888\"/>\n");
    mpt__svg_text(b, (r->x0 + r->x1) / 2, r->y1 + 34, "text-anchor=\"middle\"", "epoch");
}

/* One series: a polyline per run of drawable values. */
static void mpt__plot_series(mpt__svg *b, const mpt_history *h, int k, const char *color,
                             const mpt__plot_area *r, const mpt__plot_axis *a) {
    const double *v = h->values[k];
    int e = 0, end, i;
    mpt__svg_printf(b, "<g class=\"series\" data-key=\"");
    mpt__svg_escaped(b, h->keys[k]);
    mpt__svg_printf(b, "\" fill=\"%s\" stroke=\"%s\">\n<title>", color, color);
    mpt__svg_escaped(b, h->keys[k]);
    mpt__svg_printf(b, "</title>\n");
    while (e < h->epochs) {
        if (!mpt__plot_drawable(v[e], a->log_scale)) {
            e++;
            continue;
        }
        for (end = e; end < h->epochs && mpt__plot_drawable(v[end], a->log_scale); end++) {}
        mpt__svg_printf(b, "<polyline fill=\"none\" stroke-width=\"2\" points=\"");
        for (i = e; i < end; i++) {
            if (i > e) mpt__svg_printf(b, " ");
            mpt__svg_point(b, mpt__plot_x(r, i), mpt__plot_y(r, a, v[i]));
        }
        mpt__svg_printf(b, "\"/>\n");
        for (i = e; i < end && (h->epochs <= 40 || end - e == 1); i++) {
            mpt__svg_printf(b, "<circle r=\"3\" stroke=\"none\" cx=\"");
            mpt__svg_number(b, mpt__plot_x(r, i));
            mpt__svg_printf(b, "\" cy=\"");
            mpt__svg_number(b, mpt__plot_y(r, a, v[i]));
            mpt__svg_printf(b, "\"/>\n");
        }
        e = end;
    }
    mpt__svg_printf(b, "</g>\n");
}

/* Text widths are estimated, at 7 px a character (12 px text), 8 for the
   panels' bold 14 px titles. */
static double mpt__plot_text_width(const char *text, double per_char) {
    return per_char * (double)strlen(text);
}

/* What the legend calls series i: "training" and "validation" when the
   panel has both (its title names the quantity), else the series' key. */
static const char *mpt__plot_legend_label(const mpt_history *h, const mpt__plot_panel *p, int i) {
    if (p->key[0] >= 0 && p->key[1] >= 0) return i == 0 ? "training" : "validation";
    return h->keys[p->key[i]];
}

static double mpt__plot_legend_width(const mpt_history *h, const mpt__plot_panel *p) {
    double w = 0;
    int i;
    for (i = 0; i < 2; i++)
        if (p->key[i] >= 0) w += mpt__plot_text_width(mpt__plot_legend_label(h, p, i), 7) + 40;
    return w;
}

/* The legend, right-aligned at `right`: a stroke and a label per series. */
static void mpt__plot_legend(mpt__svg *b, const mpt_history *h, const mpt__plot_panel *p,
                             double right, double y) {
    double x = right;
    int i;
    for (i = 1; i >= 0; i--) {
        char stroke[64];
        const char *label;
        if (p->key[i] < 0) continue;
        label = mpt__plot_legend_label(h, p, i);
        x -= mpt__plot_text_width(label, 7);
        mpt__svg_text(b, x, y + 4, "", label);
        snprintf(stroke, sizeof stroke, "stroke=\"%s\" stroke-width=\"2\"", p->color[i]);
        mpt__svg_line(b, x - 24, y, x - 6, y, stroke);
        x -= 40;
    }
}

/* Panel p in the box at (x, y) of size w × h: the title, and the legend
   on its line, or on a line of its own when they would overlap. */
static void mpt__plot_panel_draw(mpt__svg *b, const mpt_history *h, const mpt__plot_panel *p,
                                 double x, double y, double w, double ht) {
    mpt__plot_axis a = mpt__plot_y_axis(h, p);
    mpt__plot_area r;
    double title_end;
    int i, own_line;
    r.x0 = x + 70;
    r.x1 = x + w - 24;
    r.y1 = y + ht - 44;
    r.epochs = h->epochs;
    title_end = r.x0 + mpt__plot_text_width(p->title, 8) + (a.log_scale ? 100 : 0);
    own_line = title_end + 16 > r.x1 - mpt__plot_legend_width(h, p);
    r.y0 = y + (own_line ? 54 : 36);
    mpt__svg_text(b, r.x0, y + 22, "font-size=\"14\" font-weight=\"bold\"", p->title);
    if (a.log_scale) mpt__svg_text(b, r.x0 + mpt__plot_text_width(p->title, 8) + 12, y + 22,
                                   "fill=\"#666666\"", "(log scale)");
    mpt__plot_legend(b, h, p, r.x1, y + (own_line ? 38 : 18));
    mpt__plot_axes(b, &r, &a);
    for (i = 0; i < 2; i++)
        if (p->key[i] >= 0) mpt__plot_series(b, h, p->key[i], p->color[i], &r, &a);
}

static void mpt__plot_draw(mpt__svg *b, const mpt_history *h, const mpt__plot_panel *panels,
                           int n, int width, int height, const char *title) {
    int cols = n > 1 ? 2 : 1, rows = (n + cols - 1) / cols, i;
    double w = (double)width / cols, ht = (double)(height - 50) / rows;
    mpt__svg_printf(b, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                       "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                       "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
                       "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n",
                       width, height, width, height, width, height);
    mpt__svg_text(b, width / 2.0, 32, "text-anchor=\"middle\" font-size=\"20\"", title);
    for (i = 0; i < n; i++)
        mpt__plot_panel_draw(b, h, &panels[i], (i % cols) * w, 50 + (i / cols) * ht, w, ht);
    mpt__svg_printf(b, "</svg>\n");
}

/* A failure's message: into ctx (and its logger), or without one to stderr. */
static mpt_status mpt__plot_fail(mpt_context *ctx, mpt_status status, const char *fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    if (ctx) return mpt__fail(ctx, status, "%s", message);
    mpt__log(NULL, MPT_LOG_ERROR, "%s (%s)", message, mpt_status_string(status));
    return status;
}

/* Makes the rename durable: the directory of path synced. The file is in
   place already, so a failure here is a warning. */
static void mpt__plot_sync_dir(mpt_context *ctx, const char *path, char *scratch) {
    char *slash;
    int fd;
    strcpy(scratch, path);
    slash = strrchr(scratch, '/');
    if (!slash) strcpy(scratch, ".");
    else slash[slash == scratch] = 0; /* "/plot.svg": "/" */
    fd = open(scratch, O_RDONLY);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL && errno != EBADF))
        mpt__log(ctx, MPT_LOG_WARNING, "plot: wrote '%s', but cannot sync its directory "
                 "'%s': %s", path, scratch, strerror(errno));
    if (fd >= 0) close(fd);
}

/* Writes text to path as a checkpoint is saved (@impl-checkpoints): into
   "<path>.tmp-<pid>[-k]" (O_EXCL: nothing already there is written
   through), fsynced and renamed over path; on a failure the temporary
   file is removed and path left as it was. A plot is written in one go,
   so unlike checkpoints there is no lock, nor a sweep for what a killed
   process left. */
static mpt_status mpt__plot_write_file(mpt_context *ctx, const char *path, const char *text,
                                       size_t len) {
    size_t size = strlen(path) + 48;
    char *tmp = (char *)mpt__svg_alloc(ctx, size);
    const char *failed = NULL;
    int fd = -1, created, k, err = 0;
    if (!tmp) return mpt__plot_fail(ctx, MPT_ERR_OUT_OF_MEMORY, "plot '%s': out of memory", path);
    for (k = 0; k < 100 && fd < 0; k++) {
        if (k == 0) snprintf(tmp, size, "%s.tmp-%ld", path, (long)getpid());
        else snprintf(tmp, size, "%s.tmp-%ld-%d", path, (long)getpid(), k);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (fd < 0 && errno != EEXIST) break;
    }
    created = fd >= 0;
    if (!created) failed = "create", err = errno;
    while (!failed && len > 0) {
        ssize_t got = write(fd, text, MPT__MIN(len, (size_t)1 << 30));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) failed = "write", err = errno;
        else text += got, len -= (size_t)got;
    }
    if (!failed && fsync(fd) != 0 && errno != EINVAL) failed = "sync", err = errno;
    if (created && close(fd) != 0 && !failed) failed = "close", err = errno;
    if (!failed && rename(tmp, path) != 0) failed = "rename into place", err = errno;
    if (failed && created) remove(tmp);
    if (failed)
        mpt__plot_fail(ctx, MPT_ERR_IO, "plot: cannot %s '%s' (for '%s'): %s", failed, tmp, path,
                       strerror(err));
    else
        mpt__plot_sync_dir(ctx, path, tmp);
    mpt__svg_free(ctx, tmp);
    return failed ? MPT_ERR_IO : MPT_OK;
}

static mpt_status mpt__plot_check(const mpt_history *h, const char *path, const mpt_plot_desc *d) {
    int k;
    if (!path || !*path)
        return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot: %s path",
                              path ? "an empty" : "a NULL");
    if (!h) return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': NULL history", path);
    if (h->epochs <= 0)
        return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': the history has %d "
                              "epochs: nothing to draw (fit first)", path, h->epochs);
    if (h->n_keys < 0 || h->n_keys > MPT_MAX_LOGS)
        return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': n_keys %d is not in "
                              "0..%d", path, h->n_keys, MPT_MAX_LOGS);
    for (k = 0; k < h->n_keys; k++)
        if (!h->keys[k] || !h->values[k])
            return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': key %d has a "
                                  "NULL %s", path, k, h->keys[k] ? "values array" : "name");
    if (d->width < 0 || d->height < 0)
        return mpt__plot_fail(d->ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': width %d and height "
                              "%d must not be negative", path, d->width, d->height);
    return MPT_OK;
}

MPTDEF mpt_status mpt_history_plot_svg(const mpt_history *history, const char *path,
                                       const mpt_plot_desc *desc) {
    mpt_plot_desc d;
    mpt__plot_panel panels[MPT_MAX_LOGS];
    mpt__svg svg;
    int n, rows, width, height;
    mpt_status s;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc; /* NULL: every default */
    MPT__CHECK(mpt__plot_check(history, path, &d));
    n = mpt__plot_panels(history, panels);
    if (n == 0)
        return mpt__plot_fail(d.ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': the history has no "
                              "loss, metric, learning rate or loss scale to draw", path);
    rows = n > 1 ? (n + 1) / 2 : 1;
    width = d.width ? d.width : 1000;
    height = d.height ? d.height : 60 + 320 * rows;
    if (width < 320 || height < 200 || height < 50 + 120 * rows)
        return mpt__plot_fail(d.ctx, MPT_ERR_INVALID_ARGUMENT, "plot '%s': %d × %d pixels is "
                              "too small for %d rows of panels (at least 320 × %d)", path, width,
                              height, rows, MPT__MAX(200, 50 + 120 * rows));
    memset(&svg, 0, sizeof svg);
    svg.ctx = d.ctx;
    mpt__plot_draw(&svg, history, panels, n, width, height,
                   d.title ? d.title : "Training history");
    if (svg.oom)
        s = mpt__plot_fail(d.ctx, MPT_ERR_OUT_OF_MEMORY, "plot '%s': out of memory", path);
    else
        s = mpt__plot_write_file(d.ctx, path, svg.text, svg.len);
    mpt__svg_free(d.ctx, svg.text);
    return s;
}
/* =============================================================================
   @impl-callbacks  EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger, TensorBoard
   =============================================================================

   Each callback is a state struct behind mpt_callback.user_data. Every
   state begins with the same head (a magic number, the context that
   allocated it, and what else it owns), so that one mpt_callback_destroy
   frees any of them.

   The rules are Keras 3's (keras/src/callbacks/), named where they are
   not obvious:
   - A quantity improves on a reference when current < reference − |min_delta|
     in min mode (current > reference + |min_delta| in max mode). Auto mode
     minimises names that end in "loss" and maximises every other name.
   - A monitored name missing from an epoch's logs logs a warning (as Keras
     warns) and the callback does nothing that epoch.
   - EarlyStopping, ReduceLROnPlateau and CSVLogger reset their state in
     on_train_begin, so one callback serves several fits. ModelCheckpoint
     keeps its best value from creation on, as Keras does: a second fit only
     overwrites a best-only file with something better.
   - EarlyStopping restores the best weights in on_train_end whenever
     restore_best_weights is set and some epoch was monitored, whether or not
     it stopped training (Keras 3; Keras 2 restored only when it stopped).

   Where Keras' own behaviour does not carry over, mpt.h chooses:
   - ReduceLROnPlateau works on the model's base learning rate (float32)
     and prints the new rate with the fewest digits that read back as that
     float32 ("0.001"; Keras prints the float64 product, 0.0009999999776482583).
   - ModelCheckpoint formats its filepath with the part of Python's
     str.format a file name needs: {epoch}, {epoch:02d}, {val_loss:.2f},
     {loss:.3e}, {{ and }}. It does not create missing directories.
   - CSVLogger writes the first epoch's keys, sorted, with "\n" line ends
     (Python's csv module writes "\r\n"), and does not add the empty val_
     columns Keras adds when the first epoch has no validation keys: fit
     validates every epoch or never. Values are written as Python's repr.

   Messages go through the model's printer as whole lines ("Epoch 3: ...\n");
   fit ends its progress line before it calls on_epoch_end. */


#define MPT__CB_MAGIC 0x6d707443u /* "mptC": a live callback state       */
#define MPT__CB_NAME_MAX 64       /* a monitored name or a CSV column     */
#define MPT__CB_PATH_MAX 4096     /* a formatted checkpoint path          */

/* ---- what every callback state shares ------------------------------------- */

typedef struct mpt__cb_head {
    uint32_t magic;                           /* MPT__CB_MAGIC while alive      */
    mpt_context *ctx;                         /* allocated the state; frees it  */
    void (*release)(struct mpt__cb_head *h);  /* frees what the state owns, or NULL */
} mpt__cb_head;

/* Allocates a zeroed state of `bytes` whose first member is a head. */
static void *mpt__cb_new(mpt_context *ctx, size_t bytes, const char *what,
                         void (*release)(mpt__cb_head *), mpt_status *status) {
    mpt__cb_head *h = (mpt__cb_head *)mpt__calloc(ctx, bytes);
    *status = MPT_OK;
    if (!h) {
        *status = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
        return NULL;
    }
    h->magic = MPT__CB_MAGIC;
    h->ctx = ctx;
    h->release = release;
    return h;
}

/* Copies a string the caller owns into the state; NULL on failure. */
static char *mpt__cb_strdup(mpt_context *ctx, const char *s) {
    size_t n = strlen(s) + 1;
    char *copy = (char *)mpt__alloc(ctx, n);
    if (copy) memcpy(copy, s, n);
    return copy;
}

/* The quantity a callback watches and which way is better. */
typedef struct mpt__cb_monitor {
    char name[MPT__CB_NAME_MAX];
    int minimize;             /* 1: lower is better                     */
    double min_delta;         /* |min_delta|                            */
} mpt__cb_monitor;

static int mpt__cb_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Resolves the monitor's name (default "val_loss") and direction. */
static mpt_status mpt__cb_monitor_init(mpt_context *ctx, const char *what, const char *monitor,
                                       mpt_monitor_mode mode, double min_delta,
                                       mpt__cb_monitor *mon) {
    const char *name = monitor ? monitor : "val_loss";
    if (strlen(name) == 0 || strlen(name) >= sizeof mon->name)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: monitor \"%s\" must have 1..%d characters", what, name,
                         (int)sizeof mon->name - 1);
    if (mode != MPT_MODE_AUTO && mode != MPT_MODE_MIN && mode != MPT_MODE_MAX)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: mode %d is not MPT_MODE_AUTO, MPT_MODE_MIN or MPT_MODE_MAX", what,
                         (int)mode);
    if (!isfinite(min_delta))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "%s: min_delta %g must be finite", what,
                         min_delta);
    strcpy(mon->name, name);
    mon->minimize =
        mode == MPT_MODE_MIN || (mode == MPT_MODE_AUTO && mpt__cb_ends_with(name, "loss"));
    mon->min_delta = fabs(min_delta);
    return MPT_OK;
}

/* Whether `current` beats `reference` by more than min_delta. */
static int mpt__cb_improves(const mpt__cb_monitor *mon, double current, double reference) {
    return mon->minimize ? current < reference - mon->min_delta
                         : current > reference + mon->min_delta;
}

/* The worst value: anything finite improves on it. */
static double mpt__cb_worst(const mpt__cb_monitor *mon) {
    return mon->minimize ? INFINITY : -INFINITY;
}

/* Finds `name` in logs. Unlike mpt_logs_get, tells a logged NaN from a
   missing name. */
static int mpt__cb_find(const mpt_logs *logs, const char *name, double *value) {
    int i;
    for (i = 0; logs && i < logs->count; i++)
        if (logs->names[i] && strcmp(logs->names[i], name) == 0) {
            *value = logs->values[i];
            return 1;
        }
    return 0;
}

/* "loss,accuracy,val_loss": the names in logs, for a warning. */
static void mpt__cb_names(const mpt_logs *logs, char *buf, size_t size) {
    size_t used = 0;
    int i;
    buf[0] = 0;
    for (i = 0; logs && i < logs->count && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? "," : "",
                                 logs->names[i] ? logs->names[i] : "?");
}

/* The monitored value, or 0 after a warning (as Keras's) when the epoch's
   logs lack it. `why` completes "<why> conditioned on metric `x`". */
static int mpt__cb_monitored(const mpt_model *m, const mpt__cb_monitor *mon, const char *why,
                             const mpt_logs *logs, double *value) {
    char names[512];
    if (mpt__cb_find(logs, mon->name, value)) return 1;
    mpt__cb_names(logs, names, sizeof names);
    mpt__log(m->ctx, MPT_LOG_WARNING,
             "%s conditioned on metric `%s` which is not available. Available metrics are: %s",
             why, mon->name, names);
    return 0;
}

/* v as Python's repr writes a float: the fewest significant digits that
   read back as the same value ("0.1", "1.0", "1e-05", "0.3333333333333333",
   "1e+16", "nan", "inf"). single: the fewest that read back as the same
   float32 (a learning rate is stored as float32). */
static void mpt__cb_repr(char *buf, size_t size, double v, int single) {
    char sci[40];
    int digits, exp10, max_digits = single ? 9 : 17;
    if (isnan(v)) {
        snprintf(buf, size, "nan");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, size, v < 0 ? "-inf" : "inf");
        return;
    }
    for (digits = 1; digits < max_digits; digits++) {
        double back;
        snprintf(sci, sizeof sci, "%.*e", digits - 1, v);
        back = strtod(sci, NULL);
        if (single ? (float)back == (float)v : back == v) break;
    }
    snprintf(sci, sizeof sci, "%.*e", digits - 1, v);
    exp10 = atoi(strchr(sci, 'e') + 1);
    if (exp10 < -4 || exp10 >= 16) { /* Python's repr switches to exponents there */
        snprintf(buf, size, "%s", sci);
    } else {                         /* fixed point, at least one decimal: "100.0" */
        int decimals = digits - 1 - exp10;
        snprintf(buf, size, "%.*f", decimals < 1 ? 1 : decimals, v);
    }
}

/* =============================================================================
   EarlyStopping
   ============================================================================= */

typedef struct mpt__cb_early_stopping {
    mpt__cb_head head;
    mpt__cb_monitor mon;
    int patience, start_from_epoch, restore_best_weights, verbose;
    int has_baseline;
    double baseline;
    /* Reset by on_train_begin: */
    int wait;                 /* epochs since the wait was last reset        */
    int stopped_epoch;        /* 0-based epoch that stopped training; 0: none */
    int has_best;             /* Keras' best is None until the first epoch   */
    double best;
    int best_epoch;           /* 0-based                                     */
    int has_best_weights;
    /* Owned, sized by on_train_begin: */
    float *best_weights;      /* (weights_count) float32: every parameter's
                                 value, in parameter order                   */
    int64_t weights_count;
} mpt__cb_early_stopping;

static void mpt__cb_early_stopping_release(mpt__cb_head *h) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)h;
    mpt__free(h->ctx, es->best_weights);
    es->best_weights = NULL;
}

/* Elements over every parameter of a built model. */
static int64_t mpt__cb_weights_count(const mpt_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < m->n_params; i++) n += m->params[i].count;
    return n;
}

/* Copies every parameter's float32 value into best_weights (to = 1) or
   back from it (to = 0). */
static mpt_status mpt__cb_early_stopping_copy_weights(mpt__cb_early_stopping *es, mpt_model *m,
                                                      int to_best) {
    float *at = es->best_weights;
    int i;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        size_t bytes = sizeof(float) * (size_t)P->count;
        MPT__CHECK(to_best ? mpt__download(m, at, P->value, bytes)
                           : mpt__upload(m, P->value, at, bytes));
        at += P->count;
    }
    return MPT_OK;
}

/* Sizes the weight copy for this model: a callback may serve another model
   in a later fit. A new copy holds no best weights yet. */
static mpt_status mpt__cb_early_stopping_prepare_weights(mpt__cb_early_stopping *es, mpt_model *m) {
    int64_t n;
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "EarlyStopping: restore_best_weights needs a built model at "
                         "on_train_begin");
    n = mpt__cb_weights_count(m);
    if (n == es->weights_count && es->best_weights) return MPT_OK;
    mpt__free(es->head.ctx, es->best_weights);
    es->weights_count = 0;
    es->has_best_weights = 0;
    es->best_weights = (float *)mpt__alloc(es->head.ctx, sizeof(float) * (size_t)n);
    if (!es->best_weights)
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "EarlyStopping: cannot allocate %lld bytes for the best weights",
                         (long long)n * 4);
    es->weights_count = n;
    return MPT_OK;
}

static mpt_status mpt__cb_early_stopping_train_begin(void *user, mpt_model *m) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    es->wait = 0;
    es->stopped_epoch = 0;
    es->has_best = 0;
    es->best = 0;
    es->best_epoch = 0;
    es->has_best_weights = 0;
    return es->restore_best_weights ? mpt__cb_early_stopping_prepare_weights(es, m) : MPT_OK;
}

static mpt_status mpt__cb_early_stopping_keep_weights(mpt__cb_early_stopping *es, mpt_model *m,
                                                      int epoch) {
    MPT__CHECK(mpt__cb_early_stopping_copy_weights(es, m, 1));
    es->has_best_weights = 1;
    es->best_epoch = epoch;
    return MPT_OK;
}

/* Keras 3's on_epoch_end, step by step: the wait grows every monitored
   epoch; an improvement records the best (and its weights) and resets the
   wait only if it also beats the baseline, and never stops training. */
static mpt_status mpt__cb_early_stopping_epoch_end(void *user, mpt_model *m, int epoch,
                                                   const mpt_logs *logs, int *stop) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    double current;
    if (!mpt__cb_monitored(m, &es->mon, "Early stopping", logs, &current) ||
        epoch < es->start_from_epoch)
        return MPT_OK;
    /* A no-op after on_train_begin; guards a caller who skipped it. */
    if (es->restore_best_weights) MPT__CHECK(mpt__cb_early_stopping_prepare_weights(es, m));
    if (es->restore_best_weights && !es->has_best_weights)
        MPT__CHECK(mpt__cb_early_stopping_keep_weights(es, m, epoch));
    es->wait++;
    if (!es->has_best || mpt__cb_improves(&es->mon, current, es->best)) {
        es->has_best = 1;
        es->best = current;
        es->best_epoch = epoch;
        if (es->restore_best_weights) MPT__CHECK(mpt__cb_early_stopping_keep_weights(es, m, epoch));
        if (!es->has_baseline || mpt__cb_improves(&es->mon, current, es->baseline)) es->wait = 0;
        return MPT_OK;
    }
    if (es->wait >= es->patience && epoch > 0) {
        es->stopped_epoch = epoch;
        if (stop) *stop = 1;
    }
    return MPT_OK;
}

static mpt_status mpt__cb_early_stopping_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    (void)logs;
    if (es->stopped_epoch > 0 && es->verbose > 0)
        mpt__print(m, "Epoch %d: early stopping\n", es->stopped_epoch + 1);
    if (!es->restore_best_weights || !es->has_best_weights) return MPT_OK;
    if (!m->built || mpt__cb_weights_count(m) != es->weights_count)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "EarlyStopping: the model's parameters changed since on_train_begin "
                         "(%lld elements kept); cannot restore the best weights",
                         (long long)es->weights_count);
    if (es->verbose > 0)
        mpt__print(m, "Restoring model weights from the end of the best epoch: %d.\n",
                   es->best_epoch + 1);
    MPT__CHECK(mpt__cb_early_stopping_copy_weights(es, m, 0));
    mpt_model_refresh_weights(m);
    return MPT_OK;
}

static mpt_status mpt__cb_early_stopping_check(mpt_context *ctx, const mpt_early_stopping_desc *d) {
    if (d->patience < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: patience %d must be >= 0", d->patience);
    if (d->start_from_epoch < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: start_from_epoch %d must be >= 0", d->start_from_epoch);
    if (d->has_baseline && isnan(d->baseline))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: baseline is NaN; nothing could ever beat it");
    return MPT_OK;
}

/* Starts every created callback from a zeroed struct: the caller's *out
   is all zeros after a failure. */
static mpt_status mpt__cb_check_out(mpt_context *ctx, const char *what, mpt_callback *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "%s: NULL out", what);
    return MPT_OK;
}

MPTDEF mpt_status mpt_callback_early_stopping(mpt_context *ctx, const mpt_early_stopping_desc *d,
                                              mpt_callback *out) {
    mpt_early_stopping_desc defaults;
    mpt__cb_early_stopping *es;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "EarlyStopping", out));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* every field has a usable default */
    MPT__CHECK(mpt__cb_early_stopping_check(ctx, d));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "EarlyStopping", d->monitor, d->mode, d->min_delta, &mon));
    es = (mpt__cb_early_stopping *)mpt__cb_new(ctx, sizeof *es, "EarlyStopping",
                                               mpt__cb_early_stopping_release, &s);
    if (!es) return s;
    es->mon = mon;
    es->patience = d->patience;
    es->start_from_epoch = d->start_from_epoch;
    es->restore_best_weights = d->restore_best_weights != 0;
    es->verbose = d->verbose;
    es->has_baseline = d->has_baseline != 0;
    es->baseline = d->baseline;
    out->on_train_begin = mpt__cb_early_stopping_train_begin;
    out->on_epoch_end = mpt__cb_early_stopping_epoch_end;
    out->on_train_end = mpt__cb_early_stopping_train_end;
    out->user_data = es;
    return MPT_OK;
}

/* =============================================================================
   ReduceLROnPlateau
   ============================================================================= */

typedef struct mpt__cb_reduce_lr {
    mpt__cb_head head;
    mpt__cb_monitor mon;
    double factor;
    float min_lr;
    int patience, cooldown, verbose;
    /* Reset by on_train_begin: */
    double best;
    int wait;                 /* epochs without improvement, outside cooldown */
    int cooldown_counter;     /* epochs of cooldown left                      */
} mpt__cb_reduce_lr;

static mpt_status mpt__cb_reduce_lr_train_begin(void *user, mpt_model *m) {
    mpt__cb_reduce_lr *r = (mpt__cb_reduce_lr *)user;
    (void)m;
    r->best = mpt__cb_worst(&r->mon);
    r->wait = 0;
    r->cooldown_counter = 0;
    return MPT_OK;
}

/* Multiplies the model's base learning rate by factor, not below min_lr
   (the rate fit's schedule then scales). */
static void mpt__cb_reduce_lr_reduce(mpt__cb_reduce_lr *r, mpt_model *m, int epoch) {
    float old_lr = m->learning_rate, new_lr;
    char text[40];
    if (!(old_lr > r->min_lr)) return;
    new_lr = (float)MPT__MAX((double)old_lr * r->factor, (double)r->min_lr);
    m->learning_rate = new_lr;
    if (r->verbose > 0) {
        mpt__cb_repr(text, sizeof text, new_lr, 1);
        mpt__print(m, "Epoch %d: ReduceLROnPlateau reducing learning rate to %s.\n", epoch + 1,
                   text);
    }
    r->cooldown_counter = r->cooldown;
    r->wait = 0;
}

/* Keras 3's order: a cooldown epoch counts down and clears the wait; an
   improvement resets the wait; otherwise, outside cooldown, the wait grows
   and reaching patience lowers the rate. */
static mpt_status mpt__cb_reduce_lr_epoch_end(void *user, mpt_model *m, int epoch,
                                              const mpt_logs *logs, int *stop) {
    mpt__cb_reduce_lr *r = (mpt__cb_reduce_lr *)user;
    double current;
    (void)stop;
    if (!mpt__cb_monitored(m, &r->mon, "Learning rate reduction is", logs, &current))
        return MPT_OK;
    if (r->cooldown_counter > 0) {
        r->cooldown_counter--;
        r->wait = 0;
    }
    if (mpt__cb_improves(&r->mon, current, r->best)) {
        r->best = current;
        r->wait = 0;
    } else if (r->cooldown_counter == 0) {
        r->wait++;
        if (r->wait >= r->patience) mpt__cb_reduce_lr_reduce(r, m, epoch);
    }
    return MPT_OK;
}

static mpt_status mpt__cb_reduce_lr_check(mpt_context *ctx, const mpt_reduce_lr_desc *d) {
    if (!(d->factor >= 0 && d->factor < 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: factor %g must be in (0, 1) (0: the default 0.1); "
                         "a factor >= 1 would not reduce the rate", (double)d->factor);
    if (d->patience < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: patience %d must be >= 0", d->patience);
    if (d->cooldown < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: cooldown %d must be >= 0", d->cooldown);
    if (!(d->min_lr >= 0 && d->min_lr < INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: min_lr %g must be finite and >= 0", (double)d->min_lr);
    return MPT_OK;
}

MPTDEF mpt_status mpt_callback_reduce_lr_on_plateau(mpt_context *ctx,
                                                    const mpt_reduce_lr_desc *d,
                                                    mpt_callback *out) {
    mpt_reduce_lr_desc defaults;
    mpt__cb_reduce_lr *r;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "ReduceLROnPlateau", out));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults;
    MPT__CHECK(mpt__cb_reduce_lr_check(ctx, d));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "ReduceLROnPlateau", d->monitor, d->mode,
                                    d->min_delta != 0 ? (double)d->min_delta : 1e-4, &mon));
    r = (mpt__cb_reduce_lr *)mpt__cb_new(ctx, sizeof *r, "ReduceLROnPlateau", NULL, &s);
    if (!r) return s;
    r->mon = mon;
    /* 0.1f, not 0.1: the same rate as a factor given as 0.1f */
    r->factor = (double)(d->factor != 0 ? d->factor : 0.1f);
    r->min_lr = d->min_lr;
    r->patience = d->patience != 0 || d->has_patience ? d->patience : 10;
    r->cooldown = d->cooldown;
    r->verbose = d->verbose;
    r->best = mpt__cb_worst(&mon);
    out->on_train_begin = mpt__cb_reduce_lr_train_begin;
    out->on_epoch_end = mpt__cb_reduce_lr_epoch_end;
    out->user_data = r;
    return MPT_OK;
}

/* =============================================================================
   ModelCheckpoint
   ============================================================================= */

/* A replacement field's format spec, the part of Python's mini-language a
   file name needs: [0][width][.precision][type], type one of d f F e E g G
   or none. */
typedef struct mpt__cb_spec {
    int zero, width, precision; /* precision -1: none given */
    char type;                  /* 0: none                  */
} mpt__cb_spec;

static const char *mpt__cb_digits(const char *s, int *value) {
    *value = 0;
    while (*s >= '0' && *s <= '9' && *value < 100000) *value = *value * 10 + (*s++ - '0');
    return s;
}

static int mpt__cb_parse_spec(const char *s, const char *end, mpt__cb_spec *spec) {
    const char *after;
    spec->zero = *s == '0';
    spec->precision = -1;
    spec->type = 0;
    s = mpt__cb_digits(s, &spec->width);
    if (s < end && *s == '.') {
        after = mpt__cb_digits(s + 1, &spec->precision);
        if (after == s + 1 || spec->precision > 50) return 0;
        s = after;
    }
    if (s < end && strchr("dfFeEgG", *s)) spec->type = *s++;
    return s == end && spec->width <= 200;
}

/* One field's text: value is the epoch (is_int) or a log value. Returns
   snprintf's count, or -1 for a float given the integer type 'd'. */
static int mpt__cb_put_field(char *dst, size_t room, const mpt__cb_spec *spec, double value,
                             int is_int) {
    char repr[40];
    int w = spec->width, p = spec->precision < 0 ? 6 : spec->precision;
    switch (spec->type) {
    case 'd':
        if (!is_int) return -1;
        return snprintf(dst, room, spec->zero ? "%0*d" : "%*d", w, (int)value);
    case 'f': case 'F': return snprintf(dst, room, spec->zero ? "%0*.*f" : "%*.*f", w, p, value);
    case 'e': return snprintf(dst, room, spec->zero ? "%0*.*e" : "%*.*e", w, p, value);
    case 'E': return snprintf(dst, room, spec->zero ? "%0*.*E" : "%*.*E", w, p, value);
    case 'g': return snprintf(dst, room, spec->zero ? "%0*.*g" : "%*.*g", w, p, value);
    case 'G': return snprintf(dst, room, spec->zero ? "%0*.*G" : "%*.*G", w, p, value);
    default: break;
    }
    if (is_int) return snprintf(dst, room, spec->zero ? "%0*d" : "%*d", w, (int)value);
    if (spec->precision >= 0)
        return snprintf(dst, room, spec->zero ? "%0*.*g" : "%*.*g", w, p, value);
    mpt__cb_repr(repr, sizeof repr, value, 0); /* Python's str(float) */
    return snprintf(dst, room, "%*s", w, repr);
}

/* The value a field names: "epoch" (1-based) or a log's. */
static int mpt__cb_field_value(const char *name, int epoch1, const mpt_logs *logs, double *value,
                               int *is_int) {
    *is_int = strcmp(name, "epoch") == 0;
    if (*is_int) {
        *value = epoch1;
        return 1;
    }
    return mpt__cb_find(logs, name, value);
}

/* Parses the field that starts at the '{' at p: its name and spec, and
   where the text after its '}' starts. */
static mpt_status mpt__cb_parse_field(mpt_context *ctx, const char *pattern, const char *p,
                                      char *name, mpt__cb_spec *spec, const char **next) {
    const char *close = strchr(p, '}'), *colon;
    ptrdiff_t len;
    if (!close)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" has an unclosed '{' at offset %d "
                         "(write \"{{\" for the character)", pattern, (int)(p - pattern));
    colon = (const char *)memchr(p, ':', (size_t)(close - p));
    if (!colon) colon = close;
    len = colon - (p + 1);
    if (len < 1 || len >= MPT__CB_NAME_MAX || memchr(p + 1, '{', (size_t)len) ||
        !mpt__cb_parse_spec(colon + (colon < close), close, spec))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\": field \"%.*s\" is not {name} or "
                         "{name:spec} with spec [0][width][.precision][dfeg]", pattern,
                         (int)(close - p + 1), p);
    memcpy(name, p + 1, (size_t)len);
    name[len] = 0;
    *next = close + 1;
    return MPT_OK;
}

/* Appends one field's text at out + *n (counting what does not fit). */
static mpt_status mpt__cb_put_named(mpt_context *ctx, const char *pattern, const char *name,
                                    const mpt__cb_spec *spec, int epoch1, const mpt_logs *logs,
                                    char *out, size_t size, size_t *n) {
    char names[512];
    double value;
    int is_int, len;
    size_t at = MPT__MIN(*n, size - 1);
    if (!mpt__cb_field_value(name, epoch1, logs, &value, &is_int)) {
        mpt__cb_names(logs, names, sizeof names);
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" names {%s}, which is neither epoch "
                         "nor in the logs (%s)", pattern, name, names);
    }
    len = mpt__cb_put_field(out + at, size - at, spec, value, is_int);
    if (len < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\": {%s} is a float; 'd' is for the "
                         "epoch", pattern, name);
    *n += (size_t)len;
    return MPT_OK;
}

/* Writes pattern with each "{name}" or "{name:spec}" replaced, as Python's
   pattern.format(epoch=epoch1, **logs) does ("{{" and "}}" are braces).
   With out NULL it only checks the syntax, whatever the names. */
static mpt_status mpt__cb_format_path(mpt_context *ctx, const char *pattern, int epoch1,
                                      const mpt_logs *logs, char *out, size_t size) {
    const char *p = pattern;
    size_t n = 0;
    while (*p) {
        if (*p == '{' && p[1] != '{') {
            char name[MPT__CB_NAME_MAX];
            mpt__cb_spec spec = {0, 0, -1, 0};
            MPT__CHECK(mpt__cb_parse_field(ctx, pattern, p, name, &spec, &p));
            if (out)
                MPT__CHECK(mpt__cb_put_named(ctx, pattern, name, &spec, epoch1, logs, out, size,
                                             &n));
            continue;
        }
        if (*p == '}' && p[1] != '}')
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "ModelCheckpoint: filepath \"%s\" has a single '}' at offset %d "
                             "(write \"}}\" for the character)", pattern, (int)(p - pattern));
        /* a character, or a doubled brace that stands for one */
        if (out && n + 1 < size) out[n] = *p;
        n++;
        p += (*p == '{' || *p == '}') ? 2 : 1;
    }
    if (out && n >= size)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" becomes %zu characters, more than %zu",
                         pattern, n, size - 1);
    if (out) out[n] = 0;
    return MPT_OK;
}

typedef struct mpt__cb_model_checkpoint {
    mpt__cb_head head;
    mpt__cb_monitor mon;      /* min_delta 0, as Keras                     */
    char *filepath;           /* owned copy of the pattern                 */
    int save_best_only, save_weights_only, verbose;
    double best;              /* from creation on: Keras never resets it   */
    char path[MPT__CB_PATH_MAX]; /* this epoch's formatted filepath        */
} mpt__cb_model_checkpoint;

static void mpt__cb_model_checkpoint_release(mpt__cb_head *h) {
    mpt__cb_model_checkpoint *c = (mpt__cb_model_checkpoint *)h;
    mpt__free(h->ctx, c->filepath);
    c->filepath = NULL;
}

/* Keras' _should_save_model: with save_best_only, only an improvement (or
   a missing monitor, after a warning) is saved. */
static int mpt__cb_model_checkpoint_should_save(mpt__cb_model_checkpoint *c, mpt_model *m,
                                                int epoch, const mpt_logs *logs) {
    double current;
    if (!c->save_best_only) {
        if (c->verbose > 0) mpt__print(m, "Epoch %d: saving model to %s\n", epoch + 1, c->path);
        return 1;
    }
    if (!mpt__cb_find(logs, c->mon.name, &current)) {
        mpt__log(m->ctx, MPT_LOG_WARNING, "Can save best model only with %s available.",
                 c->mon.name);
        return 1;
    }
    if (mpt__cb_improves(&c->mon, current, c->best)) {
        if (c->verbose > 0)
            mpt__print(m, "Epoch %d: %s improved from %.5f to %.5f, saving model to %s\n",
                       epoch + 1, c->mon.name, c->best, current, c->path);
        c->best = current;
        return 1;
    }
    if (c->verbose > 0)
        mpt__print(m, "Epoch %d: %s did not improve from %.5f\n", epoch + 1, c->mon.name, c->best);
    return 0;
}

static mpt_status mpt__cb_model_checkpoint_epoch_end(void *user, mpt_model *m, int epoch,
                                                     const mpt_logs *logs, int *stop) {
    mpt__cb_model_checkpoint *c = (mpt__cb_model_checkpoint *)user;
    (void)stop;
    MPT__CHECK(mpt__cb_format_path(m->ctx, c->filepath, epoch + 1, logs, c->path, sizeof c->path));
    if (!mpt__cb_model_checkpoint_should_save(c, m, epoch, logs)) return MPT_OK;
    return c->save_weights_only ? mpt_model_save_weights(m, c->path)
                                : mpt_model_save_checkpoint(m, c->path);
}

MPTDEF mpt_status mpt_callback_model_checkpoint(mpt_context *ctx,
                                                const mpt_model_checkpoint_desc *d,
                                                mpt_callback *out) {
    mpt__cb_model_checkpoint *c;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "ModelCheckpoint", out));
    if (!d) /* NULL: every default, but filepath is required */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "ModelCheckpoint: filepath is NULL (NULL "
                         "descriptor); it is required (e.g. \"ckpt-{epoch}.safetensors\")");
    if (!d->filepath || !d->filepath[0])
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "ModelCheckpoint: filepath is %s; it is "
                         "required (e.g. \"ckpt-{epoch}.safetensors\")",
                         d->filepath ? "empty" : "NULL");
    MPT__CHECK(mpt__cb_format_path(ctx, d->filepath, 1, NULL, NULL, 0));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "ModelCheckpoint", d->monitor, d->mode, 0, &mon));
    c = (mpt__cb_model_checkpoint *)mpt__cb_new(ctx, sizeof *c, "ModelCheckpoint",
                                                mpt__cb_model_checkpoint_release, &s);
    if (!c) return s;
    c->filepath = mpt__cb_strdup(ctx, d->filepath);
    if (!c->filepath) {
        mpt__free(ctx, c);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "ModelCheckpoint: out of memory");
    }
    c->mon = mon;
    c->save_best_only = d->save_best_only != 0;
    c->save_weights_only = d->save_weights_only != 0;
    c->verbose = d->verbose;
    c->best = mpt__cb_worst(&mon);
    out->on_epoch_end = mpt__cb_model_checkpoint_epoch_end;
    out->user_data = c;
    return MPT_OK;
}

/* =============================================================================
   CSVLogger
   ============================================================================= */

typedef struct mpt__cb_csv_logger {
    mpt__cb_head head;
    char *filename;           /* owned copy                                */
    char separator;
    int append;
    /* Set by on_train_begin and the first on_epoch_end: */
    FILE *file;               /* open from on_train_begin to on_train_end  */
    int elsewhere;            /* another worker writes the file            */
    int write_header;         /* not when appending to a non-empty file    */
    int n_keys;               /* -1 until the first epoch's logs           */
    char keys[MPT_MAX_LOGS][MPT__CB_NAME_MAX]; /* the columns after "epoch", sorted */
} mpt__cb_csv_logger;

static void mpt__cb_csv_release(mpt__cb_head *h) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)h;
    if (c->file) fclose(c->file); /* a fit that failed never called on_train_end */
    c->file = NULL;
    mpt__free(h->ctx, c->filename);
    c->filename = NULL;
}

static mpt_status mpt__cb_csv_io_error(mpt_context *ctx, const mpt__cb_csv_logger *c,
                                       const char *what) {
    return mpt__fail(ctx, MPT_ERR_IO, "CSVLogger: cannot %s \"%s\": %s", what, c->filename,
                     strerror(errno));
}

/* Whether the file exists and holds at least one byte. */
static int mpt__cb_csv_has_content(const char *filename) {
    FILE *f = fopen(filename, "rb");
    int c;
    if (!f) return 0;
    c = fgetc(f);
    fclose(f);
    return c != EOF;
}

static mpt_status mpt__cb_csv_train_begin(void *user, mpt_model *m) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    if (c->file) fclose(c->file); /* the last fit ended without on_train_end */
    c->file = NULL;
    c->elsewhere = !mpt__strategy_is_chief(m->strategy); /* worker 0 writes files */
    if (c->elsewhere) return MPT_OK;
    c->write_header = !(c->append && mpt__cb_csv_has_content(c->filename));
    c->n_keys = -1;
    c->file = fopen(c->filename, c->append ? "a" : "w");
    if (!c->file)
        return mpt__cb_csv_io_error(m->ctx, c, c->append ? "open for appending" : "create");
    return MPT_OK;
}

/* A field as Python's csv module (excel dialect, minimal quoting) writes
   it: quoted, with quotes doubled, when it holds the separator, a quote or
   a line break. */
static void mpt__cb_csv_field(FILE *f, const char *text, char separator) {
    if (!strchr(text, separator) && !strpbrk(text, "\"\r\n")) {
        fputs(text, f);
        return;
    }
    fputc('"', f);
    for (; *text; text++) {
        if (*text == '"') fputc('"', f);
        fputc(*text, f);
    }
    fputc('"', f);
}

/* Fixes the columns from the first epoch's logs: their names, sorted as
   Python's sorted() sorts strings (by code point, which strcmp gives for
   UTF-8). */
static mpt_status mpt__cb_csv_set_keys(mpt__cb_csv_logger *c, mpt_model *m, const mpt_logs *logs) {
    int i, j, n = logs ? MPT__MIN(logs->count, MPT_MAX_LOGS) : 0;
    char tmp[MPT__CB_NAME_MAX];
    for (i = 0; i < n; i++) {
        const char *name = logs->names[i] ? logs->names[i] : "";
        if (strlen(name) >= MPT__CB_NAME_MAX)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "CSVLogger \"%s\": log name \"%s\" is longer than %d characters",
                             c->filename, name, MPT__CB_NAME_MAX - 1);
        strcpy(c->keys[i], name);
        for (j = i; j > 0 && strcmp(c->keys[j - 1], c->keys[j]) > 0; j--) {
            strcpy(tmp, c->keys[j]);
            strcpy(c->keys[j], c->keys[j - 1]);
            strcpy(c->keys[j - 1], tmp);
        }
    }
    c->n_keys = n;
    return MPT_OK;
}

static void mpt__cb_csv_write_header(const mpt__cb_csv_logger *c) {
    int k;
    fputs("epoch", c->file);
    for (k = 0; k < c->n_keys; k++) {
        fputc(c->separator, c->file);
        mpt__cb_csv_field(c->file, c->keys[k], c->separator);
    }
    fputc('\n', c->file);
}

/* One row: the 0-based epoch, then each column's value as Python's repr
   writes it, or "NA" when this epoch's logs lack it (as Keras). */
static void mpt__cb_csv_write_row(const mpt__cb_csv_logger *c, int epoch, const mpt_logs *logs) {
    char text[40];
    int k;
    fprintf(c->file, "%d", epoch);
    for (k = 0; k < c->n_keys; k++) {
        double v;
        fputc(c->separator, c->file);
        if (mpt__cb_find(logs, c->keys[k], &v)) {
            mpt__cb_repr(text, sizeof text, v, 0);
            fputs(text, c->file);
        } else {
            fputs("NA", c->file);
        }
    }
    fputc('\n', c->file);
}

static mpt_status mpt__cb_csv_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                        int *stop) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    (void)stop;
    if (c->elsewhere) return MPT_OK;
    if (!c->file)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "CSVLogger \"%s\": on_epoch_end before on_train_begin", c->filename);
    if (c->n_keys < 0) {
        MPT__CHECK(mpt__cb_csv_set_keys(c, m, logs));
        if (c->write_header) mpt__cb_csv_write_header(c);
    }
    mpt__cb_csv_write_row(c, epoch, logs);
    /* Flushed every epoch, so the file shows a run that is still going or
       that crashed. */
    if (fflush(c->file) != 0 || ferror(c->file)) return mpt__cb_csv_io_error(m->ctx, c, "write to");
    return MPT_OK;
}

static mpt_status mpt__cb_csv_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    int failed;
    (void)logs;
    if (!c->file) return MPT_OK;
    failed = fclose(c->file) != 0;
    c->file = NULL;
    return failed ? mpt__cb_csv_io_error(m->ctx, c, "close") : MPT_OK;
}

MPTDEF mpt_status mpt_callback_csv_logger(mpt_context *ctx, const mpt_csv_logger_desc *d,
                                          mpt_callback *out) {
    mpt__cb_csv_logger *c;
    mpt_status s;
    char sep;
    MPT__CHECK(mpt__cb_check_out(ctx, "CSVLogger", out));
    if (!d) /* NULL: every default, but filename is required */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "CSVLogger: filename is NULL (NULL descriptor); it is required");
    if (!d->filename || !d->filename[0])
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "CSVLogger: filename is %s; it is required",
                         d->filename ? "empty" : "NULL");
    sep = d->separator ? d->separator : ',';
    if (sep == '"' || sep == '\n' || sep == '\r')
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "CSVLogger \"%s\": separator 0x%02x cannot be a quote or a line break",
                         d->filename, (unsigned)(unsigned char)sep);
    c = (mpt__cb_csv_logger *)mpt__cb_new(ctx, sizeof *c, "CSVLogger", mpt__cb_csv_release, &s);
    if (!c) return s;
    c->filename = mpt__cb_strdup(ctx, d->filename);
    if (!c->filename) {
        mpt__free(ctx, c);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "CSVLogger: out of memory");
    }
    c->separator = sep;
    c->append = d->append != 0;
    c->n_keys = -1;
    out->on_train_begin = mpt__cb_csv_train_begin;
    out->on_epoch_end = mpt__cb_csv_epoch_end;
    out->on_train_end = mpt__cb_csv_train_end;
    out->user_data = c;
    return MPT_OK;
}

/* =============================================================================
   TensorBoard
   =============================================================================

   The event files TensorBoard reads, encoded here without TensorFlow or a
   protobuf library. A file is a sequence of TFRecords, little-endian:
       uint64 length | uint32 masked CRC-32C of those 8 bytes |
       data          | uint32 masked CRC-32C of the data
   whose data is one serialized Event (tensorboard/compat/proto: event.proto,
   summary.proto, tensor.proto; the field numbers are theirs):
       Event          { double wall_time = 1; int64 step = 2;
                        string file_version = 3; Summary summary = 5; }
       Summary        { repeated Value value = 1; }
       Value          { string tag = 1; float simple_value = 2;
                        HistogramProto histo = 5; TensorProto tensor = 8;
                        SummaryMetadata metadata = 9; }
       HistogramProto { double min = 1, max = 2, num = 3, sum = 4,
                        sum_squares = 5; repeated double bucket_limit = 6,
                        bucket = 7 (packed); }
       TensorProto    { DataType dtype = 1; TensorShapeProto tensor_shape = 2;
                        repeated bytes string_val = 8; }
       SummaryMetadata { PluginData plugin_data = 1 { string plugin_name = 1; } }
   A file's first record is the Event whose file_version is "brain.Event:2".
   Each record is assembled in memory and handed to the kernel in one
   write(), and the files are synced every epoch: a killed process, a full
   disk or a machine that goes down leave at most the last record cut
   short, and readers stop before it.

   As Keras' TensorBoard callback: the runs train/ and validation/ under
   log_dir, each file named events.out.tfevents.<10-digit unix seconds>.
   <host>.<pid>.<n> (tensorboard's EventFileWriter; n counts past names
   already taken); each epoch's logs as "epoch_<name>" at step = the 0-based
   epoch, the "val_" ones in validation/ without the prefix; with
   update_freq_batches N, "batch_<name>" every N batches at step = the
   batches since on_train_begin, 1-based (Keras 2's train counter after the
   step); histograms at the epochs where epoch % histogram_freq == 0.
   Where mpt.h chooses:
   - Scalars are simple_value (float32), which every TensorBoard reads; one
     Event carries all of a step's scalars.
   - Histograms are HistogramProto over TensorFlow's default buckets
     (tensorflow/core/lib/histogram/histogram.cc), runs of empty buckets
     collapsed as its EncodeToProto does; tag "<layer>/<param>". Gradients
     are the last batch's, divided by the loss scale that batch ran with,
     tag "<layer>/<param>_grad" (Keras 2's write_grads name); an epoch
     whose last step was skipped (inf or NaN gradients) has none.
   - Keras writes the model as a graph ("keras", graph_keras_model); mpt.h
     writes mpt_model_summary's table as the text "model_summary" (the text
     plugin's markdown; indented, so it shows as a fixed-width block). */

#define MPT__TB_BUCKETS 1551   /* TensorFlow's default bucket count          */
#define MPT__TB_DT_STRING 7    /* DataType DT_STRING (types.proto)            */
#define MPT__TB_HEADER 12      /* a record's length and its masked CRC       */

/* ---- CRC-32C and the record framing ----------------------------------------- */

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: a
   few records an epoch do not need a table. */
static uint32_t mpt__crc32c(const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    uint32_t crc = 0xFFFFFFFFu;
    int k;
    while (n--) {
        crc ^= *p++;
        for (k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* TFRecord stores CRCs rotated and offset, so that the CRC of data that
   holds CRCs stays meaningful. */
static uint32_t mpt__tb_masked_crc(const void *data, size_t n) {
    uint32_t crc = mpt__crc32c(data, n);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

static void mpt__tb_put_le(unsigned char *dst, uint64_t v, int bytes) {
    int i;
    for (i = 0; i < bytes; i++) dst[i] = (unsigned char)(v >> (8 * i));
}

/* ---- protobuf encoding --------------------------------------------------------- */

/* A growing buffer a message is encoded into. A failed allocation sets
   `failed`, and every later append does nothing. */
typedef struct mpt__pb {
    const mpt_context *ctx;
    unsigned char *data;
    size_t size, cap;
    int failed;
} mpt__pb;

enum { MPT__PB_VARINT = 0, MPT__PB_FIXED64 = 1, MPT__PB_LEN = 2, MPT__PB_FIXED32 = 5 };

static int mpt__pb_reserve(mpt__pb *b, size_t more) {
    unsigned char *grown;
    size_t cap;
    if (b->failed) return 0;
    if (b->size + more <= b->cap) return 1;
    cap = MPT__MAX(2 * b->cap, b->size + more + 256);
    grown = (unsigned char *)mpt__alloc(b->ctx, cap);
    if (!grown) {
        b->failed = 1;
        return 0;
    }
    if (b->size) memcpy(grown, b->data, b->size);
    mpt__free(b->ctx, b->data);
    b->data = grown;
    b->cap = cap;
    return 1;
}

static void mpt__pb_bytes(mpt__pb *b, const void *src, size_t n) {
    if (!mpt__pb_reserve(b, n)) return;
    if (n) memcpy(b->data + b->size, src, n);
    b->size += n;
}

/* v as a varint into out (at most 10 bytes); returns its length. */
static size_t mpt__pb_varint_bytes(uint64_t v, unsigned char *out) {
    size_t n = 0;
    do {
        unsigned char low = (unsigned char)(v & 0x7f);
        v >>= 7;
        out[n++] = (unsigned char)(low | (v ? 0x80 : 0));
    } while (v);
    return n;
}

static void mpt__pb_varint(mpt__pb *b, uint64_t v) {
    unsigned char bytes[10];
    mpt__pb_bytes(b, bytes, mpt__pb_varint_bytes(v, bytes));
}

static void mpt__pb_key(mpt__pb *b, int field, int wire) {
    mpt__pb_varint(b, ((uint64_t)field << 3) | (uint64_t)wire);
}

static void mpt__pb_fixed(mpt__pb *b, uint64_t bits, int bytes) {
    unsigned char le[8];
    mpt__tb_put_le(le, bits, bytes);
    mpt__pb_bytes(b, le, (size_t)bytes);
}

static void mpt__pb_double(mpt__pb *b, int field, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    mpt__pb_key(b, field, MPT__PB_FIXED64);
    mpt__pb_fixed(b, bits, 8);
}

static void mpt__pb_float(mpt__pb *b, int field, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    mpt__pb_key(b, field, MPT__PB_FIXED32);
    mpt__pb_fixed(b, bits, 4);
}

/* int64 and enum fields: a negative value is its 64-bit two's complement. */
static void mpt__pb_int64(mpt__pb *b, int field, int64_t v) {
    mpt__pb_key(b, field, MPT__PB_VARINT);
    mpt__pb_varint(b, (uint64_t)v);
}

static void mpt__pb_string(mpt__pb *b, int field, const char *s) {
    size_t n = strlen(s);
    mpt__pb_key(b, field, MPT__PB_LEN);
    mpt__pb_varint(b, n);
    mpt__pb_bytes(b, s, n);
}

/* Starts a length-delimited field whose length is not known yet (an
   embedded message); returns where its body starts, for pb_end. */
static size_t mpt__pb_begin(mpt__pb *b, int field) {
    mpt__pb_key(b, field, MPT__PB_LEN);
    return b->size;
}

/* Ends the field whose body starts at `body`: its length goes in front. */
static void mpt__pb_end(mpt__pb *b, size_t body) {
    unsigned char len[10];
    size_t n, k;
    if (b->failed) return;
    n = b->size - body;
    k = mpt__pb_varint_bytes(n, len);
    if (!mpt__pb_reserve(b, k)) return;
    memmove(b->data + body + k, b->data + body, n);
    memcpy(b->data + body, len, k);
    b->size += k;
}

/* A packed repeated double. */
static void mpt__pb_doubles(mpt__pb *b, int field, const double *v, int n) {
    size_t body = mpt__pb_begin(b, field);
    int i;
    for (i = 0; i < n; i++) {
        uint64_t bits;
        memcpy(&bits, &v[i], sizeof bits);
        mpt__pb_fixed(b, bits, 8);
    }
    mpt__pb_end(b, body);
}

/* ---- events -------------------------------------------------------------------------- */

/* Starts an event in b, after room for its record header: wall_time and
   step, then whatever the caller adds. */
static void mpt__tb_event_begin(mpt__pb *b, int64_t step) {
    static const unsigned char header[MPT__TB_HEADER] = {0};
    b->size = 0;
    b->failed = 0;
    mpt__pb_bytes(b, header, sizeof header); /* filled by mpt__tb_frame */
    mpt__pb_double(b, 1, mpt__now());
    mpt__pb_int64(b, 2, step);
}

/* Frames the event in b as a TFRecord: the header before it, the data's
   CRC after it. */
static void mpt__tb_frame(mpt__pb *b) {
    unsigned char crc[4];
    size_t n;
    if (b->failed) return;
    n = b->size - MPT__TB_HEADER;
    mpt__tb_put_le(b->data, n, 8);
    mpt__tb_put_le(b->data + 8, mpt__tb_masked_crc(b->data, 8), 4);
    mpt__tb_put_le(crc, mpt__tb_masked_crc(b->data + MPT__TB_HEADER, n), 4);
    mpt__pb_bytes(b, crc, sizeof crc);
}

static void mpt__tb_scalar(mpt__pb *b, const char *prefix, const char *name, double value) {
    size_t body = mpt__pb_begin(b, 1), n = strlen(prefix) + strlen(name);
    mpt__pb_key(b, 1, MPT__PB_LEN); /* the tag, in two pieces */
    mpt__pb_varint(b, n);
    mpt__pb_bytes(b, prefix, strlen(prefix));
    mpt__pb_bytes(b, name, strlen(name));
    mpt__pb_float(b, 2, (float)value);
    mpt__pb_end(b, body);
}

/* text with every line indented by four spaces: markdown's code block. */
static void mpt__tb_indented(mpt__pb *b, const char *text) {
    while (*text) {
        const char *end = strchr(text, '\n');
        size_t n = end ? (size_t)(end - text) + 1 : strlen(text);
        mpt__pb_bytes(b, "    ", 4);
        mpt__pb_bytes(b, text, n);
        text += n;
    }
}

/* A text summary: a scalar DT_STRING tensor for the "text" plugin. */
static void mpt__tb_text(mpt__pb *b, const char *tag, const char *text) {
    size_t value = mpt__pb_begin(b, 1), tensor, string, metadata, plugin;
    mpt__pb_string(b, 1, tag);
    tensor = mpt__pb_begin(b, 8);
    mpt__pb_int64(b, 1, MPT__TB_DT_STRING);
    mpt__pb_end(b, mpt__pb_begin(b, 2)); /* tensor_shape {}: a scalar */
    string = mpt__pb_begin(b, 8);
    mpt__tb_indented(b, text);
    mpt__pb_end(b, string);
    mpt__pb_end(b, tensor);
    metadata = mpt__pb_begin(b, 9);
    plugin = mpt__pb_begin(b, 1);
    mpt__pb_string(b, 1, "text");
    mpt__pb_end(b, plugin);
    mpt__pb_end(b, metadata);
    mpt__pb_end(b, value);
}

/* ---- histograms ------------------------------------------------------------------------ */

typedef struct mpt__tb_hist {
    double min, max, num, sum, sum_squares;
    double count[MPT__TB_BUCKETS];      /* bucket i: [limit[i-1], limit[i])  */
    int n_out;                          /* after collapsing empty runs        */
    double out_limit[MPT__TB_BUCKETS], out_count[MPT__TB_BUCKETS];
} mpt__tb_hist;

/* TensorFlow's default bucket limits, ascending: -DBL_MAX, the negatives
   of the positive ones, 0, the positive ones, DBL_MAX; the positive ones
   start at 1e-12 and grow by 10% (by repeated multiplication, as there)
   while below 1e20. */
static void mpt__tb_bucket_limits(double *limit) {
    const int half = (MPT__TB_BUCKETS - 1) / 2; /* 774 positive, then DBL_MAX */
    double v = 1.0e-12;
    int i;
    limit[half] = 0;
    for (i = 1; i < half; i++, v *= 1.1) {
        limit[half + i] = v;
        limit[half - i] = -v;
    }
    limit[MPT__TB_BUCKETS - 1] = DBL_MAX;
    limit[0] = -DBL_MAX;
}

static void mpt__tb_hist_clear(mpt__tb_hist *h) {
    memset(h, 0, sizeof *h);
    h->min = DBL_MAX; /* as TensorFlow's Clear: the last limit */
    h->max = -DBL_MAX;
}

/* Adds n values, each times `factor`, as TensorFlow's Histogram::Add
   (the bucket: the first limit above the value). NaN has no bucket and is
   left out; inf goes to the outermost bucket on its side. */
static void mpt__tb_hist_add(mpt__tb_hist *h, const double *limit, const float *values,
                             int64_t n, double factor) {
    int64_t i;
    for (i = 0; i < n; i++) {
        double v = (double)values[i] * factor;
        int lo = 0, hi = MPT__TB_BUCKETS - 1;
        if (isnan(v)) continue;
        while (lo < hi) { /* upper_bound, clamped to the last bucket */
            int mid = (lo + hi) / 2;
            if (v < limit[mid]) hi = mid;
            else lo = mid + 1;
        }
        h->count[lo] += 1;
        h->min = MPT__MIN(h->min, v);
        h->max = MPT__MAX(h->max, v);
        h->num += 1;
        h->sum += v;
        h->sum_squares += v * v;
    }
}

/* TensorFlow's EncodeToProto without preserve_zero_buckets: a run of empty
   buckets becomes one, ending at the run's last limit. */
static void mpt__tb_hist_collapse(mpt__tb_hist *h, const double *limit) {
    int i = 0;
    h->n_out = 0;
    while (i < MPT__TB_BUCKETS) {
        double end = limit[i], count = h->count[i];
        i++;
        if (count <= 0)
            for (; i < MPT__TB_BUCKETS && h->count[i] <= 0; i++) end = limit[i];
        h->out_limit[h->n_out] = end;
        h->out_count[h->n_out] = count;
        h->n_out++;
    }
}

static void mpt__tb_histo(mpt__pb *b, const char *name, const char *suffix,
                          const mpt__tb_hist *h) {
    size_t value = mpt__pb_begin(b, 1), histo;
    mpt__pb_key(b, 1, MPT__PB_LEN);
    mpt__pb_varint(b, strlen(name) + strlen(suffix));
    mpt__pb_bytes(b, name, strlen(name));
    mpt__pb_bytes(b, suffix, strlen(suffix));
    histo = mpt__pb_begin(b, 5);
    mpt__pb_double(b, 1, h->min);
    mpt__pb_double(b, 2, h->max);
    mpt__pb_double(b, 3, h->num);
    mpt__pb_double(b, 4, h->sum);
    mpt__pb_double(b, 5, h->sum_squares);
    mpt__pb_doubles(b, 6, h->out_limit, h->n_out);
    mpt__pb_doubles(b, 7, h->out_count, h->n_out);
    mpt__pb_end(b, histo);
    mpt__pb_end(b, value);
}

/* ---- files ------------------------------------------------------------------------------- */

typedef struct mpt__tb_file {
    int fd;                             /* -1: not open                       */
    int failed;                         /* a write failed: warned, no more    */
    char path[MPT__CB_PATH_MAX];        /* the file, or the directory it was
                                           to go in when it could not open    */
} mpt__tb_file;

/* mkdir -p: creates each missing directory of path. 0 or an errno. */
static int mpt__tb_mkdirs(const char *path) {
    char dir[MPT__CB_PATH_MAX];
    size_t n = strlen(path), i;
    struct stat st;
    if (n >= sizeof dir) return ENAMETOOLONG;
    memcpy(dir, path, n + 1);
    for (i = 1; i <= n; i++) {
        if (dir[i] != '/' && dir[i] != 0) continue;
        dir[i] = 0;
        if (mkdir(dir, 0777) != 0 && errno != EEXIST) return errno;
        dir[i] = path[i];
    }
    if (stat(path, &st) != 0) return errno;
    return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

/* Creates a new event file in log_dir/run. 0 or an errno. */
static int mpt__tb_create(mpt__tb_file *f, const char *log_dir, const char *run) {
    char dir[MPT__CB_PATH_MAX];
    const char *host = "localhost";
    struct utsname names;
    int n, err;
    f->fd = -1;
    f->failed = 0;
    snprintf(dir, sizeof dir, "%s/%s", log_dir, run);
    snprintf(f->path, sizeof f->path, "%s", dir);
    if ((err = mpt__tb_mkdirs(dir)) != 0) return err;
    if (uname(&names) == 0 && names.nodename[0]) host = names.nodename;
    for (n = 0; n < 1000; n++) { /* O_EXCL: never another writer's file */
        if ((size_t)snprintf(f->path, sizeof f->path, "%s/events.out.tfevents.%010lld.%s.%ld.%d",
                             dir, (long long)mpt__now(), host, (long)getpid(),
                             n) >= sizeof f->path)
            return ENAMETOOLONG;
        f->fd = open(f->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND, 0666);
        if (f->fd >= 0 || errno != EEXIST) break;
    }
    if (f->fd >= 0) return 0;
    err = errno;
    snprintf(f->path, sizeof f->path, "%s", dir); /* the message names the directory */
    return err;
}

/* Closes f after syncing it. 0 or an errno. */
static int mpt__tb_close(mpt__tb_file *f) {
    int err = 0;
    if (f->fd < 0) return 0;
    if (fsync(f->fd) != 0 && errno != EINVAL) err = errno;
    if (close(f->fd) != 0 && !err) err = errno;
    f->fd = -1;
    return err;
}

/* =============================================================================
   TensorBoard: the callback
   ============================================================================= */

typedef struct mpt__cb_tensorboard {
    mpt__cb_head head;
    char *log_dir;            /* owned copy                                 */
    int histogram_freq, fail_on_error;
    int64_t update_freq;      /* batches; 0: epochs only                    */
    /* Set by on_train_begin: */
    int elsewhere;            /* another worker writes the files            */
    int64_t batches;          /* batches since on_train_begin               */
    mpt__tb_file train, validation;
    /* Owned, reused from event to event: */
    mpt__pb event;            /* the record being encoded                   */
    float *host;              /* a parameter copied out of device memory    */
    int64_t host_count;
    double limit[MPT__TB_BUCKETS];
    mpt__tb_hist hist;
} mpt__cb_tensorboard;

static void mpt__cb_tensorboard_release(mpt__cb_head *h) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)h;
    mpt__tb_close(&t->train); /* a fit that failed never called on_train_end */
    mpt__tb_close(&t->validation);
    mpt__free(h->ctx, t->log_dir);
    mpt__free(h->ctx, t->event.data);
    mpt__free(h->ctx, t->host);
    t->log_dir = NULL;
    t->event.data = NULL;
    t->host = NULL;
}

/* A file that failed during training: with fail_on_error, fit's error;
   else a warning, and the file takes no more events. */
static mpt_status mpt__tb_failed(const mpt__cb_tensorboard *t, mpt_model *m, mpt__tb_file *f,
                                 int err, const char *what) {
    f->failed = 1;
    if (t->fail_on_error)
        return mpt__fail(m->ctx, MPT_ERR_IO, "TensorBoard: cannot %s \"%s\": %s", what, f->path,
                         strerror(err));
    mpt__log(m->ctx, MPT_LOG_WARNING,
             "TensorBoard: cannot %s \"%s\": %s; training goes on without these events", what,
             f->path, strerror(err));
    return MPT_OK;
}

/* Frames the event being encoded and appends it to f in one write. */
static mpt_status mpt__tb_write(mpt__cb_tensorboard *t, mpt_model *m, mpt__tb_file *f) {
    mpt__pb *b = &t->event;
    size_t done = 0;
    if (f->fd < 0 || f->failed) return MPT_OK;
    mpt__tb_frame(b);
    if (b->failed) return mpt__tb_failed(t, m, f, ENOMEM, "encode an event for");
    while (done < b->size) {
        ssize_t n = write(f->fd, b->data + done, b->size - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return mpt__tb_failed(t, m, f, n < 0 ? errno : EIO, "write to");
        done += (size_t)n;
    }
    return MPT_OK;
}

/* A file's first event: the version of the format. */
static mpt_status mpt__tb_file_version(mpt__cb_tensorboard *t, mpt_model *m, mpt__tb_file *f) {
    mpt__tb_event_begin(&t->event, 0);
    mpt__pb_string(&t->event, 3, "brain.Event:2");
    return mpt__tb_write(t, m, f);
}

/* mpt_model_summary's table as the text "model_summary" at step 0. */
static mpt_status mpt__tb_model_summary(mpt__cb_tensorboard *t, mpt_model *m) {
    size_t n = mpt_model_summary(m, NULL, 0) + 1, summary;
    char *table = (char *)mpt__alloc(m->ctx, n);
    if (!table) return mpt__tb_failed(t, m, &t->train, ENOMEM, "summarize the model for");
    mpt_model_summary(m, table, n);
    mpt__tb_event_begin(&t->event, 0);
    summary = mpt__pb_begin(&t->event, 5);
    mpt__tb_text(&t->event, "model_summary", table);
    mpt__pb_end(&t->event, summary);
    mpt__free(m->ctx, table);
    return mpt__tb_write(t, m, &t->train);
}

static mpt_status mpt__cb_tensorboard_train_begin(void *user, mpt_model *m) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)user;
    int err;
    mpt__tb_close(&t->train); /* the last fit ended without on_train_end */
    mpt__tb_close(&t->validation);
    t->validation.failed = 0;
    t->elsewhere = !mpt__strategy_is_chief(m->strategy); /* worker 0 writes files */
    t->batches = 0;
    if (t->elsewhere) return MPT_OK;
    err = mpt__tb_create(&t->train, t->log_dir, "train");
    if (err) /* before training: the log directory is unusable */
        return mpt__fail(m->ctx, MPT_ERR_IO, "TensorBoard: cannot create an event file in \"%s\": "
                         "%s", t->train.path, strerror(err));
    MPT__CHECK(mpt__tb_file_version(t, m, &t->train));
    return mpt__tb_model_summary(t, m);
}

/* One event of the logs whose names start with "val_" (val = 1; written
   without the prefix) or do not (val = 0), each tagged prefix + name. */
static mpt_status mpt__tb_scalars(mpt__cb_tensorboard *t, mpt_model *m, mpt__tb_file *f,
                                  const char *prefix, int64_t step, const mpt_logs *logs,
                                  int val) {
    size_t summary;
    int i, any = 0;
    mpt__tb_event_begin(&t->event, step);
    summary = mpt__pb_begin(&t->event, 5);
    for (i = 0; logs && i < logs->count; i++) {
        const char *name = logs->names[i];
        if (!name || (strncmp(name, "val_", 4) == 0) != val) continue;
        mpt__tb_scalar(&t->event, prefix, val ? name + 4 : name, logs->values[i]);
        any = 1;
    }
    mpt__pb_end(&t->event, summary);
    return any ? mpt__tb_write(t, m, f) : MPT_OK;
}

static int mpt__tb_has_val(const mpt_logs *logs) {
    int i;
    for (i = 0; logs && i < logs->count; i++)
        if (logs->names[i] && strncmp(logs->names[i], "val_", 4) == 0) return 1;
    return 0;
}

/* The validation run's file, opened at the first epoch with validation
   logs (Keras creates it as lazily: a fit without validation has none). */
static mpt_status mpt__tb_open_validation(mpt__cb_tensorboard *t, mpt_model *m) {
    int err;
    if (t->validation.fd >= 0 || t->validation.failed) return MPT_OK;
    err = mpt__tb_create(&t->validation, t->log_dir, "validation");
    if (err) return mpt__tb_failed(t, m, &t->validation, err, "create an event file in");
    return mpt__tb_file_version(t, m, &t->validation);
}

/* A parameter's float32 values in host memory: the tensor itself on the
   CPU, else a copy from the device (as checkpoints read it). */
static mpt_status mpt__tb_host_values(mpt__cb_tensorboard *t, mpt_model *m, const mpt_tensor *v,
                                      const float **values) {
    int64_t n = mpt_tensor_count(v);
    if (v->device == MPT_DEVICE_CPU) {
        *values = (const float *)v->data;
        return MPT_OK;
    }
    if (n > t->host_count) {
        mpt__free(t->head.ctx, t->host);
        t->host_count = 0;
        t->host = (float *)mpt__alloc(t->head.ctx, sizeof(float) * (size_t)n);
        if (!t->host)
            return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                             "TensorBoard: cannot allocate %lld bytes for a histogram",
                             (long long)n * 4);
        t->host_count = n;
    }
    *values = t->host;
    return mpt__download(m, t->host, v->data, sizeof(float) * (size_t)n);
}

/* One histogram event: v's values times factor, tagged name + suffix. */
static mpt_status mpt__tb_histogram(mpt__cb_tensorboard *t, mpt_model *m, const char *name,
                                    const char *suffix, const mpt_tensor *v, double factor,
                                    int epoch) {
    const float *values = NULL;
    size_t summary;
    MPT__CHECK(mpt__tb_host_values(t, m, v, &values));
    mpt__tb_hist_clear(&t->hist);
    mpt__tb_hist_add(&t->hist, t->limit, values, mpt_tensor_count(v), factor);
    mpt__tb_hist_collapse(&t->hist, t->limit);
    mpt__tb_event_begin(&t->event, epoch);
    summary = mpt__pb_begin(&t->event, 5);
    mpt__tb_histo(&t->event, name, suffix, &t->hist);
    mpt__pb_end(&t->event, summary);
    return mpt__tb_write(t, m, &t->train);
}

/* The loss scale the last step's gradients were multiplied by, or 0 when
   that step was skipped (its gradients hold inf or NaN). The model's
   scale is the one after the step: dynamic scaling grows it after
   growth_interval finite steps in a row, good_steps then back at 0 (unless
   growing would have passed FLT_MAX). */
static mpt_status mpt__tb_last_scale(mpt_model *m, double *scale) {
    const mpt_loss_scale_desc *d = &m->compile.loss_scale;
    mpt_step_state st;
    MPT__CHECK(mpt__download(m, &st, m->state, sizeof st));
    *scale = st.finite ? st.loss_scale : 0;
    if (st.finite && d->mode == MPT_LOSS_SCALE_DYNAMIC && st.good_steps == 0 &&
        (double)st.loss_scale * d->growth_factor <= FLT_MAX)
        *scale = (double)st.loss_scale / d->growth_factor;
    return MPT_OK;
}

/* Every parameter's values and every trainable one's gradient. */
static mpt_status mpt__tb_histograms(mpt__cb_tensorboard *t, mpt_model *m, int epoch) {
    double scale;
    int i;
    MPT__CHECK(mpt__tb_last_scale(m, &scale));
    for (i = 0; i < mpt_model_param_count(m) && !t->train.failed; i++) {
        mpt_param_info info;
        MPT__CHECK(mpt_model_param(m, i, &info));
        MPT__CHECK(mpt__tb_histogram(t, m, info.name, "", &info.value, 1.0, epoch));
        if (info.grad.data && scale > 0)
            MPT__CHECK(mpt__tb_histogram(t, m, info.name, "_grad", &info.grad, 1.0 / scale,
                                         epoch));
    }
    return MPT_OK;
}

/* Syncs a file at the end of an epoch, so that a machine that goes down
   keeps the epochs before. */
static mpt_status mpt__tb_sync(const mpt__cb_tensorboard *t, mpt_model *m, mpt__tb_file *f) {
    if (f->fd < 0 || f->failed || fsync(f->fd) == 0 || errno == EINVAL) return MPT_OK;
    return mpt__tb_failed(t, m, f, errno, "sync");
}

static mpt_status mpt__cb_tensorboard_epoch_end(void *user, mpt_model *m, int epoch,
                                                const mpt_logs *logs, int *stop) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)user;
    (void)stop;
    if (t->elsewhere) return MPT_OK;
    if (t->train.fd < 0 && !t->train.failed)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "TensorBoard \"%s\": on_epoch_end before on_train_begin", t->log_dir);
    MPT__CHECK(mpt__tb_scalars(t, m, &t->train, "epoch_", epoch, logs, 0));
    if (mpt__tb_has_val(logs)) {
        MPT__CHECK(mpt__tb_open_validation(t, m));
        MPT__CHECK(mpt__tb_scalars(t, m, &t->validation, "epoch_", epoch, logs, 1));
    }
    if (t->histogram_freq > 0 && epoch % t->histogram_freq == 0)
        MPT__CHECK(mpt__tb_histograms(t, m, epoch));
    MPT__CHECK(mpt__tb_sync(t, m, &t->train));
    return mpt__tb_sync(t, m, &t->validation);
}

static mpt_status mpt__cb_tensorboard_batch_end(void *user, mpt_model *m, int64_t batch,
                                                const mpt_logs *logs, int *stop) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)user;
    (void)batch;
    (void)stop;
    if (t->elsewhere) return MPT_OK;
    t->batches++;
    if (t->batches % t->update_freq != 0) return MPT_OK;
    return mpt__tb_scalars(t, m, &t->train, "batch_", t->batches, logs, 0);
}

static mpt_status mpt__cb_tensorboard_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)user;
    mpt__tb_file *files[2];
    int k;
    (void)logs;
    files[0] = &t->train;
    files[1] = &t->validation;
    for (k = 0; k < 2; k++) {
        int err = mpt__tb_close(files[k]);
        if (err && !files[k]->failed) MPT__CHECK(mpt__tb_failed(t, m, files[k], err, "close"));
    }
    return MPT_OK;
}

static mpt_status mpt__cb_tensorboard_check(mpt_context *ctx, const mpt_tensorboard_desc *d) {
    int err;
    if (!d) /* NULL: every default, but log_dir is required */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "TensorBoard: log_dir is NULL (NULL descriptor); it is required");
    if (!d->log_dir || !d->log_dir[0])
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "TensorBoard: log_dir is %s; it is required",
                         d->log_dir ? "empty" : "NULL");
    if (d->histogram_freq < 0 || d->update_freq_batches < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "TensorBoard \"%s\": histogram_freq %d and update_freq_batches %lld "
                         "must not be negative", d->log_dir, d->histogram_freq,
                         (long long)d->update_freq_batches);
    if (strlen(d->log_dir) > MPT__CB_PATH_MAX - 512) /* room for the runs' file names */
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "TensorBoard: log_dir has %zu characters, more than %d",
                         strlen(d->log_dir), MPT__CB_PATH_MAX - 512);
    err = mpt__tb_mkdirs(d->log_dir);
    if (!err && access(d->log_dir, W_OK | X_OK) != 0) err = errno;
    if (err)
        return mpt__fail(ctx, MPT_ERR_IO, "TensorBoard: log_dir \"%s\" cannot be created or "
                         "written to: %s", d->log_dir, strerror(err));
    return MPT_OK;
}

MPTDEF mpt_status mpt_callback_tensorboard(mpt_context *ctx, const mpt_tensorboard_desc *d,
                                           mpt_callback *out) {
    mpt__cb_tensorboard *t;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "TensorBoard", out));
    MPT__CHECK(mpt__cb_tensorboard_check(ctx, d));
    t = (mpt__cb_tensorboard *)mpt__cb_new(ctx, sizeof *t, "TensorBoard",
                                           mpt__cb_tensorboard_release, &s);
    if (!t) return s;
    t->train.fd = t->validation.fd = -1;
    t->event.ctx = ctx;
    t->log_dir = mpt__cb_strdup(ctx, d->log_dir);
    if (!t->log_dir) {
        mpt__free(ctx, t);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "TensorBoard: out of memory");
    }
    t->histogram_freq = d->histogram_freq;
    t->update_freq = d->update_freq_batches;
    t->fail_on_error = d->fail_on_error != 0;
    mpt__tb_bucket_limits(t->limit);
    out->on_train_begin = mpt__cb_tensorboard_train_begin;
    out->on_epoch_end = mpt__cb_tensorboard_epoch_end;
    out->on_train_end = mpt__cb_tensorboard_train_end;
    /* only when asked: fit reads the running values back for batch callbacks */
    if (t->update_freq > 0) out->on_batch_end = mpt__cb_tensorboard_batch_end;
    out->user_data = t;
    return MPT_OK;
}

/* =============================================================================
   Destroying any of them
   ============================================================================= */

/* Frees a callback made by the functions above and zeroes *cb. A zeroed
   callback, or one already destroyed through this pointer, is left alone;
   so is a caller's own callback whose user_data does not start with the
   head (its first 4 bytes would have to be the magic number). */
MPTDEF void mpt_callback_destroy(mpt_callback *cb) {
    mpt__cb_head *h;
    if (!cb) return;
    h = (mpt__cb_head *)cb->user_data;
    if (h && h->magic == MPT__CB_MAGIC) {
        h->magic = 0; /* a stale copy of *cb then finds no live state */
        if (h->release) h->release(h);
        mpt__free(h->ctx, h);
    }
    memset(cb, 0, sizeof *cb);
}
/* =============================================================================
   @impl-profiler  fit's profile_batch: the steps of a range timed piece by
   piece, written as a Chrome trace, and a table of the layers' times
   =============================================================================

   A profiled step runs the same calls in the same order as any other step
   (mpt__queue_step), with a marker after each piece: every layer's
   forward, the loss, every layer's backward, the gradients' check, every
   layer's update, and the loss-scale bookkeeping with the layers' commit.
   The update, one fused call over every parameter in an ordinary step,
   runs layer by layer here: each layer's call reads a copy of the step's
   record (so each sees the same optimizer step, loss scale and gradient
   norm) and the last copy, one optimizer step on, goes back; every weight
   comes out bit for bit as the fused call leaves it. On a backend with a
   timer (CUDA: events) the markers are queued with the work and read once
   after the last profiled step; elsewhere the host's monotonic clock reads
   them as the calls return, which on the CPU is when the work is done.

   The host's side of each step is timed too, by the same clock: the data
   wait (the batch fetched, or on a GPU the next one loaded and its copy
   started), the calls that queue the step, and the host work after it
   (callbacks, the progress bar, reading the metrics back) up to the next
   step's fetch. The backend's record of the training scalars is copied
   aside before and after each step (on its queue, nothing waits), so the
   trace gives each step's own loss and loss scale. */

/* The pieces of a step, in the order a step runs them. */
enum {
    MPT__PROF_BEGIN = 0,     /* the step's first marker */
    MPT__PROF_FORWARD,
    MPT__PROF_LOSS,
    MPT__PROF_BACKWARD,
    MPT__PROF_GRAD_CHECK,
    MPT__PROF_UPDATE,
    MPT__PROF_LOSS_SCALE
};

static const char *const mpt__profile_piece[] = {"step", "forward", "loss", "backward",
                                                 "gradient check", "update", "loss scale"};

/* One profiled step, host times in seconds of mpt__profile_clock. */
typedef struct mpt__profile_step {
    int64_t step;            /* 1-based over the fit, as profile_batch counts */
    int epoch;               /* 0-based                                 */
    int64_t rows;            /* the batch's                             */
    int first_mark, n_marks; /* its markers in the profile's arrays     */
    double begin;            /* its batch asked for                     */
    double data_end;         /* the batch ready (and the next one started on a GPU) */
    double queued;           /* the step's calls returned               */
    double end;              /* the next fetch begins: host work done   */
} mpt__profile_step;

struct mpt__profile {
    mpt_model *m;
    int64_t first, last;     /* profile_batch                           */
    int64_t step;            /* steps fit has begun                     */
    int fail_on_error;
    int open;                /* the last step's host work not yet ended  */
    int written;             /* finished: the files written (or refused) */
    char *dir;               /* profile_dir                             */
    int n_steps, max_steps;
    mpt__profile_step *steps;    /* (max_steps)                         */
    int n_marks, max_marks;
    unsigned char *piece;        /* (max_marks) what ends at each marker */
    int *layer;                  /* (max_marks) whose piece, or −1      */
    double *seconds;             /* (max_marks) each marker's time       */
    void *timer;                 /* the backend's, or NULL: host clock  */
    double timer_zero;           /* the host's clock at marker 0        */
    mpt_step_state *records;     /* backend memory: (2·max_steps + 1) the
                                    record before and after each step, then
                                    the layer-by-layer update's copy    */
    mpt_step_state *host_records; /* (2·max_steps) read back             */
    char run_dir[MPT__CB_PATH_MAX];  /* where the files went            */
    char *table;                 /* the per-layer table, once written    */
};

/* Seconds on a clock that never steps back (CLOCK_MONOTONIC where the
   headers declare it, as under _POSIX_C_SOURCE; else the time of day). */
static double mpt__profile_clock(void) {
#if defined(CLOCK_MONOTONIC)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
    return mpt__now();
}

/* ---- opening: the range checked against the run, the buffers taken -------- */

static void mpt__profile_free(mpt__profile *P) {
    mpt_model *m;
    if (!P) return;
    m = P->m;
    if (P->timer) m->be->timer_free(m->impl, P->timer);
    if (P->records) m->be->free(m->impl, MPT__MEM_WORKSPACE, P->records);
    mpt__free(m->ctx, P->host_records);
    mpt__free(m->ctx, P->steps);
    mpt__free(m->ctx, P->piece);
    mpt__free(m->ctx, P->layer);
    mpt__free(m->ctx, P->seconds);
    mpt__free(m->ctx, P->dir);
    mpt__svg_free(m->ctx, P->table);
    mpt__free(m->ctx, P);
}

/* Refuses a range that is not 1 <= first <= last, one past the run (epochs
   · steps per epoch), a missing directory or a strategy. */
static mpt_status mpt__profile_check(mpt_model *m, const mpt_fit_desc *d, int64_t run_steps) {
    int64_t first = d->profile_batch[0], last = d->profile_batch[1];
    if (first < 1 || last < first)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: profile_batch {%lld, %lld} is not a range of steps 1 <= first "
                         "<= last ({0, 0}: no profiling)", (long long)first, (long long)last);
    if (last > run_steps)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: profile_batch {%lld, %lld} reaches past the run's %lld steps "
                         "(steps count from 1 over all the fit's epochs)",
                         (long long)first, (long long)last, (long long)run_steps);
    if (!d->profile_dir || !d->profile_dir[0])
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: profile_batch is set but profile_dir is %s",
                         d->profile_dir ? "empty" : "NULL");
    if (strlen(d->profile_dir) > MPT__CB_PATH_MAX - 512)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: profile_dir has %zu characters, more than %d",
                         strlen(d->profile_dir), MPT__CB_PATH_MAX - 512);
    if (m->strategy)
        return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                         "fit: profile_batch is not supported under a strategy (profile a "
                         "single replica)");
    return MPT_OK;
}

/* The markers one step needs at most: its first, then a forward and a
   backward and an update per layer, the loss, the check, the scale. */
static int mpt__profile_marks_per_step(const mpt_model *m) { return 3 * m->n_layers + 4; }

/* A profiler for fit's run of run_steps steps, or *out NULL when the
   descriptor asks for none. */
static mpt_status mpt__profile_open(mpt_model *m, const mpt_fit_desc *d, int64_t run_steps,
                                    mpt__profile **out) {
    mpt__profile *P;
    int64_t steps;
    int err;
    *out = NULL;
    if (d->profile_batch[0] == 0 && d->profile_batch[1] == 0) return MPT_OK;
    MPT__CHECK(mpt__profile_check(m, d, run_steps));
    err = mpt__tb_mkdirs(d->profile_dir);
    if (!err && access(d->profile_dir, W_OK | X_OK) != 0) err = errno;
    if (err && d->profile_fail_on_error)
        return mpt__fail(m->ctx, MPT_ERR_IO, "fit: profile_dir \"%s\" cannot be created or "
                         "written to: %s", d->profile_dir, strerror(err));
    if (err) {
        mpt__log(m->ctx, MPT_LOG_WARNING, "fit: profile_dir \"%s\" cannot be created or written "
                 "to: %s; training goes on without profiling", d->profile_dir, strerror(err));
        return MPT_OK;
    }
    steps = d->profile_batch[1] - d->profile_batch[0] + 1;
    if (steps > INT_MAX / (3 * m->n_layers + 4))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: profile_batch {%lld, %lld}: %lld steps are too many to profile",
                         (long long)d->profile_batch[0], (long long)d->profile_batch[1],
                         (long long)steps);
    P = (mpt__profile *)mpt__calloc(m->ctx, sizeof *P);
    if (!P) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory for the profiler");
    P->m = m;
    P->first = d->profile_batch[0];
    P->last = d->profile_batch[1];
    P->fail_on_error = d->profile_fail_on_error != 0;
    P->max_steps = (int)steps;
    P->max_marks = P->max_steps * mpt__profile_marks_per_step(m);
    P->dir = mpt__cb_strdup(m->ctx, d->profile_dir);
    P->steps = (mpt__profile_step *)mpt__calloc(m->ctx, sizeof *P->steps * (size_t)steps);
    P->piece = (unsigned char *)mpt__calloc(m->ctx, (size_t)P->max_marks);
    P->layer = (int *)mpt__calloc(m->ctx, sizeof(int) * (size_t)P->max_marks);
    P->seconds = (double *)mpt__calloc(m->ctx, sizeof(double) * (size_t)P->max_marks);
    P->host_records = (mpt_step_state *)mpt__calloc(m->ctx, sizeof(mpt_step_state) * 2 *
                                                                (size_t)steps);
    if (!P->dir || !P->steps || !P->piece || !P->layer || !P->seconds || !P->host_records) {
        mpt__profile_free(P);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory for the profiler");
    }
    if (m->be->alloc(m->impl, MPT__MEM_WORKSPACE, sizeof(mpt_step_state) * (2 * (size_t)steps + 1),
                     (void **)&P->records) != MPT_OK ||
        (m->be->timer_create &&
         m->be->timer_create(m->impl, P->max_marks, &P->timer) != MPT_OK)) {
        mpt_status s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: the profiler's buffers: %s",
                                 m->be->error(m->impl));
        mpt__profile_free(P);
        return s;
    }
    mpt__memory_peak_note(m, (int64_t)(sizeof(mpt_step_state) * (2 * (size_t)steps + 1)));
    *out = P;
    return MPT_OK;
}

/* ---- a profiled step --------------------------------------------------------- */

/* Marker number n_marks, ending `piece` of `layer` (−1: none). */
static void mpt__profile_mark(mpt__profile *P, int piece, int layer) {
    int i = P->n_marks++;
    P->piece[i] = (unsigned char)piece;
    P->layer[i] = layer;
    if (P->timer) {
        if (i == 0) P->timer_zero = mpt__profile_clock();
        P->m->be->timer_mark(P->m->impl, P->timer, i);
    } else {
        P->seconds[i] = mpt__profile_clock();
    }
}

/* The fused update, one layer's parameters at a time (see the section's
   comment): each call reads a fresh copy of the step's record. */
static void mpt__profile_update_by_layer(mpt__profile *P, mpt_model *m) {
    const mpt_update_args *all = &m->update;
    mpt_step_state *copy = P->records + 2 * P->max_steps;
    mpt_update_args u = *all;
    int k = 0, i = 0;
    u.state = copy;
    while (k < all->n) { /* the trainable parameters in m->params' order: layer by layer */
        int layer, n = 0;
        while (!m->params[i].trainable) i++;
        layer = m->params[i].layer;
        for (; i < m->n_params && m->params[i].layer == layer; i++) n += m->params[i].trainable;
        m->be->copy(m->impl, copy, m->state, sizeof *copy);
        u.n = n;
        u.value = all->value + k;
        u.grad = all->grad + k;
        u.slot0 = all->slot0 ? all->slot0 + k : NULL;
        u.slot1 = all->slot1 ? all->slot1 + k : NULL;
        u.compute = all->compute ? all->compute + k : NULL;
        u.compute_dtype = all->compute_dtype ? all->compute_dtype + k : NULL;
        u.count = all->count + k;
        m->be->update(m->impl, &u);
        mpt__profile_mark(P, MPT__PROF_UPDATE, layer);
        k += n;
    }
    if (all->n > 0) m->be->copy(m->impl, m->state, copy, sizeof *copy);
}

/* mpt__queue_step with a marker after each piece. */
static void mpt__profile_queue_step(mpt__profile *P, mpt_model *m, const mpt_tensor *x,
                                    const mpt_tensor *y, mpt__step_times *times) {
    mpt__forward_walk fw;
    mpt__backward_walk bw;
    mpt_loss_args loss;
    double t0 = mpt__now(), t1, t2;
    int i;
    mpt__profile_mark(P, MPT__PROF_BEGIN, -1);
    mpt__forward_begin(m, x, 1, &fw);
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = mpt__forward_prepare(m, i, &fw);
        L->ops->forward(L, &fw.p);
        mpt__forward_finish(L, &fw);
        mpt__profile_mark(P, MPT__PROF_FORWARD, i);
    }
    loss = mpt__loss_args(m, y, 1);
    m->be->loss(m->impl, &loss);
    mpt__profile_mark(P, MPT__PROF_LOSS, -1);
    t1 = mpt__now();
    mpt__backward_begin(m, 0, &bw); /* mpt_model_backward(m, NULL, NULL)'s walk */
    for (i = m->n_layers - 1; i >= bw.first; i--) {
        mpt__layer *L = mpt__backward_prepare(m, i, &bw);
        L->ops->backward(L, &bw.p);
        mpt__backward_finish(m, i, &bw);
        mpt__profile_mark(P, MPT__PROF_BACKWARD, i);
    }
    t2 = mpt__now();
    m->be->grad_stats(m->impl, &m->update);
    mpt__profile_mark(P, MPT__PROF_GRAD_CHECK, -1);
    mpt__profile_update_by_layer(P, m);
    m->be->loss_scale_update(m->impl, &m->compile.loss_scale, m->state);
    mpt__model_commit(m);
    mpt__profile_mark(P, MPT__PROF_LOSS_SCALE, -1);
    times->forward += t1 - t0;
    times->backward += t2 - t1;
    times->update += mpt__now() - t2;
}

/* Ends the last profiled step's host work at `when`. */
static void mpt__profile_close_host(mpt__profile *P, double when) {
    if (!P->open) return;
    P->steps[P->n_steps - 1].end = when;
    P->open = 0;
}

/* A step in the range: fetched, copied in, queued piece by piece. */
static int mpt__profile_run_step(mpt__fit_run *r, double begin, mpt_tensor *x, mpt_tensor *y,
                                 mpt__step_times *times, mpt_status *s) {
    mpt__profile *P = r->profile;
    mpt_model *m = r->m;
    mpt__profile_step *rec;
    mpt_tensor in, target;
    if (!mpt__fit_next(r, x, y)) return 0;
    rec = &P->steps[P->n_steps];
    memset(rec, 0, sizeof *rec);
    rec->step = ++P->step;
    rec->epoch = m->epoch;
    rec->begin = begin;
    if (r->feed.on) { /* as mpt__fit_feed_step, never replayed */
        mpt_tensor nx, ny;
        int b = 1 - r->feed.next; /* the buffer the step's batch is in */
        in = r->feed.slot[0].x[b];
        target = r->feed.slot[0].y[b];
        mpt__feed_wait(m, &r->feed);
        r->feed.have = 0;
        if (mpt__fit_take(r, &nx, &ny))
            *s = mpt__feed_upload(m, &r->feed, &nx, &ny, r->rows, r->global_rows);
    } else {
        *s = mpt__input_on_backend(m, x, &in);
        if (*s == MPT_OK) *s = mpt__target_on_backend(m, y, &target);
    }
    if (*s != MPT_OK) {
        P->step--; /* not taken: it is run again (out-of-memory recovery) or fit ends */
        return 1;
    }
    rec->data_end = mpt__profile_clock();
    rec->rows = in.shape[0];
    rec->first_mark = P->n_marks;
    m->be->copy(m->impl, &P->records[2 * P->n_steps], m->state, sizeof(mpt_step_state));
    mpt__profile_queue_step(P, m, &in, &target, times);
    m->be->copy(m->impl, &P->records[2 * P->n_steps + 1], m->state, sizeof(mpt_step_state));
    rec->n_marks = P->n_marks - rec->first_mark;
    rec->queued = mpt__profile_clock();
    P->n_steps++;
    P->open = 1;
    r->done += rec->rows;
    return 1;
}

/* The range is over: the profiler leaves fit's loop, its trace to be
   written at the epoch's end (mpt__profile_write_pending). */
static void mpt__profile_leave_loop(mpt__fit_run *r) {
    r->profiled = r->profile;
    r->profile = NULL;
}

/* fit's next step while a profiler is open (the one branch it adds to the
   loop): in the range, timed; else as any step. Returns 0 at the epoch's
   end. */
static int mpt__profile_fit_step(mpt__fit_run *r, mpt_tensor *x, mpt_tensor *y,
                                 mpt__step_times *times, mpt_status *s) {
    mpt__profile *P = r->profile;
    double begin = mpt__profile_clock();
    int more;
    mpt__profile_close_host(P, begin);
    if (P->step >= P->last) mpt__profile_leave_loop(r);
    else if (P->step + 1 >= P->first) return mpt__profile_run_step(r, begin, x, y, times, s);
    more = mpt__fit_next_step(r, x, y, times, s);
    P->step += more && *s == MPT_OK;
    return more;
}

/* When an epoch's steps are over: the open host work ends now. */
static void mpt__profile_loop_end(mpt__fit_run *r) {
    mpt__profile_close_host(r->profile, mpt__profile_clock());
    if (r->profile->step >= r->profile->last) mpt__profile_leave_loop(r);
}

/* ---- the trace ---------------------------------------------------------------- */

/* Multiply-adds per sample of a layer's product (Dense's and Conv2D's:
   the kernel's entries times the output positions), 0 for the others. */
static double mpt__profile_macs(const mpt_model *m, int i) {
    const mpt__layer *L = &m->layers[i];
    double channels;
    if ((L->ops != &mpt__dense_ops && L->ops != &mpt__conv2d_ops) || L->n_params < 1) return 0;
    channels = (double)L->out_shape[L->out_rank - 1];
    return channels > 0 ? (double)L->param[0]->count * (double)L->out_count / channels : 0;
}

/* Floating-point operations of a piece on `rows` samples: 2 per
   multiply-add; backward is the kernel's gradient and, above the first
   trainable layer, the input's. */
static double mpt__profile_flops(const mpt_model *m, int piece, int i, int64_t rows) {
    double macs = mpt__profile_macs(m, i) * (double)rows;
    if (piece == MPT__PROF_FORWARD) return 2 * macs;
    if (piece == MPT__PROF_BACKWARD)
        return (i > mpt__first_trainable_layer(m) ? 4 : 2) * macs;
    return 0;
}

/* Microseconds since `zero`, with nanoseconds: an event's start and end
   are written from whole nanoseconds so that a child's end never rounds
   past its parent's. */
static int64_t mpt__profile_ns(double t, double zero) { return (int64_t)floor((t - zero) * 1e9 + 0.5); }

/* src as the inside of a JSON string (quotes, backslashes and control
   characters escaped), cut to fit dst. */
static const char *mpt__profile_json_text(char *dst, size_t size, const char *src) {
    size_t n = 0;
    for (; *src && n + 7 < size; src++) {
        unsigned char c = (unsigned char)*src;
        if (c == '"' || c == '\\') dst[n++] = '\\', dst[n++] = (char)c;
        else if (c < 0x20) n += (size_t)snprintf(dst + n, size - n, "\\u%04x", c);
        else dst[n++] = (char)c;
    }
    dst[n] = 0;
    return dst;
}

/* One complete event ("ph": "X"): name, lane, start and end in ns. */
static void mpt__profile_event(mpt__svg *b, const char *name, int tid, int64_t begin_ns,
                               int64_t end_ns, const char *args) {
    int64_t dur = MPT__MAX(end_ns - begin_ns, (int64_t)0);
    char text[256];
    begin_ns = MPT__MAX(begin_ns, (int64_t)0);
    mpt__svg_printf(b, ",\n{\"name\": \"%s\", \"ph\": \"X\", \"pid\": 1, \"tid\": %d, "
                       "\"ts\": %lld.%03lld, \"dur\": %lld.%03lld, \"args\": {%s}}",
                    mpt__profile_json_text(text, sizeof text, name), tid,
                    (long long)(begin_ns / 1000), (long long)(begin_ns % 1000),
                    (long long)(dur / 1000), (long long)(dur % 1000), args);
}

/* JSON for a double: a number, or null for inf and NaN. */
static void mpt__profile_number(char *buf, size_t size, double v) {
    if (isfinite(v)) snprintf(buf, size, "%.9g", v);
    else snprintf(buf, size, "null");
}

/* One step's events: the host's (tid 1) and the compute's (tid 2). */
static void mpt__profile_step_events(mpt__svg *b, const mpt__profile *P, int k, double zero) {
    const mpt_model *m = P->m;
    const mpt__profile_step *rec = &P->steps[k];
    const mpt_step_state *before = &P->host_records[2 * k], *after = &P->host_records[2 * k + 1];
    double samples = after->samples - before->samples;
    double loss = samples > 0 ? (after->loss_sum - before->loss_sum) / samples : NAN;
    char args[768], name[160], l[40], e[40], layer[160], cls[64];
    int j;
    mpt__profile_number(l, sizeof l, loss);
    snprintf(args, sizeof args, "\"step\": %lld, \"epoch\": %d, \"batch\": %lld, \"loss\": %s, "
             "\"loss_scale\": %.9g, \"applied\": %s", (long long)rec->step, rec->epoch + 1,
             (long long)rec->rows, l, (double)before->loss_scale, after->finite ? "true" : "false");
    snprintf(name, sizeof name, "step %lld", (long long)rec->step);
    mpt__profile_event(b, name, 1, mpt__profile_ns(rec->begin, zero),
                       mpt__profile_ns(rec->end, zero), args);
    snprintf(args, sizeof args, "\"step\": %lld", (long long)rec->step);
    mpt__profile_event(b, "data wait", 1, mpt__profile_ns(rec->begin, zero),
                       mpt__profile_ns(rec->data_end, zero), args);
    mpt__profile_event(b, m->be->timer_mark && P->timer ? "queue step" : "run step", 1,
                       mpt__profile_ns(rec->data_end, zero), mpt__profile_ns(rec->queued, zero),
                       args);
    mpt__profile_event(b, "host work", 1, mpt__profile_ns(rec->queued, zero),
                       mpt__profile_ns(rec->end, zero), args);
    snprintf(name, sizeof name, "step %lld", (long long)rec->step);
    mpt__profile_event(b, name, 2, mpt__profile_ns(P->seconds[rec->first_mark], zero),
                       mpt__profile_ns(P->seconds[rec->first_mark + rec->n_marks - 1], zero),
                       args);
    for (j = rec->first_mark + 1; j < rec->first_mark + rec->n_marks; j++) {
        int piece = P->piece[j], i = P->layer[j];
        double seconds = P->seconds[j] - P->seconds[j - 1];
        double flops = i >= 0 ? mpt__profile_flops(m, piece, i, rec->rows) : 0;
        if (i >= 0) {
            mpt__profile_number(e, sizeof e, seconds > 0 && flops > 0 ? flops / seconds * 1e-9 : 0);
            snprintf(name, sizeof name, "%s %s", m->layers[i].name, mpt__profile_piece[piece]);
            snprintf(args, sizeof args, "\"step\": %lld, \"layer\": \"%s\", \"class\": \"%s\", "
                     "\"phase\": \"%s\", \"flops\": %.0f, \"gflops_per_second\": %s",
                     (long long)rec->step,
                     mpt__profile_json_text(layer, sizeof layer, m->layers[i].name),
                     mpt__profile_json_text(cls, sizeof cls, m->layers[i].ops->class_name),
                     mpt__profile_piece[piece], flops, e);
        } else {
            snprintf(name, sizeof name, "%s", mpt__profile_piece[piece]);
            snprintf(args, sizeof args, "\"step\": %lld, \"phase\": \"%s\"", (long long)rec->step,
                     mpt__profile_piece[piece]);
        }
        mpt__profile_event(b, name, 2, mpt__profile_ns(P->seconds[j - 1], zero),
                           mpt__profile_ns(P->seconds[j], zero), args);
    }
}

/* The whole trace: names for the process and its two lanes, then the steps. */
static void mpt__profile_trace(mpt__svg *b, const mpt__profile *P) {
    double zero = P->n_steps ? P->steps[0].begin : 0;
    int k;
    mpt__svg_printf(b, "[\n");
    mpt__svg_printf(b, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 1, "
                       "\"args\": {\"name\": \"mpt fit (%s)\"}},\n", P->m->be->name);
    mpt__svg_printf(b, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 1, "
                       "\"args\": {\"name\": \"host\"}},\n");
    mpt__svg_printf(b, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 2, "
                       "\"args\": {\"name\": \"%s\"}}", P->timer ? "device queue" : "compute");
    for (k = 0; k < P->n_steps; k++) mpt__profile_step_events(b, P, k, zero);
    mpt__svg_printf(b, "\n]\n");
}

/* ---- the per-layer table ---------------------------------------------------------- */

/* The mean per profiled step of each layer's pieces, and of the rest. */
static void mpt__profile_table(mpt__svg *b, const mpt__profile *P) {
    const mpt_model *m = P->m;
    double steps = P->n_steps > 0 ? (double)P->n_steps : 1, step = 0, data = 0, host = 0;
    double other[MPT__PROF_LOSS_SCALE + 1];
    int i, j, k;
    memset(other, 0, sizeof other);
    for (k = 0; k < P->n_steps; k++) {
        const mpt__profile_step *rec = &P->steps[k];
        step += P->seconds[rec->first_mark + rec->n_marks - 1] - P->seconds[rec->first_mark];
        data += rec->data_end - rec->begin;
        host += rec->end - rec->queued;
        for (j = rec->first_mark + 1; j < rec->first_mark + rec->n_marks; j++)
            if (P->layer[j] < 0) other[P->piece[j]] += P->seconds[j] - P->seconds[j - 1];
    }
    mpt__svg_printf(b, "%-32s %11s %11s %11s %11s %9s %9s\n", "Layer (type)", "Forward ms",
                    "Backward ms", "Update ms", "Total ms", "% of step", "GFLOP/s");
    for (i = 0; i < m->n_layers; i++) {
        double t[MPT__PROF_LOSS_SCALE + 1], flops = 0, total;
        char name[128], rate[32];
        memset(t, 0, sizeof t);
        for (k = 0; k < P->n_steps; k++) {
            const mpt__profile_step *rec = &P->steps[k];
            for (j = rec->first_mark + 1; j < rec->first_mark + rec->n_marks; j++) {
                if (P->layer[j] != i) continue;
                t[P->piece[j]] += P->seconds[j] - P->seconds[j - 1];
                flops += mpt__profile_flops(m, P->piece[j], i, rec->rows);
            }
        }
        total = t[MPT__PROF_FORWARD] + t[MPT__PROF_BACKWARD] + t[MPT__PROF_UPDATE];
        snprintf(name, sizeof name, "%s (%s)", m->layers[i].name, m->layers[i].ops->class_name);
        if (flops > 0 && t[MPT__PROF_FORWARD] + t[MPT__PROF_BACKWARD] > 0)
            snprintf(rate, sizeof rate, "%.2f",
                     flops / (t[MPT__PROF_FORWARD] + t[MPT__PROF_BACKWARD]) * 1e-9);
        else
            snprintf(rate, sizeof rate, "-");
        mpt__svg_printf(b, "%-32.32s %11.4f %11.4f %11.4f %11.4f %8.1f%% %9s\n", name,
                        1e3 * t[MPT__PROF_FORWARD] / steps, 1e3 * t[MPT__PROF_BACKWARD] / steps,
                        1e3 * t[MPT__PROF_UPDATE] / steps, 1e3 * total / steps,
                        step > 0 ? 100 * total / step : 0.0, rate);
    }
    for (j = MPT__PROF_LOSS; j <= MPT__PROF_LOSS_SCALE; j++) {
        if (j == MPT__PROF_BACKWARD || j == MPT__PROF_UPDATE) continue;
        mpt__svg_printf(b, "%-32s %47.4f %8.1f%%\n", mpt__profile_piece[j],
                        1e3 * other[j] / steps, step > 0 ? 100 * other[j] / step : 0.0);
    }
    mpt__svg_printf(b, "%-32s %47.4f %8.1f%%\n", "step (compute)", 1e3 * step / steps, 100.0);
    mpt__svg_printf(b, "%-32s %47.4f\n", "data wait (host)", 1e3 * data / steps);
    mpt__svg_printf(b, "%-32s %47.4f\n", "host work after the step", 1e3 * host / steps);
}

/* ---- the files -------------------------------------------------------------------- */

/* dir/plugins/profile/<date and time>[_k], made new (TensorBoard's layout). */
static int mpt__profile_make_run_dir(mpt__profile *P) {
    char base[MPT__CB_PATH_MAX], stamp[64];
    int n = snprintf(base, sizeof base, "%s/plugins/profile", P->dir);
    time_t now = time(NULL);
    struct tm *tm = localtime(&now);
    int err, k;
    if (n < 0 || (size_t)n >= sizeof base) return ENAMETOOLONG;
    if ((err = mpt__tb_mkdirs(base)) != 0) {
        snprintf(P->run_dir, sizeof P->run_dir, "%s", base);
        return err;
    }
    if (!tm || !strftime(stamp, sizeof stamp, "%Y_%m_%d_%H_%M_%S", tm)) snprintf(stamp, sizeof stamp, "run");
    for (k = 0; k < 1000; k++) {
        n = k == 0 ? snprintf(P->run_dir, sizeof P->run_dir, "%s/%s", base, stamp)
                       : snprintf(P->run_dir, sizeof P->run_dir, "%s/%s_%d", base, stamp, k);
        if (n < 0 || (size_t)n >= sizeof P->run_dir) return ENAMETOOLONG;
        if (mkdir(P->run_dir, 0777) == 0) return 0;
        if (errno != EEXIST) return errno;
    }
    return EEXIST;
}

/* text written whole to path (through path.tmp, renamed), gzip'd when
   gz. 0 or an errno. */
static int mpt__profile_write(const char *path, const char *text, size_t len, int gz) {
    char tmp[MPT__CB_PATH_MAX + 128];
    int err = 0, n = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (n < 0 || (size_t)n >= sizeof tmp) return ENAMETOOLONG;
#ifndef MPT_NO_ZLIB
    if (gz) {
        gzFile f = gzopen(tmp, "wb");
        if (!f) return errno ? errno : ENOMEM;
        if (len > 0 && gzwrite(f, text, (unsigned)len) != (int)len) err = EIO;
        if (gzclose(f) != Z_OK && !err) err = EIO;
    } else
#endif
    {
        FILE *f = fopen(tmp, "wb");
        (void)gz;
        if (!f) return errno;
        if (fwrite(text, 1, len, f) != len) err = errno ? errno : EIO;
        if (fclose(f) != 0 && !err) err = errno ? errno : EIO;
    }
    if (!err && rename(tmp, path) != 0) err = errno;
    if (err) remove(tmp);
    return err;
}

/* A failure of the profiler's files: a warning, or with
   profile_fail_on_error, fit's MPT_ERR_IO. */
static mpt_status mpt__profile_io_failed(mpt__profile *P, const char *what, const char *path,
                                         int err) {
    if (P->fail_on_error)
        return mpt__fail(P->m->ctx, MPT_ERR_IO, "fit: profiler: cannot %s \"%s\": %s", what,
                         path, strerror(err));
    mpt__log(P->m->ctx, MPT_LOG_WARNING, "fit: profiler: cannot %s \"%s\": %s; training goes on "
             "without the trace", what, path, strerror(err));
    return MPT_OK;
}

/* dir/host + suffix into path; nonzero when it does not fit. */
static int mpt__profile_path(char *path, size_t size, const char *dir, const char *host,
                             const char *suffix) {
    int n = snprintf(path, size, "%s/%s%s", dir, host, suffix);
    return n < 0 || (size_t)n >= size;
}

/* The trace (plain, and gzip'd with zlib) and the table, into a new run
   directory named by the host. */
static mpt_status mpt__profile_write_files(mpt__profile *P, const mpt__svg *trace,
                                           const mpt__svg *table) {
    char path[MPT__CB_PATH_MAX + 64];
    const char *host = "localhost";
    struct utsname names;
    int err = mpt__profile_make_run_dir(P);
    if (err) return mpt__profile_io_failed(P, "create the directory", P->run_dir, err);
    if (uname(&names) == 0 && names.nodename[0]) host = names.nodename;
    if (mpt__profile_path(path, sizeof path, P->run_dir, host, ".trace.json") ||
        (err = mpt__profile_write(path, trace->text, trace->len, 0)) != 0)
        return mpt__profile_io_failed(P, "write", path, err ? err : ENAMETOOLONG);
#ifndef MPT_NO_ZLIB
    if (mpt__profile_path(path, sizeof path, P->run_dir, host, ".trace.json.gz") ||
        (err = mpt__profile_write(path, trace->text, trace->len, 1)) != 0)
        return mpt__profile_io_failed(P, "write", path, err ? err : ENAMETOOLONG);
#endif
    if (mpt__profile_path(path, sizeof path, P->run_dir, host, ".layers.txt") ||
        (err = mpt__profile_write(path, table->text, table->len, 0)) != 0)
        return mpt__profile_io_failed(P, "write", path, err ? err : ENAMETOOLONG);
    return MPT_OK;
}

/* ---- finishing ---------------------------------------------------------------------- */

/* Reads the markers and records back (the one wait), writes the files
   and keeps the table for fit's end. */
static mpt_status mpt__profile_finish(mpt__profile *P) {
    mpt_model *m = P->m;
    mpt__svg trace, table;
    mpt_status s = MPT_OK;
    int i;
    P->written = 1;
    if (P->timer && P->n_marks > 0) {
        s = m->be->timer_read(m->impl, P->timer, P->n_marks, P->seconds);
        for (i = 0; s == MPT_OK && i < P->n_marks; i++) P->seconds[i] += P->timer_zero;
        if (s != MPT_OK)
            return mpt__fail(m->ctx, s, "fit: profiler: reading the markers: %s",
                             m->be->error(m->impl));
    }
    if (P->n_steps > 0)
        MPT__CHECK(mpt__download(m, P->host_records, P->records,
                                 sizeof(mpt_step_state) * 2 * (size_t)P->n_steps));
    memset(&trace, 0, sizeof trace);
    memset(&table, 0, sizeof table);
    trace.ctx = table.ctx = m->ctx;
    mpt__profile_trace(&trace, P);
    mpt__profile_table(&table, P);
    if (trace.oom || table.oom)
        s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: profiler: out of memory for the trace");
    else
        s = mpt__profile_write_files(P, &trace, &table);
    mpt__svg_free(m->ctx, trace.text);
    if (s == MPT_OK && !table.oom) {
        P->table = table.text;
    } else {
        mpt__svg_free(m->ctx, table.text);
    }
    return s;
}

/* After an epoch's steps are timed (its seconds taken): the trace of a
   range that ended in it. */
static mpt_status mpt__profile_write_pending(mpt__fit_run *r) {
    return r->profiled && !r->profiled->written ? mpt__profile_finish(r->profiled) : MPT_OK;
}

/* At fit's end: a range the run stopped short of is written as far as it
   got (with a warning); the table printed with verbose >= 1. */
static mpt_status mpt__profile_close(mpt__fit_run *r, int verbose) {
    mpt__profile *P = r->profile ? r->profile : r->profiled;
    mpt_status s = MPT_OK;
    if (!P) return MPT_OK;
    if (r->profile) {
        mpt__profile_close_host(P, mpt__profile_clock());
        mpt__log(r->m->ctx, MPT_LOG_WARNING, "fit: profiler: training ended after step %lld, "
                 "before profile_batch's last step %lld; the trace holds %d step%s",
                 (long long)P->step, (long long)P->last, P->n_steps, P->n_steps == 1 ? "" : "s");
        mpt__profile_leave_loop(r);
    }
    s = mpt__profile_write_pending(r);
    if (s == MPT_OK && verbose && P->table && P->n_steps > 0) {
        const char *line = P->table;
        mpt__print(r->m, "Profile: steps %lld-%lld, trace in %s\n", (long long)P->steps[0].step,
                   (long long)P->steps[P->n_steps - 1].step, P->run_dir);
        while (*line) { /* a line at a time: mpt__print's buffer is short */
            const char *end = strchr(line, '\n');
            int n = end ? (int)(end - line) : (int)strlen(line);
            mpt__print(r->m, "%.*s\n", n, line);
            line += n + (end != NULL);
        }
    }
    return s;
}

/* =============================================================================
   @impl-safetensors  the file format: dtypes, byte order, the JSON header
   written and read
   =============================================================================

   The format (safetensors, as the Hugging Face library writes and reads it):
       u64 N, little-endian | N bytes of JSON, space-padded to a multiple of 8 | data
   The JSON maps each tensor's name to {"dtype", "shape", "data_offsets":
   [begin, end]}, byte offsets into the data, which the tensors tile from 0
   without gaps; "__metadata__" is a map of strings. Tensors are
   little-endian and row-major. */


#define MPT__ST_MAX_HEADER 100000000     /* bytes: the safetensors library's limit */
#define MPT__ST_MAX_RANK 8               /* dimensions a tensor in a file may have  */

/* ---- dtypes a safetensors file may name ----------------------------------- */

typedef enum mpt__st_dtype {
    MPT__ST_BOOL, MPT__ST_U8, MPT__ST_I8, MPT__ST_F8_E5M2, MPT__ST_F8_E4M3,
    MPT__ST_I16, MPT__ST_U16, MPT__ST_F16, MPT__ST_BF16,
    MPT__ST_I32, MPT__ST_U32, MPT__ST_F32,
    MPT__ST_F64, MPT__ST_I64, MPT__ST_U64,
    MPT__ST_DTYPE_COUNT_
} mpt__st_dtype;

static const struct {
    const char *name;
    int size; /* bytes per element */
} mpt__st_dtypes[MPT__ST_DTYPE_COUNT_] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},
    {"I32", 4},  {"U32", 4}, {"F32", 4},
    {"F64", 8},  {"I64", 8}, {"U64", 8}};

/* The dtype named `name`, or -1. */
static int mpt__st_dtype_find(const char *name) {
    int i;
    for (i = 0; i < MPT__ST_DTYPE_COUNT_; i++)
        if (strcmp(mpt__st_dtypes[i].name, name) == 0) return i;
    return -1;
}

/* ---- small shared pieces ----------------------------------------------------- */

static int mpt__ckpt_little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* Reverses the bytes of each `elem`-byte element: host order <-> little-endian
   on a big-endian host. */
static void mpt__ckpt_swap(void *data, int64_t bytes, int elem) {
    unsigned char *p = (unsigned char *)data, t;
    int64_t i;
    int k;
    for (i = 0; i + elem <= bytes; i += elem)
        for (k = 0; k < elem / 2; k++) {
            t = p[i + k];
            p[i + k] = p[i + elem - 1 - k];
            p[i + elem - 1 - k] = t;
        }
}

/* Length (1..4) of the well-formed UTF-8 sequence at p, or 0 when it is not
   one (a stray continuation byte, an overlong form, a surrogate, a code
   point past U+10FFFF, or a sequence cut by the end at p + avail). */
static int mpt__st_utf8_len(const unsigned char *p, int64_t avail) {
    unsigned char lo = 0x80, hi = 0xbf;
    int len, i;
    if (p[0] < 0x80) return 1;
    if (p[0] >= 0xc2 && p[0] <= 0xdf) {
        len = 2;
    } else if (p[0] >= 0xe0 && p[0] <= 0xef) {
        len = 3;
        if (p[0] == 0xe0) lo = 0xa0; /* overlong below U+0800 */
        if (p[0] == 0xed) hi = 0x9f; /* surrogates U+D800..DFFF */
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        len = 4;
        if (p[0] == 0xf0) lo = 0x90; /* overlong below U+10000 */
        if (p[0] == 0xf4) hi = 0x8f; /* past U+10FFFF */
    } else {
        return 0;
    }
    if (avail < len) return 0;
    for (i = 1; i < len; i++, lo = 0x80, hi = 0xbf)
        if (p[i] < lo || p[i] > hi) return 0;
    return len;
}

/* Room for one more item in a growing array of `size`-byte items: returns
   the array to use from now on (items itself while there is room), or NULL
   when memory runs out (items is then still valid and still the caller's). */
static void *mpt__ckpt_grow(const mpt_context *ctx, void *items, int n, int *cap, size_t size) {
    void *grown;
    int want;
    if (n < *cap) return items;
    if (*cap > INT_MAX / 2) return NULL;
    want = *cap ? 2 * *cap : 16;
    grown = mpt__alloc(ctx, size * (size_t)want);
    if (!grown) return NULL;
    if (items) memcpy(grown, items, size * (size_t)n);
    mpt__free(ctx, items);
    *cap = want;
    return grown;
}

/* ---- writing the JSON header: a growing string -------------------------------- */

/* A growing string (for the JSON header). Out of memory is remembered and
   reported once, at the end. */
typedef struct mpt__ckpt_text {
    const mpt_context *ctx;
    char *s;       /* (cap) NUL-terminated */
    size_t len, cap;
    int oom;
} mpt__ckpt_text;

static void mpt__ckpt_put(mpt__ckpt_text *t, const char *s, size_t n) {
    if (t->oom) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 1024;
        char *grown;
        while (cap < t->len + n + 1) cap *= 2;
        grown = (char *)mpt__alloc(t->ctx, cap);
        if (!grown) {
            t->oom = 1;
            return;
        }
        if (t->s) memcpy(grown, t->s, t->len);
        mpt__free(t->ctx, t->s);
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = 0;
}

static void mpt__ckpt_puts(mpt__ckpt_text *t, const char *s) { mpt__ckpt_put(t, s, strlen(s)); }

/* s as a JSON string: quotes, backslashes and control characters escaped;
   other bytes as they are (the caller has checked they are UTF-8). */
static void mpt__ckpt_put_json(mpt__ckpt_text *t, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    char esc[8];
    mpt__ckpt_puts(t, "\"");
    for (; *p; p++) {
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            mpt__ckpt_put(t, esc, 2);
        } else if (*p == '\n') {
            mpt__ckpt_puts(t, "\\n");
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)*p);
            mpt__ckpt_puts(t, esc);
        } else {
            mpt__ckpt_put(t, (const char *)p, 1);
        }
    }
    mpt__ckpt_puts(t, "\"");
}

static void mpt__ckpt_put_pair(mpt__ckpt_text *t, const char *key, const char *value, int first) {
    if (!first) mpt__ckpt_puts(t, ",");
    mpt__ckpt_put_json(t, key);
    mpt__ckpt_puts(t, ":");
    mpt__ckpt_put_json(t, value);
}

/* ---- reading a file: the header ------------------------------------------------ */

typedef struct mpt__st_tensor {
    const char *name;                 /* decoded, in the header buffer        */
    int64_t at;                       /* file offset of its name (messages)   */
    mpt__st_dtype dtype;
    int rank;
    int64_t shape[MPT__ST_MAX_RANK];
    int64_t begin, end;               /* data_offsets: bytes [begin, end) of the data */
    int used;                         /* claimed by one of the model's entries */
} mpt__st_tensor;

typedef struct mpt__st_meta {
    const char *key, *value;
    int64_t at;
} mpt__st_meta;

typedef struct mpt__st_file {
    mpt_context *ctx;
    const char *path;
    int fd;                  /* -1 when closed                              */
    int64_t size;            /* of the file                                 */
    int64_t n;               /* of the header                               */
    char *json;              /* (n + 1) the header; strings decoded in place */
    int64_t pos;             /* the reader's position in json               */
    mpt__st_tensor *t;       /* [n_t], sorted by name once read             */
    int n_t, cap_t;
    mpt__st_meta *meta;      /* [n_meta]                                    */
    int n_meta, cap_meta, has_meta;
} mpt__st_file;

/* A malformed header: names the file and the byte (counted from the file's
   start) where reading stopped. */
static mpt_status mpt__st_bad(mpt__st_file *f, int64_t pos, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': malformed header at byte %lld: %s",
                     f->path, (long long)(8 + pos), why);
}

static int mpt__st_peek(const mpt__st_file *f) {
    return f->pos < f->n ? (unsigned char)f->json[f->pos] : -1;
}

/* What is at the reader's position, for messages: "'x'", "byte 0x07", "the end". */
static const char *mpt__st_found(const mpt__st_file *f, char *buf, size_t size) {
    int c = mpt__st_peek(f);
    if (c < 0)
        snprintf(buf, size, "the end of the header");
    else if (c > 0x20 && c < 0x7f)
        snprintf(buf, size, "'%c'", c);
    else
        snprintf(buf, size, "byte 0x%02x", (unsigned)c);
    return buf;
}

static void mpt__st_ws(mpt__st_file *f) {
    int c;
    while ((c = mpt__st_peek(f)) == ' ' || c == '\t' || c == '\n' || c == '\r') f->pos++;
}

static mpt_status mpt__st_expect(mpt__st_file *f, char c, const char *where) {
    char found[32];
    mpt__st_ws(f);
    if (mpt__st_peek(f) != (unsigned char)c)
        return mpt__st_bad(f, f->pos, "expected '%c' %s, found %s", c, where,
                           mpt__st_found(f, found, sizeof found));
    f->pos++;
    return MPT_OK;
}

static int mpt__st_hex4(const char *p, uint32_t *out) {
    int i;
    *out = 0;
    for (i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return 0;
        *out = *out << 4 | (uint32_t)d;
    }
    return 1;
}

static int mpt__st_put_utf8(char *w, uint32_t cp) {
    if (cp < 0x80) {
        w[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        w[0] = (char)(0xc0 | cp >> 6);
        w[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        w[0] = (char)(0xe0 | cp >> 12);
        w[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        w[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    w[0] = (char)(0xf0 | cp >> 18);
    w[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    w[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    w[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decodes the \u escape at json[r] (the backslash) into *cp; *len gets the
   bytes it took (6, or 12 for a surrogate pair). */
static mpt_status mpt__st_unicode_escape(mpt__st_file *f, int64_t r, uint32_t *cp, int *len) {
    const char *j = f->json;
    uint32_t lo;
    if (r + 6 > f->n || !mpt__st_hex4(j + r + 2, cp))
        return mpt__st_bad(f, r, "\\u must be followed by 4 hex digits");
    *len = 6;
    if (*cp >= 0xdc00 && *cp <= 0xdfff)
        return mpt__st_bad(f, r, "\\u%04x is a low surrogate without a high one", (unsigned)*cp);
    if (*cp >= 0xd800 && *cp <= 0xdbff) {
        if (r + 12 > f->n || j[r + 6] != '\\' || j[r + 7] != 'u' || !mpt__st_hex4(j + r + 8, &lo) ||
            lo < 0xdc00 || lo > 0xdfff)
            return mpt__st_bad(f, r, "\\u%04x is a high surrogate without a low one after it",
                               (unsigned)*cp);
        *cp = 0x10000 + ((*cp - 0xd800) << 10) + (lo - 0xdc00);
        *len = 12;
    }
    if (*cp == 0) return mpt__st_bad(f, r, "\\u0000 in a string is not supported");
    return MPT_OK;
}

/* Decodes the escape at json[*r] (the backslash) to json[*w...]. Decoding
   never lengthens a string, so it happens in place: *w stays behind *r. */
static mpt_status mpt__st_escape(mpt__st_file *f, int64_t *r, int64_t *w) {
    char *j = f->json;
    int c = *r + 1 < f->n ? (unsigned char)j[*r + 1] : -1;
    char plain;
    uint32_t cp = 0;
    int len = 0;
    switch (c) {
    case '"': case '\\': case '/': plain = (char)c; break;
    case 'b': plain = '\b'; break;
    case 'f': plain = '\f'; break;
    case 'n': plain = '\n'; break;
    case 'r': plain = '\r'; break;
    case 't': plain = '\t'; break;
    case 'u':
        MPT__CHECK(mpt__st_unicode_escape(f, *r, &cp, &len));
        *w += mpt__st_put_utf8(j + *w, cp);
        *r += len;
        return MPT_OK;
    case -1: return mpt__st_bad(f, *r, "unterminated escape at the end of the header");
    default:
        return mpt__st_bad(f, *r, "invalid escape '\\%c'", c > 0x20 && c < 0x7f ? c : '?');
    }
    j[(*w)++] = plain;
    *r += 2;
    return MPT_OK;
}

/* A JSON string at the reader's position, decoded in place: *out points at
   it, NUL-terminated, inside json. */
static mpt_status mpt__st_string(mpt__st_file *f, const char **out) {
    char *j = f->json, found[32];
    int64_t start, r, w;
    mpt__st_ws(f);
    if (mpt__st_peek(f) != '"')
        return mpt__st_bad(f, f->pos, "expected a string, found %s",
                           mpt__st_found(f, found, sizeof found));
    start = w = f->pos;
    r = start + 1;
    for (;;) {
        unsigned char c;
        int len;
        if (r >= f->n) return mpt__st_bad(f, start, "unterminated string");
        c = (unsigned char)j[r];
        if (c == '"') break;
        if (c == '\\') {
            MPT__CHECK(mpt__st_escape(f, &r, &w));
        } else if (c < 0x20) {
            return mpt__st_bad(f, r, "control character 0x%02x in a string (it must be escaped)",
                               (unsigned)c);
        } else {
            len = mpt__st_utf8_len((const unsigned char *)j + r, f->n - r);
            if (!len)
                return mpt__st_bad(f, r, "invalid UTF-8 byte 0x%02x in a string", (unsigned)c);
            memmove(j + w, j + r, (size_t)len);
            w += len;
            r += len;
        }
    }
    j[w] = 0;
    f->pos = r + 1;
    *out = j + start;
    return MPT_OK;
}

/* A non-negative JSON integer (shape dimensions and offsets are nothing else). */
static mpt_status mpt__st_uint(mpt__st_file *f, int64_t *out, const char *what) {
    char found[32];
    int64_t v = 0, start;
    int c;
    mpt__st_ws(f);
    start = f->pos;
    c = mpt__st_peek(f);
    if (c == '-') return mpt__st_bad(f, start, "%s must not be negative", what);
    if (c < '0' || c > '9')
        return mpt__st_bad(f, start, "expected an integer in %s, found %s", what,
                           mpt__st_found(f, found, sizeof found));
    if (c == '0' && f->pos + 1 < f->n && f->json[f->pos + 1] >= '0' && f->json[f->pos + 1] <= '9')
        return mpt__st_bad(f, start, "a number in %s has a leading zero", what);
    while ((c = mpt__st_peek(f)) >= '0' && c <= '9') {
        if (v > (INT64_MAX - (c - '0')) / 10)
            return mpt__st_bad(f, start, "a number in %s is too large", what);
        v = v * 10 + (c - '0');
        f->pos++;
    }
    if (c == '.' || c == 'e' || c == 'E')
        return mpt__st_bad(f, start, "a number in %s is not an integer", what);
    *out = v;
    return MPT_OK;
}

/* [n, n, ...] with at most max values into out; *count gets how many. */
static mpt_status mpt__st_uint_array(mpt__st_file *f, int64_t *out, int max, int *count,
                                     const char *what) {
    char found[32];
    int c;
    *count = 0;
    MPT__CHECK(mpt__st_expect(f, '[', what));
    mpt__st_ws(f);
    if (mpt__st_peek(f) == ']') {
        f->pos++;
        return MPT_OK;
    }
    for (;;) {
        if (*count == max) return mpt__st_bad(f, f->pos, "%s has more than %d values", what, max);
        MPT__CHECK(mpt__st_uint(f, &out[(*count)++], what));
        mpt__st_ws(f);
        c = mpt__st_peek(f);
        if (c != ',' && c != ']')
            return mpt__st_bad(f, f->pos, "expected ',' or ']' in %s, found %s", what,
                               mpt__st_found(f, found, sizeof found));
        f->pos++;
        if (c == ']') return MPT_OK;
    }
}

/* Steps to the next member of an object whose '{' has been read: *key is
   its name (NULL at the closing '}'), *at where the name starts; the ':'
   after it has been read. */
static mpt_status mpt__st_member(mpt__st_file *f, int first, const char **key, int64_t *at) {
    char found[32];
    int c;
    mpt__st_ws(f);
    c = mpt__st_peek(f);
    if (c == '}') {
        f->pos++;
        *key = NULL;
        return MPT_OK;
    }
    if (!first) {
        if (c != ',')
            return mpt__st_bad(f, f->pos, "expected ',' or '}' after a member, found %s",
                               mpt__st_found(f, found, sizeof found));
        f->pos++;
        mpt__st_ws(f);
    }
    *at = f->pos;
    MPT__CHECK(mpt__st_string(f, key));
    return mpt__st_expect(f, ':', "after a key");
}

/* The bytes [begin, end) must hold exactly the shape's elements. */
static mpt_status mpt__st_check_extent(mpt__st_file *f, const mpt__st_tensor *T) {
    char s[96];
    int64_t count = 1, bytes = 0;
    int d, ok = 1;
    for (d = 0; d < T->rank && ok; d++) ok = mpt__mul_ok(count, T->shape[d], &count);
    ok = ok && mpt__mul_ok(count, mpt__st_dtypes[T->dtype].size, &bytes);
    if (T->begin > T->end)
        return mpt__st_bad(f, T->at, "tensor \"%s\": data_offsets [%lld, %lld] end before they "
                           "begin", T->name, (long long)T->begin, (long long)T->end);
    if (!ok || bytes != T->end - T->begin)
        return mpt__st_bad(f, T->at, "tensor \"%s\": %s %s is %s bytes, but data_offsets "
                           "[%lld, %lld] hold %lld", T->name, mpt__st_dtypes[T->dtype].name,
                           mpt_shape_format(s, sizeof s, T->rank, T->shape),
                           ok ? "a different number of" : "too many", (long long)T->begin,
                           (long long)T->end, (long long)(T->end - T->begin));
    return MPT_OK;
}

/* One tensor's {"dtype": .., "shape": [..], "data_offsets": [b, e]}. */
static mpt_status mpt__st_tensor_entry(mpt__st_file *f, const char *name, int64_t at) {
    static const char *const keys[3] = {"dtype", "shape", "data_offsets"};
    mpt__st_tensor *T, *grown;
    const char *key, *dtype;
    int64_t key_at = at, offsets[2] = {0, 0};
    int seen = 0, first, k, n_offsets = 0;
    grown = (mpt__st_tensor *)mpt__ckpt_grow(f->ctx, f->t, f->n_t, &f->cap_t, sizeof *f->t);
    if (!grown) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    f->t = grown;
    T = &f->t[f->n_t];
    memset(T, 0, sizeof *T);
    T->name = name;
    T->at = at;
    MPT__CHECK(mpt__st_expect(f, '{', "to open a tensor's entry"));
    for (first = 1;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &key_at));
        if (!key) break;
        for (k = 0; k < 3 && strcmp(key, keys[k]) != 0; k++) continue;
        if (k == 3)
            return mpt__st_bad(f, key_at, "tensor \"%s\": unexpected key \"%s\" (a tensor has "
                               "dtype, shape and data_offsets)", name, key);
        if (seen & (1 << k))
            return mpt__st_bad(f, key_at, "tensor \"%s\": \"%s\" given twice", name, key);
        seen |= 1 << k;
        if (k == 0) {
            int found;
            MPT__CHECK(mpt__st_string(f, &dtype));
            found = mpt__st_dtype_find(dtype);
            if (found < 0)
                return mpt__st_bad(f, key_at, "tensor \"%s\": unknown dtype \"%s\"", name, dtype);
            T->dtype = (mpt__st_dtype)found;
        } else if (k == 1) {
            MPT__CHECK(mpt__st_uint_array(f, T->shape, MPT__ST_MAX_RANK, &T->rank, "shape"));
        } else {
            MPT__CHECK(mpt__st_uint_array(f, offsets, 2, &n_offsets, "data_offsets"));
            if (n_offsets != 2)
                return mpt__st_bad(f, key_at, "tensor \"%s\": data_offsets must hold 2 values",
                                   name);
        }
    }
    if (seen != 7)
        return mpt__st_bad(f, at, "tensor \"%s\" has no \"%s\"", name,
                           keys[!(seen & 1) ? 0 : !(seen & 2) ? 1 : 2]);
    T->begin = offsets[0];
    T->end = offsets[1];
    MPT__CHECK(mpt__st_check_extent(f, T));
    f->n_t++;
    return MPT_OK;
}

/* "__metadata__": {"key": "value", ...}, strings only. */
static mpt_status mpt__st_metadata(mpt__st_file *f, int64_t at) {
    mpt__st_meta *grown;
    const char *key, *value;
    int64_t key_at = at;
    int first = 1;
    if (f->has_meta) return mpt__st_bad(f, at, "\"__metadata__\" given twice");
    f->has_meta = 1;
    MPT__CHECK(mpt__st_expect(f, '{', "to open \"__metadata__\""));
    for (;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &key_at));
        if (!key) return MPT_OK;
        mpt__st_ws(f);
        if (mpt__st_peek(f) != '"')
            return mpt__st_bad(f, f->pos, "\"__metadata__\" value of \"%s\" is not a string", key);
        MPT__CHECK(mpt__st_string(f, &value));
        grown = (mpt__st_meta *)mpt__ckpt_grow(f->ctx, f->meta, f->n_meta, &f->cap_meta,
                                               sizeof *f->meta);
        if (!grown) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
        f->meta = grown;
        f->meta[f->n_meta].key = key;
        f->meta[f->n_meta].value = value;
        f->meta[f->n_meta].at = key_at;
        f->n_meta++;
    }
}

static mpt_status mpt__st_parse(mpt__st_file *f) {
    char found[32];
    const char *key;
    int64_t at = 0;
    int first;
    f->pos = 0;
    MPT__CHECK(mpt__st_expect(f, '{', "at the start of the header"));
    for (first = 1;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &at));
        if (!key) break;
        if (strcmp(key, "__metadata__") == 0)
            MPT__CHECK(mpt__st_metadata(f, at));
        else
            MPT__CHECK(mpt__st_tensor_entry(f, key, at));
    }
    mpt__st_ws(f);
    if (f->pos != f->n)
        return mpt__st_bad(f, f->pos, "%s after the header's closing '}'",
                           mpt__st_found(f, found, sizeof found));
    return MPT_OK;
}

/* ---- reading a file: the layout of the data ----------------------------------- */

static int mpt__st_by_name(const void *a, const void *b) {
    return strcmp(((const mpt__st_tensor *)a)->name, ((const mpt__st_tensor *)b)->name);
}

static int mpt__st_meta_by_key(const void *a, const void *b) {
    return strcmp(((const mpt__st_meta *)a)->key, ((const mpt__st_meta *)b)->key);
}

static int mpt__st_by_offset(const void *a, const void *b) {
    const mpt__st_tensor *x = *(const mpt__st_tensor *const *)a;
    const mpt__st_tensor *y = *(const mpt__st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Names unique (tensors and metadata keys), sorted by name for lookups. */
static mpt_status mpt__st_check_names(mpt__st_file *f) {
    int i;
    if (f->n_t > 1) qsort(f->t, (size_t)f->n_t, sizeof *f->t, mpt__st_by_name);
    for (i = 1; i < f->n_t; i++)
        if (strcmp(f->t[i - 1].name, f->t[i].name) == 0)
            return mpt__st_bad(f, MPT__MAX(f->t[i - 1].at, f->t[i].at),
                               "duplicate tensor name \"%s\" (also at byte %lld)", f->t[i].name,
                               (long long)(8 + MPT__MIN(f->t[i - 1].at, f->t[i].at)));
    if (f->n_meta > 1) qsort(f->meta, (size_t)f->n_meta, sizeof *f->meta, mpt__st_meta_by_key);
    for (i = 1; i < f->n_meta; i++)
        if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
            return mpt__st_bad(f, MPT__MAX(f->meta[i - 1].at, f->meta[i].at),
                               "duplicate \"__metadata__\" key \"%s\"", f->meta[i].key);
    return MPT_OK;
}

/* The tensors tile the data from 0 without gaps or overlaps, and the data
   ends where the file does (8 + N + end == file size). */
static mpt_status mpt__st_check_layout(mpt__st_file *f) {
    mpt__st_tensor **order; /* [n_t] the tensors by offset */
    int64_t data = f->size - 8 - f->n, expect = 0;
    mpt_status s = MPT_OK;
    int i;
    order = (mpt__st_tensor **)mpt__alloc(f->ctx, sizeof *order * (size_t)(f->n_t + 1));
    if (!order) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (i = 0; i < f->n_t; i++) order[i] = &f->t[i];
    if (f->n_t > 1) qsort(order, (size_t)f->n_t, sizeof *order, mpt__st_by_offset);
    for (i = 0; i < f->n_t && s == MPT_OK; i++) {
        if (order[i]->begin != expect)
            s = mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': tensor \"%s\" (header byte "
                          "%lld) has data_offsets [%lld, %lld], but the data must be contiguous "
                          "from 0: %s at %lld", f->path, order[i]->name,
                          (long long)(8 + order[i]->at), (long long)order[i]->begin,
                          (long long)order[i]->end,
                          order[i]->begin > expect ? "a gap" : "an overlap", (long long)expect);
        expect = order[i]->end;
    }
    mpt__free(f->ctx, order);
    if (s == MPT_OK && expect != data)
        s = mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': the tensors end at byte %lld of "
                      "the data, so the file should have 8 + %lld + %lld = %llu bytes, but its "
                      "size is %lld%s", f->path, (long long)expect, (long long)f->n,
                      (long long)expect, /* unsigned: expect may be near INT64_MAX */
                      8ull + (unsigned long long)f->n + (unsigned long long)expect,
                      (long long)f->size, expect > data ? " (truncated?)" : "");
    return s;
}

/* ---- reading a file: opening, reading, closing ----------------------------------- */

/* Reads bytes [offset, offset + bytes) of the file into dst. */
static mpt_status mpt__st_read_at(mpt__st_file *f, int64_t offset, void *dst, int64_t bytes) {
    unsigned char *p = (unsigned char *)dst;
    if (lseek(f->fd, (off_t)offset, SEEK_SET) < 0)
        return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: cannot seek in '%s': %s", f->path,
                         strerror(errno));
    while (bytes > 0) {
        ssize_t got = read(f->fd, p, (size_t)MPT__MIN(bytes, (int64_t)1 << 30));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0)
            return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: cannot read '%s': %s", f->path,
                             strerror(errno));
        if (got == 0)
            return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: '%s' ended %lld bytes early: it "
                             "changed while being read", f->path, (long long)bytes);
        p += got;
        bytes -= got;
    }
    return MPT_OK;
}

static void mpt__st_close(mpt__st_file *f) {
    if (f->fd >= 0) close(f->fd);
    mpt__free(f->ctx, f->json);
    mpt__free(f->ctx, f->t);
    mpt__free(f->ctx, f->meta);
    f->fd = -1;
    f->json = NULL;
    f->t = NULL;
    f->meta = NULL;
}

/* The length, the header, and their checks. */
static mpt_status mpt__st_read_header(mpt__st_file *f) {
    unsigned char n8[8];
    uint64_t n = 0;
    int i;
    if (f->size < 8)
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': %lld bytes is too short for a "
                         "safetensors file (it starts with an 8-byte header length)", f->path,
                         (long long)f->size);
    MPT__CHECK(mpt__st_read_at(f, 0, n8, 8));
    for (i = 0; i < 8; i++) n |= (uint64_t)n8[i] << (8 * i);
    if (n > MPT__ST_MAX_HEADER)
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': header length %llu is over "
                         "the limit of %d bytes", f->path, (unsigned long long)n,
                         MPT__ST_MAX_HEADER);
    if (n > (uint64_t)(f->size - 8))
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': header length %llu runs past "
                         "the end of the file (%lld bytes)", f->path, (unsigned long long)n,
                         (long long)f->size);
    f->n = (int64_t)n;
    f->json = (char *)mpt__alloc(f->ctx, (size_t)n + 1);
    if (!f->json)
        return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: cannot allocate %llu bytes "
                         "for the header of '%s'", (unsigned long long)n + 1, f->path);
    MPT__CHECK(mpt__st_read_at(f, 8, f->json, f->n));
    f->json[f->n] = 0;
    return MPT_OK;
}

/* Opens a safetensors file and checks everything about it that does not
   depend on the model. On failure the caller still closes f. */
static mpt_status mpt__st_open(mpt__st_file *f, mpt_context *ctx, const char *path) {
    memset(f, 0, sizeof *f);
    f->ctx = ctx;
    f->path = path;
    MPT__CHECK(mpt__open_regular(ctx, "checkpoint: ", path, &f->fd, &f->size));
    MPT__CHECK(mpt__st_read_header(f));
    MPT__CHECK(mpt__st_parse(f));
    MPT__CHECK(mpt__st_check_names(f));
    return mpt__st_check_layout(f);
}

static mpt__st_tensor *mpt__st_find(const mpt__st_file *f, const char *name) {
    mpt__st_tensor key;
    if (f->n_t == 0) return NULL;
    key.name = name;
    return (mpt__st_tensor *)bsearch(&key, f->t, (size_t)f->n_t, sizeof *f->t, mpt__st_by_name);
}

static const char *mpt__st_meta_get(const mpt__st_file *f, const char *key) {
    int i;
    for (i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
    return NULL;
}

/* =============================================================================
   @impl-checkpoints  the model in a safetensors file: the weights and the full
   training state
   =============================================================================

   What mpt.h stores, in this order in the data:
       train/optimizer_steps, train/step, train/epoch,       I64, rank 0  } full
       train/good_steps, train/skipped_steps                              } checkpoints
       train/learning_rate, train/loss_scale                 F32, rank 0  } only
       <layer>/<param>                  F32   every parameter, trainable or not
       optimizer/<layer>/<param>/<slot> F32   full checkpoints: "momentum" (SGD),
                                              "m" and "v" (Adam, AdamW)
   The 8-byte scalars come first so that every tensor starts at a multiple of
   its element size (the data starts at 8 + N, a multiple of 8), as a reader
   that maps the file in place wants.

   Saving writes "<path>.tmp-<pid>" beside the target, fsyncs it, renames it
   over the target (atomic on POSIX) and fsyncs the directory, so a crash
   leaves the old file or the new one, never a mix of both. Any failure
   removes the temporary file and leaves the target as it was. A save that
   is killed cannot remove it: the next save to the same target does (a
   save holds a lock on its temporary file, so those nobody holds are
   leftovers).

   Loading reads the whole header with a strict JSON reader (a malformed byte
   is reported with its offset in the file), checks the layout of the data,
   then every name, dtype and shape against the model, a full checkpoint's
   policy and optimizer, and the training scalars' ranges; then it reads
   the tensors into a host copy of the model's arenas and checks their
   values (finite; Adam's second moments >= 0). Only when all of that has
   passed does the model take the copy, so a failed load, a read error
   included, leaves the model as it was; only a device that fails while
   taking the copy can leave it partly loaded, and the error says so. */


#define MPT__CKPT_CHUNK ((size_t)1 << 16) /* bytes staged per write               */
#define MPT__CKPT_NAME 192               /* "optimizer/" + parameter name + "/momentum" */

/* Tests define MPT__CHECKPOINT_FAIL_AFTER_BYTES (before including mpt.h) as
   an expression: while it is >= 0, saving fails with ENOSPC once that many
   bytes of the temporary file are written, as a full disk would. */

/* ---- the names a file gives optimizers, their slots and policies ------------------ */

static const char *mpt__ckpt_optimizer_name(mpt_optimizer_type type) {
    switch (type) {
    case MPT_OPTIMIZER_ADAM: return "adam";
    case MPT_OPTIMIZER_SGD: return "sgd";
    case MPT_OPTIMIZER_ADAMW: return "adamw";
    default: return "?";
    }
}

/* The name of optimizer slot k, as it appears in "optimizer/<param>/<slot>". */
static const char *mpt__ckpt_slot_name(mpt_optimizer_type type, int k) {
    static const char *const adam[2] = {"m", "v"};
    static const char *const other[2] = {"slot0", "slot1"};
    if (k < 0 || k > 1) return "slot";
    if (type == MPT_OPTIMIZER_SGD && k == 0) return "momentum";
    if (type == MPT_OPTIMIZER_ADAM || type == MPT_OPTIMIZER_ADAMW) return adam[k];
    return other[k];
}

/* ---- what the model stores: one entry per tensor ------------------------------ */

/* The training scalars, staged: saving copies them out of the model first,
   loading reads and checks them here before any reaches the model. */
typedef struct mpt__ckpt_train {
    int64_t optimizer_steps, step, epoch, good_steps, skipped_steps;
    float learning_rate, loss_scale;
} mpt__ckpt_train;

typedef struct mpt__ckpt_entry {
    char name[MPT__CKPT_NAME];
    mpt__st_dtype dtype;            /* F32 or I64                                */
    int rank;
    int64_t shape[MPT_MAX_RANK];
    void *data;                     /* (bytes): in the model, or in plan->train  */
    int64_t bytes;
    int64_t begin;                  /* offset in the file's data                 */
    int staged;                     /* data points into plan->train              */
    int non_negative;               /* loading: its F32 values must be >= 0 too
                                       (Adam's second moment, a moving variance) */
} mpt__ckpt_entry;

/* Every tensor of a weights file (full = 0) or a full checkpoint (full = 1),
   in file order. The entries point into `train`: never copy a plan. */
typedef struct mpt__ckpt_plan {
    mpt__ckpt_entry *e; /* [n] */
    int n;
    int64_t data_bytes; /* the file's data: the entries' bytes, back to back */
    mpt__ckpt_train train;
    unsigned char *mirror; /* the model's parameter and optimizer arenas
                              copied to the host, which the entries point
                              into: always when loading, and when saving a
                              model on a GPU; else NULL (a save on the CPU
                              reads the model in place)                    */
} mpt__ckpt_plan;

/* Where the file's bytes for a parameter buffer are: in place when the
   plan has no mirror, else at the same offset in the mirror. */
static void *mpt__ckpt_host(const mpt_model *m, const mpt__ckpt_plan *pl, int arena, void *p) {
    size_t at;
    if (!pl->mirror) return p;
    at = (size_t)((unsigned char *)p - (unsigned char *)m->arena[arena]);
    return pl->mirror + (arena == MPT__MEM_OPTIMIZER ? (size_t)m->arena_bytes[MPT__MEM_PARAMS] : 0) +
           at;
}

/* The mirror (both arenas, back to back), downloaded. A load always reads
   into one, even on the CPU, so that the file's values are checked before
   any reaches the model and a failed load leaves it as it was; a save
   needs one only to see a GPU's memory. */
static mpt_status mpt__ckpt_mirror(mpt_model *m, int loading, mpt__ckpt_plan *pl) {
    size_t params = (size_t)m->arena_bytes[MPT__MEM_PARAMS];
    size_t slots = (size_t)m->arena_bytes[MPT__MEM_OPTIMIZER];
    if (!loading && mpt__model_device(m) == MPT_DEVICE_CPU) return MPT_OK;
    pl->mirror = (unsigned char *)mpt__alloc(m->ctx, params + slots + 1);
    if (!pl->mirror) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    MPT__CHECK(mpt__download(m, pl->mirror, m->arena[MPT__MEM_PARAMS], params));
    return slots ? mpt__download(m, pl->mirror + params, m->arena[MPT__MEM_OPTIMIZER], slots)
                 : MPT_OK;
}

/* After a load into the mirror, once every value is checked: the arenas
   take its contents. */
static mpt_status mpt__ckpt_unmirror(mpt_model *m, const mpt__ckpt_plan *pl) {
    size_t params = (size_t)m->arena_bytes[MPT__MEM_PARAMS];
    size_t slots = (size_t)m->arena_bytes[MPT__MEM_OPTIMIZER];
    if (!pl->mirror) return MPT_OK;
    MPT__CHECK(mpt__upload(m, m->arena[MPT__MEM_PARAMS], pl->mirror, params));
    return slots ? mpt__upload(m, m->arena[MPT__MEM_OPTIMIZER], pl->mirror + params, slots)
                 : MPT_OK;
}

static mpt_status mpt__ckpt_add(mpt_model *m, mpt__ckpt_plan *pl, const char *prefix,
                                const char *name, const char *suffix, mpt__st_dtype dtype,
                                int rank, const int64_t *shape, void *data, int64_t count) {
    mpt__ckpt_entry *e = &pl->e[pl->n];
    int len = snprintf(e->name, sizeof e->name, "%s%s%s", prefix, name, suffix);
    if (len < 0 || (size_t)len >= sizeof e->name)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "checkpoint: tensor name \"%s%s%s\" is longer than %d bytes", prefix,
                         name, suffix, (int)sizeof e->name - 1);
    e->dtype = dtype;
    e->rank = rank;
    if (rank > 0) memcpy(e->shape, shape, sizeof(int64_t) * (size_t)rank);
    e->data = data;
    e->bytes = count * mpt__st_dtypes[dtype].size;
    e->begin = pl->data_bytes;
    pl->data_bytes += e->bytes;
    pl->n++;
    return MPT_OK;
}

static mpt_status mpt__ckpt_add_train(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt__ckpt_train *t = &pl->train;
    int first = pl->n, i;
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "optimizer_steps", "", MPT__ST_I64, 0, NULL,
                             &t->optimizer_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "step", "", MPT__ST_I64, 0, NULL, &t->step, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "epoch", "", MPT__ST_I64, 0, NULL, &t->epoch, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "good_steps", "", MPT__ST_I64, 0, NULL,
                             &t->good_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "skipped_steps", "", MPT__ST_I64, 0, NULL,
                             &t->skipped_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "learning_rate", "", MPT__ST_F32, 0, NULL,
                             &t->learning_rate, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "loss_scale", "", MPT__ST_F32, 0, NULL,
                             &t->loss_scale, 1));
    for (i = first; i < pl->n; i++) pl->e[i].staged = 1;
    return MPT_OK;
}

static mpt_status mpt__ckpt_add_slots(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt_optimizer_type type = m->compile.optimizer.type;
    char suffix[32];
    int i, k;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        for (k = 0; P->trainable && k < m->n_slots; k++) {
            if (!P->slot[k])
                return mpt__fail(m->ctx, MPT_ERR_STATE,
                                 "checkpoint: %s has no optimizer state (slot %d of %d)",
                                 P->name, k, m->n_slots);
            snprintf(suffix, sizeof suffix, "/%s", mpt__ckpt_slot_name(type, k));
            MPT__CHECK(mpt__ckpt_add(m, pl, "optimizer/", P->name, suffix, MPT__ST_F32, P->rank,
                                     P->shape, mpt__ckpt_host(m, pl, MPT__MEM_OPTIMIZER, P->slot[k]),
                                     P->count));
            /* Adam's v is a mean of squares: sqrt(v) of a negative one is NaN. */
            pl->e[pl->n - 1].non_negative = type != MPT_OPTIMIZER_SGD && k == 1;
        }
    }
    return MPT_OK;
}

/* Lists the tensors of the model's file (loading: pointing into a mirror);
   pl must be zeroed, and is freed by mpt__ckpt_plan_free whatever this
   returns. */
static mpt_status mpt__ckpt_plan_init(mpt_model *m, int full, int loading, mpt__ckpt_plan *pl) {
    int i, n = m->n_params;
    if (full) {
        if (m->n_slots < 0 || m->n_slots > 2)
            return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %d optimizer slots per "
                             "parameter (at most 2 are supported)", m->n_slots);
        for (i = 0; i < m->n_params; i++) n += m->params[i].trainable ? m->n_slots : 0;
        n += 7; /* the train/ scalars */
    }
    pl->e = (mpt__ckpt_entry *)mpt__calloc(m->ctx, sizeof *pl->e * (size_t)n);
    if (!pl->e) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    MPT__CHECK(mpt__ckpt_mirror(m, loading, pl));
    if (full) MPT__CHECK(mpt__ckpt_add_train(m, pl));
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        MPT__CHECK(mpt__ckpt_add(m, pl, "", P->name, "", MPT__ST_F32, P->rank, P->shape,
                                 mpt__ckpt_host(m, pl, MPT__MEM_PARAMS, P->value), P->count));
        pl->e[pl->n - 1].non_negative = P->non_negative;
    }
    return full ? mpt__ckpt_add_slots(m, pl) : MPT_OK;
}

static void mpt__ckpt_plan_free(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt__free(m->ctx, pl->e);
    mpt__free(m->ctx, pl->mirror);
    pl->e = NULL;
    pl->mirror = NULL;
}

/* ---- writing the header ------------------------------------------------------- */

/* The model in a few lines, one per layer: class, name, compute dtype and
   one sample's output shape ("Dense dense_1 float16 (10,)"). */
static void mpt__ckpt_put_model(mpt__ckpt_text *t, const mpt_model *m) {
    mpt__ckpt_text lines;
    char line[256], shape[96];
    int i;
    memset(&lines, 0, sizeof lines);
    lines.ctx = t->ctx;
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        snprintf(line, sizeof line, "%s%s %s %s %s", i ? "\n" : "", L->ops->class_name, L->name,
                 mpt_dtype_name(L->dtype), mpt_shape_format(shape, sizeof shape, L->out_rank,
                                                            L->out_shape));
        mpt__ckpt_puts(&lines, line);
    }
    mpt__ckpt_put_pair(t, "model", lines.s ? lines.s : "", 0);
    t->oom |= lines.oom;
    mpt__free(t->ctx, lines.s);
}

static void mpt__ckpt_put_metadata(mpt__ckpt_text *t, const mpt_model *m, int full) {
    char seed[32], shape[96];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)m->desc.seed);
    mpt_shape_format(shape, sizeof shape, m->desc.input_rank, m->desc.input_shape);
    mpt__ckpt_puts(t, "\"__metadata__\":{");
    mpt__ckpt_put_pair(t, "format", "mpt", 1);
    mpt__ckpt_put_pair(t, "mpt_version", MPT_VERSION, 0);
    mpt__ckpt_put_pair(t, "kind", full ? "checkpoint" : "weights", 0);
    if (full)
        mpt__ckpt_put_pair(t, "optimizer", mpt__ckpt_optimizer_name(m->compile.optimizer.type), 0);
    mpt__ckpt_put_pair(t, "policy", mpt_policy_name(m->desc.policy), 0);
    mpt__ckpt_put_pair(t, "seed", seed, 0);
    mpt__ckpt_put_pair(t, "input_shape", shape, 0);
    mpt__ckpt_put_model(t, m);
    mpt__ckpt_puts(t, "}");
}

static void mpt__ckpt_put_entry(mpt__ckpt_text *t, const mpt__ckpt_entry *e) {
    char num[64];
    int d;
    mpt__ckpt_puts(t, ",");
    mpt__ckpt_put_json(t, e->name);
    mpt__ckpt_puts(t, ":{\"dtype\":\"");
    mpt__ckpt_puts(t, mpt__st_dtypes[e->dtype].name);
    mpt__ckpt_puts(t, "\",\"shape\":[");
    for (d = 0; d < e->rank; d++) {
        snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        mpt__ckpt_puts(t, num);
    }
    snprintf(num, sizeof num, "],\"data_offsets\":[%lld,%lld]}", (long long)e->begin,
             (long long)(e->begin + e->bytes));
    mpt__ckpt_puts(t, num);
}

/* Layer names come from the caller; a reader rejects a header that is not
   UTF-8, so a name that is not is refused before anything is written. */
static mpt_status mpt__ckpt_check_names(mpt_model *m) {
    int i;
    for (i = 0; i < m->n_layers; i++) {
        const unsigned char *p = (const unsigned char *)m->layers[i].name;
        int64_t left = (int64_t)strlen(m->layers[i].name);
        while (left > 0) {
            int len = mpt__st_utf8_len(p, left);
            if (!len)
                return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                                 "checkpoint: layer %d's name is not valid UTF-8 (byte 0x%02x)",
                                 i, (unsigned)*p);
            p += len;
            left -= len;
        }
    }
    return MPT_OK;
}

/* The JSON header, space-padded to a multiple of 8 bytes. */
static mpt_status mpt__ckpt_header(mpt_model *m, const mpt__ckpt_plan *pl, int full,
                                   mpt__ckpt_text *t) {
    int i;
    MPT__CHECK(mpt__ckpt_check_names(m));
    mpt__ckpt_puts(t, "{");
    mpt__ckpt_put_metadata(t, m, full);
    for (i = 0; i < pl->n; i++) mpt__ckpt_put_entry(t, &pl->e[i]);
    mpt__ckpt_puts(t, "}");
    while (!t->oom && t->len % 8) mpt__ckpt_puts(t, " ");
    if (t->oom) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    return MPT_OK;
}

/* ---- writing the file -------------------------------------------------------- */

typedef struct mpt__ckpt_writer {
    mpt_context *ctx;
    const char *what;      /* what messages call it: "checkpoint", "export" */
    const char *path;      /* the target                              */
    char *tmp;             /* "<path>.tmp-<pid>"                      */
    int created;           /* tmp exists and is ours to remove        */
    int fd;                /* the temporary file; -1 when closed      */
    int64_t written;       /* bytes written to it                     */
    unsigned char *chunk;  /* (MPT__CKPT_CHUNK) little-endian staging  */
} mpt__ckpt_writer;

static mpt_status mpt__ckpt_write_fail(mpt__ckpt_writer *w, const char *what) {
    int err = errno;
    return mpt__fail(w->ctx, MPT_ERR_IO, "%s: cannot %s '%s' (for '%s'): %s",
                     w->what ? w->what : "checkpoint", what, w->tmp, w->path, strerror(err));
}

/* The directory part of path ("." when it has none), allocated; NULL when
   memory runs out. */
static char *mpt__ckpt_dir_of(const mpt_context *ctx, const char *path) {
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    char *dir = (char *)mpt__alloc(ctx, len + 2); /* (len + 2) */
    if (!dir) return NULL;
    if (!slash)
        strcpy(dir, ".");
    else if (len == 0)
        strcpy(dir, "/");
    else {
        memcpy(dir, path, len);
        dir[len] = 0;
    }
    return dir;
}

/* ---- temporary files that a killed save left behind ----------------------------

   A save holds a write lock (fcntl) on its temporary file from creating it
   to renaming it, and the kernel drops the lock when the process ends,
   however it ends. So a "<target>.tmp-<pid>[-<k>]" that nobody holds a
   lock on is what a save killed mid-write left, and the next save to the
   same target removes it (500 saves killed mid-write used to leave 178
   files, 375 MB). Names with this process's pid are never touched: fcntl
   locks belong to a process, so another thread's save in progress would
   look unlocked, and closing any descriptor of a file drops all of this
   process's locks on it. A file system without locks has no sweep. */

/* A write lock on the whole file, without waiting; errno says why not. */
static int mpt__ckpt_lock(int fd) {
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    return fcntl(fd, F_SETLK, &l) == 0;
}

/* Whether name is "<base>.tmp-<pid>" or "<base>.tmp-<pid>-<k>", k < 1000,
   of a pid other than this process's. */
static int mpt__ckpt_is_others_temp(const char *name, const char *base, size_t base_len) {
    const char *p;
    long long pid = 0;
    int digits = 0, k_digits = 0;
    if (strncmp(name, base, base_len) != 0 || strncmp(name + base_len, ".tmp-", 5) != 0) return 0;
    for (p = name + base_len + 5; *p >= '0' && *p <= '9' && digits < 18; p++, digits++)
        pid = pid * 10 + (*p - '0');
    if (digits == 0) return 0;
    if (*p == '-') {
        for (p++; *p >= '0' && *p <= '9' && k_digits < 3; p++) k_digits++;
        if (k_digits == 0) return 0;
    }
    return *p == 0 && pid != (long long)getpid();
}

/* Removes path when nobody holds a lock on it. The lock is taken, and held
   while unlinking, so that a save that has just created the file (and not
   yet locked it) finds the lock taken or its file gone, and takes another
   name; the identity check keeps a file renamed in between. */
static void mpt__ckpt_remove_if_stale(mpt_context *ctx, const char *path) {
    struct stat held, named;
    int fd = open(path, O_WRONLY | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return;
    if (fstat(fd, &held) == 0 && S_ISREG(held.st_mode) && mpt__ckpt_lock(fd) &&
        stat(path, &named) == 0 && named.st_dev == held.st_dev && named.st_ino == held.st_ino &&
        unlink(path) == 0)
        mpt__log(ctx, MPT_LOG_INFO, "checkpoint: removed '%s', left by a save that did not "
                 "finish", path);
    close(fd);
}

/* Removes the stale temporary files of target path. Best effort: a
   directory that cannot be listed is simply not swept. */
static void mpt__ckpt_sweep(mpt_context *ctx, const char *path) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t base_len = strlen(base), size = 0;
    char *dir = mpt__ckpt_dir_of(ctx, path), *temp = NULL;
    DIR *d;
    struct dirent *e;
    if (dir) {
        size = strlen(dir) + base_len + 40; /* "/" ".tmp-" pid "-" k: what is_others_temp allows */
        temp = (char *)mpt__alloc(ctx, size);
    }
    if (!temp) {
        mpt__log(ctx, MPT_LOG_WARNING, "checkpoint: cannot look for stale temporary files of "
                 "'%s': out of memory", path);
        mpt__free(ctx, dir);
        return;
    }
    d = opendir(dir);
    while (d && (e = readdir(d)) != NULL) {
        if (!mpt__ckpt_is_others_temp(e->d_name, base, base_len)) continue;
        snprintf(temp, size, "%s/%s", dir, e->d_name);
        mpt__ckpt_remove_if_stale(ctx, temp);
    }
    if (d) closedir(d);
    mpt__free(ctx, temp);
    mpt__free(ctx, dir);
}

/* The lock on a temporary file just created: whether the file is still
   this save's. A sweep holding it, or having removed the file already,
   means it is on its way out; a file system without locks leaves nothing
   to check. */
static int mpt__ckpt_hold(int fd) {
    struct stat st;
    if (!mpt__ckpt_lock(fd) && (errno == EAGAIN || errno == EACCES)) return 0;
    return fstat(fd, &st) == 0 && st.st_nlink > 0;
}

/* Creates the temporary file next to the target, after sweeping away what
   killed saves left there; O_EXCL so that nothing already there (another
   writer's file, a link) is ever written through. `what` names the file
   in messages ("checkpoint"). */
static mpt_status mpt__ckpt_writer_open(mpt__ckpt_writer *w, mpt_context *ctx, const char *what,
                                        const char *path) {
    size_t size = strlen(path) + 48;
    int k;
    memset(w, 0, sizeof *w);
    w->ctx = ctx;
    w->what = what;
    w->path = path;
    w->fd = -1;
    w->chunk = (unsigned char *)mpt__alloc(ctx, MPT__CKPT_CHUNK);
    w->tmp = (char *)mpt__alloc(ctx, size);
    if (!w->chunk || !w->tmp)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "%s '%s': out of memory", what, path);
    mpt__ckpt_sweep(ctx, path);
    for (k = 0; k < 100; k++) {
        if (k == 0)
            snprintf(w->tmp, size, "%s.tmp-%ld", path, (long)getpid());
        else
            snprintf(w->tmp, size, "%s.tmp-%ld-%d", path, (long)getpid(), k);
        w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (w->fd < 0 && errno == EEXIST) continue;
        if (w->fd < 0 || mpt__ckpt_hold(w->fd)) break;
        close(w->fd); /* a sweep is removing it: another name */
        w->fd = -1;
    }
    if (w->fd < 0) return mpt__ckpt_write_fail(w, "create");
    w->created = 1;
    return MPT_OK;
}

static mpt_status mpt__ckpt_write_raw(mpt__ckpt_writer *w, const void *src, size_t n) {
    const unsigned char *p = (const unsigned char *)src;
    while (n > 0) {
        size_t part = MPT__MIN(n, (size_t)1 << 30);
        ssize_t got;
#ifdef MPT__CHECKPOINT_FAIL_AFTER_BYTES
        {
            int64_t limit = (int64_t)(MPT__CHECKPOINT_FAIL_AFTER_BYTES);
            if (limit >= 0 && w->written + (int64_t)part > limit) {
                if (limit <= w->written) {
                    errno = ENOSPC;
                    return mpt__ckpt_write_fail(w, "write");
                }
                part = (size_t)(limit - w->written);
            }
        }
#endif
        got = write(w->fd, p, part);
        if (got < 0) {
            if (errno == EINTR) continue;
            return mpt__ckpt_write_fail(w, "write");
        }
        p += got;
        n -= (size_t)got;
        w->written += got;
    }
    return MPT_OK;
}

/* Writes `bytes` of `elem`-byte elements in little-endian order, a chunk at
   a time. */
static mpt_status mpt__ckpt_write_le(mpt__ckpt_writer *w, const void *src, int64_t bytes,
                                     int elem) {
    const unsigned char *p = (const unsigned char *)src;
    int swap = !mpt__ckpt_little_endian();
    while (bytes > 0) {
        size_t part = (size_t)MPT__MIN(bytes, (int64_t)MPT__CKPT_CHUNK);
        memcpy(w->chunk, p, part);
        if (swap) mpt__ckpt_swap(w->chunk, (int64_t)part, elem);
        MPT__CHECK(mpt__ckpt_write_raw(w, w->chunk, part));
        p += part;
        bytes -= (int64_t)part;
    }
    return MPT_OK;
}

/* Makes the rename durable. The new file is already in place, so a failure
   here is a warning, not an error. */
static void mpt__ckpt_sync_dir(mpt_context *ctx, const char *path) {
    char *dir = mpt__ckpt_dir_of(ctx, path);
    int fd;
    if (!dir) {
        mpt__log(ctx, MPT_LOG_WARNING, "checkpoint: saved '%s', but cannot sync its directory: "
                 "out of memory", path);
        return;
    }
    fd = open(dir, O_RDONLY);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL && errno != EBADF))
        mpt__log(ctx, MPT_LOG_WARNING, "checkpoint: saved '%s', but cannot sync its directory "
                 "'%s': %s", path, dir, strerror(errno));
    if (fd >= 0) close(fd);
    mpt__free(ctx, dir);
}

/* fsync, close, and rename the temporary file over the target. */
static mpt_status mpt__ckpt_writer_commit(mpt__ckpt_writer *w) {
    int failed;
    if (fsync(w->fd) != 0) return mpt__ckpt_write_fail(w, "sync");
    failed = close(w->fd) != 0;
    w->fd = -1;
    if (failed) return mpt__ckpt_write_fail(w, "close");
    if (rename(w->tmp, w->path) != 0) return mpt__ckpt_write_fail(w, "rename into place");
    w->created = 0; /* renamed: nothing left to remove */
    mpt__ckpt_sync_dir(w->ctx, w->path);
    return MPT_OK;
}

/* Closes and removes the temporary file unless it was committed. */
static void mpt__ckpt_writer_close(mpt__ckpt_writer *w) {
    if (w->fd >= 0) close(w->fd);
    if (w->created) remove(w->tmp);
    mpt__free(w->ctx, w->tmp);
    mpt__free(w->ctx, w->chunk);
    w->fd = -1;
    w->created = 0;
    w->tmp = NULL;
    w->chunk = NULL;
}

static mpt_status mpt__ckpt_write_file(mpt__ckpt_writer *w, const mpt__ckpt_plan *pl,
                                       const mpt__ckpt_text *header) {
    unsigned char n8[8];
    int i;
    for (i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)header->len >> (8 * i));
    MPT__CHECK(mpt__ckpt_write_raw(w, n8, 8));
    MPT__CHECK(mpt__ckpt_write_raw(w, header->s, header->len));
    for (i = 0; i < pl->n; i++)
        MPT__CHECK(mpt__ckpt_write_le(w, pl->e[i].data, pl->e[i].bytes,
                                      mpt__st_dtypes[pl->e[i].dtype].size));
    return mpt__ckpt_writer_commit(w);
}

static mpt_status mpt__ckpt_check_model(mpt_model *m, const char *path, int full,
                                        const char *what) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!path || !*path)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "checkpoint: %s needs a path", what);
    MPT__CHECK(mpt__refuse_quantized(m, what));
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %s('%s') needs a built model "
                         "(mpt_model_build, or fit)", what, path);
    if (full && !m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %s('%s') needs a compiled model "
                         "(mpt_model_compile): the optimizer state is part of it", what, path);
    return MPT_OK;
}

static mpt_status mpt__ckpt_save(mpt_model *m, const char *path, int full, const char *what) {
    mpt__ckpt_plan pl;
    mpt__ckpt_text header;
    mpt__ckpt_writer w;
    mpt_status s;
    MPT__CHECK(mpt__ckpt_check_model(m, path, full, what));
    if (!mpt__strategy_is_chief(m->strategy)) return MPT_OK; /* worker 0 writes the file */
    memset(&pl, 0, sizeof pl);
    memset(&header, 0, sizeof header);
    memset(&w, 0, sizeof w);
    w.fd = -1;
    w.ctx = m->ctx;
    header.ctx = m->ctx;
    pl.train.optimizer_steps = m->optimizer_steps;
    pl.train.step = (int64_t)m->step;
    pl.train.epoch = m->epoch;
    pl.train.good_steps = m->good_steps;
    pl.train.skipped_steps = m->skipped_steps;
    pl.train.learning_rate = m->learning_rate;
    pl.train.loss_scale = m->loss_scale;
    s = mpt__ckpt_plan_init(m, full, 0, &pl);
    if (s == MPT_OK) s = mpt__ckpt_header(m, &pl, full, &header);
    if (s == MPT_OK) s = mpt__ckpt_writer_open(&w, m->ctx, "checkpoint", path);
    if (s == MPT_OK) s = mpt__ckpt_write_file(&w, &pl, &header);
    mpt__ckpt_writer_close(&w);
    mpt__free(m->ctx, header.s);
    mpt__ckpt_plan_free(m, &pl);
    return s;
}

/* ---- loading into a model ---------------------------------------------------- */

/* "F32 (3, 2)" */
static const char *mpt__ckpt_describe(char *buf, size_t size, mpt__st_dtype dtype, int rank,
                                      const int64_t *shape) {
    char s[96];
    snprintf(buf, size, "%s %s", mpt__st_dtypes[dtype].name, mpt_shape_format(s, sizeof s, rank,
                                                                              shape));
    return buf;
}

/* Finds each of the model's entries in the file, with its dtype and shape. */
static mpt_status mpt__ckpt_match(mpt_model *m, mpt__st_file *f, const mpt__ckpt_plan *pl,
                                  mpt__st_tensor **found) {
    char want[128], got[128];
    int i, d, same;
    for (i = 0; i < pl->n; i++) {
        const mpt__ckpt_entry *e = &pl->e[i];
        mpt__st_tensor *T = mpt__st_find(f, e->name);
        mpt__ckpt_describe(want, sizeof want, e->dtype, e->rank, e->shape);
        if (!T)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has no tensor \"%s\" (the "
                             "model's is %s)", f->path, e->name, want);
        mpt__ckpt_describe(got, sizeof got, T->dtype, T->rank, T->shape);
        if (T->dtype != e->dtype)
            return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': tensor \"%s\" is %s in the "
                             "file, but the model's is %s", f->path, e->name, got, want);
        same = T->rank == e->rank;
        for (d = 0; same && d < e->rank; d++) same = T->shape[d] == e->shape[d];
        if (!same)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s': tensor \"%s\" is %s in the "
                             "file, but the model's is %s", f->path, e->name, got, want);
        T->used = 1;
        found[i] = T;
    }
    return MPT_OK;
}

/* Every tensor of the file must be the model's; load_weights passes over
   the optimizer state and training scalars of a full checkpoint. */
static mpt_status mpt__ckpt_check_unused(mpt_model *m, const mpt__st_file *f, int full) {
    char got[128];
    int i;
    for (i = 0; i < f->n_t; i++) {
        const mpt__st_tensor *T = &f->t[i];
        int extra_state = strncmp(T->name, "optimizer/", 10) == 0 ||
                          strncmp(T->name, "train/", 6) == 0;
        if (T->used || (!full && extra_state)) continue;
        mpt__ckpt_describe(got, sizeof got, T->dtype, T->rank, T->shape);
        if (full && strncmp(T->name, "optimizer/", 10) == 0)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has optimizer state \"%s\" "
                             "%s that the model's optimizer (%s, %d slot%s per parameter) "
                             "does not", f->path, T->name, got,
                             mpt__ckpt_optimizer_name(m->compile.optimizer.type), m->n_slots,
                             m->n_slots == 1 ? "" : "s");
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has a tensor \"%s\" %s that "
                         "the model does not have", f->path, T->name, got);
    }
    return MPT_OK;
}

/* A full checkpoint's metadata, where it has any, must be about this
   model's kind of training state. Its policy too: the loss scale and the
   moments were shaped by that policy's arithmetic (a float16 run's scale
   of 32768 means nothing to a bfloat16 one, which does not scale). Every
   file mpt.h writes names its policy; one without (another program's,
   or stripped) is taken as it is, its loss scale still bounded by this
   model's loss-scale mode (mpt__ckpt_check_loss_scale). */
static mpt_status mpt__ckpt_check_metadata(mpt_model *m, const mpt__st_file *f) {
    const char *kind = mpt__st_meta_get(f, "kind");
    const char *opt = mpt__st_meta_get(f, "optimizer");
    const char *policy = mpt__st_meta_get(f, "policy");
    const char *seed = mpt__st_meta_get(f, "seed");
    const char *mine = mpt__ckpt_optimizer_name(m->compile.optimizer.type);
    const char *my_policy = mpt_policy_name(m->desc.policy);
    char want[32];
    if (kind && strcmp(kind, "checkpoint") != 0)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' holds \"%s\", not a full "
                         "checkpoint: load it with mpt_model_load_weights", f->path, kind);
    if (opt && strcmp(opt, mine) != 0)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' holds %s state, but the model "
                         "is compiled with %s", f->path, opt, mine);
    if (policy && strcmp(policy, my_policy) != 0)
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "checkpoint '%s' holds the training state "
                         "(optimizer, loss scale) of a %s model, but this model's policy is %s; "
                         "mpt_model_load_weights loads its float32 weights into a model of any "
                         "policy", f->path, policy, my_policy);
    snprintf(want, sizeof want, "%llu", (unsigned long long)m->desc.seed);
    if (seed && strcmp(seed, want) != 0)
        mpt__log(m->ctx, MPT_LOG_WARNING, "checkpoint '%s' was saved by a model with seed %s; "
                 "this one's is %s, so the data order and dropout masks will differ from "
                 "the original run", f->path, seed, want);
    return MPT_OK;
}

/* The training scalars' values, before any of them reaches the model: each
   within what training can reach, so that nothing computed from them
   overflows.
   - Step counters (optimizer_steps, step, good_steps, skipped_steps): 0 to
     2^62. No run gets there (at a billion steps a second: 146 years), and
     from there another 2^62 steps fit in an int64_t, so the "+ 1" of each
     step that follows never overflows.
   - epoch: 0 to INT_MAX, fit's range (its epochs are ints).
   - learning_rate: finite and >= 0, as mpt_model_set_learning_rate.
   - loss_scale: what the model's loss-scale mode allows (below). */
#define MPT__CKPT_MAX_STEPS ((int64_t)1 << 62)

static mpt_status mpt__ckpt_check_counter(mpt_model *m, const char *path, const char *name,
                                          int64_t v, int64_t max) {
    if (v >= 0 && v <= max) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/%s is %lld, outside 0..%lld "
                     "(what training can reach)", path, name, (long long)v, (long long)max);
}

/* Dynamic scaling keeps the scale a normal float: it never grows to inf
   and never shrinks below FLT_MIN, where 1/scale would be inf. A fixed
   scale is the one compile was given, and a model that does not scale has
   1: a file with another one was saved by a model that scaled otherwise. */
static mpt_status mpt__ckpt_check_loss_scale(mpt_model *m, const char *path, float scale) {
    const mpt_loss_scale_desc *d = &m->compile.loss_scale;
    if (d->mode == MPT_LOSS_SCALE_DYNAMIC && !(scale >= FLT_MIN && scale <= FLT_MAX))
        return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/loss_scale is %g; a "
                         "dynamic loss scale is finite and at least %g", path, (double)scale,
                         (double)FLT_MIN);
    if (d->mode == MPT_LOSS_SCALE_FIXED && !(scale == d->initial_scale))
        return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/loss_scale is %g, but "
                         "the model's loss scale is fixed at %g", path, (double)scale,
                         (double)d->initial_scale);
    if (d->mode == MPT_LOSS_SCALE_NONE && !(scale == 1.0f))
        return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/loss_scale is %g, but "
                         "the model does not scale its loss (loss-scale mode none: 1)", path,
                         (double)scale);
    return MPT_OK;
}

static mpt_status mpt__ckpt_check_train(mpt_model *m, const char *path, const mpt__ckpt_train *t) {
    MPT__CHECK(mpt__ckpt_check_counter(m, path, "optimizer_steps", t->optimizer_steps,
                                       MPT__CKPT_MAX_STEPS));
    MPT__CHECK(mpt__ckpt_check_counter(m, path, "step", t->step, MPT__CKPT_MAX_STEPS));
    MPT__CHECK(mpt__ckpt_check_counter(m, path, "epoch", t->epoch, INT_MAX));
    MPT__CHECK(mpt__ckpt_check_counter(m, path, "good_steps", t->good_steps,
                                       MPT__CKPT_MAX_STEPS));
    MPT__CHECK(mpt__ckpt_check_counter(m, path, "skipped_steps", t->skipped_steps,
                                       MPT__CKPT_MAX_STEPS));
    if (!(t->learning_rate >= 0 && t->learning_rate <= FLT_MAX))
        return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/learning_rate is %g; it "
                         "must be finite and >= 0", path, (double)t->learning_rate);
    return mpt__ckpt_check_loss_scale(m, path, t->loss_scale);
}

/* Every float32 value read (weights, moving statistics, optimizer state)
   must be finite, and variances and Adam's second moments >= 0: one NaN
   would spread to every weight at the first step, silently. The test is
   on the bits, so no -ffast-math can fold it away. */
static mpt_status mpt__ckpt_check_values(mpt_model *m, const char *path,
                                         const mpt__ckpt_entry *e) {
    const unsigned char *p = (const unsigned char *)e->data;
    int64_t i, n = e->bytes / 4;
    for (i = 0; e->dtype == MPT__ST_F32 && i < n; i++) {
        uint32_t u;
        float v;
        memcpy(&u, p + 4 * i, 4);
        memcpy(&v, &u, 4);
        if ((u & 0x7f800000u) == 0x7f800000u)
            return mpt__fail(m->ctx, MPT_ERR_NUMERIC, "checkpoint '%s': tensor \"%s\" holds %s "
                             "at element %lld; weights and optimizer state must be finite (was "
                             "it saved from a run that diverged?)", path, e->name,
                             (u & 0x007fffffu) ? "NaN" : (u >> 31) ? "-inf" : "inf",
                             (long long)i);
        if (e->non_negative && v < 0)
            return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': tensor \"%s\" holds %g at "
                             "element %lld; a variance or a second moment (a mean of "
                             "squares) is never negative", path, e->name, (double)v,
                             (long long)i);
    }
    return MPT_OK;
}

/* Reads the entries with staged == want_staged into place. */
static mpt_status mpt__ckpt_read(mpt__st_file *f, const mpt__ckpt_plan *pl,
                                 mpt__st_tensor *const *found, int want_staged) {
    int i, swap = !mpt__ckpt_little_endian();
    for (i = 0; i < pl->n; i++) {
        const mpt__ckpt_entry *e = &pl->e[i];
        if (e->staged != want_staged) continue;
        MPT__CHECK(mpt__st_read_at(f, 8 + f->n + found[i]->begin, e->data, e->bytes));
        if (swap) mpt__ckpt_swap(e->data, e->bytes, mpt__st_dtypes[e->dtype].size);
    }
    return MPT_OK;
}

static void mpt__ckpt_apply_train(mpt_model *m, const mpt__ckpt_train *t) {
    m->optimizer_steps = t->optimizer_steps;
    m->step = (uint64_t)t->step;
    m->epoch = (int)t->epoch;
    m->good_steps = t->good_steps;
    m->skipped_steps = t->skipped_steps;
    m->learning_rate = t->learning_rate;
    m->loss_scale = t->loss_scale;
}

/* Everything checked, the small scalars read and checked; then the tensors
   into the mirror, checked; only then does the model take them. */
static mpt_status mpt__ckpt_load_checked(mpt_model *m, mpt__st_file *f, const mpt__ckpt_plan *pl,
                                         mpt__st_tensor **found, int full) {
    mpt_status s;
    int i;
    if (full) MPT__CHECK(mpt__ckpt_check_metadata(m, f));
    MPT__CHECK(mpt__ckpt_match(m, f, pl, found));
    MPT__CHECK(mpt__ckpt_check_unused(m, f, full));
    if (full) {
        MPT__CHECK(mpt__ckpt_read(f, pl, found, 1));
        MPT__CHECK(mpt__ckpt_check_train(m, f->path, &pl->train));
    }
    MPT__CHECK(mpt__ckpt_read(f, pl, found, 0));
    for (i = 0; i < pl->n; i++)
        if (!pl->e[i].staged) MPT__CHECK(mpt__ckpt_check_values(m, f->path, &pl->e[i]));
    s = mpt__ckpt_unmirror(m, pl);
    if (s != MPT_OK) {
        /* Only a device's failure to take the checked values gets here. */
        char why[sizeof m->ctx->error];
        snprintf(why, sizeof why, "%s", mpt_context_error(m->ctx));
        mpt_model_refresh_weights(m);
        return mpt__fail(m->ctx, s, "%s; the model's weights%s may be partly loaded", why,
                         full ? " and optimizer state" : "");
    }
    if (full) mpt__ckpt_apply_train(m, &pl->train);
    mpt_model_refresh_weights(m);
    return MPT_OK;
}

static mpt_status mpt__ckpt_load(mpt_model *m, const char *path, int full, const char *what) {
    mpt__st_file f;
    mpt__ckpt_plan pl;
    mpt__st_tensor **found = NULL; /* [pl.n] the file's tensor for each entry */
    mpt_status s;
    MPT__CHECK(mpt__ckpt_check_model(m, path, full, what));
    memset(&pl, 0, sizeof pl);
    s = mpt__st_open(&f, m->ctx, path);
    if (s == MPT_OK) s = mpt__ckpt_plan_init(m, full, 1, &pl);
    if (s == MPT_OK) {
        found = (mpt__st_tensor **)mpt__calloc(m->ctx, sizeof *found * (size_t)(pl.n + 1));
        if (!found) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    }
    if (s == MPT_OK) s = mpt__ckpt_load_checked(m, &f, &pl, found, full);
    mpt__free(m->ctx, found);
    mpt__ckpt_plan_free(m, &pl);
    mpt__st_close(&f);
    return s;
}

/* ---- the public functions -------------------------------------------------------- */

MPTDEF mpt_status mpt_model_save_weights(mpt_model *m, const char *path) {
    return mpt__ckpt_save(m, path, 0, "save_weights");
}

MPTDEF mpt_status mpt_model_load_weights(mpt_model *m, const char *path) {
    return mpt__ckpt_load(m, path, 0, "load_weights");
}

MPTDEF mpt_status mpt_model_save_checkpoint(mpt_model *m, const char *path) {
    return mpt__ckpt_save(m, path, 1, "save_checkpoint");
}

MPTDEF mpt_status mpt_model_load_checkpoint(mpt_model *m, const char *path) {
    return mpt__ckpt_load(m, path, 1, "load_checkpoint");
}

MPTDEF int mpt_model_epoch(const mpt_model *m) { return m ? m->epoch : 0; }

/* =============================================================================
   @impl-strategy  data parallelism: replicas in this process, workers over MPI
   =============================================================================

   A replicated model is replica 0; the others (m->replica[1..]) are
   ordinary models with the same layers, built and compiled with it, whose
   weights are copied from it once built. fit gives each replica its rows
   of the batch, sums the gradients (replica by replica, in order, then
   across workers), and has every replica apply the same update. */

/* The strategy: its replicas in this process, its place among the
   workers, and the devices and communicator of replicas on several GPUs.
   Code before this section reaches it through the public getters. */
struct mpt_strategy {
    mpt_context *ctx;
    mpt_strategy_type type;
    int local;              /* replicas in this process                   */
    int worker, workers;    /* this process's index, and how many         */
    double timeout;         /* seconds a collective may wait              */
    int64_t bucket_bytes;   /* gradient bytes per all-reduce              */
    int began_mpi;          /* MPI_Finalize at destroy                    */
    /* Replicas on several GPUs (or GPU workers): the backend of replica k,
       [0] the context's, and the communicator over them (NCCL). */
    int n_backends;
    const mpt_backend *backend[MPT__MAX_REPLICAS];
    void *impl[MPT__MAX_REPLICAS];
    void *comm;
};

static int mpt__strategy_total(const mpt_strategy *s) { return s->local * s->workers; }
static int mpt__strategy_is_chief(const mpt_strategy *s) { return !s || s->worker == 0; }

MPTDEF int mpt_strategy_num_replicas(const mpt_strategy *s) { return s ? mpt__strategy_total(s) : 0; }
MPTDEF int mpt_strategy_worker(const mpt_strategy *s) { return s ? s->worker : 0; }
MPTDEF int mpt_strategy_num_workers(const mpt_strategy *s) { return s ? s->workers : 0; }

/* Joins the processes mpirun started (MPI begun here unless the program
   began it). */
static mpt_status mpt__strategy_join_workers(mpt_strategy *s) {
#ifdef MPT_MPI
    int ready = 0, provided;
    MPI_Initialized(&ready);
    if (!ready) {
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return mpt__fail(s->ctx, MPT_ERR_STATE, "strategy: MPI_Init_thread failed");
        s->began_mpi = 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &s->worker);
    MPI_Comm_size(MPI_COMM_WORLD, &s->workers);
    return MPT_OK;
#else
    return mpt__fail(s->ctx, MPT_ERR_UNSUPPORTED,
                     "strategy: multi-worker needs a build with -DMPT_MPI (mpicc)");
#endif
}

#ifdef MPT_CUDA
/* Another CUDA device's backend, made as the context made its own. */
static mpt_status mpt__strategy_add_device(mpt_strategy *s, int device) {
    mpt_context_desc d = s->ctx->desc;
    char message[512] = "";
    mpt_status st;
    d.cuda_device = device;
    st = mpt_cuda_backend_create(&d, &s->backend[s->n_backends], &s->impl[s->n_backends], message,
                                 sizeof message);
    if (st != MPT_OK) return mpt__fail(s->ctx, st, "strategy: CUDA device %d: %s", device, message);
    s->n_backends++;
    return MPT_OK;
}

/* The devices of a mirrored strategy on a GPU context: the listed ones, or
   every visible one (devices are tried in order until one is not there). */
static mpt_status mpt__strategy_mirror_devices(mpt_strategy *s, const mpt_strategy_desc *desc) {
    int own = s->ctx->desc.cuda_device, k;
    if (desc->n_devices > 0) {
        if (desc->devices[0] != own)
            return mpt__fail(s->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "strategy: devices[0] is %d, not the context's device %d",
                             desc->devices[0], own);
        for (k = 1; k < desc->n_devices; k++) MPT__CHECK(mpt__strategy_add_device(s, desc->devices[k]));
        return MPT_OK;
    }
    for (k = 0; k < MPT__MAX_REPLICAS && s->n_backends < MPT__MAX_REPLICAS; k++) {
        mpt_context_desc d = s->ctx->desc;
        char message[512];
        if (k == own) continue;
        d.cuda_device = k;
        if (mpt_cuda_backend_create(&d, &s->backend[s->n_backends], &s->impl[s->n_backends],
                                    message, sizeof message) != MPT_OK)
            break; /* no device k */
        s->n_backends++;
    }
    return MPT_OK;
}
#endif

/* On a GPU context: a mirrored strategy puts one replica on each of its
   devices (unless num_replicas asks for logical replicas on the context's
   one), a multi-worker one joins the workers' devices; either way a
   communicator (NCCL) sums the gradients between devices. */
static mpt_status mpt__strategy_open_devices(mpt_strategy *s, const mpt_strategy_desc *desc) {
    const mpt_backend *be = mpt_context_backend(s->ctx, &s->impl[0]);
    s->backend[0] = be;
    s->n_backends = 1;
    if (be == mpt__cpu_backend()) {
        if (desc->n_devices > 0)
            return mpt__fail(s->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "strategy: a list of CUDA devices, but the context is on the CPU");
        return MPT_OK;
    }
#ifdef MPT_CUDA
    if (s->type == MPT_STRATEGY_MIRRORED && desc->num_replicas == 0) {
        MPT__CHECK(mpt__strategy_mirror_devices(s, desc));
        s->local = s->n_backends;
    }
#endif
    if (s->n_backends == 1 && s->workers == 1) return MPT_OK; /* one device: nothing to join */
    if (!be->comm_create)
        return mpt__fail(s->ctx, MPT_ERR_UNSUPPORTED,
                         "strategy: replicas on %d GPUs need mpt_cuda.cu built with -DMPT_NCCL "
                         "(and -lnccl)", s->n_backends * s->workers);
    if (s->workers == 1) {
        if (be->comm_create(s->impl, s->n_backends, 0, s->n_backends, NULL, &s->comm) != MPT_OK)
            return mpt__fail(s->ctx, MPT_ERR_UNSUPPORTED, "strategy: %s", be->error(s->impl[0]));
        return MPT_OK;
    }
#ifdef MPT_MPI
    {
        unsigned char id[MPT_COMM_ID_BYTES];
        memset(id, 0, sizeof id);
        if (s->worker == 0 && be->comm_id(s->impl[0], id) != MPT_OK)
            return mpt__fail(s->ctx, MPT_ERR_UNSUPPORTED, "strategy: %s", be->error(s->impl[0]));
        MPI_Bcast(id, MPT_COMM_ID_BYTES, MPI_BYTE, 0, MPI_COMM_WORLD);
        if (be->comm_create(s->impl, 1, s->worker, s->workers, id, &s->comm) != MPT_OK)
            return mpt__fail(s->ctx, MPT_ERR_UNSUPPORTED, "strategy: %s", be->error(s->impl[0]));
    }
#endif
    return MPT_OK;
}

MPTDEF mpt_status mpt_strategy_create(mpt_context *ctx, const mpt_strategy_desc *desc,
                                      mpt_strategy **out) {
    mpt_strategy *s;
    mpt_status st = MPT_OK;
    mpt_strategy_desc defaults;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "strategy: NULL out");
    *out = NULL;
    memset(&defaults, 0, sizeof defaults);
    if (!desc) desc = &defaults; /* NULL: every default */
    if (desc->type < MPT_STRATEGY_DEFAULT || desc->type > MPT_STRATEGY_MULTI_WORKER)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "strategy: unknown type %d",
                         (int)desc->type);
    if (desc->num_replicas > MPT__MAX_REPLICAS)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "strategy: num_replicas %d: a model can have at most %d replicas",
                         desc->num_replicas, MPT__MAX_REPLICAS);
    if (desc->n_devices > MPT__MAX_REPLICAS)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "strategy: %d devices: a model can have at most %d replicas, one a device",
                         desc->n_devices, MPT__MAX_REPLICAS);
    if (desc->n_devices < 0 || (desc->n_devices > 0 && !desc->devices))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "strategy: %d devices (0..%d, with a list)",
                         desc->n_devices, MPT__MAX_REPLICAS);
    if (desc->num_replicas < 0 || (desc->num_replicas > 1 && desc->type != MPT_STRATEGY_MIRRORED))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "strategy: num_replicas %d (0..%d, and above 1 only for mirrored)",
                         desc->num_replicas, MPT__MAX_REPLICAS);
    if (!(desc->timeout_seconds >= 0 && desc->timeout_seconds < 1e9) || desc->bucket_bytes < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "strategy: timeout_seconds %g and bucket_bytes %lld must be >= 0",
                         desc->timeout_seconds, (long long)desc->bucket_bytes);
    s = (mpt_strategy *)mpt__calloc(ctx, sizeof *s);
    if (!s) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "strategy: out of memory");
    s->ctx = ctx;
    s->type = desc->type;
    s->local = desc->num_replicas ? desc->num_replicas : 1;
    s->workers = 1;
    s->timeout = desc->timeout_seconds ? desc->timeout_seconds : 60;
    s->bucket_bytes = desc->bucket_bytes ? desc->bucket_bytes : (int64_t)4 << 20;
    if (s->type == MPT_STRATEGY_MULTI_WORKER) st = mpt__strategy_join_workers(s);
    if (st == MPT_OK) st = mpt__strategy_open_devices(s, desc);
    if (st != MPT_OK) {
        mpt_strategy_destroy(s);
        return st;
    }
    *out = s;
    return MPT_OK;
}

MPTDEF void mpt_strategy_destroy(mpt_strategy *s) {
    int k;
    if (!s) return;
    if (s->comm) s->backend[0]->comm_destroy(s->comm);
    for (k = 1; k < s->n_backends; k++) s->backend[k]->destroy(s->impl[k]);
#ifdef MPT_MPI
    if (s->began_mpi) MPI_Finalize();
#endif
    mpt__free(s->ctx, s);
}

/* ---- waiting for the other workers, never forever --------------------------- */

#ifdef MPT_MPI
/* Completes n requests, polling, or fails after the strategy's timeout
   naming what was awaited: another worker has died or is stuck. */
static mpt_status mpt__mpi_wait(mpt_model *m, MPI_Request *req, int n, const char *what) {
    double start = mpt__now();
    int done = 0;
    while (!done) {
        if (MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
            return mpt__fail(m->ctx, MPT_ERR_STATE, "worker %d: %s: MPI failed",
                             m->strategy->worker, what);
        if (done) break;
        if (mpt__now() - start > m->strategy->timeout)
            return mpt__fail(m->ctx, MPT_ERR_STATE,
                             "worker %d: %s: no answer from the other workers in %g s "
                             "(one has stopped or is stuck); giving up",
                             m->strategy->worker, what, m->strategy->timeout);
        sched_yield();
    }
    return MPT_OK;
}
#endif

/* Σ over the workers, in place, of n values in host memory: doubles (the
   tallies) when `doubles`, else floats (on the CPU backend, its buffers). */
static mpt_status mpt__workers_sum(mpt_model *m, void *v, int64_t n, int doubles,
                                   const char *what) {
#ifdef MPT_MPI
    if (m->strategy && m->strategy->workers > 1) {
        MPI_Request r;
        MPI_Iallreduce(MPI_IN_PLACE, v, (int)n, doubles ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM,
                       MPI_COMM_WORLD, &r);
        return mpt__mpi_wait(m, &r, 1, what);
    }
#endif
    (void)m;
    (void)v;
    (void)n;
    (void)doubles;
    (void)what;
    return MPT_OK;
}

/* ---- BatchNormalization synchronized over the replicas ------------------------ */

static int mpt__is_sync_bn(const mpt__layer *L) {
    return L->ops == &mpt__bn_ops && L->desc.batchnorm.synchronized;
}

/* Host room for the widest synchronized layer's sums (none: nothing). */
static mpt_status mpt__sync_scratch_alloc(mpt_model *m) {
    int64_t widest = 0;
    int i;
    for (i = 0; i < m->n_layers; i++)
        if (mpt__is_sync_bn(&m->layers[i]))
            widest = MPT__MAX(widest, m->layers[i].in_shape[m->layers[i].in_rank - 1]);
    if (!widest) return MPT_OK;
    m->sync_scratch = (double *)mpt__alloc(m->ctx, (size_t)(2 * widest + 1) * sizeof(double) +
                                                       (size_t)(2 * widest) * sizeof(float));
    return m->sync_scratch ? MPT_OK
                           : mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "strategy: out of memory");
}


/* Replica r's layer i's saved[ia] and saved[ib], C floats each, into fa
   and fb on the host. */
static mpt_status mpt__sync_download(mpt_model *r, int i, int ia, int ib, float *fa, float *fb,
                                     int64_t C) {
    MPT__CHECK(mpt__download(r, fa, r->layers[i].saved[ia], sizeof(float) * (size_t)C));
    return mpt__download(r, fb, r->layers[i].saved[ib], sizeof(float) * (size_t)C);
}

/* Forward's: from each replica's batch mean and variance of layer i
   (saved[0], saved[1]) over its rows, sums[0..C) = Σ rows·mean and
   sums[C..2C) = Σ rows·(variance + mean²), and sums[2C] = Σ rows, over the
   replicas and then the workers. */
static mpt_status mpt__sync_gather_moments(mpt_model *m, int i, const int64_t *rows,
                                           double *sums, int64_t C) {
    float *mean = (float *)(sums + 2 * C + 1), *var = mean + C;
    int64_t c;
    int k;
    for (c = 0; c <= 2 * C; c++) sums[c] = 0;
    for (k = 0; k < m->n_replicas; k++) {
        double n = (double)rows[k];
        if (!rows[k]) continue;
        MPT__CHECK(mpt__sync_download(m->replica[k], i, 0, 1, mean, var, C));
        for (c = 0; c < C; c++) {
            sums[c] += n * mean[c];
            sums[C + c] += n * ((double)var[c] + (double)mean[c] * mean[c]);
        }
        sums[2 * C] += n;
    }
    return mpt__workers_sum(m, sums, 2 * C + 1, 1, "synchronizing BatchNormalization");
}

/* Backward's: from each replica's per-channel Σdy and Σdy·x̂ of layer i
   (saved[2], saved[3]), sums[0..C) = Σdy and sums[C..2C) = Σdy·x̂ over the
   replicas and then the workers. */
static mpt_status mpt__sync_gather_sums(mpt_model *m, int i, const int64_t *rows, double *sums,
                                        int64_t C) {
    float *sum_dy = (float *)(sums + 2 * C + 1), *sum_dyx = sum_dy + C;
    int64_t c;
    int k;
    for (c = 0; c < 2 * C; c++) sums[c] = 0;
    for (k = 0; k < m->n_replicas; k++) {
        if (!rows[k]) continue;
        MPT__CHECK(mpt__sync_download(m->replica[k], i, 2, 3, sum_dy, sum_dyx, C));
        for (c = 0; c < C; c++) {
            sums[c] += sum_dy[c];
            sums[C + c] += sum_dyx[c];
        }
    }
    return mpt__workers_sum(m, sums, 2 * C, 1, "synchronizing BatchNormalization");
}

/* Two C-float arrays (from host floats) into layer i's saved[ia], saved[ib]
   on every replica. */
static mpt_status mpt__sync_scatter(mpt_model *m, int i, int ia, int ib, const float *a,
                                    const float *b, int64_t C) {
    int k;
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        MPT__CHECK(mpt__upload(r, r->layers[i].saved[ia], a, sizeof(float) * (size_t)C));
        MPT__CHECK(mpt__upload(r, r->layers[i].saved[ib], b, sizeof(float) * (size_t)C));
    }
    return MPT_OK;
}

/* Forward of synchronized layer i: each replica measures its batch, the
   statistics of the union (mean, biased variance: Σx/N and Σx²/N − mean²
   from each part's mean and variance, in double) go to every replica's
   saved mean and variance, and each normalises with them. */
static mpt_status mpt__sync_bn_forward(mpt_model *m, int i, mpt__forward_walk *fw,
                                       const int64_t *rows) {
    const mpt__layer *L0 = &m->layers[i];
    int64_t C = L0->in_shape[L0->in_rank - 1], c, bn_rows[MPT__MAX_REPLICAS];
    double *sums = m->sync_scratch, N;
    float *mean = (float *)(sums + 2 * C + 1), *var = mean + C;
    int k;
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        mpt_batchnorm_args a;
        bn_rows[k] = 0;
        if (!rows[k]) continue;
        a = mpt__bn_args(&r->layers[i], &fw[k].p);
        bn_rows[k] = a.rows;
        r->be->batchnorm_forward(r->impl, &a);
    }
    MPT__CHECK(mpt__sync_gather_moments(m, i, bn_rows, sums, C));
    N = MPT__MAX(sums[2 * C], 1);
    for (c = 0; c < C; c++) {
        double mu = sums[c] / N;
        mean[c] = (float)mu;
        var[c] = (float)MPT__MAX(sums[C + c] / N - mu * mu, 0.0);
    }
    MPT__CHECK(mpt__sync_scatter(m, i, 0, 1, mean, var, C));
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        mpt_batchnorm_args a;
        if (!rows[k]) continue;
        a = mpt__bn_args(&r->layers[i], &fw[k].p);
        a.training = 0; /* normalise with the union's statistics, just saved */
        a.moving_mean = a.mean;
        a.moving_variance = a.variance;
        r->be->batchnorm_forward(r->impl, &a);
    }
    return MPT_OK;
}

/* Backward of synchronized layer i: each replica sums dy and dy·x̂ over its
   rows (into dbeta and dgamma, or saved[2] and saved[3] where the layer
   has no beta or gamma), the sums over every replica go to each, and dx
   subtracts their means. */
static mpt_status mpt__sync_bn_backward(mpt_model *m, int i, mpt__backward_walk *bw,
                                        const int64_t *rows) {
    const mpt__layer *L0 = &m->layers[i];
    int64_t C = L0->in_shape[L0->in_rank - 1], c, bn_rows[MPT__MAX_REPLICAS];
    double *sums = m->sync_scratch;
    float *sum_dy = (float *)(sums + 2 * C + 1), *sum_dyx = sum_dy + C;
    int k;
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        mpt__layer *L = &r->layers[i];
        mpt_batchnorm_args a;
        bn_rows[k] = 0;
        if (!rows[k]) continue;
        a = mpt__bn_args(L, &bw[k].p);
        bn_rows[k] = a.rows;
        a.dx = NULL;
        a.dbeta = (float *)L->saved[2];
        a.dgamma = (float *)L->saved[3];
        r->be->batchnorm_backward(r->impl, &a);
    }
    MPT__CHECK(mpt__sync_gather_sums(m, i, bn_rows, sums, C));
    for (c = 0; c < C; c++) {
        sum_dy[c] = (float)sums[c];
        sum_dyx[c] = (float)sums[C + c];
    }
    MPT__CHECK(mpt__sync_scatter(m, i, 2, 3, sum_dy, sum_dyx, C));
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        mpt__layer *L = &r->layers[i];
        mpt_batchnorm_args a;
        if (!rows[k]) continue;
        a = mpt__bn_args(L, &bw[k].p);
        a.sum_dy = (const float *)L->saved[2];
        a.sum_dy_xhat = (const float *)L->saved[3];
        a.total_rows = (int64_t)sums[2 * C];
        r->be->batchnorm_backward(r->impl, &a);
    }
    return MPT_OK;
}

/* ---- building the replicas ---------------------------------------------------- */

#ifdef MPT_MPI
/* A hash of everything that must match between workers: the input, the
   policy and seed, each layer's class, name, dtype and output shape, every
   parameter's shape, and the batch each replica is built for. */
static uint64_t mpt__model_signature(const mpt_model *m) {
    uint64_t h = 0xcbf29ce484222325ull;
#define MPT__MIX(v) (h = mpt__mix64(h ^ (uint64_t)(v)))
    int i, k;
    const char *c;
    for (i = 0; i < m->desc.input_rank; i++) MPT__MIX(m->desc.input_shape[i]);
    MPT__MIX(m->desc.policy);
    MPT__MIX(m->desc.seed);
    MPT__MIX(m->max_batch);
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        for (c = L->ops->class_name; *c; c++) MPT__MIX(*c);
        for (c = L->name; *c; c++) MPT__MIX(*c);
        MPT__MIX(L->dtype);
        for (k = 0; k < L->out_rank; k++) MPT__MIX(L->out_shape[k]);
    }
    for (i = 0; i < m->n_params; i++)
        for (k = 0; k < m->params[i].rank; k++) MPT__MIX(m->params[i].shape[k]);
#undef MPT__MIX
    return h;
}
#endif

/* Multi-worker: every worker built the same model (else all fail, naming
   the workers that differ), and all take worker 0's weights. */
static mpt_status mpt__workers_agree(mpt_model *m) {
#ifdef MPT_MPI
    mpt_strategy *s = m->strategy;
    uint64_t mine = mpt__model_signature(m), *all;
    MPI_Request r;
    int w, bad = 0;
    char which[256] = "";
    size_t used = 0;
    if (s->workers <= 1) return MPT_OK;
    all = (uint64_t *)mpt__alloc(m->ctx, sizeof(uint64_t) * (size_t)s->workers);
    if (!all) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "strategy: out of memory");
    MPI_Iallgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD, &r);
    if (mpt__mpi_wait(m, &r, 1, "comparing the workers' models") != MPT_OK) {
        mpt__free(m->ctx, all);
        return MPT_ERR_STATE;
    }
    for (w = 1; w < s->workers; w++)
        if (all[w] != all[0]) {
            bad++;
            if (used < sizeof which)
                used += (size_t)snprintf(which + used, sizeof which - used, " %d", w);
        }
    mpt__free(m->ctx, all);
    if (bad)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "strategy: workers built different models (layers, shapes, policy, "
                         "seed or batch): worker%s%s differ%s from worker 0",
                         bad > 1 ? "s" : "", which, bad > 1 ? "" : "s");
    {
        /* worker 0's weights, in pieces that fit MPI's int counts (through
           the host from a GPU) */
        int64_t bytes = m->arena_bytes[MPT__MEM_PARAMS], left = bytes;
        int on_host = mpt__model_device(m) == MPT_DEVICE_CPU;
        unsigned char *host = on_host ? (unsigned char *)m->arena[MPT__MEM_PARAMS]
                                      : (unsigned char *)mpt__alloc(m->ctx, (size_t)bytes + 1);
        unsigned char *p = host;
        mpt_status st = host ? MPT_OK : mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "out of memory");
        if (st == MPT_OK && !on_host) st = mpt__download(m, host, m->arena[MPT__MEM_PARAMS], bytes);
        while (st == MPT_OK && left > 0) {
            int piece = (int)MPT__MIN(left, (int64_t)1 << 30);
            MPI_Ibcast(p, piece, MPI_BYTE, 0, MPI_COMM_WORLD, &r);
            st = mpt__mpi_wait(m, &r, 1, "receiving worker 0's weights");
            p += piece;
            left -= piece;
        }
        if (st == MPT_OK && !on_host) st = mpt__upload(m, m->arena[MPT__MEM_PARAMS], host, bytes);
        if (!on_host) mpt__free(m->ctx, host);
        MPT__CHECK(st);
        mpt_model_refresh_weights(m);
    }
#else
    (void)m;
#endif
    return MPT_OK;
}

/* to's parameters (values and moving statistics) become from's: in place
   on one device, through the host between devices. */
static mpt_status mpt__copy_params(mpt_model *to, mpt_model *from) {
    size_t bytes = (size_t)from->arena_bytes[MPT__MEM_PARAMS];
    void *host;
    mpt_status s;
    if (to->impl == from->impl) {
        to->be->copy(to->impl, to->arena[MPT__MEM_PARAMS], from->arena[MPT__MEM_PARAMS], bytes);
        mpt_model_refresh_weights(to);
        return MPT_OK;
    }
    host = mpt__alloc(to->ctx, bytes + 1);
    if (!host) return mpt__fail(to->ctx, MPT_ERR_OUT_OF_MEMORY, "strategy: out of memory");
    s = mpt__download(from, host, from->arena[MPT__MEM_PARAMS], bytes);
    if (s == MPT_OK) s = mpt__upload(to, to->arena[MPT__MEM_PARAMS], host, bytes);
    mpt__free(to->ctx, host);
    if (s == MPT_OK) mpt_model_refresh_weights(to);
    return s;
}

static mpt_status mpt__replica_new(mpt_model *m, int k, mpt_model **out) {
    mpt_model_desc d = m->desc;
    mpt_model *r = NULL;
    int i;
    mpt_status s;
    d.strategy = NULL;
    MPT__CHECK(mpt_model_create(m->ctx, &d, &r));
    r->replica_index = m->replica_index + k;
    if (m->strategy->n_backends > 1) { /* its own GPU */
        r->be = m->strategy->backend[k];
        r->impl = m->strategy->impl[k];
    }
    for (i = 0, s = MPT_OK; s == MPT_OK && i < m->n_layers; i++)
        s = mpt__model_add(r, m->layers[i].ops, &m->layers[i].desc, m->layers[i].name,
                           m->layers[i].desc.common.dtype);
    if (s == MPT_OK && m->compiled) s = mpt_model_compile(r, &m->compile);
    if (s == MPT_OK) s = mpt__build_one(r, m->max_batch);
    if (s == MPT_OK) s = mpt__copy_params(r, m); /* replica 0's weights */
    if (s != MPT_OK) {
        mpt_model_destroy(r);
        return s;
    }
    *out = r;
    return MPT_OK;
}

/* After replica 0 is built: the other replicas of this process, then the
   agreement between workers. A failure leaves the model unbuilt. */
static mpt_status mpt__replicas_build(mpt_model *m) {
    mpt_strategy *s = m->strategy;
    mpt_status st = MPT_OK;
    int k;
    m->replica = (mpt_model **)mpt__calloc(m->ctx, sizeof(mpt_model *) * (size_t)s->local);
    if (!m->replica) st = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "strategy: out of memory");
    if (st == MPT_OK && s->workers > 1 && mpt__model_device(m) != MPT_DEVICE_CPU && !s->comm)
        st = mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                       "strategy: several workers on GPUs need mpt_cuda.cu built with -DMPT_NCCL");
    if (st == MPT_OK) {
        m->replica[0] = m;
        m->replica_index = s->worker * s->local;
    }
    for (k = 1; st == MPT_OK && k < s->local; k++) {
        st = mpt__replica_new(m, k, &m->replica[k]);
        if (st == MPT_OK) m->n_replicas = k + 1;
    }
    if (st == MPT_OK) st = mpt__sync_scratch_alloc(m);
    if (st == MPT_OK) st = mpt__workers_agree(m);
    if (st != MPT_OK) {
        for (k = 1; k < m->n_replicas; k++) mpt_model_destroy(m->replica[k]);
        mpt__free(m->ctx, m->replica);
        mpt__free(m->ctx, m->sync_scratch);
        m->replica = NULL;
        m->sync_scratch = NULL;
        m->n_replicas = 1;
        mpt__free_arenas(m);
        m->built = 0;
    }
    return st;
}

/* ---- the gradients between workers, bucket by bucket ---------------------------- */

/* One step's all-reduce of the gradient arena (float32 sums), cut into
   buckets that start as soon as the layers filling them are done with
   their backward pass: the layers' gradients lie in layer order in the
   arena, and backward runs from the last layer, so what is finished is
   always the arena's tail [offset of layer i, end). */
typedef struct mpt__exchange {
    int64_t pending;        /* floats [0, pending) not yet sent            */
    int64_t bucket;         /* floats per bucket                           */
    int n, cap;
#ifdef MPT_MPI
    MPI_Request *req;       /* [cap]                                       */
#endif
} mpt__exchange;

static void mpt__exchange_free(mpt_model *m) {
    if (!m->exchange) return;
#ifdef MPT_MPI
    mpt__free(m->ctx, m->exchange->req);
#endif
    mpt__free(m->ctx, m->exchange);
    m->exchange = NULL;
}

/* Allocated when fit starts (a step allocates nothing); only with workers. */
static mpt_status mpt__exchange_open(mpt_model *m) {
    mpt__exchange *x;
    int64_t floats = m->arena_bytes[MPT__MEM_GRADS] / 4;
    if (!m->strategy || m->strategy->workers <= 1 || m->n_replicas > 1 || m->strategy->comm)
        return MPT_OK; /* (a communicator sums GPUs' gradients itself) */
    x = (mpt__exchange *)mpt__calloc(m->ctx, sizeof *x);
    if (!x) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    m->exchange = x;
    x->bucket = MPT__MAX(m->strategy->bucket_bytes / 4, 1);
    /* a bucket per layer at most, each in pieces below 2^30 floats */
    x->cap = 2 * m->n_layers + (int)(floats >> 30) + 4;
#ifdef MPT_MPI
    x->req = (MPI_Request *)mpt__calloc(m->ctx, sizeof(MPI_Request) * (size_t)x->cap);
    if (!x->req) {
        mpt__exchange_free(m);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    }
#endif
    return MPT_OK;
}

/* Starts the all-reduce of floats [from, pending). */
static void mpt__exchange_send(mpt_model *m, int64_t from) {
    mpt__exchange *x = m->exchange;
#ifdef MPT_MPI
    float *g = (float *)m->arena[MPT__MEM_GRADS];
    while (x->pending > from && x->n < x->cap) {
        int64_t piece = MPT__MIN(x->pending - from, (int64_t)1 << 30);
        MPI_Iallreduce(MPI_IN_PLACE, g + x->pending - piece, (int)piece, MPI_FLOAT, MPI_SUM,
                       MPI_COMM_WORLD, &x->req[x->n++]);
        x->pending -= piece;
    }
#else
    (void)m;
#endif
    x->pending = MPT__MIN(x->pending, from);
}

/* Called by backward after each layer: sends the finished tail once it
   holds a bucket, and lets MPI progress what is in flight. */
static void mpt__exchange_layer_done(mpt_model *m, int layer) {
    mpt__exchange *x = m->exchange;
    const mpt__layer *L = &m->layers[layer];
    int k;
    for (k = 0; k < L->n_params; k++)
        if (L->param[k]->trainable) {
            int64_t at = L->param[k]->grad - (float *)m->arena[MPT__MEM_GRADS];
            if (x->pending - at >= x->bucket) mpt__exchange_send(m, at);
            break;
        }
#ifdef MPT_MPI
    if (x->n) {
        int done;
        MPI_Testall(x->n, x->req, &done, MPI_STATUSES_IGNORE);
    }
#endif
}

/* The step's exchange: before backward, arm it; after, send the rest and
   wait (with the strategy's timeout) for every bucket. */
static void mpt__exchange_arm(mpt_model *m) {
    m->exchange->pending = m->arena_bytes[MPT__MEM_GRADS] / 4;
    m->exchange->n = 0;
}

static mpt_status mpt__exchange_finish(mpt_model *m) {
    mpt__exchange_send(m, 0);
#ifdef MPT_MPI
    return mpt__mpi_wait(m, m->exchange->req, m->exchange->n, "summing the gradients");
#else
    return MPT_OK;
#endif
}

/* count floats summed over every replica on every device and worker,
   through the strategy's communicator, in place on each: each replica's
   arena `arena` (layer < 0) or layer `layer`'s saved[which]. */
static mpt_status mpt__comm_sum(mpt_model *m, int arena, int layer, int which, int64_t count) {
    float *bufs[MPT__MAX_REPLICAS];
    mpt_status st;
    int k;
    for (k = 0; k < m->n_replicas; k++) {
        mpt_model *r = m->replica[k];
        bufs[k] = layer < 0 ? (float *)r->arena[arena] : (float *)r->layers[layer].saved[which];
    }
    st = m->be->allreduce_sum(m->strategy->comm, bufs, count);
    return st == MPT_OK ? st
                        : mpt__fail(m->ctx, st, "strategy: %s",
                                    m->be->comm_error(m->strategy->comm));
}

/* BatchNormalization's batch statistics made the mean over the replicas
   that had rows (here and on every worker) before every replica commits
   them: the moving statistics, an average of linear updates, then equal
   the mean of per-replica moving statistics, which is what TensorFlow
   reads from its per-replica (ON_READ, MEAN) variables. They stay the
   same on every replica. */
static mpt_status mpt__replicas_average_statistics(mpt_model *m, const int64_t *had_rows) {
    int n = m->n_replicas, i, j, k, any = 0;
    double contributors = 0;
    for (i = 0; i < m->n_layers; i++)
        any |= m->layers[i].ops == &mpt__bn_ops && !mpt__is_sync_bn(&m->layers[i]);
    if (!any) return MPT_OK; /* nothing to average: no collective either */
    for (k = 0; k < n; k++) contributors += had_rows[k] != 0;
    MPT__CHECK(mpt__workers_sum(m, &contributors, 1, 1, "counting the replicas with rows"));
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = &m->layers[i];
        int64_t C = L->in_shape[L->in_rank - 1];
        if (L->ops != &mpt__bn_ops || mpt__is_sync_bn(L)) continue; /* synchronized: equal */
        for (j = 0; j < 2; j++) { /* saved[0]: mean, saved[1]: variance, (C) each */
            float *sum = (float *)L->saved[j];
            if (m->strategy->comm) { /* several devices: through the communicator */
                float inv = (float)(1.0 / MPT__MAX(contributors, 1));
                for (k = 0; k < n; k++)
                    if (!had_rows[k])
                        m->replica[k]->be->zero(m->replica[k]->impl,
                                                m->replica[k]->layers[i].saved[j],
                                                sizeof(float) * (size_t)C);
                MPT__CHECK(mpt__comm_sum(m, 0, i, j, C));
                for (k = 0; k < n; k++)
                    m->replica[k]->be->scale(m->replica[k]->impl,
                                             (float *)m->replica[k]->layers[i].saved[j], inv, C);
                continue;
            }
            if (!had_rows[0]) m->be->zero(m->impl, sum, sizeof(float) * (size_t)C);
            for (k = 1; k < n; k++)
                if (had_rows[k])
                    m->be->add(m->impl, sum, (const float *)m->replica[k]->layers[i].saved[j], C);
            MPT__CHECK(mpt__workers_sum(m, sum, C, 0, "averaging the batch statistics"));
            m->be->scale(m->impl, sum, (float)(1.0 / MPT__MAX(contributors, 1)), C);
            for (k = 1; k < n; k++)
                m->be->copy(m->impl, m->replica[k]->layers[i].saved[j], sum,
                            sizeof(float) * (size_t)C);
        }
    }
    return MPT_OK;
}

/* ---- one replicated training step --------------------------------------------- */

/* Rows [b0, b1) of a batch tensor, as a view. */
static mpt_tensor mpt__rows(const mpt_tensor *t, int64_t b0, int64_t b1) {
    mpt_tensor v = *t;
    v.shape[0] = b1 - b0;
    v.data = (unsigned char *)t->data + (size_t)b0 * (mpt_tensor_bytes(t) / (size_t)t->shape[0]);
    return v;
}

/* Replica k's rows of this worker's batch of `rows` (a contiguous share:
   xs[k], ys[k]; none, when the batch has fewer rows than replicas: empty
   tensors, shape[0] 0). */
static void mpt__replica_rows(const mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                              int64_t rows, mpt_tensor *xs, mpt_tensor *ys) {
    int n = m->n_replicas, k;
    for (k = 0; k < n; k++) {
        int64_t b0 = rows * k / n, b1 = rows * (k + 1) / n;
        memset(&xs[k], 0, sizeof xs[k]);
        memset(&ys[k], 0, sizeof ys[k]);
        if (b1 > b0) {
            xs[k] = mpt__rows(x, b0, b1);
            ys[k] = mpt__rows(y, b0, b1);
        }
    }
}

/* Every replica's forward, loss and backward on its rows xs[k], ys[k]
   (none: then its gradients are zero), layer by layer in step (a
   synchronized layer needs every replica at the same layer), each loss
   divided by the global batch. */
static mpt_status mpt__replicas_forward_backward(mpt_model *m, const mpt_tensor *xs,
                                                 const mpt_tensor *ys, int64_t global_rows,
                                                 int64_t *had) {
    int n = m->n_replicas, k, i, first = m->n_layers;
    mpt__forward_walk fw[MPT__MAX_REPLICAS];
    mpt__backward_walk bw[MPT__MAX_REPLICAS];
    mpt_tensor target[MPT__MAX_REPLICAS];
    for (k = 0; k < n; k++) {
        mpt_model *r = m->replica[k];
        had[k] = xs[k].shape[0];
        if (had[k] > 0) {
            mpt_tensor in;
            MPT__CHECK(mpt__input_on_backend(r, &xs[k], &in));
            MPT__CHECK(mpt__target_on_backend(r, &ys[k], &target[k]));
            mpt__forward_begin(r, &in, 1, &fw[k]);
        } else {
            r->be->zero(r->impl, r->arena[MPT__MEM_GRADS], (size_t)r->arena_bytes[MPT__MEM_GRADS]);
        }
    }
    for (i = 0; i < m->n_layers; i++) {
        for (k = 0; k < n; k++)
            if (had[k]) mpt__forward_prepare(m->replica[k], i, &fw[k]);
        if (mpt__is_sync_bn(&m->layers[i])) {
            MPT__CHECK(mpt__sync_bn_forward(m, i, fw, had));
        } else {
            for (k = 0; k < n; k++)
                if (had[k]) m->replica[k]->layers[i].ops->forward(&m->replica[k]->layers[i], &fw[k].p);
        }
        for (k = 0; k < n; k++)
            if (had[k]) mpt__forward_finish(&m->replica[k]->layers[i], &fw[k]);
    }
    for (k = 0; k < n; k++) {
        mpt_model *r = m->replica[k];
        mpt_loss_args loss;
        if (!had[k]) continue;
        loss = mpt__loss_args(r, &target[k], 1);
        loss.grad_weight = (float)((double)had[k] / (double)global_rows);
        r->be->loss(r->impl, &loss);
        mpt__backward_begin(r, 0, &bw[k]);
        first = bw[k].first;
    }
    for (i = m->n_layers - 1; i >= first; i--) {
        for (k = 0; k < n; k++)
            if (had[k]) mpt__backward_prepare(m->replica[k], i, &bw[k]);
        if (mpt__is_sync_bn(&m->layers[i])) {
            MPT__CHECK(mpt__sync_bn_backward(m, i, bw, had));
        } else {
            for (k = 0; k < n; k++)
                if (had[k])
                    m->replica[k]->layers[i].ops->backward(&m->replica[k]->layers[i], &bw[k].p);
        }
        for (k = 0; k < n; k++)
            if (had[k]) mpt__backward_finish(m->replica[k], i, &bw[k]);
    }
    return MPT_OK;
}

/* The replicas' gradients summed on one device: replica 0 adds the others'
   in order, the workers' sum follows (MPI, in buckets), and every replica
   takes the result. */
static mpt_status mpt__local_sum_grads(mpt_model *m, int64_t grads) {
    int k;
    for (k = 1; k < m->n_replicas; k++)
        m->be->add(m->impl, (float *)m->arena[MPT__MEM_GRADS],
                   (const float *)m->replica[k]->arena[MPT__MEM_GRADS], grads / 4);
    if (m->exchange) MPT__CHECK(mpt__exchange_finish(m));
    for (k = 1; k < m->n_replicas; k++)
        m->be->copy(m->impl, m->replica[k]->arena[MPT__MEM_GRADS], m->arena[MPT__MEM_GRADS],
                    (size_t)grads);
    return MPT_OK;
}

/* The step: forward and backward on every replica, the gradients summed
   over the replicas (in order) and the workers, the same update on every
   replica. xs[k], ys[k]: replica k's rows, where it can read them (on a
   GPU, fit's feed uploaded them). */
static mpt_status mpt__replicas_step(mpt_model *m, const mpt_tensor *xs, const mpt_tensor *ys,
                                     int64_t global_rows, mpt__step_times *times) {
    int n = m->n_replicas, k;
    int64_t grads = m->arena_bytes[MPT__MEM_GRADS], had[MPT__MAX_REPLICAS];
    double t0 = mpt__now(), t1;
    if (m->exchange) mpt__exchange_arm(m);
    MPT__CHECK(mpt__replicas_forward_backward(m, xs, ys, global_rows, had));
    if (m->strategy->comm) { /* GPUs: the communicator sums them, on every device */
        MPT__CHECK(mpt__comm_sum(m, MPT__MEM_GRADS, -1, 0, grads / 4));
    } else {
        MPT__CHECK(mpt__local_sum_grads(m, grads));
    }
    t1 = mpt__now();
    MPT__CHECK(mpt__replicas_average_statistics(m, had));
    for (k = 0; k < n; k++) mpt__queue_update(m->replica[k]); /* the averaged statistics */
    times->backward += t1 - t0;
    times->update += mpt__now() - t1;
    return MPT_OK;
}

/* The step on this worker's batch of `rows` in host memory. */
static mpt_status mpt__replicated_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                                       int64_t rows, int64_t global_rows, mpt__step_times *times) {
    mpt_tensor xs[MPT__MAX_REPLICAS], ys[MPT__MAX_REPLICAS];
    mpt__replica_rows(m, x, y, rows, xs, ys);
    return mpt__replicas_step(m, xs, ys, global_rows, times);
}

/* Whether fit may record the replicas' step in a CUDA graph and replay it:
   when they share one device and one worker. Collectives between devices
   stay out (NCCL's, replayed in graphs of several devices from one thread,
   can deadlock), as do MPI's between workers and a synchronized
   BatchNormalization (both pass through the host every step). */
static int mpt__replicas_capturable(const mpt_model *m) {
    int i;
    if (m->strategy->comm || m->strategy->workers > 1) return 0;
    for (i = 0; i < m->n_layers; i++)
        if (mpt__is_sync_bn(&m->layers[i])) return 0;
    return 1;
}

/* This worker's share of an epoch's order: of each global batch of
   `batch` samples (the last may be shorter), its contiguous slice.
   Returns how many samples that is. */
static int64_t mpt__worker_order(const mpt_model *m, const int64_t *order, int64_t n,
                                 int64_t batch, int64_t *mine) {
    int64_t g, used = 0;
    int w = m->strategy->worker, W = m->strategy->workers;
    for (g = 0; g < n; g += batch) {
        int64_t rows = MPT__MIN(batch, n - g);
        int64_t b0 = rows * w / W, b1 = rows * (w + 1) / W;
        memcpy(mine + used, order + g + b0, sizeof(int64_t) * (size_t)(b1 - b0));
        used += b1 - b0;
    }
    return used;
}

/* =============================================================================
   @impl-quantize  post-training quantization: the operations from the layers
   =============================================================================

   A quantized model is an mpt_model without layers of its own that holds
   an mpt__quantized: the operations (mpt__qop) made from the float model's
   layers with BatchNormalization folded in, the quantization of every
   tensor between them, and what each mode stores. One batch runs through
   the operations in one of four ways (mpt__qexec):
     reference  the folded model in float32, from the float32 weights kept
                while quantizing (calibration runs it)
     float16    the same with the float16 weights widened as each layer runs
     dynamic    products in int8 on inputs quantized per sample, the rest
                in float32
     integer    everything in int8 from the input's quantization on
   (@impl-quantized-passes), and @impl-quantized-model calibrates, builds
   the model and runs it over datasets. This section: the structures, a
   tensor's quantization, the operations from the layers, the work block. */

#define MPT__Q_HIST_BINS 2048
#define MPT__Q_COLS_BUDGET ((int64_t)1 << 20) /* elements of im2col rows per chunk */

typedef enum mpt__qexec {
    MPT__QX_REFERENCE = 0,
    MPT__QX_FLOAT16,
    MPT__QX_DYNAMIC,
    MPT__QX_INTEGER
} mpt__qexec;

typedef struct mpt__qop {
    mpt_quantized_layer info;  /* the public view: its pointers are the arrays below */
    char name[64], folded[64];
    mpt__win g;                /* conv and pooling: the window                 */
    int64_t in_count, out_count; /* elements of one sample                     */
    float *w;                  /* (N, K) folded float32 weights, while quantizing */
    float *bias;               /* (N) folded float32 bias                      */
    int8_t *wq;                /* (N, K) int8 modes                            */
    float *wscale;             /* (N) int8 modes                               */
    mpt_half *wh;              /* (N, K) float16 mode                          */
    int32_t *bq, *mult, *shift; /* (N) each, full integer                      */
    int8_t lut[256];           /* full-integer activation: out for in + 128    */
    float exp_table[256];      /* full-integer softmax: exp(−in_scale · d), d = max − q */
} mpt__qop;

struct mpt__quantized {
    mpt_quantize_mode mode;
    mpt_dtype io_dtype;
    int n_ops;
    mpt__qop *ops;              /* [n_ops]                                      */
    mpt_quant_params *tensor;   /* [n_ops + 1]: [0] the input, [i + 1] op i's output */
    int64_t in_count;           /* elements of one input sample                  */
    int64_t max_count;          /* of the largest tensor of one sample           */
    int64_t max_cols;           /* of the largest conv's im2col rows, one sample */
    int64_t max_weights;        /* the largest N·K                               */
    int64_t size_bytes;
};

/* A batch's scratch, one block: two activation buffers and what the
   products need. Sized for `batch` samples by mpt__qwork_alloc. */
typedef struct mpt__qwork {
    void *block;
    void *act[2];       /* (batch, max_count) float32 (int8 in integer)     */
    int32_t *acc;       /* (batch, max_count) the dynamic products           */
    int8_t *xq;         /* (batch, max_count) a dynamic product's input      */
    float *row_scale;   /* (batch · max_count) its scale per im2col row      */
    float *sample_scale; /* (batch) a dynamic conv's scale per sample        */
    void *cols;         /* im2col chunk, up to max(budget, max_cols) float32 */
    float *weights;     /* (max_weights) float16 weights widened             */
    int64_t batch;
} mpt__qwork;

static int mpt__qop_weighted(const mpt__qop *op) {
    return op->info.op == MPT_QOP_FULLY_CONNECTED || op->info.op == MPT_QOP_CONV_2D;
}

/* Operations whose output keeps the input's quantization (TFLite's rule
   for pooling and reshape): no range of their own. */
static int mpt__qop_passes_params(const mpt__qop *op) {
    return op->info.op == MPT_QOP_MAX_POOL_2D || op->info.op == MPT_QOP_AVERAGE_POOL_2D ||
           op->info.op == MPT_QOP_GLOBAL_AVERAGE_POOL_2D || op->info.op == MPT_QOP_RESHAPE;
}

static void mpt__qop_free(const mpt_context *ctx, mpt__qop *op) {
    mpt__free(ctx, op->w);
    mpt__free(ctx, op->bias);
    mpt__free(ctx, op->wq);
    mpt__free(ctx, op->wscale);
    mpt__free(ctx, op->wh);
    mpt__free(ctx, op->bq);
    mpt__free(ctx, op->mult);
    mpt__free(ctx, op->shift);
}

static void mpt__quantized_free(const mpt_context *ctx, struct mpt__quantized *Q) {
    int i;
    if (!Q) return;
    for (i = 0; i < Q->n_ops; i++) mpt__qop_free(ctx, &Q->ops[i]);
    mpt__free(ctx, Q->ops);
    mpt__free(ctx, Q->tensor);
    mpt__free(ctx, Q);
}

/* A quantized model is only predicted with and evaluated. */
static mpt_status mpt__refuse_quantized(mpt_model *m, const char *what) {
    if (!m->quantized) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_STATE,
                     "%s: this model is quantized (mpt_model_quantize): it only predicts and "
                     "evaluates", what);
}

/* ---- tensors' quantization ------------------------------------------------------ */

/* TFLite's choice for an int8 tensor over [lo, hi]: the range widened to
   hold 0 (so that zero padding is exact), scale (hi − lo)/255 and the zero
   point that puts lo at −128, rounded and clamped. */
static mpt_quant_params mpt__q_params(float lo, float hi) {
    mpt_quant_params p;
    double a = lo < 0 ? lo : 0, b = hi > 0 ? hi : 0, zp;
    p.min = lo;
    p.max = hi;
    p.scale = b > a ? (float)((b - a) / 255.0) : 1.0f;
    zp = -128.0 - a / (double)p.scale;
    p.zero_point = (int32_t)MPT__MAX(-128.0, MPT__MIN(127.0, floor(zp + 0.5)));
    return p;
}

/* The fixed output quantization TFLite gives softmax and sigmoid (1/256,
   −128: [0, 1)) and tanh (1/128, 0: [−1, 1)). */
static mpt_quant_params mpt__q_fixed_params(float scale, int32_t zero_point) {
    mpt_quant_params p;
    p.scale = scale;
    p.zero_point = zero_point;
    p.min = (float)((-128 - zero_point) * (double)scale);
    p.max = (float)((127 - zero_point) * (double)scale);
    return p;
}

/* Saturated to int8; NaN (a NaN input given to invoke) becomes 0. */
static int8_t mpt__q_clamp8(double v) {
    return (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v == v ? v : 0);
}

/* roundf (ties away from zero, TFLite's TfLiteRound) for |v| < 2^31,
   without a call: v minus its truncation is exact. Larger values only
   saturate the int8 they become. */
static float mpt__q_round(float v) {
    int32_t i;
    float r;
    if (!(fabsf(v) < 2147483520.0f)) return v; /* the largest float below 2^31 */
    i = (int32_t)v;
    r = v - (float)i;
    return (float)(i + (r >= 0.5f) - (r <= -0.5f));
}

/* q = clamp(round(x / scale) + zero_point), ties away from zero as TFLite. */
static int8_t mpt__q_quantize(float x, const mpt_quant_params *p) {
    return mpt__q_clamp8((double)mpt__q_round(x / p->scale) + p->zero_point);
}

/* ---- the operations, from the float model's layers ------------------------------------ */

/* A layer's parameter by its short name ("kernel"), or NULL. */
static mpt__param *mpt__q_layer_param(const mpt__layer *L, const char *name) {
    int k;
    for (k = 0; k < L->n_params; k++) {
        const char *slash = strrchr(L->param[k]->name, '/');
        if (slash && strcmp(slash + 1, name) == 0) return L->param[k];
    }
    return NULL;
}

/* A parameter's float32 master into host memory (a GPU model's too). */
static mpt_status mpt__q_param_read(mpt_model *m, const mpt__param *P, float *dst) {
    if (mpt__model_device(m) == MPT_DEVICE_CPU) {
        memcpy(dst, P->value, sizeof(float) * (size_t)P->count);
        return MPT_OK;
    }
    return mpt__download(m, dst, P->value, sizeof(float) * (size_t)P->count);
}

static mpt__qop *mpt__q_append(mpt__quantized *Q, const mpt__layer *L, mpt_quantized_op kind) {
    mpt__qop *op = &Q->ops[Q->n_ops++];
    memset(op, 0, sizeof *op);
    snprintf(op->name, sizeof op->name, "%s", L->name);
    op->info.name = op->name;
    op->info.op = kind;
    op->info.in_rank = L->in_rank;
    op->info.out_rank = L->out_rank;
    memcpy(op->info.in_shape, L->in_shape, sizeof op->info.in_shape);
    memcpy(op->info.out_shape, L->out_shape, sizeof op->info.out_shape);
    op->in_count = L->in_count;
    op->out_count = L->out_count;
    return op;
}

/* An activation of its own after layer L (a Dense's softmax, an Activation). */
static void mpt__q_append_activation(mpt__quantized *Q, const mpt__layer *L, mpt_activation act) {
    mpt__qop *op = mpt__q_append(Q, L, MPT_QOP_ACTIVATION);
    op->info.in_rank = L->out_rank;
    memcpy(op->info.in_shape, L->out_shape, sizeof op->info.in_shape);
    op->in_count = L->out_count;
    op->info.activation = act;
}

/* Dense or Conv2D: the kernel transposed into (N, K) rows, one per output
   channel, and the bias (zeros without one), checked finite. */
static mpt_status mpt__q_append_weighted(mpt_model *m, mpt__quantized *Q, const mpt__layer *L) {
    int conv = strcmp(L->ops->class_name, "Conv2D") == 0;
    mpt__qop *op = mpt__q_append(Q, L, conv ? MPT_QOP_CONV_2D : MPT_QOP_FULLY_CONNECTED);
    const mpt__param *kernel = mpt__q_layer_param(L, "kernel"), *bias = mpt__q_layer_param(L, "bias");
    mpt_activation act = conv ? L->desc.conv2d.activation : L->desc.dense.activation;
    int64_t N, K, n, k;
    float *host;
    mpt_status s;
    if (conv) {
        const mpt_conv2d_desc *d = &L->desc.conv2d;
        int64_t strides[2];
        strides[0] = d->strides[0] ? d->strides[0] : 1;
        strides[1] = d->strides[1] ? d->strides[1] : 1;
        mpt__win_init(&op->g, L, d->kernel_size, strides, d->padding);
        N = d->filters;
        K = op->g.kh * op->g.kw * op->g.c;
        op->info.kernel_size[0] = op->g.kh;
        op->info.kernel_size[1] = op->g.kw;
        op->info.strides[0] = op->g.sh;
        op->info.strides[1] = op->g.sw;
        op->info.padding = d->padding;
    } else {
        N = L->desc.dense.units;
        K = L->in_count;
    }
    op->info.out_channels = N;
    op->info.depth = K;
    if (K > MPT_QGEMM_MAX_K)
        return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                         "quantize: %s '%s' sums %lld products per output, more than the int8 "
                         "product's %d", L->ops->class_name, L->name, (long long)K,
                         MPT_QGEMM_MAX_K);
    op->w = (float *)mpt__alloc(m->ctx, sizeof(float) * (size_t)(N * K));
    op->bias = (float *)mpt__calloc(m->ctx, sizeof(float) * (size_t)N);
    host = (float *)mpt__alloc(m->ctx, sizeof(float) * (size_t)(N * K));
    if (!op->w || !op->bias || !host) {
        mpt__free(m->ctx, host);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory for '%s'",
                         L->name);
    }
    s = mpt__q_param_read(m, kernel, host); /* (K, N), Keras' layout */
    if (s == MPT_OK && bias) s = mpt__q_param_read(m, bias, op->bias);
    for (k = 0; s == MPT_OK && k < K; k++)
        for (n = 0; n < N; n++) op->w[n * K + k] = host[k * N + n];
    mpt__free(m->ctx, host);
    for (n = 0; s == MPT_OK && n < N * K + N; n++)
        if (!isfinite(n < N * K ? op->w[n] : op->bias[n - N * K]))
            s = mpt__fail(m->ctx, MPT_ERR_NUMERIC, "quantize: %s '%s' holds a %s that is not "
                          "finite", L->ops->class_name, L->name, n < N * K ? "weight" : "bias");
    if (s != MPT_OK) return s;
    if (act == MPT_ACT_NONE || act == MPT_ACT_RELU) op->info.activation = act;
    else mpt__q_append_activation(Q, L, act);
    return MPT_OK;
}

/* BatchNormalization folded into the Dense or Conv2D before it (op):
   w'[c] = w[c]·s[c], b'[c] = (b[c] − mean[c])·s[c] + beta[c], s[c] =
   gamma[c] / sqrt(var[c] + eps), with the layer's own 1/sqrt. */
static mpt_status mpt__q_fold_batchnorm(mpt_model *m, mpt__qop *op, const mpt__layer *L) {
    const mpt__param *gamma = mpt__q_layer_param(L, "gamma"), *beta = mpt__q_layer_param(L, "beta");
    const mpt__param *mean = mpt__q_layer_param(L, "moving_mean");
    const mpt__param *var = mpt__q_layer_param(L, "moving_variance");
    int64_t N = op->info.out_channels, K = op->info.depth, c, k;
    float *v = (float *)mpt__alloc(m->ctx, sizeof(float) * 4 * (size_t)N); /* gamma, beta, mean, var */
    mpt_status s = MPT_OK;
    if (!v) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
    for (c = 0; c < N; c++) v[c] = 1.0f, v[N + c] = 0.0f;
    if (gamma) s = mpt__q_param_read(m, gamma, v);
    if (s == MPT_OK && beta) s = mpt__q_param_read(m, beta, v + N);
    if (s == MPT_OK) s = mpt__q_param_read(m, mean, v + 2 * N);
    if (s == MPT_OK) s = mpt__q_param_read(m, var, v + 3 * N);
    for (c = 0; s == MPT_OK && c < N; c++) {
        float scale = v[c] * mpt__bn_inv_std(v[3 * N + c], mpt__bn_epsilon(L));
        if (!isfinite(scale) || !isfinite(v[N + c]) || !isfinite(v[2 * N + c])) {
            s = mpt__fail(m->ctx, MPT_ERR_NUMERIC, "quantize: BatchNormalization '%s' channel "
                          "%lld is not finite", L->name, (long long)c);
            break;
        }
        for (k = 0; k < K; k++) op->w[c * K + k] *= scale;
        op->bias[c] = (op->bias[c] - v[2 * N + c]) * scale + v[N + c];
    }
    mpt__free(m->ctx, v);
    if (s != MPT_OK) return s;
    snprintf(op->folded, sizeof op->folded, "%s", L->name);
    op->info.folded_batchnorm = op->folded;
    return MPT_OK;
}

static void mpt__q_append_pool(mpt__quantized *Q, const mpt__layer *L, mpt_quantized_op kind) {
    mpt__qop *op = mpt__q_append(Q, L, kind);
    if (kind == MPT_QOP_GLOBAL_AVERAGE_POOL_2D) mpt__global_pool_win(&op->g, L);
    else mpt__pool_win(&op->g, L);
    op->info.kernel_size[0] = op->g.kh;
    op->info.kernel_size[1] = op->g.kw;
    op->info.strides[0] = op->g.sh;
    op->info.strides[1] = op->g.sw;
    op->info.padding = kind == MPT_QOP_GLOBAL_AVERAGE_POOL_2D ? MPT_PADDING_VALID
                                                              : L->desc.pool2d.padding;
}

/* The last operation, if it is a Dense or Conv2D that ends without an
   activation and nothing but Dropout has come since: what a
   BatchNormalization folds into and a ReLU fuses with. */
static mpt__qop *mpt__q_open_product(mpt__quantized *Q, int open) {
    mpt__qop *op = Q->n_ops ? &Q->ops[Q->n_ops - 1] : NULL;
    return open && op && mpt__qop_weighted(op) && op->info.activation == MPT_ACT_NONE ? op : NULL;
}

/* Walks the float model's layers into operations. */
static mpt_status mpt__q_build_ops(mpt_model *m, mpt__quantized *Q) {
    int i, open = 0; /* the last op is a product a BatchNormalization may follow */
    Q->ops = (mpt__qop *)mpt__calloc(m->ctx, sizeof(mpt__qop) * (size_t)(2 * m->n_layers + 1));
    if (!Q->ops) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        const char *cls = L->ops->class_name;
        if (!strcmp(cls, "Dense") || !strcmp(cls, "Conv2D")) {
            MPT__CHECK(mpt__q_append_weighted(m, Q, L));
            open = 1;
            continue;
        }
        if (!strcmp(cls, "Dropout")) continue; /* the identity at inference */
        if (!strcmp(cls, "BatchNormalization")) {
            mpt__qop *op = mpt__q_open_product(Q, open);
            if (!op || op->info.folded_batchnorm)
                return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                                 "quantize: BatchNormalization '%s' does not directly follow a "
                                 "Dense or Conv2D without activation, so it cannot be folded",
                                 L->name);
            MPT__CHECK(mpt__q_fold_batchnorm(m, op, L));
            continue;
        }
        if (!strcmp(cls, "Activation")) {
            mpt_activation act = L->desc.activation.activation;
            mpt__qop *op = mpt__q_open_product(Q, open);
            if (act == MPT_ACT_NONE) continue;
            if (act == MPT_ACT_RELU && op) op->info.activation = MPT_ACT_RELU;
            else mpt__q_append_activation(Q, L, act);
        } else if (!strcmp(cls, "MaxPooling2D")) {
            mpt__q_append_pool(Q, L, MPT_QOP_MAX_POOL_2D);
        } else if (!strcmp(cls, "AveragePooling2D")) {
            mpt__q_append_pool(Q, L, MPT_QOP_AVERAGE_POOL_2D);
        } else if (!strcmp(cls, "GlobalAveragePooling2D")) {
            mpt__q_append_pool(Q, L, MPT_QOP_GLOBAL_AVERAGE_POOL_2D);
        } else if (!strcmp(cls, "Flatten")) {
            mpt__q_append(Q, L, MPT_QOP_RESHAPE);
        } else {
            return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED,
                             "quantize: layer '%s' (%s) has no quantized form", L->name, cls);
        }
        open = 0;
    }
    return MPT_OK;
}

/* The largest buffers one sample needs, for mpt__qwork_alloc. */
static void mpt__q_plan(mpt__quantized *Q, int64_t in_count) {
    int i;
    Q->in_count = Q->max_count = in_count;
    for (i = 0; i < Q->n_ops; i++) {
        const mpt__qop *op = &Q->ops[i];
        Q->max_count = MPT__MAX(Q->max_count, op->out_count);
        if (op->info.op == MPT_QOP_CONV_2D)
            Q->max_cols = MPT__MAX(Q->max_cols, op->g.oh * op->g.ow * op->info.depth);
        if (mpt__qop_weighted(op))
            Q->max_weights = MPT__MAX(Q->max_weights, op->info.out_channels * op->info.depth);
    }
}

/* ---- the batch's work block ------------------------------------------------------------- */

static mpt_status mpt__qwork_alloc(mpt_context *ctx, const mpt__quantized *Q, int64_t batch,
                                   mpt__qwork *w) {
    int64_t per = 0, act, cols, total = 0;
    memset(w, 0, sizeof *w);
    w->batch = batch;
    cols = 4 * MPT__MAX(MPT__Q_COLS_BUDGET, Q->max_cols);
    if (!mpt__mul_ok(batch, Q->max_count, &per) || !mpt__mul_ok(per, 4, &act) ||
        !mpt__mul_ok(act, 6, &total) || !mpt__add_ok(total, cols + 4 * Q->max_weights + 9 * 64,
                                                     &total) ||
        (uint64_t)total > (uint64_t)SIZE_MAX)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "quantized model: batches of %lld samples are "
                         "too large", (long long)batch);
    w->block = mpt__alloc(ctx, (size_t)total);
    if (!w->block)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantized model: cannot allocate %lld bytes "
                         "for a batch of %lld", (long long)total, (long long)batch);
    {
        unsigned char *p = (unsigned char *)w->block;
#define MPT__Q_CARVE(dst, type, bytes) (dst = (type)(void *)p, p += ((bytes) + 63) / 64 * 64)
        MPT__Q_CARVE(w->act[0], void *, act);
        MPT__Q_CARVE(w->act[1], void *, act);
        MPT__Q_CARVE(w->acc, int32_t *, act);
        MPT__Q_CARVE(w->xq, int8_t *, act);
        MPT__Q_CARVE(w->row_scale, float *, act);
        MPT__Q_CARVE(w->sample_scale, float *, 4 * batch);
        MPT__Q_CARVE(w->cols, void *, cols);
        MPT__Q_CARVE(w->weights, float *, 4 * Q->max_weights);
#undef MPT__Q_CARVE
    }
    return MPT_OK;
}

/* =============================================================================
   @impl-quantized-passes  one batch through the operations, in each mode
   =============================================================================

   Each operation writes into one of two buffers of the batch's work block
   in turn. Convolutions run as products over im2col rows, a chunk of
   samples at a time (as Conv2D does). The loops run over the context's
   threads a sample or a few rows a task, each task writing only its own
   outputs, and the products through mpt_gemm/mpt_qgemm, which split their
   work the same way: no result depends on the thread count. */

/* n samples' windows into rows of cols ((n·OH·OW) × (kh·kw·C), elements of
   es bytes); a pixel outside the image is `fill`: 0.0f in float, the
   zero point in int8 (its real value is 0). */
static void mpt__q_im2col(const mpt__win *g, size_t es, const void *fill, const void *x,
                          int64_t n, void *cols) {
    const size_t pixel = (size_t)g->c * es;
    const unsigned char *src = (const unsigned char *)x;
    unsigned char *dst = (unsigned char *)cols;
    int64_t b, oy, ox, i, k, c;
    for (b = 0; b < n; b++)
        for (oy = 0; oy < g->oh; oy++)
            for (ox = 0; ox < g->ow; ox++)
                for (i = 0; i < g->kh; i++) {
                    const int64_t y = oy * g->sh - g->top + i, x0 = ox * g->sw - g->left;
                    const unsigned char *row = src + (size_t)((b * g->h + y) * g->w) * pixel;
                    if (y >= 0 && y < g->h && x0 >= 0 && x0 + g->kw <= g->w) {
                        memcpy(dst, row + (size_t)x0 * pixel, (size_t)g->kw * pixel);
                        dst += (size_t)g->kw * pixel;
                        continue;
                    }
                    for (k = 0; k < g->kw; k++, dst += pixel) {
                        const int64_t xx = x0 + k;
                        if (y >= 0 && y < g->h && xx >= 0 && xx < g->w)
                            memcpy(dst, row + (size_t)xx * pixel, pixel);
                        else
                            for (c = 0; c < g->c; c++) memcpy(dst + (size_t)c * es, fill, es);
                    }
                }
}

/* Max or average pooling of n samples in float32 (padding not counted).
   Each window's pixels are read whole (C contiguous channels) into y,
   row by row: per channel the same order as a loop over the window. */
static void mpt__q_pool_float(const mpt__qop *op, const float *x, float *y, int64_t n) {
    const mpt__win *g = &op->g;
    const int max = op->info.op == MPT_QOP_MAX_POOL_2D;
    int64_t b, oy, ox, c, r, q, r0, r1, c0, c1;
    for (b = 0; b < n; b++, x += g->h * g->w * g->c)
        for (oy = 0; oy < g->oh; oy++)
            for (ox = 0; ox < g->ow; ox++, y += g->c) {
                float *MPT__RESTRICT out = y;
                mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
                for (c = 0; c < g->c; c++) out[c] = max ? -INFINITY : 0.0f;
                for (r = r0; r < r1; r++)
                    for (q = c0; q < c1; q++) {
                        const float *MPT__RESTRICT px = x + (r * g->w + q) * g->c;
                        if (max)
                            for (c = 0; c < g->c; c++) out[c] = px[c] > out[c] ? px[c] : out[c];
                        else
                            for (c = 0; c < g->c; c++) out[c] += px[c];
                    }
                if (!max)
                    for (c = 0; c < g->c; c++) out[c] /= (float)((r1 - r0) * (c1 - c0));
            }
}

/* The same in int8 (input and output share their quantization): the
   average rounded half away from zero, as TFLite's integer AVERAGE_POOL_2D,
   its sums in int32 over channels a block at a time. */
static void mpt__q_pool_int8(const mpt__qop *op, const int8_t *x, int8_t *y, int64_t n) {
    const mpt__win *g = &op->g;
    const int max = op->info.op == MPT_QOP_MAX_POOL_2D;
    int32_t acc[256];
    int64_t b, oy, ox, c, c_end, k, r, q, r0, r1, c0, c1;
    for (b = 0; b < n; b++, x += g->h * g->w * g->c)
        for (oy = 0; oy < g->oh; oy++)
            for (ox = 0; ox < g->ow; ox++, y += g->c) {
                int32_t count;
                mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
                count = (int32_t)((r1 - r0) * (c1 - c0));
                for (c = 0; c < g->c; c = c_end) {
                    c_end = MPT__MIN(c + 256, g->c);
                    for (k = c; k < c_end; k++) acc[k - c] = max ? -128 : 0;
                    for (r = r0; r < r1; r++)
                        for (q = c0; q < c1; q++) {
                            const int8_t *px = x + (r * g->w + q) * g->c;
                            if (max)
                                for (k = c; k < c_end; k++)
                                    acc[k - c] = px[k] > acc[k - c] ? px[k] : acc[k - c];
                            else
                                for (k = c; k < c_end; k++) acc[k - c] += px[k];
                        }
                    for (k = c; k < c_end; k++) {
                        int32_t v = acc[k - c];
                        if (!max) v = v >= 0 ? (v + count / 2) / count : (v - count / 2) / count;
                        y[k] = (int8_t)v;
                    }
                }
            }
}

/* im2col and pooling over the context's threads, one sample a task. */
typedef struct mpt__qsample_job {
    const mpt__qop *op;
    size_t es;                /* bytes of an element: 4, or 1 in int8      */
    const void *fill;         /* im2col: a pixel outside the image          */
    const unsigned char *x;   /* (n, in_count) elements                     */
    unsigned char *y;         /* im2col: (n·OH·OW, K); pooling: (n, out_count) */
} mpt__qsample_job;

static void mpt__q_im2col_task(void *arg, int64_t b, int thread) {
    const mpt__qsample_job *j = (const mpt__qsample_job *)arg;
    const mpt__win *g = &j->op->g;
    (void)thread;
    mpt__q_im2col(g, j->es, j->fill, j->x + (size_t)(b * j->op->in_count) * j->es, 1,
                  j->y + (size_t)(b * g->oh * g->ow * j->op->info.depth) * j->es);
}

static void mpt__q_pool_task(void *arg, int64_t b, int thread) {
    const mpt__qsample_job *j = (const mpt__qsample_job *)arg;
    const size_t in = (size_t)(b * j->op->in_count) * j->es;
    const size_t out = (size_t)(b * j->op->out_count) * j->es;
    (void)thread;
    if (j->es == 1) mpt__q_pool_int8(j->op, (const int8_t *)(j->x + in), (int8_t *)(j->y + out), 1);
    else mpt__q_pool_float(j->op, (const float *)(j->x + in), (float *)(j->y + out), 1);
}

static void mpt__q_each_sample(mpt_context *ctx, mpt__task_fn fn, const mpt__qop *op, size_t es,
                               const void *fill, const void *x, void *y, int64_t n) {
    mpt__qsample_job j;
    j.op = op, j.es = es, j.fill = fill;
    j.x = (const unsigned char *)x;
    j.y = (unsigned char *)y;
    mpt__parallel_for(ctx, n, fn, &j);
}

/* Symmetric int8 of each of `rows` runs of `cols` floats: scale max|x|/127
   (1 for a run of zeros), as TFLite's hybrid kernels quantize per batch row.
   The loops go 16 elements at a time so that -O2 vectorizes them; a run
   holding inf or NaN takes the scalar path, which saturates. */
#define MPT__Q_LANES 16

static float mpt__q_abs_max(const float *MPT__RESTRICT x, int64_t n) {
    float lane[MPT__Q_LANES] = {0}, amax = 0;
    int64_t i = 0, k;
    for (; i + MPT__Q_LANES <= n; i += MPT__Q_LANES)
        for (k = 0; k < MPT__Q_LANES; k++) {
            float a = fabsf(x[i + k]);
            lane[k] = a > lane[k] ? a : lane[k];
        }
    for (k = 0; k < MPT__Q_LANES; k++) amax = lane[k] > amax ? lane[k] : amax;
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

/* round(x·inv) for |x·inv| ≤ 127.5: ties away from zero, as mpt__q_round. */
static int8_t mpt__q_round_small(float v) {
    int32_t i = (int32_t)v;
    float r = v - (float)i;
    i += (r >= 0.5f) - (r <= -0.5f);
    return (int8_t)(i > 127 ? 127 : i < -127 ? -127 : i);
}

static void mpt__q_symmetric_rows(const float *x, int64_t rows, int64_t cols, int8_t *q,
                                  float *scale) {
    int64_t r, c, k;
    for (r = 0; r < rows; r++, x += cols, q += cols) {
        const float *MPT__RESTRICT in = x;
        int8_t *MPT__RESTRICT out = q;
        float amax = mpt__q_abs_max(x, cols), inv;
        scale[r] = amax > 0 ? amax / 127.0f : 1.0f;
        inv = amax > 0 ? 127.0f / amax : 0.0f;
        if (!(amax < INFINITY)) {
            for (c = 0; c < cols; c++) out[c] = mpt__q_clamp8((double)mpt__q_round(in[c] * inv));
            continue;
        }
        for (c = 0; c + MPT__Q_LANES <= cols; c += MPT__Q_LANES)
            for (k = 0; k < MPT__Q_LANES; k++) out[c + k] = mpt__q_round_small(in[c + k] * inv);
        for (; c < cols; c++) out[c] = mpt__q_round_small(in[c] * inv);
    }
}

/* Rows of a dynamic product, MPT__Q_TASK_ROWS a task (each row alone, so
   any thread count gives the same): quantized before it, or dequantized
   after it, y = acc · row_scale · w_scale[c] + bias[c], then ReLU. */
#define MPT__Q_TASK_ROWS 8

typedef struct mpt__qrows_job {
    const mpt__qop *op;
    int64_t rows, cols;
    const float *x;          /* quantize: (rows, cols)                       */
    int8_t *q;               /* quantize: (rows, cols)                       */
    float *scale;            /* quantize: (rows)                             */
    const int32_t *acc;      /* dequantize: (rows, N)                         */
    const float *row_scale;  /* dequantize: (rows)                            */
    float *y;                /* dequantize: (rows, N)                         */
} mpt__qrows_job;

static void mpt__q_quantize_rows_task(void *arg, int64_t task, int thread) {
    const mpt__qrows_job *j = (const mpt__qrows_job *)arg;
    int64_t r0 = task * MPT__Q_TASK_ROWS, n = MPT__MIN(MPT__Q_TASK_ROWS, j->rows - r0);
    (void)thread;
    mpt__q_symmetric_rows(j->x + r0 * j->cols, n, j->cols, j->q + r0 * j->cols, j->scale + r0);
}

static void mpt__q_dequantize_rows_task(void *arg, int64_t task, int thread) {
    const mpt__qrows_job *j = (const mpt__qrows_job *)arg;
    const int64_t N = j->op->info.out_channels;
    const int relu = j->op->info.activation == MPT_ACT_RELU;
    const float *MPT__RESTRICT wscale = j->op->wscale, *MPT__RESTRICT bias = j->op->bias;
    int64_t r, c, r1 = MPT__MIN((task + 1) * MPT__Q_TASK_ROWS, j->rows);
    (void)thread;
    for (r = task * MPT__Q_TASK_ROWS; r < r1; r++) {
        const int32_t *MPT__RESTRICT acc = j->acc + r * N;
        float *MPT__RESTRICT y = j->y + r * N;
        const float s = j->row_scale[r];
        const float lowest = relu ? 0.0f : -INFINITY;
        for (c = 0; c < N; c++) {
            float v = (float)acc[c] * (s * wscale[c]) + bias[c];
            y[c] = v < lowest ? lowest : v;
        }
    }
}

/* mpt__q_symmetric_rows over the context's threads. */
static void mpt__q_symmetric_rows_parallel(mpt_context *ctx, const float *x, int64_t rows,
                                           int64_t cols, int8_t *q, float *scale) {
    mpt__qrows_job j;
    memset(&j, 0, sizeof j);
    j.rows = rows, j.cols = cols, j.x = x, j.q = q, j.scale = scale;
    mpt__parallel_for(ctx, (rows + MPT__Q_TASK_ROWS - 1) / MPT__Q_TASK_ROWS,
                      mpt__q_quantize_rows_task, &j);
}

/* A Dense or Conv2D's product over `rows` rows a (rows × K), into y (rows × N):
   float32 (reference, float16), int8 dequantized with row_scale (dynamic)
   or int8 requantized (integer). */
static mpt_status mpt__q_product(mpt_context *ctx, const mpt__quantized *Q, int i, mpt__qexec ex,
                                 const void *a, int64_t rows, const float *row_scale, void *y,
                                 mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    const int64_t N = op->info.out_channels, K = op->info.depth;
    const int relu = op->info.activation == MPT_ACT_RELU;
    if (ex == MPT__QX_REFERENCE || ex == MPT__QX_FLOAT16) {
        mpt_gemm_desc g;
        memset(&g, 0, sizeof g);
        if (ex == MPT__QX_FLOAT16)
            MPT__CHECK(mpt_convert(ctx, MPT_FLOAT32, w->weights, MPT_FLOAT16, op->wh, N * K));
        g.trans_b = 1;
        g.m = rows, g.n = N, g.k = K;
        g.ab_dtype = MPT_FLOAT32;
        g.a = a, g.lda = K;
        g.b = ex == MPT__QX_FLOAT16 ? w->weights : op->w, g.ldb = K;
        g.c = (float *)y, g.ldc = N;
        g.bias = op->bias;
        g.activation = relu ? MPT_ACT_RELU : MPT_ACT_NONE;
        return mpt_gemm(ctx, &g);
    } else {
        mpt_qgemm_desc d;
        memset(&d, 0, sizeof d);
        d.m = rows, d.n = N, d.k = K;
        d.a = a, d.lda = K;
        d.b = op->wq, d.ldb = K, d.trans_b = 1;
        d.ldc = N;
        if (ex == MPT__QX_DYNAMIC) {
            mpt__qrows_job j;
            d.c = w->acc;
            MPT__CHECK(mpt_qgemm(ctx, &d));
            memset(&j, 0, sizeof j);
            j.op = op, j.rows = rows, j.acc = w->acc, j.row_scale = row_scale, j.y = (float *)y;
            mpt__parallel_for(ctx, (rows + MPT__Q_TASK_ROWS - 1) / MPT__Q_TASK_ROWS,
                              mpt__q_dequantize_rows_task, &j);
            return MPT_OK;
        }
        d.a_zero_point = op->info.input.zero_point;
        d.bias = op->bq;
        d.c_int8 = (int8_t *)y;
        d.multiplier = op->mult, d.shift = op->shift, d.per_channel = 1;
        d.c_zero_point = op->info.output.zero_point;
        d.c_min = relu ? op->info.output.zero_point : -128;
        d.c_max = 127;
        return mpt_qgemm(ctx, &d);
    }
}

static mpt_status mpt__q_fully_connected(mpt_context *ctx, const mpt__quantized *Q, int i,
                                         mpt__qexec ex, const void *x, void *y, int64_t n,
                                         mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    if (ex != MPT__QX_DYNAMIC) return mpt__q_product(ctx, Q, i, ex, x, n, NULL, y, w);
    mpt__q_symmetric_rows_parallel(ctx, (const float *)x, n, op->in_count, w->xq, w->row_scale);
    return mpt__q_product(ctx, Q, i, ex, w->xq, n, w->row_scale, y, w);
}

/* Conv2D: chunks of samples through im2col and the product. Dynamic
   quantizes each sample whole first (one scale per sample, so its zero
   padding stays 0). */
static mpt_status mpt__q_conv(mpt_context *ctx, const mpt__quantized *Q, int i, mpt__qexec ex,
                              const void *x, void *y, int64_t n, mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    const int64_t pix = op->g.oh * op->g.ow, K = op->info.depth, N = op->info.out_channels;
    const int int8_in = ex == MPT__QX_DYNAMIC || ex == MPT__QX_INTEGER;
    const size_t es = int8_in ? 1 : 4, out_es = ex == MPT__QX_INTEGER ? 1 : 4;
    const float zero = 0.0f;
    const int8_t zp = (int8_t)(ex == MPT__QX_INTEGER ? op->info.input.zero_point : 0);
    int64_t chunk = MPT__MAX(1, MPT__MIN(n, MPT__Q_COLS_BUDGET / MPT__MAX(pix * K, 1))), b0;
    float *sample_scale = w->sample_scale;
    if (ex == MPT__QX_DYNAMIC) {
        mpt__q_symmetric_rows_parallel(ctx, (const float *)x, n, op->in_count, w->xq, sample_scale);
        x = w->xq;
    }
    for (b0 = 0; b0 < n; b0 += chunk) {
        int64_t cb = MPT__MIN(chunk, n - b0), r;
        mpt__q_each_sample(ctx, mpt__q_im2col_task, op, es,
                           int8_in ? (const void *)&zp : (const void *)&zero,
                           (const unsigned char *)x + (size_t)(b0 * op->in_count) * es, w->cols, cb);
        if (ex == MPT__QX_DYNAMIC)
            for (r = 0; r < cb * pix; r++) w->row_scale[r] = sample_scale[b0 + r / pix];
        MPT__CHECK(mpt__q_product(ctx, Q, i, ex, w->cols, cb * pix, w->row_scale,
                                  (unsigned char *)y + (size_t)(b0 * pix * N) * out_es, w));
    }
    return MPT_OK;
}

/* Softmax of int8 logits as TFLite's: exp of each logit's distance to its
   row's largest from a table, the row's sum, and p·256 − 128 rounded. */
static void mpt__q_softmax_int8(const mpt__qop *op, const int8_t *x, int8_t *y, int64_t rows,
                                int64_t cols) {
    int64_t r, c;
    for (r = 0; r < rows; r++, x += cols, y += cols) {
        int max = -128;
        float sum = 0, inv;
        for (c = 0; c < cols; c++) max = x[c] > max ? x[c] : max;
        for (c = 0; c < cols; c++) sum += op->exp_table[max - x[c]];
        inv = 256.0f / sum;
        for (c = 0; c < cols; c++)
            y[c] = mpt__q_clamp8((double)mpt__q_round(op->exp_table[max - x[c]] * inv) - 128.0);
    }
}

/* Operation i on n samples: x in, y out (float32, or int8 in integer). */
static mpt_status mpt__q_run_op(mpt_context *ctx, const mpt__quantized *Q, int i, mpt__qexec ex,
                                const void *x, void *y, int64_t n, mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    const int integer = ex == MPT__QX_INTEGER;
    const size_t es = integer ? 1 : 4;
    int64_t k, count = n * op->out_count;
    switch (op->info.op) {
    case MPT_QOP_FULLY_CONNECTED: return mpt__q_fully_connected(ctx, Q, i, ex, x, y, n, w);
    case MPT_QOP_CONV_2D: return mpt__q_conv(ctx, Q, i, ex, x, y, n, w);
    case MPT_QOP_MAX_POOL_2D:
    case MPT_QOP_AVERAGE_POOL_2D:
    case MPT_QOP_GLOBAL_AVERAGE_POOL_2D:
        mpt__q_each_sample(ctx, mpt__q_pool_task, op, es, NULL, x, y, n);
        return MPT_OK;
    case MPT_QOP_RESHAPE: memcpy(y, x, (size_t)count * es); return MPT_OK;
    case MPT_QOP_ACTIVATION: {
        const int64_t cols = op->info.out_shape[op->info.out_rank - 1];
        if (integer && op->info.activation == MPT_ACT_SOFTMAX) {
            mpt__q_softmax_int8(op, (const int8_t *)x, (int8_t *)y, count / cols, cols);
        } else if (integer) {
            for (k = 0; k < count; k++) ((int8_t *)y)[k] = op->lut[((const int8_t *)x)[k] + 128];
        } else {
            memcpy(y, x, (size_t)count * 4);
            if (op->info.activation == MPT_ACT_SOFTMAX) mpt__softmax_rows((float *)y, count / cols, cols);
            else mpt__activation_forward(op->info.activation, (float *)y, count);
        }
        return MPT_OK;
    }
    default: return mpt__fail(ctx, MPT_ERR_STATE, "quantized model: unknown operation %d",
                              (int)op->info.op);
    }
}

/* Calibration's record: each tensor's range, then its histogram. */
typedef struct mpt__qcalib {
    float *lo, *hi;      /* [n_ops + 1] */
    int64_t *hist;       /* [n_ops + 1][MPT__Q_HIST_BINS]; NULL in the min/max pass */
} mpt__qcalib;

static void mpt__q_observe(mpt__qcalib *c, int t, const float *v, int64_t n) {
    int64_t k;
    if (!c->hist) {
        for (k = 0; k < n; k++) {
            c->lo[t] = v[k] < c->lo[t] ? v[k] : c->lo[t];
            c->hi[t] = v[k] > c->hi[t] ? v[k] : c->hi[t];
        }
        return;
    }
    {
        int64_t *h = c->hist + (size_t)t * MPT__Q_HIST_BINS;
        double width = ((double)c->hi[t] - c->lo[t]) / MPT__Q_HIST_BINS;
        for (k = 0; k < n; k++) {
            int64_t bin = width > 0 ? (int64_t)((v[k] - c->lo[t]) / width) : 0;
            h[MPT__MAX(0, MPT__MIN(MPT__Q_HIST_BINS - 1, bin))]++;
        }
    }
}

/* n samples through every operation: returns the last output (x itself
   when there is none). The integer pass reads int8 x. With calib, every
   tensor is observed (reference only). */
static mpt_status mpt__q_forward(mpt_context *ctx, const mpt__quantized *Q, mpt__qexec ex,
                                 const void *x, int64_t n, mpt__qwork *w, mpt__qcalib *calib,
                                 const void **out) {
    const void *cur = x;
    int i;
    if (calib) mpt__q_observe(calib, 0, (const float *)x, n * Q->in_count);
    for (i = 0; i < Q->n_ops; i++) {
        void *y = w->act[i & 1];
        if (cur == y) y = w->act[(i + 1) & 1];
        MPT__CHECK(mpt__q_run_op(ctx, Q, i, ex, cur, y, n, w));
        if (calib) mpt__q_observe(calib, i + 1, (const float *)y, n * Q->ops[i].out_count);
        cur = y;
    }
    *out = cur;
    return MPT_OK;
}

static mpt__qexec mpt__q_exec(const mpt__quantized *Q) {
    return Q->mode == MPT_QUANTIZE_FULL_INTEGER ? MPT__QX_INTEGER
           : Q->mode == MPT_QUANTIZE_FLOAT16    ? MPT__QX_FLOAT16
                                                : MPT__QX_DYNAMIC;
}

static int64_t mpt__q_out_count(const mpt__quantized *Q) {
    return Q->n_ops ? Q->ops[Q->n_ops - 1].out_count : Q->in_count;
}

/* (n, one output's shape...) into shape; returns its rank. */
static int mpt__q_batch_shape(const mpt_model *m, int64_t n, int64_t *shape) {
    const mpt__quantized *Q = m->quantized;
    int rank = Q->n_ops ? Q->ops[Q->n_ops - 1].info.out_rank : m->desc.input_rank;
    shape[0] = n;
    memcpy(shape + 1, Q->n_ops ? Q->ops[Q->n_ops - 1].info.out_shape : m->desc.input_shape,
           sizeof(int64_t) * (size_t)rank);
    return rank + 1;
}

/* The model's float32 input quantized into int8, MPT__Q_TASK_ROWS samples a task. */
typedef struct mpt__qinput_job {
    const float *x;
    int8_t *q;
    int64_t n, count;            /* samples, elements of one */
    const mpt_quant_params *p;
} mpt__qinput_job;

static void mpt__q_quantize_input_task(void *arg, int64_t task, int thread) {
    const mpt__qinput_job *j = (const mpt__qinput_job *)arg;
    int64_t k = task * MPT__Q_TASK_ROWS * j->count;
    const int64_t end = MPT__MIN(task * MPT__Q_TASK_ROWS + MPT__Q_TASK_ROWS, j->n) * j->count;
    (void)thread;
    for (; k < end; k++) j->q[k] = mpt__q_quantize(j->x[k], j->p);
}

/* n float32 samples to n float32 outputs, whatever the mode: the integer
   pass quantizes at the start and dequantizes at the end. */
static mpt_status mpt__q_run_float(mpt_context *ctx, const mpt__quantized *Q, const float *x,
                                   int64_t n, float *y, mpt__qwork *w) {
    const void *out;
    int64_t k, count = n * mpt__q_out_count(Q);
    if (Q->mode != MPT_QUANTIZE_FULL_INTEGER) {
        MPT__CHECK(mpt__q_forward(ctx, Q, mpt__q_exec(Q), x, n, w, NULL, &out));
        memcpy(y, out, sizeof(float) * (size_t)count);
        return MPT_OK;
    }
    {
        const mpt_quant_params *in = &Q->tensor[0], *o = &Q->tensor[Q->n_ops];
        mpt__qinput_job j;
        int8_t *xq = (int8_t *)w->act[1]; /* op 0 writes act[0] */
        j.x = x, j.q = xq, j.n = n, j.count = Q->in_count, j.p = in;
        mpt__parallel_for(ctx, (n + MPT__Q_TASK_ROWS - 1) / MPT__Q_TASK_ROWS,
                          mpt__q_quantize_input_task, &j);
        MPT__CHECK(mpt__q_forward(ctx, Q, MPT__QX_INTEGER, xq, n, w, NULL, &out));
        for (k = 0; k < count; k++)
            y[k] = (float)(((const int8_t *)out)[k] - o->zero_point) * o->scale;
    }
    return MPT_OK;
}

/* =============================================================================
   @impl-quantized-model  calibration, mpt_model_quantize, and the quantized
   model's predict, evaluate, invoke and summary
   ============================================================================= */

/* ---- calibration and the int8 parameters -------------------------------------------------- */

/* The percentile p's value (and 100 − p's) of tensor t from its histogram. */
static void mpt__q_percentile_range(const mpt__qcalib *c, int t, double p, float *lo, float *hi) {
    const int64_t *h = c->hist + (size_t)t * MPT__Q_HIST_BINS;
    double width = ((double)c->hi[t] - c->lo[t]) / MPT__Q_HIST_BINS, total = 0, run = 0;
    int b, first = 0, last = MPT__Q_HIST_BINS - 1;
    for (b = 0; b < MPT__Q_HIST_BINS; b++) total += (double)h[b];
    for (b = 0; b < MPT__Q_HIST_BINS; b++) {
        run += (double)h[b];
        if (run > total * (1.0 - p / 100.0)) { first = b; break; }
    }
    for (run = 0, b = MPT__Q_HIST_BINS - 1; b >= 0; b--) {
        run += (double)h[b];
        if (run > total * (1.0 - p / 100.0)) { last = b; break; }
    }
    *lo = (float)(c->lo[t] + width * first);
    *hi = (float)(c->lo[t] + width * (last + 1));
}

/* Every tensor's range finite (a weight large enough overflows a sum). */
static mpt_status mpt__q_ranges_finite(mpt_context *ctx, const mpt__quantized *Q,
                                       const float *lo, const float *hi) {
    int t;
    for (t = 0; t <= Q->n_ops; t++)
        if (!isfinite(lo[t]) || !isfinite(hi[t]))
            return mpt__fail(ctx, MPT_ERR_NUMERIC, "quantize: calibration met a value that is "
                             "not finite in the %s%s%s", t ? "output of '" : "model's input",
                             t ? Q->ops[t - 1].name : "", t ? "'" : "");
    return MPT_OK;
}

/* Runs the folded float32 model over the calibration samples (twice for a
   percentile: the range, then the histograms over it) into each tensor's
   range. */
static mpt_status mpt__q_calibrate(mpt_model *m, mpt__quantized *Q, const mpt_quantize_desc *d,
                                   float *lo, float *hi) {
    mpt_context *ctx = m->ctx;
    int64_t n = mpt_dataset_count(d->representative_data), *order = NULL, k;
    int passes = d->calibration == MPT_CALIBRATION_PERCENTILE ? 2 : 1, pass, t;
    int64_t batch = d->batch_size;
    mpt__qcalib c;
    mpt__qwork w;
    mpt__loader *loader = NULL;
    mpt_status s;
    if (d->calibration_samples > 0) n = MPT__MIN(n, d->calibration_samples);
    batch = MPT__MIN(batch, n);
    memset(&c, 0, sizeof c);
    c.lo = lo, c.hi = hi;
    for (t = 0; t <= Q->n_ops; t++) lo[t] = INFINITY, hi[t] = -INFINITY;
    s = mpt__qwork_alloc(ctx, Q, batch, &w);
    order = (int64_t *)mpt__alloc(ctx, sizeof(int64_t) * (size_t)n);
    if (s == MPT_OK && !order) s = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
    if (s == MPT_OK) s = mpt__loader_create(ctx, d->representative_data, batch, MPT_FLOAT32, &loader);
    for (k = 0; s == MPT_OK && k < n; k++) order[k] = k;
    for (pass = 0; s == MPT_OK && pass < passes; pass++) {
        mpt_tensor x, y;
        if (pass == 1) { /* the histograms need finite ranges to lay their bins over */
            s = mpt__q_ranges_finite(ctx, Q, lo, hi);
            if (s != MPT_OK) break;
            c.hist = (int64_t *)mpt__calloc(ctx, sizeof(int64_t) * MPT__Q_HIST_BINS *
                                                     (size_t)(Q->n_ops + 1));
            if (!c.hist) { s = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory"); break; }
        }
        mpt__loader_start_epoch(loader, order, n, batch);
        while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
            const void *out;
            s = mpt__q_forward(ctx, Q, MPT__QX_REFERENCE, x.data, x.shape[0], &w, &c, &out);
        }
    }
    if (s == MPT_OK) s = mpt__q_ranges_finite(ctx, Q, lo, hi);
    for (t = 0; s == MPT_OK && c.hist && t <= Q->n_ops; t++)
        mpt__q_percentile_range(&c, t, d->percentile, &lo[t], &hi[t]);
    mpt__free(ctx, c.hist);
    mpt__loader_destroy(loader);
    mpt__free(ctx, order);
    mpt__free(ctx, w.block);
    return s;
}

/* Symmetric per-channel int8 weights: scale max|w[c]|/127 (1 for a
   channel of zeros), q in [−127, 127]. */
static mpt_status mpt__q_weights_int8(mpt_context *ctx, mpt__qop *op) {
    int64_t N = op->info.out_channels, K = op->info.depth;
    op->wq = (int8_t *)mpt__alloc(ctx, (size_t)(N * K));
    op->wscale = (float *)mpt__alloc(ctx, sizeof(float) * (size_t)N);
    if (!op->wq || !op->wscale)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory for '%s'", op->name);
    mpt__q_symmetric_rows(op->w, N, K, op->wq, op->wscale); /* ±127: −128 never appears */
    op->info.weights = op->wq;
    op->info.weight_scales = op->wscale;
    return MPT_OK;
}

/* Full integer: int32 biases (scale in·w[c], ties away from zero,
   saturated) and the multipliers of in·w[c]/out. */
static mpt_status mpt__q_integer_product(mpt_context *ctx, mpt__qop *op) {
    int64_t N = op->info.out_channels, c;
    const mpt_quant_params *in = &op->info.input, *out = &op->info.output;
    op->bq = (int32_t *)mpt__alloc(ctx, sizeof(int32_t) * (size_t)N);
    op->mult = (int32_t *)mpt__alloc(ctx, sizeof(int32_t) * (size_t)N);
    op->shift = (int32_t *)mpt__alloc(ctx, sizeof(int32_t) * (size_t)N);
    if (!op->bq || !op->mult || !op->shift)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory for '%s'", op->name);
    for (c = 0; c < N; c++) {
        double bs = (double)in->scale * op->wscale[c], q = round((double)op->bias[c] / bs);
        op->bq[c] = (int32_t)(q > INT32_MAX ? INT32_MAX : q < INT32_MIN ? INT32_MIN : q);
        if (mpt_quantize_multiplier(ctx, bs / out->scale, &op->mult[c], &op->shift[c]) != MPT_OK)
            return mpt__fail(ctx, MPT_ERR_NUMERIC, "quantize: '%s' channel %lld: the output "
                             "scale ratio %g has no int32 multiplier", op->name, (long long)c,
                             bs / out->scale);
    }
    op->info.bias_int32 = op->bq;
    op->info.multiplier = op->mult;
    op->info.shift = op->shift;
    return MPT_OK;
}

/* Full integer activations: a table from every int8 input to its output. */
static void mpt__q_integer_activation(mpt__qop *op) {
    const mpt_quant_params *in = &op->info.input, *out = &op->info.output;
    int q;
    for (q = -128; q < 128; q++) {
        float v = (float)(q - in->zero_point) * in->scale;
        op->exp_table[q + 128] = expf(-in->scale * (float)(q + 128));
        mpt__activation_forward(op->info.activation == MPT_ACT_SOFTMAX ? MPT_ACT_NONE
                                                                       : op->info.activation, &v, 1);
        op->lut[q + 128] = mpt__q_quantize(v, out);
    }
}

/* Every tensor's quantization from its range, then what each operation
   needs in integer. */
static mpt_status mpt__q_make_integer(mpt_context *ctx, mpt__quantized *Q, const float *lo,
                                      const float *hi) {
    int i;
    Q->tensor[0] = mpt__q_params(lo[0], hi[0]);
    for (i = 0; i < Q->n_ops; i++) {
        mpt__qop *op = &Q->ops[i];
        mpt_activation act = op->info.activation;
        mpt_quant_params *out = &Q->tensor[i + 1];
        if (mpt__qop_passes_params(op)) *out = Q->tensor[i];
        else if (op->info.op == MPT_QOP_ACTIVATION && (act == MPT_ACT_SOFTMAX || act == MPT_ACT_SIGMOID))
            *out = mpt__q_fixed_params(1.0f / 256, -128);
        else if (op->info.op == MPT_QOP_ACTIVATION && act == MPT_ACT_TANH)
            *out = mpt__q_fixed_params(1.0f / 128, 0);
        else *out = mpt__q_params(lo[i + 1], hi[i + 1]);
        op->info.input = Q->tensor[i];
        op->info.output = *out;
        if (mpt__qop_weighted(op)) MPT__CHECK(mpt__q_integer_product(ctx, op));
        if (op->info.op == MPT_QOP_ACTIVATION) mpt__q_integer_activation(op);
    }
    return MPT_OK;
}

/* The weights in the mode's form; the float32 copies go (float16 and
   dynamic keep the float32 bias). */
static mpt_status mpt__q_store_weights(mpt_context *ctx, mpt__quantized *Q) {
    int i;
    for (i = 0; i < Q->n_ops; i++) {
        mpt__qop *op = &Q->ops[i];
        int64_t NK = op->info.out_channels * op->info.depth, N = op->info.out_channels;
        if (!mpt__qop_weighted(op)) continue;
        if (Q->mode == MPT_QUANTIZE_FLOAT16) {
            op->wh = (mpt_half *)mpt__alloc(ctx, sizeof(mpt_half) * (size_t)NK);
            if (!op->wh) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
            MPT__CHECK(mpt_convert(ctx, MPT_FLOAT16, op->wh, MPT_FLOAT32, op->w, NK));
            op->info.weights_float16 = op->wh;
            Q->size_bytes += 2 * NK + 4 * N;
        } else {
            MPT__CHECK(mpt__q_weights_int8(ctx, op));
            Q->size_bytes += NK + 8 * N; /* int8 weights, a scale and a bias per channel */
        }
        if (Q->mode != MPT_QUANTIZE_FULL_INTEGER) op->info.bias = op->bias;
    }
    return MPT_OK;
}

static void mpt__q_drop_float_weights(mpt_context *ctx, mpt__quantized *Q) {
    int i;
    for (i = 0; i < Q->n_ops; i++) {
        mpt__free(ctx, Q->ops[i].w);
        Q->ops[i].w = NULL;
    }
}

/* ---- quantize ------------------------------------------------------------------------------ */

static mpt_status mpt__quantize_check(mpt_model *m, mpt_quantize_desc *d) {
    mpt_context *ctx = m->ctx;
    if (d->mode < 0 || d->mode >= MPT_QUANTIZE_MODE_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: unknown mode %d", (int)d->mode);
    if (d->calibration < 0 || d->calibration >= MPT_CALIBRATION_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: unknown calibration %d",
                         (int)d->calibration);
    if (d->percentile == 0) d->percentile = 99.99;
    if (!(d->percentile >= 50 && d->percentile <= 100))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: percentile %g is not in "
                         "[50, 100]", d->percentile);
    if (d->batch_size == 0) d->batch_size = MPT__DEFAULT_BATCH_SIZE;
    if (d->batch_size < 0 || d->calibration_samples < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: %s %lld is negative",
                         d->batch_size < 0 ? "batch_size" : "calibration_samples",
                         (long long)(d->batch_size < 0 ? d->batch_size : d->calibration_samples));
    if (d->io_dtype == MPT_DTYPE_DEFAULT) d->io_dtype = MPT_FLOAT32;
    if (d->io_dtype != MPT_FLOAT32 && d->io_dtype != MPT_INT8 && d->io_dtype != MPT_UINT8)
        return mpt__fail(ctx, MPT_ERR_DTYPE, "quantize: io_dtype %s is not float32, int8 or "
                         "uint8", mpt_dtype_name(d->io_dtype));
    if (d->io_dtype != MPT_FLOAT32 && d->mode != MPT_QUANTIZE_FULL_INTEGER)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: io_dtype %s needs the "
                         "full-integer mode", mpt_dtype_name(d->io_dtype));
    if (m->quantized)
        return mpt__fail(ctx, MPT_ERR_STATE, "quantize: the model is quantized already");
    if (!m->built || m->n_layers == 0)
        return mpt__fail(ctx, MPT_ERR_STATE, "quantize: the model is not built: build it and "
                         "train it (mpt_model_fit) or load its weights first");
    if (m->optimizer_steps == 0 && !m->weights_given)
        return mpt__fail(ctx, MPT_ERR_STATE, "quantize: the model holds its initial weights: "
                         "train it (mpt_model_fit) or load its weights (mpt_model_load_weights) "
                         "first");
    if (d->mode != MPT_QUANTIZE_FULL_INTEGER) return MPT_OK;
    if (!d->representative_data)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: full integer needs "
                         "representative_data, the samples that calibrate the ranges");
    if (mpt_dataset_count(d->representative_data) == 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: representative_data is empty");
    return mpt__check_samples(m, d->representative_data, "quantize: representative_data");
}

/* The quantized model's own: its operations and tensors. */
static mpt_status mpt__quantize_build(mpt_model *m, const mpt_quantize_desc *d,
                                      mpt__quantized *Q) {
    float *range = NULL;
    mpt_status s;
    Q->mode = d->mode;
    Q->io_dtype = d->io_dtype;
    MPT__CHECK(mpt__q_build_ops(m, Q));
    mpt__q_plan(Q, m->layers[0].in_count);
    Q->tensor = (mpt_quant_params *)mpt__calloc(m->ctx, sizeof(mpt_quant_params) *
                                                            (size_t)(Q->n_ops + 1));
    if (!Q->tensor) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
    s = mpt__q_store_weights(m->ctx, Q);
    if (s == MPT_OK && d->mode == MPT_QUANTIZE_FULL_INTEGER) {
        range = (float *)mpt__alloc(m->ctx, sizeof(float) * 2 * (size_t)(Q->n_ops + 1));
        if (!range) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
        if (s == MPT_OK) s = mpt__q_calibrate(m, Q, d, range, range + Q->n_ops + 1);
        if (s == MPT_OK) s = mpt__q_make_integer(m->ctx, Q, range, range + Q->n_ops + 1);
        mpt__free(m->ctx, range);
    }
    mpt__q_drop_float_weights(m->ctx, Q);
    return s;
}

MPTDEF mpt_status mpt_model_quantize(mpt_model *m, const mpt_quantize_desc *desc,
                                     mpt_model **out) {
    mpt_quantize_desc d;
    mpt_model_desc md;
    mpt__quantized *Q;
    mpt_model *q = NULL;
    mpt_status s;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "quantize: NULL out");
    *out = NULL;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc; /* NULL: every default (dynamic-range) */
    MPT__CHECK(mpt__quantize_check(m, &d));
    Q = (mpt__quantized *)mpt__calloc(m->ctx, sizeof *Q);
    if (!Q) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "quantize: out of memory");
    s = mpt__quantize_build(m, &d, Q);
    md = m->desc;
    md.policy = MPT_POLICY_FLOAT32;
    md.strategy = NULL;
    md.memory_limit = 0;
    if (s == MPT_OK) s = mpt_model_create(m->ctx, &md, &q);
    if (s != MPT_OK) {
        mpt__quantized_free(m->ctx, Q);
        return s;
    }
    q->quantized = Q;
    q->compiled = m->compiled;
    q->compile = m->compile;
    *out = q;
    return MPT_OK;
}

/* ---- predict, evaluate, invoke -------------------------------------------------------------- */

static mpt_status mpt__quantized_predict(mpt_model *m, const mpt_dataset *data,
                                         int64_t batch_size, mpt_tensor *out) {
    const mpt__quantized *Q = m->quantized;
    int64_t n, shape[MPT_MAX_RANK], per = mpt__q_out_count(Q), done = 0, *order, k;
    mpt__loader *loader = NULL;
    mpt__qwork w;
    mpt_tensor x, y;
    mpt_status s;
    if (!data || !out)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "predict: NULL %s",
                         data ? "out" : "data");
    memset(out, 0, sizeof *out);
    batch_size = mpt__batch_size_or_default(batch_size);
    if (batch_size < 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "predict: batch_size %lld must be > 0",
                         (long long)batch_size);
    MPT__CHECK(mpt__check_samples(m, data, "predict"));
    n = mpt_dataset_count(data);
    MPT__CHECK(mpt_tensor_alloc(m->ctx, out, MPT_FLOAT32, mpt__q_batch_shape(m, n, shape), shape));
    batch_size = MPT__MAX(1, MPT__MIN(batch_size, n));
    s = mpt__qwork_alloc(m->ctx, Q, batch_size, &w);
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)(n + 1));
    if (s == MPT_OK && !order) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "predict: out of memory");
    for (k = 0; s == MPT_OK && k < n; k++) order[k] = k;
    if (s == MPT_OK) s = mpt__loader_create(m->ctx, data, batch_size, MPT_FLOAT32, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch_size);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        s = mpt__q_run_float(m->ctx, Q, (const float *)x.data, x.shape[0],
                             (float *)out->data + done * per, &w);
        done += x.shape[0];
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    mpt__free(m->ctx, w.block);
    if (s != MPT_OK) mpt_tensor_free(m->ctx, out);
    return s;
}

/* Accuracy and top-k of one batch's outputs (rows × classes) against
   class ids or float targets, added to t. */
static void mpt__q_tally_batch(const mpt_model *m, const float *p, int64_t rows, int64_t classes,
                               const mpt_tensor *target, mpt__tally *t) {
    int64_t r, c;
    for (r = 0; r < rows; r++, p += classes) {
        int64_t best = 0, label, above = 0;
        for (c = 1; c < classes; c++) best = p[c] > p[best] ? c : best;
        if (target->dtype == MPT_INT32) {
            label = ((const int32_t *)target->data)[r];
        } else {
            const float *tr = (const float *)target->data + r * classes;
            for (label = 0, c = 1; c < classes; c++) label = tr[c] > tr[label] ? c : label;
        }
        if (label < 0 || label >= classes) continue;
        t->correct += best == label;
        for (c = 0; c < classes; c++) above += p[c] > p[label];
        t->top_k += above < m->compile.top_k;
    }
}

static mpt_status mpt__quantized_evaluate(mpt_model *m, const mpt_dataset *data,
                                          const mpt_evaluate_desc *desc, mpt_logs *logs) {
    const mpt__quantized *Q = m->quantized;
    int64_t n, batch, per = mpt__q_out_count(Q), *order, k;
    mpt__loader *loader = NULL;
    mpt__qwork w;
    mpt__tally t;
    float *pred;
    mpt_tensor x, y;
    mpt_status s;
    if (!data || !logs)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "evaluate: NULL %s",
                         !data ? "data" : "logs");
    memset(logs, 0, sizeof *logs);
    memset(&t, 0, sizeof t);
    if (!m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "evaluate: compile the model first (quantizing a "
                         "compiled model keeps its loss and metrics)");
    batch = mpt__batch_size_or_default(desc ? desc->batch_size : 0);
    if (batch < 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "evaluate: batch_size %lld must be > 0",
                         (long long)batch);
    MPT__CHECK(mpt__check_samples(m, data, "evaluate"));
    n = mpt_dataset_count(data);
    batch = MPT__MAX(1, MPT__MIN(batch, n));
    s = mpt__qwork_alloc(m->ctx, Q, batch, &w);
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)(n + 1));
    pred = (float *)mpt__alloc(m->ctx, sizeof(float) * (size_t)(batch * per));
    if (s == MPT_OK && (!order || !pred))
        s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "evaluate: out of memory");
    for (k = 0; s == MPT_OK && k < n; k++) order[k] = k;
    if (s == MPT_OK) s = mpt__loader_create(m->ctx, data, batch, MPT_FLOAT32, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        mpt_tensor p;
        double loss = 0;
        int64_t b = x.shape[0], shape[MPT_MAX_RANK];
        int rank = mpt__q_batch_shape(m, b, shape);
        s = mpt__q_run_float(m->ctx, Q, (const float *)x.data, b, pred, &w);
        if (s == MPT_OK) s = mpt_tensor_wrap(m->ctx, &p, MPT_FLOAT32, rank, shape, pred);
        if (s == MPT_OK) s = mpt_loss_compute(m->ctx, &m->compile.loss, &p, &y, &loss, NULL);
        if (s != MPT_OK) break;
        t.loss_sum += loss * (double)b;
        t.samples += b;
        mpt__q_tally_batch(m, pred, b, per, &y, &t);
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    mpt__free(m->ctx, pred);
    mpt__free(m->ctx, w.block);
    if (s == MPT_OK) mpt__tally_logs(m, &t, 0, logs);
    return s;
}

/* mpt_model_summary of a quantized model: its mode, then per operation
   the float layer it came from, its output shape and its quantization. */
static size_t mpt__quantized_summary(const mpt_model *m, char *buf, size_t size) {
    static const char *const mode[] = {"dynamic-range", "full integer", "float16"};
    static const char *const op_name[] = {"FULLY_CONNECTED", "CONV_2D", "MAX_POOL_2D",
                                          "AVERAGE_POOL_2D", "MEAN", "RESHAPE", "ACTIVATION"};
    const mpt__quantized *Q = m->quantized;
    size_t used = 0;
    int i;
    char shape[96];
    mpt__append(buf, size, &used, "Model: \"quantized\" (%s, input and output %s)\n",
                mode[Q->mode], mpt_dtype_name(Q->io_dtype));
    mpt__append(buf, size, &used, "%-18s %-28s %-18s %s\n", "Operation", "Layer",
                "Output Shape", Q->mode == MPT_QUANTIZE_FULL_INTEGER ? "Output (scale, zero point)"
                                                                    : "");
    for (i = 0; i < Q->n_ops; i++) {
        const mpt_quantized_layer *L = &Q->ops[i].info;
        char layer[96];
        snprintf(layer, sizeof layer, "%s%s%s%s%s", L->name,
                 L->folded_batchnorm ? " + " : "",
                 L->folded_batchnorm ? L->folded_batchnorm : "",
                 L->activation != MPT_ACT_NONE ? " " : "",
                 L->activation != MPT_ACT_NONE ? mpt_activation_name(L->activation) : "");
        mpt__append(buf, size, &used, "%-18s %-28s (None, %-11s", op_name[L->op], layer,
                    mpt_shape_format(shape, sizeof shape, L->out_rank, L->out_shape) + 1);
        if (Q->mode == MPT_QUANTIZE_FULL_INTEGER)
            mpt__append(buf, size, &used, " %.6g, %d", (double)L->output.scale,
                        (int)L->output.zero_point);
        mpt__append(buf, size, &used, "\n");
    }
    mpt__append(buf, size, &used, "Weights as stored: %lld bytes\n", (long long)Q->size_bytes);
    return used;
}

/* The model's input or output quantization in io_dtype: uint8's zero
   point is int8's + 128 (the same reals, shifted codes). */
static mpt_quant_params mpt__q_io_params(const mpt__quantized *Q, int output) {
    mpt_quant_params p = Q->tensor[output ? Q->n_ops : 0];
    if (Q->io_dtype == MPT_UINT8) p.zero_point += 128;
    return p;
}

MPTDEF mpt_status mpt_model_quantized_info(const mpt_model *m, mpt_quantized_info *out) {
    const mpt__quantized *Q;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "quantized_info: NULL out");
    memset(out, 0, sizeof *out);
    if (!m->quantized)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "quantized_info: the model is not quantized");
    Q = m->quantized;
    out->mode = Q->mode;
    out->io_dtype = Q->io_dtype;
    if (Q->mode == MPT_QUANTIZE_FULL_INTEGER) {
        out->input = mpt__q_io_params(Q, 0);
        out->output = mpt__q_io_params(Q, 1);
    }
    out->n_layers = Q->n_ops;
    out->size_bytes = Q->size_bytes;
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_quantized_layer(const mpt_model *m, int index,
                                            mpt_quantized_layer *out) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "quantized_layer: NULL out");
    memset(out, 0, sizeof *out);
    if (!m->quantized)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "quantized_layer: the model is not quantized");
    if (index < 0 || index >= m->quantized->n_ops)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "quantized_layer: %d is not in 0..%d",
                         index, m->quantized->n_ops - 1);
    *out = m->quantized->ops[index].info;
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_quantized_invoke(mpt_model *m, const mpt_tensor *x, mpt_tensor *y) {
    const mpt__quantized *Q;
    int64_t n, k, shape[MPT_MAX_RANK], count;
    mpt__qwork w;
    const void *out = NULL;
    mpt_status s;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!x || !y || !x->data)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "quantized_invoke: NULL %s",
                         !y ? "y" : "x");
    memset(y, 0, sizeof *y);
    if (!m->quantized)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "quantized_invoke: the model is not quantized");
    Q = m->quantized;
    if (x->dtype != Q->io_dtype)
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "quantized_invoke: input dtype %s, but the "
                         "model takes %s", mpt_dtype_name(x->dtype), mpt_dtype_name(Q->io_dtype));
    if (x->rank < 2 || x->shape[0] < 1)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "quantized_invoke: input rank %d is not (batch, "
                         "sample...)", x->rank);
    MPT__CHECK(mpt__check_sample_shape(m, x->rank - 1, x->shape + 1, "quantized_invoke"));
    n = x->shape[0];
    count = n * mpt__q_out_count(Q);
    MPT__CHECK(mpt_tensor_alloc(m->ctx, y, Q->io_dtype, mpt__q_batch_shape(m, n, shape), shape));
    s = mpt__qwork_alloc(m->ctx, Q, n, &w);
    if (s == MPT_OK && Q->io_dtype == MPT_FLOAT32) {
        s = mpt__q_run_float(m->ctx, Q, (const float *)x->data, n, (float *)y->data, &w);
    } else if (s == MPT_OK) {
        /* uint8 codes are the int8 ones + 128 (mpt__q_io_params) */
        int8_t *xq = (int8_t *)w.act[1]; /* op 0 writes act[0] */
        const int shift = Q->io_dtype == MPT_UINT8 ? 128 : 0;
        for (k = 0; k < n * Q->in_count; k++)
            xq[k] = (int8_t)(shift ? ((const uint8_t *)x->data)[k] - 128 : ((const int8_t *)x->data)[k]);
        s = mpt__q_forward(m->ctx, Q, MPT__QX_INTEGER, xq, n, &w, NULL, &out);
        for (k = 0; s == MPT_OK && k < count; k++) {
            int v = ((const int8_t *)out)[k] + shift;
            if (shift) ((uint8_t *)y->data)[k] = (uint8_t)v;
            else ((int8_t *)y->data)[k] = (int8_t)v;
        }
    }
    mpt__free(m->ctx, w.block);
    if (s != MPT_OK) mpt_tensor_free(m->ctx, y);
    return s;
}

/* =============================================================================
   @impl-export  a model as a TFLite (FlatBuffers) or ONNX (protobuf) file: the
   plan both formats read
   =============================================================================

   Three pieces, along the data flow (this section, @impl-export-tflite,
   @impl-export-onnx):
     the plan   the model's layers as steps on the host, which both formats
                read: each Dense and Conv2D with its float32 weights (a
                BatchNormalization right after it folded in), the pooling
                layers, Flatten, the activations, an unfolded
                BatchNormalization as a per-channel scale and shift;
                Dropout and linear activations leave nothing.
     TFLite     a FlatBuffers builder, then the graph as tensors, operators
                and buffers in arrays, then those serialised.
     ONNX       nodes and initializers through @impl-callbacks' protobuf
                encoder (mpt__pb).
   Every constant of a format goes through one function (mpt__tfl_constant,
   mpt__onnx_constant), which decides how it is stored: float32, or float16
   turned back into float32 in the graph. A quantized model's storage
   belongs there and in the step's emission, which knows a kernel from a
   bias; the pieces it needs are here and tested in the runtimes: a TFLite
   tensor's quantization parameters (mpt__tfl_quant: scales and zero points
   per tensor or per channel) with QUANTIZE/DEQUANTIZE, and ONNX
   initializers of any data type (mpt__onnx_initializer) for
   QuantizeLinear/DequantizeLinear pairs.
   The finished bytes go to disk through the checkpoints' writer
   (@impl-checkpoints): a temporary file, fsynced, renamed over the path. */

/* ---- the plan: the model's layers as export steps ------------------------------- */

typedef enum mpt__export_kind {
    MPT__EXPORT_DENSE,           /* act(x · kernel + bias), kernel (in, units)       */
    MPT__EXPORT_CONV2D,          /* act(conv(x, kernel) + bias), kernel (kh, kw, C, F) */
    MPT__EXPORT_MAX_POOL,
    MPT__EXPORT_AVG_POOL,
    MPT__EXPORT_GLOBAL_AVG_POOL, /* (H, W, C) -> (C)                                 */
    MPT__EXPORT_FLATTEN,         /* (H, W, C) -> (H·W·C), NHWC order                 */
    MPT__EXPORT_ACTIVATION,      /* act(x)                                           */
    MPT__EXPORT_SCALE_SHIFT      /* x · kernel + bias per channel (the last axis):
                                    a BatchNormalization with nothing to fold into */
} mpt__export_kind;

typedef struct mpt__export_step {
    mpt__export_kind kind;
    const mpt__layer *L;  /* the layer it comes from: its name, shapes, window */
    mpt_activation act;   /* what the step ends with (a following Activation's) */
    mpt__win g;           /* Conv2D and pooling: the window                     */
    mpt_padding padding;
    float *kernel;        /* (kernel_count) host copy, BatchNormalization folded;
                             SCALE_SHIFT: the scale (C)                          */
    float *bias;          /* (bias_count): zeros where the layer has none;
                             SCALE_SHIFT: the shift (C)                          */
    int64_t kernel_count, bias_count;
} mpt__export_step;

typedef struct mpt__export_plan {
    mpt_model *m;
    const char *format;      /* "TFLite", "ONNX": messages name it          */
    const char *path;
    mpt_dtype weight_dtype;  /* MPT_FLOAT32 or MPT_FLOAT16                   */
    mpt__export_step *steps; /* [n]                                          */
    int n;
    unsigned char *mirror;   /* the parameter arena on the host, when the
                                model is on a GPU; else NULL                 */
} mpt__export_plan;

/* An array of `elem`-byte items with room for one more; 0 when memory runs out. */
static int mpt__export_grow(const mpt_context *ctx, void **items, int *cap, int n, size_t elem) {
    void *grown;
    int more;
    if (n < *cap) return 1;
    more = *cap ? 2 * *cap : 16;
    grown = mpt__calloc(ctx, elem * (size_t)more);
    if (!grown) return 0;
    if (n) memcpy(grown, *items, elem * (size_t)n);
    mpt__free(ctx, *items);
    *items = grown;
    *cap = more;
    return 1;
}

/* The host copy of a layer's parameter ("kernel", "moving_mean"); NULL if
   the layer has none by that name (a Dense without bias). */
static const float *mpt__export_param(const mpt__export_plan *pl, const mpt__layer *L,
                                      const char *what) {
    int k;
    for (k = 0; k < L->n_params; k++) {
        const mpt__param *P = L->param[k];
        const char *slash = strrchr(P->name, '/');
        size_t at;
        if (!slash || strcmp(slash + 1, what) != 0) continue;
        if (!pl->mirror) return P->value;
        at = (size_t)((const unsigned char *)P->value -
                      (const unsigned char *)pl->m->arena[MPT__MEM_PARAMS]);
        return (const float *)(pl->mirror + at);
    }
    return NULL;
}

/* A new step for layer L, with room for kernel_count + bias_count floats
   (the bias zeroed). */
static mpt_status mpt__export_step_add(mpt__export_plan *pl, int *cap, mpt__export_kind kind,
                                       const mpt__layer *L, int64_t kernel_count,
                                       int64_t bias_count) {
    mpt_context *ctx = pl->m->ctx;
    mpt__export_step *s;
    if (!mpt__export_grow(ctx, (void **)&pl->steps, cap, pl->n, sizeof *pl->steps))
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "export '%s': out of memory", pl->path);
    s = &pl->steps[pl->n++];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->L = L;
    s->kernel_count = kernel_count;
    s->bias_count = bias_count;
    if (kernel_count + bias_count > 0) {
        s->kernel = (float *)mpt__calloc(ctx, sizeof(float) * (size_t)(kernel_count + bias_count));
        if (!s->kernel)
            return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "export '%s': out of memory", pl->path);
        s->bias = s->kernel + kernel_count;
    }
    return MPT_OK;
}

/* The activation a layer ends with, read from its descriptor (Conv2D's
   ops do not report theirs). */
static mpt_activation mpt__export_activation(const mpt__layer *L) {
    if (L->ops == &mpt__dense_ops) return L->desc.dense.activation;
    if (L->ops == &mpt__conv2d_ops) return L->desc.conv2d.activation;
    if (L->ops == &mpt__activation_ops) return L->desc.activation.activation;
    return MPT_ACT_NONE;
}

/* Dense or Conv2D: its kernel, its bias (or zeros) and its activation. */
static mpt_status mpt__export_weighted(mpt__export_plan *pl, int *cap, const mpt__layer *L,
                                       mpt__export_kind kind) {
    const float *kernel = mpt__export_param(pl, L, "kernel"), *bias = mpt__export_param(pl, L, "bias");
    int64_t units = L->out_shape[L->out_rank - 1];
    mpt__export_step *s;
    mpt__conv_plan c;
    MPT__CHECK(mpt__export_step_add(pl, cap, kind, L, L->param[0]->count, units));
    s = &pl->steps[pl->n - 1];
    memcpy(s->kernel, kernel, sizeof(float) * (size_t)s->kernel_count);
    if (bias) memcpy(s->bias, bias, sizeof(float) * (size_t)units);
    s->act = mpt__export_activation(L);
    if (kind == MPT__EXPORT_CONV2D) {
        mpt__conv_plan_init(&c, L, 1);
        s->g = c.g;
        s->padding = L->desc.conv2d.padding;
    }
    return MPT_OK;
}

/* BatchNormalization in inference: y = (x − mean)·scale + beta per channel,
   scale = gamma / sqrt(variance + epsilon), as its forward computes them. */
static void mpt__export_bn_affine(const mpt__export_plan *pl, const mpt__layer *L, int64_t c,
                                  double *scale, double *shift) {
    const float *gamma = mpt__export_param(pl, L, "gamma"), *beta = mpt__export_param(pl, L, "beta");
    const float *mean = mpt__export_param(pl, L, "moving_mean");
    const float *var = mpt__export_param(pl, L, "moving_variance");
    float s = (gamma ? gamma[c] : 1.0f) * mpt__bn_inv_std(var[c], mpt__bn_epsilon(L));
    *scale = s;
    *shift = (beta ? beta[c] : 0.0f) - (double)mean[c] * s;
}

/* Folds BatchNormalization L into the Dense or Conv2D step s before it:
   each output channel's kernel column times its scale; the bias becomes
   bias·scale + shift. */
static void mpt__export_fold_bn(const mpt__export_plan *pl, mpt__export_step *s,
                                const mpt__layer *L) {
    int64_t C = s->bias_count, rows = s->kernel_count / C, r, c;
    for (c = 0; c < C; c++) {
        double scale, shift;
        mpt__export_bn_affine(pl, L, c, &scale, &shift);
        for (r = 0; r < rows; r++) s->kernel[r * C + c] = (float)(s->kernel[r * C + c] * scale);
        s->bias[c] = (float)(s->bias[c] * scale + shift);
    }
}

/* BatchNormalization with nothing to fold into: a scale and shift step. */
static mpt_status mpt__export_scale_shift(mpt__export_plan *pl, int *cap, const mpt__layer *L) {
    int64_t C = L->in_shape[L->in_rank - 1], c;
    mpt__export_step *s;
    MPT__CHECK(mpt__export_step_add(pl, cap, MPT__EXPORT_SCALE_SHIFT, L, C, C));
    s = &pl->steps[pl->n - 1];
    for (c = 0; c < C; c++) {
        double scale, shift;
        mpt__export_bn_affine(pl, L, c, &scale, &shift);
        s->kernel[c] = (float)scale;
        s->bias[c] = (float)shift;
    }
    return MPT_OK;
}

/* The step before, when a layer can merge into it: a Dense or Conv2D that
   ends without an activation. */
static mpt__export_step *mpt__export_mergeable(mpt__export_plan *pl) {
    mpt__export_step *s = pl->n ? &pl->steps[pl->n - 1] : NULL;
    if (s && (s->kind == MPT__EXPORT_DENSE || s->kind == MPT__EXPORT_CONV2D) &&
        s->act == MPT_ACT_NONE)
        return s;
    return NULL;
}

static mpt_status mpt__export_unsupported(const mpt__export_plan *pl, const mpt__layer *L,
                                          const char *why) {
    return mpt__fail(pl->m->ctx, MPT_ERR_UNSUPPORTED,
                     "export to %s '%s': layer '%s' (%s) %s; nothing was written", pl->format,
                     pl->path, L->name, L->ops->class_name, why);
}

/* One layer's steps: a new step, a merge into the one before, or none. */
static mpt_status mpt__export_layer(mpt__export_plan *pl, int *cap, const mpt__layer *L) {
    const mpt__layer_ops *ops = L->ops;
    mpt__export_step *before = mpt__export_mergeable(pl);
    if (ops == &mpt__dropout_ops) return MPT_OK; /* inference: the identity */
    if (ops == &mpt__dense_ops) return mpt__export_weighted(pl, cap, L, MPT__EXPORT_DENSE);
    if (ops == &mpt__conv2d_ops) return mpt__export_weighted(pl, cap, L, MPT__EXPORT_CONV2D);
    if (ops == &mpt__activation_ops) {
        mpt_activation act = L->desc.activation.activation;
        if (act == MPT_ACT_NONE) return MPT_OK;
        if (before) {
            before->act = act;
            return MPT_OK;
        }
        MPT__CHECK(mpt__export_step_add(pl, cap, MPT__EXPORT_ACTIVATION, L, 0, 0));
        pl->steps[pl->n - 1].act = act;
        return MPT_OK;
    }
    if (ops == &mpt__bn_ops) {
        if (!before) return mpt__export_scale_shift(pl, cap, L);
        mpt__export_fold_bn(pl, before, L);
        return MPT_OK;
    }
    if (ops == &mpt__max_pool_ops || ops == &mpt__avg_pool_ops) {
        MPT__CHECK(mpt__export_step_add(pl, cap, ops == &mpt__max_pool_ops
                                                     ? MPT__EXPORT_MAX_POOL
                                                     : MPT__EXPORT_AVG_POOL, L, 0, 0));
        mpt__pool_win(&pl->steps[pl->n - 1].g, L);
        pl->steps[pl->n - 1].padding = L->desc.pool2d.padding;
        return MPT_OK;
    }
    if (ops == &mpt__global_pool_ops)
        return mpt__export_step_add(pl, cap, MPT__EXPORT_GLOBAL_AVG_POOL, L, 0, 0);
    if (ops == &mpt__flatten_ops)
        return L->in_rank == 1 ? MPT_OK /* already a vector */
                               : mpt__export_step_add(pl, cap, MPT__EXPORT_FLATTEN, L, 0, 0);
    return mpt__export_unsupported(pl, L, "has no counterpart in the export");
}

static void mpt__export_plan_free(mpt__export_plan *pl) {
    int i;
    mpt_context *ctx = pl->m->ctx;
    for (i = 0; i < pl->n; i++) mpt__free(ctx, pl->steps[i].kernel);
    mpt__free(ctx, pl->steps);
    mpt__free(ctx, pl->mirror);
    pl->steps = NULL;
    pl->mirror = NULL;
    pl->n = 0;
}

/* Checks the call and walks the layers into steps. */
static mpt_status mpt__export_plan_init(mpt__export_plan *pl, mpt_model *m, const char *format,
                                        const char *path, const mpt_export_desc *desc) {
    mpt_export_desc d;
    int i, cap = 0;
    memset(pl, 0, sizeof *pl);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc; /* NULL: every default */
    pl->m = m;
    pl->format = format;
    pl->path = path;
    if (!path || !*path)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "export to %s: %s path", format,
                         path ? "an empty" : "a NULL");
    if (m->quantized) /* its int8 or float16 operations are not planned as steps yet */
        return mpt__fail(m->ctx, MPT_ERR_UNSUPPORTED, "export to %s '%s': the model is quantized "
                         "(mpt_model_quantize); export the float model it came from", format,
                         path);
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "export to %s '%s': the model is not built "
                         "(mpt_model_build, or fit)", format, path);
    pl->weight_dtype = d.weight_dtype == MPT_DTYPE_DEFAULT ? MPT_FLOAT32 : d.weight_dtype;
    if (pl->weight_dtype != MPT_FLOAT32 && pl->weight_dtype != MPT_FLOAT16)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "export to %s '%s': weight_dtype %s "
                         "(%d) is not float32 or float16", format, path,
                         mpt_dtype_name(d.weight_dtype), (int)d.weight_dtype);
    if (mpt__model_device(m) != MPT_DEVICE_CPU) {
        size_t bytes = (size_t)m->arena_bytes[MPT__MEM_PARAMS];
        pl->mirror = (unsigned char *)mpt__alloc(m->ctx, bytes + 1);
        if (!pl->mirror)
            return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "export '%s': out of memory", path);
        MPT__CHECK(mpt__download(m, pl->mirror, m->arena[MPT__MEM_PARAMS], bytes));
    }
    for (i = 0; i < m->n_layers; i++) MPT__CHECK(mpt__export_layer(pl, &cap, &m->layers[i]));
    return MPT_OK;
}

/* The step's output: one sample's rank and shape. */
static int mpt__export_out_shape(const mpt__export_step *s, int64_t *shape) {
    memcpy(shape, s->L->out_shape, sizeof s->L->out_shape);
    return s->L->out_rank;
}

/* Writes the finished bytes as checkpoints are written. */
static mpt_status mpt__export_write(mpt_model *m, const char *path, const unsigned char *bytes,
                                    size_t n) {
    mpt__ckpt_writer w;
    mpt_status s = mpt__ckpt_writer_open(&w, m->ctx, "export", path);
    if (s == MPT_OK) s = mpt__ckpt_write_raw(&w, bytes, n);
    if (s == MPT_OK) s = mpt__ckpt_writer_commit(&w);
    mpt__ckpt_writer_close(&w);
    return s;
}

/* =============================================================================
   @impl-export-tflite  the plan as a TFLite file: FlatBuffers, then the graph
   =============================================================================

   ---- FlatBuffers, built back to front ---------------------------------------------

   An offset in a FlatBuffer is unsigned and relative to where it is
   stored, so whatever a table refers to sits after it: the builder fills
   its buffer from the end towards the front, children first, as the
   flatbuffers library does. A position is counted from the end (the size
   when the thing was finished), which growing the buffer leaves as it is.
   Each scalar is aligned to its size counted from the end, and the
   finished buffer is padded to a multiple of the largest alignment used,
   so the alignments hold from the front as well.
   A table is its soffset to its vtable, then its fields; its vtable (u16:
   the vtable's bytes, the table's bytes, then each field's offset in the
   table, 0 when absent) is written just in front of it. */

#define MPT__FB_MAX_FIELDS 16

typedef struct mpt__fb {
    const mpt_context *ctx;
    unsigned char *data;  /* (cap): the bytes are data[cap − size .. cap)           */
    size_t size, cap;
    size_t max_align;
    int failed;           /* out of memory or past 2 GiB: later calls do nothing */
    size_t table_start;   /* the size when the table being built began          */
    int n_fields;
    size_t field_at[MPT__FB_MAX_FIELDS]; /* each field's position; 0: absent     */
} mpt__fb;

static int mpt__fb_reserve(mpt__fb *b, size_t more) {
    unsigned char *grown;
    size_t cap;
    if (b->failed) return 0;
    if (b->size + more <= b->cap) return 1;
    if (b->size + more > (size_t)0x7fffffff) { /* offsets are 32-bit */
        b->failed = 1;
        return 0;
    }
    cap = MPT__MAX(2 * b->cap, b->size + more + 1024);
    grown = (unsigned char *)mpt__alloc(b->ctx, cap);
    if (!grown) {
        b->failed = 1;
        return 0;
    }
    if (b->size) memcpy(grown + cap - b->size, b->data + b->cap - b->size, b->size);
    mpt__free(b->ctx, b->data);
    b->data = grown;
    b->cap = cap;
    return 1;
}

/* n bytes in front (NULL: zeros). */
static void mpt__fb_front(mpt__fb *b, const void *src, size_t n) {
    if (n == 0 || !mpt__fb_reserve(b, n)) return;
    b->size += n;
    if (src) memcpy(b->data + b->cap - b->size, src, n);
    else memset(b->data + b->cap - b->size, 0, n);
}

/* Pads so that the front is aligned to `align` once `len` more bytes are there. */
static void mpt__fb_align(mpt__fb *b, size_t len, size_t align) {
    if (align > b->max_align) b->max_align = align;
    mpt__fb_front(b, NULL, (align - (b->size + len) % align) % align);
}

/* A little-endian scalar of `bytes` bytes, aligned to its size. */
static void mpt__fb_scalar(mpt__fb *b, uint64_t v, int bytes) {
    unsigned char le[8];
    mpt__fb_align(b, (size_t)bytes, (size_t)bytes);
    mpt__tb_put_le(le, v, bytes);
    mpt__fb_front(b, le, (size_t)bytes);
}

/* A uoffset to the thing at position `target`. */
static void mpt__fb_offset(mpt__fb *b, size_t target) {
    mpt__fb_align(b, 4, 4);
    mpt__fb_scalar(b, (uint32_t)(b->size + 4 - target), 4);
}

/* A vector of n elements of `elem` bytes, already little-endian in `le`,
   its data aligned to `align`; returns its position. */
static size_t mpt__fb_vector(mpt__fb *b, const void *le, size_t n, int elem, size_t align) {
    mpt__fb_align(b, n * (size_t)elem, MPT__MAX(align, 4));
    mpt__fb_front(b, le, n * (size_t)elem);
    mpt__fb_scalar(b, (uint32_t)n, 4);
    return b->size;
}

static size_t mpt__fb_int32s(mpt__fb *b, const int32_t *v, int n) {
    unsigned char le[4 * 8];
    int i;
    if (n > 8) { /* longer lists are never written */
        b->failed = 1;
        return 0;
    }
    for (i = 0; i < n; i++) mpt__tb_put_le(le + 4 * i, (uint32_t)v[i], 4);
    return mpt__fb_vector(b, le, (size_t)n, 4, 4);
}

static size_t mpt__fb_string(mpt__fb *b, const char *s) {
    size_t n = strlen(s);
    mpt__fb_align(b, n + 1, 4);
    mpt__fb_front(b, NULL, 1); /* the terminating NUL */
    mpt__fb_front(b, s, n);
    mpt__fb_scalar(b, (uint32_t)n, 4);
    return b->size;
}

/* A vector of offsets to the things at positions at[0..n). */
static size_t mpt__fb_offsets(mpt__fb *b, const size_t *at, int n) {
    int i;
    mpt__fb_align(b, 4 * (size_t)n, 4);
    for (i = n - 1; i >= 0; i--) mpt__fb_offset(b, at[i]);
    mpt__fb_scalar(b, (uint32_t)n, 4);
    return b->size;
}

static void mpt__fb_table_begin(mpt__fb *b) {
    b->table_start = b->size;
    b->n_fields = 0;
    memset(b->field_at, 0, sizeof b->field_at);
}

static void mpt__fb_field_done(mpt__fb *b, int id) {
    b->field_at[id] = b->size;
    if (id + 1 > b->n_fields) b->n_fields = id + 1;
}

static void mpt__fb_field_scalar(mpt__fb *b, int id, uint64_t v, int bytes) {
    mpt__fb_scalar(b, v, bytes);
    mpt__fb_field_done(b, id);
}

static void mpt__fb_field_offset(mpt__fb *b, int id, size_t target) {
    mpt__fb_offset(b, target);
    mpt__fb_field_done(b, id);
}

/* Ends the table: its soffset, then its vtable in front; returns its position. */
static size_t mpt__fb_table_end(mpt__fb *b) {
    size_t table, vtable;
    int id;
    mpt__fb_scalar(b, 0, 4); /* the soffset, filled below */
    table = b->size;
    for (id = b->n_fields - 1; id >= 0; id--)
        mpt__fb_scalar(b, b->field_at[id] ? table - b->field_at[id] : 0, 2);
    mpt__fb_scalar(b, table - b->table_start, 2);
    mpt__fb_scalar(b, 4 + 2 * (uint64_t)b->n_fields, 2);
    vtable = b->size;
    if (!b->failed) /* the vtable is vtable − table bytes before the table */
        mpt__tb_put_le(b->data + b->cap - table, (uint32_t)(vtable - table), 4);
    return table;
}

/* The root offset and the file identifier in front of everything. */
static void mpt__fb_finish(mpt__fb *b, size_t root, const char identifier[4]) {
    mpt__fb_align(b, 8, MPT__MAX(b->max_align, 4));
    mpt__fb_front(b, identifier, 4);
    mpt__fb_front(b, NULL, 4);
    if (!b->failed) mpt__tb_put_le(b->data + b->cap - b->size, (uint32_t)(b->size - root), 4);
}

/* ---- TFLite: the graph as tensors, operators and buffers --------------------------

   Numbers from tensorflow/lite/schema/schema.fbs (field ids count a union
   as two: its type, then its value). */

enum { /* BuiltinOperator */
    MPT__TFL_ADD = 0, MPT__TFL_AVERAGE_POOL_2D = 1, MPT__TFL_CONV_2D = 3,
    MPT__TFL_DEQUANTIZE = 6, MPT__TFL_FULLY_CONNECTED = 9, MPT__TFL_LOGISTIC = 14,
    MPT__TFL_MAX_POOL_2D = 17, MPT__TFL_MUL = 18, MPT__TFL_RELU = 19, MPT__TFL_RESHAPE = 22,
    MPT__TFL_SOFTMAX = 25, MPT__TFL_TANH = 28, MPT__TFL_QUANTIZE = 114, MPT__TFL_GELU = 150
};
enum { /* TensorType */
    MPT__TFL_FLOAT32 = 0, MPT__TFL_FLOAT16 = 1, MPT__TFL_INT32 = 2, MPT__TFL_UINT8 = 3,
    MPT__TFL_INT8 = 9
};
enum { /* BuiltinOptions: the union's type ids */
    MPT__TFL_NO_OPTIONS = 0, MPT__TFL_CONV2D_OPTIONS = 1, MPT__TFL_POOL2D_OPTIONS = 5,
    MPT__TFL_FULLY_CONNECTED_OPTIONS = 8, MPT__TFL_SOFTMAX_OPTIONS = 9,
    MPT__TFL_ADD_OPTIONS = 11, MPT__TFL_RESHAPE_OPTIONS = 17, MPT__TFL_MUL_OPTIONS = 21,
    MPT__TFL_GELU_OPTIONS = 116
};
enum { MPT__TFL_SAME = 0, MPT__TFL_VALID = 1 }; /* Padding */
enum { MPT__TFL_ACT_NONE = 0, MPT__TFL_ACT_RELU = 1 }; /* ActivationFunctionType */

/* A quantized tensor's parameters (QuantizationParameters): real =
   scale · (q − zero_point), one pair for the whole tensor (n = 1) or one
   per index of axis `dimension` (a kernel's output channels: 0). */
typedef struct mpt__tfl_quant {
    int n;                      /* 0: not quantized                          */
    const float *scale;         /* (n), borrowed until the file is written  */
    const int64_t *zero_point;  /* (n), likewise                             */
    int dimension;              /* quantized_dimension                       */
} mpt__tfl_quant;

typedef struct mpt__tfl_tensor {
    char name[96];
    int type;             /* TensorType                                     */
    int rank;
    int32_t shape[MPT_MAX_RANK];
    int batched;          /* shape[0] is the batch: shape_signature has −1 */
    uint32_t buffer;      /* 0: no data (the empty sentinel)                */
    mpt__tfl_quant quant; /* INT8, UINT8 (and an int32 bias): its scales    */
} mpt__tfl_tensor;

typedef struct mpt__tfl_op {
    int code;             /* BuiltinOperator                                */
    int32_t inputs[3];
    int n_inputs;
    int32_t output;
    int options;          /* BuiltinOptions type                            */
    int32_t opt[6];       /* the options table's fields, in schema order    */
    int n_opt;
} mpt__tfl_op;

typedef struct mpt__tfl_buffer {
    unsigned char *data;  /* (bytes), little-endian; owned                  */
    size_t bytes;
} mpt__tfl_buffer;

typedef struct mpt__tfl {
    mpt__export_plan *pl;
    mpt__tfl_tensor *tensors;
    int n_tensors, cap_tensors;
    mpt__tfl_op *ops;
    int n_ops, cap_ops;
    mpt__tfl_buffer *buffers; /* [0] is the empty sentinel                  */
    int n_buffers, cap_buffers;
    int failed;               /* out of memory                                */
} mpt__tfl;

/* A tensor: (1, sample...) with a free batch when batched, else as given. */
static int32_t mpt__tfl_tensor_add(mpt__tfl *g, const char *layer, const char *what, int type,
                                   int rank, const int64_t *shape, int batched, uint32_t buffer) {
    mpt__tfl_tensor *t;
    int i;
    if (g->failed || !mpt__export_grow(g->pl->m->ctx, (void **)&g->tensors, &g->cap_tensors,
                                       g->n_tensors, sizeof *g->tensors)) {
        g->failed = 1;
        return 0;
    }
    t = &g->tensors[g->n_tensors];
    snprintf(t->name, sizeof t->name, "%s%s%s", layer, *what ? "/" : "", what);
    t->type = type;
    t->rank = rank + (batched ? 1 : 0);
    t->shape[0] = 1;
    for (i = 0; i < rank; i++) t->shape[i + (batched ? 1 : 0)] = (int32_t)shape[i];
    t->batched = batched;
    t->buffer = buffer;
    return g->n_tensors++;
}

/* A buffer taking `bytes` of data (owned from here on, freed on failure). */
static uint32_t mpt__tfl_buffer_add(mpt__tfl *g, unsigned char *data, size_t bytes) {
    if (g->failed || !mpt__export_grow(g->pl->m->ctx, (void **)&g->buffers, &g->cap_buffers,
                                       g->n_buffers, sizeof *g->buffers)) {
        mpt__free(g->pl->m->ctx, data);
        g->failed = 1;
        return 0;
    }
    g->buffers[g->n_buffers].data = data;
    g->buffers[g->n_buffers].bytes = bytes;
    return (uint32_t)g->n_buffers++;
}

static mpt__tfl_op *mpt__tfl_op_add(mpt__tfl *g, int code, int32_t in0, int32_t in1, int32_t in2,
                                    int n_inputs, int32_t output) {
    mpt__tfl_op *op;
    if (g->failed || !mpt__export_grow(g->pl->m->ctx, (void **)&g->ops, &g->cap_ops, g->n_ops,
                                       sizeof *g->ops)) {
        g->failed = 1;
        return NULL;
    }
    op = &g->ops[g->n_ops++];
    memset(op, 0, sizeof *op);
    op->code = code;
    op->inputs[0] = in0;
    op->inputs[1] = in1;
    op->inputs[2] = in2;
    op->n_inputs = n_inputs;
    op->output = output;
    return op;
}

/* A float constant of the model (a kernel, a bias, a scale), as the export
   stores it: float32, or float16 with a DEQUANTIZE to float32 in front of
   its users, as TFLite's converter writes float16-quantized models.
   Returns the float32 tensor the ops read. */
static int32_t mpt__tfl_constant(mpt__tfl *g, const char *layer, const char *what, int rank,
                                 const int64_t *shape, const float *values, int64_t n) {
    int half = g->pl->weight_dtype == MPT_FLOAT16;
    size_t elem = half ? 2 : 4;
    unsigned char *data = (unsigned char *)mpt__alloc(g->pl->m->ctx, elem * (size_t)n + 1);
    int64_t i;
    int32_t stored, dequantized;
    char name[80];
    if (!data) {
        g->failed = 1;
        return 0;
    }
    for (i = 0; i < n; i++) {
        uint32_t bits;
        if (half) {
            mpt__tb_put_le(data + 2 * i, mpt_float_to_half(values[i]), 2);
        } else {
            memcpy(&bits, &values[i], 4);
            mpt__tb_put_le(data + 4 * i, bits, 4);
        }
    }
    stored = mpt__tfl_tensor_add(g, layer, what, half ? MPT__TFL_FLOAT16 : MPT__TFL_FLOAT32, rank,
                                 shape, 0, mpt__tfl_buffer_add(g, data, elem * (size_t)n));
    if (!half) return stored;
    snprintf(name, sizeof name, "%s_dequantized", what);
    dequantized = mpt__tfl_tensor_add(g, layer, name, MPT__TFL_FLOAT32, rank, shape, 0, 0);
    mpt__tfl_op_add(g, MPT__TFL_DEQUANTIZE, stored, 0, 0, 1, dequantized);
    return dequantized;
}

/* An int32 vector constant (RESHAPE's shape). */
static int32_t mpt__tfl_int32_constant(mpt__tfl *g, const char *layer, const char *what,
                                       const int32_t *values, int n) {
    unsigned char *data = (unsigned char *)mpt__alloc(g->pl->m->ctx, 4 * (size_t)n);
    int64_t shape = n;
    int i;
    if (!data) {
        g->failed = 1;
        return 0;
    }
    for (i = 0; i < n; i++) mpt__tb_put_le(data + 4 * i, (uint32_t)values[i], 4);
    return mpt__tfl_tensor_add(g, layer, what, MPT__TFL_INT32, 1, &shape, 0,
                               mpt__tfl_buffer_add(g, data, 4 * (size_t)n));
}

/* The activation FULLY_CONNECTED and CONV_2D fuse; -1 when it needs an op
   of its own (LiteRT's FULLY_CONNECTED refuses a fused tanh). */
static int mpt__tfl_fused(mpt_activation act) {
    switch (act) {
    case MPT_ACT_NONE: return MPT__TFL_ACT_NONE;
    case MPT_ACT_RELU: return MPT__TFL_ACT_RELU;
    default: return -1;
    }
}

/* act(x) as an op of its own into a new tensor of the step's output shape. */
static int32_t mpt__tfl_activation(mpt__tfl *g, const mpt__export_step *s, int32_t x) {
    int64_t shape[MPT_MAX_RANK];
    int rank = mpt__export_out_shape(s, shape);
    int32_t y = mpt__tfl_tensor_add(g, s->L->name, "output", MPT__TFL_FLOAT32, rank, shape, 1, 0);
    mpt__tfl_op *op;
    switch (s->act) {
    case MPT_ACT_RELU: mpt__tfl_op_add(g, MPT__TFL_RELU, x, 0, 0, 1, y); break;
    case MPT_ACT_TANH: mpt__tfl_op_add(g, MPT__TFL_TANH, x, 0, 0, 1, y); break;
    case MPT_ACT_SIGMOID: mpt__tfl_op_add(g, MPT__TFL_LOGISTIC, x, 0, 0, 1, y); break;
    case MPT_ACT_GELU: /* exact (approximate false), as mpt.h's */
        op = mpt__tfl_op_add(g, MPT__TFL_GELU, x, 0, 0, 1, y);
        if (op) op->options = MPT__TFL_GELU_OPTIONS, op->n_opt = 1;
        break;
    default: /* softmax, over the last axis */
        op = mpt__tfl_op_add(g, MPT__TFL_SOFTMAX, x, 0, 0, 1, y);
        if (op) {
            float beta = 1.0f;
            op->options = MPT__TFL_SOFTMAX_OPTIONS;
            memcpy(&op->opt[0], &beta, 4);
            op->n_opt = 1;
        }
        break;
    }
    return y;
}

/* The output of a step's main op: the step's output when the op fuses the
   activation, else a tensor the activation op then reads. */
static int32_t mpt__tfl_main_output(mpt__tfl *g, const mpt__export_step *s) {
    int64_t shape[MPT_MAX_RANK];
    int rank = mpt__export_out_shape(s, shape);
    return mpt__tfl_tensor_add(g, s->L->name, mpt__tfl_fused(s->act) < 0 ? "linear" : "output",
                               MPT__TFL_FLOAT32, rank, shape, 1, 0);
}

/* Dense: FULLY_CONNECTED, weights [units, in] (the kernel transposed). */
static int32_t mpt__tfl_dense(mpt__tfl *g, const mpt__export_step *s, int32_t x) {
    int64_t units = s->bias_count, in = s->kernel_count / units, shape[2], i, j;
    float *w = (float *)mpt__alloc(g->pl->m->ctx, sizeof(float) * (size_t)s->kernel_count + 1);
    int32_t kernel, bias, y;
    mpt__tfl_op *op;
    if (!w) {
        g->failed = 1;
        return 0;
    }
    for (i = 0; i < in; i++)
        for (j = 0; j < units; j++) w[j * in + i] = s->kernel[i * units + j];
    shape[0] = units;
    shape[1] = in;
    kernel = mpt__tfl_constant(g, s->L->name, "kernel", 2, shape, w, s->kernel_count);
    mpt__free(g->pl->m->ctx, w);
    bias = mpt__tfl_constant(g, s->L->name, "bias", 1, &units, s->bias, units);
    y = mpt__tfl_main_output(g, s);
    op = mpt__tfl_op_add(g, MPT__TFL_FULLY_CONNECTED, x, kernel, bias, 3, y);
    if (op) {
        op->options = MPT__TFL_FULLY_CONNECTED_OPTIONS;
        op->opt[0] = MPT__MAX(mpt__tfl_fused(s->act), 0);
        op->n_opt = 1;
    }
    return mpt__tfl_fused(s->act) < 0 ? mpt__tfl_activation(g, s, y) : y;
}

/* Conv2D: CONV_2D, filters [F, kh, kw, C] (the kernel's (kh, kw, C, F) with F first). */
static int32_t mpt__tfl_conv2d(mpt__tfl *g, const mpt__export_step *s, int32_t x) {
    int64_t F = s->bias_count, khwc = s->kernel_count / F, shape[4], i, f;
    float *w = (float *)mpt__alloc(g->pl->m->ctx, sizeof(float) * (size_t)s->kernel_count + 1);
    int32_t kernel, bias, y;
    mpt__tfl_op *op;
    if (!w) {
        g->failed = 1;
        return 0;
    }
    for (i = 0; i < khwc; i++)
        for (f = 0; f < F; f++) w[f * khwc + i] = s->kernel[i * F + f];
    shape[0] = F;
    shape[1] = s->g.kh;
    shape[2] = s->g.kw;
    shape[3] = s->g.c;
    kernel = mpt__tfl_constant(g, s->L->name, "kernel", 4, shape, w, s->kernel_count);
    mpt__free(g->pl->m->ctx, w);
    bias = mpt__tfl_constant(g, s->L->name, "bias", 1, &F, s->bias, F);
    y = mpt__tfl_main_output(g, s);
    op = mpt__tfl_op_add(g, MPT__TFL_CONV_2D, x, kernel, bias, 3, y);
    if (op) {
        op->options = MPT__TFL_CONV2D_OPTIONS;
        op->opt[0] = s->padding == MPT_PADDING_SAME ? MPT__TFL_SAME : MPT__TFL_VALID;
        op->opt[1] = (int32_t)s->g.sw;
        op->opt[2] = (int32_t)s->g.sh;
        op->opt[3] = MPT__MAX(mpt__tfl_fused(s->act), 0);
        op->n_opt = 4;
    }
    return mpt__tfl_fused(s->act) < 0 ? mpt__tfl_activation(g, s, y) : y;
}

/* MAX_POOL_2D or AVERAGE_POOL_2D over the window g into tensor y. */
static void mpt__tfl_pool(mpt__tfl *g, int code, const mpt__win *w, int padding, int32_t x,
                          int32_t y) {
    mpt__tfl_op *op = mpt__tfl_op_add(g, code, x, 0, 0, 1, y);
    if (!op) return;
    op->options = MPT__TFL_POOL2D_OPTIONS;
    op->opt[0] = padding;
    op->opt[1] = (int32_t)w->sw;
    op->opt[2] = (int32_t)w->sh;
    op->opt[3] = (int32_t)w->kw;
    op->opt[4] = (int32_t)w->kh;
    op->opt[5] = MPT__TFL_ACT_NONE;
    op->n_opt = 6;
}

/* RESHAPE x to (batch, n) into y. */
static void mpt__tfl_to_vectors(mpt__tfl *g, const mpt__layer *L, int64_t n, int32_t x,
                                int32_t y) {
    int32_t dims[2], shape;
    mpt__tfl_op *op;
    dims[0] = -1;
    dims[1] = (int32_t)n;
    shape = mpt__tfl_int32_constant(g, L->name, "shape", dims, 2);
    op = mpt__tfl_op_add(g, MPT__TFL_RESHAPE, x, shape, 0, 2, y);
    if (!op) return;
    op->options = MPT__TFL_RESHAPE_OPTIONS; /* new_shape, as the shape input says */
    op->opt[0] = -1;
    op->opt[1] = (int32_t)n;
    op->n_opt = 2;
}

/* One step's ops, reading tensor x; returns the step's output tensor. */
static int32_t mpt__tfl_step(mpt__tfl *g, const mpt__export_step *s, int32_t x) {
    int64_t shape[MPT_MAX_RANK], C;
    int rank = mpt__export_out_shape(s, shape);
    int32_t y, t, scale, shift;
    mpt__win whole;
    switch (s->kind) {
    case MPT__EXPORT_DENSE: return mpt__tfl_dense(g, s, x);
    case MPT__EXPORT_CONV2D: return mpt__tfl_conv2d(g, s, x);
    case MPT__EXPORT_MAX_POOL:
    case MPT__EXPORT_AVG_POOL:
        y = mpt__tfl_tensor_add(g, s->L->name, "output", MPT__TFL_FLOAT32, rank, shape, 1, 0);
        mpt__tfl_pool(g, s->kind == MPT__EXPORT_MAX_POOL ? MPT__TFL_MAX_POOL_2D
                                                         : MPT__TFL_AVERAGE_POOL_2D,
                      &s->g, s->padding == MPT_PADDING_SAME ? MPT__TFL_SAME : MPT__TFL_VALID, x, y);
        return y;
    case MPT__EXPORT_GLOBAL_AVG_POOL: /* one window the size of the image, then (batch, C) */
        memset(&whole, 0, sizeof whole);
        whole.kh = s->L->in_shape[0];
        whole.kw = s->L->in_shape[1];
        whole.sh = whole.sw = 1;
        C = s->L->in_shape[2];
        {
            int64_t pooled[3];
            pooled[0] = pooled[1] = 1;
            pooled[2] = C;
            t = mpt__tfl_tensor_add(g, s->L->name, "pooled", MPT__TFL_FLOAT32, 3, pooled, 1, 0);
        }
        mpt__tfl_pool(g, MPT__TFL_AVERAGE_POOL_2D, &whole, MPT__TFL_VALID, x, t);
        y = mpt__tfl_tensor_add(g, s->L->name, "output", MPT__TFL_FLOAT32, rank, shape, 1, 0);
        mpt__tfl_to_vectors(g, s->L, C, t, y);
        return y;
    case MPT__EXPORT_FLATTEN:
        y = mpt__tfl_tensor_add(g, s->L->name, "output", MPT__TFL_FLOAT32, rank, shape, 1, 0);
        mpt__tfl_to_vectors(g, s->L, shape[0], x, y);
        return y;
    case MPT__EXPORT_ACTIVATION: return mpt__tfl_activation(g, s, x);
    case MPT__EXPORT_SCALE_SHIFT: /* MUL by the scale, ADD the shift (over the last axis) */
        C = s->bias_count;
        scale = mpt__tfl_constant(g, s->L->name, "scale", 1, &C, s->kernel, C);
        shift = mpt__tfl_constant(g, s->L->name, "shift", 1, &C, s->bias, C);
        t = mpt__tfl_tensor_add(g, s->L->name, "scaled", MPT__TFL_FLOAT32, rank, shape, 1, 0);
        y = mpt__tfl_tensor_add(g, s->L->name, "output", MPT__TFL_FLOAT32, rank, shape, 1, 0);
        {
            mpt__tfl_op *mul = mpt__tfl_op_add(g, MPT__TFL_MUL, x, scale, 0, 2, t);
            mpt__tfl_op *add = mpt__tfl_op_add(g, MPT__TFL_ADD, t, shift, 0, 2, y);
            if (mul) mul->options = MPT__TFL_MUL_OPTIONS, mul->n_opt = 1;
            if (add) add->options = MPT__TFL_ADD_OPTIONS, add->n_opt = 1;
        }
        return y;
    }
    return x;
}

/* ---- TFLite: serialising the graph -------------------------------------------------- */

static size_t mpt__tfl_write_buffer(mpt__fb *b, const mpt__tfl_buffer *buf) {
    size_t data = buf->bytes ? mpt__fb_vector(b, buf->data, buf->bytes, 1, 16) : 0;
    mpt__fb_table_begin(b);
    if (data) mpt__fb_field_offset(b, 0, data); /* Buffer.data, force_align 16 */
    return mpt__fb_table_end(b);
}

/* QuantizationParameters {min 0, max 1, scale 2, zero_point 3, details
   (a union: 4 and 5), quantized_dimension 6}. */
static size_t mpt__tfl_write_quant(mpt__fb *b, const mpt__tfl_quant *q) {
    size_t scale, zero_point;
    int i;
    mpt__fb_align(b, 8 * (size_t)q->n, 8);
    for (i = q->n - 1; i >= 0; i--) mpt__fb_scalar(b, (uint64_t)q->zero_point[i], 8);
    mpt__fb_scalar(b, (uint32_t)q->n, 4);
    zero_point = b->size;
    mpt__fb_align(b, 4 * (size_t)q->n, 4);
    for (i = q->n - 1; i >= 0; i--) {
        uint32_t bits;
        memcpy(&bits, &q->scale[i], 4);
        mpt__fb_scalar(b, bits, 4);
    }
    mpt__fb_scalar(b, (uint32_t)q->n, 4);
    scale = b->size;
    mpt__fb_table_begin(b);
    mpt__fb_field_offset(b, 2, scale);
    mpt__fb_field_offset(b, 3, zero_point);
    mpt__fb_field_scalar(b, 6, (uint32_t)q->dimension, 4);
    return mpt__fb_table_end(b);
}

static size_t mpt__tfl_write_tensor(mpt__fb *b, const mpt__tfl_tensor *t) {
    int32_t signature[MPT_MAX_RANK];
    size_t shape, sig = 0, name, quant = 0;
    if (t->quant.n > 0) quant = mpt__tfl_write_quant(b, &t->quant);
    shape = mpt__fb_int32s(b, t->shape, t->rank);
    if (t->batched) {
        memcpy(signature, t->shape, sizeof signature);
        signature[0] = -1;
        sig = mpt__fb_int32s(b, signature, t->rank);
    }
    name = mpt__fb_string(b, t->name);
    mpt__fb_table_begin(b);
    mpt__fb_field_offset(b, 0, shape);                  /* Tensor.shape           */
    mpt__fb_field_scalar(b, 1, (uint64_t)t->type, 1);   /* type                   */
    mpt__fb_field_scalar(b, 2, t->buffer, 4);           /* buffer                 */
    mpt__fb_field_offset(b, 3, name);                   /* name                   */
    if (quant) mpt__fb_field_offset(b, 4, quant);       /* quantization           */
    if (sig) mpt__fb_field_offset(b, 7, sig);           /* shape_signature        */
    return mpt__fb_table_end(b);
}

/* An op's options table, in the field order of its schema table. */
static size_t mpt__tfl_write_options(mpt__fb *b, const mpt__tfl_op *op) {
    size_t new_shape = 0;
    int i;
    if (op->options == MPT__TFL_RESHAPE_OPTIONS) new_shape = mpt__fb_int32s(b, op->opt, op->n_opt);
    mpt__fb_table_begin(b);
    switch (op->options) {
    case MPT__TFL_CONV2D_OPTIONS: /* padding, stride_w, stride_h, fused_activation_function */
        mpt__fb_field_scalar(b, 0, (uint64_t)op->opt[0], 1);
        mpt__fb_field_scalar(b, 1, (uint32_t)op->opt[1], 4);
        mpt__fb_field_scalar(b, 2, (uint32_t)op->opt[2], 4);
        mpt__fb_field_scalar(b, 3, (uint64_t)op->opt[3], 1);
        break;
    case MPT__TFL_POOL2D_OPTIONS: /* padding, stride_w, stride_h, filter_width, filter_height,
                                     fused_activation_function */
        mpt__fb_field_scalar(b, 0, (uint64_t)op->opt[0], 1);
        for (i = 1; i <= 4; i++) mpt__fb_field_scalar(b, i, (uint32_t)op->opt[i], 4);
        mpt__fb_field_scalar(b, 5, (uint64_t)op->opt[5], 1);
        break;
    case MPT__TFL_FULLY_CONNECTED_OPTIONS: /* fused_activation_function */
    case MPT__TFL_ADD_OPTIONS:
    case MPT__TFL_MUL_OPTIONS:
    case MPT__TFL_GELU_OPTIONS: /* approximate */
        mpt__fb_field_scalar(b, 0, (uint64_t)op->opt[0], 1);
        break;
    case MPT__TFL_SOFTMAX_OPTIONS: mpt__fb_field_scalar(b, 0, (uint32_t)op->opt[0], 4); break;
    case MPT__TFL_RESHAPE_OPTIONS: mpt__fb_field_offset(b, 0, new_shape); break;
    default: break;
    }
    return mpt__fb_table_end(b);
}

/* The index of code in codes[0..*n), added when new. */
static int mpt__tfl_opcode_index(int *codes, int *n, int code) {
    int i;
    for (i = 0; i < *n; i++)
        if (codes[i] == code) return i;
    codes[*n] = code;
    return (*n)++;
}

static size_t mpt__tfl_write_op(mpt__fb *b, const mpt__tfl_op *op, int opcode_index) {
    size_t inputs = mpt__fb_int32s(b, op->inputs, op->n_inputs);
    size_t outputs = mpt__fb_int32s(b, &op->output, 1);
    size_t options = op->options ? mpt__tfl_write_options(b, op) : 0;
    mpt__fb_table_begin(b);
    mpt__fb_field_scalar(b, 0, (uint32_t)opcode_index, 4); /* Operator.opcode_index */
    mpt__fb_field_offset(b, 1, inputs);
    mpt__fb_field_offset(b, 2, outputs);
    if (options) {
        mpt__fb_field_scalar(b, 3, (uint64_t)op->options, 1); /* builtin_options_type */
        mpt__fb_field_offset(b, 4, options);                   /* builtin_options      */
    }
    return mpt__fb_table_end(b);
}

static size_t mpt__tfl_write_opcode(mpt__fb *b, int code) {
    mpt__fb_table_begin(b);
    mpt__fb_field_scalar(b, 0, (uint64_t)MPT__MIN(code, 127), 1); /* deprecated_builtin_code */
    mpt__fb_field_scalar(b, 2, 1, 4);                             /* version                 */
    mpt__fb_field_scalar(b, 3, (uint32_t)code, 4);                /* builtin_code            */
    return mpt__fb_table_end(b);
}

/* The whole file: Model {version 3, operator_codes, subgraphs [one],
   description, buffers}. Positions are kept in one scratch array. */
static mpt_status mpt__tfl_serialise(mpt__tfl *g, int32_t input, int32_t output, mpt__fb *b) {
    mpt_context *ctx = g->pl->m->ctx;
    int n = MPT__MAX(MPT__MAX(g->n_tensors, g->n_ops), g->n_buffers), i, n_codes = 0;
    size_t *at = (size_t *)mpt__calloc(ctx, sizeof(size_t) * (size_t)n + 1);
    int *codes = (int *)mpt__calloc(ctx, sizeof(int) * (size_t)g->n_ops + 1);
    int *index = (int *)mpt__calloc(ctx, sizeof(int) * (size_t)g->n_ops + 1);
    size_t buffers, tensors, operators, opcodes, subgraph, subgraphs, inputs, outputs, name,
        description, model;
    if (!at || !codes || !index) {
        mpt__free(ctx, at);
        mpt__free(ctx, codes);
        mpt__free(ctx, index);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "export '%s': out of memory", g->pl->path);
    }
    for (i = 0; i < g->n_buffers; i++) at[i] = mpt__tfl_write_buffer(b, &g->buffers[i]);
    buffers = mpt__fb_offsets(b, at, g->n_buffers);
    for (i = 0; i < g->n_tensors; i++) at[i] = mpt__tfl_write_tensor(b, &g->tensors[i]);
    tensors = mpt__fb_offsets(b, at, g->n_tensors);
    for (i = 0; i < g->n_ops; i++) index[i] = mpt__tfl_opcode_index(codes, &n_codes, g->ops[i].code);
    for (i = 0; i < g->n_ops; i++) at[i] = mpt__tfl_write_op(b, &g->ops[i], index[i]);
    operators = mpt__fb_offsets(b, at, g->n_ops);
    for (i = 0; i < n_codes; i++) at[i] = mpt__tfl_write_opcode(b, codes[i]);
    opcodes = mpt__fb_offsets(b, at, n_codes);
    inputs = mpt__fb_int32s(b, &input, 1);
    outputs = mpt__fb_int32s(b, &output, 1);
    name = mpt__fb_string(b, "main");
    mpt__fb_table_begin(b); /* SubGraph {tensors, inputs, outputs, operators, name} */
    mpt__fb_field_offset(b, 0, tensors);
    mpt__fb_field_offset(b, 1, inputs);
    mpt__fb_field_offset(b, 2, outputs);
    mpt__fb_field_offset(b, 3, operators);
    mpt__fb_field_offset(b, 4, name);
    subgraph = mpt__fb_table_end(b);
    subgraphs = mpt__fb_offsets(b, &subgraph, 1);
    description = mpt__fb_string(b, "mpt.h " MPT_VERSION);
    mpt__fb_table_begin(b); /* Model */
    mpt__fb_field_scalar(b, 0, 3, 4); /* version */
    mpt__fb_field_offset(b, 1, opcodes);
    mpt__fb_field_offset(b, 2, subgraphs);
    mpt__fb_field_offset(b, 3, description);
    mpt__fb_field_offset(b, 4, buffers);
    model = mpt__fb_table_end(b);
    mpt__fb_finish(b, model, "TFL3");
    mpt__free(ctx, at);
    mpt__free(ctx, codes);
    mpt__free(ctx, index);
    if (b->failed)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "export to TFLite '%s': out of memory (or "
                         "a file past 2 GiB)", g->pl->path);
    return MPT_OK;
}

static void mpt__tfl_free(mpt__tfl *g) {
    mpt_context *ctx = g->pl->m->ctx;
    int i;
    for (i = 0; i < g->n_buffers; i++) mpt__free(ctx, g->buffers[i].data);
    mpt__free(ctx, g->buffers);
    mpt__free(ctx, g->tensors);
    mpt__free(ctx, g->ops);
}

MPTDEF mpt_status mpt_model_export_tflite(mpt_model *m, const char *path,
                                          const mpt_export_desc *desc) {
    mpt__export_plan pl;
    mpt__tfl g;
    mpt__fb b;
    mpt_status s;
    int32_t x, input;
    int64_t shape[MPT_MAX_RANK - 1];
    int i, rank;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    s = mpt__export_plan_init(&pl, m, "TFLite", path, desc);
    if (s != MPT_OK || !mpt__strategy_is_chief(m->strategy)) {
        mpt__export_plan_free(&pl);
        return s;
    }
    memset(&g, 0, sizeof g);
    memset(&b, 0, sizeof b);
    g.pl = &pl;
    b.ctx = m->ctx;
    mpt__tfl_buffer_add(&g, NULL, 0); /* the empty sentinel */
    rank = mpt_model_input_shape(m, shape);
    x = input = mpt__tfl_tensor_add(&g, "input", "", MPT__TFL_FLOAT32, rank, shape, 1, 0);
    for (i = 0; i < pl.n; i++) x = mpt__tfl_step(&g, &pl.steps[i], x);
    if (g.failed)
        s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "export to TFLite '%s': out of memory", path);
    else
        s = mpt__tfl_serialise(&g, input, x, &b);
    if (s == MPT_OK) s = mpt__export_write(m, path, b.data + b.cap - b.size, b.size);
    mpt__free(m->ctx, b.data);
    mpt__tfl_free(&g);
    mpt__export_plan_free(&pl);
    return s;
}

/* =============================================================================
   @impl-export-onnx  the plan as an ONNX file: nodes and initializers in protobuf
   =============================================================================

   Field numbers from onnx/onnx.proto: ModelProto {ir_version 1,
   producer_name 2, producer_version 3, graph 7, opset_import 8};
   OperatorSetIdProto {domain 1, version 2}; GraphProto {node 1, name 2,
   initializer 5, input 11, output 12}; NodeProto {input 1, output 2,
   name 3, op_type 4, attribute 5}; AttributeProto {name 1, f 2, i 3,
   ints 8, type 20}; TensorProto {dims 1, data_type 2, name 8, raw_data 9};
   ValueInfoProto {name 1, type 2}; TypeProto {tensor_type 1};
   TypeProto.Tensor {elem_type 1, shape 2}; TensorShapeProto {dim 1};
   Dimension {dim_value 1, dim_param 2}.
   ONNX convolutions and pooling are NCHW, mpt.h is NHWC: the running value
   is transposed to NCHW before the first of them and back before what
   needs the NHWC order (Flatten, whose element order must be mpt.h's, and
   the output). */

enum { /* TensorProto.DataType */
    MPT__ONNX_FLOAT = 1, MPT__ONNX_UINT8 = 2, MPT__ONNX_INT8 = 3, MPT__ONNX_INT32 = 6,
    MPT__ONNX_FLOAT16 = 10
};
enum { MPT__ONNX_ATTR_INT = 2, MPT__ONNX_ATTR_INTS = 7 }; /* AttributeProto.AttributeType */
#define MPT__ONNX_IR_VERSION 7 /* what opset 13 needs */
#define MPT__ONNX_OPSET 13     /* per-axis QuantizeLinear for a later int8 export */

typedef struct mpt__onnx {
    mpt__export_plan *pl;
    mpt__pb nodes, inits;  /* GraphProto's nodes and initializers, apart      */
    char x[96];            /* the running value's name                        */
    int rank;              /* its rank, the batch included                    */
    int nchw;              /* 4-D and channels first                          */
} mpt__onnx;

static void mpt__onnx_attr_int(mpt__pb *b, const char *name, int64_t v) {
    size_t body = mpt__pb_begin(b, 5);
    mpt__pb_string(b, 1, name);
    mpt__pb_int64(b, 3, v);
    mpt__pb_int64(b, 20, MPT__ONNX_ATTR_INT);
    mpt__pb_end(b, body);
}

static void mpt__onnx_attr_ints(mpt__pb *b, const char *name, const int64_t *v, int n) {
    size_t body = mpt__pb_begin(b, 5);
    int i;
    mpt__pb_string(b, 1, name);
    for (i = 0; i < n; i++) mpt__pb_int64(b, 8, v[i]);
    mpt__pb_int64(b, 20, MPT__ONNX_ATTR_INTS);
    mpt__pb_end(b, body);
}

/* Starts a node op(inputs...) -> output; the caller adds its attributes and
   ends it with mpt__pb_end(&o->nodes, returned body). */
static size_t mpt__onnx_node(mpt__onnx *o, const char *op, const char *output, const char *in0,
                             const char *in1, const char *in2) {
    mpt__pb *b = &o->nodes;
    size_t body = mpt__pb_begin(b, 1);
    mpt__pb_string(b, 1, in0);
    if (in1) mpt__pb_string(b, 1, in1);
    if (in2) mpt__pb_string(b, 1, in2);
    mpt__pb_string(b, 2, output);
    mpt__pb_string(b, 3, output); /* the node is named after what it makes */
    mpt__pb_string(b, 4, op);
    return body;
}

/* name = "<layer>/<what>" into out. */
static const char *mpt__onnx_name(char *out, size_t size, const mpt__layer *L, const char *what) {
    snprintf(out, size, "%s/%s", L->name, what);
    return out;
}

/* A float constant (kernel, bias, scale) as an initializer: float32, or
   float16 with a Cast to float32; `out` receives the float32 value's name. */
/* Starts an initializer (TensorProto {dims, data_type, name, raw_data})
   of `bytes` bytes of data; returns where those go, for the caller to fill
   little-endian (NULL when memory ran out), and *body for
   mpt__pb_end(&o->inits, *body) once they are there. Any data type: float,
   float16, and the int8, uint8 and int32 of quantized tensors. */
static unsigned char *mpt__onnx_initializer(mpt__onnx *o, const char *name, int data_type,
                                            int rank, const int64_t *dims, size_t bytes,
                                            size_t *body) {
    mpt__pb *b = &o->inits;
    int d;
    *body = mpt__pb_begin(b, 5);
    for (d = 0; d < rank; d++) mpt__pb_int64(b, 1, dims[d]);
    mpt__pb_int64(b, 2, data_type);
    mpt__pb_string(b, 8, name);
    mpt__pb_key(b, 9, MPT__PB_LEN); /* raw_data */
    mpt__pb_varint(b, bytes);
    if (!mpt__pb_reserve(b, bytes)) return NULL;
    b->size += bytes;
    return b->data + b->size - bytes;
}

static void mpt__onnx_constant(mpt__onnx *o, const mpt__layer *L, const char *what, int rank,
                               const int64_t *dims, const float *values, int64_t n, char *out,
                               size_t out_size) {
    int half = o->pl->weight_dtype == MPT_FLOAT16;
    size_t body, elem = half ? 2 : 4;
    char stored[96];
    unsigned char *data;
    int64_t i;
    mpt__onnx_name(stored, sizeof stored, L, what);
    data = mpt__onnx_initializer(o, stored, half ? MPT__ONNX_FLOAT16 : MPT__ONNX_FLOAT, rank, dims,
                                 (size_t)n * elem, &body);
    for (i = 0; data && i < n; i++) {
        uint32_t bits;
        if (half) {
            bits = mpt_float_to_half(values[i]);
        } else {
            memcpy(&bits, &values[i], 4);
        }
        mpt__tb_put_le(data + (size_t)i * elem, bits, (int)elem);
    }
    mpt__pb_end(&o->inits, body);
    if (!half) {
        snprintf(out, out_size, "%s", stored);
        return;
    }
    snprintf(out, out_size, "%s_float32", stored);
    body = mpt__onnx_node(o, "Cast", out, stored, NULL, NULL);
    mpt__onnx_attr_int(&o->nodes, "to", MPT__ONNX_FLOAT);
    mpt__pb_end(&o->nodes, body);
}

/* Makes the running value NCHW (nchw = 1) or NHWC (0), by a Transpose when
   it is 4-D and not so already. */
static void mpt__onnx_layout(mpt__onnx *o, const mpt__layer *L, int nchw) {
    static const int64_t to_nchw[4] = {0, 3, 1, 2}, to_nhwc[4] = {0, 2, 3, 1};
    char y[96];
    size_t body;
    if (o->rank != 4 || o->nchw == nchw) return;
    mpt__onnx_name(y, sizeof y, L, nchw ? "nchw" : "nhwc");
    body = mpt__onnx_node(o, "Transpose", y, o->x, NULL, NULL);
    mpt__onnx_attr_ints(&o->nodes, "perm", nchw ? to_nchw : to_nhwc, 4);
    mpt__pb_end(&o->nodes, body);
    snprintf(o->x, sizeof o->x, "%s", y);
    o->nchw = nchw;
}

/* A node of one input with no attributes: op(x) -> "<layer>/<what>". */
static void mpt__onnx_unary(mpt__onnx *o, const mpt__layer *L, const char *op, const char *what) {
    char y[96];
    mpt__onnx_name(y, sizeof y, L, what);
    mpt__pb_end(&o->nodes, mpt__onnx_node(o, op, y, o->x, NULL, NULL));
    snprintf(o->x, sizeof o->x, "%s", y);
}

/* A float32 scalar initializer "<layer>/<what>" (always float32: it is
   part of an op, not a weight). */
static void mpt__onnx_scalar(mpt__onnx *o, const mpt__layer *L, const char *what, float v,
                             char *name, size_t size) {
    size_t body;
    uint32_t bits;
    unsigned char *data;
    mpt__onnx_name(name, size, L, what);
    data = mpt__onnx_initializer(o, name, MPT__ONNX_FLOAT, 0, NULL, 4, &body);
    memcpy(&bits, &v, 4);
    if (data) mpt__tb_put_le(data, bits, 4);
    mpt__pb_end(&o->inits, body);
}

/* A node of two inputs, the running value first: op(x, b) -> "<layer>/<what>". */
static void mpt__onnx_binary(mpt__onnx *o, const mpt__layer *L, const char *op, const char *b,
                             const char *what) {
    char y[96];
    mpt__onnx_name(y, sizeof y, L, what);
    mpt__pb_end(&o->nodes, mpt__onnx_node(o, op, y, o->x, b, NULL));
    snprintf(o->x, sizeof o->x, "%s", y);
}

/* GELU, exact: x · ½(1 + erf(x/√2)), from opset 13's Erf (Gelu itself
   comes in opset 20). */
static void mpt__onnx_gelu(mpt__onnx *o, const mpt__layer *L) {
    char x[96], rsqrt2[96], one[96], half[96];
    snprintf(x, sizeof x, "%s", o->x);
    mpt__onnx_scalar(o, L, "gelu_rsqrt2", 0.70710678118654752f, rsqrt2, sizeof rsqrt2);
    mpt__onnx_scalar(o, L, "gelu_one", 1.0f, one, sizeof one);
    mpt__onnx_scalar(o, L, "gelu_half", 0.5f, half, sizeof half);
    mpt__onnx_binary(o, L, "Mul", rsqrt2, "gelu_scaled");
    mpt__onnx_unary(o, L, "Erf", "gelu_erf");
    mpt__onnx_binary(o, L, "Add", one, "gelu_sum");
    mpt__onnx_binary(o, L, "Mul", half, "gelu_half_sum");
    mpt__onnx_binary(o, L, "Mul", x, "activation");
}

/* The step's activation on the running value (softmax over the channels:
   the last axis, or axis 1 when NCHW). */
static void mpt__onnx_activation(mpt__onnx *o, const mpt__export_step *s) {
    char y[96];
    size_t body;
    switch (s->act) {
    case MPT_ACT_GELU: mpt__onnx_gelu(o, s->L); break;
    case MPT_ACT_RELU: mpt__onnx_unary(o, s->L, "Relu", "activation"); break;
    case MPT_ACT_TANH: mpt__onnx_unary(o, s->L, "Tanh", "activation"); break;
    case MPT_ACT_SIGMOID: mpt__onnx_unary(o, s->L, "Sigmoid", "activation"); break;
    case MPT_ACT_SOFTMAX:
        mpt__onnx_name(y, sizeof y, s->L, "activation");
        body = mpt__onnx_node(o, "Softmax", y, o->x, NULL, NULL);
        mpt__onnx_attr_int(&o->nodes, "axis", o->nchw ? 1 : -1);
        mpt__pb_end(&o->nodes, body);
        snprintf(o->x, sizeof o->x, "%s", y);
        break;
    default: break;
    }
}

/* kernel_shape, strides and pads of a window: ONNX pads are explicit,
   (top, left, bottom, right); 'same' puts the odd pixel at the bottom/right
   as TensorFlow does, and 'valid' pads nothing. */
static void mpt__onnx_window(mpt__pb *b, const mpt__win *g) {
    int64_t k[2], st[2], pads[4];
    k[0] = g->kh;
    k[1] = g->kw;
    st[0] = g->sh;
    st[1] = g->sw;
    pads[0] = g->top;
    pads[1] = g->left;
    pads[2] = MPT__MAX((g->oh - 1) * g->sh + g->kh - g->h - g->top, 0);
    pads[3] = MPT__MAX((g->ow - 1) * g->sw + g->kw - g->w - g->left, 0);
    mpt__onnx_attr_ints(b, "kernel_shape", k, 2);
    mpt__onnx_attr_ints(b, "strides", st, 2);
    mpt__onnx_attr_ints(b, "pads", pads, 4);
}

/* Dense: Gemm(x, kernel (in, units), bias). */
static void mpt__onnx_dense(mpt__onnx *o, const mpt__export_step *s) {
    char kernel[128], bias[128], y[96];
    int64_t dims[2];
    dims[1] = s->bias_count;
    dims[0] = s->kernel_count / dims[1];
    mpt__onnx_constant(o, s->L, "kernel", 2, dims, s->kernel, s->kernel_count, kernel,
                       sizeof kernel);
    mpt__onnx_constant(o, s->L, "bias", 1, &dims[1], s->bias, dims[1], bias, sizeof bias);
    mpt__onnx_name(y, sizeof y, s->L, "linear");
    mpt__pb_end(&o->nodes, mpt__onnx_node(o, "Gemm", y, o->x, kernel, bias));
    snprintf(o->x, sizeof o->x, "%s", y);
    mpt__onnx_activation(o, s);
}

/* Conv2D: Conv(x NCHW, kernel (F, C, kh, kw), bias). */
static void mpt__onnx_conv2d(mpt__onnx *o, const mpt__export_step *s) {
    int64_t F = s->bias_count, C = s->g.c, khw = s->g.kh * s->g.kw, dims[4], p, c, f;
    float *w = (float *)mpt__alloc(o->pl->m->ctx, sizeof(float) * (size_t)s->kernel_count + 1);
    char kernel[128], bias[128], y[96];
    size_t body;
    if (!w) {
        o->nodes.failed = 1;
        return;
    }
    for (p = 0; p < khw; p++) /* (kh·kw, C, F) -> (F, C, kh·kw) */
        for (c = 0; c < C; c++)
            for (f = 0; f < F; f++) w[(f * C + c) * khw + p] = s->kernel[(p * C + c) * F + f];
    dims[0] = F;
    dims[1] = C;
    dims[2] = s->g.kh;
    dims[3] = s->g.kw;
    mpt__onnx_constant(o, s->L, "kernel", 4, dims, w, s->kernel_count, kernel, sizeof kernel);
    mpt__free(o->pl->m->ctx, w);
    mpt__onnx_constant(o, s->L, "bias", 1, &F, s->bias, F, bias, sizeof bias);
    mpt__onnx_layout(o, s->L, 1);
    mpt__onnx_name(y, sizeof y, s->L, "linear");
    body = mpt__onnx_node(o, "Conv", y, o->x, kernel, bias);
    mpt__onnx_window(&o->nodes, &s->g);
    mpt__pb_end(&o->nodes, body);
    snprintf(o->x, sizeof o->x, "%s", y);
    mpt__onnx_activation(o, s);
}

/* Scale and shift per channel: Mul and Add, the constants shaped (C, 1, 1)
   when NCHW so that they broadcast over the channels. */
static void mpt__onnx_scale_shift(mpt__onnx *o, const mpt__export_step *s) {
    int64_t dims[3];
    int rank = o->nchw ? 3 : 1;
    char scale[128], shift[128], y[96];
    dims[0] = s->bias_count;
    dims[1] = dims[2] = 1;
    mpt__onnx_constant(o, s->L, "scale", rank, dims, s->kernel, s->bias_count, scale, sizeof scale);
    mpt__onnx_constant(o, s->L, "shift", rank, dims, s->bias, s->bias_count, shift, sizeof shift);
    mpt__onnx_name(y, sizeof y, s->L, "scaled");
    mpt__pb_end(&o->nodes, mpt__onnx_node(o, "Mul", y, o->x, scale, NULL));
    snprintf(o->x, sizeof o->x, "%s", y);
    mpt__onnx_name(y, sizeof y, s->L, "shifted");
    mpt__pb_end(&o->nodes, mpt__onnx_node(o, "Add", y, o->x, shift, NULL));
    snprintf(o->x, sizeof o->x, "%s", y);
}

static void mpt__onnx_flatten(mpt__onnx *o, const mpt__layer *L) {
    char y[96];
    size_t body;
    mpt__onnx_layout(o, L, 0); /* mpt.h's vectors are in NHWC order */
    mpt__onnx_name(y, sizeof y, L, "flat");
    body = mpt__onnx_node(o, "Flatten", y, o->x, NULL, NULL);
    mpt__onnx_attr_int(&o->nodes, "axis", 1);
    mpt__pb_end(&o->nodes, body);
    snprintf(o->x, sizeof o->x, "%s", y);
    o->rank = 2;
    o->nchw = 0;
}

static void mpt__onnx_step(mpt__onnx *o, const mpt__export_step *s) {
    char y[96];
    size_t body;
    switch (s->kind) {
    case MPT__EXPORT_DENSE: mpt__onnx_dense(o, s); break;
    case MPT__EXPORT_CONV2D: mpt__onnx_conv2d(o, s); break;
    case MPT__EXPORT_MAX_POOL:
    case MPT__EXPORT_AVG_POOL:
        mpt__onnx_layout(o, s->L, 1);
        mpt__onnx_name(y, sizeof y, s->L, "pooled");
        body = mpt__onnx_node(o, s->kind == MPT__EXPORT_MAX_POOL ? "MaxPool" : "AveragePool", y,
                              o->x, NULL, NULL);
        mpt__onnx_window(&o->nodes, &s->g); /* AveragePool: count_include_pad 0, as Keras */
        mpt__pb_end(&o->nodes, body);
        snprintf(o->x, sizeof o->x, "%s", y);
        break;
    case MPT__EXPORT_GLOBAL_AVG_POOL: /* (N, C, 1, 1), then (N, C) */
        mpt__onnx_layout(o, s->L, 1);
        mpt__onnx_unary(o, s->L, "GlobalAveragePool", "pooled");
        mpt__onnx_flatten(o, s->L);
        break;
    case MPT__EXPORT_FLATTEN: mpt__onnx_flatten(o, s->L); break;
    case MPT__EXPORT_ACTIVATION: mpt__onnx_activation(o, s); break;
    case MPT__EXPORT_SCALE_SHIFT: mpt__onnx_scale_shift(o, s); break;
    }
}

/* ValueInfoProto: name, float32, (N, shape...) with N free. */
static void mpt__onnx_value_info(mpt__pb *b, int field, const char *name, int rank,
                                 const int64_t *shape) {
    size_t info = mpt__pb_begin(b, field), type, tensor, dims, dim;
    int i;
    mpt__pb_string(b, 1, name);
    type = mpt__pb_begin(b, 2);
    tensor = mpt__pb_begin(b, 1);
    mpt__pb_int64(b, 1, MPT__ONNX_FLOAT);
    dims = mpt__pb_begin(b, 2);
    dim = mpt__pb_begin(b, 1);
    mpt__pb_string(b, 2, "N");
    mpt__pb_end(b, dim);
    for (i = 0; i < rank; i++) {
        dim = mpt__pb_begin(b, 1);
        mpt__pb_int64(b, 1, shape[i]);
        mpt__pb_end(b, dim);
    }
    mpt__pb_end(b, dims);
    mpt__pb_end(b, tensor);
    mpt__pb_end(b, type);
    mpt__pb_end(b, info);
}

/* ModelProto around the nodes and initializers; the running value is the
   output, one sample of shape out_shape (out_rank). */
static void mpt__onnx_model(mpt__onnx *o, int in_rank, const int64_t *in_shape, int out_rank,
                            const int64_t *out_shape, mpt__pb *b) {
    size_t graph, opset, body;
    body = mpt__onnx_node(o, "Identity", "output", o->x, NULL, NULL);
    mpt__pb_end(&o->nodes, body);
    mpt__pb_int64(b, 1, MPT__ONNX_IR_VERSION);
    mpt__pb_string(b, 2, "mpt.h");
    mpt__pb_string(b, 3, MPT_VERSION);
    opset = mpt__pb_begin(b, 8);
    mpt__pb_int64(b, 2, MPT__ONNX_OPSET);
    mpt__pb_end(b, opset);
    graph = mpt__pb_begin(b, 7);
    mpt__pb_bytes(b, o->nodes.data, o->nodes.size);
    mpt__pb_string(b, 2, "mpt");
    mpt__pb_bytes(b, o->inits.data, o->inits.size);
    mpt__onnx_value_info(b, 11, "input", in_rank, in_shape);
    mpt__onnx_value_info(b, 12, "output", out_rank, out_shape);
    mpt__pb_end(b, graph);
    if (o->nodes.failed || o->inits.failed) b->failed = 1;
}

MPTDEF mpt_status mpt_model_export_onnx(mpt_model *m, const char *path,
                                        const mpt_export_desc *desc) {
    mpt__export_plan pl;
    mpt__onnx o;
    mpt__pb b;
    mpt_status s;
    int64_t in_shape[MPT_MAX_RANK - 1], out_shape[MPT_MAX_RANK - 1];
    int i, in_rank, out_rank;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    s = mpt__export_plan_init(&pl, m, "ONNX", path, desc);
    if (s != MPT_OK || !mpt__strategy_is_chief(m->strategy)) {
        mpt__export_plan_free(&pl);
        return s;
    }
    memset(&o, 0, sizeof o);
    memset(&b, 0, sizeof b);
    o.pl = &pl;
    o.nodes.ctx = o.inits.ctx = b.ctx = m->ctx;
    snprintf(o.x, sizeof o.x, "input");
    o.rank = 1 + m->desc.input_rank;
    o.nchw = 0;
    for (i = 0; i < pl.n; i++) mpt__onnx_step(&o, &pl.steps[i]);
    if (pl.n) mpt__onnx_layout(&o, pl.steps[pl.n - 1].L, 0); /* the output is NHWC */
    in_rank = mpt_model_input_shape(m, in_shape);
    out_rank = pl.n ? mpt__export_out_shape(&pl.steps[pl.n - 1], out_shape) : in_rank;
    if (!pl.n) memcpy(out_shape, in_shape, sizeof in_shape);
    mpt__onnx_model(&o, in_rank, in_shape, out_rank, out_shape, &b);
    if (b.failed)
        s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "export to ONNX '%s': out of memory", path);
    else
        s = mpt__export_write(m, path, b.data, b.size);
    mpt__free(m->ctx, b.data);
    mpt__free(m->ctx, o.nodes.data);
    mpt__free(m->ctx, o.inits.data);
    mpt__export_plan_free(&pl);
    return s;
}

/* =============================================================================
   @impl-cpu-backend  the CPU's implementation of @backend's table
   =============================================================================

   Memory is the context's allocator's; "copies" between host and backend
   are memcpy; every compute function runs at once on the context's thread
   pool (the reference code lives with its layer, loss or optimizer above).
   Nothing is queued, so sync has nothing to wait for, and there is nothing
   to record for a replay. */

static mpt_status mpt__cpu_alloc(void *impl, int category, size_t bytes, void **out) {
    mpt_context *ctx = (mpt_context *)impl;
    (void)category;
    *out = NULL;
    if (bytes == 0) return MPT_OK;
    *out = mpt__alloc(ctx, bytes);
    if (*out) return MPT_OK;
    snprintf(ctx->error, sizeof ctx->error, "cannot allocate %zu bytes", bytes);
    return MPT_ERR_OUT_OF_MEMORY;
}

static void mpt__cpu_free(void *impl, int category, void *ptr) {
    (void)category;
    mpt__free((mpt_context *)impl, ptr);
}

static mpt_status mpt__cpu_alloc_host(void *impl, size_t bytes, void **out) {
    return mpt__cpu_alloc(impl, 0, bytes, out);
}

static void mpt__cpu_free_host(void *impl, void *ptr) { mpt__free((mpt_context *)impl, ptr); }

static mpt_status mpt__cpu_upload(void *impl, void *dst, const void *src, size_t bytes) {
    (void)impl;
    if (bytes) memmove(dst, src, bytes);
    return MPT_OK;
}

static void mpt__cpu_upload_async(void *impl, void *dst, const void *src, size_t bytes) {
    mpt__cpu_upload(impl, dst, src, bytes);
}

static void mpt__cpu_copy(void *impl, void *dst, const void *src, size_t bytes) {
    mpt__cpu_upload(impl, dst, src, bytes);
}

static void mpt__cpu_zero(void *impl, void *dst, size_t bytes) {
    (void)impl;
    if (bytes) memset(dst, 0, bytes);
}

static mpt_status mpt__cpu_ok(void *impl) {
    (void)impl;
    return MPT_OK;
}

static void mpt__cpu_nothing(void *impl) { (void)impl; }

static const char *mpt__cpu_error(void *impl) { return ((mpt_context *)impl)->error; }

static mpt_status mpt__cpu_no_capture(void *impl) {
    snprintf(((mpt_context *)impl)->error, sizeof ((mpt_context *)impl)->error,
             "the CPU backend records no graphs");
    return MPT_ERR_UNSUPPORTED;
}

static mpt_status mpt__cpu_capture_end(void *impl, void **graph) {
    *graph = NULL;
    return mpt__cpu_no_capture(impl);
}

static mpt_status mpt__cpu_replay(void *impl, void *graph) {
    (void)graph;
    return mpt__cpu_no_capture(impl);
}

static void mpt__cpu_graph_free(void *impl, void *graph) {
    (void)impl;
    (void)graph;
}

/* The CPU's GEMM stores C in float32 only (gemm_rounds_c is 0). */
static void mpt__cpu_gemm(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    (void)c_dtype;
    mpt__gemm((mpt_context *)impl, d);
}

static void mpt__cpu_convert(void *impl, mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                             const void *src, int64_t n) {
    mpt__convert((const mpt_context *)impl, dst_dtype, dst, src_dtype, src, n);
}

static void mpt__cpu_activation(void *impl, mpt_activation act, float *x, int64_t rows,
                                int64_t cols) {
    (void)impl;
    if (act == MPT_ACT_SOFTMAX)
        mpt__softmax_rows(x, rows, cols);
    else
        mpt__activation_forward(act, x, rows * cols);
}

static void mpt__cpu_activation_grad(void *impl, mpt_activation act, mpt_dtype dtype,
                                     const void *z, const void *y, const void *dy, float *dz,
                                     float *tmp, int64_t rows, int64_t cols) {
    mpt__activation_grad((mpt_context *)impl, act, dtype, z, y, dy, dz, tmp, rows * cols, cols);
}

static void mpt__cpu_column_sums(void *impl, const float *dz, int64_t rows, int64_t cols,
                                 float *out, int accumulate) {
    (void)impl;
    if (!accumulate) memset(out, 0, sizeof(float) * (size_t)cols);
    mpt__add_column_sums(dz, rows, cols, out);
}

typedef struct mpt__add_job {
    float *dst;
    const float *src;
    int64_t n;
} mpt__add_job;

enum { MPT__ADD_CHUNK = 1 << 16 };

static void mpt__add_task(void *arg, int64_t task, int thread) {
    const mpt__add_job *j = (const mpt__add_job *)arg;
    int64_t i0 = task * MPT__ADD_CHUNK;
    (void)thread;
    mpt__add_f32(j->dst + i0, j->src + i0, MPT__MIN((int64_t)MPT__ADD_CHUNK, j->n - i0));
}

static void mpt__cpu_add(void *impl, float *dst, const float *src, int64_t n) {
    mpt__add_job j;
    j.dst = dst;
    j.src = src;
    j.n = n;
    mpt__parallel_for((mpt_context *)impl, (n + MPT__ADD_CHUNK - 1) / MPT__ADD_CHUNK, mpt__add_task,
                      &j);
}

static void mpt__cpu_scale(void *impl, float *x, float alpha, int64_t n) {
    int64_t i;
    (void)impl;
    for (i = 0; i < n; i++) x[i] *= alpha;
}

/* The table, filled by name (C++17, which mpt.h also compiles as, has no
   designated initializers): a member added to mpt_backend cannot shift the
   others. The slots left NULL are the optional ones (@backend). */
static void mpt__cpu_table_fill(mpt_backend *t) {
    memset(t, 0, sizeof *t);
    t->name = "cpu";
    t->gemm_rounds_c = 0;
    t->can_capture = 0;
    t->alloc = mpt__cpu_alloc;
    t->free = mpt__cpu_free;
    t->alloc_host = mpt__cpu_alloc_host;
    t->free_host = mpt__cpu_free_host;
    t->upload = mpt__cpu_upload;
    t->download = mpt__cpu_upload; /* the same memmove */
    t->upload_async = mpt__cpu_upload_async;
    t->upload_wait = mpt__cpu_nothing;
    t->upload_done = mpt__cpu_ok;
    t->copy = mpt__cpu_copy;
    t->zero = mpt__cpu_zero;
    t->sync = mpt__cpu_ok;
    t->error = mpt__cpu_error;
    t->destroy = mpt__cpu_nothing;
    t->capture_begin = mpt__cpu_no_capture;
    t->capture_end = mpt__cpu_capture_end;
    t->replay = mpt__cpu_replay;
    t->graph_free = mpt__cpu_graph_free;
    t->gemm = mpt__cpu_gemm;
    t->gemm_plan = NULL; /* nothing to choose */
    t->convert = mpt__cpu_convert;
    t->activation = mpt__cpu_activation;
    t->activation_grad = mpt__cpu_activation_grad;
    t->column_sums = mpt__cpu_column_sums;
    t->im2col = mpt__cpu_im2col;
    t->col2im = mpt__cpu_col2im;
    t->conv_direct = mpt__cpu_conv_direct;
    t->pool_forward = mpt__cpu_pool_forward;
    t->pool_backward = mpt__cpu_pool_backward;
    t->pool_workspace = mpt__cpu_pool_workspace;
    t->batchnorm_forward = mpt__cpu_batchnorm_forward;
    t->batchnorm_backward = mpt__cpu_batchnorm_backward;
    t->batchnorm_commit = mpt__cpu_batchnorm_commit;
    t->batchnorm_workspace = mpt__cpu_batchnorm_workspace;
    t->dropout = mpt__cpu_dropout;
    t->loss = mpt__cpu_loss;
    t->grad_stats = mpt__cpu_grad_stats;
    t->update = mpt__cpu_update;
    t->loss_scale_update = mpt__cpu_loss_scale_update;
    t->add = mpt__cpu_add;
    t->scale = mpt__cpu_scale;
    /* no collectives (comm_*, allreduce_sum): the replicas share memory */
}

static mpt_backend mpt__cpu_table;
static pthread_once_t mpt__cpu_table_once = PTHREAD_ONCE_INIT;

static void mpt__cpu_table_init(void) { mpt__cpu_table_fill(&mpt__cpu_table); }

/* The one CPU table every context shares (models tell the CPU by its
   address), filled once, before any thread reads it. */
static const mpt_backend *mpt__cpu_backend(void) {
    pthread_once(&mpt__cpu_table_once, mpt__cpu_table_init);
    return &mpt__cpu_table;
}

#endif /* MPT__IMPLEMENTED */
#endif /* MPT_IMPLEMENTATION */

/*
MIT License

Copyright (c) 2026 the mpt.h authors

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
*/

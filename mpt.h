/* mpt.h — mixed-precision training of neural networks in one C header.

   FP16/BF16 compute, FP32 master weights and Keras-style layers on the CPU,
   with a CUDA backend and a mirrored (data-parallel) strategy to come.

   Do this:
       #define MPT_IMPLEMENTATION
   before you include this file in *one* C or C++ file to create the
   implementation. Every other file includes it for the API alone.

       #include ...
       #define MPT_IMPLEMENTATION
       #include "mpt.h"

   Build line (pthreads, libm):
       cc -O2 my_trainer.c -lpthread -lm -o my_trainer

   OPTIONAL DEFINES
       MPT_STATIC     make every function static to the implementing file.
       MPT_NO_SIMD    compile only the portable paths (no AVX2/AVX-512/F16C);
                      without it those paths are chosen at run time by CPUID.

   ENVIRONMENT
       MPT_NUM_THREADS   threads of a context whose descriptor leaves
                         num_threads at 0 (default: the online CPUs).

   ONE COMPLETE EXAMPLE (a forward and backward pass of a small MLP)

       mpt_context *ctx;
       mpt_context_create(&(mpt_context_desc){ 0 }, &ctx);
       mpt_model *m;
       mpt_model_create(ctx, &(mpt_model_desc){
           .input_shape = { 784 }, .input_rank = 1,
           .policy = MPT_POLICY_MIXED_BFLOAT16, .seed = 42 }, &m);
       mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 1024,
                                                 .activation = MPT_ACT_RELU });
       mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10 });
       if (mpt_model_build(m, 128) != MPT_OK)
           fprintf(stderr, "%s\n", mpt_context_error(ctx));
       mpt_tensor logits;
       mpt_model_forward(m, &images, 1, &logits);   // images: (128, 784) float32
       double loss;
       mpt_tensor dlogits;
       mpt_model_output_grad(m, &dlogits);           // where the loss gradient goes
       mpt_loss_compute(ctx, &(mpt_loss_desc){
           .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1 },
           &logits, &labels, &loss, &dlogits);
       mpt_model_backward(m, NULL);                  // gradients of every parameter
       mpt_model_destroy(m);
       mpt_context_destroy(ctx);

   CONTENTS (each section has a banner; grep for "@section-name")
       @status       status codes, error strings, logging
       @context      the context: allocator, logger, thread pool, CPU features
       @dtypes       dtypes, float16/bfloat16 conversions
       @tensors      shapes and tensors
       @gemm         the CPU matrix product
       @rng          the counter-based random numbers
       @layers       layer descriptors and the sequential model
       @losses       loss functions
       @impl-*       the same sections again, implemented

   CONVENTIONS
       Public names start with mpt_, private ones with mpt__, macros and enum
       values with MPT_. Functions that can fail return mpt_status; on failure
       the context holds a message naming the layer, file, shape or value
       (mpt_context_error) and the logger has been told. Nothing aborts or
       exits on a caller's mistake. Sizes are int64_t. Images are NHWC.
       Descriptor structs are zero-initialised for defaults; each field's
       comment gives its default.

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
    MPT_CPU_AVX512_BF16 = 1 << 3  /* AVX-512 BF16 dot products      */
};

typedef struct mpt_context_desc {
    int num_threads;         /* default 0: $MPT_NUM_THREADS, else the online CPUs */
    int disable_cpu_features;/* default 0: MPT_CPU_* bits never to use (tests use
                                this to run the portable paths)                */
    mpt_allocator allocator; /* default: malloc/free                          */
    mpt_logger logger;       /* default: errors and warnings to stderr        */
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

/* C = alpha · op(A) · op(B) + beta · C, then C = act(C + bias) when asked.
   op(A) is M×K, op(B) is K×N, C is M×N, all row-major with leading
   dimensions lda, ldb, ldc (in elements). A and B may be float32, float16
   or bfloat16 (both the same dtype); accumulation and C are float32.
   Work is split over rows and columns of C, never over K, so the result is
   the same whatever the thread count. */
/* "relu", "softmax", ...: the Keras name; "?" if unknown. */
MPTDEF const char *mpt_activation_name(mpt_activation act);

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

typedef struct mpt_batchnorm_desc {
    MPT_LAYER_COMMON_FIELDS;
    float momentum;                     /* default (0) 0.99; for a momentum of
                                           exactly 0 give a tiny value       */
    float epsilon;                      /* default (0) 1e-3; must be > 0     */
    int no_center;                      /* default 0: beta is used          */
    int no_scale;                       /* default 0: gamma is used         */
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

typedef struct mpt_model_desc {
    int64_t input_shape[MPT_MAX_RANK - 1]; /* required: one sample's shape,
                                              e.g. {28, 28, 1} (HWC)         */
    int input_rank;                         /* required: 1..3                 */
    mpt_policy policy;                      /* default float32                */
    uint64_t seed;                          /* default 0; weights and dropout
                                               masks follow from it          */
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
                                                         const mpt_flatten_desc *desc);
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

/* One sample's input shape (as given to mpt_model_create); returns its rank. */
MPTDEF int mpt_model_input_shape(const mpt_model *m, int64_t *shape);
MPTDEF int mpt_model_layer_count(const mpt_model *m);
MPTDEF const char *mpt_model_layer_name(const mpt_model *m, int index);
/* The compute dtype a layer resolved to (after build). */
MPTDEF mpt_dtype mpt_model_layer_dtype(const mpt_model *m, int index);
/* One sample's output shape of a layer (after build); returns its rank. */
MPTDEF int mpt_model_layer_output_shape(const mpt_model *m, int index, int64_t *shape);

/* =============================================================================
   @losses: loss functions
   ============================================================================= */

typedef enum mpt_loss_type {
    MPT_LOSS_NONE = 0,
    MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, /* target: int32 class ids (batch) */
    MPT_LOSS_CATEGORICAL_CROSSENTROPY,        /* target: one-hot/probabilities   */
    MPT_LOSS_BINARY_CROSSENTROPY,             /* target: 0..1, same shape        */
    MPT_LOSS_MEAN_SQUARED_ERROR,              /* target: same shape              */
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

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    mpt_allocator allocator;
    mpt_logger logger;
    int num_threads;
    int cpu;                    /* MPT_CPU_* in use */
    mpt__pool pool;
    mpt__worker_arg *worker_args;
    void **scratch;             /* [num_threads] × MPT__THREAD_SCRATCH_BYTES */
    char error[1024];
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

static void *mpt__alloc(const mpt_context *ctx, size_t bytes) {
    if (bytes == 0) bytes = 1;
    return ctx->allocator.alloc(ctx->allocator.user_data, bytes, MPT__ALIGN);
}

static void *mpt__calloc(const mpt_context *ctx, size_t bytes) {
    void *p = mpt__alloc(ctx, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

static void mpt__free(const mpt_context *ctx, void *ptr) {
    if (ptr) ctx->allocator.free(ctx->allocator.user_data, ptr);
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
   that error paths read `return mpt__fail(ctx, MPT_ERR_SHAPE, "...", ...);`. */
static mpt_status mpt__fail(mpt_context *ctx, mpt_status status, const char *fmt, ...) {
    va_list ap;
    if (!ctx) return status;
    va_start(ap, fmt);
    vsnprintf(ctx->error, sizeof ctx->error, fmt, ap);
    va_end(ap);
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
        unsigned a, b, c, d;
        __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
        if ((c >> 29) & 1u && (f & MPT_CPU_AVX2)) f |= MPT_CPU_F16C;
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        (f & MPT_CPU_AVX2) && (f & MPT_CPU_F16C))
        f |= MPT_CPU_AVX512;
    if ((f & MPT_CPU_AVX512) && __builtin_cpu_supports("avx512bf16")) f |= MPT_CPU_AVX512_BF16;
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

MPTDEF void mpt_context_destroy(mpt_context *ctx) {
    int i;
    if (!ctx) return;
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
    *out = ctx;
    return MPT_OK;
fail:
    mpt_context_destroy(ctx);
    return s;
}

MPTDEF const char *mpt_context_error(const mpt_context *ctx) { return ctx ? ctx->error : ""; }
MPTDEF int mpt_context_num_threads(const mpt_context *ctx) { return ctx ? ctx->num_threads : 0; }
MPTDEF int mpt_context_cpu_features(const mpt_context *ctx) { return ctx ? ctx->cpu : 0; }

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

#include "wip/convert.h"

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
    case MPT_ACT_RELU: for (i = 0; i < n; i++) x[i] = x[i] > 0 ? x[i] : 0; break;
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
    case MPT_ACT_RELU: for (i = 0; i < n; i++) dz[i] = y[i] > 0 ? dy[i] : 0; break;
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

#include "wip/gemm.h"


/* =============================================================================
   @impl-rng
   ============================================================================= */

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
   3", 2011): ten rounds of multiply-xor over a 128-bit counter keyed by 64
   bits. Counter-based, so element i of a dropout mask or of an initial
   weight tensor is the same however the work is split. */
MPTDEF void mpt_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo,
                           uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter_lo, c1 = (uint32_t)(counter_lo >> 32);
    uint32_t c2 = (uint32_t)counter_hi, c3 = (uint32_t)(counter_hi >> 32);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    int round;
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

/* A uniform float in [0, 1) from 24 random bits. */
static float mpt__uniform01(uint32_t bits) { return (float)(bits >> 8) * (1.0f / 16777216.0f); }

/* SplitMix64, to derive independent keys (one per parameter, per layer) from
   the model's seed. */
static uint64_t mpt__mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#include "wip/model.h"
#include "wip/dense.h"
#include "wip/conv.h"
#include "wip/norm.h"
#include "wip/losses.h"

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

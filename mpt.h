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

   Build line (pthreads, libm, zlib):
       cc -O2 my_trainer.c -lpthread -lm -lz -o my_trainer

   OPTIONAL DEFINES
       MPT_STATIC     make every function static to the implementing file.
       MPT_NO_SIMD    compile only the portable paths (no AVX2/AVX-512/F16C);
                      without it those paths are chosen at run time by CPUID.
       MPT_NO_ZLIB    build without zlib (no -lz): gzip-compressed IDX files
                      then give MPT_ERR_UNSUPPORTED; plain ones still load.

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
       @optimizers   optimizers, learning-rate schedules, loss scaling
       @training     compile, fit, evaluate, predict, summary, history
       @data         datasets: caller arrays, IDX files
       @callbacks    EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger
       @checkpoints  safetensors weights and full training state
     implementation, in the same order:
       @impl-status @impl-context @impl-dtypes @impl-tensors
       @impl-activations @impl-gemm @impl-rng
       @impl-layers (the layer interface, the plan, forward and backward)
       @impl-dense @impl-flatten @impl-activation @impl-windows
       @impl-conv2d @impl-pooling @impl-batchnorm @impl-dropout
       @impl-losses

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
                                           training data, taken before shuffling */
    int verbose;                        /* 0 silent (default), 1 progress bar,
                                           2 one line per epoch (Keras)        */
    const mpt_callback *callbacks;      /* default none                        */
    int n_callbacks;
    mpt_printer printer;                /* default stdout                      */
} mpt_fit_desc;

/* Trains on `train` (builds the model for batch_size first if it is not
   built). Shuffling follows the model's seed and the epoch, so a run is
   reproducible. The history of every epoch is kept (mpt_model_history). */
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

/* Writes a Keras-like table (layer, output shape, parameters, compute dtype,
   then memory per category) into buf; returns the length it needs, like
   snprintf. The model must be built. */
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
                              float32 targets                              */
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
   numbers, dimensions, counts and truncation. */
MPTDEF mpt_status mpt_dataset_load_idx(mpt_context *ctx, const char *images_path,
                                       const char *labels_path, mpt_dataset **out);
/* The training or test part of an MNIST-format directory (Fashion-MNIST's
   train-images-idx3-ubyte.gz, t10k-..., with or without .gz). */
MPTDEF mpt_status mpt_dataset_load_mnist(mpt_context *ctx, const char *dir, int test,
                                         mpt_dataset **out);
MPTDEF int64_t mpt_dataset_count(const mpt_dataset *d);
/* One sample's shape; returns its rank. */
MPTDEF int mpt_dataset_sample_shape(const mpt_dataset *d, int64_t *shape);
/* Two views sharing d's data: samples [0, first) and [first, n), with
   first in 1..n-1; head or tail may be NULL. The views and d may be
   destroyed in any order. */
MPTDEF mpt_status mpt_dataset_split(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                    mpt_dataset **head, mpt_dataset **tail);
MPTDEF void mpt_dataset_destroy(mpt_dataset *d);

/* =============================================================================
   @callbacks: EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger
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

/* Each creates a callback whose state it owns; pass *out in fit's callbacks
   and free it with mpt_callback_destroy (which takes only callbacks made by
   these four functions, or zeroed ones). Messages go to fit's printer.
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
MPTDEF void mpt_callback_destroy(mpt_callback *cb);

/* =============================================================================
   @checkpoints: safetensors files
   ============================================================================= */

/* The float32 weights (every parameter, trainable or not) as a safetensors
   file, written to a temporary file, fsync'ed, then renamed into place. */
MPTDEF mpt_status mpt_model_save_weights(mpt_model *m, const char *path);
/* Loads weights saved by save_weights or save_checkpoint; every name,
   dtype and shape must match the model (the model is left unchanged if
   anything does not). */
MPTDEF mpt_status mpt_model_load_weights(mpt_model *m, const char *path);
/* The full training state: weights ("dense/kernel", ...), optimizer moments
   ("optimizer/dense/kernel/m", ...), step counters, loss scale and its
   counter, learning rate and epoch ("train/..."), and the model's
   description, policy and seed in __metadata__. Loaded into a model built
   the same way with the same seed (a different seed is only warned about:
   the seed orders the data and keys dropout), fit continues from it
   bit-identically on the CPU (pass initial_epoch = mpt_model_epoch). The
   model is unchanged when a check fails; only a read error after every
   check has passed can leave the weights partly loaded, and says so. */
MPTDEF mpt_status mpt_model_save_checkpoint(mpt_model *m, const char *path);
MPTDEF mpt_status mpt_model_load_checkpoint(mpt_model *m, const char *path);
/* Epochs completed, as recorded by fit and restored by load_checkpoint. */
MPTDEF int mpt_model_epoch(const mpt_model *m);

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
#include <sys/time.h>
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

/* Needs AVX2, and F16C for the pairs that involve float16. */
static MPT__TARGET_AVX2 void mpt__convert_avx2(mpt_dtype dst_dtype, void *dst,
                                              mpt_dtype src_dtype, const void *src,
                                              int64_t n) {
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16)
        mpt__avx2_loop(MPT_FLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_BFLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_FLOAT32, dst, MPT_FLOAT16, src, n);
    else if (src_dtype == MPT_FLOAT16)
        mpt__avx2_loop(MPT_BFLOAT16, dst, MPT_FLOAT16, src, n);
    else if (dst_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_FLOAT32, dst, MPT_BFLOAT16, src, n);
    else
        mpt__avx2_loop(MPT_FLOAT16, dst, MPT_BFLOAT16, src, n);
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
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16)
        mpt__avx512_loop(MPT_FLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_BFLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_FLOAT32, dst, MPT_FLOAT16, src, n);
    else if (src_dtype == MPT_FLOAT16)
        mpt__avx512_loop(MPT_BFLOAT16, dst, MPT_FLOAT16, src, n);
    else if (dst_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_FLOAT32, dst, MPT_BFLOAT16, src, n);
    else
        mpt__avx512_loop(MPT_FLOAT16, dst, MPT_BFLOAT16, src, n);
}
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

static float mpt__load_f32(mpt_dtype dtype, const void *p, int64_t i) {
    switch (dtype) {
    case MPT_FLOAT16: return mpt_half_to_float(((const mpt_half *)p)[i]);
    case MPT_BFLOAT16: return mpt_bf16_to_float(((const mpt_bf16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

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
            if (e->relu) v = v > 0 ? v : 0;
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
    if (e->relu) v = _mm256_max_ps(v, _mm256_setzero_ps());
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
    /* (x > 0 ? x : 0, as the scalar ReLU: NaN and -0 give +0.) */
    if (e->relu) v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), v);
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
        int64_t tn = target / tm, rows, cols, nblocks;
        double cost;
        if (target % tm || tm > units_m || tn > units_n) continue;
        rows = (units_m + tm - 1) / tm;
        cols = ((units_n + tn - 1) / tn) * job->nr;
        nblocks = (cols + job->nc - 1) / job->nc;
        (void)rows;
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
    int64_t nkb, tasks_m;
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
    /* Equal depth blocks of at most KC, a multiple of 8 (so pairs never
       straddle blocks); this depends on K only. */
    nkb = (d->k + MPT__GEMM_KC - 1) / MPT__GEMM_KC;
    job.kc = ((d->k + nkb - 1) / nkb + 7) / 8 * 8;
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
    if (!d) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: NULL descriptor");
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

/* =============================================================================
   @impl-layers: the layer interface and the sequential model
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
} mpt__param;

typedef union mpt__layer_desc {
    mpt_dense_desc dense;
    mpt_conv2d_desc conv2d;
    mpt_pool2d_desc pool2d;
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

typedef enum mpt__category {
    MPT__MEM_PARAMS,      /* float32 master weights             */
    MPT__MEM_GRADS,       /* float32 gradients                  */
    MPT__MEM_OPTIMIZER,   /* float32 optimizer state (slots)    */
    MPT__MEM_WEIGHT_COPY, /* compute-dtype copies of weights    */
    MPT__MEM_ACTIVATIONS, /* outputs, saved buffers, gradients  */
    MPT__MEM_WORKSPACE,   /* scratch shared by all layers       */
    MPT__MEM_COUNT_
} mpt__category;

struct mpt_model {
    mpt_context *ctx;
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
    void *grad_buf[2];                   /* ping-pong activation gradients */
    int64_t last_batch;                  /* of the last forward, 0 if none */
    int last_training;
    int emit_logits;                     /* the last layer skips its softmax */
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
};

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

/* A parameter as the layer reads it (compute dtype) and its float32 forms. */
static const void *mpt__pw(const mpt__layer *L, int k) { return L->param[k]->compute; }
static float *mpt__pv(const mpt__layer *L, int k) { return L->param[k]->value; }
static float *mpt__pg(const mpt__layer *L, int k) { return L->param[k]->grad; }

/* ---- building a model ----------------------------------------------------- */

MPTDEF mpt_status mpt_model_create(mpt_context *ctx, const mpt_model_desc *desc,
                                   mpt_model **out) {
    mpt_model *m;
    int i;
    char s[96];
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!desc || !out)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL %s", desc ? "out" : "desc");
    *out = NULL;
    if (desc->input_rank < 1 || desc->input_rank > MPT_MAX_RANK - 1)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "model: input_rank %d is not in 1..%d (one sample, without the batch)",
                         desc->input_rank, MPT_MAX_RANK - 1);
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
    m = (mpt_model *)mpt__calloc(ctx, sizeof *m);
    if (!m) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "model: out of memory");
    m->ctx = ctx;
    m->desc = *desc;
    m->policy_dtype = desc->policy == MPT_POLICY_MIXED_FLOAT16    ? MPT_FLOAT16
                      : desc->policy == MPT_POLICY_MIXED_BFLOAT16 ? MPT_BFLOAT16
                                                                  : MPT_FLOAT32;
    *out = m;
    return MPT_OK;
}

MPTDEF void mpt_model_destroy(mpt_model *m) {
    int c;
    if (!m) return;
    for (c = 0; c < MPT__MEM_COUNT_; c++) mpt__free(m->ctx, m->arena[c]);
    for (c = 0; c < MPT_MAX_LOGS; c++) mpt__free(m->ctx, m->history.values[c]);
    mpt__free(m->ctx, m->layers);
    mpt__free(m->ctx, m->params);
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
static void mpt__init_param(const mpt_model *m, int index) {
    const mpt__param *P = &m->params[index];
    uint64_t key = mpt__mix64(m->desc.seed ^ (0x5EEDull << 32) ^ (uint64_t)index);
    int64_t i;
    uint32_t r[4];
    switch (P->init) {
    case MPT_INIT_ONES:
        for (i = 0; i < P->count; i++) P->value[i] = 1.0f;
        break;
    case MPT_INIT_GLOROT_UNIFORM: {
        double limit = sqrt(6.0 / (double)(P->fan_in + P->fan_out));
        for (i = 0; i < P->count; i++) {
            mpt_philox4x32(key, 0, (uint64_t)i, r);
            P->value[i] = (float)((2.0 * mpt__uniform01(r[0]) - 1.0) * limit);
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
            P->value[i] = (float)(z * stddev);
        }
        break;
    }
    default: /* zeros: the arena is zero-filled */
        break;
    }
}

MPTDEF void mpt_model_refresh_weights(mpt_model *m) {
    int i;
    if (!m || !m->built) return;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        if (P->compute != (void *)P->value)
            mpt__convert(m->ctx, P->compute_dtype, P->compute, MPT_FLOAT32, P->value, P->count);
    }
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

/* The optimizer's state, m->n_slots float32 tensors per trainable
   parameter, zero-filled: allocated by build when the model is compiled
   first, or by compile when it is built first (and again on recompiling,
   which starts the optimizer afresh, as in Keras). */
static mpt_status mpt__alloc_optimizer_state(mpt_model *m) {
    int64_t floats = 0;
    float *next;
    int i, s;
    mpt__free(m->ctx, m->arena[MPT__MEM_OPTIMIZER]);
    m->arena[MPT__MEM_OPTIMIZER] = NULL;
    m->arena_bytes[MPT__MEM_OPTIMIZER] = 0;
    for (i = 0; i < m->n_params; i++) {
        m->params[i].slot[0] = m->params[i].slot[1] = NULL;
        if (m->params[i].trainable) floats += m->params[i].count * m->n_slots;
    }
    if (floats == 0) return MPT_OK;
    next = (float *)mpt__calloc(m->ctx, (size_t)floats * sizeof(float));
    if (!next)
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "model: cannot allocate %lld bytes of optimizer state",
                         (long long)floats * 4);
    m->arena[MPT__MEM_OPTIMIZER] = next;
    m->arena_bytes[MPT__MEM_OPTIMIZER] = floats * 4;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        for (s = 0; P->trainable && s < m->n_slots; s++) {
            P->slot[s] = next;
            next += P->count;
        }
    }
    return MPT_OK;
}

/* The activation a layer ends with (Dense's and Activation's; none else). */
static mpt_activation mpt__layer_activation(const mpt__layer *L) {
    if (strcmp(L->ops->class_name, "Dense") == 0) return L->desc.dense.activation;
    if (strcmp(L->ops->class_name, "Activation") == 0) return L->desc.activation.activation;
    return MPT_ACT_NONE;
}

/* Keras' advice for mixed precision, followed by default: the final
   softmax computes in float32, so the probabilities (and the logits the
   loss reads) are float32. A dtype given for that layer wins. */
static void mpt__final_softmax_in_float32(mpt_model *m) {
    mpt__layer *L = &m->layers[m->n_layers - 1];
    if (mpt__layer_activation(L) == MPT_ACT_SOFTMAX && L->desc.flatten.dtype == MPT_DTYPE_DEFAULT)
        L->dtype = MPT_FLOAT32;
}

MPTDEF mpt_status mpt_model_build(mpt_model *m, int64_t max_batch) {
    mpt__carver c[MPT__MEM_COUNT_];
    int64_t grad_buf_bytes, workspace_bytes;
    int i;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: already built");
    if (m->n_layers == 0) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: no layers to build");
    if (max_batch <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: max_batch %lld must be > 0",
                         (long long)max_batch);
    m->max_batch = max_batch;
    m->n_params = 0;
    mpt__final_softmax_in_float32(m);
    MPT__CHECK(mpt__build_layers(m, &grad_buf_bytes, &workspace_bytes));
    memset(c, 0, sizeof c);
    mpt__layout(m, c, grad_buf_bytes);
    c[MPT__MEM_WORKSPACE].used = workspace_bytes;
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
        if (i == MPT__MEM_OPTIMIZER) continue; /* mpt__alloc_optimizer_state's */
        m->arena_bytes[i] = c[i].used;
        m->arena[i] = mpt__calloc(m->ctx, (size_t)c[i].used);
        if (!m->arena[i]) {
            int j;
            for (j = 0; j < i; j++) {
                mpt__free(m->ctx, m->arena[j]);
                m->arena[j] = NULL;
            }
            return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                             "model: cannot allocate %lld bytes for batches of %lld",
                             (long long)c[i].used, (long long)max_batch);
        }
        c[i].base = (unsigned char *)m->arena[i];
        c[i].used = 0;
    }
    mpt__layout(m, c, grad_buf_bytes);
    for (i = 0; i < m->n_params; i++) mpt__init_param(m, i);
    m->built = 1;
    mpt_model_refresh_weights(m);
    return m->compiled ? mpt__alloc_optimizer_state(m) : MPT_OK;
}

/* ---- running a model ------------------------------------------------------ */

static mpt_status mpt__check_input(mpt_model *m, const mpt_tensor *x) {
    char got[96], want[96];
    int i, ok;
    if (!x || !x->data)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "model: NULL input tensor%s",
                         x ? " data" : "");
    if (!mpt_dtype_is_float(x->dtype))
        return mpt__fail(m->ctx, MPT_ERR_DTYPE, "model: input dtype %s is not a float dtype",
                         mpt_dtype_name(x->dtype));
    ok = x->rank == m->desc.input_rank + 1;
    for (i = 0; ok && i < m->desc.input_rank; i++) ok = x->shape[i + 1] == m->desc.input_shape[i];
    if (!ok || x->shape[0] < 1 || x->shape[0] > m->max_batch) {
        mpt_shape_format(want, sizeof want, m->desc.input_rank, m->desc.input_shape);
        return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                         "model: input shape %s does not match (batch, %s) with batch in 1..%lld",
                         mpt_shape_format(got, sizeof got, x->rank, x->shape), want + 1,
                         (long long)m->max_batch);
    }
    return MPT_OK;
}

static void mpt__layer_view(const mpt_model *m, const mpt__layer *L, void *data, int use_input,
                            mpt_tensor *t) {
    memset(t, 0, sizeof *t);
    t->dtype = L->dtype;
    t->rank = (use_input ? L->in_rank : L->out_rank) + 1;
    t->shape[0] = m->last_batch;
    memcpy(t->shape + 1, use_input ? L->in_shape : L->out_shape,
           sizeof(int64_t) * (size_t)(t->rank - 1));
    t->data = data;
}

static void mpt__pass_init(mpt_model *m, int64_t batch, int training, mpt__pass *p) {
    memset(p, 0, sizeof *p);
    p->ctx = m->ctx;
    p->model = m;
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

/* Forward without the checks and without committing layer state. */
static void mpt__model_forward(mpt_model *m, const mpt_tensor *x, int training) {
    const void *cur = x->data;
    mpt_dtype cur_dtype = x->dtype;
    mpt__pass p;
    int i;
    mpt__pass_init(m, x->shape[0], training, &p);
    for (i = 0; i < m->n_layers; i++) {
        mpt__layer *L = &m->layers[i];
        if (cur_dtype != L->dtype) {
            mpt__convert(m->ctx, L->dtype, L->x_cast, cur_dtype, cur, p.batch * L->in_count);
            cur = L->x_cast;
        }
        L->x = cur;
        if (L->output_is_input) L->y = (void *)cur;
        p.x = L->x;
        p.y = L->y;
        p.logits_only = m->emit_logits && i == m->n_layers - 1;
        L->ops->forward(L, &p);
        cur = L->y;
        cur_dtype = L->dtype;
    }
    m->last_batch = p.batch;
    m->last_training = p.training;
}

MPTDEF mpt_status mpt_model_forward(mpt_model *m, const mpt_tensor *x, int training,
                                    mpt_tensor *out) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: forward before build");
    MPT__CHECK(mpt__check_input(m, x));
    mpt__model_forward(m, x, training);
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

MPTDEF mpt_status mpt_model_backward(mpt_model *m, const mpt_tensor *dout, mpt_tensor *dinput) {
    mpt__pass p;
    int i, cur = 0;
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
        if (dout->data != m->grad_buf[0])
            mpt__convert(m->ctx, last->dtype, m->grad_buf[0], dout->dtype, dout->data,
                         mpt_tensor_count(dout));
    }
    mpt__pass_init(m, m->last_batch, 1, &p);
    for (i = m->n_layers - 1; i >= 0; i--) {
        mpt__layer *L = &m->layers[i];
        p.x = L->x;
        p.y = L->y;
        p.dy = m->grad_buf[cur];
        p.dx = (i > 0 || dinput) ? m->grad_buf[1 - cur] : NULL;
        p.logits_only = m->emit_logits && i == m->n_layers - 1;
        L->ops->backward(L, &p);
        if (i > 0 && m->layers[i - 1].dtype != L->dtype) {
            /* dy is spent: the converted gradient goes back into its buffer. */
            mpt__convert(m->ctx, m->layers[i - 1].dtype, m->grad_buf[cur], L->dtype,
                         m->grad_buf[1 - cur], p.batch * L->in_count);
        } else if (p.dx) {
            cur = 1 - cur;
        }
    }
    if (dinput) mpt__layer_view(m, &m->layers[0], m->grad_buf[cur], 1, dinput);
    return MPT_OK;
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

/* dz = dy · act'(...) in float32, reading dy, the output y and (for GELU)
   the pre-activation z in `dtype`. tmp holds n floats. */
static void mpt__activation_grad(mpt_context *ctx, mpt_activation act, mpt_dtype dtype,
                                 const void *z, const void *y, const void *dy, float *dz,
                                 float *tmp, int64_t n, int64_t cols) {
    mpt__convert(ctx, MPT_FLOAT32, dz, dtype, dy, n);
    if (act == MPT_ACT_NONE) return;
    mpt__convert(ctx, MPT_FLOAT32, tmp, dtype, act == MPT_ACT_GELU ? z : y, n);
    mpt__activation_backward(act, act == MPT_ACT_GELU ? tmp : NULL,
                             act == MPT_ACT_GELU ? NULL : tmp, dz, dz, n, cols);
}

/* The bias gradient: sums of the rows of dz (rows × cols), in a fixed order. */
static void mpt__column_sums(const float *dz, int64_t rows, int64_t cols, float *out) {
    int64_t r, c;
    for (c = 0; c < cols; c++) out[c] = 0;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) out[c] += dz[r * cols + c];
}

/* Adds a layer after checking what every layer descriptor shares. */
#define MPT__ADD_LAYER(m, ops, field, d)                                   \
    do {                                                                   \
        mpt__layer_desc ld_;                                               \
        memset(&ld_, 0, sizeof ld_);                                       \
        ld_.field = *(d);                                                  \
        return mpt__model_add((m), &(ops), &ld_, (d)->name, (d)->dtype);   \
    } while (0)

static mpt_status mpt__check_add(mpt_model *m, const void *desc, const char *what) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!desc) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "%s: NULL descriptor", what);
    return MPT_OK;
}

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
    mpt__ws w = {(unsigned char *)p->workspace};
    float *acc = (L->dtype == MPT_FLOAT32 && fused) ? (float *)p->y
                                                    : (float *)mpt__ws_take(&w, 4 * n);
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.m = B;
    g.n = units;
    g.k = in;
    g.ab_dtype = L->dtype;
    g.a = p->x;
    g.lda = in;
    g.b = mpt__pw(L, 0);
    g.ldb = units;
    g.c = acc;
    g.ldc = units;
    g.bias = d->no_bias ? NULL : mpt__pv(L, 1);
    g.activation = fused ? act : MPT_ACT_NONE;
    mpt__gemm(p->ctx, &g);
    if (act == MPT_ACT_GELU) {
        mpt__convert(p->ctx, L->dtype, L->saved[0], MPT_FLOAT32, acc, n);
        mpt__activation_forward(MPT_ACT_GELU, acc, n);
    } else if (act == MPT_ACT_SOFTMAX) {
        mpt__softmax_rows(acc, B, units);
    }
    if (acc != p->y) mpt__convert(p->ctx, L->dtype, p->y, MPT_FLOAT32, acc, n);
}

static void mpt__dense_backward(mpt__layer *L, const mpt__pass *p) {
    const mpt_dense_desc *d = &L->desc.dense;
    int64_t B = p->batch, in = L->in_count, units = d->units, n = B * units;
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * n);
    float *tmp = (float *)mpt__ws_take(&w, 4 * n);
    void *dz_c = L->dtype == MPT_FLOAT32 ? (void *)dz : mpt__ws_take(&w, mpt__dbytes(L->dtype, n));
    mpt_gemm_desc g;
    mpt__activation_grad(p->ctx, mpt__pass_activation(p, d->activation), L->dtype, L->saved[0],
                         p->y, p->dy, dz, tmp, n, units);
    if (!d->no_bias) mpt__column_sums(dz, B, units, mpt__pg(L, 1));
    /* The weight and input gradients are products in the compute dtype,
       as the forward was: dz is rounded to it once. */
    if (dz_c != (void *)dz) mpt__convert(p->ctx, L->dtype, dz_c, MPT_FLOAT32, dz, n);
    memset(&g, 0, sizeof g); /* dkernel (in, units) = xᵀ · dz */
    g.trans_a = 1;
    g.m = in;
    g.n = units;
    g.k = B;
    g.ab_dtype = L->dtype;
    g.a = p->x;
    g.lda = in;
    g.b = dz_c;
    g.ldb = units;
    g.c = mpt__pg(L, 0);
    g.ldc = units;
    mpt__gemm(p->ctx, &g);
    if (p->dx) { /* dx (B, in) = dz · kernelᵀ */
        float *dxf = L->dtype == MPT_FLOAT32 ? (float *)p->dx
                                             : (float *)mpt__ws_take(&w, 4 * B * in);
        memset(&g, 0, sizeof g);
        g.trans_b = 1;
        g.m = B;
        g.n = in;
        g.k = units;
        g.ab_dtype = L->dtype;
        g.a = dz_c;
        g.lda = units;
        g.b = mpt__pw(L, 0);
        g.ldb = units;
        g.c = dxf;
        g.ldc = in;
        mpt__gemm(p->ctx, &g);
        if ((void *)dxf != p->dx) mpt__convert(p->ctx, L->dtype, p->dx, MPT_FLOAT32, dxf, B * in);
    }
}

static const mpt__layer_ops mpt__dense_ops = {"Dense", "dense", mpt__dense_build,
                                              mpt__dense_forward, mpt__dense_backward, NULL};

MPTDEF mpt_status mpt_model_add_dense(mpt_model *m, const mpt_dense_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "Dense"));
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
    MPT__ADD_LAYER(m, mpt__dense_ops, dense, d);
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
    if (p->dx) memcpy(p->dx, p->dy, (size_t)mpt__dbytes(L->dtype, p->batch * L->in_count));
}

static const mpt__layer_ops mpt__flatten_ops = {"Flatten", "flatten", mpt__flatten_build,
                                                mpt__flatten_forward, mpt__flatten_backward, NULL};

MPTDEF mpt_status mpt_model_add_flatten(mpt_model *m, const mpt_flatten_desc *d) {
    mpt_flatten_desc none;
    MPT__CHECK(m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT);
    memset(&none, 0, sizeof none);
    MPT__ADD_LAYER(m, mpt__flatten_ops, flatten, d ? d : &none);
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
    mpt__convert(p->ctx, MPT_FLOAT32, t, L->dtype, p->x, n);
    if (act == MPT_ACT_SOFTMAX)
        mpt__softmax_rows(t, n / cols, cols);
    else
        mpt__activation_forward(act, t, n);
    mpt__convert(p->ctx, L->dtype, p->y, MPT_FLOAT32, t, n);
}

static void mpt__activation_layer_backward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count, cols = L->in_shape[L->in_rank - 1];
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * n);
    float *tmp = (float *)mpt__ws_take(&w, 4 * n);
    if (!p->dx) return;
    mpt__activation_grad(p->ctx, mpt__pass_activation(p, L->desc.activation.activation),
                         L->dtype, p->x, p->y, p->dy, dz, tmp, n, cols);
    mpt__convert(p->ctx, L->dtype, p->dx, MPT_FLOAT32, dz, n);
}

static const mpt__layer_ops mpt__activation_ops = {"Activation", "activation",
                                                   mpt__activation_build,
                                                   mpt__activation_layer_forward,
                                                   mpt__activation_layer_backward, NULL};

MPTDEF mpt_status mpt_model_add_activation(mpt_model *m, const mpt_activation_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "Activation"));
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Activation: unknown activation %d",
                         (int)d->activation);
    MPT__ADD_LAYER(m, mpt__activation_ops, activation, d);
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

typedef struct mpt__win {
    int64_t h, w, c;     /* one input sample (H, W, C)              */
    int64_t kh, kw;      /* window (kernel or pool) size            */
    int64_t sh, sw;      /* strides                                 */
    int64_t top, left;   /* padding before the first row / column   */
    int64_t oh, ow;      /* output rows and columns (0: no window fits) */
} mpt__win;

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
   cols. */

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

/* cols (n·OH·OW, kh·kw·C) from x (n, H, W, C), both in the compute dtype. */
static void mpt__im2col(mpt_context *ctx, const mpt__conv_plan *c, const void *x, int64_t n,
                        void *cols) {
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = &c->g;
    j.es = c->es;
    j.x = (const unsigned char *)x;
    j.cols = (unsigned char *)cols;
    mpt__parallel_for(ctx, n * c->g.oh, mpt__im2col_task, &j);
}

/* dx (n, H, W, C) in dtype from dcols (n·OH·OW, kh·kw·C) float32; dxf
   (n, H, W, C) float32 is where the sums are made (dx itself if float32). */
static void mpt__col2im(mpt_context *ctx, const mpt__conv_plan *c, mpt_dtype dtype,
                        const float *dcols, int64_t n, float *dxf, void *dx) {
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = &c->g;
    j.es = c->es;
    j.dcols = dcols;
    j.dx = dtype == MPT_FLOAT32 ? (float *)dx : dxf;
    j.dtype = dtype;
    j.out = dx;
    mpt__parallel_for(ctx, n * c->g.h, mpt__col2im_task, &j);
}

/* ---- Conv2D build, forward, backward -------------------------------------- */

static mpt_status mpt__conv2d_build(mpt_model *m, mpt__layer *L) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    mpt__conv_plan c;
    int64_t kshape[4], row_bytes = 0, sample_bytes = 0, chunk_bytes;
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
    if (sample_bytes < 0 || !mpt__mul_ok(sample_bytes, c.chunk, &chunk_bytes))
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "Conv2D '%s': buffers for input %s overflow",
                         L->name, mpt_shape_format(s, sizeof s, 3, L->in_shape));
    return mpt__layer_set_workspace(m, L, 0, mpt__ws_bytes(chunk_bytes, 6));
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
    float *acc = (L->dtype == MPT_FLOAT32 && fused) ? (float *)y
                                                    : (float *)mpt__ws_take(&w, 4 * ny);
    mpt_gemm_desc g;
    if (cols) mpt__im2col(p->ctx, c, x, n, cols); /* (rows, kk) */
    memset(&g, 0, sizeof g);                      /* acc (rows, F) = cols · kernel */
    g.m = rows;
    g.n = c->f;
    g.k = c->kk;
    g.ab_dtype = L->dtype;
    g.a = cols ? (const void *)cols : (const void *)x;
    g.lda = c->kk;
    g.b = mpt__pw(L, 0);
    g.ldb = c->f;
    g.c = acc;
    g.ldc = c->f;
    g.bias = d->no_bias ? NULL : mpt__pv(L, 1);
    g.activation = fused ? d->activation : MPT_ACT_NONE;
    mpt__gemm(p->ctx, &g);
    if (d->activation == MPT_ACT_GELU) {
        unsigned char *z = (unsigned char *)L->saved[0] + (size_t)(b0 * c->pix * c->f) * c->es;
        mpt__convert(p->ctx, L->dtype, z, MPT_FLOAT32, acc, ny);
        mpt__activation_forward(MPT_ACT_GELU, acc, ny);
    } else if (d->activation == MPT_ACT_SOFTMAX) {
        mpt__softmax_rows(acc, rows, c->f); /* over the channels of each pixel */
    }
    if ((void *)acc != (void *)y) mpt__convert(p->ctx, L->dtype, y, MPT_FLOAT32, acc, ny);
}

static void mpt__conv2d_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv_plan c;
    int64_t b0;
    mpt__conv_plan_init(&c, L, p->model->max_batch);
    for (b0 = 0; b0 < p->batch; b0 += c.chunk)
        mpt__conv2d_forward_chunk(L, p, &c, b0, MPT__MIN(c.chunk, p->batch - b0));
}

/* out[j] += Σ_r dz[r][j]: the bias gradient, rows in order. */
static void mpt__add_column_sums(const float *dz, int64_t rows, int64_t cols, float *out) {
    int64_t r;
    for (r = 0; r < rows; r++) mpt__add_f32(out, dz + r * cols, cols);
}

/* dkernel (kk, F) = colsᵀ · dz, added to what the earlier chunks left
   unless this is the first. cols (rows, kk) and dz (rows, F) in dtype. */
static void mpt__conv2d_kernel_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                    const void *cols, const void *dz, int64_t rows, int first) {
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.trans_a = 1;
    g.m = c->kk;
    g.n = c->f;
    g.k = rows;
    g.ab_dtype = L->dtype;
    g.a = cols;
    g.lda = c->kk;
    g.b = dz;
    g.ldb = c->f;
    g.c = mpt__pg(L, 0);
    g.ldc = c->f;
    g.beta = first ? 0.0f : 1.0f;
    mpt__gemm(p->ctx, &g);
}

/* dcols (rows, kk) float32 = dz · kernelᵀ; dz (rows, F) in dtype. */
static void mpt__conv2d_cols_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                  const void *dz, int64_t rows, float *dcols) {
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.trans_b = 1;
    g.m = rows;
    g.n = c->kk;
    g.k = c->f;
    g.ab_dtype = L->dtype;
    g.a = dz;
    g.lda = c->f;
    g.b = mpt__pw(L, 0);
    g.ldb = c->f;
    g.c = dcols;
    g.ldc = c->kk;
    mpt__gemm(p->ctx, &g);
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
    mpt__activation_grad(p->ctx, d->activation, L->dtype, z,
                         (const unsigned char *)p->y + (size_t)y_off * c->es,
                         (const unsigned char *)p->dy + (size_t)y_off * c->es, dz, tmp, ny, c->f);
    if (!d->no_bias) {
        if (b0 == 0) memset(mpt__pg(L, 1), 0, sizeof(float) * (size_t)c->f);
        mpt__add_column_sums(dz, rows, c->f, mpt__pg(L, 1));
    }
    /* The products run in the compute dtype, as the forward did. */
    if (dz_c != (void *)dz) mpt__convert(p->ctx, L->dtype, dz_c, MPT_FLOAT32, dz, ny);
    if (cols) mpt__im2col(p->ctx, c, x, n, cols); /* recomputed: cheaper than keeping it */
    mpt__conv2d_kernel_grad(L, p, c, cols ? (const void *)cols : (const void *)x, dz_c, rows,
                            b0 == 0);
    if (!dx) return;
    if (!c->identity) {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        mpt__col2im(p->ctx, c, L->dtype, dcols, n, dxf, dx);
    } else if (f32) { /* dcols is dx */
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, (float *)dx);
    } else {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        mpt__convert(p->ctx, L->dtype, dx, MPT_FLOAT32, dcols, n * L->in_count);
    }
}

static void mpt__conv2d_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv_plan c;
    int64_t b0;
    mpt__conv_plan_init(&c, L, p->model->max_batch);
    for (b0 = 0; b0 < p->batch; b0 += c.chunk)
        mpt__conv2d_backward_chunk(L, p, &c, b0, MPT__MIN(c.chunk, p->batch - b0));
}

static const mpt__layer_ops mpt__conv2d_ops = {"Conv2D", "conv2d", mpt__conv2d_build,
                                               mpt__conv2d_forward, mpt__conv2d_backward, NULL};

MPTDEF mpt_status mpt_model_add_conv2d(mpt_model *m, const mpt_conv2d_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "Conv2D"));
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
    MPT__ADD_LAYER(m, mpt__conv2d_ops, conv2d, d);
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

typedef enum mpt__pool_kind { MPT__POOL_MAX, MPT__POOL_AVERAGE, MPT__POOL_GLOBAL } mpt__pool_kind;

static void mpt__pool_win(mpt__win *g, const mpt__layer *L, mpt__pool_kind kind) {
    const mpt_pool2d_desc *d = &L->desc.pool2d;
    int64_t size[2], strides[2];
    if (kind == MPT__POOL_GLOBAL) {
        size[0] = strides[0] = L->in_shape[0];
        size[1] = strides[1] = L->in_shape[1];
        mpt__win_init(g, L, size, strides, MPT_PADDING_VALID);
        return;
    }
    size[0] = d->pool_size[0] ? d->pool_size[0] : 2;
    size[1] = d->pool_size[1] ? d->pool_size[1] : 2;
    strides[0] = d->strides[0] ? d->strides[0] : size[0];
    strides[1] = d->strides[1] ? d->strides[1] : size[1];
    mpt__win_init(g, L, size, strides, d->padding);
}

static mpt_status mpt__pool_build(mpt_model *m, mpt__layer *L, mpt__pool_kind kind) {
    mpt__win g;
    int64_t out_count;
    MPT__CHECK(mpt__expect_image(m, L));
    mpt__pool_win(&g, L, kind);
    MPT__CHECK(mpt__expect_window_fits(m, L, &g, "pool_size"));
    if (kind == MPT__POOL_GLOBAL) {
        L->out_rank = 1;
        L->out_shape[0] = g.c;
    } else {
        L->out_rank = 3;
        L->out_shape[0] = g.oh;
        L->out_shape[1] = g.ow;
        L->out_shape[2] = g.c;
    }
    out_count = g.oh * g.ow * g.c; /* ≤ in_count: windows start inside the image */
    if (kind == MPT__POOL_MAX) {
        if (L->in_count > INT32_MAX)
            return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                             "MaxPooling2D '%s': %lld elements per sample do not fit the int32 "
                             "indices it saves", L->name, (long long)L->in_count);
        MPT__CHECK(mpt__layer_add_saved(m, L, 4 * out_count, 0)); /* argmax (B, OH, OW, C) */
    }
    /* Per sample, float32: forward x and y, backward dy and dx. */
    return mpt__layer_set_workspace(m, L, 4 * (L->in_count + out_count), MPT__ALIGN);
}

static mpt_status mpt__max_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_MAX);
}
static mpt_status mpt__avg_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_AVERAGE);
}
static mpt_status mpt__global_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_GLOBAL);
}

typedef struct mpt__pool_job {
    const mpt_context *ctx;
    mpt__win g;
    mpt__pool_kind kind;
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

static void mpt__pool_job_init(mpt__pool_job *j, const mpt__layer *L, const mpt__pass *p,
                               mpt__pool_kind kind) {
    memset(j, 0, sizeof *j);
    j->ctx = p->ctx;
    mpt__pool_win(&j->g, L, kind);
    j->kind = kind;
    j->dtype = L->dtype;
    j->es = mpt_dtype_size(L->dtype);
    j->n_in = L->in_count;
    j->n_out = L->out_count;
    j->x = p->x;
    j->y = p->y;
    j->dy = p->dy;
    j->dx = p->dx;
    j->argmax = kind == MPT__POOL_MAX ? (int32_t *)L->saved[0] : NULL;
    j->ws = (float *)p->workspace;
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

/* y[c] = max of the window's pixels (first wins; NaN wins), arg[c] = where. */
static void mpt__max_window(const mpt__win *g, const float *x, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, float *y, int32_t *arg) {
    int64_t r, q, e;
    for (e = 0; e < g->c; e++) {
        y[e] = -INFINITY;
        arg[e] = (int32_t)((r0 * g->w + c0) * g->c + e);
    }
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++) {
            const int64_t at = (r * g->w + q) * g->c;
            for (e = 0; e < g->c; e++) {
                float v = x[at + e];
                if (v > y[e] || (v != v && y[e] == y[e])) {
                    y[e] = v;
                    arg[e] = (int32_t)(at + e);
                }
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
            if (j->kind == MPT__POOL_MAX)
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
    if (j->kind == MPT__POOL_MAX) {
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

static void mpt__pool_forward(mpt__layer *L, const mpt__pass *p, mpt__pool_kind kind) {
    mpt__pool_job j;
    mpt__pool_job_init(&j, L, p, kind);
    mpt__parallel_for(p->ctx, p->batch, mpt__pool_forward_task, &j);
}

static void mpt__pool_backward(mpt__layer *L, const mpt__pass *p, mpt__pool_kind kind) {
    mpt__pool_job j;
    if (!p->dx) return; /* no parameters: only dx to compute */
    mpt__pool_job_init(&j, L, p, kind);
    mpt__parallel_for(p->ctx, p->batch, mpt__pool_backward_task, &j);
}

static void mpt__max_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_MAX);
}
static void mpt__max_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_MAX);
}
static void mpt__avg_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_AVERAGE);
}
static void mpt__avg_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_AVERAGE);
}
static void mpt__global_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_GLOBAL);
}
static void mpt__global_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_GLOBAL);
}

static const mpt__layer_ops mpt__max_pool_ops = {"MaxPooling2D", "max_pooling2d",
                                                 mpt__max_pool_build, mpt__max_pool_forward,
                                                 mpt__max_pool_backward, NULL};
static const mpt__layer_ops mpt__avg_pool_ops = {"AveragePooling2D", "average_pooling2d",
                                                 mpt__avg_pool_build, mpt__avg_pool_forward,
                                                 mpt__avg_pool_backward, NULL};
static const mpt__layer_ops mpt__global_pool_ops = {
    "GlobalAveragePooling2D", "global_average_pooling2d", mpt__global_pool_build,
    mpt__global_pool_forward, mpt__global_pool_backward, NULL};

static mpt_status mpt__check_pool_desc(mpt_model *m, const mpt_pool2d_desc *d, const char *cls) {
    MPT__CHECK(mpt__check_add(m, d, cls));
    return mpt__check_window_desc(m, cls, "pool_size", d->pool_size, 0, d->strides, d->padding);
}

MPTDEF mpt_status mpt_model_add_max_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    MPT__CHECK(mpt__check_pool_desc(m, d, "MaxPooling2D"));
    MPT__ADD_LAYER(m, mpt__max_pool_ops, pool2d, d);
}

MPTDEF mpt_status mpt_model_add_average_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    MPT__CHECK(mpt__check_pool_desc(m, d, "AveragePooling2D"));
    MPT__ADD_LAYER(m, mpt__avg_pool_ops, pool2d, d);
}

MPTDEF mpt_status mpt_model_add_global_average_pooling2d(mpt_model *m,
                                                         const mpt_flatten_desc *d) {
    mpt_flatten_desc none;
    MPT__CHECK(m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT);
    memset(&none, 0, sizeof none);
    MPT__ADD_LAYER(m, mpt__global_pool_ops, flatten, d ? d : &none);
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
static float mpt__bn_inv_std(const mpt__layer *L, double var) {
    return (float)(1.0 / sqrt(var + (double)mpt__bn_epsilon(L)));
}

/* How the rows of one batch are split into tasks. */
typedef struct mpt__bn_plan {
    int64_t channels;   /* C                                   */
    int64_t rows;       /* B · positions                       */
    int64_t chunk_rows; /* rows per task: about MPT__BN_CHUNK elements */
    int64_t n_chunks;
} mpt__bn_plan;

static mpt__bn_plan mpt__bn_plan_rows(const mpt__layer *L, int64_t batch) {
    mpt__bn_plan pl;
    pl.channels = L->in_shape[L->in_rank - 1];
    pl.rows = batch * (L->in_count / pl.channels);
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

static mpt__bn_ws mpt__bn_ws_carve(const mpt__layer *L, const mpt__pass *p,
                                   const mpt__bn_plan *pl) {
    mpt__ws w = {(unsigned char *)p->workspace};
    int64_t n = pl->rows * pl->channels;
    int copy = L->dtype != MPT_FLOAT32; /* float32 is read where it lies (never written) */
    mpt__bn_ws b;
    b.xf = copy ? (float *)mpt__ws_take(&w, 4 * n) : (float *)p->x;
    b.dyf = copy ? (float *)mpt__ws_take(&w, 4 * n) : (float *)p->dy;
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

static float mpt__bn_param(const mpt__layer *L, int slot, int64_t c, float absent) {
    return slot < 0 ? absent : mpt__pv(L, slot)[c];
}

/* The batch mean and biased variance into saved[0] and saved[1]. */
static void mpt__bn_batch_stats(mpt__layer *L, const mpt__pass *p, mpt__bn_job *j,
                                const mpt__bn_ws *w) {
    float *mean = (float *)L->saved[0], *var = (float *)L->saved[1]; /* (C) each */
    int64_t C = j->plan.channels, c;
    mpt__parallel_for(p->ctx, j->plan.n_chunks, mpt__bn_sum_task, j);
    mpt__bn_combine(&j->plan, w->part, 0, w->sum);
    for (c = 0; c < C; c++) mean[c] = (float)(w->sum[c] / (double)j->plan.rows);
    j->mean = mean;
    mpt__parallel_for(p->ctx, j->plan.n_chunks, mpt__bn_sqdev_task, j);
    mpt__bn_combine(&j->plan, w->part, 1, w->sum + C);
    for (c = 0; c < C; c++) var[c] = (float)(w->sum[C + c] / (double)j->plan.rows);
}

static void mpt__bn_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__bn_plan pl = mpt__bn_plan_rows(L, p->batch);
    mpt__bn_ws w = mpt__bn_ws_carve(L, p, &pl);
    int64_t C = pl.channels, n = pl.rows * C, c;
    int moving = mpt__bn_moving_slot(L);
    float *scale = w.coef, *beta = w.coef + C; /* (C) each */
    const float *mean, *var;
    mpt__bn_job j;
    memset(&j, 0, sizeof j);
    j.plan = pl;
    j.part = w.part;
    if ((void *)w.xf != p->x) mpt__convert(p->ctx, MPT_FLOAT32, w.xf, L->dtype, p->x, n);
    j.x = w.xf;
    if (p->training) {
        mpt__bn_batch_stats(L, p, &j, &w);
        mean = (const float *)L->saved[0];
        var = (const float *)L->saved[1];
    } else {
        mean = mpt__pv(L, moving);
        var = mpt__pv(L, moving + 1);
    }
    for (c = 0; c < C; c++) {
        scale[c] = mpt__bn_param(L, mpt__bn_gamma_slot(L), c, 1.0f) * mpt__bn_inv_std(L, var[c]);
        beta[c] = mpt__bn_param(L, mpt__bn_beta_slot(L), c, 0.0f);
    }
    j.mean = mean;
    j.scale = scale;
    j.beta = beta;
    /* float32 writes y directly; otherwise y goes over the float32 copy of
       x (backward reads the layer's input, not this copy) and is rounded. */
    j.out = L->dtype == MPT_FLOAT32 ? (float *)p->y : w.xf;
    mpt__parallel_for(p->ctx, pl.n_chunks, mpt__bn_normalize_task, &j);
    if ((void *)j.out != p->y) mpt__convert(p->ctx, L->dtype, p->y, MPT_FLOAT32, j.out, n);
}

/* Folds the batch statistics of the last training forward into the moving
   ones (Keras: the biased batch variance, as measured). */
static void mpt__bn_commit(mpt__layer *L, const mpt__pass *p) {
    const float *mean = (const float *)L->saved[0], *var = (const float *)L->saved[1];
    int slot = mpt__bn_moving_slot(L);
    float *moving_mean = mpt__pv(L, slot), *moving_var = mpt__pv(L, slot + 1); /* (C) */
    double mom = mpt__bn_momentum(L);
    int64_t C = L->in_shape[L->in_rank - 1], c;
    (void)p;
    for (c = 0; c < C; c++) {
        moving_mean[c] = (float)(moving_mean[c] * mom + mean[c] * (1 - mom));
        moving_var[c] = (float)(moving_var[c] * mom + var[c] * (1 - mom));
    }
}

static void mpt__bn_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__bn_plan pl = mpt__bn_plan_rows(L, p->batch);
    mpt__bn_ws w = mpt__bn_ws_carve(L, p, &pl);
    int64_t C = pl.channels, n = pl.rows * C, c;
    int gamma = mpt__bn_gamma_slot(L), beta = mpt__bn_beta_slot(L);
    const float *var = (const float *)L->saved[1];                            /* (C) */
    float *scale = w.coef, *inv_std = w.coef + C, *mdy = inv_std + C, *mdyx = mdy + C; /* (C) */
    mpt__bn_job j;
    memset(&j, 0, sizeof j);
    j.plan = pl;
    j.part = w.part;
    if ((void *)w.xf != p->x) mpt__convert(p->ctx, MPT_FLOAT32, w.xf, L->dtype, p->x, n);
    if ((void *)w.dyf != p->dy) mpt__convert(p->ctx, MPT_FLOAT32, w.dyf, L->dtype, p->dy, n);
    j.x = w.xf;
    j.dy = w.dyf;
    j.mean = (const float *)L->saved[0];
    for (c = 0; c < C; c++) {
        inv_std[c] = mpt__bn_inv_std(L, var[c]);
        scale[c] = mpt__bn_param(L, gamma, c, 1.0f) * inv_std[c];
    }
    j.inv_std = inv_std;
    mpt__parallel_for(p->ctx, pl.n_chunks, mpt__bn_grad_sums_task, &j);
    mpt__bn_combine(&pl, w.part, 0, w.sum);
    mpt__bn_combine(&pl, w.part, 1, w.sum + C);
    for (c = 0; c < C; c++) { /* dbeta = Σ dy, dgamma = Σ dy · x̂ */
        if (beta >= 0) mpt__pg(L, beta)[c] = (float)w.sum[c];
        if (gamma >= 0) mpt__pg(L, gamma)[c] = (float)w.sum[C + c];
        mdy[c] = (float)(w.sum[c] / (double)pl.rows);
        mdyx[c] = (float)(w.sum[C + c] / (double)pl.rows);
    }
    if (!p->dx) return;
    j.scale = scale;
    j.mean_dy = mdy;
    j.mean_dy_xhat = mdyx;
    j.out = L->dtype == MPT_FLOAT32 ? (float *)p->dx : w.dyf; /* in place over dy's copy */
    mpt__parallel_for(p->ctx, pl.n_chunks, mpt__bn_dx_task, &j);
    if ((void *)j.out != p->dx) mpt__convert(p->ctx, L->dtype, p->dx, MPT_FLOAT32, j.out, n);
}

/* Workspace bytes beyond the per-sample float32 copies: the chunk sums for
   a batch of max_batch (at most rows / chunk_rows + 1 chunks), sum and coef. */
static mpt_status mpt__bn_fixed_workspace(mpt_model *m, mpt__layer *L, int64_t *bytes) {
    mpt__bn_plan pl = mpt__bn_plan_rows(L, 1);
    int64_t rows, elems;
    *bytes = 0;
    if (!mpt__mul_ok(m->max_batch, pl.rows, &rows) ||
        !mpt__mul_ok(rows / pl.chunk_rows + 1 + 2, pl.channels, &elems) ||
        !mpt__mul_ok(elems, 16, bytes) ||
        !mpt__add_ok(*bytes, MPT__BN_WS_PIECES * MPT__ALIGN, bytes))
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                         "BatchNormalization '%s': workspace for a batch of %lld overflows",
                         L->name, (long long)m->max_batch);
    return MPT_OK;
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
    MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C)); /* batch mean (C) f32     */
    MPT__CHECK(mpt__layer_add_saved(m, L, 0, 4 * C)); /* batch variance (C) f32 */
    MPT__CHECK(mpt__bn_fixed_workspace(m, L, &fixed));
    /* half dtypes: x and dy in float32, (B, ...) each */
    return mpt__layer_set_workspace(m, L, L->dtype == MPT_FLOAT32 ? 0 : 8 * L->in_count, fixed);
}

static const mpt__layer_ops mpt__bn_ops = {"BatchNormalization", "batch_normalization",
                                           mpt__bn_build, mpt__bn_forward, mpt__bn_backward,
                                           mpt__bn_commit};

MPTDEF mpt_status mpt_model_add_batch_normalization(mpt_model *m, const mpt_batchnorm_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "BatchNormalization"));
    if (!(d->momentum >= 0 && d->momentum <= 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "BatchNormalization: momentum %g is not in [0, 1]", (double)d->momentum);
    if (!(d->epsilon >= 0 && d->epsilon < INFINITY))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "BatchNormalization: epsilon %g must be > 0 and finite (0: 1e-3)",
                         (double)d->epsilon);
    MPT__ADD_LAYER(m, mpt__bn_ops, batchnorm, d);
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

static uint64_t mpt__dropout_key(const mpt__layer *L) {
    return L->desc.dropout.seed ? mpt__mix64(L->desc.dropout.seed) : L->seed;
}

typedef struct mpt__dropout_job {
    const mpt__layer *L;
    mpt_context *ctx;
    uint64_t step;     /* the training step the mask belongs to      */
    const void *in;    /* (n) x (forward) or dy (backward), L->dtype */
    void *out;         /* (n) y or dx, L->dtype                      */
    float *tmp;        /* (n) float32 scratch; NULL when L->dtype is */
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
    mpt_dtype dt = j->L->dtype;
    int64_t i0 = chunk * MPT__DROPOUT_CHUNK, i1 = MPT__MIN(j->n, i0 + MPT__DROPOUT_CHUNK);
    size_t offset = (size_t)i0 * mpt_dtype_size(dt);
    const void *in = (const char *)j->in + offset; /* (i1 − i0) this chunk's part */
    void *out = (char *)j->out + offset;
    uint64_t key = mpt__dropout_key(j->L);
    float rate = j->L->desc.dropout.rate;
    (void)thread;
    if (j->tmp) { /* half dtypes: through this chunk's float32 slice */
        float *t = j->tmp + i0;
        mpt__convert(j->ctx, MPT_FLOAT32, t, dt, in, i1 - i0);
        mpt__dropout_mask(key, j->step, rate, t, t, i0, i1);
        mpt__convert(j->ctx, dt, out, MPT_FLOAT32, t, i1 - i0);
    } else {
        mpt__dropout_mask(key, j->step, rate, (const float *)in, (float *)out, i0, i1);
    }
}

static void mpt__dropout_run(mpt__layer *L, const mpt__pass *p, uint64_t step, const void *in,
                             void *out) {
    mpt__dropout_job j;
    j.L = L;
    j.ctx = p->ctx;
    j.step = step;
    j.in = in;
    j.out = out;
    j.tmp = L->dtype == MPT_FLOAT32 ? NULL : (float *)p->workspace;
    j.n = p->batch * L->in_count;
    if (L->desc.dropout.rate == 0) { /* the identity, in training too */
        if (out != in) memcpy(out, in, (size_t)mpt__dbytes(L->dtype, j.n));
        return;
    }
    mpt__parallel_for(p->ctx, (j.n + MPT__DROPOUT_CHUNK - 1) / MPT__DROPOUT_CHUNK,
                      mpt__dropout_task, &j);
}

static void mpt__dropout_forward(mpt__layer *L, const mpt__pass *p) {
    uint64_t *step = (uint64_t *)L->saved[0]; /* (1) the step of this mask */
    if (!p->training) {
        memcpy(p->y, p->x, (size_t)mpt__dbytes(L->dtype, p->batch * L->in_count));
        return;
    }
    *step = p->model->step;
    mpt__dropout_run(L, p, *step, p->x, p->y);
}

static void mpt__dropout_backward(mpt__layer *L, const mpt__pass *p) {
    if (p->dx) mpt__dropout_run(L, p, *(const uint64_t *)L->saved[0], p->dy, p->dx);
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
                                                NULL};

MPTDEF mpt_status mpt_model_add_dropout(mpt_model *m, const mpt_dropout_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "Dropout"));
    if (!(d->rate >= 0 && d->rate < 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Dropout: rate %g is not in [0, 1)",
                         (double)d->rate);
    MPT__ADD_LAYER(m, mpt__dropout_ops, dropout, d);
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

/* Element i of a float tensor of any float dtype, as float32, and back. */
static float mpt__getf(mpt_dtype dtype, const void *data, int64_t i) {
    switch (dtype) {
    case MPT_FLOAT16: return mpt_half_to_float(((const mpt_half *)data)[i]);
    case MPT_BFLOAT16: return mpt_bf16_to_float(((const mpt_bf16 *)data)[i]);
    default: return ((const float *)data)[i];
    }
}

static void mpt__setf(mpt_dtype dtype, void *data, int64_t i, float v) {
    switch (dtype) {
    case MPT_FLOAT16: ((mpt_half *)data)[i] = mpt_float_to_half(v); break;
    case MPT_BFLOAT16: ((mpt_bf16 *)data)[i] = mpt_float_to_bf16(v); break;
    default: ((float *)data)[i] = v; break;
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
    return mpt__getf(j->target->dtype, j->target->data, r * j->K + c);
}

static float mpt__loss_pred(const mpt__loss_job *j, int64_t i) {
    return mpt__getf(j->pred->dtype, j->pred->data, i);
}

static void mpt__loss_grad(const mpt__loss_job *j, int64_t i, float g) {
    mpt__setf(j->dpred->dtype, j->dpred->data, i, g * j->gscale);
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
    if (d->type <= MPT_LOSS_NONE || d->type >= MPT_LOSS_COUNT_)
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
    if (!mpt__same_shape(pred, target))
        return mpt__fail(ctx, MPT_ERR_SHAPE, "%s: target shape %s is not pred's %s", name,
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
        float v = mpt__getf(t->dtype, t->data, i);
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
    if (!d || !pred || !target || !loss)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loss: NULL %s",
                         !d ? "desc" : !pred ? "pred" : !target ? "target" : "loss");
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

MPTDEF mpt_status mpt_loss_compute(mpt_context *ctx, const mpt_loss_desc *desc,
                                   const mpt_tensor *pred, const mpt_tensor *target,
                                   double *loss, mpt_tensor *dpred) {
    mpt__loss_job j;
    int categorical, t;
    double sum = 0, count;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
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
    /* The mean is over rows for crossentropies, over elements otherwise. */
    count = categorical ? (double)j.rows : (double)j.rows * (double)j.K;
    j.gscale = (float)((desc->grad_scale != 0 ? desc->grad_scale : 1.0) / count);
    j.n_tasks = (int)MPT__MIN(j.rows, (int64_t)MPT__LOSS_TASKS);
    mpt__parallel_for(ctx, j.n_tasks, mpt__loss_task, &j);
    for (t = 0; t < j.n_tasks; t++) sum += j.partial[t];
    *loss = sum / count;
    return MPT_OK;
}

#include "wip/optim.h"
#include "wip/data.h"
#include "wip/train.h"
#include "wip/callbacks.h"
#include "wip/checkpoint.h"

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

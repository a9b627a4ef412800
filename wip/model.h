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

typedef enum mpt__category {
    MPT__MEM_PARAMS,      /* float32 master weights             */
    MPT__MEM_GRADS,       /* float32 gradients                  */
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
};

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
        /* Gradient buffers hold float32 (the widest dtype) of the larger side. */
        MPT__CHECK(mpt__batch_bytes(m, L, 4 * MPT__MAX(L->in_count, L->out_count), 0,
                                    &grad_bytes));
        *grad_buf_bytes = MPT__MAX(*grad_buf_bytes, grad_bytes);
        *workspace_bytes = MPT__MAX(*workspace_bytes, L->workspace_bytes);
        rank = L->out_rank;
        memcpy(shape, L->out_shape, sizeof shape);
    }
    return MPT_OK;
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
    MPT__CHECK(mpt__build_layers(m, &grad_buf_bytes, &workspace_bytes));
    memset(c, 0, sizeof c);
    mpt__layout(m, c, grad_buf_bytes);
    c[MPT__MEM_WORKSPACE].used = workspace_bytes;
    for (i = 0; i < MPT__MEM_COUNT_; i++) {
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
    return MPT_OK;
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

MPTDEF mpt_status mpt_model_forward(mpt_model *m, const mpt_tensor *x, int training,
                                    mpt_tensor *out) {
    const void *cur;
    mpt_dtype cur_dtype;
    mpt__pass p;
    int i;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!m->built) return mpt__fail(m->ctx, MPT_ERR_STATE, "model: forward before build");
    MPT__CHECK(mpt__check_input(m, x));
    memset(&p, 0, sizeof p);
    p.ctx = m->ctx;
    p.model = m;
    p.batch = x->shape[0];
    p.training = training != 0;
    p.workspace = m->arena[MPT__MEM_WORKSPACE];
    cur = x->data;
    cur_dtype = x->dtype;
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
        L->ops->forward(L, &p);
        if (p.training && L->ops->commit) L->ops->commit(L, &p);
        cur = L->y;
        cur_dtype = L->dtype;
    }
    m->last_batch = p.batch;
    m->last_training = p.training;
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
    memset(&p, 0, sizeof p);
    p.ctx = m->ctx;
    p.model = m;
    p.batch = m->last_batch;
    p.training = 1;
    p.workspace = m->arena[MPT__MEM_WORKSPACE];
    for (i = m->n_layers - 1; i >= 0; i--) {
        mpt__layer *L = &m->layers[i];
        p.x = L->x;
        p.y = L->y;
        p.dy = m->grad_buf[cur];
        p.dx = (i > 0 || dinput) ? m->grad_buf[1 - cur] : NULL;
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

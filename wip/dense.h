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
   Dense: y = act(x · kernel + bias)                x: (B, in)  y: (B, units)
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

static void mpt__dense_forward(mpt__layer *L, const mpt__pass *p) {
    const mpt_dense_desc *d = &L->desc.dense;
    int64_t B = p->batch, in = L->in_count, units = d->units, n = B * units;
    int fused = d->activation != MPT_ACT_GELU && d->activation != MPT_ACT_SOFTMAX;
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
    g.activation = fused ? d->activation : MPT_ACT_NONE;
    mpt__gemm(p->ctx, &g);
    if (d->activation == MPT_ACT_GELU) {
        mpt__convert(p->ctx, L->dtype, L->saved[0], MPT_FLOAT32, acc, n);
        mpt__activation_forward(MPT_ACT_GELU, acc, n);
    } else if (d->activation == MPT_ACT_SOFTMAX) {
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
    mpt__activation_grad(p->ctx, d->activation, L->dtype, L->saved[0], p->y, p->dy, dz, tmp, n,
                         units);
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
   Flatten: (B, h, w, c) -> (B, h·w·c), the same memory seen as vectors
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
   Activation: y = act(x), elementwise (softmax: over the last axis)
   ============================================================================= */

static mpt_status mpt__activation_build(mpt_model *m, mpt__layer *L) {
    L->out_rank = L->in_rank;
    memcpy(L->out_shape, L->in_shape, sizeof L->in_shape);
    return mpt__layer_set_workspace(m, L, 8 * L->in_count, 2 * MPT__ALIGN);
}

static void mpt__activation_layer_forward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count, cols = L->in_shape[L->in_rank - 1];
    float *t = (float *)p->workspace;
    mpt__convert(p->ctx, MPT_FLOAT32, t, L->dtype, p->x, n);
    if (L->desc.activation.activation == MPT_ACT_SOFTMAX)
        mpt__softmax_rows(t, n / cols, cols);
    else
        mpt__activation_forward(L->desc.activation.activation, t, n);
    mpt__convert(p->ctx, L->dtype, p->y, MPT_FLOAT32, t, n);
}

static void mpt__activation_layer_backward(mpt__layer *L, const mpt__pass *p) {
    int64_t n = p->batch * L->in_count, cols = L->in_shape[L->in_rank - 1];
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * n);
    float *tmp = (float *)mpt__ws_take(&w, 4 * n);
    if (!p->dx) return;
    mpt__activation_grad(p->ctx, L->desc.activation.activation, L->dtype, p->x, p->y, p->dy, dz,
                         tmp, n, cols);
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

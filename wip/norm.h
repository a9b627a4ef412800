/* =============================================================================
   BatchNormalization: each channel (the last axis) normalised over the batch
   and every spatial position            x, y: (B, ..., C)   parameters: (C)
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
   Dropout: inverted dropout                               x, y: (B, ...)
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

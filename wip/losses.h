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

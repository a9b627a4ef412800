/* Losses: every loss and mode against a double-precision reference (value
   and analytic gradient, the latter checked by central differences), known
   answers by hand, large logits, half-precision predictions, grad_scale,
   thread-count independence, and bad input. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;


/* ======================================================================
   The reference, in double
   ====================================================================== */

#define EPS 1e-7f /* Keras' epsilon, as the float32 it is */

typedef struct ref_case {
    mpt_loss_type type;
    int from_logits;
    int64_t rows, K;       /* pred is (rows, K) (its last axis K)  */
    const double *target;  /* (rows, K), or NULL for class ids     */
    const int32_t *labels; /* (rows) for sparse                    */
} ref_case;

static double ref_target(const ref_case *c, int64_t r, int64_t k) {
    return c->labels ? (c->labels[r] == k ? 1.0 : 0.0) : c->target[r * c->K + k];
}

static double ref_clip(double v) {
    return v < (double)EPS ? (double)EPS : v > (double)(1.0f - EPS) ? (double)(1.0f - EPS) : v;
}

static int ref_clipped(double v) { return v < (double)EPS || v > (double)(1.0f - EPS); }

/* −Σ t·log_softmax(z) of one row; gradient softmax·Σt − t into g (or NULL). */
static double ref_xent_logits(const ref_case *c, int64_t r, const double *z, double *g) {
    double mx = z[0], s = 0, lse, loss = 0, tsum = 0;
    int64_t k;
    for (k = 1; k < c->K; k++) mx = z[k] > mx ? z[k] : mx;
    for (k = 0; k < c->K; k++) s += exp(z[k] - mx);
    lse = mx + log(s);
    for (k = 0; k < c->K; k++) {
        loss += ref_target(c, r, k) * (lse - z[k]);
        tsum += ref_target(c, r, k);
    }
    if (g)
        for (k = 0; k < c->K; k++) g[k] = exp(z[k] - lse) * tsum - ref_target(c, r, k);
    return loss;
}

/* Keras 3 from probabilities: q = p / Σp, clipped, −Σ t·log q; the
   gradient through the division, zero through a clipped q. */
static double ref_xent_probs(const ref_case *c, int64_t r, const double *p, double *g) {
    double S = 0, loss = 0, dot = 0;
    int64_t k;
    for (k = 0; k < c->K; k++) S += p[k];
    for (k = 0; k < c->K; k++) {
        double q = p[k] / S, t = ref_target(c, r, k);
        double gk = ref_clipped(q) ? 0 : -t / q;
        loss -= t * log(ref_clip(q));
        dot += gk * q;
    }
    if (g)
        for (k = 0; k < c->K; k++) {
            double q = p[k] / S, t = ref_target(c, r, k);
            g[k] = ((ref_clipped(q) ? 0 : -t / q) - dot) / S;
        }
    return loss;
}

static double ref_bce(int from_logits, double x, double t, double *g) {
    if (from_logits) {
        *g = 1 / (1 + exp(-x)) - t;
        return -t * log(1 / (1 + exp(-x))) - (1 - t) * log(1 / (1 + exp(x)));
    }
    *g = ref_clipped(x) ? 0 : (1 - t) / (1 - x) - t / x;
    return -(t * log(ref_clip(x)) + (1 - t) * log(1 - ref_clip(x)));
}

/* The mean loss; grad (rows × K, or NULL) receives its gradient. */
static double ref_loss(const ref_case *c, const double *pred, double *grad) {
    int categorical = c->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
                      c->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    double count = categorical ? (double)c->rows : (double)(c->rows * c->K), sum = 0;
    int64_t r, k, i;
    for (r = 0; r < c->rows; r++) {
        const double *z = pred + r * c->K;
        double *g = grad ? grad + r * c->K : NULL;
        if (categorical) {
            sum += c->from_logits ? ref_xent_logits(c, r, z, g) : ref_xent_probs(c, r, z, g);
            continue;
        }
        for (k = 0; k < c->K; k++) {
            double t = ref_target(c, r, k), gk;
            if (c->type == MPT_LOSS_BINARY_CROSSENTROPY) {
                sum += ref_bce(c->from_logits, z[k], t, &gk);
            } else {
                sum += (z[k] - t) * (z[k] - t);
                gk = 2 * (z[k] - t);
            }
            if (g) g[k] = gk;
        }
    }
    if (grad)
        for (i = 0; i < c->rows * c->K; i++) grad[i] /= count;
    return sum / count;
}


/* A tensor of `dtype` holding the doubles v (n of them), shape (rank, shape). */
static void make_tensor(mpt_tensor *t, mpt_dtype dtype, int rank, const int64_t *shape,
                        const double *v) {
    int64_t n, i;
    float *f;
    mpt_tensor_alloc(ctx, t, dtype, rank, shape);
    n = mpt_tensor_count(t);
    f = (float *)malloc(sizeof(float) * (size_t)n);
    for (i = 0; i < n; i++) f[i] = (float)v[i];
    mpt_convert(ctx, dtype, t->data, MPT_FLOAT32, f, n);
    free(f);
}

static void tensor_doubles(const mpt_tensor *t, double *out) {
    int64_t n = mpt_tensor_count(t), i;
    float *f = (float *)malloc(sizeof(float) * (size_t)n);
    mpt_convert(ctx, MPT_FLOAT32, f, t->dtype, t->data, n);
    for (i = 0; i < n; i++) out[i] = f[i];
    free(f);
}

/* ======================================================================
   Against the reference
   ====================================================================== */

/* Random inputs for a loss: logits in [−3, 3], probabilities away from the
   clip, targets as the loss expects. pred of shape (lead..., K). */
static void check_loss(mpt_loss_type type, int from_logits, mpt_dtype pred_dtype,
                       mpt_dtype dpred_dtype, int rank, const int64_t *shape, float grad_scale) {
    ref_case c;
    mpt_tensor tp, tt, tg;
    int64_t n = 1, i, r, k, m, step;
    double *pred, *target, *grad_ref, *grad_num, *grad_lib, loss_ref, loss_lib = 0, e;
    int32_t *labels;
    double tol_grad = dpred_dtype == MPT_FLOAT32 ? 1e-5 : dpred_dtype == MPT_FLOAT16 ? 2e-3 : 1e-2;
    int sparse = type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    char label[160], s[64];
    const double h = 1e-6;
    test__begin();
    snprintf(label, sizeof label, "%s%s pred %s %s dpred %s scale %g", mpt__loss_name(type),
             from_logits ? " from_logits" : "", mpt_shape_format(s, sizeof s, rank, shape),
             mpt_dtype_name(pred_dtype), mpt_dtype_name(dpred_dtype), (double)grad_scale);
    for (i = 0; i < rank; i++) n *= shape[i];
    memset(&c, 0, sizeof c);
    c.type = type;
    c.from_logits = from_logits;
    c.K = shape[rank - 1];
    c.rows = n / c.K;
    pred = (double *)calloc((size_t)n, sizeof(double));
    target = (double *)calloc((size_t)n, sizeof(double));
    grad_ref = (double *)calloc((size_t)n, sizeof(double));
    grad_num = (double *)calloc((size_t)n, sizeof(double));
    grad_lib = (double *)calloc((size_t)n, sizeof(double));
    labels = (int32_t *)calloc((size_t)c.rows, sizeof(int32_t));
    for (i = 0; i < n; i++) {
        double lo = from_logits || type == MPT_LOSS_MEAN_SQUARED_ERROR ? -3 : 0.05;
        double hi = from_logits || type == MPT_LOSS_MEAN_SQUARED_ERROR ? 3 : 0.95;
        pred[i] = round_to(pred_dtype, test_uniform(lo, hi));
        target[i] = type == MPT_LOSS_MEAN_SQUARED_ERROR ? test_uniform(-1, 1) : test_uniform(0, 1);
        target[i] = (float)target[i];
    }
    /* CCE: a distribution per row, except for rank 3, whose rows sum to
       anything (the gradient is then softmax·Σt − t, not softmax − t). */
    if (type == MPT_LOSS_CATEGORICAL_CROSSENTROPY && rank == 2)
        for (r = 0; r < c.rows; r++) {
            double sum = 0;
            for (k = 0; k < c.K; k++) sum += target[r * c.K + k];
            for (k = 0; k < c.K; k++) target[r * c.K + k] = (float)(target[r * c.K + k] / sum);
        }
    for (r = 0; r < c.rows; r++) labels[r] = (int32_t)test_randint(0, (int)c.K - 1);
    if (sparse) c.labels = labels;
    else c.target = target;

    /* The library. */
    make_tensor(&tp, pred_dtype, rank, shape, pred);
    if (sparse) {
        mpt_tensor_alloc(ctx, &tt, MPT_INT32, rank - 1, shape);
        memcpy(tt.data, labels, sizeof(int32_t) * (size_t)c.rows);
    } else {
        make_tensor(&tt, MPT_FLOAT32, rank, shape, target);
    }
    mpt_tensor_alloc(ctx, &tg, dpred_dtype, rank, shape);
    CHECK(mpt_loss_compute(ctx, &(mpt_loss_desc){.type = type, .from_logits = from_logits,
                                                 .grad_scale = grad_scale},
                           &tp, &tt, &loss_lib, &tg) == MPT_OK,
          "%s: %s", label, mpt_context_error(ctx));

    /* The reference, its gradient checked by central differences: at
       every element of the small cases, at every (n/256)th of a large one
       (each difference costs a whole loss: all of 300 × 11 would be
       O(n²)); the library is compared with the reference everywhere.
       Until the library's gradient is read into grad_lib below, it holds
       the reference at the checked elements. */
    loss_ref = ref_loss(&c, pred, grad_ref);
    step = n > 256 ? n / 256 : 1;
    for (i = 0, m = 0; i < n; i += step, m++) {
        double keep = pred[i], plus, minus;
        pred[i] = keep + h;
        plus = ref_loss(&c, pred, NULL);
        pred[i] = keep - h;
        minus = ref_loss(&c, pred, NULL);
        pred[i] = keep;
        grad_num[m] = (plus - minus) / (2 * h);
        grad_lib[m] = grad_ref[i];
    }
    e = rel_err(grad_lib, grad_num, m);
    CHECK(e < 1e-6, "%s: reference gradient vs finite differences: %.3g", label, e);
    tensor_doubles(&tg, grad_lib);
    CHECK(fabs(loss_lib - loss_ref) <= 2e-6 * (1 + fabs(loss_ref)), "%s: loss %.9g, want %.9g",
          label, loss_lib, loss_ref);
    for (i = 0; i < n; i++) grad_ref[i] *= grad_scale ? grad_scale : 1;
    e = rel_err(grad_lib, grad_ref, n);
    CHECK(e < tol_grad, "%s: gradient relative error %.3g > %.3g", label, e, tol_grad);
    mpt_tensor_free(ctx, &tp);
    mpt_tensor_free(ctx, &tt);
    mpt_tensor_free(ctx, &tg);
    free(pred), free(target), free(grad_ref), free(grad_num), free(grad_lib), free(labels);
    test__end("%s", label);
}

static void test_against_reference(void) {
    static const mpt_loss_type types[] = {
        MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, MPT_LOSS_CATEGORICAL_CROSSENTROPY,
        MPT_LOSS_BINARY_CROSSENTROPY, MPT_LOSS_MEAN_SQUARED_ERROR};
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const int64_t s2[2] = {5, 7}, s3[3] = {2, 3, 4}, s1[1] = {6}, big[2] = {300, 11};
    int t, logits, d;
    for (t = 0; t < 4; t++)
        for (logits = 0; logits < (types[t] == MPT_LOSS_MEAN_SQUARED_ERROR ? 1 : 2); logits++) {
            for (d = 0; d < 3; d++) check_loss(types[t], logits, dtypes[d], dtypes[d], 2, s2, 0);
            check_loss(types[t], logits, MPT_FLOAT32, MPT_FLOAT32, 3, s3, 0);
            check_loss(types[t], logits, MPT_FLOAT16, MPT_FLOAT32, 2, s2, 0);
            check_loss(types[t], logits, MPT_FLOAT32, MPT_FLOAT16, 2, s2, 1024);
            check_loss(types[t], logits, MPT_FLOAT32, MPT_FLOAT32, 2, big, 0.5f);
            if (types[t] >= MPT_LOSS_BINARY_CROSSENTROPY)
                check_loss(types[t], logits, MPT_BFLOAT16, MPT_FLOAT32, 1, s1, 0);
        }
}

/* ======================================================================
   Known answers
   ====================================================================== */

/* loss of pred (rows × K, float32) against float targets or class ids. */
static mpt_status run_loss(mpt_context *c, mpt_loss_type type, int from_logits, int rank,
                           const int64_t *shape, float *pred, const void *target,
                           mpt_dtype target_dtype, int target_rank, const int64_t *target_shape,
                           double *loss, float *grad) {
    mpt_tensor tp, tt, tg;
    mpt_tensor_wrap(c, &tp, MPT_FLOAT32, rank, shape, pred);
    mpt_tensor_wrap(c, &tt, target_dtype, target_rank, target_shape, (void *)target);
    if (grad) mpt_tensor_wrap(c, &tg, MPT_FLOAT32, rank, shape, grad);
    return mpt_loss_compute(c, &(mpt_loss_desc){.type = type, .from_logits = from_logits},
                            &tp, &tt, loss, grad ? &tg : NULL);
}

#define NEAR(a, b, tol) (fabs((double)(a) - (double)(b)) <= (tol))

static void test_known_answers(void) {
    int64_t s12[2] = {1, 2}, s1[1] = {1}, s11[2] = {1, 1}, s22[2] = {2, 2};
    float z[2] = {0, 0}, g[4], p[4];
    int32_t label1[1] = {1};
    double loss;
    /* SCCE from logits [0, 0], label 1: ln 2; gradient softmax − onehot. */
    CHECK(run_loss(ctx, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1, 2, s12, z, label1, MPT_INT32,
                   1, s1, &loss, g) == MPT_OK, "scce");
    CHECK(NEAR(loss, log(2.0), 1e-7), "scce logits [0, 0] = %.9g, want ln 2", loss);
    CHECK(g[0] == 0.5f && g[1] == -0.5f, "scce gradient %g %g", g[0], g[1]);
    /* Labels of shape (batch, 1) too. */
    CHECK(run_loss(ctx, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1, 2, s12, z, label1, MPT_INT32,
                   2, s11, &loss, NULL) == MPT_OK && NEAR(loss, log(2.0), 1e-7),
          "labels (1, 1): %s", mpt_context_error(ctx));
    /* SCCE from probabilities [0.25, 0.75], label 1: −ln 0.75. */
    p[0] = 0.25f, p[1] = 0.75f;
    CHECK(run_loss(ctx, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0, 2, s12, p, label1, MPT_INT32,
                   1, s1, &loss, g) == MPT_OK && NEAR(loss, -log(0.75), 1e-7),
          "scce probs %.9g", loss);
    /* CCE from unnormalised probabilities [1, 3]: divided by the sum 4 first. */
    {
        float t[2] = {0, 1};
        p[0] = 1, p[1] = 3;
        CHECK(run_loss(ctx, MPT_LOSS_CATEGORICAL_CROSSENTROPY, 0, 2, s12, p, t, MPT_FLOAT32, 2,
                       s12, &loss, g) == MPT_OK && NEAR(loss, -log(0.75), 1e-7),
              "cce probs [1, 3] = %.9g, want -ln 0.75", loss);
        /* d/dp of −log(p1 / (p0 + p1)) = [1/4, 1/4 − 1/3] */
        CHECK(NEAR(g[0], 0.25, 1e-7) && NEAR(g[1], 0.25 - 1.0 / 3, 1e-7), "cce gradient %g %g",
              g[0], g[1]);
        /* A one-hot prediction: both classes clipped, the gradient zero. */
        p[0] = 0, p[1] = 1;
        CHECK(run_loss(ctx, MPT_LOSS_CATEGORICAL_CROSSENTROPY, 0, 2, s12, p, t, MPT_FLOAT32, 2,
                       s12, &loss, g) == MPT_OK, "cce clipped");
        CHECK(NEAR(loss, -log((double)(1.0f - EPS)), 1e-9) && g[0] == 0 && g[1] == 0,
              "cce clipped: loss %g gradient %g %g", loss, g[0], g[1]);
        /* Wrong and certain: −log(1e-7) ≈ 16.118, gradient through the sum only. */
        t[0] = 1, t[1] = 0;
        CHECK(run_loss(ctx, MPT_LOSS_CATEGORICAL_CROSSENTROPY, 0, 2, s12, p, t, MPT_FLOAT32, 2,
                       s12, &loss, g) == MPT_OK && NEAR(loss, -log((double)EPS), 1e-5),
              "cce certain and wrong: %g", loss);
    }
    /* BCE: logits 0 with target 1, probability 0.5: both ln 2. */
    {
        float t[1] = {1}, x[1] = {0};
        CHECK(run_loss(ctx, MPT_LOSS_BINARY_CROSSENTROPY, 1, 2, s11, x, t, MPT_FLOAT32, 2, s11,
                       &loss, g) == MPT_OK && NEAR(loss, log(2.0), 1e-7) && g[0] == -0.5f,
              "bce logits 0: %g, gradient %g", loss, g[0]);
        x[0] = 0.5f;
        CHECK(run_loss(ctx, MPT_LOSS_BINARY_CROSSENTROPY, 0, 2, s11, x, t, MPT_FLOAT32, 2, s11,
                       &loss, g) == MPT_OK && NEAR(loss, log(2.0), 1e-7) && NEAR(g[0], -2, 1e-6),
              "bce p 0.5: %g, gradient %g", loss, g[0]);
        /* p = 0 with target 1: clipped to 1e-7, −log(1e-7); gradient 0. */
        x[0] = 0;
        CHECK(run_loss(ctx, MPT_LOSS_BINARY_CROSSENTROPY, 0, 2, s11, x, t, MPT_FLOAT32, 2, s11,
                       &loss, g) == MPT_OK && NEAR(loss, -log((double)EPS), 1e-5) && g[0] == 0,
              "bce p 0: %g, gradient %g", loss, g[0]);
    }
    /* MSE: [[1, 2], [3, 4]] against 0: mean over the last axis (2.5, 12.5)
       then over the batch: 7.5; gradient 2·p / 4. */
    {
        float t[4] = {0, 0, 0, 0};
        p[0] = 1, p[1] = 2, p[2] = 3, p[3] = 4;
        CHECK(run_loss(ctx, MPT_LOSS_MEAN_SQUARED_ERROR, 0, 2, s22, p, t, MPT_FLOAT32, 2, s22,
                       &loss, g) == MPT_OK && loss == 7.5, "mse %g", loss);
        CHECK(g[0] == 0.5f && g[1] == 1 && g[2] == 1.5f && g[3] == 2, "mse gradient %g %g %g %g",
              g[0], g[1], g[2], g[3]);
    }
}

/* Logits of ±1e4 (float16 holds them too): finite losses and gradients. */
static void test_large_logits(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int64_t s12[2] = {1, 2}, s1[1] = {1};
    int32_t label[1] = {1};
    float t[2] = {0, 1};
    double loss;
    int d;
    for (d = 0; d < 3; d++) {
        mpt_tensor tp, tt, tg;
        double v[2] = {1e4, -1e4}, gd[2], big = round_to(dtypes[d], 1e4); /* bfloat16: 9984 */
        make_tensor(&tp, dtypes[d], 2, s12, v);
        mpt_tensor_alloc(ctx, &tg, dtypes[d], 2, s12);
        mpt_tensor_wrap(ctx, &tt, MPT_INT32, 1, s1, label);
        CHECK(mpt_loss_compute(ctx, &(mpt_loss_desc){.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                                                     .from_logits = 1},
                               &tp, &tt, &loss, &tg) == MPT_OK, "scce");
        tensor_doubles(&tg, gd);
        CHECK(isfinite(loss) && NEAR(loss, 2 * big, 1e-3) && gd[0] == 1 && gd[1] == -1,
              "%s scce [1e4, -1e4] label 1: loss %g gradient %g %g", mpt_dtype_name(dtypes[d]),
              loss, gd[0], gd[1]);
        mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 2, s12, t);
        CHECK(mpt_loss_compute(ctx, &(mpt_loss_desc){.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                                                     .from_logits = 1},
                               &tp, &tt, &loss, &tg) == MPT_OK, "cce");
        tensor_doubles(&tg, gd);
        CHECK(NEAR(loss, 2 * big, 1e-3) && gd[0] == 1 && gd[1] == -1, "cce: loss %g gradient %g %g",
              loss, gd[0], gd[1]);
        /* BCE: x = 1e4 with t = 0 costs 1e4, x = −1e4 with t = 1 costs 1e4. */
        t[0] = 0, t[1] = 1;
        CHECK(mpt_loss_compute(ctx, &(mpt_loss_desc){.type = MPT_LOSS_BINARY_CROSSENTROPY,
                                                     .from_logits = 1},
                               &tp, &tt, &loss, &tg) == MPT_OK, "bce");
        tensor_doubles(&tg, gd);
        CHECK(NEAR(loss, big, 1e-3) && gd[0] == 0.5 && gd[1] == -0.5, "bce: loss %g gradient %g %g",
              loss, gd[0], gd[1]);
        mpt_tensor_free(ctx, &tp);
        mpt_tensor_free(ctx, &tg);
    }
}

/* dpred may be pred itself: the gradient replaces the logits. */
static void test_in_place(void) {
    int64_t shape[2] = {6, 9}, ls[1] = {6}, i;
    float z[54], zc[54], g[54];
    int32_t labels[6] = {0, 8, 3, 3, 1, 7};
    double a, b;
    mpt_tensor tp, tt, tg;
    for (i = 0; i < 54; i++) z[i] = zc[i] = (float)test_uniform(-4, 4);
    CHECK(run_loss(ctx, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1, 2, shape, z, labels,
                   MPT_INT32, 1, ls, &a, g) == MPT_OK, "separate");
    mpt_tensor_wrap(ctx, &tp, MPT_FLOAT32, 2, shape, zc);
    mpt_tensor_wrap(ctx, &tg, MPT_FLOAT32, 2, shape, zc);
    mpt_tensor_wrap(ctx, &tt, MPT_INT32, 1, ls, labels);
    CHECK(mpt_loss_compute(ctx, &(mpt_loss_desc){.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                                                 .from_logits = 1},
                           &tp, &tt, &b, &tg) == MPT_OK, "in place: %s", mpt_context_error(ctx));
    CHECK(a == b && memcmp(g, zc, sizeof g) == 0, "in place differs: loss %g vs %g", a, b);
}

/* Targets (R,) for pred (R, 1), as Keras takes them for binary
   crossentropy and mean squared error: the same loss and gradient, to the
   bit, as targets (R, 1); a missing axis other than a last 1 is refused. */
static void test_targets_without_last_axis(void) {
    enum { R = 37 };
    static const mpt_loss_type types[3] = {MPT_LOSS_BINARY_CROSSENTROPY,
                                           MPT_LOSS_BINARY_CROSSENTROPY,
                                           MPT_LOSS_MEAN_SQUARED_ERROR};
    int64_t s_r1[2] = {R, 1}, s_r[1] = {R}, s_r3[2] = {R, 3}, s_short[1] = {R - 1}, i;
    float p[R * 3], t[R * 3], g1[R], g2[R];
    mpt_context *q = quiet_ctx();
    mpt_tensor tp, tt, tg, tp3;
    double a, b;
    int k;
    for (i = 0; i < R * 3; i++) p[i] = (float)test_uniform(0.02, 0.98), t[i] = (float)test_uniform(0, 1);
    mpt_tensor_wrap(ctx, &tp, MPT_FLOAT32, 2, s_r1, p);
    for (k = 0; k < 3; k++) {
        mpt_loss_desc d = {types[k], k == 1, 0};
        mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 2, s_r1, t);
        mpt_tensor_wrap(ctx, &tg, MPT_FLOAT32, 2, s_r1, g1);
        CHECK(mpt_loss_compute(ctx, &d, &tp, &tt, &a, &tg) == MPT_OK, "(R, 1) targets: %s",
              mpt_context_error(ctx));
        mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 1, s_r, t);
        mpt_tensor_wrap(ctx, &tg, MPT_FLOAT32, 2, s_r1, g2);
        CHECK(mpt_loss_compute(ctx, &d, &tp, &tt, &b, &tg) == MPT_OK, "%s: (R,) targets: %s",
              mpt__loss_name(types[k]), mpt_context_error(ctx));
        CHECK(a == b && !memcmp(g1, g2, sizeof g1), "%s (from_logits %d): loss %.17g vs %.17g",
              mpt__loss_name(types[k]), k == 1, a, b);
    }
    mpt_tensor_wrap(q, &tp3, MPT_FLOAT32, 2, s_r3, p);
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 1, s_r, t);
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){MPT_LOSS_MEAN_SQUARED_ERROR, 0, 0}, &tp3, &tt, &a,
                           NULL) == MPT_ERR_SHAPE, "(R,) targets for pred (R, 3) accepted");
    CHECK(strstr(mpt_context_error(q), "(37,)") && strstr(mpt_context_error(q), "(37, 3)"),
          "message: %s", mpt_context_error(q));
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 1, s_short, t);
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){MPT_LOSS_BINARY_CROSSENTROPY, 0, 0}, &tp, &tt, &a,
                           NULL) == MPT_ERR_SHAPE, "(R - 1,) targets for pred (R, 1) accepted");
    mpt_context_destroy(q);
}

/* The same loss, to the bit, with 1 and 4 threads. */
static void test_threads(void) {
    enum { R = 1000, K = 10 };
    int64_t shape[2] = {R, K}, ls[1] = {R}, i;
    float *z = (float *)malloc(sizeof(float) * R * K), *g[2];
    int32_t labels[R];
    double loss[2];
    int t;
    for (i = 0; i < R * K; i++) z[i] = (float)test_uniform(-5, 5);
    for (i = 0; i < R; i++) labels[i] = test_randint(0, K - 1);
    for (t = 0; t < 2; t++) {
        mpt_context *c;
        mpt_context_create(&(mpt_context_desc){.num_threads = t ? 4 : 1}, &c);
        g[t] = (float *)malloc(sizeof(float) * R * K);
        CHECK(run_loss(c, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1, 2, shape, z, labels,
                       MPT_INT32, 1, ls, &loss[t], g[t]) == MPT_OK, "loss");
        mpt_context_destroy(c);
    }
    CHECK(loss[0] == loss[1], "loss %.17g with 1 thread, %.17g with 4", loss[0], loss[1]);
    CHECK(memcmp(g[0], g[1], sizeof(float) * R * K) == 0, "gradients differ");
    free(z), free(g[0]), free(g[1]);
}

/* ======================================================================
   Bad input
   ====================================================================== */

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    int64_t s43[2] = {4, 3}, s45[2] = {4, 5}, s4[1] = {4}, s42[2] = {4, 2};
    float p[20], t[20], g[20];
    int32_t labels[4] = {0, 2, -1, 1};
    double loss = 123;
    mpt_tensor tp, tt, tg, tl;
    mpt_loss_desc scce = {MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1, 0};
    mpt_loss_desc cce = {MPT_LOSS_CATEGORICAL_CROSSENTROPY, 0, 0};
    int i;
    for (i = 0; i < 20; i++) p[i] = 0.1f * (float)(i % 7) + 0.05f, t[i] = 0.25f;
    mpt_tensor_wrap(q, &tp, MPT_FLOAT32, 2, s43, p);
    mpt_tensor_wrap(q, &tl, MPT_INT32, 1, s4, labels);
    mpt_tensor_wrap(q, &tg, MPT_FLOAT32, 2, s43, g);

    /* Class ids out of range, naming the sample and the value. */
    CHECK(mpt_loss_compute(q, &scce, &tp, &tl, &loss, &tg) == MPT_ERR_INVALID_ARGUMENT,
          "label -1 accepted");
    CHECK(strstr(mpt_context_error(q), "sample 2") && strstr(mpt_context_error(q), "-1"),
          "message: %s", mpt_context_error(q));
    CHECK(loss == 123, "loss written on failure");
    labels[2] = 3;
    CHECK(mpt_loss_compute(q, &scce, &tp, &tl, &loss, &tg) == MPT_ERR_INVALID_ARGUMENT,
          "label 3 of 3 classes accepted");
    CHECK(strstr(mpt_context_error(q), "label 3") && strstr(mpt_context_error(q), "0..2"),
          "message: %s", mpt_context_error(q));
    labels[2] = 1;
    CHECK(mpt_loss_compute(q, &scce, &tp, &tl, &loss, &tg) == MPT_OK, "valid labels refused");

    /* NaN and inf in pred (and target), naming the first bad index. */
    p[5] = NAN;
    CHECK(mpt_loss_compute(q, &scce, &tp, &tl, &loss, &tg) == MPT_ERR_NUMERIC, "NaN accepted");
    CHECK(strstr(mpt_context_error(q), "element 5 (sample 1)") != NULL, "message: %s",
          mpt_context_error(q));
    p[5] = 0.5f;
    p[11] = -INFINITY;
    CHECK(mpt_loss_compute(q, &scce, &tp, &tl, &loss, NULL) == MPT_ERR_NUMERIC, "-inf accepted");
    CHECK(strstr(mpt_context_error(q), "element 11") != NULL, "message: %s", mpt_context_error(q));
    p[11] = 0.5f;
    t[3] = NAN;
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 2, s43, t);
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, NULL) == MPT_ERR_NUMERIC, "NaN target accepted");
    t[3] = 0.25f;

    /* Shapes. */
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 2, s45, t);
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, NULL) == MPT_ERR_SHAPE, "(4, 5) target for (4, 3)");
    CHECK(strstr(mpt_context_error(q), "(4, 5)") && strstr(mpt_context_error(q), "(4, 3)"),
          "message: %s", mpt_context_error(q));
    mpt_tensor_wrap(q, &tt, MPT_INT32, 2, s42, labels);
    CHECK(mpt_loss_compute(q, &scce, &tp, &tt, &loss, NULL) == MPT_ERR_SHAPE, "(4, 2) labels accepted");
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 2, s43, t);
    mpt_tensor_wrap(q, &tg, MPT_FLOAT32, 2, s45, g);
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, &tg) == MPT_ERR_SHAPE, "(4, 5) dpred accepted");
    {
        mpt_tensor scalar = tp;
        scalar.rank = 0;
        CHECK(mpt_loss_compute(q, &cce, &scalar, &tt, &loss, NULL) == MPT_ERR_SHAPE,
              "rank-0 pred accepted");
    }

    /* Dtypes. */
    CHECK(mpt_loss_compute(q, &scce, &tp, &tt, &loss, NULL) == MPT_ERR_DTYPE,
          "float labels accepted");
    CHECK(strstr(mpt_context_error(q), "int32") != NULL, "message: %s", mpt_context_error(q));
    mpt_tensor_wrap(q, &tt, MPT_INT32, 2, s43, p);
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, NULL) == MPT_ERR_DTYPE, "int32 cce target accepted");
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 2, s43, t);
    mpt_tensor_wrap(q, &tg, MPT_INT32, 2, s43, g);
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, &tg) == MPT_ERR_DTYPE, "int32 dpred accepted");
    {
        mpt_tensor ip;
        mpt_tensor_wrap(q, &ip, MPT_INT32, 2, s43, p);
        CHECK(mpt_loss_compute(q, &cce, &ip, &tt, &loss, NULL) == MPT_ERR_DTYPE, "int32 pred accepted");
    }

    /* The descriptor and NULLs. */
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = MPT_LOSS_NONE}, &tp, &tt, &loss, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "type none accepted");
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = (mpt_loss_type)99}, &tp, &tt, &loss, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "type 99 accepted");
    CHECK(strstr(mpt_context_error(q), "99") != NULL, "message: %s", mpt_context_error(q));
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = MPT_LOSS_MEAN_SQUARED_ERROR, .from_logits = 1},
                           &tp, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT,
          "mse from logits accepted");
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                                               .grad_scale = -1}, &tp, &tt, &loss, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "grad_scale -1 accepted");
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                                               .grad_scale = NAN}, &tp, &tt, &loss, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "grad_scale NaN accepted");
    CHECK(mpt_loss_compute(q, &(mpt_loss_desc){.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                                               .grad_scale = INFINITY}, &tp, &tt, &loss, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "grad_scale inf accepted");
    CHECK(mpt_loss_compute(q, NULL, &tp, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL desc");
    CHECK(mpt_loss_compute(q, &cce, NULL, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL pred");
    CHECK(mpt_loss_compute(q, &cce, &tp, NULL, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL target");
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, NULL, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL loss");
    CHECK(mpt_loss_compute(NULL, &cce, &tp, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    {
        mpt_tensor nodata = tp;
        nodata.data = NULL;
        CHECK(mpt_loss_compute(q, &cce, &nodata, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT,
              "NULL pred data accepted");
    }

    /* Probabilities whose row sums to 0; a dpred half over pred. */
    for (i = 0; i < 3; i++) p[3 + i] = 0;
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT,
          "zero probability row accepted");
    CHECK(strstr(mpt_context_error(q), "row 1") != NULL, "message: %s", mpt_context_error(q));
    for (i = 0; i < 3; i++) p[3 + i] = 0.3f;
    mpt_tensor_wrap(q, &tg, MPT_FLOAT32, 2, s43, p + 1);
    loss = 123;
    CHECK(mpt_loss_compute(q, &cce, &tp, &tt, &loss, &tg) == MPT_ERR_INVALID_ARGUMENT,
          "dpred partly over pred accepted");
    CHECK(loss == 123, "loss written on failure");
    CHECK(count_errors >= 25, "errors were not all logged (%d)", count_errors);
    mpt_context_destroy(q);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    test_seed(3);
    TEST_RUN(test_known_answers);
    test_against_reference();
    TEST_RUN(test_large_logits);
    TEST_RUN(test_in_place);
    TEST_RUN(test_threads);
    TEST_RUN(test_targets_without_last_axis);
    TEST_RUN(test_bad_input);
    mpt_context_destroy(ctx);
    return test_summary("test_losses");
}

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

   Keras 3 is followed where the spec is silent: decoupled weight decay
   (w −= lr·wd·w, with the scheduled rate) is applied by every optimizer
   that has one, to every trainable variable, before the update; clipping
   is applied to the unscaled gradients, and the L2 term added after it. */

#include <float.h> /* FLT_MIN */

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

/* The rate the model's next step will use. */
static double mpt__current_learning_rate(const mpt_model *m) {
    return mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps);
}

/* ---- walking the trainable parameters as one vector ----------------------- */

typedef void (*mpt__span_fn)(void *arg, mpt__param *P, int64_t begin, int64_t end);

/* Calls fn on each trainable parameter's part of the elements [begin, end)
   of all trainable parameters laid end to end, in parameter order. */
static void mpt__for_spans(mpt_model *m, int64_t begin, int64_t end, mpt__span_fn fn, void *arg) {
    int64_t offset = 0;
    int i;
    for (i = 0; i < m->n_params && offset < end; i++) {
        mpt__param *P = &m->params[i];
        int64_t lo, hi;
        if (!P->trainable) continue;
        lo = MPT__MAX(begin, offset);
        hi = MPT__MIN(end, offset + P->count);
        if (lo < hi) fn(arg, P, lo - offset, hi - offset);
        offset += P->count;
    }
}

static int64_t mpt__trainable_count(const mpt_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < m->n_params; i++)
        if (m->params[i].trainable) n += m->params[i].count;
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

static mpt__ranges mpt__opt_ranges(const mpt_model *m) {
    mpt__ranges r;
    r.total = mpt__trainable_count(m);
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
    mpt_model *m;
    mpt__ranges r;
    mpt__sum_squares_fn sum_squares;
    double partial[MPT__OPT_TASKS]; /* (n_tasks) each range's sum of g² */
} mpt__norm_job;

/* One task's running sum over the spans of its range. */
typedef struct mpt__norm_acc {
    mpt__sum_squares_fn sum_squares;
    double sum;
} mpt__norm_acc;

static void mpt__norm_span(void *arg, mpt__param *P, int64_t begin, int64_t end) {
    mpt__norm_acc *a = (mpt__norm_acc *)arg;
    a->sum += a->sum_squares(P->grad + begin, end - begin);
}

static void mpt__norm_task(void *arg, int64_t task, int thread) {
    mpt__norm_job *j = (mpt__norm_job *)arg;
    int64_t begin = task * j->r.range;
    mpt__norm_acc a;
    (void)thread;
    a.sum_squares = j->sum_squares;
    a.sum = 0;
    mpt__for_spans(j->m, begin, MPT__MIN(begin + j->r.range, j->r.total), mpt__norm_span, &a);
    j->partial[task] = a.sum;
}

/* Σ g² over every trainable gradient as it stands (loss scale included), in
   double, the ranges' sums added in range order: inf or NaN exactly when
   some gradient is, and the same bits for any thread count. */
static double mpt__gradient_sum_squares(mpt_model *m, const mpt__ranges *r) {
    mpt__norm_job j;
    double sum = 0;
    int64_t t;
    j.m = m;
    j.r = *r;
    j.sum_squares = mpt__sum_squares;
#if MPT__X86
    if (m->ctx->cpu & MPT_CPU_AVX2) j.sum_squares = mpt__sum_squares_avx2;
#endif
    mpt__parallel_for(m->ctx, r->n_tasks, mpt__norm_task, &j);
    for (t = 0; t < r->n_tasks; t++) sum += j.partial[t];
    return sum;
}

/* ---- pass 2: the fused update --------------------------------------------- */

typedef struct mpt__update_job mpt__update_job;

/* Updates n elements of the master w from the gradient g and the slots s0,
   s1 (NULL where the optimizer has none). */
typedef void (*mpt__block_fn)(const mpt__update_job *j, float *w, const float *g, float *s0,
                              float *s1, int64_t n);

/* Every number the element loops use, in float32 as Keras computes. */
struct mpt__update_job {
    mpt_model *m;
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
static void mpt__update_span(void *arg, mpt__param *P, int64_t begin, int64_t end) {
    const mpt__update_job *j = (const mpt__update_job *)arg;
    int copy = P->compute != (void *)P->value;
    mpt__convert_fn convert = mpt__convert_kernel(j->m->ctx->cpu, P->compute_dtype, MPT_FLOAT32);
    size_t csize = mpt_dtype_size(P->compute_dtype);
    int64_t b;
    for (b = begin; b < end; b += MPT__OPT_BLOCK) {
        int64_t n = MPT__MIN((int64_t)MPT__OPT_BLOCK, end - b);
        j->block(j, P->value + b, P->grad + b, P->slot[0] ? P->slot[0] + b : NULL,
                 P->slot[1] ? P->slot[1] + b : NULL, n);
        if (copy)
            convert(P->compute_dtype, (char *)P->compute + (size_t)b * csize, MPT_FLOAT32,
                    P->value + b, n);
    }
}

static void mpt__update_task(void *arg, int64_t task, int thread) {
    mpt__update_job *j = (mpt__update_job *)arg;
    int64_t begin = task * j->r.range;
    (void)thread;
    mpt__for_spans(j->m, begin, MPT__MIN(begin + j->r.range, j->r.total), mpt__update_span, j);
}

/* The per-step numbers of the update: the scheduled rate, Adam's α with
   its bias correction for t = optimizer_steps + 1, and the gradient
   multiplier, 1/scale (a reciprocal in double, as PyTorch; exact for a
   power of two) times min(1, c/‖g‖), ‖g‖ the global norm after unscaling. */
static void mpt__update_job_init(mpt_model *m, double sum_sq, mpt__update_job *j) {
    const mpt_optimizer_desc *d = &m->compile.optimizer;
    double lr = mpt__current_learning_rate(m);
    double inv_scale = 1.0 / (double)m->loss_scale;
    double norm = sqrt(sum_sq) * inv_scale, clip = 1.0;
    double t = (double)(m->optimizer_steps + 1);
    int sgd = d->type == MPT_OPTIMIZER_SGD;
    if (d->clip_global_norm > 0 && norm > d->clip_global_norm) clip = d->clip_global_norm / norm;
    j->block = sgd ? mpt__sgd_block : mpt__adam_block;
#if MPT__X86
    if (m->ctx->cpu & MPT_CPU_AVX2) j->block = sgd ? mpt__sgd_block_avx2 : mpt__adam_block_avx2;
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

/* One update of every trainable parameter from P->grad (the model must be
   built and compiled). Returns 1 when applied; 0 when some gradient is
   inf or NaN, and then nothing at all has changed. Allocates nothing. */
static int mpt__optimizer_step(mpt_model *m) {
    mpt__ranges r = mpt__opt_ranges(m);
    mpt__update_job j;
    double sum_sq = mpt__gradient_sum_squares(m, &r);
    if (!isfinite(sum_sq)) return 0;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.r = r;
    mpt__update_job_init(m, sum_sq, &j);
    mpt__parallel_for(m->ctx, r.n_tasks, mpt__update_task, &j);
    m->optimizer_steps++;
    return 1;
}

/* ---- loss scaling ----------------------------------------------------------- */

/* After each step, with finite = what mpt__optimizer_step returned. A
   non-finite step has been skipped whatever the mode (an update from inf
   or NaN gradients would destroy the weights), so skipped_steps counts it
   in every mode. Dynamic mode, as Keras' LossScaleOptimizer: a skipped
   step multiplies the scale by backoff_factor and restarts the count of
   finite steps; growth_interval finite steps in a row multiply it by
   growth_factor. Power-of-two factors keep a power-of-two scale exact.
   Two guards Keras lacks: the scale never grows to inf (as PyTorch's
   newer kernels) nor shrinks below FLT_MIN, where 1/scale would be inf. */
static void mpt__loss_scale_update(mpt_model *m, int finite) {
    const mpt_loss_scale_desc *d = &m->compile.loss_scale;
    int dynamic = d->mode == MPT_LOSS_SCALE_DYNAMIC;
    if (!finite) {
        m->skipped_steps++;
        if (!dynamic) return;
        {
            float old = m->loss_scale, scaled = old * d->backoff_factor;
            m->good_steps = 0;
            if (scaled >= FLT_MIN) m->loss_scale = scaled;
            /* Warned on the way down through 1, so once per collapse. */
            if (old >= 1 && m->loss_scale < 1)
                mpt__log(m->ctx, MPT_LOG_WARNING,
                         "loss scale collapsed to %g: gradients overflow even unscaled — "
                         "check for inf/NaN in the model or data", (double)m->loss_scale);
        }
        return;
    }
    if (!dynamic) return;
    if (++m->good_steps >= d->growth_interval) {
        float grown = m->loss_scale * d->growth_factor;
        if (grown < INFINITY) m->loss_scale = grown;
        m->good_steps = 0;
    }
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
    mpt_compile_desc r;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!desc) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "compile: NULL desc");
    /* Everything is checked before anything changes: a failed compile
       leaves the model as it was. */
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

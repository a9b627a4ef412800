/* Optimizers, learning-rate schedules, loss scaling and compile: each
   optimizer against a reference computed here in double, the schedules at
   chosen steps, a skipped step that changes nothing, the scale's growth
   and backoff, compute copies, determinism across thread counts, and bad
   input. Gradients are written by hand into the parameters. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;

/* ---- a reference optimizer in double ------------------------------------- */

typedef struct ref_opt {
    mpt_optimizer_type type;
    double lr, momentum, b1, b2, eps, wd, l2, clip;
    int nesterov;
} ref_opt;

/* The rule of each optimizer, written from the papers' (and Keras')
   formulas: g unscaled, clipped over all n values, plus l2·w; the weight
   decayed by lr·wd first; then the update with Adam's step t (1-based). */
static void ref_step(const ref_opt *o, int n, double *w, const double *g_in, double *s0,
                     double *s1, int t, double lr) {
    double norm = 0, factor = 1;
    int i;
    for (i = 0; i < n; i++) norm += g_in[i] * g_in[i];
    norm = sqrt(norm);
    if (o->clip > 0 && norm > o->clip) factor = o->clip / norm;
    for (i = 0; i < n; i++) {
        double g = g_in[i] * factor + o->l2 * w[i];
        w[i] -= lr * o->wd * w[i];
        if (o->type == MPT_OPTIMIZER_SGD && o->momentum == 0) {
            w[i] -= lr * g;
        } else if (o->type == MPT_OPTIMIZER_SGD) {
            s0[i] = o->momentum * s0[i] - lr * g;
            w[i] += o->nesterov ? o->momentum * s0[i] - lr * g : s0[i];
        } else {
            double mhat, vhat;
            s0[i] = o->b1 * s0[i] + (1 - o->b1) * g;
            s1[i] = o->b2 * s1[i] + (1 - o->b2) * g * g;
            /* The paper's form, bias-corrected moments m̂ and v̂; Keras adds
               ε to sqrt(v) rather than to sqrt(v̂), which is ε/sqrt(1 − β2^t)
               added to sqrt(v̂). */
            mhat = s0[i] / (1 - pow(o->b1, t));
            vhat = s1[i] / (1 - pow(o->b2, t));
            w[i] -= lr * mhat / (sqrt(vhat) + o->eps / sqrt(1 - pow(o->b2, t)));
        }
    }
}

/* ---- moving values in and out of a model's trainable parameters ---------- */

#define MAXN 64

/* Copies `v` (all trainable parameters end to end) into the values (what
   0, then refreshes the compute copies) or the gradients (what 1, times
   scale); returns how many there are. */
static int put(mpt_model *m, const double *v, int what, double scale) {
    int i, k = 0;
    int64_t e;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        if (!P->trainable) continue;
        for (e = 0; e < P->count; e++, k++) {
            if (what == 0) P->value[e] = (float)v[k];
            else P->grad[e] = (float)(v[k] * scale);
        }
    }
    if (what == 0) mpt_model_refresh_weights(m);
    return k;
}

/* what: 0 values, 1 grads, 2 slot 0, 3 slot 1. */
static int get(const mpt_model *m, double *v, int what) {
    int i, k = 0;
    int64_t e;
    for (i = 0; i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        if (!P->trainable) continue;
        for (e = 0; e < P->count; e++, k++)
            v[k] = what == 0 ? P->value[e] : what == 1 ? P->grad[e] : P->slot[what - 2][e];
    }
    return k;
}

/* Dense(5 → 4) with a bias: kernel (5, 4) and bias (4,), 24 trainable
   values in two tensors; the kernel is long enough for the vector loops
   (8 lanes) and their scalar tails. */
static mpt_model *tiny_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {5}, .input_rank = 1, .policy = policy,
                                          .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4});
    if (mpt_model_build(m, 2) != MPT_OK) fprintf(stderr, "build: %s\n", mpt_context_error(c));
    return m;
}

static mpt_status compile(mpt_model *m, mpt_optimizer_desc opt, mpt_loss_scale_desc ls) {
    mpt_compile_desc d;
    memset(&d, 0, sizeof d);
    d.optimizer = opt;
    d.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    d.loss_scale = ls;
    return mpt_model_compile(m, &d);
}

/* A model big enough for several ranges and many blocks, with kernels in
   the compute dtype and float32 biases. */
static mpt_model *wide_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {300}, .input_rank = 1, .policy = policy,
                                          .seed = 11}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 257});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 33});
    mpt_model_build(m, 1);
    return m;
}

/* Random gradients for step s, the same for every model of this shape. */
static void wide_grads(mpt_model *m, int s, float scale) {
    int i;
    int64_t e;
    test_seed(100 + (unsigned)s);
    for (i = 0; i < m->n_params; i++)
        for (e = 0; e < m->params[i].count; e++)
            m->params[i].grad[e] = (float)test_uniform(-1, 1) * scale;
}

/* The optimizer's two passes on the backend, the model's host copy of the
   training scalars pushed before and pulled after. Returns whether the
   step was applied. */
static int opt_step(mpt_model *m) {
    mpt_step_state st;
    mpt__state_push(m);
    m->be->grad_stats(m->impl, &m->update);
    m->be->update(m->impl, &m->update);
    mpt__state_pull(m, &st);
    return st.finite;
}

/* The loss-scale bookkeeping after a step that was (not) finite. */
static void scale_update(mpt_model *m, int finite) {
    mpt_step_state st;
    mpt__state_push(m);
    m->state[0].finite = finite; /* the CPU backend: host memory */
    m->be->loss_scale_update(m->impl, &m->compile.loss_scale, m->state);
    mpt__state_pull(m, &st);
}

/* A step followed by the loss-scale update, as fit runs them. */
static int apply(mpt_model *m) {
    int finite = opt_step(m);
    scale_update(m, finite);
    return finite;
}

/* Known, float-exact starting weights and gradients for step s. */
static void start_weights(double *w, int n) {
    int i;
    for (i = 0; i < n; i++) w[i] = (float)(0.5 - 0.25 * i + 0.03125 * i * i);
}

static void step_grads(double *g, int n, int s) {
    int i;
    for (i = 0; i < n; i++) g[i] = (float)(sin(1.3 * i + 0.7 * s + 0.2) * (1 + 0.5 * (i % 3)));
}

/* Runs `steps` steps of `opt` on the tiny model (the loss scale `scale`,
   fixed, multiplies the gradients) and checks the weights and slots
   against ref_step at every step. lr_at(t) gives the scheduled rate. */
static void check_optimizer(const char *name, mpt_optimizer_desc opt, const ref_opt *ref,
                            float scale, double (*lr_at)(int t), int steps) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_FLOAT32);
    double w0[MAXN], w[MAXN], g[MAXN], s0[MAXN] = {0}, s1[MAXN] = {0};
    double got[MAXN], dgot[MAXN], dref[MAXN], slot[MAXN];
    int n, s, i;
    test__begin();
    CHECK(compile(m, opt, (mpt_loss_scale_desc){.mode = scale == 1 ? MPT_LOSS_SCALE_NONE
                                                                   : MPT_LOSS_SCALE_FIXED,
                                                .initial_scale = scale}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    n = get(m, w, 0);
    start_weights(w0, n);
    memcpy(w, w0, sizeof w);
    put(m, w0, 0, 1);
    for (s = 0; s < steps; s++) {
        double lr = lr_at ? lr_at(s) : ref->lr;
        step_grads(g, n, s);
        put(m, g, 1, scale);
        CHECK(apply(m) == 1, "step %d skipped", s);
        ref_step(ref, n, w, g, s0, s1, s + 1, lr);
        get(m, got, 0);
        for (i = 0; i < n; i++) {
            dgot[i] = got[i] - w0[i];
            dref[i] = w[i] - w0[i];
        }
        CHECK(rel_err(dgot, dref, n) < 2e-5, "%s step %d: weights moved by %.9g, not %.9g "
              "(element 0; rel err %.3g)", name, s, dgot[0], dref[0], rel_err(dgot, dref, n));
        if (m->n_slots >= 1) {
            get(m, slot, 2);
            CHECK(rel_err(slot, s0, n) < 2e-5, "%s step %d: slot 0 %.9g, not %.9g", name, s,
                  slot[0], s0[0]);
        }
        if (m->n_slots >= 2) {
            get(m, slot, 3);
            CHECK(rel_err(slot, s1, n) < 2e-5, "%s step %d: slot 1 %.9g, not %.9g", name, s,
                  slot[0], s1[0]);
        }
    }
    CHECK(m->optimizer_steps == steps, "optimizer_steps %lld", (long long)m->optimizer_steps);
    mpt_model_destroy(m);
    test__end("optimizer %s", name);
}

static double lr_step_decay(int t) { return 0.1 * pow(0.5, t / 2); }      /* D = 2 */
static double lr_warmup_cosine(int t) {                                    /* W = 2, D = 3 */
    const double pi = 3.14159265358979323846;
    return t < 2 ? 0.1 * (t + 1) / 2 : 0.1 * 0.5 * (1 + cos(pi * fmin(t - 2, 3) / 3));
}

/* Adam's float32 defaults, exactly */
#define ADAM_DEFAULTS .b1 = 0.9f, .b2 = 0.999f, .eps = 1e-7f

static void test_optimizers(void) {
    static const struct {
        const char *name;
        mpt_optimizer_desc opt;
        ref_opt ref;
        float scale;
        double (*lr_at)(int t); /* NULL: ref's lr */
        int steps;
    } cases[] = {
        /* plain SGD */
        {"SGD", {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.1f}, 1, NULL, 4},
        {"SGD default rate", {.type = MPT_OPTIMIZER_SGD}, /* Keras' default rate for SGD */
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.01f}, 1, NULL, 3},
        {"SGD + weight decay + l2",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .weight_decay = 0.05f, .l2 = 0.25f},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.1f, .wd = 0.05f, .l2 = 0.25f}, 1, NULL, 4},
        {"SGD momentum 0.9", {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .momentum = 0.9f},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.1f, .momentum = 0.9f}, 1, NULL, 4},
        {"SGD nesterov",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .momentum = 0.9f, .nesterov = 1},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.1f, .momentum = 0.9f, .nesterov = 1}, 1, NULL, 4},
        {"SGD momentum + weight decay + l2",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .momentum = 0.9f,
          .weight_decay = 0.05f, .l2 = 0.25f},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.1f, .momentum = 0.9f, .wd = 0.05f, .l2 = 0.25f}, 1,
         NULL, 4},
        /* Adam: the first steps are where the bias correction matters most. */
        {"Adam", {.learning_rate = 0.01f},
         {.type = MPT_OPTIMIZER_ADAM, .lr = 0.01f, ADAM_DEFAULTS}, 1, NULL, 5},
        {"Adam beta 0.5/0.75 eps 1e-3",
         {.learning_rate = 0.01f, .beta_1 = 0.5f, .beta_2 = 0.75f, .epsilon = 1e-3f},
         {.type = MPT_OPTIMIZER_ADAM, .lr = 0.01f, .b1 = 0.5f, .b2 = 0.75f, .eps = 1e-3f}, 1,
         NULL, 5},
        {"Adam + l2", {.learning_rate = 0.01f, .l2 = 0.5f},
         {.type = MPT_OPTIMIZER_ADAM, .lr = 0.01f, ADAM_DEFAULTS, .l2 = 0.5f}, 1, NULL, 4},
        {"AdamW default decay", {.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 0.01f},
         {.type = MPT_OPTIMIZER_ADAMW, .lr = 0.01f, ADAM_DEFAULTS, .wd = 0.004f /* Keras' */}, 1,
         NULL, 4},
        /* large enough that a decay applied after the update would show */
        {"AdamW decay 0.5",
         {.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 0.01f, .weight_decay = 0.5f},
         {.type = MPT_OPTIMIZER_ADAMW, .lr = 0.01f, ADAM_DEFAULTS, .wd = 0.5f}, 1, NULL, 4},
        /* Clipping by the global norm over both tensors (the gradients' norm is
           about 4.5: clipped to 1; 100 leaves them alone), with and without a
           loss scale, which must be removed before the norm is taken. */
        {"SGD clip 1", {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f, .clip_global_norm = 1},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.5f, .clip = 1}, 1, NULL, 3},
        {"SGD clip 1, loss scale 1024",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f, .clip_global_norm = 1},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.5f, .clip = 1}, 1024, NULL, 3},
        {"SGD clip 1, loss scale 3 (not a power of two)",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f, .clip_global_norm = 1},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.5f, .clip = 1}, 3, NULL, 3},
        {"SGD clip 100 (no effect)",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f, .clip_global_norm = 100},
         {.type = MPT_OPTIMIZER_SGD, .lr = 0.5f, .clip = 100}, 1, NULL, 3},
        {"Adam clip 0.5 + l2 (l2 after clipping)",
         {.learning_rate = 0.01f, .clip_global_norm = 0.5f, .l2 = 0.125f},
         {.type = MPT_OPTIMIZER_ADAM, .lr = 0.01f, ADAM_DEFAULTS, .clip = 0.5f, .l2 = 0.125f}, 1,
         NULL, 4},
        /* The scheduled rate is the one each step uses. */
        {"SGD momentum, step decay",
         {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .momentum = 0.5f,
          .schedule = {.type = MPT_LR_STEP_DECAY, .decay_steps = 2, .decay_rate = 0.5f}},
         {.type = MPT_OPTIMIZER_SGD, .momentum = 0.5f}, 1, lr_step_decay, 6},
        {"AdamW, warm-up + cosine (decay uses the scheduled rate)",
         {.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 0.1f,
          .schedule = {.type = MPT_LR_COSINE_DECAY, .decay_steps = 3, .warmup_steps = 2}},
         {.type = MPT_OPTIMIZER_ADAMW, ADAM_DEFAULTS, .wd = 0.004f}, 1, lr_warmup_cosine, 7},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_optimizer(cases[i].name, cases[i].opt, &cases[i].ref, cases[i].scale,
                        cases[i].lr_at, cases[i].steps);
}

/* Adam's first step moves every weight by lr·g/(|g| + ε') ≈ lr·sign(g):
   a check that does not depend on ref_step. */
static void test_adam_first_step(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_FLOAT32);
    double w0[MAXN], g[MAXN] = {0}, w[MAXN]; /* put reads as many as the model holds */
    int n, i;
    compile(m, (mpt_optimizer_desc){.learning_rate = 0.01f}, (mpt_loss_scale_desc){0});
    n = get(m, w0, 0);
    step_grads(g, n, 0);
    put(m, g, 1, 1);
    CHECK(apply(m) == 1, "skipped");
    get(m, w, 0);
    for (i = 0; i < n; i++)
        CHECK(fabs((w0[i] - w[i]) - 0.01 * (g[i] > 0 ? 1 : -1)) < 1e-6,
              "element %d moved by %.9g for g = %g", i, w0[i] - w[i], g[i]);
    mpt_model_destroy(m);
}

/* ---- schedules --------------------------------------------------------------- */

static double lr_at(mpt_lr_schedule s, double base, int64_t t) {
    mpt_optimizer_desc in, out;
    memset(&in, 0, sizeof in);
    in.schedule = s;
    if (mpt__optimizer_resolve(ctx, &in, &out) != MPT_OK) return -1;
    return mpt__learning_rate_at(&out, base, t);
}

static void test_schedules(void) {
    static const struct {
        mpt_lr_schedule s;
        int64_t t;
        double want;
    } cases[] = {
        {{MPT_LR_CONSTANT, 0, 0, 0, 0}, 0, 0.1},
        {{MPT_LR_CONSTANT, 0, 0, 0, 0}, 1000000, 0.1},
        {{MPT_LR_EXPONENTIAL_DECAY, 4, 0.5f, 0, 0}, 0, 0.1},
        {{MPT_LR_EXPONENTIAL_DECAY, 4, 0.5f, 0, 0}, 2, 0.07071067811865475},
        {{MPT_LR_EXPONENTIAL_DECAY, 4, 0.5f, 0, 0}, 4, 0.05},
        {{MPT_LR_EXPONENTIAL_DECAY, 4, 0.5f, 0, 0}, 6, 0.035355339059327376},
        {{MPT_LR_EXPONENTIAL_DECAY, 4, 1.0f, 0, 0}, 400, 0.1},
        {{MPT_LR_STEP_DECAY, 4, 0.5f, 0, 0}, 3, 0.1},
        {{MPT_LR_STEP_DECAY, 4, 0.5f, 0, 0}, 4, 0.05},
        {{MPT_LR_STEP_DECAY, 4, 0.5f, 0, 0}, 9, 0.025},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0.25f, 0}, 0, 0.1},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0.25f, 0}, 5, 0.0625},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0.25f, 0}, 10, 0.025},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0.25f, 0}, 25, 0.025},
        {{MPT_LR_COSINE_DECAY, 12, 0, 0, 0}, 4, 0.075},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0, 0}, 10, 0},
        /* warm-up: lr/W at t = 0 up to lr at t = W − 1, then the schedule on t − W */
        {{MPT_LR_CONSTANT, 0, 0, 0, 4}, 0, 0.025},
        {{MPT_LR_CONSTANT, 0, 0, 0, 4}, 1, 0.05},
        {{MPT_LR_CONSTANT, 0, 0, 0, 4}, 3, 0.1},
        {{MPT_LR_CONSTANT, 0, 0, 0, 4}, 4, 0.1},
        {{MPT_LR_CONSTANT, 0, 0, 0, 1}, 0, 0.1},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0, 4}, 3, 0.1},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0, 4}, 4, 0.1},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0, 4}, 9, 0.05},
        {{MPT_LR_COSINE_DECAY, 10, 0, 0, 4}, 14, 0},
        {{MPT_LR_STEP_DECAY, 2, 0.25f, 0, 3}, 2, 0.1},
        {{MPT_LR_STEP_DECAY, 2, 0.25f, 0, 3}, 4, 0.1},
        {{MPT_LR_STEP_DECAY, 2, 0.25f, 0, 3}, 5, 0.025},
    };
    int i;
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        double got = lr_at(cases[i].s, 0.1, cases[i].t);
        test__begin();
        CHECK(fabs(got - cases[i].want) <= 1e-12 + 1e-9 * cases[i].want,
              "got %.12g, want %.12g", got, cases[i].want);
        test__end("schedule type %d (D=%lld rate=%g alpha=%g W=%lld) at t=%lld",
                  (int)cases[i].s.type, (long long)cases[i].s.decay_steps,
                  (double)cases[i].s.decay_rate, (double)cases[i].s.alpha,
                  (long long)cases[i].s.warmup_steps, (long long)cases[i].t);
    }
}

/* The model's current rate follows its step count and its base rate. */
static void test_current_rate(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_FLOAT32);
    double g[MAXN];
    int n;
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.2f,
                                    .schedule = {.type = MPT_LR_STEP_DECAY, .decay_steps = 1,
                                                 .decay_rate = 0.5f}},
            (mpt_loss_scale_desc){0});
    CHECK(fabs(mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps) - 0.2) < 1e-7, "t=0: %g",
          mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps));
    n = get(m, g, 1);
    step_grads(g, n, 0);
    put(m, g, 1, 1);
    apply(m);
    CHECK(fabs(mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps) - 0.1) < 1e-7, "t=1: %g",
          mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps));
    CHECK(mpt_model_set_learning_rate(m, 0.5f) == MPT_OK, "set");
    CHECK(mpt_model_learning_rate(m) == 0.5f, "base %g", (double)mpt_model_learning_rate(m));
    CHECK(fabs(mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps) - 0.25) < 1e-7, "after set: %g",
          mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate, m->optimizer_steps));
    mpt_model_destroy(m);
}

/* ---- loss scaling ------------------------------------------------------------ */

typedef struct snapshot {
    unsigned char *arena[MPT__MEM_COUNT_];
    int64_t optimizer_steps, good_steps, skipped_steps;
    uint64_t step;
    float learning_rate, loss_scale;
} snapshot;

/* The parameter, optimizer-state and weight-copy arenas (everything a step
   may write but the gradients) and the counters. */
static const int snap_arenas[3] = {MPT__MEM_PARAMS, MPT__MEM_OPTIMIZER, MPT__MEM_WEIGHT_COPY};

static void snap_take(const mpt_model *m, snapshot *s) {
    int k;
    memset(s, 0, sizeof *s);
    for (k = 0; k < 3; k++) {
        int a = snap_arenas[k];
        s->arena[a] = (unsigned char *)malloc((size_t)m->arena_bytes[a] + 1);
        if (m->arena_bytes[a]) memcpy(s->arena[a], m->arena[a], (size_t)m->arena_bytes[a]);
    }
    s->optimizer_steps = m->optimizer_steps;
    s->good_steps = m->good_steps;
    s->skipped_steps = m->skipped_steps;
    s->step = m->step;
    s->learning_rate = m->learning_rate;
    s->loss_scale = m->loss_scale;
}

static int snap_same_state(const mpt_model *m, const snapshot *s) {
    int k, same = 1;
    for (k = 0; k < 3; k++) {
        int a = snap_arenas[k];
        same &= m->arena_bytes[a] == 0 ||
                memcmp(s->arena[a], m->arena[a], (size_t)m->arena_bytes[a]) == 0;
    }
    /* (not the step counter: it moves on after every step, skipped or not) */
    return same && s->optimizer_steps == m->optimizer_steps &&
           s->learning_rate == m->learning_rate;
}

static void snap_free(snapshot *s) {
    int k;
    for (k = 0; k < MPT__MEM_COUNT_; k++) free(s->arena[k]);
}

/* An inf or NaN in any one gradient skips the step: every weight, slot,
   compute copy and counter stays bit-identical, the scale halves, and the
   next applied step is Adam's next t (skips do not count). */
static void test_overflow_skips(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    double w[MAXN], g[MAXN], s0[MAXN] = {0}, s1[MAXN] = {0}, got[MAXN];
    const float bad[3] = {INFINITY, -INFINITY, NAN};
    ref_opt r;
    snapshot snap;
    int n, s, k, t = 0;
    memset(&r, 0, sizeof r);
    r.type = MPT_OPTIMIZER_ADAM;
    r.lr = 0.01f;
    r.b1 = 0.9f;
    r.b2 = 0.999f;
    r.eps = 1e-7f;
    CHECK(compile(m, (mpt_optimizer_desc){.learning_rate = 0.01f}, (mpt_loss_scale_desc){0}) ==
              MPT_OK, "compile");
    CHECK(m->compile.loss_scale.mode == MPT_LOSS_SCALE_DYNAMIC, "float16 model not dynamic");
    CHECK(mpt_model_loss_scale(m) == 32768.0f, "initial scale %g", (double)mpt_model_loss_scale(m));
    n = get(m, w, 0);
    for (s = 0; s < 2; s++) { /* two applied steps: slots are not zero */
        step_grads(g, n, s);
        put(m, g, 1, mpt_model_loss_scale(m));
        CHECK(apply(m) == 1, "finite step %d skipped", s);
        ref_step(&r, n, w, g, s0, s1, ++t, r.lr);
    }
    for (k = 0; k < 3; k++) {
        float scale = mpt_model_loss_scale(m);
        step_grads(g, n, 2 + k);
        put(m, g, 1, scale);
        m->params[k == 2 ? 0 : 1].grad[k] = bad[k]; /* kernel or bias, various places */
        snap_take(m, &snap);
        CHECK(opt_step(m) == 0, "%g gradient not detected", (double)bad[k]);
        CHECK(snap_same_state(m, &snap), "a skipped step (%g) changed state", (double)bad[k]);
        CHECK(m->skipped_steps == snap.skipped_steps && m->loss_scale == scale,
              "the step itself touched the loss-scale counters");
        scale_update(m, 0);
        CHECK(snap_same_state(m, &snap), "the scale update changed other state");
        CHECK(m->loss_scale == scale * 0.5f, "scale %g after backoff from %g",
              (double)m->loss_scale, (double)scale);
        CHECK(m->skipped_steps == k + 1 && m->good_steps == 0, "skipped %lld good %lld",
              (long long)m->skipped_steps, (long long)m->good_steps);
        snap_free(&snap);
    }
    step_grads(g, n, 9);
    put(m, g, 1, mpt_model_loss_scale(m));
    CHECK(apply(m) == 1 && m->optimizer_steps == 3, "steps after the skips: %lld",
          (long long)m->optimizer_steps);
    ref_step(&r, n, w, g, s0, s1, ++t, r.lr);
    get(m, got, 0);
    CHECK(rel_err(got, w, n) < 1e-6, "weights after the skips differ from Adam's t = 3");
    mpt_model_destroy(m);
}

/* The same in a model of several ranges: an inf or NaN anywhere, the last
   element included, is found on any thread, and nothing changes. */
static void test_overflow_wide(void) {
    mpt_model *m = wide_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    mpt__ranges r;
    snapshot snap;
    int k;
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .momentum = 0.9f},
            (mpt_loss_scale_desc){0});
    wide_grads(m, 0, 1);
    CHECK(apply(m) == 1, "finite step skipped");
    r = mpt__opt_ranges(&m->update);
    CHECK(r.n_tasks == 3, "%lld ranges", (long long)r.n_tasks);
    for (k = 0; k < 4; k++) {
        /* global element: the first, one in the second and third ranges, the last */
        int64_t at = k == 0 ? 0 : k == 3 ? r.total - 1 : k * r.range + 17, e = at;
        int i = 0;
        while (e >= m->params[i].count) e -= m->params[i++].count;
        wide_grads(m, 1 + k, 1);
        m->params[i].grad[e] = k & 1 ? NAN : -INFINITY;
        snap_take(m, &snap);
        CHECK(apply(m) == 0, "non-finite gradient at element %lld (%s[%lld]) not found",
              (long long)at, m->params[i].name, (long long)e);
        CHECK(snap_same_state(m, &snap), "state changed (element %lld)", (long long)at);
        snap_free(&snap);
    }
    CHECK(m->skipped_steps == 4 && mpt_model_loss_scale(m) == 2048, "skipped %lld, scale %g",
          (long long)m->skipped_steps, (double)mpt_model_loss_scale(m));
    mpt_model_destroy(m);
}

/* growth_interval finite steps in a row double the scale; a skip restarts
   the count. */
static void test_dynamic_growth(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    double g[MAXN];
    int n, s;
    static const int finite[] = {1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1};
    static const float want[] = {8, 8, 16, 16, 16, 8, 8, 8, 16, 16, 16, 32};
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 8,
                                  .growth_interval = 3});
    n = get(m, g, 1);
    for (s = 0; s < 12; s++) {
        step_grads(g, n, s);
        put(m, g, 1, 1);
        if (!finite[s]) m->params[0].grad[0] = NAN;
        CHECK(apply(m) == finite[s], "step %d", s);
        CHECK(mpt_model_loss_scale(m) == want[s], "step %d: scale %g, want %g", s,
              (double)mpt_model_loss_scale(m), (double)want[s]);
    }
    CHECK(m->good_steps == 0 && m->skipped_steps == 1 && m->optimizer_steps == 11,
          "good %lld skipped %lld steps %lld", (long long)m->good_steps,
          (long long)m->skipped_steps, (long long)m->optimizer_steps);
    /* Custom factors, still exact powers of two. */
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 1024,
                                  .growth_interval = 1, .growth_factor = 4,
                                  .backoff_factor = 0.25f});
    put(m, g, 1, 1);
    apply(m);
    CHECK(mpt_model_loss_scale(m) == 4096, "growth 4: %g", (double)mpt_model_loss_scale(m));
    m->params[1].grad[1] = INFINITY;
    apply(m);
    CHECK(mpt_model_loss_scale(m) == 1024, "backoff 0.25: %g", (double)mpt_model_loss_scale(m));
    mpt_model_destroy(m);
}

/* The scale neither grows to inf nor shrinks to 0 (where 1/scale is inf). */
static void test_scale_bounds(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    mpt_context *q = quiet_ctx();
    double g[MAXN];
    int s, n;
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 0x1p127f,
                                  .growth_interval = 1});
    n = get(m, g, 1);
    step_grads(g, n, 0);
    put(m, g, 1, 1e-30);
    apply(m);
    CHECK(mpt_model_loss_scale(m) == 0x1p127f, "grew to %g", (double)mpt_model_loss_scale(m));
    mpt_model_destroy(m);
    m = tiny_model(q, MPT_POLICY_MIXED_FLOAT16); /* a quiet context: the collapse warns */
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 0x1p-124f});
    for (s = 0; s < 5; s++) {
        m->params[0].grad[0] = NAN;
        apply(m);
    }
    CHECK(mpt_model_loss_scale(m) >= FLT_MIN, "shrank to %g", (double)mpt_model_loss_scale(m));
    CHECK(m->skipped_steps == 5, "skipped %lld", (long long)m->skipped_steps);
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* FIXED keeps its scale through overflows and long runs; NONE is 1; both
   still skip non-finite steps and count them. */
static void test_fixed_and_none(void) {
    mpt_model *m = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    double g[MAXN];
    int n, s;
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_FIXED, .initial_scale = 128,
                                  .growth_interval = 2});
    n = get(m, g, 1);
    for (s = 0; s < 7; s++) {
        step_grads(g, n, s);
        put(m, g, 1, 128);
        if (s == 3) m->params[1].grad[0] = -INFINITY;
        CHECK(apply(m) == (s != 3), "step %d", s);
        CHECK(mpt_model_loss_scale(m) == 128, "fixed scale moved to %g at step %d",
              (double)mpt_model_loss_scale(m), s);
    }
    CHECK(m->skipped_steps == 1 && m->optimizer_steps == 6, "skipped %lld steps %lld",
          (long long)m->skipped_steps, (long long)m->optimizer_steps);
    compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_NONE, .initial_scale = 128});
    CHECK(mpt_model_loss_scale(m) == 1, "none: scale %g", (double)mpt_model_loss_scale(m));
    CHECK(m->skipped_steps == 0 && m->optimizer_steps == 0, "compile did not reset counters");
    m->params[0].grad[2] = NAN;
    CHECK(apply(m) == 0 && m->skipped_steps == 1 && mpt_model_loss_scale(m) == 1,
          "none: NaN step not skipped, or scale moved");
    mpt_model_destroy(m);
}

/* DEFAULT: dynamic for float16 compute, none for bfloat16 and float32. */
static void test_default_mode(void) {
    static const struct {
        mpt_policy policy;
        mpt_dtype layer_dtype;
        mpt_loss_scale_mode want;
        float scale;
    } cases[] = {
        {MPT_POLICY_MIXED_FLOAT16, MPT_DTYPE_DEFAULT, MPT_LOSS_SCALE_DYNAMIC, 32768},
        {MPT_POLICY_MIXED_BFLOAT16, MPT_DTYPE_DEFAULT, MPT_LOSS_SCALE_NONE, 1},
        {MPT_POLICY_FLOAT32, MPT_DTYPE_DEFAULT, MPT_LOSS_SCALE_NONE, 1},
        {MPT_POLICY_FLOAT32, MPT_FLOAT16, MPT_LOSS_SCALE_DYNAMIC, 32768},
        {MPT_POLICY_MIXED_BFLOAT16, MPT_FLOAT16, MPT_LOSS_SCALE_DYNAMIC, 32768},
    };
    int i;
    for (i = 0; i < 5; i++) {
        mpt_model *m = NULL;
        test__begin();
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1,
                                                .policy = cases[i].policy}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .dtype = cases[i].layer_dtype});
        CHECK(mpt_model_loss_scale(m) == 1, "before compile: %g", (double)mpt_model_loss_scale(m));
        CHECK(compile(m, (mpt_optimizer_desc){0}, (mpt_loss_scale_desc){0}) == MPT_OK, "compile");
        CHECK(m->compile.loss_scale.mode == cases[i].want, "mode %d, want %d",
              (int)m->compile.loss_scale.mode, (int)cases[i].want);
        CHECK(mpt_model_loss_scale(m) == cases[i].scale, "scale %g",
              (double)mpt_model_loss_scale(m));
        mpt_model_destroy(m);
        test__end("default loss scale, policy %d, last layer %s", (int)cases[i].policy,
                  mpt_dtype_name(cases[i].layer_dtype));
    }
}

static int warnings;
static char last_warning[1024];
static void warn_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    if (level == MPT_LOG_WARNING) {
        warnings++;
        snprintf(last_warning, sizeof last_warning, "%s", msg);
    }
}

/* Falling below 1 warns once, with the scale in the message. */
static void test_collapse_warning(void) {
    mpt_context *c = NULL;
    mpt_model *m;
    int s;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1, .logger = {warn_logger, NULL}}, &c);
    m = tiny_model(c, MPT_POLICY_MIXED_FLOAT16);
    compile(m, (mpt_optimizer_desc){0},
            (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 4});
    warnings = 0;
    for (s = 0; s < 2; s++) {
        m->params[0].grad[0] = NAN;
        apply(m);
    }
    CHECK(warnings == 0 && mpt_model_loss_scale(m) == 1, "warned at scale %g",
          (double)mpt_model_loss_scale(m));
    for (s = 0; s < 6; s++) {
        m->params[0].grad[0] = NAN;
        apply(m);
    }
    CHECK(warnings == 1, "%d warnings", warnings);
    CHECK(strstr(last_warning, "loss scale collapsed to 0.5") != NULL, "message: %s",
          last_warning);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

/* With a power-of-two scale, unscaling is exact: scaled and unscaled
   gradients give bit-identical weights and slots. */
static void test_exact_unscale(void) {
    static const mpt_optimizer_desc opts[] = {
        {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f, .momentum = 0.9f, .nesterov = 1},
        {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f, .clip_global_norm = 0.25f},
        {.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 0.01f, .weight_decay = 0.1f, .l2 = 0.01f},
    };
    static const float scales[] = {1024, 0x1p-10f, 65536};
    int o, k, s, n;
    for (o = 0; o < 3; o++)
        for (k = 0; k < 3; k++) {
            mpt_model *a = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
            mpt_model *b = tiny_model(ctx, MPT_POLICY_MIXED_FLOAT16);
            double g[MAXN], wa[MAXN], wb[MAXN], sa[MAXN], sb[MAXN];
            test__begin();
            compile(a, opts[o], (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_NONE});
            compile(b, opts[o], (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_FIXED,
                                                      .initial_scale = scales[k]});
            n = get(a, g, 1);
            for (s = 0; s < 3; s++) {
                step_grads(g, n, s);
                put(a, g, 1, 1);
                put(b, g, 1, scales[k]);
                apply(a);
                apply(b);
            }
            get(a, wa, 0);
            get(b, wb, 0);
            CHECK(memcmp(wa, wb, sizeof(double) * (size_t)n) == 0, "weights differ");
            CHECK(memcmp(a->arena[MPT__MEM_WEIGHT_COPY], b->arena[MPT__MEM_WEIGHT_COPY],
                         (size_t)a->arena_bytes[MPT__MEM_WEIGHT_COPY]) == 0, "copies differ");
            if (a->n_slots) {
                get(a, sa, 2);
                get(b, sb, 2);
                CHECK(memcmp(sa, sb, sizeof(double) * (size_t)n) == 0, "slots differ");
            }
            mpt_model_destroy(a);
            mpt_model_destroy(b);
            test__end("unscaling by %g is exact (%s)", (double)scales[k],
                      opts[o].type == MPT_OPTIMIZER_SGD ? "SGD nesterov"
                      : opts[o].type == MPT_OPTIMIZER_ADAM ? "Adam + clipping" : "AdamW + l2");
        }
}

/* ---- compute copies, determinism, what is not trained, allocation ------------ */

static void test_compute_copies(void) {
    static const mpt_policy policies[] = {MPT_POLICY_MIXED_FLOAT16, MPT_POLICY_MIXED_BFLOAT16};
    int p, i, s;
    int64_t e;
    for (p = 0; p < 2; p++) {
        mpt_model *m = wide_model(ctx, policies[p]);
        int copies = 0, bad = 0;
        test__begin();
        compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 0.01f},
                (mpt_loss_scale_desc){0});
        for (s = 0; s < 3; s++) {
            wide_grads(m, s, mpt_model_loss_scale(m));
            CHECK(apply(m) == 1, "step %d skipped", s);
        }
        for (i = 0; i < m->n_params; i++) {
            mpt__param *P = &m->params[i];
            if (P->compute == (void *)P->value) continue;
            copies++;
            for (e = 0; e < P->count; e++) {
                uint16_t want = P->compute_dtype == MPT_FLOAT16 ? mpt_float_to_half(P->value[e])
                                                                : mpt_float_to_bf16(P->value[e]);
                bad += ((const uint16_t *)P->compute)[e] != want;
            }
        }
        CHECK(copies == 2, "%d compute copies", copies);
        CHECK(bad == 0, "%d compute elements differ from the converted master", bad);
        mpt_model_destroy(m);
        test__end("compute copies follow the masters (%s)",
                  policies[p] == MPT_POLICY_MIXED_FLOAT16 ? "float16" : "bfloat16");
    }
}

/* The vector and the portable loops do the same float operations in the
   same order; they give the same bits unless the compiler fuses a multiply
   and an add into an FMA, which GNU dialects (gnu99, gnu++17) allow and
   ISO ones (-std=c99, as build.sh uses) do not. */
#ifdef __STRICT_ANSI__
#define SIMD_EXACT 1
#else
#define SIMD_EXACT 0
#endif

/* 1, 2 and 3 threads, the portable loops instead of the AVX-512 and AVX2
   ones, and AVX2 without AVX-512: bit-identical weights and slots
   (clipping on, so the global norm's summation order matters too). */
static void check_threads(const char *name, mpt_optimizer_desc opt) {
    static const int threads[5] = {1, 2, 3, 2, 2};
    static const int disable[5] = {0, 0, 0, ~0, MPT_CPU_AVX512};
    mpt_model *m[5];
    mpt_context *c[5];
    int k, s;
    test__begin();
    for (k = 0; k < 5; k++) {
        mpt_context_create(&(mpt_context_desc){.num_threads = threads[k],
                                               .disable_cpu_features = disable[k]}, &c[k]);
        m[k] = wide_model(c[k], MPT_POLICY_MIXED_FLOAT16);
        compile(m[k], opt,
                (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 3000});
        for (s = 0; s < 3; s++) {
            wide_grads(m[k], s, mpt_model_loss_scale(m[k]));
            CHECK(apply(m[k]) == 1, "step %d skipped", s);
        }
    }
    CHECK(mpt__opt_ranges(&m[0]->update).n_tasks == 3, "%lld ranges, not 3",
          (long long)mpt__opt_ranges(&m[0]->update).n_tasks);
    {   /* the global sum of squares itself: the same bits, and right */
        double sums[4], plain = 0;
        int i;
        int64_t e;
        for (k = 0; k < 4; k++) {
            mpt__ranges r = mpt__opt_ranges(&m[k]->update);
            wide_grads(m[k], 7, 1);
            sums[k] = mpt__gradient_sum_squares(m[k]->ctx, &m[k]->update, &r);
        }
        for (i = 0; i < m[0]->n_params; i++)
            for (e = 0; e < m[0]->params[i].count; e++)
                plain += (double)m[0]->params[i].grad[e] * m[0]->params[i].grad[e];
        CHECK(memcmp(&sums[0], &sums[1], sizeof(double)) == 0 &&
                  memcmp(&sums[0], &sums[2], sizeof(double)) == 0 &&
                  (!SIMD_EXACT || memcmp(&sums[0], &sums[3], sizeof(double)) == 0),
              "sum of squares %.17g / %.17g / %.17g / %.17g with 1/2/3 threads / portable",
              sums[0], sums[1], sums[2], sums[3]);
        CHECK(fabs(sums[3] - plain) <= 1e-12 * plain, "portable sum of squares %.17g, not %.17g",
              sums[3], plain);
        CHECK(fabs(sums[0] - plain) <= 1e-12 * plain, "sum of squares %.17g, not %.17g", sums[0],
              plain);
    }
    for (k = 1; k < 5; k++) {
        int a;
        if (k == 3 && !SIMD_EXACT) { /* FMAs may differ in the last bit: a tolerance */
            double diff = 0, size = 0;
            int i;
            int64_t e;
            for (i = 0; i < m[0]->n_params; i++)
                for (e = 0; e < m[0]->params[i].count; e++) {
                    diff += fabs((double)m[3]->params[i].value[e] - m[0]->params[i].value[e]);
                    size += fabs((double)m[0]->params[i].value[e]);
                }
            CHECK(diff <= 1e-6 * size, "portable loops: weights differ by %g (sum |w| %g)", diff,
                  size);
            continue;
        }
        for (a = 0; a < MPT__MEM_COUNT_; a++) {
            if ((a != MPT__MEM_PARAMS && a != MPT__MEM_OPTIMIZER && a != MPT__MEM_WEIGHT_COPY) ||
                m[0]->arena_bytes[a] == 0)
                continue;
            CHECK(m[k]->arena_bytes[a] == m[0]->arena_bytes[a] &&
                      memcmp(m[k]->arena[a], m[0]->arena[a], (size_t)m[0]->arena_bytes[a]) == 0,
                  "arena %d differs between 1 and %d threads%s", a, threads[k],
                  k == 3 ? " (portable loops)" : k == 4 ? " (AVX2 without AVX-512)" : "");
        }
    }
    for (k = 0; k < 5; k++) {
        mpt_model_destroy(m[k]);
        mpt_context_destroy(c[k]);
    }
    test__end("the same bits on 1, 2, 3 threads, without SIMD and without AVX-512: %s", name);
}

static void test_threads(void) {
    check_threads("Adam, clipping, l2", (mpt_optimizer_desc){.learning_rate = 0.01f,
                                                             .clip_global_norm = 3, .l2 = 0.01f});
    check_threads("AdamW", (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW});
    check_threads("SGD, weight decay, l2", (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD,
                                                                .weight_decay = 0.1f, .l2 = 0.05f});
    check_threads("SGD momentum, clipping", (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD,
                                                                 .momentum = 0.9f,
                                                                 .clip_global_norm = 3});
    check_threads("SGD nesterov, l2", (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD,
                                                           .momentum = 0.9f, .nesterov = 1,
                                                           .l2 = 0.01f});
    /* 3 steps with N = 2: a sum, an update from the mean (clipped: the
       mean's sum of squares over the ranges), a sum again */
    check_threads("Adam, clipping, accumulating 2",
                  (mpt_optimizer_desc){.learning_rate = 0.01f, .clip_global_norm = 3,
                                       .gradient_accumulation_steps = 2});
    check_threads("AdamW excluding biases",
                  (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW, .weight_decay = 0.1f,
                                       .exclude_from_weight_decay = "bias"});
    check_threads("SGD momentum, weight decay excluding kernels",
                  (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .momentum = 0.9f,
                                       .weight_decay = 0.1f, .exclude_from_weight_decay = "kernel"});
    check_threads("SGD momentum, accumulating 2",
                  (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .momentum = 0.9f,
                                       .gradient_accumulation_steps = 2});
}

/* ---- exclude_from_weight_decay ---------------------------------------------- */

/* Dense → LayerNormalization → Dense → BatchNormalization: kernels,
   biases, and the normalizations' gamma and beta. */
static mpt_model *norm_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {20}, .input_rank = 1, .policy = policy,
                                          .seed = 5}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 19});
    mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){0});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 9});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_build(m, 1);
    return m;
}

/* The same random values in every trainable parameter of models of one
   shape (biases and betas start at 0, where a decay changes nothing). */
static void random_weights(mpt_model *m) {
    int i;
    int64_t e;
    test_seed(77);
    for (i = 0; i < m->n_params; i++)
        for (e = 0; m->params[i].trainable && e < m->params[i].count; e++)
            m->params[i].value[e] = (float)test_uniform(-1, 1);
    mpt_model_refresh_weights(m);
}

/* Whether parameter P's master and slots hold the same bits in a and b. */
static int same_param(const mpt__param *a, const mpt__param *b) {
    size_t bytes = (size_t)a->count * sizeof(float);
    return memcmp(a->value, b->value, bytes) == 0 && memcmp(a->slot[0], b->slot[0], bytes) == 0 &&
           memcmp(a->slot[1], b->slot[1], bytes) == 0;
}

/* Whether name holds one of the comma-separated words. */
static int name_has_any(const char *name, const char *words) {
    char copy[64], *w;
    snprintf(copy, sizeof copy, "%s", words);
    for (w = strtok(copy, ","); w; w = strtok(NULL, ","))
        if (strstr(name, w)) return 1;
    return 0;
}

/* Random gradients for step s in the trainable parameters. */
static void trainable_grads(mpt_model *m, int s) {
    int i;
    int64_t e;
    test_seed(200 + (unsigned)s);
    for (i = 0; i < m->n_params; i++)
        for (e = 0; m->params[i].trainable && e < m->params[i].count; e++)
            m->params[i].grad[e] = (float)test_uniform(-1, 1);
}

/* AdamW (weight_decay 0.1) excluding `list`, against the same model with
   no list and with Adam at weight_decay 0: after 3 steps each excluded
   parameter (its name holds one of `words`) is bit for bit Adam's, each other
   bit for bit AdamW's as without the list, and an excluded one differs
   from its decayed self (so that the exclusion is what made it equal). */
static void check_exclusion(mpt_model *(*make)(mpt_context *, mpt_policy), mpt_policy policy,
                            const char *list, const char *words) {
    mpt_optimizer_desc with = {.type = MPT_OPTIMIZER_ADAMW, .weight_decay = 0.1f,
                               .learning_rate = 0.01f, .exclude_from_weight_decay = list};
    mpt_optimizer_desc decayed = with, undecayed = with;
    mpt_model *m[3];
    int k, s, i, excluded = 0, kept = 0, changed = 0;
    decayed.exclude_from_weight_decay = NULL;
    undecayed.type = MPT_OPTIMIZER_ADAM;
    undecayed.weight_decay = 0;
    undecayed.exclude_from_weight_decay = NULL;
    for (k = 0; k < 3; k++) {
        m[k] = make(ctx, policy);
        CHECK(compile(m[k], k == 0 ? with : k == 1 ? decayed : undecayed,
                      (mpt_loss_scale_desc){0}) == MPT_OK, "compile: %s", mpt_context_error(ctx));
        random_weights(m[k]);
        for (s = 0; s < 3; s++) {
            trainable_grads(m[k], s);
            CHECK(apply(m[k]) == 1, "step %d skipped", s);
        }
    }
    CHECK(m[0]->update.no_decay != NULL && m[1]->update.no_decay == NULL,
          "no-decay flags %p / %p", (const void *)m[0]->update.no_decay,
          (const void *)m[1]->update.no_decay);
    for (i = 0; i < m[0]->n_params; i++) {
        const mpt__param *P = &m[0]->params[i];
        if (!P->trainable) continue;
        if (name_has_any(P->name, words)) {
            excluded++;
            changed += !same_param(P, &m[1]->params[i]);
            CHECK(same_param(P, &m[2]->params[i]), "%s is not Adam's without decay", P->name);
        } else {
            kept++;
            CHECK(same_param(P, &m[1]->params[i]), "%s is not decayed as without the list",
                  P->name);
        }
        if (P->compute != (void *)P->value)
            CHECK(memcmp(P->compute, name_has_any(P->name, words) ? m[2]->params[i].compute
                                                                   : m[1]->params[i].compute,
                         (size_t)P->count * mpt_dtype_size(P->compute_dtype)) == 0,
                  "%s's compute copy", P->name);
    }
    CHECK(excluded >= 2 && kept >= 2 && changed == excluded,
          "%d excluded (%d differ from decayed), %d decayed", excluded, changed, kept);
    for (k = 0; k < 3; k++) mpt_model_destroy(m[k]);
}

static void test_exclude_bias(void) {
    check_exclusion(wide_model, MPT_POLICY_FLOAT32, "bias", "bias");
    check_exclusion(wide_model, MPT_POLICY_MIXED_FLOAT16, "bias", "bias");
}

static void test_exclude_norms(void) {
    check_exclusion(norm_model, MPT_POLICY_FLOAT32, "gamma,beta", "gamma,beta");
    check_exclusion(norm_model, MPT_POLICY_MIXED_BFLOAT16, "bias,gamma,beta", "bias,gamma,beta");
}

static int infos;
static char last_info[1024];
static void info_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    if (level != MPT_LOG_INFO || !strstr(msg, "exclude_from_weight_decay")) return;
    infos++;
    snprintf(last_info, sizeof last_info, "%s", msg);
}

/* An item that matches nothing is taken (as Keras) and said once at info
   level; a list that spares nothing leaves the update as without one; an
   empty list is none; compile keeps its own copy. */
static void test_exclude_unmatched(void) {
    mpt_context *c = NULL;
    mpt_model *m;
    char list[32] = "bias,nosuch";
    mpt_context_create(&(mpt_context_desc){.num_threads = 1,
                                           .logger = {.fn = info_logger, .user_data = NULL}},
                       &c);
    m = tiny_model(c, MPT_POLICY_FLOAT32);
    infos = 0;
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW,
                                          .exclude_from_weight_decay = list},
                  (mpt_loss_scale_desc){0}) == MPT_OK, "compile: %s", mpt_context_error(c));
    CHECK(infos == 1 && strstr(last_info, "\"nosuch\""), "%d infos, last: %s", infos, last_info);
    list[0] = 'X'; /* the caller's string may change after compile */
    CHECK(strcmp(m->compile.optimizer.exclude_from_weight_decay, "bias,nosuch") == 0 &&
              m->update.no_decay && m->update.no_decay[0] == 0 && m->update.no_decay[1] == 1,
          "kept \"%s\", flags", m->compile.optimizer.exclude_from_weight_decay);
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW,
                                          .exclude_from_weight_decay = "nosuch"},
                  (mpt_loss_scale_desc){0}) == MPT_OK, "recompile");
    CHECK(m->update.no_decay == NULL && infos == 2, "nothing matched: flags %p, %d infos",
          (const void *)m->update.no_decay, infos);
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW,
                                          .exclude_from_weight_decay = ""},
                  (mpt_loss_scale_desc){0}) == MPT_OK, "empty list");
    CHECK(m->update.no_decay == NULL && m->compile.optimizer.exclude_from_weight_decay == NULL &&
              infos == 2, "empty list: flags %p, %d infos", (const void *)m->update.no_decay, infos);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

/* Non-trainable parameters (BatchNormalization's moving statistics) get
   no slots and no update, not even weight decay. */
static void test_non_trainable(void) {
    mpt_model *m = NULL;
    int i, checked = 0;
    float before[2][4];
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_build(m, 2);
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW, .weight_decay = 0.5f},
                  (mpt_loss_scale_desc){0}) == MPT_OK, "compile");
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        int64_t e;
        if (P->trainable) {
            for (e = 0; e < P->count; e++) P->grad[e] = 0.5f;
            continue;
        }
        for (e = 0; e < P->count; e++) P->value[e] = 1.5f + (float)e;
        memcpy(before[checked], P->value, sizeof before[0]);
        CHECK(P->slot[0] == NULL && P->slot[1] == NULL, "%s has slots", P->name);
        checked++;
    }
    CHECK(checked == 2, "%d non-trainable parameters", checked);
    CHECK(apply(m) == 1, "skipped");
    for (i = 0, checked = 0; i < m->n_params; i++)
        if (!m->params[i].trainable)
            CHECK(memcmp(before[checked++], m->params[i].value, sizeof before[0]) == 0,
                  "%s changed", m->params[i].name);
    mpt_model_destroy(m);
}

/* A step allocates nothing, whatever the outcome. */
static void test_no_allocation(void) {
    counting_alloc counts = {0, 0, -1};
    mpt_context *c = counting_ctx(&counts);
    mpt_model *m;
    long before;
    int s;
    m = wide_model(c, MPT_POLICY_MIXED_FLOAT16);
    compile(m, (mpt_optimizer_desc){.clip_global_norm = 1}, (mpt_loss_scale_desc){0});
    before = counts.allocs;
    for (s = 0; s < 3; s++) {
        wide_grads(m, s, 1);
        if (s == 1) m->params[2].grad[5] = NAN;
        apply(m);
    }
    CHECK(counts.allocs == before, "%ld allocations in 3 steps", counts.allocs - before);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

/* ---- compile ----------------------------------------------------------------- */

static void test_compile_defaults(void) {
    mpt_model *m = NULL;
    const mpt_optimizer_desc *o;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    /* before build: build allocates the slots */
    CHECK(compile(m, (mpt_optimizer_desc){0}, (mpt_loss_scale_desc){0}) == MPT_OK, "compile");
    o = &m->compile.optimizer;
    CHECK(m->compiled && o->type == MPT_OPTIMIZER_ADAM && o->learning_rate == 0.001f &&
              o->beta_1 == 0.9f && o->beta_2 == 0.999f && o->epsilon == 1e-7f &&
              o->weight_decay == 0 && o->l2 == 0 && o->clip_global_norm == 0,
          "Adam defaults");
    CHECK(m->compile.top_k == 5 && m->n_slots == 2 && mpt_model_learning_rate(m) == 0.001f,
          "top_k %d slots %d", m->compile.top_k, m->n_slots);
    {
        const mpt_loss_scale_desc *ls = &m->compile.loss_scale;
        CHECK(ls->mode == MPT_LOSS_SCALE_NONE && ls->initial_scale == 32768 &&
                  ls->growth_interval == 2000 && ls->growth_factor == 2 &&
                  ls->backoff_factor == 0.5f, "loss scale defaults");
    }
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build");
    CHECK(m->params[0].slot[0] && m->params[0].slot[1] && m->params[1].slot[1], "no slots");
    /* recompiling starts afresh */
    m->params[0].slot[0][0] = 5;
    m->optimizer_steps = m->good_steps = m->skipped_steps = 7;
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD}, (mpt_loss_scale_desc){0}) ==
              MPT_OK, "recompile");
    CHECK(m->n_slots == 0 && m->params[0].slot[0] == NULL && mpt_model_learning_rate(m) == 0.01f,
          "SGD: %d slots, lr %g", m->n_slots, (double)mpt_model_learning_rate(m));
    CHECK(m->optimizer_steps == 0 && m->good_steps == 0 && m->skipped_steps == 0,
          "counters not reset");
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .momentum = 0.5f},
                  (mpt_loss_scale_desc){0}) == MPT_OK, "recompile");
    CHECK(m->n_slots == 1 && m->params[0].slot[0] && !m->params[0].slot[1] &&
              m->params[0].slot[0][0] == 0, "SGD momentum: %d slots", m->n_slots);
    CHECK(compile(m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAMW, .schedule = {.type =
                  MPT_LR_COSINE_DECAY, .decay_steps = 10}}, (mpt_loss_scale_desc){0}) == MPT_OK,
          "recompile");
    CHECK(m->compile.optimizer.weight_decay == 0.004f && m->n_slots == 2, "AdamW: wd %g",
          (double)m->compile.optimizer.weight_decay);
    {
        mpt_compile_desc d;
        memset(&d, 0, sizeof d);
        d.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
        d.loss.from_logits = 1;
        d.loss.grad_scale = 0.5f;
        d.metrics = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K;
        d.top_k = 3;
        CHECK(mpt_model_compile(m, &d) == MPT_OK, "compile: %s", mpt_context_error(ctx));
        CHECK(m->compile.top_k == 3 && m->compile.metrics == d.metrics &&
                  m->compile.loss.from_logits == 1 && m->compile.loss.grad_scale == 0.5f,
              "the user's loss and metrics are kept as given");
    }
    mpt_model_destroy(m);
}

typedef struct bad_case {
    const char *what;      /* the words the message must hold */
    const char *value;
    mpt_compile_desc d;
} bad_case;

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = tiny_model(q, MPT_POLICY_FLOAT32);
    mpt_compile_desc good, d;
    bad_case cases[48];
    char long_list[MPT_EXCLUDE_FROM_WEIGHT_DECAY_MAX + 2];
    int n = 0, i;
    memset(long_list, 'a', sizeof long_list - 1);
    long_list[sizeof long_list - 1] = 0;
    memset(&good, 0, sizeof good);
    good.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    good.optimizer.learning_rate = 0.05f;
#define BAD(what_, value_, stmt)                                                 \
    do {                                                                         \
        d = good;                                                                \
        stmt;                                                                    \
        cases[n].what = what_;                                                   \
        cases[n].value = value_;                                                 \
        cases[n++].d = d;                                                        \
    } while (0)
    BAD("loss.type", "required", d.loss.type = MPT_LOSS_NONE);
    BAD("loss type", "99", d.loss.type = (mpt_loss_type)99);
    BAD("metrics", "0x400", d.metrics = 0x400); /* the bit after MPT_METRIC_AUC */
    BAD("top_k", "-1", d.top_k = -1);
    BAD("optimizer: type", "7", d.optimizer.type = (mpt_optimizer_type)7);
    BAD("learning_rate", "-0.5", d.optimizer.learning_rate = -0.5f);
    BAD("learning_rate", "nan", d.optimizer.learning_rate = NAN);
    BAD("learning_rate", "inf", d.optimizer.learning_rate = INFINITY);
    BAD("momentum", "1", d.optimizer.momentum = 1);
    BAD("momentum", "-0.1", d.optimizer.momentum = -0.1f);
    BAD("beta_1", "1.5", d.optimizer.beta_1 = 1.5f);
    BAD("beta_2", "-0.25", d.optimizer.beta_2 = -0.25f);
    BAD("beta_2", "1", d.optimizer.beta_2 = 1);
    BAD("epsilon", "-1", d.optimizer.epsilon = -1);
    BAD("weight_decay", "-0.5", d.optimizer.weight_decay = -0.5f);
    BAD("l2", "-2", d.optimizer.l2 = -2);
    BAD("clip_global_norm", "-1", d.optimizer.clip_global_norm = -1);
    BAD("clip_global_norm", "nan", d.optimizer.clip_global_norm = NAN);
    BAD("schedule.type", "9", d.optimizer.schedule.type = (mpt_lr_schedule_type)9);
    BAD("decay_steps", "0", (d.optimizer.schedule.type = MPT_LR_EXPONENTIAL_DECAY,
                             d.optimizer.schedule.decay_rate = 0.5f));
    BAD("decay_steps", "-3", (d.optimizer.schedule.type = MPT_LR_COSINE_DECAY,
                              d.optimizer.schedule.decay_steps = -3));
    BAD("decay_rate", "0", (d.optimizer.schedule.type = MPT_LR_STEP_DECAY,
                            d.optimizer.schedule.decay_steps = 10));
    BAD("decay_rate", "1.5", (d.optimizer.schedule.type = MPT_LR_EXPONENTIAL_DECAY,
                              d.optimizer.schedule.decay_steps = 10,
                              d.optimizer.schedule.decay_rate = 1.5f));
    BAD("alpha", "2", (d.optimizer.schedule.type = MPT_LR_COSINE_DECAY,
                       d.optimizer.schedule.decay_steps = 10, d.optimizer.schedule.alpha = 2));
    BAD("alpha", "-0.5", d.optimizer.schedule.alpha = -0.5f);
    BAD("warmup_steps", "-1", d.optimizer.schedule.warmup_steps = -1);
    BAD("gradient_accumulation_steps", "-1", d.optimizer.gradient_accumulation_steps = -1);
    BAD("exclude_from_weight_decay", "bias,,gamma",
        d.optimizer.exclude_from_weight_decay = "bias,,gamma");
    BAD("exclude_from_weight_decay", "bias,", d.optimizer.exclude_from_weight_decay = "bias,");
    BAD("exclude_from_weight_decay", "\",bias\"", d.optimizer.exclude_from_weight_decay = ",bias");
    BAD("exclude_from_weight_decay", "\",\"", d.optimizer.exclude_from_weight_decay = ",");
    BAD("exclude_from_weight_decay", "longer than 1023", d.optimizer.exclude_from_weight_decay = long_list);
    BAD("exclude_from_weight_decay", "0xff", d.optimizer.exclude_from_weight_decay = "bias,\xff");
    BAD("loss_scale: mode", "9", d.loss_scale.mode = (mpt_loss_scale_mode)9);
    BAD("initial_scale", "-1", d.loss_scale.initial_scale = -1);
    BAD("initial_scale", "inf", d.loss_scale.initial_scale = INFINITY);
    BAD("growth_interval", "-5", d.loss_scale.growth_interval = -5);
    BAD("growth_factor", "1", d.loss_scale.growth_factor = 1);
    BAD("growth_factor", "0.5", d.loss_scale.growth_factor = 0.5f);
    BAD("backoff_factor", "1", d.loss_scale.backoff_factor = 1);
    BAD("backoff_factor", "-0.5", d.loss_scale.backoff_factor = -0.5f);
    /* a valid optimizer with a bad loss scale: the optimizer is not kept either */
    BAD("backoff_factor", "2", (d.optimizer.type = MPT_OPTIMIZER_SGD, d.optimizer.momentum = 0.5f,
                                d.loss_scale.backoff_factor = 2));
#undef BAD
    CHECK(mpt_model_compile(m, &good) == MPT_OK, "good compile: %s", mpt_context_error(q));
    m->optimizer_steps = 3;
    for (i = 0; i < n; i++) {
        mpt_compile_desc before;
        const char *msg;
        test__begin();
        memcpy(&before, &m->compile, sizeof before);
        CHECK(mpt_model_compile(m, &cases[i].d) == MPT_ERR_INVALID_ARGUMENT, "accepted");
        msg = mpt_context_error(q);
        CHECK(strstr(msg, cases[i].what) && strstr(msg, cases[i].value), "message: %s", msg);
        CHECK(memcmp(&before, &m->compile, sizeof before) == 0 && m->optimizer_steps == 3 &&
                  m->compiled && m->n_slots == 2 && mpt_model_learning_rate(m) == 0.05f,
              "a failed compile changed the model");
        test__end("compile rejects %s %s", cases[i].what, cases[i].value);
    }
    test__begin();
    CHECK(mpt_model_compile(m, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL desc accepted");
    CHECK(mpt_model_compile(NULL, &good) == MPT_ERR_INVALID_ARGUMENT, "NULL model accepted");
    /* Ranges' open ends are accepted. */
    d = good;
    d.optimizer.momentum = 0.999f;
    d.optimizer.schedule.type = MPT_LR_STEP_DECAY;
    d.optimizer.schedule.decay_steps = 1;
    d.optimizer.schedule.decay_rate = 1;
    d.optimizer.schedule.alpha = 1;
    d.loss_scale.growth_interval = 1;
    d.loss_scale.backoff_factor = 0.999f;
    CHECK(mpt_model_compile(m, &d) == MPT_OK, "edge values: %s", mpt_context_error(q));
    test__end("compile: NULL arguments, edge values");

    test__begin();
    CHECK(mpt_model_set_learning_rate(m, -1) == MPT_ERR_INVALID_ARGUMENT, "-1 accepted");
    CHECK(strstr(mpt_context_error(q), "learning_rate") && strstr(mpt_context_error(q), "-1"),
          "message: %s", mpt_context_error(q));
    CHECK(mpt_model_set_learning_rate(m, NAN) == MPT_ERR_INVALID_ARGUMENT, "NaN accepted");
    CHECK(mpt_model_set_learning_rate(m, INFINITY) == MPT_ERR_INVALID_ARGUMENT, "inf accepted");
    CHECK(strstr(mpt_context_error(q), "inf"), "message: %s", mpt_context_error(q));
    CHECK(mpt_model_learning_rate(m) == 0.05f, "a rejected rate was kept");
    CHECK(mpt_model_set_learning_rate(m, 0) == MPT_OK && mpt_model_learning_rate(m) == 0,
          "0 rejected");
    CHECK(mpt_model_set_learning_rate(NULL, 0.1f) == MPT_ERR_INVALID_ARGUMENT, "NULL accepted");
    mpt_model_destroy(m);
    m = tiny_model(q, MPT_POLICY_FLOAT32);
    CHECK(mpt_model_set_learning_rate(m, 0.1f) == MPT_ERR_STATE, "set before compile accepted");
    CHECK(strstr(mpt_context_error(q), "compile"), "message: %s", mpt_context_error(q));
    CHECK(mpt_model_learning_rate(NULL) == 0 && mpt_model_loss_scale(NULL) == 0, "NULL getters");
    mpt_model_destroy(m);
    test__end("set_learning_rate rejects negative, NaN, inf, and before compile");
    CHECK(count_errors >= n, "errors were not all logged (%d)", count_errors);
    mpt_context_destroy(q);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    test_optimizers();
    TEST_RUN(test_adam_first_step);
    test_schedules();
    TEST_RUN(test_current_rate);
    TEST_RUN(test_overflow_skips);
    TEST_RUN(test_overflow_wide);
    TEST_RUN(test_dynamic_growth);
    TEST_RUN(test_scale_bounds);
    TEST_RUN(test_fixed_and_none);
    test_default_mode();
    TEST_RUN(test_collapse_warning);
    test_exact_unscale();
    test_compute_copies();
    test_threads();
    TEST_RUN(test_exclude_bias);
    TEST_RUN(test_exclude_norms);
    TEST_RUN(test_exclude_unmatched);
    TEST_RUN(test_non_trainable);
    TEST_RUN(test_no_allocation);
    TEST_RUN(test_compile_defaults);
    test_bad_input();
    mpt_context_destroy(ctx);
    return test_summary("test_optim");
}

/* A training step by hand: mpt_model_compute_loss, mpt_model_grad_stats,
   mpt_model_scale_grads and mpt_model_sgd_step against hand computations
   on the CPU backend (whose buffers the test reads and writes directly),
   with fresh random weights, inputs and gradients; an inf and a NaN in one
   gradient; bad arguments. tests/test_cuda.c runs them on a GPU against
   the CPU. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;

enum { FEATURES = 5, CLASSES = 3, BATCH = 12 };

/* Dense(7, relu) -> BatchNormalization -> Dense(3): trainable kernels and
   biases, gamma and beta, and two parameters that are not trainable (the
   moving statistics). */
static mpt_model *step_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .policy = policy, .seed = 11}, &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 7, .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .dtype = MPT_FLOAT32});
    CHECK(mpt_model_build(m, BATCH) == MPT_OK, "build: %s", mpt_context_error(c));
    return m;
}

static mpt_param_info param(mpt_model *m, int p) {
    mpt_param_info info;
    CHECK(mpt_model_param(m, p, &info) == MPT_OK, "param %d: %s", p, mpt_context_error(ctx));
    return info;
}

/* Fresh random values (never all zeros) in every trainable gradient. */
static void random_grads(mpt_model *m, double lo, double hi) {
    int p;
    int64_t k;
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info w = param(m, p);
        for (k = 0; w.trainable && k < mpt_tensor_count(&w.grad); k++)
            ((float *)w.grad.data)[k] = (float)test_uniform(lo, hi);
    }
}

/* Every parameter's float32 values (masters, or gradients), concatenated
   in parameter order; free with free(). */
static float *copy_all(mpt_model *m, int grads, int64_t *n) {
    int p;
    int64_t total = 0, at = 0;
    float *out;
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info w = param(m, p);
        total += mpt_tensor_count(&w.value);
    }
    out = (float *)calloc((size_t)total, sizeof(float));
    for (p = 0; out && p < mpt_model_param_count(m); p++) {
        mpt_param_info w = param(m, p);
        int64_t c = mpt_tensor_count(&w.value);
        if (grads && w.trainable) memcpy(out + at, w.grad.data, sizeof(float) * (size_t)c);
        if (!grads) memcpy(out + at, w.value.data, sizeof(float) * (size_t)c);
        at += c;
    }
    *n = total;
    return out;
}

static void random_batch(float *x, int32_t *y) {
    int i;
    for (i = 0; i < BATCH * FEATURES; i++) x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < BATCH; i++) y[i] = test_randint(0, CLASSES - 1);
}

/* One training forward and backward of a random batch, so that every
   buffer holds what a real step leaves there. */
static void forward_backward(mpt_model *m, float *x, int32_t *y, float grad_scale) {
    mpt_tensor xb, yb;
    double loss;
    random_batch(x, y);
    mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){BATCH, FEATURES}, x);
    mpt_tensor_wrap(ctx, &yb, MPT_INT32, 1, (int64_t[]){BATCH}, y);
    CHECK(mpt_model_forward(m, &xb, 1, NULL) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    CHECK(mpt_model_compute_loss(m, &(mpt_loss_desc){
              .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1,
              .grad_scale = grad_scale}, &yb, &loss) == MPT_OK,
          "compute_loss: %s", mpt_context_error(ctx));
    CHECK(mpt_model_backward(m, NULL, NULL) == MPT_OK, "backward: %s", mpt_context_error(ctx));
}

/* ---- compute_loss ------------------------------------------------------------- */

/* The loss and the output gradient are mpt_loss_compute's on the same
   output, for each policy, a sparse and a dense loss, and a grad_scale. */
static void test_compute_loss_is_loss_compute(void) {
    static const mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                           MPT_POLICY_MIXED_BFLOAT16};
    int pi, dense;
    test_seed(101);
    for (pi = 0; pi < 3; pi++)
        for (dense = 0; dense < 2; dense++) {
            mpt_model *m = step_model(ctx, policies[pi]);
            float x[BATCH * FEATURES], onehot[BATCH * CLASSES], want[BATCH * CLASSES];
            int32_t y[BATCH];
            mpt_tensor xb, yb, out, dout, expected;
            mpt_loss_desc d = {.type = dense ? MPT_LOSS_CATEGORICAL_CROSSENTROPY
                                             : MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                               .from_logits = 1, .grad_scale = (float)test_uniform(1, 1000)};
            double got = 0, ref = 0, worst = 0;
            int i;
            if (!m) return;
            random_batch(x, y);
            for (i = 0; i < BATCH * CLASSES; i++) onehot[i] = (float)test_uniform(0.1, 1);
            mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){BATCH, FEATURES}, x);
            if (dense)
                mpt_tensor_wrap(ctx, &yb, MPT_FLOAT32, 2, (int64_t[]){BATCH, CLASSES}, onehot);
            else
                mpt_tensor_wrap(ctx, &yb, MPT_INT32, 1, (int64_t[]){BATCH}, y);
            CHECK(mpt_model_forward(m, &xb, 1, &out) == MPT_OK, "forward: %s",
                  mpt_context_error(ctx));
            CHECK(mpt_model_compute_loss(m, &d, &yb, &got) == MPT_OK, "compute_loss: %s",
                  mpt_context_error(ctx));
            mpt_tensor_wrap(ctx, &expected, MPT_FLOAT32, 2, (int64_t[]){BATCH, CLASSES}, want);
            CHECK(mpt_loss_compute(ctx, &d, &out, &yb, &ref, &expected) == MPT_OK,
                  "loss_compute: %s", mpt_context_error(ctx));
            CHECK(mpt_model_output_grad(m, &dout) == MPT_OK, "output_grad: %s",
                  mpt_context_error(ctx));
            for (i = 0; i < BATCH * CLASSES; i++)
                worst = fmax(worst, fabs(((float *)dout.data)[i] - want[i]) / (fabs(want[i]) + 1e-3));
            CHECK(got > 0 && fabs(got - ref) <= 1e-6 * ref,
                  "policy %d dense %d: loss %.9g, mpt_loss_compute %.9g", pi, dense, got, ref);
            CHECK(worst <= 1e-5, "policy %d dense %d: output gradient off by %g (relative)", pi,
                  dense, worst);
            mpt_model_destroy(m);
        }
}

/* compute_loss gives the loss alone: the same bits whatever metrics the
   model was compiled with (r2_score and auc among them), and evaluate,
   whose metrics those are, reports the same bits before and after it. */
static void test_compute_loss_leaves_the_metrics(void) {
    enum { N = 2 * BATCH + 5 };
    static float x[N * FEATURES], t[N * CLASSES];
    int binary, i;
    test_seed(131);
    for (binary = 0; binary <= 1; binary++) {
        mpt_model *m = step_model(ctx, MPT_POLICY_FLOAT32);
        mpt_dataset *d = NULL;
        mpt_tensor tx, ty, xb, yb;
        mpt_loss_desc loss = {.type = binary ? MPT_LOSS_BINARY_CROSSENTROPY
                                             : MPT_LOSS_MEAN_SQUARED_ERROR,
                              .from_logits = binary};
        mpt_logs before, after;
        double uncompiled = 0, compiled = 0;
        if (!m) return;
        for (i = 0; i < N * FEATURES; i++) x[i] = (float)test_uniform(-2, 2);
        for (i = 0; i < N * CLASSES; i++)
            t[i] = binary ? (float)test_randint(0, 1) : (float)test_uniform(-1, 1);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N, FEATURES}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N, CLASSES}, t);
        mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){BATCH, FEATURES}, x + FEATURES);
        mpt_tensor_wrap(ctx, &yb, MPT_FLOAT32, 2, (int64_t[]){BATCH, CLASSES}, t + CLASSES);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
              "dataset: %s", mpt_context_error(ctx));
        CHECK(mpt_model_forward(m, &xb, 0, NULL) == MPT_OK &&
                  mpt_model_compute_loss(m, &loss, &yb, &uncompiled) == MPT_OK &&
                  mpt_model_compile(m, &(mpt_compile_desc){
                      .loss = loss,
                      .metrics = binary ? MPT_METRIC_AUC | MPT_METRIC_ACCURACY
                                        : MPT_METRIC_R2_SCORE | MPT_METRIC_MEAN_ABSOLUTE_ERROR,
                      .weighted_metrics = binary ? MPT_METRIC_AUC : MPT_METRIC_R2_SCORE}) ==
                      MPT_OK &&
                  mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = BATCH}, &before) ==
                      MPT_OK &&
                  mpt_model_forward(m, &xb, 0, NULL) == MPT_OK &&
                  mpt_model_compute_loss(m, &loss, &yb, &compiled) == MPT_OK &&
                  mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = BATCH}, &after) ==
                      MPT_OK,
              "%s", mpt_context_error(ctx));
        CHECK(compiled == uncompiled && compiled > 0,
              "binary %d: compute_loss %.17g compiled with r2_score/auc, %.17g without", binary,
              compiled, uncompiled);
        CHECK(memcmp(&before, &after, sizeof before) == 0 &&
                  !isnan(mpt_logs_get(&after, binary ? "auc" : "r2_score")) &&
                  !isnan(mpt_logs_get(&after, binary ? "weighted_auc" : "weighted_r2_score")),
              "binary %d: evaluate's %s %.17g before compute_loss, %.17g after", binary,
              binary ? "auc" : "r2_score", mpt_logs_get(&before, binary ? "auc" : "r2_score"),
              mpt_logs_get(&after, binary ? "auc" : "r2_score"));
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
    }
}

/* ---- grad_stats --------------------------------------------------------------- */

static void test_grad_stats_is_the_norm(void) {
    mpt_model *m = step_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    float x[BATCH * FEATURES];
    int32_t y[BATCH];
    int finite = -1, p;
    double norm = -1, want = 0;
    int64_t k;
    if (!m) return;
    test_seed(202);
    forward_backward(m, x, y, 1);
    random_grads(m, -3, 3);
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info w = param(m, p);
        for (k = 0; w.trainable && k < mpt_tensor_count(&w.grad); k++)
            want += (double)((float *)w.grad.data)[k] * ((float *)w.grad.data)[k];
    }
    want = sqrt(want);
    CHECK(mpt_model_grad_stats(m, &finite, &norm) == MPT_OK, "grad_stats: %s",
          mpt_context_error(ctx));
    CHECK(finite == 1, "finite gradients reported as %d", finite);
    CHECK(fabs(norm - want) <= 1e-12 * want, "global norm %.17g, by hand %.17g", norm, want);
    CHECK(mpt_model_grad_stats(m, NULL, NULL) == MPT_OK, "grad_stats with NULL outputs: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
}

/* An inf, then a NaN, in one element of one gradient (a random one). */
static void test_grad_stats_finds_inf_and_nan(void) {
    mpt_model *m = step_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    float x[BATCH * FEATURES];
    int32_t y[BATCH];
    const float bad[2] = {INFINITY, NAN};
    int b;
    if (!m) return;
    test_seed(303);
    forward_backward(m, x, y, 1);
    for (b = 0; b < 2; b++) {
        mpt_param_info w;
        int finite = -1, p;
        double norm = 0;
        int64_t at;
        random_grads(m, -1, 1);
        do p = test_randint(0, mpt_model_param_count(m) - 1);
        while (!param(m, p).trainable);
        w = param(m, p);
        at = test_randint(0, (int)mpt_tensor_count(&w.grad) - 1);
        ((float *)w.grad.data)[at] = bad[b];
        CHECK(mpt_model_grad_stats(m, &finite, &norm) == MPT_OK, "grad_stats: %s",
              mpt_context_error(ctx));
        CHECK(finite == 0, "%g in %s[%lld]: reported finite", (double)bad[b], w.name,
              (long long)at);
        CHECK(b == 0 ? norm == INFINITY : isnan(norm), "%g in %s[%lld]: norm %g", (double)bad[b],
              w.name, (long long)at, norm);
        ((float *)w.grad.data)[at] = 0.5f;
        CHECK(mpt_model_grad_stats(m, &finite, &norm) == MPT_OK && finite == 1 && isfinite(norm),
              "after removing the %g: finite %d, norm %g", (double)bad[b], finite, norm);
    }
    mpt_model_destroy(m);
}

/* ---- scale_grads and sgd_step --------------------------------------------------- */

static void test_scale_grads_multiplies_each(void) {
    mpt_model *m = step_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    float x[BATCH * FEATURES], factor, *before, *after, *values, *values_after;
    int32_t y[BATCH];
    int64_t n, i, wrong = 0;
    if (!m) return;
    test_seed(404);
    forward_backward(m, x, y, 1);
    random_grads(m, -100, 100);
    factor = (float)test_uniform(1e-4, 1);
    before = copy_all(m, 1, &n);
    values = copy_all(m, 0, &n);
    CHECK(mpt_model_scale_grads(m, factor) == MPT_OK, "scale_grads: %s", mpt_context_error(ctx));
    after = copy_all(m, 1, &n);
    values_after = copy_all(m, 0, &n);
    for (i = 0; before && after && i < n; i++) wrong += after[i] != before[i] * factor;
    CHECK(wrong == 0, "%lld of %lld gradients are not g * %g", (long long)wrong, (long long)n,
          (double)factor);
    CHECK(values && values_after && !memcmp(values, values_after, sizeof(float) * (size_t)n),
          "scale_grads changed a weight");
    free(before);
    free(after);
    free(values);
    free(values_after);
    mpt_model_destroy(m);
}

/* w − lr·g on every trainable master, the non-trainable ones untouched,
   and the compute copies rewritten: a forward right after the step gives
   what it gives after mpt_model_refresh_weights. */
static void test_sgd_step_updates_masters_and_copies(void) {
    static const mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    int pi;
    test_seed(505);
    for (pi = 0; pi < 2; pi++) {
        mpt_model *m = step_model(ctx, policies[pi]);
        float x[BATCH * FEATURES], lr = (float)test_uniform(0.01, 0.5), out1[BATCH * CLASSES];
        int32_t y[BATCH];
        float *w0, *g, *w1;
        int64_t n, i, at = 0, wrong = 0;
        int p;
        mpt_tensor xb, out;
        if (!m) return;
        forward_backward(m, x, y, 1);
        random_grads(m, -1, 1);
        w0 = copy_all(m, 0, &n);
        g = copy_all(m, 1, &n);
        CHECK(mpt_model_sgd_step(m, lr) == MPT_OK, "sgd_step: %s", mpt_context_error(ctx));
        w1 = copy_all(m, 0, &n);
        for (p = 0; w0 && g && w1 && p < mpt_model_param_count(m); p++) {
            mpt_param_info w = param(m, p);
            for (i = at; i < at + mpt_tensor_count(&w.value); i++) {
                float want = w.trainable ? w0[i] - lr * g[i] : w0[i];
                wrong += fabsf(w1[i] - want) > 1e-6f * (1 + fabsf(want));
            }
            at += mpt_tensor_count(&w.value);
        }
        CHECK(wrong == 0, "policy %d: %lld of %lld weights are not w - %g * g", pi,
              (long long)wrong, (long long)n, (double)lr);
        mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){BATCH, FEATURES}, x);
        CHECK(mpt_model_forward(m, &xb, 0, &out) == MPT_OK, "forward: %s", mpt_context_error(ctx));
        memcpy(out1, out.data, sizeof out1);
        mpt_model_refresh_weights(m);
        CHECK(mpt_model_forward(m, &xb, 0, &out) == MPT_OK, "forward: %s", mpt_context_error(ctx));
        CHECK(!memcmp(out1, out.data, sizeof out1),
              "policy %d: the compute copies were not rewritten by the step", pi);
        free(w0);
        free(g);
        free(w1);
        mpt_model_destroy(m);
    }
}

/* ---- bad arguments -------------------------------------------------------------- */

static void test_bad_arguments(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *unbuilt = NULL, *m;
    mpt_tensor yb, xb;
    float x[BATCH * FEATURES];
    int32_t y[BATCH];
    double loss;
    int finite;
    mpt_loss_desc d = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1};
    test_seed(606);
    random_batch(x, y);
    mpt_tensor_wrap(q, &yb, MPT_INT32, 1, (int64_t[]){BATCH}, y);
    mpt_tensor_wrap(q, &xb, MPT_FLOAT32, 2, (int64_t[]){BATCH, FEATURES}, x);
    CHECK(mpt_model_grad_stats(NULL, &finite, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL model");
    CHECK(mpt_model_scale_grads(NULL, 2) == MPT_ERR_INVALID_ARGUMENT, "NULL model");
    CHECK(mpt_model_sgd_step(NULL, 0.1f) == MPT_ERR_INVALID_ARGUMENT, "NULL model");
    CHECK(mpt_model_compute_loss(NULL, &d, &yb, &loss) == MPT_ERR_INVALID_ARGUMENT, "NULL model");

    mpt_model_create(q, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1}, &unbuilt);
    mpt_model_add_dense(unbuilt, &(mpt_dense_desc){.units = 2});
    test_expect_error(q, mpt_model_grad_stats(unbuilt, &finite, NULL), MPT_ERR_STATE, "build",
                      "grad_stats before build");
    test_expect_error(q, mpt_model_scale_grads(unbuilt, 2), MPT_ERR_STATE, "build",
                      "scale_grads before build");
    test_expect_error(q, mpt_model_sgd_step(unbuilt, 0.1f), MPT_ERR_STATE, "build",
                      "sgd_step before build");
    test_expect_error(q, mpt_model_compute_loss(unbuilt, &d, &yb, &loss), MPT_ERR_STATE, "build",
                      "compute_loss before build");
    mpt_model_destroy(unbuilt);

    m = step_model(q, MPT_POLICY_MIXED_FLOAT16);
    if (!m) {
        mpt_context_destroy(q);
        return;
    }
    test_expect_error(q, mpt_model_scale_grads(m, INFINITY), MPT_ERR_INVALID_ARGUMENT, "factor inf",
                      "scale_grads(inf)");
    test_expect_error(q, mpt_model_scale_grads(m, NAN), MPT_ERR_INVALID_ARGUMENT, "factor nan",
                      "scale_grads(NaN)");
    test_expect_error(q, mpt_model_sgd_step(m, NAN), MPT_ERR_INVALID_ARGUMENT, "learning_rate nan",
                      "sgd_step(NaN)");
    test_expect_error(q, mpt_model_sgd_step(m, INFINITY), MPT_ERR_INVALID_ARGUMENT,
                      "learning_rate inf", "sgd_step(inf)");
    test_expect_error(q, mpt_model_sgd_step(m, -0.5f), MPT_ERR_INVALID_ARGUMENT,
                      "learning_rate -0.5", "sgd_step(-0.5)");
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_STATE, "forward",
                      "compute_loss before a forward pass");
    CHECK(mpt_model_forward(m, &xb, 1, NULL) == MPT_OK, "forward: %s", mpt_context_error(q));
    test_expect_error(q, mpt_model_compute_loss(m, NULL, &yb, &loss), MPT_ERR_INVALID_ARGUMENT,
                      "NULL desc", "compute_loss(NULL desc)");
    test_expect_error(q, mpt_model_compute_loss(m, &d, NULL, &loss), MPT_ERR_INVALID_ARGUMENT,
                      "NULL target", "compute_loss(NULL target)");
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "NULL loss", "compute_loss(NULL loss)");
    y[BATCH / 2] = CLASSES;
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_INVALID_ARGUMENT,
                      "label 3 of sample 6", "compute_loss(label out of range)");
    y[BATCH / 2] = 0;
    d.grad_scale = INFINITY;
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_INVALID_ARGUMENT,
                      "grad_scale inf", "compute_loss(grad_scale inf)");
    d.grad_scale = 0;
    mpt_tensor_wrap(q, &yb, MPT_INT32, 1, (int64_t[]){BATCH - 1}, y);
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_SHAPE, "(11,)",
                      "compute_loss(target of 11 rows)");
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_compute_loss_is_loss_compute);
    TEST_RUN(test_compute_loss_leaves_the_metrics);
    TEST_RUN(test_grad_stats_is_the_norm);
    TEST_RUN(test_grad_stats_finds_inf_and_nan);
    TEST_RUN(test_scale_grads_multiplies_each);
    TEST_RUN(test_sgd_step_updates_masters_and_copies);
    TEST_RUN(test_bad_arguments);
}

int main(void) {
    static const test_program p = {.name = "test_step", .ctx = &ctx, .threads = 2,
                                   .cases = run_cases};
    return test_main(&p);
}

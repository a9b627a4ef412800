/* The training loop: fit, evaluate, predict, summary, history, progress
   output; loss scaling through real steps (an overflow skips the step and
   touches no state); bit-identical resume from a checkpoint; bad input;
   and a short real training run on Fashion-MNIST. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;
static char tmpdir[512]; /* the cases' files: test_main makes it and removes it */

/* ---- small synthetic data -------------------------------------------------------- */

enum { N_SYN = 200, FEATURES = 6, CLASSES = 3 };

/* Three classes separated along different feature directions. */
static void make_blobs(float *x, int32_t *y, int n, uint64_t seed) {
    int i, j;
    for (i = 0; i < n; i++) {
        uint32_t r[4];
        y[i] = i % CLASSES;
        for (j = 0; j < FEATURES; j++) {
            mpt_philox4x32(seed, (uint64_t)i, (uint64_t)j, r);
            x[i * FEATURES + j] = (float)(r[0] / 4294967296.0 - 0.5) + (j == y[i] ? 1.5f : 0.0f);
        }
    }
}

static mpt_dataset *blob_dataset(float *x, int32_t *y, int n) {
    return test_dataset_xy(ctx, x, y, n, FEATURES);
}

/* Dense(16, relu) -> BatchNormalization -> Dropout -> Dense(3, softmax),
   built for max_batch (0: not built). */
static mpt_model *blob_model_for(mpt_policy policy, uint64_t seed, int64_t max_batch) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = policy, .seed = seed}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.2f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K, .top_k = 2}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    if (max_batch > 0)
        CHECK(mpt_model_build(m, max_batch) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static mpt_model *blob_model(mpt_policy policy, uint64_t seed) {
    return blob_model_for(policy, seed, 32);
}

/* ---- fit learns; history; evaluate and predict agree -------------------------------- */

static void test_fit_learns_and_reports(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    mpt_dataset *d;
    mpt_model *m;
    mpt_logs logs;
    mpt_tensor pred;
    mpt_history h;
    int64_t i, correct = 0;
    make_blobs(x, y, N_SYN, 1);
    d = blob_dataset(x, y, N_SYN);
    m = blob_model(MPT_POLICY_FLOAT32, 3);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 8, .batch_size = 32,
                                              .validation_split = 0.25f}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_history(m, &h);
    CHECK(h.epochs == 8, "history has %d epochs", h.epochs);
    CHECK(history_value(m, "loss", 7) < history_value(m, "loss", 0), "loss did not fall: %g -> %g",
          history_value(m, "loss", 0), history_value(m, "loss", 7));
    CHECK(history_value(m, "val_accuracy", 7) >= 0.9, "val_accuracy %g",
          history_value(m, "val_accuracy", 7));
    CHECK(history_value(m, "sparse_top_k_categorical_accuracy", 7) >=
              history_value(m, "accuracy", 7), "top-2 below top-1");
    CHECK(history_value(m, "learning_rate", 0) > 0.0099 && history_value(m, "learning_rate", 0) < 0.0101,
          "learning_rate %g", history_value(m, "learning_rate", 0));
    CHECK(history_value(m, "loss_scale", 0) == 1, "float32 loss scale %g",
          history_value(m, "loss_scale", 0));
    CHECK(history_value(m, "skipped_steps", 0) == 0, "skipped steps");
    CHECK(history_value(m, "samples_per_second", 0) > 0, "samples_per_second");
    CHECK(mpt_model_epoch(m) == 8, "epoch %d", mpt_model_epoch(m));

    /* evaluate's accuracy is what predict's argmax gives */
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    CHECK(pred.rank == 2 && pred.shape[0] == N_SYN && pred.shape[1] == CLASSES, "predict shape");
    for (i = 0; i < N_SYN; i++) {
        const float *p = (const float *)pred.data + i * CLASSES;
        int best = p[1] > p[0] ? 1 : 0;
        best = p[2] > p[best] ? 2 : best;
        correct += best == y[i];
        CHECK(fabsf(p[0] + p[1] + p[2] - 1) < 1e-5f, "probabilities of %lld sum to %g",
              (long long)i, p[0] + p[1] + p[2]);
    }
    CHECK(fabs(mpt_logs_get(&logs, "accuracy") - (double)correct / N_SYN) < 1e-12,
          "evaluate %g vs predict %g", mpt_logs_get(&logs, "accuracy"), (double)correct / N_SYN);
    mpt_tensor_free(ctx, &pred);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- a regression's metrics --------------------------------------------------- */

enum { N_REG = 120, REG_IN = 4, REG_OUT = 2 };

/* A dataset of float x (n, REG_IN) and float targets (n, REG_OUT). */
static mpt_dataset *regression_dataset(float *x, float *y, int64_t n) {
    mpt_tensor tx, ty;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){n, REG_IN}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){n, REG_OUT}, y);
    return test_dataset_of(ctx, &tx, &ty);
}

/* mean_absolute_error, mean_squared_error, root_mean_squared_error and
   mean_absolute_percentage_error in fit's history (and their val_ twins)
   and in evaluate's logs equal Keras' definitions computed in double from
   predict's outputs, over uneven batches, in float32 and mixed_float16;
   a target of 0 takes Keras' epsilon; a crossentropy refuses them. */
static void test_regression_metrics(void) {
    static float x[N_REG * REG_IN], y[N_REG * REG_OUT];
    const int metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_MEAN_SQUARED_ERROR |
                        MPT_METRIC_ROOT_MEAN_SQUARED_ERROR |
                        MPT_METRIC_MEAN_ABSOLUTE_PERCENTAGE_ERROR;
    mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    mpt_dataset *d;
    int64_t i, k;
    int pi;
    for (i = 0; i < N_REG; i++) {
        for (k = 0; k < REG_IN; k++) x[i * REG_IN + k] = (float)test_uniform(-1, 1);
        y[i * REG_OUT] = 2 * x[i * REG_IN] - x[i * REG_IN + 1] + (float)test_uniform(-0.1, 0.1);
        y[i * REG_OUT + 1] = x[i * REG_IN + 2] * x[i * REG_IN + 3] + 0.5f;
    }
    y[5 * REG_OUT] = 0; /* |y| < epsilon: divided by 1e-7 */
    d = regression_dataset(x, y, N_REG);
    for (pi = 0; pi < 2; pi++) {
        mpt_model *m = NULL;
        mpt_logs logs;
        mpt_tensor pred;
        double sum_abs = 0, sum_sq = 0, sum_pct = 0, n = (double)N_REG * REG_OUT;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {REG_IN}, .input_rank = 1,
                                                .policy = policies[pi], .seed = 4}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = REG_OUT});
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
                  .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}, .metrics = metrics}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 16,
                                                  .validation_split = 0.25f}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(history_value(m, "mean_absolute_error", 2) < history_value(m, "mean_absolute_error", 0),
              "mae did not fall: %g -> %g", history_value(m, "mean_absolute_error", 0),
              history_value(m, "mean_absolute_error", 2));
        CHECK(fabs(history_value(m, "root_mean_squared_error", 2) -
                   sqrt(history_value(m, "mean_squared_error", 2))) < 1e-12,
              "rmse %g, mse %g", history_value(m, "root_mean_squared_error", 2),
              history_value(m, "mean_squared_error", 2));
        CHECK(history_value(m, "val_mean_absolute_percentage_error", 2) > 0, "val_mape missing");
        /* the loss is the mean squared error itself */
        CHECK(fabs(history_value(m, "mean_squared_error", 2) - history_value(m, "loss", 2)) <
                  1e-5 * history_value(m, "loss", 2),
              "mse %g, loss %g", history_value(m, "mean_squared_error", 2),
              history_value(m, "loss", 2));
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        for (i = 0; i < N_REG * REG_OUT; i++) {
            double t = y[i], e = fabs(t - ((const float *)pred.data)[i]);
            sum_abs += e;
            sum_sq += e * e;
            sum_pct += 100 * e / (fabs(t) > 1e-7 ? fabs(t) : 1e-7);
        }
        CHECK(fabs(mpt_logs_get(&logs, "mean_absolute_error") - sum_abs / n) <= 1e-12 * sum_abs / n,
              "%s mae %.17g vs %.17g", mpt_policy_name(policies[pi]),
              mpt_logs_get(&logs, "mean_absolute_error"), sum_abs / n);
        CHECK(fabs(mpt_logs_get(&logs, "mean_squared_error") - sum_sq / n) <= 1e-12 * sum_sq / n,
              "mse %.17g vs %.17g", mpt_logs_get(&logs, "mean_squared_error"), sum_sq / n);
        CHECK(fabs(mpt_logs_get(&logs, "root_mean_squared_error") - sqrt(sum_sq / n)) <=
                  1e-12 * sqrt(sum_sq / n),
              "rmse %.17g vs %.17g", mpt_logs_get(&logs, "root_mean_squared_error"),
              sqrt(sum_sq / n));
        CHECK(sum_pct / n > 1e6, "the zero target's term is missing: %g", sum_pct / n);
        CHECK(fabs(mpt_logs_get(&logs, "mean_absolute_percentage_error") - sum_pct / n) <=
                  1e-12 * sum_pct / n,
              "mape %.17g vs %.17g", mpt_logs_get(&logs, "mean_absolute_percentage_error"),
              sum_pct / n);
        mpt_tensor_free(ctx, &pred);
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(d);
    {
        mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 3);
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR}) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "need the mean_squared_error loss"),
              "error metrics with a crossentropy: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
    }
}

/* precision and recall of a binary classifier (a sigmoid unit and binary
   crossentropy, its sigmoid fused into the loss during fit) as Keras
   counts them, from predict's probabilities against 0.5, over uneven
   batches; with the history's val_ twins; refused with a softmax. */
static void test_precision_and_recall(void) {
    static float x[N_SYN * FEATURES], t[N_SYN];
    static int32_t y[N_SYN];
    mpt_dataset *d;
    mpt_tensor tx, ty, pred;
    mpt_model *m = NULL;
    mpt_logs logs;
    double tp = 0, fp = 0, fn = 0;
    int64_t i;
    make_blobs(x, y, N_SYN, 3);
    for (i = 0; i < N_SYN; i++) t[i] = y[i] == 1 ? 1.0f : 0.0f; /* class 1 against the rest */
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, t);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 6}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 1, .activation = MPT_ACT_SIGMOID});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.05f}, .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
              .metrics = MPT_METRIC_PRECISION | MPT_METRIC_RECALL}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32,
                                              .validation_split = 0.25f}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(history_value(m, "val_recall", 1) >= 0 && history_value(m, "precision", 1) >= 0,
          "val_recall %g, precision %g", history_value(m, "val_recall", 1),
          history_value(m, "precision", 1));
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    for (i = 0; i < N_SYN; i++) {
        int predicted = ((const float *)pred.data)[i] > 0.5f, labelled = t[i] != 0;
        tp += predicted && labelled;
        fp += predicted && !labelled;
        fn += !predicted && labelled;
    }
    CHECK(tp > 0 && tp + fp < N_SYN, "a degenerate classifier: TP %g FP %g FN %g", tp, fp, fn);
    CHECK(mpt_logs_get(&logs, "precision") == tp / (tp + fp), "precision %.17g vs %.17g",
          mpt_logs_get(&logs, "precision"), tp / (tp + fp));
    CHECK(mpt_logs_get(&logs, "recall") == tp / (tp + fn), "recall %.17g vs %.17g",
          mpt_logs_get(&logs, "recall"), tp / (tp + fn));
    mpt_tensor_free(ctx, &pred);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    m = blob_model(MPT_POLICY_FLOAT32, 3);
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_RECALL}) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "count binary outputs"),
          "recall with a softmax: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);
}

/* A one-layer classifier of the blobs: Dense(3, softmax), or one sigmoid
   unit for binary crossentropy, SGD at lr. */
static mpt_model *weighted_model(mpt_loss_type loss, float lr) {
    mpt_model *m = NULL;
    int binary = loss == MPT_LOSS_BINARY_CROSSENTROPY;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .seed = 8}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = binary ? 1 : CLASSES,
                                             .activation = binary ? MPT_ACT_SIGMOID
                                                                  : MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){.optimizer = {.type = MPT_OPTIMIZER_SGD,
                                                                 .learning_rate = lr},
                                                   .loss = {.type = loss}}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    return m;
}

/* fit's class_weight as Keras': (1) the first epoch's loss (one batch of
   every sample, at the initial weights) is Σ w[class]·loss / rows,
   computed here from predict's probabilities, for class ids, one-hot
   targets and one binary unit; (2) weights of 1 train bit for bit as no
   weights; (3) weights of 2 train exactly as SGD at twice the rate;
   (4) bad tables, losses and binary targets are refused, naming them. */
static void test_class_weight(void) {
    static float x[N_SYN * FEATURES], onehot[N_SYN * CLASSES], binary[N_SYN];
    static int32_t y[N_SYN];
    const float w3[CLASSES] = {0.5f, 3.0f, 0.0f}, w2[2] = {0.25f, 4.0f};
    const mpt_loss_type losses[3] = {MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                                     MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                                     MPT_LOSS_BINARY_CROSSENTROPY};
    const char *loss_names[3] = {"sparse", "one-hot", "binary"};
    mpt_dataset *data[3];
    mpt_tensor tx, ty;
    int64_t i;
    int li;
    make_blobs(x, y, N_SYN, 4);
    for (i = 0; i < N_SYN; i++) {
        onehot[i * CLASSES + y[i]] = 1;
        binary[i] = y[i] == 2 ? 1.0f : 0.0f;
    }
    data[0] = blob_dataset(x, y, N_SYN);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, CLASSES}, onehot);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data[1]) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, binary);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data[2]) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    for (li = 0; li < 3; li++) {
        int bin = losses[li] == MPT_LOSS_BINARY_CROSSENTROPY;
        const float *w = bin ? w2 : w3;
        mpt_model *m = weighted_model(losses[li], 0.01f);
        mpt_tensor pred;
        double sum = 0, got;
        CHECK(mpt_model_predict(m, data[li], N_SYN, &pred) == MPT_OK, "predict: %s",
              mpt_context_error(ctx));
        for (i = 0; i < N_SYN; i++) {
            const float *p = (const float *)pred.data + i * (bin ? 1 : CLASSES);
            if (bin)
                sum += w[binary[i] > 0.5f] * -(binary[i] ? log(p[0]) : log(1 - (double)p[0]));
            else
                sum += w[y[i]] * -log(p[y[i]]);
        }
        mpt_tensor_free(ctx, &pred);
        CHECK(mpt_model_fit(m, data[li], &(mpt_fit_desc){.epochs = 1, .batch_size = N_SYN,
                                                         .class_weight = w,
                                                         .class_weight_count = bin ? 2 : CLASSES})
                  == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        got = history_value(m, "loss", 0);
        CHECK(fabs(got - sum / N_SYN) <= 1e-5 * (sum / N_SYN), "%s: weighted loss %.9g, by hand %.9g",
              loss_names[li], got, sum / N_SYN);
        mpt_model_destroy(m);
    }
    {   /* weights 1: no weights; weights 2: twice the rate (both exact) */
        const float ones[CLASSES] = {1, 1, 1}, twos[CLASSES] = {2, 2, 2};
        mpt_model *a = weighted_model(losses[0], 0.02f), *b = weighted_model(losses[0], 0.02f),
                  *c = weighted_model(losses[0], 0.01f), *d = weighted_model(losses[0], 0.02f);
        mpt_fit_desc fit = {.epochs = 2, .batch_size = 16};
        CHECK(mpt_model_fit(a, data[0], &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        fit.class_weight = ones;
        fit.class_weight_count = CLASSES;
        CHECK(mpt_model_fit(b, data[0], &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        fit.class_weight = twos;
        CHECK(mpt_model_fit(c, data[0], &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(test_same_state(a, b), "class weights of 1 changed the training");
        CHECK(test_same_state(a, c), "class weights of 2 differ from twice the learning rate");
        CHECK(history_value(c, "loss", 1) == 2 * history_value(a, "loss", 1),
              "loss %.17g, not twice %.17g", history_value(c, "loss", 1), history_value(a, "loss", 1));
        /* refusals */
        fit.class_weight_count = 2;
        CHECK(mpt_model_fit(d, data[0], &fit) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "class_weight has 2 weights"),
              "short table: %s", mpt_context_error(ctx));
        fit.class_weight = (const float[]){1, -1, 1};
        fit.class_weight_count = CLASSES;
        CHECK(mpt_model_fit(d, data[0], &fit) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "class_weight[1] = -1"),
              "negative weight: %s", mpt_context_error(ctx));
        mpt_model_destroy(a);
        mpt_model_destroy(b);
        mpt_model_destroy(c);
        mpt_model_destroy(d);
    }
    {
        mpt_model *m = weighted_model(losses[2], 0.01f);
        binary[7] = 1.5f;
        CHECK(mpt_model_fit(m, data[2], &(mpt_fit_desc){.epochs = 1, .class_weight = w2,
                                                        .class_weight_count = 2})
                      == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "binary target 7 is 1.5"),
              "binary target out of range: %s", mpt_context_error(ctx));
        binary[7] = 0;
        mpt_model_destroy(m);
    }
    for (li = 0; li < 3; li++) mpt_dataset_destroy(data[li]);
}

/* ---- sample weights and weighted metrics ---------------------------------------- */

/* A weight per sample: 0 .. 2.5 in a pattern that leaves no run of equal
   ones, and one 0. */
static void sample_weights(float *w, int n) {
    int i;
    for (i = 0; i < n; i++) w[i] = (float)((i * 7) % 11) * 0.25f;
}

/* The blobs with class ids and sample weights w (copied). */
static mpt_dataset *weighted_blobs(float *x, int32_t *y, const float *w, int n) {
    mpt_tensor tx, ty, tw;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){n, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){n}, y);
    mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, (int64_t[]){n}, (void *)(uintptr_t)w);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty, .sample_weight = &tw},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* Σ w·(crossentropy of predict's probabilities) over samples
   [first, first + n) of a dataset, times cw[label] when cw is given. */
static double weighted_xent(mpt_model *m, const mpt_dataset *d, const int32_t *y, const float *w,
                            const float *cw, int64_t first, int64_t n) {
    mpt_tensor pred;
    double sum = 0;
    int64_t i;
    CHECK(mpt_model_predict(m, d, N_SYN, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    for (i = 0; i < n; i++) {
        int32_t label = y[first + i];
        double p = ((const float *)pred.data)[i * CLASSES + label];
        sum += (double)w[first + i] * (cw ? cw[label] : 1.0) * -log(p);
    }
    mpt_tensor_free(ctx, &pred);
    return sum;
}

/* Keras' fit(x, y, sample_weight=w): (1) the first epoch's loss (one
   batch of every sample, at the initial weights) is Σ w·loss / rows (not
   / Σ w), with class_weight multiplying in; (2) evaluate, over uneven
   batches, and validation_split's part (its own weights) weigh the loss
   alike; (3) weights of 1 train bit for bit as none, weights of 2 as SGD
   at twice the rate; (4) 1 and 2 threads train the same bits; (5) bad
   weights are refused, naming them. */
static void test_sample_weight(void) {
    static float x[N_SYN * FEATURES], w[N_SYN], ones[N_SYN], twos[N_SYN];
    static int32_t y[N_SYN];
    const float cw[CLASSES] = {0.5f, 3.0f, 1.0f};
    mpt_dataset *d, *d1, *d2, *plain, *tail;
    mpt_logs logs;
    int64_t i;
    make_blobs(x, y, N_SYN, 5);
    sample_weights(w, N_SYN);
    for (i = 0; i < N_SYN; i++) ones[i] = 1, twos[i] = 2;
    d = weighted_blobs(x, y, w, N_SYN);
    d1 = weighted_blobs(x, y, ones, N_SYN);
    d2 = weighted_blobs(x, y, twos, N_SYN);
    plain = blob_dataset(x, y, N_SYN);
    {   /* (1) */
        mpt_model *m = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.01f),
                  *c = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.01f);
        double by_hand = weighted_xent(m, d, y, w, NULL, 0, N_SYN) / N_SYN;
        double with_classes = weighted_xent(c, d, y, w, cw, 0, N_SYN) / N_SYN;
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = N_SYN}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(fabs(history_value(m, "loss", 0) - by_hand) <= 1e-5 * by_hand,
              "weighted loss %.9g, by hand %.9g", history_value(m, "loss", 0), by_hand);
        CHECK(mpt_model_fit(c, d, &(mpt_fit_desc){.epochs = 1, .batch_size = N_SYN,
                                                  .class_weight = cw,
                                                  .class_weight_count = CLASSES}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(fabs(history_value(c, "loss", 0) - with_classes) <= 1e-5 * with_classes,
              "sample × class weights: loss %.9g, by hand %.9g", history_value(c, "loss", 0),
              with_classes);
        /* (2) evaluate in batches of 7; a split's tail keeps its weights */
        by_hand = weighted_xent(m, d, y, w, NULL, 0, N_SYN) / N_SYN;
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(fabs(mpt_logs_get(&logs, "loss") - by_hand) <= 1e-5 * by_hand,
              "evaluate's loss %.9g, by hand %.9g", mpt_logs_get(&logs, "loss"), by_hand);
        CHECK(mpt_dataset_split(ctx, d, 150, NULL, &tail) == MPT_OK, "split: %s",
              mpt_context_error(ctx));
        by_hand = weighted_xent(m, tail, y, w, NULL, 150, N_SYN - 150) / (N_SYN - 150);
        CHECK(mpt_model_evaluate(m, tail, &(mpt_evaluate_desc){.batch_size = 7}, &logs) ==
                      MPT_OK &&
                  fabs(mpt_logs_get(&logs, "loss") - by_hand) <= 1e-5 * by_hand,
              "a view's loss %.9g, by hand %.9g", mpt_logs_get(&logs, "loss"), by_hand);
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16, .no_shuffle = 1,
                                                  .validation_split = 0.25f}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        by_hand = weighted_xent(m, tail, y, w, NULL, 150, N_SYN - 150) / (N_SYN - 150);
        CHECK(fabs(history_value(m, "val_loss", 0) - by_hand) <= 1e-5 * by_hand,
              "validation_split's val_loss %.9g, by hand %.9g", history_value(m, "val_loss", 0),
              by_hand);
        mpt_dataset_destroy(tail);
        mpt_model_destroy(m);
        mpt_model_destroy(c);
    }
    {   /* (3) */
        mpt_model *a = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.02f),
                  *b = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.02f),
                  *c = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.01f);
        mpt_fit_desc fit = {.epochs = 2, .batch_size = 16};
        CHECK(mpt_model_fit(a, plain, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(b, d1, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(c, d2, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(test_same_state(a, b), "sample weights of 1 changed the training");
        CHECK(test_same_state(a, c), "sample weights of 2 differ from twice the learning rate");
        CHECK(history_value(c, "loss", 1) == 2 * history_value(a, "loss", 1),
              "loss %.17g, not twice %.17g", history_value(c, "loss", 1),
              history_value(a, "loss", 1));
        mpt_model_destroy(a);
        mpt_model_destroy(b);
        mpt_model_destroy(c);
    }
    {   /* (4) a mixed-precision model with dropout, shuffled, in 1 and 2 threads */
        mpt_context *saved = ctx, *one = path_ctx(1, 0), *two = path_ctx(2, 0);
        mpt_model *m[2];
        int t;
        for (t = 0; t < 2; t++) {
            mpt_dataset *dt;
            ctx = t ? two : one;
            dt = weighted_blobs(x, y, w, N_SYN);
            m[t] = blob_model(MPT_POLICY_MIXED_FLOAT16, 9);
            CHECK(mpt_model_fit(m[t], dt, &(mpt_fit_desc){.epochs = 2, .batch_size = 24}) ==
                      MPT_OK,
                  "fit: %s", mpt_context_error(ctx));
            mpt_dataset_destroy(dt);
        }
        ctx = saved;
        CHECK(test_same_state(m[0], m[1]), "1 and 2 threads trained differently with sample weights");
        CHECK(history_value(m[0], "loss", 1) == history_value(m[1], "loss", 1),
              "losses %.17g and %.17g", history_value(m[0], "loss", 1),
              history_value(m[1], "loss", 1));
        mpt_model_destroy(m[0]);
        mpt_model_destroy(m[1]);
        mpt_context_destroy(one);
        mpt_context_destroy(two);
    }
    {   /* (5) */
        float bad[N_SYN];
        mpt_tensor tx, ty, tw;
        mpt_dataset *v = NULL, *e = NULL;
        memcpy(bad, w, sizeof bad);
        bad[17] = -1;
        CHECK(mpt_dataset_set_sample_weight(ctx, plain, bad, N_SYN) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "sample_weight[17] = -1"),
              "negative weight: %s", mpt_context_error(ctx));
        bad[17] = NAN;
        CHECK(mpt_dataset_set_sample_weight(ctx, plain, bad, N_SYN) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "sample_weight[17] = nan"),
              "NaN weight: %s", mpt_context_error(ctx));
        bad[17] = INFINITY;
        CHECK(mpt_dataset_set_sample_weight(ctx, plain, bad, N_SYN) == MPT_ERR_INVALID_ARGUMENT,
              "an infinite weight was taken");
        CHECK(mpt_dataset_set_sample_weight(ctx, plain, w, N_SYN - 1) == MPT_ERR_SHAPE &&
                  strstr(mpt_context_error(ctx), "has 199 weights but the dataset has 200"),
              "short weights: %s", mpt_context_error(ctx));
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N_SYN}, y);
        mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, (int64_t[]){N_SYN - 1}, w);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty,
                                                           .sample_weight = &tw}, &e) ==
                      MPT_ERR_SHAPE && !e,
              "a dataset with short weights: %s", mpt_context_error(ctx));
        mpt_tensor_wrap(ctx, &tw, MPT_INT32, 1, (int64_t[]){N_SYN}, y);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty,
                                                           .sample_weight = &tw}, &e) ==
                      MPT_ERR_DTYPE && strstr(mpt_context_error(ctx), "must be float32"),
              "int32 weights: %s", mpt_context_error(ctx));
        CHECK(mpt_dataset_split(ctx, plain, 100, &v, NULL) == MPT_OK, "split: %s",
              mpt_context_error(ctx));
        CHECK(mpt_dataset_set_sample_weight(ctx, v, w, 100) == MPT_ERR_STATE &&
                  strstr(mpt_context_error(ctx), "of a view"),
              "weights on a view: %s", mpt_context_error(ctx));
        /* set on the root after the split: the view reads them; removed: none */
        CHECK(mpt_dataset_set_sample_weight(ctx, plain, twos, N_SYN) == MPT_OK, "set: %s",
              mpt_context_error(ctx));
        {
            mpt_model *a = weighted_model(MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0.01f);
            double unweighted, weighted;
            mpt_model_evaluate(a, v, NULL, &logs);
            weighted = mpt_logs_get(&logs, "loss");
            CHECK(mpt_dataset_set_sample_weight(ctx, plain, NULL, 0) == MPT_OK, "remove: %s",
                  mpt_context_error(ctx));
            mpt_model_evaluate(a, v, NULL, &logs);
            unweighted = mpt_logs_get(&logs, "loss");
            CHECK(weighted == 2 * unweighted, "a view's loss %.17g with weights 2, %.17g without",
                  weighted, unweighted);
            mpt_model_destroy(a);
        }
        mpt_dataset_destroy(v);
    }
    mpt_dataset_destroy(d);
    mpt_dataset_destroy(d1);
    mpt_dataset_destroy(d2);
    mpt_dataset_destroy(plain);
}

/* Keras' compile(weighted_metrics=...): each value Σ w·metric / Σ w,
   computed here in double from predict's outputs, over uneven batches,
   in float32 and mixed_float16: a regression's errors and a classifier's
   accuracy and precision and recall; a metric in both lists is logged
   plain and as "weighted_<name>", one in weighted_metrics alone under its
   own name; a dataset without weights gives the plain values. */
static void test_weighted_metrics(void) {
    static float x[N_REG * REG_IN], y[N_REG * REG_OUT], w[N_REG];
    mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    mpt_dataset *d;
    int64_t i, k;
    int pi;
    for (i = 0; i < N_REG; i++) { /* its own draws: the other tests' stay as they were */
        for (k = 0; k < REG_IN; k++) {
            uint32_t r[4];
            mpt_philox4x32(11, (uint64_t)i, (uint64_t)k, r);
            x[i * REG_IN + k] = (float)(r[0] / 2147483648.0 - 1);
        }
        y[i * REG_OUT] = 2 * x[i * REG_IN] - x[i * REG_IN + 1];
        y[i * REG_OUT + 1] = x[i * REG_IN + 2] * x[i * REG_IN + 3] + 0.5f;
    }
    sample_weights(w, N_REG);
    d = regression_dataset(x, y, N_REG);
    for (pi = 0; pi < 2; pi++) {
        mpt_model *m = NULL;
        mpt_logs logs, plain_logs;
        mpt_tensor pred;
        double sw = 0, abs_err = 0, sq = 0, pct = 0, plain_abs = 0;
        CHECK(mpt_dataset_set_sample_weight(ctx, d, NULL, 0) == MPT_OK, "unset: %s",
              mpt_context_error(ctx));
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {REG_IN}, .input_rank = 1,
                                                .policy = policies[pi], .seed = 4}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = REG_OUT});
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .optimizer = {.learning_rate = 0.01f},
                  .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
                  .metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR,
                  .weighted_metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_MEAN_SQUARED_ERROR |
                                      MPT_METRIC_ROOT_MEAN_SQUARED_ERROR |
                                      MPT_METRIC_MEAN_ABSOLUTE_PERCENTAGE_ERROR}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 16}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        /* no weights: each 1, the plain value */
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &plain_logs) ==
                  MPT_OK, "evaluate: %s", mpt_context_error(ctx));
        CHECK(fabs(mpt_logs_get(&plain_logs, "weighted_mean_absolute_error") -
                   mpt_logs_get(&plain_logs, "mean_absolute_error")) <=
                  1e-12 * mpt_logs_get(&plain_logs, "mean_absolute_error"),
              "unweighted: weighted mae %.17g, mae %.17g",
              mpt_logs_get(&plain_logs, "weighted_mean_absolute_error"),
              mpt_logs_get(&plain_logs, "mean_absolute_error"));
        CHECK(mpt_dataset_set_sample_weight(ctx, d, w, N_REG) == MPT_OK, "set: %s",
              mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16,
                                                  .validation_split = 0.25f}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(!isnan(history_value(m, "val_weighted_mean_absolute_error", 0)) &&
                  !isnan(history_value(m, "val_mean_squared_error", 0)) &&
                  !isnan(history_value(m, "weighted_mean_absolute_error", 0)),
              "the weighted metrics' history keys are missing");
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        for (i = 0; i < N_REG; i++) {
            double sa = 0, ss = 0, sp = 0;
            for (k = 0; k < REG_OUT; k++) {
                double t = y[i * REG_OUT + k], e = fabs(t - ((const float *)pred.data)[i * REG_OUT + k]);
                sa += e;
                ss += e * e;
                sp += 100 * e / (fabs(t) > 1e-7 ? fabs(t) : 1e-7);
            }
            sw += w[i];
            abs_err += w[i] * sa / REG_OUT;
            sq += w[i] * ss / REG_OUT;
            pct += w[i] * sp / REG_OUT;
            plain_abs += sa / REG_OUT;
        }
        mpt_tensor_free(ctx, &pred);
#define CLOSE(name, want)                                                                  \
    CHECK(fabs(mpt_logs_get(&logs, name) - (want)) <= 1e-12 * (want), "%s %s %.17g vs %.17g", \
          mpt_policy_name(policies[pi]), name, mpt_logs_get(&logs, name), (double)(want))
        CLOSE("mean_absolute_error", plain_abs / N_REG);
        CLOSE("weighted_mean_absolute_error", abs_err / sw);
        CLOSE("mean_squared_error", sq / sw);
        CLOSE("root_mean_squared_error", sqrt(sq / sw));
        CLOSE("mean_absolute_percentage_error", pct / sw);
#undef CLOSE
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(d);
    {   /* a classifier's weighted accuracy; a binary one's precision and recall */
        static float bx[N_SYN * FEATURES], bw[N_SYN], t[N_SYN];
        static int32_t by[N_SYN];
        mpt_dataset *c, *b;
        mpt_tensor pred, tx, ty, tw;
        mpt_model *m = NULL;
        mpt_logs logs;
        double right = 0, sw = 0, tp = 0, fp = 0, fn = 0;
        make_blobs(bx, by, N_SYN, 6);
        sample_weights(bw, N_SYN);
        c = weighted_blobs(bx, by, bw, N_SYN);
        m = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .optimizer = {.learning_rate = 0.01f},
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .metrics = MPT_METRIC_ACCURACY, .weighted_metrics = MPT_METRIC_ACCURACY}) ==
                  MPT_OK, "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, c, &(mpt_fit_desc){.epochs = 1, .batch_size = 32}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_evaluate(m, c, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, c, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        for (i = 0; i < N_SYN; i++) {
            const float *p = (const float *)pred.data + i * CLASSES;
            int best = 0;
            for (k = 1; k < CLASSES; k++) best = p[k] > p[best] ? (int)k : best;
            right += bw[i] * (best == by[i]);
            sw += bw[i];
        }
        mpt_tensor_free(ctx, &pred);
        CHECK(fabs(mpt_logs_get(&logs, "weighted_accuracy") - right / sw) <= 1e-12,
              "weighted accuracy %.17g vs %.17g", mpt_logs_get(&logs, "weighted_accuracy"),
              right / sw);
        mpt_model_destroy(m);
        mpt_dataset_destroy(c);
        for (i = 0; i < N_SYN; i++) t[i] = by[i] == 1 ? 1.0f : 0.0f;
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, bx);
        mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, t);
        mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, (int64_t[]){N_SYN}, bw);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty,
                                                           .sample_weight = &tw}, &b) == MPT_OK,
              "dataset: %s", mpt_context_error(ctx));
        m = NULL;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .seed = 6}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 1, .activation = MPT_ACT_SIGMOID});
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .optimizer = {.learning_rate = 0.05f},
                  .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
                  .weighted_metrics = MPT_METRIC_PRECISION | MPT_METRIC_RECALL}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, b, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_evaluate(m, b, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, b, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        for (i = 0; i < N_SYN; i++) {
            int predicted = ((const float *)pred.data)[i] > 0.5f, labelled = t[i] != 0;
            tp += bw[i] * (predicted && labelled);
            fp += bw[i] * (predicted && !labelled);
            fn += bw[i] * (!predicted && labelled);
        }
        mpt_tensor_free(ctx, &pred);
        CHECK(tp > 0, "a degenerate classifier");
        CHECK(fabs(mpt_logs_get(&logs, "precision") - tp / (tp + fp)) <= 1e-12 &&
                  fabs(mpt_logs_get(&logs, "recall") - tp / (tp + fn)) <= 1e-12,
              "weighted precision %.17g vs %.17g, recall %.17g vs %.17g",
              mpt_logs_get(&logs, "precision"), tp / (tp + fp), mpt_logs_get(&logs, "recall"),
              tp / (tp + fn));
        mpt_model_destroy(m);
        mpt_dataset_destroy(b);
    }
    {
        mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 3);
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .weighted_metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR}) ==
                      MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "weighted_metrics mean_absolute_error"),
              "weighted error metrics with a crossentropy: %s", mpt_context_error(ctx));
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .weighted_metrics = 1 << 20}) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "weighted_metrics 0x100000 has unknown bits"),
              "unknown weighted metric: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
    }
}

/* ---- r2_score and auc ------------------------------------------------------------- */

/* Keras' R2Score (uniform_average) computed directly in double: per
   column the weighted mean first, then Σ w·(y − mean)² (the textbook
   two-pass form, not the library's sums), the columns' scores averaged;
   w NULL: each 1. */
static double r2_direct(const float *pred, const float *y, const float *w, int64_t n, int64_t K) {
    double score = 0;
    int64_t i, c;
    for (c = 0; c < K; c++) {
        double sw = 0, swy = 0, res = 0, tot = 0, mean;
        for (i = 0; i < n; i++) {
            double wi = w ? w[i] : 1.0;
            sw += wi;
            swy += wi * y[i * K + c];
        }
        mean = swy / sw;
        for (i = 0; i < n; i++) {
            double wi = w ? w[i] : 1.0, d = (double)y[i * K + c] - pred[i * K + c];
            double e = (double)y[i * K + c] - mean;
            res += wi * d * d;
            tot += wi * e * e;
        }
        score += 1 - res / tot;
    }
    return score / (double)K;
}

static int close_to(double got, double want, double rel) {
    return fabs(got - want) <= rel * fabs(want) || (got == 0 && want == 0);
}

/* The regression of test_regression_metrics (Dense(8, relu) -> Dense(2))
   with r2_score in both lists, in context c, fitted two epochs of
   uneven batches (16, the last 10) with validation. */
static mpt_model *r2_model(mpt_context *c, mpt_policy policy, mpt_dataset *d) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {REG_IN}, .input_rank = 1,
                                          .policy = policy, .seed = 4}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = REG_OUT});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
              .metrics = MPT_METRIC_R2_SCORE | MPT_METRIC_MEAN_SQUARED_ERROR,
              .weighted_metrics = MPT_METRIC_R2_SCORE}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 16,
                                              .validation_split = 0.25f}) == MPT_OK,
          "fit: %s", mpt_context_error(c));
    return m;
}

/* Two models' histories of `key` hold the same bits. */
static int same_history(const mpt_model *a, const mpt_model *b, const char *key) {
    int e;
    for (e = 0; e < 2; e++) {
        double x = history_value(a, key, e), y = history_value(b, key, e);
        if (memcmp(&x, &y, sizeof x) || isnan(x)) return 0;
    }
    return 1;
}

/* Keras' R2Score: evaluate's r2_score and weighted_r2_score (and fit's,
   with their val_ twins) against a direct double computation from
   predict's outputs over uneven batches (7), float32 and mixed_float16,
   1e-9 relative; the same bits on one thread as on two; a constant
   column scores 0 (SS_tot 0, as Keras); refused with a crossentropy,
   naming the metric and the loss. */
static void test_r2_score(void) {
    static float x[N_REG * REG_IN], y[N_REG * REG_OUT], w[N_REG];
    mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    mpt_dataset *d;
    int64_t i, k;
    int pi;
    for (i = 0; i < N_REG; i++) {
        for (k = 0; k < REG_IN; k++) {
            uint32_t r[4];
            mpt_philox4x32(12, (uint64_t)i, (uint64_t)k, r);
            x[i * REG_IN + k] = (float)(r[0] / 2147483648.0 - 1);
        }
        y[i * REG_OUT] = 2 * x[i * REG_IN] - x[i * REG_IN + 1] + 0.3f;
        y[i * REG_OUT + 1] = x[i * REG_IN + 2] * x[i * REG_IN + 3] + 0.5f;
    }
    sample_weights(w, N_REG);
    d = regression_dataset(x, y, N_REG);
    CHECK(mpt_dataset_set_sample_weight(ctx, d, w, N_REG) == MPT_OK, "set: %s",
          mpt_context_error(ctx));
    for (pi = 0; pi < 2; pi++) {
        mpt_model *m = r2_model(ctx, policies[pi], d), *one;
        mpt_context *single = quiet_ctx(), *saved = ctx;
        mpt_dataset *d1;
        mpt_logs logs;
        mpt_tensor pred;
        double plain, weighted;
        CHECK(!isnan(history_value(m, "r2_score", 1)) && !isnan(history_value(m, "val_r2_score", 1)) &&
                  !isnan(history_value(m, "weighted_r2_score", 1)) &&
                  !isnan(history_value(m, "val_weighted_r2_score", 1)),
              "r2_score's history keys are missing");
        CHECK(history_value(m, "r2_score", 1) > history_value(m, "r2_score", 0),
              "r2_score did not rise: %g -> %g", history_value(m, "r2_score", 0),
              history_value(m, "r2_score", 1));
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        plain = r2_direct((const float *)pred.data, y, NULL, N_REG, REG_OUT);
        weighted = r2_direct((const float *)pred.data, y, w, N_REG, REG_OUT);
        CHECK(close_to(mpt_logs_get(&logs, "r2_score"), plain, 1e-9), "%s r2_score %.17g vs %.17g",
              mpt_policy_name(policies[pi]), mpt_logs_get(&logs, "r2_score"), plain);
        CHECK(close_to(mpt_logs_get(&logs, "weighted_r2_score"), weighted, 1e-9),
              "%s weighted_r2_score %.17g vs %.17g", mpt_policy_name(policies[pi]),
              mpt_logs_get(&logs, "weighted_r2_score"), weighted);
        CHECK(plain < 1 && fabs(plain - weighted) > 1e-6,
              "a degenerate regression: r2 %g, weighted %g", plain, weighted);
        mpt_tensor_free(ctx, &pred);
        /* one thread: the same bits */
        ctx = single;
        d1 = regression_dataset(x, y, N_REG);
        ctx = saved;
        CHECK(mpt_dataset_set_sample_weight(single, d1, w, N_REG) == MPT_OK, "set: %s",
              mpt_context_error(single));
        one = r2_model(single, policies[pi], d1);
        CHECK(same_history(m, one, "r2_score") && same_history(m, one, "val_r2_score") &&
                  same_history(m, one, "weighted_r2_score"),
              "%s: r2_score on one thread %.17g, on two %.17g", mpt_policy_name(policies[pi]),
              history_value(one, "r2_score", 1), history_value(m, "r2_score", 1));
        mpt_model_destroy(one);
        mpt_dataset_destroy(d1);
        mpt_context_destroy(single);
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(d);
    {   /* a constant target column: SS_tot = 0, its score 0 (Keras'
           isinf rule), the other column's as computed */
        static float cy[N_REG * REG_OUT];
        mpt_model *m = NULL;
        mpt_logs logs;
        mpt_tensor pred;
        double want;
        for (i = 0; i < N_REG; i++) {
            cy[i * REG_OUT] = y[i * REG_OUT];
            cy[i * REG_OUT + 1] = 0.25f;
        }
        d = regression_dataset(x, cy, N_REG);
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {REG_IN}, .input_rank = 1,
                                                .seed = 4}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = REG_OUT});
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
                  .metrics = MPT_METRIC_R2_SCORE}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &logs) == MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, d, 32, &pred) == MPT_OK, "predict: %s", mpt_context_error(ctx));
        {   /* column 0 alone, then (r2_0 + 0) / 2 */
            static float p0[N_REG], y0[N_REG];
            for (i = 0; i < N_REG; i++) {
                p0[i] = ((const float *)pred.data)[i * REG_OUT];
                y0[i] = cy[i * REG_OUT];
            }
            want = r2_direct(p0, y0, NULL, N_REG, 1) / 2;
        }
        CHECK(close_to(mpt_logs_get(&logs, "r2_score"), want, 1e-9),
              "a constant column: r2_score %.17g, want %.17g", mpt_logs_get(&logs, "r2_score"), want);
        mpt_tensor_free(ctx, &pred);
        mpt_model_destroy(m);
        mpt_dataset_destroy(d);
    }
    {
        mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 3);
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
                  .metrics = MPT_METRIC_R2_SCORE}) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "metrics r2_score") &&
                  strstr(mpt_context_error(ctx), "not binary_crossentropy"),
              "r2_score with a crossentropy: %s", mpt_context_error(ctx));
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .weighted_metrics = MPT_METRIC_R2_SCORE}) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "weighted_metrics r2_score") &&
                  strstr(mpt_context_error(ctx), "sparse_categorical_crossentropy"),
              "weighted r2_score with a crossentropy: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
    }
}

/* A model of one Activation layer: its outputs are its inputs' sigmoids
   (or the inputs themselves, read as logits), so that auc's known
   answers can be set in the data. */
static double auc_of(const float *in, const float *labels, int64_t n, int logits) {
    mpt_model *m = NULL;
    mpt_dataset *d = NULL;
    mpt_tensor tx, ty;
    mpt_logs logs;
    double auc;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){n, 1}, (void *)(uintptr_t)in);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){n, 1}, (void *)(uintptr_t)labels);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {1}, .input_rank = 1}, &m);
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = logits ? MPT_ACT_NONE
                                                                            : MPT_ACT_SIGMOID});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY, .from_logits = logits},
              .metrics = MPT_METRIC_AUC}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 3}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    auc = mpt_logs_get(&logs, "auc");
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    return auc;
}

/* Keras' AUC: known answers (positives all above the negatives 1,
   reversed 0, every score tied 0.5, one pair tied among separated ones
   in between), from probabilities and from logits; a sigmoid classifier's
   auc and weighted auc (fit's, with val_, and evaluate's) against a
   direct double computation of each threshold's counts and Keras'
   trapezoids from predict's outputs, over uneven batches, float32 and
   mixed_float16, 1e-9 relative; one thread's bits as two's; refused with
   a softmax, naming it. */
static void test_auc(void) {
    static float bx[N_SYN * FEATURES], bw[N_SYN], t[N_SYN];
    static int32_t by[N_SYN];
    const float labels[8] = {0, 1, 0, 1, 1, 0, 0, 1};
    float in[8];
    mpt_policy policies[2] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16};
    mpt_tensor tx, ty, tw;
    int64_t i;
    int pi, logits;
    for (logits = 0; logits < 2; logits++) {
        double a;
        for (i = 0; i < 8; i++) in[i] = labels[i] != 0 ? 2.0f + (float)i : -2.0f - (float)i;
        a = auc_of(in, labels, 8, logits);
        CHECK(a == 1, "separated (logits %d): auc %.17g, want 1", logits, a);
        for (i = 0; i < 8; i++) in[i] = -in[i];
        a = auc_of(in, labels, 8, logits);
        CHECK(a == 0, "reversed (logits %d): auc %.17g, want 0", logits, a);
        for (i = 0; i < 8; i++) in[i] = 0.25f;
        a = auc_of(in, labels, 8, logits);
        CHECK(a == 0.5, "tied (logits %d): auc %.17g, want 0.5", logits, a);
        /* one positive tied with one negative: 15 of the 16 pairs ranked
           right, the tie half: (15 + 0.5) / 16 */
        for (i = 0; i < 8; i++) in[i] = labels[i] != 0 ? 2.0f + (float)i : -2.0f - (float)i;
        in[0] = in[1];
        a = auc_of(in, labels, 8, logits);
        CHECK(fabs(a - 15.5 / 16) < 1e-15, "a tie (logits %d): auc %.17g, want %.17g", logits, a,
              15.5 / 16);
    }
    make_blobs(bx, by, N_SYN, 9);
    sample_weights(bw, N_SYN);
    for (i = 0; i < N_SYN; i++) t[i] = by[i] == 1 ? 1.0f : 0.0f;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, bx);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, t);
    mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, (int64_t[]){N_SYN}, bw);
    for (pi = 0; pi < 2; pi++) {
        mpt_context *cs[2];
        mpt_model *ms[2];
        mpt_dataset *ds[2];
        mpt_logs logs;
        mpt_tensor pred;
        double plain, weighted;
        int c;
        cs[0] = ctx;
        cs[1] = quiet_ctx(); /* one thread */
        for (c = 0; c < 2; c++) {
            ds[c] = NULL;
            ms[c] = NULL;
            CHECK(mpt_dataset_create(cs[c], &(mpt_dataset_desc){.x = &tx, .y = &ty,
                                                                 .sample_weight = &tw},
                                     &ds[c]) == MPT_OK,
                  "dataset: %s", mpt_context_error(cs[c]));
            mpt_model_create(cs[c], &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                      .policy = policies[pi], .seed = 6}, &ms[c]);
            mpt_model_add_dense(ms[c], &(mpt_dense_desc){.units = 1,
                                                         .activation = MPT_ACT_SIGMOID});
            CHECK(mpt_model_compile(ms[c], &(mpt_compile_desc){
                      .optimizer = {.learning_rate = 0.02f},
                      .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
                      .metrics = MPT_METRIC_AUC | MPT_METRIC_PRECISION,
                      .weighted_metrics = MPT_METRIC_AUC}) == MPT_OK,
                  "compile: %s", mpt_context_error(cs[c]));
            CHECK(mpt_model_fit(ms[c], ds[c], &(mpt_fit_desc){.epochs = 2, .batch_size = 32,
                                                              .validation_split = 0.25f}) ==
                      MPT_OK,
                  "fit: %s", mpt_context_error(cs[c]));
        }
        CHECK(same_history(ms[0], ms[1], "auc") && same_history(ms[0], ms[1], "val_auc") &&
                  same_history(ms[0], ms[1], "weighted_auc") &&
                  same_history(ms[0], ms[1], "val_weighted_auc"),
              "%s: auc on one thread %.17g, on two %.17g", mpt_policy_name(policies[pi]),
              history_value(ms[1], "auc", 1), history_value(ms[0], "auc", 1));
        CHECK(mpt_model_evaluate(ms[0], ds[0], &(mpt_evaluate_desc){.batch_size = 7}, &logs) ==
                  MPT_OK, "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(ms[0], ds[0], 32, &pred) == MPT_OK, "predict: %s",
              mpt_context_error(ctx));
        plain = auc_direct((const float *)pred.data, t, NULL, N_SYN, 1, 0);
        weighted = auc_direct((const float *)pred.data, t, bw, N_SYN, 1, 0);
        CHECK(plain > 0.6 && plain < 1 && fabs(plain - weighted) > 1e-6,
              "a degenerate classifier: auc %g, weighted %g", plain, weighted);
        CHECK(close_to(mpt_logs_get(&logs, "auc"), plain, 1e-9), "%s auc %.17g vs %.17g",
              mpt_policy_name(policies[pi]), mpt_logs_get(&logs, "auc"), plain);
        CHECK(close_to(mpt_logs_get(&logs, "weighted_auc"), weighted, 1e-9),
              "%s weighted_auc %.17g vs %.17g", mpt_policy_name(policies[pi]),
              mpt_logs_get(&logs, "weighted_auc"), weighted);
        mpt_tensor_free(ctx, &pred);
        for (c = 0; c < 2; c++) {
            mpt_model_destroy(ms[c]);
            mpt_dataset_destroy(ds[c]);
        }
        mpt_context_destroy(cs[1]);
    }
    {
        mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 3);
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                  .metrics = MPT_METRIC_AUC}) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "metrics auc ranks binary outputs") &&
                  strstr(mpt_context_error(ctx), "not sparse_categorical_crossentropy"),
              "auc with a softmax: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
    }
}

/* ---- weighted losses and metrics against Keras' own values --------------------

   The values TensorFlow's Keras gives on a small fixed case, computed once
   by tests/data/keras_weighted/make.py (whose docstring defines the case:
   inputs, weights, targets, sample and class weights) and pasted here.
   mpt.h's models hold the same float32 weights and predict the same values
   (to 1e-6); its loss and metrics must then be Keras': evaluate with and
   without sample weights (the metrics compiled as weighted_metrics), and
   fit's first epoch with class_weight (one batch: the logged values are
   the weights' before the update). Tolerance: 2e-6 relative (Keras
   computes in float32; its printed value is float32's), or 1e-6 absolute
   for values near 0. Keras 3 refuses class_weight with sample_weight
   together, so their product (which mpt.h allows) has no reference. */
/* tests/data/keras_weighted/make.py, TensorFlow 2.21.0, Keras 3.15.1 */
#define KERAS_CLS_EVALUATE_LOSS 1.99257493019104
#define KERAS_CLS_EVALUATE_ACCURACY 0.27272728085517883
#define KERAS_CLS_EVALUATE_TOP2 0.86363637447357178
#define KERAS_CLS_EVALUATE_UNWEIGHTED_LOSS 1.3345303535461426
#define KERAS_CLS_EVALUATE_UNWEIGHTED_ACCURACY 0.375
#define KERAS_CLS_EVALUATE_UNWEIGHTED_TOP2 0.875
#define KERAS_CLS_FIT_CLASS_WEIGHT_LOSS 1.655632495880127
#define KERAS_CLS_FIT_CLASS_WEIGHT_ACCURACY 0.44999998807907104
#define KERAS_CLS_FIT_CLASS_WEIGHT_TOP2 0.89999997615814209
#define KERAS_BIN_EVALUATE_LOSS 0.99807220697402954
#define KERAS_BIN_EVALUATE_ACCURACY 0.54545456171035767
#define KERAS_BIN_EVALUATE_AUC 0.55555558204650879
#define KERAS_BIN_EVALUATE_PRECISION 0.63636362552642822
#define KERAS_BIN_EVALUATE_RECALL 0.53846156597137451
#define KERAS_BIN_EVALUATE_UNWEIGHTED_LOSS 0.67762076854705811
#define KERAS_BIN_EVALUATE_UNWEIGHTED_ACCURACY 0.625
#define KERAS_BIN_EVALUATE_UNWEIGHTED_AUC 0.5625
#define KERAS_BIN_EVALUATE_UNWEIGHTED_PRECISION 0.60000002384185791
#define KERAS_BIN_EVALUATE_UNWEIGHTED_RECALL 0.75
#define KERAS_BIN_FIT_CLASS_WEIGHT_LOSS 0.70772182941436768
#define KERAS_BIN_FIT_CLASS_WEIGHT_ACCURACY 0.5625
#define KERAS_BIN_FIT_CLASS_WEIGHT_AUC 0.5625
#define KERAS_BIN_FIT_CLASS_WEIGHT_PRECISION 0.3333333432674408
#define KERAS_BIN_FIT_CLASS_WEIGHT_RECALL 0.75
#define KERAS_REG_EVALUATE_LOSS 2.1309814453125
#define KERAS_REG_EVALUATE_MAE 1.015625
#define KERAS_REG_EVALUATE_MSE 1.5498046875
#define KERAS_REG_EVALUATE_RMSE 1.2449115514755249
#define KERAS_REG_EVALUATE_MAPE 184.78895568847656
#define KERAS_REG_EVALUATE_R2 -0.84212189912796021
#define KERAS_REG_EVALUATE_UNWEIGHTED_LOSS 1.5615234375
#define KERAS_REG_EVALUATE_UNWEIGHTED_MAE 0.9765625
#define KERAS_REG_EVALUATE_UNWEIGHTED_MSE 1.5615234375
#define KERAS_REG_EVALUATE_UNWEIGHTED_RMSE 1.2496093511581421
#define KERAS_REG_EVALUATE_UNWEIGHTED_MAPE 164.28570556640625
#define KERAS_REG_EVALUATE_UNWEIGHTED_R2 -0.60033261775970459
static const float keras_cls_pred[] = {
    0.33409825f, 0.428990632f, 0.236911118f, 0.364113659f, 0.138201952f, 0.49768436f,
    0.463315189f, 0.175854623f, 0.360830247f, 0.135824457f, 0.174402058f, 0.6897735f,
    0.161312491f, 0.700709581f, 0.137977898f, 0.254275203f, 0.326495856f, 0.419228971f,
    0.310227722f, 0.398340285f, 0.291431993f, 0.0871874318f, 0.378724873f, 0.534087718f
};
static const float keras_bin_pred[] = {
    0.53120935f, 0.692641973f, 0.665410519f, 0.437823504f, 0.407333434f, 0.577495337f,
    0.546738207f, 0.320821285f
};
static const float keras_reg_pred[] = {
    1.3125f, 0.3125f, -0.6875f, -0.375f, 0.5625f, -0.25f,
    -0.625f, 1.5f, 1.4375f, 0.8125f, -0.5625f, 0.125f,
    0.6875f, 0.25f, -0.5f, 2.0f
};

enum { KW_N = 8, KW_IN = 3 };

static float kw_x[KW_N * KW_IN];

/* Dense(units, act) on KW_IN features with the weights of make.py's
   formulas (kind 0 the classifier, 1 the binary one, 2 the regression). */
static mpt_model *keras_weighted_model(int kind, const mpt_compile_desc *cd) {
    static const int64_t units[3] = {3, 1, 2};
    static const mpt_activation act[3] = {MPT_ACT_SOFTMAX, MPT_ACT_SIGMOID, MPT_ACT_NONE};
    mpt_model *m = NULL;
    mpt_param_info kernel, bias;
    int64_t j, c;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {KW_IN}, .input_rank = 1, .seed = 1},
                     &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = units[kind], .activation = act[kind]});
    CHECK(mpt_model_compile(m, cd) == MPT_OK && mpt_model_build(m, KW_N) == MPT_OK &&
              mpt_model_param(m, 0, &kernel) == MPT_OK && mpt_model_param(m, 1, &bias) == MPT_OK,
          "model %d: %s", kind, mpt_context_error(ctx));
    for (j = 0; j < KW_IN; j++)
        for (c = 0; c < units[kind]; c++)
            ((float *)kernel.value.data)[j * units[kind] + c] =
                kind == 0   ? (float)((7 * j + 3 * c) % 9 - 4) / 8
                : kind == 1 ? (float)((3 * j + 1) % 5 - 2) / 4
                            : (float)((2 * j + 5 * c) % 7 - 3) / 4;
    for (c = 0; c < units[kind]; c++)
        ((float *)bias.value.data)[c] = kind == 0   ? (float)(c - 1) / 4
                                        : kind == 1 ? 0.125f
                                                    : (float)c / 2;
    mpt_model_refresh_weights(m);
    return m;
}

static void kw_close(const char *what, const char *name, double got, double want) {
    CHECK(fabs(got - want) <= fmax(2e-6 * fabs(want), 1e-6), "%s: %s %.9g, Keras %.9g", what,
          name, got, want);
}

static void test_weighted_against_keras(void) {
    static const float sample_weight[KW_N] = {1, 2, 0.5f, 3, 1, 0, 2, 1.5f};
    static const float class_weight[3] = {1, 2, 0.5f}, class_weight_binary[2] = {1.5f, 0.5f};
    static const float labels_binary[KW_N] = {1, 0, 1, 1, 0, 0, 1, 0};
    static const float *const keras_pred[3] = {keras_cls_pred, keras_bin_pred, keras_reg_pred};
    static int32_t y_cls[KW_N];
    static float y_reg[KW_N * 2];
    int64_t i, j;
    int kind;
    for (i = 0; i < KW_N; i++) {
        for (j = 0; j < KW_IN; j++) kw_x[i * KW_IN + j] = (float)((7 * i + 3 * j + 2 * i * j) % 13 - 6) / 4;
        y_cls[i] = (int32_t)((5 * i + 1) % 3);
        for (j = 0; j < 2; j++) y_reg[i * 2 + j] = (float)((3 * i + 2 * j) % 7 - 3) / 2 + 0.25f;
    }
    for (kind = 0; kind < 3; kind++) {
        static const int64_t units[3] = {3, 1, 2};
        const int metrics[3] = {
            MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K,
            MPT_METRIC_ACCURACY | MPT_METRIC_AUC | MPT_METRIC_PRECISION | MPT_METRIC_RECALL,
            MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_MEAN_SQUARED_ERROR |
                MPT_METRIC_ROOT_MEAN_SQUARED_ERROR | MPT_METRIC_MEAN_ABSOLUTE_PERCENTAGE_ERROR |
                MPT_METRIC_R2_SCORE};
        const mpt_loss_type loss[3] = {MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY,
                                       MPT_LOSS_BINARY_CROSSENTROPY, MPT_LOSS_MEAN_SQUARED_ERROR};
        mpt_compile_desc cd = {.loss = {.type = loss[kind]}, .top_k = 2,
                               .weighted_metrics = metrics[kind]};
        mpt_model *m = keras_weighted_model(kind, &cd), *f = keras_weighted_model(kind, &cd);
        mpt_dataset *d = NULL, *dw = NULL;
        mpt_tensor tx, ty, pred;
        mpt_logs weighted, plain;
        double worst = 0;
        int s;
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){KW_N, KW_IN}, kw_x);
        if (kind == 0) mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){KW_N}, y_cls);
        else if (kind == 1)
            mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 1, (int64_t[]){KW_N}, (void *)labels_binary);
        else mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){KW_N, 2}, y_reg);
        memset(&pred, 0, sizeof pred);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK &&
                  mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &dw) ==
                      MPT_OK &&
                  mpt_dataset_set_sample_weight(ctx, dw, sample_weight, KW_N) == MPT_OK &&
                  mpt_model_predict(m, d, KW_N, &pred) == MPT_OK &&
                  mpt_model_evaluate(m, dw, &(mpt_evaluate_desc){.batch_size = KW_N}, &weighted) ==
                      MPT_OK &&
                  mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = KW_N}, &plain) ==
                      MPT_OK,
              "kind %d: %s", kind, mpt_context_error(ctx));
        for (i = 0; pred.data && i < KW_N * units[kind]; i++)
            worst = fmax(worst, fabs(((const float *)pred.data)[i] - keras_pred[kind][i]));
        CHECK(pred.data && worst <= 1e-6, "kind %d: predictions %.3g from Keras'", kind, worst);
        mpt_tensor_free(ctx, &pred);
#define KW(LOGS, NAME, VALUE) kw_close(#VALUE, NAME, mpt_logs_get(&LOGS, NAME), VALUE)
        if (kind == 0) {
            KW(weighted, "loss", KERAS_CLS_EVALUATE_LOSS);
            KW(weighted, "accuracy", KERAS_CLS_EVALUATE_ACCURACY);
            KW(weighted, "sparse_top_k_categorical_accuracy", KERAS_CLS_EVALUATE_TOP2);
            KW(plain, "loss", KERAS_CLS_EVALUATE_UNWEIGHTED_LOSS);
            KW(plain, "accuracy", KERAS_CLS_EVALUATE_UNWEIGHTED_ACCURACY);
            KW(plain, "sparse_top_k_categorical_accuracy", KERAS_CLS_EVALUATE_UNWEIGHTED_TOP2);
        } else if (kind == 1) {
            KW(weighted, "loss", KERAS_BIN_EVALUATE_LOSS);
            KW(weighted, "accuracy", KERAS_BIN_EVALUATE_ACCURACY);
            KW(weighted, "auc", KERAS_BIN_EVALUATE_AUC);
            KW(weighted, "precision", KERAS_BIN_EVALUATE_PRECISION);
            KW(weighted, "recall", KERAS_BIN_EVALUATE_RECALL);
            KW(plain, "loss", KERAS_BIN_EVALUATE_UNWEIGHTED_LOSS);
            KW(plain, "accuracy", KERAS_BIN_EVALUATE_UNWEIGHTED_ACCURACY);
            KW(plain, "auc", KERAS_BIN_EVALUATE_UNWEIGHTED_AUC);
            KW(plain, "precision", KERAS_BIN_EVALUATE_UNWEIGHTED_PRECISION);
            KW(plain, "recall", KERAS_BIN_EVALUATE_UNWEIGHTED_RECALL);
        } else {
            KW(weighted, "loss", KERAS_REG_EVALUATE_LOSS);
            KW(weighted, "mean_absolute_error", KERAS_REG_EVALUATE_MAE);
            KW(weighted, "mean_squared_error", KERAS_REG_EVALUATE_MSE);
            KW(weighted, "root_mean_squared_error", KERAS_REG_EVALUATE_RMSE);
            KW(weighted, "mean_absolute_percentage_error", KERAS_REG_EVALUATE_MAPE);
            KW(weighted, "r2_score", KERAS_REG_EVALUATE_R2);
            KW(plain, "loss", KERAS_REG_EVALUATE_UNWEIGHTED_LOSS);
            KW(plain, "mean_absolute_error", KERAS_REG_EVALUATE_UNWEIGHTED_MAE);
            KW(plain, "mean_squared_error", KERAS_REG_EVALUATE_UNWEIGHTED_MSE);
            KW(plain, "root_mean_squared_error", KERAS_REG_EVALUATE_UNWEIGHTED_RMSE);
            KW(plain, "mean_absolute_percentage_error", KERAS_REG_EVALUATE_UNWEIGHTED_MAPE);
            KW(plain, "r2_score", KERAS_REG_EVALUATE_UNWEIGHTED_R2);
        }
#undef KW
        if (kind < 2) { /* fit(class_weight=...): the first (only) batch's values */
            s = mpt_model_fit(f, d, &(mpt_fit_desc){
                                        .epochs = 1, .batch_size = KW_N, .no_shuffle = 1,
                                        .class_weight = kind ? class_weight_binary : class_weight,
                                        .class_weight_count = kind ? 2 : 3});
            CHECK(s == MPT_OK, "kind %d: fit: %s", kind, mpt_context_error(ctx));
#define KW(NAME, VALUE) kw_close(#VALUE, NAME, history_value(f, NAME, 0), VALUE)
            if (kind == 0) {
                KW("loss", KERAS_CLS_FIT_CLASS_WEIGHT_LOSS);
                KW("accuracy", KERAS_CLS_FIT_CLASS_WEIGHT_ACCURACY);
                KW("sparse_top_k_categorical_accuracy", KERAS_CLS_FIT_CLASS_WEIGHT_TOP2);
            } else {
                KW("loss", KERAS_BIN_FIT_CLASS_WEIGHT_LOSS);
                KW("accuracy", KERAS_BIN_FIT_CLASS_WEIGHT_ACCURACY);
                KW("auc", KERAS_BIN_FIT_CLASS_WEIGHT_AUC);
                KW("precision", KERAS_BIN_FIT_CLASS_WEIGHT_PRECISION);
                KW("recall", KERAS_BIN_FIT_CLASS_WEIGHT_RECALL);
            }
#undef KW
        }
        mpt_dataset_destroy(d);
        mpt_dataset_destroy(dw);
        mpt_model_destroy(m);
        mpt_model_destroy(f);
    }
}

/* With one-hot targets Keras names the top-k metric
   top_k_categorical_accuracy; it counts as the sparse one does. */
static void test_top_k_of_one_hot_targets(void) {
    static float x[N_SYN * FEATURES], onehot[N_SYN * CLASSES];
    static int32_t y[N_SYN];
    mpt_logs sparse_logs, logs;
    mpt_dataset *ds, *dh;
    mpt_tensor tx, ty;
    mpt_model *m;
    int64_t i;
    make_blobs(x, y, N_SYN, 2);
    for (i = 0; i < N_SYN; i++) onehot[i * CLASSES + y[i]] = 1;
    ds = blob_dataset(x, y, N_SYN);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, CLASSES}, onehot);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &dh) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    m = blob_model(MPT_POLICY_FLOAT32, 5);
    CHECK(mpt_model_evaluate(m, ds, NULL, &sparse_logs) == MPT_OK, "evaluate: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .loss = {.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_TOP_K, .top_k = 2}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, dh, NULL, &logs) == MPT_OK, "evaluate: %s", mpt_context_error(ctx));
    CHECK(isnan(mpt_logs_get(&logs, "sparse_top_k_categorical_accuracy")), "sparse name kept");
    CHECK(mpt_logs_get(&logs, "top_k_categorical_accuracy") ==
              mpt_logs_get(&sparse_logs, "sparse_top_k_categorical_accuracy"),
          "one-hot %g vs sparse %g", mpt_logs_get(&logs, "top_k_categorical_accuracy"),
          mpt_logs_get(&sparse_logs, "sparse_top_k_categorical_accuracy"));
    mpt_model_destroy(m);
    mpt_dataset_destroy(ds);
    mpt_dataset_destroy(dh);
}

/* ---- the same seed gives the same run; resuming is bit-identical ---------------------- */

static void test_reproducible_and_resumable(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    char path_buf[600];
    const char *path = 
        test_file_in(path_buf, sizeof path_buf, tmpdir, "test_train_resume.safetensors");
    mpt_dataset *d;
    mpt_model *a, *b, *c;
    make_blobs(x, y, N_SYN, 2);
    d = blob_dataset(x, y, N_SYN);
    a = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
    b = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
    c = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
    /* a: 3 epochs straight. b: 2 epochs, saved; c: loads, runs epoch 3. */
    CHECK(mpt_model_fit(a, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK, "fit a");
    CHECK(mpt_model_fit(b, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK, "fit b");
    CHECK(mpt_model_save_checkpoint(b, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(c, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(mpt_model_epoch(c) == 2, "restored epoch %d", mpt_model_epoch(c));
    CHECK(mpt_model_fit(c, d, &(mpt_fit_desc){.epochs = 3, .initial_epoch = 2,
                                              .batch_size = 32}) == MPT_OK, "fit c");
    CHECK(test_same_state(a, c), "resumed training differs from the straight run");
    CHECK(!test_same_state(a, b), "two epochs equal three");
    /* the same seed again from scratch: the same run */
    mpt_model_destroy(b);
    b = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
    CHECK(mpt_model_fit(b, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK, "fit");
    CHECK(test_same_state(a, b), "the same seed gave another run");
    remove(path);
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    mpt_model_destroy(c);
    mpt_dataset_destroy(d);
}

/* ---- loss scaling through real steps -------------------------------------------------- */

/* A copy of everything a step may change. */
typedef struct snapshot {
    float *values[16], *slots[16][2];
    int64_t optimizer_steps;
} snapshot;

static void take(const mpt_model *m, snapshot *s) {
    int i, k;
    for (i = 0; i < m->n_params && i < 16; i++) {
        size_t bytes = sizeof(float) * (size_t)m->params[i].count;
        s->values[i] = (float *)malloc(bytes);
        memcpy(s->values[i], m->params[i].value, bytes);
        for (k = 0; k < 2; k++) {
            s->slots[i][k] = NULL;
            if (k < m->n_slots && m->params[i].slot[k]) {
                s->slots[i][k] = (float *)malloc(bytes);
                memcpy(s->slots[i][k], m->params[i].slot[k], bytes);
            }
        }
    }
    s->optimizer_steps = m->optimizer_steps;
}

/* 1 when m still holds what s took; frees s. */
static int unchanged(const mpt_model *m, snapshot *s) {
    int i, k, same = s->optimizer_steps == m->optimizer_steps;
    for (i = 0; i < m->n_params && i < 16; i++) {
        size_t bytes = sizeof(float) * (size_t)m->params[i].count;
        same &= !memcmp(s->values[i], m->params[i].value, bytes);
        free(s->values[i]);
        for (k = 0; k < 2; k++) {
            if (s->slots[i][k]) same &= !memcmp(s->slots[i][k], m->params[i].slot[k], bytes);
            free(s->slots[i][k]);
        }
    }
    return same;
}

/* One training step as fit runs it, the model's host copy of the training
   scalars pushed before and pulled after. */
static mpt_status train_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y) {
    mpt__step_times times = {0, 0, 0};
    mpt_step_state st;
    mpt_tensor none; /* no sample weights */
    mpt_status s = mpt__state_push(m);
    memset(&none, 0, sizeof none);
    if (s == MPT_OK) s = mpt__train_step(m, x, y, &none, &times);
    if (s == MPT_OK) s = mpt__state_pull(m, &st);
    return s;
}

static void test_overflow_skips_the_step(void) {
    static float x[32 * FEATURES];
    static int32_t y[32];
    mpt_model *m = blob_model(MPT_POLICY_MIXED_FLOAT16, 9);
    mpt_tensor tx, ty;
    snapshot snap;
    float scale;
    make_blobs(x, y, 32, 4);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){32, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){32}, y);
    CHECK(m->loss_scale == 32768.0f, "mixed_float16 starts at %g", m->loss_scale);
    m->emit_logits = mpt__can_fuse_softmax(m);
    /* A normal step first, so that the optimizer has state to protect. */
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step");
    CHECK(m->optimizer_steps == 1 && m->skipped_steps == 0, "first step not applied");
    /* A scale so large that the float16 gradients overflow: the step must
       be skipped, the scale halved, and no weight, moment or statistic
       (BatchNormalization's moving ones are parameters too) touched. */
    m->loss_scale = 1e38f;
    scale = m->loss_scale;
    take(m, &snap);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "overflowing step");
    CHECK(m->skipped_steps == 1, "skipped_steps %lld", (long long)m->skipped_steps);
    CHECK(m->loss_scale == scale * 0.5f, "scale %g after overflow from %g", m->loss_scale, scale);
    CHECK(unchanged(m, &snap), "a skipped step changed the model's state");
    /* growth after growth_interval finite steps in a row */
    m->loss_scale = 1024;
    m->compile.loss_scale.growth_interval = 3;
    m->good_steps = 0;
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step");
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step");
    CHECK(m->loss_scale == 1024, "grew early: %g", m->loss_scale);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step");
    CHECK(m->loss_scale == 2048, "no growth after 3 finite steps: %g", m->loss_scale);
    m->emit_logits = 0;
    mpt_model_destroy(m);
}

/* bfloat16 needs no loss scale by default; float16 gets Keras' 2^15. */
static void test_default_loss_scale(void) {
    mpt_model *m = blob_model(MPT_POLICY_MIXED_BFLOAT16, 1);
    CHECK(mpt_model_loss_scale(m) == 1, "bfloat16 scale %g", mpt_model_loss_scale(m));
    mpt_model_destroy(m);
    m = blob_model(MPT_POLICY_MIXED_FLOAT16, 1);
    CHECK(mpt_model_loss_scale(m) == 32768, "float16 scale %g", mpt_model_loss_scale(m));
    mpt_model_destroy(m);
}

/* ---- output: summary and progress ---------------------------------------------------- */

static char printed[1 << 16];
static test_text printed_to = {printed, sizeof printed, 0};

static void test_summary_and_progress(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    char text[4096];
    mpt_dataset *d;
    mpt_model *m = blob_model(MPT_POLICY_MIXED_FLOAT16, 1);
    size_t n = mpt_model_summary(m, text, sizeof text);
    CHECK(n > 0 && n < sizeof text, "summary length %zu", n);
    CHECK(strstr(text, "dense (Dense)") && strstr(text, "(None, 16)") &&
              strstr(text, "float16") && strstr(text, "Total params: 227") &&
              strstr(text, "Non-trainable params: 32") && strstr(text, "optimizer state"),
          "summary:\n%s", text);
    /* the softmax layer computes in float32 under mixed_float16 */
    CHECK(mpt_model_layer_dtype(m, 3) == MPT_FLOAT32 && mpt_model_layer_dtype(m, 0) == MPT_FLOAT16,
          "dtypes %s %s", mpt_dtype_name(mpt_model_layer_dtype(m, 0)),
          mpt_dtype_name(mpt_model_layer_dtype(m, 3)));
    CHECK(mpt_model_summary(m, text, 10) == n, "needed size differs when truncated");
    make_blobs(x, y, N_SYN, 3);
    d = blob_dataset(x, y, N_SYN);
    test_text_clear(&printed_to);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32, .verbose = 1,
                                              .printer = {test_text_append, &printed_to}}) ==
              MPT_OK,
          "fit");
    CHECK(strstr(printed, "Epoch 1/2\n") && strstr(printed, "Epoch 2/2\n"), "epochs:\n%s", printed);
    CHECK(strstr(printed, "7/7 [==============================] - ") &&
              strstr(printed, "/step - loss: ") && strstr(printed, " - accuracy: "),
          "progress:\n%s", printed);
    test_text_clear(&printed_to);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 32, .verbose = 2,
                                              .printer = {test_text_append, &printed_to}}) ==
              MPT_OK,
          "fit");
    CHECK(strstr(printed, "7/7 - ") && !strchr(printed, '['), "verbose 2:\n%s", printed);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* Keras 2's live line: the count right-aligned to the total's digits (the
   bar stays in place), a line shorter than the one it overwrites padded
   with spaces to that width (nothing of the longer one left on the
   screen; what is remembered is the line's own width, past which the
   screen now holds spaces), and the final line the same, ending the row. */
static void test_progress_line_overwrites_cleanly(void) {
    mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 1);
    mpt_logs logs;
    int shown = 0;
    size_t first;
    memset(&logs, 0, sizeof logs);
    mpt__logs_set(&logs, "loss", 0.5);
    mpt__logs_set(&logs, "accuracy", 0.75);
    m->printer.fn = test_text_append;
    m->printer.user_data = &printed_to;
    test_text_clear(&printed_to);
    mpt__progress(m, 1, 7, 469, 1.0, &logs, 0, &shown);
    first = strlen(printed);
    CHECK(strncmp(printed, "\r  7/469 [.", 11) == 0 && strstr(printed, " - accuracy: 0.7500") &&
              shown == (int)first - 1,
          "first line (shown %d): '%s'", shown, printed);
    memset(&logs, 0, sizeof logs);
    mpt__logs_set(&logs, "loss", 0.25);
    test_text_clear(&printed_to);
    mpt__progress(m, 1, 400, 469, 50.0, &logs, 0, &shown);
    CHECK(strncmp(printed, "\r400/469 [", 10) == 0 && strlen(printed) == first &&
              printed[first - 1] == ' ' && strstr(printed, "loss: 0.2500   ") &&
              shown == (int)(strstr(printed, "0.2500") + 6 - printed) - 1,
          "shorter line (shown %d, %zu bytes against %zu): '%s'", shown, strlen(printed), first,
          printed);
    test_text_clear(&printed_to);
    mpt__progress(m, 1, 469, 469, 60.0, &logs, 1, &shown);
    CHECK(strncmp(printed, "\r469/469 [==============================] - ", 44) == 0 &&
              printed[strlen(printed) - 1] == '\n' && shown == 0,
          "final line (shown %d): '%s'", shown, printed);
    m->printer.fn = NULL;
    mpt_model_destroy(m);
}

/* ---- a user callback sees every batch and can stop training ---------------------------- */

typedef struct counter {
    int batches, epochs, stop_at_epoch;
} counter;

static mpt_status count_batch(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                              int *stop) {
    counter *c = (counter *)user;
    (void)m;
    (void)batch;
    (void)stop;
    c->batches += !isnan(mpt_logs_get(logs, "loss"));
    return MPT_OK;
}

static mpt_status count_epoch(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                              int *stop) {
    counter *c = (counter *)user;
    (void)m;
    (void)logs;
    c->epochs++;
    if (epoch == c->stop_at_epoch) *stop = 1;
    return MPT_OK;
}

static void test_user_callback(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    counter c = {0, 0, 1};
    mpt_callback cb;
    mpt_dataset *d;
    mpt_model *m = blob_model(MPT_POLICY_FLOAT32, 1);
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = count_batch;
    cb.on_epoch_end = count_epoch;
    cb.user_data = &c;
    make_blobs(x, y, N_SYN, 3);
    d = blob_dataset(x, y, N_SYN);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 5, .batch_size = 32, .callbacks = &cb,
                                              .n_callbacks = 1}) == MPT_OK, "fit");
    CHECK(c.epochs == 2 && c.batches == 14, "epochs %d batches %d (stop after epoch 2, 7 batches "
          "each: the last partial batch of 8 is kept)", c.epochs, c.batches);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- a training step allocates nothing -------------------------------------------------- */

typedef struct alloc_watch {
    const counting_alloc *counts;
    long at_first_batch;
    int batches, grew;
} alloc_watch;

static mpt_status watch_batch(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                              int *stop) {
    alloc_watch *w = (alloc_watch *)user;
    (void)m;
    (void)logs;
    (void)stop;
    if (batch == 0) w->at_first_batch = w->counts->allocs;
    else w->grew |= w->counts->allocs != w->at_first_batch;
    w->batches++;
    return MPT_OK;
}

/* Between the first and the last batch of an epoch — forward, loss,
   backward, optimizer, loss scaling, loader — nothing is allocated. */
static void test_steps_allocate_nothing(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    counting_alloc counts = {0, 0, -1};
    mpt_context *saved = ctx;
    alloc_watch w = {&counts, 0, 0, 0};
    mpt_callback cb;
    mpt_dataset *d;
    mpt_model *m;
    ctx = counting_ctx(&counts);
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = watch_batch;
    cb.user_data = &w;
    make_blobs(x, y, N_SYN, 7);
    d = blob_dataset(x, y, N_SYN);
    m = blob_model(MPT_POLICY_MIXED_FLOAT16, 2);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32, .callbacks = &cb,
                                              .n_callbacks = 1}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(w.batches == 14 && !w.grew, "%d batches; allocations during an epoch: %s", w.batches,
          w.grew ? "yes" : "none");
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
    CHECK(counts.allocs == counts.frees, "%ld allocations, %ld frees", counts.allocs, counts.frees);
    ctx = saved;
}

/* ---- bad input ------------------------------------------------------------------------ */

static void test_bad_input(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    mpt_context *saved = ctx;
    mpt_dataset *d, *wrong = NULL;
    mpt_model *m, *plain = NULL;
    mpt_logs logs;
    mpt_tensor tx, ty, out;
    static float wide[10 * 7];
    static int32_t few[10];
    ctx = quiet_ctx();
    make_blobs(x, y, N_SYN, 3);
    y[17] = 3; /* a label the model's 3 classes do not have */
    d = blob_dataset(x, y, N_SYN);
    m = blob_model(MPT_POLICY_FLOAT32, 1);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32}) == MPT_ERR_INVALID_ARGUMENT,
          "label 3 for 3 classes accepted");
    CHECK(strstr(mpt_context_error(ctx), "0..3") && strstr(mpt_context_error(ctx), "3 classes"),
          "message: %s", mpt_context_error(ctx));
    y[17] = 2;
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = -1}) == MPT_ERR_INVALID_ARGUMENT,
          "batch size -1 accepted");
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 64}) == MPT_OK && m->max_batch == 64,
          "batch 64 for a model built for 32: not planned again (%s)", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32, .validation_split = 1.5f}) ==
              MPT_ERR_INVALID_ARGUMENT, "validation_split 1.5 accepted");
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32, .verbose = 3}) ==
              MPT_ERR_INVALID_ARGUMENT, "verbose 3 accepted");
    {
        mpt_dataset *good = blob_dataset(x, y, N_SYN); /* every label in range */
        CHECK(mpt_model_fit(m, good, &(mpt_fit_desc){.batch_size = 32, .on_out_of_memory = 7}) ==
                      MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(ctx), "on_out_of_memory 7"),
              "on_out_of_memory 7 accepted (%s)", mpt_context_error(ctx));
        mpt_dataset_destroy(good);
    }
    CHECK(mpt_model_fit(m, NULL, &(mpt_fit_desc){.batch_size = 32}) == MPT_ERR_INVALID_ARGUMENT,
          "NULL data accepted");
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = -1}, &logs) ==
              MPT_ERR_INVALID_ARGUMENT, "batch -1 accepted");
    CHECK(mpt_model_predict(m, d, -1, &out) == MPT_ERR_INVALID_ARGUMENT, "predict batch -1");
    /* samples of the wrong shape */
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){10, 7}, wide);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){10}, few);
    mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &wrong);
    CHECK(mpt_model_fit(m, wrong, &(mpt_fit_desc){.batch_size = 5}) == MPT_ERR_SHAPE,
          "7 features for 6 accepted");
    CHECK(strstr(mpt_context_error(ctx), "(7,)") && strstr(mpt_context_error(ctx), "(6,)"),
          "message: %s", mpt_context_error(ctx));
    /* fit before compile */
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1}, &plain);
    mpt_model_add_dense(plain, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_fit(plain, d, &(mpt_fit_desc){.batch_size = 8}) == MPT_ERR_STATE,
          "fit without compile accepted");
    mpt_model_destroy(plain);
    mpt_dataset_destroy(wrong);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
    ctx = saved;
}

/* ---- every entry point checks the samples' shape ------------------------------------- */

/* Samples narrower (a read past the batch) or wider (misaligned samples)
   than the model's input (784,) are refused by forward, fit (training and
   validation data), evaluate and predict, the message naming both shapes. */
static void test_sample_shape_checked_everywhere(void) {
    static const int64_t widths[2] = {100, 1000};
    static float x[8 * 1000], right[8 * 784];
    static int32_t y[8];
    mpt_context *saved = ctx;
    mpt_model *m = NULL;
    mpt_dataset *good = NULL;
    mpt_tensor tx, ty, out;
    mpt_logs logs;
    char want[32];
    int w, i;
    ctx = quiet_ctx();
    for (i = 0; i < 8 * 1000; i++) x[i] = (float)(i % 97) / 97.0f - 0.3f;
    for (i = 0; i < 8 * 784; i++) right[i] = (float)(i % 89) / 89.0f - 0.4f;
    for (i = 0; i < 8; i++) y[i] = (i * 7) % 10;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {784}, .input_rank = 1, .seed = 5},
                     &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){8, 784}, right);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){8}, y);
    mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &good);
    for (w = 0; w < 2; w++) {
        mpt_dataset *bad = NULL;
        snprintf(want, sizeof want, "(%lld,)", (long long)widths[w]);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){8, widths[w]}, x);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &bad) == MPT_OK,
              "dataset: %s", mpt_context_error(ctx));
        CHECK(mpt_model_predict(m, bad, 4, &out) == MPT_ERR_SHAPE, "predict on %s accepted",
              want);
        CHECK(out.data == NULL, "predict left an output behind");
        CHECK(strstr(mpt_context_error(ctx), want) && strstr(mpt_context_error(ctx), "(784,)"),
              "predict message: %s", mpt_context_error(ctx));
        CHECK(mpt_model_evaluate(m, bad, &(mpt_evaluate_desc){.batch_size = 4}, &logs) ==
                  MPT_ERR_SHAPE, "evaluate on %s accepted", want);
        CHECK(mpt_model_fit(m, bad, &(mpt_fit_desc){.batch_size = 4}) == MPT_ERR_SHAPE,
              "fit on %s accepted", want);
        CHECK(mpt_model_fit(m, good, &(mpt_fit_desc){.batch_size = 4, .validation_data = bad}) ==
                  MPT_ERR_SHAPE, "fit with validation data %s accepted", want);
        CHECK(strstr(mpt_context_error(ctx), "validation") && strstr(mpt_context_error(ctx), want),
              "validation message: %s", mpt_context_error(ctx));
        CHECK(mpt_model_forward(m, &tx, 0, &out) == MPT_ERR_SHAPE, "forward on %s accepted", want);
        CHECK(strstr(mpt_context_error(ctx), want) && strstr(mpt_context_error(ctx), "(784,)"),
              "forward message: %s", mpt_context_error(ctx));
        mpt_dataset_destroy(bad);
    }
    CHECK(mpt_model_predict(m, good, 4, &out) == MPT_OK, "predict on (784,): %s",
          mpt_context_error(ctx));
    mpt_tensor_free(ctx, &out);
    mpt_dataset_destroy(good);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    ctx = saved;
}

/* ---- batch_size 0 means 32 ------------------------------------------------------------- */

static mpt_status count_steps(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                              int *stop) {
    (void)m;
    (void)batch;
    (void)logs;
    (void)stop;
    ++*(int *)user;
    return MPT_OK;
}

/* Keras' steps_per_epoch: all the batches an epoch has trains exactly as
   leaving it out; 3 batches of 20 an epoch take 3 steps an epoch, the
   first 60 samples of each epoch's shuffle (a sum the test computes from
   the same shuffle: the epoch's loss is theirs); more than the data has,
   or a negative count, is refused. */
static void test_steps_per_epoch(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    mpt_model *a, *b;
    mpt_dataset *d;
    mpt_fit_desc f = fit_for(3, 20);
    mpt_callback cb;
    int steps = 0;
    make_blobs(x, y, N_SYN, 31);
    d = blob_dataset(x, y, N_SYN);
    a = blob_model(MPT_POLICY_FLOAT32, 5);
    b = blob_model(MPT_POLICY_FLOAT32, 5);
    CHECK(mpt_model_fit(a, d, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    f.steps_per_epoch = N_SYN / 20;
    CHECK(mpt_model_fit(b, d, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(test_same_state(a, b), "every batch by steps_per_epoch trains otherwise than by default");
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    a = blob_model(MPT_POLICY_FLOAT32, 5);
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = count_steps;
    cb.user_data = &steps;
    f = fit_for(2, 20);
    f.steps_per_epoch = 3;
    f.callbacks = &cb;
    f.n_callbacks = 1;
    CHECK(mpt_model_fit(a, d, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(steps == 6 && a->optimizer_steps == 6, "%d batches, %lld updates: 2 epochs of 3 wanted",
          steps, (long long)a->optimizer_steps);
    {
        mpt_history h;
        int k, found = 0;
        mpt_model_history(a, &h);
        for (k = 0; k < h.n_keys; k++)
            if (strcmp(h.keys[k], "samples_per_second") == 0) found = 1;
        CHECK(h.epochs == 2 && found, "history of %d epochs", h.epochs);
    }
    f.steps_per_epoch = N_SYN / 20 + 1;
    f.n_callbacks = 0;
    test_expect_error(ctx, mpt_model_fit(a, d, &f), MPT_ERR_INVALID_ARGUMENT,
                      "steps_per_epoch 11 of batches of 20 needs more than the 200 training "
                      "samples", "fit");
    f.steps_per_epoch = -1;
    test_expect_error(ctx, mpt_model_fit(a, d, &f), MPT_ERR_INVALID_ARGUMENT,
                      "steps_per_epoch -1 is negative", "fit");
    CHECK(a->optimizer_steps == 6, "a refused fit trained");
    mpt_model_destroy(a);
    mpt_dataset_destroy(d);
}

/* As in Keras: 200 samples are 7 batches (the model, built for 64, would
   take 4), and evaluate and predict give exactly what batches of 32 give. */
static void test_batch_size_zero_means_32(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    mpt_callback cb;
    mpt_dataset *d;
    mpt_model *m = blob_model_for(MPT_POLICY_FLOAT32, 4, 64), *fresh;
    mpt_logs with0, with32;
    mpt_tensor p0, p32;
    int steps = 0;
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = count_steps;
    cb.user_data = &steps;
    make_blobs(x, y, N_SYN, 11);
    d = blob_dataset(x, y, N_SYN);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .callbacks = &cb, .n_callbacks = 1}) ==
              MPT_OK,
          "fit with batch_size 0: %s", mpt_context_error(ctx));
    CHECK(steps == 7, "%d batches for 200 samples (batches of 32: 7)", steps);
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){0}, &with0) == MPT_OK,
          "evaluate with batch_size 0: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 32}, &with32) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&with0, "loss") == mpt_logs_get(&with32, "loss"), "loss %.17g vs %.17g",
          mpt_logs_get(&with0, "loss"), mpt_logs_get(&with32, "loss"));
    CHECK(mpt_model_predict(m, d, 0, &p0) == MPT_OK, "predict with batch_size 0: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_predict(m, d, 32, &p32) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    CHECK(p0.data && p32.data && !memcmp(p0.data, p32.data, mpt_tensor_bytes(&p32)),
          "predict with batch_size 0 differs from 32");
    mpt_tensor_free(ctx, &p0);
    mpt_tensor_free(ctx, &p32);
    /* an unbuilt model is built for the default batch */
    fresh = blob_model_for(MPT_POLICY_FLOAT32, 4, 0);
    CHECK(mpt_model_fit(fresh, d, &(mpt_fit_desc){0}) == MPT_OK, "fit: %s",
          mpt_context_error(ctx));
    CHECK(fresh->max_batch == 32, "built for %lld", (long long)fresh->max_batch);
    mpt_model_destroy(fresh);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- validation_split as Keras cuts it ---------------------------------------------- */

/* Keras: split_at = int(n · (1 − validation_split)) in double on the split
   as written; 0.1 of 60,000 leaves 6,000 for validation. fit, with a
   batch per sample, trains on exactly split_at samples. */
static void test_validation_split_as_keras(void) {
    static const double splits[] = {0.1, 0.2, 0.25, 0.3, 0.15, 0.05, 0.33, 0.5, 0.7, 0.9, 0.01};
    static const int64_t sizes[] = {10, 100, 1000, 6000, 60000, 50000, 12345, 7, 999, 70000};
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    size_t i, j;
    mpt_callback cb;
    mpt_dataset *d, *ten;
    mpt_model *m;
    int steps = 0;
    for (i = 0; i < sizeof splits / sizeof *splits; i++)
        for (j = 0; j < sizeof sizes / sizeof *sizes; j++) {
            int64_t keras = (int64_t)((double)sizes[j] * (1. - splits[i]));
            int64_t ours = mpt__validation_split_at(sizes[j], (float)splits[i]);
            CHECK(ours == keras, "validation_split %g of %lld: training on %lld, Keras %lld",
                  splits[i], (long long)sizes[j], (long long)ours, (long long)keras);
        }
    CHECK(60000 - mpt__validation_split_at(60000, 0.1f) == 6000, "0.1 of 60,000: %lld",
          (long long)(60000 - mpt__validation_split_at(60000, 0.1f)));
    make_blobs(x, y, N_SYN, 12);
    d = blob_dataset(x, y, N_SYN);
    mpt_dataset_split(ctx, d, 10, &ten, NULL);
    m = blob_model_for(MPT_POLICY_FLOAT32, 4, 1);
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = count_steps;
    cb.user_data = &steps;
    CHECK(mpt_model_fit(m, ten, &(mpt_fit_desc){.epochs = 1, .batch_size = 1,
                                                .validation_split = 0.1f, .callbacks = &cb,
                                                .n_callbacks = 1}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(steps == 9, "0.1 of 10 samples trained on %d (Keras: 9)", steps);
    mpt_model_destroy(m);
    mpt_dataset_destroy(ten);
    mpt_dataset_destroy(d);
}

/* ---- float targets (n,) for an output of one unit ---------------------------------- */

/* Trains Dense(8, relu) -> Dense(1, act) on y (float32 or int32) of shape
   ty_rank == 1 ? (n,) : (n, 1) for two epochs and returns the model. */
static mpt_model *fit_one_unit(const float *x, mpt_dtype y_dtype, const void *y, int ty_rank,
                               mpt_loss_type loss, mpt_activation act, mpt_policy policy) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, (void *)x);
    mpt_tensor_wrap(ctx, &ty, y_dtype, ty_rank, (int64_t[]){N_SYN, 1}, (void *)y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset with y of rank %d: %s", ty_rank, mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = policy, .seed = 9}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 1, .activation = act});
    mpt_model_compile(m, &(mpt_compile_desc){.optimizer = {.learning_rate = 0.01f},
                                             .loss = {.type = loss},
                                             .metrics = MPT_METRIC_ACCURACY});
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 16,
                                              .validation_split = 0.2f}) == MPT_OK,
          "fit with y of rank %d: %s", ty_rank, mpt_context_error(ctx));
    mpt_dataset_destroy(d);
    return m;
}

/* ---- a Conv2D that ends in softmax ---------------------------------------------------- */

enum { PIX_N = 5, PIX_H = 5, PIX_W = 4, PIX_C = 4, PIX_F = 16, PIX_OH = 1, PIX_OW = 1 };

/* Conv2D(8, 3x3 same, relu) -> Conv2D(16, 5x4 valid, last_act): one pixel
   of 16 classes (the loss takes a sample's whole output as one row),
   categorical crossentropy; one SGD step a fit (batch = PIX_N). 16 filters
   over 5·4·8 inputs: the backend's direct convolution where it has one. */
static mpt_model *pixel_model(mpt_policy policy, mpt_activation last_act, int from_logits) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {PIX_H, PIX_W, PIX_C},
                                            .input_rank = 3, .policy = policy, .seed = 5}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 8, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = PIX_F, .kernel_size = {PIX_H, PIX_W},
                                               .activation = last_act});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f},
              .loss = {.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY,
                       .from_logits = from_logits}}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, PIX_N) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* Its softmax is the layer's activation, as a final Dense's is: under mixed
   precision it computes in float32, and fit leaves the softmax to the
   crossentropy, so the layer must then hand over logits and take the
   loss's gradient of them. One step must equal the same network's without
   activation trained from_logits, and its loss the crossentropy of the
   probabilities the model predicted before it, summed here in double. */
static void test_conv2d_final_softmax(void) {
    enum { NX = PIX_N * PIX_H * PIX_W * PIX_C, NY = PIX_N * PIX_OH * PIX_OW * PIX_F };
    static float x[NX], t[NY];
    mpt_model *mixed = pixel_model(MPT_POLICY_MIXED_FLOAT16, MPT_ACT_SOFTMAX, 0);
    mpt_model *probs = pixel_model(MPT_POLICY_FLOAT32, MPT_ACT_SOFTMAX, 0);
    mpt_model *logits = pixel_model(MPT_POLICY_FLOAT32, MPT_ACT_NONE, 1);
    mpt_dataset *d = NULL;
    mpt_tensor tx, tt, py;
    double want = 0, worst = 0, moved = 0;
    int64_t i, j;
    int k;
    CHECK(mpt_model_layer_dtype(mixed, 1) == MPT_FLOAT32 &&
              mpt_model_layer_dtype(mixed, 0) == MPT_FLOAT16 &&
              mpt__layer_activation(&mixed->layers[1]) == MPT_ACT_SOFTMAX,
          "mixed_float16: the final Conv2D(softmax) computes in %s, the first in %s",
          mpt_dtype_name(mpt_model_layer_dtype(mixed, 1)),
          mpt_dtype_name(mpt_model_layer_dtype(mixed, 0)));
    for (i = 0; i < NX; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < NY / PIX_F; i++) t[i * PIX_F + test_randint(0, PIX_F - 1)] = 1;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){PIX_N, PIX_H, PIX_W, PIX_C}, x);
    mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 4, (int64_t[]){PIX_N, PIX_OH, PIX_OW, PIX_F}, t);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &tt}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    memset(&py, 0, sizeof py);
    if (mpt_model_forward(probs, &tx, 0, &py) != MPT_OK || py.dtype != MPT_FLOAT32 ||
        mpt_tensor_count(&py) != NY) {
        CHECK(0, "forward: %s", mpt_context_error(ctx));
        py.data = NULL;
    }
    for (i = 0; py.data && i < NY / PIX_F; i++)
        for (j = 0; j < PIX_F; j++)
            if (t[i * PIX_F + j] == 1)
                want -= log((double)((const float *)py.data)[i * PIX_F + j]) / (NY / PIX_F);
    for (k = 0; k < 2 && d; k++)
        CHECK(mpt_model_fit(k ? logits : probs, d, &(mpt_fit_desc){
                  .epochs = 1, .batch_size = PIX_N}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
    CHECK(fabs(history_value(probs, "loss", 0) - want) <= 1e-5 * want,
          "loss %.8g, the predictions' crossentropy %.8g", history_value(probs, "loss", 0), want);
    CHECK(fabs(history_value(logits, "loss", 0) - want) <= 1e-5 * want,
          "from_logits: loss %.8g, want %.8g", history_value(logits, "loss", 0), want);
    for (k = 0; k < mpt_model_param_count(probs); k++) {
        mpt_param_info a, b;
        mpt_model_param(probs, k, &a);
        mpt_model_param(logits, k, &b);
        for (i = 0; i < mpt_tensor_count(&a.value); i++) {
            const float *wa = (const float *)a.value.data, *wb = (const float *)b.value.data;
            const float *ga = (const float *)a.grad.data, *gb = (const float *)b.grad.data;
            worst = fmax(worst, fmax(fabs((double)wa[i] - wb[i]), fabs((double)ga[i] - gb[i])));
            moved = fmax(moved, fabs((double)gb[i]));
        }
    }
    CHECK(moved > 1e-3 && worst <= 1e-5,
          "the step's gradients or weights differ from from_logits' by %g (largest gradient %g)",
          worst, moved);
    mpt_dataset_destroy(d);
    mpt_model_destroy(mixed);
    mpt_model_destroy(probs);
    mpt_model_destroy(logits);
}

/* The three one-unit trainings the target tests compare: binary
   crossentropy with a sigmoid in float32 (k = 0) and mixed_float16 (1),
   mean squared error without activation in float32 (2). */
static void one_unit_case(int k, mpt_loss_type *loss, mpt_activation *act, mpt_policy *policy) {
    *loss = k < 2 ? MPT_LOSS_BINARY_CROSSENTROPY : MPT_LOSS_MEAN_SQUARED_ERROR;
    *act = k < 2 ? MPT_ACT_SIGMOID : MPT_ACT_NONE;
    *policy = k == 1 ? MPT_POLICY_MIXED_FLOAT16 : MPT_POLICY_FLOAT32;
}

/* As Keras: targets (n,) train a one-unit output under binary crossentropy
   and mean squared error exactly as targets (n, 1) do; (n,) targets for an
   output of 3 units are refused. */
static void test_targets_of_shape_n(void) {
    static float x[N_SYN * FEATURES], y[N_SYN];
    static int32_t ids[N_SYN];
    mpt_context *saved = ctx;
    int k, i;
    make_blobs(x, ids, N_SYN, 13);
    for (i = 0; i < N_SYN; i++) y[i] = ids[i] == 1 ? 0.9f : (float)(i % 5) * 0.05f;
    for (k = 0; k < 3; k++) {
        mpt_loss_type loss;
        mpt_activation act;
        mpt_policy policy;
        one_unit_case(k, &loss, &act, &policy);
        mpt_model *a = fit_one_unit(x, MPT_FLOAT32, y, 2, loss, act, policy);
        mpt_model *b = fit_one_unit(x, MPT_FLOAT32, y, 1, loss, act, policy);
        CHECK(test_same_state(a, b), "%s: (n,) targets train otherwise than (n, 1)",
              mpt__loss_name(loss));
        CHECK(history_value(a, "val_loss", 1) == history_value(b, "val_loss", 1) &&
                  history_value(a, "accuracy", 1) == history_value(b, "accuracy", 1),
              "val_loss %.17g vs %.17g", history_value(a, "val_loss", 1),
              history_value(b, "val_loss", 1));
        mpt_model_destroy(a);
        mpt_model_destroy(b);
    }
    {
        mpt_tensor tx, ty;
        mpt_dataset *d = NULL;
        mpt_model *m;
        ctx = quiet_ctx();
        m = blob_model_for(MPT_POLICY_FLOAT32, 1, 32);
        mpt_model_compile(m, &(mpt_compile_desc){.loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}});
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 1, (int64_t[]){N_SYN}, y);
        mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d);
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32}) == MPT_ERR_SHAPE,
              "(n,) targets for 3 output units accepted");
        CHECK(strstr(mpt_context_error(ctx), "(3,)") != NULL, "message: %s",
              mpt_context_error(ctx));
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
        ctx = saved;
    }
}

/* int32 0/1 labels (what mpt_dataset_create documents for labels and the
   IDX loader returns) for one output unit under binary crossentropy or
   mean squared error are targets converted to float, as Keras casts them:
   training and validation give what float32 labels give, bit for bit.
   Sparse crossentropy over one class takes only label 0 (Keras raises for
   1), and an integer past 2^24 (not exact in float32) is refused. */
static void test_int32_targets_of_one_unit(void) {
    static float x[N_SYN * FEATURES], yf[N_SYN];
    static int32_t ids[N_SYN], yi[N_SYN];
    mpt_context *saved = ctx;
    int k, i;
    make_blobs(x, ids, N_SYN, 14 + (uint64_t)test_randint(0, 1000));
    for (i = 0; i < N_SYN; i++) {
        yi[i] = ids[i] == 1;
        yf[i] = (float)yi[i];
    }
    for (k = 0; k < 3; k++) {
        mpt_loss_type loss;
        mpt_activation act;
        mpt_policy policy;
        one_unit_case(k, &loss, &act, &policy);
        mpt_model *a = fit_one_unit(x, MPT_FLOAT32, yf, 1, loss, act, policy);
        mpt_model *b = fit_one_unit(x, MPT_INT32, yi, 1, loss, act, policy);
        CHECK(test_same_state(a, b), "%s: int32 0/1 labels train otherwise than float32 ones",
              mpt__loss_name(loss));
        CHECK(history_value(a, "loss", 1) == history_value(b, "loss", 1) &&
                  history_value(a, "val_loss", 1) == history_value(b, "val_loss", 1) &&
                  history_value(a, "val_accuracy", 1) == history_value(b, "val_accuracy", 1),
              "%s: int32 labels: loss %.9g, val_loss %.9g, val_accuracy %g; float32: %.9g, "
              "%.9g, %g", mpt__loss_name(loss), history_value(b, "loss", 1),
              history_value(b, "val_loss", 1), history_value(b, "val_accuracy", 1),
              history_value(a, "loss", 1), history_value(a, "val_loss", 1),
              history_value(a, "val_accuracy", 1));
        mpt_model_destroy(a);
        mpt_model_destroy(b);
    }
    ctx = quiet_ctx();
    for (k = 0; k < 2; k++) {
        mpt_tensor tx, ty;
        mpt_dataset *d = NULL;
        mpt_model *m = NULL;
        int32_t keep = yi[7];
        mpt_status s;
        if (k == 1) yi[7] = (1 << 24) + 1 + test_randint(0, 100);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N_SYN}, yi);
        mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d);
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .seed = 3}, &m);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 1, .activation = k ? MPT_ACT_SIGMOID
                                                                            : MPT_ACT_SOFTMAX});
        mpt_model_compile(m, &(mpt_compile_desc){
                                 .loss = {.type = k ? MPT_LOSS_BINARY_CROSSENTROPY
                                                    : MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
        s = mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 16});
        CHECK(s == MPT_ERR_INVALID_ARGUMENT,
              k ? "an int32 target past 2^24 accepted (%s)"
                : "sparse crossentropy over one class took label 1 (%s)",
              mpt_status_string(s));
        CHECK(strstr(mpt_context_error(ctx), k ? "2^24" : "1 classes") != NULL, "message: %s",
              mpt_context_error(ctx));
        s = mpt_model_evaluate(m, d, NULL, &(mpt_logs){0});
        CHECK(s == MPT_ERR_INVALID_ARGUMENT, "evaluate: %s", mpt_status_string(s));
        yi[7] = keep;
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
    }
    mpt_context_destroy(ctx);
    ctx = saved;
}

/* ---- sizes near INT64_MAX ------------------------------------------------------------ */

/* max_batch INT64_MAX (mpt_model_build, and fit's batch_size on a model
   fit builds) overflowed the rounding to the replicas' share before any
   check; an input dimension of INT64_MAX was accepted and overflowed in
   the layers' plans, then reported "out of memory"; so did a Conv2D whose
   output is past what a sample may hold. Each is MPT_ERR_OVERFLOW with a
   message naming it, and the model is left as it was (it then builds). */
static void test_sizes_past_int64(void) {
    mpt_context *saved = ctx;
    mpt_model *m = NULL;
    mpt_status s;
    int64_t big = INT64_MAX - test_randint(0, 3);
    ctx = quiet_ctx();
    m = blob_model_for(MPT_POLICY_FLOAT32, 1, 0);
    s = mpt_model_build(m, big);
    CHECK(s == MPT_ERR_OVERFLOW && strstr(mpt_context_error(ctx), "overflow") && !m->built,
          "build(%lld): status %d (%s)", (long long)big, (int)s, mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build(8) after: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);

    m = NULL;
    s = mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2, big}, .input_rank = 2}, &m);
    CHECK(s == MPT_ERR_OVERFLOW && m == NULL && strstr(mpt_context_error(ctx), "2^56"),
          "input (2, %lld): status %d (%s)", (long long)big, (int)s, mpt_context_error(ctx));
    s = mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {big}, .input_rank = 1}, &m);
    CHECK(s == MPT_ERR_OVERFLOW && m == NULL && strstr(mpt_context_error(ctx), "2^56"),
          "input (%lld,): status %d (%s)", (long long)big, (int)s, mpt_context_error(ctx));

    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4, 4, 2}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = ((int64_t)1 << 57) + test_randint(0, 9),
                                               .kernel_size = {3, 3}});
    s = mpt_model_build(m, 2);
    CHECK(s == MPT_ERR_OVERFLOW && strstr(mpt_context_error(ctx), "conv2d") &&
              strstr(mpt_context_error(ctx), "too large"),
          "Conv2D of 2^57 filters: status %d (%s)", (int)s, mpt_context_error(ctx));
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    ctx = saved;
}

/* Keras: a batch_size past the training samples trains on all of them in
   one batch. fit(batch_size = 2^26) on 16 samples planned buffers for 2^26
   samples (15.8 GB for this model); it must build for 16 and train as
   batch_size 16 does, bit for bit; INT64_MAX too; and a model built for
   16 takes such a batch_size rather than refusing it. evaluate and predict
   on an unbuilt model build for the 16 samples as well, and a fit after an
   evaluate that built the model for fewer plans it again. */
static void test_batch_size_past_the_data(void) {
    static float x[16 * FEATURES];
    static int32_t y[16];
    const int64_t sizes[2] = {(int64_t)1 << 26, INT64_MAX};
    mpt_dataset *d;
    mpt_model *want = blob_model_for(MPT_POLICY_FLOAT32, 7, 0), *m;
    int k;
    make_blobs(x, y, 16, 20 + (uint64_t)test_randint(0, 1000));
    d = blob_dataset(x, y, 16);
    CHECK(mpt_model_fit(want, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 16}) == MPT_OK,
          "fit with batch_size 16: %s", mpt_context_error(ctx));
    for (k = 0; k < 3; k++) {
        int64_t batch = sizes[k % 2];
        m = blob_model_for(MPT_POLICY_FLOAT32, 7, k == 2 ? 16 : 0);
        m->desc.memory_limit = 64 << 20; /* a plan for 2^26 samples fails, not the machine */
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = batch}) == MPT_OK,
              "fit with batch_size %lld: %s", (long long)batch, mpt_context_error(ctx));
        CHECK(m->built && m->max_batch == 16, "batch_size %lld for 16 samples: built for %lld",
              (long long)batch, (long long)m->max_batch);
        CHECK(m->built && test_same_state(m, want), "batch_size %lld trains otherwise than 16",
              (long long)batch);
        mpt_model_destroy(m);
    }
    /* evaluate and predict on an unbuilt model build for the 16 samples
       too (they planned 2^26, and failed under the memory limit) */
    for (k = 0; k < 2; k++) {
        mpt_logs logs;
        mpt_tensor p;
        mpt_status s;
        m = blob_model_for(MPT_POLICY_FLOAT32, 7, 0);
        m->desc.memory_limit = 64 << 20;
        s = k == 0 ? mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = sizes[0]}, &logs)
                   : mpt_model_predict(m, d, sizes[1], &p);
        CHECK(s == MPT_OK, "%s with batch_size %lld: %s", k ? "predict" : "evaluate",
              (long long)sizes[k], mpt_context_error(ctx));
        CHECK(m->built && m->max_batch == 16, "%s built for %lld", k ? "predict" : "evaluate",
              (long long)m->max_batch);
        if (k == 1 && s == MPT_OK) mpt_tensor_free(ctx, &p);
        mpt_model_destroy(m);
    }
    { /* fit plans again a model evaluate built for fewer samples (Keras' fit
         takes any batch size) and trains as one built for 16 does, bit for bit */
        mpt_dataset *few = blob_dataset(x, y, 8);
        mpt_logs logs;
        m = blob_model_for(MPT_POLICY_FLOAT32, 7, 0);
        CHECK(mpt_model_evaluate(m, few, &(mpt_evaluate_desc){.batch_size = 32}, &logs) ==
                      MPT_OK &&
                  m->max_batch == 8,
              "evaluate on 8 samples: built for %lld (%s)", (long long)m->max_batch,
              mpt_context_error(ctx));
        CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 16}) == MPT_OK,
              "fit after evaluate: %s", mpt_context_error(ctx));
        CHECK(m->max_batch == 16 && test_same_state(m, want),
              "fit after evaluate: built for %lld, %s", (long long)m->max_batch,
              test_same_state(m, want) ? "the same state" : "another state");
        mpt_model_destroy(m);
        mpt_dataset_destroy(few);
    }
    mpt_model_destroy(want);
    mpt_dataset_destroy(d);
}

/* ---- a short real run on Fashion-MNIST ------------------------------------------------ */

/* An MLP (Flatten -> Dense(128, relu) -> Dense(10, softmax)) trained for
   one epoch on the 60,000 training images under mixed_float16 must reach
   82 % on the 10,000 test images (chance is 10 %; it reached 0.8316 when
   this test was written). */
static void test_fashion_mnist_short_run(void) {
    const char *dir = "/usr/share/datasets/fashion-mnist";
    mpt_dataset *all = NULL, *test = NULL;
    mpt_model *m = NULL;
    mpt_logs logs;
    double acc;
    if (mpt_dataset_load_mnist(ctx, dir, 0, &all) != MPT_OK) {
        SKIP("no Fashion-MNIST in /usr/share/datasets/fashion-mnist (dataset-fashion-mnist)");
        return;
    }
    CHECK(mpt_dataset_load_mnist(ctx, dir, 1, &test) == MPT_OK, "test set: %s",
          mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 1}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 128, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}, .metrics = MPT_METRIC_ACCURACY});
    CHECK(mpt_model_fit(m, all, &(mpt_fit_desc){.epochs = 1, .batch_size = 128}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, test, &(mpt_evaluate_desc){.batch_size = 500}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    acc = mpt_logs_get(&logs, "accuracy");
    printf("# fashion-mnist short run: test accuracy %.4f\n", acc);
    CHECK(acc >= 0.80, "test accuracy %.4f < 0.80", acc);
    mpt_model_destroy(m);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(all);
}

/* ---- gradient accumulation (Keras 3's gradient_accumulation_steps) ------------------------ */

enum { ACC_N = 4, ACC_SMALL = 8, ACC_LARGE = ACC_N * ACC_SMALL, ACC_UPDATES = 3 };

/* Dense(16, relu) -> Dense(3, softmax): no BatchNormalization or Dropout,
   whose batch statistics and masks depend on the batch's size. */
static mpt_model *plain_model(mpt_policy policy, mpt_optimizer_desc opt, int64_t max_batch) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = policy, .seed = 21}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = opt, .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}}) ==
              MPT_OK, "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, max_batch) == MPT_OK, "build: %s", mpt_context_error(ctx));
    m->emit_logits = mpt__can_fuse_softmax(m); /* as fit */
    return m;
}

/* Rows [first, first + rows) of x and y as tensors. */
static void rows_of(float *x, int32_t *y, int64_t first, int64_t rows, mpt_tensor *tx,
                    mpt_tensor *ty) {
    mpt_tensor_wrap(ctx, tx, MPT_FLOAT32, 2, (int64_t[]){rows, FEATURES}, x + first * FEATURES);
    mpt_tensor_wrap(ctx, ty, MPT_INT32, 1, (int64_t[]){rows}, y + first);
}

/* Every trainable weight of a and b: bit for bit (max_ulps 0), or within
   max_ulps units in the last place; the largest difference seen, in ulps. */
static int64_t weights_ulps(const mpt_model *a, const mpt_model *b) {
    int64_t worst = 0, e;
    int i;
    for (i = 0; i < a->n_params; i++)
        for (e = 0; e < a->params[i].count; e++) {
            int32_t u, v;
            int64_t d;
            memcpy(&u, &a->params[i].value[e], 4);
            memcpy(&v, &b->params[i].value[e], 4);
            if (u < 0) u = INT32_MIN - u; /* sign-magnitude to a monotone integer line */
            if (v < 0) v = INT32_MIN - v;
            d = (int64_t)u - (int64_t)v;
            if (d < 0) d = -d;
            if (d > worst) worst = d;
        }
    return worst;
}

/* N batches of 8 accumulated against one batch of 32, the same rows in the
   same order, after several updates. What can and cannot be exact: the
   per-sample gradients are the same bits (no layer mixes the rows, and the
   loss's 1/8 and 1/32 are powers of two, so every product and the final
   division by N = 4 are exact); what differs is where the sums over the
   rows are rounded: the large batch's GEMM adds 32 rows in one chain, the
   accumulation adds 4 sums of 8 (as Keras does, and as any framework
   accumulating separately computed gradients must). Those are different
   roundings of the same real number, a few ulps apart per update;
   everything else is the same arithmetic. So the comparison allows a
   small stated bound, and the exact rule is checked separately
   (test_accumulation_keras_rule, bit for bit). */
static void check_large_batch(const char *name, mpt_optimizer_desc opt) {
    static float x[ACC_LARGE * ACC_UPDATES * FEATURES];
    static int32_t y[ACC_LARGE * ACC_UPDATES];
    mpt_optimizer_desc acc = opt;
    mpt_model *small, *large;
    mpt_tensor tx, ty;
    int64_t ulps;
    int u, b;
    acc.gradient_accumulation_steps = ACC_N;
    make_blobs(x, y, ACC_LARGE * ACC_UPDATES, 17);
    small = plain_model(MPT_POLICY_FLOAT32, acc, ACC_SMALL);
    large = plain_model(MPT_POLICY_FLOAT32, opt, ACC_LARGE);
    CHECK(weights_ulps(small, large) == 0, "%s: the two models start apart", name);
    for (u = 0; u < ACC_UPDATES; u++) {
        rows_of(x, y, (int64_t)u * ACC_LARGE, ACC_LARGE, &tx, &ty);
        CHECK(train_step(large, &tx, &ty) == MPT_OK, "large step: %s", mpt_context_error(ctx));
        for (b = 0; b < ACC_N; b++) {
            rows_of(x, y, (int64_t)u * ACC_LARGE + b * ACC_SMALL, ACC_SMALL, &tx, &ty);
            CHECK(train_step(small, &tx, &ty) == MPT_OK, "step: %s", mpt_context_error(ctx));
        }
        CHECK(small->optimizer_steps == u + 1 && small->accumulated_steps == 0,
              "%s: %lld updates, %lld batches in the sum after %d cycles", name,
              (long long)small->optimizer_steps, (long long)small->accumulated_steps, u + 1);
    }
    ulps = weights_ulps(small, large);
    printf("# %s: accumulated 4 x 8 vs one batch of 32 after %d updates: %lld ulps apart at "
           "most\n", name, ACC_UPDATES, (long long)ulps);
    CHECK(ulps <= 16, "%s: %lld ulps from the large batch's weights", name, (long long)ulps);
    CHECK(test_weight_diff(small, large) < 1e-5, "%s: weights %g apart", name,
          test_weight_diff(small, large));
    mpt_model_destroy(small);
    mpt_model_destroy(large);
}

static void test_accumulation_equals_large_batch(void) {
    check_large_batch("sgd",
                      (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.5f});
    check_large_batch("adam", (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAM});
}

/* The float32 sums of every trainable parameter of m, copied. */
static float *accum_copy(const mpt_model *m) {
    int64_t total = 0, at = 0;
    float *c;
    int i;
    for (i = 0; i < m->n_params; i++) total += m->params[i].trainable ? m->params[i].count : 0;
    c = (float *)malloc(sizeof(float) * (size_t)(total + 1));
    for (i = 0; i < m->n_params; i++) {
        if (!m->params[i].trainable) continue;
        memcpy(c + at, m->params[i].accum, sizeof(float) * (size_t)m->params[i].count);
        at += m->params[i].count;
    }
    return c;
}

/* Keras 3's rule bit for bit, on the model's own gradients: the N − 1
   accumulating steps leave every weight as it was and add the gradient
   to the sum (acc + g); the N-th updates with (g + acc) / N and empties
   the sum; plain SGD, so w − lr·mean is the whole update. With a clip by
   global norm the mean is what gets clipped. */
static void check_keras_rule(float clip) {
    static float x[ACC_SMALL * ACC_N * FEATURES];
    static int32_t y[ACC_SMALL * ACC_N];
    const float lr = 0.25f;
    mpt_model *m = plain_model(MPT_POLICY_FLOAT32,
                               (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD,
                                                    .learning_rate = lr,
                                                    .clip_global_norm = clip,
                                                    .gradient_accumulation_steps = ACC_N},
                               ACC_SMALL);
    mpt_tensor tx, ty;
    snapshot snap;
    int b, i, bad = 0;
    make_blobs(x, y, ACC_SMALL * ACC_N, 23);
    for (b = 0; b < ACC_N; b++) {
        float *before = accum_copy(m), *after;
        double norm2 = 0, factor = 1;
        int64_t at = 0, e;
        take(m, &snap);
        rows_of(x, y, (int64_t)b * ACC_SMALL, ACC_SMALL, &tx, &ty);
        CHECK(train_step(m, &tx, &ty) == MPT_OK, "step %d: %s", b, mpt_context_error(ctx));
        after = accum_copy(m);
        if (b < ACC_N - 1) {
            CHECK(unchanged(m, &snap), "accumulating step %d changed a weight or slot", b);
            CHECK(m->accumulated_steps == b + 1, "step %d: %lld in the sum", b,
                  (long long)m->accumulated_steps);
            for (i = 0; i < m->n_params; i++)
                for (e = 0; m->params[i].trainable && e < m->params[i].count; e++, at++)
                    bad += after[at] != m->params[i].grad[e] + before[at];
            CHECK(!bad, "step %d: %d sums are not acc + g", b, bad);
        } else {
            CHECK(m->optimizer_steps == 1 && m->accumulated_steps == 0,
                  "applying step: %lld updates, %lld in the sum",
                  (long long)m->optimizer_steps, (long long)m->accumulated_steps);
            for (i = 0; i < m->n_params; i++)
                for (e = 0; m->params[i].trainable && e < m->params[i].count; e++, at++) {
                    double g = (double)((m->params[i].grad[e] + before[at]) / (float)ACC_N);
                    norm2 += g * g;
                }
            if (clip > 0 && sqrt(norm2) > clip) factor = clip / sqrt(norm2);
            for (i = 0, at = 0; i < m->n_params; i++)
                for (e = 0; m->params[i].trainable && e < m->params[i].count; e++, at++) {
                    float mean = (m->params[i].grad[e] + before[at]) / (float)ACC_N;
                    float g = mean * (float)factor;
                    float want = snap.values[i][e] - g * lr;
                    bad += m->params[i].value[e] != want || after[at] != 0.0f;
                }
            CHECK(!bad, "clip %g: %d weights differ from w - lr * clip((g + acc) / N) or sums "
                  "not emptied", (double)clip, bad);
            CHECK(clip == 0 || factor < 1, "clip %g never bit: norm %g", (double)clip,
                  sqrt(norm2));
            unchanged(m, &snap); /* frees it */
        }
        free(before);
        free(after);
    }
    mpt_model_destroy(m);
}

static void test_accumulation_keras_rule(void) {
    check_keras_rule(0);
    check_keras_rule(1e-3f); /* small enough to clip the mean */
}

/* Adam's t counts updates; the schedule's t counts the batches the
   optimizer was handed (Keras 3 calls a LearningRateSchedule with its raw
   iteration counter): at the first update, N − 1. */
static void test_accumulation_schedule_counts_batches(void) {
    mpt_optimizer_desc d = {.gradient_accumulation_steps = ACC_N,
                            .schedule = {.type = MPT_LR_STEP_DECAY, .decay_steps = 2,
                                         .decay_rate = 0.5f}};
    mpt_optimizer_desc r;
    mpt_step_state st;
    mpt__update_coefs k;
    double lr;
    CHECK(mpt__optimizer_resolve(ctx, &d, &r) == MPT_OK, "resolve: %s", mpt_context_error(ctx));
    memset(&st, 0, sizeof st);
    st.learning_rate = 0.1f;
    st.loss_scale = 1;
    st.finite = 1;
    st.accumulated_steps = ACC_N - 1;
    k = mpt__update_coefs_at(&r, &st);
    CHECK(k.mode == MPT__ACCUM_APPLY, "mode %d", k.mode);
    /* t = 3: 0.1 · 0.5^floor(3 / 2); Adam's t = 1 */
    lr = (double)0.1f * 0.5;
    CHECK(k.lr == (float)lr, "first update's rate %g", (double)k.lr);
    CHECK(k.alpha == (float)(lr * sqrt(1.0 - (double)0.999f) / (1.0 - (double)0.9f)),
          "Adam's bias correction is not the first update's: alpha %g", (double)k.alpha);
    st.optimizer_steps = 1; /* the second update: t = 7 */
    k = mpt__update_coefs_at(&r, &st);
    CHECK(k.lr == (float)((double)0.1f * 0.125), "second update's rate %g", (double)k.lr);
    st.accumulated_steps = 0;
    CHECK(mpt__update_coefs_at(&r, &st).mode == MPT__ACCUM_ADD, "a cycle's first batch applies");
}

/* Under mixed_float16's dynamic loss scaling (Keras' LossScaleOptimizer
   around an optimizer that accumulates): a batch whose gradients overflow
   is skipped whole: no weight, moment, BatchNormalization statistic or sum
   changes and it does not count toward the N; the scale backs off. The
   sums hold unscaled gradients, so batches under different scales add up
   consistently. */
static void test_accumulation_overflow_skips(void) {
    static float x[32 * FEATURES];
    static int32_t y[32];
    mpt_model *m = blob_model_for(MPT_POLICY_MIXED_FLOAT16, 9, 0);
    mpt_model *ref;
    mpt_tensor tx, ty;
    snapshot snap;
    float *sum, *now, scale;
    int64_t n = 0, e;
    int i, close = 1;
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f, .gradient_accumulation_steps = 3},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    m->emit_logits = mpt__can_fuse_softmax(m);
    make_blobs(x, y, 32, 4);
    rows_of(x, y, 0, 32, &tx, &ty);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step");
    CHECK(m->accumulated_steps == 1 && m->optimizer_steps == 0, "first batch not accumulated");
    /* overflow: skipped whole */
    m->loss_scale = 1e38f;
    scale = m->loss_scale;
    sum = accum_copy(m);
    take(m, &snap);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "overflowing step");
    now = accum_copy(m);
    for (i = 0; i < m->n_params; i++) n += m->params[i].trainable ? m->params[i].count : 0;
    CHECK(!memcmp(sum, now, sizeof(float) * (size_t)n), "a skipped batch changed the sums");
    CHECK(unchanged(m, &snap), "a skipped batch changed a weight, moment or statistic");
    CHECK(m->skipped_steps == 1 && m->loss_scale == scale * 0.5f,
          "skipped %lld, scale %g", (long long)m->skipped_steps, m->loss_scale);
    CHECK(m->accumulated_steps == 1, "a skipped batch counted toward N: %lld",
          (long long)m->accumulated_steps);
    free(now);
    /* the next two finite batches complete the cycle: one update */
    m->loss_scale = 1024;
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step at 1024");
    CHECK(m->accumulated_steps == 2 && m->optimizer_steps == 0, "second batch: %lld, %lld",
          (long long)m->accumulated_steps, (long long)m->optimizer_steps);
    free(sum);
    /* the third finite batch applies: one update, the sums emptied */
    take(m, &snap);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "applying step");
    CHECK(m->optimizer_steps == 1 && m->accumulated_steps == 0, "no update after 3 finite "
          "batches: %lld, %lld", (long long)m->optimizer_steps, (long long)m->accumulated_steps);
    CHECK(!unchanged(m, &snap), "the applying step changed nothing");
    now = accum_copy(m);
    for (e = 0; e < n; e++) close &= now[e] == 0;
    CHECK(close, "the sums were not emptied");
    free(now);
    /* an N = 1 model has no sums */
    ref = blob_model(MPT_POLICY_MIXED_FLOAT16, 9);
    CHECK(ref->params[0].accum == NULL && ref->update.accum == NULL, "N = 1 has sums");
    m->emit_logits = 0;
    mpt_model_destroy(ref);
    mpt_model_destroy(m);
}

/* The sums hold each batch's gradients unscaled by its own scale: the same
   batch at 32768 and then at 1024 (no Dropout, so the same gradients) adds
   up to twice the first's, and the first's is g · 2^-15 exactly. */
static void test_accumulation_scales_not_mixed(void) {
    static float x[ACC_SMALL * FEATURES];
    static int32_t y[ACC_SMALL];
    mpt_model *m = plain_model(MPT_POLICY_MIXED_FLOAT16,
                               (mpt_optimizer_desc){.gradient_accumulation_steps = 3}, ACC_SMALL);
    mpt_tensor tx, ty;
    float *first, *now;
    int64_t n = 0, e, at = 0;
    int i, exact = 1, twice = 1, same = 1;
    make_blobs(x, y, ACC_SMALL, 31);
    rows_of(x, y, 0, ACC_SMALL, &tx, &ty);
    CHECK(m->loss_scale == 32768.0f, "scale %g", m->loss_scale);
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step at 32768");
    first = accum_copy(m);
    for (i = 0; i < m->n_params; i++)
        for (e = 0; m->params[i].trainable && e < m->params[i].count; e++, at++)
            exact &= first[at] == m->params[i].grad[e] * (1.0f / 32768.0f);
    CHECK(exact, "the first sum is not the gradients unscaled by 32768");
    for (i = 0; i < m->n_params; i++) n += m->params[i].trainable ? m->params[i].count : 0;
    m->loss_scale = 1024;
    CHECK(train_step(m, &tx, &ty) == MPT_OK, "step at 1024");
    now = accum_copy(m);
    for (e = 0; e < n; e++) {
        double want = 2.0 * first[e];
        same &= now[e] == 2.0f * first[e];
        twice &= fabs((double)now[e] - want) <= 1e-3 * fabs(want) + 1e-9;
    }
    printf("# mixed_float16: one batch at 32768 then at 1024: the sum is %s twice the first\n",
           same ? "exactly" : "within 1e-3 of");
    CHECK(twice, "the sums mix the scales: not twice the first batch's unscaled gradients");
    free(first);
    free(now);
    mpt_model_destroy(m);
}

/* The optimizer's memory holds the sums: one float32 per trainable weight. */
static void test_accumulation_memory(void) {
    mpt_memory_report one, four;
    mpt_optimizer_desc off = {.gradient_accumulation_steps = 1};
    mpt_optimizer_desc on = {.gradient_accumulation_steps = 4};
    mpt_model *a = plain_model(MPT_POLICY_FLOAT32, off, 8);
    mpt_model *b = plain_model(MPT_POLICY_FLOAT32, on, 8);
    int64_t trainable = 0;
    int i;
    for (i = 0; i < a->n_params; i++) trainable += a->params[i].trainable ? a->params[i].count : 0;
    CHECK(mpt_model_memory(a, &one) == MPT_OK && mpt_model_memory(b, &four) == MPT_OK, "memory");
    CHECK(one.optimizer == 2 * 4 * trainable, "Adam without accumulation: %lld bytes",
          (long long)one.optimizer);
    CHECK(four.optimizer == 3 * 4 * trainable, "Adam with the sums: %lld bytes, want %lld",
          (long long)four.optimizer, (long long)(3 * 4 * trainable));
    CHECK(a->params[0].accum == NULL && b->params[0].accum != NULL, "sums where N = 1");
    { /* memory_limit counts them: a limit that holds N = 1's plan refuses N = 4's */
        mpt_context *q = quiet_ctx();
        mpt_model *c = NULL;
        mpt_model_create(q, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                              .seed = 21, .memory_limit = one.total}, &c);
        mpt_model_add_dense(c, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(c, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        CHECK(mpt_model_compile(c, &(mpt_compile_desc){
                  .optimizer = off, .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}}) ==
                  MPT_OK, "compile: %s", mpt_context_error(q));
        CHECK(mpt_model_build(c, 8) == MPT_OK, "N = 1 within its own plan's bytes: %s",
              mpt_context_error(q));
        test_expect_error(q, mpt_model_compile(c, &(mpt_compile_desc){
                                  .optimizer = on,
                                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}}),
                          MPT_ERR_OUT_OF_MEMORY, "memory_limit", "compile N = 4 under the limit");
        mpt_model_destroy(c);
        mpt_context_destroy(q);
    }
    mpt_model_destroy(a);
    mpt_model_destroy(b);
}

/* A checkpoint in the middle of a cycle (7 batches an epoch, N = 4: every
   epoch ends inside one) resumes bit for bit: sums and count included. A
   file without them (saved by a model that did not accumulate) loads as at
   a cycle's end; a model that does not accumulate refuses a file that
   holds them. */
static mpt_model *accum_blob_model(int steps) {
    mpt_model *m = blob_model_for(MPT_POLICY_MIXED_FLOAT16, 5, 0);
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f, .gradient_accumulation_steps = steps},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static int same_sums(const mpt_model *a, const mpt_model *b) {
    int i;
    for (i = 0; i < a->n_params; i++)
        if (a->params[i].trainable &&
            memcmp(a->params[i].accum, b->params[i].accum,
                   sizeof(float) * (size_t)a->params[i].count))
            return 0;
    return a->accumulated_steps == b->accumulated_steps;
}

static void test_accumulation_resume_mid_cycle(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    char path_buf[600];
    const char *path = 
        test_file_in(path_buf, sizeof path_buf, tmpdir, "test_train_accum.safetensors");
    char plain_buf[600];
    const char *plain = 
        test_file_in(plain_buf, sizeof plain_buf, tmpdir, "test_train_accum_plain.safetensors");
    mpt_context *q = quiet_ctx();
    mpt_dataset *d;
    mpt_model *a, *b, *c, *old;
    int i, empty = 1;
    make_blobs(x, y, N_SYN, 2);
    d = blob_dataset(x, y, N_SYN);
    a = accum_blob_model(4);
    b = accum_blob_model(4);
    c = accum_blob_model(4);
    CHECK(mpt_model_fit(a, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK, "fit a");
    CHECK(a->optimizer_steps == 5 && a->accumulated_steps == 1, "21 batches: %lld updates, "
          "%lld in the sum", (long long)a->optimizer_steps, (long long)a->accumulated_steps);
    CHECK(mpt_model_fit(b, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK, "fit b");
    CHECK(b->accumulated_steps == 2, "14 batches leave %lld in the sum",
          (long long)b->accumulated_steps);
    CHECK(mpt_model_save_checkpoint(b, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(c, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(same_sums(b, c), "the sums did not come back from the file");
    CHECK(mpt_model_fit(c, d, &(mpt_fit_desc){.epochs = 3, .initial_epoch = 2,
                                              .batch_size = 32}) == MPT_OK, "fit c");
    CHECK(test_same_state(a, c) && same_sums(a, c),
          "resumed in mid-cycle differs from the straight run");
    /* a file without the sums: an empty sum, count 0 */
    old = blob_model(MPT_POLICY_MIXED_FLOAT16, 5); /* Adam, N = 1 */
    CHECK(mpt_model_fit(old, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 32}) == MPT_OK, "fit");
    CHECK(mpt_model_save_checkpoint(old, plain) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(c, plain) == MPT_OK, "an older file: %s",
          mpt_context_error(ctx));
    for (i = 0; i < c->n_params; i++) {
        int64_t e;
        for (e = 0; c->params[i].trainable && e < c->params[i].count; e++)
            empty &= c->params[i].accum[e] == 0;
    }
    CHECK(empty && c->accumulated_steps == 0, "a file without sums left %lld in them",
          (long long)c->accumulated_steps);
    CHECK(test_same_state(old, c), "the older file's state did not load");
    /* N = 1 refuses the sums */
    mpt_model_destroy(old);
    {
        mpt_model *n1 = NULL;
        mpt_model_create(q, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                              .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 5}, &n1);
        mpt_model_add_dense(n1, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
        mpt_model_add_batch_normalization(n1, &(mpt_batchnorm_desc){0});
        mpt_model_add_dropout(n1, &(mpt_dropout_desc){.rate = 0.2f});
        mpt_model_add_dense(n1, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        mpt_model_compile(n1, &(mpt_compile_desc){
                                  .optimizer = {.learning_rate = 0.01f},
                                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
        CHECK(mpt_model_build(n1, 32) == MPT_OK, "build: %s", mpt_context_error(q));
        test_expect_error(q, mpt_model_load_checkpoint(n1, path), MPT_ERR_STATE,
                          "gradient_accumulation_steps 0", "load into N = 1");
        mpt_model_destroy(n1);
    }
    /* a count outside 0 .. N − 1: a model accumulating 2 refuses 2 */
    {
        mpt_model *two = NULL;
        mpt_model_create(q, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                              .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 5}, &two);
        mpt_model_add_dense(two, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
        mpt_model_add_batch_normalization(two, &(mpt_batchnorm_desc){0});
        mpt_model_add_dropout(two, &(mpt_dropout_desc){.rate = 0.2f});
        mpt_model_add_dense(two,
                            &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        mpt_model_compile(two, &(mpt_compile_desc){
                                   .optimizer = {.learning_rate = 0.01f,
                                                 .gradient_accumulation_steps = 2},
                                   .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
        CHECK(mpt_model_build(two, 32) == MPT_OK, "build: %s", mpt_context_error(q));
        test_expect_error(q, mpt_model_load_checkpoint(two, path), MPT_ERR_FORMAT,
                          "train/accumulated_steps is 2, outside 0..1", "load into N = 2");
        mpt_model_destroy(two);
    }
    remove(path);
    remove(plain);
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    mpt_model_destroy(c);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}

/* A negative count is refused, naming the field and the value; the model
   stays as it was. 0 and 1 both mean every batch updates. */
static void test_accumulation_bad_values(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES});
    test_expect_error(q, mpt_model_compile(m, &(mpt_compile_desc){
                             .optimizer = {.gradient_accumulation_steps = -3},
                             .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}),
                      MPT_ERR_INVALID_ARGUMENT, "gradient_accumulation_steps -3 must be >= 0",
                      "compile");
    CHECK(!m->compiled, "a refused compile compiled the model");
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){.optimizer = {.gradient_accumulation_steps = 1},
                                                  .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}) ==
              MPT_OK, "N = 1: %s", mpt_context_error(q));
    CHECK(mpt__accum_steps(&m->compile.optimizer) == 1, "N = 1 accumulates");
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_fit_learns_and_reports);
    TEST_RUN(test_regression_metrics);
    TEST_RUN(test_top_k_of_one_hot_targets);
    TEST_RUN(test_precision_and_recall);
    TEST_RUN(test_class_weight);
    TEST_RUN(test_sample_weight);
    TEST_RUN(test_weighted_metrics);
    TEST_RUN(test_r2_score);
    TEST_RUN(test_auc);
    TEST_RUN(test_weighted_against_keras);
    TEST_RUN(test_reproducible_and_resumable);
    TEST_RUN(test_overflow_skips_the_step);
    TEST_RUN(test_default_loss_scale);
    TEST_RUN(test_summary_and_progress);
    TEST_RUN(test_progress_line_overwrites_cleanly);
    TEST_RUN(test_user_callback);
    TEST_RUN(test_steps_allocate_nothing);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_sample_shape_checked_everywhere);
    TEST_RUN(test_batch_size_zero_means_32);
    TEST_RUN(test_steps_per_epoch);
    TEST_RUN(test_validation_split_as_keras);
    TEST_RUN(test_targets_of_shape_n);
    TEST_RUN(test_int32_targets_of_one_unit);
    TEST_RUN(test_sizes_past_int64);
    TEST_RUN(test_batch_size_past_the_data);
    TEST_RUN(test_conv2d_final_softmax);
    TEST_RUN(test_fashion_mnist_short_run);
    TEST_RUN(test_accumulation_equals_large_batch);
    TEST_RUN(test_accumulation_keras_rule);
    TEST_RUN(test_accumulation_schedule_counts_batches);
    TEST_RUN(test_accumulation_overflow_skips);
    TEST_RUN(test_accumulation_scales_not_mixed);
    TEST_RUN(test_accumulation_memory);
    TEST_RUN(test_accumulation_resume_mid_cycle);
    TEST_RUN(test_accumulation_bad_values);
}

int main(void) {
    static const test_program p = {.name = "test_train", .ctx = &ctx, .threads = 2,
                                   .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir, .keep_env = "MPT_KEEP_TEST_FILES",
                                   .cases = run_cases};
    return test_main(&p);
}

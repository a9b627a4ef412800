/* Models of several outputs (Keras' keras.Model(x, outputs=[cls, reg]) and
   model.fit(x, [y_cls, y_reg])): a classifier head and a regression head
   on one trunk learn both, and their loss_weights move the balance; the
   losses and metrics of a small fixed case against TensorFlow's Keras;
   gradients from both outputs (one of them also read by a later layer)
   against finite differences in double, in the three policies; training
   that repeats bit for bit on 1 and 2 threads; 2 logical replicas of a
   mirrored strategy against 1 with the global batch; a declared single
   output that trains as an undeclared one; loss scaling through every
   output; the labels carried through splits; predict per output; the
   logs' and the progress line's names; a profiled fit with TensorBoard
   (the per-layer table's heads, each output's tags in the events) and
   out-of-memory halving, both ending where a plain run ends; a model
   file's round trip and hostile architecture JSON; and the refusals
   (outputs, compile, data, what does not take such a model yet). On the emulated GPU:
   tests/test_backend.c; on a GPU: tests/test_cuda.c. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;
static mpt_context *quiet; /* for the refusals: errors counted, not printed */
static char tmpdir[512];

/* ---- the task: a class and a number from one vector -------------------------

   Sample i: 8 numbers in [-1, 1); its class is (x0 > 0) + 2·(x1 > 0), its
   target t = x2·x3 + x4 / 2 (a product: the trunk's nonlinearity is
   needed). */
enum { F = 8, CLASSES = 4, N_TRAIN = 1024, N_TEST = 256, N_ALL = N_TRAIN + N_TEST };

typedef struct task_data {
    float x[N_ALL * F];
    int32_t y[N_ALL];
    float t[N_ALL];
} task_data;

static task_data data;
static int64_t task_memory_limit; /* task_model's memory_limit (0: none) */

static void make_data(void) {
    int64_t i, j;
    test_seed(21);
    for (i = 0; i < N_ALL; i++) {
        float *x = data.x + i * F;
        for (j = 0; j < F; j++) x[j] = (float)test_uniform(-1, 1);
        data.y[i] = (x[0] > 0) + 2 * (x[1] > 0);
        data.t[i] = x[2] * x[3] + x[4] / 2;
    }
}

/* Samples [first, first + n) with both labels (labels[0] the classes). */
static mpt_dataset *task_dataset(mpt_context *c, int64_t first, int64_t n, int copy) {
    int64_t sx[2] = {n, F}, sy[1] = {n}, st[2] = {n, 1};
    mpt_tensor tx, ty, tt;
    const mpt_tensor *labels[2];
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, sx, data.x + first * F);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, sy, data.y + first);
    mpt_tensor_wrap(c, &tt, MPT_FLOAT32, 2, st, data.t + first);
    labels[0] = &ty;
    labels[1] = &tt;
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .labels = labels, .label_count = 2,
                                                    .copy = copy},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

/* x → Dense(32, relu) → "cls" Dense(4, softmax) and "reg" Dense(1), both
   outputs, compiled with Adam and the given loss weights (NULL: 1 each). */
static mpt_model *task_model(mpt_context *c, mpt_policy policy, const float *loss_weights,
                             const mpt_loss_scale_desc *scale) {
    mpt_model *m = NULL;
    mpt_node h, cls, reg;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1,
                                                .policy = policy, .seed = 7,
                                                .memory_limit = task_memory_limit},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    h = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 32,
                                                           .activation = MPT_ACT_RELU});
    cls = mpt_dense(m, h, &(mpt_dense_desc){.name = "cls", .units = CLASSES,
                                            .activation = MPT_ACT_SOFTMAX});
    reg = mpt_dense(m, h, &(mpt_dense_desc){.name = "reg", .units = 1});
    CHECK(mpt_model_add_output(m, cls) == MPT_OK, "add_output: %s", mpt_context_error(c));
    CHECK(mpt_model_add_output(m, reg) == MPT_OK, "add_output: %s", mpt_context_error(c));
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                                   .optimizer = {.type = MPT_OPTIMIZER_ADAM,
                                                 .learning_rate = 0.01f},
                                   .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                              {.type = MPT_LOSS_MEAN_SQUARED_ERROR}},
                                   .loss_weights = loss_weights,
                                   .output_metrics = {MPT_METRIC_ACCURACY,
                                                      MPT_METRIC_MEAN_ABSOLUTE_ERROR},
                                   .loss_scale = scale ? *scale : (mpt_loss_scale_desc){0}}) ==
              MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

/* The variance of the held-out targets: what predicting their mean scores. */
static double target_variance(void) {
    double mean = 0, var = 0;
    int64_t i;
    for (i = N_TRAIN; i < N_ALL; i++) mean += data.t[i] / N_TEST;
    for (i = N_TRAIN; i < N_ALL; i++) var += (data.t[i] - mean) * (data.t[i] - mean) / N_TEST;
    return var;
}

static mpt_logs evaluate(mpt_model *m, mpt_dataset *d) {
    mpt_logs logs;
    memset(&logs, 0, sizeof logs);
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 64}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    return logs;
}

/* Both heads learn with equal weights (held out: accuracy above 90%, the
   regression's loss under a fifth of the targets' variance), in float32
   and mixed_float16; a weight of 0 leaves a head where it started while
   the other learns: the weights decide what the trunk serves. */
static void test_two_heads_learn(void) {
    mpt_dataset *train = task_dataset(ctx, 0, N_TRAIN, 0);
    mpt_dataset *test = task_dataset(ctx, N_TRAIN, N_TEST, 0);
    const float equal[2] = {1, 1}, cls_only[2] = {1, 0}, reg_only[2] = {0, 1};
    const double var = target_variance();
    mpt_fit_desc fit = fit_for(20, 32);
    mpt_logs logs;
    int k;
    for (k = 0; k < 2; k++) {
        mpt_model *m = task_model(ctx, test_policies[k], equal, NULL);
        CHECK(mpt_model_fit(m, train, &fit) == MPT_OK, "fit %s: %s",
              mpt_policy_name(test_policies[k]), mpt_context_error(ctx));
        logs = evaluate(m, test);
        printf("# %s, weights 1, 1: held out cls_accuracy %.4f, reg_loss %.6f (variance %.4f)\n",
               mpt_policy_name(test_policies[k]), mpt_logs_get(&logs, "cls_accuracy"),
               mpt_logs_get(&logs, "reg_loss"), var);
        CHECK(mpt_logs_get(&logs, "cls_accuracy") > 0.9, "%s: cls_accuracy %.4f",
              mpt_policy_name(test_policies[k]), mpt_logs_get(&logs, "cls_accuracy"));
        CHECK(mpt_logs_get(&logs, "reg_loss") < var / 5, "%s: reg_loss %.4f, variance %.4f",
              mpt_policy_name(test_policies[k]), mpt_logs_get(&logs, "reg_loss"), var);
        CHECK(fabs(mpt_logs_get(&logs, "loss") - mpt_logs_get(&logs, "cls_loss") -
                   mpt_logs_get(&logs, "reg_loss")) < 1e-6,
              "loss %.7f is not cls_loss + reg_loss", mpt_logs_get(&logs, "loss"));
        mpt_model_destroy(m);
    }
    {
        mpt_model *a = task_model(ctx, MPT_POLICY_FLOAT32, cls_only, NULL);
        mpt_model *b = task_model(ctx, MPT_POLICY_FLOAT32, reg_only, NULL);
        mpt_logs la, lb;
        CHECK(mpt_model_fit(a, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(b, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        la = evaluate(a, test);
        lb = evaluate(b, test);
        printf("# weights 1, 0: cls_accuracy %.4f, reg_loss %.4f; weights 0, 1: cls_accuracy "
               "%.4f, reg_loss %.4f\n", mpt_logs_get(&la, "cls_accuracy"),
               mpt_logs_get(&la, "reg_loss"), mpt_logs_get(&lb, "cls_accuracy"),
               mpt_logs_get(&lb, "reg_loss"));
        CHECK(mpt_logs_get(&la, "cls_accuracy") > 0.9 && mpt_logs_get(&la, "reg_loss") > var / 2,
              "weights 1, 0: cls_accuracy %.4f, reg_loss %.4f", mpt_logs_get(&la, "cls_accuracy"),
              mpt_logs_get(&la, "reg_loss"));
        CHECK(mpt_logs_get(&lb, "cls_accuracy") < 0.6 && mpt_logs_get(&lb, "reg_loss") < var / 5,
              "weights 0, 1: cls_accuracy %.4f, reg_loss %.4f", mpt_logs_get(&lb, "cls_accuracy"),
              mpt_logs_get(&lb, "reg_loss"));
        CHECK(fabs(mpt_logs_get(&la, "loss") - mpt_logs_get(&la, "cls_loss")) < 1e-6,
              "weights 1, 0: loss %.7f is not cls_loss", mpt_logs_get(&la, "loss"));
        mpt_model_destroy(a);
        mpt_model_destroy(b);
    }
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
}

/* ---- against Keras: a small fixed case (tests/data/keras_outputs/make.py) ----- */

enum { KN = 6, KIN = 3, KH = 4, KC = 3 };

/* keys: loss, cls_loss, reg_loss, cls_accuracy, reg_mean_absolute_error */
static const char *const keras_keys[] = {"loss", "cls_loss", "reg_loss", "cls_accuracy",
                                         "reg_mean_absolute_error"};
/* what make.py printed (TensorFlow 2.21.0, Keras 3) */
static const double KERAS_EVALUATE[] = {
    1.22180223, 0.870358884, 0.70288676, 0.666666687, 0.727049768};
static const double KERAS_EVALUATE_WEIGHTED[] = {
    1.16366482, 0.970338643, 0.386652261, 0.666666687, 0.727049768};
static const double KERAS_FIT[] = {
    1.22180223, 0.870358884, 0.70288676, 0.666666687, 0.727049768};
static const double KERAS_AFTER_STEP[] = {
    -0.382947713, 0.264754087, -0.00338146766, -0.261926591, 0.0174505915, -0.211971477,
    0.348202497, 0.112528302, 0.376342386, 0.115192711, -0.136005118, -0.363994956,
    -0.123458028, -0.00312993093, 0.135417759, 0.249765381, -0.513317585, 0.258247435,
    -0.244929835, -0.00342312944, -0.505892098, 0.259315223, 0.508394659, 0.00172262604,
    -0.510117292, -0.240130752, 0.503698826, -0.0135680679, -0.242725, -0.00136402028,
    0.244089022, 0.24089551, 0.732680976, -0.724948943, -0.237090319, 0.249733642};
static const float KERAS_SAMPLE_WEIGHT[KN] = {1, 2, 0.5f, 0, 1.5f, 1};

typedef struct keras_case {
    float x[KN * KIN];
    int32_t y[KN];
    float t[KN];
} keras_case;

static void keras_data(keras_case *k) {
    int i, j;
    for (i = 0; i < KN; i++) {
        for (j = 0; j < KIN; j++)
            k->x[i * KIN + j] = (float)(((5 * i + 3 * j + i * j) % 11 - 5) / 4.0);
        k->y[i] = (2 * i + 1) % 3;
        k->t[i] = (float)((i % 4) / 2.0 - 0.5);
    }
}

/* make.py's weights, in the model's parameter order. */
static void keras_weights(mpt_model *m) {
    float *w[6];
    int p, j, h, c;
    for (p = 0; p < 6; p++) {
        mpt_param_info info;
        mpt_model_param(m, p, &info);
        w[p] = (float *)info.value.data;
    }
    for (j = 0; j < KIN; j++)
        for (h = 0; h < KH; h++) w[0][j * KH + h] = (float)(((3 * j + 5 * h) % 7 - 3) / 8.0);
    for (h = 0; h < KH; h++) w[1][h] = (float)((h - 1) / 8.0);
    for (h = 0; h < KH; h++)
        for (c = 0; c < KC; c++) w[2][h * KC + c] = (float)(((2 * h + 3 * c) % 5 - 2) / 4.0);
    for (c = 0; c < KC; c++) w[3][c] = (float)((c - 1) / 4.0);
    for (h = 0; h < KH; h++) w[4][h] = (float)(((h + 2) % 4 - 1.5) / 2.0);
    w[5][0] = 0.25f;
    mpt_model_refresh_weights(m);
}

static void expect_keras(const mpt_logs *logs, const double *want, const char *what) {
    int k;
    for (k = 0; k < 5; k++) {
        double got = mpt_logs_get(logs, keras_keys[k]);
        CHECK(fabs(got - want[k]) <= 2e-6 * fabs(want[k]) + 1e-7, "%s: %s %.9g, Keras %.9g",
              what, keras_keys[k], got, want[k]);
    }
}

/* evaluate with and without sample weights, and fit's one step (SGD 0.1,
   one batch): the logs and the weights after it, as Keras computes them. */
static void test_keras_reference(void) {
    keras_case k;
    int64_t sx[2] = {KN, KIN}, sy[1] = {KN}, st[2] = {KN, 1}, sw[1] = {KN};
    mpt_tensor tx, ty, tt, tw;
    const mpt_tensor *labels[2];
    mpt_dataset *d = NULL, *dw = NULL;
    mpt_model *m = NULL;
    mpt_node h;
    mpt_logs logs;
    mpt_history hist;
    float after[64];
    int i;
    keras_data(&k);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, sx, k.x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, sy, k.y);
    mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 2, st, k.t);
    mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, sw, (void *)KERAS_SAMPLE_WEIGHT);
    labels[0] = &ty;
    labels[1] = &tt;
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .labels = labels,
                                                      .label_count = 2},
                             &d) == MPT_OK, "dataset: %s", mpt_context_error(ctx));
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .labels = labels,
                                                      .label_count = 2, .sample_weight = &tw},
                             &dw) == MPT_OK, "dataset: %s", mpt_context_error(ctx));
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {KIN}, .input_rank = 1},
                           &m) == MPT_OK, "create: %s", mpt_context_error(ctx));
    h = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.name = "hidden", .units = KH,
                                                           .activation = MPT_ACT_TANH});
    mpt_model_add_output(m, mpt_dense(m, h, &(mpt_dense_desc){.name = "cls", .units = KC,
                                                              .activation = MPT_ACT_SOFTMAX}));
    mpt_model_add_output(m, mpt_dense(m, h, &(mpt_dense_desc){.name = "reg", .units = 1}));
    test_compile_class_and_number(
        ctx, m, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f});
    CHECK(mpt_model_build(m, KN) == MPT_OK, "build: %s", mpt_context_error(ctx));
    keras_weights(m);
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = KN}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    expect_keras(&logs, KERAS_EVALUATE, "evaluate");
    CHECK(logs.count == 5, "evaluate logs %d values, Keras 5", logs.count);
    CHECK(mpt_model_evaluate(m, dw, &(mpt_evaluate_desc){.batch_size = KN}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    expect_keras(&logs, KERAS_EVALUATE_WEIGHTED, "evaluate with sample weights");
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = KN, .no_shuffle = 1}) ==
              MPT_OK, "fit: %s", mpt_context_error(ctx));
    mpt_model_history(m, &hist);
    memset(&logs, 0, sizeof logs);
    for (i = 0; i < hist.n_keys; i++) {
        logs.names[logs.count] = hist.keys[i];
        logs.values[logs.count++] = hist.values[i][0];
    }
    expect_keras(&logs, KERAS_FIT, "fit's epoch");
    test_weights_of(m, after, 64);
    for (i = 0; i < (int)(sizeof KERAS_AFTER_STEP / sizeof *KERAS_AFTER_STEP); i++)
        CHECK(fabs(after[i] - KERAS_AFTER_STEP[i]) < 2e-6, "weight %d after the step %.9g, Keras "
              "%.9g", i, after[i], KERAS_AFTER_STEP[i]);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_dataset_destroy(dw);
}

/* ---- gradients from both outputs -----------------------------------------------
   x (5) → "h" Dense(4, tanh); output 0: "a" Dense(3) on h; output 1: "b"
   Dense(2, sigmoid) on Concatenate(h, a): a's gradient is its own
   upstream gradient plus what b's branch gives back. */

enum { G_IN = 5, G_H = 4, G_A = 3, G_B = 2 };

static void two_output_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    double *yb = y + c->batch * G_A; /* output 1's batch follows output 0's */
    int64_t n, i;
    for (n = 0; n < c->batch; n++) {
        double ha[G_H + G_A], z[G_B];
        ref_dense_sample(x + n * G_IN, p[0], p[1], G_IN, G_H, ha);
        for (i = 0; i < G_H; i++) ha[i] = tanh(ha[i]);
        ref_dense_sample(ha, p[2], p[3], G_H, G_A, ha + G_H);
        for (i = 0; i < G_A; i++) y[n * G_A + i] = ha[G_H + i];
        ref_dense_sample(ha, p[4], p[5], G_H + G_A, G_B, z);
        for (i = 0; i < G_B; i++) yb[n * G_B + i] = 1 / (1 + exp(-z[i]));
    }
}

static mpt_model *two_output_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_node both[2], a;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {G_IN}, .input_rank = 1,
                                                .policy = policy, .seed = 3},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    both[0] = mpt_dense(m, mpt_model_input(m),
                        &(mpt_dense_desc){.name = "h", .units = G_H, .activation = MPT_ACT_TANH});
    both[1] = a = mpt_dense(m, both[0], &(mpt_dense_desc){.name = "a", .units = G_A});
    mpt_model_add_output(m, a);
    mpt_model_add_output(m, mpt_dense(m, mpt_concatenate(m, 2, both, NULL),
                                      &(mpt_dense_desc){.name = "b", .units = G_B,
                                                        .activation = MPT_ACT_SIGMOID}));
    return m;
}

static void test_two_output_gradients(void) {
    gc_check_policies(ctx, two_output_model, two_output_ref, "two outputs");
}

/* ---- the same bits: 1 and 2 threads; one output declared or not -------------- */

enum { N_WEIGHTS = 8 * 32 + 32 + 32 * 4 + 4 + 32 + 1 };

static void fit_weights(mpt_context *c, mpt_policy policy, float *w) {
    mpt_dataset *train = task_dataset(c, 0, 256, 0);
    mpt_model *m = task_model(c, policy, (const float[]){1.0f, 0.25f}, NULL);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(c));
    test_weights_of(m, w, N_WEIGHTS);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
}

static void test_threads_bit_identical(void) {
    int k;
    for (k = 0; k < 3; k++) {
        static float w1[N_WEIGHTS], w2[N_WEIGHTS];
        mpt_context *one = path_ctx(1, 0), *two = path_ctx(2, 0);
        test__begin();
        fit_weights(one, test_policies[k], w1);
        fit_weights(two, test_policies[k], w2);
        CHECK(memcmp(w1, w2, sizeof w1) == 0, "%s: 1 and 2 threads differ",
              mpt_policy_name(test_policies[k]));
        mpt_context_destroy(one);
        mpt_context_destroy(two);
        test__end("1 and 2 threads bit-identical, two outputs, %s",
                  mpt_policy_name(test_policies[k]));
    }
}

/* Two logical replicas of the mirrored strategy, each its half of the
   global batch and its labels, train as one replica with the whole batch:
   the same history and weights up to the order of the sums. */
static void test_replicas_match_one(void) {
    static const char *const keys[] = {"loss", "cls_loss", "reg_loss", "cls_accuracy",
                                       "reg_mean_absolute_error", "val_loss", "val_reg_loss",
                                       NULL};
    mpt_dataset *train = task_dataset(ctx, 0, 320, 0);
    mpt_strategy *s = test_mirrored_strategy(ctx, 2);
    mpt_model *one = task_model(ctx, MPT_POLICY_FLOAT32, (const float[]){1.0f, 0.5f}, NULL);
    mpt_model *two = NULL;
    mpt_node h, cls, reg;
    mpt_fit_desc fit = fit_for(3, 64);
    fit.validation_split = 0.2f;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1,
                                                  .seed = 7, .strategy = s},
                           &two) == MPT_OK, "create: %s", mpt_context_error(ctx));
    h = mpt_dense(two, mpt_model_input(two), &(mpt_dense_desc){.units = 32,
                                                               .activation = MPT_ACT_RELU});
    cls = mpt_dense(two, h, &(mpt_dense_desc){.name = "cls", .units = CLASSES,
                                              .activation = MPT_ACT_SOFTMAX});
    reg = mpt_dense(two, h, &(mpt_dense_desc){.name = "reg", .units = 1});
    mpt_model_add_output(two, cls);
    mpt_model_add_output(two, reg);
    test_compile_class_and_number(
        ctx, two, (mpt_optimizer_desc){.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f});
    CHECK(mpt_model_fit(one, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(two, train, &fit) == MPT_OK, "fit on 2 replicas: %s",
          mpt_context_error(ctx));
    test_replicas_match(one, two, keys, 1e-5);
    mpt_model_destroy(one);
    mpt_model_destroy(two);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(train);
}

/* A model whose one output is declared trains as the same model without. */
static void test_one_output_declared(void) {
    float w[2][F * 16 + 16 + 16 * CLASSES + CLASSES];
    int k;
    mpt_dataset *train = test_dataset_xy(ctx, data.x, data.y, 256, F);
    for (k = 0; k < 2; k++) {
        mpt_model *m = NULL;
        mpt_node h, out;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1,
                                                .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 4},
                         &m);
        h = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 16,
                                                               .activation = MPT_ACT_RELU});
        out = mpt_dense(m, h, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        if (k) CHECK(mpt_model_add_output(m, out) == MPT_OK, "add_output: %s",
                     mpt_context_error(ctx));
        test_compile_classifier(ctx, m);
        CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_output_count(m) == 1, "%d outputs", mpt_model_output_count(m));
        test_weights_of(m, w[k], (int64_t)(sizeof w[k] / sizeof(float)));
        mpt_model_destroy(m);
    }
    CHECK(memcmp(w[0], w[1], sizeof w[0]) == 0, "a declared output trains otherwise");
    mpt_dataset_destroy(train);
}

/* ---- loss scaling through every output -------------------------------------------
   In float32 a fixed scale of 1024 multiplies and divides every gradient
   exactly: the same training as none, so each output's gradient must get
   the scale. mixed_float16's dynamic scaling from 2^40 skips the steps
   whose gradients overflow float16, backs off, and then learns. */
static void test_loss_scaling(void) {
    static float w[2][N_WEIGHTS];
    mpt_dataset *train = task_dataset(ctx, 0, 256, 0);
    mpt_loss_scale_desc none = {.mode = MPT_LOSS_SCALE_NONE};
    mpt_loss_scale_desc fixed = {.mode = MPT_LOSS_SCALE_FIXED, .initial_scale = 1024};
    mpt_loss_scale_desc huge = {.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 1099511627776.0f};
    mpt_model *m;
    int k;
    double first, last, skipped = 0;
    for (k = 0; k < 2; k++) {
        m = task_model(ctx, MPT_POLICY_FLOAT32, NULL, k ? &fixed : &none);
        CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        test_weights_of(m, w[k], N_WEIGHTS);
        mpt_model_destroy(m);
    }
    for (k = 0; k < N_WEIGHTS; k++)
        CHECK(w[0][k] == w[1][k], "weight %d: %.9g with a scale of 1024, %.9g without", k,
              w[1][k], w[0][k]);
    m = task_model(ctx, MPT_POLICY_MIXED_FLOAT16, NULL, &huge);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 8, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    first = history_value(m, "loss", 0);
    last = history_value(m, "loss", 7);
    for (k = 0; k < 8; k++) skipped += history_value(m, "skipped_steps", k);
    printf("# mixed_float16 from 2^40: skipped %g steps, loss scale %g, loss %.4f -> %.4f\n",
           skipped, mpt_model_loss_scale(m), first, last);
    /* float16 holds up to 65504: the scale comes down below 2^16 or so,
       one halving a skipped step */
    CHECK(skipped >= 20 && skipped <= 32, "skipped %g steps", skipped);
    CHECK(mpt_model_loss_scale(m) <= 1048576, "loss scale %g", mpt_model_loss_scale(m));
    CHECK(isfinite(last) && last < 0.8 * first, "loss %.4f -> %.4f", first, last);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
}

/* ---- names, progress, predict, the labels through splits --------------------------- */

static void test_logs_and_progress(void) {
    static char text[1 << 16];
    test_text out = {text, sizeof text, 0};
    const char *const keys[] = {"loss", "cls_loss", "cls_accuracy", "reg_loss",
                                "reg_mean_absolute_error", "val_loss", "val_cls_loss",
                                "val_cls_accuracy", "val_reg_loss",
                                "val_reg_mean_absolute_error"};
    mpt_dataset *train = task_dataset(ctx, 0, 320, 0);
    mpt_model *m = task_model(ctx, MPT_POLICY_FLOAT32, (const float[]){2.0f, 0.5f}, NULL);
    mpt_history hist;
    size_t k;
    mpt_fit_desc fit = fit_for(2, 32);
    fit.validation_split = 0.2f;
    fit.verbose = 2;
    fit.printer.fn = test_text_append;
    fit.printer.user_data = &out;
    test_text_clear(&out);
    CHECK(mpt_model_fit(m, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    mpt_model_history(m, &hist);
    for (k = 0; k < sizeof keys / sizeof *keys; k++) {
        char shown[64];
        CHECK(isfinite(history_value(m, keys[k], 1)), "history lacks %s", keys[k]);
        snprintf(shown, sizeof shown, " - %s: ", keys[k]);
        CHECK(strstr(text, shown) != NULL, "the progress line lacks '%s': %s", shown, text);
    }
    for (k = 0; k < 2; k++) {
        const char *v = k ? "val_" : "";
        char loss[32], cls[32], reg[32];
        snprintf(loss, sizeof loss, "%sloss", v);
        snprintf(cls, sizeof cls, "%scls_loss", v);
        snprintf(reg, sizeof reg, "%sreg_loss", v);
        CHECK(fabs(history_value(m, loss, 1) - 2 * history_value(m, cls, 1) -
                   0.5 * history_value(m, reg, 1)) < 1e-5,
              "%s %.6f is not 2·%s + 0.5·%s", loss, history_value(m, loss, 1), cls, reg);
    }
    CHECK(history_value(m, "accuracy", 1) != history_value(m, "accuracy", 1),
          "a model of two outputs logs 'accuracy' unprefixed");
    CHECK(strcmp(mpt_model_output_name(m, 1), "reg") == 0 && !mpt_model_output_name(m, 2),
          "output names %s", mpt_model_output_name(m, 1));
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
}

/* predict_outputs gives each output; its classes score as evaluate says;
   the one-tensor predict refuses the model. */
static void test_predict_outputs(void) {
    mpt_dataset *train = task_dataset(ctx, 0, 512, 0);
    mpt_dataset *test = task_dataset(ctx, N_TRAIN, N_TEST, 0);
    mpt_model *m = task_model(ctx, MPT_POLICY_FLOAT32, NULL, NULL);
    mpt_tensor outs[2], one;
    mpt_logs logs;
    int64_t i, right = 0;
    double se = 0;
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    logs = evaluate(m, test);
    CHECK(mpt_model_predict_outputs(m, test, 50, 2, outs) == MPT_OK, "predict_outputs: %s",
          mpt_context_error(ctx));
    CHECK(outs[0].rank == 2 && outs[0].shape[0] == N_TEST && outs[0].shape[1] == CLASSES &&
              outs[1].rank == 2 && outs[1].shape[1] == 1,
          "shapes (%lld, %lld) and (%lld, %lld)", (long long)outs[0].shape[0],
          (long long)outs[0].shape[1], (long long)outs[1].shape[0], (long long)outs[1].shape[1]);
    for (i = 0; i < N_TEST; i++) {
        const float *p = (const float *)outs[0].data + i * CLASSES;
        int c, best = 0;
        for (c = 1; c < CLASSES; c++)
            if (p[c] > p[best]) best = c;
        right += best == data.y[N_TRAIN + i];
        se += pow(((const float *)outs[1].data)[i] - data.t[N_TRAIN + i], 2);
    }
    CHECK(fabs((double)right / N_TEST - mpt_logs_get(&logs, "cls_accuracy")) < 1e-9,
          "predicted accuracy %.4f, evaluate's %.4f", (double)right / N_TEST,
          mpt_logs_get(&logs, "cls_accuracy"));
    CHECK(fabs(se / N_TEST - mpt_logs_get(&logs, "reg_loss")) < 1e-5,
          "predicted mse %.6f, evaluate's %.6f", se / N_TEST, mpt_logs_get(&logs, "reg_loss"));
    mpt_tensor_free(ctx, &outs[0]);
    mpt_tensor_free(ctx, &outs[1]);
    test_expect_error(ctx, mpt_model_predict(m, test, 32, &one), MPT_ERR_INVALID_ARGUMENT,
                      "predict_outputs", "predict");
    test_expect_error(ctx, mpt_model_predict_outputs(m, test, 32, 1, outs),
                      MPT_ERR_INVALID_ARGUMENT, "room for 1 output", "predict_outputs(1)");
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
}

/* A split's halves hold their samples' labels: their losses, weighted by
   their sizes, make the whole's; a copied dataset's are its own. */
static void test_labels_through_splits(void) {
    mpt_dataset *all = task_dataset(ctx, 0, 200, 1), *head = NULL, *tail = NULL;
    mpt_model *m = task_model(ctx, MPT_POLICY_FLOAT32, (const float[]){1.0f, 3.0f}, NULL);
    mpt_logs la, lh, lt;
    int k;
    const char *const keys[] = {"loss", "cls_loss", "reg_loss", "cls_accuracy",
                                "reg_mean_absolute_error"};
    CHECK(mpt_dataset_split(ctx, all, 120, &head, &tail) == MPT_OK, "split: %s",
          mpt_context_error(ctx));
    la = evaluate(m, all);
    lh = evaluate(m, head);
    lt = evaluate(m, tail);
    for (k = 0; k < 5; k++) {
        double whole = mpt_logs_get(&la, keys[k]);
        double parts = (120 * mpt_logs_get(&lh, keys[k]) + 80 * mpt_logs_get(&lt, keys[k])) / 200;
        CHECK(fabs(whole - parts) < 1e-5 * fabs(whole) + 1e-7, "%s: %.7f whole, %.7f from the "
              "halves", keys[k], whole, parts);
    }
    mpt_dataset_destroy(all); /* the views outlive it */
    CHECK(mpt_model_fit(m, tail, &(mpt_fit_desc){.epochs = 1, .batch_size = 16}) == MPT_OK,
          "fit on a view: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    mpt_model_destroy(m);
}

/* ---- model files ------------------------------------------------------------------ */

/* A trained model of two outputs saved whole (mpt_model_save) and loaded
   with no code: the same outputs, losses, loss weights and metrics, so the
   same evaluation bit for bit and the same predictions; a checkpoint of it
   resumes training as the model itself goes on. */
static void test_model_file_round_trip(void) {
    mpt_dataset *train = task_dataset(ctx, 0, 256, 0);
    mpt_dataset *test = task_dataset(ctx, N_TRAIN, N_TEST, 0);
    mpt_model *m = task_model(ctx, MPT_POLICY_MIXED_FLOAT16, (const float[]){0.75f, 2.0f}, NULL);
    mpt_model *back = NULL;
    mpt_logs a, b;
    mpt_tensor pa[2], pb[2];
    char path[600];
    int k;
    snprintf(path, sizeof path, "%s/two_outputs.safetensors", tmpdir);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &back) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (!back) goto done;
    CHECK(mpt_model_output_count(back) == 2 && strcmp(mpt_model_output_name(back, 0), "cls") == 0 &&
              strcmp(mpt_model_output_name(back, 1), "reg") == 0,
          "outputs %d loaded", mpt_model_output_count(back));
    a = evaluate(m, test);
    b = evaluate(back, test);
    CHECK(a.count == 5 && b.count == 5, "%d and %d values", a.count, b.count);
    for (k = 0; k < a.count; k++)
        CHECK(strcmp(a.names[k], b.names[k]) == 0 && a.values[k] == b.values[k],
              "%s %.9g, loaded %s %.9g", a.names[k], a.values[k], b.names[k], b.values[k]);
    CHECK(fabs(mpt_logs_get(&b, "loss") - 0.75 * mpt_logs_get(&b, "cls_loss") -
               2 * mpt_logs_get(&b, "reg_loss")) < 1e-5, "the loaded loss weights");
    CHECK(mpt_model_predict_outputs(m, test, 64, 2, pa) == MPT_OK &&
              mpt_model_predict_outputs(back, test, 64, 2, pb) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    for (k = 0; k < 2; k++) {
        CHECK(mpt_tensor_bytes(&pa[k]) == mpt_tensor_bytes(&pb[k]) &&
                  memcmp(pa[k].data, pb[k].data, mpt_tensor_bytes(&pa[k])) == 0,
              "output %d's predictions differ after loading", k);
        mpt_tensor_free(ctx, &pa[k]);
        mpt_tensor_free(ctx, &pb[k]);
    }
    /* the trained model goes on an epoch and saves a checkpoint; the
       loaded one (an epoch behind) resumes from it: the next epoch ends on
       the same weights in both */
    snprintf(path, sizeof path, "%s/two_outputs_state.safetensors", tmpdir);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK &&
              mpt_model_save_checkpoint(m, path) == MPT_OK &&
              mpt_model_load_checkpoint(back, path) == MPT_OK,
          "checkpoint: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 4, .batch_size = 32}) == MPT_OK &&
              mpt_model_fit(back, train, &(mpt_fit_desc){.epochs = 4, .batch_size = 32}) ==
                  MPT_OK,
          "fit after the checkpoint: %s", mpt_context_error(ctx));
    CHECK(test_weight_diff(back, m) == 0, "resumed from the checkpoint: weights differ by %.3g "
          "(relative norm)", test_weight_diff(back, m));
done:
    mpt_model_destroy(back);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
}

/* Architecture JSON of two outputs, read as mpt_model_load reads it: the
   good one loads; hostile outputs, losses and weights are refused, each
   with its reason. */
static void test_file_outputs_refused(void) {
#define DENSE(name, in, units) \
    "{\"class\":\"Dense\",\"name\":\"" name "\",\"inputs\":[" in "],"  \
    "\"config\":{\"units\":" units "}}"
#define LAYERS DENSE("h", "0", "4") "," DENSE("cls", "1", "3") "," DENSE("reg", "1", "1")
#define LOSSES "\"losses[0].type\":1,\"losses[1].type\":4"
    static const struct {
        const char *outputs, *compile, *words;
    } cases[] = {
        {"[2,3]", LOSSES ",\"loss_weights[0]\":1,\"loss_weights[1]\":0.5", NULL},
        {"[2]", LOSSES, "\"outputs\" is not an array of 2..4 nodes"},
        {"[2,3,2,3,2]", LOSSES, "\"outputs\" is not an array of 2..4 nodes"},
        {"{\"a\":2}", LOSSES, "\"outputs\" is not an array"},
        {"[2,9]", LOSSES, "an output node"},
        {"[0,3]", LOSSES, "an output node"},
        {"[2,2.5]", LOSSES, "an output node"},
        {"[3,3]", LOSSES, "is output 0 already"},
        {"[1,3]", LOSSES ",\"loss_weights[0]\":1,\"loss_weights[1]\":1",
         "'cls' (Dense) leads to none of the 2 outputs"},
        {"[2,3]", LOSSES ",\"loss_weights[0]\":1", "loss_weights[1] ('reg') = nan"},
        {"[2,3]", LOSSES ",\"loss_weights[0]\":-1,\"loss_weights[1]\":1",
         "loss_weights[0] ('cls') = -1"},
        {"[2,3]", "\"losses[0].type\":1,\"loss_weights[0]\":1,\"loss_weights[1]\":1",
         "output 1 ('reg') has no loss"},
        {"[2,3]", LOSSES ",\"losses[1].type\":77,\"loss_weights[0]\":1,\"loss_weights[1]\":1",
         "losses[1].type"},
        {"[2,3]", LOSSES ",\"losses[3].type\":4,\"loss_weights[0]\":1,\"loss_weights[1]\":1",
         "losses[3] is set but the model has 2 outputs"},
        {"[2,3]", LOSSES ",\"loss_weights[4]\":1", "has no field \"loss_weights[4]\""},
        {"[2,3]", LOSSES ",\"output_metrics[0]\":4096,\"loss_weights[0]\":1,"
                  "\"loss_weights[1]\":1", "unknown bits"},
        {NULL, "\"loss.type\":1,\"loss_weights[0]\":1",
         "loss_weights is for a model of several outputs"},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char rest[512] = "";
        size_t used = 0;
        if (cases[k].outputs)
            used = (size_t)snprintf(rest, sizeof rest, ",\"outputs\":%s", cases[k].outputs);
        snprintf(rest + used, sizeof rest - used, ",\"compile\":{%s}", cases[k].compile);
        test_json_case(quiet, (int)k,
                       cases[k].outputs ? LAYERS : DENSE("h", "0", "4") "," DENSE("cls", "1", "3"),
                       rest, cases[k].words, mpt_model_output_count);
    }
#undef DENSE
#undef LAYERS
#undef LOSSES
}

/* ---- refusals ------------------------------------------------------------------- */

static mpt_model *two_head_model(mpt_context *c, mpt_node *h, mpt_node *cls, mpt_node *reg) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1}, &m);
    *h = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 8});
    *cls = mpt_dense(m, *h, &(mpt_dense_desc){.name = "cls", .units = CLASSES,
                                              .activation = MPT_ACT_SOFTMAX});
    *reg = mpt_dense(m, *h, &(mpt_dense_desc){.name = "reg", .units = 1});
    return m;
}

static void test_bad_outputs(void) {
    mpt_node h, cls, reg, in1;
    mpt_model *m = two_head_model(quiet, &h, &cls, &reg);
    test_expect_error(quiet, mpt_model_add_output(m, 0), MPT_ERR_INVALID_ARGUMENT, "input",
                      "add_output(input)");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg);
    test_expect_error(quiet, mpt_model_add_output(m, 99), MPT_ERR_INVALID_ARGUMENT,
                      "not a layer's output", "add_output(99)");
    test_expect_error(quiet, mpt_model_build(m, 8), MPT_ERR_INVALID_ARGUMENT,
                      "not a layer's output", "build after a bad add_output");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg);
    mpt_model_add_output(m, cls);
    test_expect_error(quiet, mpt_model_add_output(m, cls), MPT_ERR_INVALID_ARGUMENT,
                      "is output 0 already", "add_output twice");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg); /* reg leads to no output */
    mpt_model_add_output(m, cls);
    mpt_model_add_output(m, h);
    test_expect_error(quiet, mpt_model_build(m, 8), MPT_ERR_INVALID_ARGUMENT,
                      "'reg' (Dense) leads to none of the 2 outputs", "a head left out");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg); /* one output, not the last layer */
    mpt_model_add_output(m, cls);
    test_expect_error(quiet, mpt_model_build(m, 8), MPT_ERR_INVALID_ARGUMENT,
                      "is not the last layer added", "one output not last");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg);
    in1 = mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1});
    test_expect_error(quiet, mpt_model_add_output(m, in1), MPT_ERR_INVALID_ARGUMENT,
                      "not a layer's output", "add_output(an InputLayer)");
    mpt_model_destroy(m);
    m = two_head_model(quiet, &h, &cls, &reg);
    mpt_model_add_output(m, cls);
    mpt_model_add_output(m, reg);
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_add_output(m, h), MPT_ERR_STATE, "after build",
                      "add_output after build");
    mpt_model_destroy(m);
    {
        int k;
        mpt_node nodes[5];
        mpt_model_create(quiet, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1}, &m);
        for (k = 0; k < 5; k++)
            nodes[k] = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 1});
        for (k = 0; k < 4; k++) mpt_model_add_output(m, nodes[k]);
        test_expect_error(quiet, mpt_model_add_output(m, nodes[4]), MPT_ERR_INVALID_ARGUMENT,
                          "MPT_MAX_OUTPUTS", "a fifth output");
        mpt_model_destroy(m);
    }
}

static void test_bad_compile(void) {
    mpt_node h, cls, reg;
    mpt_model *m = two_head_model(quiet, &h, &cls, &reg), *one = NULL;
    mpt_compile_desc good = {.losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                        {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}};
    mpt_compile_desc d;
    mpt_model_add_output(m, cls);
    mpt_model_add_output(m, reg);
    d = good;
    d.losses[1].type = MPT_LOSS_NONE;
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                      "output 1 ('reg') has no loss", "a missing loss");
    d = good;
    d.metrics = MPT_METRIC_ACCURACY;
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                      "output_metrics[k]", "metrics for several outputs");
    d = good;
    d.output_metrics[1] = MPT_METRIC_PRECISION;
    d.losses[1].type = MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                      "output_metrics[1] ('reg')", "a metric that does not fit its loss");
    d = good;
    d.output_metrics[1] = MPT_METRIC_R2_SCORE;
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_UNSUPPORTED, "r2_score",
                      "r2_score for several outputs");
    d = good;
    d.loss_weights = (const float[]){1.0f, -1.0f};
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                      "loss_weights[1] ('reg') = -1", "a negative weight");
    d = good;
    d.losses[2].type = MPT_LOSS_MEAN_SQUARED_ERROR;
    test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                      "losses[2] is set but the model has 2 outputs", "a loss past the outputs");
    d = good;
    CHECK(mpt_model_compile(m, &d) == MPT_OK, "compile: %s", mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_add_output(m, h), MPT_ERR_STATE, "after compile",
                      "add_output after compile");
    mpt_model_destroy(m);
    one = small_classifier(quiet, &(classifier_desc){.features = F, .hidden = 8, .classes = 4});
    d = good;
    test_expect_error(quiet, mpt_model_compile(one, &d), MPT_ERR_INVALID_ARGUMENT,
                      "for a model of several outputs", "losses on one output");
    memset(&d, 0, sizeof d);
    d.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    d.loss_weights = (const float[]){0.5f};
    test_expect_error(quiet, mpt_model_compile(one, &d), MPT_ERR_INVALID_ARGUMENT,
                      "loss_weights is for a model of several outputs", "loss_weights on one");
    mpt_model_destroy(one);
    { /* four outputs of six metrics each: more log names than mpt_logs holds */
        const int six = MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_MEAN_SQUARED_ERROR |
                        MPT_METRIC_ROOT_MEAN_SQUARED_ERROR |
                        MPT_METRIC_MEAN_ABSOLUTE_PERCENTAGE_ERROR | MPT_METRIC_PRECISION |
                        MPT_METRIC_RECALL;
        int k;
        mpt_model_create(quiet, &(mpt_model_desc){.input_shape = {F}, .input_rank = 1}, &m);
        memset(&d, 0, sizeof d);
        d.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
        for (k = 0; k < 4; k++) {
            mpt_model_add_output(m, mpt_dense(m, mpt_model_input(m),
                                              &(mpt_dense_desc){.units = 1}));
            d.output_metrics[k] = six;
        }
        test_expect_error(quiet, mpt_model_compile(m, &d), MPT_ERR_INVALID_ARGUMENT,
                          "more than MPT_MAX_LOGS", "too many log names");
        d.output_metrics[3] = MPT_METRIC_MEAN_ABSOLUTE_ERROR;
        CHECK(mpt_model_compile(m, &d) == MPT_OK, "compile of four outputs: %s",
              mpt_context_error(quiet));
        mpt_model_destroy(m);
    }
}

static void test_bad_data(void) {
    mpt_model *m = task_model(quiet, MPT_POLICY_FLOAT32, NULL, NULL);
    int64_t sx[2] = {10, F}, sy[1] = {10}, st[2] = {10, 1}, st9[2] = {9, 1}, st2[2] = {10, 2};
    mpt_tensor tx, ty, tt, t9, t2, tbad;
    const mpt_tensor *labels[2], *three[3];
    mpt_dataset *d = NULL;
    mpt_logs logs;
    int32_t big[10];
    int i;
    for (i = 0; i < 10; i++) big[i] = i; /* past the 4 classes */
    mpt_tensor_wrap(quiet, &tx, MPT_FLOAT32, 2, sx, data.x);
    mpt_tensor_wrap(quiet, &ty, MPT_INT32, 1, sy, data.y);
    mpt_tensor_wrap(quiet, &tt, MPT_FLOAT32, 2, st, data.t);
    mpt_tensor_wrap(quiet, &t9, MPT_FLOAT32, 2, st9, data.t);
    mpt_tensor_wrap(quiet, &t2, MPT_FLOAT32, 2, st2, data.x);
    mpt_tensor_wrap(quiet, &tbad, MPT_INT32, 1, sy, big);
    labels[0] = &ty;
    labels[1] = &t9;
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx,
                          .labels = labels, .label_count = 2}, &d),
                      MPT_ERR_SHAPE, "labels[1] (9, 1) has 9 samples", "a label count");
    labels[1] = &tt;
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx, .y = &ty,
                          .labels = labels, .label_count = 2}, &d),
                      MPT_ERR_INVALID_ARGUMENT, "y and labels are both set", "y and labels");
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx,
                          .labels = labels, .label_count = 5}, &d),
                      MPT_ERR_INVALID_ARGUMENT, "label_count 5", "label_count 5");
    /* one label tensor for two outputs */
    d = test_dataset_xy(quiet, data.x, data.y, 10, F);
    test_expect_error(quiet, mpt_model_fit(m, d, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "holds 1 label tensor but the model has 2 outputs", "one label");
    mpt_dataset_destroy(d);
    /* three for two */
    three[0] = &ty;
    three[1] = &tt;
    three[2] = &tt;
    mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx, .labels = three, .label_count = 3}, &d);
    test_expect_error(quiet, mpt_model_evaluate(m, d, NULL, &logs), MPT_ERR_INVALID_ARGUMENT,
                      "holds 3 label tensors", "three labels");
    mpt_dataset_destroy(d);
    /* output 1's targets of the wrong shape */
    labels[1] = &t2;
    mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx, .labels = labels, .label_count = 2},
                       &d);
    test_expect_error(quiet, mpt_model_fit(m, d, NULL), MPT_ERR_SHAPE,
                      "output 1 ('reg'): targets of shape (2,) for a model output of shape (1,)",
                      "output 1's shape");
    mpt_dataset_destroy(d);
    /* output 0's class ids out of range */
    labels[0] = &tbad;
    labels[1] = &tt;
    mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx, .labels = labels, .label_count = 2},
                       &d);
    test_expect_error(quiet, mpt_model_fit(m, d, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "output 0 ('cls'): labels range over 0..9", "output 0's ids");
    mpt_dataset_destroy(d);
    /* class_weight, as Keras, for one output only */
    labels[0] = &ty;
    mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &tx, .labels = labels, .label_count = 2},
                       &d);
    test_expect_error(quiet, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1,
                          .class_weight = (const float[]){1, 1, 1, 1}, .class_weight_count = 4}),
                      MPT_ERR_UNSUPPORTED, "class_weight is for a model of one output",
                      "class_weight");
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}

/* What does not take a model of several outputs yet says so. */
static void test_unsupported(void) {
    mpt_model *m = task_model(quiet, MPT_POLICY_FLOAT32, NULL, NULL);
    mpt_tensor t, x;
    float xs[2 * F] = {0};
    int64_t shape[2] = {2, F};
    int32_t ids[4] = {0}; /* the prompt: read if generate did not refuse first */
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_generate(m, ids, 1, &(mpt_generate_desc){
                                                              .max_new_tokens = 1}, ids),
                      MPT_ERR_UNSUPPORTED, "several outputs", "generate");
    /* a forward and backward by hand: backward's dout refused, compute_loss too */
    mpt_tensor_wrap(quiet, &x, MPT_FLOAT32, 2, shape, xs);
    CHECK(mpt_model_forward(m, &x, 1, &t) == MPT_OK, "forward: %s", mpt_context_error(quiet));
    CHECK(t.rank == 2 && t.shape[1] == CLASSES, "forward gives output 0");
    CHECK(mpt_model_output_at(m, 1, &t) == MPT_OK && t.shape[1] == 1, "output_at(1)");
    test_expect_error(quiet, mpt_model_output_at(m, 2, &t), MPT_ERR_INVALID_ARGUMENT,
                      "output 2 is not one of the model's 2", "output_at(2)");
    test_expect_error(quiet, mpt_model_backward(m, &t, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "mpt_model_output_grad_at", "backward(dout)");
    test_expect_error(quiet, mpt_model_compute_loss(m, &(mpt_loss_desc){
                                                           .type = MPT_LOSS_MEAN_SQUARED_ERROR},
                                                    &t, (double[1]){0}),
                      MPT_ERR_UNSUPPORTED, "outputs", "compute_loss");
    mpt_model_destroy(m);
}

/* ---- the tools around fit: the profiler, TensorBoard, out-of-memory halving -------- */

/* Whether the file at path holds the bytes of text (an event file's tags
   are stored as they are, inside its records). */
static int file_holds(const char *path, const char *text) {
    static char bytes[1 << 20];
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(bytes, 1, sizeof bytes - 1, f) : 0, len = strlen(text), i;
    if (f) fclose(f);
    for (i = 0; i + len <= n; i++)
        if (memcmp(bytes + i, text, len) == 0) return 1;
    return 0;
}

/* The one events file fit wrote into dir (its name: where fit put it). */
static int events_file(const char *dir, char *path, size_t size) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int found = 0;
    while (d && (e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "events.out.tfevents.", 20) == 0) {
            snprintf(path, size, "%s/%s", dir, e->d_name);
            found++;
        }
    if (d) closedir(d);
    return found == 1;
}

/* A profiled fit with TensorBoard's callback: training ends bit for bit
   where the plain fit ends; the per-layer table has a row for each head;
   the events hold each output's loss and metric under Keras' names. */
static void test_profiler_and_tensorboard(void) {
    static float plain_w[1024], profiled_w[1024];
    static char printed[16384];
    static const char *const tags[] = {"epoch_loss", "epoch_cls_loss", "epoch_reg_loss",
                                       "epoch_cls_accuracy", "epoch_reg_mean_absolute_error"};
    mpt_dataset *train = task_dataset(ctx, 0, N_TRAIN, 0);
    mpt_model *plain = task_model(ctx, MPT_POLICY_MIXED_FLOAT16, NULL, NULL);
    mpt_model *profiled = task_model(ctx, MPT_POLICY_MIXED_FLOAT16, NULL, NULL);
    test_text out = {printed, sizeof printed, 0};
    mpt_callback tb;
    mpt_fit_desc f = fit_for(2, 32);
    char profile_dir[600], tb_dir[600], train_dir[700], events[1000];
    size_t k;
    CHECK(mpt_model_fit(plain, train, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    snprintf(profile_dir, sizeof profile_dir, "%s/profile", tmpdir);
    snprintf(tb_dir, sizeof tb_dir, "%s/tb", tmpdir);
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = tb_dir}, &tb) ==
              MPT_OK,
          "tensorboard: %s", mpt_context_error(ctx));
    f.profile_batch[0] = 20;
    f.profile_batch[1] = 40; /* 32 steps an epoch: into the second */
    f.profile_dir = profile_dir;
    f.callbacks = &tb;
    f.n_callbacks = 1;
    f.verbose = 2;
    f.printer = (mpt_printer){test_text_append, &out};
    test_text_clear(&out);
    CHECK(mpt_model_fit(profiled, train, &f) == MPT_OK, "profiled fit: %s",
          mpt_context_error(ctx));
    test_weights_of(plain, plain_w, 1024);
    test_weights_of(profiled, profiled_w, 1024);
    CHECK(memcmp(plain_w, profiled_w, sizeof plain_w) == 0, "profiling changed the weights");
    CHECK(strstr(printed, "\n cls ") || strstr(printed, "\ncls "), "no row for cls in:\n%s",
          printed);
    CHECK(strstr(printed, "\n reg ") || strstr(printed, "\nreg "), "no row for reg in:\n%s",
          printed);
    snprintf(train_dir, sizeof train_dir, "%s/train", tb_dir);
    CHECK(events_file(train_dir, events, sizeof events), "one events file in %s", train_dir);
    for (k = 0; k < sizeof tags / sizeof tags[0]; k++)
        CHECK(file_holds(events, tags[k]), "%s lacks the tag %s", events, tags[k]);
    mpt_callback_destroy(&tb);
    mpt_model_destroy(plain);
    mpt_model_destroy(profiled);
    mpt_dataset_destroy(train);
}

/* fit's out-of-memory recovery plans every output's buffers: a model that
   fits batches of 16 but not 64 is halved twice and ends, bit for bit,
   where a run at 16 ends. */
static void test_out_of_memory_halves(void) {
    static float ref_w[1024], got_w[1024];
    mpt_dataset *train = task_dataset(ctx, 0, N_TRAIN / 4, 0);
    mpt_model *probe = task_model(ctx, MPT_POLICY_FLOAT32, NULL, NULL), *ref, *m;
    mpt_memory_report mem;
    mpt_fit_desc f = fit_for(2, 16);
    CHECK(mpt_model_build(probe, 16) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_memory(probe, &mem);
    ref = task_model(ctx, MPT_POLICY_FLOAT32, NULL, NULL);
    CHECK(mpt_model_fit(ref, train, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    task_memory_limit = mem.total; /* batches of 16 fit exactly; 32 and 64 do not */
    m = task_model(quiet, MPT_POLICY_FLOAT32, NULL, NULL);
    task_memory_limit = 0;
    f.batch_size = 64;
    test_expect_error(quiet, mpt_model_fit(m, train, &f), MPT_ERR_OUT_OF_MEMORY, "memory",
                      "fit at 64 without recovery");
    f.on_out_of_memory = MPT_OOM_HALVE_BATCH;
    CHECK(mpt_model_fit(m, train, &f) == MPT_OK, "fit: %s", mpt_context_error(quiet));
    CHECK(m->max_batch == 16, "halved to 16, not %lld", (long long)m->max_batch);
    test_weights_of(ref, ref_w, 1024);
    test_weights_of(m, got_w, 1024);
    CHECK(memcmp(ref_w, got_w, sizeof ref_w) == 0, "the weights of a run at 16");
    CHECK(history_value(m, "reg_loss", 1) == history_value(ref, "reg_loss", 1) &&
              history_value(m, "cls_accuracy", 1) == history_value(ref, "cls_accuracy", 1),
          "the history of a run at 16: reg_loss %.9g vs %.9g",
          history_value(m, "reg_loss", 1), history_value(ref, "reg_loss", 1));
    mpt_model_destroy(probe);
    mpt_model_destroy(ref);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
}

/* The summary of a model of two outputs: its usual table. */
static void test_model_summary(void) {
    mpt_model *m = task_model(ctx, MPT_POLICY_FLOAT32, NULL, NULL);
    char text[8192];
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_summary(m, text, sizeof text) < sizeof text, "summary too long");
    CHECK(strstr(text, "cls (Dense)") && strstr(text, "reg (Dense)"), "summary: %s", text);
    CHECK(!test_summary_misaligned(text), "summary misaligned: %s", test_summary_misaligned(text));
    mpt_model_destroy(m);
}

static void cases(void) {
    quiet = quiet_ctx();
    make_data();
    TEST_RUN(test_keras_reference);
    test_two_output_gradients();
    TEST_RUN(test_two_heads_learn);
    test_threads_bit_identical();
    TEST_RUN(test_one_output_declared);
    TEST_RUN(test_replicas_match_one);
    TEST_RUN(test_loss_scaling);
    TEST_RUN(test_logs_and_progress);
    TEST_RUN(test_predict_outputs);
    TEST_RUN(test_labels_through_splits);
    TEST_RUN(test_profiler_and_tensorboard);
    TEST_RUN(test_out_of_memory_halves);
    TEST_RUN(test_model_file_round_trip);
    TEST_RUN(test_file_outputs_refused);
    TEST_RUN(test_bad_outputs);
    TEST_RUN(test_bad_compile);
    TEST_RUN(test_bad_data);
    TEST_RUN(test_unsupported);
    TEST_RUN(test_model_summary);
    mpt_context_destroy(quiet);
}

int main(void) {
    test_program p = {"test_outputs", &ctx, 0, quiet_logger, 0, NULL, tmpdir, sizeof tmpdir,
                      "MPT_KEEP_TMP", cases};
    return test_main(&p);
}

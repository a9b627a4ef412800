/* The training loop: fit, evaluate, predict, summary, history, progress
   output; loss scaling through real steps (an overflow skips the step and
   touches no state); bit-identical resume from a checkpoint; bad input;
   and a short real training run on Fashion-MNIST. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;

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
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){n, FEATURES}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){n}, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* Dense(16, relu) -> BatchNormalization -> Dropout -> Dense(3, softmax). */
static mpt_model *blob_model(mpt_policy policy, uint64_t seed) {
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
    CHECK(mpt_model_build(m, 32) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static double history_value(const mpt_model *m, const char *key, int epoch) {
    mpt_history h;
    int k;
    mpt_model_history(m, &h);
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], key) && epoch < h.epochs) return h.values[k][epoch];
    return NAN;
}

/* Every byte of every parameter and optimizer slot. */
static int same_state(const mpt_model *a, const mpt_model *b) {
    int i, s;
    if (a->n_params != b->n_params) return 0;
    for (i = 0; i < a->n_params; i++) {
        const mpt__param *p = &a->params[i], *q = &b->params[i];
        if (memcmp(p->value, q->value, sizeof(float) * (size_t)p->count)) return 0;
        for (s = 0; s < a->n_slots; s++)
            if (p->slot[s] && memcmp(p->slot[s], q->slot[s], sizeof(float) * (size_t)p->count))
                return 0;
    }
    return a->optimizer_steps == b->optimizer_steps && a->loss_scale == b->loss_scale &&
           a->step == b->step;
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

/* ---- the same seed gives the same run; resuming is bit-identical ---------------------- */

static void test_reproducible_and_resumable(void) {
    static float x[N_SYN * FEATURES];
    static int32_t y[N_SYN];
    const char *path = "build/test_train_resume.safetensors";
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
    CHECK(same_state(a, c), "resumed training differs from the straight run");
    CHECK(!same_state(a, b), "two epochs equal three");
    /* the same seed again from scratch: the same run */
    mpt_model_destroy(b);
    b = blob_model(MPT_POLICY_MIXED_FLOAT16, 5);
    CHECK(mpt_model_fit(b, d, &(mpt_fit_desc){.epochs = 3, .batch_size = 32}) == MPT_OK, "fit");
    CHECK(same_state(a, b), "the same seed gave another run");
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
    mpt_status s = mpt__state_push(m);
    if (s == MPT_OK) s = mpt__train_step(m, x, y, &times);
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
static size_t printed_len;
static void capture(void *user, const char *text) {
    size_t n = strlen(text);
    (void)user;
    if (printed_len + n < sizeof printed) {
        memcpy(printed + printed_len, text, n + 1);
        printed_len += n;
    }
}

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
    printed_len = 0;
    printed[0] = 0;
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32, .verbose = 1,
                                              .printer = {capture, NULL}}) == MPT_OK, "fit");
    CHECK(strstr(printed, "Epoch 1/2\n") && strstr(printed, "Epoch 2/2\n"), "epochs:\n%s", printed);
    CHECK(strstr(printed, "7/7 [==============================] - ") &&
              strstr(printed, "/step - loss: ") && strstr(printed, " - accuracy: "),
          "progress:\n%s", printed);
    printed_len = 0;
    printed[0] = 0;
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 32, .verbose = 2,
                                              .printer = {capture, NULL}}) == MPT_OK, "fit");
    CHECK(strstr(printed, "7/7 - ") && !strchr(printed, '['), "verbose 2:\n%s", printed);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
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
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 64}) == MPT_ERR_INVALID_ARGUMENT,
          "batch 64 for a model built for 32 accepted");
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32, .validation_split = 1.5f}) ==
              MPT_ERR_INVALID_ARGUMENT, "validation_split 1.5 accepted");
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.batch_size = 32, .verbose = 3}) ==
              MPT_ERR_INVALID_ARGUMENT, "verbose 3 accepted");
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

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    TEST_RUN(test_fit_learns_and_reports);
    TEST_RUN(test_reproducible_and_resumable);
    TEST_RUN(test_overflow_skips_the_step);
    TEST_RUN(test_default_loss_scale);
    TEST_RUN(test_summary_and_progress);
    TEST_RUN(test_user_callback);
    TEST_RUN(test_steps_allocate_nothing);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_fashion_mnist_short_run);
    mpt_context_destroy(ctx);
    return test_summary("test_train");
}

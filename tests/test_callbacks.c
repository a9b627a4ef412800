/* The built-in callbacks (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint,
   CSVLogger), driven directly with chosen sequences of logs on a small
   built model, as fit would drive them: on_train_begin, on_epoch_end per
   epoch until one sets *stop, on_train_end. Expected epochs and messages
   follow Keras 3's callbacks step by step. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

#include <dirent.h>
#include <sys/stat.h>

static mpt_context *ctx;
static char tmpdir[128];

/* ---- what the callbacks print and log ------------------------------------- */

static char printed[8192];  /* everything the model's printer received */
static int warnings;        /* warnings logged since the last reset     */
static char last_log[1024]; /* the last warning or error                */

static void capture_print(void *user, const char *text) {
    size_t n = strlen(printed);
    (void)user;
    snprintf(printed + n, sizeof printed - n, "%s", text);
}

static void capture_log(void *user, mpt_log_level level, const char *message) {
    (void)user;
    if (level == MPT_LOG_WARNING) warnings++;
    if (level == MPT_LOG_ERROR) count_errors++;
    snprintf(last_log, sizeof last_log, "%s", message);
}

static void reset_capture(void) {
    printed[0] = 0;
    last_log[0] = 0;
    warnings = 0;
    count_errors = 0;
}

/* ---- a small model whose weights the test sets per epoch ------------------ */

#define MAX_EPOCHS 16

/* input 3 -> Dense 4 (relu) -> Dense 2, bfloat16 compute, so that the
   compute copies differ from the float32 values. */
static mpt_model *small_model(void) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1,
                                             .policy = MPT_POLICY_MIXED_BFLOAT16, .seed = 3},
                     &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    if (mpt_model_build(m, 4) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    m->printer.fn = capture_print;
    return m;
}

static int64_t total_weights(const mpt_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < m->n_params; i++) n += m->params[i].count;
    return n;
}

/* Gives every parameter values that identify the epoch (as training would
   change them) and refreshes the compute copies. */
static void set_epoch_weights(mpt_model *m, int epoch) {
    int i;
    int64_t j;
    for (i = 0; i < m->n_params; i++)
        for (j = 0; j < m->params[i].count; j++)
            m->params[i].value[j] = (float)sin(0.37 * epoch + 0.11 * j + i);
    mpt_model_refresh_weights(m);
}

/* All values, in parameter order, into out (total_weights floats). */
static void get_weights(const mpt_model *m, float *out) {
    int i;
    for (i = 0; i < m->n_params; i++) {
        memcpy(out, m->params[i].value, sizeof(float) * (size_t)m->params[i].count);
        out += m->params[i].count;
    }
}

/* Whether each compute copy is the rounding of its value. */
static int compute_copies_match(const mpt_model *m) {
    int i;
    int64_t j;
    for (i = 0; i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        for (j = 0; j < P->count; j++) {
            float c = P->compute_dtype == MPT_BFLOAT16
                          ? mpt_bf16_to_float(((const mpt_bf16 *)P->compute)[j])
                          : ((const float *)P->compute)[j];
            if (c != (float)round_to(P->compute_dtype, P->value[j])) return 0;
        }
    }
    return 1;
}

/* Logs holding one named value. */
static mpt_logs one_log(const char *name, double value) {
    mpt_logs l;
    memset(&l, 0, sizeof l);
    l.count = 1;
    l.names[0] = name;
    l.values[0] = value;
    return l;
}

/* Runs a callback like fit over values[0..n) of `monitor` (epoch e sets
   the weights of epoch e first); returns the epoch that set *stop, or -1.
   lr (if not NULL) receives the model's learning rate after each epoch. */
static int drive(mpt_callback *cb, mpt_model *m, const char *monitor, const double *values, int n,
                 float *lr) {
    int e, stopped = -1;
    mpt_logs logs;
    memset(&logs, 0, sizeof logs);
    if (cb->on_train_begin)
        CHECK(cb->on_train_begin(cb->user_data, m) == MPT_OK, "on_train_begin: %s",
              mpt_context_error(ctx));
    for (e = 0; e < n && stopped < 0; e++) {
        int stop = 0;
        set_epoch_weights(m, e);
        logs = one_log(monitor, values[e]);
        CHECK(cb->on_epoch_end(cb->user_data, m, e, &logs, &stop) == MPT_OK, "on_epoch_end %d: %s",
              e, mpt_context_error(ctx));
        if (lr) lr[e] = m->learning_rate;
        if (stop) stopped = e;
    }
    if (cb->on_train_end)
        CHECK(cb->on_train_end(cb->user_data, m, &logs) == MPT_OK, "on_train_end: %s",
              mpt_context_error(ctx));
    return stopped;
}

/* The epoch at which an EarlyStopping with desc stops on values. */
static int early_stop_epoch(const mpt_early_stopping_desc *d, const char *monitor,
                            const double *values, int n) {
    mpt_callback cb;
    mpt_model *m = small_model();
    int stopped = -2;
    CHECK(m != NULL, "model: %s", mpt_context_error(ctx));
    CHECK(mpt_callback_early_stopping(ctx, d, &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    if (m && cb.user_data) stopped = drive(&cb, m, monitor, values, n, NULL);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
    return stopped;
}

/* ---- EarlyStopping ---------------------------------------------------------- */

typedef struct es_case {
    const char *what;
    mpt_early_stopping_desc desc;
    const char *monitor;
    double values[MAX_EPOCHS];
    int n;
    int want; /* the epoch that stops training; -1: none */
} es_case;

static void test_early_stopping_rules(void) {
    static const es_case cases[] = {
        /* wait grows each epoch without improvement, stop at patience */
        {"patience 2", {.patience = 2}, "val_loss", {1.0, 0.9, 0.95, 0.92, 0.91}, 5, 3},
        {"patience 2, improvement resets the wait", {.patience = 2}, "val_loss",
         {1.0, 0.9, 0.95, 0.8, 0.85, 0.86}, 6, 5},
        {"patience 0 stops at the first epoch without improvement", {0}, "val_loss",
         {1.0, 0.9, 0.8, 0.8}, 4, 3},
        {"equal is no improvement", {.patience = 1}, "val_loss", {0.5, 0.5}, 2, 1},
        {"never worse: never stops", {.patience = 1}, "val_loss", {3, 2, 1, 0.5, 0.25}, 5, -1},
        /* min_delta: current < best - |min_delta| */
        {"min_delta 0.25: 0.75 is not below 1 - 0.25", {.patience = 1, .min_delta = 0.25f},
         "val_loss", {1.0, 0.75}, 2, 1},
        {"min_delta 0.25: 0.5 is", {.patience = 1, .min_delta = 0.25f}, "val_loss",
         {1.0, 0.5, 0.375}, 3, 2},
        {"negative min_delta counts as |min_delta|", {.patience = 1, .min_delta = -0.25f},
         "val_loss", {1.0, 0.75}, 2, 1},
        /* mode */
        {"auto: accuracy is maximised", {.patience = 1, .monitor = "val_accuracy"},
         "val_accuracy", {0.5, 0.6, 0.6}, 3, 2},
        {"auto: accuracy rising never stops", {.patience = 1, .monitor = "val_accuracy"},
         "val_accuracy", {0.5, 0.6, 0.7, 0.8}, 4, -1},
        {"auto: a name ending in loss is minimised", {.patience = 1, .monitor = "my_loss"},
         "my_loss", {1, 0.5, 0.6}, 3, 2},
        {"auto: 'lossy' does not end in loss: maximised", {.patience = 1, .monitor = "lossy"},
         "lossy", {1, 2, 3, 2.5}, 4, 3},
        {"mode min on an accuracy", {.patience = 1, .mode = MPT_MODE_MIN, .monitor = "accuracy"},
         "accuracy", {0.5, 0.6}, 2, 1},
        {"mode max on a loss", {.patience = 1, .mode = MPT_MODE_MAX, .monitor = "loss"}, "loss",
         {0.5, 0.4}, 2, 1},
        {"max mode min_delta 0.25", {.patience = 1, .min_delta = 0.25f, .monitor = "accuracy"},
         "accuracy", {0.25, 0.5, 0.75}, 3, 1},
        /* baseline: an improvement that does not beat it leaves the wait growing,
           and an improving epoch never stops training (Keras 3 returns early) */
        {"baseline not beaten: improving epochs do not stop",
         {.patience = 2, .has_baseline = 1, .baseline = 0.5}, "val_loss", {0.9, 0.8, 0.7, 0.6},
         4, -1},
        {"baseline not beaten: first flat epoch stops (wait 4)",
         {.patience = 2, .has_baseline = 1, .baseline = 0.5}, "val_loss", {0.9, 0.8, 0.7, 0.75},
         4, 3},
        {"same without baseline: wait 1 < 2", {.patience = 2}, "val_loss", {0.9, 0.8, 0.7, 0.75},
         4, -1},
        {"baseline beaten resets the wait", {.patience = 2, .has_baseline = 1, .baseline = 0.5},
         "val_loss", {0.9, 0.4, 0.45, 0.46}, 4, 3},
        {"baseline 0 (a real value, has_baseline) is not beaten by 0.1",
         {.patience = 1, .has_baseline = 1, .baseline = 0}, "val_loss", {0.2, 0.1, 0.15}, 3, 2},
        /* start_from_epoch: earlier epochs are ignored */
        {"start_from_epoch 0: stops at 1", {.patience = 1}, "val_loss", {0.1, 0.1, 0.5, 0.6}, 4,
         1},
        {"start_from_epoch 2: epochs 0, 1 ignored", {.patience = 1, .start_from_epoch = 2},
         "val_loss", {0.1, 0.1, 0.5, 0.6}, 4, 3},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const es_case *c = &cases[i];
        int got;
        test__begin();
        reset_capture();
        got = early_stop_epoch(&c->desc, c->monitor, c->values, c->n);
        CHECK(got == c->want, "stopped at epoch %d, want %d", got, c->want);
        CHECK(warnings == 0, "unexpected warning: %s", last_log);
        test__end("EarlyStopping: %s", c->what);
    }
}

/* The default monitor is val_loss: logs without it warn (as Keras) and do
   nothing; the warning names the monitor and the available keys. */
static void test_early_stopping_missing_monitor(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[4] = {1, 2, 3, 4};
    int stopped;
    reset_capture();
    CHECK(mpt_callback_early_stopping(ctx, NULL, &cb) == MPT_OK, "create with NULL desc");
    stopped = drive(&cb, m, "loss", values, 4, NULL);
    CHECK(stopped == -1, "stopped at %d without its monitor", stopped);
    CHECK(warnings == 4, "%d warnings, want one per epoch", warnings);
    CHECK(strstr(last_log, "`val_loss`") && strstr(last_log, "Available metrics are: loss"),
          "warning: %s", last_log);
    CHECK(count_errors == 0, "errors logged");
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* A NaN is a value, not a missing key: no warning, and (as in Keras) no
   later value improves on a NaN best. */
static void test_early_stopping_nan(void) {
    const double values[3] = {NAN, 0.5, 0.4};
    int got;
    reset_capture();
    got = early_stop_epoch(&(mpt_early_stopping_desc){.patience = 1}, "val_loss", values, 3);
    CHECK(got == 1, "stopped at %d, want 1", got);
    CHECK(warnings == 0, "warning for a NaN value: %s", last_log);
}

/* restore_best_weights: after on_train_end every value equals (memcmp)
   what it was at the best epoch, and the compute copies follow. Keras 3
   restores whether or not the callback stopped training. */
static void check_restore(const double *values, int n, int patience, int want_stop,
                          int want_best, int verbose, const char *want_printed) {
    mpt_callback cb;
    mpt_model *m = small_model();
    float *snap[MAX_EPOCHS], *now;
    int64_t count;
    int e, stopped;
    reset_capture();
    if (!m) {
        CHECK(0, "model: %s", mpt_context_error(ctx));
        return;
    }
    count = total_weights(m);
    for (e = 0; e < n; e++) {
        snap[e] = (float *)malloc(sizeof(float) * (size_t)count);
        set_epoch_weights(m, e);
        get_weights(m, snap[e]);
    }
    now = (float *)malloc(sizeof(float) * (size_t)count);
    CHECK(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){
              .patience = patience, .restore_best_weights = 1, .verbose = verbose},
                                      &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    stopped = drive(&cb, m, "val_loss", values, n, NULL);
    CHECK(stopped == want_stop, "stopped at %d, want %d", stopped, want_stop);
    get_weights(m, now);
    CHECK(memcmp(now, snap[want_best], sizeof(float) * (size_t)count) == 0,
          "weights after on_train_end are not those of epoch %d", want_best);
    CHECK(compute_copies_match(m), "compute copies not refreshed after restoring");
    CHECK(strcmp(printed, want_printed) == 0, "printed \"%s\", want \"%s\"", printed, want_printed);
    /* The same callback, reused: on_train_begin resets everything. */
    printed[0] = 0;
    stopped = drive(&cb, m, "val_loss", values, n, NULL);
    get_weights(m, now);
    CHECK(stopped == want_stop && memcmp(now, snap[want_best], sizeof(float) * (size_t)count) == 0,
          "second run: stopped at %d", stopped);
    CHECK(strcmp(printed, want_printed) == 0, "second run printed \"%s\"", printed);
    mpt_callback_destroy(&cb);
    for (e = 0; e < n; e++) free(snap[e]);
    free(now);
    mpt_model_destroy(m);
}

static void test_early_stopping_restore_best_weights(void) {
    const double stops[4] = {1.0, 0.5, 0.7, 0.8};
    const double runs_out[3] = {1.0, 0.5, 0.7};
    const double first_best[3] = {0.5, 0.6, 0.7};
    check_restore(stops, 4, 2, 3, 1, 1,
                  "Epoch 4: early stopping\n"
                  "Restoring model weights from the end of the best epoch: 2.\n");
    check_restore(runs_out, 3, 5, -1, 1, 1,
                  "Restoring model weights from the end of the best epoch: 2.\n");
    check_restore(first_best, 3, 1, 1, 0, 0, "");
}

/* Without restore_best_weights the weights stay those of the last epoch;
   verbose prints only the stop. */
static void test_early_stopping_no_restore(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[4] = {1.0, 0.5, 0.7, 0.8};
    float *last, *now;
    int64_t count = total_weights(m);
    reset_capture();
    last = (float *)malloc(sizeof(float) * (size_t)count);
    now = (float *)malloc(sizeof(float) * (size_t)count);
    set_epoch_weights(m, 3);
    get_weights(m, last);
    mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.patience = 2, .verbose = 1}, &cb);
    CHECK(drive(&cb, m, "val_loss", values, 4, NULL) == 3, "stop epoch");
    get_weights(m, now);
    CHECK(memcmp(now, last, sizeof(float) * (size_t)count) == 0, "weights changed");
    CHECK(strcmp(printed, "Epoch 4: early stopping\n") == 0, "printed \"%s\"", printed);
    mpt_callback_destroy(&cb);
    free(last);
    free(now);
    mpt_model_destroy(m);
}

/* restore_best_weights needs the model built by on_train_begin. */
static void test_early_stopping_unbuilt_model(void) {
    mpt_callback cb;
    mpt_model *m = NULL;
    reset_capture();
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.restore_best_weights = 1}, &cb);
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_ERR_STATE, "unbuilt model accepted");
    CHECK(strstr(mpt_context_error(ctx), "EarlyStopping") &&
          strstr(mpt_context_error(ctx), "built"), "error: %s", mpt_context_error(ctx));
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* A caller who never calls on_train_begin still gets a weight copy sized
   for the model (no write through a NULL copy). */
static void test_early_stopping_without_train_begin(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    mpt_logs l;
    float *best, *now;
    int64_t count = total_weights(m);
    int stop = 0;
    best = (float *)malloc(sizeof(float) * (size_t)count);
    now = (float *)malloc(sizeof(float) * (size_t)count);
    mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.restore_best_weights = 1}, &cb);
    set_epoch_weights(m, 0);
    get_weights(m, best);
    l = one_log("val_loss", 1);
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &l, &stop) == MPT_OK, "epoch 0");
    set_epoch_weights(m, 1);
    l = one_log("val_loss", 2);
    CHECK(cb.on_epoch_end(cb.user_data, m, 1, &l, &stop) == MPT_OK && stop, "epoch 1");
    CHECK(cb.on_train_end(cb.user_data, m, &l) == MPT_OK, "end");
    get_weights(m, now);
    CHECK(memcmp(now, best, sizeof(float) * (size_t)count) == 0, "not restored");
    mpt_callback_destroy(&cb);
    free(best);
    free(now);
    mpt_model_destroy(m);
}

/* ---- ReduceLROnPlateau -------------------------------------------------------- */

typedef struct rlr_case {
    const char *what;
    mpt_reduce_lr_desc desc;
    const char *monitor;
    double values[MAX_EPOCHS];
    int n;
    float lr0;
    float want[MAX_EPOCHS]; /* the rate after each epoch */
} rlr_case;

/* The rate after one reduction, computed as the callback does. */
#define RED(lr, f) ((float)((double)(float)(lr) * (double)(float)(f)))

static void test_reduce_lr_rules(void) {
    static const rlr_case cases[] = {
        {"patience 2, factor 0.5, flat", {.patience = 2, .factor = 0.5f}, "val_loss",
         {1, 1, 1, 1, 1, 1}, 6, 0.01f,
         {0.01f, 0.01f, RED(0.01f, 0.5f), RED(0.01f, 0.5f), RED(RED(0.01f, 0.5f), 0.5f),
          RED(RED(0.01f, 0.5f), 0.5f)}},
        {"improvements keep the rate", {.patience = 1, .factor = 0.5f}, "val_loss",
         {1, 0.5, 0.25, 0.125}, 4, 0.01f, {0.01f, 0.01f, 0.01f, 0.01f}},
        {"default factor 0.1 and patience 10", {0}, "val_loss",
         {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 12, 0.01f,
         {0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, RED(0.01f, 0.1f),
          RED(0.01f, 0.1f)}},
        {"has_patience lets 0 through: every flat epoch reduces",
         {.has_patience = 1, .factor = 0.5f}, "val_loss", {1, 1, 1}, 3, 1.0f,
         {1.0f, 0.5f, 0.25f}},
        /* default min_delta 1e-4: a drop of 5e-5 is no improvement */
        {"default min_delta 1e-4", {.patience = 1, .factor = 0.5f}, "val_loss",
         {1.0, 0.99995, 0.9998}, 3, 1.0f, {1.0f, 0.5f, 0.5f}},
        {"min_delta 0.25", {.patience = 1, .factor = 0.5f, .min_delta = 0.25f}, "val_loss",
         {1.0, 0.8, 0.74, 0.6}, 4, 1.0f, {1.0f, 0.5f, 0.5f, 0.25f}},
        /* cooldown 2: after a reduction, one epoch does nothing (counter
           2 -> 1, still cooling); the next counts down to 0 and then waits */
        {"cooldown 2, patience 1", {.patience = 1, .factor = 0.5f, .cooldown = 2}, "val_loss",
         {1, 1, 1, 1, 1, 1, 1, 1}, 8, 1.0f,
         {1.0f, 0.5f, 0.5f, 0.25f, 0.25f, 0.125f, 0.125f, 0.0625f}},
        {"cooldown 2, patience 2", {.patience = 2, .factor = 0.5f, .cooldown = 2}, "val_loss",
         {1, 1, 1, 1, 1, 1, 1, 1}, 8, 1.0f,
         {1.0f, 1.0f, 0.5f, 0.5f, 0.5f, 0.25f, 0.25f, 0.25f}},
        /* min_lr: never below it, and no change once there */
        {"min_lr 0.3", {.patience = 1, .factor = 0.5f, .min_lr = 0.3f}, "val_loss",
         {1, 1, 1, 1}, 4, 1.0f, {1.0f, 0.5f, 0.3f, 0.3f}},
        {"rate already at min_lr", {.patience = 1, .factor = 0.5f, .min_lr = 1.0f}, "val_loss",
         {1, 1, 1}, 3, 1.0f, {1.0f, 1.0f, 1.0f}},
        /* mode */
        {"auto: accuracy is maximised", {.patience = 1, .factor = 0.5f,
                                         .monitor = "val_accuracy"}, "val_accuracy",
         {0.5, 0.6, 0.7, 0.6}, 4, 1.0f, {1.0f, 1.0f, 1.0f, 0.5f}},
        {"mode max on a loss", {.patience = 1, .factor = 0.5f, .mode = MPT_MODE_MAX}, "val_loss",
         {0.5, 0.4}, 2, 1.0f, {1.0f, 0.5f}},
        {"monitor loss", {.patience = 1, .factor = 0.5f, .monitor = "loss"}, "loss", {1, 2}, 2,
         1.0f, {1.0f, 0.5f}},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const rlr_case *c = &cases[i];
        mpt_callback cb;
        mpt_model *m = small_model();
        float lr[MAX_EPOCHS];
        int e;
        test__begin();
        reset_capture();
        m->learning_rate = c->lr0;
        CHECK(mpt_callback_reduce_lr_on_plateau(ctx, &c->desc, &cb) == MPT_OK, "create: %s",
              mpt_context_error(ctx));
        CHECK(cb.on_batch_end == NULL && cb.on_epoch_begin == NULL, "unexpected hooks");
        drive(&cb, m, c->monitor, c->values, c->n, lr);
        for (e = 0; e < c->n; e++)
            CHECK(lr[e] == c->want[e], "after epoch %d lr %.9g, want %.9g", e, lr[e], c->want[e]);
        /* reused: on_train_begin resets best, wait and cooldown */
        m->learning_rate = c->lr0;
        drive(&cb, m, c->monitor, c->values, c->n, lr);
        for (e = 0; e < c->n; e++)
            CHECK(lr[e] == c->want[e], "second run: after epoch %d lr %.9g, want %.9g", e, lr[e],
                  c->want[e]);
        CHECK(warnings == 0, "warning: %s", last_log);
        mpt_callback_destroy(&cb);
        mpt_model_destroy(m);
        test__end("ReduceLROnPlateau: %s", c->what);
    }
}

static void test_reduce_lr_messages(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[4] = {1, 1, 1, 1};
    reset_capture();
    m->learning_rate = 0.01f;
    mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.patience = 1, .verbose = 1,
                                                                 .min_lr = 5e-4f}, &cb);
    drive(&cb, m, "val_loss", values, 4, NULL);
    CHECK(strcmp(printed, "Epoch 2: ReduceLROnPlateau reducing learning rate to 0.001.\n"
                          "Epoch 3: ReduceLROnPlateau reducing learning rate to 0.0005.\n") == 0,
          "printed \"%s\"", printed);
    CHECK(m->learning_rate == 5e-4f, "lr %.9g", m->learning_rate);
    /* a missing monitor: a warning, nothing else */
    reset_capture();
    drive(&cb, m, "loss", values, 2, NULL);
    CHECK(warnings == 2 && strstr(last_log, "Learning rate reduction is conditioned on metric "
                                            "`val_loss` which is not available"),
          "warnings %d: %s", warnings, last_log);
    CHECK(printed[0] == 0 && m->learning_rate == 5e-4f, "acted without its monitor");
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* ---- the formatting helpers ---------------------------------------------------- */

static void test_repr(void) {
    static const struct { double v; const char *want; } cases[] = {
        {0.1, "0.1"}, {1.0, "1.0"}, {-2.5, "-2.5"}, {0.0, "0.0"}, {100.0, "100.0"},
        {1e-05, "1e-05"}, {0.0001, "0.0001"}, {1.0 / 3, "0.3333333333333333"},
        {2.0 / 3, "0.6666666666666666"}, {1e16, "1e+16"},
        {1234567890123456.0, "1234567890123456.0"},
        {1.5e-7, "1.5e-07"}, {123.456, "123.456"}, {1e300, "1e+300"}, {5e-324, "5e-324"},
        {0.30000000000000004, "0.30000000000000004"},
    };
    size_t i;
    char buf[40];
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mpt__cb_repr(buf, sizeof buf, cases[i].v, 0);
        CHECK(strcmp(buf, cases[i].want) == 0, "repr(%.17g) = %s, want %s", cases[i].v, buf,
              cases[i].want);
    }
    mpt__cb_repr(buf, sizeof buf, NAN, 0);
    CHECK(strcmp(buf, "nan") == 0, "nan: %s", buf);
    mpt__cb_repr(buf, sizeof buf, -INFINITY, 0);
    CHECK(strcmp(buf, "-inf") == 0, "-inf: %s", buf);
    mpt__cb_repr(buf, sizeof buf, 0.001f, 1);
    CHECK(strcmp(buf, "0.001") == 0, "float32 0.001: %s", buf);
    mpt__cb_repr(buf, sizeof buf, 1e-5f, 1);
    CHECK(strcmp(buf, "1e-05") == 0, "float32 1e-5: %s", buf);
    /* every double reads back exactly */
    test_seed(11);
    for (i = 0; i < 2000; i++) {
        double v = test_uniform(-1, 1) * pow(10.0, test_randint(-30, 30));
        mpt__cb_repr(buf, sizeof buf, v, 0);
        CHECK(strtod(buf, NULL) == v, "repr(%.17g) = %s does not read back", v, buf);
    }
}

static void test_format_path(void) {
    static const struct { const char *pattern; const char *want; } ok[] = {
        {"ckpt-{epoch}.safetensors", "ckpt-7.safetensors"},
        {"ckpt-{epoch:02d}.safetensors", "ckpt-07.safetensors"},
        {"ckpt-{epoch:03}.st", "ckpt-007.st"},
        {"ckpt-{epoch:3d}.st", "ckpt-  7.st"},
        {"m-{epoch:02d}-{val_loss:.2f}.st", "m-07-0.49.st"},
        {"{val_loss}", "0.49"},
        {"{loss:.3e}", "1.250e-03"},
        {"{loss:g}", "0.00125"},
        {"{val_loss:07.3f}", "000.490"},
        {"{epoch:.1f}", "7.0"},
        {"{{epoch}}-{epoch}", "{epoch}-7"},
        {"plain.safetensors", "plain.safetensors"},
        {"a}}b{{", "a}b{"},
    };
    static const char *bad_syntax[] = {"ckpt-{epoch", "ckpt-}x", "{}", "{epoch:x}",
                                       "{epoch:.}", "{epoch:02q}", "{a{b}"};
    mpt_logs logs;
    char out[256];
    size_t i;
    memset(&logs, 0, sizeof logs);
    logs.count = 2;
    logs.names[0] = "loss";
    logs.values[0] = 0.00125;
    logs.names[1] = "val_loss";
    logs.values[1] = 0.49;
    reset_capture();
    for (i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        mpt_status s = mpt__cb_format_path(ctx, ok[i].pattern, 7, &logs, out, sizeof out);
        CHECK(s == MPT_OK && strcmp(out, ok[i].want) == 0, "\"%s\" -> \"%s\" (%s), want \"%s\"",
              ok[i].pattern, s == MPT_OK ? out : "", mpt_context_error(ctx), ok[i].want);
        CHECK(mpt__cb_format_path(ctx, ok[i].pattern, 1, NULL, NULL, 0) == MPT_OK,
              "syntax check rejects \"%s\"", ok[i].pattern);
    }
    for (i = 0; i < sizeof bad_syntax / sizeof bad_syntax[0]; i++) {
        CHECK(mpt__cb_format_path(ctx, bad_syntax[i], 1, NULL, NULL, 0) == MPT_ERR_INVALID_ARGUMENT,
              "syntax check accepts \"%s\"", bad_syntax[i]);
        CHECK(strstr(mpt_context_error(ctx), bad_syntax[i]), "error does not name \"%s\": %s",
              bad_syntax[i], mpt_context_error(ctx));
    }
    CHECK(mpt__cb_format_path(ctx, "{accuracy}", 1, &logs, out, sizeof out) ==
              MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "{accuracy}") &&
              strstr(mpt_context_error(ctx), "loss,val_loss"),
          "unknown key: %s", mpt_context_error(ctx));
    CHECK(mpt__cb_format_path(ctx, "{val_loss:d}", 1, &logs, out, sizeof out) ==
              MPT_ERR_INVALID_ARGUMENT, "'d' for a float accepted");
    CHECK(mpt__cb_format_path(ctx, "{epoch}-long-name", 1, &logs, out, 8) ==
              MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "characters"),
          "overlong path: %s", mpt_context_error(ctx));
}

/* ---- ModelCheckpoint ------------------------------------------------------------ */

static int file_exists(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

static void tmp_path(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", tmpdir, name);
}

/* Loads a weights file into the model and compares it with snap. */
static int file_holds(mpt_model *m, const char *path, const float *snap) {
    int64_t count = total_weights(m);
    float *now = (float *)malloc(sizeof(float) * (size_t)count);
    int same;
    set_epoch_weights(m, 99);
    if (mpt_model_load_weights(m, path) != MPT_OK) {
        free(now);
        return 0;
    }
    get_weights(m, now);
    same = memcmp(now, snap, sizeof(float) * (size_t)count) == 0;
    free(now);
    return same;
}

/* Every epoch saved, to a name with the epoch in it. */
static void test_checkpoint_every_epoch(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[3] = {0.5, 0.6, 0.4};
    char pattern[256], path[256], want[1024];
    int e;
    reset_capture();
    tmp_path(pattern, sizeof pattern, "every-{epoch:02d}.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
              .filepath = pattern, .save_weights_only = 1, .verbose = 1}, &cb) == MPT_OK,
          "create: %s", mpt_context_error(ctx));
    CHECK(cb.on_train_begin == NULL && cb.on_epoch_end != NULL, "hooks");
    drive(&cb, m, "val_loss", values, 3, NULL);
    want[0] = 0;
    for (e = 1; e <= 3; e++) {
        char name[64], line[512];
        snprintf(name, sizeof name, "every-%02d.safetensors", e);
        tmp_path(path, sizeof path, name);
        CHECK(file_exists(path), "%s missing", path);
        snprintf(line, sizeof line, "Epoch %d: saving model to %s\n", e, path);
        strcat(want, line);
    }
    CHECK(strcmp(printed, want) == 0, "printed \"%s\", want \"%s\"", printed, want);
    tmp_path(path, sizeof path, "every-00.safetensors");
    CHECK(!file_exists(path), "an epoch 0 file");
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* save_best_only: only improvements are saved; the messages are Keras'. */
static void test_checkpoint_best_only(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[4] = {0.5, 0.6, 0.4, 0.4};
    float *snap[4];
    char pattern[256], path[256], want[2048];
    int e;
    int64_t count = total_weights(m);
    reset_capture();
    for (e = 0; e < 4; e++) {
        snap[e] = (float *)malloc(sizeof(float) * (size_t)count);
        set_epoch_weights(m, e);
        get_weights(m, snap[e]);
    }
    tmp_path(pattern, sizeof pattern, "best-{epoch}.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
              .filepath = pattern, .save_best_only = 1, .save_weights_only = 1, .verbose = 1},
                                        &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    drive(&cb, m, "val_loss", values, 4, NULL);
    for (e = 1; e <= 4; e++) {
        char name[64];
        snprintf(name, sizeof name, "best-%d.safetensors", e);
        tmp_path(path, sizeof path, name);
        CHECK(file_exists(path) == (e == 1 || e == 3), "%s %s", path,
              file_exists(path) ? "saved" : "missing");
        if (e == 1 || e == 3)
            CHECK(file_holds(m, path, snap[e - 1]), "%s does not hold epoch %d's weights: %s",
                  path, e - 1, mpt_context_error(ctx));
    }
    snprintf(want, sizeof want,
             "Epoch 1: val_loss improved from inf to 0.50000, saving model to "
             "%s/best-1.safetensors\n"
             "Epoch 2: val_loss did not improve from 0.50000\n"
             "Epoch 3: val_loss improved from 0.50000 to 0.40000, saving model to "
             "%s/best-3.safetensors\n"
             "Epoch 4: val_loss did not improve from 0.40000\n", tmpdir, tmpdir);
    CHECK(strcmp(printed, want) == 0, "printed \"%s\", want \"%s\"", printed, want);
    /* Keras keeps best across fits: a second run saves only what beats 0.4 */
    printed[0] = 0;
    drive(&cb, m, "val_loss", values, 4, NULL);
    CHECK(strstr(printed, "Epoch 1: val_loss did not improve from 0.40000\n") == printed,
          "second run printed \"%s\"", printed);
    mpt_callback_destroy(&cb);
    for (e = 0; e < 4; e++) free(snap[e]);
    mpt_model_destroy(m);
}

/* One file, overwritten by each improvement; max mode for an accuracy;
   the full checkpoint (save_weights_only 0). */
static void test_checkpoint_single_file_max_mode(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    const double values[3] = {0.5, 0.75, 0.625};
    float *snap;
    char path[256], want[1024];
    int64_t count = total_weights(m);
    reset_capture();
    snap = (float *)malloc(sizeof(float) * (size_t)count);
    set_epoch_weights(m, 1);
    get_weights(m, snap);
    tmp_path(path, sizeof path, "acc.safetensors");
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}) == MPT_OK, "compile: %s",
          mpt_context_error(ctx));
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
              .filepath = path, .monitor = "val_accuracy", .save_best_only = 1, .verbose = 1},
                                        &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    drive(&cb, m, "val_accuracy", values, 3, NULL);
    CHECK(file_holds(m, path, snap), "%s does not hold epoch 1's weights: %s", path,
          mpt_context_error(ctx));
    snprintf(want, sizeof want,
             "Epoch 1: val_accuracy improved from -inf to 0.50000, saving model to %s\n"
             "Epoch 2: val_accuracy improved from 0.50000 to 0.75000, saving model to %s\n"
             "Epoch 3: val_accuracy did not improve from 0.75000\n", path, path);
    CHECK(strcmp(printed, want) == 0, "printed \"%s\", want \"%s\"", printed, want);
    mpt_callback_destroy(&cb);
    free(snap);
    mpt_model_destroy(m);
}

/* A save that fails ends the epoch with its status; a missing monitor with
   save_best_only warns and saves (Keras 3); an unknown key in the path is
   an error naming it. */
static void test_checkpoint_errors_at_epoch_end(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    mpt_logs logs = one_log("loss", 0.5);
    char path[256], dir[256];
    int stop = 0;
    mpt_status s;
    reset_capture();
    tmp_path(dir, sizeof dir, "gone");
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    tmp_path(path, sizeof path, "gone/x-{epoch}.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
              .filepath = path, .save_weights_only = 1}, &cb) == MPT_OK, "create: %s",
          mpt_context_error(ctx));
    rmdir(dir); /* removed after the check at creation */
    s = cb.on_epoch_end(cb.user_data, m, 0, &logs, &stop);
    CHECK(s != MPT_OK, "saving into a missing directory succeeded");
    CHECK(strstr(mpt_context_error(ctx), "x-1.safetensors"), "error does not name the file: %s",
          mpt_context_error(ctx));
    mpt_callback_destroy(&cb);

    reset_capture();
    tmp_path(path, sizeof path, "nomon.safetensors");
    mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
        .filepath = path, .save_best_only = 1, .save_weights_only = 1}, &cb);
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &logs, &stop) == MPT_OK, "missing monitor: %s",
          mpt_context_error(ctx));
    CHECK(warnings == 1 && strstr(last_log, "val_loss"), "warning: %s", last_log);
    CHECK(file_exists(path), "not saved without its monitor");
    mpt_callback_destroy(&cb);

    reset_capture();
    tmp_path(path, sizeof path, "x-{val_loss:.2f}.safetensors");
    mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
        .filepath = path, .save_weights_only = 1}, &cb);
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &logs, &stop) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "{val_loss}"),
          "unknown key: %s", mpt_context_error(ctx));
    CHECK(stop == 0, "stop set");
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* Whether the test's directory holds a name containing part. */
static int tmpdir_has(const char *part) {
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    int found = 0;
    while (d && (e = readdir(d)) != NULL) found |= strstr(e->d_name, part) != NULL;
    if (d) closedir(d);
    return found;
}

/* A filepath whose directory is missing, or takes no new files (/proc,
   which access() calls writable for root), fails when the callback is
   made, with MPT_ERR_IO naming it, not after the first epoch's training;
   the check leaves no file behind. A directory named by a field can only
   be checked when the epoch ends. */
static void test_checkpoint_path_checked_when_made(void) {
    mpt_callback cb;
    char paths[3][256], path[256];
    int k;
    reset_capture();
    tmp_path(paths[0], sizeof paths[0], "no-such-dir/x-{epoch}.safetensors");
    snprintf(paths[1], sizeof paths[1], "/proc/mpt-ckpt-{epoch}.safetensors");
    snprintf(paths[2], sizeof paths[2], "/proc/no-such-dir/w.safetensors");
    for (k = 0; k < 3; k++) {
        memcpy(path, paths[k], sizeof path); /* both 256 bytes */
        memset(&cb, 0x5a, sizeof cb);
        CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){.filepath = path},
                                            &cb) == MPT_ERR_IO, "%s accepted", path);
        CHECK(strstr(mpt_context_error(ctx), path) && strstr(mpt_context_error(ctx),
                                                               "ModelCheckpoint"),
              "error: %s", mpt_context_error(ctx));
        CHECK(cb.user_data == NULL && cb.on_epoch_end == NULL, "*out not zeroed");
        mpt_callback_destroy(&cb);
    }
    tmp_path(path, sizeof path, "ok-{epoch:02d}.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){.filepath = path},
                                        &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    CHECK(!tmpdir_has(".tmp-") && !tmpdir_has("ok-"), "the check left a file");
    mpt_callback_destroy(&cb);
    tmp_path(path, sizeof path, "run-{epoch}/w.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){.filepath = path},
                                        &cb) == MPT_OK, "a field in the directory: %s",
          mpt_context_error(ctx));
    mpt_callback_destroy(&cb);
}

/* ---- CSVLogger ------------------------------------------------------------------- */

static char *read_file(const char *path) {
    static char buf[8192];
    FILE *f = fopen(path, "rb");
    size_t n;
    buf[0] = 0;
    if (!f) return buf;
    n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Three logs in unsorted order; epoch e's values. */
static mpt_logs csv_logs(int e) {
    static const double loss[3] = {1.25, 0.1, 1.0 / 3};
    mpt_logs l;
    memset(&l, 0, sizeof l);
    l.count = 3;
    l.names[0] = "val_loss";
    l.values[0] = e == 2 ? NAN : 2.0 * (e + 1);
    l.names[1] = "loss";
    l.values[1] = loss[e];
    l.names[2] = "accuracy";
    l.values[2] = e == 1 ? 1e-05 : 0.5;
    return l;
}

/* Runs a CSV logger for epochs [first, first + n) of csv_logs; checks the
   file after each epoch (it is flushed) against want_after[e]. */
static void csv_run(mpt_callback *cb, mpt_model *m, const char *path, int first, int n,
                    const char *const *want_after) {
    int e, stop = 0;
    mpt_logs logs;
    CHECK(cb->on_train_begin(cb->user_data, m) == MPT_OK, "on_train_begin: %s",
          mpt_context_error(ctx));
    for (e = 0; e < n; e++) {
        logs = csv_logs(e);
        CHECK(cb->on_epoch_end(cb->user_data, m, first + e, &logs, &stop) == MPT_OK,
              "on_epoch_end: %s", mpt_context_error(ctx));
        CHECK(strcmp(read_file(path), want_after[e]) == 0, "after epoch %d the file is \"%s\", "
              "want \"%s\"", first + e, read_file(path), want_after[e]);
    }
    CHECK(cb->on_train_end(cb->user_data, m, &logs) == MPT_OK, "on_train_end: %s",
          mpt_context_error(ctx));
}

#define CSV_HEADER "epoch,accuracy,loss,val_loss\n"
#define CSV_ROW0 "0,0.5,1.25,2.0\n"
#define CSV_ROW1 "1,1e-05,0.1,4.0\n"
#define CSV_ROW2 "2,0.5,0.3333333333333333,nan\n"

static void test_csv_logger(void) {
    static const char *const want[3] = {CSV_HEADER CSV_ROW0, CSV_HEADER CSV_ROW0 CSV_ROW1,
                                        CSV_HEADER CSV_ROW0 CSV_ROW1 CSV_ROW2};
    static const char *const appended[2] = {
        CSV_HEADER CSV_ROW0 CSV_ROW1 CSV_ROW2 "3,0.5,1.25,2.0\n",
        CSV_HEADER CSV_ROW0 CSV_ROW1 CSV_ROW2 "3,0.5,1.25,2.0\n4,1e-05,0.1,4.0\n"};
    mpt_callback cb;
    mpt_model *m = small_model();
    char path[256];
    reset_capture();
    tmp_path(path, sizeof path, "log.csv");
    CHECK(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path}, &cb) == MPT_OK,
          "create: %s", mpt_context_error(ctx));
    csv_run(&cb, m, path, 0, 3, want);
    /* not appending: a second fit rewrites the file */
    csv_run(&cb, m, path, 0, 3, want);
    mpt_callback_destroy(&cb);
    /* appending to a non-empty file: no second header */
    CHECK(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path, .append = 1},
                                  &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
    csv_run(&cb, m, path, 3, 2, appended);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

static void test_csv_logger_append_new_and_empty(void) {
    static const char *const want[1] = {CSV_HEADER CSV_ROW0};
    mpt_callback cb;
    mpt_model *m = small_model();
    char path[256];
    FILE *f;
    reset_capture();
    tmp_path(path, sizeof path, "new.csv");
    remove(path);
    mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path, .append = 1}, &cb);
    csv_run(&cb, m, path, 0, 1, want);
    /* an empty file gets the header too */
    f = fopen(path, "wb");
    if (f) fclose(f);
    csv_run(&cb, m, path, 0, 1, want);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* A separator, a missing key ("NA"), a name that needs quoting, and keys
   fixed by the first epoch. */
static void test_csv_logger_separator_and_quoting(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    mpt_logs l;
    char path[256];
    int stop = 0;
    reset_capture();
    tmp_path(path, sizeof path, "semi.csv");
    mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path, .separator = ';'}, &cb);
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK, "begin");
    memset(&l, 0, sizeof l);
    l.count = 3;
    l.names[0] = "b;c";
    l.values[0] = 1;
    l.names[1] = "a\"q";
    l.values[1] = 2;
    l.names[2] = "z";
    l.values[2] = -0.5;
    cb.on_epoch_end(cb.user_data, m, 0, &l, &stop);
    l.count = 2; /* "z" missing, "new" never becomes a column */
    l.names[1] = "new";
    cb.on_epoch_end(cb.user_data, m, 1, &l, &stop);
    cb.on_train_end(cb.user_data, m, &l);
    CHECK(strcmp(read_file(path), "epoch;\"a\"\"q\";\"b;c\";z\n0;2.0;1.0;-0.5\n1;NA;1.0;NA\n") == 0,
          "file \"%s\"", read_file(path));
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* Cannot open: MPT_ERR_IO naming the file; destroy closes a file that
   on_train_end never closed (the leak checker would see it). */
static void test_csv_logger_io(void) {
    mpt_callback cb;
    mpt_model *m = small_model();
    mpt_logs l = one_log("loss", 1);
    char path[256];
    int stop = 0;
    reset_capture();
    tmp_path(path, sizeof path, "no-such-dir/log.csv");
    mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path}, &cb);
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_ERR_IO, "opened %s", path);
    CHECK(strstr(mpt_context_error(ctx), path) && strstr(mpt_context_error(ctx), "CSVLogger"),
          "error: %s", mpt_context_error(ctx));
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &l, &stop) == MPT_ERR_STATE,
          "epoch end without a file");
    mpt_callback_destroy(&cb);
    tmp_path(path, sizeof path, "open.csv");
    mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path}, &cb);
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK, "begin");
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &l, &stop) == MPT_OK, "epoch end");
    CHECK(strcmp(read_file(path), "epoch,loss\n0,1.0\n") == 0, "file \"%s\"", read_file(path));
    mpt_callback_destroy(&cb); /* no on_train_end: destroy closes the file */
    mpt_model_destroy(m);
}

/* ---- creation errors and destroy ----------------------------------------------- */

static void expect_bad(mpt_status got, mpt_callback *cb, const char *what, const char *needle) {
    CHECK(got == MPT_ERR_INVALID_ARGUMENT, "%s: status %d", what, (int)got);
    CHECK(strstr(mpt_context_error(ctx), needle), "%s: error \"%s\" lacks \"%s\"", what,
          mpt_context_error(ctx), needle);
    CHECK(cb->user_data == NULL && cb->on_epoch_end == NULL, "%s: *out not zeroed", what);
    mpt_callback_destroy(cb);
}

static void test_bad_descriptors(void) {
    mpt_callback cb;
    char longname[100];
    reset_capture();
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    memset(&cb, 0x5a, sizeof cb);
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.patience = -1}, &cb),
               &cb, "negative patience", "patience -1");
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.start_from_epoch = -2},
                                           &cb), &cb, "negative start_from_epoch", "-2");
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){
                   .mode = (mpt_monitor_mode)7}, &cb), &cb, "bad mode", "mode 7");
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.monitor = ""}, &cb),
               &cb, "empty monitor", "monitor");
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.monitor = longname},
                                           &cb), &cb, "long monitor", longname);
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){
                   .has_baseline = 1, .baseline = NAN}, &cb), &cb, "NaN baseline", "baseline");
    expect_bad(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.min_delta = INFINITY},
                                           &cb), &cb, "infinite min_delta", "min_delta");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.factor = 1}, &cb),
               &cb, "factor 1", "factor 1");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.factor = 1.5f}, &cb),
               &cb, "factor 1.5", "factor 1.5");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.factor = -0.5f},
                                                 &cb), &cb, "negative factor", "factor -0.5");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.factor = NAN}, &cb),
               &cb, "NaN factor", "factor");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.patience = -3}, &cb),
               &cb, "negative patience", "patience -3");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.cooldown = -1}, &cb),
               &cb, "negative cooldown", "cooldown -1");
    expect_bad(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){.min_lr = -1}, &cb),
               &cb, "negative min_lr", "min_lr -1");
    expect_bad(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){0}, &cb), &cb,
               "NULL filepath", "filepath is NULL");
    expect_bad(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){.filepath = ""},
                                             &cb), &cb, "empty filepath", "filepath is empty");
    expect_bad(mpt_callback_model_checkpoint(ctx, NULL, &cb), &cb, "NULL checkpoint desc",
               "filepath is NULL");
    expect_bad(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
                   .filepath = "ckpt-{epoch.st"}, &cb), &cb, "unclosed brace", "ckpt-{epoch.st");
    expect_bad(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
                   .filepath = "c.st", .mode = (mpt_monitor_mode)-1}, &cb), &cb, "bad mode",
               "mode -1");
    expect_bad(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){0}, &cb), &cb,
               "NULL filename", "filename is NULL");
    expect_bad(mpt_callback_csv_logger(ctx, NULL, &cb), &cb, "NULL csv desc", "filename is NULL");
    expect_bad(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = "a.csv",
                                                                   .separator = '"'}, &cb),
               &cb, "quote separator", "separator");
    CHECK(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = "a.csv"}, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "NULL out accepted");
    CHECK(mpt_callback_early_stopping(NULL, NULL, &cb) == MPT_ERR_INVALID_ARGUMENT &&
              cb.user_data == NULL, "NULL ctx accepted");
    CHECK(count_errors >= 22, "only %d errors logged", count_errors);
}

/* destroy takes a zeroed callback, a NULL, and the same one twice. */
static void test_destroy(void) {
    mpt_callback cb, copy, zero;
    mpt_model *m = small_model();
    memset(&zero, 0, sizeof zero);
    mpt_callback_destroy(NULL);
    mpt_callback_destroy(&zero);
    mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){.restore_best_weights = 1}, &cb);
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK, "begin");
    copy = cb;
    mpt_callback_destroy(&cb);
    CHECK(cb.user_data == NULL && cb.on_train_begin == NULL, "not zeroed");
    mpt_callback_destroy(&cb);
    (void)copy; /* destroying `copy` now would be a use after free: not allowed */
    mpt_callback_reduce_lr_on_plateau(ctx, NULL, &cb);
    mpt_callback_destroy(&cb);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* ---- through fit ------------------------------------------------------------------ */

/* EarlyStopping inside mpt_model_fit on the training loss with an
   impossible min_delta: fit stops after epoch 1 (patience 1) and its
   history holds two epochs; the CSV logger saw the same two. */
static void test_through_fit(void) {
    mpt_model *m = small_model();
    mpt_callback cbs[2];
    mpt_dataset *data = NULL;
    mpt_history h;
    float x[16 * 3];
    int32_t y[16];
    int64_t xs[2] = {16, 3}, ys[1] = {16};
    mpt_tensor tx, ty;
    char path[256];
    int i;
    const char *csv;
    reset_capture();
    for (i = 0; i < 48; i++) x[i] = (float)sin(i);
    for (i = 0; i < 16; i++) y[i] = i & 1;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, xs, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1}}) ==
              MPT_OK, "compile: %s", mpt_context_error(ctx));
    tmp_path(path, sizeof path, "fit.csv");
    mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){
        .monitor = "loss", .min_delta = 1000, .patience = 1, .verbose = 1}, &cbs[0]);
    mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path}, &cbs[1]);
    CHECK(mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 10, .batch_size = 4,
                                                 .callbacks = cbs, .n_callbacks = 2,
                                                 .printer = {capture_print, NULL}}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_history(m, &h) == MPT_OK && h.epochs == 2, "history has %d epochs", h.epochs);
    CHECK(strstr(printed, "Epoch 2: early stopping\n") != NULL, "printed \"%s\"", printed);
    csv = read_file(path);
    CHECK(strncmp(csv, "epoch,", 6) == 0 && strstr(csv, "\n0,") && strstr(csv, "\n1,") &&
              !strstr(csv, "\n2,"), "csv \"%s\"", csv);
    mpt_callback_destroy(&cbs[0]);
    mpt_callback_destroy(&cbs[1]);
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
}

static void run_cases(void) {
    test_early_stopping_rules();
    TEST_RUN(test_early_stopping_missing_monitor);
    TEST_RUN(test_early_stopping_nan);
    TEST_RUN(test_early_stopping_restore_best_weights);
    TEST_RUN(test_early_stopping_no_restore);
    TEST_RUN(test_early_stopping_unbuilt_model);
    TEST_RUN(test_early_stopping_without_train_begin);
    test_reduce_lr_rules();
    TEST_RUN(test_reduce_lr_messages);
    TEST_RUN(test_repr);
    TEST_RUN(test_format_path);
    TEST_RUN(test_checkpoint_every_epoch);
    TEST_RUN(test_checkpoint_best_only);
    TEST_RUN(test_checkpoint_single_file_max_mode);
    TEST_RUN(test_checkpoint_errors_at_epoch_end);
    TEST_RUN(test_checkpoint_path_checked_when_made);
    TEST_RUN(test_csv_logger);
    TEST_RUN(test_csv_logger_append_new_and_empty);
    TEST_RUN(test_csv_logger_separator_and_quoting);
    TEST_RUN(test_csv_logger_io);
    TEST_RUN(test_bad_descriptors);
    TEST_RUN(test_destroy);
    TEST_RUN(test_through_fit);
}

int main(void) {
    static const test_program p = {.name = "test_callbacks", .ctx = &ctx, .threads = 2,
                                   .logger = capture_log, .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir, .cases = run_cases};
    return test_main(&p);
}

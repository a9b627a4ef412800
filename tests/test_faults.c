/* Faults the library must survive: every allocation of a save, a load, a
   build, a fit, an evaluate and a predict failing in turn; a process killed
   while it writes a checkpoint; and training resumed from a checkpoint in
   a fresh process, which must end bit for bit where an unbroken run ends.

   The program re-executes itself (through /proc/self/exe) for the
   processes of the resume test: "test_faults resume <phase> <policy> <dir>". */
#define _POSIX_C_SOURCE 200809L /* kill, nanosleep */
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static char dir[64]; /* a fresh directory for this run's files */

/* ---- files ------------------------------------------------------------------- */

static const char *path_of(char *buf, const char *name) {
    snprintf(buf, 256, "%s/%s", dir, name);
    return buf;
}

/* The bytes of a file or of a model's state (malloc'd, not the library's). */
typedef struct blob {
    unsigned char *bytes;
    size_t n;
} blob;

static void blob_put(blob *b, const void *p, size_t n) {
    b->bytes = (unsigned char *)realloc(b->bytes, b->n + n + 1);
    memcpy(b->bytes + b->n, p, n);
    b->n += n;
}

static int blob_same(blob a, blob b) {
    return a.bytes && b.bytes && a.n == b.n && memcmp(a.bytes, b.bytes, a.n) == 0;
}

static blob blob_copy(blob b) {
    blob c = {NULL, 0};
    if (b.bytes) blob_put(&c, b.bytes, b.n);
    return c;
}

static void blob_free(blob *b) {
    free(b->bytes);
    b->bytes = NULL;
    b->n = 0;
}

/* The whole file; bytes NULL if there is none. */
static blob slurp(const char *path) {
    blob b = {NULL, 0};
    unsigned char buf[65536];
    size_t got;
    FILE *f = fopen(path, "rb");
    if (!f) return b;
    blob_put(&b, "", 0);
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) blob_put(&b, buf, got);
    fclose(f);
    return b;
}

static void spit(const char *path, blob b) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(b.bytes, 1, b.n, f);
        fclose(f);
    }
}

/* Files in dir whose name starts with prefix and goes on with ".tmp-"
   (a save's temporary file); prefix "" counts every temporary file. */
static int temporaries(const char *prefix) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    size_t len = strlen(prefix);
    if (!d) return -1;
    while ((e = readdir(d)) != NULL)
        n += strncmp(e->d_name, prefix, len) == 0 && strstr(e->d_name + len, ".tmp-") != NULL;
    closedir(d);
    return n;
}

static double now_seconds(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

/* ---- models and data ------------------------------------------------------------ */

/* Dense -> BatchNormalization -> Dropout -> Dense on 6 features, 3 classes,
   compiled with Adam (and, under mixed_float16, a dynamic loss scale that
   starts far too high and grows every other step, so that steps are
   skipped and the scale moves in a short run). */
static mpt_model *make_model(mpt_context *c, mpt_policy policy, uint64_t seed) {
    mpt_model *m = NULL;
    mpt_compile_desc cd;
    if (mpt_model_create(c, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                              .policy = policy, .seed = seed},
                         &m) != MPT_OK)
        return NULL;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = 1;
    cd.metrics = MPT_METRIC_ACCURACY;
    if (policy == MPT_POLICY_MIXED_FLOAT16) {
        cd.loss_scale.mode = MPT_LOSS_SCALE_DYNAMIC;
        cd.loss_scale.initial_scale = 1048576.0f;
        cd.loss_scale.growth_interval = 2;
    }
    if (mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU}) !=
            MPT_OK ||
        mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0}) != MPT_OK ||
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f}) != MPT_OK ||
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3}) != MPT_OK ||
        mpt_model_compile(m, &cd) != MPT_OK || mpt_model_build(m, 8) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* n samples of 6 features and their class (0..2), fresh random values. */
typedef struct toy_data {
    float x[40 * 6];
    int32_t y[40];
    mpt_tensor tx, ty;
    mpt_dataset *d;
} toy_data;

static mpt_status toy_data_make(mpt_context *c, toy_data *t, int n, uint64_t seed) {
    int i;
    test_seed(seed);
    for (i = 0; i < n * 6; i++) t->x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < n; i++) t->y[i] = (t->x[6 * i] > 0) + (t->x[6 * i + 1] > 0.5f);
    mpt_tensor_wrap(c, &t->tx, MPT_FLOAT32, 2, (int64_t[]){n, 6}, t->x);
    mpt_tensor_wrap(c, &t->ty, MPT_INT32, 1, (int64_t[]){n}, t->y);
    return mpt_dataset_create(c, &(mpt_dataset_desc){.x = &t->tx, .y = &t->ty}, &t->d);
}

/* Everything a load may change: every float32 master (through the public
   API), the compute copies and the optimizer slots, and the training
   scalars (the loss scale, epoch and learning rate through the public API). */
static blob model_state(mpt_model *m) {
    blob b = {NULL, 0};
    int i, k, n = mpt_model_param_count(m);
    float lr = mpt_model_learning_rate(m), scale = mpt_model_loss_scale(m);
    int epoch = mpt_model_epoch(m);
    for (i = 0; i < n; i++) {
        mpt_param_info info;
        const mpt__param *P = &m->params[i];
        if (mpt_model_param(m, i, &info) != MPT_OK) continue;
        blob_put(&b, info.value.data, mpt_tensor_bytes(&info.value));
        blob_put(&b, P->compute, mpt_dtype_size(P->compute_dtype) * (size_t)P->count);
        for (k = 0; k < 2; k++)
            if (P->slot[k]) blob_put(&b, P->slot[k], 4 * (size_t)P->count);
    }
    blob_put(&b, &lr, sizeof lr);
    blob_put(&b, &scale, sizeof scale);
    blob_put(&b, &epoch, sizeof epoch);
    blob_put(&b, &m->optimizer_steps, sizeof m->optimizer_steps);
    blob_put(&b, &m->step, sizeof m->step);
    blob_put(&b, &m->good_steps, sizeof m->good_steps);
    blob_put(&b, &m->skipped_steps, sizeof m->skipped_steps);
    return b;
}

/* ==== 1. every allocation failing in turn ========================================== */

/* The context's allocator: counts the requests and the live blocks (from
   any thread), and refuses request number fail_at. */
static struct {
    pthread_mutex_t mutex;
    long calls;   /* requests so far                     */
    long live;    /* blocks allocated and not yet freed  */
    long fail_at; /* the request to refuse; -1: none     */
    long refused; /* requests refused                    */
} heap = {PTHREAD_MUTEX_INITIALIZER, 0, 0, -1, 0};

static void *fault_alloc(void *user, size_t bytes, size_t alignment) {
    void *p = NULL;
    int refuse;
    (void)user;
    pthread_mutex_lock(&heap.mutex);
    refuse = ++heap.calls == heap.fail_at;
    heap.refused += refuse;
    if (!refuse) p = mpt__default_alloc(NULL, bytes, alignment);
    heap.live += p != NULL;
    pthread_mutex_unlock(&heap.mutex);
    return p;
}

static void fault_free(void *user, void *p) {
    (void)user;
    if (!p) return;
    pthread_mutex_lock(&heap.mutex);
    heap.live--;
    pthread_mutex_unlock(&heap.mutex);
    mpt__default_free(NULL, p);
}

static long heap_read(const long *field) {
    long v;
    pthread_mutex_lock(&heap.mutex);
    v = *field;
    pthread_mutex_unlock(&heap.mutex);
    return v;
}

/* Arms the k-th request from now (k >= 1) to fail; 0 disarms (and keeps
   the count of refusals since the arming). */
static void fail_request(long k) {
    pthread_mutex_lock(&heap.mutex);
    heap.fail_at = k > 0 ? heap.calls + k : -1;
    if (k > 0) heap.refused = 0;
    pthread_mutex_unlock(&heap.mutex);
}

static int warnings; /* warnings the fault context has logged */

static void fault_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    (void)msg;
    warnings += level == MPT_LOG_WARNING;
}

/* What the operations share: a two-thread context on the counting
   allocator, a trained model, another model's files to load, and data. */
typedef struct fixture {
    mpt_context *c;
    mpt_model *m;        /* the model saved, loaded, evaluated, run          */
    toy_data train, val; /* 24 and 8 samples                                 */
    char start[256];     /* m's full checkpoint: where each load test starts */
    char other_w[256];   /* another model's weights                          */
    char other_c[256];   /* another model's full checkpoint                  */
    char target[256];    /* where the save tests write                       */
} fixture;

/* One operation under test. setup and teardown run with no failure armed;
   run is the operation; check looks at its result (k: the failed request,
   0 for the first run, which fails nothing and is the reference). */
typedef struct fault_op {
    const char *name;
    void (*setup)(fixture *fx, long k);
    mpt_status (*run)(fixture *fx);
    void (*check)(fixture *fx, mpt_status s, long k);
    void (*teardown)(fixture *fx);
} fault_op;

/* Fills the context's message with an old one, which the next failure
   must replace entirely. */
static void stale_message(mpt_context *c) {
    size_t n = 0, size = sizeof c->error;
    while (n + 16 < size) n += (size_t)snprintf(c->error + n, size - n, "stale message; ");
}

/* Whether some part of msg (between ": " separators) comes twice. */
static int message_repeats_a_part(const char *msg) {
    char copy[1024], *parts[64], *p = copy;
    int n = 0, i, j;
    snprintf(copy, sizeof copy, "%s", msg);
    while (p && n < 64) {
        char *sep = strstr(p, ": ");
        parts[n++] = p;
        p = sep ? sep + 2 : NULL;
        if (sep) *sep = 0;
    }
    for (i = 0; i < n; i++)
        for (j = i + 1; j < n; j++)
            if (strcmp(parts[i], parts[j]) == 0) return 1;
    return 0;
}

/* A failure's own message: it says what ran out and keeps nothing of the
   old one. */
static int message_is_clean(const char *msg) {
    return (strstr(msg, "memory") || strstr(msg, "allocate")) && !strstr(msg, "stale message") &&
           !message_repeats_a_part(msg);
}

/* Runs op once to count its requests (N), then N more times with request
   k = 1..N refused. Each must fail with MPT_ERR_OUT_OF_MEMORY and a
   message (or succeed, if the refusal was tolerated: check then requires
   the full result, and a warning must say what was given up), and leave
   the live blocks as they were. Should the requests ever come in another
   order or number (from threads), a run whose k-th request never came
   must still give a full result or a clean error. */
static void run_fault_op(fixture *fx, const fault_op *op) {
    long n, k, base, oom = 0, tolerated = 0, unreached = 0;
    mpt_status s;
    test__begin();
    base = heap_read(&heap.live);
    if (op->setup) op->setup(fx, 0);
    n = heap_read(&heap.calls);
    s = op->run(fx);
    n = heap_read(&heap.calls) - n;
    CHECK(s == MPT_OK, "%s without a failure: %s", op->name, mpt_context_error(fx->c));
    op->check(fx, s, 0);
    if (op->teardown) op->teardown(fx);
    CHECK(heap_read(&heap.live) == base, "%s leaves %ld blocks more than it found", op->name,
          heap_read(&heap.live) - base);
    for (k = 1; k <= n; k++) {
        int warned;
        if (op->setup) op->setup(fx, k);
        stale_message(fx->c);
        warned = warnings;
        fail_request(k);
        s = op->run(fx);
        fail_request(0);
        if (s != MPT_OK) {
            oom += s == MPT_ERR_OUT_OF_MEMORY;
            CHECK(s == MPT_ERR_OUT_OF_MEMORY, "%s with request %ld of %ld refused: %s (%s)",
                  op->name, k, n, mpt_status_string(s), mpt_context_error(fx->c));
            CHECK(message_is_clean(mpt_context_error(fx->c)),
                  "%s with request %ld refused: the message is \"%s\"", op->name, k,
                  mpt_context_error(fx->c));
        } else if (heap_read(&heap.refused) == 0) {
            unreached++;
        } else {
            tolerated++;
            CHECK(warnings > warned, "%s with request %ld refused succeeds without a warning",
                  op->name, k);
        }
        op->check(fx, s, k);
        if (op->teardown) op->teardown(fx);
        CHECK(heap_read(&heap.live) == base, "%s with request %ld refused leaves %ld blocks",
              op->name, k, heap_read(&heap.live) - base);
        if (test__current_failed) break;
    }
    test__end("out of memory: each of the %ld allocations of %s refused in turn (%ld gave "
              "out of memory, %ld were tolerated, %ld never came), nothing leaked",
              n, op->name, oom, tolerated, unreached);
}

/* ---- saving --------------------------------------------------------------------- */

/* What request k's run (status s) left, now (a file's bytes, a model's
   whole state), against what was there before it and what the reference
   run (k = 0) left, *done, kept then: the reference run must change
   something (ref: what), a run that succeeds despite a refusal must leave
   exactly *done (ok: what). 1 for a run that failed: the caller checks
   that it left things as they were. */
static int failed_run(blob now, long k, mpt_status s, blob *done, blob before, const char *ref,
                      const char *ok) {
    if (k == 0) {
        blob_free(done);
        *done = blob_copy(now);
        CHECK(done->bytes && !blob_same(*done, before), "%s", ref);
    } else if (s == MPT_OK) {
        CHECK(blob_same(now, *done), "request %ld refused, %s", k, ok);
    }
    return k != 0 && s != MPT_OK;
}

static blob saved_before; /* what is at the target before the save (odd k)     */
static blob saved_after;  /* what the save writes (the reference run's file)   */

/* Odd k: the target holds another model's complete file; even k: nothing. */
static void save_setup(fixture *fx, long k) {
    remove(fx->target);
    if (k % 2 == 1) spit(fx->target, saved_before);
}

static mpt_status save_weights_run(fixture *fx) {
    return mpt_model_save_weights(fx->m, fx->target);
}
static mpt_status save_checkpoint_run(fixture *fx) {
    return mpt_model_save_checkpoint(fx->m, fx->target);
}

static void save_check(fixture *fx, mpt_status s, long k) {
    blob now = slurp(fx->target);
    if (failed_run(now, k, s, &saved_after, saved_before, "the reference save wrote a new file",
                   "save succeeded: the file is the complete new one")) {
        if (k % 2 == 1)
            CHECK(blob_same(now, saved_before),
                  "request %ld refused: the previous file is intact", k);
        else
            CHECK(now.bytes == NULL, "request %ld refused: no file appears where there was none",
                  k);
    }
    CHECK(temporaries("") == 0, "request %ld refused: %d temporary files left", k,
          temporaries(""));
    blob_free(&now);
}

/* ---- loading -------------------------------------------------------------------- */

static blob state_before, state_loaded;

static void load_setup(fixture *fx, long k) {
    (void)k;
    CHECK(mpt_model_load_checkpoint(fx->m, fx->start) == MPT_OK, "reset: %s",
          mpt_context_error(fx->c));
    blob_free(&state_before);
    state_before = model_state(fx->m);
}

static mpt_status load_weights_run(fixture *fx) {
    return mpt_model_load_weights(fx->m, fx->other_w);
}
static mpt_status load_checkpoint_run(fixture *fx) {
    return mpt_model_load_checkpoint(fx->m, fx->other_c);
}

static void load_check(fixture *fx, mpt_status s, long k) {
    blob now = model_state(fx->m);
    if (failed_run(now, k, s, &state_loaded, state_before, "the reference load changed the model",
                   "load succeeded: fully loaded"))
        CHECK(blob_same(now, state_before), "request %ld refused: the model is exactly as before "
              "(masters, compute copies, optimizer slots, training scalars)", k);
    blob_free(&now);
}

/* ---- building ------------------------------------------------------------------- */

static mpt_model *built; /* the model the build tests make */

/* The layers of the models built here, after the first failure s (if any)
   none: Dense(16, relu) → BatchNormalization (→ Dropout(0.25)) → Dense(3). */
static mpt_status add_layers(mpt_model *m, mpt_status s, int dropout) {
    if (s == MPT_OK)
        s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    if (s == MPT_OK) s = mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    if (s == MPT_OK && dropout) s = mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    return s;
}

static mpt_status build_run(fixture *fx, int compile_first) {
    mpt_compile_desc cd;
    mpt_status s;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = 1;
    built = NULL;
    s = mpt_model_create(fx->c, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                                  .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 3},
                         &built);
    s = add_layers(built, s, 1);
    if (s == MPT_OK && compile_first) s = mpt_model_compile(built, &cd);
    if (s == MPT_OK) s = mpt_model_build(built, 8);
    if (s == MPT_OK && !compile_first) s = mpt_model_compile(built, &cd);
    return s;
}

static mpt_status build_compiled_run(fixture *fx) { return build_run(fx, 1); }
static mpt_status compile_built_run(fixture *fx) { return build_run(fx, 0); }

/* After a failed step the same model must still be usable: what did not
   happen can be done again, and the model then trains. */
static void build_check(fixture *fx, mpt_status s, long k) {
    mpt_compile_desc cd;
    mpt_status again = MPT_OK;
    (void)s;
    if (!built) return; /* mpt_model_create itself failed */
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = 1;
    if (mpt_model_layer_count(built) < 4) return; /* adding a layer failed: nothing to build */
    if (!built->compiled) again = mpt_model_compile(built, &cd);
    if (again == MPT_OK && !built->built) again = mpt_model_build(built, 8);
    CHECK(again == MPT_OK, "request %ld refused: compile or build again: %s", k,
          mpt_context_error(fx->c));
    if (again == MPT_OK)
        again = mpt_model_fit(built, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8});
    CHECK(again == MPT_OK, "request %ld refused: the model then trains: %s", k,
          mpt_context_error(fx->c));
    CHECK(built->optimizer_steps > 0, "request %ld refused: the model then takes steps "
          "(%lld optimizer steps)", k, (long long)built->optimizer_steps);
}

static void build_teardown(fixture *fx) {
    (void)fx;
    mpt_model_destroy(built);
    built = NULL;
}

/* ---- fit ------------------------------------------------------------------------- */

static mpt_model *fitted;
static blob fit_result; /* the reference run's final state */

static void fit_setup(fixture *fx, long k) {
    (void)k;
    fitted = make_model(fx->c, MPT_POLICY_MIXED_FLOAT16, 7);
    CHECK(fitted && mpt_model_load_checkpoint(fitted, fx->start) == MPT_OK, "fit setup: %s",
          mpt_context_error(fx->c));
}

/* Two epochs with validation data, a ModelCheckpoint saving every epoch
   and a CSVLogger: the callbacks are made inside, so their allocations
   fail too. */
static mpt_status fit_run(fixture *fx) {
    mpt_callback cbs[2];
    char ckpt[256], csv[256];
    mpt_status s;
    memset(cbs, 0, sizeof cbs);
    if (!fitted) return MPT_ERR_STATE;
    s = mpt_callback_model_checkpoint(
        fx->c, &(mpt_model_checkpoint_desc){.filepath = path_of(ckpt, "fit-{epoch}.safetensors")},
        &cbs[0]);
    if (s == MPT_OK)
        s = mpt_callback_csv_logger(fx->c, &(mpt_csv_logger_desc){.filename = path_of(csv,
                                                                                    "fit.csv")},
                                    &cbs[1]);
    if (s == MPT_OK)
        s = mpt_model_fit(fitted, fx->train.d,
                          &(mpt_fit_desc){.epochs = 2, .batch_size = 8,
                                          .validation_data = fx->val.d, .callbacks = cbs,
                                          .n_callbacks = 2});
    mpt_callback_destroy(&cbs[0]);
    mpt_callback_destroy(&cbs[1]);
    return s;
}

/* Three epochs on the first 75% of the data, validated on the rest
   (split inside fit), with EarlyStopping keeping the best weights to
   restore and ReduceLROnPlateau. */
static mpt_status fit_split_run(fixture *fx) {
    mpt_callback cbs[2];
    mpt_status s;
    memset(cbs, 0, sizeof cbs);
    if (!fitted) return MPT_ERR_STATE;
    s = mpt_callback_early_stopping(
        fx->c, &(mpt_early_stopping_desc){.patience = 2, .restore_best_weights = 1}, &cbs[0]);
    if (s == MPT_OK)
        s = mpt_callback_reduce_lr_on_plateau(
            fx->c, &(mpt_reduce_lr_desc){.factor = 0.5f, .has_patience = 1}, &cbs[1]);
    if (s == MPT_OK)
        s = mpt_model_fit(fitted, fx->train.d,
                          &(mpt_fit_desc){.epochs = 3, .batch_size = 8, .validation_split = 0.25f,
                                          .callbacks = cbs, .n_callbacks = 2});
    mpt_callback_destroy(&cbs[0]);
    mpt_callback_destroy(&cbs[1]);
    return s;
}

static void fit_check(fixture *fx, mpt_status s, long k) {
    char p[256];
    blob now;
    if (!fitted) return;
    now = model_state(fitted);
    if (k == 0) {
        blob_free(&fit_result);
        fit_result = model_state(fitted);
    } else if (s == MPT_OK) {
        CHECK(blob_same(now, fit_result), "request %ld refused, fit succeeded: the same "
              "training as without the failure", k);
    }
    blob_free(&now);
    CHECK(temporaries("") == 0, "request %ld refused: %d temporary files left", k,
          temporaries(""));
    s = mpt_model_fit(fitted, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8,
                                                           .validation_data = fx->val.d});
    CHECK(s == MPT_OK, "request %ld refused: the model fits again: %s", k,
          mpt_context_error(fx->c));
    CHECK(mpt_model_save_checkpoint(fitted, path_of(p, "after_fit.safetensors")) == MPT_OK,
          "request %ld refused: the model saves again: %s", k, mpt_context_error(fx->c));
}

static void fit_teardown(fixture *fx) {
    (void)fx;
    mpt_model_destroy(fitted);
    fitted = NULL;
}

/* ---- compiling a trained model again ----------------------------------------------- */

static mpt_compile_desc sgd_momentum(void) {
    mpt_compile_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_SGD;
    cd.optimizer.momentum = 0.9f;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = 1;
    return cd;
}

static mpt_status recompile_run(fixture *fx) {
    mpt_compile_desc cd = sgd_momentum();
    (void)fx;
    return fitted ? mpt_model_compile(fitted, &cd) : MPT_ERR_STATE;
}

/* A compile that failed leaves the model compiled as before or not
   compiled (fit then says so); compiling again works, and it trains. */
static void recompile_check(fixture *fx, mpt_status s, long k) {
    mpt_compile_desc cd = sgd_momentum();
    if (!fitted) return;
    if (s != MPT_OK && !fitted->compiled) {
        CHECK(mpt_model_fit(fitted, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) ==
                      MPT_ERR_STATE &&
                  strstr(mpt_context_error(fx->c), "compile"),
              "request %ld refused: fit on the uncompiled model says so: %s", k,
              mpt_context_error(fx->c));
        CHECK(mpt_model_compile(fitted, &cd) == MPT_OK, "request %ld refused: compile again: %s",
              k, mpt_context_error(fx->c));
    }
    CHECK(mpt_model_fit(fitted, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) ==
              MPT_OK,
          "request %ld refused: the model then trains: %s", k, mpt_context_error(fx->c));
}

/* ---- a mirrored strategy --------------------------------------------------------- */

static mpt_strategy *mirrored;

/* Two replicas in this process: the strategy, the model, its build (the
   second replica's buffers), a fit and a checkpoint's round trip. */
static mpt_status mirrored_run(fixture *fx) {
    char p[256];
    mpt_status s;
    built = NULL;
    mirrored = NULL;
    s = mpt_strategy_create(fx->c, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = 2},
                            &mirrored);
    if (s == MPT_OK)
        s = mpt_model_create(fx->c, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                                      .policy = MPT_POLICY_MIXED_FLOAT16,
                                                      .seed = 3, .strategy = mirrored},
                             &built);
    s = add_layers(built, s, 0);
    if (s == MPT_OK) {
        mpt_compile_desc cd;
        memset(&cd, 0, sizeof cd);
        cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
        cd.loss.from_logits = 1;
        s = mpt_model_compile(built, &cd);
    }
    if (s == MPT_OK) s = mpt_model_build(built, 8);
    if (s == MPT_OK)
        s = mpt_model_fit(built, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8,
                                                              .validation_data = fx->val.d});
    if (s == MPT_OK) s = mpt_model_save_checkpoint(built, path_of(p, "mirrored.safetensors"));
    if (s == MPT_OK) s = mpt_model_load_checkpoint(built, p);
    return s;
}

/* A replicated model that failed to build builds again and trains. */
static void mirrored_check(fixture *fx, mpt_status s, long k) {
    mpt_status again = MPT_OK;
    (void)s;
    CHECK(temporaries("") == 0, "request %ld refused: %d temporary files left", k,
          temporaries(""));
    if (!built || mpt_model_layer_count(built) < 3 || !built->compiled) return;
    if (!built->built) again = mpt_model_build(built, 8);
    if (again == MPT_OK)
        again = mpt_model_fit(built, fx->train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8});
    CHECK(again == MPT_OK && built->n_replicas == 2,
          "request %ld refused: the model then builds and trains on %d replicas: %s", k,
          built->n_replicas, mpt_context_error(fx->c));
}

static void mirrored_teardown(fixture *fx) {
    build_teardown(fx);
    mpt_strategy_destroy(mirrored);
    mirrored = NULL;
}

/* ---- evaluate and predict ------------------------------------------------------ */

static mpt_logs eval_logs, eval_reference;

static mpt_status evaluate_run(fixture *fx) {
    return mpt_model_evaluate(fx->m, fx->val.d, &(mpt_evaluate_desc){.batch_size = 4}, &eval_logs);
}

static void evaluate_check(fixture *fx, mpt_status s, long k) {
    (void)fx;
    if (k == 0) eval_reference = eval_logs;
    if (s == MPT_OK)
        CHECK(eval_logs.count == eval_reference.count &&
                  memcmp(eval_logs.values, eval_reference.values,
                         sizeof(double) * (size_t)eval_logs.count) == 0,
              "request %ld refused, evaluate succeeded: the same loss and accuracy", k);
}

/* Predict and evaluate keep a plan with the model, made the first time
   (@impl-predict: its kernels packed ahead, folds), which the model frees
   with itself: dropped after each run, so that what is counted is what
   the run leaks, and so that each run makes it again and its requests
   are refused in turn too. */
static void plan_teardown(fixture *fx) {
    mpt__predict_plan_free(fx->m);
}

static mpt_tensor predicted;
static blob predict_reference;

static mpt_status predict_run(fixture *fx) {
    return mpt_model_predict(fx->m, fx->val.d, 4, &predicted);
}

static void predict_check(fixture *fx, mpt_status s, long k) {
    blob now = {NULL, 0};
    if (s == MPT_OK) blob_put(&now, predicted.data, mpt_tensor_bytes(&predicted));
    if (k == 0) {
        blob_free(&predict_reference);
        predict_reference = now;
        now.bytes = NULL;
    } else if (s == MPT_OK) {
        CHECK(blob_same(now, predict_reference), "request %ld refused, predict succeeded: the "
              "same outputs", k);
    } else {
        CHECK(predicted.data == NULL, "request %ld refused: predict hands back no tensor", k);
    }
    blob_free(&now);
    mpt_tensor_free(fx->c, &predicted);
}

static void test_out_of_memory(void) {
    static const fault_op ops[] = {
        {"save_weights", save_setup, save_weights_run, save_check, NULL},
        {"save_checkpoint", save_setup, save_checkpoint_run, save_check, NULL},
        {"load_weights", load_setup, load_weights_run, load_check, NULL},
        {"load_checkpoint", load_setup, load_checkpoint_run, load_check, NULL},
        {"create, add, compile, build", NULL, build_compiled_run, build_check, build_teardown},
        {"create, add, build, compile", NULL, compile_built_run, build_check, build_teardown},
        {"fit (2 epochs, validation, ModelCheckpoint, CSVLogger)", fit_setup, fit_run, fit_check,
         fit_teardown},
        {"fit (validation_split, EarlyStopping restoring the best weights, "
         "ReduceLROnPlateau)", fit_setup, fit_split_run, fit_check, fit_teardown},
        {"compile (SGD with momentum) of a model trained with Adam", fit_setup, recompile_run,
         recompile_check, fit_teardown},
        {"mirrored strategy (2 replicas): build, fit, save and load", NULL, mirrored_run,
         mirrored_check, mirrored_teardown},
        {"evaluate", NULL, evaluate_run, evaluate_check, plan_teardown},
        {"predict", NULL, predict_run, predict_check, plan_teardown}};
    fixture fx;
    mpt_context_desc d;
    mpt_model *other;
    size_t i;
    long base = heap_read(&heap.live);
    memset(&fx, 0, sizeof fx);
    memset(&d, 0, sizeof d);
    d.num_threads = 2;
    d.logger.fn = fault_logger;
    d.allocator.alloc = fault_alloc;
    d.allocator.free = fault_free;
    test__begin();
    CHECK(mpt_context_create(&d, &fx.c) == MPT_OK, "context");
    if (!fx.c) return;
    fx.m = make_model(fx.c, MPT_POLICY_MIXED_FLOAT16, 7);
    other = make_model(fx.c, MPT_POLICY_MIXED_FLOAT16, 8);
    CHECK(fx.m && other, "models: %s", mpt_context_error(fx.c));
    CHECK(toy_data_make(fx.c, &fx.train, 24, 1) == MPT_OK &&
              toy_data_make(fx.c, &fx.val, 8, 2) == MPT_OK,
          "data: %s", mpt_context_error(fx.c));
    if (fx.m && other && fx.train.d && fx.val.d) {
        CHECK(mpt_model_fit(fx.m, fx.train.d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) ==
                      MPT_OK &&
                  mpt_model_fit(other, fx.train.d, &(mpt_fit_desc){.epochs = 2, .batch_size = 8}) ==
                      MPT_OK,
              "fit: %s", mpt_context_error(fx.c));
        CHECK(mpt_model_save_checkpoint(fx.m, path_of(fx.start, "start.safetensors")) == MPT_OK &&
                  mpt_model_save_weights(other, path_of(fx.other_w, "other_w.safetensors")) ==
                      MPT_OK &&
                  mpt_model_save_checkpoint(other, path_of(fx.other_c, "other_c.safetensors")) ==
                      MPT_OK,
              "save: %s", mpt_context_error(fx.c));
    }
    path_of(fx.target, "target.safetensors");
    test__end("out of memory: the models and files the tests start from");
    for (i = 0; !test__current_failed && i < sizeof ops / sizeof *ops; i++) {
        if (i < 2) {
            blob_free(&saved_before);
            saved_before = slurp(i == 0 ? fx.other_w : fx.other_c);
        }
        run_fault_op(&fx, &ops[i]);
    }
    blob_free(&saved_before);
    blob_free(&saved_after);
    blob_free(&state_before);
    blob_free(&state_loaded);
    blob_free(&fit_result);
    blob_free(&predict_reference);
    mpt_model_destroy(other);
    mpt_model_destroy(fx.m);
    mpt_dataset_destroy(fx.train.d);
    mpt_dataset_destroy(fx.val.d);
    mpt_context_destroy(fx.c);
    test__begin();
    CHECK(heap_read(&heap.live) == base, "%ld blocks still live after everything was destroyed",
          heap_read(&heap.live) - base);
    test__end("out of memory: every block the context gave out came back");
}

/* ==== 2. a process killed while it saves a checkpoint ================================== */

/* Dense(256) -> Dense(10) on 64 features with Adam: a checkpoint of some
   230 KB, so that a save takes long enough to be killed half-way. */
static mpt_model *make_kill_model(mpt_context *c) {
    mpt_model *m = NULL;
    mpt_compile_desc cd;
    if (mpt_model_create(c, &(mpt_model_desc){.input_shape = {64}, .input_rank = 1, .seed = 5},
                         &m) != MPT_OK)
        return NULL;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = 1;
    if (mpt_model_add_dense(m, &(mpt_dense_desc){.units = 256, .activation = MPT_ACT_RELU}) !=
            MPT_OK ||
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10}) != MPT_OK ||
        mpt_model_compile(m, &cd) != MPT_OK || mpt_model_build(m, 4) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Version v of the model: every master, optimizer slot and counter is a
   function of v, and the first weight is v itself (exact below 2^24). */
static void set_version(mpt_model *m, int64_t v) {
    int i, k;
    int64_t j;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        for (j = 0; j < P->count; j++) {
            P->value[j] = sinf(0.001f * (float)(j + 7 * i) + 0.37f * (float)(v % 1000));
            for (k = 0; k < 2; k++) /* Adam's second moment (slot 1) is never negative */
                if (P->slot[k])
                    P->slot[k][j] = k ? P->value[j] * P->value[j] : P->value[j] + 0.5f;
        }
    }
    m->params[0].value[0] = (float)v;
    m->optimizer_steps = v;
    m->step = (uint64_t)v;
    m->epoch = (int)(v % 1000);
    mpt_model_refresh_weights(m);
}

static int64_t version_of(const mpt_model *m) { return (int64_t)m->params[0].value[0]; }

/* The child: saves versions base + 1, base + 2, ... to path, writing each
   version to fd once its save has returned, until it is killed. */
static void saver_child(int fd, const char *path, int64_t base) {
    mpt_context *c = quiet_ctx();
    mpt_model *m = c ? make_kill_model(c) : NULL;
    int64_t v, failed = -1;
    if (!m || write(fd, "r", 1) != 1) _exit(2);
    for (v = base + 1; v < base + 10000; v++) {
        set_version(m, v);
        if (mpt_model_save_checkpoint(m, path) != MPT_OK) {
            if (write(fd, &failed, sizeof failed) < 0) _exit(4);
            _exit(3);
        }
        if (write(fd, &v, sizeof v) != (ssize_t)sizeof v) _exit(4);
    }
    _exit(0);
}

/* What the parent knows of the file at the path. */
typedef struct kill_tally {
    int64_t on_disk;           /* the version the file holds; 0: no file yet  */
    int kills, saves, absent, earlier, last_done, in_flight;
} kill_tally;

/* The file after a kill: absent only if no save ever completed, else it
   loads and is, bit for bit, the last save that completed or the one the
   child was killed in (renamed into place before it could say so). */
static void check_after_kill(mpt_model *pm, const char *path, const char *ref, int64_t base,
                             int64_t done, kill_tally *t) {
    blob file = slurp(path), want;
    int64_t v, in_flight = (done ? done : base) + 1;
    if (!file.bytes) {
        CHECK(t->on_disk == 0 && done == 0, "the file is gone after version %lld was saved",
              (long long)(done ? done : t->on_disk));
        t->absent++;
        return;
    }
    CHECK(mpt_model_load_checkpoint(pm, path) == MPT_OK, "the file loads after a kill: %s",
          mpt_context_error(pm->ctx));
    v = version_of(pm);
    CHECK(v == in_flight || v == (done ? done : t->on_disk),
          "the file holds version %lld; the last completed save was %lld, the one in flight %lld",
          (long long)v, (long long)(done ? done : t->on_disk), (long long)in_flight);
    set_version(pm, v);
    CHECK(mpt_model_save_checkpoint(pm, ref) == MPT_OK, "reference save: %s",
          mpt_context_error(pm->ctx));
    want = slurp(ref);
    CHECK(blob_same(file, want), "the file is bit for bit the complete save of version %lld",
          (long long)v);
    t->earlier += v != in_flight && !done;
    t->last_done += v != in_flight && done;
    t->in_flight += v == in_flight;
    t->on_disk = v;
    blob_free(&want);
    blob_free(&file);
}

/* A child that saves checkpoints in a loop, killed with SIGKILL after a
   random delay (1 us to 4 saves' time), 150 times or for 25 s. */
static void test_killed_while_saving(void) {
    mpt_context *c = quiet_ctx();
    mpt_model *pm = c ? make_kill_model(c) : NULL;
    char path[256], ref[256];
    kill_tally t;
    double start, save_us, us;
    int run, i, left = -1;
    memset(&t, 0, sizeof t);
    CHECK(pm != NULL, "model: %s", mpt_context_error(c));
    path_of(path, "kill.safetensors");
    path_of(ref, "kill_reference.safetensors");
    start = now_seconds();
    for (i = 0; pm && i < 4; i++) mpt_model_save_checkpoint(pm, ref);
    save_us = 1e6 * (now_seconds() - start) / 4;
    test_seed(17);
    start = now_seconds();
    for (run = 0; pm && run < 150 && now_seconds() - start < 25 && !test__current_failed; run++) {
        int64_t base = (int64_t)(run + 1) * 10000, v, done = 0;
        struct timespec delay;
        int fds[2], status = 0, bad = 0;
        char ready;
        pid_t pid;
        if (pipe(fds) != 0) break;
        fflush(stdout);
        pid = fork();
        if (pid == 0) {
            close(fds[0]);
            saver_child(fds[1], path, base);
        }
        close(fds[1]);
        if (pid < 0 || read(fds[0], &ready, 1) != 1) {
            CHECK(0, "the saving process did not start");
            close(fds[0]);
            if (pid > 0) waitpid(pid, &status, 0);
            break;
        }
        /* log-uniform: as many kills within the first microseconds as in the last ms */
        us = exp(test_uniform(0, log(4 * save_us)));
        delay.tv_sec = (time_t)(us / 1e6);
        delay.tv_nsec = 1000L * ((long)us % 1000000L);
        nanosleep(&delay, NULL);
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        while (read(fds[0], &v, sizeof v) == (ssize_t)sizeof v) {
            bad |= v < 0;
            done = v;
            t.saves++;
        }
        close(fds[0]);
        CHECK(!bad && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "the saving process failed on its own (status 0x%x)", (unsigned)status);
        t.kills++;
        check_after_kill(pm, path, ref, base, done, &t);
    }
    CHECK(t.kills >= 30, "only %d kills in the time allowed", t.kills);
    if (pm) {
        set_version(pm, 42);
        CHECK(mpt_model_save_checkpoint(pm, path) == MPT_OK, "a normal save after the kills: %s",
              mpt_context_error(c));
        /* the killed savers' temporaries are swept by the next save */
        left = temporaries("kill.safetensors");
        CHECK(left == 0, "%d temporary files left after a normal save", left);
        set_version(pm, 7);
        CHECK(mpt_model_load_checkpoint(pm, path) == MPT_OK && version_of(pm) == 42,
              "and it loads: %s", mpt_context_error(c));
    }
    test__end("killed while saving: %d SIGKILLs 1..%.0f us into saves of %.0f us; the file "
              "loads, bit for bit the last save done (%d), the killed one (%d), an earlier "
              "run's (%d), none (%d); %d temporaries left after the next save",
              t.kills, 4 * save_us, save_us, t.last_done, t.in_flight, t.earlier, t.absent, left);
    mpt_model_destroy(pm);
    mpt_context_destroy(c);
}

/* ==== 3. resuming in a fresh process ================================================== */

static const char *const policy_names[3] = {"float32", "mixed_float16", "mixed_bfloat16"};
static const mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                       MPT_POLICY_MIXED_BFLOAT16};

/* One process of the resume test: "straight" trains 4 epochs, "first" 2;
   "rest" loads first's checkpoint into a fresh model and trains epochs 3
   and 4. Each saves its full checkpoint as <where>/<phase>.safetensors.
   Returns the exit status. */
static int resume_phase(const char *phase, const char *policy, const char *where) {
    mpt_context *c = NULL;
    mpt_context_desc d;
    mpt_model *m = NULL;
    toy_data data;
    char in[300], out[300];
    int p, epochs = strcmp(phase, "first") == 0 ? 2 : 4, initial = 0;
    mpt_status s = MPT_ERR_INVALID_ARGUMENT;
    memset(&d, 0, sizeof d);
    memset(&data, 0, sizeof data);
    d.num_threads = 2;
    for (p = 0; p < 3 && strcmp(policy, policy_names[p]) != 0; p++) continue;
    if (p < 3 && mpt_context_create(&d, &c) == MPT_OK) {
        m = make_model(c, policies[p], 21);
        s = m ? toy_data_make(c, &data, 40, 5) : MPT_ERR_STATE;
    }
    if (s == MPT_OK && strcmp(phase, "rest") == 0) {
        snprintf(in, sizeof in, "%s/first.safetensors", where);
        s = mpt_model_load_checkpoint(m, in);
        initial = mpt_model_epoch(m);
    }
    if (s == MPT_OK)
        s = mpt_model_fit(m, data.d, &(mpt_fit_desc){.epochs = epochs, .initial_epoch = initial,
                                                     .batch_size = 8});
    snprintf(out, sizeof out, "%s/%s.safetensors", where, phase);
    if (s == MPT_OK) s = mpt_model_save_checkpoint(m, out);
    if (s != MPT_OK)
        fprintf(stderr, "resume %s %s: %s\n", phase, policy, c ? mpt_context_error(c) : "context");
    mpt_dataset_destroy(data.d);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    return s == MPT_OK ? 0 : 1;
}

/* This program again, as one process of the resume test: its exit status. */
static int run_phase(const char *phase, const char *policy) {
    int status = 0;
    pid_t pid;
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_faults", "resume", phase, policy, dir, (char *)NULL);
        _exit(127);
    }
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void test_resume_across_processes(void) {
    mpt_context *c = quiet_ctx();
    int p;
    for (p = 0; p < 3; p++) {
        char a_path[256], b_path[256], c_path[256];
        blob a, b, resumed;
        mpt_model *straight = make_model(c, policies[p], 21);
        mpt_model *first = make_model(c, policies[p], 21);
        int ra, rb, rc;
        test__begin();
        ra = run_phase("straight", policy_names[p]);
        rb = run_phase("first", policy_names[p]);
        rc = rb == 0 ? run_phase("rest", policy_names[p]) : -1;
        CHECK(ra == 0 && rb == 0 && rc == 0, "the processes exit with %d, %d, %d", ra, rb, rc);
        a = slurp(path_of(a_path, "straight.safetensors"));
        b = slurp(path_of(b_path, "first.safetensors"));
        resumed = slurp(path_of(c_path, "rest.safetensors"));
        CHECK(a.bytes && resumed.bytes && blob_same(a, resumed),
              "the resumed run's checkpoint (masters, BatchNormalization statistics, Adam "
              "moments, step counters, loss scale) is bit for bit the unbroken run's");
        CHECK(straight && first && mpt_model_load_checkpoint(straight, a_path) == MPT_OK &&
                  mpt_model_load_checkpoint(first, b_path) == MPT_OK,
              "load: %s", mpt_context_error(c));
        if (straight && first) {
            CHECK(mpt_model_epoch(first) == 2 && mpt_model_epoch(straight) == 4 &&
                      first->optimizer_steps > 0 &&
                      straight->optimizer_steps > first->optimizer_steps &&
                      memcmp(straight->params[0].value, first->params[0].value,
                             4 * (size_t)first->params[0].count) != 0,
                  "the last two epochs trained (epochs %d, %d; optimizer steps %lld, %lld)",
                  mpt_model_epoch(first), mpt_model_epoch(straight),
                  (long long)first->optimizer_steps, (long long)straight->optimizer_steps);
            if (policies[p] == MPT_POLICY_MIXED_FLOAT16)
                CHECK(first->skipped_steps > 0 && straight->skipped_steps > first->skipped_steps &&
                          mpt_model_loss_scale(first) < 1048576.0f,
                      "the dynamic loss scale skipped steps on both sides of the split (%lld, "
                      "%lld; scale %g at the split)", (long long)first->skipped_steps,
                      (long long)straight->skipped_steps, (double)mpt_model_loss_scale(first));
        }
        test__end("resume across processes, policy %s: 4 epochs in one process == 2 epochs, "
                  "checkpoint, exit, 2 more in a fresh process, bit for bit (loss scale %g, "
                  "%lld steps skipped)", policy_names[p],
                  straight ? (double)mpt_model_loss_scale(straight) : 0.0,
                  straight ? (long long)straight->skipped_steps : 0LL);
        blob_free(&a);
        blob_free(&b);
        blob_free(&resumed);
        mpt_model_destroy(straight);
        mpt_model_destroy(first);
    }
    mpt_context_destroy(c);
}

static void run_cases(void) {
    test_out_of_memory();
    test_killed_while_saving();
    test_resume_across_processes();
}

int main(int argc, char **argv) {
    static const test_program p = {.name = "test_faults", .tmpdir = dir,
                                   .tmpdir_size = sizeof dir, .cases = run_cases};
    if (argc == 5 && strcmp(argv[1], "resume") == 0) return resume_phase(argv[2], argv[3], argv[4]);
    return test_main(&p);
}

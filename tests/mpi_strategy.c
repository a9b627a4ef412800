/* The multi-worker strategy over MPI, on the CPU. Built with
       mpicc -DMPT_MPI tests/mpi_strategy.c -lpthread -lm -lz
   and run by build.sh as
       mpirun -np 2 --oversubscribe ./mpi_strategy SCENARIO
   SCENARIO:
     match    two workers end with identical weights, equal (to 1e-5
              relative norm error) to one process given the global batch,
              while worker 0 shows the progress bar (as examples/mirrored.c);
              with a TensorBoard callback on each, only worker 0 creates
              its log_dir; a model of two outputs as well;
     differ   worker 1 builds another model: both fail, naming worker 1;
     stuck    worker 1 stops answering mid-epoch: worker 0 fails with a
              clear error after the strategy's timeout (2 s) instead of
              waiting forever (then leaves without MPI_Finalize, so that
              mpirun ends the job);
     dies     worker 1 exits mid-epoch: mpirun ends the job (build.sh checks
              that it ends, with an error, within its time limit).
   Worker 0 prints the PASS/FAIL lines; the others' stdout is discarded and
   their results reach worker 0 through MPI. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

static mpt_context *ctx;
static int rank;
static int leave_without_finalize; /* a collective in flight can never complete */

static mpt_dataset *blobs(void) { return blobs_in(ctx); }

/* Dense(units, relu) [-> BatchNormalization (bn 1), synchronized (bn 2)]
   -> Dense(3, softmax). Per-replica statistics make replicas differ from
   one process on the global batch; synchronized ones do not. */
static mpt_model *model(mpt_strategy *s, int64_t units, int bn) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .seed = 5, .strategy = s}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = units, .activation = MPT_ACT_RELU});
    if (bn) mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.synchronized = bn == 2});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = {.learning_rate = 0.05f},
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
        .metrics = MPT_METRIC_ACCURACY});
    return m;
}

static mpt_strategy *workers(double timeout) {
    mpt_strategy *s = NULL;
    mpt_status st = mpt_strategy_create(
        ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MULTI_WORKER, .timeout_seconds = timeout,
                                  .bucket_bytes = 256}, /* several buckets for a small model */
        &s);
    CHECK(st == MPT_OK, "strategy: %s", mpt_context_error(ctx));
    return s;
}

static void discard_text(void *user, const char *text) { (void)user, (void)text; }

/* Two workers, global batch 32 (16 each; the last batch of 8: 4 each):
   identical weights on both, and the same as one process trained on the
   global batch — without BatchNormalization (bn 0) and with a
   synchronized one (bn 2); with gradient accumulation over `accumulate`
   batches (0: none), each worker accumulating the summed gradients. */
static void match(int bn, int accumulate) {
    mpt_strategy *s = workers(60);
    mpt_model *m = model(s, 16, bn), *one = model(NULL, 16, bn);
    mpt_dataset *d = blobs();
    mpt_fit_desc fit;
    mpt_status st;
    uint64_t sum = 0, sums[2] = {0, 0};
    int n = mpt_strategy_num_workers(s);
    if (accumulate) {
        mpt_compile_desc cd = {.optimizer = {.learning_rate = 0.05f,
                                             .gradient_accumulation_steps = accumulate},
                               .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                               .metrics = MPT_METRIC_ACCURACY};
        CHECK(mpt_model_compile(m, &cd) == MPT_OK && mpt_model_compile(one, &cd) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
    }
    memset(&fit, 0, sizeof fit);
    fit.epochs = 3;
    fit.batch_size = 32;
    fit.verbose = 1; /* worker 0 prints a bar: the workers must still sum in step */
    fit.printer.fn = discard_text;
    CHECK(n == 2 && mpt_strategy_num_replicas(s) == 2, "%d workers, %d replicas", n,
          mpt_strategy_num_replicas(s));
    st = mpt_model_fit(m, d, &fit);
    CHECK(st == MPT_OK, "fit: %s", mpt_context_error(ctx));
    if (st == MPT_OK) {
        int i;
        int64_t e;
        for (i = 0; i < m->n_params; i++)
            for (e = 0; e < m->params[i].count; e++) {
                uint32_t bits;
                memcpy(&bits, &m->params[i].value[e], 4);
                sum = mpt__mix64(sum ^ bits);
            }
    }
    MPI_Allgather(&sum, 1, MPI_UINT64_T, sums, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    CHECK(sums[0] == sums[1] && sums[0] != 0, "the workers' weights differ (%llx, %llx)",
          (unsigned long long)sums[0], (unsigned long long)sums[1]);
    if (rank == 0) {
        double diff;
        CHECK(mpt_model_fit(one, d, &fit) == MPT_OK, "fit alone: %s", mpt_context_error(ctx));
        diff = test_weight_diff(m, one);
        printf("# 2 workers vs 1 process (bn %d, accumulating %d): relative norm error of the "
               "weights %.3g\n", bn, accumulate, diff);
        CHECK(diff <= 1e-5, "2 workers vs 1 process (bn %d, accumulating %d): relative norm "
              "error %.3g", bn, accumulate, diff);
        CHECK(m->optimizer_steps == one->optimizer_steps &&
                  m->accumulated_steps == one->accumulated_steps,
              "accumulating %d: %lld updates, %lld in the sum; alone %lld, %lld", accumulate,
              (long long)m->optimizer_steps, (long long)m->accumulated_steps,
              (long long)one->optimizer_steps, (long long)one->accumulated_steps);
    }
    mpt_model_destroy(m);
    mpt_model_destroy(one);
    mpt_dataset_destroy(d);
    mpt_strategy_destroy(s);
}

/* Every worker makes a TensorBoard callback, each here with a log_dir of
   its own so that what each one creates shows: worker 0 creates its
   log_dir and writes train/ there; worker 1 creates nothing. */
static void tensorboard_on_worker_0(void) {
    mpt_strategy *s = workers(60);
    mpt_model *m = model(s, 16, 0);
    mpt_dataset *d = blobs();
    mpt_callback cb;
    mpt_fit_desc fit;
    char base[64], mine_dir[96], log_dir[128], train[160], cmd[96];
    struct stat st;
    int id = (int)getpid(), made[2], all[4] = {0, 0, 0, 0};
    MPI_Bcast(&id, 1, MPI_INT, 0, MPI_COMM_WORLD); /* worker 0's: one base for both */
    snprintf(base, sizeof base, "/tmp/mpt_mpi_tensorboard_%d", id);
    snprintf(mine_dir, sizeof mine_dir, "%s/worker%d", base, rank);
    snprintf(log_dir, sizeof log_dir, "%s/logs", mine_dir);
    snprintf(train, sizeof train, "%s/train", log_dir);
    memset(&cb, 0, sizeof cb);
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = log_dir}, &cb) ==
              MPT_OK, "TensorBoard: %s", mpt_context_error(ctx));
    memset(&fit, 0, sizeof fit);
    fit.epochs = 1;
    fit.batch_size = 32;
    fit.callbacks = &cb;
    fit.n_callbacks = 1;
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    made[0] = stat(mine_dir, &st) == 0;
    made[1] = stat(train, &st) == 0 && S_ISDIR(st.st_mode);
    MPI_Allgather(made, 2, MPI_INT, all, 2, MPI_INT, MPI_COMM_WORLD);
    CHECK(all[0] && all[1] && !all[2] && !all[3],
          "worker 0 made its log_dir: %d, train/: %d; worker 1 made its log_dir: %d, train/: %d",
          all[0], all[1], all[2], all[3]);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_strategy_destroy(s);
    MPI_Barrier(MPI_COMM_WORLD);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    if (rank == 0 && system(cmd) != 0) CHECK(0, "could not remove %s", base);
}

/* r2_score and auc, plain and weighted, in training, validation and
   evaluate on two workers. Every worker validates and evaluates on the
   whole dataset (its replica 0), so its r2_score and auc sums are already
   whole: both workers report the same bits, equal to the metric computed
   from the worker's own predictions (summing the sums over the workers
   would count every sample twice), and close to one process trained on
   the global batch. A binary classifier for auc, a regression for
   r2_score; sample weights 1, 2, 3 in turn. */
static void epoch_metrics(int regression) {
    static float t[N_SYN], w[N_SYN];
    const int bits = regression ? MPT_METRIC_R2_SCORE : MPT_METRIC_AUC;
    const char *key = regression ? "r2_score" : "auc";
    char name[64];
    mpt_strategy *s = workers(60);
    mpt_model *m[2] = {NULL, NULL};
    mpt_dataset *d;
    mpt_tensor tx, ty, p;
    mpt_fit_desc fit;
    mpt_logs logs[2];
    double got[8], all[16], want[2];
    int i, k, plain_weighted;
    for (i = 0; i < N_SYN; i++) {
        t[i] = regression ? blob_x[i * FEATURES] + 0.5f * blob_x[i * FEATURES + 1]
                          : (float)(blob_y[i] == 0);
        w[i] = (float)(1 + i % 3);
    }
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, blob_x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 1, (int64_t[]){N_SYN}, t);
    d = NULL;
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK &&
              mpt_dataset_set_sample_weight(ctx, d, w, N_SYN) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    for (k = 0; k < 2; k++) { /* the workers' model, then one process's */
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .seed = 5, .strategy = k ? NULL : s}, &m[k]);
        mpt_model_add_dense(m[k], &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m[k], &(mpt_dense_desc){
            .units = 1, .activation = regression ? MPT_ACT_NONE : MPT_ACT_SIGMOID});
        CHECK(mpt_model_compile(m[k], &(mpt_compile_desc){
                  .optimizer = {.learning_rate = 0.02f},
                  .loss = {.type = regression ? MPT_LOSS_MEAN_SQUARED_ERROR
                                              : MPT_LOSS_BINARY_CROSSENTROPY},
                  .metrics = bits, .weighted_metrics = bits}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
    }
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = 32;
    fit.validation_split = 0.25f;
    CHECK(mpt_model_fit(m[0], d, &fit) == MPT_OK &&
              mpt_model_evaluate(m[0], d, &(mpt_evaluate_desc){.batch_size = 32}, &logs[0]) ==
                  MPT_OK,
          "fit and evaluate on 2 workers: %s", mpt_context_error(ctx));
    for (plain_weighted = 0; plain_weighted < 2; plain_weighted++) {
        snprintf(name, sizeof name, "%s%s", plain_weighted ? "weighted_" : "", key);
        got[4 * plain_weighted] = history_value(m[0], name, -1);
        got[4 * plain_weighted + 2] = mpt_logs_get(&logs[0], name);
        snprintf(name, sizeof name, "val_%s%s", plain_weighted ? "weighted_" : "", key);
        got[4 * plain_weighted + 1] = history_value(m[0], name, -1);
    }
    /* from this worker's own predictions of every sample */
    memset(&p, 0, sizeof p);
    CHECK(mpt_model_predict(m[0], d, 32, &p) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    for (plain_weighted = 0; p.data && plain_weighted < 2; plain_weighted++) {
        const float *pr = (const float *)p.data, *wt = plain_weighted ? w : NULL;
        if (regression) {
            double sw = 0, sy = 0, ss = 0, res = 0, mean;
            for (i = 0; i < N_SYN; i++) {
                double wi = wt ? wt[i] : 1.0, di = (double)t[i] - (double)pr[i];
                sw += wi, sy += wi * t[i], ss += wi * t[i] * t[i];
                res += wi * di * di;
            }
            mean = sy / sw;
            want[plain_weighted] = 1 - res / (ss - sy * mean);
        } else {
            want[plain_weighted] = auc_direct(pr, t, wt, N_SYN, 1, 0);
        }
        got[4 * plain_weighted + 3] = want[plain_weighted];
        CHECK(fabs(got[4 * plain_weighted + 2] - want[plain_weighted]) <=
                  1e-9 * fabs(want[plain_weighted]),
              "worker %d: evaluate's %s%s %.17g, from its predictions of every sample %.17g",
              rank, plain_weighted ? "weighted_" : "", key, got[4 * plain_weighted + 2],
              want[plain_weighted]);
    }
    mpt_tensor_free(ctx, &p);
    MPI_Allgather(got, 8, MPI_DOUBLE, all, 8, MPI_DOUBLE, MPI_COMM_WORLD);
    CHECK(memcmp(all, all + 8, sizeof got) == 0,
          "%s: the workers differ: %s %.17g / %.17g, val %.17g / %.17g, evaluate %.17g / %.17g",
          key, key, all[0], all[8], all[1], all[9], all[2], all[10]);
    if (rank == 0) {
        mpt_logs one;
        CHECK(mpt_model_fit(m[1], d, &fit) == MPT_OK &&
                  mpt_model_evaluate(m[1], d, &(mpt_evaluate_desc){.batch_size = 32}, &one) ==
                      MPT_OK,
              "fit alone: %s", mpt_context_error(ctx));
        for (plain_weighted = 0; plain_weighted < 2; plain_weighted++) {
            double alone[3];
            snprintf(name, sizeof name, "%s%s", plain_weighted ? "weighted_" : "", key);
            alone[0] = history_value(m[1], name, -1);
            alone[2] = mpt_logs_get(&one, name);
            snprintf(name, sizeof name, "val_%s%s", plain_weighted ? "weighted_" : "", key);
            alone[1] = history_value(m[1], name, -1);
            printf("# %s%s on 2 workers / 1 process: fit %.9f / %.9f, validation %.9f / %.9f, "
                   "evaluate %.9f / %.9f\n", plain_weighted ? "weighted " : "", key,
                   got[4 * plain_weighted], alone[0], got[4 * plain_weighted + 1], alone[1],
                   got[4 * plain_weighted + 2], alone[2]);
            for (i = 0; i < 3; i++)
                CHECK(!isnan(alone[i]) && fabs(got[4 * plain_weighted + i] - alone[i]) <= 1e-4,
                      "%s%s (%s): 2 workers %.9f, 1 process %.9f",
                      plain_weighted ? "weighted " : "", key,
                      i == 0 ? "fit" : i == 1 ? "validation" : "evaluate",
                      got[4 * plain_weighted + i], alone[i]);
        }
    }
    mpt_model_destroy(m[0]);
    mpt_model_destroy(m[1]);
    mpt_dataset_destroy(d);
    mpt_strategy_destroy(s);
}

/* A model of two outputs (a class and a number from one trunk) on two
   workers: identical weights on both, the same as one process trained on
   the global batch (1e-5), and the same per-output logs. */
static void match_two_outputs(void) {
    static float target[N_SYN];
    mpt_strategy *s = workers(60);
    mpt_model *m[2] = {NULL, NULL};
    mpt_dataset *d = NULL;
    mpt_tensor tx, ty, tt;
    const mpt_tensor *labels[2] = {&ty, &tt};
    mpt_fit_desc fit;
    uint64_t sum = 0, sums[2] = {0, 0};
    int i, k;
    for (i = 0; i < N_SYN; i++) target[i] = blob_x[i * FEATURES] * blob_x[i * FEATURES + 1];
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, blob_x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N_SYN}, blob_y);
    mpt_tensor_wrap(ctx, &tt, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, target);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .labels = labels,
                                                      .label_count = 2}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    for (k = 0; k < 2; k++) { /* m[0] on the workers, m[1] alone */
        mpt_node h;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .seed = 5, .strategy = k ? NULL : s}, &m[k]);
        h = mpt_dense(m[k], mpt_model_input(m[k]), &(mpt_dense_desc){.units = 16,
                                                                     .activation = MPT_ACT_RELU});
        mpt_model_add_output(m[k], mpt_dense(m[k], h, &(mpt_dense_desc){
                                                          .name = "cls", .units = CLASSES,
                                                          .activation = MPT_ACT_SOFTMAX}));
        mpt_model_add_output(m[k], mpt_dense(m[k], h, &(mpt_dense_desc){.name = "reg",
                                                                        .units = 1}));
        CHECK(mpt_model_compile(m[k], &(mpt_compile_desc){
                  .optimizer = {.learning_rate = 0.05f},
                  .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                             {.type = MPT_LOSS_MEAN_SQUARED_ERROR}},
                  .loss_weights = (const float[]){1.0f, 0.5f},
                  .output_metrics = {MPT_METRIC_ACCURACY, MPT_METRIC_MEAN_ABSOLUTE_ERROR}}) ==
                  MPT_OK,
              "compile: %s", mpt_context_error(ctx));
    }
    memset(&fit, 0, sizeof fit);
    fit.epochs = 3;
    fit.batch_size = 32;
    CHECK(mpt_model_fit(m[0], d, &fit) == MPT_OK, "fit on two workers: %s",
          mpt_context_error(ctx));
    for (i = 0; i < m[0]->n_params; i++) {
        int64_t e;
        for (e = 0; e < m[0]->params[i].count; e++) {
            uint32_t bits;
            memcpy(&bits, &m[0]->params[i].value[e], 4);
            sum = mpt__mix64(sum ^ bits);
        }
    }
    MPI_Allgather(&sum, 1, MPI_UINT64_T, sums, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    CHECK(sums[0] == sums[1] && sums[0] != 0, "two outputs: the workers' weights differ");
    if (rank == 0) {
        static const char *const keys[] = {"loss", "cls_loss", "reg_loss", "cls_accuracy",
                                           "reg_mean_absolute_error"};
        double diff;
        CHECK(mpt_model_fit(m[1], d, &fit) == MPT_OK, "fit alone: %s", mpt_context_error(ctx));
        diff = test_weight_diff(m[0], m[1]);
        printf("# two outputs, 2 workers vs 1 process: relative norm error of the weights "
               "%.3g\n", diff);
        CHECK(diff <= 1e-5, "two outputs, 2 workers vs 1 process: relative norm error %.3g",
              diff);
        for (k = 0; k < 5; k++) {
            double a = history_value(m[0], keys[k], -1), b = history_value(m[1], keys[k], -1);
            CHECK(fabs(a - b) <= 1e-5 * fabs(b) + 1e-7, "%s: %.9g on 2 workers, %.9g alone",
                  keys[k], a, b);
        }
    }
    mpt_model_destroy(m[0]);
    mpt_model_destroy(m[1]);
    mpt_dataset_destroy(d);
    mpt_strategy_destroy(s);
}

static void test_match(void) {
    match(0, 0);
    match(2, 0);
    tensorboard_on_worker_0();
    match(0, 3);
    epoch_metrics(0);
    epoch_metrics(1);
    match_two_outputs();
}

static void test_differ(void) {
    mpt_context *q = quiet_ctx();
    mpt_context *keep = ctx;
    mpt_strategy *s;
    mpt_model *m;
    mpt_status st;
    int bad[2] = {0, 0}, mine;
    ctx = q;
    s = workers(30);
    m = model(s, rank == 1 ? 17 : 16, 1);
    st = mpt_model_build(m, 32);
    mine = st == MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(q), "worker 1") &&
           strstr(mpt_context_error(q), "different models");
    MPI_Allgather(&mine, 1, MPI_INT, bad, 1, MPI_INT, MPI_COMM_WORLD);
    CHECK(bad[0] && bad[1], "workers with different models: worker 0 %s, worker 1 %s (%s)",
          bad[0] ? "refused" : "accepted", bad[1] ? "refused" : "accepted",
          mpt_context_error(q));
    mpt_model_destroy(m);
    mpt_strategy_destroy(s);
    ctx = keep;
    mpt_context_destroy(q);
}

/* Worker 1 sleeps in a batch callback: worker 0 must give up. */
static mpt_status sleep_on_worker_1(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                                    int *stop) {
    (void)user, (void)m, (void)logs, (void)stop;
    if (rank == 1 && batch == 2) sleep(1000);
    return MPT_OK;
}

static mpt_status exit_on_worker_1(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                                   int *stop) {
    (void)user, (void)m, (void)logs, (void)stop;
    if (rank == 1 && batch == 2) _exit(3);
    return MPT_OK;
}

static void run_until_a_worker_stops(int dies) {
    mpt_context *q = quiet_ctx();
    mpt_context *keep = ctx;
    mpt_strategy *s;
    mpt_model *m;
    mpt_dataset *d;
    mpt_callback cb;
    mpt_fit_desc fit;
    mpt_status st;
    double start;
    ctx = q;
    s = workers(2);
    m = model(s, 16, 1);
    d = blobs();
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = dies ? exit_on_worker_1 : sleep_on_worker_1;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 5;
    fit.batch_size = 32;
    fit.callbacks = &cb;
    fit.n_callbacks = 1;
    start = mpt__now();
    st = mpt_model_fit(m, d, &fit);
    CHECK(st == MPT_ERR_STATE && strstr(mpt_context_error(q), "no answer"),
          "a stuck worker: status %d: %s", (int)st, mpt_context_error(q));
    CHECK(mpt__now() - start < 30, "gave up after %.1f s (timeout 2 s)", mpt__now() - start);
    printf("# gave up after %.1f s: %s\n", mpt__now() - start, mpt_context_error(q));
    ctx = keep;
    leave_without_finalize = 1;
}

static void test_stuck(void) { run_until_a_worker_stops(0); }
static void test_dies(void) { run_until_a_worker_stops(1); }

int main(int argc, char **argv) {
    const char *scenario = argc > 1 ? argv[1] : "match";
    int provided, ok;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) return 1;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &ctx);
    make_blobs();
    if (!strcmp(scenario, "match")) TEST_RUN(test_match);
    else if (!strcmp(scenario, "differ")) TEST_RUN(test_differ);
    else if (!strcmp(scenario, "stuck")) TEST_RUN(test_stuck);
    else if (!strcmp(scenario, "dies")) TEST_RUN(test_dies);
    else fprintf(stderr, "unknown scenario %s\n", scenario);
    ok = test_summary(scenario);
    if (leave_without_finalize) { /* mpirun then ends the other worker */
        fflush(stdout);
        _exit(ok);
    }
    mpt_context_destroy(ctx);
    MPI_Finalize();
    return ok;
}

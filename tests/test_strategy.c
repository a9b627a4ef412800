/* The mirrored strategy on the CPU: N logical replicas against one replica
   with the same global batch, replicas that stay identical, loss scaling
   decided alike everywhere, and bad input. (Several processes under MPI:
   tests/mpi_strategy.c, run by build.sh with mpirun.) */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

static mpt_context *ctx;
static char tmpdir[512]; /* the cases' files: test_main makes it and removes it */

static mpt_dataset *blobs(void) { return blobs_in(ctx); }

/* Dense(16, relu) [-> BatchNormalization -> Dropout (extras 1) or a
   synchronized BatchNormalization (extras 2)] -> Dense(3, softmax). */
static mpt_model *model(mpt_strategy *s, mpt_policy policy, int extras, mpt_optimizer_type opt) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = policy, .seed = 5, .strategy = s}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    if (extras == 1) {
        mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.2f});
    } else if (extras == 2) {
        mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.synchronized = 1});
    }
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = opt, .learning_rate = 0.05f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    return m;
}

/* The last epoch's value of a history key. */
static mpt_strategy *mirrored(int replicas) {
    mpt_strategy *s = NULL;
    CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = replicas}, &s) == MPT_OK,
          "strategy: %s", mpt_context_error(ctx));
    return s;
}

static int replicas_identical(const mpt_model *m) {
    int k;
    for (k = 1; k < m->n_replicas; k++)
        if (memcmp(m->arena[MPT__MEM_PARAMS], m->replica[k]->arena[MPT__MEM_PARAMS],
                   (size_t)m->arena_bytes[MPT__MEM_PARAMS]) ||
            (m->arena_bytes[MPT__MEM_OPTIMIZER] &&
             memcmp(m->arena[MPT__MEM_OPTIMIZER], m->replica[k]->arena[MPT__MEM_OPTIMIZER],
                    (size_t)m->arena_bytes[MPT__MEM_OPTIMIZER])))
            return 0;
    return 1;
}

/* Fits one (a single replica) and many (`replicas` of them) on d, three
   epochs of global batch 32; the relative norm error of many's weights
   against one's. */
static double fit_both(mpt_model *one, mpt_model *many, mpt_dataset *d, int replicas) {
    mpt_fit_desc fit = fit_for(3, 32);
    CHECK(mpt_model_fit(one, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(many, d, &fit) == MPT_OK, "fit %d replicas: %s", replicas,
          mpt_context_error(ctx));
    return test_weight_diff(many, one);
}

/* N replicas, global batch 32 (the epoch's last batch has 8 samples: 2 or
   4 per replica, or 0 for some of 4 in a batch of 2), give after three
   epochs the weights one replica gets with the same global batch. The
   only difference is the order of the float32 additions that sum the
   gradients (per replica, then across replicas, instead of over the whole
   batch): allowed 1e-5 relative norm error, the project's float32
   tolerance (measured: below 1e-6). */
static void test_replicas_match_one(void) {
    int counts[2] = {2, 4}, c, o;
    mpt_optimizer_type opts[2] = {MPT_OPTIMIZER_SGD, MPT_OPTIMIZER_ADAM};
    mpt_dataset *d = blobs();
    for (o = 0; o < 2; o++)
        for (c = 0; c < 2; c++) {
            mpt_strategy *s = mirrored(counts[c]);
            mpt_model *one = model(NULL, MPT_POLICY_FLOAT32, 0, opts[o]);
            mpt_model *many = model(s, MPT_POLICY_FLOAT32, 0, opts[o]);
            double diff = fit_both(one, many, d, counts[c]);
            CHECK(many->n_replicas == counts[c] && mpt_strategy_num_replicas(s) == counts[c],
                  "%d replicas built, %d in the strategy", many->n_replicas,
                  mpt_strategy_num_replicas(s));
            CHECK(diff <= 1e-5, "optimizer %d, %d replicas: relative norm error %.3g",
                  (int)opts[o], counts[c], diff);
            printf("# optimizer %d, %d replicas vs 1: relative norm error of the weights %.3g\n",
                   (int)opts[o], counts[c], diff);
            CHECK(replicas_identical(many), "%d replicas drifted apart", counts[c]);
            CHECK(fabs(history_value(many, "loss", -1) - history_value(one, "loss", -1)) < 1e-5,
                  "%d replicas: loss %.8f, one replica %.8f", counts[c],
                  history_value(many, "loss", -1), history_value(one, "loss", -1));
            CHECK(history_value(many, "accuracy", -1) == history_value(one, "accuracy", -1),
                  "%d replicas: accuracy %.6f, one replica %.6f", counts[c],
                  history_value(many, "accuracy", -1), history_value(one, "accuracy", -1));
            mpt_model_destroy(one);
            mpt_model_destroy(many);
            mpt_strategy_destroy(s);
        }
    mpt_dataset_destroy(d);
}

/* r2_score and auc sum over the replicas as the tallies do: one epoch of
   global batch 32 (the last 8) on 2 replicas gives what one replica
   gives, 1e-9 relative, training and validation alike. A learning rate
   too small to move a float32 weight keeps the outputs the same in both,
   so that only the order of the sums differs. Dense(1, sigmoid) under
   mean squared error, class 1 against the rest. */
static void test_r2_score_and_auc_over_replicas(void) {
    static float t[N_SYN];
    static const char *const keys[4] = {"r2_score", "auc", "val_r2_score", "val_auc"};
    mpt_model *m[2];
    mpt_strategy *s = mirrored(2);
    mpt_dataset *d = NULL;
    mpt_tensor tx, ty;
    int i, k;
    for (i = 0; i < N_SYN; i++) t[i] = blob_y[i] == 1 ? 1.0f : 0.0f;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, blob_x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){N_SYN, 1}, t);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    for (k = 0; k < 2; k++) {
        m[k] = NULL;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                                .seed = 5, .strategy = k ? s : NULL}, &m[k]);
        mpt_model_add_dense(m[k], &(mpt_dense_desc){.units = 1, .activation = MPT_ACT_SIGMOID});
        CHECK(mpt_model_compile(m[k], &(mpt_compile_desc){
                  .optimizer = {.type = MPT_OPTIMIZER_SGD, .learning_rate = 1e-20f},
                  .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
                  .metrics = MPT_METRIC_R2_SCORE | MPT_METRIC_AUC}) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(m[k], d, &(mpt_fit_desc){.epochs = 1, .batch_size = 32,
                                                     .validation_split = 0.2f}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
    }
    for (i = 0; i < 4; i++) {
        double one = history_value(m[0], keys[i], 0), two = history_value(m[1], keys[i], 0);
        CHECK(fabs(two - one) <= 1e-9 * fabs(one) && !isnan(one),
              "%s: 2 replicas %.17g, one %.17g", keys[i], two, one);
    }
    CHECK(history_value(m[0], "auc", 0) > 0.5, "auc %g", history_value(m[0], "auc", 0));
    for (k = 0; k < 2; k++) mpt_model_destroy(m[k]);
    mpt_dataset_destroy(d);
    mpt_strategy_destroy(s);
}

/* A residual graph with a shared layer: h = Dense(16, relu); s = a Dense
   S(16, relu) called twice, S(h) + S(S(h)); a synchronized
   BatchNormalization of Add(s, h); Dense(3, softmax);
   SGD (Adam turns the last bits of the sums' order, in gradients that
   BatchNormalization drives towards zero, into whole steps). */
static mpt_model *graph_model(mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_node h, two[2];
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .seed = 5, .strategy = s}, &m);
    h = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    two[0] = mpt_dense(m, h, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU,
                                               .name = "shared"});
    two[1] = mpt_apply_layer(m, "shared", 1, &two[0]); /* the same weights again */
    two[0] = mpt_add(m, 2, two, NULL);
    two[1] = h;
    h = mpt_batch_normalization(m, mpt_add(m, 2, two, NULL),
                                &(mpt_batchnorm_desc){.synchronized = 1});
    mpt_dense(m, h, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_SGD, .learning_rate = 0.05f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    return m;
}

/* A graph's replicas are the same graph: 2 and 4 of them match one
   replica given the global batch, as a chain's do (1e-5 relative norm
   error), and stay identical. */
static void test_graph_replicas_match_one(void) {
    int counts[2] = {2, 4}, c;
    mpt_dataset *d = blobs();
    for (c = 0; c < 2; c++) {
        mpt_strategy *s = mirrored(counts[c]);
        mpt_model *one = graph_model(NULL), *many = graph_model(s);
        double diff = fit_both(one, many, d, counts[c]);
        CHECK(diff <= 1e-5, "graph, %d replicas: relative norm error %.3g", counts[c], diff);
        printf("# graph, %d replicas vs 1: relative norm error of the weights %.3g\n", counts[c],
               diff);
        CHECK(replicas_identical(many), "%d replicas of a graph drifted apart", counts[c]);
        mpt_model_destroy(one);
        mpt_model_destroy(many);
        mpt_strategy_destroy(s);
    }
    mpt_dataset_destroy(d);
}

/* A synchronized BatchNormalization normalises every replica's rows with
   the global batch's statistics and backpropagates through them, so N
   replicas again match one replica given the global batch (its moving
   statistics too): 1e-5 relative norm error over every parameter. */
static void test_synchronized_batchnorm(void) {
    int counts[2] = {2, 4}, c;
    mpt_dataset *d = blobs();
    for (c = 0; c < 2; c++) {
        mpt_strategy *s = mirrored(counts[c]);
        mpt_model *one = model(NULL, MPT_POLICY_FLOAT32, 2, MPT_OPTIMIZER_ADAM);
        mpt_model *many = model(s, MPT_POLICY_FLOAT32, 2, MPT_OPTIMIZER_ADAM);
        double diff = fit_both(one, many, d, counts[c]);
        printf("# synchronized BatchNormalization, %d replicas vs 1: relative norm error %.3g\n",
               counts[c], diff);
        CHECK(diff <= 1e-5, "%d replicas: relative norm error %.3g", counts[c], diff);
        CHECK(replicas_identical(many), "%d replicas drifted apart", counts[c]);
        mpt_model_destroy(one);
        mpt_model_destroy(many);
        mpt_strategy_destroy(s);
    }
    mpt_dataset_destroy(d);
}

/* With BatchNormalization (per-replica statistics) and Dropout (a mask per
   replica), in mixed_float16: the replicas stay bit-identical, their
   masks differ, and the model learns. */
static void test_replicas_stay_identical(void) {
    mpt_dataset *d = blobs();
    mpt_strategy *s = mirrored(3);
    mpt_model *m = model(s, MPT_POLICY_MIXED_FLOAT16, 1, MPT_OPTIMIZER_ADAM);
    mpt_fit_desc fit;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 5;
    fit.batch_size = 30;
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(replicas_identical(m), "replicas drifted apart");
    CHECK(history_value(m, "accuracy", -1) > 0.9, "accuracy %.3f after 5 epochs",
          history_value(m, "accuracy", -1));
    CHECK(mpt__dropout_key(&m->layers[2], m->replica_index) !=
              mpt__dropout_key(&m->replica[1]->layers[2], m->replica[1]->replica_index),
          "replicas share a dropout key");
    mpt_model_destroy(m);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(d);
}

/* A loss scale that overflows float16 skips the step on every replica:
   the decision is taken on the summed gradients. */
static void test_skips_are_global(void) {
    mpt_dataset *d = blobs();
    mpt_strategy *s = mirrored(2);
    mpt_model *m = model(s, MPT_POLICY_MIXED_FLOAT16, 0, MPT_OPTIMIZER_SGD);
    mpt_fit_desc fit;
    int k;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 1;
    fit.batch_size = 40;
    CHECK(mpt_model_build(m, 40) == MPT_OK, "build: %s", mpt_context_error(ctx));
    m->loss_scale = 1e38f; /* float16 gradients overflow: every step skips until it falls */
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(m->skipped_steps == 5, "%lld of 5 steps skipped", (long long)m->skipped_steps);
    for (k = 1; k < m->n_replicas; k++)
        CHECK(m->replica[k]->skipped_steps == m->skipped_steps &&
                  m->replica[k]->loss_scale == m->loss_scale,
              "replica %d: %lld skipped, scale %g; replica 0: %lld, %g", k,
              (long long)m->replica[k]->skipped_steps, m->replica[k]->loss_scale,
              (long long)m->skipped_steps, m->loss_scale);
    CHECK(replicas_identical(m), "replicas drifted apart");
    mpt_model_destroy(m);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(d);
}

/* Evaluate, predict and checkpoints of a replicated model use replica 0. */
static void test_evaluate_predict_checkpoint(void) {
    char path_buf[600];
    const char *path = test_file_in(path_buf, sizeof path_buf, tmpdir, "test_strategy.safetensors");
    mpt_dataset *d = blobs();
    mpt_strategy *s = mirrored(2);
    mpt_model *m = model(s, MPT_POLICY_FLOAT32, 1, MPT_OPTIMIZER_ADAM);
    mpt_model *single = model(NULL, MPT_POLICY_FLOAT32, 1, MPT_OPTIMIZER_ADAM);
    mpt_fit_desc fit;
    mpt_logs a, b;
    mpt_tensor pa, pb;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = 50;
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save_checkpoint(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(single, 50) == MPT_OK && mpt_model_load_checkpoint(single, path) == MPT_OK,
          "load: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 50}, &a) == MPT_OK &&
              mpt_model_evaluate(single, d, &(mpt_evaluate_desc){.batch_size = 25}, &b) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&a, "accuracy") == mpt_logs_get(&b, "accuracy") &&
              fabs(mpt_logs_get(&a, "loss") - mpt_logs_get(&b, "loss")) < 1e-6,
          "evaluate: %g/%g vs %g/%g", mpt_logs_get(&a, "loss"), mpt_logs_get(&a, "accuracy"),
          mpt_logs_get(&b, "loss"), mpt_logs_get(&b, "accuracy"));
    CHECK(mpt_model_predict(m, d, 50, &pa) == MPT_OK && mpt_model_predict(single, d, 25, &pb) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    CHECK(!memcmp(pa.data, pb.data, mpt_tensor_bytes(&pa)), "predictions differ");
    mpt_tensor_free(ctx, &pa);
    mpt_tensor_free(ctx, &pb);
    remove(path);
    mpt_model_destroy(m);
    mpt_model_destroy(single);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(d);
}

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    mpt_strategy *s = NULL;
    mpt_model *m = NULL;
    mpt_dataset *d = blobs();
    mpt_fit_desc fit;
    mpt_status st;
    st = mpt_strategy_create(q, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                     .num_replicas = MPT__MAX_REPLICAS + 1}, &s);
    CHECK(st == MPT_ERR_INVALID_ARGUMENT && !s && strstr(mpt_context_error(q), "num_replicas 65") &&
              strstr(mpt_context_error(q), "at most 64 replicas"),
          "65 replicas: %d %s", (int)st, mpt_context_error(q));
    st = mpt_strategy_create(q, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                     .devices = (const int[]){0},
                                                     .n_devices = MPT__MAX_REPLICAS + 1}, &s);
    CHECK(st == MPT_ERR_INVALID_ARGUMENT && !s && strstr(mpt_context_error(q), "65 devices") &&
              strstr(mpt_context_error(q), "at most 64 replicas"),
          "65 devices: %d %s", (int)st, mpt_context_error(q));
    st = mpt_strategy_create(q, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                     .num_replicas = MPT__MAX_REPLICAS}, &s);
    CHECK(st == MPT_OK && s && mpt_strategy_num_replicas(s) == MPT__MAX_REPLICAS,
          "64 replicas: %d %s", (int)st, mpt_context_error(q));
    mpt_strategy_destroy(s);
    s = NULL;
    CHECK(mpt_strategy_create(q, &(mpt_strategy_desc){.type = (mpt_strategy_type)7}, &s) ==
              MPT_ERR_INVALID_ARGUMENT,
          "unknown type accepted");
#ifndef MPT_MPI
    st = mpt_strategy_create(q, &(mpt_strategy_desc){.type = MPT_STRATEGY_MULTI_WORKER}, &s);
    CHECK(st == MPT_ERR_UNSUPPORTED && strstr(mpt_context_error(q), "MPT_MPI"),
          "multi-worker without MPI: %d %s", (int)st, mpt_context_error(q));
#endif
    s = mirrored(3);
    m = model(s, MPT_POLICY_FLOAT32, 0, MPT_OPTIMIZER_SGD);
    memset(&fit, 0, sizeof fit);
    fit.batch_size = 32; /* not a multiple of 3 */
    st = mpt_model_fit(m, d, &fit);
    CHECK(st == MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "3 replicas") &&
              strstr(mpt_context_error(ctx), "32"),
          "batch 32 over 3 replicas: %d %s", (int)st, mpt_context_error(ctx));
    CHECK(!m->built, "a refused fit built the model");
    mpt_model_destroy(m);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}

/* Gradient accumulation under the strategy: the replicas' gradients are
   summed every batch as without it, and each replica accumulates the sum
   (the same sums everywhere: they stay identical, sums included). N = 3
   over global batches of 32 matches one replica accumulating alike, to
   the same 1e-5 as without accumulation. */
static void test_accumulation_across_replicas(void) {
    int counts[2] = {2, 4}, c;
    mpt_dataset *d = blobs();
    for (c = 0; c < 2; c++) {
        mpt_strategy *s = mirrored(counts[c]);
        mpt_model *one = model(NULL, MPT_POLICY_FLOAT32, 0, MPT_OPTIMIZER_ADAM);
        mpt_model *many = model(s, MPT_POLICY_FLOAT32, 0, MPT_OPTIMIZER_ADAM);
        mpt_compile_desc acc = {.optimizer = {.learning_rate = 0.05f,
                                              .gradient_accumulation_steps = 3},
                                .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}};
        double diff;
        CHECK(mpt_model_compile(one, &acc) == MPT_OK && mpt_model_compile(many, &acc) == MPT_OK,
              "compile: %s", mpt_context_error(ctx));
        diff = fit_both(one, many, d, counts[c]);
        printf("# accumulating 3, %d replicas vs 1: relative norm error %.3g\n", counts[c],
               diff);
        CHECK(diff <= 1e-5, "%d replicas: relative norm error %.3g", counts[c], diff);
        CHECK(replicas_identical(many), "%d replicas (or their sums) drifted apart", counts[c]);
        CHECK(many->optimizer_steps == one->optimizer_steps &&
                  many->accumulated_steps == one->accumulated_steps && one->optimizer_steps == 7,
              "%d replicas: %lld updates, %lld in the sum; one: %lld, %lld", counts[c],
              (long long)many->optimizer_steps, (long long)many->accumulated_steps,
              (long long)one->optimizer_steps, (long long)one->accumulated_steps);
        mpt_model_destroy(one);
        mpt_model_destroy(many);
        mpt_strategy_destroy(s);
    }
    mpt_dataset_destroy(d);
}

/* What puts weights into a built replicated model puts them into every
   replica: a checkpoint (weights, optimizer state, counters), weights
   alone, masters edited and refreshed, EarlyStopping's best weights. The
   next epoch then goes on from them bit for bit as the saved run does. */
static void test_loading_reaches_every_replica(void) {
    char path_buf[600];
    const char *path = 
        test_file_in(path_buf, sizeof path_buf, tmpdir, "test_strategy_replicas.safetensors");
    mpt_dataset *d = blobs();
    mpt_strategy *s = mirrored(2);
    mpt_model *a = model(s, MPT_POLICY_MIXED_FLOAT16, 1, MPT_OPTIMIZER_ADAM);
    mpt_model *b = model(s, MPT_POLICY_MIXED_FLOAT16, 1, MPT_OPTIMIZER_ADAM);
    mpt_fit_desc fit = fit_for(2, 40);
    mpt_param_info info;
    int k;
    CHECK(mpt_model_fit(a, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save_checkpoint(a, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    fit.epochs = 1;
    fit.no_shuffle = 1; /* b elsewhere: other weights, moments and counters */
    CHECK(mpt_model_fit(b, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(b, path) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(replicas_identical(b), "a checkpoint reached replica 0 only");
    for (k = 1; k < b->n_replicas; k++)
        CHECK(b->replica[k]->optimizer_steps == a->optimizer_steps &&
                  b->replica[k]->loss_scale == a->loss_scale,
              "replica %d: %lld optimizer steps, scale %g; the file's %lld, %g", k,
              (long long)b->replica[k]->optimizer_steps, b->replica[k]->loss_scale,
              (long long)a->optimizer_steps, a->loss_scale);
    fit = fit_for(3, 40);
    fit.initial_epoch = 2;
    CHECK(mpt_model_fit(a, d, &fit) == MPT_OK && mpt_model_fit(b, d, &fit) == MPT_OK,
          "fit on: %s", mpt_context_error(ctx));
    CHECK(test_weight_diff(a, b) == 0 && replicas_identical(b),
          "after the loaded checkpoint's next epoch: relative difference %.3g",
          test_weight_diff(a, b));
    /* weights alone, and a master edited by hand */
    CHECK(mpt_model_load_weights(b, path) == MPT_OK, "load_weights: %s", mpt_context_error(ctx));
    CHECK(replicas_identical(b), "load_weights reached replica 0 only");
    mpt_model_param(b, 0, &info);
    ((float *)info.value.data)[0] += 0.5f;
    mpt_model_refresh_weights(b);
    CHECK(replicas_identical(b), "refresh_weights reached replica 0 only");
    remove(path);
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(d);
}

/* With replicas, forward and backward run in each replica's task, so fit
   times them as one: the summary says "forward and backward" and the logs
   have forward_and_backward_ms_per_step instead of a forward of 0 ms and
   a backward holding both; one replica keeps the two apart. */
static void test_step_times_with_replicas(void) {
    static char buf[16384];
    test_text printed = {buf, sizeof buf, 0};
    mpt_dataset *d = blobs();
    int replicas;
    for (replicas = 1; replicas <= 2; replicas++) {
        mpt_strategy *s = replicas > 1 ? mirrored(replicas) : NULL;
        mpt_model *m = model(s, MPT_POLICY_FLOAT32, 0, MPT_OPTIMIZER_SGD);
        mpt_fit_desc fit = fit_for(2, 32);
        const char *step;
        double together, forward, backward, ms = -1, part = -1;
        fit.verbose = 1;
        fit.printer.fn = test_text_append;
        fit.printer.user_data = &printed;
        test_text_clear(&printed);
        CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        together = history_value(m, "forward_and_backward_ms_per_step", -1);
        forward = history_value(m, "forward_ms_per_step", -1);
        backward = history_value(m, "backward_ms_per_step", -1);
        step = strstr(buf, "\nStep: ");
        if (replicas > 1) {
            CHECK(together > 0 && isnan(forward) && isnan(backward),
                  "%d replicas: logs together %g, forward %g, backward %g", replicas, together,
                  forward, backward);
            CHECK(step && sscanf(step, "\nStep: %lfms - forward and backward: %lfms - update: ",
                                 &ms, &part) == 2 && part > 0 && part <= ms,
                  "%d replicas: step line: %s", replicas, step ? step : buf);
        } else {
            CHECK(isnan(together) && forward > 0 && backward > 0,
                  "one replica: logs together %g, forward %g, backward %g", together, forward,
                  backward);
            CHECK(step && strstr(step, " - forward: ") && strstr(step, " - backward: ") &&
                      !strstr(step, "forward and backward"),
                  "one replica: step line: %s", step ? step : buf);
        }
        mpt_model_destroy(m);
        mpt_strategy_destroy(s);
    }
    mpt_dataset_destroy(d);
}

static void run_cases(void) {
    TEST_RUN(test_replicas_match_one);
    TEST_RUN(test_r2_score_and_auc_over_replicas);
    TEST_RUN(test_synchronized_batchnorm);
    TEST_RUN(test_graph_replicas_match_one);
    TEST_RUN(test_replicas_stay_identical);
    TEST_RUN(test_skips_are_global);
    TEST_RUN(test_evaluate_predict_checkpoint);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_accumulation_across_replicas);
    TEST_RUN(test_loading_reaches_every_replica);
    TEST_RUN(test_step_times_with_replicas);
}

int main(void) {
    static const test_program p = {.name = "test_strategy", .ctx = &ctx, .threads = 2,
                                   .setup = make_blobs, .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir, .keep_env = "MPT_KEEP_TEST_FILES",
                                   .cases = run_cases};
    return test_main(&p);
}

/* The public API's conventions: fit stops on a model that became
   non-finite; a NULL descriptor means all defaults; the getters of a
   model's policy and each layer's class and dtypes; the summary's policy
   line and its refusal before build; the messages of shape errors. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"
#include "blobs.h"

static mpt_context *ctx;

/* ---- fit stops on a non-finite model ------------------------------------------------- */

/* Dense(16, relu) -> Dense(3) on the blobs, from logits, SGD at lr. */
static mpt_model *blob_model(mpt_context *c, mpt_policy policy, float lr,
                             mpt_loss_scale_desc scale) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                          .policy = policy, .seed = 7}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_SGD, .learning_rate = lr},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1},
              .loss_scale = scale}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

static int epochs_ended;
static mpt_status count_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                  int *stop) {
    (void)user, (void)m, (void)epoch, (void)logs, (void)stop;
    epochs_ended++;
    return MPT_OK;
}

static int history_epochs(const mpt_model *m) {
    mpt_history h;
    return mpt_model_history(m, &h) == MPT_OK ? h.epochs : -1;
}

/* float32, no loss scaling, a learning rate that sends the loss to NaN:
   fit stops after the first epoch with MPT_ERR_NUMERIC naming the epoch,
   before the epoch's callbacks (which could save the broken model). */
static void test_fit_stops_on_nan_loss(void) {
    mpt_context *q = quiet_ctx();
    mpt_dataset *d = blobs_in(q);
    mpt_model *m = blob_model(q, MPT_POLICY_FLOAT32, 1e30f, (mpt_loss_scale_desc){0});
    mpt_callback cb = {0};
    mpt_status s;
    cb.on_epoch_end = count_epoch_end;
    epochs_ended = 0;
    s = mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 4, .batch_size = 20, .callbacks = &cb,
                                            .n_callbacks = 1});
    CHECK(s == MPT_ERR_NUMERIC, "fit gave %s: %s", mpt_status_string(s), mpt_context_error(q));
    CHECK(strstr(mpt_context_error(q), "epoch 1/4") && strstr(mpt_context_error(q), "loss is nan"),
          "message: %s", mpt_context_error(q));
    CHECK(epochs_ended == 0 && history_epochs(m) == 1 && mpt_model_epoch(m) == 1,
          "%d callbacks, %d epochs in the history", epochs_ended, history_epochs(m));
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}

/* A weight that is inf: the message names its layer, tensor and element. */
static void test_fit_names_the_nonfinite_weight(void) {
    mpt_context *q = quiet_ctx();
    mpt_dataset *d = blobs_in(q);
    mpt_model *m = blob_model(q, MPT_POLICY_FLOAT32, 0.01f, (mpt_loss_scale_desc){0});
    mpt_param_info p;
    mpt_status s;
    CHECK(mpt_model_build(m, 20) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_param(m, 3, &p); /* dense_1/bias */
    ((float *)p.value.data)[2] = INFINITY;
    mpt_model_refresh_weights(m);
    s = mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 20});
    CHECK(s == MPT_ERR_NUMERIC, "fit gave %s", mpt_status_string(s));
    CHECK(strstr(mpt_context_error(q), "epoch 1/2") &&
              strstr(mpt_context_error(q), "layer dense_1, tensor bias, element 2 is inf"),
          "message: %s", mpt_context_error(q));
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}

/* Steps skipped by dynamic loss scaling are normal: a scale so high that
   the first steps overflow float16 skips them and training goes on. */
static void test_fit_goes_on_after_skipped_steps(void) {
    mpt_context *q = quiet_ctx();
    mpt_dataset *d = blobs_in(q);
    mpt_model *m = blob_model(q, MPT_POLICY_MIXED_FLOAT16, 0.05f,
                              (mpt_loss_scale_desc){.mode = MPT_LOSS_SCALE_DYNAMIC,
                                                    .initial_scale = 0x1p100f});
    mpt_history h;
    mpt_status s = mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 20});
    CHECK(s == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(m->skipped_steps > 0, "no step was skipped");
    CHECK(mpt_model_history(m, &h) == MPT_OK && h.epochs == 2, "history");
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    make_blobs();
    TEST_RUN(test_fit_stops_on_nan_loss);
    TEST_RUN(test_fit_names_the_nonfinite_weight);
    TEST_RUN(test_fit_goes_on_after_skipped_steps);
    mpt_context_destroy(ctx);
    return test_summary("test_api");
}

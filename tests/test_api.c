/* The public API's conventions: fit stops on a model that became
   non-finite; a NULL descriptor means all defaults; fit's epochs 0 trains
   nothing; the getters of a model's policy and each layer's class and
   dtypes; the summary's policy line, its columns with long names and its
   refusal before build; the messages of shape errors. */
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
    double skipped = 0;
    int k, e;
    CHECK(s == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(mpt_model_history(m, &h) == MPT_OK && h.epochs == 2, "history");
    for (k = 0; k < h.n_keys; k++)
        for (e = 0; !strcmp(h.keys[k], "skipped_steps") && e < h.epochs; e++)
            skipped += h.values[k][e];
    CHECK(skipped > 0, "no step was skipped");
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
    mpt_context_destroy(q);
}


/* ---- a NULL descriptor means all defaults ------------------------------------------- */

/* Every layer whose fields all have defaults takes NULL: pooling (2, 2),
   BatchNormalization, Dropout (rate 0), Activation (identity), Flatten,
   GlobalAveragePooling2D; Dense and Conv2D name their required field. */
static void test_null_layer_descriptors(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL, *g = NULL;
    int64_t shape[MPT_MAX_RANK] = {0};
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {8, 8, 3}, .input_rank = 3}, &m) ==
              MPT_OK, "create");
    CHECK(mpt_model_add_max_pooling2d(m, NULL) == MPT_OK, "MaxPooling2D: %s", mpt_context_error(q));
    CHECK(mpt_model_add_average_pooling2d(m, NULL) == MPT_OK, "AveragePooling2D: %s",
          mpt_context_error(q));
    CHECK(mpt_model_add_batch_normalization(m, NULL) == MPT_OK, "BatchNormalization: %s",
          mpt_context_error(q));
    CHECK(mpt_model_add_dropout(m, NULL) == MPT_OK, "Dropout: %s", mpt_context_error(q));
    CHECK(mpt_model_add_activation(m, NULL) == MPT_OK, "Activation: %s", mpt_context_error(q));
    CHECK(mpt_model_add_flatten(m, NULL) == MPT_OK, "Flatten: %s", mpt_context_error(q));
    CHECK(mpt_model_add_dense(m, NULL) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "units"),
          "Dense: %s", mpt_context_error(q));
    CHECK(mpt_model_add_conv2d(m, NULL) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "filters"),
          "Conv2D: %s", mpt_context_error(q));
    CHECK(mpt_model_layer_count(m) == 6, "%d layers", mpt_model_layer_count(m));
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
    CHECK(mpt_model_layer_output_shape(m, 1, shape) == 3 && shape[0] == 2 && shape[1] == 2 &&
              shape[2] == 3, "pooling twice by the default (2, 2) gave (%lld, %lld, %lld)",
          (long long)shape[0], (long long)shape[1], (long long)shape[2]);
    CHECK(mpt_model_layer_output_shape(m, 5, shape) == 1 && shape[0] == 12, "flatten %lld",
          (long long)shape[0]);
    CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 4, 5}, .input_rank = 3}, &g) ==
              MPT_OK && mpt_model_add_global_average_pooling2d(g, NULL) == MPT_OK,
          "GlobalAveragePooling2D: %s", mpt_context_error(q));
    mpt_model_destroy(g);
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* The model's, the loss's, compile's and the dataset's required fields
   are named when the descriptor is NULL; the GEMM's defaults are the empty
   product. */
static void test_null_descriptors_with_required_fields(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    mpt_dataset *d = NULL;
    float p[6] = {0.2f, 0.3f, 0.5f, 0.1f, 0.1f, 0.8f}, t[6] = {0, 0, 1, 0, 1, 0};
    mpt_tensor tp, tt;
    double loss = 0;
    CHECK(mpt_gemm(q, NULL) == MPT_OK, "gemm: %s", mpt_context_error(q));
    CHECK(mpt_model_create(q, NULL, &m) == MPT_ERR_INVALID_ARGUMENT && !m &&
              strstr(mpt_context_error(q), "input_shape and input_rank are required"),
          "model: %s", mpt_context_error(q));
    mpt_tensor_wrap(q, &tp, MPT_FLOAT32, 2, (int64_t[]){2, 3}, p);
    mpt_tensor_wrap(q, &tt, MPT_FLOAT32, 2, (int64_t[]){2, 3}, t);
    CHECK(mpt_loss_compute(q, NULL, &tp, &tt, &loss, NULL) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "type is required"),
          "loss: %s", mpt_context_error(q));
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_compile(m, NULL) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "loss.type is required"),
          "compile: %s", mpt_context_error(q));
    CHECK(mpt_dataset_create(q, NULL, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "x is required"),
          "dataset: %s", mpt_context_error(q));
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* fit and evaluate with NULL: one epoch at batch_size 32 (the header's
   default, which a zero batch_size now gets too), as the explicit values;
   predict's batch_size 0 is 32 too. */
static void test_null_fit_and_evaluate(void) {
    mpt_dataset *d = blobs_in(ctx);
    mpt_model *a = blob_model(ctx, MPT_POLICY_FLOAT32, 0.05f, (mpt_loss_scale_desc){0});
    mpt_model *b = blob_model(ctx, MPT_POLICY_FLOAT32, 0.05f, (mpt_loss_scale_desc){0});
    mpt_logs la, lb;
    mpt_param_info pa, pb;
    CHECK(mpt_model_fit(a, d, NULL) == MPT_OK, "fit NULL: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(b, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 32}) == MPT_OK, "fit");
    CHECK(history_epochs(a) == 1, "%d epochs", history_epochs(a));
    CHECK(mpt_model_param(a, 0, &pa) == MPT_OK && mpt_model_param(b, 0, &pb) == MPT_OK &&
              !memcmp(pa.value.data, pb.value.data, mpt_tensor_bytes(&pa.value)),
          "fit(NULL) trained otherwise than batch_size 32, 1 epoch");
    CHECK(mpt_model_evaluate(a, d, NULL, &la) == MPT_OK, "evaluate NULL: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(a, d, &(mpt_evaluate_desc){.batch_size = 32}, &lb) == MPT_OK,
          "evaluate");
    CHECK(mpt_logs_get(&la, "loss") == mpt_logs_get(&lb, "loss") &&
              isfinite(mpt_logs_get(&la, "loss")),
          "evaluate NULL: loss %g, batch 32: %g", mpt_logs_get(&la, "loss"),
          mpt_logs_get(&lb, "loss"));
    CHECK(mpt_model_predict(a, d, 0, &pa.value) == MPT_OK &&
              mpt_model_predict(a, d, 32, &pb.value) == MPT_OK &&
              mpt_tensor_bytes(&pa.value) == mpt_tensor_bytes(&pb.value) &&
              !memcmp(pa.value.data, pb.value.data, mpt_tensor_bytes(&pa.value)),
          "predict with batch_size 0 (32): %s", mpt_context_error(ctx));
    mpt_tensor_free(ctx, &pa.value);
    mpt_tensor_free(ctx, &pb.value);
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    mpt_dataset_destroy(d);
}

/* Counts the calls of the callbacks fit makes around its epochs. */
typedef struct fit_calls {
    int train_begin, epoch_begin, epoch_end, train_end;
} fit_calls;

static mpt_status count_train_begin(void *user, mpt_model *m) {
    (void)m;
    ((fit_calls *)user)->train_begin++;
    return MPT_OK;
}

static mpt_status count_epoch_begin(void *user, mpt_model *m, int epoch) {
    (void)m, (void)epoch;
    ((fit_calls *)user)->epoch_begin++;
    return MPT_OK;
}

static mpt_status count_every_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                        int *stop) {
    (void)m, (void)epoch, (void)logs, (void)stop;
    ((fit_calls *)user)->epoch_end++;
    return MPT_OK;
}

static mpt_status count_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    (void)m, (void)logs;
    ((fit_calls *)user)->train_end++;
    return MPT_OK;
}

/* epochs 0 trains nothing, as Keras' fit(epochs=0): the model is built,
   the callbacks' train begin and end run, no epoch does, the history is
   empty and the weights are the initial ones; so does epochs below
   initial_epoch (Keras' range(initial_epoch, epochs) is empty). A
   descriptor that leaves epochs at 0 is such a request, not the default
   (NULL trains one epoch: test_null_fit_and_evaluate). */
static void test_fit_zero_epochs_trains_nothing(void) {
    mpt_dataset *d = blobs_in(ctx);
    mpt_model *a = blob_model(ctx, MPT_POLICY_FLOAT32, 0.05f, (mpt_loss_scale_desc){0});
    mpt_model *b = blob_model(ctx, MPT_POLICY_FLOAT32, 0.05f, (mpt_loss_scale_desc){0});
    mpt_param_info pa, pb;
    mpt_fit_desc f;
    fit_calls calls = {0, 0, 0, 0};
    mpt_callback cb = {0};
    cb.on_train_begin = count_train_begin;
    cb.on_epoch_begin = count_epoch_begin;
    cb.on_epoch_end = count_every_epoch_end;
    cb.on_train_end = count_train_end;
    cb.user_data = &calls;
    f = fit_for(0, 20);
    f.callbacks = &cb;
    f.n_callbacks = 1;
    CHECK(mpt_model_fit(a, d, &f) == MPT_OK, "fit epochs 0: %s", mpt_context_error(ctx));
    CHECK(calls.train_begin == 1 && calls.train_end == 1 && calls.epoch_begin == 0 &&
              calls.epoch_end == 0,
          "train begin %d, end %d, epoch begin %d, end %d (Keras: 1, 1, 0, 0)", calls.train_begin,
          calls.train_end, calls.epoch_begin, calls.epoch_end);
    CHECK(history_epochs(a) == 0 && mpt_model_epoch(a) == 0 && a->optimizer_steps == 0,
          "%d epochs in the history, epoch %d, %lld steps", history_epochs(a), mpt_model_epoch(a),
          (long long)a->optimizer_steps);
    CHECK(a->built && a->max_batch == 20, "fit built the model for 20: built %d for %lld", a->built,
          (long long)a->max_batch);
    CHECK(mpt_model_build(b, 20) == MPT_OK && mpt_model_param(a, 0, &pa) == MPT_OK &&
              mpt_model_param(b, 0, &pb) == MPT_OK &&
              !memcmp(pa.value.data, pb.value.data, mpt_tensor_bytes(&pa.value)),
          "fit with epochs 0 changed the initial weights");
    CHECK(mpt_model_fit(a, d, &(mpt_fit_desc){.batch_size = 20}) == MPT_OK &&
              history_epochs(a) == 0 && a->optimizer_steps == 0,
          "a descriptor without epochs trained %d epochs", history_epochs(a));
    f = fit_for(1, 20);
    f.initial_epoch = 3;
    CHECK(mpt_model_fit(a, d, &f) == MPT_OK && history_epochs(a) == 0 && a->optimizer_steps == 0,
          "epochs 1 from initial_epoch 3 trained %d epochs", history_epochs(a));
    mpt_model_destroy(a);
    mpt_model_destroy(b);
    mpt_dataset_destroy(d);
}

/* Callbacks and the strategy: NULL where every field has a default;
   ModelCheckpoint and CSVLogger name the path they require. */
static void test_null_callback_and_strategy_descriptors(void) {
    mpt_context *q = quiet_ctx();
    mpt_callback cb;
    mpt_strategy *st = NULL;
    CHECK(mpt_callback_early_stopping(q, NULL, &cb) == MPT_OK, "EarlyStopping");
    mpt_callback_destroy(&cb);
    CHECK(mpt_callback_reduce_lr_on_plateau(q, NULL, &cb) == MPT_OK, "ReduceLROnPlateau");
    mpt_callback_destroy(&cb);
    CHECK(mpt_callback_model_checkpoint(q, NULL, &cb) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "filepath is NULL") &&
              strstr(mpt_context_error(q), "required"),
          "ModelCheckpoint: %s", mpt_context_error(q));
    CHECK(mpt_callback_csv_logger(q, NULL, &cb) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "filename is NULL") &&
              strstr(mpt_context_error(q), "required"),
          "CSVLogger: %s", mpt_context_error(q));
    CHECK(mpt_strategy_create(q, NULL, &st) == MPT_OK && st && mpt_strategy_num_replicas(st) >= 1,
          "strategy: %s", mpt_context_error(q));
    mpt_strategy_destroy(st);
    mpt_context_destroy(q);
}

/* ---- getters and the summary --------------------------------------------------------- */

/* Dense(relu) -> Flatten -> Dense(softmax) under mixed_float16, built. */
static mpt_model *mixed_model(mpt_context *c, int build) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                          .policy = MPT_POLICY_MIXED_FLOAT16}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_SOFTMAX});
    if (build) CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(c));
    return m;
}

/* The model's policy, each layer's class name, variable and compute dtype. */
static void test_policy_and_layer_getters(void) {
    static const char *const classes[3] = {"Dense", "Flatten", "Dense"};
    static const mpt_dtype compute[3] = {MPT_FLOAT16, MPT_FLOAT16, MPT_FLOAT32};
    mpt_model *m = mixed_model(ctx, 1), *plain = NULL;
    int i;
    CHECK(mpt_model_policy(m) == MPT_POLICY_MIXED_FLOAT16, "policy %d", (int)mpt_model_policy(m));
    CHECK(!strcmp(mpt_policy_name(mpt_model_policy(m)), "mixed_float16") &&
              !strcmp(mpt_policy_name(MPT_POLICY_FLOAT32), "float32") &&
              !strcmp(mpt_policy_name(MPT_POLICY_MIXED_BFLOAT16), "mixed_bfloat16") &&
              !strcmp(mpt_policy_name((mpt_policy)9), "?"),
          "policy names");
    for (i = 0; i < 3; i++) {
        const char *cls = mpt_model_layer_class_name(m, i);
        CHECK(cls && !strcmp(cls, classes[i]), "layer %d: class %s", i, cls ? cls : "NULL");
        CHECK(mpt_model_layer_variable_dtype(m, i) == MPT_FLOAT32, "layer %d: variables %s", i,
              mpt_dtype_name(mpt_model_layer_variable_dtype(m, i)));
        CHECK(mpt_model_layer_dtype(m, i) == compute[i], "layer %d: compute %s", i,
              mpt_dtype_name(mpt_model_layer_dtype(m, i)));
    }
    CHECK(!mpt_model_layer_class_name(m, 3) && !mpt_model_layer_class_name(m, -1) &&
              !mpt_model_layer_class_name(NULL, 0) &&
              mpt_model_layer_variable_dtype(m, 3) == MPT_DTYPE_DEFAULT,
          "a layer that does not exist");
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {2}, .input_rank = 1}, &plain);
    CHECK(mpt_model_policy(plain) == MPT_POLICY_FLOAT32, "default policy");
    mpt_model_destroy(plain);
    mpt_model_destroy(m);
}

/* Every getter that fills a struct leaves zeros when it fails (NULL model,
   an index that does not exist, a model not built, quantized or fitted),
   never the bytes it was given. */
static int all_zero(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    size_t i;
    for (i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

static void test_failed_getters_leave_zeros(void) {
    mpt_model *built = mixed_model(ctx, 1), *unbuilt = mixed_model(ctx, 0);
    mpt_param_info info;
    mpt_history h;
    mpt_memory_report mem;
    mpt_quantized_info qi;
    mpt_quantized_layer ql;
    mpt_device_info dev;
    int failures = 0, zeros = 0;
#define TRY(call, out)                                  \
    do {                                                \
        memset(&(out), 0xAB, sizeof(out));              \
        failures += (call) != MPT_OK;                   \
        zeros += all_zero(&(out), sizeof(out));         \
    } while (0)
    TRY(mpt_model_param(NULL, 0, &info), info);
    TRY(mpt_model_param(unbuilt, 0, &info), info);
    TRY(mpt_model_param(built, 99, &info), info);
    TRY(mpt_model_history(NULL, &h), h);
    TRY(mpt_model_memory(NULL, &mem), mem);
    TRY(mpt_model_memory(unbuilt, &mem), mem);
    TRY(mpt_model_memory_peak(NULL, &mem), mem);
    TRY(mpt_model_memory_peak(built, &mem), mem);
    TRY(mpt_model_quantized_info(NULL, &qi), qi);
    TRY(mpt_model_quantized_info(built, &qi), qi);
    TRY(mpt_model_quantized_layer(NULL, 0, &ql), ql);
    TRY(mpt_model_quantized_layer(built, 0, &ql), ql);
    TRY(mpt_device_query(NULL, 0, &dev), dev);
    TRY(mpt_device_query(ctx, 99, &dev), dev);
#undef TRY
    CHECK(failures == 14, "%d of 14 calls failed", failures);
    CHECK(zeros == 14, "%d of 14 failed calls left their struct zero", zeros);
    mpt_model_destroy(unbuilt);
    mpt_model_destroy(built);
}

/* The summary names the policy and each layer's compute dtype. */
static void test_summary_shows_the_policy(void) {
    char text[4096];
    mpt_model *m = mixed_model(ctx, 1);
    size_t n = mpt_model_summary(m, text, sizeof text);
    CHECK(n > 0 && n < sizeof text, "length %zu", n);
    CHECK(strstr(text, "Dtype policy: \"mixed_float16\" (variables float32, compute float16)") &&
              strstr(text, "dense (Dense)") && strstr(text, "float16") &&
              strstr(text, "float32"),
          "summary:\n%s", text);
    mpt_model_destroy(m);
}

/* Long names keep the table aligned: the layer column widens to
   "global_average_pooling2d (GlobalAveragePooling2D)" and to a long name
   of the user's, and the rules with it; short names keep Keras' widths. */
static void test_summary_long_names(void) {
    char text[4096], want[128];
    mpt_model *m = NULL;
    const char *why;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {8, 8, 3}, .input_rank = 3},
                           &m) == MPT_OK &&
              mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3}}) ==
                  MPT_OK &&
              mpt_model_add_global_average_pooling2d(m, NULL) == MPT_OK &&
              mpt_model_add_dense(m, &(mpt_dense_desc){
                  .units = 2, .name = "classifier_head_of_a_model_with_long_names"}) == MPT_OK &&
              mpt_model_build(m, 2) == MPT_OK,
          "model: %s", mpt_context_error(ctx));
    test_summary_holds(m, text, sizeof text, " global_average_pooling2d (GlobalAveragePooling2D) ",
                       " classifier_head_of_a_model_with_long_names (Dense) ");
    mpt_model_destroy(m);
    m = mixed_model(ctx, 1);
    mpt_model_summary(m, text, sizeof text);
    why = test_summary_misaligned(text);
    snprintf(want, sizeof want, "\n %-44s %-24s %-12d float16\n", "dense (Dense)", "(None, 8)", 56);
    CHECK(!why && strstr(text, want), "%s in\n%s", why ? why : "short names: not Keras' widths",
          text);
    mpt_model_destroy(m);
}

/* Before build, the summary says why it has no table, as Keras raises. */
static void test_summary_before_build(void) {
    char text[512];
    mpt_model *m = mixed_model(ctx, 0);
    size_t n = mpt_model_summary(m, text, sizeof text);
    CHECK(n > 0 && n < sizeof text && strlen(text) == n, "length %zu", n);
    CHECK(strstr(text, "has not yet been built") && strstr(text, "mpt_model_build") &&
              strstr(text, "mpt_model_fit"),
          "summary: %s", text);
    CHECK(mpt_model_summary(m, text, 8) == n && strlen(text) == 7, "truncated");
    mpt_model_destroy(m);
}

/* A wrong input shape: the messages name both shapes, no stray ")". */
static void test_forward_shape_message(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = mixed_model(q, 1), *img = NULL;
    float x[4 * 48];
    mpt_tensor t, out;
    int i;
    for (i = 0; i < 4 * 48; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(q, &t, MPT_FLOAT32, 2, (int64_t[]){2, 5}, x);
    CHECK(mpt_model_forward(m, &t, 0, &out) == MPT_ERR_SHAPE, "(2, 5) for (6,) accepted");
    CHECK(strstr(mpt_context_error(q), "input (2, 5): samples of shape (5,) do not fit the model's input (6,)") &&
              !strstr(mpt_context_error(q), "))"),
          "message: %s", mpt_context_error(q));
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 4, 3}, .input_rank = 3}, &img);
    mpt_model_add_flatten(img, NULL);
    CHECK(mpt_model_build(img, 2) == MPT_OK, "build");
    mpt_tensor_wrap(q, &t, MPT_FLOAT32, 4, (int64_t[]){3, 4, 4, 3}, x);
    CHECK(mpt_model_forward(img, &t, 0, &out) == MPT_ERR_SHAPE, "batch 3 for 2 accepted");
    CHECK(strstr(mpt_context_error(q), "input shape (3, 4, 4, 3) is not (batch, sample...) with batch in 1..2") &&
              !strstr(mpt_context_error(q), "))"),
          "message: %s", mpt_context_error(q));
    mpt_model_destroy(img);
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_fit_stops_on_nan_loss);
    TEST_RUN(test_fit_names_the_nonfinite_weight);
    TEST_RUN(test_fit_goes_on_after_skipped_steps);
    TEST_RUN(test_null_layer_descriptors);
    TEST_RUN(test_null_descriptors_with_required_fields);
    TEST_RUN(test_null_fit_and_evaluate);
    TEST_RUN(test_fit_zero_epochs_trains_nothing);
    TEST_RUN(test_null_callback_and_strategy_descriptors);
    TEST_RUN(test_policy_and_layer_getters);
    TEST_RUN(test_failed_getters_leave_zeros);
    TEST_RUN(test_summary_shows_the_policy);
    TEST_RUN(test_summary_long_names);
    TEST_RUN(test_summary_before_build);
    TEST_RUN(test_forward_shape_message);
}

int main(void) {
    static const test_program p = {.name = "test_api", .ctx = &ctx, .threads = 2,
                                   .setup = make_blobs, .cases = run_cases};
    return test_main(&p);
}

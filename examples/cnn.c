/* The "OptimizedImageClassifier" on Fashion-MNIST:
       Conv2D(32, 3, relu) -> BatchNormalization -> Conv2D(32, 3, relu)
       -> MaxPooling2D(2) -> Dropout(0.25)
       -> Conv2D(64, 3, relu) -> BatchNormalization -> Conv2D(64, 3, relu)
       -> MaxPooling2D(2) -> Dropout(0.25)
       -> Flatten -> Dense(512, relu) -> BatchNormalization -> Dropout(0.5)
       -> Dense(10, softmax)
   Adam 1e-3, batch 128, validation on the last 10,000 training images,
   EarlyStopping(patience 3, restore best), ReduceLROnPlateau(factor 0.2,
   patience 2), ModelCheckpoint(best only) to cnn_best.safetensors.

   Build: cc -O2 cnn.c -lpthread -lm -lz -o cnn         (in examples/)
   Run:   ./cnn [--policy ...] [--epochs 15] [--batch-size 128] [--threads N]
                [--data DIR] [--verbose 1] [--tensorboard DIR]
                [--plot FILE] [--profile DIR] */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

static mpt_status add_conv_block(mpt_model *m, int64_t filters) {
    mpt_status s = mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = filters,
                                                               .kernel_size = { 3, 3 },
                                                               .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){ 0 });
    if (s == MPT_OK) s = mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = filters,
                                                                     .kernel_size = { 3, 3 },
                                                                     .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
    if (s == MPT_OK) s = mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.25f });
    return s;
}

int main(int argc, char **argv) {
    options o = default_options(15);
    mpt_context *ctx;
    mpt_dataset *all, *train, *validation, *test;
    mpt_model *model;
    mpt_callback callbacks[3];
    char summary[8192];
    int i, rc = open_fashion_mnist(argc, argv, &o, &ctx, &all, &test);
    if (rc) return rc;
    TRY(mpt_dataset_split(ctx, all, mpt_dataset_count(all) - 10000, &train, &validation));

    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 }, .input_rank = 3,
                                                 .policy = o.policy, .seed = o.seed }, &model));
    TRY(add_conv_block(model, 32));
    TRY(add_conv_block(model, 64));
    TRY(mpt_model_add_flatten(model, NULL));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 512, .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_batch_normalization(model, &(mpt_batchnorm_desc){ 0 }));
    TRY(mpt_model_add_dropout(model, &(mpt_dropout_desc){ .rate = 0.5f }));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 10, .activation = MPT_ACT_SOFTMAX }));
    TRY(mpt_model_compile(model, &(mpt_compile_desc){
        .optimizer = { .type = MPT_OPTIMIZER_ADAM, .learning_rate = 1e-3f },
        .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
        .metrics = MPT_METRIC_ACCURACY }));
    TRY(mpt_model_build(model, o.batch_size));
    if (o.verbose && mpt_model_summary(model, summary, sizeof summary)) printf("%s", summary);

    TRY(mpt_callback_early_stopping(ctx, &(mpt_early_stopping_desc){
        .patience = 3, .restore_best_weights = 1, .verbose = 1 }, &callbacks[0]));
    TRY(mpt_callback_reduce_lr_on_plateau(ctx, &(mpt_reduce_lr_desc){
        .factor = 0.2f, .patience = 2, .verbose = 1 }, &callbacks[1]));
    TRY(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
        .filepath = "cnn_best.safetensors", .save_best_only = 1, .save_weights_only = 1,
        .verbose = 1 }, &callbacks[2]));
    TRY(fit_with_flags(ctx, &o, model, train, validation, callbacks, 3));
    TRY(evaluate_and_report(ctx, &o, model, "cnn", test));

    for (i = 2; i >= 0; i--) mpt_callback_destroy(&callbacks[i]);
    mpt_model_destroy(model);
    mpt_dataset_destroy(validation);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(all);
    mpt_context_destroy(ctx);
    return 0;
}

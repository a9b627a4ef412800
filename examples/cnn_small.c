/* A small CNN on Fashion-MNIST: Conv2D(32, 3, relu) -> MaxPooling2D(2) ->
   Flatten -> Dense(128, relu) -> Dense(10, softmax), Adam, batch 128.

   Build: cc -O2 cnn_small.c -lpthread -lm -lz -o cnn_small   (in examples/)
   Run:   ./cnn_small [--policy ...] [--epochs 5] [--batch-size 128] [--threads N]
                      [--data DIR] [--verbose 1] [--tensorboard DIR]
                      [--plot FILE] [--profile DIR] */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

int main(int argc, char **argv) {
    options o = default_options(5);
    mpt_context *ctx;
    mpt_dataset *train, *test;
    mpt_model *model;
    char summary[4096];
    int rc = open_fashion_mnist(argc, argv, &o, &ctx, &train, &test);
    if (rc) return rc;

    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 }, .input_rank = 3,
                                                 .policy = o.policy, .seed = o.seed }, &model));
    TRY(mpt_model_add_conv2d(model, &(mpt_conv2d_desc){ .filters = 32, .kernel_size = { 3, 3 },
                                                        .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_max_pooling2d(model, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } }));
    TRY(mpt_model_add_flatten(model, NULL));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 128, .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 10, .activation = MPT_ACT_SOFTMAX }));
    TRY(mpt_model_compile(model, &(mpt_compile_desc){
        .optimizer = { .type = MPT_OPTIMIZER_ADAM },
        .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
        .metrics = MPT_METRIC_ACCURACY }));
    TRY(mpt_model_build(model, o.batch_size));
    if (o.verbose && mpt_model_summary(model, summary, sizeof summary)) printf("%s", summary);

    TRY(fit_with_flags(ctx, &o, model, train, NULL, NULL, 0));
    TRY(evaluate_and_report(ctx, &o, model, "cnn_small", test));

    mpt_model_destroy(model);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

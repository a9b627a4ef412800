/* The seed MLP on Fashion-MNIST: Flatten -> Dense(1024, relu) ->
   Dense(10, softmax), Adam, batch 128, mixed_float16 by default.

   Build: cc -O2 mlp.c -lpthread -lm -lz -o mlp          (in examples/)
   Run:   ./mlp [--policy float32|mixed_float16|mixed_bfloat16] [--epochs 20]
                [--batch-size 128] [--threads N] [--data DIR] [--verbose 1]
                [--tensorboard DIR] [--plot FILE] [--profile DIR]

   Shows Keras' progress bar, then one JSON line with the results. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

int main(int argc, char **argv) {
    options o = default_options(20);
    mpt_context *ctx;
    mpt_dataset *train, *test;
    mpt_model *model;
    char summary[4096];
    int rc = open_fashion_mnist(argc, argv, &o, &ctx, &train, &test);
    if (rc) return rc;

    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 }, .input_rank = 3,
                                                 .policy = o.policy, .seed = o.seed }, &model));
    TRY(mpt_model_add_flatten(model, NULL));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 1024, .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_dense(model, &(mpt_dense_desc){ .units = 10, .activation = MPT_ACT_SOFTMAX }));
    TRY(mpt_model_compile(model, &(mpt_compile_desc){
        .optimizer = { .type = MPT_OPTIMIZER_ADAM, .learning_rate = 1e-3f },
        .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
        .metrics = MPT_METRIC_ACCURACY }));
    TRY(mpt_model_build(model, o.batch_size));
    if (o.verbose && mpt_model_summary(model, summary, sizeof summary)) printf("%s", summary);

    TRY(fit_with_flags(ctx, &o, model, train, NULL, NULL, 0));
    TRY(evaluate_and_report(ctx, &o, model, "mlp", test));

    mpt_model_destroy(model);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

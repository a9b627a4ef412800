/* The CNN of TensorFlow's MirroredStrategy walkthrough on Fashion-MNIST:
   Conv2D(32, 3, relu) -> MaxPooling2D(2) -> Flatten -> Dense(128, relu) ->
   Dense(10, softmax), trained with a mirrored strategy. The batch size is
   the global batch, split evenly over the replicas.

   Build and run, one process (replicas share the CPU, or the GPU with
   -DMPT_CUDA and mpt_cuda.cu):
       cc -O2 mirrored.c -lpthread -lm -lz -o mirrored
       ./mirrored --replicas 2 [--policy ...] [--epochs 5] [--batch-size 128] ...
   Several processes, on one node or many (one replica each, MPI):
       mpicc -O2 -DMPT_MPI mirrored.c -lpthread -lm -lz -o mirrored
       mpirun -np 2 ./mirrored
       mpirun -np 16 -H a:8,b:8 ./mirrored */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

/* Takes "--replicas N" out of argv (the other flags are common.h's);
   -1 after saying what is wrong when N is not a number. */
static int take_replicas(int *argc, char **argv) {
    int i, replicas = 1;
    unsigned long long n;
    for (i = 1; i + 1 < *argc; i++)
        if (!strcmp(argv[i], "--replicas")) {
            replicas = read_number(argv[0], "--replicas", argv[i + 1], INT_MAX, &n) ? (int)n : -1;
            memmove(argv + i, argv + i + 2, sizeof(char *) * (size_t)(*argc - i - 2));
            *argc -= 2;
            break;
        }
    return replicas;
}

int main(int argc, char **argv) {
    options o = default_options(5);
    int replicas = take_replicas(&argc, argv);
    mpt_context *ctx;
    mpt_strategy *strategy;
    mpt_model *model;
    mpt_dataset *train, *test;
    mpt_logs result;
    if (replicas < 0 || !parse_options(argc, argv, &o)) return 2;
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = o.threads }, &ctx) != MPT_OK)
        return 1;
#ifdef MPT_MPI
    (void)replicas; /* one per process */
    TRY(mpt_strategy_create(ctx, &(mpt_strategy_desc){ .type = MPT_STRATEGY_MULTI_WORKER },
                            &strategy));
#else
    TRY(mpt_strategy_create(ctx, &(mpt_strategy_desc){ .type = MPT_STRATEGY_MIRRORED,
                                                       .num_replicas = replicas }, &strategy));
#endif
    if (mpt_strategy_worker(strategy) == 0)
        printf("Number of devices: %d\n", mpt_strategy_num_replicas(strategy));
    TRY(mpt_dataset_load_mnist(ctx, o.data, 0, &train));
    TRY(mpt_dataset_load_mnist(ctx, o.data, 1, &test));

    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 }, .input_rank = 3,
                                                 .policy = o.policy, .seed = o.seed,
                                                 .strategy = strategy }, &model));
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

    TRY(fit_with_flags(ctx, &o, model, train, NULL, NULL, 0));
    if (mpt_strategy_worker(strategy) == 0) TRY(write_plot(ctx, &o, model, "mirrored"));
    TRY(mpt_model_evaluate(model, test, &(mpt_evaluate_desc){ .batch_size = o.batch_size },
                           &result));
    if (mpt_strategy_worker(strategy) == 0) print_result("mirrored", &o, model, ctx, &result);

    mpt_model_destroy(model);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_strategy_destroy(strategy);
    mpt_context_destroy(ctx);
    return 0;
}

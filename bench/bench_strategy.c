/* Step time of the mirrored strategy on the CPU, with the seed CNN
   (Conv2D(32, 3, relu) -> MaxPooling2D(2) -> Flatten -> Dense(128, relu) ->
   Dense(10, softmax)), global batch 128, mixed_bfloat16, on Fashion-MNIST.

   Built with cc: 1, 2 and 4 logical replicas in this process, sharing its
   threads.
   Built with mpicc -DMPT_MPI and run by mpirun: one replica per process
   (run it with -np 1 and -np 2), then the bus bandwidth of MPI_Allreduce
   on 4 and 64 MiB of floats, as nccl-tests computes it:
   2·(n − 1)/n · bytes / seconds.

   Prints a table and one JSON line per result. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

#ifdef MPT_MPI
#include <mpi.h>
#endif

enum { SAMPLES = 128 * 40, BATCH = 128, EPOCHS = 3 };

/* ms per step of the last of EPOCHS epochs (the first warms up). */
static double step_ms(mpt_context *ctx, mpt_strategy *s, const mpt_dataset *train) {
    mpt_model *m = NULL;
    double ms = -1;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                            .policy = MPT_POLICY_MIXED_BFLOAT16, .seed = 1,
                                            .strategy = s}, &m);
    add_cnn_small_layers(m);
    mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = {.type = MPT_OPTIMIZER_ADAM},
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    if (mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = EPOCHS, .batch_size = BATCH}) == MPT_OK)
        ms = 1e3 * history_last(m, "epoch_seconds") / (SAMPLES / BATCH);
    else
        fprintf(stderr, "fit: %s\n", mpt_context_error(ctx));
    mpt_model_destroy(m);
    return ms;
}

#ifdef MPT_MPI
/* Bus bandwidth (GB/s) of MPI_Allreduce over `bytes` of floats. */
static double allreduce_busbw(int64_t bytes, int workers) {
    int64_t n = bytes / 4;
    float *buf = (float *)calloc((size_t)n, sizeof(float));
    double t0, seconds;
    int i, reps = 10;
    if (!buf) return 0;
    MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); /* warm-up */
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (i = 0; i < reps; i++)
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    seconds = (MPI_Wtime() - t0) / reps;
    free(buf);
    return 2.0 * (workers - 1) / workers * (double)bytes / seconds / 1e9;
}
#endif

int main(void) {
    mpt_context *ctx = NULL;
    mpt_dataset *all = NULL, *train = NULL, *rest = NULL;
    mpt_context_create(&(mpt_context_desc){0}, &ctx);
    if (mpt_dataset_load_mnist(ctx, "/usr/share/datasets/fashion-mnist", 0, &all) != MPT_OK ||
        mpt_dataset_split(ctx, all, SAMPLES, &train, &rest) != MPT_OK) {
        fprintf(stderr, "bench_strategy: %s\n", mpt_context_error(ctx));
        return 1;
    }
#ifdef MPT_MPI
    {
        mpt_strategy *s = NULL;
        double ms;
        int workers;
        if (mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MULTI_WORKER},
                                &s) != MPT_OK) {
            fprintf(stderr, "bench_strategy: %s\n", mpt_context_error(ctx));
            return 1;
        }
        workers = mpt_strategy_num_workers(s);
        ms = step_ms(ctx, s, train);
        if (mpt_strategy_worker(s) == 0) {
            double bw4 = workers > 1 ? allreduce_busbw((int64_t)4 << 20, workers) : 0;
            double bw64 = workers > 1 ? allreduce_busbw((int64_t)64 << 20, workers) : 0;
            (void)bw4;
            printf("| MPI workers | threads each | ms/step (global batch %d) |\n|---|---|---|\n",
                   BATCH);
            printf("| %d | %d | %.2f |\n", workers, mpt_context_num_threads(ctx), ms);
            printf("{\"bench\":\"strategy_step\",\"kind\":\"mpi\",\"workers\":%d,\"threads\":%d,"
                   "\"batch\":%d,\"ms_per_step\":%.3f}\n",
                   workers, mpt_context_num_threads(ctx), BATCH, ms);
            if (workers > 1)
                printf("{\"bench\":\"mpi_allreduce\",\"workers\":%d,\"bytes\":%d,"
                       "\"busbw_gb_s\":%.3f}\n{\"bench\":\"mpi_allreduce\",\"workers\":%d,"
                       "\"bytes\":%d,\"busbw_gb_s\":%.3f}\n",
                       workers, 4 << 20, bw4, workers, 64 << 20, bw64);
        } else if (workers > 1) {
            allreduce_busbw((int64_t)4 << 20, workers);
            allreduce_busbw((int64_t)64 << 20, workers);
        }
        mpt_strategy_destroy(s);
    }
#else
    {
        int replicas[3] = {1, 2, 4}, i;
        printf("| logical replicas | threads | ms/step (global batch %d) |\n|---|---|---|\n",
               BATCH);
        for (i = 0; i < 3; i++) {
            mpt_strategy *s = NULL;
            double ms;
            mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                          .num_replicas = replicas[i]}, &s);
            ms = step_ms(ctx, s, train);
            printf("| %d | %d | %.2f |\n", replicas[i], mpt_context_num_threads(ctx), ms);
            printf("{\"bench\":\"strategy_step\",\"kind\":\"logical\",\"replicas\":%d,"
                   "\"threads\":%d,\"batch\":%d,\"ms_per_step\":%.3f}\n",
                   replicas[i], mpt_context_num_threads(ctx), BATCH, ms);
            mpt_strategy_destroy(s);
        }
    }
#endif
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(rest);
    mpt_dataset_destroy(all);
    mpt_context_destroy(ctx);
    return 0;
}

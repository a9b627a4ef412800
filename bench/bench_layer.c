/* One layer's forward and backward time, alone in a model, at the CNN's
   shapes (batch 128): the fastest of N training forwards and of N
   backwards, which on a shared host is the least disturbed.

       gcc -std=c99 -O2 -I. bench/bench_layer.c -o build/bench_layer -lpthread -lm -lz
       ./build/bench_layer --layer bn|bn_dense|dropout|maxpool
                           [--policy float32|mixed_bfloat16]
                           [--repeat 40] [--threads 2]

   bn: BatchNormalization over 24 × 24 × 32 (the CNN's first); bn_dense:
   BatchNormalization over 1 × 1 × 512 (the rows and channels of the CNN's
   after Dense(512)); dropout: Dropout(0.25) over 12 × 12 × 64; maxpool:
   MaxPooling2D(2) over 26 × 26 × 32 (the small CNN's). To compare two versions of the library,
   build this file against each one's mpt.h (`git show COMMIT:mpt.h >
   DIR/mpt.h`, then `-IDIR` instead of `-I.`) and run them in turns. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

static mpt_status add_layer(mpt_model *m, const char *layer) {
    if (!strcmp(layer, "bn") || !strcmp(layer, "bn_dense")) return mpt_model_add_batch_normalization(m, NULL);
    if (!strcmp(layer, "dropout"))
        return mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.25f });
    return mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
}

int main(int argc, char **argv) {
    const char *layer = "bn", *policy = "float32";
    int repeat = 40, threads = 2, i;
    int64_t batch = 128, h, c, n_in, n_out, k;
    mpt_context *ctx = NULL;
    mpt_model *m = NULL;
    mpt_tensor tx, ty, tdy, tdx;
    float *x, *dy;
    double best_fwd = 1e30, best_bwd = 1e30;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layer")) layer = argv[i + 1];
        else if (!strcmp(argv[i], "--policy")) policy = argv[i + 1];
        else if (!strcmp(argv[i], "--repeat")) repeat = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else break;
    }
    if (i != argc || repeat < 1 || threads < 1 ||
        (strcmp(layer, "bn") && strcmp(layer, "bn_dense") && strcmp(layer, "dropout") &&
         strcmp(layer, "maxpool")) ||
        (strcmp(policy, "float32") && strcmp(policy, "mixed_bfloat16"))) {
        fprintf(stderr, "usage: %s --layer bn|bn_dense|dropout|maxpool "
                        "[--policy float32|mixed_bfloat16] "
                        "[--repeat N] [--threads N]\n", argv[0]);
        return 2;
    }
    h = !strcmp(layer, "maxpool") ? 26 : !strcmp(layer, "bn") ? 24 : 12;
    c = !strcmp(layer, "dropout") ? 64 : 32;
    if (!strcmp(layer, "bn_dense")) h = 1, c = 512; /* 1 × 1 × 512: a Dense output's rows */
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = threads }, &ctx) != MPT_OK ||
        mpt_model_create(ctx, &(mpt_model_desc){
                             .input_shape = { h, h, c }, .input_rank = 3,
                             .policy = strcmp(policy, "float32") ? MPT_POLICY_MIXED_BFLOAT16
                                                                 : MPT_POLICY_FLOAT32 },
                         &m) != MPT_OK ||
        add_layer(m, layer) != MPT_OK || mpt_model_build(m, batch) != MPT_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
        return 1;
    }
    n_in = batch * h * h * c;
    x = (float *)malloc(sizeof(float) * (size_t)n_in);
    dy = (float *)malloc(sizeof(float) * (size_t)n_in); /* at least the output's size */
    for (k = 0; k < n_in; k++) {
        x[k] = (float)rand() / (float)RAND_MAX;
        dy[k] = (float)rand() / (float)RAND_MAX - 0.5f;
    }
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){ batch, h, h, c }, x);
    memset(&tdx, 0, sizeof tdx);
    for (i = 0; i < repeat; i++) {
        double t0 = now(), t1, t2;
        if (mpt_model_forward(m, &tx, 1, &ty) != MPT_OK) break;
        t1 = now();
        tdy = ty; /* the output's shape, float32 values */
        tdy.dtype = MPT_FLOAT32;
        tdy.data = dy;
        if (mpt_model_backward(m, &tdy, &tdx) != MPT_OK) break;
        t2 = now();
        if (t1 - t0 < best_fwd) best_fwd = t1 - t0;
        if (t2 - t1 < best_bwd) best_bwd = t2 - t1;
    }
    n_out = mpt_tensor_count(&ty);
    if (i < repeat) fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
    else
        printf("{\"bench\":\"layer\",\"layer\":\"%s\",\"policy\":\"%s\",\"threads\":%d,"
               "\"batch\":%lld,\"in\":%lld,\"out\":%lld,\"repeats\":%d,\"forward_ms_min\":%.3f,"
               "\"backward_ms_min\":%.3f}\n",
               layer, policy, threads, (long long)batch, (long long)n_in, (long long)n_out,
               repeat, 1e3 * best_fwd, 1e3 * best_bwd);
    free(x);
    free(dy);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    return i < repeat;
}

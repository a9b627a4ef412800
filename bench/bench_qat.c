/* What quantization-aware training costs: one epoch of fit over the first
   samples of Fashion-MNIST, the seed MLP or cnn_small as
   examples/quantize.c builds them, as a float model and as a
   quantization-aware one (mpt_model_quantize_aware), fresh models each
   round, the two interleaved round after round in one process (which goes
   first alternating): on a shared host only such side-by-side ratios mean
   anything. Prints each round and the median of the rounds' ratios.

       gcc -std=c99 -O2 -I. bench/bench_qat.c -o build/bench_qat -lpthread -lm -lz
       ./build/bench_qat [--model mlp|cnn_small] [--samples 16384] [--rounds 5]
                         [--policy mixed_float16|float32] [--data DIR] */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

/* Samples per second of one epoch, quantization-aware or not; 0 on failure. */
static double epoch_speed(mpt_context *ctx, const mpt_dataset *data, const char *model,
                          mpt_policy policy, int aware) {
    mpt_model *m = NULL;
    double start, seconds;
    mpt_status s;
    if (make_quantize_model(ctx, model, policy, 128, &m) != MPT_OK ||
        (aware && mpt_model_quantize_aware(m, NULL) != MPT_OK)) {
        fprintf(stderr, "bench_qat: %s\n", mpt_context_error(ctx));
        mpt_model_destroy(m);
        return 0;
    }
    start = now();
    s = mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 1, .batch_size = 128});
    seconds = now() - start;
    mpt_model_destroy(m);
    if (s != MPT_OK) fprintf(stderr, "bench_qat: %s\n", mpt_context_error(ctx));
    return s == MPT_OK ? (double)mpt_dataset_count(data) / seconds : 0;
}

int main(int argc, char **argv) {
    const char *model = "mlp", *data_dir = "/usr/share/datasets/fashion-mnist";
    mpt_policy policy = MPT_POLICY_MIXED_FLOAT16;
    int64_t samples = 16384;
    int rounds = 5, i, r;
    double ratio[64];
    mpt_context *ctx;
    mpt_dataset *train, *head = NULL;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--samples")) samples = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--data")) data_dir = argv[i + 1];
        else if (!strcmp(argv[i], "--policy"))
            policy = !strcmp(argv[i + 1], "float32") ? MPT_POLICY_FLOAT32 : MPT_POLICY_MIXED_FLOAT16;
    }
    if (rounds < 1 || rounds > 64 || samples < 2) {
        fprintf(stderr, "%s: --rounds is 1..64 and --samples at least 2\n", argv[0]);
        return 2;
    }
    if (mpt_context_create(NULL, &ctx) != MPT_OK) return 1;
    if (mpt_dataset_load_mnist(ctx, data_dir, 0, &train) != MPT_OK ||
        (samples < mpt_dataset_count(train) &&
         mpt_dataset_split(ctx, train, samples, &head, NULL) != MPT_OK)) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
        return 1;
    }
    for (r = 0; r < rounds; r++) {
        double speed[2];
        int first = r % 2; /* which goes first alternates */
        speed[first] = epoch_speed(ctx, head ? head : train, model, policy, first);
        speed[1 - first] = epoch_speed(ctx, head ? head : train, model, policy, 1 - first);
        if (speed[0] <= 0 || speed[1] <= 0) return 1;
        ratio[r] = speed[1] / speed[0];
        printf("round %d: float %.0f, quantization-aware %.0f samples/s: %.2fx\n", r, speed[0],
               speed[1], ratio[r]);
    }
    printf("{\"model\":\"%s\",\"rounds\":%d,\"qat_speed_vs_float_median\":%.2f}\n", model, rounds,
           median(ratio, rounds));
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

/* Int8 predict against float32 predict, side by side: examples/quantize.c's
   models (mlp, cnn_small), one batch of Fashion-MNIST test images, timed
   in interleaved rounds (float32, full_int8, dynamic_int8, float32, ...)
   so that the shared host's load falls on every variant alike.

       cc -std=c99 -O2 -I. bench/bench_int8_predict.c -o build/bench_int8_predict \
          -lpthread -lm -lz
       ./build/bench_int8_predict --model cnn_small [--weights FILE] [--threads 2]
           [--batch-size 128] [--rounds 15] [--reps 20] [--calibration minmax]
           [--data DIR] [--export DIR] [--serve]

   --weights FILE loads the float32 model's weights when FILE exists, else
   trains one epoch (mixed_float16, seed 1, as quantize.c does) and saves
   them there; without it the model trains each time. full_int8 is
   calibrated on the first 500 training images. A round times --reps
   predicts of the batch per variant and keeps the median; the report is
   each variant's median over rounds and the median of the per-round
   ratios to float32, one JSON line each.

   --export DIR writes DIR/<model>_full_int8.onnx (mpt_model_export_onnx)
   for bench/compare_int8.py. --serve then reads lines "VARIANT REPS" on
   stdin (VARIANT: float32, full_int8 or dynamic_int8) and answers each
   with the median seconds of REPS predicts of the batch, so that the
   script can interleave these with ONNX Runtime's in one run. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <sys/stat.h>
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

#define CHECK(call)                                                                     \
    do {                                                                                \
        if ((call) != MPT_OK) {                                                         \
            fprintf(stderr, "bench_int8_predict: %s\n", mpt_context_error(ctx));          \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

enum { FLOAT32, FULL_INT8, DYNAMIC_INT8, VARIANTS };
static const char *const variant_names[VARIANTS] = {"float32", "full_int8", "dynamic_int8"};

/* The float32 model's weights: loaded from path if it exists, else
   trained for one epoch in mixed_float16 (and saved to path if given). */
static mpt_status get_weights(mpt_context *ctx, const char *name, const char *path,
                              const mpt_dataset *train, int64_t batch, mpt_model *model) {
    struct stat st;
    mpt_model *trained;
    mpt_status s;
    int i;
    if (path && stat(path, &st) == 0) return mpt_model_load_weights(model, path);
    s = make_quantize_model(ctx, name, MPT_POLICY_MIXED_FLOAT16, batch, &trained);
    if (s != MPT_OK) return s;
    s = mpt_model_fit(trained, train, &(mpt_fit_desc){ .epochs = 1, .batch_size = batch });
    for (i = 0; s == MPT_OK && i < mpt_model_param_count(trained); i++) {
        mpt_param_info a, b;
        mpt_model_param(trained, i, &a);
        mpt_model_param(model, i, &b);
        memcpy(b.value.data, a.value.data, mpt_tensor_bytes(&a.value));
    }
    if (s == MPT_OK) mpt_model_refresh_weights(model);
    if (s == MPT_OK && path) s = mpt_model_save_weights(model, path);
    mpt_model_destroy(trained);
    return s;
}

/* Median seconds of reps predicts of the batch. */
static double time_predict(mpt_context *ctx, mpt_model *m, const mpt_dataset *batch,
                           int64_t batch_size, int reps) {
    double t[1000];
    int r;
    if (reps > 1000) reps = 1000;
    for (r = 0; r < reps; r++) {
        mpt_tensor out;
        double start = now();
        if (mpt_model_predict(m, batch, batch_size, &out) != MPT_OK) return -1;
        t[r] = now() - start;
        mpt_tensor_free(ctx, &out);
    }
    return median(t, reps);
}

int main(int argc, char **argv) {
    const char *model_name = "mlp", *weights = NULL, *export_dir = NULL;
    const char *data = "/usr/share/datasets/fashion-mnist", *calibration = "minmax";
    int threads = 2, rounds = 15, reps = 20, serve = 0, i, r, v;
    int64_t batch = 128;
    mpt_calibration calib = MPT_CALIBRATION_MIN_MAX;
    mpt_context *ctx;
    mpt_dataset *train, *test, *first, *rest;
    mpt_model *models[VARIANTS];
    static double seconds[VARIANTS][200], ratio[VARIANTS][200];
    for (i = 1; i < argc; i++) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(flag, "--serve")) { serve = 1; continue; }
        if (!value) break;
        if (!strcmp(flag, "--model")) model_name = value;
        else if (!strcmp(flag, "--weights")) weights = value;
        else if (!strcmp(flag, "--threads")) threads = atoi(value);
        else if (!strcmp(flag, "--batch-size")) batch = atoll(value);
        else if (!strcmp(flag, "--rounds")) rounds = atoi(value);
        else if (!strcmp(flag, "--reps")) reps = atoi(value);
        else if (!strcmp(flag, "--calibration")) calibration = value;
        else if (!strcmp(flag, "--data")) data = value;
        else if (!strcmp(flag, "--export")) export_dir = value;
        else break;
        i++;
    }
    if (!strcmp(calibration, "percentile")) calib = MPT_CALIBRATION_PERCENTILE;
    else if (!strcmp(calibration, "mse")) calib = MPT_CALIBRATION_MSE;
    else if (strcmp(calibration, "minmax")) i = -1;
    if (i != argc || (strcmp(model_name, "mlp") && strcmp(model_name, "cnn_small")) ||
        rounds < 1 || rounds > 200 || reps < 1 || batch < 1) {
        fprintf(stderr, "usage: %s [--model mlp|cnn_small] [--weights FILE] [--threads N]\n"
                        "          [--batch-size N] [--rounds N (<= 200)] [--reps N]\n"
                        "          [--calibration minmax|percentile|mse] [--data DIR]\n"
                        "          [--export DIR] [--serve]\n", argv[0]);
        return 2;
    }
    if (export_dir && mkdir(export_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_int8_predict: cannot create '%s': %s\n", export_dir,
                strerror(errno));
        return 1;
    }
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = threads }, &ctx) != MPT_OK)
        return 1;
    CHECK(mpt_dataset_load_mnist(ctx, data, 0, &train));
    CHECK(mpt_dataset_load_mnist(ctx, data, 1, &test));
    CHECK(mpt_dataset_split(ctx, test, batch, &first, &rest));
    CHECK(make_quantize_model(ctx, model_name, MPT_POLICY_FLOAT32, batch, &models[FLOAT32]));
    CHECK(get_weights(ctx, model_name, weights, train, batch, models[FLOAT32]));
    CHECK(mpt_model_quantize(models[FLOAT32], &(mpt_quantize_desc){
        .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = train,
        .calibration_samples = 500, .calibration = calib }, &models[FULL_INT8]));
    CHECK(mpt_model_quantize(models[FLOAT32], &(mpt_quantize_desc){
        .mode = MPT_QUANTIZE_DYNAMIC_RANGE }, &models[DYNAMIC_INT8]));
    if (export_dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s_full_int8.onnx", export_dir, model_name);
        CHECK(mpt_model_export_onnx(models[FULL_INT8], path, NULL));
        printf("{\"exported\":\"%s\"}\n", path);
        fflush(stdout);
    }
    for (v = 0; v < VARIANTS; v++) /* warm-up: pages, pool, caches */
        if (time_predict(ctx, models[v], first, batch, 3) < 0) CHECK(MPT_ERR_STATE);
    if (serve) {
        char line[256], name[64];
        int n;
        while (fgets(line, sizeof line, stdin) && sscanf(line, "%63s %d", name, &n) == 2) {
            double t = -1;
            for (v = 0; v < VARIANTS; v++)
                if (!strcmp(name, variant_names[v])) t = time_predict(ctx, models[v], first, batch, n);
            printf("%.9f\n", t);
            fflush(stdout);
        }
    } else {
        for (r = 0; r < rounds; r++)
            for (v = 0; v < VARIANTS; v++)
                if ((seconds[v][r] = time_predict(ctx, models[v], first, batch, reps)) < 0)
                    CHECK(MPT_ERR_STATE);
        for (r = 0; r < rounds; r++)
            for (v = 0; v < VARIANTS; v++) ratio[v][r] = seconds[FLOAT32][r] / seconds[v][r];
        for (v = 0; v < VARIANTS; v++)
            printf("{\"bench\":\"int8_predict\",\"model\":\"%s\",\"variant\":\"%s\","
                   "\"batch\":%lld,\"threads\":%d,\"rounds\":%d,\"reps\":%d,"
                   "\"median_ms\":%.4f,\"samples_per_s\":%.0f,\"speedup_vs_float32\":%.3f}\n",
                   model_name, variant_names[v], (long long)batch, threads, rounds, reps,
                   1e3 * median(seconds[v], rounds), (double)batch / median(seconds[v], rounds),
                   median(ratio[v], rounds));
    }
    for (v = 0; v < VARIANTS; v++) mpt_model_destroy(models[v]);
    mpt_dataset_destroy(first);
    mpt_dataset_destroy(rest);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

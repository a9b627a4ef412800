/* Predict in every variant a model deploys as: examples/quantize.c's mlp
   and cnn_small, the seed cnn (examples/cnn.c) and ResNet-20
   (examples/resnet.c's, from examples/resnet20.h), each as float32, float16
   (mpt_model_quantize's FLOAT16: weights stored as float16, computed in
   float32), dynamic_int8 and full_int8, on Fashion-MNIST test images,
   timed in interleaved rounds so that the shared host's load falls on
   every variant alike.

       cc -std=c99 -O2 -I. bench/bench_predict.c -o build/bench_predict \
          -lpthread -lm -lz
       ./build/bench_predict --model cnn_small [--weights FILE] [--threads 2]
           [--batch-size 128] [--rounds 15] [--reps 20] [--calibration minmax]
           [--data DIR] [--export DIR] [--train-samples N] [--serve]

   --weights FILE loads the float32 model's weights when FILE exists, else
   trains one epoch (mixed_float16, seed 1, as quantize.c does) and saves
   them there; without it the model trains each time. --train-samples N
   trains on the first N training images only (a smoke run's weights:
   keep them apart from the real ones). full_int8 is calibrated on the
   first 500 training images. The seed cnn's BatchNormalizations follow a
   ReLU: every variant computes them as a MUL by their scale and an ADD of
   their shift (TFLite's converter's form); ResNet-20's fold into the
   Conv2D before each. A round times --reps
   predicts of one batch per variant and keeps the median; the report is
   each variant's median over rounds and the median of the per-round
   ratios to float32, one JSON line each.

   --export DIR writes DIR/<model>_<variant>.tflite and .onnx for each
   variant (mpt_model_export_tflite, mpt_model_export_onnx) and prints
   {"exported": ...} with their stem. --serve then reads lines
   "VARIANT BATCH REPS" on stdin (BATCH: 1 or --batch-size) and answers
   each with the seconds of each of REPS predicts of that many images, on
   one line (-1 for a variant the model does not have), so that
   bench/compare_deploy.py can interleave them with the runtimes' calls. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <sys/stat.h>
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "../examples/resnet20.h" /* ResNet-20's layers, for common.h */
#include "common.h"
#include "peak.h"

#define CHECK(call)                                                                     \
    do {                                                                                \
        if ((call) != MPT_OK) {                                                         \
            fprintf(stderr, "bench_predict: %s\n", mpt_context_error(ctx));             \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

enum { FLOAT32, FLOAT16, DYNAMIC_INT8, FULL_INT8, VARIANTS };
static const char *const variant_names[VARIANTS] = {"float32", "float16", "dynamic_int8",
                                                    "full_int8"};
#define MAX_REPS 5000

/* The float32 model's weights: loaded from path if it exists, else
   trained for one epoch in mixed_float16 (and saved to path if given). */
static mpt_status get_weights(mpt_context *ctx, const char *name, const char *path,
                              const mpt_dataset *train, int64_t samples, int64_t batch,
                              mpt_model *model) {
    struct stat st;
    mpt_model *trained;
    mpt_dataset *head = NULL;
    mpt_status s;
    int i;
    if (path && stat(path, &st) == 0) return mpt_model_load_weights(model, path);
    s = make_quantize_model(ctx, name, MPT_POLICY_MIXED_FLOAT16, batch, &trained);
    if (s != MPT_OK) return s;
    if (samples > 0 && samples < mpt_dataset_count(train))
        s = mpt_dataset_split(ctx, train, samples, &head, NULL);
    if (s == MPT_OK)
        s = mpt_model_fit(trained, head ? head : train,
                          &(mpt_fit_desc){ .epochs = 1, .batch_size = batch });
    mpt_dataset_destroy(head);
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

/* The seconds of each of reps predicts of the images in `batch` into t;
   0 or an error status. */
static mpt_status time_predicts(mpt_context *ctx, mpt_model *m, const mpt_dataset *batch,
                                int reps, double *t) {
    int r;
    for (r = 0; r < reps; r++) {
        mpt_tensor out;
        double start = now();
        mpt_status s = mpt_model_predict(m, batch, mpt_dataset_count(batch), &out);
        if (s != MPT_OK) return s;
        t[r] = now() - start;
        mpt_tensor_free(ctx, &out);
    }
    return MPT_OK;
}

/* The median seconds of reps predicts, or -1. */
static double median_predict(mpt_context *ctx, mpt_model *m, const mpt_dataset *batch,
                             int reps) {
    static double t[MAX_REPS];
    if (reps > MAX_REPS) reps = MAX_REPS;
    return time_predicts(ctx, m, batch, reps, t) == MPT_OK ? median(t, reps) : -1;
}

/* models[v] for every variant the float32 model has: a refusal of
   quantization leaves NULL and says why on stderr. */
static void make_variants(mpt_context *ctx, mpt_model **models, const mpt_dataset *train,
                          mpt_calibration calib) {
    static const mpt_quantize_mode modes[VARIANTS] = {
        MPT_QUANTIZE_MODE_COUNT_, MPT_QUANTIZE_FLOAT16, MPT_QUANTIZE_DYNAMIC_RANGE,
        MPT_QUANTIZE_FULL_INTEGER};
    int v;
    for (v = FLOAT16; v < VARIANTS; v++) {
        mpt_quantize_desc q;
        memset(&q, 0, sizeof q);
        q.mode = modes[v];
        if (v == FULL_INT8) {
            q.representative_data = train;
            q.calibration_samples = 500;
            q.calibration = calib;
        }
        models[v] = NULL;
        if (mpt_model_quantize(models[FLOAT32], &q, &models[v]) != MPT_OK)
            fprintf(stderr, "bench_predict: no %s variant: %s\n", variant_names[v],
                    mpt_context_error(ctx));
    }
}

/* DIR/<model>_<variant>.tflite and .onnx for every variant there is. */
static mpt_status export_variants(mpt_context *ctx, mpt_model **models, const char *dir,
                                  const char *model_name) {
    char path[4096];
    int v;
    mpt_status s = MPT_OK;
    for (v = 0; v < VARIANTS && s == MPT_OK; v++) {
        if (!models[v]) continue;
        snprintf(path, sizeof path, "%s/%s_%s.tflite", dir, model_name, variant_names[v]);
        s = mpt_model_export_tflite(models[v], path, NULL);
        snprintf(path, sizeof path, "%s/%s_%s.onnx", dir, model_name, variant_names[v]);
        if (s == MPT_OK) s = mpt_model_export_onnx(models[v], path, NULL);
    }
    (void)ctx;
    if (s == MPT_OK) printf("{\"exported\":\"%s/%s\"}\n", dir, model_name);
    fflush(stdout);
    return s;
}

/* --serve: "VARIANT BATCH REPS" lines answered with each predict's seconds;
   a "peak" line with the FMA peak (bench/peak.h) of one thread and of the
   context's threads, in GFLOP/s: whether they ran on as many cores. */
static void serve(mpt_context *ctx, mpt_model **models, const mpt_dataset *one,
                  const mpt_dataset *batch) {
    static double t[MAX_REPS];
    const int lanes = mpt_context_cpu_features(ctx) & MPT_CPU_AVX512 ? 16 : 8;
    char line[256], name[64];
    long long images;
    int reps, v, r;
    while (fgets(line, sizeof line, stdin)) {
        const mpt_dataset *d;
        mpt_model *m = NULL;
        if (!strncmp(line, "peak", 4)) {
            printf("%.1f %.1f\n", measure_peak_iters(ctx, lanes, 500000L, 1),
                   measure_peak_iters(ctx, lanes, 500000L, ctx->num_threads));
            fflush(stdout);
            continue;
        }
        if (sscanf(line, "%63s %lld %d", name, &images, &reps) != 3) break;
        d = images == 1 ? one : batch;
        if (reps > MAX_REPS) reps = MAX_REPS;
        for (v = 0; v < VARIANTS; v++)
            if (!strcmp(name, variant_names[v])) m = models[v];
        if (!m || (images != 1 && images != mpt_dataset_count(batch)) || reps < 1 ||
            time_predicts(ctx, m, d, reps, t) != MPT_OK) {
            printf("-1\n");
        } else {
            for (r = 0; r < reps; r++) printf(r ? " %.9f" : "%.9f", t[r]);
            printf("\n");
        }
        fflush(stdout);
    }
}

int main(int argc, char **argv) {
    const char *model_name = "mlp", *weights = NULL, *export_dir = NULL;
    const char *data = "/usr/share/datasets/fashion-mnist", *calibration = "minmax";
    int threads = 2, rounds = 15, reps = 20, serving = 0, i, r, v;
    int64_t batch = 128, train_samples = 0;
    mpt_calibration calib = MPT_CALIBRATION_MIN_MAX;
    mpt_context *ctx;
    mpt_dataset *train, *test, *first, *rest, *one, *others;
    mpt_model *models[VARIANTS];
    static double seconds[VARIANTS][200], ratio[VARIANTS][200];
    for (i = 1; i < argc; i++) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(flag, "--serve")) { serving = 1; continue; }
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
        else if (!strcmp(flag, "--train-samples")) train_samples = atoll(value);
        else break;
        i++;
    }
    if (!strcmp(calibration, "percentile")) calib = MPT_CALIBRATION_PERCENTILE;
    else if (!strcmp(calibration, "mse")) calib = MPT_CALIBRATION_MSE;
    else if (strcmp(calibration, "minmax")) i = -1;
    if (i != argc ||
        (strcmp(model_name, "mlp") && strcmp(model_name, "cnn_small") &&
         strcmp(model_name, "cnn") && strcmp(model_name, "resnet")) ||
        rounds < 1 || rounds > 200 || reps < 1 || batch < 2 || train_samples < 0) {
        fprintf(stderr, "usage: %s [--model mlp|cnn_small|cnn|resnet] [--weights FILE]\n"
                        "          [--threads N] [--batch-size N (>= 2)] [--rounds N (<= 200)]\n"
                        "          [--reps N] [--calibration minmax|percentile|mse] [--data DIR]\n"
                        "          [--export DIR] [--train-samples N] [--serve]\n", argv[0]);
        return 2;
    }
    if (export_dir && mkdir(export_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_predict: cannot create '%s': %s\n", export_dir, strerror(errno));
        return 1;
    }
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = threads }, &ctx) != MPT_OK)
        return 1;
    CHECK(mpt_dataset_load_mnist(ctx, data, 0, &train));
    CHECK(mpt_dataset_load_mnist(ctx, data, 1, &test));
    CHECK(mpt_dataset_split(ctx, test, batch, &first, &rest));
    CHECK(mpt_dataset_split(ctx, test, 1, &one, &others));
    CHECK(make_quantize_model(ctx, model_name, MPT_POLICY_FLOAT32, batch, &models[FLOAT32]));
    CHECK(get_weights(ctx, model_name, weights, train, train_samples, batch, models[FLOAT32]));
    make_variants(ctx, models, train, calib);
    if (export_dir) CHECK(export_variants(ctx, models, export_dir, model_name));
    for (v = 0; v < VARIANTS; v++) /* warm-up: pages, pool, caches */
        if (models[v] && (median_predict(ctx, models[v], first, 3) < 0 ||
                          median_predict(ctx, models[v], one, 3) < 0))
            CHECK(MPT_ERR_STATE);
    if (serving) {
        serve(ctx, models, one, first);
    } else {
        for (r = 0; r < rounds; r++)
            for (v = 0; v < VARIANTS; v++)
                if (models[v] && (seconds[v][r] = median_predict(ctx, models[v], first, reps)) < 0)
                    CHECK(MPT_ERR_STATE);
        for (r = 0; r < rounds; r++)
            for (v = 0; v < VARIANTS; v++) ratio[v][r] = seconds[FLOAT32][r] / seconds[v][r];
        for (v = 0; v < VARIANTS; v++)
            if (models[v])
                printf("{\"bench\":\"predict\",\"model\":\"%s\",\"variant\":\"%s\","
                       "\"batch\":%lld,\"threads\":%d,\"rounds\":%d,\"reps\":%d,"
                       "\"median_ms\":%.4f,\"samples_per_s\":%.0f,\"speedup_vs_float32\":%.3f}\n",
                       model_name, variant_names[v], (long long)batch, threads, rounds, reps,
                       1e3 * median(seconds[v], rounds),
                       (double)batch / median(seconds[v], rounds), median(ratio[v], rounds));
    }
    for (v = 0; v < VARIANTS; v++) mpt_model_destroy(models[v]);
    mpt_dataset_destroy(one);
    mpt_dataset_destroy(others);
    mpt_dataset_destroy(first);
    mpt_dataset_destroy(rest);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

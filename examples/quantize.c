/* Post-training quantization on Fashion-MNIST, as TFLiteConverter does it:
   train (or load) a model, then make every variant and measure each on
   the test set.
       float32       the trained weights, computed in float32
       float16       weights stored as float16 (Optimize.DEFAULT with
                     supported_types = [tf.float16])
       dynamic_int8  int8 weights per channel, activations quantized per
                     batch as they come (Optimize.DEFAULT)
       full_int8     int8 weights and activations, ranges calibrated on 500
                     training images (TFLITE_BUILTINS_INT8 with a
                     representative dataset)
       qat_int8      the trained model fine-tuned for --qat-epochs with the
                     int8 rounding in its forward pass (tfmot's
                     quantize_model), Adam at --qat-learning-rate (a tenth
                     of training's: a fresh optimizer at the full rate
                     first undoes some of what training reached), then
                     converted to full integer with the ranges training
                     learned: no representative dataset
   After training, the line every example prints; then one JSON line per
   variant: test accuracy, bytes of weights as stored, predict speed (the
   fastest of three passes over the test set in batches of --batch-size),
   and the files --export wrote for it.

   --export DIR writes DIR/<model>_float32.tflite and .onnx, and
   DIR/<model>_float16.tflite and .onnx (weights stored as float16), with
   mpt_model_export_tflite / mpt_model_export_onnx, and names them in those
   variants' lines ("tflite":"PATH","onnx":"PATH"); DIR is created if
   missing. The quantized models go to DIR/<model>_dynamic_int8.tflite
   and .onnx (mpt_model_export_tflite / _onnx of the quantized model: int8
   kernels read by TFLite's hybrid ops and by ONNX's MatMulInteger and
   ConvInteger, float32 activations) and DIR/<model>_full_int8.tflite and
   .onnx (int8 operations in TFLite, the QDQ form in ONNX; float32 input
   and output); qat_int8 to DIR/<model>_qat_int8.tflite and .onnx as
   full_int8.

   Build: cc -O2 quantize.c -lpthread -lm -lz -o quantize   (in examples/)
   Run:   ./quantize [--model mlp|cnn_small|cnn] [--weights FILE] [--epochs 1]
                     [--policy ...] [--batch-size 128] [--threads N] [--data DIR]
                     [--calibration-samples 500] [--calibration minmax|percentile|mse]
                     [--qat-epochs 1] [--qat-learning-rate 0.0001]
                     [--verbose 0] [--tensorboard DIR]
                     [--plot FILE] [--profile DIR] [--export DIR]
   --weights FILE loads a model saved by mpt_model_save_weights instead of
   training it (the model's architecture must match the file's).
   --calibration picks how full_int8 takes each tensor's range from the
   calibration images: minmax (the default), percentile (99.99) or mse
   (the range of least quantization error, MPT_CALIBRATION_MSE).
   --model cnn is the seed cnn (cnn.c's layers): its BatchNormalizations
   follow a ReLU, so each quantized variant computes them as a MUL by their
   scale and an ADD of their shift, as TFLite's converter writes them; it
   has no qat_int8 (quantization-aware training refuses such a
   BatchNormalization, and this says so). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <float.h>
#include <sys/stat.h>
#include <time.h>
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Takes "--name VALUE" out of argv (the other flags are common.h's);
   returns VALUE or fallback. */
static const char *take_flag(int *argc, char **argv, const char *name, const char *fallback) {
    int i;
    for (i = 1; i + 1 < *argc; i++)
        if (!strcmp(argv[i], name)) {
            const char *value = argv[i + 1];
            memmove(argv + i, argv + i + 2, sizeof(char *) * (size_t)(*argc - i - 2));
            *argc -= 2;
            return value;
        }
    return fallback;
}

/* --qat-learning-rate's value, all of it a number from 0 (Keras' default)
   to float32's largest: atof would read "abc" as 0. Returns 0 after
   saying what is wrong. */
static int read_rate(const char *program, const char *value, float *rate) {
    char *end;
    double r = strtod(value, &end);
    if (end == value || *end || !(r >= 0) || r > FLT_MAX) {
        fprintf(stderr, "%s: --qat-learning-rate takes a number from 0, not \"%s\"\n", program,
                value);
        return 0;
    }
    *rate = (float)r;
    return 1;
}

/* The seed MLP, cnn_small or the seed cnn (cnn.c's layers), compiled (Adam
at learning_rate; 0: Keras' default) and built. */
static mpt_status make_model(mpt_context *ctx, const char *name, mpt_policy policy,
                             float learning_rate, const options *o, mpt_model **out) {
    mpt_model *m;
    mpt_status s = mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 },
                                                            .input_rank = 3, .policy = policy,
                                                            .seed = o->seed }, &m);
    if (s != MPT_OK) return s;
    if (!strcmp(name, "cnn")) { /* two blocks of Conv2D -> BN -> Conv2D -> pool, as cnn.c */
        int64_t filters;
        for (filters = 32; filters <= 64; filters *= 2) {
            mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = filters,
                                                        .kernel_size = { 3, 3 },
                                                        .activation = MPT_ACT_RELU });
            mpt_model_add_batch_normalization(m, NULL);
            mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = filters,
                                                        .kernel_size = { 3, 3 },
                                                        .activation = MPT_ACT_RELU });
            mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
            mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.25f });
        }
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 512, .activation = MPT_ACT_RELU });
        mpt_model_add_batch_normalization(m, NULL);
        mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.5f });
    } else if (!strcmp(name, "cnn_small")) {
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = 32, .kernel_size = { 3, 3 },
                                                    .activation = MPT_ACT_RELU });
        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 128, .activation = MPT_ACT_RELU });
    } else {
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 1024, .activation = MPT_ACT_RELU });
    }
    mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10, .activation = MPT_ACT_SOFTMAX });
    s = mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = { .type = MPT_OPTIMIZER_ADAM, .learning_rate = learning_rate },
        .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
        .metrics = MPT_METRIC_ACCURACY });
    if (s == MPT_OK) s = mpt_model_build(m, o->batch_size);
    if (s != MPT_OK) mpt_model_destroy(m);
    else *out = m;
    return s;
}

/* from's float32 masters into to (the same architecture). */
static mpt_status copy_weights(mpt_model *from, mpt_model *to) {
    int i;
    for (i = 0; i < mpt_model_param_count(from); i++) {
        mpt_param_info a = {0}, b = {0}; /* (filled on MPT_OK; -O3 cannot tell) */
        mpt_status s = mpt_model_param(from, i, &a);
        if (s == MPT_OK) s = mpt_model_param(to, i, &b);
        if (s != MPT_OK) return s;
        memcpy(b.value.data, a.value.data, mpt_tensor_bytes(&a.value));
    }
    mpt_model_refresh_weights(to);
    return MPT_OK;
}

/* The files one variant was exported to (written 0: none). */
typedef struct exported {
    char tflite[4096], onnx[4096];
    int written;
} exported;

/* m as dir/<model>_<variant>.tflite and .onnx, its weights stored as
   weight_dtype (the files compute in float32 either way). */
static mpt_status export_variant(mpt_model *m, const char *dir,
                                 const char *model_name, const char *variant,
                                 mpt_dtype weight_dtype, exported *files) {
    mpt_export_desc desc = { .weight_dtype = weight_dtype };
    mpt_status s;
    snprintf(files->tflite, sizeof files->tflite, "%s/%s_%s.tflite", dir, model_name, variant);
    snprintf(files->onnx, sizeof files->onnx, "%s/%s_%s.onnx", dir, model_name, variant);
    s = mpt_model_export_tflite(m, files->tflite, &desc);
    if (s == MPT_OK) s = mpt_model_export_onnx(m, files->onnx, &desc);
    files->written = s == MPT_OK;
    return s;
}

/* A quantized model q (dynamic range or full integer) as
   dir/<model>_<variant>.tflite and .onnx. */
static mpt_status export_quantized_variant(mpt_model *q, const char *dir, const char *model_name,
                                      const char *variant, exported *files) {
    mpt_status s;
    snprintf(files->tflite, sizeof files->tflite, "%s/%s_%s.tflite", dir, model_name, variant);
    snprintf(files->onnx, sizeof files->onnx, "%s/%s_%s.onnx", dir, model_name, variant);
    s = mpt_model_export_tflite(q, files->tflite, NULL);
    if (s == MPT_OK) s = mpt_model_export_onnx(q, files->onnx, NULL);
    files->written = s == MPT_OK;
    return s;
}

/* text as a JSON string (quotes and backslashes escaped), or null. */
static void print_json_string(const char *text) {
    if (!text) {
        fputs("null", stdout);
        return;
    }
    putchar('"');
    for (; *text; text++) {
        if (*text == '"' || *text == '\\') putchar('\\');
        if ((unsigned char)*text < 0x20) printf("\\u%04x", (unsigned char)*text);
        else putchar(*text);
    }
    putchar('"');
}

/* Accuracy and predict's speed over the test set, one JSON line naming
   the exported files (null where none). */
static mpt_status report(mpt_context *ctx, mpt_model *m, const char *model_name,
                         const char *variant, int64_t size_bytes, const mpt_dataset *test,
                         int64_t batch_size, const exported *files) {
    mpt_logs logs;
    mpt_tensor out;
    double seconds = INFINITY;
    int run;
    mpt_status s = mpt_model_evaluate(m, test, &(mpt_evaluate_desc){ .batch_size = batch_size },
                                      &logs);
    /* the fastest of three passes over the test set */
    for (run = 0; s == MPT_OK && run < 3; run++) {
        double start = now();
        s = mpt_model_predict(m, test, batch_size, &out);
        if (now() - start < seconds) seconds = now() - start;
        if (s == MPT_OK && run < 2) mpt_tensor_free(ctx, &out);
    }
    if (s != MPT_OK) return s;
    printf("{\"model\":\"%s\",\"variant\":\"%s\",\"test_accuracy\":%.4f,\"size_bytes\":%lld,"
           "\"predict_samples_per_s\":%.0f,\"threads\":%d,\"tflite\":",
           model_name, variant, mpt_logs_get(&logs, "accuracy"), (long long)size_bytes,
           (double)out.shape[0] / seconds, mpt_context_num_threads(ctx));
    print_json_string(files->written ? files->tflite : NULL);
    fputs(",\"onnx\":", stdout);
    print_json_string(files->written ? files->onnx : NULL);
    fputs("}\n", stdout);
    fflush(stdout);
    mpt_tensor_free(ctx, &out);
    return MPT_OK;
}

int main(int argc, char **argv) {
    options o = default_options(1);
    const char *model_name = take_flag(&argc, argv, "--model", "mlp");
    const char *weights = take_flag(&argc, argv, "--weights", NULL);
    const char *calibration_text = take_flag(&argc, argv, "--calibration-samples", "500");
    const char *export_dir = take_flag(&argc, argv, "--export", NULL);
    const char *calibration_name = take_flag(&argc, argv, "--calibration", "minmax");
    mpt_calibration calibration_method = MPT_CALIBRATION_MIN_MAX;
    const char *qat_epochs_text = take_flag(&argc, argv, "--qat-epochs", "1");
    const char *qat_rate_text = take_flag(&argc, argv, "--qat-learning-rate", "0.0001");
    static const struct { const char *name; mpt_quantize_mode mode; } variants[] = {
        { "float16", MPT_QUANTIZE_FLOAT16 },
        { "dynamic_int8", MPT_QUANTIZE_DYNAMIC_RANGE },
        { "full_int8", MPT_QUANTIZE_FULL_INTEGER } };
    mpt_context *ctx;
    mpt_model *trained, *model;
    mpt_dataset *train, *test;
    int64_t calibration, float_bytes = 0;
    exported files = { .written = 0 };
    unsigned long long n;
    int i, qat_epochs;
    float qat_rate;
    o.verbose = 0; /* the result lines only */
    if (!parse_options(argc, argv, &o)) return 2;
    if (!read_number(argv[0], "--calibration-samples", calibration_text, INT64_MAX, &n)) return 2;
    calibration = (int64_t)n;
    if (!read_number(argv[0], "--qat-epochs", qat_epochs_text, INT_MAX, &n)) return 2;
    qat_epochs = (int)n;
    if (!read_rate(argv[0], qat_rate_text, &qat_rate)) return 2;
    if (!strcmp(calibration_name, "percentile")) calibration_method = MPT_CALIBRATION_PERCENTILE;
    else if (!strcmp(calibration_name, "mse")) calibration_method = MPT_CALIBRATION_MSE;
    else if (strcmp(calibration_name, "minmax")) {
        fprintf(stderr, "%s: --calibration is minmax, percentile or mse, not %s\n", argv[0],
                calibration_name);
        return 2;
    }
    if (strcmp(model_name, "mlp") && strcmp(model_name, "cnn_small") && strcmp(model_name, "cnn")) {
        fprintf(stderr, "%s: --model is mlp, cnn_small or cnn, not %s\n", argv[0], model_name);
        return 2;
    }
    if (export_dir && mkdir(export_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "%s: --export: cannot create directory '%s': %s\n", argv[0], export_dir,
                strerror(errno));
        return 1;
    }
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = o.threads }, &ctx) != MPT_OK)
        return 1;
    TRY(mpt_dataset_load_mnist(ctx, o.data, 0, &train));
    TRY(mpt_dataset_load_mnist(ctx, o.data, 1, &test));

    /* Train in the policy asked for (or load), then measure in float32.
       Training ends with the line every example prints. */
    TRY(make_model(ctx, model_name, o.policy, 0, &o, &trained));
    if (weights) {
        TRY(mpt_model_load_weights(trained, weights));
    } else {
        TRY(fit_with_flags(ctx, &o, trained, train, NULL, NULL, 0));
        TRY(evaluate_and_report(ctx, &o, trained, model_name, test));
    }
    TRY(make_model(ctx, model_name, MPT_POLICY_FLOAT32, 0, &o, &model));
    TRY(copy_weights(trained, model));
    for (i = 0; i < mpt_model_param_count(model); i++) {
        mpt_param_info p;
        mpt_model_param(model, i, &p);
        float_bytes += (int64_t)mpt_tensor_bytes(&p.value);
    }
    if (export_dir)
        TRY(export_variant(model, export_dir, model_name, "float32", MPT_DTYPE_DEFAULT, &files));
    TRY(report(ctx, model, model_name, "float32", float_bytes, test, o.batch_size, &files));

    for (i = 0; i < 3; i++) {
        mpt_model *q;
        mpt_quantized_info info;
        TRY(mpt_model_quantize(model, &(mpt_quantize_desc){
            .mode = variants[i].mode,
            .representative_data = train, /* its first calibration_samples images */
            .calibration_samples = calibration,
            .calibration = calibration_method }, &q));
        mpt_model_quantized_info(q, &info);
        /* The float16 files come from the float model, its weights stored
           as float16 on the way out; the int8 variants' .tflite and .onnx from q. */
        files.written = 0;
        if (export_dir && variants[i].mode == MPT_QUANTIZE_FLOAT16)
            TRY(export_variant(model, export_dir, model_name, variants[i].name, MPT_FLOAT16,
                               &files));
        else if (export_dir)
            TRY(export_quantized_variant(q, export_dir, model_name, variants[i].name, &files));
        TRY(report(ctx, q, model_name, variants[i].name, info.size_bytes, test, o.batch_size,
                   &files));
        mpt_model_destroy(q);
    }

    /* Quantization-aware training: the trained weights fine-tuned in the
       training policy with the int8 rounding in every forward pass, then
       converted with the ranges they were trained with. */
    if (qat_epochs > 0) {
        mpt_model *aware, *q;
        mpt_quantized_info info;
        mpt_status s;
        TRY(make_model(ctx, model_name, o.policy, qat_rate, &o, &aware));
        TRY(copy_weights(trained, aware));
        s = mpt_model_quantize_aware(aware, NULL);
        if (s == MPT_ERR_UNSUPPORTED) /* the seed cnn: BatchNormalizations after a ReLU */
            fprintf(stderr, "%s: no qat_int8 for --model %s (the error above says why)\n",
                    argv[0], model_name);
        else
            TRY(s);
        if (s == MPT_OK) {
            TRY(mpt_model_fit(aware, train, &(mpt_fit_desc){ .epochs = qat_epochs,
                                                             .batch_size = o.batch_size,
                                                             .verbose = o.verbose }));
            TRY(mpt_model_quantize(aware, &(mpt_quantize_desc){
                .mode = MPT_QUANTIZE_FULL_INTEGER }, &q));
            mpt_model_quantized_info(q, &info);
            files.written = 0;
            if (export_dir)
                TRY(export_quantized_variant(q, export_dir, model_name, "qat_int8", &files));
            TRY(report(ctx, q, model_name, "qat_int8", info.size_bytes, test, o.batch_size,
                       &files));
            mpt_model_destroy(q);
        }
        mpt_model_destroy(aware);
    }

    mpt_model_destroy(model);
    mpt_model_destroy(trained);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(train);
    mpt_context_destroy(ctx);
    return 0;
}

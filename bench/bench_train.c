/* Training-speed benchmark: samples/s of one epoch of mpt_model_fit on
   Fashion-MNIST, for the seed MLP, the small CNN (examples/cnn_small.c) and
   the CNN (examples/cnn.c) under each precision policy,
   and the time per step split into forward (with the loss), backward and
   update, as fit records them in the model's history.

       gcc -std=c99 -O2 -I. bench/bench_train.c -o build/bench_train -lpthread -lm -lz
       ./build/bench_train                       (every model and policy; ~1 min)
       ./build/bench_train --model mlp --policy float32 --repeat 3

   Flags (defaults in brackets):
       --model mlp|cnn_small|cnn|all [all]
       --policy float32|mixed_float16|mixed_bfloat16|all [all]
       --threads N         [2]    the context's pool (mpt_context_desc.num_threads)
       --batch-size N      [128]
       --mlp-samples N     [60000] the first N training images (the whole set)
       --cnn-small-samples N [12800] the first N training images (100
                                   batches) for cnn_small
       --cnn-samples N     [6400]  the first N training images (50 batches),
                                   to keep the CNN's run short
       --warmup-samples N  [1280]  a short fit of the same model before the
                                   measured one (builds it, warms caches)
       --repeat N          [1]    measured one-epoch fits per result; the
                                   median is reported, with the min and max
       --data DIR          [/usr/share/datasets/fashion-mnist]

   Every model: batch 128, Adam 1e-3, sparse categorical crossentropy on a
   final softmax (fit fuses the softmax into the loss), shuffled every epoch,
   no metrics (the PyTorch twin, bench/torch_train.py, computes none either).

   Prints a Markdown table and one JSON line per result. samples_per_s is
   the history's "samples_per_second" (samples / wall time of the epoch,
   data loading included); forward_ms, backward_ms and update_ms are
   "forward_ms_per_step", "backward_ms_per_step" and "update_ms_per_step";
   other_ms is the rest of a step's wall time (waiting for the loader's
   batch, bookkeeping). */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REPEAT 32

typedef struct options {
    const char *model;   /* "mlp", "cnn_small", "cnn" or "all" */
    const char *policy;  /* a policy name or "all" */
    int threads;
    int64_t batch_size;
    int64_t mlp_samples, cnn_small_samples, cnn_samples, warmup_samples;
    int repeat;
    const char *data;
} options;

static const char *const policy_names[3] = {"float32", "mixed_float16", "mixed_bfloat16"};
static const mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                       MPT_POLICY_MIXED_BFLOAT16};

/* One measured fit's numbers, from the history's only epoch. */
typedef struct result {
    double samples_per_s, forward_ms, backward_ms, update_ms, other_ms;
} result;

static int parse_options(int argc, char **argv, options *o) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *flag = argv[i], *value = argv[i + 1];
        if (!strcmp(flag, "--model")) o->model = value;
        else if (!strcmp(flag, "--policy")) o->policy = value;
        else if (!strcmp(flag, "--threads")) o->threads = atoi(value);
        else if (!strcmp(flag, "--batch-size")) o->batch_size = atoll(value);
        else if (!strcmp(flag, "--mlp-samples")) o->mlp_samples = atoll(value);
        else if (!strcmp(flag, "--cnn-small-samples")) o->cnn_small_samples = atoll(value);
        else if (!strcmp(flag, "--cnn-samples")) o->cnn_samples = atoll(value);
        else if (!strcmp(flag, "--warmup-samples")) o->warmup_samples = atoll(value);
        else if (!strcmp(flag, "--repeat")) o->repeat = atoi(value);
        else if (!strcmp(flag, "--data")) o->data = value;
        else break;
    }
    if (i != argc || o->threads < 1 || o->batch_size < 1 || o->mlp_samples < 1 ||
        o->cnn_small_samples < 1 || o->cnn_samples < 1 || o->warmup_samples < 1 || o->repeat < 1 || o->repeat > MAX_REPEAT ||
        (strcmp(o->model, "mlp") && strcmp(o->model, "cnn_small") && strcmp(o->model, "cnn") &&
         strcmp(o->model, "all")) ||
        (strcmp(o->policy, "all") && strcmp(o->policy, policy_names[0]) &&
         strcmp(o->policy, policy_names[1]) && strcmp(o->policy, policy_names[2]))) {
        fprintf(stderr,
                "usage: %s [--model mlp|cnn_small|cnn|all] [--policy float32|mixed_float16|"
                "mixed_bfloat16|all]\n"
                "          [--threads N] [--batch-size N] [--mlp-samples N]\n"
                "          [--cnn-small-samples N] [--cnn-samples N]\n"
                "          [--warmup-samples N] [--repeat 1..%d] [--data DIR]\n",
                argv[0], MAX_REPEAT);
        return 0;
    }
    return 1;
}

/* ---- the three models -------------------------------------------------------- */

/* Flatten -> Dense(1024, relu) -> Dense(10, softmax) */
static mpt_status add_mlp(mpt_model *m) {
    mpt_status s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 1024,
                                                                   .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10,
                                                                   .activation = MPT_ACT_SOFTMAX });
    return s;
}

/* examples/cnn_small.c: Conv2D(32, 3, relu) -> MaxPool(2) -> Flatten ->
   Dense(128, relu) -> Dense(10, softmax) */
static mpt_status add_cnn_small(mpt_model *m) {
    mpt_status s = mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = 32,
                                                               .kernel_size = { 3, 3 },
                                                               .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
    if (s == MPT_OK) s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 128,
                                                                   .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10,
                                                                   .activation = MPT_ACT_SOFTMAX });
    return s;
}

/* Conv2D(f, 3, relu) -> BN -> Conv2D(f, 3, relu) -> MaxPool(2) -> Dropout(0.25) */
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

/* The examples/cnn.c model: two conv blocks (32, 64 filters), Flatten,
   Dense(512, relu), BN, Dropout(0.5), Dense(10, softmax). */
static mpt_status add_cnn(mpt_model *m) {
    mpt_status s = add_conv_block(m, 32);
    if (s == MPT_OK) s = add_conv_block(m, 64);
    if (s == MPT_OK) s = mpt_model_add_flatten(m, NULL);
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 512,
                                                                   .activation = MPT_ACT_RELU });
    if (s == MPT_OK) s = mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){ 0 });
    if (s == MPT_OK) s = mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.5f });
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10,
                                                                   .activation = MPT_ACT_SOFTMAX });
    return s;
}

#define N_MODELS 3
static const char *const model_names[N_MODELS] = {"mlp", "cnn_small", "cnn"};
static mpt_status (*const add_model[N_MODELS])(mpt_model *) = {add_mlp, add_cnn_small, add_cnn};

/* ---- measuring ------------------------------------------------------------------ */

static double history_last(const mpt_model *m, const char *key) {
    mpt_history h;
    int k;
    if (mpt_model_history(m, &h) != MPT_OK || h.epochs < 1) return 0;
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], key)) return h.values[k][h.epochs - 1];
    return 0;
}

/* Builds the model, fits it once on `warmup`, then `repeat` times for one
   epoch on `train`, each fit's numbers into r[]. */
static mpt_status measure(mpt_context *ctx, int model, mpt_policy policy, const options *o,
                          const mpt_dataset *warmup, const mpt_dataset *train, result *r) {
    mpt_model *m = NULL;
    mpt_fit_desc fit = { .epochs = 1, .batch_size = o->batch_size };
    int64_t steps = (mpt_dataset_count(train) + o->batch_size - 1) / o->batch_size;
    mpt_status s;
    int i;
    s = mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 }, .input_rank = 3,
                                                 .policy = policy, .seed = 42 }, &m);
    if (s == MPT_OK) s = add_model[model](m);
    if (s == MPT_OK)
        s = mpt_model_compile(m, &(mpt_compile_desc){
            .optimizer = { .type = MPT_OPTIMIZER_ADAM, .learning_rate = 1e-3f },
            .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY } });
    if (s == MPT_OK) s = mpt_model_build(m, o->batch_size);
    if (s == MPT_OK) s = mpt_model_fit(m, warmup, &fit);
    for (i = 0; s == MPT_OK && i < o->repeat; i++) {
        double step_ms;
        s = mpt_model_fit(m, train, &fit);
        if (s != MPT_OK) break;
        r[i].samples_per_s = history_last(m, "samples_per_second");
        r[i].forward_ms = history_last(m, "forward_ms_per_step");
        r[i].backward_ms = history_last(m, "backward_ms_per_step");
        r[i].update_ms = history_last(m, "update_ms_per_step");
        step_ms = 1e3 * history_last(m, "epoch_seconds") / (double)steps;
        r[i].other_ms = step_ms - r[i].forward_ms - r[i].backward_ms - r[i].update_ms;
    }
    mpt_model_destroy(m);
    return s;
}

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values (the mean of the middle two when n is even). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, compare_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Each field's median over n results (and the samples/s range). */
static result summarize(const result *r, int n, double *min_sps, double *max_sps) {
    double v[5][MAX_REPEAT];
    result out;
    int i;
    for (i = 0; i < n; i++) {
        v[0][i] = r[i].samples_per_s;
        v[1][i] = r[i].forward_ms;
        v[2][i] = r[i].backward_ms;
        v[3][i] = r[i].update_ms;
        v[4][i] = r[i].other_ms;
    }
    out.samples_per_s = median(v[0], n);
    *min_sps = v[0][0]; /* sorted by median() */
    *max_sps = v[0][n - 1];
    out.forward_ms = median(v[1], n);
    out.backward_ms = median(v[2], n);
    out.update_ms = median(v[3], n);
    out.other_ms = median(v[4], n);
    return out;
}

static void cpu_name(char *buf, size_t size) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, size, "?");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(buf, size, "%s", strchr(line, ':') + 2);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    fclose(f);
}

int main(int argc, char **argv) {
    options o = {"all", "all", 2, 128, 60000, 12800, 6400, 1280, 1,
                 "/usr/share/datasets/fashion-mnist"};
    mpt_context *ctx = NULL;
    mpt_dataset *all = NULL, *parts[1 + N_MODELS][2] = {{NULL, NULL}};
    char cpu[256], json[N_MODELS][3][512];
    int mi, pi, ran = 0, rc = 0, features;
    if (!parse_options(argc, argv, &o)) return 2;
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = o.threads }, &ctx) != MPT_OK) {
        fprintf(stderr, "%s: cannot create a context\n", argv[0]);
        return 1;
    }
    if (mpt_dataset_load_mnist(ctx, o.data, 0, &all) != MPT_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
        mpt_context_destroy(ctx);
        return 1;
    }
    {
        /* the first N images: warm-up, mlp, cnn_small, cnn */
        int64_t n = mpt_dataset_count(all), want[1 + N_MODELS];
        int k;
        want[0] = o.warmup_samples;
        want[1] = o.mlp_samples;
        want[2] = o.cnn_small_samples;
        want[3] = o.cnn_samples;
        for (k = 0; k < 1 + N_MODELS; k++) {
            if (want[k] > n) want[k] = n;
            if (want[k] < n &&
                mpt_dataset_split(ctx, all, want[k], &parts[k][0], &parts[k][1]) != MPT_OK) {
                fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
                rc = 1;
            }
        }
        if (o.mlp_samples > n) o.mlp_samples = n;
        if (o.cnn_small_samples > n) o.cnn_small_samples = n;
        if (o.cnn_samples > n) o.cnn_samples = n;
    }
    cpu_name(cpu, sizeof cpu);
    features = mpt_context_cpu_features(ctx);
    printf("# mpt.h %s training speed: CPU \"%s\" (%s%s%s%s), %d threads, batch %lld, "
           "Adam 1e-3\n",
           MPT_VERSION, cpu, features & MPT_CPU_AVX2 ? "avx2 " : "",
           features & MPT_CPU_F16C ? "f16c " : "", features & MPT_CPU_AVX512 ? "avx512 " : "",
           features & MPT_CPU_AVX512_BF16 ? "avx512bf16" : "", mpt_context_num_threads(ctx),
           (long long)o.batch_size);
    printf("# samples: mlp %lld, cnn_small %lld, cnn %lld (the first N training images), "
           "warm-up %lld; median of %d\n\n",
           (long long)o.mlp_samples, (long long)o.cnn_small_samples, (long long)o.cnn_samples, (long long)o.warmup_samples,
           o.repeat);
    printf("| model | policy | samples/s | min..max | forward ms | backward ms | update ms "
           "| other ms |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    fflush(stdout);
    for (mi = 0; rc == 0 && mi < N_MODELS; mi++) {
        const char *model = model_names[mi];
        const int64_t samples[N_MODELS] = {o.mlp_samples, o.cnn_small_samples, o.cnn_samples};
        const mpt_dataset *warmup = parts[0][0] ? parts[0][0] : all;
        const mpt_dataset *train = parts[1 + mi][0] ? parts[1 + mi][0] : all;
        if (strcmp(o.model, "all") && strcmp(o.model, model)) continue;
        for (pi = 0; pi < 3; pi++) {
            result r[MAX_REPEAT], med;
            double lo, hi;
            if (strcmp(o.policy, "all") && strcmp(o.policy, policy_names[pi])) continue;
            if (measure(ctx, mi, policies[pi], &o, warmup, train, r) != MPT_OK) {
                fprintf(stderr, "%s: %s %s: %s\n", argv[0], model, policy_names[pi],
                        mpt_context_error(ctx));
                rc = 1;
                break;
            }
            med = summarize(r, o.repeat, &lo, &hi);
            printf("| %s | %s | %.0f | %.0f..%.0f | %.2f | %.2f | %.2f | %.2f |\n", model,
                   policy_names[pi], med.samples_per_s, lo, hi, med.forward_ms, med.backward_ms,
                   med.update_ms, med.other_ms);
            fflush(stdout);
            snprintf(json[mi][pi], sizeof json[mi][pi],
                     "{\"bench\":\"train\",\"framework\":\"mpt\",\"version\":\"%s\","
                     "\"model\":\"%s\",\"policy\":\"%s\",\"threads\":%d,\"batch\":%lld,"
                     "\"samples\":%lld,\"repeats\":%d,\"samples_per_s\":%.1f,"
                     "\"samples_per_s_min\":%.1f,\"samples_per_s_max\":%.1f,"
                     "\"forward_ms\":%.3f,\"backward_ms\":%.3f,\"update_ms\":%.3f,"
                     "\"other_ms\":%.3f}",
                     MPT_VERSION, model, policy_names[pi], mpt_context_num_threads(ctx),
                     (long long)o.batch_size, (long long)samples[mi],
                     o.repeat, med.samples_per_s, lo, hi, med.forward_ms, med.backward_ms,
                     med.update_ms, med.other_ms);
            ran |= 1 << (3 * mi + pi);
        }
    }
    printf("\n");
    for (mi = 0; mi < N_MODELS; mi++)
        for (pi = 0; pi < 3; pi++)
            if (ran & (1 << (3 * mi + pi))) printf("%s\n", json[mi][pi]);
    for (mi = 0; mi < 1 + N_MODELS; mi++) {
        mpt_dataset_destroy(parts[mi][1]);
        mpt_dataset_destroy(parts[mi][0]);
    }
    mpt_dataset_destroy(all);
    mpt_context_destroy(ctx);
    return rc;
}

/* Training-speed benchmark: samples/s of one epoch of mpt_model_fit on
   Fashion-MNIST, for the seed MLP, the small CNN (examples/cnn_small.c),
   the CNN (examples/cnn.c) and, when asked for, ResNet-20
   (examples/resnet.c's layers, examples/resnet20.h) under each precision
   policy, and the time per step split into forward (with the loss),
   backward and update, as fit records them in the model's history.

       gcc -std=c99 -O2 -I. bench/bench_train.c -o build/bench_train -lpthread -lm -lz
       ./build/bench_train                       (the three seed models, every policy; ~1 min)
       ./build/bench_train --model mlp --policy float32 --repeat 3
       ./build/bench_train --model resnet        (~1 min more on 2 cores)

   Flags (defaults in brackets):
       --model mlp|cnn_small|cnn|resnet|all [all]   all: mlp, cnn_small
                                   and cnn, not resnet: one ResNet-20 run
                                   takes as long as the other three
                                   together, and ./build.sh bench runs
                                   this with the defaults
       --policy float32|mixed_float16|mixed_bfloat16|all [all]
       --threads N         [2]    the context's pool (mpt_context_desc.num_threads)
       --batch-size N      [128]
       --mlp-samples N     [60000] the first N training images (the whole set)
       --cnn-small-samples N [12800] the first N training images (100
                                   batches) for cnn_small
       --cnn-samples N     [6400]  the first N training images (50 batches),
                                   to keep the CNN's run short
       --resnet-samples N  [6400]  the first N training images (50 batches)
                                   for resnet: 13-15 s an epoch on 2
                                   idle cores
       --warmup-samples N  [1280]  a short fit of the same model before the
                                   measured one (builds it, warms caches)
       --repeat N          [1]    measured one-epoch fits per result; the
                                   median is reported, with the min and max
       --profile DIR       [none] the first measured fit's steps 5 to 20
                                   (fewer where the epoch has fewer) timed
                                   layer by layer (fit's profile_batch):
                                   the per-layer table goes to
                                   DIR/plugins/profile/<run>/<host>.layers.txt,
                                   one run per model and policy; that fit's
                                   numbers include the profiler's cost
       --data DIR          [/usr/share/datasets/fashion-mnist]

   Every model: batch 128, Adam 1e-3 (Keras' epsilon 1e-7), sparse
   categorical crossentropy on a final softmax (fit fuses the softmax into
   the loss), shuffled every epoch, no metrics (the PyTorch twin,
   bench/torch_train.py, computes none either).

   Prints a Markdown table and one JSON line per result. samples_per_s is
   the history's "samples_per_second" (samples / wall time of the epoch,
   data loading included); forward_ms, backward_ms and update_ms are
   "forward_ms_per_step", "backward_ms_per_step" and "update_ms_per_step";
   other_ms is the rest of a step's wall time (waiting for the loader's
   batch, bookkeeping). */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include "mpt.h"
#include "common.h"
#include "../examples/resnet20.h"

#define MAX_REPEAT 32

typedef struct options {
    const char *model;   /* "mlp", "cnn_small", "cnn", "resnet" or "all" (the first three) */
    const char *policy;  /* a policy name or "all" */
    int threads;
    int64_t batch_size;
    int64_t mlp_samples, cnn_small_samples, cnn_samples, resnet_samples, warmup_samples;
    int repeat;
    const char *data;
    const char *profile; /* --profile DIR, or NULL */
} options;

static const char *const policy_names[3] = {"float32", "mixed_float16", "mixed_bfloat16"};
static const mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                       MPT_POLICY_MIXED_BFLOAT16};

/* One measured fit's numbers, from the history's only epoch. */
typedef struct result {
    double samples_per_s, forward_ms, backward_ms, update_ms, other_ms;
} result;

/* A flag's value as a whole number from 0 to max, all of it, or -1 (which
   the checks below refuse): atoi would read "5x" as 5 and "x" as 0. */
static int64_t whole_number(const char *value, int64_t max) {
    char *end;
    long long n;
    errno = 0;
    n = strtoll(value, &end, 10);
    if (!isdigit((unsigned char)value[0]) || *end || errno == ERANGE || n > max) return -1;
    return n;
}

static int parse_options(int argc, char **argv, options *o) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *flag = argv[i], *value = argv[i + 1];
        if (!strcmp(flag, "--model")) o->model = value;
        else if (!strcmp(flag, "--policy")) o->policy = value;
        else if (!strcmp(flag, "--threads")) o->threads = (int)whole_number(value, INT_MAX);
        else if (!strcmp(flag, "--batch-size")) o->batch_size = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--mlp-samples"))
            o->mlp_samples = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--cnn-small-samples"))
            o->cnn_small_samples = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--cnn-samples"))
            o->cnn_samples = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--resnet-samples"))
            o->resnet_samples = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--warmup-samples"))
            o->warmup_samples = whole_number(value, INT64_MAX);
        else if (!strcmp(flag, "--repeat")) o->repeat = (int)whole_number(value, INT_MAX);
        else if (!strcmp(flag, "--data")) o->data = value;
        else if (!strcmp(flag, "--profile")) o->profile = value;
        else break;
    }
    if (i != argc || o->threads < 1 || o->batch_size < 1 || o->mlp_samples < 1 ||
        o->cnn_small_samples < 1 || o->cnn_samples < 1 || o->resnet_samples < 1 ||
        o->warmup_samples < 1 || o->repeat < 1 || o->repeat > MAX_REPEAT ||
        (strcmp(o->model, "mlp") && strcmp(o->model, "cnn_small") && strcmp(o->model, "cnn") &&
         strcmp(o->model, "resnet") && strcmp(o->model, "all")) ||
        (strcmp(o->policy, "all") && strcmp(o->policy, policy_names[0]) &&
         strcmp(o->policy, policy_names[1]) && strcmp(o->policy, policy_names[2]))) {
        fprintf(stderr,
                "usage: %s [--model mlp|cnn_small|cnn|resnet|all] [--policy float32|"
                "mixed_float16|mixed_bfloat16|all]\n"
                "          [--threads N] [--batch-size N] [--mlp-samples N]\n"
                "          [--cnn-small-samples N] [--cnn-samples N] [--resnet-samples N]\n"
                "          [--warmup-samples N] [--repeat 1..%d] [--data DIR] "
                "[--profile DIR]\n",
                argv[0], MAX_REPEAT);
        return 0;
    }
    return 1;
}

/* ---- the models (their layers: common.h; ResNet-20's: examples/resnet20.h) --- */

#define N_MODELS 4
static const char *const model_names[N_MODELS] = {"mlp", "cnn_small", "cnn", "resnet"};
static mpt_status (*const add_model[N_MODELS])(mpt_model *) = {
    add_mlp_layers, add_cnn_small_layers, add_cnn_layers, add_resnet20_layers};

/* Whether --model selects the model: "all" is the three seed models. */
static int selected(const char *option, const char *model) {
    return !strcmp(option, model) || (!strcmp(option, "all") && strcmp(model, "resnet"));
}

/* ---- measuring ------------------------------------------------------------------ */

/* Builds the model, fits it once on `warmup`, then `repeat` times for one
   epoch on `train`, each fit's numbers into r[]. */
static mpt_status measure(mpt_context *ctx, int model, mpt_policy policy, const options *o,
                          const mpt_dataset *warmup, const mpt_dataset *train, result *r) {
    mpt_model *m = NULL;
    mpt_fit_desc fit = { .epochs = 1, .batch_size = o->batch_size };
    int64_t steps = (mpt_dataset_count(train) + o->batch_size - 1) / o->batch_size;
    mpt_status s;
    int i;
    s = make_train_model(ctx, add_model[model], policy, o->batch_size, &m);
    if (s == MPT_OK) s = mpt_model_fit(m, warmup, &fit);
    for (i = 0; s == MPT_OK && i < o->repeat; i++) {
        mpt_fit_desc measured = fit;
        double step_ms;
        if (o->profile && i == 0) { /* steps 5..20, or what the epoch has */
            measured.profile_batch[0] = steps >= 5 ? 5 : 1;
            measured.profile_batch[1] = steps < measured.profile_batch[0] + 15
                                            ? steps
                                            : measured.profile_batch[0] + 15;
            measured.profile_dir = o->profile;
        }
        s = mpt_model_fit(m, train, &measured);
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

int main(int argc, char **argv) {
    options o = {"all", "all", 2, 128, 60000, 12800, 6400, 6400, 1280, 1,
                 "/usr/share/datasets/fashion-mnist", NULL};
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
        /* the first N images: warm-up, mlp, cnn_small, cnn, resnet */
        int64_t n = mpt_dataset_count(all), want[1 + N_MODELS];
        int k;
        want[0] = o.warmup_samples;
        want[1] = o.mlp_samples;
        want[2] = o.cnn_small_samples;
        want[3] = o.cnn_samples;
        want[4] = o.resnet_samples;
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
        if (o.resnet_samples > n) o.resnet_samples = n;
    }
    cpu_name(cpu, sizeof cpu);
    features = mpt_context_cpu_features(ctx);
    printf("# mpt.h %s training speed: CPU \"%s\" (%s%s%s%s), %d threads, batch %lld, "
           "Adam 1e-3\n",
           MPT_VERSION, cpu, features & MPT_CPU_AVX2 ? "avx2 " : "",
           features & MPT_CPU_F16C ? "f16c " : "", features & MPT_CPU_AVX512 ? "avx512 " : "",
           features & MPT_CPU_AVX512_BF16 ? "avx512bf16" : "", mpt_context_num_threads(ctx),
           (long long)o.batch_size);
    printf("# samples: mlp %lld, cnn_small %lld, cnn %lld, resnet %lld (the first N training "
           "images), warm-up %lld; median of %d\n\n",
           (long long)o.mlp_samples, (long long)o.cnn_small_samples, (long long)o.cnn_samples,
           (long long)o.resnet_samples, (long long)o.warmup_samples, o.repeat);
    printf("| model | policy | samples/s | min..max | forward ms | backward ms | update ms "
           "| other ms |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    fflush(stdout);
    for (mi = 0; rc == 0 && mi < N_MODELS; mi++) {
        const char *model = model_names[mi];
        const int64_t samples[N_MODELS] = {o.mlp_samples, o.cnn_small_samples, o.cnn_samples,
                                           o.resnet_samples};
        const mpt_dataset *warmup = parts[0][0] ? parts[0][0] : all;
        const mpt_dataset *train = parts[1 + mi][0] ? parts[1 + mi][0] : all;
        if (!selected(o.model, model)) continue;
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

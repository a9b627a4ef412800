/* What the examples share: the Fashion-MNIST examples' command-line flags,
   data, fit and the JSON line they end with; the hand-written loops' toy
   problem; TRY. Include after mpt.h. The functions are static inline, so
   an example that calls only some of them builds without warnings. */
#ifndef MPT_EXAMPLES_COMMON_H
#define MPT_EXAMPLES_COMMON_H

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct options {
    mpt_policy policy;
    const char *policy_name;
    const char *data;       /* an MNIST-format directory */
    int epochs;
    int64_t batch_size;
    int threads;            /* 0: MPT_NUM_THREADS, else every CPU */
    int verbose;            /* as Keras' fit: 0, 1 or 2 */
    uint64_t seed;
    const char *tensorboard; /* --tensorboard DIR; NULL: no event files */
    const char *plot;        /* --plot FILE; NULL: no SVG of the history */
    const char *profile;     /* --profile DIR; NULL: no profiling */
    const char *save;        /* --save FILE: the trained model (mpt_model_save) */
    const char *load;        /* --load FILE: the model from a file, not built in
                                code (mpt_model_load); with --epochs 0 only
                                evaluated */
    const char *export_stem; /* --export STEM: STEM.tflite and STEM.onnx of the
                                model (float32 weights) */
    int model_files;         /* 1: the example takes --save, --load and --export */
    int augment_flag;        /* 1: the example takes --no-augment */
    int augment;             /* 1: training images go through the example's
                                augmentation layers (--no-augment: 0) */
} options;

/* The defaults the flags change: mixed_float16, Fashion-MNIST from
   /usr/share/datasets/fashion-mnist, `epochs` epochs of batches of 128,
   every CPU, verbose 1, seed 1, no TensorBoard, plot or profile. */
static inline options default_options(int epochs) {
    options o = { .policy = MPT_POLICY_MIXED_FLOAT16, .policy_name = "mixed_float16",
                  .data = "/usr/share/datasets/fashion-mnist", .epochs = epochs,
                  .batch_size = 128, .verbose = 1, .seed = 1, .augment = 1 };
    return o;
}

/* Reads a flag's value as a whole number from 0 to max into *n, all of
   it: atoi would read "abc" as 0 (and --epochs 0 trains nothing) and "5x"
   as 5. Returns 0 after saying what is wrong. */
static inline int read_number(const char *program, const char *flag, const char *value,
                              unsigned long long max, unsigned long long *n) {
    char *end;
    errno = 0;
    *n = strtoull(value, &end, 10);
    if (!isdigit((unsigned char)value[0]) || *end || errno == ERANGE || *n > max) {
        fprintf(stderr, "%s: %s takes a whole number from 0 to %llu, not \"%s\"\n", program, flag,
                max, value);
        return 0;
    }
    return 1;
}

/* The policy mpt_policy_name calls name ("float32", "mixed_float16",
   "mixed_bfloat16") into *policy; 0 when it names none. */
static inline int policy_named(const char *name, mpt_policy *policy) {
    static const mpt_policy all[] = { MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                      MPT_POLICY_MIXED_BFLOAT16 };
    size_t k;
    for (k = 0; k < sizeof all / sizeof all[0]; k++)
        if (!strcmp(name, mpt_policy_name(all[k]))) {
            *policy = all[k];
            return 1;
        }
    return 0;
}

/* Reads --policy, --epochs, --batch-size, --threads, --data, --seed,
   --verbose, --tensorboard, --plot, --profile, --save, --load, --export
   and --no-augment (the examples that offer them; --no-augment takes no
   value) over the defaults already in *o; returns 0
   after printing the usage (and what is wrong with a number) when
   something is wrong. */
static inline int parse_options(int argc, char **argv, options *o) {
    int i;
    for (i = 1; i < argc; i += 2) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned long long n; /* a value that is not a number matches no branch: the loop stops */
        if (o->augment_flag && !strcmp(flag, "--no-augment")) {
            o->augment = 0;
            i--; /* a flag without a value */
            continue;
        }
        if (!value) break;
        if (!strcmp(flag, "--policy")) o->policy_name = value;
        else if (!strcmp(flag, "--epochs") && read_number(argv[0], flag, value, INT_MAX / 2, &n))
            o->epochs = (int)n; /* (half: room for the epochs a loaded model has) */
        else if (!strcmp(flag, "--batch-size") && read_number(argv[0], flag, value, INT64_MAX, &n))
            o->batch_size = (int64_t)n;
        else if (!strcmp(flag, "--threads") && read_number(argv[0], flag, value, INT_MAX, &n))
            o->threads = (int)n;
        else if (!strcmp(flag, "--data")) o->data = value;
        else if (!strcmp(flag, "--seed") && read_number(argv[0], flag, value, UINT64_MAX, &n))
            o->seed = (uint64_t)n;
        else if (!strcmp(flag, "--verbose") && read_number(argv[0], flag, value, 2, &n))
            o->verbose = (int)n;
        else if (!strcmp(flag, "--tensorboard")) o->tensorboard = value;
        else if (!strcmp(flag, "--plot")) o->plot = value;
        else if (!strcmp(flag, "--profile")) o->profile = value;
        else if (o->model_files && !strcmp(flag, "--save")) o->save = value;
        else if (o->model_files && !strcmp(flag, "--load")) o->load = value;
        else if (o->model_files && !strcmp(flag, "--export")) o->export_stem = value;
        else break;
    }
    if (!policy_named(o->policy_name, &o->policy)) i = -1;
    if (i != argc) {
        fprintf(stderr, "usage: %s [--policy float32|mixed_float16|mixed_bfloat16] [--epochs N]\n"
                        "          [--batch-size N] [--threads N] [--data DIR] [--seed N]\n"
                        "          [--verbose 0|1|2] [--tensorboard DIR] [--plot FILE]\n"
                        "          [--profile DIR]%s%s\n",
                argv[0], o->model_files ? " [--save FILE] [--load FILE] [--export STEM]" : "",
                o->augment_flag ? " [--no-augment]" : "");
        return 0;
    }
    return 1;
}

/* With --tensorboard DIR, appends to callbacks[*n] a TensorBoard callback
   writing DIR/train (and DIR/validation when fit validates), with every
   parameter's histograms each epoch: `tensorboard --logdir DIR` shows
   them. */
static inline mpt_status add_tensorboard(mpt_context *ctx, const options *o,
                                         mpt_callback *callbacks, int *n) {
    mpt_status s;
    if (!o->tensorboard) return MPT_OK;
    s = mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){ .log_dir = o->tensorboard,
                                                               .histogram_freq = 1 },
                                 &callbacks[*n]);
    if (s == MPT_OK) (*n)++;
    return s;
}

/* With --profile DIR, fit times steps 10 to 20 of the first epoch layer by
   layer (Keras' profile_batch=(10, 20)): a Chrome trace in
   DIR/plugins/profile/<run>/ and a per-layer table at the end. With
   --epochs 0 there is no step to time (fit would refuse the range). */
static inline mpt_fit_desc *with_profile(const options *o, mpt_fit_desc *fit) {
    if (!o->profile || o->epochs == 0) return fit;
    fit->profile_batch[0] = 10;
    fit->profile_batch[1] = 20;
    fit->profile_dir = o->profile;
    return fit;
}

/* With --plot FILE, draws the model's history (loss, metrics, learning
   rate, loss scale per epoch) into FILE, an SVG a browser opens. */
static inline mpt_status write_plot(mpt_context *ctx, const options *o, const mpt_model *model,
                                    const char *model_name) {
    mpt_history h;
    char title[128];
    if (!o->plot) return MPT_OK;
    mpt_model_history(model, &h);
    snprintf(title, sizeof title, "%s on Fashion-MNIST, %s", model_name, o->policy_name);
    return mpt_history_plot_svg(&h, o->plot, &(mpt_plot_desc){ .title = title, .ctx = ctx });
}

/* The last epoch's training speed from the model's history. */
static inline double last_samples_per_second(const mpt_model *model) {
    mpt_history h;
    int k;
    mpt_model_history(model, &h);
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], "samples_per_second") && h.epochs > 0)
            return h.values[k][h.epochs - 1];
    return 0;
}

static inline void print_result(const char *model_name, const options *o, const mpt_model *model,
                                mpt_context *ctx, const mpt_logs *test) {
    mpt_history h;
    mpt_model_history(model, &h);
    printf("{\"model\":\"%s\",\"policy\":\"%s\",\"epochs\":%d,\"batch_size\":%lld,"
           "\"threads\":%d,\"test_loss\":%.4f,\"test_accuracy\":%.4f,"
           "\"train_samples_per_s\":%.0f%s}\n",
           model_name, o->policy_name, h.epochs, (long long)o->batch_size,
           mpt_context_num_threads(ctx), mpt_logs_get(test, "loss"),
           mpt_logs_get(test, "accuracy"), last_samples_per_second(model),
           !o->augment_flag ? "" : o->augment ? ",\"augment\":true" : ",\"augment\":false");
}

/* Parses the flags over o's defaults, creates the context (--threads)
   and loads Fashion-MNIST's training and test sets (--data). Returns 0,
   or the exit status after saying why: 2 for a wrong flag, 1 otherwise. */
static inline int open_fashion_mnist(int argc, char **argv, options *o, mpt_context **ctx,
                                     mpt_dataset **train, mpt_dataset **test) {
    if (!parse_options(argc, argv, o)) return 2;
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = o->threads }, ctx) != MPT_OK)
        return 1;
    if (mpt_dataset_load_mnist(*ctx, o->data, 0, train) != MPT_OK ||
        mpt_dataset_load_mnist(*ctx, o->data, 1, test) != MPT_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(*ctx));
        return 1;
    }
    return 0;
}

/* model.fit(train, epochs, batch_size, verbose, validation_data (NULL:
   none), callbacks) as the flags say: the example's own callbacks (at
   most 7), then with --tensorboard DIR a TensorBoard callback (destroyed
   again after the fit), and with --profile DIR the profiler. */
static inline mpt_status fit_with_flags(mpt_context *ctx, const options *o, mpt_model *model,
                                        const mpt_dataset *train, const mpt_dataset *validation,
                                        const mpt_callback *callbacks, int n_callbacks) {
    mpt_callback all[8]; /* the example's and TensorBoard's */
    /* --epochs more than the model has (a loaded one may have some) */
    mpt_fit_desc fit = { .epochs = mpt_model_epoch(model) + o->epochs,
                         .initial_epoch = mpt_model_epoch(model), .batch_size = o->batch_size,
                         .validation_data = validation, .verbose = o->verbose,
                         .callbacks = all, .n_callbacks = n_callbacks };
    mpt_status s;
    int i;
    if (n_callbacks > 7) return MPT_ERR_INVALID_ARGUMENT;
    for (i = 0; i < n_callbacks; i++) all[i] = callbacks[i];
    s = add_tensorboard(ctx, o, all, &fit.n_callbacks);
    if (s == MPT_OK) s = mpt_model_fit(model, train, with_profile(o, &fit));
    if (fit.n_callbacks > n_callbacks) mpt_callback_destroy(&all[n_callbacks]);
    return s;
}

/* After the fit: the --plot SVG, model.evaluate(test) and the JSON line. */
static inline mpt_status evaluate_and_report(mpt_context *ctx, const options *o, mpt_model *model,
                                             const char *model_name, const mpt_dataset *test) {
    mpt_logs result;
    mpt_status s = write_plot(ctx, o, model, model_name);
    if (s == MPT_OK)
        s = mpt_model_evaluate(model, test, &(mpt_evaluate_desc){ .batch_size = o->batch_size },
                               &result);
    if (s == MPT_OK) print_result(model_name, o, model, ctx, &result);
    return s;
}

/* The hand-written loops' toy problem: n points on two noisy rings, class
   0 inside (radius 0.5), class 1 outside (radius 1). No straight line
   separates them, so the hidden layers must learn. x: (n, 2), y: (n). */
static inline void make_rings(int n, float *x, int32_t *y) {
    uint32_t r[4];
    int i;
    for (i = 0; i < n; i++) {
        double angle, radius;
        mpt_philox4x32(1234, 0, (uint64_t)i, r);
        angle = 6.283185307 * r[0] / 4294967296.0;
        y[i] = (int32_t)(r[1] & 1);
        radius = (y[i] ? 1.0 : 0.5) + 0.15 * (r[2] / 4294967296.0 - 0.5);
        x[2 * i] = (float)(radius * cos(angle));
        x[2 * i + 1] = (float)(radius * sin(angle));
    }
}

/* The hand-written loops' model of make_rings' points: Dense(32, relu) →
   Dense(32, relu) → Dense(2) logits kept in float32 (their loss is taken
   in float32), seeded alike, built for batch. */
static inline mpt_status make_rings_model(mpt_context *ctx, mpt_policy policy, int64_t batch,
                                          mpt_model **model) {
    mpt_status s = mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 2 }, .input_rank = 1,
                                                            .policy = policy, .seed = 1 }, model);
    if (s == MPT_OK)
        s = mpt_model_add_dense(*model, &(mpt_dense_desc){ .units = 32,
                                                           .activation = MPT_ACT_RELU });
    if (s == MPT_OK)
        s = mpt_model_add_dense(*model, &(mpt_dense_desc){ .units = 32,
                                                           .activation = MPT_ACT_RELU });
    if (s == MPT_OK)
        s = mpt_model_add_dense(*model, &(mpt_dense_desc){ .units = 2, .dtype = MPT_FLOAT32 });
    if (s == MPT_OK) s = mpt_model_build(*model, batch);
    return s;
}

/* On a failed call: the context's error on stderr, after the program's
   name, and exit status 1. */
#define TRY(call)                                                          \
    do {                                                                   \
        if ((call) != MPT_OK) {                                            \
            fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));  \
            return 1;                                                      \
        }                                                                  \
    } while (0)

#endif

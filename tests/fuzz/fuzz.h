/* What the fuzz harnesses share, and seeds.c, which writes their first
   corpora from files mpt.h itself writes: a quiet context, a directory of
   this process's own for the files the loaders read, the IDX harnesses'
   input layout, the small model the checkpoint harnesses load into,
   with a snapshot of its whole state, and those harnesses' checks. Include after mpt.h (with
   MPT_IMPLEMENTATION). */
#ifndef MPT_FUZZ_H
#define MPT_FUZZ_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A harness's own failure (not the library's): stop, loudly. */
static inline void fuzz_die(const char *what) {
    fprintf(stderr, "fuzz: %s\n", what);
    abort();
}

/* ---- a one-thread context that keeps its messages to itself --------------- */

static inline void fuzz__drop_log(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    (void)msg;
}

static inline mpt_context *fuzz_context(void) {
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.num_threads = 1;
    d.logger.fn = fuzz__drop_log;
    if (mpt_context_create(&d, &ctx) != MPT_OK) fuzz_die("cannot create a context");
    return ctx;
}

/* ---- files: a directory per process ----------------------------------------

   In /dev/shm where there is one (no disk write per input), else $TMPDIR or
   /tmp; unique per process (mkdtemp), so that several fuzzers run side by
   side. Removed at exit with whatever the harness left in it. */

static char fuzz__dir[256];

static inline void fuzz__remove_dir(void) {
    static const char *const names[] = {"images", "labels", "input.safetensors",
                                        "pristine.safetensors", "state.safetensors",
                                        "trained.safetensors", "npy_x", "npy_y", "csv",
                                        "text"};
    char path[512];
    size_t i;
    for (i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(path, sizeof path, "%s/%s", fuzz__dir, names[i]);
        unlink(path);
    }
    rmdir(fuzz__dir);
}

/* buf (512 bytes) becomes this process's directory/name. */
static inline const char *fuzz_path(char *buf, const char *name) {
    if (!fuzz__dir[0]) {
        const char *tmp = getenv("TMPDIR");
        if (access("/dev/shm", W_OK) == 0) tmp = "/dev/shm";
        snprintf(fuzz__dir, sizeof fuzz__dir, "%s/mpt_fuzz_XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(fuzz__dir)) fuzz_die("cannot create a temporary directory");
        atexit(fuzz__remove_dir);
    }
    snprintf(buf, 512, "%s/%s", fuzz__dir, name);
    return buf;
}

static inline void fuzz_write(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) fuzz_die("cannot write a file");
}

/* The whole file (malloc'd), its size in *size. */
static inline unsigned char *fuzz_read(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n = 0;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        fuzz_die("cannot read a file");
    buf = (unsigned char *)malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) fuzz_die("cannot read a file");
    fclose(f);
    *size = (size_t)n;
    return buf;
}

/* ---- IDX inputs: both files in one ------------------------------------------

   A 4-byte big-endian length L, then the images file (L bytes, fewer if the
   input ends first), then the labels file (the rest). */

static inline void fuzz_idx_split(const uint8_t *data, size_t size, const uint8_t **images,
                           size_t *images_size, const uint8_t **labels, size_t *labels_size) {
    size_t len = 0;
    if (size >= 4)
        len = (size_t)data[0] << 24 | (size_t)data[1] << 16 | (size_t)data[2] << 8 | data[3];
    data += size >= 4 ? 4 : size;
    size -= size >= 4 ? 4 : size;
    if (len > size) len = size;
    *images = data;
    *images_size = len;
    *labels = data + len;
    *labels_size = size - len;
}

/* Loads the two files. A load must fail, leaving *out NULL and saying
   why, or give samples of the shape (rows, cols, 1) whose first and last
   can be read. */
static inline void fuzz_idx_load(mpt_context *ctx, const char *images, const char *labels) {
    mpt_dataset *d = (mpt_dataset *)&d; /* the load must set it */
    int64_t shape[4] = {0}, which[2];
    float *x;
    int32_t y[2];
    ctx->error[0] = 0;
    if (mpt_dataset_load_idx(ctx, images, labels, &d) != MPT_OK) {
        if (d) fuzz_die("a failed load_idx left *out set");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed load_idx gave no reason");
        return;
    }
    if (!d || mpt_dataset_count(d) < 1 || mpt_dataset_sample_shape(d, shape) != 3 ||
        shape[0] < 1 || shape[1] < 1 || shape[2] != 1)
        fuzz_die("load_idx gave a dataset without samples, or of a wrong shape");
    which[0] = 0;
    which[1] = mpt_dataset_count(d) - 1;
    x = (float *)malloc((size_t)(2 * shape[0] * shape[1]) * sizeof(float)); /* (2, rows, cols) */
    if (!x) fuzz_die("out of memory");
    mpt__dataset_gather(ctx, d, which, 2, MPT_FLOAT32, x, y);
    free(x);
    mpt_dataset_destroy(d);
}

/* The IDX harnesses' run: the input split into the images and the labels
   file, each written to this process's directory by `put` (as it is, or
   compressed), and the two loaded by fuzz_idx_load. */
static inline void fuzz_idx_run(const uint8_t *data, size_t size,
                                void (*put)(const char *path, const void *data, size_t size)) {
    static mpt_context *ctx;
    char images[512], labels[512];
    const uint8_t *img, *lab;
    size_t img_size, lab_size;
    if (!ctx) ctx = fuzz_context();
    fuzz_idx_split(data, size, &img, &img_size, &lab, &lab_size);
    put(fuzz_path(images, "images"), img, img_size);
    put(fuzz_path(labels, "labels"), lab, lab_size);
    fuzz_idx_load(ctx, images, labels);
}

/* ---- the model the weights and checkpoint harnesses load into ---------------

   Conv2D (kernel, bias) → BatchNormalization (gamma, beta and the moving
   statistics, which are not trainable) → MaxPooling2D → Flatten → Dense,
   mixed_float16 with dynamic loss scaling and Adam (two moments per
   parameter): every kind of state a checkpoint holds. Two steps of fit on
   random data give it moments, step counters and a loss scale; `variant`
   picks the data, so that the seeds' files hold other values than the
   harness's model. fuzz_qat_model is the same model made quantization-
   aware before it trains (its Conv2D's ReLU an Activation after the
   BatchNormalization, its Dense giving logits, as QAT wants them), so that
   its files hold the learned ranges too. */

static inline void fuzz__fill(float *v, int64_t n, uint64_t *rng) {
    int64_t i;
    for (i = 0; i < n; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (float)((double)(*rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
}

static inline mpt_model *fuzz__model(mpt_context *ctx, int variant, int qat) {
    enum { N = 8 };
    static float x[N * 4 * 4 * 2]; /* (N, 4, 4, 2) */
    static int32_t y[N];           /* (N) */
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(variant + 1);
    int64_t x_shape[4] = {N, 4, 4, 2}, y_shape[1] = {N};
    mpt_tensor xt, yt;
    mpt_dataset *data = NULL;
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_conv2d_desc conv;
    mpt_dense_desc dense;
    mpt_batchnorm_desc bn;
    mpt_pool2d_desc pool;
    mpt_flatten_desc flat;
    mpt_activation_desc relu;
    mpt_compile_desc cd;
    mpt_dataset_desc dd;
    mpt_fit_desc fd;
    int i;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 4, md.input_shape[1] = 4, md.input_shape[2] = 2;
    md.input_rank = 3;
    md.policy = MPT_POLICY_MIXED_FLOAT16;
    md.seed = 7;
    memset(&conv, 0, sizeof conv);
    conv.filters = 3, conv.kernel_size[0] = 3, conv.kernel_size[1] = 3;
    conv.padding = MPT_PADDING_SAME;
    conv.activation = qat ? MPT_ACT_NONE : MPT_ACT_RELU;
    memset(&relu, 0, sizeof relu);
    relu.activation = MPT_ACT_RELU;
    memset(&bn, 0, sizeof bn);
    memset(&pool, 0, sizeof pool);
    memset(&flat, 0, sizeof flat);
    memset(&dense, 0, sizeof dense);
    dense.units = 4, dense.activation = qat ? MPT_ACT_NONE : MPT_ACT_SOFTMAX;
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_ADAM;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss.from_logits = qat;
    fuzz__fill(x, N * 4 * 4 * 2, &rng);
    for (i = 0; i < N; i++) y[i] = (int32_t)((rng >> (8 * (i % 8))) & 3);
    memset(&dd, 0, sizeof dd);
    dd.x = &xt, dd.y = &yt;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 1, fd.batch_size = N / 2;
    if (mpt_model_create(ctx, &md, &m) != MPT_OK || mpt_model_add_conv2d(m, &conv) != MPT_OK ||
        mpt_model_add_batch_normalization(m, &bn) != MPT_OK ||
        (qat && mpt_model_add_activation(m, &relu) != MPT_OK) ||
        mpt_model_add_max_pooling2d(m, &pool) != MPT_OK || mpt_model_add_flatten(m, &flat) != MPT_OK ||
        mpt_model_add_dense(m, &dense) != MPT_OK || mpt_model_compile(m, &cd) != MPT_OK ||
        (qat && (mpt_model_build(m, N / 2) != MPT_OK ||
                 mpt_model_quantize_aware(m, NULL) != MPT_OK)) ||
        mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 4, x_shape, x) != MPT_OK ||
        mpt_tensor_wrap(ctx, &yt, MPT_INT32, 1, y_shape, y) != MPT_OK ||
        mpt_dataset_create(ctx, &dd, &data) != MPT_OK || mpt_model_fit(m, data, &fd) != MPT_OK)
        fuzz_die(mpt_context_error(ctx));
    mpt_dataset_destroy(data);
    return m;
}

static inline mpt_model *fuzz_model(mpt_context *ctx, int variant) {
    return fuzz__model(ctx, variant, 0);
}

static inline mpt_model *fuzz_qat_model(mpt_context *ctx, int variant) {
    return fuzz__model(ctx, variant, 1);
}

/* ---- the model's whole state ----------------------------------------------------

   Every parameter's float32 master values, the loss scale, learning rate
   and epoch through the public getters, and the bytes of a checkpoint the
   model saves (which hold the optimizer's moments, every step counter
   and a quantization-aware model's ranges too). */

typedef struct fuzz_state {
    float *values; /* every parameter's, in order */
    int64_t n_values;
    float loss_scale, learning_rate;
    int epoch;
    unsigned char *checkpoint;
    size_t checkpoint_size;
} fuzz_state;

static inline void fuzz_state_take(mpt_context *ctx, mpt_model *m, fuzz_state *s) {
    char path[512];
    mpt_param_info p;
    int i;
    int64_t n = 0;
    memset(s, 0, sizeof *s);
    for (i = 0; i < mpt_model_param_count(m); i++)
        if (mpt_model_param(m, i, &p) == MPT_OK) n += mpt_tensor_count(&p.value);
    s->values = (float *)malloc((size_t)n * sizeof(float));
    if (!s->values) fuzz_die("out of memory");
    for (i = 0; i < mpt_model_param_count(m); i++) {
        if (mpt_model_param(m, i, &p) != MPT_OK) continue;
        memcpy(s->values + s->n_values, p.value.data, mpt_tensor_bytes(&p.value));
        s->n_values += mpt_tensor_count(&p.value);
    }
    s->loss_scale = mpt_model_loss_scale(m);
    s->learning_rate = mpt_model_learning_rate(m);
    s->epoch = mpt_model_epoch(m);
    if (mpt_model_save_checkpoint(m, fuzz_path(path, "state.safetensors")) != MPT_OK)
        fuzz_die(mpt_context_error(ctx));
    s->checkpoint = fuzz_read(path, &s->checkpoint_size);
}

/* NULL when every master value and the loss scale are finite (and the
   scale positive), else which is not. */
static inline const char *fuzz_state_nonfinite(const fuzz_state *s) {
    int64_t i;
    for (i = 0; i < s->n_values; i++)
        if (!isfinite(s->values[i])) return "a parameter's master value";
    if (!isfinite(s->loss_scale) || !(s->loss_scale > 0)) return "the loss scale";
    if (!isfinite(s->learning_rate)) return "the learning rate";
    return NULL;
}

/* ---- the short epoch a loaded model trains ----------------------------------------

   4 samples of the harness models' input (4, 4, 2), labels 0..3, in
   batches of 2, shuffled by the model's seed: tiny, so that a harness
   still runs many inputs a second. */

static inline mpt_dataset *fuzz_train_data(mpt_context *ctx) {
    enum { N = 4 };
    static float x[N * 4 * 4 * 2]; /* (N, 4, 4, 2) */
    static int32_t y[N] = {0, 1, 2, 3};
    int64_t x_shape[4] = {N, 4, 4, 2}, y_shape[1] = {N};
    uint64_t rng = 12345;
    mpt_tensor xt, yt;
    mpt_dataset *data = NULL;
    mpt_dataset_desc dd;
    fuzz__fill(x, N * 4 * 4 * 2, &rng);
    memset(&dd, 0, sizeof dd);
    dd.x = &xt, dd.y = &yt;
    if (mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 4, x_shape, x) != MPT_OK ||
        mpt_tensor_wrap(ctx, &yt, MPT_INT32, 1, y_shape, y) != MPT_OK ||
        mpt_dataset_create(ctx, &dd, &data) != MPT_OK)
        fuzz_die(mpt_context_error(ctx));
    return data;
}

static inline void fuzz_state_free(fuzz_state *s) {
    free(s->values);
    free(s->checkpoint);
    memset(s, 0, sizeof *s);
}

/* NULL when a and b are the same state, else what differs. Values compare
   bit for bit (a NaN written in place of a NaN is still the same). */
static inline const char *fuzz_state_diff(const fuzz_state *a, const fuzz_state *b) {
    if (a->n_values != b->n_values ||
        memcmp(a->values, b->values, (size_t)a->n_values * sizeof(float)) != 0)
        return "the parameters' master values";
    if (memcmp(&a->loss_scale, &b->loss_scale, sizeof a->loss_scale) != 0)
        return "the loss scale";
    if (memcmp(&a->learning_rate, &b->learning_rate, sizeof a->learning_rate) != 0)
        return "the learning rate";
    if (a->epoch != b->epoch) return "the epoch";
    if (a->checkpoint_size != b->checkpoint_size ||
        memcmp(a->checkpoint, b->checkpoint, a->checkpoint_size) != 0)
        return "the saved training state (optimizer moments, step counters, loss scale)";
    return NULL;
}

/* ---- the model-file harnesses (fuzz_weights.c, fuzz_checkpoint.c, fuzz_qat.c) ----

   The input is written to this process's directory as a file and loaded
   (load) into a small trained model (make_model). A load that fails must
   leave the whole model as it was (every master value, the optimizer
   state, loss scale and counters) and say why. One that succeeds goes on
   as a user would: one short epoch of fit from what was loaded (in the
   model's own policy, quantization-aware for fuzz_qat_model), which fails
   with a known status and a reason or leaves finite state; then the model
   is saved (save, and its whole checkpoint) and each file must load back.
   Finally the model's own checkpoint is loaded back, so that every input
   starts from the same state. The state lives in the descriptor, so the
   three harnesses can share one binary (fuzz_loaders.c). */

typedef struct fuzz_model_file {
    mpt_status (*load)(mpt_model *m, const char *path);
    mpt_status (*save)(mpt_model *m, const char *path); /* load's writer */
    mpt_model *(*make_model)(mpt_context *ctx, int variant);
    /* set up by the first input: */
    mpt_context *ctx;
    mpt_model *model;
    fuzz_state before;  /* the model's state before every input */
    char pristine[512]; /* ... as its checkpoint */
    mpt_dataset *train; /* what a loaded model trains on */
} fuzz_model_file;

static inline void fuzz__model_file_setup(fuzz_model_file *h) {
    h->ctx = fuzz_context();
    h->model = h->make_model(h->ctx, 0);
    h->train = fuzz_train_data(h->ctx);
    fuzz_state_take(h->ctx, h->model, &h->before);
    fuzz_write(fuzz_path(h->pristine, "pristine.safetensors"), h->before.checkpoint,
               h->before.checkpoint_size);
}

/* Aborts, naming what changed, when the model's state is not h->before. */
static inline void fuzz__expect_unchanged(fuzz_model_file *h, const char *after_what) {
    fuzz_state now;
    const char *diff;
    fuzz_state_take(h->ctx, h->model, &now);
    diff = fuzz_state_diff(&h->before, &now);
    if (diff) {
        fprintf(stderr, "fuzz: %s changed %s (error: %s)\n", after_what, diff,
                mpt_context_error(h->ctx));
        abort();
    }
    fuzz_state_free(&now);
}

/* After a successful load: one short epoch, then save and load again. */
static inline void fuzz__train_save_load(fuzz_model_file *h) {
    mpt_fit_desc fit;
    fuzz_state now;
    const char *bad;
    char trained[512];
    mpt_status s;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 1;
    fit.batch_size = 2;
    h->ctx->error[0] = 0;
    s = mpt_model_fit(h->model, h->train, &fit);
    if (s != MPT_OK) {
        if (s < MPT_ERR_NUMERIC || s > MPT_OK) fuzz_die("fit after a load gave an unknown status");
        if (!mpt_context_error(h->ctx)[0]) fuzz_die("a failed fit after a load gave no reason");
        return;
    }
    fuzz_state_take(h->ctx, h->model, &now); /* saves the whole checkpoint: must work */
    bad = fuzz_state_nonfinite(&now);
    if (bad) {
        fprintf(stderr, "fuzz: fit after a load returned OK with a non-finite %s\n", bad);
        abort();
    }
    if (mpt_model_load_checkpoint(h->model, fuzz_path(trained, "state.safetensors")) != MPT_OK) {
        fprintf(stderr, "fuzz: the checkpoint saved after fit does not load back: %s\n",
                mpt_context_error(h->ctx));
        abort();
    }
    fuzz_state_free(&now);
    if (h->save(h->model, fuzz_path(trained, "trained.safetensors")) != MPT_OK)
        fuzz_die(mpt_context_error(h->ctx));
    if (h->load(h->model, trained) != MPT_OK) {
        fprintf(stderr, "fuzz: the file saved after fit does not load back: %s\n",
                mpt_context_error(h->ctx));
        abort();
    }
}

/* One input of a model-file harness. */
static inline int fuzz_model_file_input(fuzz_model_file *h, const uint8_t *data, size_t size) {
    char input[512];
    if (!h->ctx) fuzz__model_file_setup(h);
    fuzz_write(fuzz_path(input, "input.safetensors"), data, size);
    h->ctx->error[0] = 0;
    if (h->load(h->model, input) != MPT_OK) {
        if (!mpt_context_error(h->ctx)[0]) fuzz_die("a failed load gave no reason");
        fuzz__expect_unchanged(h, "a failed load");
        return 0;
    }
    fuzz__train_save_load(h);
    if (mpt_model_load_checkpoint(h->model, h->pristine) != MPT_OK)
        fuzz_die("the model's own checkpoint does not load back");
    fuzz__expect_unchanged(h, "a successful load and fit undone by the model's own checkpoint");
    return 0;
}

/* The entry point of a model-file harness that loads with load_fn, saves
   with save_fn, into make_model_fn's model. */
#define FUZZ_MODEL_FILE_HARNESS(load_fn, save_fn, make_model_fn)                            \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);                          \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {                         \
        static fuzz_model_file harness = {                                                 \
            .load = load_fn, .save = save_fn, .make_model = make_model_fn};                \
        return fuzz_model_file_input(&harness, data, size);                                \
    }

#endif

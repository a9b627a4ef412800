/* Text as a dataset of windows over its bytes (mpt_dataset_load_text,
   mpt_dataset_create_text): every window and its targets against the
   bytes they were made from, the validation part exactly the file's last
   fraction, views, fit's shuffled epochs over the starts, evaluate and
   predict over the validation windows against a reference, a tiny
   Embedding -> Dense((T, 256)) model that learns a repetitive text, one
   thread and two alike to the bit, two mirrored replicas as one, and bad
   input refused with a message that names the file and the value. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp in helpers.h */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include <sys/stat.h>
#include <unistd.h>

static mpt_context *ctx;
static char tmp_dir[128];

/* size random bytes (every value 0..255 likely, never all zeros). */
static uint8_t *random_bytes(int64_t size) {
    uint8_t *b = (uint8_t *)malloc((size_t)size);
    int64_t i;
    for (i = 0; b && i < size; i++) b[i] = (uint8_t)(test_next() >> 56);
    return b;
}

static void write_file(const char *path, const void *bytes, size_t size) {
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(bytes, 1, size, f) == size, "cannot write %s", path);
    if (f) fclose(f);
}

static mpt_dataset_text_desc text_desc(int64_t T, float fraction) {
    mpt_dataset_text_desc d;
    memset(&d, 0, sizeof d);
    d.sequence_length = T;
    d.validation_fraction = fraction;
    return d;
}

/* Every sample of d (windows of T from `at`, `stride` apart, of `bytes`)
   gathered as the loader gathers them, and its labels read back: each
   equal to the bytes it stands for. */
static void check_windows(const mpt_dataset *d, const uint8_t *bytes, int64_t at, int64_t stride,
                          int64_t T, const char *what) {
    int64_t n = mpt_dataset_count(d), i, t, bad = -1;
    int64_t *all = (int64_t *)calloc((size_t)n, sizeof(int64_t));
    int32_t *x = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n * T));
    int32_t *y = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n * T));
    int32_t *labels = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n * T));
    if (!all || !x || !y || !labels) goto done;
    for (i = 0; i < n; i++) all[i] = i;
    mpt__dataset_gather(ctx, d, all, n, MPT_INT32, x, y);
    CHECK(mpt_dataset_labels(ctx, d, 0, n, labels) == MPT_OK, "%s: labels: %s", what,
          mpt_context_error(ctx));
    for (i = 0; i < n && bad < 0; i++)
        for (t = 0; t < T; t++) {
            const uint8_t *w = bytes + at + i * stride + t;
            if (x[i * T + t] != w[0] || y[i * T + t] != w[1] || labels[i * T + t] != w[1]) {
                bad = i;
                CHECK(0, "%s: window %lld position %lld: x %d y %d label %d, the bytes %d %d",
                      what, (long long)i, (long long)t, x[i * T + t], y[i * T + t],
                      labels[i * T + t], w[0], w[1]);
                break;
            }
        }
done:
    free(all);
    free(x);
    free(y);
    free(labels);
}

/* ---- the windows are the bytes ----------------------------------------------- */

static void test_windows_are_the_bytes(void) {
    enum { SIZE = 1000, T = 16 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL, *val = NULL;
    int64_t shape[4] = {0};
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    if (!train || !val) goto done;
    /* the default fraction 0.1: training keeps int(1000 · 0.9) = 900 bytes */
    CHECK(mpt_dataset_count(train) == 900 - T, "train: %lld windows, not %d",
          (long long)mpt_dataset_count(train), 900 - T);
    CHECK(mpt_dataset_count(val) == (100 - 1) / T, "validation: %lld windows, not %d",
          (long long)mpt_dataset_count(val), (100 - 1) / T);
    CHECK(mpt_dataset_sample_shape(train, shape) == 1 && shape[0] == T, "sample shape");
    CHECK(mpt_dataset_target_shape(val, shape) == 1 && shape[0] == T, "target shape");
    check_windows(train, bytes, 0, 1, T, "train");
    check_windows(val, bytes, 900, T, T, "validation");
done:
    mpt_dataset_destroy(train); /* the root first: the view keeps the bytes */
    mpt_dataset_destroy(val);
    free(bytes);
}

/* The file's bytes load as the same bytes in memory do. */
static void test_file_as_memory(void) {
    enum { SIZE = 3001, T = 32 };
    uint8_t *bytes = random_bytes(SIZE);
    char path[256];
    mpt_dataset_text_desc desc = text_desc(T, 0.25f);
    mpt_dataset *train = NULL, *val = NULL;
    snprintf(path, sizeof path, "%s/random.bin", tmp_dir);
    write_file(path, bytes, SIZE);
    CHECK(mpt_dataset_load_text(ctx, path, &desc, &train, &val) == MPT_OK, "load_text: %s",
          mpt_context_error(ctx));
    if (train && val) {
        int64_t cut = (int64_t)(SIZE * 0.75); /* 2250 */
        CHECK(mpt_dataset_count(train) == cut - T && mpt_dataset_count(val) == (SIZE - cut - 1) / T,
              "counts %lld and %lld", (long long)mpt_dataset_count(train),
              (long long)mpt_dataset_count(val));
        check_windows(train, bytes, 0, 1, T, "train");
        check_windows(val, bytes, cut, T, T, "validation");
    }
    mpt_dataset_destroy(val); /* the view first, this time */
    mpt_dataset_destroy(train);
    free(bytes);
}

/* The validation part is exactly the last fraction of the bytes, cut as
   nanoGPT cuts them (training keeps int(n · (1 − f)) for f as written). */
static void test_split_is_the_last_fraction(void) {
    static const struct {
        int64_t size;
        float fraction;
        int64_t train_bytes;
    } cases[] = {{1000, 0, 900},     {1000, 0.1f, 900}, {1000, 0.3f, 700},  {1115394, 0, 1003854},
                 {999, 0.5f, 499},   {200, 0.2f, 160},  {60000, 0.1f, 54000}};
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int64_t T = 8, size = cases[k].size, cut = cases[k].train_bytes;
        uint8_t *bytes = random_bytes(size);
        mpt_dataset_text_desc desc = text_desc(T, cases[k].fraction);
        mpt_dataset *train = NULL, *val = NULL;
        int32_t first[8], last[8];
        test__begin();
        CHECK(mpt_dataset_create_text(ctx, bytes, size, &desc, &train, &val) == MPT_OK,
              "create_text: %s", mpt_context_error(ctx));
        if (train && val) {
            CHECK(mpt_dataset_count(train) == cut - T &&
                      mpt_dataset_count(val) == (size - cut - 1) / T,
                  "counts %lld and %lld", (long long)mpt_dataset_count(train),
                  (long long)mpt_dataset_count(val));
            /* the last training window predicts byte cut - 1; validation
               reads from byte cut */
            mpt_dataset_labels(ctx, train, mpt_dataset_count(train) - 1, 1, last);
            mpt_dataset_labels(ctx, val, 0, 1, first);
            CHECK(last[T - 1] == bytes[cut - 1] && first[0] == bytes[cut + 1],
                  "the cut is not at byte %lld", (long long)cut);
        }
        mpt_dataset_destroy(train);
        mpt_dataset_destroy(val);
        free(bytes);
        test__end("test_split_is_the_last_fraction %lld bytes, fraction %g", (long long)size,
                  (double)cases[k].fraction);
    }
}

/* no_validation: every byte trains; validation NULL alone keeps the cut. */
static void test_no_validation(void) {
    enum { SIZE = 500, T = 10 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL, *val = (mpt_dataset *)&val;
    desc.no_validation = 1;
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK && !val,
          "no_validation: %s", mpt_context_error(ctx));
    CHECK(mpt_dataset_count(train) == SIZE - T, "no_validation: %lld windows",
          (long long)mpt_dataset_count(train));
    check_windows(train, bytes, 0, 1, T, "every byte");
    mpt_dataset_destroy(train);
    desc.no_validation = 0;
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, NULL) == MPT_OK &&
              mpt_dataset_count(train) == 450 - T,
          "validation NULL: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(train);
    free(bytes);
}

/* Views split from each part start further on in the same bytes. */
static void test_views(void) {
    enum { SIZE = 800, T = 12 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0.5f);
    mpt_dataset *train = NULL, *val = NULL, *head = NULL, *tail = NULL, *vhead = NULL,
                *vtail = NULL;
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    if (!train || !val) goto done;
    CHECK(mpt_dataset_split(ctx, train, 100, &head, &tail) == MPT_OK &&
              mpt_dataset_split(ctx, val, 10, &vhead, &vtail) == MPT_OK,
          "split: %s", mpt_context_error(ctx));
    if (!head || !tail || !vhead || !vtail) goto done;
    CHECK(mpt_dataset_count(tail) == 400 - T - 100 && mpt_dataset_count(vtail) == 399 / T - 10,
          "view counts");
    check_windows(head, bytes, 0, 1, T, "train head");
    check_windows(tail, bytes, 100, 1, T, "train tail");
    check_windows(vhead, bytes, 400, T, T, "validation head");
    check_windows(vtail, bytes, 400 + 10 * T, T, T, "validation tail");
done:
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(vhead);
    mpt_dataset_destroy(val);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(vtail);
    free(bytes);
}

/* ---- random windows each step: fit's shuffle over the starts ------------------ */

/* Each epoch's order is a permutation of the starts (every window once),
   no two epochs alike, and the loader's batches in that order are those
   windows. */
static void test_shuffled_epochs(void) {
    enum { SIZE = 5000, T = 20, EPOCHS = 5, BATCH = 32 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL;
    mpt_model *m = NULL;
    int64_t *order[EPOCHS] = {0}, n = 0, i, b = 0;
    char *seen = NULL;
    int e, f;
    mpt__loader *loader = NULL;
    mpt_tensor x, y;
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, NULL) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {T}, .input_rank = 1,
                                                   .input_dtype = MPT_INT32, .seed = 5},
                           &m) == MPT_OK,
          "model: %s", mpt_context_error(ctx));
    if (!train || !m) goto done;
    n = mpt_dataset_count(train);
    seen = (char *)malloc((size_t)n);
    for (e = 0; e < EPOCHS; e++) {
        order[e] = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
        mpt__epoch_order(m, e, 1, order[e], n);
        memset(seen, 0, (size_t)n);
        for (i = 0; i < n; i++)
            if (order[e][i] >= 0 && order[e][i] < n) seen[order[e][i]]++;
        for (i = 0; i < n && seen[i] == 1; i++) {}
        CHECK(i == n, "epoch %d: start %lld is taken %d times", e, (long long)i,
              i < n ? seen[i] : 0);
        for (f = 0; f < e; f++)
            CHECK(memcmp(order[e], order[f], sizeof(int64_t) * (size_t)n) != 0,
                  "epochs %d and %d have the same order", f, e);
    }
    /* the loader's batches of epoch 3, on its thread */
    CHECK(mpt__loader_create(ctx, train, BATCH, MPT_INT32, &loader) == MPT_OK &&
              mpt__loader_start_epoch(loader, order[3], n, BATCH) == MPT_OK,
          "loader: %s", mpt_context_error(ctx));
    while (loader && mpt__loader_next(loader, &x, &y)) {
        const int32_t *xs = (const int32_t *)x.data, *ys = (const int32_t *)y.data;
        int64_t r, t, bad = 0;
        for (r = 0; r < x.shape[0]; r++)
            for (t = 0; t < T; t++) {
                int64_t s = order[3][b * BATCH + r];
                bad += xs[r * T + t] != bytes[s + t] || ys[r * T + t] != bytes[s + t + 1];
            }
        CHECK(bad == 0 && x.rank == 2 && x.shape[1] == T && y.rank == 2 && y.shape[1] == T,
              "batch %lld: %lld values differ from the windows", (long long)b, (long long)bad);
        b++;
    }
    CHECK(b == (n + BATCH - 1) / BATCH, "%lld batches, not %lld", (long long)b,
          (long long)((n + BATCH - 1) / BATCH));
done:
    mpt__loader_destroy(loader);
    for (e = 0; e < EPOCHS; e++) free(order[e]);
    free(seen);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    free(bytes);
}

/* The shuffle of a million windows (a 1 MB text's) takes milliseconds. */
static void test_shuffle_of_a_million(void) {
    const int64_t n = 1000000;
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    mpt_model *m = NULL;
    double start, seconds;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {128}, .input_rank = 1,
                                                   .input_dtype = MPT_INT32}, &m) == MPT_OK,
          "model: %s", mpt_context_error(ctx));
    if (m && order) {
        start = mpt__now();
        mpt__epoch_order(m, 1, 1, order, n);
        seconds = mpt__now() - start;
        printf("# an epoch's order over %lld windows: %.1f ms\n", (long long)n, seconds * 1e3);
        CHECK(seconds < 5, "the shuffle took %.2f s", seconds);
    }
    mpt_model_destroy(m);
    free(order);
}

/* ---- a model on the windows ---------------------------------------------------- */

#define VOCAB 256

/* Embedding(256, 16) -> Dense(256, softmax): each position's next byte
   from its own byte alone (a bigram model), per position of (T,). */
static mpt_model *bigram_model(mpt_context *c, int64_t T, mpt_strategy *strategy) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {T}, .input_rank = 1,
                                                 .input_dtype = MPT_INT32, .seed = 11,
                                                 .strategy = strategy}, &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    if (!m) return NULL;
    CHECK(mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = VOCAB,
                                                           .output_dim = 16}) == MPT_OK,
          "embedding: %s", mpt_context_error(c));
    CHECK(mpt_model_add_dense(m, &(mpt_dense_desc){.units = VOCAB,
                                                   .activation = MPT_ACT_SOFTMAX}) == MPT_OK,
          "dense: %s", mpt_context_error(c));
    test_compile_classifier(c, m);
    return m;
}

/* A repetitive text: a phrase repeated, each of its bytes different, so
   that every byte has one successor, which a bigram model can learn. */
static uint8_t *repetitive_text(int64_t size) {
    static const char phrase[] = "Jumpy-fox.\n";
    uint8_t *b = (uint8_t *)malloc((size_t)size);
    int64_t i;
    for (i = 0; b && i < size; i++) b[i] = (uint8_t)phrase[i % (int64_t)(sizeof phrase - 1)];
    return b;
}

/* evaluate over the validation windows gives the mean of −log p(next
   byte) over their positions, computed here from predict's outputs. */
static void test_evaluate_and_predict(void) {
    enum { SIZE = 2000, T = 16 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL, *val = NULL;
    mpt_model *m = bigram_model(ctx, T, NULL);
    mpt_tensor out;
    mpt_logs logs;
    double ref = 0;
    int64_t n = 0, i, t;
    memset(&out, 0, sizeof out);
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    if (!m || !val) goto done;
    n = mpt_dataset_count(val);
    CHECK(mpt_model_predict(m, val, 5, &out) == MPT_OK && out.rank == 3 && out.shape[0] == n &&
              out.shape[1] == T && out.shape[2] == VOCAB,
          "predict: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, val, &(mpt_evaluate_desc){.batch_size = 5}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    if (out.data) {
        const float *p = (const float *)out.data; /* (n, T, 256) */
        for (i = 0; i < n; i++)
            for (t = 0; t < T; t++)
                ref -= log((double)p[(i * T + t) * VOCAB + bytes[1800 + i * T + t + 1]]);
        ref /= (double)(n * T);
        CHECK(fabs(mpt_logs_get(&logs, "loss") - ref) <= 1e-5 * ref,
              "evaluate's loss %.9g, the mean over predict's outputs %.9g",
              mpt_logs_get(&logs, "loss"), ref);
        CHECK(fabs(ref - log(256.0)) < 0.05, "an untrained model's loss %.4f, not near ln 256",
              ref);
    }
done:
    mpt_tensor_free(ctx, &out);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    free(bytes);
}

/* fit on a repetitive text learns it: the loss, and val_loss over the
   held-out tail, fall from ln 256 to near 0. */
static void test_fit_learns_a_repetitive_text(void) {
    enum { SIZE = 4000, T = 16 };
    uint8_t *bytes = repetitive_text(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL, *val = NULL;
    mpt_model *m = bigram_model(ctx, T, NULL);
    mpt_fit_desc f = fit_for(3, 32);
    mpt_logs logs;
    double before = 0;
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    if (!m || !train || !val) goto done;
    CHECK(mpt_model_evaluate(m, val, NULL, &logs) == MPT_OK, "evaluate: %s",
          mpt_context_error(ctx));
    before = mpt_logs_get(&logs, "loss");
    f.validation_data = val;
    CHECK(mpt_model_fit(m, train, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(history_value(m, "loss", -1) < 0.1 * before && history_value(m, "val_loss", -1) < 0.1 &&
              history_value(m, "val_accuracy", -1) > 0.99,
          "fit took the loss from %.4f to %.4f only (val_loss %.4f, val_accuracy %.3f)", before,
          history_value(m, "loss", -1), history_value(m, "val_loss", -1),
          history_value(m, "val_accuracy", -1));
    printf("# a bigram model on a repetitive text: val_loss %.4f -> %.4f nats per byte in 3 "
           "epochs\n", before, history_value(m, "val_loss", -1));
done:
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    free(bytes);
}

/* One thread and two train the same weights, to the bit, and log the
   same losses. */
static void test_threads_bit_identical(void) {
    enum { SIZE = 3000, T = 16 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_context *c[2] = {NULL, NULL};
    mpt_dataset *train[2] = {NULL, NULL}, *val[2] = {NULL, NULL};
    mpt_model *m[2] = {NULL, NULL};
    mpt_fit_desc f = fit_for(2, 32);
    int k, i, differ = 0;
    for (k = 0; k < 2; k++) {
        mpt_context_desc cd;
        memset(&cd, 0, sizeof cd);
        cd.num_threads = k + 1;
        CHECK(mpt_context_create(&cd, &c[k]) == MPT_OK, "context");
        if (!c[k]) continue;
        CHECK(mpt_dataset_create_text(c[k], bytes, SIZE, &desc, &train[k], &val[k]) == MPT_OK,
              "create_text: %s", mpt_context_error(c[k]));
        m[k] = bigram_model(c[k], T, NULL);
        f.validation_data = val[k];
        if (m[k] && train[k])
            CHECK(mpt_model_fit(m[k], train[k], &f) == MPT_OK, "fit on %d threads: %s", k + 1,
                  mpt_context_error(c[k]));
    }
    if (m[0] && m[1]) {
        CHECK(history_value(m[0], "loss", -1) == history_value(m[1], "loss", -1) &&
                  history_value(m[0], "val_loss", -1) == history_value(m[1], "val_loss", -1),
              "losses: 1 thread %.9g %.9g, 2 threads %.9g %.9g", history_value(m[0], "loss", -1),
              history_value(m[0], "val_loss", -1), history_value(m[1], "loss", -1),
              history_value(m[1], "val_loss", -1));
        for (i = 0; i < m[0]->n_params; i++)
            differ += memcmp(m[0]->params[i].value, m[1]->params[i].value,
                             sizeof(float) * (size_t)m[0]->params[i].count) != 0;
        CHECK(differ == 0, "%d parameters differ between 1 thread and 2", differ);
    }
    for (k = 0; k < 2; k++) {
        mpt_model_destroy(m[k]);
        mpt_dataset_destroy(train[k]);
        mpt_dataset_destroy(val[k]);
        mpt_context_destroy(c[k]);
    }
    free(bytes);
}

/* Two mirrored replicas, each its share of every batch of windows, train
   as one model does. */
static void test_mirrored(void) {
    enum { SIZE = 1200, T = 8 };
    uint8_t *bytes = random_bytes(SIZE);
    mpt_dataset_text_desc desc = text_desc(T, 0);
    mpt_dataset *train = NULL, *val = NULL;
    mpt_strategy *st = NULL;
    mpt_model *one = NULL, *two = NULL;
    mpt_fit_desc f = fit_for(2, 32);
    CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = 2}, &st) == MPT_OK,
          "strategy: %s", mpt_context_error(ctx));
    CHECK(mpt_dataset_create_text(ctx, bytes, SIZE, &desc, &train, &val) == MPT_OK,
          "create_text: %s", mpt_context_error(ctx));
    one = bigram_model(ctx, T, NULL);
    two = bigram_model(ctx, T, st);
    f.validation_data = val;
    if (one && two && train) {
        CHECK(mpt_model_fit(one, train, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(two, train, &f) == MPT_OK, "fit mirrored: %s", mpt_context_error(ctx));
        test_replicas_match(one, two, (const char *const[]){"loss", "val_loss", NULL}, 1e-5);
    }
    mpt_model_destroy(one);
    mpt_model_destroy(two);
    mpt_strategy_destroy(st);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    free(bytes);
}

/* ---- bad input ---------------------------------------------------------------- */

/* A load that must fail with `want` and a message holding both `a` and
   `b`, leaving both outputs NULL. */
static void expect_load_fail(mpt_context *q, const char *path, const mpt_dataset_text_desc *desc,
                             mpt_status want, const char *a, const char *b, const char *what) {
    mpt_dataset *train = (mpt_dataset *)&train, *val = (mpt_dataset *)&val;
    mpt_status s = mpt_dataset_load_text(q, path, desc, &train, &val);
    test__begin();
    CHECK(s == want && !train && !val, "status %d (want %d), outputs %p %p: %s", (int)s, (int)want,
          (void *)train, (void *)val, mpt_context_error(q));
    CHECK(strstr(mpt_context_error(q), a) && strstr(mpt_context_error(q), b),
          "the message '%s' does not name '%s' and '%s'", mpt_context_error(q), a, b);
    if (s == MPT_OK) {
        mpt_dataset_destroy(train);
        mpt_dataset_destroy(val);
    }
    test__end("test_bad_input: %s", what);
}

static void test_bad_input(void) {
    mpt_context *q = quiet_ctx();
    uint8_t *bytes = random_bytes(1000);
    char missing[256], dir[256], small[256], ok[256];
    mpt_dataset_text_desc d = text_desc(128, 0);
    mpt_dataset *train = NULL, *val = NULL;
    snprintf(missing, sizeof missing, "%s/no-such-file.txt", tmp_dir);
    snprintf(dir, sizeof dir, "%s/a-directory", tmp_dir);
    snprintf(small, sizeof small, "%s/small.txt", tmp_dir);
    snprintf(ok, sizeof ok, "%s/ok.txt", tmp_dir);
    mkdir(dir, 0700);
    write_file(small, bytes, 100);
    write_file(ok, bytes, 1000);
    expect_load_fail(q, missing, &d, MPT_ERR_IO, missing, "No such file", "a missing file");
    expect_load_fail(q, dir, &d, MPT_ERR_IO, dir, "a directory", "a directory");
    /* 100 bytes: training keeps 90, fewer than T + 1 = 129 */
    expect_load_fail(q, small, &d, MPT_ERR_FORMAT, small, "training part, 90 of its 100 bytes",
                     "a file shorter than a window");
    /* 1000 bytes: training 900 > 129, validation 100 < 129 */
    expect_load_fail(q, ok, &d, MPT_ERR_FORMAT, ok, "validation part, the last 100 of its 1000",
                     "a validation part shorter than a window");
    d.sequence_length = 0;
    expect_load_fail(q, ok, &d, MPT_ERR_INVALID_ARGUMENT, ok, "sequence_length 0",
                     "sequence_length 0");
    d.sequence_length = -5;
    expect_load_fail(q, ok, &d, MPT_ERR_INVALID_ARGUMENT, ok, "sequence_length -5",
                     "sequence_length < 0");
    d.sequence_length = INT64_MAX;
    expect_load_fail(q, ok, &d, MPT_ERR_FORMAT, ok, "sequence_length 9223372036854775807",
                     "sequence_length past any file");
    d.sequence_length = 16;
    d.validation_fraction = 1.0f;
    expect_load_fail(q, ok, &d, MPT_ERR_INVALID_ARGUMENT, ok, "validation_fraction 1 ",
                     "validation_fraction 1");
    d.validation_fraction = -0.1f;
    expect_load_fail(q, ok, &d, MPT_ERR_INVALID_ARGUMENT, ok, "validation_fraction -0.1",
                     "validation_fraction < 0");
    d.validation_fraction = NAN;
    expect_load_fail(q, ok, &d, MPT_ERR_INVALID_ARGUMENT, ok, "validation_fraction nan",
                     "validation_fraction NaN");
    d.validation_fraction = 0.999f;
    expect_load_fail(q, ok, &d, MPT_ERR_FORMAT, ok, "training part, 1 of its 1000",
                     "validation_fraction leaving no training bytes");
    expect_load_fail(q, ok, NULL, MPT_ERR_INVALID_ARGUMENT, "load_text", "sequence_length is "
                     "required", "a NULL descriptor");
    expect_load_fail(q, NULL, &d, MPT_ERR_INVALID_ARGUMENT, "load_text", "NULL path", "NULL path");

    test__begin();
    d = text_desc(16, 0);
    CHECK(mpt_dataset_load_text(q, ok, &d, NULL, &val) == MPT_ERR_INVALID_ARGUMENT && !val,
          "NULL train accepted");
    CHECK(mpt_dataset_create_text(q, NULL, 10, &d, &train, &val) == MPT_ERR_INVALID_ARGUMENT &&
              !train && !val, "NULL bytes accepted");
    CHECK(mpt_dataset_create_text(q, bytes, -1, &d, &train, &val) == MPT_ERR_INVALID_ARGUMENT,
          "a negative size accepted");
    CHECK(mpt_dataset_create_text(q, bytes, 0, &d, &train, &val) == MPT_ERR_FORMAT &&
              strstr(mpt_context_error(q), "text in memory") && !train && !val,
          "no bytes: %s", mpt_context_error(q));
    CHECK(mpt_dataset_create_text(q, bytes, 100, &d, &train, &val) == MPT_ERR_FORMAT &&
              strstr(mpt_context_error(q), "validation part, the last 10 of its 100 bytes"),
          "100 bytes, windows of 16: the 10 of validation accepted (%s)", mpt_context_error(q));
    test__end("test_bad_input: NULL and empty arguments, bytes in memory");

    /* The bytes are ids: a table without room for them all is refused, by
       the byte's offset in the text; a window of another length too. */
    test__begin();
    {
        mpt_model *m = NULL, *other = NULL;
        d = text_desc(16, 0);
        CHECK(mpt_dataset_load_text(q, ok, &d, &train, &val) == MPT_OK, "load: %s",
              mpt_context_error(q));
        CHECK(mpt_model_create(q, &(mpt_model_desc){.input_shape = {16}, .input_rank = 1,
                                                     .input_dtype = MPT_INT32}, &m) == MPT_OK,
              "model");
        if (m && train) {
            int64_t k = 0;
            char want[64];
            while (bytes[k] < 100) k++;
            mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 100, .output_dim = 4});
            mpt_model_add_dense(m, &(mpt_dense_desc){.units = 100, .activation = MPT_ACT_SOFTMAX});
            test_compile_classifier(q, m);
            snprintf(want, sizeof want, "got id %d (byte %lld of the text)", bytes[k],
                     (long long)k);
            CHECK(mpt_model_fit(m, train, NULL) == MPT_ERR_INVALID_ARGUMENT &&
                      strstr(mpt_context_error(q), want),
                  "an id past the table: '%s' does not say '%s'", mpt_context_error(q), want);
        }
        other = bigram_model(q, 24, NULL);
        if (other && train)
            CHECK(mpt_model_fit(other, train, NULL) == MPT_ERR_SHAPE,
                  "windows of 16 for a model of 24 positions: %s", mpt_context_error(q));
        mpt_model_destroy(m);
        mpt_model_destroy(other);
        mpt_dataset_destroy(train);
        mpt_dataset_destroy(val);
    }
    test__end("test_bad_input: ids past the table, windows of another length");
    free(bytes);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_windows_are_the_bytes);
    TEST_RUN(test_file_as_memory);
    test_split_is_the_last_fraction();
    TEST_RUN(test_no_validation);
    TEST_RUN(test_views);
    TEST_RUN(test_shuffled_epochs);
    TEST_RUN(test_shuffle_of_a_million);
    TEST_RUN(test_evaluate_and_predict);
    TEST_RUN(test_fit_learns_a_repetitive_text);
    TEST_RUN(test_threads_bit_identical);
    TEST_RUN(test_mirrored);
    test_bad_input();
}

int main(void) {
    static const test_program p = {.name = "test_text", .ctx = &ctx, .seed = 2501,
                                   .tmpdir = tmp_dir, .tmpdir_size = sizeof tmp_dir,
                                   .cases = run_cases};
    return test_main(&p);
}

/* Checkpoints in safetensors format: round trips of the weights and of the
   full training state, the exact bytes of a file, models that do not match
   a file, malformed files, crash safety of saving, and (where Python has
   safetensors and numpy) files that the reference library reads and writes. */
#define _POSIX_C_SOURCE 200809L /* opendir, fork, kill */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* >= 0: saving fails with ENOSPC after this many bytes (see checkpoint.h). */
static long long fail_after = -1;
/* Called at each write of a save: returns fail_after (and may look at the
   save in progress from another process). */
static long long during_save(void);
#define MPT__CHECKPOINT_FAIL_AFTER_BYTES during_save()

#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx; /* one thread; errors counted, warnings kept */
static char dir[64];     /* a fresh directory for this run's files */
static char last_warning[1024];

static void test_logger(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    if (level == MPT_LOG_ERROR) count_errors++;
    if (level == MPT_LOG_WARNING) snprintf(last_warning, sizeof last_warning, "%s", msg);
}

/* ---- files ------------------------------------------------------------------- */

static int exists(const char *path) { return access(path, F_OK) == 0; }

static const char *path_of(char *buf, const char *name) {
    snprintf(buf, 256, "%s/%s", dir, name);
    return buf;
}

static void spit(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(bytes, 1, n, f);
        fclose(f);
    }
}

/* A safetensors file from its JSON (padded with spaces to a multiple of 8)
   and its data. */
static void write_st(const char *path, const char *json, const void *data, size_t data_len) {
    size_t len = strlen(json), n = (len + 7) / 8 * 8, i;
    unsigned char *buf = (unsigned char *)calloc(1, 8 + n + data_len + 1);
    for (i = 0; i < 8; i++) buf[i] = (unsigned char)((unsigned long long)n >> (8 * i));
    memcpy(buf + 8, json, len);
    memset(buf + 8 + len, ' ', n - len);
    if (data_len) memcpy(buf + 8 + n, data, data_len);
    spit(path, buf, 8 + n + data_len);
    free(buf);
}

/* The header's JSON of a safetensors file (malloc'd), or NULL. */
static char *header_of(const char *path) {
    long n;
    unsigned char *b = test_read_file(path, &n);
    unsigned long long len = 0;
    char *json = NULL;
    int i;
    if (b && n >= 8) {
        for (i = 0; i < 8; i++) len |= (unsigned long long)b[i] << (8 * i);
        if (len <= (unsigned long long)n - 8) {
            json = (char *)malloc(len + 1);
            memcpy(json, b + 8, len);
            json[len] = 0;
        }
    }
    free(b);
    return json;
}

/* How many files in dir have a name starting with prefix. */
static int files_starting(const char *prefix) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* ---- models ------------------------------------------------------------------ */

typedef struct arch {
    mpt_policy policy;
    uint64_t seed;
    int64_t units;   /* of the Dense; default 5 */
    int no_bn;       /* leave BatchNormalization out */
    int extra_dense; /* a second Dense (3 units) at the end */
} arch;

/* Conv2D -> BatchNormalization -> Flatten -> Dense (-> Dense) on 6x6x2 images. */
static mpt_model *make_model(arch a) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6, 6, 2}, .input_rank = 3,
                                                  .policy = a.policy, .seed = a.seed},
                           &m) == MPT_OK, "create: %s", mpt_context_error(ctx));
    if (!m) return NULL;
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    if (!a.no_bn) mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.momentum = 0.9f});
    mpt_model_add_flatten(m, &(mpt_flatten_desc){0});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = a.units ? a.units : 5});
    if (a.extra_dense) mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* Dense(2) on 3 inputs: dense/kernel (3, 2) and dense/bias (2,). */
static mpt_model *make_tiny(void) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build tiny: %s", mpt_context_error(ctx));
    return m;
}

static mpt_status compile_with(mpt_model *m, mpt_optimizer_type type, float momentum) {
    mpt_compile_desc c;
    memset(&c, 0, sizeof c);
    c.optimizer.type = type;
    c.optimizer.momentum = momentum;
    c.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    c.loss.from_logits = 1;
    return mpt_model_compile(m, &c);
}

/* Recognisable values in every parameter (BatchNormalization's moving
   statistics too, the variance kept positive) and every optimizer slot. */
static void fill_model(mpt_model *m, float salt) {
    int i, k;
    int64_t j;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        int positive = strstr(P->name, "moving_variance") != NULL;
        for (j = 0; j < P->count; j++) {
            float v = salt + 0.01f * (float)i + (float)sin(0.37 * (double)j + i);
            P->value[j] = positive ? fabsf(v) + 0.5f : v;
            for (k = 0; k < 2; k++)
                if (P->slot[k])
                    P->slot[k][j] = 1000.0f * (float)(k + 1) + salt + (float)i + 0.125f * (float)j;
        }
    }
    mpt_model_refresh_weights(m);
}

static void fill_train_state(mpt_model *m) {
    m->optimizer_steps = 123456789012LL;
    m->step = 98765;
    m->epoch = 7;
    m->learning_rate = 0.00123f;
    m->loss_scale = 4096.0f;
    m->good_steps = 1999;
    m->skipped_steps = 3;
}

/* Everything a load may change: masters, compute copies, slots, scalars. */
typedef struct snapshot {
    unsigned char *bytes;
    size_t n;
} snapshot;

static void snap_put(snapshot *s, const void *p, size_t n) {
    s->bytes = (unsigned char *)realloc(s->bytes, s->n + n);
    memcpy(s->bytes + s->n, p, n);
    s->n += n;
}

static snapshot snap_take(const mpt_model *m) {
    snapshot s = {NULL, 0};
    int i, k;
    for (i = 0; i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        snap_put(&s, P->value, 4 * (size_t)P->count);
        snap_put(&s, P->compute, mpt_dtype_size(P->compute_dtype) * (size_t)P->count);
        for (k = 0; k < 2; k++)
            if (P->slot[k]) snap_put(&s, P->slot[k], 4 * (size_t)P->count);
    }
    snap_put(&s, &m->optimizer_steps, sizeof m->optimizer_steps);
    snap_put(&s, &m->step, sizeof m->step);
    snap_put(&s, &m->epoch, sizeof m->epoch);
    snap_put(&s, &m->learning_rate, sizeof m->learning_rate);
    snap_put(&s, &m->loss_scale, sizeof m->loss_scale);
    snap_put(&s, &m->good_steps, sizeof m->good_steps);
    snap_put(&s, &m->skipped_steps, sizeof m->skipped_steps);
    return s;
}

static int snap_same(const mpt_model *m, snapshot before) {
    snapshot now = snap_take(m);
    int same = now.n == before.n && memcmp(now.bytes, before.bytes, now.n) == 0;
    free(now.bytes);
    return same;
}

static const mpt__param *param_named(const mpt_model *m, const char *name) {
    int i;
    for (i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return &m->params[0];
}

/* Masters (and, with slots, the optimizer state) of two models bit for bit. */
static int same_state(const mpt_model *a, const mpt_model *b, int slots) {
    int i, k;
    if (a->n_params != b->n_params) return 0;
    for (i = 0; i < a->n_params; i++) {
        const mpt__param *P = &a->params[i], *Q = &b->params[i];
        if (strcmp(P->name, Q->name) != 0 || P->count != Q->count ||
            memcmp(P->value, Q->value, 4 * (size_t)P->count) != 0)
            return 0;
        for (k = 0; slots && k < 2; k++)
            if ((P->slot[k] == NULL) != (Q->slot[k] == NULL) ||
                (P->slot[k] && memcmp(P->slot[k], Q->slot[k], 4 * (size_t)P->count) != 0))
                return 0;
    }
    return 1;
}

/* Each compute-dtype copy is the conversion of its master. */
static int copies_fresh(const mpt_model *m) {
    int i;
    int64_t j;
    for (i = 0; i < m->n_params; i++) {
        const mpt__param *P = &m->params[i];
        const uint16_t *h = (const uint16_t *)P->compute;
        if (P->compute == (void *)P->value) continue;
        for (j = 0; j < P->count; j++) {
            uint16_t want = P->compute_dtype == MPT_FLOAT16 ? mpt_float_to_half(P->value[j])
                                                             : mpt_float_to_bf16(P->value[j]);
            if (h[j] != want) return 0;
        }
    }
    return 1;
}

/* Inference outputs of two models on the same input, bit for bit. */
static int same_outputs(mpt_model *a, mpt_model *b) {
    float x[2 * 6 * 6 * 2];
    mpt_tensor t, ya, yb;
    int i, same;
    test_seed(11);
    for (i = 0; i < 2 * 6 * 6 * 2; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &t, MPT_FLOAT32, 4, (int64_t[]){2, 6, 6, 2}, x);
    if (mpt_model_forward(a, &t, 0, &ya) != MPT_OK) return 0;
    if (mpt_model_forward(b, &t, 0, &yb) != MPT_OK) return 0;
    same = ya.dtype == yb.dtype && memcmp(ya.data, yb.data, mpt_tensor_bytes(&ya)) == 0;
    return same;
}

/* ---- round trips ----------------------------------------------------------------- */

static void test_weights_round_trip(void) {
    static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                          MPT_POLICY_MIXED_BFLOAT16};
    char p[256];
    int k;
    for (k = 0; k < 3; k++) {
        arch a = {policies[k], 1, 0, 0, 0}, b = a;
        mpt_model *ma, *mb;
        test__begin();
        b.seed = 2; /* other initial weights, which the load must replace */
        ma = make_model(a);
        mb = make_model(b);
        fill_model(ma, 0.5f);
        CHECK(mpt_model_save_weights(ma, path_of(p, "w.safetensors")) == MPT_OK, "save: %s",
              mpt_context_error(ctx));
        CHECK(!same_state(ma, mb, 0), "the two models start out different");
        CHECK(mpt_model_load_weights(mb, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
        CHECK(same_state(ma, mb, 0), "masters (BatchNormalization's moving statistics "
              "included) are bit-identical after the round trip");
        CHECK(copies_fresh(mb), "the compute-dtype copies were refreshed from the masters");
        CHECK(same_outputs(ma, mb), "the loaded model computes the same outputs");
        CHECK(files_starting("w.safetensors.tmp") == 0, "no temporary file is left behind");
        mpt_model_destroy(ma);
        mpt_model_destroy(mb);
        test__end("weights round trip (Conv2D, BatchNormalization, Dense), policy %s",
                  k == 0 ? "float32" : k == 1 ? "mixed_float16" : "mixed_bfloat16");
    }
}

static void check_full_round_trip(mpt_optimizer_type type, float momentum, const char *slot_key,
                                  const char *label) {
    arch a = {MPT_POLICY_MIXED_FLOAT16, 3, 0, 0, 0}, b = a;
    mpt_model *ma, *mb, *mc;
    snapshot before;
    char p[256], *json;
    test__begin();
    b.seed = 4;
    ma = make_model(a);
    mb = make_model(b);
    mc = make_model(b);
    CHECK(compile_with(ma, type, momentum) == MPT_OK && compile_with(mb, type, momentum) == MPT_OK
              && compile_with(mc, type, momentum) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    fill_model(ma, 0.25f);
    fill_train_state(ma);
    CHECK(mpt_model_save_checkpoint(ma, path_of(p, "full.safetensors")) == MPT_OK, "save: %s",
          mpt_context_error(ctx));
    last_warning[0] = 0;
    CHECK(mpt_model_load_checkpoint(mb, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(same_state(ma, mb, 1), "masters and optimizer slots bit-identical");
    CHECK(copies_fresh(mb), "compute-dtype copies refreshed");
    CHECK(mb->optimizer_steps == 123456789012LL && mb->step == 98765 && mb->epoch == 7 &&
          mb->good_steps == 1999 && mb->skipped_steps == 3,
          "counters restored: %lld %llu %d %lld %lld", (long long)mb->optimizer_steps,
          (unsigned long long)mb->step, mb->epoch, (long long)mb->good_steps,
          (long long)mb->skipped_steps);
    CHECK(memcmp(&mb->learning_rate, &ma->learning_rate, 4) == 0 &&
          memcmp(&mb->loss_scale, &ma->loss_scale, 4) == 0, "learning rate %g, loss scale %g",
          (double)mb->learning_rate, (double)mb->loss_scale);
    CHECK(mpt_model_epoch(mb) == 7, "mpt_model_epoch %d", mpt_model_epoch(mb));
    CHECK(strstr(last_warning, "seed 3") != NULL, "a warning says the seeds differ: '%s'",
          last_warning);
    json = header_of(p);
    CHECK(json && strstr(json, "\"kind\":\"checkpoint\""), "metadata kind checkpoint");
    CHECK(json && (slot_key ? strstr(json, slot_key) != NULL
                            : strstr(json, "\"optimizer/") == NULL),
          "optimizer entries: want %s", slot_key ? slot_key : "none");
    CHECK(json && strstr(json, "\"train/loss_scale\":{\"dtype\":\"F32\",\"shape\":[]"),
          "train/loss_scale is a rank-0 F32");
    free(json);
    /* load_weights takes the weights out of a full checkpoint and nothing else */
    before = snap_take(mc);
    CHECK(mpt_model_load_weights(mc, p) == MPT_OK, "load_weights of a checkpoint: %s",
          mpt_context_error(ctx));
    CHECK(same_state(ma, mc, 0), "load_weights: masters bit-identical");
    CHECK(mc->epoch == 0 && mc->optimizer_steps == 0 && mc->step == 0,
          "load_weights leaves the training scalars alone");
    CHECK(mc->n_slots == 0 || mc->params[0].slot[0][0] == 0.0f,
          "load_weights leaves the optimizer state alone");
    free(before.bytes);
    mpt_model_destroy(ma);
    mpt_model_destroy(mb);
    mpt_model_destroy(mc);
    test__end("full checkpoint round trip, %s", label);
}

static void test_full_round_trip(void) {
    check_full_round_trip(MPT_OPTIMIZER_ADAM, 0, "\"optimizer/dense/kernel/v\"", "adam");
    check_full_round_trip(MPT_OPTIMIZER_ADAMW, 0, "\"optimizer/conv2d/bias/m\"", "adamw");
    check_full_round_trip(MPT_OPTIMIZER_SGD, 0.9f,
                          "\"optimizer/batch_normalization/gamma/momentum\"", "sgd, momentum");
    check_full_round_trip(MPT_OPTIMIZER_SGD, 0, NULL, "sgd, no momentum (no slots)");
}

/* ---- the bytes of a file ------------------------------------------------------------ */

static void check_layout(const char *path, const char *json, const unsigned char *data,
                         size_t data_len) {
    long n;
    unsigned char *b = test_read_file(path, &n);
    size_t len = strlen(json), padded = (len + 7) / 8 * 8, i;
    unsigned long long N = 0;
    CHECK(b != NULL, "read %s", path);
    if (!b) return;
    for (i = 0; i < 8; i++) N |= (unsigned long long)b[i] << (8 * i);
    CHECK(N == padded && N % 8 == 0, "header length %llu, want %zu (a multiple of 8)", N, padded);
    CHECK((size_t)n == 8 + padded + data_len, "file size %ld, want 8 + %zu + %zu", n, padded,
          data_len);
    if ((size_t)n == 8 + padded + data_len) {
        CHECK(memcmp(b + 8, json, len) == 0, "header:\n got  %.*s\n want %s", (int)len, b + 8,
              json);
        for (i = len; i < padded; i++) CHECK(b[8 + i] == ' ', "padding byte %zu is a space", i);
        CHECK(memcmp(b + 8 + padded, data, data_len) == 0, "data bytes");
    }
    free(b);
}

static void put_f32(unsigned char *p, float v) {
    uint32_t u;
    int i;
    memcpy(&u, &v, 4);
    for (i = 0; i < 4; i++) p[i] = (unsigned char)(u >> (8 * i));
}

static void put_i64(unsigned char *p, long long v) {
    int i;
    for (i = 0; i < 8; i++) p[i] = (unsigned char)((unsigned long long)v >> (8 * i));
}

static void test_file_layout(void) {
    static const float kernel[6] = {1, 2, 3, 4, 5, 6.5f}, bias[2] = {0.5f, -0.25f};
    static const char *weights_json =
        "{\"__metadata__\":{\"format\":\"mpt\",\"mpt_version\":\"" MPT_VERSION "\","
        "\"kind\":\"weights\",\"policy\":\"float32\",\"seed\":\"0\",\"input_shape\":\"(3,)\","
        "\"model\":\"Dense dense float32 (2,)\"},"
        "\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]},"
        "\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[24,32]}}";
    static const char *full_json =
        "{\"__metadata__\":{\"format\":\"mpt\",\"mpt_version\":\"" MPT_VERSION "\","
        "\"kind\":\"checkpoint\",\"optimizer\":\"sgd\",\"policy\":\"float32\",\"seed\":\"0\","
        "\"input_shape\":\"(3,)\",\"model\":\"Dense dense float32 (2,)\"},"
        "\"train/optimizer_steps\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
        "\"train/step\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
        "\"train/epoch\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[16,24]},"
        "\"train/good_steps\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]},"
        "\"train/skipped_steps\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[32,40]},"
        "\"train/learning_rate\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[40,44]},"
        "\"train/loss_scale\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[44,48]},"
        "\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[48,72]},"
        "\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[72,80]},"
        "\"optimizer/dense/kernel/momentum\":{\"dtype\":\"F32\",\"shape\":[3,2],"
        "\"data_offsets\":[80,104]},"
        "\"optimizer/dense/bias/momentum\":{\"dtype\":\"F32\",\"shape\":[2],"
        "\"data_offsets\":[104,112]}}";
    unsigned char data[112];
    mpt_model *m = make_tiny();
    char p[256];
    int i;
    if (!m) return;
    memcpy(m->params[0].value, kernel, sizeof kernel);
    memcpy(m->params[1].value, bias, sizeof bias);
    for (i = 0; i < 6; i++) put_f32(data + 4 * i, kernel[i]);
    for (i = 0; i < 2; i++) put_f32(data + 24 + 4 * i, bias[i]);
    CHECK(mpt_model_save_weights(m, path_of(p, "tiny.safetensors")) == MPT_OK, "save: %s",
          mpt_context_error(ctx));
    check_layout(p, weights_json, data, 32);

    CHECK(compile_with(m, MPT_OPTIMIZER_SGD, 0.5f) == MPT_OK, "compile: %s",
          mpt_context_error(ctx));
    fill_train_state(m);
    for (i = 0; i < 6; i++) m->params[0].slot[0][i] = -1.0f - (float)i;
    for (i = 0; i < 2; i++) m->params[1].slot[0][i] = 100.0f + (float)i;
    put_i64(data + 0, 123456789012LL);
    put_i64(data + 8, 98765);
    put_i64(data + 16, 7);
    put_i64(data + 24, 1999);
    put_i64(data + 32, 3);
    put_f32(data + 40, 0.00123f);
    put_f32(data + 44, 4096.0f);
    for (i = 0; i < 6; i++) put_f32(data + 48 + 4 * i, kernel[i]);
    for (i = 0; i < 2; i++) put_f32(data + 72 + 4 * i, bias[i]);
    for (i = 0; i < 6; i++) put_f32(data + 80 + 4 * i, -1.0f - (float)i);
    for (i = 0; i < 2; i++) put_f32(data + 104 + 4 * i, 100.0f + (float)i);
    CHECK(mpt_model_save_checkpoint(m, path_of(p, "tiny_full.safetensors")) == MPT_OK, "save: %s",
          mpt_context_error(ctx));
    check_layout(p, full_json, data, 112);
    mpt_model_destroy(m);
}

/* ---- models that do not fit a file ----------------------------------------------- */

/* Loads `path` into m (full: as a checkpoint) and expects `want`, a message
   containing each of the `needles`, and m exactly as it was. */
static void expect_refused(mpt_model *m, const char *path, int full, mpt_status want,
                           const char *needle1, const char *needle2, const char *label) {
    snapshot before;
    mpt_status s;
    test__begin();
    if (m) {
        fill_model(m, -3.0f);
        before = snap_take(m);
        s = full ? mpt_model_load_checkpoint(m, path) : mpt_model_load_weights(m, path);
        CHECK(s == want, "status %s, want %s (%s)", mpt_status_string(s), mpt_status_string(want),
              mpt_context_error(ctx));
        CHECK(!needle1 || strstr(mpt_context_error(ctx), needle1), "message '%s' names '%s'",
              mpt_context_error(ctx), needle1);
        CHECK(!needle2 || strstr(mpt_context_error(ctx), needle2), "message '%s' names '%s'",
              mpt_context_error(ctx), needle2);
        CHECK(snap_same(m, before), "the model is unchanged");
        free(before.bytes);
    }
    test__end("%s is refused", label);
}

static void test_mismatches(void) {
    arch base = {MPT_POLICY_MIXED_BFLOAT16, 5, 0, 0, 0}, a;
    mpt_model *src = make_model(base), *m;
    char w[256], c[256], p[256];
    long n;
    unsigned char *bytes;
    test__begin();
    CHECK(src && compile_with(src, MPT_OPTIMIZER_ADAM, 0) == MPT_OK, "compile");
    if (src) {
        fill_model(src, 1.0f);
        fill_train_state(src);
    }
    CHECK(mpt_model_save_weights(src, path_of(w, "base_w.safetensors")) == MPT_OK, "save");
    CHECK(mpt_model_save_checkpoint(src, path_of(c, "base_c.safetensors")) == MPT_OK, "save");
    test__end("mismatches: the reference files are saved");
    if (!src) return;

    a = base, a.units = 6;
    m = make_model(a);
    expect_refused(m, w, 0, MPT_ERR_SHAPE, "dense/kernel", "(144, 6)", "a Dense with other units");
    mpt_model_destroy(m);

    a = base, a.extra_dense = 1;
    m = make_model(a);
    expect_refused(m, w, 0, MPT_ERR_SHAPE, "dense_1/kernel", w, "a file missing a layer");
    mpt_model_destroy(m);

    a = base, a.no_bn = 1;
    m = make_model(a);
    expect_refused(m, w, 0, MPT_ERR_SHAPE, "batch_normalization/", "does not have",
                   "a file with a layer the model lacks");
    mpt_model_destroy(m);

    m = make_model(base);
    compile_with(m, MPT_OPTIMIZER_ADAM, 0);
    expect_refused(m, w, 1, MPT_ERR_SHAPE, "load_weights", NULL,
                   "load_checkpoint of a weights file");
    mpt_model_destroy(m);

    m = make_model(base);
    compile_with(m, MPT_OPTIMIZER_SGD, 0.9f);
    expect_refused(m, c, 1, MPT_ERR_SHAPE, "adam", "sgd", "an Adam checkpoint into an SGD model");
    mpt_model_destroy(m);

    /* The same checkpoint without its metadata: the slot entries decide. */
    m = make_model(base);
    compile_with(m, MPT_OPTIMIZER_SGD, 0.9f);
    bytes = test_read_file(c, &n);
    if (bytes) {
        char *json = header_of(c), *meta_end = json ? strstr(json, "},\"train/") : NULL;
        unsigned long long N = 0;
        int i;
        for (i = 0; i < 8; i++) N |= (unsigned long long)bytes[i] << (8 * i);
        if (meta_end) {
            char *stripped = (char *)malloc(strlen(json) + 1);
            sprintf(stripped, "{%s", meta_end + 2);
            write_st(path_of(p, "no_meta.safetensors"), stripped, bytes + 8 + N,
                     (size_t)n - 8 - (size_t)N);
            free(stripped);
        }
        free(json);
        free(bytes);
    }
    expect_refused(m, p, 1, MPT_ERR_SHAPE, "optimizer/", NULL,
                   "an Adam checkpoint without metadata into an SGD model");
    mpt_model_destroy(m);

    /* A checkpoint whose loss scale is negative: every scalar is checked
       before the weights are read. */
    bytes = test_read_file(c, &n);
    if (bytes) {
        unsigned long long N = 0;
        int i;
        for (i = 0; i < 8; i++) N |= (unsigned long long)bytes[i] << (8 * i);
        put_f32(bytes + 8 + N + 44, -1.0f);
        spit(path_of(p, "bad_scale.safetensors"), bytes, (size_t)n);
        free(bytes);
    }
    m = make_model(base);
    compile_with(m, MPT_OPTIMIZER_ADAM, 0);
    expect_refused(m, p, 1, MPT_ERR_FORMAT, "train/loss_scale", NULL,
                   "a checkpoint with a negative loss scale");
    mpt_model_destroy(m);

    /* A file whose dense/bias is F16: the right shape, the wrong dtype;
       one whose kernel is transposed. */
    {
        static const struct {
            const char *file, *header;
            mpt_status status;
            const char *word1, *word2, *what;
        } wrong[] = {
            {"f16.safetensors",
             "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]},"
             "\"dense/bias\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[24,28]}}",
             MPT_ERR_FORMAT, "dense/bias", "F16 (2,)", "a dtype other than F32"},
            {"transposed.safetensors",
             "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
             "\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[24,28]}}",
             MPT_ERR_SHAPE, "(2, 3)", "(3, 2)", "a transposed kernel"},
        };
        unsigned char data[28];
        size_t i;
        for (i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
            memset(data, 0, sizeof data);
            write_st(path_of(p, wrong[i].file), wrong[i].header, data, sizeof data);
            m = make_tiny();
            expect_refused(m, p, 0, wrong[i].status, wrong[i].word1, wrong[i].word2,
                           wrong[i].what);
            mpt_model_destroy(m);
        }
    }

    /* The wrong order of calls. */
    test__begin();
    {
        mpt_model *unbuilt = NULL, *uncompiled = make_tiny();
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &unbuilt);
        mpt_model_add_dense(unbuilt, &(mpt_dense_desc){.units = 2});
        CHECK(mpt_model_load_weights(unbuilt, w) == MPT_ERR_STATE, "load into an unbuilt model");
        CHECK(mpt_model_save_weights(unbuilt, p) == MPT_ERR_STATE, "save an unbuilt model");
        CHECK(mpt_model_save_checkpoint(uncompiled, p) == MPT_ERR_STATE &&
                  strstr(mpt_context_error(ctx), "compile"),
              "save_checkpoint of an uncompiled model: %s", mpt_context_error(ctx));
        CHECK(mpt_model_load_checkpoint(uncompiled, c) == MPT_ERR_STATE,
              "load_checkpoint into an uncompiled model");
        CHECK(mpt_model_save_weights(NULL, p) == MPT_ERR_INVALID_ARGUMENT, "NULL model");
        CHECK(mpt_model_save_weights(uncompiled, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL path");
        CHECK(mpt_model_load_weights(uncompiled, "") == MPT_ERR_INVALID_ARGUMENT, "empty path");
        CHECK(mpt_model_epoch(NULL) == 0, "mpt_model_epoch(NULL)");
        mpt_model_destroy(unbuilt);
        mpt_model_destroy(uncompiled);
    }
    test__end("checkpoints need a built (and, for the full state, compiled) model");
    mpt_model_destroy(src);
}

/* ---- values training cannot produce ------------------------------------------------ */

/* src with n bytes at `at` of its data (after the header) replaced, as dst. */
static void patch_data(const char *src, const char *dst, long long at, const void *bytes,
                       size_t n) {
    long len;
    unsigned char *b = test_read_file(src, &len);
    unsigned long long N = 0;
    int i;
    if (!b) return;
    for (i = 0; i < 8; i++) N |= (unsigned long long)b[i] << (8 * i);
    if ((long long)(8 + N) + at + (long long)n <= len) memcpy(b + 8 + N + at, bytes, n);
    spit(dst, b, (size_t)len);
    free(b);
}

static void patch_i64(const char *src, const char *dst, long long at, long long v) {
    unsigned char b[8];
    put_i64(b, v);
    patch_data(src, dst, at, b, 8);
}

static void patch_f32(const char *src, const char *dst, long long at, float v) {
    unsigned char b[4];
    put_f32(b, v);
    patch_data(src, dst, at, b, 4);
}

/* Where tensor `name` starts in the data of the file at path, or -1. */
static long long tensor_begin(const char *path, const char *name) {
    char *json = header_of(path), key[256], *at;
    long long begin = -1;
    snprintf(key, sizeof key, "\"%s\":{", name);
    at = json ? strstr(json, key) : NULL;
    at = at ? strstr(at, "\"data_offsets\":[") : NULL;
    if (at) begin = strtoll(at + strlen("\"data_offsets\":["), NULL, 10);
    free(json);
    return begin;
}

/* The file at src without its __metadata__, as dst. */
static void strip_metadata(const char *src, const char *dst) {
    long n;
    unsigned char *bytes = test_read_file(src, &n);
    char *json = header_of(src), *meta_end = json ? strstr(json, "},\"") : NULL;
    unsigned long long N = 0;
    int i;
    if (bytes && meta_end) {
        char *stripped = (char *)malloc(strlen(json) + 1);
        for (i = 0; i < 8; i++) N |= (unsigned long long)bytes[i] << (8 * i);
        sprintf(stripped, "{%s", meta_end + 2);
        write_st(dst, stripped, bytes + 8 + N, (size_t)n - 8 - (size_t)N);
        free(stripped);
    }
    free(json);
    free(bytes);
}

/* A mixed_float16 model (dynamic loss scaling) with Adam, its state filled. */
static mpt_model *make_f16_adam(uint64_t seed) {
    arch a = {MPT_POLICY_MIXED_FLOAT16, seed, 0, 0, 0};
    mpt_model *m = make_model(a);
    CHECK(m && compile_with(m, MPT_OPTIMIZER_ADAM, 0) == MPT_OK, "compile: %s",
          mpt_context_error(ctx));
    return m;
}

/* Each training scalar is bounded to what training can reach: counters
   past 2^62 (INT64_MAX overflowed the next step's "+ 1"), an epoch past
   INT_MAX, a learning rate or loss scale that is not a finite float in
   range. The limits themselves load, and training goes on from them. */
static void test_counter_bounds(void) {
    static const struct {
        const char *name;
        long long at, v;
    } counters[] = {
        {"train/optimizer_steps", 0, 9223372036854775807LL},
        {"train/optimizer_steps", 0, (1LL << 62) + 1},
        {"train/optimizer_steps", 0, -1},
        {"train/step", 8, 9223372036854775807LL},
        {"train/step", 8, (1LL << 62) + 1},
        {"train/epoch", 16, 2147483648LL},
        {"train/epoch", 16, -5},
        {"train/good_steps", 24, 9223372036854775807LL},
        {"train/skipped_steps", 32, 9223372036854775807LL},
        {"train/skipped_steps", 32, (1LL << 62) + 1},
    };
    static const struct {
        const char *name;
        long long at;
        float v;
    } floats[] = {
        {"train/learning_rate", 40, -0.001f}, {"train/learning_rate", 40, INFINITY},
        {"train/learning_rate", 40, NAN},     {"train/loss_scale", 44, INFINITY},
        {"train/loss_scale", 44, NAN},        {"train/loss_scale", 44, 0.0f},
        {"train/loss_scale", 44, -32768.0f},  {"train/loss_scale", 44, 1e-40f /* subnormal */},
    };
    mpt_model *src = make_f16_adam(31), *m;
    char c[256], p[256], label[128];
    size_t i;
    test__begin();
    if (src) {
        fill_model(src, 0.5f);
        fill_train_state(src);
    }
    CHECK(mpt_model_save_checkpoint(src, path_of(c, "bounds.safetensors")) == MPT_OK, "save: %s",
          mpt_context_error(ctx));
    CHECK(tensor_begin(c, "train/loss_scale") == 44 && tensor_begin(c, "train/epoch") == 16,
          "the scalars are where this test patches them");
    test__end("bounds: the reference checkpoint is saved");
    if (!src) return;
    for (i = 0; i < sizeof counters / sizeof *counters; i++) {
        patch_i64(c, path_of(p, "bad_counter.safetensors"), counters[i].at, counters[i].v);
        m = make_f16_adam(31);
        snprintf(label, sizeof label, "a checkpoint with %s = %lld", counters[i].name,
                 counters[i].v);
        expect_refused(m, p, 1, MPT_ERR_FORMAT, counters[i].name, "outside", label);
        mpt_model_destroy(m);
    }
    for (i = 0; i < sizeof floats / sizeof *floats; i++) {
        patch_f32(c, path_of(p, "bad_float.safetensors"), floats[i].at, floats[i].v);
        m = make_f16_adam(31);
        snprintf(label, sizeof label, "a checkpoint with %s = %g", floats[i].name,
                 (double)floats[i].v);
        expect_refused(m, p, 1, MPT_ERR_FORMAT, floats[i].name, NULL, label);
        mpt_model_destroy(m);
    }

    /* The largest values allowed load; training goes on from near them
       and saves a checkpoint that loads again. */
    test__begin();
    m = make_f16_adam(31);
    patch_i64(c, path_of(p, "at_limit.safetensors"), 0, 1LL << 62);
    patch_i64(p, p, 8, 1LL << 62);
    patch_i64(p, p, 16, 2147483647LL);
    patch_i64(p, p, 24, 1LL << 62);
    patch_i64(p, p, 32, 1LL << 62);
    patch_f32(p, p, 44, FLT_MAX);
    CHECK(m && mpt_model_load_checkpoint(m, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(m && m->optimizer_steps == 1LL << 62 && m->step == 1ull << 62 &&
              m->good_steps == 1LL << 62 && m->skipped_steps == 1LL << 62 &&
              m->epoch == 2147483647 && m->loss_scale == FLT_MAX,
          "the limits were loaded");
    patch_f32(p, p, 44, FLT_MIN);
    CHECK(m && mpt_model_load_checkpoint(m, p) == MPT_OK && m->loss_scale == FLT_MIN,
          "a loss scale of FLT_MIN loads: %s", mpt_context_error(ctx));
    patch_i64(c, path_of(p, "near_limit.safetensors"), 0, (1LL << 62) - 1000);
    patch_i64(p, p, 8, (1LL << 62) - 1000);
    patch_i64(p, p, 24, (1LL << 62) - 1000);
    CHECK(m && mpt_model_load_checkpoint(m, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (m) {
        float x[4 * 6 * 6 * 2];
        int32_t y[4];
        mpt_tensor tx, ty;
        mpt_dataset *data = NULL;
        int j, finite = 1;
        int64_t k;
        test_seed(33);
        for (j = 0; j < 4 * 6 * 6 * 2; j++) x[j] = (float)test_uniform(-1, 1);
        for (j = 0; j < 4; j++) y[j] = (int32_t)test_uniform(0, 5);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){4, 6, 6, 2}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){4}, y);
        mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data);
        CHECK(mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 1, .batch_size = 1}) == MPT_OK,
              "fit from the limits: %s", mpt_context_error(ctx));
        for (j = 0; j < m->n_params; j++)
            for (k = 0; k < m->params[j].count; k++) finite &= isfinite(m->params[j].value[k]) != 0;
        CHECK(finite, "every weight is still finite");
        CHECK(m->step == (1ull << 62) - 1000 + 4 && m->optimizer_steps > (1LL << 62) - 1000,
              "the counters went on: step %llu, optimizer steps %lld",
              (unsigned long long)m->step, (long long)m->optimizer_steps);
        CHECK(mpt_model_save_checkpoint(m, path_of(p, "after_limit.safetensors")) == MPT_OK,
              "save: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
        m = make_f16_adam(31);
        CHECK(m && mpt_model_load_checkpoint(m, p) == MPT_OK,
              "the model's own checkpoint loads again: %s", mpt_context_error(ctx));
        mpt_dataset_destroy(data);
    }
    mpt_model_destroy(m);
    test__end("bounds: counters at their limits load, train and save a loadable checkpoint");

    /* From the limits themselves a step takes the counters past 2^62: the
       checkpoint that would hold them is refused before any file is
       written, by the loader's own bound (it would refuse the file). */
    test__begin();
    m = make_f16_adam(31);
    CHECK(m && mpt_model_load_checkpoint(m, path_of(p, "at_limit.safetensors")) == MPT_OK,
          "load: %s", mpt_context_error(ctx));
    if (m) {
        float x[4 * 6 * 6 * 2];
        int32_t y[4];
        mpt_tensor tx, ty;
        mpt_dataset *data = NULL;
        mpt_status s;
        int j;
        for (j = 0; j < 4 * 6 * 6 * 2; j++) x[j] = (float)test_uniform(-1, 1);
        for (j = 0; j < 4; j++) y[j] = test_randint(0, 4);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){4, 6, 6, 2}, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){4}, y);
        mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data);
        CHECK(mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 1, .batch_size = 4}) == MPT_OK,
              "fit from the limits: %s", mpt_context_error(ctx));
        CHECK(m->step == (1ull << 62) + 1, "step %llu", (unsigned long long)m->step);
        s = mpt_model_save_checkpoint(m, path_of(p, "past_limit.safetensors"));
        CHECK(s == MPT_ERR_STATE, "a checkpoint past the counters' bound: status %d (%s)",
              (int)s, mpt_context_error(ctx));
        CHECK(strstr(mpt_context_error(ctx), "not written") &&
                  strstr(mpt_context_error(ctx), "outside 0..4611686018427387904"),
              "message: %s", mpt_context_error(ctx));
        CHECK(files_starting("past_limit") == 0, "a file was written");
        mpt_dataset_destroy(data);
    }
    mpt_model_destroy(m);
    test__end("bounds: a checkpoint past the counters' bound is refused, not written");
    mpt_model_destroy(src);
}

/* Non-finite weights or moments, and negative variances and second moments, are refused
   by both loaders, with the tensor's name; the last tensor of the file
   being the bad one shows that nothing read before it reached the model. */
static void test_bad_values(void) {
    static const struct {
        const char *tensor;
        float v;
        int full; /* 0: the weights file */
        mpt_status want;
        const char *says;
    } cases[] = {
        {"dense/kernel", NAN, 0, MPT_ERR_NUMERIC, "NaN"},
        {"conv2d/bias", INFINITY, 0, MPT_ERR_NUMERIC, "inf"},
        {"batch_normalization/moving_mean", -INFINITY, 0, MPT_ERR_NUMERIC, "-inf"},
        {"dense/bias", NAN, 1, MPT_ERR_NUMERIC, "NaN"},
        {"optimizer/conv2d/kernel/m", NAN, 1, MPT_ERR_NUMERIC, "NaN"},
        {"optimizer/dense/kernel/v", INFINITY, 1, MPT_ERR_NUMERIC, "inf"},
        {"batch_normalization/moving_variance", -0.25f, 0, MPT_ERR_FORMAT, "negative"},
        {"batch_normalization/moving_variance", -2.0f, 1, MPT_ERR_FORMAT, "negative"},
        {"optimizer/dense/bias/v", -0.5f, 1, MPT_ERR_FORMAT, "negative"}, /* last: see below */
    };
    mpt_model *src = make_f16_adam(41), *m, *sgd;
    char w[256], c[256], p[256], label[160];
    size_t i;
    test__begin();
    if (src) fill_model(src, 0.75f);
    CHECK(mpt_model_save_weights(src, path_of(w, "values_w.safetensors")) == MPT_OK &&
              mpt_model_save_checkpoint(src, path_of(c, "values_c.safetensors")) == MPT_OK,
          "save: %s", mpt_context_error(ctx));
    test__end("values: the reference files are saved");
    if (!src) return;
    for (i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *file = cases[i].full ? c : w;
        long long begin = tensor_begin(file, cases[i].tensor);
        test__begin();
        CHECK(begin >= 0, "%s is in the file", cases[i].tensor);
        test__end("values: %s is in the reference file", cases[i].tensor);
        patch_f32(file, path_of(p, "bad_value.safetensors"), begin + 4 * 3, cases[i].v);
        m = make_f16_adam(41);
        snprintf(label, sizeof label, "%s with %g in %s",
                 cases[i].full ? "a checkpoint" : "weights", (double)cases[i].v, cases[i].tensor);
        expect_refused(m, p, cases[i].full, cases[i].want, cases[i].tensor, cases[i].says, label);
        mpt_model_destroy(m);
    }
    /* load_weights of a checkpoint reads no optimizer state: a bad moment
       there is not its business. */
    test__begin();
    m = make_f16_adam(42);
    CHECK(m && mpt_model_load_weights(m, p) == MPT_OK && same_state(src, m, 0),
          "load_weights of a checkpoint with a negative v: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);
    test__end("values: load_weights ignores the optimizer state it does not load");

    /* SGD's momentum must be finite too. */
    test__begin();
    sgd = make_model((arch){MPT_POLICY_FLOAT32, 43, 0, 0, 0});
    CHECK(sgd && compile_with(sgd, MPT_OPTIMIZER_SGD, 0.9f) == MPT_OK, "compile");
    if (sgd) fill_model(sgd, 0.25f);
    CHECK(mpt_model_save_checkpoint(sgd, path_of(c, "values_sgd.safetensors")) == MPT_OK, "save");
    patch_f32(c, path_of(p, "bad_momentum.safetensors"),
              tensor_begin(c, "optimizer/dense/kernel/momentum") + 4, NAN);
    test__end("values: the SGD checkpoint is saved");
    expect_refused(sgd, p, 1, MPT_ERR_NUMERIC, "optimizer/dense/kernel/momentum", "NaN",
                   "a checkpoint with a NaN momentum");
    mpt_model_destroy(sgd);
    mpt_model_destroy(src);
}

/* ---- policies ---------------------------------------------------------------------- */

static mpt_status compile_fixed(mpt_model *m, float scale) {
    mpt_compile_desc c;
    memset(&c, 0, sizeof c);
    c.optimizer.type = MPT_OPTIMIZER_ADAM;
    c.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    c.loss.from_logits = 1;
    c.loss_scale.mode = MPT_LOSS_SCALE_FIXED;
    c.loss_scale.initial_scale = scale;
    return mpt_model_compile(m, &c);
}

/* A full checkpoint carries its policy's training state (a float16 run's
   loss scale): another policy's model refuses it, and load_weights moves
   the weights across policies. */
static void test_policies_across(void) {
    static const mpt_policy others[] = {MPT_POLICY_MIXED_BFLOAT16, MPT_POLICY_FLOAT32};
    static const char *const names[] = {"mixed_bfloat16", "float32"};
    mpt_model *src = make_f16_adam(51), *m;
    char c[256], w[256], p[256], label[128];
    int k;
    test__begin();
    if (src) {
        fill_model(src, -0.5f);
        fill_train_state(src); /* a loss scale of 4096 */
    }
    CHECK(mpt_model_save_checkpoint(src, path_of(c, "policy_c.safetensors")) == MPT_OK &&
              mpt_model_save_weights(src, path_of(w, "policy_w.safetensors")) == MPT_OK,
          "save: %s", mpt_context_error(ctx));
    test__end("policies: the mixed_float16 files are saved");
    if (!src) return;
    for (k = 0; k < 2; k++) {
        arch a = {others[k], 52, 0, 0, 0};
        m = make_model(a);
        if (m) compile_with(m, MPT_OPTIMIZER_ADAM, 0);
        snprintf(label, sizeof label, "a mixed_float16 checkpoint into a %s model", names[k]);
        expect_refused(m, c, 1, MPT_ERR_DTYPE, "mixed_float16", names[k], label);
        CHECK(strstr(mpt_context_error(ctx), "mpt_model_load_weights") != NULL,
              "the message points to load_weights: %s", mpt_context_error(ctx));

        test__begin();
        CHECK(m && mpt_model_load_weights(m, c) == MPT_OK && same_state(src, m, 0) &&
                  copies_fresh(m),
              "load_weights of the checkpoint: %s", mpt_context_error(ctx));
        fill_model(m, 3.0f);
        CHECK(m && mpt_model_load_weights(m, w) == MPT_OK && same_state(src, m, 0) &&
                  copies_fresh(m),
              "load_weights of the weights: %s", mpt_context_error(ctx));
        CHECK(m && m->loss_scale == 1.0f && m->optimizer_steps == 0,
              "the training state stays the model's own");
        test__end("policies: load_weights takes mixed_float16 weights into %s", names[k]);

        /* A checkpoint without metadata (not written by mpt.h, or stripped)
           is not known to be another policy's; its loss scale still is not
           one this model can have. */
        strip_metadata(c, path_of(p, "policy_no_meta.safetensors"));
        snprintf(label, sizeof label, "a mixed_float16 checkpoint without metadata into %s",
                 names[k]);
        expect_refused(m, p, 1, MPT_ERR_FORMAT, "train/loss_scale", "does not scale", label);
        mpt_model_destroy(m);
    }

    test__begin();
    m = make_f16_adam(53);
    CHECK(m && mpt_model_load_checkpoint(m, p) == MPT_OK,
          "the stripped checkpoint loads into a mixed_float16 model: %s", mpt_context_error(ctx));
    CHECK(m && same_state(src, m, 1) && m->loss_scale == 4096.0f, "state restored");
    mpt_model_destroy(m);
    test__end("policies: a checkpoint without metadata loads into a model it fits");

    /* A fixed loss scale is compile's; a bfloat16 model's is 1. */
    m = make_model((arch){MPT_POLICY_MIXED_FLOAT16, 54, 0, 0, 0});
    if (m) compile_fixed(m, 1024.0f);
    expect_refused(m, c, 1, MPT_ERR_FORMAT, "train/loss_scale", "fixed at 1024",
                   "a dynamic checkpoint's scale into a model with a fixed one");
    test__begin();
    CHECK(m && mpt_model_save_checkpoint(m, path_of(p, "fixed.safetensors")) == MPT_OK, "save");
    mpt_model_destroy(m);
    m = make_model((arch){MPT_POLICY_MIXED_FLOAT16, 54, 0, 0, 0});
    CHECK(m && compile_fixed(m, 1024.0f) == MPT_OK && mpt_model_load_checkpoint(m, p) == MPT_OK &&
              m->loss_scale == 1024.0f,
          "a fixed-scale checkpoint loads into its own kind of model: %s", mpt_context_error(ctx));
    mpt_model_destroy(m);
    m = make_model((arch){MPT_POLICY_MIXED_BFLOAT16, 55, 0, 0, 0});
    CHECK(m && compile_with(m, MPT_OPTIMIZER_ADAM, 0) == MPT_OK, "compile");
    if (m) fill_model(m, 1.5f);
    CHECK(m && mpt_model_save_checkpoint(m, path_of(p, "bf16.safetensors")) == MPT_OK, "save");
    mpt_model_destroy(m);
    m = make_model((arch){MPT_POLICY_MIXED_BFLOAT16, 55, 0, 0, 0});
    CHECK(m && compile_with(m, MPT_OPTIMIZER_ADAM, 0) == MPT_OK &&
              mpt_model_load_checkpoint(m, p) == MPT_OK && m->loss_scale == 1.0f,
          "a mixed_bfloat16 checkpoint loads into a mixed_bfloat16 model: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
    test__end("policies: fixed-scale and unscaled checkpoints load into their own kind");
    mpt_model_destroy(src);
}

/* ---- malformed files ---------------------------------------------------------------- */

#define K_OK "\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]}"
#define B_OK "\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[24,32]}"

typedef struct bad_json {
    const char *label, *json;
    size_t data_len;
    const char *needle; /* in the message, besides the path */
} bad_json;

static void test_malformed(void) {
    static const bad_json cases[] = {
        {"no closing brace", "{" K_OK "," B_OK, 32, "byte"},
        {"a trailing comma", "{" K_OK "," B_OK ",}", 32, "byte"},
        {"a missing colon", "{\"dense/kernel\" {\"dtype\":\"F32\"}}", 32, "':'"},
        {"an unterminated string", "{\"dense/kernel", 32, "unterminated"},
        {"a bad escape", "{\"dense\\q/kernel\":{}}", 32, "escape"},
        {"a lone surrogate", "{\"dense\\ud800/kernel\":{}}", 32, "surrogate"},
        {"a raw control character", "{\"dense\n/kernel\":{}}", 32, "control"},
        {"invalid UTF-8", "{\"dense\xff/kernel\":{}}", 32, "UTF-8"},
        {"an overlong UTF-8 form", "{\"dense\xc0\xaf/kernel\":{}}", 32, "UTF-8"},
        {"a leading zero", "{" K_OK ",\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                           "\"data_offsets\":[024,32]}}", 32, "leading zero"},
        {"a negative offset", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],"
                              "\"data_offsets\":[-1,24]}}", 32, "negative"},
        {"a fractional offset", "{" K_OK ",\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                                "\"data_offsets\":[24,32.0]}}", 32, "integer"},
        {"a huge number", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],"
                          "\"data_offsets\":[0,99999999999999999999]}}", 32, "too large"},
        {"garbage after the object", "{" K_OK "," B_OK "}x", 32, "after"},
        {"a dtype that is a number", "{\"dense/kernel\":{\"dtype\":5}}", 32, "string"},
        {"a metadata value that is a number", "{\"__metadata__\":{\"a\":1}," K_OK "," B_OK "}", 32,
         "not a string"},
        {"two metadata objects", "{\"__metadata__\":{},\"__metadata__\":{}," K_OK "," B_OK "}", 32,
         "twice"},
        {"an array at the top", "[1,2]", 32, "'{'"},
        {"an empty header", "", 32, "'{'"},
        {"an unknown key", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],"
                           "\"data_offsets\":[0,24],\"strides\":[2,1]}," B_OK "}", 32, "strides"},
        {"a repeated key", "{\"dense/kernel\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", 32, "twice"},
        {"no data_offsets", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2]}," B_OK "}", 32,
         "data_offsets"},
        {"three data_offsets", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],"
                               "\"data_offsets\":[0,12,24]}}", 32, "more than 2"},
        {"a shape that does not fill its bytes",
         "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,3],\"data_offsets\":[0,24]}," B_OK "}",
         32, "(3, 3)"},
        {"offsets that end before they begin", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[0],"
                                               "\"data_offsets\":[24,0]}}", 32, "end before"},
        {"an unknown dtype", "{\"dense/kernel\":{\"dtype\":\"F33\",\"shape\":[3,2],"
                             "\"data_offsets\":[0,24]}," B_OK "}", 32, "F33"},
        {"duplicate names", "{" K_OK "," B_OK ",\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                            "\"data_offsets\":[32,40]}}", 40, "duplicate"},
        {"a gap between tensors", "{" K_OK ",\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                                  "\"data_offsets\":[28,36]}}", 36, "gap"},
        {"overlapping tensors", "{" K_OK ",\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                                "\"data_offsets\":[20,28]}}", 28, "overlap"},
        {"data that does not start at 0", "{\"dense/kernel\":{\"dtype\":\"F32\",\"shape\":[3,2],"
                                          "\"data_offsets\":[8,32]}," B_OK "}", 32, "gap"},
        {"a byte too many at the end", "{" K_OK "," B_OK "}", 33, "but its size is"},
        {"truncated data", "{" K_OK "," B_OK "}", 28, "truncated"},
        {"a tensor of almost 2^63 bytes", "{\"dense/kernel\":{\"dtype\":\"U8\","
                                          "\"shape\":[9223372036854775807],\"data_offsets\":"
                                          "[0,9223372036854775807]}}", 32, "truncated"},
    };
    unsigned char data[64], raw[64];
    char p[256];
    mpt_model *m;
    size_t i;
    test__begin();
    m = make_tiny();
    test__end("malformed: the tiny model builds");
    if (!m) return;
    memset(data, 0x3f, sizeof data);

    /* A valid file that uses what JSON allows: whitespace, escapes,
       another key order, metadata last, no padding needed by the reader. */
    test__begin();
    {
        float vals[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        int k;
        write_st(path_of(p, "fancy.safetensors"),
                 " {\r\n \"\\u0064ense\\/kernel\" : { \"shape\" : [ 3 , 2 ] , \"data_offsets\":"
                 "[0, 24], \"dtype\" : \"F32\" },\t\"dense/bias\":{\"dtype\":\"F32\",\"shape\":[2],"
                 "\"data_offsets\":[24,32]}, \"__metadata__\":{\"note\":"
                 "\"caf\\u00e9 \\ud83d\\ude00 "
                 "\xc3\xa9\\n\\\"q\\\"\"} } ",
                 vals, sizeof vals);
        CHECK(mpt_model_load_weights(m, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
        for (k = 0; k < 6; k++) CHECK(m->params[0].value[k] == vals[k], "kernel[%d]", k);
        CHECK(m->params[1].value[0] == 7 && m->params[1].value[1] == 8, "bias");
    }
    test__end("a valid header with whitespace, escapes and metadata last loads");

    for (i = 0; i < sizeof cases / sizeof *cases; i++) {
        snapshot before;
        mpt_status s;
        test__begin();
        write_st(path_of(p, "bad.safetensors"), cases[i].json, data, cases[i].data_len);
        fill_model(m, 2.0f);
        before = snap_take(m);
        s = mpt_model_load_weights(m, p);
        CHECK(s == MPT_ERR_FORMAT, "status %s, want malformed file (%s)", mpt_status_string(s),
              mpt_context_error(ctx));
        CHECK(strstr(mpt_context_error(ctx), p) != NULL, "message names the file: %s",
              mpt_context_error(ctx));
        CHECK(strstr(mpt_context_error(ctx), cases[i].needle) != NULL, "message '%s' says '%s'",
              mpt_context_error(ctx), cases[i].needle);
        CHECK(snap_same(m, before), "the model is unchanged");
        free(before.bytes);
        test__end("malformed: %s", cases[i].label);
    }

    /* Where the reader stopped: the 'x' after the object. */
    test__begin();
    {
        const char *json = "{" K_OK "," B_OK "}";
        char want[64];
        write_st(path_of(p, "bad.safetensors"),
                 "{" K_OK "," B_OK "}x", data, 32);
        snprintf(want, sizeof want, "at byte %d:", 8 + (int)strlen(json));
        CHECK(mpt_model_load_weights(m, p) == MPT_ERR_FORMAT &&
                  strstr(mpt_context_error(ctx), want),
              "message '%s' has '%s'", mpt_context_error(ctx), want);
    }
    test__end("malformed: the message gives the byte offset in the file");

    /* The length field itself. */
    {
        static const struct {
            const char *label;
            unsigned long long n;
            size_t file_len;
            const char *needle;
        } heads[] = {{"an empty file", 0, 0, "too short"},
                     {"a file shorter than 8 bytes", 0, 5, "too short"},
                     {"a header length past the end of the file", 1000, 40, "past the end"},
                     {"a header over 100 MB", 100000001ull, 40, "limit"},
                     {"a header length near 2^64", ~0ull, 40, "limit"}};
        for (i = 0; i < sizeof heads / sizeof *heads; i++) {
            snapshot before;
            int k;
            test__begin();
            memset(raw, '{', sizeof raw);
            for (k = 0; k < 8; k++) raw[k] = (unsigned char)(heads[i].n >> (8 * k));
            spit(path_of(p, "bad.safetensors"), raw, heads[i].file_len);
            before = snap_take(m);
            CHECK(mpt_model_load_weights(m, p) == MPT_ERR_FORMAT, "status (%s)",
                  mpt_context_error(ctx));
            CHECK(strstr(mpt_context_error(ctx), heads[i].needle) &&
                      strstr(mpt_context_error(ctx), p),
                  "message '%s' says '%s'", mpt_context_error(ctx), heads[i].needle);
            CHECK(snap_same(m, before), "the model is unchanged");
            free(before.bytes);
            test__end("malformed: %s", heads[i].label);
        }
    }
    mpt_model_destroy(m);
}

/* ---- crash safety and I/O errors ------------------------------------------------ */

static void test_crash_safety(void) {
    arch a = {MPT_POLICY_MIXED_FLOAT16, 9, 0, 0, 0};
    mpt_model *m = make_model(a), *check;
    char p[256], q[256];
    unsigned char *v1, *now;
    long n1, n;
    long long cuts[8];
    char *json;
    size_t k;
    test__begin();
    CHECK(m && compile_with(m, MPT_OPTIMIZER_ADAM, 0) == MPT_OK, "compile");
    if (m) fill_model(m, 0.0f);
    CHECK(mpt_model_save_weights(m, path_of(p, "safe.safetensors")) == MPT_OK, "save v1");
    v1 = test_read_file(p, &n1);
    json = header_of(p);
    CHECK(v1 && json, "read v1");
    test__end("crash safety: the first version is saved");
    if (!m || !v1) {
        free(json);
        free(v1);
        mpt_model_destroy(m);
        return;
    }
    /* In the length, the header, the padding's end, the data, the last byte. */
    cuts[0] = 0, cuts[1] = 3, cuts[2] = 8, cuts[3] = 40;
    cuts[4] = 8 + (json ? (long long)strlen(json) : 0) - 1;
    cuts[5] = cuts[4] + 1 + 100, cuts[6] = n1 - 1, cuts[7] = n1 / 2;
    free(json);
    fill_model(m, 5.0f);
    for (k = 0; k < 8; k++) {
        test__begin();
        fail_after = cuts[k];
        CHECK(mpt_model_save_weights(m, p) == MPT_ERR_IO, "the write fails (%s)",
              mpt_context_error(ctx));
        CHECK(strstr(mpt_context_error(ctx), p) && strstr(mpt_context_error(ctx), "No space"),
              "message names the file and the cause: %s", mpt_context_error(ctx));
        fail_after = -1;
        now = test_read_file(p, &n);
        CHECK(now && n == n1 && memcmp(now, v1, (size_t)n) == 0, "the old file is intact");
        CHECK(files_starting("safe.safetensors.tmp") == 0, "no temporary file is left");
        free(now);
        test__end("crash safety: a write failing after %lld of %ld bytes", cuts[k], n1);
    }

    test__begin();
    fail_after = 100;
    CHECK(mpt_model_save_checkpoint(m, path_of(q, "new.safetensors")) == MPT_ERR_IO,
          "the write fails");
    fail_after = -1;
    CHECK(access(q, F_OK) != 0, "no file appears at the target");
    CHECK(files_starting("new.safetensors") == 0, "no temporary file is left");
    test__end("crash safety: a failed first save leaves nothing behind");

    test__begin();
    CHECK(mpt_model_save_weights(m, p) == MPT_OK, "save v2: %s", mpt_context_error(ctx));
    check = make_model(a);
    CHECK(check && mpt_model_load_weights(check, p) == MPT_OK && same_state(m, check, 0),
          "the new file replaced the old one");
    CHECK(files_starting("safe.safetensors") == 1, "one file, no temporary one");
    mpt_model_destroy(check);
    test__end("crash safety: the next save replaces the file");

    test__begin();
    {
        char missing[300];
        snprintf(missing, sizeof missing, "%s/no/such/dir/w.safetensors", dir);
        CHECK(mpt_model_save_weights(m, missing) == MPT_ERR_IO, "save into a missing directory");
        CHECK(strstr(mpt_context_error(ctx), missing) &&
                  strstr(mpt_context_error(ctx), "No such file"),
              "message names the path and the cause: %s", mpt_context_error(ctx));
        CHECK(mpt_model_load_weights(m, missing) == MPT_ERR_IO &&
                  strstr(mpt_context_error(ctx), missing),
              "loading a missing file: %s", mpt_context_error(ctx));
        CHECK(mpt_model_load_weights(m, dir) == MPT_ERR_IO &&
                  strstr(mpt_context_error(ctx), "not a regular file"),
              "loading a directory: %s", mpt_context_error(ctx));
    }
    test__end("I/O errors name the path: a missing directory, a missing file, a directory");
    free(v1);
    mpt_model_destroy(m);
}

/* ---- temporary files of saves that were killed ------------------------------------------ */

/* A process that writes "<target>.tmp-<its pid>" and holds a write lock on
   it, as a save in progress does, until it is killed; -1 if it could not
   be started. */
static pid_t start_writer(const char *target) {
    int ready[2];
    char c = 0;
    pid_t pid;
    if (pipe(ready) != 0) return -1;
    pid = fork();
    if (pid == 0) {
        char name[320];
        struct flock l;
        int fd;
        snprintf(name, sizeof name, "%s.tmp-%ld", target, (long)getpid());
        fd = open(name, O_WRONLY | O_CREAT | O_EXCL, 0600);
        memset(&l, 0, sizeof l);
        l.l_type = F_WRLCK;
        l.l_whence = SEEK_SET;
        c = fd >= 0 && write(fd, "partial", 7) == 7 && fcntl(fd, F_SETLK, &l) == 0 ? 'y' : 'n';
        if (write(ready[1], &c, 1) != 1) _exit(1);
        for (;;) pause();
    }
    close(ready[1]);
    if (pid > 0 && (read(ready[0], &c, 1) != 1 || c != 'y')) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        pid = -1;
    }
    close(ready[0]);
    return pid;
}

/* A save in another process while this one's save is writing: set, the
   next write of a save here forks a process that saves `probe_model` to
   the same target; probe_result is 1 if that save worked and left this
   one's temporary file alone. */
static mpt_model *probe_model;
static const char *probe_target;
static int probe_result = -1;
static int die_during_save; /* set: the next write of a save kills the process */

static long long during_save(void) {
    if (die_during_save) raise(SIGKILL);
    if (probe_model) {
        mpt_model *m = probe_model;
        char mine[320];
        pid_t pid;
        int status = 0;
        probe_model = NULL;
        snprintf(mine, sizeof mine, "%s.tmp-%ld", probe_target, (long)getpid());
        pid = fork();
        if (pid == 0)
            _exit(exists(mine) && mpt_model_save_weights(m, probe_target) == MPT_OK &&
                          exists(mine)
                      ? 0
                      : 1);
        probe_result = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                       WEXITSTATUS(status) == 0;
    }
    return fail_after;
}

/* The pid of a process that has ended. */
static pid_t dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid(pid, NULL, 0);
    return pid;
}

/* A save removes the temporary files of its target that saves killed
   mid-write left (nobody holds their lock), and nothing else: not a save
   in progress in another process (it holds the lock), not this process's
   own, not other targets' or names that only look alike. */
static void test_stale_temporaries(void) {
    mpt_model *m = make_tiny(), *check = make_tiny();
    char target[256], stale[320], stale_k[320], live[320], mine[320], other[320], alike[320];
    char alike2[320];
    unsigned char junk[4096];
    pid_t dead = dead_pid(), holder;
    size_t i;
    CHECK(m && check && dead > 0, "setup");
    if (!m || !check || dead <= 0) {
        mpt_model_destroy(m);
        mpt_model_destroy(check);
        return;
    }
    test_seed(61);
    for (i = 0; i < sizeof junk; i++) junk[i] = (unsigned char)test_uniform(0, 256);
    path_of(target, "swept.safetensors");
    snprintf(stale, sizeof stale, "%s.tmp-%ld", target, (long)dead);
    snprintf(stale_k, sizeof stale_k, "%s.tmp-%ld-3", target, (long)dead);
    snprintf(mine, sizeof mine, "%s.tmp-%ld-7", target, (long)getpid());
    snprintf(other, sizeof other, "%s/other.safetensors.tmp-%ld", dir, (long)dead);
    snprintf(alike, sizeof alike, "%s.tmp-%ldx", target, (long)dead);
    snprintf(alike2, sizeof alike2, "%s.tmpx-%ld", target, (long)dead);
    spit(stale, junk, sizeof junk);
    spit(stale_k, junk, 100);
    spit(mine, junk, 10);
    spit(other, junk, 10);
    spit(alike, junk, 10);
    spit(alike2, junk, 10);
    /* The live one: a file another process is writing, its pid alive. */
    holder = start_writer(target);
    CHECK(holder > 0, "a process writes a temporary file of %s", target);
    snprintf(live, sizeof live, "%s.tmp-%ld", target, (long)holder);
    fill_model(m, 0.5f);
    CHECK(mpt_model_save_weights(m, target) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(!exists(stale), "the stale temporary file of a dead process is gone");
    CHECK(!exists(stale_k), "the stale \"-<k>\" temporary file is gone");
    CHECK(exists(live), "the temporary file a live process holds is kept");
    CHECK(exists(mine), "this process's own temporary file is kept");
    CHECK(exists(other) && exists(alike) && exists(alike2),
          "another target's file and files that only look alike are kept");
    CHECK(mpt_model_load_weights(check, target) == MPT_OK && same_state(m, check, 0),
          "the save itself worked: %s", mpt_context_error(ctx));
    if (holder > 0) {
        kill(holder, SIGKILL);
        waitpid(holder, NULL, 0);
    }
    /* Killed, the holder's lock is gone: the next save sweeps its file. */
    CHECK(mpt_model_save_weights(m, target) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(!exists(live), "the file of the killed writer is gone after the next save");
    CHECK(exists(mine), "this process's own temporary file is still kept");
    /* A save killed mid-write, for real: its file stays until the next save. */
    {
        pid_t killed = fork();
        int status = 0;
        char left[320];
        if (killed == 0) {
            die_during_save = 1;
            mpt_model_save_weights(m, target);
            _exit(3);
        }
        CHECK(killed > 0 && waitpid(killed, &status, 0) == killed && WIFSIGNALED(status) &&
                  WTERMSIG(status) == SIGKILL,
              "a save was killed mid-write");
        snprintf(left, sizeof left, "%s.tmp-%ld", target, (long)killed);
        CHECK(exists(left), "the killed save left %s", left);
        CHECK(mpt_model_save_weights(m, target) == MPT_OK, "save: %s", mpt_context_error(ctx));
        CHECK(!exists(left), "the next save removed what the killed one left");
    }
    /* Two processes saving to one target: neither sweeps the other's. */
    probe_model = check;
    probe_target = target;
    CHECK(mpt_model_save_weights(m, target) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(probe_result == 1, "a save in another process kept this one's temporary file");
    CHECK(mpt_model_load_weights(check, target) == MPT_OK && same_state(m, check, 0),
          "the last save to finish is the file: %s", mpt_context_error(ctx));
    remove(mine);
    remove(other);
    remove(alike);
    remove(alike2);
    mpt_model_destroy(m);
    mpt_model_destroy(check);
}

/* ---- running out of memory ------------------------------------------------------------ */

static int allocs_left = -1; /* >= 0: allocations that succeed before one fails */

static void *failing_alloc(void *user, size_t bytes, size_t alignment) {
    (void)user;
    if (allocs_left == 0) return NULL;
    if (allocs_left > 0) allocs_left--;
    return mpt__default_alloc(NULL, bytes, alignment);
}

static void failing_free(void *user, void *p) {
    (void)user;
    mpt__default_free(NULL, p);
}

/* Every allocation of a save and of a load fails in turn: each call either
   works or says out of memory, leaks nothing (ASan), leaves no temporary
   file, and leaves the model as it was. */
static void test_out_of_memory(void) {
    mpt_context_desc d;
    mpt_context *c = NULL;
    mpt_model *m = NULL;
    char p[256], q[256];
    int k, saves_ok = 0, loads_ok = 0;
    memset(&d, 0, sizeof d);
    d.num_threads = 1;
    d.logger.fn = test_logger;
    d.allocator.alloc = failing_alloc;
    d.allocator.free = failing_free;
    CHECK(mpt_context_create(&d, &c) == MPT_OK, "context");
    if (!c) return;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    if (m) mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(m && mpt_model_build(m, 2) == MPT_OK && compile_with(m, MPT_OPTIMIZER_ADAM, 0) == MPT_OK,
          "model");
    if (m) {
        fill_model(m, 1.0f);
        CHECK(mpt_model_save_checkpoint(m, path_of(q, "oom_src.safetensors")) == MPT_OK, "save");
    }
    for (k = 0; m && k < 40; k++) {
        snapshot before = snap_take(m);
        mpt_status s;
        allocs_left = k;
        s = mpt_model_save_checkpoint(m, path_of(p, "oom.safetensors"));
        allocs_left = -1;
        CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "save with allocation %d failing: %s", k,
              mpt_status_string(s));
        CHECK(files_starting("oom.safetensors.tmp") == 0, "no temporary file (allocation %d)", k);
        saves_ok += s == MPT_OK;
        allocs_left = k;
        s = mpt_model_load_checkpoint(m, q);
        allocs_left = -1;
        CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "load with allocation %d failing: %s", k,
              mpt_status_string(s));
        CHECK(s == MPT_OK || snap_same(m, before), "a failed load changes nothing (allocation %d)",
              k);
        loads_ok += s == MPT_OK;
        free(before.bytes);
    }
    CHECK(saves_ok > 0 && saves_ok < 40 && loads_ok > 0 && loads_ok < 40,
          "some calls failed and some got through (%d saves, %d loads)", saves_ok, loads_ok);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
}

/* ---- resuming fit from a checkpoint --------------------------------------------------- */

/* Two epochs in one go, and one epoch + save + load into a fresh model + one
   more epoch, must end bit-identical (dropout, shuffling, Adam's t and the
   loss scale all carried by the checkpoint). */
static mpt_model *make_fit_model(void) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 21}, &m);
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    compile_with(m, MPT_OPTIMIZER_ADAM, 0);
    return m;
}

static void test_resume_fit(void) {
    float x[40 * 6];
    int32_t y[40];
    mpt_tensor tx, ty;
    mpt_dataset *data = NULL;
    mpt_model *once = make_fit_model(), *first = make_fit_model(), *second = make_fit_model();
    char p[256];
    int i;
    test_seed(5);
    for (i = 0; i < 40 * 6; i++) x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < 40; i++) y[i] = (x[6 * i] > 0) + (x[6 * i + 1] > 0);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){40, 6}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){40}, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    if (data && once && first && second) {
        CHECK(mpt_model_fit(once, data, &(mpt_fit_desc){.epochs = 2, .batch_size = 8}) == MPT_OK,
              "fit 2 epochs: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(first, data, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK,
              "fit 1 epoch: %s", mpt_context_error(ctx));
        CHECK(mpt_model_save_checkpoint(first, path_of(p, "resume.safetensors")) == MPT_OK,
              "save: %s", mpt_context_error(ctx));
        CHECK(mpt_model_build(second, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        CHECK(mpt_model_load_checkpoint(second, p) == MPT_OK, "load: %s", mpt_context_error(ctx));
        CHECK(mpt_model_epoch(second) == 1, "epoch %d after loading", mpt_model_epoch(second));
        CHECK(mpt_model_fit(second, data, &(mpt_fit_desc){.epochs = 2, .initial_epoch = 1,
                                                          .batch_size = 8}) == MPT_OK,
              "fit the second epoch: %s", mpt_context_error(ctx));
        CHECK(once->step == second->step && once->optimizer_steps == second->optimizer_steps &&
                  once->epoch == second->epoch,
              "counters: step %llu vs %llu, optimizer steps %lld vs %lld",
              (unsigned long long)once->step, (unsigned long long)second->step,
              (long long)once->optimizer_steps, (long long)second->optimizer_steps);
        CHECK(same_state(once, second, 1), "weights and moments bit-identical to an unbroken run");
    }
    mpt_dataset_destroy(data);
    mpt_model_destroy(once);
    mpt_model_destroy(first);
    mpt_model_destroy(second);
}

/* ---- quantization-aware training's ranges ------------------------------------------ */

/* Dense -> BatchNormalization -> ReLU -> Dropout -> Dense, mixed_float16 with
   Adam: every kind of state, and the learned ranges of the input, the folded
   product's ReLU and the logits. */
static mpt_model *make_qat_model(int aware) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 23}, &m);
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    compile_with(m, MPT_OPTIMIZER_ADAM, 0);
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    if (aware)
        CHECK(mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.8f}) == MPT_OK,
              "quantize_aware: %s", mpt_context_error(ctx));
    return m;
}

static float qat_x[48 * 6];
static int32_t qat_y[48];

static mpt_dataset *qat_data(void) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    int i;
    test_seed(17);
    for (i = 0; i < 48 * 6; i++) qat_x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < 48; i++) qat_y[i] = (qat_x[6 * i] > 0) + (qat_x[6 * i + 1] > 0.5f);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){48, 6}, qat_x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){48}, qat_y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* Every learned range as qat_range reports it: (status, min, max) for the
   input and each layer, so that "not set" is compared too. */
typedef struct qat_ranges {
    int status[8];
    float min[8], max[8];
} qat_ranges;

static qat_ranges qat_ranges_of(const mpt_model *m) {
    qat_ranges r;
    int i;
    memset(&r, 0, sizeof r);
    for (i = -1; i < mpt_model_layer_count(m) && i < 7; i++)
        r.status[i + 1] = (int)mpt_model_qat_range(m, i, &r.min[i + 1], &r.max[i + 1]);
    return r;
}

static int qat_ranges_same(qat_ranges a, qat_ranges b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Two full-integer models, operation by operation, bit for bit. */
static int same_int8_models(const mpt_model *a, const mpt_model *b) {
    mpt_quantized_info ia, ib;
    int i, same;
    mpt_model_quantized_info(a, &ia);
    mpt_model_quantized_info(b, &ib);
    same = ia.n_layers == ib.n_layers && memcmp(&ia.input, &ib.input, sizeof ia.input) == 0 &&
           memcmp(&ia.output, &ib.output, sizeof ia.output) == 0;
    for (i = 0; same && i < ia.n_layers; i++) {
        mpt_quantized_layer la, lb;
        int64_t n;
        mpt_model_quantized_layer(a, i, &la);
        mpt_model_quantized_layer(b, i, &lb);
        n = la.out_channels;
        same = la.op == lb.op && n == lb.out_channels && la.depth == lb.depth &&
               memcmp(&la.input, &lb.input, sizeof la.input) == 0 &&
               memcmp(&la.output, &lb.output, sizeof la.output) == 0;
        if (same && la.weights)
            same = memcmp(la.weights, lb.weights, (size_t)(n * la.depth)) == 0 &&
                   memcmp(la.weight_scales, lb.weight_scales, 4 * (size_t)n) == 0 &&
                   memcmp(la.bias_int32, lb.bias_int32, 4 * (size_t)n) == 0 &&
                   memcmp(la.multiplier, lb.multiplier, 4 * (size_t)n) == 0 &&
                   memcmp(la.shift, lb.shift, 4 * (size_t)n) == 0;
    }
    return same;
}

static mpt_model *to_int8(mpt_model *m) {
    mpt_model *q = NULL;
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q) ==
              MPT_OK, "convert: %s", mpt_context_error(ctx));
    return q;
}

/* Two models' predictions on d, bit for bit. */
static int same_predictions(mpt_model *a, mpt_model *b, const mpt_dataset *d) {
    mpt_tensor ya, yb;
    int same;
    if (!a || !b || mpt_model_predict(a, d, 16, &ya) != MPT_OK) return 0;
    if (mpt_model_predict(b, d, 16, &yb) != MPT_OK) {
        mpt_tensor_free(ctx, &ya);
        return 0;
    }
    same = mpt_tensor_bytes(&ya) == mpt_tensor_bytes(&yb) &&
           memcmp(ya.data, yb.data, mpt_tensor_bytes(&ya)) == 0;
    mpt_tensor_free(ctx, &ya);
    mpt_tensor_free(ctx, &yb);
    return same;
}

/* Two epochs of quantization-aware training in one fit, ModelCheckpoint
   saving the full state and the weights after the first; a fresh
   quantization-aware model loading the checkpoint and fitting the second
   epoch ends bit-identical to the unbroken run (weights, moments, ranges),
   and so do their int8 models and those models' predictions. The weights
   file carries the ranges too: a model given it converts to the same int8
   model as the checkpoint's. */
static void test_qat_resume(void) {
    mpt_dataset *d = qat_data();
    mpt_model *first = make_qat_model(1), *second = make_qat_model(1), *third = make_qat_model(1);
    mpt_model *q1 = NULL, *q2 = NULL, *q_loaded = NULL, *q3 = NULL;
    mpt_callback cb[2];
    char c[256], w[256], c_pattern[256], w_pattern[256], *json;
    memset(cb, 0, sizeof cb);
    path_of(c_pattern, "qat-{epoch}.safetensors");
    path_of(w_pattern, "qat-weights-{epoch}.safetensors");
    CHECK(mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){.filepath = c_pattern},
                                        &cb[0]) == MPT_OK &&
              mpt_callback_model_checkpoint(ctx, &(mpt_model_checkpoint_desc){
                                                     .filepath = w_pattern,
                                                     .save_weights_only = 1}, &cb[1]) == MPT_OK,
          "callbacks: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(first, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 8,
                                                  .callbacks = cb, .n_callbacks = 2}) == MPT_OK,
          "fit 2 epochs: %s", mpt_context_error(ctx));
    mpt_callback_destroy(&cb[0]);
    mpt_callback_destroy(&cb[1]);
    path_of(c, "qat-1.safetensors");
    path_of(w, "qat-weights-1.safetensors");
    json = header_of(c);
    CHECK(json && strstr(json, "\"qat/input/min\":{\"dtype\":\"F32\",\"shape\":[]") &&
              strstr(json, "\"qat/input/initialized\":{\"dtype\":\"I64\",\"shape\":[]") &&
              strstr(json, "\"qat/activation/output/max\"") &&
              strstr(json, "\"qat/dense_1/output/min\"") && !strstr(json, "qat/dense/") &&
              strstr(json, "\"qat_ema_decay\":\"0.800000012\""),
          "the checkpoint names the ranges: %s", json ? json : "(none)");
    free(json);
    json = header_of(w);
    CHECK(json && strstr(json, "\"qat/dense_1/output/initialized\"") && !strstr(json, "train/"),
          "the weights file holds the ranges: %s", json ? json : "(none)");
    free(json);
    CHECK(mpt_model_load_checkpoint(second, c) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(qat_ranges_of(second).status[0] == MPT_OK && qat_ranges_of(second).status[3] == MPT_OK &&
              qat_ranges_of(second).status[5] == MPT_OK,
          "the input's, the ReLU's and the logits' ranges are set");
    q_loaded = to_int8(second);
    CHECK(mpt_model_load_weights(third, w) == MPT_OK, "load weights: %s", mpt_context_error(ctx));
    CHECK(qat_ranges_same(qat_ranges_of(second), qat_ranges_of(third)),
          "the weights file holds the checkpoint's ranges");
    q3 = to_int8(third);
    CHECK(q_loaded && q3 && same_int8_models(q_loaded, q3),
          "the weights file converts to the checkpoint's int8 model");
    CHECK(same_predictions(q_loaded, q3, d), "... which predicts the same bits");
    CHECK(mpt_model_fit(second, d, &(mpt_fit_desc){.epochs = 2, .initial_epoch = 1,
                                                   .batch_size = 8}) == MPT_OK,
          "fit the loaded model on: %s", mpt_context_error(ctx));
    CHECK(same_state(first, second, 1), "weights and moments bit-identical to the unbroken run");
    CHECK(qat_ranges_same(qat_ranges_of(first), qat_ranges_of(second)),
          "ranges bit-identical to the unbroken run");
    q1 = to_int8(first);
    q2 = to_int8(second);
    CHECK(q1 && q2 && same_int8_models(q1, q2), "the int8 models are identical");
    CHECK(same_predictions(q1, q2, d), "the int8 models predict the same bits");
    CHECK(!same_int8_models(q1, q_loaded), "(the second epoch changed the int8 model)");
    mpt_model_destroy(q1);
    mpt_model_destroy(q2);
    mpt_model_destroy(q3);
    mpt_model_destroy(q_loaded);
    mpt_model_destroy(first);
    mpt_model_destroy(second);
    mpt_model_destroy(third);
    mpt_dataset_destroy(d);
}

/* Files with and without ranges, into models with and without QAT
   (cases of their own: expect_refused reports its own). */
static void test_qat_mismatch(void) {
    mpt_dataset *d = qat_data();
    mpt_model *aware = make_qat_model(1), *plain = make_qat_model(0), *m = make_qat_model(1);
    mpt_model *named[2] = {NULL, NULL};
    char c[256], w[256], pc[256], pw[256];
    qat_ranges before;
    int k;
    test__begin();
    CHECK(mpt_model_fit(aware, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(plain, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_save_checkpoint(aware, path_of(c, "qat_m.safetensors"));
    mpt_model_save_weights(aware, path_of(w, "qat_mw.safetensors"));
    mpt_model_save_checkpoint(plain, path_of(pc, "plain_m.safetensors"));
    mpt_model_save_weights(plain, path_of(pw, "plain_mw.safetensors"));
    /* its weights file: the weights, the ranges passed over */
    CHECK(mpt_model_load_weights(plain, w) == MPT_OK, "weights with ranges into a float model: %s",
          mpt_context_error(ctx));
    CHECK(same_state(aware, plain, 0), "the weights are taken");
    /* files without ranges into a quantization-aware model that has some:
       loaded, its ranges learned again from the next batch */
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK, "fit: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_load_checkpoint(m, pc) == MPT_OK, "a float checkpoint into a quantization-"
          "aware model: %s", mpt_context_error(ctx));
    before = qat_ranges_of(m);
    CHECK(before.status[0] == MPT_ERR_INVALID_ARGUMENT && before.status[3] == MPT_ERR_INVALID_ARGUMENT,
          "the ranges are unset after loading a file without them (%d %d)", before.status[0],
          before.status[3]);
    mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8});
    CHECK(mpt_model_load_weights(m, pw) == MPT_OK, "float weights into a quantization-aware "
          "model: %s", mpt_context_error(ctx));
    CHECK(qat_ranges_of(m).status[0] == MPT_ERR_INVALID_ARGUMENT, "unset again");
    /* a checkpoint with ranges over a model whose ranges differ: every one taken */
    CHECK(mpt_model_load_checkpoint(m, c) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(qat_ranges_same(qat_ranges_of(m), qat_ranges_of(aware)), "the file's ranges");
    last_warning[0] = 0;
    {
        mpt_model *other = NULL;
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1,
                                                .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 23},
                         &other);
        mpt_model_add_dense(other, &(mpt_dense_desc){.units = 16});
        mpt_model_add_batch_normalization(other, &(mpt_batchnorm_desc){0});
        mpt_model_add_activation(other, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
        mpt_model_add_dropout(other, &(mpt_dropout_desc){.rate = 0.25f});
        mpt_model_add_dense(other, &(mpt_dense_desc){.units = 3});
        compile_with(other, MPT_OPTIMIZER_ADAM, 0);
        mpt_model_build(other, 8);
        mpt_model_quantize_aware(other, NULL);
        CHECK(mpt_model_load_checkpoint(other, c) == MPT_OK, "load: %s", mpt_context_error(ctx));
        CHECK(strstr(last_warning, "ema_decay 0.800000012") && strstr(last_warning, "0.999"),
              "another decay is warned about: '%s'", last_warning);
        mpt_model_destroy(other);
    }
    test__end("quantization-aware ranges: files with and without them, models with and "
              "without quantization-aware training");
    /* a full checkpoint's ranges into a float model: refused, nothing changed */
    mpt_model_destroy(plain);
    plain = make_qat_model(0);
    expect_refused(plain, c, 1, MPT_ERR_STATE, "not quantization-aware", "\"qat/",
                   "a quantization-aware checkpoint into a float model");
    mpt_model_destroy(aware);
    mpt_model_destroy(plain);
    mpt_model_destroy(m);
    /* a layer named "qat": its parameters are not ranges */
    test__begin();
    {
        for (k = 0; k < 2; k++) {
            mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1}, &named[k]);
            mpt_model_add_dense(named[k], &(mpt_dense_desc){.units = 4, .name = "qat"});
            compile_with(named[k], MPT_OPTIMIZER_ADAM, 0);
            CHECK(mpt_model_build(named[k], 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        }
        CHECK(mpt_model_quantize_aware(named[1], NULL) == MPT_OK, "qat: %s", mpt_context_error(ctx));
        mpt_model_fit(named[0], d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8});
        mpt_model_save_checkpoint(named[0], path_of(c, "qat_named.safetensors"));
        CHECK(mpt_model_load_checkpoint(named[1], c) == MPT_OK, "a float checkpoint of a layer "
              "named 'qat' into a quantization-aware model: %s", mpt_context_error(ctx));
        mpt_model_fit(named[1], d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8});
        mpt_model_save_checkpoint(named[1], c);
    }
    test__end("a float checkpoint of a layer named 'qat' loads into a quantization-aware model");
    expect_refused(named[0], c, 1, MPT_ERR_STATE, "\"qat/input/", "not quantization-aware",
                   "ranges of a layer named 'qat' into a float model");
    mpt_model_destroy(named[0]);
    mpt_model_destroy(named[1]);
    mpt_dataset_destroy(d);
}

/* src with `from` in its header replaced by `to` (the header padded again), as dst. */
static void patch_header(const char *src, const char *dst, const char *from, const char *to) {
    long n;
    unsigned char *bytes = test_read_file(src, &n);
    char *json = header_of(src), *at = json ? strstr(json, from) : NULL, *edited;
    size_t len, N;
    CHECK(at != NULL, "'%s' is in the header of %s", from, src);
    if (!bytes || !at) {
        free(bytes);
        free(json);
        return;
    }
    N = strlen(json);
    edited = (char *)malloc(N + strlen(to) + 1);
    sprintf(edited, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from));
    len = strlen(edited);
    while (len && edited[len - 1] == ' ') edited[--len] = 0;
    write_st(dst, edited, bytes + 8 + N, (size_t)n - 8 - N);
    free(edited);
    free(json);
    free(bytes);
}

/* Loads path into m, a trained quantization-aware model whose ranges are
   not the file's: refused with `want` and a message naming `needle`,
   weights, state and ranges as they were. */
static void expect_qat_refused(mpt_model *m, const char *path, int full, mpt_status want,
                               const char *needle, const char *label) {
    qat_ranges ranges = qat_ranges_of(m);
    snapshot before = snap_take(m);
    mpt_status s;
    test__begin();
    s = full ? mpt_model_load_checkpoint(m, path) : mpt_model_load_weights(m, path);
    CHECK(s == want, "status %s, want %s (%s)", mpt_status_string(s), mpt_status_string(want),
          mpt_context_error(ctx));
    CHECK(strstr(mpt_context_error(ctx), needle), "message '%s' names '%s'",
          mpt_context_error(ctx), needle);
    CHECK(snap_same(m, before), "weights and training state unchanged");
    CHECK(qat_ranges_same(qat_ranges_of(m), ranges), "ranges unchanged");
    free(before.bytes);
    test__end("%s is refused", label);
}

static void test_qat_bad_values(void) {
    mpt_dataset *d = qat_data();
    mpt_model *src = make_qat_model(1), *m = make_qat_model(1);
    char c[256], w[256], p[256];
    test__begin();
    CHECK(mpt_model_fit(src, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 8}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(qat_ranges_of(m).status[0] == MPT_OK && !qat_ranges_same(qat_ranges_of(m), qat_ranges_of(src)),
          "the model's ranges are set, and not the file's");
    CHECK(mpt_model_save_checkpoint(src, path_of(c, "qat_bad.safetensors")) == MPT_OK &&
              mpt_model_save_weights(src, path_of(w, "qat_badw.safetensors")) == MPT_OK,
          "save: %s", mpt_context_error(ctx));
    test__end("quantization-aware files to corrupt");
    path_of(p, "qat_patched.safetensors");
    patch_f32(c, p, tensor_begin(c, "qat/activation/output/min"), NAN);
    expect_qat_refused(m, p, 1, MPT_ERR_NUMERIC, "\"qat/activation/output/min\" holds NaN",
                       "a NaN range");
    patch_f32(w, p, tensor_begin(w, "qat/dense_1/output/max"), INFINITY);
    expect_qat_refused(m, p, 0, MPT_ERR_NUMERIC, "\"qat/dense_1/output/max\" holds inf",
                       "an infinite range in a weights file");
    patch_f32(c, p, tensor_begin(c, "qat/input/min"), 1e6f);
    expect_qat_refused(m, p, 1, MPT_ERR_FORMAT, "\"qat/input/min\" is 1e+06, above \"qat/input/max\"",
                       "min above max");
    patch_i64(c, p, tensor_begin(c, "qat/dense_1/output/initialized"), 2);
    expect_qat_refused(m, p, 1, MPT_ERR_FORMAT, "\"qat/dense_1/output/initialized\" is 2",
                       "an initialized flag of 2");
    patch_header(c, p, "\"qat/input/max\":{\"dtype\":\"F32\",\"shape\":[]",
                 "\"qat/input/max\":{\"dtype\":\"F32\",\"shape\":[1]");
    expect_qat_refused(m, p, 1, MPT_ERR_SHAPE, "\"qat/input/max\" is F32 (1,)", "a range of shape (1,)");
    patch_header(w, p, "\"qat/input/max\":{\"dtype\":\"F32\"", "\"qat/input/max\":{\"dtype\":\"I32\"");
    expect_qat_refused(m, p, 0, MPT_ERR_FORMAT, "\"qat/input/max\" is I32", "an I32 range");
    patch_header(c, p, "\"qat/input/max\"", "\"qat/input/mux\"");
    expect_qat_refused(m, p, 1, MPT_ERR_SHAPE, "but not \"qat/input/max\"", "a missing range");
    mpt_model_destroy(src);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- interoperability with the safetensors library ------------------------------------ */

static void test_python_interop(void) {
    arch a = {MPT_POLICY_MIXED_BFLOAT16, 13, 0, 0, 0};
    mpt_model *m;
    char p[256], script[256], py_file[256], cmd[1024];
    FILE *f;
    if (!test_python_imports("safetensors.numpy, numpy")) return;
    m = make_model(a);
    if (!m) return;
    compile_with(m, MPT_OPTIMIZER_ADAM, 0);
    fill_model(m, 0.75f);
    fill_train_state(m);
    CHECK(mpt_model_save_checkpoint(m, path_of(p, "py.safetensors")) == MPT_OK, "save: %s",
          mpt_context_error(ctx));
    /* The reference reader must see our names, dtypes, shapes, values and metadata. */
    f = fopen(path_of(script, "check.py"), "w");
    if (f) {
        fprintf(f,
                "import sys, numpy as np\n"
                "from safetensors import safe_open\n"
                "from safetensors.numpy import load_file, save_file\n"
                "d = load_file(sys.argv[1])\n"
                "k = d['dense/kernel']\n"
                "assert k.dtype == np.float32 and k.shape == (144, 5), (k.dtype, k.shape)\n"
                "assert float(k[1, 2]) == float.fromhex(sys.argv[2]), (k[1, 2], sys.argv[2])\n"
                "v = d['optimizer/conv2d/kernel/v']\n"
                "assert float(v[2, 1, 0, 3]) == float.fromhex(sys.argv[3])\n"
                "assert d['batch_normalization/moving_variance'].shape == (4,)\n"
                "assert d['train/epoch'].shape == () and int(d['train/epoch']) == 7\n"
                "t = d['train/optimizer_steps']\n"
                "assert t.dtype == np.int64 and int(t) == 123456789012\n"
                "assert float(d['train/loss_scale']) == 4096.0\n"
                "assert len(d) == 7 + 8 + 2 * 6, sorted(d)\n"
                "with safe_open(sys.argv[1], framework='np') as g:\n"
                "    meta = g.metadata()\n"
                "assert meta['kind'] == 'checkpoint' and meta['optimizer'] == 'adam', meta\n"
                "assert meta['policy'] == 'mixed_bfloat16', meta\n"
                "assert 'Conv2D conv2d bfloat16 (6, 6, 4)' in meta['model'], meta\n"
                "save_file({'dense/kernel': np.arange(6, dtype=np.float32).reshape(3, 2) * 0.5,\n"
                "           'dense/bias': np.array([1.5, -2.0], dtype=np.float32)}, sys.argv[4],\n"
                "          metadata={'format': 'np'})\n");
        fclose(f);
    }
    {
        const mpt__param *K = param_named(m, "dense/kernel"), *C = param_named(m, "conv2d/kernel");
        float k12 = K->value[1 * K->shape[1] + 2];
        float v = C->slot[1][((2 * C->shape[1] + 1) * C->shape[2] + 0) * C->shape[3] + 3];
        snprintf(cmd, sizeof cmd, "'%s' %s %s %a %a %s", test_python(), script, p, (double)k12,
                 (double)v, path_of(py_file, "from_py.safetensors"));
    }
    CHECK(system(cmd) == 0, "the safetensors library reads our checkpoint (%s)", cmd);
    {
        mpt_model *tiny = make_tiny();
        int i;
        CHECK(tiny && mpt_model_load_weights(tiny, py_file) == MPT_OK, "load what Python wrote: %s",
              mpt_context_error(ctx));
        for (i = 0; tiny && i < 6; i++)
            CHECK(tiny->params[0].value[i] == 0.5f * (float)i, "kernel[%d] = %g", i,
                  (double)tiny->params[0].value[i]);
        CHECK(tiny && tiny->params[1].value[0] == 1.5f && tiny->params[1].value[1] == -2.0f,
              "bias from Python");
        mpt_model_destroy(tiny);
    }
    mpt_model_destroy(m);
}

/* The safetensors library reads a quantization-aware checkpoint's
   ranges: scalar float32 min and max holding the model's values, int64
   "initialized" flags, no range for the Dense that BatchNormalization
   follows, and the moving average's decay in the metadata. */
static void test_qat_python_interop(void) {
    mpt_dataset *d;
    mpt_model *m;
    qat_ranges r;
    char p[256], script[256], cmd[1024];
    FILE *f;
    if (!test_python_imports("safetensors.numpy, numpy")) return;
    d = qat_data();
    m = make_qat_model(1);
    CHECK(m && d && mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    r = qat_ranges_of(m);
    CHECK(r.status[0] == MPT_OK && r.status[3] == MPT_OK && r.status[5] == MPT_OK,
          "the input's, the ReLU's and the logits' ranges are set");
    CHECK(m && mpt_model_save_checkpoint(m, path_of(p, "qat-py.safetensors")) == MPT_OK,
          "save: %s", mpt_context_error(ctx));
    f = fopen(path_of(script, "check_qat.py"), "w");
    if (f) {
        fprintf(f,
                "import sys, numpy as np\n"
                "from safetensors import safe_open\n"
                "from safetensors.numpy import load_file\n"
                "d = load_file(sys.argv[1])\n"
                "names = ['qat/input', 'qat/activation/output', 'qat/dense_1/output']\n"
                "for i, name in enumerate(names):\n"
                "    for j, end in enumerate(['min', 'max']):\n"
                "        v = d[name + '/' + end]\n"
                "        assert v.dtype == np.float32 and v.shape == (), (name, v.dtype, v.shape)\n"
                "        want = float.fromhex(sys.argv[2 + 2 * i + j])\n"
                "        assert float(v) == want, (name, end, float(v), want)\n"
                "    flag = d[name + '/initialized']\n"
                "    assert flag.dtype == np.int64 and flag.shape == () and int(flag) == 1, flag\n"
                "qat = sorted(k for k in d if k.startswith('qat/'))\n"
                "assert len(qat) == 9 and not any(k.startswith('qat/dense/') for k in qat), qat\n"
                "with safe_open(sys.argv[1], framework='np') as g:\n"
                "    meta = g.metadata()\n"
                "assert np.float32(meta['qat_ema_decay']) == np.float32(0.8), meta\n");
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "'%s' %s %s %a %a %a %a %a %a", test_python(), script, p,
             (double)r.min[0], (double)r.max[0], (double)r.min[3], (double)r.max[3],
             (double)r.min[5], (double)r.max[5]);
    CHECK(system(cmd) == 0, "the safetensors library reads the ranges (%s)", cmd);
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

static void run_cases(void) {
    test_weights_round_trip();
    test_full_round_trip();
    TEST_RUN(test_file_layout);
    test_mismatches();
    test_counter_bounds();
    test_bad_values();
    test_policies_across();
    test_malformed();
    test_crash_safety();
    TEST_RUN(test_stale_temporaries);
    TEST_RUN(test_out_of_memory);
    TEST_RUN(test_resume_fit);
    TEST_RUN(test_qat_resume);
    test_qat_mismatch();
    test_qat_bad_values();
    TEST_RUN(test_python_interop);
    TEST_RUN(test_qat_python_interop);
}

int main(void) {
    static const test_program p = {.name = "test_checkpoint", .ctx = &ctx, .threads = 1,
                                   .logger = test_logger, .tmpdir = dir,
                                   .tmpdir_size = sizeof dir, .cases = run_cases};
    return test_main(&p);
}

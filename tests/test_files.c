/* Files that are not regular files, given to the loaders: a FIFO (which a
   plain open() would wait on for a writer, forever), a character device and
   a directory. Each loader (safetensors weights and checkpoints, IDX
   images and labels, plain or gzip-compressed, NumPy's .npy and .npz, CSV)
   must refuse each quickly, with MPT_ERR_IO and a message naming the file
   and what it is; so must the CSVLogger, which writes one. Every call runs
   under an alarm, so a regression fails here instead of hanging. */
#define _POSIX_C_SOURCE 200809L /* mkfifo */
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

#define GUARD_SECONDS 5

static mpt_context *ctx;
static char dir[64]; /* a fresh directory for this run's files */

static void on_alarm(int sig) {
    static const char msg[] =
        "FAIL a loader or writer blocked on a file that is not a regular one\n";
    (void)sig;
    /* Only async-signal-safe calls here. */
    if (write(STDOUT_FILENO, msg, sizeof msg - 1) < 0) _exit(2);
    _exit(1);
}

/* A model with a single Dense, for the safetensors loaders. */
static mpt_model *make_tiny(void) {
    mpt_model *m = NULL;
    mpt_compile_desc c;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    memset(&c, 0, sizeof c);
    c.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    if (mpt_model_build(m, 2) != MPT_OK || mpt_model_compile(m, &c) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

static void write_bytes(const char *path, const unsigned char *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(b, 1, n, f);
        fclose(f);
    }
}

/* A valid plain IDX labels file with 3 random labels. */
static void write_labels(const char *path) {
    unsigned char b[11] = {0, 0, 8, 1, 0, 0, 0, 3};
    int i;
    for (i = 0; i < 3; i++) b[8 + i] = (unsigned char)test_uniform(0, 10);
    write_bytes(path, b, sizeof b);
}

/* A valid plain IDX images file: 3 random 2x2 images. */
static void write_images(const char *path) {
    unsigned char b[16 + 12] = {0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2};
    int i;
    for (i = 0; i < 12; i++) b[16 + i] = (unsigned char)test_uniform(0, 256);
    write_bytes(path, b, sizeof b);
}

/* Valid IDX labels and images in dir, the loaders' other file: their paths
   into labels and images (IDX_PATH bytes each). */
#define IDX_PATH 128
static void write_idx_files(char *labels, char *images) {
    snprintf(labels, IDX_PATH, "%s/labels-idx1-ubyte", dir);
    snprintf(images, IDX_PATH, "%s/images-idx3-ubyte", dir);
    write_labels(labels);
    write_images(images);
}

static void expect_refusal(mpt_status s, const char *path, const char *kind, const char *what) {
    CHECK(s == MPT_ERR_IO, "%s: status %s, want i/o error (%s)", what, mpt_status_string(s),
          mpt_context_error(ctx));
    CHECK(strstr(mpt_context_error(ctx), path) != NULL, "%s: message names the file: %s", what,
          mpt_context_error(ctx));
    CHECK(strstr(mpt_context_error(ctx), kind) != NULL &&
              strstr(mpt_context_error(ctx), "not a regular file") != NULL,
          "%s: message says it is %s, not a regular file: %s", what, kind,
          mpt_context_error(ctx));
}

/* Every loader on `path`, which is `kind`, each under the alarm; labels
   and images are valid IDX files to pair it with. */
static void check_loaders(const char *path, const char *kind, const char *labels,
                          const char *images) {
    mpt_model *m = make_tiny();
    mpt_dataset *d = NULL;
    mpt_dataset_csv_desc csv;
    mpt_status s;
    memset(&csv, 0, sizeof csv);
    csv.label_column = "y";
    CHECK(m != NULL, "model: %s", mpt_context_error(ctx));
    if (!m) return;
    alarm(GUARD_SECONDS);
    s = mpt_model_load_weights(m, path);
    alarm(0);
    expect_refusal(s, path, kind, "load_weights");
    alarm(GUARD_SECONDS);
    s = mpt_model_load_checkpoint(m, path);
    alarm(0);
    expect_refusal(s, path, kind, "load_checkpoint");
    alarm(GUARD_SECONDS);
    s = mpt_dataset_load_idx(ctx, path, labels, &d);
    alarm(0);
    expect_refusal(s, path, kind, "load_idx (images)");
    CHECK(d == NULL, "no dataset");
    alarm(GUARD_SECONDS);
    s = mpt_dataset_load_idx(ctx, images, path, &d);
    alarm(0);
    expect_refusal(s, path, kind, "load_idx (labels)");
    CHECK(d == NULL, "no dataset");
    alarm(GUARD_SECONDS);
    s = mpt_dataset_load_npy(ctx, path, NULL, NULL, &d);
    alarm(0);
    expect_refusal(s, path, kind, "load_npy");
    CHECK(d == NULL, "no dataset");
    alarm(GUARD_SECONDS);
    s = mpt_dataset_load_csv(ctx, path, &csv, &d);
    alarm(0);
    expect_refusal(s, path, kind, "load_csv");
    CHECK(d == NULL, "no dataset");
    mpt_model_destroy(m);
}

static void test_fifo(void) {
    char fifo[128], labels[IDX_PATH], images[IDX_PATH];
    snprintf(fifo, sizeof fifo, "%s/weights.safetensors", dir);
    write_idx_files(labels, images);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    check_loaders(fifo, "a FIFO", labels, images);
    remove(fifo);
    remove(labels);
    remove(images);
}

/* The gzip path too: MNIST's file names end in .gz, which the MNIST loader
   prefers; a FIFO there must not block it either. */
static void test_fifo_gz(void) {
    char fifo[128], labels[128];
    mpt_dataset *d = NULL;
    mpt_status s;
    snprintf(fifo, sizeof fifo, "%s/train-images-idx3-ubyte.gz", dir);
    snprintf(labels, sizeof labels, "%s/train-labels-idx1-ubyte", dir);
    write_labels(labels);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    alarm(GUARD_SECONDS);
    s = mpt_dataset_load_mnist(ctx, dir, 0, &d);
    alarm(0);
    expect_refusal(s, fifo, "a FIFO", "load_mnist");
    CHECK(d == NULL, "no dataset");
    remove(fifo);
    remove(labels);
}

static void test_device_and_directory(void) {
    char labels[IDX_PATH], images[IDX_PATH], sub[128];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    write_idx_files(labels, images);
    CHECK(mkdir(sub, 0700) == 0, "mkdir %s", sub);
    check_loaders("/dev/null", "a character device", labels, images);
    check_loaders(sub, "a directory", labels, images);
    rmdir(sub);
    remove(labels);
    remove(images);
}

/* The CSVLogger opens its file when fit begins: a FIFO there (appending or
   not) is refused with MPT_ERR_IO, not waited on for a reader, and is left
   a FIFO; so is a character device. */
static void test_csv_logger_refuses(void) {
    static const char *const kinds[2] = {"a FIFO", "a character device"};
    char fifo[128];
    mpt_model *m = make_tiny();
    int k, append;
    struct stat st;
    snprintf(fifo, sizeof fifo, "%s/log.csv", dir);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    CHECK(m != NULL, "model: %s", mpt_context_error(ctx));
    for (k = 0; m && k < 2; k++) {
        const char *path = k == 0 ? fifo : "/dev/null";
        for (append = 0; append < 2; append++) {
            mpt_callback cb;
            mpt_status s;
            CHECK(mpt_callback_csv_logger(ctx, &(mpt_csv_logger_desc){.filename = path,
                                                                       .append = append},
                                          &cb) == MPT_OK, "create: %s", mpt_context_error(ctx));
            alarm(GUARD_SECONDS);
            s = cb.on_train_begin(cb.user_data, m);
            alarm(0);
            expect_refusal(s, path, kinds[k], append ? "CSVLogger (append)" : "CSVLogger");
            CHECK(strstr(mpt_context_error(ctx), "CSVLogger") != NULL, "message names the "
                  "callback: %s", mpt_context_error(ctx));
            mpt_callback_destroy(&cb);
        }
    }
    CHECK(stat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO is still one");
    remove(fifo);
    mpt_model_destroy(m);
}

/* The regular files beside them still load. */
static void test_regular_files_load(void) {
    char labels[IDX_PATH], images[IDX_PATH];
    mpt_dataset *d = NULL;
    write_idx_files(labels, images);
    CHECK(mpt_dataset_load_idx(ctx, images, labels, &d) == MPT_OK, "load_idx: %s",
          mpt_context_error(ctx));
    CHECK(d && mpt_dataset_count(d) == 3, "3 samples");
    mpt_dataset_destroy(d);
    remove(labels);
    remove(images);
}

static void run_cases(void) {
    TEST_RUN(test_fifo);
    TEST_RUN(test_fifo_gz);
    TEST_RUN(test_device_and_directory);
    TEST_RUN(test_csv_logger_refuses);
    TEST_RUN(test_regular_files_load);
}

static void guard_with_alarm(void) { signal(SIGALRM, on_alarm); }

int main(void) {
    static const test_program p = {.name = "test_files", .ctx = &ctx, .threads = 1,
                                   .logger = quiet_logger, .seed = 17,
                                   .setup = guard_with_alarm, .tmpdir = dir,
                                   .tmpdir_size = sizeof dir, .cases = run_cases};
    return test_main(&p);
}

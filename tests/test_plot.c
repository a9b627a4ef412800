/* Watching training after the fact: the history drawn as an SVG file
   (well-formed XML, read back with Python's xml.etree.ElementTree; one
   polyline per run of finite values; bad input; the file replaced whole
   or not at all), and the summary fit prints after its last epoch. */
#define _POSIX_C_SOURCE 200809L /* popen, mkdir */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

#include <dirent.h>
#include <sys/stat.h> /* mkdir */
#include <unistd.h>   /* rmdir, getpid */

static mpt_context *ctx;
static char tmpdir[256];

/* ---- reading an SVG back ------------------------------------------------------------------ */

/* Parses the file with ElementTree and prints, for each series (a <g>
   with data-key), "key<TAB>polylines<TAB>points of each, comma-separated";
   then "texts<TAB>" and every <text>'s content joined by '|'. Anything that
   is not well-formed XML makes it exit with an error. */
static const char *const reader_py =
    "import sys, xml.etree.ElementTree as ET\n"
    "ns = '{http://www.w3.org/2000/svg}'\n"
    "root = ET.parse(sys.argv[1]).getroot()\n"
    "assert root.tag == ns + 'svg', root.tag\n"
    "for g in root.iter(ns + 'g'):\n"
    "    key = g.get('data-key')\n"
    "    if key is None: continue\n"
    "    lines = g.findall(ns + 'polyline')\n"
    "    counts = []\n"
    "    for p in lines:\n"
    "        pts = p.get('points').split()\n"
    "        for xy in pts:\n"
    "            x, y = xy.split(',')\n"
    "            float(x); float(y)\n"
    "        counts.append(str(len(pts)))\n"
    "    print('%s\\t%d\\t%s' % (key, len(lines), ','.join(counts)))\n"
    "print('texts\\t' + '|'.join(t.text or '' for t in root.iter(ns + 'text')))\n";

typedef struct svg_read {
    int ok;               /* python parsed the file                       */
    char lines[64][256];  /* its output, one line each                   */
    int n;
    char texts[8192];     /* the <text> contents, joined by '|'          */
} svg_read;

static void svg_line(void *user, const char *line) {
    svg_read *r = (svg_read *)user;
    if (!strncmp(line, "texts\t", 6))
        snprintf(r->texts, sizeof r->texts, "%s", line + 6);
    else if (r->n < 64)
        snprintf(r->lines[r->n++], sizeof r->lines[0], "%.255s", line);
}

static void read_svg(const char *path, svg_read *r) {
    memset(r, 0, sizeof *r);
    r->ok = test_python_lines(tmpdir, "reader.py", reader_py, path, svg_line, r);
}

/* The line of series `key` ("key\tpolylines\tcounts"), or NULL. */
static const char *series_line(const svg_read *r, const char *key) {
    size_t n = strlen(key);
    int i;
    for (i = 0; i < r->n; i++)
        if (!strncmp(r->lines[i], key, n) && r->lines[i][n] == '\t') return r->lines[i];
    return NULL;
}

/* Checks that series `key` has the polylines whose point counts are
   `expected` ("10", "3,3,2", "" for none). */
static void check_series(const svg_read *r, const char *key, int polylines, const char *expected) {
    char want[256];
    const char *got = series_line(r, key);
    snprintf(want, sizeof want, "%s\t%d\t%s", key, polylines, expected);
    CHECK(got && !strcmp(got, want), "series %s: got '%s', want '%s'", key, got ? got : "(none)",
          want);
}

/* ---- a history by hand ------------------------------------------------------------------- */

enum { EPOCHS = 12, MAX_EPOCHS = 64 };

typedef struct fake_history {
    mpt_history h;
    double values[MPT_MAX_LOGS][MAX_EPOCHS];
} fake_history;

static void add_key(fake_history *f, const char *key, double lo, double hi) {
    int k = f->h.n_keys++, e;
    f->h.keys[k] = key;
    f->h.values[k] = f->values[k];
    for (e = 0; e < f->h.epochs; e++) f->values[k][e] = test_uniform(lo, hi);
}

/* loss, accuracy, their val_ twins, the learning rate, a loss scale
   spanning 2^10..2^16 and two measurements the plot leaves out. */
static void make_history(fake_history *f, int epochs) {
    int e;
    memset(f, 0, sizeof *f);
    f->h.epochs = epochs;
    add_key(f, "loss", 0.2, 2.5);
    add_key(f, "accuracy", 0.3, 0.99);
    add_key(f, "val_loss", 0.2, 2.5);
    add_key(f, "val_accuracy", 0.3, 0.99);
    add_key(f, "learning_rate", 1e-4, 1e-3);
    add_key(f, "loss_scale", 0, 0);
    for (e = 0; e < epochs; e++) f->values[5][e] = ldexp(1, 10 + test_randint(0, 6));
    f->values[5][0] = 1024;
    f->values[5][epochs - 1] = 65536;
    add_key(f, "epoch_seconds", 1, 5);
    add_key(f, "samples_per_second", 1e3, 1e5);
}

static void path_in_tmp(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", tmpdir, name);
}

/* Plots h into tmpdir/name with the defaults, and reads the SVG back. */
static void plot_and_read(const mpt_history *h, const char *name, svg_read *r) {
    char path[512];
    path_in_tmp(path, sizeof path, name);
    CHECK(mpt_history_plot_svg(h, path, &(mpt_plot_desc){.ctx = ctx}) == MPT_OK, "plot %s: %s",
          name, mpt_context_error(ctx));
    read_svg(path, r);
}

/* ---- the tests --------------------------------------------------------------------------- */

static void test_well_formed(void) {
    fake_history f;
    svg_read r;
    char path[512], counts[64];
    make_history(&f, EPOCHS);
    path_in_tmp(path, sizeof path, "history.svg");
    /* a title a careless caller could pass: markup, quotes, a control
       character and a byte that is not UTF-8, then a valid "é" */
    CHECK(mpt_history_plot_svg(&f.h, path, &(mpt_plot_desc){
              .title = "<b>\"run\" & 'co'\x01\xff caf\xc3\xa9</b>", .ctx = ctx}) == MPT_OK,
          "plot: %s", mpt_context_error(ctx));
    read_svg(path, &r);
    CHECK(r.ok, "not well-formed XML: %s", r.n ? r.lines[r.n - 1] : "(no output)");
    snprintf(counts, sizeof counts, "%d", EPOCHS);
    check_series(&r, "loss", 1, counts);
    check_series(&r, "val_loss", 1, counts);
    check_series(&r, "accuracy", 1, counts);
    check_series(&r, "val_accuracy", 1, counts);
    check_series(&r, "learning_rate", 1, counts);
    check_series(&r, "loss_scale", 1, counts);
    CHECK(r.n == 6, "%d series drawn, want 6 (no measurements)", r.n);
    CHECK(strstr(r.texts, "<b>\"run\" & 'co'?? caf\xc3\xa9</b>") != NULL, "title: %s", r.texts);
    CHECK(strstr(r.texts, "loss scale|(log scale)") && strstr(r.texts, "|epoch|"),
          "labels: %s", r.texts);
    /* the legend: training and validation on the paired panels, the key alone */
    CHECK(strstr(r.texts, "|loss|validation|training|") &&
              strstr(r.texts, "|learning rate|learning_rate|"), "legend: %s", r.texts);
    /* ticks: the epochs, and the loss scale's powers of two */
    CHECK(strstr(r.texts, "|12|") && strstr(r.texts, "|1024|"), "ticks: %s", r.texts);
}

/* NaN and inf break a curve into pieces; a series with nothing finite
   has no polyline, and a lone finite value a polyline of one point. */
static void test_nan_breaks_the_curve(void) {
    fake_history f;
    svg_read r;
    int e;
    make_history(&f, 10);
    f.values[0][3] = NAN;      /* loss: 0-2, 4-6, 8-9 */
    f.values[0][7] = INFINITY;
    f.values[1][0] = -INFINITY; /* accuracy: 1-7, 9 alone */
    f.values[1][8] = NAN;
    for (e = 0; e < 10; e++) f.values[2][e] = NAN; /* val_loss: nothing */
    f.values[3][5] = 1e308;                         /* val_accuracy: too large to place */
    plot_and_read(&f.h, "nan.svg", &r);
    CHECK(r.ok, "not well-formed XML: %s", r.n ? r.lines[r.n - 1] : "(no output)");
    check_series(&r, "loss", 3, "3,3,2");
    check_series(&r, "accuracy", 2, "7,1");
    check_series(&r, "val_loss", 0, "");
    check_series(&r, "val_accuracy", 2, "5,4");
    check_series(&r, "learning_rate", 1, "10");
}

/* A history of one epoch, and one with nothing but a validation loss;
   a longer one labels epoch 1, then every 5th. */
static void test_small_histories(void) {
    fake_history f;
    svg_read r;
    memset(&f, 0, sizeof f);
    f.h.epochs = 40;
    add_key(&f, "loss", 0.2, 0.3);
    plot_and_read(&f.h, "long.svg", &r);
    CHECK(r.ok && strstr(r.texts, "|1|5|10|15|20|25|30|35|40|epoch"), "epoch ticks: %s", r.texts);
    memset(&f, 0, sizeof f);
    f.h.epochs = 1;
    add_key(&f, "val_loss", 0.5, 1.5);
    plot_and_read(&f.h, "one.svg", &r);
    CHECK(r.ok && r.n == 1, "one epoch: %d series, %s", r.n, r.n ? r.lines[0] : "");
    check_series(&r, "val_loss", 1, "1");
}

/* How many files in tmpdir start with `prefix`. */
static int files_starting(const char *prefix) {
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    int n = 0;
    while (d && (e = readdir(d)) != NULL) n += !strncmp(e->d_name, prefix, strlen(prefix));
    if (d) closedir(d);
    return n;
}

static void test_bad_input(void) {
    fake_history f;
    mpt_history empty;
    mpt_plot_desc d = {0};
    char path[512], dir_path[512], text[64] = {0};
    FILE *file;
    make_history(&f, 4);
    memset(&empty, 0, sizeof empty);
    d.ctx = ctx;
    path_in_tmp(path, sizeof path, "bad.svg");
    CHECK(mpt_history_plot_svg(NULL, path, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "bad.svg") &&
              strstr(mpt_context_error(ctx), "NULL history"),
          "NULL history: %s", mpt_context_error(ctx));
    CHECK(mpt_history_plot_svg(&f.h, NULL, &d) == MPT_ERR_INVALID_ARGUMENT, "NULL path");
    CHECK(mpt_history_plot_svg(&f.h, "", &d) == MPT_ERR_INVALID_ARGUMENT, "empty path");
    CHECK(mpt_history_plot_svg(&empty, path, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "bad.svg") &&
              strstr(mpt_context_error(ctx), "0 epochs"),
          "empty history: %s", mpt_context_error(ctx));
    empty.epochs = 3;
    CHECK(mpt_history_plot_svg(&empty, path, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "no loss"),
          "no keys: %s", mpt_context_error(ctx));
    f.h.values[1] = NULL;
    CHECK(mpt_history_plot_svg(&f.h, path, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "key 1"), "NULL values: %s", mpt_context_error(ctx));
    f.h.values[1] = f.values[1];
    f.h.n_keys = MPT_MAX_LOGS + 1;
    CHECK(mpt_history_plot_svg(&f.h, path, &d) == MPT_ERR_INVALID_ARGUMENT, "n_keys too large");
    f.h.n_keys = 8;
    d.width = -5;
    CHECK(mpt_history_plot_svg(&f.h, path, &d) == MPT_ERR_INVALID_ARGUMENT, "negative width");
    d.width = 100;
    CHECK(mpt_history_plot_svg(&f.h, path, &d) == MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(ctx), "too small"), "tiny: %s", mpt_context_error(ctx));
    d.width = 0;
    CHECK(files_starting("bad.svg") == 0, "a failed call left a file");
    /* a directory that does not exist */
    CHECK(mpt_history_plot_svg(&f.h, "/nonexistent-mpt-dir/plot.svg", &d) == MPT_ERR_IO &&
              strstr(mpt_context_error(ctx), "'/nonexistent-mpt-dir/plot.svg'"),
          "unwritable: %s", mpt_context_error(ctx));
    /* a target the rename cannot replace (a directory): the temporary
       file is removed and the target left as it was */
    path_in_tmp(dir_path, sizeof dir_path, "is_a_dir.svg");
    mkdir(dir_path, 0700);
    CHECK(mpt_history_plot_svg(&f.h, dir_path, &d) == MPT_ERR_IO &&
              strstr(mpt_context_error(ctx), "rename") && strstr(mpt_context_error(ctx), dir_path),
          "onto a directory: %s", mpt_context_error(ctx));
    CHECK(files_starting("is_a_dir.svg") == 1, "the temporary file was left behind");
    rmdir(dir_path);
    /* an existing file is replaced whole */
    file = fopen(path, "w");
    if (file) {
        fputs("old", file);
        fclose(file);
    }
    CHECK(mpt_history_plot_svg(&f.h, path, NULL) == MPT_OK, "NULL desc");
    file = fopen(path, "r");
    if (file) {
        CHECK(fgets(text, sizeof text, file) && !strncmp(text, "<?xml", 5), "not replaced: %s",
              text);
        fclose(file);
    }
    CHECK(files_starting("bad.svg") == 1, "temporary files left");
    remove(path);
    /* without a context the status alone comes back (the message goes to stderr) */
    CHECK(mpt_history_plot_svg(&empty, NULL, NULL) == MPT_ERR_INVALID_ARGUMENT, "no context");
}

/* The plot goes through the writer every file goes through: what a killed
   writer left beside the target ("<path>.tmp-<pid>", unlocked) is swept,
   with a context or without one. */
static void test_killed_writes_swept(void) {
    fake_history f;
    mpt_plot_desc d = {0};
    char path[512], left[600];
    int k;
    FILE *file;
    make_history(&f, 4);
    d.ctx = ctx;
    path_in_tmp(path, sizeof path, "swept.svg");
    for (k = 0; k < 2; k++) {
        snprintf(left, sizeof left, "%s.tmp-1%s", path, k ? "-3" : "");
        file = fopen(left, "w");
        if (file) {
            fputs("<?xml half", file);
            fclose(file);
        }
        CHECK(mpt_history_plot_svg(&f.h, path, k ? NULL : &d) == MPT_OK, "plot: %s",
              mpt_context_error(ctx));
        CHECK(access(left, F_OK) != 0, "%s, left by a killed write, is still there", left);
        CHECK(files_starting("swept.svg") == 1, "temporary files left");
        remove(left);
    }
    remove(path);
}

/* ---- a real fit: its plot and fit's closing summary ---------------------------------------- */

static char printed[1 << 15];
static test_text printed_to = {printed, sizeof printed, 0};

/* The loss scale seen after every step: its rises and falls. */
typedef struct scale_watch {
    float last;
    int grew, shrank;
} scale_watch;

static mpt_status watch_scale(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                              int *stop) {
    scale_watch *w = (scale_watch *)user;
    float now = mpt_model_loss_scale(m);
    (void)batch;
    (void)logs;
    (void)stop;
    w->grew += now > w->last;
    w->shrank += now < w->last;
    w->last = now;
    return MPT_OK;
}

static mpt_model *small_model(void) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {FEATURES}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 5}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    /* a scale that overflows at first, and grows back every 4 good steps:
       both directions within a few epochs */
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY,
              .loss_scale = {.initial_scale = 16777216, .growth_interval = 4}}) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    return m;
}

static double history_sum(const mpt_history *h, const char *key) {
    double sum = 0;
    int k, e;
    for (k = 0; k < h->n_keys; k++)
        if (!strcmp(h->keys[k], key))
            for (e = 0; e < h->epochs; e++) sum += h->values[k][e];
    return sum;
}

static void test_fit_summary_and_plot(void) {
    mpt_dataset *all = blobs_in(ctx), *train = NULL, *val = NULL;
    mpt_model *m = small_model();
    scale_watch w;
    mpt_callback cb;
    mpt_history h;
    svg_read r;
    const char *fit, *step, *scale;
    int epochs = 0, grew = -1, shrank = -1;
    long long steps = 0, skipped = -1;
    double total = 0, training = 0, rate = 0, ms[5] = {0}, first = 0, final = 0;
    CHECK(mpt_dataset_split(ctx, all, 160, &train, &val) == MPT_OK, "split");
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = watch_scale;
    cb.user_data = &w;
    w.last = mpt_model_loss_scale(m);
    w.grew = w.shrank = 0;
    test_text_clear(&printed_to);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 4, .batch_size = 16, .verbose = 1,
                                                  .validation_data = val, .callbacks = &cb,
                                                  .n_callbacks = 1,
                                                  .printer = {test_text_append, &printed_to}}) ==
              MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_model_history(m, &h);
    fit = strstr(printed, "\nFit: ");
    step = strstr(printed, "\nStep: ");
    scale = strstr(printed, "\nLoss scale: ");
    CHECK(fit && step && scale && fit < step && step < scale &&
              fit > strstr(printed, "Epoch 4/4"), "summary:\n%s", printed);
    if (fit && step && scale) {
        CHECK(sscanf(fit, "\nFit: %d epochs, %lld steps in %lfs (training %lfs) - %lf samples/s",
                     &epochs, &steps, &total, &training, &rate) == 5, "fit line: %s", fit);
        CHECK(sscanf(step, "\nStep: %lfms - forward: %lfms - backward: %lfms - update: %lfms - "
                           "data and host: %lfms", &ms[0], &ms[1], &ms[2], &ms[3], &ms[4]) == 5,
              "step line: %s", step);
        CHECK(sscanf(scale, "\nLoss scale: %lf -> %lf (dynamic) - grew: %d - shrank: %d - "
                            "skipped steps: %lld", &first, &final, &grew, &shrank, &skipped) == 5,
              "scale line: %s", scale);
    }
    CHECK(epochs == 4 && steps == 4 * 10, "%d epochs, %lld steps", epochs, steps);
    CHECK(fabs(training - history_sum(&h, "epoch_seconds")) <= 0.006 && total >= training - 0.01,
          "total %g, training %g, the epochs' %g", total, training,
          history_sum(&h, "epoch_seconds"));
    CHECK(fabs(rate - 4 * 160 / history_sum(&h, "epoch_seconds")) <= 1e-3 * rate + 1,
          "samples/s %g for %g s", rate, history_sum(&h, "epoch_seconds"));
    /* the mean step: the epochs' (equal numbers of steps) means, and the parts add up */
    CHECK(fabs(ms[1] - history_sum(&h, "forward_ms_per_step") / 4) <= 0.01 * ms[1] + 1e-3 &&
              fabs(ms[2] - history_sum(&h, "backward_ms_per_step") / 4) <= 0.01 * ms[2] + 1e-3 &&
              fabs(ms[3] - history_sum(&h, "update_ms_per_step") / 4) <= 0.01 * ms[3] + 1e-3,
          "step parts %g %g %g", ms[1], ms[2], ms[3]);
    CHECK(fabs(ms[0] - (ms[1] + ms[2] + ms[3] + ms[4])) <= 0.02 * ms[0] + 1e-3 &&
              fabs(ms[0] - 1e3 * training / 40) <= 0.01 * ms[0] + 0.2,
          "step %g ms vs parts and %g s / 40", ms[0], training);
    CHECK(skipped == (long long)history_sum(&h, "skipped_steps") && skipped > 0,
          "skipped %lld, history %g", skipped, history_sum(&h, "skipped_steps"));
    CHECK(grew == w.grew && shrank == w.shrank && grew > 0 && shrank > 0,
          "grew %d shrank %d; seen %d and %d", grew, shrank, w.grew, w.shrank);
    CHECK(first == 16777216 && final == mpt_model_loss_scale(m), "scale %g -> %g", first, final);
    /* the plot of a real history */
    plot_and_read(&h, "fit.svg", &r);
    CHECK(r.ok && r.n == 6, "fit's plot: %d series, %s", r.n, r.n ? r.lines[r.n - 1] : "");
    check_series(&r, "loss", 1, "4");
    check_series(&r, "val_loss", 1, "4");
    check_series(&r, "accuracy", 1, "4");
    check_series(&r, "val_accuracy", 1, "4");
    check_series(&r, "learning_rate", 1, "4");
    check_series(&r, "loss_scale", 1, "4");
    /* verbose 0 prints nothing, the summary included */
    test_text_clear(&printed_to);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 1, .batch_size = 16,
                                                  .printer = {test_text_append, &printed_to}}) ==
              MPT_OK,
          "fit");
    CHECK(printed_to.len == 0, "verbose 0 printed:\n%s", printed);
    /* verbose 2 ends with it too */
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 16, .verbose = 2,
                                                  .printer = {test_text_append, &printed_to}}) ==
              MPT_OK,
          "fit");
    CHECK(strstr(printed, "Fit: 2 epochs, 20 steps in ") && strstr(printed, "\nStep: ") &&
              strstr(printed, "\nLoss scale: ") && strstr(printed, " - skipped steps: "),
          "verbose 2:\n%s", printed);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    mpt_dataset_destroy(all);
}

static void run_cases(void) {
    TEST_RUN(test_well_formed);
    TEST_RUN(test_nan_breaks_the_curve);
    TEST_RUN(test_small_histories);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_killed_writes_swept);
    TEST_RUN(test_fit_summary_and_plot);
}

int main(void) {
    static const test_program p = {.name = "test_plot", .ctx = &ctx, .threads = 2,
                                   .logger = quiet_logger, .seed = 41, .setup = make_blobs,
                                   .tmpdir = tmpdir, .tmpdir_size = sizeof tmpdir,
                                   /* set, the SVGs stay in tmpdir to look at */
                                   .keep_env = "MPT_TEST_KEEP_PLOTS", .cases = run_cases};
    return test_main(&p);
}

/* fit's profiler (profile_batch): the Chrome trace read back with Python's
   json module (every profiled step has one forward event per layer, one
   backward per layer the backward pass runs through, one update per layer
   with trainable weights, durations >= 0, each inside its step), the gzip'd
   copy served by TensorBoard's profile plugin (through TensorBoard's own
   HTTP routes, $MPT_TEST_PYTHON with tensorboard-plugin-profile 2.19.0),
   training bit for bit as without profiling, and bad input: ranges outside
   the run, a directory that cannot be written. */
#define _POSIX_C_SOURCE 200809L /* popen, symlink */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/utsname.h>

static mpt_context *ctx;
static char tmpdir[256];

/* Dense(16, relu) → Dropout(0.25) → Dense(3, softmax), Adam, seeded. */
static mpt_model *make_model(mpt_context *c) {
    classifier_desc d = {FEATURES, 16, CLASSES, 0.25f, 11, 0, NULL};
    return small_classifier(c, &d);
}

/* 200 samples in batches of 32: 7 steps an epoch. */
static mpt_fit_desc fit_desc(int epochs) { return fit_for(epochs, 32); }

/* The only entry of dir (a run directory), into out; 0 if not one. */
static int only_entry(const char *dir, char *out, size_t size) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    if (!d) return 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        n++;
        snprintf(out, size, "%s/%.200s", dir, e->d_name);
    }
    closedir(d);
    return n == 1;
}

/* Reads a trace with json (and its .gz twin with gzip) and prints per
   step: "step N fwd=a,b bwd=c,d upd=e nested=1 nonneg=1 loss=x", then
   "gz=1" when the .gz holds the same events. */
static const char *const check_py =
    "import json, sys, gzip, os, collections\n"
    "ev = json.load(open(sys.argv[1]))\n"
    "assert isinstance(ev, list)\n"
    "x = [e for e in ev if e['ph'] == 'X']\n"
    "for e in x:\n"
    "    assert set(e) >= {'name', 'ph', 'ts', 'dur', 'pid', 'tid', 'args'}, e\n"
    "steps = [e for e in x if e['name'].startswith('step ') and e['tid'] == 1]\n"
    "for s in sorted(steps, key=lambda e: e['args']['step']):\n"
    "    n = s['args']['step']\n"
    "    mine = [e for e in x if e['args'].get('step') == n]\n"
    "    ph = collections.defaultdict(list)\n"
    "    for e in mine:\n"
    "        if 'layer' in e['args']: ph[e['args']['phase']].append(e['args']['layer'])\n"
    "    end = s['ts'] + s['dur'] + 1e-3\n"
    "    nested = all(e['ts'] >= s['ts'] - 1e-3 and e['ts'] + e['dur'] <= end for e in mine)\n"
    "    nonneg = all(e['dur'] >= 0 for e in mine)\n"
    "    print('step %d fwd=%s bwd=%s upd=%s nested=%d nonneg=%d loss=%.6f' % (n,\n"
    "          ','.join(ph['forward']), ','.join(ph['backward']), ','.join(ph['update']),\n"
    "          nested, nonneg, s['args']['loss']))\n"
    "gz = sys.argv[1] + '.gz'\n"
    "if os.path.exists(gz): print('gz=%d' % (json.load(gzip.open(gz)) == ev))\n";

typedef struct trace_read {
    int ok, n;
    char lines[32][256];
} trace_read;

static void trace_line(void *user, const char *line) {
    trace_read *r = (trace_read *)user;
    if (r->n < 32) snprintf(r->lines[r->n++], sizeof r->lines[0], "%.255s", line);
}

static void read_trace(const char *path, trace_read *r) {
    memset(r, 0, sizeof *r);
    r->ok = test_python_lines(tmpdir, "check.py", check_py, path, trace_line, r);
}

/* f profiles steps first..last into tmpdir/sub: dir (size bytes), which
   f points to. */
static void profile_steps(mpt_fit_desc *f, char *dir, size_t size, const char *sub,
                          int64_t first, int64_t last) {
    snprintf(dir, size, "%s/%s", tmpdir, sub);
    f->profile_batch[0] = first;
    f->profile_batch[1] = last;
    f->profile_dir = dir;
}

/* Reads the trace of the one run that fit's profiler wrote under dir into
   r; prefix receives "<run directory>/<host>", the run's files' name less
   their endings. */
static void read_run_trace(const char *dir, char *prefix, size_t prefix_size, trace_read *r) {
    char plugin[400], run[700] = "", path[1200];
    struct utsname names;
    snprintf(plugin, sizeof plugin, "%s/plugins/profile", dir);
    CHECK(only_entry(plugin, run, sizeof run), "one run directory in %s", plugin);
    uname(&names);
    snprintf(prefix, prefix_size, "%s/%s", run, names.nodename);
    snprintf(path, sizeof path, "%s.trace.json", prefix);
    read_trace(path, r);
}

static void test_trace_per_layer(void) {
    mpt_dataset *data = blobs_in(ctx);
    mpt_model *plain = make_model(ctx), *profiled = make_model(ctx);
    mpt_fit_desc f = fit_desc(2);
    char dir[300], prefix[1100], path[1200];
    trace_read r;
    mpt_history h1, h2;
    int k;
    if (!test_python_imports("json, gzip")) goto done;
    CHECK(mpt_model_fit(plain, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    profile_steps(&f, dir, sizeof dir, "logs", 5, 9); /* epoch 1's 5..7 and epoch 2's 1..2 */
    CHECK(mpt_model_fit(profiled, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    read_run_trace(dir, prefix, sizeof prefix, &r);
    CHECK(r.ok, "the trace %s.trace.json parses: %s", prefix, r.n ? r.lines[r.n - 1] : "");
    CHECK(r.n == 6, "5 steps and the gzip line, got %d lines", r.n);
    for (k = 0; k < 5 && k < r.n; k++) {
        char want[256];
        snprintf(want, sizeof want, "step %d fwd=dense,dropout,dense_1 bwd=dense_1,dropout,dense "
                 "upd=dense,dense_1 nested=1 nonneg=1 loss=", 5 + k);
        CHECK(strncmp(r.lines[k], want, strlen(want)) == 0, "got '%s', want '%s...'",
              r.lines[k], want);
    }
    CHECK(r.n == 6 && strcmp(r.lines[5], "gz=1") == 0, "the .gz copy holds the same events");
    snprintf(path, sizeof path, "%s.layers.txt", prefix);
    CHECK(access(path, R_OK) == 0, "the table %s", path);
    /* training itself is the same, bit for bit */
    CHECK(test_same_weights(plain, profiled), "profiled weights equal the unprofiled run's");
    mpt_model_history(plain, &h1);
    mpt_model_history(profiled, &h2);
    CHECK(h1.epochs == 2 && h2.epochs == 2 && h1.values[0][1] == h2.values[0][1],
          "the same losses (%s: %g vs %g)", h1.keys[0], h1.values[0][1], h2.values[0][1]);
done:
    mpt_model_destroy(plain);
    mpt_model_destroy(profiled);
    mpt_dataset_destroy(data);
}

/* TensorBoard with its profile plugin, as `tensorboard --logdir` builds it
   (the installed plugins, the in-process data loader), asked through its
   HTTP routes what the plugin's frontend asks: the profile tab enabled, the
   run, its tools, the host, and the trace viewer's data, which must be the
   trace's events. Prints "read" when all of them hold. */
static const char *const tensorboard_py =
    "import gzip, json, logging, sys\n"
    "logging.disable(logging.WARNING)\n"
    "from tensorboard import default, program\n"
    "from tensorboard.backend import application\n"
    "from tensorboard.backend.event_processing import data_ingester\n"
    "from werkzeug import test, wrappers\n"
    "logdir, run, host, trace = sys.argv[1:5]\n"
    "tb = program.TensorBoard(plugins=default.get_plugins())\n"
    "tb.configure(argv=[None, '--logdir', logdir, '--load_fast', 'false'])\n"
    "ingester = data_ingester.LocalDataIngester(tb.flags)\n"
    "ingester.start()\n"
    "app = application.TensorBoardWSGIApp(tb.flags, tb.plugin_loaders, ingester.data_provider,\n"
    "                                     tb.assets_zip_provider, ingester.deprecated_multiplexer)\n"
    "client = test.Client(app, wrappers.Response)\n"
    "def get(route, **query):\n"
    "    r = client.get(route, query_string=query)\n"
    "    assert r.status_code == 200, (route, query, r.status, r.data[:200])\n"
    "    gz = r.headers.get('Content-Encoding') == 'gzip'\n"
    "    return json.loads(gzip.decompress(r.data) if gz else r.data)\n"
    "plugin = get('/data/plugins_listing').get('profile')\n"
    "assert plugin and plugin['enabled'], ('the profile plugin is off', plugin)\n"
    "profile = '/data/plugin/profile/'\n"
    "runs = get(profile + 'runs')\n"
    "assert runs == [run], ('runs', runs)\n"
    "tools = get(profile + 'run_tools', run=run)\n"
    "assert 'trace_viewer#' in tools, ('no trace viewer for the run; tools:', tools)\n"
    "hosts = get(profile + 'hosts', run=run, tag='trace_viewer#')\n"
    "assert hosts == [{'hostname': host}], ('hosts', hosts)\n"
    "events = get(profile + 'data', run=run, tag='trace_viewer#', host=host)\n"
    "assert events == json.load(open(trace)), 'the trace viewer gets other events'\n"
    "print('read')\n";

/* The run's trace, read by TensorBoard's profile plugin (a version that
   reads <host>.trace.json.gz: tensorboard-plugin-profile 2.19.0 and
   earlier; later ones read only XSpace protobufs, <host>.xplane.pb). */
/* Gradient accumulation (3 batches, clipping the mean) under the profiler,
   whose update runs layer by layer, each on a copy of the step's record:
   steps 2..6 profiled (accumulating and applying ones) train bit for bit
   as unprofiled. */
static void test_accumulation_profiled(void) {
    mpt_dataset *data = blobs_in(ctx);
    mpt_model *plain = make_model(ctx), *profiled = make_model(ctx);
    mpt_compile_desc cd = {.optimizer = {.learning_rate = 0.01f, .clip_global_norm = 0.5f,
                                         .gradient_accumulation_steps = 3},
                           .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}};
    mpt_fit_desc f = fit_desc(1);
    char dir[300];
    CHECK(mpt_model_compile(plain, &cd) == MPT_OK && mpt_model_compile(profiled, &cd) == MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(plain, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    profile_steps(&f, dir, sizeof dir, "accumulating", 2, 6);
    CHECK(mpt_model_fit(profiled, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(test_same_weights(plain, profiled), "profiled weights differ from the unprofiled run's");
    CHECK(plain->optimizer_steps == 2 && profiled->optimizer_steps == 2 &&
              plain->accumulated_steps == 1 && profiled->accumulated_steps == 1,
          "7 batches: %lld/%lld updates, %lld/%lld in the sum", (long long)plain->optimizer_steps,
          (long long)profiled->optimizer_steps, (long long)plain->accumulated_steps,
          (long long)profiled->accumulated_steps);
    mpt_model_destroy(plain);
    mpt_model_destroy(profiled);
    mpt_dataset_destroy(data);
}

static void test_tensorboard_reads_trace(void) {
    mpt_dataset *data = blobs_in(ctx);
    mpt_model *m = make_model(ctx);
    mpt_fit_desc f = fit_desc(1);
    char dir[300], plugin[400], run[700], trace[1200], script[400], cmd[3000], line[512];
    char last[512] = "";
    const char *run_name;
    struct utsname names;
    FILE *fp;
    int read = 0;
    if (!test_python_imports("tensorboard_plugin_profile, werkzeug")) goto done;
    profile_steps(&f, dir, sizeof dir, "tensorboard", 2, 3);
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    snprintf(plugin, sizeof plugin, "%s/plugins/profile", dir);
    if (!only_entry(plugin, run, sizeof run)) {
        CHECK(0, "one run directory in %s", plugin);
        goto done;
    }
    run_name = strrchr(run, '/') + 1;
    uname(&names);
    snprintf(trace, sizeof trace, "%s/%s.trace.json", run, names.nodename);
    snprintf(script, sizeof script, "%s/read_profile.py", tmpdir);
    fp = fopen(script, "w");
    if (!fp) goto done;
    fputs(tensorboard_py, fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' '%s' '%s' '%s' 2>&1", test_python(), script, dir,
             run_name, names.nodename, trace);
    fp = popen(cmd, "r");
    if (!fp) goto done;
    while (fgets(line, sizeof line, fp)) {
        line[strcspn(line, "\n")] = 0;
        if (strcmp(line, "read") == 0) read = 1;
        else if (line[0]) snprintf(last, sizeof last, "%s", line); /* the reason, if it fails */
    }
    CHECK(pclose(fp) == 0 && read, "TensorBoard's profile plugin reads %s.gz: %s (%s)", trace,
          last, cmd);
done:
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
}

/* Conv2D → BatchNormalization → MaxPooling2D → Flatten → Dense(softmax),
   mixed_bfloat16 with dynamic loss scaling, SGD with momentum. */
static mpt_model *make_conv_model(mpt_context *c) {
    mpt_model *m = NULL;
    mpt_model_desc md;
    mpt_compile_desc cd;
    memset(&md, 0, sizeof md);
    md.input_shape[0] = 8;
    md.input_shape[1] = 8;
    md.input_shape[2] = 2;
    md.input_rank = 3;
    md.policy = MPT_POLICY_MIXED_BFLOAT16;
    md.seed = 3;
    CHECK(mpt_model_create(c, &md, &m) == MPT_OK, "create: %s", mpt_context_error(c));
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 8, .kernel_size = {3, 3},
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_max_pooling2d(m, NULL);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_SOFTMAX});
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_SGD;
    cd.optimizer.learning_rate = 0.05f;
    cd.optimizer.momentum = 0.9f;
    cd.loss.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.loss_scale.mode = MPT_LOSS_SCALE_DYNAMIC;
    CHECK(mpt_model_compile(m, &cd) == MPT_OK, "compile: %s", mpt_context_error(c));
    return m;
}

static void test_conv_mixed_precision(void) {
    enum { N = 96 };
    static float x[N * 8 * 8 * 2];
    static int32_t y[N];
    mpt_tensor tx, ty;
    mpt_dataset *data = NULL;
    mpt_model *plain, *profiled;
    mpt_fit_desc f = fit_desc(2); /* 3 steps an epoch */
    char dir[300], prefix[1100];
    trace_read r;
    int64_t i;
    int k;
    if (!test_python_imports("json, gzip")) return;
    for (i = 0; i < N * 8 * 8 * 2; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < N; i++) y[i] = test_randint(0, 3);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){N, 8, 8, 2}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N}, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    plain = make_conv_model(ctx);
    profiled = make_conv_model(ctx);
    CHECK(mpt_model_fit(plain, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    profile_steps(&f, dir, sizeof dir, "conv", 2, 4);
    CHECK(mpt_model_fit(profiled, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    read_run_trace(dir, prefix, sizeof prefix, &r);
    CHECK(r.ok && r.n >= 3, "the trace %s.trace.json parses: %s", prefix,
          r.n ? r.lines[r.n - 1] : "");
    for (k = 0; k < 3 && k < r.n; k++) {
        char want[256];
        snprintf(want, sizeof want, "step %d fwd=conv2d,batch_normalization,max_pooling2d,flatten,"
                 "dense bwd=dense,flatten,max_pooling2d,batch_normalization,conv2d "
                 "upd=conv2d,batch_normalization,dense nested=1 nonneg=1 loss=", 2 + k);
        CHECK(strncmp(r.lines[k], want, strlen(want)) == 0, "got '%s', want '%s...'",
              r.lines[k], want);
    }
    CHECK(test_same_weights(plain, profiled) && plain->loss_scale == profiled->loss_scale &&
              plain->step == profiled->step,
          "profiled weights (moving statistics among them), loss scale and steps equal the "
          "unprofiled run's");
    mpt_model_destroy(plain);
    mpt_model_destroy(profiled);
    mpt_dataset_destroy(data);
}

static void test_bad_ranges(void) {
    mpt_context *q = quiet_ctx();
    mpt_dataset *data = blobs_in(q);
    mpt_model *m = make_model(q);
    static const int64_t ranges[][2] = {{0, 3}, {-1, 2}, {5, 3}, {1, 15}, {14, 15}};
    size_t i;
    for (i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        mpt_fit_desc f = fit_desc(2); /* 14 steps */
        mpt_status s;
        f.profile_batch[0] = ranges[i][0];
        f.profile_batch[1] = ranges[i][1];
        f.profile_dir = tmpdir;
        s = mpt_model_fit(m, data, &f);
        CHECK(s == MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(q), "profile_batch"),
              "{%lld, %lld}: status %d, '%s'", (long long)ranges[i][0], (long long)ranges[i][1],
              (int)s, mpt_context_error(q));
        if (i == 3)
            CHECK(strstr(mpt_context_error(q), "14 steps") != NULL, "names the run's steps: %s",
                  mpt_context_error(q));
    }
    {
        mpt_fit_desc f = fit_desc(1);
        f.profile_batch[0] = f.profile_batch[1] = 2;
        CHECK(mpt_model_fit(m, data, &f) == MPT_ERR_INVALID_ARGUMENT &&
                  strstr(mpt_context_error(q), "profile_dir"),
              "no profile_dir: %s", mpt_context_error(q));
    }
    CHECK(mpt_model_history(m, &(mpt_history){0}) == MPT_OK && m->optimizer_steps == 0,
          "nothing trained: %lld optimizer steps", (long long)m->optimizer_steps);
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

static void test_unwritable_directory(void) {
    mpt_context *q = warning_ctx(1);
    mpt_dataset *data = blobs_in(q);
    mpt_model *m = make_model(q);
    mpt_fit_desc f = fit_desc(1);
    char file[300], dir[400];
    FILE *fp;
    snprintf(file, sizeof file, "%s/a_file", tmpdir);
    fp = fopen(file, "w");
    if (fp) fclose(fp);
    snprintf(dir, sizeof dir, "%s/logs", file); /* under a file: never a directory */
    f.profile_batch[0] = 2;
    f.profile_batch[1] = 3;
    f.profile_dir = dir;
    count_warnings = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "training goes on: %s", mpt_context_error(q));
    CHECK(count_warnings == 1 && m->optimizer_steps == 7, "one warning (%d), 7 steps (%lld)",
          count_warnings, (long long)m->optimizer_steps);
    f.profile_fail_on_error = 1;
    CHECK(mpt_model_fit(m, data, &f) == MPT_ERR_IO && strstr(mpt_context_error(q), dir),
          "asked to: fit stops, naming the directory: %s", mpt_context_error(q));
    CHECK(m->optimizer_steps == 7, "before training: %lld", (long long)m->optimizer_steps);
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

/* The trace's files go through the writer every file goes through: a
   symlink planted at the old fixed temporary name "<path>.tmp" is never
   written through (its target keeps its bytes), what a killed run left
   ("<path>.tmp-<pid>", unlocked) is swept, and a write leaves only the
   file, whole (the gzip'd copy reads back). */
#define PROFILE_WRITE(path, text, gz) mpt__profile_write(ctx, path, text, strlen(text), gz)
static void test_trace_files_crash_safe(void) {
    const char *text = "{\"traceEvents\": []}";
    char dir[300], path[400], planted[420], victim[400], stale[420], got[64];
    int gz;
    FILE *fp;
    snprintf(dir, sizeof dir, "%s/crash", tmpdir);
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    for (gz = 0; gz < 2; gz++) {
        snprintf(path, sizeof path, "%s/host.trace.json%s", dir, gz ? ".gz" : "");
        snprintf(planted, sizeof planted, "%s.tmp", path);
        snprintf(stale, sizeof stale, "%s.tmp-1", path); /* pid 1 holds no lock on it */
        snprintf(victim, sizeof victim, "%s/victim%d", dir, gz);
        fp = fopen(victim, "w");
        if (fp) {
            fputs("keep", fp);
            fclose(fp);
        }
        fp = fopen(stale, "w");
        if (fp) {
            fputs("half a trace", fp);
            fclose(fp);
        }
        CHECK(symlink(victim, planted) == 0, "symlink %s", planted);
        CHECK(PROFILE_WRITE(path, text, gz) == 0, "write %s", path);
        fp = fopen(victim, "r");
        CHECK(fp && fgets(got, sizeof got, fp) && strcmp(got, "keep") == 0,
              "written through the link planted at %s", planted);
        if (fp) fclose(fp);
        CHECK(access(stale, F_OK) != 0, "%s, left by a killed run, is still there", stale);
        if (gz) {
            gzFile z = gzopen(path, "rb");
            int n = z ? gzread(z, got, sizeof got - 1) : -1;
            if (z) gzclose(z);
            CHECK(n == (int)strlen(text) && memcmp(got, text, (size_t)n) == 0, "%s reads back",
                  path);
        } else {
            fp = fopen(path, "r");
            CHECK(fp && fgets(got, sizeof got, fp) && strcmp(got, text) == 0, "%s reads back",
                  path);
            if (fp) fclose(fp);
        }
        remove(planted);
        remove(stale);
        remove(path);
        remove(victim);
    }
    rmdir(dir);
}

/* Each run writes a new directory, so what a killed run left in its own
   is swept by the next profiled fit into the same profile_dir. */
static void test_killed_runs_swept(void) {
    char dir[300], old_run[400], left[3][500];
    static const char *const names[3] = {".trace.json.tmp-1", ".layers.txt.tmp-1-2",
                                         ".trace.json.gz.tmp-1"};
    const char *host = "localhost";
    struct utsname u;
    mpt_dataset *data = blobs_in(ctx);
    mpt_model *m = make_model(ctx);
    mpt_fit_desc f = fit_desc(1);
    int k;
    FILE *fp;
    if (uname(&u) == 0 && u.nodename[0]) host = u.nodename;
    snprintf(dir, sizeof dir, "%s/swept", tmpdir);
    snprintf(old_run, sizeof old_run, "%s/plugins/profile/2000_01_01_00_00_00", dir);
    CHECK(mpt__tb_mkdirs(old_run) == 0, "mkdir %s", old_run);
    for (k = 0; k < 3; k++) {
        snprintf(left[k], sizeof left[k], "%s/%s%s", old_run, host, names[k]);
        fp = fopen(left[k], "w");
        if (fp) {
            fputs("half a file", fp);
            fclose(fp);
        }
    }
    f.profile_batch[0] = 2;
    f.profile_batch[1] = 3;
    f.profile_dir = dir;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    for (k = 0; k < 3; k++)
        CHECK(access(left[k], F_OK) != 0, "%s, left by a killed run, is still there", left[k]);
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
}

/* A callback that stops training after batch `at` (0-based, in an epoch). */
static mpt_status stop_at(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                          int *stop) {
    (void)m;
    (void)logs;
    if (batch == *(int64_t *)user) *stop = 1;
    return MPT_OK;
}

static void test_run_ends_early(void) {
    mpt_context *q = warning_ctx(1);
    mpt_dataset *data = blobs_in(q);
    mpt_model *m = make_model(q);
    mpt_fit_desc f = fit_desc(1);
    mpt_callback cb;
    int64_t at = 3;
    char dir[300], prefix[1100];
    trace_read r;
    if (!test_python_imports("json")) goto done;
    memset(&cb, 0, sizeof cb);
    cb.on_batch_end = stop_at;
    cb.user_data = &at;
    profile_steps(&f, dir, sizeof dir, "early", 3, 6);
    f.callbacks = &cb;
    f.n_callbacks = 1;
    count_warnings = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(count_warnings == 1, "a warning that the range was cut short (%d)", count_warnings);
    read_run_trace(dir, prefix, sizeof prefix, &r);
    CHECK(r.ok && r.n >= 2 && !strncmp(r.lines[0], "step 3 ", 7) && !strncmp(r.lines[1], "step 4 ", 7) &&
              strncmp(r.lines[2], "step", 4) != 0,
          "steps 3 and 4 only: '%s' '%s'", r.lines[0], r.lines[1]);
done:
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_trace_per_layer);
    TEST_RUN(test_tensorboard_reads_trace);
    TEST_RUN(test_conv_mixed_precision);
    TEST_RUN(test_bad_ranges);
    TEST_RUN(test_unwritable_directory);
    TEST_RUN(test_trace_files_crash_safe);
    TEST_RUN(test_killed_runs_swept);
    TEST_RUN(test_run_ends_early);
    TEST_RUN(test_accumulation_profiled);
}

int main(void) {
    static const test_program p = {.name = "test_profiler", .ctx = &ctx, .threads = 2,
                                   .setup = make_blobs, .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir, .cases = run_cases};
    return test_main(&p);
}

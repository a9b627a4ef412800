/* The TensorBoard callback: the CRC-32C and TFRecord framing against known
   bytes, then a short fit whose event files TensorBoard's own reader
   (tensorboard's EventAccumulator, run through $MPT_TEST_PYTHON) reads
   back, checked tag by tag against the history, the batch logs, the
   weights and gradients; files cut at random bytes as a killed run leaves
   them; bad descriptors; and a write that fails mid-training. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

#include <dirent.h>
#include <sys/stat.h>

static mpt_context *ctx;
static char tmpdir[128];
static int warnings;
static char last_warning[1024];

static void capture_log(void *user, mpt_log_level level, const char *message) {
    (void)user;
    if (level == MPT_LOG_WARNING) {
        warnings++;
        snprintf(last_warning, sizeof last_warning, "%s", message);
    }
}

static void print_nothing(void *user, const char *text) {
    (void)user;
    (void)text;
}

static char *tmp_path(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", tmpdir, name);
    return buf;
}

/* ---- CRC-32C and the framing ------------------------------------------------------ */

static void test_crc32c_vectors(void) {
    unsigned char zeros[32], ones[32], up[32];
    int i;
    memset(zeros, 0, sizeof zeros);
    memset(ones, 0xff, sizeof ones);
    for (i = 0; i < 32; i++) up[i] = (unsigned char)i;
    /* the check value, and RFC 3720's (iSCSI) test vectors */
    CHECK(mpt__crc32c("123456789", 9) == 0xE3069283u, "crc of 123456789: %08x",
          mpt__crc32c("123456789", 9));
    CHECK(mpt__crc32c(zeros, 32) == 0x8A9136AAu, "crc of 32 zeros: %08x", mpt__crc32c(zeros, 32));
    CHECK(mpt__crc32c(ones, 32) == 0x62A8AB43u, "crc of 32 0xff: %08x", mpt__crc32c(ones, 32));
    CHECK(mpt__crc32c(up, 32) == 0x46DD794Eu, "crc of 0..31: %08x", mpt__crc32c(up, 32));
    CHECK(mpt__crc32c("", 0) == 0, "crc of nothing: %08x", mpt__crc32c("", 0));
}

/* Event { wall_time: 1.5, step: 3, file_version: "brain.Event:2" } framed as
   a TFRecord, the bytes as tensorboard's protobuf and masked_crc32c make them. */
static void test_framing(void) {
    static const unsigned char expected[42] = {
        0x1a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12, 0x9b, 0xd8, 0x2d, 0x09, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x10, 0x03, 0x1a, 0x0d, 0x62, 0x72, 0x61,
        0x69, 0x6e, 0x2e, 0x45, 0x76, 0x65, 0x6e, 0x74, 0x3a, 0x32, 0xe3, 0xc0, 0xb9, 0x5c};
    mpt__pb b;
    int i, first = -1;
    memset(&b, 0, sizeof b);
    b.ctx = ctx;
    mpt__tb_event_begin(&b, 3);
    b.size = MPT__TB_HEADER; /* the header, without event_begin's wall time */
    mpt__pb_double(&b, 1, 1.5);
    mpt__pb_int64(&b, 2, 3);
    mpt__pb_string(&b, 3, "brain.Event:2");
    mpt__tb_frame(&b);
    CHECK(!b.failed && b.size == sizeof expected, "record of %zu bytes", b.size);
    for (i = 0; i < (int)sizeof expected && i < (int)b.size && first < 0; i++)
        if (b.data[i] != expected[i]) first = i;
    CHECK(first < 0, "byte %d is %02x, expected %02x", first, first < 0 ? 0 : b.data[first],
          first < 0 ? 0 : expected[first]);
    mpt__free(ctx, b.data);
}

/* Embedded messages of every length class: the varint in front of a body
   of 127, 128 and 16384 bytes takes 1, 2 and 3 bytes. */
static void test_nested_lengths(void) {
    static const size_t sizes[3] = {127, 128, 16384};
    static const size_t header[3] = {1, 2, 3};
    int k;
    for (k = 0; k < 3; k++) {
        mpt__pb b;
        size_t body, i, n = 0;
        unsigned char *filler = (unsigned char *)malloc(sizes[k]);
        memset(&b, 0, sizeof b);
        b.ctx = ctx;
        for (i = 0; i < sizes[k]; i++) filler[i] = (unsigned char)test_randint(0, 255);
        mpt__pb_int64(&b, 1, 7);
        body = mpt__pb_begin(&b, 5);
        mpt__pb_bytes(&b, filler, sizes[k]);
        mpt__pb_end(&b, body);
        CHECK(!b.failed && b.size == 2 + 1 + header[k] + sizes[k], "size %zu for %zu bytes",
              b.size, sizes[k]);
        for (i = 0; i < header[k] && !b.failed; i++)
            n |= (size_t)(b.data[3 + i] & 0x7f) << (7 * i);
        CHECK(n == sizes[k] && b.data[2] == 0x2a, "length %zu, key %02x", n, b.data[2]);
        CHECK(!b.failed && memcmp(b.data + 3 + header[k], filler, sizes[k]) == 0,
              "the body moved intact");
        mpt__free(ctx, b.data);
        free(filler);
    }
}

static void test_bucket_limits(void) {
    double limit[MPT__TB_BUCKETS], v = 1e-12;
    int i, ascending = 1;
    mpt__tb_bucket_limits(limit);
    for (i = 1; i < MPT__TB_BUCKETS; i++) ascending &= limit[i - 1] < limit[i];
    CHECK(ascending, "limits ascend");
    CHECK(limit[0] == -DBL_MAX && limit[MPT__TB_BUCKETS - 1] == DBL_MAX && limit[775] == 0,
          "ends %g %g, middle %g", limit[0], limit[MPT__TB_BUCKETS - 1], limit[775]);
    for (i = 776; i < MPT__TB_BUCKETS - 1; i++, v *= 1.1)
        if (limit[i] != v || limit[1550 - i] != -v) break;
    CHECK(i == MPT__TB_BUCKETS - 1 && v >= 1e20 && v / 1.1 < 1e20,
          "limit %d differs from 1e-12 * 1.1^k", i);
}

/* TensorFlow's Histogram::Add: a value goes to the first bucket whose
   limit is above it, so one equal to a limit goes to the next bucket. NaN
   is left out; inf lands in the outermost bucket on its side. */
static void test_histogram_buckets(void) {
    static mpt__tb_hist h;
    double limit[MPT__TB_BUCKETS];
    const float one = 1.0f, zero = 0.0f;
    float special[3];
    int i, filled = 0;
    mpt__tb_bucket_limits(limit);
    special[0] = NAN;
    special[1] = INFINITY;
    special[2] = -INFINITY;
    mpt__tb_hist_clear(&h);
    CHECK(h.min == DBL_MAX && h.max == -DBL_MAX, "empty: min %g max %g", h.min, h.max);
    mpt__tb_hist_add(&h, limit, &one, 1, limit[800]);     /* exactly a limit */
    mpt__tb_hist_add(&h, limit, &one, 1, limit[900] * 1.01); /* inside a bucket */
    mpt__tb_hist_add(&h, limit, &zero, 1, 1.0);
    mpt__tb_hist_add(&h, limit, &one, 1, -DBL_MAX);
    CHECK(h.count[801] == 1 && h.count[901] == 1 && h.count[776] == 1 && h.count[1] == 1,
          "buckets %g %g %g %g", h.count[801], h.count[901], h.count[776], h.count[1]);
    CHECK(h.num == 4 && h.min == -DBL_MAX && h.max == limit[900] * 1.01, "num %g min %g max %g",
          h.num, h.min, h.max);
    mpt__tb_hist_add(&h, limit, special, 3, 1.0);
    CHECK(h.num == 6 && h.count[MPT__TB_BUCKETS - 1] == 1 && h.count[0] == 1,
          "inf and -inf counted at the ends, NaN left out: num %g", h.num);
    /* collapsed: empty runs become one bucket ending at the run's last limit */
    mpt__tb_hist_collapse(&h, limit);
    for (i = 0; i < h.n_out; i++) filled += h.out_count[i] > 0;
    CHECK(filled == 6 && h.n_out == 6 + 4 && h.out_limit[h.n_out - 1] == DBL_MAX &&
              h.out_limit[1] == limit[1] && h.out_limit[2] == limit[775] &&
              h.out_limit[3] == limit[776],
          "%d buckets, %d filled", h.n_out, filled);
}

/* ---- a short fit, read back by TensorBoard -------------------------------------- */

#define N_TRAIN 16
#define N_VAL 8
#define BATCH 4
#define EPOCHS 3
#define MAX_BATCH_EVENTS 16

/* What on_batch_end saw, to compare with the batch scalars. */
typedef struct batch_record {
    int64_t count;                        /* batches so far           */
    int n;
    int64_t step[MAX_BATCH_EVENTS];
    double loss[MAX_BATCH_EVENTS], accuracy[MAX_BATCH_EVENTS];
} batch_record;

static mpt_status record_batch(void *user, mpt_model *m, int64_t batch, const mpt_logs *logs,
                               int *stop) {
    batch_record *r = (batch_record *)user;
    (void)m;
    (void)batch;
    (void)stop;
    r->count++;
    if (r->count % 2 == 0 && r->n < MAX_BATCH_EVENTS) {
        r->step[r->n] = r->count;
        r->loss[r->n] = mpt_logs_get(logs, "loss");
        r->accuracy[r->n] = mpt_logs_get(logs, "accuracy");
        r->n++;
    }
    return MPT_OK;
}

static mpt_dataset *random_dataset(int64_t n, float *x, int32_t *y) {
    int64_t xs[2] = {n, 3}, ys[1] = {n};
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    int64_t i;
    for (i = 0; i < 3 * n; i++) x[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < n; i++) y[i] = test_randint(0, 1);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, xs, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, y);
    if (mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty, .copy = 1}, &d) != MPT_OK)
        return NULL;
    return d;
}

/* input 3 -> Dense 5 (relu) -> Dense 2 (softmax) in mixed_float16, whose
   dynamic loss scale doubles every 4 steps: each epoch's last step grows
   it, so the gradients at an epoch's end are scaled by half the scale the
   model then holds. */
static mpt_model *small_model(int seed) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1,
                                             .policy = MPT_POLICY_MIXED_FLOAT16, .seed = seed},
                     &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .activation = MPT_ACT_SOFTMAX});
    if (mpt_model_compile(m, &(mpt_compile_desc){
            .optimizer = {.type = MPT_OPTIMIZER_ADAM},
            .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
            .metrics = MPT_METRIC_ACCURACY,
            .loss_scale = {.mode = MPT_LOSS_SCALE_DYNAMIC, .initial_scale = 256,
                           .growth_interval = BATCH}}) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* The reader: loads both runs with EventAccumulator and checks them
   against expect.py (written below), then cuts the train file at the
   offsets given and checks that each cut file reads with exactly the
   events of the whole records before the cut. */
static const char *const reader_script =
    "import sys, os, re, struct, shutil, numpy as np\n"
    "from safetensors.numpy import load_file\n"
    "from tensorboard.backend.event_processing import event_accumulator as ea\n"
    "from tensorboard.compat.proto import event_pb2\n"
    "log_dir, weights, expect, cuts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]\n"
    "E = {}\n"
    "exec(open(expect).read(), E)\n"
    "def load(path):\n"
    "    a = ea.EventAccumulator(path, size_guidance={'scalars': 0, 'histograms': 0, 'tensors': 0})\n"
    "    a.Reload()\n"
    "    return a\n"
    "def one_file(run):\n"
    "    names = os.listdir(os.path.join(log_dir, run))\n"
    "    assert len(names) == 1, names\n"
    "    m = re.fullmatch(r'events\\.out\\.tfevents\\.(\\d{10})\\.(.+)\\.(\\d+)\\.(\\d+)', names[0])\n"
    "    assert m and int(m.group(3)) == E['pid'] and m.group(4) == '0', names[0]\n"
    "    return os.path.join(log_dir, run, names[0])\n"
    "runs = {r: load(os.path.join(log_dir, r)) for r in ('train', 'validation')}\n"
    "for r in runs:\n"
    "    one_file(r)\n"
    "    assert runs[r].file_version == 2.0, runs[r].file_version\n"
    "# scalars: every tag, step and value\n"
    "for run, tags in E['scalars'].items():\n"
    "    got = runs[run].Tags()['scalars']\n"
    "    assert sorted(got) == sorted(tags), (run, sorted(got), sorted(tags))\n"
    "    for tag, points in tags.items():\n"
    "        ev = runs[run].Scalars(tag)\n"
    "        assert [e.step for e in ev] == [p[0] for p in points], (run, tag, ev)\n"
    "        for e, (step, v) in zip(ev, points):\n"
    "            assert e.value == float(np.float32(v)), (run, tag, step, e.value, v)\n"
    "# histograms: the weights' at the last epoch bucket by bucket, every one's count\n"
    "limits = [1e-12]\n"
    "while limits[-1] * 1.1 < 1e20:\n"
    "    limits.append(limits[-1] * 1.1)\n"
    "limits = np.array([-1.7976931348623157e308] + [-v for v in reversed(limits)] + [0.0]\n"
    "                  + limits + [1.7976931348623157e308])\n"
    "assert len(limits) == 1551\n"
    "def tf_histogram(v):\n"
    "    counts = np.bincount(np.searchsorted(limits, v, side='right'), minlength=len(limits))\n"
    "    lim, cnt, i = [], [], 0\n"
    "    while i < len(limits):\n"
    "        end, c = limits[i], counts[i]\n"
    "        i += 1\n"
    "        if c <= 0:\n"
    "            while i < len(limits) and counts[i] <= 0:\n"
    "                end, c = limits[i], counts[i]\n"
    "                i += 1\n"
    "        lim.append(end)\n"
    "        cnt.append(float(c))\n"
    "    return lim, cnt\n"
    "W = load_file(weights)\n"
    "tr = runs['train']\n"
    "assert sorted(tr.Tags()['histograms']) == sorted(E['histograms']), tr.Tags()['histograms']\n"
    "for tag, (count, last_sum) in E['histograms'].items():\n"
    "    ev = tr.Histograms(tag)\n"
    "    assert [e.step for e in ev] == list(range(E['epochs'])), (tag, [e.step for e in ev])\n"
    "    for e in ev:\n"
    "        h = e.histogram_value\n"
    "        assert h.num == count and sum(h.bucket) == count, (tag, h.num, count)\n"
    "    h = ev[-1].histogram_value\n"
    "    assert abs(h.sum - last_sum) <= 1e-6 * max(1.0, abs(last_sum)), (tag, h.sum, last_sum)\n"
    "    if tag in W:\n"
    "        v = W[tag].astype(np.float64).ravel()\n"
    "        assert h.min == v.min() and h.max == v.max(), (tag, h.min, h.max)\n"
    "        assert h.sum == sum(v.tolist()) and h.sum_squares == sum((v * v).tolist()), tag\n"
    "        lim, cnt = tf_histogram(v)\n"
    "        assert list(h.bucket_limit) == lim and list(h.bucket) == cnt, tag\n"
    "# the model summary, as a text tensor at step 0\n"
    "assert tr.Tags()['tensors'] == ['model_summary'], tr.Tags()['tensors']\n"
    "t = tr.Tensors('model_summary')\n"
    "assert len(t) == 1 and t[0].step == 0, t\n"
    "assert tr.SummaryMetadata('model_summary').plugin_data.plugin_name == 'text'\n"
    "text = t[0].tensor_proto.string_val[0].decode()\n"
    "table = open(E['summary']).read()\n"
    "assert text == ''.join('    ' + line for line in table.splitlines(True)), text\n"
    "# cut files: the events of the whole records before the cut, and no more\n"
    "data = open(one_file('train'), 'rb').read()\n"
    "ends, at = [], 0\n"
    "while at < len(data):\n"
    "    (n,) = struct.unpack('<Q', data[at:at + 8])\n"
    "    at += 16 + n\n"
    "    ends.append(at)\n"
    "assert ends[-1] == len(data), (ends[-1], len(data))\n"
    "def counts(acc):\n"
    "    tags = acc.Tags()\n"
    "    return (sum(len(acc.Scalars(t)) for t in tags['scalars']),\n"
    "            sum(len(acc.Histograms(t)) for t in tags['histograms']),\n"
    "            sum(len(acc.Tensors(t)) for t in tags['tensors']))\n"
    "def counts_of_records(blob):\n"
    "    s = h = t = 0\n"
    "    at = 0\n"
    "    while at < len(blob):\n"
    "        (n,) = struct.unpack('<Q', blob[at:at + 8])\n"
    "        e = event_pb2.Event.FromString(blob[at + 12:at + 12 + n])\n"
    "        for v in e.summary.value:\n"
    "            k = v.WhichOneof('value')\n"
    "            s, h, t = s + (k == 'simple_value'), h + (k == 'histo'), t + (k == 'tensor')\n"
    "        at += 16 + n\n"
    "    return s, h, t\n"
    "cut_dir = os.path.join(log_dir, 'cut')\n"
    "for c in map(int, cuts):\n"
    "    shutil.rmtree(cut_dir, ignore_errors=True)\n"
    "    os.makedirs(cut_dir)\n"
    "    with open(os.path.join(cut_dir, 'events.out.tfevents.0.cut'), 'wb') as f:\n"
    "        f.write(data[:c])\n"
    "    whole = max([e for e in ends if e <= c], default=0)\n"
    "    got, want = counts(load(cut_dir)), counts_of_records(data[:whole])\n"
    "    assert got == want, ('cut at', c, 'of', len(data), got, want)\n"
    "shutil.rmtree(cut_dir)\n"
    "print('read back', len(data), 'bytes,', len(ends), 'records,', len(cuts), 'cuts')\n";

/* expect.py: what the reader must find, from the history, the batch
   logs and the model after fit. Doubles as %.17g read back exactly. */
static void write_expectations(const char *path, mpt_model *m, const batch_record *batches,
                               const char *summary_path) {
    mpt_history h;
    FILE *f = fopen(path, "w");
    int k, e, run, i, n;
    if (!f || mpt_model_history(m, &h) != MPT_OK) {
        CHECK(0, "cannot write %s", path);
        if (f) fclose(f);
        return;
    }
    fprintf(f, "pid = %d\nepochs = %d\nsummary = '%s'\n", (int)getpid(), EPOCHS, summary_path);
    fprintf(f, "scalars = {'train': {}, 'validation': {}}\n");
    for (run = 0; run < 2; run++)
        for (k = 0; k < h.n_keys; k++) {
            const char *key = h.keys[k];
            int val = strncmp(key, "val_", 4) == 0;
            if (val != run) continue;
            /* fit's epoch_seconds is its own tag, not epoch_epoch_seconds */
            fprintf(f, "scalars['%s']['%s%s'] = [", run ? "validation" : "train",
                    strncmp(key, "epoch_", 6) == 0 ? "" : "epoch_", val ? key + 4 : key);
            for (e = 0; e < h.epochs; e++) fprintf(f, "(%d, %.17g), ", e, h.values[k][e]);
            fprintf(f, "]\n");
        }
    fprintf(f, "scalars['train']['batch_loss'] = [");
    for (i = 0; i < batches->n; i++)
        fprintf(f, "(%lld, %.17g), ", (long long)batches->step[i], batches->loss[i]);
    fprintf(f, "]\nscalars['train']['batch_accuracy'] = [");
    for (i = 0; i < batches->n; i++)
        fprintf(f, "(%lld, %.17g), ", (long long)batches->step[i], batches->accuracy[i]);
    fprintf(f, "]\nhistograms = {}\n");
    /* The last step grew the scale (4 steps an epoch, growth_interval 4):
       it ran with half the scale the model holds now. */
    n = mpt_model_param_count(m);
    for (i = 0; i < n; i++) {
        mpt_param_info p;
        double sum = 0, grad_sum = 0;
        int64_t j, count;
        mpt_model_param(m, i, &p);
        count = mpt_tensor_count(&p.value);
        for (j = 0; j < count; j++) sum += ((const float *)p.value.data)[j];
        fprintf(f, "histograms['%s'] = (%lld, %.17g)\n", p.name, (long long)count, sum);
        if (!p.grad.data) continue;
        for (j = 0; j < count; j++) grad_sum += ((const float *)p.grad.data)[j];
        fprintf(f, "histograms['%s_grad'] = (%lld, %.17g)\n", p.name, (long long)count,
                grad_sum / (mpt_model_loss_scale(m) / 2));
    }
    CHECK(h.epochs == EPOCHS && history_value(m, "loss_scale", EPOCHS - 1) == 256 * 8,
          "%d epochs, loss scale %g (expected 256 doubled at each epoch's end)", h.epochs,
          history_value(m, "loss_scale", EPOCHS - 1));
    fclose(f);
}

static void write_summary(const char *path, const mpt_model *m) {
    char table[8192];
    FILE *f = fopen(path, "w");
    mpt_model_summary(m, table, sizeof table);
    if (f) {
        fputs(table, f);
        fclose(f);
    }
}

/* The size of the one event file in log_dir/train; -1 if none. */
static long long train_file_size(const char *log_dir) {
    char dir[512], path[1024];
    DIR *d;
    struct dirent *e;
    struct stat st;
    long long size = -1;
    snprintf(dir, sizeof dir, "%s/train", log_dir);
    d = opendir(dir);
    while (d && (e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "events.out.tfevents.", 20) == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (stat(path, &st) == 0) size = (long long)st.st_size;
        }
    if (d) closedir(d);
    return size;
}

static void test_fit_read_by_tensorboard(void) {
    float x[3 * N_TRAIN], vx[3 * N_VAL];
    int32_t y[N_TRAIN], vy[N_VAL];
    mpt_dataset *train, *val;
    mpt_model *m;
    mpt_callback cbs[2];
    batch_record batches;
    char log_dir[256], weights[256], expect[256], summary[256], script[256], cmd[2048];
    size_t used;
    long long size;
    int i;
    FILE *f;
    if (!test_python_imports("tensorboard, safetensors.numpy, numpy")) return;
    train = random_dataset(N_TRAIN, x, y);
    val = random_dataset(N_VAL, vx, vy);
    m = small_model(test_randint(1, 1000));
    memset(&batches, 0, sizeof batches);
    memset(cbs, 0, sizeof cbs);
    cbs[1].on_batch_end = record_batch;
    cbs[1].user_data = &batches;
    /* nested: the callback creates what is missing */
    tmp_path(log_dir, sizeof log_dir, "logs/run 1");
    CHECK(train && val && m, "setup: %s", mpt_context_error(ctx));
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){
              .log_dir = log_dir, .histogram_freq = 1, .update_freq_batches = 2}, &cbs[0]) ==
              MPT_OK, "create: %s", mpt_context_error(ctx));
    if (train && val && m)
        CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){
                  .epochs = EPOCHS, .batch_size = BATCH, .validation_data = val,
                  .callbacks = cbs, .n_callbacks = 2}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
    CHECK(batches.n == EPOCHS * N_TRAIN / BATCH / 2, "%d batch records", batches.n);
    if (m && mpt_model_history(m, &(mpt_history){0}) == MPT_OK) {
        tmp_path(weights, sizeof weights, "weights.safetensors");
        CHECK(mpt_model_save_weights(m, weights) == MPT_OK, "save: %s", mpt_context_error(ctx));
        write_summary(tmp_path(summary, sizeof summary, "summary.txt"), m);
        write_expectations(tmp_path(expect, sizeof expect, "expect.py"), m, &batches, summary);
        f = fopen(tmp_path(script, sizeof script, "read.py"), "w");
        if (f) {
            fputs(reader_script, f);
            fclose(f);
        }
        used = (size_t)snprintf(cmd, sizeof cmd, "'%s' %s '%s' %s %s", test_python(), script,
                                log_dir, weights, expect);
        /* cuts inside the first record's header and at random bytes */
        used += (size_t)snprintf(cmd + used, sizeof cmd - used, " 1 11 12 13");
        size = train_file_size(log_dir);
        CHECK(size > 1000, "the train file has %lld bytes", size);
        for (i = 0; i < 24 && used < sizeof cmd && size > 1000; i++)
            used += (size_t)snprintf(cmd + used, sizeof cmd - used, " %d",
                                     test_randint(14, (int)size - 1));
        CHECK(system(cmd) == 0, "TensorBoard's reader disagrees (%s)", cmd);
    }
    mpt_callback_destroy(&cbs[0]);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    mpt_model_destroy(m);
}

/* ---- bad descriptors, failures ------------------------------------------------------ */

static void test_bad_descriptors(void) {
    mpt_callback cb;
    char file[256], under_file[300];
    FILE *f;
    memset(&cb, 0xff, sizeof cb);
    CHECK(mpt_callback_tensorboard(ctx, NULL, &cb) == MPT_ERR_INVALID_ARGUMENT &&
              cb.user_data == NULL && strstr(mpt_context_error(ctx), "log_dir is NULL"),
          "NULL descriptor: %s", mpt_context_error(ctx));
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = ""}, &cb) ==
              MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "log_dir is empty"),
          "empty log_dir: %s", mpt_context_error(ctx));
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = tmpdir,
                                                                .histogram_freq = -1}, &cb) ==
              MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "histogram_freq -1"),
          "negative histogram_freq: %s", mpt_context_error(ctx));
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){
              .log_dir = tmpdir, .update_freq_batches = -2}, &cb) == MPT_ERR_INVALID_ARGUMENT,
          "negative update_freq_batches: %s", mpt_context_error(ctx));
    /* a directory that cannot exist: its parent is a regular file */
    f = fopen(tmp_path(file, sizeof file, "a-file"), "w");
    if (f) fclose(f);
    snprintf(under_file, sizeof under_file, "%s/logs", file);
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = under_file}, &cb) ==
              MPT_ERR_IO && strstr(mpt_context_error(ctx), under_file) && cb.user_data == NULL,
          "log_dir under a file: %s", mpt_context_error(ctx));
    /* a directory that cannot be written, though access() says root may:
       /proc takes no new files; refused when the callback is made */
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = "/proc/mpt-logs/a"},
                                   &cb) == MPT_ERR_IO &&
              strstr(mpt_context_error(ctx), "/proc/mpt-logs/a") && cb.user_data == NULL,
          "log_dir under /proc: %s", mpt_context_error(ctx));
    mpt_callback_destroy(&cb);
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = tmpdir}, NULL) ==
              MPT_ERR_INVALID_ARGUMENT, "NULL out");
    remove(file);
}

/* Replaces the train file's descriptor, at epoch 1, with one that cannot
   be written: every later write fails as a full disk's would. */
static mpt_status break_train_file(void *user, mpt_model *m, int epoch) {
    mpt__cb_tensorboard *t = (mpt__cb_tensorboard *)((mpt_callback *)user)->user_data;
    int fd;
    (void)m;
    if (epoch != 1) return MPT_OK;
    fd = open("/dev/null", O_RDONLY);
    if (fd >= 0) {
        dup2(fd, t->train.fd);
        close(fd);
    }
    return MPT_OK;
}

static void test_write_failure(void) {
    float x[3 * N_TRAIN];
    int32_t y[N_TRAIN];
    mpt_dataset *train = random_dataset(N_TRAIN, x, y);
    char log_dir[256];
    int fail_on_error;
    tmp_path(log_dir, sizeof log_dir, "failing");
    for (fail_on_error = 0; fail_on_error < 2; fail_on_error++) {
        mpt_model *m = small_model(7);
        mpt_callback cbs[2];
        mpt_history h;
        mpt_status s;
        memset(cbs, 0, sizeof cbs);
        CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){
                  .log_dir = log_dir, .fail_on_error = fail_on_error}, &cbs[0]) == MPT_OK,
              "create: %s", mpt_context_error(ctx));
        cbs[1].on_epoch_begin = break_train_file;
        cbs[1].user_data = &cbs[0];
        warnings = 0;
        last_warning[0] = 0;
        s = train && m ? mpt_model_fit(m, train, &(mpt_fit_desc){
                                           .epochs = 3, .batch_size = BATCH,
                                           .callbacks = cbs, .n_callbacks = 2,
                                           .printer = {print_nothing, NULL}})
                       : MPT_ERR_STATE;
        if (!fail_on_error) {
            CHECK(s == MPT_OK && mpt_model_history(m, &h) == MPT_OK && h.epochs == 3,
                  "training goes on: %s", mpt_context_error(ctx));
            CHECK(warnings == 1 && strstr(last_warning, "TensorBoard: cannot write to") &&
                      strstr(last_warning, "/failing/train/events.out.tfevents."),
                  "one warning naming the file (%d): %s", warnings, last_warning);
        } else {
            CHECK(s == MPT_ERR_IO && strstr(mpt_context_error(ctx), "TensorBoard: cannot write to"),
                  "fail_on_error stops fit: %s", mpt_context_error(ctx));
        }
        mpt_callback_destroy(&cbs[0]);
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(train);
}

/* Run names' event files in log_dir/run. */
static int count_files(const char *log_dir, const char *run) {
    char dir[512];
    DIR *d;
    struct dirent *e;
    int n = 0;
    snprintf(dir, sizeof dir, "%s/%s", log_dir, run);
    d = opendir(dir);
    while (d && (e = readdir(d)) != NULL) n += strncmp(e->d_name, "events.out.tfevents.", 20) == 0;
    if (d) closedir(d);
    return n;
}

/* The logs an epoch's end gives (a random loss and val_loss) into *logs,
   and m built for BATCH: 1. Else 0, the failure recorded, m destroyed. */
static int epoch_logs_and_built(mpt_model *m, mpt_logs *logs) {
    memset(logs, 0, sizeof *logs);
    logs->count = 2;
    logs->names[0] = "loss";
    logs->values[0] = test_uniform(0.1, 2);
    logs->names[1] = "val_loss";
    logs->values[1] = test_uniform(0.1, 2);
    if (!m || mpt_model_build(m, BATCH) != MPT_OK) {
        CHECK(0, "model: %s", mpt_context_error(ctx));
        mpt_model_destroy(m);
        return 0;
    }
    return 1;
}

/* The callback driven by hand as fit drives it: making it creates no
   directory, and a worker other than 0 creates and writes nothing (every
   worker makes the callback; worker 0 creates log_dir when fit begins); a
   callback used before on_train_begin says so; each fit starts new files
   (a validation file only once there are val_ logs). */
static void test_workers_and_fits(void) {
    mpt_model *m = small_model(5);
    mpt_strategy other;
    mpt_callback cb;
    mpt_logs logs;
    char parent[256], log_dir[300];
    struct stat st;
    int fit;
    if (!epoch_logs_and_built(m, &logs)) return;
    tmp_path(parent, sizeof parent, "by_hand");
    snprintf(log_dir, sizeof log_dir, "%s/logs", parent);
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = log_dir}, &cb) ==
              MPT_OK, "create: %s", mpt_context_error(ctx));
    CHECK(stat(parent, &st) != 0, "making the callback created %s", parent);
    CHECK(cb.on_batch_end == NULL, "no batch hook without update_freq_batches: fit would "
          "read the running values back every batch");
    CHECK(cb.on_epoch_end(cb.user_data, m, 0, &logs, NULL) == MPT_ERR_STATE &&
              strstr(mpt_context_error(ctx), "before on_train_begin"),
          "before on_train_begin: %s", mpt_context_error(ctx));
    memset(&other, 0, sizeof other);
    other.worker = 1;
    other.workers = 2;
    m->strategy = &other;
    CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK &&
              cb.on_epoch_end(cb.user_data, m, 0, &logs, NULL) == MPT_OK &&
              cb.on_train_end(cb.user_data, m, &logs) == MPT_OK,
          "worker 1: %s", mpt_context_error(ctx));
    CHECK(stat(parent, &st) != 0, "worker 1 created %s", parent);
    m->strategy = NULL;
    for (fit = 1; fit <= 2; fit++) {
        CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK, "%s", mpt_context_error(ctx));
        CHECK(count_files(log_dir, "train") == fit && count_files(log_dir, "validation") == fit - 1,
              "fit %d: before its first epoch, %d train and %d validation files", fit,
              count_files(log_dir, "train"), count_files(log_dir, "validation"));
        CHECK(cb.on_epoch_end(cb.user_data, m, 0, &logs, NULL) == MPT_OK &&
                  cb.on_train_end(cb.user_data, m, &logs) == MPT_OK,
              "%s", mpt_context_error(ctx));
        CHECK(count_files(log_dir, "validation") == fit, "fit %d: %d validation files", fit,
              count_files(log_dir, "validation"));
    }
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* The bytes of the one event file in log_dir/run, malloc'd, into *n;
   NULL if there is none. */
static unsigned char *read_run(const char *log_dir, const char *run, long *n) {
    char dir[512], path[1024];
    unsigned char *data = NULL;
    DIR *d;
    struct dirent *e;
    FILE *f = NULL;
    snprintf(dir, sizeof dir, "%s/%s", log_dir, run);
    d = opendir(dir);
    while (d && !f && (e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "events.out.tfevents.", 20) == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            f = fopen(path, "rb");
        }
    if (d) closedir(d);
    if (f && fseek(f, 0, SEEK_END) == 0 && (*n = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0) {
        data = (unsigned char *)malloc((size_t)*n);
        if (data && fread(data, 1, (size_t)*n, f) != (size_t)*n) {
            free(data);
            data = NULL;
        }
    }
    if (f) fclose(f);
    return data;
}

/* 1 when the event bytes hold a Summary.Value whose tag is exactly tag:
   field 1 (key 0x0a), its length, the tag's bytes. */
static int has_tag(const unsigned char *data, long n, const char *tag) {
    size_t len = strlen(tag);
    long i;
    for (i = 0; i + 2 + (long)len <= n; i++)
        if (data[i] == 0x0a && data[i + 1] == len && memcmp(data + i + 2, tag, len) == 0) return 1;
    return 0;
}

/* Tags as Keras names them, "epoch_" + the log's name, but for fit's
   epoch_seconds, which is "epoch_seconds" rather than
   "epoch_epoch_seconds"; a log of the user's that starts with "epoch_"
   (an output layer named "epoch": epoch_loss) keeps Keras' prefix, so it
   cannot be taken for fit's epoch_loss. */
static void test_epoch_tags(void) {
    mpt_model *m = small_model(11);
    mpt_callback cb;
    mpt_logs logs;
    char log_dir[256];
    unsigned char *train = NULL, *validation = NULL;
    long n_train = 0, n_validation = 0;
    if (!epoch_logs_and_built(m, &logs)) return;
    logs.names[2] = "epoch_seconds";
    logs.values[2] = 1.5;
    logs.names[3] = "epoch_loss";
    logs.values[3] = 0.25;
    logs.count = 4;
    tmp_path(log_dir, sizeof log_dir, "tags");
    CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = log_dir}, &cb) ==
                  MPT_OK &&
              cb.on_train_begin(cb.user_data, m) == MPT_OK &&
              cb.on_epoch_end(cb.user_data, m, 0, &logs, NULL) == MPT_OK &&
              cb.on_train_end(cb.user_data, m, &logs) == MPT_OK,
          "callback: %s", mpt_context_error(ctx));
    train = read_run(log_dir, "train", &n_train);
    validation = read_run(log_dir, "validation", &n_validation);
    CHECK(train && validation, "event files in %s", log_dir);
    CHECK(has_tag(train, n_train, "epoch_seconds") &&
              !has_tag(train, n_train, "epoch_epoch_seconds"),
          "epoch_seconds tagged %s",
          has_tag(train, n_train, "epoch_epoch_seconds") ? "epoch_epoch_seconds" : "otherwise");
    CHECK(has_tag(train, n_train, "epoch_loss") && has_tag(train, n_train, "epoch_epoch_loss"),
          "the loss as epoch_loss, the output \"epoch\"'s as epoch_epoch_loss");
    CHECK(has_tag(validation, n_validation, "epoch_loss") &&
              !has_tag(validation, n_validation, "epoch_seconds"),
          "validation: val_loss as epoch_loss, nothing else");
    free(train);
    free(validation);
    mpt_callback_destroy(&cb);
    mpt_model_destroy(m);
}

/* A run's directory that cannot be made (a regular file holds its name):
   the train run's fails fit before training, naming it; the validation
   run's, found mid-training, warns and training goes on. */
static void test_unusable_runs(void) {
    mpt_model *m = small_model(9);
    mpt_callback cb;
    mpt_logs logs;
    char log_dir[256], blocker[300];
    FILE *f;
    int run;
    if (!epoch_logs_and_built(m, &logs)) return;
    for (run = 0; run < 2; run++) {
        const char *name = run ? "validation" : "train";
        snprintf(log_dir, sizeof log_dir, "%s/blocked_%s", tmpdir, name);
        CHECK(mpt_callback_tensorboard(ctx, &(mpt_tensorboard_desc){.log_dir = log_dir}, &cb) ==
                  MPT_OK, "create: %s", mpt_context_error(ctx));
        snprintf(blocker, sizeof blocker, "%s/%s", log_dir, name);
        mkdir(log_dir, 0700); /* worker 0 would make it when fit begins */
        f = fopen(blocker, "w");
        if (f) fclose(f);
        warnings = 0;
        last_warning[0] = 0;
        if (!run) {
            CHECK(cb.on_train_begin(cb.user_data, m) == MPT_ERR_IO &&
                      strstr(mpt_context_error(ctx), blocker),
                  "train run: %s", mpt_context_error(ctx));
        } else {
            CHECK(cb.on_train_begin(cb.user_data, m) == MPT_OK &&
                      cb.on_epoch_end(cb.user_data, m, 0, &logs, NULL) == MPT_OK &&
                      cb.on_epoch_end(cb.user_data, m, 1, &logs, NULL) == MPT_OK &&
                      cb.on_train_end(cb.user_data, m, &logs) == MPT_OK,
                  "validation run: %s", mpt_context_error(ctx));
            CHECK(warnings == 1 && strstr(last_warning, blocker) && count_files(log_dir, "train") == 1,
                  "one warning naming %s (%d): %s", blocker, warnings, last_warning);
        }
        mpt_callback_destroy(&cb);
    }
    mpt_model_destroy(m);
}

static void run_cases(void) {
    TEST_RUN(test_crc32c_vectors);
    TEST_RUN(test_framing);
    TEST_RUN(test_nested_lengths);
    TEST_RUN(test_bucket_limits);
    TEST_RUN(test_histogram_buckets);
    TEST_RUN(test_fit_read_by_tensorboard);
    TEST_RUN(test_bad_descriptors);
    TEST_RUN(test_write_failure);
    TEST_RUN(test_workers_and_fits);
    TEST_RUN(test_epoch_tags);
    TEST_RUN(test_unusable_runs);
}

int main(void) {
    static const test_program p = {.name = "test_tensorboard", .ctx = &ctx, .threads = 2,
                                   .logger = capture_log, .seed = 23, .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir, .cases = run_cases};
    return test_main(&p);
}

/* =============================================================================
   @impl-checkpoints  safetensors files: the weights and the full training state
   =============================================================================

   The format (safetensors, as the Hugging Face library writes and reads it):
       u64 N, little-endian | N bytes of JSON, space-padded to a multiple of 8 | data
   The JSON maps each tensor's name to {"dtype", "shape", "data_offsets":
   [begin, end]}, byte offsets into the data, which the tensors tile from 0
   without gaps; "__metadata__" is a map of strings. Tensors are
   little-endian and row-major.

   What mpt.h stores, in this order in the data:
       train/optimizer_steps, train/step, train/epoch,       I64, rank 0  } full
       train/good_steps, train/skipped_steps                              } checkpoints
       train/learning_rate, train/loss_scale                 F32, rank 0  } only
       <layer>/<param>                  F32   every parameter, trainable or not
       optimizer/<layer>/<param>/<slot> F32   full checkpoints: "momentum" (SGD),
                                              "m" and "v" (Adam, AdamW)
   The 8-byte scalars come first so that every tensor starts at a multiple of
   its element size (the data starts at 8 + N, a multiple of 8), as a reader
   that maps the file in place wants.

   Saving writes "<path>.tmp-<pid>" beside the target, fsyncs it, renames it
   over the target (atomic on POSIX) and fsyncs the directory, so a crash
   leaves the old file or the new one, never a mix of both. Any failure
   removes the temporary file and leaves the target as it was.

   Loading reads the whole header with a strict JSON reader (a malformed byte
   is reported with its offset in the file), checks the layout of the data,
   then every name, dtype and shape against the model, and the training
   scalars' values, before it writes anything into the model; only then are
   the tensors read into place. A read that fails after all that (the file
   shrank while being read, a disk error) can leave the tensors partly
   loaded; the error says so. */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/types.h>

#define MPT__ST_MAX_HEADER 100000000     /* bytes: the safetensors library's limit */
#define MPT__ST_MAX_RANK 8               /* dimensions a tensor in a file may have  */
#define MPT__CKPT_CHUNK ((size_t)1 << 16) /* bytes staged per write               */
#define MPT__CKPT_NAME 192               /* "optimizer/" + parameter name + "/momentum" */

/* Tests define MPT__CHECKPOINT_FAIL_AFTER_BYTES (before including mpt.h) as
   an expression: while it is >= 0, saving fails with ENOSPC once that many
   bytes of the temporary file are written, as a full disk would. */

/* ---- dtypes a safetensors file may name ----------------------------------- */

typedef enum mpt__st_dtype {
    MPT__ST_BOOL, MPT__ST_U8, MPT__ST_I8, MPT__ST_F8_E5M2, MPT__ST_F8_E4M3,
    MPT__ST_I16, MPT__ST_U16, MPT__ST_F16, MPT__ST_BF16,
    MPT__ST_I32, MPT__ST_U32, MPT__ST_F32,
    MPT__ST_F64, MPT__ST_I64, MPT__ST_U64,
    MPT__ST_DTYPE_COUNT_
} mpt__st_dtype;

static const struct {
    const char *name;
    int size; /* bytes per element */
} mpt__st_dtypes[MPT__ST_DTYPE_COUNT_] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},
    {"I32", 4},  {"U32", 4}, {"F32", 4},
    {"F64", 8},  {"I64", 8}, {"U64", 8}};

/* The dtype named `name`, or -1. */
static int mpt__st_dtype_find(const char *name) {
    int i;
    for (i = 0; i < MPT__ST_DTYPE_COUNT_; i++)
        if (strcmp(mpt__st_dtypes[i].name, name) == 0) return i;
    return -1;
}

/* ---- small shared pieces ----------------------------------------------------- */

static int mpt__ckpt_little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* Reverses the bytes of each `elem`-byte element: host order <-> little-endian
   on a big-endian host. */
static void mpt__ckpt_swap(void *data, int64_t bytes, int elem) {
    unsigned char *p = (unsigned char *)data, t;
    int64_t i;
    int k;
    for (i = 0; i + elem <= bytes; i += elem)
        for (k = 0; k < elem / 2; k++) {
            t = p[i + k];
            p[i + k] = p[i + elem - 1 - k];
            p[i + elem - 1 - k] = t;
        }
}

/* Length (1..4) of the well-formed UTF-8 sequence at p, or 0 when it is not
   one (a stray continuation byte, an overlong form, a surrogate, a code
   point past U+10FFFF, or a sequence cut by the end at p + avail). */
static int mpt__st_utf8_len(const unsigned char *p, int64_t avail) {
    unsigned char lo = 0x80, hi = 0xbf;
    int len, i;
    if (p[0] < 0x80) return 1;
    if (p[0] >= 0xc2 && p[0] <= 0xdf) {
        len = 2;
    } else if (p[0] >= 0xe0 && p[0] <= 0xef) {
        len = 3;
        if (p[0] == 0xe0) lo = 0xa0; /* overlong below U+0800 */
        if (p[0] == 0xed) hi = 0x9f; /* surrogates U+D800..DFFF */
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        len = 4;
        if (p[0] == 0xf0) lo = 0x90; /* overlong below U+10000 */
        if (p[0] == 0xf4) hi = 0x8f; /* past U+10FFFF */
    } else {
        return 0;
    }
    if (avail < len) return 0;
    for (i = 1; i < len; i++, lo = 0x80, hi = 0xbf)
        if (p[i] < lo || p[i] > hi) return 0;
    return len;
}

/* Room for one more item in a growing array of `size`-byte items: returns
   the array to use from now on (items itself while there is room), or NULL
   when memory runs out (items is then still valid and still the caller's). */
static void *mpt__ckpt_grow(const mpt_context *ctx, void *items, int n, int *cap, size_t size) {
    void *grown;
    int want;
    if (n < *cap) return items;
    if (*cap > INT_MAX / 2) return NULL;
    want = *cap ? 2 * *cap : 16;
    grown = mpt__alloc(ctx, size * (size_t)want);
    if (!grown) return NULL;
    if (items) memcpy(grown, items, size * (size_t)n);
    mpt__free(ctx, items);
    *cap = want;
    return grown;
}

static const char *mpt__ckpt_optimizer_name(mpt_optimizer_type type) {
    switch (type) {
    case MPT_OPTIMIZER_ADAM: return "adam";
    case MPT_OPTIMIZER_SGD: return "sgd";
    case MPT_OPTIMIZER_ADAMW: return "adamw";
    default: return "?";
    }
}

/* The name of optimizer slot k, as it appears in "optimizer/<param>/<slot>". */
static const char *mpt__ckpt_slot_name(mpt_optimizer_type type, int k) {
    static const char *const adam[2] = {"m", "v"};
    static const char *const other[2] = {"slot0", "slot1"};
    if (k < 0 || k > 1) return "slot";
    if (type == MPT_OPTIMIZER_SGD && k == 0) return "momentum";
    if (type == MPT_OPTIMIZER_ADAM || type == MPT_OPTIMIZER_ADAMW) return adam[k];
    return other[k];
}

static const char *mpt__ckpt_policy_name(mpt_policy policy) {
    switch (policy) {
    case MPT_POLICY_MIXED_FLOAT16: return "mixed_float16";
    case MPT_POLICY_MIXED_BFLOAT16: return "mixed_bfloat16";
    default: return "float32";
    }
}

/* ---- what the model stores: one entry per tensor ------------------------------ */

/* The training scalars, staged: saving copies them out of the model first,
   loading reads and checks them here before any reaches the model. */
typedef struct mpt__ckpt_train {
    int64_t optimizer_steps, step, epoch, good_steps, skipped_steps;
    float learning_rate, loss_scale;
} mpt__ckpt_train;

typedef struct mpt__ckpt_entry {
    char name[MPT__CKPT_NAME];
    mpt__st_dtype dtype;            /* F32 or I64                                */
    int rank;
    int64_t shape[MPT_MAX_RANK];
    void *data;                     /* (bytes): in the model, or in plan->train  */
    int64_t bytes;
    int64_t begin;                  /* offset in the file's data                 */
    int staged;                     /* data points into plan->train              */
} mpt__ckpt_entry;

/* Every tensor of a weights file (full = 0) or a full checkpoint (full = 1),
   in file order. The entries point into `train`: never copy a plan. */
typedef struct mpt__ckpt_plan {
    mpt__ckpt_entry *e; /* [n] */
    int n;
    int64_t data_bytes; /* the file's data: the entries' bytes, back to back */
    mpt__ckpt_train train;
} mpt__ckpt_plan;

static mpt_status mpt__ckpt_add(mpt_model *m, mpt__ckpt_plan *pl, const char *prefix,
                                const char *name, const char *suffix, mpt__st_dtype dtype,
                                int rank, const int64_t *shape, void *data, int64_t count) {
    mpt__ckpt_entry *e = &pl->e[pl->n];
    int len = snprintf(e->name, sizeof e->name, "%s%s%s", prefix, name, suffix);
    if (len < 0 || (size_t)len >= sizeof e->name)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "checkpoint: tensor name \"%s%s%s\" is longer than %d bytes", prefix,
                         name, suffix, (int)sizeof e->name - 1);
    e->dtype = dtype;
    e->rank = rank;
    if (rank > 0) memcpy(e->shape, shape, sizeof(int64_t) * (size_t)rank);
    e->data = data;
    e->bytes = count * mpt__st_dtypes[dtype].size;
    e->begin = pl->data_bytes;
    pl->data_bytes += e->bytes;
    pl->n++;
    return MPT_OK;
}

static mpt_status mpt__ckpt_add_train(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt__ckpt_train *t = &pl->train;
    int first = pl->n, i;
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "optimizer_steps", "", MPT__ST_I64, 0, NULL,
                             &t->optimizer_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "step", "", MPT__ST_I64, 0, NULL, &t->step, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "epoch", "", MPT__ST_I64, 0, NULL, &t->epoch, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "good_steps", "", MPT__ST_I64, 0, NULL,
                             &t->good_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "skipped_steps", "", MPT__ST_I64, 0, NULL,
                             &t->skipped_steps, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "learning_rate", "", MPT__ST_F32, 0, NULL,
                             &t->learning_rate, 1));
    MPT__CHECK(mpt__ckpt_add(m, pl, "train/", "loss_scale", "", MPT__ST_F32, 0, NULL,
                             &t->loss_scale, 1));
    for (i = first; i < pl->n; i++) pl->e[i].staged = 1;
    return MPT_OK;
}

static mpt_status mpt__ckpt_add_slots(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt_optimizer_type type = m->compile.optimizer.type;
    char suffix[32];
    int i, k;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        for (k = 0; P->trainable && k < m->n_slots; k++) {
            if (!P->slot[k])
                return mpt__fail(m->ctx, MPT_ERR_STATE,
                                 "checkpoint: %s has no optimizer state (slot %d of %d)",
                                 P->name, k, m->n_slots);
            snprintf(suffix, sizeof suffix, "/%s", mpt__ckpt_slot_name(type, k));
            MPT__CHECK(mpt__ckpt_add(m, pl, "optimizer/", P->name, suffix, MPT__ST_F32, P->rank,
                                     P->shape, P->slot[k], P->count));
        }
    }
    return MPT_OK;
}

/* Lists the tensors of the model's file; pl must be zeroed, and is freed by
   mpt__ckpt_plan_free whatever this returns. */
static mpt_status mpt__ckpt_plan_init(mpt_model *m, int full, mpt__ckpt_plan *pl) {
    int i, n = m->n_params;
    if (full) {
        if (m->n_slots < 0 || m->n_slots > 2)
            return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %d optimizer slots per "
                             "parameter (at most 2 are supported)", m->n_slots);
        for (i = 0; i < m->n_params; i++) n += m->params[i].trainable ? m->n_slots : 0;
        n += 7; /* the train/ scalars */
    }
    pl->e = (mpt__ckpt_entry *)mpt__calloc(m->ctx, sizeof *pl->e * (size_t)n);
    if (!pl->e) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    if (full) MPT__CHECK(mpt__ckpt_add_train(m, pl));
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        MPT__CHECK(mpt__ckpt_add(m, pl, "", P->name, "", MPT__ST_F32, P->rank, P->shape,
                                 P->value, P->count));
    }
    return full ? mpt__ckpt_add_slots(m, pl) : MPT_OK;
}

static void mpt__ckpt_plan_free(mpt_model *m, mpt__ckpt_plan *pl) {
    mpt__free(m->ctx, pl->e);
    pl->e = NULL;
}

/* ---- writing the header ------------------------------------------------------- */

/* A growing string (for the JSON header). Out of memory is remembered and
   reported once, at the end. */
typedef struct mpt__ckpt_text {
    const mpt_context *ctx;
    char *s;       /* (cap) NUL-terminated */
    size_t len, cap;
    int oom;
} mpt__ckpt_text;

static void mpt__ckpt_put(mpt__ckpt_text *t, const char *s, size_t n) {
    if (t->oom) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 1024;
        char *grown;
        while (cap < t->len + n + 1) cap *= 2;
        grown = (char *)mpt__alloc(t->ctx, cap);
        if (!grown) {
            t->oom = 1;
            return;
        }
        if (t->s) memcpy(grown, t->s, t->len);
        mpt__free(t->ctx, t->s);
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = 0;
}

static void mpt__ckpt_puts(mpt__ckpt_text *t, const char *s) { mpt__ckpt_put(t, s, strlen(s)); }

/* s as a JSON string: quotes, backslashes and control characters escaped;
   other bytes as they are (the caller has checked they are UTF-8). */
static void mpt__ckpt_put_json(mpt__ckpt_text *t, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    char esc[8];
    mpt__ckpt_puts(t, "\"");
    for (; *p; p++) {
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            mpt__ckpt_put(t, esc, 2);
        } else if (*p == '\n') {
            mpt__ckpt_puts(t, "\\n");
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)*p);
            mpt__ckpt_puts(t, esc);
        } else {
            mpt__ckpt_put(t, (const char *)p, 1);
        }
    }
    mpt__ckpt_puts(t, "\"");
}

static void mpt__ckpt_put_pair(mpt__ckpt_text *t, const char *key, const char *value, int first) {
    if (!first) mpt__ckpt_puts(t, ",");
    mpt__ckpt_put_json(t, key);
    mpt__ckpt_puts(t, ":");
    mpt__ckpt_put_json(t, value);
}

/* The model in a few lines, one per layer: class, name, compute dtype and
   one sample's output shape ("Dense dense_1 float16 (10,)"). */
static void mpt__ckpt_put_model(mpt__ckpt_text *t, const mpt_model *m) {
    mpt__ckpt_text lines;
    char line[256], shape[96];
    int i;
    memset(&lines, 0, sizeof lines);
    lines.ctx = t->ctx;
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        snprintf(line, sizeof line, "%s%s %s %s %s", i ? "\n" : "", L->ops->class_name, L->name,
                 mpt_dtype_name(L->dtype), mpt_shape_format(shape, sizeof shape, L->out_rank,
                                                            L->out_shape));
        mpt__ckpt_puts(&lines, line);
    }
    mpt__ckpt_put_pair(t, "model", lines.s ? lines.s : "", 0);
    t->oom |= lines.oom;
    mpt__free(t->ctx, lines.s);
}

static void mpt__ckpt_put_metadata(mpt__ckpt_text *t, const mpt_model *m, int full) {
    char seed[32], shape[96];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)m->desc.seed);
    mpt_shape_format(shape, sizeof shape, m->desc.input_rank, m->desc.input_shape);
    mpt__ckpt_puts(t, "\"__metadata__\":{");
    mpt__ckpt_put_pair(t, "format", "mpt", 1);
    mpt__ckpt_put_pair(t, "mpt_version", MPT_VERSION, 0);
    mpt__ckpt_put_pair(t, "kind", full ? "checkpoint" : "weights", 0);
    if (full)
        mpt__ckpt_put_pair(t, "optimizer", mpt__ckpt_optimizer_name(m->compile.optimizer.type), 0);
    mpt__ckpt_put_pair(t, "policy", mpt__ckpt_policy_name(m->desc.policy), 0);
    mpt__ckpt_put_pair(t, "seed", seed, 0);
    mpt__ckpt_put_pair(t, "input_shape", shape, 0);
    mpt__ckpt_put_model(t, m);
    mpt__ckpt_puts(t, "}");
}

static void mpt__ckpt_put_entry(mpt__ckpt_text *t, const mpt__ckpt_entry *e) {
    char num[64];
    int d;
    mpt__ckpt_puts(t, ",");
    mpt__ckpt_put_json(t, e->name);
    mpt__ckpt_puts(t, ":{\"dtype\":\"");
    mpt__ckpt_puts(t, mpt__st_dtypes[e->dtype].name);
    mpt__ckpt_puts(t, "\",\"shape\":[");
    for (d = 0; d < e->rank; d++) {
        snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        mpt__ckpt_puts(t, num);
    }
    snprintf(num, sizeof num, "],\"data_offsets\":[%lld,%lld]}", (long long)e->begin,
             (long long)(e->begin + e->bytes));
    mpt__ckpt_puts(t, num);
}

/* Layer names come from the caller; a reader rejects a header that is not
   UTF-8, so a name that is not is refused before anything is written. */
static mpt_status mpt__ckpt_check_names(mpt_model *m) {
    int i;
    for (i = 0; i < m->n_layers; i++) {
        const unsigned char *p = (const unsigned char *)m->layers[i].name;
        int64_t left = (int64_t)strlen(m->layers[i].name);
        while (left > 0) {
            int len = mpt__st_utf8_len(p, left);
            if (!len)
                return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                                 "checkpoint: layer %d's name is not valid UTF-8 (byte 0x%02x)",
                                 i, (unsigned)*p);
            p += len;
            left -= len;
        }
    }
    return MPT_OK;
}

/* The JSON header, space-padded to a multiple of 8 bytes. */
static mpt_status mpt__ckpt_header(mpt_model *m, const mpt__ckpt_plan *pl, int full,
                                   mpt__ckpt_text *t) {
    int i;
    MPT__CHECK(mpt__ckpt_check_names(m));
    mpt__ckpt_puts(t, "{");
    mpt__ckpt_put_metadata(t, m, full);
    for (i = 0; i < pl->n; i++) mpt__ckpt_put_entry(t, &pl->e[i]);
    mpt__ckpt_puts(t, "}");
    while (!t->oom && t->len % 8) mpt__ckpt_puts(t, " ");
    if (t->oom) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    return MPT_OK;
}

/* ---- writing the file -------------------------------------------------------- */

typedef struct mpt__ckpt_writer {
    mpt_context *ctx;
    const char *path;      /* the target                              */
    char *tmp;             /* "<path>.tmp-<pid>"                      */
    int created;           /* tmp exists and is ours to remove        */
    int fd;                /* the temporary file; -1 when closed      */
    int64_t written;       /* bytes written to it                     */
    unsigned char *chunk;  /* (MPT__CKPT_CHUNK) little-endian staging  */
} mpt__ckpt_writer;

static mpt_status mpt__ckpt_write_fail(mpt__ckpt_writer *w, const char *what) {
    int err = errno;
    return mpt__fail(w->ctx, MPT_ERR_IO, "checkpoint: cannot %s '%s' (for '%s'): %s", what,
                     w->tmp, w->path, strerror(err));
}

/* Creates the temporary file next to the target; O_EXCL so that nothing
   already there (another writer's file, a link) is ever written through. */
static mpt_status mpt__ckpt_writer_open(mpt__ckpt_writer *w, mpt_context *ctx, const char *path) {
    size_t size = strlen(path) + 48;
    int k;
    memset(w, 0, sizeof *w);
    w->ctx = ctx;
    w->path = path;
    w->fd = -1;
    w->chunk = (unsigned char *)mpt__alloc(ctx, MPT__CKPT_CHUNK);
    w->tmp = (char *)mpt__alloc(ctx, size);
    if (!w->chunk || !w->tmp)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (k = 0; k < 100; k++) {
        if (k == 0)
            snprintf(w->tmp, size, "%s.tmp-%ld", path, (long)getpid());
        else
            snprintf(w->tmp, size, "%s.tmp-%ld-%d", path, (long)getpid(), k);
        w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (w->fd >= 0 || errno != EEXIST) break;
    }
    if (w->fd < 0) return mpt__ckpt_write_fail(w, "create");
    w->created = 1;
    return MPT_OK;
}

static mpt_status mpt__ckpt_write_raw(mpt__ckpt_writer *w, const void *src, size_t n) {
    const unsigned char *p = (const unsigned char *)src;
    while (n > 0) {
        size_t part = MPT__MIN(n, (size_t)1 << 30);
        ssize_t got;
#ifdef MPT__CHECKPOINT_FAIL_AFTER_BYTES
        {
            int64_t limit = (int64_t)(MPT__CHECKPOINT_FAIL_AFTER_BYTES);
            if (limit >= 0 && w->written + (int64_t)part > limit) {
                if (limit <= w->written) {
                    errno = ENOSPC;
                    return mpt__ckpt_write_fail(w, "write");
                }
                part = (size_t)(limit - w->written);
            }
        }
#endif
        got = write(w->fd, p, part);
        if (got < 0) {
            if (errno == EINTR) continue;
            return mpt__ckpt_write_fail(w, "write");
        }
        p += got;
        n -= (size_t)got;
        w->written += got;
    }
    return MPT_OK;
}

/* Writes `bytes` of `elem`-byte elements in little-endian order, a chunk at
   a time. */
static mpt_status mpt__ckpt_write_le(mpt__ckpt_writer *w, const void *src, int64_t bytes,
                                     int elem) {
    const unsigned char *p = (const unsigned char *)src;
    int swap = !mpt__ckpt_little_endian();
    while (bytes > 0) {
        size_t part = (size_t)MPT__MIN(bytes, (int64_t)MPT__CKPT_CHUNK);
        memcpy(w->chunk, p, part);
        if (swap) mpt__ckpt_swap(w->chunk, (int64_t)part, elem);
        MPT__CHECK(mpt__ckpt_write_raw(w, w->chunk, part));
        p += part;
        bytes -= (int64_t)part;
    }
    return MPT_OK;
}

/* Makes the rename durable. The new file is already in place, so a failure
   here is a warning, not an error. */
static void mpt__ckpt_sync_dir(mpt_context *ctx, const char *path) {
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    char *dir = (char *)mpt__alloc(ctx, len + 2); /* (len + 2) the directory's path */
    int fd;
    if (!dir) return;
    if (!slash)
        strcpy(dir, ".");
    else if (len == 0)
        strcpy(dir, "/");
    else {
        memcpy(dir, path, len);
        dir[len] = 0;
    }
    fd = open(dir, O_RDONLY);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL && errno != EBADF))
        mpt__log(ctx, MPT_LOG_WARNING, "checkpoint: saved '%s', but cannot sync its directory "
                 "'%s': %s", path, dir, strerror(errno));
    if (fd >= 0) close(fd);
    mpt__free(ctx, dir);
}

/* fsync, close, and rename the temporary file over the target. */
static mpt_status mpt__ckpt_writer_commit(mpt__ckpt_writer *w) {
    int failed;
    if (fsync(w->fd) != 0) return mpt__ckpt_write_fail(w, "sync");
    failed = close(w->fd) != 0;
    w->fd = -1;
    if (failed) return mpt__ckpt_write_fail(w, "close");
    if (rename(w->tmp, w->path) != 0) return mpt__ckpt_write_fail(w, "rename into place");
    w->created = 0; /* renamed: nothing left to remove */
    mpt__ckpt_sync_dir(w->ctx, w->path);
    return MPT_OK;
}

/* Closes and removes the temporary file unless it was committed. */
static void mpt__ckpt_writer_close(mpt__ckpt_writer *w) {
    if (w->fd >= 0) close(w->fd);
    if (w->created) remove(w->tmp);
    mpt__free(w->ctx, w->tmp);
    mpt__free(w->ctx, w->chunk);
    w->fd = -1;
    w->created = 0;
    w->tmp = NULL;
    w->chunk = NULL;
}

static mpt_status mpt__ckpt_write_file(mpt__ckpt_writer *w, const mpt__ckpt_plan *pl,
                                       const mpt__ckpt_text *header) {
    unsigned char n8[8];
    int i;
    for (i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)header->len >> (8 * i));
    MPT__CHECK(mpt__ckpt_write_raw(w, n8, 8));
    MPT__CHECK(mpt__ckpt_write_raw(w, header->s, header->len));
    for (i = 0; i < pl->n; i++)
        MPT__CHECK(mpt__ckpt_write_le(w, pl->e[i].data, pl->e[i].bytes,
                                      mpt__st_dtypes[pl->e[i].dtype].size));
    return mpt__ckpt_writer_commit(w);
}

static mpt_status mpt__ckpt_check_model(mpt_model *m, const char *path, int full,
                                        const char *what) {
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!path || !*path)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "checkpoint: %s needs a path", what);
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %s('%s') needs a built model "
                         "(mpt_model_build, or fit)", what, path);
    if (full && !m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "checkpoint: %s('%s') needs a compiled model "
                         "(mpt_model_compile): the optimizer state is part of it", what, path);
    return MPT_OK;
}

static mpt_status mpt__ckpt_save(mpt_model *m, const char *path, int full, const char *what) {
    mpt__ckpt_plan pl;
    mpt__ckpt_text header;
    mpt__ckpt_writer w;
    mpt_status s;
    MPT__CHECK(mpt__ckpt_check_model(m, path, full, what));
    memset(&pl, 0, sizeof pl);
    memset(&header, 0, sizeof header);
    memset(&w, 0, sizeof w);
    w.fd = -1;
    w.ctx = m->ctx;
    header.ctx = m->ctx;
    pl.train.optimizer_steps = m->optimizer_steps;
    pl.train.step = (int64_t)m->step;
    pl.train.epoch = m->epoch;
    pl.train.good_steps = m->good_steps;
    pl.train.skipped_steps = m->skipped_steps;
    pl.train.learning_rate = m->learning_rate;
    pl.train.loss_scale = m->loss_scale;
    s = mpt__ckpt_plan_init(m, full, &pl);
    if (s == MPT_OK) s = mpt__ckpt_header(m, &pl, full, &header);
    if (s == MPT_OK) s = mpt__ckpt_writer_open(&w, m->ctx, path);
    if (s == MPT_OK) s = mpt__ckpt_write_file(&w, &pl, &header);
    mpt__ckpt_writer_close(&w);
    mpt__free(m->ctx, header.s);
    mpt__ckpt_plan_free(m, &pl);
    return s;
}

/* ---- reading a file: the header ------------------------------------------------ */

typedef struct mpt__st_tensor {
    const char *name;                 /* decoded, in the header buffer        */
    int64_t at;                       /* file offset of its name (messages)   */
    mpt__st_dtype dtype;
    int rank;
    int64_t shape[MPT__ST_MAX_RANK];
    int64_t begin, end;               /* data_offsets: bytes [begin, end) of the data */
    int used;                         /* claimed by one of the model's entries */
} mpt__st_tensor;

typedef struct mpt__st_meta {
    const char *key, *value;
    int64_t at;
} mpt__st_meta;

typedef struct mpt__st_file {
    mpt_context *ctx;
    const char *path;
    int fd;                  /* -1 when closed                              */
    int64_t size;            /* of the file                                 */
    int64_t n;               /* of the header                               */
    char *json;              /* (n + 1) the header; strings decoded in place */
    int64_t pos;             /* the reader's position in json               */
    mpt__st_tensor *t;       /* [n_t], sorted by name once read             */
    int n_t, cap_t;
    mpt__st_meta *meta;      /* [n_meta]                                    */
    int n_meta, cap_meta, has_meta;
} mpt__st_file;

/* A malformed header: names the file and the byte (counted from the file's
   start) where reading stopped. */
static mpt_status mpt__st_bad(mpt__st_file *f, int64_t pos, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': malformed header at byte %lld: %s",
                     f->path, (long long)(8 + pos), why);
}

static int mpt__st_peek(const mpt__st_file *f) {
    return f->pos < f->n ? (unsigned char)f->json[f->pos] : -1;
}

/* What is at the reader's position, for messages: "'x'", "byte 0x07", "the end". */
static const char *mpt__st_found(const mpt__st_file *f, char *buf, size_t size) {
    int c = mpt__st_peek(f);
    if (c < 0)
        snprintf(buf, size, "the end of the header");
    else if (c > 0x20 && c < 0x7f)
        snprintf(buf, size, "'%c'", c);
    else
        snprintf(buf, size, "byte 0x%02x", (unsigned)c);
    return buf;
}

static void mpt__st_ws(mpt__st_file *f) {
    int c;
    while ((c = mpt__st_peek(f)) == ' ' || c == '\t' || c == '\n' || c == '\r') f->pos++;
}

static mpt_status mpt__st_expect(mpt__st_file *f, char c, const char *where) {
    char found[32];
    mpt__st_ws(f);
    if (mpt__st_peek(f) != (unsigned char)c)
        return mpt__st_bad(f, f->pos, "expected '%c' %s, found %s", c, where,
                           mpt__st_found(f, found, sizeof found));
    f->pos++;
    return MPT_OK;
}

static int mpt__st_hex4(const char *p, uint32_t *out) {
    int i;
    *out = 0;
    for (i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return 0;
        *out = *out << 4 | (uint32_t)d;
    }
    return 1;
}

static int mpt__st_put_utf8(char *w, uint32_t cp) {
    if (cp < 0x80) {
        w[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        w[0] = (char)(0xc0 | cp >> 6);
        w[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        w[0] = (char)(0xe0 | cp >> 12);
        w[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        w[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    w[0] = (char)(0xf0 | cp >> 18);
    w[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    w[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    w[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decodes the \u escape at json[r] (the backslash) into *cp; *len gets the
   bytes it took (6, or 12 for a surrogate pair). */
static mpt_status mpt__st_unicode_escape(mpt__st_file *f, int64_t r, uint32_t *cp, int *len) {
    const char *j = f->json;
    uint32_t lo;
    if (r + 6 > f->n || !mpt__st_hex4(j + r + 2, cp))
        return mpt__st_bad(f, r, "\\u must be followed by 4 hex digits");
    *len = 6;
    if (*cp >= 0xdc00 && *cp <= 0xdfff)
        return mpt__st_bad(f, r, "\\u%04x is a low surrogate without a high one", (unsigned)*cp);
    if (*cp >= 0xd800 && *cp <= 0xdbff) {
        if (r + 12 > f->n || j[r + 6] != '\\' || j[r + 7] != 'u' || !mpt__st_hex4(j + r + 8, &lo) ||
            lo < 0xdc00 || lo > 0xdfff)
            return mpt__st_bad(f, r, "\\u%04x is a high surrogate without a low one after it",
                               (unsigned)*cp);
        *cp = 0x10000 + ((*cp - 0xd800) << 10) + (lo - 0xdc00);
        *len = 12;
    }
    if (*cp == 0) return mpt__st_bad(f, r, "\\u0000 in a string is not supported");
    return MPT_OK;
}

/* Decodes the escape at json[*r] (the backslash) to json[*w...]. Decoding
   never lengthens a string, so it happens in place: *w stays behind *r. */
static mpt_status mpt__st_escape(mpt__st_file *f, int64_t *r, int64_t *w) {
    char *j = f->json;
    int c = *r + 1 < f->n ? (unsigned char)j[*r + 1] : -1;
    char plain;
    uint32_t cp = 0;
    int len = 0;
    switch (c) {
    case '"': case '\\': case '/': plain = (char)c; break;
    case 'b': plain = '\b'; break;
    case 'f': plain = '\f'; break;
    case 'n': plain = '\n'; break;
    case 'r': plain = '\r'; break;
    case 't': plain = '\t'; break;
    case 'u':
        MPT__CHECK(mpt__st_unicode_escape(f, *r, &cp, &len));
        *w += mpt__st_put_utf8(j + *w, cp);
        *r += len;
        return MPT_OK;
    case -1: return mpt__st_bad(f, *r, "unterminated escape at the end of the header");
    default:
        return mpt__st_bad(f, *r, "invalid escape '\\%c'", c > 0x20 && c < 0x7f ? c : '?');
    }
    j[(*w)++] = plain;
    *r += 2;
    return MPT_OK;
}

/* A JSON string at the reader's position, decoded in place: *out points at
   it, NUL-terminated, inside json. */
static mpt_status mpt__st_string(mpt__st_file *f, const char **out) {
    char *j = f->json, found[32];
    int64_t start, r, w;
    mpt__st_ws(f);
    if (mpt__st_peek(f) != '"')
        return mpt__st_bad(f, f->pos, "expected a string, found %s",
                           mpt__st_found(f, found, sizeof found));
    start = w = f->pos;
    r = start + 1;
    for (;;) {
        unsigned char c;
        int len;
        if (r >= f->n) return mpt__st_bad(f, start, "unterminated string");
        c = (unsigned char)j[r];
        if (c == '"') break;
        if (c == '\\') {
            MPT__CHECK(mpt__st_escape(f, &r, &w));
        } else if (c < 0x20) {
            return mpt__st_bad(f, r, "control character 0x%02x in a string (it must be escaped)",
                               (unsigned)c);
        } else {
            len = mpt__st_utf8_len((const unsigned char *)j + r, f->n - r);
            if (!len)
                return mpt__st_bad(f, r, "invalid UTF-8 byte 0x%02x in a string", (unsigned)c);
            memmove(j + w, j + r, (size_t)len);
            w += len;
            r += len;
        }
    }
    j[w] = 0;
    f->pos = r + 1;
    *out = j + start;
    return MPT_OK;
}

/* A non-negative JSON integer (shape dimensions and offsets are nothing else). */
static mpt_status mpt__st_uint(mpt__st_file *f, int64_t *out, const char *what) {
    char found[32];
    int64_t v = 0, start;
    int c;
    mpt__st_ws(f);
    start = f->pos;
    c = mpt__st_peek(f);
    if (c == '-') return mpt__st_bad(f, start, "%s must not be negative", what);
    if (c < '0' || c > '9')
        return mpt__st_bad(f, start, "expected an integer in %s, found %s", what,
                           mpt__st_found(f, found, sizeof found));
    if (c == '0' && f->pos + 1 < f->n && f->json[f->pos + 1] >= '0' && f->json[f->pos + 1] <= '9')
        return mpt__st_bad(f, start, "a number in %s has a leading zero", what);
    while ((c = mpt__st_peek(f)) >= '0' && c <= '9') {
        if (v > (INT64_MAX - (c - '0')) / 10)
            return mpt__st_bad(f, start, "a number in %s is too large", what);
        v = v * 10 + (c - '0');
        f->pos++;
    }
    if (c == '.' || c == 'e' || c == 'E')
        return mpt__st_bad(f, start, "a number in %s is not an integer", what);
    *out = v;
    return MPT_OK;
}

/* [n, n, ...] with at most max values into out; *count gets how many. */
static mpt_status mpt__st_uint_array(mpt__st_file *f, int64_t *out, int max, int *count,
                                     const char *what) {
    char found[32];
    int c;
    *count = 0;
    MPT__CHECK(mpt__st_expect(f, '[', what));
    mpt__st_ws(f);
    if (mpt__st_peek(f) == ']') {
        f->pos++;
        return MPT_OK;
    }
    for (;;) {
        if (*count == max) return mpt__st_bad(f, f->pos, "%s has more than %d values", what, max);
        MPT__CHECK(mpt__st_uint(f, &out[(*count)++], what));
        mpt__st_ws(f);
        c = mpt__st_peek(f);
        if (c != ',' && c != ']')
            return mpt__st_bad(f, f->pos, "expected ',' or ']' in %s, found %s", what,
                               mpt__st_found(f, found, sizeof found));
        f->pos++;
        if (c == ']') return MPT_OK;
    }
}

/* Steps to the next member of an object whose '{' has been read: *key is
   its name (NULL at the closing '}'), *at where the name starts; the ':'
   after it has been read. */
static mpt_status mpt__st_member(mpt__st_file *f, int first, const char **key, int64_t *at) {
    char found[32];
    int c;
    mpt__st_ws(f);
    c = mpt__st_peek(f);
    if (c == '}') {
        f->pos++;
        *key = NULL;
        return MPT_OK;
    }
    if (!first) {
        if (c != ',')
            return mpt__st_bad(f, f->pos, "expected ',' or '}' after a member, found %s",
                               mpt__st_found(f, found, sizeof found));
        f->pos++;
        mpt__st_ws(f);
    }
    *at = f->pos;
    MPT__CHECK(mpt__st_string(f, key));
    return mpt__st_expect(f, ':', "after a key");
}

/* The bytes [begin, end) must hold exactly the shape's elements. */
static mpt_status mpt__st_check_extent(mpt__st_file *f, const mpt__st_tensor *T) {
    char s[96];
    int64_t count = 1, bytes = 0;
    int d, ok = 1;
    for (d = 0; d < T->rank && ok; d++) ok = mpt__mul_ok(count, T->shape[d], &count);
    ok = ok && mpt__mul_ok(count, mpt__st_dtypes[T->dtype].size, &bytes);
    if (T->begin > T->end)
        return mpt__st_bad(f, T->at, "tensor \"%s\": data_offsets [%lld, %lld] end before they "
                           "begin", T->name, (long long)T->begin, (long long)T->end);
    if (!ok || bytes != T->end - T->begin)
        return mpt__st_bad(f, T->at, "tensor \"%s\": %s %s is %s bytes, but data_offsets "
                           "[%lld, %lld] hold %lld", T->name, mpt__st_dtypes[T->dtype].name,
                           mpt_shape_format(s, sizeof s, T->rank, T->shape),
                           ok ? "a different number of" : "too many", (long long)T->begin,
                           (long long)T->end, (long long)(T->end - T->begin));
    return MPT_OK;
}

/* One tensor's {"dtype": .., "shape": [..], "data_offsets": [b, e]}. */
static mpt_status mpt__st_tensor_entry(mpt__st_file *f, const char *name, int64_t at) {
    static const char *const keys[3] = {"dtype", "shape", "data_offsets"};
    mpt__st_tensor *T, *grown;
    const char *key, *dtype;
    int64_t key_at = at, offsets[2] = {0, 0};
    int seen = 0, first, k, n_offsets = 0;
    grown = (mpt__st_tensor *)mpt__ckpt_grow(f->ctx, f->t, f->n_t, &f->cap_t, sizeof *f->t);
    if (!grown) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    f->t = grown;
    T = &f->t[f->n_t];
    memset(T, 0, sizeof *T);
    T->name = name;
    T->at = at;
    MPT__CHECK(mpt__st_expect(f, '{', "to open a tensor's entry"));
    for (first = 1;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &key_at));
        if (!key) break;
        for (k = 0; k < 3 && strcmp(key, keys[k]) != 0; k++) continue;
        if (k == 3)
            return mpt__st_bad(f, key_at, "tensor \"%s\": unexpected key \"%s\" (a tensor has "
                               "dtype, shape and data_offsets)", name, key);
        if (seen & (1 << k))
            return mpt__st_bad(f, key_at, "tensor \"%s\": \"%s\" given twice", name, key);
        seen |= 1 << k;
        if (k == 0) {
            int found;
            MPT__CHECK(mpt__st_string(f, &dtype));
            found = mpt__st_dtype_find(dtype);
            if (found < 0)
                return mpt__st_bad(f, key_at, "tensor \"%s\": unknown dtype \"%s\"", name, dtype);
            T->dtype = (mpt__st_dtype)found;
        } else if (k == 1) {
            MPT__CHECK(mpt__st_uint_array(f, T->shape, MPT__ST_MAX_RANK, &T->rank, "shape"));
        } else {
            MPT__CHECK(mpt__st_uint_array(f, offsets, 2, &n_offsets, "data_offsets"));
            if (n_offsets != 2)
                return mpt__st_bad(f, key_at, "tensor \"%s\": data_offsets must hold 2 values",
                                   name);
        }
    }
    if (seen != 7)
        return mpt__st_bad(f, at, "tensor \"%s\" has no \"%s\"", name,
                           keys[!(seen & 1) ? 0 : !(seen & 2) ? 1 : 2]);
    T->begin = offsets[0];
    T->end = offsets[1];
    MPT__CHECK(mpt__st_check_extent(f, T));
    f->n_t++;
    return MPT_OK;
}

/* "__metadata__": {"key": "value", ...}, strings only. */
static mpt_status mpt__st_metadata(mpt__st_file *f, int64_t at) {
    mpt__st_meta *grown;
    const char *key, *value;
    int64_t key_at = at;
    int first = 1;
    if (f->has_meta) return mpt__st_bad(f, at, "\"__metadata__\" given twice");
    f->has_meta = 1;
    MPT__CHECK(mpt__st_expect(f, '{', "to open \"__metadata__\""));
    for (;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &key_at));
        if (!key) return MPT_OK;
        mpt__st_ws(f);
        if (mpt__st_peek(f) != '"')
            return mpt__st_bad(f, f->pos, "\"__metadata__\" value of \"%s\" is not a string", key);
        MPT__CHECK(mpt__st_string(f, &value));
        grown = (mpt__st_meta *)mpt__ckpt_grow(f->ctx, f->meta, f->n_meta, &f->cap_meta,
                                               sizeof *f->meta);
        if (!grown) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
        f->meta = grown;
        f->meta[f->n_meta].key = key;
        f->meta[f->n_meta].value = value;
        f->meta[f->n_meta].at = key_at;
        f->n_meta++;
    }
}

static mpt_status mpt__st_parse(mpt__st_file *f) {
    char found[32];
    const char *key;
    int64_t at = 0;
    int first;
    f->pos = 0;
    MPT__CHECK(mpt__st_expect(f, '{', "at the start of the header"));
    for (first = 1;; first = 0) {
        MPT__CHECK(mpt__st_member(f, first, &key, &at));
        if (!key) break;
        if (strcmp(key, "__metadata__") == 0)
            MPT__CHECK(mpt__st_metadata(f, at));
        else
            MPT__CHECK(mpt__st_tensor_entry(f, key, at));
    }
    mpt__st_ws(f);
    if (f->pos != f->n)
        return mpt__st_bad(f, f->pos, "%s after the header's closing '}'",
                           mpt__st_found(f, found, sizeof found));
    return MPT_OK;
}

/* ---- reading a file: the layout of the data ----------------------------------- */

static int mpt__st_by_name(const void *a, const void *b) {
    return strcmp(((const mpt__st_tensor *)a)->name, ((const mpt__st_tensor *)b)->name);
}

static int mpt__st_meta_by_key(const void *a, const void *b) {
    return strcmp(((const mpt__st_meta *)a)->key, ((const mpt__st_meta *)b)->key);
}

static int mpt__st_by_offset(const void *a, const void *b) {
    const mpt__st_tensor *x = *(const mpt__st_tensor *const *)a;
    const mpt__st_tensor *y = *(const mpt__st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Names unique (tensors and metadata keys), sorted by name for lookups. */
static mpt_status mpt__st_check_names(mpt__st_file *f) {
    int i;
    if (f->n_t > 1) qsort(f->t, (size_t)f->n_t, sizeof *f->t, mpt__st_by_name);
    for (i = 1; i < f->n_t; i++)
        if (strcmp(f->t[i - 1].name, f->t[i].name) == 0)
            return mpt__st_bad(f, MPT__MAX(f->t[i - 1].at, f->t[i].at),
                               "duplicate tensor name \"%s\" (also at byte %lld)", f->t[i].name,
                               (long long)(8 + MPT__MIN(f->t[i - 1].at, f->t[i].at)));
    if (f->n_meta > 1) qsort(f->meta, (size_t)f->n_meta, sizeof *f->meta, mpt__st_meta_by_key);
    for (i = 1; i < f->n_meta; i++)
        if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
            return mpt__st_bad(f, MPT__MAX(f->meta[i - 1].at, f->meta[i].at),
                               "duplicate \"__metadata__\" key \"%s\"", f->meta[i].key);
    return MPT_OK;
}

/* The tensors tile the data from 0 without gaps or overlaps, and the data
   ends where the file does (8 + N + end == file size). */
static mpt_status mpt__st_check_layout(mpt__st_file *f) {
    mpt__st_tensor **order; /* [n_t] the tensors by offset */
    int64_t data = f->size - 8 - f->n, expect = 0;
    mpt_status s = MPT_OK;
    int i;
    order = (mpt__st_tensor **)mpt__alloc(f->ctx, sizeof *order * (size_t)(f->n_t + 1));
    if (!order) return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (i = 0; i < f->n_t; i++) order[i] = &f->t[i];
    if (f->n_t > 1) qsort(order, (size_t)f->n_t, sizeof *order, mpt__st_by_offset);
    for (i = 0; i < f->n_t && s == MPT_OK; i++) {
        if (order[i]->begin != expect)
            s = mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': tensor \"%s\" (header byte "
                          "%lld) has data_offsets [%lld, %lld], but the data must be contiguous "
                          "from 0: %s at %lld", f->path, order[i]->name,
                          (long long)(8 + order[i]->at), (long long)order[i]->begin,
                          (long long)order[i]->end,
                          order[i]->begin > expect ? "a gap" : "an overlap", (long long)expect);
        expect = order[i]->end;
    }
    mpt__free(f->ctx, order);
    if (s == MPT_OK && expect != data)
        s = mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': the tensors end at byte %lld of "
                      "the data, so the file should have 8 + %lld + %lld = %lld bytes, but its "
                      "size is %lld%s", f->path, (long long)expect, (long long)f->n,
                      (long long)expect, (long long)(8 + f->n + expect), (long long)f->size,
                      expect > data ? " (truncated?)" : "");
    return s;
}

/* ---- reading a file: opening, reading, closing ----------------------------------- */

/* Reads bytes [offset, offset + bytes) of the file into dst. */
static mpt_status mpt__st_read_at(mpt__st_file *f, int64_t offset, void *dst, int64_t bytes) {
    unsigned char *p = (unsigned char *)dst;
    if (lseek(f->fd, (off_t)offset, SEEK_SET) < 0)
        return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: cannot seek in '%s': %s", f->path,
                         strerror(errno));
    while (bytes > 0) {
        ssize_t got = read(f->fd, p, (size_t)MPT__MIN(bytes, (int64_t)1 << 30));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0)
            return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: cannot read '%s': %s", f->path,
                             strerror(errno));
        if (got == 0)
            return mpt__fail(f->ctx, MPT_ERR_IO, "checkpoint: '%s' ended %lld bytes early: it "
                             "changed while being read", f->path, (long long)bytes);
        p += got;
        bytes -= got;
    }
    return MPT_OK;
}

static void mpt__st_close(mpt__st_file *f) {
    if (f->fd >= 0) close(f->fd);
    mpt__free(f->ctx, f->json);
    mpt__free(f->ctx, f->t);
    mpt__free(f->ctx, f->meta);
    f->fd = -1;
    f->json = NULL;
    f->t = NULL;
    f->meta = NULL;
}

/* The length, the header, and their checks. */
static mpt_status mpt__st_read_header(mpt__st_file *f) {
    unsigned char n8[8];
    uint64_t n = 0;
    int i;
    if (f->size < 8)
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': %lld bytes is too short for a "
                         "safetensors file (it starts with an 8-byte header length)", f->path,
                         (long long)f->size);
    MPT__CHECK(mpt__st_read_at(f, 0, n8, 8));
    for (i = 0; i < 8; i++) n |= (uint64_t)n8[i] << (8 * i);
    if (n > MPT__ST_MAX_HEADER)
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': header length %llu is over "
                         "the limit of %d bytes", f->path, (unsigned long long)n,
                         MPT__ST_MAX_HEADER);
    if (n > (uint64_t)(f->size - 8))
        return mpt__fail(f->ctx, MPT_ERR_FORMAT, "checkpoint '%s': header length %llu runs past "
                         "the end of the file (%lld bytes)", f->path, (unsigned long long)n,
                         (long long)f->size);
    f->n = (int64_t)n;
    f->json = (char *)mpt__alloc(f->ctx, (size_t)n + 1);
    if (!f->json)
        return mpt__fail(f->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: cannot allocate %llu bytes "
                         "for the header of '%s'", (unsigned long long)n + 1, f->path);
    MPT__CHECK(mpt__st_read_at(f, 8, f->json, f->n));
    f->json[f->n] = 0;
    return MPT_OK;
}

/* Opens a safetensors file and checks everything about it that does not
   depend on the model. On failure the caller still closes f. */
static mpt_status mpt__st_open(mpt__st_file *f, mpt_context *ctx, const char *path) {
    struct stat st;
    memset(f, 0, sizeof *f);
    f->ctx = ctx;
    f->path = path;
    f->fd = open(path, O_RDONLY);
    if (f->fd < 0)
        return mpt__fail(ctx, MPT_ERR_IO, "checkpoint: cannot open '%s': %s", path,
                         strerror(errno));
    if (fstat(f->fd, &st) != 0)
        return mpt__fail(ctx, MPT_ERR_IO, "checkpoint: cannot stat '%s': %s", path,
                         strerror(errno));
    if (!S_ISREG(st.st_mode))
        return mpt__fail(ctx, MPT_ERR_IO, "checkpoint: '%s' is not a regular file", path);
    f->size = (int64_t)st.st_size;
    MPT__CHECK(mpt__st_read_header(f));
    MPT__CHECK(mpt__st_parse(f));
    MPT__CHECK(mpt__st_check_names(f));
    return mpt__st_check_layout(f);
}

static mpt__st_tensor *mpt__st_find(const mpt__st_file *f, const char *name) {
    mpt__st_tensor key;
    if (f->n_t == 0) return NULL;
    key.name = name;
    return (mpt__st_tensor *)bsearch(&key, f->t, (size_t)f->n_t, sizeof *f->t, mpt__st_by_name);
}

static const char *mpt__st_meta_get(const mpt__st_file *f, const char *key) {
    int i;
    for (i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
    return NULL;
}

/* ---- loading into a model ---------------------------------------------------- */

/* "F32 (3, 2)" */
static const char *mpt__ckpt_describe(char *buf, size_t size, mpt__st_dtype dtype, int rank,
                                      const int64_t *shape) {
    char s[96];
    snprintf(buf, size, "%s %s", mpt__st_dtypes[dtype].name, mpt_shape_format(s, sizeof s, rank,
                                                                              shape));
    return buf;
}

/* Finds each of the model's entries in the file, with its dtype and shape. */
static mpt_status mpt__ckpt_match(mpt_model *m, mpt__st_file *f, const mpt__ckpt_plan *pl,
                                  mpt__st_tensor **found) {
    char want[128], got[128];
    int i, d, same;
    for (i = 0; i < pl->n; i++) {
        const mpt__ckpt_entry *e = &pl->e[i];
        mpt__st_tensor *T = mpt__st_find(f, e->name);
        mpt__ckpt_describe(want, sizeof want, e->dtype, e->rank, e->shape);
        if (!T)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has no tensor \"%s\" (the "
                             "model's is %s)", f->path, e->name, want);
        mpt__ckpt_describe(got, sizeof got, T->dtype, T->rank, T->shape);
        if (T->dtype != e->dtype)
            return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': tensor \"%s\" is %s in the "
                             "file, but the model's is %s", f->path, e->name, got, want);
        same = T->rank == e->rank;
        for (d = 0; same && d < e->rank; d++) same = T->shape[d] == e->shape[d];
        if (!same)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s': tensor \"%s\" is %s in the "
                             "file, but the model's is %s", f->path, e->name, got, want);
        T->used = 1;
        found[i] = T;
    }
    return MPT_OK;
}

/* Every tensor of the file must be the model's; load_weights passes over
   the optimizer state and training scalars of a full checkpoint. */
static mpt_status mpt__ckpt_check_unused(mpt_model *m, const mpt__st_file *f, int full) {
    char got[128];
    int i;
    for (i = 0; i < f->n_t; i++) {
        const mpt__st_tensor *T = &f->t[i];
        int extra_state = strncmp(T->name, "optimizer/", 10) == 0 ||
                          strncmp(T->name, "train/", 6) == 0;
        if (T->used || (!full && extra_state)) continue;
        mpt__ckpt_describe(got, sizeof got, T->dtype, T->rank, T->shape);
        if (full && strncmp(T->name, "optimizer/", 10) == 0)
            return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has optimizer state \"%s\" "
                             "%s that the model's optimizer (%s, %d slot%s per parameter) "
                             "does not", f->path, T->name, got,
                             mpt__ckpt_optimizer_name(m->compile.optimizer.type), m->n_slots,
                             m->n_slots == 1 ? "" : "s");
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' has a tensor \"%s\" %s that "
                         "the model does not have", f->path, T->name, got);
    }
    return MPT_OK;
}

/* A full checkpoint's metadata, where it has any, must be about this
   model's kind of training state. */
static mpt_status mpt__ckpt_check_metadata(mpt_model *m, const mpt__st_file *f) {
    const char *kind = mpt__st_meta_get(f, "kind");
    const char *opt = mpt__st_meta_get(f, "optimizer");
    const char *seed = mpt__st_meta_get(f, "seed");
    const char *mine = mpt__ckpt_optimizer_name(m->compile.optimizer.type);
    char want[32];
    if (kind && strcmp(kind, "checkpoint") != 0)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' holds \"%s\", not a full "
                         "checkpoint: load it with mpt_model_load_weights", f->path, kind);
    if (opt && strcmp(opt, mine) != 0)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "checkpoint '%s' holds %s state, but the model "
                         "is compiled with %s", f->path, opt, mine);
    snprintf(want, sizeof want, "%llu", (unsigned long long)m->desc.seed);
    if (seed && strcmp(seed, want) != 0)
        mpt__log(m->ctx, MPT_LOG_WARNING, "checkpoint '%s' was saved by a model with seed %s; "
                 "this one's is %s, so the data order and dropout masks will differ from "
                 "the original run", f->path, seed, want);
    return MPT_OK;
}

/* The training scalars' values, before any of them reaches the model. */
static mpt_status mpt__ckpt_check_train(mpt_model *m, const char *path, const mpt__ckpt_train *t) {
    const char *bad = NULL;
    double v = 0;
    if (t->optimizer_steps < 0) bad = "optimizer_steps", v = (double)t->optimizer_steps;
    if (t->step < 0) bad = "step", v = (double)t->step;
    if (t->epoch < 0 || t->epoch > INT_MAX) bad = "epoch", v = (double)t->epoch;
    if (t->good_steps < 0) bad = "good_steps", v = (double)t->good_steps;
    if (t->skipped_steps < 0) bad = "skipped_steps", v = (double)t->skipped_steps;
    if (!(t->learning_rate >= 0 && t->learning_rate < INFINITY))
        bad = "learning_rate", v = t->learning_rate;
    if (!(t->loss_scale > 0 && t->loss_scale < INFINITY)) bad = "loss_scale", v = t->loss_scale;
    if (bad)
        return mpt__fail(m->ctx, MPT_ERR_FORMAT, "checkpoint '%s': train/%s is %g (counters must "
                         "be >= 0, the learning rate finite and >= 0, the loss scale finite "
                         "and > 0)", path, bad, v);
    return MPT_OK;
}

/* Reads the entries with staged == want_staged into place. */
static mpt_status mpt__ckpt_read(mpt__st_file *f, const mpt__ckpt_plan *pl,
                                 mpt__st_tensor *const *found, int want_staged) {
    int i, swap = !mpt__ckpt_little_endian();
    for (i = 0; i < pl->n; i++) {
        const mpt__ckpt_entry *e = &pl->e[i];
        if (e->staged != want_staged) continue;
        MPT__CHECK(mpt__st_read_at(f, 8 + f->n + found[i]->begin, e->data, e->bytes));
        if (swap) mpt__ckpt_swap(e->data, e->bytes, mpt__st_dtypes[e->dtype].size);
    }
    return MPT_OK;
}

static void mpt__ckpt_apply_train(mpt_model *m, const mpt__ckpt_train *t) {
    m->optimizer_steps = t->optimizer_steps;
    m->step = (uint64_t)t->step;
    m->epoch = (int)t->epoch;
    m->good_steps = t->good_steps;
    m->skipped_steps = t->skipped_steps;
    m->learning_rate = t->learning_rate;
    m->loss_scale = t->loss_scale;
}

/* Everything checked, the small scalars read and checked; then the tensors. */
static mpt_status mpt__ckpt_load_checked(mpt_model *m, mpt__st_file *f, const mpt__ckpt_plan *pl,
                                         mpt__st_tensor **found, int full) {
    mpt_status s;
    if (full) MPT__CHECK(mpt__ckpt_check_metadata(m, f));
    MPT__CHECK(mpt__ckpt_match(m, f, pl, found));
    MPT__CHECK(mpt__ckpt_check_unused(m, f, full));
    if (full) {
        MPT__CHECK(mpt__ckpt_read(f, pl, found, 1));
        MPT__CHECK(mpt__ckpt_check_train(m, f->path, &pl->train));
    }
    s = mpt__ckpt_read(f, pl, found, 0);
    if (s != MPT_OK) {
        /* Only an I/O failure after every check gets here. */
        char why[sizeof m->ctx->error];
        snprintf(why, sizeof why, "%s", mpt_context_error(m->ctx));
        mpt_model_refresh_weights(m);
        return mpt__fail(m->ctx, s, "%s; the model's weights%s may be partly loaded", why,
                         full ? " and optimizer state" : "");
    }
    if (full) mpt__ckpt_apply_train(m, &pl->train);
    mpt_model_refresh_weights(m);
    return MPT_OK;
}

static mpt_status mpt__ckpt_load(mpt_model *m, const char *path, int full, const char *what) {
    mpt__st_file f;
    mpt__ckpt_plan pl;
    mpt__st_tensor **found = NULL; /* [pl.n] the file's tensor for each entry */
    mpt_status s;
    MPT__CHECK(mpt__ckpt_check_model(m, path, full, what));
    memset(&pl, 0, sizeof pl);
    s = mpt__st_open(&f, m->ctx, path);
    if (s == MPT_OK) s = mpt__ckpt_plan_init(m, full, &pl);
    if (s == MPT_OK) {
        found = (mpt__st_tensor **)mpt__calloc(m->ctx, sizeof *found * (size_t)(pl.n + 1));
        if (!found) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    }
    if (s == MPT_OK) s = mpt__ckpt_load_checked(m, &f, &pl, found, full);
    mpt__free(m->ctx, found);
    mpt__ckpt_plan_free(m, &pl);
    mpt__st_close(&f);
    return s;
}

/* ---- the public functions -------------------------------------------------------- */

MPTDEF mpt_status mpt_model_save_weights(mpt_model *m, const char *path) {
    return mpt__ckpt_save(m, path, 0, "save_weights");
}

MPTDEF mpt_status mpt_model_load_weights(mpt_model *m, const char *path) {
    return mpt__ckpt_load(m, path, 0, "load_weights");
}

MPTDEF mpt_status mpt_model_save_checkpoint(mpt_model *m, const char *path) {
    return mpt__ckpt_save(m, path, 1, "save_checkpoint");
}

MPTDEF mpt_status mpt_model_load_checkpoint(mpt_model *m, const char *path) {
    return mpt__ckpt_load(m, path, 1, "load_checkpoint");
}

MPTDEF int mpt_model_epoch(const mpt_model *m) { return m ? m->epoch : 0; }

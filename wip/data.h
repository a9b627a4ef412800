/* =============================================================================
   @impl-data: datasets over caller arrays and IDX files, and the batch loader
   =============================================================================

   A dataset is x (n, sample shape...) in uint8, float32, float16 or
   bfloat16, and y: int32 class ids (n,) or float32 targets (n, ...). uint8
   images stay uint8 in memory (a quarter of float32) and are normalised
   (x·scale + offset) only when a batch is gathered, through a 256-entry
   table per dtype, so every value is rounded exactly once, as mpt__convert
   rounds it.

   A view (mpt_dataset_split) points into its root's buffers. The root
   counts its live views and frees its buffers when the last of itself and
   its views is destroyed, so destroying them in any order is safe. (The
   count is not atomic: a dataset and its views are split and destroyed on
   one thread at a time, as a context is used.)

   The loader gathers batch i + 1 on its own thread (not the pool, which
   serves one job at a time and is busy with batch i) into the second of
   two buffers allocated up front: fit allocates nothing per batch.

   Internal API for the training loop (train.h):
     mpt__dataset_label_dtype / _label_range / _label_count / _label_shape
     mpt__dataset_gather                   samples in any order, normalised
     mpt__loader_create / _start_epoch / _next / _destroy   prefetching */

#include <errno.h>
#include <sys/stat.h>
#ifndef MPT_NO_ZLIB
#include <zlib.h>
#endif

/* The training loop's entry points below: a build whose train.h calls only
   some of them must still compile warning-free. */
#if defined(__GNUC__) || defined(__clang__)
#define MPT__DATA_API __attribute__((unused)) static
#else
#define MPT__DATA_API static
#endif

struct mpt_dataset {
    mpt_context *ctx;             /* allocated this struct                       */
    mpt_dataset *root;            /* owner of the buffers: itself, or a view's root */
    int refs;                     /* root: itself + its live views               */
    int64_t n;                    /* samples                                     */
    mpt_dtype x_dtype;            /* uint8, float32, float16 or bfloat16         */
    int x_rank;                   /* one sample's rank, 1..3                     */
    int64_t x_shape[MPT_MAX_RANK - 1];
    int64_t x_count;              /* elements of one sample                      */
    const void *x;                /* (n, x_shape) x_dtype, this dataset's sample 0 */
    mpt_dtype y_dtype;            /* int32 class ids or float32 targets          */
    int y_rank;                   /* one target's rank: 0 for class ids          */
    int64_t y_shape[MPT_MAX_RANK - 1];
    int64_t y_count;              /* elements of one target: 1 for class ids     */
    const void *y;                /* (n, y_shape) y_dtype                        */
    int32_t label_min, label_max; /* class ids: their range over these n samples */
    float scale, offset;          /* uint8 x: x·scale + offset                   */
    float u8_f32[256];            /* uint8 x: each byte value normalised         */
    mpt_half u8_f16[256];         /*   the same, rounded to float16              */
    mpt_bf16 u8_bf16[256];        /*   the same, rounded to bfloat16             */
    void *owned_x, *owned_y;      /* root: buffers freed with it; NULL if borrowed */
};

/* ---- the dataset object --------------------------------------------------- */

static mpt_dataset *mpt__dataset_new(mpt_context *ctx) {
    mpt_dataset *d = (mpt_dataset *)mpt__calloc(ctx, sizeof *d);
    if (!d) return NULL;
    d->ctx = ctx;
    d->root = d;
    d->refs = 1;
    return d;
}

/* The normalisation tables. fmaf rounds x·scale + offset once, whatever
   the compiler's contraction settings, so every build agrees. */
static void mpt__dataset_set_scale(mpt_dataset *d, float scale, float offset) {
    int i;
    d->scale = scale;
    d->offset = offset;
    for (i = 0; i < 256; i++) {
        d->u8_f32[i] = fmaf((float)i, scale, offset);
        d->u8_f16[i] = mpt_float_to_half(d->u8_f32[i]);
        d->u8_bf16[i] = mpt_float_to_bf16(d->u8_f32[i]);
    }
}

static void mpt__dataset_find_label_range(mpt_dataset *d) {
    const int32_t *y = (const int32_t *)d->y; /* (n) */
    int64_t i;
    if (d->y_dtype != MPT_INT32) return;
    d->label_min = d->label_max = y[0];
    for (i = 1; i < d->n; i++) {
        d->label_min = MPT__MIN(d->label_min, y[i]);
        d->label_max = MPT__MAX(d->label_max, y[i]);
    }
}

static void mpt__dataset_release(mpt_dataset *root) {
    if (--root->refs > 0) return;
    mpt__free(root->ctx, root->owned_x);
    mpt__free(root->ctx, root->owned_y);
    mpt__free(root->ctx, root);
}

MPTDEF void mpt_dataset_destroy(mpt_dataset *d) {
    mpt_dataset *root;
    if (!d) return;
    root = d->root;
    if (d != root) mpt__free(d->ctx, d);
    mpt__dataset_release(root);
}

MPTDEF int64_t mpt_dataset_count(const mpt_dataset *d) { return d ? d->n : 0; }

MPTDEF int mpt_dataset_sample_shape(const mpt_dataset *d, int64_t *shape) {
    if (!d) return 0;
    if (shape) memcpy(shape, d->x_shape, sizeof(int64_t) * (size_t)d->x_rank);
    return d->x_rank;
}

/* ---- mpt_dataset_create: checking caller arrays --------------------------- */

/* Index of the first NaN or inf among n elements of a float dtype, or -1. */
static int64_t mpt__first_nonfinite(mpt_dtype dtype, const void *data, int64_t n) {
    int64_t i;
    if (dtype == MPT_FLOAT32) {
        /* The bits, through memcpy (one load): no aliasing question, and
           no -ffast-math that could fold isfinite() to 1. */
        const float *f = (const float *)data; /* (n) */
        for (i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, f + i, 4);
            if ((u & 0x7f800000u) == 0x7f800000u) return i;
        }
    } else {
        /* float16: exponent 0x7c00; bfloat16: 0x7f80 */
        const uint16_t *u = (const uint16_t *)data; /* (n) half bits */
        uint16_t e = dtype == MPT_FLOAT16 ? 0x7c00u : 0x7f80u;
        for (i = 0; i < n; i++)
            if ((u[i] & e) == e) return i;
    }
    return -1;
}

static float mpt__element_f32(mpt_dtype dtype, const void *data, int64_t i) {
    if (dtype == MPT_FLOAT16) return mpt_half_to_float(((const mpt_half *)data)[i]);
    if (dtype == MPT_BFLOAT16) return mpt_bf16_to_float(((const mpt_bf16 *)data)[i]);
    return ((const float *)data)[i];
}

/* NaN and inf in x or y, named by sample and element. */
static mpt_status mpt__check_finite(mpt_context *ctx, const char *what, const mpt_tensor *t) {
    int64_t n = mpt_tensor_count(t), per = n / t->shape[0];
    int64_t bad = mpt__first_nonfinite(t->dtype, t->data, n);
    if (bad < 0) return MPT_OK;
    return mpt__fail(ctx, MPT_ERR_NUMERIC,
                     "dataset: %s sample %lld holds %g (element %lld of the sample, %s)", what,
                     (long long)(bad / per), (double)mpt__element_f32(t->dtype, t->data, bad),
                     (long long)(bad % per), mpt_dtype_name(t->dtype));
}

static mpt_status mpt__check_dataset_tensor(mpt_context *ctx, const char *what,
                                            const mpt_tensor *t) {
    char s[96];
    int64_t count, bytes;
    int i;
    if (!t) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: NULL %s", what);
    if (mpt_dtype_size(t->dtype) == 0)
        return mpt__fail(ctx, MPT_ERR_DTYPE, "dataset: %s has unknown dtype %d", what,
                         (int)t->dtype);
    if (t->rank < 1 || t->rank > MPT_MAX_RANK)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "dataset: %s has rank %d, not 1..%d", what, t->rank,
                         MPT_MAX_RANK);
    mpt_shape_format(s, sizeof s, t->rank, t->shape);
    for (i = 0; i < t->rank; i++)
        if (t->shape[i] <= 0)
            return mpt__fail(ctx, MPT_ERR_SHAPE, "dataset: %s shape %s has a dimension <= 0",
                             what, s);
    count = mpt__shape_count(t->rank, t->shape);
    if (count < 0 || !mpt__mul_ok(count, (int64_t)mpt_dtype_size(t->dtype), &bytes) ||
        (uint64_t)bytes > (uint64_t)SIZE_MAX)
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "dataset: %s shape %s is too large", what, s);
    if (!t->data)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: %s has NULL data", what);
    if (t->device != MPT_DEVICE_CPU)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED, "dataset: %s must be in CPU memory", what);
    return MPT_OK;
}

static mpt_status mpt__check_dataset_x(mpt_context *ctx, const mpt_tensor *x) {
    char s[96];
    if (x->dtype != MPT_UINT8 && !mpt_dtype_is_float(x->dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "dataset: x dtype %s is not uint8, float32, float16 or bfloat16",
                         mpt_dtype_name(x->dtype));
    if (x->rank < 2)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: x shape %s needs rank >= 2: (n, sample...)",
                         mpt_shape_format(s, sizeof s, x->rank, x->shape));
    return mpt_dtype_is_float(x->dtype) ? mpt__check_finite(ctx, "x", x) : MPT_OK;
}

/* y: int32 class ids (n,) or (n, 1), each >= 0; or float32 targets (n, ...). */
static mpt_status mpt__check_dataset_y(mpt_context *ctx, const mpt_tensor *y) {
    char s[96];
    int64_t i;
    mpt_shape_format(s, sizeof s, y->rank, y->shape);
    if (y->dtype == MPT_FLOAT32) {
        if (y->rank < 2)
            return mpt__fail(ctx, MPT_ERR_SHAPE,
                             "dataset: float32 targets y %s need rank >= 2: (n, ...), e.g. (n, 1)",
                             s);
        return mpt__check_finite(ctx, "y", y);
    }
    if (y->dtype != MPT_INT32)
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "dataset: y dtype %s is neither int32 (class ids) nor float32 (targets)",
                         mpt_dtype_name(y->dtype));
    if (y->rank > 2 || (y->rank == 2 && y->shape[1] != 1))
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: int32 class ids y %s must be (n,) or (n, 1); one-hot or "
                         "other targets are float32", s);
    for (i = 0; i < y->shape[0]; i++)
        if (((const int32_t *)y->data)[i] < 0)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "dataset: y sample %lld is class id %d, which is negative",
                             (long long)i, (int)((const int32_t *)y->data)[i]);
    return MPT_OK;
}

static mpt_status mpt__check_dataset_desc(mpt_context *ctx, const mpt_dataset_desc *desc) {
    char sx[96], sy[96];
    if (!desc) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: NULL descriptor");
    MPT__CHECK(mpt__check_dataset_tensor(ctx, "x", desc->x));
    MPT__CHECK(mpt__check_dataset_tensor(ctx, "y", desc->y));
    if (desc->x->shape[0] != desc->y->shape[0])
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "dataset: x %s has %lld samples but y %s has %lld",
                         mpt_shape_format(sx, sizeof sx, desc->x->rank, desc->x->shape),
                         (long long)desc->x->shape[0],
                         mpt_shape_format(sy, sizeof sy, desc->y->rank, desc->y->shape),
                         (long long)desc->y->shape[0]);
    if (!isfinite(desc->scale) || !isfinite(desc->offset))
        return mpt__fail(ctx, MPT_ERR_NUMERIC, "dataset: scale %g and offset %g must be finite",
                         (double)desc->scale, (double)desc->offset);
    MPT__CHECK(mpt__check_dataset_x(ctx, desc->x));
    return mpt__check_dataset_y(ctx, desc->y);
}

/* d->x or d->y: the caller's buffer, or an owned copy of it. */
static mpt_status mpt__dataset_take(mpt_context *ctx, const mpt_tensor *t, int copy,
                                    const void **data, void **owned) {
    size_t bytes = mpt_tensor_bytes(t);
    *data = t->data;
    if (!copy) return MPT_OK;
    *owned = mpt__alloc(ctx, bytes);
    if (!*owned)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset: cannot allocate %zu bytes to copy",
                         bytes);
    memcpy(*owned, t->data, bytes);
    *data = *owned;
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_create(mpt_context *ctx, const mpt_dataset_desc *desc,
                                     mpt_dataset **out) {
    mpt_dataset *d;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset: NULL out");
    *out = NULL;
    MPT__CHECK(mpt__check_dataset_desc(ctx, desc));
    d = mpt__dataset_new(ctx);
    if (!d) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset: out of memory");
    d->n = desc->x->shape[0];
    d->x_dtype = desc->x->dtype;
    d->x_rank = desc->x->rank - 1;
    memcpy(d->x_shape, desc->x->shape + 1, sizeof(int64_t) * (size_t)d->x_rank);
    d->x_count = mpt__shape_count(d->x_rank, d->x_shape);
    d->y_dtype = desc->y->dtype;
    d->y_rank = d->y_dtype == MPT_INT32 ? 0 : desc->y->rank - 1;
    memcpy(d->y_shape, desc->y->shape + 1, sizeof(int64_t) * (size_t)d->y_rank);
    d->y_count = mpt__shape_count(d->y_rank, d->y_shape);
    s = mpt__dataset_take(ctx, desc->x, desc->copy, &d->x, &d->owned_x);
    if (s == MPT_OK) s = mpt__dataset_take(ctx, desc->y, desc->copy, &d->y, &d->owned_y);
    if (s != MPT_OK) {
        mpt_dataset_destroy(d);
        return s;
    }
    mpt__dataset_set_scale(d, desc->scale != 0 ? desc->scale : 1.0f / 255.0f, desc->offset);
    mpt__dataset_find_label_range(d);
    *out = d;
    return MPT_OK;
}

/* ---- views ---------------------------------------------------------------- */

static mpt_dataset *mpt__dataset_view(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                      int64_t n) {
    mpt_dataset *v = (mpt_dataset *)mpt__alloc(ctx, sizeof *v);
    if (!v) return NULL;
    *v = *d;
    v->ctx = ctx;
    v->refs = 0;
    v->owned_x = v->owned_y = NULL;
    v->n = n;
    v->x = (const char *)d->x +
           (size_t)first * (size_t)d->x_count * mpt_dtype_size(d->x_dtype);
    v->y = (const char *)d->y +
           (size_t)first * (size_t)d->y_count * mpt_dtype_size(d->y_dtype);
    mpt__dataset_find_label_range(v);
    /* The one change split makes to its const argument: the root counts
       the view, so that it outlives it whatever the order of destroys. */
    v->root->refs++;
    return v;
}

MPTDEF mpt_status mpt_dataset_split(mpt_context *ctx, const mpt_dataset *d, int64_t first,
                                    mpt_dataset **head, mpt_dataset **tail) {
    mpt_dataset *h = NULL, *t = NULL;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (head) *head = NULL;
    if (tail) *tail = NULL;
    if (!d || (!head && !tail))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "dataset split: NULL %s",
                         d ? "head and tail" : "dataset");
    if (first <= 0 || first >= d->n)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "dataset split: first %lld leaves a part empty (the dataset has %lld "
                         "samples; first must be in 1..%lld)",
                         (long long)first, (long long)d->n, (long long)d->n - 1);
    if (head && !(h = mpt__dataset_view(ctx, d, 0, first)))
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset split: out of memory");
    if (tail && !(t = mpt__dataset_view(ctx, d, first, d->n - first))) {
        mpt_dataset_destroy(h);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "dataset split: out of memory");
    }
    if (head) *head = h;
    if (tail) *tail = t;
    return MPT_OK;
}

/* ---- what the training loop reads ----------------------------------------- */

/* MPT_INT32 (class ids) or MPT_FLOAT32 (targets). */
MPT__DATA_API mpt_dtype mpt__dataset_label_dtype(const mpt_dataset *d) { return d->y_dtype; }

/* 1 and the smallest and largest class id for class ids; 0 for targets. */
MPT__DATA_API int mpt__dataset_label_range(const mpt_dataset *d, int32_t *min, int32_t *max) {
    if (d->y_dtype != MPT_INT32) return 0;
    if (min) *min = d->label_min;
    if (max) *max = d->label_max;
    return 1;
}

/* Elements of one sample's target: 1 for class ids. */
MPT__DATA_API int64_t mpt__dataset_label_count(const mpt_dataset *d) { return d->y_count; }

/* One sample's target shape (for comparing with the model's output); returns
   its rank, 0 for class ids. */
MPT__DATA_API int mpt__dataset_label_shape(const mpt_dataset *d, int64_t *shape) {
    if (shape && d->y_rank > 0) memcpy(shape, d->y_shape, sizeof(int64_t) * (size_t)d->y_rank);
    return d->y_rank;
}

/* n uint8 values normalised into dtype through the dataset's tables. */
static void mpt__expand_u8(const mpt_dataset *d, mpt_dtype dtype, void *dst, const uint8_t *src,
                           int64_t n) {
    int64_t i;
    if (dtype == MPT_FLOAT32) {
        float *o = (float *)dst; /* (n) */
        for (i = 0; i < n; i++) o[i] = d->u8_f32[src[i]];
    } else {
        const uint16_t *table = dtype == MPT_FLOAT16 ? d->u8_f16 : d->u8_bf16;
        uint16_t *o = (uint16_t *)dst; /* (n) */
        for (i = 0; i < n; i++) o[i] = table[src[i]];
    }
}

/* Writes samples indices[0..n) (each in [0, count)) of d, in that order,
   into x (n, sample shape) in x_dtype (float32, float16 or bfloat16) and y
   (n, label count) int32 or float32; either may be NULL when not wanted.
   Serial and never uses the pool, so the loader's thread may call it while
   the pool works; ctx only picks the vector conversion (NULL: portable). */
MPT__DATA_API void mpt__dataset_gather(mpt_context *ctx, const mpt_dataset *d,
                                       const int64_t *indices, int64_t n, mpt_dtype x_dtype,
                                       void *x, void *y) {
    size_t x_in = (size_t)d->x_count * mpt_dtype_size(d->x_dtype);
    size_t x_out = (size_t)d->x_count * mpt_dtype_size(x_dtype);
    size_t y_bytes = (size_t)d->y_count * 4; /* int32 or float32 */
    mpt__convert_fn convert = NULL;
    int64_t i;
    if (d->x_dtype != MPT_UINT8 && d->x_dtype != x_dtype)
        convert = mpt__convert_kernel(ctx ? ctx->cpu : 0, x_dtype, d->x_dtype);
    for (i = 0; x && i < n; i++) {
        const char *src = (const char *)d->x + (size_t)indices[i] * x_in;
        char *dst = (char *)x + (size_t)i * x_out;
        if (d->x_dtype == MPT_UINT8)
            mpt__expand_u8(d, x_dtype, dst, (const uint8_t *)src, d->x_count);
        else if (convert)
            convert(x_dtype, dst, d->x_dtype, src, d->x_count);
        else
            memcpy(dst, src, x_in);
    }
    for (i = 0; y && i < n; i++)
        memcpy((char *)y + (size_t)i * y_bytes, (const char *)d->y + (size_t)indices[i] * y_bytes,
               y_bytes);
}

/* ---- files: gzip through zlib, or plain ----------------------------------- */

typedef struct mpt__file {
    const char *path;
    int cut;      /* the gzip stream ended early: a truncated .gz file */
#ifndef MPT_NO_ZLIB
    gzFile gz;
#else
    FILE *f;
#endif
} mpt__file;

static mpt_status mpt__file_open(mpt_context *ctx, mpt__file *f, const char *path) {
    struct stat st;
    f->path = path;
    /* open() succeeds on a directory; say what it is rather than "read error". */
    if (stat(path, &st) != 0)
        return mpt__fail(ctx, MPT_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode))
        return mpt__fail(ctx, MPT_ERR_IO, "cannot read '%s': it is a directory", path);
    errno = 0;
#ifndef MPT_NO_ZLIB
    f->gz = gzopen(path, "rb");
    if (f->gz) gzbuffer(f->gz, 1u << 17); /* fewer, larger reads of a 26 MB file */
    if (!f->gz)
#else
    f->f = fopen(path, "rb");
    if (!f->f)
#endif
        return mpt__fail(ctx, MPT_ERR_IO, "cannot open '%s': %s", path,
                         errno ? strerror(errno) : "out of memory");
    return MPT_OK;
}

static void mpt__file_close(mpt__file *f) {
#ifndef MPT_NO_ZLIB
    if (f->gz) gzclose(f->gz);
    f->gz = NULL;
#else
    if (f->f) fclose(f->f);
    f->f = NULL;
#endif
}

/* Why the last read stopped short: MPT_OK at the end of the file, where
   f->cut tells a gzip stream cut short (the caller, which knows how many
   bytes it expected, words that error). */
static mpt_status mpt__file_error(mpt_context *ctx, mpt__file *f) {
#ifndef MPT_NO_ZLIB
    int err = Z_OK;
    const char *msg = gzerror(f->gz, &err);
    size_t len = strlen(f->path);
    if (err == Z_OK) return MPT_OK;
    /* zlib's message starts with the path, which ours names already. */
    if (strncmp(msg, f->path, len) == 0 && strncmp(msg + len, ": ", 2) == 0) msg += len + 2;
    if (err == Z_BUF_ERROR) {
        f->cut = 1;
        return MPT_OK;
    }
    if (err == Z_ERRNO)
        return mpt__fail(ctx, MPT_ERR_IO, "cannot read '%s': %s", f->path, msg);
    if (err == Z_MEM_ERROR)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': zlib is out of memory",
                         f->path);
    /* zlib decompresses ahead of what was asked, so where the damage is
       cannot be told. */
    return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' is corrupted: bad gzip data (zlib: %s)", f->path,
                     msg);
#else
    if (!ferror(f->f)) return MPT_OK;
    return mpt__fail(ctx, MPT_ERR_IO, "cannot read '%s': %s", f->path, strerror(errno));
#endif
}

/* Reads up to n bytes; *got is less than n only at the end of the file. */
static mpt_status mpt__file_read(mpt_context *ctx, mpt__file *f, void *buf, int64_t n,
                                 int64_t *got) {
    *got = 0;
    while (*got < n) {
        /* gzread counts in unsigned int: ask for at most 1 GiB at a time. */
        unsigned ask = (unsigned)MPT__MIN(n - *got, (int64_t)1 << 30);
#ifndef MPT_NO_ZLIB
        int r = gzread(f->gz, (char *)buf + *got, ask);
#else
        long r = (long)fread((char *)buf + *got, 1, ask, f->f);
#endif
        if (r > 0) *got += r;
        if (r < (int64_t)ask) return mpt__file_error(ctx, f);
    }
    return MPT_OK;
}

/* ---- IDX (MNIST-format) files --------------------------------------------

   Big-endian: bytes 0 and 1 zero, byte 2 the element type (0x08 unsigned
   byte), byte 3 the number of dimensions; then each dimension as a u32;
   then the elements, row-major. Images are 0x00000803 (n, rows, cols),
   labels 0x00000801 (n). */

typedef struct mpt__idx {
    mpt__file file;
    int n_dims;
    int64_t dims[3];
    int64_t header_bytes;  /* 4 + 4 · n_dims                   */
    int64_t data_bytes;    /* the product of dims (uint8 data) */
} mpt__idx;

static uint32_t mpt__be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static const char *mpt__idx_type_name(int code) {
    switch (code) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0b: return "int16";
    case 0x0c: return "int32";
    case 0x0d: return "float32";
    case 0x0e: return "float64";
    default: return NULL;
    }
}

static mpt_status mpt__idx_check_magic(mpt_context *ctx, const mpt__idx *idx,
                                       const unsigned char *m, const char *what, int dims) {
    const char *path = idx->file.path;
    const char *type = mpt__idx_type_name(m[2]);
#ifdef MPT_NO_ZLIB
    if (m[0] == 0x1f && m[1] == 0x8b)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED,
                         "'%s' is gzip-compressed, and this build has no zlib (MPT_NO_ZLIB): "
                         "gunzip it first", path);
#endif
    if (m[0] != 0 || m[1] != 0 || !type)
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' is not an IDX file: magic number 0x%08x (an IDX %s file starts "
                         "with 0x%08x)",
                         path, (unsigned)mpt__be32(m), what, 0x800u + (unsigned)dims);
    if (m[2] != 0x08)
        return mpt__fail(ctx, MPT_ERR_UNSUPPORTED,
                         "'%s' holds IDX elements of type 0x%02x (%s); only 0x08 (unsigned "
                         "byte) is supported", path, m[2], type);
    if (m[3] != dims)
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' has %d dimension%s (magic 0x%08x); an IDX %s file has %d (0x%08x)",
                         path, m[3], m[3] == 1 ? "" : "s", (unsigned)mpt__be32(m), what, dims,
                         0x800u + (unsigned)dims);
    return MPT_OK;
}

/* The header's sizes: each > 0, and their product (the data bytes) must
   fit in memory's sizes. */
static mpt_status mpt__idx_check_dims(mpt_context *ctx, mpt__idx *idx) {
    int i;
    idx->data_bytes = 1;
    for (i = 0; i < idx->n_dims; i++) {
        if (idx->dims[i] == 0)
            return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s': IDX dimension %d of %d is 0",
                             idx->file.path, i, idx->n_dims);
        if (!mpt__mul_ok(idx->data_bytes, idx->dims[i], &idx->data_bytes) ||
            (uint64_t)idx->data_bytes > (uint64_t)SIZE_MAX / 4)
            return mpt__fail(ctx, MPT_ERR_OVERFLOW,
                             "'%s': IDX dimensions %lld x %lld x %lld are too large",
                             idx->file.path, (long long)idx->dims[0],
                             (long long)(idx->n_dims > 1 ? idx->dims[1] : 1),
                             (long long)(idx->n_dims > 2 ? idx->dims[2] : 1));
    }
    return MPT_OK;
}

/* "'f' is truncated: its IDX header promises 7856 bytes, the file has 7000". */
static mpt_status mpt__idx_truncated(mpt_context *ctx, const mpt__idx *idx, const char *part,
                                     int64_t expected, int64_t actual) {
    const char *how = "";
#ifndef MPT_NO_ZLIB
    if (idx->file.cut)
        how = " (uncompressed; its gzip stream is cut short)";
    else if (!gzdirect(idx->file.gz))
        how = " (uncompressed)";
#endif
    return mpt__fail(ctx, MPT_ERR_FORMAT, "'%s' is truncated: %s %lld bytes, the file has %lld%s",
                     idx->file.path, part, (long long)expected, (long long)actual, how);
}

/* Opens path and reads its header: `dims` dimensions of IDX unsigned bytes. */
static mpt_status mpt__idx_open(mpt_context *ctx, mpt__idx *idx, const char *path,
                                const char *what, int dims) {
    unsigned char h[16]; /* magic + up to 3 dimensions */
    int64_t got;
    int i;
    memset(idx, 0, sizeof *idx);
    MPT__CHECK(mpt__file_open(ctx, &idx->file, path));
    MPT__CHECK(mpt__file_read(ctx, &idx->file, h, 4, &got));
    if (got < 4) return mpt__idx_truncated(ctx, idx, "an IDX magic number needs", 4, got);
    MPT__CHECK(mpt__idx_check_magic(ctx, idx, h, what, dims));
    idx->n_dims = dims;
    idx->header_bytes = 4 + 4 * (int64_t)dims;
    MPT__CHECK(mpt__file_read(ctx, &idx->file, h + 4, 4 * (int64_t)dims, &got));
    if (got < 4 * dims)
        return mpt__idx_truncated(ctx, idx, "its IDX header needs", idx->header_bytes, 4 + got);
    for (i = 0; i < dims; i++) idx->dims[i] = mpt__be32(h + 4 + 4 * i);
    return mpt__idx_check_dims(ctx, idx);
}

/* After the data: anything left is an error (a file that does not match its
   header); reading on also makes zlib check the gzip CRC and length. */
static mpt_status mpt__idx_expect_end(mpt_context *ctx, mpt__idx *idx) {
    unsigned char rest[4096];
    int64_t got, extra = 0, end = idx->header_bytes + idx->data_bytes;
    do {
        MPT__CHECK(mpt__file_read(ctx, &idx->file, rest, sizeof rest, &got));
        extra += got;
    } while (got == (int64_t)sizeof rest && extra < ((int64_t)1 << 20));
    if (extra == 0 && idx->file.cut) /* all the data, but no CRC to check it by */
        return mpt__fail(ctx, MPT_ERR_FORMAT,
                         "'%s' is truncated: its gzip stream ends before its CRC and length",
                         idx->file.path);
    if (extra == 0) return MPT_OK;
    return mpt__fail(ctx, MPT_ERR_FORMAT,
                     "'%s' has %s%lld trailing byte%s after the %lld bytes its IDX header "
                     "describes",
                     idx->file.path, got == (int64_t)sizeof rest ? "more than " : "",
                     (long long)extra, extra == 1 ? "" : "s", (long long)end);
}

/* The first buffer for the data; it doubles as data arrives, up to what
   the header promises, so a corrupted header that promises terabytes ends
   as a truncated file rather than as a huge allocation. */
#define MPT__IDX_FIRST_CHUNK ((int64_t)64 << 20)

static mpt_status mpt__idx_grow(mpt_context *ctx, const mpt__idx *idx, unsigned char **buf,
                                int64_t have, int64_t *cap) {
    int64_t next = MPT__MIN(*cap * 2, idx->data_bytes);
    unsigned char *bigger = (unsigned char *)mpt__alloc(ctx, (size_t)next);
    if (!bigger)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY,
                         "reading '%s': cannot allocate %lld bytes", idx->file.path,
                         (long long)next);
    memcpy(bigger, *buf, (size_t)have);
    mpt__free(ctx, *buf);
    *buf = bigger;
    *cap = next;
    return MPT_OK;
}

/* Reads the data (idx->data_bytes) into *out, a new buffer, and checks that
   the file ends there. */
static mpt_status mpt__idx_read_data(mpt_context *ctx, mpt__idx *idx, unsigned char **out) {
    int64_t cap = MPT__MIN(idx->data_bytes, MPT__IDX_FIRST_CHUNK), have = 0, got;
    unsigned char *buf = (unsigned char *)mpt__alloc(ctx, (size_t)cap); /* (data_bytes) */
    mpt_status s = MPT_OK;
    if (!buf)
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': cannot allocate %lld bytes",
                         idx->file.path, (long long)cap);
    for (;;) {
        s = mpt__file_read(ctx, &idx->file, buf + have, cap - have, &got);
        have += got;
        if (s != MPT_OK) break;
        if (have < cap) {
            s = mpt__idx_truncated(ctx, idx, "its IDX header promises",
                                   idx->header_bytes + idx->data_bytes, idx->header_bytes + have);
            break;
        }
        if (have == idx->data_bytes) {
            s = mpt__idx_expect_end(ctx, idx);
            break;
        }
        s = mpt__idx_grow(ctx, idx, &buf, have, &cap);
        if (s != MPT_OK) break;
    }
    if (s != MPT_OK) {
        mpt__free(ctx, buf);
        return s;
    }
    *out = buf;
    return MPT_OK;
}

/* Labels: n unsigned bytes widened to int32 class ids. */
static mpt_status mpt__idx_read_labels(mpt_context *ctx, mpt__idx *idx, int32_t **out) {
    unsigned char *bytes = NULL; /* (n) */
    int32_t *labels;             /* (n) */
    int64_t i;
    MPT__CHECK(mpt__idx_read_data(ctx, idx, &bytes));
    labels = (int32_t *)mpt__alloc(ctx, (size_t)idx->data_bytes * sizeof(int32_t));
    if (!labels) {
        mpt__free(ctx, bytes);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "reading '%s': out of memory",
                         idx->file.path);
    }
    for (i = 0; i < idx->data_bytes; i++) labels[i] = bytes[i];
    mpt__free(ctx, bytes);
    *out = labels;
    return MPT_OK;
}

/* Both headers first, so that a count mismatch is found before any data is
   read; then images, then labels. */
static mpt_status mpt__load_idx(mpt_context *ctx, mpt__idx *img, mpt__idx *lab,
                                const char *images_path, const char *labels_path,
                                mpt_dataset *d) {
    unsigned char *x = NULL;
    int32_t *y = NULL;
    MPT__CHECK(mpt__idx_open(ctx, img, images_path, "image", 3));
    MPT__CHECK(mpt__idx_open(ctx, lab, labels_path, "label", 1));
    if (img->dims[0] != lab->dims[0])
        return mpt__fail(ctx, MPT_ERR_SHAPE, "'%s' holds %lld images but '%s' holds %lld labels",
                         images_path, (long long)img->dims[0], labels_path,
                         (long long)lab->dims[0]);
    MPT__CHECK(mpt__idx_read_data(ctx, img, &x));
    d->owned_x = x;
    MPT__CHECK(mpt__idx_read_labels(ctx, lab, &y));
    d->owned_y = y;
    d->n = img->dims[0];
    d->x_dtype = MPT_UINT8;
    d->x_rank = 3;
    d->x_shape[0] = img->dims[1];
    d->x_shape[1] = img->dims[2];
    d->x_shape[2] = 1;
    d->x_count = img->dims[1] * img->dims[2];
    d->x = x;
    d->y_dtype = MPT_INT32;
    d->y_count = 1;
    d->y = y;
    mpt__dataset_set_scale(d, 1.0f / 255.0f, 0.0f);
    mpt__dataset_find_label_range(d);
    return MPT_OK;
}

MPTDEF mpt_status mpt_dataset_load_idx(mpt_context *ctx, const char *images_path,
                                       const char *labels_path, mpt_dataset **out) {
    mpt__idx img, lab;
    mpt_dataset *d;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !images_path || !labels_path)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_idx: NULL %s",
                         !out ? "out" : !images_path ? "images_path" : "labels_path");
    *out = NULL;
    d = mpt__dataset_new(ctx);
    if (!d) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "load_idx: out of memory");
    memset(&img, 0, sizeof img);
    memset(&lab, 0, sizeof lab);
    s = mpt__load_idx(ctx, &img, &lab, images_path, labels_path, d);
    mpt__file_close(&img.file);
    mpt__file_close(&lab.file);
    if (s != MPT_OK) {
        mpt_dataset_destroy(d);
        return s;
    }
    *out = d;
    return MPT_OK;
}

/* dir/name, compressed first (then plain) where zlib is there, plain
   first otherwise so that a plain copy beside a .gz one still loads. */
static mpt_status mpt__mnist_path(mpt_context *ctx, const char *dir, const char *name,
                                  char *path, size_t size) {
    struct stat st;
    int k;
    for (k = 0; k < 2; k++) {
#ifndef MPT_NO_ZLIB
        int gz = k == 0;
#else
        int gz = k == 1;
#endif
        int len = snprintf(path, size, "%s/%s%s", dir, name, gz ? ".gz" : "");
        if (len < 0 || (size_t)len >= size)
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_mnist: directory name '%s' is "
                             "too long", dir);
        if (stat(path, &st) == 0) return MPT_OK;
    }
    return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: neither '%s/%s.gz' nor '%s/%s' exists", dir,
                     name, dir, name);
}

MPTDEF mpt_status mpt_dataset_load_mnist(mpt_context *ctx, const char *dir, int test,
                                         mpt_dataset **out) {
    char images[4096], labels[4096];
    const char *part = test ? "t10k" : "train";
    char name[64];
    struct stat st;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !dir)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "load_mnist: NULL %s", dir ? "out" : "dir");
    *out = NULL;
    if (stat(dir, &st) != 0)
        return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: cannot open directory '%s': %s", dir,
                         strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return mpt__fail(ctx, MPT_ERR_IO, "load_mnist: '%s' is not a directory", dir);
    snprintf(name, sizeof name, "%s-images-idx3-ubyte", part);
    MPT__CHECK(mpt__mnist_path(ctx, dir, name, images, sizeof images));
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte", part);
    MPT__CHECK(mpt__mnist_path(ctx, dir, name, labels, sizeof labels));
    return mpt_dataset_load_idx(ctx, images, labels, out);
}

/* ---- the prefetching batch loader -----------------------------------------

   Two slots, batch b in slot b % 2. The consumer (fit's thread) holds the
   batch it last received until its next call; meanwhile the loader thread
   fills the other slot with the batch after. So loading b + 1 overlaps
   computing on b, and a slot is never written while it is being read. */

typedef struct mpt__loader {
    mpt_context *ctx;
    const mpt_dataset *d;
    mpt_dtype x_dtype;
    int64_t max_batch;
    void *block;            /* the one allocation behind the four buffers */
    void *x_buf[2];         /* (max_batch, sample shape) x_dtype          */
    void *y_buf[2];         /* (max_batch, label count) int32 or float32  */
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t cond;    /* any change of the state below              */
    int stop;
    /* The epoch; reset only while no batch is being loaded. */
    const int64_t *order;   /* (n) sample indices, borrowed               */
    int64_t n, batch_size, n_batches;
    int64_t produce;        /* next batch the thread loads                */
    int64_t consume;        /* next batch next() returns                  */
    int64_t held;           /* batch the consumer holds, -1 if none       */
    int64_t slot_batch[2];  /* batch ready in each slot, -1 if free       */
    int loading;            /* the thread is filling slot produce % 2     */
} mpt__loader;

static int mpt__loader_can_load(const mpt__loader *l) {
    return l->produce < l->n_batches && l->slot_batch[l->produce & 1] < 0;
}

static void *mpt__loader_main(void *arg) {
    mpt__loader *l = (mpt__loader *)arg;
    pthread_mutex_lock(&l->mutex);
    for (;;) {
        int64_t b, first, count;
        const int64_t *indices;
        int slot;
        while (!l->stop && !mpt__loader_can_load(l)) pthread_cond_wait(&l->cond, &l->mutex);
        if (l->stop) break;
        b = l->produce;
        slot = (int)(b & 1);
        first = b * l->batch_size;
        count = MPT__MIN(l->batch_size, l->n - first);
        indices = l->order + first;
        l->loading = 1; /* start_epoch waits for this to clear */
        pthread_mutex_unlock(&l->mutex);
        mpt__dataset_gather(l->ctx, l->d, indices, count, l->x_dtype, l->x_buf[slot],
                            l->y_buf[slot]);
        pthread_mutex_lock(&l->mutex);
        l->loading = 0;
        l->slot_batch[slot] = b;
        l->produce = b + 1;
        pthread_cond_broadcast(&l->cond);
    }
    pthread_mutex_unlock(&l->mutex);
    return NULL;
}

/* Carves the four batch buffers out of one block, each 64-byte aligned. */
static mpt_status mpt__loader_alloc(mpt__loader *l) {
    int64_t xb, yb, total;
    int k;
    if (!mpt__mul_ok(l->max_batch, l->d->x_count * (int64_t)mpt_dtype_size(l->x_dtype), &xb) ||
        !mpt__mul_ok(l->max_batch, l->d->y_count * 4, &yb) ||
        !mpt__add_ok(xb, yb, &total) || !mpt__add_ok(total, 2 * MPT__ALIGN, &total) ||
        !mpt__mul_ok(total, 2, &total) || (uint64_t)total > (uint64_t)SIZE_MAX)
        return mpt__fail(l->ctx, MPT_ERR_OVERFLOW, "loader: batches of %lld samples are too large",
                         (long long)l->max_batch);
    xb = (xb + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    yb = (yb + MPT__ALIGN - 1) / MPT__ALIGN * MPT__ALIGN;
    l->block = mpt__alloc(l->ctx, (size_t)total);
    if (!l->block)
        return mpt__fail(l->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "loader: cannot allocate %lld bytes for two batches of %lld samples",
                         (long long)total, (long long)l->max_batch);
    for (k = 0; k < 2; k++) {
        l->x_buf[k] = (char *)l->block + (size_t)k * (size_t)(xb + yb);
        l->y_buf[k] = (char *)l->x_buf[k] + (size_t)xb;
    }
    return MPT_OK;
}

/* A loader of batches of up to max_batch samples of d, x in x_dtype (a
   float dtype), with its thread started and no epoch yet. d must outlive it. */
MPT__DATA_API mpt_status mpt__loader_create(mpt_context *ctx, const mpt_dataset *d,
                                            int64_t max_batch, mpt_dtype x_dtype,
                                            mpt__loader **out) {
    mpt__loader *l;
    mpt_status s;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out || !d)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loader: NULL %s", d ? "out" : "dataset");
    *out = NULL;
    if (max_batch <= 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "loader: max_batch %lld must be > 0",
                         (long long)max_batch);
    if (!mpt_dtype_is_float(x_dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "loader: batch dtype %s is not a float dtype",
                         mpt_dtype_name(x_dtype));
    l = (mpt__loader *)mpt__calloc(ctx, sizeof *l);
    if (!l) return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "loader: out of memory");
    l->ctx = ctx;
    l->d = d;
    l->x_dtype = x_dtype;
    l->max_batch = max_batch;
    l->held = l->slot_batch[0] = l->slot_batch[1] = -1;
    s = mpt__loader_alloc(l);
    if (s != MPT_OK) {
        mpt__free(ctx, l);
        return s;
    }
    pthread_mutex_init(&l->mutex, NULL);
    pthread_cond_init(&l->cond, NULL);
    if (pthread_create(&l->thread, NULL, mpt__loader_main, l) != 0) {
        pthread_mutex_destroy(&l->mutex);
        pthread_cond_destroy(&l->cond);
        mpt__free(ctx, l->block);
        mpt__free(ctx, l);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "loader: cannot start its thread");
    }
    *out = l;
    return MPT_OK;
}

/* Every index must name a sample: a wrong one would read outside x. */
static int mpt__loader_epoch_ok(mpt__loader *l, const int64_t *order, int64_t n,
                                int64_t batch_size) {
    int64_t i;
    if (n < 0 || (n > 0 && !order) || batch_size <= 0 || batch_size > l->max_batch) {
        mpt__fail(l->ctx, MPT_ERR_INVALID_ARGUMENT,
                  "loader: epoch of %lld samples in batches of %lld (max %lld)%s", (long long)n,
                  (long long)batch_size, (long long)l->max_batch, order ? "" : ", NULL order");
        return 0;
    }
    for (i = 0; i < n; i++)
        if (order[i] < 0 || order[i] >= l->d->n) {
            mpt__fail(l->ctx, MPT_ERR_INVALID_ARGUMENT,
                      "loader: order[%lld] = %lld is not a sample of this dataset (0..%lld)",
                      (long long)i, (long long)order[i], (long long)l->d->n - 1);
            return 0;
        }
    return 1;
}

/* Starts an epoch over order[0..n) (kept by pointer until the next epoch or
   destroy) in batches of batch_size, the last one partial; loading batch 0
   begins now. Ends any epoch in progress. Bad arguments (recorded in the
   context's error) give an epoch with no batches. */
MPT__DATA_API void mpt__loader_start_epoch(mpt__loader *l, const int64_t *order, int64_t n,
                                           int64_t batch_size) {
    int ok = mpt__loader_epoch_ok(l, order, n, batch_size);
    pthread_mutex_lock(&l->mutex);
    while (l->loading) pthread_cond_wait(&l->cond, &l->mutex);
    l->order = order;
    l->n = ok ? n : 0;
    l->batch_size = ok ? batch_size : 1;
    l->n_batches = ok ? (n + batch_size - 1) / batch_size : 0;
    l->produce = l->consume = 0;
    l->held = l->slot_batch[0] = l->slot_batch[1] = -1;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mutex);
}

/* Waits for the next batch and points x (b, sample shape...) in x_dtype
   and y ((b,) int32 or (b, target shape...) float32) at it: borrowed,
   valid until the next call. Returns 0 when the epoch has no more. */
MPT__DATA_API int mpt__loader_next(mpt__loader *l, mpt_tensor *x, mpt_tensor *y) {
    const mpt_dataset *d = l->d;
    int64_t b, count;
    int slot;
    pthread_mutex_lock(&l->mutex);
    if (l->held >= 0) { /* the caller is done with it: the thread may refill it */
        l->slot_batch[l->held & 1] = -1;
        l->held = -1;
        pthread_cond_broadcast(&l->cond);
    }
    if (l->consume >= l->n_batches) {
        pthread_mutex_unlock(&l->mutex);
        return 0;
    }
    b = l->consume++;
    slot = (int)(b & 1);
    while (l->slot_batch[slot] != b) pthread_cond_wait(&l->cond, &l->mutex);
    l->held = b;
    count = MPT__MIN(l->batch_size, l->n - b * l->batch_size);
    pthread_mutex_unlock(&l->mutex);
    memset(x, 0, sizeof *x);
    x->dtype = l->x_dtype;
    x->rank = d->x_rank + 1;
    x->shape[0] = count;
    memcpy(x->shape + 1, d->x_shape, sizeof(int64_t) * (size_t)d->x_rank);
    x->data = l->x_buf[slot];
    memset(y, 0, sizeof *y);
    y->dtype = d->y_dtype;
    y->rank = d->y_rank + 1;
    y->shape[0] = count;
    memcpy(y->shape + 1, d->y_shape, sizeof(int64_t) * (size_t)d->y_rank);
    y->data = l->y_buf[slot];
    return 1;
}

/* Stops and joins the thread (at once, also mid-epoch) and frees the loader. */
MPT__DATA_API void mpt__loader_destroy(mpt__loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mutex);
    l->stop = 1;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mutex);
    pthread_join(l->thread, NULL);
    pthread_mutex_destroy(&l->mutex);
    pthread_cond_destroy(&l->cond);
    mpt__free(l->ctx, l->block);
    mpt__free(l->ctx, l);
}

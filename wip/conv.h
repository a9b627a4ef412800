/* =============================================================================
   Windows over images: the geometry Conv2D and the pooling layers share
   =============================================================================

   One sample is (H, W, C), NHWC. A window of kh × kw pixels slides with
   strides (sh, sw). Padding follows TensorFlow:
     valid: only whole windows, out = floor((in − k) / s) + 1;
     same:  out = ceil(in / s), padded by max((out − 1)·s + k − in, 0)
            pixels, half of them (rounded down) at the top/left, the rest
            at the bottom/right.
   Padding is never materialised: the loops skip pixels outside the image
   (zeros for a convolution, "not there" for pooling). */

typedef struct mpt__win {
    int64_t h, w, c;     /* one input sample (H, W, C)              */
    int64_t kh, kw;      /* window (kernel or pool) size            */
    int64_t sh, sw;      /* strides                                 */
    int64_t top, left;   /* padding before the first row / column   */
    int64_t oh, ow;      /* output rows and columns (0: no window fits) */
} mpt__win;

/* Outputs along one axis, and the padding before the first input. */
static int64_t mpt__win_axis(int64_t in, int64_t k, int64_t s, mpt_padding padding,
                             int64_t *before) {
    int64_t out;
    *before = 0;
    if (padding == MPT_PADDING_VALID) return in < k ? 0 : (in - k) / s + 1;
    out = (in - 1) / s + 1;                             /* ceil(in / s), no overflow  */
    *before = MPT__MAX(k - (in - (out - 1) * s), 0) / 2; /* (out−1)·s + k − in, halved */
    return out;
}

static void mpt__win_init(mpt__win *g, const mpt__layer *L, const int64_t size[2],
                          const int64_t strides[2], mpt_padding padding) {
    g->h = L->in_shape[0];
    g->w = L->in_shape[1];
    g->c = L->in_shape[2];
    g->kh = size[0];
    g->kw = size[1];
    g->sh = strides[0];
    g->sw = strides[1];
    g->oh = mpt__win_axis(g->h, g->kh, g->sh, padding, &g->top);
    g->ow = mpt__win_axis(g->w, g->kw, g->sw, padding, &g->left);
}

/* The rows [*r0, *r1) and columns [*c0, *c1) of the input that output
   pixel (oy, ox)'s window covers, padding cut off. */
static void mpt__win_span(const mpt__win *g, int64_t oy, int64_t ox, int64_t *r0, int64_t *r1,
                          int64_t *c0, int64_t *c1) {
    int64_t y = oy * g->sh - g->top, x = ox * g->sw - g->left;
    *r0 = MPT__MAX(y, 0);
    *r1 = MPT__MIN(y + g->kh, g->h);
    *c0 = MPT__MAX(x, 0);
    *c1 = MPT__MIN(x + g->kw, g->w);
}

/* Image layers take (H, W, C) samples. */
static mpt_status mpt__expect_image(mpt_model *m, const mpt__layer *L) {
    char s[96];
    if (L->in_rank == 3) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                     "%s '%s' expects one sample to be (height, width, channels), got (batch, %s",
                     L->ops->class_name, L->name,
                     mpt_shape_format(s, sizeof s, L->in_rank, L->in_shape) + 1);
}

/* Under 'valid' padding a window larger than the image leaves no output. */
static mpt_status mpt__expect_window_fits(mpt_model *m, const mpt__layer *L, const mpt__win *g,
                                          const char *what) {
    char s[96];
    if (g->oh > 0 && g->ow > 0) return MPT_OK;
    return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                     "%s '%s': %s (%lld, %lld) is larger than the input %s with padding 'valid'",
                     L->ops->class_name, L->name, what, (long long)g->kh, (long long)g->kw,
                     mpt_shape_format(s, sizeof s, L->in_rank, L->in_shape));
}

/* Checks what a window descriptor gives: each of size and strides must be
   > 0, or 0 for its default; `size_required` makes 0 an error. */
static mpt_status mpt__check_window_desc(mpt_model *m, const char *cls, const char *size_name,
                                         const int64_t size[2], int size_required,
                                         const int64_t strides[2], mpt_padding padding) {
    /* Bounded so that no index arithmetic on a window can overflow. */
    const int64_t limit = (int64_t)1 << 30;
    int i;
    for (i = 0; i < 2; i++) {
        if (size[i] < (size_required ? 1 : 0) || size[i] > limit)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: %s (%lld, %lld) must be in 1..%lld%s", cls, size_name,
                             (long long)size[0], (long long)size[1], (long long)limit,
                             size_required ? "" : " (or 0 for the default)");
        if (strides[i] < 0 || strides[i] > limit)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: strides (%lld, %lld) must be in 1..%lld (or 0 for the default)",
                             cls, (long long)strides[0], (long long)strides[1], (long long)limit);
    }
    if (padding != MPT_PADDING_VALID && padding != MPT_PADDING_SAME)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: unknown padding %d (MPT_PADDING_VALID or MPT_PADDING_SAME)", cls,
                         (int)padding);
    return MPT_OK;
}

/* to[0..n) += from[0..n). In blocks of 16 through a local array, which
   tells the compiler the two do not overlap: at -O2 its cheap cost model
   vectorises only loops like these (fixed length, no overlap checks). */
static void mpt__add_f32(float *to, const float *from, int64_t n) {
    int64_t i = 0;
    int k;
    for (; i + 16 <= n; i += 16) {
        float t[16];
        for (k = 0; k < 16; k++) t[k] = to[i + k] + from[i + k];
        for (k = 0; k < 16; k++) to[i + k] = t[k];
    }
    for (; i < n; i++) to[i] += from[i];
}

/* *acc += a·b, overflow-checked; *acc stays -1 once anything overflowed. */
static void mpt__acc_mul(int64_t *acc, int64_t a, int64_t b) {
    int64_t ab;
    if (*acc < 0 || !mpt__mul_ok(a, b, &ab) || !mpt__add_ok(*acc, ab, acc)) *acc = -1;
}

/* =============================================================================
   Conv2D: y = act(conv(x, kernel) + bias)
           x: (B, H, W, C)  kernel: (kh, kw, C, F)  y: (B, OH, OW, F)
   =============================================================================

   As a matrix product (im2col): each output pixel's window, read in
   (kh, kw, C) order, is one row of a matrix `cols`, (B·OH·OW) × (kh·kw·C).
   Keras' kernel layout, row-major, is already the (kh·kw·C) × F matrix, so
       forward:  y  = act(cols · kernel + bias)            (B·OH·OW) × F
       backward: dkernel = colsᵀ · dz,  dcols = dz · kernelᵀ,
                 dx = col2im(dcols): each entry of dcols added back to the
                 pixel it was copied from (float32, a fixed order).
   The whole batch's cols can be large (128 × 24·24 × 288 floats is 85 MB
   in float32), so the batch is cut into chunks of samples whose cols hold
   about MPT__CONV_COLS_BUDGET elements (2^20: 4 MiB in float32): the
   products keep thousands of rows, the workspace stays small, and what
   im2col writes is still in cache when the GEMM packs it (measured on the
   CNN above: 2^20 beat 2^22 by 20-30%). The chunk size depends on the
   layer alone, and kernel gradients are summed chunk after chunk (beta =
   1), so results do not depend on the thread count. A 1×1 kernel with
   stride 1 needs no im2col: the image, seen as (B·H·W) × C, is its own
   cols. */

#ifndef MPT__CONV_COLS_BUDGET
#define MPT__CONV_COLS_BUDGET ((int64_t)1 << 20) /* elements of cols per chunk */
#endif

/* What a Conv2D pass needs, derived from the layer. */
typedef struct mpt__conv_plan {
    mpt__win g;
    int64_t f;      /* filters                                          */
    int64_t kk;     /* kh·kw·C: the length of one row of cols            */
    int64_t pix;    /* OH·OW: output pixels (rows of cols) per sample    */
    int64_t chunk;  /* samples per chunk                                 */
    int identity;   /* 1×1 kernel, stride 1: cols is the image itself    */
    size_t es;      /* bytes of one element of the compute dtype         */
} mpt__conv_plan;

static void mpt__conv_plan_init(mpt__conv_plan *c, const mpt__layer *L, int64_t max_batch) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    int64_t strides[2];
    strides[0] = d->strides[0] ? d->strides[0] : 1;
    strides[1] = d->strides[1] ? d->strides[1] : 1;
    mpt__win_init(&c->g, L, d->kernel_size, strides, d->padding);
    c->f = d->filters;
    c->kk = c->g.kh * c->g.kw * c->g.c;
    c->pix = c->g.oh * c->g.ow;
    /* budget / (pix · kk), divided in two steps so that nothing overflows */
    c->chunk = MPT__CONV_COLS_BUDGET / MPT__MAX(c->pix, 1) / c->kk;
    c->chunk = MPT__MAX(1, MPT__MIN(max_batch, c->chunk));
    c->identity = c->g.kh == 1 && c->g.kw == 1 && c->g.sh == 1 && c->g.sw == 1;
    c->es = mpt_dtype_size(L->dtype);
}

/* ---- im2col and col2im, one task per image row ---------------------------- */

typedef struct mpt__im2col_job {
    const mpt_context *ctx;
    const mpt__win *g;
    size_t es;                /* bytes per element                            */
    const unsigned char *x;   /* (n, H, W, C) compute dtype                   */
    unsigned char *cols;      /* im2col: (n·OH·OW, kh·kw·C) compute dtype      */
    const float *dcols;       /* col2im: (n·OH·OW, kh·kw·C) float32            */
    float *dx;                /* col2im: (n, H, W, C) float32                  */
    mpt_dtype dtype;          /* col2im: dtype of out (float32: out is dx)     */
    void *out;                /* col2im: (n, H, W, C) the result, in dtype     */
} mpt__im2col_job;

/* Output row oy of sample b: copies its windows into their rows of cols.
   A window row inside the image is kw·C contiguous elements: one memcpy. */
static void mpt__im2col_task(void *arg, int64_t task, int thread) {
    const mpt__im2col_job *j = (const mpt__im2col_job *)arg;
    const mpt__win *g = j->g;
    const int64_t b = task / g->oh, oy = task % g->oh, y0 = oy * g->sh - g->top;
    const size_t pixel = (size_t)g->c * j->es, run = (size_t)g->kw * pixel;
    const unsigned char *x = j->x + (size_t)(b * g->h * g->w) * pixel;
    unsigned char *dst = j->cols + (size_t)(task * g->ow * g->kh) * run;
    int64_t ox, i, k;
    (void)thread;
    for (ox = 0; ox < g->ow; ox++) {
        const int64_t x0 = ox * g->sw - g->left;
        for (i = 0; i < g->kh; i++, dst += run) {
            const int64_t y = y0 + i;
            if (y < 0 || y >= g->h) {
                memset(dst, 0, run);
            } else if (x0 >= 0 && x0 + g->kw <= g->w) {
                memcpy(dst, x + (size_t)(y * g->w + x0) * pixel, run);
            } else {
                for (k = 0; k < g->kw; k++) {
                    const int64_t xx = x0 + k;
                    if (xx < 0 || xx >= g->w)
                        memset(dst + (size_t)k * pixel, 0, pixel);
                    else
                        memcpy(dst + (size_t)k * pixel, x + (size_t)(y * g->w + xx) * pixel,
                               pixel);
                }
            }
        }
    }
}

/* Input row y of sample b's dx: the entries of dcols copied from it, added
   output pixel after output pixel (the same sums whichever thread runs
   it), then stored in the compute dtype. Row by row, not window by window,
   so that tasks never write the same pixel. */
static void mpt__col2im_task(void *arg, int64_t task, int thread) {
    const mpt__im2col_job *j = (const mpt__im2col_job *)arg;
    const mpt__win *g = j->g;
    const int64_t b = task / g->h, y = task % g->h, run = g->kw * g->c, n_row = g->w * g->c;
    /* the output rows whose windows cover y: oy·sh − top ≤ y < oy·sh − top + kh */
    const int64_t lo = y + g->top - g->kh + 1;
    const int64_t oy0 = lo <= 0 ? 0 : (lo + g->sh - 1) / g->sh;
    const int64_t oy1 = MPT__MIN(g->oh - 1, (y + g->top) / g->sh);
    float *dx = j->dx + task * n_row; /* (W, C) */
    int64_t oy, ox, k;
    (void)thread;
    memset(dx, 0, sizeof(float) * (size_t)n_row);
    for (oy = oy0; oy <= oy1; oy++) {
        const int64_t i = y - (oy * g->sh - g->top); /* which row of the window y is */
        for (ox = 0; ox < g->ow; ox++) {
            const float *src = j->dcols + (((b * g->oh + oy) * g->ow + ox) * g->kh + i) * run;
            const int64_t x0 = ox * g->sw - g->left;
            if (x0 >= 0 && x0 + g->kw <= g->w) { /* the window row lies inside the image */
                mpt__add_f32(dx + x0 * g->c, src, run);
                continue;
            }
            for (k = 0; k < g->kw; k++)
                if (x0 + k >= 0 && x0 + k < g->w)
                    mpt__add_f32(dx + (x0 + k) * g->c, src + k * g->c, g->c);
        }
    }
    if (j->dtype != MPT_FLOAT32)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->out + (size_t)(task * n_row) * j->es,
                     MPT_FLOAT32, dx, n_row);
}

/* cols (n·OH·OW, kh·kw·C) from x (n, H, W, C), both in the compute dtype. */
static void mpt__im2col(mpt_context *ctx, const mpt__conv_plan *c, const void *x, int64_t n,
                        void *cols) {
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = &c->g;
    j.es = c->es;
    j.x = (const unsigned char *)x;
    j.cols = (unsigned char *)cols;
    mpt__parallel_for(ctx, n * c->g.oh, mpt__im2col_task, &j);
}

/* dx (n, H, W, C) in dtype from dcols (n·OH·OW, kh·kw·C) float32; dxf
   (n, H, W, C) float32 is where the sums are made (dx itself if float32). */
static void mpt__col2im(mpt_context *ctx, const mpt__conv_plan *c, mpt_dtype dtype,
                        const float *dcols, int64_t n, float *dxf, void *dx) {
    mpt__im2col_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.g = &c->g;
    j.es = c->es;
    j.dcols = dcols;
    j.dx = dtype == MPT_FLOAT32 ? (float *)dx : dxf;
    j.dtype = dtype;
    j.out = dx;
    mpt__parallel_for(ctx, n * c->g.h, mpt__col2im_task, &j);
}

/* ---- Conv2D build, forward, backward -------------------------------------- */

static mpt_status mpt__conv2d_build(mpt_model *m, mpt__layer *L) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    mpt__conv_plan c;
    int64_t kshape[4], row_bytes = 0, sample_bytes = 0, chunk_bytes;
    char s[96];
    MPT__CHECK(mpt__expect_image(m, L));
    kshape[0] = d->kernel_size[0];
    kshape[1] = d->kernel_size[1];
    kshape[2] = L->in_shape[2];
    kshape[3] = d->filters;
    if (mpt__shape_count(4, kshape) < 0) /* checked first: the plan multiplies them */
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "Conv2D '%s': kernel %s is too large",
                         L->name, mpt_shape_format(s, sizeof s, 4, kshape));
    mpt__conv_plan_init(&c, L, m->max_batch);
    MPT__CHECK(mpt__expect_window_fits(m, L, &c.g, "kernel"));
    L->out_rank = 3;
    L->out_shape[0] = c.g.oh;
    L->out_shape[1] = c.g.ow;
    L->out_shape[2] = c.f;
    /* Keras' fans for a conv kernel: the receptive field times channels. */
    MPT__CHECK(mpt__layer_add_param(m, L, "kernel", 4, kshape,
                                    d->kernel_initializer ? d->kernel_initializer
                                                          : MPT_INIT_GLOROT_UNIFORM,
                                    c.kk, c.g.kh * c.g.kw * c.f, 1, L->dtype));
    if (!d->no_bias)
        MPT__CHECK(mpt__layer_add_param(m, L, "bias", 1, &c.f,
                                        d->bias_initializer ? d->bias_initializer
                                                            : MPT_INIT_ZEROS,
                                        c.kk, c.g.kh * c.g.kw * c.f, 1, MPT_FLOAT32));
    if (d->activation == MPT_ACT_GELU) /* z (B, OH, OW, F) */
        MPT__CHECK(mpt__layer_add_saved(m, L, mpt__dbytes(L->dtype, c.pix * c.f), 0));
    /* Per chunk (backward needs the most): dz, tmp (rows, F) f32; dz in
       dtype (rows, F); cols (rows, kk) dtype; dcols (rows, kk) f32; dx
       (chunk, H, W, C) f32; rows = chunk·OH·OW. */
    mpt__acc_mul(&row_bytes, c.f, 8 + (int64_t)c.es);
    mpt__acc_mul(&row_bytes, c.kk, 4 + (int64_t)c.es);
    mpt__acc_mul(&sample_bytes, c.pix, row_bytes);
    mpt__acc_mul(&sample_bytes, L->in_count, 4);
    if (sample_bytes < 0 || !mpt__mul_ok(sample_bytes, c.chunk, &chunk_bytes))
        return mpt__fail(m->ctx, MPT_ERR_OVERFLOW, "Conv2D '%s': buffers for input %s overflow",
                         L->name, mpt_shape_format(s, sizeof s, 3, L->in_shape));
    return mpt__layer_set_workspace(m, L, 0, mpt__ws_bytes(chunk_bytes, 6));
}

/* y rows [b0·pix, (b0 + n)·pix) of the batch. */
static void mpt__conv2d_forward_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                      int64_t b0, int64_t n) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    const int64_t rows = n * c->pix, ny = rows * c->f;
    const int fused = d->activation != MPT_ACT_GELU && d->activation != MPT_ACT_SOFTMAX;
    const unsigned char *x = (const unsigned char *)p->x + (size_t)(b0 * L->in_count) * c->es;
    unsigned char *y = (unsigned char *)p->y + (size_t)(b0 * c->pix * c->f) * c->es;
    mpt__ws w = {(unsigned char *)p->workspace};
    void *cols = c->identity ? NULL : mpt__ws_take(&w, rows * c->kk * (int64_t)c->es);
    float *acc = (L->dtype == MPT_FLOAT32 && fused) ? (float *)y
                                                    : (float *)mpt__ws_take(&w, 4 * ny);
    mpt_gemm_desc g;
    if (cols) mpt__im2col(p->ctx, c, x, n, cols); /* (rows, kk) */
    memset(&g, 0, sizeof g);                      /* acc (rows, F) = cols · kernel */
    g.m = rows;
    g.n = c->f;
    g.k = c->kk;
    g.ab_dtype = L->dtype;
    g.a = cols ? (const void *)cols : (const void *)x;
    g.lda = c->kk;
    g.b = mpt__pw(L, 0);
    g.ldb = c->f;
    g.c = acc;
    g.ldc = c->f;
    g.bias = d->no_bias ? NULL : mpt__pv(L, 1);
    g.activation = fused ? d->activation : MPT_ACT_NONE;
    mpt__gemm(p->ctx, &g);
    if (d->activation == MPT_ACT_GELU) {
        unsigned char *z = (unsigned char *)L->saved[0] + (size_t)(b0 * c->pix * c->f) * c->es;
        mpt__convert(p->ctx, L->dtype, z, MPT_FLOAT32, acc, ny);
        mpt__activation_forward(MPT_ACT_GELU, acc, ny);
    } else if (d->activation == MPT_ACT_SOFTMAX) {
        mpt__softmax_rows(acc, rows, c->f); /* over the channels of each pixel */
    }
    if ((void *)acc != (void *)y) mpt__convert(p->ctx, L->dtype, y, MPT_FLOAT32, acc, ny);
}

static void mpt__conv2d_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv_plan c;
    int64_t b0;
    mpt__conv_plan_init(&c, L, p->model->max_batch);
    for (b0 = 0; b0 < p->batch; b0 += c.chunk)
        mpt__conv2d_forward_chunk(L, p, &c, b0, MPT__MIN(c.chunk, p->batch - b0));
}

/* out[j] += Σ_r dz[r][j]: the bias gradient, rows in order. */
static void mpt__add_column_sums(const float *dz, int64_t rows, int64_t cols, float *out) {
    int64_t r;
    for (r = 0; r < rows; r++) mpt__add_f32(out, dz + r * cols, cols);
}

/* dkernel (kk, F) = colsᵀ · dz, added to what the earlier chunks left
   unless this is the first. cols (rows, kk) and dz (rows, F) in dtype. */
static void mpt__conv2d_kernel_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                    const void *cols, const void *dz, int64_t rows, int first) {
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.trans_a = 1;
    g.m = c->kk;
    g.n = c->f;
    g.k = rows;
    g.ab_dtype = L->dtype;
    g.a = cols;
    g.lda = c->kk;
    g.b = dz;
    g.ldb = c->f;
    g.c = mpt__pg(L, 0);
    g.ldc = c->f;
    g.beta = first ? 0.0f : 1.0f;
    mpt__gemm(p->ctx, &g);
}

/* dcols (rows, kk) float32 = dz · kernelᵀ; dz (rows, F) in dtype. */
static void mpt__conv2d_cols_grad(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                  const void *dz, int64_t rows, float *dcols) {
    mpt_gemm_desc g;
    memset(&g, 0, sizeof g);
    g.trans_b = 1;
    g.m = rows;
    g.n = c->kk;
    g.k = c->f;
    g.ab_dtype = L->dtype;
    g.a = dz;
    g.lda = c->f;
    g.b = mpt__pw(L, 0);
    g.ldb = c->f;
    g.c = dcols;
    g.ldc = c->kk;
    mpt__gemm(p->ctx, &g);
}

/* Adds this chunk's share to the kernel and bias gradients (the first
   chunk overwrites them) and writes its samples' dx. */
static void mpt__conv2d_backward_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                                       int64_t b0, int64_t n) {
    const mpt_conv2d_desc *d = &L->desc.conv2d;
    const int64_t rows = n * c->pix, ny = rows * c->f, y_off = b0 * c->pix * c->f;
    const int f32 = L->dtype == MPT_FLOAT32;
    const unsigned char *x = (const unsigned char *)p->x + (size_t)(b0 * L->in_count) * c->es;
    unsigned char *dx = p->dx ? (unsigned char *)p->dx + (size_t)(b0 * L->in_count) * c->es : NULL;
    const void *z = d->activation == MPT_ACT_GELU
                        ? (const unsigned char *)L->saved[0] + (size_t)y_off * c->es : NULL;
    mpt__ws w = {(unsigned char *)p->workspace};
    float *dz = (float *)mpt__ws_take(&w, 4 * ny);                          /* (rows, F) */
    float *tmp = (float *)mpt__ws_take(&w, 4 * ny);                         /* (rows, F) */
    void *dz_c = f32 ? (void *)dz : mpt__ws_take(&w, ny * (int64_t)c->es); /* (rows, F) */
    void *cols = c->identity ? NULL : mpt__ws_take(&w, rows * c->kk * (int64_t)c->es);
    float *dcols = (float *)mpt__ws_take(&w, 4 * rows * c->kk);  /* (rows, kk) */
    float *dxf = (float *)mpt__ws_take(&w, 4 * n * L->in_count); /* (n, H, W, C) */
    mpt__activation_grad(p->ctx, d->activation, L->dtype, z,
                         (const unsigned char *)p->y + (size_t)y_off * c->es,
                         (const unsigned char *)p->dy + (size_t)y_off * c->es, dz, tmp, ny, c->f);
    if (!d->no_bias) {
        if (b0 == 0) memset(mpt__pg(L, 1), 0, sizeof(float) * (size_t)c->f);
        mpt__add_column_sums(dz, rows, c->f, mpt__pg(L, 1));
    }
    /* The products run in the compute dtype, as the forward did. */
    if (dz_c != (void *)dz) mpt__convert(p->ctx, L->dtype, dz_c, MPT_FLOAT32, dz, ny);
    if (cols) mpt__im2col(p->ctx, c, x, n, cols); /* recomputed: cheaper than keeping it */
    mpt__conv2d_kernel_grad(L, p, c, cols ? (const void *)cols : (const void *)x, dz_c, rows,
                            b0 == 0);
    if (!dx) return;
    if (!c->identity) {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        mpt__col2im(p->ctx, c, L->dtype, dcols, n, dxf, dx);
    } else if (f32) { /* dcols is dx */
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, (float *)dx);
    } else {
        mpt__conv2d_cols_grad(L, p, c, dz_c, rows, dcols);
        mpt__convert(p->ctx, L->dtype, dx, MPT_FLOAT32, dcols, n * L->in_count);
    }
}

static void mpt__conv2d_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__conv_plan c;
    int64_t b0;
    mpt__conv_plan_init(&c, L, p->model->max_batch);
    for (b0 = 0; b0 < p->batch; b0 += c.chunk)
        mpt__conv2d_backward_chunk(L, p, &c, b0, MPT__MIN(c.chunk, p->batch - b0));
}

static const mpt__layer_ops mpt__conv2d_ops = {"Conv2D", "conv2d", mpt__conv2d_build,
                                               mpt__conv2d_forward, mpt__conv2d_backward, NULL};

MPTDEF mpt_status mpt_model_add_conv2d(mpt_model *m, const mpt_conv2d_desc *d) {
    MPT__CHECK(mpt__check_add(m, d, "Conv2D"));
    if (d->filters <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: filters %lld must be > 0",
                         (long long)d->filters);
    MPT__CHECK(mpt__check_window_desc(m, "Conv2D", "kernel_size", d->kernel_size, 1, d->strides,
                                      d->padding));
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: unknown activation %d",
                         (int)d->activation);
    if (!mpt__initializer_valid(d->kernel_initializer) ||
        !mpt__initializer_valid(d->bias_initializer))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "Conv2D: unknown initializer %d",
                         (int)(mpt__initializer_valid(d->kernel_initializer)
                                   ? d->bias_initializer
                                   : d->kernel_initializer));
    MPT__ADD_LAYER(m, mpt__conv2d_ops, conv2d, d);
}

/* =============================================================================
   MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D
           x: (B, H, W, C)  y: (B, OH, OW, C)   (global: y (B, C))
   =============================================================================

   One task per sample; each reads its sample in float32 (converted into
   its own part of the workspace unless the layer is float32) and writes
   only its own output, so nothing depends on the thread count.
   Max: the first largest value of each window wins (as TensorFlow), a NaN
   wins over any number (so non-finite values reach the loss), and its
   index within the sample is saved (int32) for backward.
   Average: the mean of the window's pixels inside the image (Keras does
   not count 'same' padding). Global average pooling is average pooling
   with one window the size of the image. */

typedef enum mpt__pool_kind { MPT__POOL_MAX, MPT__POOL_AVERAGE, MPT__POOL_GLOBAL } mpt__pool_kind;

static void mpt__pool_win(mpt__win *g, const mpt__layer *L, mpt__pool_kind kind) {
    const mpt_pool2d_desc *d = &L->desc.pool2d;
    int64_t size[2], strides[2];
    if (kind == MPT__POOL_GLOBAL) {
        size[0] = strides[0] = L->in_shape[0];
        size[1] = strides[1] = L->in_shape[1];
        mpt__win_init(g, L, size, strides, MPT_PADDING_VALID);
        return;
    }
    size[0] = d->pool_size[0] ? d->pool_size[0] : 2;
    size[1] = d->pool_size[1] ? d->pool_size[1] : 2;
    strides[0] = d->strides[0] ? d->strides[0] : size[0];
    strides[1] = d->strides[1] ? d->strides[1] : size[1];
    mpt__win_init(g, L, size, strides, d->padding);
}

static mpt_status mpt__pool_build(mpt_model *m, mpt__layer *L, mpt__pool_kind kind) {
    mpt__win g;
    int64_t out_count;
    MPT__CHECK(mpt__expect_image(m, L));
    mpt__pool_win(&g, L, kind);
    MPT__CHECK(mpt__expect_window_fits(m, L, &g, "pool_size"));
    if (kind == MPT__POOL_GLOBAL) {
        L->out_rank = 1;
        L->out_shape[0] = g.c;
    } else {
        L->out_rank = 3;
        L->out_shape[0] = g.oh;
        L->out_shape[1] = g.ow;
        L->out_shape[2] = g.c;
    }
    out_count = g.oh * g.ow * g.c; /* ≤ in_count: windows start inside the image */
    if (kind == MPT__POOL_MAX) {
        if (L->in_count > INT32_MAX)
            return mpt__fail(m->ctx, MPT_ERR_OVERFLOW,
                             "MaxPooling2D '%s': %lld elements per sample do not fit the int32 "
                             "indices it saves", L->name, (long long)L->in_count);
        MPT__CHECK(mpt__layer_add_saved(m, L, 4 * out_count, 0)); /* argmax (B, OH, OW, C) */
    }
    /* Per sample, float32: forward x and y, backward dy and dx. */
    return mpt__layer_set_workspace(m, L, 4 * (L->in_count + out_count), MPT__ALIGN);
}

static mpt_status mpt__max_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_MAX);
}
static mpt_status mpt__avg_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_AVERAGE);
}
static mpt_status mpt__global_pool_build(mpt_model *m, mpt__layer *L) {
    return mpt__pool_build(m, L, MPT__POOL_GLOBAL);
}

typedef struct mpt__pool_job {
    const mpt_context *ctx;
    mpt__win g;
    mpt__pool_kind kind;
    mpt_dtype dtype;
    size_t es;
    int64_t n_in, n_out;     /* elements of one input / output sample      */
    const void *x;           /* forward: (B, H, W, C) dtype                 */
    void *y;                 /* forward: (B, OH, OW, C) dtype               */
    const void *dy;          /* backward: (B, OH, OW, C) dtype              */
    void *dx;                /* backward: (B, H, W, C) dtype                */
    int32_t *argmax;         /* max: (B, OH, OW, C) index into the sample   */
    float *ws;               /* (B, n_in + n_out) float32                   */
} mpt__pool_job;

static void mpt__pool_job_init(mpt__pool_job *j, const mpt__layer *L, const mpt__pass *p,
                               mpt__pool_kind kind) {
    memset(j, 0, sizeof *j);
    j->ctx = p->ctx;
    mpt__pool_win(&j->g, L, kind);
    j->kind = kind;
    j->dtype = L->dtype;
    j->es = mpt_dtype_size(L->dtype);
    j->n_in = L->in_count;
    j->n_out = L->out_count;
    j->x = p->x;
    j->y = p->y;
    j->dy = p->dy;
    j->dx = p->dx;
    j->argmax = kind == MPT__POOL_MAX ? (int32_t *)L->saved[0] : NULL;
    j->ws = (float *)p->workspace;
}

/* Element `at` of a dtype array, as a byte pointer. */
static const void *mpt__elem(const void *base, int64_t at, size_t es) {
    return (const unsigned char *)base + (size_t)at * es;
}

/* Sample b of `src` (n elements of dtype) in float32: src itself when the
   dtype is float32, else converted into buf. */
static const float *mpt__as_f32(const mpt_context *ctx, mpt_dtype dtype, const void *src,
                                int64_t b, int64_t n, float *buf) {
    const void *s = mpt__elem(src, b * n, mpt_dtype_size(dtype));
    if (dtype == MPT_FLOAT32) return (const float *)s;
    mpt__convert(ctx, MPT_FLOAT32, buf, dtype, s, n);
    return buf;
}

/* y[c] = max of the window's pixels (first wins; NaN wins), arg[c] = where. */
static void mpt__max_window(const mpt__win *g, const float *x, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, float *y, int32_t *arg) {
    int64_t r, q, e;
    for (e = 0; e < g->c; e++) {
        y[e] = -INFINITY;
        arg[e] = (int32_t)((r0 * g->w + c0) * g->c + e);
    }
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++) {
            const int64_t at = (r * g->w + q) * g->c;
            for (e = 0; e < g->c; e++) {
                float v = x[at + e];
                if (v > y[e] || (v != v && y[e] == y[e])) {
                    y[e] = v;
                    arg[e] = (int32_t)(at + e);
                }
            }
        }
}

/* y[c] = mean of the window's pixels inside the image. */
static void mpt__avg_window(const mpt__win *g, const float *x, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, float *y) {
    const float inv = 1.0f / (float)((r1 - r0) * (c1 - c0));
    int64_t r, q, e;
    for (e = 0; e < g->c; e++) y[e] = 0;
    for (r = r0; r < r1; r++)
        for (q = c0; q < c1; q++)
            for (e = 0; e < g->c; e++) y[e] += x[(r * g->w + q) * g->c + e];
    for (e = 0; e < g->c; e++) y[e] *= inv;
}

static void mpt__pool_forward_task(void *arg, int64_t b, int thread) {
    const mpt__pool_job *j = (const mpt__pool_job *)arg;
    const mpt__win *g = &j->g;
    float *xbuf = j->ws + b * (j->n_in + j->n_out); /* (H, W, C)    */
    float *ybuf = xbuf + j->n_in;                   /* (OH, OW, C) */
    const float *x = mpt__as_f32(j->ctx, j->dtype, j->x, b, j->n_in, xbuf);
    float *y = j->dtype == MPT_FLOAT32 ? (float *)j->y + b * j->n_out : ybuf;
    int64_t oy, ox, r0, r1, c0, c1;
    (void)thread;
    for (oy = 0; oy < g->oh; oy++)
        for (ox = 0; ox < g->ow; ox++) {
            const int64_t at = (oy * g->ow + ox) * g->c;
            mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
            if (j->kind == MPT__POOL_MAX)
                mpt__max_window(g, x, r0, r1, c0, c1, y + at, j->argmax + b * j->n_out + at);
            else
                mpt__avg_window(g, x, r0, r1, c0, c1, y + at);
        }
    if (y == ybuf)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->y + (size_t)(b * j->n_out) * j->es,
                     MPT_FLOAT32, ybuf, j->n_out);
}

/* dx of sample b: each output's gradient goes back to the pixel that won
   (max) or is shared by the window's pixels (average), outputs in order. */
static void mpt__pool_backward_task(void *arg, int64_t b, int thread) {
    const mpt__pool_job *j = (const mpt__pool_job *)arg;
    const mpt__win *g = &j->g;
    float *dybuf = j->ws + b * (j->n_in + j->n_out); /* (OH, OW, C) */
    float *dxbuf = dybuf + j->n_out;                 /* (H, W, C)   */
    const float *dy = mpt__as_f32(j->ctx, j->dtype, j->dy, b, j->n_out, dybuf);
    float *dx = j->dtype == MPT_FLOAT32 ? (float *)j->dx + b * j->n_in : dxbuf;
    int64_t oy, ox, r0, r1, c0, c1, r, q, e;
    (void)thread;
    memset(dx, 0, sizeof(float) * (size_t)j->n_in);
    if (j->kind == MPT__POOL_MAX) {
        const int32_t *arg_b = j->argmax + b * j->n_out;
        for (e = 0; e < j->n_out; e++) dx[arg_b[e]] += dy[e];
    } else {
        for (oy = 0; oy < g->oh; oy++)
            for (ox = 0; ox < g->ow; ox++) {
                const float *d = dy + (oy * g->ow + ox) * g->c;
                float inv;
                mpt__win_span(g, oy, ox, &r0, &r1, &c0, &c1);
                inv = 1.0f / (float)((r1 - r0) * (c1 - c0));
                for (r = r0; r < r1; r++)
                    for (q = c0; q < c1; q++)
                        for (e = 0; e < g->c; e++) dx[(r * g->w + q) * g->c + e] += d[e] * inv;
            }
    }
    if (dx == dxbuf)
        mpt__convert(j->ctx, j->dtype, (unsigned char *)j->dx + (size_t)(b * j->n_in) * j->es,
                     MPT_FLOAT32, dxbuf, j->n_in);
}

static void mpt__pool_forward(mpt__layer *L, const mpt__pass *p, mpt__pool_kind kind) {
    mpt__pool_job j;
    mpt__pool_job_init(&j, L, p, kind);
    mpt__parallel_for(p->ctx, p->batch, mpt__pool_forward_task, &j);
}

static void mpt__pool_backward(mpt__layer *L, const mpt__pass *p, mpt__pool_kind kind) {
    mpt__pool_job j;
    if (!p->dx) return; /* no parameters: only dx to compute */
    mpt__pool_job_init(&j, L, p, kind);
    mpt__parallel_for(p->ctx, p->batch, mpt__pool_backward_task, &j);
}

static void mpt__max_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_MAX);
}
static void mpt__max_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_MAX);
}
static void mpt__avg_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_AVERAGE);
}
static void mpt__avg_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_AVERAGE);
}
static void mpt__global_pool_forward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_forward(L, p, MPT__POOL_GLOBAL);
}
static void mpt__global_pool_backward(mpt__layer *L, const mpt__pass *p) {
    mpt__pool_backward(L, p, MPT__POOL_GLOBAL);
}

static const mpt__layer_ops mpt__max_pool_ops = {"MaxPooling2D", "max_pooling2d",
                                                 mpt__max_pool_build, mpt__max_pool_forward,
                                                 mpt__max_pool_backward, NULL};
static const mpt__layer_ops mpt__avg_pool_ops = {"AveragePooling2D", "average_pooling2d",
                                                 mpt__avg_pool_build, mpt__avg_pool_forward,
                                                 mpt__avg_pool_backward, NULL};
static const mpt__layer_ops mpt__global_pool_ops = {
    "GlobalAveragePooling2D", "global_average_pooling2d", mpt__global_pool_build,
    mpt__global_pool_forward, mpt__global_pool_backward, NULL};

static mpt_status mpt__check_pool_desc(mpt_model *m, const mpt_pool2d_desc *d, const char *cls) {
    MPT__CHECK(mpt__check_add(m, d, cls));
    return mpt__check_window_desc(m, cls, "pool_size", d->pool_size, 0, d->strides, d->padding);
}

MPTDEF mpt_status mpt_model_add_max_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    MPT__CHECK(mpt__check_pool_desc(m, d, "MaxPooling2D"));
    MPT__ADD_LAYER(m, mpt__max_pool_ops, pool2d, d);
}

MPTDEF mpt_status mpt_model_add_average_pooling2d(mpt_model *m, const mpt_pool2d_desc *d) {
    MPT__CHECK(mpt__check_pool_desc(m, d, "AveragePooling2D"));
    MPT__ADD_LAYER(m, mpt__avg_pool_ops, pool2d, d);
}

MPTDEF mpt_status mpt_model_add_global_average_pooling2d(mpt_model *m,
                                                         const mpt_flatten_desc *d) {
    mpt_flatten_desc none;
    MPT__CHECK(m ? MPT_OK : MPT_ERR_INVALID_ARGUMENT);
    memset(&none, 0, sizeof none);
    MPT__ADD_LAYER(m, mpt__global_pool_ops, flatten, d ? d : &none);
}

/* The backend table as a GPU model uses it, tested on the CPU: a "device"
   backend that runs the CPU's own functions but keeps the model's buffers
   apart from the host's makes mpt.h take every path a CUDA model takes —
   batches staged in pinned memory and uploaded on the second queue into
   two alternating buffers, targets uploaded, outputs and training scalars
   downloaded, checkpoints through a host mirror, EarlyStopping's weight
   copies, the GEMM timing pass, full steps recorded once per buffer and
   replayed (the device keeps each call of a recording with its arguments,
   as a CUDA graph does, and runs them again at each replay). Since the
   arithmetic is the CPU's, a model trained there must end bit for bit
   where the same model ends on the CPU backend; a mistake in the staging
   (a stale buffer, a lost tally, a missed push or pull) or a value the
   host worked out while recording shows up as a difference.

   The device's memory is kept honest: every allocation is tracked, and
   the test checks that the model reads and writes host buffers only
   through upload/download (a host pointer reaching a compute function is
   a failure). A second emulated device holds a second replica, as a
   mirrored model on two GPUs does: every call must then pass the memory
   of the device it goes to (on a GPU, the device the call makes current). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;
static char tmpdir[512]; /* the cases' files: test_main makes it and removes it */

/* ---- the emulated device ---------------------------------------------------- */

enum { MAX_BLOCKS = 256 };

typedef struct device_memory {
    struct {
        unsigned char *base;
        size_t bytes;
    } block[MAX_BLOCKS];
    int n;
    long uploads_async, waits, plans, allreduces, gemms;
    long lookups; /* lookup_u8 calls run (recorded ones each time replayed) */
    long upload_bytes; /* bytes uploaded asynchronously */
    long captures, replays, unrecordable; /* graphs recorded and replayed */
    long stray; /* pointers given to a device's functions that are not its memory */
} device_memory;

/* The context's device, and a second one for replicas on two devices: its
   impl is a context of its own (which the CPU's functions run on), and a
   call on it must pass the second device's memory only. */
static device_memory dev, dev2;
static mpt_context *dev2_impl;

static device_memory *memory_of(const void *impl) {
    return dev2_impl && impl == (const void *)dev2_impl ? &dev2 : &dev;
}

static int on_device(const device_memory *d, const void *p) {
    int i;
    if (!p) return 1;
    for (i = 0; i < d->n; i++)
        if ((const unsigned char *)p >= d->block[i].base &&
            (const unsigned char *)p < d->block[i].base + d->block[i].bytes)
            return 1;
    return 0;
}

/* p, passed to a function of impl's device, must be that device's memory:
   a host pointer, or another device's, is counted (on the first device). */
static void expect_device(const void *impl, const void *p) {
    if (!on_device(memory_of(impl), p)) dev.stray++;
}

static const mpt_backend *cpu(void) { return mpt__cpu_backend(); }

/* Recording, as a CUDA graph records a step: between capture_begin and
   capture_end each compute call is kept with its arguments (by value, as
   a kernel launch keeps them) instead of run, and replay runs the kept
   calls. A value the host worked out while recording is frozen into every
   replay, as on a GPU, and what a GPU cannot record (copies to or from
   the host, allocations, waits for the device) is counted. */
typedef enum emu_op {
    OP_GEMM, OP_CONVERT, OP_ACTIVATION, OP_ACTIVATION_GRAD, OP_COLUMN_SUMS, OP_IM2COL,
    OP_COL2IM, OP_POOL_FORWARD, OP_POOL_BACKWARD, OP_BN_FORWARD, OP_BN_BACKWARD, OP_BN_COMMIT,
    OP_DROPOUT, OP_LOSS, OP_GRAD_STATS, OP_UPDATE, OP_LOSS_SCALE, OP_ADD, OP_SCALE, OP_COPY,
    OP_ZERO, OP_CONV_DIRECT, OP_LN_FORWARD, OP_LN_BACKWARD, OP_ATTN_FORWARD, OP_ATTN_BACKWARD,
    OP_ELEMENTWISE, OP_COPY_ROWS, OP_GATHER_ROWS, OP_SCATTER_ADD_ROWS, OP_LOOKUP_U8,
    OP_ALLREDUCE
} emu_op;

typedef struct emu_call { /* the arguments of one call; each op uses some */
    emu_op op;
    void *impl;
    mpt_gemm_desc gemm;
    mpt_batchnorm_args bn;
    mpt_layernorm_args ln;
    mpt_attention_args attn;
    mpt_loss_args loss;
    mpt_update_args update;
    mpt_loss_scale_desc loss_scale;
    mpt_conv_args conv; /* its window in `window` */
    mpt_window window;
    mpt_dtype dtype[2];
    mpt_activation act;
    mpt_pool_kind pool;
    const void *in[4];
    void *out[3];
    void *comm;
    float *bufs[MPT__MAX_REPLICAS];
    int64_t n[2];
    int64_t dims[7];
    float value;
    uint64_t key;
    int flag;
} emu_call;

typedef struct emu_graph {
    emu_call *calls;
    int n, cap;
} emu_graph;

static emu_graph *recording; /* the capture in progress, or NULL */

/* A new call at the end of the recording (NULL: out of memory, counted). */
static emu_call *record(emu_op op, void *impl) {
    emu_call *c;
    if (recording->n == recording->cap) {
        int cap = recording->cap ? 2 * recording->cap : 64;
        emu_call *grown = (emu_call *)realloc(recording->calls, sizeof(emu_call) * (size_t)cap);
        if (!grown) {
            dev.unrecordable++;
            return NULL;
        }
        recording->calls = grown;
        recording->cap = cap;
    }
    c = &recording->calls[recording->n++];
    memset(c, 0, sizeof *c);
    c->op = op;
    c->impl = impl;
    return c;
}

/* A call a GPU cannot record (it still runs here). */
static void not_while_recording(void) {
    if (recording) dev.unrecordable++;
}

static mpt_status emu_alloc(void *impl, int category, size_t bytes, void **out) {
    device_memory *d = memory_of(impl);
    mpt_status s;
    not_while_recording();
    s = cpu()->alloc(impl, category, bytes, out);
    if (s == MPT_OK && *out && d->n < MAX_BLOCKS) {
        d->block[d->n].base = (unsigned char *)*out;
        d->block[d->n].bytes = bytes;
        d->n++;
    }
    return s;
}

static void emu_free(void *impl, int category, void *ptr) {
    device_memory *d = memory_of(impl);
    int i;
    not_while_recording();
    expect_device(impl, ptr);
    for (i = 0; ptr && i < d->n; i++)
        if (d->block[i].base == ptr) {
            d->block[i] = d->block[--d->n];
            break;
        }
    cpu()->free(impl, category, ptr);
}

static mpt_status emu_upload(void *impl, void *dst, const void *src, size_t bytes) {
    not_while_recording();
    expect_device(impl, dst);
    return cpu()->upload(impl, dst, src, bytes);
}

static mpt_status emu_download(void *impl, void *dst, const void *src, size_t bytes) {
    not_while_recording();
    expect_device(impl, src);
    return cpu()->download(impl, dst, src, bytes);
}

static void emu_upload_async(void *impl, void *dst, const void *src, size_t bytes) {
    not_while_recording();
    expect_device(impl, dst);
    memory_of(impl)->uploads_async++;
    memory_of(impl)->upload_bytes += (long)bytes;
    cpu()->upload_async(impl, dst, src, bytes);
}

static void emu_upload_wait(void *impl) {
    memory_of(impl)->waits++;
}

static mpt_status emu_upload_done(void *impl) {
    not_while_recording();
    return cpu()->upload_done(impl);
}

static mpt_status emu_sync(void *impl) {
    not_while_recording();
    return cpu()->sync(impl);
}

static mpt_status emu_capture_begin(void *impl) {
    (void)impl;
    if (recording) return MPT_ERR_STATE;
    recording = (emu_graph *)calloc(1, sizeof *recording);
    return recording ? MPT_OK : MPT_ERR_OUT_OF_MEMORY;
}

static mpt_status emu_capture_end(void *impl, void **graph) {
    *graph = recording;
    recording = NULL;
    if (!*graph) return MPT_ERR_STATE;
    memory_of(impl)->captures++;
    return MPT_OK;
}

static void emu_graph_free(void *impl, void *graph) {
    (void)impl;
    if (graph) free(((emu_graph *)graph)->calls);
    free(graph);
}

static void emu_copy(void *impl, void *dst, const void *src, size_t bytes) {
    expect_device(impl, dst);
    expect_device(impl, src);
    if (recording) {
        emu_call *c = record(OP_COPY, impl);
        if (c) c->out[0] = dst, c->in[0] = src, c->n[0] = (int64_t)bytes;
        return;
    }
    cpu()->copy(impl, dst, src, bytes);
}

static void emu_zero(void *impl, void *dst, size_t bytes) {
    expect_device(impl, dst);
    if (recording) {
        emu_call *c = record(OP_ZERO, impl);
        if (c) c->out[0] = dst, c->n[0] = (int64_t)bytes;
        return;
    }
    cpu()->zero(impl, dst, bytes);
}

static void emu_gemm(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    expect_device(impl, d->a);
    expect_device(impl, d->b);
    expect_device(impl, d->c);
    expect_device(impl, d->bias);
    if (recording) {
        emu_call *c = record(OP_GEMM, impl);
        if (c) c->gemm = *d, c->dtype[0] = c_dtype;
        return;
    }
    memory_of(impl)->gemms++;
    cpu()->gemm(impl, d, c_dtype);
}

static mpt_status emu_gemm_plan(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    (void)c_dtype;
    expect_device(impl, d->a);
    expect_device(impl, d->b);
    expect_device(impl, d->c);
    memory_of(impl)->plans++;
    return MPT_OK;
}

static void emu_convert(void *impl, mpt_dtype dd, void *dst, mpt_dtype sd, const void *src,
                        int64_t n) {
    expect_device(impl, dst);
    expect_device(impl, src);
    if (recording) {
        emu_call *c = record(OP_CONVERT, impl);
        if (c) c->dtype[0] = dd, c->out[0] = dst, c->dtype[1] = sd, c->in[0] = src, c->n[0] = n;
        return;
    }
    cpu()->convert(impl, dd, dst, sd, src, n);
}

static void emu_lookup_u8(void *impl, mpt_dtype dtype, void *dst, const void *table,
                          const uint8_t *src, int64_t n) {
    expect_device(impl, dst);
    expect_device(impl, table);
    expect_device(impl, src);
    if (recording) {
        emu_call *c = record(OP_LOOKUP_U8, impl);
        if (c) c->dtype[0] = dtype, c->out[0] = dst, c->in[0] = table, c->in[1] = src, c->n[0] = n;
        return;
    }
    memory_of(impl)->lookups++;
    cpu()->lookup_u8(impl, dtype, dst, table, src, n);
}

static void emu_activation(void *impl, mpt_activation act, float *x, int64_t rows, int64_t cols) {
    expect_device(impl, x);
    if (recording) {
        emu_call *c = record(OP_ACTIVATION, impl);
        if (c) c->act = act, c->out[0] = x, c->n[0] = rows, c->n[1] = cols;
        return;
    }
    cpu()->activation(impl, act, x, rows, cols);
}

static void emu_activation_grad(void *impl, mpt_activation act, mpt_dtype dtype, const void *z,
                                const void *y, const void *dy, float *dz, float *tmp,
                                int64_t rows, int64_t cols) {
    expect_device(impl, z);
    expect_device(impl, y);
    expect_device(impl, dy);
    expect_device(impl, dz);
    expect_device(impl, tmp);
    if (recording) {
        emu_call *c = record(OP_ACTIVATION_GRAD, impl);
        if (c) {
            c->act = act, c->dtype[0] = dtype, c->in[0] = z, c->in[1] = y, c->in[2] = dy;
            c->out[0] = dz, c->out[1] = tmp, c->n[0] = rows, c->n[1] = cols;
        }
        return;
    }
    cpu()->activation_grad(impl, act, dtype, z, y, dy, dz, tmp, rows, cols);
}

static void emu_column_sums(void *impl, const float *dz, int64_t rows, int64_t cols, float *out,
                            int accumulate) {
    expect_device(impl, dz);
    expect_device(impl, out);
    if (recording) {
        emu_call *c = record(OP_COLUMN_SUMS, impl);
        if (c) c->in[0] = dz, c->n[0] = rows, c->n[1] = cols, c->out[0] = out, c->flag = accumulate;
        return;
    }
    cpu()->column_sums(impl, dz, rows, cols, out, accumulate);
}

static void emu_im2col(void *impl, const mpt_window *g, mpt_dtype dtype, const void *x,
                       int64_t n, void *cols) {
    expect_device(impl, x);
    expect_device(impl, cols);
    if (recording) {
        emu_call *c = record(OP_IM2COL, impl);
        if (c) c->window = *g, c->dtype[0] = dtype, c->in[0] = x, c->n[0] = n, c->out[0] = cols;
        return;
    }
    cpu()->im2col(impl, g, dtype, x, n, cols);
}

/* The CPU's direct convolution decides whether it takes a case and
   computes it in the same call. While recording, the inputs are not
   computed yet: the call runs on scratch outputs only for its answer, and
   a case it takes is kept and run on replay. */
static int emu_conv_direct(void *impl, const mpt_conv_args *a) {
    const mpt_window *g = a->g;
    const int64_t kk = g->kh * g->kw * g->c;
    mpt_conv_args probe = *a;
    void *out, *ws;
    int done;
    expect_device(impl, a->x);
    if (!recording) return cpu()->conv_direct(impl, a);
    /* outputs: dkernel (kk, F) float32, or y at 4 bytes an element at most */
    out = calloc((size_t)(a->kernel_grad ? kk * a->f
                                         : a->n * (a->input_grad ? g->h * g->w * g->c
                                                                 : g->oh * g->ow * a->f)),
                 4);
    ws = calloc(1, (size_t)(!a->kernel_grad ? MPT_CONV_DIRECT_WS_BYTES(kk, g->c, a->f)
                                            : MPT_CONV_WINO_KGRAD_WS_BYTES(g, a->n, a->f) +
                                                  MPT_CONV_KGRAD_WS_BYTES(g, a->n, a->f) +
                                                  MPT_CONV_SHALLOW_KGRAD_WS_BYTES(g, a->n, a->f)));
    if (a->kernel_grad) probe.dkernel = (float *)out;
    else probe.y = out;
    if (a->ws) probe.ws = ws;
    done = out && ws && cpu()->conv_direct(impl, &probe);
    free(out);
    free(ws);
    if (done) {
        emu_call *c = record(OP_CONV_DIRECT, impl);
        if (c) c->conv = *a, c->window = *g;
    }
    return done;
}

static void emu_col2im(void *impl, const mpt_window *g, mpt_dtype dtype, const float *dcols,
                       int64_t n, float *dxf, void *dx) {
    expect_device(impl, dcols);
    expect_device(impl, dxf);
    expect_device(impl, dx);
    if (recording) {
        emu_call *c = record(OP_COL2IM, impl);
        if (c) {
            c->window = *g, c->dtype[0] = dtype, c->in[0] = dcols, c->n[0] = n;
            c->out[0] = dxf, c->out[1] = dx;
        }
        return;
    }
    cpu()->col2im(impl, g, dtype, dcols, n, dxf, dx);
}

static void emu_pool_forward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                             mpt_dtype dtype, const void *x, void *y, int32_t *argmax, int64_t n,
                             void *ws) {
    expect_device(impl, x);
    expect_device(impl, y);
    expect_device(impl, argmax);
    expect_device(impl, ws);
    if (recording) {
        emu_call *c = record(OP_POOL_FORWARD, impl);
        if (c) {
            c->pool = kind, c->window = *g, c->dtype[0] = dtype, c->in[0] = x, c->out[0] = y;
            c->out[1] = argmax, c->n[0] = n, c->out[2] = ws;
        }
        return;
    }
    cpu()->pool_forward(impl, kind, g, dtype, x, y, argmax, n, ws);
}

static void emu_pool_backward(void *impl, mpt_pool_kind kind, const mpt_window *g,
                              mpt_dtype dtype, const void *dy, void *dx, const int32_t *argmax,
                              int64_t n, void *ws) {
    expect_device(impl, dy);
    expect_device(impl, dx);
    expect_device(impl, argmax);
    expect_device(impl, ws);
    if (recording) {
        emu_call *c = record(OP_POOL_BACKWARD, impl);
        if (c) {
            c->pool = kind, c->window = *g, c->dtype[0] = dtype, c->in[0] = dy, c->out[0] = dx;
            c->in[1] = argmax, c->n[0] = n, c->out[1] = ws;
        }
        return;
    }
    cpu()->pool_backward(impl, kind, g, dtype, dy, dx, argmax, n, ws);
}

static void expect_batchnorm_args(void *impl, const mpt_batchnorm_args *a) {
    const void *p[] = {a->x, a->y, a->dy, a->dx, a->gamma, a->beta, a->dgamma, a->dbeta,
                       a->mean, a->variance, a->moving_mean, a->moving_variance,
                       a->workspace, a->sum_dy, a->sum_dy_xhat};
    size_t i;
    for (i = 0; i < sizeof p / sizeof p[0]; i++) expect_device(impl, p[i]);
}

static void emu_batchnorm_commit(void *impl, const mpt_batchnorm_args *a,
                                 const mpt_step_state *state) {
    expect_batchnorm_args(impl, a);
    expect_device(impl, state);
    if (recording) {
        emu_call *c = record(OP_BN_COMMIT, impl);
        if (c) c->bn = *a, c->in[0] = state;
        return;
    }
    cpu()->batchnorm_commit(impl, a, state);
}

static void expect_layernorm_args(void *impl, const mpt_layernorm_args *a) {
    const void *p[] = {a->x,      a->y,      a->dy,   a->dx,      a->gamma,    a->beta,
                       a->dgamma, a->dbeta,  a->mean, a->inv_std, a->workspace};
    size_t i;
    for (i = 0; i < sizeof p / sizeof p[0]; i++) expect_device(impl, p[i]);
}

static void expect_attention_args(void *impl, const mpt_attention_args *a) {
    const void *p[] = {a->state, a->saved_step, a->q,  a->k,  a->v,        a->o,
                       a->d_o,   a->dq,         a->dk, a->dv, a->workspace};
    size_t i;
    for (i = 0; i < sizeof p / sizeof p[0]; i++) expect_device(impl, p[i]);
}

static void emu_elementwise(void *impl, mpt_elementwise_op op, mpt_dtype dtype, void *y,
                            const void *a, const void *b, float alpha, int64_t n) {
    expect_device(impl, y);
    expect_device(impl, a);
    expect_device(impl, b);
    if (recording) {
        emu_call *c = record(OP_ELEMENTWISE, impl);
        if (c) c->flag = (int)op, c->dtype[0] = dtype, c->out[0] = y, c->in[0] = a,
               c->in[1] = b, c->value = alpha, c->n[0] = n;
        return;
    }
    cpu()->elementwise(impl, op, dtype, y, a, b, alpha, n);
}

static void emu_copy_rows(void *impl, void *dst, int64_t dst_pitch, int64_t dst_plane,
                          const void *src, int64_t src_pitch, int64_t src_plane, int64_t width,
                          int64_t rows, int64_t planes) {
    expect_device(impl, dst);
    expect_device(impl, src);
    if (recording) {
        emu_call *c = record(OP_COPY_ROWS, impl);
        if (c) {
            int64_t dims[7] = {dst_pitch, dst_plane, src_pitch, src_plane, width, rows, planes};
            c->out[0] = dst, c->in[0] = src;
            memcpy(c->dims, dims, sizeof dims);
        }
        return;
    }
    cpu()->copy_rows(impl, dst, dst_pitch, dst_plane, src, src_pitch, src_plane, width, rows,
                     planes);
}

static void emu_gather_rows(void *impl, mpt_dtype dtype, void *y, const void *table,
                            int64_t rows, int64_t width, const int32_t *ids, int64_t n) {
    expect_device(impl, y);
    expect_device(impl, table);
    expect_device(impl, ids);
    if (recording) {
        emu_call *c = record(OP_GATHER_ROWS, impl);
        if (c) c->dtype[0] = dtype, c->out[0] = y, c->in[0] = table, c->in[1] = ids,
               c->n[0] = rows, c->n[1] = width, c->dims[0] = n;
        return;
    }
    cpu()->gather_rows(impl, dtype, y, table, rows, width, ids, n);
}

static void emu_scatter_add_rows(void *impl, mpt_dtype dtype, float *dtable, int64_t rows,
                                 int64_t width, const void *dy, const int32_t *ids, int64_t n) {
    expect_device(impl, dtable);
    expect_device(impl, dy);
    expect_device(impl, ids);
    if (recording) {
        emu_call *c = record(OP_SCATTER_ADD_ROWS, impl);
        if (c) c->dtype[0] = dtype, c->out[0] = dtable, c->in[0] = dy, c->in[1] = ids,
               c->n[0] = rows, c->n[1] = width, c->dims[0] = n;
        return;
    }
    cpu()->scatter_add_rows(impl, dtype, dtable, rows, width, dy, ids, n);
}

static void emu_dropout(void *impl, uint64_t key, float rate, mpt_dtype dtype, const void *in,
                        void *out, int64_t n, const mpt_step_state *state, int64_t *saved_step,
                        void *ws) {
    expect_device(impl, in);
    expect_device(impl, out);
    expect_device(impl, state);
    expect_device(impl, saved_step);
    expect_device(impl, ws);
    if (recording) {
        emu_call *c = record(OP_DROPOUT, impl);
        if (c) {
            c->key = key, c->value = rate, c->dtype[0] = dtype, c->in[0] = in, c->out[0] = out;
            c->n[0] = n, c->in[1] = state, c->out[1] = saved_step, c->out[2] = ws;
        }
        return;
    }
    cpu()->dropout(impl, key, rate, dtype, in, out, n, state, saved_step, ws);
}

static void expect_loss_args(void *impl, const mpt_loss_args *a) {
    const void *p[] = {a->pred,         a->target,       a->dpred,       a->state,
                       a->sample_weight, a->class_weight, a->metric_sums, a->metric_parts};
    size_t i;
    for (i = 0; i < sizeof p / sizeof p[0]; i++) expect_device(impl, p[i]);
}

static void expect_update_args(void *impl, const mpt_update_args *u) {
    int k;
    for (k = 0; k < u->n; k++) {
        expect_device(impl, u->value[k]);
        expect_device(impl, u->grad[k]);
        if (u->slot0) expect_device(impl, u->slot0[k]);
    }
    expect_device(impl, u->state);
}

/* The slots whose arguments are one struct: its pointers must be the
   device's; the call is kept while a graph is captured, else run on the
   CPU backend. */
#define EMU_STRUCT_SLOT(slot, args_type, expect_args, op, member)                                 \
    static void emu_##slot(void *impl, const args_type *a) {                                      \
        expect_args(impl, a);                                                                     \
        if (recording) {                                                                          \
            emu_call *c = record(op, impl);                                                       \
            if (c) c->member = *a;                                                                \
            return;                                                                               \
        }                                                                                         \
        cpu()->slot(impl, a);                                                                     \
    }
EMU_STRUCT_SLOT(batchnorm_forward, mpt_batchnorm_args, expect_batchnorm_args, OP_BN_FORWARD, bn)
EMU_STRUCT_SLOT(batchnorm_backward, mpt_batchnorm_args, expect_batchnorm_args, OP_BN_BACKWARD, bn)
EMU_STRUCT_SLOT(layernorm_forward, mpt_layernorm_args, expect_layernorm_args, OP_LN_FORWARD, ln)
EMU_STRUCT_SLOT(layernorm_backward, mpt_layernorm_args, expect_layernorm_args, OP_LN_BACKWARD, ln)
EMU_STRUCT_SLOT(attention_forward, mpt_attention_args, expect_attention_args, OP_ATTN_FORWARD, attn)
EMU_STRUCT_SLOT(attention_backward, mpt_attention_args, expect_attention_args, OP_ATTN_BACKWARD,
                attn)
EMU_STRUCT_SLOT(grad_stats, mpt_update_args, expect_update_args, OP_GRAD_STATS, update)
EMU_STRUCT_SLOT(update, mpt_update_args, expect_update_args, OP_UPDATE, update)
EMU_STRUCT_SLOT(loss, mpt_loss_args, expect_loss_args, OP_LOSS, loss)

static void emu_loss_scale_update(void *impl, const mpt_loss_scale_desc *d,
                                  mpt_step_state *state) {
    expect_device(impl, state);
    if (recording) {
        emu_call *c = record(OP_LOSS_SCALE, impl);
        if (c) c->loss_scale = *d, c->out[0] = state;
        return;
    }
    cpu()->loss_scale_update(impl, d, state);
}

static void emu_add(void *impl, float *dst, const float *src, int64_t n) {
    expect_device(impl, dst);
    expect_device(impl, src);
    if (recording) {
        emu_call *c = record(OP_ADD, impl);
        if (c) c->out[0] = dst, c->in[0] = src, c->n[0] = n;
        return;
    }
    cpu()->add(impl, dst, src, n);
}

static void emu_scale(void *impl, float *x, float alpha, int64_t n) {
    expect_device(impl, x);
    if (recording) {
        emu_call *c = record(OP_SCALE, impl);
        if (c) c->out[0] = x, c->value = alpha, c->n[0] = n;
        return;
    }
    cpu()->scale(impl, x, alpha, n);
}

static mpt_status emu_allreduce_sum(void *comm, float *const *bufs, int64_t count);

/* Runs one kept call as it was made. */
static void run_call(const emu_call *c) {
    void *impl = c->impl;
    switch (c->op) {
    case OP_GEMM: emu_gemm(impl, &c->gemm, c->dtype[0]); break;
    case OP_CONVERT:
        emu_convert(impl, c->dtype[0], c->out[0], c->dtype[1], c->in[0], c->n[0]);
        break;
    case OP_ALLREDUCE: (void)emu_allreduce_sum(c->comm, c->bufs, c->n[0]); break;
    case OP_LOOKUP_U8:
        emu_lookup_u8(impl, c->dtype[0], c->out[0], c->in[0], (const uint8_t *)c->in[1], c->n[0]);
        break;
    case OP_ACTIVATION: emu_activation(impl, c->act, (float *)c->out[0], c->n[0], c->n[1]); break;
    case OP_ACTIVATION_GRAD:
        emu_activation_grad(impl, c->act, c->dtype[0], c->in[0], c->in[1], c->in[2],
                            (float *)c->out[0], (float *)c->out[1], c->n[0], c->n[1]);
        break;
    case OP_COLUMN_SUMS:
        emu_column_sums(impl, (const float *)c->in[0], c->n[0], c->n[1], (float *)c->out[0],
                        c->flag);
        break;
    case OP_IM2COL: emu_im2col(impl, &c->window, c->dtype[0], c->in[0], c->n[0], c->out[0]); break;
    case OP_CONV_DIRECT: {
        mpt_conv_args conv = c->conv;
        conv.g = &c->window; /* the kept copy of the window */
        (void)cpu()->conv_direct(impl, &conv);
        break;
    }
    case OP_COL2IM:
        emu_col2im(impl, &c->window, c->dtype[0], (const float *)c->in[0], c->n[0],
                   (float *)c->out[0], c->out[1]);
        break;
    case OP_POOL_FORWARD:
        emu_pool_forward(impl, c->pool, &c->window, c->dtype[0], c->in[0], c->out[0],
                         (int32_t *)c->out[1], c->n[0], c->out[2]);
        break;
    case OP_POOL_BACKWARD:
        emu_pool_backward(impl, c->pool, &c->window, c->dtype[0], c->in[0], c->out[0],
                          (const int32_t *)c->in[1], c->n[0], c->out[1]);
        break;
    case OP_BN_FORWARD: emu_batchnorm_forward(impl, &c->bn); break;
    case OP_BN_BACKWARD: emu_batchnorm_backward(impl, &c->bn); break;
    case OP_BN_COMMIT:
        emu_batchnorm_commit(impl, &c->bn, (const mpt_step_state *)c->in[0]);
        break;
    case OP_DROPOUT:
        emu_dropout(impl, c->key, c->value, c->dtype[0], c->in[0], c->out[0], c->n[0],
                    (const mpt_step_state *)c->in[1], (int64_t *)c->out[1], c->out[2]);
        break;
    case OP_LOSS: emu_loss(impl, &c->loss); break;
    case OP_GRAD_STATS: emu_grad_stats(impl, &c->update); break;
    case OP_UPDATE: emu_update(impl, &c->update); break;
    case OP_LOSS_SCALE:
        emu_loss_scale_update(impl, &c->loss_scale, (mpt_step_state *)c->out[0]);
        break;
    case OP_ADD: emu_add(impl, (float *)c->out[0], (const float *)c->in[0], c->n[0]); break;
    case OP_SCALE: emu_scale(impl, (float *)c->out[0], c->value, c->n[0]); break;
    case OP_COPY: emu_copy(impl, c->out[0], c->in[0], (size_t)c->n[0]); break;
    case OP_ZERO: emu_zero(impl, c->out[0], (size_t)c->n[0]); break;
    case OP_LN_FORWARD: emu_layernorm_forward(impl, &c->ln); break;
    case OP_LN_BACKWARD: emu_layernorm_backward(impl, &c->ln); break;
    case OP_ATTN_FORWARD: emu_attention_forward(impl, &c->attn); break;
    case OP_ATTN_BACKWARD: emu_attention_backward(impl, &c->attn); break;
    case OP_ELEMENTWISE:
        emu_elementwise(impl, (mpt_elementwise_op)c->flag, c->dtype[0], c->out[0], c->in[0],
                        c->in[1], c->value, c->n[0]);
        break;
    case OP_COPY_ROWS:
        emu_copy_rows(impl, c->out[0], c->dims[0], c->dims[1], c->in[0], c->dims[2], c->dims[3],
                      c->dims[4], c->dims[5], c->dims[6]);
        break;
    case OP_GATHER_ROWS:
        emu_gather_rows(impl, c->dtype[0], c->out[0], c->in[0], c->n[0], c->n[1],
                        (const int32_t *)c->in[1], c->dims[0]);
        break;
    case OP_SCATTER_ADD_ROWS:
        emu_scatter_add_rows(impl, c->dtype[0], (float *)c->out[0], c->n[0], c->n[1], c->in[0],
                             (const int32_t *)c->in[1], c->dims[0]);
        break;
    }
}

static mpt_status emu_replay(void *impl, void *graph) {
    const emu_graph *g = (const emu_graph *)graph;
    int i;
    if (!g || recording) return MPT_ERR_STATE;
    for (i = 0; i < g->n; i++) run_call(&g->calls[i]);
    memory_of(impl)->replays++;
    return MPT_OK;
}

/* The collectives between emulated devices: the sum over the members in
   their order, as one device adds the replicas' buffers in order, written
   back to every member. */
typedef struct emu_comm {
    int n;
    void *impls[MPT__MAX_REPLICAS];
} emu_comm;

static mpt_status emu_comm_id(void *impl, void *id) {
    (void)impl;
    memset(id, 0, MPT_COMM_ID_BYTES);
    return MPT_OK;
}

static mpt_status emu_comm_create(void *const *impls, int n, int first, int members,
                                  const void *id, void **comm) {
    emu_comm *c = (emu_comm *)calloc(1, sizeof *c);
    (void)id;
    *comm = c;
    if (!c || first != 0 || members != n || n > MPT__MAX_REPLICAS) return MPT_ERR_UNSUPPORTED;
    c->n = n;
    memcpy(c->impls, impls, sizeof(void *) * (size_t)n);
    return MPT_OK;
}

static void emu_comm_destroy(void *comm) { free(comm); }

static mpt_status emu_allreduce_sum(void *comm, float *const *bufs, int64_t count) {
    const emu_comm *c = (const emu_comm *)comm;
    int64_t i;
    int k;
    for (k = 0; k < c->n; k++) expect_device(c->impls[k], bufs[k]);
    if (recording) { /* a recorded step holds its collective, as NCCL's in a CUDA graph */
        emu_call *r = record(OP_ALLREDUCE, c->impls[0]);
        if (r) {
            r->comm = comm;
            r->n[0] = count;
            memcpy(r->bufs, bufs, sizeof(float *) * (size_t)c->n);
        }
        return MPT_OK;
    }
    for (i = 0; i < count; i++) {
        float sum = bufs[0][i];
        for (k = 1; k < c->n; k++) sum += bufs[k][i];
        for (k = 0; k < c->n; k++) bufs[k][i] = sum;
    }
    dev.allreduces++;
    return MPT_OK;
}

static const char *emu_comm_error(void *comm) {
    (void)comm;
    return "the emulated communicator failed";
}

static mpt_backend emu_table;

/* Puts the emulated device under ctx (models created afterwards use it). */
static void use_emulated_device(mpt_context *c) {
    emu_table = *cpu();
    emu_table.name = "emulated";
    emu_table.alloc = emu_alloc;
    emu_table.free = emu_free;
    emu_table.upload = emu_upload;
    emu_table.download = emu_download;
    emu_table.upload_async = emu_upload_async;
    emu_table.upload_wait = emu_upload_wait;
    emu_table.upload_done = emu_upload_done;
    emu_table.sync = emu_sync;
    emu_table.can_capture = 1;
    emu_table.capture_begin = emu_capture_begin;
    emu_table.capture_end = emu_capture_end;
    emu_table.replay = emu_replay;
    emu_table.graph_free = emu_graph_free;
    emu_table.copy = emu_copy;
    emu_table.zero = emu_zero;
    emu_table.gemm = emu_gemm;
    emu_table.gemm_plan = emu_gemm_plan;
    emu_table.gemm_shared_a = NULL; /* as the CUDA backend: gemm once per product */
    emu_table.convert = emu_convert;
    emu_table.lookup_u8 = emu_lookup_u8;
    emu_table.activation = emu_activation;
    emu_table.activation_keep_z = NULL; /* as the CUDA backend: convert, activation, convert */
    emu_table.activation_grad = emu_activation_grad;
    emu_table.column_sums = emu_column_sums;
    emu_table.dz_and_bias_grad = NULL; /* as the CUDA backend: the three calls above */
    emu_table.im2col = emu_im2col;
    emu_table.col2im = emu_col2im;
    emu_table.conv_direct = emu_conv_direct;
    emu_table.pool_forward = emu_pool_forward;
    emu_table.pool_backward = emu_pool_backward;
    emu_table.batchnorm_forward = emu_batchnorm_forward;
    emu_table.batchnorm_backward = emu_batchnorm_backward;
    emu_table.batchnorm_commit = emu_batchnorm_commit;
    emu_table.layernorm_forward = emu_layernorm_forward;
    emu_table.layernorm_backward = emu_layernorm_backward;
    emu_table.attention_forward = emu_attention_forward;
    emu_table.attention_backward = emu_attention_backward;
    emu_table.elementwise = emu_elementwise;
    emu_table.copy_rows = emu_copy_rows;
    emu_table.gather_rows = emu_gather_rows;
    emu_table.scatter_add_rows = emu_scatter_add_rows;
    emu_table.dropout = emu_dropout;
    emu_table.loss = emu_loss;
    emu_table.grad_stats = emu_grad_stats;
    emu_table.update = emu_update;
    emu_table.loss_scale_update = emu_loss_scale_update;
    emu_table.add = emu_add;
    emu_table.scale = emu_scale;
    emu_table.comm_id = emu_comm_id;
    emu_table.comm_create = emu_comm_create;
    emu_table.comm_destroy = emu_comm_destroy;
    emu_table.allreduce_sum = emu_allreduce_sum;
    emu_table.comm_error = emu_comm_error;
    c->backend = &emu_table;
}

/* Gives a mirrored strategy of two replicas on the emulated device a
   second device, `second`, for replica 1, joined to the first by the
   emulated communicator: what mpt_strategy_create does on two GPUs. */
static void add_second_device(mpt_strategy *s, mpt_context *second) {
    dev2_impl = second;
    s->backend[1] = &emu_table;
    s->impl[1] = second;
    s->n_backends = 2;
    CHECK(emu_table.comm_create(s->impl, 2, 0, 2, NULL, &s->comm) == MPT_OK,
          "the emulated communicator");
}

/* ---- a small image model and data -------------------------------------------- */

enum { N = 120, SIDE = 8, CLASSES = 4, BATCH = 32 };

static float xs[N * SIDE * SIDE];
static int32_t ys[N];

/* Class c: a bright square in quadrant c, on noise. */
static void make_images(void) {
    int i, r, q;
    test_seed(7);
    for (i = 0; i < N; i++) {
        ys[i] = i % CLASSES;
        for (r = 0; r < SIDE; r++)
            for (q = 0; q < SIDE; q++) {
                int in = (r < SIDE / 2) == (ys[i] < 2) && (q < SIDE / 2) == (ys[i] % 2 == 0);
                xs[(i * SIDE + r) * SIDE + q] = (float)test_uniform(0, 0.5) + (in ? 0.7f : 0);
            }
    }
}

static mpt_dataset *image_dataset(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N}, ys);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

/* Conv2D(4, 3, relu) -> BatchNormalization (its statistics over every
   replica's rows when `synchronized`) -> MaxPooling2D -> Flatten ->
   Dropout(0.25) -> Dense(4, softmax), compiled with Adam. */
static mpt_model *image_model_with(mpt_context *c, mpt_policy policy, mpt_strategy *s,
                                   int synchronized) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .policy = policy, .seed = 11, .strategy = s}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){.synchronized = synchronized});
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){0});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

static mpt_model *image_model(mpt_context *c, mpt_policy policy) {
    return image_model_with(c, policy, NULL, 0);
}

static int is_time_key(const char *key) {
    return strstr(key, "second") || strstr(key, "ms_per_step");
}

/* The same keys, times aside (a model with replicas logs its forward and
   backward as one: forward_and_backward_ms_per_step), with the same
   values in every epoch. */
static int same_history(const mpt_model *a, const mpt_model *b) {
    mpt_history ha, hb;
    int k, j, e, na = 0, nb = 0;
    mpt_model_history(a, &ha);
    mpt_model_history(b, &hb);
    if (ha.epochs != hb.epochs) return 0;
    for (j = 0; j < hb.n_keys; j++) nb += !is_time_key(hb.keys[j]);
    for (k = 0; k < ha.n_keys; k++) {
        if (is_time_key(ha.keys[k])) continue;
        na++;
        for (j = 0; j < hb.n_keys && strcmp(hb.keys[j], ha.keys[k]) != 0; j++) continue;
        if (j == hb.n_keys) return 0;
        for (e = 0; e < ha.epochs; e++)
            if (ha.values[k][e] != hb.values[j][e]) return 0;
    }
    return na == nb;
}

/* ---- the tests ------------------------------------------------------------------ */

/* fit, evaluate and predict on the emulated device equal the CPU's, bit for
   bit, in each policy; the batches went up by the asynchronous path. */
static void test_fit_matches_the_cpu(void) {
    mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                              MPT_POLICY_MIXED_BFLOAT16};
    int k;
    for (k = 0; k < 3; k++) {
        mpt_context *dc = NULL;
        mpt_model *cpu, *gpu;
        mpt_dataset *d_cpu, *d_gpu;
        mpt_tensor p_cpu, p_gpu;
        mpt_logs l_cpu, l_gpu;
        mpt_fit_desc fit;
        memset(&dev, 0, sizeof dev);
        mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
        use_emulated_device(dc);
        d_cpu = image_dataset(ctx);
        d_gpu = image_dataset(dc);
        cpu = image_model(ctx, policies[k]);
        gpu = image_model(dc, policies[k]);
        memset(&fit, 0, sizeof fit);
        fit.epochs = 3;
        fit.batch_size = BATCH; /* 120 = 3 full batches and one of 24 */
        fit.validation_split = 0.2f;
        CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "cpu fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "device fit: %s",
              mpt_context_error(dc));
        CHECK(test_same_state(cpu, gpu), "policy %d: weights differ after fit", k);
        CHECK(same_history(cpu, gpu), "policy %d: histories differ", k);
        CHECK(mpt_model_evaluate(cpu, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                      MPT_OK &&
                  mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50},
                                     &l_gpu) == MPT_OK,
              "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
        CHECK(mpt_logs_get(&l_cpu, "loss") == mpt_logs_get(&l_gpu, "loss") &&
                  mpt_logs_get(&l_cpu, "accuracy") == mpt_logs_get(&l_gpu, "accuracy"),
              "policy %d: evaluate %g/%g vs %g/%g", k, mpt_logs_get(&l_cpu, "loss"),
              mpt_logs_get(&l_cpu, "accuracy"), mpt_logs_get(&l_gpu, "loss"),
              mpt_logs_get(&l_gpu, "accuracy"));
        CHECK(mpt_model_predict(cpu, d_cpu, 50, &p_cpu) == MPT_OK &&
                  mpt_model_predict(gpu, d_gpu, 50, &p_gpu) == MPT_OK,
              "predict: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
        CHECK(mpt_tensor_bytes(&p_cpu) == mpt_tensor_bytes(&p_gpu) &&
                  !memcmp(p_cpu.data, p_gpu.data, mpt_tensor_bytes(&p_cpu)),
              "policy %d: predictions differ", k);
        /* 96 training samples = 3 batches per epoch, each uploaded as x and y */
        CHECK(dev.uploads_async == 3 * 3 * 2 && dev.waits == 3 * 3,
              "policy %d: %ld asynchronous uploads, %ld waits (want 18, 9)", k,
              dev.uploads_async, dev.waits);
        /* a step recorded per buffer, every full step replayed, nothing
           recorded that a GPU could not record */
        CHECK(dev.captures == 2 && dev.replays == 9 && dev.unrecordable == 0,
              "policy %d: %ld steps recorded, %ld replayed (want 2, 9), %ld calls a graph "
              "cannot hold", k, dev.captures, dev.replays, dev.unrecordable);
        CHECK(dev.plans > 0, "policy %d: no GEMM was timed before the first step", k);
        CHECK(dev.stray == 0, "policy %d: %ld host pointers reached the device's functions", k,
              dev.stray);
        mpt_tensor_free(ctx, &p_cpu);
        mpt_tensor_free(dc, &p_gpu);
        mpt_model_destroy(cpu);
        mpt_model_destroy(gpu);
        mpt_dataset_destroy(d_cpu);
        mpt_dataset_destroy(d_gpu);
        CHECK(dev.n == 0, "policy %d: %d device blocks leaked", k, dev.n);
        mpt_context_destroy(dc);
    }
}

/* The same fit (2 epochs of BATCH, a fifth held out) of the same model on
   the CPU and on the device: the same weights, optimizer state and
   history, bit for bit. */
static void fit_both_alike(mpt_context *dc, mpt_model *cpu, mpt_model *gpu,
                           const mpt_dataset *d_cpu, const mpt_dataset *d_gpu) {
    mpt_fit_desc fit;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    fit.validation_split = 0.2f;
    CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "cpu fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "device fit: %s", mpt_context_error(dc));
    CHECK(test_same_state(cpu, gpu), "weights differ after fit");
    CHECK(same_history(cpu, gpu), "histories differ");
}

/* ---- uint8 images: uploaded as bytes, normalised on the device ------------------ */

static uint8_t pixels[N * SIDE * SIDE];

/* The image data as uint8 pixels (x/255 as the IDX loader scales them). */
static mpt_dataset *byte_dataset(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_UINT8, 4, (int64_t[]){N, SIDE, SIDE, 1}, pixels);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N}, ys);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty, .scale = 1.0f / 255},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

/* How fit_bytes feeds the device. */
typedef enum feed_mode {
    FEED_RESIDENT, /* the default: the dataset on the device, indices go up */
    FEED_BYTES,    /* MPT_RESIDENT=0: each batch's bytes go up             */
    FEED_HOST      /* MPT_UPLOAD_BYTES=0: the host's normalised values      */
} feed_mode;

/* A uint8 dataset stays on the device whole (Keras' cache()): each step
   uploads its sample indices alone, gathers its images and labels there,
   and looks the bytes up in the dataset's own table (all recorded with
   the step, so each replay does it again); with two replicas, or
   MPT_RESIDENT=0, each batch's bytes go up instead, a quarter of
   float32's; MPT_UPLOAD_BYTES=0 uploads the host's values. Every way, fit
   ends bit for bit where the CPU's ends, in every policy. */
static void fit_bytes(mpt_policy policy, int replicas, feed_mode mode) {
    mpt_context *dc = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    const mpt_strategy_desc sd = {.type = MPT_STRATEGY_MIRRORED, .num_replicas = 2};
    /* 96 training samples: 3 batches an epoch, 2 epochs; each uploads its
       images and its int32 labels */
    const long steps = 6;
    long labels = 4 * BATCH;
    long images = SIDE * SIDE * BATCH;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    if (replicas)
        CHECK(mpt_strategy_create(ctx, &sd, &s_cpu) == MPT_OK &&
                  mpt_strategy_create(dc, &sd, &s_dev) == MPT_OK,
              "strategy: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    d_cpu = byte_dataset(ctx);
    d_gpu = byte_dataset(dc);
    cpu = image_model_with(ctx, policy, s_cpu, 0);
    gpu = image_model_with(dc, policy, s_dev, 0);
    if (mode == FEED_BYTES) setenv("MPT_RESIDENT", "0", 1);
    if (mode == FEED_HOST) setenv("MPT_UPLOAD_BYTES", "0", 1);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu);
    unsetenv("MPT_RESIDENT");
    unsetenv("MPT_UPLOAD_BYTES");
    CHECK(!replicas || test_same_state(cpu->replica[1], gpu->replica[1]),
          "policy %d, mode %d: replica 1's weights differ from the CPU's", (int)policy, (int)mode);
    if (mode == FEED_HOST) images *= (long)mpt_dtype_size(mpt__input_batch_dtype(gpu));
    if (mode == FEED_RESIDENT && !replicas) images = 0, labels = 4 * BATCH; /* the indices */
    CHECK(dev.upload_bytes == steps * (images + labels),
          "policy %d, replicas %d, mode %d: %ld bytes uploaded a step, want %ld", (int)policy,
          replicas, (int)mode, dev.upload_bytes / steps, images + labels);
    CHECK(dev.lookups == (mode == FEED_HOST ? 0 : steps * (replicas ? 2 : 1)),
          "policy %d, replicas %d, mode %d: %ld lookups on the device", (int)policy, replicas,
          (int)mode, dev.lookups);
    CHECK(dev.captures == 2 && dev.unrecordable == 0 && dev.stray == 0,
          "%ld steps recorded (want 2), %ld calls a graph cannot hold, %ld host pointers on "
          "the device", dev.captures, dev.unrecordable, dev.stray);
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

static void test_fit_bytes_match_the_cpu(void) {
    int64_t i;
    for (i = 0; i < N * SIDE * SIDE; i++) pixels[i] = (uint8_t)((i * 37 + i / 61) % 256);
    fit_bytes(MPT_POLICY_FLOAT32, 0, FEED_RESIDENT);
    fit_bytes(MPT_POLICY_MIXED_FLOAT16, 0, FEED_RESIDENT);
    fit_bytes(MPT_POLICY_MIXED_BFLOAT16, 0, FEED_RESIDENT);
    fit_bytes(MPT_POLICY_MIXED_FLOAT16, 1, FEED_RESIDENT); /* replicas: bytes go up */
    fit_bytes(MPT_POLICY_MIXED_FLOAT16, 0, FEED_BYTES);
    fit_bytes(MPT_POLICY_MIXED_BFLOAT16, 0, FEED_BYTES);
    fit_bytes(MPT_POLICY_MIXED_FLOAT16, 0, FEED_HOST);
}

/* Sample weights (with class weights and weighted metrics) on the
   emulated device: each batch's weights go up with its targets, by the
   asynchronous path and into the recorded steps' buffers, and fit,
   validation and evaluate end bit for bit where the CPU's do. */
static void test_sample_weights_match_the_cpu(void) {
    static float w[N];
    const float class_weight[CLASSES] = {1.5f, 0.5f, 2.0f, 1.0f};
    mpt_context *dc = NULL;
    mpt_model *cpu_model, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_logs l_cpu, l_gpu;
    mpt_fit_desc fit;
    int i;
    for (i = 0; i < N; i++) w[i] = (float)((i * 7) % 11) * 0.25f;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    CHECK(mpt_dataset_set_sample_weight(ctx, d_cpu, w, N) == MPT_OK &&
              mpt_dataset_set_sample_weight(dc, d_gpu, w, N) == MPT_OK,
          "weights: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    cpu_model = image_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    gpu = image_model(dc, MPT_POLICY_MIXED_FLOAT16);
    {   /* compiled again, with weighted accuracy */
        mpt_compile_desc c = cpu_model->compile;
        c.weighted_metrics = MPT_METRIC_ACCURACY;
        CHECK(mpt_model_compile(cpu_model, &c) == MPT_OK && mpt_model_compile(gpu, &c) == MPT_OK,
              "compile: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    }
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    fit.validation_split = 0.2f;
    fit.class_weight = class_weight;
    fit.class_weight_count = CLASSES;
    CHECK(mpt_model_fit(cpu_model, d_cpu, &fit) == MPT_OK, "cpu fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "device fit: %s", mpt_context_error(dc));
    CHECK(test_same_state(cpu_model, gpu), "weights differ after a weighted fit");
    CHECK(same_history(cpu_model, gpu), "histories differ");
    CHECK(history_value(gpu, "val_weighted_accuracy", 1) >= 0, "no val_weighted_accuracy");
    CHECK(mpt_model_evaluate(cpu_model, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                  MPT_OK &&
              mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_gpu) ==
                  MPT_OK,
          "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    CHECK(mpt_logs_get(&l_cpu, "loss") == mpt_logs_get(&l_gpu, "loss") &&
              mpt_logs_get(&l_cpu, "weighted_accuracy") == mpt_logs_get(&l_gpu, "weighted_accuracy"),
          "evaluate %.17g/%.17g vs %.17g/%.17g", mpt_logs_get(&l_cpu, "loss"),
          mpt_logs_get(&l_cpu, "weighted_accuracy"), mpt_logs_get(&l_gpu, "loss"),
          mpt_logs_get(&l_gpu, "weighted_accuracy"));
    /* 96 training samples = 3 batches per epoch, each uploaded as x, y and w */
    CHECK(dev.uploads_async == 2 * 3 * 3 && dev.captures == 2 && dev.stray == 0,
          "%ld asynchronous uploads (want 18), %ld steps recorded (want 2), %ld host pointers "
          "on the device", dev.uploads_async, dev.captures, dev.stray);
    mpt_model_destroy(cpu_model);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* r2_score and auc (plain and weighted) on the emulated device: their
   records live in its memory, the recorded steps' loss adds to them on
   replay, and fit, validation and evaluate end bit for bit where the
   CPU's do. Flatten -> Dense(2, sigmoid) under mean squared error, the
   targets a class's two yes-or-no answers. */
static float binary_ys[N * 2];

static mpt_model *binary_model(mpt_context *c) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 17}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .activation = MPT_ACT_SIGMOID});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.05f},
              .loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
              .metrics = MPT_METRIC_R2_SCORE | MPT_METRIC_AUC,
              .weighted_metrics = MPT_METRIC_R2_SCORE | MPT_METRIC_AUC}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

static mpt_dataset *binary_dataset(mpt_context *c, const float *w) {
    mpt_tensor tx, ty, tw;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &ty, MPT_FLOAT32, 2, (int64_t[]){N, 2}, binary_ys);
    mpt_tensor_wrap(c, &tw, MPT_FLOAT32, 1, (int64_t[]){N}, (void *)(uintptr_t)w);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty, .sample_weight = &tw},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

static void test_r2_score_and_auc_match_the_cpu(void) {
    static float w[N];
    static const char *const keys[4] = {"r2_score", "auc", "weighted_r2_score", "weighted_auc"};
    mpt_context *dc = NULL;
    mpt_model *cpu_model, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_logs l_cpu, l_gpu;
    int i;
    for (i = 0; i < N; i++) {
        w[i] = (float)((i * 7) % 11) * 0.25f;
        binary_ys[2 * i] = ys[i] == 1 ? 1.0f : 0.0f;
        binary_ys[2 * i + 1] = ys[i] >= 2 ? 1.0f : 0.0f;
    }
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = binary_dataset(ctx, w);
    d_gpu = binary_dataset(dc, w);
    cpu_model = binary_model(ctx);
    gpu = binary_model(dc);
    CHECK(mpt_model_fit(cpu_model, d_cpu, &(mpt_fit_desc){.epochs = 2, .batch_size = BATCH,
                                                          .validation_split = 0.2f}) == MPT_OK,
          "cpu fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &(mpt_fit_desc){.epochs = 2, .batch_size = BATCH,
                                                    .validation_split = 0.2f}) == MPT_OK,
          "device fit: %s", mpt_context_error(dc));
    CHECK(test_same_state(cpu_model, gpu), "weights differ");
    CHECK(same_history(cpu_model, gpu), "histories differ");
    CHECK(history_value(gpu, "val_weighted_auc", 1) > 0 && history_value(gpu, "auc", 1) > 0,
          "val_weighted_auc %g, auc %g", history_value(gpu, "val_weighted_auc", 1),
          history_value(gpu, "auc", 1));
    CHECK(mpt_model_evaluate(cpu_model, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                  MPT_OK &&
              mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_gpu) ==
                  MPT_OK,
          "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    for (i = 0; i < 4; i++)
        CHECK(mpt_logs_get(&l_cpu, keys[i]) == mpt_logs_get(&l_gpu, keys[i]) &&
                  !isnan(mpt_logs_get(&l_cpu, keys[i])),
              "evaluate's %s: %.17g on the CPU, %.17g on the device", keys[i],
              mpt_logs_get(&l_cpu, keys[i]), mpt_logs_get(&l_gpu, keys[i]));
    CHECK(dev.captures == 2 && dev.stray == 0,
          "%ld steps recorded (want 2), %ld host pointers on the device", dev.captures, dev.stray);
    mpt_model_destroy(cpu_model);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* An output of several positions per sample: Conv2D 'same' ->
   LayerNormalization (each pixel's channels) -> Conv2D(1×1, softmax) gives
   (SIDE, SIDE, CLASSES), with a class id per pixel (the quadrant's class
   where the square is, else 0). The per-position loss, its gradient, the
   tally of samples and fractional hits and LayerNormalization's recorded
   and replayed calls go the same way through the device's staging as on
   the CPU, bit for bit. */
static int32_t pixel_ys[N * SIDE * SIDE];

static mpt_model *pixel_model(mpt_context *c) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .seed = 13}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 6, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_layer_normalization(m, NULL); /* each pixel's 6 channels */
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = CLASSES, .kernel_size = {1, 1},
                                               .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K, .top_k = 2}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

static mpt_dataset *pixel_dataset(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 3, (int64_t[]){N, SIDE, SIDE}, pixel_ys);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

static void test_fit_per_position_matches_the_cpu(void) {
    mpt_context *dc = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_logs l_cpu, l_gpu;
    int i, r, q;
    for (i = 0; i < N; i++)
        for (r = 0; r < SIDE; r++)
            for (q = 0; q < SIDE; q++) {
                int in = (r < SIDE / 2) == (ys[i] < 2) && (q < SIDE / 2) == (ys[i] % 2 == 0);
                pixel_ys[(i * SIDE + r) * SIDE + q] = in ? ys[i] : 0;
            }
    memset(&dev, 0, sizeof dev);
    memset(&l_cpu, 0, sizeof l_cpu);
    memset(&l_gpu, 0, sizeof l_gpu);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = pixel_dataset(ctx);
    d_gpu = pixel_dataset(dc);
    cpu = pixel_model(ctx);
    gpu = pixel_model(dc);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu);
    CHECK(mpt_model_evaluate(cpu, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                  MPT_OK &&
              mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_gpu) ==
                  MPT_OK,
          "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    CHECK(mpt_logs_get(&l_cpu, "loss") == mpt_logs_get(&l_gpu, "loss") &&
              mpt_logs_get(&l_cpu, "accuracy") == mpt_logs_get(&l_gpu, "accuracy") &&
              mpt_logs_get(&l_cpu, "sparse_top_k_categorical_accuracy") ==
                  mpt_logs_get(&l_gpu, "sparse_top_k_categorical_accuracy"),
          "evaluate %g/%g vs %g/%g", mpt_logs_get(&l_cpu, "loss"),
          mpt_logs_get(&l_cpu, "accuracy"), mpt_logs_get(&l_gpu, "loss"),
          mpt_logs_get(&l_gpu, "accuracy"));
    /* accuracy over 64 positions a sample: not a whole number of samples */
    CHECK(mpt_logs_get(&l_cpu, "accuracy") > 0.5, "accuracy %g after 2 epochs",
          mpt_logs_get(&l_cpu, "accuracy"));
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* MultiHeadAttention (causal, with dropout on its weights) over token
   embeddings, a class per position: its recorded and replayed attention
   calls, dropout's step read from the device's step state, go the same
   way through the device as on the CPU, bit for bit. */
enum { SEQ_T = 6, SEQ_V = 5 };
static int32_t seq_x[N * SEQ_T], seq_y[N * SEQ_T];

static mpt_model *attention_model(mpt_context *c) {
    mpt_model *m = NULL;
    mpt_node h;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SEQ_T}, .input_rank = 1,
                                          .input_dtype = MPT_INT32, .seed = 5,
                                          .policy = MPT_POLICY_MIXED_BFLOAT16}, &m);
    h = mpt_embedding(m, mpt_model_input(m),
                      &(mpt_embedding_desc){.input_dim = SEQ_V, .output_dim = 8});
    h = mpt_multi_head_attention(m, h, h, &(mpt_multi_head_attention_desc){
                                     .num_heads = 2, .key_dim = 4, .use_causal_mask = 1,
                                     .dropout = 0.1f});
    mpt_dense(m, h, &(mpt_dense_desc){.units = SEQ_V, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(c, m);
    return m;
}

static mpt_dataset *attention_dataset(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_tensor_wrap(c, &tx, MPT_INT32, 2, (int64_t[]){N, SEQ_T}, seq_x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 2, (int64_t[]){N, SEQ_T}, seq_y);
    return test_dataset_of(c, &tx, &ty);
}

static void test_fit_attention_matches_the_cpu(void) {
    mpt_context *dc = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    int i, t;
    for (i = 0; i < N; i++)
        for (t = 0; t < SEQ_T; t++) {
            seq_x[i * SEQ_T + t] = test_randint(0, SEQ_V - 1);
            seq_y[i * SEQ_T + t] = seq_x[i * SEQ_T + (t ? t - 1 : 0)];
        }
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = attention_dataset(ctx);
    d_gpu = attention_dataset(dc);
    cpu = attention_model(ctx);
    gpu = attention_model(dc);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu);
    CHECK(dev.replays > 0 && dev.unrecordable == 0, "%ld replays, %ld steps unrecordable",
          dev.replays, dev.unrecordable);
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    { /* generation from the device's model (its weights downloaded): the CPU's ids */
        const int32_t prompt[3] = {1, 4, 2};
        const mpt_generate_desc gd = {.max_new_tokens = 2 * SEQ_T, .temperature = 0.8f,
                                      .top_k = 3, .seed = 11};
        int32_t a[3 + 2 * SEQ_T], b[3 + 2 * SEQ_T];
        CHECK(mpt_model_generate(cpu, prompt, 3, &gd, a) == MPT_OK &&
                  mpt_model_generate(gpu, prompt, 3, &gd, b) == MPT_OK,
              "generate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
        CHECK(memcmp(a, b, sizeof a) == 0, "ids generated from the device's model differ");
    }
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* A model of three inputs: the image, a vector (4) whose first number
   carries the class's low bit, and ids (3) into an Embedding; fit's feed
   stages and uploads every input ahead of its step on the device, and
   the recorded steps replay them: the model ends where it ends on the
   CPU, bit for bit, on one replica and on two logical ones; evaluate and
   predict (each batch's inputs uploaded as it comes) agree too. */
static float two_vec[N * 4];
static int32_t two_ids[N * 3];

static mpt_dataset *inputs_dataset(mpt_context *c) {
    mpt_tensor tx, tv, ti, ty;
    const mpt_tensor *in[3];
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &tv, MPT_FLOAT32, 2, (int64_t[]){N, 4}, two_vec);
    mpt_tensor_wrap(c, &ti, MPT_INT32, 2, (int64_t[]){N, 3}, two_ids);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N}, ys);
    in[0] = &tx, in[1] = &tv, in[2] = &ti;
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.inputs = in, .input_count = 3, .y = &ty},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

static mpt_model *inputs_model(mpt_context *c, mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_node three[3], v, ids;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 13,
                                          .strategy = s}, &m);
    v = mpt_model_add_input(m, &(mpt_input_desc){.shape = {4}, .rank = 1});
    ids = mpt_model_add_input(m, &(mpt_input_desc){.shape = {3}, .rank = 1, .dtype = MPT_INT32});
    three[0] = mpt_flatten(m, mpt_conv2d(m, mpt_model_input(m), &(mpt_conv2d_desc){
                                             .filters = 2, .kernel_size = {3, 3},
                                             .activation = MPT_ACT_RELU}), NULL);
    three[1] = mpt_dense(m, v, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_RELU});
    three[2] = mpt_flatten(m, mpt_embedding(m, ids, &(mpt_embedding_desc){.input_dim = 6,
                                                                          .output_dim = 2}),
                           NULL);
    mpt_dense(m, mpt_concatenate(m, 3, three, NULL),
              &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(c, m);
    return m;
}

/* A fresh emulated device (its counters zeroed) on a context of 2 threads,
   and for replicas > 1 a mirrored strategy of that many on the CPU's
   context and on the device's (else both NULL). */
static mpt_context *device_and_strategies(int replicas, mpt_strategy **s_cpu,
                                          mpt_strategy **s_dev) {
    mpt_context *dc = NULL;
    *s_cpu = *s_dev = NULL;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    if (replicas > 1)
        CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                            .num_replicas = replicas},
                                  s_cpu) == MPT_OK &&
                  mpt_strategy_create(dc, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                               .num_replicas = replicas},
                                      s_dev) == MPT_OK,
              "strategy: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    return dc;
}

static void fit_inputs_on_the_device(int replicas) {
    mpt_context *dc = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_logs l_cpu, l_gpu;
    mpt_tensor p_cpu, p_gpu;
    int i;
    for (i = 0; i < N * 4; i++) two_vec[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < N; i++) two_vec[i * 4] = ys[i] % 2 ? 0.8f : -0.8f;
    for (i = 0; i < N * 3; i++) two_ids[i] = test_randint(0, 5);
    dc = device_and_strategies(replicas, &s_cpu, &s_dev);
    d_cpu = inputs_dataset(ctx);
    d_gpu = inputs_dataset(dc);
    cpu = inputs_model(ctx, s_cpu);
    gpu = inputs_model(dc, s_dev);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu);
    CHECK(replicas == 1 || test_same_state(cpu->replica[1], gpu->replica[1]),
          "replica 1 differs between the CPU and the device");
    CHECK(dev.replays > 0 && dev.unrecordable == 0, "%d replicas: %ld replays, %ld calls a graph "
          "cannot hold", replicas, dev.replays, dev.unrecordable);
    CHECK(mpt_model_evaluate(cpu, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                  MPT_OK &&
              mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_gpu) ==
                  MPT_OK,
          "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    CHECK(mpt_logs_get(&l_cpu, "loss") == mpt_logs_get(&l_gpu, "loss"), "evaluate %g vs %g",
          mpt_logs_get(&l_cpu, "loss"), mpt_logs_get(&l_gpu, "loss"));
    CHECK(mpt_model_predict(cpu, d_cpu, 50, &p_cpu) == MPT_OK &&
              mpt_model_predict(gpu, d_gpu, 50, &p_gpu) == MPT_OK,
          "predict: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    CHECK(memcmp(p_cpu.data, p_gpu.data, mpt_tensor_bytes(&p_cpu)) == 0,
          "predictions differ");
    mpt_tensor_free(ctx, &p_cpu);
    mpt_tensor_free(dc, &p_gpu);
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

static void test_fit_inputs_matches_the_cpu(void) {
    fit_inputs_on_the_device(1);
    fit_inputs_on_the_device(2);
}

/* A model of two outputs (the class, and the image's mean brightness as a
   number): fit's feed stages and uploads output 1's targets ahead of each
   step beside y, the recorded steps replay them, and each output's loss
   tallies into its own record on the device: the model ends where it
   ends on the CPU, bit for bit, on one replica and on two logical ones;
   evaluate (each batch's labels uploaded as it comes) and
   predict_outputs agree too. */
static float brightness[N];

static mpt_dataset *outputs_dataset(mpt_context *c) {
    mpt_tensor tx, ty, tt;
    const mpt_tensor *labels[2];
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N}, ys);
    mpt_tensor_wrap(c, &tt, MPT_FLOAT32, 2, (int64_t[]){N, 1}, brightness);
    labels[0] = &ty, labels[1] = &tt;
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .labels = labels,
                                                    .label_count = 2},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

static mpt_model *outputs_model(mpt_context *c, mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_node h;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .policy = MPT_POLICY_MIXED_FLOAT16, .seed = 17,
                                          .strategy = s}, &m);
    h = mpt_flatten(m, mpt_conv2d(m, mpt_model_input(m), &(mpt_conv2d_desc){
                                         .filters = 2, .kernel_size = {3, 3},
                                         .activation = MPT_ACT_RELU}), NULL);
    h = mpt_dense(m, h, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_output(m, mpt_dense(m, h, &(mpt_dense_desc){.units = CLASSES,
                                                              .activation = MPT_ACT_SOFTMAX}));
    mpt_model_add_output(m, mpt_dense(m, h, &(mpt_dense_desc){.units = 1}));
    test_compile_class_and_number(c, m, (mpt_optimizer_desc){0});
    return m;
}

static void fit_outputs_on_the_device(int replicas) {
    mpt_context *dc = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_logs l_cpu, l_gpu;
    mpt_tensor p_cpu[2], p_gpu[2];
    int i, k;
    for (i = 0; i < N; i++) {
        double sum = 0;
        for (k = 0; k < SIDE * SIDE; k++) sum += xs[i * SIDE * SIDE + k];
        brightness[i] = (float)(sum / (SIDE * SIDE));
    }
    dc = device_and_strategies(replicas, &s_cpu, &s_dev);
    d_cpu = outputs_dataset(ctx);
    d_gpu = outputs_dataset(dc);
    cpu = outputs_model(ctx, s_cpu);
    gpu = outputs_model(dc, s_dev);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu);
    CHECK(dev.replays > 0 && dev.unrecordable == 0, "%d replicas: %ld replays, %ld calls a graph "
          "cannot hold", replicas, dev.replays, dev.unrecordable);
    CHECK(mpt_model_evaluate(cpu, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                  MPT_OK &&
              mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_gpu) ==
                  MPT_OK,
          "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    CHECK(l_cpu.count == 5 && l_gpu.count == 5 &&
              memcmp(l_cpu.values, l_gpu.values, sizeof(double) * 5) == 0,
          "evaluate: loss %g vs %g, dense_2_loss %g vs %g", mpt_logs_get(&l_cpu, "loss"),
          mpt_logs_get(&l_gpu, "loss"), mpt_logs_get(&l_cpu, "dense_2_loss"),
          mpt_logs_get(&l_gpu, "dense_2_loss"));
    CHECK(mpt_model_predict_outputs(cpu, d_cpu, 50, 2, p_cpu) == MPT_OK &&
              mpt_model_predict_outputs(gpu, d_gpu, 50, 2, p_gpu) == MPT_OK,
          "predict: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    for (k = 0; k < 2; k++) {
        CHECK(memcmp(p_cpu[k].data, p_gpu[k].data, mpt_tensor_bytes(&p_cpu[k])) == 0,
              "output %d's predictions differ", k);
        mpt_tensor_free(ctx, &p_cpu[k]);
        mpt_tensor_free(dc, &p_gpu[k]);
    }
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

static void test_fit_outputs_matches_the_cpu(void) {
    fit_outputs_on_the_device(1);
    fit_outputs_on_the_device(2);
}

/* A checkpoint saved from the device and loaded on the CPU (and back)
   carries every weight, moment and counter; training on continues alike. */
static void test_checkpoints_cross(void) {
    char path_buf[600];
    const char *path = test_file_in(path_buf, sizeof path_buf, tmpdir, "test_backend.safetensors");
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu, *back;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_fit_desc fit;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    gpu = image_model(dc, MPT_POLICY_MIXED_FLOAT16);
    cpu = image_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    back = image_model(dc, MPT_POLICY_MIXED_FLOAT16);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(mpt_model_save_checkpoint(gpu, path) == MPT_OK, "save: %s", mpt_context_error(dc));
    CHECK(mpt_model_build(cpu, BATCH) == MPT_OK && mpt_model_load_checkpoint(cpu, path) == MPT_OK,
          "load on the CPU: %s", mpt_context_error(ctx));
    CHECK(test_same_state(cpu, gpu), "the CPU's copy differs from the device's");
    CHECK(mpt_model_save_checkpoint(cpu, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(back, BATCH) == MPT_OK && mpt_model_load_checkpoint(back, path) == MPT_OK,
          "load on the device: %s", mpt_context_error(dc));
    CHECK(test_same_state(back, gpu), "the round trip changed the state");
    fit.initial_epoch = 2;
    fit.epochs = 3;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK && mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK,
          "resume: %s / %s", mpt_context_error(dc), mpt_context_error(ctx));
    CHECK(test_same_state(cpu, gpu), "resumed runs diverge");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    remove(path);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_model_destroy(back);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_context_destroy(dc);
}

/* EarlyStopping restoring the best weights works through downloads and
   uploads: the device's model ends where the CPU's does. */
static void test_early_stopping_restores(void) {
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_callback cb_cpu, cb_gpu;
    mpt_fit_desc fit;
    mpt_early_stopping_desc es;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    gpu = image_model(dc, MPT_POLICY_FLOAT32);
    cpu = image_model(ctx, MPT_POLICY_FLOAT32);
    memset(&es, 0, sizeof es);
    es.monitor = "val_loss";
    es.patience = 1;
    es.restore_best_weights = 1;
    es.min_delta = 10; /* nothing counts as an improvement: stops after epoch 2 */
    CHECK(mpt_callback_early_stopping(ctx, &es, &cb_cpu) == MPT_OK &&
              mpt_callback_early_stopping(dc, &es, &cb_gpu) == MPT_OK,
          "callback: %s", mpt_context_error(ctx));
    memset(&fit, 0, sizeof fit);
    fit.epochs = 5;
    fit.batch_size = BATCH;
    fit.validation_split = 0.25f;
    fit.callbacks = &cb_cpu;
    fit.n_callbacks = 1;
    CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    fit.callbacks = &cb_gpu;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(mpt_model_epoch(cpu) == 2 && mpt_model_epoch(gpu) == 2, "stopped after %d / %d epochs",
          mpt_model_epoch(cpu), mpt_model_epoch(gpu));
    CHECK(test_same_state(cpu, gpu), "restored weights differ");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_callback_destroy(&cb_cpu);
    mpt_callback_destroy(&cb_gpu);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_context_destroy(dc);
}

/* The public step functions take host tensors on a device model: the
   input and the output gradient go up, the views say where they live. */
static void test_public_steps_on_the_device(void) {
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu;
    mpt_tensor x, out_g, out_c, dout;
    mpt_param_info info;
    static float dy[BATCH * CLASSES];
    int i;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    gpu = image_model(dc, MPT_POLICY_MIXED_BFLOAT16);
    cpu = image_model(ctx, MPT_POLICY_MIXED_BFLOAT16);
    CHECK(mpt_model_build(gpu, BATCH) == MPT_OK && mpt_model_build(cpu, BATCH) == MPT_OK,
          "build: %s", mpt_context_error(dc));
    mpt_tensor_wrap(ctx, &x, MPT_FLOAT32, 4, (int64_t[]){BATCH, SIDE, SIDE, 1}, xs);
    for (i = 0; i < BATCH * CLASSES; i++) dy[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &dout, MPT_FLOAT32, 2, (int64_t[]){BATCH, CLASSES}, dy);
    CHECK(mpt_model_forward(gpu, &x, 1, &out_g) == MPT_OK &&
              mpt_model_forward(cpu, &x, 1, &out_c) == MPT_OK,
          "forward: %s", mpt_context_error(dc));
    CHECK(out_g.device == MPT_DEVICE_CUDA && out_c.device == MPT_DEVICE_CPU,
          "output views on devices %d and %d", (int)out_g.device, (int)out_c.device);
    CHECK(!memcmp(out_g.data, out_c.data, mpt_tensor_bytes(&out_c)), "outputs differ");
    CHECK(mpt_model_backward(gpu, &dout, NULL) == MPT_OK &&
              mpt_model_backward(cpu, &dout, NULL) == MPT_OK,
          "backward: %s", mpt_context_error(dc));
    for (i = 0; i < mpt_model_param_count(cpu); i++) {
        mpt_param_info ic;
        mpt_model_param(gpu, i, &info);
        mpt_model_param(cpu, i, &ic);
        CHECK(info.value.device == MPT_DEVICE_CUDA, "%s: value on device %d", info.name,
              (int)info.value.device);
        if (info.trainable)
            CHECK(!memcmp(info.grad.data, ic.grad.data, mpt_tensor_bytes(&ic.grad)),
                  "%s: gradients differ", info.name);
    }
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_context_destroy(dc);
}

/* Two mirrored replicas on the device (each with its own staging buffers,
   uploads and GEMM timing) end bit for bit where two replicas end on the
   CPU; their full steps are recorded and replayed, unless BatchNormalization
   is synchronized (its statistics pass through the host every step). */
static void mirrored_on_the_device(int synchronized) {
    mpt_context *dc = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_fit_desc fit;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = 2}, &s_cpu) == MPT_OK &&
              mpt_strategy_create(dc, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                           .num_replicas = 2}, &s_dev) == MPT_OK,
          "strategy: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    cpu = image_model_with(ctx, MPT_POLICY_MIXED_FLOAT16, s_cpu, synchronized);
    gpu = image_model_with(dc, MPT_POLICY_MIXED_FLOAT16, s_dev, synchronized);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(test_same_state(cpu, gpu) && test_same_state(cpu->replica[1], gpu->replica[1]),
          "synchronized %d: replicated weights differ between the CPU and the device",
          synchronized);
    CHECK(same_history(cpu, gpu), "synchronized %d: histories differ", synchronized);
    /* 2 epochs of 4 batches (the last of 24), each replica's rows as x and y */
    CHECK(dev.uploads_async == 2 * 4 * 2 * 2 && dev.waits == 2 * 4,
          "%ld asynchronous uploads, %ld waits (want 32, 8: one per step on the one device)",
          dev.uploads_async, dev.waits);
    /* the replicas share the device: their full steps (3 an epoch) recorded
       once per buffer and replayed; the last, of 12 rows each, runs as it is */
    CHECK(dev.captures == (synchronized ? 0 : 2) && dev.replays == (synchronized ? 0 : 6) &&
              dev.unrecordable == 0,
          "synchronized %d: %ld replicated steps recorded, %ld replayed, %ld calls a graph "
          "cannot hold", synchronized, dev.captures, dev.replays, dev.unrecordable);
    CHECK(dev.plans > 0, "the replicas' GEMMs were not timed");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

static void test_mirrored_on_the_device(void) {
    mirrored_on_the_device(0);
    mirrored_on_the_device(1);
}

/* MPT_NCCL_ONE_GPU=1: a mirrored strategy of the one device gets a
   communicator of one member; its step's gradient sum and the averaged
   BatchNormalization statistics go through it (recorded with the step,
   as NCCL's in a CUDA graph) and fit ends bit for bit where the CPU's
   ends with no strategy. */
static void test_one_member_communicator(void) {
    mpt_context *dc = NULL;
    mpt_strategy *s = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    setenv("MPT_NCCL_ONE_GPU", "1", 1);
    CHECK(mpt_strategy_create(dc, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED}, &s) ==
              MPT_OK,
          "strategy: %s", mpt_context_error(dc));
    unsetenv("MPT_NCCL_ONE_GPU");
    CHECK(s && s->comm && s->n_backends == 1, "no communicator of one member");
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    cpu = image_model_with(ctx, MPT_POLICY_MIXED_FLOAT16, NULL, 0);
    gpu = image_model_with(dc, MPT_POLICY_MIXED_FLOAT16, s, 0);
    fit_both_alike(dc, cpu, gpu, d_cpu, d_gpu); /* with no strategy on the CPU */
    CHECK(gpu->n_replicas == 1, "%d replicas, want 1", gpu->n_replicas);
    /* 3 steps an epoch, 2 epochs: each sums the gradients and averages the
       statistics (2 of BatchNormalization's saved buffers) */
    CHECK(dev.captures == 2 && dev.replays == 6 && dev.allreduces == 6 * 3,
          "%ld steps recorded (want 2), %ld replayed (want 6), %ld all-reduces run (want 18)",
          dev.captures, dev.replays, dev.allreduces);
    CHECK(dev.unrecordable == 0 && dev.stray == 0, "%ld calls a graph cannot hold, %ld host "
          "pointers on the device", dev.unrecordable, dev.stray);
    mpt_model_destroy(cpu);
    mpt_model_destroy(gpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* Two replicas on two emulated devices, run from one thread as a mirrored
   model on two GPUs runs them: every call that passes a replica's buffers
   goes to that replica's device (on a GPU, the device its call enters),
   the gradients and statistics are summed by the communicator (or, when
   synchronized, gathered through the host), and the model ends bit for
   bit where two replicas end on the CPU. */
static void mirrored_on_two_devices(int synchronized) {
    mpt_context *dc = NULL, *second = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_strategy_desc sd;
    mpt_model *cpu_model, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_fit_desc fit;
    memset(&dev, 0, sizeof dev);
    memset(&dev2, 0, sizeof dev2);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &second);
    use_emulated_device(dc);
    memset(&sd, 0, sizeof sd);
    sd.type = MPT_STRATEGY_MIRRORED;
    sd.num_replicas = 2;
    CHECK(mpt_strategy_create(ctx, &sd, &s_cpu) == MPT_OK &&
              mpt_strategy_create(dc, &sd, &s_dev) == MPT_OK,
          "strategy: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    add_second_device(s_dev, second);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    cpu_model = image_model_with(ctx, MPT_POLICY_MIXED_FLOAT16, s_cpu, synchronized);
    gpu = image_model_with(dc, MPT_POLICY_MIXED_FLOAT16, s_dev, synchronized);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH; /* 120 samples: the last batch of 24 */
    fit.validation_split = 0.2f;
    CHECK(mpt_model_fit(cpu_model, d_cpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(gpu->n_replicas == 2 && gpu->replica[1]->impl == (void *)second,
          "replica 1 is not on the second device");
    CHECK(test_same_state(cpu_model, gpu) && test_same_state(cpu_model->replica[1], gpu->replica[1]),
          "synchronized %d: weights on two devices differ from two replicas on the CPU",
          synchronized);
    CHECK(same_history(cpu_model, gpu), "synchronized %d: histories differ", synchronized);
    /* 2 epochs of 3 batches, each device's replica's rows as x and y */
    CHECK(dev.uploads_async == 12 && dev.waits == 6 && dev2.uploads_async == 12 &&
              dev2.waits == 6,
          "asynchronous uploads and waits: %ld and %ld on the first device, %ld and %ld on the "
          "second (want 12 and 6 on each)",
          dev.uploads_async, dev.waits, dev2.uploads_async, dev2.waits);
    CHECK(dev.captures == 0 && dev2.captures == 0,
          "a step over two devices (collectives in it) was recorded");
    CHECK(dev.allreduces > 0 && dev2.n > 0 && dev2.plans > 0,
          "%ld all-reduces, %d blocks and %ld timed GEMMs on the second device", dev.allreduces,
          dev2.n, dev2.plans);
    CHECK(dev.stray == 0, "synchronized %d: %ld pointers reached a device whose memory they are "
          "not", synchronized, dev.stray);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu_model);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0 && dev2.n == 0, "%d and %d device blocks leaked", dev.n, dev2.n);
    dev2_impl = NULL;
    mpt_context_destroy(second);
    mpt_context_destroy(dc);
}

static void test_mirrored_on_two_devices(void) {
    mirrored_on_two_devices(0);
    mirrored_on_two_devices(1);
}

/* ---- what both backends run: @backend-shared --------------------------------- */

/* Philox4x32-10 against Random123's known-answer vectors (kat_vectors:
   ctr[0..3], key[0..1] -> out[0..3]). mpt_philox4x32's counter_lo holds
   ctr[0] (low half) and ctr[1], counter_hi ctr[2] and ctr[3], the key
   key[0] and key[1]. */
static void test_philox_known_answers(void) {
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1}};
    int v, w;
    for (v = 0; v < 3; v++) {
        const uint32_t *t = kat[v];
        uint64_t lo = t[0] | (uint64_t)t[1] << 32, hi = t[2] | (uint64_t)t[3] << 32;
        uint64_t key = t[4] | (uint64_t)t[5] << 32;
        uint32_t out[4];
        mpt_philox4x32(key, hi, lo, out);
        for (w = 0; w < 4; w++)
            CHECK(out[w] == t[6 + w], "vector %d word %d: %08x, Random123 says %08x", v, w,
                  (unsigned)out[w], (unsigned)t[6 + w]);
    }
}

/* Every required slot of the CPU's table is filled (@backend). */
/* A backend's conv_cols_budget sets how many samples Conv2D puts through
   im2col and the product at once: the image model's Conv2D (36 output
   pixels of 9 values per sample) in chunks of 5 samples takes 10
   products for a batch of 50 where the CPU's budget takes 1, and predicts
   the same bits (each sample's rows are its own). */
static void test_conv_chunk_follows_the_backend(void) {
    mpt_context *dc = NULL;
    mpt_model *cpu, *dm;
    mpt_dataset *d_cpu, *d_dev;
    mpt_tensor p_cpu, p_dev;
    long products;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    emu_table.conv_direct = NULL; /* the im2col path, which chunks */
    emu_table.conv_cols_budget = 5 * (SIDE - 2) * (SIDE - 2) * 9;
    d_cpu = image_dataset(ctx);
    d_dev = image_dataset(dc);
    cpu = image_model(ctx, MPT_POLICY_FLOAT32);
    dm = image_model(dc, MPT_POLICY_FLOAT32);
    dev.gemms = 0;
    CHECK(mpt_model_predict(cpu, d_cpu, 50, &p_cpu) == MPT_OK &&
              mpt_model_predict(dm, d_dev, 50, &p_dev) == MPT_OK,
          "predict: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    products = dev.gemms;
    /* N = 120 samples in batches of 50, 50, 20, each: the Conv2D's chunks
       of 5 and one Dense */
    CHECK(products == (10 + 1) + (10 + 1) + (4 + 1), "%ld products for %d samples (want 27)",
          products, N);
    CHECK(mpt_tensor_bytes(&p_cpu) == mpt_tensor_bytes(&p_dev) &&
              !memcmp(p_cpu.data, p_dev.data, mpt_tensor_bytes(&p_cpu)),
          "predictions differ from the CPU's");
    mpt_tensor_free(ctx, &p_cpu);
    mpt_tensor_free(dc, &p_dev);
    mpt_model_destroy(cpu);
    mpt_model_destroy(dm);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_dev);
    mpt_context_destroy(dc);
    emu_table.conv_cols_budget = 0;
}

static void test_cpu_table_is_complete(void) {
    const mpt_backend *t = mpt_context_backend(ctx, NULL);
    const char *gap = backend_table_gap(t);
    CHECK(!strcmp(t->name, "cpu"), "the context's backend is \"%s\", not the CPU's", t->name);
    CHECK(!gap, "the CPU's table: %s", gap);
    CHECK(!t->comm_create, "the CPU's table has collectives");
}

static void run_cases(void) {
    TEST_RUN(test_philox_known_answers);
    TEST_RUN(test_cpu_table_is_complete);
    TEST_RUN(test_fit_matches_the_cpu);
    TEST_RUN(test_fit_bytes_match_the_cpu);
    TEST_RUN(test_fit_per_position_matches_the_cpu);
    TEST_RUN(test_fit_attention_matches_the_cpu);
    TEST_RUN(test_fit_inputs_matches_the_cpu);
    TEST_RUN(test_fit_outputs_matches_the_cpu);
    TEST_RUN(test_sample_weights_match_the_cpu);
    TEST_RUN(test_r2_score_and_auc_match_the_cpu);
    TEST_RUN(test_checkpoints_cross);
    TEST_RUN(test_early_stopping_restores);
    TEST_RUN(test_public_steps_on_the_device);
    TEST_RUN(test_mirrored_on_the_device);
    TEST_RUN(test_mirrored_on_two_devices);
    TEST_RUN(test_one_member_communicator);
    TEST_RUN(test_conv_chunk_follows_the_backend);
}

int main(void) {
    static const test_program p = {.name = "test_backend", .ctx = &ctx, .threads = 2,
                                   .setup = make_images, .tmpdir = tmpdir,
                                   .tmpdir_size = sizeof tmpdir,
                                   .keep_env = "MPT_KEEP_TEST_FILES", .cases = run_cases};
    return test_main(&p);
}

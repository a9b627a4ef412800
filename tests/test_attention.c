/* MultiHeadAttention: the backend's scaled dot-product attention against
   a double-precision reference (causal or not, a query shorter than the
   keys, several query blocks, dropout's mask, each dtype; outputs
   poisoned first), the reference's own gradients against finite
   differences; the layer's gradients against finite differences in
   double in all three policies (self-attention in a Sequential stack,
   cross-attention with a value and a key of their own in a graph,
   value_dim, output_dim, no biases, dropout); Keras' weights; training
   that repeats bit for bit on 1 and 2 threads; a small model that learns
   to copy the token before; model files; bad descriptors and shapes
   refused with their names; quantization refusing the layer. The same
   with no_flash_attention (the weights P kept from forward): the backend
   against the reference, the same bits as the fused attention (forward,
   gradients, training with dropout, on 1 and 2 threads), the layer's
   gradients against finite differences, P's bytes in mpt_model_memory's
   activations, the field in model files. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;
static char tmpdir[512];

static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                      MPT_POLICY_MIXED_BFLOAT16};

/* The documented dropout rule (Dropout's): word e % 4 of Philox(key, (step,
   e / 4)) as a 24-bit uniform is ≥ rate. */
static int ref_keep(uint64_t key, uint64_t step, uint64_t e, float rate) {
    uint32_t r[4];
    mpt_philox4x32(key, step, e / 4, r);
    return (float)(r[e % 4] >> 8) / 16777216.0f >= rate;
}

/* ---- the attention in double ------------------------------------------------

   q (B, Tq, H, dk), k (B, Tk, H, dk), v (B, Tk, H, dv) → o (B, Tq, H, dv),
   as mpt_attention_args documents it. */
typedef struct attn_shape {
    int64_t B, H, Tq, Tk, dk, dv, offset;
    int causal;
    float rate;
    uint64_t key, step;
} attn_shape;

static int64_t attn_seen(const attn_shape *s, int64_t i) {
    int64_t n = i + s->offset + 1;
    return s->causal ? (n < s->Tk ? n : s->Tk) : s->Tk;
}

/* The weights P (and P̃ with dropout) of (b, h), Tq × Tk. */
static void attn_weights_ref(const attn_shape *s, const double *q, const double *k, int64_t b,
                             int64_t h, double *p, double *pd) {
    double scale = (float)(1.0 / sqrt((double)s->dk)), keep_scale = 1.0f / (1.0f - s->rate);
    int64_t i, j, d;
    for (i = 0; i < s->Tq; i++) {
        double mx = -INFINITY, sum = 0;
        int64_t seen = attn_seen(s, i);
        for (j = 0; j < s->Tk; j++) {
            double dot = 0;
            for (d = 0; d < s->dk; d++)
                dot += q[((b * s->Tq + i) * s->H + h) * s->dk + d] *
                       k[((b * s->Tk + j) * s->H + h) * s->dk + d];
            p[i * s->Tk + j] = j < seen ? dot * scale : -INFINITY;
            if (j < seen && p[i * s->Tk + j] > mx) mx = p[i * s->Tk + j];
        }
        for (j = 0; j < s->Tk; j++) sum += j < seen ? exp(p[i * s->Tk + j] - mx) : 0;
        for (j = 0; j < s->Tk; j++) {
            uint64_t e = (uint64_t)(((b * s->H + h) * s->Tq + i) * s->Tk + j);
            p[i * s->Tk + j] = j < seen ? exp(p[i * s->Tk + j] - mx) / sum : 0;
            pd[i * s->Tk + j] = s->rate > 0 && !ref_keep(s->key, s->step, e, s->rate)
                                    ? 0
                                    : p[i * s->Tk + j] * (s->rate > 0 ? keep_scale : 1);
        }
    }
}

static void attn_forward_ref(const attn_shape *s, const double *q, const double *k,
                             const double *v, double *o) {
    double *p = (double *)malloc(sizeof(double) * (size_t)(2 * s->Tq * s->Tk)), *pd;
    int64_t b, h, i, j, e;
    pd = p + s->Tq * s->Tk;
    for (b = 0; b < s->B; b++)
        for (h = 0; h < s->H; h++) {
            attn_weights_ref(s, q, k, b, h, p, pd);
            for (i = 0; i < s->Tq; i++)
                for (e = 0; e < s->dv; e++) {
                    double acc = 0;
                    for (j = 0; j < s->Tk; j++)
                        acc += pd[i * s->Tk + j] * v[((b * s->Tk + j) * s->H + h) * s->dv + e];
                    o[((b * s->Tq + i) * s->H + h) * s->dv + e] = acc;
                }
        }
    free(p);
}

/* dq, dk, dv of Σ d_o · o, by the chain rule in double. */
static void attn_backward_ref(const attn_shape *s, const double *q, const double *k,
                              const double *v, const double *d_o, double *dq, double *dk,
                              double *dv) {
    int64_t n = s->Tq * s->Tk, b, h, i, j, d;
    double *p = (double *)malloc(sizeof(double) * (size_t)(4 * n)), *pd = p + n, *dp = p + 2 * n;
    double *ds = p + 3 * n, scale = (float)(1.0 / sqrt((double)s->dk));
    memset(dq, 0, sizeof(double) * (size_t)(s->B * s->Tq * s->H * s->dk));
    memset(dk, 0, sizeof(double) * (size_t)(s->B * s->Tk * s->H * s->dk));
    memset(dv, 0, sizeof(double) * (size_t)(s->B * s->Tk * s->H * s->dv));
    for (b = 0; b < s->B; b++)
        for (h = 0; h < s->H; h++) {
            attn_weights_ref(s, q, k, b, h, p, pd);
            for (i = 0; i < s->Tq; i++) {
                double row = 0;
                for (j = 0; j < s->Tk; j++) {
                    double g = 0;
                    for (d = 0; d < s->dv; d++) {
                        double go = d_o[((b * s->Tq + i) * s->H + h) * s->dv + d];
                        g += go * v[((b * s->Tk + j) * s->H + h) * s->dv + d];
                        dv[((b * s->Tk + j) * s->H + h) * s->dv + d] += pd[i * s->Tk + j] * go;
                    }
                    /* through the mask: dP = dP̃ · P̃ / P where P ≠ 0 */
                    dp[i * s->Tk + j] =
                        p[i * s->Tk + j] != 0 ? g * pd[i * s->Tk + j] / p[i * s->Tk + j] : 0;
                    row += p[i * s->Tk + j] * dp[i * s->Tk + j];
                }
                for (j = 0; j < s->Tk; j++)
                    ds[i * s->Tk + j] = p[i * s->Tk + j] * (dp[i * s->Tk + j] - row) * scale;
            }
            for (i = 0; i < s->Tq; i++)
                for (j = 0; j < s->Tk; j++)
                    for (d = 0; d < s->dk; d++) {
                        dq[((b * s->Tq + i) * s->H + h) * s->dk + d] +=
                            ds[i * s->Tk + j] * k[((b * s->Tk + j) * s->H + h) * s->dk + d];
                        dk[((b * s->Tk + j) * s->H + h) * s->dk + d] +=
                            ds[i * s->Tk + j] * q[((b * s->Tq + i) * s->H + h) * s->dk + d];
                    }
        }
    free(p);
}

static double *random_doubles(int64_t n, mpt_dtype dtype, double lo, double hi) {
    double *x = (double *)malloc(sizeof(double) * (size_t)n);
    int64_t i;
    for (i = 0; i < n; i++) x[i] = round_to(dtype, test_uniform(lo, hi));
    return x;
}

/* The reference's gradients against central differences of Σ d_o · o:
   the chain rule above is what the library is held to, so it is checked
   first (no dropout: the mask is not differentiable anyway). */
static void test_reference_gradients(void) {
    attn_shape s = {2, 2, 3, 4, 3, 2, 1, 1, 0, 0, 0};
    int64_t nq = s.B * s.Tq * s.H * s.dk, nk = s.B * s.Tk * s.H * s.dk, nv = s.B * s.Tk * s.H * s.dv;
    int64_t no = s.B * s.Tq * s.H * s.dv, i, t;
    double *q = random_doubles(nq, MPT_FLOAT32, -1, 1), *k = random_doubles(nk, MPT_FLOAT32, -1, 1);
    double *v = random_doubles(nv, MPT_FLOAT32, -1, 1), *d_o = random_doubles(no, MPT_FLOAT32, -1, 1);
    double *o = (double *)malloc(sizeof(double) * (size_t)no), *g[3], *num, worst = 0;
    double *in[3];
    int64_t count[3];
    test__begin();
    in[0] = q, in[1] = k, in[2] = v;
    count[0] = nq, count[1] = nk, count[2] = nv;
    for (t = 0; t < 3; t++) g[t] = (double *)malloc(sizeof(double) * (size_t)count[t]);
    attn_backward_ref(&s, q, k, v, d_o, g[0], g[1], g[2]);
    for (t = 0; t < 3; t++) {
        num = (double *)malloc(sizeof(double) * (size_t)count[t]);
        for (i = 0; i < count[t]; i++) {
            double keep = in[t][i], plus = 0, minus = 0;
            int64_t j;
            in[t][i] = keep + 1e-6;
            attn_forward_ref(&s, q, k, v, o);
            for (j = 0; j < no; j++) plus += d_o[j] * o[j];
            in[t][i] = keep - 1e-6;
            attn_forward_ref(&s, q, k, v, o);
            for (j = 0; j < no; j++) minus += d_o[j] * o[j];
            in[t][i] = keep;
            num[i] = (plus - minus) / 2e-6;
        }
        worst = fmax(worst, rel_err(g[t], num, count[t]));
        free(num);
    }
    CHECK(worst < 1e-7, "the reference's gradients differ from finite differences by %.3g", worst);
    for (t = 0; t < 3; t++) free(g[t]);
    free(q), free(k), free(v), free(d_o), free(o);
    test__end("the reference attention's gradients = finite differences");
}

/* ---- the backend's attention against the reference ---------------------------- */

/* n values of x as dtype into a fresh buffer. */
static void *as_dtype(mpt_dtype dtype, const double *x, int64_t n) {
    float *f = (float *)malloc(sizeof(float) * (size_t)n);
    void *out = malloc((size_t)n * mpt_dtype_size(dtype));
    int64_t i;
    for (i = 0; i < n; i++) f[i] = (float)x[i];
    mpt_convert(ctx, dtype, out, MPT_FLOAT32, f, n);
    free(f);
    return out;
}

static double *to_doubles(mpt_dtype dtype, const void *x, int64_t n) {
    float *f = (float *)malloc(sizeof(float) * (size_t)n);
    double *out = (double *)malloc(sizeof(double) * (size_t)n);
    int64_t i;
    mpt_convert(ctx, MPT_FLOAT32, f, dtype, x, n);
    for (i = 0; i < n; i++) out[i] = f[i];
    free(f);
    return out;
}

/* Tolerances (relative norm error): float32 sums; float16 and bfloat16
   round P̃ and dS to their significands as operands, and O once. */
static double attn_tolerance(mpt_dtype dtype, int backward) {
    if (dtype == MPT_FLOAT16) return backward ? 1e-2 : 3e-3;
    if (dtype == MPT_BFLOAT16) return backward ? 6e-2 : 2e-2;
    return backward ? 2e-5 : 2e-6;
}

/* keep: P kept in a probs buffer (poisoned: forward must write it all
   that backward reads) instead of computed again. */
static void check_backend_attention(mpt_context *c, const attn_shape *s, mpt_dtype dtype,
                                    int keep) {
    void *impl;
    const mpt_backend *be = mpt_context_backend(c, &impl);
    int64_t nq = s->B * s->Tq * s->H * s->dk, nk = s->B * s->Tk * s->H * s->dk;
    int64_t nv = s->B * s->Tk * s->H * s->dv, no = s->B * s->Tq * s->H * s->dv, ws_bytes;
    double *q = random_doubles(nq, dtype, -2, 2), *k = random_doubles(nk, dtype, -2, 2);
    double *v = random_doubles(nv, dtype, -1, 1), *d_o = random_doubles(no, dtype, -1, 1);
    double *o_ref = (double *)malloc(sizeof(double) * (size_t)no), *o_lib, e;
    double *g_ref[3], *g_lib[3];
    float *g[3];
    int64_t count[3];
    mpt_attention_args a;
    mpt_step_state state;
    int64_t saved_step = -1;
    char label[200];
    int t;
    snprintf(label, sizeof label,
             "attention %s B=%lld H=%lld Tq=%lld Tk=%lld dk=%lld dv=%lld%s offset %lld "
             "dropout %g%s",
             mpt_dtype_name(dtype), (long long)s->B, (long long)s->H, (long long)s->Tq,
             (long long)s->Tk, (long long)s->dk, (long long)s->dv, s->causal ? " causal" : "",
             (long long)s->offset, (double)s->rate, keep ? " P kept" : "");
    memset(&a, 0, sizeof a);
    memset(&state, 0, sizeof state);
    state.step = s->step;
    a.dtype = dtype;
    a.batch = s->B;
    a.heads = s->H;
    a.q_len = s->Tq;
    a.kv_len = s->Tk;
    a.key_dim = s->dk;
    a.value_dim = s->dv;
    a.scale = (float)(1.0 / sqrt((double)s->dk));
    a.causal = s->causal;
    a.causal_offset = s->offset;
    a.dropout = s->rate;
    a.dropout_key = s->key;
    a.state = &state;
    a.saved_step = &saved_step;
    a.q = as_dtype(dtype, q, nq);
    a.k = as_dtype(dtype, k, nk);
    a.v = as_dtype(dtype, v, nv);
    a.o = malloc((size_t)no * mpt_dtype_size(dtype));
    memset(a.o, 0xFF, (size_t)no * mpt_dtype_size(dtype)); /* NaN: every element must be written */
    if (keep) {
        size_t bytes = sizeof(float) * (size_t)(s->B * s->H * s->Tq * s->Tk);
        a.probs = (float *)malloc(bytes);
        memset(a.probs, 0xFF, bytes);
    }
    ws_bytes = be->attention_workspace(impl, &a);
    CHECK(ws_bytes >= 0, "%s: workspace %lld", label, (long long)ws_bytes);
    a.workspace = aligned_block((size_t)ws_bytes + 64, 64);
    be->attention_forward(impl, &a);
    CHECK(saved_step == (s->rate > 0 ? (int64_t)s->step : -1), "%s: saved step %lld", label,
          (long long)saved_step);
    attn_forward_ref(s, q, k, v, o_ref);
    o_lib = to_doubles(dtype, a.o, no);
    e = rel_err(o_lib, o_ref, no);
    CHECK(e <= attn_tolerance(dtype, 0), "%s: forward relative error %.3g > %.3g", label, e,
          attn_tolerance(dtype, 0));
    /* backward, from a step that is no longer the state's */
    state.step = s->step + 5;
    count[0] = nq, count[1] = nk, count[2] = nv;
    for (t = 0; t < 3; t++) {
        g[t] = (float *)malloc(sizeof(float) * (size_t)count[t]);
        memset(g[t], 0xFF, sizeof(float) * (size_t)count[t]);
        g_ref[t] = (double *)malloc(sizeof(double) * (size_t)count[t]);
    }
    a.d_o = as_dtype(dtype, d_o, no);
    a.dq = g[0], a.dk = g[1], a.dv = g[2];
    be->attention_backward(impl, &a);
    attn_backward_ref(s, q, k, v, d_o, g_ref[0], g_ref[1], g_ref[2]);
    for (t = 0; t < 3; t++) {
        static const char *const names[] = {"dq", "dk", "dv"};
        g_lib[t] = to_doubles(MPT_FLOAT32, g[t], count[t]);
        e = rel_err(g_lib[t], g_ref[t], count[t]);
        CHECK(e <= attn_tolerance(dtype, 1), "%s: %s relative error %.3g > %.3g", label,
              names[t], e, attn_tolerance(dtype, 1));
        free(g_lib[t]), free(g_ref[t]), free(g[t]);
    }
    free((void *)a.q), free((void *)a.k), free((void *)a.v), free(a.o), free((void *)a.d_o);
    free(a.probs);
    aligned_block_free(a.workspace);
    free(q), free(k), free(v), free(d_o), free(o_ref), free(o_lib);
}

static void test_backend_attention(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    /* B, H, Tq, Tk, dk, dv, offset, causal, rate, key, step */
    static const attn_shape shapes[] = {
        {2, 3, 5, 5, 4, 4, 0, 0, 0, 0, 0},
        {2, 2, 6, 6, 8, 3, 0, 1, 0, 0, 0},
        {1, 2, 3, 7, 5, 6, 4, 1, 0, 0, 0},       /* a query after 4 cached keys */
        {1, 1, 70, 70, 16, 8, 0, 1, 0, 0, 0},    /* two query blocks of the CPU's */
        {3, 1, 130, 9, 3, 5, 0, 0, 0, 0, 0},     /* three, against few keys */
        {2, 2, 9, 9, 4, 4, 0, 1, 0.3f, 77, 12},  /* dropout */
        {1, 3, 66, 40, 4, 2, 0, 0, 0.5f, 5, 3}};
    int d, k, keep;
    for (keep = 0; keep < 2; keep++)
        for (d = 0; d < 3; d++)
            for (k = 0; k < (int)(sizeof shapes / sizeof shapes[0]); k++) {
                test__begin();
                check_backend_attention(ctx, &shapes[k], dtypes[d], keep);
                test__end("backend attention %s, shape %d%s", mpt_dtype_name(dtypes[d]), k,
                          keep ? ", P kept" : "");
            }
}

/* One forward and backward of the backend's attention on c: o (in dtype)
   and dq, dk, dv (float32), fresh; P kept where keep. */
typedef struct attn_result {
    void *o;
    float *g[3];
} attn_result;

static attn_result run_attention(mpt_context *c, const attn_shape *s, mpt_dtype dtype, int keep,
                                 const void *const *qkv, const void *d_o) {
    void *impl;
    const mpt_backend *be = mpt_context_backend(c, &impl);
    mpt_attention_args a;
    mpt_step_state state;
    attn_result r;
    int64_t saved_step = -1, no = s->B * s->Tq * s->H * s->dv, count[3];
    int t;
    count[0] = count[1] = s->B * s->Tq * s->H * s->dk;
    count[1] = s->B * s->Tk * s->H * s->dk;
    count[2] = s->B * s->Tk * s->H * s->dv;
    memset(&a, 0, sizeof a);
    memset(&state, 0, sizeof state);
    state.step = s->step;
    a.dtype = dtype, a.batch = s->B, a.heads = s->H, a.q_len = s->Tq, a.kv_len = s->Tk;
    a.key_dim = s->dk, a.value_dim = s->dv, a.scale = (float)(1.0 / sqrt((double)s->dk));
    a.causal = s->causal, a.causal_offset = s->offset;
    a.dropout = s->rate, a.dropout_key = s->key, a.state = &state, a.saved_step = &saved_step;
    a.q = qkv[0], a.k = qkv[1], a.v = qkv[2], a.d_o = d_o;
    r.o = a.o = malloc((size_t)no * mpt_dtype_size(dtype));
    if (keep) { /* NaN: what backward reads, forward must have written */
        size_t bytes = sizeof(float) * (size_t)(s->B * s->H * s->Tq * s->Tk);
        a.probs = (float *)malloc(bytes);
        memset(a.probs, 0xFF, bytes);
    }
    a.workspace = aligned_block((size_t)be->attention_workspace(impl, &a) + 64, 64);
    for (t = 0; t < 3; t++) r.g[t] = (float *)malloc(sizeof(float) * (size_t)count[t]);
    a.dq = r.g[0], a.dk = r.g[1], a.dv = r.g[2];
    be->attention_forward(impl, &a);
    be->attention_backward(impl, &a);
    free(a.probs);
    aligned_block_free(a.workspace);
    return r;
}

/* Whether two results are the same bits; frees both. */
static int same_results(attn_result x, attn_result y, const attn_shape *s, mpt_dtype dtype) {
    int64_t no = s->B * s->Tq * s->H * s->dv, count[3];
    int t, same = memcmp(x.o, y.o, (size_t)no * mpt_dtype_size(dtype)) == 0;
    count[0] = s->B * s->Tq * s->H * s->dk;
    count[1] = s->B * s->Tk * s->H * s->dk;
    count[2] = s->B * s->Tk * s->H * s->dv;
    for (t = 0; t < 3; t++) {
        same &= memcmp(x.g[t], y.g[t], sizeof(float) * (size_t)count[t]) == 0;
        free(x.g[t]), free(y.g[t]);
    }
    free(x.o), free(y.o);
    return same;
}

/* P kept gives the fused attention's bits, O and dQ, dK, dV (the causal
   mask, dropout, several query blocks, a cache's offset, each dtype),
   and the same bits on 1 and 2 threads. */
static void test_kept_same_bits(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    /* B, H, Tq, Tk, dk, dv, offset, causal, rate, key, step */
    static const attn_shape shapes[] = {
        {2, 2, 6, 6, 8, 3, 0, 1, 0, 0, 0},
        {1, 2, 3, 7, 5, 6, 4, 1, 0, 0, 0},
        {1, 2, 140, 140, 16, 8, 0, 1, 0.2f, 9, 4}, /* three query blocks, dropout */
        {2, 3, 66, 40, 4, 2, 0, 0, 0.5f, 5, 3}};
    mpt_context *one = NULL;
    int d, k, t;
    mpt_context_create(&(mpt_context_desc){.num_threads = 1, .logger = {quiet_logger, NULL}}, &one);
    for (d = 0; d < 3; d++)
        for (k = 0; k < (int)(sizeof shapes / sizeof shapes[0]); k++) {
            const attn_shape *s = &shapes[k];
            int64_t count[4];
            double *x[4];
            const void *in[4];
            test__begin();
            count[0] = s->B * s->Tq * s->H * s->dk, count[1] = s->B * s->Tk * s->H * s->dk;
            count[2] = s->B * s->Tk * s->H * s->dv, count[3] = s->B * s->Tq * s->H * s->dv;
            for (t = 0; t < 4; t++) {
                x[t] = random_doubles(count[t], dtypes[d], -2, 2);
                in[t] = as_dtype(dtypes[d], x[t], count[t]);
            }
            CHECK(same_results(run_attention(one, s, dtypes[d], 1, in, in[3]),
                               run_attention(ctx, s, dtypes[d], 1, in, in[3]), s, dtypes[d]),
                  "%s shape %d: P kept differs between 1 and 2 threads",
                  mpt_dtype_name(dtypes[d]), k);
            CHECK(same_results(run_attention(ctx, s, dtypes[d], 0, in, in[3]),
                               run_attention(ctx, s, dtypes[d], 1, in, in[3]), s, dtypes[d]),
                  "%s shape %d: P kept differs from the fused attention", mpt_dtype_name(dtypes[d]),
                  k);
            for (t = 0; t < 4; t++) free(x[t]), free((void *)in[t]);
            test__end("P kept = fused attention, bit for bit, %s shape %d",
                      mpt_dtype_name(dtypes[d]), k);
        }
    mpt_context_destroy(one);
}

/* ---- the layer's gradients ---------------------------------------------------- */

/* What the model around the layer is: MHA on x alone (Sequential); on x
   with a value Dense(dv_in)(x) and a key Dense(dk_in)(x) of their own; on
   x with the value Concatenate(axis 1)(x, Dense(D)(x)), twice as long. */
enum { MHA_SELF, MHA_KEY_VALUE, MHA_LONGER_VALUE };

typedef struct mha_ref {
    int kind;
    int64_t T, D, H, dk, dv, dout, dv_in, dk_in;
    int causal, bias;
    float rate;
    const mpt_model *m; /* for dropout's key and step */
    int layer;          /* the attention's index */
    int keep;           /* no_flash_attention */
} mha_ref;

/* y (rows, n) = x (rows, k) · w (k, n) + b (n, or NULL) */
static void ref_dense(const double *x, const double *w, const double *b, int64_t rows,
                      int64_t k, int64_t n, double *y) {
    int64_t r, i, j;
    for (r = 0; r < rows; r++)
        for (j = 0; j < n; j++) {
            double acc = b ? b[j] : 0;
            for (i = 0; i < k; i++) acc += x[r * k + i] * w[i * n + j];
            y[r * n + j] = acc;
        }
}

static void mha_forward_ref(const gc_case *c, const double *x, double *const *params, double *y) {
    const mha_ref *d = (const mha_ref *)c->user;
    const int64_t B = c->batch, T = d->T, D = d->D, Tk = d->kind == MHA_LONGER_VALUE ? 2 * T : T;
    int64_t Dv = d->kind == MHA_KEY_VALUE ? d->dv_in : D, Dk = d->kind == MHA_KEY_VALUE ? d->dk_in : D;
    double *xv = (double *)calloc((size_t)(B * Tk * (Dv + Dk)), sizeof(double)), *xk;
    double *q = (double *)calloc((size_t)(B * T * d->H * d->dk), sizeof(double));
    double *k = (double *)calloc((size_t)(B * Tk * d->H * d->dk), sizeof(double));
    double *v = (double *)calloc((size_t)(B * Tk * d->H * d->dv), sizeof(double));
    double *o = (double *)calloc((size_t)(B * T * d->H * d->dv), sizeof(double));
    double *const *w;
    attn_shape s;
    int64_t b, t, i, step = d->bias ? 2 : 1;
    xk = xv + B * Tk * Dv;
    switch (d->kind) {
    case MHA_KEY_VALUE:
        ref_dense(x, params[0], params[1], B * T, D, Dv, xv);
        ref_dense(x, params[2], params[3], B * T, D, Dk, xk);
        w = params + 4;
        break;
    case MHA_LONGER_VALUE: /* each sample: its T rows of x, then T rows of Dense(x) */
        ref_dense(x, params[0], params[1], B * T, D, D, xk);
        for (b = 0; b < B; b++)
            for (t = 0; t < T; t++)
                for (i = 0; i < D; i++) {
                    xv[(b * Tk + t) * D + i] = x[(b * T + t) * D + i];
                    xv[(b * Tk + T + t) * D + i] = xk[(b * T + t) * D + i];
                }
        memcpy(xk, xv, sizeof(double) * (size_t)(B * Tk * D));
        w = params + 2;
        break;
    default:
        memcpy(xv, x, sizeof(double) * (size_t)(B * T * D));
        memcpy(xk, x, sizeof(double) * (size_t)(B * T * D));
        w = params;
        break;
    }
    ref_dense(x, w[0], d->bias ? w[1] : NULL, B * T, D, d->H * d->dk, q);
    ref_dense(xk, w[step], d->bias ? w[step + 1] : NULL, B * Tk, Dk, d->H * d->dk, k);
    ref_dense(xv, w[2 * step], d->bias ? w[2 * step + 1] : NULL, B * Tk, Dv, d->H * d->dv, v);
    memset(&s, 0, sizeof s);
    s.B = B, s.H = d->H, s.Tq = T, s.Tk = Tk, s.dk = d->dk, s.dv = d->dv, s.causal = d->causal;
    s.rate = d->rate;
    if (d->rate > 0) {
        s.key = d->m->layers[d->layer].seed;
        s.step = d->m->step;
    }
    attn_forward_ref(&s, q, k, v, o);
    ref_dense(o, w[3 * step], d->bias ? w[3 * step + 1] : NULL, B * T, d->H * d->dv, d->dout, y);
    free(xv), free(q), free(k), free(v), free(o);
}

static void check_mha(const mha_ref *shape, mpt_policy policy) {
    mha_ref d = *shape;
    mpt_model *m = NULL;
    mpt_multi_head_attention_desc md;
    char label[200];
    test__begin();
    memset(&md, 0, sizeof md);
    md.num_heads = d.H;
    md.key_dim = d.dk;
    md.value_dim = d.dv == d.dk ? 0 : d.dv;
    md.output_dim = d.dout == d.D ? 0 : d.dout;
    md.use_causal_mask = d.causal;
    md.no_bias = !d.bias;
    md.dropout = d.rate;
    md.no_flash_attention = d.keep;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {d.T, d.D}, .input_rank = 2,
                                                  .policy = policy, .seed = 3}, &m) == MPT_OK,
          "create");
    if (d.kind == MHA_SELF) {
        CHECK(mpt_model_add_multi_head_attention(m, &md) == MPT_OK, "add: %s",
              mpt_context_error(ctx));
    } else {
        mpt_node x = mpt_model_input(m), value, key, y;
        if (d.kind == MHA_KEY_VALUE) {
            value = mpt_dense(m, x, &(mpt_dense_desc){.units = d.dv_in});
            key = mpt_dense(m, x, &(mpt_dense_desc){.units = d.dk_in});
            y = mpt_multi_head_attention_with_key(m, x, value, key, &md);
        } else {
            mpt_node two[2];
            two[0] = x;
            two[1] = mpt_dense(m, x, &(mpt_dense_desc){.units = d.D});
            value = mpt_concatenate(m, 2, two, &(mpt_concatenate_desc){.axis = 1});
            y = mpt_multi_head_attention(m, x, value, &md);
        }
        CHECK(y != MPT_NODE_FAILED, "graph: %s", mpt_context_error(ctx));
    }
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    d.m = m;
    d.layer = mpt_model_layer_count(m) - 1;
    m->step = 17;
    snprintf(label, sizeof label,
             "MultiHeadAttention %s kind %d T=%lld D=%lld H=%lld dk=%lld dv=%lld out=%lld%s%s "
             "dropout %g%s",
             mpt_policy_name(policy), d.kind, (long long)d.T, (long long)d.D, (long long)d.H,
             (long long)d.dk, (long long)d.dv, (long long)d.dout, d.causal ? " causal" : "",
             d.bias ? "" : " no bias", (double)d.rate, d.keep ? " P kept" : "");
    /* the key's bias (and the Dense's that only makes the key) shifts each
       query's scores alike: its gradient is zero */
    gc_check(ctx, &(gc_case){.model = m, .batch = 3, .training = 1,
                             .ref_forward = mha_forward_ref, .user = &d,
                             .zero_grads = "key/bias,dense_1/bias"}, label);
    if (d.rate > 0) { /* inference leaves every weight in */
        d.rate = 0;
        gc_check(ctx, &(gc_case){.model = m, .batch = 3, .training = 0,
                                 .ref_forward = mha_forward_ref, .user = &d}, label);
    }
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

/* The AVX-512 softmax row against the softmax in double: rows of 1 to 200
   keys (masked tails), some seen only in part (the rest must be 0, even
   in a NaN row), scores
   spread over ±30; each weight within 5e-7 relative (plus 1e-30;
   measured: 3.6e-7). Then a
   NaN score makes the row NaN and a -inf one a weight of 0, as the scalar
   rule does. */
static void test_softmax_row_vector(void) {
#if MPT__X86
    enum { MAXN = 200 };
    float p[MAXN], s[MAXN];
    double worst = 0;
    int n, seen, c, bad = 0;
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) {
        SKIP("no AVX-512 on this CPU");
        return;
    }
    for (n = 1; n <= MAXN; n += 7)
        for (seen = 1; seen <= n; seen += 1 + n / 5) {
            double max = -INFINITY, sum = 0;
            for (c = 0; c < n; c++) p[c] = s[c] = (float)test_uniform(-30, 30);
            for (c = 0; c < seen; c++) {
                const double v = (double)(float)(s[c] * 0.125f);
                max = v > max ? v : max;
            }
            for (c = 0; c < seen; c++) sum += exp((double)(float)(s[c] * 0.125f) - max);
            mpt__attn_softmax_row(mpt_context_cpu_features(ctx), p, seen, n, 0.125f);
            for (c = 0; c < n; c++) {
                const double want = c < seen ? exp((double)(float)(s[c] * 0.125f) - max) / sum : 0;
                const double e = fabs(p[c] - want) / (want + 1e-30);
                worst = e > worst ? e : worst;
                bad += c < seen ? e > 5e-7 : p[c] != 0.0f;
            }
        }
    CHECK(bad == 0, "%d weights off the double softmax (worst relative error %.3g)", bad, worst);
    for (c = 0; c < 20; c++) p[c] = (float)c;
    p[5] = NAN;
    mpt__attn_softmax_row(mpt_context_cpu_features(ctx), p, 18, 20, 1.0f);
    CHECK(isnan(p[0]) && isnan(p[17]) && p[18] == 0.0f && p[19] == 0.0f,
          "a NaN score: weights %g, %g, past the keys seen %g, %g", p[0], p[17], p[18], p[19]);
    for (c = 0; c < 20; c++) p[c] = (float)c;
    p[5] = -INFINITY;
    mpt__attn_softmax_row(mpt_context_cpu_features(ctx), p, 20, 20, 1.0f);
    CHECK(p[5] == 0.0f && p[19] > 0.6f && p[19] < 0.64f, "a -inf score: weights %g, %g", p[5],
          p[19]);
#else
    SKIP("no x86 SIMD in this build");
#endif
}

static void test_mha_gradients(int keep) {
    /* kind, T, D, H, dk, dv, dout, dv_in, dk_in, causal, bias, rate */
    static const mha_ref shapes[] = {
        {MHA_SELF, 5, 6, 2, 3, 3, 6, 0, 0, 1, 1, 0, NULL, 0, 0},
        {MHA_SELF, 4, 5, 3, 2, 4, 3, 0, 0, 0, 1, 0, NULL, 0, 0},
        {MHA_SELF, 4, 4, 1, 4, 4, 4, 0, 0, 0, 0, 0, NULL, 0, 0},
        {MHA_SELF, 6, 4, 2, 2, 2, 4, 0, 0, 1, 1, 0.25f, NULL, 0, 0},
        /* H·key_dim = 32, whole GEMM panels: the query, key and value
           products run as one on x (mpt__gemm_shared_a) */
        {MHA_SELF, 5, 8, 2, 16, 16, 8, 0, 0, 1, 1, 0, NULL, 0, 0},
        {MHA_KEY_VALUE, 3, 4, 2, 3, 2, 5, 6, 7, 0, 1, 0, NULL, 0, 0},
        {MHA_LONGER_VALUE, 3, 4, 2, 2, 3, 4, 0, 0, 1, 1, 0, NULL, 0, 0}};
    int k, p;
    for (p = 0; p < 3; p++)
        for (k = 0; k < (int)(sizeof shapes / sizeof shapes[0]); k++) {
            mha_ref d = shapes[k];
            d.keep = keep;
            check_mha(&d, policies[p]);
        }
}

/* ---- Keras' weights ---------------------------------------------------------------- */

static void test_weights_keras(void) {
    static const char *const names[] = {
        "multi_head_attention/query/kernel", "multi_head_attention/query/bias",
        "multi_head_attention/key/kernel",   "multi_head_attention/key/bias",
        "multi_head_attention/value/kernel", "multi_head_attention/value/bias",
        "multi_head_attention/attention_output/kernel", "multi_head_attention/attention_output/bias"};
    /* query (T, 6), value (T, 6): H 2, key_dim 3, value_dim 5, output 4 */
    static const int64_t shapes[8][3] = {{6, 2, 3}, {2, 3, 0}, {6, 2, 3}, {2, 3, 0},
                                         {6, 2, 5}, {2, 5, 0}, {2, 5, 4}, {4, 0, 0}};
    mpt_model *m = NULL;
    char text[8192];
    int p, d;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {7, 6}, .input_rank = 2}, &m);
    CHECK(mpt_model_add_multi_head_attention(m, &(mpt_multi_head_attention_desc){
              .num_heads = 2, .key_dim = 3, .value_dim = 5, .output_dim = 4}) == MPT_OK,
          "add: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_param_count(m) == 8, "%d parameters", mpt_model_param_count(m));
    for (p = 0; p < 8 && p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        int same;
        mpt_model_param(m, p, &info);
        same = strcmp(info.name, names[p]) == 0;
        for (d = 0; d < 3 && shapes[p][d]; d++) same &= info.value.shape[d] == shapes[p][d];
        same &= info.value.rank == d;
        CHECK(same, "parameter %d: %s of rank %d, expected %s", p, info.name, info.value.rank,
              names[p]);
    }
    {
        int64_t out[4] = {0, 0, 0, 0};
        int rank = mpt_model_layer_output_shape(m, 0, out);
        CHECK(rank == 2 && out[0] == 7 && out[1] == 4, "output shape rank %d (%lld, %lld)", rank,
              (long long)out[0], (long long)out[1]);
    }
    /* Keras' count: 3·(6·6 + 6) − (6·6 + 6) + (6·10 + 10) + (10·4 + 4) */
    mpt_model_summary(m, text, sizeof text);
    CHECK(strstr(text, "multi_head_attention (MultiHeadAttention)") && strstr(text, " 198 "),
          "no MultiHeadAttention row of 198 parameters:\n%s", text);
    mpt_model_destroy(m);
}

/* ---- a small model that learns to copy the token before ------------------------------ */

enum { CP_V = 8, CP_T = 8, CP_N = 512 };

/* Random ids; each position's target is the id before it (position 0's
   is its own). */
static void copy_data(int32_t *x, int32_t *y, int64_t n) {
    int64_t i, t;
    for (i = 0; i < n; i++)
        for (t = 0; t < CP_T; t++) {
            x[i * CP_T + t] = test_randint(0, CP_V - 1);
            y[i * CP_T + t] = x[i * CP_T + (t ? t - 1 : 0)];
        }
}

static mpt_dataset *copy_dataset(mpt_context *c, int32_t *x, int32_t *y, int64_t n) {
    int64_t shape[2];
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    shape[0] = n;
    shape[1] = CP_T;
    mpt_tensor_wrap(c, &tx, MPT_INT32, 2, shape, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 2, shape, y);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

/* ids → Embedding + PositionEmbedding → x + MHA(x, causal) → Dense(V, softmax) per position;
   on the strategy st when not NULL */
static mpt_model *copy_model_with(mpt_context *c, mpt_policy policy, float dropout,
                                  mpt_strategy *st, int keep) {
    mpt_model *m = NULL;
    mpt_node tok, two[2], h;
    CHECK(mpt_model_create(c,
                           &(mpt_model_desc){.input_shape = {CP_T},
                                             .input_rank = 1,
                                             .input_dtype = MPT_INT32,
                                             .policy = policy,
                                             .seed = 21,
                                             .strategy = st},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    tok = mpt_embedding(m, mpt_model_input(m),
                        &(mpt_embedding_desc){.input_dim = CP_V, .output_dim = 16});
    two[0] = tok;
    two[1] = mpt_position_embedding(m, tok, &(mpt_position_embedding_desc){.sequence_length = CP_T});
    h = mpt_add(m, 2, two, NULL);
    two[0] = h;
    two[1] = mpt_multi_head_attention(
        m, h, h,
        &(mpt_multi_head_attention_desc){
            .num_heads = 2, .key_dim = 8, .use_causal_mask = 1, .dropout = dropout,
            .no_flash_attention = keep});
    h = mpt_add(m, 2, two, NULL);
    mpt_dense(m, h, &(mpt_dense_desc){.units = CP_V, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(c, m);
    return m;
}

static mpt_model *copy_model_on(mpt_context *c, mpt_policy policy, float dropout,
                                mpt_strategy *st) {
    return copy_model_with(c, policy, dropout, st, 0);
}

static mpt_model *copy_model(mpt_context *c, mpt_policy policy, float dropout) {
    return copy_model_on(c, policy, dropout, NULL);
}

/* Mirrored over 2 replicas (dropout on the weights, each replica its own
   mask): it learns the copy too. */
static void test_mirrored(void) {
    static int32_t x[CP_N * CP_T], y[CP_N * CP_T];
    mpt_strategy *st = test_mirrored_strategy(ctx, 2);
    mpt_model *m;
    mpt_dataset *d;
    mpt_logs logs;
    m = copy_model_on(ctx, MPT_POLICY_MIXED_BFLOAT16, 0.1f, st);
    copy_data(x, y, CP_N);
    d = copy_dataset(ctx, x, y, CP_N);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 12, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, d, NULL, &logs) == MPT_OK, "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&logs, "accuracy") >= 0.95, "accuracy %.3f < 0.95 on 2 replicas",
          mpt_logs_get(&logs, "accuracy"));
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_strategy_destroy(st);
}

static void test_learns_copy(void) {
    static int32_t x[CP_N * CP_T], y[CP_N * CP_T], vx[128 * CP_T], vy[128 * CP_T];
    int k;
    copy_data(x, y, CP_N);
    copy_data(vx, vy, 128);
    for (k = 1; k < 3; k++) {
        mpt_model *m = copy_model(ctx, policies[k], 0);
        mpt_dataset *train = copy_dataset(ctx, x, y, CP_N), *val = copy_dataset(ctx, vx, vy, 128);
        mpt_logs logs;
        test__begin();
        CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 12, .batch_size = 32}) == MPT_OK,
              "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_evaluate(m, val, NULL, &logs) == MPT_OK, "evaluate: %s",
              mpt_context_error(ctx));
        CHECK(mpt_logs_get(&logs, "accuracy") >= 0.95,
              "%s: held-out accuracy %.3f < 0.95 (loss %.3f)", mpt_policy_name(policies[k]),
              mpt_logs_get(&logs, "accuracy"), mpt_logs_get(&logs, "loss"));
        printf("# %s copy model: held-out accuracy %.3f, loss %.4f\n",
               mpt_policy_name(policies[k]), mpt_logs_get(&logs, "accuracy"),
               mpt_logs_get(&logs, "loss"));
        mpt_dataset_destroy(train);
        mpt_dataset_destroy(val);
        mpt_model_destroy(m);
        test__end("learns to copy the token before, %s", mpt_policy_name(policies[k]));
    }
}

/* The same training (with dropout) on 1 and 2 threads: the same bits. */
static int32_t threads_x[128 * CP_T], threads_y[128 * CP_T];

static mpt_model *threads_model(mpt_context *c, mpt_policy policy) {
    return copy_model(c, policy, 0.1f);
}

static mpt_dataset *threads_data(mpt_context *c) {
    return copy_dataset(c, threads_x, threads_y, 128);
}

static mpt_model *threads_model_kept(mpt_context *c, mpt_policy policy) {
    return copy_model_with(c, policy, 0.1f, NULL, 1);
}

static void test_threads_bit_identical(void) {
    copy_data(threads_x, threads_y, 128);
    test_threads_bit_identical_fits(&(test_training){threads_model, threads_data, 2, 32});
    test_threads_bit_identical_fits(&(test_training){threads_model_kept, threads_data, 2, 32});
}

/* Training with P kept (dropout 0.1 on the weights, the causal mask)
   ends with the fused attention's weights, bit for bit, in each policy;
   P's bytes (4·H·T·T a sample, rounded up to 64) are in the activations
   alone. */
static void test_kept_training(void) {
    int k, keep;
    copy_data(threads_x, threads_y, 128);
    for (k = 0; k < 3; k++) {
        float *w[2] = {NULL, NULL};
        int64_t size = 0;
        mpt_memory_report mem[2];
        test__begin();
        for (keep = 0; keep < 2; keep++) {
            mpt_model *m = copy_model_with(ctx, policies[k], 0.1f, NULL, keep);
            mpt_dataset *d = threads_data(ctx);
            int p;
            CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
                  "fit: %s", mpt_context_error(ctx));
            CHECK(mpt_model_memory(m, &mem[keep]) == MPT_OK, "memory: %s", mpt_context_error(ctx));
            for (p = 0, size = 0; p < mpt_model_param_count(m); p++) {
                mpt_param_info info;
                mpt_model_param(m, p, &info);
                size += mpt_tensor_count(&info.value);
            }
            w[keep] = (float *)calloc((size_t)size, sizeof(float));
            test_weights_of(m, w[keep], size);
            if (keep) { /* the last step's P of sample 0, head 0: rows of weights */
                const float *P = (const float *)m->layers[3].saved[5];
                int64_t i, j;
                for (i = 0; i < CP_T; i++) {
                    double sum = 0;
                    for (j = 0; j <= i; j++) sum += P[i * CP_T + j];
                    CHECK(fabs(sum - 1) < 1e-5, "%s: kept P's row %lld sums to %g",
                          mpt_policy_name(policies[k]), (long long)i, sum);
                }
            }
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
        }
        CHECK(memcmp(w[0], w[1], sizeof(float) * (size_t)size) == 0,
              "%s: the weights after training with P kept differ from the fused attention's",
              mpt_policy_name(policies[k]));
        CHECK(mem[1].activations - mem[0].activations == (4 * 2 * CP_T * CP_T * 32 + 63) / 64 * 64,
              "%s: P kept adds %lld bytes of activations, expected %d",
              mpt_policy_name(policies[k]), (long long)(mem[1].activations - mem[0].activations),
              (4 * 2 * CP_T * CP_T * 32 + 63) / 64 * 64);
        CHECK(mem[1].workspace == mem[0].workspace && mem[1].parameters == mem[0].parameters,
              "%s: P kept changed the workspace or parameters", mpt_policy_name(policies[k]));
        free(w[0]);
        free(w[1]);
        test__end("training with P kept = fused, bit for bit, and P in the activations, %s",
                  mpt_policy_name(policies[k]));
    }
}

/* ---- model files ----------------------------------------------------------------------- */

static void test_model_file(void) {
    static int32_t x[64 * CP_T], y[64 * CP_T];
    mpt_model *m = copy_model(ctx, MPT_POLICY_MIXED_BFLOAT16, 0.1f), *back = NULL;
    mpt_dataset *d;
    char path[600];
    copy_data(x, y, 64);
    d = copy_dataset(ctx, x, y, 64);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16}) == MPT_OK, "fit: %s",
          mpt_context_error(ctx));
    snprintf(path, sizeof path, "%s/copy.mpt", tmpdir);
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &back) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (back) {
        const mpt_multi_head_attention_desc *d0 = &m->layers[3].desc.multi_head_attention;
        const mpt_multi_head_attention_desc *d1 = &back->layers[3].desc.multi_head_attention;
        CHECK(strcmp(mpt_model_layer_class_name(back, 3), "MultiHeadAttention") == 0, "layer 3 %s",
              mpt_model_layer_class_name(back, 3));
        CHECK(d1->num_heads == d0->num_heads && d1->key_dim == d0->key_dim &&
                  d1->use_causal_mask == 1 && d1->dropout == d0->dropout && back->layers[3].n_in == 1,
              "descriptor not kept");
        test_same_predictions(ctx, m, back, d, 16);
        mpt_model_destroy(back);
    }
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    /* no_flash_attention is in the file */
    m = copy_model_with(ctx, MPT_POLICY_FLOAT32, 0, NULL, 1);
    back = NULL;
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    snprintf(path, sizeof path, "%s/kept.mpt", tmpdir);
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &back) == MPT_OK, "load: %s", mpt_context_error(ctx));
    CHECK(back && back->layers[3].desc.multi_head_attention.no_flash_attention == 1,
          "no_flash_attention not kept in the model file");
    mpt_model_destroy(back);
    mpt_model_destroy(m);
}

/* ---- generation with the key/value cache --------------------------------------------- */

/* The reference: the same draws from predict's probabilities on the
   window mpt_model_generate documents (the last ids since it last
   started again: at most T, and T/2 + 1 after starting again). */
static void generate_ref(mpt_model *m, const int32_t *prompt, int64_t n_prompt,
                         const mpt_generate_desc *d, int32_t *out) {
    int64_t T = CP_T, n = n_prompt + d->max_new_tokens, w0 = n_prompt > T ? n_prompt - T : 0, i;
    memcpy(out, prompt, sizeof(int32_t) * (size_t)n_prompt);
    for (i = n_prompt; i < n; i++) {
        int32_t window[CP_T];
        int64_t shape[2] = {1, CP_T}, len, k, best = 0;
        mpt_tensor x, y;
        const float *p;
        uint32_t r[4];
        double u, total = 0, w[CP_V];
        if (i - 1 - w0 == T) w0 = i - 1 - T / 2;
        len = i - w0;
        memset(window, 0, sizeof window);
        memcpy(window, out + w0, sizeof(int32_t) * (size_t)len);
        mpt_tensor_wrap(ctx, &x, MPT_INT32, 2, shape, window);
        CHECK(mpt_model_predict_tensor(m, &x, 1, &y) == MPT_OK, "predict: %s",
              mpt_context_error(ctx));
        p = (const float *)y.data + (len - 1) * CP_V;
        for (k = 1; k < CP_V; k++) best = p[k] > p[best] ? k : best;
        mpt_philox4x32(d->seed, (uint64_t)i, 0, r);
        u = (r[0] >> 8) / 16777216.0;
        for (k = 0; k < CP_V; k++) total += w[k] = pow((double)p[k] + 1e-30, 1.0 / d->temperature);
        for (k = 0, u *= total; k < CP_V - 1 && u >= w[k]; k++) u -= w[k];
        out[i] = (int32_t)(d->temperature == 0 ? best : k);
        mpt_tensor_free(ctx, &y);
    }
}

/* Greedy and sampled ids from the cache equal those from predict on the
   whole window, past the context (starting again twice), on a model of
   random weights (so that the ids vary). */
static void test_generate_matches_predict(void) {
    static const float temperatures[] = {0, 0.7f, 1.5f};
    mpt_model *m = copy_model(ctx, MPT_POLICY_FLOAT32, 0.1f);
    int32_t prompt[3] = {1, 5, 2}, got[40], want[40];
    int p, k, t;
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        float *v;
        int64_t j;
        mpt_model_param(m, p, &info);
        v = (float *)info.value.data;
        for (j = 0; j < mpt_tensor_count(&info.value); j++)
            v[j] = (float)test_uniform(-1, 1) * (strstr(info.name, "gamma") ? 0.5f : 1.0f);
    }
    mpt_model_refresh_weights(m);
    for (t = 0; t < 3; t++) {
        mpt_generate_desc d = {37, temperatures[t], 0, 99};
        memset(got, 0xFF, sizeof got);
        CHECK(mpt_model_generate(m, prompt, 3, &d, got) == MPT_OK, "generate: %s",
              mpt_context_error(ctx));
        generate_ref(m, prompt, 3, &d, want);
        for (k = 0; k < 40 && got[k] == want[k]; k++) continue;
        CHECK(k == 40, "temperature %g: id %d is %d, predict's window gives %d",
              (double)temperatures[t], k, k < 40 ? got[k] : 0, k < 40 ? want[k] : 0);
        if (t == 0) { /* the ids vary: the test sees the model */
            int distinct = 0, seen[CP_V] = {0};
            for (k = 3; k < 40; k++) distinct += !seen[got[k]]++;
            CHECK(distinct >= 2, "greedy generation gave %d distinct ids", distinct);
        }
    }
    { /* the probabilities themselves, position by position (internal state) */
        mpt__gen g;
        int32_t ids[CP_T];
        int64_t shape[2] = {1, CP_T}, pos, c;
        mpt_tensor x, y;
        double worst = 0;
        for (k = 0; k < CP_T; k++) ids[k] = test_randint(0, CP_V - 1);
        mpt_tensor_wrap(ctx, &x, MPT_INT32, 2, shape, ids);
        CHECK(mpt_model_predict_tensor(m, &x, 1, &y) == MPT_OK, "predict: %s",
              mpt_context_error(ctx));
        CHECK(mpt__gen_open(m, &g) == MPT_OK, "open: %s", mpt_context_error(ctx));
        for (pos = 0; pos < CP_T; pos++) {
            mpt__gen_position(&g, ids[pos]);
            for (c = 0; c < CP_V; c++)
                worst = fmax(worst, fabs(g.row[m->n_layers][c] -
                                         ((const float *)y.data)[pos * CP_V + c]));
        }
        CHECK(worst < 1e-5, "the cache's probabilities differ from predict's by %.3g", worst);
        mpt__gen_free(&g);
        mpt_tensor_free(ctx, &y);
    }
    { /* a prompt longer than the context: its last T ids */
        int32_t longer[12], a[20], b[20];
        mpt_generate_desc d = {8, 0, 0, 1};
        for (k = 0; k < 12; k++) longer[k] = test_randint(0, CP_V - 1);
        CHECK(mpt_model_generate(m, longer, 12, &d, a) == MPT_OK, "generate: %s",
              mpt_context_error(ctx));
        generate_ref(m, longer, 12, &d, b);
        CHECK(memcmp(a, b, sizeof a) == 0, "a prompt longer than the context generates otherwise");
    }
    mpt_model_destroy(m);
}

/* What generation cannot walk, or is not given, is refused by name. */
static void test_generate_refusals(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = copy_model(q, MPT_POLICY_FLOAT32, 0);
    int32_t prompt[2] = {1, 9}, out[8];
    mpt_generate_desc d = {4, 0, 0, 1};
    test_expect_error(q, mpt_model_generate(m, prompt, 1, &d, out), MPT_ERR_STATE, "not built",
                      "generate");
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
    test_expect_error(q, mpt_model_generate(m, prompt, 2, &d, out), MPT_ERR_INVALID_ARGUMENT,
                      "prompt id 9 at 1 is outside Embedding 'embedding'", "generate");
    test_expect_error(q, mpt_model_generate(m, prompt, 0, &d, out), MPT_ERR_INVALID_ARGUMENT,
                      "a prompt of at least one id", "generate");
    d.max_new_tokens = -1;
    test_expect_error(q, mpt_model_generate(m, prompt, 1, &d, out), MPT_ERR_INVALID_ARGUMENT,
                      "max_new_tokens", "generate");
    mpt_model_destroy(m);
    /* attention that is not causal sees the future */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1,
                                          .input_dtype = MPT_INT32}, &m);
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 10, .output_dim = 4});
    mpt_model_add_multi_head_attention(m, &(mpt_multi_head_attention_desc){.num_heads = 1,
                                                                          .key_dim = 2});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    d.max_new_tokens = 4;
    test_expect_error(q, mpt_model_generate(m, prompt, 1, &d, out), MPT_ERR_UNSUPPORTED,
                      "MultiHeadAttention 'multi_head_attention' only causal self-attention",
                      "generate");
    mpt_model_destroy(m);
    /* a layer across positions */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1,
                                          .input_dtype = MPT_INT32}, &m);
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 10, .output_dim = 4});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    test_expect_error(q, mpt_model_generate(m, prompt, 1, &d, out), MPT_ERR_UNSUPPORTED,
                      "Flatten 'flatten' acts across positions", "generate");
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* ---- refusals ------------------------------------------------------------------------------- */

static void expect_add(mpt_context *q, const mpt_multi_head_attention_desc *d, const char *words) {
    mpt_model *m = NULL;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 6}, .input_rank = 2}, &m);
    test_expect_error(q, mpt_model_add_multi_head_attention(m, d), MPT_ERR_INVALID_ARGUMENT, words,
                      "add");
    mpt_model_destroy(m);
}

static void test_refusals(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    mpt_node x, v;
    expect_add(q, &(mpt_multi_head_attention_desc){.key_dim = 4}, "num_heads 0");
    expect_add(q, &(mpt_multi_head_attention_desc){.num_heads = 2}, "key_dim 0");
    expect_add(q, &(mpt_multi_head_attention_desc){.num_heads = 2, .key_dim = 2, .value_dim = -1},
               "value_dim -1");
    expect_add(q, &(mpt_multi_head_attention_desc){.num_heads = 2, .key_dim = 2, .output_dim = -3},
               "output_dim -3");
    expect_add(q, &(mpt_multi_head_attention_desc){.num_heads = 2, .key_dim = 2, .dropout = 1},
               "dropout 1 is not in [0, 1)");
    expect_add(q, &(mpt_multi_head_attention_desc){.num_heads = 2, .key_dim = 2,
                                                   .kernel_initializer = (mpt_initializer)99},
               "unknown initializer 99");
    /* a vector is not a sequence */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1}, &m);
    mpt_model_add_multi_head_attention(m, &(mpt_multi_head_attention_desc){.num_heads = 1,
                                                                          .key_dim = 2});
    test_expect_error(q, mpt_model_build(m, 2), MPT_ERR_SHAPE,
                      "'multi_head_attention': the query ('input') has samples of shape (6,)",
                      "build");
    mpt_model_destroy(m);
    /* a value longer than the key */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 6}, .input_rank = 2}, &m);
    x = mpt_model_input(m);
    {
        mpt_node two[2];
        two[0] = x;
        two[1] = x;
        v = mpt_concatenate(m, 2, two, &(mpt_concatenate_desc){.axis = 1});
    }
    mpt_multi_head_attention_with_key(m, x, v, x,
                                      &(mpt_multi_head_attention_desc){.num_heads = 1, .key_dim = 2});
    test_expect_error(q, mpt_model_build(m, 2), MPT_ERR_SHAPE,
                      "the key has 4 positions, the value 8", "build");
    mpt_model_destroy(m);
    /* huge sizes overflow cleanly */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 6}, .input_rank = 2}, &m);
    mpt_model_add_multi_head_attention(
        m, &(mpt_multi_head_attention_desc){.num_heads = (int64_t)1 << 40, .key_dim = (int64_t)1 << 30});
    test_expect_error(q, mpt_model_build(m, 2), MPT_ERR_OVERFLOW, "is too large", "build");
    mpt_model_destroy(m);
    /* quantization takes it in dynamic range (its projections int8, the
       attention float32: tests/test_quantize.c checks the numbers); full
       integer has no form for it and says so */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 6}, .input_rank = 2}, &m);
    mpt_model_add_multi_head_attention(m, &(mpt_multi_head_attention_desc){.num_heads = 1,
                                                                          .key_dim = 2});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_refresh_weights(m); /* as trained */
    {
        static float x[4 * 4 * 6];
        mpt_model *quantized = NULL;
        mpt_dataset *d = NULL;
        mpt_tensor t, a, b;
        int64_t k;
        double worst = 0;
        for (k = 0; k < 4 * 4 * 6; k++) x[k] = (float)((k * 37 % 23) - 11) / 11.0f;
        mpt_tensor_wrap(q, &t, MPT_FLOAT32, 3, (int64_t[]){4, 4, 6}, x);
        CHECK(mpt_dataset_create(q, &(mpt_dataset_desc){.x = &t}, &d) == MPT_OK, "dataset");
        CHECK(mpt_model_quantize(m, NULL, &quantized) == MPT_OK && quantized, "quantize: %s",
              mpt_context_error(q));
        CHECK(quantized && mpt_model_predict(m, d, 4, &a) == MPT_OK &&
                  mpt_model_predict(quantized, d, 4, &b) == MPT_OK,
              "predict: %s", mpt_context_error(q));
        for (k = 0; quantized && k < 4 * 3; k++)
            worst = fmax(worst, fabs(((float *)a.data)[k] - ((float *)b.data)[k]));
        CHECK(worst < 0.05, "the quantized attention differs by %g", worst);
        if (quantized) mpt_tensor_free(q, &a), mpt_tensor_free(q, &b);
        mpt_model_destroy(quantized);
        quantized = NULL;
        test_expect_error(q, mpt_model_quantize(m, &(mpt_quantize_desc){
                              .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = d},
                              &quantized),
                          MPT_ERR_UNSUPPORTED, "'multi_head_attention' (MultiHeadAttention) has "
                          "no full-integer form", "quantize full integer");
        CHECK(quantized == NULL, "quantize gave a model");
        mpt_dataset_destroy(d);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void cases(void) {
    test_reference_gradients();
    test_backend_attention();
    test_mha_gradients(0);
    test_mha_gradients(1);
    test_kept_same_bits();
    TEST_RUN(test_softmax_row_vector);
    TEST_RUN(test_weights_keras);
    test_learns_copy();
    TEST_RUN(test_mirrored);
    test_threads_bit_identical();
    test_kept_training();
    TEST_RUN(test_model_file);
    TEST_RUN(test_generate_matches_predict);
    TEST_RUN(test_generate_refusals);
    TEST_RUN(test_refusals);
}

int main(void) {
    return test_main(&(test_program){.name = "test_attention", .ctx = &ctx, .threads = 2,
                                      .logger = quiet_logger, .seed = 7, .tmpdir = tmpdir,
                                      .tmpdir_size = sizeof tmpdir,
                                      .keep_env = "MPT_KEEP_TEST_FILES", .cases = cases});
}

/* Random model graphs, checked whole: the fused paths against a reference
   written here in double.

   predict and the quantized models do not run the layers one by one: they
   fold BatchNormalization into the product before it, pool in a Conv2D's
   epilogue, add and ReLU in one pass, fuse the attention, and in int8 run
   a Conv2D from its windows with the chain, the pooling or the residual ADD
   around it. Each of these has its own conditions (shapes, strides,
   padding, which layer reads what), and the tests of each path build the
   cases their authors thought of. Here a seeded generator builds graphs
   nobody wrote by hand: image models (Conv2D of any kernel, stride and
   padding, BatchNormalization, ReLU, the poolings, ZeroPadding2D, residual
   Add/Subtract/Multiply/Average, Concatenate of two branches, then
   Flatten or GlobalAveragePooling2D and Dense) and token models
   (Embedding, PositionEmbedding, LayerNormalization, self- and
   cross-attention with and without a causal mask, Dense over the last
   axis with ReLU and both GELUs, residual Adds). For each graph:

   - predict (float32) within 2e-5 of each output's scale, the sum of the
     magnitudes of the terms that make it (Winograd's transforms and the
     folds round otherwise than sums in order; measured up to 2.2e-7 over
     1,200 graphs); on 1 and 2 threads and on the portable path (no SIMD);
   - the float16 model within 1e-3 of the scale, against the reference
     run with its weights rounded to float16 (measured up to 1.7e-4);
   - the dynamic-range int8 model within 5e-2 of the scale (measured up
     to 7.2e-3): rounding each row and channel to 8 bits stays well inside,
     a wrong row, tap or channel does not;
   - the full-integer model of an image graph: the same bytes on 1 and 2
     threads and without AVX-512 VNNI (a Conv2D from its windows with its
     chain, pooling or residual ADD, or by im2col, one op at a time);
   - fit on 1 and 2 threads gives the same weights, bit for bit, in the
     three policies (the gradient sums of fan-out in a fixed order).

   And in ./build.sh check, with the runtimes installed: 30 graphs of each
   kind exported to TFLite and ONNX and run in LiteRT and ONNX Runtime on
   the same inputs: float32 (and an image graph's float16 model) within
   1e-4 of the largest output (measured up to 1.3e-5 over 300 graphs); an
   image graph's full-integer file within 16 steps of its output's scale
   (each operation is within one step, and a step before a narrow output
   range is many of its steps: measured up to 12 with 16 calibration
   samples); its dynamic-range file within 2e-2 of the largest output in
   ONNX Runtime (a code moved at a half, mpt.h's doc of the export;
   measured up to 1e-2) and 1e-1 in LiteRT (whose hybrid kernels quantize
   asymmetrically; measured up to 4.6e-2).

   A failure names the seed and prints the graph. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, popen */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

/* ---- a graph, as the generator writes it ------------------------------------------------- */

enum {
    G_CONV, G_BN, G_RELU, G_MAX_POOL, G_AVG_POOL, G_ZERO_PAD, G_ADD, G_SUBTRACT, G_MULTIPLY,
    G_AVERAGE, G_CONCAT, G_GLOBAL_POOL, G_FLATTEN, G_DENSE, /* images */
    G_EMBEDDING, G_POSITIONS, G_LAYER_NORM, G_ATTENTION     /* tokens */
};
static const char *const g_kind_names[] = {
    "conv", "bn", "relu", "maxpool", "avgpool", "zeropad", "add", "sub", "mul", "avg",
    "concat", "gap", "flatten", "dense", "embedding", "positions", "layernorm", "attention"};

#define G_MAX_LAYERS 40

/* A layer: its kind, the nodes it reads (0 the model's input, k the output
   of layer k − 1), its settings and its output's shape per sample (h, w, c;
   a token model's (T, c) as h = T, w = 1). */
typedef struct {
    int kind, in[3], n_in;
    int kh, kw, sh, sw, same;         /* Conv2D, the poolings             */
    int bias, units;                  /* Conv2D's and Dense's             */
    mpt_activation act;               /* Conv2D's and Dense's             */
    int pad[4];                       /* ZeroPadding2D's top bottom left right */
    int heads, key_dim, value_dim;    /* attention's                      */
    int causal, no_flash, eps_small;  /* attention's, LayerNormalization's */
    int max_positions;                /* PositionEmbedding's              */
    int h, w, c;
} g_layer;

typedef struct {
    int tokens;          /* 1: int32 ids of a vocabulary of `vocab`, (T) */
    int h, w, c, vocab;  /* the input: (h, w, c) images or (h = T) ids   */
    int n;
    g_layer L[G_MAX_LAYERS];
} g_graph;

#define NODE_H(g, j) ((j) ? (g)->L[(j) - 1].h : (g)->h)
#define NODE_W(g, j) ((j) ? (g)->L[(j) - 1].w : (g)->w)
#define NODE_C(g, j) ((j) ? (g)->L[(j) - 1].c : (g)->c)
#define NODE_SIZE(g, j) ((int64_t)NODE_H(g, j) * NODE_W(g, j) * NODE_C(g, j))

/* Keras' output size along an axis: 'same' ceil(n / s), 'valid' (n − k) / s + 1 */
static int out_size(int n, int k, int s, int same) {
    return same ? (n + s - 1) / s : n >= k ? (n - k) / s + 1 : 0;
}

/* 'same' padding's rows before, as Keras splits it (the extra one after). */
static int pad_before(int n, int k, int s, int same) {
    const int total = (out_size(n, k, s, same) - 1) * s + k - n;
    return same && total > 0 ? total / 2 : 0;
}

/* Appends layer x to g: its node, or 0 when g is full or x's output
   would be empty. */
static int g_push(g_graph *g, g_layer x) {
    if (g->n >= G_MAX_LAYERS || x.h < 1 || x.w < 1 || x.c < 1) return 0;
    g->L[g->n++] = x;
    return g->n;
}

/* A layer of `kind` reading node `in`, its output the input's shape. */
static g_layer g_on(int kind, const g_graph *g, int in) {
    g_layer x;
    memset(&x, 0, sizeof x);
    x.kind = kind, x.in[0] = in, x.n_in = 1;
    x.h = NODE_H(g, in), x.w = NODE_W(g, in), x.c = NODE_C(g, in);
    return x;
}

static int g_conv(g_graph *g, int in, int filters, int kh, int kw, int sh, int sw, int same) {
    g_layer x = g_on(G_CONV, g, in);
    x.kh = kh, x.kw = kw, x.sh = sh, x.sw = sw, x.same = same;
    x.act = test_randint(0, 2) == 0 ? MPT_ACT_RELU : MPT_ACT_NONE;
    x.bias = test_randint(0, 3) != 0, x.units = filters;
    x.h = out_size(x.h, kh, sh, same), x.w = out_size(x.w, kw, sw, same), x.c = filters;
    return g_push(g, x);
}

static int g_merge(g_graph *g, int kind, int a, int b) {
    g_layer x = g_on(kind, g, a);
    x.in[1] = b, x.n_in = 2;
    if (kind == G_CONCAT) x.c += NODE_C(g, b);
    return g_push(g, x);
}

/* An image model: blocks of Conv2D (BatchNormalization, ReLU), a pooling,
   a residual merge, two branches concatenated or a ZeroPadding2D, then a
   head of Flatten or GlobalAveragePooling2D and one or two Dense. */
static void random_image_graph(g_graph *g) {
    static const int channels[] = {1, 1, 2, 3, 4, 8, 16, 17, 32};
    static const int filters[] = {1, 3, 8, 16, 16, 17, 24, 32, 32, 48, 64};
    const int big = test_randint(0, 2) == 0;
    int cur = 0, blocks = test_randint(1, 5), b, node;
    memset(g, 0, sizeof *g);
    g->h = test_randint(3, big ? 30 : 14), g->w = test_randint(3, big ? 30 : 14);
    g->c = channels[test_randint(0, 8)];
    for (b = 0; b < blocks && g->n < G_MAX_LAYERS - 8; b++) {
        const int pick = test_randint(0, 9);
        if (pick <= 3) { /* Conv2D (BatchNormalization) (ReLU) */
            const int k = test_randint(0, 4), kh = k == 0 ? 1 : k == 4 ? 5 : 3;
            const int kw = test_randint(0, 5) ? kh : test_randint(1, 4);
            const int s = test_randint(0, 3) == 0 ? 2 : 1;
            node = g_conv(g, cur, filters[test_randint(0, 10)], kh, kw, s,
                          test_randint(0, 4) ? s : test_randint(1, 2), test_randint(0, 1));
            if (!node) continue;
            cur = node;
            if (test_randint(0, 1)) cur = g_push(g, g_on(G_BN, g, cur));
            if (test_randint(0, 1)) cur = g_push(g, g_on(G_RELU, g, cur));
        } else if (pick <= 5) { /* MaxPooling2D or AveragePooling2D */
            g_layer x = g_on(test_randint(0, 2) ? G_MAX_POOL : G_AVG_POOL, g, cur);
            x.kh = test_randint(1, 3), x.kw = test_randint(0, 3) ? x.kh : test_randint(1, 3);
            x.sh = test_randint(0, 2) ? x.kh : test_randint(1, 2);
            x.sw = test_randint(0, 2) ? x.kw : test_randint(1, 2);
            x.same = test_randint(0, 2) == 0;
            x.h = out_size(x.h, x.kh, x.sh, x.same), x.w = out_size(x.w, x.kw, x.sw, x.same);
            if ((node = g_push(g, x))) cur = node;
        } else if (pick == 6) { /* a residual merge with a 'same' Conv2D */
            static const int merges[] = {G_ADD, G_ADD, G_ADD, G_SUBTRACT, G_MULTIPLY, G_AVERAGE};
            int branch = g_conv(g, cur, NODE_C(g, cur), 3, 3, 1, 1, 1);
            const int kind = merges[test_randint(0, 5)];
            if (!branch) continue;
            if (test_randint(0, 1)) branch = g_push(g, g_on(G_BN, g, branch));
            node = test_randint(0, 1) ? g_merge(g, kind, branch, cur)
                                      : g_merge(g, kind, cur, branch);
            if (!node) continue;
            cur = node;
            if (test_randint(0, 1)) cur = g_push(g, g_on(G_RELU, g, cur));
        } else if (pick == 7) { /* two branches concatenated */
            const int a = g_conv(g, cur, test_randint(1, 20), 1, 1, 1, 1, 0);
            const int c = g_conv(g, cur, test_randint(1, 20), 3, 3, 1, 1, 1);
            if (a && c && (node = g_merge(g, G_CONCAT, a, c))) cur = node;
        } else if (pick == 8) { /* ZeroPadding2D, never all zeros (Keras' default 1) */
            g_layer x = g_on(G_ZERO_PAD, g, cur);
            int k;
            for (k = 0; k < 4; k++) x.pad[k] = test_randint(0, 2);
            if (!(x.pad[0] | x.pad[1] | x.pad[2] | x.pad[3])) x.pad[test_randint(0, 3)] = 1;
            x.h += x.pad[0] + x.pad[1], x.w += x.pad[2] + x.pad[3];
            if ((node = g_push(g, x))) cur = node;
        } else {
            cur = g_push(g, g_on(G_BN, g, cur));
        }
    }
    { /* the head */
        g_layer x = g_on(test_randint(0, 1) || NODE_SIZE(g, cur) > 3000 ? G_GLOBAL_POOL
                                                                           : G_FLATTEN, g, cur);
        x.c = x.kind == G_GLOBAL_POOL ? x.c : (int)NODE_SIZE(g, cur), x.h = x.w = 1;
        cur = g_push(g, x);
        if (test_randint(0, 1)) {
            x = g_on(G_DENSE, g, cur);
            x.units = x.c = test_randint(1, 70), x.bias = 1;
            x.act = test_randint(0, 1) ? MPT_ACT_RELU : MPT_ACT_NONE;
            cur = g_push(g, x);
        }
        x = g_on(G_DENSE, g, cur);
        x.units = x.c = test_randint(1, 12), x.bias = test_randint(0, 3) != 0;
        g_push(g, x);
    }
}

/* A token model: Embedding (+ PositionEmbedding), blocks of (LayerNorm)
   attention + residual Add and (LayerNorm) Dense(act) Dense + Add, then
   (LayerNorm) and a Dense head over the last axis. */
static void random_token_graph(g_graph *g) {
    static const int widths[] = {4, 8, 12, 16, 24, 32, 48, 64};
    static const mpt_activation acts[] = {MPT_ACT_NONE, MPT_ACT_RELU, MPT_ACT_GELU,
                                          MPT_ACT_GELU_TANH};
    const int D = widths[test_randint(0, 7)];
    int cur, blocks = test_randint(1, 3), b;
    g_layer x;
    memset(g, 0, sizeof *g);
    g->tokens = 1, g->h = test_randint(1, 24), g->w = 1, g->c = 1, g->vocab = test_randint(3, 300);
    x = g_on(G_EMBEDDING, g, 0), x.c = D;
    cur = g_push(g, x);
    if (test_randint(0, 2)) {
        x = g_on(G_POSITIONS, g, cur), x.max_positions = g->h + test_randint(0, 8);
        cur = g_merge(g, G_ADD, cur, g_push(g, x));
    }
    for (b = 0; b < blocks; b++) {
        int h = cur, a, f;
        if (test_randint(0, 3)) {
            x = g_on(G_LAYER_NORM, g, cur), x.eps_small = test_randint(0, 1);
            h = g_push(g, x);
        }
        x = g_on(G_ATTENTION, g, h); /* query h; value h, or cur (cross) */
        x.in[1] = test_randint(0, 4) ? h : cur, x.n_in = 2;
        if (test_randint(0, 4) == 0) x.in[2] = cur, x.n_in = 3; /* a key of its own */
        x.heads = test_randint(1, 4), x.key_dim = test_randint(1, 16);
        x.value_dim = test_randint(0, 2) ? x.key_dim : test_randint(1, 16);
        x.causal = test_randint(0, 3) != 0, x.bias = test_randint(0, 3) != 0;
        x.no_flash = test_randint(0, 3) == 0;
        a = g_push(g, x);
        cur = test_randint(0, 1) ? g_merge(g, G_ADD, cur, a) : g_merge(g, G_ADD, a, cur);
        if (test_randint(0, 3)) {
            x = g_on(G_LAYER_NORM, g, cur), x.eps_small = test_randint(0, 1);
            h = g_push(g, x);
            x = g_on(G_DENSE, g, h), x.units = x.c = test_randint(1, 4) * D;
            x.act = acts[test_randint(0, 3)], x.bias = test_randint(0, 3) != 0;
            f = g_push(g, x);
            x = g_on(G_DENSE, g, f), x.units = x.c = D, x.bias = 1;
            cur = g_merge(g, G_ADD, cur, g_push(g, x));
        }
    }
    if (test_randint(0, 1)) {
        x = g_on(G_LAYER_NORM, g, cur), x.eps_small = 1;
        cur = g_push(g, x);
    }
    x = g_on(G_DENSE, g, cur), x.units = x.c = test_randint(0, 1) ? g->vocab : test_randint(1, 20);
    x.bias = test_randint(0, 3) != 0;
    g_push(g, x);
}

/* The graph on one line, for a failure's message. */
static void print_graph(const g_graph *g, int seed) {
    int i, k;
    printf("  seed %d: input %dx%dx%d%s:", seed, g->h, g->w, g->c, g->tokens ? " ids" : "");
    for (i = 0; i < g->n; i++) {
        const g_layer *x = &g->L[i];
        printf(" [%d]%s(", i + 1, g_kind_names[x->kind]);
        for (k = 0; k < x->n_in; k++) printf("%s%d", k ? "," : "", x->in[k]);
        if (x->kind == G_CONV || x->kind == G_MAX_POOL || x->kind == G_AVG_POOL)
            printf(" %dx%d/%dx%d %s", x->kh, x->kw, x->sh, x->sw, x->same ? "same" : "valid");
        if (x->kind == G_ATTENTION)
            printf(" h%d k%d v%d%s", x->heads, x->key_dim, x->value_dim,
                   x->causal ? " causal" : "");
        printf(")%dx%dx%d", x->h, x->w, x->c);
    }
    printf("\n");
}

/* ---- the model of a graph ---------------------------------------------------------------- */

/* Layer i of g is named "l<i>", so the reference finds its weights by name. */
static mpt_node add_layer(mpt_model *m, const g_graph *g, int i, const mpt_node *node) {
    const g_layer *x = &g->L[i];
    char name[16];
    const mpt_node a = node[x->in[0]], two[2] = {node[x->in[0]], node[x->in[1]]};
    snprintf(name, sizeof name, "l%d", i);
    switch (x->kind) {
    case G_CONV:
        return mpt_conv2d(m, a, &(mpt_conv2d_desc){.name = name, .filters = x->units,
            .kernel_size = {x->kh, x->kw}, .strides = {x->sh, x->sw},
            .padding = x->same ? MPT_PADDING_SAME : MPT_PADDING_VALID,
            .activation = x->act, .no_bias = !x->bias});
    case G_BN: return mpt_batch_normalization(m, a, &(mpt_batchnorm_desc){.name = name});
    case G_RELU:
        return mpt_activation_layer(m, a, &(mpt_activation_desc){.name = name,
                                                                 .activation = MPT_ACT_RELU});
    case G_MAX_POOL:
    case G_AVG_POOL: {
        const mpt_pool2d_desc d = {.name = name, .pool_size = {x->kh, x->kw},
                                   .strides = {x->sh, x->sw},
                                   .padding = x->same ? MPT_PADDING_SAME : MPT_PADDING_VALID};
        return x->kind == G_MAX_POOL ? mpt_max_pooling2d(m, a, &d)
                                     : mpt_average_pooling2d(m, a, &d);
    }
    case G_ZERO_PAD:
        return mpt_zero_padding2d(m, a, &(mpt_zero_padding2d_desc){.name = name,
            .padding = {{x->pad[0], x->pad[1]}, {x->pad[2], x->pad[3]}}});
    case G_ADD: return mpt_add(m, 2, two, &(mpt_merge_desc){.name = name});
    case G_SUBTRACT: return mpt_subtract(m, 2, two, &(mpt_merge_desc){.name = name});
    case G_MULTIPLY: return mpt_multiply(m, 2, two, &(mpt_merge_desc){.name = name});
    case G_AVERAGE: return mpt_average(m, 2, two, &(mpt_merge_desc){.name = name});
    case G_CONCAT: return mpt_concatenate(m, 2, two, &(mpt_concatenate_desc){.name = name});
    case G_GLOBAL_POOL:
        return mpt_global_average_pooling2d(m, a, &(mpt_global_pool2d_desc){.name = name});
    case G_FLATTEN: return mpt_flatten(m, a, &(mpt_flatten_desc){.name = name});
    case G_DENSE:
        return mpt_dense(m, a, &(mpt_dense_desc){.name = name, .units = x->units,
                                                  .activation = x->act, .no_bias = !x->bias});
    case G_EMBEDDING:
        return mpt_embedding(m, a, &(mpt_embedding_desc){.name = name, .input_dim = g->vocab,
                                                          .output_dim = x->c});
    case G_POSITIONS:
        return mpt_position_embedding(m, a, &(mpt_position_embedding_desc){
            .name = name, .sequence_length = x->max_positions});
    case G_LAYER_NORM:
        return mpt_layer_normalization(m, a, &(mpt_layer_normalization_desc){
            .name = name, .epsilon = x->eps_small ? 1e-5f : 0});
    default: { /* G_ATTENTION */
        const mpt_multi_head_attention_desc d = {
            .name = name, .num_heads = x->heads, .key_dim = x->key_dim,
            .value_dim = x->value_dim, .use_causal_mask = x->causal, .no_bias = !x->bias,
            .no_flash_attention = x->no_flash};
        return x->n_in == 3 ? mpt_multi_head_attention_with_key(m, a, node[x->in[1]],
                                                                node[x->in[2]], &d)
                            : mpt_multi_head_attention(m, a, node[x->in[1]], &d);
    }
    }
}

/* U(−1, 1) for most weights; kernels scaled by their fan-in so that the
   activations stay near 1 through any depth; BatchNormalization's
   statistics and LayerNormalization's gamma away from zero. */
static void randomize_weights(mpt_model *m) {
    int i;
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info p;
        const mpt_tensor *v = &p.value;
        double lo = -0.5, hi = 0.5;
        int64_t k, count;
        mpt_model_param(m, i, &p);
        count = mpt_tensor_count(v);
        if (strstr(p.name, "gamma") || strstr(p.name, "variance")) lo = 0.5, hi = 1.5;
        else if (strstr(p.name, "beta") || strstr(p.name, "mean") || strstr(p.name, "bias"))
            lo = -0.3, hi = 0.3;
        else if (strstr(p.name, "kernel")) { /* q/k/v: (D, H, dim), fan-in D; else (..., out) */
            const int projection = strstr(p.name, "query/") || strstr(p.name, "key/") ||
                                   strstr(p.name, "value/");
            const double fan_in = projection ? (double)v->shape[0]
                                             : (double)count / (double)v->shape[v->rank - 1];
            hi = sqrt(3.0 * test_uniform(0.5, 3.0) / fan_in), lo = -hi;
        }
        for (k = 0; k < count; k++) ((float *)v->data)[k] = (float)test_uniform(lo, hi);
    }
    mpt_model_refresh_weights(m);
}

/* The model of g in a policy, built for batches of max_batch, its weights
   random; NULL (and a failed check) if it does not build. */
static mpt_model *model_of(mpt_context *c, const g_graph *g, mpt_policy policy,
                           int64_t max_batch) {
    mpt_model *m = NULL;
    mpt_node node[G_MAX_LAYERS + 1];
    mpt_model_desc d;
    int i;
    memset(&d, 0, sizeof d);
    d.input_shape[0] = g->h, d.policy = policy, d.seed = 3;
    if (g->tokens) {
        d.input_rank = 1, d.input_dtype = MPT_INT32;
    } else {
        d.input_shape[1] = g->w, d.input_shape[2] = g->c, d.input_rank = 3;
    }
    if (mpt_model_create(c, &d, &m) != MPT_OK) return NULL;
    node[0] = mpt_model_input(m);
    for (i = 0; i < g->n; i++) node[i + 1] = add_layer(m, g, i, node);
    if (mpt_model_build(m, max_batch) != MPT_OK) {
        CHECK(0, "build: %s", mpt_context_error(c));
        mpt_model_destroy(m);
        return NULL;
    }
    randomize_weights(m);
    return m;
}

/* ---- the reference, in double ------------------------------------------------------------ */

/* Each node's values for n samples and each value's scale: the sum of the
   magnitudes of the terms that made it, which bounds the rounding of any
   order of the sums. */
typedef struct {
    double *value[G_MAX_LAYERS + 1], *scale[G_MAX_LAYERS + 1];
} reference;

static void reference_free(reference *r) {
    int i;
    for (i = 0; i <= G_MAX_LAYERS; i++) free(r->value[i]), free(r->scale[i]);
    memset(r, 0, sizeof *r);
}

/* The model the reference reads its weights from: as they are, or as
   float16 holds them (half); BatchNormalization on the moving statistics,
   or on the batch's (training). */
typedef struct {
    mpt_model *m;
    int half, training;
} weights;

/* Layer i's weight "l<i>/<what>", NULL if it has none (no bias). */

static const float *weight(const weights *w, int i, const char *what) {
    char name[64];
    int p;
    snprintf(name, sizeof name, "l%d/%s", i, what);
    for (p = 0; p < mpt_model_param_count(w->m); p++) {
        mpt_param_info info;
        mpt_model_param(w->m, p, &info);
        if (!strcmp(info.name, name)) return (const float *)info.value.data;
    }
    return NULL;
}

static double wv(const weights *w, const float *t, int64_t k) {
    return round_to(w->half ? MPT_FLOAT16 : MPT_FLOAT32, t[k]);
}

/* y = x · kernel (+ bias), (act), over rows of `in` values, for Conv2D's
   windows and Dense alike: tap (row r, input k) is x[at(r, k)] or absent
   (-1: padding). */
static void ref_conv(const weights *w, int i, const g_graph *g, int n, reference *r) {
    const g_layer *x = &g->L[i];
    const int H = NODE_H(g, x->in[0]), W = NODE_W(g, x->in[0]), C = NODE_C(g, x->in[0]);
    const int dense = x->kind == G_DENSE, F = x->c;
    const int top = dense ? 0 : pad_before(H, x->kh, x->sh, x->same);
    const int left = dense ? 0 : pad_before(W, x->kw, x->sw, x->same);
    const int kh = dense ? 1 : x->kh, kw = dense ? 1 : x->kw;
    const float *kernel = weight(w, i, "kernel"), *bias = weight(w, i, "bias");
    const double *a = r->value[x->in[0]], *am = r->scale[x->in[0]];
    double *y = r->value[i + 1], *ym = r->scale[i + 1];
    /* (Dense over the last axis: each (h, w) position a row of C inputs) */
    const int64_t rows = (int64_t)n * x->h * x->w;
    int64_t row;
    for (row = 0; row < rows; row++) {
        const int b = (int)(row / ((int64_t)x->h * x->w)), oy = (int)(row / x->w % x->h);
        const int ox = (int)(row % x->w);
        int f, ky, kx, c;
        for (f = 0; f < F; f++) {
            double s = bias ? wv(w, bias, f) : 0, sm = fabs(s);
            for (ky = 0; ky < kh; ky++)
                for (kx = 0; kx < kw; kx++) {
                    const int iy = dense ? oy : oy * x->sh + ky - top;
                    const int ix = dense ? ox : ox * x->sw + kx - left;
                    if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                    for (c = 0; c < C; c++) {
                        const double k = wv(w, kernel, (((int64_t)ky * kw + kx) * C + c) * F + f);
                        const int64_t at = (((int64_t)b * H + iy) * W + ix) * C + c;
                        s += k * a[at], sm += fabs(k) * am[at];
                    }
                }
            y[row * F + f] = ref_act(x->act, s), ym[row * F + f] = sm;
        }
    }
}

static void ref_pool(const g_layer *x, const g_graph *g, int n, reference *r, int i) {
    const int H = NODE_H(g, x->in[0]), W = NODE_W(g, x->in[0]), C = x->c;
    const int top = pad_before(H, x->kh, x->sh, x->same);
    const int left = pad_before(W, x->kw, x->sw, x->same);
    const double *a = r->value[x->in[0]], *am = r->scale[x->in[0]];
    int b, oy, ox, c, ky, kx;
    for (b = 0; b < n; b++)
        for (oy = 0; oy < x->h; oy++)
            for (ox = 0; ox < x->w; ox++)
                for (c = 0; c < C; c++) {
                    double best = -INFINITY, best_scale = 0, sum = 0, sum_scale = 0;
                    int seen = 0;
                    const int64_t at = (((int64_t)b * x->h + oy) * x->w + ox) * C + c;
                    for (ky = 0; ky < x->kh; ky++)
                        for (kx = 0; kx < x->kw; kx++) {
                            const int iy = oy * x->sh + ky - top, ix = ox * x->sw + kx - left;
                            int64_t from;
                            if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue; /* not counted */
                            from = (((int64_t)b * H + iy) * W + ix) * C + c;
                            if (a[from] > best) best = a[from];
                            best_scale = fmax(best_scale, am[from]);
                            sum += a[from], sum_scale += am[from], seen++;
                        }
                    r->value[i + 1][at] = x->kind == G_MAX_POOL ? best : sum / seen;
                    r->scale[i + 1][at] = x->kind == G_MAX_POOL ? best_scale : sum_scale / seen;
                }
}

/* BatchNormalization, epsilon 1e-3: on the moving statistics, or in
   training on the batch's (each channel's mean and biased variance over
   the samples and positions). */
static void ref_batch_norm(const weights *w, int i, const g_graph *g, int n, reference *r) {
    const int64_t C = g->L[i].c, count = (int64_t)n * NODE_SIZE(g, i + 1);
    const float *gamma = weight(w, i, "gamma"), *beta = weight(w, i, "beta");
    const float *moving_mean = weight(w, i, "moving_mean");
    const float *moving_var = weight(w, i, "moving_variance");
    const double *a = r->value[g->L[i].in[0]], *am = r->scale[g->L[i].in[0]];
    double *mean = (double *)calloc((size_t)C, sizeof(double));
    double *var = (double *)calloc((size_t)C, sizeof(double));
    int64_t k, c;
    for (c = 0; c < C; c++) mean[c] = moving_mean[c], var[c] = moving_var[c];
    if (w->training) {
        memset(mean, 0, sizeof(double) * (size_t)C), memset(var, 0, sizeof(double) * (size_t)C);
        for (k = 0; k < count; k++) mean[k % C] += a[k] / (double)(count / C);
        for (k = 0; k < count; k++)
            var[k % C] += (a[k] - mean[k % C]) * (a[k] - mean[k % C]) / (double)(count / C);
    }
    for (k = 0; k < count; k++) {
        const double s = gamma[k % C] / sqrt(var[k % C] + 1e-3);
        r->value[i + 1][k] = (a[k] - mean[k % C]) * s + beta[k % C];
        r->scale[i + 1][k] = (am[k] + fabs(mean[k % C])) * fabs(s) + fabs(beta[k % C]);
    }
    free(mean), free(var);
}

/* softmax(Q_h K_hᵀ / √key_dim) V_h per head, then the output projection. */
static void ref_attention(const weights *w, int i, const g_graph *g, int n, reference *r) {
    const g_layer *x = &g->L[i];
    const int T = x->h, H = x->heads, kd = x->key_dim, vd = x->value_dim, D = x->c;
    const int key_node = x->n_in == 3 ? x->in[2] : x->in[1];
    const int in_node[3] = {x->in[0], key_node, x->in[1]}, dims[3] = {kd, kd, vd};
    static const char *const proj[3] = {"query", "key", "value"};
    const float *wo = weight(w, i, "attention_output/kernel");
    const float *bo = weight(w, i, "attention_output/bias");
    double *qkv[3], *qkv_scale[3], *o = (double *)malloc(sizeof(double) * (size_t)T * H * vd);
    double *o_scale = (double *)malloc(sizeof(double) * (size_t)T * H * vd);
    double *p = (double *)malloc(sizeof(double) * (size_t)T);
    const float *kernels[3], *biases[3];
    int b, h, t, e, j, k, c;
    for (k = 0; k < 3; k++) {
        char what[32];
        qkv[k] = (double *)malloc(sizeof(double) * (size_t)T * dims[k]);
        qkv_scale[k] = (double *)malloc(sizeof(double) * (size_t)T * dims[k]);
        snprintf(what, sizeof what, "%s/kernel", proj[k]);
        kernels[k] = weight(w, i, what);
        snprintf(what, sizeof what, "%s/bias", proj[k]);
        biases[k] = weight(w, i, what);
    }
    for (b = 0; b < n; b++) {
        for (h = 0; h < H; h++) {
            for (k = 0; k < 3; k++) { /* the projections, (Din, H, dim) kernels */
                const int Din = NODE_C(g, in_node[k]);
                const double *in = r->value[in_node[k]] + (int64_t)b * T * Din;
                const double *in_scale = r->scale[in_node[k]] + (int64_t)b * T * Din;
                const float *kernel = kernels[k], *bias = biases[k];
                for (t = 0; t < T; t++)
                    for (e = 0; e < dims[k]; e++) {
                        double s = bias ? wv(w, bias, h * dims[k] + e) : 0, sm = fabs(s);
                        for (c = 0; c < Din; c++) {
                            const double kk = wv(w, kernel, ((int64_t)c * H + h) * dims[k] + e);
                            s += kk * in[t * Din + c], sm += fabs(kk) * in_scale[t * Din + c];
                        }
                        qkv[k][t * dims[k] + e] = s, qkv_scale[k][t * dims[k] + e] = sm;
                    }
            }
            for (t = 0; t < T; t++) {
                const int seen = x->causal ? t + 1 : T;
                double top = -INFINITY, total = 0, score_scale = 0;
                for (j = 0; j < seen; j++) {
                    double s = 0, sm = 0;
                    for (e = 0; e < kd; e++) {
                        s += qkv[0][t * kd + e] * qkv[1][j * kd + e];
                        sm += qkv_scale[0][t * kd + e] * qkv_scale[1][j * kd + e];
                    }
                    p[j] = s / sqrt((double)kd), top = fmax(top, p[j]);
                    score_scale = fmax(score_scale, sm / sqrt((double)kd));
                }
                for (j = 0; j < seen; j++) p[j] = exp(p[j] - top), total += p[j];
                for (e = 0; e < vd; e++) {
                    double s = 0, sm = 0;
                    for (j = 0; j < seen; j++)
                        s += p[j] / total * qkv[2][j * vd + e],
                        sm += p[j] / total * qkv_scale[2][j * vd + e];
                    /* an error ε in the scores moves the weights by about ε, relative */
                    o[(t * H + h) * vd + e] = s;
                    o_scale[(t * H + h) * vd + e] = sm * (1 + score_scale);
                }
            }
        }
        for (t = 0; t < T; t++)
            for (e = 0; e < D; e++) {
                const int64_t at = ((int64_t)b * T + t) * D + e;
                double s = bo ? wv(w, bo, e) : 0, sm = fabs(s);
                for (c = 0; c < H * vd; c++) {
                    const double kk = wv(w, wo, (int64_t)c * D + e);
                    s += kk * o[t * H * vd + c], sm += fabs(kk) * o_scale[t * H * vd + c];
                }
                r->value[i + 1][at] = s, r->scale[i + 1][at] = sm;
            }
    }
    for (k = 0; k < 3; k++) free(qkv[k]), free(qkv_scale[k]);
    free(o), free(o_scale), free(p);
}

/* Layers first .. g->n − 1 of g, their inputs in r. */
static void reference_layers(const weights *w, const g_graph *g, int n, reference *r,
                             int first) {
    int64_t k;
    int i;
    for (i = first; i < g->n; i++) {
        const g_layer *L = &g->L[i];
        const int64_t count = (int64_t)n * NODE_SIZE(g, i + 1), C = L->c;
        const double *a = r->value[L->in[0]], *am = r->scale[L->in[0]];
        const double *b = L->n_in > 1 ? r->value[L->in[1]] : NULL;
        const double *bm = L->n_in > 1 ? r->scale[L->in[1]] : NULL;
        double *y = (double *)calloc((size_t)count, sizeof(double));
        double *ym = (double *)calloc((size_t)count, sizeof(double));
        r->value[i + 1] = y, r->scale[i + 1] = ym;
        switch (L->kind) {
        case G_CONV:
        case G_DENSE: ref_conv(w, i, g, n, r); break;
        case G_MAX_POOL:
        case G_AVG_POOL: ref_pool(L, g, n, r, i); break;
        case G_ATTENTION: ref_attention(w, i, g, n, r); break;
        case G_BN: ref_batch_norm(w, i, g, n, r); break;
        case G_LAYER_NORM: { /* each row of C over its own mean and variance */
            const float *gamma = weight(w, i, "gamma"), *beta = weight(w, i, "beta");
            const double eps = L->eps_small ? 1e-5 : 1e-3;
            int64_t row, c;
            for (row = 0; row < count / C; row++) {
                double mean = 0, var = 0, mean_scale = 0, inv;
                for (c = 0; c < C; c++) mean += a[row * C + c], mean_scale += am[row * C + c];
                mean /= (double)C, mean_scale /= (double)C;
                for (c = 0; c < C; c++) var += (a[row * C + c] - mean) * (a[row * C + c] - mean);
                inv = 1 / sqrt(var / (double)C + eps);
                for (c = 0; c < C; c++) {
                    y[row * C + c] = (a[row * C + c] - mean) * inv * gamma[c] + beta[c];
                    ym[row * C + c] = ((am[row * C + c] + mean_scale) * inv + 1) * fabs(gamma[c]) +
                                      fabs(beta[c]);
                }
            }
            break;
        }
        case G_RELU:
            for (k = 0; k < count; k++) y[k] = a[k] > 0 ? a[k] : 0, ym[k] = am[k];
            break;
        case G_ZERO_PAD: {
            const int Hin = NODE_H(g, L->in[0]), Win = NODE_W(g, L->in[0]);
            for (k = 0; k < (int64_t)n * Hin * Win; k++) {
                const int64_t b0 = k / (Hin * Win), iy = k / Win % Hin, ix = k % Win;
                const int64_t to = ((b0 * L->h + iy + L->pad[0]) * L->w + ix + L->pad[2]) * C;
                memcpy(y + to, a + k * C, sizeof(double) * (size_t)C);
                memcpy(ym + to, am + k * C, sizeof(double) * (size_t)C);
            }
            break;
        }
        case G_ADD:
        case G_SUBTRACT:
        case G_MULTIPLY:
        case G_AVERAGE:
            for (k = 0; k < count; k++) {
                y[k] = L->kind == G_ADD        ? a[k] + b[k]
                       : L->kind == G_SUBTRACT ? a[k] - b[k]
                       : L->kind == G_MULTIPLY ? a[k] * b[k]
                                               : (a[k] + b[k]) / 2;
                ym[k] = L->kind == G_MULTIPLY ? am[k] * bm[k]
                        : L->kind == G_AVERAGE ? (am[k] + bm[k]) / 2
                                               : am[k] + bm[k];
            }
            break;
        case G_CONCAT: {
            const int64_t ca = NODE_C(g, L->in[0]), cb = NODE_C(g, L->in[1]);
            for (k = 0; k < count / C; k++) {
                memcpy(y + k * C, a + k * ca, sizeof(double) * (size_t)ca);
                memcpy(ym + k * C, am + k * ca, sizeof(double) * (size_t)ca);
                memcpy(y + k * C + ca, b + k * cb, sizeof(double) * (size_t)cb);
                memcpy(ym + k * C + ca, bm + k * cb, sizeof(double) * (size_t)cb);
            }
            break;
        }
        case G_GLOBAL_POOL: {
            const int64_t HW = NODE_H(g, L->in[0]) * NODE_W(g, L->in[0]);
            int64_t p;
            for (k = 0; k < count; k++) {
                const int64_t b0 = k / C, c = k % C;
                for (p = 0; p < HW; p++)
                    y[k] += a[(b0 * HW + p) * C + c], ym[k] += am[(b0 * HW + p) * C + c];
                y[k] /= (double)HW, ym[k] /= (double)HW;
            }
            break;
        }
        case G_FLATTEN:
            memcpy(y, a, sizeof(double) * (size_t)count);
            memcpy(ym, am, sizeof(double) * (size_t)count);
            break;
        case G_EMBEDDING: {
            const float *table = weight(w, i, "embeddings");
            for (k = 0; k < count; k++) {
                y[k] = wv(w, table, (int64_t)a[k / C] * C + k % C);
                ym[k] = fabs(y[k]);
            }
            break;
        }
        case G_POSITIONS: {
            const float *table = weight(w, i, "embeddings");
            for (k = 0; k < count; k++) {
                y[k] = wv(w, table, k % ((int64_t)L->h * C));
                ym[k] = fabs(y[k]);
            }
            break;
        }
        }
    }
}

/* Every node of g for the n samples x (float32 images, or int32 ids). */
static void reference_run(const weights *w, const g_graph *g, const void *x, int n,
                          reference *r) {
    const int64_t in_count = (int64_t)n * NODE_SIZE(g, 0);
    int64_t k;
    memset(r, 0, sizeof *r);
    r->value[0] = (double *)calloc((size_t)in_count, sizeof(double));
    r->scale[0] = (double *)calloc((size_t)in_count, sizeof(double));
    for (k = 0; k < in_count; k++)
        r->value[0][k] = g->tokens ? ((const int32_t *)x)[k] : ((const float *)x)[k],
        r->scale[0][k] = fabs(r->value[0][k]);
    reference_layers(w, g, n, r, 0);
}

/* got (n samples of g's output) within tol of each output's scale (and
   1e-6 absolute); what names the run. */
static void expect_near(const g_graph *g, const reference *r, const float *got, int n,
                        double tol, const char *what, int seed) {
    const int64_t count = (int64_t)n * NODE_SIZE(g, g->n);
    const double *want = r->value[g->n], *scale = r->scale[g->n];
    int64_t k, bad = 0, worst_at = 0;
    double worst = 0;
    for (k = 0; k < count; k++) {
        const double e = fabs(got[k] - want[k]) / (tol * scale[k] + 1e-6);
        bad += !(e <= 1);
        if (!(e <= worst)) worst = e, worst_at = k;
    }
    CHECK(bad == 0, "seed %d, %s: %lld of %lld outputs off (output %lld: %g, want %g, scale %g)",
          seed, what, (long long)bad, (long long)count, (long long)worst_at,
          (double)got[worst_at], want[worst_at], scale[worst_at]);
    if (bad) print_graph(g, seed);
}

/* ---- the checks -------------------------------------------------------------------------- */

#define IMAGE_GRAPHS 120
#define TOKEN_GRAPHS 120
#define TRAINED_GRAPHS 30 /* of each kind */

/* Graph `seed` of a kind, the same for every call. */
static void graph_of(g_graph *g, int tokens, int seed) {
    test_seed(1000 + 2 * (unsigned long long)seed + (unsigned long long)tokens);
    if (tokens) random_token_graph(g);
    else random_image_graph(g);
}

/* n samples for g: images in U(−1, 1), or ids of its vocabulary. */
static void *inputs_of(const g_graph *g, int n, mpt_tensor *t) {
    const int64_t count = (int64_t)n * NODE_SIZE(g, 0);
    int64_t shape[4] = {n, g->h, g->w, g->c}, k;
    void *x = malloc(sizeof(float) * (size_t)count);
    for (k = 0; k < count; k++)
        if (g->tokens) ((int32_t *)x)[k] = test_randint(0, g->vocab - 1);
        else ((float *)x)[k] = (float)test_uniform(-1, 1);
    memset(t, 0, sizeof *t);
    if (g->tokens) shape[1] = g->h; /* (n, T) */
    t->dtype = g->tokens ? MPT_INT32 : MPT_FLOAT32;
    t->rank = g->tokens ? 2 : 4;
    memcpy(t->shape, shape, sizeof shape);
    t->data = x;
    return x;
}

/* The quantized model of m in `mode` (representative data d for full
   integer), invoked on x; its float32 outputs (malloc'd), or NULL. */
static float *quantized_outputs(mpt_context *c, mpt_model *m, mpt_quantize_mode mode,
                                const mpt_dataset *d, const mpt_tensor *x, int64_t count) {
    mpt_model *q = NULL;
    mpt_tensor y;
    float *out = NULL;
    memset(&y, 0, sizeof y);
    if (mpt_model_quantize(m, &(mpt_quantize_desc){.mode = mode, .representative_data = d}, &q) !=
        MPT_OK) {
        CHECK(0, "quantize (mode %d): %s", (int)mode, mpt_context_error(c));
        return NULL;
    }
    if (mpt_model_quantized_invoke(q, x, &y) == MPT_OK && mpt_tensor_count(&y) == count) {
        out = (float *)malloc(sizeof(float) * (size_t)count);
        memcpy(out, y.data, sizeof(float) * (size_t)count);
    } else {
        CHECK(0, "invoke (mode %d): %s", (int)mode, mpt_context_error(c));
    }
    mpt_tensor_free(c, &y);
    mpt_model_destroy(q);
    return out;
}

/* The contexts a graph runs in: threads, the CPU features turned off,
   and what runs there. The portable path's float32 calibration rounds
   otherwise, so its full-integer scales may differ: not compared. */
static const struct {
    int threads, disable;
    const char *name;
    int predict, full_integer;
} runs[] = {{2, 0, "2 threads", 1, 1},
            {1, 0, "1 thread", 1, 1},
            {1, ~0, "the portable path", 1, 0},
            {2, MPT_CPU_AVX512_VNNI, "2 threads without VNNI", 0, 1}};
#define RUNS ((int)(sizeof runs / sizeof runs[0]))

/* Graph `seed` of a kind: predict in every run, and in the first its
   float16 and dynamic-range models, against the reference; an image
   graph's full-integer outputs the same bytes in every run that makes
   them. */
static void check_graph(int tokens, int seed) {
    g_graph g;
    reference ref, ref_half;
    mpt_tensor x;
    float *full[RUNS] = {NULL};
    int64_t count;
    void *xs;
    int n, r;
    memset(&ref, 0, sizeof ref), memset(&ref_half, 0, sizeof ref_half);
    graph_of(&g, tokens, seed);
    n = test_randint(1, 9);
    xs = inputs_of(&g, n, &x);
    count = (int64_t)n * NODE_SIZE(&g, g.n);
    for (r = 0; r < RUNS; r++) {
        mpt_context *c = path_ctx(runs[r].threads, runs[r].disable);
        mpt_model *m;
        mpt_dataset *d = NULL;
        mpt_tensor out;
        test_seed(77 + (unsigned long long)seed); /* the same weights in every run */
        m = c ? model_of(c, &g, MPT_POLICY_FLOAT32, 16) : NULL;
        if (!m) {
            mpt_context_destroy(c);
            break;
        }
        mpt_dataset_create(c, &(mpt_dataset_desc){.x = &x}, &d);
        if (r == 0) {
            const weights w = {m, 0, 0}, w_half = {m, 1, 0};
            float *f16 = quantized_outputs(c, m, MPT_QUANTIZE_FLOAT16, NULL, &x, count);
            float *dyn = quantized_outputs(c, m, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, &x, count);
            reference_run(&w, &g, xs, n, &ref);
            reference_run(&w_half, &g, xs, n, &ref_half);
            if (f16) expect_near(&g, &ref_half, f16, n, 1e-3, "float16", seed);
            if (dyn) expect_near(&g, &ref, dyn, n, 0.05, "dynamic int8", seed);
            free(f16), free(dyn);
        }
        if (runs[r].predict) {
            char what[64];
            memset(&out, 0, sizeof out);
            CHECK(mpt_model_predict(m, d, test_randint(1, 16), &out) == MPT_OK, "predict: %s",
                  mpt_context_error(c));
            snprintf(what, sizeof what, "predict on %s", runs[r].name);
            if (out.data) expect_near(&g, &ref, (const float *)out.data, n, 2e-5, what, seed);
            mpt_tensor_free(c, &out);
        }
        if (!tokens && runs[r].full_integer)
            full[r] = quantized_outputs(c, m, MPT_QUANTIZE_FULL_INTEGER, d, &x, count);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(c);
    }
    for (r = 1; r < RUNS && full[0]; r++)
        if (full[r] && memcmp(full[0], full[r], sizeof(float) * (size_t)count)) {
            CHECK(0, "seed %d: full integer on %s gives other outputs than on %s", seed,
                  runs[r].name, runs[0].name);
            print_graph(&g, seed);
        }
    for (r = 0; r < RUNS; r++) free(full[r]);
    reference_free(&ref);
    reference_free(&ref_half);
    free(xs);
}

/* check(tokens, seed) on graphs 0 .. count − 1 of a kind. */
static void each_graph(void (*check)(int tokens, int seed), int tokens, int count) {
    int seed;
    for (seed = 0; seed < count; seed++) check(tokens, seed);
}

static void test_image_graphs(void) { each_graph(check_graph, 0, IMAGE_GRAPHS); }
static void test_token_graphs(void) { each_graph(check_graph, 1, TOKEN_GRAPHS); }

/* ---- gradients --------------------------------------------------------------------------- */

#define GRADIENT_GRAPHS 20 /* of each kind */
#define GRADIENT_PLACES 1  /* in each parameter */

/* L = Σ R·y over the output y of the reference in training, as the loss
   whose output gradient is R, with layer `changed`'s weights moved: the
   nodes before its output are base's (the layers are in graph order, so
   none of them reads it), the rest run again. */
static double reference_loss(const weights *w, const g_graph *g, int n, const reference *base,
                             int changed, const float *R) {
    const int64_t count = (int64_t)n * NODE_SIZE(g, g->n);
    reference r;
    int64_t k;
    int i;
    double loss = 0;
    memset(&r, 0, sizeof r);
    for (i = 0; i <= changed; i++) r.value[i] = base->value[i], r.scale[i] = base->scale[i];
    reference_layers(w, g, n, &r, changed);
    for (k = 0; k < count; k++) loss += R[k] * r.value[g->n][k];
    for (i = 0; i <= changed; i++) r.value[i] = r.scale[i] = NULL; /* base's */
    reference_free(&r);
    return loss;
}

/* Graph `seed`'s float32 training forward and backward from a random
   output gradient R: each trainable parameter's gradient at a random
   place against central differences of reference_loss, in steps of 1e-6
   of the weight (at least 1e-7; a step across a ReLU's or a max's kink is
   wrong by design, and steps this small rarely cross one). Within 1 %, or
   1e-4 of the parameter's largest gradient, or 1e-5 where the gradient is
   0 and both sides only round: a bias before a BatchNormalization in
   training (the batch's mean takes it away). A key projection's bias is
   left out for the same reason: it moves every score of a query's row
   alike, which the softmax undoes. */
static void check_gradients(int tokens, int seed) {
    mpt_context *c = path_ctx(2, 0);
    g_graph g;
    mpt_model *m;
    mpt_tensor x, out, dout;
    reference base;
    weights w;
    float *R;
    void *xs;
    int64_t count, k;
    int n, p, j, ran;
    memset(&base, 0, sizeof base);
    graph_of(&g, tokens, seed);
    n = test_randint(2, 6);
    xs = inputs_of(&g, n, &x);
    count = (int64_t)n * NODE_SIZE(&g, g.n);
    R = (float *)malloc(sizeof(float) * (size_t)count);
    for (k = 0; k < count; k++) R[k] = (float)test_uniform(-1, 1);
    test_seed(77 + (unsigned long long)seed);
    m = c ? model_of(c, &g, MPT_POLICY_FLOAT32, 8) : NULL;
    w.m = m, w.half = 0, w.training = 1;
    memset(&dout, 0, sizeof dout);
    dout.dtype = MPT_FLOAT32, dout.rank = g.tokens ? 3 : 2, dout.data = R;
    dout.shape[0] = n, dout.shape[1] = g.tokens ? g.h : g.L[g.n - 1].c;
    dout.shape[2] = g.L[g.n - 1].c;
    ran = m && mpt_model_forward(m, &x, 1, &out) == MPT_OK &&
          mpt_model_backward(m, &dout, NULL) == MPT_OK;
    CHECK(ran, "seed %d: forward and backward: %s", seed, c ? mpt_context_error(c) : "no context");
    if (ran) reference_run(&w, &g, xs, n, &base);
    for (p = 0; ran && p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        const float *grad;
        float *value;
        double largest = 0;
        int layer = 0;
        mpt_model_param(m, p, &info);
        if (!info.trainable || strstr(info.name, "key/bias") ||
            sscanf(info.name, "l%d/", &layer) != 1)
            continue;
        value = (float *)info.value.data, grad = (const float *)info.grad.data;
        for (k = 0; k < mpt_tensor_count(&info.value); k++) largest = fmax(largest, fabs(grad[k]));
        for (j = 0; j < GRADIENT_PLACES; j++) {
            const int64_t at = test_randint(0, (int)mpt_tensor_count(&info.value) - 1);
            const float v = value[at];
            const double step = 1e-6 * fmax(0.1, fabs(v));
            double up, down, numeric;
            /* the steps as float32 holds them */
            value[at] = (float)(v + step), up = reference_loss(&w, &g, n, &base, layer, R);
            numeric = (double)value[at];
            value[at] = (float)(v - step), down = reference_loss(&w, &g, n, &base, layer, R);
            numeric = (up - down) / (numeric - (double)value[at]);
            value[at] = v;
            if (!(fabs(grad[at] - numeric) <= 1e-2 * fabs(numeric) + 1e-4 * largest + 1e-5)) {
                CHECK(0, "seed %d: %s[%lld]: backward %.7g, central differences %.7g", seed,
                      info.name, (long long)at, (double)grad[at], numeric);
                print_graph(&g, seed);
            }
        }
    }
    reference_free(&base);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    free(R);
    free(xs);
}

static void test_image_graph_gradients(void) { each_graph(check_gradients, 0, GRADIENT_GRAPHS); }
static void test_token_graph_gradients(void) { each_graph(check_gradients, 1, GRADIENT_GRAPHS); }

/* ---- the exported files in LiteRT and ONNX Runtime --------------------------------------- */

#define EXPORTED_GRAPHS 30 /* of each kind */

/* Writes `bytes` of p to dir/name; 1 when it could. */
static int write_file(const char *dir, const char *name, const void *p, size_t bytes) {
    char path[512];
    FILE *f;
    size_t wrote;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "wb");
    if (!f) return 0;
    wrote = fwrite(p, 1, bytes, f);
    return fclose(f) == 0 && wrote == bytes;
}

/* The variant `name` of a graph for the runtimes: mpt.h's outputs (from
   predict, or from a quantized model's invoke) in dir/<name>.bin, the
   model exported beside them, and a line of the manifest with how far
   LiteRT's and ONNX Runtime's outputs may be from them. */
static void export_variant(FILE *manifest, const char *dir, const char *name, mpt_context *c,
                           mpt_model *m, const float *outputs, int64_t count,
                           double litert_bound, double onnx_bound) {
    char file[512];
    snprintf(file, sizeof file, "%s.bin", name);
    CHECK(write_file(dir, file, outputs, sizeof(float) * (size_t)count), "write %s", file);
    snprintf(file, sizeof file, "%s/%s.tflite", dir, name);
    CHECK(mpt_model_export_tflite(m, file, NULL) == MPT_OK, "%s: %s", file, mpt_context_error(c));
    snprintf(file, sizeof file, "%s/%s.onnx", dir, name);
    CHECK(mpt_model_export_onnx(m, file, NULL) == MPT_OK, "%s: %s", file, mpt_context_error(c));
    fprintf(manifest, "%s %s %g %g\n", dir, name, litert_bound, onnx_bound);
}

/* The largest |y| of count outputs, at least 1e-3. */
static double largest_output(const float *y, int64_t count) {
    double most = 1e-3;
    int64_t k;
    for (k = 0; k < count; k++) most = fmax(most, fabs(y[k]));
    return most;
}

/* Graph `seed` of a kind written for the runtimes under root: its inputs,
   its float32 model (and an image graph's quantized ones, full integer
   calibrated on those 16 inputs), mpt.h's outputs of each. */
static void export_graph(FILE *manifest, const char *root, int tokens, int seed) {
    mpt_context *c = path_ctx(2, 0);
    char dir[400];
    g_graph g;
    mpt_model *m;
    mpt_dataset *d = NULL;
    mpt_tensor x, out;
    const int n = tokens ? 4 : 16;
    int64_t count;
    void *xs;
    int mode;
    graph_of(&g, tokens, seed);
    xs = inputs_of(&g, n, &x);
    count = (int64_t)n * NODE_SIZE(&g, g.n);
    snprintf(dir, sizeof dir, "%s/%s%d", root, tokens ? "tokens" : "images", seed);
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    test_seed(77 + (unsigned long long)seed);
    m = c ? model_of(c, &g, MPT_POLICY_FLOAT32, 16) : NULL;
    memset(&out, 0, sizeof out);
    if (m && mpt_dataset_create(c, &(mpt_dataset_desc){.x = &x}, &d) == MPT_OK &&
        mpt_model_predict(m, d, 16, &out) == MPT_OK) {
        const double most = largest_output((const float *)out.data, count);
        /* the shape line the runtimes read the inputs by */
        fprintf(manifest, "%s shape %d %s %d %d %d\n", dir, n, tokens ? "int32" : "float32", g.h,
                g.w, g.c);
        CHECK(write_file(dir, "x.bin", xs, sizeof(float) * (size_t)(n * NODE_SIZE(&g, 0))),
              "write %s/x.bin", dir);
        export_variant(manifest, dir, "float32", c, m, (const float *)out.data, count, 1e-4 * most,
                       1e-4 * most);
    } else {
        CHECK(0, "seed %d: %s", seed, c ? mpt_context_error(c) : "no context");
    }
    for (mode = 0; !tokens && out.data && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        static const char *const names[] = {"dynamic_int8", "full_int8", "float16"};
        mpt_model *q = NULL;
        mpt_tensor y;
        mpt_quantized_info info;
        memset(&y, 0, sizeof y);
        if (mpt_model_quantize(m, &(mpt_quantize_desc){.mode = (mpt_quantize_mode)mode,
                                                       .representative_data = d}, &q) != MPT_OK ||
            mpt_model_quantized_invoke(q, &x, &y) != MPT_OK ||
            mpt_model_quantized_info(q, &info) != MPT_OK) {
            CHECK(0, "seed %d, %s: %s", seed, names[mode], mpt_context_error(c));
        } else { /* the bounds: see the top of this file */
            const double most = largest_output((const float *)y.data, count);
            double litert = 0.1 * most, onnx = 0.02 * most; /* dynamic range */
            if (mode == MPT_QUANTIZE_FULL_INTEGER) litert = onnx = 16 * info.output.scale;
            if (mode == MPT_QUANTIZE_FLOAT16) litert = onnx = 1e-4 * most;
            export_variant(manifest, dir, names[mode], c, q, (const float *)y.data, count, litert,
                           onnx);
        }
        mpt_tensor_free(c, &y);
        mpt_model_destroy(q);
    }
    mpt_tensor_free(c, &out);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    free(xs);
}

/* Runs each file of the manifest (argv[1]) in LiteRT and ONNX Runtime on
   its inputs and prints a line for each whose outputs are further from
   mpt.h's than its bound for that runtime. */
static const char runtimes_script[] =
    "import sys\n"
    "import numpy as np\n"
    "import onnxruntime as ort\n"
    "from ai_edge_litert.interpreter import Interpreter\n"
    "def litert(path, x):\n"
    "    it = Interpreter(model_path=path)\n"
    "    i, o = it.get_input_details()[0], it.get_output_details()[0]\n"
    "    it.resize_tensor_input(i['index'], list(x.shape))\n"
    "    it.allocate_tensors()\n"
    "    it.set_tensor(i['index'], x)\n"
    "    it.invoke()\n"
    "    return it.get_tensor(o['index'])\n"
    TEST_ORT_SESSION_PY
    "def onnx(path, x):\n"
    "    s = ort_session(path)\n"
    "    return s.run(None, {s.get_inputs()[0].name: x})[0]\n"
    "inputs, checked = {}, 0\n"
    "for line in open(sys.argv[1]):\n"
    "    words = line.split()\n"
    "    d = words[0]\n"
    "    if words[1] == 'shape':\n"
    "        n, dtype = int(words[2]), np.dtype(words[3])\n"
    "        shape = [n, int(words[4])] if dtype == np.int32 else \\\n"
    "            [n] + [int(v) for v in words[4:7]]\n"
    "        inputs[d] = np.fromfile(d + '/x.bin', dtype=dtype).reshape(shape)\n"
    "        continue\n"
    "    name, bounds, x = words[1], [float(v) for v in words[2:4]], inputs[d]\n"
    "    want = np.fromfile(d + '/' + name + '.bin', dtype=np.float32).reshape(len(x), -1)\n"
    "    for runtime, run, ext, bound in (('LiteRT', litert, '.tflite', bounds[0]),\n"
    "                                     ('ONNX Runtime', onnx, '.onnx', bounds[1])):\n"
    "        got = run(d + '/' + name + ext, x).reshape(len(x), -1)\n"
    "        off = float(np.abs(got.astype(np.float64) - want).max())\n"
    "        if not off <= bound:\n"
    "            print('OFF', d, name, runtime, 'by', off, 'bound', bound)\n"
    "        checked += 1\n"
    "print('CHECKED', checked)\n";

typedef struct {
    int checked;
} runtime_lines;

static void runtime_line(void *user, const char *text) {
    runtime_lines *r = (runtime_lines *)user;
    if (sscanf(text, "CHECKED %d", &r->checked) == 1) return;
    CHECK(strncmp(text, "OFF", 3) != 0 && strncmp(text, "Traceback", 9) != 0, "%s", text);
    if (strncmp(text, "INFO", 4)) printf("  %s\n", text);
}

static void test_exported_graphs_in_litert_and_onnx_runtime(void) {
    char root[] = "/tmp/mpt_random_graphs_XXXXXX", manifest_path[512];
    runtime_lines lines = {0};
    FILE *manifest;
    int seed, tokens, files = 0;
    if (!test_python_imports("numpy, onnxruntime, ai_edge_litert")) return;
    CHECK(mkdtemp(root) != NULL, "mkdtemp");
    snprintf(manifest_path, sizeof manifest_path, "%s/manifest", root);
    manifest = fopen(manifest_path, "w");
    for (tokens = 0; manifest && tokens <= 1; tokens++)
        for (seed = 0; seed < EXPORTED_GRAPHS; seed++) {
            export_graph(manifest, root, tokens, seed);
            files += tokens ? 2 : 8; /* a model each runtime runs */
        }
    CHECK(manifest && fclose(manifest) == 0, "write %s", manifest_path);
    CHECK(test_python_lines(root, "runtimes.py", runtimes_script, manifest_path, runtime_line,
                            &lines),
          "the runtimes' script failed");
    CHECK(lines.checked == files, "the runtimes ran %d models, want %d", lines.checked, files);
    test_remove_tree(root);
}

/* ---- fit on 1 and 2 threads -------------------------------------------------------------- */

/* Graph `seed` fit for an epoch of 64 samples (batches of 16: images; of
   8: tokens) in a policy on `threads`; its weights (malloc'd, *size of
   them), or NULL. */
static float *fit_weights(int tokens, int seed, mpt_policy policy, int threads, int64_t *size) {
    mpt_context *c = path_ctx(threads, 0);
    const int n = tokens ? 24 : 64;
    g_graph g;
    mpt_model *m;
    mpt_dataset *d = NULL;
    mpt_tensor x, y;
    int32_t *labels;
    float *w = NULL;
    void *xs;
    int64_t k, count;
    graph_of(&g, tokens, seed);
    xs = inputs_of(&g, n, &x);
    count = tokens ? (int64_t)n * g.h : n; /* a label a position, or a sample */
    labels = (int32_t *)malloc(sizeof(int32_t) * (size_t)count);
    for (k = 0; k < count; k++) labels[k] = test_randint(0, g.L[g.n - 1].c - 1);
    memset(&y, 0, sizeof y);
    y.dtype = MPT_INT32, y.rank = tokens ? 2 : 1, y.shape[0] = n, y.shape[1] = g.h;
    y.data = labels;
    test_seed(91 + (unsigned long long)seed);
    m = c ? model_of(c, &g, policy, 16) : NULL;
    if (m && mpt_dataset_create(c, &(mpt_dataset_desc){.x = &x, .y = &y}, &d) == MPT_OK &&
        mpt_model_compile(m, &(mpt_compile_desc){
            .optimizer = {.type = MPT_OPTIMIZER_ADAMW, .learning_rate = 1e-2f,
                          .weight_decay = 0.1f},
            .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1}}) ==
            MPT_OK &&
        mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = tokens ? 8 : 16}) ==
            MPT_OK) {
        for (k = 0, *size = 0; k < mpt_model_param_count(m); k++) {
            mpt_param_info info;
            mpt_model_param(m, (int)k, &info);
            *size += mpt_tensor_count(&info.value);
        }
        w = (float *)malloc(sizeof(float) * (size_t)*size);
        test_weights_of(m, w, *size);
    } else {
        CHECK(0, "seed %d, %s on %d threads: %s", seed, mpt_policy_name(policy), threads,
              c ? mpt_context_error(c) : "no context");
    }
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(c);
    free(labels);
    free(xs);
    return w;
}

/* Graph `seed` fit on 1 and 2 threads: the same weights, bit for bit, in
   every policy. */
static void check_fit(int tokens, int seed) {
    int k;
    for (k = 0; k < 3; k++) {
        int64_t size[2] = {0, 0};
        float *one = fit_weights(tokens, seed, test_policies[k], 1, &size[0]);
        float *two = fit_weights(tokens, seed, test_policies[k], 2, &size[1]);
        if (one && two &&
            (size[0] != size[1] || memcmp(one, two, sizeof(float) * (size_t)size[0]))) {
            g_graph g;
            graph_of(&g, tokens, seed);
            CHECK(0, "seed %d, %s: fit's weights differ between 1 and 2 threads", seed,
                  mpt_policy_name(test_policies[k]));
            print_graph(&g, seed);
        }
        free(one), free(two);
    }
}

static void test_image_graphs_fit_alike_on_1_and_2_threads(void) {
    each_graph(check_fit, 0, TRAINED_GRAPHS);
}
static void test_token_graphs_fit_alike_on_1_and_2_threads(void) {
    each_graph(check_fit, 1, TRAINED_GRAPHS);
}

int main(void) {
    TEST_RUN(test_image_graphs);
    TEST_RUN(test_token_graphs);
    TEST_RUN(test_image_graph_gradients);
    TEST_RUN(test_token_graph_gradients);
    TEST_RUN(test_exported_graphs_in_litert_and_onnx_runtime);
    TEST_RUN(test_image_graphs_fit_alike_on_1_and_2_threads);
    TEST_RUN(test_token_graphs_fit_alike_on_1_and_2_threads);
    return test_summary("test_random_graphs");
}

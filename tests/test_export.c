/* Export to TFLite and ONNX (@export): small models with random weights and
   every layer the export writes are exported, run in the runtimes people
   deploy with — LiteRT (ai_edge_litert's Interpreter) and ONNX Runtime,
   after onnx.checker — on random inputs, through $MPT_TEST_PYTHON, and
   compared with mpt.h's own predict; models trained quantization-aware
   and converted with the ranges they learned too. Then the calls that
   must fail: a layer the export cannot write, an unbuilt model, paths that
   cannot be written; each leaves nothing behind. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, opendir */
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;
static char dir[64];

static const char *path_of(char *buf, const char *name) {
    snprintf(buf, 256, "%s/%s", dir, name);
    return buf;
}

/* ---- models with every layer the export writes ---------------------------------- */

typedef enum {
    MLP, MLP_VECTORS, MLP_ROWS, CNN, CNN_GAP, CNN_OPEN, GRAPH, SEQ, PIXELS, LN_ROWS, LN_CNN,
    TOKENS, ATTENTION, RESNET, BN_GRAPH
} arch;

static const char *arch_name(arch a) {
    static const char *names[] = {"mlp",     "mlp_vectors", "mlp_rows", "cnn",
                                  "cnn_gap", "cnn_open",    "graph",    "seq",
                                  "pixels",  "ln_rows",     "ln_cnn",   "tokens",
                                  "attention", "resnet",      "bn_graph"};
    return names[a];
}

static void add_dense(mpt_model *m, int64_t units, mpt_activation act) {
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = units, .activation = act});
}

static void add_conv(mpt_model *m, int64_t filters, int64_t kh, int64_t kw, int64_t sh,
                     int64_t sw, mpt_padding padding, mpt_activation act) {
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = filters,
                                               .kernel_size = {kh, kw},
                                               .strides = {sh, sw},
                                               .padding = padding,
                                               .activation = act});
}

static void add_bn(mpt_model *m) { mpt_model_add_batch_normalization(m, NULL); }

static void add_act(mpt_model *m, mpt_activation act) {
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = act});
}

static mpt_node conv_node(mpt_model *m, mpt_node x, int64_t filters, int64_t k,
                          mpt_padding padding) {
    return mpt_conv2d(m, x,
                      &(mpt_conv2d_desc){.filters = filters,
                                         .kernel_size = {k, k},
                                         .padding = padding});
}

/* ResNet's downsampling block: two 3×3 Conv2D (the first of stride 2)
   beside a 1×1 projection of stride 2, each with its BatchNormalization
   (folded), added, then ReLU. */
static mpt_node down_block(mpt_model *m, mpt_node x, int64_t filters, int with_bn) {
    mpt_conv2d_desc d = {.filters = filters, .kernel_size = {3, 3}, .strides = {2, 2},
                         .padding = MPT_PADDING_SAME};
    mpt_activation_desc relu = {.activation = MPT_ACT_RELU};
    mpt_node two[2];
    two[0] = mpt_conv2d(m, x, &d);
    if (with_bn) two[0] = mpt_batch_normalization(m, two[0], NULL);
    two[0] = conv_node(m, mpt_activation_layer(m, two[0], &relu), filters, 3, MPT_PADDING_SAME);
    d.kernel_size[0] = d.kernel_size[1] = 1;
    two[1] = mpt_conv2d(m, x, &d);
    if (with_bn) {
        two[0] = mpt_batch_normalization(m, two[0], NULL);
        two[1] = mpt_batch_normalization(m, two[1], NULL);
    }
    return mpt_activation_layer(m, mpt_add(m, 2, two, NULL), &relu);
}

/* The model's input through RandomFlip and RandomTranslation, which
   training alone runs: the export and quantization leave both out, and
   the file's input feeds every layer that reads their output. */
static mpt_node augmented_input(mpt_model *m) {
    mpt_node x = mpt_random_flip(m, mpt_model_input(m), NULL);
    return mpt_random_translation(m, x, &(mpt_random_translation_desc){
        .height_factor = {-0.1f, 0.1f}, .width_factor = {-0.1f, 0.1f}});
}

/* A graph with every merge and what the walk must not fold: a Conv2D
   whose output two layers read keeps its BatchNormalization apart (and the
   ReLU after it), one read once has it folded; ZeroPadding2D with
   uneven sides; Add of three (Sum), Subtract, Multiply, Average of three;
   Concatenate over the channels (one input the model's, NHWC in ONNX)
   and over the rows (two Conv2D outputs, NCHW in ONNX); a Conv2D applied
   twice (a shared layer); ResNet's downsampling block; Dropout, a
   linear Activation and the augmentation layers on the input, which
   leave nothing. with_bn 0 leaves BatchNormalization out. */
static void add_graph(mpt_model *m, int with_bn) {
    mpt_node x = augmented_input(m), in[3], a, r, c0, s1, d, mul, av, pool, twin, c2, e, y;
    mpt_zero_padding2d_desc pad = {.padding = {{1, 2}, {0, 3}}};
    c0 = conv_node(m, mpt_zero_padding2d(m, x, &pad), 4, 4, MPT_PADDING_VALID); /* (28, 28, 4) */
    a = conv_node(m, x, 4, 3, MPT_PADDING_SAME);
    r = with_bn ? mpt_batch_normalization(m, a, NULL) : a; /* a is read twice: not folded */
    r = mpt_activation_layer(m, r, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    in[0] = r, in[1] = a, in[2] = c0;
    s1 = mpt_add(m, 3, in, NULL);
    in[0] = s1, in[1] = c0;
    d = mpt_subtract(m, 2, in, NULL);
    in[0] = d, in[1] = r;
    mul = mpt_multiply(m, 2, in, NULL);
    in[0] = mul, in[1] = s1, in[2] = a;
    av = mpt_average(m, 3, in, NULL);
    in[0] = av, in[1] = x;
    pool = mpt_max_pooling2d(m, mpt_concatenate(m, 2, in, NULL), NULL); /* (14, 14, 5) */
    twin = mpt_conv2d(m, pool,
                      &(mpt_conv2d_desc){.name = "twin",
                                         .filters = 5,
                                         .kernel_size = {3, 3},
                                         .padding = MPT_PADDING_SAME,
                                         .activation = MPT_ACT_RELU});
    twin = mpt_apply_layer(m, "twin", 1, &twin); /* its own output, through it again */
    c2 = conv_node(m, twin, 3, 3, MPT_PADDING_SAME);
    if (with_bn) c2 = mpt_batch_normalization(m, c2, NULL); /* read once: folded */
    c2 = mpt_activation_layer(m, c2, &(mpt_activation_desc){.activation = MPT_ACT_TANH});
    e = conv_node(m, pool, 3, 1, MPT_PADDING_VALID);
    e = mpt_activation_layer(m, e, NULL); /* linear */
    in[0] = c2, in[1] = e;
    y = mpt_concatenate(m, 2, in, &(mpt_concatenate_desc){.axis = 1}); /* (28, 14, 3) */
    y = down_block(m, y, 6, with_bn);                                 /* (14, 7, 6) */
    y = mpt_dropout(m, y, &(mpt_dropout_desc){.rate = 0.2f});
    y = mpt_flatten(m, y, NULL);
    mpt_dense(m, y, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
}

/* A graph that quantizes (no Average, every BatchNormalization after a
   Conv2D nothing else reads): a residual block (Add), ResNet's
   downsampling block, a Concatenate of it with a MaxPooling2D of the
   block's output (two scales), ZeroPadding2D before a Conv2D, a Multiply
   and a Subtract, GlobalAveragePooling2D and a softmax; the augmentation
   layers on the input, which quantization leaves out. */
static void add_resnet(mpt_model *m, int with_bn) {
    mpt_activation_desc relu = {.activation = MPT_ACT_RELU};
    mpt_node r, a, two[2];
    r = conv_node(m, augmented_input(m), 8, 3, MPT_PADDING_SAME);
    if (with_bn) r = mpt_batch_normalization(m, r, NULL);
    r = mpt_activation_layer(m, r, &relu);
    a = conv_node(m, r, 8, 3, MPT_PADDING_SAME);
    if (with_bn) a = mpt_batch_normalization(m, a, NULL);
    a = conv_node(m, mpt_activation_layer(m, a, &relu), 8, 3, MPT_PADDING_SAME);
    if (with_bn) a = mpt_batch_normalization(m, a, NULL);
    two[0] = a, two[1] = r;
    r = mpt_activation_layer(m, mpt_add(m, 2, two, NULL), &relu);  /* (28, 28, 8) */
    two[0] = down_block(m, r, 12, with_bn), two[1] = mpt_max_pooling2d(m, r, NULL);
    r = mpt_concatenate(m, 2, two, NULL);                             /* (14, 14, 20) */
    two[0] = conv_node(m, mpt_zero_padding2d(m, r, NULL), 6, 3, MPT_PADDING_VALID);
    two[1] = conv_node(m, r, 6, 1, MPT_PADDING_VALID);
    two[1] = mpt_multiply(m, 2, two, NULL);
    r = mpt_subtract(m, 2, two, NULL);                                /* (14, 14, 6) */
    mpt_dense(m, mpt_global_average_pooling2d(m, r, NULL),
              &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
}

/* A graph of BatchNormalizations that do not fold (each a MUL by its
   scale and an ADD of its shift, in every quantized form): one on the
   input, one after a Conv2D that two layers read (its ReLU after it), one
   after their Add (its ReLU fused into the ADD), one after a Dense's ReLU
   (the seed cnn's), before the softmax. */
static void add_bn_graph(mpt_model *m) {
    mpt_activation_desc relu = {.activation = MPT_ACT_RELU};
    mpt_node a, two[2], y;
    a = conv_node(m, mpt_batch_normalization(m, mpt_model_input(m), NULL), 6, 3,
                  MPT_PADDING_SAME);
    two[0] = mpt_activation_layer(m, mpt_batch_normalization(m, a, NULL), &relu);
    two[1] = conv_node(m, a, 6, 1, MPT_PADDING_VALID);
    y = mpt_activation_layer(m, mpt_batch_normalization(m, mpt_add(m, 2, two, NULL), NULL), &relu);
    y = mpt_flatten(m, mpt_max_pooling2d(m, y, NULL), NULL);
    y = mpt_dense(m, y, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_dense(m, mpt_batch_normalization(m, y, NULL),
              &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
}

#define TOKEN_T 12 /* the token model's ids per sample */
#define TOKEN_V 37 /* its vocabulary */

/* Token ids: Embedding, PositionEmbedding added to it (its rows a constant
   the Add broadcasts over the batch), LayerNormalization, Dense over the
   positions with the tanh GELU, a softmax per position. */
static void add_tokens(mpt_model *m) {
    mpt_node in[2], y;
    in[0] = mpt_embedding(m, mpt_model_input(m),
                          &(mpt_embedding_desc){.input_dim = TOKEN_V, .output_dim = 8});
    in[1] = mpt_position_embedding(m, in[0],
                                   &(mpt_position_embedding_desc){.sequence_length = TOKEN_T});
    y = mpt_layer_normalization(m, mpt_add(m, 2, in, NULL), NULL);
    y = mpt_dense(m, y, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_GELU_TANH});
    mpt_dense(m, y, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_SOFTMAX});
}

/* A GPT's block and more: causal self-attention on the token and position
   embeddings with a residual Add, LayerNormalization, then attention of
   those positions to a value of their own width (a Dense of them) and a
   key of their own (the sum before the normalization), three heads of
   other query/key and value sizes, another output width, no biases; a
   softmax per position. */
static void add_attention(mpt_model *m) {
    mpt_node in[2], h, n, v;
    in[0] = mpt_embedding(m, mpt_model_input(m),
                          &(mpt_embedding_desc){.input_dim = TOKEN_V, .output_dim = 8});
    in[1] = mpt_position_embedding(m, in[0],
                                   &(mpt_position_embedding_desc){.sequence_length = TOKEN_T});
    h = mpt_add(m, 2, in, NULL);
    in[0] = h;
    in[1] = mpt_multi_head_attention(m, h, h, &(mpt_multi_head_attention_desc){
                                                  .num_heads = 2, .key_dim = 4,
                                                  .use_causal_mask = 1});
    h = mpt_add(m, 2, in, NULL);
    n = mpt_layer_normalization(m, h, NULL);
    v = mpt_dense(m, n, &(mpt_dense_desc){.units = 6});
    n = mpt_multi_head_attention_with_key(
        m, n, v, h,
        &(mpt_multi_head_attention_desc){.num_heads = 3, .key_dim = 3, .value_dim = 5,
                                         .output_dim = 7, .no_bias = 1});
    mpt_dense(m, n, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_SOFTMAX});
}

/* Odd sizes throughout; BatchNormalization both folded (after a Dense or
   Conv2D without activation) and on its own (after an activation, or after
   pooling); every activation; 'same' and 'valid', strides, non-square
   windows; LayerNormalization (which neither format has as an op in the
   versions written) with and without gamma and beta, over rows and over
   channels. with_bn 0 leaves BatchNormalization out. */
static mpt_model *make_model(arch a, int with_bn) {
    mpt_model *m = NULL;
    mpt_model_desc desc = {.input_shape = {28, 28, 1}, .input_rank = 3, .seed = 7};
    if (a == MLP_VECTORS) { /* samples (784,) */
        desc.input_shape[0] = 784;
        desc.input_rank = 1;
    } else if (a == MLP_ROWS || a == SEQ || a == LN_ROWS) { /* samples (28, 28) */
        desc.input_rank = 2;
    } else if (a == TOKENS || a == ATTENTION) { /* samples (TOKEN_T,) of int32 ids */
        desc.input_shape[0] = TOKEN_T;
        desc.input_rank = 1;
        desc.input_dtype = MPT_INT32;
    }
    if (mpt_model_create(ctx, &desc, &m) != MPT_OK) return NULL;
    switch (a) {
    case MLP_VECTORS:
    case MLP_ROWS:
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 11, MPT_ACT_NONE);
        if (with_bn) add_bn(m);
        add_act(m, MPT_ACT_SOFTMAX);
        break;
    case MLP:
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 37, MPT_ACT_RELU);
        if (with_bn) add_bn(m); /* after relu: its own scale and shift */
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.3f});
        add_dense(m, 23, MPT_ACT_NONE);
        if (with_bn) add_bn(m); /* folded into the Dense */
        add_act(m, MPT_ACT_TANH);
        add_dense(m, 19, MPT_ACT_SIGMOID);
        add_act(m, MPT_ACT_GELU);
        add_act(m, MPT_ACT_GELU_TANH);
        add_dense(m, 10, MPT_ACT_SOFTMAX);
        break;
    case SEQ: /* Dense over the last axis of (28, 28): 28 positions */
        add_dense(m, 16, MPT_ACT_GELU_TANH);
        add_dense(m, 14, MPT_ACT_SOFTMAX); /* per position */
        add_dense(m, 12, MPT_ACT_NONE);
        if (with_bn) add_bn(m); /* folded into the Dense */
        /* last, so that the two GELUs' difference (up to 4.7e-4) shows */
        add_act(m, MPT_ACT_GELU_TANH);
        break;
    case PIXELS: /* Dense over the channels of a Conv2D's (H, W, C) */
        add_conv(m, 6, 3, 3, 2, 2, MPT_PADDING_VALID, MPT_ACT_RELU);
        add_dense(m, 5, MPT_ACT_GELU);
        add_dense(m, 4, MPT_ACT_TANH);
        add_conv(m, 3, 2, 2, 1, 1, MPT_PADDING_SAME, MPT_ACT_NONE);
        add_dense(m, 7, MPT_ACT_SOFTMAX);
        break;
    case CNN:
        add_conv(m, 5, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU);
        if (with_bn) add_bn(m); /* after relu, 4-D: its own scale and shift */
        mpt_model_add_max_pooling2d(m, NULL);
        add_conv(m, 7, 2, 3, 2, 1, MPT_PADDING_SAME, MPT_ACT_NONE);
        if (with_bn) add_bn(m); /* folded into the Conv2D */
        add_act(m, MPT_ACT_RELU);
        mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {3, 3},
                                                               .strides = {2, 2},
                                                               .padding = MPT_PADDING_SAME});
        add_conv(m, 6, 1, 1, 1, 1, MPT_PADDING_VALID, MPT_ACT_TANH);
        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {2, 3},
                                                           .strides = {1, 2},
                                                           .padding = MPT_PADDING_SAME});
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 10, MPT_ACT_NONE);
        add_act(m, MPT_ACT_SOFTMAX);
        break;
    case CNN_GAP:
        add_conv(m, 9, 5, 5, 2, 2, MPT_PADDING_SAME, MPT_ACT_GELU);
        mpt_model_add_average_pooling2d(m, NULL);
        if (with_bn) add_bn(m); /* after pooling: its own scale and shift */
        mpt_model_add_global_average_pooling2d(m, NULL);
        add_dense(m, 10, MPT_ACT_SOFTMAX);
        break;
    case GRAPH: add_graph(m, with_bn); break;
    case RESNET: add_resnet(m, with_bn); break;
    case BN_GRAPH: add_bn_graph(m); break;
    case TOKENS: add_tokens(m); break;
    case ATTENTION: add_attention(m); break;
    case LN_ROWS: /* LayerNormalization over each row of 28, 3-D in the files */
        mpt_model_add_layer_normalization(m, NULL);
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 13, MPT_ACT_RELU);
        mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){.no_center = 1,
                                                                             .epsilon = 0.1f});
        add_dense(m, 10, MPT_ACT_SOFTMAX);
        break;
    case LN_CNN: /* over each pixel's channels: NCHW in ONNX, after a Conv2D */
        add_conv(m, 5, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU);
        mpt_model_add_layer_normalization(m, NULL);
        mpt_model_add_max_pooling2d(m, NULL);
        add_conv(m, 4, 3, 3, 2, 2, MPT_PADDING_SAME, MPT_ACT_NONE);
        mpt_model_add_layer_normalization(m, &(mpt_layer_normalization_desc){.no_scale = 1});
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 10, MPT_ACT_SOFTMAX);
        break;
    case CNN_OPEN: /* ends 4-D: the output must come back NHWC */
        add_conv(m, 4, 3, 3, 3, 3, MPT_PADDING_VALID, MPT_ACT_NONE);
        add_act(m, MPT_ACT_SIGMOID);
        add_conv(m, 3, 2, 2, 1, 1, MPT_PADDING_SAME, MPT_ACT_NONE);
        add_act(m, MPT_ACT_SOFTMAX); /* over the channels */
        break;
    }
    if (mpt_model_build(m, 64) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Random weights; BatchNormalization's statistics too (variances > 0), so
   that folding has something to fold. */
static void randomize(mpt_model *m) {
    int i, n = mpt_model_param_count(m);
    for (i = 0; i < n; i++) {
        mpt_param_info info;
        int64_t k, count;
        float *v;
        const char *what;
        if (mpt_model_param(m, i, &info) != MPT_OK) continue;
        v = (float *)info.value.data;
        count = mpt_tensor_count(&info.value);
        what = strrchr(info.name, '/') + 1;
        for (k = 0; k < count; k++) {
            if (strcmp(what, "moving_variance") == 0) v[k] = (float)test_uniform(0.3, 2.0);
            else if (strcmp(what, "gamma") == 0) v[k] = (float)test_uniform(0.5, 1.5);
            else if (strcmp(what, "kernel") == 0) v[k] = (float)test_uniform(-0.6, 0.6);
            else v[k] = (float)test_uniform(-0.5, 0.5);
        }
    }
    mpt_model_refresh_weights(m);
}

/* Every parameter rounded to float16 and back: what a float16-weight file holds. */
static void round_to_half(mpt_model *m) {
    int i, n = mpt_model_param_count(m);
    for (i = 0; i < n; i++) {
        mpt_param_info info;
        int64_t k, count;
        float *v;
        if (mpt_model_param(m, i, &info) != MPT_OK) continue;
        v = (float *)info.value.data;
        count = mpt_tensor_count(&info.value);
        for (k = 0; k < count; k++) v[k] = mpt_half_to_float(mpt_float_to_half(v[k]));
    }
    mpt_model_refresh_weights(m);
}

/* ---- running the files in their runtimes ---------------------------------------------- */

#define N_SAMPLES 37
#define SAMPLE (28 * 28)

/* The script: runs a .tflite in LiteRT or an .onnx in ONNX Runtime (after
   onnx.checker) on x (float32 samples, or int32 token ids), writes the
   outputs as little-endian float32, and checks how the weights (kernels,
   embedding tables) are stored (float32, float16, or int8 read by the
   products themselves: LiteRT's hybrid ops, ONNX's MatMulInteger and
   ConvInteger). */
static const char *write_script(char *buf) {
    FILE *f = fopen(path_of(buf, "run.py"), "w");
    if (!f) return NULL;
    fputs("import sys, numpy as np\n" TEST_ORT_SESSION_PY
          "fmt, model, xin, n, out, wdtype = sys.argv[1:7]\n"
          "if xin.endswith('.gz'):  # IDX images, scaled as mpt.h's loader scales them\n"
          "    import gzip\n"
          "    raw = np.frombuffer(gzip.open(xin).read(), dtype=np.uint8, offset=16)\n"
          "    x = raw.reshape(-1, 28, 28, 1).astype(np.float32) * np.float32(1 / 255)\n"
          "elif xin.endswith('.ids'):  # int32 token ids, (n, T)\n"
          "    x = np.fromfile(xin, dtype='<i4').reshape(int(n), -1)\n"
          "else:\n"
          "    x = np.fromfile(xin, dtype='<f4').reshape(int(n), 28, 28, 1)\n"
          "weights = ('/kernel', '/embeddings')  # stored as the file's weights are\n"
          "if wdtype == 'qint8':  # a full-integer model: int8 kernels, int8 ops between\n"
          "    weights, wdtype = weights + ('/kernel_quantized',), 'full_int8'\n"
          "def shaped(x, sample):  # as the model's input: (n, 28, 28, 1), (n, 784), ...\n"
          "    return np.ascontiguousarray(x.reshape([len(x)] + [int(d) for d in sample]))\n"
          "if fmt == 'tflite':\n"
          "    from ai_edge_litert.interpreter import Interpreter\n"
          "    it = Interpreter(model_path=model)\n"
          "    i = it.get_input_details()[0]['index']\n"
          "    x = shaped(x, it.get_input_details()[0]['shape'][1:])\n"
          "    it.resize_tensor_input(i, list(x.shape))\n"
          "    it.allocate_tensors()\n"
          "    it.set_tensor(i, x)\n"
          "    it.invoke()\n"
          "    y = it.get_tensor(it.get_output_details()[0]['index'])\n"
          "    kinds = {t['name']: t['dtype'] for t in it.get_tensor_details()}\n"
          "    kernels = [d for name, d in kinds.items() if name.endswith(weights)]\n"
          "    ops = [op['op_name'] for op in it._get_ops_details()]\n"
          "    if wdtype == 'int8':  # hybrid: the products read the int8 kernels themselves\n"
          "        assert 'DEQUANTIZE' not in ops, ops\n"
          "else:\n"
          "    import onnx, onnxruntime as ort\n"
          "    proto = onnx.load(model)\n"
          "    onnx.checker.check_model(proto, full_check=True)\n"
          "    s = ort_session(model)\n"
          "    x = shaped(x, s.get_inputs()[0].shape[1:])\n"
          "    y = s.run(None, {'input': x})[0]\n"
          "    kernels = [onnx.helper.tensor_dtype_to_np_dtype(t.data_type)\n"
          "               for t in proto.graph.initializer if t.name.endswith(weights)]\n"
          "    ops = set(node.op_type for node in proto.graph.node)\n"
          "    if wdtype == 'int8':  # every product in integers, none in float\n"
          "        assert ops & {'MatMulInteger', 'ConvInteger'}, ops\n"
          "        assert not ops & {'Gemm', 'Conv', 'MatMul', 'DequantizeLinear'}, ops\n"
          "kdtype = 'int8' if wdtype == 'full_int8' else wdtype\n"
          "assert kernels and all(np.dtype(d) == np.dtype(kdtype) for d in kernels), kernels\n"
          "np.ascontiguousarray(y, dtype='<f4').tofile(out)\n",
          f);
    fclose(f);
    return buf;
}

/* Runs `model` (fmt "tflite" or "onnx") on the N_SAMPLES float32 samples
   in x_path (or the images of an IDX file); fills y (count floats).
   Returns 1 when the runtime ran and gave count outputs. */
static int run_runtime(const char *fmt, const char *model, const char *x_path, const char *wdtype,
                       float *y, int64_t count) {
    char script[256], out[256], cmd[1400];
    FILE *f;
    long got;
    if (!write_script(script)) return 0;
    path_of(out, "y.bin");
    remove(out);
    snprintf(cmd, sizeof cmd, "'%s' %s %s %s %s %d %s %s", test_python(), script, fmt, model,
             x_path, N_SAMPLES, out, wdtype);
    if (system(cmd) != 0) {
        test__fail(__FILE__, __LINE__, "the runtime failed on %s (%s)", model, cmd);
        return 0;
    }
    f = fopen(out, "rb");
    if (!f) return 0;
    got = (long)fread(y, sizeof(float), (size_t)count + 1, f);
    fclose(f);
    CHECK(got == count, "%s gave %ld outputs, mpt.h %lld", model, got, (long long)count);
    return got == count;
}

static int32_t ids_host[N_SAMPLES * TOKEN_T];

/* mpt.h's outputs for x: (N_SAMPLES, output...) floats into *y (owned
   tensor); for a model of token ids, on ids_host instead. */
static int predict(mpt_model *m, float *x, mpt_tensor *y) {
    static int32_t labels[N_SAMPLES];
    mpt_tensor tx, ty;
    mpt_dataset *data = NULL;
    int64_t shape[MPT_MAX_RANK];
    int rank = mpt_model_input_shape(m, shape), ok;
    if (m->desc.input_dtype == MPT_INT32)
        mpt_tensor_wrap(ctx, &tx, MPT_INT32, 2, (int64_t[]){N_SAMPLES, TOKEN_T}, ids_host);
    else
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){N_SAMPLES, 28, 28, 1}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N_SAMPLES}, labels);
    ok = mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data) == MPT_OK &&
         mpt_dataset_reshape(ctx, data, rank, shape) == MPT_OK &&
         mpt_model_predict(m, data, 16, y) == MPT_OK;
    CHECK(ok, "predict: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(data);
    return ok;
}

static int64_t argmax(const float *v, int64_t n) {
    int64_t i, best = 0;
    for (i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* |got − want| <= tol · max(1, |want|) everywhere, and the same top-1 on
   at least `agree` of the samples (1: all); returns the largest difference. */
static double compare(const char *what, const float *got, const float *want, int64_t count,
                      int64_t per_sample, double tol, double agree) {
    int64_t i, worst = 0, top1_diff = 0;
    double max_diff = 0;
    for (i = 0; i < count; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= max_diff)) max_diff = d, worst = i;
    }
    for (i = 0; i < count / per_sample; i++)
        top1_diff += argmax(got + i * per_sample, per_sample) !=
                     argmax(want + i * per_sample, per_sample);
    CHECK(max_diff <= tol * fmax(1.0, fabs((double)want[worst])),
          "%s: output %lld is %.9g, mpt.h's %.9g (difference %.3g > %.3g)", what,
          (long long)worst, (double)got[worst], (double)want[worst], max_diff, tol);
    CHECK((double)top1_diff <= (1 - agree) * (double)(count / per_sample),
          "%s: top-1 differs from mpt.h's on %lld of %lld samples", what, (long long)top1_diff,
          (long long)(count / per_sample));
    if (agree < 1) /* the trained model's: the numbers the issue asks for */
        printf("# %s: top-1 as mpt.h's on %lld of %lld samples, largest difference %.3g\n", what,
               (long long)(count / per_sample - top1_diff), (long long)(count / per_sample),
               max_diff);
    return max_diff;
}

static long file_size(const char *path) {
    FILE *f = fopen(path, "rb");
    long n;
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fclose(f);
    return n;
}

static float x_host[N_SAMPLES * SAMPLE];

static const char *write_inputs(char *buf) {
    FILE *f;
    int i;
    for (i = 0; i < N_SAMPLES * SAMPLE; i++) x_host[i] = (float)test_uniform(0, 1);
    f = fopen(path_of(buf, "x.bin"), "wb");
    if (!f) return NULL;
    fwrite(x_host, sizeof(float), N_SAMPLES * SAMPLE, f);
    fclose(f);
    return buf;
}

/* Token ids for the token model, every id of the vocabulary among them
   (the first and the last included), into ids_host and the file. */
static const char *write_ids(char *buf) {
    FILE *f;
    int i;
    for (i = 0; i < N_SAMPLES * TOKEN_T; i++)
        ids_host[i] = i < TOKEN_V ? i : (int32_t)test_uniform(0, TOKEN_V - 1e-9);
    f = fopen(path_of(buf, "x.ids"), "wb");
    if (!f) return NULL;
    fwrite(ids_host, sizeof(int32_t), N_SAMPLES * TOKEN_T, f);
    fclose(f);
    return buf;
}

/* One model in both formats, its weights stored as `weights` (float32 or
   float16), run in both runtimes: outputs within tol of mpt.h's (they are
   probabilities in [0, 1], or of that size), top-1 identical. float32
   models have BatchNormalization; float16 ones do not, as the export rounds
   the folded weights, which rounding the model's own ones (what mpt.h
   predicts with here) does not reproduce. A float16 file holds float16
   kernels and, for the MLP, whose weights are most of its files (the
   CNNs' are not), is about half the float32 one's size. */
static void check_float(arch a, mpt_dtype weights, double tol) {
    const int half = weights == MPT_FLOAT16;
    const char *wname = half ? "float16" : "float32";
    char x_path[256], tfl[256], onnx[256], tfl32[256], onnx32[256], name[64], what[64];
    mpt_export_desc desc = {.weight_dtype = weights};
    mpt_model *m;
    mpt_tensor want;
    float *got;
    int64_t count, per_sample;
    test__begin();
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) {
        test__end("export_%s_%s", wname, arch_name(a));
        return;
    }
    test_seed((half ? 200 : 100) + a);
    m = make_model(a, !half);
    CHECK(m != NULL, "build: %s", mpt_context_error(ctx));
    memset(&want, 0, sizeof want);
    if (m && (a == TOKENS || a == ATTENTION ? write_ids(x_path) : write_inputs(x_path))) {
        randomize(m);
        snprintf(name, sizeof name, "%s_%s.tflite", arch_name(a), wname);
        CHECK(mpt_model_export_tflite(m, path_of(tfl, name), &desc) == MPT_OK, "TFLite: %s",
              mpt_context_error(ctx));
        snprintf(name, sizeof name, "%s_%s.onnx", arch_name(a), wname);
        CHECK(mpt_model_export_onnx(m, path_of(onnx, name), &desc) == MPT_OK, "ONNX: %s",
              mpt_context_error(ctx));
        if (half) {
            mpt_model_export_tflite(m, path_of(tfl32, "f32.tflite"), NULL);
            mpt_model_export_onnx(m, path_of(onnx32, "f32.onnx"), NULL);
            CHECK(a != MLP || (file_size(tfl) < 0.55 * file_size(tfl32) &&
                               file_size(onnx) < 0.55 * file_size(onnx32)),
                  "float16 files of %ld and %ld bytes, float32 ones %ld and %ld",
                  file_size(tfl), file_size(onnx), file_size(tfl32), file_size(onnx32));
            round_to_half(m);
        }
        if (predict(m, x_host, &want)) {
            count = mpt_tensor_count(&want);
            per_sample = want.shape[want.rank - 1];
            got = (float *)malloc(sizeof(float) * (size_t)(count + 1));
            snprintf(what, sizeof what, "LiteRT, %s weights", wname);
            if (got && run_runtime("tflite", tfl, x_path, wname, got, count))
                compare(what, got, (const float *)want.data, count, per_sample, tol, 1);
            snprintf(what, sizeof what, "ONNX Runtime, %s weights", wname);
            if (got && run_runtime("onnx", onnx, x_path, wname, got, count))
                compare(what, got, (const float *)want.data, count, per_sample, tol, 1);
            free(got);
        }
    }
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(m);
    test__end("export_%s_%s", wname, arch_name(a));
}

/* ---- a trained model ----------------------------------------------------------------- */

/* Dynamic range in LiteRT: its hybrid FULLY_CONNECTED quantizes each row
   of inputs, and its hybrid CONV_2D each sample, asymmetrically ([min,
   max] onto [−128, 127], as the file asks and as its XNNPACK kernels do
   whatever the file asks), where mpt.h takes [−max|x|, max|x|] onto
   [−127, 127]: each input lands up to half a step of either away, and the
   outputs (probabilities here) differ by up to DYNAMIC_TFLITE_TOL, which
   is 2× the largest difference measured when this was written (0.024 on
   the random-weight models, 0.0096 on the trained Fashion-MNIST MLP). */
#define DYNAMIC_TFLITE_TOL 0.05

/* The trained model quantized to dynamic range, exported, run on the 10,000
   test images (got: room for their outputs). ONNX Runtime computes mpt.h's
   arithmetic (the same int8 inputs and integer sums; one rounding more in
   the float scaling): within 1e-5. LiteRT within DYNAMIC_TFLITE_TOL. Both:
   top-1 mpt.h's on at least 99.5 % of the images (LiteRT's: 9,990 of
   10,000 measured when this was written). bn: the model has
   BatchNormalizations that do not fold, whose scales (up to gamma /
   sqrt(var) of the trained statistics) magnify each difference of an
   input's int8 rounding in the products after them: LiteRT's asymmetric
   inputs (above) then give top-1 mpt.h's on 9,919 of the 10,000 images
   (largest difference 0.0076), and ONNX Runtime, mpt.h's arithmetic but
   for float32 rounding (which at a tie moves an int8 input a step), on
   10,000, largest difference 5.9e-4 (measured when this was written):
   bounds of 99 % and 1.5e-3 for them. */
static void check_trained_dynamic_range(mpt_model *m, mpt_dataset *test, const char *images,
                                        float *got, int bn) {
    const char *fmts[2] = {"tflite", "onnx"};
    const double tols[2] = {DYNAMIC_TFLITE_TOL, bn ? 1.5e-3 : 1e-5};
    const double agree[2] = {bn ? 0.99 : 0.995, 0.995};
    mpt_model *qm = NULL;
    mpt_tensor want;
    char files[2][256], what[64];
    int k;
    memset(&want, 0, sizeof want);
    CHECK(mpt_model_quantize(m, NULL, &qm) == MPT_OK &&
              mpt_model_predict(qm, test, 500, &want) == MPT_OK,
          "dynamic range: %s", mpt_context_error(ctx));
    CHECK(qm && mpt_model_export_tflite(qm, path_of(files[0], "fmnist_dynamic.tflite"), NULL) ==
                    MPT_OK, "TFLite, dynamic range: %s", mpt_context_error(ctx));
    CHECK(qm && mpt_model_export_onnx(qm, path_of(files[1], "fmnist_dynamic.onnx"), NULL) ==
                    MPT_OK, "ONNX, dynamic range: %s", mpt_context_error(ctx));
    for (k = 0; want.data && k < 2; k++) {
        snprintf(what, sizeof what, "%s, dynamic range", fmts[k]);
        if (run_runtime(fmts[k], files[k], images, "int8", got, mpt_tensor_count(&want)))
            compare(what, got, (const float *)want.data, mpt_tensor_count(&want), 10, tols[k],
                    agree[k]);
    }
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(qm);
}

/* An MLP with BatchNormalization trained for one epoch on 12,000
   Fashion-MNIST images under `policy`, exported, run on all 10,000 test
   images: outputs within tol of mpt.h's predict, top-1 mpt.h's on at least
   99.5 % of the images (the issue's bar). */
static void check_trained(mpt_policy policy, double tol, mpt_dataset *train, mpt_dataset *test,
                          const char *images) {
    const char *fmts[2] = {"tflite", "onnx"};
    mpt_model *m = NULL;
    mpt_tensor want;
    char files[2][256], what[64];
    float *got = NULL;
    int64_t count = 0;
    int k;
    memset(&want, 0, sizeof want);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                            .policy = policy, .seed = 3}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 96});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.2f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}, .metrics = MPT_METRIC_ACCURACY});
    if (m && mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 1, .batch_size = 128}) == MPT_OK &&
        mpt_model_predict(m, test, 500, &want) == MPT_OK) {
        count = mpt_tensor_count(&want);
        got = (float *)malloc(sizeof(float) * (size_t)(count + 1));
    }
    CHECK(got != NULL, "fit and predict: %s", mpt_context_error(ctx));
    CHECK(got && mpt_model_export_tflite(m, path_of(files[0], "fmnist.tflite"), NULL) == MPT_OK,
          "TFLite: %s", mpt_context_error(ctx));
    CHECK(got && mpt_model_export_onnx(m, path_of(files[1], "fmnist.onnx"), NULL) == MPT_OK,
          "ONNX: %s", mpt_context_error(ctx));
    for (k = 0; got && k < 2; k++) {
        snprintf(what, sizeof what, "%s, trained under %s", fmts[k], mpt_policy_name(policy));
        if (run_runtime(fmts[k], files[k], images, "float32", got, count))
            compare(what, got, (const float *)want.data, count, 10, tol, 0.995);
    }
    if (got && policy == MPT_POLICY_FLOAT32) check_trained_dynamic_range(m, test, images, got, 0);
    free(got);
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(m);
}

/* Fashion-MNIST's training set into *all and the Python runtimes present:
   1; else the case is skipped (no dataset) or test_python_imports says
   why (a failure where the runtimes are required), and 0. */
static int fashion_mnist_and_runtimes(const char *data_dir, mpt_dataset **all) {
    if (mpt_dataset_load_mnist(ctx, data_dir, 0, all) != MPT_OK) {
        SKIP("no Fashion-MNIST in /usr/share/datasets/fashion-mnist (dataset-fashion-mnist)");
        return 0;
    }
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) {
        mpt_dataset_destroy(*all);
        *all = NULL;
        return 0;
    }
    return 1;
}

/* float32: outputs within 1e-4 (it gives the same top-1 on every image).
   mixed_float16: mpt.h's predict computes in float16 (each rounding of an
   activation or weight copy off by up to 2^-11 ≈ 4.9e-4, relatively), the
   files in float32 from the float32 masters: probabilities within 2e-3,
   four such roundings (4.2e-4 measured when this was written; top-1 the
   same on 9,997 of 10,000 images). */
static void test_fashion_mnist_trained(void) {
    const char *data_dir = "/usr/share/datasets/fashion-mnist";
    mpt_dataset *all = NULL, *head = NULL, *test = NULL;
    char images[256];
    if (!fashion_mnist_and_runtimes(data_dir, &all)) return;
    snprintf(images, sizeof images, "%s/t10k-images-idx3-ubyte.gz", data_dir);
    CHECK(mpt_dataset_load_mnist(ctx, data_dir, 1, &test) == MPT_OK && access(images, R_OK) == 0,
          "test set (%s): %s", images, mpt_context_error(ctx));
    CHECK(mpt_dataset_split(ctx, all, 12000, &head, NULL) == MPT_OK, "split: %s",
          mpt_context_error(ctx));
    if (test && head) {
        check_trained(MPT_POLICY_FLOAT32, 1e-4, head, test, images);
        check_trained(MPT_POLICY_MIXED_FLOAT16, 2e-3, head, test, images);
    }
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(all);
}

/* ---- a trained full-integer model end to end -------------------------------------

   Each quantized operation agrees with LiteRT and ONNX Runtime within one
   step (export_one_op_*); chained through a trained model those steps can
   move the final softmax's input by a few of its own steps, and the
   logits' scale is coarse beside the softmax's fixed 1/256, so an output
   probability may end several of its steps away on a few images. A small
   CNN (Conv2D(16, 3×3, relu) → MaxPooling2D → Flatten → Dense(64, relu) →
   Dense(10, softmax)) trained for one epoch on 12,000 Fashion-MNIST
   images, quantized to full integer (float32 io) on 500 of them, run on
   the 10,000 test images: the same top-1 as mpt.h's predict on at least
   E2E_TOP1 of them, and every output within E2E_STEPS steps of 1/256, in
   both runtimes. Measured when this was written (LiteRT 2.3.0, ONNX
   Runtime 1.32.0), the same in both: top-1 mpt.h's on 9,998 of the 10,000
   images, every output within 7 steps, 328 outputs on 176 images more than
   one step off (the logits' scale was 0.085: a logit one step off moves a
   probability by up to 0.25 · 0.085, 5.5 steps). The bounds leave room for
   another runtime version's rounding: about twice the largest difference,
   ten times the top-1 misses. */
#define E2E_TOP1 0.998
#define E2E_STEPS 16

/* What one runtime gave against mpt.h's: the largest difference in
   steps, the outputs more than one step off and the images they are on,
   and the images whose top-1 class is mpt.h's (ties: or one of mpt.h's
   when its largest output is tied, as runtime_matches counts them). */
static void full_integer_against(const char *what, const float *got, const float *want,
                                 int64_t images, int64_t classes, double step, int ties) {
    int64_t i, c, off_outputs = 0, off_images = 0, top1_same = 0, tied = 0;
    double worst = 0;
    for (i = 0; i < images; i++) {
        int off = 0;
        for (c = 0; c < classes; c++) {
            double d = fabs((double)got[i * classes + c] - (double)want[i * classes + c]) / step;
            worst = fmax(worst, d);
            off_outputs += d > 1.001;
            off |= d > 1.001;
        }
        off_images += off;
        c = argmax(got + i * classes, classes);
        top1_same += c == argmax(want + i * classes, classes);
        tied += c != argmax(want + i * classes, classes) &&
                want[i * classes + c] == want[i * classes + argmax(want + i * classes, classes)];
    }
    printf("# %s: top-1 as mpt.h's on %lld of %lld images (%lld more of mpt.h's tied top "
           "classes); every output within %.0f steps of 1/256 (more than one step on %lld "
           "outputs of %lld images)\n", what, (long long)top1_same, (long long)images,
           (long long)tied, worst, (long long)off_outputs, (long long)off_images);
    if (ties) top1_same += tied;
    CHECK((double)top1_same >= E2E_TOP1 * (double)images,
          "%s: top-1 as mpt.h's on %lld of %lld images", what, (long long)top1_same,
          (long long)images);
    CHECK(worst <= E2E_STEPS + 0.001, "%s: an output %.3g steps from mpt.h's (bound %d)", what,
          worst, E2E_STEPS);
}

/* A float16 model of the trained m: its kernels float16, its unfolded
   BatchNormalizations' constants float32, computed in float32 in both
   runtimes as in mpt.h: within 1e-4, top-1 the same on every image. */
static void check_trained_float16(mpt_model *m, mpt_dataset *test, const char *images,
                                  float *got) {
    const char *fmts[2] = {"tflite", "onnx"};
    mpt_model *qm = NULL;
    mpt_tensor want;
    char files[2][256], what[64];
    int k;
    memset(&want, 0, sizeof want);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FLOAT16}, &qm) ==
                  MPT_OK &&
              mpt_model_predict(qm, test, 500, &want) == MPT_OK &&
              mpt_model_export_tflite(qm, path_of(files[0], "fmnist_bn_f16.tflite"), NULL) ==
                  MPT_OK &&
              mpt_model_export_onnx(qm, path_of(files[1], "fmnist_bn_f16.onnx"), NULL) == MPT_OK,
          "float16: %s", mpt_context_error(ctx));
    for (k = 0; want.data && k < 2; k++) {
        snprintf(what, sizeof what, "%s, float16, trained with BatchNormalization", fmts[k]);
        if (run_runtime(fmts[k], files[k], images, "float16", got, mpt_tensor_count(&want)))
            compare(what, got, (const float *)want.data, mpt_tensor_count(&want), 10, 1e-4, 1);
    }
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(qm);
}

/* The small CNN above trained and quantized to full integer, in both
   runtimes. with_bn: the seed cnn's BatchNormalizations that do not fold,
   one after the Conv2D's ReLU and one after the Dense's (each a MUL by its
   scale and an ADD of its shift, the constants int8 per tensor), under the
   same bounds, a tie among mpt.h's top classes counting as
   runtime_matches counts it: that model is less sure of itself after one
   epoch, and measured when this was written, the same in both runtimes,
   every output within 2 steps, top-1 mpt.h's on 9,980 of the 10,000
   images and one of its tied top classes on 13 more; that model also in
   dynamic range and float16 (check_trained_dynamic_range's and
   check_trained_float16's bounds). */
static void trained_full_integer(mpt_dataset *head, mpt_dataset *calibration, mpt_dataset *test,
                                 const char *images, int with_bn) {
    const char *fmts[2] = {"tflite", "onnx"};
    mpt_model *m = NULL, *qm = NULL;
    mpt_quantized_info info;
    mpt_tensor want;
    char files[2][256], what[96];
    float *got = NULL;
    int k;
    memset(&want, 0, sizeof want);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                            .seed = 5}, &m);
    add_conv(m, 16, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU);
    if (with_bn) add_bn(m);
    mpt_model_add_max_pooling2d(m, NULL);
    mpt_model_add_flatten(m, NULL);
    add_dense(m, 64, MPT_ACT_RELU);
    if (with_bn) add_bn(m);
    add_dense(m, 10, MPT_ACT_SOFTMAX);
    mpt_model_compile(m, &(mpt_compile_desc){
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}, .metrics = MPT_METRIC_ACCURACY});
    CHECK(mpt_model_fit(m, head, &(mpt_fit_desc){.epochs = 1, .batch_size = 128}) == MPT_OK &&
              mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                         .representative_data = calibration},
                                 &qm) == MPT_OK &&
              mpt_model_predict(qm, test, 500, &want) == MPT_OK &&
              mpt_model_quantized_info(qm, &info) == MPT_OK,
          "fit, quantize and predict: %s", mpt_context_error(ctx));
    if (want.data) got = (float *)malloc(sizeof(float) * (size_t)(mpt_tensor_count(&want) + 1));
    CHECK(got && mpt_model_export_tflite(qm, path_of(files[0], with_bn ? "fmnist_bn_int8.tflite"
                                                                       : "fmnist_int8.tflite"),
                                         NULL) == MPT_OK &&
              mpt_model_export_onnx(qm, path_of(files[1], with_bn ? "fmnist_bn_int8.onnx"
                                                                  : "fmnist_int8.onnx"),
                                    NULL) == MPT_OK,
          "export: %s", mpt_context_error(ctx));
    for (k = 0; got && k < 2; k++) {
        snprintf(what, sizeof what, "%s, full integer, trained%s", fmts[k],
                 with_bn ? " with BatchNormalization" : "");
        if (run_runtime(fmts[k], files[k], images, "qint8", got, mpt_tensor_count(&want)))
            full_integer_against(what, got, (const float *)want.data, want.shape[0], 10,
                                 (double)info.output.scale, with_bn);
    }
    if (got && with_bn) {
        check_trained_dynamic_range(m, test, images, got, 1);
        check_trained_float16(m, test, images, got);
    }
    free(got);
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
}

static void test_fashion_mnist_full_integer(void) {
    const char *data_dir = "/usr/share/datasets/fashion-mnist";
    mpt_dataset *all = NULL, *head = NULL, *calibration = NULL, *test = NULL;
    char images[256];
    if (!fashion_mnist_and_runtimes(data_dir, &all)) return;
    snprintf(images, sizeof images, "%s/t10k-images-idx3-ubyte.gz", data_dir);
    CHECK(mpt_dataset_load_mnist(ctx, data_dir, 1, &test) == MPT_OK &&
              mpt_dataset_split(ctx, all, 12000, &head, NULL) == MPT_OK &&
              mpt_dataset_split(ctx, head, 500, &calibration, NULL) == MPT_OK,
          "data: %s", mpt_context_error(ctx));
    if (test && head && calibration) {
        trained_full_integer(head, calibration, test, images, 0);
        trained_full_integer(head, calibration, test, images, 1);
    }
    mpt_dataset_destroy(calibration);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(all);
}

/* ---- TFLite's quantization parameters ------------------------------------------------

   The pieces a quantized export builds on, in a graph made by hand: QUANTIZE
   to int8 per tensor (scale, zero point) and back, then FULLY_CONNECTED
   with int8 weights per output channel (quantized_dimension 0) through
   DEQUANTIZE. LiteRT must read the parameters as written and compute what
   numpy computes from them. */
static void test_tflite_quantization(void) {
    static const float x_scale[1] = {0.05f}, w_scale[3] = {0.01f, 0.02f, 0.5f};
    static const int64_t x_zero[1] = {-3}, w_zero[3] = {0, 0, 0};
    static const int8_t weights[12] = {1, -2, 3, 127, -127, 5, 0, 9, 11, -13, 17, -19};
    static const float bias[3] = {0.25f, -0.5f, 0.125f};
    const mpt__tfl_quant xq = {1, x_scale, x_zero, 0}, wq = {3, w_scale, w_zero, 0};
    mpt_model *m = make_model(MLP_VECTORS, 0); /* lends its context */
    mpt__export_plan pl;
    mpt__tfl g;
    mpt__fb b;
    char p[256], script[256], cmd[1024];
    int64_t v4 = 4, v3 = 3, w_shape[2] = {3, 4};
    int32_t input, xi8, xf, wi8, wf, bf, y;
    unsigned char *w_data = (unsigned char *)mpt__alloc(ctx, 12); /* the graph takes it */
    FILE *f;
    if (!test_python_imports("numpy, ai_edge_litert.interpreter") || !m || !w_data) {
        mpt__free(ctx, w_data);
        mpt_model_destroy(m);
        return;
    }
    memset(&pl, 0, sizeof pl);
    memset(&g, 0, sizeof g);
    memset(&b, 0, sizeof b);
    pl.m = m;
    pl.path = path_of(p, "quantized.tflite");
    pl.weight_dtype = MPT_FLOAT32;
    g.pl = &pl;
    b.ctx = ctx;
    memcpy(w_data, weights, 12);
    mpt__tfl_buffer_add(&g, NULL, 0);
    input = mpt__tfl_tensor_add(&g, "input", "", MPT__TFL_FLOAT32, 1, &v4, 1, 0);
    xi8 = mpt__tfl_tensor_add(&g, "x", "int8", MPT__TFL_INT8, 1, &v4, 1, 0);
    xf = mpt__tfl_tensor_add(&g, "x", "float", MPT__TFL_FLOAT32, 1, &v4, 1, 0);
    wi8 = mpt__tfl_tensor_add(&g, "dense", "kernel", MPT__TFL_INT8, 2, w_shape, 0,
                              mpt__tfl_buffer_add(&g, w_data, 12));
    wf = mpt__tfl_tensor_add(&g, "dense", "kernel_float", MPT__TFL_FLOAT32, 2, w_shape, 0, 0);
    bf = mpt__tfl_constant(&g, "dense", "bias", 1, &v3, bias, 3);
    y = mpt__tfl_tensor_add(&g, "dense", "output", MPT__TFL_FLOAT32, 1, &v3, 1, 0);
    CHECK(!g.failed, "the graph");
    if (!g.failed) {
        g.tensors[xi8].quant = xq;
        g.tensors[wi8].quant = wq;
    }
    mpt__tfl_op_add(&g, MPT__TFL_QUANTIZE, input, 0, 0, 1, xi8);
    mpt__tfl_op_add(&g, MPT__TFL_DEQUANTIZE, xi8, 0, 0, 1, xf);
    mpt__tfl_op_add(&g, MPT__TFL_DEQUANTIZE, wi8, 0, 0, 1, wf);
    mpt__tfl_op_add(&g, MPT__TFL_FULLY_CONNECTED, xf, wf, bf, 3, y);
    CHECK(mpt__tfl_serialise(&g, &input, 1, &y, 1, &b) == MPT_OK &&
              mpt__export_write(m, p, b.data + b.cap - b.size, b.size) == MPT_OK,
          "write: %s", mpt_context_error(ctx));
    f = fopen(path_of(script, "quantized.py"), "w");
    if (f) {
        fputs("import sys, numpy as np\n"
              "from ai_edge_litert.interpreter import Interpreter\n"
              "it = Interpreter(model_path=sys.argv[1])\n"
              "q = {t['name']: t['quantization_parameters'] for t in it.get_tensor_details()}\n"
              "assert np.allclose(q['x/int8']['scales'], [0.05]), q['x/int8']\n"
              "assert list(q['x/int8']['zero_points']) == [-3], q['x/int8']\n"
              "k = q['dense/kernel']\n"
              "assert np.allclose(k['scales'], [0.01, 0.02, 0.5]) and k['quantized_dimension'] == 0, k\n"
              "assert list(k['zero_points']) == [0, 0, 0], k\n"
              "x = np.array([[0.5, -0.2, 0.0371, 6.9], [-7.0, 1.0, 0.26, 0.31]], np.float32)\n"
              "i = it.get_input_details()[0]['index']\n"
              "it.resize_tensor_input(i, list(x.shape))\n"
              "it.allocate_tensors()\n"
              "it.set_tensor(i, x)\n"
              "it.invoke()\n"
              "y = it.get_tensor(it.get_output_details()[0]['index'])\n"
              "xq = np.clip(np.round(x / np.float32(0.05)) - 3, -128, 127)\n"
              "xd = np.float32(0.05) * (xq + 3)\n"
              "w = np.array([1, -2, 3, 127, -127, 5, 0, 9, 11, -13, 17, -19], np.float32)\n"
              "w = w.reshape(3, 4) * np.array([[0.01], [0.02], [0.5]], np.float32)\n"
              "want = xd @ w.T + np.array([0.25, -0.5, 0.125], np.float32)\n"
              "assert np.abs(y - want).max() < 1e-5, (y, want)\n",
              f);
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "'%s' %s %s", test_python(), script, p);
    CHECK(system(cmd) == 0, "LiteRT reads the quantization parameters and computes with them (%s)",
          cmd);
    mpt__free(ctx, b.data);
    mpt__tfl_free(&g);
    mpt_model_destroy(m);
}

/* ONNX's QDQ form likewise: QuantizeLinear and DequantizeLinear of the
   input per tensor (int8, zero point −3), int8 weights dequantized per
   output channel (axis 1 of Gemm's (in, out) B), a float bias; checked by
   onnx.checker and run in ONNX Runtime against numpy. */
static void test_onnx_qdq(void) {
    static const int8_t weights[12] = {1, -2, 3, 127, -127, 5, 0, 9, 11, -13, 17, -19};
    static const float w_scale[3] = {0.01f, 0.02f, 0.5f}, bias[3] = {0.25f, -0.5f, 0.125f};
    mpt_model *m = make_model(MLP_VECTORS, 0); /* lends its context and a layer's name */
    mpt__export_plan pl;
    mpt__onnx o;
    mpt__pb b;
    char p[256], script[256], cmd[1024], bias_name[128];
    int64_t three = 3, w_dims[2] = {4, 3};
    unsigned char *data;
    size_t body;
    float x_scale = 0.05f;
    uint32_t bits;
    int i;
    FILE *f;
    if (!test_python_imports("numpy, onnx, onnxruntime") || !m) {
        mpt_model_destroy(m);
        return;
    }
    memset(&pl, 0, sizeof pl);
    memset(&o, 0, sizeof o);
    memset(&b, 0, sizeof b);
    pl.m = m;
    pl.path = path_of(p, "qdq.onnx");
    pl.weight_dtype = MPT_FLOAT32;
    o.pl = &pl;
    o.nodes.ctx = o.inits.ctx = b.ctx = ctx;
    data = mpt__onnx_initializer(&o, "x_scale", MPT__ONNX_FLOAT, 0, NULL, 4, &body);
    memcpy(&bits, &x_scale, 4);
    if (data) mpt__tb_put_le(data, bits, 4);
    mpt__pb_end(&o.inits, body);
    data = mpt__onnx_initializer(&o, "x_zero", MPT__ONNX_INT8, 0, NULL, 1, &body);
    if (data) data[0] = (unsigned char)(int8_t)-3;
    mpt__pb_end(&o.inits, body);
    data = mpt__onnx_initializer(&o, "w_int8", MPT__ONNX_INT8, 2, w_dims, 12, &body);
    if (data) memcpy(data, weights, 12);
    mpt__pb_end(&o.inits, body);
    data = mpt__onnx_initializer(&o, "w_scale", MPT__ONNX_FLOAT, 1, &three, 12, &body);
    for (i = 0; data && i < 3; i++) {
        memcpy(&bits, &w_scale[i], 4);
        mpt__tb_put_le(data + 4 * i, bits, 4);
    }
    mpt__pb_end(&o.inits, body);
    data = mpt__onnx_initializer(&o, "w_zero", MPT__ONNX_INT8, 1, &three, 3, &body);
    if (data) memset(data, 0, 3);
    mpt__pb_end(&o.inits, body);
    mpt__onnx_constant(&o, &m->layers[1], "bias", 1, &three, bias, 3, bias_name, sizeof bias_name);
    mpt__pb_end(&o.nodes, mpt__onnx_node(&o, "QuantizeLinear", "x_int8", "input", "x_scale",
                                         "x_zero"));
    mpt__pb_end(&o.nodes, mpt__onnx_node(&o, "DequantizeLinear", "x", "x_int8", "x_scale",
                                         "x_zero"));
    body = mpt__onnx_node(&o, "DequantizeLinear", "w", "w_int8", "w_scale", "w_zero");
    mpt__onnx_attr_int(&o.nodes, "axis", 1);
    mpt__pb_end(&o.nodes, body);
    mpt__pb_end(&o.nodes, mpt__onnx_node(&o, "Gemm", "y", "x", "w", bias_name));
    mpt__onnx_model(&o, &(mpt__onnx_port){.name = "input", .elem_type = MPT__ONNX_FLOAT,
                                           .rank = 1, .shape = {4}},
                    1,
                    &(mpt__onnx_port){.name = "output", .value = "y",
                                      .elem_type = MPT__ONNX_FLOAT, .rank = 1, .shape = {3}},
                    1, &b);
    CHECK(!b.failed && mpt__export_write(m, p, b.data, b.size) == MPT_OK, "write: %s",
          mpt_context_error(ctx));
    f = fopen(path_of(script, "qdq.py"), "w");
    if (f) {
        fputs("import sys, numpy as np, onnx, onnxruntime as ort\n"
              "onnx.checker.check_model(onnx.load(sys.argv[1]), full_check=True)\n"
              "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
              "x = np.array([[0.5, -0.2, 0.0371, 6.9], [-7.0, 1.0, 0.26, 0.31]], np.float32)\n"
              "y = s.run(None, {'input': x})[0]\n"
              "xq = np.clip(np.round(x / np.float32(0.05)) - 3, -128, 127)\n"
              "xd = np.float32(0.05) * (xq + 3)\n"
              "w = np.array([1, -2, 3, 127, -127, 5, 0, 9, 11, -13, 17, -19], np.float32)\n"
              "w = w.reshape(4, 3) * np.array([0.01, 0.02, 0.5], np.float32)\n"
              "want = xd @ w + np.array([0.25, -0.5, 0.125], np.float32)\n"
              "assert np.abs(y - want).max() < 1e-5, (y, want)\n",
              f);
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "'%s' %s %s", test_python(), script, p);
    CHECK(system(cmd) == 0, "ONNX Runtime runs the QDQ graph as numpy computes it (%s)", cmd);
    mpt__free(ctx, b.data);
    mpt__free(ctx, o.nodes.data);
    mpt__free(ctx, o.inits.data);
    mpt_model_destroy(m);
}

/* ---- what must fail, leaving nothing behind ----------------------------------------- */

/* The names in dir, into buf, each followed by a space; "(too many)" at
   the end when they do not fit. */
static void list_dir(const char *d, char *buf, size_t size) {
    DIR *dd = opendir(d);
    struct dirent *e;
    size_t used = 0, n;
    buf[0] = 0;
    while (dd && (e = readdir(dd)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        n = strlen(e->d_name);
        if (used + n + 2 + sizeof "(too many)" > size) {
            strcpy(buf + used, "(too many)");
            break;
        }
        memcpy(buf + used, e->d_name, n);
        buf[used + n] = ' ';
        used += n + 1;
        buf[used] = 0;
    }
    if (dd) closedir(dd);
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

typedef mpt_status (*export_fn)(mpt_model *, const char *, const mpt_export_desc *);

/* A layer the export has no counterpart for (one of a kind this file does
   not know, as a layer added to mpt.h later would be): MPT_ERR_UNSUPPORTED,
   naming the layer and the file, and no file. */
static void test_unsupported_layer(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    export_fn fns[2] = {mpt_model_export_tflite, mpt_model_export_onnx};
    const char *names[2] = {"mystery.tflite", "mystery.onnx"};
    mpt__layer_ops mystery;
    const mpt__layer_ops *real;
    char p[256];
    int k;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    mpt_model_add_activation(m, &(mpt_activation_desc){.name = "odd", .activation = MPT_ACT_TANH});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
    real = m->layers[2].ops;
    mystery = *real;
    mystery.class_name = "Mystery";
    mystery.kind = MPT__LAYER_KINDS; /* past every kind mpt.h knows */
    m->layers[2].ops = &mystery;
    for (k = 0; k < 2; k++) {
        mpt_status s = fns[k](m, path_of(p, names[k]), NULL);
        CHECK(s == MPT_ERR_UNSUPPORTED, "%s: status %d", names[k], (int)s);
        CHECK(strstr(mpt_context_error(q), "'odd' (Mystery)") && strstr(mpt_context_error(q), p),
              "the message names the layer and the file: %s", mpt_context_error(q));
        CHECK(!exists(p), "%s was written", p);
    }
    m->layers[2].ops = real;
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* The token model, the attention model, and ids through an Embedding in
   a chain quantize in dynamic range and float16 (@quantize: the
   embeddings, LayerNormalization and the attention float32, every product
   quantized), their predictions near the float model's; the files have no
   form for them yet: both exports refuse the quantized model naming its
   Embedding's GATHER, and write nothing. Full integer and
   quantization-aware training refuse them, naming the Embedding. The
   float export still takes them. */
static void test_tokens_quantized(void) {
    static const mpt_quantize_mode modes[3] = {MPT_QUANTIZE_DYNAMIC_RANGE, MPT_QUANTIZE_FLOAT16,
                                               MPT_QUANTIZE_FULL_INTEGER};
    static const double bound[2] = {0.05, 0.01}; /* dynamic, float16: probabilities */
    mpt_context *q = quiet_ctx();
    mpt_dataset *data = NULL;
    mpt_tensor tx;
    char p[256];
    int chain, k;
    int64_t i;
    test_seed(1085);
    for (i = 0; i < N_SAMPLES * TOKEN_T; i++) ids_host[i] = test_randint(0, TOKEN_V - 1);
    mpt_tensor_wrap(q, &tx, MPT_INT32, 2, (int64_t[]){N_SAMPLES, TOKEN_T}, ids_host);
    CHECK(mpt_dataset_create(q, &(mpt_dataset_desc){.x = &tx}, &data) == MPT_OK, "dataset: %s",
          mpt_context_error(q));
    for (chain = 0; chain < 3; chain++) {
        mpt_model *m = NULL, *qm = NULL;
        mpt_tensor want;
        CHECK(mpt_model_create(q,
                               &(mpt_model_desc){.input_shape = {TOKEN_T},
                                                 .input_rank = 1,
                                                 .input_dtype = MPT_INT32},
                               &m) == MPT_OK,
              "create: %s", mpt_context_error(q));
        if (chain == 1) {
            mpt_model_add_embedding(
                m, &(mpt_embedding_desc){.name = "tokens", .input_dim = TOKEN_V, .output_dim = 4});
            mpt_model_add_flatten(m, NULL);
            add_dense(m, 5, MPT_ACT_SOFTMAX);
        } else if (chain == 2) {
            add_attention(m);
        } else {
            add_tokens(m);
        }
        CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
        randomize(m); /* weights of its own: quantize refuses initial ones first */
        CHECK(mpt_model_predict(m, data, 0, &want) == MPT_OK, "predict: %s", mpt_context_error(q));
        for (k = 0; k < 3; k++) {
            mpt_status s = mpt_model_quantize(
                m, &(mpt_quantize_desc){.mode = modes[k], .representative_data = data}, &qm);
            if (modes[k] == MPT_QUANTIZE_FULL_INTEGER) {
                CHECK(s == MPT_ERR_UNSUPPORTED && !qm, "full integer: status %d: %s", (int)s,
                      mpt_context_error(q));
                CHECK(strstr(mpt_context_error(q), chain == 1 ? "'tokens' (Embedding) has no "
                                                               "full-integer form"
                                                             : "(Embedding) has no full-integer"),
                      "the message names the layer: %s", mpt_context_error(q));
            } else {
                mpt_tensor got;
                double worst = 0;
                FILE *f;
                CHECK(s == MPT_OK && qm, "chain %d mode %d: %s", chain, (int)modes[k],
                      mpt_context_error(q));
                CHECK(qm && mpt_model_predict(qm, data, 0, &got) == MPT_OK, "predict: %s",
                      mpt_context_error(q));
                for (i = 0; qm && i < mpt_tensor_count(&want); i++)
                    worst = fmax(worst, fabs(((float *)want.data)[i] - ((float *)got.data)[i]));
                CHECK(worst <= bound[k], "chain %d mode %d: predictions differ by %g (bound %g)",
                      chain, (int)modes[k], worst, bound[k]);
                if (qm) mpt_tensor_free(q, &got);
                test_expect_error(q, mpt_model_export_onnx(qm, path_of(p, "refused_q.onnx"), NULL),
                                  MPT_ERR_UNSUPPORTED, "(GATHER) has no form", "export onnx");
                test_expect_error(q, mpt_model_export_tflite(qm, path_of(p, "refused_q.tflite"),
                                                             NULL),
                                  MPT_ERR_UNSUPPORTED, "(GATHER) has no form", "export tflite");
                f = fopen(path_of(p, "refused_q.onnx"), "rb");
                CHECK(!f, "a refused onnx export left a file");
                if (f) fclose(f);
                f = fopen(path_of(p, "refused_q.tflite"), "rb");
                CHECK(!f, "a refused tflite export left a file");
                if (f) fclose(f);
            }
            mpt_model_destroy(qm);
            qm = NULL;
        }
        mpt_tensor_free(q, &want);
        CHECK(mpt_model_quantize_aware(m, NULL) != MPT_OK, "quantization-aware training took it");
        CHECK(mpt_model_export_onnx(m, path_of(p, "refused_quantized.onnx"), NULL) == MPT_OK &&
                  mpt_model_export_tflite(m, path_of(p, "refused_quantized.tflite"), NULL) ==
                      MPT_OK,
              "the float export: %s", mpt_context_error(q));
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

/* PositionEmbedding's rows go to the files as a (T, D) constant, without
   the batch: read by a layer that does not broadcast it over the batch (a
   LayerNormalization), or as the model's output, it is refused, naming it
   (and the reader), and nothing is written. */
static void test_positions_unbatched(void) {
    export_fn fns[2] = {mpt_model_export_tflite, mpt_model_export_onnx};
    const char *names[2] = {"positions.tflite", "positions.onnx"};
    mpt_context *q = quiet_ctx();
    int output, k;
    for (output = 0; output < 2; output++) {
        mpt_model *m = NULL;
        mpt_node in[2];
        mpt_model_create(
            q,
            &(mpt_model_desc){.input_shape = {TOKEN_T}, .input_rank = 1, .input_dtype = MPT_INT32},
            &m);
        in[0] = mpt_embedding(m, mpt_model_input(m),
                              &(mpt_embedding_desc){.input_dim = TOKEN_V, .output_dim = 4});
        in[1] = mpt_position_embedding(
            m, in[0], &(mpt_position_embedding_desc){.name = "pos", .sequence_length = TOKEN_T});
        if (!output) {
            in[1] =
                mpt_layer_normalization(m, in[1], &(mpt_layer_normalization_desc){.name = "norm"});
            mpt_add(m, 2, in, NULL);
        }
        CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(q));
        for (k = 0; k < 2; k++) {
            char p[256];
            mpt_status s = fns[k](m, path_of(p, names[k]), NULL);
            const char *e = mpt_context_error(q);
            CHECK(s == MPT_ERR_UNSUPPORTED, "%s: status %d", names[k], (int)s);
            CHECK(strstr(e, "'pos' (PositionEmbedding)") &&
                      (output ? strstr(e, "the model's output") != NULL
                              : strstr(e, "'norm' (LayerNormalization)") != NULL),
                  "the message names the layers: %s", e);
            CHECK(!exists(p), "%s was written", p);
        }
        mpt_model_destroy(m);
    }
    mpt_context_destroy(q);
}

/* ---- several inputs and outputs -------------------------------------------------------- */

#define MULTI_VEC 5
#define MULTI_OUT (10 + 1 + 16) /* a sample's values over the three outputs */

/* Keras' two-branch model: the image ("input") through Conv2D, a
   BatchNormalization folded into it, ReLU and pooling; a vector
   ("vector") through a Dense; concatenated into a Dense "trunk" that is
   itself an output beside the two heads it feeds ("cls" and "reg"). */
static mpt_model *multi_io_model(void) {
    mpt_model *m = NULL;
    mpt_node img, vec, both[2], trunk;
    if (mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                                .seed = 3}, &m) != MPT_OK)
        return NULL;
    img = mpt_model_input(m);
    vec = mpt_model_add_input(m, &(mpt_input_desc){.shape = {MULTI_VEC}, .rank = 1,
                                                   .name = "vector"});
    both[0] = mpt_conv2d(m, img, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3}});
    both[0] = mpt_batch_normalization(m, both[0], NULL);
    both[0] = mpt_activation_layer(m, both[0], &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    both[0] = mpt_max_pooling2d(m, both[0], &(mpt_pool2d_desc){.pool_size = {2, 2}});
    both[0] = mpt_flatten(m, both[0], NULL);
    both[1] = mpt_dense(m, vec, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    trunk = mpt_dense(m, mpt_concatenate(m, 2, both, NULL),
                      &(mpt_dense_desc){.name = "trunk", .units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){
                                              .name = "cls", .units = 10,
                                              .activation = MPT_ACT_SOFTMAX}));
    mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){.name = "reg", .units = 1}));
    mpt_model_add_output(m, trunk);
    if (mpt_model_compile(m, &(mpt_compile_desc){
            .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                       {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
                       {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}}) != MPT_OK ||
        mpt_model_build(m, 16) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Runs the two-input file in its runtime, feeding each input by its name,
   and writes the outputs one after another (in the file's order: ONNX
   Runtime's must be named cls, reg, trunk). */
static const char *write_multi_script(char *buf) {
    FILE *f = fopen(path_of(buf, "run_multi.py"), "w");
    if (!f) return NULL;
    fputs("import sys, numpy as np\n" TEST_ORT_SESSION_PY
          "fmt, model, n, xin, vin, out = sys.argv[1:7]\n"
          "dt = sys.argv[7] if len(sys.argv) > 7 else '<f4'  # uint8: the io codes\n"
          "n = int(n)\n"
          "feeds = {'input': np.fromfile(xin, dtype=dt).reshape(n, 28, 28, 1),\n"
          "         'vector': np.fromfile(vin, dtype=dt).reshape(n, -1)}\n"
          "if fmt == 'tflite':\n"
          "    from ai_edge_litert.interpreter import Interpreter\n"
          "    it = Interpreter(model_path=model)\n"
          "    ins = it.get_input_details()\n"
          "    assert sorted(d['name'] for d in ins) == ['input', 'vector'], ins\n"
          "    for d in ins:\n"
          "        it.resize_tensor_input(d['index'], list(feeds[d['name']].shape))\n"
          "    it.allocate_tensors()\n"
          "    for d in ins:\n"
          "        it.set_tensor(d['index'], feeds[d['name']])\n"
          "    it.invoke()\n"
          "    ys = [it.get_tensor(d['index']) for d in it.get_output_details()]\n"
          "else:\n"
          "    import onnx, onnxruntime as ort\n"
          "    onnx.checker.check_model(onnx.load(model), full_check=True)\n"
          "    s = ort_session(model)\n"
          "    names = [o.name for o in s.get_outputs()]\n"
          "    assert names == ['cls', 'reg', 'trunk'], names\n"
          "    ys = s.run(None, feeds)\n"
          "assert len(ys) == 3, len(ys)\n"
          "y = np.concatenate([np.ascontiguousarray(y, dtype='<f4').reshape(n, -1) for y in ys], 1)\n"
          "y.tofile(out)\n",
          f);
    fclose(f);
    return buf;
}

/* multi_io_model with random weights (seed), its N_SAMPLES images in x
   (uniform in [0, 1)) and vectors in v (in [-1, 1)) wrapped by tx and tv,
   and a dataset of both in *data (NULL if it could not be made); NULL
   when the model could not be made. */
static mpt_model *multi_io_with_inputs(unsigned seed, float *x, float *v, mpt_tensor *tx,
                                       mpt_tensor *tv, mpt_dataset **data) {
    const mpt_tensor *inputs[2] = {tx, tv};
    mpt_model *m;
    int i;
    test_seed(seed);
    m = multi_io_model();
    CHECK(m != NULL, "model: %s", mpt_context_error(ctx));
    if (!m) return NULL;
    randomize(m);
    for (i = 0; i < N_SAMPLES * SAMPLE; i++) x[i] = (float)test_uniform(0, 1);
    for (i = 0; i < N_SAMPLES * MULTI_VEC; i++) v[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, tx, MPT_FLOAT32, 4, (int64_t[]){N_SAMPLES, 28, 28, 1}, x);
    mpt_tensor_wrap(ctx, tv, MPT_FLOAT32, 2, (int64_t[]){N_SAMPLES, MULTI_VEC}, v);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = inputs, .input_count = 2},
                             data) == MPT_OK, "dataset: %s", mpt_context_error(ctx));
    return m;
}

/* A model of two inputs and three outputs (one of them read by the other
   two), exported to both formats with float32 and float16 weights: each
   runtime's outputs, fed by input name, are predict_outputs' within
   1e-4 with float32 weights; with float16 ones within 1e-2 (the file's
   kernels, the BatchNormalization folded into the Conv2D's among them,
   are rounded to float16, 2^-11 relative each, where mpt.h predicts with
   the float32 ones; check_float holds float16 files to 1e-4 on models
   without a fold). Inputs or outputs wired to the wrong tensors differ
   by far more. */
static void test_several_inputs_and_outputs(void) {
    static float x[N_SAMPLES * SAMPLE], v[N_SAMPLES * MULTI_VEC], want[N_SAMPLES * MULTI_OUT],
        got[N_SAMPLES * MULTI_OUT + 1];
    static const char *const fmts[2] = {"tflite", "onnx"};
    mpt_model *m;
    mpt_tensor tx, tv, outs[3];
    mpt_dataset *data = NULL;
    char script[256], x_path[256], v_path[256], y_path[256], file[256], cmd[1600], name[64];
    int i, k, w, widths[3] = {10, 1, 16};
    FILE *f;
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) return;
    m = multi_io_with_inputs(77, x, v, &tx, &tv, &data);
    if (!m) return;
    memset(outs, 0, sizeof outs);
    CHECK(data && mpt_model_predict_outputs(m, data, 16, 3, outs) == MPT_OK, "predict: %s",
          mpt_context_error(ctx));
    for (i = 0; i < N_SAMPLES; i++) /* a sample's outputs side by side, as the script writes */
        for (k = 0, w = 0; k < 3; w += widths[k], k++)
            if (outs[k].data)
                memcpy(want + i * MULTI_OUT + w, (const float *)outs[k].data + i * widths[k],
                       sizeof(float) * (size_t)widths[k]);
    f = fopen(path_of(x_path, "multi_x.bin"), "wb");
    if (f) fwrite(x, sizeof(float), N_SAMPLES * SAMPLE, f), fclose(f);
    f = fopen(path_of(v_path, "multi_v.bin"), "wb");
    if (f) fwrite(v, sizeof(float), N_SAMPLES * MULTI_VEC, f), fclose(f);
    write_multi_script(script);
    for (w = 0; w < 2; w++) {
        mpt_export_desc desc = {.weight_dtype = w ? MPT_FLOAT16 : MPT_FLOAT32};
        for (k = 0; k < 2; k++) {
            long n = 0;
            snprintf(name, sizeof name, "multi_%s.%s", w ? "f16" : "f32", fmts[k]);
            CHECK((k ? mpt_model_export_onnx(m, path_of(file, name), &desc)
                     : mpt_model_export_tflite(m, path_of(file, name), &desc)) == MPT_OK,
                  "export %s: %s", name, mpt_context_error(ctx));
            remove(path_of(y_path, "multi_y.bin"));
            snprintf(cmd, sizeof cmd, "'%s' %s %s %s %d %s %s %s", test_python(), script, fmts[k],
                     file, N_SAMPLES, x_path, v_path, y_path);
            CHECK(system(cmd) == 0, "the runtime failed on %s (%s)", name, cmd);
            f = fopen(y_path, "rb");
            if (f) n = (long)fread(got, sizeof(float), N_SAMPLES * MULTI_OUT + 1, f), fclose(f);
            CHECK(n == N_SAMPLES * MULTI_OUT, "%s gave %ld values, mpt.h %d", name, n,
                  N_SAMPLES * MULTI_OUT);
            if (n == N_SAMPLES * MULTI_OUT)
                compare(name, got, want, n, MULTI_OUT, w ? 1e-2 : 1e-4, 1);
        }
    }
    for (k = 0; k < 3; k++) mpt_tensor_free(ctx, &outs[k]);
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
}

/* Runs file (format fmt: "tflite" or "onnx") in its runtime through
   write_multi_script on the inputs at x_path and v_path (float32, or
   with dtype "uint8" the io codes): the N_SAMPLES samples' three outputs
   side by side (codes as floats) into got; 1 when it gave them all. */
static int multi_run(const char *fmt, const char *file, const char *x_path, const char *v_path,
                     const char *dtype, float *got) {
    char script[256], y_path[256], cmd[1600];
    long n = 0;
    FILE *f;
    write_multi_script(script);
    remove(path_of(y_path, "multi_y.bin"));
    snprintf(cmd, sizeof cmd, "'%s' %s %s %s %d %s %s %s %s", test_python(), script, fmt, file,
             N_SAMPLES, x_path, v_path, y_path, dtype);
    CHECK(system(cmd) == 0, "the runtime failed on %s (%s)", file, cmd);
    f = fopen(y_path, "rb");
    if (f) n = (long)fread(got, sizeof(float), N_SAMPLES * MULTI_OUT + 1, f), fclose(f);
    CHECK(n == N_SAMPLES * MULTI_OUT, "%s gave %ld values, mpt.h %d", file, n,
          N_SAMPLES * MULTI_OUT);
    return n == N_SAMPLES * MULTI_OUT;
}

/* A full-integer file's outputs (got) against mpt.h's (want), in steps of
   each output's own scale (scales[k]; widths[k] values a sample): within
   `within` steps on >= 99 % of the values and top-1 of cls the same on
   every sample, as runtime_matches holds a whole model. */
static void multi_steps(const char *name, const float *got, const float *want,
                        const float *scales, const int *widths, double within) {
    int64_t i, close = 0, top1_same = 0;
    double worst = 0;
    int k, c, w;
    for (i = 0; i < N_SAMPLES; i++) {
        for (k = 0, w = 0; k < 3; w += widths[k], k++)
            for (c = 0; c < widths[k]; c++) {
                const int64_t at = i * MULTI_OUT + w + c;
                const double d = fabs((double)got[at] - (double)want[at]) / scales[k];
                close += d <= within;
                worst = fmax(worst, d);
            }
        top1_same += want[i * MULTI_OUT + argmax(got + i * MULTI_OUT, widths[0])] ==
                     want[i * MULTI_OUT + argmax(want + i * MULTI_OUT, widths[0])];
    }
    printf("# %s: within %g steps of mpt.h on %lld of %d values (largest %.3g steps), top-1 "
           "the same on %lld of %d samples\n", name, within, (long long)close,
           N_SAMPLES * MULTI_OUT, worst, (long long)top1_same, N_SAMPLES);
    CHECK(close >= 0.99 * N_SAMPLES * MULTI_OUT, "%s: %lld of %d values within %g steps", name,
          (long long)close, N_SAMPLES * MULTI_OUT, within);
    CHECK(top1_same == N_SAMPLES, "%s: top-1 the same on %lld of %d samples", name,
          (long long)top1_same, N_SAMPLES);
}

/* A dynamic-range file's outputs (got) against mpt.h's (want): each
   output's largest difference within tol of its largest magnitude (at
   least 1; cls holds probabilities, reg and trunk values of several
   units), top-1 of cls the same on 95 % of the samples. */
static void multi_relative(const char *name, const float *got, const float *want,
                           const int *widths, double tol) {
    int64_t i, top1_same = 0;
    int k, c, w;
    for (k = 0, w = 0; k < 3; w += widths[k], k++) {
        double largest = 1, worst = 0;
        for (i = 0; i < N_SAMPLES; i++)
            for (c = 0; c < widths[k]; c++) {
                const int64_t at = i * MULTI_OUT + w + c;
                largest = fmax(largest, fabs((double)want[at]));
                worst = fmax(worst, fabs((double)got[at] - (double)want[at]));
            }
        printf("# %s: output %d within %.3g of mpt.h (%.3g of its largest, %.3g)\n", name, k,
               worst, worst / largest, largest);
        CHECK(worst <= tol * largest, "%s: output %d differs by %g, %g of its largest %g", name,
              k, worst, worst / largest, largest);
    }
    for (i = 0; i < N_SAMPLES; i++)
        top1_same += argmax(got + i * MULTI_OUT, widths[0]) ==
                     argmax(want + i * MULTI_OUT, widths[0]);
    CHECK(top1_same >= 0.95 * N_SAMPLES, "%s: top-1 the same on %lld of %d samples", name,
          (long long)top1_same, N_SAMPLES);
}

/* The same model of two inputs and three outputs quantized in each mode
   (full integer calibrated on the samples, float32 io): each runtime's
   outputs, fed by input name and in the model's output order, are the
   quantized model's predict_outputs as check_quantized_float holds float16
   and dynamic-range files (float16 within 1e-4 in both; dynamic range in
   ONNX Runtime within 1e-5, in LiteRT, which quantizes each input row
   its own way, within DYNAMIC_TFLITE_TOL with top-1 the same on 95 %), and
   full integer as runtime_matches holds a whole model, in steps of each
   output's own scale (LiteRT within one, ONNX Runtime within two). */
static void test_several_inputs_and_outputs_quantized(void) {
    static float x[N_SAMPLES * SAMPLE], v[N_SAMPLES * MULTI_VEC], want[N_SAMPLES * MULTI_OUT],
        got[N_SAMPLES * MULTI_OUT + 1];
    static const char *const fmts[2] = {"tflite", "onnx"};
    static const char *const modes[3] = {"dynamic_range", "full_integer", "float16"};
    const int widths[3] = {10, 1, 16};
    mpt_model *m;
    mpt_tensor tx, tv, outs[3];
    mpt_dataset *data = NULL;
    char x_path[256], v_path[256], file[256], name[64];
    int i, k, w, mode;
    FILE *f;
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) return;
    m = multi_io_with_inputs(78, x, v, &tx, &tv, &data);
    if (!m) return;
    f = fopen(path_of(x_path, "multi_x.bin"), "wb");
    if (f) fwrite(x, sizeof(float), N_SAMPLES * SAMPLE, f), fclose(f);
    f = fopen(path_of(v_path, "multi_v.bin"), "wb");
    if (f) fwrite(v, sizeof(float), N_SAMPLES * MULTI_VEC, f), fclose(f);
    for (mode = 0; data && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *qm = NULL;
        mpt_quantized_info info;
        float scales[3] = {0};
        memset(outs, 0, sizeof outs);
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = (mpt_quantize_mode)mode,
                                                         .representative_data = data},
                                 &qm) == MPT_OK &&
                  mpt_model_predict_outputs(qm, data, 16, 3, outs) == MPT_OK &&
                  mpt_model_quantized_info(qm, &info) == MPT_OK,
              "%s: %s", modes[mode], mpt_context_error(ctx));
        for (k = 0; k < 3; k++) scales[k] = info.outputs[k].scale;
        for (i = 0; outs[2].data && i < N_SAMPLES; i++)
            for (k = 0, w = 0; k < 3; w += widths[k], k++)
                memcpy(want + i * MULTI_OUT + w, (const float *)outs[k].data + i * widths[k],
                       sizeof(float) * (size_t)widths[k]);
        for (k = 0; qm && outs[2].data && k < 2; k++) {
            snprintf(name, sizeof name, "multi_%s.%s", modes[mode], fmts[k]);
            CHECK((k ? mpt_model_export_onnx(qm, path_of(file, name), NULL)
                     : mpt_model_export_tflite(qm, path_of(file, name), NULL)) == MPT_OK,
                  "export %s: %s", name, mpt_context_error(ctx));
            if (!multi_run(fmts[k], file, x_path, v_path, "float32", got)) continue;
            if (mode == MPT_QUANTIZE_FULL_INTEGER)
                multi_steps(name, got, want, scales, widths, k ? 2.001 : 1.001);
            else if (mode == MPT_QUANTIZE_FLOAT16)
                compare(name, got, want, N_SAMPLES * MULTI_OUT, MULTI_OUT, 1e-4, 1);
            else if (k)
                compare(name, got, want, N_SAMPLES * MULTI_OUT, MULTI_OUT, 1e-5, 1);
            else
                multi_relative(name, got, want, widths, DYNAMIC_TFLITE_TOL);
        }
        for (k = 0; k < 3; k++) mpt_tensor_free(ctx, &outs[k]);
        mpt_model_destroy(qm);
    }
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
}

/* Values x (n of them) as the uint8 codes of io parameters p (the int8
   ones' zero point + 128: mpt_quantized_info), into codes; back to the
   reals they stand for into x, which the model then quantizes to the
   same codes. */
static void multi_codes(float *x, int64_t n, const mpt_quant_params *p, uint8_t *codes) {
    mpt_quant_params p8 = *p;
    int64_t i;
    p8.zero_point -= 128;
    for (i = 0; i < n; i++) {
        codes[i] = (uint8_t)(mpt__q_quantize(x[i], &p8) + 128);
        x[i] = (float)(codes[i] - p->zero_point) * p->scale;
    }
}

/* The model of two inputs and three outputs quantized to full integer with
   uint8 io (TFLite's inference_input_type and inference_output_type):
   each file takes each input's codes at its own scale and zero point and
   gives each output's at its own, within one code of mpt.h's (LiteRT) or
   two (ONNX Runtime) on 99 % of the values, top-1 the same. */
static void test_several_inputs_and_outputs_uint8_io(void) {
    static float x[N_SAMPLES * SAMPLE], v[N_SAMPLES * MULTI_VEC], want[N_SAMPLES * MULTI_OUT],
        got[N_SAMPLES * MULTI_OUT + 1];
    static uint8_t xc[N_SAMPLES * SAMPLE], vc[N_SAMPLES * MULTI_VEC];
    static const char *const fmts[2] = {"tflite", "onnx"};
    const int widths[3] = {10, 1, 16};
    const float ones[3] = {1, 1, 1};
    mpt_model *m, *qm = NULL;
    mpt_tensor tx, tv, outs[3];
    const mpt_tensor *inputs[2] = {&tx, &tv};
    mpt_dataset *data = NULL;
    mpt_quantized_info info;
    char x_path[256], v_path[256], file[256], name[64];
    int i, k, w;
    FILE *f;
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) return;
    test_seed(79);
    m = multi_io_model();
    CHECK(m != NULL, "model: %s", mpt_context_error(ctx));
    if (!m) return;
    randomize(m);
    memset(outs, 0, sizeof outs);
    for (i = 0; i < N_SAMPLES * SAMPLE; i++) x[i] = (float)test_uniform(0, 1);
    for (i = 0; i < N_SAMPLES * MULTI_VEC; i++) v[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){N_SAMPLES, 28, 28, 1}, x);
    mpt_tensor_wrap(ctx, &tv, MPT_FLOAT32, 2, (int64_t[]){N_SAMPLES, MULTI_VEC}, v);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = inputs, .input_count = 2,
                                                      .copy = 1}, &data) == MPT_OK &&
              mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                         .representative_data = data,
                                                         .io_dtype = MPT_UINT8}, &qm) == MPT_OK &&
              mpt_model_quantized_info(qm, &info) == MPT_OK,
          "quantize: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(data);
    data = NULL;
    if (!qm) goto done;
    multi_codes(x, N_SAMPLES * SAMPLE, &info.inputs[0], xc);
    multi_codes(v, N_SAMPLES * MULTI_VEC, &info.inputs[1], vc);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = inputs, .input_count = 2},
                             &data) == MPT_OK &&
              mpt_model_predict_outputs(qm, data, 16, 3, outs) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    for (i = 0; outs[2].data && i < N_SAMPLES; i++) /* each output in its codes */
        for (k = 0, w = 0; k < 3; w += widths[k], k++) {
            mpt_quant_params p8 = info.outputs[k];
            int c;
            p8.zero_point -= 128;
            for (c = 0; c < widths[k]; c++)
                want[i * MULTI_OUT + w + c] = (float)(mpt__q_quantize(
                    ((const float *)outs[k].data)[i * widths[k] + c], &p8) + 128);
        }
    f = fopen(path_of(x_path, "multi_xc.bin"), "wb");
    if (f) fwrite(xc, 1, sizeof xc, f), fclose(f);
    f = fopen(path_of(v_path, "multi_vc.bin"), "wb");
    if (f) fwrite(vc, 1, sizeof vc, f), fclose(f);
    for (k = 0; outs[2].data && k < 2; k++) {
        snprintf(name, sizeof name, "multi_uint8_io.%s", fmts[k]);
        CHECK((k ? mpt_model_export_onnx(qm, path_of(file, name), NULL)
                 : mpt_model_export_tflite(qm, path_of(file, name), NULL)) == MPT_OK,
              "export %s: %s", name, mpt_context_error(ctx));
        if (multi_run(fmts[k], file, x_path, v_path, "uint8", got))
            multi_steps(name, got, want, ones, widths, k ? 2.001 : 1.001);
    }
done:
    for (k = 0; k < 3; k++) mpt_tensor_free(ctx, &outs[k]);
    mpt_dataset_destroy(data);
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
}

static void test_unbuilt_model(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    char p[256];
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3}, &m);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_export_tflite(m, path_of(p, "unbuilt.tflite"), NULL) == MPT_ERR_STATE &&
              strstr(mpt_context_error(q), "not built") && !exists(p),
          "TFLite: %s", mpt_context_error(q));
    CHECK(mpt_model_export_onnx(m, path_of(p, "unbuilt.onnx"), NULL) == MPT_ERR_STATE &&
              strstr(mpt_context_error(q), "not built") && !exists(p),
          "ONNX: %s", mpt_context_error(q));
    CHECK(mpt_model_export_onnx(m, NULL, NULL) == MPT_ERR_INVALID_ARGUMENT, "a NULL path");
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build");
    CHECK(mpt_model_export_onnx(m, path_of(p, "int8.onnx"),
                                &(mpt_export_desc){.weight_dtype = MPT_INT8}) ==
                  MPT_ERR_INVALID_ARGUMENT &&
              strstr(mpt_context_error(q), "weight_dtype int8") && !exists(p),
          "weight_dtype int8: %s", mpt_context_error(q));
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* A quantized model's weights are stored as its quantization made them:
   weight_dtype 99, int8, or float32 for an int8 one, is refused, naming
   the value, and nothing is written (both were ignored); the default
   exports, and so does float16 for a float16 model. */
static void test_quantized_weight_dtype(void) {
    static const mpt_quantize_mode modes[2] = {MPT_QUANTIZE_DYNAMIC_RANGE, MPT_QUANTIZE_FLOAT16};
    const mpt_dtype bad[3] = {(mpt_dtype)99, MPT_INT8, MPT_FLOAT32};
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    char p[256];
    int i, k, f;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build");
    randomize(m);
    for (i = 0; i < 2; i++) {
        mpt_model *qm = NULL;
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = modes[i]}, &qm) == MPT_OK,
              "quantize: %s", mpt_context_error(q));
        for (f = 0; qm && f < 2; f++) {
            mpt_status (*export_fn)(mpt_model *, const char *, const mpt_export_desc *) =
                f ? mpt_model_export_onnx : mpt_model_export_tflite;
            const char *name = f ? "weight_dtype.onnx" : "weight_dtype.tflite";
            remove(path_of(p, name)); /* no file of that name before the refusals */
            for (k = 0; k < 3; k++) {
                mpt_status s = export_fn(qm, path_of(p, name),
                                         &(mpt_export_desc){.weight_dtype = bad[k]});
                CHECK(s == MPT_ERR_INVALID_ARGUMENT &&
                          strstr(mpt_context_error(q), "weight_dtype") && !exists(p),
                      "mode %d, %s, weight_dtype %d: status %d (%s)", (int)modes[i], name,
                      (int)bad[k], (int)s, mpt_context_error(q));
            }
            CHECK(export_fn(qm, path_of(p, name), NULL) == MPT_OK && exists(p),
                  "mode %d, %s, the default: %s", (int)modes[i], name, mpt_context_error(q));
            remove(p);
            if (modes[i] == MPT_QUANTIZE_FLOAT16)
                CHECK(export_fn(qm, path_of(p, name),
                                &(mpt_export_desc){.weight_dtype = MPT_FLOAT16}) == MPT_OK,
                      "float16 for a float16 model, %s: %s", name, mpt_context_error(q));
            remove(p);
        }
        mpt_model_destroy(qm);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* ---- full-integer quantized models in LiteRT ---------------------------------------- */

#define Q_SAMPLES 400 /* top-1 on 99.5 %: at most 2 samples may differ */
#define Q_CALIBRATION 64

static float xq_host[Q_SAMPLES * SAMPLE];
static uint8_t xq_codes[Q_SAMPLES * SAMPLE]; /* uint8 io; as int8 for int8 io */

/* Runs a quantized .tflite in LiteRT on the Q_SAMPLES inputs in x_path (in
   the input tensor's dtype, which must be io), checks that its kernels are
   int8 and its output is io, and writes the outputs as float32. */
static const char *write_quantized_script(char *buf) {
    FILE *f = fopen(path_of(buf, "run_int8.py"), "w");
    if (!f) return NULL;
    fputs("import sys, numpy as np\n"
          "from ai_edge_litert.interpreter import Interpreter\n"
          "model, xin, n, out, io = sys.argv[1:6]\n"
          "weightless = sys.argv[6:] == ['weightless']  # a pooling or activation alone\n"
          "it = Interpreter(model_path=model)\n"
          "d, o = it.get_input_details()[0], it.get_output_details()[0]\n"
          "assert np.dtype(d['dtype']) == np.dtype(io) and np.dtype(o['dtype']) == np.dtype(io), (d, o)\n"
          "kinds = {t['name']: t for t in it.get_tensor_details()}\n"
          "kernels = [t for name, t in kinds.items() if name.endswith('/kernel')]\n"
          "assert (weightless or kernels) and all(np.dtype(t['dtype']) == np.int8 and\n"
          "                       t['quantization_parameters']['quantized_dimension'] == 0 and\n"
          "                       len(t['quantization_parameters']['scales']) == t['shape'][0]\n"
          "                       for t in kernels), kernels\n"
          "x = np.fromfile(xin, dtype=d['dtype']).reshape([int(n)] + list(d['shape'][1:]))\n"
          "it.resize_tensor_input(d['index'], list(x.shape))\n"
          "it.allocate_tensors()\n"
          "it.set_tensor(d['index'], x)\n"
          "it.invoke()\n"
          "np.ascontiguousarray(it.get_tensor(o['index']), dtype='<f4').tofile(out)\n",
          f);
    fclose(f);
    return buf;
}

/* qm's outputs for the Q_SAMPLES inputs in its io dtype, as float32 (codes
   for uint8 and int8), into want (owned by the caller; NULL on failure). */
static float *quantized_outputs(mpt_model *qm, mpt_dtype io, int64_t *per_sample) {
    int64_t shape[MPT_MAX_RANK], k, count;
    int rank = mpt_model_input_shape(qm, shape + 1);
    mpt_tensor x, y;
    float *want;
    shape[0] = Q_SAMPLES;
    mpt_tensor_wrap(ctx, &x, io, rank + 1, shape,
                    io == MPT_FLOAT32 ? (void *)xq_host : (void *)xq_codes);
    if (mpt_model_quantized_invoke(qm, &x, &y) != MPT_OK) {
        CHECK(0, "quantized_invoke: %s", mpt_context_error(ctx));
        return NULL;
    }
    count = mpt_tensor_count(&y);
    *per_sample = count / Q_SAMPLES;
    want = (float *)malloc(sizeof(float) * (size_t)count);
    for (k = 0; want && k < count; k++)
        want[k] = io == MPT_UINT8  ? (float)((const uint8_t *)y.data)[k]
                  : io == MPT_INT8 ? (float)((const int8_t *)y.data)[k]
                                   : ((const float *)y.data)[k];
    mpt_tensor_free(ctx, &y);
    return want;
}

/* The model quantized to full integer on Q_CALIBRATION of the samples. */
static mpt_model *quantize_full_integer(mpt_model *m, mpt_dtype io) {
    static int32_t labels[Q_CALIBRATION];
    int64_t shape[MPT_MAX_RANK];
    int rank = mpt_model_input_shape(m, shape);
    mpt_tensor tx, ty;
    mpt_dataset *data = NULL;
    mpt_model *qm = NULL;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){Q_CALIBRATION, 28, 28, 1}, xq_host);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){Q_CALIBRATION}, labels);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &data) == MPT_OK &&
              mpt_dataset_reshape(ctx, data, rank, shape) == MPT_OK &&
              mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                         .representative_data = data,
                                                         .io_dtype = io}, &qm) == MPT_OK,
          "quantize: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(data);
    return qm;
}

/* ---- full-integer quantized models in ONNX Runtime ---------------------------------- */

/* Runs a QDQ .onnx in ONNX Runtime (after onnx.checker) on the Q_SAMPLES
   inputs in x_path (float32, or the int8 or uint8 codes of that io dtype,
   which the model's input and output must have), checks that its kernels are int8 initializers
   dequantized per axis and that ONNX Runtime's optimized graph runs int8
   kernels (every Gemm a QGemm, a Flatten before it included; Conv mostly
   QLinearConv, though it leaves cnn_gap's 5×5 stride-2 one in float; with
   int8 io, a final Gemm stays in float: ONNX Runtime merges the output's
   QuantizeLinear into the Gemm's own, which then makes the graph's output,
   and it fuses no operation whose QuantizeLinear does), and writes the
   outputs as float32 (ort_session's: unfused where the fused kernels
   saturate, test.h). */
static const char *write_qdq_script(char *buf) {
    FILE *f = fopen(path_of(buf, "run_qdq.py"), "w");
    if (!f) return NULL;
    fputs("import sys, numpy as np, onnx, onnxruntime as ort\n" TEST_ORT_SESSION_PY
          "model, xin, n, out, io = sys.argv[1:6]\n"
          "weightless = sys.argv[6:] == ['weightless']  # a pooling or activation alone\n"
          "proto = onnx.load(model)\n"
          "onnx.checker.check_model(proto, full_check=True)\n"
          "inits = {t.name: t for t in proto.graph.initializer}\n"
          "kernels = [t for name, t in inits.items() if name.endswith('/kernel_quantized')]\n"
          "assert (weightless or kernels) and all(t.data_type == onnx.TensorProto.INT8 for t in kernels)\n"
          "assert all(len(inits[t.name.replace('_quantized', '_scale')].dims) == 1 and\n"
          "           inits[t.name.replace('_quantized', '_scale')].dims[0] == t.dims[0]\n"
          "           for t in kernels)\n"
          "ops = [node.op_type for node in proto.graph.node]\n"
          "assert 'QuantizeLinear' in ops and 'DequantizeLinear' in ops, ops\n"
          "options = ort.SessionOptions()\n"
          "options.optimized_model_filepath = model + '.optimized.onnx'\n"
          "s = ort.InferenceSession(model, options, providers=['CPUExecutionProvider'])\n"
          "fused = [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]\n"
          "last_gemm = io == 'int8' and fused[-2:] == ['Gemm', 'QuantizeLinear']\n"
          "assert fused.count('Gemm') == last_gemm, fused\n"
          "assert weightless or {'QGemm', 'QLinearConv'} & set(fused) or\\\n"
          "    (io == 'int8' and fused.count('Gemm') + fused.count('Conv') == 1), fused\n"
          "kind = {'float32': 'tensor(float)', 'int8': 'tensor(int8)', 'uint8': 'tensor(uint8)'}[io]\n"
          "assert s.get_inputs()[0].type == kind and s.get_outputs()[0].type == kind, \\\n"
          "    (s.get_inputs()[0].type, s.get_outputs()[0].type, io)\n"
          "shape = [int(n)] + list(s.get_inputs()[0].shape[1:])\n"
          "x = np.fromfile(xin, dtype='<f4' if io == 'float32' else io).reshape(shape)\n"
          "y = ort_session(model).run(None, {'input': x})[0]\n"
          "np.ascontiguousarray(y, dtype='<f4').tofile(out)\n",
          f);
    fclose(f);
    return buf;
}

/* ---- full-integer quantized models in both runtimes, against mpt.h's --------------- */

/* A runtime the full-integer models are exported for and run in: the
   format, the Python modules and script that run it, and how far (in steps
   of the output's scale, with float32's rounding of the dequantized value)
   its outputs may be from mpt_model_quantized_invoke's. */
typedef struct {
    const char *name, *ext, *imports;
    mpt_status (*export_fn)(mpt_model *m, const char *path, const mpt_export_desc *desc);
    const char *(*write_script)(char *buf);
    double within;         /* steps */
    const char *within_in; /* the same, in words */
} runtime;

/* LiteRT: TFLite's kernels requantize with the same integer multipliers,
   but round some sums (average pooling, softmax's and the activations'
   tables) their own way, so an output may be one step off. */
static const runtime litert = {"LiteRT", "tflite", "numpy, ai_edge_litert.interpreter",
                               mpt_model_export_tflite, write_quantized_script, 1.001, "one step"};
/* ONNX Runtime, the QDQ form: it computes the graph either in float between
   the Q/DQ pairs or in its own fused int8 kernels, both rounding the
   requantization their own way (float products and sums instead of mpt.h's
   integer multiplier and shift, its own exp, tanh and erf), so an output
   may be a step or two off. */
static const runtime onnx_runtime = {"ONNX Runtime", "onnx", "numpy, onnx, onnxruntime",
                                     mpt_model_export_onnx, write_qdq_script, 2.001, "two steps"};

/* qm (io dtype io) exported as name.EXT, run in rt on the Q_SAMPLES inputs
   in xq_host (float32 io) or xq_codes and compared with qm's own outputs
   (int8 and uint8 io: in codes, a step each): within rt's steps on >= 99 %
   of the elements, top-1 the same on >= 99.5 % of the samples (the
   runtime's top class one of mpt.h's: the random models' outputs tie often
   at softmax's 1/256). */
enum { WHOLE_MODEL, ONE_OP, ONE_OP_WEIGHTLESS, WHOLE_GRAPH };

static void runtime_matches(const runtime *rt, mpt_model *qm, mpt_dtype io, const char *name,
                            int one_op) {
    char x_path[256], model[256], script[256], out[256], cmd[1400];
    mpt_quantized_info info;
    float *want = NULL, *got = NULL;
    int64_t per_sample = 1, count, k, within = 0, top1_same = 0, i;
    double worst = 0, step;
    FILE *f;
    mpt_model_quantized_info(qm, &info);
    step = io == MPT_FLOAT32 ? (double)info.output.scale : 1.0;
    want = quantized_outputs(qm, io, &per_sample);
    count = per_sample * Q_SAMPLES;
    snprintf(model, sizeof model, "%s/%s.%s", dir, name, rt->ext);
    CHECK(rt->export_fn(qm, model, NULL) == MPT_OK, "export: %s", mpt_context_error(ctx));
    f = fopen(path_of(x_path, "xq.bin"), "wb");
    if (!want || !f || !rt->write_script(script)) {
        if (f) fclose(f);
        CHECK(0, "cannot write %s", x_path);
        goto done;
    }
    if (io == MPT_FLOAT32) fwrite(xq_host, sizeof(float), Q_SAMPLES * SAMPLE, f);
    else fwrite(xq_codes, 1, sizeof xq_codes, f);
    fclose(f);
    path_of(out, "yq.bin");
    remove(out);
    snprintf(cmd, sizeof cmd, "'%s' %s %s %s %d %s %s%s", test_python(), script, model, x_path,
             Q_SAMPLES, out, mpt_dtype_name(io), one_op == ONE_OP_WEIGHTLESS ? " weightless" : "");
    if (system(cmd) != 0) {
        CHECK(0, "%s failed on %s (%s)", rt->name, model, cmd);
        goto done;
    }
    got = (float *)malloc(sizeof(float) * (size_t)count + 4);
    f = fopen(out, "rb");
    CHECK(got && f && (int64_t)fread(got, sizeof(float), (size_t)count + 1, f) == count,
          "%s: %s's outputs", name, rt->name);
    if (f) fclose(f);
    if (!got) goto done;
    for (k = 0; k < count; k++) {
        double d = fabs((double)got[k] - (double)want[k]) / step;
        within += d <= rt->within;
        if (d > worst) worst = d;
    }
    if (one_op != WHOLE_MODEL && one_op != WHOLE_GRAPH) {
        /* one operation: every output within one step, in both runtimes */
        printf("# %s: %s within one step of mpt.h on %lld of %lld outputs (largest %.3g "
               "steps)\n", name, rt->name, (long long)within, (long long)count, worst);
        CHECK(worst <= 1.001, "%s: an output %.3g steps from mpt.h's in %s", name, worst,
              rt->name);
        goto done;
    }
    for (i = 0; i < Q_SAMPLES; i++) { /* the runtime's top class is one of mpt.h's (ties) */
        const float *w = want + i * per_sample;
        top1_same += w[argmax(got + i * per_sample, per_sample)] == w[argmax(w, per_sample)];
    }
    printf("# %s: %s within %s of mpt.h on %lld of %lld outputs (largest %.3g steps), "
           "top-1 the same on %lld of %d samples\n", name, rt->name, rt->within_in,
           (long long)within, (long long)count, worst, (long long)top1_same, Q_SAMPLES);
    /* A graph's chains are longer and pass a step on: an ADD or SUB of two
       inputs each a step off is two off, and the next op, at a finer scale,
       makes that more (the ResNet blocks, measured: in LiteRT with uint8
       io 91 % of the outputs within one step, the largest 31 steps; in
       ONNX Runtime with int8 io 95 % within two, the largest 39; top-1
       the same on 400 of 400 in both; with the other io dtypes every
       output the same). What holds per operation, merges included, is
       export_one_op_*'s. */
    CHECK(one_op == WHOLE_GRAPH || within >= 0.99 * (double)count,
          "%s: %lld of %lld outputs within %s", name, (long long)within, (long long)count,
          rt->within_in);
    CHECK(top1_same >= 0.995 * Q_SAMPLES, "%s: top-1 the same on %lld of %d samples", name,
          (long long)top1_same, Q_SAMPLES);
done:
    free(want);
    free(got);
}

/* The case name: model a (random weights) quantized to full integer with io
   float32, uint8 or int8 on random inputs (uint8 and int8 io: the random
   codes of xq_codes), exported and run in rt as runtime_matches says. */
static void check_full_integer_in(const runtime *rt, const char *name, unsigned long long seed,
                                  arch a, mpt_dtype io, int with_bn) {
    mpt_model *m, *qm = NULL;
    int64_t k;
    test__begin();
    test_seed(seed);
    m = make_model(a, with_bn);
    if (!test_python_imports(rt->imports) || !m) {
        mpt_model_destroy(m);
        test__end("%s", name);
        return;
    }
    randomize(m);
    for (k = 0; k < Q_SAMPLES * SAMPLE; k++) {
        xq_host[k] = (float)test_uniform(0, 1);
        xq_codes[k] = (uint8_t)(test_uniform(0, 256));
    }
    qm = quantize_full_integer(m, io);
    if (qm) runtime_matches(rt, qm, io, name, a == RESNET ? WHOLE_GRAPH : WHOLE_MODEL);
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
    test__end("%s", name);
}

/* In LiteRT (.tflite). with_bn: the model's BatchNormalizations in
   (those that do not fold: a MUL and an ADD; the case named "_bn"). */
static void check_full_integer(arch a, mpt_dtype io, int with_bn) {
    char name[64];
    snprintf(name, sizeof name, "export_full_integer_%s%s_%s_io", arch_name(a),
             with_bn ? "_bn" : "", mpt_dtype_name(io));
    check_full_integer_in(&litert, name,
                          300 + 3 * a + (io == MPT_UINT8) + 2 * (io == MPT_INT8) + 1000 * with_bn,
                          a, io, with_bn);
}

/* In ONNX Runtime (.onnx, the QDQ form). */
static void check_full_integer_onnx(arch a, mpt_dtype io, int with_bn) {
    char name[64];
    snprintf(name, sizeof name, "export_full_integer_onnx_%s%s%s%s", arch_name(a),
             with_bn ? "_bn" : "", io == MPT_FLOAT32 ? "" : "_",
             io == MPT_FLOAT32 ? "" : mpt_dtype_name(io));
    check_full_integer_in(&onnx_runtime, name,
                          500 + a + 17 * (io == MPT_UINT8) + 31 * (io == MPT_INT8) +
                              1000 * with_bn,
                          a, io, with_bn);
}

/* ---- one operation at a time, in both runtimes -------------------------------------

   What holds per operation: a model of one quantized operation, int8 codes
   in and out (no QUANTIZE or DEQUANTIZE around it), run in LiteRT and in
   ONNX Runtime on Q_SAMPLES random inputs: every output within one step of
   mpt.h's (the runtimes round some sums, tables and float products their
   own way). Chained, those steps can grow: a whole model's output after
   its softmax may be several steps off (test_fashion_mnist_full_integer). */
typedef enum {
    OP_DENSE, OP_DENSE_RELU, OP_CONV, OP_CONV_STRIDED, OP_MAX_POOL, OP_AVERAGE_POOL,
    OP_GLOBAL_POOL, OP_RELU, OP_SIGMOID, OP_TANH, OP_GELU, OP_GELU_TANH, OP_SOFTMAX,
    OP_PAD, OP_ADD, OP_SUB, OP_MUL, OP_CONCAT, OP_AVERAGE, OP_SHARED, OP_BATCH_NORM, OP_COUNT
} one_op_kind;

static const char *const one_op_names[OP_COUNT] = {
    "dense", "dense_relu", "conv2d", "conv2d_strided", "max_pooling2d", "average_pooling2d",
    "global_average_pooling2d", "relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "softmax",
    "zero_padding2d", "add", "subtract", "multiply", "concatenate", "average",
    "shared_conv2d_add", "batch_normalization"};

/* A merge of the image and a 1×1 Conv2D of it (3 filters for Concatenate,
   which then joins the image's channel, at the input's scale, requantized
   to the output's, to the Conv2D's; 1 for the others): the merge's inputs
   at two scales. A Conv2D's int8 results are the runtimes' to the bit but
   for an odd tie, so the merge is what is measured (AVERAGE: its ADD, then
   its MUL by the constant 1/2). SHARED: the Conv2D
   called again on its own output (a shared layer: its operations named
   "<name>/call1" in both files, whose names must be their own), the two
   added. */
static void one_merge(mpt_model *m, one_op_kind op) {
    mpt_node two[2];
    two[0] = mpt_model_input(m);
    two[1] = mpt_conv2d(m, two[0], &(mpt_conv2d_desc){.name = "twin",
                                                      .filters = op == OP_CONCAT ? 3 : 1,
                                                      .kernel_size = {1, 1}});
    if (op == OP_SHARED) two[0] = mpt_apply_layer(m, "twin", 1, &two[1]);
    if (op == OP_ADD || op == OP_SHARED) mpt_add(m, 2, two, NULL);
    else if (op == OP_SUB) mpt_subtract(m, 2, two, NULL);
    else if (op == OP_MUL) mpt_multiply(m, 2, two, NULL);
    else if (op == OP_AVERAGE) mpt_average(m, 2, two, NULL); /* ADD, then MUL by 1/2 */
    else mpt_concatenate(m, 2, two, NULL);
}

/* The model of one operation: a Dense on (784,) vectors, a Conv2D or a
   pooling on (28, 28, 1) images, an activation on (28, 28) rows (softmax
   over each row of 28). */
static mpt_model *one_op_model(one_op_kind op) {
    static const mpt_activation acts[] = {MPT_ACT_RELU, MPT_ACT_SIGMOID, MPT_ACT_TANH,
                                          MPT_ACT_GELU, MPT_ACT_GELU_TANH, MPT_ACT_SOFTMAX};
    mpt_model *m = NULL;
    mpt_model_desc desc = {.input_shape = {28, 28, 1}, .input_rank = 3, .seed = 7};
    if (op <= OP_DENSE_RELU) desc.input_shape[0] = 784, desc.input_rank = 1;
    if ((op >= OP_RELU && op <= OP_SOFTMAX) || op == OP_BATCH_NORM) desc.input_rank = 2;
    if (mpt_model_create(ctx, &desc, &m) != MPT_OK) return NULL;
    switch (op) {
    case OP_DENSE: add_dense(m, 11, MPT_ACT_NONE); break;
    case OP_DENSE_RELU: add_dense(m, 13, MPT_ACT_RELU); break;
    case OP_CONV: add_conv(m, 5, 3, 3, 1, 1, MPT_PADDING_VALID, MPT_ACT_RELU); break;
    case OP_CONV_STRIDED: add_conv(m, 4, 2, 3, 2, 1, MPT_PADDING_SAME, MPT_ACT_NONE); break;
    case OP_MAX_POOL: mpt_model_add_max_pooling2d(m, NULL); break;
    case OP_AVERAGE_POOL:
        mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {3, 3},
                                                               .strides = {2, 2},
                                                               .padding = MPT_PADDING_SAME});
        break;
    case OP_GLOBAL_POOL: mpt_model_add_global_average_pooling2d(m, NULL); break;
    case OP_PAD:
        mpt_model_add_zero_padding2d(m, &(mpt_zero_padding2d_desc){.padding = {{1, 2}, {0, 3}}});
        break;
    case OP_ADD:
    case OP_SUB:
    case OP_MUL:
    case OP_CONCAT:
    case OP_AVERAGE:
    case OP_SHARED: one_merge(m, op); break;
    case OP_BATCH_NORM: add_bn(m); break; /* over the 28 channels of each row: MUL, ADD */
    default: add_act(m, acts[op - OP_RELU]); break;
    }
    if (mpt_model_build(m, 64) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

static void check_one_op(const runtime *rt, one_op_kind op) {
    mpt_model *m, *qm = NULL;
    int64_t k;
    test__begin();
    test_seed(700 + op);
    m = one_op_model(op);
    CHECK(m != NULL, "%s: %s", one_op_names[op], mpt_context_error(ctx));
    if (!test_python_imports(rt->imports) || !m) {
        mpt_model_destroy(m);
        test__end("export_one_op_%s_%s", rt->ext, one_op_names[op]);
        return;
    }
    randomize(m);
    for (k = 0; k < Q_SAMPLES * SAMPLE; k++) { /* calibration over ±4: the tables' curves */
        xq_host[k] = (float)test_uniform(-4, 4);
        xq_codes[k] = (uint8_t)(test_uniform(0, 256));
    }
    qm = quantize_full_integer(m, MPT_INT8);
    if (qm) {
        char name[96];
        snprintf(name, sizeof name, "one_%s", one_op_names[op]);
        runtime_matches(rt, qm, MPT_INT8, name,
                        op <= OP_CONV_STRIDED || (op >= OP_ADD && op != OP_BATCH_NORM)
                            ? ONE_OP : ONE_OP_WEIGHTLESS);
    }
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
    test__end("export_one_op_%s_%s", rt->ext, one_op_names[op]);
}

/* ---- quantization-aware trained models in both runtimes ------------------------------ */

#define QAT_TRAIN 640

static float qat_x[QAT_TRAIN * SAMPLE];
static int32_t qat_y[QAT_TRAIN];

/* A 28×28 image of class cls: noise with a bright 4×4 square in one of
   ten places, a problem both models learn in a few epochs. */
static void qat_image(float *x, int cls) {
    int r, c, top = 3 + 12 * (cls / 5), left = 2 + 5 * (cls % 5);
    for (r = 0; r < 28; r++)
        for (c = 0; c < 28; c++)
            x[r * 28 + c] = (float)(test_uniform(0, 0.3) + (r >= top && r < top + 4 &&
                                                            c >= left && c < left + 4 ? 0.7 : 0));
}

static mpt_dataset *qat_dataset(float *x, int32_t *y, int64_t n) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){n, 28, 28, 1}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){n}, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* The MLP, or Conv2D -> BatchNormalization -> ReLU (folded at the
   conversion) -> MaxPooling2D; both end in Dense(10) giving logits, which
   the conversion must reproduce to one step (a softmax would hide a wrong
   range behind probabilities saturated at 0 and 1). */
static mpt_model *qat_model(int cnn) {
    mpt_model *m = NULL;
    if (mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28, 1}, .input_rank = 3,
                                                .seed = 9}, &m) != MPT_OK)
        return NULL;
    if (cnn) {
        add_conv(m, 6, 3, 3, 2, 2, MPT_PADDING_SAME, MPT_ACT_NONE);
        add_bn(m);
        add_act(m, MPT_ACT_RELU);
        mpt_model_add_max_pooling2d(m, NULL);
        mpt_model_add_flatten(m, NULL);
    } else {
        mpt_model_add_flatten(m, NULL);
        add_dense(m, 24, MPT_ACT_RELU);
    }
    add_dense(m, 10, MPT_ACT_NONE);
    mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f},
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1},
        .metrics = MPT_METRIC_ACCURACY});
    if (mpt_model_build(m, 32) != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* The converted model's logits against the quantization-aware model's
   own predict on the same inputs: the fake quantization rounds as the
   conversion will, with the trained ranges, to float32 rounding of the
   products, so the logits are the same but where a rounding tie lands
   the other way: one output step (as in test_qat), on < 1 % of them;
   top-1 the same on >= 99.5 % of the samples. A wrong range, scale or
   fold in the conversion breaks this (a range 10 % too wide leaves
   8-16 % of the logits a step off), where the runtimes, which only run
   what was converted, would not notice. */
static void matches_fake_quantized(mpt_model *m, mpt_model *qm, mpt_dataset *d,
                                   const char *name) {
    mpt_tensor fq, iq;
    mpt_quantized_info info;
    double bound = 1.0 + 1e-3, worst = 0;
    int64_t i, k, per_sample, top1_same = 0, exact = 0;
    if (mpt_model_predict(m, d, 32, &fq) != MPT_OK) {
        CHECK(0, "%s: predict: %s", name, mpt_context_error(ctx));
        return;
    }
    if (mpt_model_predict(qm, d, 32, &iq) != MPT_OK) {
        CHECK(0, "%s: predict: %s", name, mpt_context_error(ctx));
        mpt_tensor_free(ctx, &fq);
        return;
    }
    mpt_model_quantized_info(qm, &info);
    per_sample = mpt_tensor_count(&fq) / Q_SAMPLES;
    for (k = 0; k < mpt_tensor_count(&fq); k++) {
        double d = fabs((double)((const float *)fq.data)[k] - ((const float *)iq.data)[k]) /
                   info.output.scale;
        exact += d < 1e-3;
        worst = fmax(worst, d);
    }
    for (i = 0; i < Q_SAMPLES; i++) {
        const float *w = (const float *)fq.data + i * per_sample;
        top1_same += w[argmax((const float *)iq.data + i * per_sample, per_sample)] ==
                     w[argmax(w, per_sample)];
    }
    printf("# %s: int8 model within %.3g output steps of the quantization-aware one, the same "
           "on %lld of %lld outputs, top-1 the same on %lld of %d samples\n", name, worst,
           (long long)exact, (long long)mpt_tensor_count(&fq), (long long)top1_same, Q_SAMPLES);
    CHECK(worst <= bound, "%s: the int8 model is %.3f output steps from the quantization-aware "
          "one", name, worst);
    CHECK(exact >= 0.99 * (double)mpt_tensor_count(&fq), "%s: the int8 model's logits are the "
          "quantization-aware one's on only %lld of %lld outputs", name, (long long)exact,
          (long long)mpt_tensor_count(&fq));
    CHECK(top1_same >= 0.995 * Q_SAMPLES, "%s: top-1 the same on %lld of %d samples", name,
          (long long)top1_same, Q_SAMPLES);
    mpt_tensor_free(ctx, &fq);
    mpt_tensor_free(ctx, &iq);
}

/* xq_host's images as the codes a model of input quantization p takes:
   x/scale rounded half away from zero, plus the zero point, saturated to
   the io dtype's codes (as mpt.h quantizes a float32 input). */
static void quantize_images(const mpt_quant_params *p, mpt_dtype io) {
    int lo = io == MPT_UINT8 ? 0 : -128, hi = io == MPT_UINT8 ? 255 : 127;
    int64_t k;
    for (k = 0; k < Q_SAMPLES * SAMPLE; k++) {
        float v = xq_host[k] / p->scale;
        long q = (long)(v < 0 ? -floorf(-v + 0.5f) : floorf(v + 0.5f)) + p->zero_point;
        q = q < lo ? lo : q > hi ? hi : q;
        if (io == MPT_UINT8) xq_codes[k] = (uint8_t)q;
        else ((int8_t *)xq_codes)[k] = (int8_t)q;
    }
}

/* The quantization-aware model m converted again with int8 or uint8 io
   (TFLite's inference_input_type): the same int8 model as qm (float32
   io) but at its ends, so on the fresh images quantized at its input's
   parameters its output codes, dequantized, are qm's outputs bit for
   bit; then run in LiteRT and ONNX Runtime on those codes, as qm is. */
static void integer_io_matches(mpt_model *m, mpt_model *qm, mpt_dtype io, const char *name) {
    char io_name[96];
    mpt_model *qio = NULL;
    mpt_quantized_info info;
    mpt_tensor x, xf, y, yf;
    int64_t shape[MPT_MAX_RANK], k, off = 0;
    int rank;
    snprintf(io_name, sizeof io_name, "%s_%s_io", name, mpt_dtype_name(io));
    if (mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                   .io_dtype = io}, &qio) != MPT_OK) {
        CHECK(0, "%s: convert: %s", io_name, mpt_context_error(ctx));
        return;
    }
    mpt_model_quantized_info(qio, &info);
    CHECK(info.io_dtype == io, "%s: io %s", io_name, mpt_dtype_name(info.io_dtype));
    quantize_images(&info.input, io);
    rank = mpt_model_input_shape(qio, shape + 1);
    shape[0] = Q_SAMPLES;
    mpt_tensor_wrap(ctx, &x, io, rank + 1, shape, xq_codes);
    mpt_tensor_wrap(ctx, &xf, MPT_FLOAT32, rank + 1, shape, xq_host);
    if (mpt_model_quantized_invoke(qio, &x, &y) != MPT_OK ||
        mpt_model_quantized_invoke(qm, &xf, &yf) != MPT_OK) {
        CHECK(0, "%s: invoke: %s", io_name, mpt_context_error(ctx));
        mpt_model_destroy(qio);
        return;
    }
    for (k = 0; k < mpt_tensor_count(&y); k++) {
        int code = io == MPT_UINT8 ? ((const uint8_t *)y.data)[k] : ((const int8_t *)y.data)[k];
        off += (float)(code - info.output.zero_point) * info.output.scale !=
               ((const float *)yf.data)[k];
    }
    CHECK(off == 0, "%s: %lld of %lld outputs differ from the float32 io model's", io_name,
          (long long)off, (long long)mpt_tensor_count(&y));
    mpt_tensor_free(ctx, &y);
    mpt_tensor_free(ctx, &yf);
    runtime_matches(&litert, qio, io, io_name, WHOLE_MODEL);
    runtime_matches(&onnx_runtime, qio, io, io_name, WHOLE_MODEL);
    mpt_model_destroy(qio);
}

/* A model trained quantization-aware (a float epoch, then two with fake
   quantization), converted to full integer with the ranges it learned (no
   representative data), exported to both formats and run in LiteRT and
   ONNX Runtime on fresh images of the same kind, checked as the
   post-training full-integer models are; and the converted model against
   the quantization-aware one. */
static void check_quantization_aware(int cnn) {
    const char *name = cnn ? "export_qat_cnn_bn" : "export_qat_mlp";
    mpt_model *m, *qm = NULL;
    mpt_dataset *train = NULL, *fresh = NULL;
    static int32_t fresh_y[Q_SAMPLES];
    mpt_logs logs;
    int64_t i;
    test__begin();
    test_seed(700 + cnn);
    m = qat_model(cnn);
    CHECK(m != NULL, "%s: build: %s", name, mpt_context_error(ctx));
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter") || !m) {
        mpt_model_destroy(m);
        test__end("%s", name);
        return;
    }
    for (i = 0; i < QAT_TRAIN; i++) qat_image(qat_x + i * SAMPLE, qat_y[i] = test_randint(0, 9));
    for (i = 0; i < Q_SAMPLES; i++) qat_image(xq_host + i * SAMPLE, fresh_y[i] = test_randint(0, 9));
    train = qat_dataset(qat_x, qat_y, QAT_TRAIN);
    fresh = qat_dataset(xq_host, fresh_y, Q_SAMPLES);
    if (!train || !fresh) goto done;
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 1, .batch_size = 32}) == MPT_OK &&
              mpt_model_quantize_aware(m, &(mpt_qat_desc){.ema_decay = 0.9f}) == MPT_OK &&
              mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "%s: quantization-aware fit: %s", name, mpt_context_error(ctx));
    mpt_model_evaluate(m, fresh, NULL, &logs);
    CHECK(mpt_logs_get(&logs, "accuracy") > 0.9, "%s: accuracy %.3f after training", name,
          mpt_logs_get(&logs, "accuracy"));
    if (mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &qm) !=
        MPT_OK) {
        CHECK(0, "%s: convert: %s", name, mpt_context_error(ctx));
        goto done;
    }
    matches_fake_quantized(m, qm, fresh, name);
    runtime_matches(&litert, qm, MPT_FLOAT32, name, WHOLE_MODEL);
    runtime_matches(&onnx_runtime, qm, MPT_FLOAT32, name, WHOLE_MODEL);
    integer_io_matches(m, qm, MPT_UINT8, name);
    integer_io_matches(m, qm, MPT_INT8, name);
done:
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(fresh);
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
    test__end("%s", name);
}

/* A float16 or dynamic-range quantized model in both formats, compared
   with its own predict. float16: float16 kernels computing in float32, the
   same float math as mpt.h's: within 1e-4, top-1 identical. Dynamic range:
   int8 kernels read by the integer products; ONNX Runtime within 1e-5, top-1
   identical; LiteRT within DYNAMIC_TFLITE_TOL and top-1 the same on 95 %
   of the samples (the random weights' probabilities lie close together,
   so a difference within the bound can swap the top two: 1 of 37 on the
   MLP; the 99.5 % bar is the trained model's). */
static void check_quantized_float(arch a, mpt_quantize_mode mode, int with_bn) {
    const int half = mode == MPT_QUANTIZE_FLOAT16;
    const double tflite_tol = half ? 1e-4 : DYNAMIC_TFLITE_TOL, onnx_tol = half ? 1e-4 : 1e-5;
    const char *mname = half ? "float16" : "dynamic_range", *wdtype = half ? "float16" : "int8";
    char x_path[256], tfl[256], onnx[256];
    mpt_model *m = NULL, *qm = NULL;
    mpt_tensor want;
    float *got;
    int64_t count;
    test__begin();
    memset(&want, 0, sizeof want);
    if (!test_python_imports("numpy, onnx, onnxruntime, ai_edge_litert.interpreter")) {
        test__end("export_%s_quantized_%s%s", mname, arch_name(a), with_bn ? "_bn" : "");
        return;
    }
    test_seed((half ? 400 : 600) + a + 1000 * with_bn);
    m = make_model(a, with_bn);
    CHECK(m != NULL, "build: %s", mpt_context_error(ctx));
    if (m && write_inputs(x_path)) {
        randomize(m);
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = mode}, &qm) == MPT_OK,
              "quantize: %s", mpt_context_error(ctx));
        snprintf(tfl, sizeof tfl, "%s/%s%s_%s_quantized.tflite", dir, arch_name(a),
                 with_bn ? "_bn" : "", mname);
        snprintf(onnx, sizeof onnx, "%s/%s%s_%s_quantized.onnx", dir, arch_name(a),
                 with_bn ? "_bn" : "", mname);
        CHECK(qm && mpt_model_export_tflite(qm, tfl, NULL) == MPT_OK, "TFLite: %s",
              mpt_context_error(ctx));
        CHECK(qm && mpt_model_export_onnx(qm, onnx, NULL) == MPT_OK, "ONNX: %s",
              mpt_context_error(ctx));
        if (qm && predict(qm, x_host, &want)) {
            count = mpt_tensor_count(&want);
            got = (float *)malloc(sizeof(float) * (size_t)(count + 1));
            if (got && run_runtime("tflite", tfl, x_path, wdtype, got, count))
                compare("LiteRT", got, (const float *)want.data, count,
                        want.shape[want.rank - 1], tflite_tol, half ? 1 : 0.95);
            if (got && run_runtime("onnx", onnx, x_path, wdtype, got, count))
                compare("ONNX Runtime", got, (const float *)want.data, count,
                        want.shape[want.rank - 1], onnx_tol, 1);
            free(got);
        }
    }
    mpt_tensor_free(ctx, &want);
    mpt_model_destroy(qm);
    mpt_model_destroy(m);
    test__end("export_%s_quantized_%s%s", mname, arch_name(a), with_bn ? "_bn" : "");
}

/* A path under a regular file, and a path that is a directory (the whole
   file is written, and renaming it over the directory fails): an I/O error
   naming the path, the directory as it was, no temporary file left. */
static void test_unwritable_path(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL;
    export_fn fns[2] = {mpt_model_export_tflite, mpt_model_export_onnx};
    static char before[16384], after[16384]; /* every file the tests before wrote */
    char file[256], sub[256], p[300];
    FILE *f;
    int k;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {6, 5, 2}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2}});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    f = fopen(path_of(file, "plain_file"), "w");
    if (f) fclose(f);
    mkdir(path_of(sub, "a_directory"), 0777);
    list_dir(dir, before, sizeof before);
    for (k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/model", file);
        CHECK(fns[k](m, p, NULL) == MPT_ERR_IO && strstr(mpt_context_error(q), p),
              "under a file: %s", mpt_context_error(q));
        CHECK(fns[k](m, sub, NULL) == MPT_ERR_IO && strstr(mpt_context_error(q), sub) &&
                  strstr(mpt_context_error(q), "rename"),
              "over a directory: %s", mpt_context_error(q));
        list_dir(dir, after, sizeof after);
        CHECK(strcmp(before, after) == 0, "the directory held \"%s\", now \"%s\"", before, after);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* Memory that runs out at each allocation of an export in turn: each
   fails with MPT_ERR_OUT_OF_MEMORY and writes nothing, and whatever it
   allocated is freed. The model with float32 and float16 weights, and
   quantized to float16 and to dynamic range. */
static void test_out_of_memory(void) {
    counting_alloc c = {0, 0, -1};
    mpt_context *q = counting_ctx(&c);
    mpt_model *m = NULL, *plain = NULL, *models[4] = {NULL, NULL, NULL, NULL};
    export_fn fns[2] = {mpt_model_export_tflite, mpt_model_export_onnx};
    mpt_export_desc descs[4] = {{MPT_FLOAT32}, {MPT_FLOAT16}, {MPT_DTYPE_DEFAULT},
                                {MPT_DTYPE_DEFAULT}};
    char p[256];
    long k, before;
    int f, d, finished;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {7, 6, 2}, .input_rank = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2}});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_max_pooling2d(m, NULL);
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_global_average_pooling2d(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    models[0] = models[1] = m;
    /* Quantized: without the BatchNormalization after pooling, which has
       nothing to fold into. */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {7, 6, 2}, .input_rank = 3}, &plain);
    mpt_model_add_conv2d(plain, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2}});
    mpt_model_add_batch_normalization(plain, NULL);
    mpt_model_add_max_pooling2d(plain, NULL);
    mpt_model_add_global_average_pooling2d(plain, NULL);
    mpt_model_add_dense(plain, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(plain, 2) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_refresh_weights(plain);
    CHECK(mpt_model_quantize(plain, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FLOAT16},
                             &models[2]) == MPT_OK &&
              mpt_model_quantize(plain, NULL, &models[3]) == MPT_OK,
          "quantize: %s", mpt_context_error(q));
    for (f = 0; f < 2; f++)
        for (d = 0; d < 4 && models[d]; d++) {
            path_of(p, f ? "oom.onnx" : "oom.tflite");
            for (k = 0, finished = 0; !finished && k < 10000; k++) {
                mpt_status s;
                before = c.allocs - c.frees;
                c.fail_after = c.allocs + k;
                s = fns[f](models[d], p, &descs[d]);
                c.fail_after = -1;
                CHECK(c.allocs - c.frees == before, "%s (model %d), allocation %ld failing: %ld "
                      "blocks left allocated", p, d, k, c.allocs - c.frees - before);
                if (s == MPT_OK) {
                    finished = 1;
                    break;
                }
                CHECK(s == MPT_ERR_OUT_OF_MEMORY && strstr(mpt_context_error(q), "out of memory"),
                      "%s (model %d), allocation %ld failing: status %d, %s", p, d, k, (int)s,
                      mpt_context_error(q));
                CHECK(!exists(p), "%s (model %d) written with allocation %ld failing", p, d, k);
            }
            CHECK(finished && k > 3, "%s (model %d): %ld allocations", p, d, k);
            remove(p);
        }
    mpt_model_destroy(models[3]);
    mpt_model_destroy(models[2]);
    mpt_model_destroy(plain);
    mpt_model_destroy(m);
    mpt_context_destroy(q);
    CHECK(c.allocs == c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
}

static void remove_dir(void) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("# cannot remove %s\n", dir);
}

int main(void) {
    static const arch with_bn[4] = {MLP, CNN, CNN_GAP, BN_GRAPH};
    mpt_context_desc d;
    int a, i;
    memset(&d, 0, sizeof d);
    d.num_threads = 1;
    if (mpt_context_create(&d, &ctx) != MPT_OK) return 1;
    snprintf(dir, sizeof dir, "/tmp/mpt_export_XXXXXX");
    if (!mkdtemp(dir)) {
        printf("FAIL cannot create a temporary directory\n");
        return 1;
    }
    for (a = MLP; a <= BN_GRAPH; a++) check_float((arch)a, MPT_FLOAT32, 1e-4);
    for (a = MLP; a <= RESNET; a++) check_float((arch)a, MPT_FLOAT16, 1e-4);
    TEST_RUN(test_fashion_mnist_trained);
    TEST_RUN(test_fashion_mnist_full_integer);
    TEST_RUN(test_tflite_quantization);
    TEST_RUN(test_onnx_qdq);
    for (a = MLP; a <= CNN_OPEN; a++) {
        check_full_integer((arch)a, MPT_FLOAT32, 0);
        check_full_integer((arch)a, MPT_UINT8, 0);
        check_full_integer((arch)a, MPT_INT8, 0);
    }
    check_full_integer(RESNET, MPT_FLOAT32, 0);
    check_full_integer(RESNET, MPT_UINT8, 0);
    check_full_integer(RESNET, MPT_INT8, 0);
    for (a = MLP; a <= CNN_OPEN; a++) check_quantized_float((arch)a, MPT_QUANTIZE_FLOAT16, 0);
    for (a = MLP; a <= CNN_OPEN; a++)
        check_quantized_float((arch)a, MPT_QUANTIZE_DYNAMIC_RANGE, 0);
    check_quantized_float(RESNET, MPT_QUANTIZE_FLOAT16, 0);
    check_quantized_float(RESNET, MPT_QUANTIZE_DYNAMIC_RANGE, 0);
    /* BatchNormalizations that do not fold (after a ReLU, 2-D and 4-D;
       after pooling; in a graph); dynamic range and full integer:
       test_fashion_mnist_full_integer's trained model and the one-op
       cases (the random models' softmax outputs lie within a step of each
       other on a few samples in 100, where either runtime's rounding may
       pick another top class) */
    for (i = 0; i < 4; i++) check_quantized_float(with_bn[i], MPT_QUANTIZE_FLOAT16, 1);
    for (a = MLP; a <= CNN_OPEN; a++) check_full_integer_onnx((arch)a, MPT_FLOAT32, 0);
    check_full_integer_onnx(MLP, MPT_UINT8, 0);
    check_full_integer_onnx(CNN_OPEN, MPT_INT8, 0);
    check_full_integer_onnx(RESNET, MPT_FLOAT32, 0);
    check_full_integer_onnx(RESNET, MPT_UINT8, 0);
    check_full_integer_onnx(RESNET, MPT_INT8, 0);
    for (a = OP_DENSE; a < OP_COUNT; a++) check_one_op(&litert, (one_op_kind)a);
    /* (not SHARED: ONNX Runtime leaves its two 1-filter Conv nodes in float,
       which run_qdq.py refuses) */
    for (a = OP_DENSE; a < OP_SHARED; a++) check_one_op(&onnx_runtime, (one_op_kind)a);
    check_one_op(&onnx_runtime, OP_BATCH_NORM);
    check_quantization_aware(0);
    check_quantization_aware(1);
    TEST_RUN(test_unsupported_layer);
    TEST_RUN(test_tokens_quantized);
    TEST_RUN(test_positions_unbatched);
    TEST_RUN(test_several_inputs_and_outputs);
    TEST_RUN(test_several_inputs_and_outputs_quantized);
    TEST_RUN(test_several_inputs_and_outputs_uint8_io);
    TEST_RUN(test_unbuilt_model);
    TEST_RUN(test_quantized_weight_dtype);
    TEST_RUN(test_unwritable_path);
    TEST_RUN(test_out_of_memory);
    remove_dir();
    mpt_context_destroy(ctx);
    return test_summary("test_export");
}

/* Writes the fuzz harnesses' first corpora into DIR/<harness>/ (./build.sh
   makes them at fuzz time, into build/fuzz/seeds): files mpt.h itself
   writes, and small IDX files with their gzip.
       idx, idx_gzip   images and labels files in one input (fuzz_idx_split):
                       a few samples, one sample of one pixel; gzip'd too
       weights         the weights and the full checkpoint of fuzz_model
       checkpoint      the same two files
       qat             those two of fuzz_qat_model, and the same two files
       npy             NumPy's own files (tests/data/npy/, read from the
                       repository's root): x and y .npy files in one input
                       (fuzz_idx_split), and .npz archives alone
       csv             small CSV files whose label column is "y"
       text            a few lines of text, and the bytes 0..255
       model           architecture JSON: a conv model, a graph of every
                       merge, a model of token ids (Embedding,
                       PositionEmbedding, LayerNormalization,
                       MultiHeadAttention keeping its weights, Dense over
                       positions), a model of three inputs (numbers,
                       an image, ids: InputLayers), a model of two
                       outputs (their losses, loss weights and metrics)
   Usage: seeds DIR (DIR/<harness> must exist). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

static const char *out_dir;

static void put(const char *harness, const char *name, const void *data, size_t size) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, harness, name);
    fuzz_write(path, data, size);
}

/* An IDX header: magic 0x0000080<dims>, then each size big-endian. */
static size_t idx_header(unsigned char *p, int dims, const uint32_t *sizes) {
    int i;
    p[0] = p[1] = 0;
    p[2] = 0x08;
    p[3] = (unsigned char)dims;
    for (i = 0; i < dims; i++) {
        p[4 + 4 * i] = (unsigned char)(sizes[i] >> 24);
        p[5 + 4 * i] = (unsigned char)(sizes[i] >> 16);
        p[6 + 4 * i] = (unsigned char)(sizes[i] >> 8);
        p[7 + 4 * i] = (unsigned char)sizes[i];
    }
    return 4 + 4 * (size_t)dims;
}

/* gzip of data[0..size) into out (room for size + 64), its size. */
static size_t gzip(unsigned char *out, const unsigned char *data, size_t size) {
    z_stream z;
    size_t n;
    memset(&z, 0, sizeof z);
    if (deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
        fuzz_die("deflateInit2");
    z.next_in = (unsigned char *)data;
    z.avail_in = (uInt)size;
    z.next_out = out;
    z.avail_out = (uInt)(size + 64);
    if (deflate(&z, Z_FINISH) != Z_STREAM_END) fuzz_die("deflate");
    n = z.total_out;
    deflateEnd(&z);
    return n;
}

/* One IDX input (n images of rows x cols, pixels and labels varied), plain
   in "idx" and "idx_gzip", both parts gzip'd in "idx_gzip". */
static void idx_seed(const char *name, uint32_t n, uint32_t rows, uint32_t cols) {
    static unsigned char images[4096], labels[512], input[8192], gz_img[4096 + 64],
        gz_lab[512 + 64];
    uint32_t dims[3] = {n, rows, cols};
    size_t ni = idx_header(images, 3, dims), nl = idx_header(labels, 1, dims), i, len, at;
    char gz_name[64];
    for (i = 0; i < (size_t)n * rows * cols; i++) images[ni++] = (unsigned char)(37 * i + 11);
    for (i = 0; i < n; i++) labels[nl++] = (unsigned char)((7 * i + 3) % 10);
    len = ni;
    input[0] = (unsigned char)(len >> 24), input[1] = (unsigned char)(len >> 16);
    input[2] = (unsigned char)(len >> 8), input[3] = (unsigned char)len;
    memcpy(input + 4, images, ni);
    memcpy(input + 4 + ni, labels, nl);
    put("idx", name, input, 4 + ni + nl);
    put("idx_gzip", name, input, 4 + ni + nl);
    len = gzip(gz_img, images, ni);
    input[0] = (unsigned char)(len >> 24), input[1] = (unsigned char)(len >> 16);
    input[2] = (unsigned char)(len >> 8), input[3] = (unsigned char)len;
    memcpy(input + 4, gz_img, len);
    at = 4 + len;
    len = gzip(gz_lab, labels, nl);
    memcpy(input + at, gz_lab, len);
    snprintf(gz_name, sizeof gz_name, "%s.gz", name);
    put("idx_gzip", gz_name, input, at + len);
}

/* x's and y's .npy files of tests/data/npy/ in one input (fuzz_idx_split),
   or an .npz archive alone (y NULL: an empty y part). */
static void npy_seed(const char *name, const char *x, const char *y) {
    char path[512];
    unsigned char *xb, *yb = NULL, *input;
    size_t xn, yn = 0;
    snprintf(path, sizeof path, "tests/data/npy/%s", x);
    xb = fuzz_read(path, &xn);
    if (y) {
        snprintf(path, sizeof path, "tests/data/npy/%s", y);
        yb = fuzz_read(path, &yn);
    }
    input = (unsigned char *)malloc(4 + xn + yn);
    if (!input) fuzz_die("out of memory");
    input[0] = (unsigned char)(xn >> 24), input[1] = (unsigned char)(xn >> 16);
    input[2] = (unsigned char)(xn >> 8), input[3] = (unsigned char)xn;
    memcpy(input + 4, xb, xn);
    if (yn) memcpy(input + 4 + xn, yb, yn);
    put("npy", name, input, 4 + xn + yn);
    free(input);
    free(xb);
    free(yb);
}

/* A model's weights and checkpoint (prefix + "weights.safetensors", ...),
   as files of the harnesses named (NULL-ended). */
static void model_seeds(mpt_context *ctx, mpt_model *m, const char *prefix,
                        const char *const *harnesses) {
    char path[512], name[128];
    unsigned char *bytes;
    size_t size;
    int k, full;
    for (full = 0; full <= 1; full++) {
        fuzz_path(path, "input.safetensors");
        if ((full ? mpt_model_save_checkpoint(m, path) : mpt_model_save_weights(m, path)) !=
            MPT_OK)
            fuzz_die(mpt_context_error(ctx));
        bytes = fuzz_read(path, &size);
        snprintf(name, sizeof name, "%s%s.safetensors", prefix, full ? "checkpoint" : "weights");
        for (k = 0; harnesses[k]; k++) put(harnesses[k], name, bytes, size);
        free(bytes);
    }
}

/* A model's architecture JSON (what mpt_model_save keeps in the metadata),
   a seed of the model harness. */
static void architecture_seed(mpt_context *ctx, mpt_model *m, const char *name) {
    mpt__ckpt_text t;
    memset(&t, 0, sizeof t);
    t.ctx = ctx;
    mpt__put_architecture(&t, m);
    if (t.oom || !t.s) fuzz_die("out of memory");
    put("model", name, t.s, t.len);
    mpt__free(ctx, t.s);
}

/* The model md describes, or the run ends. */
static mpt_model *created(mpt_context *ctx, const mpt_model_desc *md) {
    mpt_model *m = NULL;
    if (mpt_model_create(ctx, md, &m) != MPT_OK) fuzz_die(mpt_context_error(ctx));
    return m;
}

/* m compiled with cd and built for batches of 4, or the run ends. */
static void compiled_and_built(mpt_context *ctx, mpt_model *m, const mpt_compile_desc *cd) {
    if (mpt_model_compile(m, cd) != MPT_OK || mpt_model_build(m, 4) != MPT_OK)
        fuzz_die(mpt_context_error(ctx));
}

/* A graph of every merge, ZeroPadding2D, the augmentation layers, a
   shared layer and a dtype given, compiled. */
static mpt_model *graph_model(mpt_context *ctx) {
    mpt_model *m = created(ctx, &(mpt_model_desc){.input_shape = {6, 6, 1}, .input_rank = 3,
                                                  .policy = MPT_POLICY_MIXED_BFLOAT16});
    mpt_conv2d_desc conv;
    mpt_zero_padding2d_desc pad;
    mpt_random_flip_desc flip;
    mpt_random_translation_desc shift;
    mpt_concatenate_desc cat;
    mpt_dense_desc dense;
    mpt_compile_desc cd;
    mpt_node x, a, b, two[2];
    memset(&conv, 0, sizeof conv);
    conv.filters = 2, conv.kernel_size[0] = conv.kernel_size[1] = 3;
    conv.padding = MPT_PADDING_SAME;
    memset(&pad, 0, sizeof pad);
    pad.padding[1][0] = 2;
    memset(&cat, 0, sizeof cat);
    cat.axis = 2;
    memset(&flip, 0, sizeof flip);
    flip.mode = MPT_FLIP_HORIZONTAL;
    memset(&shift, 0, sizeof shift);
    shift.height_factor[0] = -0.1f, shift.height_factor[1] = 0.2f;
    shift.width_factor[0] = shift.width_factor[1] = 0.25f;
    shift.fill_mode = MPT_FILL_CONSTANT, shift.interpolation = MPT_INTERPOLATION_NEAREST;
    shift.fill_value = 1, shift.seed = 3;
    x = mpt_random_translation(m, mpt_random_flip(m, mpt_model_input(m), &flip), &shift);
    a = mpt_conv2d(m, x, &conv);             /* c1 */
    b = mpt_apply_layer(m, "conv2d", 1, &x); /* c2: c1's weights again */
    two[0] = a, two[1] = b;
    two[0] = mpt_add(m, 2, two, NULL);       /* s = c1 + c2 */
    two[1] = a;
    two[1] = mpt_multiply(m, 2, two, NULL);  /* s · c1 */
    two[0] = b;
    two[1] = mpt_subtract(m, 2, two, NULL);  /* c2 − s · c1 */
    two[0] = a;
    a = mpt_average(m, 2, two, NULL);
    two[0] = a;
    two[1] = mpt_conv2d(m, mpt_zero_padding2d(m, x, &pad), &conv);
    a = mpt_concatenate(m, 2, two, &cat);
    memset(&dense, 0, sizeof dense);
    dense.units = 3, dense.dtype = MPT_FLOAT32;
    mpt_dense(m, mpt_flatten(m, a, NULL), &dense);
    memset(&cd, 0, sizeof cd);
    cd.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    compiled_and_built(ctx, m, &cd);
    return m;
}

/* A model of token ids: Embedding, PositionEmbedding added, a
   LayerNormalization, a causal MultiHeadAttention with dropout that keeps
   its weights for backward (no_flash_attention) and Dense layers over the
   positions (the tanh GELU), compiled with regression metrics. */
static mpt_model *token_model(mpt_context *ctx) {
    mpt_model *m = created(ctx, &(mpt_model_desc){.input_shape = {5}, .input_rank = 1,
                                                  .input_dtype = MPT_INT32,
                                                  .policy = MPT_POLICY_MIXED_FLOAT16});
    mpt_embedding_desc emb;
    mpt_position_embedding_desc pos;
    mpt_layer_normalization_desc ln;
    mpt_multi_head_attention_desc mha;
    mpt_dense_desc dense;
    mpt_compile_desc cd;
    mpt_node two[2];
    memset(&emb, 0, sizeof emb);
    emb.input_dim = 11, emb.output_dim = 4, emb.embeddings_initializer = MPT_INIT_GPT2_NORMAL;
    memset(&pos, 0, sizeof pos);
    pos.sequence_length = 8;
    memset(&ln, 0, sizeof ln);
    ln.epsilon = 1e-5f, ln.no_center = 1;
    memset(&dense, 0, sizeof dense);
    dense.units = 6, dense.activation = MPT_ACT_GELU_TANH;
    two[0] = mpt_embedding(m, mpt_model_input(m), &emb);
    two[1] = mpt_position_embedding(m, two[0], &pos);
    two[0] = mpt_layer_normalization(m, mpt_add(m, 2, two, NULL), &ln);
    memset(&mha, 0, sizeof mha);
    mha.num_heads = 2, mha.key_dim = 3, mha.use_causal_mask = 1, mha.dropout = 0.1f;
    mha.no_flash_attention = 1;
    two[0] = mpt_multi_head_attention(m, two[0], two[0], &mha);
    dense.units = 6;
    two[0] = mpt_dense(m, two[0], &dense);
    dense.units = 2, dense.activation = MPT_ACT_NONE, dense.dtype = MPT_FLOAT32;
    mpt_dense(m, two[0], &dense);
    memset(&cd, 0, sizeof cd);
    cd.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    cd.metrics = MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_PRECISION;
    compiled_and_built(ctx, m, &cd);
    return m;
}

/* A model of three inputs (Keras' functional model with a list of
   inputs): input 0 numbers (3), an image (4, 4, 1) named "image" and ids
   (2) of another input, joined by a Concatenate; compiled. */
static mpt_model *inputs_model(mpt_context *ctx) {
    mpt_model *m = created(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1,
                                                  .policy = MPT_POLICY_MIXED_FLOAT16});
    mpt_input_desc image, ids;
    mpt_embedding_desc emb;
    mpt_dense_desc dense;
    mpt_compile_desc cd;
    mpt_node three[3];
    memset(&image, 0, sizeof image);
    image.shape[0] = image.shape[1] = 4, image.shape[2] = 1, image.rank = 3;
    image.name = "image";
    memset(&ids, 0, sizeof ids);
    ids.shape[0] = 2, ids.rank = 1, ids.dtype = MPT_INT32;
    memset(&emb, 0, sizeof emb);
    emb.input_dim = 7, emb.output_dim = 2;
    memset(&dense, 0, sizeof dense);
    dense.units = 2;
    three[1] = mpt_flatten(m, mpt_model_add_input(m, &image), NULL);
    three[2] = mpt_flatten(m, mpt_embedding(m, mpt_model_add_input(m, &ids), &emb), NULL);
    three[0] = mpt_dense(m, mpt_model_input(m), &dense);
    mpt_dense(m, mpt_concatenate(m, 3, three, NULL), &dense);
    memset(&cd, 0, sizeof cd);
    cd.loss.type = MPT_LOSS_MEAN_SQUARED_ERROR;
    compiled_and_built(ctx, m, &cd);
    return m;
}

/* A model of two outputs (Keras' functional model with a list of
   outputs): a classifier and a regression on one Dense, each its loss,
   loss weight and metrics; compiled. */
static mpt_model *outputs_model(mpt_context *ctx) {
    static const float weights[2] = {1.0f, 0.5f};
    mpt_model *m = created(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1});
    mpt_dense_desc dense, cls, reg;
    mpt_compile_desc cd;
    mpt_node h;
    memset(&dense, 0, sizeof dense);
    dense.units = 4;
    dense.activation = MPT_ACT_RELU;
    memset(&cls, 0, sizeof cls);
    cls.name = "cls";
    cls.units = 3;
    cls.activation = MPT_ACT_SOFTMAX;
    memset(&reg, 0, sizeof reg);
    reg.name = "reg";
    reg.units = 1;
    h = mpt_dense(m, mpt_model_input(m), &dense);
    mpt_model_add_output(m, mpt_dense(m, h, &cls));
    mpt_model_add_output(m, mpt_dense(m, h, &reg));
    memset(&cd, 0, sizeof cd);
    cd.losses[0].type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY;
    cd.losses[1].type = MPT_LOSS_MEAN_SQUARED_ERROR;
    cd.loss_weights = weights;
    cd.output_metrics[0] = MPT_METRIC_ACCURACY;
    cd.output_metrics[1] = MPT_METRIC_MEAN_ABSOLUTE_ERROR;
    compiled_and_built(ctx, m, &cd);
    return m;
}

int main(int argc, char **argv) {
    mpt_context *ctx;
    if (argc != 2) {
        fprintf(stderr, "usage: seeds DIR\n");
        return 2;
    }
    out_dir = argv[1];
    ctx = fuzz_context();
    idx_seed("three_4x5", 3, 4, 5);
    idx_seed("one_1x1", 1, 1, 1);
    idx_seed("ten_7x3", 10, 7, 3);
    npy_seed("f32_i64", "x_f32.npy", "y_i64.npy");
    npy_seed("f16_u8", "x_f16.npy", "y_u8.npy");
    npy_seed("v2_f32_targets", "x_f32_v2.npy", "y_f32.npy");
    npy_seed("v3_be", "x_f32_v3.npy", "y_i64_be.npy");
    npy_seed("u8_i32", "x_u8.npy", "y_i32.npy");
    npy_seed("f64_f16", "x_f64.npy", "y_f16.npy");
    npy_seed("stored", "xy.npz", NULL);
    npy_seed("deflated", "xy_z.npz", NULL);
    {
        static const char *const csv[] = {
            "a,b,y\n1,2,3\n4.5,-6e-3,7\n",
            "y,x\r\n0,0.25\r\n\r\n1, 1e3\r\n",
            "\xef\xbb\xbfp,q,r,y\n1,2,3,4\n5,6,7,8\n9,10,11,12\n"};
        char name[16];
        size_t k;
        for (k = 0; k < sizeof csv / sizeof *csv; k++) {
            snprintf(name, sizeof name, "rows%zu.csv", k);
            put("csv", name, csv[k], strlen(csv[k]));
        }
    }
    {
        static const char lines[] = "First Citizen:\nBefore we proceed any further, hear me "
                                    "speak.\n\nAll:\nSpeak, speak.\n";
        unsigned char every[256];
        int k;
        for (k = 0; k < 256; k++) every[k] = (unsigned char)k;
        put("text", "lines.txt", lines, strlen(lines));
        put("text", "every_byte.bin", every, sizeof every);
    }
    {
        static const char *const plain[] = {"weights", "checkpoint", "qat", NULL};
        static const char *const aware[] = {"qat", NULL};
        static const struct {
            mpt_model *(*build)(mpt_context *ctx);
            const char *file;
        } graphs[] = {
            {graph_model, "merges_graph.json"},
            {token_model, "token_ids.json"},
            {inputs_model, "three_inputs.json"},
            {outputs_model, "two_outputs.json"},
        };
        size_t k;
        mpt_model *m = fuzz_model(ctx, 1); /* other values than the harnesses' models */
        model_seeds(ctx, m, "", plain);
        mpt_model_destroy(m);
        m = fuzz_qat_model(ctx, 1);
        model_seeds(ctx, m, "qat_", aware);
        mpt_model_destroy(m);
        m = fuzz_model(ctx, 1);
        architecture_seed(ctx, m, "conv_bn_pool_dense.json");
        mpt_model_destroy(m);
        for (k = 0; k < sizeof graphs / sizeof graphs[0]; k++) {
            m = graphs[k].build(ctx);
            architecture_seed(ctx, m, graphs[k].file);
            mpt_model_destroy(m);
        }
    }
    mpt_context_destroy(ctx);
    return 0;
}

/* Tests of post-training quantization (mpt_model_quantize) and of the
   quantized model's predict, evaluate and invoke.

   The bounds are stated in quantization steps. An int8 product's output
   differs from the folded float32 model's by at most
       0.5·in_scale·Σ|w| (the input's rounding)
     + 0.5·w_scale[c]·Σ|x| (the weights' rounding)
     + 1.5·out_scale (the bias's and the output's rounding, one step for
                      the multiplier's and the requantization's)
   per element; a table activation by half an output step plus the
   input's half step times the activation's slope; pooling by one step.
   Integer results leave no tolerance: an int8 Dense against a scalar
   reference of TFLite's requantization, and every mode on 1, 2 and 3
   threads, bit for bit. */
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "helpers.h"

enum { H = 8, W = 8, C = 2, CLASSES = 4, N_SAMPLES = 96 };

static float sample_x[N_SAMPLES * H * W * C];
static int32_t sample_y[N_SAMPLES];

static void make_samples(unsigned long long seed) {
    int i;
    test_seed(seed);
    for (i = 0; i < N_SAMPLES * H * W * C; i++) sample_x[i] = (float)test_uniform(0.0, 1.0);
    for (i = 0; i < N_SAMPLES; i++) sample_y[i] = test_randint(0, CLASSES - 1);
}

static mpt_dataset *samples_dataset(mpt_context *ctx, int64_t n, const float *x) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    int64_t xs[4] = {n, H, W, C}, ys[1] = {n};
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, (void *)x);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, sample_y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* Every parameter from the seed: kernels and biases in ±0.5, BatchNormalization's
   gamma and variance in [0.5, 1.5], its beta and mean in ±0.3. */
static void randomize(mpt_model *m, unsigned long long seed) {
    int i, n = mpt_model_param_count(m);
    test_seed(seed);
    for (i = 0; i < n; i++) {
        mpt_param_info p;
        int64_t k, count;
        float lo = -0.5f, hi = 0.5f;
        mpt_model_param(m, i, &p);
        count = mpt_tensor_count(&p.value);
        if (strstr(p.name, "gamma") || strstr(p.name, "variance")) lo = 0.5f, hi = 1.5f;
        else if (strstr(p.name, "beta") || strstr(p.name, "mean")) lo = -0.3f, hi = 0.3f;
        for (k = 0; k < count; k++) ((float *)p.value.data)[k] = (float)test_uniform(lo, hi);
    }
    mpt_model_refresh_weights(m);
}

/* Rounds every weight of m to the nearest float16 value (so that a float16
   model of it computes with the very same weights). */
static void round_weights_to_half(mpt_context *ctx, mpt_model *m) {
    int i;
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info p;
        mpt_half *h;
        mpt_model_param(m, i, &p);
        h = (mpt_half *)malloc(sizeof(mpt_half) * (size_t)mpt_tensor_count(&p.value));
        mpt_convert(ctx, MPT_FLOAT16, h, MPT_FLOAT32, p.value.data, mpt_tensor_count(&p.value));
        mpt_convert(ctx, MPT_FLOAT32, p.value.data, MPT_FLOAT16, h, mpt_tensor_count(&p.value));
        free(h);
    }
    mpt_model_refresh_weights(m);
}

enum { MODEL_CNN, MODEL_GAP, MODEL_DENSE, MODEL_WIDE, MODEL_RESIDUAL, MODEL_MERGES,
       MODEL_BN_CHAIN, MODEL_BN_GRAPH, MODEL_BN_CHAIN16, MODEL_POOL_BRANCH };

/* Whether a kind is built as a graph (add_graph). */
static int is_graph(int kind) {
    return kind == MODEL_RESIDUAL || kind == MODEL_MERGES || kind == MODEL_BN_GRAPH ||
           kind == MODEL_POOL_BRANCH;
}

/* CNN: Conv2D → BatchNormalization → ReLU → MaxPooling2D → Conv2D(tanh)
   → AveragePooling2D('same') → Flatten → Dense(gelu) → Dropout →
   Dense(sigmoid) → Dense(softmax). GAP: Conv2D(relu) →
   GlobalAveragePooling2D → Dense(softmax). DENSE: Flatten → Dense(16) →
   BatchNormalization → Dense(4, relu). WIDE: Conv2D(300, 1×1) →
   MaxPooling2D → AveragePooling2D → Flatten → Dense(softmax): pooling
   over more channels than a block of its int32 sums. BN_CHAIN, the seed
   cnn's BatchNormalizations that do not fold: Conv2D(relu) →
   BatchNormalization → Conv2D(relu) → MaxPooling2D → Flatten →
   Dense(relu) → BatchNormalization → Dropout → Dense(softmax).
   BN_CHAIN16: Conv2D(16, relu) → BatchNormalization → Conv2D(relu) →
   Flatten → Dense(softmax), the chain over 16 channels (which the dynamic
   pass runs inside the second Conv2D's quantization). */
static void add_graph(mpt_model *m, int kind);

/* The BatchNormalization chains' start: a ReLU Conv2D of `filters`
   (same padding), the BatchNormalization the next Conv2D's quantization
   runs as a per-channel chain, then a ReLU Conv2D of 5 filters. */
static void add_conv_bn_conv(mpt_model *m, int64_t filters) {
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = filters, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 5, .kernel_size = {3, 3},
                                               .activation = MPT_ACT_RELU});
}

static void add_layers(mpt_model *m, int kind) {
    if (is_graph(kind)) {
        add_graph(m, kind);
    } else if (kind == MODEL_BN_CHAIN) {
        add_conv_bn_conv(m, 6);
        mpt_model_add_max_pooling2d(m, NULL);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 12, .activation = MPT_ACT_RELU});
        mpt_model_add_batch_normalization(m, NULL);
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.5f});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                                 .activation = MPT_ACT_SOFTMAX});
    } else if (kind == MODEL_CNN) {
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 6, .kernel_size = {3, 3},
                                                   .padding = MPT_PADDING_SAME});
        mpt_model_add_batch_normalization(m, NULL);
        mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
        mpt_model_add_max_pooling2d(m, NULL);
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 5, .kernel_size = {2, 2},
                                                   .activation = MPT_ACT_TANH});
        mpt_model_add_average_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {2, 2},
                                                              .strides = {1, 1},
                                                              .padding = MPT_PADDING_SAME});
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 12, .activation = MPT_ACT_GELU});
        mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.3f});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 7, .activation = MPT_ACT_SIGMOID});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                                 .activation = MPT_ACT_SOFTMAX});
    } else if (kind == MODEL_GAP) {
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 8, .kernel_size = {3, 3},
                                                   .strides = {2, 2},
                                                   .activation = MPT_ACT_RELU});
        mpt_model_add_global_average_pooling2d(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                                 .activation = MPT_ACT_SOFTMAX});
    } else if (kind == MODEL_BN_CHAIN16) {
        add_conv_bn_conv(m, 16);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                                 .activation = MPT_ACT_SOFTMAX});
    } else if (kind == MODEL_WIDE) {
        mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 300, .kernel_size = {1, 1}});
        mpt_model_add_max_pooling2d(m, NULL);
        mpt_model_add_average_pooling2d(m, NULL);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES,
                                                 .activation = MPT_ACT_SOFTMAX});
    } else {
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16});
        mpt_model_add_batch_normalization(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_RELU});
    }
}

/* The graphs (@layers' functional form). RESIDUAL, two blocks of
   ResNet's: Conv2D → BatchNormalization → ReLU (a) → Conv2D → BatchNormalization,
   Add with a, ReLU (r); then ZeroPadding2D → Conv2D(stride 2) →
   BatchNormalization → ReLU beside a 1×1 Conv2D(stride 2, 'same') of r,
   Add, ReLU, GlobalAveragePooling2D → Dense(softmax). MERGES: every other
   merge: c1 = Conv2D(relu), c2 = Conv2D(1×1, tanh) (a fixed scale of
   1/128 against c1's calibrated one), Subtract, Multiply, an Add of
   three, a Concatenate of four on the channels (inputs at four scales)
   read by a shared 1×1 Conv2D called twice (the second call on another
   Concatenate), the Average of the two and c1 beside c1 concatenated along
   the rows (axis 1), MaxPooling2D → Flatten → Dense(softmax). BN_GRAPH,
   BatchNormalizations that do not fold in a graph: one on the input, one
   after a Conv2D that two layers read (a: its BatchNormalization → ReLU
   beside a 1×1 Conv2D of a), one after their Add, then ReLU (fused into
   the ADD of its shift), GlobalAveragePooling2D → Dense(softmax).
   POOL_BRANCH: a Conv2D(relu) that the MaxPooling2D after it reads, and a
   later GlobalAveragePooling2D too (so the two may not run as one): the
   Add of both poolings' GlobalAveragePooling2D → Dense(softmax). */
static void add_graph(mpt_model *m, int kind) {
    mpt_node x = mpt_model_input(m), a, b, r, c, d, two[2], four[4];
    const mpt_activation_desc relu = {.activation = MPT_ACT_RELU};
    if (kind == MODEL_POOL_BRANCH) {
        a = mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                                .padding = MPT_PADDING_SAME,
                                                .activation = MPT_ACT_RELU});
        two[0] = mpt_global_average_pooling2d(m, mpt_max_pooling2d(m, a, NULL), NULL);
        two[1] = mpt_global_average_pooling2d(m, a, NULL);
        mpt_dense(m, mpt_add(m, 2, two, NULL),
                  &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        return;
    }
    if (kind == MODEL_BN_GRAPH) {
        a = mpt_conv2d(m, mpt_batch_normalization(m, x, NULL),
                       &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                          .padding = MPT_PADDING_SAME});
        two[0] = mpt_activation_layer(m, mpt_batch_normalization(m, a, NULL), &relu);
        two[1] = mpt_conv2d(m, a, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {1, 1}});
        r = mpt_activation_layer(m, mpt_batch_normalization(m, mpt_add(m, 2, two, NULL), NULL),
                                 &relu);
        mpt_dense(m, mpt_global_average_pooling2d(m, r, NULL),
                  &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        return;
    }
    if (kind == MODEL_RESIDUAL) {
        a = mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                                .padding = MPT_PADDING_SAME});
        a = mpt_activation_layer(m, mpt_batch_normalization(m, a, NULL), &relu);
        b = mpt_conv2d(m, a, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                                .padding = MPT_PADDING_SAME});
        two[0] = mpt_batch_normalization(m, b, NULL), two[1] = a;
        r = mpt_activation_layer(m, mpt_add(m, 2, two, NULL), &relu);
        c = mpt_conv2d(m, mpt_zero_padding2d(m, r, NULL),
                       &(mpt_conv2d_desc){.filters = 6, .kernel_size = {3, 3}, .strides = {2, 2}});
        c = mpt_activation_layer(m, mpt_batch_normalization(m, c, NULL), &relu);
        d = mpt_conv2d(m, r, &(mpt_conv2d_desc){.filters = 6, .kernel_size = {1, 1},
                                                .strides = {2, 2}, .padding = MPT_PADDING_SAME});
        two[0] = c, two[1] = d;
        r = mpt_activation_layer(m, mpt_add(m, 2, two, NULL), &relu);
        mpt_dense(m, mpt_global_average_pooling2d(m, r, NULL),
                  &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
        return;
    }
    a = mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                            .padding = MPT_PADDING_SAME,
                                            .activation = MPT_ACT_RELU});
    b = mpt_conv2d(m, x, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {1, 1},
                                            .activation = MPT_ACT_TANH});
    two[0] = a, two[1] = b;
    four[0] = mpt_subtract(m, 2, two, NULL);
    four[1] = mpt_multiply(m, 2, two, NULL);
    {
        mpt_node three[3];
        three[0] = a, three[1] = b, three[2] = four[0];
        four[2] = mpt_add(m, 3, three, NULL);
    }
    four[3] = b;
    c = mpt_conv2d(m, mpt_concatenate(m, 4, four, NULL),
                   &(mpt_conv2d_desc){.name = "shared", .filters = 4, .kernel_size = {1, 1}});
    four[3] = four[0], four[0] = a;
    d = mpt_apply_layer(m, "shared", 1, (mpt_node[]){mpt_concatenate(m, 4, four, NULL)});
    {
        mpt_node three[3];
        three[0] = c, three[1] = d, three[2] = a;
        two[0] = mpt_average(m, 3, three, NULL), two[1] = a;
    }
    r = mpt_concatenate(m, 2, two, &(mpt_concatenate_desc){.axis = 1});
    r = mpt_flatten(m, mpt_max_pooling2d(m, r, NULL), NULL);
    mpt_dense(m, r, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
}

/* A model of that kind, built for batches of 32, its weights random from seed. */
static mpt_model *make_model(mpt_context *ctx, int kind, unsigned long long seed) {
    mpt_model *m = NULL;
    mpt_status s;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                                  .seed = 7}, &m) == MPT_OK, "create");
    if (!m) return NULL;
    add_layers(m, kind);
    s = mpt_model_build(m, 32);
    CHECK(s == MPT_OK, "build: %s", mpt_context_error(ctx));
    randomize(m, seed);
    return m;
}

static mpt_model *quantize(mpt_model *m, mpt_quantize_mode mode, const mpt_dataset *rep,
                           mpt_dtype io) {
    mpt_model *q = NULL;
    mpt_status s = mpt_model_quantize(m, &(mpt_quantize_desc){.mode = mode,
                                                              .representative_data = rep,
                                                              .io_dtype = io}, &q);
    CHECK(s == MPT_OK, "quantize mode %d: %s", (int)mode, mpt_context_error(m->ctx));
    return q;
}

/* ---- rounding ---------------------------------------------------------------------------- */

/* The quantizers' rounding is roundf's (ties away from zero, TFLite's
   TfLiteRound): on the ties, their neighbours, and random values. */
static void test_rounding_ties_away_from_zero(void) {
    static const float ties[] = {0.5f, 1.5f, 2.5f, 126.5f, 127.5f, 0.49999997f, 2.5000002f,
                                 1e6f + 0.5f, 8388607.5f, 3e9f, 0.0f};
    int i, bad = 0;
    test_seed(21);
    for (i = 0; i < 2 * 11 + 100000; i++) {
        float v = i < 22 ? (i & 1 ? -ties[i / 2] : ties[i / 2]) : (float)test_uniform(-130, 130);
        bad += mpt__q_round(v) != roundf(v);
        /* symmetric int8: −127 is the lowest code */
        if (fabsf(v) <= 127.5f) bad += mpt__q_round_small(v) != fmaxf(-127, mpt__q_clamp8(roundf(v)));
    }
    CHECK(bad == 0, "%d values rounded unlike roundf", bad);
}

/* ---- BatchNormalization folded, in float32 -------------------------------------------- */

/* The folded operations in float32 against the float model's own predict:
   the same function, up to float32 rounding. */
static void test_batchnorm_folding_float(void) {
    static const int kinds[] = {MODEL_CNN,      MODEL_GAP,      MODEL_DENSE, MODEL_RESIDUAL,
                                MODEL_MERGES,   MODEL_BN_CHAIN, MODEL_BN_GRAPH};
    int ki;
    make_samples(11);
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++) {
        const int kind = kinds[ki];
        mpt_context *ctx = quiet_ctx();
        mpt_model *m = make_model(ctx, kind, 100 + (unsigned)kind);
        mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
        mpt__quantized Q;
        mpt__qwork w;
        mpt_tensor ref;
        const void *out = NULL;
        int64_t k, count;
        double worst = 0, largest = 0;
        memset(&Q, 0, sizeof Q);
        memset(&w, 0, sizeof w);
        CHECK(mpt_model_predict(m, d, 32, &ref) == MPT_OK, "predict");
        CHECK(mpt__q_build_ops(m, &Q) == MPT_OK, "ops: %s", mpt_context_error(ctx));
        CHECK(mpt__q_plan(ctx, &Q, H * W * C) == MPT_OK, "plan");
        CHECK(mpt__qwork_alloc(ctx, &Q, N_SAMPLES, &w) == MPT_OK, "work");
        CHECK(kind == MODEL_GAP || kind == MODEL_MERGES || kind >= MODEL_BN_CHAIN ||
                  Q.ops[0].info.folded_batchnorm ||
                  Q.ops[1].info.folded_batchnorm, "model %d: no BatchNormalization folded", kind);
        if (kind == MODEL_RESIDUAL) { /* all three, a graph's too */
            int i, folded = 0;
            for (i = 0; i < Q.n_ops; i++) folded += Q.ops[i].info.folded_batchnorm != NULL;
            CHECK(folded == 3, "residual: %d BatchNormalizations folded, want 3", folded);
        }
        if (kind >= MODEL_BN_CHAIN) { /* none folds: each a MUL by its scale, an ADD of its shift */
            int i, pairs = 0, folded = 0;
            for (i = 0; i < Q.n_ops; i++) {
                folded += Q.ops[i].info.folded_batchnorm != NULL;
                pairs += Q.ops[i].info.op == MPT_QOP_MUL && Q.ops[i].info.n_constants > 0 &&
                         i + 1 < Q.n_ops && Q.ops[i + 1].info.op == MPT_QOP_ADD &&
                         Q.ops[i + 1].info.n_constants == Q.ops[i].info.n_constants &&
                         Q.ops[i + 1].in_t[0] == i + 1;
            }
            CHECK(folded == 0 && pairs == (kind == MODEL_BN_CHAIN ? 2 : 3),
                  "model %d: %d folded, %d scale-and-shift pairs", kind, folded, pairs);
        }
        if (w.block)
            CHECK(mpt__q_forward(ctx, &Q, MPT__QX_REFERENCE, sample_x, N_SAMPLES, &w, NULL,
                                 &out) == MPT_OK, "forward");
        count = mpt_tensor_count(&ref);
        for (k = 0; k < count; k++)
            largest = fmax(largest, fabs(((const float *)ref.data)[k]));
        for (k = 0; out && k < count; k++) {
            double e = fabs(((const float *)out)[k] - ((const float *)ref.data)[k]);
            worst = e > worst ? e : worst;
        }
        /* float32 rounding in sums of up to 128 terms: a few ulps of the largest output */
        CHECK(out && worst <= 1e-5 * largest, "model %d: folded float32 differs by %g (largest "
              "output %g)", kind, worst, largest);
        mpt_tensor_free(ctx, &ref);
        mpt__free(ctx, w.block);
        Q.tensor = NULL;
        {
            int i;
            for (i = 0; i < Q.n_ops; i++) mpt__qop_free(ctx, &Q.ops[i]);
            mpt__free(ctx, Q.ops);
            mpt__free(ctx, Q.root);
            mpt__free(ctx, Q.slot);
        }
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
}

/* ---- each operation against the folded float32 one ------------------------------------------ */

static double slope(mpt_activation act) {
    return act == MPT_ACT_SIGMOID ? 0.25 : act == MPT_ACT_GELU ? 1.13 : 1.0;
}

/* Σ|row| over each of the rows (the largest), for the bound of a product. */
static double largest_abs_row(const float *x, int64_t rows, int64_t cols) {
    double best = 0;
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        double s = 0;
        for (c = 0; c < cols; c++) s += fabs(x[r * cols + c]);
        best = s > best ? s : best;
    }
    return best;
}

/* A graph's operation i (a merge, or ZeroPadding2D) in full integer on
   its reference inputs quantized, against the reference output. Each
   input's rounding is half its step; ADD and SUB add the two, MUL takes
   each times the other's magnitude (|a|·s_b/2 + |b|·s_a/2 + s_a·s_b/4),
   a CONCATENATION input requantized to the output's scale rounds once
   more; then the output's own rounding: within its step with the
   fixed-point multipliers'. */
static void check_integer_graph_op(mpt__quantized *Q, int i, float **ref, int64_t n) {
    const mpt__qop *op = &Q->ops[i];
    const mpt_quant_params *o = &op->info.output;
    const int64_t count = n * op->out_count;
    int8_t *xq[MPT_MAX_MERGE_INPUTS], *yq = (int8_t *)malloc((size_t)count);
    const void *xs[MPT_MAX_MERGE_INPUTS];
    double worst = 0;
    int64_t k, r, c, at = 0;
    int j;
    for (j = 0; j < op->info.n_inputs; j++) {
        const int t = op->in_t[j];
        const int64_t in_count = t ? Q->ops[t - 1].out_count : Q->in_count;
        xq[j] = (int8_t *)malloc((size_t)(n * in_count));
        for (k = 0; k < n * in_count; k++) xq[j][k] = mpt__q_quantize(ref[t][k], &Q->tensor[t]);
        xs[j] = xq[j];
    }
    if (op->info.op == MPT_QOP_PAD) mpt__q_pad(op, 1, xs[0], yq, n);
    else if (op->info.op == MPT_QOP_CONCATENATION) mpt__q_concat(op, 1, xs, yq, n);
    else mpt__q_binary(op, 1, xs[0], op->info.n_inputs > 1 ? xs[1] : NULL, yq, count);
    for (k = 0; k < count; k++) {
        const double got = (yq[k] - o->zero_point) * (double)o->scale, want = ref[i + 1][k];
        double bound = o->scale + 1e-6;
        if (op->info.op == MPT_QOP_ADD || op->info.op == MPT_QOP_SUB) {
            bound += 0.5 * (Q->tensor[op->in_t[0]].scale + Q->tensor[op->in_t[1]].scale);
        } else if (op->info.n_constants) { /* by a constant per channel, itself rounded */
            const double si = Q->tensor[op->in_t[0]].scale, sc = op->info.constant_params.scale;
            const double cv = op->info.constants[k % op->info.n_constants];
            bound += op->info.op == MPT_QOP_ADD
                         ? 0.5 * (si + sc)
                         : 0.5 * si * fabs(cv) + 0.5 * sc * fabs(ref[op->in_t[0]][k]) + 0.25 * si * sc;
        } else if (op->info.op == MPT_QOP_MUL && op->info.n_inputs == 1) { /* by 1/n, exact */
            bound += 0.5 * Q->tensor[op->in_t[0]].scale * op->info.constant;
        } else if (op->info.op == MPT_QOP_MUL) {
            const double sa = Q->tensor[op->in_t[0]].scale, sb = Q->tensor[op->in_t[1]].scale;
            bound += 0.5 * fabs(ref[op->in_t[0]][k]) * sb + 0.5 * fabs(ref[op->in_t[1]][k]) * sa +
                     0.25 * sa * sb;
        } else if (op->info.op == MPT_QOP_PAD) {
            bound = 0.5 * o->scale + 1e-6; /* the padding is exactly 0 */
        }
        if (fabs(got - want) > bound * 1.0001 && fabs(got - want) / bound > worst)
            worst = fabs(got - want) / bound;
    }
    if (op->info.op == MPT_QOP_CONCATENATION) /* each input's half step, by where it went */
        for (j = 0; j < op->info.n_inputs; at += op->inner[j], j++)
            for (r = 0; r < n * op->outer; r++)
                for (c = 0; c < op->inner[j]; c++) {
                    const int64_t e = r * (op->out_count / op->outer) + at + c;
                    const double got = (yq[e] - o->zero_point) * (double)o->scale;
                    const double bound = 0.5 * Q->tensor[op->in_t[j]].scale +
                                         (op->in_mult[j] ? o->scale : 0) + 1e-6;
                    if (fabs(got - ref[i + 1][e]) > bound * 1.0001)
                        worst = fmax(worst, fabs(got - ref[i + 1][e]) / bound);
                }
    CHECK(worst == 0, "op %d (%s, kind %d): %g times its bound", i, op->name, (int)op->info.op,
          worst);
    for (j = 0; j < op->info.n_inputs; j++) free(xq[j]);
    free(yq);
}

/* Operation i in full integer on the reference input quantized, against
   the reference output (both in `ref`, one buffer per tensor). */
static void check_integer_op(mpt_context *ctx, mpt__quantized *Q, int i, float **ref, int64_t n,
                             mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    const mpt_quant_params *in = &op->info.input, *o = &op->info.output;
    const float *x = ref[op->in_t[0]]; /* in a chain, ref[i] */
    int64_t k, count = n * op->out_count, c;
    int8_t *xq, *yq;
    double worst = 0, x_sum = 0;
    if (mpt__qop_is_merge(op) || op->info.op == MPT_QOP_PAD) {
        check_integer_graph_op(Q, i, ref, n);
        return;
    }
    xq = (int8_t *)malloc((size_t)(n * op->in_count)), yq = (int8_t *)malloc((size_t)count);
    for (k = 0; k < n * op->in_count; k++) xq[k] = mpt__q_quantize(x[k], in);
    CHECK(mpt__q_run_op(ctx, Q, i, MPT__QX_INTEGER, xq, yq, n, w) == MPT_OK, "op %d", i);
    if (op->info.op == MPT_QOP_CONV_2D)
        x_sum = (double)op->info.depth * (in->max > -in->min ? in->max : -in->min);
    else if (op->info.op == MPT_QOP_FULLY_CONNECTED)
        x_sum = largest_abs_row(x, n, op->in_count);
    for (k = 0; k < count; k++) {
        double got = (yq[k] - o->zero_point) * (double)o->scale, want = ref[i + 1][k], bound;
        c = k % (op->info.out_channels ? op->info.out_channels : 1);
        if (op->info.op == MPT_QOP_CONV_2D || op->info.op == MPT_QOP_FULLY_CONNECTED) {
            double w_sum = 0;
            int64_t j;
            for (j = 0; j < op->info.depth; j++)
                w_sum += fabs(op->info.weights[c * op->info.depth + j] * (double)op->info.weight_scales[c]);
            bound = 0.5 * in->scale * w_sum + 0.5 * op->info.weight_scales[c] * x_sum + 1.5 * o->scale;
            if (op->info.activation == MPT_ACT_RELU && want < 0) want = 0;
        } else if (op->info.op == MPT_QOP_ACTIVATION) {
            bound = op->info.activation == MPT_ACT_SOFTMAX ? o->scale + in->scale
                                                           : 0.5 * o->scale + 0.5 * in->scale * slope(op->info.activation) + 1e-6;
        } else {
            bound = o->scale + 1e-6;
        }
        if (fabs(got - want) > bound * 1.0001 && fabs(got - want) / bound > worst)
            worst = fabs(got - want) / bound;
    }
    CHECK(worst == 0, "op %d (%s, kind %d): %g times its bound", i, op->name, (int)op->info.op,
          worst);
    if (op->info.op == MPT_QOP_ACTIVATION && op->info.activation == MPT_ACT_SOFTMAX) {
        /* TFLite's int8 softmax exactly: round(256·p) − 128 from the int8
           logits, p in double (a code off by one only at a tie) */
        int64_t cols = op->info.out_shape[0], r, j, off = 0;
        for (r = 0; r < n; r++) {
            const int8_t *z = xq + r * cols;
            double sum = 0, max = -128;
            for (j = 0; j < cols; j++) max = z[j] > max ? z[j] : max;
            for (j = 0; j < cols; j++) sum += exp(-(double)in->scale * (max - z[j]));
            for (j = 0; j < cols; j++) {
                double v = 256.0 * exp(-(double)in->scale * (max - z[j])) / sum;
                double want = fmin(127, floor(v + 0.5) - 128);
                off += yq[r * cols + j] != want && fabs(v - floor(v) - 0.5) > 1e-3;
            }
        }
        CHECK(off == 0, "softmax: %lld codes differ from round(256·p) − 128", (long long)off);
    }
    free(xq);
    free(yq);
}

/* Dynamic range on one product: the inputs quantized per sample. */
static void check_dynamic_op(mpt_context *ctx, mpt__quantized *Q, int i, float **ref, int64_t n,
                             mpt__qwork *w) {
    const mpt__qop *op = &Q->ops[i];
    const float *x = ref[op->in_t[0]]; /* in a chain, ref[i] */
    int64_t k, count = n * op->out_count;
    float *y = (float *)malloc(sizeof(float) * (size_t)count);
    double worst = 0, amax = 0, x_sum;
    for (k = 0; k < n * op->in_count; k++) amax = fabs(x[k]) > amax ? fabs(x[k]) : amax;
    x_sum = op->info.op == MPT_QOP_CONV_2D ? op->info.depth * amax
                                           : largest_abs_row(x, n, op->in_count);
    CHECK(mpt__q_run_op(ctx, Q, i, MPT__QX_DYNAMIC, x, y, n, w) == MPT_OK, "op %d", i);
    for (k = 0; k < count; k++) {
        int64_t c = k % op->info.out_channels, j;
        double w_sum = 0, bound, want = ref[i + 1][k];
        for (j = 0; j < op->info.depth; j++)
            w_sum += fabs(op->info.weights[c * op->info.depth + j] * (double)op->info.weight_scales[c]);
        /* the input's scale is at most the whole batch's largest / 127 */
        bound = 0.5 * (amax / 127) * w_sum + 0.5 * op->info.weight_scales[c] * x_sum + 1e-5;
        if (fabs(y[k] - want) > bound && fabs(y[k] - want) / bound > worst)
            worst = fabs(y[k] - want) / bound;
    }
    CHECK(worst == 0, "dynamic op %d (%s): %g times its bound", i, op->name, worst);
    free(y);
}

/* The folded float32 reference of every tensor of a graph, each operation
   run on its own inputs' tensors: ref[0] the samples, ref[i + 1] op i's
   output (allocated here). */
static void graph_reference(mpt_context *ctx, mpt__quantized *R, float **ref, int64_t n,
                            mpt__qwork *w) {
    int i, k;
    for (i = 0; i < R->n_ops; i++) {
        const mpt__qop *op = &R->ops[i];
        const void *xs[MPT_MAX_MERGE_INPUTS] = {NULL}; /* n_inputs ≥ 1 set below */
        ref[i + 1] = (float *)malloc(sizeof(float) * (size_t)(n * op->out_count));
        for (k = 0; k < op->info.n_inputs; k++) xs[k] = ref[op->in_t[k]];
        if (op->info.op == MPT_QOP_PAD) mpt__q_pad(op, 0, xs[0], ref[i + 1], n);
        else if (op->info.op == MPT_QOP_CONCATENATION) mpt__q_concat(op, 0, xs, ref[i + 1], n);
        else if (mpt__qop_is_merge(op))
            mpt__q_binary(op, 0, xs[0], op->info.n_inputs > 1 ? xs[1] : NULL, ref[i + 1],
                          n * op->out_count);
        else
            CHECK(mpt__q_run_op(ctx, R, i, MPT__QX_REFERENCE, xs[0], ref[i + 1], n, w) == MPT_OK,
                  "reference op %d", i);
    }
}

/* The reference of m's quantization: its folded float32 operations (R),
   their work block w and every tensor they give on the samples, ref[0]
   the input and ref[i + 1] operation i's output (ref holds `room`). */
static void reference_open(mpt_context *ctx, mpt_model *m, mpt__quantized *R, float **ref,
                           int room, mpt__qwork *w) {
    memset(R, 0, sizeof *R);
    CHECK(mpt__q_build_ops(m, R) == MPT_OK, "ops");
    CHECK(R->n_ops < room && mpt__q_plan(ctx, R, H * W * C) == MPT_OK, "plan");
    CHECK(mpt__qwork_alloc(ctx, R, N_SAMPLES, w) == MPT_OK, "work");
    ref[0] = sample_x;
    graph_reference(ctx, R, ref, N_SAMPLES, w);
}

static void reference_close(mpt_context *ctx, mpt__quantized *R, float **ref, mpt__qwork *w) {
    int i;
    for (i = 0; i < R->n_ops; i++) {
        free(ref[i + 1]);
        mpt__qop_free(ctx, &R->ops[i]);
    }
    mpt__free(ctx, R->ops);
    mpt__free(ctx, R->root);
    mpt__free(ctx, R->slot);
    mpt__free(ctx, w->block);
}

static void test_layers_within_steps(void) {
    int kind;
    make_samples(12);
    for (kind = MODEL_CNN; kind <= MODEL_BN_CHAIN; kind++) {
        mpt_context *ctx;
        mpt_model *m;
        if (is_graph(kind)) continue; /* test_graph_ops_within_steps */
        ctx = quiet_ctx();
        m = make_model(ctx, kind, 200 + (unsigned)kind);
        mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
        mpt_model *qi = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
        mpt_model *qd = quantize(m, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, MPT_DTYPE_DEFAULT);
        mpt__quantized R;
        mpt__qwork w;
        float *ref[32];
        int i, checked = 0;
        reference_open(ctx, m, &R, ref, 32, &w); /* a chain's too: each reads the one before */
        for (i = 0; qi && qd && i < R.n_ops; i++) {
            check_integer_op(ctx, qi->quantized, i, ref, N_SAMPLES, &w);
            if (mpt__qop_weighted(&R.ops[i])) check_dynamic_op(ctx, qd->quantized, i, ref, N_SAMPLES, &w);
            checked++;
        }
        CHECK(checked == R.n_ops && checked > 0, "model %d: %d operations checked", kind, checked);
        reference_close(ctx, &R, ref, &w);
        mpt_model_destroy(qi);
        mpt_model_destroy(qd);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
}

/* ---- graphs ----------------------------------------------------------------------------- */

/* Each operation of the two graphs in full integer (and each product in
   dynamic range) within its bound of the folded float32 reference, on its
   own inputs (the merges' bounds: check_integer_graph_op); and each
   merge's output range calibrated (min/max) on the samples is the range
   of the reference's values there. */
static void test_graph_ops_within_steps(void) {
    int kind;
    make_samples(16);
    for (kind = MODEL_RESIDUAL; kind <= MODEL_BN_GRAPH; kind++) {
        mpt_context *ctx;
        mpt_model *m;
        if (!is_graph(kind)) continue;
        ctx = quiet_ctx();
        m = make_model(ctx, kind, 210 + (unsigned)kind);
        mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
        mpt_model *qi = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
        mpt_model *qd = quantize(m, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, MPT_DTYPE_DEFAULT);
        mpt__quantized R;
        mpt__qwork w;
        float *ref[64];
        int i, merges = 0, ranges = 0;
        int64_t k;
        reference_open(ctx, m, &R, ref, 64, &w);
        for (i = 0; qi && qd && i < R.n_ops; i++) {
            const mpt__qop *op = &qi->quantized->ops[i];
            check_integer_op(ctx, qi->quantized, i, ref, N_SAMPLES, &w);
            if (mpt__qop_weighted(&R.ops[i]))
                check_dynamic_op(ctx, qd->quantized, i, ref, N_SAMPLES, &w);
            merges += mpt__qop_is_merge(op) || op->info.op == MPT_QOP_PAD;
            if (mpt__qop_is_merge(op)) {
                float lo = INFINITY, hi = -INFINITY;
                double tol;
                for (k = 0; k < N_SAMPLES * op->out_count; k++)
                    lo = fminf(lo, ref[i + 1][k]), hi = fmaxf(hi, ref[i + 1][k]);
                tol = 1e-5 * (fabs(lo) + fabs(hi)); /* batches of 32 against one of 96 */
                CHECK(fabs(op->info.output.min - lo) <= tol &&
                          fabs(op->info.output.max - hi) <= tol,
                      "op %d (%s): calibrated [%g, %g], the reference's values [%g, %g]", i,
                      op->name, op->info.output.min, op->info.output.max, lo, hi);
                ranges++;
            }
        }
        for (i = 0; qi && i < qi->quantized->n_ops; i++) { /* a file's names are its own */
            int j;
            for (j = 0; j < i; j++)
                CHECK(strcmp(qi->quantized->ops[i].name, qi->quantized->ops[j].name) != 0 ||
                          qi->quantized->ops[i].info.op == MPT_QOP_ACTIVATION,
                      "ops %d and %d are both named '%s'", j, i, qi->quantized->ops[i].name);
        }
        /* residual: ZeroPadding2D and two ADDs; merges: SUB, MUL, two ADDs
           of the Add of three, three CONCATENATIONs, the Average's two
           ADDs and MUL by 1/3; BatchNormalizations: three MULs by a scale
           and ADDs of a shift, and the Add */
        CHECK(merges == (kind == MODEL_RESIDUAL ? 3 : kind == MODEL_MERGES ? 10 : 7) &&
                  ranges == merges - (kind == MODEL_RESIDUAL),
              "model %d: %d graph operations checked, %d ranges", kind, merges, ranges);
        reference_close(ctx, &R, ref, &w);
        mpt_model_destroy(qi);
        mpt_model_destroy(qd);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
}

/* TFLite's fixed-point helpers, written out from their definitions (for
   the scalar references): SaturatingRoundingDoublingHighMul, then
   RoundingDivideByPOT as gemmlowp writes it (mask and threshold). */
static int32_t ref_high_mul(int32_t a, int32_t b) {
    long long ab = (long long)a * b, nudge = ab >= 0 ? (1LL << 30) : 1 - (1LL << 30);
    if (a == INT32_MIN && b == INT32_MIN) return INT32_MAX;
    return (int32_t)((ab + nudge) / (1LL << 31));
}

static int32_t ref_divide_pot(int32_t x, int e) {
    const int32_t mask = (int32_t)((1LL << e) - 1), rem = x & mask;
    const int32_t threshold = (mask >> 1) + (x < 0);
    return (x >> e) + (rem > threshold);
}

static int32_t ref_mbqm(int32_t x, int32_t m, int shift) {
    const int left = shift > 0 ? shift : 0, right = shift > 0 ? 0 : -shift;
    return ref_divide_pot(ref_high_mul((int32_t)(x * (1LL << left)), m), right);
}

/* QuantizeMultiplier: q·2^shift = real, q in [0.5, 1) as Q31. */
static void ref_multiplier(double real, int32_t *m, int *shift) {
    long long q = llround(frexp(real, shift) * (double)(1LL << 31));
    if (q == (1LL << 31)) q /= 2, ++*shift;
    *m = (int32_t)q;
}

static int8_t ref_sat8(int32_t v) { return (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v); }

/* The int8 ADD, SUB and MUL of the merges graph (their tables of every
   pair of codes, which predict looks up) on every pair of input
   codes, and its CONCATENATIONs' requantized inputs on every code, bit for
   bit against TFLite's reference kernels written from their arithmetic:
   ADD/SUB ((a − za)·2^20 and (b − zb)·2^20 each times its multiplier of
   s/(2·max(sa, sb)), added or subtracted, times 2·max/(2^20·so), plus zo),
   MUL ((a − za)(b − zb) times sa·sb/so, plus zo), QUANTIZE int8 to int8
   ((a − za) times sa/so, plus zo). */
static void test_graph_merge_scalar_reference(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q;
    mpt_dataset *d;
    int i, checked = 0, requantized = 0;
    long long off = 0;
    make_samples(17);
    m = make_model(ctx, MODEL_MERGES, 230);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
    for (i = 0; q && i < q->quantized->n_ops; i++) {
        const mpt__quantized *Q = q->quantized;
        const mpt__qop *op = &Q->ops[i];
        const mpt_quant_params *o = &op->info.output;
        int a, b, k;
        if (op->info.op == MPT_QOP_ADD || op->info.op == MPT_QOP_SUB ||
            op->info.op == MPT_QOP_MUL) {
            /* an Average's MUL by 1/n: the constant as code 127 at (1/n)/127 */
            const mpt_quant_params constant = {op->info.constant / 127.0f, 0, 0, 0};
            const int by_constant = op->info.n_inputs == 1;
            const mpt_quant_params *pa = &Q->tensor[op->in_t[0]];
            const mpt_quant_params *pb = by_constant ? &constant : &Q->tensor[op->in_t[1]];
            const double twice = 2.0 * fmax(pa->scale, pb->scale);
            int32_t ma, mb, mo;
            int sa, sb, so;
            CHECK(by_constant || op->pair_lut, "op %d: two inputs and no table of their codes",
                  i); /* so the pairs below are what predict looks up */
            ref_multiplier(pa->scale / twice, &ma, &sa);
            ref_multiplier(pb->scale / twice, &mb, &sb);
            if (op->info.op == MPT_QOP_MUL)
                ref_multiplier((double)pa->scale * pb->scale / o->scale, &mo, &so);
            else
                ref_multiplier(twice / ((double)(1 << 20) * o->scale), &mo, &so);
            for (a = -128; a < 128; a++)
                for (b = by_constant ? 127 : -128; b < 128; b++) {
                    int8_t x0 = (int8_t)a, x1 = (int8_t)b, got, want;
                    int32_t raw;
                    mpt__q_binary(op, 1, &x0, by_constant ? NULL : &x1, &got, 1);
                    if (op->info.op == MPT_QOP_MUL) {
                        raw = ref_mbqm((a - pa->zero_point) * (b - pb->zero_point), mo, so);
                    } else {
                        const int32_t va = ref_mbqm((a - pa->zero_point) * (1 << 20), ma, sa);
                        const int32_t vb = ref_mbqm((b - pb->zero_point) * (1 << 20), mb, sb);
                        raw = ref_mbqm(op->info.op == MPT_QOP_SUB ? va - vb : va + vb, mo, so);
                    }
                    want = ref_sat8(raw + o->zero_point);
                    if (op->info.activation == MPT_ACT_RELU && want < o->zero_point)
                        want = (int8_t)o->zero_point; /* a fused ReLU */
                    off += got != want;
                }
            checked++;
        } else if (op->info.op == MPT_QOP_CONCATENATION) {
            for (k = 0; k < op->info.n_inputs; k++) {
                const mpt_quant_params *p = &Q->tensor[op->in_t[k]];
                const int same = p->scale == o->scale && p->zero_point == o->zero_point;
                int32_t mq;
                int sq;
                ref_multiplier((double)p->scale / o->scale, &mq, &sq);
                requantized += !same;
                for (a = -128; a < 128; a++) {
                    int8_t in[MPT_MAX_MERGE_INPUTS], out[64 * MPT_MAX_MERGE_INPUTS];
                    const void *xs[MPT_MAX_MERGE_INPUTS];
                    mpt__qop one = *op; /* one sample of one element per input */
                    int j;
                    one.outer = 1, one.out_count = op->info.n_inputs;
                    for (j = 0; j < op->info.n_inputs; j++)
                        one.inner[j] = 1, in[j] = (int8_t)a, xs[j] = &in[j];
                    mpt__q_concat(&one, 1, xs, out, 1);
                    off += out[k] != (same ? (int8_t)a
                                           : ref_sat8(ref_mbqm(a - p->zero_point, mq, sq) +
                                                      o->zero_point));
                }
            }
            checked++;
        }
    }
    CHECK(checked == 10, "%d merges checked, want 10", checked);
    CHECK(requantized >= 3, "only %d concatenated inputs at another scale than their output's",
          requantized);
    CHECK(off == 0, "%lld codes differ from TFLite's arithmetic", off);
    mpt_model_destroy(q);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* Layer `layer`'s parameter `what` ("gamma"), from the float model's masters. */
static const float *param_of(mpt_model *m, const char *layer, const char *what) {
    mpt_param_info p;
    return test_param_named(m, layer, what, &p) ? (const float *)p.value.data : NULL;
}

/* A BatchNormalization that does not fold, in full integer: its MUL by
   the scale and ADD of the shift per channel (both graphs' and the seed
   cnn's chain). The constants are the float model's: s[c] = gamma[c] ·
   (float)(1/sqrt(var + eps)) to the bit, shift[c] = beta[c] − mean[c]·s[c]
   rounded once; their int8 codes symmetric per tensor (scale max|c|/127,
   each code within half a step, ±127 at the largest); and every input
   code on every channel gives TFLite's int8 MUL ((a − za)·q_c times
   sa·sc/so, plus zo) or ADD (each less its zero point, shifted 20 bits,
   times its multiplier of s/(2·max(sa, sc)), added, times 2·max/(2^20·so),
   plus zo; a fused ReLU clamped at zo), bit for bit. */
static void test_scale_shift_scalar_reference(void) {
    static const int kinds[] = {MODEL_BN_CHAIN, MODEL_BN_GRAPH};
    int ki, checked = 0;
    long long off = 0, constants_off = 0;
    make_samples(19);
    for (ki = 0; ki < 2; ki++) {
        mpt_context *ctx = quiet_ctx();
        mpt_model *m = make_model(ctx, kinds[ki], 250 + (unsigned)ki);
        mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
        mpt_model *q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
        int i;
        for (i = 0; q && i + 1 < q->quantized->n_ops; i++) {
            const mpt__quantized *Q = q->quantized;
            const mpt__qop *mul = &Q->ops[i], *add = &Q->ops[i + 1];
            const int64_t C = mul->info.n_constants;
            const char *bn = add->name;
            const float *gamma = param_of(m, bn, "gamma"), *beta = param_of(m, bn, "beta");
            const float *mean = param_of(m, bn, "moving_mean");
            const float *var = param_of(m, bn, "moving_variance");
            int k;
            if (mul->info.op != MPT_QOP_MUL || !C) continue;
            CHECK(add->info.op == MPT_QOP_ADD && add->info.n_constants == C && gamma && beta &&
                      mean && var,
                  "op %d (%s): not a MUL then ADD of a BatchNormalization's", i, mul->name);
            if (!gamma || !beta || !mean || !var || add->info.op != MPT_QOP_ADD) continue;
            /* the pair as predict runs it: one table, the two ops' codes composed */
            CHECK(mul->chained == 1 && add->chained == -1 && mul->chain_lut,
                  "op %d (%s): the MUL and ADD are not chained", i, mul->name);
            for (k = -128; mul->chain_lut && k < 128; k++) {
                int8_t x[64], y[64], z[64];
                int64_t c;
                for (c = 0; c < C; c++) x[c] = (int8_t)k;
                mpt__q_binary(mul, 1, x, NULL, y, C);
                mpt__q_binary(add, 1, y, NULL, z, C);
                mpt__q_lookup_channels(mul->chain_lut, C, x, y, C);
                for (c = 0; c < C; c++) off += y[c] != z[c];
            }
            for (k = 0; k < 2; k++) {
                const mpt__qop *op = k ? add : mul;
                const mpt_quant_params *pa = &Q->tensor[op->in_t[0]], *o = &op->info.output;
                const double sc = op->info.constant_params.scale;
                double amax = 0, twice = 2.0 * fmax(pa->scale, sc);
                int32_t ma, mc, mo;
                int sa, sh_c, so, a;
                int64_t c;
                for (c = 0; c < C; c++) {
                    const float s = gamma[c] * (float)(1.0 / sqrt((double)var[c] + 1e-3));
                    const float want = k ? (float)((double)beta[c] - (double)mean[c] * s) : s;
                    constants_off += op->info.constants[c] != want;
                    amax = fmax(amax, fabs(op->info.constants[c]));
                }
                constants_off += fabs(sc - amax / 127) > 1e-6 * sc || op->info.constant_params.zero_point;
                for (c = 0; c < C; c++) {
                    const double exact = op->info.constants[c] / sc;
                    constants_off += fabs(op->info.constants_int8[c] - exact) > 0.5 + 1e-4;
                    constants_off += fabs(exact) > 126.999 && abs(op->info.constants_int8[c]) != 127;
                }
                ref_multiplier(pa->scale / twice, &ma, &sa);
                ref_multiplier(sc / twice, &mc, &sh_c);
                if (k) ref_multiplier(twice / ((double)(1 << 20) * o->scale), &mo, &so);
                else ref_multiplier((double)pa->scale * sc / o->scale, &mo, &so);
                for (a = -128; a < 128; a++) {
                    int8_t x[64], y[64];
                    for (c = 0; c < C; c++) x[c] = (int8_t)a;
                    mpt__q_binary(op, 1, x, NULL, y, C);
                    for (c = 0; c < C; c++) {
                        const int32_t b = op->info.constants_int8[c];
                        int32_t raw;
                        int8_t want;
                        if (k) {
                            raw = ref_mbqm(ref_mbqm((a - pa->zero_point) * (1 << 20), ma, sa) +
                                               ref_mbqm(b * (1 << 20), mc, sh_c),
                                           mo, so);
                        } else {
                            raw = ref_mbqm((a - pa->zero_point) * b, mo, so);
                        }
                        want = ref_sat8(raw + o->zero_point);
                        if (op->info.activation == MPT_ACT_RELU && want < o->zero_point)
                            want = (int8_t)o->zero_point;
                        off += y[c] != want;
                    }
                }
                checked++;
            }
        }
        mpt_model_destroy(q);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
    CHECK(checked == 2 * (2 + 3), "%d MULs and ADDs by a constant per channel checked, want 10",
          checked);
    CHECK(constants_off == 0, "%lld constants differ from the float model's", constants_off);
    CHECK(off == 0, "%lld codes differ from TFLite's arithmetic", off);
}

/* The graphs quantized in each mode, through mpt_model_predict and
   mpt_model_evaluate, against the float model's: float16 with the weights
   rounded to half first is the float model's arithmetic but for the
   BatchNormalizations folded and the sums' order (float32 rounding of the
   logits: within 1e-4); dynamic range and full integer within the bounds below
   on the softmax outputs, and evaluate's accuracy apart from the float
   model's by at most the share of samples whose top-1 differs. */
static void test_graph_predict_modes(void) {
    static const double bound[3] = {0.05, 0.1, 1e-4}; /* dynamic, full integer, float16 */
    int kind, mode;
    make_samples(18);
    for (kind = MODEL_RESIDUAL; kind <= MODEL_BN_GRAPH; kind++) {
        mpt_context *ctx = quiet_ctx();
        mpt_model *m = make_model(ctx, kind, 240 + (unsigned)kind);
        mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
        mpt_tensor a;
        mpt_logs lf, lq;
        round_weights_to_half(ctx, m);
        mpt_model_compile(m, &(mpt_compile_desc){
            .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
            .metrics = MPT_METRIC_ACCURACY});
        CHECK(mpt_model_predict(m, d, 32, &a) == MPT_OK, "predict float");
        CHECK(mpt_model_evaluate(m, d, NULL, &lf) == MPT_OK, "evaluate float");
        for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
            mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
            mpt_tensor b;
            double worst = 0;
            int64_t r, c, top_off = 0;
            memset(&b, 0, sizeof b);
            CHECK(q && mpt_model_predict(q, d, 40, &b) == MPT_OK, "kind %d mode %d: predict",
                  kind, mode);
            for (r = 0; b.data && r < N_SAMPLES; r++) {
                const float *pf = (const float *)a.data + r * CLASSES;
                const float *pq = (const float *)b.data + r * CLASSES;
                int tf = 0, tq = 0;
                for (c = 0; c < CLASSES; c++) {
                    worst = fmax(worst, fabs(pf[c] - pq[c]));
                    tf = pf[c] > pf[tf] ? (int)c : tf;
                    tq = pq[c] > pq[tq] ? (int)c : tq;
                }
                top_off += tf != tq;
            }
            CHECK(b.data && worst <= bound[mode],
                  "kind %d mode %d: outputs differ by %g (bound %g)", kind, mode, worst,
                  bound[mode]);
            CHECK(q && mpt_model_evaluate(q, d, NULL, &lq) == MPT_OK, "evaluate");
            CHECK(fabs(mpt_logs_get(&lq, "accuracy") - mpt_logs_get(&lf, "accuracy")) <=
                      (double)top_off / N_SAMPLES + 1e-9,
                  "kind %d mode %d: accuracy %g, float %g, %lld top-1 differ", kind, mode,
                  mpt_logs_get(&lq, "accuracy"), mpt_logs_get(&lf, "accuracy"),
                  (long long)top_off);
            if (getenv("MPT_TEST_VERBOSE"))
                printf("  kind %d mode %d: worst %g, top-1 differs on %lld of %d\n", kind, mode,
                       worst, (long long)top_off, N_SAMPLES);
            mpt_tensor_free(ctx, &b);
            mpt_model_destroy(q);
        }
        mpt_tensor_free(ctx, &a);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
}

/* ---- Dense over the last axis of a sequence ------------------------------------------------- */

enum { SEQ_T = 6, SEQ_D = 8, SEQ_N = 40 };

/* (shape) -> Dense(16, relu) -> Dense(12, gelu) -> Dense(CLASSES, softmax),
   shape (SEQ_T, SEQ_D) or one position's (SEQ_D). */
static mpt_model *dense_stack(mpt_context *ctx, int sequence) {
    mpt_model *m = NULL;
    mpt_model_desc md = {.input_shape = {sequence ? SEQ_T : SEQ_D, SEQ_D},
                         .input_rank = sequence ? 2 : 1, .seed = 3};
    if (!sequence) md.input_shape[1] = 0;
    CHECK(mpt_model_create(ctx, &md, &m) == MPT_OK, "create");
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 12, .activation = MPT_ACT_GELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* A Dense over a sequence quantizes in every mode, each position a row of
   the product: its predictions are, bit for bit, those of the same
   weights applied to the positions as samples of their own (the dynamic
   mode's scale per row is per position; full integer calibrates the same
   values), and within the modes' bounds of the float model's. */
static void test_dense_over_sequence(void) {
    static const double bound[3] = {0.05, 0.1, 1e-4}; /* dynamic, full integer, float16 */
    static float x[SEQ_N * SEQ_T * SEQ_D];
    mpt_context *ctx = quiet_ctx();
    mpt_model *seq = dense_stack(ctx, 1), *rows = dense_stack(ctx, 0);
    mpt_dataset *dseq = NULL, *drows = NULL;
    mpt_tensor tx, a;
    int i, n = seq ? mpt_model_param_count(seq) : 0, mode;
    int64_t k;
    if (!seq || !rows) return;
    test_seed(61);
    for (k = 0; k < SEQ_N * SEQ_T * SEQ_D; k++) x[k] = (float)test_uniform(-1.0, 1.0);
    randomize(seq, 610);
    round_weights_to_half(ctx, seq);
    for (i = 0; i < n; i++) {
        mpt_param_info p, r;
        mpt_model_param(seq, i, &p);
        mpt_model_param(rows, i, &r);
        memcpy(r.value.data, p.value.data, sizeof(float) * (size_t)mpt_tensor_count(&p.value));
    }
    mpt_model_refresh_weights(rows);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 3, (int64_t[]){SEQ_N, SEQ_T, SEQ_D}, x);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx}, &dseq) == MPT_OK, "dataset");
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){SEQ_N * SEQ_T, SEQ_D}, x);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx}, &drows) == MPT_OK, "dataset");
    CHECK(mpt_model_predict(seq, dseq, 16, &a) == MPT_OK, "predict float");
    for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *qs = quantize(seq, (mpt_quantize_mode)mode, dseq, MPT_DTYPE_DEFAULT);
        mpt_model *qr = quantize(rows, (mpt_quantize_mode)mode, drows, MPT_DTYPE_DEFAULT);
        mpt_tensor bs, br;
        double worst = 0;
        memset(&bs, 0, sizeof bs);
        memset(&br, 0, sizeof br);
        CHECK(qs && mpt_model_predict(qs, dseq, 16, &bs) == MPT_OK, "mode %d: predict: %s", mode,
              mpt_context_error(ctx));
        CHECK(qr && mpt_model_predict(qr, drows, 16 * SEQ_T, &br) == MPT_OK, "mode %d: rows",
              mode);
        CHECK(bs.data && bs.rank == 3 && bs.shape[1] == SEQ_T && bs.shape[2] == CLASSES,
              "mode %d: output shape", mode);
        for (k = 0; bs.data && k < SEQ_N * SEQ_T * CLASSES; k++)
            worst = fmax(worst, fabs(((float *)a.data)[k] - ((float *)bs.data)[k]));
        CHECK(bs.data && br.data &&
                  !memcmp(bs.data, br.data, sizeof(float) * SEQ_N * SEQ_T * CLASSES),
              "mode %d: the sequence's positions differ from the same rows as samples", mode);
        CHECK(bs.data && worst <= bound[mode] && (worst > 0 || mode == MPT_QUANTIZE_FLOAT16),
              "mode %d: outputs differ by %g "
              "(bound %g)", mode, worst, bound[mode]);
        if (getenv("MPT_TEST_VERBOSE")) printf("  mode %d: worst %g\n", mode, worst);
        mpt_tensor_free(ctx, &bs);
        mpt_tensor_free(ctx, &br);
        mpt_model_destroy(qs);
        mpt_model_destroy(qr);
    }
    mpt_tensor_free(ctx, &a);
    mpt_dataset_destroy(dseq);
    mpt_dataset_destroy(drows);
    mpt_model_destroy(seq);
    mpt_model_destroy(rows);
    mpt_context_destroy(ctx);
}

/* ---- a small GPT: Embedding, PositionEmbedding, LayerNormalization, attention -------------- */

enum { GPT_T = 8, GPT_V = 16, GPT_D = 16, GPT_N = 24 };

static mpt_node gpt_residual(mpt_model *m, mpt_node x, mpt_node branch) {
    mpt_node both[2] = {x, branch};
    return mpt_add(m, 2, both, NULL);
}

/* ids (GPT_T) -> Embedding + PositionEmbedding -> one pre-LayerNormalization
   block (causal attention of 2 heads, a GELU MLP) -> LayerNormalization ->
   Dense(GPT_V, softmax), examples/gpt.c's shape; blocks 0: the
   embeddings and a LayerNormalization alone (no product). */
static mpt_model *small_gpt(mpt_context *ctx, int blocks, unsigned long long seed) {
    mpt_model *m = NULL;
    mpt_node tok, x, h;
    int b;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {GPT_T}, .input_rank = 1,
                                                  .input_dtype = MPT_INT32, .seed = 5},
                           &m) == MPT_OK, "create");
    if (!m) return NULL;
    tok = mpt_embedding(m, mpt_model_input(m), &(mpt_embedding_desc){
        .input_dim = GPT_V, .output_dim = GPT_D, .name = "tokens"});
    x = gpt_residual(m, tok, mpt_position_embedding(m, tok, &(mpt_position_embedding_desc){
        .sequence_length = GPT_T}));
    for (b = 0; b < blocks; b++) {
        h = mpt_layer_normalization(m, x, &(mpt_layer_normalization_desc){.epsilon = 1e-5f});
        h = mpt_multi_head_attention(m, h, h, &(mpt_multi_head_attention_desc){
            .num_heads = 2, .key_dim = GPT_D / 2, .use_causal_mask = 1, .name = "attention"});
        x = gpt_residual(m, x, h);
        h = mpt_layer_normalization(m, x, &(mpt_layer_normalization_desc){.epsilon = 1e-5f});
        h = mpt_dense(m, h, &(mpt_dense_desc){.units = 2 * GPT_D, .activation = MPT_ACT_GELU});
        x = gpt_residual(m, x, mpt_dense(m, h, &(mpt_dense_desc){.units = GPT_D}));
    }
    x = mpt_layer_normalization(m, x, &(mpt_layer_normalization_desc){.epsilon = 1e-5f});
    if (blocks) mpt_dense(m, x, &(mpt_dense_desc){.units = GPT_V, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    randomize(m, seed);
    return m;
}

static mpt_dataset *ids_dataset(mpt_context *ctx, int32_t *ids, int64_t n) {
    mpt_tensor t;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(ctx, &t, MPT_INT32, 2, (int64_t[]){n, GPT_T}, ids);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &t}, &d) == MPT_OK, "dataset: %s",
          mpt_context_error(ctx));
    return d;
}

/* The largest difference between the float model's predictions and q's. */
static double predict_difference(mpt_context *ctx, mpt_model *m, mpt_model *q,
                                 const mpt_dataset *d, int *same_bits) {
    mpt_tensor a, b;
    double worst = 0;
    int64_t k, count;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    CHECK(mpt_model_predict(m, d, 10, &a) == MPT_OK, "predict float");
    CHECK(q && mpt_model_predict(q, d, 10, &b) == MPT_OK, "predict quantized: %s",
          mpt_context_error(ctx));
    count = a.data && b.data ? mpt_tensor_count(&a) : 0;
    CHECK(!b.data || mpt_tensor_count(&b) == mpt_tensor_count(&a), "output shape");
    for (k = 0; k < count; k++)
        worst = fmax(worst, fabs(((float *)a.data)[k] - ((float *)b.data)[k]));
    *same_bits = count > 0 && !memcmp(a.data, b.data, sizeof(float) * (size_t)count);
    mpt_tensor_free(ctx, &a);
    mpt_tensor_free(ctx, &b);
    return worst;
}

/* The embeddings and LayerNormalization are the float model's own
   arithmetic: bit for bit its predictions, in both float modes. A GPT
   block quantizes in dynamic range (every Dense and the attention's four
   projections int8) within 0.02 of the float model's probabilities, and
   in float16 (weights that float16 holds exactly) within 1e-5 (on a CPU
   with AVX-512, where the activations are the float model's, 0). */
static void test_small_gpt(void) {
    static int32_t ids[GPT_N * GPT_T];
    mpt_context *ctx = quiet_ctx();
    mpt_model *plain = small_gpt(ctx, 0, 620), *gpt = small_gpt(ctx, 1, 621);
    mpt_dataset *d;
    int64_t k;
    int mode, same;
    test_seed(62);
    for (k = 0; k < GPT_N * GPT_T; k++) ids[k] = test_randint(0, GPT_V - 1);
    d = ids_dataset(ctx, ids, GPT_N);
    if (!plain || !gpt || !d) return;
    round_weights_to_half(ctx, gpt);
    for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *q;
        double worst;
        if (mode == MPT_QUANTIZE_FULL_INTEGER) continue; /* test_small_gpt_refusals */
        q = quantize(plain, (mpt_quantize_mode)mode, NULL, MPT_DTYPE_DEFAULT);
        worst = predict_difference(ctx, plain, q, d, &same);
        CHECK(same, "mode %d: the embeddings and LayerNormalization differ from the float "
              "model's by %g", mode, worst);
        mpt_model_destroy(q);
        q = quantize(gpt, (mpt_quantize_mode)mode, NULL, MPT_DTYPE_DEFAULT);
        worst = predict_difference(ctx, gpt, q, d, &same);
        CHECK(mode == MPT_QUANTIZE_DYNAMIC_RANGE ? worst > 0 && worst <= 0.02 : worst <= 1e-5,
              "mode %d: a GPT block differs from the float model's by %g", mode, worst);
        if (getenv("MPT_TEST_VERBOSE")) printf("  gpt mode %d: worst %g\n", mode, worst);
        if (q && mode == MPT_QUANTIZE_DYNAMIC_RANGE) {
            mpt_quantized_layer L;
            int i, projections = 0, attention = 0, info_n;
            mpt_quantized_info info;
            CHECK(mpt_model_quantized_info(q, &info) == MPT_OK, "info");
            info_n = info.n_layers;
            for (i = 0; i < info_n; i++) {
                CHECK(mpt_model_quantized_layer(q, i, &L) == MPT_OK, "layer %d", i);
                projections += L.op == MPT_QOP_FULLY_CONNECTED && !strncmp(L.name, "attention/", 10) && L.weights != NULL;
                attention += L.op == MPT_QOP_ATTENTION && L.n_inputs == 3 && L.heads == 2 && L.causal;
            }
            CHECK(projections == 4 && attention == 1, "%d int8 projections, %d attentions",
                  projections, attention);
        }
        mpt_model_destroy(q);
    }
    mpt_dataset_destroy(d);
    mpt_model_destroy(plain);
    mpt_model_destroy(gpt);
    mpt_context_destroy(ctx);
}

/* What the quantized GPT does not do is refused, naming the layer: full
   integer, quantization-aware training, the quantized files; an id
   outside the table is refused by predict, as the float model refuses it. */
static void test_small_gpt_refusals(void) {
    static int32_t ids[GPT_N * GPT_T];
    mpt_context *ctx = quiet_ctx();
    mpt_model *gpt = small_gpt(ctx, 1, 622), *q = NULL;
    mpt_dataset *d = ids_dataset(ctx, ids, GPT_N);
    mpt_tensor t;
    FILE *f;
    if (!gpt || !d) return;
    test_expect_error(ctx, mpt_model_quantize(gpt, &(mpt_quantize_desc){
                          .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = d}, &q),
                      MPT_ERR_UNSUPPORTED, "layer 'tokens' (Embedding) has no full-integer form",
                      "full integer");
    CHECK(!q, "a full-integer model came back");
    q = quantize(gpt, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, MPT_DTYPE_DEFAULT);
    if (q) {
        test_expect_error(ctx, mpt_model_export_tflite(q, "unwritten.tflite", NULL),
                          MPT_ERR_UNSUPPORTED, "'tokens' (GATHER)", "export tflite");
        test_expect_error(ctx, mpt_model_export_onnx(q, "unwritten.onnx", NULL),
                          MPT_ERR_UNSUPPORTED, "'tokens' (GATHER)", "export onnx");
        f = fopen("unwritten.tflite", "rb");
        CHECK(!f, "a refused export left a file");
        if (f) fclose(f);
        f = fopen("unwritten.onnx", "rb");
        CHECK(!f, "a refused export left a file");
        if (f) fclose(f);
        { /* invoke takes the ids as predict does, and refuses floats */
            mpt_tensor x, y, p;
            float floats[GPT_T];
            memset(&y, 0, sizeof y);
            memset(&p, 0, sizeof p);
            mpt_tensor_wrap(ctx, &x, MPT_INT32, 2, (int64_t[]){GPT_N, GPT_T}, ids);
            CHECK(mpt_model_quantized_invoke(q, &x, &y) == MPT_OK &&
                      mpt_model_predict(q, d, 7, &p) == MPT_OK &&
                      !memcmp(y.data, p.data, sizeof(float) * GPT_N * GPT_T * GPT_V),
                  "invoke differs from predict: %s", mpt_context_error(ctx));
            mpt_tensor_free(ctx, &y);
            mpt_tensor_free(ctx, &p);
            memset(floats, 0, sizeof floats);
            mpt_tensor_wrap(ctx, &x, MPT_FLOAT32, 2, (int64_t[]){1, GPT_T}, floats);
            test_expect_error(ctx, mpt_model_quantized_invoke(q, &x, &y), MPT_ERR_DTYPE,
                              "input dtype float32, but the model takes int32", "invoke");
        }
        ids[5] = GPT_V;
        test_expect_error(ctx, mpt_model_predict(q, d, 10, &t), MPT_ERR_INVALID_ARGUMENT,
                          "Embedding 'tokens' got id 16 (sample 0, position 5)", "bad id");
        ids[5] = 0;
    }
    mpt_model_destroy(q);
    test_expect_error(ctx, mpt_model_quantize_aware(gpt, NULL), MPT_ERR_UNSUPPORTED,
                      "layer 'tokens' (Embedding) has no full-integer form", "quantize_aware");
    mpt_dataset_destroy(d);
    mpt_model_destroy(gpt);
    mpt_context_destroy(ctx);
}

/* A model whose output is its input (a Dropout alone: nothing runs at
   inference) has no operation to quantize or to write: refused, saying
   so, with no model made. */
static void test_nothing_to_quantize(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = NULL, *q = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1}, &m);
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.5f});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    m->weights_given = 1; /* past the check for initial weights, which it has none of */
    test_expect_error(ctx, mpt_model_quantize(m, NULL, &q), MPT_ERR_UNSUPPORTED,
                      "the model's output is its input", "quantize");
    CHECK(!q, "a quantized model came back");
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* What a float16 model keeps besides its file's weights, from what its
   operations hold: a Dense's half strips and float32 panels of whole
   columns, a Conv2D's float32 kernel. */
static int64_t float16_kept_bytes(const mpt__quantized *Q) {
    int64_t bytes = 0;
    int i;
    for (i = 0; i < Q->n_ops; i++) {
        const mpt__qop *op = &Q->ops[i];
        const int64_t NK = op->info.out_channels * op->info.depth;
        if (op->info.op == MPT_QOP_CONV_2D) bytes += 4 * NK;
        if (op->info.op != MPT_QOP_FULLY_CONNECTED || !op->wh_kept) continue;
        CHECK(op->wh_kept->panels && op->wh_kept->panels->cols >= op->info.out_channels,
              "op %d: no panels of all %lld columns", i, (long long)op->info.out_channels);
        if (op->wh_kept->panels) bytes += 4 * op->info.depth * op->wh_kept->panels->cols;
        if (op->wh_kept->strips) bytes += 2 * NK;
    }
    return bytes;
}

/* float16: every output within float16's rounding of the weights. */
static void test_float16_model(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q;
    mpt_dataset *d;
    mpt_tensor a, b;
    mpt_quantized_info info;
    int64_t k, count;
    double worst = 0;
    memset(&info, 0, sizeof info); /* read below where quantize failed too */
    make_samples(13);
    m = make_model(ctx, MODEL_GAP, 300);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    q = quantize(m, MPT_QUANTIZE_FLOAT16, NULL, MPT_DTYPE_DEFAULT);
    CHECK(mpt_model_predict(m, d, 32, &a) == MPT_OK, "predict float");
    CHECK(q && mpt_model_predict(q, d, 32, &b) == MPT_OK, "predict float16");
    count = mpt_tensor_count(&a);
    for (k = 0; q && k < count; k++) {
        double e = fabs(((float *)a.data)[k] - ((float *)b.data)[k]);
        worst = e > worst ? e : worst;
    }
    CHECK(worst > 0 && worst < 2e-3, "float16 differs by %g", worst);
    CHECK(q && mpt_model_quantized_info(q, &info) == MPT_OK, "info");
    /* Conv2D 3·3·2 → 8, Dense 8 → 4: 2 bytes a weight, 4 a bias */
    CHECK(info.size_bytes == 2 * (18 * 8 + 8 * 4) + 4 * (8 + 4), "size %lld",
          (long long)info.size_bytes);
    CHECK(q && info.kept_bytes == float16_kept_bytes(q->quantized), "kept %lld, want %lld",
          (long long)info.kept_bytes, (long long)(q ? float16_kept_bytes(q->quantized) : 0));
    mpt_tensor_free(ctx, &a);
    mpt_tensor_free(ctx, &b);
    mpt_model_destroy(q);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* What an int8 model keeps besides its file's bytes, from what its
   operations hold, each by its own layout's rule: a packed kernel's
   panels of nr columns and depth groups (4 bytes a group of four, or of
   two without VNNI's quads), to a whole 64 bytes, its column sums and,
   where AMX may read them, the zero bytes after them (slack); a
   direct Conv2D's taps and sums (its filters padded to 16); full
   integer's multiplier and shift per channel and its lookup tables. */
static int64_t int8_kept_bytes(const mpt__quantized *Q) {
    int64_t bytes = 0;
    int i;
    for (i = 0; i < Q->n_ops; i++) {
        const mpt__qop *op = &Q->ops[i];
        const int64_t N = op->info.out_channels, C = op->info.n_constants;
        if (op->wpacked) {
            const mpt_qgemm_packed *p = op->wpacked;
            const int64_t groups = p->quads ? (p->k + 3) / 4 : (p->k + 1) / 2;
            const int64_t panels = (p->n + p->nr - 1) / p->nr;
            bytes += (panels * p->nr * groups * 4 + 63) / 64 * 64 + 4 * p->n + p->slack;
        }
        if (op->direct_w) bytes += (op->direct_groups + 1) * ((N + 15) / 16 * 16) * 4;
        if (op->mult) bytes += 8 * N;
        if (op->channel_lut) bytes += 256 * C;
        if (op->chain_lut) bytes += 256 * C + 4;
        if (op->pair_lut) bytes += 256 * 256 + 4;
    }
    return bytes;
}

/* The int8 modes count what they keep (mpt_quantized_info.kept_bytes):
   at least the packed copy of every weight, and each table. */
static void test_int8_kept_bytes(void) {
    int kind, mode, pair_tables = 0, channel_tables = 0, chain_tables = 0;
    make_samples(29);
    for (kind = MODEL_CNN; kind <= MODEL_POOL_BRANCH; kind++)
        for (mode = MPT_QUANTIZE_DYNAMIC_RANGE; mode <= MPT_QUANTIZE_FULL_INTEGER; mode++) {
            mpt_context *ctx = quiet_ctx();
            mpt_model *m = make_model(ctx, kind, 970);
            mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
            mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
            mpt_quantized_info info;
            int64_t weights = 0;
            int i;
            memset(&info, 0, sizeof info);
            for (i = 0; q && i < q->quantized->n_ops; i++) {
                const mpt__qop *op = &q->quantized->ops[i];
                if (op->wq) weights += op->info.out_channels * op->info.depth;
                CHECK(!op->wq || op->wpacked, "model %d mode %d op %d: weights not packed", kind,
                      mode, i);
                pair_tables += op->pair_lut != NULL;
                channel_tables += op->channel_lut != NULL;
                chain_tables += op->chain_lut != NULL;
            }
            CHECK(q && mpt_model_quantized_info(q, &info) == MPT_OK && weights > 0 &&
                      info.kept_bytes == int8_kept_bytes(q->quantized) &&
                      info.kept_bytes >= weights,
                  "model %d mode %d: kept %lld bytes, want %lld (%lld weights)", kind, mode,
                  (long long)info.kept_bytes, (long long)(q ? int8_kept_bytes(q->quantized) : 0),
                  (long long)weights);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
    CHECK(pair_tables && channel_tables && chain_tables,
          "the models hold %d pair, %d channel and %d chain tables: some not seen", pair_tables,
          channel_tables, chain_tables);
}

/* The summary names the mode, each operation's float layers and, in full
   integer, its output's quantization. */
static void test_quantized_summary(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q;
    mpt_dataset *d;
    char text[4096];
    size_t n;
    make_samples(20);
    m = make_model(ctx, MODEL_CNN, 250);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_UINT8);
    n = q ? mpt_model_summary(q, text, sizeof text) : 0;
    CHECK(n > 0 && n < sizeof text, "summary of %zu characters", n);
    CHECK(strstr(text, "full integer, input and output uint8"), "mode: %s", text);
    CHECK(strstr(text, "CONV_2D") && strstr(text, "conv2d + batch_normalization relu"),
          "the folded conv: %s", text);
    CHECK(strstr(text, "0.00390625, -128"), "softmax's fixed quantization: %s", text);
    mpt_model_destroy(q);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* What an exporter reads, per mode: every pointer the documentation
   promises is there, the others NULL; and a model trained in
   mixed_float16 quantizes from its float32 masters, to the same bytes as
   a float32 model with those weights. */
static void test_layer_accessors_per_mode(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = NULL, *mixed = NULL;
    mpt_dataset *d;
    int mode, i, k;
    make_samples(22);
    m = make_model(ctx, MODEL_CNN, 260);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                            .policy = MPT_POLICY_MIXED_FLOAT16}, &mixed);
    add_layers(mixed, MODEL_CNN);
    CHECK(mpt_model_build(mixed, 32) == MPT_OK, "build mixed");
    randomize(mixed, 260);
    for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
        mpt_model *qm = quantize(mixed, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
        mpt_quantized_info info;
        mpt_tensor a, b;
        if (!q || !qm) {
            mpt_model_destroy(q);
            mpt_model_destroy(qm);
            continue;
        }
        mpt_model_quantized_info(q, &info);
        /* 8 layers' operations, tanh, gelu, sigmoid and softmax apart */
        CHECK(info.mode == (mpt_quantize_mode)mode && info.n_layers == 12,
              "mode %d: %d operations", mode, info.n_layers);
        for (i = 0; i < info.n_layers; i++) {
            mpt_quantized_layer L;
            int weighted, full = mode == MPT_QUANTIZE_FULL_INTEGER;
            CHECK(mpt_model_quantized_layer(q, i, &L) == MPT_OK, "layer %d", i);
            weighted = L.op == MPT_QOP_FULLY_CONNECTED || L.op == MPT_QOP_CONV_2D;
            CHECK(!weighted || (L.out_channels > 0 && L.depth > 0), "layer %d: shape", i);
            CHECK((L.weights != NULL) == (weighted && mode != MPT_QUANTIZE_FLOAT16) &&
                      (L.weight_scales != NULL) == (L.weights != NULL) &&
                      (L.weights_float16 != NULL) == (weighted && mode == MPT_QUANTIZE_FLOAT16) &&
                      (L.bias != NULL) == (weighted && !full) &&
                      (L.bias_int32 != NULL) == (weighted && full) &&
                      (L.multiplier != NULL) == (weighted && full) &&
                      (L.shift != NULL) == (weighted && full),
                  "mode %d layer %d (%s): the pointers", mode, i, L.name);
            CHECK(!full || (L.input.scale > 0 && L.output.scale > 0), "layer %d: scales", i);
            for (k = 0; weighted && L.weights && k < L.out_channels * L.depth; k++)
                CHECK(L.weights[k] >= -127, "layer %d: weight −128", i);
        }
        CHECK(mpt_model_predict(q, d, 32, &a) == MPT_OK && mpt_model_predict(qm, d, 32, &b) == MPT_OK,
              "predict");
        CHECK(!memcmp(a.data, b.data, mpt_tensor_bytes(&a)),
              "mode %d: the mixed_float16 model quantizes differently", mode);
        mpt_tensor_free(ctx, &a);
        mpt_tensor_free(ctx, &b);
        mpt_model_destroy(q);
        mpt_model_destroy(qm);
    }
    mpt_model_destroy(mixed);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- bit for bit on every thread count -------------------------------------------------- */

/* q's predictions of d in batches of `batch` on a context of `threads`
   threads: on 1 thread they become *first (the caller frees it), on more
   they must equal *first bit for bit. */
static void predict_as_on_one_thread(mpt_context *ctx, mpt_model *q, mpt_dataset *d,
                                     int64_t batch, int threads, mpt_tensor *first,
                                     const char *what) {
    mpt_tensor out;
    memset(&out, 0, sizeof out);
    CHECK(q && mpt_model_predict(q, d, batch, &out) == MPT_OK, "%s: predict", what);
    if (threads == 1) {
        *first = out;
        return;
    }
    CHECK(out.data && first->data && !memcmp(out.data, first->data, mpt_tensor_bytes(&out)),
          "%s: %d threads differ from 1", what, threads);
    mpt_tensor_free(ctx, &out);
}

static void test_bit_exact_across_threads(void) {
    static const int kinds[] = {MODEL_CNN,    MODEL_GAP,      MODEL_RESIDUAL,
                                MODEL_MERGES, MODEL_BN_CHAIN, MODEL_BN_GRAPH};
    int mode, threads, kind, ki;
    make_samples(14);
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (kind = kinds[ki], mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
            mpt_tensor first;
            memset(&first, 0, sizeof first);
            for (threads = 1; threads <= 3; threads++) {
                mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
                mpt_model *m = make_model(ctx, kind, 400);
                mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
                mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
                char what[64];
                snprintf(what, sizeof what, "model %d mode %d", kind, mode);
                predict_as_on_one_thread(ctx, q, d, 40, threads, &first, what);
                mpt_model_destroy(q);
                mpt_dataset_destroy(d);
                mpt_model_destroy(m);
                if (threads == 3) mpt_tensor_free(ctx, &first);
                mpt_context_destroy(ctx);
            }
        }
}

/* The small GPT's dynamic-range and float16 predictions (its row
   quantization, LayerNormalization, attention) are the same bits on 1, 2
   and 3 threads. */
static void test_small_gpt_across_threads(void) {
    static int32_t ids[GPT_N * GPT_T];
    int mode, threads;
    int64_t k;
    test_seed(64);
    for (k = 0; k < GPT_N * GPT_T; k++) ids[k] = test_randint(0, GPT_V - 1);
    for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_tensor first;
        if (mode == MPT_QUANTIZE_FULL_INTEGER) continue;
        memset(&first, 0, sizeof first);
        for (threads = 1; threads <= 3; threads++) {
            mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
            mpt_model *m = small_gpt(ctx, 1, 623);
            mpt_dataset *d = ids_dataset(ctx, ids, GPT_N);
            mpt_model *q = m ? quantize(m, (mpt_quantize_mode)mode, NULL, MPT_DTYPE_DEFAULT) : NULL;
            char what[64];
            snprintf(what, sizeof what, "small GPT mode %d", mode);
            predict_as_on_one_thread(ctx, q, d, 10, threads, &first, what);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            if (threads == 3) mpt_tensor_free(ctx, &first);
            mpt_context_destroy(ctx);
        }
    }
}

/* ---- calibration -------------------------------------------------------------------------- */

static void test_calibration_ranges(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q = NULL;
    mpt_dataset *d;
    mpt_quantized_info info;
    mpt_quantized_layer first;
    float lo = INFINITY, hi = -INFINITY;
    int k;
    make_samples(15);
    for (k = 0; k < 40 * H * W * C; k++) {
        sample_x[k] = sample_x[k] * 2.0f - 0.5f; /* [-0.5, 1.5) */
        lo = sample_x[k] < lo ? sample_x[k] : lo;
        hi = sample_x[k] > hi ? sample_x[k] : hi;
    }
    sample_x[60 * H * W * C + 5] = 40.0f; /* an outlier after the first 40 samples */
    m = make_model(ctx, MODEL_DENSE, 500);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    /* min/max of the first 40 samples */
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                     .representative_data = d,
                                                     .calibration_samples = 40}, &q) == MPT_OK,
          "quantize: %s", mpt_context_error(ctx));
    mpt_model_quantized_info(q, &info);
    CHECK(info.input.min == lo && info.input.max == hi, "input range [%g, %g], want [%g, %g]",
          info.input.min, info.input.max, lo, hi);
    CHECK(fabs(info.input.scale - (hi - lo) / 255.0) < 1e-7, "scale %g", info.input.scale);
    CHECK(info.input.zero_point == (int32_t)floor(-128 - lo / info.input.scale + 0.5),
          "zero point %d", info.input.zero_point);
    mpt_model_quantized_layer(q, 0, &first);
    CHECK(first.op == MPT_QOP_RESHAPE && first.output.scale == info.input.scale &&
              first.output.zero_point == info.input.zero_point,
          "Flatten keeps its input's quantization");
    mpt_model_destroy(q);
    /* every sample: the outlier sets the maximum; a percentile drops it */
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                     .representative_data = d}, &q) == MPT_OK,
          "quantize");
    mpt_model_quantized_info(q, &info);
    CHECK(info.input.max == 40.0f, "min/max: max %g, want the outlier 40", info.input.max);
    mpt_model_destroy(q);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                     .representative_data = d,
                                                     .calibration = MPT_CALIBRATION_PERCENTILE,
                                                     .percentile = 99.9}, &q) == MPT_OK,
          "quantize percentile: %s", mpt_context_error(ctx));
    mpt_model_quantized_info(q, &info);
    CHECK(info.input.max < 1.6f && info.input.max > 0.9f && info.input.min < 0.05f,
          "percentile: range [%g, %g]", info.input.min, info.input.max);
    mpt_model_destroy(q);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* The MSE range of n values by brute force, from the definition: a
   histogram of 2048 bins over min..max, each bin's count at its centre,
   every range with both ends on every 16th bin edge, quantized as the
   model would be; returns the least summed squared error, its range in
   *lo, *hi. */
static double mse_range_reference(const float *x, int64_t n, float *lo, float *hi) {
    static int64_t hist[2048];
    float mn = INFINITY, mx = -INFINITY;
    double width, best = INFINITY;
    int64_t k;
    int a, b, bin;
    for (k = 0; k < n; k++) mn = x[k] < mn ? x[k] : mn, mx = x[k] > mx ? x[k] : mx;
    width = ((double)mx - mn) / 2048;
    memset(hist, 0, sizeof hist);
    for (k = 0; k < n; k++) {
        int64_t i = (int64_t)((x[k] - mn) / width);
        hist[i < 0 ? 0 : i > 2047 ? 2047 : i]++;
    }
    for (b = 2048; b >= 16; b -= 16) /* another order than the library's */
        for (a = 0; a < b; a += 16) {
            const float l = (float)(mn + width * a), u = (float)(mn + width * b);
            const mpt_quant_params p = mpt__q_params(l, u);
            double err = 0;
            for (bin = 0; bin < 2048; bin++) {
                const float v = (float)(mn + width * (bin + 0.5));
                const double e = (double)(mpt__q_quantize(v, &p) - p.zero_point) * p.scale - v;
                if (hist[bin]) err += (double)hist[bin] * e * e;
            }
            if (err < best || (err == best && (l < *lo || (l == *lo && u < *hi))))
                best = err, *lo = l, *hi = u;
        }
    return best;
}

/* Mean squared error of quantizing n values with p. */
static double quantization_mse(const float *x, int64_t n, const mpt_quant_params *p) {
    double sum = 0;
    int64_t k;
    for (k = 0; k < n; k++) {
        const double e = (double)(mpt__q_quantize(x[k], p) - p->zero_point) * p->scale - x[k];
        sum += e * e;
    }
    return sum / (double)n;
}

/* MSE calibration on heavy-tailed inputs (Laplace, each side's scale its
   own, shifted: 12,288 values reaching about ±9 scales): its range clips
   the tails that min/max keeps, the input's quantization error is lower
   than with min/max, and the range is the one a brute-force search of the
   definition finds, in four cases (so that a coarser grid would show).
   Then a percentile whose lower end is clipped keeps its upper end where
   it belongs. */
static void test_calibration_mse(void) {
    static const double neg_scale[] = {1.0, 0.5, 2.0, 1.0}, shift[] = {0.0, 0.3, -1.0, 2.0};
    const int64_t count = (int64_t)N_SAMPLES * H * W * C;
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q = NULL;
    mpt_dataset *d = NULL;
    mpt_quantized_info mm, mse;
    int64_t k;
    int v;
    make_samples(31);
    test_seed(32);
    m = make_model(ctx, MODEL_DENSE, 510);
    for (v = 0; v < 4; v++) { /* Laplace, its two sides scaled apart, shifted */
        float ref_lo = INFINITY, ref_hi = INFINITY;
        double ref_err, err_mm, err_mse;
        for (k = 0; k < count; k++) {
            const double u = -log(test_uniform(1e-12, 1.0));
            sample_x[k] = (float)((test_uniform(0.0, 1.0) < 0.5 ? -neg_scale[v] * u : u) + shift[v]);
        }
        mpt_dataset_destroy(d);
        d = samples_dataset(ctx, N_SAMPLES, sample_x);
        q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
        if (q) mpt_model_quantized_info(q, &mm);
        mpt_model_destroy(q);
        q = NULL;
        CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                         .representative_data = d,
                                                         .calibration = MPT_CALIBRATION_MSE},
                                 &q) == MPT_OK, "quantize mse: %s", mpt_context_error(ctx));
        if (!q) continue;
        mpt_model_quantized_info(q, &mse);
        mpt_model_destroy(q);
        q = NULL;
        CHECK(mse.input.min > mm.input.min && mse.input.max < mm.input.max,
              "case %d: mse range [%g, %g] does not clip min/max's [%g, %g]", v, mse.input.min,
              mse.input.max, mm.input.min, mm.input.max);
        err_mm = quantization_mse(sample_x, count, &mm.input);
        err_mse = quantization_mse(sample_x, count, &mse.input);
        CHECK(err_mse < err_mm, "case %d: quantization MSE %g with the mse range, %g with "
              "min/max", v, err_mse, err_mm);
        ref_err = mse_range_reference(sample_x, count, &ref_lo, &ref_hi);
        CHECK(mse.input.min == ref_lo && mse.input.max == ref_hi,
              "case %d: mse range [%.9g, %.9g], brute force [%.9g, %.9g] (histogram error %g)",
              v, mse.input.min, mse.input.max, ref_lo, ref_hi, ref_err);
    }
    /* a percentile with a low outlier: [-0.5, 1.5) and one -40 */
    for (k = 0; k < count; k++) sample_x[k] = (float)test_uniform(-0.5, 1.5);
    sample_x[77] = -40.0f;
    mpt_dataset_destroy(d);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    CHECK(mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                     .representative_data = d,
                                                     .calibration = MPT_CALIBRATION_PERCENTILE,
                                                     .percentile = 99.9}, &q) == MPT_OK,
          "quantize percentile: %s", mpt_context_error(ctx));
    if (q) {
        mpt_model_quantized_info(q, &mse);
        CHECK(fabs(mse.input.min + 0.5) < 0.05 && fabs(mse.input.max - 1.5) < 0.05,
              "percentile with the low end clipped: range [%g, %g], want about [-0.5, 1.5]",
              mse.input.min, mse.input.max);
    }
    mpt_model_destroy(q);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* ---- requantization against a scalar reference ------------------------------------------ */

static int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return a % b < 0 ? q - 1 : q;
}

/* TFLite's MultiplyByQuantizedMultiplier, from the formulas (as test_qgemm). */
static int32_t ref_requantize(int32_t acc, int32_t m, int shift) {
    int left = shift > 0 ? shift : 0, right = shift > 0 ? 0 : -shift;
    int64_t x = (int64_t)acc * ((int64_t)1 << left), h;
    x = x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : x;
    h = floor_div(x * m + ((int64_t)1 << 30), (int64_t)1 << 31);
    if (right == 0) return (int32_t)h;
    if (h >= 0) return (int32_t)((h + ((int64_t)1 << (right - 1))) / ((int64_t)1 << right));
    return (int32_t)-((-h + ((int64_t)1 << (right - 1))) / ((int64_t)1 << right));
}

/* Flatten → Dense(16) with BN → Dense(4, relu), int8 in and out: each
   Dense's int8 output from its int8 input, weights, int32 bias, multiplier
   and shift as the accessor gives them. uint8 in and out are the same
   codes + 128. */
static void test_requantization_scalar_reference(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m, *q8, *qu8;
    mpt_dataset *d;
    mpt_quantized_info info;
    mpt_tensor x, y, xu, yu;
    int8_t *cur;
    int64_t n = 20, k, shape[4] = {20, H, W, C};
    int i, layers, mismatches = 0;
    make_samples(16);
    m = make_model(ctx, MODEL_DENSE, 600);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    q8 = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_INT8);
    qu8 = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_UINT8);
    if (!q8 || !qu8) goto done;
    mpt_model_quantized_info(q8, &info);
    CHECK(info.io_dtype == MPT_INT8, "io dtype");
    {
        mpt_quantized_info u;
        mpt_model_quantized_info(qu8, &u);
        CHECK(u.io_dtype == MPT_UINT8 && u.input.scale == info.input.scale &&
                  u.input.zero_point == info.input.zero_point + 128 &&
                  u.output.zero_point == info.output.zero_point + 128,
              "uint8 io: zero points %d, %d; int8 %d, %d", u.input.zero_point,
              u.output.zero_point, info.input.zero_point, info.output.zero_point);
    }
    mpt_tensor_alloc(ctx, &x, MPT_INT8, 4, shape);
    mpt_tensor_alloc(ctx, &xu, MPT_UINT8, 4, shape);
    for (k = 0; k < n * H * W * C; k++) {
        ((int8_t *)x.data)[k] = mpt__q_quantize(sample_x[k], &info.input);
        ((uint8_t *)xu.data)[k] = (uint8_t)(((int8_t *)x.data)[k] + 128);
    }
    CHECK(mpt_model_quantized_invoke(q8, &x, &y) == MPT_OK, "invoke: %s", mpt_context_error(ctx));
    CHECK(mpt_model_quantized_invoke(qu8, &xu, &yu) == MPT_OK, "invoke uint8");
    /* the scalar reference, layer by layer */
    cur = (int8_t *)malloc((size_t)(n * H * W * C));
    memcpy(cur, x.data, (size_t)(n * H * W * C));
    layers = info.n_layers;
    for (i = 0; i < layers; i++) {
        mpt_quantized_layer L;
        int8_t *next;
        int64_t r, c, j;
        mpt_model_quantized_layer(q8, i, &L);
        if (L.op != MPT_QOP_FULLY_CONNECTED) continue; /* the reshape: the same bytes */
        next = (int8_t *)malloc((size_t)(n * L.out_channels));
        for (r = 0; r < n; r++)
            for (c = 0; c < L.out_channels; c++) {
                int64_t acc = L.bias_int32[c];
                int32_t v;
                for (j = 0; j < L.depth; j++)
                    acc += (int64_t)(cur[r * L.depth + j] - L.input.zero_point) *
                           L.weights[c * L.depth + j];
                v = ref_requantize((int32_t)acc, L.multiplier[c], L.shift[c]) + L.output.zero_point;
                if (L.activation == MPT_ACT_RELU && v < L.output.zero_point) v = L.output.zero_point;
                next[r * L.out_channels + c] = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v);
            }
        free(cur);
        cur = next;
    }
    for (k = 0; y.data && k < n * CLASSES; k++) {
        mismatches += cur[k] != ((int8_t *)y.data)[k];
        mismatches += yu.data && ((uint8_t *)yu.data)[k] != (uint8_t)(cur[k] + 128);
    }
    CHECK(mismatches == 0, "%d outputs differ from the scalar reference", mismatches);
    /* float io: the same codes, dequantized */
    {
        mpt_model *qf = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
        mpt_tensor p;
        int diff = 0;
        CHECK(qf && mpt_model_predict(qf, d, 7, &p) == MPT_OK, "predict");
        for (k = 0; qf && k < n * CLASSES; k++)
            diff += ((float *)p.data)[k] != (cur[k] - info.output.zero_point) * info.output.scale;
        CHECK(diff == 0, "%d float outputs are not the int8 ones dequantized", diff);
        if (qf) mpt_tensor_free(ctx, &p);
        mpt_model_destroy(qf);
    }
    free(cur);
    mpt_tensor_free(ctx, &x);
    mpt_tensor_free(ctx, &xu);
    mpt_tensor_free(ctx, &y);
    mpt_tensor_free(ctx, &yu);
done:
    mpt_model_destroy(q8);
    mpt_model_destroy(qu8);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* The float32 input's quantization, 16 values at a time with AVX-512 and
   the rest one by one, against mpt__q_quantize: ties of x / scale (scale
   0.25: every odd multiple of 0.125 is one), values near and past ±1000
   steps, ±inf, NaN and huge ones, for zero points at both ends. */
static void test_quantize_input_lanes(void) {
    static const float scales[] = {0.25f, 0.0137f, 3.0f};
    static const int32_t zps[] = {-128, -3, 0, 127};
    enum { COUNT = 16 * 300 + 7 };
    static float x[COUNT];
    static int8_t q[COUNT];
    mpt_context *ctx = quiet_ctx();
    int si, zi, avx512, off;
    int64_t k;
    test_seed(57);
    for (si = 0; si < 3; si++)
        for (zi = 0; zi < 4; zi++)
            for (avx512 = 0; avx512 <= ((mpt_context_cpu_features(ctx) & MPT_CPU_AVX512) != 0);
                 avx512++) {
                mpt_quant_params p;
                mpt__qinput_job j;
                memset(&p, 0, sizeof p);
                p.scale = scales[si], p.zero_point = zps[zi];
                for (k = 0; k < COUNT; k++)
                    x[k] = k % 4 == 0   ? (float)(k / 4 - 600) * 0.125f
                           : k % 4 == 1 ? (float)test_uniform(-1100.0, 1100.0) * p.scale
                           : k % 4 == 2 ? (float)test_uniform(-2.0, 2.0)
                                        : (float)test_uniform(-1e10, 1e10);
                x[5] = INFINITY, x[22] = -INFINITY, x[39] = NAN, x[COUNT - 1] = NAN;
                x[40] = 1e38f, x[41] = -1e38f, x[42] = 999.5f * p.scale, x[43] = -999.5f * p.scale;
                memset(q, 0x5a, sizeof q);
                memset(&j, 0, sizeof j);
                j.x = x, j.q = q, j.n = 1, j.count = COUNT, j.p = &p, j.avx512 = avx512;
                mpt__q_quantize_input_task(&j, 0, 0);
                for (off = 0, k = 0; k < COUNT; k++) off += q[k] != mpt__q_quantize(x[k], &p);
                CHECK(off == 0, "scale %g, zero point %d, avx512 %d: %d of %d values differ",
                      (double)p.scale, p.zero_point, avx512, off, COUNT);
            }
    mpt_context_destroy(ctx);
}

/* The dynamic products' rows quantized with AVX-512 (where the CPU has
   it) against the C loop: the same codes and scales, bit for bit, on rows
   of every length from 1 to 40 and of 101, 208 and 256 (the largest
   sought four vectors a step, then the tail's), with ties (127·k/2 of a
   row whose largest is 127), zeros, a row of zeros, and rows holding inf
   or NaN (left to the C loop). */
static void test_symmetric_rows_lanes(void) {
    enum { ROWS = 12, MAXC = 256 };
    static float x[ROWS * MAXC];
    static int8_t q[2][ROWS * MAXC];
    static float scale[2][ROWS];
    mpt_context *ctx = quiet_ctx();
    int64_t length, cols, k;
    int v, off = 0;
    test_seed(63);
    for (length = 1; length <= 43; length++) {
        cols = length <= 40 ? length : length == 41 ? MAXC : length == 42 ? 101 : 208;
        for (k = 0; k < ROWS * cols; k++) x[k] = (float)test_uniform(-3.0, 3.0);
        for (k = 0; k < cols; k++) x[k] = k == 0 ? 127.0f : (float)(k % 255 - 127) * 0.5f; /* ties */
        for (k = 0; k < cols; k++) x[cols + k] = 0.0f;
        if (cols > 2) x[2 * cols + 1] = INFINITY, x[3 * cols + 2] = NAN, x[4 * cols] = -INFINITY;
        for (v = 0; v < 2; v++) {
            mpt__qrows_job j;
            memset(&j, 0, sizeof j);
            memset(q[v], 0x5a, sizeof q[v]);
            j.rows = ROWS, j.cols = cols, j.x = x, j.q = q[v], j.scale = scale[v];
            j.avx512 = v && (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512) != 0;
            mpt__q_quantize_rows_task(&j, 0, 0);
            mpt__q_quantize_rows_task(&j, 1, 0);
        }
        off += memcmp(q[0], q[1], (size_t)(ROWS * cols)) != 0 ||
               memcmp(scale[0], scale[1], sizeof scale[0]) != 0;
        CHECK(q[0][0] == 127 && (cols < 3 || q[0][2] == -63), /* −62.5: away from zero */
              "cols %lld: the ties", (long long)cols);
    }
    CHECK(off == 0, "%d row lengths quantize differently with AVX-512", off);
    mpt_context_destroy(ctx);
}

/* A uint8 dataset's bytes through the 256-entry table, 64 at a time with
   AVX-512 VBMI where the CPU has it and one by one otherwise, against the
   table read in C: every byte value, runs that start and end anywhere in
   a 64-byte block, poisoned outputs, and the bytes around a run untouched. */
static void test_byte_table_lanes(void) {
    enum { COUNT = 64 * 5 + 37 };
    static uint8_t bytes[COUNT];
    static int8_t table[256], q[COUNT + 64];
    mpt_context *ctx = quiet_ctx();
    const int has_vbmi = (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512_VBMI) &&
                         (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512);
    int vbmi, start, off;
    int64_t k;
    test_seed(58);
    for (k = 0; k < 256; k++) table[k] = (int8_t)test_randint(-128, 127);
    for (k = 0; k < COUNT; k++) bytes[k] = (uint8_t)(k < 256 ? k : test_randint(0, 255));
    for (vbmi = 0; vbmi <= has_vbmi; vbmi++)
        for (start = 0; start < 70; start += 13) {
            mpt__qinput_job j;
            memset(q, 0x5a, sizeof q);
            memset(&j, 0, sizeof j);
            j.bytes = bytes + start, j.table = table, j.q = q + 1;
            j.n = 1, j.count = COUNT - start - start / 2, j.vbmi = vbmi, j.avx512 = vbmi;
            mpt__q_quantize_input_task(&j, 0, 0);
            for (off = 0, k = 0; k < j.count; k++) off += q[1 + k] != table[bytes[start + k]];
            off += q[0] != 0x5a || q[1 + j.count] != 0x5a;
            CHECK(off == 0, "vbmi %d, %lld bytes from %d: %d differ from the table", vbmi,
                  (long long)j.count, start, off);
        }
    CHECK(has_vbmi || !(mpt__cpu_features(1) & MPT_CPU_AVX512_VBMI), "VBMI detected but not used");
    mpt_context_destroy(ctx);
}

/* A Conv2D that absorbs a chain copies its input rows through the
   chain's per-channel tables (mpt__qconv_table_copy); the AVX-512 copy
   (16 channels a gather) gives the portable loop's bytes: channel counts
   below, at and past 16 and 32 (the masked last lanes), 1 to 7 pixels,
   every code, and nothing written past the copy. The table ends in 4
   bytes of 0x5a that no output may show, as the gather's last word reads
   them. */
static void test_table_copy_lanes(void) {
    static const int64_t channels[] = {2, 3, 15, 16, 17, 31, 32, 33, 64};
    static int8_t table[64 * 256 + 4], src[64 * 7];
    static uint8_t want[64 * 7], got[64 * 7 + 8];
    mpt_context *ctx = quiet_ctx();
    int ci, pixels, bad = 0, cases = 0;
    if (!(mpt_context_cpu_features(ctx) & MPT_CPU_AVX512)) {
        SKIP("this CPU lacks AVX-512");
        mpt_context_destroy(ctx);
        return;
    }
#if MPT__X86
    test_seed(61);
    for (ci = 0; ci < 9; ci++)
        for (pixels = 1; pixels <= 7; pixels += 3) {
            const int64_t C = channels[ci], n = C * pixels;
            int64_t k;
            for (k = 0; k < 256 * C; k++) table[k] = (int8_t)test_randint(-128, 127);
            memset(table + 256 * C, 0x5a, 4);
            for (k = 0; k < n; k++) /* the first pixels walk through every code */
                src[k] = (int8_t)(k < 256 ? k - 128 : test_randint(-128, 127));
            src[n - 1] = 127; /* the last channel's last entry: the table's last word */
            memset(got, 0xa5, sizeof got);
            mpt__qconv_table_copy(want, src, pixels, C, table);
            mpt__qconv_table_copy_avx512(got, src, pixels, C, table);
            for (k = 0; k < n; k++) bad += got[k] != want[k];
            for (k = n; k < n + 8; k++) bad += got[k] != 0xa5;
            cases++;
        }
#endif
    CHECK(cases == 27 && bad == 0, "%d bytes of %d copies differ from the portable loop's", bad,
          cases);
    mpt_context_destroy(ctx);
}

/* A full-integer model's Dense and Conv2D products skip mpt_qgemm's
   checks (mpt__qgemm_prepared), their requantization's plain test made
   once (mpt__qop.plain_requant): each weighted op's product of 1, 3 and
   13 rows of random codes (mpt__q_product) gives the bytes mpt_qgemm
   gives on the descriptor written here from the op's fields, and the
   cached test is the one mpt_qgemm makes, on 1 and 2 threads. */
static void test_products_as_public_qgemm(void) {
    static const int kinds[] = {MODEL_CNN, MODEL_DENSE, MODEL_WIDE, MODEL_RESIDUAL};
    static const int64_t rows[] = {1, 3, 13};
    int ki, threads, ri, products = 0, bad = 0, flags = 0;
    make_samples(33);
    for (ki = 0; ki < 4; ki++)
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
            mpt_model *m = make_model(ctx, kinds[ki], 340 + (unsigned)ki);
            mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
            mpt_model *q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
            int i;
            test_seed(90 + (unsigned)ki);
            for (i = 0; q && i < q->quantized->n_ops; i++) {
                const mpt__qop *op = &q->quantized->ops[i];
                const int64_t N = op->info.out_channels, K = op->info.depth;
                if (!mpt__qop_weighted(op)) continue;
                flags += op->plain_requant != mpt__requant_is_plain(K, N, op->shift, N, op->bq);
                for (ri = 0; ri < 3; ri++) {
                    const int64_t M = rows[ri];
                    int8_t *a = (int8_t *)malloc((size_t)(M * K));
                    int8_t *got = (int8_t *)malloc((size_t)(M * N));
                    int8_t *want = (int8_t *)malloc((size_t)(M * N));
                    mpt_qgemm_desc g;
                    int64_t k;
                    for (k = 0; k < M * K; k++) a[k] = (int8_t)test_randint(-128, 127);
                    memset(&g, 0, sizeof g);
                    g.m = M, g.n = N, g.k = K, g.a = a, g.lda = K;
                    g.b = op->wq, g.ldb = K, g.trans_b = 1;
                    g.a_zero_point = op->info.input.zero_point;
                    g.bias = op->bq, g.c_int8 = want, g.ldc = N;
                    g.multiplier = op->mult, g.shift = op->shift, g.per_channel = 1;
                    g.c_zero_point = op->info.output.zero_point;
                    g.c_min = op->info.activation == MPT_ACT_RELU ? op->info.output.zero_point
                                                                  : -128;
                    g.c_max = 127;
                    CHECK(mpt_qgemm(ctx, &g) == MPT_OK, "qgemm: %s", mpt_context_error(ctx));
                    CHECK(mpt__q_product(ctx, q->quantized, i, MPT__QX_INTEGER, a, M, NULL, got,
                                         NULL) == MPT_OK,
                          "product: %s", mpt_context_error(ctx));
                    bad += memcmp(got, want, (size_t)(M * N)) != 0;
                    products++;
                    free(a), free(got), free(want);
                }
            }
            CHECK(q != NULL, "model %d: quantize failed", kinds[ki]);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
    CHECK(products >= 4 * 2 * 3 * 2 && bad == 0 && flags == 0,
          "%d of %d products differ from mpt_qgemm's, %d cached plain tests differ", bad,
          products, flags);
}

/* The table a full-integer model reads a uint8 dataset's bytes through
   (mpt__q_byte_table: AVX-512 where the CPU has it) holds each byte's
   float quantized one by one (mpt__q_quantize): [0, 1] and [-1, 1]
   normalisations and values on the ties, under scales and zero points
   that clamp some of them, and a NaN. */
static void test_byte_table_values(void) {
    static const float scales[] = {1.0f / 255.0f, 2.0f / 255.0f, 0.5f, 1.0f / 1024.0f};
    static const int zero_points[] = {-128, 0, 5, 127};
    mpt_context *ctx = quiet_ctx();
    float f[256];
    int8_t got[256];
    int si, zi, form, v, bad = 0;
    for (form = 0; form < 3; form++)
        for (si = 0; si < 4; si++)
            for (zi = 0; zi < 4; zi++) {
                mpt_quant_params p;
                memset(&p, 0, sizeof p);
                p.scale = scales[si], p.zero_point = zero_points[zi];
                for (v = 0; v < 256; v++)
                    f[v] = form == 0   ? (float)v / 255.0f
                           : form == 1 ? (float)v / 127.5f - 1.0f
                                       : ((float)(v - 128) + 0.5f) * p.scale; /* ties */
                if (form == 2) f[7] = NAN;
                mpt__q_byte_table(ctx, &p, f, got);
                for (v = 0; v < 256; v++) bad += got[v] != mpt__q_quantize(f[v], &p);
            }
    CHECK(bad == 0, "%d entries of 48 tables differ from mpt__q_quantize's", bad);
    mpt_context_destroy(ctx);
}

/* A full-integer model reads a uint8 dataset's bytes through a table
   (the byte's normalised float, quantized once): predict and evaluate give
   the bits they give on the same samples as float32, on every model kind,
   scale and offset, batch sizes that leave a partial batch, 1 and 2 threads. */
static void test_uint8_samples_as_float32(void) {
    static uint8_t bytes[N_SAMPLES * H * W * C];
    static float floats[N_SAMPLES * H * W * C];
    static const float scale[] = {0.0f, 0.0123f}, offset[] = {0.0f, -1.5f};
    int kind, v, threads, i;
    for (threads = 1; threads <= 2; threads++) {
        mpt_context *ctx;
        CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &ctx) == MPT_OK,
              "context");
        make_samples(71);
        test_seed(72);
        for (i = 0; i < N_SAMPLES * H * W * C; i++) bytes[i] = (uint8_t)test_randint(0, 255);
        for (kind = MODEL_CNN; kind <= MODEL_DENSE; kind++)
            for (v = 0; v < 2; v++) {
                mpt_model *m = make_model(ctx, kind, 80 + kind), *q;
                mpt_dataset *rep = samples_dataset(ctx, N_SAMPLES, sample_x), *du = NULL, *df;
                mpt_tensor tx, ty, pu, pf;
                mpt_logs lu, lf;
                int64_t xs[4] = {N_SAMPLES, H, W, C}, ys[1] = {N_SAMPLES};
                const float sc = scale[v] ? scale[v] : 1.0f / 255;
                mpt_model_compile(m, &(mpt_compile_desc){
                    .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                    .metrics = MPT_METRIC_ACCURACY});
                q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, rep, MPT_FLOAT32);
                mpt_tensor_wrap(ctx, &tx, MPT_UINT8, 4, xs, bytes);
                mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, sample_y);
                CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty,
                                                                  .scale = scale[v],
                                                                  .offset = offset[v]},
                                         &du) == MPT_OK, "%s", mpt_context_error(ctx));
                for (i = 0; du && i < N_SAMPLES * H * W * C; i++) /* what a float32 batch holds */
                    floats[i] = du->u8_f32[bytes[i]];
                CHECK(du && fabsf(du->u8_f32[200] - (200 * sc + offset[v])) < 1e-5f,
                      "the dataset's scale");
                df = samples_dataset(ctx, N_SAMPLES, floats);
                memset(&pu, 0, sizeof pu), memset(&pf, 0, sizeof pf);
                CHECK(q && du && df && mpt_model_predict(q, du, 40, &pu) == MPT_OK &&
                          mpt_model_predict(q, df, 40, &pf) == MPT_OK,
                      "predict: %s", mpt_context_error(ctx));
                CHECK(pu.data && pf.data && mpt_tensor_bytes(&pu) == mpt_tensor_bytes(&pf) &&
                          memcmp(pu.data, pf.data, mpt_tensor_bytes(&pu)) == 0,
                      "model %d, scale %g offset %g, %d threads: uint8 and float32 samples "
                      "predict differently", kind, (double)sc, (double)offset[v], threads);
                CHECK(mpt_model_evaluate(q, du, &(mpt_evaluate_desc){.batch_size = 33}, &lu) ==
                              MPT_OK &&
                          mpt_model_evaluate(q, df, &(mpt_evaluate_desc){.batch_size = 33}, &lf) ==
                              MPT_OK && memcmp(&lu, &lf, sizeof lu) == 0,
                      "model %d: uint8 and float32 samples evaluate differently", kind);
                mpt_tensor_free(ctx, &pu);
                mpt_tensor_free(ctx, &pf);
                mpt_dataset_destroy(du);
                mpt_dataset_destroy(df);
                mpt_dataset_destroy(rep);
                mpt_model_destroy(q);
                mpt_model_destroy(m);
            }
        mpt_context_destroy(ctx);
    }
}

/* A binary classifier with `units` sigmoid units (one, or several
   independent labels) and binary crossentropy counts accuracy as Keras'
   binary_accuracy: each probability past 0.5 where its label is 1, the
   mean over every unit; not an argmax over the units. The float model's
   evaluate and every quantized mode's agree with that count from their
   own predictions, and so does their auc with Keras' AUC of them. */
static void check_binary_accuracy(mpt_context *ctx, mpt_model *q, const float *targets,
                                  int units, const mpt_dataset *d, const char *what) {
    mpt_tensor p;
    mpt_logs logs;
    int i, hits = 0, ones = 0, n = N_SAMPLES * units;
    memset(&p, 0, sizeof p);
    CHECK(mpt_model_predict(q, d, 32, &p) == MPT_OK &&
              mpt_model_evaluate(q, d, &(mpt_evaluate_desc){.batch_size = 40}, &logs) == MPT_OK,
          "%s: %s", what, mpt_context_error(ctx));
    for (i = 0; p.data && i < n; i++) {
        hits += (((const float *)p.data)[i] > 0.5f) == (targets[i] == 1.0f);
        ones += ((const float *)p.data)[i] > 0.5f;
    }
    CHECK(ones > 0 && ones < n, "%s: every prediction on one side (%d of %d)", what, ones, n);
    CHECK(fabs(mpt_logs_get(&logs, "accuracy") - (double)hits / n) < 1e-9,
          "%s, %d units: accuracy %g, %d of %d predictions right", what, units,
          mpt_logs_get(&logs, "accuracy"), hits, n);
    if (p.data) { /* and auc over every unit, as Keras' AUC() flattens them */
        double want = auc_direct((const float *)p.data, targets, NULL, N_SAMPLES, units, 0);
        CHECK(fabs(mpt_logs_get(&logs, "auc") - want) <= 1e-9 * want,
              "%s, %d units: auc %.17g, from the predictions %.17g", what, units,
              mpt_logs_get(&logs, "auc"), want);
    }
    mpt_tensor_free(ctx, &p);
}

static void test_binary_accuracy(void) {
    mpt_context *ctx = quiet_ctx();
    int units;
    static float targets[N_SAMPLES * 3];
    make_samples(91);
    for (units = 1; units <= 3; units += 2) {
        mpt_model *m = NULL;
        mpt_dataset *d = NULL;
        mpt_tensor tx, ty;
        int64_t xs[4] = {N_SAMPLES, H, W, C}, ys[2] = {N_SAMPLES, units};
        int i, mode;
        for (i = 0; i < N_SAMPLES * units; i++)
            targets[i] = (float)((sample_y[i / units] >> (i % units)) & 1);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, sample_x);
        mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, ys, targets);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
              "dataset: %s", mpt_context_error(ctx));
        CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                                      .seed = 3}, &m) == MPT_OK, "create");
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = units, .activation = MPT_ACT_SIGMOID});
        CHECK(mpt_model_compile(m, &(mpt_compile_desc){
                  .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
                  .metrics = MPT_METRIC_ACCURACY | MPT_METRIC_AUC}) == MPT_OK &&
                  mpt_model_build(m, 32) == MPT_OK, "%s", mpt_context_error(ctx));
        randomize(m, 92);
        for (i = 0; m && i < mpt_model_param_count(m); i++) { /* logits well away from 0 */
            mpt_param_info info;
            int64_t k;
            mpt_model_param(m, i, &info);
            for (k = 0; strstr(info.name, "kernel") && k < mpt_tensor_count(&info.value); k++)
                ((float *)info.value.data)[k] *= 4.0f;
        }
        if (m) mpt_model_refresh_weights(m);
        if (m && d) check_binary_accuracy(ctx, m, targets, units, d, "float32");
        for (mode = 0; m && d && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
            mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
            char what[32];
            snprintf(what, sizeof what, "mode %d", mode);
            CHECK(q != NULL, "%s: quantize", what);
            if (q) check_binary_accuracy(ctx, q, targets, units, d, what);
            mpt_model_destroy(q);
        }
        mpt_model_destroy(m);
        mpt_dataset_destroy(d);
    }
    mpt_context_destroy(ctx);
}

/* Sample weights in the quantized model's evaluate, as in the float
   model's: the loss Σ w·l over the samples' count (Keras'
   sum_over_batch_size), each weighted metric Σ w·metric / Σ w. Weights
   of 1 evaluate bit for bit as none; weights of 2 on the even samples
   (1 on the others) against the same sums in double from the quantized
   predict's outputs, in every mode, with a partial last batch. */
static double clipped(double p) { return p < 1e-7 ? 1e-7 : p > 1 - 1e-7 ? 1 - 1e-7 : p; }

static void check_weighted_evaluate(mpt_context *ctx, mpt_model *q, const float *targets,
                                    int binary, const char *what) {
    static float ones[N_SAMPLES], w[N_SAMPLES];
    mpt_dataset *d = NULL;
    mpt_tensor tx, ty, p;
    mpt_logs plain, with_ones, weighted;
    int64_t xs[4] = {N_SAMPLES, H, W, C}, ys[1] = {N_SAMPLES};
    double loss = 0, sw = 0, hit = 0, in_top2 = 0, tp = 0, fp = 0, fn = 0;
    int i, c;
    for (i = 0; i < N_SAMPLES; i++) ones[i] = 1.0f, w[i] = i % 2 ? 1.0f : 2.0f;
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, sample_x);
    if (binary) mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 1, ys, (void *)targets);
    else mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, sample_y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    memset(&p, 0, sizeof p);
    CHECK(d && mpt_model_predict(q, d, 32, &p) == MPT_OK &&
              mpt_model_evaluate(q, d, &(mpt_evaluate_desc){.batch_size = 40}, &plain) ==
                  MPT_OK &&
              mpt_dataset_set_sample_weight(ctx, d, ones, N_SAMPLES) == MPT_OK &&
              mpt_model_evaluate(q, d, &(mpt_evaluate_desc){.batch_size = 40}, &with_ones) ==
                  MPT_OK &&
              mpt_dataset_set_sample_weight(ctx, d, w, N_SAMPLES) == MPT_OK &&
              mpt_model_evaluate(q, d, &(mpt_evaluate_desc){.batch_size = 40}, &weighted) ==
                  MPT_OK,
          "%s: %s", what, mpt_context_error(ctx));
    CHECK(memcmp(&plain, &with_ones, sizeof plain) == 0,
          "%s: weights of 1 evaluate otherwise than none (loss %.17g, %.17g)", what,
          mpt_logs_get(&plain, "loss"), mpt_logs_get(&with_ones, "loss"));
    for (i = 0; p.data && i < N_SAMPLES; i++) {
        const float *row = (const float *)p.data + i * (binary ? 1 : CLASSES);
        double l;
        if (binary) {
            double pc = clipped(row[0]), t = targets[i];
            int predicted = row[0] > 0.5f;
            l = -(t * log(pc) + (1 - t) * log(1 - pc));
            hit += w[i] * (predicted == (t > 0.5));
            fn += w[i] * (!predicted && t != 0);
            tp += w[i] * (predicted && t != 0);
            fp += w[i] * (predicted && t == 0);
        } else {
            double sum = 0;
            int best = 0, above = 0;
            for (c = 0; c < CLASSES; c++) sum += row[c];
            l = -log(clipped(row[sample_y[i]] / sum));
            for (c = 1; c < CLASSES; c++) best = row[c] > row[best] ? c : best;
            for (c = 0; c < CLASSES; c++) above += row[c] > row[sample_y[i]];
            hit += w[i] * (best == sample_y[i]);
            in_top2 += w[i] * (above < 2);
        }
        loss += w[i] * l;
        sw += w[i];
    }
#define CLOSE_TO(name, want, tol)                                                              \
    CHECK(fabs(mpt_logs_get(&weighted, name) - (want)) <= (tol) * fabs(want) + 1e-12,          \
          "%s: %s %.17g, from the predictions %.17g", what, name,                              \
          mpt_logs_get(&weighted, name), (double)(want))
    CLOSE_TO("loss", loss / N_SAMPLES, 1e-5);
    CHECK(fabs(mpt_logs_get(&weighted, "loss") - mpt_logs_get(&plain, "loss")) > 1e-6,
          "%s: the weights changed nothing", what);
    if (binary) {
        CLOSE_TO("accuracy", hit / sw, 1e-12);
        CLOSE_TO("precision", tp / (tp + fp), 1e-12);
        CLOSE_TO("recall", tp / (tp + fn), 1e-12);
        if (p.data) {
            CLOSE_TO("weighted_auc", auc_direct((const float *)p.data, targets, w, N_SAMPLES, 1, 0),
                     1e-9);
            CLOSE_TO("auc", auc_direct((const float *)p.data, targets, NULL, N_SAMPLES, 1, 0),
                     1e-9);
        }
    } else {
        CLOSE_TO("weighted_accuracy", hit / sw, 1e-12);
        CLOSE_TO("sparse_top_k_categorical_accuracy", in_top2 / sw, 1e-12);
        CHECK(mpt_logs_get(&weighted, "accuracy") == mpt_logs_get(&plain, "accuracy"),
              "%s: the unweighted accuracy moved with the weights", what);
    }
#undef CLOSE_TO
    mpt_tensor_free(ctx, &p);
    mpt_dataset_destroy(d);
}

static void test_weighted_evaluate(void) {
    mpt_context *ctx = quiet_ctx();
    static float targets[N_SAMPLES];
    int binary, mode, i;
    make_samples(101);
    for (i = 0; i < N_SAMPLES; i++) targets[i] = (float)(sample_y[i] & 1);
    for (binary = 0; binary <= 1; binary++) {
        mpt_model *m = NULL;
        mpt_dataset *rep = samples_dataset(ctx, N_SAMPLES, sample_x);
        CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                                      .seed = 5}, &m) == MPT_OK, "create");
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = binary ? 1 : CLASSES,
                                                 .activation = binary ? MPT_ACT_SIGMOID
                                                                      : MPT_ACT_SOFTMAX});
        CHECK(mpt_model_compile(
                  m, binary ? &(mpt_compile_desc){
                                  .loss = {.type = MPT_LOSS_BINARY_CROSSENTROPY},
                                  .metrics = MPT_METRIC_AUC,
                                  .weighted_metrics = MPT_METRIC_ACCURACY | MPT_METRIC_AUC |
                                                      MPT_METRIC_PRECISION | MPT_METRIC_RECALL}
                            : &(mpt_compile_desc){
                                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                  .metrics = MPT_METRIC_ACCURACY,
                                  .top_k = 2,
                                  .weighted_metrics = MPT_METRIC_ACCURACY |
                                                      MPT_METRIC_SPARSE_TOP_K}) == MPT_OK &&
                  mpt_model_build(m, 32) == MPT_OK,
              "%s", mpt_context_error(ctx));
        randomize(m, 102 + binary);
        for (mode = 0; m && rep && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
            mpt_model *q = quantize(m, (mpt_quantize_mode)mode, rep, MPT_FLOAT32);
            char what[64];
            snprintf(what, sizeof what, "%s, mode %d", binary ? "binary" : "sparse", mode);
            if (q) check_weighted_evaluate(ctx, q, targets, binary, what);
            mpt_model_destroy(q);
        }
        mpt_dataset_destroy(rep);
        mpt_model_destroy(m);
    }
    mpt_context_destroy(ctx);
}

/* One output of a full-integer Conv2D from its int8 input (h, w, c), as
   the accessor gives the layer: OHWI weights, 'same' padding TensorFlow's
   (the extra row and column at the bottom and right), pixels outside the
   image at the input's zero point (real 0). */
static int8_t conv_int8_reference(const mpt_quantized_layer *L, const int8_t *x, int64_t oy,
                                  int64_t ox, int64_t f) {
    const int64_t h = L->in_shape[0], w = L->in_shape[1], c = L->in_shape[2];
    const int64_t kh = L->kernel_size[0], kw = L->kernel_size[1];
    const int64_t sh = L->strides[0], sw = L->strides[1];
    int64_t top = 0, left = 0, acc = L->bias_int32[f], i, j, e;
    int32_t v;
    if (L->padding == MPT_PADDING_SAME) {
        top = ((L->out_shape[0] - 1) * sh + kh - h) / 2;
        left = ((L->out_shape[1] - 1) * sw + kw - w) / 2;
        top = top < 0 ? 0 : top, left = left < 0 ? 0 : left;
    }
    for (i = 0; i < kh; i++)
        for (j = 0; j < kw; j++)
            for (e = 0; e < c; e++) {
                const int64_t y = oy * sh - top + i, xx = ox * sw - left + j;
                const int32_t in = y >= 0 && y < h && xx >= 0 && xx < w
                                       ? x[(y * w + xx) * c + e] : L->input.zero_point;
                acc += (int64_t)(in - L->input.zero_point) * L->weights[((f * kh + i) * kw + j) * c + e];
            }
    v = ref_requantize((int32_t)acc, L->multiplier[f], L->shift[f]) + L->output.zero_point;
    if (L->activation == MPT_ACT_RELU && v < L->output.zero_point) v = L->output.zero_point;
    return (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v);
}

/* Small convolutions (a 3×3 one on one channel, K = 9, and a 2×2 'same'
   one on four, K = 16: the depths whose im2col rows are copied and packed
   without calls) in a full-integer model with float32 input, against a
   scalar reference layer by layer from the input quantized one value at
   a time, on every SIMD path and on 1 and 2 threads, bit for bit. */
static void test_small_conv_scalar_reference(void) {
    static const int disable[] = {0, MPT_CPU_AVX512 | MPT_CPU_AVX512_VNNI | MPT_CPU_AVX512_BF16,
                                  ~0};
    enum { N = 11, IH = 9, IW = 7 };
    static float xs[N * IH * IW];
    static int32_t ys[N];
    int di, threads;
    for (di = 0; di < 3; di++)
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *ctx = NULL;
            mpt_context_desc cd;
            mpt_model *m = NULL, *q = NULL;
            mpt_dataset *d = NULL;
            mpt_tensor tx, ty, p;
            mpt_quantized_info info;
            int64_t shape[4] = {N, IH, IW, 1}, yshape[1] = {N}, k, r;
            int8_t *cur, *next;
            int i, diff = 0;
            memset(&cd, 0, sizeof cd);
            memset(&p, 0, sizeof p);
            cd.num_threads = threads, cd.disable_cpu_features = disable[di];
            CHECK(mpt_context_create(&cd, &ctx) == MPT_OK, "context");
            test_seed(71);
            for (k = 0; k < N * IH * IW; k++) xs[k] = (float)test_uniform(-0.2, 1.0);
            for (k = 0; k < N; k++) ys[k] = (int32_t)(k % 3);
            CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {IH, IW, 1},
                                                          .input_rank = 3, .seed = 3},
                                   &m) == MPT_OK, "create");
            mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                                       .activation = MPT_ACT_RELU});
            mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 3, .kernel_size = {2, 2},
                                                       .padding = MPT_PADDING_SAME});
            mpt_model_add_flatten(m, NULL);
            mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
            CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
            randomize(m, 72);
            mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
            mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
            CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
                  "dataset");
            q = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
            CHECK(q && mpt_model_predict(q, d, 4, &p) == MPT_OK, "predict: %s",
                  mpt_context_error(ctx));
            if (!q || !p.data) goto next;
            mpt_model_quantized_info(q, &info);
            cur = (int8_t *)malloc((size_t)(N * IH * IW));
            for (k = 0; k < N * IH * IW; k++) cur[k] = mpt__q_quantize(xs[k], &info.input);
            for (i = 0; i < info.n_layers; i++) {
                mpt_quantized_layer L;
                int64_t in_count = 1, out_count = 1, a, c, e;
                mpt_model_quantized_layer(q, i, &L);
                for (a = 0; a < L.in_rank; a++) in_count *= L.in_shape[a];
                for (a = 0; a < L.out_rank; a++) out_count *= L.out_shape[a];
                if (L.op == MPT_QOP_RESHAPE) continue;
                next = (int8_t *)malloc((size_t)(N * out_count));
                for (r = 0; r < N; r++)
                    for (e = 0; e < out_count; e++) {
                        if (L.op == MPT_QOP_CONV_2D) {
                            const int64_t f = e % L.out_channels, pix = e / L.out_channels;
                            next[r * out_count + e] = conv_int8_reference(
                                &L, cur + r * in_count, pix / L.out_shape[1],
                                pix % L.out_shape[1], f);
                        } else {
                            int64_t acc = L.bias_int32[e];
                            int32_t v;
                            for (c = 0; c < L.depth; c++)
                                acc += (int64_t)(cur[r * in_count + c] - L.input.zero_point) *
                                       L.weights[e * L.depth + c];
                            v = ref_requantize((int32_t)acc, L.multiplier[e], L.shift[e]) +
                                L.output.zero_point;
                            next[r * out_count + e] = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v);
                        }
                    }
                free(cur);
                cur = next;
            }
            for (k = 0; k < N * 3; k++)
                diff += ((float *)p.data)[k] !=
                        (float)(cur[k] - info.output.zero_point) * info.output.scale;
            CHECK(diff == 0, "cpu features less %#x, %d thread(s): %d of %d outputs differ from "
                  "the scalar reference", (unsigned)disable[di], threads, diff, N * 3);
            free(cur);
        next:
            mpt_tensor_free(ctx, &p);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
}

/* A float16 model's Conv2D runs the float32 model's direct convolution on
   its widened kernel (mpt__q_conv_float16_direct): the float16 model of a
   float model whose weights are float16 values already predicts the
   float model's bits, on shapes that take the one-channel kernel,
   Winograd's 3×3 and the tiles, with and without ReLU, on 1 and 2 threads;
   and again on the next calls (batches of 1, then all), which read the
   kernel the first one prepared (conv_ws, kept: the one-channel and
   Winograd cases, where AVX-512 runs the direct convolution). With a
   MaxPooling2D after it (the last case: Winograd in chunks, its pooling
   declined by the epilogue), the next call still
   reads the kernel kept, not one prepared again: with the kept one
   spoilt, its outputs change. */
static void test_float16_conv_direct(void) {
    static const struct {
        int64_t h, w, c, filters, k, stride;
        mpt_padding pad;
        int relu, pool;
    } cases[] = {
        {28, 28, 1, 32, 3, 1, MPT_PADDING_VALID, 1, 0},
        {10, 9, 16, 16, 3, 1, MPT_PADDING_SAME, 0, 0},
        {11, 9, 3, 8, 5, 2, MPT_PADDING_SAME, 1, 0},
        {10, 12, 16, 16, 3, 1, MPT_PADDING_SAME, 1, 1},
    };
    enum { N = 7 };
    int ci, threads;
    for (ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++)
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
            const int direct = (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512) != 0;
            mpt_model *m = NULL, *q = NULL;
            mpt_dataset *d = NULL;
            mpt_tensor tx, ty, a, b;
            const int64_t count = N * cases[ci].h * cases[ci].w * cases[ci].c;
            int64_t shape[4] = {N, cases[ci].h, cases[ci].w, cases[ci].c}, yshape[1] = {N}, k;
            float *xs = (float *)malloc(sizeof(float) * (size_t)count);
            int32_t ys[N] = {0};
            int diff = 0;
            memset(&a, 0, sizeof a), memset(&b, 0, sizeof b);
            test_seed(400 + ci);
            for (k = 0; k < count; k++) xs[k] = (float)test_uniform(-1.0, 1.0);
            mpt_model_create(ctx, &(mpt_model_desc){
                .input_shape = {cases[ci].h, cases[ci].w, cases[ci].c}, .input_rank = 3,
                .seed = 9}, &m);
            mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
                .filters = cases[ci].filters, .kernel_size = {cases[ci].k, cases[ci].k},
                .strides = {cases[ci].stride, cases[ci].stride}, .padding = cases[ci].pad,
                .activation = cases[ci].relu ? MPT_ACT_RELU : MPT_ACT_NONE});
            if (cases[ci].pool)
                mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){.pool_size = {2, 2}});
            mpt_model_add_flatten(m, NULL);
            CHECK(mpt_model_build(m, N) == MPT_OK, "build: %s", mpt_context_error(ctx));
            randomize(m, 500 + ci);
            round_weights_to_half(ctx, m);
            mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
            mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
            CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
                  "dataset: %s", mpt_context_error(ctx));
            q = quantize(m, MPT_QUANTIZE_FLOAT16, NULL, MPT_DTYPE_DEFAULT);
            CHECK(mpt_model_predict(m, d, N, &a) == MPT_OK, "predict float32: %s",
                  mpt_context_error(ctx));
            CHECK(q && mpt_model_predict(q, d, N, &b) == MPT_OK, "predict float16: %s",
                  mpt_context_error(ctx));
            for (k = 0; a.data && b.data && k < mpt_tensor_count(&a); k++)
                diff += ((float *)a.data)[k] != ((float *)b.data)[k];
            CHECK(a.data && b.data && diff == 0,
                  "case %d, %d threads: %d of %lld outputs differ from the float32 model's", ci,
                  threads, diff, (long long)mpt_tensor_count(&a));
            /* the kernel the first call prepared (Winograd's U, the shallow
               kernel's) kept and read by the next calls: a batch of 1 first,
               then the whole batch again, the same outputs */
            CHECK(!q || ci == 2 || /* (the 5×5 stride-2 one declines: im2col) */
                      !direct || /* (without AVX-512 every case runs im2col's GEMM) */
                      (q->quantized->ops[0].conv_ws && q->quantized->ops[0].conv_ws->kept),
                  "case %d: the Conv2D's prepared kernel was not kept", ci);
            for (k = 0; k < 2; k++) {
                mpt_tensor c;
                int64_t e;
                memset(&c, 0, sizeof c);
                diff = 0;
                CHECK(q && mpt_model_predict(q, d, k == 0 ? 1 : N, &c) == MPT_OK,
                      "predict float16 again: %s", mpt_context_error(ctx));
                for (e = 0; a.data && c.data && e < mpt_tensor_count(&a); e++)
                    diff += ((float *)a.data)[e] != ((float *)c.data)[e];
                CHECK(a.data && c.data && diff == 0,
                      "case %d, %d threads, call %d: %d outputs differ with the kept kernel", ci,
                      threads, (int)k + 2, diff);
                mpt_tensor_free(ctx, &c);
            }
            if (cases[ci].pool && direct && q && q->quantized->ops[0].conv_ws) {
                mpt_tensor c;
                memset(&c, 0, sizeof c);
                memset(q->quantized->ops[0].conv_ws->bytes, 0x3C, 256); /* (kept stays 1) */
                CHECK(mpt_model_predict(q, d, N, &c) == MPT_OK && c.data &&
                          memcmp(c.data, a.data, mpt_tensor_bytes(&a)) != 0,
                      "case %d, %d threads: the spoilt kernel was prepared again, not read",
                      ci, threads);
                mpt_tensor_free(ctx, &c);
            }
            mpt_tensor_free(ctx, &a);
            mpt_tensor_free(ctx, &b);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
            free(xs);
        }
}

/* A float16 model's Dense reads its weights as (K, N) kept for the GEMM
   (wh_kept, made once by mpt_model_quantize): batches of 1 to 4 through
   the GEMM's few-rows strips kept in half, larger ones on panels widened
   once. With weights that are float16 values already, every batch
   size's outputs are the float32 model's bit for bit, on 1 and 2 threads
   (B of 600 × 300 halves: the strips run on the pool from 256 KiB), and
   the panels are kept (the strips too where the few-rows path exists:
   AVX-512). */
static void test_float16_dense_in_place(void) {
    enum { N = 9, HH = 10, WW = 10, CC = 6, UNITS = 300 };
    static const int64_t batches[] = {1, 2, 4, 5, 9};
    int threads, bi, i;
    for (threads = 1; threads <= 2; threads++) {
        mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
        mpt_model *m = NULL, *q = NULL;
        mpt_dataset *d = NULL;
        mpt_tensor tx, ty;
        int64_t shape[4] = {N, HH, WW, CC}, yshape[1] = {N}, k;
        static float xs[N * HH * WW * CC];
        int32_t ys[N] = {0};
        test_seed(700 + threads);
        for (k = 0; k < N * HH * WW * CC; k++) xs[k] = (float)test_uniform(-1.0, 1.0);
        mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {HH, WW, CC}, .input_rank = 3,
                                                .seed = 9}, &m);
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = UNITS, .activation = MPT_ACT_RELU});
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10});
        CHECK(mpt_model_build(m, N) == MPT_OK, "build: %s", mpt_context_error(ctx));
        randomize(m, 800 + threads);
        round_weights_to_half(ctx, m);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
              "dataset: %s", mpt_context_error(ctx));
        q = quantize(m, MPT_QUANTIZE_FLOAT16, NULL, MPT_DTYPE_DEFAULT);
        for (i = 0; q && i < q->quantized->n_ops; i++) {
            const mpt__qop *op = &q->quantized->ops[i];
            const int64_t on = op->info.out_channels, ok = op->info.depth;
            const int avx512 = (mpt_context_cpu_features(ctx) & MPT_CPU_AVX512) != 0;
            if (op->info.op != MPT_QOP_FULLY_CONNECTED) continue;
            CHECK(op->wh_kept && op->wh_kept->panels && !op->wh_kept->strips == !avx512 &&
                      op->wh_kept->panels->k == ok && op->wh_kept->panels->n == on,
                  "op %d: its %lld × %lld kernel is not kept as the GEMM reads it", i,
                  (long long)ok, (long long)on);
        }
        if (q) { /* what is kept is counted: the strips too where they are */
            mpt_quantized_info info;
            CHECK(mpt_model_quantized_info(q, &info) == MPT_OK &&
                      info.kept_bytes == float16_kept_bytes(q->quantized) &&
                      info.kept_bytes >= 4 * (600 * UNITS + UNITS * 10),
                  "kept %lld bytes, want %lld", (long long)info.kept_bytes,
                  (long long)float16_kept_bytes(q->quantized));
        }
        for (bi = 0; q && bi < 5; bi++) {
            mpt_tensor a, b;
            int diff = 0;
            memset(&a, 0, sizeof a), memset(&b, 0, sizeof b);
            CHECK(mpt_model_predict(m, d, batches[bi], &a) == MPT_OK, "predict float32: %s",
                  mpt_context_error(ctx));
            CHECK(mpt_model_predict(q, d, batches[bi], &b) == MPT_OK, "predict float16: %s",
                  mpt_context_error(ctx));
            for (k = 0; a.data && b.data && k < mpt_tensor_count(&a); k++)
                diff += ((float *)a.data)[k] != ((float *)b.data)[k];
            CHECK(a.data && b.data && diff == 0,
                  "batch %lld, %d threads: %d of %lld outputs differ from the float32 model's",
                  (long long)batches[bi], threads, diff, (long long)mpt_tensor_count(&a));
            mpt_tensor_free(ctx, &a);
            mpt_tensor_free(ctx, &b);
        }
        mpt_model_destroy(q);
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        mpt_context_destroy(ctx);
    }
}

/* The float16 and dynamic-range models' max pooling runs in float32 as
   the float model's does (the AVX-512 window where the CPU has it): the
   outputs are the float model's bit for bit (a dataset refuses NaN, so
   test_pool's NaN cases stand for the rule), for channel counts below, at
   and past a vector of 16, windows that overlap and run past the image,
   on 1 and 2 threads. */
static void test_float_max_pool_as_float_model(void) {
    static const struct { int64_t c, k, stride; mpt_padding pad; } cases[] = {
        {3, 2, 2, MPT_PADDING_VALID}, {16, 3, 2, MPT_PADDING_SAME}, {20, 2, 1, MPT_PADDING_SAME},
    };
    static const mpt_quantize_mode modes[] = {MPT_QUANTIZE_FLOAT16, MPT_QUANTIZE_DYNAMIC_RANGE};
    enum { N = 5, HH = 9, WW = 7 };
    int ci, mi, threads;
    for (ci = 0; ci < 3; ci++)
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
            mpt_model *m = NULL;
            mpt_dataset *d = NULL;
            mpt_tensor tx, ty, a;
            const int64_t count = N * HH * WW * cases[ci].c;
            int64_t shape[4] = {N, HH, WW, cases[ci].c}, yshape[1] = {N}, k;
            float *xs = (float *)malloc(sizeof(float) * (size_t)count);
            int32_t ys[N] = {0};
            test_seed(900 + ci);
            for (k = 0; k < count; k++) xs[k] = (float)test_uniform(-1.0, 1.0);
            mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {HH, WW, cases[ci].c},
                                                    .input_rank = 3, .seed = 9}, &m);
            mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){
                .pool_size = {cases[ci].k, cases[ci].k},
                .strides = {cases[ci].stride, cases[ci].stride}, .padding = cases[ci].pad});
            mpt_model_add_flatten(m, NULL);
            CHECK(mpt_model_build(m, N) == MPT_OK, "build: %s", mpt_context_error(ctx));
            mpt_model_refresh_weights(m); /* no weights: none to train */
            mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
            mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
            CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
                  "dataset: %s", mpt_context_error(ctx));
            memset(&a, 0, sizeof a);
            CHECK(mpt_model_predict(m, d, N, &a) == MPT_OK, "float pooling: %s",
                  mpt_context_error(ctx));
            for (mi = 0; mi < 2; mi++) {
                mpt_model *q = quantize(m, modes[mi], NULL, MPT_DTYPE_DEFAULT);
                mpt_tensor b;
                memset(&b, 0, sizeof b);
                CHECK(q && mpt_model_predict(q, d, N, &b) == MPT_OK,
                      "quantized pooling: %s", mpt_context_error(ctx));
                CHECK(a.data && b.data && mpt_tensor_bytes(&a) == mpt_tensor_bytes(&b) &&
                          memcmp(a.data, b.data, mpt_tensor_bytes(&a)) == 0,
                      "case %d, mode %d, %d threads: the pooled bits differ from the float "
                      "model's", ci, (int)modes[mi], threads);
                mpt_tensor_free(ctx, &b);
                mpt_model_destroy(q);
            }
            mpt_tensor_free(ctx, &a);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
            free(xs);
        }
}

/* ---- a trained model --------------------------------------------------------------------- */

/* Four classes of 8×8×2 images, each brighter in its own quadrant; a
   small CNN trained a few epochs; every quantized variant's accuracy
   within 3 points of float32's, evaluate's loss close, and the int8
   variants about a quarter the size. */
static void test_trained_model_accuracy(void) {
    mpt_context *ctx = test_ctx_logging(2, quiet_logger);
    mpt_model *m = NULL, *q[3] = {NULL, NULL, NULL};
    mpt_dataset *train = NULL, *test = NULL;
    mpt_logs lf, lq;
    float *x = (float *)malloc(sizeof(float) * 512 * H * W * C);
    int32_t *y = (int32_t *)malloc(sizeof(int32_t) * 512);
    int64_t i, j, float_bytes = 0;
    int mode;
    test_seed(17);
    for (i = 0; i < 512; i++) {
        y[i] = (int32_t)(i % CLASSES);
        for (j = 0; j < H * W * C; j++) {
            int64_t r = j / (W * C), c = (j / C) % W, quad = (r >= H / 2) * 2 + (c >= W / 2);
            x[i * H * W * C + j] = (float)test_uniform(0, 1) + (quad == y[i] ? 0.6f : 0.0f);
        }
    }
    {
        mpt_tensor tx, ty;
        int64_t xs[4] = {512, H, W, C}, ys[1] = {512};
        mpt_dataset *all = NULL;
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, y);
        mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &all);
        mpt_dataset_split(ctx, all, 384, &train, &test);
        mpt_dataset_destroy(all);
    }
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                            .seed = 3}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 8, .kernel_size = {3, 3}});
    mpt_model_add_batch_normalization(m, NULL);
    mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    mpt_model_add_max_pooling2d(m, NULL);
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 32, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
        .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
        .metrics = MPT_METRIC_ACCURACY});
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 8, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, test, NULL, &lf) == MPT_OK, "evaluate");
    CHECK(mpt_logs_get(&lf, "accuracy") > 0.9, "float32 accuracy %g: the task is too hard",
          mpt_logs_get(&lf, "accuracy"));
    for (i = 0; i < mpt_model_param_count(m); i++) {
        mpt_param_info p;
        mpt_model_param(m, (int)i, &p);
        float_bytes += 4 * mpt_tensor_count(&p.value);
    }
    for (mode = 0; mode < 3; mode++) {
        mpt_quantized_info info;
        q[mode] = quantize(m, (mpt_quantize_mode)mode, train, MPT_DTYPE_DEFAULT);
        if (!q[mode]) continue;
        CHECK(mpt_model_evaluate(q[mode], test, NULL, &lq) == MPT_OK, "evaluate mode %d: %s",
              mode, mpt_context_error(ctx));
        CHECK(fabs(mpt_logs_get(&lq, "accuracy") - mpt_logs_get(&lf, "accuracy")) <= 0.03,
              "mode %d: accuracy %g, float32 %g", mode, mpt_logs_get(&lq, "accuracy"),
              mpt_logs_get(&lf, "accuracy"));
        CHECK(fabs(mpt_logs_get(&lq, "loss") - mpt_logs_get(&lf, "loss")) <= 0.05,
              "mode %d: loss %g, float32 %g", mode, mpt_logs_get(&lq, "loss"),
              mpt_logs_get(&lf, "loss"));
        mpt_model_quantized_info(q[mode], &info);
        /* float16 keeps its biases in float32 */
        CHECK(mode == MPT_QUANTIZE_FLOAT16 ? info.size_bytes < float_bytes * 0.51
                                           : info.size_bytes < float_bytes * 0.3,
              "mode %d: %lld bytes, float32 %lld", mode, (long long)info.size_bytes,
              (long long)float_bytes);
    }
    for (mode = 0; mode < 3; mode++) mpt_model_destroy(q[mode]);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    free(x);
    free(y);
}

/* ---- bad input ------------------------------------------------------------------------------ */

static void test_bad_input(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = NULL, *q = NULL, *raw = NULL;
    mpt_dataset *d, *wrong = NULL;
    float other[4 * 10];
    mpt_tensor tx, ty, t;
    mpt_logs logs;
    int k;
    make_samples(18);
    d = samples_dataset(ctx, N_SAMPLES, sample_x);
    for (k = 0; k < 40; k++) other[k] = (float)test_uniform(0, 1);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){4, 10}, other);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){4}, sample_y);
    mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &wrong);

    /* unbuilt, then built but never trained nor given weights */
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3}, &raw);
    mpt_model_add_flatten(raw, NULL);
    mpt_model_add_dense(raw, &(mpt_dense_desc){.units = 3});
    expect_status(ctx, mpt_model_quantize(raw, NULL, &q), MPT_ERR_STATE, "not built", "unbuilt");
    mpt_model_build(raw, 8);
    expect_status(ctx, mpt_model_quantize(raw, NULL, &q), MPT_ERR_STATE, "initial weights",
                  "untrained");
    CHECK(q == NULL, "no model on failure");

    m = make_model(ctx, MODEL_DENSE, 700);
    expect_status(
        ctx, mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER}, &q),
        MPT_ERR_INVALID_ARGUMENT, "representative_data", "no calibration data");
    expect_status(ctx,
                  mpt_model_quantize(m,
                                     &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                          .representative_data = wrong},
                                     &q),
                  MPT_ERR_SHAPE, "representative_data", "mismatched calibration data");
    expect_status(ctx, mpt_model_quantize(m, &(mpt_quantize_desc){.io_dtype = MPT_INT8}, &q),
                  MPT_ERR_INVALID_ARGUMENT, "full-integer", "int8 io in dynamic-range");
    expect_status(ctx, mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                                  .representative_data = d,
                                                                  .io_dtype = MPT_FLOAT16}, &q),
                  MPT_ERR_DTYPE, "io_dtype", "float16 io");
    expect_status(ctx,
                  mpt_model_quantize(m, &(mpt_quantize_desc){.mode = (mpt_quantize_mode)9}, &q),
                  MPT_ERR_INVALID_ARGUMENT, "mode", "unknown mode");
    expect_status(ctx,
                  mpt_model_quantize(m,
                                     &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                          .representative_data = d,
                                                          .calibration = MPT_CALIBRATION_PERCENTILE,
                                                          .percentile = 120},
                                     &q),
                  MPT_ERR_INVALID_ARGUMENT, "percentile", "percentile out of range");
    {   /* an empty dataset: none can be made through the API (a dimension of
           0 is refused), so a one-sample one is emptied by hand */
        mpt_dataset *empty = samples_dataset(ctx, 1, sample_x);
        if (empty) {
            empty->n = 0;
            expect_status(ctx, mpt_model_quantize(m, &(mpt_quantize_desc){
                                                         .mode = MPT_QUANTIZE_FULL_INTEGER,
                                                         .representative_data = empty}, &q),
                          MPT_ERR_INVALID_ARGUMENT, "empty", "empty calibration data");
            empty->n = 1;
            mpt_dataset_destroy(empty);
        }
    }
    /* a weight that is not finite names its layer */
    {
        mpt_param_info p;
        float keep;
        mpt_model_param(m, 0, &p);
        keep = ((float *)p.value.data)[3];
        ((float *)p.value.data)[3] = NAN;
        expect_status(ctx, mpt_model_quantize(m, NULL, &q), MPT_ERR_NUMERIC, p.layer_name,
                      "NaN weight");
        ((float *)p.value.data)[3] = keep;
    }
    /* calibration that overflows names the layer, with either method */
    {
        mpt_param_info p;
        int method;
        float keep[H * W * C * 16]; /* dense/kernel */
        mpt_model_param(m, 0, &p);
        memcpy(keep, p.value.data, sizeof keep);
        for (k = 0; k < H * W * C * 16; k++) ((float *)p.value.data)[k] = 3e38f;
        for (method = 0; method < MPT_CALIBRATION_COUNT_; method++)
            expect_status(ctx, mpt_model_quantize(m, &(mpt_quantize_desc){
                                                      .mode = MPT_QUANTIZE_FULL_INTEGER,
                                                      .representative_data = d,
                                                      .calibration = (mpt_calibration)method}, &q),
                          MPT_ERR_NUMERIC, "not finite in the output of 'dense'", "overflow");
        memcpy(p.value.data, keep, sizeof keep);
    }
    /* the quantized model refuses what only a float model does */
    q = quantize(m, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, MPT_DTYPE_DEFAULT);
    if (q) {
        mpt_model *qq = NULL;
        expect_status(ctx, mpt_model_fit(q, d, NULL), MPT_ERR_STATE, "quantized", "fit");
        expect_status(ctx, mpt_model_build(q, 4), MPT_ERR_STATE, "quantized", "build");
        expect_status(ctx, mpt_model_add_dense(q, &(mpt_dense_desc){.units = 2}), MPT_ERR_STATE,
                      "quantized", "add");
        mpt_tensor_wrap(ctx, &t, MPT_FLOAT32, 4, (int64_t[]){2, H, W, C}, sample_x);
        {
            mpt_tensor o;
            expect_status(ctx, mpt_model_forward(q, &t, 0, &o), MPT_ERR_STATE, "quantized",
                          "forward");
            expect_status(ctx, mpt_model_quantized_invoke(q, &t, &o), MPT_OK, "", "invoke float32");
            mpt_tensor_free(ctx, &o);
            t.dtype = MPT_INT8;
            expect_status(ctx, mpt_model_quantized_invoke(q, &t, &o), MPT_ERR_DTYPE, "float32",
                          "invoke int8 on float io");
        }
        expect_status(ctx, mpt_model_quantize(q, NULL, &qq), MPT_ERR_STATE, "quantized already",
                      "quantize twice");
        expect_status(ctx, mpt_model_save_weights(q, "/tmp/mpt_test_quantize_never.safetensors"),
                      MPT_ERR_STATE, "quantized", "save_weights");
        expect_status(ctx, mpt_model_evaluate(q, d, NULL, &logs), MPT_ERR_STATE, "compile",
                      "evaluate uncompiled");
        expect_status(ctx, mpt_model_predict(q, wrong, 0, &t), MPT_ERR_SHAPE, "predict",
                      "predict shape");
        mpt_model_destroy(q);
    }
    {
        mpt_quantized_info info;
        expect_status(ctx, mpt_model_quantized_info(m, &info), MPT_ERR_STATE, "not quantized",
                      "info of a float model");
    }
    mpt_model_destroy(m);
    /* BatchNormalization after an activation, or first, cannot be folded: a
       MUL by its scale ("<name>/scaled") then an ADD of its shift, in every
       mode; a non-finite statistic is refused naming the layer */
    {
        int order, mode;
        for (order = 0; order < 3; order++)
            for (mode = 0; mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
                const char *name = order == 0 ? "bn_first" : "bn_after_relu";
                mpt_model *b = NULL;
                mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C},
                                                        .input_rank = 3}, &b);
                if (order == 0)
                    mpt_model_add_batch_normalization(b, &(mpt_batchnorm_desc){.name = name});
                mpt_model_add_flatten(b, NULL);
                mpt_model_add_dense(b, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_RELU});
                if (order > 0)
                    mpt_model_add_batch_normalization(b, &(mpt_batchnorm_desc){.name = name});
                mpt_model_build(b, 8);
                randomize(b, 800);
                if (order == 2) { /* a variance of NaN */
                    mpt_param_info p;
                    int i;
                    for (i = 0; i < mpt_model_param_count(b); i++) {
                        mpt_model_param(b, i, &p);
                        if (strstr(p.name, "moving_variance")) ((float *)p.value.data)[3] = NAN;
                    }
                    mpt_model_refresh_weights(b);
                    expect_status(ctx, mpt_model_quantize(b, &(mpt_quantize_desc){
                                      .mode = (mpt_quantize_mode)mode, .representative_data = d},
                                      &q), MPT_ERR_NUMERIC, "'bn_after_relu' channel 3",
                                  "BatchNormalization not finite");
                    CHECK(q == NULL, "no model on failure");
                } else {
                    mpt_quantized_layer a, s;
                    q = NULL;
                    CHECK(mpt_model_quantize(b, &(mpt_quantize_desc){
                              .mode = (mpt_quantize_mode)mode, .representative_data = d},
                              &q) == MPT_OK, "%s mode %d: %s", name, mode,
                          mpt_context_error(ctx));
                    mpt_model_quantized_layer(q, order == 0 ? 0 : 2, &s);
                    mpt_model_quantized_layer(q, order == 0 ? 1 : 3, &a);
                    CHECK(s.op == MPT_QOP_MUL && a.op == MPT_QOP_ADD && s.n_constants ==
                              (order == 0 ? C : 5) && a.n_constants == s.n_constants &&
                              a.inputs[0] == (order == 0 ? 0 : 2) && !strcmp(a.name, name) &&
                              !strncmp(s.name, name, strlen(name)) &&
                              !strcmp(s.name + strlen(name), "/scaled") &&
                              (mode == MPT_QUANTIZE_FULL_INTEGER) == (a.constants_int8 != NULL),
                          "%s mode %d: not a MUL then an ADD by constants per channel", name,
                          mode);
                    mpt_model_destroy(q);
                }
                mpt_model_destroy(b);
            }
    }
    mpt_model_destroy(raw);
    mpt_dataset_destroy(wrong);
    mpt_dataset_destroy(d);
    mpt_context_destroy(ctx);
}

/* ---- every allocation failing in turn ------------------------------------------------------- */

static void test_allocation_failures(void) {
    static const int kinds[2] = {MODEL_CNN, MODEL_BN_GRAPH}; /* BN_GRAPH: MULs and ADDs by constants */
    long k;
    int ki;
    make_samples(19);
    for (ki = 0; ki < 2; ki++) {
        int succeeded = 0, refused = 0;
        for (k = 0; k < 400 && !succeeded; k++) {
            counting_alloc a = {0, 0, -1};
            mpt_context *ctx = counting_ctx(&a);
            mpt_model *m = make_model(ctx, kinds[ki], 900), *q = NULL;
            mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
            mpt_tensor out;
            mpt_status s;
            long before = a.allocs;
            a.fail_after = before + k;
            s = mpt_model_quantize(m, &(mpt_quantize_desc){.mode = MPT_QUANTIZE_FULL_INTEGER,
                                                           .representative_data = d}, &q);
            if (s == MPT_OK) s = mpt_model_predict(q, d, 16, &out);
            a.fail_after = -1;
            CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "model %d allocation %ld: status %d "
                  "(%s)", kinds[ki], k, (int)s, mpt_context_error(ctx));
            if (s == MPT_OK) {
                succeeded = 1;
                mpt_tensor_free(ctx, &out);
            } else {
                refused++;
                CHECK(s != MPT_OK || q == NULL, "a model left after failure");
            }
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
            CHECK(a.allocs == a.frees, "model %d allocation %ld refused: %ld blocks leaked",
                  kinds[ki], k, a.allocs - a.frees);
        }
        CHECK(succeeded && refused > 5, "model %d: %d refusals before success", kinds[ki],
              refused);
    }
}

/* The int8 weights are packed once, when quantizing: a predict in 12
   batches allocates no more blocks than one in a single batch, for every
   model and int8 mode, and the outputs are the same. The batch's work
   block is kept from one predict to the next: the first predict allocates
   more than the ones after it. */
static void test_weights_packed_once(void) {
    int kind, mode;
    make_samples(23);
    for (kind = MODEL_CNN; kind <= MODEL_WIDE; kind++)
        for (mode = MPT_QUANTIZE_DYNAMIC_RANGE; mode <= MPT_QUANTIZE_FULL_INTEGER; mode++) {
            counting_alloc a = {0, 0, -1};
            mpt_context *ctx = counting_ctx(&a);
            mpt_model *m = make_model(ctx, kind, 950);
            mpt_dataset *d = samples_dataset(ctx, N_SAMPLES, sample_x);
            mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
            mpt_tensor one, many;
            long before, allocs_first, allocs_one, allocs_many;
            memset(&one, 0, sizeof one);
            memset(&many, 0, sizeof many);
            before = a.allocs;
            CHECK(q && mpt_model_predict(q, d, N_SAMPLES, &one) == MPT_OK, "predict: %s",
                  mpt_context_error(ctx));
            allocs_first = a.allocs - before;
            mpt_tensor_free(ctx, &one);
            before = a.allocs;
            CHECK(q && mpt_model_predict(q, d, N_SAMPLES, &one) == MPT_OK, "predict: %s",
                  mpt_context_error(ctx));
            allocs_one = a.allocs - before;
            CHECK(allocs_one < allocs_first, "model %d mode %d: a second predict allocated %ld "
                  "blocks, the first %ld: the work block was not kept", kind, mode, allocs_one,
                  allocs_first);
            before = a.allocs;
            CHECK(q && mpt_model_predict(q, d, N_SAMPLES / 12, &many) == MPT_OK, "predict: %s",
                  mpt_context_error(ctx));
            allocs_many = a.allocs - before;
            CHECK(allocs_many == allocs_one, "model %d mode %d: %ld blocks allocated in 12 "
                  "batches, %ld in one", kind, mode, allocs_many, allocs_one);
            CHECK(one.data && many.data && !memcmp(one.data, many.data, mpt_tensor_bytes(&one)),
                  "model %d mode %d: 12 batches differ from one", kind, mode);
            mpt_tensor_free(ctx, &one);
            mpt_tensor_free(ctx, &many);
            mpt_model_destroy(q);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
}

/* ---- int8 pooling against a scalar reference ------------------------------------------- */

/* Output pixel (oy, ox), channel c of int8 pooling, one window element at a
   time: the maximum, or the average rounded half away from zero. */
static int8_t pool_int8_reference(const mpt__win *g, int max, const int8_t *x, int64_t oy,
                                  int64_t ox, int64_t c) {
    int64_t r, q;
    int32_t best = -128, sum = 0, count = 0;
    for (r = oy * g->sh - g->top; r < oy * g->sh - g->top + g->kh; r++)
        for (q = ox * g->sw - g->left; q < ox * g->sw - g->left + g->kw; q++) {
            int32_t v;
            if (r < 0 || r >= g->h || q < 0 || q >= g->w) continue;
            v = x[(r * g->w + q) * g->c + c];
            if (v > best) best = v;
            sum += v;
            count++;
        }
    if (max) return (int8_t)best;
    return (int8_t)(sum >= 0 ? (sum + count / 2) / count : (sum - count / 2) / count);
}

/* Max and average pooling in int8 on channel counts around the lanes, odd
   windows and strides, 'valid' and 'same' padding, 1 and 2 threads: the
   same codes as the scalar reference. */
static void test_pool_int8_scalar_reference(void) {
    static const int64_t channels[] = {1, 15, 16, 17, 31, 32, 33, 65};
    static const int64_t windows[][4] = {{2, 2, 2, 2}, {3, 3, 1, 1}, {3, 1, 2, 1}, {1, 5, 1, 3}};
    int threads, ci, wi, pad, max;
    test_seed(21);
    for (threads = 1; threads <= 2; threads++) {
        mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
        for (ci = 0; ci < (int)(sizeof channels / sizeof channels[0]); ci++)
            for (wi = 0; wi < 4; wi++)
                for (pad = 0; pad < 2; pad++)
                    for (max = 0; max < 2; max++) {
                        const int64_t n = 3, size[2] = {windows[wi][0], windows[wi][1]};
                        const int64_t strides[2] = {windows[wi][2], windows[wi][3]};
                        mpt__qop op;
                        int8_t *x, *y;
                        int64_t b, oy, ox, c, off = 0;
                        memset(&op, 0, sizeof op);
                        op.info.op = max ? MPT_QOP_MAX_POOL_2D : MPT_QOP_AVERAGE_POOL_2D;
                        op.g.h = 7, op.g.w = 6, op.g.c = channels[ci];
                        op.g.kh = size[0], op.g.kw = size[1];
                        op.g.sh = strides[0], op.g.sw = strides[1];
                        op.g.oh = mpt__win_axis(op.g.h, op.g.kh, op.g.sh,
                                                pad ? MPT_PADDING_SAME : MPT_PADDING_VALID, &op.g.top);
                        op.g.ow = mpt__win_axis(op.g.w, op.g.kw, op.g.sw,
                                                pad ? MPT_PADDING_SAME : MPT_PADDING_VALID, &op.g.left);
                        op.in_count = op.g.h * op.g.w * op.g.c;
                        op.out_count = op.g.oh * op.g.ow * op.g.c;
                        x = (int8_t *)malloc((size_t)(n * op.in_count));
                        y = (int8_t *)malloc((size_t)(n * op.out_count));
                        for (b = 0; b < n * op.in_count; b++) x[b] = (int8_t)test_randint(-128, 127);
                        memset(y, 0x55, (size_t)(n * op.out_count));
                        mpt__q_each_sample(ctx, mpt__q_pool_task, &op, 1, NULL, x, y, n);
                        for (b = 0; b < n; b++)
                            for (oy = 0; oy < op.g.oh; oy++)
                                for (ox = 0; ox < op.g.ow; ox++)
                                    for (c = 0; c < op.g.c; c++)
                                        off += y[b * op.out_count + (oy * op.g.ow + ox) * op.g.c + c] !=
                                               pool_int8_reference(&op.g, max, x + b * op.in_count, oy, ox, c);
                        CHECK(off == 0, "%s pool, C=%lld, window %lldx%lld stride %lldx%lld, %s, %d "
                              "threads: %lld codes differ from the scalar reference",
                              max ? "max" : "average", (long long)op.g.c, (long long)size[0],
                              (long long)size[1], (long long)strides[0], (long long)strides[1],
                              pad ? "same" : "valid", threads, (long long)off);
                        free(x);
                        free(y);
                    }
        mpt_context_destroy(ctx);
    }
}

/* A one-channel Conv2D in a full-integer or dynamic-range model runs from
   the image with AVX-512 VNNI, and with a MaxPooling2D after it takes the
   maximum of its sums before requantizing or dequantizing
   (mpt__q_direct_conv): the int8 codes (full integer) and the float
   outputs (dynamic range) of shapes that reach its corners (filters in one, two and three blocks of
   16, kernels wider than 4 taps, strides, 'same' padding on both layers,
   overlapping pools, no pool) against the same model with VNNI disabled,
   which takes im2col and the product (held to the scalar reference in
   test_small_conv_scalar_reference and test_pool_int8_scalar_reference),
   on 1 and 2 threads. */
static void test_one_channel_conv_from_the_image(void) {
    static const struct {
        int64_t h, w, filters, kh, kw, sh, sw;
        mpt_padding pad;
        int relu;
        int64_t pool, pool_stride; /* pool 0: none */
        mpt_padding pool_pad;
    } cases[] = {
        {13, 11, 32, 3, 3, 1, 1, MPT_PADDING_VALID, 1, 2, 2, MPT_PADDING_VALID},
        {12, 9, 37, 5, 5, 1, 1, MPT_PADDING_SAME, 0, 3, 2, MPT_PADDING_SAME},
        {15, 10, 16, 3, 3, 2, 2, MPT_PADDING_VALID, 0, 0, 0, MPT_PADDING_VALID},
        {9, 17, 20, 1, 1, 1, 1, MPT_PADDING_VALID, 1, 2, 1, MPT_PADDING_VALID},
        {10, 21, 8, 2, 7, 1, 3, MPT_PADDING_SAME, 1, 2, 2, MPT_PADDING_SAME},
        {28, 28, 48, 3, 3, 1, 1, MPT_PADDING_VALID, 1, 2, 2, MPT_PADDING_VALID},
    };
    enum { N = 9 };
    int ci, threads, dynamic;
    for (ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++)
        for (threads = 1; threads <= 2; threads++)
            for (dynamic = 0; dynamic <= 1; dynamic++) {
                unsigned char *codes[2] = {NULL, NULL};
                int64_t count = 0, k, diff = 0;
                int variant, direct[2] = {0, 0};
                for (variant = 0; variant < 2; variant++) { /* 0: all the CPU has; 1: no VNNI */
                    mpt_context *ctx = NULL;
                    mpt_context_desc cd;
                    mpt_model *m = NULL, *q = NULL;
                    mpt_dataset *d = NULL;
                    mpt_tensor tx, ty, x8, y8;
                    float *xs;
                    int32_t ys[N] = {0};
                    int64_t shape[4] = {N, cases[ci].h, cases[ci].w, 1}, yshape[1] = {N};
                    memset(&cd, 0, sizeof cd);
                    memset(&y8, 0, sizeof y8);
                    cd.num_threads = threads;
                    cd.disable_cpu_features = variant ? MPT_CPU_AVX512_VNNI : 0;
                    CHECK(mpt_context_create(&cd, &ctx) == MPT_OK, "context");
                    xs = (float *)malloc(sizeof(float) * (size_t)(N * cases[ci].h * cases[ci].w));
                    test_seed(90 + ci);
                    for (k = 0; k < N * cases[ci].h * cases[ci].w; k++)
                        xs[k] = (float)test_uniform(-0.3, 1.0);
                    mpt_model_create(ctx, &(mpt_model_desc){
                        .input_shape = {cases[ci].h, cases[ci].w, 1}, .input_rank = 3, .seed = 5},
                        &m);
                    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
                        .filters = cases[ci].filters, .kernel_size = {cases[ci].kh, cases[ci].kw},
                        .strides = {cases[ci].sh, cases[ci].sw}, .padding = cases[ci].pad,
                        .activation = cases[ci].relu ? MPT_ACT_RELU : MPT_ACT_NONE});
                    if (cases[ci].pool)
                        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){
                            .pool_size = {cases[ci].pool, cases[ci].pool},
                            .strides = {cases[ci].pool_stride, cases[ci].pool_stride},
                            .padding = cases[ci].pool_pad});
                    mpt_model_add_flatten(m, NULL);
                    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
                    randomize(m, 300 + ci);
                    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
                    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
                    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) ==
                              MPT_OK, "dataset: %s", mpt_context_error(ctx));
                    q = quantize(m, dynamic ? MPT_QUANTIZE_DYNAMIC_RANGE
                                            : MPT_QUANTIZE_FULL_INTEGER,
                                 d, dynamic ? MPT_DTYPE_DEFAULT : MPT_INT8);
                    if (q && dynamic) {
                        direct[variant] = q->quantized->ops[0].direct_w != NULL;
                        CHECK(mpt_model_predict(q, d, 4, &y8) == MPT_OK, "predict: %s",
                              mpt_context_error(ctx));
                        count = (int64_t)mpt_tensor_bytes(&y8);
                        codes[variant] = (unsigned char *)malloc((size_t)count);
                        if (y8.data) memcpy(codes[variant], y8.data, (size_t)count);
                        mpt_tensor_free(ctx, &y8);
                    } else if (q) {
                        mpt_quantized_info info;
                        mpt_model_quantized_info(q, &info);
                        direct[variant] = q->quantized->ops[0].direct_w != NULL;
                        mpt_tensor_alloc(ctx, &x8, MPT_INT8, 4, shape);
                        for (k = 0; k < N * cases[ci].h * cases[ci].w; k++)
                            ((int8_t *)x8.data)[k] = mpt__q_quantize(xs[k], &info.input);
                        CHECK(mpt_model_quantized_invoke(q, &x8, &y8) == MPT_OK, "invoke: %s",
                              mpt_context_error(ctx));
                        count = mpt_tensor_count(&y8);
                        codes[variant] = (unsigned char *)malloc((size_t)count);
                        if (y8.data) memcpy(codes[variant], y8.data, (size_t)count);
                        mpt_tensor_free(ctx, &x8);
                        mpt_tensor_free(ctx, &y8);
                    }
                    mpt_model_destroy(q);
                    mpt_dataset_destroy(d);
                    mpt_model_destroy(m);
                    mpt_context_destroy(ctx);
                    free(xs);
                }
                if ((mpt__cpu_features(1) & MPT_CPU_AVX512_VNNI) &&
                    (mpt__cpu_features(1) & MPT_CPU_AVX512))
                    CHECK(direct[0], "case %d: the conv does not run from the image", ci);
                CHECK(!direct[1], "case %d: the conv runs from the image without VNNI", ci);
                for (k = 0; codes[0] && codes[1] && k < count; k++)
                    diff += codes[0][k] != codes[1][k];
                CHECK(codes[0] && codes[1] && diff == 0,
                      "case %d (%lldx%lld, %lld filters, %lldx%lld kernel, %d threads, %s): "
                      "%lld of %lld bytes differ from im2col's", ci, (long long)cases[ci].h,
                      (long long)cases[ci].w, (long long)cases[ci].filters, (long long)cases[ci].kh,
                      (long long)cases[ci].kw, threads, dynamic ? "dynamic range" : "full integer",
                      (long long)diff, (long long)count);
                free(codes[0]);
                free(codes[1]);
            }
}

/* A Conv2D of several channels in a full-integer or dynamic-range model
   runs from its windows with AVX-512 VNNI (mpt__qconv_run): its int8 codes
   (full integer) and float outputs (dynamic range) against the same model
   with VNNI disabled, which takes im2col and the product (held to the
   scalar reference in test_small_conv_scalar_reference), for shapes that
   reach the path's corners: 16 filters (blocks of 24 pixels), 32 and a
   multiple (12 × 32), 40 and 10 (a last block of 16, masked lanes), rows
   of kw·C bytes not a multiple of 4 (3 channels), strides, 1×1, 'same'
   padding on every side, an image too small for a block, a 2×2
   MaxPooling2D after it ('valid': run with it, the maximum of each
   window's sums requantized or dequantized, a row and a column of the
   Conv2D's left out; 'same' on odd sizes: on its own), a ReLU and none;
   the whole batch and one sample alone (a sample's rows split over
   tasks), on 1 and 2 threads. */
static void test_conv_from_windows(void) {
    static const struct {
        int64_t h, w, c, filters, kh, kw, sh, sw;
        mpt_padding pad;
        int relu, pool; /* pool 1: MaxPooling2D 'valid', 2: 'same' */
    } cases[] = {
        {12, 12, 16, 16, 3, 3, 1, 1, MPT_PADDING_SAME, 1, 0},
        {13, 11, 32, 32, 3, 3, 1, 1, MPT_PADDING_VALID, 1, 1},
        {12, 14, 16, 16, 3, 3, 1, 1, MPT_PADDING_SAME, 0, 1},
        {10, 10, 16, 40, 3, 3, 1, 1, MPT_PADDING_VALID, 1, 1},
        {14, 14, 16, 32, 3, 3, 2, 2, MPT_PADDING_SAME, 0, 0},
        {14, 13, 16, 32, 1, 1, 2, 2, MPT_PADDING_VALID, 0, 0},
        {9, 10, 3, 40, 5, 3, 1, 2, MPT_PADDING_SAME, 1, 0},
        {7, 7, 64, 64, 3, 3, 1, 1, MPT_PADDING_SAME, 1, 0},
        {6, 5, 8, 10, 2, 4, 1, 1, MPT_PADDING_SAME, 0, 2},
        {3, 2, 24, 48, 3, 3, 1, 1, MPT_PADDING_SAME, 1, 0},
    };
    enum { N = 9 };
    int ci, threads, dynamic;
    for (ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++)
        for (threads = 1; threads <= 2; threads++)
            for (dynamic = 0; dynamic <= 1; dynamic++) {
                unsigned char *codes[2][2] = {{NULL, NULL}, {NULL, NULL}};
                int64_t count[2] = {0, 0}, k, diff = 0, one;
                const int64_t in_count = cases[ci].h * cases[ci].w * cases[ci].c;
                int variant, alone, direct[2] = {0, 0};
                for (variant = 0; variant < 2; variant++) { /* 0: all the CPU has; 1: no VNNI */
                    mpt_context *ctx = NULL;
                    mpt_context_desc cd;
                    mpt_model *m = NULL, *q = NULL;
                    mpt_dataset *d = NULL;
                    mpt_tensor tx, ty;
                    float *xs;
                    int32_t ys[N] = {0};
                    int64_t shape[4] = {N, cases[ci].h, cases[ci].w, cases[ci].c}, yshape[1] = {N};
                    memset(&cd, 0, sizeof cd);
                    cd.num_threads = threads;
                    cd.disable_cpu_features = variant ? MPT_CPU_AVX512_VNNI : 0;
                    CHECK(mpt_context_create(&cd, &ctx) == MPT_OK, "context");
                    xs = (float *)malloc(sizeof(float) * (size_t)(N * in_count));
                    test_seed(190 + ci);
                    for (k = 0; k < N * in_count; k++) xs[k] = (float)test_uniform(-0.6, 1.0);
                    mpt_model_create(ctx, &(mpt_model_desc){
                        .input_shape = {cases[ci].h, cases[ci].w, cases[ci].c}, .input_rank = 3,
                        .seed = 5}, &m);
                    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){
                        .filters = cases[ci].filters, .kernel_size = {cases[ci].kh, cases[ci].kw},
                        .strides = {cases[ci].sh, cases[ci].sw}, .padding = cases[ci].pad,
                        .activation = cases[ci].relu ? MPT_ACT_RELU : MPT_ACT_NONE});
                    if (cases[ci].pool)
                        mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){
                            .pool_size = {2, 2},
                            .padding = cases[ci].pool == 1 ? MPT_PADDING_VALID : MPT_PADDING_SAME});
                    mpt_model_add_flatten(m, NULL);
                    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
                    randomize(m, 400 + ci);
                    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, xs);
                    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, yshape, ys);
                    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) ==
                              MPT_OK, "dataset: %s", mpt_context_error(ctx));
                    q = quantize(m, dynamic ? MPT_QUANTIZE_DYNAMIC_RANGE
                                            : MPT_QUANTIZE_FULL_INTEGER,
                                 d, dynamic ? MPT_DTYPE_DEFAULT : MPT_INT8);
                    for (alone = 0; q && alone < 2; alone++) { /* the batch, then sample 0 */
                        mpt_tensor x8, y8;
                        mpt_quantized_info info;
                        int64_t xshape[4] = {alone ? 1 : N, cases[ci].h, cases[ci].w, cases[ci].c};
                        direct[variant] = q->quantized->ops[0].direct_w != NULL;
                        if (!variant)
                            CHECK(!direct[0] || (cases[ci].pool == 1) ==
                                                    (mpt__qconv_pool(q->quantized, 0) != NULL),
                                  "case %d: the MaxPooling2D %s with the conv", ci,
                                  cases[ci].pool == 1 ? "does not run" : "runs");
                        memset(&y8, 0, sizeof y8);
                        if (dynamic) {
                            mpt_tensor_wrap(ctx, &x8, MPT_FLOAT32, 4, xshape, xs);
                        } else {
                            mpt_model_quantized_info(q, &info);
                            mpt_tensor_alloc(ctx, &x8, MPT_INT8, 4, xshape);
                            for (k = 0; k < mpt_tensor_count(&x8); k++)
                                ((int8_t *)x8.data)[k] = mpt__q_quantize(xs[k], &info.input);
                        }
                        CHECK(mpt_model_quantized_invoke(q, &x8, &y8) == MPT_OK, "invoke: %s",
                              mpt_context_error(ctx));
                        count[alone] = (int64_t)mpt_tensor_bytes(&y8);
                        codes[variant][alone] = (unsigned char *)malloc((size_t)count[alone] + 1);
                        if (y8.data) memcpy(codes[variant][alone], y8.data, (size_t)count[alone]);
                        if (!dynamic) mpt_tensor_free(ctx, &x8);
                        mpt_tensor_free(ctx, &y8);
                    }
                    mpt_model_destroy(q);
                    mpt_dataset_destroy(d);
                    mpt_model_destroy(m);
                    mpt_context_destroy(ctx);
                    free(xs);
                }
                if ((mpt__cpu_features(1) & MPT_CPU_AVX512_VNNI) &&
                    (mpt__cpu_features(1) & MPT_CPU_AVX512))
                    CHECK(direct[0], "case %d: the conv does not run from its windows", ci);
                CHECK(!direct[1], "case %d: the conv runs from its windows without VNNI", ci);
                one = count[0] / N; /* sample 0 alone: the batch's first sample */
                for (k = 0; codes[0][0] && codes[1][0] && k < count[0]; k++)
                    diff += codes[0][0][k] != codes[1][0][k];
                for (k = 0; codes[0][1] && codes[1][0] && k < one && count[1] == one; k++)
                    diff += codes[0][1][k] != codes[1][0][k];
                CHECK(codes[0][0] && codes[1][0] && codes[0][1] && count[1] == one && diff == 0,
                      "case %d (%lldx%lldx%lld, %lld filters, %lldx%lld kernel, %d threads, %s): "
                      "%lld of %lld bytes differ from im2col's", ci, (long long)cases[ci].h,
                      (long long)cases[ci].w, (long long)cases[ci].c,
                      (long long)cases[ci].filters, (long long)cases[ci].kh,
                      (long long)cases[ci].kw, threads, dynamic ? "dynamic range" : "full integer",
                      (long long)diff, (long long)(count[0] + one));
                free(codes[0][0]);
                free(codes[0][1]);
                free(codes[1][0]);
                free(codes[1][1]);
            }
}

/* Every model's full-integer codes and dynamic-range floats from
   mpt__q_forward (convolutions from their windows, chains of per-channel
   MULs and ADDs as one table, merges over the threads) are those of its
   operations run one by one on buffers of their own (mpt__q_run_op's
   im2col and products, mpt__q_binary), bit for bit: the batch and one
   sample, on 1 and 2 threads; BN_CHAIN16 in dynamic range also with an
   inf in its first sample; POOL_BRANCH's Conv2D, read after its
   MaxPooling2D too, not run with it. */
/* RESIDUAL's two ADDs (the Conv2D's output their first input, then their
   second), BN_GRAPH's one and MERGES' Average's first (of the shared
   Conv2D's two calls). */
#define ADDS_AFTER_CONV 4
static void test_forward_as_ops_one_by_one(void) {
    static const int kinds[] = {MODEL_CNN,      MODEL_GAP,      MODEL_RESIDUAL,
                                MODEL_MERGES,   MODEL_BN_CHAIN, MODEL_BN_GRAPH,
                                MODEL_BN_CHAIN16, MODEL_POOL_BRANCH};
    int ki, threads, dynamic, poison, chains = 0, absorbed = 0, adds = 0, fused = 0;
    make_samples(31);
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (threads = 1; threads <= 2; threads++) {
            mpt_context *ctx = test_ctx_logging(threads, quiet_logger);
            mpt_model *m, *q[2];
            mpt_dataset *d;
            m = make_model(ctx, kinds[ki], 320 + (unsigned)ki);
            d = samples_dataset(ctx, N_SAMPLES, sample_x);
            q[0] = quantize(m, MPT_QUANTIZE_FULL_INTEGER, d, MPT_DTYPE_DEFAULT);
            q[1] = quantize(m, MPT_QUANTIZE_DYNAMIC_RANGE, NULL, MPT_DTYPE_DEFAULT);
            for (dynamic = 0; q[0] && q[1] && dynamic <= 1; dynamic++) {
                mpt__quantized *Q = q[dynamic]->quantized;
                const mpt__qexec ex = dynamic ? MPT__QX_DYNAMIC : MPT__QX_INTEGER;
                const size_t es = dynamic ? 4 : 1;
                const int64_t per = mpt__q_out_count(Q, 0) * (int64_t)es;
                mpt__qwork *w = NULL;
                void *buf[64] = {NULL};
                int64_t n, k, diff = 0;
                int i;
                for (i = 0; !dynamic && i < Q->n_ops; i++) {
                    chains += Q->ops[i].chained > 0;
                    absorbed += Q->ops[i].absorbs && mpt__qconv_takes(ctx, &Q->ops[i], ex);
                    adds += Q->ops[i].fuse_add && mpt__qconv_takes(ctx, &Q->ops[i], ex);
                }
                for (i = 0; dynamic && i < Q->n_ops; i++)
                    fused += mpt__q_dynamic_chain(ctx, Q, i, ex) != NULL;
                CHECK(Q->n_ops < 64 && mpt__qwork_reuse(ctx, Q, N_SAMPLES, &w) == MPT_OK, "work");
                buf[0] = malloc((size_t)(N_SAMPLES * Q->in_count) * es);
                for (k = 0; k < N_SAMPLES * Q->in_count; k++)
                    if (dynamic) ((float *)buf[0])[k] = sample_x[k];
                    else ((int8_t *)buf[0])[k] = mpt__q_quantize(sample_x[k], &Q->tensor[0]);
                /* poison: BN_CHAIN16's sample 0 all FLT_MAX (dynamic range:
                   the first Conv2D's outputs overflow, the second Conv2D's
                   input holds an inf, its scale is not finite, and the chain
                   it would run is written first) */
                for (poison = 0; poison <= (dynamic && kinds[ki] == MODEL_BN_CHAIN16); poison++)
                for (n = N_SAMPLES; w && n >= 1; n = n == 1 ? 0 : 1) {
                    const void *out = NULL;
                    for (k = 0; poison && k < Q->in_count; k++) ((float *)buf[0])[k] = FLT_MAX;
                    unsigned char *got = (unsigned char *)malloc((size_t)(n * per));
                    for (i = 0; i < Q->n_ops; i++) /* one by one */
                        buf[i + 1] = malloc((size_t)(n * Q->ops[i].out_count) * es);
                    for (i = 0; i < Q->n_ops; i++) {
                        const mpt__qop *op = &Q->ops[i];
                        const void *xs[MPT_MAX_MERGE_INPUTS];
                        int j;
                        for (j = 0; j < op->info.n_inputs; j++) xs[j] = buf[op->in_t[j]];
                        if (op->info.op == MPT_QOP_RESHAPE)
                            memcpy(buf[i + 1], xs[0], (size_t)(n * op->out_count) * es);
                        else if (op->info.op == MPT_QOP_PAD) mpt__q_pad(op, !dynamic, xs[0], buf[i + 1], n);
                        else if (op->info.op == MPT_QOP_CONCATENATION)
                            mpt__q_concat(op, !dynamic, xs, buf[i + 1], n);
                        else if (mpt__qop_is_merge(op))
                            mpt__q_binary(op, !dynamic, xs[0], op->info.n_inputs > 1 ? xs[1] : NULL,
                                          buf[i + 1], n * op->out_count);
                        else
                            CHECK(mpt__q_run_op(ctx, Q, i, ex, xs[0], buf[i + 1], n, w) == MPT_OK,
                                  "op %d", i);
                    }
                    for (i = 0; poison && i < Q->n_ops; i++) {
                        const float *in = (const float *)buf[Q->ops[i].in_t[0]];
                        int infinite = 0;
                        if (!mpt__q_dynamic_chain(ctx, Q, i, ex)) continue;
                        for (k = 0; k < Q->ops[i].in_count; k++) infinite |= isinf(in[k]);
                        CHECK(infinite, "the poisoned sample's Conv2D %d reads no inf", i);
                    }
                    CHECK(mpt__q_forward(ctx, Q, ex, buf[0], n, w, NULL, &out) == MPT_OK,
                          "forward: %s", mpt_context_error(ctx));
                    if (out) memcpy(got, out, (size_t)(n * per));
                    for (k = 0; out && k < n * per; k++)
                        diff += got[k] != ((const unsigned char *)buf[Q->outs[0]])[k];
                    CHECK(out && diff == 0, "model %d, %s%s, %d threads, %lld samples: %lld of "
                          "%lld bytes differ from the operations one by one", kinds[ki],
                          dynamic ? "dynamic range" : "full integer", poison ? " (an inf)" : "",
                          threads, (long long)n, (long long)diff, (long long)(n * per));
                    for (i = 0; i < Q->n_ops; i++) free(buf[i + 1]);
                    free(got);
                }
                free(buf[0]);
            }
            mpt_model_destroy(q[0]);
            mpt_model_destroy(q[1]);
            mpt_dataset_destroy(d);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
    CHECK(chains == 2 * (2 + 3 + 1), "%d chains of per-channel MULs and ADDs, want 2 + 3 + 1 "
          "(a run on 1 and 2 threads each)", chains);
    /* BN_CHAIN's first, BN_GRAPH's on the input and BN_CHAIN16's, looked up as
       their Conv2D copies rows; BN_CHAIN16's run in its dynamic quantization */
    if ((mpt__cpu_features(1) & MPT_CPU_AVX512_VNNI) && (mpt__cpu_features(1) & MPT_CPU_AVX512))
        CHECK(absorbed == 2 * 3 && adds == 2 * ADDS_AFTER_CONV && fused == 2,
              "%d chains absorbed by the Conv2D after them (want 2 + 3), %d ADDs run with the "
              "Conv2D before them (want %d), %d chains run in a dynamic quantization (want 2)",
              absorbed, adds, 2 * ADDS_AFTER_CONV, fused);
}

/* ---- several inputs and outputs ------------------------------------------------------ */

enum { MULTI_VEC = 5 };
static float multi_v[N_SAMPLES * MULTI_VEC];

/* Keras' two-branch model: the image through Conv2D, a BatchNormalization
   folded into it, ReLU, pooling and Flatten; a vector ("vector") through a
   Dense; both concatenated into a Dense "trunk", then "cls" (a softmax over
   CLASSES) and, with two outputs, "reg" (one linear unit) as well. */
static mpt_model *multi_model(mpt_context *ctx, int outputs, unsigned long long seed) {
    mpt_model *m = NULL;
    mpt_node both[2], trunk;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                                  .seed = 7}, &m) == MPT_OK, "create");
    if (!m) return NULL;
    both[1] = mpt_model_add_input(m, &(mpt_input_desc){.shape = {MULTI_VEC}, .rank = 1,
                                                       .name = "vector"});
    both[0] = mpt_conv2d(m, mpt_model_input(m), &(mpt_conv2d_desc){.filters = 4,
                                                                   .kernel_size = {3, 3}});
    both[0] = mpt_batch_normalization(m, both[0], NULL);
    both[0] = mpt_activation_layer(m, both[0], &(mpt_activation_desc){.activation = MPT_ACT_RELU});
    both[0] = mpt_max_pooling2d(m, both[0], &(mpt_pool2d_desc){.pool_size = {2, 2}});
    both[0] = mpt_flatten(m, both[0], NULL);
    both[1] = mpt_dense(m, both[1], &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    trunk = mpt_dense(m, mpt_concatenate(m, 2, both, NULL),
                      &(mpt_dense_desc){.name = "trunk", .units = 16, .activation = MPT_ACT_RELU});
    mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){
                                              .name = "cls", .units = CLASSES,
                                              .activation = MPT_ACT_SOFTMAX}));
    if (outputs == 2)
        mpt_model_add_output(m, mpt_dense(m, trunk, &(mpt_dense_desc){.name = "reg", .units = 1}));
    CHECK((outputs == 1 ? mpt_model_compile(m, &(mpt_compile_desc){
                              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                              .metrics = MPT_METRIC_ACCURACY})
                        : mpt_model_compile(m, &(mpt_compile_desc){
                              .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                         {.type = MPT_LOSS_MEAN_SQUARED_ERROR}}})) == MPT_OK &&
              mpt_model_build(m, 32) == MPT_OK,
          "compile and build: %s", mpt_context_error(ctx));
    randomize(m, seed);
    round_weights_to_half(ctx, m); /* float16's bound: its arithmetic alone */
    return m;
}

/* The samples (sample_x, and multi_v in ±1) as a dataset of both inputs,
   with sample_y (and, for two outputs, the vector's first value as reg's
   target). */
static mpt_dataset *multi_dataset(mpt_context *ctx, int outputs) {
    static float reg[N_SAMPLES];
    mpt_tensor tx, tv, ty, tr;
    const mpt_tensor *inputs[2] = {&tx, &tv}, *labels[2] = {&ty, &tr};
    mpt_dataset *d = NULL;
    int i;
    for (i = 0; i < N_SAMPLES; i++) reg[i] = multi_v[i * MULTI_VEC];
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, (int64_t[]){N_SAMPLES, H, W, C}, sample_x);
    mpt_tensor_wrap(ctx, &tv, MPT_FLOAT32, 2, (int64_t[]){N_SAMPLES, MULTI_VEC}, multi_v);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, (int64_t[]){N_SAMPLES}, sample_y);
    mpt_tensor_wrap(ctx, &tr, MPT_FLOAT32, 2, (int64_t[]){N_SAMPLES, 1}, reg);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = inputs, .input_count = 2,
                                                      .labels = labels,
                                                      .label_count = outputs}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* Each output of q against the float model's (a[k]): the largest
   difference, relative to the float output's largest magnitude (at
   least 1), into *worst; the top-1 class of cls differing on *top_off
   samples. */
static void multi_compare(const mpt_tensor *a, const mpt_tensor *b, int outputs, double *worst,
                          int64_t *top_off) {
    int k;
    *worst = 0, *top_off = 0;
    for (k = 0; k < outputs; k++) {
        const int64_t count = mpt_tensor_count(&a[k]), per = count / N_SAMPLES;
        double largest = 1, diff = 0;
        int64_t i, c;
        CHECK(b[k].data && mpt_tensor_count(&b[k]) == count && b[k].shape[b[k].rank - 1] ==
                  a[k].shape[a[k].rank - 1],
              "output %d: not the float model's shape", k);
        if (!b[k].data || mpt_tensor_count(&b[k]) != count) continue;
        for (i = 0; i < count; i++) {
            largest = fmax(largest, fabs(((const float *)a[k].data)[i]));
            diff = fmax(diff, fabs(((const float *)a[k].data)[i] - ((const float *)b[k].data)[i]));
        }
        *worst = fmax(*worst, diff / largest);
        for (i = 0; k == 0 && i < N_SAMPLES; i++) {
            const float *pf = (const float *)a[k].data + i * per;
            const float *pq = (const float *)b[k].data + i * per;
            int tf = 0, tq = 0;
            for (c = 0; c < per; c++) {
                tf = pf[c] > pf[tf] ? (int)c : tf;
                tq = pq[c] > pq[tq] ? (int)c : tq;
            }
            *top_off += tf != tq;
        }
    }
}

/* Full integer: each input quantized over its own range, as calibration
   with min/max sees it (the image's samples in [0, 1), the vector's in
   ±1), and each output its own. */
static void multi_ranges(const mpt_model *q) {
    mpt_quantized_info info;
    mpt_quant_params want[2];
    float lo[2] = {INFINITY, INFINITY}, hi[2] = {-INFINITY, -INFINITY};
    int64_t i;
    for (i = 0; i < N_SAMPLES * H * W * C; i++)
        lo[0] = fminf(lo[0], sample_x[i]), hi[0] = fmaxf(hi[0], sample_x[i]);
    for (i = 0; i < N_SAMPLES * MULTI_VEC; i++)
        lo[1] = fminf(lo[1], multi_v[i]), hi[1] = fmaxf(hi[1], multi_v[i]);
    want[0] = mpt__q_params(lo[0], hi[0]);
    want[1] = mpt__q_params(lo[1], hi[1]);
    CHECK(mpt_model_quantized_info(q, &info) == MPT_OK && info.n_inputs == 2 &&
              info.n_outputs == 2,
          "info: %d inputs, %d outputs", info.n_inputs, info.n_outputs);
    for (i = 0; i < 2; i++)
        CHECK(info.inputs[i].scale == want[i].scale &&
                  info.inputs[i].zero_point == want[i].zero_point,
              "input %d: scale %g, zero point %d; its samples' range gives %g, %d", (int)i,
              (double)info.inputs[i].scale, (int)info.inputs[i].zero_point,
              (double)want[i].scale, (int)want[i].zero_point);
    CHECK(info.input.scale == info.inputs[0].scale && info.output.scale == info.outputs[0].scale,
          "input and output are not input 0's and output 0's");
    /* cls ends in a softmax, TFLite's fixed 1/256; reg's range is its own */
    CHECK(info.outputs[0].scale == 1.0f / 256 && info.outputs[0].zero_point == -128 &&
              info.outputs[1].scale != info.outputs[0].scale,
          "outputs: (%g, %d) and (%g, %d)", (double)info.outputs[0].scale,
          (int)info.outputs[0].zero_point, (double)info.outputs[1].scale,
          (int)info.outputs[1].zero_point);
}

/* A model of two inputs and two outputs (Keras' keras.Model([img, vec],
   [cls, reg])) quantized in each mode: predict_outputs gives each output
   in the model's order, within the bounds test_graph_predict_modes holds
   graphs to of the float model's (relative to each output's largest
   magnitude; float16 within 1e-3: the kernel a BatchNormalization folds
   into is rounded to float16 after the fold, 2^-11 relative each, measured
   2.2e-4), the same bits one sample at a time as in batches of 40;
   in full integer each input and output has its own quantization. What
   takes one input and output says so. */
static void test_several_inputs_and_outputs(void) {
    static const double bound[3] = {0.05, 0.1, 1e-3}; /* dynamic, full integer, float16 */
    mpt_context *ctx = quiet_ctx();
    mpt_model *m;
    mpt_dataset *d;
    mpt_tensor a[2], b[2], one[2], t;
    int mode, k;
    make_samples(41);
    for (k = 0; k < N_SAMPLES * MULTI_VEC; k++) multi_v[k] = (float)test_uniform(-1, 1);
    m = multi_model(ctx, 2, 410);
    d = multi_dataset(ctx, 2);
    memset(a, 0, sizeof a);
    CHECK(m && d && mpt_model_predict_outputs(m, d, 32, 2, a) == MPT_OK, "predict float: %s",
          mpt_context_error(ctx));
    for (mode = 0; m && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
        double worst = 0;
        int64_t top_off = 0, diff = 0, i;
        memset(b, 0, sizeof b);
        memset(one, 0, sizeof one);
        if (!q) continue;
        CHECK(mpt_model_input_count(q) == 2 && mpt_model_output_count(q) == 2,
              "mode %d: %d inputs, %d outputs", mode, mpt_model_input_count(q),
              mpt_model_output_count(q));
        CHECK(mpt_model_predict_outputs(q, d, 40, 2, b) == MPT_OK &&
                  mpt_model_predict_outputs(q, d, 1, 2, one) == MPT_OK,
              "mode %d: predict: %s", mode, mpt_context_error(ctx));
        multi_compare(a, b, 2, &worst, &top_off);
        CHECK(worst <= bound[mode], "mode %d: outputs differ by %g of their largest (bound %g)",
              mode, worst, bound[mode]);
        for (k = 0; k < 2 && b[k].data && one[k].data; k++)
            for (i = 0; i < mpt_tensor_count(&b[k]); i++)
                diff += ((const float *)b[k].data)[i] != ((const float *)one[k].data)[i];
        CHECK(diff == 0, "mode %d: %lld outputs differ one sample at a time", mode,
              (long long)diff);
        if (mode == MPT_QUANTIZE_FULL_INTEGER) multi_ranges(q);
        if (getenv("MPT_TEST_VERBOSE"))
            printf("  mode %d: worst %g, top-1 differs on %lld of %d\n", mode, worst,
                   (long long)top_off, N_SAMPLES);
        test_expect_error(ctx, mpt_model_predict(q, d, 8, &t), MPT_ERR_INVALID_ARGUMENT,
                          "mpt_model_predict_outputs gives them all", "predict of one tensor");
        test_expect_error(ctx, mpt_model_quantized_invoke(q, &b[0], &t), MPT_ERR_INVALID_ARGUMENT,
                          "the model has 2 inputs and 2 outputs, but 1 and 1 were given "
                          "(mpt_model_quantized_invoke_io takes them all)", "invoke");
        {
            mpt_dataset *d1 = samples_dataset(ctx, N_SAMPLES, sample_x);
            mpt_tensor refused[2]; /* a refused predict empties its outs: not one's */
            test_expect_error(ctx, mpt_model_predict_outputs(q, d1, 8, 2, refused),
                              MPT_ERR_INVALID_ARGUMENT, "holds 1 input tensor but the model has "
                              "2 inputs", "a dataset of one input");
            mpt_dataset_destroy(d1);
        }
        for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &b[k]), mpt_tensor_free(ctx, &one[k]);
        mpt_model_destroy(q);
    }
    /* quantization-aware training takes the model (tests/test_qat.c), but not a
       softmax ending a Dense other than the last layer */
    test_expect_error(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                      "Dense 'cls' ends in softmax", "quantize_aware");
    for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &a[k]);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* The two-input model with one output: evaluate of the quantized model in
   each mode reads both inputs; its accuracy is the float model's but for
   the samples whose top-1 changed, its loss within the outputs' bound. */
static void test_several_inputs_evaluate(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m;
    mpt_dataset *d;
    mpt_tensor a, b;
    mpt_logs lf, lq;
    int mode, k;
    memset(&lf, 0, sizeof lf);
    memset(&lq, 0, sizeof lq);
    make_samples(42);
    for (k = 0; k < N_SAMPLES * MULTI_VEC; k++) multi_v[k] = (float)test_uniform(-1, 1);
    m = multi_model(ctx, 1, 420);
    d = multi_dataset(ctx, 1);
    memset(&a, 0, sizeof a);
    CHECK(m && d && mpt_model_predict(m, d, 32, &a) == MPT_OK &&
              mpt_model_evaluate(m, d, NULL, &lf) == MPT_OK,
          "float: %s", mpt_context_error(ctx));
    for (mode = 0; a.data && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
        double worst = 0;
        int64_t top_off = 0;
        memset(&b, 0, sizeof b);
        CHECK(q && mpt_model_predict(q, d, 40, &b) == MPT_OK &&
                  mpt_model_evaluate(q, d, NULL, &lq) == MPT_OK,
              "mode %d: %s", mode, mpt_context_error(ctx));
        multi_compare(&a, &b, 1, &worst, &top_off);
        CHECK(b.data && fabs(mpt_logs_get(&lq, "accuracy") - mpt_logs_get(&lf, "accuracy")) <=
                            (double)top_off / N_SAMPLES + 1e-9,
              "mode %d: accuracy %g, float %g, %lld top-1 differ", mode,
              mpt_logs_get(&lq, "accuracy"), mpt_logs_get(&lf, "accuracy"), (long long)top_off);
        CHECK(b.data && fabs(mpt_logs_get(&lq, "loss") - mpt_logs_get(&lf, "loss")) <= 0.05,
              "mode %d: loss %g, float %g", mode, mpt_logs_get(&lq, "loss"),
              mpt_logs_get(&lf, "loss"));
        mpt_tensor_free(ctx, &b);
        mpt_model_destroy(q);
    }
    mpt_tensor_free(ctx, &a);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* What evaluate of the two-output model gives, computed here from its
   outputs (cls's probabilities, reg's values) over the samples: Keras'
   clipped crossentropy and accuracy of cls, mean squared and absolute
   error of reg against the vector's first value, the loss 1·cls + 0.5·reg. */
static void multi_evaluate_by_hand(const mpt_tensor *out, double *cls_loss, double *cls_acc,
                                   double *reg_loss, double *reg_mae) {
    int64_t i, c;
    *cls_loss = *cls_acc = *reg_loss = *reg_mae = 0;
    for (i = 0; out[0].data && out[1].data && i < N_SAMPLES; i++) {
        const float *row = (const float *)out[0].data + i * CLASSES;
        const float r = ((const float *)out[1].data)[i], t = multi_v[i * MULTI_VEC];
        double sum = 0;
        int best = 0;
        for (c = 0; c < CLASSES; c++) sum += row[c];
        for (c = 1; c < CLASSES; c++) best = row[c] > row[best] ? (int)c : best;
        *cls_loss += -log(clipped(row[sample_y[i]] / sum)) / N_SAMPLES;
        *cls_acc += (double)(best == sample_y[i]) / N_SAMPLES;
        *reg_loss += ((double)t - r) * ((double)t - r) / N_SAMPLES;
        *reg_mae += fabs((double)t - r) / N_SAMPLES;
    }
}

/* Keras' evaluate of a quantized model of two outputs compiled with loss
   weights (1, 0.5) and each output's metrics: the float model's names in
   its order ("loss", then "cls_loss", "cls_accuracy", "reg_loss",
   "reg_mean_absolute_error"); the values in the int8 modes those computed
   here from the quantized model's predict_outputs (within float32's
   rounding of the loss terms), in float16 the float model's evaluate
   within 5e-4 relative (measured 3.5e-5 on the loss; its outputs are
   within 1e-3 of the largest: test_several_inputs_and_outputs). A
   dataset of one label is refused. */
static void test_several_outputs_evaluate(void) {
    static const float weights[2] = {1.0f, 0.5f};
    mpt_context *ctx = quiet_ctx();
    mpt_model *m;
    mpt_dataset *d, *d1;
    mpt_logs lf, lq;
    int mode, k;
    make_samples(43);
    for (k = 0; k < N_SAMPLES * MULTI_VEC; k++) multi_v[k] = (float)test_uniform(-1, 1);
    m = multi_model(ctx, 2, 430);
    d = multi_dataset(ctx, 2);
    d1 = multi_dataset(ctx, 1);
    memset(&lf, 0, sizeof lf);
    CHECK(m && d && d1 &&
              mpt_model_compile(m, &(mpt_compile_desc){
                                       .losses = {{.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                                  {.type = MPT_LOSS_MEAN_SQUARED_ERROR}},
                                       .loss_weights = weights,
                                       .output_metrics = {MPT_METRIC_ACCURACY,
                                                          MPT_METRIC_MEAN_ABSOLUTE_ERROR}}) ==
                  MPT_OK &&
              mpt_model_evaluate(m, d, NULL, &lf) == MPT_OK && lf.count == 5,
          "float: %s (%d logs)", mpt_context_error(ctx), lf.count);
    for (mode = 0; lf.count == 5 && mode < MPT_QUANTIZE_MODE_COUNT_; mode++) {
        mpt_model *q = quantize(m, (mpt_quantize_mode)mode, d, MPT_DTYPE_DEFAULT);
        mpt_tensor out[2];
        double want[5];
        memset(out, 0, sizeof out);
        memset(&lq, 0, sizeof lq);
        CHECK(q && mpt_model_evaluate(q, d, &(mpt_evaluate_desc){.batch_size = 40}, &lq) ==
                       MPT_OK &&
                  mpt_model_predict_outputs(q, d, 40, 2, out) == MPT_OK,
              "mode %d: %s", mode, mpt_context_error(ctx));
        CHECK(lq.count == lf.count, "mode %d: %d logs, the float model %d", mode, lq.count,
              lf.count);
        for (k = 0; k < lq.count && k < lf.count; k++)
            CHECK(!strcmp(lq.names[k], lf.names[k]), "mode %d: log %d is '%s', the float "
                  "model's '%s'", mode, k, lq.names[k], lf.names[k]);
        if (mode == MPT_QUANTIZE_FLOAT16) {
            for (k = 0; k < 5; k++) want[k] = lf.values[k];
        } else {
            multi_evaluate_by_hand(out, &want[1], &want[2], &want[3], &want[4]);
            want[0] = weights[0] * want[1] + weights[1] * want[3];
        }
        for (k = 0; k < 5 && k < lq.count; k++)
            CHECK(fabs(lq.values[k] - want[k]) <=
                      (mode == MPT_QUANTIZE_FLOAT16 ? 5e-4 : 1e-5) * fabs(want[k]) + 1e-12,
                  "mode %d: %s %.9g, expected %.9g", mode, lq.names[k], lq.values[k], want[k]);
        if (getenv("MPT_TEST_VERBOSE"))
            printf("  mode %d: loss %.6f (float %.6f), cls_accuracy %.4f\n", mode, lq.values[0],
                   lf.values[0], lq.values[2]);
        test_expect_error(ctx, mpt_model_evaluate(q, d1, NULL, &lq), MPT_ERR_INVALID_ARGUMENT,
                          "the dataset holds 1 label tensor but the model has 2 outputs",
                          "evaluate of one label");
        for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &out[k]);
        mpt_model_destroy(q);
    }
    mpt_dataset_destroy(d1);
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* The samples in a full-integer model's input codes: each input quantized
   as its info says (uint8: the int8 code + 128). */
static void multi_codes(const mpt_quantized_info *info, int8_t *img, int8_t *vec) {
    int k;
    int64_t i;
    for (k = 0; k < 2; k++) {
        mpt_quant_params p = info->inputs[k];
        const float *x = k ? multi_v : sample_x;
        int8_t *q = k ? vec : img;
        const int64_t count = N_SAMPLES * (k ? MULTI_VEC : H * W * C);
        if (info->io_dtype == MPT_UINT8) p.zero_point -= 128;
        for (i = 0; i < count; i++)
            q[i] = (int8_t)(mpt__q_quantize(x[i], &p) + (info->io_dtype == MPT_UINT8 ? 128 : 0));
    }
}

/* mpt_model_quantized_invoke_io of the two-input, two-output model: in
   every mode and io dtype its outputs are predict_outputs' of the same
   samples bit for bit (int8 and uint8: its codes dequantized as predict
   dequantizes them); wrong counts, dtypes and shapes are refused naming
   the input, the outputs left empty. */
static void test_several_inputs_invoke(void) {
    static int8_t img[N_SAMPLES * H * W * C], vec[N_SAMPLES * MULTI_VEC];
    static const struct { mpt_quantize_mode mode; mpt_dtype io; } runs[] = {
        {MPT_QUANTIZE_DYNAMIC_RANGE, MPT_DTYPE_DEFAULT}, {MPT_QUANTIZE_FLOAT16, MPT_DTYPE_DEFAULT},
        {MPT_QUANTIZE_FULL_INTEGER, MPT_FLOAT32}, {MPT_QUANTIZE_FULL_INTEGER, MPT_INT8},
        {MPT_QUANTIZE_FULL_INTEGER, MPT_UINT8}};
    mpt_context *ctx = quiet_ctx();
    mpt_model *m;
    mpt_dataset *d;
    int r, k;
    make_samples(44);
    for (k = 0; k < N_SAMPLES * MULTI_VEC; k++) multi_v[k] = (float)test_uniform(-1, 1);
    m = multi_model(ctx, 2, 440);
    d = multi_dataset(ctx, 2);
    for (r = 0; m && d && r < (int)(sizeof runs / sizeof runs[0]); r++) {
        mpt_model *q = quantize(m, runs[r].mode, d, runs[r].io);
        mpt_quantized_info info;
        mpt_tensor xs[2], bad[2], p[2], ys[2], t;
        int64_t diff = 0, i;
        memset(p, 0, sizeof p);
        memset(ys, 0, sizeof ys);
        if (!q || mpt_model_quantized_info(q, &info) != MPT_OK) continue;
        if (info.io_dtype == MPT_FLOAT32) {
            mpt_tensor_wrap(ctx, &xs[0], MPT_FLOAT32, 4, (int64_t[]){N_SAMPLES, H, W, C},
                            sample_x);
            mpt_tensor_wrap(ctx, &xs[1], MPT_FLOAT32, 2, (int64_t[]){N_SAMPLES, MULTI_VEC},
                            multi_v);
        } else {
            multi_codes(&info, img, vec);
            mpt_tensor_wrap(ctx, &xs[0], info.io_dtype, 4, (int64_t[]){N_SAMPLES, H, W, C}, img);
            mpt_tensor_wrap(ctx, &xs[1], info.io_dtype, 2, (int64_t[]){N_SAMPLES, MULTI_VEC},
                            vec);
        }
        CHECK(mpt_model_predict_outputs(q, d, 40, 2, p) == MPT_OK &&
                  mpt_model_quantized_invoke_io(q, xs, 2, ys, 2) == MPT_OK,
              "run %d: %s", r, mpt_context_error(ctx));
        for (k = 0; k < 2 && p[k].data && ys[k].data; k++) {
            const mpt_quant_params o = info.outputs[k];
            CHECK(ys[k].dtype == info.io_dtype && mpt_tensor_count(&ys[k]) ==
                      mpt_tensor_count(&p[k]) && ys[k].rank == p[k].rank,
                  "run %d: output %d is not (batch, output shape) in io_dtype", r, k);
            for (i = 0; i < mpt_tensor_count(&p[k]); i++) {
                float v = info.io_dtype == MPT_FLOAT32 ? ((const float *)ys[k].data)[i]
                          : info.io_dtype == MPT_INT8
                              ? (float)(((const int8_t *)ys[k].data)[i] - o.zero_point) * o.scale
                              : (float)(((const uint8_t *)ys[k].data)[i] - o.zero_point) * o.scale;
                diff += memcmp(&v, (const float *)p[k].data + i, sizeof v) != 0;
            }
        }
        CHECK(diff == 0, "run %d: %lld outputs differ from predict_outputs'", r, (long long)diff);
        for (k = 0; k < 2; k++) mpt_tensor_free(ctx, &ys[k]), mpt_tensor_free(ctx, &p[k]);
        test_expect_error(ctx, mpt_model_quantized_invoke_io(q, xs, 1, ys, 2),
                          MPT_ERR_INVALID_ARGUMENT, "the model has 2 inputs and 2 outputs, but "
                          "1 and 2 were given", "one input");
        test_expect_error(ctx, mpt_model_quantized_invoke(q, &xs[0], &t),
                          MPT_ERR_INVALID_ARGUMENT, "invoke_io takes them all", "invoke");
        memcpy(bad, xs, sizeof bad);
        bad[1].dtype = info.io_dtype == MPT_FLOAT32 ? MPT_INT32 : MPT_FLOAT32;
        test_expect_error(ctx, mpt_model_quantized_invoke_io(q, bad, 2, ys, 2), MPT_ERR_DTYPE,
                          "input 1 ('vector'): input dtype", "dtype");
        memcpy(bad, xs, sizeof bad);
        bad[1].shape[1] = MULTI_VEC - 1;
        test_expect_error(ctx, mpt_model_quantized_invoke_io(q, bad, 2, ys, 2), MPT_ERR_SHAPE,
                          "input 1 ('vector'): samples of shape (4,) do not fit the model's "
                          "input (5,)", "shape");
        memcpy(bad, xs, sizeof bad);
        bad[1].shape[0] = N_SAMPLES - 1;
        test_expect_error(ctx, mpt_model_quantized_invoke_io(q, bad, 2, ys, 2), MPT_ERR_SHAPE,
                          "input 1 ('vector'): a batch of 95 samples, but input 0's is 96",
                          "batch");
        memcpy(bad, xs, sizeof bad);
        bad[0].shape[3] = C + 1;
        test_expect_error(ctx, mpt_model_quantized_invoke_io(q, bad, 2, ys, 2), MPT_ERR_SHAPE,
                          "input 0 ('input'): samples of shape", "shape of input 0");
        CHECK(!ys[0].data && !ys[1].data, "run %d: a refused invoke left outputs", r);
        mpt_model_destroy(q);
    }
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

int main(void) {
    TEST_RUN(test_rounding_ties_away_from_zero);
    TEST_RUN(test_batchnorm_folding_float);
    TEST_RUN(test_layers_within_steps);
    TEST_RUN(test_float16_model);
    TEST_RUN(test_int8_kept_bytes);
    TEST_RUN(test_float16_conv_direct);
    TEST_RUN(test_float16_dense_in_place);
    TEST_RUN(test_float_max_pool_as_float_model);
    TEST_RUN(test_quantized_summary);
    TEST_RUN(test_layer_accessors_per_mode);
    TEST_RUN(test_scale_shift_scalar_reference);
    TEST_RUN(test_bit_exact_across_threads);
    TEST_RUN(test_calibration_ranges);
    TEST_RUN(test_requantization_scalar_reference);
    TEST_RUN(test_pool_int8_scalar_reference);
    TEST_RUN(test_trained_model_accuracy);
    TEST_RUN(test_bad_input);
    TEST_RUN(test_allocation_failures);
    TEST_RUN(test_weights_packed_once);
    TEST_RUN(test_quantize_input_lanes);
    TEST_RUN(test_symmetric_rows_lanes);
    TEST_RUN(test_byte_table_lanes);
    TEST_RUN(test_table_copy_lanes);
    TEST_RUN(test_products_as_public_qgemm);
    TEST_RUN(test_byte_table_values);
    TEST_RUN(test_uint8_samples_as_float32);
    TEST_RUN(test_binary_accuracy);
    TEST_RUN(test_weighted_evaluate);
    TEST_RUN(test_small_conv_scalar_reference);
    TEST_RUN(test_calibration_mse);
    TEST_RUN(test_one_channel_conv_from_the_image);
    TEST_RUN(test_conv_from_windows);
    TEST_RUN(test_forward_as_ops_one_by_one);
    TEST_RUN(test_graph_ops_within_steps);
    TEST_RUN(test_graph_merge_scalar_reference);
    TEST_RUN(test_graph_predict_modes);
    TEST_RUN(test_several_inputs_and_outputs);
    TEST_RUN(test_several_inputs_evaluate);
    TEST_RUN(test_several_outputs_evaluate);
    TEST_RUN(test_several_inputs_invoke);
    TEST_RUN(test_nothing_to_quantize);
    TEST_RUN(test_dense_over_sequence);
    TEST_RUN(test_small_gpt);
    TEST_RUN(test_small_gpt_refusals);
    TEST_RUN(test_small_gpt_across_threads);
    return test_summary("test_quantize");
}

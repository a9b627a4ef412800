/* A build's bits do not depend on how it was compiled.

   ./build.sh check compiles this one program three ways: as every test
   (gcc -std=c99 -O2), in gcc's GNU mode with -march=native and with clang
   -march=native, runs each and compares what they print. gcc's GNU modes
   fuse a product and the sum after it into one rounding wherever the
   target has FMA, and clang does so within an expression; mpt.h asks
   for no fusing in its own code (MPT__CONTRACT_END), so the three must
   print the same lines. Each line is a model trained a few steps in one
   policy and with one optimizer, and the FNV-1a hash of every weight's
   bits and of its predictions (float, and dynamic-range int8 for the
   image model): the layers, optimizers and kernels where fusing was
   found (Winograd's 3×3 products, BatchNormalization, GELU,
   LayerNormalization, attention, Adam with a global norm clip, SGD with
   Nesterov momentum, the int8 dequantization). Not a PASS/FAIL test:
   build.sh judges it. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 64 /* samples */
#define TRY(call)                         \
    do {                                  \
        mpt_status s_ = (call);           \
        if (s_ != MPT_OK) return s_;      \
    } while (0)

static uint64_t fnv1a(uint64_t h, const void *data, size_t bytes) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < bytes; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t weights_hash(mpt_model *m) {
    uint64_t h = 14695981039346656037ull;
    int p;
    for (p = 0; p < mpt_model_param_count(m); p++) {
        mpt_param_info info;
        if (mpt_model_param(m, p, &info) != MPT_OK) return 0;
        h = fnv1a(h, info.value.data, 4 * (size_t)mpt_tensor_count(&info.value));
    }
    return h;
}

static uint64_t predictions_hash(mpt_context *ctx, mpt_model *m, const mpt_dataset *data) {
    mpt_tensor out;
    uint64_t h = 0;
    memset(&out, 0, sizeof out);
    if (mpt_model_predict(m, data, 16, &out) == MPT_OK)
        h = fnv1a(14695981039346656037ull, out.data,
                  (size_t)mpt_tensor_count(&out) * mpt_dtype_size(out.dtype));
    mpt_tensor_free(ctx, &out);
    return h;
}

/* Conv2D, BatchNormalization, pooling, a second Conv2D of 16 channels (a
   3×3 of stride 1: Winograd's), Dense with GELU, LayerNormalization. */
static mpt_status image_model(mpt_context *ctx, mpt_policy policy, mpt_model **model) {
    mpt_model *m;
    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 12, 12, 3 },
                                                        .input_rank = 3, .policy = policy,
                                                        .seed = 7 }, model));
    m = *model;
    TRY(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = 16,
                                                           .kernel_size = { 3, 3 },
                                                           .padding = MPT_PADDING_SAME,
                                                           .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_batch_normalization(m, NULL));
    TRY(mpt_model_add_max_pooling2d(m, NULL));
    TRY(mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = 16,
                                                           .kernel_size = { 3, 3 },
                                                           .padding = MPT_PADDING_SAME,
                                                           .activation = MPT_ACT_RELU }));
    TRY(mpt_model_add_flatten(m, NULL));
    TRY(mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 32,
                                                         .activation = MPT_ACT_GELU }));
    TRY(mpt_model_add_layer_normalization(m, NULL));
    return mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 10,
                                                     .activation = MPT_ACT_SOFTMAX });
}

/* Token and position embeddings, causal self-attention, a residual Add,
   LayerNormalization, a Dense per position. */
static mpt_status text_model(mpt_context *ctx, mpt_policy policy, mpt_model **model) {
    mpt_model *m;
    mpt_node tok, x, both[2];
    TRY(mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 8 }, .input_rank = 1,
                                                        .input_dtype = MPT_INT32,
                                                        .policy = policy, .seed = 7 }, model));
    m = *model;
    tok = mpt_embedding(m, mpt_model_input(m), &(mpt_embedding_desc){ .input_dim = 32,
                                                                       .output_dim = 16 });
    both[0] = tok;
    both[1] = mpt_position_embedding(m, tok, &(mpt_position_embedding_desc){
        .sequence_length = 8 });
    x = mpt_add(m, 2, both, NULL);
    both[0] = x;
    both[1] = mpt_multi_head_attention(m, x, x, &(mpt_multi_head_attention_desc){
        .num_heads = 2, .key_dim = 8, .use_causal_mask = 1 });
    x = mpt_layer_normalization(m, mpt_add(m, 2, both, NULL), NULL);
    mpt_dense(m, x, &(mpt_dense_desc){ .units = 32, .activation = MPT_ACT_SOFTMAX });
    return MPT_OK;
}

static const mpt_optimizer_desc optimizers[] = {
    { .type = MPT_OPTIMIZER_ADAM, .learning_rate = 1e-2f, .clip_global_norm = 1.0f },
    { .type = MPT_OPTIMIZER_SGD, .learning_rate = 5e-2f, .momentum = 0.9f, .nesterov = 1,
      .l2 = 1e-4f },
    { .type = MPT_OPTIMIZER_ADAMW, .learning_rate = 1e-2f, .weight_decay = 0.1f },
};
static const char *const optimizer_names[] = { "adam_clipped", "sgd_nesterov", "adamw" };

/* Trains a model of `make` two epochs on data, then prints its line. */
static mpt_status one_case(mpt_context *ctx, const char *what,
                           mpt_status (*make)(mpt_context *, mpt_policy, mpt_model **),
                           mpt_policy policy, int opt, const mpt_dataset *data, int quantize) {
    mpt_model *m = NULL, *q = NULL;
    uint64_t w = 0, pred = 0, pred_int8 = 0;
    mpt_fit_desc fit;
    mpt_status s = make(ctx, policy, &m);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = 16;
    fit.verbose = 0;
    if (s == MPT_OK)
        s = mpt_model_compile(m, &(mpt_compile_desc){
            .optimizer = optimizers[opt],
            .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY } });
    if (s == MPT_OK) s = mpt_model_build(m, 16);
    if (s == MPT_OK) s = mpt_model_fit(m, data, &fit);
    if (s == MPT_OK) {
        w = weights_hash(m);
        pred = predictions_hash(ctx, m, data);
    }
    if (s == MPT_OK && quantize) {
        s = mpt_model_quantize(m, &(mpt_quantize_desc){ .mode = MPT_QUANTIZE_DYNAMIC_RANGE }, &q);
        if (s == MPT_OK) pred_int8 = predictions_hash(ctx, q, data);
    }
    if (s == MPT_OK)
        printf("%s %s %s weights %016llx predictions %016llx int8 %016llx\n", what,
               mpt_policy_name(policy), optimizer_names[opt], (unsigned long long)w,
               (unsigned long long)pred, (unsigned long long)pred_int8);
    else
        fprintf(stderr, "%s %s %s: %s\n", what, mpt_policy_name(policy), optimizer_names[opt],
                mpt_context_error(ctx));
    mpt_model_destroy(q);
    mpt_model_destroy(m);
    return s;
}

int main(void) {
    static float images[N * 12 * 12 * 3];
    static int32_t ids[N * 8], classes[N], next_ids[N * 8];
    const mpt_policy policies[] = { MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                    MPT_POLICY_MIXED_BFLOAT16 };
    mpt_context *ctx = NULL;
    mpt_tensor x_img, y_img, x_ids, y_ids;
    mpt_dataset *img = NULL, *text = NULL;
    int64_t img_shape[4] = { N, 12, 12, 3 }, class_shape[1] = { N }, ids_shape[2] = { N, 8 };
    uint64_t r = 88172645463325252ull;
    int i, p, o, failed = 0;
    for (i = 0; i < N * 12 * 12 * 3; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        images[i] = (float)(r >> 40) / (float)(1 << 24) - 0.5f;
    }
    for (i = 0; i < N; i++) classes[i] = (int32_t)((i * 7 + (images[i * 432] > 0)) % 10);
    for (i = 0; i < N * 8; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        ids[i] = (int32_t)(r >> 59);
    }
    for (i = 0; i < N * 8; i++) next_ids[i] = (ids[i] + 3) % 32;
    /* two threads: the tasks' split is part of what must repeat */
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = 2 }, &ctx) != MPT_OK) return 1;
    mpt_tensor_wrap(ctx, &x_img, MPT_FLOAT32, 4, img_shape, images);
    mpt_tensor_wrap(ctx, &y_img, MPT_INT32, 1, class_shape, classes);
    mpt_tensor_wrap(ctx, &x_ids, MPT_INT32, 2, ids_shape, ids);
    mpt_tensor_wrap(ctx, &y_ids, MPT_INT32, 2, ids_shape, next_ids);
    if (mpt_dataset_create(ctx, &(mpt_dataset_desc){ .x = &x_img, .y = &y_img }, &img) !=
            MPT_OK ||
        mpt_dataset_create(ctx, &(mpt_dataset_desc){ .x = &x_ids, .y = &y_ids }, &text) !=
            MPT_OK) {
        fprintf(stderr, "datasets: %s\n", mpt_context_error(ctx));
        return 1;
    }
    for (p = 0; p < 3; p++) {
        for (o = 0; o < 2; o++)
            failed |= one_case(ctx, "image", image_model, policies[p], o, img, 1) != MPT_OK;
        failed |= one_case(ctx, "text", text_model, policies[p], 2, text, 0) != MPT_OK;
    }
    mpt_dataset_destroy(text);
    mpt_dataset_destroy(img);
    mpt_context_destroy(ctx);
    return failed;
}

/* Trains a small MLP on two rings of points with plain SGD written by
   hand: forward, loss, backward, then w -= lr · grad on every float32
   master weight. (The optimizers, loss scaling and fit() come later; this
   shows what they are made of.)

   Build: cc -O2 hand_sgd.c -lpthread -lm -o hand_sgd          (in examples/)
   Run:   ./hand_sgd [float32|mixed_float16|mixed_bfloat16] */
#define MPT_NO_ZLIB /* it reads no files: no zlib, no -lz */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

enum { N = 512, BATCH = 64, EPOCHS = 200 };

int main(int argc, char **argv) {
    static float x[N * 2];
    static int32_t y[N];
    mpt_policy policy = MPT_POLICY_FLOAT32;
    mpt_context *ctx;
    mpt_model *model;
    int epoch, i, correct = 0;
    double loss = 0;
    if (argc > 1 && strcmp(argv[1], "mixed_float16") == 0) policy = MPT_POLICY_MIXED_FLOAT16;
    if (argc > 1 && strcmp(argv[1], "mixed_bfloat16") == 0) policy = MPT_POLICY_MIXED_BFLOAT16;
    make_rings(N, x, y); /* class 0 inside, 1 outside: no line separates them (common.h) */

    if (mpt_context_create(&(mpt_context_desc){ .num_threads = 1 }, &ctx) != MPT_OK) return 1;
    TRY(make_rings_model(ctx, policy, BATCH, &model)); /* 2 → 32 → 32 → 2 logits (common.h) */

    for (epoch = 0; epoch < EPOCHS; epoch++) {
        loss = 0;
        for (i = 0; i < N; i += BATCH) {
            mpt_tensor xb, yb, logits, dlogits;
            double batch_loss;
            int p;
            TRY(mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){ BATCH, 2 }, x + 2 * i));
            TRY(mpt_tensor_wrap(ctx, &yb, MPT_INT32, 1, (int64_t[]){ BATCH }, y + i));
            TRY(mpt_model_forward(model, &xb, 1, &logits));
            TRY(mpt_model_output_grad(model, &dlogits));
            TRY(mpt_loss_compute(ctx, &(mpt_loss_desc){
                    .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1 },
                &logits, &yb, &batch_loss, &dlogits));
            TRY(mpt_model_backward(model, NULL, NULL));
            for (p = 0; p < mpt_model_param_count(model); p++) {
                mpt_param_info w;
                int64_t k;
                TRY(mpt_model_param(model, p, &w));
                for (k = 0; w.trainable && k < mpt_tensor_count(&w.value); k++)
                    ((float *)w.value.data)[k] -= 0.1f * ((float *)w.grad.data)[k];
            }
            mpt_model_refresh_weights(model); /* the compute-dtype copies */
            loss += batch_loss / (N / BATCH);
        }
        if (epoch % 50 == 0) printf("epoch %3d  loss %.4f\n", epoch, loss);
    }
    for (i = 0; i < N; i += BATCH) {
        mpt_tensor xb, logits;
        int b;
        TRY(mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){ BATCH, 2 }, x + 2 * i));
        TRY(mpt_model_forward(model, &xb, 0, &logits));
        for (b = 0; b < BATCH; b++) {
            const float *z = (const float *)logits.data + 2 * b;
            correct += (z[1] > z[0]) == (y[i + b] == 1);
        }
    }
    printf("{\"example\":\"hand_sgd\",\"policy\":\"%s\",\"loss\":%.6g,\"train_accuracy\":%.4f}\n",
           argc > 1 ? argv[1] : "float32", loss,
           (double)correct / N);
    mpt_model_destroy(model);
    mpt_context_destroy(ctx);
    return 0;
}

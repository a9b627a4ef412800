/* hand_sgd.c's loop in mixed_float16, with dynamic loss scaling written by
   hand: what fit does for you in a float16 model, one step at a time.

   float16 gradients underflow (small values become 0) unless the loss,
   and with it every gradient, is multiplied by a large scale; too large a
   scale overflows them to inf instead. So each step:
     1. scale:   the loss gradient times `scale` (mpt_loss_desc.grad_scale)
     2. check:   are all the float32 gradients finite? (mpt_model_grad_stats)
     3. skip:    if not, no update; the scale is halved (backoff)
     4. unscale: else the gradients times 1/scale, then w -= lr · g
     5. grow:    after GROWTH_INTERVAL finite steps in a row, scale × 2
   (Keras' LossScaleOptimizer; it waits 2000 steps to grow, this short run
   waits 100). The scale starts at 2^32, far too high, so the first steps
   overflow and are skipped until it has backed off.

   Every piece runs in the model's own memory, so the same loop trains on
   a GPU. float32 and mixed_bfloat16 need no scale (bfloat16 has float32's
   range): there the scale stays 1 and only the finiteness check remains.

   Build: cc -O2 -I.. hand_loss_scaling.c -lpthread -lm -lz -o hand_loss_scaling
   Run:   ./hand_loss_scaling [mixed_float16|float32|mixed_bfloat16] */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

enum { N = 512, BATCH = 64, EPOCHS = 200, GROWTH_INTERVAL = 100 };
#define LEARNING_RATE 0.1f
#define INITIAL_SCALE 4294967296.0f /* 2^32 */

int main(int argc, char **argv) {
    static float x[N * 2];
    static int32_t y[N];
    const char *policy_name = argc > 1 ? argv[1] : "mixed_float16";
    mpt_policy policy = MPT_POLICY_MIXED_FLOAT16;
    mpt_context *ctx;
    mpt_model *model;
    mpt_dataset *rings;
    mpt_tensor xt, yt, predictions;
    int dynamic, epoch, i, step = 0, correct = 0;
    int good_steps = 0, skipped = 0, shrinks = 0, growths = 0;
    float scale;
    double loss = 0;
    if (strcmp(policy_name, "float32") == 0) policy = MPT_POLICY_FLOAT32;
    else if (strcmp(policy_name, "mixed_bfloat16") == 0) policy = MPT_POLICY_MIXED_BFLOAT16;
    else policy_name = "mixed_float16";
    dynamic = policy == MPT_POLICY_MIXED_FLOAT16;
    scale = dynamic ? INITIAL_SCALE : 1.0f;
    make_rings(N, x, y); /* hand_sgd.c's two rings (common.h) */

    if (mpt_context_create(&(mpt_context_desc){ .num_threads = 1 }, &ctx) != MPT_OK) return 1;
    TRY(make_rings_model(ctx, policy, BATCH, &model)); /* 2 → 32 → 32 → 2 logits (common.h) */

    for (epoch = 0; epoch < EPOCHS; epoch++) {
        loss = 0;
        for (i = 0; i < N; i += BATCH, step++) {
            mpt_tensor xb, yb;
            double batch_loss, norm;
            int finite;
            TRY(mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 2, (int64_t[]){ BATCH, 2 }, x + 2 * i));
            TRY(mpt_tensor_wrap(ctx, &yb, MPT_INT32, 1, (int64_t[]){ BATCH }, y + i));
            TRY(mpt_model_forward(model, &xb, 1, NULL));
            /* 1. scale: backward starts from scale · dloss/dlogits */
            TRY(mpt_model_compute_loss(model, &(mpt_loss_desc){
                    .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1,
                    .grad_scale = scale }, &yb, &batch_loss));
            TRY(mpt_model_backward(model, NULL, NULL));
            /* 2. check the scaled gradients */
            TRY(mpt_model_grad_stats(model, &finite, &norm));
            loss += batch_loss / (N / BATCH);
            if (!finite) {
                /* 3. skip: the weights stay as they are; back off */
                skipped++;
                good_steps = 0;
                if (dynamic) {
                    scale *= 0.5f;
                    shrinks++;
                }
                printf("step %4d: gradients overflow, step skipped, loss scale -> %g\n", step,
                       (double)scale);
                continue;
            }
            /* 4. unscale, then w -= lr · g (and the float16 copies rewritten) */
            TRY(mpt_model_scale_grads(model, 1.0f / scale));
            TRY(mpt_model_sgd_step(model, LEARNING_RATE));
            /* 5. grow after a run of finite steps */
            if (dynamic && ++good_steps == GROWTH_INTERVAL) {
                scale *= 2.0f;
                good_steps = 0;
                growths++;
                printf("step %4d: %d finite steps in a row, loss scale -> %g\n", step,
                       GROWTH_INTERVAL, (double)scale);
            }
        }
        if (epoch % 50 == 0) printf("epoch %3d  loss %.4f\n", epoch, loss);
    }

    /* The accuracy from predict's float32 outputs, copied to the host. */
    TRY(mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 2, (int64_t[]){ N, 2 }, x));
    TRY(mpt_tensor_wrap(ctx, &yt, MPT_INT32, 1, (int64_t[]){ N }, y));
    TRY(mpt_dataset_create(ctx, &(mpt_dataset_desc){ .x = &xt, .y = &yt }, &rings));
    TRY(mpt_model_predict(model, rings, BATCH, &predictions));
    for (i = 0; i < N; i++) {
        const float *z = (const float *)predictions.data + 2 * i;
        correct += (z[1] > z[0]) == (y[i] == 1);
    }
    printf("{\"example\":\"hand_loss_scaling\",\"policy\":\"%s\",\"loss\":%.6g,"
           "\"train_accuracy\":%.4f,\"steps\":%d,\"skipped_steps\":%d,\"scale_shrinks\":%d,"
           "\"scale_growths\":%d,\"initial_loss_scale\":%g,\"final_loss_scale\":%g}\n",
           policy_name, loss, (double)correct / N, step, skipped, shrinks, growths,
           (double)(dynamic ? INITIAL_SCALE : 1.0f), (double)scale);
    mpt_tensor_free(ctx, &predictions);
    mpt_dataset_destroy(rings);
    mpt_model_destroy(model);
    mpt_context_destroy(ctx);
    return 0;
}

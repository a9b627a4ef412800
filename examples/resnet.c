/* ResNet-20 (He et al. 2016, the CIFAR variant) on Fashion-MNIST, written
   with the functional form, as Keras' functional API writes it: the
   layers (drawn there) are in resnet20.h, which bench/bench_train.c times
   too. he_normal kernels, Adam from 1e-3 decayed to 0 over the run's
   steps by a cosine (Keras' CosineDecay: the last epochs at a small rate,
   so the final weights are not one noisy step's; at a constant 1e-3 the
   test accuracy after 15 epochs swung with the last step: 0.866 where the
   best epoch's validation read 0.905), batch 128, validation on the last
   10,000 training images, 20 epochs. Training images go through Keras'
   data augmentation first (add_augmentation below: a left-right flip and
   a shift of at most one pixel, each image its own); --no-augment trains
   without. The JSON line says which ran ("augment"). The recipe is the
   one of four runs with the best validation accuracy (bench/RESULTS.md,
   "ResNet-20 at 15 epochs with RandomFlip and RandomTranslation"): without
   augmentation the network learned the training set by epoch 13
   (accuracy 0.9999) and stopped at 0.924 on validation; a flip alone
   overfit as well (0.926); shifts of up to 3 pixels left it underfit
   after 15 epochs (training 0.942, validation 0.932); one pixel and 20
   epochs read 0.940.

   Build: cc -O2 resnet.c -lpthread -lm -lz -o resnet       (in examples/)
   Run:   ./resnet [--policy ...] [--epochs 20] [--batch-size 128] [--threads N]
                   [--data DIR] [--verbose 1] [--tensorboard DIR]
                   [--plot FILE] [--profile DIR] [--save FILE] [--load FILE]
                   [--export STEM] [--no-augment]
   --save FILE writes the trained model with mpt_model_save; --load FILE
   rebuilds it with mpt_model_load instead of building it in code (with
   --epochs 0 it is only evaluated; a larger --epochs trains it on from
   the epochs it has). --export STEM writes STEM.tflite and STEM.onnx
   (float32 weights), and the model quantized to full integer (calibrated
   on 500 training images) as STEM_full_int8.tflite and .onnx, whose test
   accuracy in mpt.h it reports too; bench/run_exported.py runs each pair
   in LiteRT and ONNX Runtime on the test images. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"
#include "resnet20.h" /* the layers, shared with bench/bench_train.c */

/* Keras' data augmentation at the model's input, active in training only:
       RandomFlip("horizontal"),
       RandomTranslation(0.05, 0.05, fill_mode="constant", interpolation="nearest")
   Fashion-MNIST's background is 0, so the pixels shifted in are 0
   ("constant", fill_value 0) rather than a reflection of the garment's
   edge (Keras' "reflect"). "nearest" shifts by whole pixels (a shift of
   up to 1.4 pixels rounds to -1, 0 or 1), as the random crops after
   padding of He et al.'s CIFAR recipe do:
   training images stay as sharp as the test images, where bilinear
   interpolation at a fractional shift would blur only the training ones. */
static mpt_node add_augmentation(mpt_model *m, mpt_node x) {
    x = mpt_random_flip(m, x, &(mpt_random_flip_desc){ .mode = MPT_FLIP_HORIZONTAL });
    return mpt_random_translation(m, x, &(mpt_random_translation_desc){
        .height_factor = { -0.05f, 0.05f }, .width_factor = { -0.05f, 0.05f },
        .fill_mode = MPT_FILL_CONSTANT, .interpolation = MPT_INTERPOLATION_NEAREST });
}

static mpt_status build_resnet20(mpt_context *ctx, const options *o, mpt_model **out) {
    mpt_status s = mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { 28, 28, 1 },
                                                            .input_rank = 3, .policy = o->policy,
                                                            .seed = o->seed }, out);
    mpt_node x;
    if (s != MPT_OK) return s;
    x = mpt_model_input(*out);
    if (o->augment) x = add_augmentation(*out, x);
    return add_resnet20_layers_on(*out, x);
}

int main(int argc, char **argv) {
    options o = default_options(20);
    mpt_context *ctx;
    mpt_dataset *all, *train, *validation, *test;
    mpt_model *model;
    char summary[16384];
    int rc;
    o.model_files = 1;
    o.augment_flag = 1;
    rc = open_fashion_mnist(argc, argv, &o, &ctx, &all, &test);
    if (rc) return rc;
    TRY(mpt_dataset_split(ctx, all, mpt_dataset_count(all) - 10000, &train, &validation));

    if (o.load) { /* the architecture, weights and training state from the file */
        TRY(mpt_model_load(ctx, o.load, &model));
    } else {
        /* every step of the run: epochs of ceil(train / batch) steps */
        int64_t steps = (int64_t)o.epochs *
                        ((mpt_dataset_count(train) + o.batch_size - 1) / o.batch_size);
        TRY(build_resnet20(ctx, &o, &model));
        TRY(mpt_model_compile(model, &(mpt_compile_desc){
            .optimizer = { .type = MPT_OPTIMIZER_ADAM, .learning_rate = 1e-3f,
                           .schedule = { .type = steps > 0 ? MPT_LR_COSINE_DECAY
                                                           : MPT_LR_CONSTANT,
                                         .decay_steps = steps } },
            .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
            .metrics = MPT_METRIC_ACCURACY }));
        TRY(mpt_model_build(model, o.batch_size));
    }
    if (o.verbose && mpt_model_summary(model, summary, sizeof summary)) printf("%s", summary);
    /* fit would train no epoch for --epochs 0 either, but it would first
       hold --batch-size to the batch a loaded model was built for, and
       evaluate runs any batch size */
    if (o.epochs > 0) /* (a loaded model goes on from the epochs it has) */
        TRY(fit_with_flags(ctx, &o, model, train, validation, NULL, 0));
    if (o.save) TRY(mpt_model_save(model, o.save));
    if (o.export_stem) {
        char path[1024];
        snprintf(path, sizeof path, "%s.tflite", o.export_stem);
        TRY(mpt_model_export_tflite(model, path, NULL));
        snprintf(path, sizeof path, "%s.onnx", o.export_stem);
        TRY(mpt_model_export_onnx(model, path, NULL));
    }
    TRY(evaluate_and_report(ctx, &o, model, "resnet", test));
    if (o.export_stem) { /* as TFLiteConverter with a representative dataset */
        char path[1024];
        mpt_model *q;
        TRY(mpt_model_quantize(model, &(mpt_quantize_desc){
            .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = train,
            .calibration_samples = 500 }, &q));
        snprintf(path, sizeof path, "%s_full_int8.tflite", o.export_stem);
        TRY(mpt_model_export_tflite(q, path, NULL));
        snprintf(path, sizeof path, "%s_full_int8.onnx", o.export_stem);
        TRY(mpt_model_export_onnx(q, path, NULL));
        TRY(evaluate_and_report(ctx, &o, q, "resnet_full_int8", test));
        mpt_model_destroy(q);
    }

    mpt_model_destroy(model);
    mpt_dataset_destroy(validation);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
    mpt_dataset_destroy(all);
    mpt_context_destroy(ctx);
    return 0;
}

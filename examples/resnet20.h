/* ResNet-20's layers (He et al. 2016, the CIFAR variant), written with the
   functional form as Keras' functional API writes it; examples/resnet.c
   trains it and bench/bench_train.c (--model resnet) times it against the
   same network in TensorFlow and PyTorch (bench/tf_train.py,
   bench/torch_train.py), so the three cannot drift apart. Include after
   mpt.h; C99 (compound literals), only the public API.

       Conv2D(16, 3, same, no bias) -> BatchNormalization -> ReLU
       3 stages of 3 basic blocks, 16, 32 and 64 filters:
           Conv2D(3, same) -> BN -> ReLU -> Conv2D(3, same) -> BN,
           Add with the shortcut, ReLU
       (the first block of stages 2 and 3 has stride 2, and a 1x1 Conv2D
       of stride 2 + BN on its shortcut)
       -> GlobalAveragePooling2D -> Dense(10, softmax)

   Every Conv2D is he_normal without a bias (the BatchNormalization after
   it has one); BatchNormalization has Keras' defaults (momentum 0.99,
   epsilon 1e-3). */
#ifndef MPT_EXAMPLES_RESNET20_H
#define MPT_EXAMPLES_RESNET20_H

static inline mpt_node resnet_conv(mpt_model *m, mpt_node x, int64_t filters, int64_t size,
                                   int64_t stride) {
    return mpt_conv2d(m, x, &(mpt_conv2d_desc){ .filters = filters,
                                                 .kernel_size = { size, size },
                                                 .strides = { stride, stride },
                                                 .padding = MPT_PADDING_SAME, .no_bias = 1,
                                                 .kernel_initializer = MPT_INIT_HE_NORMAL });
}

static inline mpt_node resnet_bn(mpt_model *m, mpt_node x) {
    return mpt_batch_normalization(m, x, NULL);
}

static inline mpt_node resnet_relu(mpt_model *m, mpt_node x) {
    return mpt_activation_layer(m, x, &(mpt_activation_desc){ .activation = MPT_ACT_RELU });
}

/* One basic block; stride 2 halves the image and takes a projection shortcut. */
static inline mpt_node resnet_basic_block(mpt_model *m, mpt_node x, int64_t filters,
                                          int64_t stride) {
    mpt_node y = resnet_relu(m, resnet_bn(m, resnet_conv(m, x, filters, 3, stride)));
    mpt_node sum[2];
    sum[0] = resnet_bn(m, resnet_conv(m, y, filters, 3, 1));
    sum[1] = stride == 1 ? x : resnet_bn(m, resnet_conv(m, x, filters, 1, stride));
    return resnet_relu(m, mpt_add(m, 2, sum, NULL));
}

/* ResNet-20 on node `in` (an image), to a Dense(10, softmax) output.
   Returns MPT_OK: a failed call is kept by the model, and
   mpt_model_build returns it with its message. */
static inline mpt_status add_resnet20_layers_on(mpt_model *m, mpt_node in) {
    static const int64_t filters[3] = { 16, 32, 64 };
    mpt_node x = resnet_relu(m, resnet_bn(m, resnet_conv(m, in, 16, 3, 1)));
    int stage, block;
    for (stage = 0; stage < 3; stage++)
        for (block = 0; block < 3; block++)
            x = resnet_basic_block(m, x, filters[stage], stage > 0 && block == 0 ? 2 : 1);
    x = mpt_global_average_pooling2d(m, x, NULL);
    mpt_dense(m, x, &(mpt_dense_desc){ .units = 10, .activation = MPT_ACT_SOFTMAX });
    return MPT_OK;
}

/* ResNet-20 on m's input (a model just created, its input an image). */
static inline mpt_status add_resnet20_layers(mpt_model *m) {
    return add_resnet20_layers_on(m, mpt_model_input(m));
}

#endif

#!/usr/bin/env python3
"""TensorFlow twin of bench/bench_train.c: samples/s of one training epoch of
the seed MLP, the small CNN, the CNN and ResNet-20 on Fashion-MNIST on the
CPU, for comparison with mpt.h.

    build/venv-peers/bin/python bench/tf_train.py                 # mlp, cnn_small, cnn; float32
    build/venv-peers/bin/python bench/tf_train.py --model mlp --repeat 3 --bf16
    build/venv-peers/bin/python bench/tf_train.py --model resnet --bf16

Same models (Keras layers, as the seeds wrote them), data, batch size (128),
optimizer (Adam, lr 1e-3, Keras' eps 1e-7), loss (sparse categorical
crossentropy on logits: the softmax fused into the loss, as mpt.h's fit fuses
it), shuffling every epoch and thread count (intra-op parallelism 2, inter-op
1) as bench_train. The MLP trains on all 60,000 training images, the small CNN
on the first 12,800, the CNN and ResNet-20 on the first 6,400. Each measured epoch
follows a warm-up fit over the first 1,280 images of the same model (it
traces and builds the training function).

The data is a float32 tensor in memory (/255 once) fed by tf.data (shuffled
every epoch, batched, prefetched, repeated); samples/s is images / wall time
of one epoch of Model.fit, each epoch timed by a callback within one fit. (A
new pass over a finite tf.data pipeline stalled about 1.8 s at the start of
every second epoch or so, outside the training steps: 35 % of a 6,400-image
cnn epoch. A repeated dataset with steps_per_epoch keeps one pass going.)
Keras does not split a step into forward, backward and update, so those
fields are null. Images are NHWC (channels last): the layout Keras' Conv2D
takes on the CPU, and the one oneDNN's kernels run without a transpose.

--bf16 also measures the Keras "mixed_bfloat16" policy (float32 variables,
bfloat16 compute; the last Dense layer in float32 as Keras advises). Prints a
Markdown table and one JSON line per result.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_peers  # noqa: E402  (the command line and output torch_train.py shares)
from idx_data import find, read_idx  # noqa: E402

keras = tf.keras
layers = keras.layers


def load_train(data_dir):
    x = read_idx(find(data_dir, "train-images-idx3-ubyte"))
    y = read_idx(find(data_dir, "train-labels-idx1-ubyte"))
    return (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1), y.astype(np.int32)  # NHWC


def logits():
    """The last Dense layer, float32 under every policy, without the softmax."""
    return layers.Dense(10, dtype="float32")


def sequential(*stack):
    """A Sequential model of the layers, for 28×28×1 images."""
    return keras.Sequential([keras.Input((28, 28, 1)), *stack])


def mlp():
    """Flatten -> Dense(1024, relu) -> Dense(10)."""
    return sequential(layers.Flatten(), layers.Dense(1024, activation="relu"), logits())


def cnn_small():
    """examples/cnn_small.c: Conv2D(32, 3, relu) -> MaxPool(2) -> Flatten ->
    Dense(128, relu) -> Dense(10)."""
    return sequential(layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(2),
                      layers.Flatten(), layers.Dense(128, activation="relu"), logits())


def cnn():
    """examples/cnn.c (Keras' BatchNormalization defaults: momentum 0.99,
    epsilon 1e-3)."""
    def block(filters):
        return [layers.Conv2D(filters, 3, activation="relu"), layers.BatchNormalization(),
                layers.Conv2D(filters, 3, activation="relu"), layers.MaxPooling2D(2),
                layers.Dropout(0.25)]
    return sequential(*block(32), *block(64), layers.Flatten(),
                      layers.Dense(512, activation="relu"), layers.BatchNormalization(),
                      layers.Dropout(0.5), logits())


def resnet():
    """examples/resnet20.h's ResNet-20, in the functional API as there:
    Conv2D(16, 3, same, no bias) -> BN -> ReLU, 3 stages of 3 basic blocks
    (16, 32, 64 filters; Conv2D -> BN -> ReLU -> Conv2D -> BN, Add with the
    shortcut, ReLU; the first block of stages 2 and 3 with stride 2 and a
    1×1 Conv2D + BN shortcut), GlobalAveragePooling2D, Dense(10).
    he_normal kernels, Keras' BatchNormalization defaults."""
    def conv(x, filters, size, stride):
        return layers.Conv2D(filters, size, strides=stride, padding="same", use_bias=False,
                             kernel_initializer="he_normal")(x)

    def bn(x):
        return layers.BatchNormalization()(x)

    def relu(x):
        return layers.Activation("relu")(x)

    inputs = keras.Input((28, 28, 1))
    x = relu(bn(conv(inputs, 16, 3, 1)))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            y = relu(bn(conv(x, filters, 3, stride)))
            y = bn(conv(y, filters, 3, 1))
            shortcut = x if stride == 1 else bn(conv(x, filters, 1, stride))
            x = relu(layers.Add()([y, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, logits()(x))


def dataset(x, y, batch, seed):
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(x.shape[0], seed=seed, reshuffle_each_iteration=True)
            .batch(batch).prefetch(tf.data.AUTOTUNE))


class EpochTimes(keras.callbacks.Callback):
    """The wall time of each epoch of a fit."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def main():
    args = train_peers.parse_args(__doc__.split("\n")[0], "also the mixed_bfloat16 policy")

    # before any op runs, or TensorFlow keeps its defaults (one thread per core)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x, y = load_train(args.data)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    config = f"intra={args.threads} inter=1 onednn_opts={onednn}"
    print(f"# TensorFlow {tf.__version__} (Keras {keras.__version__}), {config}, "
          f"batch {args.batch_size}, python {sys.version.split()[0]}")

    policies = ["float32"] + (["mixed_bfloat16"] if args.bf16 else [])
    train_peers.table_header()
    framework = {"framework": "tensorflow", "version": tf.__version__, "config": config}
    lines = []
    for name, build, samples in train_peers.selected_models(
            args, {"mlp": mlp, "cnn_small": cnn_small, "cnn": cnn, "resnet": resnet}):
        samples = min(samples, x.shape[0])
        for policy in policies:
            keras.mixed_precision.set_global_policy(policy)
            keras.utils.set_random_seed(42)
            model = build()
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            w = args.warmup_samples
            # tf.data shuffles; Keras' own shuffle flag would only warn
            model.fit(dataset(x[:w], y[:w], args.batch_size, 1), epochs=1, shuffle=False,
                      verbose=0)
            # each epoch is one pass: the repeated dataset's batches per pass
            steps = -(-samples // args.batch_size)
            train = dataset(x[:samples], y[:samples], args.batch_size, 42).repeat()
            timer = EpochTimes()
            model.fit(train, epochs=args.repeat, steps_per_epoch=steps, shuffle=False, verbose=0,
                      callbacks=[timer])
            rate = train_peers.rates(samples, timer.seconds)
            train_peers.table_row(name, policy, rate)
            lines.append(train_peers.result_line(framework, name, policy, args.threads,
                                                 args.batch_size, samples, args.repeat, rate))
            keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    train_peers.print_lines(lines)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""ResNet-20 trained to its test accuracy in TensorFlow/Keras, as
examples/resnet.c trains it in mpt.h: the same model (bench/tf_train.py's
resnet(), examples/resnet20.h's layers), the first 50,000 training images
for training and the last 10,000 for validation, Adam from 1e-3 decayed
to 0 by Keras' CosineDecay over the run's steps (as resnet.c), batch 128,
sparse categorical crossentropy on logits, shuffled every epoch, a policy
(mixed_float16 by default, as resnet.c), resnet.c's augmentation at the
input (RandomFlip("horizontal"), RandomTranslation(0.05, 0.05,
fill_mode="constant", interpolation="nearest"); --no-augment: none),
then the test set's accuracy. For
the accuracy at equal epochs that issue-level comparisons ask for, not for
speed (bench/tf_train.py and compare.sh time the steps).

    /tmp/tfvenv/bin/python bench/tf_resnet.py --epochs 20 [--policy mixed_float16]
        [--threads 2] [--seed 42] [--train-samples 50000]
        [--data /usr/share/datasets/fashion-mnist] [--no-augment]

Prints Keras' progress per epoch (val_accuracy included), the test
accuracy after every epoch (so that a run of N epochs also gives the
figure at any fewer: TensorFlow's float16 on a CPU without AVX512-FP16
runs through Eigen and is slow), and one JSON line: the policy, epochs,
the validation and test accuracy of each epoch, test_accuracy (the
last), and the wall seconds of each epoch's training.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_train  # noqa: E402  (the ResNet-20 builder and the training images)
from idx_data import find, read_idx  # noqa: E402

keras = tf.keras


def load_test(data_dir):
    x = read_idx(find(data_dir, "t10k-images-idx3-ubyte"))
    y = read_idx(find(data_dir, "t10k-labels-idx1-ubyte"))
    return (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1), y.astype(np.int32)


class TestEachEpoch(keras.callbacks.Callback):
    """The test set's accuracy after every epoch, and each epoch's
    training time (the test pass not counted)."""

    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch
        self.accuracy, self.seconds = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)
        _, accuracy = self.model.evaluate(self.x, self.y, batch_size=self.batch, verbose=0)
        self.accuracy.append(float(accuracy))
        print(f"# epoch {epoch + 1}: test_accuracy {accuracy:.4f}, "
              f"{self.seconds[-1]:.0f} s", flush=True)


def augmented(model):
    """The model behind resnet.c's augmentation layers, which Keras runs
    in training only (fit), never in evaluate or predict."""
    inputs = keras.Input(model.input_shape[1:])
    x = keras.layers.RandomFlip("horizontal")(inputs)
    x = keras.layers.RandomTranslation(0.05, 0.05, fill_mode="constant",
                                       interpolation="nearest")(x)
    return keras.Model(inputs, model(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--policy", default="mixed_float16",
                    choices=["float32", "mixed_float16", "mixed_bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-samples", type=int, default=50000,
                    help="the first N of the 50,000 training images (fewer: a smoke run)")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--no-augment", action="store_true",
                    help="train without resnet.c's RandomFlip and RandomTranslation")
    args = ap.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x, y = tf_train.load_train(args.data)
    x_test, y_test = load_test(args.data)
    n_train = x.shape[0] - 10000  # resnet.c: the last 10,000 validate
    train_x, train_y = x[:min(args.train_samples, n_train)], y[:min(args.train_samples, n_train)]
    print(f"# TensorFlow {tf.__version__} (Keras {keras.__version__}), threads {args.threads}, "
          f"policy {args.policy}, {train_x.shape[0]} training images, {args.epochs} epochs, "
          f"augmentation {'off' if args.no_augment else 'on'}", flush=True)

    keras.mixed_precision.set_global_policy(args.policy)
    keras.utils.set_random_seed(args.seed)
    model = tf_train.resnet()
    if not args.no_augment:
        model = augmented(model)
    steps = args.epochs * -(-train_x.shape[0] // args.batch_size)
    rate = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=steps)
    model.compile(optimizer=keras.optimizers.Adam(rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    train = tf_train.dataset(train_x, train_y, args.batch_size, args.seed)
    validation = (tf.data.Dataset.from_tensor_slices((x[n_train:], y[n_train:]))
                  .batch(args.batch_size))
    each = TestEachEpoch(x_test, y_test, args.batch_size)
    history = model.fit(train, epochs=args.epochs, validation_data=validation, verbose=2,
                        shuffle=False,  # tf.data shuffles; the flag would only warn
                        callbacks=[each])
    print(json.dumps({"bench": "resnet_accuracy", "framework": "tensorflow",
                      "version": tf.__version__, "policy": args.policy, "epochs": args.epochs,
                      "threads": args.threads, "batch": args.batch_size, "seed": args.seed,
                      "train_samples": int(train_x.shape[0]),
                      "augment": not args.no_augment,
                      "val_accuracy": [round(v, 4) for v in history.history["val_accuracy"]],
                      "test_accuracy_each": [round(v, 4) for v in each.accuracy],
                      "test_accuracy": round(each.accuracy[-1], 4),
                      "epoch_s": [round(v, 1) for v in each.seconds]}, separators=(",", ":")))


if __name__ == "__main__":
    main()

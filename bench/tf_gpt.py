#!/usr/bin/env python3
"""TensorFlow (Keras 3) twin of examples/gpt.c: training tokens/s and validation
loss of the same character-level GPT on the CPU, for comparison with mpt.h.

    build/venv-peers/bin/python bench/tf_gpt.py                  # float32, 40 steps
    build/venv-peers/bin/python bench/tf_gpt.py --policy mixed_bfloat16 --steps 40 --timed-steps 20
    build/venv-peers/bin/python bench/tf_gpt.py --data FILE --eval 0

The model, built as gpt.c builds it, from Keras' own layers:
    Embedding(256, 256) + a learned position embedding (128, 256)
    4 blocks, pre-LayerNormalization (epsilon 1e-5):
        x = x + MultiHeadAttention(num_heads=4, key_dim=64)(LN(x), LN(x),
                                   use_causal_mask=True)
        x = x + Dense(256)(Dense(1024, activation="gelu")(LN(x)))   exact GELU
    -> LayerNormalization -> Dense(256) logits, sparse cross-entropy from the
    logits over every position (nats per byte).
Every projection has a bias (Keras' MultiHeadAttention keeps q, k, v and the
output as four kernels, as mpt.h does). GPT-2's initialisation: kernels and
embeddings N(0, 0.02²), biases 0, LayerNormalization's gamma 1 and beta 0.
AdamW: learning rate 1e-3, beta_1 0.9, beta_2 0.999, epsilon 1e-7, weight
decay 0.1, none on biases and LayerNormalization's parameters
(exclude_from_weight_decay, as gpt.c asks mpt.h). No dropout.

mixed_bfloat16: Keras' policy of that name (float32 variables, bfloat16
compute); the logits are cast to float32 for the loss, as the final layer's
float32 output is in mpt.h; no loss scaling (bfloat16 needs none). The
residual stream is float32 (the position embedding's add and each residual
Add with dtype="float32"), as gpt.c keeps it.

Data: gpt.c's. The text is every file of /usr/share/games/fortunes but the .dat
indexes and the .u8 links, in name order (or --data FILE); the first
int(size · 0.9) bytes train, the rest validate. A training batch is 32
windows of 129 bytes at random starts (inputs the first 128, targets the
last 128); the validation loss reads the tail's windows back to back.

The step: one tf.function (forward, loss, gradients, AdamW) traced once, the
Keras way of writing a custom training step. Timing: --steps optimizer steps
in all, the last --timed-steps of them timed (batch gathering included); the
steps before warm up (the first traces the function). Threads: intra-op
--threads, inter-op 1. Prints one JSON line like gpt.c's and torch_gpt.py's.
"""
import json
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_text import (  # noqa: E402  (shared with torch_gpt.py)
    arguments, cut, parse, rate_factor, read_text, run_steps, schedule_fields)

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 256, 128, 256, 4, 4


# ---- the text ---------------------------------------------------------------------------

def split(text):
    """(train, validation) as uint8 arrays (gpt_text.cut)."""
    train, val = cut(text)
    return np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8)


def windows(data, starts):
    """Inputs (B, T) and targets (B, T), int32, of the windows at starts."""
    xy = data[starts[:, None] + np.arange(CONTEXT + 1)].astype(np.int32)
    return xy[:, :-1], xy[:, 1:]


# ---- the model ---------------------------------------------------------------------------

def build_model(keras):
    normal = keras.initializers.RandomNormal(0.0, 0.02)

    class PositionEmbedding(keras.layers.Layer):
        """A learned (T, C) table added to the token embedding."""

        def build(self, input_shape):
            self.table = self.add_weight(name="embeddings", shape=(CONTEXT, WIDTH),
                                         initializer=normal)

        def call(self, x):
            return x + keras.ops.cast(self.table, x.dtype)

    def dense(units, **kw):
        return keras.layers.Dense(units, kernel_initializer=normal, **kw)

    def norm():
        return keras.layers.LayerNormalization(epsilon=1e-5)

    ids = keras.Input((CONTEXT,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, embeddings_initializer=normal)(ids)
    # the residual stream in float32, as examples/gpt.c keeps it (and PyTorch's
    # autocast): the position embedding's add and every residual Add compute in
    # float32; the branches in the policy's dtype
    x = PositionEmbedding(dtype="float32")(x)
    for _ in range(LAYERS):
        h = norm()(x)
        h = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS,
                                            kernel_initializer=normal)(h, h,
                                                                      use_causal_mask=True)
        x = keras.layers.Add(dtype="float32")([x, h])
        h = dense(4 * WIDTH, activation="gelu")(norm()(x))
        x = keras.layers.Add(dtype="float32")([x, dense(WIDTH)(h)])
    logits = dense(VOCAB, dtype="float32")(norm()(x))   # float32 out, as mpt.h's last layer
    return keras.Model(ids, logits)


# ---- main --------------------------------------------------------------------------------

def main():
    args = parse(arguments(__doc__.split("\n")[0], ("float32", "mixed_bfloat16")))

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import keras
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)
    keras.mixed_precision.set_global_policy(args.policy)

    text = read_text(args.data)
    train, val = split(text)
    model = build_model(keras)
    # the rate of every step, looked up by the optimizer's iteration count
    # (0 at the first update): gpt.c's schedule, constant without one
    rates = tf.constant([1e-3 * rate_factor(args, t) for t in range(args.steps + 1)],
                        dtype=tf.float32)

    class Schedule(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return tf.gather(rates, tf.minimum(tf.cast(step, tf.int32), args.steps))

    opt = keras.optimizers.AdamW(learning_rate=Schedule(), weight_decay=0.1, beta_1=0.9,
                                 beta_2=0.999, epsilon=1e-7)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def eval_step(x, y):
        return loss_fn(y, model(x, training=False))

    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"# TensorFlow {tf.__version__}, Keras {keras.__version__}, {args.threads} threads, "
          f"{args.policy}, {params:,} parameters, text {len(text):,} bytes "
          f"({train.size:,} train), python {sys.version.split()[0]}", flush=True)

    rng = np.random.default_rng(args.seed)

    def step():
        x, y = windows(train, rng.integers(0, train.size - CONTEXT, args.batch_size))
        return float(train_step(x, y))

    losses, timed_s, seconds = run_steps(args, step)
    tokens_per_s = args.timed_steps * args.batch_size * CONTEXT / seconds

    val_loss = None
    if args.eval:
        n = (val.size - 1) // CONTEXT
        total = 0.0
        for i in range(0, n, args.batch_size):
            starts = np.arange(i, min(i + args.batch_size, n)) * CONTEXT
            x, y = windows(val, starts)
            total += float(eval_step(x, y)) * starts.size
        val_loss = total / n
    line = {"model": "gpt", "framework": "tensorflow", "version": tf.__version__,
            "policy": args.policy, "steps": args.steps, "timed_steps": args.timed_steps,
            "batch_size": args.batch_size, "context": CONTEXT, "threads": args.threads,
            "params": params, "tokens_per_s": round(tokens_per_s),
            "step_ms": round(1e3 * statistics.median(timed_s), 1),
            "train_loss": round(losses[-1], 4),
            "val_loss": None if val_loss is None else round(val_loss, 4),
            "bits_per_char": None if val_loss is None else round(val_loss / math.log(2), 4),
            **schedule_fields(args)}
    print(json.dumps(line, separators=(",", ":")))


if __name__ == "__main__":
    main()

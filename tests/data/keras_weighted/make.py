"""Computes, with TensorFlow's Keras, the weighted losses and metrics that
tests/test_train.c (test_weighted_against_keras) compares mpt.h's with,
and prints them as the C constants pasted there: run it from anywhere
(python3 make.py) and paste what it prints over the block it replaces.

The case is small and fixed, every input and weight an exact binary
fraction (the formulas below, which test_train.c computes too), so that
mpt.h's model and this one hold the same float32 values:
   N = 8 samples of IN = 3 features, x[i][j] = ((7 i + 3 j + 2 i j) mod 13 - 6) / 4
   a classifier   Dense(3, softmax), kernel[j][c] = ((7 j + 3 c) mod 9 - 4) / 8,
                  bias[c] = (c - 1) / 4, labels y[i] = (5 i + 1) mod 3
   a binary one   Dense(1, sigmoid), kernel[j] = ((3 j + 1) mod 5 - 2) / 4,
                  bias 1/8, targets t[i] = LABELS_BINARY[i]
   a regression   Dense(2), kernel[j][c] = ((2 j + 5 c) mod 7 - 3) / 4,
                  bias[c] = c / 2, targets r[i][c] = ((3 i + 2 c) mod 7 - 3) / 2 + 1/4
                  (never 0: percentage errors stay finite)
   sample weights SAMPLE_WEIGHT (one 0), class weights CLASS_WEIGHT(_BINARY)
Keras gives the reference the issue asks for: model.evaluate(x, y,
sample_weight=w) with the metrics compiled as weighted_metrics, the same
without sample weights (the unweighted values), and the first epoch's logs
of model.fit(x, y, class_weight=..., batch_size=N) with SGD at learning
rate 0 (one batch, so the logged values are those of the weights above).

Made with tensorflow-cpu 2.21.0 (Keras 3) in a venv of its own:
    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install 'tensorflow-cpu==2.21.*'
    /tmp/tfvenv/bin/python make.py"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow import keras  # noqa: E402

N, IN = 8, 3
SAMPLE_WEIGHT = np.array([1, 2, 0.5, 3, 1, 0, 2, 1.5], np.float32)
CLASS_WEIGHT = {0: 1.0, 1: 2.0, 2: 0.5}
CLASS_WEIGHT_BINARY = {0: 1.5, 1: 0.5}
LABELS_BINARY = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)

i, j = np.meshgrid(np.arange(N), np.arange(IN), indexing="ij")
x = (((7 * i + 3 * j + 2 * i * j) % 13 - 6) / 4).astype(np.float32)


def dense(units, activation, kernel, bias):
    m = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(units, activation=activation)])
    m.layers[0].set_weights([kernel.astype(np.float32), bias.astype(np.float32)])
    return m


def logs(model, loss, metrics, y):
    """evaluate with sample weights and without, and fit's first epoch with
    class weights (Keras 3 refuses class and sample weights together)."""
    out = {}
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss,
                  weighted_metrics=[m() for m in metrics])
    ev = model.evaluate(x, y, sample_weight=SAMPLE_WEIGHT, batch_size=N, verbose=0,
                        return_dict=True)
    out["evaluate"] = ev
    plain = model.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
    out["evaluate_unweighted"] = plain
    cw = CLASS_WEIGHT_BINARY if loss == "binary_crossentropy" else CLASS_WEIGHT
    h = model.fit(x, y, class_weight=cw, batch_size=N, epochs=1, shuffle=False, verbose=0)
    out["fit_class_weight"] = {k: v[0] for k, v in h.history.items()}
    return out


def emit(prefix, results, keys):
    for run, values in results.items():
        for k in keys:
            if k in values:
                print(f"#define KERAS_{prefix}_{run.upper()}_{k.upper()} {float(values[k]):.17g}")


c = np.arange(3)
cls = dense(3, "softmax", ((7 * np.arange(IN)[:, None] + 3 * c) % 9 - 4) / 8, (c - 1) / 4)
y_cls = ((5 * np.arange(N) + 1) % 3).astype(np.int32)
r_cls = logs(cls, "sparse_categorical_crossentropy",
             [lambda: keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
              lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
             y_cls)

binary = dense(1, "sigmoid", (((3 * np.arange(IN) + 1) % 5 - 2) / 4)[:, None], np.array([0.125]))
r_bin = logs(binary, "binary_crossentropy",
             [lambda: keras.metrics.BinaryAccuracy(name="accuracy"),
              lambda: keras.metrics.AUC(name="auc"),
              lambda: keras.metrics.Precision(name="precision"),
              lambda: keras.metrics.Recall(name="recall")],
             LABELS_BINARY)

c2 = np.arange(2)
reg = dense(2, None, ((2 * np.arange(IN)[:, None] + 5 * c2) % 7 - 3) / 4, c2 / 2)
y_reg = (((3 * np.arange(N)[:, None] + 2 * c2) % 7 - 3) / 2 + 0.25).astype(np.float32)
r_reg = logs(reg, "mean_squared_error",
             [lambda: keras.metrics.MeanAbsoluteError(name="mae"),
              lambda: keras.metrics.MeanSquaredError(name="mse"),
              lambda: keras.metrics.RootMeanSquaredError(name="rmse"),
              lambda: keras.metrics.MeanAbsolutePercentageError(name="mape"),
              lambda: keras.metrics.R2Score(name="r2")],
             y_reg)
del r_reg["fit_class_weight"]  # class_weight: classifiers only

print(f"/* tests/data/keras_weighted/make.py, TensorFlow {tf.__version__}, Keras "
      f"{keras.__version__} */")
emit("CLS", r_cls, ["loss", "accuracy", "top2"])
emit("BIN", r_bin, ["loss", "accuracy", "auc", "precision", "recall"])
emit("REG", r_reg, ["loss", "mae", "mse", "rmse", "mape", "r2"])
# the predictions, for the test to check that both models compute the same
def c_float(v):
    text = f"{v:.9g}"
    return text + ("f" if "." in text or "e" in text else ".0f")


for name, model in (("cls", cls), ("bin", binary), ("reg", reg)):
    values = [c_float(v) for v in model.predict(x, verbose=0).ravel()]
    print(f"static const float keras_{name}_pred[] = {{")
    for k in range(0, len(values), 6):
        print("    " + ", ".join(values[k:k + 6]) + ("," if k + 6 < len(values) else ""))
    print("};")

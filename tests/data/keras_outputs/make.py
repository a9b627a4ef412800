"""Computes, with TensorFlow's Keras, the losses and metrics of a model of
two outputs that tests/test_outputs.c (test_keras_reference) compares
mpt.h's with, and prints them as the C constants pasted there: run it from
anywhere (python3 make.py) and paste what it prints over the block it
replaces.

The case is small and fixed, every input and weight an exact binary
fraction (the formulas below, which test_outputs.c computes too), so that
mpt.h's model and this one hold the same float32 values:
   N = 6 samples of IN = 3 features, x[i][j] = ((5 i + 3 j + i j) mod 11 - 5) / 4
   hidden   Dense(4, tanh),   kernel[j][h] = ((3 j + 5 h) mod 7 - 3) / 8,  bias[h] = (h - 1) / 8
   cls      Dense(3, softmax) on hidden, kernel[h][c] = ((2 h + 3 c) mod 5 - 2) / 4,
            bias[c] = (c - 1) / 4, labels y[i] = (2 i + 1) mod 3
   reg      Dense(1) on hidden, kernel[h] = ((h + 2) mod 4 - 1.5) / 2, bias 1/4,
            targets t[i] = (i mod 4) / 2 - 1/2
   compile(loss=[sparse_categorical_crossentropy, mse], loss_weights=[1, 0.5],
           metrics=[[accuracy], [mean_absolute_error]]), SGD(0.1)
   sample weights SAMPLE_WEIGHT
Printed: evaluate without and with sample weights, then fit(epochs=1,
batch_size=N, shuffle=False)'s logs (the weights before its one step) and
every weight after that step.

Made with tensorflow-cpu 2.21.0 (Keras 3):
    /tmp/tfvenv/bin/python make.py"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
from tensorflow import keras  # noqa: E402

N, IN, H, C = 6, 3, 4, 3
SAMPLE_WEIGHT = np.array([1, 2, 0.5, 0, 1.5, 1], np.float32)

i, j = np.meshgrid(np.arange(N), np.arange(IN), indexing="ij")
x = (((5 * i + 3 * j + i * j) % 11 - 5) / 4).astype(np.float32)
y = ((2 * np.arange(N) + 1) % 3).astype(np.int32)
t = ((np.arange(N) % 4) / 2 - 0.5).astype(np.float32).reshape(N, 1)

jj, hh = np.meshgrid(np.arange(IN), np.arange(H), indexing="ij")
k_hidden = (((3 * jj + 5 * hh) % 7 - 3) / 8).astype(np.float32)
b_hidden = ((np.arange(H) - 1) / 8).astype(np.float32)
hh2, cc = np.meshgrid(np.arange(H), np.arange(C), indexing="ij")
k_cls = (((2 * hh2 + 3 * cc) % 5 - 2) / 4).astype(np.float32)
b_cls = ((np.arange(C) - 1) / 4).astype(np.float32)
k_reg = (((np.arange(H) + 2) % 4 - 1.5) / 2).astype(np.float32).reshape(H, 1)
b_reg = np.array([0.25], np.float32)


def model():
    inp = keras.Input((IN,))
    h = keras.layers.Dense(H, activation="tanh", name="hidden")(inp)
    a = keras.layers.Dense(C, activation="softmax", name="cls")(h)
    b = keras.layers.Dense(1, name="reg")(h)
    m = keras.Model(inp, [a, b])
    m.get_layer("hidden").set_weights([k_hidden, b_hidden])
    m.get_layer("cls").set_weights([k_cls, b_cls])
    m.get_layer("reg").set_weights([k_reg, b_reg])
    m.compile(optimizer=keras.optimizers.SGD(0.1),
              loss=["sparse_categorical_crossentropy", "mse"], loss_weights=[1.0, 0.5],
              metrics=[["accuracy"], ["mean_absolute_error"]])
    return m


def c_array(name, values):
    return "static const double %s[] = {%s};" % (
        name, ", ".join("%.9g" % v for v in np.asarray(values, np.float64).ravel()))


KEYS = ["loss", "cls_loss", "reg_loss", "cls_accuracy", "reg_mean_absolute_error"]
m = model()
plain = m.evaluate(x, [y, t], batch_size=N, verbose=0, return_dict=True)
weighted = m.evaluate(x, [y, t], sample_weight=SAMPLE_WEIGHT, batch_size=N, verbose=0,
                      return_dict=True)
hist = m.fit(x, [y, t], batch_size=N, epochs=1, shuffle=False, verbose=0).history
print("/* keys: " + ", ".join(KEYS) + " */")
print(c_array("KERAS_EVALUATE", [plain[k] for k in KEYS]))
print(c_array("KERAS_EVALUATE_WEIGHTED", [weighted[k] for k in KEYS]))
print(c_array("KERAS_FIT", [hist[k][0] for k in KEYS]))
after = []
for name in ["hidden", "cls", "reg"]:
    for w in m.get_layer(name).get_weights():
        after.extend(np.asarray(w, np.float64).ravel())
print(c_array("KERAS_AFTER_STEP", after))

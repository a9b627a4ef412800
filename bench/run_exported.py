"""Test accuracy of an exported .tflite and .onnx in LiteRT and ONNX Runtime.

Runs the files examples/quantize.c --export wrote (float32 in and out) on
Fashion-MNIST's 10,000 test images, scaled as mpt.h's IDX loader scales
them (byte * float32(1/255)), and prints each runtime's top-1 accuracy.

    build/venv/bin/python bench/run_exported.py /tmp/qx/mlp_qat_int8 [--data DIR]
"""
import argparse
import os
import sys

import numpy as np
import onnxruntime as ort
from ai_edge_litert.interpreter import Interpreter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from idx_data import find, read_idx  # noqa: E402


def litert_outputs(path, x):
    it = Interpreter(model_path=path)
    d, o = it.get_input_details()[0], it.get_output_details()[0]
    it.resize_tensor_input(d["index"], list(x.shape))
    it.allocate_tensors()
    it.set_tensor(d["index"], x)
    it.invoke()
    return it.get_tensor(o["index"])


def ort_outputs(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("stem", help="the files' path without .tflite / .onnx")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    images = read_idx(find(a.data, "t10k-images-idx3-ubyte"))
    labels = read_idx(find(a.data, "t10k-labels-idx1-ubyte")).astype(np.int64)
    x = (images.astype(np.float32) * np.float32(1.0 / 255.0)).reshape(-1, 28, 28, 1)
    for name, run, ext in (("LiteRT", litert_outputs, ".tflite"),
                           ("ONNX Runtime", ort_outputs, ".onnx")):
        y = run(a.stem + ext, x)
        accuracy = float(np.mean(np.argmax(y.reshape(len(x), -1), axis=1) == labels))
        print(f"{name}: {a.stem + ext}: test accuracy {accuracy:.4f} on {len(x)} images")


if __name__ == "__main__":
    main()

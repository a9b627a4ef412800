"""mpt.h's int8 predict against ONNX Runtime's on the very same model.

For each model (examples/quantize.c's mlp and cnn_small), build/bench_int8_predict
loads (or trains once and saves) the float32 weights, quantizes them to
full integer (min/max over the first 500 training images) and exports that
model with mpt_model_export_onnx (QDQ form, float32 in and out). This script
loads the .onnx into ONNX Runtime (CPUExecutionProvider, intra-op threads =
--threads, inter-op 1, every graph optimization) and times, in interleaved
rounds whose order rotates, three things on the same batch of test images:
mpt.h's float32 predict and its full_int8 predict (through bench_int8_predict
--serve, one process kept alive), and ONNX Runtime's run of the int8 file.
A round is the median of --reps calls of each; the report is the median over
rounds of each time and of the per-round ratios.

    bench/compare_int8.sh [--models mlp cnn_small] [--rounds 9] [--reps 20]

Prints a Markdown table, then one JSON line per model ("bench":"compare_int8").
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from idx_data import find, read_idx  # noqa: E402


class MptServer:
    """bench_int8_predict --serve: one line per request, the median seconds back."""

    def __init__(self, binary, model, weights, export_dir, threads, batch, data):
        cmd = [binary, "--model", model, "--weights", weights, "--threads", str(threads),
               "--batch-size", str(batch), "--export", export_dir, "--data", data, "--serve"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{binary} exited: {self.proc.wait()}")
        self.onnx_path = json.loads(line)["exported"]

    def time(self, variant, reps):
        self.proc.stdin.write(f"{variant} {reps}\n")
        self.proc.stdin.flush()
        seconds = float(self.proc.stdout.readline())
        if seconds < 0:
            raise RuntimeError(f"bench_int8_predict: {variant} failed")
        return seconds

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def ort_session(path, threads):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def ort_time(session, feed, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn_small"])
    p.add_argument("--binary", default=os.path.join(root, "build", "bench_int8_predict"))
    p.add_argument("--weights-dir", default=os.path.join(root, "build"),
                   help="where <model>_int8bench.safetensors is kept (trained once if missing)")
    p.add_argument("--export-dir", default=os.path.join(root, "build", "int8_onnx"))
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()

    images = read_idx(find(a.data, "t10k-images-idx3-ubyte"))[:a.batch]
    x = (images.astype(np.float32) / np.float32(255.0)).reshape(a.batch, 28, 28, 1)
    results = []
    for model in a.models:
        weights = os.path.join(a.weights_dir, f"{model}_int8bench.safetensors")
        mpt = MptServer(a.binary, model, weights, a.export_dir, a.threads, a.batch, a.data)
        session = ort_session(mpt.onnx_path, a.threads)
        feed = {session.get_inputs()[0].name: x}
        ort_time(session, feed, a.warmup)
        runs = {"mpt_float32": [], "mpt_int8": [], "ort_int8": []}
        timers = {
            "mpt_float32": lambda: mpt.time("float32", a.reps),
            "mpt_int8": lambda: mpt.time("full_int8", a.reps),
            "ort_int8": lambda: ort_time(session, feed, a.reps),
        }
        order = list(timers)
        for r in range(a.rounds):
            for name in order[r % 3:] + order[:r % 3]:
                runs[name].append(timers[name]())
        mpt.close()
        med = {k: statistics.median(v) for k, v in runs.items()}
        vs_ort = statistics.median(o / m for o, m in zip(runs["ort_int8"], runs["mpt_int8"]))
        vs_float = statistics.median(f / m for f, m in zip(runs["mpt_float32"], runs["mpt_int8"]))
        results.append({
            "bench": "compare_int8", "model": model, "batch": a.batch, "threads": a.threads,
            "rounds": a.rounds, "reps": a.reps, "onnx": mpt.onnx_path,
            "onnxruntime": ort.__version__,
            "mpt_float32_ms": round(1e3 * med["mpt_float32"], 4),
            "mpt_int8_ms": round(1e3 * med["mpt_int8"], 4),
            "ort_int8_ms": round(1e3 * med["ort_int8"], 4),
            "mpt_int8_vs_ort_int8": round(vs_ort, 3),
            "mpt_int8_vs_mpt_float32": round(vs_float, 3),
        })

    print(f"ONNX Runtime {ort.__version__}, {platform.processor() or platform.machine()}, "
          f"batch {a.batch}, {a.threads} threads, {a.rounds} rounds x {a.reps} calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print()
    print("| model | mpt.h float32 (ms) | mpt.h int8 (ms) | ORT int8 (ms) "
          "| int8 speed-up vs mpt.h float32 | mpt.h int8 vs ORT int8 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['mpt_float32_ms']:.3f} | {r['mpt_int8_ms']:.3f} "
              f"| {r['ort_int8_ms']:.3f} | {r['mpt_int8_vs_mpt_float32']:.2f}x "
              f"| {r['mpt_int8_vs_ort_int8']:.2f}x |")
    print()
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

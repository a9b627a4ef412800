"""mpt.h's predict against ONNX Runtime and LiteRT on the very files it exports.

For each model (mlp, cnn_small, the seed cnn, ResNet-20) build/bench_predict loads (or
trains once and saves) the float32 weights, makes each variant mpt.h
deploys (float32; float16 weights; dynamic_int8; full_int8, calibrated on
500 training images) and exports each to .tflite and .onnx. This script
runs the same files in ONNX Runtime (CPUExecutionProvider, intra-op
threads --threads, inter-op 1, every graph optimization) and in LiteRT
(its default XNNPACK delegate, --threads threads), and times, in
interleaved rounds whose order rotates, the three on the same Fashion-MNIST
test images:

  - batch 1: every call timed; the median and the 99th percentile over all
    the rounds' calls (--reps1 a round, >= 1,000 in all by default);
  - batch --batch: the median of --reps calls a round, as samples/s; the
    median over rounds.

Warm-up calls are excluded: --warmup calls of each side when a cell
starts, and in every round, right before a side's timed calls, its own
calls for --warm-ms milliseconds. That second warm-up is what makes the
sides comparable: ONNX Runtime's worker threads keep spinning for tens
of milliseconds after a run returns (about one core,
bench/spin_after_run.py), so whichever side ran right after it lost a
core for its first calls, and on this 2-CPU virtual machine a CPU that
sat idle comes back slowly. The ratio of a cell is the faster runtime's
time over mpt.h's (above 1: mpt.h is faster), from the medians. Before
and after each cell, right after mpt.h's own warm-up calls (so that no
other side's spinning threads are in it), two threads' FMA peak over one
thread's ("cores_seen"): about 2 where the host gave the two threads two
cores, about 1 where it gave them one core's worth, as it sometimes
does; a cell measured at about 1 is not comparable with one at about 2.

    bench/compare_deploy.sh [--models mlp cnn_small cnn resnet] [--rounds 5]
        [--reps 20] [--reps1 200] [--train-samples N --weights-dir DIR]

Two diagnostics of the batch-1 cells, whose 10-50 us calls swing with
the machine's state: --settle S sleeps S seconds before every round (so
that another runtime's threads have gone idle), and --alone NAME times
only NAME (mpt, onnxruntime or litert) after a first full round, the
others loaded and warm but idle; its cells carry "alone" and NAME's
figures only.

--train-samples N trains a model that has no saved weights on the first N
training images only: a smoke run that proves every cell runs (give it a
--weights-dir of its own, so that its weights are not the table's).

Prints a Markdown table, then one JSON line per cell ("bench":"deploy").
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
from ai_edge_litert.interpreter import Interpreter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from idx_data import find, read_idx  # noqa: E402

VARIANTS = ("float32", "float16", "dynamic_int8", "full_int8")


class MptServer:
    """bench_predict --serve: one line per request, each call's seconds back."""

    def __init__(self, binary, model, weights, export_dir, threads, batch, data, train_samples):
        cmd = [binary, "--model", model, "--weights", weights, "--threads", str(threads),
               "--batch-size", str(batch), "--export", export_dir, "--data", data,
               "--train-samples", str(train_samples), "--serve"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{binary} exited: {self.proc.wait()}")
        self.stem = json.loads(line)["exported"]

    def times(self, variant, batch, reps):
        self.proc.stdin.write(f"{variant} {batch} {reps}\n")
        self.proc.stdin.flush()
        values = [float(v) for v in self.proc.stdout.readline().split()]
        if not values or values[0] < 0:
            raise RuntimeError(f"bench_predict: {variant} at batch {batch} failed")
        return values

    def cores(self):
        """Two threads' FMA peak over one thread's (bench/peak.h): about 2
        where the two run on two cores, about 1 where they share one."""
        self.proc.stdin.write("peak\n")
        self.proc.stdin.flush()
        one, both = (float(v) for v in self.proc.stdout.readline().split())
        return round(both / one, 2)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def ort_caller(path, threads, x):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return lambda: session.run(None, feed)


def litert_caller(path, threads, x):
    it = Interpreter(model_path=path, num_threads=threads)
    d, o = it.get_input_details()[0], it.get_output_details()[0]
    it.resize_tensor_input(d["index"], list(x.shape))
    it.allocate_tensors()

    def call():
        it.set_tensor(d["index"], x)
        it.invoke()
        return it.get_tensor(o["index"])
    return call


def timed_calls(call, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def warm(run, seconds):
    """Calls run(reps) (each call's seconds back) until they add up to seconds."""
    reps, spent = 1, 0.0
    while spent < seconds:
        spent += sum(run(reps))
        reps = min(2 * reps, 1000)


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    models = ["mlp", "cnn_small", "cnn", "resnet"]  # bench_predict's --model
    p.add_argument("--models", nargs="+", default=models, choices=models,
                   help="separated by spaces")
    p.add_argument("--binary", default=os.path.join(root, "build", "bench_predict"))
    p.add_argument("--weights-dir", default=os.path.join(root, "build"),
                   help="where <model>_deploybench.safetensors is kept (trained once if missing)")
    p.add_argument("--export-dir", default=os.path.join(root, "build", "deploy"))
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="batch-size calls a round")
    p.add_argument("--reps1", type=int, default=200, help="batch-1 calls a round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--warm-ms", type=float, default=100.0,
                   help="each side's untimed calls right before its timed calls in every round")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds of idle before each round")
    p.add_argument("--alone", choices=("mpt", "onnxruntime", "litert"),
                   help="after the first round, time only this side")
    p.add_argument("--train-samples", type=int, default=0,
                   help="train a model without saved weights on this many images (0: all)")
    a = p.parse_args()

    images = read_idx(find(a.data, "t10k-images-idx3-ubyte"))[:a.batch]
    x = (images.astype(np.float32) * np.float32(1.0 / 255.0)).reshape(a.batch, 28, 28, 1)
    inputs = {1: np.ascontiguousarray(x[:1]), a.batch: x}
    cells = []
    for model in a.models:
        weights = os.path.join(a.weights_dir, f"{model}_deploybench.safetensors")
        mpt = MptServer(a.binary, model, weights, a.export_dir, a.threads, a.batch, a.data,
                        a.train_samples)
        for variant in VARIANTS:
            stem = f"{mpt.stem}_{variant}"
            if not os.path.exists(stem + ".onnx"):
                continue  # the model has no such variant (bench_predict said why)
            for batch, reps in ((1, a.reps1), (a.batch, a.reps)):
                xb = inputs[batch]
                callers = {  # name: reps -> each call's seconds
                    "mpt": lambda r, b=batch, v=variant: mpt.times(v, b, r),
                    "onnxruntime": None, "litert": None,
                }
                runtime_calls = {"onnxruntime": ort_caller(stem + ".onnx", a.threads, xb),
                                 "litert": litert_caller(stem + ".tflite", a.threads, xb)}
                for name, call in runtime_calls.items():
                    timed_calls(call, a.warmup)
                    callers[name] = lambda r, c=call: timed_calls(c, r)
                mpt.times(variant, batch, a.warmup)
                runs = {k: [] for k in callers}
                order = list(callers)
                warm(callers["mpt"], a.warm_ms / 1e3)  # no other side's spinning threads in it
                cores_before = mpt.cores()
                for r in range(a.rounds):
                    for name in order[r % 3:] + order[:r % 3]:
                        if a.alone and r > 0 and name != a.alone:
                            continue
                        time.sleep(a.settle)
                        warm(callers[name], a.warm_ms / 1e3)
                        runs[name].append(callers[name](reps))
                if a.alone:
                    runs = {a.alone: runs[a.alone][1:]}
                warm(callers["mpt"], a.warm_ms / 1e3)
                cores_after = mpt.cores()
                cell = {"bench": "deploy", "model": model, "variant": variant, "batch": batch,
                        "threads": a.threads, "rounds": a.rounds, "calls_per_round": reps,
                        "warm_ms": a.warm_ms,
                        "cores_seen": [cores_before, cores_after]}
                if a.alone:
                    cell["alone"] = a.alone
                for name, rounds in runs.items():
                    if batch == 1:
                        every = [t for rnd in rounds for t in rnd]
                        cell[f"{name}_median_ms"] = round(1e3 * statistics.median(every), 4)
                        cell[f"{name}_p99_ms"] = round(1e3 * percentile(every, 99), 4)
                    else:
                        med = statistics.median(statistics.median(rnd) for rnd in rounds)
                        cell[f"{name}_median_ms"] = round(1e3 * med, 4)
                        cell[f"{name}_samples_per_s"] = round(batch / med, 1)
                if not a.alone:
                    faster = min(("onnxruntime", "litert"),
                                 key=lambda n: cell[f"{n}_median_ms"])
                    cell["faster_runtime"] = faster
                    cell["ratio"] = round(cell[f"{faster}_median_ms"] / cell["mpt_median_ms"], 3)
                cells.append(cell)
                print(json.dumps(cell), file=sys.stderr, flush=True)
        mpt.close()

    import ai_edge_litert
    print(f"ONNX Runtime {ort.__version__}, LiteRT (ai-edge-litert) "
          f"{getattr(ai_edge_litert, '__version__', '?')}, "
          f"{platform.processor() or platform.machine()}, {a.threads} threads, "
          f"{a.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    print()
    print("| model | variant | batch | mpt.h | ONNX Runtime | LiteRT | faster runtime / mpt.h "
          "| cores seen |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for c in cells:
        fmt = []
        for n in ("mpt", "onnxruntime", "litert"):
            if n + "_median_ms" not in c:
                fmt.append("(idle)")
            elif c["batch"] == 1:
                fmt.append(f"{c[n + '_median_ms']:.3f} ms (p99 {c[n + '_p99_ms']:.3f})")
            else:
                fmt.append(f"{c[n + '_samples_per_s']:,.0f}/s")
        ratio = f"{c['ratio']:.2f}x" if "ratio" in c else "-"
        seen = "–".join(f"{v:.1f}" for v in c["cores_seen"])
        print(f"| {c['model']} | {c['variant']} | {c['batch']} | {fmt[0]} | {fmt[1]} | {fmt[2]} "
              f"| {ratio} | {seen} |")
    print()
    for c in cells:
        print(json.dumps(c))


if __name__ == "__main__":
    main()

"""How much CPU each runtime's threads keep burning after a call returns.

Runs one exported file (build/deploy/<model>_<variant>.onnx and .tflite,
as bench/compare_deploy.sh writes them) 20 times in ONNX Runtime (2
intra-op threads, compare_deploy's settings) and in LiteRT (XNNPACK, 2
threads), then sleeps and reads this process's CPU time over the sleep:
about 0 where the runtime's threads went to sleep when the call returned,
up to 1 (a core) where a worker kept spinning for work. A side timed
right after a spinning runtime gets one core for two threads, which is
why compare_deploy warms each side up right before its timed calls.

    bench/compare_deploy.sh --models mlp   # writes build/deploy once
    build/venv/bin/python bench/spin_after_run.py [--file build/deploy/mlp_full_int8]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_deploy import litert_caller, ort_caller, timed_calls  # noqa: E402


def cores_while_sleeping(call, seconds):
    timed_calls(call, 20)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", default="build/deploy/mlp_full_int8",
                   help="the exported files' stem (.onnx and .tflite)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    x = np.random.default_rng(1).random((a.batch, 28, 28, 1), dtype=np.float32)
    runtimes = (("ONNX Runtime", ort_caller(a.file + ".onnx", a.threads, x)),
                ("LiteRT", litert_caller(a.file + ".tflite", a.threads, x)))
    for name, call in runtimes:
        for ms in (2, 10, 50, 200):
            cores = statistics.median(cores_while_sleeping(call, ms / 1e3) for _ in range(5))
            print(f"{name}: {cores:.2f} cores busy during the {ms} ms after 20 calls "
                  f"(median of 5)", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch on the GPU: training samples/s of the seed MLP and the CNN, the
GPU twin of bench/bench_cuda.c's training table.

    python3 bench/torch_gpu_train.py                    # both models, batch 128 and 1024
    python3 bench/torch_gpu_train.py --model mlp --batch-sizes 128 --repeat 5
    python3 bench/torch_gpu_train.py --no-cuda-graphs   # the eager rows only

The models are bench/torch_train.py's (imported from it): the same
architectures as examples/mlp.c and examples/cnn.c, Adam (lr 1e-3, eps 1e-7
as Keras), CrossEntropyLoss on logits (the softmax fused into the loss, as
mpt.h's fit fuses it). Two policies, eager:
  float32           TF32 off for matmuls and convolutions (mpt.h's float32
                    is true float32); --tf32 turns it on
  autocast_float16  torch.autocast("cuda", dtype=torch.float16) with a
                    GradScaler (dynamic loss scaling), float32 weights:
                    mpt.h's mixed_float16
and, with --cuda-graphs (the default), the same two with the whole training
step (forward, loss, backward, Adam) captured once in a torch.cuda.CUDAGraph
and replayed per batch, as PyTorch's whole-network capture recipe does:
static input and label tensors each batch is gathered into (outside the
graph, on the GPU), warm-up steps on a side stream, Adam(capturable=True),
zero_grad(set_to_none=True) before the capture. This takes the per-kernel
launch cost off the host, as mpt.h's graphs do:
  float32_graphs           as float32
  autocast_float16_graphs  autocast float16 with a FIXED loss scale (2**15,
                           unscaled in the graph before Adam): GradScaler's
                           inf check and scale update need a host sync and
                           cannot be captured, so this row skips no step and
                           never adapts its scale, unlike autocast_float16
With --compile MODE (e.g. max-autotune; none by default: inductor's
autotuning takes minutes), two more rows run the model through
torch.compile(model, mode=MODE) (inductor; max-autotune and reduce-overhead
also replay CUDA graphs), eager Adam and GradScaler around it:
  float32_compiled, autocast_float16_compiled
their "compile_seconds" is the warm-up's time, compilation included.
A capture or compilation that fails prints a '#' line and the other rows go on.
The data is synthetic (uniform pixels, random labels), generated on the GPU
and resident there: nothing is read or downloaded. Each epoch draws a
random permutation on the GPU and gathers its batches from it. Sample counts
are whole batches, as bench_cuda's: mlp 59,392, cnn 25,600. After
--warmup-steps steps (cuDNN's autotuner, allocator, kernels), each measured
epoch is timed with torch.cuda.synchronize() on both ends; the median of
--repeat epochs is reported, with the min and max. Prints a Markdown table
and one JSON line per result ("graphs": true on the graph rows), each
opening with where it came from: "commit" ($MPT_BENCH_COMMIT, which
./build.sh gpu sets; else git's; else "unknown"), "arch" (the GPU's
compute capability), "device", "driver" (nvidia-smi's, where it runs),
"runtime" (PyTorch's CUDA) and "date" (UTC, when the run began).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import cnn, mlp  # noqa: E402  (the same models as the CPU comparison)

SAMPLES = {"mlp": 59392, "cnn": 25600}
LOSS_SCALE = 2.0 ** 15  # the graph rows' fixed float16 loss scale


def make_scaler():
    """A GradScaler: torch.amp's where it has one (torch.cuda.amp's is deprecated there)."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


def provenance(device):
    """Where the results came from: the first keys of every JSON line."""
    commit = os.environ.get("MPT_BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        driver = ""
    major, minor = torch.cuda.get_device_capability(device)
    return {"commit": commit or "unknown", "arch": f"sm_{major}{minor}",
            "device": torch.cuda.get_device_name(device), "driver": driver.strip() or "unknown",
            "runtime": torch.version.cuda,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_epoch(model, opt, scaler, loss_fn, x, y, batch, autocast, steps=None):
    """One shuffled pass (or `steps` steps) over x, y; returns (seconds, samples)."""
    n = x.shape[0]
    order = torch.randperm(n, device=x.device)
    count = n // batch if steps is None else steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(count):
        idx = order[(i * batch) % n:(i * batch) % n + batch]
        xb, yb = x[idx], y[idx]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            loss = loss_fn(model(xb), yb)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start, count * batch


def graph_step(model, opt, loss_fn, xs, ys, autocast):
    """The captured step: forward, loss, backward, Adam. float16 scales the
    loss by the fixed LOSS_SCALE and unscales the gradients before Adam, all
    on the GPU (no .item(), no inf check: nothing that waits for the host).
    No autocast cast cache, as torch.cuda.make_graphed_callables requires: each
    weight is cast once per step either way."""
    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast, cache_enabled=False):
        loss = loss_fn(model(xs), ys)
    if autocast:
        (loss * LOSS_SCALE).backward()
        for p in model.parameters():
            p.grad.mul_(1.0 / LOSS_SCALE)
    else:
        loss.backward()
    opt.step()
    return loss


def capture(model, opt, loss_fn, xs, ys, autocast, warmup=3):
    """PyTorch's whole-network recipe: a few eager steps on a side stream
    (cuDNN's autotuner, Adam's state, the allocator), then one step captured.
    Returns the graph and its static loss tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            graph_step(model, opt, loss_fn, xs, ys, autocast)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # backward in the graph allocates .grad from its pool
    with torch.cuda.graph(graph):
        loss = graph_step(model, opt, loss_fn, xs, ys, autocast)
    return graph, loss


def run_graph_epoch(graph, xs, ys, x, y, steps=None):
    """run_epoch with the step replayed: each batch gathered into xs, ys."""
    n, batch = x.shape[0], xs.shape[0]
    order = torch.randperm(n, device=x.device)
    whole = n // batch
    count = whole if steps is None else steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(count):
        idx = order[(i % whole) * batch:(i % whole + 1) * batch]
        torch.index_select(x, 0, idx, out=xs)
        torch.index_select(y, 0, idx, out=ys)
        graph.replay()
    torch.cuda.synchronize()
    return time.perf_counter() - start, count * batch


def measure(model_name, build, x, y, batch, autocast, graphs, args, compiled=False):
    """The runs of one row: [(seconds, samples)] of --repeat epochs after the
    warm-up, and the warm-up's seconds."""
    torch.manual_seed(42)
    model = build().to(x.device)
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    if not graphs:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
        scaler = make_scaler() if autocast else None
        step_model = torch.compile(model, mode=args.compile) if compiled else model
        warmup = run_epoch(step_model, opt, scaler, loss_fn, x, y, batch, autocast,
                           steps=args.warmup_steps)[0]
        return [run_epoch(step_model, opt, scaler, loss_fn, x, y, batch, autocast)
                for _ in range(args.repeat)], warmup
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7, capturable=True)
    xs, ys = x[:batch].clone(), y[:batch].clone()  # the static input and labels
    graph, loss = capture(model, opt, loss_fn, xs, ys, autocast)
    warmup = run_graph_epoch(graph, xs, ys, x, y, steps=args.warmup_steps)[0]
    runs = [run_graph_epoch(graph, xs, ys, x, y) for _ in range(args.repeat)]
    if not torch.isfinite(loss).item():  # after the timing: a fixed scale can overflow
        print(f"# {model_name} batch {batch}: the graph's last loss is {loss.item()}", flush=True)
    return runs, warmup


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all", choices=["mlp", "cnn", "all"])
    ap.add_argument("--batch-sizes", default="128,1024")
    ap.add_argument("--repeat", type=int, default=3, help="measured epochs; the median is reported")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 in the float32 runs")
    ap.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=True,
                    help="also the rows with the step in one CUDA graph (the default)")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="only the eager rows")
    ap.add_argument("--compile", default="none", metavar="MODE",
                    help="also rows through torch.compile(mode=MODE): default, reduce-overhead, "
                         "max-autotune, ...; none (the default) leaves them out")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("# torch_gpu_train: PyTorch sees no CUDA device; nothing measured")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    origin = provenance(device)
    print(f"# PyTorch {torch.__version__} on {name}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, TF32 {'on' if args.tf32 else 'off'}, "
          f"synthetic data on the GPU, median of {args.repeat}")
    print(f"# commit {origin['commit']}, {origin['arch']}, driver {origin['driver']}, "
          f"{origin['date']}")
    policies = [("float32", False, False, False), ("autocast_float16", True, False, False)]
    if args.cuda_graphs and hasattr(torch.cuda, "CUDAGraph"):
        policies += [("float32_graphs", False, True, False),
                     ("autocast_float16_graphs", True, True, False)]
        print("# *_graphs: the whole step in one CUDA graph replayed per batch; "
              f"autocast_float16_graphs has a FIXED loss scale {LOSS_SCALE:.0f}, no "
              "GradScaler (its inf check syncs with the host and cannot be captured)")
    elif args.cuda_graphs:
        print("# this PyTorch has no torch.cuda.CUDAGraph: no *_graphs rows")
    if args.compile != "none" and hasattr(torch, "compile"):
        policies += [("float32_compiled", False, False, True),
                     ("autocast_float16_compiled", True, False, True)]
        print(f"# *_compiled: torch.compile(model, mode={args.compile!r}); compile_seconds is "
              "the warm-up's time, compilation included")
    elif args.compile != "none":
        print("# this PyTorch has no torch.compile: no *_compiled rows")

    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    print("\n| model | policy | batch | samples | samples/s | min..max |")
    print("|---|---|---:|---:|---:|---:|")
    lines = []
    for model_name, build in (("mlp", mlp), ("cnn", cnn)):
        if args.model not in ("all", model_name):
            continue
        samples = SAMPLES[model_name]
        gen = torch.Generator(device=device).manual_seed(42)
        x = torch.rand(samples, 1, 28, 28, device=device, generator=gen)
        y = torch.randint(0, 10, (samples,), device=device, generator=gen)
        for batch in batches:
            for policy, autocast, graphs, compiled in policies:
                try:
                    runs, warmup = measure(model_name, build, x, y, batch, autocast, graphs, args,
                                           compiled)
                except Exception as e:  # noqa: BLE001  (a failed capture must not end the table)
                    if not graphs and not compiled:
                        raise
                    print(f"# {model_name} {policy} batch {batch}: "
                          f"{'compilation' if compiled else 'capture'} failed: "
                          f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
                    continue
                sps = [count / seconds for seconds, count in runs]
                med = statistics.median(sps)
                print(f"| {model_name} | {policy} | {batch} | {runs[0][1]} | {med:.0f} "
                      f"| {min(sps):.0f}..{max(sps):.0f} |", flush=True)
                row = dict(origin)
                row.update({
                    "bench": "cuda_train", "framework": "pytorch", "version": torch.__version__,
                    "device": name, "model": model_name, "policy": policy, "batch": batch,
                    "samples": runs[0][1], "data": "synthetic", "tf32": args.tf32,
                    "repeats": args.repeat, "samples_per_s": round(med, 1),
                    "samples_per_s_min": round(min(sps), 1),
                    "samples_per_s_max": round(max(sps), 1)})
                if graphs:
                    row["graphs"] = True
                if compiled:
                    row["compile_mode"] = args.compile
                    row["compile_seconds"] = round(warmup, 1)
                lines.append(json.dumps(row, separators=(",", ":")))
                torch.cuda.empty_cache()
    print()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch on the GPU: training samples/s of the seed MLP and the CNN, the
GPU twin of bench/bench_cuda.c's training table.

    python3 bench/torch_gpu_train.py                    # both models, batch 128 and 1024
    python3 bench/torch_gpu_train.py --model mlp --batch-sizes 128 --repeat 5

The models are bench/torch_train.py's (imported from it): the same
architectures as examples/mlp.c and examples/cnn.c, Adam (lr 1e-3, eps 1e-7
as Keras), CrossEntropyLoss on logits (the softmax fused into the loss, as
mpt.h's fit fuses it). Two policies:
  float32           TF32 off for matmuls and convolutions (mpt.h's float32
                    is true float32); --tf32 turns it on
  autocast_float16  torch.autocast("cuda", dtype=torch.float16) with a
                    GradScaler (dynamic loss scaling), float32 weights:
                    mpt.h's mixed_float16
The data is synthetic (uniform pixels, random labels), generated on the GPU
and resident there: nothing is read or downloaded. Each epoch draws a
random permutation on the GPU and gathers its batches from it. Sample counts
are whole batches, as bench_cuda's: mlp 59,392, cnn 25,600. After
--warmup-steps steps (cuDNN's autotuner, allocator, kernels), each measured
epoch is timed with torch.cuda.synchronize() on both ends; the median of
--repeat epochs is reported, with the min and max. Prints a Markdown table
and one JSON line per result.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import cnn, mlp  # noqa: E402  (the same models as the CPU comparison)

SAMPLES = {"mlp": 59392, "cnn": 25600}


def make_scaler():
    """A GradScaler: torch.amp's where it has one (torch.cuda.amp's is deprecated there)."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all", choices=["mlp", "cnn", "all"])
    ap.add_argument("--batch-sizes", default="128,1024")
    ap.add_argument("--repeat", type=int, default=3, help="measured epochs; the median is reported")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 in the float32 runs")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("# torch_gpu_train: PyTorch sees no CUDA device; nothing measured")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"# PyTorch {torch.__version__} on {name}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, TF32 {'on' if args.tf32 else 'off'}, "
          f"synthetic data on the GPU, median of {args.repeat}")

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
            for policy, autocast in (("float32", False), ("autocast_float16", True)):
                torch.manual_seed(42)
                model = build().to(device)
                model.train()
                opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
                scaler = make_scaler() if autocast else None
                loss_fn = nn.CrossEntropyLoss()
                run_epoch(model, opt, scaler, loss_fn, x, y, batch, autocast,
                          steps=args.warmup_steps)
                runs = [run_epoch(model, opt, scaler, loss_fn, x, y, batch, autocast)
                        for _ in range(args.repeat)]
                sps = [count / seconds for seconds, count in runs]
                med = statistics.median(sps)
                print(f"| {model_name} | {policy} | {batch} | {runs[0][1]} | {med:.0f} "
                      f"| {min(sps):.0f}..{max(sps):.0f} |", flush=True)
                lines.append(json.dumps({
                    "bench": "cuda_train", "framework": "pytorch", "version": torch.__version__,
                    "device": name, "model": model_name, "policy": policy, "batch": batch,
                    "samples": runs[0][1], "data": "synthetic", "tf32": args.tf32,
                    "repeats": args.repeat, "samples_per_s": round(med, 1),
                    "samples_per_s_min": round(min(sps), 1),
                    "samples_per_s_max": round(max(sps), 1)}, separators=(",", ":")))
                del model, opt, scaler
                torch.cuda.empty_cache()
    print()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

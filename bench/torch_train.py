#!/usr/bin/env python3
"""PyTorch twin of bench/bench_train.c: samples/s of one training epoch of the
seed MLP, the small CNN, the CNN and ResNet-20 on Fashion-MNIST on the CPU,
for comparison with mpt.h.

    /usr/bin/python3 bench/torch_train.py                 # mlp, cnn_small, cnn; float32
    /usr/bin/python3 bench/torch_train.py --model mlp --repeat 3 --bf16
    /usr/bin/python3 bench/torch_train.py --model resnet --bf16

Same models, data, batch size (128), optimizer (Adam, lr 1e-3, eps 1e-7 as
Keras), loss (CrossEntropyLoss on logits: the softmax fused into the loss, as
mpt.h's fit fuses it), shuffling every epoch, and thread count
(torch.set_num_threads(2), one inter-op thread). The MLP trains on all
60,000 training images, the small CNN on the first 12,800, the CNN and
ResNet-20 on the first 6,400, as bench_train does.
Each measured epoch follows a warm-up pass over the first 1,280 images.

The time per step is split as bench_train splits it: forward = the model and
the loss, backward = loss.backward(), update = optimizer.step() (with
zero_grad(set_to_none=True) before the forward, counted in "other", with
batching the data). The data is a float32 tensor in memory (/255 once), and
a batch is gathered by indexing with the epoch's permutation.

--bf16 also measures torch.autocast("cpu", dtype=torch.bfloat16) where the
installed torch supports it (the model's weights stay float32, as mpt.h's
mixed_bfloat16). Prints a Markdown table and one JSON line per result.

ResNet-20 runs channels last (torch.channels_last: the weights, and each
batch of images, so oneDNN's convolutions take and give NHWC without
reordering); --memory-format contiguous runs it NCHW instead. The other
models stay NCHW, as they were measured.
"""
import math
import os
import re
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import train_peers  # the command line and output bench/tf_train.py shares
from idx_data import find, read_idx  # the IDX reader bench/tf_train.py shares


def load_train(data_dir):
    x = read_idx(find(data_dir, "train-images-idx3-ubyte"))
    y = read_idx(find(data_dir, "train-labels-idx1-ubyte"))
    x = torch.from_numpy(x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)  # NCHW
    y = torch.from_numpy(y.astype(np.int64))
    return x, y


def mlp():
    """Flatten -> Dense(1024, relu) -> Dense(10) (softmax fused into the loss)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10))


def cnn_small():
    """examples/cnn_small.c: Conv2D(32, 3, relu) -> MaxPool(2) -> Flatten ->
    Dense(128, relu) -> Dense(10)."""
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 13 * 13, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn():
    """examples/cnn.c. Keras' BatchNormalization: momentum 0.99 (PyTorch's
    momentum is 1 - that), epsilon 1e-3."""
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3), nn.ReLU(), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
                nn.Conv2d(cout, cout, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25)]
    return nn.Sequential(*block(1, 32), *block(32, 64), nn.Flatten(),
                         nn.Linear(64 * 4 * 4, 512), nn.ReLU(),
                         nn.BatchNorm1d(512, eps=1e-3, momentum=0.01), nn.Dropout(0.5),
                         nn.Linear(512, 10))


def he_normal_(weight):
    """Keras' he_normal: a normal of stddev sqrt(2 / fan_in) truncated at two
    standard deviations (the stddev corrected for the truncation)."""
    fan_in = weight[0].numel()
    std = math.sqrt(2.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(weight, 0.0, std, -2 * std, 2 * std)


def conv_bn(cin, cout, size, stride):
    """Conv2D(cout, size, stride, same, no bias, he_normal) -> BatchNormalization
    (Keras' defaults). Keras' "same" pads a stride-2 convolution of an even
    image by one at the bottom and right only; padding=size // 2 pads both
    sides and gives the same output size."""
    conv = nn.Conv2d(cin, cout, size, stride=stride, padding=size // 2, bias=False)
    he_normal_(conv.weight)
    return nn.Sequential(conv, nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01))


class BasicBlock(nn.Module):
    """Conv -> BN -> ReLU -> Conv -> BN, plus the shortcut (a 1×1 Conv + BN
    where the block has stride 2), then ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.first = conv_bn(cin, cout, 3, stride)
        self.second = conv_bn(cout, cout, 3, 1)
        self.shortcut = conv_bn(cin, cout, 1, stride) if stride != 1 else nn.Identity()
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.second(self.relu(self.first(x)))
        return self.relu(y + self.shortcut(x))


def resnet():
    """examples/resnet20.h's ResNet-20: Conv2D(16, 3, same, no bias) -> BN ->
    ReLU, 3 stages of 3 basic blocks (16, 32, 64 filters; the first block of
    stages 2 and 3 with stride 2), global average pooling, Dense(10)."""
    stack = [conv_bn(1, 16, 3, 1), nn.ReLU()]
    cin = 16
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            stack.append(BasicBlock(cin, filters, 2 if stage > 0 and block == 0 else 1))
            cin = filters
    return nn.Sequential(*stack, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def epoch(model, opt, loss_fn, x, y, batch, autocast, generator, memory_format):
    """One shuffled epoch; returns (seconds, forward, backward, update seconds, steps)."""
    n = x.shape[0]
    order = torch.randperm(n, generator=generator)
    fwd = bwd = upd = 0.0
    steps = 0
    total = 0.0
    start = time.perf_counter()
    for i in range(0, n, batch):
        idx = order[i:i + batch]
        xb, yb = x[idx].contiguous(memory_format=memory_format), y[idx]
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = loss_fn(model(xb), yb)
        else:
            loss = loss_fn(model(xb), yb)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        total += loss.item()
        fwd += t1 - t0
        bwd += t2 - t1
        upd += t3 - t2
        steps += 1
    return time.perf_counter() - start, fwd, bwd, upd, steps


def blas_info():
    try:
        cfg = torch.__config__.show()
    except Exception:  # noqa: BLE001 - older or stripped builds
        return "?"
    m = re.search(r"BLAS_INFO=([^,\s]+)", cfg)
    info = m.group(1) if m else "?"
    if "MKL-DNN" in cfg or "oneDNN" in cfg:
        info += "+onednn"
    # Debian's torch says BLAS_INFO=generic and calls libblas.so.3, which is
    # OpenBLAS where libopenblas0-pthread or -openmp is installed (the system's
    # alternative, or LD_LIBRARY_PATH's); name the files actually mapped.
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f
                     if "blas" in line.lower() and line.split()[-1].startswith("/")}
        loaded = sorted(os.path.realpath(p) for p in paths)
        if loaded:
            info += " (" + ", ".join(loaded) + ")"
    except OSError:
        pass
    return info


def matmul_gflops():
    """A 1024³ float32 matmul's GFLOP/s: tells a fast BLAS from the reference one."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 1024 ** 3 / best / 1e9


def main():
    def options(ap):
        ap.add_argument("--config", default=None,
                        help="how the caller set PyTorch up (BLAS, environment), for the JSON lines")
        ap.add_argument("--memory-format", default="channels_last",
                        choices=["channels_last", "contiguous"],
                        help="ResNet-20's layout (the other models run contiguous, NCHW)")

    args = train_peers.parse_args(__doc__.split("\n")[0], "also bfloat16 autocast, if supported",
                                  options)

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(42)
    x, y = load_train(args.data)
    blas = blas_info()
    gflops = matmul_gflops()
    # How idle OpenMP threads wait decides a lot on a shared host: libgomp's
    # default spins, and spinning threads starve the working ones when other
    # processes hold cores. compare.sh tries both settings.
    config = args.config or "omp_wait=" + os.environ.get("OMP_WAIT_POLICY", "default").lower()
    print(f"# PyTorch {torch.__version__} ({blas}), {torch.get_num_threads()} threads, "
          f"batch {args.batch_size}, {config}, 1024^3 matmul {gflops:.1f} GFLOP/s, "
          f"python {sys.version.split()[0]}")

    policies = [("float32", None)]
    if args.bf16:
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.ones(2, 2) @ torch.ones(2, 2)
            policies.append(("autocast_bfloat16", torch.bfloat16))
        except Exception as e:  # noqa: BLE001
            print(f"# bfloat16 autocast unsupported: {e}")

    train_peers.table_header(("forward ms", "backward ms", "update ms", "other ms"))
    framework = {"framework": "pytorch", "version": torch.__version__, "blas": blas,
                 "config": config, "matmul_gflops": round(gflops, 1)}
    lines = []
    for name, build, samples in train_peers.selected_models(
            args, {"mlp": mlp, "cnn_small": cnn_small, "cnn": cnn, "resnet": resnet}):
        xs, ys = x[:samples], y[:samples]
        layout = args.memory_format if name == "resnet" else "contiguous"
        memory_format = getattr(torch, f"{layout}_format" if layout == "contiguous" else layout)
        for policy, dtype in policies:
            torch.manual_seed(42)
            gen = torch.Generator().manual_seed(42)
            model = build().to(memory_format=memory_format)
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
            loss_fn = nn.CrossEntropyLoss()
            epoch(model, opt, loss_fn, x[:args.warmup_samples], y[:args.warmup_samples],
                  args.batch_size, dtype, gen, memory_format)
            runs = [epoch(model, opt, loss_fn, xs, ys, args.batch_size, dtype, gen, memory_format)
                    for _ in range(args.repeat)]
            rate = train_peers.rates(samples, [r[0] for r in runs])
            med = lambda k: statistics.median(1e3 * r[k] / r[4] for r in runs)  # noqa: E731
            other = statistics.median(1e3 * (r[0] - r[1] - r[2] - r[3]) / r[4] for r in runs)
            step_ms = (med(1), med(2), med(3), other)
            train_peers.table_row(name, policy, rate, [f"{ms:.2f}" for ms in step_ms])
            lines.append(train_peers.result_line({**framework, "memory_format": layout}, name,
                                                 policy, torch.get_num_threads(),
                                                 args.batch_size, samples, args.repeat, rate,
                                                 step_ms))
    train_peers.print_lines(lines)


if __name__ == "__main__":
    main()

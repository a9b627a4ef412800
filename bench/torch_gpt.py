#!/usr/bin/env python3
"""PyTorch twin of examples/gpt.c: training tokens/s and validation loss of the
same character-level GPT on the CPU, for comparison with mpt.h.

    /usr/bin/python3 bench/torch_gpt.py                       # float32, 40 steps
    /usr/bin/python3 bench/torch_gpt.py --policy autocast_bfloat16 --steps 40 --timed-steps 20
    /usr/bin/python3 bench/torch_gpt.py --data FILE --eval 0

The model, as gpt.c builds it:
    Embedding(256, 256) + a learned position embedding (128, 256)
    4 blocks, pre-LayerNorm (eps 1e-5):
        x = x + out(causal attention of 4 heads of 64 over q, k, v of LN(x))
        x = x + Linear(1024 -> 256)(GELU(Linear(256 -> 1024)(LN(x))))   exact GELU
    -> LayerNorm -> Linear(256 -> 256) logits, cross-entropy over every position.
Every projection has a bias. Keras' MultiHeadAttention keeps q, k and v as three
kernels; here they are one Linear(256 -> 768), the same products in one GEMM
(PyTorch's fastest form of the same model). GPT-2's initialisation: weights and
embeddings N(0, 0.02²), biases 0, LayerNorm weight 1 and bias 0.
AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-7 (Keras' and mpt.h's default),
weight decay 0.1 on the 2-D weights and both embeddings, none on biases and
LayerNorm parameters (PyTorch's AdamW decays as Keras does: w -= lr·wd·w),
its multi-tensor (foreach) form.
No dropout.

Data: gpt.c's. The text is every file of /usr/share/games/fortunes but the .dat
indexes and the .u8 links, in name order (or --data FILE); the first
int(size · 0.9) bytes train, the rest validate. A training batch is 32
windows of 129 bytes at random starts (inputs the first 128, targets the
last 128); the validation loss reads the tail's windows back to back (starts
0, 128, 256, ... of the tail), each byte once, as mpt.h's text dataset does,
and averages over every position (nats per byte).

Timing: --steps optimizer steps in all; the last --timed-steps of them are
timed (batch gathering, forward, loss, backward, update: what fit's
samples/s covers), so the steps before warm the caches and allocator, as
gpt.c's last epoch follows its first. tokens_per_s = timed steps × batch ×
128 / their seconds. Attention: F.scaled_dot_product_attention(is_causal=True)
where this torch has it (2.0 and later), else the explicit masked softmax.

Threads: torch.set_num_threads(--threads), one inter-op thread. bfloat16:
torch.autocast("cpu", dtype=torch.bfloat16) around the forward and the loss,
the weights and the optimizer in float32 (mpt.h's mixed_bfloat16 keeps
float32 weights too). Prints one JSON line like gpt.c's.
"""
import json
import math
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_text import (  # noqa: E402  (shared with tf_gpt.py)
    arguments, cut, parse, rate_factor, read_text, run_steps, schedule_fields)

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 256, 128, 256, 4, 4


# ---- the text ----------------------------------------------------------------------

def split(text):
    """(train, validation) as uint8 tensors (gpt_text.cut)."""
    train, val = cut(text)
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8),
            torch.frombuffer(bytearray(val), dtype=torch.uint8))


def train_batch(train, batch, generator):
    """batch windows at random starts: inputs (B, T) and targets (B, T), int64."""
    starts = torch.randint(0, train.numel() - CONTEXT, (batch,), generator=generator)
    xy = train[starts[:, None] + torch.arange(CONTEXT + 1)].long()  # (B, T + 1)
    return xy[:, :-1], xy[:, 1:]


# ---- the model -----------------------------------------------------------------------

class Attention(nn.Module):
    """Causal multi-head attention: q, k, v, softmax(q k^T / sqrt(64)) v, output."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)   # q, k, v kernels side by side
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1),
                             persistent=False)
        self.sdpa = getattr(F, "scaled_dot_product_attention", None)

    def forward(self, x):                        # (B, T, C)
        b, t, c = x.shape
        d = c // HEADS
        q, k, v = self.qkv(x).split(WIDTH, dim=2)
        if self.sdpa is not None:
            q, k, v = (z.view(b, t, HEADS, d).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
            y = self.sdpa(q, k, v, is_causal=True).transpose(1, 2)
        else:
            # Heads as one batch of contiguous (T, D) matrices for bmm: torch
            # 1.13's 4-D matmul over the transposed views is slower here.
            q, k, v = (z.view(b, t, HEADS, d).transpose(1, 2).reshape(b * HEADS, t, d)
                       for z in (q, k, v))       # (B·H, T, D)
            scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))  # (B·H, T, T)
            scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
            y = torch.bmm(scores.softmax(dim=-1), v).view(b, HEADS, t, d).transpose(1, 2)
        return self.out(y.reshape(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH, eps=1e-5)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(WIDTH, eps=1e-5)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.gelu = nn.GELU()                    # exact (erf), as mpt.h's gelu
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(self.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.empty(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, eps=1e-5)
        self.head = nn.Linear(WIDTH, VOCAB)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.startswith("ln") or ".ln" in name:
                continue                          # LayerNorm keeps 1 and 0
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            else:
                nn.init.zeros_(p)

    def forward(self, idx, targets):             # (B, T) each
        x = self.tokens(idx) + self.positions[:idx.shape[1]]  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))         # (B, T, VOCAB)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def optimizer(model, lr, weight_decay):
    """AdamW with decay on the matrices and embeddings, none on biases and LayerNorm."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.999), eps=1e-7,
                             foreach=True)        # one pass over all tensors per op


@torch.no_grad()
def evaluate(model, val, batch, autocast):
    """Mean loss over the validation windows laid back to back (nats per byte)."""
    n = (val.numel() - 1) // CONTEXT
    total = 0.0
    for i in range(0, n, batch):
        starts = torch.arange(i, min(i + batch, n)) * CONTEXT
        xy = val[starts[:, None] + torch.arange(CONTEXT + 1)].long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total += model(xy[:, :-1], xy[:, 1:]).item() * starts.numel()
    return total / n


# ---- main ------------------------------------------------------------------------------

def main():
    ap = arguments(__doc__.split("\n")[0], ("float32", "autocast_bfloat16"))
    ap.add_argument("--config", default=None,
                    help="how the caller set PyTorch up (BLAS, environment), for the JSON line")
    args = parse(ap)

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)
    text = read_text(args.data)
    train, val = split(text)
    model = GPT()
    model.train()
    opt = optimizer(model, 1e-3, 0.1)
    # LambdaLR's t is the scheduler steps taken: one after each optimizer step
    rates = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: rate_factor(args, t))
    autocast = args.policy == "autocast_bfloat16"
    attention = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "masked_softmax"
    params = sum(p.numel() for p in model.parameters())
    print(f"# PyTorch {torch.__version__}, {torch.get_num_threads()} threads, {args.policy}, "
          f"attention {attention}, {params:,} parameters, text {len(text):,} bytes "
          f"({train.numel():,} train), python {sys.version.split()[0]}", flush=True)

    gen = torch.Generator().manual_seed(args.seed)

    def step():
        x, y = train_batch(train, args.batch_size, gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        rates.step()
        return loss.item()

    losses, timed_s, seconds = run_steps(args, step)
    tokens_per_s = args.timed_steps * args.batch_size * CONTEXT / seconds
    val_loss = evaluate(model, val, args.batch_size, autocast) if args.eval else None
    line = {"model": "gpt", "framework": "pytorch", "version": torch.__version__,
            "policy": args.policy, "steps": args.steps, "timed_steps": args.timed_steps,
            "batch_size": args.batch_size, "context": CONTEXT,
            "threads": torch.get_num_threads(), "attention": attention, "params": params,
            "tokens_per_s": round(tokens_per_s),
            "step_ms": round(1e3 * statistics.median(timed_s), 1),
            "train_loss": round(losses[-1], 4),
            "val_loss": None if val_loss is None else round(val_loss, 4),
            "bits_per_char": None if val_loss is None else round(val_loss / math.log(2), 4),
            **schedule_fields(args)}
    if args.config:
        line["config"] = args.config
    print(json.dumps(line, separators=(",", ":")))


if __name__ == "__main__":
    main()

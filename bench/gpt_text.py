"""examples/gpt.c's text for its Python twins (bench/torch_gpt.py, bench/tf_gpt.py):
the fortunes' files in name order, cut as mpt.h's text dataset cuts them."""
import argparse
import math
import os
import time

FORTUNES = "/usr/share/games/fortunes"


def read_fortunes():
    """gpt.c's default text: every file of the fortunes but the .dat indexes
    and the .u8 links, in name (byte) order, one after another."""
    names = sorted(n for n in os.listdir(os.fsencode(FORTUNES))
                   if not n.startswith(b".") and not n.endswith(b".dat")
                   and not n.endswith(b".u8"))
    parts = []
    for n in names:
        with open(os.path.join(os.fsencode(FORTUNES), n), "rb") as f:
            parts.append(f.read())
    return b"".join(parts)


def read_text(path):
    """The text a run trains on: the file at path, or the fortunes (None)."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    return read_fortunes()


def cut(text):
    """(train, validation) bytes: mpt.h's cut, int(size · (1 - 0.1))."""
    at = int(len(text) * (1.0 - 0.1))
    return text[:at], text[at:]


def arguments(description, policies):
    """The flags both twins take (gpt.c's run, their precisions as policies);
    a twin adds its own, then calls parse."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data", default=None, help="a text file (default: the fortunes)")
    ap.add_argument("--policy", default=policies[0], choices=policies)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    ap.add_argument("--timed-steps", type=int, default=20, help="the last steps, timed")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval", type=int, default=1, help="0: no validation loss")
    ap.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up (gpt.c's)")
    ap.add_argument("--cosine", type=float, default=None, metavar="ALPHA",
                    help="a cosine decay to ALPHA·lr over the steps after the warm-up")
    return ap


def rate_factor(args, t):
    """The learning rate at optimizer step t (steps taken so far) as a
    fraction of the base rate: mpt_lr_schedule's rule, which gpt.c's
    --warmup and --cosine set (a linear warm-up (t + 1)/W over the first
    W steps, then a cosine decay to alpha over the remaining steps, Keras'
    CosineDecay); 1 for neither."""
    w = args.warmup
    if t < w:
        return (t + 1) / w
    if args.cosine is None:
        return 1.0
    d = args.steps - w
    progress = min(t - w, d) / d
    return (1 - args.cosine) * 0.5 * (1 + math.cos(math.pi * progress)) + args.cosine


def schedule_fields(args):
    """The JSON line's fields for a schedule, as gpt.c prints them (none
    for a constant rate)."""
    if not args.warmup and args.cosine is None:
        return {}
    return {"warmup": args.warmup, "cosine": -1 if args.cosine is None else args.cosine}


def run_steps(args, step):
    """Runs step() (one optimizer step, returning its loss as a float)
    args.steps times: (the losses, the timed steps' seconds each, the seconds
    of the last args.timed_steps together)."""
    losses, step_s = [], []
    first_timed = args.steps - args.timed_steps
    start = None
    for i in range(args.steps):
        if i == first_timed:
            start = time.perf_counter()
        t0 = time.perf_counter()
        losses.append(step())
        step_s.append(time.perf_counter() - t0)
    return losses, step_s[first_timed:], time.perf_counter() - start


def parse(ap):
    """The flags, the timed steps checked."""
    args = ap.parse_args()
    if not 0 < args.timed_steps <= args.steps:
        ap.error("--timed-steps must be in 1..--steps")
    if args.warmup < 0 or (args.cosine is not None and
                           (not 0 <= args.cosine <= 1 or args.warmup >= args.steps)):
        ap.error("--warmup must be >= 0, --cosine in 0..1 with a step after the warm-up")
    return args

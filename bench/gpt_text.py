"""examples/gpt.c's text for its Python twins (bench/torch_gpt.py, bench/tf_gpt.py):
the fortunes' files in name order, cut as mpt.h's text dataset cuts them."""
import argparse
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
    return ap


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
    return args

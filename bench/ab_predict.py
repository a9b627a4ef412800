"""Two builds of bench_predict side by side: each started once in --serve
mode on the same weights, then asked in turn (the order swapped every
round, so a shared host's load falls on both alike) for REPS predicts of
each variant at batch 1 and at --batch-size. Prints one JSON line per
variant and batch: each build's median over rounds of its per-round median,
and the median over rounds of old/new (above 1: the new build is faster)
with its range over rounds.

    gcc -std=c99 -O2 -I. bench/bench_predict.c -o build/bp_new -lpthread -lm -lz
    (the same at the older commit into build/bp_old)
    python3 bench/ab_predict.py build/bp_old build/bp_new --model cnn_small \\
        --weights build/cnn_small_deploybench.safetensors [--rounds 5]
        [--reps1 300] [--reps 30] [--batch-size 128]
"""
import argparse
import json
import statistics
import subprocess

VARIANTS = ["float32", "float16", "dynamic_int8", "full_int8"]


def start(binary, args):
    cmd = [binary, "--model", args.model, "--batch-size", str(args.batch_size), "--serve"]
    if args.weights:
        cmd += ["--weights", args.weights]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def ask(proc, variant, batch, reps):
    proc.stdin.write(f"{variant} {batch} {reps}\n")
    proc.stdin.flush()
    times = [float(t) for t in proc.stdout.readline().split()]
    return None if times == [-1.0] else statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--model", default="mlp")
    p.add_argument("--weights")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps1", type=int, default=300)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    procs = {"old": start(args.old, args), "new": start(args.new, args)}
    cells = [(v, b) for v in VARIANTS for b in (1, args.batch_size)]
    got = {(v, b, w): [] for v, b in cells for w in procs}
    for r in range(args.rounds):
        for v, b in cells:
            order = ["old", "new"] if (r % 2 == 0) else ["new", "old"]
            for w in order:
                got[(v, b, w)].append(ask(procs[w], v, b, args.reps1 if b == 1 else args.reps))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    for v, b in cells:
        old, new = got[(v, b, "old")], got[(v, b, "new")]
        if None in old or None in new:
            continue
        ratios = [o / n for o, n in zip(old, new)]
        print(json.dumps({"bench": "ab_predict", "model": args.model, "variant": v, "batch": b,
                          "rounds": args.rounds, "calls_per_round": args.reps1 if b == 1 else args.reps,
                          "old_median_ms": round(1e3 * statistics.median(old), 4),
                          "new_median_ms": round(1e3 * statistics.median(new), 4),
                          "old_over_new": round(statistics.median(ratios), 3),
                          "old_over_new_range": [round(min(ratios), 3), round(max(ratios), 3)]}))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# mpt.h against PyTorch on the CPU: the same models, data, batch size and
# thread count, run back to back, and the samples/s ratios mpt/pytorch.
#
#   bench/compare_torch.sh                      # MLP, 2 threads, 3 rounds
#   bench/compare_torch.sh --model all --rounds 2 --threads 2 --batch-size 128
#   bench/compare_torch.sh --rounds 5 --quiet-wait 120   # on a shared host
#
# Each round runs build/bench_train (every policy) and bench/torch_train.py
# (float32 with libgomp's default OpenMP wait policy; float32 and bfloat16
# autocast, where supported, with OMP_WAIT_POLICY=PASSIVE), alternating which
# goes first, so that a noisy host hurts both sides alike. For each
# result it prints the median samples/s over the rounds with the min..max,
# then one JSON line per ratio:
#   float32_vs_float32  mpt float32 / PyTorch float32
#   best_vs_float32     mpt's fastest policy / PyTorch float32
#   best_vs_best        mpt's fastest policy / PyTorch's fastest (bfloat16 autocast
#                       where the installed torch has it)
# from the medians over the rounds ("ratio"), from the best runs
# ("ratio_best": interference only ever slows a run down), and round by round
# ("ratio_per_round": runs adjacent in time, so under similar load). PyTorch
# is taken with the faster of its two OpenMP wait settings (see run_torch).
# The target is >= 1.5 for the MLP (the "met" field: float32 PyTorch, medians).
#
# PyTorch is Debian's python3-torch run by /usr/bin/python3 with
# libopenblas0-pthread (without it, Debian's torch calls the reference BLAS);
# TORCH_PYTHON=/path/to/python selects another interpreter (e.g. a venv with
# PyPI's wheel). As root, missing Debian packages are installed first.
# Raw JSON lines are kept in build/compare/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

ROUNDS=3
THREADS=2
BATCH=128
MODEL=mlp
QUIET_WAIT=0
PY=${TORCH_PYTHON:-/usr/bin/python3}
while [ $# -gt 0 ]; do
    case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --quiet-wait) QUIET_WAIT=$2; shift 2 ;;
    *) echo "usage: $0 [--model mlp|cnn|all] [--rounds N] [--threads N] [--batch-size N]" \
            "[--quiet-wait SECONDS]" >&2
       exit 2 ;;
    esac
done

# ---- what it needs ------------------------------------------------------------
need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)
pkgs="zlib1g-dev"
[ "$PY" = /usr/bin/python3 ] && pkgs="$pkgs python3 python3-numpy python3-torch libopenblas0-pthread"
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "compare_torch.sh: installing ${need[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }; then
            echo "compare_torch.sh: apt-get install failed" >&2
            exit 1
        fi
    else
        echo "compare_torch.sh: missing packages: ${need[*]} (run as root to install them)" >&2
        exit 1
    fi
fi

mkdir -p build build/compare
gcc -std=c99 -O2 -I. bench/bench_train.c -o build/bench_train -lpthread -lm -lz ||
    { echo "compare_torch.sh: bench_train does not build" >&2; exit 1; }

# ---- the rounds ------------------------------------------------------------------
# The host may be shared: each run records how many cores other processes
# kept busy meanwhile ("others_cores", from /proc/stat less this script's
# children), and with --quiet-wait S a run first waits up to S seconds for
# the other processes to use less than a quarter of a core.
log=build/compare/results.jsonl
: >"$log"
busy_jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# user + system seconds of this shell's finished children, from `times` run
# in this shell (a $(...) subshell would count its own children only)
children_cpu() {
    times >build/compare/times.txt
    awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] }
                   print t }' build/compare/times.txt
}
now() { date +%s.%N; }
others_cores() { # busy0 busy1 self0 self1 wall0 wall1 (HZ = getconf CLK_TCK)
    awk -v b0="$1" -v b1="$2" -v s0="$3" -v s1="$4" -v w0="$5" -v w1="$6" -v hz="$HZ" \
        'BEGIN { o = ((b1 - b0) / hz - (s1 - s0)) / (w1 - w0); printf "%.2f", o < 0 ? 0 : o }'
}
HZ=$(getconf CLK_TCK 2>/dev/null || echo 100)
wait_quiet() {
    local waited=0 b0 b1 busy='?'
    while [ "$waited" -lt "$QUIET_WAIT" ]; do
        b0=$(busy_jiffies); sleep 2; b1=$(busy_jiffies)
        busy=$(awk -v a="$b0" -v b="$b1" -v hz="$HZ" 'BEGIN { printf "%.2f", (b - a) / hz / 2 }')
        awk -v x="$busy" 'BEGIN { exit !(x < 0.25) }' && return 0
        waited=$((waited + 2))
    done
    [ "$QUIET_WAIT" -gt 0 ] && echo "# (the host stayed busy: $busy cores in use after waiting ${QUIET_WAIT}s)"
}
# measure NAME ROUND COMMAND...: runs it, keeps its JSON lines with the round
# and others_cores added.
measure() {
    local name=$1 round=$2 out b0 b1 s0 s1 w0 w1 oc
    shift 2
    out=build/compare/${name}_$round.txt
    wait_quiet
    echo "## round $round: $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    children_cpu >build/compare/self.txt; s0=$(cat build/compare/self.txt)
    b0=$(busy_jiffies); w0=$(now)
    "$@" | tee "$out"
    b1=$(busy_jiffies); w1=$(now)
    children_cpu >build/compare/self.txt; s1=$(cat build/compare/self.txt)
    oc=$(others_cores "$b0" "$b1" "$s0" "$s1" "$w0" "$w1")
    echo "# other processes kept $oc cores busy during this run"
    grep '^{' "$out" | sed "s/}\$/,\"round\":$round,\"others_cores\":$oc}/" >>"$log"
}
run_mpt() {
    measure mpt "$1" ./build/bench_train --model "$MODEL" --threads "$THREADS" --batch-size "$BATCH"
}
# PyTorch twice: libgomp's default (idle threads spin) and OMP_WAIT_POLICY=
# PASSIVE (they sleep), which is much faster whenever other processes hold
# cores; the ratios take whichever is faster. bfloat16 autocast with the
# passive setting only, to keep a round short.
run_torch() {
    measure pytorch "$1" "$PY" bench/torch_train.py --model "$MODEL" --threads "$THREADS" \
        --batch-size "$BATCH"
    OMP_WAIT_POLICY=PASSIVE measure pytorch_passive "$1" "$PY" bench/torch_train.py \
        --model "$MODEL" --threads "$THREADS" --batch-size "$BATCH" --bf16
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then run_mpt "$r"; run_torch "$r"; else run_torch "$r"; run_mpt "$r"; fi
    echo
done

# ---- the summary --------------------------------------------------------------------
"$PY" - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
groups = {}
for r in rows:
    fw = r["framework"] + (" " + r["config"] if "config" in r else "")
    groups.setdefault((r["model"], fw, r["policy"]), []).append(r)
print("| model | framework | policy | samples/s (median) | min..max | runs "
      "| forward ms | backward ms | update ms | other ms | others' cores |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
med = {}
for (model, fw, policy), rs in sorted(groups.items()):
    s = [r["samples_per_s"] for r in rs]
    m = lambda k: statistics.median(r[k] for r in rs)
    med[(model, fw, policy)] = (statistics.median(s), max(s))
    print(f"| {model} | {fw} | {policy} | {statistics.median(s):.0f} | {min(s):.0f}..{max(s):.0f} "
          f"| {len(s)} | {m('forward_ms'):.2f} | {m('backward_ms'):.2f} | {m('update_ms'):.2f} "
          f"| {m('other_ms'):.2f} | {m('others_cores'):.2f} |")
print()
def per_round(model, fw_is, policy):
    """{round: samples/s} of one result, keeping the faster PyTorch setting."""
    out = {}
    for r in rows:
        if r["model"] == model and fw_is(r) and r["policy"] == policy:
            out[r["round"]] = max(out.get(r["round"], 0), r["samples_per_s"])
    return out

for model in ("mlp", "cnn"):
    torch_rows = {(fw, p): v for (mo, fw, p), v in med.items()
                  if mo == model and fw.startswith("pytorch")}
    mpt = {p: v for (mo, fw, p), v in med.items() if mo == model and fw == "mpt"}
    if not torch_rows or not mpt:
        continue
    best = max(mpt, key=lambda p: mpt[p][0])
    torch_best = max(torch_rows, key=lambda k: torch_rows[k][0])
    torch32 = [k for k in torch_rows if k[1] == "float32"]
    torch32 = max(torch32, key=lambda k: torch_rows[k][0]) if torch32 else torch_best
    for label, policy, base_key in (("float32_vs_float32", "float32", torch32),
                                    ("best_vs_float32", best, torch32),
                                    ("best_vs_best", best, torch_best)):
        if policy not in mpt:
            continue
        base = torch_rows[base_key]
        # each round's mpt run against the same round's PyTorch run (the
        # faster OpenMP setting): adjacent in time, so under similar load
        a = per_round(model, lambda r: r["framework"] == "mpt", policy)
        b = per_round(model, lambda r: r["framework"] == "pytorch", base_key[1])
        paired = [a[k] / b[k] for k in sorted(a) if k in b and b[k] > 0]
        line = {"bench": "train_ratio", "model": model, "comparison": label,
                "mpt_policy": policy, "pytorch": base_key[0] + " " + base_key[1],
                "mpt_samples_per_s": round(mpt[policy][0], 1),
                "pytorch_samples_per_s": round(base[0], 1),
                "ratio": round(mpt[policy][0] / base[0], 3),
                "ratio_best": round(mpt[policy][1] / base[1], 3),
                "ratio_per_round": [round(x, 3) for x in paired]}
        if model == "mlp":
            line.update(target=1.5, met=bool(mpt[policy][0] / base[0] >= 1.5))
        print(json.dumps(line, separators=(",", ":")))
PY

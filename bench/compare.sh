#!/usr/bin/env bash
# mpt.h against TensorFlow and PyTorch on the CPU: the same models, data,
# batch size, optimizer and thread count, run interleaved, and the samples/s
# ratio of mpt.h to the fastest peer at equal precision.
#
#   bench/compare.sh                               # mlp, cnn_small, cnn; 3 rounds, 2 threads
#   bench/compare.sh --model mlp --rounds 5
#   bench/compare.sh --model resnet --rounds 3     # ResNet-20 (~6 min a round on 2 cores)
#   bench/compare.sh --rounds 5 --quiet-wait 120   # on a shared host
#
# Models: mlp (examples/mlp.c), cnn_small (examples/cnn_small.c), cnn
# (examples/cnn.c) and resnet (examples/resnet.c's ResNet-20,
# examples/resnet20.h), Fashion-MNIST, batch 128, Adam; each measured epoch
# runs the same number of steps in all three after a warm-up fit (mlp 469
# steps, cnn_small 100, cnn 50, resnet 50). --model all is the first three,
# as in bench_train: a round of resnet takes longer than the three together.
# Each round runs, per model, build/bench_train
# (every policy), bench/tf_train.py (float32, mixed_bfloat16) and
# bench/torch_train.py (float32, bfloat16 autocast), rotating which goes
# first, so that a noisy host hurts all of them alike.
#
# What it installs when missing (as root; otherwise it says what is missing):
#   - Debian's python3-torch (1.13) with OpenBLAS, both its pthread and its
#     OpenMP build (libopenblas0-pthread, libopenblas0-openmp), python3-numpy;
#   - TensorFlow 2.21 from PyPI (tensorflow-cpu==2.21.*, or $TF_SPEC) in a
#     virtual environment, build/venv-peers (not as root: pip only).
# The library and its tests need none of this.
#
# The peers get their fastest configuration:
#   - TensorFlow: intra-op threads 2, inter-op 1, oneDNN as the wheel ships it,
#     data from tf.data with prefetching, images NHWC (Keras' CPU layout).
#   - PyTorch: OpenBLAS with the core type the CPU has (OPENBLAS_CORETYPE=
#     SkylakeX with AVX-512, Haswell with AVX2; the environment may preset a
#     slower one), glibc's malloc thresholds fixed (MALLOC_MMAP_THRESHOLD_,
#     MALLOC_TRIM_THRESHOLD_: otherwise the large activations are mmap'ed and
#     unmapped every step and page faults dominate), and whichever of OpenBLAS's
#     OpenMP or pthread build and of libgomp's wait policies (default: idle
#     threads spin; OMP_WAIT_POLICY=PASSIVE: they sleep) is fastest here: a
#     short probe before the rounds tries the four and keeps the fastest (it
#     trains the MLP, or ResNet-20 for --model resnet alone; the
#     OpenBLAS build is picked with LD_LIBRARY_PATH; the system's alternative
#     is left alone). The header says which it used. ResNet-20 runs
#     channels last (torch.channels_last: oneDNN's convolutions without
#     reorders; in a short run here 206 against 160 samples/s NCHW in
#     float32, 205 against 178 in bfloat16), the other models NCHW.
#
# Output: a Markdown table of the medians over the rounds, one JSON line per
# result ("train_result") and one per model and precision ("train_ratio":
# mpt.h float32 / the fastest peer's float32, mpt.h mixed_bfloat16 / the
# fastest peer's bfloat16), from the medians ("ratio"), the best runs
# ("ratio_best": interference only ever slows a run down) and round by round
# ("ratio_per_round": runs adjacent in time, and "others_cores_per_round",
# the cores other processes kept busy during mpt.h's run and the peer's:
# a round of resnet lasts minutes, and the load can change within it), with
# "met" for the >= 1.5 target and "moonshot_met" for >= 2. Every run records
# how many cores other processes kept busy meanwhile ("others_cores"). Raw
# JSON lines are kept in build/compare/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

ROUNDS=3
THREADS=2
BATCH=128
MODEL=all
QUIET_WAIT=0
SYS_PY=/usr/bin/python3
usage() {
    echo "usage: $0 [--model mlp|cnn_small|cnn|resnet|all] [--rounds N] [--threads N]" \
         "[--batch-size N] [--quiet-wait SECONDS]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || usage # every option takes a value (set -u would stop at $2 unset)
    case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --quiet-wait) QUIET_WAIT=$2; shift 2 ;;
    *) usage ;;
    esac
done
# whole numbers, or seq would run no round and the summary would be empty
for n in "$ROUNDS" "$THREADS" "$BATCH" "$QUIET_WAIT"; do
    case $n in '' | *[!0-9]*) usage ;; esac
done
[ "$ROUNDS" -ge 1 ] && [ "$THREADS" -ge 1 ] && [ "$BATCH" -ge 1 ] || usage
case $MODEL in
all) MODELS="mlp cnn_small cnn" ;;
mlp|cnn_small|cnn|resnet) MODELS=$MODEL ;;
*) echo "compare.sh: unknown model $MODEL" >&2; exit 2 ;;
esac

# ---- what it needs ------------------------------------------------------------
PEERS_NAME=compare.sh PEERS_DIR=build/compare
. bench/peers.sh
peers_install zlib1g-dev dataset-fashion-mnist python3 python3-venv python3-numpy python3-torch \
    libopenblas0-pthread libopenblas0-openmp
mkdir -p build build/compare
peers_tensorflow

gcc -std=c99 -O2 -I. bench/bench_train.c -o build/bench_train -lpthread -lm -lz ||
    { echo "compare.sh: bench_train does not build" >&2; exit 1; }

# ---- PyTorch's configuration ------------------------------------------------------
# The probe: the MLP's float32 epoch over 3,840 images (30 steps), twice;
# for --model resnet alone, ResNet-20's over 640 images (5 steps), whose
# convolutions run in oneDNN, not in the BLAS the MLP's products run in,
# so the MLP's choice need not be the fastest for it.
probe_rate() {
    local what=(--model mlp --mlp-samples 3840)
    [ "$MODELS" = resnet ] && what=(--model resnet --resnet-samples 640)
    env "$@" "$SYS_PY" bench/torch_train.py "${what[@]}" --warmup-samples 256 \
        --threads "$THREADS" --batch-size "$BATCH" 2>/dev/null |
        sed -n 's/.*"samples_per_s":\([0-9.]*\).*/\1/p'
}
torch_probe 2 probe_rate
echo

# ---- the rounds ------------------------------------------------------------------
log=$PEERS_DIR/results.jsonl
: >"$log"
run_mpt() {
    measure "mpt_$2" "$1" '' ./build/bench_train --model "$2" --threads "$THREADS" --batch-size "$BATCH"
}
run_tf() {
    measure "tensorflow_$2" "$1" '' "$TF_PY" bench/tf_train.py --model "$2" --threads "$THREADS" \
        --batch-size "$BATCH" --bf16
}
run_torch() {
    measure "pytorch_$2" "$1" '' env "${TORCH_ENV[@]}" "$SYS_PY" bench/torch_train.py --model "$2" \
        --threads "$THREADS" --batch-size "$BATCH" --bf16 --config "$TORCH_CONFIG"
}
for r in $(seq 1 "$ROUNDS"); do
    for m in $MODELS; do
        case $((r % 3)) in
        1) run_mpt "$r" "$m"; run_tf "$r" "$m"; run_torch "$r" "$m" ;;
        2) run_tf "$r" "$m"; run_torch "$r" "$m"; run_mpt "$r" "$m" ;;
        0) run_torch "$r" "$m"; run_mpt "$r" "$m"; run_tf "$r" "$m" ;;
        esac
    done
    echo
done

# ---- the summary --------------------------------------------------------------------
"$SYS_PY" - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
NAMES = {"mpt": "mpt.h", "tensorflow": "TensorFlow", "pytorch": "PyTorch"}
# the policy of each framework that a precision compares
PRECISION = {"float32": {"mpt": "float32", "tensorflow": "float32", "pytorch": "float32"},
             "bfloat16": {"mpt": "mixed_bfloat16", "tensorflow": "mixed_bfloat16",
                          "pytorch": "autocast_bfloat16"}}
groups = {}
for r in rows:
    groups.setdefault((r["model"], r["framework"], r["policy"]), []).append(r)
models = [m for m in ("mlp", "cnn_small", "cnn", "resnet") if any(k[0] == m for k in groups)]
versions = {r["framework"]: r["version"] + (" (" + r["config"] + ")" if "config" in r else "")
            for r in rows}
for fw in ("mpt", "tensorflow", "pytorch"):
    if fw in versions:
        print(f"# {NAMES[fw]} {versions[fw]}")
print()

def med(rs, k):
    v = [r[k] for r in rs if r.get(k) is not None]
    return statistics.median(v) if v else None

def ms(x):
    return "—" if x is None else f"{x:.2f}"

print("| model | framework | policy | samples/s (median) | min..max | runs "
      "| forward ms | backward ms | update ms | other ms | others' cores |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
order = {"mpt": 0, "tensorflow": 1, "pytorch": 2}
results = []
for (model, fw, policy), rs in sorted(groups.items(), key=lambda kv: (
        models.index(kv[0][0]), order[kv[0][1]], kv[0][2])):
    s = [r["samples_per_s"] for r in rs]
    print(f"| {model} | {NAMES[fw]} | {policy} | {statistics.median(s):,.0f} "
          f"| {min(s):,.0f}..{max(s):,.0f} | {len(s)} | {ms(med(rs, 'forward_ms'))} "
          f"| {ms(med(rs, 'backward_ms'))} | {ms(med(rs, 'update_ms'))} "
          f"| {ms(med(rs, 'other_ms'))} | {med(rs, 'others_cores'):.2f} |")
    results.append({"bench": "train_result", "model": model, "framework": fw, "policy": policy,
                    "samples_per_s": round(statistics.median(s), 1),
                    "samples_per_s_min": round(min(s), 1), "samples_per_s_max": round(max(s), 1),
                    "runs": len(s), "others_cores": med(rs, "others_cores")})
print()

def per_round(model, fw, policy, key="samples_per_s"):
    return {r["round"]: r[key] for r in groups.get((model, fw, policy), [])}

ratios = []
print("| model | precision | mpt.h samples/s | fastest peer | peer samples/s | ratio "
      "| per round | target 1.5× |")
print("|---|---|---:|---|---:|---:|---|---|")
for model in models:
    for precision, policy in PRECISION.items():
        mine = groups.get((model, "mpt", policy["mpt"]))
        peers = {fw: groups[(model, fw, policy[fw])] for fw in ("tensorflow", "pytorch")
                 if (model, fw, policy[fw]) in groups}
        if not mine or not peers:
            continue
        peer_med = {fw: statistics.median(r["samples_per_s"] for r in rs) for fw, rs in peers.items()}
        fastest = max(peer_med, key=peer_med.get)
        m_med = statistics.median(r["samples_per_s"] for r in mine)
        m_best = max(r["samples_per_s"] for r in mine)
        p_best = max(max(r["samples_per_s"] for r in rs) for rs in peers.values())
        a = per_round(model, "mpt", policy["mpt"])
        a_load = per_round(model, "mpt", policy["mpt"], "others_cores")
        b, b_load = {}, {}  # the round's fastest peer run, and its load
        for fw in peers:
            load = per_round(model, fw, policy[fw], "others_cores")
            for k, v in per_round(model, fw, policy[fw]).items():
                if v > b.get(k, 0):
                    b[k], b_load[k] = v, load[k]
        paired = [round(a[k] / b[k], 3) for k in sorted(a) if b.get(k)]
        # a round's runs are minutes apart: the load each had says whether
        # the pair is fair
        paired_load = [[a_load[k], b_load[k]] for k in sorted(a) if b.get(k)]
        ratio = m_med / peer_med[fastest]
        line = {"bench": "train_ratio", "model": model, "precision": precision,
                "mpt_policy": policy["mpt"], "peer": fastest, "peer_policy": policy[fastest],
                "mpt_samples_per_s": round(m_med, 1),
                "peer_samples_per_s": round(peer_med[fastest], 1),
                "ratio": round(ratio, 3), "ratio_best": round(m_best / p_best, 3),
                "ratio_per_round": paired, "others_cores_per_round": paired_load,
                "target": 1.5, "met": bool(ratio >= 1.5),
                "moonshot_met": bool(ratio >= 2.0)}
        ratios.append(line)
        print(f"| {model} | {precision} | {m_med:,.0f} | {NAMES[fastest]} {policy[fastest]} "
              f"| {peer_med[fastest]:,.0f} | **{ratio:.2f}** | "
              f"{', '.join(f'{x:.2f}' for x in paired)} | {'met' if ratio >= 1.5 else 'missed'} |")
print()
for line in results + ratios:
    print(json.dumps(line, separators=(",", ":")))
PY
peers_finish

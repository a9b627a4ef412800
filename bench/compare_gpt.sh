#!/usr/bin/env bash
# examples/gpt.c against PyTorch and TensorFlow on the CPU: the same
# character-level GPT (3.3 M parameters, context 128, batch 32), data,
# optimizer and thread count, run interleaved, and the training tokens/s
# ratio of mpt.h to the fastest peer at equal precision, with the share of
# the CPU's fp32 FMA peak each reaches.
#
#   bench/compare_gpt.sh                          # 2 rounds, 40 steps, 20 timed (~9 min)
#   bench/compare_gpt.sh --rounds 3 --steps 30 --timed-steps 15
#   bench/compare_gpt.sh --full-data              # the validation loss on all the fortunes
#
# Each run trains --steps optimizer steps from the same initialisation
# scheme and times the last --timed-steps: build/gpt trains epochs of
# --timed-steps steps (its tokens_per_s is its last epoch's), and
# bench/torch_gpt.py and bench/tf_gpt.py time their last --timed-steps
# steps; then each reports the validation loss. Precisions: mpt.h float32
# against PyTorch's and TensorFlow's float32, mpt.h mixed_bfloat16 against
# torch.autocast("cpu", dtype=torch.bfloat16) and Keras' mixed_bfloat16.
# Each round runs the six, rotating which framework goes first.
#
# The data: by default the first 300,000 bytes of gpt.c's text (the fortunes
# in name order), so that its validation part (the last 10 %, 234 windows)
# is read in seconds: gpt.c evaluates after every epoch and the whole
# fortunes' tail (2,000 windows) takes it about 40 s a pass. The work per
# step does not depend on the text. --full-data uses all the fortunes, as
# gpt.c does by default (the validation losses are then gpt.c's own).
#
# PyTorch is Debian's python3-torch (1.13: no scaled_dot_product_attention,
# so the attention is the explicit masked softmax over bmm), set up as
# bench/compare.sh sets it up: OpenBLAS with the CPU's core type, glibc's
# malloc thresholds fixed, and whichever of OpenBLAS's OpenMP and pthread
# builds and libgomp's wait policies a short probe finds fastest. Its bfloat16
# matmuls go to oneDNN (on a CPU with AMX, its AMX kernels). TensorFlow is
# 2.21 from PyPI in build/venv-peers (as bench/compare.sh installs it):
# Keras 3's own layers, a tf.function step, intra-op threads as mpt.h's,
# inter-op 1.
#
# The peak: bench/bench_gemm.c's fp32 FMA probe (2 threads, zmm and ymm, the
# better of the two), run before and after the rounds; the best reading is
# the peak. FLOPs per training token: 6 × the parameters of the matmuls (all
# but the two embeddings) + 12 × layers × context × width for the attention's
# products (PaLM's count; the causal half that is masked is counted too).
# On a shared host the probe reads what the other processes leave, as the
# runs do. The share is of the fp32 FMA peak for both precisions: bfloat16
# matmuls run on AVX-512 BF16 dot products (twice the FMA's rate) or, in
# PyTorch on a CPU with AMX, on AMX tiles, so that share can pass 100 %.
#
# Output: a Markdown table of the medians over the rounds, one JSON line per
# result ("gpt_result") and one per precision ("gpt_ratio": mpt.h's tokens/s
# over PyTorch's, from the medians, the best runs and round by round). Every
# run records how many cores other processes kept busy meanwhile
# ("others_cores"). Raw output is kept in build/compare_gpt/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

ROUNDS=2
THREADS=2
STEPS=40
TIMED=20
FULL_DATA=0
QUIET_WAIT=0
SYS_PY=/usr/bin/python3
DIR=build/compare_gpt
while [ $# -gt 0 ]; do
    case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --timed-steps) TIMED=$2; shift 2 ;;
    --full-data) FULL_DATA=1; shift ;;
    --quiet-wait) QUIET_WAIT=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--threads N] [--steps N] [--timed-steps N]" \
            "[--full-data] [--quiet-wait SECONDS]" >&2
       exit 2 ;;
    esac
done
if [ "$TIMED" -le 0 ] || [ "$STEPS" -le "$TIMED" ] || [ $((STEPS % TIMED)) -ne 0 ]; then
    echo "compare_gpt.sh: --steps must be a multiple of --timed-steps, past it (gpt.c times" \
         "its last epoch of --timed-steps steps)" >&2
    exit 2
fi

# ---- what it needs ----------------------------------------------------------------
PEERS_NAME=compare_gpt.sh PEERS_DIR=$DIR
. bench/peers.sh
peers_install zlib1g-dev fortunes python3 python3-venv python3-numpy python3-torch \
    libopenblas0-pthread libopenblas0-openmp
peers_tensorflow
mkdir -p "$DIR"
# build OUT SOURCE: when OUT is older than SOURCE, mpt.h or the examples' common.h
build() {
    [ "$1" -nt "$2" ] && [ "$1" -nt mpt.h ] && [ "$1" -nt examples/common.h ] && return 0
    gcc -O2 -I. "$2" -o "$1" -lpthread -lm -lz ||
        { echo "compare_gpt.sh: $2 does not build" >&2; exit 1; }
}
build build/gpt examples/gpt.c
build "$DIR/bench_gemm" bench/bench_gemm.c

# the text: gpt.c's (every fortunes file but the .dat indexes and .u8 links,
# in name order), whole or its first 300,000 bytes
DATA_ARGS=()
if [ "$FULL_DATA" -eq 0 ]; then
    "$SYS_PY" - "$DIR/fortunes_head.txt" <<'PY' || exit 1
import sys
sys.path.insert(0, "bench")
from gpt_text import read_fortunes
open(sys.argv[1], "wb").write(read_fortunes()[:300000])
PY
    DATA_ARGS=(--data "$DIR/fortunes_head.txt")
fi

# ---- measuring a run ------------------------------------------------------------------
log=$DIR/results.jsonl
# peak TAG: bench_gemm's 2-thread fp32 FMA peak line, tagged, into $log
# (line-buffered, so that it stops there)
peak() {
    stdbuf -oL "$DIR/bench_gemm" quick 2>/dev/null |
        sed -n "/\"bench\":\"fma_peak\",\"threads\":2,/{s/}\$/,\"when\":\"$1\"}/p;q}" | tee -a "$log"
}

# ---- PyTorch's configuration ----------------------------------------------------------
# The probe: 3 float32 steps, the last 2 timed, once in each configuration
# (float32 is where the BLAS works: bfloat16 goes to oneDNN).
gpt_rate() {
    env "$@" "$SYS_PY" bench/torch_gpt.py "${DATA_ARGS[@]}" --steps 3 --timed-steps 2 --eval 0 \
        --threads "$THREADS" 2>/dev/null | sed -n 's/.*"tokens_per_s":\([0-9.]*\).*/\1/p'
}
: >"$log"
echo "# $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores, commit" \
     "$(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date)"
torch_probe 1 gpt_rate
echo "# fp32 FMA peak before the rounds:"
peak before
echo

# ---- the rounds -------------------------------------------------------------------------
run_mpt() { # ROUND POLICY
    measure "mpt_$2" "$1" '"framework":"mpt",' ./build/gpt "${DATA_ARGS[@]}" --steps "$STEPS" \
        --eval-interval "$TIMED" --sample 0 --threads "$THREADS" --policy "$2"
}
run_torch() { # ROUND POLICY
    measure "pytorch_$2" "$1" '' env "${TORCH_ENV[@]}" "$SYS_PY" bench/torch_gpt.py \
        "${DATA_ARGS[@]}" --steps "$STEPS" --timed-steps "$TIMED" --threads "$THREADS" \
        --policy "$2" --config "$TORCH_CONFIG"
}
run_tf() { # ROUND POLICY
    measure "tensorflow_$2" "$1" '' "$TF_PY" bench/tf_gpt.py "${DATA_ARGS[@]}" --steps "$STEPS" \
        --timed-steps "$TIMED" --threads "$THREADS" --policy "$2"
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then
        run_mpt "$r" float32; run_torch "$r" float32; run_tf "$r" float32
        run_mpt "$r" mixed_bfloat16; run_torch "$r" autocast_bfloat16; run_tf "$r" mixed_bfloat16
    else
        run_tf "$r" mixed_bfloat16; run_torch "$r" autocast_bfloat16; run_mpt "$r" mixed_bfloat16
        run_tf "$r" float32; run_torch "$r" float32; run_mpt "$r" float32
    fi
    echo
done
echo "# fp32 FMA peak after the rounds:"
peak after
echo

# ---- the summary ----------------------------------------------------------------------------
"$SYS_PY" - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peaks = [max(r["zmm_gflops"], r["ymm_gflops"]) for r in rows if r.get("bench") == "fma_peak"]
peak = max(peaks) if peaks else None
runs = [r for r in rows if r.get("model") == "gpt"]
# FLOPs per training token: 6 per matmul parameter (forward 2, backward 4)
# and the attention's q·k and p·v products, forward and backward
VOCAB, CONTEXT, WIDTH, LAYERS = 256, 128, 256, 4
params = 3323648
matmul_params = params - VOCAB * WIDTH - CONTEXT * WIDTH
flops_per_token = 6 * matmul_params + 12 * LAYERS * CONTEXT * WIDTH
NAMES = {"mpt": "mpt.h", "pytorch": "PyTorch", "tensorflow": "TensorFlow"}
PEERS = ("pytorch", "tensorflow")
PRECISION = {"float32": {"mpt": "float32", "pytorch": "float32", "tensorflow": "float32"},
             "bfloat16": {"mpt": "mixed_bfloat16", "pytorch": "autocast_bfloat16",
                          "tensorflow": "mixed_bfloat16"}}
groups = {}
for r in runs:
    groups.setdefault((r["framework"], r["policy"]), []).append(r)
if "pytorch" in {k[0] for k in groups}:
    t = next(r for r in runs if r["framework"] == "pytorch")
    print(f"# PyTorch {t['version']} ({t.get('config', '?')}), attention {t['attention']}")
if "tensorflow" in {k[0] for k in groups}:
    t = next(r for r in runs if r["framework"] == "tensorflow")
    print(f"# TensorFlow {t['version']}")
print(f"# {flops_per_token / 1e6:.2f} MFLOP per training token; fp32 FMA peak (2 threads, best "
      f"of {len(peaks)} probes): " + (f"{peak:.1f} GFLOP/s" if peak else "not measured") +
      " (a bfloat16 share past 100 % is the bfloat16 dot products' doing, at twice the FMA"
      " rate, or AMX's)")
print()

def frac(tps):
    return None if not peak else tps * flops_per_token / 1e9 / peak

print("| framework | policy | tokens/s (median) | min..max | runs | GFLOP/s "
      "| share of fp32 FMA peak | val_loss (nats/byte) | others' cores |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
results = []
for fw in ("mpt",) + PEERS:
    for precision in PRECISION.values():
        rs = groups.get((fw, precision[fw]))
        if not rs:
            continue
        t = [r["tokens_per_s"] for r in rs]
        m = statistics.median(t)
        vl = [r["val_loss"] for r in rs if r.get("val_loss") is not None]
        oc = statistics.median(r["others_cores"] for r in rs)
        f = frac(m)
        print(f"| {NAMES[fw]} | {precision[fw]} | {m:,.0f} | {min(t):,.0f}..{max(t):,.0f} "
              f"| {len(t)} | {m * flops_per_token / 1e9:.1f} "
              f"| {'—' if f is None else f'{100 * f:.1f} %'} "
              f"| {', '.join(f'{v:.4f}' for v in vl)} | {oc:.2f} |")
        results.append({"bench": "gpt_result", "framework": fw, "policy": precision[fw],
                        "tokens_per_s": round(m), "tokens_per_s_min": min(t),
                        "tokens_per_s_max": max(t), "runs": len(t),
                        "gflops": round(m * flops_per_token / 1e9, 1),
                        "peak_fraction": None if f is None else round(f, 4),
                        "val_loss": vl, "steps": rs[0]["steps"], "others_cores": oc})
print()
print("| precision | mpt.h tokens/s | fastest peer | peer tokens/s | ratio (medians) "
      "| best/best | per round |")
print("|---|---:|---|---:|---:|---:|---|")
ratios = []
for precision, policy in PRECISION.items():
    mine = groups.get(("mpt", policy["mpt"]))
    peers = {fw: groups[(fw, policy[fw])] for fw in PEERS if (fw, policy[fw]) in groups}
    if not mine or not peers:
        continue
    medians = {fw: statistics.median(r["tokens_per_s"] for r in rs) for fw, rs in peers.items()}
    fastest = max(medians, key=medians.get)
    peer = peers[fastest]
    m = statistics.median(r["tokens_per_s"] for r in mine)
    p = medians[fastest]
    best = max(r["tokens_per_s"] for r in mine) / max(r["tokens_per_s"] for r in peer)
    a = {r["round"]: r["tokens_per_s"] for r in mine}
    b = {r["round"]: r["tokens_per_s"] for r in peer}
    paired = [round(a[k] / b[k], 3) for k in sorted(a) if b.get(k)]
    print(f"| {precision} | {m:,.0f} | {NAMES[fastest]} {policy[fastest]} | {p:,.0f} "
          f"| **{m / p:.2f}** | {best:.2f} | {', '.join(f'{x:.2f}' for x in paired)} |")
    ratios.append({"bench": "gpt_ratio", "precision": precision, "mpt_policy": policy["mpt"],
                   "peer": fastest, "peer_policy": policy[fastest],
                   "mpt_tokens_per_s": round(m), "peer_tokens_per_s": round(p),
                   "ratio": round(m / p, 3), "ratio_best": round(best, 3),
                   "ratio_per_round": paired,
                   "mpt_peak_fraction": None if not peak else round(frac(m), 4),
                   "peer_peak_fraction": None if not peak else round(frac(p), 4)})
print()
for line in results + ratios:
    print(json.dumps(line, separators=(",", ":")))
PY
peers_finish

#!/usr/bin/env bash
# examples/gpt.c against PyTorch on the CPU: the same character-level GPT
# (3.3 M parameters, context 128, batch 32), data, optimizer and thread
# count, run interleaved, and the training tokens/s ratio of mpt.h to the
# peer at equal precision, with the share of the CPU's fp32 FMA peak each
# reaches.
#
#   bench/compare_gpt.sh                          # 2 rounds, 40 steps, 20 timed (~9 min)
#   bench/compare_gpt.sh --rounds 3 --steps 30 --timed-steps 15
#   bench/compare_gpt.sh --full-data              # the validation loss on all the fortunes
#
# Each run trains --steps optimizer steps from the same initialisation
# scheme and times the last --timed-steps: build/gpt trains epochs of
# --timed-steps steps (its tokens_per_s is its last epoch's), and
# bench/torch_gpt.py times its last --timed-steps steps; then both report
# the validation loss. Precisions: mpt.h float32 against PyTorch float32,
# mpt.h mixed_bfloat16 against torch.autocast("cpu", dtype=torch.bfloat16).
# Each round runs the four, rotating which framework goes first.
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
# matmuls go to oneDNN (on a CPU with AMX, its AMX kernels).
#
# The peak: bench/bench_gemm.c's fp32 FMA probe (2 threads, zmm and ymm, the
# better of the two), run before and after the rounds; the best reading is
# the peak. FLOPs per training token: 6 × the parameters of the matmuls (all
# but the two embeddings) + 12 × layers × context × width for the attention's
# products (PaLM's count; the causal half that is masked is counted too).
# On a shared host the probe reads what the other processes leave, as the
# runs do. The share is of the fp32 FMA peak for both precisions: PyTorch's
# bfloat16 matmuls run on AMX tiles, whose peak is far above it, so that
# share can pass 100 %.
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
need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)
for p in zlib1g-dev fortunes python3 python3-numpy python3-torch \
         libopenblas0-pthread libopenblas0-openmp; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "compare_gpt.sh: installing ${need[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }; then
            echo "compare_gpt.sh: apt-get install failed" >&2
            exit 1
        fi
    else
        echo "compare_gpt.sh: missing packages: ${need[*]} (run as root to install them)" >&2
        exit 1
    fi
fi
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
import os, sys
d = b"/usr/share/games/fortunes"
names = sorted(n for n in os.listdir(d) if not n.startswith(b".")
               and not n.endswith(b".dat") and not n.endswith(b".u8"))
text = b"".join(open(os.path.join(d, n), "rb").read() for n in names)
open(sys.argv[1], "wb").write(text[:300000])
PY
    DATA_ARGS=(--data "$DIR/fortunes_head.txt")
fi

# ---- measuring a run ------------------------------------------------------------------
# others_cores: the cores other processes kept busy during a run, from
# /proc/stat's busy time less this script's children's CPU time.
log=$DIR/results.jsonl
HZ=$(getconf CLK_TCK 2>/dev/null || echo 100)
busy_jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# user + system seconds of this shell's finished children: `times` must run
# in this shell (in a $(...) subshell it would count that subshell's only)
children_cpu() {
    times >"$DIR/times.txt"
    awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] }
                   print t }' "$DIR/times.txt" >"$DIR/self.txt"
}
now() { date +%s.%N; }
others_cores() { # busy0 busy1 self0 self1 wall0 wall1
    awk -v b0="$1" -v b1="$2" -v s0="$3" -v s1="$4" -v w0="$5" -v w1="$6" -v hz="$HZ" \
        'BEGIN { o = ((b1 - b0) / hz - (s1 - s0)) / (w1 - w0); printf "%.2f", o < 0 ? 0 : o }'
}
wait_quiet() { # with --quiet-wait S: up to S seconds for others to use < 1/4 core
    local waited=0 b0 b1 busy='?'
    while [ "$waited" -lt "$QUIET_WAIT" ]; do
        b0=$(busy_jiffies); sleep 2; b1=$(busy_jiffies)
        busy=$(awk -v a="$b0" -v b="$b1" -v hz="$HZ" 'BEGIN { printf "%.2f", (b - a) / hz / 2 }')
        awk -v x="$busy" 'BEGIN { exit !(x < 0.25) }' && return 0
        waited=$((waited + 2))
    done
    [ "$QUIET_WAIT" -gt 0 ] && echo "# (the host stayed busy: $busy cores in use after waiting ${QUIET_WAIT}s)"
}
FAILED_RUNS=0
# measure NAME ROUND FIELDS COMMAND...: runs it and appends its JSON line to
# $log with FIELDS (JSON members, may be empty), the round and others_cores.
measure() {
    local name=$1 round=$2 fields=$3 out s0 s1 b0 b1 w0 w1 oc
    shift 3
    out=$DIR/${name}_$round.txt
    wait_quiet
    echo "## round $round: $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    children_cpu; s0=$(cat "$DIR/self.txt"); b0=$(busy_jiffies); w0=$(now)
    "$@" >"$out" 2>"$DIR/${name}_$round.err"
    b1=$(busy_jiffies); w1=$(now); children_cpu; s1=$(cat "$DIR/self.txt")
    oc=$(others_cores "$b0" "$b1" "$s0" "$s1" "$w0" "$w1")
    grep '^{' "$out"
    echo "# other processes kept $oc cores busy during this run ($(awk -v a="$w0" -v b="$w1" \
         'BEGIN { printf "%.0f", b - a }') s)"
    grep -q '^{' "$out" || { echo "compare_gpt.sh: $name printed no result:" >&2
                            tail -n 5 "$DIR/${name}_$round.err" >&2; FAILED_RUNS=$((FAILED_RUNS + 1)); }
    grep '^{' "$out" | sed "s/}\$/,${fields}\"round\":$round,\"others_cores\":$oc}/" >>"$log"
}
# peak TAG: bench_gemm's 2-thread fp32 FMA peak line, tagged, into $log
# (line-buffered, so that it stops there)
peak() {
    stdbuf -oL "$DIR/bench_gemm" quick 2>/dev/null |
        sed -n "/\"bench\":\"fma_peak\",\"threads\":2,/{s/}\$/,\"when\":\"$1\"}/p;q}" | tee -a "$log"
}

# ---- PyTorch's configuration ----------------------------------------------------------
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu
case " $(grep -m1 '^flags' /proc/cpuinfo) " in
*" avx512f "*) CORETYPE=SkylakeX ;;
*" avx2 "*) CORETYPE=Haswell ;;
*) CORETYPE= ;;
esac
torch_env() { # BLAS WAIT (openmp|pthread, default|passive): `env` arguments
    local e=(-u OMP_WAIT_POLICY -u OPENBLAS_CORETYPE
             LD_LIBRARY_PATH="$OPENBLAS_DIR/openblas-$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
             MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824)
    [ -n "$CORETYPE" ] && e+=(OPENBLAS_CORETYPE="$CORETYPE")
    [ "$2" = passive ] && e+=(OMP_WAIT_POLICY=PASSIVE)
    printf '%s\n' "${e[@]}"
}
torch_config_name() { echo "openblas-$1 coretype=${CORETYPE:-auto} malloc=fixed omp_wait=$2"; }
# The probe: 3 float32 steps, the last 2 timed, in each configuration; the
# fastest wins (float32 is where the BLAS works: bfloat16 goes to oneDNN).
: >"$log"
echo "# $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores, commit" \
     "$(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date)"
echo "# probing PyTorch's configurations"
best=0 TORCH_BLAS=pthread TORCH_WAIT=passive
for blas in pthread openmp; do
    for wait in passive default; do
        mapfile -t e < <(torch_env "$blas" "$wait")
        tps=$(env "${e[@]}" "$SYS_PY" bench/torch_gpt.py "${DATA_ARGS[@]}" --steps 3 \
                  --timed-steps 2 --eval 0 --threads "$THREADS" 2>/dev/null |
              sed -n 's/.*"tokens_per_s":\([0-9.]*\).*/\1/p')
        echo "#   $(torch_config_name "$blas" "$wait"): ${tps:-failed} tokens/s"
        if awk -v a="${tps:-0}" -v b="$best" 'BEGIN { exit !(a > b) }'; then
            best=$tps TORCH_BLAS=$blas TORCH_WAIT=$wait
        fi
    done
done
mapfile -t TORCH_ENV < <(torch_env "$TORCH_BLAS" "$TORCH_WAIT")
TORCH_CONFIG=$(torch_config_name "$TORCH_BLAS" "$TORCH_WAIT")
echo "# PyTorch runs with: $TORCH_CONFIG"
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
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then
        run_mpt "$r" float32; run_torch "$r" float32
        run_mpt "$r" mixed_bfloat16; run_torch "$r" autocast_bfloat16
    else
        run_torch "$r" autocast_bfloat16; run_mpt "$r" mixed_bfloat16
        run_torch "$r" float32; run_mpt "$r" float32
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
NAMES = {"mpt": "mpt.h", "pytorch": "PyTorch"}
PRECISION = {"float32": {"mpt": "float32", "pytorch": "float32"},
             "bfloat16": {"mpt": "mixed_bfloat16", "pytorch": "autocast_bfloat16"}}
groups = {}
for r in runs:
    groups.setdefault((r["framework"], r["policy"]), []).append(r)
if "pytorch" in {k[0] for k in groups}:
    t = next(r for r in runs if r["framework"] == "pytorch")
    print(f"# PyTorch {t['version']} ({t.get('config', '?')}), attention {t['attention']}")
print(f"# {flops_per_token / 1e6:.2f} MFLOP per training token; fp32 FMA peak (2 threads, best "
      f"of {len(peaks)} probes): " + (f"{peak:.1f} GFLOP/s" if peak else "not measured") +
      " (a bfloat16 share past 100 % is AMX's doing)")
print()

def frac(tps):
    return None if not peak else tps * flops_per_token / 1e9 / peak

print("| framework | policy | tokens/s (median) | min..max | runs | GFLOP/s "
      "| share of fp32 FMA peak | val_loss (nats/byte) | others' cores |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
results = []
for fw in ("mpt", "pytorch"):
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
print("| precision | mpt.h tokens/s | PyTorch tokens/s | ratio (medians) | best/best | per round |")
print("|---|---:|---:|---:|---:|---|")
ratios = []
for precision, policy in PRECISION.items():
    mine, peer = groups.get(("mpt", policy["mpt"])), groups.get(("pytorch", policy["pytorch"]))
    if not mine or not peer:
        continue
    m = statistics.median(r["tokens_per_s"] for r in mine)
    p = statistics.median(r["tokens_per_s"] for r in peer)
    best = max(r["tokens_per_s"] for r in mine) / max(r["tokens_per_s"] for r in peer)
    a = {r["round"]: r["tokens_per_s"] for r in mine}
    b = {r["round"]: r["tokens_per_s"] for r in peer}
    paired = [round(a[k] / b[k], 3) for k in sorted(a) if b.get(k)]
    print(f"| {precision} | {m:,.0f} | {p:,.0f} | **{m / p:.2f}** | {best:.2f} "
          f"| {', '.join(f'{x:.2f}' for x in paired)} |")
    ratios.append({"bench": "gpt_ratio", "precision": precision, "mpt_policy": policy["mpt"],
                   "peer": "pytorch", "peer_policy": policy["pytorch"],
                   "mpt_tokens_per_s": round(m), "peer_tokens_per_s": round(p),
                   "ratio": round(m / p, 3), "ratio_best": round(best, 3),
                   "ratio_per_round": paired,
                   "mpt_peak_fraction": None if not peak else round(frac(m), 4),
                   "peer_peak_fraction": None if not peak else round(frac(p), 4)})
print()
for line in results + ratios:
    print(json.dumps(line, separators=(",", ":")))
PY
if [ "$FAILED_RUNS" -gt 0 ]; then
    echo "compare_gpt.sh: $FAILED_RUNS run(s) printed no result (see $DIR/*.err)" >&2
    exit 1
fi

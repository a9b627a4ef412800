#!/usr/bin/env bash
# examples/gpt.c against bench/torch_gpt.py by CPU time: one thread each,
# the user CPU seconds of a run of 6 training steps less those of a run of
# 2 (what building the model, loading the text, importing torch and
# evaluating cost cancels out), over 4: a training step's CPU cost, float32
# against float32, mixed_bfloat16 against autocast_bfloat16.
#
#   bench/compare_gpt_cpu.sh [GPT_BINARY]        (default build/gpt)
#
# For a host whose other load comes and goes: wall-clock tokens/s (what
# compare_gpt.sh reports) then measures the load as much as the
# frameworks, where one thread's CPU time counts only the time it ran.
# (Where the two cores are siblings of one physical core, a busy sibling
# still slows the thread down; CPU time does not remove that.) PyTorch runs
# on OpenBLAS's pthread build with one thread, as compare_gpt.sh sets it
# up; the text is compare_gpt.sh's 300,000-byte head (run it once first).
# Prints one JSON line per run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
GPT=${1:-build/gpt}
D=build/compare_gpt/fortunes_head.txt
[ -r "$D" ] || { echo "$0: no $D (run bench/compare_gpt.sh once)" >&2; exit 1; }
[ -x "$GPT" ] || { echo "$0: no $GPT" >&2; exit 1; }
TORCH_ENV=(env -u OMP_WAIT_POLICY LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-pthread
           MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824
           OPENBLAS_CORETYPE=SkylakeX OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
           OPENBLAS_NUM_THREADS=1)
# user CPU seconds of COMMAND..., its output discarded
cpu() { local t; t=$( { TIMEFORMAT='%U'; time "$@" >/dev/null 2>&1; } 2>&1 ) || return 1; echo "$t"; }
for precision in float32 bfloat16; do
    if [ $precision = float32 ]; then mp=float32 tp=float32
    else mp=mixed_bfloat16 tp=autocast_bfloat16; fi
    for steps in 2 6; do
        m=$(cpu "$GPT" --data "$D" --steps $steps --eval-interval $steps --sample 0 --threads 1 \
                --policy $mp --verbose 0) || { echo "$0: $GPT failed" >&2; exit 1; }
        echo "{\"framework\":\"mpt\",\"policy\":\"$mp\",\"steps\":$steps,\"user_s\":$m}"
        p=$(cpu "${TORCH_ENV[@]}" /usr/bin/python3 bench/torch_gpt.py --data "$D" --steps $steps \
                --timed-steps 1 --eval 0 --threads 1 --policy $tp) ||
            { echo "$0: bench/torch_gpt.py failed" >&2; exit 1; }
        echo "{\"framework\":\"pytorch\",\"policy\":\"$tp\",\"steps\":$steps,\"user_s\":$p}"
    done
done

#!/usr/bin/env bash
# Builds of examples/gpt.c against each other by their CPU time: one-thread
# runs, interleaved (the order reversed every other round), float32 and
# mixed_bfloat16, each printing one JSON line with the run's user CPU
# seconds ("user_s"), its wall seconds and gpt.c's own line.
#
#   bench/ab_gpt.sh ROUNDS STEPS GPT_BINARY...
#   bench/ab_gpt.sh 2 4 /tmp/gpt_before build/gpt
#
# Why CPU time: on a host whose other load comes and goes, a run's wall
# time counts the waits for a core too, and tokens_per_s with it; one
# thread's user time is what the run's work cost. It covers the whole
# program (the model built, STEPS training steps, one evaluation of the
# validation tail), the same work for every binary. The text is
# compare_gpt.sh's 300,000-byte head (build/compare_gpt/fortunes_head.txt:
# run compare_gpt.sh once first), or DATA=FILE.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ $# -lt 3 ]; then
    echo "usage: $0 ROUNDS STEPS GPT_BINARY..." >&2
    exit 2
fi
ROUNDS=$1 STEPS=$2
shift 2
DATA=${DATA:-build/compare_gpt/fortunes_head.txt}
[ -r "$DATA" ] || { echo "$0: no $DATA (run bench/compare_gpt.sh once, or set DATA)" >&2; exit 1; }
out=$(mktemp) || exit 1
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$ROUNDS"); do
    for policy in float32 mixed_bfloat16; do
        bins=("$@")
        [ $((r % 2)) -eq 0 ] && bins=($(printf '%s\n' "$@" | tac))
        for b in "${bins[@]}"; do
            t=$( { TIMEFORMAT='%U %R'; time "$b" --data "$DATA" --steps "$STEPS" \
                   --eval-interval "$STEPS" --sample 0 --threads 1 --policy "$policy" \
                   --verbose 0 >"$out"; } 2>&1 ) || { echo "$0: $b failed" >&2; exit 1; }
            echo "{\"round\":$r,\"binary\":\"$b\",\"user_s\":${t% *},\"wall_s\":${t#* },$(tail -1 "$out" | sed 's/^{//')"
        done
    done
done

#!/usr/bin/env bash
# mpt.h's int8 predict against ONNX Runtime's on the same exported model
# (bench/compare_int8.py says how): builds build/bench_int8_predict, makes
# build/venv with onnxruntime, onnx and numpy from PyPI when they are
# missing (as build.sh does), then runs the comparison.
#
#   bench/compare_int8.sh                                 # mlp and cnn_small
#   bench/compare_int8.sh --models cnn_small --rounds 15 --reps 30
#
# The first run trains each model one epoch (a few seconds to a minute)
# and keeps the weights in build/<model>_int8bench.safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
cc -std=c99 -O2 -I. bench/bench_int8_predict.c -o build/bench_int8_predict -lpthread -lm -lz
if ! build/venv/bin/python -c 'import onnxruntime, onnx, numpy' 2>/dev/null; then
    [ -x build/venv/bin/python ] || python3 -m venv build/venv
    build/venv/bin/python -m pip install -q onnxruntime onnx numpy
fi
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M UTC'), " \
     "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs, uptime:$(uptime | sed 's/.*load/ load/')"
exec build/venv/bin/python bench/compare_int8.py "$@"

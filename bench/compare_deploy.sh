#!/usr/bin/env bash
# mpt.h's predict against ONNX Runtime's and LiteRT's on the files mpt.h
# exports, in every variant, at batch 1 and 128 (bench/compare_deploy.py
# says how): builds build/bench_predict, makes build/venv with onnxruntime,
# ai-edge-litert and numpy from PyPI when they are missing (as build.sh
# does), then runs the comparison.
#
#   bench/compare_deploy.sh                         # mlp, cnn_small, cnn, resnet
#   bench/compare_deploy.sh --models cnn_small --rounds 9 --reps1 300
#
# The first run trains each model one epoch (a few seconds to a few
# minutes) and keeps the weights in build/<model>_deploybench.safetensors.
# As root it first installs the Debian packages it needs (a compiler, zlib,
# the data, python3 and python3-venv), as bench/compare.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_NAME=compare_deploy.sh PEERS_DIR=build/deploy
. bench/peers.sh
peers_install zlib1g-dev dataset-fashion-mnist python3 python3-venv
mkdir -p build
cc -std=c99 -O2 -I. bench/bench_predict.c -o build/bench_predict -lpthread -lm -lz
if ! build/venv/bin/python -c 'import onnxruntime, ai_edge_litert, numpy' 2>/dev/null; then
    [ -x build/venv/bin/python ] || python3 -m venv build/venv
    build/venv/bin/python -m pip install -q onnxruntime ai-edge-litert numpy
fi
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M UTC'), " \
     "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs, uptime:$(uptime | sed 's/.*load/ load/')"
exec build/venv/bin/python bench/compare_deploy.py "$@"

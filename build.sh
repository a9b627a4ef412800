#!/usr/bin/env bash
# Builds and tests mpt.h.
#   ./build.sh          build the tests, examples and benchmarks (gcc -O2 -g,
#                       warnings as errors) into build/
#   ./build.sh test     install what is missing (as root; Python packages into
#                       build/venv), build as ./build.sh does and with warnings as
#                       errors, run every test under AddressSanitizer + UBSan,
#                       fuzz each loader for 30 s, and end with
#                       "N passed, N failed, N skipped"
#   ./build.sh fuzz [seconds]
#                       fuzz each file loader (tests/fuzz/, libFuzzer with
#                       clang) for that long (default 60 s) after replaying
#                       tests/fuzz/findings/
#   ./build.sh bench    build and run the CPU benchmarks (results: bench/RESULTS.md)
#   ./build.sh run      install Fashion-MNIST if missing (as root) and train
#                       examples/mlp.c with the progress bar
#   ./build.sh gpu      on a machine with nvcc and a CUDA device: build with the
#                       CUDA backend, run tests/test_cuda.c, bench/bench_cuda.c,
#                       examples/mlp.c and (where PyTorch sees the GPU)
#                       bench/torch_gpu_train.py, and end with a summary table
set -uo pipefail
cd "$(dirname "$0")"

CC=${CC:-gcc}
CXX=${CXX:-g++}
WARN="-Wall -Wextra -Werror"
OPT="-O2 -g"
LIBS="-lpthread -lm -lz"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
B=build
mkdir -p "$B"

# Debian packages the tests and examples need; installed only when missing and root.
# python3-venv: the interop tests' virtual environment; clang and its runtime
# libraries (libFuzzer): the fuzz harnesses.
DEB_PACKAGES="zlib1g-dev dataset-fashion-mnist openmpi-bin libopenmpi-dev python3-venv
clang libclang-rt-14-dev"

# Python packages (PyPI names) the interoperability tests import; pip installs
# them into PY_VENV when one is missing (python_env).
PY_PACKAGES="safetensors numpy tensorboard"
PY_VENV=$B/venv

install_packages() {
    local missing=()
    command -v "$CC" >/dev/null && command -v "$CXX" >/dev/null || missing+=(gcc g++ libc6-dev)
    for p in $DEB_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "build.sh: missing packages: ${missing[*]} (run as root to install them)" >&2
        return 0
    fi
    echo "build.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null ||
        echo "build.sh: apt-get install failed; tests that need those packages will fail" >&2
}

# cc_prog NAME SOURCE EXTRA_FLAGS...: compile one single-file program.
cc_prog() {
    local name=$1 src=$2
    shift 2
    $CC -std=c99 $WARN $OPT "$@" -I. "$src" -o "$B/$name" $LIBS
}

# Every test, benchmark and example, without sanitizers (what ./build.sh
# builds), one compiler per CPU; prints the errors, fails if any program
# does not build.
build_all() {
    local src name ok=0
    rm -f "$B"/*.plain.failed
    for src in tests/test_*.c bench/*.c examples/*.c; do
        [ -e "$src" ] || continue
        name=$(basename "$src" .c)
        while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n; done
        { cc_prog "$name" "$src" 2>"$B/$name.plain.log" || touch "$B/$name.plain.failed"; } &
    done
    wait
    for src in tests/test_*.c bench/*.c examples/*.c; do
        name=$(basename "$src" .c)
        [ -e "$B/$name.plain.failed" ] || continue
        echo "$src:" && cat "$B/$name.plain.log"
        ok=1
    done
    return $ok
}

passed=0
failed=0
skipped=0

# record NAME STATUS [WHY]: a check that build.sh itself runs.
record() {
    case $2 in
    pass) passed=$((passed + 1)); echo "PASS $1" ;;
    skip) skipped=$((skipped + 1)); echo "SKIP $1: $3" ;;
    *) failed=$((failed + 1)); echo "FAIL $1: $3" ;;
    esac
}

# Builds mpt.h as C99, C11 and C++17, in two translation units (one with
# MPT_IMPLEMENTATION), with every warning an error.
compile_checks() {
    local d=$B/compile && mkdir -p "$d"
    cat >"$d/impl.c" <<'SRC'
#define MPT_IMPLEMENTATION
#include "mpt.h"
SRC
    cat >"$d/use.c" <<'SRC'
#include "mpt.h"
int main(void) {
    mpt_context *ctx = 0;
    if (mpt_context_create(0, &ctx) != MPT_OK) return 1;
    mpt_context_destroy(ctx);
    return mpt_float_to_half(1.0f) == 0x3c00 ? 0 : 1;
}
SRC
    local std
    for std in c99 c11; do
        if $CC -std=$std $WARN -pedantic -O1 -I. -c "$d/impl.c" -o "$d/impl_$std.o" 2>"$d/$std.log" &&
            $CC -std=$std $WARN -pedantic -O1 -I. -c "$d/use.c" -o "$d/use_$std.o" 2>>"$d/$std.log" &&
            $CC "$d/impl_$std.o" "$d/use_$std.o" -o "$d/prog_$std" $LIBS 2>>"$d/$std.log" &&
            "$d/prog_$std"; then
            record "compile mpt.h as $std, two translation units" pass
        else
            record "compile mpt.h as $std, two translation units" fail "see $d/$std.log"
            cat "$d/$std.log"
        fi
    done
    # The portable build: no SIMD paths, no zlib (and no -lz).
    if $CC -std=c99 $WARN -pedantic -O2 -DMPT_NO_SIMD -DMPT_NO_ZLIB -I. -c "$d/impl.c" \
        -o "$d/impl_portable.o" 2>"$d/portable.log" &&
        $CC -std=c99 $WARN -pedantic -O2 -I. -c "$d/use.c" -o "$d/use_portable.o" \
            2>>"$d/portable.log" &&
        $CC "$d/impl_portable.o" "$d/use_portable.o" -o "$d/prog_portable" -lpthread -lm \
            2>>"$d/portable.log" && "$d/prog_portable"; then
        record "compile mpt.h with MPT_NO_SIMD and MPT_NO_ZLIB, linked without zlib" pass
    else
        record "compile mpt.h with MPT_NO_SIMD and MPT_NO_ZLIB" fail "see $d/portable.log"
        cat "$d/portable.log"
    fi
    cp "$d/impl.c" "$d/impl.cpp" && cp "$d/use.c" "$d/use.cpp"
    if $CXX -std=c++17 $WARN -O1 -I. -c "$d/impl.cpp" -o "$d/impl_cxx.o" 2>"$d/cxx.log" &&
        $CXX -std=c++17 $WARN -O1 -I. -c "$d/use.cpp" -o "$d/use_cxx.o" 2>>"$d/cxx.log" &&
        $CXX "$d/impl_cxx.o" "$d/use_cxx.o" -o "$d/prog_cxx" $LIBS 2>>"$d/cxx.log" &&
        "$d/prog_cxx"; then
        record "compile mpt.h as C++17, two translation units" pass
    else
        record "compile mpt.h as C++17, two translation units" fail "see $d/cxx.log"
        cat "$d/cxx.log"
    fi
}

# The CUDA backend, where there is one, must at least compile wherever nvcc is.
cuda_compile_check() {
    [ -e mpt_cuda.cu ] || return 0
    local nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    if [ ! -x "$nvcc" ]; then
        record "compile mpt_cuda.cu with nvcc" skip "no nvcc on this machine"
    elif "$nvcc" -std=c++17 -arch=sm_90 -Werror all-warnings -DMPT_CUDA -I. -c mpt_cuda.cu \
        -o "$B/mpt_cuda.o" 2>"$B/nvcc.log"; then
        record "compile mpt_cuda.cu with nvcc" pass
    else
        cat "$B/nvcc.log"
        record "compile mpt_cuda.cu with nvcc" fail "see $B/nvcc.log"
    fi
    # with the NCCL collectives (several GPUs), where NCCL's header is
    if [ -x "$nvcc" ] && echo '#include <nccl.h>' | "$nvcc" -x cu -E - >/dev/null 2>&1; then
        if "$nvcc" -std=c++17 -arch=sm_90 -Werror all-warnings -DMPT_CUDA -DMPT_NCCL -I. \
            -c mpt_cuda.cu -o "$B/mpt_cuda_nccl.o" 2>"$B/nvcc_nccl.log"; then
            record "compile mpt_cuda.cu with nvcc -DMPT_NCCL" pass
        else
            cat "$B/nvcc_nccl.log"
            record "compile mpt_cuda.cu with nvcc -DMPT_NCCL" fail "see $B/nvcc_nccl.log"
        fi
    fi
}

# What ./build.sh builds (-O2 -g, warnings as errors, no sanitizers: gcc
# warns of other things there than under them), checked here so that the
# README's first command keeps working.
build_all_check() {
    if build_all >"$B/build_all.log" 2>&1; then
        record "./build.sh: every test, benchmark and example builds at $OPT with $WARN" pass
    else
        cat "$B/build_all.log"
        record "./build.sh: every test, benchmark and example builds" fail "see above"
    fi
}

# Each example as the README's table builds it (run in examples/, the
# output into build/readme/): the line a reader copies must work.
readme_example_checks() {
    local line cmd name
    mkdir -p "$B/readme"
    while IFS= read -r line; do
        cmd=${line%% && *}
        name=${cmd##* -o }
        if (cd examples && eval "${cmd% -o *} -o ../$B/readme/$name") >"$B/readme/$name.log" 2>&1; then
            record "README: (cd examples && $cmd)" pass
        else
            cat "$B/readme/$name.log"
            record "README: (cd examples && $cmd)" fail "see above"
        fi
    done < <(grep -o '`cc -O2 [^`]*`' README.md | tr -d '`' | grep ' -o ')
}

# The hand-written SGD loop must learn its toy problem (two rings, not
# linearly separable) under every policy.
example_checks() {
    local p acc
    if ! cc_prog hand_sgd examples/hand_sgd.c $SAN 2>"$B/hand_sgd.log"; then
        cat "$B/hand_sgd.log"
        record "build examples/hand_sgd.c" fail "compile error (see above)"
        return
    fi
    for p in float32 mixed_float16 mixed_bfloat16; do
        acc=$("./$B/hand_sgd" $p | sed -n 's/.*"train_accuracy":\([0-9.]*\).*/\1/p')
        if [ -n "$acc" ] && awk "BEGIN{exit !($acc >= 0.98)}"; then
            record "examples/hand_sgd $p learns the rings (train accuracy $acc >= 0.98)" pass
        else
            record "examples/hand_sgd $p learns the rings" fail "train accuracy '${acc}' < 0.98"
        fi
    done
    hand_loss_scaling_checks
}

# The field NAME of a JSON line (numbers only).
json_number() { sed -n "s/.*\"$1\":\([-0-9.e+]*\).*/\1/p"; }

# The loss-scaling loop by hand: it learns the rings, and in float16 its
# scale (2^32 at first) overflows, backs off and grows again.
hand_loss_scaling_checks() {
    local p out acc skipped shrinks growths final
    if ! cc_prog hand_loss_scaling examples/hand_loss_scaling.c $SAN 2>"$B/hand_ls.log"; then
        cat "$B/hand_ls.log"
        record "build examples/hand_loss_scaling.c" fail "compile error (see above)"
        return
    fi
    for p in mixed_float16 float32 mixed_bfloat16; do
        out=$("./$B/hand_loss_scaling" $p | tail -n 1)
        acc=$(echo "$out" | json_number train_accuracy)
        if [ -n "$acc" ] && awk "BEGIN{exit !($acc >= 0.98)}"; then
            record "examples/hand_loss_scaling $p learns the rings (train accuracy $acc >= 0.98)" pass
        else
            record "examples/hand_loss_scaling $p learns the rings" fail "train accuracy '${acc}' < 0.98"
        fi
    done
    out=$("./$B/hand_loss_scaling" mixed_float16 | tail -n 1)
    skipped=$(echo "$out" | json_number skipped_steps)
    shrinks=$(echo "$out" | json_number scale_shrinks)
    growths=$(echo "$out" | json_number scale_growths)
    final=$(echo "$out" | json_number final_loss_scale)
    if [ "${skipped:-0}" -ge 1 ] && [ "${shrinks:-0}" -ge 1 ] && [ "${growths:-0}" -ge 1 ] &&
        awk "BEGIN{exit !(${final:-0} > 0 && ${final:-0} < 4294967296)}"; then
        record "examples/hand_loss_scaling mixed_float16 skips $skipped steps, shrinks the scale $shrinks times, grows it $growths times" pass
    else
        record "examples/hand_loss_scaling mixed_float16 adjusts its scale" fail \
            "skipped '$skipped', shrinks '$shrinks', growths '$growths', final scale '$final' in: $out"
    fi
}

# True when PY_VENV's Python has every package of PY_PACKAGES (read from
# their metadata: no import, no network).
python_env_complete() {
    [ -x "$PY_VENV/bin/python" ] &&
        "$PY_VENV/bin/python" -c 'import sys, importlib.metadata as m
for p in sys.argv[1:]: m.version(p)' $PY_PACKAGES >/dev/null 2>&1
}

# The Python of the interoperability tests: a virtual environment (PY_VENV)
# with PY_PACKAGES from PyPI, made and filled only when something is missing,
# so a re-run costs one Python start. The tests run $MPT_TEST_PYTHON; with
# MPT_TEST_PYTHON_REQUIRED=1 (everything installed) a test that cannot import
# a package fails instead of skipping. Where PyPI cannot be reached the tests
# skip, and this says why.
python_env() {
    local index=${PIP_INDEX_URL:-https://pypi.org/simple}
    if ! python_env_complete; then
        if [ ! -x "$PY_VENV/bin/python" ] && ! python3 -m venv "$PY_VENV" >"$B/venv.log" 2>&1; then
            cat "$B/venv.log"
            record "Python environment for the interop tests ($PY_VENV)" fail \
                "python3 -m venv failed (Debian: apt-get install python3-venv)"
            return
        fi
        echo "build.sh: installing $PY_PACKAGES into $PY_VENV"
        if ! "$PY_VENV/bin/python" -m pip install -q --retries 1 --timeout 30 $PY_PACKAGES \
            >>"$B/venv.log" 2>&1; then
            if ! "$PY_VENV/bin/python" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=20)' "$index/" >/dev/null 2>&1; then
                echo "build.sh: cannot reach $index: the Python packages ($PY_PACKAGES) are" \
                    "not installed and the interop tests that need them skip" >&2
                return
            fi
            cat "$B/venv.log"
            record "Python environment for the interop tests ($PY_VENV)" fail \
                "pip could not install $PY_PACKAGES (see above)"
            return
        fi
    fi
    export MPT_TEST_PYTHON=$PWD/$PY_VENV/bin/python MPT_TEST_PYTHON_REQUIRED=1
}

# nvcc from $NVCC, the PATH or /usr/local/cuda; fails when there is none.
find_nvcc() {
    local nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    [ -x "$nvcc" ] && echo "$nvcc"
}

CUDA_LIBS="-lcublasLt -lcublas"

# count_output NAME OUT RC: adds a test program's PASS/FAIL/SKIP lines (in
# the file OUT) to the totals; a crash without a FAIL line is a failure.
count_output() {
    passed=$((passed + $(grep -c '^PASS ' "$2")))
    failed=$((failed + $(grep -c '^FAIL ' "$2")))
    skipped=$((skipped + $(grep -c '^SKIP ' "$2")))
    if [ "$3" -ne 0 ] && ! grep -q '^FAIL ' "$2"; then
        record "$1 exits cleanly" fail "exit status $3"
    fi
}

# tests/test_cuda.c once more, built by nvcc with the CUDA backend (the loop
# in run_tests builds it with gcc, without MPT_CUDA, where it only skips).
# Not under AddressSanitizer, which does not run with the CUDA runtime. On a
# machine without a device it checks the fallback to the CPU and skips the
# comparisons. Nothing to do before mpt_cuda.cu exists, or without nvcc.
cuda_test() {
    local nvcc name=test_cuda_nvcc out rc
    nvcc=$(find_nvcc) || return 0
    [ -e mpt_cuda.cu ] || return 0
    if ! "$nvcc" -std=c++17 -O2 -arch=sm_90 -Werror all-warnings -DMPT_CUDA -I. \
        -x cu tests/test_cuda.c mpt_cuda.cu -o "$B/$name" $LIBS $CUDA_LIBS \
        2>"$B/$name.build.log"; then
        cat "$B/$name.build.log"
        record "build tests/test_cuda.c with nvcc" fail "compile error (see above)"
        return
    fi
    out=$B/$name.out
    timeout 1800 "./$B/$name" >"$out" 2>&1
    rc=$?
    cat "$out"
    count_output "$name" "$out" $rc
}

# Where no GPU is reached, ./build.sh gpu must fail, not pass: under
# MPT_REQUIRE_GPU=1 test_cuda (the gcc build always, the nvcc one where it
# found no device) and bench_cuda exit with an error.
required_gpu_checks() {
    local prog out
    for prog in test_cuda test_cuda_nvcc; do
        [ -x "$B/$prog" ] || continue
        [ $prog = test_cuda ] || grep -q '^SKIP .*no CUDA device' "$B/$prog.out" 2>/dev/null ||
            continue
        out=$B/$prog.required.out
        MPT_REQUIRE_GPU=1 ASAN_OPTIONS=detect_leaks=1 timeout 600 "./$B/$prog" >"$out" 2>&1
        if [ $? -ne 0 ] && grep -q '^FAIL a CUDA device is reached' "$out"; then
            record "$prog without a device under MPT_REQUIRE_GPU=1 fails" pass
        else
            cat "$out"
            record "$prog without a device under MPT_REQUIRE_GPU=1 fails" fail "it passed (see above)"
        fi
    done
    if [ -x "$B/bench_cuda" ]; then
        if MPT_REQUIRE_GPU=1 timeout 60 "./$B/bench_cuda" gemm >"$B/bench_cuda.required.out" 2>&1; then
            record "bench_cuda without a device under MPT_REQUIRE_GPU=1 fails" fail "exit status 0"
        else
            record "bench_cuda without a device under MPT_REQUIRE_GPU=1 fails" pass
        fi
    fi
}

# The multi-worker strategy: tests/mpi_strategy.c built with mpicc
# -DMPT_MPI and run by mpirun as two processes on this machine, one
# scenario at a time (see the file). "dies" kills a worker: passing means
# mpirun ended the job, with an error, well inside its time limit.
mpi_tests() {
    local sc out rc start secs
    if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
        record "multi-worker strategy (mpirun -np 2)" skip "no mpicc/mpirun (openmpi-bin, libopenmpi-dev)"
        return
    fi
    # the implementation as a CUDA and MPI build compiles it (GPU workers)
    if mpicc -std=c99 $WARN -DMPT_MPI -DMPT_CUDA -DMPT_IMPLEMENTATION -x c -c mpt.h \
        -o "$B/mpt_mpi_cuda.o" 2>"$B/mpt_mpi_cuda.log"; then
        record "compile mpt.h with MPT_MPI and MPT_CUDA" pass
    else
        cat "$B/mpt_mpi_cuda.log"
        record "compile mpt.h with MPT_MPI and MPT_CUDA" fail "see above"
    fi
    if ! mpicc -std=c99 $WARN $OPT -DMPT_MPI -I. tests/mpi_strategy.c -o "$B/mpi_strategy" \
        -lpthread -lm -lz 2>"$B/mpi_strategy.build.log"; then
        cat "$B/mpi_strategy.build.log"
        record "build tests/mpi_strategy.c with mpicc" fail "compile error (see above)"
        return
    fi
    for sc in match differ stuck dies; do
        out=$B/mpi_strategy.$sc.out
        start=$(date +%s)
        timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 \
            "./$B/mpi_strategy" "$sc" >"$out" 2>&1
        rc=$?
        secs=$(($(date +%s) - start))
        grep -E '^(PASS|FAIL|SKIP|#) ' "$out"
        if [ "$sc" = dies ]; then
            if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $secs -lt 60 ]; then
                record "mpi dies: the job ends when a worker exits mid-step (${secs}s)" pass
            else
                record "mpi dies: the job ends when a worker exits mid-step" fail \
                    "exit status $rc after ${secs}s"
            fi
            continue
        fi
        passed=$((passed + $(grep -c '^PASS ' "$out")))
        failed=$((failed + $(grep -c '^FAIL ' "$out")))
        if [ $rc -eq 124 ] || ! grep -q '^PASS ' "$out"; then
            cat "$out"
            record "mpi $sc" fail "exit status $rc after ${secs}s, no PASS line"
        fi
    done
}

# ---- fuzzing: tests/fuzz/, libFuzzer with clang ---------------------------
#
# One harness per file loader: fuzz_<name>.c for each name below. Seed
# corpora are files mpt.h itself writes, made by tests/fuzz/seeds.c into
# $FUZZ/seeds/<name>; what a run finds to be new is kept in
# $FUZZ/corpus/<name> for the next run. Inputs that once crashed a harness
# live in tests/fuzz/findings/<name>/ and are replayed before every run.

FUZZ_HARNESSES="idx idx_gzip weights checkpoint"
FUZZ=$B/fuzz
FUZZ_CC=${FUZZ_CC:-clang}
FUZZ_FLAGS="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -g -O1"
FUZZ_TEST_SECONDS=30 # per harness, in ./build.sh test

fuzz_dict() {
    case $1 in
    idx*) echo tests/fuzz/idx.dict ;;
    *) echo tests/fuzz/safetensors.dict ;;
    esac
}

# The seeds, then every harness (in parallel: each is a whole mpt.h under
# three sanitizers). Records a failure for what does not build.
fuzz_build() {
    local name
    mkdir -p "$FUZZ"
    if ! command -v "$FUZZ_CC" >/dev/null; then
        record "fuzz harnesses" fail "no $FUZZ_CC (Debian: clang libclang-rt-14-dev)"
        return 1
    fi
    rm -rf "$FUZZ/seeds" "$FUZZ"/*.build.failed
    for name in $FUZZ_HARNESSES; do mkdir -p "$FUZZ/seeds/$name" "$FUZZ/corpus/$name"; done
    if ! $CC -std=c99 $WARN -O1 -g -I. tests/fuzz/seeds.c -o "$FUZZ/seeds_gen" $LIBS \
        2>"$FUZZ/seeds.log" || ! "./$FUZZ/seeds_gen" "$FUZZ/seeds" 2>>"$FUZZ/seeds.log"; then
        cat "$FUZZ/seeds.log"
        record "fuzz seed corpora (tests/fuzz/seeds.c)" fail "see above"
        return 1
    fi
    for name in $FUZZ_HARNESSES; do
        while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n; done
        { "$FUZZ_CC" -std=c99 $WARN $FUZZ_FLAGS -I. "tests/fuzz/fuzz_$name.c" \
            -o "$FUZZ/fuzz_$name" $LIBS 2>"$FUZZ/$name.build.log" ||
            touch "$FUZZ/$name.build.failed"; } &
    done
    wait
    for name in $FUZZ_HARNESSES; do
        [ -e "$FUZZ/$name.build.failed" ] || continue
        cat "$FUZZ/$name.build.log"
        record "build tests/fuzz/fuzz_$name.c with $FUZZ_CC" fail "compile error (see above)"
    done
}

# fuzz_replay NAME: every committed finding of NAME's harness, once.
fuzz_replay() {
    local name=$1 dir=tests/fuzz/findings/$1 log=$FUZZ/$1.replay.log
    local -a inputs
    mapfile -t inputs < <(find "$dir" -type f ! -name .gitkeep 2>/dev/null | sort)
    [ ${#inputs[@]} -gt 0 ] || return 0
    if "./$FUZZ/fuzz_$name" "${inputs[@]}" >"$log" 2>&1; then
        record "fuzz_$name: the ${#inputs[@]} past finding(s) in $dir load or fail cleanly" pass
    else
        tail -40 "$log"
        record "fuzz_$name: replaying $dir" fail "$(grep -m1 -E 'ERROR|^fuzz: ' "$log")"
    fi
}

# fuzz_run NAME SECONDS: NAME's harness for SECONDS on its corpus and seeds,
# with its dictionary. An input that crashes it is left in
# $FUZZ/artifacts/NAME/ (fix mpt.h, then add it to tests/fuzz/findings/NAME/).
fuzz_run() {
    local name=$1 secs=$2 log=$FUZZ/$1.log runs rc why input
    mkdir -p "$FUZZ/artifacts/$name"
    UBSAN_OPTIONS=print_stacktrace=1 "./$FUZZ/fuzz_$name" -max_total_time="$secs" -timeout=10 \
        -dict="$(fuzz_dict "$name")" -print_final_stats=1 \
        -artifact_prefix="$FUZZ/artifacts/$name/" "$FUZZ/corpus/$name" "$FUZZ/seeds/$name" \
        >"$log" 2>&1
    rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    if [ $rc -eq 0 ] && [ -n "$runs" ]; then
        record "fuzz_$name for ${secs}s: $runs inputs, no crash" pass
    else
        tail -60 "$log"
        why=$(grep -m1 -E 'ERROR|^fuzz: ' "$log")
        input=$(sed -n 's/.*Test unit written to //p' "$log" | head -1)
        record "fuzz_$name for ${secs}s" fail "$why (the input: ${input:-none written})"
    fi
}

# fuzz_all SECONDS: build, replay the findings, then fuzz each harness.
fuzz_all() {
    local name
    fuzz_build || return
    for name in $FUZZ_HARNESSES; do
        [ -x "$FUZZ/fuzz_$name" ] && [ ! -e "$FUZZ/$name.build.failed" ] || continue
        fuzz_replay "$name"
        fuzz_run "$name" "$1"
    done
}

run_tests() {
    install_packages
    python_env
    build_all_check
    compile_checks
    cuda_compile_check
    readme_example_checks
    example_checks
    local t name out
    for t in tests/test_*.c; do
        name=$(basename "$t" .c)
        if ! cc_prog "$name" "$t" $SAN 2>"$B/$name.build.log"; then
            cat "$B/$name.build.log"
            record "build $name" fail "compile error (see above)"
            continue
        fi
        out=$B/$name.out
        # A hung test (a deadlocked loader thread, say) fails instead of stalling CI.
        ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
            timeout 900 "./$B/$name" >"$out" 2>&1
        local rc=$?
        cat "$out"
        passed=$((passed + $(grep -c '^PASS ' "$out")))
        failed=$((failed + $(grep -c '^FAIL ' "$out")))
        skipped=$((skipped + $(grep -c '^SKIP ' "$out")))
        if [ $rc -ne 0 ] && ! grep -q '^FAIL ' "$out"; then
            record "$name exits cleanly" fail "exit status $rc"
        fi
    done
    cuda_test
    required_gpu_checks
    mpi_tests
    fuzz_all $FUZZ_TEST_SECONDS
    echo "$passed passed, $failed failed, $skipped skipped"
    [ $failed -eq 0 ]
}

# A Python whose torch sees a CUDA device: $TORCH_PYTHON, python3 or
# /usr/bin/python3 (Debian's torch), the first that does.
find_torch_gpu_python() {
    local py
    for py in ${TORCH_PYTHON:-} python3 /usr/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1 &&
            { echo "$py"; return 0; }
    done
    return 1
}

# ./build.sh gpu. Every program is built with -arch=native where nvcc can
# ask the device (else sm_90), mpt_cuda.cu compiled once and linked into
# each. examples/mlp.c is C99 (compound literals), so gcc compiles it, with
# MPT_CUDA, and nvcc links it. The summary lists the test counts and every
# JSON line the benchmarks printed.
run_gpu() {
    local nvcc arch flags py p rc=0 out line
    local -a results=()
    nvcc=$(find_nvcc) || { echo "build.sh gpu: needs nvcc (set NVCC=...)" >&2; return 1; }
    [ -e mpt_cuda.cu ] || { echo "build.sh gpu: mpt_cuda.cu is missing" >&2; return 1; }
    if ! nvidia-smi -L >"$B/gpu.devices" 2>&1 || ! grep -q '^GPU ' "$B/gpu.devices"; then
        cat "$B/gpu.devices" >&2
        echo "build.sh gpu: no CUDA device (nvidia-smi -L lists none)" >&2
        return 1
    fi
    install_packages
    echo '__global__ void k(void) {}' >"$B/arch_check.cu"
    arch=sm_90 # nvcc falls back to a default, with only a warning, when it finds no GPU
    "$nvcc" -arch=native -c "$B/arch_check.cu" -o "$B/arch_check.o" >"$B/arch_check.log" 2>&1 &&
        ! grep -qi "cannot find valid GPU" "$B/arch_check.log" && arch=native
    flags="-std=c++17 -O2 -arch=$arch -Werror all-warnings -DMPT_CUDA -I."
    echo "build.sh gpu: $(head -1 "$B/gpu.devices"), nvcc -arch=$arch"
    if ! "$nvcc" $flags -c mpt_cuda.cu -o "$B/mpt_cuda_gpu.o" 2>"$B/gpu_build.log" ||
        ! "$nvcc" $flags -x cu -c tests/test_cuda.c -o "$B/test_cuda_gpu.o" 2>>"$B/gpu_build.log" ||
        ! "$nvcc" $flags -x cu -c bench/bench_cuda.c -o "$B/bench_cuda_gpu.o" 2>>"$B/gpu_build.log" ||
        ! $CC -std=c99 $WARN $OPT -DMPT_CUDA -I. -c examples/mlp.c -o "$B/mlp_gpu.o" \
            2>>"$B/gpu_build.log"; then
        cat "$B/gpu_build.log"
        echo "build.sh gpu: compile error (see above)" >&2
        return 1
    fi
    for p in test_cuda bench_cuda mlp; do
        if ! "$nvcc" -arch=$arch "$B/${p}_gpu.o" "$B/mpt_cuda_gpu.o" -o "$B/${p}_gpu" \
            $LIBS $CUDA_LIBS 2>>"$B/gpu_build.log"; then
            cat "$B/gpu_build.log"
            echo "build.sh gpu: link error (see above)" >&2
            return 1
        fi
    done

    out=$B/test_cuda_gpu.out
    "./$B/test_cuda_gpu" 2>&1 | tee "$out"
    count_output test_cuda_gpu "$out" "${PIPESTATUS[0]}"
    [ $failed -eq 0 ] || rc=1

    "./$B/mlp_gpu" --verbose 2 2>&1 | tee "$B/mlp_gpu.out"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    "./$B/bench_cuda_gpu" 2>&1 | tee "$B/bench_cuda_gpu.out"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    if py=$(find_torch_gpu_python); then
        "$py" bench/torch_gpu_train.py 2>&1 | tee "$B/torch_gpu_train.out"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    else
        echo "build.sh gpu: no Python with a CUDA-enabled torch; bench/torch_gpu_train.py not run" |
            tee "$B/torch_gpu_train.out"
    fi

    echo
    echo "## ./build.sh gpu: $(head -1 "$B/gpu.devices")"
    echo
    echo "| step | result |"
    echo "|---|---|"
    echo "| tests/test_cuda.c | $passed passed, $failed failed, $skipped skipped |"
    while IFS= read -r line; do results+=("| examples/mlp.c | $line |"); done \
        < <(grep '^{' "$B/mlp_gpu.out")
    while IFS= read -r line; do results+=("| bench/bench_cuda.c | $line |"); done \
        < <(grep '^{' "$B/bench_cuda_gpu.out")
    while IFS= read -r line; do results+=("| bench/torch_gpu_train.py | $line |"); done \
        < <(grep '^{' "$B/torch_gpu_train.out")
    [ ${#results[@]} -gt 0 ] && printf '%s\n' "${results[@]}"
    grep -q '^{' "$B/torch_gpu_train.out" || echo "| bench/torch_gpu_train.py | not run |"
    return $rc
}

case ${1:-all} in
all) build_all ;;
test) run_tests ;;
run)
    install_packages
    cc_prog mlp examples/mlp.c || exit 1
    shift
    "./$B/mlp" --verbose 1 "$@"
    ;;
bench)
    build_all || exit 1
    for b in bench/*.c; do "./$B/$(basename "$b" .c)"; done
    ;;
gpu) run_gpu ;;
fuzz)
    install_packages
    fuzz_all "${2:-60}"
    echo "$passed passed, $failed failed"
    [ $failed -eq 0 ]
    ;;
*) echo "usage: ./build.sh [all|test|bench|run|gpu|fuzz [seconds]]" >&2; exit 2 ;;
esac

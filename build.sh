#!/usr/bin/env bash
# Builds and tests mpt.h.
#   ./build.sh run      install what training needs (as root: a C compiler,
#                       zlib, Fashion-MNIST) and train examples/mlp.c with the
#                       progress bar
#   ./build.sh test     the quick check (about 10 minutes on 2 cores): every
#                       test program's cases that need no PyPI package, MPI,
#                       nvcc or fuzzing (Debian's python3 reads the SVG
#                       plots back), under UBSan (and AddressSanitizer where
#                       the program uses only the public API), plus the
#                       hand-written training loops; ends with
#                       "N passed, N failed, N skipped" and the time taken
#   ./build.sh check    the full check (what CI runs, about 30 minutes): the
#                       plain build with warnings as errors, mpt.h as C99,
#                       C11, C++17 and portable C, every test under
#                       AddressSanitizer + UBSan, the interop tests in the
#                       real runtimes (Python packages into build/venv), MPI,
#                       nvcc and the GPU pack where nvcc is, fuzzing each
#                       loader for 30 s, the README's build lines
#   ./build.sh          build the tests, examples and benchmarks (gcc -O2 -g,
#                       warnings as errors) into build/; only what changed is
#                       rebuilt
#   ./build.sh fuzz [seconds]
#                       fuzz each file loader (tests/fuzz/, libFuzzer with
#                       clang) for that long (default 60 s) after replaying
#                       tests/fuzz/findings/
#   ./build.sh bench    build and run the CPU benchmarks (results: bench/RESULTS.md)
#   ./build.sh gpu [build|test|sanitize|bench|torch|all] [--data DIR] [--out DIR]
#                       on a machine with nvcc and a CUDA device (nothing
#                       installed, every program under timeout): build with
#                       the CUDA backend (-arch=sm_90), run tests/test_cuda.c
#                       (also with NCCL where it is), examples/mlp.c,
#                       compute-sanitizer, bench/bench_cuda.c and (where
#                       PyTorch sees the GPU) bench/torch_gpu_train.py, and
#                       end with a summary table naming the device; fails
#                       when no GPU is reached (see bench/GPU.md)
#   ./build.sh gpu-data [SRC]
#                       copy Fashion-MNIST into data/fashion-mnist (git-ignored)
#                       to carry to a GPU machine
#   ./build.sh gpu-pack build the GPU programs here (sm_90a), stripped, with
#                       the data, into build/gpu-pack (and gzip'ed, to
#                       carry: build/gpu-pack.tar.gz); on the GPU machine
#                       GPU_PREBUILT=build/gpu-pack ./build.sh gpu STEP runs
#                       them without building
set -uo pipefail
cd "$(dirname "$0")"

CC=${CC:-gcc}
CXX=${CXX:-g++}
WARN="-Wall -Wextra -Werror"
OPT="-O2 -g"
LIBS="-lpthread -lm -lz"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
UBSAN="-fsanitize=undefined -fno-sanitize-recover=undefined"
B=build
JOBS=${JOBS:-$(nproc)}
STARTED=$(date +%s)
mkdir -p "$B"

# Debian packages, installed only when missing and root. Training needs a C
# compiler, zlib and the data; the full check also MPI, python3-venv (the
# interop tests' virtual environment) and clang with its runtime libraries
# (libFuzzer: the fuzz harnesses).
# The quick test also needs Debian's python3 (no PyPI package): tests/test_plot.c
# reads the SVG plots back with Python's own XML parser.
DEB_TRAIN="zlib1g-dev dataset-fashion-mnist"
DEB_TEST="$DEB_TRAIN python3"
DEB_CHECK="$DEB_TEST openmpi-bin libopenmpi-dev python3-venv clang libclang-rt-14-dev"

# Python packages (PyPI names) the interoperability tests import; pip installs
# them into PY_VENV when one is missing (python_env). onnxruntime, onnx (its
# checker) and ai-edge-litert (LiteRT's interpreter) run the exported models.
# tensorboard-plugin-profile serves fit's profiler trace (<host>.trace.json.gz):
# 2.19.0 is the last version that reads that file (later ones read only
# <host>.xplane.pb); it holds protobuf below 5, and so TensorBoard at 2.20.
PY_PACKAGES="safetensors numpy tensorboard onnxruntime onnx ai-edge-litert
tensorboard-plugin-profile==2.19.0"
PY_VENV=$B/venv

# install_packages PACKAGES...: the Debian packages (and gcc, g++) not yet
# installed, when root.
install_packages() {
    local missing=() p
    command -v "$CC" >/dev/null && command -v "$CXX" >/dev/null || missing+=(gcc g++ libc6-dev)
    for p in "$@"; do
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
        echo "build.sh: apt-get install failed; what needs those packages will fail" >&2
}

# ---- building: the implementation compiled once, programs when they change --
#
# A program that uses only the public API (it compiles with
# -DMPT_NO_IMPLEMENTATION, and sets no MPT_ option of its own) is compiled
# so and linked with one implementation object per set of flags; any other
# program compiles the implementation itself. Every object is rebuilt only
# when a checksum of its inputs (the flags, its source, mpt.h, its
# folder's headers and examples/'s, which bench/ shares) changed: taken
# before the compiler reads them, so an edit during a build is not lost.
#
# A flavour names a set of flags and a folder:
#   plain   -O2 -g, warnings as errors: what ./build.sh builds, into build/
#   asan    AddressSanitizer + UBSan, into build/asan/
#   ubsan   UBSan, into build/ubsan/
# The ~30 test programs that compile the implementation themselves are
# most of ./build.sh check's time, so the sanitizer flavours compile for
# speed: -Og (with ASan 60 % of -O1's time: 48 s against 82 s for
# tests/test_inputs.c) and -g1 (line tables only: a sanitizer's report
# still names every frame's file and line, and the compile takes half of
# -g's time: 21 s of a core against 41 s for tests/test_context.c; rebuild
# with -g to see variables in a debugger).
flavour_flags() {
    case $1 in
    plain) echo "-std=c99 $WARN $OPT" ;;
    asan) echo "-std=c99 $WARN -Og -g1 $SAN" ;;
    ubsan) echo "-std=c99 $WARN -Og -g1 $UBSAN" ;;
    esac
}
flavour_dir() { if [ "$1" = plain ]; then echo "$B"; else echo "$B/$1"; fi; }

# True when SOURCE can link the shared implementation object: it defines
# no MPT_ option and compiles without the implementation (a private name or
# a private struct's field does not). The answer is kept in $B/api/ for the
# same source, headers and mpt.h.
uses_public_api_only() {
    local src=$1 name answer
    name=$(basename "$src" .c)
    answer=$B/api/$name.$(cat "$src" mpt.h "$(dirname "$src")"/*.h examples/*.h 2>/dev/null |
        md5sum | cut -c1-32)
    if [ ! -e "$answer" ]; then
        mkdir -p "$B/api" && rm -f "$B/api/$name".*
        if ! grep -qE '^#define MPT_(NO_|STATIC|CUDA|MPI)' "$src" &&
            $CC -std=c99 $WARN -fsyntax-only -DMPT_NO_IMPLEMENTATION -I. "$src" >/dev/null 2>&1; then
            echo 1 >"$answer"
        else
            echo 0 >"$answer"
        fi
    fi
    [ "$(cat "$answer")" = 1 ]
}

# inputs_sum FLAGS SOURCE: the checksum that decides a rebuild.
inputs_sum() { { echo "$1"; cat "$2" mpt.h "$(dirname "$2")"/*.h examples/*.h 2>/dev/null; } | md5sum; }

# impl_object FLAVOUR: DIR/obj/mpt.o, the implementation, when stale.
impl_object() {
    local dir sum o
    dir=$(flavour_dir "$1")/obj && o=$dir/mpt.o
    mkdir -p "$dir"
    sum=$(impl_sum "$1")
    if [ -e "$o" ] && [ "$(cat "$o.sum" 2>/dev/null)" = "$sum" ]; then
        rm -f "$o.building"
        return 0
    fi
    rm -f "$o" "$o.sum"
    printf '#define MPT_IMPLEMENTATION\n#include "mpt.h"\n' >"$dir/mpt_impl.c"
    if ! $CC $(flavour_flags "$1") -I. -c "$dir/mpt_impl.c" -o "$o.tmp" 2>"$o.log"; then
        cat "$o.log"
        rm -f "$o.building"
        return 1
    fi
    echo "$sum" >"$o.sum" && mv "$o.tmp" "$o"
    rm -f "$o.building"
    echo "compiled mpt.h"
}

# impl_sum FLAVOUR: the checksum that decides whether mpt.o is rebuilt.
impl_sum() { { flavour_flags "$1"; cat mpt.h; } | md5sum; }

# impl_prepare FLAVOUR: before jobs that link mpt.o start (and the job
# that builds it, impl_job): a stale one removed, and DIR/obj/mpt.o.building
# left until impl_object has done, so that build_program waits for it.
impl_prepare() {
    local o
    o=$(flavour_dir "$1")/obj/mpt.o
    mkdir -p "$(dirname "$o")"
    touch "$o.building"
    [ "$(cat "$o.sum" 2>/dev/null)" = "$(impl_sum "$1")" ] || rm -f "$o" "$o.sum"
}

# build_program FLAVOUR SOURCE: DIR/NAME from SOURCE, when stale (the
# shared implementation object must be built first). Prints the errors.
build_program() {
    local flavour=$1 src=$2 name dir flags sum o impl=()
    name=$(basename "$src" .c) && dir=$(flavour_dir "$flavour") && flags=$(flavour_flags "$flavour")
    o=$dir/obj/$name.o
    mkdir -p "$dir/obj"
    if uses_public_api_only "$src"; then
        flags="$flags -DMPT_NO_IMPLEMENTATION"
        impl=("$dir/obj/mpt.o")
    else
        # The implementation's functions the program does not call are
        # then left out instead of compiled.
        flags="$flags -DMPT_STATIC -Wno-unused-function"
    fi
    sum=$(inputs_sum "$flags" "$src")
    if [ ! -e "$o" ] || [ "$(cat "$o.sum" 2>/dev/null)" != "$sum" ]; then
        rm -f "$o" "$o.sum"
        $CC $flags -I. -c "$src" -o "$o" 2>"$o.log" || { cat "$o.log"; return 1; }
        echo "$sum" >"$o.sum"
        echo "compiled $src"
    fi
    if [ ${#impl[@]} -gt 0 ]; then
        while [ -e "${impl[0]}.building" ]; do sleep 1; done
        [ -e "${impl[0]}" ] || impl_object "$flavour" >/dev/null ||
            { echo "mpt.h does not compile (see ${impl[0]}.log)"; return 1; }
    fi
    $CC $(flavour_flags "$flavour") "$o" "${impl[@]}" -o "$dir/$name" $LIBS 2>"$o.link.log" ||
        { cat "$o.link.log"; return 1; }
}

# timed COMMAND...: COMMAND, then a line saying how long it took (the
# jobs of the check's first queue: which one to make cheaper next).
timed() {
    local t0 rc
    t0=$(date +%s)
    "$@"
    rc=$?
    echo "  $*: $(($(date +%s) - t0)) s"
    return $rc
}

# spawn COMMAND...: COMMAND in the background, at most JOBS at a time.
spawn() {
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    "$@" &
}

# Every benchmark and example (what ./build.sh builds; the tests are built
# by ./build.sh test and check), JOBS at a time; says what it builds; fails
# if any program does not build.
build_all() {
    local src name ok=0 n=0
    local -a sources
    # those that compile the implementation themselves first, while the
    # shared object builds
    mapfile -t sources < <(for src in examples/*.c bench/*.c; do
        uses_public_api_only "$src" && echo "1 $src" || echo "0 $src"; done | sort | cut -d' ' -f2)
    mkdir -p "$B/obj" && rm -f "$B"/obj/*.failed
    echo "build.sh: building into $B/ (gcc $OPT, $WARN; only what changed)"
    impl_prepare plain
    spawn impl_job plain
    for src in "${sources[@]}"; do
        name=$(basename "$src" .c)
        spawn build_all_job "$src"
        n=$((n + 1))
    done
    wait
    for src in "${sources[@]}"; do
        name=$(basename "$src" .c)
        [ -e "$B/obj/$name.failed" ] || continue
        echo "$src:" && cat "$B/obj/$name.errors"
        ok=1
    done
    [ $ok -eq 0 ] && echo "build.sh: $n programs up to date in $B/ ($(elapsed))"
    return $ok
}

# build_all_job SOURCE: build_program plain, and a line saying what it did.
build_all_job() {
    local name t0=$(date +%s)
    name=$(basename "$1" .c)
    if ! build_program plain "$1" >"$B/obj/$name.errors" 2>&1; then
        touch "$B/obj/$name.failed"
        echo "  $name: does not build"
    elif grep -q '^compiled ' "$B/obj/$name.errors"; then
        echo "  $name: compiled ($(($(date +%s) - t0)) s)"
    fi
}

# Seconds since build.sh started, as "M min S s".
elapsed() {
    local s=$(($(date +%s) - STARTED))
    echo "$((s / 60)) min $((s % 60)) s"
}

passed=0
failed=0
skipped=0
omitted=0

# record NAME STATUS [WHY]: a check that build.sh itself runs.
record() {
    case $2 in
    pass) passed=$((passed + 1)); echo "PASS $1" ;;
    skip) skipped=$((skipped + 1)); echo "SKIP $1: $3" ;;
    *) failed=$((failed + 1)); echo "FAIL $1: $3" ;;
    esac
}

# ---- running the tests ------------------------------------------------------

# count_output NAME OUT RC: adds a test program's PASS/FAIL/SKIP/OMIT lines
# (in the file OUT) to the totals; a crash without a FAIL line is a failure.
count_output() {
    passed=$((passed + $(grep -c '^PASS ' "$2")))
    failed=$((failed + $(grep -c '^FAIL ' "$2")))
    skipped=$((skipped + $(grep -c '^SKIP ' "$2")))
    omitted=$((omitted + $(grep -c '^OMIT ' "$2")))
    if [ "$3" -ne 0 ] && ! grep -q '^FAIL ' "$2"; then
        record "$1 exits cleanly" fail "exit status $3"
    fi
}

# test_job FLAVOUR SOURCE [ARGS...]: builds one program and runs it (under
# timeout: a hung test fails instead of stalling the run); its output goes
# to DIR/NAME.out and its exit status to DIR/NAME.rc, and one line says how
# it went. Runs in the background: it records nothing itself.
test_job() {
    local flavour=$1 src=$2 name dir out rc t0 t1 t2
    shift 2
    name=$(basename "$src" .c) && dir=$(flavour_dir "$flavour")
    out=$dir/$name.out
    rm -f "$out" "$dir/$name.rc"
    t0=$(date +%s)
    if ! build_program "$flavour" "$src" >"$dir/$name.build.log" 2>&1; then
        { cat "$dir/$name.build.log"; echo "FAIL build $src: compile error (see above)"; } >"$out"
        echo 1 >"$dir/$name.rc"
        echo "  $name: does not build"
        return
    fi
    t1=$(date +%s)
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        timeout 900 "./$dir/$name" "$@" >"$out" 2>&1
    rc=$?
    t2=$(date +%s)
    echo $rc >"$dir/$name.rc"
    printf '  %-20s %4d passed, %d failed, %d skipped%s%s (built in %d s, ran in %d s)\n' "$name" \
        "$(grep -c '^PASS ' "$out")" "$(grep -c '^FAIL ' "$out")" "$(grep -c '^SKIP ' "$out")" \
        "$(grep -q '^OMIT ' "$out" && echo ", $(grep -c '^OMIT ' "$out") interop left out")" \
        "$([ $rc -eq 0 ] || echo ", exit status $rc")" $((t1 - t0)) $((t2 - t1))
}

# impl_job FLAVOUR: impl_object, and a line saying what it did (for the
# programs that link the object: build_program waits for it).
impl_job() {
    local errors t0=$(date +%s)
    errors=$(flavour_dir "$1")/obj/mpt.o.errors
    if ! impl_object "$1" >"$errors" 2>&1; then
        echo "  mpt.h ($1 object) does not build:" && cat "$errors"
    elif grep -q '^compiled ' "$errors"; then
        echo "  mpt.h ($1 object): compiled ($(($(date +%s) - t0)) s)"
    fi
}

# The test programs in the order they start: those that compile the
# implementation themselves, the slowest first, then those that link the
# shared object.
TEST_ORDER="test_conv test_train test_data test_quantize test_export test_qat test_faults
test_checkpoint test_pool test_optim test_backend test_strategy test_tensorboard"

# test_sources: the test programs in that order, less TESTS_LEFT_OUT
# (./build.sh test leaves out tests/test_cuda.c, whose cases need a CUDA
# build).
test_sources() {
    local t src
    {
        for t in $TEST_ORDER; do [ -e "tests/$t.c" ] && echo "tests/$t.c"; done
        for src in tests/test_*.c; do
            case " $(echo $TEST_ORDER) " in *" $(basename "$src" .c) "*) continue ;; esac
            uses_public_api_only "$src" || echo "$src"
        done
        for src in tests/test_*.c; do uses_public_api_only "$src" && echo "$src"; done
    } | grep -vxF -e "${TESTS_LEFT_OUT:-none}"
}

# run_test_programs PUBLIC INTERNAL: every tests/test_*.c and the
# hand-written training loops of examples/, JOBS at a time: in flavour
# PUBLIC those that link the shared implementation object, in INTERNAL
# those that compile it themselves. Then their counts, and the failures and
# last lines of each program that failed.
run_test_programs() {
    local public=$1 internal=$2 dir src name rc flavour sources
    # Each program's flavour as it was built, so that a source edited while
    # the tests run is counted from its own output, not a stale one of the
    # other flavour.
    local -A flavour_of
    mkdir -p "$(flavour_dir "$public")/obj" "$(flavour_dir "$internal")/obj"
    echo "build.sh: building and running the tests, $JOBS at a time ($public: those that use" \
        "only the public API; $internal: the others) ($(elapsed))"
    impl_prepare "$public"
    spawn impl_job "$public"
    sources=$(test_sources)
    for src in $sources; do
        flavour_of[$src]=$(test_flavour "$src" "$public" "$internal")
        spawn test_job "${flavour_of[$src]}" "$src"
    done
    for name in hand_sgd hand_loss_scaling; do
        spawn hand_loop_job "$(test_flavour "examples/$name.c" "$public" "$internal")" "$name"
    done
    wait
    for src in $sources; do
        name=$(basename "$src" .c)
        dir=$(flavour_dir "${flavour_of[$src]}")
        rc=$(cat "$dir/$name.rc" 2>/dev/null || echo 1)
        [ -e "$dir/$name.out" ] || echo "FAIL $name: no output" >"$dir/$name.out"
        if [ "$rc" -ne 0 ] || grep -q '^FAIL ' "$dir/$name.out"; then
            echo "---- $name (exit status $rc): its failures and last lines"
            grep '^FAIL ' "$dir/$name.out"
            tail -n 30 "$dir/$name.out"
        fi
        count_output "$name" "$dir/$name.out" "$rc"
    done
    hand_loop_checks "$public" "$internal"
}

# test_flavour SOURCE PUBLIC INTERNAL: the flavour SOURCE builds in.
test_flavour() { if uses_public_api_only "$1"; then echo "$2"; else echo "$3"; fi; }

# hand_loop_job FLAVOUR NAME: builds examples/NAME.c and runs it in each
# policy; the last line of each run in DIR/NAME.POLICY.out.
hand_loop_job() {
    local flavour=$1 name=$2 dir p t0
    dir=$(flavour_dir "$flavour")
    rm -f "$dir/$name".*.out
    t0=$(date +%s)
    if ! build_program "$flavour" "examples/$name.c" >"$dir/$name.build.log" 2>&1; then
        echo "  $name: does not build"
        return
    fi
    for p in float32 mixed_float16 mixed_bfloat16; do
        UBSAN_OPTIONS=print_stacktrace=1 timeout 600 "./$dir/$name" $p 2>&1 | tail -n 1 >"$dir/$name.$p.out"
    done
    echo "  $name: trained in three policies ($(($(date +%s) - t0)) s)"
}

# The field NAME of a JSON line (numbers only).
json_number() { sed -n "s/.*\"$1\":\([-0-9.e+]*\).*/\1/p"; }

# The hand-written loops must learn their toy problem (two rings, not
# linearly separable) under every policy, and in float16 the loss-scaling
# loop's scale (2^32 at first) overflows, backs off and grows again.
hand_loop_checks() {
    local dir name p out acc skipped shrinks growths final
    for name in hand_sgd hand_loss_scaling; do
        dir=$(flavour_dir "$(test_flavour "examples/$name.c" "$1" "$2")")
        if [ ! -e "$dir/$name" ]; then
            cat "$dir/$name.build.log"
            record "build examples/$name.c" fail "compile error (see above)"
            continue
        fi
        for p in float32 mixed_float16 mixed_bfloat16; do
            acc=$(json_number train_accuracy <"$dir/$name.$p.out")
            if [ -n "$acc" ] && awk "BEGIN{exit !($acc >= 0.98)}"; then
                record "examples/$name $p learns the rings (train accuracy $acc >= 0.98)" pass
            else
                record "examples/$name $p learns the rings" fail \
                    "train accuracy '${acc}' < 0.98 in: $(cat "$dir/$name.$p.out")"
            fi
        done
    done
    out=$(cat "$dir/hand_loss_scaling.mixed_float16.out" 2>/dev/null) # dir: the last name's
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

# ---- the full check's own checks -----------------------------------------------

# compile_job KIND: mpt.h built as C99 (-O1), C11 (-O3: some
# maybe-uninitialized warnings show only after its inlining, and would break
# a user's -O3 -Werror build), portable C (no SIMD paths, no zlib, linked
# without -lz) or C++17, in two translation units (one with
# MPT_IMPLEMENTATION), every warning an error; the program runs. Leaves
# $B/compile/KIND.ok, or the errors in $B/compile/KIND.log.
compile_job() {
    local d=$B/compile kind=$1 cc=$CC std ext=c opt=-O1 defs="" libs=$LIBS
    case $kind in
    c99) std=c99 ;;
    c11) std=c11 opt=-O3 ;;
    portable) std=c99 opt=-O2 defs="-DMPT_NO_SIMD -DMPT_NO_ZLIB" libs="-lpthread -lm" ;;
    cxx) std=c++17 cc=$CXX ext=cpp ;;
    esac
    local pedantic=-pedantic
    [ "$kind" = cxx ] && pedantic=""
    rm -f "$d/$kind.ok"
    $cc -std=$std $WARN $pedantic $opt $defs -I. -c "$d/impl.$ext" -o "$d/impl_$kind.o" \
        >"$d/$kind.log" 2>&1 &&
        $cc -std=$std $WARN $pedantic $opt -I. -c "$d/use.$ext" -o "$d/use_$kind.o" \
            >>"$d/$kind.log" 2>&1 &&
        $cc "$d/impl_$kind.o" "$d/use_$kind.o" -o "$d/prog_$kind" $libs >>"$d/$kind.log" 2>&1 &&
        "$d/prog_$kind" >>"$d/$kind.log" 2>&1 && touch "$d/$kind.ok"
}

compile_sources() {
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
    cp "$d/impl.c" "$d/impl.cpp" && cp "$d/use.c" "$d/use.cpp"
}

compile_results() {
    local kind what
    for kind in c99 c11 portable cxx; do
        case $kind in
        c99) what="compile mpt.h as c99 -O1, two translation units" ;;
        c11) what="compile mpt.h as c11 -O3, two translation units" ;;
        portable) what="compile mpt.h with MPT_NO_SIMD and MPT_NO_ZLIB, linked without zlib" ;;
        cxx) what="compile mpt.h as C++17, two translation units" ;;
        esac
        if [ -e "$B/compile/$kind.ok" ]; then record "$what" pass
        else cat "$B/compile/$kind.log"; record "$what" fail "see $B/compile/$kind.log"
        fi
    done
}

# tests/same_bits.c compiled as every test is (gcc -std=c99 -O2), in gcc's
# GNU mode with -march=native and by clang with -march=native: the three
# must print the same lines (the compilers' defaults fuse a product and a
# sum where FMA exists; mpt.h asks them not to, and this shows it works).
SAME_BITS_KINDS="iso gnu_native clang_native"
same_bits_job() {
    local d=$B/same_bits kind=$1 cc=$CC flags="-O2 -march=native"
    case $kind in
    iso) flags="-std=c99 -O2" ;;
    clang_native) cc=clang ;;
    esac
    mkdir -p "$d" && rm -f "$d/$kind.out"
    $cc $flags $WARN -I. tests/same_bits.c -o "$d/$kind" $LIBS >"$d/$kind.log" 2>&1 &&
        "$d/$kind" >"$d/$kind.out" 2>>"$d/$kind.log"
}

same_bits_result() {
    local d=$B/same_bits kind what="tests/same_bits.c: the same bits from gcc -std=c99, gcc's GNU mode -march=native and clang -march=native"
    for kind in $SAME_BITS_KINDS; do
        if [ "$(wc -l <"$d/$kind.out" 2>/dev/null)" != 9 ]; then
            cat "$d/$kind.log"
            record "$what" fail "the $kind build did not print its 9 lines (see $d/$kind.log)"
            return
        fi
    done
    for kind in $SAME_BITS_KINDS; do
        if ! cmp -s "$d/iso.out" "$d/$kind.out"; then
            diff "$d/iso.out" "$d/$kind.out"
            record "$what" fail "the $kind build's bits differ (above)"
            return
        fi
    done
    record "$what" pass
}

# What ./build.sh builds (-O2 -g, warnings as errors, no sanitizers: gcc
# warns of other things there than under them), checked here so that the
# plain build keeps working.
build_all_check() {
    if build_all >"$B/build_all.log" 2>&1; then
        record "./build.sh: every benchmark and example builds at $OPT with $WARN" pass
    else
        cat "$B/build_all.log"
        record "./build.sh: every benchmark and example builds" fail "see above"
    fi
}

# Each example as the README's table builds it, checked against what
# build_all compiled: the source is that example (build_all built it with
# stricter flags), and its object links with exactly the libraries the line
# names (the examples that read no file link without -lz).
readme_example_checks() {
    local line cmd name src libs objs
    mkdir -p "$B/readme"
    while IFS= read -r line; do
        cmd=${line%% && *}
        name=${cmd##* -o }
        src=$(echo "$cmd" | grep -o '[a-z_0-9]*\.c')
        libs=$(echo "$cmd" | grep -o ' -l[a-z]*' | tr -d '\n')
        objs="$B/obj/$(basename "$src" .c).o"
        uses_public_api_only "examples/$src" && objs="$objs $B/obj/mpt.o"
        if [ -e "examples/$src" ] && [ -x "$B/$(basename "$src" .c)" ] &&
            $CC $objs -o "$B/readme/$name" $libs >"$B/readme/$name.log" 2>&1; then
            record "README: (cd examples && $cmd): built by ./build.sh, links with$libs" pass
        else
            cat "$B/readme/$name.log" 2>/dev/null
            record "README: (cd examples && $cmd)" fail "not built by ./build.sh, or does not link with$libs"
        fi
    done < <(grep -o '`cc -O2 [^`]*`' README.md | tr -d '`' | grep ' -o ')
}

# True when PY_VENV's Python has every package of PY_PACKAGES, at the version
# where one is pinned (NAME==VERSION) (read from their metadata: no import, no
# network).
python_env_complete() {
    [ -x "$PY_VENV/bin/python" ] &&
        "$PY_VENV/bin/python" -c 'import sys, importlib.metadata as m
for p in sys.argv[1:]:
    name, _, pin = p.partition("==")
    if m.version(name) != (pin or m.version(name)): sys.exit(1)' $PY_PACKAGES >/dev/null 2>&1
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

# The CUDA backend must at least compile wherever nvcc is: here for sm_90,
# the generic Hopper target (the GPU pack builds sm_90a, with NCCL where
# nccl.h is, and runs tests/test_cuda.c from it).
cuda_compile_job() {
    local nvcc
    nvcc=$(find_nvcc) || return 0
    rm -f "$B/nvcc.ok"
    "$nvcc" -std=c++17 -O2 -arch=sm_90 -Werror all-warnings -DMPT_CUDA -I. -c mpt_cuda.cu \
        -o "$B/mpt_cuda.o" >"$B/nvcc.log" 2>&1 && touch "$B/nvcc.ok"
}

cuda_compile_result() {
    if ! find_nvcc >/dev/null; then
        record "compile mpt_cuda.cu with nvcc" skip "no nvcc on this machine"
    elif [ -e "$B/nvcc.ok" ]; then
        record "compile mpt_cuda.cu with nvcc -arch=sm_90" pass
    else
        cat "$B/nvcc.log"
        record "compile mpt_cuda.cu with nvcc -arch=sm_90" fail "see $B/nvcc.log"
    fi
}

# The pack for a GPU machine built (gpu_pack_job: every GPU program, the
# Hopper image included, with NCCL where nccl.h is, nvcc -Werror); its
# tests/test_cuda.c runs here without a device (the fallback to the CPU; the comparisons
# skip), and fails under MPT_REQUIRE_GPU=1, as run from the pack by
# GPU_PREBUILT ./build.sh gpu test. (Subshells: the gpu steps' own counts
# stay out of ours.)
gpu_checks() {
    local out=$B/test_cuda_nvcc.out rc
    find_nvcc >/dev/null && [ -e mpt_cuda.cu ] || return 0
    if ! have_zlib; then
        record "./build.sh gpu-pack builds every GPU program" fail "no zlib.h"
        return
    fi
    if [ ! -e "$B/gpu_pack.ok" ]; then
        cat "$B/gpu_pack.log"
        record "./build.sh gpu-pack builds every GPU program" fail "see above"
        return
    fi
    record "./build.sh gpu-pack builds every GPU program$([ -x "$B/gpu-pack/test_cuda_nccl" ] &&
        echo ", NCCL's too")" pass
    gpu_pack_fits
    timeout 1800 "$B/gpu-pack/test_cuda_gpu" >"$out" 2>&1
    rc=$?
    grep -E '^(FAIL|SKIP) ' "$out"
    echo "tests/test_cuda.c built by nvcc: $(grep -c '^PASS ' "$out") passed"
    count_output test_cuda_nvcc "$out" $rc
    (GPU_PREBUILT=$B/gpu-pack run_gpu test --out "$B/gpu_prebuilt_check") \
        >"$B/gpu_prebuilt_check.log" 2>&1
    if [ $? -ne 0 ] &&
        grep -q '^FAIL a CUDA device is reached' "$B/gpu_prebuilt_check/test_cuda.out"; then
        record "GPU_PREBUILT ./build.sh gpu test without a device fails" pass
    else
        cat "$B/gpu_prebuilt_check.log"
        record "GPU_PREBUILT ./build.sh gpu test without a device fails" fail "see above"
    fi
}

# gpu_pack_job: ./build.sh gpu-pack (a job of the full check's first
# queue); leaves $B/gpu_pack.ok when it built.
gpu_pack_job() {
    rm -f "$B/gpu_pack.ok"
    find_nvcc >/dev/null && [ -e mpt_cuda.cu ] && have_zlib || return 0
    (gpu_pack >"$B/gpu_pack.log" 2>&1) && touch "$B/gpu_pack.ok"
}

# The gzip'ed pack and the tracked tree, together, within the 64 MiB that
# travel to a GPU machine in one call (bench/GPU.md).
gpu_pack_fits() {
    local pack tree
    pack=$(stat -c %s "$B/gpu-pack.tar.gz" 2>/dev/null || echo 0)
    tree=$(git ls-files -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    if [ "$pack" -gt 0 ] && [ $((pack + ${tree:-0})) -lt $((64 * 1024 * 1024)) ]; then
        record "the gzip'ed GPU pack and the tree fit the 64 MiB that travel" pass
    else
        record "the gzip'ed GPU pack and the tree fit the 64 MiB that travel" fail \
            "pack $pack bytes, tree ${tree:-?} bytes"
    fi
}

# Where no GPU is reached, ./build.sh gpu must fail, not pass: under
# MPT_REQUIRE_GPU=1 test_cuda (the gcc build; the nvcc one in gpu_checks)
# and bench_cuda exit with an error. And the gpu path works on a bare GPU
# machine: without zlib.h it decompresses the data, and it installs nothing
# (there is no package manager to ask).
required_gpu_checks() {
    local out=$B/asan/test_cuda.required.out f
    if [ -x "$B/asan/test_cuda" ]; then
        MPT_REQUIRE_GPU=1 ASAN_OPTIONS=detect_leaks=1 timeout 600 "./$B/asan/test_cuda" >"$out" 2>&1
        if [ $? -ne 0 ] && grep -q '^FAIL a CUDA device is reached' "$out"; then
            record "test_cuda without a device under MPT_REQUIRE_GPU=1 fails" pass
        else
            cat "$out"
            record "test_cuda without a device under MPT_REQUIRE_GPU=1 fails" fail "it passed (see above)"
        fi
    fi
    if [ -x "$B/bench_cuda" ]; then
        if MPT_REQUIRE_GPU=1 timeout 60 "./$B/bench_cuda" gemm >"$B/bench_cuda.required.out" 2>&1; then
            record "bench_cuda without a device under MPT_REQUIRE_GPU=1 fails" fail "exit status 0"
        else
            record "bench_cuda without a device under MPT_REQUIRE_GPU=1 fails" pass
        fi
    fi
    # without zlib.h, the data's .gz files are read decompressed
    (
        B=$B/gpu_data_check
        rm -rf "$B" && mkdir -p "$B/src" &&
            head -c 4099 /dev/urandom >"$B/expected" &&
            gzip -c "$B/expected" >"$B/src/train-images-idx3-ubyte.gz" &&
            d=$(MPT_GPU_NO_ZLIB=1 gpu_dataset "$B/src") &&
            cmp -s "$d/train-images-idx3-ubyte" "$B/expected"
    ) && record "./build.sh gpu without zlib.h decompresses the data" pass ||
        record "./build.sh gpu without zlib.h decompresses the data" fail "see gpu_dataset"
    for f in $(declare -F | awk '{print $3}' |
        grep -E '^(gpu_|run_gpu$|find_nccl$|find_nvcc$|have_zlib$|find_torch_gpu_python$)'); do
        [ "$f" = gpu_checks ] && continue
        if declare -f "$f" | grep -qE 'install_packages|apt-get|dpkg|pip install|python_env'; then
            record "./build.sh gpu installs nothing" fail "$f installs packages"
            return
        fi
    done
    record "./build.sh gpu installs nothing" pass
}

# mpi_build_job cuda|strategy: one of the two MPI builds (a job): the
# implementation as a CUDA and MPI build (GPU workers), or
# tests/mpi_strategy.c.
mpi_build_job() {
    command -v mpicc >/dev/null || return 0
    case $1 in
    cuda)
        rm -f "$B/mpt_mpi_cuda.ok"
        mpicc -std=c99 $WARN -DMPT_MPI -DMPT_CUDA -DMPT_IMPLEMENTATION -x c -c mpt.h \
            -o "$B/mpt_mpi_cuda.o" >"$B/mpt_mpi_cuda.log" 2>&1 && touch "$B/mpt_mpi_cuda.ok"
        ;;
    strategy)
        rm -f "$B/mpi_strategy.ok"
        mpicc -std=c99 $WARN $OPT -DMPT_MPI -I. tests/mpi_strategy.c -o "$B/mpi_strategy" \
            -lpthread -lm -lz >"$B/mpi_strategy.build.log" 2>&1 && touch "$B/mpi_strategy.ok"
        ;;
    esac
}

# The multi-worker strategy: tests/mpi_strategy.c built with mpicc
# -DMPT_MPI (mpi_build_job) and run by mpirun as two processes on this
# machine, one scenario at a time (see the file). "dies" kills a worker:
# passing means mpirun ended the job, with an error, well inside its time
# limit.
mpi_tests() {
    local sc out rc start secs
    if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
        record "multi-worker strategy (mpirun -np 2)" skip "no mpicc/mpirun (openmpi-bin, libopenmpi-dev)"
        return
    fi
    if [ -e "$B/mpt_mpi_cuda.ok" ]; then
        record "compile mpt.h with MPT_MPI and MPT_CUDA" pass
    else
        cat "$B/mpt_mpi_cuda.log"
        record "compile mpt.h with MPT_MPI and MPT_CUDA" fail "see above"
    fi
    if [ ! -e "$B/mpi_strategy.ok" ]; then
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

FUZZ_HARNESSES="idx idx_gzip weights checkpoint qat model npy csv text"
FUZZ=$B/fuzz
FUZZ_CC=${FUZZ_CC:-clang}
FUZZ_FLAGS="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -gline-tables-only -O1"
FUZZ_TEST_SECONDS=30 # per harness, in ./build.sh check

fuzz_dict() {
    case $1 in
    idx*) echo tests/fuzz/idx.dict ;;
    model) echo tests/fuzz/model.dict ;;
    npy) echo tests/fuzz/npy.dict ;;
    csv) echo tests/fuzz/csv.dict ;;
    text) echo tests/fuzz/text.dict ;;
    *) echo tests/fuzz/safetensors.dict ;;
    esac
}

# fuzz_build_job loaders|seeds: the binary of every harness
# (tests/fuzz/fuzz_loaders.c: mpt.h compiled once under the fuzzer's
# sanitizers, 200 s of a core with line tables only where -g took 235,
# and one binary per harness cost that four times in ./build.sh check),
# linked under each harness's name; or the seed corpora.
fuzz_build_job() {
    local name
    if [ "$1" = seeds ]; then
        $CC -std=c99 $WARN -DMPT_STATIC -Wno-unused-function -O1 -g -I. tests/fuzz/seeds.c \
            -o "$FUZZ/seeds_gen" $LIBS \
            >"$FUZZ/seeds.log" 2>&1 && "./$FUZZ/seeds_gen" "$FUZZ/seeds" >>"$FUZZ/seeds.log" 2>&1 ||
            touch "$FUZZ/seeds.build.failed"
        return
    fi
    # MPT_STATIC: what no harness reaches is left out, not compiled
    if "$FUZZ_CC" -std=c99 $WARN -DMPT_STATIC -Wno-unused-function $FUZZ_FLAGS -I. \
        tests/fuzz/fuzz_loaders.c -o "$FUZZ/fuzz_loaders" $LIBS >"$FUZZ/loaders.build.log" 2>&1
    then
        for name in $FUZZ_HARNESSES; do ln -sf fuzz_loaders "$FUZZ/fuzz_$name"; done
    else
        for name in $FUZZ_HARNESSES; do
            cp "$FUZZ/loaders.build.log" "$FUZZ/$name.build.log"
            touch "$FUZZ/$name.build.failed"
        done
    fi
}

# The harnesses' binary and the seeds, as jobs (spawn); fuzz_build_results
# says what failed.
fuzz_build_jobs() {
    local name
    mkdir -p "$FUZZ"
    command -v "$FUZZ_CC" >/dev/null || return 0
    rm -rf "$FUZZ/seeds" "$FUZZ"/*.build.failed
    for name in $FUZZ_HARNESSES; do mkdir -p "$FUZZ/seeds/$name" "$FUZZ/corpus/$name"; done
    spawn timed fuzz_build_job loaders
    spawn timed fuzz_build_job seeds
}

fuzz_build_results() {
    local name
    if ! command -v "$FUZZ_CC" >/dev/null; then
        record "fuzz harnesses" fail "no $FUZZ_CC (Debian: clang libclang-rt-14-dev)"
        return 1
    fi
    if [ -e "$FUZZ/seeds.build.failed" ]; then
        cat "$FUZZ/seeds.log"
        record "fuzz seed corpora (tests/fuzz/seeds.c)" fail "see above"
        return 1
    fi
    for name in $FUZZ_HARNESSES; do
        [ -e "$FUZZ/$name.build.failed" ] || continue
        cat "$FUZZ/$name.build.log"
        record "build tests/fuzz/fuzz_$name.c with $FUZZ_CC (in tests/fuzz/fuzz_loaders.c)" fail \
            "compile error (see above)"
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

# fuzz_run_job NAME SECONDS: NAME's harness for SECONDS on its corpus and
# seeds, with its dictionary (a job: fuzz_run_result reads its log). An
# input that crashes it is left in $FUZZ/artifacts/NAME/ (fix mpt.h, then
# add it to tests/fuzz/findings/NAME/).
fuzz_run_job() {
    local name=$1 secs=$2
    mkdir -p "$FUZZ/artifacts/$name"
    UBSAN_OPTIONS=print_stacktrace=1 "./$FUZZ/fuzz_$name" -max_total_time="$secs" -timeout=10 \
        -dict="$(fuzz_dict "$name")" -print_final_stats=1 \
        -artifact_prefix="$FUZZ/artifacts/$name/" "$FUZZ/corpus/$name" "$FUZZ/seeds/$name" \
        >"$FUZZ/$name.log" 2>&1
    echo $? >"$FUZZ/$name.rc"
}

fuzz_run_result() {
    local name=$1 secs=$2 log=$FUZZ/$1.log runs rc why input
    rc=$(cat "$FUZZ/$name.rc" 2>/dev/null || echo 1)
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    if [ "$rc" -eq 0 ] && [ -n "$runs" ]; then
        record "fuzz_$name for ${secs}s: $runs inputs, no crash" pass
    else
        tail -60 "$log"
        why=$(grep -m1 -E 'ERROR|^fuzz: ' "$log")
        input=$(sed -n 's/.*Test unit written to //p' "$log" | head -1)
        record "fuzz_$name for ${secs}s" fail "$why (the input: ${input:-none written})"
    fi
}

# fuzz_all_built SECONDS: replay the findings, then fuzz each harness that
# built, JOBS at a time.
fuzz_all_built() {
    local name
    [ -e "$FUZZ/seeds.build.failed" ] && return
    for name in $FUZZ_HARNESSES; do
        [ -x "$FUZZ/fuzz_$name" ] && [ ! -e "$FUZZ/$name.build.failed" ] || continue
        fuzz_replay "$name"
        rm -f "$FUZZ/$name.rc"
        spawn fuzz_run_job "$name" "$1"
    done
    wait
    for name in $FUZZ_HARNESSES; do
        [ -x "$FUZZ/fuzz_$name" ] && [ ! -e "$FUZZ/$name.build.failed" ] || continue
        fuzz_run_result "$name" "$1"
    done
}

# ./build.sh fuzz SECONDS: build, then fuzz_all_built.
fuzz_all() {
    fuzz_build_jobs
    wait
    fuzz_build_results || return
    fuzz_all_built "$1"
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

# ---- ./build.sh gpu: the CUDA backend on a GPU machine ----------------------
#
# ./build.sh gpu [build|test|sanitize|bench|torch|all] [--data DIR]
#                [--out DIR] [--tools LIST]
# Made for a bare GPU machine: nvcc and the CUDA libraries, maybe NCCL as a
# Python wheel, maybe no zlib headers, no Debian packages, no network. It
# never installs anything. Every program is built with -arch=$GPU_ARCH:
# sm_90a on a Hopper GPU (nvidia-smi's compute capability 9.0: the image
# with mpt_cuda.cu's wgmma/TMA GEMM), else sm_90 (set GPU_ARCH to choose,
# e.g. GPU_ARCH=sm_90a to compile the Hopper kernel on a machine without a
# GPU); objects are rebuilt only when a source is newer, so the steps can
# be separate calls. Each program runs under `timeout`, with
# MPT_REQUIRE_GPU=1: a CUDA backend that does not open is a failure, not a
# skip. Logs, the JSON lines of every result (results.jsonl) and a summary
# (summary_STEP.md) go to the --out directory (default build/gpu).
#   build     only the build (every step builds what is stale first)
#   test      tests/test_cuda.c (and again built with NCCL where NCCL is),
#             examples/mlp.c on Fashion-MNIST
#   sanitize  compute-sanitizer: memcheck, racecheck, synccheck on
#             `test_cuda quick`, initcheck on one epoch of examples/mlp.c at
#             batch 1024 (--tools memcheck,initcheck picks some)
#   bench     bench/bench_cuda.c
#   torch     bench/torch_gpu_train.py where PyTorch sees the GPU ($TORCH_COMPILE=MODE
#             adds its torch.compile rows, e.g. max-autotune)
#   all       test, bench and torch (the default)
# --data: Fashion-MNIST (the four IDX files, .gz or not); default
# /usr/share/datasets/fashion-mnist, else data/fashion-mnist (what
# ./build.sh gpu-data puts there). Without zlib.h the build has
# -DMPT_NO_ZLIB and .gz files are decompressed into build/fashion-mnist.
# MPT_GPU_NO_ZLIB=1 builds so even where zlib.h is.

GPU_ARCH=${GPU_ARCH:-}

# The architecture when GPU_ARCH is not set: sm_90a on a Hopper GPU (wgmma
# and setmaxnreg exist only there), else sm_90.
gpu_default_arch() {
    local cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
    if [ "${cap// /}" = 9.0 ]; then echo sm_90a; else echo sm_90; fi
}
GPU_DATA_COPY=data/fashion-mnist # git-ignored: a copy that travels with the tree
GPU_TEST_SECONDS=${GPU_TEST_SECONDS:-420}
GPU_SANITIZE_SECONDS=${GPU_SANITIZE_SECONDS:-240} # per tool
GPU_BENCH_SECONDS=${GPU_BENCH_SECONDS:-480}
GPU_BUILD_SECONDS=${GPU_BUILD_SECONDS:-480}

# ./build.sh gpu-data [SRC]: copies Fashion-MNIST's four .gz files (about
# 30 MB) from SRC (default the Debian path) into DEST (default
# data/fashion-mnist; the pack gives its own), to be
# carried to a GPU machine with the working tree.
gpu_data() {
    local src=${1:-/usr/share/datasets/fashion-mnist} dest=${2:-$GPU_DATA_COPY} f
    mkdir -p "$dest"
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte \
        t10k-labels-idx1-ubyte; do
        if [ -e "$src/$f.gz" ]; then cp "$src/$f.gz" "$dest/"
        elif [ -e "$src/$f" ]; then cp "$src/$f" "$dest/"
        else echo "build.sh gpu-data: $src has no $f(.gz)" >&2; return 1
        fi
    done
    du -sh "$dest"
}

# nvcc's release number (13.0), for the summaries.
nvcc_release() { "$1" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'; }

# True when the C compiler finds zlib.h (and MPT_GPU_NO_ZLIB is not 1).
have_zlib() {
    [ "${MPT_GPU_NO_ZLIB:-0}" != 1 ] && echo '#include <zlib.h>' | $CC -E -x c - >/dev/null 2>&1
}

# gpu_dataset DIR: the directory the GPU programs read Fashion-MNIST from:
# DIR, or without zlib a decompressed copy of its .gz files in
# build/fashion-mnist (gzip, else Python's gzip module).
gpu_dataset() {
    local dir=$1 f plain=$B/fashion-mnist
    if have_zlib || [ ! -e "$dir/train-images-idx3-ubyte.gz" ] ||
        [ -e "$dir/train-images-idx3-ubyte" ]; then
        echo "$dir"
        return
    fi
    mkdir -p "$plain"
    for f in "$dir"/*-ubyte.gz; do
        [ -s "$plain/$(basename "$f" .gz)" ] && continue
        if command -v gzip >/dev/null; then
            gzip -dc "$f" >"$plain/$(basename "$f" .gz)"
        else
            python3 -c 'import gzip, shutil, sys
with gzip.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' \
                "$f" "$plain/$(basename "$f" .gz)"
        fi || echo "build.sh gpu: cannot decompress $f" >&2
    done
    echo "$plain"
}

# NCCL's include and library directories ("INC LIB"; empty where the
# compiler's default paths have it), from the system or the Python wheel
# (nvidia-nccl-cu*: site-packages/nvidia/nccl/{include,lib}); fails when
# there is no nccl.h with a libnccl.so.2.
find_nccl() {
    local nvcc=$1 py d
    if echo '#include <nccl.h>' | "$nvcc" -x cu -E - >/dev/null 2>&1; then
        echo " "
        return 0
    fi
    for py in ${TORCH_PYTHON:-} python3 /usr/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        d=$("$py" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null) || continue
        if [ -e "$d/include/nccl.h" ] && [ -e "$d/lib/libnccl.so.2" ]; then
            echo "$d/include $d/lib"
            return 0
        fi
    done
    return 1
}

# gpu_compile OUT SOURCE COMMAND...: COMMAND (which writes OUT) in the
# background, unless OUT was built from the same SOURCE, headers and
# command: a checksum of them, taken before the compiler reads them, is
# kept in OUT.sum (times would not do: a source edited during a build is
# older than the object). Its log is OUT.log, a failure OUT.failed.
gpu_compile() {
    local out=$1 src=$2 sum
    shift 2
    rm -f "$out.failed"
    sum=$({ echo "$*"; cat "$src" mpt.h tests/*.h examples/*.h bench/*.h; } | md5sum)
    [ -e "$out" ] && [ "$(cat "$out.sum" 2>/dev/null)" = "$sum" ] && return 0
    rm -f "$out" "$out.sum"
    { if timeout "$GPU_BUILD_SECONDS" "$@" >"$out.log" 2>&1; then echo "$sum" >"$out.sum"
      else echo $? >"$out.failed"; rm -f "$out"; fi; } &
}

# The commit the benchmarks' JSON lines name: git's (with "-dirty" when the
# tree has uncommitted changes), else the prebuilt pack's BUILD note's
# (the GPU machine's copy of the tree has no .git), else "unknown".
bench_commit() {
    local c
    if c=$(git rev-parse --short HEAD 2>/dev/null); then
        git diff --quiet HEAD 2>/dev/null || c="$c-dirty"
        echo "$c"
    elif [ -n "${GPU_PREBUILT:-}" ] && c=$(sed -n 's/.* at \([0-9a-f]*\).*/\1/p' "$GPU_PREBUILT/BUILD" 2>/dev/null) &&
        [ -n "$c" ]; then
        echo "$c"
    else
        echo unknown
    fi
}

# Builds the GPU programs into build/: test_cuda_gpu, bench_cuda_gpu,
# mlp_gpu, and test_cuda_nccl where NCCL is. Prints what failed.
gpu_build() {
    local nvcc=$1 zflags=$2 libs=$3 nccl=$4 flags o p inc lib ok=0
    local -a nccl_inc=() nccl_lib=()
    flags="-std=c++17 -O2 -arch=$GPU_ARCH -Werror all-warnings -DMPT_CUDA $zflags -I."
    if [ -n "$nccl" ]; then
        read -r inc lib <<<"$nccl"
        [ -n "${inc:-}" ] && nccl_inc=(-I"$inc")
        if [ -n "${lib:-}" ]; then nccl_lib=(-L"$lib" -l:libnccl.so.2 -Xlinker -rpath="$lib")
        else nccl_lib=(-lnccl); fi
    fi
    gpu_compile "$B/mpt_cuda_gpu.o" mpt_cuda.cu "$nvcc" $flags -c mpt_cuda.cu -o "$B/mpt_cuda_gpu.o"
    gpu_compile "$B/test_cuda_gpu.o" tests/test_cuda.c "$nvcc" $flags -x cu -c tests/test_cuda.c \
        -o "$B/test_cuda_gpu.o"
    gpu_compile "$B/bench_cuda_gpu.o" bench/bench_cuda.c "$nvcc" $flags -x cu -c bench/bench_cuda.c \
        -DMPT_BENCH_COMMIT="\"$(bench_commit)\"" -DMPT_BENCH_ARCH="\"$GPU_ARCH\"" \
        -o "$B/bench_cuda_gpu.o"
    gpu_compile "$B/mlp_gpu.o" examples/mlp.c $CC -std=c99 $WARN $OPT -DMPT_CUDA $zflags -I. \
        -c examples/mlp.c -o "$B/mlp_gpu.o"
    if [ -n "$nccl" ]; then
        gpu_compile "$B/mpt_cuda_nccl.o" mpt_cuda.cu "$nvcc" $flags -DMPT_NCCL "${nccl_inc[@]}" \
            -c mpt_cuda.cu -o "$B/mpt_cuda_nccl.o"
        gpu_compile "$B/test_cuda_nccl.o" tests/test_cuda.c "$nvcc" $flags -DMPT_NCCL \
            "${nccl_inc[@]}" -x cu -c tests/test_cuda.c -o "$B/test_cuda_nccl.o"
    fi
    wait
    for o in mpt_cuda_gpu test_cuda_gpu bench_cuda_gpu mlp_gpu mpt_cuda_nccl test_cuda_nccl; do
        [ -e "$B/$o.o.failed" ] || continue
        echo "build.sh gpu: compiling $o.o failed (exit status $(cat "$B/$o.o.failed")):"
        cat "$B/$o.o.log"
        ok=1
    done
    [ $ok -eq 0 ] || return 1
    # linking is quick: always
    for p in test_cuda bench_cuda mlp; do
        "$nvcc" -arch=$GPU_ARCH "$B/${p}_gpu.o" "$B/mpt_cuda_gpu.o" -o "$B/${p}_gpu" \
            $libs $CUDA_LIBS >"$B/${p}_gpu.link.log" 2>&1 ||
            { echo "build.sh gpu: linking ${p}_gpu failed:"; cat "$B/${p}_gpu.link.log"; ok=1; }
    done
    if [ -n "$nccl" ]; then
        "$nvcc" -arch=$GPU_ARCH "$B/test_cuda_nccl.o" "$B/mpt_cuda_nccl.o" -o "$B/test_cuda_nccl" \
            $libs $CUDA_LIBS "${nccl_lib[@]}" >"$B/test_cuda_nccl.link.log" 2>&1 ||
            { echo "build.sh gpu: linking test_cuda_nccl failed:"; cat "$B/test_cuda_nccl.link.log"; ok=1; }
    fi
    return $ok
}

# gpu_run NAME SECONDS COMMAND...: COMMAND under timeout, with
# MPT_REQUIRE_GPU=1, its output shown and kept in $GPU_OUT/NAME.out; its
# JSON lines are added to $GPU_OUT/results.jsonl. Returns its status (124:
# timed out).
gpu_run() {
    local name=$1 secs=$2 rc
    shift 2
    echo "build.sh gpu: $name: $* (at most ${secs}s)"
    MPT_REQUIRE_GPU=1 MPT_DATA_DIR=$GPU_DATA timeout -k 10 "$secs" "$@" 2>&1 |
        tee "$GPU_OUT/$name.out"
    rc=${PIPESTATUS[0]}
    [ $rc -eq 124 ] && echo "build.sh gpu: $name timed out after ${secs}s" | tee -a "$GPU_OUT/$name.out"
    grep '^{' "$GPU_OUT/$name.out" >>"$GPU_OUT/results.jsonl"
    return $rc
}

# gpu_row STEP RESULT: one row of the summary table.
gpu_row() { GPU_ROWS+=("| $1 | $2 |"); }

# A test program's counts; a failure when it failed or exited uncleanly.
gpu_test_program() {
    local name=$1 secs=$2 rc
    shift 2
    gpu_run "$name" "$secs" "$@"
    rc=$?
    count_output "$name" "$GPU_OUT/$name.out" $rc
    gpu_row "$name" "$(grep -c '^PASS ' "$GPU_OUT/$name.out") passed, $(grep -c '^FAIL ' \
        "$GPU_OUT/$name.out") failed, $(grep -c '^SKIP ' "$GPU_OUT/$name.out") skipped, exit $rc"
    [ $rc -eq 0 ]
}

# A program whose JSON lines are its results.
gpu_bench_program() {
    local name=$1 secs=$2 rc line
    shift 2
    gpu_run "$name" "$secs" "$@"
    rc=$?
    if [ $rc -eq 0 ]; then record "$name" pass
    else record "$name" fail "exit status $rc (see $GPU_OUT/$name.out)"
    fi
    gpu_row "$name" "exit $rc"
    while IFS= read -r line; do gpu_row "$name" "$line"; done < <(grep '^{' "$GPU_OUT/$name.out")
    [ $rc -eq 0 ]
}

gpu_step_test() {
    local line
    gpu_test_program test_cuda "$GPU_TEST_SECONDS" "$GPU_BIN/test_cuda_gpu"
    line=$(grep -m1 '^# cuBLASLt refusals' "$GPU_OUT/test_cuda.out") && gpu_row test_cuda "${line#\# }"
    # without a device the rest would only train on the CPU
    if grep -q 'the CUDA backend did not open' "$GPU_OUT/test_cuda.out"; then
        gpu_row "the rest of gpu test" "not run: no CUDA device was reached"
        return
    fi
    if [ -x "$GPU_BIN/test_cuda_nccl" ]; then
        gpu_test_program test_cuda_nccl "$GPU_TEST_SECONDS" "$GPU_BIN/test_cuda_nccl" quick
    else
        record "tests/test_cuda.c with NCCL" skip "no nccl.h with libnccl.so.2 (system or the nvidia-nccl wheel)"
        gpu_row test_cuda_nccl "not built: no NCCL"
    fi
    gpu_bench_program mlp 180 "$GPU_BIN/mlp_gpu" --verbose 2 --data "$GPU_DATA"
}

# gpu_racecheck SANITIZER NAME PART: racecheck on `test_cuda_gpu PART`.
# Hazards reported inside cuBLASLt's own kernels (nvjet_*, NVIDIA's code:
# on an H200 its split-K kernels were) do not fail the step; any in ours,
# or any other error, does.
gpu_racecheck() {
    local rc
    gpu_run "$2" "$GPU_SANITIZE_SECONDS" "$1" --tool racecheck --error-exitcode 99 \
        --print-limit 40 "$GPU_BIN/test_cuda_gpu" "$3"
    rc=$?
    if [ $rc -eq 99 ] && ! grep -q '^FAIL ' "$GPU_OUT/$2.out" &&
        ! grep -E '^=+ +(Error|Warning)' "$GPU_OUT/$2.out" | grep -qv 'nvjet'; then
        echo "build.sh gpu: $2: every hazard is inside cuBLASLt's nvjet kernels" |
            tee -a "$GPU_OUT/$2.out"
        rc=0
    fi
    return $rc
}

gpu_step_sanitize() {
    local san tool rc
    san=$(dirname "$1")/compute-sanitizer
    [ -x "$san" ] || san=$(command -v compute-sanitizer) || {
        record "compute-sanitizer" fail "not found beside $1 or on the PATH"
        gpu_row compute-sanitizer "not found beside $1 or on the PATH"
        return
    }
    for tool in ${GPU_TOOLS//,/ }; do
        case $tool in
        initcheck)
            gpu_run "sanitize_$tool" "$GPU_SANITIZE_SECONDS" "$san" --tool "$tool" \
                --error-exitcode 99 --print-limit 20 "$GPU_BIN/mlp_gpu" --epochs 1 \
                --batch-size 1024 --data "$GPU_DATA" ;;
        memcheck | synccheck)
            gpu_run "sanitize_$tool" "$GPU_SANITIZE_SECONDS" "$san" --tool "$tool" \
                --error-exitcode 99 --print-limit 20 "$GPU_BIN/test_cuda_gpu" quick ;;
        racecheck)
            # The slowest tool: test_cuda quick in its two halves, each in its
            # own limit (the whole outlasted 190 s on an H200).
            gpu_racecheck "$san" sanitize_racecheck layers
            rc=$?
            gpu_racecheck "$san" sanitize_racecheck_gemm gemm || rc=$?
            (exit $rc) ;;
        *) record "compute-sanitizer --tool $tool" fail "unknown tool"; continue ;;
        esac
        rc=$?
        if [ $rc -eq 0 ]; then record "compute-sanitizer --tool $tool" pass
        else record "compute-sanitizer --tool $tool" fail "exit status $rc (99: errors found; see $GPU_OUT/sanitize_$tool.out)"
        fi
        gpu_row "compute-sanitizer --tool $tool" "$(cat "$GPU_OUT/sanitize_$tool"*.out |
            grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | paste -sd';' - | grep . ||
            echo "no summary"), exit $rc"
    done
}

gpu_step_bench() { gpu_bench_program bench_cuda "$GPU_BENCH_SECONDS" "$GPU_BIN/bench_cuda_gpu"; }

gpu_step_torch() {
    local py
    if py=$(find_torch_gpu_python); then
        MPT_BENCH_COMMIT=$(bench_commit) \
            gpu_bench_program torch_gpu_train "$GPU_BENCH_SECONDS" "$py" bench/torch_gpu_train.py \
            --compile "${TORCH_COMPILE:-none}"
    else
        record "bench/torch_gpu_train.py" fail "no Python whose torch sees a CUDA device"
        gpu_row torch_gpu_train "not run: no Python whose torch sees a CUDA device"
    fi
}

# The device as the driver and mpt_device_query (in the programs' output) see it.
gpu_device_lines() {
    local q
    q=$(timeout 30 nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
        --format=csv,noheader 2>&1 | head -1)
    echo "nvidia-smi: ${q:-nothing}"
    cat "$GPU_OUT"/*.out 2>/dev/null | grep -m1 -E '^# (device 1|mpt.h .* CUDA benchmarks):' ||
        echo "mpt_device_query: no program reached a device"
}

# ./build.sh gpu-pack: the GPU programs built here (GPU_ARCH, default sm_90a:
# the Hopper image) and stripped, with Fashion-MNIST's .gz files and a
# BUILD note, in build/gpu-pack: one folder (about 50 MB) to carry to a GPU
# machine, where `GPU_PREBUILT=build/gpu-pack ./build.sh gpu STEP` runs
# them without building (bench/GPU.md). They need there the libraries they
# were linked with here: CUDA's runtime, cuBLAS/cuBLASLt and zlib of the
# same major versions, and libnccl.so.2 (the nvidia-nccl wheel's is found).
gpu_pack() {
    local nvcc zflags="" libs=$LIBS nccl pack=$B/gpu-pack p src
    nvcc=$(find_nvcc) || { echo "build.sh gpu-pack: needs nvcc (set NVCC=...)" >&2; return 1; }
    have_zlib || { echo "build.sh gpu-pack: needs zlib.h (the programs read the .gz files)" >&2; return 1; }
    GPU_ARCH=${GPU_ARCH:-sm_90a}
    nccl=$(find_nccl "$nvcc") || nccl=""
    mkdir -p "$B/gpu" && gpu_build "$nvcc" "$zflags" "$libs" "$nccl" >"$B/gpu/build.log" 2>&1 || {
        cat "$B/gpu/build.log"
        echo "build.sh gpu-pack: the build failed (see above and $B/gpu/build.log)" >&2
        return 1
    }
    rm -rf "$pack" && mkdir -p "$pack" || return 1
    for p in test_cuda_gpu bench_cuda_gpu mlp_gpu test_cuda_nccl; do
        [ -e "$B/$p" ] && { strip -o "$pack/$p" "$B/$p" || return 1; }
    done
    src=/usr/share/datasets/fashion-mnist
    [ -d "$src" ] || src=$GPU_DATA_COPY
    gpu_data "$src" "$pack/fashion-mnist" >/dev/null ||
        echo "build.sh gpu-pack: the training steps will lack data" >&2
    echo "built $(date -u '+%Y-%m-%d %H:%M UTC') at $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)'), nvcc $(nvcc_release "$nvcc"), -arch=$GPU_ARCH, NCCL $([ -n "$nccl" ] && echo yes || echo no)" >"$pack/BUILD"
    cat "$pack/BUILD"
    # What travels: the folder (about 59 MB) and the tree (7 MB) pass the
    # 64 MiB a GPU machine's call takes; gzip'ed they are about 42 + 7.
    tar cf - -C "$B" gpu-pack | gzip -6 >"$pack.tar.gz" || return 1
    du -sh "$pack" "$pack.tar.gz"
}

# GPU_PREBUILT=DIR: run the programs ./build.sh gpu-pack left in DIR
# instead of building; libnccl.so.2 from the nvidia-nccl wheel where the
# system has none (find_nccl's second word).
gpu_use_prebuilt() {
    local inc lib p
    read -r inc lib <<<"$1"
    GPU_BIN=$GPU_PREBUILT
    case $GPU_BIN in /* | ./*) ;; *) GPU_BIN=./$GPU_BIN ;; esac
    for p in test_cuda_gpu bench_cuda_gpu mlp_gpu; do
        [ -x "$GPU_BIN/$p" ] || { echo "build.sh gpu: no $GPU_BIN/$p (./build.sh gpu-pack makes them)" >&2; return 1; }
    done
    [ -n "${lib:-}" ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "build.sh gpu $step: prebuilt in $GPU_PREBUILT ($(cat "$GPU_PREBUILT/BUILD" 2>/dev/null || echo 'no BUILD note')), data $GPU_DATA, output $GPU_OUT"
}

run_gpu() {
    local step=all nvcc zflags libs=$LIBS nccl="" arg s
    GPU_DATA="" GPU_OUT=$B/gpu GPU_TOOLS=memcheck,racecheck,synccheck,initcheck
    GPU_ROWS=()
    while [ $# -gt 0 ]; do
        arg=$1
        shift
        case $arg in
        build | test | sanitize | bench | torch | all) step=$arg ;;
        --data) GPU_DATA=${1:-}; shift ;;
        --out) GPU_OUT=${1:-}; shift ;;
        --tools) GPU_TOOLS=${1:-}; shift ;;
        *) echo "usage: ./build.sh gpu [build|test|sanitize|bench|torch|all] [--data DIR] [--out DIR] [--tools LIST]" >&2
           return 2 ;;
        esac
    done
    if [ -z "$GPU_DATA" ]; then
        GPU_DATA=/usr/share/datasets/fashion-mnist
        [ -d "$GPU_DATA" ] || GPU_DATA=$GPU_DATA_COPY
        [ -d "$GPU_DATA" ] || [ -z "${GPU_PREBUILT:-}" ] || GPU_DATA=$GPU_PREBUILT/fashion-mnist
    fi
    mkdir -p "$GPU_OUT" && : >"$GPU_OUT/results.jsonl"
    nvcc=$(find_nvcc) || { echo "build.sh gpu: needs nvcc (set NVCC=...)" >&2; return 1; }
    [ -e mpt_cuda.cu ] || { echo "build.sh gpu: mpt_cuda.cu is missing" >&2; return 1; }
    if have_zlib; then zflags=""
    else
        zflags=-DMPT_NO_ZLIB libs="-lpthread -lm"
        [ -n "${GPU_PREBUILT:-}" ] || echo "build.sh gpu: no zlib.h: building with -DMPT_NO_ZLIB"
    fi
    GPU_DATA=$(gpu_dataset "$GPU_DATA")
    [ -e "$GPU_DATA/train-images-idx3-ubyte" ] || [ -e "$GPU_DATA/train-images-idx3-ubyte.gz" ] ||
        echo "build.sh gpu: no Fashion-MNIST in '$GPU_DATA' (--data DIR, or ./build.sh gpu-data before the tree travels)" >&2
    nccl=$(find_nccl "$nvcc") || nccl=""
    [ -n "$GPU_ARCH" ] || GPU_ARCH=$(gpu_default_arch)
    if [ -n "${GPU_PREBUILT:-}" ]; then
        gpu_use_prebuilt "$nccl" || return 1
    else
        GPU_BIN=./$B
        echo "build.sh gpu $step: nvcc $(nvcc_release "$nvcc"), -arch=$GPU_ARCH, data $GPU_DATA, NCCL $([ -z "$nccl" ] && echo none || { [ "$nccl" = " " ] && echo system || echo "$nccl"; }), output $GPU_OUT"
        if ! gpu_build "$nvcc" "$zflags" "$libs" "$nccl" >"$GPU_OUT/build.log" 2>&1; then
            cat "$GPU_OUT/build.log"
            echo "build.sh gpu: the build failed (see above and $GPU_OUT/build.log)" >&2
            return 1
        fi
    fi
    for s in test sanitize bench torch; do
        case $step in all) [ $s = sanitize ] && continue ;; "$s") ;; *) continue ;; esac
        "gpu_step_$s" "$nvcc"
    done
    {
        echo "## ./build.sh gpu $step ($(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
        echo
        gpu_device_lines | sed 's/^/    /'
        echo
        echo "| step | result |"
        echo "|---|---|"
        [ ${#GPU_ROWS[@]} -gt 0 ] && printf '%s\n' "${GPU_ROWS[@]}"
        echo
        echo "$passed passed, $failed failed, $skipped skipped"
    } | tee "$GPU_OUT/summary_$step.md"
    [ $failed -eq 0 ]
}


# ---- the two test commands -----------------------------------------------------

# finish WHAT: the closing line, and the exit status.
finish() {
    [ $omitted -eq 0 ] ||
        echo "build.sh: $omitted interop cases were left out here (they need Python packages): ./build.sh check runs them"
    echo "build.sh $1 took $(elapsed)"
    echo "$passed passed, $failed failed, $skipped skipped"
    [ $failed -eq 0 ]
}

# ./build.sh test: what needs no PyPI package, MPI, nvcc or fuzzing. The test
# programs that use only the public API link one implementation object
# built with AddressSanitizer + UBSan; the others compile it themselves,
# with UBSan (./build.sh check runs them all under both). The interop
# cases report OMIT (MPT_TEST_INTEROP=0).
run_quick() {
    install_packages $DEB_TEST
    export MPT_TEST_INTEROP=0
    TESTS_LEFT_OUT=tests/test_cuda.c
    unset MPT_TEST_PYTHON MPT_TEST_PYTHON_REQUIRED
    run_test_programs asan ubsan
    finish test
}

# ./build.sh check: everything (what CI runs).
run_check() {
    local kind
    install_packages $DEB_CHECK
    python_env
    echo "build.sh: the plain build ($(elapsed))"
    build_all_check
    readme_example_checks
    echo "build.sh: the fuzz harnesses, the GPU pack, mpt.h as C99, C11, C++17 and portable C," \
        "three compilers' bits, nvcc, MPI ($(elapsed))"
    compile_sources
    fuzz_build_jobs
    spawn timed gpu_pack_job
    for kind in c99 c11 portable cxx; do spawn timed compile_job $kind; done
    for kind in $SAME_BITS_KINDS; do spawn timed same_bits_job $kind; done
    spawn timed cuda_compile_job
    spawn timed mpi_build_job cuda
    spawn timed mpi_build_job strategy
    wait
    fuzz_build_results
    compile_results
    same_bits_result
    cuda_compile_result
    echo "build.sh: tests/test_cuda.c from the GPU pack ($(elapsed))"
    gpu_checks
    echo "build.sh: the tests under AddressSanitizer + UBSan ($(elapsed))"
    run_test_programs asan asan
    required_gpu_checks
    echo "build.sh: MPI ($(elapsed))"
    mpi_tests
    echo "build.sh: fuzzing ($(elapsed))"
    fuzz_all_built $FUZZ_TEST_SECONDS
    finish check
}

case ${1:-all} in
all) build_all ;;
test) run_quick ;;
check) run_check ;;
run)
    install_packages $DEB_TRAIN
    echo "build.sh: building $B/mlp from examples/mlp.c (only what changed)"
    impl_object plain && build_program plain examples/mlp.c || exit 1
    shift
    "./$B/mlp" --verbose 1 "$@"
    ;;
bench)
    build_all || exit 1
    for b in bench/*.c; do "./$B/$(basename "$b" .c)"; done
    ;;
gpu) shift; run_gpu "$@" ;;
gpu-data) gpu_data "${2:-}" ;;
gpu-pack) gpu_pack ;;
fuzz)
    install_packages clang libclang-rt-14-dev
    fuzz_all "${2:-60}"
    echo "$passed passed, $failed failed"
    [ $failed -eq 0 ]
    ;;
*) echo "usage: ./build.sh [all|run|test|check|bench|gpu [STEP] [--data DIR] [--out DIR]|gpu-data [SRC]|gpu-pack|fuzz [seconds]]" >&2; exit 2 ;;
esac

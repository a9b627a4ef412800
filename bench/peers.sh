# What bench/compare.sh and bench/compare_gpt.sh share: installing what a
# comparison needs, measuring a run on a host that may be shared, and giving
# PyTorch its fastest configuration. Sourced, not run; the sourcing script
# sets PEERS_NAME (its name in messages), PEERS_DIR (where raw output goes)
# and QUIET_WAIT (seconds, see wait_quiet) first.

# ---- what it needs ----------------------------------------------------------------
# peers_install PACKAGE...: the Debian packages missing, installed as root;
# otherwise the script says what is missing and exits.
peers_install() {
    local need=() p
    command -v gcc >/dev/null || need+=(gcc libc6-dev)
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
    done
    [ ${#need[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "$PEERS_NAME: missing packages: ${need[*]} (run as root to install them)" >&2
        exit 1
    fi
    echo "$PEERS_NAME: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }; then
        echo "$PEERS_NAME: apt-get install failed" >&2
        exit 1
    fi
}

# peers_tensorflow: TensorFlow ($TF_SPEC, default 2.21 for the CPU) from PyPI
# in the virtual environment build/venv-peers (pip only, not as root);
# TF_PY is its python.
peers_tensorflow() {
    local venv=build/venv-peers spec=${TF_SPEC:-tensorflow-cpu==2.21.*}
    if ! "$venv/bin/python" -c "import tensorflow" 2>/dev/null; then
        echo "$PEERS_NAME: installing $spec into $venv (a few minutes)" >&2
        { [ -x "$venv/bin/python" ] || "${SYS_PY:-/usr/bin/python3}" -m venv "$venv"; } &&
            "$venv/bin/pip" install -q "$spec" ||
            { echo "$PEERS_NAME: cannot install $spec into $venv" >&2; exit 1; }
    fi
    TF_PY=$venv/bin/python
}

# ---- measuring a run --------------------------------------------------------------
# The host may be shared: each run records how many cores other processes
# kept busy meanwhile ("others_cores", from /proc/stat less this script's
# children), and with QUIET_WAIT=S a run first waits up to S seconds for the
# other processes to use less than a quarter of a core.
HZ=$(getconf CLK_TCK 2>/dev/null || echo 100)
busy_jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# children_cpu FILE: user + system seconds of this shell's finished children
# into FILE. `times` must run in this shell: in a $(...) subshell it would
# count that subshell's children only.
children_cpu() {
    times >"$PEERS_DIR/times.txt"
    awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] }
                   print t }' "$PEERS_DIR/times.txt" >"$1"
}
now() { date +%s.%N; }
others_cores() { # busy0 busy1 self0 self1 wall0 wall1
    awk -v b0="$1" -v b1="$2" -v s0="$3" -v s1="$4" -v w0="$5" -v w1="$6" -v hz="$HZ" \
        'BEGIN { o = ((b1 - b0) / hz - (s1 - s0)) / (w1 - w0); printf "%.2f", o < 0 ? 0 : o }'
}
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
FAILED_RUNS=0 # runs that printed no result: the script then exits 1
# measure NAME ROUND FIELDS COMMAND...: runs it (output in
# $PEERS_DIR/NAME_ROUND.txt) and appends its JSON lines to $PEERS_DIR/results.jsonl
# with FIELDS (JSON members ending in a comma, or empty), the round and
# others_cores added.
measure() {
    local name=$1 round=$2 fields=$3 out s0 s1 b0 b1 w0 w1 oc
    shift 3
    out=$PEERS_DIR/${name}_$round.txt
    wait_quiet
    echo "## round $round: $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    children_cpu "$PEERS_DIR/self.txt"; s0=$(cat "$PEERS_DIR/self.txt"); b0=$(busy_jiffies); w0=$(now)
    "$@" >"$out" 2>"$PEERS_DIR/${name}_$round.err"
    b1=$(busy_jiffies); w1=$(now); children_cpu "$PEERS_DIR/self.txt"; s1=$(cat "$PEERS_DIR/self.txt")
    oc=$(others_cores "$b0" "$b1" "$s0" "$s1" "$w0" "$w1")
    grep '^{' "$out"
    echo "# other processes kept $oc cores busy during this run ($(awk -v a="$w0" -v b="$w1" \
         'BEGIN { printf "%.0f", b - a }') s)"
    grep -q '^{' "$out" || { echo "$PEERS_NAME: $name printed no result:" >&2
                            tail -n 5 "$PEERS_DIR/${name}_$round.err" >&2; FAILED_RUNS=$((FAILED_RUNS + 1)); }
    grep '^{' "$out" | sed "s/}\$/,${fields}\"round\":$round,\"others_cores\":$oc}/" \
        >>"$PEERS_DIR/results.jsonl"
}

# peers_finish: the script's end; it fails, saying so, when a run printed no
# result (FAILED_RUNS; what the run wrote to stderr is in $PEERS_DIR/*.err).
peers_finish() {
    if [ "$FAILED_RUNS" -gt 0 ]; then
        echo "$PEERS_NAME: $FAILED_RUNS run(s) printed no result (see $PEERS_DIR/*.err)" >&2
        exit 1
    fi
}

# ---- PyTorch's configuration ------------------------------------------------------
# OpenBLAS with the core type the CPU has (the environment may preset a
# slower one), glibc's malloc thresholds fixed (otherwise large activations
# are mmap'ed and unmapped every step and page faults dominate), and
# whichever of OpenBLAS's OpenMP or pthread build and libgomp's wait
# policies (default: idle threads spin; PASSIVE: they sleep) torch_probe
# finds fastest. The OpenBLAS build is picked with LD_LIBRARY_PATH; the
# system's alternative is left alone.
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu
case " $(grep -m1 '^flags' /proc/cpuinfo) " in
*" avx512f "*) CORETYPE=SkylakeX ;;
*" avx2 "*) CORETYPE=Haswell ;;
*) CORETYPE= ;;
esac
PRESET_CORETYPE=${OPENBLAS_CORETYPE:-none}
# torch_env BLAS WAIT: the environment of one configuration (BLAS:
# openmp|pthread, WAIT: default|passive) as `env` arguments, a line each
# (env takes its -u options only before NAME=VALUE).
torch_env() {
    local e=(-u OMP_WAIT_POLICY -u OPENBLAS_CORETYPE
             LD_LIBRARY_PATH="$OPENBLAS_DIR/openblas-$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
             MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824)
    [ -n "$CORETYPE" ] && e+=(OPENBLAS_CORETYPE="$CORETYPE")
    [ "$2" = passive ] && e+=(OMP_WAIT_POLICY=PASSIVE)
    printf '%s\n' "${e[@]}"
}
torch_config_name() { echo "openblas-$1 coretype=${CORETYPE:-auto} malloc=fixed omp_wait=$2"; }
# torch_probe PASSES RATE_FUNCTION: each of the four configurations is
# given to RATE_FUNCTION (as env arguments; it runs a short training under
# them and prints its rate) PASSES times, interleaved; the fastest run's
# configuration is kept in TORCH_ENV (env arguments) and TORCH_CONFIG (its
# name). Short probes: libgomp's spinning threads can make a run 20-100x
# slower on a busy host.
torch_probe() {
    local passes=$1 rate_function=$2 pass blas wait rate best=0 best_blas=openmp best_wait=passive
    local -a e
    echo "# probing PyTorch's configurations (environment preset OPENBLAS_CORETYPE=$PRESET_CORETYPE)"
    for pass in $(seq 1 "$passes"); do
        for blas in openmp pthread; do
            for wait in passive default; do
                mapfile -t e < <(torch_env "$blas" "$wait")
                rate=$("$rate_function" "${e[@]}")
                echo "#   pass $pass: $(torch_config_name "$blas" "$wait"): ${rate:-failed}"
                if awk -v a="${rate:-0}" -v b="$best" 'BEGIN { exit !(a > b) }'; then
                    best=$rate best_blas=$blas best_wait=$wait
                fi
            done
        done
    done
    mapfile -t TORCH_ENV < <(torch_env "$best_blas" "$best_wait")
    TORCH_CONFIG=$(torch_config_name "$best_blas" "$best_wait")
    echo "# PyTorch runs with: $TORCH_CONFIG (${TORCH_ENV[*]})"
}

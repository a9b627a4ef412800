/* A very small test harness shared by the test programs.

   Each test program includes this file, runs named tests with TEST_RUN(),
   and ends with test_summary(). Every test prints one line,
       PASS <name>   |   FAIL <name>: <why>   |   SKIP <name>: <why>
       OMIT <name>: <why>   (an interop case ./build.sh test leaves out)
   which ./build.sh test and check count over all programs. A failed CHECK
   inside a test records the first failure's file, line and message, and the test
   goes on (so its cleanup still runs). */
#ifndef MPT_TEST_H
#define MPT_TEST_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test__passed, test__failed, test__skipped, test__omitted;
static int test__current_failed;
static int test__open; /* checks made since test__begin, not yet reported */
static char test__why[512];
static const char *test__skip_reason;
static const char *test__omit_reason;

static void test__fail(const char *file, int line, const char *fmt, ...) {
    if (!test__current_failed) {
        int n = snprintf(test__why, sizeof test__why, "%s:%d: ", file, line);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(test__why + n, sizeof test__why - (size_t)n, fmt, ap);
        va_end(ap);
    }
    test__current_failed = 1;
}

/* CHECK(cond, "format", ...) records a failure with the message when cond is false. */
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) test__fail(__FILE__, __LINE__, __VA_ARGS__);          \
    } while (0)

/* Marks the running test as skipped (counted apart, never as passed). */
#define SKIP(reason) (test__skip_reason = (reason))

static inline void test__report(const char *name);

/* Starts a test: no failure, no skip yet. A failure still open (a case
   loop's checks before its first test__begin) is reported first rather
   than forgotten. */
static inline void test__begin(void) {
    if (test__open && test__current_failed) test__report("(checks before the next case)");
    test__open = 1;
    test__current_failed = 0;
    test__skip_reason = NULL;
    test__omit_reason = NULL;
    test__why[0] = 0;
}

/* Ends the running test: counts it and prints its line. */
static inline void test__report(const char *name) {
    test__open = 0;
    if (test__current_failed) {
        test__failed++;
        printf("FAIL %s: %s\n", name, test__why);
    } else if (test__omit_reason) {
        test__omitted++;
        printf("OMIT %s: %s\n", name, test__omit_reason);
    } else if (test__skip_reason) {
        test__skipped++;
        printf("SKIP %s: %s\n", name, test__skip_reason);
    } else {
        test__passed++;
        printf("PASS %s\n", name);
    }
    fflush(stdout);
}

static inline void test__run(const char *name, void (*fn)(void)) {
    test__begin();
    fn();
    test__report(name);
}

#define TEST_RUN(fn) test__run(#fn, fn)

/* For tests that loop over cases: test__begin(), the checks, then
   test__end("name %d", ...) names the case. */
static inline void test__end(const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    test__report(name);
}

/* Prints this program's totals and returns the exit status. */
static int test_summary(const char *program) {
    printf("# %s: %d passed, %d failed, %d skipped", program, test__passed, test__failed,
           test__skipped);
    if (test__omitted) printf(", %d interop cases left out (MPT_TEST_INTEROP=0)", test__omitted);
    printf("\n");
    return test__failed ? 1 : 0;
}

/* Deterministic random numbers for test inputs (never all zeros). */
static unsigned long long test__rng_state = 0x9e3779b97f4a7c15ull;
static inline void test_seed(unsigned long long seed) { test__rng_state = seed * 0x9e3779b97f4a7c15ull + 1; }
static inline unsigned long long test_next(void) {
    unsigned long long z = (test__rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform in [lo, hi). */
static inline double test_uniform(double lo, double hi) {
    return lo + (hi - lo) * (double)(test_next() >> 11) * (1.0 / 9007199254740992.0);
}
static inline int test_randint(int lo, int hi) { /* inclusive */
    return lo + (int)(test_next() % (unsigned long long)(hi - lo + 1));
}

/* ---- Python, for the interoperability tests ---------------------------------- */

/* The Python the interoperability tests run: $MPT_TEST_PYTHON (./build.sh
   check points it at the virtual environment it filled), else python3. */
static inline const char *test_python(void) {
    const char *py = getenv("MPT_TEST_PYTHON");
    return py && *py ? py : "python3";
}

/* Python: ort_session(model, options=None), the ONNX Runtime CPU session
   an interoperability test reads its outputs from. On an x86 CPU without
   VNNI, ONNX Runtime's fused int8 kernels (QLinearConv, QGemm,
   QLinearMatMul) multiply the bytes in pairs summed in 16 bits
   (vpmaddubsw), which saturates: on a Zen 3 one Conv2D's outputs were up
   to 67 steps from their exact values and the int8 ResNet-20's top-1
   agreed with the exact one on 0 of 400 samples (the file run unfused
   agreed). There a
   graph with QuantizeLinear runs unfused (ORT_ENABLE_BASIC: each Q/DQ
   pair in float, as ONNX defines them); a test that checks the fusion
   itself makes a session of its own for that. */
#define TEST_ORT_SESSION_PY                                                                   \
    "def ort_session(model, options=None):\n"                                                 \
    "    import platform, onnx, onnxruntime as ort\n"                                        \
    "    flags = open('/proc/cpuinfo').read().split()\n"                                      \
    "    saturates = platform.machine() in ('x86_64', 'AMD64') and \\\n"                     \
    "        'avx512_vnni' not in flags and 'avx_vnni' not in flags\n"                        \
    "    if saturates and any(n.op_type == 'QuantizeLinear'\n"                                \
    "                         for n in onnx.load(model).graph.node):\n"                       \
    "        options = ort.SessionOptions()\n"                                                \
    "        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC\n" \
    "    return ort.InferenceSession(model, options, providers=['CPUExecutionProvider'])\n"

/* Writes the Python program `text` to dir/name, and into cmd (size bytes)
   the shell command that runs it in test_python() on one argument, arg,
   its errors joined to its output. 0 when the file cannot be written or
   the command does not fit. */
static inline int test_python_script(char *cmd, size_t size, const char *dir, const char *name,
                                     const char *text, const char *arg) {
    char script[512];
    FILE *f;
    if (snprintf(script, sizeof script, "%s/%s", dir, name) >= (int)sizeof script) return 0;
    f = fopen(script, "w");
    if (!f) return 0;
    fputs(text, f);
    fclose(f);
    return snprintf(cmd, size, "'%s' '%s' '%s' 2>&1", test_python(), script, arg) < (int)size;
}

#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200809L /* popen, pclose */
/* Runs the Python program `text` (written to dir/name) on arg and hands
   each line of its output, its newline removed, to line(user, text). 1
   when the program ran and exited with status 0. */
static inline int test_python_lines(const char *dir, const char *name, const char *text,
                                    const char *arg, void (*line)(void *user, const char *text),
                                    void *user) {
    char cmd[1024], buf[8192];
    FILE *p;
    if (!test_python_script(cmd, sizeof cmd, dir, name, text, arg)) return 0;
    p = popen(cmd, "r");
    if (!p) return 0;
    while (fgets(buf, sizeof buf, p)) {
        buf[strcspn(buf, "\n")] = 0;
        line(user, buf);
    }
    return pclose(p) == 0;
}
#endif

/* 1 when test_python() imports `modules` ("numpy, safetensors.numpy").
   Else 0, and the running test is skipped, or fails where build.sh has
   installed the packages (MPT_TEST_PYTHON_REQUIRED=1): there a missing
   module is a broken setup, not an optional one. Under MPT_TEST_INTEROP=0
   (./build.sh test, which installs no Python package) 0 at once, and the
   test is reported as OMIT: left to ./build.sh check, not skipped. */
static inline int test_python_imports(const char *modules) {
    static char why[512];
    const char *required = getenv("MPT_TEST_PYTHON_REQUIRED");
    const char *interop = getenv("MPT_TEST_INTEROP");
    char cmd[1024];
    if (interop && strcmp(interop, "0") == 0) {
        snprintf(why, sizeof why, "needs Python with %s: ./build.sh check runs it", modules);
        test__omit_reason = why;
        return 0;
    }
    snprintf(cmd, sizeof cmd, "'%s' -c 'import %s' >/dev/null 2>&1", test_python(), modules);
    if (system(cmd) == 0) return 1;
    if (required && strcmp(required, "1") == 0) {
        test__fail(__FILE__, __LINE__, "%s cannot import %s, which build.sh installed "
                   "(MPT_TEST_PYTHON_REQUIRED=1)", test_python(), modules);
    } else {
        snprintf(why, sizeof why, "%s cannot import %s (./build.sh check installs them)",
                 test_python(), modules);
        SKIP(why);
    }
    return 0;
}

#endif

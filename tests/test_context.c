/* The context: threads, the allocator hook (and that a built model's
   forward and backward allocate nothing), the logger, errors, tensors. */
#define _XOPEN_SOURCE 700 /* setenv, fork, sigaltstack */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quiet(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    (void)msg;
}

/* A forward and backward pass of a built model allocate nothing, and every
   allocation is freed by destroy. */
static void test_no_allocation_in_a_step(void) {
    counting_alloc c = {0, 0, -1};
    mpt_context *ctx = counting_ctx(&c);
    mpt_model *m = NULL;
    float x[4 * 12];
    int64_t shape[2] = {4, 12};
    mpt_tensor tx, ty, dx;
    long before;
    int i;
    CHECK(ctx != NULL, "create");
    for (i = 0; i < 48; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {12}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 9, .activation = MPT_ACT_GELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .dtype = MPT_FLOAT32});
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, shape, x);
    before = c.allocs;
    for (i = 0; i < 3; i++) {
        CHECK(mpt_model_forward(m, &tx, 1, &ty) == MPT_OK, "forward");
        CHECK(mpt_model_backward(m, NULL, &dx) == MPT_OK, "backward");
    }
    CHECK(c.allocs == before, "a step allocated %ld times", c.allocs - before);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    CHECK(c.allocs == c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
}

/* A context destroyed before its models (built and compiled, one trained
   a step) stays, with a warning, until the last of them is destroyed, and
   is freed then: no use after free, every allocation freed at the end. */
static void test_context_destroyed_before_its_models(void) {
    counting_alloc c = {0, 0, -1};
    mpt_context *ctx = counting_ctx(&c);
    mpt_model *m[2] = {NULL, NULL};
    float x[4 * 3] = {0.5f, -1, 2, 0, 1, 1, -0.25f, 3, 0, 1, 2, -2};
    int32_t y[4] = {0, 1, 1, 0};
    mpt_dataset *data;
    int k;
    CHECK(ctx != NULL, "context");
    if (!ctx) return;
    for (k = 0; k < 2; k++) {
        m[k] = small_classifier(ctx, &(classifier_desc){.features = 3, .hidden = 5,
                                                        .classes = 2, .seed = 7});
        CHECK(m[k] && mpt_model_build(m[k], 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    }
    data = test_dataset_xy(ctx, x, y, 4, 3);
    CHECK(m[0] && data && mpt_model_fit(m[0], data, &(mpt_fit_desc){.epochs = 1,
                                                                    .batch_size = 2}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(data);
    mpt_context_destroy(ctx);
    CHECK(c.frees < c.allocs, "the context went while its models remain");
    mpt_model_destroy(m[1]);
    CHECK(c.frees < c.allocs, "the context went while a model remains");
    mpt_model_destroy(m[0]); /* the last: frees the context too */
    CHECK(c.allocs == c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
}

/* Every allocation failing in turn gives an out-of-memory status and no
   leak (the sanitizer's leak check covers the frees). */
static void test_out_of_memory_everywhere(void) {
    long k;
    int saw_oom = 0;
    for (k = 0; k < 40; k++) {
        counting_alloc c = {0, 0, k};
        mpt_context *ctx = NULL;
        mpt_model *m = NULL;
        mpt_context_desc d;
        mpt_status s;
        memset(&d, 0, sizeof d);
        d.num_threads = 2;
        d.allocator.alloc = count_alloc;
        d.allocator.free = count_free;
        d.allocator.user_data = &c;
        d.logger.fn = quiet;
        s = mpt_context_create(&d, &ctx);
        if (s == MPT_OK) {
            s = mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {5}, .input_rank = 1}, &m);
            if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 4});
            if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
            if (s == MPT_OK) s = mpt_model_build(m, 3);
            mpt_model_destroy(m);
            mpt_context_destroy(ctx);
        }
        CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "allocation %ld failing gave %s", k,
              mpt_status_string(s));
        saw_oom |= s == MPT_ERR_OUT_OF_MEMORY;
        CHECK(c.allocs == c.frees, "allocation %ld failing: %ld allocs, %ld frees", k, c.allocs,
              c.frees);
    }
    CHECK(saw_oom, "no allocation failure was ever reported");
}

typedef struct count_tasks {
    int hits[1000];
    int threads_seen[8];
} count_tasks;

static void mark_task(void *arg, int64_t task, int thread) {
    count_tasks *c = (count_tasks *)arg;
    c->hits[task]++; /* each task has its own slot: no race */
    c->threads_seen[thread] = 1;
}

static void nested_task(void *arg, int64_t task, int thread);
static mpt_context *nested_ctx;

static int inner_thread[50];

static void record_inner_thread(void *arg, int64_t task, int thread) {
    (void)task;
    *(int *)arg = thread;
}

static void nested_task(void *arg, int64_t task, int thread) {
    count_tasks *c = (count_tasks *)arg;
    /* A parallel-for inside a task runs inline on this thread, under this
       thread's index (so it uses this thread's scratch). */
    inner_thread[task] = -1;
    mpt__parallel_for(nested_ctx, 3, record_inner_thread, &inner_thread[task]);
    if (inner_thread[task] != thread) c->hits[200 + task]++;
    c->hits[100 + task]++;
}

static void test_parallel_for(void) {
    static count_tasks c;
    mpt_context *ctx;
    int i;
    memset(&c, 0, sizeof c);
    CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = 3}, &ctx) == MPT_OK, "create");
    CHECK(mpt_context_num_threads(ctx) == 3, "threads %d", mpt_context_num_threads(ctx));
    for (i = 0; i < 20; i++) mpt__parallel_for(ctx, 1000, mark_task, &c);
    for (i = 0; i < 1000; i++) CHECK(c.hits[i] == 20, "task %d ran %d times", i, c.hits[i]);
    memset(&c, 0, sizeof c);
    nested_ctx = ctx;
    mpt__parallel_for(ctx, 50, nested_task, &c);
    for (i = 0; i < 50; i++) {
        CHECK(c.hits[100 + i] == 1, "nested task %d ran %d times", i, c.hits[100 + i]);
        CHECK(c.hits[200 + i] == 0, "nested task %d ran its inner tasks under another index", i);
    }
    mpt_context_destroy(ctx);
}

/* Jobs back to back with 1 to 9 tasks: each task runs once, inside its own
   parallel-for. A worker that wakes after its job ended (the caller does
   not wait for workers that took no task) must find nothing to run, and
   one that spins must see the next job's tasks, not the last one's. */
typedef struct short_job {
    int id;
    int hits[9];
} short_job;

static volatile int live_job = -1; /* the job whose parallel-for is running */
static int stray_tasks;

static void short_task(void *arg, int64_t task, int thread) {
    short_job *j = (short_job *)arg;
    (void)thread;
    if (j->id != live_job) __atomic_add_fetch(&stray_tasks, 1, __ATOMIC_RELAXED);
    j->hits[task]++;
}

static void test_parallel_for_back_to_back(void) {
    mpt_context *ctx;
    int i, t, bad = 0;
    CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = 3}, &ctx) == MPT_OK, "create");
    test_seed(5);
    for (i = 0; i < 20000; i++) {
        short_job j;
        const int n = 1 + (int)(test_next() % 9);
        memset(&j, 0, sizeof j);
        j.id = i;
        live_job = i;
        mpt__parallel_for(ctx, n, short_task, &j);
        live_job = -1;
        for (t = 0; t < 9; t++) bad += j.hits[t] != (t < n);
        if (i % 1000 == 999) /* let the workers fall asleep now and then */
            nanosleep(&(struct timespec){ 0, 200000 }, NULL);
    }
    CHECK(bad == 0, "%d tasks ran other than once", bad);
    CHECK(stray_tasks == 0, "%d tasks ran outside their parallel-for", stray_tasks);
    mpt_context_destroy(ctx);
}

static void test_threads_from_environment(void) {
    mpt_context *ctx;
    setenv("MPT_NUM_THREADS", "3", 1);
    CHECK(mpt_context_create(NULL, &ctx) == MPT_OK, "create");
    CHECK(mpt_context_num_threads(ctx) == 3, "MPT_NUM_THREADS=3 gave %d", mpt_context_num_threads(ctx));
    mpt_context_destroy(ctx);
    CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = 1}, &ctx) == MPT_OK, "create");
    CHECK(mpt_context_num_threads(ctx) == 1, "the descriptor did not win over the environment");
    mpt_context_destroy(ctx);
    unsetenv("MPT_NUM_THREADS");
    CHECK(mpt_context_create(&(mpt_context_desc){.num_threads = -1, .logger = {quiet, NULL}},
                             &ctx) == MPT_ERR_INVALID_ARGUMENT,
          "num_threads -1 accepted");
}

static char last_message[256];
static int messages;
static void remember(void *user, mpt_log_level level, const char *msg) {
    (void)user;
    if (level == MPT_LOG_ERROR) {
        snprintf(last_message, sizeof last_message, "%s", msg);
        messages++;
    }
}

static void test_errors_reach_logger_and_context(void) {
    mpt_context *ctx;
    mpt_context_desc d;
    mpt_tensor t;
    int64_t shape[2] = {3, -2};
    memset(&d, 0, sizeof d);
    d.logger.fn = remember;
    mpt_context_create(&d, &ctx);
    CHECK(strcmp(mpt_context_error(ctx), "") == 0, "fresh context has an error");
    CHECK(mpt_tensor_alloc(ctx, &t, MPT_FLOAT16, 2, shape) == MPT_ERR_SHAPE, "bad shape accepted");
    CHECK(strstr(mpt_context_error(ctx), "(3, -2)") != NULL, "error: %s", mpt_context_error(ctx));
    CHECK(messages == 1 && strstr(last_message, "(3, -2)") != NULL, "logger got: %s", last_message);
    CHECK(strcmp(mpt_status_string(MPT_ERR_SHAPE), "shape mismatch") == 0, "status string");
    mpt_context_destroy(ctx);
}

static void test_cpu_features_can_be_disabled(void) {
    mpt_context *ctx;
    mpt_context_create(&(mpt_context_desc){.disable_cpu_features = ~0}, &ctx);
    CHECK(mpt_context_cpu_features(ctx) == 0, "features left: %x", mpt_context_cpu_features(ctx));
    mpt_context_destroy(ctx);
}

static void test_dtypes_and_shapes(void) {
    char buf[64];
    CHECK(mpt_dtype_size(MPT_BFLOAT16) == 2 && mpt_dtype_size(MPT_INT8) == 1 &&
              mpt_dtype_size(MPT_INT32) == 4 && mpt_dtype_size((mpt_dtype)0) == 0, "sizes");
    CHECK(strcmp(mpt_dtype_name(MPT_FLOAT16), "float16") == 0, "name");
    CHECK(strcmp(mpt_shape_format(buf, sizeof buf, 4, (int64_t[]){128, 28, 28, 1}),
                 "(128, 28, 28, 1)") == 0, "format: %s", buf);
    CHECK(strcmp(mpt_shape_format(buf, sizeof buf, 1, (int64_t[]){784}), "(784,)") == 0,
          "format: %s", buf);
    CHECK(strcmp(mpt_shape_format(buf, 6, 2, (int64_t[]){1000, 1000}), "(1000") == 0,
          "truncated format: %s", buf);
}

/* A context whose descriptor disables MPT_CPU_AMX_INT8 never asks Linux
   for AMX's tile state, nor does a device query through it (which still
   reports the CPU's AMX). On a CPU with AMX, a child of this process
   (which has made no context yet: this case runs first, and a child
   inherits its parent's grant) makes such a context and queries the CPU
   through it, then installs an alternate signal stack over MINSIGSTKSZ
   but under the 8 KiB of tile data: Linux refuses that stack once the
   process holds the grant, so its success says neither asked. A context
   made after that with AMX allowed is still made, without AMX (Linux
   refuses the grant while the small stack is in place). */
static void test_amx_not_asked_when_disabled(void) {
#if MPT__X86 && defined(__x86_64__) && defined(__linux__)
    static const char *why[] = {"", "the small signal stack was refused: the context asked",
                                "AMX taken with a signal stack too small for it",
                                "a context failed to be made",
                                "the device query lost AMX or failed"};
    int status = 0;
    pid_t child;
    if (!mpt__cpu_has_amx_int8()) {
        SKIP("this CPU lacks the path (no AMX int8 tiles the OS saves)");
        return;
    }
    fflush(stdout);
    child = fork();
    if (child == 0) {
        static char small[6 * 1024];
        stack_t st;
        mpt_context *ctx = NULL;
        mpt_device_info cpu;
        if (mpt_context_create(&(mpt_context_desc){.disable_cpu_features = MPT_CPU_AMX_INT8},
                               &ctx) != MPT_OK)
            _exit(3);
        if (mpt_device_query(ctx, 0, &cpu) != MPT_OK || !(cpu.cpu_features & MPT_CPU_AMX_INT8))
            _exit(4);
        mpt_context_destroy(ctx);
        memset(&st, 0, sizeof st);
        st.ss_sp = small;
        st.ss_size = sizeof small;
        if (sigaltstack(&st, NULL) != 0) _exit(1);
        if (mpt_context_create(NULL, &ctx) != MPT_OK) _exit(3);
        status = mpt_context_cpu_features(ctx) & MPT_CPU_AMX_INT8 ? 2 : 0;
        mpt_context_destroy(ctx);
        _exit(status);
    }
    CHECK(child > 0 && waitpid(child, &status, 0) == child, "fork or wait failed");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: %s",
          WIFEXITED(status) && WEXITSTATUS(status) <= 4 ? why[WEXITSTATUS(status)]
                                                         : "ended by a signal");
#else
    SKIP("not x86-64 Linux");
#endif
}

static void run_cases(void) {
    TEST_RUN(test_amx_not_asked_when_disabled); /* first: before any context asks */
    TEST_RUN(test_no_allocation_in_a_step);
    TEST_RUN(test_out_of_memory_everywhere);
    TEST_RUN(test_context_destroyed_before_its_models);
    TEST_RUN(test_parallel_for);
    TEST_RUN(test_parallel_for_back_to_back);
    TEST_RUN(test_threads_from_environment);
    TEST_RUN(test_errors_reach_logger_and_context);
    TEST_RUN(test_cpu_features_can_be_disabled);
    TEST_RUN(test_dtypes_and_shapes);
}

int main(void) {
    static const test_program p = {.name = "test_context", .seed = 5, .cases = run_cases};
    return test_main(&p);
}

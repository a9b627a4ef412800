/* Devices and memory: the CPU as device 0 (mpt_device_query), a model's
   memory per category (mpt_model_memory) against sizes worked out by hand,
   and the model's memory_limit. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static void test_cpu_is_device_zero(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_device_info info;
    int features = mpt_context_cpu_features(ctx);
    CHECK(mpt_device_count(ctx) >= 1, "count %d", mpt_device_count(ctx));
    CHECK(mpt_device_query(ctx, 0, &info) == MPT_OK, "query: %s", mpt_context_error(ctx));
    CHECK(info.kind == MPT_DEVICE_CPU && info.ordinal == 0, "kind %d ordinal %d", info.kind,
          info.ordinal);
    CHECK(info.name[0] != 0 && info.name[0] != ' ', "name \"%s\"", info.name);
    CHECK(info.cores >= 1, "cores %d", info.cores);
    CHECK(info.cpu_features == features, "features %x, the context uses %x", info.cpu_features,
          features);
    CHECK(!(features & MPT_CPU_AVX2) == !strstr(info.features, "avx2"), "\"%s\" for %x",
          info.features, features);
    CHECK(!(features & MPT_CPU_F16C) == !strstr(info.features, "f16c"), "\"%s\" for %x",
          info.features, features);
    CHECK(!(features & MPT_CPU_AVX512) == !strstr(info.features, "avx512f"), "\"%s\" for %x",
          info.features, features);
    CHECK(!(features & MPT_CPU_AVX512_BF16) == !strstr(info.features, "avx512bf16"),
          "\"%s\" for %x", info.features, features);
    CHECK(!(features & MPT_CPU_AVX512_VNNI) == !strstr(info.features, "avx512vnni"),
          "\"%s\" for %x", info.features, features);
    CHECK(info.memory_total > 0 && info.memory_free > 0 && info.memory_free <= info.memory_total,
          "memory %lld of %lld free", (long long)info.memory_free, (long long)info.memory_total);
    CHECK(info.compute_major == 0 && info.sm_count == 0, "CUDA fields set for the CPU");
    mpt_context_destroy(ctx);
}

/* The device reports what the CPU has, even where a context uses less. */
static void test_device_features_are_the_hardware_ones(void) {
    mpt_context *all = quiet_ctx(), *none = NULL;
    mpt_device_info a, b;
    mpt_context_create(&(mpt_context_desc){.disable_cpu_features = ~0, .logger.fn = quiet_logger},
                       &none);
    CHECK(mpt_device_query(all, 0, &a) == MPT_OK && mpt_device_query(none, 0, &b) == MPT_OK,
          "query");
    CHECK(a.cpu_features == b.cpu_features && strcmp(a.features, b.features) == 0,
          "%x \"%s\" vs %x \"%s\"", a.cpu_features, a.features, b.cpu_features, b.features);
    mpt_context_destroy(all);
    mpt_context_destroy(none);
}

static void test_bad_device_index_is_named(void) {
    mpt_context *ctx = quiet_ctx();
    mpt_device_info info;
    int n = mpt_device_count(ctx);
    char want[32];
    snprintf(want, sizeof want, "index %d ", n);
    CHECK(mpt_device_query(ctx, n, &info) == MPT_ERR_INVALID_ARGUMENT, "index %d accepted", n);
    CHECK(strstr(mpt_context_error(ctx), want) != NULL, "error: %s", mpt_context_error(ctx));
    CHECK(mpt_device_query(ctx, -1, &info) == MPT_ERR_INVALID_ARGUMENT, "index -1 accepted");
    CHECK(strstr(mpt_context_error(ctx), "index -1 ") != NULL, "error: %s",
          mpt_context_error(ctx));
    CHECK(mpt_device_query(ctx, 0, NULL) == MPT_ERR_INVALID_ARGUMENT, "NULL out accepted");
    mpt_context_destroy(ctx);
}

/* Bytes as the model's arenas hold them: each buffer rounded up to 64. */
static int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* (inputs) -> Dense(hidden, relu) -> Dense(outputs), mixed_float16, with
   random sizes so that the rounding is exercised. */
typedef struct dense_shape {
    int64_t inputs, hidden, outputs;
} dense_shape;

static mpt_model *small_dense(mpt_context *ctx, dense_shape s, int64_t memory_limit) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {s.inputs}, .input_rank = 1,
                                            .policy = MPT_POLICY_MIXED_FLOAT16,
                                            .memory_limit = memory_limit}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = s.hidden, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = s.outputs});
    return m;
}

static void compile_adam(mpt_model *m) {
    mpt_model_compile(m, &(mpt_compile_desc){.loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR}});
}

static dense_shape random_shape(void) {
    dense_shape s;
    s.inputs = 3 + (int64_t)test_uniform(0, 20);
    s.hidden = 3 + (int64_t)test_uniform(0, 20);
    s.outputs = 1 + (int64_t)test_uniform(0, 5);
    return s;
}

static void test_memory_report_by_hand(void) {
    mpt_context *ctx = quiet_ctx();
    dense_shape s = random_shape();
    mpt_model *m = small_dense(ctx, s, 0);
    mpt_memory_report r;
    /* kernel, bias of each layer */
    int64_t count[4], masters = 0, copies = 0, params = 0;
    int i;
    char summary[4096];
    count[0] = s.inputs * s.hidden;
    count[1] = s.hidden;
    count[2] = s.hidden * s.outputs;
    count[3] = s.outputs;
    for (i = 0; i < 4; i++) {
        masters += round64(4 * count[i]);
        if (i % 2 == 0) copies += round64(2 * count[i]); /* float16 kernels; biases
                                                              are added in float32 */
        params += count[i];
    }
    CHECK(mpt_model_memory(m, &r) == MPT_ERR_STATE, "a report before build");
    compile_adam(m);
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_memory(m, &r) == MPT_OK, "memory: %s", mpt_context_error(ctx));
    CHECK(r.parameters == masters, "parameters %lld, by hand %lld", (long long)r.parameters,
          (long long)masters);
    CHECK(r.gradients == masters, "gradients %lld, by hand %lld", (long long)r.gradients,
          (long long)masters);
    CHECK(r.weight_copies == copies, "weight copies %lld, by hand %lld",
          (long long)r.weight_copies, (long long)copies);
    CHECK(r.optimizer == 2 * 4 * params, "optimizer %lld, by hand (Adam: m and v) %lld",
          (long long)r.optimizer, (long long)(2 * 4 * params));
    CHECK(r.activations >= 4 * 8 * (s.inputs + s.hidden + s.outputs) / 2 && r.workspace >= 0,
          "activations %lld workspace %lld", (long long)r.activations, (long long)r.workspace);
    CHECK(r.total == r.parameters + r.gradients + r.optimizer + r.weight_copies +
                         r.activations + r.workspace,
          "total %lld is not the sum", (long long)r.total);
    CHECK(r.limit == 0, "limit %lld", (long long)r.limit);
    mpt_model_summary(m, summary, sizeof summary);
    CHECK(strstr(summary, "memory_limit") == NULL, "a limit in the summary without one");
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* Flatten -> 2 × Dense(256, relu) -> Dense(10, last), batch 64, built. */
static int64_t activations_of(mpt_context *ctx, mpt_policy policy, mpt_activation last) {
    mpt_model *m = NULL;
    mpt_memory_report r;
    int i;
    memset(&r, 0, sizeof r);
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {28, 28}, .input_rank = 2,
                                            .policy = policy}, &m);
    mpt_model_add_flatten(m, NULL);
    for (i = 0; i < 2; i++)
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = 256, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10, .activation = last});
    mpt_model_compile(m, &(mpt_compile_desc){
                             .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    CHECK(mpt_model_build(m, 64) == MPT_OK && mpt_model_memory(m, &r) == MPT_OK, "build: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
    return r.activations;
}

/* mixed_float16's final softmax computes in float32 (Keras' advice), and
   that costs activation memory for its own output only: its float32
   input and dx live in the workspace, not in buffers kept all step (which
   cost the large MLP 128 of its 351 MiB on a GPU). So the activations are
   those of the same model ending in float16, plus the output's two more
   bytes per value, and about half of float32's. */
static void test_final_softmax_costs_only_its_output(void) {
    mpt_context *ctx = quiet_ctx();
    int64_t f32 = activations_of(ctx, MPT_POLICY_FLOAT32, MPT_ACT_SOFTMAX);
    int64_t mixed = activations_of(ctx, MPT_POLICY_MIXED_FLOAT16, MPT_ACT_SOFTMAX);
    int64_t half_end = activations_of(ctx, MPT_POLICY_MIXED_FLOAT16, MPT_ACT_NONE);
    CHECK(mixed == half_end + round64(64 * 10 * 4) - round64(64 * 10 * 2),
          "mixed with a float32 softmax %lld bytes, ending in float16 %lld", (long long)mixed,
          (long long)half_end);
    CHECK(mixed <= 0.55 * (double)f32, "mixed %lld bytes of activations, float32 %lld",
          (long long)mixed, (long long)f32);
    mpt_context_destroy(ctx);
}

/* What the model of `s` needs in all, compiled with Adam. */
static mpt_memory_report plan_of(dense_shape s) {
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = small_dense(ctx, s, 0);
    mpt_memory_report r;
    memset(&r, 0, sizeof r);
    compile_adam(m);
    mpt_model_build(m, 8);
    mpt_model_memory(m, &r);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    return r;
}

static void test_memory_limit_below_the_plan_refuses_build(void) {
    dense_shape s = random_shape();
    mpt_memory_report plan = plan_of(s), r;
    /* Room for the masters and gradients but not the optimizer state: the
       plan crosses the limit there (categories in MPT_MEMORY_* order). */
    int64_t limit = plan.parameters + plan.gradients + plan.optimizer / 2;
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = small_dense(ctx, s, limit);
    char bytes[32], limit_text[48], summary[4096];
    compile_adam(m);
    CHECK(mpt_model_build(m, 8) == MPT_ERR_OUT_OF_MEMORY, "built over the limit");
    snprintf(bytes, sizeof bytes, "needs %lld bytes", (long long)plan.optimizer);
    snprintf(limit_text, sizeof limit_text, "memory_limit of %lld bytes", (long long)limit);
    CHECK(strstr(mpt_context_error(ctx), "optimizer state") &&
              strstr(mpt_context_error(ctx), bytes) && strstr(mpt_context_error(ctx), limit_text),
          "error: %s", mpt_context_error(ctx));
    CHECK(mpt_model_memory(m, &r) == MPT_ERR_STATE, "a refused build left a built model");
    mpt_model_destroy(m);
    /* Exactly the plan builds, and the summary shows the limit. */
    m = small_dense(ctx, s, plan.total);
    compile_adam(m);
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build at the limit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_memory(m, &r) == MPT_OK && r.total == plan.total && r.limit == plan.total,
          "total %lld limit %lld, plan %lld", (long long)r.total, (long long)r.limit,
          (long long)plan.total);
    mpt_model_summary(m, summary, sizeof summary);
    CHECK(strstr(summary, "memory_limit") != NULL, "summary:\n%s", summary);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
}

/* Compiled after build: compile is where the optimizer state would cross. */
static void test_memory_limit_refuses_compile_after_build(void) {
    dense_shape s = random_shape();
    mpt_memory_report plan = plan_of(s);
    mpt_context *ctx = quiet_ctx();
    mpt_model *m = small_dense(ctx, s, plan.total - 1);
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build without the optimizer: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){.loss = {.type =
                                                                MPT_LOSS_MEAN_SQUARED_ERROR}}) ==
              MPT_ERR_OUT_OF_MEMORY,
          "compiled over the limit");
    CHECK(strstr(mpt_context_error(ctx), "optimizer state") != NULL, "error: %s",
          mpt_context_error(ctx));
    mpt_model_destroy(m);
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {4}, .input_rank = 1,
                                                  .memory_limit = -1}, &m) ==
              MPT_ERR_INVALID_ARGUMENT && strstr(mpt_context_error(ctx), "memory_limit -1"),
          "negative limit: %s", mpt_context_error(ctx));
    mpt_context_destroy(ctx);
}

int main(void) {
    test_seed(23);
    TEST_RUN(test_cpu_is_device_zero);
    TEST_RUN(test_device_features_are_the_hardware_ones);
    TEST_RUN(test_bad_device_index_is_named);
    TEST_RUN(test_memory_report_by_hand);
    TEST_RUN(test_final_softmax_costs_only_its_output);
    TEST_RUN(test_memory_limit_below_the_plan_refuses_build);
    TEST_RUN(test_memory_limit_refuses_compile_after_build);
    return test_summary("test_devices");
}

/* fit's out-of-memory recovery (on_out_of_memory = MPT_OOM_HALVE_BATCH):
   a batch whose plan is over the model's memory_limit is halved until it
   fits, and training ends bit for bit where a run started at that batch
   ends; a step that runs out of memory half-way through an epoch (an
   upload refused, through a backend table that feeds the model as a GPU
   is fed) is taken again on half the batch, keeping the weights, the
   optimizer state and the epoch's tallies. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

static mpt_context *ctx;

/* Dense(32, relu) → Dense(3, softmax), Adam: the optimizer has state to keep. */
static mpt_model *make_model(mpt_context *c, int64_t memory_limit, const mpt_backend *be) {
    classifier_desc d = {FEATURES, 32, CLASSES, 0, 5, memory_limit, be};
    return small_classifier(c, &d);
}

/* Every master weight and optimizer slot equal, bit for bit. */
static int same_state(mpt_model *a, mpt_model *b) {
    int i, k;
    if (a->n_params != b->n_params || a->n_slots != b->n_slots) return 0;
    for (i = 0; i < a->n_params; i++) {
        size_t bytes = sizeof(float) * (size_t)a->params[i].count;
        if (memcmp(a->params[i].value, b->params[i].value, bytes) != 0) return 0;
        for (k = 0; a->params[i].trainable && k < a->n_slots; k++)
            if (memcmp(a->params[i].slot[k], b->params[i].slot[k], bytes) != 0) return 0;
    }
    return a->optimizer_steps == b->optimizer_steps && a->step == b->step;
}

static void test_build_halves_to_what_fits(void) {
    mpt_context *q = warning_ctx(2);
    mpt_dataset *data = blobs_in(q);
    mpt_model *probe = make_model(q, 0, NULL), *ref = make_model(q, 0, NULL), *m = NULL;
    mpt_memory_report mem;
    mpt_fit_desc f;
    int64_t limit;
    CHECK(mpt_model_build(probe, 16) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_memory(probe, &mem);
    limit = mem.total; /* batches of 16 fit exactly; 32 and 64 do not */
    f = fit_for(2, 16);
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));

    m = make_model(q, limit, NULL);
    f.batch_size = 64;
    CHECK(mpt_model_fit(m, data, &f) == MPT_ERR_OUT_OF_MEMORY,
          "without recovery the plan is refused: %s", mpt_context_error(q));
    f.on_out_of_memory = MPT_OOM_HALVE_BATCH;
    f.min_batch_size = 32;
    CHECK(mpt_model_fit(m, data, &f) == MPT_ERR_OUT_OF_MEMORY && !m->built,
          "not below min_batch_size 32: %s", mpt_context_error(q));
    f.min_batch_size = 0;
    count_warnings = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(count_warnings == 2 && m->max_batch == 16, "halved twice (%d warnings) to 16 (%lld)",
          count_warnings, (long long)m->max_batch);
    CHECK(m->optimizer_steps == 2 * 13, "2 epochs of 13 steps: %lld",
          (long long)m->optimizer_steps);
    CHECK(history_value(m, "loss", 1) == history_value(ref, "loss", 1) &&
              history_value(m, "accuracy", 0) == history_value(ref, "accuracy", 0),
          "the history of a run at 16: loss %.9g vs %.9g", history_value(m, "loss", 1),
          history_value(ref, "loss", 1));
    CHECK(same_state(m, ref), "weights, optimizer slots and counters equal a run at 16");
    mpt_model_destroy(probe);
    mpt_model_destroy(ref);
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

/* An allocator that refuses every block over refuse_over bytes (0: none). */
static size_t refuse_over;
static long refused;

static void *refusing_alloc(void *user, size_t bytes, size_t alignment) {
    (void)user;
    if (refuse_over && bytes > refuse_over) {
        refused++;
        return NULL;
    }
    return mpt__default_alloc(NULL, bytes, alignment);
}

static void refusing_free(void *user, void *ptr) {
    (void)user;
    mpt__default_free(NULL, ptr);
}

/* The CPU backend's arenas come from the context's allocator: one that
   refuses the activations of a batch of 32 makes fit halve 64 twice. */
static void test_allocator_refusing_large_blocks(void) {
    mpt_context *q;
    mpt_dataset *data;
    mpt_model *probe, *ref, *m;
    mpt_memory_report at16, at32;
    mpt_fit_desc f;
    refuse_over = 0;
    q = test_ctx_with(2, warning_logger, (mpt_allocator){refusing_alloc, refusing_free, NULL});
    data = blobs_in(q);
    probe = make_model(q, 0, NULL);
    CHECK(mpt_model_build(probe, 32) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_memory(probe, &at32);
    mpt_model_destroy(probe);
    probe = make_model(q, 0, NULL);
    CHECK(mpt_model_build(probe, 16) == MPT_OK, "build: %s", mpt_context_error(q));
    mpt_model_memory(probe, &at16);
    mpt_model_destroy(probe);
    ref = make_model(q, 0, NULL);
    f = fit_for(1, 16);
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));

    m = make_model(q, 0, NULL);
    f.batch_size = 64;
    f.on_out_of_memory = MPT_OOM_HALVE_BATCH;
    refuse_over = (size_t)at32.activations - 1; /* more than every other block fit asks for */
    refused = 0;
    count_warnings = 0;
    CHECK(at16.activations <= (int64_t)refuse_over, "the plan for 16 (%lld) fits under %zu",
          (long long)at16.activations, refuse_over);
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    refuse_over = 0;
    CHECK(refused == 2 && count_warnings == 2 && m->max_batch == 16,
          "refused %ld blocks, %d warnings, trained at %lld", refused, count_warnings,
          (long long)m->max_batch);
    CHECK(same_state(m, ref) && history_value(m, "loss", 0) == history_value(ref, "loss", 0),
          "weights, slots, counters and loss equal a run at 16");
    mpt_model_destroy(m);
    mpt_model_destroy(ref);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

/* ---- running out of memory during an epoch ------------------------------------------- */

/* The CPU's table, which fit then feeds as it feeds a GPU (pinned
   staging, uploads on the second queue); its upload_done fails once, at
   call number fail_at (1-based; 0: never). */
static mpt_backend feeding;
static int upload_calls, fail_at;

static mpt_status refusing_upload_done(void *impl) {
    (void)impl;
    return ++upload_calls == fail_at ? MPT_ERR_OUT_OF_MEMORY : MPT_OK;
}

/* on_epoch_end: the samples the backend's record tallied this epoch. */
static double epoch_samples[4];
static mpt_status record_samples(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                 int *stop) {
    (void)user;
    (void)logs;
    (void)stop;
    if (epoch < 4) epoch_samples[epoch] = m->state[0].samples;
    return MPT_OK;
}

static void test_step_halves_mid_epoch(void) {
    mpt_context *q = warning_ctx(2);
    mpt_dataset *data = blobs_in(q);
    mpt_model *ref, *m;
    mpt_fit_desc f;
    mpt_callback cb;
    memset(&cb, 0, sizeof cb);
    cb.on_epoch_end = record_samples;
    feeding = *mpt__cpu_backend();
    feeding.upload_done = refusing_upload_done;

    /* The upload before epoch 2's first step refused: epoch 2 runs at 16,
       as a second fit at 16 would. */
    ref = make_model(q, 0, &feeding);
    m = make_model(q, 0, &feeding);
    fail_at = 0;
    f = fit_for(1, 32);
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    f.initial_epoch = 1;
    f.epochs = 2;
    f.batch_size = 16;
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    upload_calls = 0;
    fail_at = 8; /* epoch 1: 7 uploads of 32 */
    f = fit_for(2, 32);
    f.on_out_of_memory = MPT_OOM_HALVE_BATCH;
    f.callbacks = &cb;
    f.n_callbacks = 1;
    count_warnings = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(upload_calls > 8 && count_warnings == 1 && m->max_batch == 16 && f.batch_size == 32,
          "one halving (%d warnings) to 16 (%lld), the caller's descriptor untouched",
          count_warnings, (long long)m->max_batch);
    CHECK(m->optimizer_steps == 7 + 13, "7 steps at 32, 13 at 16: %lld",
          (long long)m->optimizer_steps);
    CHECK(same_state(m, ref), "weights, optimizer slots and counters equal the two fits'");
    CHECK(history_value(m, "loss", 1) == history_value(ref, "loss", 0),
          "epoch 2's loss %.9g equals the second fit's %.9g", history_value(m, "loss", 1),
          history_value(ref, "loss", 0));
    {   /* the peaks: the plan for 32 (ref's), not the 16 it ends with */
        mpt_memory_report now, peak, at32;
        mpt_model_memory(m, &now);
        mpt_model_memory(ref, &at32);
        CHECK(mpt_model_memory_peak(m, &peak) == MPT_OK, "peak: %s", mpt_context_error(q));
        CHECK(peak.activations == at32.activations && now.activations < at32.activations &&
                  peak.parameters == now.parameters && peak.total == at32.total,
              "activations peak %lld, the plan for 32 %lld, now %lld", (long long)peak.activations,
              (long long)at32.activations, (long long)now.activations);
        CHECK(peak.host >= at32.total && now.host == 0,
              "host peak %lld holds the CPU's arenas (%lld)", (long long)peak.host,
              (long long)at32.total);
    }
    mpt_model_destroy(m);

    /* Refused after 3 steps of epoch 1 (a step first starts the next
       batch's upload: the 5th call is step 4's): the other 104 samples,
       step 4's among them, at 16. */
    m = make_model(q, 0, &feeding);
    upload_calls = 0;
    fail_at = 5;
    memset(epoch_samples, 0, sizeof epoch_samples);
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(m->optimizer_steps == 3 + 7 + 13, "3 steps at 32, 7 + 13 at 16: %lld",
          (long long)m->optimizer_steps);
    CHECK(epoch_samples[0] == N_SYN && epoch_samples[1] == N_SYN,
          "each epoch tallied all %d samples: %g, %g", N_SYN, epoch_samples[0], epoch_samples[1]);
    CHECK(isfinite(history_value(m, "loss", 0)) && history_value(m, "loss", 1) < history_value(m, "loss", 0),
          "training went on: loss %g then %g", history_value(m, "loss", 0),
          history_value(m, "loss", 1));
    mpt_model_destroy(m);
    mpt_model_destroy(ref);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

/* With gradient accumulation (3 batches) the halving rebuilds the model
   in mid-cycle (epoch 1's 7 batches leave one in the sum): the sums and
   their count come through the rebuild, and training ends bit for bit
   where a fit at 32 and then one at 16 end. */
static void accumulate_3(mpt_model *m) {
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.type = MPT_OPTIMIZER_ADAM, .learning_rate = 0.01f,
                            .gradient_accumulation_steps = 3},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(m->ctx));
}

static void test_halving_keeps_accumulated_sums(void) {
    mpt_context *q = warning_ctx(2);
    mpt_dataset *data = blobs_in(q);
    mpt_model *ref, *m;
    mpt_fit_desc f;
    int i, same = 1;
    feeding = *mpt__cpu_backend();
    feeding.upload_done = refusing_upload_done;
    ref = make_model(q, 0, &feeding);
    m = make_model(q, 0, &feeding);
    accumulate_3(ref);
    accumulate_3(m);
    fail_at = 0;
    f = fit_for(1, 32);
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(ref->accumulated_steps == 1, "7 batches leave %lld in the sum",
          (long long)ref->accumulated_steps);
    f.initial_epoch = 1;
    f.epochs = 2;
    f.batch_size = 16;
    CHECK(mpt_model_fit(ref, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    upload_calls = 0;
    fail_at = 8; /* before epoch 2's first step */
    f = fit_for(2, 32);
    f.on_out_of_memory = MPT_OOM_HALVE_BATCH;
    count_warnings = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(count_warnings == 1 && m->max_batch == 16, "one halving (%d warnings) to 16 (%lld)",
          count_warnings, (long long)m->max_batch);
    for (i = 0; i < m->n_params; i++)
        if (m->params[i].trainable)
            same &= !memcmp(m->params[i].accum, ref->params[i].accum,
                            sizeof(float) * (size_t)m->params[i].count);
    CHECK(same_state(m, ref) && same && m->accumulated_steps == ref->accumulated_steps &&
              m->optimizer_steps == (7 + 13) / 3,
          "weights, slots, sums or counters differ from the two fits' (%lld updates, %lld in "
          "the sum; %lld, %lld)", (long long)m->optimizer_steps, (long long)m->accumulated_steps,
          (long long)ref->optimizer_steps, (long long)ref->accumulated_steps);
    mpt_model_destroy(m);
    mpt_model_destroy(ref);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

static char printed[8192];
static void capture(void *user, const char *text) {
    (void)user;
    strncat(printed, text, sizeof printed - strlen(printed) - 1);
}

static void test_peak_in_summary(void) {
    mpt_context *q = warning_ctx(2);
    mpt_dataset *data = blobs_in(q);
    mpt_model *m = make_model(q, 0, NULL);
    mpt_memory_report peak;
    mpt_fit_desc f;
    const char *line;
    CHECK(mpt_model_memory_peak(m, &peak) == MPT_ERR_STATE, "no peaks before a fit");
    f = fit_for(1, 50);
    f.verbose = 2;
    f.printer.fn = capture;
    printed[0] = 0;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(q));
    CHECK(mpt_model_memory_peak(m, &peak) == MPT_OK && peak.host > peak.total,
          "host %lld over the arenas' %lld", (long long)peak.host, (long long)peak.total);
    line = strstr(printed, "\nMemory peak: parameters ");
    CHECK(line && strstr(line, " - gradients ") && strstr(line, " - optimizer state ") &&
              strstr(line, " - activations ") && strstr(line, " - host "),
          "the summary's last line:\n%s", printed);
    mpt_model_destroy(m);
    mpt_dataset_destroy(data);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_build_halves_to_what_fits);
    TEST_RUN(test_allocator_refusing_large_blocks);
    TEST_RUN(test_step_halves_mid_epoch);
    TEST_RUN(test_peak_in_summary);
    TEST_RUN(test_halving_keeps_accumulated_sums);
}

int main(void) {
    static const test_program p = {.name = "test_oom_recovery", .ctx = &ctx, .threads = 2,
                                   .setup = make_blobs, .cases = run_cases};
    return test_main(&p);
}

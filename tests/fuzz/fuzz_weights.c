/* libFuzzer harness: mpt_model_load_weights. The input is written to this
   process's directory as a file and loaded into a small trained model
   (fuzz_model). A load that fails must leave the whole model as it was
   (every master value, the optimizer state, loss scale and counters) and
   say why. One that succeeds goes on as a user would: one short epoch of
   fit from what was loaded (in the model's own policy, quantization-aware
   for fuzz_qat_model), which fails with a known status and a reason or
   leaves finite state; then the model is saved (FUZZ_SAVE, and its whole
   checkpoint) and each file must load back. Finally the model's own
   checkpoint is loaded back, so that every input starts from the same
   state. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

#ifndef FUZZ_LOAD
#define FUZZ_LOAD mpt_model_load_weights
#endif
#ifndef FUZZ_SAVE
#define FUZZ_SAVE mpt_model_save_weights /* FUZZ_LOAD's writer */
#endif
#ifndef FUZZ_MODEL
#define FUZZ_MODEL fuzz_model /* or fuzz_qat_model */
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static mpt_context *ctx;
static mpt_model *model;
static fuzz_state before; /* the model's state before every input */
static char pristine[512]; /* ... as its checkpoint */
static mpt_dataset *train; /* what a loaded model trains on */

static void setup(void) {
    ctx = fuzz_context();
    model = FUZZ_MODEL(ctx, 0);
    train = fuzz_train_data(ctx);
    fuzz_state_take(ctx, model, &before);
    fuzz_write(fuzz_path(pristine, "pristine.safetensors"), before.checkpoint,
               before.checkpoint_size);
}

/* Aborts, naming what changed, when the model's state is not `before`. */
static void expect_unchanged(const char *after_what) {
    fuzz_state now;
    const char *diff;
    fuzz_state_take(ctx, model, &now);
    diff = fuzz_state_diff(&before, &now);
    if (diff) {
        fprintf(stderr, "fuzz: %s changed %s (error: %s)\n", after_what, diff,
                mpt_context_error(ctx));
        abort();
    }
    fuzz_state_free(&now);
}

/* After a successful load: one short epoch, then save and load again. */
static void train_save_load(void) {
    mpt_fit_desc fit;
    fuzz_state now;
    const char *bad;
    char trained[512];
    mpt_status s;
    memset(&fit, 0, sizeof fit);
    fit.epochs = 1;
    fit.batch_size = 2;
    ctx->error[0] = 0;
    s = mpt_model_fit(model, train, &fit);
    if (s != MPT_OK) {
        if (s < MPT_ERR_NUMERIC || s > MPT_OK) fuzz_die("fit after a load gave an unknown status");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed fit after a load gave no reason");
        return;
    }
    fuzz_state_take(ctx, model, &now); /* saves the whole checkpoint: must work */
    bad = fuzz_state_nonfinite(&now);
    if (bad) {
        fprintf(stderr, "fuzz: fit after a load returned OK with a non-finite %s\n", bad);
        abort();
    }
    if (mpt_model_load_checkpoint(model, fuzz_path(trained, "state.safetensors")) != MPT_OK) {
        fprintf(stderr, "fuzz: the checkpoint saved after fit does not load back: %s\n",
                mpt_context_error(ctx));
        abort();
    }
    fuzz_state_free(&now);
    if (FUZZ_SAVE(model, fuzz_path(trained, "trained.safetensors")) != MPT_OK)
        fuzz_die(mpt_context_error(ctx));
    if (FUZZ_LOAD(model, trained) != MPT_OK) {
        fprintf(stderr, "fuzz: the file saved after fit does not load back: %s\n",
                mpt_context_error(ctx));
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char input[512];
    if (!ctx) setup();
    fuzz_write(fuzz_path(input, "input.safetensors"), data, size);
    ctx->error[0] = 0;
    if (FUZZ_LOAD(model, input) != MPT_OK) {
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed load gave no reason");
        expect_unchanged("a failed load");
        return 0;
    }
    train_save_load();
    if (mpt_model_load_checkpoint(model, pristine) != MPT_OK)
        fuzz_die("the model's own checkpoint does not load back");
    expect_unchanged("a successful load and fit undone by the model's own checkpoint");
    return 0;
}

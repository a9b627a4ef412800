/* libFuzzer harness: mpt_model_load_weights. The input is written to this
   process's directory as a file and loaded into a small trained model
   (fuzz_model). A load that fails must leave the whole model as it was
   (every master value, the optimizer state, loss scale and counters) and
   say why; one that succeeds is undone by loading the model's own
   checkpoint back, so that every input starts from the same state. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

#ifndef FUZZ_LOAD
#define FUZZ_LOAD mpt_model_load_weights
#endif
#ifndef FUZZ_MODEL
#define FUZZ_MODEL fuzz_model /* or fuzz_qat_model */
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static mpt_context *ctx;
static mpt_model *model;
static fuzz_state before; /* the model's state before every input */
static char pristine[512]; /* ... as its checkpoint */

static void setup(void) {
    ctx = fuzz_context();
    model = FUZZ_MODEL(ctx, 0);
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
    if (mpt_model_load_checkpoint(model, pristine) != MPT_OK)
        fuzz_die("the model's own checkpoint does not load back");
    expect_unchanged("a successful load undone by the model's own checkpoint");
    return 0;
}

/* libFuzzer harness: the architecture JSON of a whole-model file, read as
   mpt_model_load reads it (mpt__json_parse, then mpt__model_from_json:
   every layer added through its own add function, compiled, built). A
   read that fails must say why and leave no model; one that succeeds
   gives a model that saves (mpt_model_save) and loads back
   (mpt_model_load). Allocations above 64 MiB are refused by the
   context's allocator, as a small machine would: the library must then
   fail cleanly (the fuzzer's own memory limit would otherwise call a
   large model a crash). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void *capped_alloc(void *user, size_t bytes, size_t alignment) {
    void *p = NULL;
    (void)user;
    if (bytes > ((size_t)64 << 20)) return NULL;
    if (alignment < sizeof(void *)) alignment = sizeof(void *);
    return posix_memalign(&p, alignment, bytes ? bytes : 1) == 0 ? p : NULL;
}

static void capped_free(void *user, void *p) {
    (void)user;
    free(p);
}

static mpt_context *capped_context(void) {
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    memset(&d, 0, sizeof d);
    d.num_threads = 1;
    d.logger.fn = fuzz__drop_log;
    d.allocator.alloc = capped_alloc;
    d.allocator.free = capped_free;
    if (mpt_context_create(&d, &ctx) != MPT_OK) fuzz_die("cannot create a context");
    return ctx;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static mpt_context *ctx;
    char path[512];
    mpt__json j;
    mpt_model *m = NULL, *back = (mpt_model *)&m;
    mpt_status s;
    if (!ctx) ctx = capped_context();
    ctx->error[0] = 0;
    s = mpt__json_parse(&j, ctx, "fuzz", (const char *)data, (int64_t)size);
    if (s == MPT_OK) s = mpt__model_from_json(&j, ctx, &m);
    mpt__json_free(&j);
    if (s != MPT_OK) {
        if (m) fuzz_die("a failed read left a model");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed read gave no reason");
        return 0;
    }
    fuzz_path(path, "input.safetensors");
    s = mpt_model_save(m, path);
    if (s == MPT_OK) {
        s = mpt_model_load(ctx, path, &back);
        if (s != MPT_OK && s != MPT_ERR_OUT_OF_MEMORY) {
            fprintf(stderr, "fuzz: a saved model does not load back: %s\n", mpt_context_error(ctx));
            abort();
        }
        if (s != MPT_OK && back) fuzz_die("a failed load left *out set");
        mpt_model_destroy(s == MPT_OK ? back : NULL);
    } else if (s != MPT_ERR_OUT_OF_MEMORY && s != MPT_ERR_NUMERIC) {
        fprintf(stderr, "fuzz: a model read from JSON does not save: %s\n",
                mpt_context_error(ctx));
        abort();
    }
    mpt_model_destroy(m);
    return 0;
}

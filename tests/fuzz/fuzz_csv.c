/* libFuzzer harness: mpt_dataset_load_csv. The input is the file; its
   label column is "y", class ids for an input of even size and float
   targets for an odd one. A load must either fail, leaving *out NULL and
   saying why (at file:line:column where a field is wrong), or give a
   dataset of (n, columns - 1) float32 samples whose first and last can be
   gathered. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static mpt_context *ctx;
    char path[512];
    mpt_dataset *d = (mpt_dataset *)&d; /* the load must set it */
    mpt_dataset_csv_desc desc;
    int64_t which[2], shape[4] = {0};
    float *xs, ys[2];
    if (!ctx) ctx = fuzz_context();
    fuzz_write(fuzz_path(path, "csv"), data, size);
    memset(&desc, 0, sizeof desc);
    desc.label_column = "y";
    desc.float_targets = size % 2;
    ctx->error[0] = 0;
    if (mpt_dataset_load_csv(ctx, path, &desc, &d) != MPT_OK) {
        if (d) fuzz_die("a failed load_csv left *out set");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed load_csv gave no reason");
        return 0;
    }
    if (!d || mpt_dataset_count(d) < 1 || mpt_dataset_sample_shape(d, shape) != 1 ||
        shape[0] < 1 || d->x_dtype != MPT_FLOAT32 || d->y_count != 1)
        fuzz_die("load_csv gave a dataset without samples, or of a wrong shape");
    which[0] = 0;
    which[1] = mpt_dataset_count(d) - 1;
    xs = (float *)malloc((size_t)(2 * shape[0]) * sizeof(float)); /* (2, columns - 1) */
    if (!xs) fuzz_die("out of memory");
    mpt__dataset_gather(ctx, d, which, 2, MPT_FLOAT32, xs, ys);
    free(xs);
    mpt_dataset_destroy(d);
    return 0;
}

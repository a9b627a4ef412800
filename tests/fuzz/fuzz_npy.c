/* libFuzzer harness: mpt_dataset_load_npy on .npy files and .npz archives.
   One input holds two files as the IDX harnesses' do (fuzz_idx_split: a
   4-byte big-endian length, x's file, y's file); an empty y part loads
   both arrays from x's file, as an archive (keys "x" and "y"). A load must
   either fail, leaving *out NULL and saying why, or give a dataset whose
   first and last samples can be gathered. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static mpt_context *ctx;
    char x_path[512], y_path[512];
    const uint8_t *x, *y;
    size_t x_size, y_size;
    mpt_dataset *d = (mpt_dataset *)&d; /* the load must set it */
    int64_t which[2];
    float *xs;
    int32_t *ys;
    if (!ctx) ctx = fuzz_context();
    fuzz_idx_split(data, size, &x, &x_size, &y, &y_size);
    fuzz_write(fuzz_path(x_path, "npy_x"), x, x_size);
    if (y_size) fuzz_write(fuzz_path(y_path, "npy_y"), y, y_size);
    ctx->error[0] = 0;
    if (mpt_dataset_load_npy(ctx, x_path, y_size ? y_path : NULL, NULL, &d) != MPT_OK) {
        if (d) fuzz_die("a failed load_npy left *out set");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed load_npy gave no reason");
        return 0;
    }
    if (!d || mpt_dataset_count(d) < 1 || d->x_count < 1 || d->y_count < 1)
        fuzz_die("load_npy gave a dataset without samples");
    which[0] = 0;
    which[1] = mpt_dataset_count(d) - 1;
    xs = (float *)malloc((size_t)(2 * d->x_count) * sizeof(float));   /* (2, sample) */
    ys = (int32_t *)malloc((size_t)(2 * d->y_count) * sizeof(int32_t)); /* (2, target) */
    if (!xs || !ys) fuzz_die("out of memory");
    mpt__dataset_gather(ctx, d, which, 2, MPT_FLOAT32, xs, ys);
    free(xs);
    free(ys);
    mpt_dataset_destroy(d);
    return 0;
}

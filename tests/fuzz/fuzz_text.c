/* libFuzzer harness: mpt_dataset_load_text. The input is the file; its
   size picks the window, sequence_length 1 + size % 13 (0 when size % 97
   is 0, which must be refused), and whether the file keeps a validation
   tail (no_validation for an odd size). A load must either fail, leaving
   both parts NULL and saying why, or give parts whose counts follow from
   the file's size, whose first and last windows and targets are the
   file's bytes where they should be, and which split into views alike. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Sample `which` of d (windows `stride` apart from byte `at` of the file)
   is the file's bytes, x and its targets, and so are its labels. */
static void fuzz_text_window(mpt_context *ctx, const mpt_dataset *d, int64_t which, int64_t at,
                             int64_t stride, int64_t T, const uint8_t *data) {
    int32_t x[16], y[16], labels[16]; /* T <= 13 */
    int64_t t;
    mpt__dataset_gather(ctx, d, &which, 1, MPT_INT32, x, y);
    if (mpt_dataset_labels(ctx, d, which, 1, labels) != MPT_OK) fuzz_die("labels refused");
    for (t = 0; t < T; t++) {
        const uint8_t *w = data + at + which * stride + t;
        if (x[t] != w[0] || y[t] != w[1] || labels[t] != w[1])
            fuzz_die("a window is not the file's bytes");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static mpt_context *ctx;
    char path[512];
    mpt_dataset *train = (mpt_dataset *)&train, *val = (mpt_dataset *)&val; /* the load sets them */
    mpt_dataset *head = NULL, *tail = NULL;
    mpt_dataset_text_desc desc;
    int64_t T, cut, n;
    if (!ctx) ctx = fuzz_context();
    fuzz_write(fuzz_path(path, "text"), data, size);
    memset(&desc, 0, sizeof desc);
    desc.sequence_length = size % 97 == 0 ? 0 : 1 + (int64_t)(size % 13);
    desc.no_validation = (int)(size % 2);
    T = desc.sequence_length;
    ctx->error[0] = 0;
    if (mpt_dataset_load_text(ctx, path, &desc, &train, &val) != MPT_OK) {
        if (train || val) fuzz_die("a failed load_text left a part set");
        if (!mpt_context_error(ctx)[0]) fuzz_die("a failed load_text gave no reason");
        return 0;
    }
    cut = desc.no_validation ? (int64_t)size : mpt__validation_split_at((int64_t)size, 0.1f);
    if (!train || mpt_dataset_count(train) != cut - T || (desc.no_validation ? val != NULL
        : !val || mpt_dataset_count(val) != ((int64_t)size - cut - 1) / T))
        fuzz_die("load_text gave parts of the wrong size");
    n = mpt_dataset_count(train);
    fuzz_text_window(ctx, train, 0, 0, 1, T, data);
    fuzz_text_window(ctx, train, n - 1, 0, 1, T, data);
    if (val) {
        fuzz_text_window(ctx, val, 0, cut, T, T, data);
        fuzz_text_window(ctx, val, mpt_dataset_count(val) - 1, cut, T, T, data);
    }
    if (n > 1) {
        if (mpt_dataset_split(ctx, train, n / 2, &head, &tail) != MPT_OK)
            fuzz_die("a split of the training part refused");
        fuzz_text_window(ctx, tail, mpt_dataset_count(tail) - 1, n / 2, 1, T, data);
    }
    mpt_dataset_destroy(train); /* before its views: they keep the bytes */
    if (head) fuzz_text_window(ctx, head, 0, 0, 1, T, data);
    if (val) fuzz_text_window(ctx, val, 0, cut, T, T, data);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(val);
    return 0;
}

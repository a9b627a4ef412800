/* libFuzzer harness: mpt_dataset_load_idx on plain IDX files. One input
   holds the images and the labels file (fuzz_idx_split); both are written
   to this process's directory as they are and loaded. A load must either
   fail, leaving *out NULL and saying why, or give a dataset whose count and
   shape its files describe and whose every sample can be read. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static mpt_context *ctx;
    char images[512], labels[512];
    const uint8_t *img, *lab;
    size_t img_size, lab_size;
    if (!ctx) ctx = fuzz_context();
    fuzz_idx_split(data, size, &img, &img_size, &lab, &lab_size);
    fuzz_write(fuzz_path(images, "images"), img, img_size);
    fuzz_write(fuzz_path(labels, "labels"), lab, lab_size);
    fuzz_idx_load(ctx, images, labels);
    return 0;
}

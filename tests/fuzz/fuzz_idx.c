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
    fuzz_idx_run(data, size, fuzz_write);
    return 0;
}

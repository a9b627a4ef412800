/* libFuzzer harness: mpt_dataset_load_idx on gzip-compressed IDX files. One
   input holds the images and the labels file (fuzz_idx_split). A part that
   is a gzip file already (1f 8b) is written as it is, which fuzzes the
   reader's handling of damaged, cut or trailing gzip data; any other part
   is compressed here first, so that mutations of the IDX bytes themselves
   also reach the loader through zlib. The checks are the plain harness's. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void write_gzip(const char *path, const void *bytes, size_t size) {
    const uint8_t *data = (const uint8_t *)bytes;
    gzFile gz;
    if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) {
        fuzz_write(path, data, size);
        return;
    }
    gz = gzopen(path, "wb1");
    if (!gz || (size && gzwrite(gz, data, (unsigned)size) != (int)size) || gzclose(gz) != Z_OK)
        fuzz_die("cannot write a gzip file");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_idx_run(data, size, write_gzip);
    return 0;
}

/* The loaders' harnesses that share no state (IDX, plain and gzip; a
   model file's architecture JSON; NumPy's .npy/.npz; CSV; text) in one
   binary, so that mpt.h is compiled once for them all under the fuzzer
   and its sanitizers (about three minutes a compile on the 2-core
   machine) instead of once each. build.sh links the binary under each harness's
   name (fuzz_idx, fuzz_csv, ...), and the name it runs by picks the
   harness: `fuzz_csv corpus/` runs as tests/fuzz/fuzz_csv.c built alone
   would. Each harness stays its own file; here each one's entry point is
   renamed as it is included. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, as each harness defines it */
#define LLVMFuzzerTestOneInput fuzz_idx_input
#include "fuzz_idx.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_idx_gzip_input
#include "fuzz_idx_gzip.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_model_input
#include "fuzz_model.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_npy_input
#include "fuzz_npy.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_csv_input
#include "fuzz_csv.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_text_input
#include "fuzz_text.c"
#undef LLVMFuzzerTestOneInput

typedef int (*fuzz_input_fn)(const uint8_t *data, size_t size);

static fuzz_input_fn fuzz_chosen;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The harness the binary's name (its last path component) names. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    static const struct {
        const char *name;
        fuzz_input_fn input;
    } harnesses[] = {{"fuzz_idx", fuzz_idx_input},
                     {"fuzz_idx_gzip", fuzz_idx_gzip_input},
                     {"fuzz_model", fuzz_model_input},
                     {"fuzz_npy", fuzz_npy_input},
                     {"fuzz_csv", fuzz_csv_input},
                     {"fuzz_text", fuzz_text_input}};
    const char *name = *argc > 0 ? strrchr((*argv)[0], '/') : NULL;
    size_t k;
    name = name ? name + 1 : *argc > 0 ? (*argv)[0] : "";
    for (k = 0; k < sizeof harnesses / sizeof harnesses[0]; k++)
        if (strcmp(name, harnesses[k].name) == 0) fuzz_chosen = harnesses[k].input;
    if (!fuzz_chosen)
        fuzz_die("run this binary by a harness's name (a link named fuzz_idx, fuzz_idx_gzip, "
                 "fuzz_model, fuzz_npy, fuzz_csv or fuzz_text)");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_chosen(data, size); }

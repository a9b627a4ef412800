/* Every harness in one binary, so that mpt.h is compiled once under the
   fuzzer and its sanitizers (200 to 260 s of a core for each
   compile on the 2-core machine) instead of once per harness. build.sh
   links the binary under each harness's name (fuzz_idx, fuzz_csv,
   fuzz_weights, ...), and the name it runs by picks the harness:
   `fuzz_csv corpus/` runs as tests/fuzz/fuzz_csv.c built alone would.
   Each harness stays its own file; here each one's entry point is renamed
   as it is included, and each keeps its state to itself (the model-file
   harnesses in their fuzz_model_file, set up by their first input), so
   that only the harness that runs sets anything up. */
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
#define LLVMFuzzerTestOneInput fuzz_weights_input
#include "fuzz_weights.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_checkpoint_input
#include "fuzz_checkpoint.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_qat_input
#include "fuzz_qat.c"
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
                     {"fuzz_text", fuzz_text_input},
                     {"fuzz_weights", fuzz_weights_input},
                     {"fuzz_checkpoint", fuzz_checkpoint_input},
                     {"fuzz_qat", fuzz_qat_input}};
    const char *name = *argc > 0 ? strrchr((*argv)[0], '/') : NULL;
    size_t k;
    name = name ? name + 1 : *argc > 0 ? (*argv)[0] : "";
    for (k = 0; k < sizeof harnesses / sizeof harnesses[0]; k++)
        if (strcmp(name, harnesses[k].name) == 0) fuzz_chosen = harnesses[k].input;
    if (!fuzz_chosen)
        fuzz_die("run this binary by a harness's name (a link named fuzz_idx, fuzz_idx_gzip, "
                 "fuzz_model, fuzz_npy, fuzz_csv, fuzz_text, fuzz_weights, fuzz_checkpoint "
                 "or fuzz_qat)");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_chosen(data, size); }

/* libFuzzer harness: mpt_model_load_weights into a small trained model
   (fuzz_model), with the checks of fuzz.h's model-file harnesses: a
   failed load leaves the model's whole state as it was and says why; a
   successful one trains an epoch from what it loaded, whose files must
   save and load back. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fuzz_model_file weights = {.load = mpt_model_load_weights,
                                      .save = mpt_model_save_weights,
                                      .make_model = fuzz_model};
    return fuzz_model_file_input(&weights, data, size);
}

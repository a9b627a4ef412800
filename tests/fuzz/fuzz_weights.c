/* libFuzzer harness: mpt_model_load_weights into a small trained model
   (fuzz_model), with the checks of fuzz.h's model-file harnesses: a
   failed load leaves the model's whole state as it was and says why; a
   successful one trains an epoch from what it loaded, whose files must
   save and load back. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

FUZZ_MODEL_FILE_HARNESS(mpt_model_load_weights, mpt_model_save_weights, fuzz_model)

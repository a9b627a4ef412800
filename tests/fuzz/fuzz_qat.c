/* libFuzzer harness: mpt_model_load_checkpoint into a quantization-aware
   model (fuzz_qat_model), with the checks of fuzz.h's model-file
   harnesses: a failed load leaves the whole state as it was, the learned
   ranges included (they are in the checkpoint fuzz_state compares); a
   successful one trains an epoch, quantization-aware, from what it
   loaded, whose checkpoint must save and load back. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../../mpt.h"
#include "fuzz.h"

FUZZ_MODEL_FILE_HARNESS(mpt_model_load_checkpoint, mpt_model_save_checkpoint, fuzz_qat_model)

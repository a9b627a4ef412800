/* libFuzzer harness: mpt_model_load_checkpoint into a quantization-aware
   model (fuzz_qat_model), with the checks of fuzz_weights.c: a failed load
   leaves the whole state as it was, the learned ranges included (they are
   in the checkpoint fuzz_state compares); a successful one trains an
   epoch, quantization-aware, from what it loaded, whose checkpoint must
   save and load back. */
#define FUZZ_LOAD mpt_model_load_checkpoint
#define FUZZ_SAVE mpt_model_save_checkpoint
#define FUZZ_MODEL fuzz_qat_model
#include "fuzz_weights.c"

/* libFuzzer harness: mpt_model_load_checkpoint, with the checks of
   fuzz_weights.c (a failed load leaves the model's whole state as it was:
   master values, optimizer moments, step counters, loss scale; a
   successful one trains an epoch from what it loaded, whose checkpoint
   must save and load back). */
#define FUZZ_LOAD mpt_model_load_checkpoint
#define FUZZ_SAVE mpt_model_save_checkpoint
#include "fuzz_weights.c"

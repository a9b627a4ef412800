/* libFuzzer harness: mpt_model_load_checkpoint, with the checks of
   fuzz_weights.c (a failed load leaves the model's whole state as it was:
   master values, optimizer moments, step counters, loss scale). */
#define FUZZ_LOAD mpt_model_load_checkpoint
#include "fuzz_weights.c"

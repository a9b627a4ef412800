/* The CPU's scaled dot-product attention at the GPT's shapes (examples/
   gpt.c: batch 32, 4 heads of 64, 128 positions, causal), fused (P
   computed again in backward) against P kept from forward
   (no_flash_attention), in turns: each round times one forward and one
   backward of each, by the process's CPU time, and the JSON line gives
   each one's fastest round and the ratios.

       gcc -std=c99 -O2 -I. bench/bench_attention.c -o build/bench_attention -lpthread -lm -lz
       ./build/bench_attention [--dtype float32|bfloat16] [--rounds 20] [--threads 1]

   CPU time, not wall time: on a shared host a run's waits for a core are
   not its work. With --threads above 1 the CPU time is the threads' sum. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"

#include <time.h>

enum { BATCH = 32, HEADS = 4, CONTEXT = 128, KEY_DIM = 64 };

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* n random values in [-1, 1] as dtype. */
static void *random_operand(mpt_context *ctx, mpt_dtype dtype, int64_t n, uint32_t *seed) {
    float *f = (float *)malloc(sizeof(float) * (size_t)n);
    void *out = malloc((size_t)n * mpt_dtype_size(dtype));
    int64_t i;
    for (i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        f[i] = (float)(*seed >> 8) / 8388608.0f - 1.0f;
    }
    mpt_convert(ctx, dtype, out, MPT_FLOAT32, f, n);
    free(f);
    return out;
}

int main(int argc, char **argv) {
    const char *dtype_name = "float32";
    int rounds = 20, threads = 1, r, keep, i;
    const int64_t rows = (int64_t)BATCH * CONTEXT * HEADS * KEY_DIM;
    double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}}; /* [keep][forward, backward] */
    mpt_dtype dtype;
    mpt_context *ctx = NULL;
    mpt_attention_args a;
    mpt_step_state state;
    const mpt_backend *be;
    void *impl, *workspace;
    float *probs;
    uint32_t seed = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dtype")) dtype_name = argv[i + 1];
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else break;
    }
    dtype = !strcmp(dtype_name, "bfloat16") ? MPT_BFLOAT16 : MPT_FLOAT32;
    if (i != argc || rounds < 1 || threads < 1 ||
        (strcmp(dtype_name, "float32") && strcmp(dtype_name, "bfloat16"))) {
        fprintf(stderr, "usage: %s [--dtype float32|bfloat16] [--rounds N] [--threads N]\n",
                argv[0]);
        return 2;
    }
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = threads }, &ctx) != MPT_OK)
        return 1;
    be = mpt_context_backend(ctx, &impl);
    memset(&a, 0, sizeof a);
    memset(&state, 0, sizeof state);
    a.dtype = dtype, a.batch = BATCH, a.heads = HEADS, a.q_len = a.kv_len = CONTEXT;
    a.key_dim = a.value_dim = KEY_DIM, a.scale = 0.125f, a.causal = 1, a.state = &state;
    a.q = random_operand(ctx, dtype, rows, &seed);
    a.k = random_operand(ctx, dtype, rows, &seed);
    a.v = random_operand(ctx, dtype, rows, &seed);
    a.d_o = random_operand(ctx, dtype, rows, &seed);
    a.o = malloc((size_t)rows * mpt_dtype_size(dtype));
    a.dq = (float *)malloc(sizeof(float) * (size_t)rows);
    a.dk = (float *)malloc(sizeof(float) * (size_t)rows);
    a.dv = (float *)malloc(sizeof(float) * (size_t)rows);
    probs = (float *)calloc((size_t)BATCH * HEADS * CONTEXT * CONTEXT, sizeof(float)); /* 8 MiB */
    workspace = malloc((size_t)be->attention_workspace(impl, &a) + 64);
    a.workspace = (void *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    for (r = 0; r <= rounds; r++) /* round 0 warms the caches and is not counted */
        for (keep = 0; keep < 2; keep++) {
            int which = r % 2 ? 1 - keep : keep; /* the order turned every other round */
            double t0, t1, t2;
            a.probs = which ? probs : NULL;
            t0 = cpu_seconds();
            be->attention_forward(impl, &a);
            t1 = cpu_seconds();
            be->attention_backward(impl, &a);
            t2 = cpu_seconds();
            if (r == 0) continue;
            best[which][0] = t1 - t0 < best[which][0] ? t1 - t0 : best[which][0];
            best[which][1] = t2 - t1 < best[which][1] ? t2 - t1 : best[which][1];
        }
    printf("{\"bench\":\"attention\",\"dtype\":\"%s\",\"batch\":%d,\"heads\":%d,\"context\":%d,"
           "\"key_dim\":%d,\"threads\":%d,\"rounds\":%d,"
           "\"fused_forward_ms\":%.2f,\"fused_backward_ms\":%.2f,"
           "\"kept_forward_ms\":%.2f,\"kept_backward_ms\":%.2f,"
           "\"backward_fused_over_kept\":%.3f,\"step_fused_over_kept\":%.3f}\n",
           dtype_name, BATCH, HEADS, CONTEXT, KEY_DIM, threads, rounds, 1e3 * best[0][0],
           1e3 * best[0][1], 1e3 * best[1][0], 1e3 * best[1][1], best[0][1] / best[1][1],
           (best[0][0] + best[0][1]) / (best[1][0] + best[1][1]));
    free((void *)a.q), free((void *)a.k), free((void *)a.v), free((void *)a.d_o), free(a.o);
    free(a.dq), free(a.dk), free(a.dv), free(probs), free(workspace);
    mpt_context_destroy(ctx);
    return 0;
}

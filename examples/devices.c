/* What this machine offers mpt.h: every device (the CPU is device 0; with
   the CUDA backend, each GPU after it), then the memory a small model plans
   per category. Reads no files.

   Build: cc -O2 devices.c -lpthread -lm -o devices          (in examples/)
   With the GPUs (the C file by a C compiler, as its compound literals
   are C99; mpt_cuda.cu by nvcc):
          cc -O2 -DMPT_CUDA -c devices.c -o devices.o
          nvcc -O2 -arch=sm_90 -DMPT_CUDA -I.. -c ../mpt_cuda.cu -o mpt_cuda.o
          nvcc devices.o mpt_cuda.o -lcublasLt -lcublas -lpthread -lm -o devices
   Run:   ./devices

   Prints each device in words, then one JSON line per device. */
#define MPT_NO_ZLIB
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include <stdio.h>

static double gib(int64_t bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

/* CUDA's versions are 1000 × major + 10 × minor: 12040 is "12.4". */
static const char *cuda_version(int v, char *text, size_t size) {
    snprintf(text, size, "%d.%d", v / 1000, v % 1000 / 10);
    return text;
}

static void print_device(int index, const mpt_device_info *d) {
    char driver[16], runtime[16];
    printf("Device %d: %s (%s)\n", index, d->name, d->kind == MPT_DEVICE_CPU ? "CPU" : "CUDA");
    printf("  memory:             %.1f GiB total, %.1f GiB free\n", gib(d->memory_total),
           gib(d->memory_free));
    if (d->kind == MPT_DEVICE_CPU) {
        printf("  cores online:       %d\n", d->cores);
        printf("  SIMD mpt.h can use: %s\n", d->features[0] ? d->features : "(portable C only)");
        return;
    }
    printf("  CUDA device:        %d\n", d->ordinal);
    printf("  compute capability %d.%d, %d SMs\n", d->compute_major, d->compute_minor,
           d->sm_count);
    printf("  driver %s, runtime %s\n", cuda_version(d->driver_version, driver, sizeof driver),
           cuda_version(d->runtime_version, runtime, sizeof runtime));
}

static void print_json(int index, const mpt_device_info *d) {
    printf("{\"device\": %d, \"kind\": \"%s\", \"name\": \"", index,
           d->kind == MPT_DEVICE_CPU ? "cpu" : "cuda");
    for (const char *c = d->name; *c; c++) /* JSON string: escape quotes */
        printf(*c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
    printf("\", \"memory_total\": %lld, \"memory_free\": %lld", (long long)d->memory_total,
           (long long)d->memory_free);
    if (d->kind == MPT_DEVICE_CPU)
        printf(", \"cores\": %d, \"features\": \"%s\"}\n", d->cores, d->features);
    else
        printf(", \"ordinal\": %d, \"compute_capability\": \"%d.%d\", \"sm_count\": %d, "
               "\"driver_version\": %d, \"runtime_version\": %d}\n",
               d->ordinal, d->compute_major, d->compute_minor, d->sm_count, d->driver_version,
               d->runtime_version);
}

/* The memory a Dense model for 28×28 images plans on the context's
   device, per category, for batches of 128. */
static int print_model_memory(mpt_context *ctx) {
    mpt_model *m = NULL;
    mpt_memory_report r;
    mpt_status s = mpt_model_create(
        ctx,
        &(mpt_model_desc){.input_shape = {784}, .input_rank = 1,
                          .policy = MPT_POLICY_MIXED_FLOAT16},
        &m);
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 1024,
                                                                  .activation = MPT_ACT_RELU});
    if (s == MPT_OK) s = mpt_model_add_dense(m, &(mpt_dense_desc){.units = 10,
                                                                  .activation = MPT_ACT_SOFTMAX});
    if (s == MPT_OK)
        s = mpt_model_compile(m, &(mpt_compile_desc){
                                     .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    if (s == MPT_OK) s = mpt_model_build(m, 128);
    if (s == MPT_OK) s = mpt_model_memory(m, &r);
    if (s == MPT_OK) {
        printf("Memory of a 784-1024-10 Dense model (mixed_float16, Adam, batches of 128):\n");
        printf("  parameters %lld, gradients %lld, optimizer %lld, weight copies %lld,\n"
               "  activations %lld, workspace %lld: %lld bytes in all\n",
               (long long)r.parameters, (long long)r.gradients, (long long)r.optimizer,
               (long long)r.weight_copies, (long long)r.activations, (long long)r.workspace,
               (long long)r.total);
    } else {
        fprintf(stderr, "devices: %s\n", mpt_context_error(ctx));
    }
    mpt_model_destroy(m);
    return s == MPT_OK;
}

int main(void) {
    mpt_context *ctx;
    mpt_device_info info[16];
    int i, n, ok = 1;
    if (mpt_context_create(NULL, &ctx) != MPT_OK) return 1;
    n = mpt_device_count(ctx);
    if (n > 16) n = 16;
    for (i = 0; i < n; i++) {
        if (mpt_device_query(ctx, i, &info[i]) != MPT_OK) {
            fprintf(stderr, "devices: %s\n", mpt_context_error(ctx));
            info[i].name[0] = 0;
            ok = 0;
            continue;
        }
        print_device(i, &info[i]);
    }
    for (i = 0; i < n; i++)
        if (info[i].name[0]) print_json(i, &info[i]);
    ok = print_model_memory(ctx) && ok;
    mpt_context_destroy(ctx);
    return ok ? 0 : 1;
}

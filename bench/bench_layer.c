/* One layer's forward and backward time, alone in a model (batch 128):
   the fastest of N training forwards, of N backwards with the input
   gradient and of N without it (a layer with weights: its weight
   gradients alone), which on a shared host is the least disturbed.

       gcc -std=c99 -O2 -I. bench/bench_layer.c -o build/bench_layer -lpthread -lm -lz
       ./build/bench_layer --layer bn|bn_dense|dropout|maxpool|conv
                           [--conv H,C,F,K,S] [--policy float32|mixed_bfloat16]
                           [--repeat 40] [--threads 2]

   bn: BatchNormalization over 24 × 24 × 32 (the CNN's first); bn_dense:
   BatchNormalization over 1 × 1 × 512 (the rows and channels of the CNN's
   after Dense(512)); dropout: Dropout(0.25) over 12 × 12 × 64; maxpool:
   MaxPooling2D(2) over 26 × 26 × 32 (the small CNN's); conv: Conv2D of F
   filters, K × K, strides S, 'same' padding, no bias (ResNet-20's) over
   H × H × C images (default 28,16,32,3,2: ResNet-20's first stride-2
   layer), with GFLOP/s beside each time (2·K²·C·F multiply-adds an output
   pixel for each of the three products). The input and dy are handed
   over in the layer's dtype, so no cast is timed (before 2026-11-30 the
   mixed_bfloat16 forward included the input's cast from float32). To
   compare two versions of the library, build this file against each
   one's mpt.h (`git show COMMIT:mpt.h > DIR/mpt.h`, then `-IDIR` instead
   of `-I.`) and run them in turns. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

typedef struct conv_shape {
    int64_t h, c, f, k, s; /* image side, channels, filters, kernel side, stride */
} conv_shape;

static mpt_status add_layer(mpt_model *m, const char *layer, const conv_shape *cs) {
    if (!strcmp(layer, "bn") || !strcmp(layer, "bn_dense")) return mpt_model_add_batch_normalization(m, NULL);
    if (!strcmp(layer, "dropout"))
        return mpt_model_add_dropout(m, &(mpt_dropout_desc){ .rate = 0.25f });
    if (!strcmp(layer, "conv"))
        return mpt_model_add_conv2d(m, &(mpt_conv2d_desc){ .filters = cs->f,
                                                           .kernel_size = { cs->k, cs->k },
                                                           .strides = { cs->s, cs->s },
                                                           .padding = MPT_PADDING_SAME,
                                                           .no_bias = 1 });
    return mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){ .pool_size = { 2, 2 } });
}

/* "H,C,F,K,S", each a positive whole number (the image side at most 4096). */
static int parse_conv(const char *s, conv_shape *cs) {
    long long v[5];
    int used = 0;
    if (sscanf(s, "%lld,%lld,%lld,%lld,%lld%n", &v[0], &v[1], &v[2], &v[3], &v[4], &used) != 5 ||
        s[used] != '\0' || v[0] < 1 || v[0] > 4096 || v[1] < 1 || v[2] < 1 || v[3] < 1 ||
        v[4] < 1)
        return 0;
    cs->h = v[0], cs->c = v[1], cs->f = v[2], cs->k = v[3], cs->s = v[4];
    return 1;
}

int main(int argc, char **argv) {
    const char *layer = "bn", *policy = "float32";
    int repeat = 40, threads = 2, i;
    int64_t batch = 128, h, c, n_in, n_out, k;
    conv_shape cs = { 28, 16, 32, 3, 2 };
    mpt_context *ctx = NULL;
    mpt_model *m = NULL;
    mpt_tensor tx, ty, tdy, tdx;
    mpt_dtype dtype;
    float *x, *dy;
    void *xd = NULL, *dyd = NULL; /* x and dy in the layer's dtype */
    double best_fwd = 1e30, best_bwd = 1e30, best_bwd_w = 1e30;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layer")) layer = argv[i + 1];
        else if (!strcmp(argv[i], "--policy")) policy = argv[i + 1];
        else if (!strcmp(argv[i], "--repeat")) repeat = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--conv") && parse_conv(argv[i + 1], &cs)) continue;
        else break;
    }
    if (i != argc || repeat < 1 || threads < 1 ||
        (strcmp(layer, "bn") && strcmp(layer, "bn_dense") && strcmp(layer, "dropout") &&
         strcmp(layer, "maxpool") && strcmp(layer, "conv")) ||
        (strcmp(policy, "float32") && strcmp(policy, "mixed_bfloat16"))) {
        fprintf(stderr, "usage: %s --layer bn|bn_dense|dropout|maxpool|conv [--conv H,C,F,K,S] "
                        "[--policy float32|mixed_bfloat16] "
                        "[--repeat N] [--threads N]\n", argv[0]);
        return 2;
    }
    h = !strcmp(layer, "maxpool") ? 26 : !strcmp(layer, "bn") ? 24 : 12;
    c = !strcmp(layer, "dropout") ? 64 : 32;
    if (!strcmp(layer, "bn_dense")) h = 1, c = 512; /* 1 × 1 × 512: a Dense output's rows */
    if (!strcmp(layer, "conv")) h = cs.h, c = cs.c;
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = threads }, &ctx) != MPT_OK ||
        mpt_model_create(ctx, &(mpt_model_desc){
                             .input_shape = { h, h, c }, .input_rank = 3,
                             .policy = strcmp(policy, "float32") ? MPT_POLICY_MIXED_BFLOAT16
                                                                 : MPT_POLICY_FLOAT32 },
                         &m) != MPT_OK ||
        add_layer(m, layer, &cs) != MPT_OK || mpt_model_build(m, batch) != MPT_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
        return 1;
    }
    dtype = strcmp(policy, "float32") ? MPT_BFLOAT16 : MPT_FLOAT32;
    n_in = batch * h * h * c;
    n_out = n_in; /* the output's size once a forward has run */
    if (!strcmp(layer, "conv")) n_out = batch * ((h + cs.s - 1) / cs.s) * ((h + cs.s - 1) / cs.s) * cs.f;
    x = (float *)malloc(sizeof(float) * (size_t)n_in);
    dy = (float *)malloc(sizeof(float) * (size_t)MPT__MAX(n_in, n_out));
    xd = malloc(sizeof(float) * (size_t)n_in);
    dyd = malloc(sizeof(float) * (size_t)MPT__MAX(n_in, n_out));
    if (!x || !dy || !xd || !dyd) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 1;
    }
    for (k = 0; k < n_in; k++) x[k] = (float)rand() / (float)RAND_MAX;
    for (k = 0; k < MPT__MAX(n_in, n_out); k++) dy[k] = (float)rand() / (float)RAND_MAX - 0.5f;
    if (mpt_convert(ctx, dtype, xd, MPT_FLOAT32, x, n_in) != MPT_OK ||
        mpt_convert(ctx, dtype, dyd, MPT_FLOAT32, dy, MPT__MAX(n_in, n_out)) != MPT_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
        return 1;
    }
    mpt_tensor_wrap(ctx, &tx, dtype, 4, (int64_t[]){ batch, h, h, c }, xd);
    memset(&tdx, 0, sizeof tdx);
    for (i = 0; i < repeat; i++) {
        double t0 = now(), t1, t2, t3;
        if (mpt_model_forward(m, &tx, 1, &ty) != MPT_OK) break;
        t1 = now();
        tdy = ty; /* the output's shape, in its dtype */
        tdy.data = dyd;
        if (mpt_model_backward(m, &tdy, &tdx) != MPT_OK) break;
        t2 = now();
        if (mpt_model_backward(m, &tdy, NULL) != MPT_OK) break;
        t3 = now();
        if (t1 - t0 < best_fwd) best_fwd = t1 - t0;
        if (t2 - t1 < best_bwd) best_bwd = t2 - t1;
        if (t3 - t2 < best_bwd_w) best_bwd_w = t3 - t2;
    }
    n_out = mpt_tensor_count(&ty);
    if (i < repeat) fprintf(stderr, "%s: %s\n", argv[0], mpt_context_error(ctx));
    else {
        printf("{\"bench\":\"layer\",\"layer\":\"%s\",", layer);
        if (!strcmp(layer, "conv")) {
            /* FLOPs of each of the three products: every output value's
               K²·C multiply-adds (the input gradient's nonzero ones are as
               many); the input gradient's time is the difference of the
               two backwards' (null where noise makes it none) */
            double gflop = 2.0 * (double)n_out * (double)(cs.k * cs.k * cs.c) * 1e-9;
            printf("\"conv\":[%lld,%lld,%lld,%lld,%lld],\"forward_gflops\":%.1f,"
                   "\"weights_grad_gflops\":%.1f,\"input_grad_gflops\":",
                   (long long)cs.h, (long long)cs.c, (long long)cs.f, (long long)cs.k,
                   (long long)cs.s, gflop / best_fwd, gflop / best_bwd_w);
            if (best_bwd > best_bwd_w) printf("%.1f,", gflop / (best_bwd - best_bwd_w));
            else printf("null,");
        }
        printf("\"policy\":\"%s\",\"threads\":%d,"
               "\"batch\":%lld,\"in\":%lld,\"out\":%lld,\"repeats\":%d,\"forward_ms_min\":%.3f,"
               "\"backward_ms_min\":%.3f,\"backward_no_dx_ms_min\":%.3f}\n",
               policy, threads, (long long)batch, (long long)n_in, (long long)n_out, repeat,
               1e3 * best_fwd, 1e3 * best_bwd, 1e3 * best_bwd_w);
    }
    free(x);
    free(dy);
    free(xd);
    free(dyd);
    mpt_model_destroy(m);
    mpt_context_destroy(ctx);
    return i < repeat;
}

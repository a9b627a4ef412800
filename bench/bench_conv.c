/* Conv2D benchmark: milliseconds per batch of one Conv2D layer on the
   shapes of the seed models (examples/cnn_small.c, examples/cnn.c: 3×3
   kernels, 'valid' padding, ReLU, batch 128), float32 and mixed_bfloat16,
   for forward, backward without the input gradient (kernel and bias
   gradients) and backward with it. The difference of the two backward
   times is the backward-data part.

       gcc -std=c99 -O2 -I. bench/bench_conv.c -o build/bench_conv -lpthread -lm -lz
       ./build/bench_conv [--threads 2] [--rounds 15] [--batch 128] [--clock wall|cpu]

   Each shape runs the current path (the backend's direct convolution,
   mpt_backend.conv_direct, where it takes the case) and the former one
   (forward and kernel gradient by im2col + GEMM; backward-data by dcols =
   dz · kernelᵀ and col2im's scatter-adds: what the layer does when
   conv_direct is NULL) interleaved, round after round in one process,
   alternating which goes first, and reports the median of the rounds and
   the median of each round's ratio former/current: on a shared host only
   such side-by-side ratios mean anything.
   backward-data is timed alone too (over the layer's chunks, dz given).
   Also timed on their own, per batch: im2col and col2im as the former
   path calls them.
   Prints a Markdown table and one JSON line per shape and policy. */
#define _POSIX_C_SOURCE 200809L
#define MPT_IMPLEMENTATION
#include "mpt.h"
#include "common.h"

/* --clock cpu: the process's CPU time instead of the wall clock. With
   --threads 1 that is the time the one thread ran, which a host busy
   with other work disturbs far less than the wall clock. */
static clockid_t clock_id = CLOCK_MONOTONIC;

typedef struct shape {
    const char *name;
    int64_t h, w, c, f;
    int needs_dx; /* the layer is not the model's first: backward-data runs */
} shape;

static const shape shapes[] = {
    {"conv1 28x28x1->32", 28, 28, 1, 32, 0},
    {"conv2 26x26x32->32", 26, 26, 32, 32, 1},
    {"conv3 12x12x32->64", 12, 12, 32, 64, 1},
    {"conv4 10x10x64->64", 10, 10, 64, 64, 1},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const struct {
    const char *name;
    mpt_policy policy;
} policies[] = {{"float32", MPT_POLICY_FLOAT32}, {"mixed_bfloat16", MPT_POLICY_MIXED_BFLOAT16}};

#define MAX_ROUNDS 31
enum { FWD, BWD_W, BWD_ALL, BWD_DATA, IM2COL, COL2IM, N_TIMES };
static const char *time_names[N_TIMES] = {"forward", "backward (no dx)", "backward",
                                          "backward-data", "im2col", "col2im"};

static uint64_t rng = 88172645463325252ull;
static float uniform(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

/* Backward-data alone over chunks as the layer cuts them, dz = p->dy:
   the former path (dcols = dz · kernelᵀ, col2im) or the direct one. */
static void data_former_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                              int64_t b0, int64_t n) {
    mpt__ws w = {(unsigned char *)p->workspace};
    const int64_t rows = n * c->pix;
    float *dcols = (float *)mpt__ws_take(&w, 4 * rows * c->kk);
    float *dxf = (float *)mpt__ws_take(&w, 4 * n * L->in_count);
    mpt__conv2d_cols_grad(L, p, c, (const unsigned char *)p->dy + (size_t)(b0 * c->pix * c->f) * c->es,
                          rows, dcols);
    p->be->col2im(p->impl, &c->g, L->dtype, dcols, n, dxf,
                  (unsigned char *)p->dx + (size_t)(b0 * L->in_count) * c->es);
}

static void data_direct_chunk(mpt__layer *L, const mpt__pass *p, const mpt__conv_plan *c,
                              int64_t b0, int64_t n) {
    if (!mpt__conv2d_direct(L, p, c, 1, 0,
                            (const unsigned char *)p->dy + (size_t)(b0 * c->pix * c->f) * c->es,
                            (unsigned char *)p->dx + (size_t)(b0 * L->in_count) * c->es, n,
                            p->workspace, b0 != 0))
        data_former_chunk(L, p, c, b0, n);
}

/* One round of one path: ms per batch of forward, both backwards, and the
   former path's im2col and col2im over the whole batch. */
static void time_round(mpt_model *m, const mpt_tensor *x, const mpt_tensor *dy, double t[N_TIMES],
                       int reps, int former, void *dz, void *dxbuf) {
    mpt__layer *L = &m->layers[0];
    mpt__conv_plan c;
    mpt_tensor out, dx;
    void *cols, *dxo;
    float *dcols, *dxf;
    double t0;
    int r;
    int64_t b0;
    mpt__conv_plan_init(&c, L, m->max_batch, m->be);
    t0 = clock_seconds(clock_id);
    for (r = 0; r < reps; r++) (void)mpt_model_forward(m, x, 1, &out);
    t[FWD] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
    t0 = clock_seconds(clock_id);
    for (r = 0; r < reps; r++) (void)mpt_model_backward(m, dy, NULL);
    t[BWD_W] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
    t0 = clock_seconds(clock_id);
    for (r = 0; r < reps; r++) (void)mpt_model_backward(m, dy, &dx);
    t[BWD_ALL] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
    {
        mpt__pass pass;
        mpt__pass_init(m, x->shape[0], 1, &pass);
        pass.dy = dz;
        pass.dx = dxbuf;
        t0 = clock_seconds(clock_id);
        for (r = 0; r < reps; r++)
            mpt__conv2d_by_chunks(L, &pass, former ? data_former_chunk : data_direct_chunk);
        t[BWD_DATA] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
    }
    /* the former path's memory passes, on the layer's own workspace */
    cols = m->arena[MPT__MEM_WORKSPACE];
    dcols = (float *)((unsigned char *)cols +
                      (c.chunk * c.pix * c.kk * (int64_t)c.es + 63) / 64 * 64);
    dxf = dcols + c.chunk * c.pix * c.kk + 16;
    dxo = m->grad_buf[0];
    t0 = clock_seconds(clock_id);
    for (r = 0; r < reps; r++)
        for (b0 = 0; b0 < x->shape[0]; b0 += c.chunk)
            m->be->im2col(m->impl, &c.g, L->dtype, x->data, MPT__MIN(c.chunk, x->shape[0] - b0),
                          cols);
    t[IM2COL] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
    t0 = clock_seconds(clock_id);
    for (r = 0; r < reps; r++)
        for (b0 = 0; b0 < x->shape[0]; b0 += c.chunk)
            m->be->col2im(m->impl, &c.g, L->dtype, dcols, MPT__MIN(c.chunk, x->shape[0] - b0),
                          dxf, dxo);
    t[COL2IM] = 1e3 * (clock_seconds(clock_id) - t0) / reps;
}

int main(int argc, char **argv) {
    int threads = 2, rounds = 15, i, s, p, r, k, reps;
    int64_t batch = 128;
    mpt_context *ctx;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch")) batch = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--clock") && !strcmp(argv[i + 1], "cpu"))
            clock_id = CLOCK_PROCESS_CPUTIME_ID;
        else if (!strcmp(argv[i], "--clock") && !strcmp(argv[i + 1], "wall"))
            clock_id = CLOCK_MONOTONIC;
        else break;
    }
    if (i != argc || threads < 1 || rounds < 1 || rounds > MAX_ROUNDS || batch < 1) {
        fprintf(stderr, "usage: %s [--threads N] [--rounds 1..%d] [--batch N] [--clock wall|cpu]\n",
                argv[0], MAX_ROUNDS);
        return 2;
    }
    if (mpt_context_create(&(mpt_context_desc){.num_threads = threads}, &ctx) != MPT_OK) return 1;
    printf("| shape | policy | path | forward ms | backward (no dx) ms | backward ms | "
           "backward-data ms | im2col ms | col2im ms |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (s = 0; s < N_SHAPES; s++)
        for (p = 0; p < 2; p++) {
            const shape *sh = &shapes[s];
            mpt_model *m = NULL;
            mpt_tensor x, dy;
            float *xd, *dyd;
            void *dz, *dxbuf;
            int64_t n_x = batch * sh->h * sh->w * sh->c, n_y = batch * (sh->h - 2) * (sh->w - 2) * sh->f;
            double t[2][N_TIMES][MAX_ROUNDS], med[2][N_TIMES], ratio[N_TIMES][MAX_ROUNDS],
                med_ratio[N_TIMES];
            int (*direct)(void *, const mpt_conv_args *) = mpt__cpu_table.conv_direct;
            if (mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {sh->h, sh->w, sh->c},
                                                        .input_rank = 3,
                                                        .policy = policies[p].policy, .seed = 1},
                                 &m) != MPT_OK ||
                mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = sh->f,
                                                           .kernel_size = {3, 3},
                                                           .activation = MPT_ACT_RELU}) != MPT_OK ||
                mpt_model_build(m, batch) != MPT_OK) {
                fprintf(stderr, "%s\n", mpt_context_error(ctx));
                return 1;
            }
            xd = (float *)malloc(sizeof(float) * (size_t)n_x);
            dyd = (float *)malloc(sizeof(float) * (size_t)n_y);
            for (i = 0; i < n_x; i++) xd[i] = uniform();
            for (i = 0; i < n_y; i++) dyd[i] = 1e-3f * uniform();
            dz = malloc(sizeof(float) * (size_t)n_y);
            dxbuf = malloc(sizeof(float) * (size_t)n_x);
            (void)mpt_convert(ctx, m->layers[0].dtype, dz, MPT_FLOAT32, dyd, n_y);
            mpt_tensor_wrap(ctx, &x, MPT_FLOAT32, 4, (int64_t[]){batch, sh->h, sh->w, sh->c}, xd);
            mpt_tensor_wrap(ctx, &dy, MPT_FLOAT32, 4,
                            (int64_t[]){batch, sh->h - 2, sh->w - 2, sh->f}, dyd);
            /* about 0.1 s per path and round */
            {
                double t0 = clock_seconds(clock_id), t1[N_TIMES];
                time_round(m, &x, &dy, t1, 1, 0, dz, dxbuf);
                reps = (int)(0.1 / MPT__MAX(clock_seconds(clock_id) - t0, 1e-4)) + 1;
            }
            for (r = 0; r < rounds; r++)
                for (k = 0; k < 2; k++) {
                    int path = (r + k) % 2; /* which goes first alternates */
                    double one[N_TIMES];
                    int q;
                    mpt__cpu_table.conv_direct = path ? NULL : direct;
                    time_round(m, &x, &dy, one, reps, path, dz, dxbuf);
                    for (q = 0; q < N_TIMES; q++) t[path][q][r] = one[q];
                }
            mpt__cpu_table.conv_direct = direct;
            /* each round's pair ran back to back: the median of their ratios
               cancels more of the host's changing load than the ratio of
               the medians */
            for (i = 0; i < N_TIMES; i++) {
                for (r = 0; r < rounds; r++) ratio[i][r] = t[1][i][r] / t[0][i][r];
                med_ratio[i] = median(ratio[i], rounds);
            }
            for (k = 0; k < 2; k++)
                for (i = 0; i < N_TIMES; i++) med[k][i] = median(t[k][i], rounds);
            for (k = 0; k < 2; k++)
                printf("| %s | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", sh->name,
                       policies[p].name, k ? "former" : "current", med[k][FWD], med[k][BWD_W],
                       med[k][BWD_ALL], med[k][BWD_DATA], med[k][IM2COL], med[k][COL2IM]);
            printf("| %s | %s | former/current | %.2f× | %.2f× | %.2f× | %.2f× | | |\n", sh->name,
                   policies[p].name, med_ratio[FWD], med_ratio[BWD_W], med_ratio[BWD_ALL],
                   med_ratio[BWD_DATA]);
            printf("{\"shape\": \"%s\", \"policy\": \"%s\", \"threads\": %d, \"batch\": %lld, "
                   "\"rounds\": %d",
                   sh->name, policies[p].name, threads, (long long)batch, rounds);
            for (i = 0; i < N_TIMES; i++)
                printf(", \"%s ms\": [%.3f, %.3f]", time_names[i], med[0][i], med[1][i]);
            for (i = 0; i < 4; i++)
                printf(", \"%s former/current\": %.3f", time_names[i], med_ratio[i]);
            printf("}\n");
            fflush(stdout);
            (void)sh->needs_dx;
            mpt_model_destroy(m);
            free(xd);
            free(dyd);
            free(dz);
            free(dxbuf);
        }
    mpt_context_destroy(ctx);
    return 0;
}

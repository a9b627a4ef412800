/* The CUDA backend's host-side rules (mpt.h, @backend-shared), which need
   no GPU: the GEMM's tile and K split, MPT_GEMM_AUTO's engine choice, the
   Hopper kernel's eligibility, tiles, split, work order and tensor maps,
   the fast division of the layout kernels' index arithmetic, how a loss's
   batch is tallied into the step state, the training arithmetic (the
   learning-rate schedule, the optimizers' coefficients and updates, GELU
   and the sigmoid, the loss terms, BatchNormalization's 1/sqrt(var + eps),
   bfloat16 rounding) against double precision and bit-level references,
   and the int8 GEMM's
   requantization (TFLite's rounding, which mpt_qgemm runs too) and
   fragment addresses (through ldmatrix and mma.sync emulated), and
   Conv2D's implicit-GEMM gathers (against the CPU backend's im2col and
   the input gradient's definition). The kernels that use them are
   compared with the CPU in tests/test_cuda.c, on a GPU. Like
   mpt_cuda.cu, it compiles those rules without the implementation (it
   calls the CPU backend through the public API only). */
#define MPT_BACKEND_SHARED
#include "mpt.h"
#include "test.h"

/* H100 SXM: 132 SMs. */
#define SMS 132

/* 128×128 only from a full wave of its tiles on, only where it can run,
   and as $MPT_CUDA_GEMM_TILE says. */
static void test_tile_choice(void) {
    /* 1536² is 12·12 = 144 tiles of 128: a wave; 1408² is 11·11 = 121. */
    CHECK(mpt__gemm_tile(1536, 1536, SMS, 1, 0) == 128, "1536x1536 takes 64 tiles");
    CHECK(mpt__gemm_tile(1408, 1408, SMS, 1, 0) == 64, "1408x1408 takes 128 tiles");
    CHECK(mpt__gemm_tile(128 * 132, 1, SMS, 1, 0) == 128, "132 tiles of 128: not 128");
    CHECK(mpt__gemm_tile(128 * 131, 1, SMS, 1, 0) == 64, "131 tiles of 128: not 64");
    CHECK(mpt__gemm_tile(1536, 1536, SMS, 0, 0) == 64, "128 without aligned operands");
    CHECK(mpt__gemm_tile(1536, 1536, SMS, 0, 128) == 64, "forced 128 without aligned operands");
    CHECK(mpt__gemm_tile(7, 7, SMS, 1, 128) == 128, "forced 128 ignored");
    CHECK(mpt__gemm_tile(4096, 4096, SMS, 1, 64) == 64, "forced 64 ignored");
    CHECK(mpt__gemm_tile_from_env(NULL) == 0 && mpt__gemm_tile_from_env("") == 0,
          "unset $MPT_CUDA_GEMM_TILE does not mean: choose");
    CHECK(mpt__gemm_tile_from_env("64") == 64 && mpt__gemm_tile_from_env("128") == 128,
          "64 and 128 not read");
    CHECK(mpt__gemm_tile_from_env("6") == -1 && mpt__gemm_tile_from_env("640") == -1 &&
              mpt__gemm_tile_from_env("12") == -1 && mpt__gemm_tile_from_env("1280") == -1 &&
              mpt__gemm_tile_from_env("big") == -1,
          "a wrong $MPT_CUDA_GEMM_TILE accepted");
}

/* Checks one split against its rules: slices of whole 32-deep steps that
   cover K with none empty, within the caps. */
static void check_split(int64_t m, int64_t n, int64_t k, int tile, int64_t capacity) {
    mpt__gemm_split s = mpt__gemm_split_k(m, n, k, tile, SMS, capacity);
    const int64_t tiles = ((m + tile - 1) / tile) * ((n + tile - 1) / tile);
    if (s.splits == 1) {
        CHECK(s.depth == k, "%lldx%lldx%lld: one slice of depth %lld", (long long)m,
              (long long)n, (long long)k, (long long)s.depth);
        return;
    }
    CHECK(s.splits >= 2 && s.splits <= MPT__GEMM_SPLIT_MAX, "%lldx%lldx%lld: %lld slices",
          (long long)m, (long long)n, (long long)k, (long long)s.splits);
    CHECK(s.depth % 32 == 0 && s.depth >= MPT__GEMM_SPLIT_MIN_DEPTH,
          "%lldx%lldx%lld: depth %lld", (long long)m, (long long)n, (long long)k,
          (long long)s.depth);
    CHECK((s.splits - 1) * s.depth < k && s.splits * s.depth >= k,
          "%lldx%lldx%lld: %lld slices of %lld do not cover K exactly", (long long)m,
          (long long)n, (long long)k, (long long)s.splits, (long long)s.depth);
    CHECK(s.splits * m * n <= capacity, "%lldx%lldx%lld: %lld slices overflow the workspace",
          (long long)m, (long long)n, (long long)k, (long long)s.splits);
    CHECK(tiles * 2 <= SMS && tiles * s.splits <= SMS, "%lldx%lldx%lld: %lld tiles, %lld slices",
          (long long)m, (long long)n, (long long)k, (long long)tiles, (long long)s.splits);
}

/* The weight gradients of the CNNs' convolutions split; products that
   fill the GPU, or have a short K, do not; odd K tails; the workspace
   bounds the slices. */
static void test_split_k(void) {
    mpt__gemm_split s = mpt__gemm_split_k(9, 32, 86528, 64, SMS, (int64_t)1 << 21);
    int i;
    CHECK(s.splits >= 32, "9x32x86528 (1 tile): only %lld slices", (long long)s.splits);
    s = mpt__gemm_split_k(288, 32, 73728, 64, SMS, (int64_t)1 << 21);
    CHECK(s.splits * 5 >= SMS / 2, "288x32x73728 (5 tiles): only %lld slices",
          (long long)s.splits);
    s = mpt__gemm_split_k(1024, 1024, 1 << 16, 64, SMS, (int64_t)1 << 21);
    CHECK(s.splits == 1, "1024x1024 (256 tiles) split in %lld", (long long)s.splits);
    s = mpt__gemm_split_k(9, 32, 1000, 64, SMS, (int64_t)1 << 21);
    CHECK(s.splits == 1, "9x32x1000 (short K) split in %lld", (long long)s.splits);
    s = mpt__gemm_split_k(288, 32, 73728, 64, SMS, 288 * 32 * 3);
    CHECK(s.splits == 3, "a workspace of 3 slices gave %lld", (long long)s.splits);
    s = mpt__gemm_split_k(288, 32, 73728, 64, SMS, 288 * 32 - 1);
    CHECK(s.splits == 1, "a workspace under 2 slices gave %lld", (long long)s.splits);
    check_split(9, 32, 86528, 64, (int64_t)1 << 21);
    check_split(288, 32, 73728, 64, (int64_t)1 << 21);
    check_split(288, 32, 73728 + 17, 64, (int64_t)1 << 21);
    check_split(9, 32, 1023, 64, (int64_t)1 << 21);
    check_split(9, 32, 1024, 64, (int64_t)1 << 21);
    check_split(9, 32, 1025, 64, (int64_t)1 << 21);
    for (i = 0; i < 20000; i++)
        check_split(test_randint(1, 2000), test_randint(1, 2000), test_randint(1, 1 << 20),
                    test_randint(0, 1) ? 64 : 128, test_randint(1, 1 << 22));
}

/* The usual engine stays unless the other beats it by more than the
   margin; refusals and ties keep it. */
static void test_engine_choice(void) {
    const mpt_gemm_engine mpt = MPT_GEMM_MPT, lt = MPT_GEMM_CUBLASLT;
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, 0.95, 0) == mpt, "5%% faster switched");
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, 0.90, 0) == mpt, "10%% faster switched");
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, 0.85, 0) == lt, "15%% faster kept the usual");
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, 1.0, 0) == mpt, "a tie switched");
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, 0.5, 1) == mpt, "a refused engine chosen");
    CHECK(mpt__gemm_engine_choose(lt, 2.0, mpt, 1.9, 0) == lt, "float32: 5%% faster switched");
    CHECK(mpt__gemm_engine_choose(lt, 2.0, mpt, 1.0, 0) == mpt, "float32: 2x faster kept");
    CHECK(mpt__gemm_engine_choose(mpt, 1.0, lt, NAN, 0) == mpt, "a NaN time chosen");
}

/* AUTO among several engines: the usual one (first) unless the fastest
   other beats it by the margin; refused or impossible ones (ms < 0) and
   ties do not count. */
static void test_engine_choice_among(void) {
    const mpt_gemm_engine e[3] = {MPT_GEMM_MPT, MPT_GEMM_WGMMA, MPT_GEMM_CUBLASLT};
    double ms[3] = {1.0, 0.8, 0.7};
    CHECK(mpt__gemm_engine_choose_among(e, ms, 3) == MPT_GEMM_CUBLASLT, "the fastest not chosen");
    ms[2] = -1;
    CHECK(mpt__gemm_engine_choose_among(e, ms, 3) == MPT_GEMM_WGMMA, "a refused engine chosen");
    ms[1] = 0.95;
    CHECK(mpt__gemm_engine_choose_among(e, ms, 3) == MPT_GEMM_MPT, "5%% faster switched");
    ms[1] = -1;
    CHECK(mpt__gemm_engine_choose_among(e, ms, 3) == MPT_GEMM_MPT, "no candidate: not the usual");
    ms[1] = 0.5, ms[2] = 0.5;
    CHECK(mpt__gemm_engine_choose_among(e, ms, 3) == MPT_GEMM_WGMMA, "a tie: not the first");
    ms[0] = -1; /* never timed: nothing beats it by the margin */
    CHECK(mpt__gemm_engine_choose_among(e, ms, 1) == MPT_GEMM_MPT, "one engine: not itself");
}

/* The engines AUTO times: the usual one first, the Hopper kernel only
   when asked (on the first GPU run it was timed without being asked). */
static void test_race_engines(void) {
    mpt_gemm_engine e[3];
    int n = mpt__gemm_race_engines(MPT_GEMM_MPT, 0, e);
    CHECK(n == 2 && e[0] == MPT_GEMM_MPT && e[1] == MPT_GEMM_CUBLASLT, "16-bit, not asked: %d", n);
    n = mpt__gemm_race_engines(MPT_GEMM_MPT, 1, e);
    CHECK(n == 3 && e[0] == MPT_GEMM_MPT && e[1] == MPT_GEMM_WGMMA && e[2] == MPT_GEMM_CUBLASLT,
          "16-bit, asked: %d", n);
    n = mpt__gemm_race_engines(MPT_GEMM_CUBLASLT, 0, e);
    CHECK(n == 2 && e[0] == MPT_GEMM_CUBLASLT && e[1] == MPT_GEMM_MPT, "float32: %d", n);
}

/* What TMA asks of the operands, and the 16-bit dtypes only. */
static void test_wgmma_eligible(void) {
    const uintptr_t p = 0x10000;
    CHECK(mpt__wgmma_eligible(4096, 4096, 4096, 4096, 4096, p, p, MPT_FLOAT16, 1),
          "4096^3 float16 refused");
    CHECK(mpt__wgmma_eligible(1, 7, 33, 40, 8, p, p, MPT_BFLOAT16, 1),
          "odd M, N, K with 16-byte pitches refused");
    CHECK(!mpt__wgmma_eligible(4096, 4096, 4096, 4096, 4096, p, p, MPT_FLOAT16, 0),
          "taken where the kernel is not (not Hopper, no sm_90a image)");
    CHECK(!mpt__wgmma_eligible(64, 64, 64, 64, 64, p, p, MPT_FLOAT32, 1), "float32 taken");
    CHECK(!mpt__wgmma_eligible(64, 64, 33, 33, 64, p, p, MPT_FLOAT16, 1),
          "lda of 66 bytes taken");
    CHECK(!mpt__wgmma_eligible(64, 64, 64, 64, 68, p, p, MPT_FLOAT16, 1),
          "ldb of 136 bytes taken");
    CHECK(!mpt__wgmma_eligible(64, 64, 64, 64, 64, p + 8, p, MPT_FLOAT16, 1),
          "A 8-byte aligned taken");
    CHECK(!mpt__wgmma_eligible(64, 64, 64, 64, 64, p, p + 2, MPT_FLOAT16, 1),
          "B 2-byte aligned taken");
    CHECK(!mpt__wgmma_eligible(64, 64, 0, 64, 64, p, p, MPT_FLOAT16, 1), "K = 0 taken");
    CHECK(!mpt__wgmma_eligible((int64_t)1 << 31, 8, 8, 8, 8, p, p, MPT_FLOAT16, 1),
          "M past int32 coordinates taken");
    CHECK(!mpt__wgmma_eligible(8, 8, 8, (int64_t)1 << 39, 8, p, p, MPT_FLOAT16, 1),
          "a pitch of 2^40 bytes taken");
}

/* 256 columns from a wave of 128×256 tiles on; the split for its tiles
   and 64-deep stages; the grid. */
static void test_wgmma_tiles_and_split(void) {
    mpt__gemm_split s;
    int i;
    CHECK(mpt__wgmma_tile_n(4096, 4096, SMS) == 256, "4096^2 (512 tiles of 256) not 256");
    CHECK(mpt__wgmma_tile_n(1024, 1024, SMS) == 128, "1024^2 (32 tiles of 256) not 128");
    CHECK(mpt__wgmma_tile_n(128 * 132, 256, SMS) == 256, "132 tiles of 256 not 256");
    CHECK(mpt__wgmma_tile_n(128 * 131, 256, SMS) == 128, "131 tiles of 256 not 128");
    CHECK(mpt__wgmma_tile_n(1 << 20, 128, SMS) == 128, "N = 128 not 128");
    s = mpt__wgmma_split_k(288, 32, 73728, 128, SMS, (int64_t)1 << 21);
    CHECK(s.splits >= 2 && s.depth % 64 == 0, "288x32x73728 (3 tiles): %lld slices of %lld",
          (long long)s.splits, (long long)s.depth);
    s = mpt__wgmma_split_k(4096, 4096, 4096, 256, SMS, (int64_t)1 << 21);
    CHECK(s.splits == 1 && s.depth == 4096, "4096^3 split in %lld", (long long)s.splits);
    for (i = 0; i < 20000; i++) {
        const int64_t m = test_randint(1, 3000), n = test_randint(1, 3000);
        const int64_t k = test_randint(1, 1 << 20), cap = test_randint(1, 1 << 22);
        const int bn = test_randint(0, 1) ? 128 : 256;
        const int64_t tiles = ((m + 127) / 128) * ((n + bn - 1) / bn);
        s = mpt__wgmma_split_k(m, n, k, bn, SMS, cap);
        if (s.splits == 1) {
            CHECK(s.depth == k, "%lldx%lldx%lld: one slice of %lld", (long long)m, (long long)n,
                  (long long)k, (long long)s.depth);
            continue;
        }
        CHECK(s.depth % 64 == 0 && s.depth >= MPT__GEMM_SPLIT_MIN_DEPTH &&
                  (s.splits - 1) * s.depth < k && s.splits * s.depth >= k &&
                  s.splits * m * n <= cap && tiles * 2 <= SMS && tiles * s.splits <= SMS,
              "%lldx%lldx%lld tile %d cap %lld: %lld slices of %lld", (long long)m,
              (long long)n, (long long)k, bn, (long long)cap, (long long)s.splits,
              (long long)s.depth);
    }
    CHECK(mpt__wgmma_grid(5, SMS) == 5 && mpt__wgmma_grid(1000, SMS) == SMS, "the grid");
}

/* The scheduler's order visits every (tile, slice) once, slices one after
   another, and within a band goes down a column of tile rows first. */
static void test_wgmma_work_order(void) {
    static const int64_t shapes[][3] = {{1, 1, 1},  {8, 16, 1}, {9, 3, 2}, {17, 5, 3},
                                        {32, 32, 1}, {7, 1, 4},  {1, 9, 1}, {100, 37, 2}};
    size_t si;
    for (si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t tm = shapes[si][0], tn = shapes[si][1], sl = shapes[si][2];
        const int64_t work = tm * tn * sl;
        unsigned char *seen = (unsigned char *)calloc((size_t)work, 1);
        int64_t w, bad = 0, twice = 0;
        for (w = 0; w < work; w++) {
            const mpt__wgmma_work a = mpt__wgmma_work_at(w, tm, tn);
            if (a.tile_m < 0 || a.tile_m >= tm || a.tile_n < 0 || a.tile_n >= tn ||
                a.slice != w / (tm * tn)) {
                bad++;
                continue;
            }
            twice += seen[(a.slice * tm + a.tile_m) * tn + a.tile_n]++ != 0;
        }
        CHECK(!bad && !twice, "%lldx%lld tiles, %lld slices: %lld out of range, %lld twice",
              (long long)tm, (long long)tn, (long long)sl, (long long)bad, (long long)twice);
        free(seen);
    }
    {
        /* 16 tile rows, 4 columns: items 0-7 are rows 0-7 of column 0,
           8-15 rows 0-7 of column 1, 32 row 8 of column 0. */
        const mpt__wgmma_work a = mpt__wgmma_work_at(3, 16, 4), b = mpt__wgmma_work_at(9, 16, 4);
        const mpt__wgmma_work c = mpt__wgmma_work_at(32, 16, 4);
        CHECK(a.tile_m == 3 && a.tile_n == 0 && b.tile_m == 1 && b.tile_n == 1 &&
                  c.tile_m == 8 && c.tile_n == 0,
              "band order: (%lld,%lld) (%lld,%lld) (%lld,%lld)", (long long)a.tile_m,
              (long long)a.tile_n, (long long)b.tile_m, (long long)b.tile_n,
              (long long)c.tile_m, (long long)c.tile_n);
    }
}

/* The tensor maps' parameters: the box's inner side 128 bytes (the
   swizzle span), a stage's bytes covered exactly, pitches in bytes. */
static void test_wgmma_operand_maps(void) {
    /* A untransposed, 300×200 stored with lda 208: K contiguous */
    mpt__wgmma_map a = mpt__wgmma_operand_map(300, 200, 208, 1, 128);
    /* B untransposed, K×N = 200×1000, ldb 1000: N contiguous, tile 256 */
    mpt__wgmma_map b = mpt__wgmma_operand_map(200, 1000, 1000, 0, 256);
    CHECK(a.dims[0] == 200 && a.dims[1] == 300 && a.row_bytes == 416, "A's dims and pitch");
    CHECK(a.box[0] == 64 && a.box[1] == 128 && a.boxes == 1, "A's box %ux%u x%d", a.box[0],
          a.box[1], a.boxes);
    CHECK(b.dims[0] == 1000 && b.dims[1] == 200 && b.row_bytes == 2000, "B's dims and pitch");
    CHECK(b.box[0] == 64 && b.box[1] == 64 && b.boxes == 4, "B's box %ux%u x%d", b.box[0],
          b.box[1], b.boxes);
    CHECK((uint64_t)a.box[0] * a.box[1] * a.boxes * 2 == 128 * 64 * 2 &&
              (uint64_t)b.box[0] * b.box[1] * b.boxes * 2 == 256 * 64 * 2,
          "a stage's bytes not covered exactly");
    b = mpt__wgmma_operand_map(1000, 200, 200, 1, 256); /* B transposed: N×K */
    CHECK(b.box[0] == 64 && b.box[1] == 256 && b.boxes == 1 && b.row_bytes == 400,
          "B transposed: box %ux%u x%d", b.box[0], b.box[1], b.boxes);
}

/* n / d for one divisor, checked against the hardware's division. */
static int64_t fastdiv_mismatches(uint32_t d, const uint32_t *n, int count) {
    const mpt__fastdiv f = mpt__fastdiv_make(d);
    int64_t bad = 0;
    int i;
    for (i = 0; i < count; i++) bad += mpt__fastdiv_div(f, n[i]) != n[i] / d;
    return bad;
}

/* Every divisor up to 4096 and random ones up to 2^31, with the powers of
   two and their neighbours, each against dividends at the edges (0, 1,
   around multiples of d, around 2^31 and 2^32) and random ones. */
static void test_fastdiv(void) {
    uint32_t n[64], d;
    int64_t bad = 0, divisors = 0;
    int i, j;
    for (i = 0; i < 4096 + 3 * 32 + 20000; i++) {
        if (i < 4096) d = (uint32_t)i + 1;
        else if (i < 4096 + 3 * 32) {
            const int bit = (i - 4096) / 3, off = (i - 4096) % 3 - 1;
            d = (uint32_t)(((uint64_t)1 << bit) + off);
            if (d == 0 || d > 0x80000000u) continue;
        } else d = (uint32_t)(test_next() % 0x80000000u) + 1;
        n[0] = 0, n[1] = 1, n[2] = d - 1, n[3] = d, n[4] = d + 1;
        n[5] = 2 * d - 1, n[6] = 2 * d, n[7] = 0x7FFFFFFFu, n[8] = 0x80000000u;
        n[9] = 0xFFFFFFFFu, n[10] = 0xFFFFFFFEu;
        n[11] = 0xFFFFFFFFu / d * d, n[12] = n[11] - 1;
        n[13] = 0x7FFFFFFFu / d * d, n[14] = n[13] - 1;
        for (j = 15; j < 64; j++) n[j] = (uint32_t)test_next();
        bad += fastdiv_mismatches(d, n, 64);
        divisors++;
    }
    CHECK(bad == 0, "%lld wrong quotients", (long long)bad);
    CHECK(divisors > 24000, "only %lld divisors", (long long)divisors);
}

/* A batch of 8 samples of 12 positions (96 rows): 8 samples, the mean
   loss × 8, and the hits as fractions of a sample; one position a sample
   (or 0 given) is the plain count; no metrics, no counts. The value sums
   (rows × K = 96 × 3 values): the errors as a mean over a sample's 36
   values summed over samples, the confusion counts as they are; each
   only when its metric is asked for. */
static void test_loss_tally(void) {
    mpt_step_state st;
    const int both = MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K;
    mpt__value_sums v = {{72, 144, 360, 5, 6, 7}}, none = {{0}};
    memset(&st, 0, sizeof st);
    st.loss_sum = 1, st.samples = 2, st.correct = 1, st.top_k = 2;
    mpt__loss_tally(&st, both, 0, 96, 12, 3, 1.5, 30, 60, &v, NULL);
    CHECK(st.samples == 10 && st.loss_sum == 13 && st.correct == 3.5 && st.top_k == 7,
          "positions: samples %g loss_sum %g correct %g top_k %g, not 10 13 3.5 7", st.samples,
          st.loss_sum, st.correct, st.top_k);
    CHECK(st.abs_error == 0 && st.true_positives == 0, "value sums tallied unasked");
    mpt__loss_tally(&st, MPT_METRIC_MEAN_ABSOLUTE_ERROR | MPT_METRIC_RECALL, 0, 96, 12, 3, 1.5,
                    30, 60, &v, NULL);
    CHECK(st.abs_error == 2 && st.squared_error == 4 && st.percent_error == 10,
          "errors %g %g %g, not 2 4 10", st.abs_error, st.squared_error, st.percent_error);
    CHECK(st.true_positives == 5 && st.false_positives == 6 && st.false_negatives == 7,
          "confusion %g %g %g, not 5 6 7", st.true_positives, st.false_positives,
          st.false_negatives);
    memset(&st, 0, sizeof st);
    mpt__loss_tally(&st, MPT_METRIC_ACCURACY, 0, 7, 0, 10, 0.1, 5, 6, &none, NULL);
    CHECK(st.samples == 7 && st.loss_sum == 0.1 * 7 && st.correct == 5 && st.top_k == 0,
          "one position: samples %g loss_sum %.17g correct %g top_k %g", st.samples, st.loss_sum,
          st.correct, st.top_k);
    mpt__loss_tally(&st, 0, 0, 7, 1, 10, 0.1, 5, 6, &none, NULL);
    CHECK(st.samples == 14 && st.correct == 5 && st.top_k == 0,
          "no metrics: correct %g top_k %g counted", st.correct, st.top_k);
}

/* A value's errors and confusion counts (mpt__value_add), by hand: the
   percent error takes max(|y|, 1e-7); a logit is positive past 0, a
   probability past 0.5; a label is positive when not 0. */
static void test_value_sums(void) {
    mpt__value_sums v = {{0}};
    mpt__value_add(&v, 0.75f, 1.0f, 0); /* TP, |d| 0.25 */
    mpt__value_add(&v, 0.5f, 0.0f, 0);  /* 0.5 is not past 0.5: TN, |d| 0.5, y 0 → ε */
    mpt__value_add(&v, 0.25f, 0.0f, 1); /* a logit past 0: FP */
    mpt__value_add(&v, -1.0f, 2.0f, 1); /* FN, |d| 3 */
    CHECK(v.sum[MPT__SUM_ABS_ERROR] == 4 && v.sum[MPT__SUM_SQUARED_ERROR] == 9.375,
          "abs %g squared %g", v.sum[MPT__SUM_ABS_ERROR], v.sum[MPT__SUM_SQUARED_ERROR]);
    CHECK(fabs(v.sum[MPT__SUM_PERCENT_ERROR] - (25 + 100 * 0.5 / 1e-7 + 100 * 0.25 / 1e-7 + 150)) <
              1e-3,
          "percent %.17g", v.sum[MPT__SUM_PERCENT_ERROR]);
    CHECK(v.sum[MPT__SUM_TRUE_POSITIVES] == 1 && v.sum[MPT__SUM_FALSE_POSITIVES] == 1 &&
              v.sum[MPT__SUM_FALSE_NEGATIVES] == 1,
          "TP %g FP %g FN %g", v.sum[MPT__SUM_TRUE_POSITIVES], v.sum[MPT__SUM_FALSE_POSITIVES],
          v.sum[MPT__SUM_FALSE_NEGATIVES]);
}

/* ---- the training arithmetic (the optimizers, activations, losses, BN) ---- */

/* A float from random bits: the rules' inputs span every exponent. */
static uint32_t rng_state = 2463534242u;
static uint32_t next_bits(void) { /* xorshift32 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}
static float uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)(next_bits() >> 8) * (1.0f / 16777216.0f);
}
static int close_to(double got, double want, double rel) {
    return fabs(got - want) <= rel * fabs(want) + 1e-30;
}
/* |got − want| within tol of `scale`, the size of the terms that made
   want (a difference of near terms cancels their leading bits). */
static int near(double got, double want, double scale, double tol) {
    return fabs(got - want) <= tol * scale;
}

/* The schedules at chosen steps against their formulas in double. */
static void test_learning_rate_schedule(void) {
    mpt_optimizer_desc d;
    memset(&d, 0, sizeof d);
    CHECK(mpt__learning_rate_at(&d, 0.5, 1000) == 0.5, "constant");
    d.schedule.warmup_steps = 4;
    CHECK(mpt__learning_rate_at(&d, 0.5, 0) == 0.125 && mpt__learning_rate_at(&d, 0.5, 3) == 0.5 &&
              mpt__learning_rate_at(&d, 0.5, -3) == 0.125,
          "warm-up: %g %g", mpt__learning_rate_at(&d, 0.5, 0), mpt__learning_rate_at(&d, 0.5, 3));
    d.schedule.type = MPT_LR_EXPONENTIAL_DECAY;
    d.schedule.decay_steps = 10;
    d.schedule.decay_rate = 0.5f;
    CHECK(close_to(mpt__learning_rate_at(&d, 1.0, 4 + 15), pow(0.5, 1.5), 1e-15),
          "exponential after warm-up: %.17g", mpt__learning_rate_at(&d, 1.0, 19));
    d.schedule.type = MPT_LR_STEP_DECAY;
    CHECK(mpt__learning_rate_at(&d, 1.0, 4 + 29) == 0.25, "step decay: %.17g",
          mpt__learning_rate_at(&d, 1.0, 33));
    d.schedule.type = MPT_LR_COSINE_DECAY;
    d.schedule.warmup_steps = 0;
    d.schedule.alpha = 0.25f;
    CHECK(mpt__learning_rate_at(&d, 2.0, 0) == 2.0 && mpt__learning_rate_at(&d, 2.0, 10) == 0.5 &&
              mpt__learning_rate_at(&d, 2.0, 99) == 0.5,
          "cosine ends: %.17g %.17g", mpt__learning_rate_at(&d, 2.0, 0),
          mpt__learning_rate_at(&d, 2.0, 10));
    CHECK(close_to(mpt__learning_rate_at(&d, 2.0, 5), 2.0 * (0.75 * 0.5 + 0.25), 1e-15),
          "cosine halfway: %.17g", mpt__learning_rate_at(&d, 2.0, 5));
}

/* The coefficients: Adam's bias correction folded into α, the unscaling
   and the clip of the global norm. */
static void test_update_coefs(void) {
    mpt_optimizer_desc d;
    mpt_step_state st;
    mpt__update_coefs k;
    double t = 3, alpha;
    memset(&d, 0, sizeof d);
    memset(&st, 0, sizeof st);
    d.beta_1 = 0.9f, d.beta_2 = 0.999f, d.epsilon = 1e-7f, d.weight_decay = 0.5f;
    st.learning_rate = 0.01f, st.optimizer_steps = 2, st.loss_scale = 1024;
    st.sum_squares = 4.0 * 1024 * 1024; /* ‖g‖ = 2 after unscaling */
    k = mpt__update_coefs_at(&d, &st);
    alpha = (double)0.01f * sqrt(1 - pow((double)0.999f, t)) / (1 - pow((double)0.9f, t));
    CHECK(close_to(k.alpha, alpha, 1e-6), "alpha %.9g, want %.9g", (double)k.alpha, alpha);
    CHECK(k.gscale == 1.0f / 1024 && k.lr == 0.01f && k.decay == 0.005f,
          "gscale %g lr %g decay %g", (double)k.gscale, (double)k.lr, (double)k.decay);
    CHECK(k.one_minus_b1 == (float)(1 - (double)0.9f), "1 - beta_1 %.9g", (double)k.one_minus_b1);
    d.clip_global_norm = 0.5f; /* 2 clipped to 0.5: a quarter */
    k = mpt__update_coefs_at(&d, &st);
    CHECK(k.gscale == 0.25f / 1024, "clipped gscale %g", (double)k.gscale);
}

/* One element of each rule against the same rule in double, over random
   masters, gradients and moments. */
static void test_update_rules(void) {
    mpt__update_coefs k;
    int i, bad = 0;
    k.gscale = 0.5f, k.l2 = 0.01f, k.decay = 0.001f, k.lr = 0.1f, k.momentum = 0.9f;
    k.one_minus_b1 = 0.1f, k.one_minus_b2 = 0.001f, k.alpha = 0.003f, k.epsilon = 1e-7f;
    for (i = 0; i < 100000; i++) {
        float w = uniform(-2, 2), g = uniform(-8, 8), m = uniform(-1, 1), v = uniform(0, 4);
        float m1 = m, v1 = v, vel = m, vel_n = m, w_adam, w_sgd, w_mom, w_nest;
        double gi = (double)g * k.gscale + (double)k.l2 * w, wi = w - (double)w * k.decay;
        double mi = m + (gi - m) * k.one_minus_b1, vi = v + (gi * gi - v) * k.one_minus_b2;
        double want_adam = wi - mi * k.alpha / (sqrt(vi) + k.epsilon);
        double velocity = (double)m * k.momentum - gi * k.lr;
        w_adam = mpt__adam_update(&k, w, g, &m1, &v1);
        w_sgd = mpt__sgd_update(&k, w, g);
        w_mom = mpt__momentum_update(&k, w, g, &vel, 0);
        w_nest = mpt__momentum_update(&k, w, g, &vel_n, 1);
        double scale = 1 + fabs(w) + fabs(gi) + fabs(m);
        bad += !near(w_adam, want_adam, scale, 1e-6) || !near(m1, mi, scale, 1e-6) ||
               !near(v1, vi, 1 + gi * gi + v, 1e-6);
        bad += !near(w_sgd, wi - gi * k.lr, scale, 1e-6);
        bad += !near(w_mom, wi + velocity, scale, 1e-6) || !near(vel, velocity, scale, 1e-6);
        bad += !near(w_nest, wi + velocity * k.momentum - gi * k.lr, scale, 1e-6) || vel_n != vel;
    }
    CHECK(bad == 0, "%d updates away from the rule in double", bad);
}

/* GELU, its derivative and the sigmoid against double precision. */
static void test_activation_rules(void) {
    int i, bad = 0;
    CHECK(mpt__sigmoid(-200.0f) == 0.0f && mpt__sigmoid(200.0f) == 1.0f &&
              mpt__sigmoid(0.0f) == 0.5f,
          "sigmoid's ends");
    CHECK(mpt__gelu(0.0f) == 0.0f && mpt__gelu(-50.0f) == 0.0f && mpt__gelu(50.0f) == 50.0f,
          "GELU's ends");
    for (i = 0; i < 100000; i++) {
        float x = uniform(-12, 12);
        double cdf = 0.5 * (1 + erf(x / sqrt(2.0))), pdf = exp(-0.5 * x * x) / sqrt(2 * 3.14159265358979323846);
        bad += !near(mpt__gelu(x), x * cdf, 1 + fabs(x), 1e-6);
        bad += !near(mpt__gelu_derivative(x), cdf + x * pdf, 1 + fabs(x), 1e-6);
        bad += !close_to(mpt__sigmoid(x), 1 / (1 + exp(-(double)x)), 1e-6);
    }
    CHECK(bad == 0, "%d values away from double", bad);
}

/* The loss terms against double precision, and their clips. */
static void test_loss_terms(void) {
    float g;
    int i, bad = 0;
    CHECK(mpt__loss_clip(0.0f) == MPT__LOSS_EPS && mpt__loss_clip(1.0f) == 1.0f - MPT__LOSS_EPS &&
              mpt__loss_clip(NAN) == MPT__LOSS_EPS && mpt__loss_clip(0.5f) == 0.5f,
          "clip");
    CHECK(mpt__bce_term(0, 0.0f, 1.0f, &g) > 16 && g == 0, "BCE at a clipped 0: gradient %g",
          (double)g);
    CHECK(mpt__xent_prob_term(0.0f, 1.0f, 1.0f, &g) > 16 && g == 0, "xent at a clipped 0");
    CHECK(mpt__bce_term(1, 1000.0f, 0.0f, &g) == 1000.0f && g == 1.0f, "BCE from a big logit");
    for (i = 0; i < 100000; i++) {
        float x = uniform(0.001f, 0.999f), t = uniform(0, 1), z = uniform(-30, 30), gx;
        double sz = 1 / (1 + exp(-(double)z)), q = exp(z - 35.0);
        double bce = -(t * log(x) + (1 - (double)t) * log(1 - (double)x));
        double bce_logits = t * log1p(exp(-(double)z)) + (1 - (double)t) * log1p(exp((double)z));
        double up = (1 - (double)t) / (1 - (double)x), down = t / (double)x;
        float loss = mpt__bce_term(0, x, t, &gx);
        bad += !close_to(loss, bce, 1e-5) || !near(gx, up - down, up + down, 1e-5);
        loss = mpt__bce_term(1, z, t, &gx);
        bad += !near(loss, bce_logits, 1 + fabs(z), 1e-6) || !near(gx, sz - t, 1, 1e-6);
        loss = mpt__xent_prob_term(x, 2.0f, t, &gx);
        bad += !close_to(loss, -t * log(x / 2.0), 1e-5) || !close_to(gx, -t / (x / 2.0), 1e-5);
        bad += mpt__squared_error_term(x, t, &gx) != ((double)(x - t)) * (x - t) ||
               gx != 2 * (x - t);
        bad += !close_to(mpt__xent_logit_term(z, t, 3.0), t * (3.0 - z), 1e-15);
        bad += !near(mpt__xent_logit_grad(z, t, 35.0, 1.0f), q - t, 1 + q, 1e-6);
    }
    CHECK(bad == 0, "%d terms away from double", bad);
}

/* BatchNormalization's 1 / sqrt(var + eps): double, rounded once. */
static void test_bn_inv_std(void) {
    CHECK(mpt__bn_inv_std(3.999, 0.001f) == (float)(1 / sqrt(3.999 + (double)0.001f)) &&
              mpt__bn_inv_std(0, 0.25f) == 2.0f,
          "inv_std %.9g", (double)mpt__bn_inv_std(3.999, 0.001f));
}

/* float32 -> bfloat16 against a reference that looks at the bits the
   other way: the kept half, then the dropped half compared with one half
   of an ulp (above it up, at it to the even one). NaNs are quieted with
   sign and payload top kept, as vcvtneps2bf16. */
static uint16_t ref_bf16(uint32_t x) {
    uint16_t kept = (uint16_t)(x >> 16);
    uint32_t dropped = x & 0xffffu;
    if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu)) return (uint16_t)(kept | 0x40u);
    if (dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u))) kept++;
    return kept;
}

static void test_bf16_rounding(void) {
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
        0x7f800001u, 0xff81ffffu, 0x7f7fffffu, 0x7f7f8000u, 0xff7f7fffu, 0x00000001u,
        0x00008000u, 0x00018000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u,
        0x807fffffu, 0x00ff8000u};
    int64_t bad = 0;
    int i;
    for (i = 0; i < (int)(sizeof special / sizeof special[0]); i++)
        CHECK(mpt__f32_bits_to_bf16(special[i]) == ref_bf16(special[i]), "%08x -> %04x, not %04x",
              (unsigned)special[i], (unsigned)mpt__f32_bits_to_bf16(special[i]),
              (unsigned)ref_bf16(special[i]));
    CHECK(mpt__f32_bits_to_bf16(0x7f7fffffu) == 0x7f80u, "FLT_MAX does not round to inf");
    for (i = 0; i < 4000000; i++) {
        uint32_t x = next_bits();
        if (i & 1) x = (x & 0xffff0000u) | 0x8000u; /* ties */
        bad += mpt__f32_bits_to_bf16(x) != ref_bf16(x);
    }
    CHECK(bad == 0, "%lld random floats rounded otherwise", (long long)bad);
}

/* ---- the int8 GEMM's requantization (mpt__requantize_int8) ------------------- */

/* gemmlowp's SaturatingRoundingDoublingHighMul and RoundingDivideByPOT
   written the other way round from the shared rule: a 128-bit-free
   floor with masks, the remainder compared bitwise. */
static int32_t ref_doubling_high_mul(int32_t a, int32_t b) {
    const int64_t ab = (int64_t)a * (int64_t)b;
    const int64_t nudge = ab >= 0 ? (int64_t)1 << 30 : 1 - ((int64_t)1 << 30);
    int64_t q;
    if (a == INT32_MIN && b == INT32_MIN) return INT32_MAX;
    q = ab + nudge;
    /* C's division truncates: floor for q ≥ 0, ceiling below */
    return (int32_t)(q >= 0 ? q >> 31 : -((-q) >> 31));
}
static int32_t ref_divide_by_pot(int32_t x, int e) {
    const int64_t mask = ((int64_t)1 << e) - 1;
    const int64_t rem = (int64_t)x & mask, threshold = (mask >> 1) + (x < 0);
    return (int32_t)(((int64_t)x >> e) + (rem > threshold));
}
static int8_t ref_requantize(int32_t acc, int32_t m, int shift, int32_t zp, int32_t lo,
                             int32_t hi) {
    int64_t x = (int64_t)acc, q;
    if (shift > 0) {
        x *= (int64_t)1 << shift;
        x = x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : x;
    }
    q = ref_divide_by_pot(ref_doubling_high_mul((int32_t)x, m), shift > 0 ? 0 : -shift) +
        (int64_t)zp;
    return (int8_t)(q < lo ? lo : q > hi ? hi : q);
}

/* What the CUDA int8 GEMM and mpt_qgemm both run, here on the host: worked
   values (ties of each rounding, saturation, the clamp), then random
   sums, multipliers, shifts, zero points and clamps against gemmlowp's
   rules written above. */
static void test_requantize_int8(void) {
    int64_t bad = 0;
    int i;
    /* 3/2 = 1.5 rounds up, −3/2 = −1.5 up too (the doubling high multiply) */
    CHECK(mpt__multiply_by_quantized_multiplier(3, 1 << 30, 0) == 2 &&
              mpt__multiply_by_quantized_multiplier(-3, 1 << 30, 0) == -1,
          "the doubling high multiply's ties: %ld, %ld",
          (long)mpt__multiply_by_quantized_multiplier(3, 1 << 30, 0),
          (long)mpt__multiply_by_quantized_multiplier(-3, 1 << 30, 0));
    /* 6·2^-2 = 1.5 → 2, −1.5 → −2 (the shift's ties go away from zero) */
    CHECK(mpt__multiply_by_quantized_multiplier(6, 1 << 30, -1) == 2 &&
              mpt__multiply_by_quantized_multiplier(-6, 1 << 30, -1) == -2,
          "the shift's ties: %ld, %ld", (long)mpt__multiply_by_quantized_multiplier(6, 1 << 30, -1),
          (long)mpt__multiply_by_quantized_multiplier(-6, 1 << 30, -1));
    CHECK(mpt__multiply_by_quantized_multiplier(INT32_MAX, INT32_MAX, 30) == INT32_MAX - 1 &&
              mpt__multiply_by_quantized_multiplier(INT32_MIN, INT32_MAX, 1) == INT32_MIN + 1,
          "a left shift past int32 saturates before the multiply");
    CHECK(mpt__rounding_doubling_high_mul(INT32_MIN, INT32_MIN) == INT32_MAX,
          "INT32_MIN² saturates");
    CHECK(mpt__requantize_int8(1000, 1 << 30, 0, -3, -128, 127) == 127 &&
              mpt__requantize_int8(-1000, 1 << 30, 0, 0, -128, 127) == -128 &&
              mpt__requantize_int8(-10, 1 << 30, 0, 4, 4, 127) == 4 &&
              mpt__requantize_int8(20, 1 << 30, 0, 4, -128, 6) == 6 &&
              mpt__requantize_int8(20, 1 << 30, 0, 4, -128, 127) == 14,
          "the zero point and the clamp");
    for (i = 0; i < 2000000; i++) {
        const int32_t acc = i % 4 ? (int32_t)test_next() : test_randint(-70000, 70000);
        const int32_t m = (int32_t)((1u << 30) + (uint32_t)(test_next() % (1u << 30)));
        const int shift = i % 8 ? test_randint(-31, 0) : test_randint(1, 30);
        const int32_t zp = test_randint(-128, 127);
        int32_t lo = -128, hi = 127;
        if (i % 3 == 0) lo = zp;
        if (i % 5 == 0) hi = test_randint(lo, 127);
        bad += mpt__requantize_int8(acc, m, shift, zp, lo, hi) !=
               ref_requantize(acc, m, shift, zp, lo, hi);
    }
    CHECK(bad == 0, "%lld of 2000000 requantizations differ from gemmlowp's rules", (long long)bad);
}

/* ---- the CUDA int8 GEMM's fragments, through emulated ldmatrix and mma ------ */

/* ldmatrix.sync.aligned.m8n8.x4.shared.b16 as PTX defines it: lane l gives
   the address of row l % 8 of matrix l / 8 (8 rows × 16 bytes); thread t
   receives, of matrix i, in register i, the 4 bytes 4(t%4)..4(t%4)+3 of
   row t / 4. */
static void emulate_ldmatrix_x4(const uint8_t *base, const int offset[32], uint32_t r[32][4]) {
    int t, i;
    for (t = 0; t < 32; t++)
        for (i = 0; i < 4; i++) {
            const uint8_t *row = base + offset[8 * i + t / 4] + 4 * (t % 4);
            r[t][i] = (uint32_t)row[0] | (uint32_t)row[1] << 8 | (uint32_t)row[2] << 16 |
                      (uint32_t)row[3] << 24;
        }
}

static int fragment_byte(uint32_t reg, int i, int is_unsigned) {
    const uint8_t b = (uint8_t)(reg >> (8 * i));
    return is_unsigned ? (int)b : (int)(int8_t)b;
}

/* mma.sync.aligned.m16n8k32.row.col.s32.{s8,u8}.s8.s32, d += a·b, with
   the fragment layouts of the PTX manual, groupID g = lane / 4 and
   threadID_in_group q = lane % 4: A's byte i (0..15, 4 per register) is
   at row g + 8·(i/4 odd), column 4q + i%4 + 16·(i ≥ 8); B's byte i (0..7)
   at row (depth) 4q + i%4 + 16·(i ≥ 4), column g; d's element i (0..3) at
   row g + 8·(i ≥ 2), column 2q + i%2. */
static void emulate_mma_m16n8k32(int32_t d[32][4], const uint32_t a[32][4],
                                 const uint32_t b[32][2], int a_unsigned) {
    int A[16][32], B[32][8], lane, i, k;
    for (lane = 0; lane < 32; lane++) {
        const int g = lane / 4, q = lane % 4;
        for (i = 0; i < 16; i++)
            A[g + ((i / 4) % 2 ? 8 : 0)][4 * q + i % 4 + (i >= 8 ? 16 : 0)] =
                fragment_byte(a[lane][i / 4], i % 4, a_unsigned);
        for (i = 0; i < 8; i++)
            B[4 * q + i % 4 + (i >= 4 ? 16 : 0)][g] = fragment_byte(b[lane][i / 4], i % 4, 0);
    }
    for (lane = 0; lane < 32; lane++)
        for (i = 0; i < 4; i++) {
            const int row = lane / 4 + (i >= 2 ? 8 : 0), col = 2 * (lane % 4) + i % 2;
            int32_t sum = 0;
            for (k = 0; k < 32; k++) sum += A[row][k] * B[k][col];
            d[lane][i] += sum;
        }
}

/* The kernel's lane offsets and accumulator positions (mpt.h), run through
   the emulated ldmatrix and mma.sync on a 16-row A slice and two 8-column
   B tiles of random bytes at the kernel's pitch, two depth steps of 32,
   int8 and uint8 A: every accumulator must hold Σ_k A[row][k]·B[k][col]
   of the row and column mpt__cuda_qgemm_acc_row/col name. */
static void test_qgemm_fragments(void) {
    enum { P = MPT__CUDA_QGEMM_PITCH, DEPTH = 64 };
    static uint8_t sa[16 * P], sb[16 * P];
    int64_t bad = 0;
    int trial;
    /* 16-byte rows an odd number of 16 bytes apart: 8 of them in 8 bank groups */
    CHECK(P >= DEPTH && P % 16 == 0 && (P / 16) % 2 == 1,
          "pitch %d: 8 rows do not fall in 8 different 16-byte bank groups", P);
    for (trial = 0; trial < 200; trial++) {
        const int a_unsigned = trial % 2;
        int a_off[32], b_off[32], lane, e, nt, kk, k;
        int32_t acc[2][32][4];
        size_t i;
        memset(acc, 0, sizeof acc);
        for (i = 0; i < sizeof sa; i++) sa[i] = (uint8_t)test_next(), sb[i] = (uint8_t)test_next();
        for (lane = 0; lane < 32; lane++)
            a_off[lane] = mpt__cuda_qgemm_a_lane(lane), b_off[lane] = mpt__cuda_qgemm_b_lane(lane);
        for (kk = 0; kk < DEPTH; kk += 32) {
            uint32_t a[32][4], r[32][4], b[2][32][2];
            emulate_ldmatrix_x4(sa + kk, a_off, a);
            emulate_ldmatrix_x4(sb + kk, b_off, r);
            for (lane = 0; lane < 32; lane++) {
                b[0][lane][0] = r[lane][0], b[0][lane][1] = r[lane][1];
                b[1][lane][0] = r[lane][2], b[1][lane][1] = r[lane][3];
            }
            for (nt = 0; nt < 2; nt++) emulate_mma_m16n8k32(acc[nt], a, b[nt], a_unsigned);
        }
        for (nt = 0; nt < 2; nt++)
            for (lane = 0; lane < 32; lane++)
                for (e = 0; e < 4; e++) {
                    const int row = mpt__cuda_qgemm_acc_row(lane, e);
                    const int col = nt * 8 + mpt__cuda_qgemm_acc_col(lane, e);
                    int32_t want = 0;
                    for (k = 0; k < DEPTH; k++)
                        want += (a_unsigned ? (int)sa[row * P + k] : (int)(int8_t)sa[row * P + k]) *
                                (int)(int8_t)sb[col * P + k];
                    bad += acc[nt][lane][e] != want;
                }
    }
    CHECK(bad == 0, "%lld accumulators differ from the product", (long long)bad);
}

/* The GEMMs' staged epilogue (mpt.h): a warp's pairs, written where
   mpt__cuda_epi_put puts them from the accumulator layout and read back
   where mpt__cuda_epi_get_row/col say, arrive at the rows and columns
   they hold, each of the 16 × 32 staged values read exactly once; every
   64-bit write and read (one per half-warp per phase) touches 32
   different banks. */
static void test_epilogue_staging(void) {
    static float stage[MPT__CUDA_EPI_WARP_FLOATS];
    int seen[16][MPT__CUDA_EPI_COLS], lane, j, h, s, bad_place = 0, bad_value = 0;
    int conflicts = 0;
    memset(seen, 0, sizeof seen);
    for (s = 0; s < MPT__CUDA_EPI_WARP_FLOATS; s++) stage[s] = -1.0f;
    for (j = 0; j < MPT__CUDA_EPI_COLS / 8; j++)
        for (h = 0; h < 2; h++) {
            int half;
            for (half = 0; half < 2; half++) {
                int banks[32] = {0}, b;
                for (lane = 16 * half; lane < 16 * half + 16; lane++) {
                    const int off = mpt__cuda_epi_put(lane, j, h);
                    banks[off % 32]++, banks[(off + 1) % 32]++;
                }
                for (b = 0; b < 32; b++) conflicts += banks[b] != 1;
            }
            for (lane = 0; lane < 32; lane++) {
                /* the pair this lane holds: elements 2h and 2h + 1 of block j */
                const int row = mpt__cuda_qgemm_acc_row(lane, 2 * h);
                const int col = 8 * j + mpt__cuda_qgemm_acc_col(lane, 2 * h);
                const int off = mpt__cuda_epi_put(lane, j, h);
                bad_place += off % 2 != 0 || off / MPT__CUDA_EPI_PITCH != row ||
                             off % MPT__CUDA_EPI_PITCH != col ||
                             mpt__cuda_qgemm_acc_col(lane, 2 * h + 1) != col % 8 + 1;
                stage[off] = (float)(row * 100 + col);
                stage[off + 1] = (float)(row * 100 + col + 1);
            }
        }
    for (s = 0; s < 8; s++) {
        int half;
        for (half = 0; half < 2; half++) {
            int banks[32] = {0}, b;
            for (lane = 16 * half; lane < 16 * half + 16; lane++) {
                const int off = mpt__cuda_epi_get_row(lane, s) * MPT__CUDA_EPI_PITCH +
                                mpt__cuda_epi_get_col(lane);
                banks[off % 32]++, banks[(off + 1) % 32]++;
            }
            for (b = 0; b < 32; b++) conflicts += banks[b] != 1;
        }
        for (lane = 0; lane < 32; lane++) {
            const int row = mpt__cuda_epi_get_row(lane, s), col = mpt__cuda_epi_get_col(lane);
            const int off = row * MPT__CUDA_EPI_PITCH + col;
            if (row < 0 || row >= 16 || col < 0 || col % 2 || col + 1 >= MPT__CUDA_EPI_COLS) {
                bad_place++;
                continue;
            }
            seen[row][col]++, seen[row][col + 1]++;
            bad_value += stage[off] != (float)(row * 100 + col) ||
                         stage[off + 1] != (float)(row * 100 + col + 1);
        }
    }
    for (s = 0; s < 16 * MPT__CUDA_EPI_COLS; s++)
        bad_place += seen[s / MPT__CUDA_EPI_COLS][s % MPT__CUDA_EPI_COLS] != 1;
    CHECK(MPT__CUDA_EPI_COLS % 8 == 0 && MPT__CUDA_EPI_PITCH >= MPT__CUDA_EPI_COLS,
          "staging %d columns at pitch %d", MPT__CUDA_EPI_COLS, MPT__CUDA_EPI_PITCH);
    CHECK(bad_place == 0, "%d pairs staged or read at the wrong place", bad_place);
    CHECK(bad_value == 0, "%d pairs read back with another pair's values", bad_value);
    CHECK(conflicts == 0, "%d banks hit twice or not at all by one access", conflicts);
}

/* ---- Conv2D's implicit-GEMM gathers (mpt__conv_gather_at) ----------------------- */

/* The windows: strides 1 to 3 (unequal too), 'same' and 'valid', kernels
   1×1, 2×3, 3×3, 5×5, odd sizes, a window larger than the image, a
   single output pixel. */
typedef struct conv_case {
    int64_t h, w, c, f, kh, kw, sh, sw;
    int same;
} conv_case;

static const conv_case conv_cases[] = {
    {7, 9, 8, 8, 3, 3, 1, 1, 1},   {7, 9, 8, 16, 3, 3, 2, 2, 1},  {9, 8, 16, 8, 3, 3, 2, 2, 0},
    {11, 10, 8, 24, 5, 5, 3, 3, 1}, {6, 7, 16, 8, 2, 3, 1, 1, 0}, {5, 5, 8, 8, 1, 1, 2, 2, 0},
    {6, 5, 8, 16, 1, 1, 3, 3, 1},  {4, 4, 8, 8, 5, 5, 3, 3, 1},   {5, 6, 8, 8, 2, 3, 2, 1, 1},
    {8, 8, 24, 8, 3, 3, 3, 3, 0},  {3, 3, 8, 8, 3, 3, 1, 1, 0},   {13, 11, 8, 8, 5, 5, 2, 3, 1},
    {10, 7, 8, 16, 3, 2, 3, 2, 1},
};
#define N_CONV_CASES ((int)(sizeof conv_cases / sizeof conv_cases[0]))

/* One axis with TensorFlow's padding, as Conv2D's window has it: 'same'
   gives ceil(in / s) outputs and half the padding before (the odd pixel
   after). */
static int64_t conv_axis(int64_t in, int64_t k, int64_t s, int same, int64_t *before) {
    int64_t out, pad;
    *before = 0;
    if (!same) return (in - k) / s + 1;
    out = (in + s - 1) / s;
    pad = (out - 1) * s + k - in;
    *before = pad > 0 ? pad / 2 : 0;
    return out;
}

static mpt_window conv_case_window(const conv_case *k) {
    mpt_window g;
    memset(&g, 0, sizeof g);
    g.h = k->h, g.w = k->w, g.c = k->c, g.kh = k->kh, g.kw = k->kw, g.sh = k->sh, g.sw = k->sw;
    g.oh = conv_axis(k->h, k->kh, k->sh, k->same, &g.top);
    g.ow = conv_axis(k->w, k->kw, k->sw, k->same, &g.left);
    return g;
}

static void conv_case_name(char *buf, size_t size, const conv_case *k) {
    snprintf(buf, size, "(%lld,%lld,%lld) kernel %lldx%lld F %lld stride %lld,%lld %s",
             (long long)k->h, (long long)k->w, (long long)k->c, (long long)k->kh,
             (long long)k->kw, (long long)k->f, (long long)k->sh, (long long)k->sw,
             k->same ? "same" : "valid");
}

static float *random_floats(int64_t n) {
    float *p = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    int64_t i;
    for (i = 0; i < n; i++) p[i] = (float)test_uniform(-1, 1);
    return p;
}

/* Value (row, col) of matrix `kind` as the kernel's loader reads it: the
   chunk at (row, col − col % 8) by the rule, then col % 8 into it; 0 where
   the rule says -1. A chunk must lie inside the tensor (t_count elements)
   and start on 8 elements (16 bytes); *bad counts those that do not. */
static double gathered(const mpt__conv_gather *q, int kind, const float *t, int64_t t_count,
                       int64_t row, int64_t col, int64_t *bad) {
    const int64_t at = mpt__conv_gather_at(q, kind, row, col - col % 8);
    if (at < 0) return 0;
    if (at % 8 != 0 || at + 8 > t_count) {
        (*bad)++;
        return 0;
    }
    return t[at + col % 8];
}

/* The forward's A and the kernel gradient's A (colsᵀ, read as the loader
   reads a transposed operand: stored row k, column m) against the CPU
   backend's own im2col of random images: the same values, zeros where
   cols has its padding, every chunk inside x and 16-byte aligned. */
static void test_conv_gather_cols(void) {
    const int64_t n = 2;
    mpt_context *ctx = NULL;
    mpt_context_desc d;
    const mpt_backend *cpu;
    void *impl;
    int ci;
    memset(&d, 0, sizeof d);
    d.use_cpu = 1;
    d.num_threads = 1;
    if (mpt_context_create(&d, &ctx) != MPT_OK) {
        CHECK(0, "no CPU context");
        return;
    }
    cpu = mpt_context_backend(ctx, &impl);
    for (ci = 0; ci < N_CONV_CASES; ci++) {
        const conv_case *k = &conv_cases[ci];
        const mpt_window g = conv_case_window(k);
        const mpt__conv_gather q = mpt__conv_gather_make(&g, k->f);
        const int64_t rows = n * g.oh * g.ow, kk = g.kh * g.kw * g.c, xn = n * g.h * g.w * g.c;
        float *x = random_floats(xn), *dz = random_floats(rows * k->f);
        float *cols = (float *)malloc(sizeof(float) * (size_t)(rows * kk));
        int64_t r, col, m, j, bad = 0, wrong = 0, wrong_grad = 0;
        char name[128];
        conv_case_name(name, sizeof name, k);
        CHECK(mpt__conv_gather_fits(&g, n, k->f), "%s: the rule refuses it", name);
        cpu->im2col(impl, &g, MPT_FLOAT32, x, n, cols); /* (rows, kk) */
        for (r = 0; r < rows; r++)
            for (col = 0; col < kk; col++)
                wrong += gathered(&q, MPT__CONV_GATHER_COLS, x, xn, r, col, &bad) !=
                         cols[r * kk + col];
        /* dkernel (kk, F) = colsᵀ · dz, the same sums in the same order */
        for (m = 0; m < kk; m++)
            for (j = 0; j < k->f; j++) {
                double by_rule = 0, by_cols = 0;
                for (r = 0; r < rows; r++) {
                    by_rule += gathered(&q, MPT__CONV_GATHER_COLS, x, xn, r, m, &bad) *
                               dz[r * k->f + j];
                    by_cols += (double)cols[r * kk + m] * dz[r * k->f + j];
                }
                wrong_grad += by_rule != by_cols;
            }
        CHECK(bad == 0, "%s: %lld chunks outside x or unaligned", name, (long long)bad);
        CHECK(wrong == 0, "%s: %lld elements of cols differ from the CPU's im2col", name,
              (long long)wrong);
        CHECK(wrong_grad == 0, "%s: %lld elements of colsᵀ·dz differ", name,
              (long long)wrong_grad);
        free(x);
        free(dz);
        free(cols);
    }
    mpt_context_destroy(ctx);
}

/* The input gradient's product, A from dz times the kernel's B (stored
   transposed), both read through the rule, in double, against the
   definition: dx[b, y, x, c] = Σ over the output pixels (oy, ox) and
   taps (i, j) with oy·sh − top + i = y, ox·sw − left + j = x, and the
   filters f, of dz[b, oy, ox, f] · kernel[i, j, c, f]. ≤ 1e-12 of the
   norm (the same products, summed in another order). */
static void test_conv_gather_input_grad(void) {
    const int64_t n = 2;
    int ci;
    for (ci = 0; ci < N_CONV_CASES; ci++) {
        const conv_case *k = &conv_cases[ci];
        const mpt_window g = conv_case_window(k);
        const mpt__conv_gather q = mpt__conv_gather_make(&g, k->f);
        const int64_t taps = g.kh * g.kw, f = k->f, C = g.c;
        const int64_t dzn = n * g.oh * g.ow * f, kn = taps * C * f, xn = n * g.h * g.w * C;
        const int64_t rows = n * g.h * g.w, depth = taps * f;
        float *dz = random_floats(dzn), *kernel = random_floats(kn);
        double *want = (double *)calloc((size_t)xn, sizeof(double)), num = 0, den = 0;
        int64_t b, oy, ox, i, j, c, ff, r, col, bad = 0;
        char name[128];
        conv_case_name(name, sizeof name, k);
        for (b = 0; b < n; b++)
            for (oy = 0; oy < g.oh; oy++)
                for (ox = 0; ox < g.ow; ox++)
                    for (i = 0; i < g.kh; i++)
                        for (j = 0; j < g.kw; j++) {
                            const int64_t y = oy * g.sh - g.top + i, x = ox * g.sw - g.left + j;
                            if (y < 0 || y >= g.h || x < 0 || x >= g.w) continue;
                            for (c = 0; c < C; c++)
                                for (ff = 0; ff < f; ff++)
                                    want[((b * g.h + y) * g.w + x) * C + c] +=
                                        (double)dz[((b * g.oh + oy) * g.ow + ox) * f + ff] *
                                        kernel[((i * g.kw + j) * C + c) * f + ff];
                        }
        for (r = 0; r < rows; r++)
            for (c = 0; c < C; c++) {
                double got = 0;
                for (col = 0; col < depth; col++)
                    got += gathered(&q, MPT__CONV_GATHER_DZ, dz, dzn, r, col, &bad) *
                           gathered(&q, MPT__CONV_GATHER_KERNEL, kernel, kn, c, col, &bad);
                num += (got - want[r * C + c]) * (got - want[r * C + c]);
                den += want[r * C + c] * want[r * C + c];
            }
        CHECK(bad == 0, "%s: %lld chunks outside dz or the kernel, or unaligned", name,
              (long long)bad);
        CHECK(den > 0 && sqrt(num / den) <= 1e-12, "%s: dx off by %.3g of its norm", name,
              den > 0 ? sqrt(num / den) : -1.0);
        free(dz);
        free(kernel);
        free(want);
    }
}

/* What the gather takes: channels and filters in whole chunks of 8, and
   indices below 2^31. */
static void test_conv_gather_fits(void) {
    const conv_case base = {12, 12, 16, 32, 3, 3, 1, 1, 1};
    conv_case k = base;
    mpt_window g = conv_case_window(&k);
    CHECK(mpt__conv_gather_fits(&g, 128, k.f), "16 channels, 32 filters refused");
    k.c = 3, g = conv_case_window(&k);
    CHECK(!mpt__conv_gather_fits(&g, 128, k.f), "3 channels (a first layer) taken");
    k = base, k.c = 12, g = conv_case_window(&k);
    CHECK(!mpt__conv_gather_fits(&g, 128, k.f), "12 channels taken");
    k = base, g = conv_case_window(&k);
    CHECK(!mpt__conv_gather_fits(&g, 128, 20), "20 filters taken");
    k = base, k.h = k.w = 4096, g = conv_case_window(&k);
    CHECK(mpt__conv_gather_fits(&g, 2, k.f), "dz of 2 × 4096² × 32 (2^30 elements) refused");
    CHECK(!mpt__conv_gather_fits(&g, 4, k.f), "dz of 4 × 4096² × 32 (2^31 elements) taken");
}

int main(void) {
    test_seed(99);
    TEST_RUN(test_tile_choice);
    TEST_RUN(test_split_k);
    TEST_RUN(test_engine_choice);
    TEST_RUN(test_engine_choice_among);
    TEST_RUN(test_race_engines);
    TEST_RUN(test_wgmma_eligible);
    TEST_RUN(test_wgmma_tiles_and_split);
    TEST_RUN(test_wgmma_work_order);
    TEST_RUN(test_wgmma_operand_maps);
    TEST_RUN(test_fastdiv);
    TEST_RUN(test_loss_tally);
    TEST_RUN(test_value_sums);
    TEST_RUN(test_learning_rate_schedule);
    TEST_RUN(test_update_coefs);
    TEST_RUN(test_update_rules);
    TEST_RUN(test_activation_rules);
    TEST_RUN(test_loss_terms);
    TEST_RUN(test_bn_inv_std);
    TEST_RUN(test_bf16_rounding);
    TEST_RUN(test_requantize_int8);
    TEST_RUN(test_qgemm_fragments);
    TEST_RUN(test_epilogue_staging);
    TEST_RUN(test_conv_gather_cols);
    TEST_RUN(test_conv_gather_input_grad);
    TEST_RUN(test_conv_gather_fits);
    return test_summary("test_cuda_rules");
}

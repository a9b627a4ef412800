/* The CUDA backend's host-side rules (mpt.h, @backend-shared), which need
   no GPU: the GEMM's tile and K split, MPT_GEMM_AUTO's engine choice, and
   the fast division of the layout kernels' index arithmetic. The kernels
   that use them are compared with the CPU in tests/test_cuda.c, on a GPU. */
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

int main(void) {
    test_seed(99);
    TEST_RUN(test_tile_choice);
    TEST_RUN(test_split_k);
    TEST_RUN(test_engine_choice);
    TEST_RUN(test_fastdiv);
    return test_summary("test_cuda_rules");
}

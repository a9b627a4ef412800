/* The CPU matrix product: C = alpha · op(A) · op(B) + beta · C, then
   C = act(C + bias), with op(A) M×K, op(B) K×N, C M×N, all row-major.

   HOW IT IS TILED (Goto/BLIS blocking, seen from row-major C)

       split C into T rectangles, T = threads            (one task each)
       task: for jc over its columns, NC at a time
               for pc over K, KC at a time
                 pack B[pc.., jc..] into KC×NC panels      (L2-resident)
                 for ir over its rows, MR at a time
                   pack A[ir.., pc..] into a KC×MR panel   (L1-resident)
                   for jr over the NC columns, NR at a time
                     micro-kernel: an MR×NR tile of C in registers,
                     KC rank-1 updates, then the epilogue

   The micro-kernel holds its MR×NR accumulators in registers and, per k,
   loads NR/16 vectors of B and broadcasts MR values of A, so each loaded
   value feeds several FMAs. With AVX-512 it is 12×32: 24 zmm accumulators,
   2 B vectors and a broadcast (27 of 32 registers); Zen 4 retires one
   512-bit FMA per cycle at 4 cycles latency, so 24 independent chains keep
   it busy, and 14 loads per 24 FMAs stay within its two load ports.
   AVX2 uses 6×16 (12 ymm accumulators), the portable C path 4×8.

   KC = 512 makes an A panel 24 KiB, which stays in the 32 KiB L1 while
   the B panels (64 KiB each) stream past it from L2; NC = 512 makes a B
   block 1 MiB, Zen 4's L2 per core. (Measured on Zen 4: KC 512 / NC 512
   beat 256 and 384 by 3-10%, mostly by writing C fewer times.) K is cut
   into equal blocks of at most KC (a multiple of 8), which depends on K
   only, never on the thread count.

   PACKING. Everything is packed into the thread's scratch memory (1 MiB
   of B block and a 24 KiB A panel out of MPT__THREAD_SCRATCH_BYTES; a
   product allocates nothing), converting float16/bfloat16 to float32 on
   the way. Where the depth is contiguous in memory (A not transposed, B
   transposed) packing is a transpose, done 8×8 in registers. With AVX-512
   BF16 and bfloat16 inputs, pairs of k stay bfloat16 side by side (a
   32-bit lane holds k and k+1) for vdpbf16ps, which does two k per
   instruction; an odd K is padded with a zero half. Edges are padded with
   zeros in the panels and stored with masks; a last B panel of at most
   NR/2 columns runs a half-width kernel, so N = 10 does 16 columns of
   work, not 32.

   WORK SPLIT. Tasks are rectangles of C, never slices of K: every element
   of C is computed by one thread with the same sequence of operations
   whatever the thread count, so results are bit-identical for 1 or 64
   threads. The rectangles are chosen to repack the least (splitting rows
   repacks B, splitting columns repacks A). Small products run as one task
   on the calling thread, where waking the pool would cost more than it
   saves.

   EPILOGUE. The first K block computes alpha·AB + beta·C (the old C is not
   read when beta is 0, so NaN garbage there is ignored), the later blocks
   add alpha·AB, and the last also adds the bias and applies the
   activation, while the tile is still in cache. alpha = 0 (alpha_is_zero)
   or K = 0 reads neither A nor B, as BLAS does. */

static float mpt__load_f32(mpt_dtype dtype, const void *p, int64_t i) {
    switch (dtype) {
    case MPT_FLOAT16: return mpt_half_to_float(((const mpt_half *)p)[i]);
    case MPT_BFLOAT16: return mpt_bf16_to_float(((const mpt_bf16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

#define MPT__GEMM_KC 512 /* depth block (max)                    */
#define MPT__GEMM_NC 512 /* columns of C per packed B block (max) */
/* Below this many multiply-adds a product runs on the calling thread. */
#define MPT__GEMM_SERIAL_FMAS ((int64_t)1 << 20)

typedef enum mpt__gemm_path {
    MPT__GEMM_SCALAR = 0,   /* portable C, 4×8                          */
    MPT__GEMM_AVX2 = 1,     /* AVX2 + FMA, 6×16                         */
    MPT__GEMM_AVX512 = 2,   /* AVX-512, 12×32                           */
    MPT__GEMM_AVX512_BF16 = 3 /* AVX-512 BF16 dot products, 12×32 pairs */
} mpt__gemm_path;

/* What the micro-kernel does when it stores its tile. */
typedef struct mpt__gemm_epi {
    float alpha;
    float beta;         /* multiplies the old C when load_c              */
    int load_c;         /* 0: C = alpha·AB (old C never read)            */
    const float *bias;  /* NULL, or the bias of the tile's first column */
    int relu;           /* fused here; other activations run after      */
} mpt__gemm_epi;

/* kc: depth; a: packed A panel (kc × MR); b: packed B panel (kc × bw),
   bw = NR or NR/2; c: the tile's first element; m ≤ MR, n ≤ bw valid. */
typedef void (*mpt__gemm_kernel_fn)(int64_t kc, const void *a, const void *b, int bw, float *c,
                                    int64_t ldc, int m, int n, const mpt__gemm_epi *e);

typedef struct mpt__gemm_job {
    const mpt_gemm_desc *d;
    mpt_context *ctx;
    mpt_dtype dtype;
    mpt__gemm_path path;
    mpt__gemm_kernel_fn kernel;
    int mr, nr;        /* micro-tile                                  */
    int pairs;         /* panels hold bfloat16 k-pairs (uint32 lanes)  */
    int64_t kc, nc;    /* depth block, column block                   */
    int64_t task_rows, task_cols, tasks_n; /* the task grid           */
    float alpha;
} mpt__gemm_job;

/* -----------------------------------------------------------------------------
   Packing. A panel is `w` lanes (rows of A or columns of B) by kc depth;
   element (lane l, depth k) of the source is at index off + l·ls + k·ks,
   where either ls = 1 (lanes contiguous: A transposed, B not) or ks = 1
   (depth contiguous: A not transposed, B transposed). float32 panels are
   laid out [k][w]; bfloat16-pair panels [k/2][w] of uint32 (k low, k+1 high).
   Lanes ≥ `lanes` and the half of a last odd pair are zero.
   ----------------------------------------------------------------------------- */

#if MPT__X86
MPT__TARGET_AVX2 static void mpt__gemm_f16_to_f32_avx2(const mpt_half *s, float *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = mpt_half_to_float(s[i]);
}
#endif

/* n contiguous source elements from index i on, as float32. */
static void mpt__gemm_row_f32(const mpt__gemm_job *job, const void *src, int64_t i, int64_t n,
                              float *d) {
    int64_t t;
    if (job->dtype == MPT_FLOAT32) {
        memcpy(d, (const float *)src + i, sizeof(float) * (size_t)n);
    } else if (job->dtype == MPT_BFLOAT16) {
        const mpt_bf16 *s = (const mpt_bf16 *)src + i;
        for (t = 0; t < n; t++) d[t] = mpt_bf16_to_float(s[t]);
    } else {
#if MPT__X86
        if (job->ctx->cpu & MPT_CPU_F16C) {
            mpt__gemm_f16_to_f32_avx2((const mpt_half *)src + i, d, n);
            return;
        }
#endif
        for (t = 0; t < n; t++) d[t] = mpt__load_f32(MPT_FLOAT16, src, i + t);
    }
}

static void mpt__gemm_pack_f32(const mpt__gemm_job *job, float *dst, int w, const void *src,
                               int64_t off, int64_t ls, int64_t ks, int lanes, int64_t kc) {
    int64_t k, l;
    if (ls == 1) {
        for (k = 0; k < kc; k++) {
            float *d = dst + k * w;
            mpt__gemm_row_f32(job, src, off + k * ks, lanes, d);
            for (l = lanes; l < w; l++) d[l] = 0;
        }
    } else if (job->dtype == MPT_FLOAT32) {
        /* A transpose: 8 depths of each lane at a time, so the reads are
           runs of 32 bytes and the writes stay within a few cache lines. */
        const float *s = (const float *)src + off;
        int64_t k0;
        for (k0 = 0; k0 < kc; k0 += 8) {
            int64_t kn = MPT__MIN(8, kc - k0);
            for (l = 0; l < lanes; l++) {
                const float *sl = s + l * ls + k0;
                float *d = dst + k0 * w + l;
                for (k = 0; k < kn; k++) d[k * w] = sl[k];
            }
        }
        for (l = lanes; l < w; l++)
            for (k = 0; k < kc; k++) dst[k * w + l] = 0;
    } else {
        float tmp[64];
        int64_t k0;
        for (l = 0; l < w; l++) {
            for (k0 = 0; k0 < kc; k0 += 64) {
                int64_t kn = MPT__MIN(64, kc - k0);
                if (l < lanes) mpt__gemm_row_f32(job, src, off + l * ls + k0, kn, tmp);
                for (k = 0; k < kn; k++) dst[(k0 + k) * w + l] = l < lanes ? tmp[k] : 0.0f;
            }
        }
    }
}

static void mpt__gemm_pack_pairs(float *dst_f, int w, const void *src, int64_t off, int64_t ls,
                                 int64_t ks, int lanes, int64_t kc) {
    uint32_t *dst = (uint32_t *)(void *)dst_f;
    const mpt_bf16 *s = (const mpt_bf16 *)src + off;
    int64_t kp, l, npairs = (kc + 1) / 2;
    for (kp = 0; kp < npairs; kp++) {
        int64_t k = 2 * kp;
        int odd_end = k + 1 >= kc;
        uint32_t *d = dst + kp * w;
        if (ls == 1) {
            const mpt_bf16 *s0 = s + k * ks, *s1 = odd_end ? s0 : s0 + ks;
            for (l = 0; l < lanes; l++)
                d[l] = (uint32_t)s0[l] | (odd_end ? 0u : (uint32_t)s1[l] << 16);
        } else {
            for (l = 0; l < lanes; l++) {
                const mpt_bf16 *sl = s + l * ls + k;
                d[l] = (uint32_t)sl[0] | (odd_end ? 0u : (uint32_t)sl[1] << 16);
            }
        }
        for (l = lanes; l < w; l++) d[l] = 0;
    }
}

#if MPT__X86
static __mmask16 mpt__gemm_mask16(int n) {
    return (__mmask16)(n >= 16 ? 0xffffu : n <= 0 ? 0u : (1u << n) - 1u);
}

/* 16 elements of dtype dt at p (lanes outside m read as 0), as float32. */
MPT__TARGET_AVX512 static inline __m512 mpt__gemm_load16(mpt_dtype dt, const void *p,
                                                         __mmask16 m) {
    __m256i h;
    if (dt == MPT_FLOAT32) return _mm512_maskz_loadu_ps(m, p);
    h = _mm256_maskz_loadu_epi16(m, p);
    /* (maskz forms: g++ 12 warns about the _mm512_undefined_* in the plain ones) */
    if (dt == MPT_FLOAT16) return _mm512_maskz_cvtph_ps(m, h);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(m, _mm512_maskz_cvtepu16_epi32(m, h), 16));
}

/* The AVX-512 packer for contiguous lanes (A transposed, B not): one
   masked load and store per 16 lanes and depth, converting to float32 or
   interleaving two depths into bfloat16 pairs. */
MPT__TARGET_AVX512 static void mpt__gemm_pack_lanes_avx512(const mpt__gemm_job *job, float *dst,
                                                           int w, const void *src, int64_t off,
                                                           int64_t ks, int lanes, int64_t kc) {
    const mpt_dtype dt = job->dtype;
    const int64_t es = (int64_t)mpt_dtype_size(dt);
    const char *s = (const char *)src + off * es;
    const int nch = (w + 15) / 16;
    uint32_t *d32 = (uint32_t *)(void *)dst;
    __mmask16 lm[2], wm[2];
    int64_t k;
    int c;
    for (c = 0; c < 2; c++) {
        lm[c] = mpt__gemm_mask16(lanes - 16 * c);
        wm[c] = mpt__gemm_mask16(w - 16 * c);
    }
    if (!job->pairs) {
        for (k = 0; k < kc; k++)
            for (c = 0; c < nch; c++)
                _mm512_mask_storeu_ps(dst + k * w + 16 * c, wm[c],
                                      mpt__gemm_load16(dt, s + (k * ks + 16 * c) * es, lm[c]));
        return;
    }
    for (k = 0; k < kc; k += 2)
        for (c = 0; c < nch; c++) {
            const char *r0 = s + (k * ks + 16 * c) * 2;
            __m256i h0 = _mm256_maskz_loadu_epi16(lm[c], r0);
            __m256i h1 = k + 1 < kc ? _mm256_maskz_loadu_epi16(lm[c], r0 + ks * 2)
                                    : _mm256_setzero_si256();
            __m512i lo = _mm512_maskz_cvtepu16_epi32(lm[c], h0);
            __m512i hi = _mm512_maskz_slli_epi32(lm[c], _mm512_maskz_cvtepu16_epi32(lm[c], h1), 16);
            _mm512_mask_storeu_epi32(d32 + (k / 2) * w + 16 * c, wm[c], _mm512_or_si512(lo, hi));
        }
}

/* The transposing packer for contiguous depth (A not transposed, B
   transposed): 8 depths of 8 lanes are loaded as 8 vectors (converted to
   float32, or 8 bfloat16 pairs as 32-bit units), transposed in registers
   and stored with masks; depths after the last full 8 (and an odd last
   half pair) are left to the portable packer. Returns the depths done. */
MPT__TARGET_AVX512 static int64_t mpt__gemm_pack_depth_avx512(const mpt__gemm_job *job,
                                                              float *dst, int w, const void *src,
                                                              int64_t off, int64_t ls, int lanes,
                                                              int64_t kc) {
    const mpt_dtype dt = job->dtype;
    const int64_t units = job->pairs ? kc / 2 : kc; /* 32-bit depth units */
    const int mode = dt == MPT_FLOAT32 || job->pairs ? 0 : dt == MPT_FLOAT16 ? 1 : 2;
    const float *sf = (const float *)src + off;
    const uint16_t *sh = (const uint16_t *)src + off;
    const int64_t step = mode == 0 && dt != MPT_FLOAT32 ? 2 : 1; /* source elements per unit */
    int64_t u0;
    int l0;
    for (l0 = 0; l0 < w; l0 += 8) {
        const __mmask8 wm = (__mmask8)(w - l0 >= 8 ? 0xff : (1u << (w - l0)) - 1u);
        const float *pf[8];
        const uint16_t *ph[8];
        int i;
        for (i = 0; i < 8; i++) {
            /* Lanes past the valid ones read lane 0 again; zeroed below. */
            int64_t l = l0 + i < lanes ? l0 + i : 0;
            pf[i] = sf + l * ls;
            ph[i] = sh + l * ls;
        }
        for (u0 = 0; u0 + 8 <= units; u0 += 8) {
            __m256 r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7;
#define MPT__LD(i)                                                                          \
    if (mode == 0)                                                                          \
        r##i = step == 1 ? _mm256_loadu_ps(pf[i] + u0)                                      \
                         : _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(ph[i] + 2 * u0))); \
    else if (mode == 1)                                                                     \
        r##i = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ph[i] + u0)));             \
    else                                                                                    \
        r##i = _mm256_castsi256_ps(_mm256_slli_epi32(                                       \
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(ph[i] + u0))), 16));     \
    if (l0 + i >= lanes) r##i = _mm256_setzero_ps();
            MPT__LD(0) MPT__LD(1) MPT__LD(2) MPT__LD(3) MPT__LD(4) MPT__LD(5) MPT__LD(6) MPT__LD(7)
#undef MPT__LD
            t0 = _mm256_unpacklo_ps(r0, r1);
            t1 = _mm256_unpackhi_ps(r0, r1);
            t2 = _mm256_unpacklo_ps(r2, r3);
            t3 = _mm256_unpackhi_ps(r2, r3);
            t4 = _mm256_unpacklo_ps(r4, r5);
            t5 = _mm256_unpackhi_ps(r4, r5);
            t6 = _mm256_unpacklo_ps(r6, r7);
            t7 = _mm256_unpackhi_ps(r6, r7);
            r0 = _mm256_shuffle_ps(t0, t2, 0x44);
            r1 = _mm256_shuffle_ps(t0, t2, 0xee);
            r2 = _mm256_shuffle_ps(t1, t3, 0x44);
            r3 = _mm256_shuffle_ps(t1, t3, 0xee);
            r4 = _mm256_shuffle_ps(t4, t6, 0x44);
            r5 = _mm256_shuffle_ps(t4, t6, 0xee);
            r6 = _mm256_shuffle_ps(t5, t7, 0x44);
            r7 = _mm256_shuffle_ps(t5, t7, 0xee);
            {
                float *d = dst + u0 * w + l0;
                _mm256_mask_storeu_ps(d + 0 * w, wm, _mm256_permute2f128_ps(r0, r4, 0x20));
                _mm256_mask_storeu_ps(d + 1 * w, wm, _mm256_permute2f128_ps(r1, r5, 0x20));
                _mm256_mask_storeu_ps(d + 2 * w, wm, _mm256_permute2f128_ps(r2, r6, 0x20));
                _mm256_mask_storeu_ps(d + 3 * w, wm, _mm256_permute2f128_ps(r3, r7, 0x20));
                _mm256_mask_storeu_ps(d + 4 * w, wm, _mm256_permute2f128_ps(r0, r4, 0x31));
                _mm256_mask_storeu_ps(d + 5 * w, wm, _mm256_permute2f128_ps(r1, r5, 0x31));
                _mm256_mask_storeu_ps(d + 6 * w, wm, _mm256_permute2f128_ps(r2, r6, 0x31));
                _mm256_mask_storeu_ps(d + 7 * w, wm, _mm256_permute2f128_ps(r3, r7, 0x31));
            }
        }
    }
    u0 = units / 8 * 8;
    return job->pairs ? 2 * u0 : u0;
}
#endif

static void mpt__gemm_pack(const mpt__gemm_job *job, float *dst, int w, const void *src,
                           int64_t off, int64_t ls, int64_t ks, int lanes, int64_t kc) {
#if MPT__X86
    if (job->path >= MPT__GEMM_AVX512 && ls == 1) {
        mpt__gemm_pack_lanes_avx512(job, dst, w, src, off, ks, lanes, kc);
        return;
    }
    if (job->path >= MPT__GEMM_AVX512 && ks == 1) {
        int64_t done = mpt__gemm_pack_depth_avx512(job, dst, w, src, off, ls, lanes, kc);
        if (done == kc) return;
        dst += (job->pairs ? done / 2 : done) * w;
        off += done;
        kc -= done;
    }
#endif
    if (job->pairs)
        mpt__gemm_pack_pairs(dst, w, src, off, ls, ks, lanes, kc);
    else
        mpt__gemm_pack_f32(job, dst, w, src, off, ls, ks, lanes, kc);
}

/* -----------------------------------------------------------------------------
   Micro-kernels
   ----------------------------------------------------------------------------- */

static void mpt__gemm_kernel_scalar(int64_t kc, const void *av, const void *bv, int bw,
                                    float *c, int64_t ldc, int m, int n,
                                    const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    float acc[4][8];
    int64_t p;
    int i, j;
    memset(acc, 0, sizeof acc);
    for (p = 0; p < kc; p++, a += 4, b += bw)
        for (i = 0; i < 4; i++)
            for (j = 0; j < bw; j++) acc[i][j] += a[i] * b[j];
    for (i = 0; i < m; i++) {
        float *ci = c + i * ldc;
        for (j = 0; j < n; j++) {
            float v = e->alpha * acc[i][j];
            if (e->load_c) v += e->beta * ci[j];
            if (e->bias) v += e->bias[j];
            if (e->relu) v = v > 0 ? v : 0;
            ci[j] = v;
        }
    }
}

/* Row lists for the register-blocked kernels: X(row) for each row. */
#define MPT__ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define MPT__ROWS12(X) MPT__ROWS6(X) X(6) X(7) X(8) X(9) X(10) X(11)

#if MPT__X86

MPT__TARGET_AVX2 static inline void mpt__gemm_store_avx2(float *c, __m256 acc, __m256i mask,
                                                         const float *bias,
                                                         const mpt__gemm_epi *e) {
    __m256 v = _mm256_mul_ps(acc, _mm256_set1_ps(e->alpha));
    if (e->load_c)
        v = _mm256_fmadd_ps(_mm256_maskload_ps(c, mask), _mm256_set1_ps(e->beta), v);
    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias, mask));
    if (e->relu) v = _mm256_max_ps(v, _mm256_setzero_ps());
    _mm256_maskstore_ps(c, mask, v);
}

MPT__TARGET_AVX2 static inline __m256i mpt__gemm_mask_avx2(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

MPT__TARGET_AVX2 static void mpt__gemm_kernel_avx2(int64_t kc, const void *av, const void *bv,
                                                   int bw, float *c, int64_t ldc, int m, int n,
                                                   const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 8 : NULL;
    __m256i k0 = mpt__gemm_mask_avx2(n), k1 = mpt__gemm_mask_avx2(n - 8);
    int64_t p;
#define MPT__D(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
    MPT__ROWS6(MPT__D)
#undef MPT__D
    if (bw == 16) {
        for (p = 0; p < kc; p++, a += 6, b += 16) {
            __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8), ai;
#define MPT__F(i)                                  \
    ai = _mm256_broadcast_ss(a + i);               \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);    \
    c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < kc; p++, a += 6, b += 8) {
            __m256 b0 = _mm256_load_ps(b), ai;
#define MPT__F(i)                                  \
    ai = _mm256_broadcast_ss(a + i);               \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);
            MPT__ROWS6(MPT__F)
#undef MPT__F
        }
    }
#define MPT__S(i)                                                              \
    if (i < m) {                                                               \
        mpt__gemm_store_avx2(c + i * ldc, c##i##0, k0, bias0, e);              \
        if (n > 8) mpt__gemm_store_avx2(c + i * ldc + 8, c##i##1, k1, bias1, e); \
    }
    MPT__ROWS6(MPT__S)
#undef MPT__S
}

MPT__TARGET_AVX512 static inline void mpt__gemm_store_avx512(float *c, __m512 acc,
                                                             __mmask16 mask, const float *bias,
                                                             const mpt__gemm_epi *e) {
    __m512 v = _mm512_mul_ps(acc, _mm512_set1_ps(e->alpha));
    if (e->load_c)
        v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, c), _mm512_set1_ps(e->beta), v);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    /* (x > 0 ? x : 0, as the scalar ReLU: NaN and -0 give +0.) */
    if (e->relu) v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), v);
    _mm512_mask_storeu_ps(c, mask, v);
}

#define MPT__STORE512(i)                                                           \
    if (i < m) {                                                                   \
        mpt__gemm_store_avx512(c + i * ldc, c##i##0, k0, bias0, e);                \
        if (n > 16) mpt__gemm_store_avx512(c + i * ldc + 16, c##i##1, k1, bias1, e); \
    }

MPT__TARGET_AVX512 static void mpt__gemm_kernel_avx512(int64_t kc, const void *av,
                                                       const void *bv, int bw, float *c,
                                                       int64_t ldc, int m, int n,
                                                       const mpt__gemm_epi *e) {
    const float *a = (const float *)av, *b = (const float *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 16 : NULL;
    __mmask16 k0 = mpt__gemm_mask16(n), k1 = mpt__gemm_mask16(n - 16);
    int64_t p;
#define MPT__D(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (p = 0; p < kc; p++, a += 12, b += 32) {
            __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16), ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(a[i]);                     \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);    \
    c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < kc; p++, a += 12, b += 16) {
            __m512 b0 = _mm512_load_ps(b), ai;
#define MPT__F(i)                                  \
    ai = _mm512_set1_ps(a[i]);                     \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__STORE512)
}

/* bfloat16 pairs: each 32-bit lane of A and B holds (k, k+1); one
   vdpbf16ps adds a[k]·b[k] + a[k+1]·b[k+1] to each float32 lane. */
MPT__TARGET_AVX512_BF16 static void mpt__gemm_kernel_avx512_bf16(int64_t kc, const void *av,
                                                                 const void *bv, int bw,
                                                                 float *c, int64_t ldc, int m,
                                                                 int n, const mpt__gemm_epi *e) {
    const uint32_t *a = (const uint32_t *)av;
    const uint32_t *b = (const uint32_t *)bv;
    const float *bias0 = e->bias, *bias1 = e->bias ? e->bias + 16 : NULL;
    __mmask16 k0 = mpt__gemm_mask16(n), k1 = mpt__gemm_mask16(n - 16);
    int64_t p, npairs = (kc + 1) / 2;
#define MPT__D(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
    MPT__ROWS12(MPT__D)
#undef MPT__D
    if (bw == 32) {
        for (p = 0; p < npairs; p++, a += 12, b += 32) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(b);
            __m512bh b1 = (__m512bh)_mm512_load_si512(b + 16);
            __m512bh ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)a[i]);             \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);             \
    c##i##1 = _mm512_dpbf16_ps(c##i##1, ai, b1);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    } else {
        for (p = 0; p < npairs; p++, a += 12, b += 16) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(b), ai;
#define MPT__F(i)                                            \
    ai = (__m512bh)_mm512_set1_epi32((int)a[i]);             \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);
            MPT__ROWS12(MPT__F)
#undef MPT__F
        }
    }
    MPT__ROWS12(MPT__STORE512)
}
#undef MPT__STORE512

#endif /* MPT__X86 */

/* -----------------------------------------------------------------------------
   The driver
   ----------------------------------------------------------------------------- */

/* Epilogue-only product (K = 0 or alpha = 0): C = beta·C, + bias, act. */
static void mpt__gemm_scale_c(const mpt_gemm_desc *d) {
    int64_t i, j;
    for (i = 0; i < d->m; i++) {
        float *c = d->c + i * d->ldc;
        for (j = 0; j < d->n; j++) {
            float v = d->beta != 0 ? d->beta * c[j] : 0.0f;
            c[j] = d->bias ? v + d->bias[j] : v;
        }
        mpt__activation_forward(d->activation, c, d->n);
    }
}

static void mpt__gemm_task(void *arg, int64_t task, int thread) {
    const mpt__gemm_job *job = (const mpt__gemm_job *)arg;
    const mpt_gemm_desc *d = job->d;
    const int mr = job->mr, nr = job->nr;
    const int64_t i0 = (task / job->tasks_n) * job->task_rows;
    const int64_t j0 = (task % job->tasks_n) * job->task_cols;
    const int64_t i1 = MPT__MIN(d->m, i0 + job->task_rows);
    const int64_t j1 = MPT__MIN(d->n, j0 + job->task_cols);
    /* Scratch: the B block (kc × nc), then one A panel (kc × mr). */
    float *bpack = (float *)mpt__thread_scratch(job->ctx, thread);
    float *apack = bpack + job->kc * job->nc;
    /* Element (i, k) of op(A) is at i·a_ls + k·a_ks; (k, j) of op(B) at
       j·b_ls + k·b_ks. */
    const int64_t a_ls = d->trans_a ? 1 : d->lda, a_ks = d->trans_a ? d->lda : 1;
    const int64_t b_ls = d->trans_b ? d->ldb : 1, b_ks = d->trans_b ? 1 : d->ldb;
    /* In pair mode a packed depth is a pair of halves, two per uint32. */
    int64_t jc, pc, ir, jr;
    if (i0 >= i1 || j0 >= j1) return;
    for (jc = j0; jc < j1; jc += job->nc) {
        const int64_t nb = MPT__MIN(job->nc, j1 - jc);
        for (pc = 0; pc < d->k; pc += job->kc) {
            const int64_t kb = MPT__MIN(job->kc, d->k - pc);
            const int64_t kstore = job->pairs ? (kb + 1) / 2 : kb; /* packed depth */
            const int first = pc == 0, last = pc + kb >= d->k;
            mpt__gemm_epi e;
            e.alpha = job->alpha;
            e.beta = first ? d->beta : 1.0f;
            e.load_c = !first || d->beta != 0;
            e.relu = last && d->activation == MPT_ACT_RELU;
            /* Pack the B block: panels of nr columns, the last one nr/2
               wide when that is enough. */
            for (jr = 0; jr < nb; jr += nr) {
                int w = nb - jr <= nr / 2 ? nr / 2 : nr;
                int lanes = (int)MPT__MIN(nr, nb - jr);
                mpt__gemm_pack(job, bpack + jr * kstore, w, d->b, (jc + jr) * b_ls + pc * b_ks,
                               b_ls, b_ks, lanes, kb);
            }
            for (ir = i0; ir < i1; ir += mr) {
                const int mb = (int)MPT__MIN(mr, i1 - ir);
                mpt__gemm_pack(job, apack, mr, d->a, ir * a_ls + pc * a_ks, a_ls, a_ks, mb, kb);
                for (jr = 0; jr < nb; jr += nr) {
                    int w = nb - jr <= nr / 2 ? nr / 2 : nr;
                    int n = (int)MPT__MIN(nr, nb - jr);
                    float *c = d->c + ir * d->ldc + jc + jr;
                    e.bias = last && d->bias ? d->bias + jc + jr : NULL;
                    job->kernel(kb, apack, bpack + jr * kstore, w, c, d->ldc, mb, n, &e);
                    if (last && d->activation != MPT_ACT_NONE && d->activation != MPT_ACT_RELU) {
                        int i;
                        for (i = 0; i < mb; i++)
                            mpt__activation_forward(d->activation, c + i * d->ldc, n);
                    }
                }
            }
        }
    }
}

/* Cuts C into tasks: at least one per thread when the product is big
   enough, in the grid that repacks least. Splitting the rows in tm parts
   packs B tm times; splitting the columns in tn parts packs A once per
   NC-block of each part. */
static void mpt__gemm_plan_tasks(mpt__gemm_job *job, int threads) {
    const mpt_gemm_desc *d = job->d;
    int64_t units_m = (d->m + job->mr - 1) / job->mr, units_n = (d->n + job->nr - 1) / job->nr;
    int64_t best_tm = 1, best_tn = 1, tm;
    double best = -1;
    int64_t fmas = d->m * d->n;
    int64_t target = threads;
    if (fmas > INT64_MAX / MPT__MAX(d->k, 1)) fmas = INT64_MAX;
    else fmas *= d->k;
    if (fmas < MPT__GEMM_SERIAL_FMAS || threads <= 1) target = 1;
    for (tm = 1; tm <= target; tm++) {
        int64_t tn = target / tm, rows, cols, nblocks;
        double cost;
        if (target % tm || tm > units_m || tn > units_n) continue;
        rows = (units_m + tm - 1) / tm;
        cols = ((units_n + tn - 1) / tn) * job->nr;
        nblocks = (cols + job->nc - 1) / job->nc;
        (void)rows;
        cost = (double)d->m * (double)d->k * (double)(tn * nblocks) +
               (double)d->n * (double)d->k * (double)tm; /* elements packed */
        if (best < 0 || cost < best) {
            best = cost;
            best_tm = tm;
            best_tn = tn;
        }
    }
    job->task_rows = ((units_m + best_tm - 1) / best_tm) * job->mr;
    job->task_cols = ((units_n + best_tn - 1) / best_tn) * job->nr;
    job->tasks_n = (d->n + job->task_cols - 1) / job->task_cols;
    if (job->tasks_n < 1) job->tasks_n = 1;
}

static void mpt__gemm(mpt_context *ctx, const mpt_gemm_desc *d) {
    mpt__gemm_job job;
    int64_t nkb, tasks_m;
    if (d->m <= 0 || d->n <= 0) return;
    if (d->k <= 0 || d->alpha_is_zero) {
        mpt__gemm_scale_c(d);
        return;
    }
    memset(&job, 0, sizeof job);
    job.d = d;
    job.ctx = ctx;
    job.dtype = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    job.alpha = d->alpha == 0 ? 1.0f : d->alpha;
    job.path = MPT__GEMM_SCALAR;
    job.kernel = mpt__gemm_kernel_scalar;
    job.mr = 4;
    job.nr = 8;
#if MPT__X86
    if ((ctx->cpu & MPT_CPU_AVX512_BF16) && job.dtype == MPT_BFLOAT16) {
        job.path = MPT__GEMM_AVX512_BF16;
        job.kernel = mpt__gemm_kernel_avx512_bf16;
        job.mr = 12;
        job.nr = 32;
        job.pairs = 1;
    } else if (ctx->cpu & MPT_CPU_AVX512) {
        job.path = MPT__GEMM_AVX512;
        job.kernel = mpt__gemm_kernel_avx512;
        job.mr = 12;
        job.nr = 32;
    } else if (ctx->cpu & MPT_CPU_AVX2) {
        job.path = MPT__GEMM_AVX2;
        job.kernel = mpt__gemm_kernel_avx2;
        job.mr = 6;
        job.nr = 16;
    }
#endif
    /* Equal depth blocks of at most KC, a multiple of 8 (so pairs never
       straddle blocks); this depends on K only. */
    nkb = (d->k + MPT__GEMM_KC - 1) / MPT__GEMM_KC;
    job.kc = ((d->k + nkb - 1) / nkb + 7) / 8 * 8;
    job.nc = MPT__GEMM_NC;
    mpt__gemm_plan_tasks(&job, ctx->num_threads);
    tasks_m = (d->m + job.task_rows - 1) / job.task_rows;
    mpt__parallel_for(ctx, tasks_m * job.tasks_n, mpt__gemm_task, &job);
}

/* -----------------------------------------------------------------------------
   The checked entry point
   ----------------------------------------------------------------------------- */

/* Checks one operand: stored rows × cols with leading dimension ld. */
static mpt_status mpt__gemm_check_operand(mpt_context *ctx, const char *name, const void *p,
                                          int trans, int64_t rows, int64_t cols, int64_t ld,
                                          const char *ld_name) {
    int64_t last;
    if (rows == 0 || cols == 0) return MPT_OK; /* not referenced */
    if (!p) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: %s is NULL", name);
    if (ld < cols)
        return mpt__fail(ctx, MPT_ERR_SHAPE,
                         "gemm: %s = %lld is less than the %lld columns of %s as stored "
                         "(%lld×%lld%s)",
                         ld_name, (long long)ld, (long long)cols, name, (long long)rows,
                         (long long)cols, trans ? ", transposed" : "");
    if (!mpt__mul_ok(rows - 1, ld, &last) || !mpt__add_ok(last, cols, &last))
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "gemm: %s (%lld×%lld, %s = %lld) overflows",
                         name, (long long)rows, (long long)cols, ld_name, (long long)ld);
    return MPT_OK;
}

MPTDEF mpt_status mpt_gemm(mpt_context *ctx, const mpt_gemm_desc *d) {
    mpt_dtype dt;
    int64_t fmas;
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!d) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: NULL descriptor");
    if (d->m < 0 || d->n < 0 || d->k < 0)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "gemm: m = %lld, n = %lld, k = %lld (negative)",
                         (long long)d->m, (long long)d->n, (long long)d->k);
    dt = d->ab_dtype ? d->ab_dtype : MPT_FLOAT32;
    if ((int)dt < 0 || dt >= MPT_DTYPE_COUNT_)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: unknown ab_dtype %d", (int)dt);
    if (!mpt_dtype_is_float(dt))
        return mpt__fail(ctx, MPT_ERR_DTYPE,
                         "gemm: ab_dtype %s (%d) is not float32, float16 or bfloat16",
                         mpt_dtype_name(dt), (int)dt);
    if (!mpt__activation_valid(d->activation))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: unknown activation %d",
                         (int)d->activation);
    if (d->activation == MPT_ACT_SOFTMAX)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "gemm: activation softmax (%d) is not elementwise; apply it after "
                         "the product", (int)d->activation);
    if (!mpt__mul_ok(d->m, d->n, &fmas))
        return mpt__fail(ctx, MPT_ERR_OVERFLOW, "gemm: m·n = %lld·%lld overflows",
                         (long long)d->m, (long long)d->n);
    if (d->m == 0 || d->n == 0) return MPT_OK;
    if (!d->c) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "gemm: c is NULL");
    if (d->ldc < d->n)
        return mpt__fail(ctx, MPT_ERR_SHAPE, "gemm: ldc = %lld is less than n = %lld",
                         (long long)d->ldc, (long long)d->n);
    MPT__CHECK(mpt__gemm_check_operand(ctx, "c", d->c, 0, d->m, d->n, d->ldc, "ldc"));
    if (!d->alpha_is_zero) {
        MPT__CHECK(mpt__gemm_check_operand(ctx, "a", d->a, d->trans_a,
                                           d->trans_a ? d->k : d->m, d->trans_a ? d->m : d->k,
                                           d->lda, "lda"));
        MPT__CHECK(mpt__gemm_check_operand(ctx, "b", d->b, d->trans_b,
                                           d->trans_b ? d->n : d->k, d->trans_b ? d->k : d->n,
                                           d->ldb, "ldb"));
    }
    mpt__gemm(ctx, d);
    return MPT_OK;
}

/* float <-> float16 / bfloat16.

   The scalar functions are the definition; every vector path (F16C, AVX2,
   AVX-512) gives the same bits for every input, which tests/test_convert.c
   checks over all 65,536 half and bfloat16 patterns and their rounding
   boundaries. Narrowing rounds to nearest even, keeps subnormals, and
   overflows to ±inf (float16: from |x| >= 65520, the midpoint between
   65504 and 2^16).

   NaN: the result is a quiet NaN of the same sign whose payload is the
   leading payload bits of the input (truncated when narrowing, zero-filled
   when widening), with the quiet bit set. That is exactly what
   vcvtps2ph / vcvtph2ps / vcvtneps2bf16 produce, so hardware and portable
   paths agree; the one exception is bfloat16 -> float, a plain shift, which
   keeps a signalling NaN signalling (it is exact, so no instruction is
   involved and nothing needs quieting). */

static uint32_t mpt__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float mpt__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

MPTDEF mpt_half mpt_float_to_half(float f) {
    uint32_t x = mpt__f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) /* NaN: quiet bit set, top 10 payload bits kept (as vcvtps2ph) */
        return (mpt_half)(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));
    if (absx >= 0x477ff000u) /* inf, or rounds to >= 65520: overflow to inf */
        return (mpt_half)(sign | 0x7c00u);
    if (absx < 0x38800000u) {
        /* Result is subnormal (or zero): shift the 24-bit significand right
           and round to nearest even on the bits shifted out. A carry out of
           0x3ff gives 0x400, the smallest normal, which is right. */
        uint32_t e = absx >> 23;
        uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* >= 14 */
        uint32_t q, rem, half;
        /* Below 2^-25 (half the smallest subnormal) everything rounds to 0;
           this also covers float subnormals (e == 0). */
        if (e < 102) return (mpt_half)sign;
        q = mant >> shift;
        rem = mant & ((1u << shift) - 1);
        half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (mpt_half)(sign | q);
    }
    {
        /* Normal: rebias the exponent, round the 13 dropped bits to nearest
           even; a carry into the exponent is the right answer. */
        uint32_t r = absx - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (mpt_half)(sign | (r >> 13));
    }
}

MPTDEF float mpt_half_to_float(mpt_half h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t m = (uint32_t)h & 0x3ffu;
    if (e == 0x1f) /* inf; NaN gets the quiet bit, as vcvtph2ps sets it */
        return mpt__bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e == 0) {
        /* Subnormal m · 2^-24: normalise so the leading 1 becomes implicit. */
        uint32_t exp = 113; /* float exponent of 2^-14, the half subnormal scale */
        if (m == 0) return mpt__bits_f32(sign);
        while (!(m & 0x400u)) {
            m <<= 1;
            exp--;
        }
        return mpt__bits_f32(sign | (exp << 23) | ((m & 0x3ffu) << 13));
    }
    return mpt__bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

MPTDEF mpt_bf16 mpt_float_to_bf16(float f) {
    uint32_t x = mpt__f32_bits(f);
    /* NaN: quiet bit set, top 7 payload bits kept (as vcvtneps2bf16). */
    if ((x & 0x7fffffffu) > 0x7f800000u) return (mpt_bf16)((x >> 16) | 0x40u);
    /* Round to nearest even on the low 16 bits; float subnormals round like
       any other value and a carry out of the largest finite gives inf. */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (mpt_bf16)(x >> 16);
}

MPTDEF float mpt_bf16_to_float(mpt_bf16 b) { return mpt__bits_f32((uint32_t)b << 16); }

/* A conversion kernel: n elements from src to dst. The dtypes are any two
   different float dtypes. */
typedef void (*mpt__convert_fn)(mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                                const void *src, int64_t n);

static void mpt__convert_scalar(mpt_dtype dst_dtype, void *dst, mpt_dtype src_dtype,
                                const void *src, int64_t n) {
    const float *sf = (const float *)src;
    const uint16_t *s16 = (const uint16_t *)src;
    float *df = (float *)dst;
    uint16_t *d16 = (uint16_t *)dst;
    int64_t i;
    /* One loop per pair so nothing is decided per element. */
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_half(sf[i]);
    } else if (src_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_bf16(sf[i]);
    } else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) df[i] = mpt_half_to_float(s16[i]);
    } else if (src_dtype == MPT_FLOAT16) {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_bf16(mpt_half_to_float(s16[i]));
    } else if (dst_dtype == MPT_FLOAT32) {
        for (i = 0; i < n; i++) df[i] = mpt_bf16_to_float(s16[i]);
    } else {
        for (i = 0; i < n; i++) d16[i] = mpt_float_to_half(mpt_bf16_to_float(s16[i]));
    }
}

#if MPT__X86
/* The vector kernels load a register of any float dtype as float32 and store
   float32 as any dtype; a float16 <-> bfloat16 conversion goes through
   float32, which is exact one way and rounds once the other, so it equals
   the scalar composition. One generic loop is forced inline into a kernel
   per dtype pair, so the dtype switches fold away at compile time. */
#define MPT__ALWAYS_INLINE __attribute__((always_inline)) inline
#if defined(__GNUC__) && !defined(__clang__)
/* GCC 12's AVX-512 headers start "undefined" vectors as `__Y = __Y`, which
   g++ reports as maybe-uninitialized once they are inlined here. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/* bfloat16 rounding in integer arithmetic, the scalar function lane by lane.
   (vcvtneps2bf16 is not used: it flushes float32 subnormal inputs to zero,
   which the scalar function does not.) */
static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE __m256i mpt__avx2_bf16_bits(__m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    /* |x| > inf as signed int32 compares: both sides are non-negative. */
    __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                        _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, qnan, is_nan);
}

static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE __m256 mpt__avx2_load(mpt_dtype t, const void *p) {
    switch (t) {
    case MPT_FLOAT16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case MPT_BFLOAT16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE void mpt__avx2_store(mpt_dtype t, void *p, __m256 v) {
    switch (t) {
    case MPT_FLOAT16:
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        break;
    case MPT_BFLOAT16: {
        /* Lanes hold values <= 0xffff, so the saturating pack is exact. */
        __m256i b = mpt__avx2_bf16_bits(v);
        _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b),
                                                        _mm256_extracti128_si256(b, 1)));
        break;
    }
    default: _mm256_storeu_ps((float *)p, v); break;
    }
}

/* 8 elements a step; the last n % 8 go through the scalar kernel. */
static MPT__TARGET_AVX2 MPT__ALWAYS_INLINE void mpt__avx2_loop(mpt_dtype dt, void *dst,
                                                               mpt_dtype st, const void *src,
                                                               int64_t n) {
    size_t ds = dt == MPT_FLOAT32 ? 4 : 2, ss = st == MPT_FLOAT32 ? 4 : 2;
    int64_t i;
    for (i = 0; i + 8 <= n; i += 8)
        mpt__avx2_store(dt, (char *)dst + (size_t)i * ds,
                        mpt__avx2_load(st, (const char *)src + (size_t)i * ss));
    if (i < n)
        mpt__convert_scalar(dt, (char *)dst + (size_t)i * ds, st,
                            (const char *)src + (size_t)i * ss, n - i);
}

/* Needs AVX2, and F16C for the pairs that involve float16. */
static MPT__TARGET_AVX2 void mpt__convert_avx2(mpt_dtype dst_dtype, void *dst,
                                              mpt_dtype src_dtype, const void *src,
                                              int64_t n) {
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16)
        mpt__avx2_loop(MPT_FLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_BFLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_FLOAT32, dst, MPT_FLOAT16, src, n);
    else if (src_dtype == MPT_FLOAT16)
        mpt__avx2_loop(MPT_BFLOAT16, dst, MPT_FLOAT16, src, n);
    else if (dst_dtype == MPT_FLOAT32)
        mpt__avx2_loop(MPT_FLOAT32, dst, MPT_BFLOAT16, src, n);
    else
        mpt__avx2_loop(MPT_FLOAT16, dst, MPT_BFLOAT16, src, n);
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE __m512i mpt__avx512_bf16_bits(__m512 v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, is_nan, qnan);
}

/* Masked loads and stores touch only the lanes in m, so the tail needs no
   scalar loop and never reads past the end. */
static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE __m512 mpt__avx512_load(mpt_dtype t, const void *p,
                                                                     __mmask16 m) {
    switch (t) {
    case MPT_FLOAT16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case MPT_BFLOAT16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    default: return _mm512_maskz_loadu_ps(m, p);
    }
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE void mpt__avx512_store(mpt_dtype t, void *p,
                                                                    __m512 v, __mmask16 m) {
    switch (t) {
    case MPT_FLOAT16:
        _mm256_mask_storeu_epi16(p, m,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
    case MPT_BFLOAT16: /* vpmovdw truncates each lane to its low 16 bits */
        _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(mpt__avx512_bf16_bits(v)));
        break;
    default: _mm512_mask_storeu_ps(p, m, v); break;
    }
}

static MPT__TARGET_AVX512 MPT__ALWAYS_INLINE void mpt__avx512_loop(mpt_dtype dt, void *dst,
                                                                   mpt_dtype st, const void *src,
                                                                   int64_t n) {
    size_t ds = dt == MPT_FLOAT32 ? 4 : 2, ss = st == MPT_FLOAT32 ? 4 : 2;
    int64_t i;
    for (i = 0; i + 16 <= n; i += 16)
        mpt__avx512_store(dt, (char *)dst + (size_t)i * ds,
                          mpt__avx512_load(st, (const char *)src + (size_t)i * ss, 0xffff),
                          0xffff);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (unsigned)(n - i)) - 1);
        mpt__avx512_store(dt, (char *)dst + (size_t)i * ds,
                          mpt__avx512_load(st, (const char *)src + (size_t)i * ss, m), m);
    }
}

static MPT__TARGET_AVX512 void mpt__convert_avx512(mpt_dtype dst_dtype, void *dst,
                                                  mpt_dtype src_dtype, const void *src,
                                                  int64_t n) {
    if (src_dtype == MPT_FLOAT32 && dst_dtype == MPT_FLOAT16)
        mpt__avx512_loop(MPT_FLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_BFLOAT16, dst, MPT_FLOAT32, src, n);
    else if (src_dtype == MPT_FLOAT16 && dst_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_FLOAT32, dst, MPT_FLOAT16, src, n);
    else if (src_dtype == MPT_FLOAT16)
        mpt__avx512_loop(MPT_BFLOAT16, dst, MPT_FLOAT16, src, n);
    else if (dst_dtype == MPT_FLOAT32)
        mpt__avx512_loop(MPT_FLOAT32, dst, MPT_BFLOAT16, src, n);
    else
        mpt__avx512_loop(MPT_FLOAT16, dst, MPT_BFLOAT16, src, n);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif /* MPT__X86 */

/* The fastest kernel the CPU bits allow for this dtype pair. */
static mpt__convert_fn mpt__convert_kernel(int cpu, mpt_dtype dst_dtype, mpt_dtype src_dtype) {
#if MPT__X86
    int f16 = dst_dtype == MPT_FLOAT16 || src_dtype == MPT_FLOAT16;
    /* The EVEX vcvtps2ph/vcvtph2ps belong to AVX-512F: no F16C bit needed. */
    if (cpu & MPT_CPU_AVX512) return mpt__convert_avx512;
    if ((cpu & MPT_CPU_AVX2) && (!f16 || (cpu & MPT_CPU_F16C))) return mpt__convert_avx2;
#else
    (void)cpu;
    (void)dst_dtype;
    (void)src_dtype;
#endif
    return mpt__convert_scalar;
}

/* Large conversions are cut into fixed chunks, one task each; every element
   is converted on its own, so the split never changes a result. One core
   converts ~10^10 elements/s while the data sit in cache, faster than
   waking the pool pays back, so only conversions that stream from memory
   (a few MB and up) are split. */
#define MPT__CONVERT_CHUNK ((int64_t)1 << 16)
#define MPT__CONVERT_PARALLEL_MIN ((int64_t)1 << 20)

typedef struct mpt__convert_job {
    mpt__convert_fn fn;
    mpt_dtype dst_dtype, src_dtype;
    char *dst;
    const char *src;
    int64_t n;
} mpt__convert_job;

static void mpt__convert_task(void *arg, int64_t task, int thread) {
    const mpt__convert_job *job = (const mpt__convert_job *)arg;
    int64_t begin = task * MPT__CONVERT_CHUNK;
    int64_t count = MPT__MIN(MPT__CONVERT_CHUNK, job->n - begin);
    (void)thread;
    job->fn(job->dst_dtype, job->dst + (size_t)begin * mpt_dtype_size(job->dst_dtype),
            job->src_dtype, job->src + (size_t)begin * mpt_dtype_size(job->src_dtype), count);
}

/* Unchecked conversion of n elements between float dtypes (ctx may be NULL:
   portable path, one thread). Bit-identical to the scalar functions on
   every path. dst and src must not overlap unless they are the same buffer
   of the same dtype. */
static void mpt__convert(const mpt_context *ctx, mpt_dtype dst_dtype, void *dst,
                         mpt_dtype src_dtype, const void *src, int64_t n) {
    mpt__convert_job job;
    if (n <= 0) return; /* also keeps NULL pointers away from memmove */
    if (dst_dtype == src_dtype) {
        if (dst != src) memmove(dst, src, (size_t)n * mpt_dtype_size(src_dtype));
        return;
    }
    job.fn = mpt__convert_kernel(ctx ? ctx->cpu : 0, dst_dtype, src_dtype);
    job.dst_dtype = dst_dtype;
    job.src_dtype = src_dtype;
    job.dst = (char *)dst;
    job.src = (const char *)src;
    job.n = n;
    if (ctx && n >= MPT__CONVERT_PARALLEL_MIN) {
        /* The pool is the only part of the context this touches. Called
           from inside a task (a layer's own parallel-for), this runs
           inline on that thread. */
        mpt__parallel_for((mpt_context *)ctx, (n + MPT__CONVERT_CHUNK - 1) / MPT__CONVERT_CHUNK,
                          mpt__convert_task, &job);
        return;
    }
    job.fn(dst_dtype, dst, src_dtype, src, n);
}

MPTDEF mpt_status mpt_convert(mpt_context *ctx, mpt_dtype dst_dtype, void *dst,
                              mpt_dtype src_dtype, const void *src, int64_t n) {
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!mpt_dtype_is_float(dst_dtype) || !mpt_dtype_is_float(src_dtype))
        return mpt__fail(ctx, MPT_ERR_DTYPE, "convert: %s -> %s is not between float dtypes",
                         mpt_dtype_name(src_dtype), mpt_dtype_name(dst_dtype));
    if (n < 0) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "convert: count %lld < 0", (long long)n);
    if (n > 0 && (!dst || !src))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "convert: NULL %s", dst ? "src" : "dst");
    if (n > 0 && dst_dtype != src_dtype) {
        /* Elements of different sizes: an overlap would read what was just written. */
        uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
        if (d < s + (uintptr_t)n * mpt_dtype_size(src_dtype) &&
            s < d + (uintptr_t)n * mpt_dtype_size(dst_dtype))
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "convert: dst and src overlap (%s -> %s)",
                             mpt_dtype_name(src_dtype), mpt_dtype_name(dst_dtype));
    }
    mpt__convert(ctx, dst_dtype, dst, src_dtype, src, n);
    return MPT_OK;
}

/* Products on llama.cpp-format GGUF blocks as they lie in the file (edge_runtime/model/gguf_kernel.py
   builds and loads it; gguf's numpy de-quantisation is the reference it is held to).

   Every type is read a tile at a time (up to 256 weights: one K-quant super-block or eight 32-weight
   blocks) into `buf`, the weights without their per-32 offset, plus `off`, one offset per 32 (Q4_1,
   Q5_1: the block's minimum; Q4_K, Q5_K: minus the sub-block's dmin * min). De-quantising adds the
   two with the same float operations, in the same order, as the reference (bit for bit; no offset
   means no add, which would turn -0 into +0). A product takes each tile once for up to eight rows
   of x: sum(buf * x) with fused multiply-adds, plus off[j] * (sum of x over sub-block j), the
   sums of x taken once per call. Only the product section is compiled with contraction into FMA;
   the de-quantisation keeps -ffp-contract=off, as the reference rounds every product. The
   opt-in int8-activation products are in gguf_native_q8.c, included in that section. */
#include <stdint.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#define TILE 256
#define MAX_ROWS 8

/* float16 -> float32 exactly as numpy widens it (an infinity or NaN keeps its payload). */
static inline float h2f(uint16_t h) {
    uint32_t em = h & 0x7fffu, bits;
    if (em >= 0x7c00u) {
        bits = 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {
        bits = (em << 13) + (112u << 23);
    } else {
        float f = (float)em * 0x1p-24f; /* a subnormal half is em * 2^-24: exact in float32 */
        memcpy(&bits, &f, 4);
    }
    bits |= (uint32_t)(h & 0x8000u) << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline float half_at(const uint8_t *p) { return h2f((uint16_t)(p[0] | (p[1] << 8))); }

static inline uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Bytes a block takes and weights it holds. */
static int block_shape(int type, int64_t *weights, int64_t *bytes) {
    switch (type) {
    case T_F32: *weights = 1; *bytes = 4; return 0;
    case T_F16: case T_BF16: *weights = 1; *bytes = 2; return 0;
    case T_Q4_0: *weights = 32; *bytes = 18; return 0;
    case T_Q4_1: *weights = 32; *bytes = 20; return 0;
    case T_Q5_0: *weights = 32; *bytes = 22; return 0;
    case T_Q5_1: *weights = 32; *bytes = 24; return 0;
    case T_Q8_0: *weights = 32; *bytes = 34; return 0;
    case T_Q4_K: *weights = 256; *bytes = 144; return 0;
    case T_Q5_K: *weights = 256; *bytes = 176; return 0;
    case T_Q6_K: *weights = 256; *bytes = 210; return 0;
    default: return -1;
    }
}

static int has_offset(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }

/* Q4_K and Q5_K: eight 6-bit scales and eight 6-bit minimums packed in 12 bytes. */
static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

#if defined(__AVX2__) && !defined(GG_GENERIC)
/* AVX2: levels are put together 16 or 32 bytes at a time, widened to int32 and converted eight at
   a time; each lane's arithmetic is the scalar one (scale times level, the level exact in float),
   so the values are the reference's. */
#include <immintrin.h>

/* dst[0..16) = d * (float(level) - bias) for the 16 byte levels of v. */
static inline void put16(float *dst, __m128i v, __m256 d, __m256 bias, int biased) {
    __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    if (biased) {
        a = _mm256_sub_ps(a, bias);
        b = _mm256_sub_ps(b, bias);
    }
    _mm256_storeu_ps(dst, _mm256_mul_ps(d, a));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(d, b));
}

static inline __m128i nib_lo(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(15)); }
static inline __m128i nib_hi(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15)); }

/* 16 in byte l of the result where bit l of the 32 bits is set, else 0. */
static inline __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
}

static void dec_q4_0(const uint8_t *restrict b, float *restrict buf) {
    const __m256 d = _mm256_set1_ps(half_at(b)), bias = _mm256_set1_ps(8.0f);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
    put16(buf, nib_lo(q), d, bias, 1);
    put16(buf + 16, nib_hi(q), d, bias, 1);
}

static void dec_q4_1(const uint8_t *restrict b, float *restrict buf, float *restrict off) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    *off = half_at(b + 2);
    put16(buf, nib_lo(q), d, d, 0);
    put16(buf + 16, nib_hi(q), d, d, 0);
}

static void dec_q5(const uint8_t *restrict b, float *restrict buf, int with_min, float *restrict off) {
    const __m256 d = _mm256_set1_ps(half_at(b)), bias = _mm256_set1_ps(16.0f);
    const uint8_t *h = b + (with_min ? 4 : 2);
    const __m256i hb = bit_bytes(u32_at(h));
    const __m128i q = _mm_loadu_si128((const __m128i *)(h + 4));
    if (with_min) *off = half_at(b + 2);
    put16(buf, _mm_or_si128(nib_lo(q), _mm256_castsi256_si128(hb)), d, bias, !with_min);
    put16(buf + 16, _mm_or_si128(nib_hi(q), _mm256_extracti128_si256(hb, 1)), d, bias, !with_min);
}

static void dec_q8_0(const uint8_t *restrict b, float *restrict buf) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int e = 0; e < 4; e++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * e));
        _mm256_storeu_ps(buf + 8 * e, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
}

static void dec_q45_k(const uint8_t *restrict b, float *restrict buf, float *restrict off, int five) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t *q = b + (five ? 48 : 16);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), sixteen = _mm256_set1_epi8(16);
    for (int c = 0; c < 4; c++) {
        const __m256 d0 = _mm256_set1_ps(d * (float)sc[2 * c]), d1 = _mm256_set1_ps(d * (float)sc[2 * c + 1]);
        const __m256i qq = _mm256_loadu_si256((const __m256i *)(q + 32 * c)), m4 = _mm256_set1_epi8(15);
        __m256i lo = _mm256_and_si256(qq, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qq, 4), m4);
        if (five) {
            const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c))), b1 = _mm256_set1_epi8((char)(2 << (2 * c)));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        float *w = buf + 64 * c;
        put16(w, _mm256_castsi256_si128(lo), d0, d0, 0);
        put16(w + 16, _mm256_extracti128_si256(lo, 1), d0, d0, 0);
        put16(w + 32, _mm256_castsi256_si128(hi), d1, d1, 0);
        put16(w + 48, _mm256_extracti128_si256(hi, 1), d1, d1, 0);
        off[2 * c] = -(dmin * (float)mn[2 * c]);
        off[2 * c + 1] = -(dmin * (float)mn[2 * c + 1]);
    }
}

static void dec_q6_k(const uint8_t *restrict b, float *restrict buf) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    const __m256 bias = _mm256_set1_ps(32.0f);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int half = 0; half < 2; half++) {
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        for (int i = 0; i < 4; i++) {
            const int g = 4 * half + i; /* the 32 weights g*32.. */
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (i & 1)));
            const __m256i l4 = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (i >> 1))), m4);
            const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * i)), m2);
            const __m256i lev = _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4));
            put16(buf + 32 * g, _mm256_castsi256_si128(lev), _mm256_set1_ps(d * (float)sc[2 * g]), bias, 1);
            put16(buf + 32 * g + 16, _mm256_extracti128_si256(lev, 1), _mm256_set1_ps(d * (float)sc[2 * g + 1]),
                  bias, 1);
        }
    }
}

#else
/* Elsewhere (NEON, or no AVX2): plain loops, which the compiler vectorises where it can. */
static void dec_q4_0(const uint8_t *b, float *buf) {
    const float d = half_at(b);
    const uint8_t *q = b + 2;
    for (int l = 0; l < 16; l++) {
        buf[l] = d * (float)((int)(q[l] & 15) - 8);
        buf[l + 16] = d * (float)((int)(q[l] >> 4) - 8);
    }
}

static void dec_q4_1(const uint8_t *b, float *buf, float *off) {
    const float d = half_at(b);
    const uint8_t *q = b + 4;
    *off = half_at(b + 2);
    for (int l = 0; l < 16; l++) {
        buf[l] = d * (float)(q[l] & 15);
        buf[l + 16] = d * (float)(q[l] >> 4);
    }
}

static void dec_q5(const uint8_t *b, float *buf, int with_min, float *off) {
    const float d = half_at(b);
    const uint8_t *h = b + (with_min ? 4 : 2), *q = h + 4;
    const uint32_t qh = u32_at(h);
    const int zero = with_min ? 0 : 16;
    if (with_min) *off = half_at(b + 2);
    for (int l = 0; l < 16; l++) {
        buf[l] = d * (float)((int)((q[l] & 15) | (((qh >> l) & 1) << 4)) - zero);
        buf[l + 16] = d * (float)((int)((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - zero);
    }
}

static void dec_q8_0(const uint8_t *b, float *buf) {
    const float d = half_at(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) buf[l] = (float)q[l] * d;
}

static void dec_q45_k(const uint8_t *b, float *buf, float *off, int five) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *q = b + (five ? 48 : 16);
    for (int c = 0; c < 4; c++) {
        const float d0 = d * (float)sc[2 * c], d1 = d * (float)sc[2 * c + 1];
        const uint8_t *qq = q + 32 * c;
        float *w = buf + 64 * c;
        if (five) {
            for (int l = 0; l < 32; l++) {
                w[l] = d0 * (float)((qq[l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4));
                w[l + 32] = d1 * (float)((qq[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
        } else {
            for (int l = 0; l < 32; l++) {
                w[l] = d0 * (float)(qq[l] & 15);
                w[l + 32] = d1 * (float)(qq[l] >> 4);
            }
        }
        off[2 * c] = -(dmin * (float)mn[2 * c]);
        off[2 * c + 1] = -(dmin * (float)mn[2 * c + 1]);
    }
}

static void dec_q6_k(const uint8_t *b, float *buf) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    for (int half = 0; half < 2; half++) {
        for (int i = 0; i < 4; i++) {
            const int g = 4 * half + i; /* the 32 weights g*32.. */
            const uint8_t *lo = ql + 64 * half + 32 * (i & 1), *hi = qh + 32 * half;
            const int shift = 4 * (i >> 1);
            const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
            float *w = buf + 32 * g;
            for (int l = 0; l < 16; l++)
                w[l] = s0 * (float)((int)(((lo[l] >> shift) & 15) | (((hi[l] >> (2 * i)) & 3) << 4)) - 32);
            for (int l = 16; l < 32; l++)
                w[l] = s1 * (float)((int)(((lo[l] >> shift) & 15) | (((hi[l] >> (2 * i)) & 3) << 4)) - 32);
        }
    }
}

#endif

/* Weights t0 .. t0+n of a row (n <= TILE; a multiple of the block, and of 32 unless the type is a
   float) into buf, with one offset per 32 into off where the type has one. */
static void decode_tile(int type, const uint8_t *restrict row, int64_t t0, int64_t n, float *restrict buf,
                        float *restrict off) {
    switch (type) {
    case T_F32:
        memcpy(buf, row + 4 * t0, (size_t)n * 4);
        return;
    case T_F16:
        for (int64_t i = 0; i < n; i++) buf[i] = half_at(row + 2 * (t0 + i));
        return;
    case T_BF16:
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *p = row + 2 * (t0 + i);
            uint32_t bits = ((uint32_t)p[0] << 16) | ((uint32_t)p[1] << 24);
            memcpy(buf + i, &bits, 4);
        }
        return;
    case T_Q4_K: case T_Q5_K:
        dec_q45_k(row + (t0 / 256) * (type == T_Q4_K ? 144 : 176), buf, off, type == T_Q5_K);
        return;
    case T_Q6_K:
        dec_q6_k(row + (t0 / 256) * 210, buf);
        return;
    default:
        break;
    }
    for (int64_t j = 0; j < n / 32; j++) {
        const int64_t blk = t0 / 32 + j;
        float *w = buf + 32 * j;
        switch (type) {
        case T_Q4_0: dec_q4_0(row + 18 * blk, w); break;
        case T_Q4_1: dec_q4_1(row + 20 * blk, w, off + j); break;
        case T_Q5_0: dec_q5(row + 22 * blk, w, 0, off + j); break;
        case T_Q5_1: dec_q5(row + 24 * blk, w, 1, off + j); break;
        case T_Q8_0: dec_q8_0(row + 34 * blk, w); break;
        default: break;
        }
    }
}

/* out[r, :] = row r de-quantised, for `rows` rows of width k; -1 for a type not handled. */
int gg_dequant(int type, const uint8_t *raw, int64_t rows, int64_t k, float *out) {
    int64_t bw, bb;
    if (block_shape(type, &bw, &bb)) return -1;
    const int64_t rb = k / bw * bb;
    float buf[TILE], off[TILE / 32];
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * rb;
        float *o = out + r * k;
        for (int64_t t0 = 0; t0 < k; t0 += TILE) {
            const int64_t n = k - t0 < TILE ? k - t0 : TILE;
            if (type == T_F32 || type == T_F16 || type == T_BF16 || !has_offset(type)) {
                decode_tile(type, row, t0, n, o + t0, off);
                continue;
            }
            decode_tile(type, row, t0, n, buf, off);
            for (int64_t i = 0; i < n; i++) o[t0 + i] = buf[i] + off[i / 32];
        }
    }
    return 0;
}

/* --- products: contraction into FMA from here on ------------------------------------------- */
#if defined(__clang__)
#define CONTRACT _Pragma("clang fp contract(fast)")
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#define CONTRACT
#endif

/* xs[r, j] = the sum of x[r, 32j .. 32j+32) (the factor of each per-32 offset). */
void gg_xsums(const float *x, int64_t m, int64_t k, float *xs) {
    CONTRACT
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 32; j++) {
            float s = 0.0f;
            for (int l = 0; l < 32; l++) s += x[r * k + 32 * j + l];
            xs[r * (k / 32) + j] = s;
        }
}

typedef float f32x8v __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));

/* out[r * ldo + i] = x[r, :] . W[i, :] for r < m (at most MAX_ROWS) and the n weight rows at raw.
   Inlined once per row count: each 8 de-quantised weights are loaded once and meet every row of x,
   whose accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_f32(int type, const uint8_t *raw, int64_t rb, int64_t n,
                                                           int64_t k, const float *x, const int64_t m,
                                                           const float *xs, float *out, int64_t ldo) {
    CONTRACT
    float buf[TILE] __attribute__((aligned(64)));
    float off[TILE / 32];
    const int offs = has_offset(type);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        f32x8v acc[MAX_ROWS];
        float tail[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) {
            acc[r] = (f32x8v){0};
            tail[r] = 0.0f;
        }
        for (int64_t t0 = 0; t0 < k; t0 += TILE) {
            const int64_t len = k - t0 < TILE ? k - t0 : TILE, even = len & ~(int64_t)7;
            decode_tile(type, row, t0, len, buf, off);
            for (int64_t l = 0; l < even; l += 8) {
                const f32x8v w = *(const f32x8v *)(buf + l);
                for (int64_t r = 0; r < m; r++) acc[r] += w * *(const f32x8u *)(x + r * k + t0 + l);
            }
            for (int64_t r = 0; r < m; r++) {
                const float *xr = x + r * k + t0;
                float t = tail[r];
                for (int64_t l = even; l < len; l++) t += buf[l] * xr[l];
                if (offs) {
                    const float *xsr = xs + r * (k / 32) + t0 / 32;
                    for (int64_t j = 0; j < len / 32; j++) t += off[j] * xsr[j];
                }
                tail[r] = t;
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float s = 0.0f;
            for (int e = 0; e < 8; e++) s += acc[r][e];
            out[r * ldo + i] = s + tail[r];
        }
    }
}

static void rows_product(int type, const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const float *x, int64_t m,
                         const float *xs, float *out, int64_t ldo) {
    switch (m) {
    case 1: rows_f32(type, raw, rb, n, k, x, 1, xs, out, ldo); break;
    case 2: rows_f32(type, raw, rb, n, k, x, 2, xs, out, ldo); break;
    case 3: rows_f32(type, raw, rb, n, k, x, 3, xs, out, ldo); break;
    case 4: rows_f32(type, raw, rb, n, k, x, 4, xs, out, ldo); break;
    case 8: rows_f32(type, raw, rb, n, k, x, 8, xs, out, ldo); break;
    default: rows_f32(type, raw, rb, n, k, x, m, xs, out, ldo); break;
    }
}

/* out[r * ldo + i] = x[r, :] . W[i, :] for every row r < m of x (float32 [m, k]) and the n weight
   rows at raw; xs from gg_xsums (only read for the types with offsets). -1 for a type not handled. */
#if defined(__AVX2__) && !defined(GG_GENERIC)
static void row1_levels(int type, const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const float *x,
                        const float *xs, float *out);
#endif

int gg_matmul(int type, const uint8_t *raw, int64_t n, int64_t k, const float *x, int64_t m, const float *xs,
              float *out, int64_t ldo) {
    int64_t bw, bb;
    if (block_shape(type, &bw, &bb)) return -1;
    const int64_t rb = k / bw * bb;
#if defined(__AVX2__) && !defined(GG_GENERIC)
    if (m == 1 && bw > 1) {
        row1_levels(type, raw, rb, n, k, x, xs, out);
        return 0;
    }
#endif
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int64_t mm = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
        rows_product(type, raw, rb, n, k, x + r0 * k, mm, xs ? xs + r0 * (k / 32) : xs, out + r0 * ldo, ldo);
    }
    return 0;
}

#include "gguf_native_q8.c" /* the int8-activation products */
#include "gguf_native_k8.c" /* q8_K-x decode products on Q4_K/Q5_K/Q6_K, Q8_0 */
#include "gguf_native_pool.c" /* the thread pool and the calls through it */
#include "gguf_native_fused.c" /* the fused serving layer's grouped calls */
#include "gguf_native_lora.c" /* the serving rows' LoRA terms */
#include "gguf_native_stack.c" /* every layer of a decode step in one call */

#if !defined(__clang__)
#pragma GCC pop_options
#endif

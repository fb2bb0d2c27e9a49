/* The int8-activation products and the integer block levels they read (part of gguf_native.c,
   which includes it inside its product section: contraction on, its helpers and types in scope). */

/* --- int8 activations (opt-in) -------------------------------------------------------------
   As llama.cpp's quantised dot products: each 32 values of a row of x become int8 levels qx and one
   scale dx (round(x / dx), dx = max |x| / 127), each weight block its integer levels and scales,
   and a 32-weight dot product is an exact int32 sum, times the two scales. The per-32 offsets of
   Q4_1/Q5_1/Q4_K/Q5_K still meet the float sums of x. The only error beyond float summation order
   is x's rounding: |x - dx qx| <= dx / 2 per value. */

/* qx[r, :], dx[r, k/32] for the m rows of x (float32 [m, k]). */
void gg_quantize_x(const float *x, int64_t m, int64_t k, int8_t *qx, float *dx) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 32; j++) {
            const float *v = x + r * k + 32 * j;
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) amax = v[l] > amax ? v[l] : (-v[l] > amax ? -v[l] : amax);
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            dx[r * (k / 32) + j] = d;
            for (int l = 0; l < 32; l++) {
                float q = v[l] * id;
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                qx[r * k + 32 * j + l] = (int8_t)(q >= 0.0f ? (int)(q + 0.5f) : -(int)(0.5f - q));
            }
        }
}

/* A tile's integer levels (signed: the level less the block's zero), its scales (Q6_K: one per 16
   weights; every other type one per 32) and one offset per 32 where the type has one. */
static void levels_tile_loops(int type, const uint8_t *restrict row, int64_t t0, int64_t n, int8_t *restrict lev,
                        float *restrict sc16, float *restrict off) {
    if (type == T_Q4_K || type == T_Q5_K) {
        const int five = type == T_Q5_K;
        const uint8_t *b = row + (t0 / 256) * (five ? 176 : 144);
        const float d = half_at(b), dmin = half_at(b + 2);
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *q = b + (five ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                int lo = q[32 * c + l] & 15, hi = q[32 * c + l] >> 4;
                if (five) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                lev[64 * c + l] = (int8_t)lo;
                lev[64 * c + 32 + l] = (int8_t)hi;
            }
        }
        for (int j = 0; j < 8; j++) {
            sc16[j] = d * (float)sc[j];
            off[j] = -(dmin * (float)mn[j]);
        }
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *b = row + (t0 / 256) * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++)
            for (int i = 0; i < 4; i++) {
                const uint8_t *lo = b + 64 * half + 32 * (i & 1), *hi = b + 128 + 32 * half;
                int8_t *w = lev + 32 * (4 * half + i);
                for (int l = 0; l < 32; l++)
                    w[l] = (int8_t)((int)(((lo[l] >> (4 * (i >> 1))) & 15) | (((hi[l] >> (2 * i)) & 3) << 4)) - 32);
            }
        for (int g = 0; g < 16; g++) sc16[g] = d * (float)sc[g];
        return;
    }
    for (int64_t j = 0; j < n / 32; j++) {
        const int64_t blk = t0 / 32 + j;
        int8_t *w = lev + 32 * j;
        const uint8_t *b;
        float d;
        switch (type) {
        case T_Q4_0: case T_Q4_1: {
            const int with_min = type == T_Q4_1;
            b = row + (with_min ? 20 : 18) * blk;
            const uint8_t *q = b + (with_min ? 4 : 2);
            const int zero = with_min ? 0 : 8;
            for (int l = 0; l < 16; l++) {
                w[l] = (int8_t)((q[l] & 15) - zero);
                w[l + 16] = (int8_t)((q[l] >> 4) - zero);
            }
            if (with_min) off[j] = half_at(b + 2);
            break;
        }
        case T_Q5_0: case T_Q5_1: {
            const int with_min = type == T_Q5_1;
            b = row + (with_min ? 24 : 22) * blk;
            const uint8_t *h = b + (with_min ? 4 : 2), *q = h + 4;
            const uint32_t qh = u32_at(h);
            const int zero = with_min ? 0 : 16;
            for (int l = 0; l < 16; l++) {
                w[l] = (int8_t)(((q[l] & 15) | (((qh >> l) & 1) << 4)) - zero);
                w[l + 16] = (int8_t)(((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - zero);
            }
            if (with_min) off[j] = half_at(b + 2);
            break;
        }
        default: /* T_Q8_0 */
            b = row + 34 * blk;
            memcpy(w, b + 2, 32);
            break;
        }
        d = half_at(b);
        sc16[j] = d;
    }
}

#if defined(__AVX2__) && !defined(GG_GENERIC)
static inline void levels_store(int8_t *dst, __m256i v) { _mm256_store_si256((__m256i *)dst, v); }

static void levels_tile(int type, const uint8_t *restrict row, int64_t t0, int64_t n, int8_t *restrict lev,
                        float *restrict sc16, float *restrict off) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == T_Q4_K || type == T_Q5_K) {
        const int five = type == T_Q5_K;
        const uint8_t *b = row + (t0 / 256) * (five ? 176 : 144);
        const float d = half_at(b), dmin = half_at(b + 2);
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *q = b + (five ? 48 : 16);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), sixteen = _mm256_set1_epi8(16);
        for (int c = 0; c < 4; c++) {
            const __m256i qq = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i lo = _mm256_and_si256(qq, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qq, 4), m4);
            if (five) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c))), b1 = _mm256_set1_epi8((char)(2 << (2 * c)));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
            }
            levels_store(lev + 64 * c, lo);
            levels_store(lev + 64 * c + 32, hi);
        }
        const __m256 vs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
        const __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
        _mm256_storeu_ps(sc16, _mm256_mul_ps(_mm256_set1_ps(d), vs));
        _mm256_storeu_ps(off, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(dmin), vm)));
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *b = row + (t0 / 256) * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        const __m256i m2 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
            const __m256i lo0 = _mm256_loadu_si256((const __m256i *)(b + 64 * half));
            const __m256i lo1 = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32));
            const __m256i l4[4] = {_mm256_and_si256(lo0, m4), _mm256_and_si256(lo1, m4),
                                   _mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4)};
            const __m256i h2[4] = {_mm256_and_si256(hi, m2), _mm256_and_si256(_mm256_srli_epi16(hi, 2), m2),
                                   _mm256_and_si256(_mm256_srli_epi16(hi, 4), m2),
                                   _mm256_and_si256(_mm256_srli_epi16(hi, 6), m2)};
            for (int i = 0; i < 4; i++)
                levels_store(lev + 32 * (4 * half + i),
                             _mm256_sub_epi8(_mm256_or_si256(l4[i], _mm256_slli_epi16(h2[i], 4)), m32));
        }
        const __m128i sb = _mm_loadu_si128((const __m128i *)sc);
        _mm256_storeu_ps(sc16, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sb))));
        _mm256_storeu_ps(sc16 + 8, _mm256_mul_ps(_mm256_set1_ps(d),
                                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sb, 8)))));
        return;
    }
    if (type == T_Q4_0 || type == T_Q4_1) {
        const int with_min = type == T_Q4_1;
        const int64_t size = with_min ? 20 : 18;
        const __m128i zero = _mm_set1_epi8(with_min ? 0 : 8), m4s = _mm_set1_epi8(15);
        for (int64_t j = 0; j < n / 32; j++) {
            const uint8_t *b = row + size * (t0 / 32 + j);
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + (with_min ? 4 : 2)));
            const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4s), zero);
            const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4s), zero);
            levels_store(lev + 32 * j, _mm256_set_m128i(hi, lo));
            sc16[j] = half_at(b);
            if (with_min) off[j] = half_at(b + 2);
        }
        return;
    }
    if (type == T_Q8_0) {
        for (int64_t j = 0; j < n / 32; j++) {
            const uint8_t *b = row + 34 * (t0 / 32 + j);
            levels_store(lev + 32 * j, _mm256_loadu_si256((const __m256i *)(b + 2)));
            sc16[j] = half_at(b);
        }
        return;
    }
    levels_tile_loops(type, row, t0, n, lev, sc16, off);
}
#else
#define levels_tile levels_tile_loops
#endif

#if defined(__AVX2__) && !defined(GG_GENERIC)
/* int32 lane i = sum of a[4i..4i+4) * b[4i..4i+4) for unsigned a (below 129) and signed b. */
static inline __m256i dot4(__m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(GG_GENERIC)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(GG_GENERIC)
#define GG_AVX512 1
/* Lane l of a 16-lane product covers weights 4l..4l+3 of 64: the per-16 scale of lane l is S[l/4 + 4p]
   for the p-th 64 of a tile (S: 16 scales per tile), or S[l/8 + 2p] with 8 per-32 scales. */
static inline __m512i lane_ids(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

static inline __m512i lanes_of(int per16, int p) {
    return per16 ? _mm512_add_epi32(_mm512_set1_epi32(4 * p), _mm512_srli_epi32(lane_ids(), 2))
                 : _mm512_add_epi32(_mm512_set1_epi32(2 * p), _mm512_srli_epi32(lane_ids(), 3));
}
#endif

/* Inlined once per row count (1..8) so that each row's accumulator stays in a register. */
static inline __attribute__((always_inline)) void rows_q8(int type, const uint8_t *raw, int64_t rb, int64_t n,
                                                          int64_t k, const int8_t *qx, const float *dx, const int64_t m,
                                                          const float *xs, float *out, int64_t ldo) {
    CONTRACT
    int8_t lev[TILE] __attribute__((aligned(64)));
    float sc16[TILE / 16], off[TILE / 32];
    const int offs = has_offset(type);
    const int64_t kb = k / 32;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        float tail[MAX_ROWS];
#if defined(__AVX2__) && !defined(GG_GENERIC)
        __m256 acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
#if defined(GG_AVX512)
        __m512 acc5[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc5[r] = _mm512_setzero_ps();
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(GG_GENERIC)
        float32x4_t acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = vdupq_n_f32(0.0f);
#endif
        for (int64_t r = 0; r < m; r++) tail[r] = 0.0f;
        for (int64_t t0 = 0; t0 < k; t0 += TILE) {
            const int64_t len = k - t0 < TILE ? k - t0 : TILE;
            levels_tile(type, row, t0, len, lev, sc16, off);
#if defined(GG_AVX512)
            if (len == TILE) { /* 64 weights a step: four 512-bit dot products per tile */
                const int per16 = type == T_Q6_K;
                __m512i aw[4];
                __mmask64 neg[4];
                for (int p = 0; p < 4; p++) {
                    const __m512i w = _mm512_load_si512((const void *)(lev + 64 * p));
                    neg[p] = offs ? 0 : _mm512_movepi8_mask(w);
                    aw[p] = offs ? w : _mm512_abs_epi8(w);
                }
                const __m512 sc = per16 ? _mm512_loadu_ps(sc16) : _mm512_castps256_ps512(_mm256_loadu_ps(sc16));
                for (int64_t r = 0; r < m; r++) {
                    const float *d8 = dx + r * kb + t0 / 32;
                    /* each scale times its 32 values' dx: per 16, dx repeats for the pair */
                    const __m512 d = _mm512_castps256_ps512(_mm256_loadu_ps(d8));
                    const __m512 dxs = per16 ? _mm512_permutexvar_ps(_mm512_srli_epi32(lane_ids(), 1), d) : d;
                    const __m512 s = _mm512_mul_ps(sc, dxs);
                    const int8_t *xr = qx + r * k + t0;
                    for (int p = 0; p < 4; p++) {
                        __m512i xq = _mm512_loadu_si512((const void *)(xr + 64 * p));
                        if (!offs) xq = _mm512_mask_sub_epi8(xq, neg[p], _mm512_setzero_si512(), xq);
                        const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[p], xq));
                        acc5[r] = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(lanes_of(per16, p), s), acc5[r]);
                    }
                }
            } else
#endif
            for (int64_t j = 0; j < len / 32; j++) {
                const int64_t b = t0 / 32 + j;
#if defined(__AVX2__) && !defined(GG_GENERIC)
                /* levels >= 0 (the types with offsets) meet x as they are; signed ones as |w| and
                   x with w's sign */
                const __m256i w = _mm256_load_si256((const __m256i *)(lev + 32 * j));
                const __m256i aw = offs ? w : _mm256_sign_epi8(w, w);
                if (type == T_Q6_K) { /* a scale per 16: lanes 0-3 hold the first 16 weights' sums */
                    const __m256 scv = _mm256_set_m128(_mm_set1_ps(sc16[2 * j + 1]), _mm_set1_ps(sc16[2 * j]));
                    for (int64_t r = 0; r < m; r++) {
                        const __m256i xr = _mm256_loadu_si256((const __m256i *)(qx + r * k + 32 * b));
                        const __m256 f = _mm256_cvtepi32_ps(dot4(aw, _mm256_sign_epi8(xr, w)));
                        acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(scv, _mm256_set1_ps(dx[r * kb + b])), acc[r]);
                    }
                    continue;
                }
                for (int64_t r = 0; r < m; r++) {
                    const __m256i xr = _mm256_loadu_si256((const __m256i *)(qx + r * k + 32 * b));
                    const __m256 f = _mm256_cvtepi32_ps(dot4(aw, offs ? xr : _mm256_sign_epi8(xr, w)));
                    acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(sc16[j] * dx[r * kb + b]), acc[r]);
                }
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(GG_GENERIC)
                /* NEON without dotprod (the compiler's default target): widening products, pairwise sums */
                const int8x16_t w0 = vld1q_s8(lev + 32 * j), w1 = vld1q_s8(lev + 32 * j + 16);
                for (int64_t r = 0; r < m; r++) {
                    const int8_t *q = qx + r * k + 32 * b;
                    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
                    const int32x4_t s0 = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(q0))),
                                                     vmull_high_s8(w0, q0));
                    const int32x4_t s1 = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w1), vget_low_s8(q1))),
                                                     vmull_high_s8(w1, q1));
                    const float d = dx[r * kb + b];
                    if (type == T_Q6_K) {
                        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(s0), sc16[2 * j] * d);
                        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(s1), sc16[2 * j + 1] * d);
                    } else {
                        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(vaddq_s32(s0, s1)), sc16[j] * d);
                    }
                }
#else
                const int8_t *w = lev + 32 * j;
                for (int64_t r = 0; r < m; r++) {
                    const int8_t *q = qx + r * k + 32 * b;
                    int32_t s0 = 0, s1 = 0;
                    for (int l = 0; l < 16; l++) {
                        s0 += (int32_t)w[l] * q[l];
                        s1 += (int32_t)w[l + 16] * q[l + 16];
                    }
                    tail[r] += (type == T_Q6_K ? (float)s0 * sc16[2 * j] + (float)s1 * sc16[2 * j + 1]
                                               : (float)(s0 + s1) * sc16[j]) * dx[r * kb + b];
                }
#endif
            }
            if (offs) {
#if defined(__AVX2__) && !defined(GG_GENERIC)
                if (len == TILE) { /* eight offsets against eight sums of x in one FMA */
                    const __m256 o = _mm256_loadu_ps(off);
                    for (int64_t r = 0; r < m; r++)
                        acc[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + r * kb + t0 / 32), acc[r]);
                    continue;
                }
#endif
                for (int64_t r = 0; r < m; r++)
                    for (int64_t j = 0; j < len / 32; j++) tail[r] += off[j] * xs[r * kb + t0 / 32 + j];
            }
        }
        for (int64_t r = 0; r < m; r++) {
#if defined(__AVX2__) && !defined(GG_GENERIC)
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            tail[r] += _mm_cvtss_f32(h);
#if defined(GG_AVX512)
            tail[r] += _mm512_reduce_add_ps(acc5[r]);
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(GG_GENERIC)
            tail[r] += vaddvq_f32(acc[r]);
#endif
            out[r * ldo + i] = tail[r];
        }
    }
}

static void rows_product_q8(int type, const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const int8_t *qx,
                            const float *dx, int64_t m, const float *xs, float *out, int64_t ldo) {
    switch (m) {
    case 1: rows_q8(type, raw, rb, n, k, qx, dx, 1, xs, out, ldo); break;
    case 2: rows_q8(type, raw, rb, n, k, qx, dx, 2, xs, out, ldo); break;
    case 3: rows_q8(type, raw, rb, n, k, qx, dx, 3, xs, out, ldo); break;
    case 4: rows_q8(type, raw, rb, n, k, qx, dx, 4, xs, out, ldo); break;
    case 8: rows_q8(type, raw, rb, n, k, qx, dx, 8, xs, out, ldo); break;
    default: rows_q8(type, raw, rb, n, k, qx, dx, m, xs, out, ldo); break;
    }
}

#if defined(__AVX2__) && !defined(GG_GENERIC)
/* One row of x against block weights (a decode step): each 32 integer levels widen to float and
   meet x, and the block's scale multiplies their sum once, instead of every weight being scaled
   into a float tile and read back (about half the instructions per weight). */
static void row1_levels(int type, const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const float *x,
                        const float *xs, float *out) {
    int8_t lev[TILE] __attribute__((aligned(32)));
    float sc16[TILE / 16], off[TILE / 32];
    const int offs = has_offset(type);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        __m256 acc = _mm256_setzero_ps();
        float tail = 0.0f;
        for (int64_t t0 = 0; t0 < k; t0 += TILE) {
            const int64_t len = k - t0 < TILE ? k - t0 : TILE;
            levels_tile(type, row, t0, len, lev, sc16, off);
            for (int64_t j = 0; j < len / 32; j++) {
                const int8_t *w = lev + 32 * j;
                const float *xr = x + t0 + 32 * j;
                __m256 p[4];
                for (int e = 0; e < 4; e++) {
                    const __m128i q = _mm_loadl_epi64((const __m128i *)(w + 8 * e));
                    p[e] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(xr + 8 * e));
                }
                if (type == T_Q6_K) {
                    acc = _mm256_fmadd_ps(_mm256_add_ps(p[0], p[1]), _mm256_set1_ps(sc16[2 * j]), acc);
                    acc = _mm256_fmadd_ps(_mm256_add_ps(p[2], p[3]), _mm256_set1_ps(sc16[2 * j + 1]), acc);
                } else {
                    acc = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3])),
                                          _mm256_set1_ps(sc16[j]), acc);
                }
            }
            if (offs) {
                if (len == TILE) {
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(off), _mm256_loadu_ps(xs + t0 / 32), acc);
                } else {
                    for (int64_t j = 0; j < len / 32; j++) tail += off[j] * xs[t0 / 32 + j];
                }
            }
        }
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[i] = _mm_cvtss_f32(h) + tail;
    }
}
#endif

/* As gg_matmul, with x given as gg_quantize_x's qx and dx (k a multiple of 32; block types only;
   xs from gg_xsums for the types with offsets). -1 for a type not handled. */
int gg_matmul_q8(int type, const uint8_t *raw, int64_t n, int64_t k, const int8_t *qx, const float *dx, int64_t m,
                 const float *xs, float *out, int64_t ldo) {
    int64_t bw, bb;
    if (block_shape(type, &bw, &bb) || bw == 1 || k % 32) return -1;
    const int64_t rb = k / bw * bb;
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int64_t mm = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
        rows_product_q8(type, raw, rb, n, k, qx + r0 * k, dx + r0 * (k / 32), mm, xs ? xs + r0 * (k / 32) : xs,
                        out + r0 * ldo, ldo);
    }
    return 0;
}

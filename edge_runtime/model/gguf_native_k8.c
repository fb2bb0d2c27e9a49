/* Decode-size int8-x products that read Q4_K, Q5_K, Q6_K and Q8_0 blocks as they lie (part of
   gguf_native.c, included in its product section; gguf_native_pool.c runs them on threads). */

/* --- x as llama.cpp's q8_K: per 256 values one float scale d (x ~ d q, q in [-127, 127], rounded
   to nearest, ties to even) and the int16 sums of q per 16. The K-quants' 6-bit sub-block scales and
   mins then apply to exact int32 sums: one float multiply per 256 weights and row of x. */
void gg_quantize_k8(const float *x, int64_t m, int64_t k, int8_t *qx, float *d, int16_t *bs) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t s = 0; s < k / 256; s++) {
            const float *v = x + r * k + 256 * s;
            int8_t *q = qx + r * k + 256 * s;
            float amax = 0.0f;
            for (int l = 0; l < 256; l++) {
                const float a = v[l] < 0.0f ? -v[l] : v[l];
                amax = a > amax ? a : amax;
            }
            const float iscale = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[r * (k / 256) + s] = amax > 0.0f ? 1.0f / iscale : 0.0f;
            for (int l = 0; l < 256; l++) {
                float t = v[l] * iscale;
                t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
                q[l] = (int8_t)__builtin_rintf(t); /* the default rounding: to nearest, ties to even */
            }
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int l = 0; l < 16; l++) sum += q[16 * g + l];
                bs[r * (k / 16) + 16 * s + g] = (int16_t)sum;
            }
        }
}

#if defined(GG_AVX512)
#ifndef GG_PREFETCH
#define GG_PREFETCH 1536 /* bytes ahead of the block being read that are asked for (about a DRAM latency) */
#endif
/* AVX-512 (BW, VNNI): a super-block's levels sit in four 64-byte registers in weight order; each row
   of x meets them with maddubs (unsigned level x signed q, pairs summed to int16) and vpdpwssd
   (times the int16 sub-block scale, summed into int32 lanes), the block's float scales applied once. */
static inline __m512i idx16(void) { /* int16 lane j of weights 64v.. -> Q6_K scale index j / 8 (v = 0) */
    return _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                              13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
}

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* A block's fp16 scale (F16C where the target has it: the same float for every non-NaN half). */
static inline float half_k8(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
#else
    return half_at(p);
#endif
}

/* Q4_K, and Q5_K (five = 1: each level's fifth bit from qh, bit 2c of qh[l] for weight 64c + l and
   bit 2c + 1 for 64c + 32 + l). */
static inline __attribute__((always_inline)) void k8_q4k(const uint8_t *raw, int64_t rb, int64_t n, int64_t k,
                                                         const int8_t *qx, const float *dx, const int16_t *bs,
                                                         const int64_t m, float *out, int64_t ldo, const int five) {
    const int64_t nsb = k / 256, bb = five ? 176 : 144;
    __m512i bit[4];
    for (int c = 0; c < 4; c++)
        bit[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << (2 * c)))),
                                    _mm256_set1_epi8((char)(2 << (2 * c))), 1);
    const __m512i m4 = _mm512_set1_epi8(15);
    /* pshufb indices: int16 lane j of weights 64v.. takes scale byte 2v + j/16 (high byte zeroed) */
    __m512i pick[4];
    for (int v = 0; v < 4; v++)
        pick[v] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(0x8000 | (2 * v)))),
                                     _mm256_set1_epi16((short)(0x8000 | (2 * v + 1))), 1);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        __m512 acc[MAX_ROWS];
        __m256 accm[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) {
            acc[r] = _mm512_setzero_ps();
            accm[r] = _mm256_setzero_ps();
        }
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *b = row + bb * s;
            _mm_prefetch((const char *)(b + GG_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 128), _MM_HINT_T0);
            const float d = half_k8(b), dmin = half_k8(b + 2);
            /* k_scales on 32-bit words: bytes 0-3 hold scales 0-3 (low 6 bits) and, in their top 2
               bits, the high bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the
               low 4 bits of scales 4-7 (low nibbles) and mins 4-7 (high nibbles) */
            const uint32_t u0 = u32_at(b + 4), u1 = u32_at(b + 8), u2 = u32_at(b + 12);
            const uint64_t sc8 = (uint64_t)(u0 & 0x3f3f3f3fu)
                                 | (uint64_t)((u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u)) << 32;
            const uint64_t mn8 = (uint64_t)(u1 & 0x3f3f3f3fu)
                                 | (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u)) << 32;
            const __m512i scw = _mm512_broadcast_i32x4(_mm_cvtsi64_si128((long long)sc8));
            const __m128i mv = _mm_cvtsi64_si128((long long)mn8);
            const __m256i mn2 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv)); /* each min twice: per 16 */
            const uint8_t *qs = b + (five ? 48 : 16);
            const __m512i q0 = _mm512_loadu_si512((const void *)qs), q1 = _mm512_loadu_si512((const void *)(qs + 64));
            const __m512i lo0 = _mm512_and_si512(q0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
            const __m512i lo1 = _mm512_and_si512(q1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
            /* 32 bytes of q hold weights 64c..64c+31 (low nibbles) and 64c+32.. (high) */
            __m512i w[4] = {_mm512_shuffle_i64x2(lo0, hi0, 0x44), _mm512_shuffle_i64x2(lo0, hi0, 0xEE),
                            _mm512_shuffle_i64x2(lo1, hi1, 0x44), _mm512_shuffle_i64x2(lo1, hi1, 0xEE)};
            if (five) {
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
                for (int c = 0; c < 4; c++)
                    w[c] = _mm512_mask_add_epi8(w[c], _mm512_test_epi8_mask(qh, bit[c]), w[c], _mm512_set1_epi8(16));
            }
            __m512i sv[4];
            for (int v = 0; v < 4; v++) sv[v] = _mm512_shuffle_epi8(scw, pick[v]);
            const __m512 dd = _mm512_set1_ps(d), dm = _mm512_castps256_ps512(_mm256_set1_ps(dmin));
            for (int64_t r = 0; r < m; r++) {
                const int8_t *xr = qx + r * k + 256 * s;
                __m512i isum = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++)
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w[v], _mm512_loadu_si512((const void *)(xr + 64 * v))),
                                               sv[v]);
                const float xd = dx[r * nsb + s];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dd, _mm512_set1_ps(xd)), acc[r]);
                const __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + r * (k / 16) + 16 * s)), mn2);
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins),
                                          _mm256_mul_ps(_mm512_castps512_ps256(dm), _mm256_set1_ps(xd)), accm[r]);
            }
        }
        for (int64_t r = 0; r < m; r++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(accm[r]), _mm256_extractf128_ps(accm[r], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            out[r * ldo + i] = hsum512(acc[r]) - _mm_cvtss_f32(h);
        }
    }
}

static inline __attribute__((always_inline)) void k8_q6k(const uint8_t *raw, int64_t rb, int64_t n, int64_t k,
                                                         const int8_t *qx, const float *dx, const int16_t *bs,
                                                         const int64_t m, float *out, int64_t ldo) {
    const int64_t nsb = k / 256;
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), base = idx16();
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        __m512 acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *b = row + 210 * s;
            _mm_prefetch((const char *)(b + GG_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 192), _MM_HINT_T0);
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            const __m512i scw = _mm512_castsi256_si512(s16);
            const float d = half_k8(b + 208);
            const __m512i qh = _mm512_loadu_si512((const void *)(b + 128));
            /* the two high bits of weight 32i + l (of each 128) sit at bits 2i, 2i+1 of qh[l] */
            const __m512i A = _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30), B = _mm512_and_si512(_mm512_slli_epi16(qh, 2), m30);
            const __m512i C = _mm512_and_si512(qh, m30), D = _mm512_and_si512(_mm512_srli_epi16(qh, 2), m30);
            const __m512i l0 = _mm512_loadu_si512((const void *)b), l1 = _mm512_loadu_si512((const void *)(b + 64));
            const __m512i w[4] = {
                _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_shuffle_i64x2(A, B, 0x44)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_shuffle_i64x2(C, D, 0x44)),
                _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_shuffle_i64x2(A, B, 0xEE)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_shuffle_i64x2(C, D, 0xEE))};
            __m512i sv[4];
            for (int v = 0; v < 4; v++)
                sv[v] = _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((short)(4 * v))), scw);
            const __m512 dd = _mm512_set1_ps(d);
            for (int64_t r = 0; r < m; r++) {
                const int8_t *xr = qx + r * k + 256 * s;
                /* levels are stored + 32: sum sc_g (u - 32) q = sum sc_g u q - 32 sum sc_g bsum_g */
                const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + r * (k / 16) + 16 * s)), s16);
                __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
                for (int v = 0; v < 4; v++)
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w[v], _mm512_loadu_si512((const void *)(xr + 64 * v))),
                                               sv[v]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dd, _mm512_set1_ps(dx[r * nsb + s])), acc[r]);
            }
        }
        for (int64_t r = 0; r < m; r++) out[r * ldo + i] = hsum512(acc[r]);
    }
}

/* Q8_0 with x per 32 (gg_quantize_x): two blocks a step, |w| against x with w's sign (vpdpbusd
   multiplies unsigned by signed), each block's int32 sum times its two scales. */
static inline __attribute__((always_inline)) void k8_q80(const uint8_t *raw, int64_t rb, int64_t n, int64_t k,
                                                         const int8_t *qx, const float *dx, const int64_t m,
                                                         float *out, int64_t ldo) {
    const int64_t kb = k / 32;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        __m512 acc[MAX_ROWS];
        float tail[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) {
            acc[r] = _mm512_setzero_ps();
            tail[r] = 0.0f;
        }
        int64_t j = 0;
        for (; j + 2 <= kb; j += 2) {
            const uint8_t *b = row + 34 * j;
            _mm_prefetch((const char *)(b + GG_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + GG_PREFETCH + 64), _MM_HINT_T0);
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            const __m512i aw = _mm512_abs_epi8(w);
            const float d0 = half_k8(b), d1 = half_k8(b + 34);
            for (int64_t r = 0; r < m; r++) {
                __m512i xq = _mm512_loadu_si512((const void *)(qx + r * k + 32 * j));
                xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
                const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xq));
                const float *d8 = dx + r * kb + j;
                const __m512 sc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0 * d8[0])),
                                                     _mm256_set1_ps(d1 * d8[1]), 1);
                acc[r] = _mm512_fmadd_ps(f, sc, acc[r]);
            }
        }
        if (j < kb) { /* an odd last block */
            const uint8_t *b = row + 34 * j;
            const float d0 = half_k8(b);
            for (int64_t r = 0; r < m; r++) {
                int32_t t = 0;
                for (int l = 0; l < 32; l++) t += (int32_t)((const int8_t *)(b + 2))[l] * qx[r * k + 32 * j + l];
                tail[r] += (float)t * (d0 * dx[r * kb + j]);
            }
        }
        for (int64_t r = 0; r < m; r++) out[r * ldo + i] = hsum512(acc[r]) + tail[r];
    }
}

static void q80_rows(const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const int8_t *qx, const float *dx,
                     int64_t m, float *out, int64_t ldo) {
    switch (m) {
    case 1: k8_q80(raw, rb, n, k, qx, dx, 1, out, ldo); break;
    case 2: k8_q80(raw, rb, n, k, qx, dx, 2, out, ldo); break;
    case 4: k8_q80(raw, rb, n, k, qx, dx, 4, out, ldo); break;
    case 8: k8_q80(raw, rb, n, k, qx, dx, 8, out, ldo); break;
    default: k8_q80(raw, rb, n, k, qx, dx, m, out, ldo); break;
    }
}
#define GG_Q80_DECODE 1

#else
/* Elsewhere: a super-block's levels are unpacked (unsigned: Q6_K's + 32, its offset applied through
   the sums of q) into 256 bytes, then meet each row of x 16 weights at a time in an int32 vector:
   AVX2 maddubs + madd (the scale in the madd), NEON sdot where the target has dotprod (else widening
   products), plain loops otherwise. */
#if defined(__AVX2__) && !defined(GG_GENERIC)
typedef __m128i acc32;
static inline acc32 acc_zero(void) { return _mm_setzero_si128(); }
static inline acc32 acc_dot16(acc32 acc, const int8_t *u, const int8_t *q, int32_t s) {
    const __m128i p = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i *)u), _mm_loadu_si128((const __m128i *)q));
    return _mm_add_epi32(acc, _mm_madd_epi16(p, _mm_set1_epi16((short)s)));
}
static inline int32_t acc_sum(acc32 a) {
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
    return _mm_cvtsi128_si32(a);
}
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(GG_GENERIC)
typedef int32x4_t acc32;
static inline acc32 acc_zero(void) { return vdupq_n_s32(0); }
static inline acc32 acc_dot16(acc32 acc, const int8_t *u, const int8_t *q, int32_t s) {
    const int8x16_t a = vld1q_s8(u), b = vld1q_s8(q);
#if defined(__ARM_FEATURE_DOTPROD)
    return vmlaq_n_s32(acc, vdotq_s32(vdupq_n_s32(0), a, b), s);
#else
    const int32x4_t p = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b))), vmull_high_s8(a, b));
    return vmlaq_n_s32(acc, p, s);
#endif
}
static inline int32_t acc_sum(acc32 a) { return vaddvq_s32(a); }
#else
typedef int32_t acc32;
static inline acc32 acc_zero(void) { return 0; }
static inline acc32 acc_dot16(acc32 acc, const int8_t *u, const int8_t *q, int32_t s) {
    int32_t t = 0;
    for (int l = 0; l < 16; l++) t += (int32_t)u[l] * q[l];
    return acc + s * t;
}
static inline int32_t acc_sum(acc32 a) { return a; }
#endif

/* The super-block's unsigned levels, one int scale per 16 weights, and (Q4_K) one min per 16
   (each sub-block's min twice, as the sums of q are per 16). */
static inline void k8_unpack(int type, const uint8_t *b, int8_t *u, int32_t *sc, int32_t *mn, float *d, float *dmin) {
    if (type == T_Q4_K || type == T_Q5_K) {
        const int five = type == T_Q5_K;
        uint8_t s8[8], m8[8];
        *d = half_at(b);
        *dmin = half_at(b + 2);
        k_scales(b + 4, s8, m8);
        const uint8_t *q = b + (five ? 48 : 16), *qh = b + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                u[64 * c + l] = (int8_t)((q[32 * c + l] & 15) | (five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0));
                u[64 * c + 32 + l] = (int8_t)((q[32 * c + l] >> 4) | (five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0));
            }
        for (int g = 0; g < 16; g++) {
            sc[g] = s8[g / 2];
            mn[g] = m8[g / 2];
        }
        return;
    }
    *d = half_at(b + 208);
    *dmin = 0.0f;
    for (int half = 0; half < 2; half++)
        for (int i = 0; i < 4; i++) {
            const uint8_t *lo = b + 64 * half + 32 * (i & 1), *hi = b + 128 + 32 * half;
            int8_t *w = u + 128 * half + 32 * i;
            for (int l = 0; l < 32; l++)
                w[l] = (int8_t)(((lo[l] >> (4 * (i >> 1))) & 15) | (((hi[l] >> (2 * i)) & 3) << 4));
        }
    for (int g = 0; g < 16; g++) {
        sc[g] = ((const int8_t *)(b + 192))[g];
        mn[g] = 32 * sc[g];
    }
}

static inline __attribute__((always_inline)) void k8_kquant(int type, const uint8_t *raw, int64_t rb, int64_t n,
                                                            int64_t k, const int8_t *qx, const float *dx,
                                                            const int16_t *bs, const int64_t m, float *out,
                                                            int64_t ldo) {
    const int64_t nsb = k / 256, bb = type == T_Q4_K ? 144 : (type == T_Q5_K ? 176 : 210);
    int8_t u[256] __attribute__((aligned(64)));
    int32_t sc[16], mn[16];
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = raw + i * rb;
        float acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = 0.0f;
        for (int64_t s = 0; s < nsb; s++) {
            float d, dmin;
            k8_unpack(type, row + bb * s, u, sc, mn, &d, &dmin);
            for (int64_t r = 0; r < m; r++) {
                const int8_t *xr = qx + r * k + 256 * s;
                const int16_t *br = bs + r * (k / 16) + 16 * s;
                acc32 a = acc_zero();
                for (int g = 0; g < 16; g++) a = acc_dot16(a, u + 16 * g, xr + 16 * g, sc[g]);
                int32_t off = 0;
                for (int g = 0; g < 16; g++) off += mn[g] * br[g];
                const float xd = dx[r * nsb + s];
                /* explicit fused multiply-adds: contraction left to the compiler may differ between
                   the loop's versions for one row and for several, and a row's value with them */
                acc[r] = type != T_Q6_K ? __builtin_fmaf(-(float)off, dmin * xd, __builtin_fmaf((float)acc_sum(a), d * xd, acc[r]))
                                        : __builtin_fmaf((float)(acc_sum(a) - off), d * xd, acc[r]);
            }
        }
        for (int64_t r = 0; r < m; r++) out[r * ldo + i] = acc[r];
    }
}
#define k8_q4k(raw, rb, n, k, qx, dx, bs, m, out, ldo, five) \
    k8_kquant((five) ? T_Q5_K : T_Q4_K, raw, rb, n, k, qx, dx, bs, m, out, ldo)
#define k8_q6k(...) k8_kquant(T_Q6_K, __VA_ARGS__)
#endif

static void k8_rows(int type, const uint8_t *raw, int64_t rb, int64_t n, int64_t k, const int8_t *qx, const float *dx,
                    const int16_t *bs, int64_t m, float *out, int64_t ldo) {
#define K8_CASE(mm) \
    if (type == T_Q4_K) k8_q4k(raw, rb, n, k, qx, dx, bs, mm, out, ldo, 0); \
    else if (type == T_Q5_K) k8_q4k(raw, rb, n, k, qx, dx, bs, mm, out, ldo, 1); \
    else k8_q6k(raw, rb, n, k, qx, dx, bs, mm, out, ldo);
    switch (m) {
    case 1: K8_CASE(1) break;
    case 2: K8_CASE(2) break;
    case 4: K8_CASE(4) break;
    case 8: K8_CASE(8) break;
    default: K8_CASE(m) break;
    }
#undef K8_CASE
}

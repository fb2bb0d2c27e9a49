/* Decode and prefill attention over the paged KV cache, the step's K/V written into their slots, and the
 * rotary turn of q and k, for the CPU (edge_runtime/kv/attention_kernel.py builds and calls it).
 *
 * Each row (a decode row, or a prefill chunk's) is computed as alone, its keys in order, its sums in fixed
 * lanes (a chunk's rows interleave in passes over their shared keys, no sum spanning two rows): a row's
 * output does not depend on the rows beside it, their contexts, the chunk it came in or the padding of
 * the step's index (the invariant torch's GEMMs only keep with padded rows and key tiles, issue #31).
 * C with GCC/Clang's
 * generic vectors (8 float lanes: the compiler picks AVX, NEON or scalar code); every sum runs in
 * fixed lanes and a fixed order (-ffp-contract=off: a*b + c a rounded product, then a rounded sum).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>


static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as torch's float -> bfloat16 conversion (NaN kept a quiet NaN) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* GCC/Clang's generic vectors (AVX, NEON or scalar code, as the target has): 8 float lanes. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* sum_i a[i] * b[i] in 8 lanes, d a multiple of 8: two vectors of partial sums, then their sum. */
static inline v8 dot_lanes(const float *a, const float *b, int64_t d) {
    v8 s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        s0 += load8(a + i) * load8(b + i);
        s1 += load8(a + i + 8) * load8(b + i + 8);
    }
    if (i < d) s0 += load8(a + i) * load8(b + i);
    return s0 + s1;
}

/* The lanes of s added in a fixed order. */
static inline float lane_sum(v8 s) { return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])); }

/* sum_i a[i] * b[i], d a multiple of 8. */
static inline float dot(const float *a, const float *b, int64_t d) { return lane_sum(dot_lanes(a, b, d)); }

/* lane_sum of s[0], ..., s[7] into one vector's lanes, each lane's adds lane_sum's, in that order (the
 * pairs then the pairs of pairs, 8 at a time: a transpose instead of 8 horizontal sums). */
static inline v8 lane_sums8(const v8 *s) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    v8 p[4], q[2];
    for (int i = 0; i < 4; i++)
        p[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    return __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    v8 r;
    for (int i = 0; i < 8; i++) r[i] = lane_sum(s[i]);
    return r;
#endif
}

/* A key's score for a query head: cap(q.k * scale) (cap <= 0: none). */
static inline float score(const float *q, const float *k, int64_t d, float scale, float cap) {
    float x = dot(q, k, d) * scale;
    return cap > 0.0f ? tanhf(x / cap) * cap : x;
}

/* e^x for x <= 0 on 8 lanes (Cephes' expf polynomial after x = n ln2 + r; within 2 ulp of expf;
 * below -87 it gives 2^-126 instead of a smaller number, weights too small to matter). */
static inline v8 exp8(v8 x) {
    v8i under = x < -87.0f; /* all ones where x < -87 */
    v8i xi, lo;
    v8 lov = x * 0.0f - 87.0f;
    memcpy(&xi, &x, sizeof x);
    memcpy(&lo, &lov, sizeof lo);
    xi = (xi & ~under) | (lo & under);
    memcpy(&x, &xi, sizeof x);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 t = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8); /* towards zero */
    v8 f = t + __builtin_convertvector(t > fx, v8);                       /* floor: t - 1 where t > fx */
    v8 r = x - f * 0.693359375f;
    r = r - f * -2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v8i bits = (__builtin_convertvector(f, v8i) + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Key (or value) row of head h at the row's j-th position: from `entries` ([B, width, kv_heads]
 * rows of d elements from `base`, `shift` rows further) where given, else from slot index[j]'s
 * head h. bf16 rows are widened into `buf`. */
static inline const float *kv_row(const void *base, int bf16, const int64_t *index, const int64_t *entries,
                                  int64_t shift, int64_t j, int64_t h, int64_t kv_heads, int64_t d, float *buf) {
    int64_t row = entries ? entries[j * kv_heads + h] + shift : index[j] * kv_heads + h;
    if (!bf16) return (const float *)base + row * d;
    const uint16_t *p = (const uint16_t *)base + row * d;
    for (int64_t i = 0; i < d; i++) buf[i] = bf16_to_f32(p[i]);
    return buf;
}

/* The largest of s[0, n) (NaNs passed over; -inf for none), 8 lanes at a time. The order can only
 * change the sign of a zero maximum, which no e^(s - m) below sees (s - (+0) and s - (-0) are equal
 * but for s = -0, and e^(+-0) is 1 either way). */
static inline float max_of(const float *s, int64_t n) {
    v8 mv = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8 x = load8(s + j);
        v8i gt = x > mv, xi, mi;
        memcpy(&xi, &x, sizeof x);
        memcpy(&mi, &mv, sizeof mv);
        mi = (xi & gt) | (mi & ~gt);
        memcpy(&mv, &mi, sizeof mv);
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* Row scores sc [heads, width] (the first n of each head's; masked keys -inf where `keep` is given) to
 * e^(s - max) in place, inv [heads] the reciprocal of each head's sum. */
static void row_softmax(float *sc, float *inv, const uint8_t *keep, int64_t n, int64_t width, int64_t heads) {
    for (int64_t hh = 0; hh < heads; hh++) {
        float *s = sc + hh * width;
        float m = max_of(s, n);
        /* e^(s - m) in place, 8 at a time (masked keys exact zeros, the tail's padding not
         * summed), summed in 8 lanes and then in a fixed order */
        v8 sum = {0};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            v8 x = load8(s + j);
            v8 e = exp8(x - m);
            if (keep) {
                v8i live = x > -INFINITY, bits;
                memcpy(&bits, &e, sizeof bits);
                bits &= live;
                memcpy(&e, &bits, sizeof e);
            }
            store8(s + j, e);
            sum += e;
        }
        if (j < n) {
            float tail[8];
            for (int l = 0; l < 8; l++) tail[l] = j + l < n ? s[j + l] - m : -100.0f;
            v8 e = exp8(load8(tail));
            for (int l = 0; j + l < n; l++) {
                float w = s[j + l] > -INFINITY ? e[l] : 0.0f;
                s[j + l] = w;
                sum[l] += w;
            }
        }
        inv[hh] = 1.0f / lane_sum(sum);
    }
}

/* Query row `row` of q (q_stride elements between rows) widened into qf [heads * d]. */
static inline void load_q(const void *q, int64_t q_stride, int64_t row, int64_t n, int bf16, float *qf) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)q + row * q_stride;
        for (int64_t i = 0; i < n; i++) qf[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(qf, (const float *)q + row * q_stride, (size_t)n * sizeof(float));
    }
}

/* acc [n] into output row `row` of out (out_stride elements between rows). */
static inline void store_out(void *out, int64_t out_stride, int64_t row, int64_t n, int bf16, const float *acc) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)out + row * out_stride;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(acc[i]);
    } else {
        memcpy((float *)out + row * out_stride, acc, (size_t)n * sizeof(float));
    }
}

/* Prefill rows a pass over their keys computes together, and the keys a tile of that pass holds (per
 * KV head: 16 KiB of float32 at d 64, in L1 while every row and query head of the group uses it). */
#define PREFILL_ROWS 8
#define KEY_TILE 64

/* Key (or value) rows of head h for positions [p0, p1) as `kv_row` reads them (`slots` or `ent`, `shift`;
 * at most KEY_TILE): pointers into the float32 cache, or bf16 rows widened once into buf [(p1 - p0) * d]
 * for every row that reads them; NULL where `keep` (NULL or [kv_heads, width] bytes: one row's) masks the
 * key (its row is never read). */
static void tile_rows(const void *cache, int bf16, const int64_t *slots, const int64_t *ent, int64_t shift,
                      const uint8_t *keep, int64_t width, int64_t p0, int64_t p1, int64_t h, int64_t kv_heads,
                      int64_t d, float *buf, const float **rows) {
    for (int64_t p = p0; p < p1; p++)
        rows[p - p0] = keep && !keep[h * width + p] ? NULL
                                                     : kv_row(cache, bf16, slots, ent, shift, p, h, kv_heads, d,
                                                              buf + (p - p0) * d);
}

/* Scores of query head q against keys kr[0, n) into s[0, n): `score` for each (-inf where kr[j] is NULL: a
 * masked key), 8 keys' lane sums at once. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, const float *const *kr, int64_t n,
                                                              int64_t d, float scale, float cap, float *s) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        int masked = 0;
        for (int l = 0; l < 8; l++) masked |= !kr[j + l];
        if (masked) {
            for (int l = 0; l < 8; l++) s[j + l] = kr[j + l] ? score(q, kr[j + l], d, scale, cap) : -INFINITY;
            continue;
        }
        v8 lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = dot_lanes(q, kr[j + l], d);
        v8 x = lane_sums8(lanes) * scale;
        if (cap > 0.0f)
            for (int l = 0; l < 8; l++) x[l] = tanhf(x[l] / cap) * cap;
        store8(s + j, x);
    }
    for (; j < n; j++) s[j] = kr[j] ? score(q, kr[j], d, scale, cap) : -INFINITY;
}

/* acc [d] += (w[j] * inv) vr[j] for j in [0, n) in order, masked keys (NULL) passed over (64 floats at a
 * time in registers). */
static inline __attribute__((always_inline)) void tile_values(float *acc, const float *const *vr, const float *w,
                                                              float inv, int64_t n, int64_t d) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        v8 a[8];
        for (int u = 0; u < 8; u++) a[u] = load8(acc + i + 8 * u);
        for (int64_t j = 0; j < n; j++) {
            if (!vr[j]) continue;
            float wj = w[j] * inv;
            for (int u = 0; u < 8; u++) a[u] = a[u] + load8(vr[j] + i + 8 * u) * wj;
        }
        for (int u = 0; u < 8; u++) store8(acc + i + 8 * u, a[u]);
    }
    for (; i < d; i += 8) {
        v8 a = load8(acc + i);
        for (int64_t j = 0; j < n; j++)
            if (vr[j]) a = a + load8(vr[j] + i) * (w[j] * inv);
        store8(acc + i, a);
    }
}

/* tile_values for two query heads of one KV head, d 64: each value row loaded once for both. */
static inline void tile_values2(float *acc0, float *acc1, const float *const *vr, const float *w0, const float *w1,
                                float inv0, float inv1, int64_t n) {
    v8 a[8], c[8];
    for (int u = 0; u < 8; u++) {
        a[u] = load8(acc0 + 8 * u);
        c[u] = load8(acc1 + 8 * u);
    }
    for (int64_t j = 0; j < n; j++) {
        if (!vr[j]) continue;
        float x = w0[j] * inv0, y = w1[j] * inv1;
        for (int u = 0; u < 8; u++) {
            v8 v = load8(vr[j] + 8 * u);
            a[u] = a[u] + v * x;
            c[u] = c[u] + v * y;
        }
    }
    for (int u = 0; u < 8; u++) {
        store8(acc0 + 8 * u, a[u]);
        store8(acc1 + 8 * u, c[u]);
    }
}

/* Rows r < nr (q widened into qf[r]; row r attending positions first[r], ... its lens[r] keys, of `slots`)
 * into acc[r] [heads * d]: softmax(cap(q.K^T * scale)) V per query head, with the KV head its group of
 * heads shares, in one pass over the union [lo, hi) of their keys, `tile` (<= KEY_TILE) keys at a time: a
 * tile's key (and value) rows are read, and widened, once for every row and query head that attends them.
 * Keys and values as `tile_rows` reads them; `ent`, `v_shift` and `keep` (NULL or [kv_heads, width] bytes,
 * masked keys exact zero weights) with one row only (a decode row). Each row's arithmetic depends on its
 * q, its keys in order and its n only: the same scores, softmax, and each head's acc summed over its keys
 * in order (then heads), whatever rows share the pass, the tile or the row's start in it; only the order
 * across rows and heads changes, which no sum spans. sc[r] [heads, width] and inv[r] [heads] receive the
 * row's softmax weights (before the 1 / sum) and reciprocal sums. */
static void attend_rows(int64_t nr, float *const *qf, const int64_t *first, const int64_t *lens, int64_t lo,
                        int64_t hi, const void *k_cache, const void *v_cache, const int64_t *slots, const int64_t *ent,
                        int64_t v_shift, const uint8_t *keep, int64_t tile, int64_t width, int64_t heads,
                        int64_t kv_heads, int64_t d, float scale, float cap, int bf16, float *const *sc,
                        float *const *inv, float *const *acc, float *buf) {
    int64_t group = heads / kv_heads;
    const float *rows[KEY_TILE];
    for (int values = 0; values < 2; values++) { /* the scores, then (after the softmax) the values' sums */
        if (values) {
            for (int64_t r = 0; r < nr; r++) {
                row_softmax(sc[r], inv[r], keep, lens[r], width, heads);
                memset(acc[r], 0, (size_t)(heads * d) * sizeof(float));
            }
        }
        for (int64_t p0 = lo; p0 < hi; p0 += tile) {
            int64_t p1 = p0 + tile < hi ? p0 + tile : hi;
            for (int64_t h = 0; h < kv_heads; h++) {
                tile_rows(values ? v_cache : k_cache, bf16, slots, ent, values ? v_shift : 0, keep, width, p0, p1, h,
                          kv_heads, d, buf, rows);
                for (int64_t r = 0; r < nr; r++) {
                    /* the row's keys [a, b) of the tile */
                    int64_t a = first[r] > p0 ? first[r] : p0, b = first[r] + lens[r] < p1 ? first[r] + lens[r] : p1;
                    for (int64_t g = 0; a < b && g < group; g++) {
                        int64_t hh = h * group + g;
                        float *s = sc[r] + hh * width + (a - first[r]);
                        const float *const *kv = rows + (a - p0);
                        /* d 64 (Llama 3.2's heads) apart: the loops' bounds then constants */
                        if (!values && d == 64) {
                            tile_scores(qf[r] + hh * d, kv, b - a, 64, scale, cap, s);
                        } else if (!values) {
                            tile_scores(qf[r] + hh * d, kv, b - a, d, scale, cap, s);
                        } else if (d == 64 && g + 1 < group) {
                            tile_values2(acc[r] + hh * d, acc[r] + (hh + 1) * d, kv, s, s + width, inv[r][hh],
                                         inv[r][hh + 1], b - a);
                            g++;
                        } else {
                            tile_values(acc[r] + hh * d, kv, s, inv[r][hh], b - a, d);
                        }
                    }
                }
            }
        }
    }
}

/* For each decode row b (query row rows[b] of q, output row rows[b] of out) and each query head:
 * softmax(cap(q.K^T * scale)) V over the row's lens[b] cached positions with the KV head its group
 * of heads shares. q: [*, heads, d] with q_stride elements between rows; out: [*, heads * d] with
 * out_stride elements between rows. Keys and values: with `entries` NULL, k_base and v_base are
 * caches [slots, kv_heads, d] and position j of row b is in slot index[b, j]; else both bases are
 * the whole slab of rows of d elements, entries [B, width, kv_heads] gives each key's row, its
 * value `v_shift` rows further (compacted rows: edge_runtime/kv/compaction.py). `mask` (NULL or
 * [B, kv_heads, width] bytes, 0 = not attended: pruned positions) gives masked keys exact zero
 * weights; `weights` (NULL or [B, heads, width] floats) receives the softmax weights, zeros past
 * lens[b]. `cap` <= 0: no soft cap. `scratch`: heads * (2 d + width + 1) + d floats. Returns 0, or
 * -1 where d is not a multiple of 8 or the heads do not group (the caller takes torch's path). */
int decode_attention(const void *q, int64_t q_stride, const void *k_base, const void *v_base, const int64_t *index,
                     const int64_t *entries, int64_t v_shift, const int64_t *lens, const int64_t *rows,
                     int64_t batch, int64_t width, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                     float cap, const uint8_t *mask, float *weights, void *out, int64_t out_stride, int bf16,
                     float *scratch) {
    if (d % 8 || kv_heads <= 0 || heads % kv_heads) return -1;
    float *qf = scratch, *acc = qf + heads * d, *sc = acc + heads * d, *inv = sc + heads * width;
    float *buf = inv + heads;
    const int64_t zero = 0;
    for (int64_t b = 0; b < batch; b++) {
        load_q(q, q_stride, rows[b], heads * d, bf16, qf);
        /* bf16 keys one at a time: `scratch` widens one row (float32 ones are read in place) */
        attend_rows(1, &qf, &zero, lens + b, 0, lens[b], k_base, v_base, index + b * width,
                    entries ? entries + b * width * kv_heads : NULL, v_shift, mask ? mask + b * kv_heads * width : NULL,
                    bf16 ? 1 : KEY_TILE, width, heads, kv_heads, d, scale, cap, bf16, &sc, &inv, &acc, buf);
        if (weights) {
            float *w = weights + b * heads * width;
            for (int64_t hh = 0; hh < heads; hh++) {
                for (int64_t j = 0; j < lens[b]; j++) w[hh * width + j] = sc[hh * width + j] * inv[hh];
                for (int64_t j = lens[b]; j < width; j++) w[hh * width + j] = 0.0f;
            }
        }
        store_out(out, out_stride, rows[b], heads * d, bf16, acc);
    }
    return 0;
}

/* Prefill rows [first, last) as decode rows: row t (query and output row rows[t]) attends the lens[t]
 * slots slots[starts[t]], ... of the caches [slots, kv_heads, d] (its causal prefix, within its
 * window), one index array shared by every row, so a chunk of n rows needs no [n, context] index.
 * Each row is computed as `decode_attention` computes a decode row with the same keys: the same bits
 * in a chunk of any extent, in any split of the rows across calls, and as a lone decode row. Up to
 * PREFILL_ROWS (8) successive rows whose key runs overlap (a chunk's) go through their keys together.
 * `scratch`: 8 * heads * (2 d + width + 1) + 64 d floats, width >= every lens[t]. Returns as
 * `decode_attention`. Rows are independent: callers split them across threads. */
int prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *slots,
                      const int64_t *starts, const int64_t *lens, const int64_t *rows, int64_t first, int64_t last,
                      int64_t width, int64_t heads, int64_t kv_heads, int64_t d, float scale, float cap, void *out,
                      int64_t out_stride, int bf16, float *scratch) {
    if (d % 8 || kv_heads <= 0 || heads % kv_heads) return -1;
    float *qf[PREFILL_ROWS], *acc[PREFILL_ROWS], *sc[PREFILL_ROWS], *inv[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; r++) {
        float *base = scratch + r * heads * (2 * d + width + 1);
        qf[r] = base;
        acc[r] = base + heads * d;
        sc[r] = acc[r] + heads * d;
        inv[r] = sc[r] + heads * width;
    }
    float *buf = scratch + PREFILL_ROWS * heads * (2 * d + width + 1);
    for (int64_t t = first; t < last;) {
        /* the group: rows t, t + 1, ... while each one's keys overlap the union of theirs so far */
        int64_t lo = starts[t], hi = starts[t] + lens[t], nr = 1;
        while (nr < PREFILL_ROWS && t + nr < last && starts[t + nr] <= hi && starts[t + nr] + lens[t + nr] >= lo) {
            lo = starts[t + nr] < lo ? starts[t + nr] : lo;
            hi = starts[t + nr] + lens[t + nr] > hi ? starts[t + nr] + lens[t + nr] : hi;
            nr++;
        }
        for (int64_t r = 0; r < nr; r++) load_q(q, q_stride, rows[t + r], heads * d, bf16, qf[r]);
        attend_rows(nr, qf, starts + t, lens + t, lo, hi, k_cache, v_cache, slots, NULL, 0, NULL, KEY_TILE, width, heads,
                    kv_heads, d, scale, cap, bf16, sc, inv, acc, buf);
        for (int64_t r = 0; r < nr; r++) store_out(out, out_stride, rows[t + r], heads * d, bf16, acc[r]);
        t += nr;
    }
    return 0;
}

/* Rows t of k and v ([*, width] with k_stride / v_stride elements between rows) into slot
 * slots[t] of k_cache / v_cache ([slots, width]); elem: bytes an element. */
void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
              int64_t rows, int64_t width, int64_t elem, void *k_cache, void *v_cache) {
    for (int64_t t = 0; t < rows; t++) {
        memcpy((char *)k_cache + slots[t] * width * elem, (const char *)k + t * k_stride * elem,
               (size_t)(width * elem));
        memcpy((char *)v_cache + slots[t] * width * elem, (const char *)v + t * v_stride * elem,
               (size_t)(width * elem));
    }
}

/* float32 rotary turn in the rotate-half layout, bit for bit torch's `x * cos + rotate_half(x) * sin`
 * (each product rounded, then the sum): x [rows, heads, d] with x_stride elements between rows
 * (heads contiguous), cos/sin [rows, r] (r even, r <= d; the dims past r pass through), out
 * [rows, heads, d] contiguous. */
void rope_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t rows,
              int64_t heads, int64_t d, int64_t r, float *out) {
    int64_t half = r / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * r, *s = sin + t * r;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * d;
            float *oh = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                float a = xh[i] * c[i];
                float b = -xh[i + half] * s[i];
                oh[i] = a + b;
            }
            for (int64_t i = half; i < r; i++) {
                float a = xh[i] * c[i];
                float b = xh[i - half] * s[i];
                oh[i] = a + b;
            }
            for (int64_t i = r; i < d; i++) oh[i] = xh[i];
        }
    }
}

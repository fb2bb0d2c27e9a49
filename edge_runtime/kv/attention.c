/* Decode and prefill attention over the paged KV cache, the step's K/V written into their slots, and the
 * rotary turn of q and k, for the CPU (edge_runtime/kv/attention_kernel.py builds and calls it).
 *
 * Each row (a decode row, or a prefill chunk's) is computed alone, its keys in order, its sums in fixed
 * lanes: a row's output does not depend on the rows beside it, their contexts, the chunk it came in
 * or the padding of the step's index (the invariant torch's GEMMs only keep with padded rows and key
 * tiles, issue #31). C with GCC/Clang's
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

/* sum_i a[i] * b[i], d a multiple of 8: two vectors of partial sums, added in a fixed order. */
static inline float dot(const float *a, const float *b, int64_t d) {
    v8 s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        s0 += load8(a + i) * load8(b + i);
        s1 += load8(a + i + 8) * load8(b + i + 8);
    }
    if (i < d) s0 += load8(a + i) * load8(b + i);
    v8 s = s0 + s1;
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
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

/* One query row (its heads' q widened into qf) over its n keys: softmax(cap(q.K^T * scale)) V per query
 * head, with the KV head its group of heads shares, into acc [heads * d]. Keys and values as
 * `kv_row` reads them (`slots` or `ent`, `width` entries a head apart in `ent` and `keep`);
 * `keep` (NULL or [kv_heads, width] bytes) gives masked keys exact zero weights; `weights` (NULL or
 * [heads, width]) receives the softmax weights. The row's arithmetic depends on its q, its keys in
 * order and n only: a row gives the same bits in any call (a decode step, a prefill chunk). */
static void attend_row(const float *qf, const void *k_base, const void *v_base, const int64_t *slots,
                       const int64_t *ent, int64_t v_shift, const uint8_t *keep, int64_t n, int64_t width,
                       int64_t heads, int64_t kv_heads, int64_t d, float scale, float cap, int bf16, float *sc,
                       float *inv, float *acc, float *buf, float *weights) {
    int64_t group = heads / kv_heads;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            if (keep && !keep[h * width + j]) {
                for (int64_t g = 0; g < group; g++) sc[(h * group + g) * width + j] = -INFINITY;
                continue;
            }
            const float *kr = kv_row(k_base, bf16, slots, ent, 0, j, h, kv_heads, d, buf);
            for (int64_t g = 0; g < group; g++) {
                float x = dot(qf + (h * group + g) * d, kr, d) * scale;
                if (cap > 0.0f) x = tanhf(x / cap) * cap;
                sc[(h * group + g) * width + j] = x;
            }
        }
    }
    for (int64_t hh = 0; hh < heads; hh++) {
        float *s = sc + hh * width;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
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
        inv[hh] = 1.0f / (((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7])));
    }
    memset(acc, 0, (size_t)(heads * d) * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            if (keep && !keep[h * width + j]) continue;
            const float *vr = kv_row(v_base, bf16, slots, ent, v_shift, j, h, kv_heads, d, buf);
            for (int64_t g = 0; g < group; g++) {
                int64_t hh = h * group + g;
                float w = sc[hh * width + j] * inv[hh];
                float *o = acc + hh * d;
                for (int64_t i = 0; i < d; i += 8) store8(o + i, load8(o + i) + load8(vr + i) * w);
            }
        }
    }
    if (weights) {
        for (int64_t hh = 0; hh < heads; hh++) {
            float *w = weights + hh * width;
            for (int64_t j = 0; j < n; j++) w[j] = sc[hh * width + j] * inv[hh];
            for (int64_t j = n; j < width; j++) w[j] = 0.0f;
        }
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
    for (int64_t b = 0; b < batch; b++) {
        load_q(q, q_stride, rows[b], heads * d, bf16, qf);
        attend_row(qf, k_base, v_base, index + b * width, entries ? entries + b * width * kv_heads : NULL, v_shift,
                   mask ? mask + b * kv_heads * width : NULL, lens[b], width, heads, kv_heads, d, scale, cap, bf16,
                   sc, inv, acc, buf, weights ? weights + b * heads * width : NULL);
        store_out(out, out_stride, rows[b], heads * d, bf16, acc);
    }
    return 0;
}

/* Prefill rows [first, last) as decode rows: row t (query and output row rows[t]) attends the lens[t]
 * slots slots[starts[t]], ... of the caches [slots, kv_heads, d] (its causal prefix, within its
 * window), one index array shared by every row, so a chunk of n rows needs no [n, context] index.
 * Each row is computed as `decode_attention` computes a decode row with the same keys: the same bits
 * in a chunk of any extent, in any split of the rows across calls, and as a lone decode row.
 * `scratch`: heads * (2 d + width + 1) + d floats, width >= every lens[t]. Returns as
 * `decode_attention`. Rows are independent: callers split them across threads. */
int prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *slots,
                      const int64_t *starts, const int64_t *lens, const int64_t *rows, int64_t first, int64_t last,
                      int64_t width, int64_t heads, int64_t kv_heads, int64_t d, float scale, float cap, void *out,
                      int64_t out_stride, int bf16, float *scratch) {
    if (d % 8 || kv_heads <= 0 || heads % kv_heads) return -1;
    float *qf = scratch, *acc = qf + heads * d, *sc = acc + heads * d, *inv = sc + heads * width;
    float *buf = inv + heads;
    for (int64_t t = first; t < last; t++) {
        load_q(q, q_stride, rows[t], heads * d, bf16, qf);
        attend_row(qf, k_cache, v_cache, slots + starts[t], NULL, 0, NULL, lens[t], width, heads, kv_heads, d, scale,
                   cap, bf16, sc, inv, acc, buf, NULL);
        store_out(out, out_stride, rows[t], heads * d, bf16, acc);
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

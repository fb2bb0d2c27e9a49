/* tests/engine/test_attention_builds.py builds this beside kv/attention.c for this machine and for
   aarch64 (run under qemu): decode and prefill attention, the KV write and the rotary turn on inputs
   made here from an integer LCG (no libm in their making: the same bits on every machine), each
   input and output written to argv[1] as a named record (32-byte name, int64 byte count, bytes). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#ifdef HARNESS_OWN_TANHF
/* The soft cap's tanhf is libm's, whose last bits differ between machines (glibc's aarch64 build
   fuses its multiply-adds); this build swaps it for one made of attention.c's own exp8 so that the
   rest of the kernel's bits can be compared across machines. */
static float harness_tanhf(float x);
#define tanhf harness_tanhf
#endif
#include "attention.c" /* compiled with -I edge_runtime/kv */
#ifdef HARNESS_OWN_TANHF
static float harness_tanhf(float x) {
    v8 y = {0};
    v8 e = exp8(y - 2.0f * fabsf(x)); /* e^(-2|x|) in every lane */
    float t = (1.0f - e[0]) / (1.0f + e[0]);
    return x < 0.0f ? -t : t;
}
#endif

/* Floats of scratch a call over `width` keys needs: the formulas in the comments above
   decode_attention and prefill_attention (the one place to follow them). */
#define DECODE_SCRATCH(heads, d, width) ((heads) * (2 * (d) + (width) + 1) + (d))
#define PREFILL_SCRATCH(heads, d, width) (8 * (heads) * (2 * (d) + (width) + 1) + 64 * (d))

enum { B = 6, WIDTH = 200, SLOTS = 64, CHUNK = 13, PAST = 40, WINDOW = 24 };
static const int64_t LENS[B] = {1, 7, 8, 9, 63, 200}; /* decode rows' keys: one, part of 8 lanes, 8, 8 + 1, ... */

static FILE *out;
static uint32_t st = 2463534242u;
static uint32_t rnd(void) { st = st * 1664525u + 1013904223u; return st >> 8; }
/* a float in [-2, 2]: an integer and one correctly rounded division */
static float rndf(void) { return ((float)(int32_t)(rnd() % 4001) - 2000.0f) / 1000.0f; }

static void put(const char *fmt, int c, const void *p, int64_t bytes) {
    char name[32] = {0};
    snprintf(name, sizeof name, fmt, c);
    fwrite(name, 1, sizeof name, out);
    fwrite(&bytes, sizeof bytes, 1, out);
    fwrite(p, 1, (size_t)bytes, out);
}

/* count elements from rndf: float32, or bfloat16 rounded as torch rounds */
static void *fill(int64_t count, int bf16) {
    void *p = malloc((size_t)count * (bf16 ? 2 : 4));
    for (int64_t i = 0; i < count; i++) {
        float x = rndf();
        if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
        else ((float *)p)[i] = x;
    }
    return p;
}

/* One shape: decode rows (plain, with weights, masked, from entries) and a prefill chunk (one
   call, a split into row ranges, each row as a decode row; causal and windowed). */
static int attention_case(int c, int64_t heads, int64_t kv, int64_t d, int bf16, float cap) {
    const int64_t elem = bf16 ? 2 : 4, qs = (heads + kv) * d, os = heads * d;
    const float scale = (float)(1.0 / __builtin_sqrt((double)d)); /* correctly rounded: IEEE sqrt */
    int64_t shape[] = {heads, kv, d, bf16, B, WIDTH, SLOTS, CHUNK};
    float capscale[] = {cap, scale};
    put("c%d/shape", c, shape, sizeof shape);
    put("c%d/cap_scale", c, capscale, sizeof capscale);
    /* caches [SLOTS, kv, d] back to back: the slab that `entries` reads, values SLOTS * kv rows on */
    char *slab = fill(2 * SLOTS * kv * d, bf16), *k = slab, *v = slab + SLOTS * kv * d * elem;
    void *q = fill(CHUNK * qs, bf16); /* CHUNK > B rows: decode reads the first B */
    int64_t index[B * WIDTH], entries[B * WIDTH * 8], rows[B];
    uint8_t keep[B * 8 * WIDTH];
    for (int64_t b = 0; b < B; b++) {
        rows[b] = B - 1 - b;
        for (int64_t j = 0; j < WIDTH; j++) {
            index[b * WIDTH + j] = j < LENS[b] ? rnd() % SLOTS : 0;
            for (int64_t h = 0; h < kv; h++) {
                entries[(b * WIDTH + j) * kv + h] = index[b * WIDTH + j] * kv + h;
                keep[(b * kv + h) * WIDTH + j] = j % 3 != 1; /* every head the same keys: a plain reference */
            }
        }
    }
    put("c%d/k", c, k, SLOTS * kv * d * elem);
    put("c%d/v", c, v, SLOTS * kv * d * elem);
    put("c%d/q", c, q, CHUNK * qs * elem);
    put("c%d/index", c, index, sizeof index);
    put("c%d/lens", c, LENS, sizeof LENS);
    put("c%d/rows", c, rows, sizeof rows);
    const int64_t most = DECODE_SCRATCH(heads, d, WIDTH) > PREFILL_SCRATCH(heads, d, WIDTH)
                             ? DECODE_SCRATCH(heads, d, WIDTH)
                             : PREFILL_SCRATCH(heads, d, WIDTH); /* WIDTH >= the chunk's keys */
    float *scratch = malloc(most * sizeof(float));
    float *weights = malloc(B * heads * WIDTH * sizeof(float));
    char *o = calloc(CHUNK * os, elem); /* CHUNK > B rows */
    int rc = 0;
    const void *kb = k, *vb = v;
#define DECODE(name, ent, shift, mask, w)                                                                          \
    memset(o, 0, B * os * elem);                                                                                  \
    rc |= decode_attention(q, qs, kb, vb, index, ent, shift, LENS, rows, B, WIDTH, heads, kv, d, scale, cap, mask, \
                           w, o, os, bf16, scratch);                                                              \
    put("c%d/" name, c, o, B * os * elem)
    DECODE("decode", NULL, 0, NULL, NULL);
    DECODE("decode_w", NULL, 0, NULL, weights);
    put("c%d/weights", c, weights, B * heads * WIDTH * sizeof(float));
    DECODE("masked", NULL, 0, keep, weights);
    put("c%d/masked_weights", c, weights, B * heads * WIDTH * sizeof(float));
    kb = vb = slab; /* the whole slab: each key's row from entries, its value SLOTS * kv rows on */
    DECODE("entries", entries, SLOTS * kv, NULL, NULL);
#undef DECODE

    /* a prefill chunk: CHUNK rows after PAST cached positions, over one slot array */
    int64_t slots[PAST + CHUNK], starts[CHUNK], lens[CHUNK], prow[CHUNK];
    for (int64_t i = 0; i < PAST + CHUNK; i++) slots[i] = rnd() % SLOTS;
    put("c%d/slots", c, slots, sizeof slots);
    for (int window = 0; window < 2; window++) {
        const int64_t pw = PAST + CHUNK;
        for (int64_t t = 0; t < CHUNK; t++) {
            int64_t end = PAST + t + 1;
            starts[t] = window && end > WINDOW ? end - WINDOW : 0;
            lens[t] = end - starts[t];
            prow[t] = (t * 5) % CHUNK; /* query and output rows out of order */
        }
        const char *tag = window ? "c%d/window" : "c%d/causal";
        char name[24];
        put(tag, c, prow, sizeof prow); /* the rows, under the variant's own name */
        snprintf(name, sizeof name, "%s_starts", tag);
        put(name, c, starts, sizeof starts);
        snprintf(name, sizeof name, "%s_lens", tag);
        put(name, c, lens, sizeof lens);
        memset(o, 0, CHUNK * os * elem);
        rc |= prefill_attention(q, qs, k, v, slots, starts, lens, prow, 0, CHUNK, pw, heads, kv, d, scale, cap, o, os,
                                bf16, scratch);
        snprintf(name, sizeof name, "%s_one", tag);
        put(name, c, o, CHUNK * os * elem);
        memset(o, 0, CHUNK * os * elem);
        const int64_t cuts[] = {0, 4, 5, 12, CHUNK}; /* ranges of rows as the Python side's threads take them */
        for (int i = 0; i + 1 < (int)(sizeof cuts / sizeof *cuts); i++)
            rc |= prefill_attention(q, qs, k, v, slots, starts, lens, prow, cuts[i], cuts[i + 1], pw, heads, kv, d,
                                    scale, cap, o, os, bf16, scratch);
        snprintf(name, sizeof name, "%s_split", tag);
        put(name, c, o, CHUNK * os * elem);
        memset(o, 0, CHUNK * os * elem);
        for (int64_t t = 0; t < CHUNK; t++) /* row t alone as a decode row over its own keys */
            rc |= decode_attention(q, qs, k, v, slots + starts[t], NULL, 0, lens + t, prow + t, 1, lens[t], heads, kv,
                                   d, scale, cap, NULL, NULL, o, os, bf16, scratch);
        snprintf(name, sizeof name, "%s_decode", tag);
        put(name, c, o, CHUNK * os * elem);
    }
    free(slab), free(q), free(scratch), free(weights), free(o);
    return rc;
}

/* write_kv: 3 rows of k and v (strided, as split from one projection) into a small cache. */
static void write_case(int c, int bf16) {
    const int64_t kv = 2, d = 16, n = 3, slots_n = 16, elem = bf16 ? 2 : 4, rs = (2 * kv + 1) * d;
    char *kvx = fill(n * rs, bf16), *kc = fill(slots_n * kv * d, bf16), *vc = fill(slots_n * kv * d, bf16);
    int64_t slots[] = {4, 11, 7};
    put("w%d/kv", c, kvx, n * rs * elem);
    put("w%d/k_before", c, kc, slots_n * kv * d * elem);
    put("w%d/v_before", c, vc, slots_n * kv * d * elem);
    put("w%d/slots", c, slots, sizeof slots);
    write_kv(kvx, rs, kvx + kv * d * elem, rs, slots, n, kv * d, elem, kc, vc);
    put("w%d/k_after", c, kc, slots_n * kv * d * elem);
    put("w%d/v_after", c, vc, slots_n * kv * d * elem);
    free(kvx), free(kc), free(vc);
}

/* rope_f32 on 5 rows of 8 heads (rows strided past 3 more heads), over all d or half of it. */
static void rope_case(int c, int64_t r) {
    const int64_t rows = 5, heads = 8, d = 64, xs = (heads + 3) * d;
    float *x = fill(rows * xs, 0), *cs = fill(rows * r, 0), *sn = fill(rows * r, 0), *o = malloc(rows * heads * d * 4);
    rope_f32(x, xs, cs, sn, rows, heads, d, r, o);
    put("r%d/x", c, x, rows * xs * 4);
    put("r%d/cos", c, cs, rows * r * 4);
    put("r%d/sin", c, sn, rows * r * 4);
    put("r%d/out", c, o, rows * heads * d * 4);
    free(x), free(cs), free(sn), free(o);
}

int main(int argc, char **argv) {
    if (argc < 2 || !(out = fopen(argv[1], "wb"))) return 2;
    int c = 0, rc = 0;
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int grouped = 1; grouped >= 0; grouped--)
            for (int64_t d = 64; d <= 128; d += 64)
                for (int capped = 0; capped < 2; capped++)
                    rc |= attention_case(c++, 8, grouped ? 2 : 8, d, bf16, capped ? 2.0f : 0.0f);
    write_case(0, 0);
    write_case(1, 1);
    rope_case(0, 64);
    rope_case(1, 32);
    return fclose(out) || rc ? 1 : 0;
}

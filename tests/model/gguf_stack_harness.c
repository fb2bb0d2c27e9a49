/* tests/model/test_gguf_stack_builds.py builds this with gguf_native.c (included) and kv/attention.c
   (linked beside it, its functions passed in as the Python side passes them) for this machine and for
   aarch64 (run under qemu): `gg_decode_stack` over a tiny 2-layer model of K-quant weights made here
   from an integer LCG, and the same step as the per-layer calls in the fused serving layer's order
   (gguf_layer.forward: norm + q|k|v, rope, KV write, attention, o onto the residual, norm + gate|up,
   silu * up + down onto the residual), adapter rows' LoRA terms after each projection (gguf_native_lora.c:
   rows 0 and 2 on q, every row on v, row 1 on o, rows 0 and 2 on up and down). Writes both results and
   both layers' KV caches to argv[1]. */
#include "gguf_native.c" /* compiled with -I edge_runtime/model */
#include <stdio.h>
#include <stdlib.h>

int decode_attention(const void *q, int64_t q_stride, const void *k_base, const void *v_base, const int64_t *index,
                     const int64_t *entries, int64_t v_shift, const int64_t *lens, const int64_t *rows, int64_t batch,
                     int64_t width, int64_t heads, int64_t kv_heads, int64_t d, float scale, float cap,
                     const uint8_t *mask, float *weights, void *out, int64_t out_stride, int bf16, float *scratch);
void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots, int64_t rows,
              int64_t width, int64_t elem, void *k_cache, void *v_cache);
void rope_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
              int64_t d, int64_t r, float *out);

enum { LAYERS = 2, HIDDEN = 256, HEADS = 4, KV = 2, D = 64, INTER = 256, M = 3, SLOTS = 32, WIDTH = 9, THREADS = 2 };
enum { Q_SIZE = HEADS * D, KV_SIZE = KV * D, NQ = Q_SIZE + 2 * KV_SIZE, NQK = (HEADS + KV) * D };

static uint32_t st = 777u;
static uint32_t rnd(void) { st = st * 1664525u + 1013904223u; return st >> 8; }
static float rndf(float scale) { return ((float)(int32_t)(rnd() % 2001) - 1000.0f) / 1000.0f * scale; }

/* n rows of width k of a K-quant type: random bytes, finite moderate fp16 scales where the block keeps them */
static uint8_t *kquant(int type, int64_t n, int64_t k) {
    int64_t bw = 1, bb = 1;
    block_shape(type, &bw, &bb);
    uint8_t *raw = malloc((size_t)(n * k / bw * bb));
    for (int64_t i = 0; i < n * k / bw * bb; i++) raw[i] = (uint8_t)rnd();
    for (int64_t blk = 0; blk < n * k / bw; blk++)
        for (int a = 0; a < 2; a++) {
            int at = type == T_Q6_K ? (a ? -1 : 208) : 2 * a;
            if (at < 0) continue;
            uint16_t h = (uint16_t)((rnd() & 0x8000) | ((1 + rnd() % 3) << 10) | (rnd() & 0x3ff)); /* 2^-14..2^-12 */
            memcpy(raw + blk * bb + at, &h, 2);
        }
    return raw;
}

/* A grouped weight of n rows of width k in parts of the given types (rows split evenly), columns in order. */
static gg_stack_weight weight(int nparts, const int *types, int64_t n, int64_t k) {
    const uint8_t **raws = malloc(sizeof *raws * nparts);
    int64_t *starts = malloc(sizeof *starts * (nparts + 1)), *cols = malloc(sizeof *cols * n);
    for (int p = 0; p <= nparts; p++) starts[p] = n * p / nparts;
    for (int p = 0; p < nparts; p++) raws[p] = kquant(types[p], starts[p + 1] - starts[p], k);
    for (int64_t i = 0; i < n; i++) cols[i] = i;
    return (gg_stack_weight){types, raws, starts, cols, n, k, nparts, THREADS};
}

static int group(const gg_stack_weight *w, const float *x, int64_t ldx, int prep, const float *norm, float *out,
                 const float *base, float *xf) {
    return gg_group_k8(x, M, w->k, ldx, prep, norm, 0.0f, 1e-5f, xf, w->nparts, w->types, w->raws, w->starts,
                       w->cols, out, w->n, base, w->n, w->threads);
}

/* A LoRA term of rank r from k inputs onto n outputs from column col, on `rows` (NULL: all M). */
static gg_lora_term term(int64_t r, int64_t k, int64_t n, int64_t col, const int64_t *rows, int64_t m) {
    float *a = malloc(sizeof(float) * r * k), *b = malloc(sizeof(float) * n * r);
    for (int64_t i = 0; i < r * k; i++) a[i] = rndf(0.1f);
    for (int64_t i = 0; i < n * r; i++) b[i] = rndf(0.1f);
    return (gg_lora_term){a, b, rows, m, r, k, n, col, 0.5f};
}

int main(int argc, char **argv) {
    FILE *out;
    if (argc < 2 || !(out = fopen(argv[1], "wb"))) return 2;
    static const int qkv_types[3] = {T_Q4_K, T_Q6_K, T_Q5_K}, one[2][1] = {{T_Q6_K}, {T_Q4_K}}, up_types[2] = {T_Q5_K, T_Q4_K};
    gg_stack_layer layers[LAYERS];
    static float caches[2][LAYERS][2][SLOTS * KV_SIZE]; /* [stack, per-layer][layer][k, v] */
    for (int l = 0; l < LAYERS; l++) {
        gg_stack_layer *L = layers + l;
        L->w[0] = weight(3, qkv_types, NQ, HIDDEN);
        L->w[1] = weight(1, one[0], HIDDEN, Q_SIZE);
        L->w[2] = weight(2, up_types, 2 * INTER, HIDDEN);
        L->w[3] = weight(1, one[1], HIDDEN, INTER);
        for (int n = 0; n < 2; n++) {
            float *w = malloc(HIDDEN * sizeof(float));
            for (int i = 0; i < HIDDEN; i++) w[i] = 1.0f + rndf(0.25f);
            L->norm[n] = w;
        }
        for (int kv = 0; kv < 2; kv++)
            for (int i = 0; i < SLOTS * KV_SIZE; i++) caches[0][l][kv][i] = caches[1][l][kv][i] = rndf(1.0f);
        L->k_cache = caches[0][l][0];
        L->v_cache = caches[0][l][1];
        L->table = 0;
    }
    /* M decode rows at positions lens[b] - 1, each over its own slots (its new key into the last) */
    const int64_t lens[M] = {1, 5, WIDTH}, rows[M] = {0, 1, 2};
    int64_t index[M * WIDTH] = {0}, slots[M];
    for (int64_t b = 0; b < M; b++) {
        for (int64_t j = 0; j < lens[b]; j++) index[b * WIDTH + j] = b * 10 + j;
        slots[b] = index[b * WIDTH + lens[b] - 1];
    }
    static float x[M * HIDDEN], x0[M * HIDDEN], x2[M * HIDDEN], cos_t[M * D], sin_t[M * D];
    for (int i = 0; i < M * HIDDEN; i++) x[i] = x0[i] = rndf(1.0f);
    for (int i = 0; i < M * D; i++) cos_t[i] = rndf(1.0f), sin_t[i] = rndf(1.0f);
    const float *cos_p[1] = {cos_t}, *sin_p[1] = {sin_t};
    static float qkv[M * NQ], qk[M * NQK], attn[M * Q_SIZE], gate_up[M * 2 * INTER];
    static float scratch[HEADS * (2 * D + WIDTH + 1) + D]; /* decode_attention's (attention.c) */
    const float scale = 0.125f;                            /* D ** -0.5 */
    static const int64_t two[2] = {0, 2}, middle[1] = {1};
    static gg_lora_term terms[LAYERS * 5];
    static int64_t spans[LAYERS * 4 * 2];
    static float xf[M * INTER];
    for (int l = 0; l < LAYERS; l++) {
        gg_lora_term *t = terms + l * 5;
        t[0] = term(4, HIDDEN, Q_SIZE, 0, two, 2);                   /* q */
        t[1] = term(3, HIDDEN, KV_SIZE, Q_SIZE + KV_SIZE, NULL, M); /* v */
        t[2] = term(4, Q_SIZE, HIDDEN, 0, middle, 1);               /* o */
        t[3] = term(2, HIDDEN, INTER, INTER, two, 2);               /* up */
        t[4] = term(5, INTER, HIDDEN, 0, two, 2);                   /* down */
        const int64_t first[4] = {0, 2, 3, 4}, count[4] = {2, 1, 1, 1};
        for (int s = 0; s < 4; s++) spans[(l * 4 + s) * 2] = l * 5 + first[s], spans[(l * 4 + s) * 2 + 1] = count[s];
    }
    int rc = gg_decode_stack(x, x2, M, HIDDEN, LAYERS, layers, HEADS, KV, D, D, 0.0f, 1e-5f, cos_p, sin_p, slots, index,
                             lens, rows, WIDTH, scale, 0.0f, qkv, qk, attn, gate_up, scratch, (void *)decode_attention,
                             (void *)write_kv, (void *)rope_f32, terms, spans, xf, THREADS);
    fwrite(x, sizeof(float), M * HIDDEN, out);
    /* the same step, layer by layer */
    for (int l = 0; l < LAYERS; l++) {
        const gg_stack_layer *L = layers + l;
        float *kc = caches[1][l][0], *vc = caches[1][l][1];
        const gg_lora_term *t = terms + l * 5;
        rc |= group(&L->w[0], x0, HIDDEN, 1, L->norm[0], qkv, NULL, xf);
        rc |= gg_lora(t, 2, xf, HIDDEN, qkv, NQ, THREADS);
        rope_f32(qkv, NQ, cos_t, sin_t, M, HEADS + KV, D, D, qk);
        write_kv(qk + Q_SIZE, NQK, qkv + Q_SIZE + KV_SIZE, NQ, slots, M, KV_SIZE, sizeof(float), kc, vc);
        rc |= decode_attention(qk, NQK, kc, vc, index, NULL, 0, lens, rows, M, WIDTH, HEADS, KV, D, scale, 0.0f, NULL,
                               NULL, attn, Q_SIZE, 0, scratch);
        rc |= group(&L->w[1], attn, Q_SIZE, 0, NULL, x2, x0, NULL);
        rc |= gg_lora(t + 2, 1, attn, Q_SIZE, x2, HIDDEN, THREADS);
        rc |= group(&L->w[2], x2, HIDDEN, 1, L->norm[1], gate_up, NULL, xf);
        rc |= gg_lora(t + 3, 1, xf, HIDDEN, gate_up, 2 * INTER, THREADS);
        rc |= group(&L->w[3], gate_up, 2 * INTER, 2, NULL, x0, x2, xf);
        rc |= gg_lora(t + 4, 1, xf, INTER, x0, HIDDEN, THREADS);
    }
    fwrite(x0, sizeof(float), M * HIDDEN, out);
    fwrite(caches, sizeof(float), sizeof caches / sizeof(float), out);
    return fclose(out) || rc ? 1 : 0;
}

/* tests/model/test_gguf_kernel.py builds this beside gguf_native.c for another machine (aarch64 under
   qemu): dequantisation, float and int8 products (through the thread pool) for every type on fixed pseudo-random blocks,
   and the fused layer's grouped calls, written to argv[1] for the test to check against gguf's numpy code. */
#include "gguf_native.c" /* compiled with -I edge_runtime/model */
#include <stdio.h>
#include <stdlib.h>
static uint32_t st = 12345;
static uint32_t rnd(void) { st = st * 1664525u + 1013904223u; return st >> 8; }
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    FILE *f = fopen(argv[1], "wb");
    int types[] = {T_F32, T_F16, T_BF16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K};
    const int64_t n = 37, k = 512, m = 13;
    float *x = malloc(m * k * 4), *xs = malloc(m * k / 32 * 4), *dx = malloc(m * k / 32 * 4);
    int8_t *qx = malloc(m * k);
    for (int64_t i = 0; i < m * k; i++) x[i] = ((float)(rnd() % 20001) - 10000.0f) / 5000.0f;
    gg_xsums(x, m, k, xs);
    gg_quantize_x(x, m, k, qx, dx);
    fwrite(qx, 1, m * k, f); fwrite(dx, 4, m * k / 32, f);
    const uint8_t *kept[11];
    float *int8s[11];
    for (int t = 0; t < 11; t++) {
        int64_t bw = 1, bb = 1; block_shape(types[t], &bw, &bb);
        const int64_t rb = k / bw * bb;
        uint8_t *raw = malloc(n * rb);
        for (int64_t i = 0; i < n * rb; i++) raw[i] = (uint8_t)rnd();
        if (types[t] == T_F32) for (int64_t i = 0; i < n * k; i++) { float v = ((float)(rnd() % 2001) - 1000.0f) / 1000.0f; memcpy(raw + 4 * i, &v, 4); }
        /* finite halves wherever a block keeps one (a random normal exponent) */
        int at[3] = {-1, -1, -1};
        switch (types[t]) { case T_Q4_0: case T_Q5_0: case T_Q8_0: at[0] = 0; break; case T_Q4_1: case T_Q5_1: case T_Q4_K: case T_Q5_K: at[0] = 0; at[1] = 2; break; case T_Q6_K: at[0] = 208; break; default: break; }
        if (types[t] == T_F16 || types[t] == T_BF16) for (int64_t i = 0; i < n * k; i++) { uint16_t h = (uint16_t)((rnd() & 0x8000) | ((types[t] == T_F16 ? 10 + rnd() % 6 : 120 + rnd() % 8) << (types[t] == T_F16 ? 10 : 7)) | (rnd() & (types[t] == T_F16 ? 0x3ff : 0x7f))); memcpy(raw + 2 * i, &h, 2); }
        for (int64_t blk = 0; blk < n * k / bw && bw > 1; blk++)
            for (int a = 0; a < 3; a++) if (at[a] >= 0) { uint16_t h = (uint16_t)((rnd() & 0x8000) | ((5 + rnd() % 6) << 10) | (rnd() & 0x3ff)); memcpy(raw + blk * bb + at[a], &h, 2); }
        float *deq = malloc(n * k * 4), *o1 = malloc(m * n * 4), *o2 = malloc(m * n * 4);
        gg_dequant(types[t], raw, n, k, deq);
        gg_matmul_mt(types[t], raw, n, k, x, m, xs, 0, o1, n, 3); /* through the pool: 3 threads */
        memset(o2, 0, m * n * 4);
        if (bw > 1) gg_matmul_mt(types[t], raw, n, k, x, m, xs, 1, o2, n, 3); /* Q4_K/Q6_K: x as q8_K */
        fwrite(raw, 1, n * rb, f); fwrite(deq, 4, n * k, f); fwrite(o1, 4, m * n, f); fwrite(o2, 4, m * n, f);
        kept[t] = raw;
        int8s[t] = o2;
    }
    fwrite(x, 4, m * k, f);
    /* the fused layer's grouped call (gguf_native_fused.c): the Q4_K rows then the Q6_K rows, their
       columns reversed; x as it is onto a base, RMS-normalised, and silu(x) * x2 (x2: x reversed) */
    int gt[2] = {T_Q4_K, T_Q6_K};
    const uint8_t *gr[2] = {kept[8], kept[10]};
    int64_t gs[3] = {0, n, 2 * n}, cols[2 * 37];
    for (int64_t i = 0; i < 2 * n; i++) cols[i] = 2 * n - 1 - i;
    float *base = malloc(m * 2 * n * 4), *go = malloc(m * 2 * n * 4), *nw = malloc(k * 4), *xf = malloc(m * k * 4);
    float *x2 = malloc(m * 2 * k * 4);
    for (int64_t i = 0; i < m * 2 * n; i++) base[i] = ((float)(rnd() % 2001) - 1000.0f) / 100.0f;
    for (int64_t i = 0; i < k; i++) nw[i] = ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) { x2[r * 2 * k + i] = x[r * k + i]; x2[r * 2 * k + k + i] = x[r * k + k - 1 - i]; }
    gg_group_k8(x, m, k, k, 0, NULL, 0.0f, 0.0f, NULL, 2, gt, gr, gs, cols, go, 2 * n, base, 2 * n, 3);
    fwrite(base, 4, m * 2 * n, f); fwrite(go, 4, m * 2 * n, f);
    fwrite(nw, 4, k, f);
    gg_group_k8(x, m, k, k, 1, nw, 0.0f, 1e-5f, xf, 2, gt, gr, gs, cols, go, 2 * n, NULL, 0, 3);
    fwrite(xf, 4, m * k, f); fwrite(go, 4, m * 2 * n, f);
    gg_group_k8(x2, m, k, 2 * k, 2, NULL, 0.0f, 0.0f, xf, 2, gt, gr, gs, cols, go, 2 * n, NULL, 0, 3);
    fwrite(xf, 4, m * k, f); fwrite(go, 4, m * 2 * n, f);
    (void)int8s;
    fclose(f);
    return 0;
}

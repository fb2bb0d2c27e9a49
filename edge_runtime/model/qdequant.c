/* De-quantisation of llama.cpp-style blocks into float32 in one pass (edge_runtime/model/qkernel.py
   builds and loads it; qweights.Blocks.dequantize is the reference it must equal bit for bit).
   Each block: (level - zero) * scale, plus offset where the format has one. The product of a
   level and a scale is exact in float32, so the offset's add is the one rounding, as in torch's
   passes; no offset means no add (adding +0 would turn llama.cpp's -0 into +0). 5- and 6-bit
   levels come as packed low nibbles plus a bit string of the bits above them (qweights.Blocks). */
#include <stdint.h>

void dequant4(const uint8_t *restrict levels, const float *restrict scales, const float *restrict offsets, float zero,
              int64_t blocks, int64_t width, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *q = levels + i * width;
        float *w = out + i * 2 * width;
        const float s = scales[i];
        if (offsets) {
            const float o = offsets[i];
            for (int64_t j = 0; j < width; j++) {
                w[2 * j] = ((float)(q[j] & 15) - zero) * s + o;
                w[2 * j + 1] = ((float)(q[j] >> 4) - zero) * s + o;
            }
        } else {
            for (int64_t j = 0; j < width; j++) {
                w[2 * j] = ((float)(q[j] & 15) - zero) * s;
                w[2 * j + 1] = ((float)(q[j] >> 4) - zero) * s;
            }
        }
    }
}

void dequant8u(const uint8_t *restrict levels, const float *restrict scales, const float *restrict offsets, float zero,
               int64_t blocks, int64_t width, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *q = levels + i * width;
        float *w = out + i * width;
        const float s = scales[i];
        if (offsets) {
            const float o = offsets[i];
            for (int64_t j = 0; j < width; j++) w[j] = ((float)q[j] - zero) * s + o;
        } else {
            for (int64_t j = 0; j < width; j++) w[j] = ((float)q[j] - zero) * s;
        }
    }
}

void dequant8s(const int8_t *restrict levels, const float *restrict scales, const float *restrict offsets, float zero,
               int64_t blocks, int64_t width, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++) {
        const int8_t *q = levels + i * width;
        float *w = out + i * width;
        const float s = scales[i];
        if (offsets) {
            const float o = offsets[i];
            for (int64_t j = 0; j < width; j++) w[j] = ((float)q[j] - zero) * s + o;
        } else {
            for (int64_t j = 0; j < width; j++) w[j] = ((float)q[j] - zero) * s;
        }
    }
}

/* 5/6-bit blocks: each block's levels are put together in a small byte array first, then written
   as floats in one loop; inlined with the block width and high-bit count as constants (the
   formats' own: 32 elements with 1 high bit, 16 with 2), the compiler unrolls the bit picking. */
static inline __attribute__((always_inline)) void hi_blocks(
        const uint8_t *restrict levels, const uint8_t *restrict high, const float *restrict scales,
        const float *restrict offsets, float zero, int64_t blocks, int64_t width, int64_t hb, float *restrict out) {
    const int64_t block = 2 * width, hwidth = block * hb / 8, mask = (1 << hb) - 1;
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *q = levels + i * width;
        const uint8_t *h = high + i * hwidth;
        float *w = out + i * block;
        uint8_t v[block];
        for (int64_t j = 0; j < width; j++) {
            const int64_t a = 2 * j * hb, b = a + hb;
            v[2 * j] = (uint8_t)((q[j] & 15) | (((h[a >> 3] >> (a & 7)) & mask) << 4));
            v[2 * j + 1] = (uint8_t)((q[j] >> 4) | (((h[b >> 3] >> (b & 7)) & mask) << 4));
        }
        const float s = scales[i];
        if (offsets) {
            const float o = offsets[i];
            for (int64_t j = 0; j < block; j++) w[j] = ((float)v[j] - zero) * s + o;
        } else {
            for (int64_t j = 0; j < block; j++) w[j] = ((float)v[j] - zero) * s;
        }
    }
}

void dequant_hi(const uint8_t *restrict levels, const uint8_t *restrict high, const float *restrict scales,
                const float *restrict offsets, float zero, int64_t blocks, int64_t width, int64_t hb,
                float *restrict out) {
    if (width == 16 && hb == 1) {
        hi_blocks(levels, high, scales, offsets, zero, blocks, 16, 1, out);
    } else if (width == 8 && hb == 2) {
        hi_blocks(levels, high, scales, offsets, zero, blocks, 8, 2, out);
    } else {
        hi_blocks(levels, high, scales, offsets, zero, blocks, width, hb, out);
    }
}

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

/* 5/6-bit blocks: eight levels at a time are put together in one 64-bit word (four bytes of low
   nibbles spread one to a byte, the high bits of the eight spread by a table to bit 4 of each
   byte), then written as floats; where a block is not a multiple of 8 long, or the machine is not
   little-endian, bit by bit. */
#include <string.h>

static uint64_t SPREAD1[256]; /* bit t of a byte -> bit 8t */
static uint32_t SPREAD2[256]; /* bits 2t, 2t+1 of a byte -> bits 8t, 8t+1 */

__attribute__((constructor)) static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t one = 0;
        uint32_t two = 0;
        for (int t = 0; t < 8; t++) one |= (uint64_t)((b >> t) & 1) << (8 * t);
        for (int t = 0; t < 4; t++) two |= (uint32_t)((b >> (2 * t)) & 3) << (8 * t);
        SPREAD1[b] = one;
        SPREAD2[b] = two;
    }
}

static inline uint64_t spread_nibbles(uint32_t x) { /* nibble t -> the low half of byte t */
    uint64_t v = x;
    v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
    v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
    return (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
}

static inline __attribute__((always_inline)) void hi_blocks(
        const uint8_t *restrict levels, const uint8_t *restrict high, const float *restrict scales,
        const float *restrict offsets, float zero, int64_t blocks, int64_t width, int64_t hb, float *restrict out) {
    const int64_t block = 2 * width, hwidth = block * hb / 8, mask = (1 << hb) - 1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const int words = block % 8 == 0;
#else
    const int words = 0;
#endif
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *q = levels + i * width;
        const uint8_t *h = high + i * hwidth;
        float *w = out + i * block;
        uint8_t v[block];
        if (words) {
            for (int64_t e = 0; e < block; e += 8) {
                uint32_t low;
                memcpy(&low, q + e / 2, 4);
                const uint64_t up = hb == 1 ? SPREAD1[h[e / 8]]
                                            : (uint64_t)SPREAD2[h[e / 4]] | (uint64_t)SPREAD2[h[e / 4 + 1]] << 32;
                const uint64_t word = spread_nibbles(low) | up << 4;
                memcpy(v + e, &word, 8);
            }
        } else {
            for (int64_t j = 0; j < width; j++) {
                const int64_t a = 2 * j * hb, b = a + hb;
                v[2 * j] = (uint8_t)((q[j] & 15) | (((h[a >> 3] >> (a & 7)) & mask) << 4));
                v[2 * j + 1] = (uint8_t)((q[j] >> 4) | (((h[b >> 3] >> (b & 7)) & mask) << 4));
            }
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

/* Factored (K-quant) scales per block: out[g * per + j] = base[g] * step[g * per + j], the same
   float32 product as torch's broadcast multiply (whose broadcast over 8 steps a group cost as
   much as the de-quantisation itself). */
void per_block_u8(const float *restrict base, const uint8_t *restrict steps, int64_t groups, int64_t per,
                  float *restrict out) {
    for (int64_t g = 0; g < groups; g++) {
        const float b = base[g];
        for (int64_t j = 0; j < per; j++) out[g * per + j] = b * (float)steps[g * per + j];
    }
}

void per_block_s8(const float *restrict base, const int8_t *restrict steps, int64_t groups, int64_t per,
                  float *restrict out) {
    for (int64_t g = 0; g < groups; g++) {
        const float b = base[g];
        for (int64_t j = 0; j < per; j++) out[g * per + j] = b * (float)steps[g * per + j];
    }
}

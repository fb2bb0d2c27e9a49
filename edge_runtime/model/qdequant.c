/* De-quantisation of llama.cpp-style blocks into float32 in one pass (edge_runtime/model/qkernel.py
   builds and loads it; qweights.Blocks.dequantize is the reference it must equal bit for bit).
   Each block: (level - zero) * scale, plus offset where the format has one. The product of a
   level and a scale is exact in float32, so the offset's add is the one rounding, as in torch's
   passes; no offset means no add (adding +0 would turn llama.cpp's -0 into +0). */
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

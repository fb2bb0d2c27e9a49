/* The fused serving layer's one call per projection (part of gguf_native.c, included after
   gguf_native_pool.c; edge_runtime/model/gguf_layer.py drives it): x prepared (as it is,
   RMS-normalised, or silu(gate) * up) and quantised to q8_K once, then the products of every part of
   a weight (q|k|v, gate|up: K-quant tensors of the file) in one pool job, each weight row's output
   written straight to its model column, onto a base (the residual) where one is given. */

/* e^x for x in [-87, 88] (clamped there): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to
   r^8, 2^n put in the exponent (0.77 ulp at most, measured against double exp over the range in steps
   of 0.001). n = round(x / ln 2) is read from the low mantissa bits of x / ln 2 + 1.5 * 2^23: no float
   to int conversion, so the loops calling it vectorise without -fno-trapping-math. */
static inline float fused_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504f + 12582912.0f;
    const float n = t - 12582912.0f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts: n * hi is exact */
    float p = 1.0f / 40320.0f;
    p = p * r + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, 4);
    bits = (bits + 127u) << 23; /* t's low 9 bits are n mod 512: n + 127 in [1, 254], the exponent */
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* One row of x prepared into v[0..k): prep 0 copies, 1 RMS-normalises as llama.py's rms_norm does in
   float32 (x * rsqrt(mean(x^2) + eps), times w, or times (offset + w) where offset is not 0), 2 takes
   silu(x[l]) * x[k + l] (the fused gate|up row). */
static void fused_prep(int prep, const float *x, int64_t k, const float *w, float offset, float eps, float *v) {
    if (prep == 1) {
        double part[8] = {0}, ss = 0.0; /* eight double sums (k is a multiple of 256): they vectorise */
        for (int64_t l = 0; l < k; l += 8)
            for (int e = 0; e < 8; e++) part[e] += (double)x[l + e] * (double)x[l + e];
        for (int e = 0; e < 8; e++) ss += part[e];
        const float r = 1.0f / __builtin_sqrtf((float)ss / (float)k + eps);
        if (offset != 0.0f)
            for (int64_t l = 0; l < k; l++) v[l] = (x[l] * r) * (offset + w[l]);
        else
            for (int64_t l = 0; l < k; l++) v[l] = w[l] * (x[l] * r);
    } else if (prep == 2) {
        for (int64_t l = 0; l < k; l++) v[l] = x[l] / (1.0f + fused_exp(-x[l])) * x[k + l];
    } else {
        memcpy(v, x, (size_t)k * 4);
    }
}

typedef struct {
    const int *types;
    const uint8_t *const *raws;
    const int64_t *starts; /* each part's first row in the whole weight; starts[nparts] = its rows */
    const int64_t *cols;   /* each weight row's model column */
    int64_t k, m, ldo, ldb;
    const int8_t *qx;
    const float *dx;
    const int16_t *bs;
    float *out;
    const float *base;
    /* the preparation, run over rows of x before the products */
    const float *x, *w;
    int64_t ldx, ldv;
    int prep;
    float offset, eps;
    float *v;
} gjob;

#define GROUP_ROWS 64
#ifndef GG_PREP_ROWS
#define GG_PREP_ROWS 64 /* a prefill chunk: below it, a second pool job per call cost more than it saved (1B, 8 rows: 118-119 against 127-131 ms a step, load 4.4-5) */
#endif

static void gjob_prep(const void *p, int64_t lo, int64_t hi) {
    const gjob *j = (const gjob *)p;
    for (int64_t r = lo; r < hi; r++) {
        float *v = j->v + r * j->ldv;
        fused_prep(j->prep, j->x + r * j->ldx, j->k, j->w, j->offset, j->eps, v);
        gg_quantize_k8(v, 1, j->k, (int8_t *)j->qx + r * j->k, (float *)j->dx + r * (j->k / 256),
                       (int16_t *)j->bs + r * (j->k / 16));
    }
}

static void gjob_range(const void *p, int64_t lo, int64_t hi) {
    const gjob *j = (const gjob *)p;
    float tmp[MAX_ROWS * GROUP_ROWS];
    int part = 0;
    while (lo < hi) {
        while (j->starts[part + 1] <= lo) part++;
        int64_t end = j->starts[part + 1] < hi ? j->starts[part + 1] : hi;
        end = end < lo + GROUP_ROWS ? end : lo + GROUP_ROWS;
        const int type = j->types[part];
        const int64_t rb = j->k / 256 * (type == T_Q4_K ? 144 : (type == T_Q5_K ? 176 : 210)), n = end - lo;
        const uint8_t *raw = j->raws[part] + (lo - j->starts[part]) * rb;
        const int64_t *cols = j->cols + lo;
        for (int64_t r0 = 0; r0 < j->m; r0 += MAX_ROWS) {
            const int64_t mm = j->m - r0 < MAX_ROWS ? j->m - r0 : MAX_ROWS;
            k8_rows(type, raw, rb, n, j->k, j->qx + r0 * j->k, j->dx + r0 * (j->k / 256), j->bs + r0 * (j->k / 16), mm,
                    tmp, GROUP_ROWS);
            for (int64_t r = 0; r < mm; r++) {
                float *o = j->out + (r0 + r) * j->ldo;
                const float *t = tmp + r * GROUP_ROWS;
                if (j->base) {
                    const float *b = j->base + (r0 + r) * j->ldb;
                    for (int64_t i = 0; i < n; i++) o[cols[i]] = b[cols[i]] + t[i];
                } else {
                    for (int64_t i = 0; i < n; i++) o[cols[i]] = t[i];
                }
            }
        }
        lo = end;
    }
}

/* out[r * ldo + cols[i]] = (base[r * ldb + cols[i]] +) W[i] . q8_K(prep(x[r])) for the m rows of x
   (float32, row stride ldx) and every row i of the nparts weights (types[p]: Q4_K, Q5_K or Q6_K, n_p =
   starts[p + 1] - starts[p] rows of width k at raws[p]). prep: 0 x as it is, 1 RMS-normalised with
   weight w (offset, eps), 2 silu(x[:, :k]) * x[:, k:2k]. xf (float32 [m, k]) receives the prepared
   rows where not NULL. A row's value depends on that row of x alone. -1 for a type or width not
   handled (nothing written), -2 for a failed allocation. */
int gg_group_k8(const float *x, int64_t m, int64_t k, int64_t ldx, int prep, const float *w, float offset, float eps,
                float *xf, int nparts, const int *types, const uint8_t *const *raws, const int64_t *starts,
                const int64_t *cols, float *out, int64_t ldo, const float *base, int64_t ldb, int threads) {
    if (k <= 0 || k % 256 || m <= 0) return m <= 0 ? 0 : -1;
    for (int p = 0; p < nparts; p++)
        if (types[p] != T_Q4_K && types[p] != T_Q5_K && types[p] != T_Q6_K) return -1;
    void *scratch = malloc((size_t)(m * k + m * (k / 256) * 4 + m * (k / 16) * 2 + (xf ? 0 : m * k * 4) + 64));
    if (scratch == NULL) return -2;
    float *v = xf ? xf : (float *)scratch;
    int8_t *qx = (int8_t *)scratch + (xf ? 0 : m * k * 4);
    float *dx = (float *)(qx + ((m * k + 3) & ~(int64_t)3));
    int16_t *bs = (int16_t *)(dx + m * (k / 256));
    const gjob j = {.types = types, .raws = raws, .starts = starts, .cols = cols, .k = k, .m = m, .ldo = ldo,
                    .ldb = ldb, .qx = qx, .dx = dx, .bs = bs, .out = out, .base = base, .x = x, .w = w, .ldx = ldx,
                    .ldv = k, .prep = prep, .offset = offset, .eps = eps, .v = v};
    pool_run(gjob_prep, &j, m, m >= GG_PREP_ROWS ? threads : 1); /* a few rows: the wake costs more than it saves */
    pool_run(gjob_range, &j, starts[nparts], threads);
    free(scratch);
    return 0;
}

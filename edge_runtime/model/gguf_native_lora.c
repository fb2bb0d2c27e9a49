/* LoRA terms on the serving rows (part of gguf_native.c, included after gguf_native_pool.c): a row's
   out += scale * B (A x), with A [r, k] and B [n, r] float32, computed for each listed row alone in a
   fixed order (A's dots in eight lanes, then B's rank sums in order): a row's term does not depend on
   the rows beside it, how many share its adapter, or the thread that computes it. The fused serving
   layer (gguf_layer.py) and the decode stack (gguf_native_stack.c) both add their adapters' terms
   here, so the two paths give an adapter row the same bits. */

#define LORA_MAX_RANK 512

/* One adapter's term on one projection: rows[i] (NULL: row i, for i < m) of a stage's x onto the
   same row of its output, columns col .. col + n. */
typedef struct {
    const float *a, *b;
    const int64_t *rows;
    int64_t m, r, k, n, col;
    float scale;
} gg_lora_term;

typedef struct {
    const gg_lora_term *t;
    const float *x;
    float *out;
    int64_t ldx, ldo;
} lora_call;

static inline float lora_dot(const float *a, const float *x, int64_t k) {
    float s[8] = {0};
    int64_t l = 0;
    for (; l + 8 <= k; l += 8)
        for (int e = 0; e < 8; e++) s[e] += a[l + e] * x[l + e];
    for (int e = 0; l < k; l++, e++) s[e] += a[l] * x[l];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static void lora_job(const void *p, int64_t lo, int64_t hi) {
    const lora_call *c = (const lora_call *)p;
    const gg_lora_term *j = c->t;
    float t[LORA_MAX_RANK];
    for (int64_t i = lo; i < hi; i++) {
        const int64_t row = j->rows ? j->rows[i] : i;
        const float *x = c->x + row * c->ldx;
        float *o = c->out + row * c->ldo + j->col;
        for (int64_t q = 0; q < j->r; q++) t[q] = lora_dot(j->a + q * j->k, x, j->k);
        int64_t n = 0;
        for (; n + 8 <= j->n; n += 8) { /* 8 outputs' sums side by side, each in rank order */
            const float *b = j->b + n * j->r;
            float s[8] = {0};
            for (int64_t q = 0; q < j->r; q++)
                for (int e = 0; e < 8; e++) s[e] += b[e * j->r + q] * t[q];
            for (int e = 0; e < 8; e++) o[n + e] = o[n + e] + s[e] * j->scale;
        }
        for (; n < j->n; n++) {
            const float *b = j->b + n * j->r;
            float s = 0.0f;
            for (int64_t q = 0; q < j->r; q++) s += b[q] * t[q];
            o[n] = o[n] + s * j->scale;
        }
    }
}

/* Multiply-adds a term's rows take at least before its rows split over the pool's threads. */
#define LORA_PARALLEL_MIN (1 << 20)

/* The terms[0 .. count) of one stage onto out (row stride ldo) from x (row stride ldx); `threads`
   split each term's rows where they hold LORA_PARALLEL_MIN multiply-adds (a wake costs more than a
   rank-8 term of a few rows). -1 where a rank is past LORA_MAX_RANK (nothing written). */
int gg_lora(const gg_lora_term *terms, int64_t count, const float *x, int64_t ldx, float *out, int64_t ldo, int threads) {
    for (int64_t e = 0; e < count; e++)
        if (terms[e].r > LORA_MAX_RANK || terms[e].r < 1) return -1;
    for (int64_t e = 0; e < count; e++) {
        const lora_call c = {.t = terms + e, .x = x, .out = out, .ldx = ldx, .ldo = ldo};
        const gg_lora_term *t = terms + e;
        pool_run(lora_job, &c, t->m, t->m * t->r * (t->k + t->n) >= LORA_PARALLEL_MIN ? threads : 1);
    }
    return 0;
}

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
    float *out, *ax; /* ax [m, r]: A x of each listed row */
    int64_t ldx, ldo, blocks;
} lora_call;

#define LORA_COLS 64 /* outputs a block of the second pass takes */

static inline float lora_dot(const float *a, const float *x, int64_t k) {
    float s[8] = {0};
    int64_t l = 0;
    for (; l + 8 <= k; l += 8)
        for (int e = 0; e < 8; e++) s[e] += a[l + e] * x[l + e];
    for (int e = 0; l < k; l++, e++) s[e] += a[l] * x[l];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static inline int64_t lora_row(const gg_lora_term *j, int64_t i) { return j->rows ? j->rows[i] : i; }

/* First pass, item i = (listed row i / r, rank q = i % r): ax[i] = A[q] . x[row]. */
static void lora_ax(const void *p, int64_t lo, int64_t hi) {
    const lora_call *c = (const lora_call *)p;
    const gg_lora_term *j = c->t;
    for (int64_t i = lo; i < hi; i++)
        c->ax[i] = lora_dot(j->a + (i % j->r) * j->k, c->x + lora_row(j, i / j->r) * c->ldx, j->k);
}

/* Second pass, item i = (listed row i / blocks, LORA_COLS outputs from (i % blocks) * LORA_COLS):
   out[row, col + n] += scale * (B[n] . ax[row]), each sum in rank order, 8 outputs side by side. */
static void lora_bx(const void *p, int64_t lo, int64_t hi) {
    const lora_call *c = (const lora_call *)p;
    const gg_lora_term *j = c->t;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t li = i / c->blocks, n0 = (i % c->blocks) * LORA_COLS;
        const int64_t n1 = n0 + LORA_COLS < j->n ? n0 + LORA_COLS : j->n;
        const float *t = c->ax + li * j->r;
        float *o = c->out + lora_row(j, li) * c->ldo + j->col;
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8) {
            const float *b = j->b + n * j->r;
            float s[8] = {0};
            for (int64_t q = 0; q < j->r; q++)
                for (int e = 0; e < 8; e++) s[e] += b[e * j->r + q] * t[q];
            for (int e = 0; e < 8; e++) o[n + e] = o[n + e] + s[e] * j->scale;
        }
        for (; n < n1; n++) {
            const float *b = j->b + n * j->r;
            float s = 0.0f;
            for (int64_t q = 0; q < j->r; q++) s += b[q] * t[q];
            o[n] = o[n] + s * j->scale;
        }
    }
}

/* Multiply-adds a pass takes at least before it splits over the pool's threads. */
#define LORA_PARALLEL_MIN (1 << 16)

/* The terms[0 .. count) of one stage onto out (row stride ldo) from x (row stride ldx), each in two
   passes (A x of every listed row, then B's sums by blocks of outputs); `threads` split a pass of
   LORA_PARALLEL_MIN multiply-adds or more (a wake costs more than a small term). -1 where a rank is
   past LORA_MAX_RANK, -2 for a failed allocation (nothing written). */
int gg_lora(const gg_lora_term *terms, int64_t count, const float *x, int64_t ldx, float *out, int64_t ldo, int threads) {
    int64_t most = 0;
    for (int64_t e = 0; e < count; e++) {
        if (terms[e].r > LORA_MAX_RANK || terms[e].r < 1) return -1;
        most = terms[e].m * terms[e].r > most ? terms[e].m * terms[e].r : most;
    }
    float *ax = malloc(sizeof(float) * (size_t)(most > 0 ? most : 1));
    if (ax == NULL) return -2;
    for (int64_t e = 0; e < count; e++) {
        const gg_lora_term *t = terms + e;
        const lora_call c = {.t = t, .x = x, .out = out, .ax = ax, .ldx = ldx, .ldo = ldo,
                             .blocks = (t->n + LORA_COLS - 1) / LORA_COLS};
        pool_run(lora_ax, &c, t->m * t->r, t->m * t->r * t->k >= LORA_PARALLEL_MIN ? threads : 1);
        pool_run(lora_bx, &c, t->m * c.blocks, t->m * t->r * t->n >= LORA_PARALLEL_MIN ? threads : 1);
    }
    free(ax);
    return 0;
}

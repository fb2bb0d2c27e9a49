/* The decode stack (part of gguf_native.c, included after gguf_native_fused.c): every layer of a
   decode-only step over a GGUF read in place in one call, each layer the fused serving layer's
   calls in its order (gguf_layer.forward without LoRA): norm + q|k|v, rope, KV write, per-row
   attention, o_proj onto the residual, norm + gate|up, silu * up + down onto the residual. The
   rope, KV write and attention are kv/attention.c's own functions, passed in as pointers, and the
   adapter rows' LoRA terms gguf_native_lora.c's, after each projection as that layer adds them: the
   bits are the per-layer path's. */

/* One grouped weight of a layer (a GroupPlan's arrays) and the threads its products take. */
typedef struct {
    const int *types;
    const uint8_t *const *raws;
    const int64_t *starts;
    const int64_t *cols;
    int64_t n, k;
    int nparts, threads;
} gg_stack_weight;

/* A layer: q|k|v, o, gate|up, down; its two norms' weights; its KV cache planes; its rope table. */
typedef struct {
    gg_stack_weight w[4];
    const float *norm[2];
    void *k_cache, *v_cache;
    int64_t table;
} gg_stack_layer;

typedef int (*gg_attention_fn)(const void *, int64_t, const void *, const void *, const int64_t *, const int64_t *,
                               int64_t, const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                               float, float, const uint8_t *, float *, void *, int64_t, int, float *);
typedef void (*gg_write_kv_fn)(const void *, int64_t, const void *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                               void *, void *);
typedef void (*gg_rope_fn)(const float *, int64_t, const float *, const float *, int64_t, int64_t, int64_t, int64_t,
                           float *);

static int stack_group(const gg_stack_weight *w, const float *x, int64_t m, int64_t ldx, int prep, const float *norm,
                       float offset, float eps, float *out, const float *base, float *xf) {
    return gg_group_k8(x, m, w->k, ldx, prep, norm, offset, eps, xf, w->nparts, w->types, w->raws, w->starts,
                       w->cols, out, w->n, base, w->n, w->threads);
}

/* Layer l's stage s LoRA terms (spans [layers * 4, 2]: first term, count) onto out from x. */
static int stack_lora(const gg_lora_term *terms, const int64_t *spans, int64_t l, int s, const float *x, int64_t ldx,
                      float *out, int64_t ldo, int threads) {
    const int64_t *span = spans + (l * 4 + s) * 2;
    return span[1] ? gg_lora(terms + span[0], span[1], x, ldx, out, ldo, threads) : 0;
}

/* x [m, hidden] float32 in and out (x2 the same size, scratch); m decode rows, row b at position
   lens[b] - 1 of its sequence, its new key/value to slot slots[b], its keys at index[b, :lens[b]]
   (index [m, width]). cos/sin: per rope table, [m, r]. qkv [m, q + 2 kv], qk [m, heads + kv_heads,
   d], attn [m, heads * d], gate_up [m, 2 inter] and scratch (decode_attention's) are the caller's
   buffers. LoRA: `terms` and `spans` as stack_lora reads them (NULL: none), `xf` [m, intermediate]
   (and >= hidden) the prepared rows they read, `threads` their split. Returns 0, or the first failing
   call's code (nothing later runs). */
int gg_decode_stack(float *x, float *x2, int64_t m, int64_t hidden, int64_t layers, const gg_stack_layer *stack,
                    int64_t heads, int64_t kv_heads, int64_t d, int64_t r, float offset, float eps,
                    const float *const *cos, const float *const *sin, const int64_t *slots, const int64_t *index,
                    const int64_t *lens, const int64_t *rows, int64_t width, float scale, float cap, float *qkv,
                    float *qk, float *attn, float *gate_up, float *scratch, void *attention, void *write_kv, void *rope,
                    const gg_lora_term *terms, const int64_t *spans, float *xf, int threads) {
    const gg_attention_fn attend = (gg_attention_fn)attention;
    const gg_write_kv_fn write = (gg_write_kv_fn)write_kv;
    const gg_rope_fn turn = (gg_rope_fn)rope;
    const int64_t q_size = heads * d, kv_size = kv_heads * d, nq = q_size + 2 * kv_size, nqk = (heads + kv_heads) * d;
    for (int64_t l = 0; l < layers; l++) {
        const gg_stack_layer *L = stack + l;
        float *keep = spans ? xf : NULL;
        int rc = stack_group(&L->w[0], x, m, hidden, 1, L->norm[0], offset, eps, qkv, NULL, keep);
        if (rc || (spans && (rc = stack_lora(terms, spans, l, 0, xf, hidden, qkv, nq, threads)))) return rc;
        turn(qkv, nq, cos[L->table], sin[L->table], m, heads + kv_heads, d, r, qk);
        write(qk + q_size, nqk, qkv + q_size + kv_size, nq, slots, m, kv_size, (int64_t)sizeof(float), L->k_cache,
              L->v_cache);
        rc = attend(qk, nqk, L->k_cache, L->v_cache, index, NULL, 0, lens, rows, m, width, heads, kv_heads, d, scale,
                    cap, NULL, NULL, attn, q_size, 0, scratch);
        if (rc) return rc;
        const int64_t inter = L->w[3].k;
        if ((rc = stack_group(&L->w[1], attn, m, q_size, 0, NULL, 0.0f, 0.0f, x2, x, NULL))) return rc;
        if (spans && (rc = stack_lora(terms, spans, l, 1, attn, q_size, x2, hidden, threads))) return rc;
        if ((rc = stack_group(&L->w[2], x2, m, hidden, 1, L->norm[1], offset, eps, gate_up, NULL, keep))) return rc;
        if (spans && (rc = stack_lora(terms, spans, l, 2, xf, hidden, gate_up, 2 * inter, threads))) return rc;
        if ((rc = stack_group(&L->w[3], gate_up, m, 2 * inter, 2, NULL, 0.0f, 0.0f, x, x2, keep))) return rc;
        if (spans && (rc = stack_lora(terms, spans, l, 3, xf, inter, x, hidden, threads))) return rc;
    }
    return 0;
}

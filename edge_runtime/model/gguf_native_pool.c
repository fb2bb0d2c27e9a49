/* The library's persistent thread pool and the products and de-quantisation it runs (part of
   gguf_native.c, included after gguf_native_k8.c). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

/* --- the pool: threads - 1 workers (created on first use, grown on demand, never joined) spin
   for SPIN_NS after each job, then sleep on a condition variable. A product's weight rows are cut
   into CHUNKS_PER_THREAD chunks per thread, which the calling thread and the workers claim one at a
   time from one atomic word (job generation | chunk count | next chunk): a worker that has lost its
   core (a busy box) delays the product by at most the chunk it holds, as the others take the rest.
   One product at a time uses the pool (another caller meanwhile runs its whole range itself), and a
   forked child starts with none. */
#define POOL_MAX 64
#define SPIN_NS 200000
#define CHUNKS_PER_THREAD 8
typedef void (*range_fn)(const void *job, int64_t lo, int64_t hi);
static struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t wake;
    atomic_uint gen;
    _Atomic uint64_t claim;
    atomic_long done;
    int workers, sleepers, forked_hook, active; /* active: the workers that take part (id < active) */
    unsigned first_gen[POOL_MAX];
    range_fn fn;
    const void *job;
    int64_t n, step;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claims and runs chunks of the current job until none is left. The job's fields were written
   before the claim word was published (release), and a claimed chunk holds the job in place until
   it is counted done. */
static void pool_claim_all(void) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
        const uint64_t chunks = (c >> 24) & 0xffffff, next = c & 0xffffff;
        if (next >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        const int64_t lo = (int64_t)next * pool.step, hi = lo + pool.step < pool.n ? lo + pool.step : pool.n;
        if (lo < hi) pool.fn(pool.job, lo, hi);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg; /* 0.. */
    unsigned seen = pool.first_gen[id];
    for (;;) {
        const int64_t start = now_ns();
        for (int spins = 0; atomic_load_explicit(&pool.gen, memory_order_acquire) == seen; spins++) {
            cpu_relax();
            if ((spins & 255) == 255 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&pool.lock);
                pool.sleepers++;
                while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen)
                    pthread_cond_wait(&pool.wake, &pool.lock);
                pool.sleepers--;
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        if (id < pool.active) pool_claim_all(); /* a pool grown for more threads than this job's */
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has no workers: start afresh */
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.sleepers = 0;
    atomic_store(&pool.claim, 0);
}

/* fn(job, lo, hi) over [0, n) on `threads` threads (the calling one included). */
static void pool_run(range_fn fn, const void *job, int64_t n, int threads) {
    threads = threads < 1 ? 1 : (threads > POOL_MAX ? POOL_MAX : threads);
    if ((int64_t)threads > n) threads = (int)n;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(job, 0, n);
        return;
    }
    if (!pool.forked_hook) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        pool.forked_hook = 1;
    }
    while (pool.workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.first_gen[pool.workers] = atomic_load(&pool.gen);
        const int failed = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    if (pool.workers == 0) {
        pthread_mutex_unlock(&pool.busy);
        fn(job, 0, n);
        return;
    }
    int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    chunks = chunks > n ? n : chunks;
    pool.active = threads - 1;
    pool.fn = fn;
    pool.job = job;
    pool.n = n;
    pool.step = (n + chunks - 1) / chunks;
    chunks = (n + pool.step - 1) / pool.step;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const unsigned gen = atomic_load(&pool.gen) + 1;
    atomic_store_explicit(&pool.claim, ((uint64_t)(gen & 0xffff) << 48) | ((uint64_t)chunks << 24), memory_order_release);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.gen, gen, memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    pool_claim_all();
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield(); /* a worker holding the last chunk has lost its core: give it ours */
    }
    pthread_mutex_unlock(&pool.busy);
}

/* --- the products through the pool --------------------------------------------------------- */
typedef struct {
    int kind, type; /* kind 0: de-quantise, 1: float x, 2: int8 x per 32 (gg_matmul_q8), 3: q8_K x,
                       4: Q8_0 with x per 32 (AVX-512) */
    const uint8_t *raw;
    int64_t rb, k, m, ldo;
    const float *x, *xs, *dx;
    const int8_t *qx;
    const int16_t *bs;
    float *out;
} pjob;

static void pjob_range(const void *p, int64_t lo, int64_t hi) {
    const pjob *j = (const pjob *)p;
    const uint8_t *raw = j->raw + lo * j->rb;
    switch (j->kind) {
    case 0: gg_dequant(j->type, raw, hi - lo, j->k, j->out + lo * j->k); break;
    case 1: gg_matmul(j->type, raw, hi - lo, j->k, j->x, j->m, j->xs, j->out + lo, j->ldo); break;
    case 2: gg_matmul_q8(j->type, raw, hi - lo, j->k, j->qx, j->dx, j->m, j->xs, j->out + lo, j->ldo); break;
#if defined(GG_Q80_DECODE)
    case 4:
        for (int64_t r0 = 0; r0 < j->m; r0 += MAX_ROWS) {
            const int64_t mm = j->m - r0 < MAX_ROWS ? j->m - r0 : MAX_ROWS;
            q80_rows(raw, j->rb, hi - lo, j->k, j->qx + r0 * j->k, j->dx + r0 * (j->k / 32), mm,
                     j->out + r0 * j->ldo + lo, j->ldo);
        }
        break;
#endif
    default:
        for (int64_t r0 = 0; r0 < j->m; r0 += MAX_ROWS) {
            const int64_t mm = j->m - r0 < MAX_ROWS ? j->m - r0 : MAX_ROWS;
            k8_rows(j->type, raw, j->rb, hi - lo, j->k, j->qx + r0 * j->k, j->dx + r0 * (j->k / 256),
                    j->bs + r0 * (j->k / 16), mm, j->out + r0 * j->ldo + lo, j->ldo);
        }
        break;
    }
}

/* As gg_dequant over n rows, cut into `threads` ranges. */
int gg_dequant_mt(int type, const uint8_t *raw, int64_t n, int64_t k, float *out, int threads) {
    int64_t bw, bb;
    if (block_shape(type, &bw, &bb)) return -1;
    const pjob j = {.kind = 0, .type = type, .raw = raw, .rb = k / bw * bb, .k = k, .out = out};
    pool_run(pjob_range, &j, n, threads);
    return 0;
}

/* out[r * ldo + i] = x[r] . W[i] for the m rows of x (float32 [m, k]) and n weight rows. int8 = 0:
   x stays float (gg_matmul; xs from gg_xsums for the offset types); int8 = 1: x quantised per 32
   (gg_matmul_q8); Q4_K, Q5_K and Q6_K with int8 = 1 take x as q8_K (gg_quantize_k8) and the kernels
   above. -1 for a type not handled. */
int gg_matmul_mt(int type, const uint8_t *raw, int64_t n, int64_t k, const float *x, int64_t m, const float *xs,
                 int int8, float *out, int64_t ldo, int threads) {
    int64_t bw, bb;
    if (block_shape(type, &bw, &bb) || (int8 && (bw == 1 || k % 32))) return -1;
    pjob j = {.kind = 1, .type = type, .raw = raw, .rb = k / bw * bb, .k = k, .m = m, .ldo = ldo, .x = x,
              .xs = xs, .out = out};
    void *scratch = NULL;
    if (int8) {
        const int kq = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
        scratch = malloc((size_t)(m * k + m * (k / 32) * 4 + m * (k / 16) * 2 + 64));
        if (scratch == NULL) return -2;
        int8_t *qx = (int8_t *)scratch;
        float *dx = (float *)(qx + ((m * k + 3) & ~(int64_t)3));
        int16_t *bs = (int16_t *)(dx + m * (k / 32));
        if (kq) gg_quantize_k8(x, m, k, qx, dx, bs);
        else gg_quantize_x(x, m, k, qx, dx);
        j.kind = kq ? 3 : 2;
#if defined(GG_Q80_DECODE)
        if (type == T_Q8_0) j.kind = 4;
#endif
        j.qx = qx;
        j.dx = dx;
        j.bs = bs;
    }
    pool_run(pjob_range, &j, n, threads);
    free(scratch);
    return 0;
}

/* A whole decode step of the decoder's layers in one call: for every sequence's one new token, layer by layer,
 *
 *   h += o_proj(attention(rope(qkv_proj(rms_norm(h)))))        (K/V stored into the paged cache first)
 *   h += down_proj(silu(gate) * up),  gate | up = gate_up_proj(rms_norm(h))
 *
 * the same maths as llama.py's torch path with the same int4 kernel (kernels.h) and the same RMSNorm, so
 * the two differ only where torch's own ops are not reproduced bit for bit: the softmax and SiLU (exp) and
 * the attention's summation order. RoPE is ``x * cos + roll(x, D/2) * sin_signed`` with RotaryEmbedding's
 * tables, rounded as torch rounds it (no contraction into fma: built with -ffp-contract=off).
 *
 * Why: at one decoding token a layer is ~50 small torch ops of a few microseconds each, as long as its int4
 * matmuls; here a step is one call (one OpenMP region), whose threads share each phase's work by claiming
 * it (below: no barrier waits for a thread that is not running). Small row-wise work (norm, activation
 * quantization, SiLU * up) is done by every thread into its own scratch rather than by one thread while the
 * others wait: at a few rows it costs less than the wait would.
 *
 * The KV cache of a layer is float32 [2, blocks, block_size, kv_heads, head_dim] (K then V); token p of
 * sequence s lives in slot tables[s, p / block_size] * block_size + p % block_size, and its own K/V go to
 * slots[s] (the engine's slot_mapping) before it attends to positions 0 .. seq_lens[s] - 1.
 */
#include <omp.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define kvg_pause() _mm_pause() /* SSE2: every x86-64 has it */
#else
#define kvg_pause() ((void)0)
#endif

typedef struct {
    const uint8_t *q;   /* q4.py's pack: qpack */
    const uint16_t *s;  /* and its scales */
} q4_weight;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    q4_weight qkv;                        /* [(heads + 2 kv_heads) * head_dim, hidden] */
    q4_weight o;                          /* [hidden, heads * head_dim] */
    q4_weight gate_up;                    /* [2 * intermediate, hidden] */
    q4_weight down;                       /* [hidden, intermediate] */
    float *kv_cache;                      /* this layer's cache (above) */
} decode_layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int64_t cache_slots;     /* blocks * block_size: where V starts, in units of one slot */
    float eps, scale;        /* RMSNorm's epsilon; the attention scale (head_dim ** -0.5) */
    const float *cos, *sin;  /* [max_position, head_dim]: RotaryEmbedding's cos_cache, sin_cache */
    const decode_layer *layer;
} decode_model;

/* The structs' layout as this compiler lays them out: sizes and field offsets, in the order layout.py's
 * ctypes mirrors list them (tests/engine/test_native_kernels.py holds the two together). Returns how many
 * numbers it wrote (at most ``room``). */
int decode_layout(int64_t *out, int room) {
    const int64_t numbers[] = {
        sizeof(q4_weight), offsetof(q4_weight, q), offsetof(q4_weight, s),
        sizeof(decode_layer), offsetof(decode_layer, input_norm), offsetof(decode_layer, post_norm),
        offsetof(decode_layer, qkv), offsetof(decode_layer, o), offsetof(decode_layer, gate_up),
        offsetof(decode_layer, down), offsetof(decode_layer, kv_cache),
        sizeof(decode_model), offsetof(decode_model, layers), offsetof(decode_model, hidden),
        offsetof(decode_model, heads), offsetof(decode_model, kv_heads), offsetof(decode_model, head_dim),
        offsetof(decode_model, intermediate), offsetof(decode_model, block_size),
        offsetof(decode_model, cache_slots), offsetof(decode_model, eps), offsetof(decode_model, scale),
        offsetof(decode_model, cos), offsetof(decode_model, sin), offsetof(decode_model, layer),
    };
    const int count = (int)(sizeof numbers / sizeof numbers[0]);
    for (int i = 0; i < count && i < room; i++) out[i] = numbers[i];
    return count;
}

/* x[0..D) rotated in place by one position's tables (D even, D % 16 == 0). */
static inline void rope(float *x, const float *cos, const float *sin, int D) {
    float rotated[D];
    const int half = D / 2;
    for (int i = 0; i < D; i++) rotated[i] = x[i] * cos[i] + x[(i + half) % D] * sin[i];
    memcpy(x, rotated, sizeof(float) * D);
}

/* Sequence s, kv head j: rotate its query heads and its key, store its key and value into the cache, and
 * attend each of those query heads over the sequence's context; out[s, query heads of j] = the results.
 * scores: room for seq_lens[s] floats. */
static void attend(const decode_model *m, const decode_layer *L, float *qkv, float *out, int s, int j,
                          const int64_t *positions, const int64_t *slots, const int32_t *tables, int width,
                          const int32_t *seq_lens, float *scores) {
    const int D = m->head_dim, group = m->heads / m->kv_heads, kv_row = m->kv_heads * D;
    const int width_qkv = (m->heads + 2 * m->kv_heads) * D;
    float *row = qkv + (size_t)s * width_qkv;
    const float *cos = m->cos + positions[s] * D, *sin = m->sin + positions[s] * D;
    float *key = row + (m->heads + j) * D, *value = row + (m->heads + m->kv_heads + j) * D;
    rope(key, cos, sin, D);
    float *keys = L->kv_cache, *values = L->kv_cache + m->cache_slots * kv_row;
    memcpy(keys + slots[s] * kv_row + j * D, key, sizeof(float) * D);
    memcpy(values + slots[s] * kv_row + j * D, value, sizeof(float) * D);
    const int n = seq_lens[s], bs = m->block_size;
    const int32_t *table = tables + (size_t)s * width;
    for (int h = j * group; h < (j + 1) * group; h++) {
        float *query = row + h * D;
        rope(query, cos, sin, D);
        float top = -INFINITY;
        for (int p = 0; p < n; p++) {
            const int64_t slot = (int64_t)table[p / bs] * bs + p % bs;
            scores[p] = dot(query, keys + slot * kv_row + j * D, D) * m->scale;
            top = fmaxf(top, scores[p]);
        }
        f16 total = f_zero();
        int p = 0;
        for (; p + 16 <= n; p += 16) {
            const f16 e = exp16(f_sub(f_load(scores + p), f_set1(top)));
            f_store(scores + p, e);
            total = f_add(total, e);
        }
        if (p < n) { /* the tail's other lanes load as 0 and add their exp only as 0 */
            const f16 e = exp16(f_sub(f_load_n(scores + p, n - p), f_set1(top)));
            float lanes[16] = {0};
            f_store_n(lanes, e, n - p);
            f_store_n(scores + p, e, n - p);
            total = f_add(total, f_load(lanes));
        }
        const float inverse = 1.0f / hsum(total);
        float *o = out + (size_t)s * m->heads * D + h * D;
        for (int i = 0; i < D; i += 16) {
            f16 acc = f_zero();
            for (int q = 0; q < n; q++) {
                const int64_t slot = (int64_t)table[q / bs] * bs + q % bs;
                acc = f_fmadd(f_set1(scores[q]), f_load(values + slot * kv_row + j * D + i), acc);
            }
            f_store(o + i, f_mul(acc, f_set1(inverse)));
        }
    }
}

/* Every thread's own scratch: rows normed or activated (x), and their quantized digits (xq, dx, sx). */
typedef struct {
    float *x, *dx, *sx, *scores;
    int8_t *xq;
} scratch;

/* x = RMSNorm(h) of S rows, quantized into t (every thread, its own copy). */
static inline void normed(const float *h, const float *w, float eps, int S, int K, scratch *t) {
    const int G = K / 32;
    for (int r = 0; r < S; r++) {
        rms_norm_row(h + (size_t)r * K, w, eps, K, t->x + (size_t)r * K);
        quantize_row(t->x + (size_t)r * K, K, t->xq + (size_t)r * 2 * K, t->dx + (size_t)r * G, t->sx + (size_t)r * G);
    }
}

/* silu(gate) * up of S rows of gate_up [S, 2I] (gate then up), quantized into t. */
static inline void activated(const float *gate_up, int S, int I, scratch *t) {
    const int G = I / 32;
    for (int r = 0; r < S; r++) {
        const float *gate = gate_up + (size_t)r * 2 * I, *up = gate + I;
        float *x = t->x + (size_t)r * I;
        for (int i = 0; i < I; i += 16) {
            const f16 g = f_load(gate + i);
            const f16 silu = f_div(g, f_add(f_set1(1.0f), exp16(f_sub(f_zero(), g))));
            f_store(x + i, f_mul(silu, f_load(up + i)));
        }
        quantize_row(x, I, t->xq + (size_t)r * 2 * I, t->dx + (size_t)r * G, t->sx + (size_t)r * G);
    }
}

/* Phases without barriers. A step is 5 phases a layer (q/k/v, attention, o, gate/up, down), each cut into
 * units; a thread claims a phase's units one at a time (an atomic counter) and counts the ones it finished
 * into ``done``. The next phase starts once ``done`` has them all. A thread that the OS has descheduled
 * (another process on its core: this machine is shared) holds nobody up unless it holds a claimed unit;
 * with an OpenMP barrier per phase, every phase waited for it: two threads then decoded a fifth as fast as
 * one. A thread that comes back late finds the phases it missed fully claimed and skips them; the private
 * preparation it may have started for one (from inputs a later phase has since overwritten) is thrown away
 * unused, because it claims nothing there. A phase's inputs never change while it still has units to claim:
 * each is rewritten only by a phase that starts after it ends. */
typedef struct {
    int claimed, done;
    char pad[56]; /* one cache line per phase: the counters of different phases do not share one */
} phase;

static inline int phase_open(phase *p, int units) {
    return __atomic_load_n(&p->claimed, __ATOMIC_RELAXED) < units;
}

static inline int phase_claim(phase *p) { return __atomic_fetch_add(&p->claimed, 1, __ATOMIC_RELAXED); }

static inline void phase_finish(phase *p, int units) {
    if (units) __atomic_fetch_add(&p->done, units, __ATOMIC_RELEASE);
}

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Spin a little (a running thread finishes a unit in microseconds), then yield the core: the thread waited
 * for may be the one the OS took off it, and may get it back. Returns the seconds spent yielding. */
static inline double phase_wait(phase *p, int units) {
    double since = 0;
    for (int spins = 0; __atomic_load_n(&p->done, __ATOMIC_ACQUIRE) < units; spins++) {
        if (spins < 2000) {
            kvg_pause();
        } else {
            if (since == 0) since = now();
            sched_yield();
        }
    }
    return since == 0 ? 0 : now() - since;
}

/* When the other threads kept the calling one waiting (yielding) for more than CONTENDED_S and a fifth of a
 * step (a step of 32 sequences is ten times one stream's), the next SOLO_STEPS steps, and the LM head's
 * product with them (int8_kernel.c), run on the calling thread alone; then the threads are tried again. A thread that another process holds off its core for a time
 * slice holds up whichever unit it has claimed, and OpenMP's region end: with one of the two cores taken,
 * two threads decoded one stream at a quarter of one thread's speed (33.6 against 128 tokens/s in two
 * rounds of one locked run). Only the engine's step thread calls these: steps never overlap. */
#define CONTENDED_S 1e-3
#define SOLO_STEPS 64
static int solo_steps;

int native_threads(void) { return solo_steps > 0 ? 1 : omp_get_max_threads(); }

enum { QKV, ATTENTION, O, GATE_UP, DOWN, PHASES };

/* Output rows of a phase's matmul (0: the attention), and its input width. */
static inline int phase_rows(const decode_model *m, int kind) {
    const int heads = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return kind == QKV ? heads : kind == GATE_UP ? 2 * m->intermediate : kind == ATTENTION ? 0 : m->hidden;
}

static inline int phase_inputs(const decode_model *m, int kind) {
    return kind == O ? m->heads * m->head_dim : kind == DOWN ? m->intermediate : m->hidden;
}

/* Output tiles per unit: about 16 units a matmul, so two threads balance and claims stay few. */
static inline int tiles_per_unit(int tiles) { return tiles >= 32 ? tiles / 16 : 1; }

/* Units of a phase: groups of tiles_per_unit output tiles, or one (sequence, kv head) of the attention. */
static inline int phase_units(const decode_model *m, int S, int kind) {
    const int tiles = phase_rows(m, kind) / 16, per = tiles_per_unit(tiles);
    return kind == ATTENTION ? S * m->kv_heads : (tiles + per - 1) / per;
}

/* This thread's own copy of phase ``kind``'s quantized input, in t. */
static void prepare(const decode_model *m, const decode_layer *L, int kind, const float *h,
                           const float *attn, const float *gate_up, int S, scratch *t) {
    const int A = m->heads * m->head_dim;
    if (kind == QKV || kind == GATE_UP) normed(h, kind == QKV ? L->input_norm : L->post_norm, m->eps, S, m->hidden, t);
    if (kind == DOWN) activated(gate_up, S, m->intermediate, t);
    if (kind == O)  /* the attention's rows */
        for (int r = 0; r < S; r++)
            quantize_row(attn + (size_t)r * A, A, t->xq + (size_t)r * 2 * A, t->dx + (size_t)r * A / 32,
                         t->sx + (size_t)r * A / 32);
}

/* The decoder's layers for S sequences decoding one token each: h [S, hidden] (float32, the embeddings in,
 * the last layer's output out, in place). positions, slots: [S] int64; tables [S, width] int32; seq_lens [S]
 * int32, each the context length with the new token. Returns 0, or -1 when scratch could not be allocated
 * (nothing computed then). */
int decode_step(const decode_model *m, float *h, int S, const int64_t *positions, const int64_t *slots,
                       const int32_t *tables, int width, const int32_t *seq_lens) {
    const int H = m->hidden, I = m->intermediate, A = m->heads * m->head_dim, last = m->layers * PHASES - 1;
    const int widest = I > H ? (I > A ? I : A) : (H > A ? H : A);
    int longest = 1;
    for (int s = 0; s < S; s++) longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    float *qkv = malloc(sizeof(float) * (size_t)S * phase_rows(m, QKV)), *attn = malloc(sizeof(float) * (size_t)S * A);
    float *gate_up = malloc(sizeof(float) * (size_t)S * 2 * I);
    phase *phases = calloc((size_t)m->layers * PHASES, sizeof(phase));
    int failed = !qkv || !attn || !gate_up || !phases;
    const int threads = native_threads();
    solo_steps -= solo_steps > 0;
    scratch own[threads];  /* allocated here: no thread waits at the region's start for another to arrive */
    for (int i = 0; i < threads; i++) {
        own[i] = (scratch){malloc(sizeof(float) * (size_t)S * widest), malloc(sizeof(float) * (size_t)S * widest / 32),
                           malloc(sizeof(float) * (size_t)S * widest / 32),
                           malloc(sizeof(float) * (size_t)(longest + 16)), malloc((size_t)S * 2 * widest)};
        failed |= !own[i].x || !own[i].dx || !own[i].sx || !own[i].scores || !own[i].xq;
    }
    const double started = now();
    double waited = 0, finished_at = 0;  /* the calling thread's time yielding, and when its own work ended */
#pragma omp parallel num_threads(threads) if (!failed)
    {
        scratch t = own[omp_get_thread_num()];
        for (int p = 0; p <= last && !failed; p++) {
            const decode_layer *L = &m->layer[p / PHASES];
            const int kind = p % PHASES, units = phase_units(m, S, kind);
            if (p > 0) {
                const double w = phase_wait(&phases[p - 1], phase_units(m, S, (p - 1) % PHASES));
                if (omp_get_thread_num() == 0) waited += w;
            }
            if (!phase_open(&phases[p], units)) continue;
            prepare(m, L, kind, h, attn, gate_up, S, &t);
            const q4_weight *w = kind == QKV ? &L->qkv : kind == O ? &L->o : kind == GATE_UP ? &L->gate_up : &L->down;
            float *out = kind == QKV ? qkv : kind == GATE_UP ? gate_up : h;
            const int N = phase_rows(m, kind), K = phase_inputs(m, kind), per = tiles_per_unit(N / 16);
            int finished = 0;
            for (int u; (u = phase_claim(&phases[p])) < units; finished++) {
                if (kind == ATTENTION) {
                    attend(m, L, qkv, attn, u / m->kv_heads, u % m->kv_heads, positions, slots, tables, width,
                           seq_lens, t.scores);
                } else {  /* o and down add their product to h: the residual */
                    const int end = (u + 1) * per < N / 16 ? (u + 1) * per : N / 16;
                    q4_tile_range(t.xq, t.dx, t.sx, S, K, w->q, w->s, N, out, out == h ? h : NULL, u * per, end);
                }
            }
            phase_finish(&phases[p], finished);
        }
        if (!failed) phase_wait(&phases[last], phase_units(m, S, last % PHASES));
        if (omp_get_thread_num() == 0) finished_at = now();
    }
    for (int i = 0; i < threads; i++) {
        free(own[i].x);
        free(own[i].dx);
        free(own[i].sx);
        free(own[i].scores);
        free(own[i].xq);
    }
    const double ended = now();
    waited += ended - finished_at;  /* the region's end */
    if (!failed && threads > 1 && waited > CONTENDED_S && waited > 0.2 * (ended - started)) solo_steps = SOLO_STEPS;
    free(qkv);
    free(attn);
    free(gate_up);
    free(phases);
    return failed ? -1 : 0;
}

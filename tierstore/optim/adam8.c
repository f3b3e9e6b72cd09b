/* The fused 8-bit AdamW update of tierstore.optim.precision (``_adam8_fp32`` and
 * ``_adam8_lossless``) as plain C, compiled at first use by tierstore/optim/native.py.
 *
 * The same IEEE operations in the same order as the compiled (inductor) kernel, so the same
 * bits: compiled with -ffp-contract=off (no fused multiply-adds) and without -ffast-math.
 * One block of BLOCK elements at a time: its moments are decoded, updated and kept in two
 * stack rows while their absmax is taken, then encoded; memory sees every field once each way.
 * A call's blocks are shared, in batches, with helper threads of a pool kept for the process's
 * life (see job_t and the pool below).
 */
#define _GNU_SOURCE /* (sched_getaffinity, pthread_setname_np) */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* The floating-point control of x86 (flush-to-zero, denormals-are-zero, rounding): a thread's own. */
#define FP_CONTROL_GET() _mm_getcsr()
#define FP_CONTROL_SET(CSR) _mm_setcsr(CSR)
#else
#define FP_CONTROL_GET() 0u
#define FP_CONTROL_SET(CSR) ((void)(CSR))
#endif

#define BLOCK 256

/* s: lr / bias1, decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bias2), eps, gmul */
typedef struct {
    float lr, decay, l2, b1, omb1, b2, omb2, bias2, eps, gmul;
} scalars_t;

/* Of each code book (m: signed, v: unsigned): its 256 values, its 255 midpoints (+inf last),
 * and the search tables of the portable encoder (native.search_tables): the code below a
 * normalised value and the midpoint above that code, by the value's high 16 bits. */
typedef struct {
    const float *m_book, *v_book;
    const float *m_mid, *v_mid;
    const int32_t *m_below, *v_below;
    const float *m_above, *v_above;
} tables_t;

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t float_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The bits of |x|: for non-negative floats their order as integers is their order as values,
 * and a NaN's bits lie above +inf's, so the largest of them is the absmax with a NaN winning (as
 * torch's amax), and the reduction vectorises (a float max with NaN rules does not). */
static inline uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

static inline float absmax_of_bits(uint32_t bits) {
    float best;
    memcpy(&best, &bits, sizeof best);
    return best < FLT_MIN ? FLT_MIN : best; /* (clamp at precision.SMALLEST_SCALE: an all-zero block still divides; a NaN stays) */
}

/* The search tables cover normalised magnitudes from 2^(LOW_EXPONENT - 127) to 1 (a normalised
 * value is at most 1); every smaller one is coded by the first entry (native.py chooses it, zero's
 * rule where that codes them all right, and checks it when it builds them). Indexed by the sign, then the high 16 bits of |x| from those of
 * 2^(LOW_EXPONENT - 127) up: 2 x 2945 entries, 46 KiB a code book, mostly in a core's L1 cache,
 * where the full 64K-entry tables (1 MiB for both books) missed it at every lookup. */
#define LOW_EXPONENT 104
#define LOWEST_HIGH (LOW_EXPONENT << 7)
#define ONE_HIGH 0x3F80
#define TABLE_HALF (ONE_HIGH - LOWEST_HIGH + 1)

/* codes of row / absmax: below[i] is the code below a value, above[i] the midpoint above that
 * code; one comparison picks the nearest code (ties: the lower). */
static inline void encode_row(const float *restrict row, float absmax, const int32_t *restrict below,
                              const float *restrict above, uint8_t *restrict codes) {
    for (int i = 0; i < BLOCK; i++) {
        float normal = row[i] / absmax;
        uint32_t high = float_bits(normal) >> 16;
        uint32_t magnitude = high & 0x7FFF;
        magnitude = magnitude < LOWEST_HIGH ? LOWEST_HIGH : magnitude;
        uint32_t negative = (high >> 15) & (magnitude <= ONE_HIGH); /* (a NaN of either sign: as +1, code 255) */
        magnitude = magnitude > ONE_HIGH ? ONE_HIGH : magnitude;
        uint32_t index = negative * TABLE_HALF + magnitude - LOWEST_HIGH;
        codes[i] = (uint8_t)(below[index] + (normal > above[index]));
    }
}

/* One block: a master of fp32 words (`master`) or, `lossless`, of low halves under the bf16
 * weight (`low`, `high`; the new weight to `high_out`); an fp32 (`grad32`) or, `bf16_grad`, bf16
 * (`grad16`) gradient; both moments decoded, AdamW, both encoded. `lossless` and `bf16_grad` are
 * constants at every call, so each case compiles to a loop of its own with no branch: inlined
 * always (left to itself gcc kept one copy with the branches in, and a loop with branches is not
 * vectorised; inlined, each loop is: about 2x faster without AVX-512). */
static inline __attribute__((always_inline)) void block_update(const int lossless, const int bf16_grad, float *restrict master, int16_t *restrict low, const uint16_t *restrict high,
                                uint16_t *restrict high_out, uint8_t *restrict m_codes, float *restrict m_scale,
                                uint8_t *restrict v_codes, float *restrict v_scale, const float *restrict grad32,
                                const uint16_t *restrict grad16, const scalars_t *restrict s, const tables_t *restrict t) {
    float m_row[BLOCK], v_row[BLOCK];
    const float ms = *m_scale, vs = *v_scale;
    const float lr = s->lr, decay = s->decay, l2 = s->l2, b1 = s->b1, omb1 = s->omb1, b2 = s->b2, omb2 = s->omb2,
                bias2 = s->bias2, eps = s->eps, gmul = s->gmul;
    const uint32_t l2_mask = l2 != 0.0f ? 0xFFFFFFFFu : 0u;
    uint32_t m_max = 0, v_max = 0;
    for (int i = 0; i < BLOCK; i++) {
        float p;
        if (!lossless) {
            p = master[i];
        } else {
            uint32_t word = ((uint32_t)high[i] << 16) | (uint16_t)low[i];
            memcpy(&p, &word, sizeof p);
        }
        float g0 = bf16_grad ? bf16_to_float(grad16[i]) : grad32[i];
        /* torch adds p * weight_decay only where it is not 0 (AdamW's decay is decoupled): p * 0
         * is NaN for a NaN or inf weight, which would take the block's moments with it. Adding
         * -0.0 instead changes no value (x + -0.0 is x, -0.0 included); chosen with a mask, so
         * the loop has no branch and is vectorised. */
        float g = g0 * gmul + bits_float((float_bits(p * l2) & l2_mask) | (~l2_mask & 0x80000000u));
        float m = t->m_book[m_codes[i]] * ms;
        float v = t->v_book[v_codes[i]] * vs;
        m = m * b1 + g * omb1;
        v = v * b2 + g * omb2 * g; /* (1 - beta2) first, as torch: g * g overflows from |g| ~ 1.8e19 */
        float denom = sqrtf(v) / bias2 + eps;
        float updated = p * decay - lr * m / denom;
        if (!lossless) {
            master[i] = updated;
        } else {
            uint32_t bits = float_bits(updated);
            low[i] = (int16_t)(bits & 0xFFFF);
            high_out[i] = (uint16_t)(bits >> 16);
        }
        m_row[i] = m;
        v_row[i] = v;
        uint32_t ma = abs_bits(m), va = abs_bits(v);
        m_max = ma > m_max ? ma : m_max;
        v_max = va > v_max ? va : v_max;
    }
    float m_abs = absmax_of_bits(m_max), v_abs = absmax_of_bits(v_max);
    encode_row(m_row, m_abs, t->m_below, t->m_above, m_codes);
    encode_row(v_row, v_abs, t->v_below, t->v_above, v_codes);
    *m_scale = m_abs;
    *v_scale = v_abs;
}


#ifdef __AVX512F__
/* -- AVX-512: no gathers ---------------------------------------------------------------------
 * Gathers are slow on recent Intel cores (the microcode against "Downfall" makes each one cost
 * tens of cycles): they were half of the portable kernel's time. Here the code books live in
 * registers: a decode is a 256-entry lookup made of 32-entry permutes, and an encode a binary
 * search over the 255 midpoints (the number of midpoints below the value: the nearest code,
 * ties the lower, as the search tables give), each step's candidates a permute too. */
#include <immintrin.h>

/* A 256-entry table in 16 registers. */
typedef struct {
    __m512 r[16];
} table256_t;

static inline void load256(table256_t *t, const float *values) {
    for (int i = 0; i < 16; i++) t->r[i] = _mm512_loadu_ps(values + 16 * i);
}

/* t[index] for 16 indices in 0..255. */
static inline __m512 lookup256(const table256_t *t, __m512i index) {
    __m512 g0 = _mm512_permutex2var_ps(t->r[0], index, t->r[1]);
    __m512 g1 = _mm512_permutex2var_ps(t->r[2], index, t->r[3]);
    __m512 g2 = _mm512_permutex2var_ps(t->r[4], index, t->r[5]);
    __m512 g3 = _mm512_permutex2var_ps(t->r[6], index, t->r[7]);
    __m512 g4 = _mm512_permutex2var_ps(t->r[8], index, t->r[9]);
    __m512 g5 = _mm512_permutex2var_ps(t->r[10], index, t->r[11]);
    __m512 g6 = _mm512_permutex2var_ps(t->r[12], index, t->r[13]);
    __m512 g7 = _mm512_permutex2var_ps(t->r[14], index, t->r[15]);
    __mmask16 b5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
    __mmask16 b7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
    __m512 a0 = _mm512_mask_blend_ps(b5, g0, g1), a1 = _mm512_mask_blend_ps(b5, g2, g3);
    __m512 a2 = _mm512_mask_blend_ps(b5, g4, g5), a3 = _mm512_mask_blend_ps(b5, g6, g7);
    __m512 c0 = _mm512_mask_blend_ps(b6, a0, a1), c1 = _mm512_mask_blend_ps(b6, a2, a3);
    return _mm512_mask_blend_ps(b7, c0, c1);
}

/* The binary search's candidates: at the step of size s, for the code c found so far (a
 * multiple of 2s), the midpoint mid[c + s - 1], indexed by c / 2s. */
typedef struct {
    __m512 s128;        /* mid[127], broadcast */
    __m512 s64, s32, s16, s8; /* up to 16 candidates each: one register */
    __m512 s4[2], s2[4], s1[8];
} search_t;

static inline void load_search(search_t *t, const float *mid) {
    float step[128];
    t->s128 = _mm512_set1_ps(mid[127]);
    __m512 *one[4] = {&t->s64, &t->s32, &t->s16, &t->s8};
    for (int k = 0, size = 64; k < 4; k++, size /= 2) {
        for (int j = 0; j < 16; j++) step[j] = j < 128 / size ? mid[j * 2 * size + size - 1] : INFINITY;
        *one[k] = _mm512_loadu_ps(step);
    }
    for (int j = 0; j < 32; j++) step[j] = mid[j * 8 + 3];
    for (int i = 0; i < 2; i++) t->s4[i] = _mm512_loadu_ps(step + 16 * i);
    for (int j = 0; j < 64; j++) step[j] = mid[j * 4 + 1];
    for (int i = 0; i < 4; i++) t->s2[i] = _mm512_loadu_ps(step + 16 * i);
    for (int j = 0; j < 128; j++) step[j] = mid[j * 2];
    for (int i = 0; i < 8; i++) t->s1[i] = _mm512_loadu_ps(step + 16 * i);
}

/* c += size where x > candidate or x is NaN (a NaN then gets code 255, as the search tables give it) */
#define SEARCH_STEP(CANDIDATE, SIZE) \
    code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(x, CANDIDATE, _CMP_NLE_UQ), code, _mm512_set1_epi32(SIZE))

/* The number of midpoints below each of 16 values (a NaN: 255). */
static inline __m512i search(const search_t *t, __m512 x) {
    __m512i code = _mm512_setzero_si512();
    SEARCH_STEP(t->s128, 128);
    SEARCH_STEP(_mm512_permutexvar_ps(_mm512_srli_epi32(code, 7), t->s64), 64);
    SEARCH_STEP(_mm512_permutexvar_ps(_mm512_srli_epi32(code, 6), t->s32), 32);
    SEARCH_STEP(_mm512_permutexvar_ps(_mm512_srli_epi32(code, 5), t->s16), 16);
    SEARCH_STEP(_mm512_permutexvar_ps(_mm512_srli_epi32(code, 4), t->s8), 8);
    __m512i j = _mm512_srli_epi32(code, 3); /* 0..31 */
    SEARCH_STEP(_mm512_permutex2var_ps(t->s4[0], j, t->s4[1]), 4);
    j = _mm512_srli_epi32(code, 2); /* 0..63 */
    __mmask16 b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    SEARCH_STEP(_mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t->s2[0], j, t->s2[1]), _mm512_permutex2var_ps(t->s2[2], j, t->s2[3])), 2);
    j = _mm512_srli_epi32(code, 1); /* 0..127 */
    b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
    __m512 a0 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t->s1[0], j, t->s1[1]), _mm512_permutex2var_ps(t->s1[2], j, t->s1[3]));
    __m512 a1 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t->s1[4], j, t->s1[5]), _mm512_permutex2var_ps(t->s1[6], j, t->s1[7]));
    SEARCH_STEP(_mm512_mask_blend_ps(b6, a0, a1), 1);
    return code;
}

typedef struct {
    table256_t m_book, v_book;
    search_t m_search, v_search;
} tables512_t;

static inline void encode_row_512(const float *restrict row, float absmax, const search_t *t, uint8_t *restrict codes) {
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int i = 0; i < BLOCK; i += 16) {
        __m512 normal = _mm512_div_ps(_mm512_loadu_ps(row + i), scale);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(search(t, normal)));
    }
}

static inline __m512 bf16x16(const uint16_t *values) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)values));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* block_update, 16 lanes at a time. */
static inline void block_update_512(const int lossless, const int bf16_grad, float *restrict master, int16_t *restrict low,
                                    const uint16_t *restrict high, uint16_t *restrict high_out, uint8_t *restrict m_codes,
                                    float *restrict m_scale, uint8_t *restrict v_codes, float *restrict v_scale,
                                    const float *restrict grad32, const uint16_t *restrict grad16, const scalars_t *restrict s,
                                    const tables512_t *restrict t) {
    float m_row[BLOCK] __attribute__((aligned(64))), v_row[BLOCK] __attribute__((aligned(64)));
    const __m512 ms = _mm512_set1_ps(*m_scale), vs = _mm512_set1_ps(*v_scale);
    const __m512 lr = _mm512_set1_ps(s->lr), decay = _mm512_set1_ps(s->decay), l2 = _mm512_set1_ps(s->l2),
                 b1 = _mm512_set1_ps(s->b1), omb1 = _mm512_set1_ps(s->omb1), b2 = _mm512_set1_ps(s->b2),
                 omb2 = _mm512_set1_ps(s->omb2), bias2 = _mm512_set1_ps(s->bias2), eps = _mm512_set1_ps(s->eps),
                 gmul = _mm512_set1_ps(s->gmul);
    const int use_l2 = s->l2 != 0.0f;
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
    for (int i = 0; i < BLOCK; i += 16) {
        __m512 p;
        if (!lossless) {
            p = _mm512_loadu_ps(master + i);
        } else {
            __m512i word = _mm512_or_si512(_mm512_castps_si512(bf16x16(high + i)),
                                           _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(low + i))));
            p = _mm512_castsi512_ps(word);
        }
        __m512 g0 = bf16_grad ? bf16x16(grad16 + i) : _mm512_loadu_ps(grad32 + i);
        __m512 g = _mm512_mul_ps(g0, gmul);
        if (use_l2) /* (block_update's rule) */
            g = _mm512_add_ps(g, _mm512_mul_ps(p, l2));
        __m512i mc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(m_codes + i)));
        __m512i vc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(v_codes + i)));
        __m512 m = _mm512_mul_ps(lookup256(&t->m_book, mc), ms);
        __m512 v = _mm512_mul_ps(lookup256(&t->v_book, vc), vs);
        m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
        v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, omb2), g));
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bias2), eps);
        __m512 updated = _mm512_sub_ps(_mm512_mul_ps(p, decay), _mm512_div_ps(_mm512_mul_ps(lr, m), denom));
        if (!lossless) {
            _mm512_storeu_ps(master + i, updated);
        } else {
            __m512i bits = _mm512_castps_si512(updated);
            _mm256_storeu_si256((__m256i *)(low + i), _mm512_cvtepi32_epi16(bits));
            _mm256_storeu_si256((__m256i *)(high_out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        }
        _mm512_store_ps(m_row + i, m);
        _mm512_store_ps(v_row + i, v);
        m_max = _mm512_max_epu32(m_max, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
        v_max = _mm512_max_epu32(v_max, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
    }
    float m_abs = absmax_of_bits(_mm512_reduce_max_epu32(m_max)), v_abs = absmax_of_bits(_mm512_reduce_max_epu32(v_max));
    encode_row_512(m_row, m_abs, &t->m_search, m_codes);
    encode_row_512(v_row, v_abs, &t->v_search, v_codes);
    *m_scale = m_abs;
    *v_scale = v_abs;
}

#define TILE_LOOP_512(LOSSLESS, BF16_GRAD, MASTER, LOW, HIGH, HIGH_OUT, G32, G16)                             \
    do {                                                                                                     \
        tables512_t t512;                                                                                   \
        load256(&t512.m_book, t.m_book);                                                                    \
        load256(&t512.v_book, t.v_book);                                                                    \
        load_search(&t512.m_search, t.m_mid);                                                               \
        load_search(&t512.v_search, t.v_mid);                                                               \
        for (int64_t start = 0, b = 0; start < numel; start += BLOCK, b++)                                  \
            block_update_512(LOSSLESS, BF16_GRAD, MASTER, LOW, HIGH, HIGH_OUT, m_codes + start, m_scales + b, \
                             v_codes + start, v_scales + b, G32, G16, &s, &t512);                           \
    } while (0)
#endif

/* One tile of whole blocks, elements 0..numel (numel a multiple of BLOCK): a master of fp32
 * words (``master``) or of low halves under the bf16 weight (``low``, ``high``; the new weight
 * to ``high_out``), an fp32 (``grad32``) or bf16 (``grad16``) gradient. Each case is its own
 * loop with the others' pointers literally NULL, so the compiler drops their branches. */
#define TILE_LOOP(LOSSLESS, BF16_GRAD, MASTER, LOW, HIGH, HIGH_OUT, G32, G16)                                              \
    for (int64_t start = 0, b = 0; start < numel; start += BLOCK, b++)                                \
        block_update(LOSSLESS, BF16_GRAD, MASTER, LOW, HIGH, HIGH_OUT, m_codes + start, m_scales + b, v_codes + start, v_scales + b, \
                     G32, G16, &s, &t)

static void adam8_range(int64_t numel, float *master, int16_t *low, const uint16_t *high, uint16_t *high_out,
                        uint8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales,
                        const float *grad32, const uint16_t *grad16, const scalars_t s, const tables_t t) {
#ifdef __AVX512F__
#define TILE TILE_LOOP_512
#else
#define TILE TILE_LOOP
#endif
    if (master != NULL && grad32 != NULL) {
        TILE(0, 0, master + start, NULL, NULL, NULL, grad32 + start, NULL);
    } else if (master != NULL) {
        TILE(0, 1, master + start, NULL, NULL, NULL, NULL, grad16 + start);
    } else if (grad32 != NULL) {
        TILE(1, 0, NULL, low + start, high + start, high_out + start, grad32 + start, NULL);
    } else {
        TILE(1, 1, NULL, low + start, high + start, high_out + start, NULL, grad16 + start);
    }
#undef TILE
}

/* One call's arguments, shared by the threads that work on it: each takes the next BATCH
 * blocks until none are left. Blocks are independent (each has its own scales), so which thread
 * updates which block does not change a bit. Shared rather than split in equal parts: on a busy
 * machine (the store's I/O and event-loop threads) a helper may wake late or be preempted,
 * and the call then takes as long as the work left divided among the threads that do run,
 * never as long as the slowest thread's fixed part. The caller waits only for batches under
 * way: a helper that joins after the work is gone finds nothing and frees the job if last. */
typedef struct {
    float *master;
    int16_t *low;
    const uint16_t *high;
    uint16_t *high_out;
    uint8_t *m_codes, *v_codes;
    float *m_scales, *v_scales;
    const float *grad32;
    const uint16_t *grad16;
    scalars_t s;
    tables_t t;
    int64_t blocks;
    _Atomic int64_t next;  /* the first block not yet taken */
    _Atomic int64_t done;  /* blocks updated */
    _Atomic int refs;      /* threads that may still read this job (the caller and joined helpers) */
    unsigned int fp_control; /* the caller's (torch.set_flush_denormal sets it on the calling thread alone): helpers
                              * compute under it, so which thread takes a block never changes a bit */
} job_t;

#define AT(POINTER, OFFSET) ((POINTER) != NULL ? (POINTER) + (OFFSET) : NULL)
#define BATCH ((int64_t)(16384 / BLOCK))

static void take_batches(job_t *j) {
    for (;;) {
        const int64_t first = atomic_fetch_add_explicit(&j->next, BATCH, memory_order_relaxed);
        if (first >= j->blocks)
            return;
        const int64_t last = first + BATCH < j->blocks ? first + BATCH : j->blocks;
        const int64_t start = first * BLOCK;
        adam8_range((last - first) * BLOCK, AT(j->master, start), AT(j->low, start), AT(j->high, start),
                    AT(j->high_out, start), j->m_codes + start, j->m_scales + first, j->v_codes + start,
                    j->v_scales + first, AT(j->grad32, start), AT(j->grad16, start), j->s, j->t);
        atomic_fetch_add_explicit(&j->done, last - first, memory_order_release); /* (its writes, seen by the caller) */
    }
}

static void let_go(job_t *j) {
    if (atomic_fetch_sub_explicit(&j->refs, 1, memory_order_acq_rel) == 1)
        free(j);
}

/* -- The helper pool --------------------------------------------------------------------------
 * Helper threads started at first need and kept for the process's life (detached, blocked on a
 * condition variable while idle: a process exits with them blocked there), instead of threads
 * started at every call: starting one cost about a batch's math, and on a busy machine helpers
 * that started after their call had ended piled up. The pool has one job slot: a caller puts its
 * job there and wakes up to `threads - 1` helpers, each of which joins it (a reference to the
 * job, taken under the lock) at most once; the caller takes it out as soon as no batch is left
 * to take, so a late helper finds the slot empty (or the next call's job) and never touches a
 * finished call's memory but for the job it holds. A caller that finds the slot taken (another Python thread's
 * call, e.g. a second optimizer) runs its call alone: calls never wait for each other, nothing can
 * deadlock, and on a machine of few cores the two calls keep the cores busy between them anyway.
 * A child of fork() has none of the threads: the fork handlers empty the pool (and give the
 * child a fresh lock, which another thread may have held at the fork), so the child's first
 * call starts helpers of its own. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;  /* a job in the slot */
    job_t *job;           /* the slot: the call helpers may join, or NULL */
    uint64_t generation;  /* jobs put in the slot so far: a helper joins each one at most once */
    int64_t wanted;       /* helpers the job in the slot still takes */
    int64_t size;         /* helpers started (in this process) */
    int64_t cap;          /* the most helpers: this process's CPUs - 1, at least 1 (0: not known yet) */
} pool_t;

#define MAX_THREADS 256

static pool_t pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&pool.lock); } /* (the pool consistent in the child) */
static void after_fork_parent(void) { pthread_mutex_unlock(&pool.lock); }

static void after_fork_child(void) {
    /* (a job in the slot is the parent's call, whose threads the child lacks: left, never freed) */
    pool.lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    pool.wake = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    pool.job = NULL;
    pool.wanted = 0;
    pool.size = 0;
}

static int64_t cpus(void) {
#ifdef __linux__
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        return CPU_COUNT(&allowed);
#endif
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? online : 1;
}

static void pool_setup(void) {
    const int64_t helpers = cpus() - 1;
    pool.cap = helpers < 1 ? 1 : helpers > MAX_THREADS - 1 ? MAX_THREADS - 1 : helpers;
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

static void *helper(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.job == NULL || pool.wanted == 0 || pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        job_t *j = pool.job;
        seen = pool.generation;
        pool.wanted--;
        atomic_fetch_add_explicit(&j->refs, 1, memory_order_relaxed); /* (the caller lets go only after taking the lock) */
        pthread_mutex_unlock(&pool.lock);
        const unsigned int own = FP_CONTROL_GET();
        FP_CONTROL_SET(j->fp_control);
        take_batches(j);
        FP_CONTROL_SET(own);
        let_go(j);
        pthread_mutex_lock(&pool.lock);
    }
    return NULL;
}

/* Helpers started up to `wanted` (at most the cap), with the lock held; where the system refuses
 * one, the cap becomes the pool's size (no retry at every call). */
static void grow(int64_t wanted) {
    if (wanted > pool.cap)
        wanted = pool.cap;
    if (pool.size >= wanted)
        return;
    pthread_attr_t detached;
    if (pthread_attr_init(&detached) != 0)
        return;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* (helpers inherit it: signals go to the process's own threads) */
    while (pool.size < wanted) {
        pthread_t id;
        if (pthread_attr_setdetachstate(&detached, PTHREAD_CREATE_DETACHED) != 0 ||
            pthread_create(&id, &detached, helper, NULL) != 0) {
            pool.cap = pool.size;
            break;
        }
#ifdef __linux__
        pthread_setname_np(id, "tierstore-adam8");
#endif
        pool.size++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&detached);
}

/* Puts j in the slot for up to `helpers` helpers and wakes them; 0 (nothing put) where the slot
 * is taken or no helper could be started. */
static int64_t offer(job_t *j, int64_t helpers) {
    pthread_once(&pool_once, pool_setup);
    pthread_mutex_lock(&pool.lock);
    if (pool.job != NULL) {
        pthread_mutex_unlock(&pool.lock);
        return 0;
    }
    grow(helpers);
    if (helpers > pool.size)
        helpers = pool.size;
    const int64_t size = pool.size;
    if (helpers > 0) {
        pool.job = j;
        pool.generation++;
        pool.wanted = helpers;
    }
    pthread_mutex_unlock(&pool.lock);
    if (helpers > 0 && helpers == size)
        pthread_cond_broadcast(&pool.wake);
    else
        for (int64_t i = 0; i < helpers; i++)
            pthread_cond_signal(&pool.wake); /* (after the unlock: a woken helper does not block on the lock) */
    return helpers;
}

static void withdraw(job_t *j) {
    pthread_mutex_lock(&pool.lock);
    if (pool.job == j) {
        pool.job = NULL;
        pool.wanted = 0;
    }
    pthread_mutex_unlock(&pool.lock);
}

/* The update of one tile of whole blocks (numel a multiple of BLOCK) by this thread and up to
 * threads - 1 helpers of the pool, sharing the blocks in batches; see job_t and the pool. */
void tierstore_adam8(int64_t threads, int64_t numel, float *master, int16_t *low, const uint16_t *high,
                     uint16_t *high_out, uint8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales,
                     const float *grad32, const uint16_t *grad16, const float *scalars,
                     const float *m_book, const float *m_mid, const int32_t *m_below, const float *m_above,
                     const float *v_book, const float *v_mid, const int32_t *v_below, const float *v_above) {
    const int64_t blocks = numel / BLOCK;
    const int64_t batches = (blocks + BATCH - 1) / BATCH;
    if (threads > batches) threads = batches;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    job_t local, *j = threads > 1 ? malloc(sizeof *j) : NULL; /* (a late helper may hold it after the call) */
    if (j == NULL) { /* (one thread, or no memory for a shared job: all of it here) */
        j = &local;
        threads = 1;
    }
    *j = (job_t){.master = master, .low = low, .high = high, .high_out = high_out, .m_codes = m_codes,
                 .v_codes = v_codes, .m_scales = m_scales, .v_scales = v_scales, .grad32 = grad32, .grad16 = grad16,
                 .t = {m_book, v_book, m_mid, v_mid, m_below, v_below, m_above, v_above}, .blocks = blocks};
    memcpy(&j->s, scalars, sizeof j->s);
    atomic_init(&j->next, 0);
    atomic_init(&j->done, 0);
    atomic_init(&j->refs, 1);
    j->fp_control = FP_CONTROL_GET();
    const int64_t offered = threads > 1 ? offer(j, threads - 1) : 0;
    take_batches(j);
    if (offered > 0)
        withdraw(j); /* (every batch taken: the slot is free for the next call) */
    while (atomic_load_explicit(&j->done, memory_order_acquire) < blocks)
        sched_yield(); /* (a batch under way on a helper: tens of microseconds) */
    if (j != &local)
        let_go(j);
}

/* 1 where the portable loop was compiled for AVX2. */
int tierstore_adam8_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* 1 where the AVX-512 kernel was compiled in. */
int tierstore_adam8_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Native float32 CPU kernels for the executor's per-layer hot path (see kernels/cpu_native.py).

   Each function does in one call what takes the PyTorch operator path several to a dozen
   operator calls, and reads its operands once: RMSNorm, rotary embedding in place, the K/V
   cache write, paged attention straight from the block table (no gathered copies of the
   context), SiLU-and-multiply in place, the float32 matmul against prepacked weight panels
   (float32, bfloat16 or int8 ones; bfloat16 on AMX's tiles where the CPU has them), Gated
   DeltaNet's short convolution and decode step in place in the requests' state slots. Loops are
   written as `acc += a * b` on vector types and rely on -ffp-contract=fast to become FMAs.
   Threads come from OpenMP; the library is loaded into a process where PyTorch already
   loaded libgomp, so both share one thread pool and torch.set_num_threads applies to both.
   Row strides are in elements. */

#define _DEFAULT_SOURCE /* syscall(), under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif
/* AMX's tiles (every CPU with them has AVX-512 too) */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX 1
#else
#define AMX 0
#endif
#if AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define KEY_TILE 32    /* keys scored at a time for many query rows (two halves of 16) */
#define MAX_TILE_ROWS 64 /* query rows (tokens x heads of one KV head) per work item */
#define WIDE_TILE 128   /* keys per tile for few query rows */
#define NARROW_TILE 64 /* the same over an fp8 or bf16 cache: its widened tiles stay in L2 */
#define TRANSPOSE_ROWS 16 /* from this many rows a transposed key tile pays for itself */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* The attention's and the activations' vectors: 16 lanes where the CPU has AVX-512F (one
   zmm register), 8 otherwise. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The sum of a vector's two halves (the vector itself with 8 lanes). */
static inline v8f fold8(vf v) {
#if VL == 16
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return v;
#endif
}

/* exp on VL lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial, ~1 ulp; inputs
   clamped to [-87.3, 88.3], so the result stays finite and normal); the
   scalar expf of libm does not vectorize, and softmax takes one per score. */
static inline vf expv(vf x) {
    const vf lo = (vf){0} - 87.3f, hi = (vf){0} + 88.3f;
    const vi below = x < lo, above = x > hi;
    x = (vf)((below & (vi)lo) | (above & (vi)hi) | (~(below | above) & (vi)x));
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(fx, vi);
    n -= (vi)(__builtin_convertvector(n, vf) > fx) & 1; /* floor, also for negatives */
    vf nf = __builtin_convertvector(n, vf);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    return y * (vf)((n + 127) << 23);
}

/* tanh on VL lanes (Cephes' tanhf: an odd polynomial below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1)
   with its sign above, ~2 ulp; expv's clamp keeps a large |x| at 1). */
static inline vf tanhv(vf x) {
    const vi sign = (vi)x & INT32_MIN;
    const vf z = (vf)((vi)x ^ sign);
    const vf far = (vf)((vi)(1.0f - 2.0f / (expv(z + z) + 1.0f)) | sign);
    const vf s = x * x;
    vf near = -5.70498872745e-3f * s + 2.06390887954e-2f;
    near = near * s - 5.37397155531e-2f;
    near = near * s + 1.33314422036e-1f;
    near = near * s - 3.33332819422e-1f;
    near = near * s * x + x;
    const vi use_far = z > 0.625f;
    return (vf)((use_far & (vi)far) | (~use_far & (vi)near));
}

static inline float dot8(const float *a, const float *b, int64_t n) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void weir_rms_norm(const float *x, int64_t x_stride, const float *weight, float *out,
                   int64_t out_stride, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        float inv = 1.0f / sqrtf(dot8(xr, xr, dim) / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (xr[d] * inv);
    }
}

/* Rotate-half RoPE in place on the first rotary_dim channels of `heads` heads of every row
   (head h of row t at x + t * row_stride + h * head_stride), with cos/sin[t, :half]
   (contiguous, half = rotary_dim / 2). */
void weir_rope(float *x, int64_t row_stride, int64_t head_stride, int64_t rows, int64_t heads,
               int64_t rotary_dim, const float *cos, const float *sin) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + h * head_stride, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* The gated MLP's activation in place: x[t, :dim] = silu(x[t, :dim]) * x[t, dim:2 dim] for
   rows of the fused gate/up projection's output (silu(g) = g / (1 + exp(-g))). */
void weir_silu_mul(float *x, int64_t row_stride, int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t t = 0; t < rows; t++) {
        float *g = x + t * row_stride;
        const float *u = g + dim;
        int64_t i = 0;
        for (; i + VL <= dim; i += VL) {
            const vf gv = loadv(g + i);
            storev(g + i, gv / (1.0f + expv(-gv)) * loadv(u + i));
        }
        for (; i < dim; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Copy each row's K and V ([kv_heads * head_dim] items of item_bytes each, at k + t * k_stride
   and v + t * v_stride items: float32, or an fp8 or bf16 cache's already converted rows)
   to cache slot slots[t]; slot -1 (padding) writes nothing. Returns 0, or -2 (nothing
   written) when a slot lies outside the cache's num_slots. */
int weir_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                  const int64_t *slots, int64_t rows, void *key_cache, void *value_cache,
                  int64_t slot_size, int64_t num_slots, int64_t item_bytes) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    const size_t bytes = (size_t)(slot_size * item_bytes);
    const char *kb = k, *vb = v;
    char *kc = key_cache, *vc = value_cache;
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        memcpy(kc + slots[t] * bytes, kb + t * k_stride * item_bytes, bytes);
        memcpy(vc + slots[t] * bytes, vb + t * v_stride * item_bytes, bytes);
    }
    return 0;
}

/* n fp8 values (format 1: e4m3, 2: e5m2) widened to float, as `values` (the 256 floats the
   format's bytes stand for) reads them. With F16C, eight at a time through a half: e5m2 is a
   half's high byte; e4m3 is a half's bits one place lower (its exponent bias, 7, is 8 below
   the half's 15), so the half is scaled by 2^8 (subnormals included), and its NaNs (every
   exponent and mantissa bit set) are made a half's NaN first. */
static inline void widen_fp8(const uint8_t *src, float *dst, int64_t n, int64_t format,
                             const float *values) {
    int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
    const __m128i low7 = _mm_set1_epi16(0x7f), sign = _mm_set1_epi16(0x80);
    for (; d + 8 <= n; d += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + d)));
        if (format == 2) {
            _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
            continue;
        }
        const __m128i em = _mm_and_si128(b, low7);
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8), _mm_slli_epi16(em, 7));
        h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(em, low7), _mm_set1_epi16(0x7e00)));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)));
    }
#else
    (void)format;
#endif
    for (; d < n; d++) dst[d] = values[src[d]];
}

/* n cached values of format 1 or 2 (fp8, as widen_fp8) or 3 (bfloat16: a float's upper half)
   widened to float. */
static inline void widen(const char *src, float *dst, int64_t n, int64_t format,
                         const float *values) {
    if (format != 3) {
        widen_fp8((const uint8_t *)src, dst, n, format, values);
        return;
    }
    for (int64_t d = 0; d < n; d++) {
        uint16_t h;
        memcpy(&h, src + 2 * d, sizeof h);
        const uint32_t u = (uint32_t)h << 16;
        memcpy(dst + d, &u, sizeof u);
    }
}

/* num_tokens consecutive query tokens of request req, times the query heads of KV heads
   kv_head .. kv_head + num_kv_heads - 1. */
typedef struct {
    int32_t req, kv_head, num_kv_heads, first_token, num_tokens;
} WorkItem;

/* The sums of eight vectors: out[k] = sum of acc[k]'s lanes. */
static inline v8f sum8x8(const vf acc[8]) {
    v8f h[8];
    for (int k = 0; k < 8; k++) h[k] = fold8(acc[k]);
#if defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)h[0], (__m256)h[1]);
    const __m256 t1 = _mm256_hadd_ps((__m256)h[2], (__m256)h[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)h[4], (__m256)h[5]);
    const __m256 t3 = _mm256_hadd_ps((__m256)h[6], (__m256)h[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                              _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8f out;
    for (int k = 0; k < 8; k++)
        out[k] = ((h[k][0] + h[k][4]) + (h[k][1] + h[k][5])) +
                 ((h[k][2] + h[k][6]) + (h[k][3] + h[k][7]));
    return out;
#endif
}

/* Scores of `rows` query rows against `tile` keys into s[rows][tile] (every krow[j] points
   at a readable key; scores past the visible keys are masked by the caller).
   Few rows (decodes): eight keys at a time per row, eight independent accumulators summed
   across lanes at the end. Many rows (prefill, tile == KEY_TILE): the tile is transposed
   once into kt[d][key] so each row's scores are broadcast-and-FMA over contiguous keys, with
   no horizontal sums; six rows share each load of two vectors of the transposed tile. */
static inline void score_tile(const float *qs, int64_t rows, const float *const *krow,
                              int64_t tile, int64_t head_dim, float *kt, float *s) {
    if (rows < TRANSPOSE_ROWS) {
        for (int64_t r = 0; r < rows; r++) {
            const float *qr = qs + r * head_dim;
            for (int64_t g = 0; g < tile; g += 8) {
                vf acc[8] = {{0}};
                int64_t d = 0;
                for (; d + VL <= head_dim; d += VL) {
                    const vf qv = loadv(qr + d);
                    for (int k = 0; k < 8; k++) acc[k] += qv * loadv(krow[g + k] + d);
                }
                v8f sums = sum8x8(acc);
                for (; d < head_dim; d++)
                    for (int k = 0; k < 8; k++) sums[k] += qr[d] * krow[g + k][d];
                store8(s + r * tile + g, sums);
            }
        }
        return;
    }
    for (int64_t j = 0; j < KEY_TILE; j++)
        for (int64_t d = 0; d < head_dim; d++) kt[d * KEY_TILE + j] = krow[j][d];
    for (int64_t half = 0; half < KEY_TILE; half += 2 * VL) {
        const float *k2 = kt + half;
        int64_t r = 0;
        for (; r + 6 <= rows; r += 6) { /* the panel matmul's 6-row register block */
            const float *q0 = qs + r * head_dim, *q1 = q0 + head_dim, *q2 = q1 + head_dim,
                        *q3 = q2 + head_dim, *q4 = q3 + head_dim, *q5 = q4 + head_dim;
            vf a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0};
            vf a3 = {0}, b3 = {0}, a4 = {0}, b4 = {0}, a5 = {0}, b5 = {0};
            for (int64_t d = 0; d < head_dim; d++) {
                const vf lo = loadv(k2 + d * KEY_TILE), hi = loadv(k2 + d * KEY_TILE + VL);
                a0 += q0[d] * lo, b0 += q0[d] * hi;
                a1 += q1[d] * lo, b1 += q1[d] * hi;
                a2 += q2[d] * lo, b2 += q2[d] * hi;
                a3 += q3[d] * lo, b3 += q3[d] * hi;
                a4 += q4[d] * lo, b4 += q4[d] * hi;
                a5 += q5[d] * lo, b5 += q5[d] * hi;
            }
            float *o = s + r * KEY_TILE + half;
            storev(o, a0), storev(o + VL, b0), o += KEY_TILE;
            storev(o, a1), storev(o + VL, b1), o += KEY_TILE;
            storev(o, a2), storev(o + VL, b2), o += KEY_TILE;
            storev(o, a3), storev(o + VL, b3), o += KEY_TILE;
            storev(o, a4), storev(o + VL, b4), o += KEY_TILE;
            storev(o, a5), storev(o + VL, b5);
        }
        for (; r < rows; r++) {
            const float *qr = qs + r * head_dim;
            vf lo_sum = {0}, hi_sum = {0};
            for (int64_t d = 0; d < head_dim; d++) {
                lo_sum += qr[d] * loadv(k2 + d * KEY_TILE);
                hi_sum += qr[d] * loadv(k2 + d * KEY_TILE + VL);
            }
            storev(s + r * KEY_TILE + half, lo_sum);
            storev(s + r * KEY_TILE + half + VL, hi_sum);
        }
    }
}

/* a[0, head_dim) = a * correction + sum over j < n of p[j] * vrow[j], the n-long sums as eight
   independent chains: eight vectors of columns at a time, then four vectors over the even
   and the odd keys apart (a 64-wide head with 16 lanes), then one vector. */
static inline void accumulate_values(float *a, float correction, const float *p,
                                     const float *const *vrow, int64_t n, int64_t head_dim) {
    int64_t d = 0;
    for (; d + 8 * VL <= head_dim; d += 8 * VL) {
        vf acc[8];
        for (int c = 0; c < 8; c++) acc[c] = loadv(a + d + VL * c) * correction;
        for (int64_t j = 0; j < n; j++)
            for (int c = 0; c < 8; c++) acc[c] += p[j] * loadv(vrow[j] + d + VL * c);
        for (int c = 0; c < 8; c++) storev(a + d + VL * c, acc[c]);
    }
    for (; d + 4 * VL <= head_dim; d += 4 * VL) {
        vf even[4], odd[4] = {{0}};
        for (int c = 0; c < 4; c++) even[c] = loadv(a + d + VL * c) * correction;
        int64_t j = 0;
        for (; j + 2 <= n; j += 2)
            for (int c = 0; c < 4; c++) {
                even[c] += p[j] * loadv(vrow[j] + d + VL * c);
                odd[c] += p[j + 1] * loadv(vrow[j + 1] + d + VL * c);
            }
        if (j < n)
            for (int c = 0; c < 4; c++) even[c] += p[j] * loadv(vrow[j] + d + VL * c);
        for (int c = 0; c < 4; c++) storev(a + d + VL * c, even[c] + odd[c]);
    }
    for (; d + VL <= head_dim; d += VL) {
        vf av = loadv(a + d) * correction;
        for (int64_t j = 0; j < n; j++) av += p[j] * loadv(vrow[j] + d);
        storev(a + d, av);
    }
    for (; d < head_dim; d++) {
        float av = a[d] * correction;
        for (int64_t j = 0; j < n; j++) av += p[j] * vrow[j][d];
        a[d] = av;
    }
}

static inline vf maxv(vf a, vf b) {
    const vi a_greater = a > b;
    return (vf)((a_greater & (vi)a) | (~a_greater & (vi)b));
}

static inline float hmaxv(vf v) {
#if VL == 16
    v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f high = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8i high_greater = high > h;
    h = (v8f)((high_greater & (v8i)high) | (~high_greater & (v8i)h));
#else
    const v8f h = v;
#endif
    float m = h[0];
    for (int i = 1; i < 8; i++) m = h[i] > m ? h[i] : m; /* maxss; fmaxf is a libm call */
    return m;
}

/* Online-softmax update of one row for the scores sr[0, n) of this tile: the row's running
   max and sum are moved to the new max, p[0, n) gets the probabilities (p[n, n rounded up to
   VL) zero) and the factor the row's accumulator must be scaled by is returned. */
static inline float softmax_tile(float *sr, int64_t n, float *row_max, float *row_sum, float *p) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    const vf neg_inf = (vf){0} - INFINITY;
    vf vmax = neg_inf;
    for (int64_t c = 0; c < n; c += VL) {
        const vi visible = lane < (vi){0} + (int32_t)(n - c);
        const vf v = (vf)((visible & (vi)loadv(sr + c)) | (~visible & (vi)neg_inf));
        storev(sr + c, v);
        vmax = maxv(vmax, v);
    }
    const float tile_max = hmaxv(vmax), m = tile_max > *row_max ? tile_max : *row_max;
    vf vsum = {0};
    for (int64_t c = 0; c < n; c += VL) {
        const vi visible = lane < (vi){0} + (int32_t)(n - c);
        const vf e = (vf)(visible & (vi)expv(loadv(sr + c) - m));
        storev(p + c, e);
        vsum += e;
    }
    const float correction = expf(*row_max - m);
    const v8f h = fold8(vsum);
    *row_sum = *row_sum * correction +
               (((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7])));
    *row_max = m;
    return correction;
}

/* The first key a query token at `pos` sees (weir.kernels.reference.AttentionSpan.first_key):
   with span > 0 its sliding window's, pos - span + 1 (negative: none hidden yet), or with
   `chunked` its chunk's; 0 without a span. It never decreases along a request's tokens, so an
   item's first token bounds the keys the item reads, and its last those every row sees. */
static inline int64_t first_visible(int64_t pos, int64_t span, int64_t chunked) {
    if (span <= 0) return 0;
    return chunked ? pos - pos % span : pos - span + 1;
}

/* One row's online-softmax step over the keys [from, n) of this tile, the first `from` hidden
   from it by its span. Its scores from `from` rounded down to VL up to `from` become
   -inf, so softmax_tile reads whole vectors of this row only; their probabilities (expv's
   floor, ~1e-38) vanish in the row's sum, which holds its max's own 1, and the values' sum
   starts at `from`. Not inlined: a second inlined copy of the softmax and the values' sum
   cost attend_item's causal loop registers (1% more instructions on the prefill of
   benchmarks/cpu_attention.py, by callgrind). */
static __attribute__((noinline)) void attend_span_row(float *sr, int64_t from, int64_t n,
                                                      float *row_max, float *row_sum, float *p,
                                                      float *a, const float *const *vrow,
                                                      int64_t head_dim) {
    const int64_t c0 = from & ~(int64_t)(VL - 1);
    for (int64_t j = c0; j < from; j++) sr[j] = -INFINITY;
    const float correction = softmax_tile(sr + c0, n - c0, row_max, row_sum, p);
    accumulate_values(a, correction, p + (from - c0), vrow + from, n - from, head_dim);
}

/* Gemma 2's soft cap of the scores s[r * tile + j] of rows [0, rows) and keys [0, nk):
   s = cap * tanh(s / cap). The keys past nk and those a row does not see are masked by the
   softmax afterwards whatever their value. Not inlined, and called only with a cap, so the
   uncapped path keeps its loops and registers as they were. */
static __attribute__((noinline)) void softcap_tile(float *s, int64_t rows, int64_t tile,
                                                   int64_t nk, float cap) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * tile;
        int64_t j = 0;
        for (; j + VL <= nk; j += VL) storev(row + j, cap * tanhv(loadv(row + j) / cap));
        for (; j < nk; j++) row[j] = cap * tanhf(row[j] / cap);
    }
}

/* One work item: `num_tokens` consecutive query tokens of one request, times the `group`
   query heads of each of its KV heads, against that request's keys 0 .. context + token
   (with a span > 0, first_visible(context + token) .. context + token: the tiles start at
   the item's first token's first visible key, and each row skips the keys of a tile below
   its own first one; with a softcap > 0, each tile's scores are capped first; with
   sinks, each query head's sink logit joins its softmax's denominator at the end),
   with an online softmax over tiles of keys read in place from the paged cache: WIDE_TILE
   keys for few rows per KV head (the per-tile softmax bookkeeping is then paid once per 128
   keys; NARROW_TILE over an fp8 or bf16 cache), KEY_TILE for many (the transposed tile
   lives in L1). An item of several KV heads walks each tile's cache slots once for all of
   them: the heads of a slot are adjacent, so the tile is read as contiguous runs rather than
   one head's stripe of every slot. */
static void attend_item(const WorkItem *w, const float *q, int64_t q_stride, float *out,
                        int64_t out_stride, const void *key_cache, const void *value_cache,
                        int64_t cache_format, const float *fp8_values,
                        const int32_t *query_start_loc, const int32_t *seq_lens,
                        const int32_t *block_table, int64_t block_table_stride,
                        int64_t block_size, int64_t num_kv_heads,
                        int64_t group, int64_t head_dim, float scale, int64_t span,
                        int64_t chunked, float softcap, const float *sinks, float *scratch) {
    const int64_t head_rows = (int64_t)w->num_tokens * group, heads = w->num_kv_heads;
    const int64_t rows = head_rows * heads;
    const int64_t tile = head_rows >= TRANSPOSE_ROWS ? KEY_TILE
                         : cache_format            ? NARROW_TILE
                                                   : WIDE_TILE;
    const int64_t q_len = query_start_loc[w->req + 1] - query_start_loc[w->req];
    const int64_t context = seq_lens[w->req] - q_len;
    const int64_t token0 = query_start_loc[w->req] + w->first_token;
    const int64_t last_key = context + w->first_token + w->num_tokens - 1;
    const int64_t pos0 = context + w->first_token, first0 = first_visible(pos0, span, chunked);
    const int64_t first_key = first0 > 0 ? first0 : 0;
    /* The item's last row's first key: no row's is later. */
    const int64_t last_first = first_visible(last_key, span, chunked);
    const int32_t *table = block_table + (int64_t)w->req * block_table_stride;
    const int64_t slot_size = num_kv_heads * head_dim, head_offset = w->kv_head * head_dim;
    const int64_t item_floats = heads * head_dim;

    /* Row r = (h * num_tokens + i) * group + g: query head (kv_head + h) * group + g of token i. */
    float *qs = scratch;                 /* [rows][head_dim], scaled queries */
    float *acc = qs + rows * head_dim;   /* [rows][head_dim] */
    float *kt = acc + rows * head_dim;   /* [head_dim][KEY_TILE] */
    float *s = kt + head_dim * KEY_TILE; /* [head_rows][tile] */
    float *row_max = s + head_rows * tile, *row_sum = row_max + rows;
    /* An fp8 or bf16 cache's tile, widened to floats: [tile][item_floats] each for K and V. */
    float *kdec = row_sum + rows, *vdec = kdec + tile * item_floats;
    const int64_t item_bytes = cache_format == 3 ? 2 : cache_format ? 1 : 4;
    const char *kc = key_cache, *vc = value_cache;
    const float *kslot[WIDE_TILE], *vslot[WIDE_TILE], *krow[WIDE_TILE], *vrow[WIDE_TILE];
    float p[WIDE_TILE];

    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = r / head_rows, i = r % head_rows / group, g = r % group;
        const float *src =
            q + (token0 + i) * q_stride + ((w->kv_head + h) * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) qs[r * head_dim + d] = src[d] * scale;
        row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);

    for (int64_t j0 = first_key; j0 <= last_key; j0 += tile) {
        const int64_t nk = last_key - j0 + 1 < tile ? last_key - j0 + 1 : tile;
        /* One division per tile: the keys' block and offset advance by increments. */
        int64_t block = j0 / block_size, offset = j0 % block_size;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t at = ((int64_t)table[block] * block_size + offset) * slot_size + head_offset;
            kslot[j] = (const float *)(kc + at * item_bytes);
            vslot[j] = (const float *)(vc + at * item_bytes);
            if (++offset == block_size) offset = 0, block++;
        }
        if (cache_format)
            for (int64_t j = 0; j < nk; j++) {
                float *kd = kdec + j * item_floats, *vd = vdec + j * item_floats;
                widen((const char *)kslot[j], kd, item_floats, cache_format, fp8_values);
                widen((const char *)vslot[j], vd, item_floats, cache_format, fp8_values);
                kslot[j] = kd, vslot[j] = vd;
            }
        for (int64_t j = nk; j < tile; j++) kslot[j] = kslot[0], vslot[j] = vslot[0];
        /* The next tile's rows are scattered over blocks the hardware prefetcher cannot
           guess: ask for them now, so they arrive while this tile is computed. */
        const int64_t next_nk = last_key - j0 - tile + 1 < tile ? last_key - j0 - tile + 1 : tile;
        for (int64_t j = 0; j < next_nk; j++) {
            const int64_t at = ((int64_t)table[block] * block_size + offset) * slot_size + head_offset;
            for (int64_t d = 0; d < item_floats * item_bytes; d += 64) {
                __builtin_prefetch(kc + at * item_bytes + d, 0, 2);
                __builtin_prefetch(vc + at * item_bytes + d, 0, 2);
            }
            if (++offset == block_size) offset = 0, block++;
        }
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t j = 0; j < tile; j++)
                krow[j] = kslot[j] + h * head_dim, vrow[j] = vslot[j] + h * head_dim;
            const int64_t r0 = h * head_rows;
            score_tile(qs + r0 * head_dim, head_rows, krow, tile, head_dim, kt, s);
            if (softcap > 0.0f) softcap_tile(s, head_rows, tile, nk, softcap);
            /* Row r's token, at position pos0 + r / group, sees keys first_visible(pos) .. pos:
               this tile's [from, n). Where even the item's last row sees back to j0 (always
               without a span), no row has hidden keys here: the plain causal loop. */
            if (last_first <= j0) {
                for (int64_t r = 0; r < head_rows; r++) {
                    const int64_t visible = pos0 + r / group - j0 + 1;
                    const int64_t n = visible < nk ? visible : nk;
                    if (n <= 0) continue;
                    const float correction =
                        softmax_tile(s + r * tile, n, row_max + r0 + r, row_sum + r0 + r, p);
                    accumulate_values(acc + (r0 + r) * head_dim, correction, p, vrow, n,
                                      head_dim);
                }
            } else {
                for (int64_t r = 0; r < head_rows; r++) {
                    const int64_t pos = pos0 + r / group;
                    const int64_t n = pos - j0 + 1 < nk ? pos - j0 + 1 : nk;
                    const int64_t first = first_visible(pos, span, chunked) - j0;
                    const int64_t from = first > 0 ? first : 0;
                    if (n <= from) continue;
                    attend_span_row(s + r * tile, from, n, row_max + r0 + r, row_sum + r0 + r,
                                    p, acc + (r0 + r) * head_dim, vrow, head_dim);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = r / head_rows, i = r % head_rows / group, g = r % group;
        const int64_t head = (w->kv_head + h) * group + g;
        float *dst = out + (token0 + i) * out_stride + head * head_dim;
        /* row_sum is in units of exp(row_max): the sink's exp(sink) joins it there (an
           overflow to inf is the right limit, an output of 0). */
        const float inv =
            1.0f / (row_sum[r] + (sinks ? expf(sinks[head] - row_max[r]) : 0.0f));
        for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[r * head_dim + d] * inv;
    }
}

/* Paged attention over a flat batch: q[t, head, :] at q + t * q_stride + head * head_dim,
   out likewise; the cache is [num_blocks * block_size, num_kv_heads, head_dim] per K and V.
   Request r owns query rows query_start_loc[r] .. query_start_loc[r + 1] and has
   seq_lens[r] keys, the last of them its own queries' (causal within the chunk). With
   span > 0, each query token sees only those from first_visible(its position) on: the last
   `span` up to its own (itself included, a sliding-window layer) or with `chunked` those of
   its own chunk of `span` positions (Llama 4's chunked local attention); span 0 is plain
   causal attention. With softcap > 0 (Gemma 2's attn_logit_softcapping), each scaled score s
   becomes softcap * tanh(s / softcap) before the softmax; softcap 0 leaves the scores as they
   are.
   With sinks (gpt-oss' attention sinks: num_heads logits, NULL for none), query head h's
   softmax has one more term, exp(sinks[h]), in its denominator and no value for it.
   With cache_format 1 (e4m3) or 2 (e5m2), the caches hold one byte a channel (fp8_values: the
   256 floats the format's bytes stand for), with 3 two (bfloat16), widened a tile at a time;
   0 is a float32 cache.
   Returns 0; -1 when scratch memory could not be allocated; -2 (nothing read) when the
   metadata points outside the batch's num_tokens rows, the block table's width or the
   cache's num_blocks. */
int weir_paged_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                         int64_t num_tokens, const void *key_cache, const void *value_cache,
                         int64_t num_blocks, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int64_t num_reqs, const int32_t *block_table,
                         int64_t block_table_stride, int64_t block_table_width,
                         int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, float scale, int64_t span, int64_t chunked,
                         float softcap, const float *sinks, int64_t cache_format,
                         const float *fp8_values) {
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t start = query_start_loc[r], end = query_start_loc[r + 1];
        const int64_t blocks = (seq_lens[r] + block_size - 1) / block_size;
        if (start < 0 || end < start || end > num_tokens || seq_lens[r] < end - start ||
            blocks > block_table_width)
            return -2;
        for (int64_t b = 0; b < blocks && end > start; b++) {
            const int32_t block = block_table[r * block_table_stride + b];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    const int64_t group = num_heads / num_kv_heads;
    int64_t tokens_per_item = MAX_TILE_ROWS / group;
    if (tokens_per_item < 1) tokens_per_item = 1;
    /* A request with few query rows per KV head (a decode, a short speculative query) is one
       item over all its KV heads when there are enough requests to share out between the
       threads: it then reads its cache slots whole. */
#if defined(_OPENMP)
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    const int merge_heads = num_reqs >= 2 * threads;
    int64_t num_items = 0, max_rows = tokens_per_item * group;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        if (merge_heads && q_len > 0 && q_len * group < TRANSPOSE_ROWS) {
            num_items++;
            if (q_len * group * num_kv_heads > max_rows) max_rows = q_len * group * num_kv_heads;
        } else {
            num_items += num_kv_heads * ((q_len + tokens_per_item - 1) / tokens_per_item);
        }
    }
    if (num_items == 0) return 0;
    WorkItem *items = malloc(sizeof(WorkItem) * num_items);
    if (!items) return -1;
    /* Items with the most keys first, so the dynamic schedule ends with short ones. */
    int64_t n = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        if (merge_heads && q_len > 0 && q_len * group < TRANSPOSE_ROWS) {
            items[n++] = (WorkItem){(int32_t)r, 0, (int32_t)num_kv_heads, 0, (int32_t)q_len};
            continue;
        }
        for (int64_t t = q_len - ((q_len - 1) % tokens_per_item + 1); t >= 0 && q_len > 0;
             t -= tokens_per_item)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t nt = q_len - t < tokens_per_item ? q_len - t : tokens_per_item;
                items[n++] = (WorkItem){(int32_t)r, (int32_t)h, 1, (int32_t)t, (int32_t)nt};
            }
    }
    const size_t scratch_floats =
        (size_t)(2 * max_rows * head_dim + head_dim * KEY_TILE + max_rows * WIDE_TILE + 2 * max_rows +
                 (cache_format ? 2 * NARROW_TILE * num_kv_heads * head_dim : 0));
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++)
            if (scratch)
                attend_item(&items[i], q, q_stride, out, out_stride, key_cache, value_cache,
                            cache_format, fp8_values, query_start_loc, seq_lens, block_table,
                            block_table_stride, block_size, num_kv_heads, group, head_dim,
                            scale, span, chunked, softcap, sinks, scratch);
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}

/* Float32 matmul against a weight prepacked into panels (weir_pack_panels): the projections
   and the LM head of every CPU step, in blocks of BLOCK_ROWS rows of x by a unit of one or two
   panels (16 weight rows interleaved, [k][16]). With 256-bit vectors a panel's 6 x 16 block is
   twelve registers: one pass over k per panel broadcasts six activations per step, twelve FMAs
   per two panel loads, about 1.2-1.4x the rate of oneDNN's and MKL's float32 GEMM at a decode
   step's rows on the AVX2 machines measured. With AVX-512 a panel's 16 columns fill one
   register and there are 32 registers, so a unit is two panels in one pass over blocks of 8
   rows: sixteen FMAs of 16 lanes per two panel loads and eight broadcasts (there the 256-bit
   kernel ran at half of oneDNN's rate from 64 rows up, this one at 0.8-1.17x of it in blocks of
   6, 3-10% more in blocks of 8; docs/benchmarks.md). Written with vector extensions, so it
   builds anywhere. */
#define PANEL 16 /* output columns (weight rows) per panel */
#define CHUNK_ROWS 96 /* rows of x per pass over the panels: 96 x k stays in L2 */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* w [n][k] row-major -> panels [ceil(n / 16)][k][16], rows past n zero: the panel of rows
   [j0, j0 + 16), elements of `size` bytes (a constant where inlined, so each copy is inlined;
   the callers' parallel loops are outlined before that could happen). */
ALWAYS_INLINE void pack_panel(const char *w, int64_t n, int64_t k, size_t size, int64_t j0,
                              char *panels) {
    char *panel = panels + (j0 / PANEL) * k * PANEL * size;
    for (int64_t c = 0; c < k; c++)
        for (int64_t j = 0; j < PANEL; j++) {
            char *to = panel + (c * PANEL + j) * size;
            if (j0 + j < n)
                memcpy(to, w + ((j0 + j) * k + c) * size, size);
            else
                memset(to, 0, size);
        }
}

void weir_pack_panels(const float *w, int64_t n, int64_t k, float *panels) {
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += PANEL)
        pack_panel((const char *)w, n, k, sizeof *w, j0, (char *)panels);
}

/* int8 weights (`--quantization int8`): the same panels of int8 codes, a quarter of float32's
   bytes; the kernel widens each step's 16 codes to float32 in registers and multiplies as
   float32, the rows' per-output scales applied to the sums. */
void weir_pack_panels_int8(const int8_t *w, int64_t n, int64_t k, int8_t *panels) {
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += PANEL)
        pack_panel((const char *)w, n, k, sizeof *w, j0, (char *)panels);
}

/* bfloat16 weights: the same panels of 16 weight rows, each 32-bit word holding a pair of
   consecutive inputs' bf16 values (the even one in the low half), [ceil(n / 16)][ceil(k / 2)]
   [16]; the rows of x are rounded to bf16 pairs alike, so a step of the loop over k covers two
   inputs with the same loads as a float32 step covers one. With AVX512_BF16 one instruction
   multiplies and adds a pair (twice the float32 FMA's work); elsewhere the pairs are widened
   to float32 (exactly) and multiplied as float32, which halves only the weights' bytes. */

/* What a panel's elements are (the kernel's KIND, a constant where inlined). */
enum { W_F32, W_BF16, W_INT8 };
#define PREFETCH_BYTES 2048 /* how far ahead in a panel its lines are asked for */

/* x's word c: a float32's bits (W_F32, W_INT8) or a bf16 pair's (W_BF16). */
ALWAYS_INLINE uint32_t word(const float *x, int64_t c) {
    uint32_t u;
    memcpy(&u, x + c, sizeof u);
    return u;
}

/* unit_rows: a unit's block for ROWS rows of x (1 to 6; a constant where inlined, so rows a
   block does not have cost nothing): ROWS x 16 outputs of panel a and of panel b (pb NULL: no
   panel b) over all of k (W_BF16: k pairs), each row's 16 outputs as two v8f halves in acc_a
   and acc_b. */
#if defined(__AVX512F__)
#define UNIT_PANELS 2 /* a plain matmul's panels per unit: both in one pass */
#define BLOCK_ROWS 8  /* sixteen accumulators of 32 registers (10 or 12 rows: no faster) */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Step c of a panel: its 16 weights (bf16: pairs) as a vector of float32 lanes. */
ALWAYS_INLINE v16f panel_step(const void *panel, int64_t c, int KIND) {
    if (KIND == W_INT8) { /* GCC 12 builds __builtin_convertvector's widening byte by byte */
        const void *codes = (const int8_t *)panel + c * PANEL;
        return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes)));
    }
    return load16((const float *)panel + c * PANEL);
}

/* acc + x's pair times w's pair, lane by lane. */
ALWAYS_INLINE v16f dot_bf16(v16f acc, v16u x, v16u w) {
#if defined(__AVX512BF16__)
    return (v16f)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
#else
    return acc + (v16f)(x << 16) * (v16f)(w << 16) +
           (v16f)(x & 0xffff0000u) * (v16f)(w & 0xffff0000u);
#endif
}

/* Row r's step c of both panels' blocks. */
ALWAYS_INLINE void row_step(v16f *a, v16f *b, const float *xr, int64_t c, int KIND, v16f wa,
                            v16f wb) {
    if (KIND == W_BF16) {
        const v16u s = (v16u){0} + word(xr, c);
        *a = dot_bf16(*a, s, (v16u)wa), *b = dot_bf16(*b, s, (v16u)wb);
    } else {
        const float s = xr[c];
        *a += s * wa, *b += s * wb;
    }
}

/* One pass over k: both panels' blocks in 16-lane accumulators (the row loop unrolled, so they
   live in registers). */
ALWAYS_INLINE void unit_rows(const float *x, int64_t x_stride, int ROWS, int KIND,
                             const void *pa, const void *pb, int64_t k,
                             v8f acc_a[2 * BLOCK_ROWS], v8f acc_b[2 * BLOCK_ROWS]) {
    v16f a[BLOCK_ROWS] = {{0}}, b[BLOCK_ROWS] = {{0}};
    const int64_t step_bytes = PANEL * (KIND == W_INT8 ? 1 : 4);
    if (!pb) pb = pa; /* computed, never stored */
    for (int64_t c = 0; c < k; c++) {
        __builtin_prefetch((const char *)pa + c * step_bytes + PREFETCH_BYTES);
        __builtin_prefetch((const char *)pb + c * step_bytes + PREFETCH_BYTES);
        const v16f wa = panel_step(pa, c, KIND), wb = panel_step(pb, c, KIND);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) row_step(&a[r], &b[r], x + r * x_stride, c, KIND, wa, wb);
    }
    memcpy(acc_a, a, sizeof a);
    memcpy(acc_b, b, sizeof b);
}
#else
#define UNIT_PANELS 1 /* a second panel would be a second pass: no gain in pairing them */
#define BLOCK_ROWS 6  /* twelve accumulators of 16 registers */
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline v8f broadcast(float v) { return (v8f){v, v, v, v, v, v, v, v}; }

/* Half h of step c of a panel: 8 of its 16 weights (bf16: pairs) as float32 lanes. */
ALWAYS_INLINE v8f panel_half(const void *panel, int64_t c, int h, int KIND) {
    if (KIND == W_INT8) {
        const int8_t *codes = (const int8_t *)panel + c * PANEL + 8 * h;
#if defined(__AVX2__)
        return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)codes)));
#else
        return (v8f){codes[0], codes[1], codes[2], codes[3], codes[4], codes[5], codes[6],
                     codes[7]};
#endif
    }
    return load8((const float *)panel + c * PANEL + 8 * h);
}

/* acc + x's pair times w's pair, lane by lane. */
ALWAYS_INLINE v8f dot_bf16_8(v8f acc, v8u x, v8u w) {
    return acc + (v8f)(x << 16) * (v8f)(w << 16) + (v8f)(x & 0xffff0000u) * (v8f)(w & 0xffff0000u);
}

/* Row r's step c of a panel's block (its two halves). */
ALWAYS_INLINE void row_step(v8f *lo, v8f *hi, const float *xr, int64_t c, int KIND, v8f w0,
                            v8f w1) {
    if (KIND == W_BF16) {
        const v8u s = (v8u){0} + word(xr, c);
        *lo = dot_bf16_8(*lo, s, (v8u)w0), *hi = dot_bf16_8(*hi, s, (v8u)w1);
    } else {
        const v8f a = broadcast(xr[c]);
        *lo += a * w0, *hi += a * w1;
    }
}

/* One panel's block: twelve 8-lane accumulators (two halves a row). */
ALWAYS_INLINE void panel_rows(const float *x, int64_t x_stride, int ROWS, int KIND,
                              const void *panel, int64_t k, v8f acc[2 * BLOCK_ROWS]) {
    v8f lo[BLOCK_ROWS] = {{0}}, hi[BLOCK_ROWS] = {{0}};
    const int64_t step_bytes = PANEL * (KIND == W_INT8 ? 1 : 4);
    for (int64_t c = 0; c < k; c++) {
        __builtin_prefetch((const char *)panel + c * step_bytes + PREFETCH_BYTES);
        const v8f b0 = panel_half(panel, c, 0, KIND), b1 = panel_half(panel, c, 1, KIND);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) row_step(&lo[r], &hi[r], x + r * x_stride, c, KIND, b0, b1);
    }
    for (int r = 0; r < BLOCK_ROWS; r++) acc[2 * r] = lo[r], acc[2 * r + 1] = hi[r];
}

/* A pass over k per panel (none for a missing panel b). */
ALWAYS_INLINE void unit_rows(const float *x, int64_t x_stride, int ROWS, int KIND,
                             const void *pa, const void *pb, int64_t k,
                             v8f acc_a[2 * BLOCK_ROWS], v8f acc_b[2 * BLOCK_ROWS]) {
    panel_rows(x, x_stride, ROWS, KIND, pa, k, acc_a);
    if (pb) panel_rows(x, x_stride, ROWS, KIND, pb, k, acc_b);
}
#endif

/* One unit's block of rows <= BLOCK_ROWS rows of x. */
ALWAYS_INLINE void unit_block(const float *x, int64_t x_stride, int64_t rows, int KIND,
                              const void *pa, const void *pb, int64_t k,
                              v8f acc_a[2 * BLOCK_ROWS], v8f acc_b[2 * BLOCK_ROWS]) {
    switch (rows) {
    case 1: unit_rows(x, x_stride, 1, KIND, pa, pb, k, acc_a, acc_b); break;
    case 2: unit_rows(x, x_stride, 2, KIND, pa, pb, k, acc_a, acc_b); break;
    case 3: unit_rows(x, x_stride, 3, KIND, pa, pb, k, acc_a, acc_b); break;
    case 4: unit_rows(x, x_stride, 4, KIND, pa, pb, k, acc_a, acc_b); break;
    case 5: unit_rows(x, x_stride, 5, KIND, pa, pb, k, acc_a, acc_b); break;
#if BLOCK_ROWS == 8
    case 6: unit_rows(x, x_stride, 6, KIND, pa, pb, k, acc_a, acc_b); break;
    case 7: unit_rows(x, x_stride, 7, KIND, pa, pb, k, acc_a, acc_b); break;
#endif
    default: unit_rows(x, x_stride, BLOCK_ROWS, KIND, pa, pb, k, acc_a, acc_b); break;
    }
}

/* Rows [i0, i0 + rows) x outputs [j0, j0 + cols) of a plain matmul from a panel's block of
   sums, sums[i * PANEL + j]. */
static inline void store_block(const float *sums, int64_t i0, int64_t rows, int64_t j0,
                               int64_t cols, const float *bias, const float *residual,
                               int64_t residual_stride, float *out, int64_t out_stride) {
    const v8f b0 = bias && cols == PANEL ? load8(bias + j0) : (v8f){0};
    const v8f b1 = bias && cols == PANEL ? load8(bias + j0 + 8) : (v8f){0};
    for (int64_t i = 0; i < rows; i++) {
        const float *v = sums + i * PANEL;
        float *o = out + (i0 + i) * out_stride + j0;
        const float *r = residual ? residual + (i0 + i) * residual_stride + j0 : NULL;
        if (cols == PANEL) {
            v8f lo = load8(v) + b0, hi = load8(v + 8) + b1;
            if (r) lo += load8(r), hi += load8(r + 8);
            store8(o, lo);
            store8(o + 8, hi);
            continue;
        }
        for (int64_t j = 0; j < cols; j++)
            o[j] = (v[j] + (bias ? bias[j0 + j] : 0.0f)) + (r ? r[j] : 0.0f);
    }
}

/* Rows [i0, i0 + rows) x outputs [j0, j0 + PANEL) of a gated matmul from the gate's and the
   up's blocks of sums (g[i * PANEL + j], u likewise): silu(g) * u, as weir_silu_mul. */
static inline void store_gated(const float *g, const float *u, int64_t i0, int64_t rows,
                               int64_t j0, int64_t n, const float *bias, float *out,
                               int64_t out_stride) {
    for (int64_t i = 0; i < rows; i++) {
        float *o = out + (i0 + i) * out_stride + j0;
        for (int64_t c = 0; c < PANEL; c += VL) {
            const vf gv = loadv(g + i * PANEL + c) + (bias ? loadv(bias + j0 + c) : (vf){0});
            const vf uv = loadv(u + i * PANEL + c) + (bias ? loadv(bias + n + j0 + c) : (vf){0});
            storev(o + c, gv / (1.0f + expv(-gv)) * uv);
        }
    }
}

/* A unit's block of sums (panel a's in sa, panel b's in sb; [rows][PANEL] each) to the
   outputs: plain (each panel's columns, panel b's only with has_b) or gated. */
static inline void store_unit(const float *sa, const float *sb, int64_t i0, int64_t rows,
                              int64_t pa, int64_t pb, int has_b, int64_t n, const float *bias,
                              const float *residual, int64_t residual_stride, float *out,
                              int64_t out_stride, int gated) {
    const int64_t j0 = pa * PANEL;
    if (gated) {
        store_gated(sa, sb, i0, rows, j0, n, bias, out, out_stride);
        return;
    }
    store_block(sa, i0, rows, j0, n - j0 < PANEL ? n - j0 : PANEL, bias, residual,
                residual_stride, out, out_stride);
    if (has_b) {
        const int64_t j1 = pb * PANEL;
        store_block(sb, i0, rows, j1, n - j1 < PANEL ? n - j1 : PANEL, bias, residual,
                    residual_stride, out, out_stride);
    }
}

/* A block of sums [rows][PANEL] of outputs [j0, j0 + PANEL) times their weight rows' scales
   (int8 codes), outputs from `columns` on left as they are (never stored). */
static inline void scale_sums(float *sums, int64_t rows, const float *scale, int64_t j0,
                              int64_t columns) {
    if (columns - j0 >= PANEL) {
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < PANEL; j++) sums[i * PANEL + j] *= scale[j0 + j];
        return;
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < columns - j0; j++) sums[i * PANEL + j] *= scale[j0 + j];
}

/* The matmul's loop over blocks of BLOCK_ROWS rows x one unit, row chunks and units shared
   out between the threads. Plain: out[i, j] = (residual[i, j] +) (bias[j] +) x[i] . w[j] for
   j < n, a unit being UNIT_PANELS panels in order (an odd last one alone). Gated (the gate/up
   projection of a gated MLP, n a multiple of PANEL): the panels hold the gate's n rows and
   then the up's n rows, a unit is panel p of each, and out[i, j] = silu(g) * u with g =
   (bias[j] +) x[i] . w[j] and u = (bias[n + j] +) x[i] . w[n + j], computed as weir_silu_mul
   computes it, so the [m, 2n] projection output is never written. Both kernels sum each
   output in the same order: their results are equal. bf16: x and the panels hold bf16 pairs,
   k counts pairs. */
static void linear_blocks(const float *x, int64_t x_stride, int64_t m, const void *panels,
                          int64_t n, int64_t k, const float *scale, const float *bias,
                          const float *residual, int64_t residual_stride, float *out,
                          int64_t out_stride, int gated, int kind) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    const int64_t units = gated ? num_panels : (num_panels + UNIT_PANELS - 1) / UNIT_PANELS;
    const int64_t chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t panel_bytes = k * PANEL * (kind == W_INT8 ? 1 : 4);
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t chunk = 0; chunk < chunks; chunk++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t pa = gated ? u : UNIT_PANELS * u;
            const int64_t pb = gated ? num_panels + u : UNIT_PANELS * u + 1;
            const int has_b = gated || (UNIT_PANELS == 2 && pb < num_panels);
            /* Chunks of equal sizes (to one row): as 96 + 4, 100 rows ran at half the rate
               of 50 + 50, the 4-row chunk's work items as many as the 96-row chunk's. */
            const int64_t begin = chunk * m / chunks, end = (chunk + 1) * m / chunks;
            for (int64_t i0 = begin; i0 < end; i0 += BLOCK_ROWS) {
                const int64_t rows = end - i0 < BLOCK_ROWS ? end - i0 : BLOCK_ROWS;
                v8f acc[2 * BLOCK_ROWS], acc_b[2 * BLOCK_ROWS];
                const float *xi = x + i0 * x_stride;
                const char *wa = (const char *)panels + pa * panel_bytes;
                const char *wb = has_b ? (const char *)panels + pb * panel_bytes : NULL;
                if (kind == W_BF16)
                    unit_block(xi, x_stride, rows, W_BF16, wa, wb, k, acc, acc_b);
                else if (kind == W_INT8)
                    unit_block(xi, x_stride, rows, W_INT8, wa, wb, k, acc, acc_b);
                else
                    unit_block(xi, x_stride, rows, W_F32, wa, wb, k, acc, acc_b);
                if (scale) {
                    const int64_t columns = gated ? 2 * n : n;
                    scale_sums((float *)acc, rows, scale, pa * PANEL, columns);
                    if (has_b) scale_sums((float *)acc_b, rows, scale, pb * PANEL, columns);
                }
                store_unit((const float *)acc, (const float *)acc_b, i0, rows, pa, pb, has_b,
                           n, bias, residual, residual_stride, out, out_stride, gated);
            }
        }
}

/* out[i, j] = (residual[i, j] +) (bias[j] +) sum_c x[i, c] * w[j, c] for i < m, j < n. */
void weir_linear(const float *x, int64_t x_stride, int64_t m, const float *panels, int64_t n,
                 int64_t k, const float *bias, const float *residual, int64_t residual_stride,
                 float *out, int64_t out_stride) {
    linear_blocks(x, x_stride, m, panels, n, k, NULL, bias, residual, residual_stride, out,
                  out_stride, 0, W_F32);
}

/* out [m, n] = silu(x w[:n]^T + bias[:n]) * (x w[n:]^T + bias[n:]) for the fused gate/up
   weight w [2n, k] packed by weir_pack_panels, n a multiple of PANEL. */
void weir_linear_silu_mul(const float *x, int64_t x_stride, int64_t m, const float *panels,
                          int64_t n, int64_t k, const float *bias, float *out,
                          int64_t out_stride) {
    linear_blocks(x, x_stride, m, panels, n, k, NULL, bias, NULL, 0, out, out_stride, 1, W_F32);
}

/* float32 -> bfloat16, rounded to nearest even (as PyTorch's and the CPU's conversions). */
static inline uint32_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u; /* NaN stays a quiet NaN */
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

/* w [n][k] bf16 row-major -> panels of bf16 pairs [ceil(n / 16)][ceil(k / 2)][16], zero past
   n and k. */
void weir_pack_panels_bf16(const uint16_t *w, int64_t n, int64_t k, uint32_t *panels) {
    const int64_t pairs = (k + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += PANEL) {
        uint32_t *panel = panels + (j0 / PANEL) * pairs * PANEL;
        for (int64_t c = 0; c < pairs; c++)
            for (int64_t j = 0; j < PANEL; j++) {
                uint32_t pair = 0;
                if (j0 + j < n) {
                    const uint16_t *row = w + (j0 + j) * k;
                    pair = row[2 * c] | (2 * c + 1 < k ? (uint32_t)row[2 * c + 1] << 16 : 0);
                }
                panel[c * PANEL + j] = pair;
            }
    }
}

#define ROUND_PAIRS 16 /* pairs of inputs round_row writes together */

/* bf16 bits -> the float32 they stand for. */
static inline float from_bf16(uint32_t b) {
    const uint32_t u = b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A row of x rounded to bf16 pairs: ROUND_PAIRS pairs (32 inputs) at a time into
   dst[s * step] for step s (the whole steps, k / 32 of them), the last k % 32 inputs' pairs
   after them. With `rest` (k a multiple of 32), what rounding left, x minus its bf16 value,
   rounded to bf16 pairs alike: x = dst + rest to 16 significant bits. */
static inline void round_row(const float *xr, int64_t k, uint32_t *dst, uint32_t *rest,
                             int64_t step) {
    int64_t s = 0;
    for (; 32 * (s + 1) <= k; s++) {
        const float *src = xr + 32 * s;
        uint32_t *o = dst + s * step;
#if defined(__AVX512BF16__)
        /* RNE as to_bf16 (and inputs below 2^-126 as zero, as the dot products read them) */
        const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
        const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(o, pairs);
        if (rest) {
            const __m512i lo16 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs));
            const __m512i hi16 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1));
            const __m512 lo_rest = lo - (__m512)_mm512_slli_epi32(lo16, 16);
            const __m512 hi_rest = hi - (__m512)_mm512_slli_epi32(hi16, 16);
            _mm512_storeu_si512(rest + s * step, (__m512i)_mm512_cvtne2ps_pbh(hi_rest, lo_rest));
        }
#else
        for (int c = 0; c < 16; c++) {
            const uint32_t a = to_bf16(src[2 * c]), b = to_bf16(src[2 * c + 1]);
            o[c] = a | b << 16;
            if (rest)
                rest[s * step + c] = to_bf16(src[2 * c] - from_bf16(a)) |
                                     to_bf16(src[2 * c + 1] - from_bf16(b)) << 16;
        }
#endif
    }
    uint32_t *o = dst + s * step;
    for (int64_t c = 0; 32 * s + 2 * c < k; c++) {
        const int64_t at = 32 * s + 2 * c;
        o[c] = to_bf16(xr[at]) | (at + 1 < k ? to_bf16(xr[at + 1]) << 16 : 0);
    }
}

/* With AMX (Intel's tile unit: Sapphire Rapids and later), the bf16 panels are already the
   layout its dot product takes for its second operand: a panel's 16 consecutive pair rows
   are one 16 x 64-byte tile (16 pairs of inputs by 16 outputs). x's pairs are laid out as
   tiles too, [m / 16][k / 32][16 rows][16 pairs], so each tile of either operand is 1 KiB
   read in order (x's rows as they are, 1,152 bytes apart, ran 11-19% slower from 256 rows).
   One TDPBF16PS adds a 16 x 16 block of 32-input dot products (8,192 multiply-adds), 16
   times a vdpbf16ps's. Blocks of 32 rows x a unit's two panels: two tiles of x and two of
   weights feed four accumulator tiles (all eight tiles); a block of one tile of x, two
   accumulators (10% faster at 6-16 rows than computing zero rows). Chunks of rows are whole
   tiles; the last tile's rows past m are zero, computed and never stored. From AMX_MIN_ROWS
   rows and for k a multiple of 32 inputs (every shape of the supported models); elsewhere
   the vector kernel. Measured 3-8x the vector kernel from 38 rows (docs/benchmarks.md).
   int8 panels run on the tiles too, from AMX_INT8_MIN_ROWS rows: a unit's codes are made
   bf16 tiles (exactly) once per chunk of rows, and x goes in as two bf16 parts, hi + lo, whose
   products add into the same accumulators: x to 16 significant bits, where the float32
   kernel has 24 (a 256th of the codes' own rounding step). 1.4-2.4x the vector kernel from
   32 rows (docs/benchmarks.md). */
#if AMX
#define AMX_ROWS 16  /* rows of a tile */
#define AMX_PAIRS ROUND_PAIRS /* pairs of inputs a tile step covers: 64 bytes */
#define AMX_TILE_WORDS (AMX_ROWS * AMX_PAIRS)
#define AMX_MIN_ROWS 5 /* fewer rows: the vector kernel (10-20% faster at 1-3 rows, equal at 4) */
#ifndef AMX_INT8_MIN_ROWS
#define AMX_INT8_MIN_ROWS 24 /* fewer rows: the vector kernel (equal at 16-20 rows, 0.6x at 8) */
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux lends a process the tile registers' state only on request (arch_prctl
   ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once, the answer kept. */
static int amx_usable(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0
                ? 1
                : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

static int amx_fits(int64_t m, int64_t k, int64_t min_rows) {
    return m >= min_rows && k % (2 * AMX_PAIRS) == 0 && amx_usable();
}

/* A block's dot products over all steps: accumulators 0-1 (x's first tile times weight tiles
   wa and wb), 2-3 with a second tile of x (TWO); x in PARTS bf16 parts, part p's tiles
   p * part_words words on from the first's (x = hi + lo: the products of both parts summed
   into the same accumulators). */
ALWAYS_INLINE void amx_steps(const uint32_t *x0, const uint32_t *x1, int64_t part_words,
                             int PARTS, int TWO, const uint32_t *wa, const uint32_t *wb,
                             int64_t steps) {
    for (int64_t c = 0; c < steps; c++) {
        _tile_loadd(4, x0 + c * AMX_TILE_WORDS, 64);
        if (TWO) _tile_loadd(5, x1 + c * AMX_TILE_WORDS, 64);
        _tile_loadd(6, wa + c * AMX_TILE_WORDS, 64);
        _tile_loadd(7, wb + c * AMX_TILE_WORDS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (TWO) _tile_dpbf16ps(2, 5, 6);
        if (TWO) _tile_dpbf16ps(3, 5, 7);
        if (PARTS == 2) {
            _tile_loadd(4, x0 + part_words + c * AMX_TILE_WORDS, 64);
            if (TWO) _tile_loadd(5, x1 + part_words + c * AMX_TILE_WORDS, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (TWO) _tile_dpbf16ps(2, 5, 6);
            if (TWO) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* An int8 panel's codes as bf16-pair weight tiles (exact: |code| <= 127 has 7 bits), all
   `steps` of it: pair row r (inputs 2r and 2r + 1) from the panel's 32 bytes at 32r. A code
   widened to float32 has zero low 16 bits, so its bf16 is the float's high half. */
static void int8_panel_tiles(const int8_t *panel, int64_t steps, uint32_t *tiles) {
    for (int64_t r = 0; r < steps * AMX_ROWS; r++) {
        const __m128i *codes = (const void *)(panel + 32 * r);
        const __m512i even =
            (__m512i)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes)));
        const __m512i odd =
            (__m512i)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 1)));
        /* 0xca: the mask ? odd : even shifted down, bit by bit */
        _mm512_storeu_si512(tiles + PANEL * r,
                            _mm512_ternarylogic_epi32(_mm512_set1_epi32(-65536), odd,
                                                      _mm512_srli_epi32(even, 16), 0xca));
    }
}

/* One AMX matmul: xt, x's pairs as tiles (see above), steps = k / 32 tile steps a row, in one
   part or (int8 panels) two, x = hi + lo, the second part_words words on; the panels (bf16's,
   or int8 codes with their `scale`s); the epilogue's operands as store_unit takes them. */
typedef struct {
    const uint32_t *xt;
    int64_t m, n, steps, part_words, row_tiles, chunks, num_panels;
    const void *panels;
    const float *scale, *bias, *residual;
    int64_t residual_stride, out_stride;
    float *out;
    int gated;
} AmxMatmul;

/* Unit u's blocks over the rows of chunk `chunk`: with INT8, x in two parts and the unit's two
   int8 panels made bf16 tiles into unit_tiles first. A constant INT8 where inlined, so each
   kind's copy has only its own loops. */
ALWAYS_INLINE void amx_unit(const AmxMatmul *p, int64_t chunk, int64_t u, int INT8,
                            uint32_t *unit_tiles) {
    const int64_t steps = p->steps, num_panels = p->num_panels;
    const int64_t pa = p->gated ? u : 2 * u, pb = p->gated ? num_panels + u : 2 * u + 1;
    const int has_b = p->gated || pb < num_panels;
    const uint32_t *wa, *wb;
    if (INT8) {
        const int8_t *codes = p->panels;
        int8_panel_tiles(codes + pa * steps * 32 * PANEL, steps, unit_tiles);
        if (has_b)
            int8_panel_tiles(codes + pb * steps * 32 * PANEL, steps,
                             unit_tiles + steps * AMX_TILE_WORDS);
        wa = unit_tiles;
        wb = has_b ? unit_tiles + steps * AMX_TILE_WORDS : wa;
    } else {
        wa = (const uint32_t *)p->panels + pa * steps * AMX_TILE_WORDS;
        wb = (const uint32_t *)p->panels + (has_b ? pb : pa) * steps * AMX_TILE_WORDS;
    }
    const int64_t begin = chunk * p->row_tiles / p->chunks;
    const int64_t end = (chunk + 1) * p->row_tiles / p->chunks;
    for (int64_t t = begin; t < end; t += 2) {
        const uint32_t *x0 = p->xt + t * steps * AMX_TILE_WORDS;
        const uint32_t *x1 = x0 + steps * AMX_TILE_WORDS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (t + 1 < end)
            amx_steps(x0, x1, p->part_words, INT8 ? 2 : 1, 1, wa, wb, steps);
        else
            amx_steps(x0, x1, p->part_words, INT8 ? 2 : 1, 0, wa, wb, steps);
        float sa[2 * AMX_ROWS * PANEL], sb[2 * AMX_ROWS * PANEL];
        _tile_stored(0, sa, PANEL * sizeof *sa);
        _tile_stored(1, sb, PANEL * sizeof *sb);
        _tile_stored(2, sa + AMX_ROWS * PANEL, PANEL * sizeof *sa);
        _tile_stored(3, sb + AMX_ROWS * PANEL, PANEL * sizeof *sb);
        const int64_t i0 = t * AMX_ROWS;
        const int64_t last = (t + 2 <= end ? t + 2 : end) * AMX_ROWS;
        const int64_t rows = (last < p->m ? last : p->m) - i0;
        if (INT8) {
            const int64_t columns = p->gated ? 2 * p->n : p->n;
            scale_sums(sa, rows, p->scale, pa * PANEL, columns);
            if (has_b) scale_sums(sb, rows, p->scale, pb * PANEL, columns);
        }
        store_unit(sa, sb, i0, rows, pa, pb, has_b, p->n, p->bias, p->residual,
                   p->residual_stride, p->out, p->out_stride, p->gated);
    }
}

static void amx_unit_bf16(const AmxMatmul *p, int64_t chunk, int64_t u) {
    amx_unit(p, chunk, u, 0, NULL);
}

static void amx_unit_int8(const AmxMatmul *p, int64_t chunk, int64_t u, uint32_t *unit_tiles) {
    amx_unit(p, chunk, u, 1, unit_tiles);
}

/* The matmul on the tiles, chunks of rows and units shared out between the threads (int8:
   each thread's unit tiles allocated once). Returns 0, or -1 where those could not be. */
static int amx_blocks(const AmxMatmul *p, int int8) {
    const int64_t units = p->gated ? p->num_panels : (p->num_panels + 1) / 2;
    int failed = 0;
#pragma omp parallel
    {
        TileConfig config = {.palette = 1};
        for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = AMX_ROWS;
        _tile_loadconfig(&config);
        uint32_t *unit_tiles =
            int8 ? malloc(2 * p->steps * AMX_TILE_WORDS * sizeof *unit_tiles) : NULL;
        if (int8 && !unit_tiles) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static) collapse(2)
        for (int64_t chunk = 0; chunk < p->chunks; chunk++)
            for (int64_t u = 0; u < units; u++) {
                if (!int8)
                    amx_unit_bf16(p, chunk, u);
                else if (unit_tiles)
                    amx_unit_int8(p, chunk, u, unit_tiles);
            }
        free(unit_tiles);
        _tile_release();
    }
    return failed ? -1 : 0;
}

/* x [m, k] times the panels (bf16's, or int8's with their scales) on the tiles: x's rows made
   tiles of bf16 pairs, in two parts for int8 panels (rows past m zero), then amx_blocks.
   Returns 0, or -1 where a buffer could not be allocated. */
static int amx_matmul(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *panels,
                      int int8, int64_t n, const float *scale, const float *bias,
                      const float *residual, int64_t residual_stride, float *out,
                      int64_t out_stride, int gated) {
    const int64_t steps = k / (2 * AMX_PAIRS), row_tiles = (m + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t chunk_tiles = CHUNK_ROWS / AMX_ROWS, parts = int8 ? 2 : 1;
    const int64_t part_words = row_tiles * steps * AMX_TILE_WORDS;
    uint32_t *xt = malloc((size_t)(parts * part_words) * sizeof *xt);
    if (!xt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < row_tiles * AMX_ROWS; i++) {
        uint32_t *row = xt + (i / AMX_ROWS * steps * AMX_ROWS + i % AMX_ROWS) * AMX_PAIRS;
        if (i < m)
            round_row(x + i * x_stride, k, row, int8 ? row + part_words : NULL, AMX_TILE_WORDS);
        else
            for (int64_t part = 0; part < parts; part++)
                for (int64_t s = 0; s < steps; s++)
                    memset(row + part * part_words + s * AMX_TILE_WORDS, 0,
                           AMX_PAIRS * sizeof *row);
    }
    const AmxMatmul plan = {
        .xt = xt, .m = m, .n = n, .steps = steps, .part_words = part_words,
        .row_tiles = row_tiles, .chunks = (row_tiles + chunk_tiles - 1) / chunk_tiles,
        .num_panels = (n + PANEL - 1) / PANEL, .panels = panels, .scale = scale, .bias = bias,
        .residual = residual, .residual_stride = residual_stride, .out_stride = out_stride,
        .out = out, .gated = gated,
    };
    const int failed = amx_blocks(&plan, int8);
    free(xt);
    return failed;
}
#endif

/* The matmul against bf16 panels: x's rows rounded to bf16 pairs first (once, not per panel;
   as tiles for AMX), then the float32 matmul's blocks over the pairs, or AMX's; sums and
   outputs stay float32. Returns 0, or -1 when the pairs' buffer could not be allocated. */
static int linear_bf16(const float *x, int64_t x_stride, int64_t m, const uint32_t *panels,
                       int64_t n, int64_t k, const float *bias, const float *residual,
                       int64_t residual_stride, float *out, int64_t out_stride, int gated) {
    const int64_t pairs = (k + 1) / 2;
#if AMX
    if (amx_fits(m, k, AMX_MIN_ROWS))
        return amx_matmul(x, x_stride, m, k, panels, 0, n, NULL, bias, residual,
                          residual_stride, out, out_stride, gated);
#endif
    uint32_t *xb = malloc((size_t)(m * pairs + 1) * sizeof *xb); /* + 1: never malloc(0) */
    if (!xb) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++)
        round_row(x + i * x_stride, k, xb + i * pairs, NULL, ROUND_PAIRS);
    linear_blocks((const float *)xb, pairs, m, panels, n, pairs, NULL, bias, residual,
                  residual_stride, out, out_stride, gated, W_BF16);
    free(xb);
    return 0;
}

/* The matmul against int8 panels: with AMX from AMX_INT8_MIN_ROWS rows, x split into two
   bf16 parts (x = hi + lo to 16 significant bits, 2^-16 of x: a 256th of a code's step) times
   the codes made bf16 tiles (exact), on the tiles; otherwise the float32 blocks, the codes
   widened in registers. Returns 0, or -1 when a buffer could not be allocated. */
static int linear_int8(const float *x, int64_t x_stride, int64_t m, const int8_t *panels,
                       int64_t n, int64_t k, const float *scale, const float *bias,
                       const float *residual, int64_t residual_stride, float *out,
                       int64_t out_stride, int gated) {
#if AMX
    if (amx_fits(m, k, AMX_INT8_MIN_ROWS))
        return amx_matmul(x, x_stride, m, k, panels, 1, n, scale, bias, residual,
                          residual_stride, out, out_stride, gated);
#endif
    linear_blocks(x, x_stride, m, panels, n, k, scale, bias, residual, residual_stride, out,
                  out_stride, gated, W_INT8);
    return 0;
}

/* weir_linear with int8 codes packed by weir_pack_panels_int8, weight row j's being
   w[j] / scale[j]: out[i, j] = (residual[i, j] +) (bias[j] +) scale[j] * x[i] . codes[j]. */
int weir_linear_int8(const float *x, int64_t x_stride, int64_t m, const int8_t *panels,
                     int64_t n, int64_t k, const float *scale, const float *bias,
                     const float *residual, int64_t residual_stride, float *out,
                     int64_t out_stride) {
    return linear_int8(x, x_stride, m, panels, n, k, scale, bias, residual, residual_stride,
                       out, out_stride, 0);
}

/* weir_linear_silu_mul with int8 codes packed by weir_pack_panels_int8 and scale [2n]. */
int weir_linear_silu_mul_int8(const float *x, int64_t x_stride, int64_t m,
                              const int8_t *panels, int64_t n, int64_t k, const float *scale,
                              const float *bias, float *out, int64_t out_stride) {
    return linear_int8(x, x_stride, m, panels, n, k, scale, bias, NULL, 0, out, out_stride, 1);
}

/* What the bf16 matmul multiplies with here: 2, AMX's tiles (from AMX_MIN_ROWS rows); 1,
   AVX512_BF16's pair dot products; 0, float32 FMAs over the pairs widened. */
int weir_bf16_matmul_unit(void) {
#if AMX
    if (amx_usable()) return 2;
#endif
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* weir_linear with the weight packed by weir_pack_panels_bf16 (k: x's columns). */
int weir_linear_bf16(const float *x, int64_t x_stride, int64_t m, const uint32_t *panels,
                     int64_t n, int64_t k, const float *bias, const float *residual,
                     int64_t residual_stride, float *out, int64_t out_stride) {
    return linear_bf16(x, x_stride, m, panels, n, k, bias, residual, residual_stride, out,
                       out_stride, 0);
}

/* weir_linear_silu_mul with the weight packed by weir_pack_panels_bf16. */
int weir_linear_silu_mul_bf16(const float *x, int64_t x_stride, int64_t m,
                              const uint32_t *panels, int64_t n, int64_t k, const float *bias,
                              float *out, int64_t out_stride) {
    return linear_bf16(x, x_stride, m, panels, n, k, bias, NULL, 0, out, out_stride, 1);
}

/* Gated DeltaNet's recurrent state columns handled at a time, their reads by k and by q
   accumulating in 2 x DELTA_VECS vectors: 128, Qwen3-Next's and Qwen 3.5's head width, so
   that their states stream whole rows from memory. Reading states past the caches, blocks of
   128 columns took 1.1-1.2 ms a layer of 16 decodes x 16 heads of 128 x 128, 64 columns
   1.25-1.4 and 32 columns 1.8, with 512-bit and 256-bit vectors alike (the latter's 32
   accumulators spill, and still gain: the pass is bound by memory, not registers). The block
   of dk rows stays in L1/L2 between the two passes over it. */
#define DELTA_COLS 128
#define DELTA_VECS (DELTA_COLS / VL)

/* Columns [0, DELTA_COLS) of one head's decode step (see weir_gated_delta_decode) for its
   state s (dk rows of dv), with the write u and the output o of those columns kept in
   registers between the pass that reads the columns and the one that updates them. */
static inline void delta_columns(float *s, int64_t dk, int64_t dv, const float *k,
                                 const float *q, const float *v, float decay, float beta,
                                 float qk, int fresh, float *o) {
    vf kr[DELTA_VECS] = {0}, qr[DELTA_VECS] = {0};
    if (!fresh)
        for (int64_t i = 0; i < dk; i++)
            for (int c = 0; c < DELTA_VECS; c++) {
                const vf x = loadv(s + i * dv + c * VL);
                kr[c] += k[i] * x;
                qr[c] += q[i] * x;
            }
    vf u[DELTA_VECS];
    for (int c = 0; c < DELTA_VECS; c++) {
        u[c] = beta * (loadv(v + c * VL) - decay * kr[c]);
        storev(o + c * VL, decay * qr[c] + qk * u[c]);
    }
    for (int64_t i = 0; i < dk; i++)
        for (int c = 0; c < DELTA_VECS; c++) {
            float *p = s + i * dv + c * VL;
            storev(p, fresh ? k[i] * u[c] : decay * loadv(p) + k[i] * u[c]);
        }
}

/* The gated delta rule's step for one token of each of num_decodes requests
   (kernels/gated_delta_net.py, whose _recurrent_step is the reference), in place in their
   state slots: request r's token is row rows[r] of q, k [num_tokens, k_heads, dk] (already
   L2-normalized, q scaled) at q + t * q_stride, k + t * k_stride, of v [num_tokens, v_heads,
   dv] at v + t * v_stride and of g, beta [num_tokens, v_heads] (contiguous); its state is
   slot slots[r] of state [num_slots, v_heads, dk, dv], taken as zero (and not read) where
   fresh[r] is 1. For v head h, served by key head h / (v_heads / k_heads), with S its state
   and the decay e = exp(g):
     u = beta (v - e S^T k),   S <- e S + k u^T,   out = e S^T q + (q . k) u = S_new^T q
   so S is read once for both products and written once. out: [num_decodes, v_heads, dv].
   Slots must be distinct. Returns 0, or -2 (nothing read or written) when a row or slot lies
   outside num_tokens or num_slots. */
int weir_gated_delta_decode(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                            const float *v, int64_t v_stride, const float *g, const float *beta,
                            int64_t num_tokens, const int64_t *rows, const int64_t *slots,
                            const int64_t *fresh, int64_t num_decodes, float *state,
                            int64_t num_slots, int64_t k_heads, int64_t v_heads, int64_t dk,
                            int64_t dv, float *out) {
    for (int64_t r = 0; r < num_decodes; r++)
        if (rows[r] < 0 || rows[r] >= num_tokens || slots[r] < 0 || slots[r] >= num_slots)
            return -2;
    const int64_t group = v_heads / k_heads, vector_cols = dv - dv % DELTA_COLS;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t r = 0; r < num_decodes; r++)
        for (int64_t h = 0; h < v_heads; h++) {
            const int64_t t = rows[r];
            const float *qh = q + t * q_stride + h / group * dk;
            const float *kh = k + t * k_stride + h / group * dk;
            const float *vh = v + t * v_stride + h * dv;
            float *s = state + (slots[r] * v_heads + h) * dk * dv;
            float *o = out + (r * v_heads + h) * dv;
            const float decay = expf(g[t * v_heads + h]), b = beta[t * v_heads + h];
            const float qk = dot8(qh, kh, dk);
            const int is_fresh = fresh[r] != 0;
            for (int64_t j = 0; j < vector_cols; j += DELTA_COLS)
                delta_columns(s + j, dk, dv, kh, qh, vh + j, decay, b, qk, is_fresh, o + j);
            /* The columns past the last whole block (heads narrower than one), one at a time. */
            for (int64_t j = vector_cols; j < dv; j++) {
                float kr = 0.0f, qr = 0.0f;
                for (int64_t i = 0; i < dk && !is_fresh; i++) {
                    kr += kh[i] * s[i * dv + j];
                    qr += qh[i] * s[i * dv + j];
                }
                const float u = b * (vh[j] - decay * kr);
                o[j] = decay * qr + qk * u;
                for (int64_t i = 0; i < dk; i++)
                    s[i * dv + j] = is_fresh ? kh[i] * u : decay * s[i * dv + j] + kh[i] * u;
            }
        }
    return 0;
}

/* n <= VL floats `stride` apart from p as a vector (lanes past n zero), and back: a block's
   channels of a conv state's column ([channels, width] per slot), or the last block's. */
static inline vf load_lanes(const float *p, int64_t stride, int64_t n) {
    if (n == VL && stride == 1) return loadv(p);
    vf v = {0};
    for (int64_t l = 0; l < n; l++) v[l] = p[l * stride];
    return v;
}

static inline void store_lanes(float *p, int64_t stride, int64_t n, vf v) {
    if (n == VL && stride == 1) {
        storev(p, v);
        return;
    }
    for (int64_t l = 0; l < n; l++) p[l * stride] = v[l];
}

/* A request's input p on n channels: its row p (rows: its first), or for p < 0 its conv
   state's column width + p (zero when fresh). */
static inline vf conv_input(const float *rows, int64_t x_stride, const float *state,
                            int64_t width, int is_fresh, int64_t p, int64_t n) {
    if (p >= 0) return load_lanes(rows + p * x_stride, 1, n);
    return is_fresh ? (vf){0} : load_lanes(state + width + p, width, n);
}

/* Output row i of a request on n <= VL channels: SiLU of the bias (or none) plus each tap's
   weight (weight_t's rows, channels apart) times its input (see conv_input). */
static inline void conv_row(const float *rows, int64_t x_stride, int64_t i, const float *state,
                            int64_t width, int is_fresh, const float *weight_t,
                            int64_t channels, const float *bias, float *out, int64_t n) {
    vf acc = bias ? load_lanes(bias, 1, n) : (vf){0};
    for (int64_t j = 0; j <= width; j++)
        acc += load_lanes(weight_t + j * channels, 1, n) *
               conv_input(rows, x_stride, state, width, is_fresh, i + j - width, n);
    store_lanes(out, 1, n, acc / (1.0f + expv(-acc)));
}

/* A request's conv state on n <= VL channels after its len rows (see weir_causal_conv1d):
   column m takes input len + m - width, a row or the state's own column len + m, to the
   right of m and so not yet overwritten. */
static inline void conv_shift(const float *rows, int64_t x_stride, int64_t len, float *state,
                              int64_t width, int is_fresh, int64_t n) {
    for (int64_t m = 0; m < width; m++)
        store_lanes(state + m, width, n,
                    conv_input(rows, x_stride, state, width, is_fresh, len + m - width, n));
}

/* The request owning row t: the last r with query_start[r] <= t (past empty requests). */
static inline int64_t request_of(const int64_t *query_start, int64_t num_requests, int64_t t) {
    int64_t lo = 0, hi = num_requests;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (query_start[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Gated DeltaNet's causal depthwise convolution (kernels/gated_delta_net.py's causal_conv1d,
   the reference) over a flat batch, its requests' conv states read and updated in place:
   request r owns rows [query_start[r], query_start[r + 1]) of x [num_tokens, channels] (at
   x + t * x_stride) and out [num_tokens, channels] (contiguous), and slot slots[r] of
   conv_state [num_slots, channels, width], its last width = taps - 1 inputs oldest first
   (zeros, not read, where fresh[r] is 1). With weight [channels, taps],
   out[t, c] = SiLU(bias[c] + sum_j weight[c, j] * in[t - width + j, c]), `in` the request's
   inputs, those before its rows from its state; bias NULL for none. The state then holds its
   last `width` inputs. Rows go one at a time across all channels (a block of rows per
   channel block would step a page per row through x and out), the weight transposed first
   so that a tap's weights lie along the channels, the states' updates after every row has
   read them. Slots must be distinct. Returns 0; -1 when the transposed weight could not be
   allocated; -2 (nothing read or written) when the rows or slots lie outside num_tokens or
   num_slots. */
int weir_causal_conv1d(const float *x, int64_t x_stride, const float *weight,
                       const float *bias, float *conv_state, int64_t num_slots,
                       const int64_t *query_start, const int64_t *slots, const int64_t *fresh,
                       int64_t num_requests, int64_t num_tokens, int64_t channels, int64_t taps,
                       float *out) {
    for (int64_t r = 0; r < num_requests; r++)
        if (query_start[r] < 0 || query_start[r + 1] < query_start[r] ||
            query_start[r + 1] > num_tokens || slots[r] < 0 || slots[r] >= num_slots)
            return -2;
    const int64_t width = taps - 1, whole = channels - channels % VL;
    float *weight_t = malloc(sizeof(float) * taps * channels);
    if (!weight_t) return -1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < channels; c++)
            for (int64_t j = 0; j < taps; j++) weight_t[j * channels + c] = weight[c * taps + j];
#pragma omp for schedule(static)
        for (int64_t t = query_start[0]; t < query_start[num_requests]; t++) {
            const int64_t r = request_of(query_start, num_requests, t), i = t - query_start[r];
            const float *rows = x + query_start[r] * x_stride;
            const float *state = conv_state + slots[r] * channels * width;
            const int is_fresh = fresh[r] != 0;
            for (int64_t c = 0; c < whole; c += VL)
                conv_row(rows + c, x_stride, i, state + c * width, width, is_fresh,
                         weight_t + c, channels, bias ? bias + c : NULL, out + t * channels + c,
                         VL);
            if (whole < channels)
                conv_row(rows + whole, x_stride, i, state + whole * width, width, is_fresh,
                         weight_t + whole, channels, bias ? bias + whole : NULL,
                         out + t * channels + whole, channels - whole);
        }
        /* Whole blocks inlined apart (n = VL), as in the rows' loop. */
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < num_requests; r++)
            for (int64_t c = 0; c < channels; c += VL) {
                const int64_t len = query_start[r + 1] - query_start[r];
                const float *rows = x + query_start[r] * x_stride + c;
                float *state = conv_state + (slots[r] * channels + c) * width;
                if (c < whole)
                    conv_shift(rows, x_stride, len, state, width, fresh[r] != 0, VL);
                else
                    conv_shift(rows, x_stride, len, state, width, fresh[r] != 0, channels - c);
            }
    }
    free(weight_t);
    return 0;
}

/* 8-bit table codecs on the CPU: one loop over memory per direction, any size.
 *
 * The same arithmetic as scaleout/compress/kernels.py (`_encode_blocks`, `_decode_blocks`),
 * bit for bit: encode divides by the block's scale (never multiplies by a reciprocal),
 * clamps the float32 bit pattern of |a| into the lookup's bins and picks the code below or
 * above the bin's one threshold; decode multiplies the 256 table values by the block's
 * scale once per block, rounds them to the output type once, then gathers.
 *
 * Built by scaleout/compress/native.py with the machine's C compiler (-O3 -march=native,
 * never -ffast-math: the division must stay IEEE) and called through ctypes.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define ABS_MASK 0x7FFFFFFFu
#define EXP_ALL_ONES 0x7F800000u

typedef struct {
    const int32_t *entries; /* positive bins, then negative bins */
    int32_t shift, first_bin, num_bins, top_bits;
} lookup_t;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> bfloat16, round to nearest even (torch's rounding; NaN stays a quiet NaN) */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    if ((u & ABS_MASK) > EXP_ALL_ONES) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* largest |x| bit pattern of a block (>= EXP_ALL_ONES: the block holds Inf or NaN) */
#define ABSMAX_BITS(NAME, T, LOAD)                                                  \
    static uint32_t NAME(const T *x, int64_t n) {                                   \
        uint32_t m = 0;                                                             \
        for (int64_t i = 0; i < n; i++) {                                           \
            uint32_t b = f2u(LOAD(x, i)) & ABS_MASK;                                \
            m = b > m ? b : m;                                                      \
        }                                                                           \
        return m;                                                                   \
    }

#define LOAD_F32(x, i) ((x)[i])
#define LOAD_BF16(x, i) u2f((uint32_t)(x)[i] << 16)

ABSMAX_BITS(absmax_f32, float, LOAD_F32)
ABSMAX_BITS(absmax_bf16, uint16_t, LOAD_BF16)

/* codes of one block with scale `scale`; returns the largest |x| bit pattern seen */
#define ENCODE_BLOCK(NAME, T, LOAD)                                                 \
    static uint32_t NAME(const T *restrict x, int64_t n, float scale,               \
                         uint8_t *restrict codes, const lookup_t *lk) {             \
        const float safe = scale > 0.0f ? scale : 1.0f;                             \
        const int32_t shift = lk->shift, first_bin = lk->first_bin;                 \
        const int32_t stored = lk->num_bins - first_bin;                            \
        const int32_t lo = first_bin << shift, hi = lk->top_bits;                   \
        const int32_t low = (1 << shift) - 1;                                       \
        const int32_t *restrict entries = lk->entries;                              \
        int32_t seen = 0;                                                           \
        for (int64_t i = 0; i < n; i++) {                                           \
            float xf = LOAD(x, i);                                                  \
            int32_t xb = (int32_t)(f2u(xf) & ABS_MASK);                             \
            seen = xb > seen ? xb : seen;                                           \
            int32_t bits = (int32_t)f2u(xf / safe);                                 \
            int32_t mag = bits & (int32_t)ABS_MASK;                                 \
            mag = mag < lo ? lo : (mag > hi ? hi : mag);                            \
            int32_t key = (mag >> shift) - first_bin + ((bits >> 31) & stored);     \
            int32_t e = entries[key];                                               \
            int32_t code = (mag & low) > (e & low) ? e >> (shift + 8) : e >> shift; \
            codes[i] = (uint8_t)code;                                               \
        }                                                                           \
        return (uint32_t)seen;                                                      \
    }

ENCODE_BLOCK(encode_block_f32, float, LOAD_F32)
ENCODE_BLOCK(encode_block_bf16, uint16_t, LOAD_BF16)

/* x (n,) -> codes (n,), scales (num_blocks,): fresh absmax scales when `given` is NULL,
 * else the given ones. block = 0: one block. Returns 1 when some input is Inf or NaN (the
 * caller then takes the reference path, which counts and flags them), else 0. */
#define ENCODE(NAME, T, ABSMAX, BLOCK)                                              \
    int NAME(const T *x, int64_t n, int64_t block, const float *given,              \
             float *scales, uint8_t *codes, const int32_t *entries, int32_t shift,  \
             int32_t first_bin, int32_t num_bins, int32_t top_bits) {               \
        lookup_t lk = {entries, shift, first_bin, num_bins, top_bits};              \
        if (block <= 0 || block > n) block = n;                                     \
        int64_t num_blocks = (n + block - 1) / block;                               \
        for (int64_t b = 0; b < num_blocks; b++) {                                  \
            int64_t start = b * block, len = n - start < block ? n - start : block; \
            float scale;                                                            \
            if (given) {                                                            \
                scale = given[b];                                                   \
            } else {                                                                \
                uint32_t m = ABSMAX(x + start, len);                                \
                if (m >= EXP_ALL_ONES) return 1;                                    \
                scale = u2f(m);                                                     \
            }                                                                       \
            scales[b] = scale;                                                      \
            if (BLOCK(x + start, len, scale, codes + start, &lk) >= EXP_ALL_ONES)   \
                return 1;                                                           \
        }                                                                           \
        return 0;                                                                   \
    }

ENCODE(so_encode_f32, float, absmax_f32, encode_block_f32)
ENCODE(so_encode_bf16, uint16_t, absmax_bf16, encode_block_bf16)

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* Byte `plane` of a 256-entry table of `stride`-byte values as four registers, and its
 * lookup of 64 codes at once: two two-register byte permutes (code bits 0..6) and a blend
 * on bit 7. A gather fetches 16 values per instruction; this fetches 64 bytes per three. */
static void load_plane(const uint8_t *bytes, int stride, int plane, __m512i r[4]) {
    uint8_t column[256];
    for (int k = 0; k < 256; k++) column[k] = bytes[k * stride + plane];
    for (int q = 0; q < 4; q++) r[q] = _mm512_loadu_si512(column + 64 * q);
}

static inline __m512i lookup_plane(const __m512i r[4], __m512i idx, __mmask64 top) {
    return _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(r[0], idx, r[1]),
                                  _mm512_permutex2var_epi8(r[2], idx, r[3]));
}

/* float32 out: four byte planes, interleaved into 32-bit values. After the byte and word
 * unpacks, register j's 128-bit lane k holds values 16k+4j .. 16k+4j+3; a 4x4 transpose of
 * lanes puts them in order. Returns how many values were written (a multiple of 64). */
static int64_t decode_f32_vbmi(const uint8_t *c, int64_t n, const float *table, float *o) {
    __m512i p0[4], p1[4], p2[4], p3[4];
    load_plane((const uint8_t *)table, 4, 0, p0);
    load_plane((const uint8_t *)table, 4, 1, p1);
    load_plane((const uint8_t *)table, 4, 2, p2);
    load_plane((const uint8_t *)table, 4, 3, p3);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i idx = _mm512_loadu_si512(c + i);
        __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i b0 = lookup_plane(p0, idx, top), b1 = lookup_plane(p1, idx, top);
        __m512i b2 = lookup_plane(p2, idx, top), b3 = lookup_plane(p3, idx, top);
        __m512i w01a = _mm512_unpacklo_epi8(b0, b1), w01b = _mm512_unpackhi_epi8(b0, b1);
        __m512i w23a = _mm512_unpacklo_epi8(b2, b3), w23b = _mm512_unpackhi_epi8(b2, b3);
        __m512i r0 = _mm512_unpacklo_epi16(w01a, w23a), r1 = _mm512_unpackhi_epi16(w01a, w23a);
        __m512i r2 = _mm512_unpacklo_epi16(w01b, w23b), r3 = _mm512_unpackhi_epi16(w01b, w23b);
        __m512i t0 = _mm512_shuffle_i32x4(r0, r1, 0x44); /* r0.0 r0.1 r1.0 r1.1 */
        __m512i t1 = _mm512_shuffle_i32x4(r2, r3, 0x44); /* r2.0 r2.1 r3.0 r3.1 */
        __m512i t2 = _mm512_shuffle_i32x4(r0, r1, 0xEE); /* r0.2 r0.3 r1.2 r1.3 */
        __m512i t3 = _mm512_shuffle_i32x4(r2, r3, 0xEE); /* r2.2 r2.3 r3.2 r3.3 */
        _mm512_storeu_si512(o + i, _mm512_shuffle_i32x4(t0, t1, 0x88));      /* lane 0s */
        _mm512_storeu_si512(o + i + 16, _mm512_shuffle_i32x4(t0, t1, 0xDD)); /* lane 1s */
        _mm512_storeu_si512(o + i + 32, _mm512_shuffle_i32x4(t2, t3, 0x88)); /* lane 2s */
        _mm512_storeu_si512(o + i + 48, _mm512_shuffle_i32x4(t2, t3, 0xDD)); /* lane 3s */
    }
    return i;
}

/* bfloat16 out: two byte planes interleaved into 16-bit values */
static int64_t decode_bf16_vbmi(const uint8_t *c, int64_t n, const uint16_t *table,
                                uint16_t *o) {
    __m512i lo[4], hi[4];
    load_plane((const uint8_t *)table, 2, 0, lo);
    load_plane((const uint8_t *)table, 2, 1, hi);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i idx = _mm512_loadu_si512(c + i);
        __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i l = lookup_plane(lo, idx, top), h = lookup_plane(hi, idx, top);
        __m512i a = _mm512_unpacklo_epi8(l, h); /* lane k: values 16k .. 16k+7 */
        __m512i b = _mm512_unpackhi_epi8(l, h); /* lane k: values 16k+8 .. 16k+15 */
        _mm512_storeu_si512(o + i, _mm512_permutex2var_epi64(a, first, b));
        _mm512_storeu_si512(o + i + 32, _mm512_permutex2var_epi64(a, second, b));
    }
    return i;
}
#define VBMI_PART(fn, ...) fn(__VA_ARGS__) /* the values it decoded */
#else
#define VBMI_PART(fn, ...) 0 /* none: the plain loop decodes every value */
#endif

/* codes (n,), scales (num_blocks,), values (256,) -> out (n,): values[code] * scale,
 * rounded once to the output type (per block, into a table of 256), then looked up.
 * block = 0: one block. */
#define DECODE(NAME, T, ROUND, VBMI)                                                \
    void NAME(const uint8_t *codes, int64_t n, int64_t block, const float *scales, \
              const float *values, T *out) {                                        \
        T table[256];                                                               \
        if (block <= 0 || block > n) block = n;                                     \
        int64_t num_blocks = (n + block - 1) / block;                               \
        for (int64_t b = 0; b < num_blocks; b++) {                                  \
            int64_t start = b * block, len = n - start < block ? n - start : block; \
            for (int k = 0; k < 256; k++) table[k] = ROUND(values[k] * scales[b]);  \
            const uint8_t *c = codes + start;                                       \
            T *o = out + start;                                                     \
            int64_t i = VBMI_PART(VBMI, c, len, table, o);                         \
            for (; i < len; i++) o[i] = table[c[i]];                                \
        }                                                                           \
    }

#define AS_F32(v) (v)

DECODE(so_decode_f32, float, AS_F32, decode_f32_vbmi)
DECODE(so_decode_bf16, uint16_t, f2bf, decode_bf16_vbmi)

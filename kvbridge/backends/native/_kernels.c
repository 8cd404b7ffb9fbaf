/* kvbridge.backends.native._kernels: compiled MODEL1 hot kernels (optional; kvbridge.backends.native falls back to numba).
 *
 * Four kernels, byte-identical to the numba accelerators of kvbridge/backends/native/__init__.py, with the same
 * chunking (CHUNK_TOKENS destination tokens of whole pages per chunk, or source tokens for the
 * decoder) and the same arguments, so that native.pool._run_chunks runs them on its thread pool
 * (every kernel releases the GIL):
 *
 *   fp8_to_model1   per-tensor E4M3 records (512 B) -> MODEL1 records (584 B), code domain:
 *                   a tile's value bytes are code_lut[m * 256 + c] (m: its largest code magnitude),
 *                   its UE8M0 byte scale_lut[m], the rope's bf16 words rope_lut[c];
 *   model1_to_fp8   MODEL1 -> per-tensor E4M3: nope_lut[b * 256 + c] (b: the tile's scale byte),
 *                   rope bytes rope_lut[h] of each bf16 word h (AVX-512: computed from h and the multiplier);
 *   model1_encode   fp32 / bf16 latents [N, 512] -> MODEL1 records (E4M3 RNE in integer steps: bf16 tiles in
 *                   16-bit lanes, 32 values a vector, fp32 and tiles reaching E4M3 subnormals in 32-bit ones);
 *   model1_decode   MODEL1 records -> fp32 latents [N, 512];
 *
 * fp8_to_model1_segments and model1_to_fp8_segments run the same token kernels between record rows anywhere (a
 * migration's source pages or records straight into its destination pages: segments of rows, no page geometry);
 * and the code-domain amax of a MODEL1 or per-tensor E4M3 pool (model1_amax, fp8_amax: dst_scale="auto",
 * as native.records._amax_kernel, chunks of CHUNK_TOKENS source tokens), the span copies of native.move_spans
 * (move_runs: memcpy on any CPU, non-temporal stores on AVX-512), and the fp4 -> fp8 indexer keys of
 * native.keys (fp4_to_fp8_keys: byte-identical to its numba kernel, segments per chunk; portable C on any CPU,
 * vpshufb 16-entry table lookups on AVX2, chosen by key_isa / set_key_isa apart from the MODEL1 kernels' ISA).
 *
 * The tables are built in Python (kvbridge.numerics) and passed in. MODEL1 record: bytes [0, 448)
 * 7 E4M3 tiles of 64, [448, 576) 64 bf16 rope values, [576, 583) the tiles' UE8M0 scale bytes,
 * byte 583 zero. A record's bytes below the layout's split point sit at page * page_bytes +
 * row * split, the others at page * page_bytes + P * split + row * (record_bytes - split).
 *
 * Each kernel has a portable scalar version and an AVX-512 (F, BW, VL, VBMI) version, compiled
 * for that ISA by function attributes only (the file itself is built for the baseline ISA) and
 * chosen at run time with __builtin_cpu_supports. VBMI's vpermi2b does the 256-entry byte table
 * lookups (two 128-entry lookups and a select on the code's sign bit). Outputs of at least
 * nt_min_bytes (set_nt_min) are written with non-temporal stores where a 64-byte row is aligned.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>
/* XXH3-64 of the page-chunk checksums (xxh3_chunks): xxHash 0.8.4's single header, vendored unchanged beside this
 * file (BSD 2-Clause, xxhash-LICENSE). XXH3's output is fixed since xxHash 0.8.0, which the `xxhash` package (>= 3.0) bundles,
 * so both give the same hashes (tests/test_migration_checksum.py compares them). */
#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
#else
#define KV_X86 0
#endif

#define CHUNK_TOKENS 256
/* The entry points' interface: bumped whenever a function is added or its arguments change, so that
 * kvbridge.backends.native.accel refuses a stale build (accel.KERNELS_INTERFACE). */
#define KV_INTERFACE 6
#define HEAD_DIM 512
#define M1_DATA 576
#define M1_RECORD 584
#define FP8_RECORD 512

enum { ISA_SCALAR = 0, ISA_AVX512 = 1 };
static int kv_isa = ISA_SCALAR;     /* in use */
static int kv_cpu_isa = ISA_SCALAR; /* best the CPU supports */
static Py_ssize_t nt_min_bytes = (Py_ssize_t)64 << 20;

typedef struct {
    Py_ssize_t pages, page_bytes, split, record_bytes;
} geom_t;

/* Byte offsets of a token's data part (record bytes < split) and footer part. */
static inline void locate(const geom_t *g, Py_ssize_t per_page, Py_ssize_t t, Py_ssize_t *data, Py_ssize_t *foot) {
    Py_ssize_t page = t / per_page, row = t - page * per_page;
    *data = page * g->page_bytes + row * g->split;
    *foot = page * g->page_bytes + per_page * g->split + row * (g->record_bytes - g->split);
}

static inline void note_bad(Py_ssize_t index, int64_t *count, int64_t *first) {
    if (*count == 0 || index < *first)
        *first = index;
    *count += 1;
}

/* Zero the destination rows of tokens >= n on page p and the page's tail. */
static void zero_unused(uint8_t *dst, const geom_t *d, Py_ssize_t dp, Py_ssize_t p, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < dp; r++) {
        Py_ssize_t t = p * dp + r, at, ft;
        if (t < n)
            continue;
        locate(d, dp, t, &at, &ft);
        memset(dst + at, 0, (size_t)d->split);
        memset(dst + ft, 0, (size_t)(d->record_bytes - d->split));
    }
    memset(dst + p * d->page_bytes + dp * d->record_bytes, 0, (size_t)(d->page_bytes - dp * d->record_bytes));
}

/* Source record of token t: in place when token-major, else gathered into buf. */
static inline const uint8_t *src_record(const uint8_t *src, const geom_t *s, Py_ssize_t t, uint8_t *buf) {
    Py_ssize_t at, ft;
    locate(s, s->pages, t, &at, &ft);
    if (s->split == s->record_bytes)
        return src + at;
    memcpy(buf, src + at, (size_t)s->split);
    memcpy(buf + s->split, src + ft, (size_t)(s->record_bytes - s->split));
    return buf;
}

/* Where a MODEL1 record's data bytes [0, 576) and footer [576, 584) go: straight into the pages when
 * the split is 576 or the record token-major, else into buf (then scattered by m1_scatter). */
static inline int m1_place(uint8_t *base, const geom_t *g, Py_ssize_t dp, Py_ssize_t t, uint8_t *buf,
                           uint8_t **data, uint8_t **foot) {
    Py_ssize_t at, ft;
    locate(g, dp, t, &at, &ft);
    if (g->split == M1_DATA) {
        *data = base + at, *foot = base + ft;
        return 1;
    }
    if (g->split == g->record_bytes) {
        *data = base + at, *foot = base + at + M1_DATA;
        return 1;
    }
    *data = buf, *foot = buf + M1_DATA;
    return 0;
}

static inline void m1_scatter(uint8_t *base, const geom_t *g, Py_ssize_t dp, Py_ssize_t t, const uint8_t *buf) {
    Py_ssize_t at, ft;
    locate(g, dp, t, &at, &ft);
    memcpy(base + at, buf, (size_t)g->split);
    memcpy(base + ft, buf + g->split, (size_t)(g->record_bytes - g->split));
}

/* MODEL1 source record of token t: data and footer pointers (in place when possible). */
static inline void m1_read(const uint8_t *src, const geom_t *s, Py_ssize_t t, uint8_t *buf,
                           const uint8_t **data, const uint8_t **foot) {
    Py_ssize_t at, ft;
    locate(s, s->pages, t, &at, &ft);
    if (s->split == M1_DATA) {
        *data = src + at, *foot = src + ft;
    } else if (s->split == s->record_bytes) {
        *data = src + at, *foot = src + at + M1_DATA;
    } else {
        memcpy(buf, src + at, (size_t)s->split);
        memcpy(buf + s->split, src + ft, (size_t)(s->record_bytes - s->split));
        *data = buf, *foot = buf + M1_DATA;
    }
}

typedef struct {
    const uint8_t *scale_lut, *bad_mag, *code_lut;
    const uint16_t *rope_lut;
} f2m_tables;

typedef struct {
    const uint8_t *nope_lut, *bad_mag, *rope_lut;
    float mult; /* the per-tensor multiplier the tables were built for (the AVX-512 code computes the rope's codes) */
} m2f_tables;

/* E4M3 code of an fp32 (RNE, saturating to +-448, NaN too), as native.accel._e4m3_byte: normal magnitudes
 * drop 20 mantissa bits with ties to even and rebias, subnormal ones are the low bits of |y| + 2^14. */
static inline uint8_t e4m3_byte(float y) {
    uint32_t b, sb;
    memcpy(&b, &y, 4);
    uint32_t mag = b & 0x7FFFFFFFu;
    uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - 960u;
    float fa;
    memcpy(&fa, &mag, 4);
    fa = fa + 16384.0f;
    memcpy(&sb, &fa, 4);
    uint32_t code = mag >= 0x3C800000u ? normal : sb - 0x46800000u;
    code = mag >= 0x43E00000u ? 0x7Eu : code;
    return (uint8_t)(code | ((b >> 24) & 0x80u));
}

/* UE8M0 exponent of a tile whose largest |value| has fp32 bits amax_bits (native.accel._tile_exponent). */
static inline int tile_exponent(uint32_t amax_bits, int min_exp) {
    int exp = (int)(amax_bits >> 23);
    if (exp == 0)
        return min_exp;
    int e = exp - 135 + ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
    return e > min_exp ? e : min_exp;
}

static inline float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* ------------------------------------------------------------------------------------------- */
/* Scalar kernels                                                                               */
/* ------------------------------------------------------------------------------------------- */

static void f2m_token_scalar(const uint8_t *in, uint8_t *data, uint8_t *foot, const f2m_tables *tb, Py_ssize_t t,
                             int64_t *count, int64_t *first) {
    for (int j = 0; j < 8; j++) {
        const uint8_t *tile = in + 64 * j;
        uint8_t m = 0;
        for (int i = 0; i < 64; i++) {
            uint8_t a = tile[i] & 0x7F;
            m = a > m ? a : m;
        }
        if (tb->bad_mag[m])
            for (int i = 0; i < 64; i++)
                if (tb->bad_mag[tile[i] & 0x7F])
                    note_bad(t * HEAD_DIM + 64 * j + i, count, first);
        if (j == 7)
            break;
        const uint8_t *row = tb->code_lut + (size_t)m * 256;
        for (int i = 0; i < 64; i++)
            data[64 * j + i] = row[tile[i]];
        foot[j] = tb->scale_lut[m];
    }
    for (int i = 0; i < 64; i++) {
        uint16_t h = tb->rope_lut[in[448 + i]];
        data[448 + 2 * i] = (uint8_t)h;
        data[448 + 2 * i + 1] = (uint8_t)(h >> 8);
    }
    foot[7] = 0;
}

static void m2f_token_scalar(const uint8_t *data, const uint8_t *foot, uint8_t *out, const m2f_tables *tb,
                             Py_ssize_t t, int64_t *count, int64_t *first) {
    for (int j = 0; j < 7; j++) {
        const uint8_t *tile = data + 64 * j;
        size_t b = foot[j];
        const uint8_t *bad = tb->bad_mag + b * 128, *lut = tb->nope_lut + b * 256;
        uint8_t m = 0;
        for (int i = 0; i < 64; i++) {
            uint8_t a = tile[i] & 0x7F;
            m = a > m ? a : m;
        }
        if (bad[m])
            for (int i = 0; i < 64; i++)
                if (bad[tile[i] & 0x7F])
                    note_bad(t * HEAD_DIM + 64 * j + i, count, first);
        for (int i = 0; i < 64; i++)
            out[64 * j + i] = lut[tile[i]];
    }
    for (int i = 0; i < 64; i++) {
        uint16_t h = (uint16_t)(data[448 + 2 * i] | (data[448 + 2 * i + 1] << 8));
        if ((h & 0x7F80) == 0x7F80)
            note_bad(t * HEAD_DIM + 448 + i, count, first);
        out[448 + i] = tb->rope_lut[h];
    }
}

static void encode_token_scalar(const float *x32, const uint16_t *x16, uint8_t *data, uint8_t *foot, int min_exp,
                                const float *pow2) {
    for (int j = 0; j < 7; j++) {
        uint32_t amax = 0;
        if (x16) {
            for (int i = 0; i < 64; i++) {
                uint32_t a = (uint32_t)(x16[64 * j + i] & 0x7FFF) << 16;
                amax = a > amax ? a : amax;
            }
        } else {
            for (int i = 0; i < 64; i++) {
                uint32_t b;
                memcpy(&b, x32 + 64 * j + i, 4);
                b &= 0x7FFFFFFFu;
                amax = b > amax ? b : amax;
            }
        }
        int e = tile_exponent(amax, min_exp);
        float mult = pow2[149 - e];
        for (int i = 0; i < 64; i++) {
            float v = x16 ? bits_f32((uint32_t)x16[64 * j + i] << 16) : x32[64 * j + i];
            data[64 * j + i] = e4m3_byte(v * mult);
        }
        foot[j] = (uint8_t)(e + 127);
    }
    for (int i = 0; i < 64; i++) {
        uint32_t h;
        if (x16) {
            h = x16[448 + i];
            if ((h & 0x7FFF) > 0x7F80)
                h |= 0x40;
        } else {
            uint32_t b;
            memcpy(&b, x32 + 448 + i, 4);
            h = (b & 0x7FFFFFFFu) > 0x7F800000u ? ((b >> 16) | 0x40u) : ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
        }
        data[448 + 2 * i] = (uint8_t)h;
        data[448 + 2 * i + 1] = (uint8_t)(h >> 8);
    }
    foot[7] = 0;
}

/* fp32 value of E4M3 code c, as native.accel._e4m3_value (NaN codes: 0x7FC00000), branch-free. */
static inline float e4m3_value(uint32_t c) {
    uint32_t a = c & 0x7F, sub;
    float sub_value = (float)(int32_t)a * 0.001953125f;
    memcpy(&sub, &sub_value, 4);
    uint32_t bits = (a >= 8 ? (a << 20) + 0x3C000000u : sub) ^ ((c & 0x80u) << 24);
    return bits_f32(a == 0x7F ? 0x7FC00000u : bits);
}

static void decode_token_scalar(const uint8_t *data, const uint8_t *foot, float *out, const float *ue8m0) {
    for (int j = 0; j < 7; j++) {
        float s = ue8m0[foot[j]];
        for (int i = 0; i < 64; i++)
            out[64 * j + i] = e4m3_value(data[64 * j + i]) * s;
    }
    for (int i = 0; i < 64; i++) {
        uint32_t b = (uint32_t)(data[448 + 2 * i] | (data[448 + 2 * i + 1] << 8)) << 16;
        memcpy(out + 448 + i, &b, 4);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* AVX-512 kernels                                                                              */
/* ------------------------------------------------------------------------------------------- */

#if KV_X86
#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512dq")))

/* Largest byte of v. */
KV_AVX512 static inline uint8_t max_u8(__m512i v) {
    __m256i a = _mm256_max_epu8(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i b = _mm_max_epu8(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_max_epu8(b, _mm_srli_si128(b, 8));
    b = _mm_max_epu8(b, _mm_srli_si128(b, 4));
    b = _mm_max_epu8(b, _mm_srli_si128(b, 2));
    b = _mm_max_epu8(b, _mm_srli_si128(b, 1));
    return (uint8_t)_mm_cvtsi128_si32(b);
}

/* Largest 16-bit word of a and b. */
KV_AVX512 static inline uint16_t max_u16(__m512i a, __m512i b) {
    __m512i v = _mm512_max_epu16(a, b);
    __m256i c = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i d = _mm_max_epu16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    d = _mm_max_epu16(d, _mm_srli_si128(d, 8));
    d = _mm_max_epu16(d, _mm_srli_si128(d, 4));
    d = _mm_max_epu16(d, _mm_srli_si128(d, 2));
    return (uint16_t)_mm_cvtsi128_si32(d);
}

/* table[c] for each byte c of idx, table: 4 vectors of 64 bytes (256 entries). */
KV_AVX512 static inline __m512i lookup256(__m512i idx, __m512i t0, __m512i t1, __m512i t2, __m512i t3) {
    __m512i lo = _mm512_permutex2var_epi8(t0, idx, t1);
    __m512i hi = _mm512_permutex2var_epi8(t2, idx, t3);
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
}

KV_AVX512 static inline void store64(void *p, __m512i v, int nt) {
    if (nt)
        _mm512_stream_si512((__m512i *)p, v);
    else
        _mm512_storeu_si512(p, v);
}

KV_AVX512 static inline void store_foot(uint8_t *p, uint64_t v, int nt) {
    if (nt)
        _mm_stream_si64((long long *)p, (long long)v);
    else
        memcpy(p, &v, 8);
}

/* Byte indices that interleave two byte vectors lo, hi (vpermt2b: 0-63 lo, 64-127 hi) into
 * little-endian 16-bit words lo[i] | hi[i] << 8: words 0-31, then words 32-63. */
#define W2(i) (i), (64 + (i))
#define W8(i) W2(i), W2(i + 1), W2(i + 2), W2(i + 3)
static const uint8_t WORDS_LO[64] = {W8(0), W8(4), W8(8), W8(12), W8(16), W8(20), W8(24), W8(28)};
static const uint8_t WORDS_HI[64] = {W8(32), W8(36), W8(40), W8(44), W8(48), W8(52), W8(56), W8(60)};
#undef W8
#undef W2

KV_AVX512 static inline void interleave_words(__m512i lo, __m512i hi, __m512i *w0, __m512i *w1) {
    *w0 = _mm512_permutex2var_epi8(lo, _mm512_loadu_si512(WORDS_LO), hi);
    *w1 = _mm512_permutex2var_epi8(lo, _mm512_loadu_si512(WORDS_HI), hi);
}

/* rope_lut split into its low and high bytes, 4 vectors each. */
typedef struct {
    __m512i lo[4], hi[4];
} rope_vec;

KV_AVX512 static void rope_vectors(const uint16_t *rope_lut, rope_vec *rv) {
    uint8_t lo[256], hi[256];
    for (int i = 0; i < 256; i++)
        lo[i] = (uint8_t)rope_lut[i], hi[i] = (uint8_t)(rope_lut[i] >> 8);
    for (int k = 0; k < 4; k++)
        rv->lo[k] = _mm512_loadu_si512(lo + 64 * k), rv->hi[k] = _mm512_loadu_si512(hi + 64 * k);
}

KV_AVX512 static void f2m_token_avx512(const uint8_t *in, uint8_t *data, uint8_t *foot, const f2m_tables *tb,
                                       const rope_vec *rv, Py_ssize_t t, int nt, int64_t *count, int64_t *first) {
    const __m512i mask7f = _mm512_set1_epi8(0x7F);
    uint64_t footer = 0;
    for (int j = 0; j < 8; j++) {
        __m512i v = _mm512_loadu_si512(in + 64 * j);
        uint8_t m = max_u8(_mm512_and_si512(v, mask7f));
        if (tb->bad_mag[m])
            for (int i = 0; i < 64; i++)
                if (tb->bad_mag[in[64 * j + i] & 0x7F])
                    note_bad(t * HEAD_DIM + 64 * j + i, count, first);
        if (j == 7) {
            __m512i lo = lookup256(v, rv->lo[0], rv->lo[1], rv->lo[2], rv->lo[3]);
            __m512i hi = lookup256(v, rv->hi[0], rv->hi[1], rv->hi[2], rv->hi[3]);
            __m512i w0, w1;
            interleave_words(lo, hi, &w0, &w1);
            store64(data + 448, w0, nt);
            store64(data + 512, w1, nt);
            break;
        }
        const uint8_t *row = tb->code_lut + (size_t)m * 256;
        __m512i out = lookup256(v, _mm512_loadu_si512(row), _mm512_loadu_si512(row + 64),
                                _mm512_loadu_si512(row + 128), _mm512_loadu_si512(row + 192));
        store64(data + 64 * j, out, nt);
        footer |= (uint64_t)tb->scale_lut[m] << (8 * j);
    }
    store_foot(foot, footer, nt && ((uintptr_t)foot & 7) == 0);
}

/* Add the set bits of k (value base + bit index) to (count, first). */
static inline void note_mask(uint64_t k, Py_ssize_t base, int64_t *count, int64_t *first) {
    Py_ssize_t at = base + __builtin_ctzll(k);
    if (*count == 0 || at < *first)
        *first = at;
    *count += __builtin_popcountll(k);
}

/* 16 E4M3 magnitude codes (sign bit clear) of the fp32 lanes of y, as native.accel._e4m3_byte computes them:
 * normal ones from the bits (the rebias folded into the rounding add; unsigned min saturates at 0x7E,
 * Inf and NaN included), subnormal ones the low byte of the bits of |y| + 2^14. */
KV_AVX512 static inline __m128i e4m3_magnitudes(__m512 y) {
    __m512i mag = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
    __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7FFFF - 0x3C000000)),
                                                        odd), 20);
    normal = _mm512_min_epu32(normal, _mm512_set1_epi32(0x7E));
    __m512 sub = _mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(16384.0f));
    __mmask16 is_normal = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x3C800000));
    return _mm512_cvtepi32_epi8(_mm512_mask_blend_epi32(is_normal, _mm512_castps_si512(sub), normal));
}

/* E4M3 codes of the 64 little-endian bf16 words at p times mult: the fp32 product rounded as e4m3_magnitudes
 * does, the sign of the product; rope_lut's codes for every finite word (a NaN word gives 0x7E | sign where the
 * table has 0, and is counted as bad). Cheaper here than gathering rope_lut[h]. */
KV_AVX512 static inline __m512i rope_codes64(const uint8_t *p, __m512 mult) {
    __m512i codes = _mm512_setzero_si512();
    uint64_t signs = 0;
    for (int k = 0; k < 4; k++) {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32 * k)));
        __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), mult);
        codes = _mm512_inserti32x4(codes, e4m3_magnitudes(y), k);
        signs |= (uint64_t)_mm512_movepi32_mask(_mm512_castps_si512(y)) << (16 * k);
    }
    return _mm512_mask_mov_epi8(codes, signs, _mm512_or_si512(codes, _mm512_set1_epi8((char)0x80)));
}

KV_AVX512 static void m2f_token_avx512(const uint8_t *data, const uint8_t *foot, uint8_t *out, const m2f_tables *tb,
                                       const uint8_t *bad_from, Py_ssize_t t, int nt, int64_t *count,
                                       int64_t *first) {
    const __m512i mask7f = _mm512_set1_epi8(0x7F);
    for (int j = 0; j < 7; j++) {
        size_t b = foot[j];
        __m512i v = _mm512_loadu_si512(data + 64 * j);
        __m512i mag = _mm512_and_si512(v, mask7f);
        if (bad_from) { /* every magnitude >= bad_from[b] is bad at scale byte b */
            __mmask64 k = _mm512_cmpge_epu8_mask(mag, _mm512_set1_epi8((char)bad_from[b]));
            if (k)
                note_mask(k, t * HEAD_DIM + 64 * j, count, first);
        } else {
            const uint8_t *bad = tb->bad_mag + b * 128;
            if (bad[max_u8(mag)])
                for (int i = 0; i < 64; i++)
                    if (bad[data[64 * j + i] & 0x7F])
                        note_bad(t * HEAD_DIM + 64 * j + i, count, first);
        }
        const uint8_t *row = tb->nope_lut + b * 256;
        __m512i o = lookup256(v, _mm512_loadu_si512(row), _mm512_loadu_si512(row + 64),
                              _mm512_loadu_si512(row + 128), _mm512_loadu_si512(row + 192));
        store64(out + 64 * j, o, nt);
    }
    const __m512i expm = _mm512_set1_epi16(0x7F80);
    __m512i h0 = _mm512_loadu_si512(data + 448), h1 = _mm512_loadu_si512(data + 512);
    __mmask32 n0 = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h0, expm), expm);
    __mmask32 n1 = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h1, expm), expm);
    if (n0 | n1)
        note_mask((uint64_t)n0 | ((uint64_t)n1 << 32), t * HEAD_DIM + 448, count, first);
    store64(out + 448, rope_codes64(data + 448, _mm512_set1_ps(tb->mult)), nt);
}

/* Index of byte 2i (the low byte of 16-bit word i) of two concatenated vectors: words 0-31 of a, then of b. */
#define B2(i) (2 * (i)), (2 * (i) + 2)
#define B8(i) B2(i), B2(i + 2), B2(i + 4), B2(i + 6)
static const uint8_t LOW_BYTES[64] = {B8(0), B8(8), B8(16), B8(24), B8(32), B8(40), B8(48), B8(56)};
#undef B8
#undef B2

/* E4M3 codes of the 64 bf16 values x (two vectors of 32 words) times 2^-e, in 16-bit lanes: y = x * 2^-e is
 * again a bf16 value (its bits: |x|'s minus e << 7) as long as x is normal and y stays normal, and y <= 448 in
 * a finite tile, so a normal E4M3 code is ((y + 7 + odd) >> 4) - (120 << 3) (RNE, as e4m3_magnitudes on the
 * fp32 bits, whose low 16 bits are zero) and y < 2^-10 gives 0. The caller guarantees e >= -116 and a finite
 * tile, so that zeros and bf16 subnormals land below 2^-10 (true: their y is below it too). Returns 0, leaving
 * *codes unset, when a lane falls in E4M3's subnormal range [2^-10, 2^-6) (then the fp32 path runs). */
KV_AVX512 static inline int e4m3_codes_bf16(__m512i x0, __m512i x1, int e, __m512i *codes) {
    const __m512i m7fff = _mm512_set1_epi16(0x7FFF), shift = _mm512_set1_epi16((short)(e * 128));
    const __m512i small = _mm512_set1_epi16(0x3A80), normal_min = _mm512_set1_epi16(0x3C80);
    const __m512i one = _mm512_set1_epi16(1), bias = _mm512_set1_epi16((short)(7 - 0x3C00));
    __m512i y0 = _mm512_sub_epi16(_mm512_and_si512(x0, m7fff), shift);
    __m512i y1 = _mm512_sub_epi16(_mm512_and_si512(x1, m7fff), shift);
    __mmask32 n0 = _mm512_cmpge_epi16_mask(y0, normal_min), n1 = _mm512_cmpge_epi16_mask(y1, normal_min);
    __mmask32 z0 = _mm512_cmplt_epi16_mask(y0, small), z1 = _mm512_cmplt_epi16_mask(y1, small);
    if ((n0 | z0) != 0xFFFFFFFFu || (n1 | z1) != 0xFFFFFFFFu)
        return 0;
    __m512i c0 = _mm512_add_epi16(_mm512_add_epi16(y0, bias), _mm512_and_si512(_mm512_srli_epi16(y0, 4), one));
    __m512i c1 = _mm512_add_epi16(_mm512_add_epi16(y1, bias), _mm512_and_si512(_mm512_srli_epi16(y1, 4), one));
    c0 = _mm512_maskz_srli_epi16(n0, c0, 4);
    c1 = _mm512_maskz_srli_epi16(n1, c1, 4);
    __m512i c = _mm512_permutex2var_epi8(c0, _mm512_loadu_si512(LOW_BYTES), c1);
    __mmask64 signs = (__mmask64)_mm512_movepi16_mask(x0) | ((__mmask64)_mm512_movepi16_mask(x1) << 32);
    *codes = _mm512_mask_mov_epi8(c, signs, _mm512_or_si512(c, _mm512_set1_epi8((char)0x80)));
    return 1;
}

KV_AVX512 static inline __attribute__((always_inline)) void encode_token_body(
    const float *x32, const uint16_t *x16, uint8_t *data, uint8_t *foot, int min_exp, const float *pow2, int nt) {
    /* Two passes, so that the tiles' amax reductions and exponents overlap rather than each stalling its tile:
     * the 7 scale exponents first, then the codes. */
    uint64_t footer = 0;
    float mults[7];
    int exps[7], fast16 = 0; /* fast16 bit j: tile j of bf16 input may take e4m3_codes_bf16 */
    for (int j = 0; j < 7; j++) {
        uint32_t amax;
        if (x16) {
            const __m512i m = _mm512_set1_epi16(0x7FFF);
            amax = (uint32_t)max_u16(_mm512_and_si512(_mm512_loadu_si512(x16 + 64 * j), m),
                                     _mm512_and_si512(_mm512_loadu_si512(x16 + 64 * j + 32), m)) << 16;
        } else {
            const __m512i m = _mm512_set1_epi32(0x7FFFFFFF);
            __m512i acc = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++)
                acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(x32 + 64 * j + 16 * k), m));
            amax = _mm512_reduce_max_epu32(acc);
        }
        int e = tile_exponent(amax, min_exp);
        mults[j] = pow2[149 - e];
        exps[j] = e;
        fast16 |= (x16 && amax < 0x7F800000u && e >= -116) << j;
        footer |= (uint64_t)(uint8_t)(e + 127) << (8 * j);
    }
    for (int j = 0; j < 7; j++) {
        __m512 v[4];
        __mmask64 signs;
        if (fast16 >> j & 1) {
            __m512i codes;
            if (e4m3_codes_bf16(_mm512_loadu_si512(x16 + 64 * j), _mm512_loadu_si512(x16 + 64 * j + 32), exps[j],
                                &codes)) {
                store64(data + 64 * j, codes, nt);
                continue;
            }
        }
        if (x16) {
            signs = (__mmask64)_mm512_movepi16_mask(_mm512_loadu_si512(x16 + 64 * j)) |
                    ((__mmask64)_mm512_movepi16_mask(_mm512_loadu_si512(x16 + 64 * j + 32)) << 32);
            for (int k = 0; k < 4; k++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(x16 + 64 * j + 16 * k));
                v[k] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
            }
        } else {
            signs = 0;
            for (int k = 0; k < 4; k++) {
                v[k] = _mm512_loadu_ps(x32 + 64 * j + 16 * k);
                signs |= (__mmask64)_mm512_movepi32_mask(_mm512_castps_si512(v[k])) << (16 * k);
            }
        }
        __m512 mult = _mm512_set1_ps(mults[j]);
        __m512i codes = _mm512_castsi128_si512(e4m3_magnitudes(_mm512_mul_ps(v[0], mult)));
        codes = _mm512_inserti32x4(codes, e4m3_magnitudes(_mm512_mul_ps(v[1], mult)), 1);
        codes = _mm512_inserti32x4(codes, e4m3_magnitudes(_mm512_mul_ps(v[2], mult)), 2);
        codes = _mm512_inserti32x4(codes, e4m3_magnitudes(_mm512_mul_ps(v[3], mult)), 3);
        /* y = x * 2^-e keeps the sign of x (NaN included) */
        codes = _mm512_mask_mov_epi8(codes, signs, _mm512_or_si512(codes, _mm512_set1_epi8((char)0x80)));
        store64(data + 64 * j, codes, nt);
    }
    __m512i w[2];
    if (x16) {
        const __m512i m = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80), q = _mm512_set1_epi16(0x40);
        for (int k = 0; k < 2; k++) {
            __m512i h = _mm512_loadu_si512(x16 + 448 + 32 * k);
            __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(h, m), inf);
            w[k] = _mm512_mask_blend_epi16(nan, h, _mm512_or_si512(h, q));
        }
    } else {
        const __m512i m = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
        __m256i half[4];
        for (int k = 0; k < 4; k++) {
            __m512i b = _mm512_castps_si512(_mm512_loadu_ps(x32 + 448 + 16 * k));
            __m512i hi = _mm512_srli_epi32(b, 16);
            __m512i rounded = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                                 _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
            __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
            __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, m), inf);
            half[k] = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
        }
        w[0] = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
        w[1] = _mm512_inserti64x4(_mm512_castsi256_si512(half[2]), half[3], 1);
    }
    store64(data + 448, w[0], nt);
    store64(data + 512, w[1], nt);
    store_foot(foot, footer, nt && ((uintptr_t)foot & 7) == 0);
}

/* One token: the body compiled separately for bf16 and fp32 input (x16 or x32 NULL), so neither pays for the
 * other's branches. */
KV_AVX512 __attribute__((noinline)) static void encode_token_bf16(const uint16_t *x16, uint8_t *data, uint8_t *foot,
                                                                 int min_exp, const float *pow2, int nt) {
    encode_token_body(NULL, x16, data, foot, min_exp, pow2, nt);
}

KV_AVX512 __attribute__((noinline)) static void encode_token_f32(const float *x32, uint8_t *data, uint8_t *foot,
                                                                int min_exp, const float *pow2, int nt) {
    encode_token_body(x32, NULL, data, foot, min_exp, pow2, nt);
}

KV_AVX512 static inline void encode_token_avx512(const float *x32, const uint16_t *x16, uint8_t *data, uint8_t *foot,
                                                 int min_exp, const float *pow2, int nt) {
    if (x16)
        encode_token_bf16(x16, data, foot, min_exp, pow2, nt);
    else
        encode_token_f32(x32, data, foot, min_exp, pow2, nt);
}

KV_AVX512 static void decode_token_avx512(const uint8_t *data, const uint8_t *foot, float *out, const float *ue8m0,
                                          int nt) {
    const __m512i m7f = _mm512_set1_epi32(0x7F), eight = _mm512_set1_epi32(8);
    const __m512i bias = _mm512_set1_epi32(0x3C000000);
    const __m512 sub_unit = _mm512_set1_ps(0.001953125f), qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
    for (int j = 0; j < 7; j++) {
        __m512 s = _mm512_set1_ps(ue8m0[foot[j]]);
        __m512i tile = _mm512_loadu_si512(data + 64 * j);
        __mmask64 signs = _mm512_movepi8_mask(tile);
        for (int k = 0; k < 4; k++) {
            __m512i a = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(data + 64 * j + 16 * k))),
                                         m7f);
            __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(a, 20), bias));
            __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(a), sub_unit);
            __m512i v = _mm512_castps_si512(_mm512_mask_blend_ps(_mm512_cmpge_epu32_mask(a, eight), sub, normal));
            v = _mm512_mask_xor_epi32(v, (__mmask16)(signs >> (16 * k)), v, sign_bit);
            __m512 value = _mm512_mask_blend_ps(_mm512_cmpeq_epu32_mask(a, m7f), _mm512_castsi512_ps(v), qnan);
            store64(out + 64 * j + 16 * k, _mm512_castps_si512(_mm512_mul_ps(value, s)), nt);
        }
    }
    for (int k = 0; k < 4; k++) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(data + 448 + 32 * k));
        store64(out + 448 + 16 * k, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16), nt);
    }
}
#endif /* KV_X86 */

/* ------------------------------------------------------------------------------------------- */
/* Chunk loops                                                                                  */
/* ------------------------------------------------------------------------------------------- */

static inline int nt_ok(const void *p, Py_ssize_t total) {
    return total >= nt_min_bytes && ((uintptr_t)p & 63) == 0;
}

static inline void store_fence(void) {
#if KV_X86
    __asm__ __volatile__("sfence" ::: "memory");
#endif
}

#define KV_BODY static inline __attribute__((always_inline))
KV_BODY void fp8_to_model1_chunks(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n,
                                 uint8_t *dst, Py_ssize_t dst_len, const geom_t *d, const f2m_tables *tb,
                                 int64_t *bad_count, int64_t *bad_first, int isa) {
    Py_ssize_t dp = d->pages, npages = dst_len / d->page_bytes, per = CHUNK_TOKENS / dp > 1 ? CHUNK_TOKENS / dp : 1;
    uint8_t in_buf[FP8_RECORD], out_buf[M1_RECORD];
#if KV_X86
    rope_vec rv;
    if (isa == ISA_AVX512)
        rope_vectors(tb->rope_lut, &rv);
#endif
    for (Py_ssize_t c = c0; c < c1; c++) {
        int64_t count = 0, first = -1;
        Py_ssize_t p_end = (c + 1) * per < npages ? (c + 1) * per : npages;
        for (Py_ssize_t p = c * per; p < p_end; p++) {
            for (Py_ssize_t r = 0; r < dp && p * dp + r < n; r++) {
                Py_ssize_t t = p * dp + r;
                const uint8_t *in = src_record(src, s, t, in_buf);
                uint8_t *data, *foot;
                int direct = m1_place(dst, d, dp, t, out_buf, &data, &foot);
#if KV_X86
                if (isa == ISA_AVX512)
                    f2m_token_avx512(in, data, foot, tb, &rv, t, direct && nt_ok(data, dst_len), &count, &first);
                else
#endif
                    f2m_token_scalar(in, data, foot, tb, t, &count, &first);
                if (!direct)
                    m1_scatter(dst, d, dp, t, out_buf);
            }
            zero_unused(dst, d, dp, p, n);
        }
        bad_count[c] = count;
        bad_first[c] = first;
    }
    store_fence();
}

/* bad_from[b]: the smallest magnitude m with bad_mag[b * 128 + m] set (128: none), when every row of
 * bad_mag is such a threshold (so a vector compare finds a tile's bad values); else 0 (then the
 * kernels check each tile's largest magnitude, then each value, in the table). */
static int bad_thresholds(const uint8_t *bad_mag, uint8_t *bad_from) {
    for (int b = 0; b < 256; b++) {
        int m = 0;
        while (m < 128 && !bad_mag[b * 128 + m])
            m++;
        bad_from[b] = (uint8_t)m;
        for (int k = m; k < 128; k++)
            if (!bad_mag[b * 128 + k])
                return 0;
    }
    return 1;
}

KV_BODY void model1_to_fp8_chunks(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n,
                                 uint8_t *dst, Py_ssize_t dst_len, const geom_t *d, const m2f_tables *tb,
                                 int64_t *bad_count, int64_t *bad_first, int isa) {
    Py_ssize_t dp = d->pages, npages = dst_len / d->page_bytes, per = CHUNK_TOKENS / dp > 1 ? CHUNK_TOKENS / dp : 1;
    uint8_t in_buf[M1_RECORD], out_buf[FP8_RECORD], bad_from[256];
    const uint8_t *thresholds = isa == ISA_AVX512 && bad_thresholds(tb->bad_mag, bad_from) ? bad_from : NULL;
    (void)thresholds; /* unused where only the scalar code is compiled */
    for (Py_ssize_t c = c0; c < c1; c++) {
        int64_t count = 0, first = -1;
        Py_ssize_t p_end = (c + 1) * per < npages ? (c + 1) * per : npages;
        for (Py_ssize_t p = c * per; p < p_end; p++) {
            for (Py_ssize_t r = 0; r < dp && p * dp + r < n; r++) {
                Py_ssize_t t = p * dp + r, at, ft;
                const uint8_t *data, *foot;
                m1_read(src, s, t, in_buf, &data, &foot);
                locate(d, dp, t, &at, &ft);
                int direct = d->split == d->record_bytes;
                uint8_t *out = direct ? dst + at : out_buf;
#if KV_X86
                if (isa == ISA_AVX512)
                    m2f_token_avx512(data, foot, out, tb, thresholds, t, direct && nt_ok(out, dst_len), &count, &first);
                else
#endif
                    m2f_token_scalar(data, foot, out, tb, t, &count, &first);
                if (!direct) {
                    memcpy(dst + at, out_buf, (size_t)d->split);
                    memcpy(dst + ft, out_buf + d->split, (size_t)(d->record_bytes - d->split));
                }
            }
            zero_unused(dst, d, dp, p, n);
        }
        bad_count[c] = count;
        bad_first[c] = first;
    }
    store_fence();
}

KV_BODY void encode_chunks(Py_ssize_t c0, Py_ssize_t c1, const float *x32, const uint16_t *x16, Py_ssize_t n,
                          uint8_t *dst, Py_ssize_t dst_len, const geom_t *d, int min_exp, const float *pow2, int isa) {
    Py_ssize_t dp = d->pages, npages = dst_len / d->page_bytes, per = CHUNK_TOKENS / dp > 1 ? CHUNK_TOKENS / dp : 1;
    uint8_t out_buf[M1_RECORD];
    for (Py_ssize_t c = c0; c < c1; c++) {
        Py_ssize_t p_end = (c + 1) * per < npages ? (c + 1) * per : npages;
        for (Py_ssize_t p = c * per; p < p_end; p++) {
            for (Py_ssize_t r = 0; r < dp && p * dp + r < n; r++) {
                Py_ssize_t t = p * dp + r;
                const float *r32 = x16 ? NULL : x32 + t * HEAD_DIM;
                const uint16_t *r16 = x16 ? x16 + t * HEAD_DIM : NULL;
                uint8_t *data, *foot;
                int direct = m1_place(dst, d, dp, t, out_buf, &data, &foot);
#if KV_X86
                if (isa == ISA_AVX512)
                    encode_token_avx512(r32, r16, data, foot, min_exp, pow2, direct && nt_ok(data, dst_len));
                else
#endif
                    encode_token_scalar(r32, r16, data, foot, min_exp, pow2);
                if (!direct)
                    m1_scatter(dst, d, dp, t, out_buf);
            }
            zero_unused(dst, d, dp, p, n);
        }
    }
    store_fence();
}

KV_BODY void decode_chunks(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n,
                          float *out, Py_ssize_t out_len, const float *ue8m0, int isa) {
    uint8_t in_buf[M1_RECORD];
    for (Py_ssize_t t = c0 * CHUNK_TOKENS; t < c1 * CHUNK_TOKENS && t < n; t++) {
        const uint8_t *data, *foot;
        m1_read(src, s, t, in_buf, &data, &foot);
        float *row = out + t * HEAD_DIM;
#if KV_X86
        if (isa == ISA_AVX512)
            decode_token_avx512(data, foot, row, ue8m0, nt_ok(row, out_len));
        else
#endif
            decode_token_scalar(data, foot, row, ue8m0);
    }
    store_fence();
}

/* Each chunk loop compiled twice: for the baseline ISA (scalar token kernels) and for AVX-512
 * (its token kernels inlined). */
#define F2M_PARAMS Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n, uint8_t *dst, \
    Py_ssize_t dst_len, const geom_t *d, const f2m_tables *tb, int64_t *bad_count, int64_t *bad_first
#define M2F_PARAMS Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n, uint8_t *dst, \
    Py_ssize_t dst_len, const geom_t *d, const m2f_tables *tb, int64_t *bad_count, int64_t *bad_first
#define ENC_PARAMS Py_ssize_t c0, Py_ssize_t c1, const float *x32, const uint16_t *x16, Py_ssize_t n, uint8_t *dst, \
    Py_ssize_t dst_len, const geom_t *d, int min_exp, const float *pow2
#define DEC_PARAMS Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n, float *out, \
    Py_ssize_t out_len, const float *ue8m0
#define TRANSCODE_ARGS c0, c1, src, s, n, dst, dst_len, d, tb, bad_count, bad_first
#define ENC_ARGS c0, c1, x32, x16, n, dst, dst_len, d, min_exp, pow2
#define DEC_ARGS c0, c1, src, s, n, out, out_len, ue8m0
#if KV_X86
#define KV_VARIANTS(name, params, args)                                                                     \
    static void name##_scalar(params) { name##_chunks(args, ISA_SCALAR); }                                \
    KV_AVX512 static void name##_avx512(params) { name##_chunks(args, ISA_AVX512); }                      \
    static void name##_run(params, int isa) {                                                               \
        if (isa == ISA_AVX512)                                                                              \
            name##_avx512(args);                                                                            \
        else                                                                                                \
            name##_scalar(args);                                                                            \
    }
#else
#define KV_VARIANTS(name, params, args)                                                                     \
    static void name##_run(params, int isa) { name##_chunks(args, ISA_SCALAR); }
#endif
KV_VARIANTS(fp8_to_model1, F2M_PARAMS, TRANSCODE_ARGS)
KV_VARIANTS(model1_to_fp8, M2F_PARAMS, TRANSCODE_ARGS)
KV_VARIANTS(encode, ENC_PARAMS, ENC_ARGS)
KV_VARIANTS(decode, DEC_PARAMS, DEC_ARGS)

/* The same two transcodes between record rows anywhere (fp8_to_model1_segments, model1_to_fp8_segments: a
 * migration's conversion straight from source pages or records into destination pages, no page geometry). Each
 * side is two streams of rows, a record's data and its footer (a MODEL1 record's bytes [0, 576) and [576, 584); an
 * FP8 record is all data, 512 bytes, its footer stream unused): a token-major side passes one buffer twice, the
 * footer 576 bytes after the data. segs int64 [S, 6], one chunk each: the byte offsets of the segment's first row in
 * the source data, source footer, destination data and destination footer streams, its rows, and the record index
 * of its first row (what bad_first counts in: index * 512 + dim). Rows of a stream lie its stride apart. */
typedef struct {
    const uint8_t *sd, *sf;
    uint8_t *dd, *df;
    const int64_t *segs;
    int64_t sds, sfs, dds, dfs;
    int nt; /* non-temporal stores where a destination row is 64-byte aligned */
} seg_args;

KV_BODY void fp8_to_model1_segments_chunks(Py_ssize_t c0, Py_ssize_t c1, const seg_args *a, const f2m_tables *tb,
                                          int64_t *bad_count, int64_t *bad_first, int isa) {
#if KV_X86
    rope_vec rv;
    if (isa == ISA_AVX512)
        rope_vectors(tb->rope_lut, &rv);
#endif
    for (Py_ssize_t c = c0; c < c1; c++) {
        const int64_t *sg = a->segs + 6 * c;
        int64_t count = 0, first = -1;
        for (int64_t r = 0; r < sg[4]; r++) {
            const uint8_t *in = a->sd + sg[0] + r * a->sds;
            uint8_t *data = a->dd + sg[2] + r * a->dds, *foot = a->df + sg[3] + r * a->dfs;
            Py_ssize_t t = sg[5] + r;
#if KV_X86
            if (isa == ISA_AVX512)
                f2m_token_avx512(in, data, foot, tb, &rv, t, a->nt && ((uintptr_t)data & 63) == 0, &count, &first);
            else
#endif
                f2m_token_scalar(in, data, foot, tb, t, &count, &first);
        }
        bad_count[c] = count;
        bad_first[c] = first;
    }
    store_fence();
}

KV_BODY void model1_to_fp8_segments_chunks(Py_ssize_t c0, Py_ssize_t c1, const seg_args *a, const m2f_tables *tb,
                                          int64_t *bad_count, int64_t *bad_first, int isa) {
    uint8_t bad_from[256];
    const uint8_t *thresholds = isa == ISA_AVX512 && bad_thresholds(tb->bad_mag, bad_from) ? bad_from : NULL;
    (void)thresholds; /* unused where only the scalar code is compiled */
    for (Py_ssize_t c = c0; c < c1; c++) {
        const int64_t *sg = a->segs + 6 * c;
        int64_t count = 0, first = -1;
        for (int64_t r = 0; r < sg[4]; r++) {
            const uint8_t *data = a->sd + sg[0] + r * a->sds, *foot = a->sf + sg[1] + r * a->sfs;
            uint8_t *out = a->dd + sg[2] + r * a->dds;
            Py_ssize_t t = sg[5] + r;
#if KV_X86
            if (isa == ISA_AVX512)
                m2f_token_avx512(data, foot, out, tb, thresholds, t, a->nt && ((uintptr_t)out & 63) == 0, &count,
                                 &first);
            else
#endif
                m2f_token_scalar(data, foot, out, tb, t, &count, &first);
        }
        bad_count[c] = count;
        bad_first[c] = first;
    }
    store_fence();
}

#define F2MS_PARAMS Py_ssize_t c0, Py_ssize_t c1, const seg_args *a, const f2m_tables *tb, int64_t *bad_count, \
    int64_t *bad_first
#define M2FS_PARAMS Py_ssize_t c0, Py_ssize_t c1, const seg_args *a, const m2f_tables *tb, int64_t *bad_count, \
    int64_t *bad_first
#define SEG_ARGS c0, c1, a, tb, bad_count, bad_first
KV_VARIANTS(fp8_to_model1_segments, F2MS_PARAMS, SEG_ARGS)
KV_VARIANTS(model1_to_fp8_segments, M2FS_PARAMS, SEG_ARGS)

/* ------------------------------------------------------------------------------------------- */
/* Code-domain amax (dst_scale="auto"): one read pass over the codes and scale bytes            */
/* ------------------------------------------------------------------------------------------- */

/* Per chunk of CHUNK_TOKENS source tokens, as native.records._amax_kernel: amax[chunk] the largest |decoded value|
 * (an fp32), bad[chunk] 1 when a value would decode to NaN/Inf (amax[chunk] is then not a result).
 * Decoding is a monotone product with one positive factor per tile or tensor, so the amax is the
 * decoded value of each tile's largest code magnitude m (one fp32 product per tile):
 *   MODEL1: e4m3(m) * 2^(b - 127) per tile (b its scale byte; m = 0x7F, b = 0xFF or an overflowing
 *           product is bad), the rope's largest |bf16| (exponent 0xFF is bad);
 *   per-tensor E4M3: |e4m3(M) * scale| of the largest magnitude M over every code of the chunk. */

/* fp32 2^(b - 127) of a UE8M0 byte (0xFF: NaN), as native.records._UE8M0_F32. */
static inline float ue8m0_value(uint32_t b) {
    return bits_f32(b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : b << 23);
}

static inline int finite_f32(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b & 0x7F800000u) != 0x7F800000u;
}

static void m1_amax_token_scalar(const uint8_t *data, const uint8_t *foot, float *best, uint16_t *rope_max,
                                 int *bad) {
    for (int j = 0; j < 7; j++) {
        uint8_t m = 0;
        for (int i = 0; i < 64; i++) {
            uint8_t a = data[64 * j + i] & 0x7F;
            m = a > m ? a : m;
        }
        float v = e4m3_value(m) * ue8m0_value(foot[j]);
        if (m == 0x7F || !finite_f32(v))
            *bad = 1;
        else if (v > *best)
            *best = v;
    }
    for (int i = 0; i < 64; i++) {
        uint16_t h = (uint16_t)((data[448 + 2 * i] | (data[448 + 2 * i + 1] << 8)) & 0x7FFF);
        *rope_max = h > *rope_max ? h : *rope_max;
    }
}

/* Largest byte & 0x7F of n bytes at p. */
static inline uint8_t max_magnitude_scalar(const uint8_t *p, Py_ssize_t n) {
    uint8_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t a = p[i] & 0x7F;
        m = a > m ? a : m;
    }
    return m;
}

#if KV_X86
/* Lane l of tile_max16's result holds the largest magnitude of tile TREE_LANE[l] (0-15) of its input; set
 * by tree_lanes() when the module is initialised. */
static uint8_t TREE_LANE[16];

/* Largest magnitude (byte & 0x7F) of each of the 16 64-byte vectors v[0..15], one per 32-bit lane (in the
 * order TREE_LANE names): a reduction tree that halves all vectors' widths together (blend + two-source
 * permute + max per pair at each level) instead of 16 separate horizontal reductions. */
KV_AVX512 static inline __m512i tile_max16(const __m512i *v) {
    __m512i w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) { /* 64 -> 32 bytes per vector: [a lo|hi max, b hi|lo max] */
        __m512i a = v[2 * i], b = v[2 * i + 1];
        __m512i lo = _mm512_mask_blend_epi64(0xF0, a, b);                                 /* a.lo256, b.hi256 */
        __m512i hi = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 3, 2));                  /* a.hi256, b.lo256 */
        w[i] = _mm512_max_epu8(lo, hi);
    }
    for (int i = 0; i < 4; i++) { /* 32 -> 16: 128-bit lanes [a, c, b, d] */
        __m512i a = w[2 * i], b = w[2 * i + 1];
        __m512i lo = _mm512_mask_blend_epi64(0xCC, a, b);                                 /* a0 b1 a2 b3 */
        __m512i hi = _mm512_permutex2var_epi64(a, _mm512_set_epi64(13, 12, 7, 6, 9, 8, 3, 2), b); /* a1 b0 a3 b2 */
        x[i] = _mm512_max_epu8(lo, hi);
    }
    for (int i = 0; i < 2; i++) { /* 16 -> 8 */
        __m512i a = x[2 * i], b = x[2 * i + 1];
        __m512i lo = _mm512_mask_blend_epi64(0xAA, a, b);
        __m512i hi = _mm512_permutex2var_epi64(a, _mm512_set_epi64(14, 7, 12, 5, 10, 3, 8, 1), b);
        y[i] = _mm512_max_epu8(lo, hi);
    }
    /* 8 -> 4 */
    __m512i lo = _mm512_mask_blend_epi32(0xAAAA, y[0], y[1]);
    __m512i hi = _mm512_permutex2var_epi32(
        y[0], _mm512_set_epi32(30, 15, 28, 13, 26, 11, 24, 9, 22, 7, 20, 5, 18, 3, 16, 1), y[1]);
    __m512i z = _mm512_max_epu8(lo, hi);
    z = _mm512_max_epu8(z, _mm512_srli_epi32(z, 16)); /* 4 -> 1 */
    z = _mm512_max_epu8(z, _mm512_srli_epi32(z, 8));
    return _mm512_and_si512(z, _mm512_set1_epi32(0x7F));
}

/* TREE_LANE from tile_max16 on vectors filled with their own index. */
KV_AVX512 static void tree_lanes(void) {
    __m512i v[16];
    uint32_t lanes[16];
    for (int i = 0; i < 16; i++)
        v[i] = _mm512_set1_epi8((char)i);
    _mm512_storeu_si512(lanes, tile_max16(v));
    for (int l = 0; l < 16; l++)
        TREE_LANE[l] = (uint8_t)lanes[l];
}

/* Two MODEL1 tokens a and b (b may be a again): their 14 tiles' amax into *best (16 fp32 lanes, max of good
 * values), bad lanes into *bad_lanes, the ropes' largest |bf16 word| into *rope (32 16-bit lanes). */
KV_AVX512 static inline void m1_amax_pair_avx512(const uint8_t *da, const uint8_t *fa, const uint8_t *db,
                                                 const uint8_t *fb, const __m128i scale_index, __m512 *best,
                                                 __mmask16 *bad_lanes, __m512i *rope) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __m512i v[16];
    for (int j = 0; j < 7; j++) {
        v[j] = _mm512_and_si512(_mm512_loadu_si512(da + 64 * j), m7f);
        v[8 + j] = _mm512_and_si512(_mm512_loadu_si512(db + 64 * j), m7f);
    }
    v[7] = v[0], v[15] = v[8]; /* padding lanes: tile 0 again (index 0 / 8 in scale_index) */
    __m512i m = tile_max16(v);
    uint64_t fa8, fb8;
    memcpy(&fa8, fa, 8);
    memcpy(&fb8, fb, 8);
    __m128i scales = _mm_shuffle_epi8(_mm_set_epi64x((long long)fb8, (long long)fa8), scale_index);
    __m512i b = _mm512_cvtepu8_epi32(scales);
    /* e4m3(m): normal (m >= 8) from the bits, subnormal m * 2^-9 */
    __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(m, 20), _mm512_set1_epi32(0x3C000000)));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f));
    __m512 e = _mm512_mask_blend_ps(_mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(8)), sub, normal);
    /* 2^(b - 127): b << 23, 0x00400000 for b = 0 (b = 255 gives Inf, not NaN: bad either way) */
    __m512i sbits = _mm512_mask_blend_epi32(_mm512_cmpeq_epu32_mask(b, _mm512_setzero_si512()),
                                            _mm512_slli_epi32(b, 23), _mm512_set1_epi32(0x00400000));
    __m512 p = _mm512_mul_ps(e, _mm512_castsi512_ps(sbits));
    const __m512i expm = _mm512_set1_epi32(0x7F800000);
    __mmask16 bad = _mm512_cmpeq_epu32_mask(_mm512_and_si512(_mm512_castps_si512(p), expm), expm) |
                    _mm512_cmpeq_epu32_mask(m, _mm512_set1_epi32(0x7F));
    *bad_lanes |= bad;
    *best = _mm512_mask_max_ps(*best, (__mmask16)~bad, *best, p);
    const __m512i m7fff = _mm512_set1_epi16(0x7FFF);
    __m512i r = _mm512_max_epu16(_mm512_and_si512(_mm512_loadu_si512(da + 448), m7fff),
                                 _mm512_and_si512(_mm512_loadu_si512(da + 512), m7fff));
    r = _mm512_max_epu16(r, _mm512_and_si512(_mm512_loadu_si512(db + 448), m7fff));
    r = _mm512_max_epu16(r, _mm512_and_si512(_mm512_loadu_si512(db + 512), m7fff));
    *rope = _mm512_max_epu16(*rope, r);
}

/* Largest byte & 0x7F of n bytes at p (vertical maxima, 256 bytes per step, a masked tail). */
KV_AVX512 static inline __m512i max_magnitude_avx512(const uint8_t *p, Py_ssize_t n, __m512i acc) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __m512i a1 = _mm512_setzero_si512(), a2 = a1, a3 = a1;
    Py_ssize_t i = 0;
    for (; i + 256 <= n; i += 256) {
        acc = _mm512_max_epu8(acc, _mm512_and_si512(_mm512_loadu_si512(p + i), m7f));
        a1 = _mm512_max_epu8(a1, _mm512_and_si512(_mm512_loadu_si512(p + i + 64), m7f));
        a2 = _mm512_max_epu8(a2, _mm512_and_si512(_mm512_loadu_si512(p + i + 128), m7f));
        a3 = _mm512_max_epu8(a3, _mm512_and_si512(_mm512_loadu_si512(p + i + 192), m7f));
    }
    for (; i < n; i += 64) {
        __mmask64 k = n - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - i)) - 1);
        acc = _mm512_max_epu8(acc, _mm512_and_si512(_mm512_maskz_loadu_epi8(k, p + i), m7f));
    }
    return _mm512_max_epu8(_mm512_max_epu8(acc, a1), _mm512_max_epu8(a2, a3));
}

/* model1_amax_chunks' tokens [t0, t1) two at a time: *best, *rope_max (the largest |rope word|), *bad. */
KV_AVX512 static void m1_amax_tokens_avx512(const uint8_t *src, const geom_t *s, Py_ssize_t t0, Py_ssize_t t1,
                                            const uint8_t *index, float *best, uint16_t *rope_max, int *bad) {
    uint8_t buf_a[M1_RECORD], buf_b[M1_RECORD];
    const __m128i scale_index = _mm_loadu_si128((const __m128i *)index);
    __m512 best_v = _mm512_setzero_ps();
    __m512i rope_v = _mm512_setzero_si512();
    __mmask16 bad_lanes = 0;
    for (Py_ssize_t t = t0; t < t1; t += 2) {
        const uint8_t *da, *fa, *db, *fb;
        m1_read(src, s, t, buf_a, &da, &fa);
        if (t + 1 < t1)
            m1_read(src, s, t + 1, buf_b, &db, &fb);
        else
            db = da, fb = fa;
        m1_amax_pair_avx512(da, fa, db, fb, scale_index, &best_v, &bad_lanes, &rope_v);
    }
    *best = _mm512_reduce_max_ps(best_v);
    *bad = bad_lanes != 0;
    *rope_max = max_u16(rope_v, rope_v);
}

/* Largest byte & 0x7F of the per-tensor E4M3 records of tokens [t0, t1). */
KV_AVX512 static uint8_t fp8_max_magnitude_avx512(const uint8_t *src, const geom_t *s, Py_ssize_t t0, Py_ssize_t t1) {
    Py_ssize_t sp = s->pages, foot_bytes = s->record_bytes - s->split;
    __m512i acc = _mm512_setzero_si512();
    for (Py_ssize_t t = t0; t < t1;) { /* the rows [r0, r1) of one page: two contiguous byte ranges */
        Py_ssize_t page = t / sp, r0 = t - page * sp, r1 = t1 - page * sp < sp ? t1 - page * sp : sp;
        const uint8_t *data = src + page * s->page_bytes, *foot = data + sp * s->split;
        acc = max_magnitude_avx512(data + r0 * s->split, (r1 - r0) * s->split, acc);
        acc = max_magnitude_avx512(foot + r0 * foot_bytes, (r1 - r0) * foot_bytes, acc);
        t += r1 - r0;
    }
    return max_u8(acc);
}
#endif /* KV_X86 */

KV_BODY void model1_amax_chunks(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n,
                                float *amax, int64_t *bad_out, int isa) {
    uint8_t buf_a[M1_RECORD];
#if KV_X86
    uint8_t index[16];
    for (int l = 0; l < 16; l++) /* the scale byte of each tree lane: tile t of token a (b: 8 + t); padding: 0 */
        index[l] = (uint8_t)((TREE_LANE[l] & 7) == 7 ? TREE_LANE[l] & 8 : TREE_LANE[l]);
#endif
    for (Py_ssize_t c = c0; c < c1; c++) {
        Py_ssize_t t0 = c * CHUNK_TOKENS, t1 = (c + 1) * CHUNK_TOKENS < n ? (c + 1) * CHUNK_TOKENS : n;
        float best = 0.0f;
        uint16_t rope_max = 0;
        int bad = 0;
#if KV_X86
        if (isa == ISA_AVX512)
            m1_amax_tokens_avx512(src, s, t0, t1, index, &best, &rope_max, &bad);
        else
#endif
            for (Py_ssize_t t = t0; t < t1; t++) {
                const uint8_t *data, *foot;
                m1_read(src, s, t, buf_a, &data, &foot);
                m1_amax_token_scalar(data, foot, &best, &rope_max, &bad);
            }
        if (rope_max >= 0x7F80)
            bad = 1;
        else if (t1 > t0 && bits_f32((uint32_t)rope_max << 16) > best)
            best = bits_f32((uint32_t)rope_max << 16);
        amax[c] = best;
        bad_out[c] = bad;
    }
}

KV_BODY void fp8_amax_chunks(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n,
                             float scale, float *amax, int64_t *bad_out, int isa) {
    Py_ssize_t sp = s->pages, foot_bytes = s->record_bytes - s->split;
    for (Py_ssize_t c = c0; c < c1; c++) {
        Py_ssize_t t0 = c * CHUNK_TOKENS, t1 = (c + 1) * CHUNK_TOKENS < n ? (c + 1) * CHUNK_TOKENS : n;
        uint8_t m = 0;
#if KV_X86
        if (isa == ISA_AVX512)
            m = fp8_max_magnitude_avx512(src, s, t0, t1);
        else
#endif
            for (Py_ssize_t t = t0; t < t1;) { /* the rows [r0, r1) of one page: two contiguous byte ranges */
                Py_ssize_t page = t / sp, r0 = t - page * sp, r1 = t1 - page * sp < sp ? t1 - page * sp : sp;
                const uint8_t *data = src + page * s->page_bytes, *foot = data + sp * s->split;
                uint8_t a = max_magnitude_scalar(data + r0 * s->split, (r1 - r0) * s->split);
                uint8_t b = max_magnitude_scalar(foot + r0 * foot_bytes, (r1 - r0) * foot_bytes);
                m = a > m ? a : m;
                m = b > m ? b : m;
                t += r1 - r0;
            }
        uint32_t bits;
        float v = e4m3_value(m) * scale;
        memcpy(&bits, &v, 4);
        v = bits_f32(bits & 0x7FFFFFFFu); /* |e4m3(m) * scale| */
        int bad = m == 0x7F || !finite_f32(v);
        amax[c] = bad ? 0.0f : v;
        bad_out[c] = bad;
    }
}

#define M1_AMAX_PARAMS Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n, float *amax, \
    int64_t *bad
#define M1_AMAX_ARGS c0, c1, src, s, n, amax, bad
#define FP8_AMAX_PARAMS Py_ssize_t c0, Py_ssize_t c1, const uint8_t *src, const geom_t *s, Py_ssize_t n, float scale, \
    float *amax, int64_t *bad
#define FP8_AMAX_ARGS c0, c1, src, s, n, scale, amax, bad
KV_VARIANTS(model1_amax, M1_AMAX_PARAMS, M1_AMAX_ARGS)
KV_VARIANTS(fp8_amax, FP8_AMAX_PARAMS, FP8_AMAX_ARGS)

/* ------------------------------------------------------------------------------------------- */
/* Python interface                                                                             */
/* ------------------------------------------------------------------------------------------- */

static int need(int ok, const char *what) {
    if (!ok)
        PyErr_Format(PyExc_ValueError, "kvbridge.backends.native._kernels: %s", what);
    return ok;
}

/* Geometry sanity: page size, page bytes and split in range, and the pool holding `pages_needed` pages. */
static int check_geom(const geom_t *g, Py_ssize_t len, Py_ssize_t record_bytes, Py_ssize_t pages_needed,
                      const char *what) {
    if (g->pages < 1 || g->record_bytes != record_bytes || g->split < 0 || g->split > g->record_bytes ||
        g->page_bytes < g->pages * g->record_bytes || len < pages_needed * g->page_bytes) {
        PyErr_Format(PyExc_ValueError, "kvbridge.backends.native._kernels: bad %s geometry", what);
        return 0;
    }
    return 1;
}

static void release(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

static Py_ssize_t npages_of(Py_ssize_t n, Py_ssize_t p) { return (n + p - 1) / p; }

static int check_chunks(Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t dst_pages, Py_ssize_t dp) {
    Py_ssize_t per = CHUNK_TOKENS / dp > 1 ? CHUNK_TOKENS / dp : 1;
    return need(c0 >= 0 && c1 >= c0 && c1 <= (dst_pages + per - 1) / per + 1, "chunk range out of bounds");
}

static PyObject *py_fp8_to_model1(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    geom_t s, d;
    Py_buffer v[8];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*nnnnnw*nnnny*y*y*y*w*w*", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split,
                          &s.record_bytes, &n, &v[1], &d.pages, &d.page_bytes, &d.split, &d.record_bytes, &v[2], &v[3],
                          &v[4], &v[5], &v[6], &v[7]))
        return NULL;
    int ok = check_geom(&s, v[0].len, FP8_RECORD, npages_of(n, s.pages), "source") &&
             check_geom(&d, v[1].len, M1_RECORD, npages_of(n, d.pages), "destination") &&
             check_chunks(c0, c1, v[1].len / d.page_bytes, d.pages) &&
             need(v[2].len >= 128 && v[3].len >= 128 && v[4].len >= 128 * 256 && v[5].len >= 512, "short table") &&
             need(v[6].len >= c1 * 8 && v[7].len >= c1 * 8, "short bad_count/bad_first");
    if (ok) {
        f2m_tables tb = {v[2].buf, v[3].buf, v[4].buf, v[5].buf};
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        fp8_to_model1_run(c0, c1, v[0].buf, &s, n, v[1].buf, v[1].len, &d, &tb, v[6].buf, v[7].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 8);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_model1_to_fp8(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    geom_t s, d;
    Py_buffer v[7];
    memset(v, 0, sizeof v);
    float mult;
    if (!PyArg_ParseTuple(args, "nny*nnnnnw*nnnny*y*y*w*w*f", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split,
                          &s.record_bytes, &n, &v[1], &d.pages, &d.page_bytes, &d.split, &d.record_bytes, &v[2], &v[3],
                          &v[4], &v[5], &v[6], &mult))
        return NULL;
    int ok = check_geom(&s, v[0].len, M1_RECORD, npages_of(n, s.pages), "source") &&
             check_geom(&d, v[1].len, FP8_RECORD, npages_of(n, d.pages), "destination") &&
             check_chunks(c0, c1, v[1].len / d.page_bytes, d.pages) &&
             need(v[2].len >= 256 * 256 && v[3].len >= 256 * 128 && v[4].len >= 65536, "short table") &&
             need(v[5].len >= c1 * 8 && v[6].len >= c1 * 8, "short bad_count/bad_first");
    if (ok) {
        m2f_tables tb = {v[2].buf, v[3].buf, v[4].buf, mult};
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        model1_to_fp8_run(c0, c1, v[0].buf, &s, n, v[1].buf, v[1].len, &d, &tb, v[5].buf, v[6].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 7);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_model1_encode(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    int from_bf16, min_exp;
    geom_t d;
    Py_buffer v[4];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*y*pnw*nnnniy*", &c0, &c1, &v[0], &v[1], &from_bf16, &n, &v[2], &d.pages,
                          &d.page_bytes, &d.split, &d.record_bytes, &min_exp, &v[3]))
        return NULL;
    int ok = check_geom(&d, v[2].len, M1_RECORD, npages_of(n, d.pages), "destination") &&
             check_chunks(c0, c1, v[2].len / d.page_bytes, d.pages) &&
             need((from_bf16 ? v[1].len >= n * HEAD_DIM * 2 : v[0].len >= n * HEAD_DIM * 4), "short latents") &&
             need(v[3].len >= 277 * 4 && min_exp >= -127 && min_exp <= 0, "bad pow2 table or exponent floor");
    if (ok) {
        int isa = kv_isa;
        const float *x32 = from_bf16 ? NULL : v[0].buf;
        const uint16_t *x16 = from_bf16 ? v[1].buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        encode_run(c0, c1, x32, x16, n, v[2].buf, v[2].len, &d, min_exp, v[3].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 4);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_model1_decode(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    geom_t s;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*nnnnnw*y*", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split, &s.record_bytes,
                          &n, &v[1], &v[2]))
        return NULL;
    int ok = check_geom(&s, v[0].len, M1_RECORD, npages_of(n, s.pages), "source") &&
             need(c0 >= 0 && c1 >= c0, "chunk range out of bounds") &&
             need(v[1].len >= n * HEAD_DIM * 4, "short output") && need(v[2].len >= 256 * 4, "short ue8m0 table");
    if (ok) {
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        decode_run(c0, c1, v[0].buf, &s, n, v[1].buf, v[1].len, v[2].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 3);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* Chunks [c0, c1) of ceil(n / CHUNK_TOKENS) source tokens; amax (fp32) and bad (int64) hold c1 entries. */
static int check_amax_args(Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t n, const Py_buffer *amax, const Py_buffer *bad) {
    return need(n >= 0 && c0 >= 0 && c1 >= c0 && c1 <= (n + CHUNK_TOKENS - 1) / CHUNK_TOKENS,
                "chunk range out of bounds") &&
           need(amax->len >= c1 * 4 && bad->len >= c1 * 8, "short amax/bad");
}

static PyObject *py_model1_amax(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    geom_t s;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*nnnnnw*w*", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split, &s.record_bytes,
                          &n, &v[1], &v[2]))
        return NULL;
    int ok = check_geom(&s, v[0].len, M1_RECORD, npages_of(n, s.pages), "source") &&
             check_amax_args(c0, c1, n, &v[1], &v[2]);
    if (ok) {
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        model1_amax_run(c0, c1, v[0].buf, &s, n, v[1].buf, v[2].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 3);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_fp8_amax(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1, n;
    float scale;
    geom_t s;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*nnnnnfw*w*", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split, &s.record_bytes,
                          &n, &scale, &v[1], &v[2]))
        return NULL;
    int ok = check_geom(&s, v[0].len, FP8_RECORD, npages_of(n, s.pages), "source") &&
             check_amax_args(c0, c1, n, &v[1], &v[2]);
    if (ok) {
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        fp8_amax_run(c0, c1, v[0].buf, &s, n, scale, v[1].buf, v[2].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 3);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static const char *isa_name(int isa) { return isa == ISA_AVX512 ? "avx512vbmi" : "scalar"; }

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_name(kv_isa)); }

static PyObject *py_cpu_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_name(kv_cpu_isa)); }

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    int want = strcmp(name, "scalar") == 0 ? ISA_SCALAR : strcmp(name, "avx512vbmi") == 0 ? ISA_AVX512 : -1;
    if (want < 0 || want > kv_cpu_isa) {
        PyErr_Format(PyExc_ValueError, "kvbridge.backends.native._kernels: ISA %R not available (this CPU: %s)", arg,
                     isa_name(kv_cpu_isa));
        return NULL;
    }
    PyObject *previous = PyUnicode_FromString(isa_name(kv_isa));
    kv_isa = want;
    return previous;
}

static PyObject *py_set_nt_min(PyObject *self, PyObject *arg) {
    Py_ssize_t value = PyLong_AsSsize_t(arg);
    if (value == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t previous = nt_min_bytes;
    nt_min_bytes = value;
    return PyLong_FromSsize_t(previous);
}

/* ------------------------------------------------------------------------------------------- */
/* Loss statistics: per-tensor E4M3 against MODEL1 (kvbridge.native_loss)                       */
/* ------------------------------------------------------------------------------------------- */

/* fp8_model1_loss / model1_fp8_loss: the statistics of native_loss._loss_kernel for a per-tensor E4M3 pool
 * (values e4m3(c) * s_pt) against a MODEL1 pool, read in place (gathered where block-split). Per value x (the
 * source's) and y (the destination's): err = |y - x|, one fp32 subtraction. Per chunk c of CHUNK_TOKENS tokens:
 * maxima[4c..] the fp32 bits of (max |x|, max err, max err over dims [0, 448), over [448, 512)), sums[c] the
 * float64 sum of err^2 (each token's, then the chunk's tokens in order), counts[3c..] (x != y, x != 0 and y == 0,
 * |x * mult| > 448 when per_tensor).
 *
 * The AVX-512 code takes E4M3 values from the fp16 whose bits are the code's sign << 15 | magnitude << 7: that
 * fp16 is exactly e4m3(c) * 2^-8 (subnormals included) and vcvtph2ps is exact, so one product with the scale
 * times 2^8 rounds e4m3(c) * scale once, as the decoder's table product does. Where scale * 2^8 would overflow
 * (per-tensor scales above FLT_MAX / 256, UE8M0 bytes above 246), the value is (f * 2^8) * scale, the first
 * product exact. Maxima are taken on bit patterns, counts by popcount of compare masks, and the float64 squares
 * are exact (48 significant bits), so only the order of the float64 additions differs from the generic kernel's.
 * A non-finite per-tensor scale runs the scalar code (the vector code takes some statistics from the codes).
 * The pools hold finite values (the transcode refused a non-finite source): the vector code reads an E4M3 NaN
 * code (magnitude 0x7F) as 480, as the numba accelerators do. */

typedef struct {
    float s_pt, mult; /* the per-tensor scale; |mult| */
    const float *ue8m0;
    uint8_t pt_sat_from, m1_sat_from[256]; /* see sat_from */
} loss_params;

typedef struct {
    uint32_t amax, nope, rope;
    int64_t unequal, flushed, saturated;
} loss_acc;

/* The smallest magnitude code a with |fl(e4m3(a) * scale) * mult| > 448 (the generic kernel's fp32 steps), 0x7F
 * when none: |fl(e4m3(a) * scale)| rises with a for a finite scale, so the saturating codes are [a, 0x7E]. */
static uint8_t sat_from(float scale, float mult) {
    int lo = 0, hi = 0x7F;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (fabsf(e4m3_value((uint32_t)mid) * scale * mult) > 448.0f)
            hi = mid;
        else
            lo = mid + 1;
    }
    return (uint8_t)lo;
}

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

KV_BODY double loss_value_scalar(float x, float y, int rope, int per_tensor, float mult, loss_acc *acc) {
    float d = y - x;
    uint32_t e = f32_bits(d) & 0x7FFFFFFFu;
    acc->amax = max_u32(acc->amax, f32_bits(x) & 0x7FFFFFFFu);
    if (rope)
        acc->rope = max_u32(acc->rope, e);
    else
        acc->nope = max_u32(acc->nope, e);
    acc->unequal += x != y;
    acc->flushed += (x != 0.0f) & (y == 0.0f);
    if (per_tensor)
        acc->saturated += bits_f32(f32_bits(x) & 0x7FFFFFFFu) * mult > 448.0f;
    double ed = (double)bits_f32(e);
    return ed * ed;
}

/* One token: pt its 512 per-tensor E4M3 bytes, data its MODEL1 bytes [0, 576), foot its scale bytes; returns its
 * float64 sum of err^2. */
KV_BODY double loss_token_scalar(const uint8_t *pt, const uint8_t *data, const uint8_t *foot, const loss_params *a,
                                int tensor_is_src, int per_tensor, loss_acc *acc) {
    double sq = 0.0;
    for (int j = 0; j < 7; j++) {
        float s = a->ue8m0[foot[j]];
        for (int i = 0; i < 64; i++) {
            float p = e4m3_value(pt[64 * j + i]) * a->s_pt, m = e4m3_value(data[64 * j + i]) * s;
            sq += tensor_is_src ? loss_value_scalar(p, m, 0, per_tensor, a->mult, acc)
                                : loss_value_scalar(m, p, 0, per_tensor, a->mult, acc);
        }
    }
    for (int i = 0; i < 64; i++) {
        float p = e4m3_value(pt[448 + i]) * a->s_pt;
        float m = bits_f32((uint32_t)(data[448 + 2 * i] | (data[448 + 2 * i + 1] << 8)) << 16);
        sq += tensor_is_src ? loss_value_scalar(p, m, 1, per_tensor, a->mult, acc)
                            : loss_value_scalar(m, p, 1, per_tensor, a->mult, acc);
    }
    return sq;
}

#if KV_X86
typedef struct {
    __m512i amax, nope, rope; /* 32-bit lanes */
    __m512i amax_code;        /* per byte: the largest per-tensor source magnitude code */
    __m512d sq0, sq1;
    int64_t unequal, flushed, saturated;
} loss_vec;

/* e4m3(c) * 2^-8 of the 64 codes at p, exactly: 4 vectors of 16 fp32. */
KV_AVX512 KV_BODY void e4m3_tile_scaled_down(const uint8_t *p, __m512 f[4]) {
    const __m256i keep = _mm256_set1_epi16((short)0xBF80);
    for (int k = 0; k < 4; k++) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
        f[k] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), keep)); /* sign << 15 | magnitude << 7 */
    }
}

/* f * a, then * b when two (see the section comment). */
KV_AVX512 KV_BODY __m512 rescale(__m512 f, __m512 a, __m512 b, int two) {
    f = _mm512_mul_ps(f, a);
    return two ? _mm512_mul_ps(f, b) : f;
}

/* The statistics of 16 values x (source) against y; x's |x| maximum and saturation count only when by_value (else
 * the caller takes them from the codes). */
KV_AVX512 KV_BODY void loss16(__m512 x, __m512 y, __m512i *emax, int by_value, int per_tensor, __m512 mult,
                              loss_vec *v) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i e = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(y, x)), abs_mask);
    *emax = _mm512_max_epu32(*emax, e);
    if (by_value) {
        __m512i ax = _mm512_and_si512(_mm512_castps_si512(x), abs_mask);
        v->amax = _mm512_max_epu32(v->amax, ax);
        if (per_tensor)
            v->saturated += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_castsi512_ps(ax), mult),
                                                                  _mm512_set1_ps(448.0f), _CMP_GT_OQ));
    }
    __mmask16 ne = _mm512_cmp_ps_mask(x, y, _CMP_NEQ_UQ);
    v->unequal += __builtin_popcount(ne);
    /* y == 0 and x != y: x != 0 and y == 0 */
    v->flushed += __builtin_popcount(_mm512_mask_cmp_ps_mask(ne, y, _mm512_setzero_ps(), _CMP_EQ_OQ));
    __m512 ef = _mm512_castsi512_ps(e);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(ef));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ef), 1)));
    v->sq0 = _mm512_fmadd_pd(lo, lo, v->sq0); /* err^2 is exact in float64: one rounding, as mul then add */
    v->sq1 = _mm512_fmadd_pd(hi, hi, v->sq1);
}

/* How many of the 64 magnitude codes mag are in [from, 0x7E] (the saturating ones: see sat_from). */
KV_AVX512 KV_BODY int saturated_codes(__m512i mag, uint8_t from) {
    __mmask64 k = _mm512_cmpge_epu8_mask(mag, _mm512_set1_epi8((char)from));
    return __builtin_popcountll(_mm512_mask_cmple_epu8_mask(k, mag, _mm512_set1_epi8(0x7E)));
}

/* A token (see loss_token_scalar). A per-tensor source's max |x| and saturation count come from its codes: |x| =
 * e4m3(|c|) * |s_pt| rises with |c| (a finite s_pt), so the largest magnitude code gives the maximum and the
 * saturating codes are those from a->pt_sat_from; a MODEL1 source's nope saturation count likewise from
 * a->m1_sat_from[scale byte]. */
KV_AVX512 KV_BODY double loss_token_avx512(const uint8_t *pt, const uint8_t *data, const uint8_t *foot,
                                           const loss_params *a, int tensor_is_src, int per_tensor, loss_vec *v) {
    const __m512 s256 = _mm512_set1_ps(256.0f), mult = _mm512_set1_ps(a->mult);
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    int pt_two = !(fabsf(a->s_pt) <= FLT_MAX / 256.0f);
    __m512 pt_a = pt_two ? s256 : _mm512_set1_ps(a->s_pt * 256.0f), pt_b = _mm512_set1_ps(a->s_pt);
    __m512 fp[4], fm[4];
    v->sq0 = v->sq1 = _mm512_setzero_pd();
    for (int j = 0; j < 8; j++) {
        if (tensor_is_src) {
            __m512i mag = _mm512_and_si512(_mm512_loadu_si512(pt + 64 * j), m7f);
            v->amax_code = _mm512_max_epu8(v->amax_code, mag);
            if (per_tensor)
                v->saturated += saturated_codes(mag, a->pt_sat_from);
        }
        e4m3_tile_scaled_down(pt + 64 * j, fp);
        if (j == 7)
            break;
        unsigned b = foot[j];
        int m_two = b > 246;
        __m512 m_a = m_two ? s256 : _mm512_set1_ps(a->ue8m0[b + 8]), m_b = _mm512_set1_ps(a->ue8m0[b]);
        if (!tensor_is_src && per_tensor)
            v->saturated += saturated_codes(_mm512_and_si512(_mm512_loadu_si512(data + 64 * j), m7f),
                                            a->m1_sat_from[b]);
        e4m3_tile_scaled_down(data + 64 * j, fm);
        for (int k = 0; k < 4; k++) {
            __m512 p = rescale(fp[k], pt_a, pt_b, pt_two), m = rescale(fm[k], m_a, m_b, m_two);
            if (tensor_is_src)
                loss16(p, m, &v->nope, 0, per_tensor, mult, v);
            else {
                v->amax = _mm512_max_epu32(v->amax, _mm512_and_si512(_mm512_castps_si512(m),
                                                                     _mm512_set1_epi32(0x7FFFFFFF)));
                loss16(m, p, &v->nope, 0, per_tensor, mult, v);
            }
        }
    }
    for (int k = 0; k < 4; k++) {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(data + 448 + 32 * k)));
        __m512 p = rescale(fp[k], pt_a, pt_b, pt_two), m = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        if (tensor_is_src)
            loss16(p, m, &v->rope, 0, per_tensor, mult, v);
        else
            loss16(m, p, &v->rope, 1, per_tensor, mult, v);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(v->sq0, v->sq1));
}

KV_AVX512 static inline void loss_vec_fold(const loss_vec *v, const loss_params *a, loss_acc *acc) {
    uint32_t by_code = f32_bits(e4m3_value(max_u8(v->amax_code)) * a->s_pt) & 0x7FFFFFFFu;
    acc->amax = max_u32(_mm512_reduce_max_epu32(v->amax), by_code);
    acc->nope = _mm512_reduce_max_epu32(v->nope);
    acc->rope = _mm512_reduce_max_epu32(v->rope);
    acc->unequal = v->unequal;
    acc->flushed = v->flushed;
    acc->saturated = v->saturated;
}
#endif /* KV_X86 */

/* The statistics of tokens [t0, t1) into acc (from zero); returns their float64 sum of err^2 (each token's sum,
 * then over the tokens in order). The source is the per-tensor pool when tensor_is_src. */
#define LOSS_TOKEN(impl, src_is_pt, per_tensor)                                                             \
    for (Py_ssize_t t = t0; t < t1; t++) {                                                                  \
        const uint8_t *pt = src_record(pt_pool, pg, t, pt_buf), *data, *foot;                               \
        m1_read(m1_pool, mg, t, m1_buf, &data, &foot);                                                      \
        sq += loss_token_##impl(pt, data, foot, a, src_is_pt, per_tensor, acc_of_##impl);                   \
    }
#define LOSS_TOKENS(impl)                                                                                   \
    if (tensor_is_src && per_tensor) {                                                                      \
        LOSS_TOKEN(impl, 1, 1)                                                                              \
    } else if (tensor_is_src) {                                                                             \
        LOSS_TOKEN(impl, 1, 0)                                                                              \
    } else if (per_tensor) {                                                                                \
        LOSS_TOKEN(impl, 0, 1)                                                                              \
    } else {                                                                                                \
        LOSS_TOKEN(impl, 0, 0)                                                                              \
    }
#define LOSS_RANGE_PARAMS Py_ssize_t t0, Py_ssize_t t1, const uint8_t *pt_pool, const geom_t *pg,               \
    const uint8_t *m1_pool, const geom_t *mg, const loss_params *a, int tensor_is_src, int per_tensor, loss_acc *acc

static double loss_range_scalar(LOSS_RANGE_PARAMS) {
    uint8_t pt_buf[FP8_RECORD], m1_buf[M1_RECORD];
    double sq = 0.0;
    loss_acc *acc_of_scalar = acc;
    LOSS_TOKENS(scalar)
    return sq;
}

#if KV_X86
KV_AVX512 static double loss_range_avx512(LOSS_RANGE_PARAMS) {
    uint8_t pt_buf[FP8_RECORD], m1_buf[M1_RECORD];
    double sq = 0.0;
    loss_vec v;
    v.amax = v.nope = v.rope = v.amax_code = _mm512_setzero_si512();
    v.unequal = v.flushed = v.saturated = 0;
    loss_vec *acc_of_avx512 = &v;
    LOSS_TOKENS(avx512)
    loss_vec_fold(&v, a, acc);
    return sq;
}
#endif
#undef LOSS_TOKENS
#undef LOSS_TOKEN

static void loss_run(Py_ssize_t c0, Py_ssize_t c1, const uint8_t *pt_pool, const geom_t *pg, const uint8_t *m1_pool,
                     const geom_t *mg, Py_ssize_t n, const loss_params *a, int tensor_is_src, int per_tensor,
                     uint32_t *maxima, double *sums, int64_t *counts, int isa) {
    for (Py_ssize_t c = c0; c < c1; c++) {
        Py_ssize_t t0 = c * CHUNK_TOKENS, t1 = t0 + CHUNK_TOKENS < n ? t0 + CHUNK_TOKENS : n;
        loss_acc acc = {0, 0, 0, 0, 0, 0};
        double sq;
#if KV_X86
        if (isa == ISA_AVX512)
            sq = loss_range_avx512(t0, t1, pt_pool, pg, m1_pool, mg, a, tensor_is_src, per_tensor, &acc);
        else
#endif
            sq = loss_range_scalar(t0, t1, pt_pool, pg, m1_pool, mg, a, tensor_is_src, per_tensor, &acc);
        maxima[4 * c] = acc.amax;
        maxima[4 * c + 1] = max_u32(acc.nope, acc.rope);
        maxima[4 * c + 2] = acc.nope;
        maxima[4 * c + 3] = acc.rope;
        sums[c] = sq;
        counts[3 * c] = acc.unequal;
        counts[3 * c + 1] = acc.flushed;
        counts[3 * c + 2] = acc.saturated;
    }
}

/* Both entry points take native_loss's accelerator arguments: (c0, c1, src, sp, spb, ssplit, srb, s_in, dst, dp,
 * dpb, dsplit, drb, s_out, n, per_tensor, mult, ue8m0, maxima, sums, counts). */
static PyObject *loss_entry(PyObject *args, int tensor_is_src) {
    Py_ssize_t c0, c1, n;
    geom_t s, d;
    float s_in, s_out, mult;
    int per_tensor;
    Py_buffer v[6];
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "nny*nnnnfy*nnnnfnpfy*w*w*w*", &c0, &c1, &v[0], &s.pages, &s.page_bytes, &s.split,
                          &s.record_bytes, &s_in, &v[1], &d.pages, &d.page_bytes, &d.split, &d.record_bytes, &s_out,
                          &n, &per_tensor, &mult, &v[2], &v[3], &v[4], &v[5]))
        return NULL;
    const geom_t *pg = tensor_is_src ? &s : &d, *mg = tensor_is_src ? &d : &s;
    Py_buffer *pt = tensor_is_src ? &v[0] : &v[1], *m1 = tensor_is_src ? &v[1] : &v[0];
    int ok = need(n >= 0, "negative token count") &&
             check_geom(pg, pt->len, FP8_RECORD, npages_of(n, pg->pages), tensor_is_src ? "source" : "destination") &&
             check_geom(mg, m1->len, M1_RECORD, npages_of(n, mg->pages), tensor_is_src ? "destination" : "source") &&
             need(c0 >= 0 && c1 >= c0 && c1 <= npages_of(n, CHUNK_TOKENS), "chunk range out of bounds") &&
             need(v[2].len >= 256 * 4, "short ue8m0 table") &&
             need(v[3].len >= c1 * 16 && v[4].len >= c1 * 8 && v[5].len >= c1 * 24, "short maxima/sums/counts");
    if (ok) {
        loss_params a = {tensor_is_src ? s_in : s_out, fabsf(mult), v[2].buf, 0x7F, {0}};
        if (per_tensor && tensor_is_src)
            a.pt_sat_from = sat_from(a.s_pt, mult);
        for (int b = 0; per_tensor && !tensor_is_src && b < 256; b++)
            a.m1_sat_from[b] = sat_from(a.ue8m0[b], mult);
        int isa = isfinite(a.s_pt) ? kv_isa : ISA_SCALAR; /* the vector code takes a finite scale */
        Py_BEGIN_ALLOW_THREADS
        loss_run(c0, c1, pt->buf, pg, m1->buf, mg, n, &a, tensor_is_src, per_tensor, v[3].buf, v[4].buf, v[5].buf,
                 isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 6);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* Span copies (native.move_spans)                                                              */
/* ------------------------------------------------------------------------------------------- */

#if KV_X86
/* n bytes src -> dst with non-temporal 64-byte stores from dst's first 64-byte boundary (the head and the tail
 * through memcpy): a move larger than the caches then writes each destination line once, without reading it. */
KV_AVX512 static void copy_streaming(uint8_t *dst, const uint8_t *src, Py_ssize_t n) {
    Py_ssize_t head = (Py_ssize_t)(-(uintptr_t)dst & 63);
    if (head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    Py_ssize_t i = head;
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((__m512i *)(dst + i), _mm512_loadu_si512(src + i));
    memcpy(dst + i, src + i, n - i);
}
#endif

static inline void copy_bytes(uint8_t *dst, const uint8_t *src, Py_ssize_t n, int streaming) {
#if KV_X86
    if (streaming) {
        copy_streaming(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* move_runs(c0, c1, runs, streaming): for runs [c0, c1) of the int64 rows (source address, destination address,
 * rows, source stride, destination stride, width) of `runs`, copy `rows` rows of `width` bytes, the strides apart
 * (one span when both strides are the width); streaming (AVX-512 only): non-temporal stores. The addresses are the
 * caller's, checked against its buffers (native.move_spans): this entry point only sees integers. */
static PyObject *py_move_runs(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1;
    int streaming;
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "nny*p", &c0, &c1, &v, &streaming))
        return NULL;
    const int64_t *runs = v.buf;
    int ok = need(v.len % 48 == 0 && c0 >= 0 && c1 >= c0 && c1 <= v.len / 48, "run range out of bounds");
    for (Py_ssize_t k = c0; ok && k < c1; k++) {
        const int64_t *r = runs + 6 * k;
        ok = need(r[2] >= 0 && r[5] >= 0 && r[3] >= r[5] && r[4] >= r[5], "bad rows, width or strides");
    }
    if (ok) {
        int nt = streaming && kv_isa == ISA_AVX512;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = c0; k < c1; k++) {
            const int64_t *r = runs + 6 * k;
            const uint8_t *src = (const uint8_t *)(uintptr_t)r[0];
            uint8_t *dst = (uint8_t *)(uintptr_t)r[1];
            int64_t rows = r[2], src_stride = r[3], dst_stride = r[4], width = r[5];
            if (src_stride == width && dst_stride == width)
                copy_bytes(dst, src, rows * width, nt);
            else
                for (int64_t i = 0; i < rows; i++)
                    copy_bytes(dst + i * dst_stride, src + i * src_stride, width, nt);
        }
        if (nt)
            store_fence();
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* Chunk checksums (native.xxh3_chunks)                                                          */
/* ------------------------------------------------------------------------------------------- */

/* xxh3_chunks(data, spans, out): out[k] = XXH3-64 (seed 0) of data's bytes [spans[2k], spans[2k + 1]) for n int64
 * (start, stop) pairs inside data and n uint64 slots of out; one call for all of a batch's chunks, with the GIL
 * released. */
static PyObject *py_xxh3_chunks(PyObject *self, PyObject *args) {
    Py_buffer views[3];
    if (!PyArg_ParseTuple(args, "y*y*w*", &views[0], &views[1], &views[2]))
        return NULL;
    const uint8_t *data = views[0].buf;
    const int64_t *spans = views[1].buf;
    uint64_t *out = views[2].buf;
    Py_ssize_t n = views[1].len / 16;
    int ok = need(views[1].len % 16 == 0 && views[2].len == n * 8, "spans and out sizes disagree");
    for (Py_ssize_t k = 0; ok && k < n; k++)
        ok = need(spans[2 * k] >= 0 && spans[2 * k] <= spans[2 * k + 1] && spans[2 * k + 1] <= views[0].len,
                  "a chunk's span is reversed or outside the data");
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n; k++)
            out[k] = XXH3_64bits(data + spans[2 * k], (size_t)(spans[2 * k + 1] - spans[2 * k]));
        Py_END_ALLOW_THREADS
    }
    release(views, 3);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* fp4 -> fp8 indexer keys (native.keys._fp4_to_fp8_keys_kernel)                                */
/* ------------------------------------------------------------------------------------------- */

/* Byte-identical to the numba kernel on every input (NaN/Inf scales included): the same fp32 operations in the same
 * order, numba's max(a, b) (b > a ? b : a, so a NaN never wins), its wrap-around of index -1, and, where the numba
 * kernel takes its word path (`words`: both code arrays 8-byte aligned, dim % 16 == 0), that path's bytes and its
 * skipped error measurement. The portable code runs that word arithmetic itself (word_block). The AVX2 code uses
 * the 16-entry table it equals byte for byte while base + 28 fits a byte (d <= 22: lut[a] = a ? base + 4a - 4 (a ==
 * 1) : 0, sign bit 7), and the word arithmetic beyond (only a NaN scale byte or an all-zero block gets there),
 * carries between bytes and all. */

#define KEY_E_MIN (-22)
#define KEY_E_MAX 127
#define KEY_E_SPAN (KEY_E_MAX - KEY_E_MIN + 1)
#define KEY_MAX_BLOCKS 64 /* dim <= 2048 */

typedef struct {
    const uint8_t *sd, *ss;
    uint8_t *dd, *ds;
    const int64_t *segs;
    int64_t sds, sss, dds, dss;
    int dim, rule, words, measure;
    float floor;
    const float *e2m1, *ue8m0, *e4m3;
    const uint8_t *pow2_codes; /* [256][KEY_E_SPAN][16]: native.keys._pow2_key_codes */
    float *err;
    int64_t *bad;
} key_args;

/* native.records._e4m3_code: E4M3 code of the non-negative fp32 bit pattern b (RNE, saturating at 448). */
static inline int64_t e4m3_code_bits(int64_t b) {
    if (b >= 0x43E00000)
        return 0x7E;
    if (b >= 0x3C800000)
        return ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960;
    int64_t e = b >> 23;
    if (e == 0)
        return 0;
    int64_t mant = (b & 0x7FFFFF) | 0x800000, shift = 14 - (e - 127);
    if (shift > 40)
        return 0;
    int64_t q = mant >> shift, rem = mant - (q << shift), half = (int64_t)1 << (shift - 1);
    if (rem > half || (rem == half && (q & 1) == 1))
        q += 1;
    return q;
}

/* native.keys._key_code: the E4M3 code of fp32(value * mult), sign included. */
static inline uint8_t key_code(float value, float mult) {
    int64_t b = (int64_t)f32_bits(value * mult);
    return (uint8_t)(e4m3_code_bits(b & 0x7FFFFFFF) | ((b >> 24) & 0x80));
}

/* native.keys._key_code_unbounded. */
static inline int64_t key_code_unbounded(float y) {
    int64_t b = (int64_t)f32_bits(y);
    return ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960;
}

#define KB01 0x0101010101010101ull
#define KB07 0x0707070707070707ull
#define KB08 0x0808080808080808ull
#define KB7F 0x7F7F7F7F7F7F7F7Full
#define KB80 0x8080808080808080ull

/* native.keys._even_bytes and _fp4_word_codes, verbatim (uint64 arithmetic wraps in both). */
static inline uint64_t even_bytes(uint64_t y) {
    uint64_t u = (y | (y << 16)) & 0x0000FFFF0000FFFFull;
    return (u | (u << 8)) & 0x00FF00FF00FF00FFull;
}

static inline uint64_t fp4_word_codes(uint64_t y, uint64_t base) {
    uint64_t nib = even_bytes(y & 0x0F0F0F0Full) | (even_bytes((y >> 4) & 0x0F0F0F0Full) << 8);
    uint64_t a = nib & KB07;
    uint64_t nonzero = ((a + KB7F) & KB80) >> 7;
    uint64_t one = ((((a ^ KB01) + KB7F) & KB80) >> 7) ^ KB01;
    uint64_t codes = base + (a << 2) - (one << 2);
    return (codes & ((nonzero << 8) - nonzero)) | ((nib & KB08) << 4);
}

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Largest E2M1 magnitude (0..7) of the 32 codes in 16 bytes. */
static inline int block_magnitude(const uint8_t *p) {
    uint8_t m = 0;
    for (int i = 0; i < 16; i++) {
        uint8_t lo = p[i] & 7, hi = (p[i] >> 4) & 7;
        m = lo > m ? lo : m;
        m = hi > m ? hi : m;
    }
    return m;
}

/* 16 code bytes -> 32 fp8 bytes through the block's table: low nibble first. */
static inline void apply_lut(const uint8_t *src, uint8_t *dst, const uint8_t *lut) {
    for (int i = 0; i < 16; i++) {
        dst[2 * i] = lut[src[i] & 15];
        dst[2 * i + 1] = lut[src[i] >> 4];
    }
}

/* A key's scale, multiplier and code tables, from its amax (numba's order of fp32 operations). */
typedef struct {
    int64_t e, k1, k15, m1;
    float scale, mult;
    int tabled, shifted;
} key_rule_t;

static inline void key_rule(const key_args *a, float amax, Py_ssize_t chunk, key_rule_t *k) {
    const float *ue8m0 = a->ue8m0;
    k->e = k->k1 = k->k15 = k->m1 = 0;
    if (a->rule <= 1) { /* vllm, vllm-ue8m0: 2^ceil(log2(max(amax, 1e-4) / 448)) */
        float x = a->floor > amax ? a->floor : amax;
        uint32_t q = f32_bits(x * (float)(1.0 / 448.0)) & 0x7FFFFFFFu;
        k->e = (int64_t)(q >> 23) - 127 + ((q & 0x7FFFFFu) != 0);
        int64_t down = 127 - k->e;
        k->scale = ue8m0[k->e + 127];
        k->mult = ue8m0[down < 0 ? down + 256 : down]; /* numba wraps index -1 (e = 128: an Inf amax) */
    } else if (a->rule == 2) { /* sglang, deepgemm, sglang-rocm: max(amax, floor) / 448 */
        float x = a->floor > amax ? a->floor : amax;
        k->scale = x / 448.0f;
        k->mult = 1.0f / k->scale;
    } else { /* trtllm: amax / 448, multiplier 448 / amax (0 for an all-zero key) */
        k->scale = amax / 448.0f;
        k->mult = amax > 0 ? 448.0f / amax : 0.0f;
        if (!finite_f32(k->mult)) /* amax < 448 / fp32 max: the torch path's product overflows */
            a->bad[chunk] = 1;
    }
    k->tabled = a->rule <= 1 && k->e >= KEY_E_MIN && k->e <= KEY_E_MAX;
    k->shifted = a->rule >= 2 && finite_f32(k->mult) && k->mult >= FLT_MIN; /* 2^-126 */
    if (k->shifted) { /* C_1, C_1.5 (native.keys._fp4_to_fp8_keys_kernel's docstring) */
        k->k1 = key_code_unbounded(k->mult);
        k->k15 = key_code_unbounded(1.5f * k->mult);
        k->m1 = (int64_t)f32_bits(k->mult);
    }
}

/* Shifted codes apply to a block of scale byte b: 0.5 * 2^k * mult >= 2^-6 (E4M3-normal). */
static inline int shifted_block(const key_rule_t *k, int64_t b) {
    return k->shifted && k->m1 + (b - 128) * ((int64_t)1 << 23) >= 0x3C800000;
}

/* The 16-entry table of a block of scale byte b outside the word path. */
static inline void block_lut(const key_args *a, const key_rule_t *k, int64_t b, uint8_t *lut) {
    if (k->tabled) {
        memcpy(lut, a->pow2_codes + ((size_t)b * KEY_E_SPAN + (size_t)(k->e - KEY_E_MIN)) * 16, 16);
    } else if (shifted_block(k, b)) { /* codes step by 8 per binade */
        static const int from15[8] = {0, 0, 0, 1, 0, 1, 0, 1};
        static const int step[8] = {0, -8, 0, 0, 8, 8, 16, 16};
        int64_t b8 = 8 * (b - 127);
        lut[0] = 0, lut[8] = 0x80;
        for (int c = 1; c < 8; c++) {
            int64_t v = (from15[c] ? k->k15 : k->k1) + step[c] + b8;
            v = v < 0x7E ? v : 0x7E;
            lut[c] = (uint8_t)v;
            lut[c + 8] = (uint8_t)(v | 0x80);
        }
    } else {
        float s = a->ue8m0[b];
        for (int c = 0; c < 16; c++)
            lut[c] = key_code(a->e2m1[c] * s, k->mult);
    }
}

/* The word path (native.keys: a block whose values stay normal in E4M3, d = b - 127 - e >= -5), 16 codes a word. */
static inline void word_block(const uint8_t *in, uint8_t *o, int64_t d) {
    uint64_t base = (uint64_t)(8 * (d + 6)) * KB01;
    for (int h = 0; h < 2; h++) {
        uint64_t x = load_u64(in + 8 * h);
        uint64_t w0 = fp4_word_codes(x & 0xFFFFFFFFull, base), w1 = fp4_word_codes(x >> 32, base);
        memcpy(o + 16 * h, &w0, 8);
        memcpy(o + 16 * h + 8, &w1, 8);
    }
}

/* worst = max(worst, |decoded fp8 - decoded fp4|) over the magnitudes present in the block. */
static inline float block_error(const key_args *a, const key_rule_t *k, const uint8_t *in, const uint8_t *lut, float s,
                                float worst) {
    unsigned present = 0;
    for (int i = 0; i < 16; i++)
        present |= (1u << (in[i] & 15)) | (1u << (in[i] >> 4));
    present |= present >> 8; /* a negative code's error is its magnitude's (both codes are symmetric) */
    for (int c = 1; c < 8; c++) { /* codes 0 and 8 (+-0) are exact */
        if (present & (1u << c)) {
            float x = fabsf(a->e4m3[lut[c]] * k->scale - a->e2m1[c] * s);
            worst = x > worst ? x : worst;
        }
    }
    return worst;
}

static inline void key_scale_bytes(const key_args *a, const key_rule_t *k, uint8_t *out_scale) {
    if (a->rule == 1) {
        memset(out_scale, (int)(uint8_t)(k->e + 127), 4);
    } else {
        uint32_t sb = f32_bits(k->scale);
        for (int i = 0; i < 4; i++)
            out_scale[i] = (uint8_t)(sb >> (8 * i));
    }
}

/* One key, portable C; returns the chunk's updated worst error. */
KV_BODY float key_scalar(const key_args *a, const uint8_t *src, const uint8_t *sc, uint8_t *dst,
                         uint8_t *out_scale, Py_ssize_t chunk, float worst) {
    const int blocks = a->dim / 32;
    float amax = 0.0f;
    for (int j = 0; j < blocks; j++) {
        float v = a->e2m1[block_magnitude(src + 16 * j)] * a->ue8m0[sc[j]];
        if (!finite_f32(v)) /* scale byte 0xFF (NaN) or 6 * 2^127 (Inf) */
            a->bad[chunk] = 1;
        amax = v > amax ? v : amax;
    }
    key_rule_t k;
    key_rule(a, amax, chunk, &k);
    uint8_t lut[16];
    for (int j = 0; j < blocks; j++) {
        const uint8_t *in = src + 16 * j;
        uint8_t *o = dst + 32 * j;
        int64_t b = sc[j], d = b - 127 - k.e;
        if (a->words && k.tabled && d >= -5) { /* exact: no error measured */
            word_block(in, o, d);
            continue;
        }
        block_lut(a, &k, b, lut);
        apply_lut(in, o, lut);
        if (a->measure)
            worst = block_error(a, &k, in, lut, a->ue8m0[b], worst);
    }
    key_scale_bytes(a, &k, out_scale);
    return worst;
}

#if KV_X86
#define KV_AVX2 __attribute__((target("avx2")))

/* The 16 codes' low and high nibbles (as bytes), and the largest magnitude (0..7) among them. */
KV_AVX2 static inline int block_nibbles_avx2(const uint8_t *p, __m128i *lo, __m128i *hi) {
    __m128i x = _mm_loadu_si128((const __m128i *)p), f = _mm_set1_epi8(0x0F), seven = _mm_set1_epi8(7);
    *lo = _mm_and_si128(x, f);
    *hi = _mm_and_si128(_mm_srli_epi16(x, 4), f);
    __m128i m = _mm_max_epu8(_mm_and_si128(*lo, seven), _mm_and_si128(*hi, seven));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 8));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 4));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 2));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 1));
    return _mm_cvtsi128_si32(m) & 0xFF;
}

/* 32 fp8 bytes of a block through its table (vpshufb: a 16-entry byte lookup), low nibble first. */
KV_AVX2 static inline void apply_lut_avx2(__m128i lo, __m128i hi, __m128i lut, uint8_t *o) {
    __m128i l = _mm_shuffle_epi8(lut, lo), h = _mm_shuffle_epi8(lut, hi);
    _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi8(l, h));
    _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi8(l, h));
}

/* One key (key_scalar's bytes): vpshufb lookups, the word and shifted tables built in vector registers. */
KV_AVX2 KV_BODY float key_avx2(const key_args *a, const uint8_t *src, const uint8_t *sc, uint8_t *dst,
                               uint8_t *out_scale, Py_ssize_t chunk, float worst) {
    const int blocks = a->dim / 32;
    __m128i lo[KEY_MAX_BLOCKS], hi[KEY_MAX_BLOCKS];
    float amax = 0.0f;
    for (int j = 0; j < blocks; j++) {
        float v = a->e2m1[block_nibbles_avx2(src + 16 * j, &lo[j], &hi[j])] * a->ue8m0[sc[j]];
        if (!finite_f32(v))
            a->bad[chunk] = 1;
        amax = v > amax ? v : amax;
    }
    key_rule_t k;
    key_rule(a, amax, chunk, &k);
    /* the word path's codes as a table (d <= 22, see the section comment): lut[a] = a ? base + word_add[a] : 0, sign
     * bit 7 for codes 8..15, base = 8 (d + 6) */
    const __m128i word_add = _mm_setr_epi8(0, 0, 8, 12, 16, 20, 24, 28, 0, 0, 8, 12, 16, 20, 24, 28);
    const __m128i nonzero = _mm_setr_epi8(0, -1, -1, -1, -1, -1, -1, -1, 0, -1, -1, -1, -1, -1, -1, -1);
    const __m128i sign = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, -128, -128, -128, -128, -128, -128, -128, -128);
    /* block_lut's shifted codes: int16 lanes c = 0..7 of C_c (lane 0 unused), + 8 (b - 127), min 0x7E */
    __m128i shifted_codes = _mm_setzero_si128();
    if (k.shifted)
        shifted_codes = _mm_setr_epi16(0, (short)(k.k1 - 8), (short)k.k1, (short)k.k15, (short)(k.k1 + 8),
                                       (short)(k.k15 + 8), (short)(k.k1 + 16), (short)(k.k15 + 16));
    uint8_t lut_bytes[16];
    for (int j = 0; j < blocks; j++) {
        uint8_t *o = dst + 32 * j;
        int64_t b = sc[j], d = b - 127 - k.e;
        __m128i lut;
        if (a->words && k.tabled && d >= -5) {
            if (d > 22) {
                word_block(src + 16 * j, o, d);
                continue;
            }
            lut = _mm_or_si128(_mm_add_epi8(word_add, _mm_and_si128(_mm_set1_epi8((char)(8 * (d + 6))), nonzero)),
                               sign);
            apply_lut_avx2(lo[j], hi[j], lut, o);
            continue;
        }
        if (k.tabled) {
            lut = _mm_loadu_si128(
                (const __m128i *)(a->pow2_codes + ((size_t)b * KEY_E_SPAN + (size_t)(k.e - KEY_E_MIN)) * 16));
        } else if (shifted_block(&k, b) && k.k15 + 16 + 8 * (b - 127) < 32767 && k.k1 - 8 + 8 * (b - 127) > -32768) {
            /* every lane in [8, 0x7E] after the min (the block's smallest value is E4M3-normal) */
            __m128i v = _mm_min_epi16(_mm_add_epi16(shifted_codes, _mm_set1_epi16((short)(8 * (b - 127)))),
                                      _mm_set1_epi16(0x7E));
            lut = _mm_or_si128(_mm_and_si128(_mm_packus_epi16(v, v), nonzero), sign);
        } else {
            block_lut(a, &k, b, lut_bytes);
            lut = _mm_loadu_si128((const __m128i *)lut_bytes);
        }
        apply_lut_avx2(lo[j], hi[j], lut, o);
        if (a->measure) {
            _mm_storeu_si128((__m128i *)lut_bytes, lut);
            worst = block_error(a, &k, src + 16 * j, lut_bytes, a->ue8m0[b], worst);
        }
    }
    key_scale_bytes(a, &k, out_scale);
    return worst;
}
#endif

/* The chunk loop over a local copy of the arguments (the key functions inlined: no byte store can alias them). */
#define KEYS_CHUNKS(key)                                                                                    \
    key_args local = *args;                                                                                 \
    const key_args *a = &local;                                                                             \
    for (Py_ssize_t chunk = c0; chunk < c1; chunk++) {                                                      \
        const int64_t *sg = a->segs + 5 * chunk;                                                            \
        const int64_t count = sg[4];                                                                        \
        const uint8_t *sd = a->sd + sg[0], *ss = a->ss + sg[1];                                             \
        uint8_t *dd = a->dd + sg[2], *ds = a->ds + sg[3];                                                   \
        float worst = 0.0f;                                                                                 \
        for (int64_t r = 0; r < count; r++)                                                                 \
            worst = key(a, sd + r * a->sds, ss + r * a->sss, dd + r * a->dds, ds + r * a->dss, chunk, worst); \
        args->err[chunk] = worst;                                                                           \
    }

static void fp4_keys_scalar(const key_args *args, Py_ssize_t c0, Py_ssize_t c1) { KEYS_CHUNKS(key_scalar) }

#if KV_X86
KV_AVX2 static void fp4_keys_avx2(const key_args *args, Py_ssize_t c0, Py_ssize_t c1) { KEYS_CHUNKS(key_avx2) }
#endif
#undef KEYS_CHUNKS

enum { KEY_ISA_SCALAR = 0, KEY_ISA_AVX2 = 1 };
static int key_isa = KEY_ISA_SCALAR, key_cpu_isa = KEY_ISA_SCALAR; /* in use; best the CPU supports */

static void fp4_keys_chunks(const key_args *a, Py_ssize_t c0, Py_ssize_t c1, int isa) {
#if KV_X86
    if (isa == KEY_ISA_AVX2) {
        fp4_keys_avx2(a, c0, c1);
        return;
    }
#endif
    fp4_keys_scalar(a, c0, c1);
}

static const char *key_isa_name(int isa) { return isa == KEY_ISA_AVX2 ? "avx2" : "scalar"; }

static PyObject *py_key_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(key_isa_name(key_isa)); }

static PyObject *py_key_cpu_isa(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(key_isa_name(key_cpu_isa));
}

static PyObject *py_set_key_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    int want = strcmp(name, "scalar") == 0 ? KEY_ISA_SCALAR : strcmp(name, "avx2") == 0 ? KEY_ISA_AVX2 : -1;
    if (want < 0 || want > key_cpu_isa) {
        PyErr_Format(PyExc_ValueError, "kvbridge.backends.native._kernels: key ISA %R not available (this CPU: %s)",
                     arg, key_isa_name(key_cpu_isa));
        return NULL;
    }
    PyObject *previous = PyUnicode_FromString(key_isa_name(key_isa));
    key_isa = want;
    return previous;
}

/* Rows [off, off + (count - 1) * stride + width) inside a buffer of len bytes. */
static int rows_fit(int64_t off, int64_t count, int64_t stride, int64_t width, Py_ssize_t len) {
    if (off < 0 || count < 0 || stride < 0)
        return 0;
    if (count == 0)
        return 1;
    if (off > len || width > len - off)
        return 0;
    return count == 1 || stride == 0 || count - 1 <= (len - off - width) / stride;
}

/* fp4_to_fp8_keys(c0, c1, sd, ss, dd, ds, segs, sds, sss, dds, dss, dim, rule, floor, e2m1, ue8m0, e4m3, pow2_codes,
 * words, measure, err, bad): native.keys._fp4_to_fp8_keys_kernel's arguments (less sd64/dd64: `words` alone says
 * which path the numba kernel would take); every segment of [c0, c1) is checked against the four buffers first. */
static PyObject *py_fp4_to_fp8_keys(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1;
    key_args a;
    Py_buffer v[11];
    memset(v, 0, sizeof v);
    long long sds, sss, dds, dss;
    if (!PyArg_ParseTuple(args, "nny*y*w*w*y*LLLLiify*y*y*y*ppw*w*", &c0, &c1, &v[0], &v[1], &v[2], &v[3], &v[4],
                          &sds, &sss, &dds, &dss, &a.dim, &a.rule, &a.floor, &v[5], &v[6], &v[7], &v[8], &a.words,
                          &a.measure, &v[9], &v[10]))
        return NULL;
    Py_ssize_t nseg = v[4].len / 40;
    int ok = need(a.dim > 0 && a.dim % 32 == 0 && a.dim / 32 <= KEY_MAX_BLOCKS, "key dim must be 32k, <= 2048") &&
             need(a.rule >= 0 && a.rule <= 3, "bad key rule") &&
             need(v[4].len % 40 == 0 && c0 >= 0 && c1 >= c0 && c1 <= nseg, "segment range out of bounds") &&
             need(v[5].len >= 16 * 4 && v[6].len >= 256 * 4 && v[7].len >= 256 * 4 &&
                      v[8].len >= 256 * KEY_E_SPAN * 16, "short table") &&
             need(v[9].len >= c1 * 4 && v[10].len >= c1 * 8, "short err/bad");
    const int64_t *segs = v[4].buf;
    for (Py_ssize_t k = c0; ok && k < c1; k++) {
        const int64_t *sg = segs + 5 * k;
        ok = need(rows_fit(sg[0], sg[4], sds, a.dim / 2, v[0].len) && rows_fit(sg[1], sg[4], sss, a.dim / 32, v[1].len) &&
                      rows_fit(sg[2], sg[4], dds, a.dim, v[2].len) && rows_fit(sg[3], sg[4], dss, 4, v[3].len),
                  "key segment out of bounds");
    }
    if (ok) {
        a.sd = v[0].buf, a.ss = v[1].buf, a.dd = v[2].buf, a.ds = v[3].buf, a.segs = segs;
        a.sds = sds, a.sss = sss, a.dds = dds, a.dss = dss;
        a.e2m1 = v[5].buf, a.ue8m0 = v[6].buf, a.e4m3 = v[7].buf, a.pow2_codes = v[8].buf;
        a.err = v[9].buf, a.bad = v[10].buf;
        int isa = key_isa;
        Py_BEGIN_ALLOW_THREADS
        fp4_keys_chunks(&a, c0, c1, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 11);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* Every segment of [c0, c1) inside its four streams (widths: sdw, sfw, ddw, dfw bytes a row; a destination row
 * stride at least its width), the segment table and the outputs long enough. */
static int check_segments(Py_ssize_t c0, Py_ssize_t c1, const Py_buffer *v, const seg_args *a, int64_t sdw,
                          int64_t sfw, int64_t ddw, int64_t dfw, Py_ssize_t bad_len, Py_ssize_t first_len) {
    Py_ssize_t nseg = v[4].len / 48;
    int ok = need(v[4].len % 48 == 0 && c0 >= 0 && c1 >= c0 && c1 <= nseg, "segment range out of bounds") &&
             need(a->dds >= ddw && a->dfs >= dfw, "destination rows overlap") &&
             need(bad_len >= c1 * 8 && first_len >= c1 * 8, "short bad_count/bad_first");
    for (Py_ssize_t k = c0; ok && k < c1; k++) {
        const int64_t *sg = a->segs + 6 * k;
        ok = need(rows_fit(sg[0], sg[4], a->sds, sdw, v[0].len) && rows_fit(sg[1], sg[4], a->sfs, sfw, v[1].len) &&
                      rows_fit(sg[2], sg[4], a->dds, ddw, v[2].len) && rows_fit(sg[3], sg[4], a->dfs, dfw, v[3].len) &&
                      sg[5] >= 0,
                  "KV segment out of bounds");
    }
    return ok;
}

/* fp8_to_model1_segments(c0, c1, sd, sf, dd, df, segs, sds, sfs, dds, dfs, nt, scale_lut, bad_mag, code_lut,
 * rope_lut, bad_count, bad_first): fp8_to_model1's tables, the rows of seg_args. */
static PyObject *py_fp8_to_model1_segments(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1;
    seg_args a;
    Py_buffer v[11];
    memset(v, 0, sizeof v);
    long long sds, sfs, dds, dfs;
    if (!PyArg_ParseTuple(args, "nny*y*w*w*y*LLLLpy*y*y*y*w*w*", &c0, &c1, &v[0], &v[1], &v[2], &v[3], &v[4], &sds,
                          &sfs, &dds, &dfs, &a.nt, &v[5], &v[6], &v[7], &v[8], &v[9], &v[10]))
        return NULL;
    a.sd = v[0].buf, a.sf = v[1].buf, a.dd = v[2].buf, a.df = v[3].buf, a.segs = v[4].buf;
    a.sds = sds, a.sfs = sfs, a.dds = dds, a.dfs = dfs;
    int ok = check_segments(c0, c1, v, &a, FP8_RECORD, 0, M1_DATA, M1_RECORD - M1_DATA, v[9].len, v[10].len) &&
             need(v[5].len >= 128 && v[6].len >= 128 && v[7].len >= 128 * 256 && v[8].len >= 512, "short table");
    if (ok) {
        f2m_tables tb = {v[5].buf, v[6].buf, v[7].buf, v[8].buf};
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        fp8_to_model1_segments_run(c0, c1, &a, &tb, v[9].buf, v[10].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 11);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* model1_to_fp8_segments(c0, c1, sd, sf, dd, df, segs, sds, sfs, dds, dfs, nt, nope_lut, bad_mag, rope_lut,
 * bad_count, bad_first, mult): model1_to_fp8's tables and multiplier, the rows of seg_args. */
static PyObject *py_model1_to_fp8_segments(PyObject *self, PyObject *args) {
    Py_ssize_t c0, c1;
    seg_args a;
    Py_buffer v[10];
    memset(v, 0, sizeof v);
    long long sds, sfs, dds, dfs;
    float mult;
    if (!PyArg_ParseTuple(args, "nny*y*w*w*y*LLLLpy*y*y*w*w*f", &c0, &c1, &v[0], &v[1], &v[2], &v[3], &v[4], &sds,
                          &sfs, &dds, &dfs, &a.nt, &v[5], &v[6], &v[7], &v[8], &v[9], &mult))
        return NULL;
    a.sd = v[0].buf, a.sf = v[1].buf, a.dd = v[2].buf, a.df = v[3].buf, a.segs = v[4].buf;
    a.sds = sds, a.sfs = sfs, a.dds = dds, a.dfs = dfs;
    int ok = check_segments(c0, c1, v, &a, M1_DATA, M1_RECORD - M1_DATA, FP8_RECORD, 0, v[8].len, v[9].len) &&
             need(v[5].len >= 256 * 256 && v[6].len >= 256 * 128 && v[7].len >= 65536, "short table");
    if (ok) {
        m2f_tables tb = {v[5].buf, v[6].buf, v[7].buf, mult};
        int isa = kv_isa;
        Py_BEGIN_ALLOW_THREADS
        model1_to_fp8_segments_run(c0, c1, &a, &tb, v[8].buf, v[9].buf, isa);
        Py_END_ALLOW_THREADS
    }
    release(v, 10);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_fp8_model1_loss(PyObject *self, PyObject *args) { return loss_entry(args, 1); }

static PyObject *py_model1_fp8_loss(PyObject *self, PyObject *args) { return loss_entry(args, 0); }

static PyMethodDef methods[] = {
    {"fp8_to_model1", py_fp8_to_model1, METH_VARARGS,
     "fp8_to_model1(c0, c1, src, sp, spb, ssplit, srb, n, dst, dp, dpb, dsplit, drb, scale_lut, bad_mag, code_lut, "
     "rope_lut, bad_count, bad_first): per-tensor E4M3 -> MODEL1 chunks [c0, c1)."},
    {"model1_to_fp8", py_model1_to_fp8, METH_VARARGS,
     "model1_to_fp8(c0, c1, src, sp, spb, ssplit, srb, n, dst, dp, dpb, dsplit, drb, nope_lut, bad_mag, rope_lut, "
     "bad_count, bad_first, mult): MODEL1 -> per-tensor E4M3 chunks [c0, c1) (mult: the tables' multiplier)."},
    {"model1_encode", py_model1_encode, METH_VARARGS,
     "model1_encode(c0, c1, x32, x16, from_bf16, n, dst, dp, dpb, dsplit, drb, min_exp, pow2): latents -> MODEL1."},
    {"model1_decode", py_model1_decode, METH_VARARGS,
     "model1_decode(c0, c1, src, sp, spb, ssplit, srb, n, out, ue8m0): MODEL1 -> fp32 latents."},
    {"model1_amax", py_model1_amax, METH_VARARGS,
     "model1_amax(c0, c1, src, sp, spb, ssplit, srb, n, amax, bad): per chunk of CHUNK_TOKENS MODEL1 tokens, the "
     "largest |decoded value| (fp32) and 1 where a value decodes to NaN/Inf."},
    {"fp8_amax", py_fp8_amax, METH_VARARGS,
     "fp8_amax(c0, c1, src, sp, spb, ssplit, srb, n, scale, amax, bad): the same for per-tensor E4M3 at scale."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels run: 'avx512vbmi' or 'scalar'."},
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "The best instruction set this CPU supports."},
    {"set_isa", py_set_isa, METH_O, "Run the kernels with the given ISA (at most cpu_isa()); returns the previous."},
    {"set_nt_min", py_set_nt_min, METH_O,
     "Outputs of at least this many bytes get non-temporal stores; returns the previous threshold."},
    {"fp8_model1_loss", py_fp8_model1_loss, METH_VARARGS,
     "fp8_model1_loss(c0, c1, src, sp, spb, ssplit, srb, s_in, dst, dp, dpb, dsplit, drb, s_out, n, per_tensor, mult, "
     "ue8m0, maxima, sums, counts): loss statistics of per-tensor E4M3 -> MODEL1 chunks [c0, c1)."},
    {"model1_fp8_loss", py_model1_fp8_loss, METH_VARARGS,
     "model1_fp8_loss(c0, c1, src, ..., counts): loss statistics of MODEL1 -> per-tensor E4M3 chunks [c0, c1)."},
    {"fp4_to_fp8_keys", py_fp4_to_fp8_keys, METH_VARARGS,
     "fp4_to_fp8_keys(c0, c1, sd, ss, dd, ds, segs, sds, sss, dds, dss, dim, rule, floor, e2m1, ue8m0, e4m3, "
     "pow2_codes, words, measure, err, bad): fp4 -> fp8 indexer keys of segments [c0, c1) (native.keys)."},
    {"key_isa", py_key_isa, METH_NOARGS, "The instruction set fp4_to_fp8_keys runs: 'avx2' or 'scalar'."},
    {"key_cpu_isa", py_key_cpu_isa, METH_NOARGS, "The best instruction set for fp4_to_fp8_keys this CPU supports."},
    {"set_key_isa", py_set_key_isa, METH_O,
     "Run fp4_to_fp8_keys with the given ISA (at most key_cpu_isa()); returns the previous."},
    {"fp8_to_model1_segments", py_fp8_to_model1_segments, METH_VARARGS,
     "fp8_to_model1 between record rows segment by segment (a migration's pages or records, no page geometry)."},
    {"model1_to_fp8_segments", py_model1_to_fp8_segments, METH_VARARGS,
     "model1_to_fp8 between record rows segment by segment (a migration's pages or records, no page geometry)."},
    {"move_runs", py_move_runs, METH_VARARGS,
     "move_runs(c0, c1, runs, streaming): row copies of runs [c0, c1) (int64 rows: source address, destination "
     "address, rows, source stride, destination stride, width)."},
    {"xxh3_chunks", py_xxh3_chunks, METH_VARARGS,
     "xxh3_chunks(data, spans, out): out[k] = XXH3-64 (seed 0) of data[spans[k, 0]:spans[k, 1]] (int64 [n, 2] "
     "spans, uint64 out)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvbridge.backends.native._kernels", "Compiled MODEL1 hot kernels (see kvbridge/backends/native/_kernels.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#if KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vbmi"))
        kv_cpu_isa = ISA_AVX512;
#endif
    kv_isa = kv_cpu_isa;
#if KV_X86
    if (__builtin_cpu_supports("avx2"))
        key_cpu_isa = KEY_ISA_AVX2;
#endif
    key_isa = key_cpu_isa;
#if KV_X86
    if (kv_cpu_isa == ISA_AVX512)
        tree_lanes();
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "CHUNK_TOKENS", CHUNK_TOKENS) < 0 ||
              PyModule_AddIntConstant(m, "INTERFACE", KV_INTERFACE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

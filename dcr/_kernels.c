/*
 * dcr._kernels: the data plane's hot loops in C (optional; dcr.native falls back to numpy).
 *
 * Every function takes buffers (numpy arrays) and plain integers, checks every length and
 * offset against the buffers it was given before it touches memory, and releases the GIL while
 * it runs, so blocks of one model run on several cores from Python threads.  The numpy
 * implementations in dcr.tensors.bits, dcr.wire.split and dcr.apply.writes define the results;
 * tests compare both on every width and edge case.
 *
 *   scan           changed elements of two bit views: positions and XOR / ULP / new values
 *   isa, set_isa   the scan's instruction-set level (portable, AVX2, AVX-512)
 *   split_gaps     Rice split of the gaps between sorted positions (payload format 2)
 *   split_ulp      Rice split of zigzagged ULP deltas, symbols as nibbles (payload format 2)
 *   value_k        the Rice parameter of ULP deltas (dcr.wire.split.value_k, from a sample)
 *   join_locations every item's positions from the location streams (decoding, format 2)
 *   join_values    every ULP item's words from the value streams (zigzagged, or at word width)
 *   rmw            read-modify-write of storage words at positions (XOR, ULP, overwrite)
 *   rmw_mapped     the same, positions mapped from canonical indices through a view geometry
 *   rmw_tasks      chunks of rmw / rmw_mapped from a shared task list, on every calling thread
 *   write_block    a block of a run of entries through a view geometry (memcpy when contiguous)
 *   increasing     whether int64 indices are strictly increasing
 *   copy_at        dst[p] = src[p] at positions (an owner's baseline update at commit)
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define DCR_SSE2 1
#endif

enum { K_XOR = 0, K_ULP = 1, K_NEW = 2, K_XOR_NEW = 3 };
/* Entry encodings: the wire codes of dcr.tensors.records.Encoding. */
enum { E_XOR = 0, E_OVERWRITE = 1, E_ULP = 2 };

/* ------------------------------------------------------------------ word helpers */

static inline uint64_t load_word(const unsigned char *p, int w) {
    switch (w) {
    case 1: return *(const uint8_t *)p;
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static inline void store_word(unsigned char *p, int w, uint64_t v) {
    switch (w) {
    case 1: *(uint8_t *)p = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); break; }
    default: memcpy(p, &v, 8); break;
    }
}

static inline uint64_t width_mask(int w) { return w == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * w)) - 1); }

/* Order-preserving pattern of a w-byte word (dcr.tensors.ordered.ordered): non-negative
 * patterns get the sign bit set, negative ones are inverted. */
static inline uint64_t ordered_word(uint64_t x, int w) {
    const uint64_t sign = (uint64_t)1 << (8 * w - 1);
    const uint64_t neg = (x >> (8 * w - 1)) & 1;  /* branch-free: weight signs are random */
    return x ^ ((sign | ((uint64_t)0 - neg)) & width_mask(w));
}

static inline uint64_t unordered_word(uint64_t y, int w) {
    const uint64_t sign = (uint64_t)1 << (8 * w - 1);
    const uint64_t pos = ((y >> (8 * w - 1)) & 1) ^ 1;
    return y ^ ((sign | ((uint64_t)0 - pos)) & width_mask(w));
}

static inline uint64_t zigzag_word(uint64_t x, int w) {
    unsigned bits = 8 * (unsigned)w;
    uint64_t m = width_mask(w);
    uint64_t neg = (x >> (bits - 1)) & 1;
    return ((x << 1) ^ (neg ? m : 0)) & m;
}

/* ------------------------------------------------------------------ buffer helpers */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* A C-contiguous buffer of `obj`; writable if asked.  Returns 0 and sets an exception on
 * failure. */
static int get_buf(PyObject *obj, Buf *b, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return 0;
    }
    b->held = 1;
    if (b->view.itemsize != 1 && b->view.itemsize != 2 && b->view.itemsize != 4 &&
        b->view.itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "%s has item size %zd (1, 2, 4 or 8 expected)", what,
                     b->view.itemsize);
        release(b);
        return 0;
    }
    return 1;
}

static inline Py_ssize_t count_of(const Buf *b) { return b->view.len / b->view.itemsize; }

static int need_itemsize(const Buf *b, Py_ssize_t size, const char *what) {
    if (b->view.itemsize != size) {
        PyErr_Format(PyExc_ValueError, "%s must have %zd-byte items, has %zd", what, size,
                     b->view.itemsize);
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ scan */

/* Instruction-set level of the scan: 0 portable (SSE2 on x86-64), 1 AVX2, 2 AVX-512 (BW,
 * VBMI2).  Chosen at import from what the CPU and OS support; set_isa() can lower it (tests
 * run every level the machine has). */
static int isa_level = 0;
static int isa_max = 0;

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define DCR_X86_DISPATCH 1
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2,popcnt")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))
#endif

/* The vector scans request both inputs SCAN_AHEAD bytes ahead of the line they compare: the
 * hardware's stream prefetch alone keeps too few lines in flight for one core to read at the
 * memory's rate (on a 2-core Xeon a scan read 12.5 GB/s without and 15.5 GB/s with it, two
 * threads 24.5 and 30 GB/s).  A request past the end of a buffer is harmless. */
#define SCAN_AHEAD 2048
#define SCAN_PREFETCH(A, B)                                                                \
    do {                                                                                   \
        __builtin_prefetch((const char *)(A) + SCAN_AHEAD, 0, 3);                          \
        __builtin_prefetch((const char *)(B) + SCAN_AHEAD, 0, 3);                          \
    } while (0)

/* Bit j of the result is set when byte j of the 64 bytes at a and b differ. */
static inline uint64_t byte_diff_mask(const unsigned char *a, const unsigned char *b) {
#ifdef DCR_SSE2
    uint64_t eq = 0;
    for (int q = 0; q < 4; q++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * q));
        __m128i y = _mm_loadu_si128((const __m128i *)(b + 16 * q));
        eq |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) << (16 * q);
    }
    return ~eq;
#else
    uint64_t m = 0;
    for (int q = 0; q < 8; q++) {
        uint64_t x, y;
        memcpy(&x, a + 8 * q, 8);
        memcpy(&y, b + 8 * q, 8);
        uint64_t d = x ^ y;
        if (!d) continue;
        for (int j = 0; j < 8; j++)
            if ((d >> (8 * j)) & 0xFF) m |= (uint64_t)1 << (8 * q + j);
    }
    return m;
#endif
}

/* Fold a byte mask into one bit per w-byte element (at the element's first byte). */
static inline uint64_t element_mask(uint64_t m, int w) {
    switch (w) {
    case 1: return m;
    case 2: return (m | (m >> 1)) & 0x5555555555555555ULL;
    case 4: m |= m >> 1; m |= m >> 2; return m & 0x1111111111111111ULL;
    default: m |= m >> 1; m |= m >> 2; m |= m >> 4; return m & 0x0101010101010101ULL;
    }
}

static inline void emit(int kind, int w, uint64_t nv, uint64_t ov, unsigned char *o1,
                        unsigned char *o2, Py_ssize_t c) {
    switch (kind) {
    case K_XOR: store_word(o1 + c * w, w, nv ^ ov); break;
    case K_ULP:
        store_word(o1 + c * w, w, (ordered_word(nv, w) - ordered_word(ov, w)) & width_mask(w));
        break;
    case K_NEW: store_word(o1 + c * w, w, nv); break;
    default:
        store_word(o1 + c * w, w, nv ^ ov);
        store_word(o2 + c * w, w, nv);
        break;
    }
}

/* Scalar emission of every set bit of m (element starts of the group at byte i). */
#define EMIT_BITS(W, MASK)                                                                 \
    do {                                                                                   \
        uint64_t m_ = (MASK);                                                              \
        while (m_) {                                                                       \
            unsigned bit = (unsigned)__builtin_ctzll(m_);                                  \
            m_ &= m_ - 1;                                                                  \
            size_t e = (i + bit) / (W);                                                    \
            pos[c] = (uint32_t)e;                                                          \
            emit(kind, W, load_word(a + e * (W), W), load_word(b + e * (W), W), o1, o2, c); \
            c++;                                                                           \
        }                                                                                  \
    } while (0)

#define SCAN_LOOP(W, MASKFN)                                                               \
    do {                                                                                   \
        for (; i + 64 <= nbytes; i += 64) {                                                \
            SCAN_PREFETCH(a + i, b + i);                                                   \
            uint64_t m = MASKFN(a + i, b + i);                                             \
            if (!m) continue;                                                              \
            EMIT_BITS(W, element_mask(m, W));                                              \
        }                                                                                  \
    } while (0)

/* Scans bytes [0, nbytes - nbytes % 64) of every width; returns where it stopped. */
static size_t scan_portable(const unsigned char *a, const unsigned char *b, size_t nbytes, int w,
                            int kind, uint32_t *pos, unsigned char *o1, unsigned char *o2,
                            Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    switch (w) {
    case 1: SCAN_LOOP(1, byte_diff_mask); break;
    case 2: SCAN_LOOP(2, byte_diff_mask); break;
    case 4: SCAN_LOOP(4, byte_diff_mask); break;
    default: SCAN_LOOP(8, byte_diff_mask); break;
    }
    *count = c;
    return i;
}

#ifdef DCR_X86_DISPATCH
TARGET_AVX2 static inline uint64_t byte_diff_mask_avx2(const unsigned char *a,
                                                       const unsigned char *b) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)a), y0 = _mm256_loadu_si256((const __m256i *)b);
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 32));
    __m256i y1 = _mm256_loadu_si256((const __m256i *)(b + 32));
    uint64_t eq = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x0, y0)) |
                  ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x1, y1)) << 32);
    return ~eq;
}

TARGET_AVX2 static size_t scan_avx2(const unsigned char *a, const unsigned char *b, size_t nbytes,
                                    int w, int kind, uint32_t *pos, unsigned char *o1,
                                    unsigned char *o2, Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    switch (w) {
    case 1: SCAN_LOOP(1, byte_diff_mask_avx2); break;
    case 2: SCAN_LOOP(2, byte_diff_mask_avx2); break;
    case 4: SCAN_LOOP(4, byte_diff_mask_avx2); break;
    default: SCAN_LOOP(8, byte_diff_mask_avx2); break;
    }
    *count = c;
    return i;
}

/* Compaction tables of the AVX2 scans, indexed by an 8-bit mask of changed lanes: the lane
 * numbers of the set bits in order (8 bytes, unused ones 0), and the pshufb control that
 * gathers those 2-byte lanes of a 16-byte vector to its front.  Filled once at import. */
static uint64_t lane_index[256];
static unsigned char lane_shuffle16[256][16];

static void init_lane_tables(void) {
    for (int m = 0; m < 256; m++) {
        uint64_t idx = 0;
        int c = 0;
        memset(lane_shuffle16[m], 0x80, 16);
        for (int j = 0; j < 8; j++) {
            if (!(m >> j & 1)) continue;
            idx |= (uint64_t)j << (8 * c);
            lane_shuffle16[m][2 * c] = (unsigned char)(2 * j);
            lane_shuffle16[m][2 * c + 1] = (unsigned char)(2 * j + 1);
            c++;
        }
        lane_index[m] = idx;
    }
}

/* The changed lanes `m` of eight 2-byte values (`v`, a 16-byte vector) to o + c, their
 * positions (at + lane) to pos + c; returns the new count.  Writes 16 bytes of values and 32
 * of positions whatever the count (the outputs' slack). */
TARGET_AVX2 static inline Py_ssize_t compact8_w2(__m128i v, unsigned m, uint32_t at, uint16_t *o,
                                                 uint32_t *pos, Py_ssize_t c) {
    __m128i sh = _mm_loadu_si128((const __m128i *)lane_shuffle16[m]);
    _mm_storeu_si128((__m128i *)(o + c), _mm_shuffle_epi8(v, sh));
    __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&lane_index[m]));
    _mm256_storeu_si256((__m256i *)(pos + c), _mm256_add_epi32(lanes, _mm256_set1_epi32((int)at)));
    return c + __builtin_popcount(m);
}

/* One AVX2 step of 2-byte words: the 32 words at a + i, b + i; their changed lanes' values
 * (of `kind`) and positions appended at c through the lane tables (no branch per change).
 * Returns the new count; *hit is whether any lane changed. */
TARGET_AVX2 static inline Py_ssize_t step_avx2_w2(const uint16_t *a, const uint16_t *b, size_t i,
                                                 int kind, int skip, uint32_t *pos, uint16_t *o1,
                                                 uint16_t *o2, Py_ssize_t c, unsigned *hit) {
    const __m256i sign = _mm256_set1_epi16((short)0x8000);
    SCAN_PREFETCH(a + i, b + i);
    __m256i va0 = _mm256_loadu_si256((const __m256i *)(a + i));
    __m256i vb0 = _mm256_loadu_si256((const __m256i *)(b + i));
    __m256i va1 = _mm256_loadu_si256((const __m256i *)(a + i + 16));
    __m256i vb1 = _mm256_loadu_si256((const __m256i *)(b + i + 16));
    /* packs interleaves 128-bit lanes: mask bytes are words 0-7, 16-23, 8-15, 24-31. */
    __m256i eq = _mm256_packs_epi16(_mm256_cmpeq_epi16(va0, vb0), _mm256_cmpeq_epi16(va1, vb1));
    uint32_t m = ~(uint32_t)_mm256_movemask_epi8(eq);
    *hit = m != 0;
    if (skip && !m) return c;
    __m256i v0, v1;
    switch (kind) {
    case K_XOR: v0 = _mm256_xor_si256(va0, vb0); v1 = _mm256_xor_si256(va1, vb1); break;
    case K_ULP: {
#define ORDERED16(x) _mm256_xor_si256((x), _mm256_or_si256(_mm256_srai_epi16((x), 15), sign))
        v0 = _mm256_sub_epi16(ORDERED16(va0), ORDERED16(vb0));
        v1 = _mm256_sub_epi16(ORDERED16(va1), ORDERED16(vb1));
#undef ORDERED16
        break;
    }
    case K_NEW: v0 = va0; v1 = va1; break;
    default: {
        v0 = _mm256_xor_si256(va0, vb0);
        v1 = _mm256_xor_si256(va1, vb1);
        Py_ssize_t d = c;
        d = compact8_w2(_mm256_castsi256_si128(va0), m & 0xFF, (uint32_t)i, o2, pos, d);
        d = compact8_w2(_mm256_extracti128_si256(va0, 1), (m >> 16) & 0xFF, (uint32_t)i + 8, o2,
                        pos, d);
        d = compact8_w2(_mm256_castsi256_si128(va1), (m >> 8) & 0xFF, (uint32_t)i + 16, o2, pos,
                        d);
        compact8_w2(_mm256_extracti128_si256(va1, 1), m >> 24, (uint32_t)i + 24, o2, pos, d);
        break;
    }
    }
    c = compact8_w2(_mm256_castsi256_si128(v0), m & 0xFF, (uint32_t)i, o1, pos, c);
    c = compact8_w2(_mm256_extracti128_si256(v0, 1), (m >> 16) & 0xFF, (uint32_t)i + 8, o1, pos,
                    c);
    c = compact8_w2(_mm256_castsi256_si128(v1), (m >> 8) & 0xFF, (uint32_t)i + 16, o1, pos, c);
    return compact8_w2(_mm256_extracti128_si256(v1, 1), m >> 24, (uint32_t)i + 24, o1, pos, c);
}

/* Steps of one window of the adaptive AVX2 scans, and the share of steps with a change (in
 * percent) above which the next window compacts every step instead of skipping unchanged
 * ones: near a 50% share the skip branch is mispredicted about every other step, which
 * costs more than compacting an empty step (3% of 2-byte words changed: 62% of steps). */
#define ADAPT_STEPS 256
#define ADAPT_DENSE_PERCENT 30

/* AVX2, 2-byte words: 32 words per step, windows of ADAPT_STEPS steps that either skip
 * unchanged steps (sparse changes) or compact every step (denser ones), chosen from the
 * previous window.  Outputs need 32 entries of slack past the last change. */
TARGET_AVX2 static size_t scan_avx2_w2(const uint16_t *a, const uint16_t *b, size_t n, int kind,
                                       uint32_t *pos, uint16_t *o1, uint16_t *o2,
                                       Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    int dense = 0;
    while (i + 32 <= n) {
        size_t end = i + 32 * ADAPT_STEPS;
        if (end > n) end = n;
        unsigned hits = 0, hit;
        if (dense) {
            for (; i + 32 <= end; i += 32) {
                c = step_avx2_w2(a, b, i, kind, 0, pos, o1, o2, c, &hit);
                hits += hit;
            }
        } else {
            for (; i + 32 <= end; i += 32) {
                c = step_avx2_w2(a, b, i, kind, 1, pos, o1, o2, c, &hit);
                hits += hit;
            }
        }
        dense = hits * 100 > ADAPT_STEPS * ADAPT_DENSE_PERCENT;
    }
    *count = c;
    return i * 2;
}

/* AVX2, 4-byte words: 16 words per step, compacted by a lane permutation. */
TARGET_AVX2 static inline Py_ssize_t compact8_w4(__m256i v, unsigned m, uint32_t at, uint32_t *o,
                                                 uint32_t *pos, Py_ssize_t c) {
    __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&lane_index[m]));
    _mm256_storeu_si256((__m256i *)(o + c), _mm256_permutevar8x32_epi32(v, lanes));
    _mm256_storeu_si256((__m256i *)(pos + c), _mm256_add_epi32(lanes, _mm256_set1_epi32((int)at)));
    return c + __builtin_popcount(m);
}

TARGET_AVX2 static size_t scan_avx2_w4(const uint32_t *a, const uint32_t *b, size_t n, int kind,
                                       uint32_t *pos, uint32_t *o1, uint32_t *o2,
                                       Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    for (; i + 16 <= n; i += 16) {
        SCAN_PREFETCH(a + i, b + i);
        __m256i va0 = _mm256_loadu_si256((const __m256i *)(a + i));
        __m256i vb0 = _mm256_loadu_si256((const __m256i *)(b + i));
        __m256i va1 = _mm256_loadu_si256((const __m256i *)(a + i + 8));
        __m256i vb1 = _mm256_loadu_si256((const __m256i *)(b + i + 8));
        unsigned m0 = 0xFF & ~(unsigned)_mm256_movemask_ps(
                                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(va0, vb0)));
        unsigned m1 = 0xFF & ~(unsigned)_mm256_movemask_ps(
                                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(va1, vb1)));
        if (!(m0 | m1)) continue;
        __m256i v0, v1;
        switch (kind) {
        case K_XOR: v0 = _mm256_xor_si256(va0, vb0); v1 = _mm256_xor_si256(va1, vb1); break;
        case K_ULP: {
#define ORDERED32(x) _mm256_xor_si256((x), _mm256_or_si256(_mm256_srai_epi32((x), 31), sign))
            v0 = _mm256_sub_epi32(ORDERED32(va0), ORDERED32(vb0));
            v1 = _mm256_sub_epi32(ORDERED32(va1), ORDERED32(vb1));
#undef ORDERED32
            break;
        }
        case K_NEW: v0 = va0; v1 = va1; break;
        default: {
            v0 = _mm256_xor_si256(va0, vb0);
            v1 = _mm256_xor_si256(va1, vb1);
            Py_ssize_t d = compact8_w4(va0, m0, (uint32_t)i, o2, pos, c);
            compact8_w4(va1, m1, (uint32_t)i + 8, o2, pos, d);
            break;
        }
        }
        c = compact8_w4(v0, m0, (uint32_t)i, o1, pos, c);
        c = compact8_w4(v1, m1, (uint32_t)i + 8, o1, pos, c);
    }
    *count = c;
    return i * 4;
}

/* AVX-512, 2-byte words: 64 words per step, changed lanes compressed into the outputs (no
 * branch per change).  Outputs need 64 entries of slack past the last change. */
TARGET_AVX512 static size_t scan_avx512_w2(const uint16_t *a, const uint16_t *b, size_t n,
                                           int kind, uint32_t *pos, uint16_t *o1, uint16_t *o2,
                                           Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    const __m512i sign = _mm512_set1_epi16((short)0x8000);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (; i + 64 <= n; i += 64) {
        SCAN_PREFETCH(a + i, b + i);
        SCAN_PREFETCH(a + i + 32, b + i + 32);
        __m512i va0 = _mm512_loadu_si512(a + i), vb0 = _mm512_loadu_si512(b + i);
        __m512i va1 = _mm512_loadu_si512(a + i + 32), vb1 = _mm512_loadu_si512(b + i + 32);
        __mmask32 k0 = _mm512_cmpneq_epi16_mask(va0, vb0), k1 = _mm512_cmpneq_epi16_mask(va1, vb1);
        if (!(k0 | k1)) continue;
        for (int h = 0; h < 2; h++) {
            __m512i va = h ? va1 : va0, vb = h ? vb1 : vb0;
            __mmask32 k = h ? k1 : k0;
            __m512i v;
            switch (kind) {
            case K_XOR: v = _mm512_xor_si512(va, vb); break;
            case K_ULP: {
                __m512i oa = _mm512_xor_si512(va, _mm512_or_si512(_mm512_srai_epi16(va, 15), sign));
                __m512i ob = _mm512_xor_si512(vb, _mm512_or_si512(_mm512_srai_epi16(vb, 15), sign));
                v = _mm512_sub_epi16(oa, ob);
                break;
            }
            case K_NEW: v = va; break;
            default:
                v = _mm512_xor_si512(va, vb);
                _mm512_storeu_si512(o2 + c, _mm512_maskz_compress_epi16(k, va));
                break;
            }
            _mm512_storeu_si512(o1 + c, _mm512_maskz_compress_epi16(k, v));
            __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)(i + 32 * h)), lane);
            unsigned lo = (uint16_t)k;
            _mm512_storeu_si512(pos + c, _mm512_maskz_compress_epi32((__mmask16)lo, at));
            Py_ssize_t c1 = c + __builtin_popcount(lo);
            _mm512_storeu_si512(pos + c1, _mm512_maskz_compress_epi32((__mmask16)(k >> 16),
                                                                       _mm512_add_epi32(at, sixteen)));
            c += __builtin_popcount(k);
        }
    }
    *count = c;
    return i * 2;
}

/* AVX-512, 4-byte words: 32 words per step. */
TARGET_AVX512 static size_t scan_avx512_w4(const uint32_t *a, const uint32_t *b, size_t n,
                                           int kind, uint32_t *pos, uint32_t *o1, uint32_t *o2,
                                           Py_ssize_t *count) {
    Py_ssize_t c = *count;
    size_t i = 0;
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (; i + 32 <= n; i += 32) {
        SCAN_PREFETCH(a + i, b + i);
        SCAN_PREFETCH(a + i + 16, b + i + 16);
        __m512i va0 = _mm512_loadu_si512(a + i), vb0 = _mm512_loadu_si512(b + i);
        __m512i va1 = _mm512_loadu_si512(a + i + 16), vb1 = _mm512_loadu_si512(b + i + 16);
        __mmask16 k0 = _mm512_cmpneq_epi32_mask(va0, vb0), k1 = _mm512_cmpneq_epi32_mask(va1, vb1);
        if (!(k0 | k1)) continue;
        for (int h = 0; h < 2; h++) {
            __m512i va = h ? va1 : va0, vb = h ? vb1 : vb0;
            __mmask16 k = h ? k1 : k0;
            __m512i v;
            switch (kind) {
            case K_XOR: v = _mm512_xor_si512(va, vb); break;
            case K_ULP: {
                __m512i oa = _mm512_xor_si512(va, _mm512_or_si512(_mm512_srai_epi32(va, 31), sign));
                __m512i ob = _mm512_xor_si512(vb, _mm512_or_si512(_mm512_srai_epi32(vb, 31), sign));
                v = _mm512_sub_epi32(oa, ob);
                break;
            }
            case K_NEW: v = va; break;
            default:
                v = _mm512_xor_si512(va, vb);
                _mm512_storeu_si512(o2 + c, _mm512_maskz_compress_epi32(k, va));
                break;
            }
            _mm512_storeu_si512(o1 + c, _mm512_maskz_compress_epi32(k, v));
            __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)(i + 16 * h)), lane);
            _mm512_storeu_si512(pos + c, _mm512_maskz_compress_epi32(k, at));
            c += __builtin_popcount(k);
        }
    }
    *count = c;
    return i * 4;
}
#endif

static void init_isa(void) {
#ifdef DCR_X86_DISPATCH
    init_lane_tables();
#endif
#ifdef DCR_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) isa_max = 1;
    if (isa_max == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2"))
        isa_max = 2;
#endif
    isa_level = isa_max;
}

/* Slack the outputs of the scan need past the changed count (the AVX-512 stores). */
#define SCAN_SLACK 64

static Py_ssize_t scan_impl(const unsigned char *a, const unsigned char *b, Py_ssize_t n, int w,
                            int kind, uint32_t *pos, unsigned char *o1, unsigned char *o2,
                            int level) {
    Py_ssize_t c = 0;
    size_t nbytes = (size_t)n * (size_t)w, i = 0;
#ifdef DCR_X86_DISPATCH
    if (level >= 2 && w == 2)
        i = scan_avx512_w2((const uint16_t *)a, (const uint16_t *)b, (size_t)n, kind, pos,
                           (uint16_t *)o1, (uint16_t *)o2, &c);
    else if (level >= 2 && w == 4)
        i = scan_avx512_w4((const uint32_t *)a, (const uint32_t *)b, (size_t)n, kind, pos,
                           (uint32_t *)o1, (uint32_t *)o2, &c);
    else if (level >= 1 && w == 2)
        i = scan_avx2_w2((const uint16_t *)a, (const uint16_t *)b, (size_t)n, kind, pos,
                         (uint16_t *)o1, (uint16_t *)o2, &c);
    else if (level >= 1 && w == 4)
        i = scan_avx2_w4((const uint32_t *)a, (const uint32_t *)b, (size_t)n, kind, pos,
                         (uint32_t *)o1, (uint32_t *)o2, &c);
    else if (level >= 1)
        i = scan_avx2(a, b, nbytes, w, kind, pos, o1, o2, &c);
    else
#endif
        i = scan_portable(a, b, nbytes, w, kind, pos, o1, o2, &c);
    (void)level;
    for (size_t e = i / (size_t)w; e < (size_t)n; e++) {
        uint64_t nv = load_word(a + e * w, w), ov = load_word(b + e * w, w);
        if (nv != ov) {
            pos[c] = (uint32_t)e;
            emit(kind, w, nv, ov, o1, o2, c);
            c++;
        }
    }
    return c;
}

PyDoc_STRVAR(scan_doc,
"scan(new, old, kind, pos, out, out2) -> count\n\n"
"Positions where the bit views new and old (same item size and length, fewer than 2**32\n"
"items) differ, into pos (uint32), with per position: kind 0 new^old, 1 ordered(new) -\n"
"ordered(old), 2 new, 3 new^old and new (into out2) -- into out (item size of new).  Outputs\n"
"hold at least len(new) + 64 items (vector stores write past the count).");

static PyObject *py_scan(PyObject *self, PyObject *args) {
    PyObject *onew, *oold, *opos, *oout, *oout2;
    int kind;
    if (!PyArg_ParseTuple(args, "OOiOOO", &onew, &oold, &kind, &opos, &oout, &oout2)) return NULL;
    if (kind < K_XOR || kind > K_XOR_NEW) return PyErr_Format(PyExc_ValueError, "bad kind %d", kind);
    Buf bn = {0}, bo = {0}, bp = {0}, b1 = {0}, b2 = {0};
    PyObject *result = NULL;
    if (!get_buf(onew, &bn, 0, "new") || !get_buf(oold, &bo, 0, "old") ||
        !get_buf(opos, &bp, 1, "pos") || !get_buf(oout, &b1, 1, "out"))
        goto done;
    if (kind == K_XOR_NEW && !get_buf(oout2, &b2, 1, "out2")) goto done;
    Py_ssize_t w = bn.view.itemsize, n = count_of(&bn);
    if (bo.view.itemsize != w || count_of(&bo) != n) {
        PyErr_SetString(PyExc_ValueError, "new and old differ in item size or length");
        goto done;
    }
    if ((uint64_t)n >= ((uint64_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "scan at most 2**32 - 1 items at once");
        goto done;
    }
    if (!need_itemsize(&bp, 4, "pos") || !need_itemsize(&b1, w, "out")) goto done;
    if (count_of(&bp) < n + SCAN_SLACK || count_of(&b1) < n + SCAN_SLACK ||
        (kind == K_XOR_NEW && (!need_itemsize(&b2, w, "out2") || count_of(&b2) < n + SCAN_SLACK))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "outputs are too short");
        goto done;
    }
    Py_ssize_t c;
    int level = isa_level;
    Py_BEGIN_ALLOW_THREADS
    c = scan_impl(bn.view.buf, bo.view.buf, n, (int)w, kind, bp.view.buf, b1.view.buf,
                  kind == K_XOR_NEW ? b2.view.buf : NULL, level);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(c);
done:
    release(&bn); release(&bo); release(&bp); release(&b1); release(&b2);
    return result;
}

PyDoc_STRVAR(isa_doc,
"isa() -> (level, highest)\n\nThe scan's instruction-set level in use and the highest this\n"
"machine supports: 0 portable, 1 AVX2, 2 AVX-512.");

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    return Py_BuildValue("ii", isa_level, isa_max);
}

PyDoc_STRVAR(set_isa_doc,
"set_isa(level) -> previous level\n\nUse at most instruction-set level `level` (clamped to\n"
"what the machine supports).  Results are identical at every level.");

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred()) return NULL;
    int previous = isa_level;
    isa_level = level < 0 ? 0 : (level > isa_max ? isa_max : (int)level);
    return PyLong_FromLong(previous);
}

/* ------------------------------------------------------------------ Rice split / join */

/* Where one item's words go in the shared streams of payload format 2: the symbol stream
 * (bytes, or nibbles for values) from symbol index `at_sym`, the remainder stream of its
 * parameter k (holding `stream_n` words) from word index `at_rem`. */
typedef struct {
    unsigned char *sym;
    Py_ssize_t sym_len; /* bytes */
    Py_ssize_t at_sym;
    int nibbles;
    unsigned char *rem;
    Py_ssize_t rem_len; /* bytes */
    Py_ssize_t stream_n;
    Py_ssize_t at_rem;
    int k;
    uint64_t cap;
    uint64_t *esc;
    Py_ssize_t esc_cap;
} Streams;

static Py_ssize_t remainder_bytes(Py_ssize_t n, int k) {
    return n * (k / 8) + (n * (k % 8) + 7) / 8;
}

/* Bounds of one item's writes: 0 and an exception if they leave the buffers. */
static int check_streams(const Streams *s, Py_ssize_t count) {
    Py_ssize_t sym_need = s->nibbles ? (s->at_sym + count + 1) / 2 : s->at_sym + count;
    if (s->at_sym < 0 || sym_need > s->sym_len) {
        PyErr_SetString(PyExc_ValueError, "symbol stream too short");
        return 0;
    }
    if (s->k < 0 || s->k > 63) {
        PyErr_SetString(PyExc_ValueError, "Rice parameter out of range");
        return 0;
    }
    if (s->k && (s->at_rem < 0 || s->stream_n < s->at_rem + count ||
                 remainder_bytes(s->stream_n, s->k) > s->rem_len)) {
        PyErr_SetString(PyExc_ValueError, "remainder stream too short");
        return 0;
    }
    return 1;
}

/* The split loop: x of word i comes from GETX; symbols, remainders (whole bytes as planes,
 * the top t bits through a 64-bit accumulator flushed 32 bits at a time) and escapes go into
 * the streams of s.  Sets bad = -2 when the escape buffer is full (GETX may set bad = -1). */
#define SPLIT_BODY(COUNT, GETX)                                                            \
    do {                                                                                   \
        const int k_ = s.k, planes_ = k_ / 8, t_ = k_ % 8, nibbles_ = s.nibbles;           \
        const uint64_t cap_ = s.cap, tmask_ = t_ ? (((uint64_t)1 << t_) - 1) : 0;          \
        unsigned char *restrict sym_ = s.sym;                                              \
        unsigned char *restrict rem_ = s.rem + (size_t)s.at_rem;                           \
        uint64_t *restrict esc_ = s.esc;                                                   \
        const size_t stride_ = (size_t)s.stream_n;                                         \
        const Py_ssize_t at_sym_ = s.at_sym, esc_cap_ = s.esc_cap;                         \
        unsigned char *restrict tail_ = s.rem + (size_t)planes_ * stride_;                 \
        uint64_t bitpos_ = (uint64_t)s.at_rem * (uint64_t)t_;                              \
        size_t tbyte_ = (size_t)(bitpos_ >> 3);                                            \
        uint64_t acc_ = 0;                                                                 \
        int nb_ = (int)(bitpos_ & 7);                                                      \
        for (Py_ssize_t i = 0; i < (COUNT); i++) {                                         \
            uint64_t x;                                                                    \
            GETX;                                                                          \
            uint64_t q = x >> k_;                                                          \
            if (q >= cap_) {                                                               \
                if (n_esc >= esc_cap_) { bad = -2; break; }                                \
                esc_[n_esc++] = q;                                                         \
                q = cap_;                                                                  \
            }                                                                              \
            if (nibbles_) {                                                                \
                Py_ssize_t at_ = at_sym_ + i;                                              \
                sym_[at_ >> 1] |= (unsigned char)(q << (4 * (at_ & 1)));                   \
            } else {                                                                       \
                sym_[at_sym_ + i] = (unsigned char)q;                                      \
            }                                                                              \
            for (int p_ = 0; p_ < planes_; p_++)                                           \
                rem_[(size_t)p_ * stride_ + (size_t)i] = (unsigned char)(x >> (8 * p_));   \
            if (t_) {                                                                      \
                acc_ |= ((x >> (8 * planes_)) & tmask_) << nb_;                            \
                nb_ += t_;                                                                 \
                if (nb_ >= 32) {                                                           \
                    uint32_t v_;                                                           \
                    memcpy(&v_, tail_ + tbyte_, 4);                                        \
                    v_ |= (uint32_t)acc_;                                                  \
                    memcpy(tail_ + tbyte_, &v_, 4);                                        \
                    tbyte_ += 4;                                                           \
                    acc_ >>= 32;                                                           \
                    nb_ -= 32;                                                             \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        if (t_ && !bad)                                                                    \
            for (size_t j_ = 0; nb_ > 0; j_++, nb_ -= 8)                                   \
                tail_[tbyte_ + j_] |= (unsigned char)(acc_ >> (8 * j_));                   \
    } while (0)

static int parse_streams(PyObject *args_sym, PyObject *args_rem, PyObject *args_esc, Buf *bs,
                         Buf *br, Buf *be, int writable, Streams *s) {
    if (!get_buf(args_sym, bs, writable, "symbols") || !get_buf(args_rem, br, writable, "remainders"))
        return 0;
    if (args_esc != Py_None) {
        if (!get_buf(args_esc, be, writable, "escapes") || !need_itemsize(be, 8, "escapes")) return 0;
        s->esc = be->view.buf;
        s->esc_cap = count_of(be);
    } else {
        s->esc = NULL;
        s->esc_cap = 0;
    }
    if (!need_itemsize(bs, 1, "symbols") || !need_itemsize(br, 1, "remainders")) return 0;
    s->sym = bs->view.buf;
    s->sym_len = bs->view.len;
    s->rem = br->view.buf;
    s->rem_len = br->view.len;
    return 1;
}

/* Gaps with k < 8 (no byte planes): the common case, one function per k so that the
 * remainder shifts are constants.  Same results as SPLIT_BODY.  Indices are requested
 * GAPS_AHEAD entries ahead: with the hardware's stream prefetch alone the split waited on
 * memory (3.5 ns per gap instead of 1.1 once the indices outgrew the caches; 1.3 with it). */
#define GAPS_AHEAD 128
#define DEF_GAPS_SMALL(T)                                                                  \
    static void gaps_k##T(const int64_t *restrict idx, Py_ssize_t gaps,                    \
                          unsigned char *restrict sym, unsigned char *restrict tail,        \
                          uint64_t bitpos, uint64_t cap, uint64_t *restrict esc,            \
                          Py_ssize_t esc_cap, Py_ssize_t *n_esc_out, int *bad) {            \
        size_t tbyte = (size_t)(bitpos >> 3);                                              \
        uint64_t acc = 0;                                                                  \
        int nb = (int)(bitpos & 7);                                                        \
        Py_ssize_t n_esc = 0;                                                              \
        for (Py_ssize_t i = 0; i < gaps; i++) {                                            \
            int64_t d = idx[i + 1] - idx[i];                                               \
            if ((i & 7) == 0) __builtin_prefetch(idx + i + GAPS_AHEAD, 0, 3);              \
            if (d <= 0) { *bad = -1; break; }                                              \
            uint64_t x = (uint64_t)(d - 1), q = x >> (T);                                  \
            if (q >= cap) {                                                                \
                if (n_esc >= esc_cap) { *bad = -2; break; }                                \
                esc[n_esc++] = q;                                                          \
                q = cap;                                                                   \
            }                                                                              \
            sym[i] = (unsigned char)q;                                                     \
            if ((T) > 0) {                                                                 \
                acc |= (x & ((1u << (T)) - 1)) << nb;                                      \
                nb += (T);                                                                 \
                if (nb >= 32) {                                                            \
                    uint32_t v;                                                            \
                    memcpy(&v, tail + tbyte, 4);                                           \
                    v |= (uint32_t)acc;                                                    \
                    memcpy(tail + tbyte, &v, 4);                                           \
                    tbyte += 4;                                                            \
                    acc >>= 32;                                                            \
                    nb -= 32;                                                              \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        if ((T) > 0 && !*bad)                                                              \
            for (size_t j = 0; nb > 0; j++, nb -= 8) tail[tbyte + j] |= (unsigned char)(acc >> (8 * j)); \
        *n_esc_out = n_esc;                                                                \
    }

DEF_GAPS_SMALL(0)
DEF_GAPS_SMALL(1)
DEF_GAPS_SMALL(2)
DEF_GAPS_SMALL(3)
DEF_GAPS_SMALL(4)
DEF_GAPS_SMALL(5)
DEF_GAPS_SMALL(6)
DEF_GAPS_SMALL(7)

typedef void (*GapsSmall)(const int64_t *, Py_ssize_t, unsigned char *, unsigned char *, uint64_t,
                          uint64_t, uint64_t *, Py_ssize_t, Py_ssize_t *, int *);
static const GapsSmall gaps_small[8] = {gaps_k0, gaps_k1, gaps_k2, gaps_k3,
                                        gaps_k4, gaps_k5, gaps_k6, gaps_k7};

PyDoc_STRVAR(split_gaps_doc,
"split_gaps(indices, k, cap, symbols, at_sym, remainders, stream_n, at_rem, escapes) -> n_esc\n\n"
"Rice split (parameter k) of the gaps minus one between the strictly increasing int64\n"
"indices: symbol min(q, cap) bytes into symbols from at_sym, remainders into the k-bit stream\n"
"of stream_n words from word at_rem (zero-initialised), quotients >= cap into escapes (u64).\n"
"Returns the escape count, or -1 if the indices do not strictly increase.");

static PyObject *py_split_gaps(PyObject *self, PyObject *args) {
    PyObject *oidx, *osym, *orem, *oesc;
    int k;
    unsigned long long cap;
    Py_ssize_t at_sym, stream_n, at_rem;
    if (!PyArg_ParseTuple(args, "OiKOnOnnO", &oidx, &k, &cap, &osym, &at_sym, &orem, &stream_n,
                          &at_rem, &oesc))
        return NULL;
    Buf bi = {0}, bs = {0}, br = {0}, be = {0};
    PyObject *result = NULL;
    Streams s = {0};
    s.at_sym = at_sym; s.stream_n = stream_n; s.at_rem = at_rem; s.k = k; s.cap = cap; s.nibbles = 0;
    if (!get_buf(oidx, &bi, 0, "indices") || !need_itemsize(&bi, 8, "indices")) goto done;
    if (!parse_streams(osym, orem, oesc, &bs, &br, &be, 1, &s)) goto done;
    Py_ssize_t n = count_of(&bi), gaps = n > 1 ? n - 1 : 0;
    if (!check_streams(&s, gaps)) goto done;
    const int64_t *idx = bi.view.buf;
    Py_ssize_t n_esc = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (k < 8)
        gaps_small[k](idx, gaps, s.sym + s.at_sym, s.rem, (uint64_t)s.at_rem * (uint64_t)k, s.cap,
                      s.esc, s.esc_cap, &n_esc, &bad);
    else
        SPLIT_BODY(gaps, {
            if (idx[i + 1] <= idx[i]) { bad = -1; break; }
            x = (uint64_t)(idx[i + 1] - idx[i] - 1);
        });
    Py_END_ALLOW_THREADS
    if (bad == -2) PyErr_SetString(PyExc_ValueError, "escape buffer too short");
    else result = PyLong_FromSsize_t(bad ? -1 : n_esc);
done:
    release(&bi); release(&bs); release(&br); release(&be);
    return result;
}

/* ULP deltas of 2-byte words with k = 0 (the usual parameter of small updates): each
 * zigzagged word is its symbol; pairs of symbols make one byte.  Same results as SPLIT_BODY. */
static void ulp_nibbles_w2(const uint16_t *restrict v, Py_ssize_t n, unsigned char *restrict sym,
                           Py_ssize_t at, uint64_t cap, uint64_t *restrict esc, Py_ssize_t esc_cap,
                           Py_ssize_t *n_esc_out, int *bad) {
    Py_ssize_t n_esc = 0, i = 0;
#define ULP_SYM(X, Q)                                                                      \
    do {                                                                                   \
        uint16_t x_ = (X);                                                                 \
        uint64_t z_ = (uint16_t)((x_ << 1) ^ (uint16_t)((int16_t)x_ >> 15));               \
        if (z_ >= cap) {                                                                   \
            if (n_esc >= esc_cap) { *bad = -2; *n_esc_out = n_esc; return; }               \
            esc[n_esc++] = z_;                                                             \
            z_ = cap;                                                                      \
        }                                                                                  \
        (Q) = (unsigned)z_;                                                                \
    } while (0)
    if (n && (at & 1)) {
        unsigned q;
        ULP_SYM(v[0], q);
        sym[at >> 1] |= (unsigned char)(q << 4);
        i = 1;
    }
    unsigned char *out = sym + ((at + i) >> 1);
    for (; i + 1 < n; i += 2) {
        unsigned lo, hi;
        ULP_SYM(v[i], lo);
        ULP_SYM(v[i + 1], hi);
        *out++ = (unsigned char)(lo | (hi << 4));
    }
    if (i < n) {
        unsigned q;
        ULP_SYM(v[i], q);
        *out |= (unsigned char)q;
    }
#undef ULP_SYM
    *n_esc_out = n_esc;
}

PyDoc_STRVAR(value_k_doc,
"value_k(values, step, cap) -> k\n\n"
"dcr.wire.split.value_k of the zigzagged words values[::step]: with t the rank-th smallest\n"
"(rank = m - 1 - m // 256 of m sampled words), 0 if t < cap, else bit_length(t // cap).\n"
"Computed from a histogram of that function of every sampled word (it is monotone).");

static PyObject *py_value_k(PyObject *self, PyObject *args) {
    PyObject *ovals;
    Py_ssize_t step;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OnK", &ovals, &step, &cap)) return NULL;
    if (step < 1 || cap < 1) return PyErr_Format(PyExc_ValueError, "step and cap must be >= 1");
    Buf bv = {0};
    if (!get_buf(ovals, &bv, 0, "values")) return NULL;
    Py_ssize_t n = count_of(&bv);
    int w = (int)bv.view.itemsize;
    const unsigned char *v = bv.view.buf;
    Py_ssize_t hist[66] = {0}, m = 0;
    int cap_bits = 64 - __builtin_clzll(cap);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i += step, m++) {
        uint64_t z = zigzag_word(load_word(v + (size_t)i * w, w), w);
        /* bit_length(z / cap) without dividing: with d = bit_length(z) - bit_length(cap),
         * the quotient has d + 1 bits when z >= cap << d (which does not overflow), else d. */
        int f = 0;
        if (z >= cap) {
            int d = (64 - __builtin_clzll(z)) - cap_bits;
            f = d + (z >= (cap << d));
        }
        hist[f]++;
    }
    Py_END_ALLOW_THREADS
    release(&bv);
    if (m == 0) return PyLong_FromLong(0);
    Py_ssize_t rank = m - 1 - m / 256, seen = 0;
    if (rank > m - 1) rank = m - 1;
    int k = 0;
    for (; k < 66; k++) {
        seen += hist[k];
        if (seen > rank) break;
    }
    return PyLong_FromLong(k);
}

PyDoc_STRVAR(split_ulp_doc,
"split_ulp(values, k, cap, symbols, at_sym, remainders, stream_n, at_rem, escapes) -> n_esc\n\n"
"Rice split of the zigzagged two's-complement words values (item size = word width):\n"
"symbols as nibbles (the low nibble first) from nibble at_sym of the zero-initialised\n"
"symbols, remainders and escapes as in split_gaps.");

static PyObject *py_split_ulp(PyObject *self, PyObject *args) {
    PyObject *ovals, *osym, *orem, *oesc;
    int k;
    unsigned long long cap;
    Py_ssize_t at_sym, stream_n, at_rem;
    if (!PyArg_ParseTuple(args, "OiKOnOnnO", &ovals, &k, &cap, &osym, &at_sym, &orem, &stream_n,
                          &at_rem, &oesc))
        return NULL;
    Buf bv = {0}, bs = {0}, br = {0}, be = {0};
    PyObject *result = NULL;
    Streams s = {0};
    s.at_sym = at_sym; s.stream_n = stream_n; s.at_rem = at_rem; s.k = k; s.cap = cap; s.nibbles = 1;
    if (cap > 15) { PyErr_SetString(PyExc_ValueError, "nibble symbols need cap <= 15"); goto done; }
    if (!get_buf(ovals, &bv, 0, "values")) goto done;
    if (!parse_streams(osym, orem, oesc, &bs, &br, &be, 1, &s)) goto done;
    Py_ssize_t n = count_of(&bv);
    if (!check_streams(&s, n)) goto done;
    int w = (int)bv.view.itemsize;
    const unsigned char *v = bv.view.buf;
    Py_ssize_t n_esc = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (k == 0 && w == 2)
        ulp_nibbles_w2((const uint16_t *)v, n, s.sym, s.at_sym, s.cap, s.esc, s.esc_cap, &n_esc,
                       &bad);
    else
        SPLIT_BODY(n, x = zigzag_word(load_word(v + i * w, w), w));
    Py_END_ALLOW_THREADS
    if (bad) PyErr_SetString(PyExc_ValueError, "escape buffer too short");
    else result = PyLong_FromSsize_t(n_esc);
done:
    release(&bv); release(&bs); release(&br); release(&be);
    return result;
}

/* ------------------------------------------------------------------ Rice join (decoding) */

/* Sequential reader of one item's remainders in a k-stream of stream_n words. */
typedef struct {
    const unsigned char *planes; /* byte plane p of word j at planes[p * stream_n + j] */
    const unsigned char *tail;   /* the top t bits of every word, packed LSB first */
    size_t stream_n;
    int planes_n, t;
} RemStream;

static inline uint64_t rem_at(const RemStream *r, size_t j) {
    uint64_t v = 0;
    for (int p = 0; p < r->planes_n; p++) v |= (uint64_t)r->planes[(size_t)p * r->stream_n + j] << (8 * p);
    if (r->t) {
        uint64_t bit = (uint64_t)j * (uint64_t)r->t;
        uint64_t x = r->tail[bit >> 3] >> (bit & 7);
        if ((bit & 7) + (uint64_t)r->t > 8) x |= (uint64_t)r->tail[(bit >> 3) + 1] << (8 - (bit & 7));
        v |= (x & (((uint64_t)1 << r->t) - 1)) << (8 * r->planes_n);
    }
    return v;
}

/* The remainder streams of one decoding: streams[k] is the buffer of parameter k (k = 1..63)
 * or None; each must hold exactly remainder_bytes(words of k, k) bytes. */
typedef struct {
    Buf bufs[64];
    RemStream rs[64];
    size_t used[64];
} Streams64;

static void release64(Streams64 *st) {
    for (int k = 0; k < 64; k++) release(&st->bufs[k]);
}

static int open_streams(PyObject *list, const size_t *words, Streams64 *st) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != 64) {
        PyErr_SetString(PyExc_ValueError, "streams must be a list of 64 buffers or None");
        return 0;
    }
    for (int k = 0; k < 64; k++) {
        PyObject *o = PyList_GET_ITEM(list, k);
        st->used[k] = 0;
        if (o == Py_None) {
            if (k && words[k]) {
                PyErr_Format(PyExc_ValueError, "no remainder stream for parameter %d", k);
                return 0;
            }
            continue;
        }
        if (!get_buf(o, &st->bufs[k], 0, "stream") || !need_itemsize(&st->bufs[k], 1, "stream"))
            return 0;
        if (k == 0 || st->bufs[k].view.len != remainder_bytes((Py_ssize_t)words[k], k)) {
            PyErr_Format(PyExc_ValueError, "remainder stream %d has the wrong length", k);
            return 0;
        }
        st->rs[k].planes = st->bufs[k].view.buf;
        st->rs[k].stream_n = words[k];
        st->rs[k].planes_n = k / 8;
        st->rs[k].t = k % 8;
        st->rs[k].tail = (const unsigned char *)st->bufs[k].view.buf + (size_t)(k / 8) * words[k];
    }
    return 1;
}

enum { J_OK = 0, J_EXCEEDS = 1, J_OUTSIDE = 2, J_SYMBOLS = 3 };

/* Remainders of k < 8 bits, read LSB first from the remainder bytes of a stream through a
 * 64-bit accumulator refilled 32 bits at a time (8 near the end). */
typedef struct {
    const unsigned char *tail;
    size_t len, at;
    uint64_t acc;
    int nb;
} Bits;

static inline void bits_open(Bits *b, const unsigned char *tail, size_t len, uint64_t bitpos) {
    b->tail = tail;
    b->len = len;
    b->at = (size_t)(bitpos >> 3);
    b->acc = (uint64_t)tail[b->at++] >> (bitpos & 7);
    b->nb = 8 - (int)(bitpos & 7);
}

static inline uint64_t bits_take(Bits *b, int k) {
    if (b->nb < k) {
        if (b->at + 4 <= b->len) {
            uint32_t v;
            memcpy(&v, b->tail + b->at, 4);
            b->acc |= (uint64_t)v << b->nb;
            b->nb += 32;
            b->at += 4;
        } else {
            b->acc |= (uint64_t)b->tail[b->at++] << b->nb;
            b->nb += 8;
        }
    }
    uint64_t r = b->acc & ((1u << k) - 1);
    b->acc >>= k;
    b->nb -= k;
    return r;
}

/* The gaps of one Rice item with k < 8 (no byte planes): the common case, one function per k
 * so that the remainder width is a constant, the remainders read through Bits.  Writes n
 * positions after `at` to out; returns a J_ status and
 * advances *g and *e past the symbols and escapes it used.  Same statuses as the general loop
 * of join_locations, except that a gap of an unescaped symbol is checked at the end of the
 * item: such a gap is below 2**15, so positions cannot wrap before an escaped gap (checked
 * where it occurs) or the end (n < 2**40), and the last position inside the tensor puts every
 * earlier one and every gap inside it (status J_OUTSIDE otherwise). */
#define DEF_JOIN_SMALL(T)                                                                  \
    static int join_k##T(const unsigned char *restrict sym, size_t *g_io,                   \
                         const uint64_t *restrict esc, size_t n_esc, size_t *e_io,          \
                         const unsigned char *restrict tail, size_t tail_len,               \
                         uint64_t bitpos, int64_t n, uint64_t at, uint64_t limit,           \
                         int64_t *restrict out) {                                           \
        uint64_t gap_max = limit - 1, q_max = gap_max >> (T);                              \
        size_t g = *g_io, e = *e_io;                                                       \
        int status = J_OK;                                                                 \
        Bits rb = {0};                                                                     \
        if ((T) > 0 && n > 0) bits_open(&rb, tail, tail_len, bitpos);                      \
        for (int64_t j = 0; j < n; j++) {                                                  \
            uint64_t q = sym[g++];                                                         \
            uint64_t rem = (T) > 0 ? bits_take(&rb, (T)) : 0;                              \
            if (q == 255) {                                                                \
                if (e >= n_esc) { status = J_SYMBOLS; break; }                             \
                q = esc[e++];                                                              \
                if (q > q_max) { status = J_EXCEEDS; break; }                              \
                uint64_t big = (q << (T)) | rem;                                           \
                if (big > gap_max) { status = J_EXCEEDS; break; }                          \
                if (at >= limit) { status = J_OUTSIDE; break; } /* no wrap below */        \
                at += 1 + big;                                                             \
                if (at >= limit) { status = J_OUTSIDE; break; }                            \
                out[j] = (int64_t)at;                                                      \
                continue;                                                                  \
            }                                                                              \
            at += 1 + ((q << (T)) | rem);                                                  \
            out[j] = (int64_t)at;                                                          \
        }                                                                                  \
        if (status == J_OK && at >= limit) status = J_OUTSIDE;                             \
        *g_io = g;                                                                         \
        *e_io = e;                                                                         \
        return status;                                                                     \
    }

DEF_JOIN_SMALL(0)
DEF_JOIN_SMALL(1)
DEF_JOIN_SMALL(2)
DEF_JOIN_SMALL(3)
DEF_JOIN_SMALL(4)
DEF_JOIN_SMALL(5)
DEF_JOIN_SMALL(6)
DEF_JOIN_SMALL(7)

typedef int (*JoinSmall)(const unsigned char *, size_t *, const uint64_t *, size_t, size_t *,
                         const unsigned char *, size_t, uint64_t, int64_t, uint64_t, uint64_t,
                         int64_t *);
static const JoinSmall join_small[8] = {join_k0, join_k1, join_k2, join_k3,
                                        join_k4, join_k5, join_k6, join_k7};

PyDoc_STRVAR(join_locations_doc,
"join_locations(symbols, streams, escapes, count, rice, k, start, numel, out)\n"
"    -> (status, item)\n\n"
"Positions of every item of a format 2 payload into out (int64, sum(count) entries): runs\n"
"start..start+count-1, Rice items start plus 1 + gap per step, gap = (q << k) | remainder\n"
"with q the next gap symbol (cap 255: the next escape word).  The per-item arrays count,\n"
"rice (0/1), k, start, numel are int64.  Status 0 ok; 1 a gap above numel - 1; 2 a position\n"
"at or past numel; 3 the symbols or escapes do not match the items (item -1).  The caller\n"
"has checked escape counts, escape words >= cap and stream padding.");

static PyObject *py_join_locations(PyObject *self, PyObject *args) {
    PyObject *osym, *ostreams, *oesc, *ocount, *orice, *ok, *ostart, *onumel, *oout;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &osym, &ostreams, &oesc, &ocount, &orice, &ok,
                          &ostart, &onumel, &oout))
        return NULL;
    Buf bs = {0}, be = {0}, bc = {0}, br = {0}, bk = {0}, bst = {0}, bn = {0}, bo = {0};
    Streams64 st;
    memset(&st, 0, sizeof st);
    PyObject *result = NULL;
    if (!get_buf(osym, &bs, 0, "symbols") || !get_buf(oesc, &be, 0, "escapes") ||
        !get_buf(ocount, &bc, 0, "count") || !get_buf(orice, &br, 0, "rice") ||
        !get_buf(ok, &bk, 0, "k") || !get_buf(ostart, &bst, 0, "start") ||
        !get_buf(onumel, &bn, 0, "numel") || !get_buf(oout, &bo, 1, "out"))
        goto done;
    if (!need_itemsize(&bs, 1, "symbols") || !need_itemsize(&be, 8, "escapes") ||
        !need_itemsize(&bc, 8, "count") || !need_itemsize(&br, 8, "rice") ||
        !need_itemsize(&bk, 8, "k") || !need_itemsize(&bst, 8, "start") ||
        !need_itemsize(&bn, 8, "numel") || !need_itemsize(&bo, 8, "out"))
        goto done;
    Py_ssize_t m = count_of(&bc);
    if (count_of(&br) != m || count_of(&bk) != m || count_of(&bst) != m || count_of(&bn) != m) {
        PyErr_SetString(PyExc_ValueError, "per-item arrays differ in length");
        goto done;
    }
    const int64_t *cnt = bc.view.buf, *rice = br.view.buf, *ks = bk.view.buf, *numel = bn.view.buf;
    const uint64_t *start = bst.view.buf;
    size_t words[64] = {0}, total = 0, gaps = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (cnt[i] < 0 || ks[i] < 0 || ks[i] > 63 || (rice[i] && cnt[i] < 2) || numel[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "bad item record");
            goto done;
        }
        total += (size_t)cnt[i];
        if (rice[i]) {
            words[ks[i]] += (size_t)cnt[i] - 1;
            gaps += (size_t)cnt[i] - 1;
        }
    }
    if (total != (size_t)count_of(&bo) || gaps != (size_t)bs.view.len) {
        result = Py_BuildValue("ii", J_SYMBOLS, -1);
        goto done;
    }
    if (!open_streams(ostreams, words, &st)) goto done;
    const unsigned char *sym = bs.view.buf;
    const uint64_t *esc = be.view.buf;
    size_t n_esc = (size_t)count_of(&be), e = 0, g = 0;
    int64_t *out = bo.view.buf;
    int status = J_OK;
    Py_ssize_t bad_item = -1;
    Py_BEGIN_ALLOW_THREADS
    size_t o = 0;
    for (Py_ssize_t i = 0; i < m && status == J_OK; i++) {
        int64_t c = cnt[i];
        uint64_t at = start[i];
        if (!rice[i]) {
            for (int64_t j = 0; j < c; j++) out[o + (size_t)j] = (int64_t)(at + (uint64_t)j);
            o += (size_t)c;
            continue;
        }
        int k = (int)ks[i];
        uint64_t limit = (uint64_t)numel[i];
        uint64_t gap_max = limit ? limit - 1 : 0, q_max = gap_max >> k;
        const RemStream *r = k ? &st.rs[k] : NULL;
        size_t j0 = k ? st.used[k] : 0;
        if (at >= limit) { status = J_OUTSIDE; bad_item = i; break; }
        out[o++] = (int64_t)at;
        if (k < 8 && c < ((int64_t)1 << 40)) {
            const unsigned char *tail = k ? r->tail : NULL;
            size_t tail_len = k ? (size_t)remainder_bytes((Py_ssize_t)r->stream_n, k) : 0;
            status = join_small[k](sym, &g, esc, n_esc, &e, tail, tail_len,
                                   (uint64_t)j0 * (uint64_t)k, c - 1, at, limit, out + o);
            if (status != J_OK) {
                if (status != J_SYMBOLS) bad_item = i;
                break;
            }
            o += (size_t)c - 1;
            if (k) st.used[k] += (size_t)c - 1;
            continue;
        }
        for (int64_t j = 1; j < c; j++) {
            uint64_t q = sym[g++];
            if (q == 255) {
                if (e >= n_esc) { status = J_SYMBOLS; break; }
                q = esc[e++];
            }
            if (q > q_max) { status = J_EXCEEDS; bad_item = i; break; }
            uint64_t gap = (q << k) | (r ? rem_at(r, j0 + (size_t)(j - 1)) : 0);
            if (gap > gap_max) { status = J_EXCEEDS; bad_item = i; break; }
            at += 1 + gap;
            if (at >= limit) { status = J_OUTSIDE; bad_item = i; break; }
            out[o++] = (int64_t)at;
        }
        if (k) st.used[k] += (size_t)c - 1;
    }
    if (status == J_OK && e != n_esc) status = J_SYMBOLS;
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("in", status, bad_item);
done:
    release(&bs); release(&be); release(&bc); release(&br); release(&bk); release(&bst);
    release(&bn); release(&bo);
    release64(&st);
    return result;
}

/* Store one decoded ULP word: the zigzagged word itself (ow 0, u64 output), or the word
 * unzigzagged at output width ow (1, 2, 4 or 8 bytes). */
static inline void put_value(unsigned char *out, int ow, size_t g, uint64_t word) {
    if (!ow) {
        memcpy(out + 8 * g, &word, 8);
        return;
    }
    uint64_t x = (word >> 1) ^ ((uint64_t)0 - (word & 1));
    store_word(out + (size_t)ow * g, ow, x);
}

/* The words of one ULP item with k < 8, one function per k (the remainder width a constant,
 * remainders read through Bits).  Symbols are the
 * nibbles from nibble *g_io on; n words go to out from index *g_io.  Same results as the
 * general loop of join_values. */
#define DEF_JOINV_SMALL(T)                                                                 \
    static int joinv_k##T(const unsigned char *restrict sym, size_t *g_io,                  \
                          const uint64_t *restrict esc, size_t n_esc, size_t *e_io,         \
                          const unsigned char *restrict tail, size_t tail_len,              \
                          uint64_t bitpos, int64_t n, uint64_t limit, unsigned char *out,   \
                          int ow) {                                                         \
        uint64_t q_max = limit >> (T);                                                     \
        size_t g = *g_io, e = *e_io;                                                       \
        int status = J_OK;                                                                 \
        Bits rb = {0};                                                                     \
        if ((T) > 0 && n > 0) bits_open(&rb, tail, tail_len, bitpos);                      \
        for (int64_t j = 0; j < n; j++, g++) {                                             \
            uint64_t q = (sym[g >> 1] >> (4 * (g & 1))) & 15;                              \
            if (q == 15) {                                                                 \
                if (e >= n_esc) { status = J_SYMBOLS; break; }                             \
                q = esc[e++];                                                              \
                if (q > q_max) { status = J_EXCEEDS; break; }                              \
            }                                                                              \
            uint64_t rem = (T) > 0 ? bits_take(&rb, (T)) : 0;                              \
            uint64_t word = (q << (T)) | rem;                                              \
            if (word > limit) { status = J_EXCEEDS; break; }                               \
            put_value(out, ow, g, word);                                                   \
        }                                                                                  \
        *g_io = g;                                                                         \
        *e_io = e;                                                                         \
        return status;                                                                     \
    }

DEF_JOINV_SMALL(0)
DEF_JOINV_SMALL(1)
DEF_JOINV_SMALL(2)
DEF_JOINV_SMALL(3)
DEF_JOINV_SMALL(4)
DEF_JOINV_SMALL(5)
DEF_JOINV_SMALL(6)
DEF_JOINV_SMALL(7)

/* One k = 0 ULP value at 2 bytes, unzigzagged (the scalar step of joinv_k0_w2). */
#define JOINV_K0_STEP()                                                                    \
    do {                                                                                   \
        uint64_t q = (sym[g >> 1] >> (4 * (g & 1))) & 15;                                  \
        if (q == 15) {                                                                     \
            if (e >= n_esc) { status = J_SYMBOLS; goto out; }                              \
            q = esc[e++];                                                                  \
        }                                                                                  \
        if (q > limit) { status = J_EXCEEDS; goto out; }                                   \
        out16[g] = (uint16_t)((q >> 1) ^ ((uint64_t)0 - (q & 1)));                         \
        g++;                                                                               \
        j++;                                                                               \
    } while (0)

#ifdef DCR_X86_DISPATCH
/* k = 0 ULP values at 2 bytes, unzigzagged, 32 per step from 16 bytes of nibble symbols (no
 * remainders: the value is the symbol), for up to `steps` steps; stops before the first step
 * that holds an escape symbol.  Returns the values written (a multiple of 32). */
TARGET_AVX2 static size_t joinv_k0_w2_avx2(const unsigned char *sym, size_t steps, uint16_t *out) {
    const __m128i nibble = _mm_set1_epi8(0x0F), fifteen = _mm_set1_epi8(15);
    const __m128i one = _mm_set1_epi8(1), seven_bits = _mm_set1_epi8(0x7F);
    const __m128i zero = _mm_setzero_si128();
    size_t b = 0;
    for (; b < steps; b++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(sym + 16 * b));
        __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        __m128i q0 = _mm_unpacklo_epi8(lo, hi), q1 = _mm_unpackhi_epi8(lo, hi);
        if (_mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(q0, fifteen), _mm_cmpeq_epi8(q1, fifteen))))
            break;
        /* (q >> 1) ^ -(q & 1) as a signed byte, sign-extended to 16 bits. */
        __m128i z0 = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(q0, 1), seven_bits),
                                   _mm_sub_epi8(zero, _mm_and_si128(q0, one)));
        __m128i z1 = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(q1, 1), seven_bits),
                                   _mm_sub_epi8(zero, _mm_and_si128(q1, one)));
        _mm256_storeu_si256((__m256i *)(out + 32 * b), _mm256_cvtepi8_epi16(z0));
        _mm256_storeu_si256((__m256i *)(out + 32 * b + 16), _mm256_cvtepi8_epi16(z1));
    }
    return 32 * b;
}
#endif

/* The words of one ULP item with k = 0 unzigzagged at 2 bytes (bf16 and fp16 deltas, the
 * usual case): whole steps of 32 values in AVX2 where the machine has it and no escape
 * intervenes, the rest one by one.  Same results as joinv_k0. */
static int joinv_k0_w2(const unsigned char *restrict sym, size_t *g_io,
                       const uint64_t *restrict esc, size_t n_esc, size_t *e_io, int64_t n,
                       uint64_t limit, uint16_t *out16, int level) {
    size_t g = *g_io, e = *e_io;
    int64_t j = 0;
    int status = J_OK;
    (void)level;
    while (j < n) {
#ifdef DCR_X86_DISPATCH
        if (level >= 1 && limit >= 14 && !(g & 1) && n - j >= 32) {
            size_t done = joinv_k0_w2_avx2(sym + (g >> 1), (size_t)(n - j) / 32, out16 + g);
            g += done;
            j += (int64_t)done;
            if (n - j < 32) continue;
            for (int s = 0; s < 32; s++) JOINV_K0_STEP(); /* the step with an escape */
            continue;
        }
#endif
        JOINV_K0_STEP();
    }
out:
    *g_io = g;
    *e_io = e;
    return status;
}

typedef int (*JoinvSmall)(const unsigned char *, size_t *, const uint64_t *, size_t, size_t *,
                          const unsigned char *, size_t, uint64_t, int64_t, uint64_t,
                          unsigned char *, int);
static const JoinvSmall joinv_small[8] = {joinv_k0, joinv_k1, joinv_k2, joinv_k3,
                                          joinv_k4, joinv_k5, joinv_k6, joinv_k7};

PyDoc_STRVAR(join_values_doc,
"join_values(symbols, streams, escapes, count, k, limit, out, unzigzag=False)\n"
"    -> (status, item)\n\n"
"Zigzagged ULP words of every ULP item into out (u64, sum(count)): word = (q << k) |\n"
"remainder, q the next nibble symbol of the packed symbols (cap 15: the next escape word).\n"
"count and k are int64 per ULP item, limit u64 (the largest word the item's width holds).\n"
"With unzigzag, out holds the words unzigzagged at its own item size (1, 2, 4 or 8 bytes),\n"
"and every limit must fit that size.  Status 0 ok; 1 a word above its limit; 3 the symbols\n"
"or escapes do not match (item -1).");

static PyObject *py_join_values(PyObject *self, PyObject *args) {
    PyObject *osym, *ostreams, *oesc, *ocount, *ok, *olimit, *oout;
    int unzig = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOO|p", &osym, &ostreams, &oesc, &ocount, &ok, &olimit,
                          &oout, &unzig))
        return NULL;
    Buf bs = {0}, be = {0}, bc = {0}, bk = {0}, bl = {0}, bo = {0};
    Streams64 st;
    memset(&st, 0, sizeof st);
    PyObject *result = NULL;
    if (!get_buf(osym, &bs, 0, "symbols") || !get_buf(oesc, &be, 0, "escapes") ||
        !get_buf(ocount, &bc, 0, "count") || !get_buf(ok, &bk, 0, "k") ||
        !get_buf(olimit, &bl, 0, "limit") || !get_buf(oout, &bo, 1, "out"))
        goto done;
    if (!need_itemsize(&bs, 1, "symbols") || !need_itemsize(&be, 8, "escapes") ||
        !need_itemsize(&bc, 8, "count") || !need_itemsize(&bk, 8, "k") ||
        !need_itemsize(&bl, 8, "limit"))
        goto done;
    Py_ssize_t ow = bo.view.itemsize;
    if (unzig ? (ow != 1 && ow != 2 && ow != 4 && ow != 8) : ow != 8) {
        PyErr_SetString(PyExc_ValueError, unzig ? "out must have item size 1, 2, 4 or 8"
                                                : "out must have item size 8");
        goto done;
    }
    Py_ssize_t m = count_of(&bc);
    if (count_of(&bk) != m || count_of(&bl) != m) {
        PyErr_SetString(PyExc_ValueError, "per-item arrays differ in length");
        goto done;
    }
    const int64_t *cnt = bc.view.buf, *ks = bk.view.buf;
    const uint64_t *lim = bl.view.buf;
    size_t words[64] = {0}, total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (cnt[i] < 0 || ks[i] < 0 || ks[i] > 63 || (unzig && lim[i] > width_mask((int)ow))) {
            PyErr_SetString(PyExc_ValueError, "bad item record");
            goto done;
        }
        total += (size_t)cnt[i];
        words[ks[i]] += (size_t)cnt[i];
    }
    if (total != (size_t)count_of(&bo) || (total + 1) / 2 != (size_t)bs.view.len) {
        result = Py_BuildValue("ii", J_SYMBOLS, -1);
        goto done;
    }
    if (!open_streams(ostreams, words, &st)) goto done;
    const unsigned char *sym = bs.view.buf;
    const uint64_t *esc = be.view.buf;
    size_t n_esc = (size_t)count_of(&be), e = 0, g = 0;
    unsigned char *out = bo.view.buf;
    int put = unzig ? (int)ow : 0, level = isa_level;
    int status = J_OK;
    Py_ssize_t bad_item = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m && status == J_OK; i++) {
        int k = (int)ks[i];
        uint64_t limit = lim[i], q_max = limit >> k;
        const RemStream *r = k ? &st.rs[k] : NULL;
        size_t j0 = k ? st.used[k] : 0;
        if (k == 0 && put == 2) {
            status = joinv_k0_w2(sym, &g, esc, n_esc, &e, cnt[i], limit, (uint16_t *)out, level);
            if (status == J_EXCEEDS) bad_item = i;
        } else if (k < 8) {
            size_t tail_len = k ? (size_t)remainder_bytes((Py_ssize_t)r->stream_n, k) : 0;
            status = joinv_small[k](sym, &g, esc, n_esc, &e, k ? r->tail : NULL, tail_len,
                                    (uint64_t)j0 * (uint64_t)k, cnt[i], limit, out, put);
            if (status == J_EXCEEDS) bad_item = i;
        } else {
            for (int64_t j = 0; j < cnt[i]; j++, g++) {
                uint64_t q = (sym[g >> 1] >> (4 * (g & 1))) & 15;
                if (q == 15) {
                    if (e >= n_esc) { status = J_SYMBOLS; break; }
                    q = esc[e++];
                }
                if (q > q_max) { status = J_EXCEEDS; bad_item = i; break; }
                uint64_t word = (q << k) | rem_at(r, j0 + (size_t)j);
                if (word > limit) { status = J_EXCEEDS; bad_item = i; break; }
                put_value(out, put, g, word);
            }
        }
        if (k) st.used[k] += (size_t)cnt[i];
    }
    if (status == J_OK && e != n_esc) status = J_SYMBOLS;
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("in", status, bad_item);
done:
    release(&bs); release(&be); release(&bc); release(&bk); release(&bl); release(&bo);
    release64(&st);
    return result;
}

/* ------------------------------------------------------------------ apply */

static inline uint64_t apply_one(int enc, int w, uint64_t before, uint64_t v) {
    switch (enc) {
    case E_XOR: return before ^ v;
    case E_ULP: return unordered_word((ordered_word(before, w) + v) & width_mask(w), w);
    default: return v;
    }
}

/* Whether the written word holds what the entry asked for (paper App. A.2 post-apply
 * checks): undoing a relative value restores `before`, an overwrite holds its value. */
static inline int check_one(int enc, int w, uint64_t before, uint64_t now, uint64_t v) {
    switch (enc) {
    case E_XOR: return (now ^ v) == before;
    case E_ULP: return unordered_word((ordered_word(now, w) - v) & width_mask(w), w) == before;
    default: return now == v;
    }
}

/* Entries per block of rmw_core: one check of a linear view, or one array of positions. */
#define RMW_BLOCK 1024

/* Where entry i of a chunk lands: an explicit position array, or a canonical index mapped
 * through a nested view geometry (see rmw_mapped); -1 when the index lies outside the view. */
typedef struct {
    const int64_t *pos;     /* explicit positions, or NULL */
    const int64_t *idx;     /* canonical indices (mapped) */
    int64_t src_off, dst_off;
    const int64_t *dims;    /* (source stride, size, destination stride) triples */
    Py_ssize_t nd;
} Where;

static inline int64_t where_of(const Where *m, Py_ssize_t i) {
    if (m->pos) return m->pos[i];
    int64_t r = m->idx[i] - m->src_off;
    if (r < 0) return -1;
    if (m->nd == 1 && m->dims[0] == 1) return r < m->dims[1] ? m->dst_off + r * m->dims[2] : -1;
    int64_t at = m->dst_off;
    for (Py_ssize_t d = 0; d < m->nd; d++) {
        int64_t stride = m->dims[3 * d], size = m->dims[3 * d + 1], digit;
        if (stride == 1) { digit = r; r = 0; }
        else { digit = r / stride; r -= digit * stride; }
        if (digit >= size) return -1;
        at += digit * m->dims[3 * d + 2];
    }
    return r == 0 ? at : -1;
}

/* where_of for entries b..b+k into at[].  A view of rows (two dimensions, the inner one of
 * stride 1: a row-parallel rank's columns) follows its row from entry to entry -- the indices
 * of a chunk rise, so the next entry lies in the same row or a following one -- and divides
 * only when an entry jumps by more than a row; other geometries map entry by entry. */
static void where_block(const Where *m, Py_ssize_t b, Py_ssize_t k, int64_t *at) {
    if (m->pos || m->nd != 2 || m->dims[3] != 1 || m->dims[0] <= 0) {
        for (Py_ssize_t j = 0; j < k; j++) at[j] = where_of(m, b + j);
        return;
    }
    const int64_t stride = m->dims[0], rows = m->dims[1], dst_row = m->dims[2];
    const int64_t width = m->dims[4], dst_col = m->dims[5];
    int64_t row = 0, row_start = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        const int64_t r = m->idx[b + j] - m->src_off;
        if (r < 0) {
            at[j] = -1;
            continue;
        }
        if (r < row_start || r - row_start >= stride) {
            if (r >= row_start && r - row_start < 2 * stride) {
                row++;
                row_start += stride;
            } else {
                row = r / stride;
                row_start = row * stride;
            }
        }
        const int64_t col = r - row_start;
        at[j] = row < rows && col < width ? m->dst_off + row * dst_row + col * dst_col : -1;
    }
}

/* How far ahead rmw_core prefetches: RMW_FAR entries ahead into L2 (outside the core's few
 * L1 miss buffers, so many more lines are in flight), RMW_NEAR entries ahead into L1. */
#define RMW_FAR 256
#define RMW_NEAR 32

/* The address of word `at` of `flat` computed without overflow, for prefetches: a prefetch of
 * an entry that lies outside the view (or of garbage) reads nothing and cannot fault. */
static inline const void *word_at(const unsigned char *flat, int w, uint64_t at) {
    return (const void *)((uintptr_t)flat + (uintptr_t)(at * (uint64_t)w));
}

/* Entries 0..k of a block whose positions are shift + x[j] * stride, every one inside the
 * storage: read, combine, write, in entry order (an entry reads what an earlier one wrote);
 * x holds `avail` >= k entries, the later ones only prefetched.  Inlined once per width and
 * encoding (block_of); returns the words written. */
static inline __attribute__((always_inline)) Py_ssize_t
rmw_direct(unsigned char *flat, int w, const unsigned char *v, const int64_t *x, Py_ssize_t avail,
           int64_t shift, int64_t stride, Py_ssize_t k, int enc, uint64_t *before) {
    const uint64_t s = (uint64_t)shift, t = (uint64_t)stride;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (j + RMW_FAR < avail)
            __builtin_prefetch(word_at(flat, w, s + (uint64_t)x[j + RMW_FAR] * t), 1, 1);
        if (j + RMW_NEAR < avail)
            __builtin_prefetch(word_at(flat, w, s + (uint64_t)x[j + RMW_NEAR] * t), 1, 3);
        unsigned char *p = flat + (size_t)(shift + x[j] * stride) * w;
        const uint64_t old = load_word(p, w);
        store_word(p, w, apply_one(enc, w, old, load_word(v + (size_t)j * w, w)));
        if (before) before[j] = old;
    }
    return k;
}

/* The same through computed positions at[0..k] (entries with at[j] < 0 lie outside the view:
 * nothing read, nothing written); the block's first RMW_FAR lines are requested up front. */
static inline __attribute__((always_inline)) Py_ssize_t
rmw_at(unsigned char *flat, int w, const unsigned char *v, const int64_t *at, Py_ssize_t k,
       int enc, uint64_t *before) {
    Py_ssize_t n = 0;
    for (Py_ssize_t j = 0; j < k && j < RMW_FAR; j++)
        if (at[j] >= 0) __builtin_prefetch(word_at(flat, w, (uint64_t)at[j]), 1, 1);
    for (Py_ssize_t j = 0; j < k; j++) {
        if (j + RMW_FAR < k && at[j + RMW_FAR] >= 0)
            __builtin_prefetch(word_at(flat, w, (uint64_t)at[j + RMW_FAR]), 1, 1);
        if (j + RMW_NEAR < k && at[j + RMW_NEAR] >= 0)
            __builtin_prefetch(word_at(flat, w, (uint64_t)at[j + RMW_NEAR]), 1, 3);
        if (at[j] < 0) continue;
        unsigned char *p = flat + (size_t)at[j] * w;
        const uint64_t old = load_word(p, w);
        store_word(p, w, apply_one(enc, w, old, load_word(v + (size_t)j * w, w)));
        if (before) before[j] = old;
        n++;
    }
    return n;
}

/* One block, direct (x != NULL) or through at[]: a specialization per width and encoding. */
static Py_ssize_t block_of(unsigned char *flat, int w, const unsigned char *v, const int64_t *x,
                           Py_ssize_t avail, int64_t shift, int64_t stride, const int64_t *at,
                           Py_ssize_t k, int enc, uint64_t *before) {
#define BLOCK_AS(W, E)                                                                     \
    return x ? rmw_direct(flat, W, v, x, avail, shift, stride, k, (E), before)             \
             : rmw_at(flat, W, v, at, k, (E), before);
#define BLOCK_W(E)                                                                         \
    switch (w) {                                                                           \
    case 1: BLOCK_AS(1, E)                                                                 \
    case 2: BLOCK_AS(2, E)                                                                 \
    case 4: BLOCK_AS(4, E)                                                                 \
    default: BLOCK_AS(8, E)                                                                \
    }
    switch (enc) {
    case E_XOR: BLOCK_W(E_XOR)
    case E_ULP: BLOCK_W(E_ULP)
    default: BLOCK_W(E_OVERWRITE)
    }
#undef BLOCK_W
#undef BLOCK_AS
}

/* Entries lo..hi, RMW_BLOCK at a time, in entry order.  Explicit positions, and blocks of a
 * linear view whose indices all lie inside it, go straight to the words (rmw_direct); other
 * blocks compute their landing positions first (rmw_at).  With `before` (check mode) the read
 * words are kept and a second pass re-reads every written word: an entry whose word does not
 * hold what it asked for -- because a later entry of the chunk wrote it too, say -- counts as
 * wrong. */
static void rmw_core(unsigned char *flat, int w, const unsigned char *vals, const Where *m,
                     Py_ssize_t lo, Py_ssize_t hi, int enc, uint64_t *before,
                     Py_ssize_t *written, Py_ssize_t *wrong) {
    Py_ssize_t n_written = 0, n_wrong = 0;
    const int linear = !m->pos && m->nd == 1 && m->dims[0] == 1 && m->dims[2] > 0 &&
                       m->src_off >= 0;
    int64_t at[RMW_BLOCK];
    for (Py_ssize_t b = lo; b < hi; b += RMW_BLOCK) {
        const Py_ssize_t k = hi - b < RMW_BLOCK ? hi - b : RMW_BLOCK;
        const unsigned char *v = vals + (size_t)b * w;
        uint64_t *keep = before ? before + (b - lo) : NULL;
        if (m->pos) {
            n_written += block_of(flat, w, v, m->pos + b, hi - b, 0, 1, NULL, k, enc, keep);
            continue;
        }
        if (linear) {
            /* Indices whose least and greatest lie inside the view all do: no check per entry. */
            const int64_t *x = m->idx + b;
            int64_t least = x[0], most = x[0];
            for (Py_ssize_t j = 1; j < k; j++) {
                least = x[j] < least ? x[j] : least;
                most = x[j] > most ? x[j] : most;
            }
            if (least >= m->src_off && most - m->src_off < m->dims[1]) {
                n_written += block_of(flat, w, v, x, hi - b,
                                      m->dst_off - m->src_off * m->dims[2], m->dims[2], NULL, k,
                                      enc, keep);
                continue;
            }
        }
        where_block(m, b, k, at);
        n_written += block_of(flat, w, v, NULL, 0, 0, 0, at, k, enc, keep);
    }
    if (before) {
        for (Py_ssize_t i = lo; i < hi; i++) {
            int64_t a = where_of(m, i);
            if (a < 0) continue;
            uint64_t now = load_word(flat + (size_t)a * w, w);
            if (!check_one(enc, w, before[i - lo], now, load_word(vals + (size_t)i * w, w)))
                n_wrong++;
        }
    }
    *written = n_written;
    *wrong = n_wrong;
}

static int check_encoding(int enc) {
    if (enc != E_XOR && enc != E_ULP && enc != E_OVERWRITE) {
        PyErr_Format(PyExc_ValueError, "bad encoding %d", enc);
        return 0;
    }
    return 1;
}

/* Runs rmw_core without the GIL; 0 and MemoryError if check mode cannot get its buffer. */
static int run_rmw(unsigned char *flat, int w, const unsigned char *vals, const Where *m,
                   Py_ssize_t lo, Py_ssize_t hi, int enc, int check, Py_ssize_t *written,
                   Py_ssize_t *wrong) {
    uint64_t *before = NULL;
    if (check && hi > lo) {
        before = PyMem_RawMalloc((size_t)(hi - lo) * sizeof(uint64_t));
        if (!before) {
            PyErr_NoMemory();
            return 0;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rmw_core(flat, w, vals, m, lo, hi, enc, before, written, wrong);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(before);
    return 1;
}

PyDoc_STRVAR(rmw_doc,
"rmw(flat, pos, values, encoding, check) -> wrong\n\n"
"flat[pos[i]] = apply(flat[pos[i]], values[i]) for every entry (encoding 0 XOR, 1 overwrite,\n"
"2 ULP delta: dcr.tensors.records.Encoding), flat and values of one item size; with check,\n"
"every written word is re-read after all writes and the entries that do not hold the\n"
"expected bits are counted.  Every position is checked against len(flat) before the first\n"
"write (ValueError, nothing written).");

static PyObject *py_rmw(PyObject *self, PyObject *args) {
    PyObject *oflat, *opos, *ovals;
    int enc, check;
    if (!PyArg_ParseTuple(args, "OOOip", &oflat, &opos, &ovals, &enc, &check)) return NULL;
    Buf bf = {0}, bp = {0}, bv = {0};
    PyObject *result = NULL;
    if (!get_buf(oflat, &bf, 1, "flat") || !get_buf(opos, &bp, 0, "pos") ||
        !get_buf(ovals, &bv, 0, "values"))
        goto done;
    if (!need_itemsize(&bp, 8, "pos") || !need_itemsize(&bv, bf.view.itemsize, "values") ||
        !check_encoding(enc))
        goto done;
    Py_ssize_t n = count_of(&bp), len = count_of(&bf);
    if (count_of(&bv) != n) { PyErr_SetString(PyExc_ValueError, "pos and values differ in length"); goto done; }
    const int64_t *pos = bp.view.buf;
    int oob = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= len) { oob = 1; break; }
    Py_END_ALLOW_THREADS
    if (oob) { PyErr_SetString(PyExc_ValueError, "a position lies outside the storage"); goto done; }
    Where m = {0};
    m.pos = pos;
    Py_ssize_t written, wrong;
    if (!run_rmw(bf.view.buf, (int)bf.view.itemsize, bv.view.buf, &m, 0, n, enc, check, &written,
                 &wrong))
        goto done;
    result = PyLong_FromSsize_t(wrong);
done:
    release(&bf); release(&bp); release(&bv);
    return result;
}

#define MAX_DIMS 16

/* Whether every position a nested view (rmw_mapped's dims) can reach lies in a storage of len
 * words, from the geometry alone; ValueError if not. */
static int view_inside(const int64_t *dims, Py_ssize_t nd, long long dst_off, Py_ssize_t len) {
    long long top = dst_off;
    for (Py_ssize_t d = 0; d < nd; d++) {
        long long reach;
        if (dims[3 * d] <= 0 || dims[3 * d + 1] <= 0 || dims[3 * d + 2] < 0 ||
            __builtin_mul_overflow((long long)dims[3 * d + 1] - 1, (long long)dims[3 * d + 2], &reach) ||
            __builtin_add_overflow(top, reach, &top)) {
            PyErr_SetString(PyExc_ValueError, "bad dims");
            return 0;
        }
    }
    if (dst_off < 0 || top >= len) {
        PyErr_SetString(PyExc_ValueError, "the view lies outside the storage");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(rmw_mapped_doc,
"rmw_mapped(flat, indices, values, lo, hi, src_offset, dst_offset, dims, encoding, check)\n"
"    -> (written, wrong)\n\n"
"rmw of entries lo..hi whose canonical index lies in a nested view: i - src_offset is\n"
"decomposed by the (source stride, size, destination stride) triples of dims (an int64\n"
"buffer of 3*d values, outermost first); entries outside the view are skipped, the others\n"
"written at dst_offset + sum(digit * destination stride).  The largest reachable position\n"
"is checked against len(flat) before the first write.");

static PyObject *py_rmw_mapped(PyObject *self, PyObject *args) {
    PyObject *oflat, *oidx, *ovals, *odims;
    Py_ssize_t lo, hi;
    long long src_off, dst_off;
    int enc, check;
    if (!PyArg_ParseTuple(args, "OOOnnLLOip", &oflat, &oidx, &ovals, &lo, &hi, &src_off, &dst_off,
                          &odims, &enc, &check))
        return NULL;
    Buf bf = {0}, bi = {0}, bv = {0}, bd = {0};
    PyObject *result = NULL;
    if (!get_buf(oflat, &bf, 1, "flat") || !get_buf(oidx, &bi, 0, "indices") ||
        !get_buf(ovals, &bv, 0, "values") || !get_buf(odims, &bd, 0, "dims"))
        goto done;
    if (!need_itemsize(&bi, 8, "indices") || !need_itemsize(&bd, 8, "dims") ||
        !need_itemsize(&bv, bf.view.itemsize, "values") || !check_encoding(enc))
        goto done;
    Py_ssize_t n = count_of(&bi), len = count_of(&bf), nd = count_of(&bd) / 3;
    if (count_of(&bv) != n || lo < 0 || hi < lo || hi > n || count_of(&bd) % 3 || nd > MAX_DIMS) {
        PyErr_SetString(PyExc_ValueError, "bad entry range or dims");
        goto done;
    }
    const int64_t *dims = bd.view.buf;
    if (!view_inside(dims, nd, dst_off, len)) goto done;
    Where m = {0};
    m.idx = bi.view.buf;
    m.src_off = src_off;
    m.dst_off = dst_off;
    m.dims = dims;
    m.nd = nd;
    Py_ssize_t written, wrong;
    if (!run_rmw(bf.view.buf, (int)bf.view.itemsize, bv.view.buf, &m, lo, hi, enc, check,
                 &written, &wrong))
        goto done;
    result = Py_BuildValue("nn", written, wrong);
done:
    release(&bf); release(&bi); release(&bv); release(&bd);
    return result;
}

PyDoc_STRVAR(rmw_tasks_doc,
"rmw_tasks(plans, tasks, state, check) -> None\n\n"
"Chunks of rmw / rmw_mapped taken from a shared task list until none is left, all without\n"
"the GIL: threads that call it with the same arguments share the work.  plans is a sequence\n"
"of (flat, indices, values, src_offset, dst_offset, dims), dims an int64 buffer of\n"
"rmw_mapped triples, or None when indices are storage positions (rmw).  tasks is int64 with\n"
"4 values per task: plan, lo, hi, encoding.  state is int64 [2 + 2 * len(plans)], shared by\n"
"the callers: the next task, a stop flag, then per plan the words written and the post-apply\n"
"check failures (atomic sums).  Every plan and task is validated before anything is written\n"
"(ValueError); a position outside the storage is found per task, before the task's first\n"
"write: it sets the stop flag, so no caller takes another task, and raises ValueError.");

typedef struct {
    Buf flat, idx, vals, dims;
    long long src_off, dst_off;
    Py_ssize_t n, len, nd;
    int mapped;
} TaskPlan;

static PyObject *py_rmw_tasks(PyObject *self, PyObject *args) {
    PyObject *oplans, *otasks, *ostate;
    int check;
    if (!PyArg_ParseTuple(args, "OOOp", &oplans, &otasks, &ostate, &check)) return NULL;
    PyObject *seq = PySequence_Fast(oplans, "plans must be a sequence");
    if (!seq) return NULL;
    const Py_ssize_t n_plans = PySequence_Fast_GET_SIZE(seq);
    TaskPlan *plans = PyMem_Calloc(n_plans ? (size_t)n_plans : 1, sizeof(TaskPlan));
    Buf bt = {0}, bs = {0};
    PyObject *result = NULL;
    uint64_t *before = NULL;
    if (!plans) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_plans; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *of, *oi, *ov, *od;
        TaskPlan *p = &plans[i];
        if (!PyTuple_Check(item) ||
            !PyArg_ParseTuple(item, "OOOLLO", &of, &oi, &ov, &p->src_off, &p->dst_off, &od)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a plan is a 6-tuple");
            goto done;
        }
        if (!get_buf(of, &p->flat, 1, "flat") || !get_buf(oi, &p->idx, 0, "indices") ||
            !get_buf(ov, &p->vals, 0, "values") || !need_itemsize(&p->idx, 8, "indices") ||
            !need_itemsize(&p->vals, p->flat.view.itemsize, "values"))
            goto done;
        const Py_ssize_t w = p->flat.view.itemsize;
        p->n = count_of(&p->idx);
        p->len = count_of(&p->flat);
        if ((w != 1 && w != 2 && w != 4 && w != 8) || count_of(&p->vals) != p->n) {
            PyErr_SetString(PyExc_ValueError, "bad word size, or indices and values differ in length");
            goto done;
        }
        p->mapped = od != Py_None;
        if (p->mapped) {
            if (!get_buf(od, &p->dims, 0, "dims") || !need_itemsize(&p->dims, 8, "dims")) goto done;
            p->nd = count_of(&p->dims) / 3;
            if (count_of(&p->dims) % 3 || p->nd > MAX_DIMS) {
                PyErr_SetString(PyExc_ValueError, "bad dims");
                goto done;
            }
            if (!view_inside(p->dims.view.buf, p->nd, p->dst_off, p->len)) goto done;
        }
    }
    if (!get_buf(otasks, &bt, 0, "tasks") || !need_itemsize(&bt, 8, "tasks") ||
        !get_buf(ostate, &bs, 1, "state") || !need_itemsize(&bs, 8, "state"))
        goto done;
    if (count_of(&bt) % 4 || count_of(&bs) != 2 + 2 * n_plans) {
        PyErr_SetString(PyExc_ValueError, "tasks must hold 4 values per task, state 2 + 2 per plan");
        goto done;
    }
    const int64_t *tasks = bt.view.buf;
    const Py_ssize_t n_tasks = count_of(&bt) / 4;
    Py_ssize_t longest = 0;
    for (Py_ssize_t t = 0; t < n_tasks; t++) {
        const int64_t *task = tasks + 4 * t;
        if (task[0] < 0 || task[0] >= n_plans || task[1] < 0 || task[2] < task[1] ||
            task[2] > plans[task[0]].n) {
            PyErr_SetString(PyExc_ValueError, "bad task: plan or entry range");
            goto done;
        }
        if (!check_encoding((int)task[3])) goto done;
        if (task[2] - task[1] > longest) longest = task[2] - task[1];
    }
    if (check && longest) {
        before = PyMem_RawMalloc((size_t)longest * sizeof(uint64_t));
        if (!before) {
            PyErr_NoMemory();
            goto done;
        }
    }
    int64_t *state = bs.view.buf;
    int outside = 0;
    Py_BEGIN_ALLOW_THREADS
    while (!__atomic_load_n(&state[1], __ATOMIC_RELAXED)) {
        const int64_t t = __atomic_fetch_add(&state[0], 1, __ATOMIC_RELAXED);
        if (t >= n_tasks) break;
        const int64_t *task = tasks + 4 * t;
        const TaskPlan *p = &plans[task[0]];
        const Py_ssize_t lo = task[1], hi = task[2];
        Where m = {0};
        if (p->mapped) {
            m.idx = p->idx.view.buf;
            m.src_off = p->src_off;
            m.dst_off = p->dst_off;
            m.dims = p->dims.view.buf;
            m.nd = p->nd;
        } else {
            const int64_t *pos = p->idx.view.buf;
            for (Py_ssize_t i = lo; i < hi; i++)
                if (pos[i] < 0 || pos[i] >= p->len) { outside = 1; break; }
            if (outside) {
                __atomic_store_n(&state[1], 1, __ATOMIC_RELAXED);
                break;
            }
            /* rmw_core indexes pos by entry number from lo. */
            m.pos = pos;
        }
        Py_ssize_t written, wrong;
        rmw_core(p->flat.view.buf, (int)p->flat.view.itemsize, p->vals.view.buf, &m, lo, hi,
                 (int)task[3], before, &written, &wrong);
        __atomic_fetch_add(&state[2 + task[0]], (int64_t)written, __ATOMIC_RELAXED);
        __atomic_fetch_add(&state[2 + n_plans + task[0]], (int64_t)wrong, __ATOMIC_RELAXED);
    }
    Py_END_ALLOW_THREADS
    if (outside) {
        PyErr_SetString(PyExc_ValueError, "a position lies outside the storage");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(before);
    if (plans) {
        for (Py_ssize_t i = 0; i < n_plans; i++) {
            release(&plans[i].flat); release(&plans[i].idx); release(&plans[i].vals);
            release(&plans[i].dims);
        }
        PyMem_Free(plans);
    }
    release(&bt); release(&bs);
    Py_DECREF(seq);
    return result;
}

/* Contiguous overwrites of at least STREAM_MIN bytes are written with non-temporal stores:
 * a block that large is not read again soon, and a streamed store skips reading each
 * destination line before writing it.  On a 2-core Xeon two threads copied 818 MB in 0.049 s
 * this way and in 0.061 s with memcpy (which streams only above its own, much larger,
 * threshold).  Portable builds (no SSE2) use memcpy. */
#define STREAM_MIN (256 * 1024)

static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
#ifdef DCR_SSE2
    if (n >= STREAM_MIN) {
        const size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            const __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            const __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            const __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        _mm_sfence(); /* streamed stores are ordered before anything that follows */
        return;
    }
#endif
    memcpy(dst, src, n);
}

PyDoc_STRVAR(write_block_doc,
"write_block(flat, dst_offset, values, src_offset, dims, encoding, check) -> (written, wrong)\n\n"
"A block of a run of entries through a copy's view geometry: for every multi-index i of the\n"
"block, flat[dst_offset + sum(i_d * dst_stride_d)] = apply(that word, values[src_offset +\n"
"sum(i_d * src_stride_d)]) (encoding 0 XOR, 1 overwrite, 2 ULP delta); dims is an int64\n"
"buffer of (size, destination stride, source stride) triples, outermost first.  A\n"
"contiguous innermost dimension of an overwrite is one copy (streamed when large).  With\n"
"check every written word is re-read after all writes: undoing a relative value restores\n"
"the word read before the write, an overwrite holds its value; wrong counts the words that\n"
"do not.  The block's reach in both buffers is checked before the first write (ValueError,\n"
"nothing written).");

static PyObject *py_write_block(PyObject *self, PyObject *args) {
    PyObject *oflat, *ovals, *odims;
    long long dst_off, src_off;
    int enc, check;
    if (!PyArg_ParseTuple(args, "OLOLOip", &oflat, &dst_off, &ovals, &src_off, &odims, &enc,
                          &check))
        return NULL;
    Buf bf = {0}, bv = {0}, bd = {0};
    PyObject *result = NULL;
    if (!get_buf(oflat, &bf, 1, "flat") || !get_buf(ovals, &bv, 0, "values") ||
        !get_buf(odims, &bd, 0, "dims"))
        goto done;
    if (!need_itemsize(&bv, bf.view.itemsize, "values") || !need_itemsize(&bd, 8, "dims") ||
        !check_encoding(enc))
        goto done;
    Py_ssize_t nd = count_of(&bd) / 3;
    if (count_of(&bd) % 3 || nd > MAX_DIMS) {
        PyErr_SetString(PyExc_ValueError, "bad dims");
        goto done;
    }
    const int64_t *dims = bd.view.buf;
    /* The last word the block reaches in each buffer, from the geometry alone. */
    long long dst_top = dst_off, src_top = src_off, total = 1;
    for (Py_ssize_t d = 0; d < nd; d++) {
        long long size = dims[3 * d], ds = dims[3 * d + 1], ss = dims[3 * d + 2], r1, r2;
        if (size <= 0 || ds < 0 || ss < 0 ||
            __builtin_mul_overflow(size - 1, ds, &r1) || __builtin_add_overflow(dst_top, r1, &dst_top) ||
            __builtin_mul_overflow(size - 1, ss, &r2) || __builtin_add_overflow(src_top, r2, &src_top) ||
            __builtin_mul_overflow(total, size, &total)) {
            PyErr_SetString(PyExc_ValueError, "bad dims");
            goto done;
        }
    }
    if (dst_off < 0 || src_off < 0 || dst_top >= count_of(&bf) || src_top >= count_of(&bv)) {
        PyErr_SetString(PyExc_ValueError, "the block lies outside its buffers");
        goto done;
    }
    unsigned char *flat = bf.view.buf;
    const unsigned char *vals = bv.view.buf;
    const int w = (int)bf.view.itemsize;
    /* Innermost dimension (a scalar block has one element). */
    const long long n_in = nd ? dims[3 * (nd - 1)] : 1;
    const long long ds_in = nd ? dims[3 * (nd - 1) + 1] : 0, ss_in = nd ? dims[3 * (nd - 1) + 2] : 0;
    const int contiguous = n_in == 1 || (ds_in == 1 && ss_in == 1);
    const long long rows = total / n_in;
    const int relative = enc != E_OVERWRITE;
    uint64_t *before = NULL;
    if (check && relative) {
        before = PyMem_RawMalloc((size_t)total * sizeof(uint64_t));
        if (!before) {
            PyErr_NoMemory();
            goto done;
        }
    }
    long long wrong = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Pass 0 writes every word; with check, pass 1 re-reads them all after the writes. */
    for (int pass = 0; pass < 1 + check; pass++) {
        long long idx[MAX_DIMS] = {0}, at = 0;
        for (long long r = 0; r < rows; r++) {
            long long dp = dst_off, sp = src_off;
            for (Py_ssize_t d = 0; d + 1 < nd; d++) {
                dp += idx[d] * dims[3 * d + 1];
                sp += idx[d] * dims[3 * d + 2];
            }
            unsigned char *dst = flat + (size_t)dp * w;
            const unsigned char *src = vals + (size_t)sp * w;
            if (!relative && contiguous) {
                if (!pass)
                    stream_copy(dst, src, (size_t)n_in * w);
                else if (memcmp(dst, src, (size_t)n_in * w))
                    for (long long j = 0; j < n_in; j++)
                        wrong += load_word(dst + (size_t)j * w, w) != load_word(src + (size_t)j * w, w);
            } else {
                for (long long j = 0; j < n_in; j++, at++) {
                    unsigned char *p = dst + (size_t)(j * ds_in) * w;
                    uint64_t v = load_word(src + (size_t)(j * ss_in) * w, w);
                    if (!pass) {
                        uint64_t b = load_word(p, w);
                        if (before) before[at] = b;
                        store_word(p, w, apply_one(enc, w, b, v));
                    } else {
                        wrong += !check_one(enc, w, before ? before[at] : 0, load_word(p, w), v);
                    }
                }
            }
            for (Py_ssize_t d = nd - 2; d >= 0; d--) {
                if (++idx[d] < dims[3 * d]) break;
                idx[d] = 0;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(before);
    result = Py_BuildValue("LL", total, wrong);
done:
    release(&bf); release(&bv); release(&bd);
    return result;
}

PyDoc_STRVAR(copy_at_doc,
"copy_at(dst, src, positions, shift) -> None\n\n"
"dst[p - shift] = src[p - shift] for every int64 p of positions: dst and src are bit views of\n"
"one length and item size.  Every position is checked before the first write (ValueError,\n"
"nothing written, if one is outside the views).");

static PyObject *py_copy_at(PyObject *self, PyObject *args) {
    PyObject *odst, *osrc, *opos;
    long long shift;
    if (!PyArg_ParseTuple(args, "OOOL", &odst, &osrc, &opos, &shift)) return NULL;
    Buf bd = {0}, bs = {0}, bp = {0};
    PyObject *result = NULL;
    if (!get_buf(odst, &bd, 1, "dst") || !get_buf(osrc, &bs, 0, "src") ||
        !get_buf(opos, &bp, 0, "positions") || !need_itemsize(&bp, 8, "positions"))
        goto done;
    Py_ssize_t w = bd.view.itemsize, n = count_of(&bd), m = count_of(&bp);
    if (bs.view.itemsize != w || count_of(&bs) != n) {
        PyErr_SetString(PyExc_ValueError, "dst and src differ in item size or length");
        goto done;
    }
    const int64_t *pos = bp.view.buf;
    unsigned char *d = bd.view.buf;
    const unsigned char *src = bs.view.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < m; j++) {
        uint64_t e = (uint64_t)pos[j] - (uint64_t)shift;
        bad |= e >= (uint64_t)n;
    }
    if (!bad) {
        /* Both words of every position are requested RMW_FAR entries ahead into L2 (see
         * rmw_core): scattered positions are bound by the cache misses in flight. */
#define COPY_AT(T)                                                                         \
    {                                                                                      \
        T *dd = (T *)d;                                                                    \
        const T *ss = (const T *)src;                                                      \
        for (Py_ssize_t j = 0; j < m; j++) {                                               \
            if (j + RMW_FAR < m) {                                                         \
                const uint64_t f = (uint64_t)pos[j + RMW_FAR] - (uint64_t)shift;           \
                __builtin_prefetch(word_at(src, sizeof(T), f), 0, 1);                      \
                __builtin_prefetch(word_at(d, sizeof(T), f), 1, 1);                        \
            }                                                                              \
            const size_t e = (size_t)(pos[j] - shift);                                     \
            dd[e] = ss[e];                                                                 \
        }                                                                                  \
    }                                                                                      \
    break;
        switch (w) {
        case 1: COPY_AT(uint8_t)
        case 2: COPY_AT(uint16_t)
        case 4: COPY_AT(uint32_t)
        default: COPY_AT(uint64_t)
        }
#undef COPY_AT
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a position lies outside the views");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&bd); release(&bs); release(&bp);
    return result;
}

PyDoc_STRVAR(spread_rows_doc,
"spread_rows(local, period, gap, offset, out) -> None\n\n"
"out[i] = j + (j // period) * gap + offset for every int64 j = local[i] >= 0 (period >= 1):\n"
"rows of period consecutive elements spread period + gap apart.  The row is recomputed only\n"
"when j leaves the previous one (one division per row for sorted input; any order is\n"
"exact).  out holds at least len(local) int64 items.");

static PyObject *py_spread_rows(PyObject *self, PyObject *args) {
    PyObject *olocal, *oout;
    long long period, gap, offset;
    if (!PyArg_ParseTuple(args, "OLLLO", &olocal, &period, &gap, &offset, &oout)) return NULL;
    if (period < 1 || gap < 0) return PyErr_Format(PyExc_ValueError, "period must be >= 1 and gap >= 0");
    Buf bl = {0}, bo = {0};
    PyObject *result = NULL;
    if (!get_buf(olocal, &bl, 0, "local") || !need_itemsize(&bl, 8, "local") ||
        !get_buf(oout, &bo, 1, "out") || !need_itemsize(&bo, 8, "out"))
        goto done;
    Py_ssize_t n = count_of(&bl);
    if (count_of(&bo) < n) {
        PyErr_SetString(PyExc_ValueError, "out is too short");
        goto done;
    }
    const int64_t *loc = bl.view.buf;
    int64_t *out = bo.view.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t lo = 0, hi = 0, add = 0; /* the current row is [lo, hi); its elements move by add */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t j = loc[i];
        if (j < lo || j >= hi) {
            if (j < 0) { bad = 1; break; }
            int64_t row = j / period;
            lo = row * period;
            hi = lo + period;
            add = row * gap + offset;
        }
        out[i] = j + add;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a local index is negative");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&bl); release(&bo);
    return result;
}

PyDoc_STRVAR(increasing_doc,
"increasing(indices) -> bool\n\nWhether the int64 indices strictly increase.");

static PyObject *py_increasing(PyObject *self, PyObject *arg) {
    Buf bi = {0};
    if (!get_buf(arg, &bi, 0, "indices")) return NULL;
    if (!need_itemsize(&bi, 8, "indices")) { release(&bi); return NULL; }
    Py_ssize_t n = count_of(&bi);
    const int64_t *idx = bi.view.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t bad = 0;
    for (Py_ssize_t i = 1; i < n; i++) bad |= (idx[i] <= idx[i - 1]);
    ok = !bad;
    Py_END_ALLOW_THREADS
    release(&bi);
    return PyBool_FromLong(ok);
}

/* ------------------------------------------------------------------ fingerprint */

PyDoc_STRVAR(hash_plane_doc,
"hash_plane(values, rowkey, colkey, r0, r1, c0, c1) -> (high, low)\n\n"
"The exact sum of h(i, x) (dcr.tensors.fingerprint.h_reference, elements of at most 32\n"
"bits) over rows r0..r1-1 and columns c0..c1-1 of the 2-D strided array `values`, whose\n"
"element (r, c) has the key rowkey[r] + c * colkey (mod 2^64), as two 64-bit halves:\n"
"sum = high * 2^64 + low.  One pass over the values, the GIL released.");

static PyObject *py_hash_plane(PyObject *self, PyObject *args) {
    PyObject *ovalues, *okeys;
    unsigned long long colkey;
    Py_ssize_t r0, r1, c0, c1;
    if (!PyArg_ParseTuple(args, "OOKnnnn", &ovalues, &okeys, &colkey, &r0, &r1, &c0, &c1))
        return NULL;
    Py_buffer bv;
    Buf bk = {0};
    if (PyObject_GetBuffer(ovalues, &bv, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t w = bv.itemsize;
    if (bv.ndim != 2 || (w != 1 && w != 2 && w != 4)) {
        PyErr_SetString(PyExc_ValueError, "values must be 2-D with 1-, 2- or 4-byte items");
        goto done;
    }
    if (!get_buf(okeys, &bk, 0, "rowkey") || !need_itemsize(&bk, 8, "rowkey")) goto done;
    if (r0 < 0 || c0 < 0 || r1 < r0 || c1 < c0 || r1 > bv.shape[0] || c1 > bv.shape[1] ||
        r1 > count_of(&bk)) {
        PyErr_SetString(PyExc_ValueError, "rows or columns out of range");
        goto done;
    }
    if ((uint64_t)(c1 - c0) >> 31) {
        PyErr_SetString(PyExc_ValueError, "at most 2^31 columns per call");
        goto done;
    }
    const unsigned char *base = bv.buf;
    const Py_ssize_t rs = bv.strides[0], cs = bv.strides[1];
    const uint64_t *keys = bk.view.buf;
    const uint64_t m1 = 0xBF58476D1CE4E5B9ULL, m2 = 0x94D049BB133111EBULL;
    const uint64_t mask = ((uint64_t)1 << 60) - 1, ck = colkey;
    uint64_t high = 0, low = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = r0; r < r1; r++) {
        const unsigned char *row = base + r * rs;
        uint64_t key = keys[r] + (uint64_t)c0 * ck;
        uint64_t lo = 0, hi = 0; /* h < 2^60: hi sums h >> 32 exactly, lo wraps */
#define HASH_ROW(T)                                                                         \
    for (Py_ssize_t c = c0; c < c1; c++, key += ck) {                                      \
        uint64_t u = key ^ (uint64_t)*(const T *)(row + c * cs);                           \
        u = (u * m1) & mask;                                                               \
        u ^= u >> 29;                                                                      \
        u = (u * m2) & mask;                                                               \
        u ^= u >> 32;                                                                      \
        lo += u;                                                                           \
        hi += u >> 32;                                                                     \
    }                                                                                      \
    break;
        switch (w) {
        case 1: HASH_ROW(uint8_t)
        case 2: HASH_ROW(uint16_t)
        default: HASH_ROW(uint32_t)
        }
#undef HASH_ROW
        /* The row's exact sum is hi * 2^32 + words, the low words summing to
         * lo - hi * 2^32 (mod 2^64), below n * 2^32 < 2^64: its low 64 bits are lo, its
         * high ones hi >> 32 plus the carry out of (hi mod 2^32) * 2^32 + words. */
        const uint64_t words = lo - (hi << 32);
        low += lo;
        high += (hi >> 32) + (lo < words) + (low < lo);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(KK)", (unsigned long long)high, (unsigned long long)low);
done:
    release(&bk);
    PyBuffer_Release(&bv);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", py_scan, METH_VARARGS, scan_doc},
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"set_isa", py_set_isa, METH_O, set_isa_doc},
    {"split_gaps", py_split_gaps, METH_VARARGS, split_gaps_doc},
    {"split_ulp", py_split_ulp, METH_VARARGS, split_ulp_doc},
    {"value_k", py_value_k, METH_VARARGS, value_k_doc},
    {"join_locations", py_join_locations, METH_VARARGS, join_locations_doc},
    {"join_values", py_join_values, METH_VARARGS, join_values_doc},
    {"rmw", py_rmw, METH_VARARGS, rmw_doc},
    {"rmw_mapped", py_rmw_mapped, METH_VARARGS, rmw_mapped_doc},
    {"rmw_tasks", py_rmw_tasks, METH_VARARGS, rmw_tasks_doc},
    {"write_block", py_write_block, METH_VARARGS, write_block_doc},
    {"increasing", py_increasing, METH_O, increasing_doc},
    {"copy_at", py_copy_at, METH_VARARGS, copy_at_doc},
    {"spread_rows", py_spread_rows, METH_VARARGS, spread_rows_doc},
    {"hash_plane", py_hash_plane, METH_VARARGS, hash_plane_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dcr._kernels",
    "The data plane's hot loops in C (see dcr.native).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    init_isa();
    return PyModule_Create(&module);
}

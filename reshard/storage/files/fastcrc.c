/* fastcrc: zlib's CRC-32 (the zip format's, polynomial 0xEDB88320 reflected), computed by
 * carry-less multiplication (PCLMULQDQ) where the CPU has it.
 *
 * Why native: every byte a conversion copies is checksummed once (the CRC-32 its writer
 * records, and the check against the source's records), and zlib 1.2.13's table-driven
 * crc32 runs at about 3.2 GB/s on this project's machine: 0.31 s of CPU per GiB, a fifth of
 * the whole data path's CPU. Folding 64 bytes per step with PCLMULQDQ (Gopal et al., "Fast
 * CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction", Intel 2009; the
 * constants are the paper's bit-reflected ones, as in Chromium's zlib crc32_simd.c) runs at
 * memory speed. The values are zlib.crc32's, bit for bit (tests/test_fastcrc.py compares them
 * on random data of every length up to a few KiB and on large buffers, by every path); a CPU with
 * VPCLMULQDQ and AVX2 folds 128 bytes a step in 256-bit lanes (about 17 GiB/s here on buffers
 * that fit the cache, 11 with 128-bit lanes); a CPU without PCLMULQDQ takes the slice-by-8 table
 * path, still about zlib's speed.
 *
 * crc32(data, value=0) -> int: zlib.crc32's signature; the GIL is released for buffers of
 * 64 KiB and more, so the copy's worker threads checksum in parallel. combine(crc1, crc2, len2):
 * zlib's crc32_combine (see py_combine). copy_crc(dst, src, value=0) -> int: dst[:] = src and
 * crc32(src, value) in one pass (see py_copy_crc).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define HAVE_X86 1
#include <immintrin.h>
#include <cpuid.h>
#endif

static uint32_t table[8][256];

static void make_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table[0][n];
        for (int k = 1; k < 8; k++) {
            c = table[0][c & 0xff] ^ (c >> 8);
            table[k][n] = c;
        }
    }
}

/* The CRC register (pre- and post-inverted by the caller) over len bytes, slice by 8. */
static uint32_t crc_table(uint32_t c, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#ifdef HAVE_X86
static int have_clmul = 0;

/* The last folding of a 128-bit remainder ``x1`` over len bytes (a multiple of 16), then the
 * reduction to 32 bits: shared by the 128-bit and the 256-bit folding. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t fold16_reduce(__m128i x1, const unsigned char *buf, size_t len) {
    static const uint64_t k3k4[2] __attribute__((aligned(16))) = {0x01751997d0ULL, 0x00ccaa009eULL};
    static const uint64_t k5k0[2] __attribute__((aligned(16))) = {0x0163cd6124ULL, 0x0000000000ULL};
    static const uint64_t poly[2] __attribute__((aligned(16))) = {0x01db710641ULL, 0x01f7011641ULL};
    __m128i x0 = _mm_load_si128((const __m128i *)k3k4), x2, x3, x5;

    while (len >= 16) { /* one lane, 16 bytes at a time */
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }

    /* 128 bits to 64 */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = _mm_loadl_epi64((const __m128i *)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);

    /* Barrett reduction to 32 bits */
    x0 = _mm_load_si128((const __m128i *)poly);
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/* The CRC register over len bytes, len >= 64 and a multiple of 16 (the paper's folding). */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_clmul(uint32_t crc, const unsigned char *buf, size_t len) {
    static const uint64_t k1k2[2] __attribute__((aligned(16))) = {0x0154442bd4ULL, 0x01c6e41596ULL};
    static const uint64_t k3k4[2] __attribute__((aligned(16))) = {0x01751997d0ULL, 0x00ccaa009eULL};
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = _mm_load_si128((const __m128i *)k1k2);
    buf += 64;
    len -= 64;

    while (len >= 64) { /* four lanes folded 64 bytes ahead */
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }

    /* the four lanes into one */
    x0 = _mm_load_si128((const __m128i *)k3k4);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);

    return fold16_reduce(x1, buf, len);
}

/* The same folding 128 bytes at a time, in four 256-bit lanes (VPCLMULQDQ): about twice the 128-bit
 * path's speed. len >= 256, a multiple of 16. The constants are x^(1024+-32) and x^(256+-32) mod P,
 * bit-reflected and shifted left by one, as the paper's k1..k4 are for 512 and 128 bits (the
 * derivation reproduces those four; tests/test_fastcrc.py compares every path with zlib). */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
static uint32_t crc_vclmul(uint32_t crc, const unsigned char *buf, size_t len) {
    static const uint64_t k3k4[2] __attribute__((aligned(16))) = {0x01751997d0ULL, 0x00ccaa009eULL};
    const __m256i k1024 = _mm256_setr_epi64x(0x1e88ef372LL, 0x14a7fe880LL, 0x1e88ef372LL, 0x14a7fe880LL);
    const __m256i k256 = _mm256_setr_epi64x(0x0f1da05aaLL, 0x15a546366LL, 0x0f1da05aaLL, 0x15a546366LL);
    __m256i y1 = _mm256_loadu_si256((const __m256i *)(buf + 0x00));
    __m256i y2 = _mm256_loadu_si256((const __m256i *)(buf + 0x20));
    __m256i y3 = _mm256_loadu_si256((const __m256i *)(buf + 0x40));
    __m256i y4 = _mm256_loadu_si256((const __m256i *)(buf + 0x60));
    y1 = _mm256_xor_si256(y1, _mm256_setr_epi32((int)crc, 0, 0, 0, 0, 0, 0, 0));
    buf += 128;
    len -= 128;
#define FOLD256(y, k, next) _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(y, k, 0x00), \
                                                                _mm256_clmulepi64_epi128(y, k, 0x11)), next)
    while (len >= 128) {
        y1 = FOLD256(y1, k1024, _mm256_loadu_si256((const __m256i *)(buf + 0x00)));
        y2 = FOLD256(y2, k1024, _mm256_loadu_si256((const __m256i *)(buf + 0x20)));
        y3 = FOLD256(y3, k1024, _mm256_loadu_si256((const __m256i *)(buf + 0x40)));
        y4 = FOLD256(y4, k1024, _mm256_loadu_si256((const __m256i *)(buf + 0x60)));
        buf += 128;
        len -= 128;
    }
    y2 = FOLD256(y1, k256, y2); /* four lanes into one, 32 bytes at a time */
    y3 = FOLD256(y2, k256, y3);
    y4 = FOLD256(y3, k256, y4);
#undef FOLD256
    /* the 256-bit lane into 128 bits: its low half folded by 128 bits onto its high half */
    __m128i k = _mm_load_si128((const __m128i *)k3k4);
    __m128i lo = _mm256_castsi256_si128(y4), hi = _mm256_extracti128_si256(y4, 1);
    __m128i x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lo, k, 0x00), _mm_clmulepi64_si128(lo, k, 0x11)), hi);
    return fold16_reduce(x1, buf, len);
}
static int have_vclmul = 0;
#endif

/* zlib.crc32(buf, crc): the finished CRC of the bytes that follow a stream whose CRC is crc, by the
 * widest folding the CPU has and `width` allows (256, 128, or 0: tables only). */
static uint32_t crc32_width(uint32_t crc, const unsigned char *p, size_t len, int width) {
    uint32_t c = ~crc;
#ifdef HAVE_X86
    if (width >= 256 && have_vclmul && len >= 256) {
        size_t bulk = len & ~(size_t)15;
        c = crc_vclmul(c, p, bulk);
        p += bulk;
        len -= bulk;
    } else if (width >= 128 && have_clmul && len >= 64) {
        size_t bulk = len & ~(size_t)15;
        c = crc_clmul(c, p, bulk);
        p += bulk;
        len -= bulk;
    }
#endif
    c = crc_table(c, p, len);
    return ~c;
}

static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t len) {
    return crc32_width(crc, p, len, 256);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc32", &view, &value)) return NULL;
    uint32_t c = (uint32_t)(value & 0xffffffffUL);
    if (view.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        c = crc32_update(c, (const unsigned char *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        c = crc32_update(c, (const unsigned char *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

/* copy_crc(dst, src, value=0) -> int: copies src into dst (same length, not overlapping) and returns
 * zlib.crc32(src, value), in one pass over the bytes. Why: a direct read of a source storage that does
 * not start on a block boundary lands in an aligned stage and is copied to its place in the slab the
 * direct write takes (reshard/storage/files/fileio.py, read_direct), and the copy then checksums the
 * slab: two passes over every byte, each through main memory once the slab outgrows the caches. Here
 * each block of COPY_BLOCK bytes is checksummed right after it is copied, while it is still in the
 * first-level caches, so the CRC costs no memory traffic of its own. The value is crc32's, because it
 * is crc32_update's over consecutive blocks (a CRC carries from one block to the next exactly). */
#define COPY_BLOCK (16 * 1024)

#ifdef HAVE_X86
static int have_avx2 = 0;

/* memcpy by 32-byte loads and non-temporal stores: the destination (a slab on its way to a direct
 * write, which the CPU does not read again) goes to memory without first being read into the cache. */
__attribute__((target("avx2")))
static void copy_stream(unsigned char *dst, const unsigned char *src, size_t len) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > len) head = len;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    while (len >= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + 0x00));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 0x20));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 0x40));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 0x60));
        _mm256_stream_si256((__m256i *)(dst + 0x00), a);
        _mm256_stream_si256((__m256i *)(dst + 0x20), b);
        _mm256_stream_si256((__m256i *)(dst + 0x40), c);
        _mm256_stream_si256((__m256i *)(dst + 0x60), d);
        src += 128;
        dst += 128;
        len -= 128;
    }
    memcpy(dst, src, len);
}
#endif

/* Each block is checksummed first (its source bytes come into the first-level caches, from memory
 * once), then copied out of those caches; on x86 with AVX2 by non-temporal stores (copy_stream). */
static uint32_t copy_crc_update(uint32_t crc, unsigned char *dst, const unsigned char *src, size_t len) {
    while (len) {
        size_t k = len < COPY_BLOCK ? len : COPY_BLOCK;
        crc = crc32_update(crc, src, k);
#ifdef HAVE_X86
        if (have_avx2) copy_stream(dst, src, k); else
#endif
        memcpy(dst, src, k);
        dst += k;
        src += k;
        len -= k;
    }
#ifdef HAVE_X86
    if (have_avx2) _mm_sfence(); /* the streamed stores are visible before the buffer is handed on */
#endif
    return crc;
}

static PyObject *py_copy_crc(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "w*y*|k:copy_crc", &dst, &src, &value)) return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_crc: %zd bytes into a buffer of %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    const unsigned char *s = (const unsigned char *)src.buf;
    unsigned char *d = (unsigned char *)dst.buf;
    if (s < d + dst.len && d < s + src.len && src.len) {
        PyErr_SetString(PyExc_ValueError, "copy_crc: the buffers overlap");
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    uint32_t c = (uint32_t)(value & 0xffffffffUL);
    if (src.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        c = copy_crc_update(c, d, s, (size_t)src.len);
        Py_END_ALLOW_THREADS
    } else {
        c = copy_crc_update(c, d, s, (size_t)src.len);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(c);
}

/* zlib's crc32_combine: the CRC of A + B from crc(A), crc(B) and len(B), by multiplying crc(A)
 * by x^(8 len(B)) modulo the polynomial. The copy combines the CRCs of its pieces once per piece
 * (a storage of several source runs, an item of head, storage and tail); in Python each
 * multiplication is a 32-step loop of about 80 us, here well under a microsecond. */
static uint32_t x2n_table[32];

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

static uint32_t x2nmodp(unsigned long long n, unsigned k) {
    uint32_t p = (uint32_t)1 << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static PyObject *py_combine(PyObject *self, PyObject *args) {
    unsigned long crc1, crc2;
    long long len2;
    if (!PyArg_ParseTuple(args, "kkL:combine", &crc1, &crc2, &len2)) return NULL;
    if (len2 <= 0) return PyLong_FromUnsignedLong(crc1 & 0xffffffffUL);
    uint32_t c = multmodp(x2nmodp((unsigned long long)len2, 3), (uint32_t)(crc1 & 0xffffffffUL)) ^ (uint32_t)(crc2 & 0xffffffffUL);
    return PyLong_FromUnsignedLong(c);
}

/* crc32_width(data, value, width): the same value by at most `width`-bit folding, so the tests
 * check every path this CPU has, not only the widest. */
static PyObject *py_crc32_width(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long value = 0;
    int width = 256;
    if (!PyArg_ParseTuple(args, "y*ki:crc32_width", &view, &value, &width)) return NULL;
    uint32_t c = crc32_width((uint32_t)(value & 0xffffffffUL), (const unsigned char *)view.buf, (size_t)view.len, width);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *py_accelerated(PyObject *self, PyObject *noargs) {
#ifdef HAVE_X86
    return PyLong_FromLong(have_vclmul ? 256 : have_clmul ? 128 : 0);
#else
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"crc32", py_crc32, METH_VARARGS, "crc32(data, value=0) -> int: zlib.crc32's value, by PCLMULQDQ folding where the CPU has it"},
    {"crc32_width", py_crc32_width, METH_VARARGS, "crc32_width(data, value, width) -> int: crc32 by at most width-bit folding (tests)"},
    {"copy_crc", py_copy_crc, METH_VARARGS, "copy_crc(dst, src, value=0) -> int: dst[:] = src, and crc32(src, value), in one pass"},
    {"combine", py_combine, METH_VARARGS, "combine(crc1, crc2, len2) -> int: zlib's crc32_combine"},
    {"accelerated", py_accelerated, METH_NOARGS, "accelerated() -> int: the folding width this CPU takes (256: VPCLMULQDQ, 128: PCLMULQDQ, 0: tables)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastcrc", "zlib's CRC-32, native and folded by carry-less multiplication (reshard/storage/files/fastcrc.c).", -1, methods};

PyMODINIT_FUNC PyInit_fastcrc(void) {
    make_tables();
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
#ifdef HAVE_X86
    unsigned int a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) have_clmul = (c & bit_PCLMUL) && (c & bit_SSE4_1);
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
    have_vclmul = have_clmul && have_avx2 && __builtin_cpu_supports("vpclmulqdq");
#endif
    return PyModule_Create(&module);
}

/* costscan: the native form of reshard.storage.pickles.safe_pickle.pickle_cost.
 *
 * Why native: the cost scan walks every opcode of a `.metadata` before the C unpickler is
 * allowed to build anything (a memo reference can make a few bytes build gigabytes). In
 * Python that pass costs about 0.8 us per opcode, twice the unpickle itself at frontier
 * scale (12 M opcodes at 256 ranks). This file is the same algorithm, opcode for opcode,
 * with the same refusals in the same order; tests/test_costscan.py checks the two against
 * each other on real, random and hostile pickles. Protocol-0 text opcodes (never written
 * by DCP or torch.save) are handed back to the Python scan whole.
 *
 * Values on the simulated stack are int64: a value >= 0 is the weight of an immutable
 * value; a value < 0 is -(1 + i) for mutable container i, whose weight and "a second
 * reference was taken" flag live in `mut[i]` (bit 62). Weights saturate at CAP, which is
 * above any budget, so "weight > limit" tests give the same answers as Python's unbounded
 * integers.
 *
 * scan(data, limit) returns the cost (int), or a tuple (code, at, detail):
 *   (0, at, message)  a refusal "message (opcode at byte at)"
 *   (1, pos, None)    the pickle ends without STOP at byte pos
 *   (2, at, None)     a protocol-0 opcode: scan in Python instead
 *   (3, at, opcode)   an opcode DCP metadata and torch.save do not use
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CAP ((int64_t)1 << 61)
#define SHARED ((int64_t)1 << 62)
#define UNSET INT64_MIN

typedef struct {
    int64_t *v;
    size_t n, cap;
} Vec;

static int vec_push(Vec *s, int64_t x) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 1024;
        int64_t *p = (int64_t *)realloc(s->v, nc * sizeof(int64_t));
        if (!p) return -1;
        s->v = p;
        s->cap = nc;
    }
    s->v[s->n++] = x;
    return 0;
}

/* The memo: dense for the indices MEMOIZE hands out (0, 1, 2, ...), a small open-addressing
 * table for BINPUT indices far beyond them. `count` is len(memo) in the Python scan. */
typedef struct {
    int64_t *dense;
    size_t dcap;
    uint64_t *skeys; /* index + 1; 0 = empty */
    int64_t *svals;
    size_t scap, sn;
    size_t count;
} Memo;

static int64_t *sparse_slot(Memo *m, uint64_t idx, int create) {
    if (m->scap == 0) {
        if (!create) return NULL;
        m->scap = 64;
        m->skeys = (uint64_t *)calloc(m->scap, sizeof(uint64_t));
        m->svals = (int64_t *)calloc(m->scap, sizeof(int64_t));
        if (!m->skeys || !m->svals) return NULL;
    }
    size_t mask = m->scap - 1, h = (size_t)((idx + 1) * 0x9E3779B97F4A7C15ULL) & mask;
    while (m->skeys[h] && m->skeys[h] != idx + 1) h = (h + 1) & mask;
    if (m->skeys[h]) return &m->svals[h];
    if (!create) return NULL;
    if ((m->sn + 1) * 2 > m->scap) { /* grow, then insert */
        size_t oc = m->scap, nc = oc * 2;
        uint64_t *ok = m->skeys;
        int64_t *ov = m->svals;
        m->skeys = (uint64_t *)calloc(nc, sizeof(uint64_t));
        m->svals = (int64_t *)calloc(nc, sizeof(int64_t));
        if (!m->skeys || !m->svals) { free(ok); free(ov); return NULL; }
        m->scap = nc;
        for (size_t i = 0; i < oc; i++) {
            if (!ok[i]) continue;
            size_t j = (size_t)(ok[i] * 0x9E3779B97F4A7C15ULL) & (nc - 1);
            while (m->skeys[j]) j = (j + 1) & (nc - 1);
            m->skeys[j] = ok[i];
            m->svals[j] = ov[i];
        }
        free(ok);
        free(ov);
        return sparse_slot(m, idx, create);
    }
    m->skeys[h] = idx + 1;
    m->svals[h] = UNSET;
    m->sn++;
    return &m->svals[h];
}

/* Where memo[idx] lives (creating the slot when `create`); NULL when absent or out of memory.
 * An index is in exactly one place: the sparse table is asked first (an index put there
 * stays there even when the dense part later grows over it). */
static int64_t *memo_slot(Memo *m, uint64_t idx, int create) {
    if (m->sn) {
        int64_t *sl = sparse_slot(m, idx, 0);
        if (sl) return sl;
    }
    if (idx < m->dcap) return &m->dense[idx];
    if (!create) return NULL;
    if (idx < 2 * (uint64_t)m->dcap + 65536) { /* grow the dense part over idx: at most 8 bytes per pickle byte */
        size_t nc = m->dcap ? m->dcap : 4096;
        while (nc <= idx) nc *= 2;
        int64_t *p = (int64_t *)realloc(m->dense, nc * sizeof(int64_t));
        if (!p) return NULL;
        for (size_t i = m->dcap; i < nc; i++) p[i] = UNSET;
        m->dense = p;
        m->dcap = nc;
        return &m->dense[idx];
    }
    return sparse_slot(m, idx, 1);
}

typedef struct {
    Vec stack, marks, mut;
    Memo memo;
    int64_t work, limit;
    size_t pos, at, n;
    int code;           /* -1 none; 0 bad; 1 eof; 2 fallback; 3 unknown opcode; 4 out of memory */
    const char *msg;    /* for code 0 */
    char buf[128];      /* a formatted message */
    int unknown_op;
} Scan;

static inline int64_t sat(int64_t a, int64_t b) { return (a >= CAP - b) ? CAP : a + b; }
static inline int64_t weight(Scan *s, int64_t x) { return x >= 0 ? x : (s->mut.v[-1 - x] & ~SHARED); }
static inline size_t fence(Scan *s) { return s->marks.n ? (size_t)s->marks.v[s->marks.n - 1] : 0; }

#define BAD(text) do { s->code = 0; s->msg = (text); return -1; } while (0)
#define EOFAT(p) do { s->code = 1; s->pos = ((p) < s->n ? (p) : s->n); return -1; } while (0)
#define NOMEM() do { s->code = 4; return -1; } while (0)
#define OVER() do { snprintf(s->buf, sizeof s->buf, "it builds more than its budget of %lld units", (long long)s->limit); \
                    s->msg = s->buf; s->code = 0; return -1; } while (0)
#define PUSH(x) do { if (vec_push(&s->stack, (x)) < 0) NOMEM(); } while (0)

static int new_mut(Scan *s, int64_t w, int64_t *out) {
    if (vec_push(&s->mut, w) < 0) return -1;
    *out = -(int64_t)s->mut.n;
    return 0;
}

/* pop()/top(): refused below the innermost MARK, as in the Python scan. */
#define POP(dst) do { if (s->stack.n <= fence(s)) BAD("stack underflow"); (dst) = s->stack.v[--s->stack.n]; } while (0)
#define TOP(dst) do { if (s->stack.n <= fence(s)) BAD("stack underflow"); (dst) = s->stack.v[s->stack.n - 1]; } while (0)

/* target(x): the mutable container x, refused when immutable or already referenced twice. */
static int64_t *target(Scan *s, int64_t x) {
    if (x >= 0) { s->code = 0; s->msg = "items are given to a value that cannot hold them"; return NULL; }
    int64_t *t = &s->mut.v[-1 - x];
    if (*t & SHARED) { s->code = 0; s->msg = "an object is changed after a reference to it was taken"; return NULL; }
    return t;
}

/* to_mark(): the items above the innermost MARK, which is popped; *start is where they begin. */
static int to_mark(Scan *s, size_t *start) {
    if (!s->marks.n) BAD("an opcode that needs a MARK has none");
    *start = (size_t)s->marks.v[--s->marks.n];
    return 0;
}

static int64_t weigh(Scan *s, size_t from, size_t to, size_t step) {
    int64_t w = 0;
    for (size_t i = from; i < to; i += step) w = sat(w, weight(s, s->stack.v[i]));
    return w;
}

static int length(Scan *s, const unsigned char *d, size_t size, int is_signed, int64_t *ln) {
    size_t pos = s->pos, n = s->n;
    if (pos + size > n) BAD("truncated");
    uint64_t v;
    if (size == 1) v = d[pos];
    else if (size == 4) {
        uint32_t u;
        memcpy(&u, d + pos, 4);
        v = is_signed ? (uint64_t)(int64_t)(int32_t)u : u;
        if (is_signed && (int32_t)u < 0) BAD("a length runs past the end of the pickle");
    } else memcpy(&v, d + pos, 8);
    if (v > (uint64_t)(n - pos - size)) BAD("a length runs past the end of the pickle");
    *ln = (int64_t)v;
    s->pos = pos + size + (size_t)v;
    return 0;
}

/* A memo index set a second time: a pickler sets each once, as it builds the object (PickleMemoFault). */
static int set_twice(Scan *s, uint64_t idx) {
    snprintf(s->buf, sizeof s->buf, "memo index %llu is set twice", (unsigned long long)idx);
    s->msg = s->buf;
    s->code = 0;
    return -1;
}

static int put(Scan *s, uint64_t idx) {
    if (idx > s->n) {
        snprintf(s->buf, sizeof s->buf, "memo index %llu is larger than the pickle", (unsigned long long)idx);
        s->msg = s->buf;
        s->code = 0;
        return -1;
    }
    int64_t x;
    TOP(x);
    int64_t *slot = memo_slot(&s->memo, idx, 1);
    if (!slot) NOMEM();
    if (*slot != UNSET) return set_twice(s, idx);
    s->memo.count++;
    *slot = x;
    return 0;
}

static inline uint32_t u4at(const unsigned char *d, size_t pos) {
    uint32_t u;
    memcpy(&u, d + pos, 4);
    return u;
}

/* The scan; 1 with the total in *total at STOP, -1 with s->code set otherwise. */
static int run(Scan *s, const unsigned char *d, int64_t *total) {
    const size_t n = s->n;
    int64_t x, y, add, w, *t;
    size_t start;
    for (;;) {
        if (s->pos >= n) EOFAT(s->pos);
        unsigned char op = d[s->pos];
        s->at = s->pos;
        s->pos++;
        switch (op) {
        case 0x94: { /* MEMOIZE */
            if (s->stack.n <= fence(s)) BAD("stack underflow");
            uint64_t idx = s->memo.count;
            int64_t *slot = memo_slot(&s->memo, idx, 1);
            if (!slot) NOMEM();
            if (*slot != UNSET) return set_twice(s, idx); /* an index a BINPUT took: MEMOIZE would rebind it */
            s->memo.count++;
            *slot = s->stack.v[s->stack.n - 1];
            break;
        }
        case 0x68: case 0x6A: { /* BINGET, LONG_BINGET */
            uint64_t idx;
            if (op == 0x68) {
                if (s->pos >= n) EOFAT(s->pos);
                idx = d[s->pos];
                s->pos += 1;
            } else {
                if (s->pos + 4 > n) EOFAT(s->pos);
                idx = u4at(d, s->pos);
                s->pos += 4;
            }
            int64_t *slot = memo_slot(&s->memo, idx, 0);
            if (!slot || *slot == UNSET) {
                snprintf(s->buf, sizeof s->buf, "memo index %llu was never set", (unsigned long long)idx);
                BAD(s->buf);
            }
            x = *slot;
            if (x < 0) s->mut.v[-1 - x] |= SHARED;
            PUSH(x);
            break;
        }
        case 0x85: /* TUPLE1 */
            if (s->stack.n <= fence(s)) BAD("stack underflow");
            s->stack.v[s->stack.n - 1] = sat(1, weight(s, s->stack.v[s->stack.n - 1]));
            break;
        case 0x28: /* MARK */
            if (vec_push(&s->marks, (int64_t)s->stack.n) < 0) NOMEM();
            break;
        case 0x29: /* EMPTY_TUPLE */
            PUSH(1);
            break;
        case 0x81: case 0x52: /* NEWOBJ, REDUCE */
            if (s->stack.n < fence(s) + 2) BAD("stack underflow");
            x = s->stack.v[--s->stack.n];
            add = weight(s, x);
            s->work = sat(s->work, add);
            if (s->work > s->limit) OVER();
            if (new_mut(s, sat(1, add), &y) < 0) NOMEM();
            s->stack.v[s->stack.n - 1] = y;
            break;
        case 0x62: /* BUILD */
            POP(x);
            TOP(y);
            if (!(t = target(s, y))) return -1;
            add = weight(s, x);
            *t = sat(*t, add);
            s->work = sat(s->work, add);
            if (*t > s->limit || s->work > s->limit) OVER();
            break;
        case 0x4B: case 0x4D: case 0x4A: case 0x47: /* BININT1, BININT2, BININT, BINFLOAT */
            s->pos += (op == 0x4B) ? 1 : (op == 0x4D) ? 2 : (op == 0x4A) ? 4 : 8;
            PUSH(1);
            break;
        case 0x75: case 0x73: { /* SETITEMS, SETITEM */
            size_t lo, hi;
            int64_t kv[2];
            if (op == 0x75) {
                if (to_mark(s, &start) < 0) return -1;
                lo = start;
                hi = s->stack.n;
            } else {
                POP(kv[1]);
                POP(kv[0]);
                lo = hi = 0;
            }
            if ((op == 0x75) && ((hi - lo) % 2)) BAD("odd number of items for SETITEMS");
            int64_t keys, vals;
            if (op == 0x75) {
                keys = weigh(s, lo, hi, 2);
                vals = weigh(s, lo + 1, hi, 2);
                s->stack.n = lo;
            } else {
                keys = weight(s, kv[0]);
                vals = weight(s, kv[1]);
            }
            TOP(y);
            if (!(t = target(s, y))) return -1;
            *t = sat(*t, sat(keys, vals));
            s->work = sat(s->work, keys);
            if (*t > s->limit || s->work > s->limit) OVER();
            break;
        }
        case 0x7D: case 0x5D: case 0x8F: /* EMPTY_DICT, EMPTY_LIST, EMPTY_SET */
            if (new_mut(s, 1, &y) < 0) NOMEM();
            PUSH(y);
            break;
        case 0x4E: case 0x88: case 0x89: /* NONE, NEWTRUE, NEWFALSE */
            PUSH(1);
            break;
        case 0x8C: case 0x55: case 0x43: case 0x8A: /* one-byte lengths */
            if (length(s, d, 1, 0, &x) < 0) return -1;
            PUSH(1 + x / 8);
            break;
        case 0x61: /* APPEND */
            POP(x);
            TOP(y);
            if (!(t = target(s, y))) return -1;
            *t = sat(*t, weight(s, x));
            if (*t > s->limit) OVER();
            break;
        case 0x65: case 0x90: /* APPENDS, ADDITEMS */
            if (to_mark(s, &start) < 0) return -1;
            add = weigh(s, start, s->stack.n, 1);
            s->stack.n = start;
            TOP(y);
            if (!(t = target(s, y))) return -1;
            *t = sat(*t, add);
            if (op == 0x90) s->work = sat(s->work, add);
            if (*t > s->limit || s->work > s->limit) OVER();
            break;
        case 0x86: case 0x87: { /* TUPLE2, TUPLE3 */
            size_t k = (size_t)(op - 0x84);
            if (s->stack.n < fence(s) + k) BAD("stack underflow");
            w = sat(1, weigh(s, s->stack.n - k, s->stack.n, 1));
            s->stack.n -= k;
            if (w > s->limit) OVER();
            PUSH(w);
            break;
        }
        case 0x74: case 0x6C: case 0x64: case 0x91: /* TUPLE, LIST, DICT, FROZENSET */
            if (to_mark(s, &start) < 0) return -1;
            w = sat(1, weigh(s, start, s->stack.n, 1));
            if (op == 0x64) s->work = sat(s->work, weigh(s, start, s->stack.n, 2));
            else if (op == 0x91) s->work = sat(s->work, w);
            s->stack.n = start;
            if (w > s->limit || s->work > s->limit) OVER();
            if (op == 0x6C || op == 0x64) {
                if (new_mut(s, w, &y) < 0) NOMEM();
                PUSH(y);
            } else PUSH(w);
            break;
        case 0x71: /* BINPUT */
            if (s->pos >= n) EOFAT(s->pos);
            if (put(s, d[s->pos]) < 0) return -1;
            s->pos += 1;
            break;
        case 0x72: /* LONG_BINPUT */
            if (s->pos + 4 > n) EOFAT(s->pos);
            if (put(s, u4at(d, s->pos)) < 0) return -1;
            s->pos += 4;
            break;
        case 0x58: case 0x42: /* BINUNICODE, BINBYTES */
            if (length(s, d, 4, 0, &x) < 0) return -1;
            PUSH(1 + x / 8);
            break;
        case 0x54: case 0x8B: /* BINSTRING, LONG4 */
            if (length(s, d, 4, 1, &x) < 0) return -1;
            PUSH(1 + x / 8);
            break;
        case 0x8D: case 0x8E: case 0x96: /* BINUNICODE8, BINBYTES8, BYTEARRAY8 */
            if (length(s, d, 8, 0, &x) < 0) return -1;
            PUSH(1 + x / 8);
            break;
        case 0x93: /* STACK_GLOBAL */
            POP(x);
            POP(x);
            PUSH(1);
            break;
        case 0x92: /* NEWOBJ_EX */
            POP(x);
            POP(y);
            add = sat(weight(s, x), weight(s, y));
            POP(x);
            s->work = sat(s->work, add);
            if (s->work > s->limit) OVER();
            if (new_mut(s, sat(1, add), &y) < 0) NOMEM();
            PUSH(y);
            break;
        case 0x6F: /* OBJ */
            if (to_mark(s, &start) < 0) return -1;
            if (start == s->stack.n) BAD("OBJ without a class");
            add = weigh(s, start, s->stack.n, 1);
            s->stack.n = start;
            s->work = sat(s->work, add);
            if (s->work > s->limit) OVER();
            if (new_mut(s, sat(1, add), &y) < 0) NOMEM();
            PUSH(y);
            break;
        case 0x51: /* BINPERSID */
            POP(x);
            PUSH(sat(1, weight(s, x)));
            break;
        case 0x32: /* DUP */
            TOP(x);
            if (x < 0) s->mut.v[-1 - x] |= SHARED;
            PUSH(x);
            break;
        case 0x30: /* POP (a MARK on top is popped instead) */
            if (s->marks.n && (size_t)s->marks.v[s->marks.n - 1] == s->stack.n) s->marks.n--;
            else POP(x);
            break;
        case 0x31: /* POP_MARK */
            if (to_mark(s, &start) < 0) return -1;
            s->stack.n = start;
            break;
        case 0x80: /* PROTO */
            s->pos += 1;
            break;
        case 0x95: /* FRAME: the framed opcodes follow inline */
            {
                size_t keep = s->pos;
                if (length(s, d, 8, 0, &x) < 0) return -1;
                s->pos = keep + 8;
            }
            break;
        case 0x2E: /* STOP */
            POP(x);
            *total = sat(s->work, weight(s, x));
            if (*total > s->limit) OVER();
            return 1;
        case 'I': case 'L': case 'F': case 'S': case 'V': case 'p': case 'g': case 'c': case 'i': case 'P':
            s->code = 2;
            return -1;
        default:
            s->code = 3;
            s->unknown_op = op;
            return -1;
        }
    }
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer buf;
    long long limit;
    if (!PyArg_ParseTuple(args, "y*L", &buf, &limit)) return NULL;
    Scan s;
    memset(&s, 0, sizeof s);
    s.n = (size_t)buf.len;
    s.limit = limit;
    s.code = -1;
    int64_t total = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = run(&s, (const unsigned char *)buf.buf, &total);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    free(s.stack.v);
    free(s.marks.v);
    free(s.mut.v);
    free(s.memo.dense);
    free(s.memo.skeys);
    free(s.memo.svals);
    if (r == 1) return PyLong_FromLongLong(total);
    switch (s.code) {
    case 0: return Py_BuildValue("(ins)", 0, (Py_ssize_t)s.at, s.msg);
    case 1: return Py_BuildValue("(inO)", 1, (Py_ssize_t)s.pos, Py_None);
    case 2: return Py_BuildValue("(inO)", 2, (Py_ssize_t)s.at, Py_None);
    case 3: return Py_BuildValue("(ini)", 3, (Py_ssize_t)s.at, s.unknown_op);
    default: return PyErr_NoMemory();
    }
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(data, limit) -> cost, or (code, at, detail): see reshard/storage/pickles/costscan.c"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "costscan", "The native pickle cost scan of reshard.storage.pickles.safe_pickle.", -1, methods};

PyMODINIT_FUNC PyInit_costscan(void) { return PyModule_Create(&module); }

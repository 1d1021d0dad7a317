/* metadecode: DCP `.metadata` decoded straight into columns, streamed from a file descriptor.
 *
 * Why native: the safe Python path (safe_pickle.load_metadata_pickle, then dcp._decode) builds
 * the whole record tree first, and the pickle memoizes every object, so the tree lives until the
 * load ends: ~1.5 GiB for the 148 MiB `.metadata` of Llama-3-8B x 1,024 ranks, and far more than
 * a machine has for 405B x 16,384 ranks (9.4 GB, 42-56 M chunks and storage entries). This walks
 * the opcodes once (plus a first, cheaper pass), keeps only what is still being built and the
 * memo entries the pickle fetches again, and emits each chunk and each storage entry as a row of
 * packed int64 columns the moment its record is complete. Memory is the columns plus bounded
 * buffers; nothing is allocated per chunk that outlives the chunk.
 *
 * It is a fast path, never a judge: anything outside the subset that torch's pickler and reshard's
 * own writer (reshard.storage.pickles.metadata_pickle) produce (an unknown global, an opcode neither uses,
 * a memo fetch of a container or record, a truncated or malformed stream, an opcode across a
 * frame's end, a chunk whose rank differs from its tensor's, BINPUT indices that do not rise (one
 * set twice), an int outside int64, a Metadata field it does not know such as Megatron's
 * all_local_plans, nesting deeper than MAXDEPTH, the cost budget of safe_pickle.pickle_cost
 * exceeded) makes decode() return None, and the caller takes the safe
 * Python path, which stays the reference and words the refusal. Where decode() answers, its columns
 * equal what the Python path reads (tests/test_metadecode.py).
 *
 * decode(fd, size, allow, dtypes, limit, block=16 MiB) -> dict | None
 *   fd      an open file, read with pread from offset 0 to `size` (never past it);
 *   allow   {(module, name): role}: the allow list of formats/dcp_metadata.toml as roles. Roles:
 *           the record names "Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
 *           "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
 *           "_StorageInfo", and "size", "dtype" (module torch, name "*"), "enum", "layout",
 *           "path", "ordered_dict". Any other role (Megatron's "SavePlan", ...) and "_StoragePrefix"
 *           are allowed to be listed but make decode() return None when the pickle names them.
 *   dtypes  the valid dtype names (a set or frozenset of str): `torch.<name>` is a dtype only then.
 *   limit   the cost budget (safe_pickle.pickle_budget(size)): a pickle the Python path would refuse
 *           as too costly is refused here too (None), with the same weights as costscan.c.
 *   block   read-block size in bytes (tests make it tiny to cross every block boundary); one opcode
 *           whose payload is longer grows the buffer to that payload, which is inside the file.
 * It holds the GIL throughout and checks for signals every 8 MiB read: an exception a signal handler
 * raises (KeyboardInterrupt) comes out of decode() as it is; nothing else raises.
 *
 * The result (all "bytes" are little-endian packed arrays for numpy.frombuffer):
 *   version        str | None
 *   keys           list[str], state_dict_metadata keys in file order (no duplicates: else None)
 *   kinds          bytes uint8 per key: 0 TensorStorageMetadata, 1 BytesStorageMetadata
 *   dtypes         list[str | None] per key;  shapes: list[tuple[int, ...] | None] per key
 *   chunk_count    bytes int64 per key (0 for bytes entries)
 *   chunk_offsets, chunk_sizes  bytes int64, flat: key k's chunks are rows of len(shape) values
 *   files, fqns    list[str], distinct relative_path / MetadataIndex.fqn values, first-seen order
 *   transforms     list[tuple[str, ...]], distinct non-empty transform_descriptors
 *   st_fqn int32, st_ndim int8 (-1: offset None), st_offsets int64 flat, st_index int64 (-1: None),
 *   st_file int32, st_offset int64, st_length int64, st_transforms int32 (-1: None or empty):
 *                  one row per storage_data pair in file order. A repeated (fqn, offset) key,
 *                  which torch never writes, is two rows here; a dict keeps the first key's place
 *                  and the last value, and so must a caller that cares.
 *   planner_data   the planner_data value as plain Python (dicts, lists, tuples, str, int, None)
 *   storage_meta   None or {"checkpoint_id", "save_id", "load_id", "modules"} (a pathlib path is
 *                  its parts joined with "/", as safe_pickle._path does)
 *   memo_kept      how many memo entries the pickle fetches (each kept until the end): a few
 *                  hundred for torch's files whatever their size; the one cost not in the columns
 * Validation of values (non-negative byte ranges, file names, dtypes reshard can store) stays in
 * Python, on the columns.
 *
 * The memo: a first pass records which memo indices are ever fetched (a bitmap over indices,
 * sized by the largest fetched index, which is below the pickle's length); the second pass keeps
 * only those, in a dense array addressed by the index's rank among the fetched ones. Values are
 * refcounted nodes; a fetched value must be an immutable leaf (str, int, tuple, global).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define CAP ((int64_t)1 << 61)
#define MAXDEPTH 64
#define MAXDIMS 64

/* ------------------------------------------------------------------ reading in blocks */

typedef struct {
    int fd;
    uint64_t size;     /* bytes of pickle: never read past */
    uint64_t base;     /* file offset of buf[0] */
    unsigned char *buf;
    size_t cap, len, pos, block;
    uint64_t checked;  /* where signals were last checked */
    int interrupted;   /* a signal handler raised (Ctrl-C): decode() lets its exception through */
} Rd;

/* Make buf[pos, pos + k) valid; -1 when the pickle (or the file) ends first or a read fails. */
static int rd_fill(Rd *r, size_t k) {
    uint64_t at = r->base + r->pos;
    if ((uint64_t)k > r->size - at) return -1;
    if (at - r->checked >= ((uint64_t)8 << 20)) { /* a 9 GB file takes a minute: stay interruptible */
        r->checked = at;
        if (PyErr_CheckSignals() < 0) { r->interrupted = 1; return -1; }
    }
    if (r->pos) { /* keep the unread tail at the front */
        memmove(r->buf, r->buf + r->pos, r->len - r->pos);
        r->len -= r->pos;
        r->base = at;
        r->pos = 0;
    }
    size_t want = k > r->block ? k : r->block;
    if ((uint64_t)want > r->size - at) want = (size_t)(r->size - at);
    if (want > r->cap) {
        unsigned char *p = (unsigned char *)realloc(r->buf, want);
        if (!p) return -1;
        r->buf = p;
        r->cap = want;
    }
    while (r->len < want) {
        ssize_t got = pread(r->fd, r->buf + r->len, want - r->len, (off_t)(r->base + r->len));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        r->len += (size_t)got;
    }
    return r->len >= k ? 0 : -1;
}

#define NEED(r, k) (((r)->pos + (k) <= (r)->len) ? 0 : rd_fill((r), (k)))

static inline uint32_t u4(const unsigned char *p) { uint32_t u; memcpy(&u, p, 4); return u; }
static inline uint64_t u8(const unsigned char *p) { uint64_t u; memcpy(&u, p, 8); return u; }

/* ------------------------------------------------------------------ values */

enum { K_NONE, K_BOOL, K_INT, K_STR, K_TUPLE, K_GLOBAL, K_LIST, K_DICT, K_REC };
enum { R_METADATA = 1, R_TSM, R_BSM, R_CHUNK, R_PROPS, R_MINDEX, R_SMETA, R_SINFO,
       R_SIZE, R_DTYPE, R_ENUM, R_LAYOUT, R_PATH, R_ODICT, R_OTHER };

typedef struct Node {
    int32_t rc;
    uint8_t t;
    uint8_t depth;
    uint8_t holds_mutable; /* a tuple holding a list, dict or record (at any depth): never fetched from the memo */
} Node;

typedef struct {
    Node *p;
    int64_t i; /* K_INT, K_BOOL: the value; K_GLOBAL: role | dtype id << 8 */
    int64_t w; /* cost weight of an immutable value (mutable ones keep theirs in the node) */
    uint8_t k;
} Val;

typedef struct { Node h; size_t len; char s[]; } Str;
typedef struct { Node h; size_t n; Val v[]; } Tup;
typedef struct {           /* K_LIST (pairs = 0) or K_DICT (pairs = 1, v holds key, value, ...) */
    Node h;
    int64_t w;
    int mode;              /* 0 plain items in v; 1 chunk list / state_dict_metadata / storage_data rows */
    Val *v;
    size_t n, cap;
    int64_t start, count;  /* mode 1: rows [start, start + count) of its column */
    int ndim;              /* chunk list: the chunks' rank */
    int dmode;             /* dict: 1 state_dict_metadata rows, 2 storage_data rows */
} Cont;
typedef struct {
    Node h;
    int64_t w;
    int role;
    int built;
    Val state;
    int64_t row; /* a chunk: its row in the chunk columns */
    int ndim;
} Rec;

static const Val NONE_V = {NULL, 0, 1, K_NONE};

/* Small blocks (nodes, short strings, small item arrays) are recycled through free lists by size
 * class: a `.metadata` makes and drops a few of them per chunk, and malloc was a fifth of the time.
 * The lists hold at most what was live at once; decode() empties them before it returns (it holds
 * the GIL throughout, so one set of lists serves every call). */
#define NCLASS 16
static void *pool[NCLASS];

static void *palloc(size_t n) {
    size_t c = (n + 15) / 16;
    if (c == 0) c = 1;
    if (c <= NCLASS && pool[c - 1]) {
        void *p = pool[c - 1];
        pool[c - 1] = *(void **)p;
        return p;
    }
    return malloc(c <= NCLASS ? c * 16 : n);
}
static void pfree(void *p, size_t n) {
    size_t c = (n + 15) / 16;
    if (c == 0) c = 1;
    if (c <= NCLASS) { *(void **)p = pool[c - 1]; pool[c - 1] = p; }
    else free(p);
}
static void pool_drain(void) {
    for (int c = 0; c < NCLASS; c++)
        while (pool[c]) { void *p = pool[c]; pool[c] = *(void **)p; free(p); }
}

static void node_free(Node *n);
static inline void vdec(Val v) { if (v.p && --v.p->rc == 0) node_free(v.p); }
static inline Val vinc(Val v) { if (v.p) v.p->rc++; return v; }

static void node_free(Node *n) {
    switch (n->t) {
    case K_STR: pfree(n, sizeof(Str) + ((Str *)n)->len + 1); return;
    case K_TUPLE: {
        Tup *t = (Tup *)n;
        for (size_t i = 0; i < t->n; i++) vdec(t->v[i]);
        pfree(n, sizeof(Tup) + t->n * sizeof(Val));
        return;
    }
    case K_LIST: case K_DICT: {
        Cont *c = (Cont *)n;
        for (size_t i = 0; i < c->n; i++) vdec(c->v[i]);
        if (c->v) pfree(c->v, c->cap * sizeof(Val));
        pfree(n, sizeof(Cont));
        return;
    }
    case K_REC: vdec(((Rec *)n)->state); pfree(n, sizeof(Rec)); return;
    default: free(n);
    }
}

static inline int64_t sat(int64_t a, int64_t b) { return (a >= CAP - b) ? CAP : a + b; }
static inline int64_t weight(Val v) {
    if (v.k == K_LIST || v.k == K_DICT) return ((Cont *)v.p)->w;
    if (v.k == K_REC) return ((Rec *)v.p)->w;
    return v.w;
}
static inline int mutable_(Val v) { return v.k == K_LIST || v.k == K_DICT || v.k == K_REC; }
static inline int vdepth(Val v) { return v.p ? v.p->depth : 0; }

/* ------------------------------------------------------------------ growable columns */

typedef struct { PyObject *b; size_t n, cap; } Col; /* a bytes object grown in place */

static int col_reserve(Col *c, size_t more) {
    if (c->n + more <= c->cap) return 0;
    size_t nc = c->cap ? c->cap : 4096;
    while (nc < c->n + more) nc *= 2;
    if (!c->b) { c->b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)nc); if (!c->b) return -1; }
    else if (_PyBytes_Resize(&c->b, (Py_ssize_t)nc) < 0) { c->b = NULL; return -1; }
    c->cap = nc;
    return 0;
}
static inline int col_put(Col *c, const void *p, size_t k) {
    if (c->n + k > c->cap && col_reserve(c, k) < 0) return -1;
    memcpy(PyBytes_AS_STRING(c->b) + c->n, p, k);
    c->n += k;
    return 0;
}
static inline int col_i64(Col *c, int64_t x) { return col_put(c, &x, 8); }
static inline int col_i32(Col *c, int32_t x) { return col_put(c, &x, 4); }
static inline int col_i8(Col *c, int8_t x) { return col_put(c, &x, 1); }
static PyObject *col_take(Col *c) {
    if (!c->b) return PyBytes_FromStringAndSize(NULL, 0);
    if (_PyBytes_Resize(&c->b, (Py_ssize_t)c->n) < 0) { c->b = NULL; return NULL; }
    PyObject *b = c->b;
    c->b = NULL;
    return b;
}

/* ------------------------------------------------------------------ interning (fqns, files, transforms) */

typedef struct {
    uint64_t *h;     /* hash per slot, 0 = empty */
    int32_t *ix;     /* index per slot */
    size_t cap, n;
    char **keys;     /* by index */
    size_t *lens;
    size_t kcap;
} Intern;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) { h ^= (unsigned char)s[i]; h *= 1099511628211ULL; }
    return h ? h : 1;
}

/* The index of bytes s[0:n] (added when new); -1 out of memory or past INT32_MAX distinct. */
static int64_t intern(Intern *t, const char *s, size_t n) {
    uint64_t h = hash_bytes(s, n);
    if ((t->n + 1) * 2 > t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 256;
        uint64_t *nh = (uint64_t *)calloc(nc, sizeof(uint64_t));
        int32_t *ni = (int32_t *)malloc(nc * sizeof(int32_t));
        if (!nh || !ni) { free(nh); free(ni); return -1; }
        for (size_t i = 0; i < t->cap; i++) {
            if (!t->h[i]) continue;
            size_t j = (size_t)t->h[i] & (nc - 1);
            while (nh[j]) j = (j + 1) & (nc - 1);
            nh[j] = t->h[i];
            ni[j] = t->ix[i];
        }
        free(t->h); free(t->ix);
        t->h = nh; t->ix = ni; t->cap = nc;
    }
    size_t j = (size_t)h & (t->cap - 1);
    while (t->h[j]) {
        if (t->h[j] == h) {
            int32_t k = t->ix[j];
            if (t->lens[k] == n && memcmp(t->keys[k], s, n) == 0) return k;
        }
        j = (j + 1) & (t->cap - 1);
    }
    if (t->n >= INT32_MAX) return -1;
    if (t->n == t->kcap) {
        size_t nc = t->kcap ? t->kcap * 2 : 64;
        char **nk = (char **)realloc(t->keys, nc * sizeof(char *));
        if (!nk) return -1;
        t->keys = nk;
        size_t *nl = (size_t *)realloc(t->lens, nc * sizeof(size_t));
        if (!nl) return -1;
        t->lens = nl;
        t->kcap = nc;
    }
    char *copy = (char *)malloc(n ? n : 1);
    if (!copy) return -1;
    memcpy(copy, s, n);
    t->keys[t->n] = copy;
    t->lens[t->n] = n;
    t->h[j] = h;
    t->ix[j] = (int32_t)t->n;
    return (int64_t)t->n++;
}

static void intern_free(Intern *t) {
    for (size_t i = 0; i < t->n; i++) free(t->keys[i]);
    free(t->keys); free(t->lens); free(t->h); free(t->ix);
}

static PyObject *pystr(const char *s, size_t n) { return PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "surrogatepass"); }

/* ------------------------------------------------------------------ the decoder's state */

typedef struct {
    Rd rd;
    PyObject *allow, *dtypes;
    int64_t limit, work;
    /* pass 1: which memo indices are fetched */
    uint64_t *bits;
    size_t nbits_words;
    uint32_t *rank;     /* fetched indices below word w */
    Val *slots;         /* pass 2: the kept memo values, by rank */
    size_t nslots;
    int memo_mode;      /* 0 unknown, 1 MEMOIZE, 2 BINPUT */
    uint64_t memo_count;
    /* the stack */
    Val *st;
    size_t sn, scap;
    size_t *marks;
    size_t mn, mcap;
    /* globals met: role and dtype name per dtype id */
    PyObject *dtype_names;  /* list of str */
    /* output */
    PyObject *keys, *key_dtypes, *shapes, *seen_keys;
    Col kinds, chunk_count, chunk_offsets, chunk_sizes;
    int64_t chunk_rows, chunk_used;
    Col st_fqn, st_ndim, st_offsets, st_index, st_file, st_offset, st_length, st_transforms;
    int64_t st_rows;
    Intern fqns, files, transforms;
    PyObject *transform_tuples;  /* list, by transform index */
} D;

/* ------------------------------------------------------------------ pass 1: the fetched memo indices */

static int mark_fetched(D *d, uint64_t idx) {
    size_t w = (size_t)(idx >> 6);
    if (w >= d->nbits_words) {
        size_t nw = d->nbits_words ? d->nbits_words : 64;
        while (nw <= w) nw *= 2;
        uint64_t *p = (uint64_t *)realloc(d->bits, nw * sizeof(uint64_t));
        if (!p) return -1;
        memset(p + d->nbits_words, 0, (nw - d->nbits_words) * sizeof(uint64_t));
        d->bits = p;
        d->nbits_words = nw;
    }
    d->bits[w] |= (uint64_t)1 << (idx & 63);
    return 0;
}

/* The length of an opcode's argument, read at r->pos (just after the opcode); -1 when unsupported or cut. */
static int64_t arg_len(Rd *r, unsigned char op) {
    switch (op) {
    case 0x94: case 0x85: case 0x28: case 0x29: case 0x81: case 0x52: case 0x62: case 0x75: case 0x73:
    case 0x7D: case 0x5D: case 0x4E: case 0x88: case 0x89: case 0x61: case 0x65: case 0x86: case 0x87:
    case 0x74: case 0x93: case 0x2E: case 0x30:
        return 0;
    case 0x4B: case 0x68: case 0x71: case 0x80: return 1;   /* BININT1, BINGET, BINPUT, PROTO */
    case 0x4D: return 2;                                     /* BININT2 */
    case 0x4A: case 0x6A: case 0x72: return 4;               /* BININT, LONG_BINGET, LONG_BINPUT */
    case 0x95: return 8;                                     /* FRAME (its bytes follow inline) */
    case 0x8C: case 0x8A:                                    /* SHORT_BINUNICODE, LONG1 */
        if (NEED(r, 1) < 0) return -1;
        return 1 + (int64_t)r->buf[r->pos];
    case 0x58:                                               /* BINUNICODE */
        if (NEED(r, 4) < 0) return -1;
        return 4 + (int64_t)u4(r->buf + r->pos);
    case 0x8D: {                                             /* BINUNICODE8 */
        if (NEED(r, 8) < 0) return -1;
        uint64_t n = u8(r->buf + r->pos);
        if (n > r->size) return -1;
        return 8 + (int64_t)n;
    }
    default: return -1;
    }
}

static int pass1(D *d) {
    Rd *r = &d->rd;
    uint64_t count = 0, next_put = 0;
    int mode = 0;
    for (;;) {
        if (NEED(r, 1) < 0) return -1;
        unsigned char op = r->buf[r->pos++];
        if (op == 0x2E) return 0;
        int64_t n = arg_len(r, op);
        if (n < 0) return -1;
        if ((uint64_t)n > r->size - (r->base + r->pos)) return -1;
        if (op == 0x94 || op == 0x71 || op == 0x72) {
            int m = op == 0x94 ? 1 : 2;
            if (mode && mode != m) return -1;  /* MEMOIZE and BINPUT in one pickle: not what pickle writes */
            mode = m;
            if (op == 0x94) count++;
            else { /* BINPUT indices rise, as a pickler hands them out: an index set twice is the safe path's to refuse */
                if (NEED(r, (size_t)n) < 0) return -1;
                uint64_t idx = op == 0x71 ? r->buf[r->pos] : u4(r->buf + r->pos);
                if (idx < next_put) return -1;
                next_put = idx + 1;
            }
        }
        if (op == 0x68 || op == 0x6A) {
            if (NEED(r, (size_t)n) < 0) return -1;
            uint64_t idx = op == 0x68 ? r->buf[r->pos] : u4(r->buf + r->pos);
            if (mode == 1 ? idx >= count : idx > r->size) return -1;
            if (mark_fetched(d, idx) < 0) return -1;
        }
        if (r->pos + (size_t)n <= r->len) r->pos += (size_t)n;
        else { /* skip a long payload without reading it */
            uint64_t to = r->base + r->pos + (uint64_t)n;
            r->base = to;
            r->pos = r->len = 0;
        }
    }
}

/* ------------------------------------------------------------------ pass 2 helpers */

#define FAIL() do { return -1; } while (0)

static inline int push(D *d, Val v) {
    if (d->sn == d->scap) {
        size_t nc = d->scap ? d->scap * 2 : 256;
        Val *p = (Val *)realloc(d->st, nc * sizeof(Val));
        if (!p) { vdec(v); return -1; }
        d->st = p;
        d->scap = nc;
    }
    d->st[d->sn++] = v;
    return 0;
}
static inline size_t fence(D *d) { return d->mn ? d->marks[d->mn - 1] : 0; }
static inline int pop(D *d, Val *out) {
    if (d->sn <= fence(d)) return -1;
    *out = d->st[--d->sn];
    return 0;
}
static int to_mark(D *d, size_t *start) {
    if (!d->mn) return -1;
    *start = d->marks[--d->mn];
    return 0;
}

static Str *str_new(const char *s, size_t n) {
    Str *x = (Str *)palloc(sizeof(Str) + n + 1);
    if (!x) return NULL;
    x->h.rc = 1; x->h.t = K_STR; x->h.depth = 0; x->h.holds_mutable = 0;
    x->len = n;
    memcpy(x->s, s, n);
    x->s[n] = 0;
    return x;
}
static Tup *tup_new(size_t n) {
    Tup *t = (Tup *)palloc(sizeof(Tup) + n * sizeof(Val));
    if (!t) return NULL;
    t->h.rc = 1; t->h.t = K_TUPLE; t->h.depth = 1; t->h.holds_mutable = 0;
    t->n = n;
    return t;
}
static Cont *cont_new(int t) {
    Cont *c = (Cont *)palloc(sizeof(Cont));
    if (!c) return NULL;
    memset(c, 0, sizeof(Cont));
    c->h.rc = 1; c->h.t = (uint8_t)t; c->h.depth = 1;
    c->w = 1;
    return c;
}
static int cont_add(Cont *c, Val v) {
    if (c->n == c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 4;
        Val *p = (Val *)palloc(nc * sizeof(Val));
        if (!p) return -1;
        if (c->v) { memcpy(p, c->v, c->n * sizeof(Val)); pfree(c->v, c->cap * sizeof(Val)); }
        c->v = p;
        c->cap = nc;
    }
    int dp = vdepth(v) + 1;
    if (dp > MAXDEPTH) return -1;
    if (dp > c->h.depth) c->h.depth = (uint8_t)dp;
    c->v[c->n++] = v;
    return 0;
}

static inline int is_str(Val v, const char *s) {
    return v.k == K_STR && ((Str *)v.p)->len == strlen(s) && memcmp(((Str *)v.p)->s, s, ((Str *)v.p)->len) == 0;
}

/* UTF-8 as pickle decodes it ("surrogatepass": encoded surrogates are accepted). */
static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t k;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) { k = 1; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { k = 2; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { k = 3; cp = c & 0x07; }
        else return 0;
        if (k >= n - i) return 0;  /* the sequence runs past the end */
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
        i += k + 1;
    }
    return 1;
}

/* An int tuple (torch.Size as the stand-in gives it, or a plain tuple of ints) into out[]; its length or -1. */
static int int_tuple(Val v, int64_t *out) {
    if (v.k != K_TUPLE) return -1;
    Tup *t = (Tup *)v.p;
    if (t->n > MAXDIMS) return -1;
    for (size_t i = 0; i < t->n; i++) {
        if (t->v[i].k != K_INT) return -1;
        out[i] = t->v[i].i;
    }
    return (int)t->n;
}

/* A built record's state dict (Cont of pairs), or NULL. */
static Cont *rec_dict(Val v, int role) {
    if (v.k != K_REC) return NULL;
    Rec *r = (Rec *)v.p;
    if (r->role != role || !r->built || r->state.k != K_DICT) return NULL;
    Cont *c = (Cont *)r->state.p;
    return c->mode ? NULL : c;
}

/* ------------------------------------------------------------------ records into rows */

/* BUILD of a ChunkStorageMetadata: its offsets and sizes become a row of the chunk columns. */
static int chunk_row(D *d, Rec *r) {
    Cont *c = (Cont *)r->state.p;
    Val off = NONE_V, siz = NONE_V;
    int have_o = 0, have_s = 0;
    for (size_t i = 0; i < c->n; i += 2) {
        if (is_str(c->v[i], "offsets")) { off = c->v[i + 1]; have_o = 1; }
        else if (is_str(c->v[i], "sizes")) { siz = c->v[i + 1]; have_s = 1; }
        else return -1;
    }
    if (!have_o || !have_s) return -1;
    int64_t a[MAXDIMS], b[MAXDIMS];
    int na = int_tuple(off, a), nb = int_tuple(siz, b);
    if (na < 0 || na != nb) return -1;
    if (na && (col_put(&d->chunk_offsets, a, 8 * (size_t)na) < 0 || col_put(&d->chunk_sizes, b, 8 * (size_t)nb) < 0)) return -1;
    r->row = d->chunk_rows++;
    r->ndim = na;
    vdec(r->state);          /* the row is out: the state is not needed again */
    r->state = NONE_V;
    return 0;
}

/* One state_dict_metadata pair: the key and its TensorStorageMetadata or BytesStorageMetadata. */
static int sdm_row(D *d, Val key, Val value) {
    if (key.k != K_STR || value.k != K_REC) return -1;
    Str *ks = (Str *)key.p;
    PyObject *k = pystr(ks->s, ks->len);
    if (!k) return -1;
    int dup = PyDict_Contains(d->seen_keys, k);
    if (dup != 0 || PyDict_SetItem(d->seen_keys, k, Py_None) < 0 || PyList_Append(d->keys, k) < 0) { Py_DECREF(k); return -1; }
    Py_DECREF(k);
    Rec *r = (Rec *)value.p;
    if (r->role == R_BSM) {
        if (r->built && !(r->state.k == K_DICT && ((Cont *)r->state.p)->n == 0 && !((Cont *)r->state.p)->mode)) return -1;
        if (PyList_Append(d->key_dtypes, Py_None) < 0 || PyList_Append(d->shapes, Py_None) < 0) return -1;
        return col_i8(&d->kinds, 1) < 0 || col_i64(&d->chunk_count, 0) < 0 ? -1 : 0;
    }
    Cont *c = rec_dict(value, R_TSM);
    if (!c) return -1;
    Val props = NONE_V, size = NONE_V, chunks = NONE_V;
    for (size_t i = 0; i < c->n; i += 2) {
        if (is_str(c->v[i], "properties")) props = c->v[i + 1];
        else if (is_str(c->v[i], "size")) size = c->v[i + 1];
        else if (is_str(c->v[i], "chunks")) chunks = c->v[i + 1];
        else return -1;
    }
    /* properties: a TensorProperties whose tuple state begins with the dtype */
    if (props.k != K_REC) return -1;
    Rec *pr = (Rec *)props.p;
    if (pr->role != R_PROPS || !pr->built || pr->state.k != K_TUPLE) return -1;
    Tup *ps = (Tup *)pr->state.p;
    if (ps->n != 5 || ps->v[0].k != K_GLOBAL || (ps->v[0].i & 0xFF) != R_DTYPE) return -1;
    PyObject *dn = PyList_GET_ITEM(d->dtype_names, (Py_ssize_t)(ps->v[0].i >> 8));
    int64_t shape[MAXDIMS];
    int nd = int_tuple(size, shape);
    if (nd < 0) return -1;
    PyObject *sh = PyTuple_New(nd);
    if (!sh) return -1;
    for (int i = 0; i < nd; i++) {
        PyObject *x = PyLong_FromLongLong(shape[i]);
        if (!x) { Py_DECREF(sh); return -1; }
        PyTuple_SET_ITEM(sh, i, x);
    }
    int e = PyList_Append(d->shapes, sh);
    Py_DECREF(sh);
    if (e < 0 || PyList_Append(d->key_dtypes, dn) < 0) return -1;
    /* chunks: a list of this file's next chunk rows, each of the tensor's rank */
    if (chunks.k != K_LIST) return -1;
    Cont *cl = (Cont *)chunks.p;
    int64_t count = 0;
    if (cl->mode == 1) {
        if (cl->start != d->chunk_used || cl->ndim != nd) return -1;
        count = cl->count;
    } else if (cl->n) return -1;
    d->chunk_used += count;
    return col_i8(&d->kinds, 0) < 0 || col_i64(&d->chunk_count, count) < 0 ? -1 : 0;
}

/* One storage_data pair: a MetadataIndex and its _StorageInfo. */
static int storage_row(D *d, Val key, Val value) {
    Cont *ki = rec_dict(key, R_MINDEX), *si = rec_dict(value, R_SINFO);
    if (!ki || !si) return -1;
    Val fqn = NONE_V, off = NONE_V, index = NONE_V;
    for (size_t i = 0; i < ki->n; i += 2) {
        if (is_str(ki->v[i], "fqn")) fqn = ki->v[i + 1];
        else if (is_str(ki->v[i], "offset")) off = ki->v[i + 1];
        else if (is_str(ki->v[i], "index")) index = ki->v[i + 1];
        else return -1;
    }
    Val rel = NONE_V, o = NONE_V, n = NONE_V, tds = NONE_V;
    for (size_t i = 0; i < si->n; i += 2) {
        if (is_str(si->v[i], "relative_path")) rel = si->v[i + 1];
        else if (is_str(si->v[i], "offset")) o = si->v[i + 1];
        else if (is_str(si->v[i], "length")) n = si->v[i + 1];
        else if (is_str(si->v[i], "transform_descriptors")) tds = si->v[i + 1];
        else return -1;
    }
    if (fqn.k != K_STR || rel.k != K_STR || o.k != K_INT || n.k != K_INT) return -1;
    if (!(index.k == K_NONE || (index.k == K_INT && index.i >= 0))) return -1;
    int64_t offs[MAXDIMS];
    int nd = -1;
    if (off.k != K_NONE && (nd = int_tuple(off, offs)) < 0) return -1;
    int64_t tix = -1;
    if (tds.k == K_LIST || tds.k == K_TUPLE) {
        Val *items = tds.k == K_LIST ? ((Cont *)tds.p)->v : ((Tup *)tds.p)->v;
        size_t m = tds.k == K_LIST ? ((Cont *)tds.p)->n : ((Tup *)tds.p)->n;
        if (tds.k == K_LIST && ((Cont *)tds.p)->mode) return -1;
        if (m) {  /* interned by its strings, each preceded by its length */
            size_t total = 0;
            for (size_t i = 0; i < m; i++) {
                if (items[i].k != K_STR) return -1;
                total += 8 + ((Str *)items[i].p)->len;
            }
            char *buf = (char *)malloc(total ? total : 1), *p = buf;
            if (!buf) return -1;
            for (size_t i = 0; i < m; i++) {
                Str *s = (Str *)items[i].p;
                uint64_t L = s->len;
                memcpy(p, &L, 8); memcpy(p + 8, s->s, s->len);
                p += 8 + s->len;
            }
            size_t before = d->transforms.n;
            tix = intern(&d->transforms, buf, total);
            free(buf);
            if (tix < 0) return -1;
            if (d->transforms.n != before) {
                PyObject *t = PyTuple_New((Py_ssize_t)m);
                if (!t) return -1;
                for (size_t i = 0; i < m; i++) {
                    Str *s = (Str *)items[i].p;
                    PyObject *x = pystr(s->s, s->len);
                    if (!x) { Py_DECREF(t); return -1; }
                    PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
                }
                int e = PyList_Append(d->transform_tuples, t);
                Py_DECREF(t);
                if (e < 0) return -1;
            }
        }
    } else if (tds.k != K_NONE) return -1;
    Str *fs = (Str *)fqn.p, *rs = (Str *)rel.p;
    int64_t fi = intern(&d->fqns, fs->s, fs->len), ri = intern(&d->files, rs->s, rs->len);
    if (fi < 0 || ri < 0) return -1;
    if (col_i32(&d->st_fqn, (int32_t)fi) < 0 || col_i8(&d->st_ndim, (int8_t)nd) < 0 ||
        (nd > 0 && col_put(&d->st_offsets, offs, 8 * (size_t)nd) < 0) ||
        col_i64(&d->st_index, index.k == K_INT ? index.i : -1) < 0 || col_i32(&d->st_file, (int32_t)ri) < 0 ||
        col_i64(&d->st_offset, o.i) < 0 || col_i64(&d->st_length, n.i) < 0 || col_i32(&d->st_transforms, (int32_t)tix) < 0)
        return -1;
    d->st_rows++;
    return 0;
}

/* SETITEM(S) of pairs kv[0..2m) into dict c: rows for state_dict_metadata and storage_data, kept pairs otherwise. */
static int dict_pairs(D *d, Cont *c, Val *kv, size_t m2) {
    for (size_t i = 0; i < m2; i += 2) {
        Val k = kv[i], v = kv[i + 1];
        int kind = 0;
        if (k.k == K_STR && v.k == K_REC && (((Rec *)v.p)->role == R_TSM || ((Rec *)v.p)->role == R_BSM)) kind = 1;
        else if (k.k == K_REC && ((Rec *)k.p)->role == R_MINDEX) kind = 2;
        if (kind) {
            if (c->n || (c->mode && c->dmode != kind)) return -1;
            if (!c->mode) {
                c->mode = 1;
                c->dmode = kind;
                c->start = kind == 1 ? (int64_t)PyList_GET_SIZE(d->keys) : d->st_rows;
            }
            if ((kind == 1 ? sdm_row(d, k, v) : storage_row(d, k, v)) < 0) return -1;
            c->count++;
            vdec(k); vdec(v);
            kv[i] = kv[i + 1] = NONE_V;
        } else {
            if (c->mode) return -1;
            if (cont_add(c, k) < 0) return -1;
            kv[i] = NONE_V;
            if (cont_add(c, v) < 0) return -1;
            kv[i + 1] = NONE_V;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ plain values into Python */

static PyObject *to_py(D *d, Val v) {
    switch (v.k) {
    case K_NONE: Py_RETURN_NONE;
    case K_BOOL: return PyBool_FromLong((long)v.i);
    case K_INT: return PyLong_FromLongLong(v.i);
    case K_STR: return pystr(((Str *)v.p)->s, ((Str *)v.p)->len);
    case K_TUPLE: case K_LIST: {
        int tuple = v.k == K_TUPLE;
        Val *items = tuple ? ((Tup *)v.p)->v : ((Cont *)v.p)->v;
        size_t n = tuple ? ((Tup *)v.p)->n : ((Cont *)v.p)->n;
        if (!tuple && ((Cont *)v.p)->mode) return NULL;
        PyObject *o = tuple ? PyTuple_New((Py_ssize_t)n) : PyList_New((Py_ssize_t)n);
        if (!o) return NULL;
        for (size_t i = 0; i < n; i++) {
            PyObject *x = to_py(d, items[i]);
            if (!x) { Py_DECREF(o); return NULL; }
            if (tuple) PyTuple_SET_ITEM(o, (Py_ssize_t)i, x); else PyList_SET_ITEM(o, (Py_ssize_t)i, x);
        }
        return o;
    }
    case K_DICT: {
        Cont *c = (Cont *)v.p;
        if (c->mode) return NULL;
        PyObject *o = PyDict_New();
        if (!o) return NULL;
        for (size_t i = 0; i < c->n; i += 2) {
            PyObject *k = to_py(d, c->v[i]), *x = k ? to_py(d, c->v[i + 1]) : NULL;
            int e = (k && x) ? PyDict_SetItem(o, k, x) : -1;
            Py_XDECREF(k); Py_XDECREF(x);
            if (e < 0) { Py_DECREF(o); return NULL; }
        }
        return o;
    }
    default: return NULL; /* a record or a global outside the fields that hold them */
    }
}

/* ------------------------------------------------------------------ pass 2 */

static int global_role(D *d, Val mod, Val name, int64_t *out) {
    if (mod.k != K_STR || name.k != K_STR) return -1;
    Str *ms = (Str *)mod.p, *ns = (Str *)name.p;
    PyObject *m = pystr(ms->s, ms->len), *n = m ? pystr(ns->s, ns->len) : NULL;
    PyObject *key = n ? PyTuple_Pack(2, m, n) : NULL;
    int64_t role = -1;
    if (key) {
        PyObject *r = PyDict_GetItemWithError(d->allow, key);
        int dtype = 0;
        if (!r && !PyErr_Occurred()) {
            PyObject *star = PyUnicode_FromString("*");
            PyObject *k2 = star ? PyTuple_Pack(2, m, star) : NULL;
            PyObject *r2 = k2 ? PyDict_GetItemWithError(d->allow, k2) : NULL;
            if (r2 && PyUnicode_Check(r2) && PyUnicode_CompareWithASCIIString(r2, "dtype") == 0 &&
                PyUnicode_CompareWithASCIIString(n, "*") != 0 && PySequence_Contains(d->dtypes, n) == 1)
                dtype = 1;
            Py_XDECREF(star); Py_XDECREF(k2);
        }
        if (dtype) {
            Py_ssize_t i, nn = PyList_GET_SIZE(d->dtype_names);
            for (i = 0; i < nn; i++)
                if (PyUnicode_Compare(PyList_GET_ITEM(d->dtype_names, i), n) == 0) break;
            if (i == nn && PyList_Append(d->dtype_names, n) < 0) i = -1;
            if (i >= 0 && i < (1 << 20)) role = R_DTYPE | ((int64_t)i << 8);
        } else if (r && PyUnicode_Check(r)) {
            static const char *names[] = {"", "Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                          "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                          "_StorageInfo", "size", "", "enum", "layout", "path", "ordered_dict"};
            for (int j = 1; j < R_OTHER; j++)
                if (names[j][0] && PyUnicode_CompareWithASCIIString(r, names[j]) == 0) { role = j; break; }
        }
    }
    Py_XDECREF(m); Py_XDECREF(n); Py_XDECREF(key);
    PyErr_Clear();
    if (role < 0) return -1;
    *out = role;
    return 0;
}

static int reduce(D *d, Val fn, Val args, int64_t add, Val *out) {
    if (fn.k != K_GLOBAL || args.k != K_TUPLE) return -1;
    Tup *a = (Tup *)args.p;
    int role = (int)(fn.i & 0xFF);
    int64_t w = sat(1, add);
    switch (role) {
    case R_SIZE: {
        if (a->n != 1 || a->v[0].k != K_TUPLE) return -1;
        Tup *t = (Tup *)a->v[0].p;
        for (size_t i = 0; i < t->n; i++) if (t->v[i].k != K_INT) return -1;
        *out = vinc(a->v[0]);
        out->w = w;
        return 0;
    }
    case R_ENUM:
        if (a->n != 1 || (a->v[0].k != K_INT && a->v[0].k != K_STR)) return -1;
        *out = vinc(a->v[0]);
        out->w = w;
        return 0;
    case R_LAYOUT:
        if (a->n != 1 || a->v[0].k != K_STR) return -1;
        *out = vinc(a->v[0]);
        out->w = w;
        return 0;
    case R_PATH: {
        size_t total = 0;
        for (size_t i = 0; i < a->n; i++) {
            if (a->v[i].k != K_STR) return -1;
            total += ((Str *)a->v[i].p)->len + 1;
        }
        Str *s = (Str *)palloc(sizeof(Str) + (total ? total - 1 : 0) + 1); /* the parts, a '/' between each two */
        if (!s) return -1;
        s->h.rc = 1; s->h.t = K_STR; s->h.depth = 0; s->h.holds_mutable = 0;
        size_t p = 0;
        for (size_t i = 0; i < a->n; i++) {
            Str *x = (Str *)a->v[i].p;
            if (i) s->s[p++] = '/';
            memcpy(s->s + p, x->s, x->len);
            p += x->len;
        }
        s->len = p;
        s->s[p] = 0;
        *out = (Val){&s->h, 0, w, K_STR};
        return 0;
    }
    case R_ODICT: {
        if (a->n) return -1;
        Cont *c = cont_new(K_DICT);
        if (!c) return -1;
        c->w = w;
        *out = (Val){&c->h, 0, 0, K_DICT};
        return 0;
    }
    default: return -1;
    }
}

#define OVER(x) do { if ((x) > d->limit) return -1; } while (0)

static int store_memo(D *d, uint64_t idx) {
    if (d->sn <= fence(d)) return -1;
    size_t w = (size_t)(idx >> 6);
    if (w >= d->nbits_words || !(d->bits[w] & ((uint64_t)1 << (idx & 63)))) return 0; /* never fetched: not kept */
    uint64_t below = d->bits[w] & (((uint64_t)1 << (idx & 63)) - 1);
    size_t slot = d->rank[w] + (size_t)__builtin_popcountll(below);
    Val v = d->st[d->sn - 1];
    vdec(d->slots[slot]);
    d->slots[slot] = vinc(v);
    d->slots[slot].k = v.k;
    return 0;
}

/* Frames. The reference unpickles from a file object (io.BytesIO), and CPython's C unpickler then
 * reads a FRAME's bytes into its buffer at once; a later read that the buffer holds only part of
 * drops that part and reads afresh after the buffer's end (_Unpickler_ReadImpl). pickle never cuts
 * an opcode at a frame's end, but a damaged file can, and the reference then reads other bytes than
 * these. So `fend` follows the unpickler's buffer end, and an opcode running across it is refused. */
static int pass2(D *d, Val *result) {
    Rd *r = &d->rd;
    Val x, y;
    size_t start;
    uint64_t fend = 0, at;
    for (;;) {
        if (NEED(r, 1) < 0) FAIL();
        at = r->base + r->pos;
        unsigned char op = r->buf[r->pos++];
        switch (op) {
        case 0x94: /* MEMOIZE */
            if (store_memo(d, d->memo_count++) < 0) FAIL();
            break;
        case 0x71: case 0x72: { /* BINPUT, LONG_BINPUT */
            size_t k = op == 0x71 ? 1 : 4;
            if (NEED(r, k) < 0) FAIL();
            uint64_t idx = k == 1 ? r->buf[r->pos] : u4(r->buf + r->pos);
            r->pos += k;
            if (idx > r->size || store_memo(d, idx) < 0) FAIL();
            break;
        }
        case 0x68: case 0x6A: { /* BINGET, LONG_BINGET: only immutable leaves */
            size_t k = op == 0x68 ? 1 : 4;
            if (NEED(r, k) < 0) FAIL();
            uint64_t idx = k == 1 ? r->buf[r->pos] : u4(r->buf + r->pos);
            r->pos += k;
            size_t w = (size_t)(idx >> 6);
            if (w >= d->nbits_words) FAIL();
            uint64_t below = d->bits[w] & (((uint64_t)1 << (idx & 63)) - 1);
            Val v = d->slots[d->rank[w] + (size_t)__builtin_popcountll(below)];
            if (v.k == K_NONE && !v.p && v.i == -1) FAIL(); /* never set */
            if (mutable_(v) || (v.p && v.p->holds_mutable)) FAIL();
            if (push(d, vinc(v)) < 0) FAIL();
            break;
        }
        case 0x28: /* MARK */
            if (d->mn == d->mcap) {
                size_t nc = d->mcap ? d->mcap * 2 : 64;
                size_t *p = (size_t *)realloc(d->marks, nc * sizeof(size_t));
                if (!p) FAIL();
                d->marks = p;
                d->mcap = nc;
            }
            d->marks[d->mn++] = d->sn;
            break;
        case 0x29: { /* EMPTY_TUPLE */
            Tup *t = tup_new(0);
            if (!t || push(d, (Val){&t->h, 0, 1, K_TUPLE}) < 0) FAIL();
            break;
        }
        case 0x85: case 0x86: case 0x87: case 0x74: { /* TUPLE1-3, TUPLE */
            size_t n;
            if (op == 0x74) { if (to_mark(d, &start) < 0) FAIL(); n = d->sn - start; }
            else { n = (size_t)(op - 0x84); if (d->sn < fence(d) + n) FAIL(); start = d->sn - n; }
            Tup *t = tup_new(n);
            if (!t) FAIL();
            int64_t w = 1;
            int dp = 1;
            t->h.holds_mutable = 0;
            for (size_t i = 0; i < n; i++) {
                Val v = d->st[start + i];
                t->v[i] = v;
                w = sat(w, weight(v));
                if (vdepth(v) + 1 > dp) dp = vdepth(v) + 1;
                if (mutable_(v) || (v.p && v.p->holds_mutable)) t->h.holds_mutable = 1;
            }
            d->sn = start;
            Val tv = {&t->h, 0, w, K_TUPLE};
            if (dp > MAXDEPTH) { vdec(tv); FAIL(); }
            t->h.depth = (uint8_t)dp;
            if (push(d, tv) < 0) FAIL();
            if (op != 0x85) OVER(w);
            break;
        }
        case 0x7D: case 0x5D: { /* EMPTY_DICT, EMPTY_LIST */
            Cont *c = cont_new(op == 0x7D ? K_DICT : K_LIST);
            if (!c || push(d, (Val){&c->h, 0, 0, op == 0x7D ? K_DICT : K_LIST}) < 0) FAIL();
            break;
        }
        case 0x4E: if (push(d, NONE_V) < 0) FAIL(); break;
        case 0x88: case 0x89: if (push(d, (Val){NULL, op == 0x88, 1, K_BOOL}) < 0) FAIL(); break;
        case 0x4B: case 0x4D: case 0x4A: { /* BININT1, BININT2, BININT */
            size_t k = op == 0x4B ? 1 : op == 0x4D ? 2 : 4;
            if (NEED(r, k) < 0) FAIL();
            const unsigned char *p = r->buf + r->pos;
            int64_t v = k == 1 ? p[0] : k == 2 ? (int64_t)(p[0] | (p[1] << 8)) : (int64_t)(int32_t)u4(p);
            r->pos += k;
            if (push(d, (Val){NULL, v, 1, K_INT}) < 0) FAIL();
            break;
        }
        case 0x8A: { /* LONG1: little-endian two's complement, at most 8 bytes here */
            if (NEED(r, 1) < 0) FAIL();
            size_t n = r->buf[r->pos];
            if (n > 8 || NEED(r, 1 + n) < 0) FAIL();
            const unsigned char *p = r->buf + r->pos + 1;
            uint64_t u = 0;
            for (size_t i = 0; i < n; i++) u |= (uint64_t)p[i] << (8 * i);
            if (n && n < 8 && (p[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
            r->pos += 1 + n;
            if (push(d, (Val){NULL, (int64_t)u, 1 + (int64_t)n / 8, K_INT}) < 0) FAIL();
            break;
        }
        case 0x8C: case 0x58: case 0x8D: { /* SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 */
            size_t k = op == 0x8C ? 1 : op == 0x58 ? 4 : 8;
            if (NEED(r, k) < 0) FAIL();
            uint64_t n = k == 1 ? r->buf[r->pos] : k == 4 ? u4(r->buf + r->pos) : u8(r->buf + r->pos);
            if (n > r->size - (r->base + r->pos + k)) FAIL();
            if (NEED(r, k + (size_t)n) < 0) FAIL();
            const unsigned char *p = r->buf + r->pos + k;
            if (!utf8_ok(p, (size_t)n)) FAIL();
            Str *s = str_new((const char *)p, (size_t)n);
            r->pos += k + (size_t)n;
            if (!s || push(d, (Val){&s->h, 0, 1 + (int64_t)(n / 8), K_STR}) < 0) FAIL();
            break;
        }
        case 0x93: { /* STACK_GLOBAL */
            Val name, mod;
            if (pop(d, &name) < 0) FAIL();
            if (pop(d, &mod) < 0) { vdec(name); FAIL(); }
            int64_t role;
            int e = global_role(d, mod, name, &role);
            vdec(name); vdec(mod);
            if (e < 0 || push(d, (Val){NULL, role, 1, K_GLOBAL}) < 0) FAIL();
            break;
        }
        case 0x81: case 0x52: { /* NEWOBJ (a record), REDUCE (a stand-in's value) */
            if (d->sn < fence(d) + 2) FAIL();
            Val args = d->st[d->sn - 1], cls = d->st[d->sn - 2];
            int64_t add = weight(args);
            d->work = sat(d->work, add);
            Val res;
            int role = cls.k == K_GLOBAL ? (int)(cls.i & 0xFF) : 0;
            if (op == 0x81) {
                if (cls.k != K_GLOBAL || role < R_METADATA || role > R_SINFO) FAIL();
                if (args.k != K_TUPLE || ((Tup *)args.p)->n) FAIL();
                Rec *rc = (Rec *)palloc(sizeof(Rec));
                if (!rc) FAIL();
                memset(rc, 0, sizeof(Rec));
                rc->h.rc = 1; rc->h.t = K_REC; rc->h.depth = 1;
                rc->w = sat(1, add);
                rc->role = role;
                rc->state = NONE_V;
                res = (Val){&rc->h, 0, 0, K_REC};
            } else if (reduce(d, cls, args, add, &res) < 0) FAIL();
            d->sn -= 2;
            vdec(args); vdec(cls);
            if (push(d, res) < 0) FAIL();
            OVER(d->work);
            break;
        }
        case 0x62: { /* BUILD: a record's state */
            if (pop(d, &x) < 0) FAIL();
            if (d->sn <= fence(d)) { vdec(x); FAIL(); }
            y = d->st[d->sn - 1];
            if (y.k != K_REC || ((Rec *)y.p)->built) { vdec(x); FAIL(); }
            Rec *rc = (Rec *)y.p;
            int64_t add = weight(x);
            rc->w = sat(rc->w, add);
            d->work = sat(d->work, add);
            rc->state = x;
            rc->built = 1;
            if (vdepth(x) + 1 > MAXDEPTH) FAIL();
            if (vdepth(x) + 1 > rc->h.depth) rc->h.depth = (uint8_t)(vdepth(x) + 1);
            if (rc->w > d->limit || d->work > d->limit) FAIL();
            if (rc->role == R_PROPS) { if (x.k != K_TUPLE) FAIL(); }
            else if (x.k != K_DICT || ((Cont *)x.p)->mode) FAIL();
            if (rc->role == R_CHUNK && chunk_row(d, rc) < 0) FAIL();
            break;
        }
        case 0x73: case 0x75: { /* SETITEM, SETITEMS */
            if (op == 0x75) { if (to_mark(d, &start) < 0) FAIL(); }
            else { if (d->sn < fence(d) + 2) FAIL(); start = d->sn - 2; }
            size_t m2 = d->sn - start;
            if (m2 % 2 || d->sn <= fence(d) + (op == 0x73 ? 2 : 0) || start == 0) FAIL();
            if (op == 0x75 && start <= fence(d)) FAIL();
            Val tgt = d->st[start - 1];
            if (tgt.k != K_DICT) FAIL();
            Cont *c = (Cont *)tgt.p;
            int64_t keys = 0, vals = 0;
            for (size_t i = start; i < d->sn; i += 2) { keys = sat(keys, weight(d->st[i])); vals = sat(vals, weight(d->st[i + 1])); }
            c->w = sat(c->w, sat(keys, vals));
            d->work = sat(d->work, keys);
            int e = dict_pairs(d, c, d->st + start, m2);
            for (size_t i = start; i < d->sn; i++) vdec(d->st[i]);
            d->sn = start;
            if (e < 0) FAIL();
            OVER(c->w);
            OVER(d->work);
            break;
        }
        case 0x61: case 0x65: { /* APPEND, APPENDS */
            if (op == 0x65) { if (to_mark(d, &start) < 0) FAIL(); if (start <= fence(d)) FAIL(); }
            else { if (d->sn < fence(d) + 2) FAIL(); start = d->sn - 1; }
            if (start == 0) FAIL();
            Val tgt = d->st[start - 1];
            if (tgt.k != K_LIST) FAIL();
            Cont *c = (Cont *)tgt.p;
            int e = 0;
            for (size_t i = start; i < d->sn; i++) {
                Val v = d->st[i];
                c->w = sat(c->w, weight(v));
                if (e) continue;
                if (v.k == K_REC && ((Rec *)v.p)->role == R_CHUNK) {
                    Rec *ch = (Rec *)v.p;
                    if (!ch->built || c->n) { e = -1; continue; }
                    if (!c->mode) { c->mode = 1; c->start = ch->row; c->ndim = ch->ndim; }
                    if (ch->row != c->start + c->count || ch->ndim != c->ndim) { e = -1; continue; }
                    c->count++;
                } else {
                    if (c->mode || cont_add(c, v) < 0) { e = -1; continue; }
                    d->st[i] = NONE_V;  /* moved into the list */
                }
            }
            for (size_t i = start; i < d->sn; i++) vdec(d->st[i]);
            d->sn = start;
            if (e < 0) FAIL();
            OVER(c->w);
            break;
        }
        case 0x30: /* POP (reshard's own writer memoizes its vocabulary, then pops it); a MARK on top is popped instead */
            if (d->mn && d->marks[d->mn - 1] == d->sn) d->mn--;
            else {
                if (pop(d, &x) < 0) FAIL();
                vdec(x);
            }
            break;
        case 0x80: /* PROTO */
            if (NEED(r, 1) < 0) FAIL();
            if (r->buf[r->pos] < 2 || r->buf[r->pos] > 5) FAIL();
            r->pos += 1;
            break;
        case 0x95: { /* FRAME: its opcodes follow inline */
            if (NEED(r, 8) < 0) FAIL();
            uint64_t n = u8(r->buf + r->pos);
            r->pos += 8;
            uint64_t q = r->base + r->pos;
            if (n > r->size - q) FAIL();
            if (at < fend && q > fend) FAIL();  /* the FRAME opcode itself runs across the buffer's end */
            if (q >= fend) fend = q + n;        /* the buffer is used up: the frame is read whole */
            else if (q + n > fend) FAIL();      /* a frame inside the buffer running past its end */
            break;
        }
        case 0x2E: /* STOP */
            if (pop(d, result) < 0) FAIL();
            if (sat(d->work, weight(*result)) > d->limit) FAIL();
            return 0;
        default:
            FAIL();
        }
        if (at < fend && r->base + r->pos > fend) FAIL();
    }
}

/* ------------------------------------------------------------------ the result */

static PyObject *finish(D *d, Val md) {
    Cont *c = rec_dict(md, R_METADATA);
    if (!c) return NULL;
    Val sdm = NONE_V, storage = NONE_V, planner = NONE_V, smeta = NONE_V, version = NONE_V;
    int have_sdm = 0, have_storage = 0;
    for (size_t i = 0; i < c->n; i += 2) {
        Val k = c->v[i], v = c->v[i + 1];
        if (k.k != K_STR) return NULL;
        if (is_str(k, "state_dict_metadata")) { sdm = v; have_sdm = 1; }
        else if (is_str(k, "storage_data")) { storage = v; have_storage = 1; }
        else if (is_str(k, "planner_data")) planner = v;
        else if (is_str(k, "storage_meta")) smeta = v;
        else if (is_str(k, "version")) version = v;
        else if (v.k != K_NONE) return NULL;  /* all_local_plans, or a field this decoder does not know */
    }
    if (!have_sdm || !have_storage || sdm.k != K_DICT || storage.k != K_DICT) return NULL;
    Cont *a = (Cont *)sdm.p, *b = (Cont *)storage.p;
    Py_ssize_t nkeys = PyList_GET_SIZE(d->keys);
    if (a->mode ? (a->dmode != 1 || a->start != 0 || a->count != nkeys) : (a->n || nkeys)) return NULL;
    if (b->mode ? (b->dmode != 2 || b->start != 0 || b->count != d->st_rows) : (b->n || d->st_rows)) return NULL;
    if (d->chunk_used != d->chunk_rows) return NULL;
    if (version.k != K_NONE && version.k != K_STR) return NULL;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    PyObject *pd = NULL, *sm = NULL, *ver = NULL;
    if (!(pd = to_py(d, planner))) goto bad;
    if (!(ver = to_py(d, version))) goto bad;
    if (smeta.k == K_NONE) { sm = Py_None; Py_INCREF(sm); }
    else {
        Cont *s = rec_dict(smeta, R_SMETA);
        if (!s || !(sm = PyDict_New())) goto bad;
        Val f[4] = {NONE_V, NONE_V, NONE_V, NONE_V};
        static const char *names[4] = {"checkpoint_id", "save_id", "load_id", "modules"};
        for (size_t i = 0; i < s->n; i += 2)
            for (int j = 0; j < 4; j++)
                if (is_str(s->v[i], names[j])) f[j] = s->v[i + 1];
        for (int j = 0; j < 4; j++) {
            PyObject *x = (j == 3 && f[j].k == K_NONE) ? PyList_New(0) : to_py(d, f[j]);
            if (!x || PyDict_SetItemString(sm, names[j], x) < 0) { Py_XDECREF(x); goto bad; }
            Py_DECREF(x);
        }
    }
    PyObject *fq = PyList_New((Py_ssize_t)d->fqns.n), *fl = PyList_New((Py_ssize_t)d->files.n);
    if (!fq || !fl) { Py_XDECREF(fq); Py_XDECREF(fl); goto bad; }
    int e = 0;
    for (size_t i = 0; i < d->fqns.n; i++) {
        PyObject *x = pystr(d->fqns.keys[i], d->fqns.lens[i]);
        if (!x) { e = -1; break; }
        PyList_SET_ITEM(fq, (Py_ssize_t)i, x);
    }
    for (size_t i = 0; !e && i < d->files.n; i++) {
        PyObject *x = pystr(d->files.keys[i], d->files.lens[i]);
        if (!x) { e = -1; break; }
        PyList_SET_ITEM(fl, (Py_ssize_t)i, x);
    }
    if (e || PyDict_SetItemString(out, "fqns", fq) < 0 || PyDict_SetItemString(out, "files", fl) < 0) {
        Py_DECREF(fq); Py_DECREF(fl); goto bad;
    }
    Py_DECREF(fq); Py_DECREF(fl);
    struct { const char *name; PyObject *o; } objs[] = {
        {"version", ver}, {"planner_data", pd}, {"storage_meta", sm}, {"keys", d->keys}, {"dtypes", d->key_dtypes},
        {"shapes", d->shapes}, {"transforms", d->transform_tuples}};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++)
        if (PyDict_SetItemString(out, objs[i].name, objs[i].o) < 0) goto bad;
    struct { const char *name; Col *c; } cols[] = {
        {"kinds", &d->kinds}, {"chunk_count", &d->chunk_count}, {"chunk_offsets", &d->chunk_offsets},
        {"chunk_sizes", &d->chunk_sizes}, {"st_fqn", &d->st_fqn}, {"st_ndim", &d->st_ndim},
        {"st_offsets", &d->st_offsets}, {"st_index", &d->st_index}, {"st_file", &d->st_file},
        {"st_offset", &d->st_offset}, {"st_length", &d->st_length}, {"st_transforms", &d->st_transforms}};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) {
        PyObject *b2 = col_take(cols[i].c);
        if (!b2 || PyDict_SetItemString(out, cols[i].name, b2) < 0) { Py_XDECREF(b2); goto bad; }
        Py_DECREF(b2);
    }
    PyObject *kept = PyLong_FromSize_t(d->nslots);
    if (!kept || PyDict_SetItemString(out, "memo_kept", kept) < 0) { Py_XDECREF(kept); goto bad; }
    Py_DECREF(kept);
    Py_DECREF(pd); Py_DECREF(sm); Py_DECREF(ver);
    return out;
bad:
    Py_XDECREF(pd); Py_XDECREF(sm); Py_XDECREF(ver);
    Py_DECREF(out);
    return NULL;
}

static void d_free(D *d) {
    for (size_t i = 0; i < d->sn; i++) vdec(d->st[i]);
    free(d->st);
    free(d->marks);
    for (size_t i = 0; i < d->nslots; i++) vdec(d->slots[i]);
    free(d->slots);
    free(d->bits);
    free(d->rank);
    free(d->rd.buf);
    Py_XDECREF(d->dtype_names); Py_XDECREF(d->keys); Py_XDECREF(d->key_dtypes); Py_XDECREF(d->shapes);
    Py_XDECREF(d->seen_keys); Py_XDECREF(d->transform_tuples);
    Col *cols[] = {&d->kinds, &d->chunk_count, &d->chunk_offsets, &d->chunk_sizes, &d->st_fqn, &d->st_ndim,
                   &d->st_offsets, &d->st_index, &d->st_file, &d->st_offset, &d->st_length, &d->st_transforms};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) Py_XDECREF(cols[i]->b);
    intern_free(&d->fqns); intern_free(&d->files); intern_free(&d->transforms);
}

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"fd", "size", "allow", "dtypes", "limit", "block", NULL};
    int fd;
    long long size, limit, block = 16 << 20;
    PyObject *allow, *dtypes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLO!OL|L", kwlist, &fd, &size, &PyDict_Type, &allow, &dtypes,
                                     &limit, &block))
        return NULL;
    if (size < 0 || block < 1) { PyErr_SetString(PyExc_ValueError, "size must be >= 0 and block >= 1"); return NULL; }
    D d;
    memset(&d, 0, sizeof d);
    d.rd.fd = fd;
    d.rd.size = (uint64_t)size;
    d.rd.block = (size_t)block;
    d.allow = allow;
    d.dtypes = dtypes;
    d.limit = limit < 0 ? CAP : limit;
    PyObject *out = NULL;
    Val result = NONE_V;
    int got = 0;
    if (pass1(&d) < 0) goto done;
    /* the ranks of the fetched indices, and one slot each */
    d.rank = (uint32_t *)malloc((d.nbits_words ? d.nbits_words : 1) * sizeof(uint32_t));
    if (!d.rank) goto done;
    for (size_t w = 0; w < d.nbits_words; w++) {
        d.rank[w] = (uint32_t)d.nslots;
        d.nslots += (size_t)__builtin_popcountll(d.bits[w]);
    }
    d.slots = (Val *)malloc((d.nslots ? d.nslots : 1) * sizeof(Val));
    if (!d.slots) { d.nslots = 0; goto done; }
    for (size_t i = 0; i < d.nslots; i++) d.slots[i] = (Val){NULL, -1, 0, K_NONE}; /* i = -1: never set */
    d.rd.base = d.rd.checked = 0;
    d.rd.pos = d.rd.len = 0;
    if (!(d.dtype_names = PyList_New(0)) || !(d.keys = PyList_New(0)) || !(d.key_dtypes = PyList_New(0)) ||
        !(d.shapes = PyList_New(0)) || !(d.seen_keys = PyDict_New()) || !(d.transform_tuples = PyList_New(0)))
        goto done;
    if (pass2(&d, &result) < 0) goto done;
    got = 1;
    out = finish(&d, result);
done:
    if (got) vdec(result);
    int interrupted = d.rd.interrupted;
    d_free(&d);
    pool_drain();
    if (interrupted) { Py_XDECREF(out); return NULL; }  /* KeyboardInterrupt and the like: not a verdict on the file */
    if (!out) {  /* whatever went wrong, out of memory included: the safe path decides */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(fd, size, allow, dtypes, limit, block=16 MiB) -> dict of columns, or None: see reshard/storage/pickles/metadecode.c"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "metadecode",
                                    "DCP .metadata decoded into columns, streamed (the fast path of reshard.storage.checkpoints.dcp).",
                                    -1, methods};

PyMODINIT_FUNC PyInit_metadecode(void) { return PyModule_Create(&module); }

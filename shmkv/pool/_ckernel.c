/*
 * shmkv.pool._ckernel: the hot loops of BlockPool in C, over the shared segment.
 *
 * This is an accelerator, not a second design: it performs exactly the mutations of the
 * pure-Python kernel (shmkv/pool/_pykernel.py), in the same order, with the same checks and the
 * same error messages, on the layout documented in shmkv/pool/layout.py. The test suite runs
 * against both kernels. The field positions below are checked against layout.py when a
 * kernel is built (Kernel.__init__ receives them and refuses a mismatch).
 *
 * A Kernel holds a buffer export of the segment's mmap; release() must be called before the
 * mmap is closed.
 *
 * Every store to the segment goes through J32/J64, which first appends the word's old value
 * to the undo journal (shmkv/pool/journal.py has the protocol), so a holder killed at any store
 * can be rolled back by whoever takes the lock over. FAULT_TICK() before each store is the
 * fault-injection point of shmkv/pool/fault.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Row geometry of BLOCK_DTYPE (64-byte rows), in int32 / int64 words. */
#define ROW_I32 16
#define ROW_I64 8
#define F_REF 0
#define F_PREV 1
#define F_NEXT 2
#define F_INDEX_NEXT 3
#define F_GROUP 4
#define F_HASH_TOKENS 5
#define F_QUEUE_KEY 3 /* int64 word */
#define HASH_BYTE_OFFSET 32
#define HASH_BYTES 32
#define ROW_BYTES 64
/* Header int64 words. */
#define H_NUM_FREE 17
#define H_QUEUE_HEAD_KEY 18
#define H_QUEUE_TAIL_KEY 19
#define H_JOURNAL_LEN 29
#define H_LOCK_SEQ 30
#define JOURNAL_OVERFLOWED (-1)
#define PHASE_IDLE 0
#define PHASE_ACQUIRING 1
#define PHASE_RELEASING 2
#define PHASE_HOLDING 3
#define NO_BLOCK (-1)
#define NO_HASH_TOKENS 0
#define NULL_BLOCK_ID 0
#define GROUP_MIX 0x9E3779B97F4A7C15ULL

static PyObject *UsageError = NULL;
static PyObject *OutOfBlocksError = NULL;
static PyObject *InvariantViolation = NULL;
static PyObject *LockTimeoutError = NULL;
static PyObject *FencedError = NULL;
static PyObject *str_block_id = NULL;

/* ------------------------------------------------------------------ fault injection */

/* Stores still allowed before this process kills itself; -1 when no fault is armed. */
static long long fault_left = -1;
static int fault_stop = 0; /* SIGSTOP instead of SIGKILL (fault.py's stop mode) */

static void fault_fire(void) {
    if (fault_stop) {
        kill(getpid(), SIGSTOP); /* returns once continued: the store goes on */
        return;
    }
    kill(getpid(), SIGKILL);
    for (;;) pause();
}

#define FAULT_TICK()                                         \
    do {                                                     \
        if (fault_left >= 0 && fault_left-- == 0) fault_fire(); \
    } while (0)

static PyObject *fault_arm(PyObject *mod, PyObject *args) {
    long long n;
    int stop = 0;
    if (!PyArg_ParseTuple(args, "L|p", &n, &stop)) return NULL;
    fault_left = n > 0 ? n - 1 : -1;
    fault_stop = stop;
    Py_RETURN_NONE;
}

static PyObject *fault_tick(PyObject *mod, PyObject *unused) {
    FAULT_TICK();
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the kernel */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;       /* the segment */
    int64_t *journal; /* the undo journal: (where, old) pairs */
    int64_t journal_cap;
    char *meta;       /* block_meta region */
    int64_t *hdr64;   /* header, as int64 words */
    int32_t *buckets; /* index_buckets region */
    int32_t *ledger;  /* this process's row of the ledger: references it holds per block */
    Py_ssize_t num_blocks;
    Py_ssize_t num_alias_rows; /* block_alias rows: num_blocks with partial keys, else 0 */
    uint64_t bucket_mask;
    int32_t head, tail;
    int32_t *scratch;  /* per-block counters for duplicate checks; all zero between calls */
    int32_t *ids_buf;  /* per-call id list */
    int32_t *first_buf, *last_buf;
    Py_ssize_t buf_cap;
} Kernel;

/* Memory ordering (shmkv/pool/layout.py, "Memory ordering", says which store publishes
 * which). STORE_REL(p, v): a release store (every earlier store is visible before it; a
 * plain mov on x86-64, stlr on aarch64). COMPILER_BARRIER(): no store moves across it at
 * compile time; what a SIGKILLed process leaves is a program-order prefix of its stores
 * (the kernel drains the store buffer before another process can look), so the journal
 * needs only this between its entry, journal_len and the data store. */
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define COMPILER_BARRIER() __atomic_signal_fence(__ATOMIC_SEQ_CST)

#define I32(k, b, f) (((int32_t *)((k)->meta + (Py_ssize_t)(b) * ROW_BYTES))[f])
#define I64(k, b, f) (((int64_t *)((k)->meta + (Py_ssize_t)(b) * ROW_BYTES))[f])
#define HASHP(k, b) ((k)->meta + (Py_ssize_t)(b) * ROW_BYTES + HASH_BYTE_OFFSET)

/* Appends the old value of the `width`-byte word at p to the undo journal (or marks it
 * overflowed). Three fault points: before the entry, before the count, before the write. */
static inline void journal_save(Kernel *k, const void *p, int width) {
    FAULT_TICK();
    int64_t n = k->hdr64[H_JOURNAL_LEN];
    if (n >= 0 && n < k->journal_cap) {
        int64_t *entry = k->journal + 2 * n;
        entry[0] = ((int64_t)((const char *)p - k->base) << 4) | width;
        entry[1] = width == 4 ? (int64_t)*(const int32_t *)p : *(const int64_t *)p;
        FAULT_TICK();
        STORE_REL(&k->hdr64[H_JOURNAL_LEN], n + 1); /* publishes the entry */
    } else if (n >= 0) {
        STORE_REL(&k->hdr64[H_JOURNAL_LEN], (int64_t)JOURNAL_OVERFLOWED);
    }
    COMPILER_BARRIER(); /* the data store (J32/J64) comes after journal_len */
    FAULT_TICK();
}

/* Journaled stores: J32(k, I32(k, b, F_REF), 1) is `I32(k, b, F_REF) = 1`, undoably. */
#define J32(k, lvalue, value)                       \
    do {                                            \
        int32_t *p_ = &(lvalue);                    \
        int32_t v_ = (int32_t)(value);              \
        journal_save((k), p_, 4);                   \
        COMPILER_BARRIER();                         \
        *p_ = v_;                                   \
    } while (0)
#define J64(k, lvalue, value)                       \
    do {                                            \
        int64_t *p_ = &(lvalue);                    \
        int64_t v_ = (int64_t)(value);              \
        journal_save((k), p_, 8);                   \
        COMPILER_BARRIER();                         \
        *p_ = v_;                                   \
    } while (0)

/* Shared memory written by another process is not trusted to be sane: every row index read
 * from it is range-checked before it is dereferenced, so corruption raises
 * InvariantViolation instead of crashing the process. */
#define ROW_OK(k, x) ((x) >= 0 && (Py_ssize_t)(x) < (k)->num_blocks + 2)
#define BLOCK_OK(k, x) ((x) >= 0 && (Py_ssize_t)(x) < (k)->num_blocks)
/* Key rows (shmkv/pool/layout.py): block rows [0, n), the two sentinels, then block b's alias
 * row at ALIAS0 + b; the prefix index links block and alias rows alike. */
#define ALIAS0(k) ((k)->num_blocks + 2)
#define NUM_KEY_ROWS(k) ((k)->num_blocks + 2 + (k)->num_alias_rows)
#define KEY_OK(k, x) \
    (BLOCK_OK(k, x) || ((Py_ssize_t)(x) >= ALIAS0(k) && (Py_ssize_t)(x) < NUM_KEY_ROWS(k)))

static void *corrupt(const char *what, long row) {
    PyObject *msg = PyUnicode_FromFormat("INV-FREE/INV-HASH: corrupt shared state: %s (row %ld)",
                                         what, row);
    if (!msg) return NULL;
    PyObject *exc = PyObject_CallFunction(InvariantViolation, "([O])", msg);
    Py_DECREF(msg);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static int kernel_alive(Kernel *k) {
    if (!k->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "shmkv kernel used after release()");
        return 0;
    }
    return 1;
}

static int ensure_bufs(Kernel *k, Py_ssize_t n) {
    if (n <= k->buf_cap) return 1;
    Py_ssize_t cap = n < 64 ? 64 : n;
    int32_t *a = PyMem_Realloc(k->ids_buf, cap * sizeof(int32_t));
    if (!a) { PyErr_NoMemory(); return 0; }
    k->ids_buf = a;
    a = PyMem_Realloc(k->first_buf, cap * sizeof(int32_t));
    if (!a) { PyErr_NoMemory(); return 0; }
    k->first_buf = a;
    a = PyMem_Realloc(k->last_buf, cap * sizeof(int32_t));
    if (!a) { PyErr_NoMemory(); return 0; }
    k->last_buf = a;
    k->buf_cap = cap;
    return 1;
}

/* ------------------------------------------------------------------ lifecycle */

static int Kernel_init(Kernel *k, PyObject *args, PyObject *kwds) {
    PyObject *buf, *geometry;
    Py_ssize_t meta_off, idx_off, ledger_off, num_blocks, num_buckets, journal_off, journal_cap;
    Py_ssize_t num_alias_rows;
    if (!PyArg_ParseTuple(args, "OnnnnnnnnO", &buf, &meta_off, &idx_off, &ledger_off,
                          &num_blocks, &num_buckets, &journal_off, &journal_cap,
                          &num_alias_rows, &geometry))
        return -1;
    if (num_alias_rows != 0 && num_alias_rows != num_blocks) {
        PyErr_SetString(PyExc_ValueError, "num_alias_rows must be 0 or num_blocks");
        return -1;
    }
    PyObject *mine = Py_BuildValue(
        "(iiiiiiiiiiiiiiiiK)", ROW_I32, ROW_I64, F_REF, F_PREV, F_NEXT, F_INDEX_NEXT, F_GROUP,
        F_HASH_TOKENS, F_QUEUE_KEY, HASH_BYTE_OFFSET, HASH_BYTES, H_NUM_FREE,
        H_QUEUE_HEAD_KEY, H_QUEUE_TAIL_KEY, H_JOURNAL_LEN, H_LOCK_SEQ,
        (unsigned long long)GROUP_MIX);
    if (!mine) return -1;
    int same = PyObject_RichCompareBool(mine, geometry, Py_EQ);
    Py_DECREF(mine);
    if (same < 0) return -1;
    if (!same) {
        PyErr_SetString(PyExc_ValueError,
                        "shmkv.pool._ckernel was built for another block layout; rebuild it");
        return -1;
    }
    if (num_buckets <= 0 || (num_buckets & (num_buckets - 1))) {
        PyErr_SetString(PyExc_ValueError, "num_buckets must be a power of two");
        return -1;
    }
    if (PyObject_GetBuffer(buf, &k->view, PyBUF_WRITABLE) < 0) return -1;
    k->has_view = 1;
    Py_ssize_t need_meta = meta_off + (num_blocks + 2 + num_alias_rows) * ROW_BYTES; /* + alias */
    Py_ssize_t need_idx = idx_off + num_buckets * 4;
    Py_ssize_t need_ledger = ledger_off + num_blocks * 4;
    Py_ssize_t need_journal = journal_off + journal_cap * 16;
    if (k->view.len < need_meta || k->view.len < need_idx || k->view.len < need_ledger ||
        k->view.len < need_journal || journal_cap < 0 || journal_off % 8 ||
        meta_off % 8 || idx_off % 4 || ledger_off % 4) {
        PyBuffer_Release(&k->view);
        k->has_view = 0;
        PyErr_SetString(PyExc_ValueError, "segment buffer too small for its layout");
        return -1;
    }
    char *base = (char *)k->view.buf;
    k->base = base;
    k->journal = (int64_t *)(base + journal_off);
    k->journal_cap = journal_cap;
    k->meta = base + meta_off;
    k->hdr64 = (int64_t *)base;
    k->buckets = (int32_t *)(base + idx_off);
    k->ledger = (int32_t *)(base + ledger_off);
    k->num_blocks = num_blocks;
    k->num_alias_rows = num_alias_rows;
    k->bucket_mask = (uint64_t)num_buckets - 1;
    k->head = (int32_t)num_blocks;
    k->tail = (int32_t)num_blocks + 1;
    k->scratch = PyMem_Calloc(num_blocks ? num_blocks : 1, sizeof(int32_t));
    if (!k->scratch) {
        PyBuffer_Release(&k->view);
        k->has_view = 0;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *Kernel_release(Kernel *k, PyObject *unused) {
    if (k->has_view) {
        PyBuffer_Release(&k->view);
        k->has_view = 0;
    }
    Py_RETURN_NONE;
}

static void Kernel_dealloc(Kernel *k) {
    if (k->has_view) PyBuffer_Release(&k->view);
    PyMem_Free(k->scratch);
    PyMem_Free(k->ids_buf);
    PyMem_Free(k->first_buf);
    PyMem_Free(k->last_buf);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

/* ------------------------------------------------------------------ prefix index */

static inline uint64_t load_u64_le(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint64_t bucket_of(Kernel *k, const unsigned char *hash, uint32_t group) {
    uint64_t w = load_u64_le(hash);
    if (group) w ^= (uint64_t)group * GROUP_MIX;
    return w & k->bucket_mask;
}

/* Returns the block (of the key row found: an alias row answers with its block), NO_BLOCK on
 * a miss, or -2 (exception set) on a corrupt chain. */
static int32_t index_lookup(Kernel *k, const unsigned char *hash, uint32_t group) {
    int32_t cur = k->buckets[bucket_of(k, hash, group)];
    Py_ssize_t steps = 0;
    while (cur != NO_BLOCK) {
        if (!KEY_OK(k, cur) || ++steps > NUM_KEY_ROWS(k)) {
            corrupt("prefix-index chain leaves the blocks or loops", cur);
            return -2;
        }
        if ((uint32_t)I32(k, cur, F_GROUP) == group &&
            memcmp(HASHP(k, cur), hash, HASH_BYTES) == 0)
            return cur < ALIAS0(k) ? cur : (int32_t)(cur - ALIAS0(k));
        cur = I32(k, cur, F_INDEX_NEXT);
    }
    return NO_BLOCK;
}

/* Unlinks a key row (a block's own or an alias row) from its chain and clears its key (same
 * order as Python: unlink first, then clear the hash fields). Returns 1 if it held a key, 0
 * if not, -1 (InvariantViolation set, nothing written) when the row is not in the chain of
 * its bucket: the walk is bounded by the number of key rows, so a looping chain raises
 * instead of spinning under the lock (BlockHashToBlockMap.pop, message for message). */
static int index_pop(Kernel *k, int32_t b) {
    if (I32(k, b, F_HASH_TOKENS) == NO_HASH_TOKENS) return 0;
    uint32_t group = (uint32_t)I32(k, b, F_GROUP);
    uint64_t bucket = bucket_of(k, (const unsigned char *)HASHP(k, b), group);
    int32_t nxt = I32(k, b, F_INDEX_NEXT);
    int32_t cur = k->buckets[bucket];
    if (cur == b) {
        J32(k, k->buckets[bucket], nxt);
    } else {
        Py_ssize_t left = NUM_KEY_ROWS(k);
        for (;;) {
            int32_t after = KEY_OK(k, cur) ? I32(k, cur, F_INDEX_NEXT) : NO_BLOCK;
            if (after == b) {
                J32(k, I32(k, cur, F_INDEX_NEXT), nxt);
                break;
            }
            cur = after;
            if (cur == NO_BLOCK || --left < 0) {
                PyObject *msg = PyUnicode_FromFormat(
                    "INV-HASH: corrupt shared state: block %d is not in the chain of its "
                    "bucket %llu", (int)b, (unsigned long long)bucket);
                if (msg) {
                    PyObject *exc = PyObject_CallFunction(InvariantViolation, "([O])", msg);
                    Py_DECREF(msg);
                    if (exc) {
                        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                        Py_DECREF(exc);
                    }
                }
                return -1;
            }
        }
    }
    J32(k, I32(k, b, F_INDEX_NEXT), NO_BLOCK);
    J32(k, I32(k, b, F_HASH_TOKENS), NO_HASH_TOKENS);
    J32(k, I32(k, b, F_GROUP), 0);
    return 1;
}

static PyObject *key_tuple(Kernel *k, int32_t b) {
    return Py_BuildValue("(y#I)", HASHP(k, b), (Py_ssize_t)HASH_BYTES,
                         (unsigned int)I32(k, b, F_GROUP));
}

/* Removes every key of block b: its own, then (if it had one) its alias; the Python
 * kernel's BlockHashToBlockMap.pop_all, write for write. -1 with InvariantViolation set on a
 * corrupt chain (the caller's mutate() undoes what was written). */
static int index_pop_all(Kernel *k, int32_t b) {
    int popped = index_pop(k, b);
    if (popped < 0) return -1;
    if (popped && k->num_alias_rows && index_pop(k, (int32_t)(ALIAS0(k) + b)) < 0) return -1;
    return 0;
}

/* Appends (hash, group) of each key index_pop_all(b) would remove to out. Returns 0 with an
 * exception set on failure. */
static int append_keys(Kernel *k, int32_t b, PyObject *out) {
    if (I32(k, b, F_HASH_TOKENS) == NO_HASH_TOKENS) return 1;
    int32_t rows[2] = {b, (int32_t)(ALIAS0(k) + b)};
    for (int i = 0; i < (k->num_alias_rows ? 2 : 1); i++) {
        if (I32(k, rows[i], F_HASH_TOKENS) == NO_HASH_TOKENS) continue;
        PyObject *key = key_tuple(k, rows[i]);
        if (!key || PyList_Append(out, key) < 0) {
            Py_XDECREF(key);
            return 0;
        }
        Py_DECREF(key);
    }
    return 1;
}

/* A KV-cache group id: an int in [0, 2**31) (the row's group_id field), else UsageError with
 * the Python kernel's message (_pykernel.check_group). Never truncated: 2**32 used to be
 * group 0 here and a miss in Python. Returns 0 with the error set. */
static int read_group(PyObject *o, uint32_t *out) {
    if (PyLong_Check(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return 0;
        if (!overflow && v >= 0 && v < (1LL << 31)) {
            *out = (uint32_t)v;
            return 1;
        }
    }
    PyErr_Format(UsageError, "kv_cache_group_id %R is not an int in [0, 2**31)", o);
    return 0;
}

static PyObject *Kernel_lookup(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lookup(block_hash, group_id)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    char *hash;
    Py_ssize_t len;
    if (!PyBytes_CheckExact(args[0])) {
        PyErr_Format(UsageError, "block hash must be bytes, got %.100s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (PyBytes_AsStringAndSize(args[0], &hash, &len) < 0) return NULL;
    if (len != HASH_BYTES) {
        PyErr_Format(UsageError, "block hash must be %d bytes (sha256), got %zd", HASH_BYTES,
                     len);
        return NULL;
    }
    uint32_t group;
    if (!read_group(args[1], &group)) return NULL;
    int32_t found = index_lookup(k, (const unsigned char *)hash, group);
    if (found == -2) return NULL;
    return PyLong_FromLong(found);
}

/* lookup_many(block_hashes, group_ids, fallback_bit) -> [int]: per key, the block holding
 * (hash, group), else (fallback_bit != 0) -2 - the block holding (hash, group | fallback_bit),
 * else -1. Every hash and group is checked before any lookup. */
static PyObject *Kernel_lookup_many(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lookup_many(block_hashes, group_ids, fallback_bit)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    if (!PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])
            || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(UsageError, "lookup_many(): block_hashes and group_ids must be lists "
                        "of one length");
        return NULL;
    }
    uint32_t fallback;
    if (!read_group(args[2], &fallback)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(args[0], i);
        if (!PyBytes_CheckExact(h)) {
            PyErr_Format(UsageError, "block hash must be bytes, got %.100s", Py_TYPE(h)->tp_name);
            return NULL;
        }
        if (PyBytes_GET_SIZE(h) != HASH_BYTES) {
            PyErr_Format(UsageError, "block hash must be %d bytes (sha256), got %zd", HASH_BYTES,
                         PyBytes_GET_SIZE(h));
            return NULL;
        }
        uint32_t group;
        if (!read_group(PyList_GET_ITEM(args[1], i), &group)) return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *hash = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(args[0], i));
        uint32_t group;
        read_group(PyList_GET_ITEM(args[1], i), &group);
        int32_t found = index_lookup(k, hash, group);
        if (found == NO_BLOCK && fallback) {
            int32_t other = index_lookup(k, hash, group | fallback);
            found = other >= 0 ? -2 - other : other;
        }
        if (PyErr_Occurred()) {  /* a corrupt chain (InvariantViolation) */
            Py_DECREF(out);
            return NULL;
        }
        PyObject *v = PyLong_FromLong(found);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static inline PyObject *get_handle(PyObject *handles, PyObject *make, int32_t b) {
    PyObject *h = PyList_GET_ITEM(handles, b);
    if (h == Py_None) return PyObject_CallFunction(make, "i", b);
    Py_INCREF(h);
    return h;
}

/* get_cached(block_hash, group_ids, handles, make_handle) -> [handle per group] or None */
static PyObject *Kernel_get_cached(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "get_cached(block_hash, group_ids, handles, make)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    if (!PyBytes_CheckExact(args[0])) {
        PyErr_Format(UsageError, "block hash must be bytes, got %.100s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (PyBytes_GET_SIZE(args[0]) != HASH_BYTES) {
        PyErr_Format(UsageError, "block hash must be %d bytes (sha256), got %zd", HASH_BYTES,
                     PyBytes_GET_SIZE(args[0]));
        return NULL;
    }
    const unsigned char *hash = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    PyObject *handles = args[2], *make = args[3];
    if (!PyList_Check(handles) || PyList_GET_SIZE(handles) != k->num_blocks) {
        PyErr_SetString(PyExc_TypeError, "handles must be the pool's handle list");
        return NULL;
    }
    PyObject *groups = PySequence_Fast(args[1], "kv_cache_group_ids must be a sequence");
    if (!groups) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(groups);
    PyObject **items = PySequence_Fast_ITEMS(groups);
    PyObject *out = PyList_New(n);
    if (!out) { Py_DECREF(groups); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t group;
        if (!read_group(items[i], &group)) goto fail;
        int32_t b = index_lookup(k, hash, group);
        if (b == -2) goto fail;
        if (b == NO_BLOCK) {
            Py_DECREF(out);
            Py_DECREF(groups);
            Py_RETURN_NONE;
        }
        PyObject *h = get_handle(handles, make, b);
        if (!h) goto fail;
        PyList_SET_ITEM(out, i, h);
    }
    Py_DECREF(groups);
    return out;
fail:
    Py_DECREF(out);
    Py_DECREF(groups);
    return NULL;
}

/* Gives an unhashed block a key and links it at the tail of its bucket chain (hash fields
 * first, then the link). Returns 0 with an exception set on a corrupt chain. */
static int index_insert(Kernel *k, const unsigned char *hash, uint32_t group, int32_t b,
                        int32_t num_tokens) {
    int64_t *words = (int64_t *)HASHP(k, b);
    for (int w = 0; w < HASH_BYTES / 8; w++) {
        int64_t word;
        memcpy(&word, hash + 8 * w, 8);
        J64(k, words[w], word);
    }
    J32(k, I32(k, b, F_GROUP), (int32_t)group);
    J32(k, I32(k, b, F_HASH_TOKENS), num_tokens);
    J32(k, I32(k, b, F_INDEX_NEXT), NO_BLOCK);
    uint64_t bucket = bucket_of(k, hash, group);
    int32_t cur = k->buckets[bucket];
    if (cur == NO_BLOCK) {
        J32(k, k->buckets[bucket], b);
        return 1;
    }
    int32_t nxt;
    Py_ssize_t steps = 0;
    while (KEY_OK(k, cur) && (nxt = I32(k, cur, F_INDEX_NEXT)) != NO_BLOCK &&
           ++steps <= NUM_KEY_ROWS(k))
        cur = nxt;
    if (!KEY_OK(k, cur) || steps > NUM_KEY_ROWS(k)) {
        corrupt("prefix-index chain leaves the blocks or loops", cur);
        return 0;
    }
    J32(k, I32(k, cur, F_INDEX_NEXT), b);
    return 1;
}

/* prefix(block_hashes, group_id, max_blocks, handles, make) -> handles of the longest run of
 * leading hashes cached in the group (at most max_blocks; -1 for no limit). */
static PyObject *Kernel_prefix(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "prefix(block_hashes, group_id, max_blocks, handles, make)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    uint32_t group;
    if (!read_group(args[1], &group)) return NULL;
    int overflow = 0;
    long long max_ll = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (max_ll == -1 && PyErr_Occurred()) return NULL;
    /* A limit past 2**63 is no limit (as in _pykernel.py); -1 means none. */
    Py_ssize_t max_blocks = overflow > 0 || max_ll > PY_SSIZE_T_MAX ? -1 : (Py_ssize_t)max_ll;
    PyObject *handles = args[3], *make = args[4];
    if (!PyList_Check(handles) || PyList_GET_SIZE(handles) != k->num_blocks) {
        PyErr_SetString(PyExc_TypeError, "handles must be the pool's handle list");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "block_hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (max_blocks >= 0 && max_blocks < n) n = max_blocks;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (!out) { Py_DECREF(seq); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != HASH_BYTES) {
            PyErr_Format(UsageError, "block hash %zd must be %d bytes (sha256), got %.100s", i,
                         HASH_BYTES, Py_TYPE(h)->tp_name);
            goto fail;
        }
        int32_t b = index_lookup(k, (const unsigned char *)PyBytes_AS_STRING(h), group);
        if (b == -2) goto fail;
        if (b == NO_BLOCK) break;
        PyObject *handle = get_handle(handles, make, b);
        if (!handle) goto fail;
        int rc = PyList_Append(out, handle);
        Py_DECREF(handle);
        if (rc < 0) goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Kernel_insert(Kernel *k, PyObject *args) {
    Py_buffer hash;
    PyObject *group_obj;
    uint32_t group;
    int block, num_tokens;
    if (!PyArg_ParseTuple(args, "y*Oii", &hash, &group_obj, &block, &num_tokens)) return NULL;
    if (!read_group(group_obj, &group)) {
        PyBuffer_Release(&hash);
        return NULL;
    }
    if (!kernel_alive(k) || hash.len != HASH_BYTES || block < 0 || block >= k->num_blocks) {
        PyBuffer_Release(&hash);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "insert(): bad argument");
        return NULL;
    }
    int ok = index_insert(k, (const unsigned char *)hash.buf, group, block, num_tokens);
    PyBuffer_Release(&hash);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Kernel_evict(Kernel *k, PyObject *arg) {
    long b = PyLong_AsLong(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    if (!kernel_alive(k)) return NULL;
    if (b < 0 || b >= k->num_blocks) {
        PyErr_Format(UsageError, "block id %ld is out of range [0, %zd)", b, k->num_blocks);
        return NULL;
    }
    PyObject *keys = PyList_New(0);
    if (!keys) return NULL;
    if (!append_keys(k, (int32_t)b, keys)) {
        Py_DECREF(keys);
        return NULL;
    }
    if (index_pop_all(k, (int32_t)b) < 0) {
        Py_DECREF(keys);
        return NULL;
    }
    return keys;
}

/* ------------------------------------------------------------------ free queue */

static inline void link_run(Kernel *k, int32_t before, const int32_t *ids, Py_ssize_t n,
                            int32_t after, int64_t key0) {
    int32_t prev = before;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        J32(k, I32(k, b, F_PREV), prev);
        J32(k, I32(k, prev, F_NEXT), b);
        J64(k, I64(k, b, F_QUEUE_KEY), key0 + i);
        prev = b;
    }
    J32(k, I32(k, prev, F_NEXT), after);
    J32(k, I32(k, after, F_PREV), prev);
}

static void queue_append_n(Kernel *k, const int32_t *ids, Py_ssize_t n) {
    if (n == 0) return;
    int64_t key0 = k->hdr64[H_QUEUE_TAIL_KEY] + 1;
    link_run(k, I32(k, k->tail, F_PREV), ids, n, k->tail, key0);
    J64(k, k->hdr64[H_QUEUE_TAIL_KEY], key0 + n - 1);
    J64(k, k->hdr64[H_NUM_FREE], k->hdr64[H_NUM_FREE] + n);
}

static void queue_prepend_n(Kernel *k, const int32_t *ids, Py_ssize_t n) {
    if (n == 0) return;
    int64_t key0 = k->hdr64[H_QUEUE_HEAD_KEY] - n;
    link_run(k, k->head, ids, n, I32(k, k->head, F_NEXT), key0);
    J64(k, k->hdr64[H_QUEUE_HEAD_KEY], key0);
    J64(k, k->hdr64[H_NUM_FREE], k->hdr64[H_NUM_FREE] + n);
}

/* ------------------------------------------------------------------ handles -> ids */

/* Reads .block_id of every handle into k->ids_buf, checking the range. Returns the count,
 * or -1 with an exception set. `seq` must come from PySequence_Fast. */
static Py_ssize_t read_ids(Kernel *k, PyObject *seq, const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (!ensure_bufs(k, n)) return -1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id_obj = PyObject_GetAttr(items[i], str_block_id);
        if (!id_obj) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                PyErr_Format(UsageError, "%s() takes KVCacheBlock handles, got %.100s", what,
                             Py_TYPE(items[i])->tp_name);
            }
            return -1;
        }
        int overflow = 0;
        long b;
        if (PyLong_CheckExact(id_obj)) {
            b = PyLong_AsLongAndOverflow(id_obj, &overflow);
        } else {
            /* Not a plain int: a numpy integer is one (its __index__), a bool, float, None
             * or str is not (block_id_int in _pykernel.py, the same words). */
            PyObject *as_int = PyBool_Check(id_obj) ? NULL : PyNumber_Index(id_obj);
            if (!as_int) {
                if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) {
                    Py_DECREF(id_obj);
                    return -1;
                }
                PyErr_Clear();
                PyErr_Format(UsageError, "%s(): block id %R is not an int", what, id_obj);
                Py_DECREF(id_obj);
                return -1;
            }
            Py_SETREF(id_obj, as_int);
            b = PyLong_AsLongAndOverflow(id_obj, &overflow);
        }
        if (b == -1 && PyErr_Occurred()) {
            Py_DECREF(id_obj);
            return -1;
        }
        if (overflow || b < 0 || b >= k->num_blocks) {
            PyErr_Format(UsageError, "%s(): block id %S is out of range [0, %zd)", what, id_obj,
                         k->num_blocks);
            Py_DECREF(id_obj);
            return -1;
        }
        Py_DECREF(id_obj);
        k->ids_buf[i] = (int32_t)b;
    }
    return n;
}

/* ------------------------------------------------------------------ pool operations */

/* allocate(n, caching, handles, make_handle, evicted_out) -> list of handles */
static PyObject *Kernel_allocate(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allocate(n, caching, handles, make, evicted_out)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    int overflow = 0;
    long long count = PyLong_AsLongLongAndOverflow(args[0], &overflow);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (overflow || count < 0 || count > PY_SSIZE_T_MAX) {
        /* Past 2**63 (or below -2**63): as many free blocks as that are never there. */
        PyErr_Format(OutOfBlocksError, "Cannot get %S free blocks from the pool", args[0]);
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)count;
    int caching = PyObject_IsTrue(args[1]);
    PyObject *handles = args[2], *make = args[3], *evicted_out = args[4];
    if (!PyList_Check(handles) || PyList_GET_SIZE(handles) != k->num_blocks) {
        PyErr_SetString(PyExc_TypeError, "handles must be the pool's handle list");
        return NULL;
    }
    int64_t num_free = k->hdr64[H_NUM_FREE];
    if (n < 0 || n > num_free) {
        PyErr_Format(OutOfBlocksError, "Cannot get %zd free blocks from the pool", n);
        return NULL;
    }
    if (!ensure_bufs(k, n)) return NULL;
    /* Everything that can fail (memory for the result and the evicted keys) happens
     * before the first write, so a failed call changes nothing. */
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    int32_t cur = I32(k, k->head, F_NEXT);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cur <= NULL_BLOCK_ID || cur >= k->num_blocks) {
            Py_DECREF(out);
            return corrupt("free queue links to a row that is not a free block", cur);
        }
        k->ids_buf[i] = cur;
        cur = I32(k, cur, F_NEXT);
    }
    if (!ROW_OK(k, cur)) {
        Py_DECREF(out);
        return corrupt("free queue links outside the block rows", cur);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = get_handle(handles, make, k->ids_buf[i]);
        if (!h) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, h);
    }
    Py_ssize_t evicted_before = evicted_out == Py_None ? 0 : PyList_GET_SIZE(evicted_out);
    if (caching && evicted_out != Py_None) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!append_keys(k, k->ids_buf[i], evicted_out)) {
                PyList_SetSlice(evicted_out, evicted_before, PY_SSIZE_T_MAX, NULL);
                Py_DECREF(out);
                return NULL;
            }
        }
    }
    /* Pop the run off the head: relink the head sentinel, then clear each block's links. */
    if (n) {
        J32(k, I32(k, k->head, F_NEXT), cur);
        J32(k, I32(k, cur, F_PREV), k->head);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = k->ids_buf[i];
        J32(k, I32(k, b, F_PREV), NO_BLOCK);
        J32(k, I32(k, b, F_NEXT), NO_BLOCK);
    }
    J64(k, k->hdr64[H_NUM_FREE], num_free - n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = k->ids_buf[i];
        if (caching && index_pop_all(k, b) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        J32(k, I32(k, b, F_REF), 1);
        J32(k, k->ledger[b], k->ledger[b] + 1);
    }
    return out;
}

/* free(blocks, caching): drop one reference per handle; checks first, then writes. */
/* The checks of a call that drops one reference per listed block (free_blocks,
 * unpin_blocks), before it writes anything: no block is dropped more often than it is
 * referenced, nor more often than this process holds it. The null block is skipped. Returns
 * 0, or -1 with a UsageError naming the first offender; leaves scratch zeroed. */
static int check_drops(Kernel *k, const int32_t *ids, Py_ssize_t n, const char *call,
                       const char *verb) {
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b == NULL_BLOCK_ID) continue;
        if (I32(k, b, F_REF) < ++k->scratch[b] && bad < 0) bad = i;
    }
    if (bad >= 0) {
        int32_t b = ids[bad];
        int32_t times = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (ids[i] == b) times++;
        for (Py_ssize_t i = 0; i < n; i++) k->scratch[ids[i]] = 0;
        int32_t ref = I32(k, b, F_REF);
        int already = ref == 0 && strcmp(call, "free_blocks") == 0;
        PyErr_Format(UsageError, "%s(): block %d has ref_cnt %d but is %s %d time(s)%s",
                     call, b, ref, verb, times, already ? " (it is already free)" : "");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b != NULL_BLOCK_ID && k->ledger[b] < k->scratch[b] && bad < 0) bad = i;
    }
    if (bad >= 0) {
        int32_t b = ids[bad];
        int32_t times = k->scratch[b];
        for (Py_ssize_t i = 0; i < n; i++) k->scratch[ids[i]] = 0;
        PyErr_Format(UsageError,
                     "%s(): block %d is %s %d time(s) but this process holds %d reference(s) "
                     "to it (ref_cnt %d)",
                     call, b, verb, times, k->ledger[b], I32(k, b, F_REF));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) k->scratch[ids[i]] = 0;
    return 0;
}

static PyObject *Kernel_free(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "free(blocks, caching)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    int caching = PyObject_IsTrue(args[1]);
    PyObject *seq = PySequence_Fast(args[0], "free_blocks() takes an iterable of blocks");
    if (!seq) return NULL;
    Py_ssize_t n = read_ids(k, seq, "free_blocks");
    Py_DECREF(seq);
    if (n < 0) return NULL;
    int32_t *ids = k->ids_buf;
    if (check_drops(k, ids, n, "free_blocks", "freed") < 0) return NULL;
    if (!ROW_OK(k, I32(k, k->head, F_NEXT)) || !ROW_OK(k, I32(k, k->tail, F_PREV)))
        return corrupt("a free-queue sentinel links outside the block rows", k->head);
    Py_ssize_t nfirst = 0, nlast = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b == NULL_BLOCK_ID) continue;
        int32_t ref = I32(k, b, F_REF) - 1;
        J32(k, I32(k, b, F_REF), ref);
        J32(k, k->ledger[b], k->ledger[b] - 1);
        if (ref == 0) {
            if (caching && I32(k, b, F_HASH_TOKENS) != NO_HASH_TOKENS)
                k->last_buf[nlast++] = b;
            else
                k->first_buf[nfirst++] = b;
        }
    }
    queue_prepend_n(k, k->first_buf, nfirst);
    queue_append_n(k, k->last_buf, nlast);
    Py_RETURN_NONE;
}

/* unpin(blocks): drop one reference per handle like free, but every block reaching 0 joins
 * the tail of the free queue, hashed or not (vLLM's unpin_blocks: a last-resort eviction
 * candidate that stays readable until reused). The null block is refused, not skipped.
 * Checks first (the null block, then ref_cnt, then this process's ledger), then writes. */
static PyObject *Kernel_unpin(Kernel *k, PyObject *arg) {
    if (!kernel_alive(k)) return NULL;
    PyObject *seq = PySequence_Fast(arg, "unpin_blocks() takes an iterable of blocks");
    if (!seq) return NULL;
    Py_ssize_t n = read_ids(k, seq, "unpin_blocks");
    Py_DECREF(seq);
    if (n < 0) return NULL;
    int32_t *ids = k->ids_buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] == NULL_BLOCK_ID) {
            PyErr_SetString(UsageError, "unpin_blocks(): block 0 is the null block");
            return NULL;
        }
    }
    if (check_drops(k, ids, n, "unpin_blocks", "unpinned") < 0) return NULL;
    if (!ROW_OK(k, I32(k, k->tail, F_PREV)))
        return corrupt("a free-queue sentinel links outside the block rows", k->tail);
    Py_ssize_t nlast = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        int32_t ref = I32(k, b, F_REF) - 1;
        J32(k, I32(k, b, F_REF), ref);
        J32(k, k->ledger[b], k->ledger[b] - 1);
        if (ref == 0) k->last_buf[nlast++] = b;
    }
    queue_append_n(k, k->last_buf, nlast);
    Py_RETURN_NONE;
}

/* touch(blocks): one more reference each; ref-0 blocks leave the free queue. */
static PyObject *Kernel_touch(Kernel *k, PyObject *arg) {
    if (!kernel_alive(k)) return NULL;
    PyObject *seq = PySequence_Fast(arg, "touch() takes a sequence of blocks");
    if (!seq) return NULL;
    Py_ssize_t n = read_ids(k, seq, "touch");
    Py_DECREF(seq);
    if (n < 0) return NULL;
    int32_t *ids = k->ids_buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b != NULL_BLOCK_ID && I32(k, b, F_REF) == 0 &&
            (!ROW_OK(k, I32(k, b, F_PREV)) || !ROW_OK(k, I32(k, b, F_NEXT)))) {
            PyErr_Format(UsageError, "touch(): block %d has ref_cnt 0 but is not in the free queue",
                         b);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b == NULL_BLOCK_ID) continue;
        int32_t ref = I32(k, b, F_REF);
        if (ref == 0) {
            int32_t prev = I32(k, b, F_PREV), nxt = I32(k, b, F_NEXT);
            J32(k, I32(k, prev, F_NEXT), nxt);
            J32(k, I32(k, nxt, F_PREV), prev);
            J32(k, I32(k, b, F_PREV), NO_BLOCK);
            J32(k, I32(k, b, F_NEXT), NO_BLOCK);
            J64(k, k->hdr64[H_NUM_FREE], k->hdr64[H_NUM_FREE] - 1);
        }
        J32(k, I32(k, b, F_REF), ref + 1);
        J32(k, k->ledger[b], k->ledger[b] + 1);
    }
    Py_RETURN_NONE;
}

/* cache(blocks, fine_hashes, num_cached, ratio, block_size, group_id, block_mask,
 *       evicted_out) -> [(position, hash)]: keys for a range of a request's blocks. */
static PyObject *Kernel_cache(Kernel *k, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cache(blocks, fine_hashes, num_cached, ratio, "
                                         "block_size, group_id, block_mask, evicted_out)");
        return NULL;
    }
    if (!kernel_alive(k)) return NULL;
    Py_ssize_t num_cached = PyLong_AsSsize_t(args[2]);
    Py_ssize_t ratio = PyLong_AsSsize_t(args[3]);
    Py_ssize_t block_size = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    uint32_t group;
    if (!read_group(args[5], &group)) return NULL;
    PyObject *mask = args[6], *evicted_out = args[7];
    PyObject *seq = PySequence_Fast(args[0], "cache_full_blocks() takes a sequence of blocks");
    if (!seq) return NULL;
    Py_ssize_t n = read_ids(k, seq, "cache_full_blocks");
    Py_DECREF(seq);
    if (n < 0) return NULL;
    PyObject *hashes = PySequence_Fast(args[1], "block_hashes must be a sequence");
    if (!hashes) return NULL;
    Py_ssize_t num_hashes = PySequence_Fast_GET_SIZE(hashes);
    PyObject **hash_items = PySequence_Fast_ITEMS(hashes);
    int32_t *ids = k->ids_buf;
    /* first_buf[j] = the position i of the j-th block to cache. */
    Py_ssize_t m = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b == NULL_BLOCK_ID) continue;
        if (mask != Py_None) {
            PyObject *flag = PySequence_GetItem(mask, i);
            if (!flag) goto done;
            int keep = PyObject_IsTrue(flag);
            Py_DECREF(flag);
            if (keep < 0) goto done;
            if (!keep) continue;
        }
        if (k->scratch[b]) {
            PyErr_Format(UsageError,
                         "cache_full_blocks(): block %d appears twice in the blocks to cache", b);
            goto done;
        }
        k->scratch[b] = 1;
        Py_ssize_t position = num_cached + i;
        Py_ssize_t h_index = (position + 1) * ratio - 1;
        if (h_index < 0 || h_index >= num_hashes) {
            PyErr_Format(UsageError, "cache_full_blocks(): block hash %zd is missing", position);
            goto done;
        }
        PyObject *h = hash_items[h_index];
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != HASH_BYTES) {
            if (PyBytes_CheckExact(h))
                PyErr_Format(UsageError,
                             "cache_full_blocks(): block hash %zd must be %d bytes, got bytes "
                             "of %zd bytes", position, HASH_BYTES, PyBytes_GET_SIZE(h));
            else
                PyErr_Format(UsageError,
                             "cache_full_blocks(): block hash %zd must be %d bytes, got %.100s",
                             position, HASH_BYTES, Py_TYPE(h)->tp_name);
            goto done;
        }
        Py_ssize_t num_tokens = (position + 1) * block_size;
        int32_t held = I32(k, b, F_HASH_TOKENS);
        if (held != NO_HASH_TOKENS && held >= num_tokens) {
            PyErr_Format(UsageError,
                         "cache_full_blocks(): block %d is already cached (%d tokens, asked "
                         "for %zd)", b, held, num_tokens);
            goto done;
        }
        k->first_buf[m++] = (int32_t)i;
    }
    /* Results and evicted keys are built before the first write. */
    result = PyList_New(m);
    if (!result) goto done;
    Py_ssize_t evicted_before = evicted_out == Py_None ? 0 : PyList_GET_SIZE(evicted_out);
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t i = k->first_buf[j], position = num_cached + i;
        PyObject *h = hash_items[(position + 1) * ratio - 1];
        PyObject *item = Py_BuildValue("(nO)", position, h);
        if (!item) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, j, item);
        int32_t b = ids[i];
        if (evicted_out != Py_None && !append_keys(k, b, evicted_out)) {
            Py_CLEAR(result);
            break;
        }
    }
    if (!result) {
        if (evicted_out != Py_None)
            PyList_SetSlice(evicted_out, evicted_before, PY_SSIZE_T_MAX, NULL);
        goto done;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t i = k->first_buf[j], position = num_cached + i;
        int32_t b = ids[i];
        PyObject *h = hash_items[(position + 1) * ratio - 1];
        /* a shorter key (and any alias) gives way to the full one */
        if (index_pop_all(k, b) < 0 || !index_insert(k, (const unsigned char *)PyBytes_AS_STRING(h), group, b,
                          (int32_t)((position + 1) * block_size))) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    for (Py_ssize_t i = 0; i < n; i++) k->scratch[ids[i]] = 0;
    Py_DECREF(hashes);
    return result;
}

static PyMethodDef Kernel_methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))Kernel_lookup, METH_FASTCALL,
     "lookup(block_hash, group_id) -> first-inserted block id holding the key, or -1"},
    {"lookup_many", (PyCFunction)(void (*)(void))Kernel_lookup_many, METH_FASTCALL,
     "lookup_many(block_hashes, group_ids, fallback_bit) -> [block id, -2 - fallback id, or -1]"},
    {"cache", (PyCFunction)(void (*)(void))Kernel_cache, METH_FASTCALL,
     "cache(blocks, fine_hashes, num_cached, ratio, block_size, group_id, block_mask, "
     "evicted_out) -> [(position, hash)]"},
    {"get_cached", (PyCFunction)(void (*)(void))Kernel_get_cached, METH_FASTCALL,
     "get_cached(block_hash, group_ids, handles, make_handle) -> handles or None"},
    {"prefix", (PyCFunction)(void (*)(void))Kernel_prefix, METH_FASTCALL,
     "prefix(block_hashes, group_id, max_blocks, handles, make) -> the longest cached prefix"},
    {"insert", (PyCFunction)Kernel_insert, METH_VARARGS,
     "insert(block_hash, group_id, block_id, num_tokens): give an unhashed block the key"},
    {"evict", (PyCFunction)Kernel_evict, METH_O,
     "evict(block_id) -> (hash, group) it held, or None; the key leaves the index"},
    {"allocate", (PyCFunction)(void (*)(void))Kernel_allocate, METH_FASTCALL,
     "allocate(n, caching, handles, make_handle, evicted_out) -> list of handles"},
    {"free", (PyCFunction)(void (*)(void))Kernel_free, METH_FASTCALL,
     "free(blocks, caching): drop one reference per block, requeue blocks reaching 0"},
    {"unpin", (PyCFunction)Kernel_unpin, METH_O,
     "unpin(blocks): drop a reference per block, queueing blocks reaching 0 at the tail"},
    {"touch", (PyCFunction)Kernel_touch, METH_O,
     "touch(blocks): add a reference per block, taking ref-0 blocks out of the queue"},
    {"release", (PyCFunction)Kernel_release, METH_NOARGS,
     "release(): drop the buffer export of the segment"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmkv.pool._ckernel.Kernel",
    .tp_basicsize = sizeof(Kernel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Kernel(buffer, meta_off, idx_off, ledger_off, num_blocks, num_buckets, "
              "journal_off, journal_cap, geometry)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Kernel_init,
    .tp_dealloc = (destructor)Kernel_dealloc,
    .tp_methods = Kernel_methods,
};


/* ------------------------------------------------------------------ the pool lock */

/* CLock: the pool lock of shmkv/pool/lock.py (same semaphore, same holder record, same
 * re-entrancy, fencing, lock-phase and take-over rules) with its fast path in C.
 * shmkv/pool/lock.py (PoolLock) is the REFERENCE protocol; this is a port of it, and
 * tests/unit/test_lock_protocol.py runs the same observations on both. Re-entrant per
 * thread; other threads of the process first wait on a per-process gate (PoolLock's
 * threading.RLock: the GIL released, at most timeout_s), so only one thread of the process
 * at a time writes the process's lock_phase word: a waiting thread never overwrites the
 * holder's HOLDING mark, which takeover reads. Waits are cut in slices; after each empty slice `on_stall()` (Python) may take
 * the lock over from a dead holder and returns True when it did. A hold that starts after a
 * take-over, or finds the undo journal non-empty, calls `on_dirty(took_over)` (Python: the
 * repair) before the caller's critical section runs. */
typedef struct {
    PyObject_HEAD
    sem_t *sem;
    PyThread_type_lock gate; /* the threads of this process, in front of the semaphore */
    PyObject *forked;        /* NULL, or (in a forked child) the error every use raises */
    Py_buffer view;
    int has_view;
    int64_t *hdr64;
    Py_ssize_t h_holder, h_incarnation, h_since;
    uint64_t *fence; /* this process's slot incarnation in the process table, or NULL */
    int64_t *phase;  /* this process's lock_phase word in the process table, or NULL */
    int64_t holder_word;
    uint64_t incarnation;
    double timeout_s;
    double slice_s;
    double spin_s; /* how long a waiter polls the semaphore before it sleeps on it */
    int enabled;
    long depth;
    unsigned long owner;
    int64_t held_since;
    long long num_acquired, wait_ns_total, hold_ns_total;
    PyObject *record;     /* None, or a list of (wait_ns, hold_ns) */
    PyObject *on_timeout; /* callable() -> message naming the holder */
    PyObject *on_stall;   /* callable() -> True if it took the lock over */
    PyObject *on_dirty;   /* callable(took_over) -> None: repair under the lock */
    /* The savepoint of the call running under mutate() (see CLock_mutate). */
    PyObject *events;     /* the pool's list of queued events */
    PyObject *undo;       /* callable(journal_len, num_events): roll back to a savepoint */
    int64_t mark;
    Py_ssize_t mark_events;
} CLock;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int CLock_init(CLock *l, PyObject *args, PyObject *kwds) {
    PyObject *buf, *on_timeout, *on_stall, *on_dirty;
    const char *name;
    long long holder_word;
    int enabled;
    if (!PyArg_ParseTuple(args, "OsnnnLddpOOO", &buf, &name, &l->h_holder, &l->h_incarnation,
                          &l->h_since, &holder_word, &l->timeout_s, &l->slice_s, &enabled,
                          &on_timeout, &on_stall, &on_dirty))
        return -1;
    if (PyObject_GetBuffer(buf, &l->view, PyBUF_WRITABLE) < 0) return -1;
    l->has_view = 1;
    if (l->view.len < (H_LOCK_SEQ + 1) * 8 || l->view.len < (l->h_since + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "segment buffer too small for the header");
        return -1;
    }
    l->hdr64 = (int64_t *)l->view.buf;
    l->gate = PyThread_allocate_lock();
    if (!l->gate) {
        PyErr_NoMemory();
        return -1;
    }
    l->sem = sem_open(name, 0);
    if (l->sem == SEM_FAILED) {
        l->sem = NULL;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return -1;
    }
    l->holder_word = holder_word;
    l->enabled = enabled;
    Py_INCREF(Py_None);
    l->record = Py_None;
    l->on_timeout = Py_NewRef(on_timeout);
    l->on_stall = Py_NewRef(on_stall);
    l->on_dirty = Py_NewRef(on_dirty);
    return 0;
}

static void CLock_dealloc(CLock *l) {
    if (l->sem) sem_close(l->sem);
    if (l->gate) PyThread_free_lock(l->gate);
    if (l->has_view) PyBuffer_Release(&l->view);
    Py_XDECREF(l->record);
    Py_XDECREF(l->on_timeout);
    Py_XDECREF(l->on_stall);
    Py_XDECREF(l->on_dirty);
    Py_XDECREF(l->events);
    Py_XDECREF(l->undo);
    Py_XDECREF(l->forked);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static PyObject *CLock_close(CLock *l, PyObject *unused) {
    if (l->sem) {
        sem_close(l->sem);
        l->sem = NULL;
    }
    if (l->has_view) {
        PyBuffer_Release(&l->view);
        l->has_view = 0;
    }
    l->fence = NULL;
    l->phase = NULL;
    Py_RETURN_NONE;
}

static PyObject *CLock_set_identity(CLock *l, PyObject *args) {
    long long holder_word;
    unsigned long long incarnation;
    Py_ssize_t fence_offset, phase_offset;
    if (!PyArg_ParseTuple(args, "LKnn", &holder_word, &incarnation, &fence_offset,
                          &phase_offset))
        return NULL;
    if (!l->has_view || fence_offset < -1 || fence_offset + 8 > l->view.len ||
        (fence_offset >= 0 && fence_offset % 8) || phase_offset < -1 ||
        phase_offset + 8 > l->view.len || (phase_offset >= 0 && phase_offset % 8)) {
        PyErr_SetString(PyExc_ValueError, "bad fence or phase offset");
        return NULL;
    }
    l->holder_word = holder_word;
    l->incarnation = incarnation;
    l->fence = fence_offset < 0 ? NULL : (uint64_t *)((char *)l->view.buf + fence_offset);
    /* -1: no row of its own yet (an attach that has not claimed a slot): no phase marks */
    l->phase = phase_offset < 0 ? NULL : (int64_t *)((char *)l->view.buf + phase_offset);
    Py_RETURN_NONE;
}

static int fenced(CLock *l) {
    if (l->fence && *l->fence != l->incarnation) {
        PyErr_SetString(FencedError,
                        "this process's slot in the pool was reclaimed (it was taken for dead); "
                        "it must attach again");
        return 1;
    }
    return 0;
}

static inline void set_phase(CLock *l, int64_t phase) {
    if (l->phase) {
        FAULT_TICK();
        STORE_REL(l->phase, phase);
    }
}

/* sem_timedwait with the deadline `until` on CLOCK_MONOTONIC: sem_clockwait (glibc >= 2.30),
 * else a poll every millisecond, sleeping on the monotonic clock. 0, or -1 with errno. */
static int sem_wait_monotonic(sem_t *sem, const struct timespec *until) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    return sem_clockwait(sem, CLOCK_MONOTONIC, until);
#else
    for (;;) {
        if (sem_trywait(sem) == 0) return 0;
        if (errno != EAGAIN) return -1;
        struct timespec now, step = {0, 1000000L};
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > until->tv_sec ||
            (now.tv_sec == until->tv_sec && now.tv_nsec >= until->tv_nsec)) {
            errno = ETIMEDOUT;
            return -1;
        }
        clock_nanosleep(CLOCK_MONOTONIC, 0, &step, NULL);
    }
#endif
}

/* Waits for the semaphore in slices, asking on_stall() after each empty one. Returns 1 when
 * acquired, 2 when taken over, 0 with an exception set, 3 with an exception set when the
 * lock was taken over all the same (the caller gives the unit back). */
static int wait_in_slices(CLock *l, int64_t start) {
    int64_t deadline = start + (int64_t)(l->timeout_s * 1e9);
    for (;;) {
        int64_t now = now_ns();
        int64_t slice = (int64_t)(l->slice_s * 1e9);
        if (now + slice > deadline) slice = deadline - now;
        if (slice < 0) slice = 0;
        /* The slice's deadline is on CLOCK_MONOTONIC, like `deadline`: a step of the wall
         * clock neither stretches nor cuts the wait (sem_timedwait's deadline is on
         * CLOCK_REALTIME). */
        int64_t until_ns = now_ns() + slice;
        struct timespec until = {(time_t)(until_ns / 1000000000LL),
                                 (long)(until_ns % 1000000000LL)};
        int rc;
        Py_BEGIN_ALLOW_THREADS
        do {
            rc = sem_wait_monotonic(l->sem, &until);
        } while (rc != 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (rc == 0) return 1;
        if (errno != ETIMEDOUT) {
            PyErr_SetFromErrno(PyExc_OSError);
            return 0;
        }
        PyObject *took = PyObject_CallNoArgs(l->on_stall);
        /* on_stall wrote this process's holder word (it took the lock over), then raised:
         * the unit is ours, give it back (PoolLock._abort_acquire, _STAGE_IN_STALL). */
        if (!took) return l->hdr64[l->h_holder] == l->holder_word ? 3 : 0;
        int yes = PyObject_IsTrue(took);
        Py_DECREF(took);
        if (yes < 0) return 0;
        if (yes) return 2;
        if (now_ns() >= deadline) {
            PyObject *msg = PyObject_CallNoArgs(l->on_timeout);
            if (msg) {
                PyErr_SetObject(LockTimeoutError, msg);
                Py_DECREF(msg);
            }
            return 0;
        }
    }
}

/* PoolLock._spin: polls the semaphore for up to spin_s before the first sleep on it. A hold
 * lasts microseconds and the holder usually runs on another core, so the unit comes back
 * sooner than a sleep and a wake-up (two context switches) would take; a holder that was
 * preempted is waited for asleep, as before. The GIL is let go meanwhile. Returns 1 when it
 * took the unit. */
static int spin_for_semaphore(CLock *l, int64_t start) {
    int64_t until = start + (int64_t)(l->spin_s * 1e9);
    int got = 0;
    if (l->spin_s <= 0) return 0;
    Py_BEGIN_ALLOW_THREADS
    do {
        int value = 0;
        for (int i = 0; i < 64; i++) { /* a short pause between two reads of the value */
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        }
        if (sem_getvalue(l->sem, &value) == 0 && value > 0 && sem_trywait(l->sem) == 0) got = 1;
    } while (!got && now_ns() < until);
    Py_END_ALLOW_THREADS
    return got;
}

static PyObject *CLock_release(CLock *l, PyObject *unused);

static PyObject *CLock_acquire(CLock *l, PyObject *unused) {
    unsigned long me = PyThread_get_thread_ident();
    if (l->depth && l->owner == me) {
        l->depth++;
        Py_RETURN_NONE;
    }
    if (l->forked) {
        PyErr_SetObject((PyObject *)Py_TYPE(l->forked), l->forked);
        return NULL;
    }
    if (!l->sem || !l->has_view) {
        PyErr_SetString(UsageError, "the pool is closed; attach again to use it");
        return NULL;
    }
    /* The gate (PoolLock._gate): one thread of the process at a time past it. */
    if (!PyThread_acquire_lock(l->gate, NOWAIT_LOCK)) {
        PyLockStatus st;
        PY_TIMEOUT_T us = (PY_TIMEOUT_T)(l->timeout_s * 1e6);
        int64_t gate_deadline = now_ns() + (int64_t)(l->timeout_s * 1e9);
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            st = PyThread_acquire_lock_timed(l->gate, us, 1);
            Py_END_ALLOW_THREADS
            if (st != PY_LOCK_INTR) break;
            if (PyErr_CheckSignals() < 0) return NULL; /* Ctrl-C while waiting at the gate */
            us = (PY_TIMEOUT_T)((gate_deadline - now_ns()) / 1000);
            if (us < 0) us = 0;
        }
        if (st != PY_LOCK_ACQUIRED) {
            PyObject *secs = PyFloat_FromDouble(l->timeout_s);
            if (secs) {
                PyErr_Format(LockTimeoutError,
                             "pool lock: another thread of this process held it for over %S s",
                             secs);
                Py_DECREF(secs);
            }
            return NULL;
        }
    }
    if (l->depth && l->owner == me) { /* cannot happen: the gate is not re-entrant */
        PyThread_release_lock(l->gate);
        PyErr_SetString(PyExc_RuntimeError, "pool lock gate");
        return NULL;
    }
    if (fenced(l)) { /* a reclaimed slot: touch nothing, not even its phase */
        PyThread_release_lock(l->gate);
        return NULL;
    }
    set_phase(l, PHASE_ACQUIRING);
    int64_t start = now_ns();
    int got = 1;
    if (l->enabled && sem_trywait(l->sem) != 0 && !spin_for_semaphore(l, start)) {
        got = wait_in_slices(l, start);
        if (got == 3) { /* taken over, then on_stall raised: give the unit back */
            STORE_REL(&l->hdr64[l->h_holder], (int64_t)0);
            STORE_REL(&l->hdr64[l->h_incarnation], (int64_t)0);
            STORE_REL(&l->hdr64[l->h_since], (int64_t)0);
            sem_post(l->sem);
            got = 0;
        }
        if (!got) {
            set_phase(l, PHASE_IDLE);
            PyThread_release_lock(l->gate);
            return NULL;
        }
    }
    set_phase(l, PHASE_HOLDING); /* first thing with the unit: see shmkv/pool/takeover.py */
    int64_t now = now_ns();
    if (fenced(l)) { /* reclaimed while it waited: give the unit back, touch nothing more */
        if (l->enabled) sem_post(l->sem);
        set_phase(l, PHASE_IDLE);
        PyThread_release_lock(l->gate);
        return NULL;
    }
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_holder], l->holder_word);
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_incarnation], (int64_t)l->incarnation);
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_since], now);
    FAULT_TICK();
    STORE_REL(&l->hdr64[H_LOCK_SEQ], l->hdr64[H_LOCK_SEQ] + 1);
    l->depth = 1;
    l->owner = me;
    l->held_since = now;
    l->num_acquired++;
    l->wait_ns_total += now - start;
    if (l->record != Py_None) {
        PyObject *item = Py_BuildValue("(Li)", (long long)(now - start), 0);
        if (!item || PyList_Append(l->record, item) < 0) {
            Py_XDECREF(item);
            PyErr_Clear(); /* statistics only: never fail a hold for them */
        } else {
            Py_DECREF(item);
        }
    }
    if (got == 2 || l->hdr64[H_JOURNAL_LEN] != 0) {
        PyObject *r = PyObject_CallFunctionObjArgs(l->on_dirty, got == 2 ? Py_True : Py_False,
                                                   NULL);
        if (!r) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *rel = CLock_release(l, NULL);
            Py_XDECREF(rel);
            PyErr_Restore(type, value, tb);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *CLock_release(CLock *l, PyObject *unused) {
    if (l->depth > 1) {
        l->depth--;
        Py_RETURN_NONE;
    }
    if (l->forked) {
        PyErr_SetObject((PyObject *)Py_TYPE(l->forked), l->forked);
        return NULL;
    }
    if (l->depth == 0 || !l->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "release of a pool lock that is not held");
        return NULL;
    }
    l->depth = 0;
    l->owner = 0;
    set_phase(l, PHASE_RELEASING);
    if (l->hdr64[H_JOURNAL_LEN] != 0) { /* commit: the hold's writes stand */
        FAULT_TICK();
        STORE_REL(&l->hdr64[H_JOURNAL_LEN], (int64_t)0); /* the commit */
    }
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_holder], (int64_t)0);
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_incarnation], (int64_t)0);
    FAULT_TICK();
    STORE_REL(&l->hdr64[l->h_since], (int64_t)0);
    /* The hold ends at the post: read the clock before it, for the post may wake a waiter
     * that preempts this process before the next line runs. */
    int64_t held = now_ns() - l->held_since;
    if (l->enabled) sem_post(l->sem);
    set_phase(l, PHASE_IDLE);
    PyThread_release_lock(l->gate);
    l->hold_ns_total += held;
    if (l->record != Py_None && PyList_GET_SIZE(l->record) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(l->record) - 1;
        PyObject *prev = PyList_GET_ITEM(l->record, last);
        PyObject *item = Py_BuildValue("(OL)", PyTuple_GET_ITEM(prev, 0), (long long)held);
        if (item) PyList_SetItem(l->record, last, item);
        else PyErr_Clear();
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- one call's hold */

static PyObject *str_planned = NULL, *str_begin = NULL, *str_end = NULL;
/* shmkv.pool.fault, which hands itself over when it imports this module (set_fault): the
 * kernel never imports it back. */
static PyObject *fault_module = NULL;

static PyObject *set_fault(PyObject *mod, PyObject *arg) {
    Py_XSETREF(fault_module, Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* An error is set and (t, v, tb) was being handled when it was raised: Python's rule, the
 * new error wins with the old one as its __context__. */
static void chain_handled(PyObject *t, PyObject *v, PyObject *tb) {
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t, &v, &tb);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (tb) PyException_SetTraceback(v, tb);
    if (v2 && v) PyException_SetContext(v2, v); /* steals v */
    else Py_XDECREF(v);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    PyErr_Restore(t2, v2, tb2);
}

/* mark_forked(error): in a forked child, every later acquire or release raises `error` and
 * touches nothing (PoolLock.mark_forked). The gate may be held by a thread of the parent
 * that the child does not have: it is never waited for again. */
static PyObject *CLock_mark_forked(CLock *l, PyObject *error) {
    if (!PyExceptionInstance_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "mark_forked() takes an exception instance");
        return NULL;
    }
    Py_XSETREF(l->forked, Py_NewRef(error));
    l->depth = 0;
    l->owner = 0;
    l->phase = NULL;
    l->fence = NULL;
    Py_RETURN_NONE;
}

static PyObject *CLock_set_savepoint(CLock *l, PyObject *args) {
    PyObject *events, *undo;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &events, &undo)) return NULL;
    Py_XSETREF(l->events, Py_NewRef(events));
    Py_XSETREF(l->undo, Py_NewRef(undo));
    Py_RETURN_NONE;
}

static PyObject *CLock_savepoint(CLock *l, PyObject *unused) {
    if (!l->events || !l->has_view || l->depth == 0) {
        PyErr_SetString(PyExc_RuntimeError, "savepoint() outside a mutate() call");
        return NULL;
    }
    l->mark = l->hdr64[H_JOURNAL_LEN];
    l->mark_events = PyList_GET_SIZE(l->events);
    Py_RETURN_NONE;
}

/* mutate(op, fn, *args): PoolLock.mutate (shmkv/pool/lock.py, the reference) in C, where a
 * Python wrapper would cost a frame (~60-100 ns) on every call of the hot paths. Fault
 * counting for `op`, the lock, a savepoint (journal_len, queued events), fn(*args); on an
 * exception, undo(savepoint) and re-raise; the lock given back; the fault count ended. */
static PyObject *CLock_mutate(CLock *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "mutate(op, fn, *args) takes at least 2 arguments");
        return NULL;
    }
    if (!l->events) {
        PyErr_SetString(PyExc_RuntimeError, "mutate() before set_savepoint()");
        return NULL;
    }
    int counting = 0;
    PyObject *fault = fault_module;
    if (fault) {
        PyObject *planned = PyObject_GetAttr(fault, str_planned);
        if (!planned) return NULL;
        counting = planned != Py_None; /* a plan is waiting: does this call start it? */
        Py_DECREF(planned);
    }
    if (counting) {
        PyObject *r = PyObject_CallMethodOneArg(fault, str_begin, args[0]);
        if (!r) return NULL;
        counting = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (counting < 0) return NULL;
    }
    PyObject *result = NULL;
    PyObject *r = CLock_acquire(l, NULL);
    if (r) {
        Py_DECREF(r);
        int64_t outer_mark = l->mark;
        Py_ssize_t outer_events = l->mark_events;
        l->mark = l->hdr64[H_JOURNAL_LEN];
        l->mark_events = PyList_GET_SIZE(l->events);
        result = PyObject_Vectorcall(args[1], args + 2, nargs - 2, NULL);
        PyObject *t = NULL, *v = NULL, *tb = NULL;
        if (!result) {
            PyErr_Fetch(&t, &v, &tb);
            /* corrupt shared state found: undo, then repair (a third argument, True) */
            PyObject *u = t && PyErr_GivenExceptionMatches(t, InvariantViolation)
                ? PyObject_CallFunction(l->undo, "LnO", (long long)l->mark, l->mark_events,
                                        Py_True)
                : PyObject_CallFunction(l->undo, "Ln", (long long)l->mark, l->mark_events);
            if (u) {
                Py_DECREF(u);
            } else {
                chain_handled(t, v, tb);
                PyErr_Fetch(&t, &v, &tb);
            }
        }
        l->mark = outer_mark;
        l->mark_events = outer_events;
        PyObject *rel = CLock_release(l, NULL);
        if (rel) {
            Py_DECREF(rel);
            if (!result) PyErr_Restore(t, v, tb);
        } else {
            Py_CLEAR(result);
            if (t || v) chain_handled(t, v, tb);
        }
    }
    if (counting) {
        PyObject *t = NULL, *v = NULL, *tb = NULL;
        if (!result) PyErr_Fetch(&t, &v, &tb);
        PyObject *e = PyObject_CallMethodNoArgs(fault, str_end);
        if (e) {
            Py_DECREF(e);
            if (!result) PyErr_Restore(t, v, tb);
        } else {
            Py_CLEAR(result);
            if (t || v) chain_handled(t, v, tb);
        }
    }
    return result;
}

static PyObject *CLock_enter(CLock *l, PyObject *unused) {
    PyObject *r = CLock_acquire(l, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_INCREF(l);
    return (PyObject *)l;
}

static PyObject *CLock_exit(CLock *l, PyObject *args) {
    PyObject *r = CLock_release(l, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *CLock_get_held(CLock *l, void *c) { return PyBool_FromLong(l->depth > 0); }
static PyObject *CLock_get_record(CLock *l, void *c) { Py_INCREF(l->record); return l->record; }
static int CLock_set_record(CLock *l, PyObject *v, void *c) {
    if (!v || (v != Py_None && !PyList_Check(v))) {
        PyErr_SetString(PyExc_TypeError, "record must be a list or None");
        return -1;
    }
    Py_INCREF(v);
    Py_SETREF(l->record, v);
    return 0;
}
static PyObject *CLock_get_timeout(CLock *l, void *c) { return PyFloat_FromDouble(l->timeout_s); }
static int CLock_set_timeout(CLock *l, PyObject *v, void *c) {
    double t = v ? PyFloat_AsDouble(v) : -1;
    if (PyErr_Occurred()) return -1;
    if (!(t > 0)) {
        PyErr_SetString(PyExc_ValueError, "timeout_s must be positive");
        return -1;
    }
    l->timeout_s = t;
    return 0;
}
static PyObject *CLock_get_spin(CLock *l, void *c) { return PyFloat_FromDouble(l->spin_s); }
static int CLock_set_spin(CLock *l, PyObject *v, void *c) {
    double t = v ? PyFloat_AsDouble(v) : -1;
    if (PyErr_Occurred()) return -1;
    if (!(t >= 0 && t <= 0.01)) {
        PyErr_SetString(PyExc_ValueError, "spin_s must be between 0 and 0.01 s");
        return -1;
    }
    l->spin_s = t;
    return 0;
}
static PyObject *CLock_get_stat(CLock *l, void *which) {
    long long v = which == (void *)0 ? l->num_acquired
                : which == (void *)1 ? l->wait_ns_total : l->hold_ns_total;
    return PyLong_FromLongLong(v);
}

static PyGetSetDef CLock_getset[] = {
    {"held", (getter)CLock_get_held, NULL, "whether this process holds the lock", NULL},
    {"record", (getter)CLock_get_record, (setter)CLock_set_record,
     "None, or a list receiving (wait_ns, hold_ns) per hold", NULL},
    {"timeout_s", (getter)CLock_get_timeout, (setter)CLock_set_timeout,
     "the longest a caller waits", NULL},
    {"spin_s", (getter)CLock_get_spin, (setter)CLock_set_spin,
     "how long a waiter polls the semaphore before it sleeps on it (0: never)", NULL},
    {"num_acquired", (getter)CLock_get_stat, NULL, "holds taken", (void *)0},
    {"wait_ns_total", (getter)CLock_get_stat, NULL, "ns spent waiting", (void *)1},
    {"hold_ns_total", (getter)CLock_get_stat, NULL, "ns spent holding", (void *)2},
    {NULL},
};

static PyMethodDef CLock_methods[] = {
    {"acquire", (PyCFunction)CLock_acquire, METH_NOARGS, "take the lock (or one more level)"},
    {"release", (PyCFunction)CLock_release, METH_NOARGS, "give back one level of the lock"},
    {"mark_forked", (PyCFunction)CLock_mark_forked, METH_O,
     "mark_forked(error): in a forked child, every later acquire/release raises error"},
    {"set_savepoint", (PyCFunction)CLock_set_savepoint, METH_VARARGS,
     "set_savepoint(events, undo): what mutate() rolls a failed call back with"},
    {"mutate", (PyCFunction)(void (*)(void))CLock_mutate, METH_FASTCALL,
     "mutate(op, fn, *args): fn(*args) under the lock, all or nothing (PoolLock.mutate)"},
    {"savepoint", (PyCFunction)CLock_savepoint, METH_NOARGS,
     "move the running mutate() call's savepoint to here"},
    {"__enter__", (PyCFunction)CLock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)CLock_exit, METH_VARARGS, NULL},
    {"set_identity", (PyCFunction)CLock_set_identity, METH_VARARGS,
     "set_identity(holder_word, incarnation, fence_offset_bytes (-1: none), "
     "phase_offset_bytes)"},
    {"close", (PyCFunction)CLock_close, METH_NOARGS, "close the semaphore and the buffer"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmkv.pool._ckernel.CLock",
    .tp_basicsize = sizeof(CLock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CLock(buffer, sem_name, h_holder, h_incarnation, h_since, holder_word, "
              "timeout_s, slice_s, enabled, on_timeout, on_stall, on_dirty)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CLock_init,
    .tp_dealloc = (destructor)CLock_dealloc,
    .tp_methods = CLock_methods,
    .tp_getset = CLock_getset,
};

static PyObject *set_errors(PyObject *mod, PyObject *args) {
    PyObject *usage, *oob, *inv, *timeout, *fenced;
    if (!PyArg_ParseTuple(args, "OOOOO", &usage, &oob, &inv, &timeout, &fenced)) return NULL;
    Py_XSETREF(LockTimeoutError, Py_NewRef(timeout));
    Py_XSETREF(FencedError, Py_NewRef(fenced));
    Py_XSETREF(UsageError, Py_NewRef(usage));
    Py_XSETREF(OutOfBlocksError, Py_NewRef(oob));
    Py_XSETREF(InvariantViolation, Py_NewRef(inv));
    Py_RETURN_NONE;
}

/* fence(): a full memory barrier, for the Python paths that publish through shared memory
 * with plain numpy / memoryview stores (shmkv/pool/barriers.py). */
static PyObject *mem_fence(PyObject *mod, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ block tables
 *
 * The rank side of shmkv/ranks/block_table.py: a batch's token indices and its slot
 * mappings from the shared tables, in one pass each. numpy is the reference there; these
 * take only what they can do exactly as it does (lists or tuples of ints, or 1-d
 * C-contiguous int64 buffers, every value in range) and answer "not taken" for anything
 * else, so the numpy path runs and raises the error that names the problem. The tables are
 * read with plain loads; the caller's seqlock validates them. */

/* An int64 operand: a buffer's data, or a list's or tuple's ints copied out. */
typedef struct {
    Py_buffer view;
    int has_view;
    int64_t *copy;
    const int64_t *data;
    Py_ssize_t n;
} I64Vec;

static void i64vec_close(I64Vec *v) {
    if (v->has_view) PyBuffer_Release(&v->view);
    v->has_view = 0;
    PyMem_Free(v->copy);
    v->copy = NULL;
}

/* 1: opened; 0: not taken (nothing raised); -1: an error was raised (memory). */
static int i64vec_open(PyObject *obj, I64Vec *v) {
    memset(v, 0, sizeof(*v));
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        v->copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
        if (!v->copy) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int overflow = 0;
            long long x = PyLong_Check(items[i])
                              ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : -1;
            if (!PyLong_Check(items[i]) || overflow) {
                i64vec_close(v);
                return 0;
            }
            v->copy[i] = x;
        }
        v->data = v->copy;
        v->n = n;
        return 1;
    }
    if (!PyObject_CheckBuffer(obj)) return 0;
    if (PyObject_GetBuffer(obj, &v->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* e.g. not contiguous: numpy's path copes */
        return 0;
    }
    v->has_view = 1;
    const char *f = v->view.format;
    if (v->view.ndim != 1 || v->view.itemsize != 8 || !f || (strcmp(f, "l") && strcmp(f, "q"))) {
        i64vec_close(v);
        return 0;
    }
    v->data = (const int64_t *)v->view.buf;
    v->n = v->view.shape[0];
    return 1;
}

/* Opens the tuple ``tuple``'s buffers into tables[]: int32 [rows, width], C-contiguous, all
 * with the rows of the first, writable when asked. 1: all opened; 0: not taken (nothing
 * raised). Either way *opened buffers are open: tables_close releases them. */
static int tables_open(PyObject *tuple, Py_buffer *tables, int writable, Py_ssize_t *opened) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    for (*opened = 0; *opened < PyTuple_GET_SIZE(tuple);) {
        Py_buffer *b = &tables[*opened];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, *opened), b, flags) < 0) {
            PyErr_Clear();
            return 0;
        }
        ++*opened;
        if (b->ndim != 2 || b->itemsize != 4 || b->shape[0] != tables[0].shape[0]) return 0;
    }
    return 1;
}

static void tables_close(Py_buffer *tables, Py_ssize_t opened) {
    for (Py_ssize_t g = 0; g < opened; g++) PyBuffer_Release(&tables[g]);
}

/* token_indices(counts, starts, req_out, pos_out) -> total tokens, or -1 (not taken).
 * Request i schedules counts[i] tokens from position starts[i]; writes, request-major, the
 * request index and the position of every token into the int64 buffers req_out / pos_out,
 * unless they are shorter than the total (then writes nothing: the caller sizes them and
 * calls again). */
static PyObject *bt_token_indices(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "token_indices(counts, starts, req_out, pos_out)");
        return NULL;
    }
    I64Vec counts, starts;
    Py_buffer req, pos;
    long long total = -1;
    int r = i64vec_open(args[0], &counts);
    if (r <= 0) return r < 0 ? NULL : PyLong_FromLong(-1);
    r = i64vec_open(args[1], &starts);
    if (r <= 0) {
        i64vec_close(&counts);
        return r < 0 ? NULL : PyLong_FromLong(-1);
    }
    if (counts.n != starts.n) goto done;
    total = 0;
    for (Py_ssize_t i = 0; i < counts.n; i++) {
        int64_t c = counts.data[i], s = starts.data[i];
        if (c < 0 || s < 0 || s > INT64_MAX - c || total > PY_SSIZE_T_MAX / 8 - c) {
            total = -1;
            goto done;
        }
        total += c;
    }
    if (PyObject_GetBuffer(args[2], &req, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
    if (PyObject_GetBuffer(args[3], &pos, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&req);
        goto fail;
    }
    if (req.itemsize == 8 && pos.itemsize == 8 && req.len >= total * 8 && pos.len >= total * 8) {
        int64_t *ro = req.buf, *po = pos.buf, t = 0;
        for (Py_ssize_t i = 0; i < counts.n; i++)
            for (int64_t k = 0, s = starts.data[i]; k < counts.data[i]; k++, t++) {
                ro[t] = i;
                po[t] = s + k;
            }
    }
    PyBuffer_Release(&req);
    PyBuffer_Release(&pos);
done:
    i64vec_close(&counts);
    i64vec_close(&starts);
    return PyLong_FromLongLong(total);
fail:
    i64vec_close(&counts);
    i64vec_close(&starts);
    return NULL;
}

/* slot_mappings(tables, block_sizes, rows, req, pos, out) -> bool.
 * Token t lies in table row rows[req[t]] at position pos[t]; its slot in group g is
 * tables[g][row, pos // bs] * bs + pos % bs (bs = block_sizes[g]), written to out[g, t]
 * (an int64 buffer of len(tables) * len(pos) words). out=None only checks. False (nothing
 * written) when anything is out of range or not taken; tables are int32 [rows, width]. */
static PyObject *bt_slot_mappings(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) ||
        PyTuple_GET_SIZE(args[0]) != PyTuple_GET_SIZE(args[1]) ||
        PyTuple_GET_SIZE(args[0]) > 64 || PyTuple_GET_SIZE(args[0]) < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "slot_mappings(tables: tuple, block_sizes: tuple, rows, req, pos, out)");
        return NULL;
    }
    Py_ssize_t ngroups = PyTuple_GET_SIZE(args[0]), opened = 0, g, t;
    Py_buffer tables[64], out;
    int64_t bs[64];
    I64Vec rows, req, pos;
    int taken = 0, have_out = 0, r;
    PyObject *result = NULL;
    if ((r = i64vec_open(args[2], &rows)) <= 0) return r < 0 ? NULL : Py_NewRef(Py_False);
    if ((r = i64vec_open(args[3], &req)) <= 0) {
        i64vec_close(&rows);
        return r < 0 ? NULL : Py_NewRef(Py_False);
    }
    if ((r = i64vec_open(args[4], &pos)) <= 0) {
        i64vec_close(&rows);
        i64vec_close(&req);
        return r < 0 ? NULL : Py_NewRef(Py_False);
    }
    for (g = 0; g < ngroups; g++) {
        PyObject *size = PyTuple_GET_ITEM(args[1], g);
        bs[g] = PyLong_Check(size) ? PyLong_AsLongLong(size) : 0;
        if (bs[g] <= 0) {
            PyErr_Clear();
            goto out;
        }
    }
    if (!tables_open(args[0], tables, 0, &opened) || req.n != pos.n) goto out;
    for (t = 0; t < rows.n; t++)
        if (rows.data[t] < 0 || rows.data[t] >= tables[0].shape[0]) goto out;
    for (t = 0; t < req.n; t++)
        if (req.data[t] < 0 || req.data[t] >= rows.n) goto out;
    for (g = 0; g < ngroups; g++) {
        int64_t limit = tables[g].shape[1] * bs[g];
        for (t = 0; t < pos.n; t++)
            if (pos.data[t] < 0 || pos.data[t] >= limit) goto out;
    }
    if (args[5] != Py_None) {
        if (PyObject_GetBuffer(args[5], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            goto out;
        }
        have_out = 1;
        if (out.itemsize != 8 || out.len != (Py_ssize_t)(ngroups * pos.n * 8)) goto out;
        int64_t *o = out.buf;
        for (g = 0; g < ngroups; g++) {
            const int32_t *table = tables[g].buf;
            int64_t width = tables[g].shape[1], b = bs[g];
            for (t = 0; t < pos.n; t++) {
                int64_t p = pos.data[t];
                o[g * pos.n + t] = (int64_t)table[rows.data[req.data[t]] * width + p / b] * b + p % b;
            }
        }
    }
    taken = 1;
out:
    result = Py_NewRef(taken ? Py_True : Py_False);
    if (have_out) PyBuffer_Release(&out);
    tables_close(tables, opened);
    i64vec_close(&rows);
    i64vec_close(&req);
    i64vec_close(&pos);
    return result;
}

/* scatter_rows(tables, num_blocks, rows, ids_per_row, appending, max_id, begin_write)
 * -> bool: the scheduler side's add_rows / append_rows. Row rows[i] of group g gets
 * ids_per_row[i][g] (written after its num_blocks[g, row] blocks when appending, from
 * column 0 otherwise) and its new length. Everything is checked and copied out first (rows
 * in range and distinct, one id list per group, every id an int in [0, max_id], no row
 * past its table's width); then begin_write() is called (the seqlock's odd store) and the
 * copied plan is stored, touching no Python object (another thread may run in the call).
 * False, with nothing called or written, when anything would be refused or is not a list
 * or tuple of ints: the Python path then says why. */
static PyObject *bt_scatter_rows(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) > 64 ||
        PyTuple_GET_SIZE(args[0]) < 1) {
        PyErr_SetString(PyExc_TypeError, "scatter_rows(tables: tuple, num_blocks, rows, "
                                         "ids_per_row, appending, max_id, begin_write)");
        return NULL;
    }
    if (!(PyList_Check(args[3]) || PyTuple_Check(args[3])) || !PySequence_Fast_GET_SIZE(args[3]))
        Py_RETURN_FALSE; /* not a list or tuple, or no rows: the Python path */
    Py_ssize_t ngroups = PyTuple_GET_SIZE(args[0]), opened = 0, g, i, k, total = 0;
    Py_buffer tables[64], lengths;
    int have_lengths = 0, taken = 0, r;
    int appending = PyObject_IsTrue(args[4]);
    long long max_id = PyLong_AsLongLong(args[5]);
    unsigned char *seen = NULL;
    int64_t *spans = NULL; /* per (row, group): start, count */
    int32_t *ids_out = NULL;
    I64Vec rows;
    PyObject *result = NULL;
    if (appending < 0 || (max_id == -1 && PyErr_Occurred())) return NULL;
    if ((r = i64vec_open(args[2], &rows)) <= 0) return r < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *per_row = args[3];
    Py_ssize_t nrows = PySequence_Fast_GET_SIZE(per_row);
    PyObject **row_ids = PySequence_Fast_ITEMS(per_row);
    if (!tables_open(args[0], tables, 1, &opened)) goto out;
    if (PyObject_GetBuffer(args[1], &lengths, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        goto out;
    }
    have_lengths = 1;
    Py_ssize_t table_rows = tables[0].shape[0];
    if (lengths.itemsize != 4 || lengths.len != (Py_ssize_t)(4 * ngroups * table_rows) ||
        rows.n != nrows)
        goto out;
    int32_t *len32 = lengths.buf;
    seen = PyMem_Calloc((size_t)(table_rows ? table_rows : 1), 1);
    spans = PyMem_Malloc((size_t)(nrows * ngroups * 2 + 1) * sizeof(int64_t));
    if (!seen || !spans) {
        PyErr_NoMemory();
        goto fail;
    }
    /* Every check, before anything is written: the spans, and the number of ids. */
    for (i = 0; i < nrows; i++) {
        int64_t row = rows.data[i];
        if (row < 0 || row >= table_rows || seen[row]) goto out;
        seen[row] = 1;
        PyObject *groups = row_ids[i];
        if (!(PyList_Check(groups) || PyTuple_Check(groups)) ||
            PySequence_Fast_GET_SIZE(groups) != ngroups)
            goto out;
        for (g = 0; g < ngroups; g++) {
            PyObject *ids = PySequence_Fast_ITEMS(groups)[g];
            if (!(PyList_Check(ids) || PyTuple_Check(ids))) goto out;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
            int64_t start = appending ? len32[g * table_rows + row] : 0;
            if (start < 0 || start + n > tables[g].shape[1]) goto out;
            spans[2 * (i * ngroups + g)] = start;
            spans[2 * (i * ngroups + g) + 1] = n;
            total += n;
        }
    }
    ids_out = PyMem_Malloc((size_t)(total + 1) * sizeof(int32_t));
    if (!ids_out) {
        PyErr_NoMemory();
        goto fail;
    }
    /* The ids, copied out and checked (no Python code runs in this loop: the items are
     * ints, read as they are). */
    for (i = 0, total = 0; i < nrows; i++) {
        PyObject **groups = PySequence_Fast_ITEMS(row_ids[i]);
        for (g = 0; g < ngroups; g++) {
            PyObject **items = PySequence_Fast_ITEMS(groups[g]);
            for (k = 0; k < spans[2 * (i * ngroups + g) + 1]; k++) {
                int overflow = 0;
                if (!PyLong_Check(items[k])) goto out;
                long long id = PyLong_AsLongLongAndOverflow(items[k], &overflow);
                if (overflow || id < 0 || id > max_id || id > INT32_MAX) goto out;
                ids_out[total++] = (int32_t)id;
            }
        }
    }
    PyObject *begun = PyObject_CallNoArgs(args[6]);
    if (!begun) goto fail;
    Py_DECREF(begun);
    for (i = 0, total = 0; i < nrows; i++) {
        int64_t row = rows.data[i];
        for (g = 0; g < ngroups; g++) {
            int64_t start = spans[2 * (i * ngroups + g)], n = spans[2 * (i * ngroups + g) + 1];
            int32_t *dst = (int32_t *)tables[g].buf + row * tables[g].shape[1] + start;
            memcpy(dst, ids_out + total, (size_t)n * sizeof(int32_t));
            total += n;
            len32[g * table_rows + row] = (int32_t)(start + n);
        }
    }
    taken = 1;
out:
    result = Py_NewRef(taken ? Py_True : Py_False);
fail:
    PyMem_Free(ids_out);
    PyMem_Free(spans);
    PyMem_Free(seen);
    if (have_lengths) PyBuffer_Release(&lengths);
    tables_close(tables, opened);
    i64vec_close(&rows);
    return result;
}

/* The offload tier's eviction heap (shmkv/vllm/lru.py, whose Python methods are the
 * reference): entries (rank int64, block int32) in two arrays, a binary min-heap ordered by
 * (rank, block). Derived data the caller writes under the pool lock inside its dirty flag. */
static int heap_open(PyObject *const *args, Py_buffer *hr, Py_buffer *hb) {
    if (PyObject_GetBuffer(args[0], hr, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return 0;
    if (PyObject_GetBuffer(args[1], hb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(hr);
        return 0;
    }
    if (hr->itemsize != 8 || hb->itemsize != 4 || hr->len / 8 != hb->len / 4) {
        PyBuffer_Release(hr);
        PyBuffer_Release(hb);
        PyErr_SetString(PyExc_ValueError, "heap: ranks must be int64 and blocks int32, "
                                          "of one length");
        return 0;
    }
    return 1;
}

static PyObject *heap_push(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "heap_push(ranks, blocks, size, rank, block)");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    long long rank = PyLong_AsLongLong(args[3]);
    long block = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer hrb, hbb;
    if (!heap_open(args, &hrb, &hbb)) return NULL;
    int64_t *hr = hrb.buf;
    int32_t *hb = hbb.buf;
    if (size < 0 || size >= hrb.len / 8) {
        PyBuffer_Release(&hrb);
        PyBuffer_Release(&hbb);
        PyErr_Format(PyExc_ValueError, "heap_push: size %zd out of [0, %zd)", size, hrb.len / 8);
        return NULL;
    }
    Py_ssize_t i = size;
    while (i) { /* sift up */
        Py_ssize_t parent = (i - 1) >> 1;
        int64_t pr = hr[parent];
        if (pr < rank || (pr == rank && hb[parent] <= block)) break;
        hr[i] = pr;
        hb[i] = hb[parent];
        i = parent;
    }
    hr[i] = rank;
    hb[i] = (int32_t)block;
    PyBuffer_Release(&hrb);
    PyBuffer_Release(&hbb);
    Py_RETURN_NONE;
}

/* Takes the top entry off a heap of *size entries: the last entry sifts down from the root. */
static void heap_take_top(int64_t *hr, int32_t *hb, Py_ssize_t *size, int64_t *top_rank,
                          int32_t *top_block) {
    *top_rank = hr[0];
    *top_block = hb[0];
    Py_ssize_t n = *size - 1;
    int64_t rank = hr[n];
    int32_t block = hb[n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        int64_t cr = hr[child];
        if (child + 1 < n) {
            int64_t sr = hr[child + 1];
            if (sr < cr || (sr == cr && hb[child + 1] < hb[child])) {
                child += 1;
                cr = sr;
            }
        }
        if (rank < cr || (rank == cr && block <= hb[child])) break;
        hr[i] = cr;
        hb[i] = hb[child];
        i = child;
    }
    if (n) {
        hr[i] = rank;
        hb[i] = block;
    }
    *size = n;
}

static PyObject *heap_pop(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "heap_pop(ranks, blocks, size)");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    if (size == -1 && PyErr_Occurred()) return NULL;
    Py_buffer hrb, hbb;
    if (!heap_open(args, &hrb, &hbb)) return NULL;
    int64_t *hr = hrb.buf;
    int32_t *hb = hbb.buf;
    if (size < 1 || size > hrb.len / 8) {
        PyBuffer_Release(&hrb);
        PyBuffer_Release(&hbb);
        PyErr_Format(PyExc_ValueError, "heap_pop: size %zd out of [1, %zd]", size, hrb.len / 8);
        return NULL;
    }
    int64_t top_rank;
    int32_t top_block;
    heap_take_top(hr, hb, &size, &top_rank, &top_block);
    PyBuffer_Release(&hrb);
    PyBuffer_Release(&hbb);
    return Py_BuildValue("(Li)", (long long)top_rank, (int)top_block);
}

/* heap_victims(ranks_heap, blocks_heap, size, ranks, words, jobs, protected, num, layout)
 *   -> (size, victims, aside, tied)
 * LRUTier.pop_victims' loop (shmkv/vllm/lru.py, whose Python code is the reference) up to its
 * first rank tie: pops entries until `num` victims. An entry is dropped when stale (its block's
 * rank in `ranks` is another, its block holds no key or a key whose group has the pending bit)
 * or when its block was met already; set aside (returned, not pushed back) when its block is
 * held (ref_cnt > 0 or a job bit) or in the set `protected`; a victim otherwise. A victim
 * candidate whose rank ties the new top is returned as `tied` (rank, block), not taken: the
 * caller breaks the tie by key bytes. `words`: the pool's block rows as int32 words; `layout`:
 * (row_words, f_ref, f_hash_tokens, f_group, no_key, pending_bit). */
static PyObject *heap_victims(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "heap_victims(ranks_heap, blocks_heap, size, ranks, "
                                         "words, jobs, protected, num, layout)");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    Py_ssize_t num = PyLong_AsSsize_t(args[7]);
    long long row, f_ref, f_htok, f_gid, no_key, pending;
    if (PyErr_Occurred()) return NULL;
    if (!PyAnySet_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "heap_victims: protected must be a set");
        return NULL;
    }
    if (!PyArg_ParseTuple(args[8], "LLLLLL", &row, &f_ref, &f_htok, &f_gid, &no_key, &pending))
        return NULL;
    Py_buffer hrb, hbb, rb = {0}, wb = {0}, jb = {0};
    if (!heap_open(args, &hrb, &hbb)) return NULL;
    PyObject *result = NULL, *victims = NULL, *aside = NULL, *tied = NULL;
    int32_t *met = NULL;
    Py_ssize_t num_met = 0;
    if (PyObject_GetBuffer(args[3], &rb, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(args[4], &wb, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(args[5], &jb, PyBUF_C_CONTIGUOUS) < 0) goto done;
    int64_t *hr = hrb.buf, *ranks = rb.buf;
    int32_t *hb = hbb.buf, *words = wb.buf;
    uint64_t *jobs = jb.buf;
    Py_ssize_t num_ranks = rb.len / 8, num_jobs = jb.len / 8, num_words = wb.len / 4;
    if (rb.itemsize != 8 || jb.itemsize != 8 || wb.itemsize != 4 || size < 0
            || size > hrb.len / 8 || row <= 0 || f_ref < 0 || f_htok < 0 || f_gid < 0
            || f_ref >= row || f_htok >= row || f_gid >= row) {
        PyErr_SetString(PyExc_ValueError, "heap_victims: bad buffers, size or layout");
        goto done;
    }
    met = PyMem_Malloc(sizeof(int32_t) * (size_t)(size + 1));
    victims = PyList_New(0);
    aside = PyList_New(0);
    if (met == NULL || victims == NULL || aside == NULL) {
        if (met == NULL) PyErr_NoMemory();
        goto done;
    }
    while (PyList_GET_SIZE(victims) < num && size > 0) {
        int64_t rank;
        int32_t block;
        heap_take_top(hr, hb, &size, &rank, &block);
        if (block <= 0 || block >= num_ranks || block >= num_jobs
                || ((long long)block + 1) * row > num_words) {
            PyErr_Format(PyExc_ValueError, "heap_victims: block %d out of range", (int)block);
            goto done;
        }
        int32_t *r = words + (Py_ssize_t)block * row;
        int seen = 0;
        for (Py_ssize_t i = 0; i < num_met && !seen; i++) seen = met[i] == block;
        if (seen || ranks[block] != rank || r[f_htok] == no_key || (r[f_gid] & pending))
            continue;  /* stale, or its block met already */
        met[num_met++] = block;
        PyObject *b = PyLong_FromLong(block);
        if (b == NULL) goto done;
        int held = PySet_Contains(args[6], b);
        if (held < 0) {
            Py_DECREF(b);
            goto done;
        }
        if (held || r[f_ref] != 0 || jobs[block] != 0) {
            PyObject *entry = Py_BuildValue("(LN)", (long long)rank, b);
            if (entry == NULL || PyList_Append(aside, entry) < 0) {
                Py_XDECREF(entry);
                goto done;
            }
            Py_DECREF(entry);
            continue;
        }
        if (size > 0 && hr[0] == rank) {  /* a tie: the caller orders it by key bytes */
            tied = Py_BuildValue("(LN)", (long long)rank, b);
            if (tied == NULL) goto done;
            break;
        }
        int failed = PyList_Append(victims, b) < 0;
        Py_DECREF(b);
        if (failed) goto done;
    }
    result = Py_BuildValue("(nOOO)", size, victims, aside, tied ? tied : Py_None);
done:
    PyMem_Free(met);
    Py_XDECREF(victims);
    Py_XDECREF(aside);
    Py_XDECREF(tied);
    if (rb.obj) PyBuffer_Release(&rb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (jb.obj) PyBuffer_Release(&jb);
    PyBuffer_Release(&hrb);
    PyBuffer_Release(&hbb);
    return result;
}

static PyMethodDef module_methods[] = {
    {"fence", mem_fence, METH_NOARGS,
     "fence(): a full memory barrier (__atomic_thread_fence(__ATOMIC_SEQ_CST))"},
    {"fault_arm", fault_arm, METH_VARARGS,
     "fault_arm(n, stop=False): SIGKILL (stop: SIGSTOP) this process before its n-th store "
     "from now (n <= 0: disarm)"},
    {"fault_tick", fault_tick, METH_NOARGS, "one store is about to happen (shmkv/pool/fault.py)"},
    {"set_fault", set_fault, METH_O,
     "set_fault(module): shmkv.pool.fault, whose plan mutate() counts stores for"},
    {"token_indices", (PyCFunction)(void (*)(void))bt_token_indices, METH_FASTCALL,
     "token_indices(counts, starts, req_out, pos_out) -> total (-1: not taken); "
     "shmkv/ranks/block_table.py"},
    {"slot_mappings", (PyCFunction)(void (*)(void))bt_slot_mappings, METH_FASTCALL,
     "slot_mappings(tables, block_sizes, rows, req, pos, out) -> taken; "
     "shmkv/ranks/block_table.py"},
    {"scatter_rows", (PyCFunction)(void (*)(void))bt_scatter_rows, METH_FASTCALL,
     "scatter_rows(tables, num_blocks, rows, ids_per_row, appending, max_id, begin_write) "
     "-> taken; shmkv/ranks/block_table.py"},
    {"heap_push", (PyCFunction)(void (*)(void))heap_push, METH_FASTCALL,
     "heap_push(ranks, blocks, size, rank, block): sift (rank, block) up from slot size; "
     "shmkv/vllm/lru.py"},
    {"heap_pop", (PyCFunction)(void (*)(void))heap_pop, METH_FASTCALL,
     "heap_pop(ranks, blocks, size) -> (rank, block) of the top; the last entry sifts down; "
     "shmkv/vllm/lru.py"},
    {"heap_victims", (PyCFunction)(void (*)(void))heap_victims, METH_FASTCALL,
     "heap_victims(ranks_heap, blocks_heap, size, ranks, words, jobs, protected, num, layout) "
     "-> (size, victims, aside, tied); shmkv/vllm/lru.py"},
    {"set_errors", set_errors, METH_VARARGS,
     "set_errors(UsageError, OutOfBlocksError, InvariantViolation, LockTimeoutError, "
     "FencedError): the classes to raise"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmkv.pool._ckernel",
    "C fast path for BlockPool's hot loops (see shmkv/pool/_pykernel.py for the reference).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__ckernel(void) {
    if (PyType_Ready(&KernelType) < 0) return NULL;
    if (PyType_Ready(&CLockType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&KernelType);
    if (PyModule_AddObject(m, "Kernel", (PyObject *)&KernelType) < 0) return NULL;
    Py_INCREF(&CLockType);
    if (PyModule_AddObject(m, "CLock", (PyObject *)&CLockType) < 0) return NULL;
    str_block_id = PyUnicode_InternFromString("block_id");
    str_planned = PyUnicode_InternFromString("planned");
    str_begin = PyUnicode_InternFromString("begin");
    str_end = PyUnicode_InternFromString("end");
    UsageError = Py_NewRef(PyExc_ValueError);
    OutOfBlocksError = Py_NewRef(PyExc_ValueError);
    InvariantViolation = Py_NewRef(PyExc_RuntimeError);
    LockTimeoutError = Py_NewRef(PyExc_TimeoutError);
    FencedError = Py_NewRef(PyExc_RuntimeError);
    return m;
}

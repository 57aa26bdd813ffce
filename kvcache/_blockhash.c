/*
 * kvcache._blockhash: a request's keyless sha256 block hashes, a chain in one call.
 *
 * vLLM's default block hash (and kvcache's, kvcache/kv_cache_utils.py) is
 *
 *     sha256(pickle.dumps((parent, tuple(block_tokens), None), protocol=5))
 *
 * for a block without extra keys, ``parent`` being the previous block's digest
 * (``NONE_HASH`` for the first). From Python that is one ``pickle.dumps`` and one
 * ``hashlib`` object a block, about 1 us. Here the pickle bytes of that one shape
 * are written directly into a buffer and digested with OpenSSL's SHA-256, for
 * every block of the chain in one call: the same bytes, so the same hashes.
 *
 * The pickle written (``pickletools.dis`` of the tuple, CPython 3.11):
 *
 *     PROTO 5, FRAME <8-byte little-endian length of the rest>,
 *     parent:  SHORT_BINBYTES <1-byte len> (len < 256) or BINBYTES <4-byte len>,
 *              then MEMOIZE
 *     tokens:  the items followed by TUPLE1/TUPLE2/TUPLE3 (1-3 tokens), or MARK,
 *              the items, TUPLE (more), then MEMOIZE (a block is never empty);
 *              an item is BININT1 <1 byte> (0..255), BININT2 <2 bytes>
 *              (256..65535), or BININT <4-byte signed> (the rest of
 *              [-2**31, 2**31)); ints are never memoized
 *     None:    NONE
 *     the 3-tuple: TUPLE3, MEMOIZE; then STOP.
 *
 * Anything else is not encoded here: the function returns None and the caller
 * hashes that call with pickle (the only encoder of every other input). That is
 * a parent that is not exactly ``bytes``, a token that is not exactly ``int``
 * (a bool pickles as NEWTRUE/NEWFALSE, a subclass by reduce) or is outside
 * [-2**31, 2**31) (LONG1), fewer tokens than ``stop`` asks for, and a pickle
 * near 64 KiB: pickle ends a frame and starts another at an opcode boundary once
 * a frame reaches 64 KiB, and puts a bytes payload of 64 KiB or more outside any
 * frame (blocks of over ~13,000 tokens; FRAME_LIMIT keeps a margin from it).
 *
 * kvcache/kv_cache_utils.py compares the result with pickle + hashlib at import
 * (every int width, both parent opcodes) and does without the extension if they
 * differ; tests/unit/test_blockhash_ext.py covers the edges and the fallbacks.
 *
 * The GIL is held throughout; no Python code runs during the loop (reading an
 * exact int calls none), so the token sequence cannot change under it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <stdint.h>
#include <string.h>

/* Pickle opcodes (Lib/pickle.py). */
#define OP_PROTO 0x80
#define OP_FRAME 0x95
#define OP_SHORT_BINBYTES 'C'
#define OP_BINBYTES 'B'
#define OP_MEMOIZE 0x94
#define OP_MARK '('
#define OP_TUPLE 't'
#define OP_TUPLE1 0x85
#define OP_TUPLE2 0x86
#define OP_TUPLE3 0x87
#define OP_BININT1 'K'
#define OP_BININT2 'M'
#define OP_BININT 'J'
#define OP_NONE 'N'
#define OP_STOP '.'

#define PICKLE_PROTOCOL 5
#define HEADER_SIZE 11 /* PROTO 5 (2 bytes), FRAME and its 8-byte length (9) */
#define DIGEST_SIZE 32
/* The largest frame encoded here: pickle splits frames at 64 KiB (its
 * FRAME_SIZE_TARGET), so stay well below it. */
#define FRAME_LIMIT (65536 - 256)
/* Bytes a block's frame takes besides its parent's payload and its tokens:
 * the parent's opcode and length (at most 5), MEMOIZE, MARK, TUPLE, MEMOIZE,
 * NONE, TUPLE3, MEMOIZE, STOP. */
#define FRAME_OVERHEAD 13
#define MAX_INT_SIZE 5 /* BININT */

/* SHA-256 as OpenSSL's provider implements it, fetched once at import. */
static EVP_MD *sha256_md = NULL;

static unsigned char *
put_le(unsigned char *p, uint64_t value, int size)
{
    for (int i = 0; i < size; i++) {
        p[i] = (unsigned char)(value >> (8 * i));
    }
    return p + size;
}

/* Write one token as pickle does; 0 when it is not encoded here (not an exact
 * int, or outside [-2**31, 2**31)). */
static int
put_token(unsigned char **out, PyObject *item)
{
    unsigned char *p = *out;
    int overflow = 0;
    long value;

    if (!PyLong_CheckExact(item)) {
        return 0;
    }
    value = PyLong_AsLongAndOverflow(item, &overflow);
    if (overflow || value < INT32_MIN || value > INT32_MAX) {
        return 0;
    }
    if (value >= 0 && value <= 0xff) {
        *p++ = OP_BININT1;
        p = put_le(p, (uint64_t)value, 1);
    }
    else if (value >= 0 && value <= 0xffff) {
        *p++ = OP_BININT2;
        p = put_le(p, (uint64_t)value, 2);
    }
    else {
        *p++ = OP_BININT;
        p = put_le(p, (uint32_t)(int32_t)value, 4);
    }
    *out = p;
    return 1;
}

/* Write the pickle of (parent, tuple(tokens[0:count]), None), count >= 1, at buf,
 * the frame's length included; return its size, or 0 when it is not encoded here
 * (a token, or the frame's size; see the top of this file). buf holds
 * HEADER_SIZE + FRAME_OVERHEAD + parent_len + count * MAX_INT_SIZE bytes. */
static Py_ssize_t
encode_block(unsigned char *buf, const char *parent, Py_ssize_t parent_len,
             PyObject *const *tokens, Py_ssize_t count)
{
    unsigned char *p = buf + HEADER_SIZE;
    Py_ssize_t frame_len;

    if (parent_len < 256) {
        *p++ = OP_SHORT_BINBYTES;
        p = put_le(p, (uint64_t)parent_len, 1);
    }
    else {
        *p++ = OP_BINBYTES;
        p = put_le(p, (uint64_t)parent_len, 4);
    }
    memcpy(p, parent, (size_t)parent_len);
    p += parent_len;
    *p++ = OP_MEMOIZE;

    /* count >= 1 (block_size >= 1): no EMPTY_TUPLE. */
    if (count > 3) {
        *p++ = OP_MARK;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!put_token(&p, tokens[i])) {
            return 0;
        }
    }
    switch (count) {
    case 1: *p++ = OP_TUPLE1; break;
    case 2: *p++ = OP_TUPLE2; break;
    case 3: *p++ = OP_TUPLE3; break;
    default: *p++ = OP_TUPLE; break;
    }
    *p++ = OP_MEMOIZE;
    *p++ = OP_NONE;
    *p++ = OP_TUPLE3;
    *p++ = OP_MEMOIZE;
    *p++ = OP_STOP;

    frame_len = (Py_ssize_t)(p - buf) - HEADER_SIZE;
    if (frame_len > FRAME_LIMIT) {
        return 0;
    }
    buf[0] = OP_PROTO;
    buf[1] = PICKLE_PROTOCOL;
    buf[2] = OP_FRAME;
    put_le(buf + 3, (uint64_t)frame_len, 8);
    return (Py_ssize_t)(p - buf);
}

PyDoc_STRVAR(sha256_chain_doc,
"sha256_chain(parent, tokens, start, stop, block_size, /) -> list[bytes] | None\n"
"\n"
"The chained keyless sha256 hashes of the blocks tokens[start:start + block_size],\n"
"tokens[start + block_size:start + 2 * block_size], ... that end at or before\n"
"stop: each is sha256(pickle.dumps((parent, tuple(block), None), protocol=5))\n"
".digest(), parent being the previous block's hash (the argument for the\n"
"first), byte for byte.\n"
"\n"
"Returns None, hashing nothing, where the pickle is not the one encoded here:\n"
"parent not exactly bytes, a token not exactly int or outside [-2**31, 2**31),\n"
"stop past the end of tokens, or a block's pickle near 64 KiB. The caller then\n"
"hashes the call with pickle.dumps and hashlib.\n"
"\n"
"Raises TypeError for tokens that are no sequence, ValueError for a\n"
"block_size below 1 or a negative start.");

static PyObject *
sha256_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *parent, *seq = NULL, *result = NULL;
    PyObject *const *items;
    Py_ssize_t start, stop, block_size, num_blocks, size;
    const char *parent_data;
    Py_ssize_t parent_len;
    unsigned char *buf = NULL;
    EVP_MD_CTX *ctx = NULL;
    unsigned char digest[DIGEST_SIZE];
    unsigned int digest_len;

    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "sha256_chain() takes 5 positional arguments (%zd given)", nargs);
        return NULL;
    }
    parent = args[0];
    start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    stop = PyLong_AsSsize_t(args[3]);
    if (stop == -1 && PyErr_Occurred()) {
        return NULL;
    }
    block_size = PyLong_AsSsize_t(args[4]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be at least 1");
        return NULL;
    }
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    /* A list or tuple as it is; another sequence copied into a list once. */
    seq = PySequence_Fast(args[1], "tokens must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    if (!PyBytes_CheckExact(parent) || stop > PySequence_Fast_GET_SIZE(seq)
        || PyBytes_GET_SIZE(parent) > FRAME_LIMIT || block_size > FRAME_LIMIT / 2) {
        goto fall_back; /* each token takes 2 bytes at least: too large a frame */
    }
    num_blocks = stop >= start ? (stop - start) / block_size : 0;
    result = PyList_New(num_blocks);
    if (result == NULL || num_blocks == 0) {
        goto done;
    }

    parent_data = PyBytes_AS_STRING(parent);
    parent_len = PyBytes_GET_SIZE(parent);
    buf = PyMem_Malloc(HEADER_SIZE + FRAME_OVERHEAD
                       + (parent_len > DIGEST_SIZE ? parent_len : DIGEST_SIZE)
                       + (size_t)block_size * MAX_INT_SIZE);
    ctx = EVP_MD_CTX_new();
    if (buf == NULL || ctx == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    items = PySequence_Fast_ITEMS(seq) + start;
    for (Py_ssize_t i = 0; i < num_blocks; i++, items += block_size) {
        PyObject *hash;

        size = encode_block(buf, parent_data, parent_len, items, block_size);
        if (size == 0) {
            goto fall_back;
        }
        if (!EVP_DigestInit_ex(ctx, sha256_md, NULL)
            || !EVP_DigestUpdate(ctx, buf, (size_t)size)
            || !EVP_DigestFinal_ex(ctx, digest, &digest_len) || digest_len != DIGEST_SIZE) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed");
            Py_CLEAR(result);
            goto done;
        }
        hash = PyBytes_FromStringAndSize((const char *)digest, DIGEST_SIZE);
        if (hash == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, hash); /* steals the reference */
        /* The next block's parent: this hash (the bytes object lives in result). */
        parent_data = PyBytes_AS_STRING(hash);
        parent_len = DIGEST_SIZE;
    }
    goto done;

fall_back:
    Py_CLEAR(result);
    result = Py_NewRef(Py_None);
done:
    EVP_MD_CTX_free(ctx); /* NULL-safe */
    PyMem_Free(buf);
    Py_XDECREF(seq);
    return result;
}

static PyMethodDef blockhash_methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))sha256_chain, METH_FASTCALL,
     sha256_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blockhash_module = {
    PyModuleDef_HEAD_INIT,
    "kvcache._blockhash",
    "Keyless sha256 block-hash chains, byte-identical to pickle + hashlib "
    "(kvcache/_blockhash.c).",
    -1,
    blockhash_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__blockhash(void)
{
    if (sha256_md == NULL) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
        /* Fetched once: EVP_sha256() would look the provider up on every init. */
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
        sha256_md = (EVP_MD *)EVP_sha256();
#endif
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA-256");
            return NULL;
        }
    }
    return PyModule_Create(&blockhash_module);
}

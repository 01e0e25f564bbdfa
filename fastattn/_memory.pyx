# cython: language_level=3
"""NumPy's data-memory handler (NEP 49) backed by csrc/fa_cache.c's bounded
block cache, switched on around fastattn's layers (:mod:`fastattn._alloc`).

``enter()`` makes the cache the handler of the current context (NumPy keeps
the handler in a context variable, so other threads and asyncio tasks are not
affected) and returns what ``exit`` needs to restore the previous one; an
array keeps the handler that allocated it, so it is freed into the cache
whenever and wherever it dies.  Nested ``enter`` calls cost one comparison.
"""
import os

from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

cimport numpy as cnp

cnp.import_array()


cdef extern from "fa_cache.h" nogil:
    ctypedef struct fa_cache_stats:
        size_t limit
        size_t cached_bytes
        int64_t cached_blocks
        int64_t hits
        int64_t misses
    void *fa_cache_malloc(size_t size)
    void *fa_cache_calloc(size_t nelem, size_t elsize)
    void *fa_cache_realloc(void *ptr, size_t size)
    void fa_cache_free(void *ptr)
    void fa_cache_set_limit(size_t limit)
    size_t fa_cache_limit()
    void fa_cache_trim()
    void fa_cache_get_stats(fa_cache_stats *out)
    void fa_cache_after_fork()
    size_t FA_CACHE_MIN_BYTES


cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyDataMemAllocator:
        void *ctx
        void *(*malloc)(void *ctx, size_t size) noexcept nogil
        void *(*calloc)(void *ctx, size_t nelem, size_t elsize) noexcept nogil
        void *(*realloc)(void *ctx, void *ptr, size_t new_size) noexcept nogil
        void (*free)(void *ctx, void *ptr, size_t size) noexcept nogil
    ctypedef struct PyDataMem_Handler:
        char name[127]
        uint8_t version
        PyDataMemAllocator allocator
    object PyDataMem_SetHandler(object handler)
    object PyDataMem_GetHandler()


cdef void *_malloc(void *ctx, size_t size) noexcept nogil:
    return fa_cache_malloc(size)


cdef void *_calloc(void *ctx, size_t nelem, size_t elsize) noexcept nogil:
    return fa_cache_calloc(nelem, elsize)


cdef void *_realloc(void *ctx, void *ptr, size_t size) noexcept nogil:
    return fa_cache_realloc(ptr, size)


cdef void _free(void *ctx, void *ptr, size_t size) noexcept nogil:
    fa_cache_free(ptr)


cdef PyDataMem_Handler g_handler
cdef bytes _name = b"fastattn_block_cache"
memcpy(g_handler.name, <char *>_name, len(_name) + 1)
g_handler.version = 1
g_handler.allocator.ctx = NULL
g_handler.allocator.malloc = _malloc
g_handler.allocator.calloc = _calloc
g_handler.allocator.realloc = _realloc
g_handler.allocator.free = _free

#: the handler capsule (alive for the process: arrays point at g_handler)
HANDLER = PyCapsule_New(&g_handler, "mem_handler", NULL)
NAME = _name.decode()
MIN_BYTES = FA_CACHE_MIN_BYTES


def enter():
    """Make the cache the current context's handler; returns the previous
    handler to give to :func:`exit` (None when the cache already was)."""
    cur = PyDataMem_GetHandler()
    if cur is HANDLER:
        return None
    return PyDataMem_SetHandler(HANDLER)


def exit(prev):
    """Undo :func:`enter` (``prev``: what it returned)."""
    if prev is not None:
        PyDataMem_SetHandler(prev)


def set_limit(size_t limit):
    fa_cache_set_limit(limit)


def limit():
    return fa_cache_limit()


def trim():
    fa_cache_trim()


def stats():
    cdef fa_cache_stats s
    fa_cache_get_stats(&s)
    return {"limit": s.limit, "cached_bytes": s.cached_bytes,
            "cached_blocks": s.cached_blocks, "hits": s.hits, "misses": s.misses}


def _after_fork_in_child():
    fa_cache_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

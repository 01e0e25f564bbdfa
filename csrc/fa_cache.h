/*
 * A bounded cache of large memory blocks (plain C, no Python).
 *
 * fastattn/_memory.pyx hands these functions to NumPy as a data-memory
 * handler (NEP 49) while fastattn's layers run, so that the activations and
 * gradients of one training step reuse the blocks the previous step freed
 * instead of mapping fresh pages: glibc returns a freed region of that size
 * to the kernel, and touching new pages costs a fault and a page clear per
 * 4 KiB or 2 MiB (9 % of a transformer training step measured here).
 *
 * Every block carries a small header before the pointer handed out (the
 * block's origin, capacity and requested size), so free and realloc work
 * without NumPy's size argument.  Blocks of at least FA_CACHE_MIN_BYTES are
 * 64-byte aligned; freed ones are kept while the cached total stays within
 * the limit (oldest evicted first), others go back to malloc at once.  A
 * request takes the smallest cached block that holds it and wastes at most a
 * quarter of it.  Thread-safe (one mutex); fa_cache_after_fork resets the
 * mutex in a forked child.
 */
#ifndef FA_CACHE_H
#define FA_CACHE_H

#include <stddef.h>
#include <stdint.h>

#define FA_CACHE_MIN_BYTES ((size_t)128 << 10)
#define FA_CACHE_SLOTS 128

void *fa_cache_malloc(size_t size);
void *fa_cache_calloc(size_t nelem, size_t elsize);
void *fa_cache_realloc(void *ptr, size_t size);
void fa_cache_free(void *ptr);

/* The most bytes kept in freed blocks (0: none; evicts down to it now). */
void fa_cache_set_limit(size_t limit);
size_t fa_cache_limit(void);
/* Frees every cached block. */
void fa_cache_trim(void);

typedef struct {
    size_t limit;
    size_t cached_bytes;   /* in freed blocks held for reuse */
    int64_t cached_blocks;
    int64_t hits;          /* large requests served from the cache */
    int64_t misses;        /* large requests that allocated */
} fa_cache_stats;

void fa_cache_get_stats(fa_cache_stats *out);
void fa_cache_after_fork(void);

#endif

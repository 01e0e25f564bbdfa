/* The bounded block cache of fa_cache.h. */
#include "fa_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define FA_CACHE_MAGIC 0x61436166u   /* "faCa" */
#define FA_CACHE_PAGE ((size_t)4096)
#define FA_CACHE_ALIGN_BIG ((size_t)64)
#define FA_CACHE_ALIGN_SMALL ((size_t)16)

typedef struct {
    void *raw;        /* what malloc / calloc returned */
    size_t cap;       /* usable bytes from the pointer handed out */
    size_t size;      /* bytes asked for (what realloc copies) */
    uint32_t magic;
    uint32_t big;     /* 1: at least FA_CACHE_MIN_BYTES, cacheable */
} fa_cache_hdr;

typedef struct {
    void *p;          /* the pointer handed out (header before it) */
    size_t cap;
    uint64_t stamp;   /* when it was freed: the oldest goes first */
} fa_cache_slot;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static fa_cache_slot g_slots[FA_CACHE_SLOTS];
static int g_nslots = 0;
static size_t g_limit = (size_t)256 << 20;
static size_t g_cached = 0;
static uint64_t g_clock = 0;
static int64_t g_hits = 0, g_misses = 0;

static inline fa_cache_hdr *hdr_of(void *p)
{
    return (fa_cache_hdr *)((char *)p - sizeof(fa_cache_hdr));
}

/* The pointer handed out for a raw block: the first `align` boundary with
 * room for the header before it. */
static void *place(void *raw, size_t cap, size_t size, int big, size_t align)
{
    uintptr_t u = (uintptr_t)raw + sizeof(fa_cache_hdr);
    u = (u + align - 1) / align * align;
    fa_cache_hdr *h = (fa_cache_hdr *)(u - sizeof(fa_cache_hdr));
    h->raw = raw;
    h->cap = cap;
    h->size = size;
    h->magic = FA_CACHE_MAGIC;
    h->big = (uint32_t)big;
    return (void *)u;
}

static void release(void *p)
{
    free(hdr_of(p)->raw);
}

/* The smallest cached block holding `size` bytes that wastes at most a
 * quarter of itself, taken out of the cache; NULL when none. Lock held. */
static void *take_locked(size_t size)
{
    int best = -1;
    for (int i = 0; i < g_nslots; i++) {
        size_t cap = g_slots[i].cap;
        if (cap >= size && size >= cap - cap / 4 && (best < 0 || cap < g_slots[best].cap))
            best = i;
    }
    if (best < 0)
        return NULL;
    void *p = g_slots[best].p;
    g_cached -= g_slots[best].cap;
    g_slots[best] = g_slots[--g_nslots];
    return p;
}

/* Evicts the oldest blocks until `need` more bytes and one more slot fit;
 * the evicted blocks are appended to out (freed by the caller, unlocked). */
static int evict_locked(size_t need, void **out, int nout)
{
    while (g_nslots > 0 && (g_cached + need > g_limit || g_nslots >= FA_CACHE_SLOTS)) {
        int old = 0;
        for (int i = 1; i < g_nslots; i++)
            if (g_slots[i].stamp < g_slots[old].stamp)
                old = i;
        out[nout++] = g_slots[old].p;
        g_cached -= g_slots[old].cap;
        g_slots[old] = g_slots[--g_nslots];
    }
    return nout;
}

static void *alloc_big(size_t size, int zero)
{
    pthread_mutex_lock(&g_lock);
    void *p = take_locked(size);
    if (p)
        g_hits++;
    else
        g_misses++;
    pthread_mutex_unlock(&g_lock);
    if (p) {
        hdr_of(p)->size = size;
        if (zero)
            memset(p, 0, size);
        return p;
    }
    size_t cap = (size + FA_CACHE_PAGE - 1) / FA_CACHE_PAGE * FA_CACHE_PAGE;
    size_t extra = sizeof(fa_cache_hdr) + FA_CACHE_ALIGN_BIG;
    if (cap < size || cap > SIZE_MAX - extra)
        return NULL;
    /* calloc: fresh pages come zeroed from the kernel, untouched until used */
    void *raw = zero ? calloc(1, cap + extra) : malloc(cap + extra);
    return raw ? place(raw, cap, size, 1, FA_CACHE_ALIGN_BIG) : NULL;
}

static void *alloc_small(size_t size, int zero)
{
    size_t extra = sizeof(fa_cache_hdr) + FA_CACHE_ALIGN_SMALL;
    if (size > SIZE_MAX - extra)
        return NULL;
    void *raw = zero ? calloc(1, size + extra) : malloc(size + extra);
    return raw ? place(raw, size, size, 0, FA_CACHE_ALIGN_SMALL) : NULL;
}

void *fa_cache_malloc(size_t size)
{
    return size >= FA_CACHE_MIN_BYTES ? alloc_big(size, 0) : alloc_small(size, 0);
}

void *fa_cache_calloc(size_t nelem, size_t elsize)
{
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    size_t size = nelem * elsize;
    return size >= FA_CACHE_MIN_BYTES ? alloc_big(size, 1) : alloc_small(size, 1);
}

void fa_cache_free(void *ptr)
{
    if (!ptr)
        return;
    fa_cache_hdr *h = hdr_of(ptr);
    if (!h->big) {
        free(h->raw);
        return;
    }
    size_t cap = h->cap;
    void *evicted[FA_CACHE_SLOTS + 1];
    int n = 0;
    pthread_mutex_lock(&g_lock);
    if (cap <= g_limit) {
        n = evict_locked(cap, evicted, 0);
        g_slots[g_nslots].p = ptr;
        g_slots[g_nslots].cap = cap;
        g_slots[g_nslots].stamp = ++g_clock;
        g_nslots++;
        g_cached += cap;
    } else {
        evicted[n++] = ptr;
    }
    pthread_mutex_unlock(&g_lock);
    for (int i = 0; i < n; i++)
        release(evicted[i]);
}

void *fa_cache_realloc(void *ptr, size_t size)
{
    if (!ptr)
        return fa_cache_malloc(size);
    fa_cache_hdr *h = hdr_of(ptr);
    /* in place while it fits and a large block stays at least half used */
    if (size <= h->cap && (!h->big || size >= h->cap / 2)) {
        h->size = size;
        return ptr;
    }
    void *q = fa_cache_malloc(size);
    if (!q)
        return NULL;   /* ptr untouched, as realloc */
    memcpy(q, ptr, h->size < size ? h->size : size);
    fa_cache_free(ptr);
    return q;
}

void fa_cache_set_limit(size_t limit)
{
    void *evicted[FA_CACHE_SLOTS + 1];
    pthread_mutex_lock(&g_lock);
    g_limit = limit;
    int n = evict_locked(0, evicted, 0);
    pthread_mutex_unlock(&g_lock);
    for (int i = 0; i < n; i++)
        release(evicted[i]);
}

size_t fa_cache_limit(void)
{
    pthread_mutex_lock(&g_lock);
    size_t l = g_limit;
    pthread_mutex_unlock(&g_lock);
    return l;
}

void fa_cache_trim(void)
{
    void *evicted[FA_CACHE_SLOTS];
    pthread_mutex_lock(&g_lock);
    int n = g_nslots;
    for (int i = 0; i < n; i++)
        evicted[i] = g_slots[i].p;
    g_nslots = 0;
    g_cached = 0;
    pthread_mutex_unlock(&g_lock);
    for (int i = 0; i < n; i++)
        release(evicted[i]);
}

void fa_cache_get_stats(fa_cache_stats *out)
{
    pthread_mutex_lock(&g_lock);
    out->limit = g_limit;
    out->cached_bytes = g_cached;
    out->cached_blocks = g_nslots;
    out->hits = g_hits;
    out->misses = g_misses;
    pthread_mutex_unlock(&g_lock);
}

void fa_cache_after_fork(void)
{
    pthread_mutex_init(&g_lock, NULL);
}

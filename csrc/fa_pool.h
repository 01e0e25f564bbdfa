/*
 * fastattn's worker pool: persistent threads that help the calling thread
 * through a list of independent tasks.
 *
 * Why not an OpenMP parallel region: its closing barrier waits for every
 * thread of the team, so one worker the OS has not scheduled yet (the app is
 * busy on the other core) holds the whole call; and libgomp's pool is not
 * safe to use in a child after fork().  Here the caller works through the
 * tasks itself and only waits for tasks that a worker has actually started;
 * a worker that wakes up late finds nothing left and goes back to sleep.
 * After fork() the child starts with an empty pool.
 */
#ifndef FA_POOL_H
#define FA_POOL_H

#include <stddef.h>
#include <stdint.h>

/* Run fn(ctx, task, slot) for task in [0, ntasks) on the calling thread plus
 * up to nthreads-1 pool workers; slot in [0, nthreads) is unique among the
 * threads running at one moment in this call (for per-slot scratch), and
 * slot 0 is always the calling thread.
 * Tasks are handed out one at a time in increasing order.
 * If stop is given, the calling thread asks it between tasks (no more often
 * than every ~20 ms); once it returns nonzero no further task starts and
 * fa_pool_run returns 1.  Returns 0 when every task ran. */
typedef void (*fa_task_fn)(void *ctx, int64_t task, int slot);
typedef int (*fa_stop_fn)(void *stop_ctx);

int fa_pool_run(int64_t ntasks, int nthreads, fa_task_fn fn, void *ctx,
                fa_stop_fn stop, void *stop_ctx);

/* fa_pool_run asks its stop callback at most this often; fa_stop_poll_check
 * (below) asks at most every FA_POLL_EVERY_NS, so that the two rate limits
 * together still ask about every 20 ms. */
#define FA_STOP_EVERY_NS 20000000
#define FA_POLL_EVERY_NS 10000000

/* Scratch: see fa_arena below.  fa_arena_nest(+1) before running code that
 * may start another call on this thread while this thread's scratch is in
 * use (a stop callback runs the application's signal handlers, which may call
 * fastattn), fa_arena_nest(-1) after: the nested call gets buffers of its own.
 * A few levels exist; deeper than that fa_arena returns NULL. */
void fa_arena_nest(int delta);

/* Cancellation inside long tasks.  A kernel keeps one fa_stop_poll per call,
 * hands fa_stop_poll_fn / &poll to fa_pool_run as its stop callback, and its
 * tasks call fa_stop_poll_check(&poll, slot) at convenient points (once per
 * key tile): on the calling thread (slot 0) it asks the stop callback, at most
 * every FA_POLL_EVERY_NS; on every thread it returns 1 once the call is being
 * stopped, and the task then returns early (its outputs are unspecified).
 * Once the callback said stop it is not asked again.  With stop == NULL
 * every check is a single load and returns 0. */
typedef struct {
    fa_stop_fn stop;
    void *stop_ctx;
    int64_t next_ns;   /* calling thread only */
    int stopped;       /* atomic */
} fa_stop_poll;

#include <time.h>

static inline int64_t fa_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void fa_stop_poll_init(fa_stop_poll *p, fa_stop_fn stop, void *stop_ctx)
{
    p->stop = stop;
    p->stop_ctx = stop_ctx;
    p->next_ns = stop ? fa_now_ns() + FA_POLL_EVERY_NS : 0;
    p->stopped = 0;
}

static inline int fa_stop_poll_stopped(fa_stop_poll *p)
{
    return p->stop != NULL && __atomic_load_n(&p->stopped, __ATOMIC_RELAXED);
}

static inline int fa_stop_poll_check(fa_stop_poll *p, int slot)
{
    if (!p->stop)
        return 0;
    if (__atomic_load_n(&p->stopped, __ATOMIC_RELAXED))
        return 1;
    if (slot != 0)
        return 0;
    int64_t t = fa_now_ns();
    if (t < p->next_ns)
        return 0;
    fa_arena_nest(1);
    int r = p->stop(p->stop_ctx);
    fa_arena_nest(-1);
    p->next_ns = fa_now_ns() + FA_POLL_EVERY_NS;
    if (r)
        __atomic_store_n(&p->stopped, 1, __ATOMIC_RELAXED);
    return r != 0;
}

/* The fa_stop_fn to give fa_pool_run (ctx: the fa_stop_poll; the pool calls
 * it on the calling thread only). */
static inline int fa_stop_poll_fn(void *poll)
{
    return fa_stop_poll_check((fa_stop_poll *)poll, 0);
}

/* Number of worker threads currently alive (for tests and explain()). */
int fa_pool_workers(void);

/* Scratch: one grow-only, 64-byte aligned buffer per calling thread, freed
 * when the thread exits (no malloc per call).  NULL when need is 0 or on
 * allocation failure.  The pointer stays valid until the same thread asks
 * for more. */
void *fa_arena(size_t need);

/* Tasks that pool workers (not the caller) ran in the last fa_pool_run that
 * posted work (for tests: a worker that misses a job shows up as 0). */
int64_t fa_pool_last_helped(void);

#endif

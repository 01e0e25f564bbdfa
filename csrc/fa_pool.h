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
 * threads running at one moment in this call (for per-slot scratch).
 * Tasks are handed out one at a time in increasing order.
 * If stop is given, the calling thread asks it between tasks (no more often
 * than every ~20 ms); once it returns nonzero no further task starts and
 * fa_pool_run returns 1.  Returns 0 when every task ran. */
typedef void (*fa_task_fn)(void *ctx, int64_t task, int slot);
typedef int (*fa_stop_fn)(void *stop_ctx);

int fa_pool_run(int64_t ntasks, int nthreads, fa_task_fn fn, void *ctx,
                fa_stop_fn stop, void *stop_ctx);

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

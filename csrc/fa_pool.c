/*
 * Worker pool (see fa_pool.h for why it is not an OpenMP team).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include "fa_pool.h"

#define FA_MAX_WORKERS 255
/* How long an idle worker spins before it sleeps, and how long the caller
 * spins on its helpers before it sleeps (nanoseconds).  While a hold is open
 * (fa_pool_hold: a layer's forward, forward_backward or backprop, which make
 * many small calls with Python in between) idle workers spin up to
 * FA_WORKER_HELD_SPIN_NS instead: a worker woken from its condition variable
 * for each of a decoder step's calls cost the seq2seq training step ~10 %
 * (A/B in one process, 2-core VM: median 154 -> 137 ms at a 300 us spin). */
#define FA_WORKER_SPIN_NS 50000
#define FA_WORKER_HELD_SPIN_NS 500000
#define FA_CALLER_SPIN_NS 200000

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    fa_task_fn fn;
    void *ctx;
    int64_t ntasks;
    int64_t next;          /* atomic: next task to hand out */
    int cancel;            /* atomic */
    int max_helpers;       /* under pool lock */
    int helpers;           /* attached workers, under pool lock */
    int slots;             /* slots given out, under pool lock */
    int64_t helped;        /* atomic: tasks run by workers */
} fa_job;

static int64_t g_last_helped = 0; /* atomic */
/* open holds (fa_pool_hold); atomic */
static int g_holds = 0;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;   /* workers sleep here */
    pthread_cond_t idle;   /* a caller waits here for its helpers to leave */
    fa_job *job;           /* the open job, or NULL */
    uint64_t gen;          /* atomic: bumped whenever a job is posted */
    int nworkers;
    int sleeping;
    int atfork_done;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
       NULL, 0, 0, 0, 0};

#define now_ns fa_now_ns

/* Take tasks until none is left or the job is cancelled.  With stop (the
 * calling thread only) ask it every FA_STOP_EVERY_NS whether to cancel. */
static void run_tasks(fa_job *j, int slot, fa_stop_fn stop, void *stop_ctx)
{
    int64_t next_check = stop ? now_ns() + FA_STOP_EVERY_NS : 0;
    for (;;) {
        if (__atomic_load_n(&j->cancel, __ATOMIC_RELAXED))
            return;
        int64_t t = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (t >= j->ntasks)
            return;
        j->fn(j->ctx, t, slot);
        if (slot)
            __atomic_add_fetch(&j->helped, 1, __ATOMIC_RELAXED);
        if (stop && now_ns() >= next_check) {
            if (stop(stop_ctx)) {
                __atomic_store_n(&j->cancel, 1, __ATOMIC_RELAXED);
                return;
            }
            next_check = now_ns() + FA_STOP_EVERY_NS;
        }
    }
}

static void *worker_main(void *unused)
{
    (void)unused;
    /* no generation yet: look at the open job right away.  (Starting from the
     * current P.gen lost the job whose call created this worker: that call
     * posts it right after ensure_workers, possibly before we run.) */
    uint64_t seen = UINT64_MAX;
    for (;;) {
        /* spin a little: back-to-back calls find us awake (longer while a
         * hold is open; its end shortens the spin at once) */
        const int64_t start = now_ns();
        while (__atomic_load_n(&P.gen, __ATOMIC_ACQUIRE) == seen) {
            const int64_t lim = __atomic_load_n(&g_holds, __ATOMIC_RELAXED) > 0
                                    ? FA_WORKER_HELD_SPIN_NS
                                    : FA_WORKER_SPIN_NS;
            if (now_ns() - start >= lim)
                break;
            for (int i = 0; i < 64; i++)
                cpu_relax();
        }
        pthread_mutex_lock(&P.lock);
        while (P.gen == seen) {
            P.sleeping++;
            pthread_cond_wait(&P.wake, &P.lock);
            P.sleeping--;
        }
        seen = P.gen;
        fa_job *j = P.job;
        if (!j || j->helpers >= j->max_helpers) {
            pthread_mutex_unlock(&P.lock);
            continue;
        }
        j->helpers++;
        int slot = ++j->slots;
        pthread_mutex_unlock(&P.lock);

        run_tasks(j, slot, NULL, NULL);

        pthread_mutex_lock(&P.lock);
        if (__atomic_sub_fetch(&j->helpers, 1, __ATOMIC_RELEASE) == 0)
            pthread_cond_broadcast(&P.idle);
        pthread_mutex_unlock(&P.lock);
    }
    return NULL;
}

static void atfork_child(void)
{
    /* the workers did not survive the fork: start over with an empty pool */
    pthread_mutex_init(&P.lock, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_cond_init(&P.idle, NULL);
    P.job = NULL;
    P.nworkers = 0;
    P.sleeping = 0;
}

/* Make sure at least n workers exist; returns how many do.  Under P.lock. */
static int ensure_workers(int n)
{
    if (!P.atfork_done) {
        pthread_atfork(NULL, NULL, atfork_child);
        P.atfork_done = 1;
    }
    if (n > FA_MAX_WORKERS)
        n = FA_MAX_WORKERS;
    while (P.nworkers < n) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        int rc = pthread_create(&th, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        P.nworkers++;
    }
    return P.nworkers;
}

int fa_pool_workers(void)
{
    pthread_mutex_lock(&P.lock);
    int n = P.nworkers;
    pthread_mutex_unlock(&P.lock);
    return n;
}

int fa_pool_hold(int delta)
{
    return __atomic_add_fetch(&g_holds, delta, __ATOMIC_RELAXED);
}

int64_t fa_pool_last_helped(void) { return __atomic_load_n(&g_last_helped, __ATOMIC_RELAXED); }

int fa_pool_run(int64_t ntasks, int nthreads, fa_task_fn fn, void *ctx,
                fa_stop_fn stop, void *stop_ctx)
{
    fa_job j = {fn, ctx, ntasks, 0, 0, 0, 0, 0, 0};
    int helpers = nthreads - 1;
    if (helpers > ntasks - 1)
        helpers = (int)(ntasks - 1);
    int posted = 0;
    if (helpers > 0) {
        pthread_mutex_lock(&P.lock);
        if (ensure_workers(helpers) > 0 && P.job == NULL) {
            /* another call may be using the pool: then this one runs alone */
            j.max_helpers = helpers;
            P.job = &j;
            __atomic_add_fetch(&P.gen, 1, __ATOMIC_RELEASE);
            if (P.sleeping > 0)
                pthread_cond_broadcast(&P.wake);
            posted = 1;
        }
        pthread_mutex_unlock(&P.lock);
    }

    run_tasks(&j, 0, stop, stop_ctx);

    if (posted) {
        /* close the job to late-comers, then wait only for tasks already started */
        pthread_mutex_lock(&P.lock);
        P.job = NULL;
        int busy = j.helpers;
        pthread_mutex_unlock(&P.lock);
        if (busy) {
            int64_t until = now_ns() + FA_CALLER_SPIN_NS;
            while (__atomic_load_n(&j.helpers, __ATOMIC_ACQUIRE) > 0 && now_ns() < until)
                for (int i = 0; i < 64; i++)
                    cpu_relax();
            pthread_mutex_lock(&P.lock);
            while (j.helpers > 0)
                pthread_cond_wait(&P.idle, &P.lock);
            pthread_mutex_unlock(&P.lock);
        }
        __atomic_store_n(&g_last_helped, __atomic_load_n(&j.helped, __ATOMIC_RELAXED),
                         __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&j.cancel, __ATOMIC_RELAXED) ? 1 : 0;
}

/* ----------------------------------------------------------- scratch arena */

/* FA_ARENA_LEVELS buffers per thread: level `depth` serves fa_arena, and
 * fa_arena_nest moves between levels (a call nested in a stop callback on
 * the same thread must not reallocate the buffer its outer call is using). */
#define FA_ARENA_LEVELS 4

typedef struct {
    void *p[FA_ARENA_LEVELS];
    size_t size[FA_ARENA_LEVELS];
    int depth;
} fa_arena_t;

static pthread_key_t g_arena_key;
static pthread_once_t g_arena_once = PTHREAD_ONCE_INIT;

static void arena_free(void *x)
{
    fa_arena_t *a = (fa_arena_t *)x;
    if (a) {
        for (int i = 0; i < FA_ARENA_LEVELS; i++)
            free(a->p[i]);
        free(a);
    }
}

static void arena_init(void) { pthread_key_create(&g_arena_key, arena_free); }

static fa_arena_t *arena_get(void)
{
    pthread_once(&g_arena_once, arena_init);
    fa_arena_t *a = (fa_arena_t *)pthread_getspecific(g_arena_key);
    if (!a) {
        a = (fa_arena_t *)calloc(1, sizeof(*a));
        if (!a)
            return NULL;
        if (pthread_setspecific(g_arena_key, a) != 0) {
            free(a);
            return NULL;
        }
    }
    return a;
}

void fa_arena_nest(int delta)
{
    fa_arena_t *a = arena_get();
    if (a)
        a->depth += delta;
}

void *fa_arena(size_t need)
{
    if (need == 0)
        return NULL;
    fa_arena_t *a = arena_get();
    if (!a || a->depth < 0 || a->depth >= FA_ARENA_LEVELS)
        return NULL;
    int l = a->depth;
    if (a->size[l] < need) {
        size_t grow = need + need / 4;
        void *p = NULL;
        if (posix_memalign(&p, 64, grow) != 0)
            return NULL;
        free(a->p[l]);
        a->p[l] = p;
        a->size[l] = grow;
    }
    return a->p[l];
}

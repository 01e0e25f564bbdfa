# cython: language_level=3
"""fastattn._kernels' worker pool, BLAS hold and SIMD switch as the bindings
that run on them (_proj, _rnn) receive them: the C function-pointer types, the
struct a module keeps them in, and inline helpers over it.

Each extension keeps its own ``runtime`` (a module global, all NULL until
then), filled by its own ``set_runtime`` from the C addresses fastattn hands
out once (fa_pool_run, fa_blas_threads_enter / _exit, fa_simd_level; see
csrc/fastattn.h), so all of them share one pool and one BLAS counter.
"""
from libc.stdint cimport int64_t, uintptr_t

from fastattn._interrupt cimport stop_fn


ctypedef void (*task_fn)(void *ctx, int64_t task, int slot) noexcept nogil
ctypedef int (*pool_run_fn)(int64_t ntasks, int nthreads, task_fn fn, void *ctx,
                            stop_fn stop, void *stop_ctx) noexcept nogil
ctypedef void *(*hold_enter_fn)() noexcept nogil
ctypedef void (*hold_exit_fn)(void *hook) noexcept nogil
ctypedef int (*simd_active_fn)() noexcept nogil


cdef struct runtime:
    pool_run_fn pool_run        # NULL: no pool (and then no BLAS hold either)
    hold_enter_fn hold_enter
    hold_exit_fn hold_exit
    simd_active_fn simd_active  # fa_simd_level (0 off, 1 AVX2, 2 AVX-512); NULL: no SIMD code


cdef inline void runtime_set(runtime *rt, uintptr_t pool_run, uintptr_t hold_enter,
                             uintptr_t hold_exit, uintptr_t simd_active) noexcept:
    """Install the addresses; 0 for any of pool / hold uninstalls all three."""
    rt.simd_active = <simd_active_fn>simd_active if simd_active else NULL
    if pool_run == 0 or hold_enter == 0 or hold_exit == 0:
        rt.pool_run = NULL
        rt.hold_enter = NULL
        rt.hold_exit = NULL
        return
    rt.hold_enter = <hold_enter_fn>hold_enter
    rt.hold_exit = <hold_exit_fn>hold_exit
    rt.pool_run = <pool_run_fn>pool_run


cdef inline bint runtime_simd(const runtime *rt) noexcept nogil:
    """True when fastattn's AVX2 dispatch is installed and on (FASTATTN_DISABLE_SIMD)."""
    return rt.simd_active != NULL and rt.simd_active() != 0


cdef inline int runtime_level(const runtime *rt) noexcept nogil:
    """fastattn's SIMD level (fa_simd_level: 0 off, 1 AVX2, 2 AVX-512); 0 when
    not installed."""
    return rt.simd_active() if rt.simd_active != NULL else 0


cdef inline void *runtime_hold(const runtime *rt) noexcept nogil:
    """BLAS held at one thread (when installed); give the result to runtime_release."""
    if rt.hold_enter != NULL:
        return rt.hold_enter()
    return NULL


cdef inline void runtime_release(const runtime *rt, void *hook) noexcept nogil:
    if rt.hold_exit != NULL:
        rt.hold_exit(hook)


cdef inline void runtime_run(const runtime *rt, int64_t ntasks, int nthreads, task_fn fn,
                             void *ctx, stop_fn stop, void *stop_ctx) noexcept nogil:
    """Tasks 0 .. ntasks-1 on at most ``nthreads`` threads of the pool; with one
    task, or without a pool, all of them on the calling thread (no stop asked)."""
    cdef int64_t t
    if rt.pool_run != NULL and ntasks > 1:
        rt.pool_run(ntasks, nthreads if nthreads < ntasks else <int>ntasks, fn, ctx,
                    stop, stop_ctx)
    else:
        for t in range(ntasks):
            fn(ctx, t, 0)


cdef extern from *:
    """
    /* a task's status, written by any worker of the pool (one int, relaxed) */
    static inline void fa_store_status(int *p, int v)
    {
    #if defined(__GNUC__) || defined(__clang__)
        __atomic_store_n(p, v, __ATOMIC_RELAXED);
    #else
        *p = v;
    #endif
    }
    """
    void fa_store_status(int *p, int v) noexcept nogil

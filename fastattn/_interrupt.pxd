# cython: language_level=3
"""KeyboardInterrupt for the kernels: the stop callback that csrc/ asks on
the calling thread (fa_pool_run's ``stop``, fa_sdpa_args.stop, ...).

A binding on the main thread (the only one Python runs signal handlers on)
gives the kernel ``interrupt_stop`` with a zeroed ``interrupt_state``; the
callback takes the GIL for a moment and runs ``PyErr_CheckSignals()``.  When
a handler raised (KeyboardInterrupt by default), the exception stays set on
the calling thread, the callback returns 1 from then on without asking again,
and the kernel stops early.  After the kernel returned (GIL held again) the
binding calls ``interrupt_raise``, which re-raises that exception: its
outputs are then incomplete and must be dropped.  ``interrupt_arm`` does the
first half: it zeroes the state and gives the callback (NULL off the main thread).
"""
from cpython.exc cimport PyErr_Occurred


cdef extern from "Python.h":
    # declared without an exception clause: the error it sets is kept for
    # interrupt_raise, not propagated from inside the nogil callback
    int _fa_check_signals "PyErr_CheckSignals" () noexcept


cdef struct interrupt_state:
    int fired


# the kernels' stop callback: non-zero means stop
ctypedef int (*stop_fn)(void *ctx) noexcept nogil


cdef inline int interrupt_stop(void *ctx) noexcept nogil:
    cdef interrupt_state *s = <interrupt_state *>ctx
    if s.fired:
        return 1
    with gil:
        if _fa_check_signals() != 0:
            s.fired = 1
    return s.fired


cdef inline int interrupt_raise(interrupt_state *s) except -1:
    """Raise the exception a signal handler left (call with the GIL, after the kernel)."""
    if s.fired:
        if PyErr_Occurred() != NULL:
            return -1
        raise KeyboardInterrupt
    return 0


cdef extern from "pythread.h":
    unsigned long thread_ident "PyThread_get_thread_ident" () noexcept nogil


cdef inline bint on_thread(unsigned long ident) noexcept nogil:
    """True on the thread of that ident (the bindings keep the main thread's)."""
    return thread_ident() == ident


cdef inline stop_fn interrupt_arm(interrupt_state *s, unsigned long main_ident) noexcept nogil:
    """Zero ``s``; ``interrupt_stop`` (with ``s`` as its context) for a call on the
    thread ``main_ident``, else NULL (no signal handler runs elsewhere)."""
    s.fired = 0
    if on_thread(main_ident):
        return interrupt_stop
    return NULL

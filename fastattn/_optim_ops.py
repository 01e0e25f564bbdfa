"""The optimizers' elementwise updates (fastattn.optim's Adam / AdamW step) on
fastattn._rowwise: one pass over each parameter in C on fastattn's worker pool
instead of NumPy's ten, the same operations in the same order, each rounded to
the parameter's dtype (so the same bits as the NumPy form below, which runs
for arrays the kernel does not take: other dtypes or non-contiguous ones).
Elementwise, so any thread count gives the same bits."""
from __future__ import annotations

import numpy as np

from . import _rowwise, _threads

__all__ = ["adam_update", "sum_squares"]

def _kernel_threads(n_threads):
    """The thread count for fastattn._rowwise, its pool installed once."""
    _threads.install_runtime_once(_rowwise.set_runtime)
    return _threads.resolve(n_threads)


def _kernel_ok(arrays):
    dt = arrays[0].dtype
    if dt not in (np.float32, np.float64):
        return False
    shape = arrays[0].shape
    return all(a.dtype == dt and a.shape == shape and a.flags.c_contiguous and a.flags.aligned
               for a in arrays) and all(a.flags.writeable for a in arrays[:1] + arrays[2:])


def adam_update(p, g, m, v, vmax, *, step, lr, betas, eps, weight_decay, decoupled, maximize,
                n_threads=None):
    """One Adam (``decoupled=False``) or AdamW step, in place on the parameter
    ``p`` and its moments ``m``, ``v`` (``vmax``: amsgrad's running maximum, or
    None); ``g`` the gradient, ``step`` the step count after this step (from 1)."""
    b1, b2 = betas
    step_size = lr / (1 - b1 ** step)
    bc2_sqrt = (1 - b2 ** step) ** 0.5
    arrays = [p, g, m, v] + ([vmax] if vmax is not None else [])
    if p.size and _kernel_ok(arrays):
        _rowwise.adam(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                      None if vmax is None else vmax.reshape(-1), float(lr), float(b1),
                      float(b2), float(eps), float(weight_decay), step_size, bc2_sqrt,
                      bool(decoupled), bool(maximize), _kernel_threads(n_threads))
        return
    d = np.negative(g) if maximize else g
    if weight_decay != 0:
        if decoupled:
            p *= 1 - lr * weight_decay
        else:
            d = d + weight_decay * p
    m += (1 - b1) * (d - m)
    v *= b2
    v += (1 - b2) * d * d
    if vmax is not None:
        np.maximum(vmax, v, out=vmax)
        v = vmax
    denom = np.sqrt(v) / bc2_sqrt
    denom += eps
    p -= step_size * (m / denom)


#: elements squared and summed at a time on sum_squares's NumPy path (stays in cache)
NUMPY_CHUNK = 1 << 15


def sum_squares(a, n_threads=None):
    """The sum of ``a``'s squared entries in float64 (a float): fixed chunks in
    C (fastattn._rowwise.sumsq, fastattn's threads) for a C-contiguous aligned
    float32 / float64 array, the chunks' sums added in order -- the same bits
    for any thread count; NumPy (chunked float64 copies, pairwise sums) for the
    rest.  Never NumPy's dot: OpenBLAS's ddot runs its own threads."""
    a = np.asarray(a)
    if a.size and a.dtype in (np.float32, np.float64) and a.flags.c_contiguous and a.flags.aligned:
        flat = a.reshape(-1)
        nt = _kernel_threads(n_threads)
        parts = np.empty(-(-flat.size // _rowwise.sumsq_chunk()))
        _rowwise.sumsq(flat, parts, nt)
        return float(np.add.reduce(parts))
    flat = a.reshape(-1)
    total = 0.0
    for i in range(0, flat.size, NUMPY_CHUNK):
        c = flat[i:i + NUMPY_CHUNK].astype(np.float64)
        np.multiply(c, c, out=c)
        total += float(np.add.reduce(c))
    return total

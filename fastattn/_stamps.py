"""Write stamps of parameter arrays: how a layer's derived copy (MultiHeadAttention's
packed projection weights) learns that fastattn changed the array it was made from.

fastattn's own in-place writers call :func:`bump` on each array they change
(an optimizer step, ``Layer.params_changed``); a derived copy records
:func:`stamp` of its sources when it is made and is stale once any differs.
A stamp is a process-wide increasing integer, kept per live array (by
``id``, with a weak reference so that an id reused after an array dies
never inherits an old stamp; the entry goes when the array does).  Writes
that do not come through fastattn (``arr[...] = ...`` by a user) are not
seen: ``Layer.params_changed()`` is the one call that says so.

Internal; not thread-safe beyond the GIL's guarantees (a bump and a stamp
racing on one array give one of the two orders, as any write would).
"""
from __future__ import annotations

import itertools
import weakref

_counter = itertools.count(1)
_entries: dict = {}   # id(array) -> [weakref(array), stamp]


def _forget(key, ref):
    entry = _entries.get(key)
    if entry is not None and entry[0] is ref:
        del _entries[key]


def bump(array) -> None:
    """Record that ``array`` (an ndarray) was just written in place."""
    key = id(array)
    entry = _entries.get(key)
    if entry is not None and entry[0]() is array:
        entry[1] = next(_counter)
        return
    ref = weakref.ref(array, lambda r, key=key: _forget(key, r))
    _entries[key] = [ref, next(_counter)]


def stamp(array) -> int:
    """The stamp of ``array``'s last :func:`bump` (0: never bumped)."""
    entry = _entries.get(id(array))
    if entry is not None and entry[0]() is array:
        return entry[1]
    return 0

"""The similarity registry: name -> :class:`fastattn.similarity.Similarity`.

Verbs::

    register_similarity(obj, name=None, *, overwrite=False)   # also a decorator
    get_similarity(name_or_obj)
    available_similarities()
    unregister_similarity(name)

``similarities`` is a read-only view (:class:`types.MappingProxyType`) of the
store.  A name clash raises unless ``overwrite=True``; the built-ins
(``dot``, ``scaled_dot``, ``general``, ``additive``, ``concat``, ``cosine``)
can be neither overwritten nor unregistered.

Third-party packages register through the entry-point group
``fastattn.similarities``: each entry point's name is the similarity's name
and its object is a :class:`~fastattn.similarity.Similarity` subclass, an
instance, or a zero-argument callable returning an instance.  Entry points
are loaded lazily -- on the first lookup of a name that is not registered,
and by :func:`available_similarities` -- never at ``import fastattn``.  A
plugin that fails to load, or whose name is already taken, emits a
:class:`FastattnPluginWarning` and is skipped.

All verbs are thread-safe (one re-entrant lock).
"""
from __future__ import annotations

import threading
import types
import warnings

__all__ = [
    "register_similarity",
    "get_similarity",
    "available_similarities",
    "unregister_similarity",
    "similarities",
    "ENTRY_POINT_GROUP",
    "FastattnPluginWarning",
    "UnknownSimilarityError",
]

ENTRY_POINT_GROUP = "fastattn.similarities"

_lock = threading.RLock()
_store: dict = {}
_builtin_names: set = set()
_entry_points_loaded = False

#: Read-only view of the registry (name -> Similarity instance).
similarities = types.MappingProxyType(_store)


class FastattnPluginWarning(UserWarning):
    """A ``fastattn.similarities`` entry point could not be loaded or clashed."""


class UnknownSimilarityError(KeyError, ValueError):
    """No similarity of that name (a KeyError and a ValueError, with a plain message)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def _check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__} {name!r}")
    if not name or name != name.strip() or not name.isprintable():
        raise ValueError(
            f"name: expected a non-empty printable str without surrounding spaces, got {name!r}"
        )
    return name


def _instantiate(obj, what: str):
    """A Similarity instance from a subclass, an instance or a factory."""
    from .similarity import Similarity

    if isinstance(obj, Similarity):
        return obj
    if isinstance(obj, type):
        if not issubclass(obj, Similarity):
            raise TypeError(
                f"{what}: expected a fastattn.similarity.Similarity subclass or instance, "
                f"got class {obj.__qualname__}"
            )
        return obj()
    if callable(obj):
        inst = obj()
        if not isinstance(inst, Similarity):
            raise TypeError(
                f"{what}: the factory {getattr(obj, '__qualname__', obj)!r} returned "
                f"{type(inst).__name__}, expected a fastattn.similarity.Similarity instance"
            )
        return inst
    raise TypeError(
        f"{what}: expected a fastattn.similarity.Similarity subclass or instance, "
        f"got {type(obj).__name__}"
    )


def _register(obj, name, overwrite, builtin=False):
    inst = _instantiate(obj, "register_similarity")
    if name is None:
        name = getattr(inst, "name", None)
        if name is None:
            raise ValueError(
                f"register_similarity: {type(inst).__qualname__} has no 'name' attribute; "
                "pass name=..."
            )
    name = _check_name(name)
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__} {overwrite!r}")
    with _lock:
        if name in _builtin_names:
            raise ValueError(
                f"register_similarity: {name!r} is a built-in similarity and cannot be "
                "overwritten; register yours under another name"
            )
        if name in _store and not overwrite:
            raise ValueError(
                f"register_similarity: a similarity named {name!r} is already registered "
                f"({type(_store[name]).__qualname__}); pass overwrite=True to replace it"
            )
        if inst.name != name:
            inst = inst._renamed(name)
        _store[name] = inst
        if builtin:
            _builtin_names.add(name)
    return inst


def register_similarity(obj=None, name=None, *, overwrite=False):
    """Register a similarity under ``name`` (default: its ``name`` attribute).

    ``obj`` is a :class:`~fastattn.similarity.Similarity` subclass (it is
    instantiated without arguments), an instance, or a zero-argument
    factory returning one.  Usable as a decorator, with or without
    arguments::

        @register_similarity
        class Mine(Similarity):
            name = "mine"
            ...

        @register_similarity(name="mine2", overwrite=True)
        class Mine2(Similarity): ...

    Returns ``obj`` unchanged (so decorated classes stay classes).  Raises
    ValueError when the name is taken (unless ``overwrite=True``) or is a
    built-in's.
    """
    if obj is None:
        def deco(o):
            _register(o, name, overwrite)
            return o
        return deco
    if isinstance(obj, str) and name is None:
        # @register_similarity("name") -- the name given positionally
        the_name = obj

        def deco(o):
            _register(o, the_name, overwrite)
            return o
        return deco
    _register(obj, name, overwrite)
    return obj


def unregister_similarity(name) -> None:
    """Remove a registered similarity.  Built-ins cannot be removed."""
    name = _check_name(name)
    with _lock:
        if name in _builtin_names:
            raise ValueError(f"unregister_similarity: {name!r} is a built-in similarity and cannot be removed")
        if name not in _store:
            raise UnknownSimilarityError(
                f"unregister_similarity: no similarity named {name!r} is registered; "
                f"available: {', '.join(sorted(_store))}"
            )
        del _store[name]


def _load_entry_points() -> None:
    """Load every ``fastattn.similarities`` entry point once (warn on failures)."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        try:
            from importlib.metadata import entry_points

            eps = entry_points(group=ENTRY_POINT_GROUP)
        except Exception as exc:  # pragma: no cover - broken metadata
            warnings.warn(f"fastattn: could not list the {ENTRY_POINT_GROUP!r} entry points: {exc}",
                          FastattnPluginWarning, stacklevel=3)
            return
        seen = set()
        for ep in eps:
            where = f"entry point {ep.name!r} = {ep.value!r}"
            if ep.name in seen or ep.name in _builtin_names:
                warnings.warn(
                    f"fastattn: ignoring {where}: a similarity named {ep.name!r} is already "
                    "registered", FastattnPluginWarning, stacklevel=3)
                continue
            seen.add(ep.name)
            try:
                obj = ep.load()
                have = _store.get(ep.name)
                if have is not None:
                    # the plugin's module registered itself when imported: fine
                    if have is obj or (isinstance(obj, type) and type(have) is obj):
                        continue
                    warnings.warn(
                        f"fastattn: ignoring {where}: a similarity named {ep.name!r} is "
                        f"already registered ({type(have).__qualname__})",
                        FastattnPluginWarning, stacklevel=3)
                    continue
                _register(obj, ep.name, False)
            except Exception as exc:
                warnings.warn(f"fastattn: could not load similarity plugin from {where}: "
                              f"{type(exc).__name__}: {exc}", FastattnPluginWarning, stacklevel=3)


def _reset_entry_points() -> None:
    """Forget that entry points were loaded (tests; newly installed plugins)."""
    global _entry_points_loaded
    with _lock:
        _entry_points_loaded = False


def available_similarities() -> tuple:
    """Sorted names of every registered similarity (entry points loaded first)."""
    _load_entry_points()
    with _lock:
        return tuple(sorted(_store))


def get_similarity(name_or_obj):
    """The registered similarity called ``name_or_obj``, or the object itself.

    A :class:`~fastattn.similarity.Similarity` instance is returned as is (it
    need not be registered); a subclass is instantiated.  An unknown name
    raises :class:`UnknownSimilarityError` (a KeyError) listing the available ones.
    """
    if not isinstance(name_or_obj, str):
        return _instantiate(name_or_obj, "similarity")
    with _lock:
        sim = _store.get(name_or_obj)
    if sim is None:
        _load_entry_points()
        with _lock:
            sim = _store.get(name_or_obj)
    if sim is None:
        raise UnknownSimilarityError(
            f"similarity: unknown name {name_or_obj!r}; available: "
            f"{', '.join(available_similarities())}"
        )
    return sim

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
instance, or a zero-argument callable returning an instance (classes and
factories are accepted here and by :func:`register_similarity` only;
:func:`get_similarity` and ``attention(similarity=...)`` take a name or an
instance and never call what they are given).  Entry points
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

from .similarity import BUILTINS, CompiledSimilarity, Similarity, builtin

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


def _what_is(obj) -> str:
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{type(obj).__name__} {obj.__qualname__}"
    return type(obj).__name__


def _check_usable(inst, what: str):
    """A Similarity instance that attention() can run: a ``score`` of its own
    (the base class's raises NotImplementedError) or, for a compiled plugin,
    a capsule."""
    cls = type(inst)
    _check_score(cls, what)
    if isinstance(inst, CompiledSimilarity) and inst.capsule is None:
        raise TypeError(
            f"{what}: {cls.__qualname__} has no capsule (a CompiledSimilarity subclass must "
            "set 'capsule' to its PyCapsule)")
    return inst


def _check_score(cls, what: str):
    if not issubclass(cls, CompiledSimilarity) and cls.score is Similarity.score:
        raise TypeError(
            f"{what}: {cls.__qualname__} does not implement score(query, key, params) "
            "(fastattn.similarity.Similarity is an abstract base class: subclass it)")


def _from_factory(obj, what: str, name=None):
    """A Similarity instance from a subclass (instantiated without arguments),
    an instance or a zero-argument factory -- for register_similarity and
    entry points only.  A failing class or factory is reported by name."""
    if isinstance(obj, Similarity):
        return obj
    if isinstance(obj, type) and not issubclass(obj, Similarity):
        raise TypeError(
            f"{what}: expected a fastattn.similarity.Similarity subclass, instance or factory, "
            f"got class {obj.__qualname__}")
    if not callable(obj):
        raise TypeError(
            f"{what}: expected a fastattn.similarity.Similarity subclass, instance or factory, "
            f"got {type(obj).__name__}")
    if isinstance(obj, type):
        _check_score(obj, what)  # e.g. the abstract base itself: say so before creating it
    label = _what_is(obj) + ("" if name is None else f" (similarity {name!r})")
    try:
        inst = obj()
    except Exception as exc:
        raise RuntimeError(
            f"{what}: could not create the similarity from {label}: "
            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(inst, Similarity):
        raise TypeError(
            f"{what}: the factory {getattr(obj, '__qualname__', obj)!r} returned "
            f"{type(inst).__name__}, expected a fastattn.similarity.Similarity instance")
    return inst


def _register(obj, name, overwrite, builtin=False):
    # cheap argument checks first: nothing is instantiated or called for a bad call
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__} {overwrite!r}")
    if name is not None:
        name = _check_name(name)
    inst = _check_usable(_from_factory(obj, "register_similarity", name), "register_similarity")
    if name is None:
        name = getattr(inst, "name", None)
        if name is None:
            raise ValueError(
                f"register_similarity: {type(inst).__qualname__} has no 'name' attribute; "
                "pass name=..."
            )
        name = _check_name(name)
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
    TypeError for a bad ``overwrite`` / ``name`` (checked before ``obj`` is
    touched), for what is not a Similarity or has no ``score`` of its own
    (the abstract base class itself); RuntimeError naming the class or
    factory when creating the instance fails; ValueError when the name is
    taken (unless ``overwrite=True``) or is a built-in's.
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
            # imported here, not at the top: importlib.metadata costs ~15 ms,
            # and most processes never look up an unknown name
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

    ``name_or_obj`` is either

    * a registered name (str): the registered object (the built-ins are
      shared and read-only); an unknown name raises
      :class:`UnknownSimilarityError` (a KeyError) listing the available
      ones, after loading the entry points;
    * a :class:`~fastattn.similarity.Similarity` instance with a ``name``
      (a str) and a ``score`` of its own (or, for a
      :class:`~fastattn.similarity.CompiledSimilarity`, a ``capsule``):
      returned as is, it need not be registered.

    Anything else -- including a Similarity *subclass* (pass an instance)
    and factories (those are for :func:`register_similarity` and entry
    points) -- raises TypeError naming ``similarity``.  Nothing passed here
    is ever called.
    """
    if not isinstance(name_or_obj, str):
        if not isinstance(name_or_obj, Similarity):
            hint = ""
            if name_or_obj in (Similarity, CompiledSimilarity):
                hint = " (the abstract base class: subclass it, implement score, pass an instance)"
            elif isinstance(name_or_obj, type) and issubclass(name_or_obj, Similarity):
                hint = f" (a Similarity subclass: pass an instance, {name_or_obj.__qualname__}(), or register it)"
            elif callable(name_or_obj):
                hint = " (similarity objects are never called here: register a factory with register_similarity)"
            raise TypeError(
                "similarity: expected a registered name (str) or a fastattn.similarity.Similarity "
                f"instance, got {_what_is(name_or_obj)}{hint}")
        sim = _check_usable(name_or_obj, "similarity")
        nm = sim.name
        if not isinstance(nm, str) or not nm:
            raise TypeError(
                f"similarity: {type(sim).__qualname__} instance has no name (set the class "
                f"attribute 'name' to a non-empty str), got name {nm!r}")
        return sim
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


def _register_builtins() -> None:
    """Register the shared built-in instances (:mod:`fastattn.similarity`) and
    protect their names: done once, when this module is imported."""
    for cls in BUILTINS:
        _register(builtin(cls.name), None, False, builtin=True)


_register_builtins()

"""The similarity registry, user (NumPy) plugins and their error messages."""
from __future__ import annotations

import tracemalloc
import types
import warnings

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R, registry
from fastattn._attention import SimilarityError
from fastattn.registry import FastattnPluginWarning, UnknownSimilarityError
from fastattn.similarity import AdditiveSimilarity, ParamSpec, Similarity

from support import assert_close, randn, run_in_threads

BUILTINS = ("additive", "concat", "cosine", "dot", "general", "scaled_dot")


@pytest.fixture(autouse=True)
def restore_registry():
    """Every test leaves the registry (and the entry-point state) as it found it."""
    store = dict(registry._store)
    builtins = set(registry._builtin_names)
    loaded = registry._entry_points_loaded
    yield
    with registry._lock:
        registry._store.clear()
        registry._store.update(store)
        registry._builtin_names.clear()
        registry._builtin_names.update(builtins)
        registry._entry_points_loaded = loaded


class Dist(Similarity):
    name = "dist"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0)}
    same_dims = True

    def score(self, query, key, params):
        d = query[..., :, None, :] - key[..., None, :, :]
        return -params["gamma"] * np.sum(d * d, axis=-1)


def test_builtins_are_registered_and_top_level_names_exist():
    assert set(BUILTINS) <= set(fastattn.available_similarities())
    for name in BUILTINS:
        assert fastattn.get_similarity(name).name == name
    assert fastattn.register_similarity is registry.register_similarity
    assert fastattn.attention is fastattn.functional.attention


def test_store_is_read_only():
    view = registry.similarities
    assert isinstance(view, types.MappingProxyType)
    with pytest.raises(TypeError):
        view["x"] = Dist()
    assert "dot" in view


def test_register_forms():
    fastattn.register_similarity(Dist)                     # class, its own name
    assert isinstance(fastattn.get_similarity("dist"), Dist)
    fastattn.register_similarity(Dist(), name="dist2")     # instance, given name
    assert fastattn.get_similarity("dist2").name == "dist2"

    @fastattn.register_similarity
    class A(Dist):
        name = "deco_plain"

    @fastattn.register_similarity(name="deco_named")
    class B(Dist):
        pass

    @fastattn.register_similarity("deco_positional")
    class C(Dist):
        pass

    assert isinstance(A, type) and isinstance(B, type)      # decorators return the class
    for n in ("deco_plain", "deco_named", "deco_positional"):
        assert n in fastattn.available_similarities()
    fastattn.register_similarity(lambda: Dist(), name="from_factory")
    assert isinstance(fastattn.get_similarity("from_factory"), Dist)


def test_clash_raises_unless_overwrite():
    fastattn.register_similarity(Dist)
    with pytest.raises(ValueError, match=r"a similarity named 'dist' is already registered "
                                         r"\(Dist\); pass overwrite=True to replace it"):
        fastattn.register_similarity(Dist)
    new = Dist()
    fastattn.register_similarity(new, overwrite=True)
    assert fastattn.get_similarity("dist") is new


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_are_protected(name):
    with pytest.raises(ValueError, match=rf"'{name}' is a built-in similarity and cannot be overwritten"):
        fastattn.register_similarity(Dist(), name=name, overwrite=True)
    with pytest.raises(ValueError, match=rf"'{name}' is a built-in similarity and cannot be removed"):
        fastattn.unregister_similarity(name)


def test_unregister():
    fastattn.register_similarity(Dist)
    fastattn.unregister_similarity("dist")
    assert "dist" not in fastattn.available_similarities()
    with pytest.raises(UnknownSimilarityError, match=r"no similarity named 'dist' is registered; "
                                                     r"available: additive, concat"):
        fastattn.unregister_similarity("dist")


def test_unknown_name_lists_available():
    with pytest.raises(KeyError, match=r"unknown name 'nope'; available: additive, concat, cosine, dot, general"):
        fastattn.get_similarity("nope")
    with pytest.raises(ValueError, match=r"similarity: unknown name 'nope'"):  # also a ValueError
        fastattn.attention(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), "nope")


def test_bad_registrations():
    with pytest.raises(TypeError, match=r"expected a fastattn.similarity.Similarity subclass, instance or factory, got class int"):
        fastattn.register_similarity(int)
    with pytest.raises(TypeError, match=r"returned int, expected a fastattn.similarity.Similarity instance"):
        fastattn.register_similarity(lambda: 3, name="x")
    with pytest.raises(TypeError, match=r"expected a fastattn.similarity.Similarity subclass, instance or factory, got int"):
        fastattn.register_similarity(3, name="x")

    class NoName(Similarity):
        def score(self, query, key, params):
            return query @ np.swapaxes(key, -1, -2)

    with pytest.raises(ValueError, match=r"NoName has no 'name' attribute; pass name=\.\.\."):
        fastattn.register_similarity(NoName)
    with pytest.raises(TypeError, match=r"name: expected a str, got int 5"):
        fastattn.register_similarity(Dist, name=5)
    with pytest.raises(ValueError, match=r"name: expected a non-empty printable str"):
        fastattn.register_similarity(Dist, name=" x")
    with pytest.raises(TypeError, match=r"overwrite: expected a bool, got int 1"):
        fastattn.register_similarity(Dist, overwrite=1)
    with pytest.raises(TypeError, match=r"similarity: expected a registered name \(str\) or a fastattn.similarity.Similarity instance, got float"):
        fastattn.get_similarity(1.5)


def test_registry_is_thread_safe():
    errors = []

    def work(i):
        try:
            for j in range(50):
                n = f"t{i}_{j}"
                fastattn.register_similarity(Dist(), name=n)
                assert fastattn.get_similarity(n).name == n
                fastattn.unregister_similarity(n)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_in_threads(work, 4)
    assert not errors
    assert not [n for n in fastattn.available_similarities() if n.startswith("t")]


def test_get_config_round_trip():
    for name in BUILTINS:
        sim = fastattn.get_similarity(name)
        again = type(sim).from_config(sim.get_config())
        assert again.get_config() == sim.get_config()
    norm = AdditiveSimilarity(normalize=True)
    assert norm.get_config() == {"name": "additive", "normalize": True}
    assert AdditiveSimilarity.from_config(norm.get_config()).normalize is True
    assert "g" in AdditiveSimilarity.from_config(norm.get_config()).params_spec
    with pytest.raises(TypeError, match=r"normalize: expected a bool, got str 'yes'"):
        AdditiveSimilarity(normalize="yes")


# ------------------------------------------------------------ entry points

class _EP:
    def __init__(self, name, obj=None, exc=None):
        self.name, self.value, self._obj, self._exc = name, f"mod:{name}", obj, exc

    def load(self):
        if self._exc:
            raise self._exc
        return self._obj


def test_entry_points_lazy_broken_and_duplicate(monkeypatch):
    calls = []

    class Other(Dist):
        pass

    fastattn.register_similarity(Other(), name="ep_other")  # a different similarity: clash
    fastattn.register_similarity(Dist, name="ep_self")     # as if the module self-registered

    def fake_entry_points(group):
        calls.append(group)
        return [_EP("ep_self", Dist), _EP("ep_other", Dist), _EP("ep_good", Dist), _EP("ep_broken", exc=ImportError("no module named boom")),
                _EP("ep_good", Dist), _EP("dot", Dist), _EP("ep_notsim", obj=42)]

    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    registry._reset_entry_points()
    fastattn.get_similarity("dot")      # a hit: entry points are not loaded
    assert calls == []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert isinstance(fastattn.get_similarity("ep_good"), Dist)   # a miss loads them
    assert calls == ["fastattn.similarities"]
    msgs = [str(w.message) for w in rec if issubclass(w.category, FastattnPluginWarning)]
    assert any("could not load similarity plugin from entry point 'ep_broken'" in m
               and "ImportError: no module named boom" in m for m in msgs)
    assert sum("ignoring entry point 'ep_good'" in m and "already registered" in m for m in msgs) == 1
    assert any("ignoring entry point 'dot'" in m for m in msgs)
    assert any("entry point 'ep_notsim'" in m and "got int" in m for m in msgs)
    assert not any("ep_self" in m for m in msgs)          # self-registered: silent
    assert any("ignoring entry point 'ep_other'" in m and "already registered" in m and "Other" in m
               for m in msgs)
    assert fastattn.get_similarity("dot").name == "dot"   # the built-in survived
    fastattn.available_similarities()
    assert calls == ["fastattn.similarities"]   # loaded once


def test_broken_plugin_never_breaks_import(tmp_path):
    """A broken entry point installed in the environment: import fastattn works,
    using it warns."""
    from support import run_child

    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[fastattn.similarities]\nbroken = no_such_module_xyz:Thing\n")
    code = ("import sys, warnings; sys.path.insert(0, sys.argv[1]); import fastattn; "
            "warnings.simplefilter('always'); "
            "names = fastattn.available_similarities(); print('ok', 'broken' in names)")
    r = run_child(code, args=(str(tmp_path),))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok False"
    assert "could not load similarity plugin from entry point 'broken'" in r.stderr
    assert "No module named 'no_such_module_xyz'" in r.stderr


# --------------------------------------------------------- NumPy plugins

def test_numpy_plugin_registered_and_used_by_name(rng):
    fastattn.register_similarity(Dist)
    q, k, v = randn(rng, (2, 50, 4)), randn(rng, (2, 333, 4)), randn(rng, (2, 333, 3))
    got = fastattn.attention(q, k, v, "dist", params={"gamma": 0.3}, is_causal=True)
    ref = R.attention(q, k, v, lambda a, b: R.score_neg_sq_dist(a, b, 0.3), is_causal=True)
    assert_close(got, ref, np.float64)


def test_numpy_plugin_memory_is_o_tile():
    """1 x 1024 x 1024: at most 1/20 of the memory of the dense computation."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1024, 64)) for _ in range(3))
    sim = Dist()
    params = {"gamma": 0.05}

    def dense():
        s = sim.score(q, k, sim.check_params(params, 64, 64, np.float64))
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return s @ v

    def peak(fn):
        tracemalloc.start()
        r = fn()
        _, p = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return p, r

    p_tiled, r_tiled = peak(lambda: fastattn.attention(q, k, v, sim, params=params))
    p_dense, r_dense = peak(dense)
    assert_close(r_tiled, r_dense, np.float64)
    assert p_tiled * 20 <= p_dense, (p_tiled, p_dense)


class Broken(Similarity):
    name = "broken"
    same_dims = True

    def __init__(self, behaviour):
        self.behaviour = behaviour

    def score(self, query, key, params):
        s = query @ np.swapaxes(key, -1, -2)
        b = self.behaviour
        if b == "raise":
            raise ZeroDivisionError("oops")
        if b == "shape":
            return s[..., :-1]
        if b == "int":
            return s.astype(np.int64)
        if b == "complex":
            return s.astype(np.complex128)
        if b == "list":
            return object()
        if b == "nan":
            s[..., 0, 0] = np.nan
        if b == "inf":
            s[..., -1, -1] = np.inf
        if b == "mutate":
            query[...] = 0  # read-only views: raises
        return s


@pytest.mark.parametrize("weights", [False, True])
def test_broken_numpy_plugins(weights, rng):
    q, k, v = randn(rng, (2, 5, 3)), randn(rng, (2, 6, 3)), randn(rng, (2, 6, 2))
    kw = dict(return_weights=weights)
    with pytest.raises(SimilarityError, match=r"similarity 'broken': score raised ZeroDivisionError: oops"):
        fastattn.attention(q, k, v, Broken("raise"), **kw)
    with pytest.raises(ValueError, match=r"score returned shape \(2, 5, 5\), expected \(\.\.\., tq, tk\) = \(2, 5, 6\)"):
        fastattn.attention(q, k, v, Broken("shape"), **kw)
    for b in ("int", "complex"):
        with pytest.raises(TypeError, match=r"score returned dtype (int64|complex128), expected a real floating dtype"):
            fastattn.attention(q, k, v, Broken(b), **kw)
    with pytest.raises(ValueError, match=r"score returned shape \(\), expected"):
        fastattn.attention(q, k, v, Broken("list"), **kw)
    for b in ("nan", "inf"):
        with pytest.raises(ValueError, match=r"similarity 'broken': score returned NaN or \+inf values"):
            fastattn.attention(q, k, v, Broken(b), **kw)
    with pytest.raises(SimilarityError, match=r"score raised ValueError: .*read-only"):
        fastattn.attention(q, k, v, Broken("mutate"), **kw)
    np.testing.assert_array_equal(q, q.copy())


def test_minus_inf_scores_act_as_a_mask(rng):
    class Band(Similarity):
        name = "band"
        same_dims = True

        def score(self, query, key, params):
            s = query @ np.swapaxes(key, -1, -2)
            i = np.arange(query.shape[-2])[:, None]
            j = np.arange(key.shape[-2])[None, :]
            return np.where(np.abs(i - j) <= 1, s, -np.inf)

    q, k, v = randn(rng, (7, 3)), randn(rng, (7, 3)), randn(rng, (7, 2))
    band = np.abs(np.arange(7)[:, None] - np.arange(7)[None, :]) <= 1
    got, w = fastattn.attention(q, k, v, Band(), return_weights=True)
    ref, rw = R.attention(q, k, v, R.score_dot, band, return_weights=True)
    assert_close(got, ref, np.float64)
    assert_close(w, rw, np.float64)


def test_plugin_without_spec_gets_params_as_given(rng):
    seen = []

    class Raw(Similarity):
        name = "raw"
        same_dims = True

        def score(self, query, key, params):
            seen.append(params)
            return query @ np.swapaxes(key, -1, -2) * params[0]

    token = [0.5]
    q, k, v = randn(rng, (3, 2)), randn(rng, (4, 2)), randn(rng, (4, 2))
    got = fastattn.attention(q, k, v, Raw(), params=token)
    assert seen and all(p is token for p in seen)
    assert_close(got, R.attention(q, k, v, lambda a, b: R.score_dot(a, b, 0.5)), np.float64)


# ----------------------------------------- review of issue 5, findings 3, 4, 6

@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_cannot_be_mutated(name, rng):
    sim = fastattn.get_similarity(name)
    for attr in ("name", "params_spec", "same_dims", "score", "config_keys", "normalize", "eps"):
        with pytest.raises(AttributeError, match=r"is a shared, read-only similarity: cannot set"):
            setattr(sim, attr, True)
    with pytest.raises(AttributeError, match=r"cannot delete 'name'"):
        del sim.name
    with pytest.raises(TypeError, match=r"does not support item assignment"):
        sim.params_spec["x"] = ParamSpec(())
    for ps in sim.params_spec.values():
        with pytest.raises(AttributeError, match=r"ParamSpec is immutable: cannot set 'required'"):
            ps.required = True
    assert fastattn.get_similarity(name) is sim and sim.name == name


def test_additive_keeps_working_after_a_mutation_attempt(rng):
    sim = fastattn.get_similarity("additive")
    with pytest.raises(AttributeError):
        sim.normalize = True
    assert sim.normalize is False and "g" not in sim.params_spec
    q, k, v = randn(rng, (2, 5, 4)), randn(rng, (2, 7, 3)), randn(rng, (2, 7, 2))
    P = sim.init_params(4, 3, d_a=6, rng=1)
    P["v"] = randn(rng, (6,), scale=3.0)  # |v| != 1: normalize=True would change the result
    got = fastattn.attention(q, k, v, "additive", params=P)
    ref = R.attention(q, k, v, lambda a, b: R.score_additive(a, b, P["W_q"], P["W_k"], P["v"], P["b"]))
    assert_close(got, ref, np.float64)
    # own instances: configuration is read-only too (params_spec follows it)
    mine = AdditiveSimilarity(normalize=True)
    with pytest.raises(AttributeError, match=r"normalize"):
        mine.normalize = False
    assert "g" in mine.params_spec
    with pytest.raises(AttributeError, match=r"eps"):
        fastattn.similarity.CosineSimilarity(eps=1e-6).eps = 0.0


def test_a_builtin_registered_under_another_name_is_a_renamed_copy():
    dot = fastattn.get_similarity("dot")
    fastattn.register_similarity(dot, name="my_dot")
    assert fastattn.get_similarity("my_dot").name == "my_dot" and dot.name == "dot"


@pytest.mark.parametrize("bad, what", [
    (np.zeros, r"got builtin_function_or_method zeros \(similarity objects are never called here"),
    (lambda: 1 / 0, r"got function .*<lambda> \(similarity objects are never called here"),
    (Dist, r"got class Dist \(a Similarity subclass: pass an instance, Dist\(\), or register it\)"),
    (Similarity, r"got class Similarity \(the abstract base class"),
    (None, r"got NoneType$"),
])
def test_similarity_argument_must_be_a_name_or_an_instance(bad, what, rng):
    q = randn(rng, (3, 4))
    with pytest.raises(TypeError, match=r"^similarity: expected a registered name \(str\) or a "
                                        r"fastattn.similarity.Similarity instance, " + what):
        fastattn.attention(q, q, q, bad)
    with pytest.raises(TypeError, match=r"^similarity: expected a registered name"):
        fastattn.get_similarity(bad)


def test_unusable_instances_are_rejected(rng):
    q = randn(rng, (3, 4))
    with pytest.raises(TypeError, match=r"^similarity: Similarity does not implement score\(query, "
                                        r"key, params\) \(fastattn.similarity.Similarity is an "
                                        r"abstract base class: subclass it\)"):
        fastattn.attention(q, q, q, Similarity())

    class Nameless(Dist):
        name = None

    with pytest.raises(TypeError, match=r"^similarity: .*Nameless instance has no name \(set the class "
                                        r"attribute 'name' to a non-empty str\), got name None"):
        fastattn.attention(q, q, q, Nameless())
    with pytest.raises(TypeError, match=r"^similarity: CompiledSimilarity has no capsule"):
        fastattn.attention(q, q, q, fastattn.CompiledSimilarity())


def test_register_rejects_the_base_class_and_checks_overwrite_first():
    created = []

    class Counting(Dist):
        def __init__(self):
            created.append(1)

    with pytest.raises(TypeError, match=r"^overwrite: expected a bool, got str 'yes'"):
        fastattn.register_similarity(Counting, overwrite="yes")
    with pytest.raises(TypeError, match=r"^overwrite: expected a bool"):
        fastattn.register_similarity(lambda: created.append(2) or Dist(), name="f", overwrite=None)
    with pytest.raises(TypeError, match=r"^name: expected a str"):
        fastattn.register_similarity(Counting, name=3)
    assert created == []  # nothing was instantiated or called
    for base in (Similarity, Similarity()):
        with pytest.raises(TypeError, match=r"^register_similarity: Similarity does not implement "
                                            r"score\(query, key, params\)"):
            fastattn.register_similarity(base, name="base")
    assert "base" not in fastattn.available_similarities()


def test_failing_factories_are_named():
    def make_it():
        return 1 / 0

    with pytest.raises(RuntimeError, match=r"^register_similarity: could not create the similarity "
                                           r"from function .*make_it \(similarity 'boom'\): "
                                           r"ZeroDivisionError: division by zero"):
        fastattn.register_similarity(make_it, name="boom")

    class Fails(Dist):
        def __init__(self):
            raise OSError("no device")

    with pytest.raises(RuntimeError, match=r"from class .*Fails: OSError: no device"):
        fastattn.register_similarity(Fails)
    assert "boom" not in fastattn.available_similarities()


def test_failing_entry_point_factory_warns_naming_the_plugin(monkeypatch):
    import importlib.metadata

    def bad_factory():
        raise ValueError("bad config")

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [_EP("ep_bad_factory", bad_factory)])
    registry._reset_entry_points()
    with pytest.warns(FastattnPluginWarning, match=r"could not load similarity plugin from entry "
                                                   r"point 'ep_bad_factory'.*RuntimeError: "
                                                   r".*bad_factory \(similarity 'ep_bad_factory'\): "
                                                   r"ValueError: bad config"):
        names = fastattn.available_similarities()
    assert "ep_bad_factory" not in names


class DotPlugin(Similarity):
    """q . k in NumPy: the tiled path with no extra memory of its own."""
    name = "dot_plugin"
    same_dims = True

    def score(self, query, key, params):
        return query @ np.swapaxes(key, -1, -2)


def test_numpy_plugin_memory_is_o_tile_with_many_batch_items():
    """B x H = 64: the tiled path works through the batch in chunks, so its
    extra memory stays O(tile) (it used to take a (64, 64, 128) score tile
    and its temporaries: ~17 MB over the 2 MB output)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((8, 8, 256, 16)) for _ in range(3))
    out_bytes = 8 * 8 * 256 * 16 * 8
    sim = DotPlugin()
    fastattn.attention(q[:1, :1, :4], k[:1, :1], v[:1, :1], sim)  # warm up (imports, caches)
    tracemalloc.start()
    got = fastattn.attention(q, k, v, sim)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - out_bytes < 1.5 * 2**20, (peak, out_bytes)
    assert_close(got, R.attention(q, k, v, R.score_dot), np.float64)


@pytest.mark.parametrize("batch", [(64,), (8, 8), (3, 1, 5), (1,), ()])
@pytest.mark.parametrize("weights", [False, True])
def test_numpy_plugin_batch_chunks_give_identical_results(batch, weights, rng):
    """Chunking the batch changes nothing: each item equals its own call."""
    q = randn(rng, batch + (70, 6))
    k = randn(rng, (1,) * len(batch) + (150, 6))   # broadcast over the batch
    v = randn(rng, batch + (150, 3))
    mask = rng.random(batch[-1:] + (70, 150)) < 0.8
    kw = dict(attn_mask=mask, is_causal=True, return_weights=weights)
    got = fastattn.attention(q, k, v, DotPlugin(), **kw)
    got = got if weights else (got,)
    for idx in np.ndindex(*batch):
        kidx = (0,) * len(batch)
        mi = idx[-1:] if batch else ()
        one = fastattn.attention(q[idx], k[kidx], v[idx], DotPlugin(), **{**kw, "attn_mask": mask[mi]})
        one = one if weights else (one,)
        for a, b in zip(got, one):
            np.testing.assert_array_equal(a[idx], b)
    ref = R.attention(q, k, v, R.score_dot, mask, True, return_weights=weights)
    for a, b in zip(got, ref if weights else (ref,)):
        assert_close(a, b, np.float64)

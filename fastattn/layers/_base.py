"""``Layer``, the base class of every layer in :mod:`fastattn.layers`
(``MultiHeadAttention`` included), and the argument checkers they share.

A layer holds

* its own parameters in ``self._params``, an ordered ``{name: ndarray}``
  mapping (the one parameter store; names may contain dots, e.g.
  ``out_proj.weight`` or ``sim.W_q``, where torch's names do);
* its sub-layers as :meth:`Layer._children` (``{name: Layer}``), the only way
  layers nest: every walk over a layer and its descendants
  (:meth:`Layer.named_parameters`, :meth:`Layer.state_dict`,
  :meth:`Layer.load_state_dict`) goes through it, and names a child's
  parameter ``<child>.<name>`` (``encoder.rnn.weight_ih_l0``), as torch does;
* its constructor arguments (JSON-friendly) in ``self._config``.

Training (a later issue) will keep gradients in ``self._grads`` beside
``self._params``, under the same names, so that the walk of
:meth:`Layer._walk` names both alike; nothing here computes gradients.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import numpy as np

from .. import _alloc, _stamps
from .._validation import check_int
from ..registry import get_similarity

__all__ = ["Layer", "check_int"]  # check_int: _validation's, shared with the ops

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ================================================================ checkers
def check_dtype(dtype, name="dtype"):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected float32 or float64, got {dtype!r}") from None
    if dt not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64, got {dt}")
    return dt


def check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def as_float_input(x, name, ndims, last=None):
    """x as a float ndarray (never copied when already float32/64) with ndim in ``ndims``
    and, if given, last dim ``last``."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"{name}: expected an array of real numbers, got {type(x).__name__} ({exc})") from None
    if x.dtype.kind not in "fiub" or (x.dtype.kind == "f" and x.dtype.itemsize > 8):
        raise TypeError(f"{name}: expected real numbers (float32/float64), got dtype {x.dtype}")
    if x.dtype.kind != "f" or x.dtype.itemsize < 4:
        # as the functional ops: integers and bool -> float64, float16 -> float32
        x = x.astype(np.float64 if x.dtype.kind != "f" else np.float32)
    if x.ndim not in ndims:
        if isinstance(ndims, range) and ndims.step == 1 and len(ndims) > 3:
            want = f"{ndims.start}-d to {ndims.stop - 1}-d"
        else:
            want = " or ".join(f"{n}-d" for n in ndims)
        raise ValueError(f"{name}: expected a {want} array, got {x.ndim}-d array of shape {x.shape}")
    if last is not None and x.shape[-1] != last:
        raise ValueError(f"{name}: expected last dim {last}, got shape {x.shape}")
    return x


def as_param_array(value, label, *, integers=True):
    """A NumPy array of a parameter's values from an array, nested lists or a torch
    tensor (duck-typed: torch is not imported); errors start with ``label``
    (e.g. ``state_dict['weight']``).

    Tensors that NumPy cannot hold (bfloat16) and float16 ones come through
    ``.float()`` (float32).  Complex, bool, object and string values are
    refused (TypeError); integers too unless ``integers`` (they are then
    cast with the rest by the caller).  The array is not copied: the caller
    copies it into the layer (:meth:`Layer._canonical_param`)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        t = value.detach().cpu()
        is_float = getattr(t, "is_floating_point", None)
        if is_float is not None:
            if not is_float():
                if not integers:
                    raise TypeError(f"{label}: expected a real floating-point tensor, got dtype {t.dtype}")
            elif str(t.dtype) not in ("torch.float32", "torch.float64"):
                t = t.float()
        value = t.numpy() if hasattr(t, "numpy") else t
    try:
        a = np.asarray(value)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"{label}: expected an array, got {type(value).__name__} ({exc})") from None
    if integers:
        if a.dtype.kind not in "fiu":
            raise TypeError(f"{label}: expected real numbers, got dtype {a.dtype}")
    elif a.dtype.kind != "f":
        raise TypeError(f"{label}: expected a real floating-point array, got dtype {a.dtype}")
    return a


# =================================================================== seeds
def _rng(seed):
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def _config_seed(seed):
    """The seed as ``get_config`` records it (a Generator is not recorded)."""
    if seed is None or isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return None if seed is None else int(seed)
    if isinstance(seed, np.random.Generator):
        return None
    raise TypeError(f"seed: expected None, an int or a np.random.Generator, got {type(seed).__name__}")


# ============================================================ similarities
# (shared by the layers that score with a registered similarity: Attention and
# AttentionDecoder)
def _similarity_config(sim):
    cfg = sim.get_config()
    return cfg if len(cfg) > 1 else cfg["name"]


def resolve_similarity(similarity):
    """A Similarity object from a name, an object or a config dict."""
    if isinstance(similarity, dict):
        cfg = dict(similarity)
        base = get_similarity(cfg.get("name"))
        return type(base).from_config(cfg)
    return get_similarity(similarity)


def init_similarity_params(sim, d_q, d_k, attn_dim, rng, dtype):
    """Random parameters for ``sim`` (its own ``init_params``); {} when it has none."""
    spec = sim.params_spec or {}
    dims = {}
    if any("d_a" in ps.shape for ps in spec.values()):
        dims["d_a"] = attn_dim
    p = sim.init_params(d_q, d_k, rng=rng, dtype=dtype, **dims)
    if p is None:
        return {}
    # an optional scalar without a default (scaled_dot's ``scale``: 1/sqrt(d)
    # computed at call time) is left out rather than materialised as 0
    return {k: np.asarray(v, dtype=dtype) for k, v in p.items()
            if spec[k].required or spec[k].default is not None or len(spec[k].shape)}


# =================================================================== Layer
class Layer:
    """Base class: one parameter store, children, state dicts, configs.

    Subclasses set ``self._params`` and ``self._config`` in ``__init__`` and
    override :meth:`_children` when they hold sub-layers.  Hooks:
    :meth:`_param_shapes` (the names and shapes ``load_state_dict`` expects),
    :meth:`_canonical_param` (how a loaded array is stored),
    :meth:`_names_error` (the message for names that do not match),
    :meth:`_after_load` (refresh what is derived from the parameters), and the
    class attributes ``_integer_params`` and ``_config_keys``.
    """

    _params: dict
    _config: dict
    #: training mode (dropout and other train-only behaviour); :meth:`train` / :meth:`eval`
    training = True

    #: load_state_dict casts integer arrays to the parameters' dtype (False: refused
    #: with TypeError, as MultiHeadAttention does)
    _integer_params = True
    #: the keys from_config accepts; None: the constructor's parameter names
    _config_keys = None

    def __init_subclass__(cls, **kwargs):
        # the layers' entry points allocate through fastattn's block cache
        # (fastattn/_alloc.py): a training step reuses the previous step's
        # freed activations instead of faulting in fresh pages
        super().__init_subclass__(**kwargs)
        for name in ("__call__", "forward_backward", "loss_and_grads"):
            fn = cls.__dict__.get(name)
            if callable(fn):
                setattr(cls, name, _alloc.cached_method(
                    fn, returns_backprop=name == "forward_backward"))

    # ------------------------------------------------------------ nesting
    def _children(self) -> dict:
        """``{name: Layer}``: the sub-layers, in state-dict order (none here)."""
        return {}

    def _walk(self, prefix=""):
        """``(prefix, layer)`` for this layer (``prefix``) and every descendant
        (``prefix + "child."``, ...), depth first in :meth:`_children` order:
        the one traversal behind every method that spans sub-layers."""
        yield prefix, self
        for name, child in self._children().items():
            yield from child._walk(f"{prefix}{name}.")

    # ---------------------------------------------------------------- params
    def parameters(self):
        """A new ``{name: ndarray}`` dict of this layer's own parameters (the live
        arrays, not copies; children's are in :meth:`named_parameters`)."""
        return dict(self._params)

    def named_parameters(self):
        """``(dotted name, array)`` pairs over this layer's parameters and its
        children's (``encoder.rnn.weight_ih_l0``), the live arrays (not
        copies), in :meth:`state_dict` order; ``dict(layer.named_parameters())``
        for a mapping."""
        for prefix, layer in self._walk():
            for name, a in layer._params.items():
                yield prefix + name, a

    # ------------------------------------------------------------- gradients
    @property
    def grads(self) -> dict:
        """``{name: ndarray}`` of this layer's own gradients, the names of
        :meth:`parameters` (the live accumulators, zeros until a backward adds
        into them; allocated on first use, in each parameter's dtype and shape)."""
        g = self.__dict__.get("_grads")
        if g is None or g.keys() != self._params.keys() or any(
                g[n].shape != a.shape or g[n].dtype != a.dtype for n, a in self._params.items()):
            old = g or {}
            g = {n: old[n] if n in old and old[n].shape == a.shape and old[n].dtype == a.dtype
                 else np.zeros(a.shape, a.dtype) for n, a in self._params.items()}
            self._grads = g
        return g

    def named_grads(self):
        """``(dotted name, gradient)`` pairs in :meth:`named_parameters` order and
        with its names (the live accumulators)."""
        for prefix, layer in self._walk():
            for name, a in layer.grads.items():
                yield prefix + name, a

    def zero_grad(self):
        """Set every gradient of this layer and its children to zero (in place).
        Returns ``self``."""
        for _, layer in self._walk():
            for a in layer.grads.values():
                a[...] = 0
        return self

    def params_changed(self):
        """Say that parameter arrays of this layer or its children were written
        in place by something other than fastattn (``layer.params[name][...] =
        ...``, a NumPy ufunc with ``out=``): what a layer derives from its
        parameters (MultiHeadAttention's packed projection weights, Linear's
        packed weight) is rebuilt
        on the next call.  fastattn's own writers (the optimizers' ``step``,
        :meth:`load_state_dict`, :func:`fastattn.load`) need no such call, and
        neither does replacing an array (``layer.params[name] = new``).
        Returns ``self``."""
        for _, a in self.named_parameters():
            if isinstance(a, np.ndarray):
                _stamps.bump(a)
        return self

    def train(self, mode=True):
        """Training mode (``mode=True``) or inference mode for this layer and its
        children (dropout is active only in training).  Returns ``self``."""
        check_bool(mode, "mode")
        for _, layer in self._walk():
            layer.training = bool(mode)
        return self

    def eval(self):
        """``train(False)``."""
        return self.train(False)

    def forward_backward(self, *inputs, **kwargs):
        """``(out, backprop)``: the forward result and a function that takes the
        gradient of the output, adds the parameter gradients into :attr:`grads`
        (of this layer and its children) and returns the gradients of the
        float inputs.  Layers that support training override this."""
        raise NotImplementedError(f"{type(self).__name__} has no forward_backward yet")

    def state_dict(self) -> dict:
        """A new ``{dotted name: ndarray}`` dict of writeable, C-contiguous copies
        (torch's names where they exist): writing to them never reaches the layer."""
        out = {}
        for name, a in self.named_parameters():
            if name in out:
                raise RuntimeError(f"{type(self).__name__}: two parameters are named {name!r}")
            out[name] = np.array(a, order="C", copy=True)
        return out

    def _param_shapes(self) -> dict:
        """``{name: shape}`` of this layer's own parameters as ``load_state_dict``
        expects them (default: the current arrays')."""
        return {n: a.shape for n, a in self._params.items()}

    def _param_table(self) -> dict:
        """``{dotted name: (layer, own name, shape)}`` over this layer and its descendants."""
        table = {}
        for prefix, layer in self._walk():
            for name, shape in layer._param_shapes().items():
                if prefix + name in table:
                    raise RuntimeError(f"{type(self).__name__}: two parameters are named {prefix + name!r}")
                table[prefix + name] = (layer, name, tuple(shape))
        return table

    def load_state_dict(self, state_dict, strict=True, *, prefix=""):
        """Copy arrays from ``state_dict`` into the parameters (cast to the layer dtype).

        ``state_dict`` maps dotted names (:meth:`state_dict`'s, after
        ``prefix``; keys not starting with ``prefix`` are ignored) to NumPy
        arrays, nested lists or torch tensors.  Names and shapes are validated
        first (nothing is changed on error): with ``strict`` missing and
        unexpected names raise ``ValueError``, without it only the names given
        are loaded; wrong shapes and NaN / infinite values raise
        ``ValueError``, values that are not real numbers ``TypeError``.  The
        layer stores copies (:meth:`_canonical_param`), never the given arrays.
        Returns ``self``.
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        table = self._param_table()
        given = {}
        for k in state_dict.keys():
            name = k if isinstance(k, str) else str(k)
            if name.startswith(prefix):
                given[name[len(prefix):]] = k
        if strict:
            missing = [n for n in table if n not in given]
            unexpected = sorted(set(given) - set(table))
            if missing or unexpected:
                raise ValueError(self._names_error([prefix + n for n in table],
                                                   [prefix + n for n in missing],
                                                   [prefix + n for n in unexpected]))
        checked = []
        for name, (layer, own, shape) in table.items():
            if name not in given:
                continue
            label = f"state_dict[{prefix + name!r}]"
            a = as_param_array(state_dict[given[name]], label, integers=layer._integer_params)
            if a.shape != shape:
                raise ValueError(f"{label}: expected shape {shape}, got {a.shape}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{label}: contains NaN or infinite values")
            checked.append((layer, own, a))
        updates = {}  # id(layer) -> (layer, {own name: stored array}), all made before any is stored
        for layer, own, a in checked:
            updates.setdefault(id(layer), (layer, {}))[1][own] = layer._canonical_param(own, a)
        for layer, arrays in updates.values():
            layer._store_params(arrays)
            layer._after_load()
        return self

    def _names_error(self, expected, missing, unexpected) -> str:
        """The message of a strict :meth:`load_state_dict` whose names do not match:
        ``expected`` every name (in state-dict order), ``missing`` those not
        given (in that order), ``unexpected`` the given ones not expected
        (sorted); all with the prefix."""
        return (f"state_dict: names do not match {type(self).__name__}: missing {sorted(missing)}, "
                f"unexpected {unexpected}")

    def _canonical_param(self, name, array):
        """The array to store for parameter ``name`` loaded from ``array`` (already
        validated): a private C-contiguous copy in the layer's dtype
        (``_config["dtype"]``; without one, the current parameter's)."""
        dtype = self._config.get("dtype") or self._params[name].dtype
        return np.array(array, dtype=dtype, order="C", copy=True)

    def _store_params(self, arrays):
        """Store ``arrays`` (``{own name: array}``) as parameters: ``_params``
        becomes a new dict in :meth:`_param_shapes` order, the parameters not
        in ``arrays`` kept."""
        old = self._params
        self._params = {n: arrays[n] if n in arrays else old[n]
                        for n in self._param_shapes() if n in arrays or n in old}

    def _after_load(self):
        """Hook: refresh derived arrays after :meth:`load_state_dict` stored new
        parameters in this layer (called on each layer that got some)."""

    # ---------------------------------------------------------------- config
    def get_config(self) -> dict:
        """Constructor arguments (JSON-friendly); ``from_config(get_config())``
        builds a layer of the same architecture (parameters freshly initialised)."""
        return dict(self._config)

    @classmethod
    def _check_config(cls, config) -> dict:
        """``config`` as a new dict of constructor arguments: a mapping with only
        known keys (:attr:`_config_keys`) and every required one."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config: expected a mapping, got {type(config).__name__}")
        params = [p for p in inspect.signature(cls.__init__).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]  # [0] is self
        keys = list(cls._config_keys) if cls._config_keys is not None else [p.name for p in params]
        unknown = sorted(str(k) for k in config if k not in keys)
        if unknown:
            raise ValueError(f"config: unknown keys {unknown}; expected some of {keys}")
        for p in params:
            if p.default is p.empty and p.name not in config:
                raise ValueError(f"config: missing required key {p.name!r}")
        return dict(config)

    @classmethod
    def from_config(cls, config, *, seed=None):
        """A new layer (freshly initialised) from :meth:`get_config`'s dict;
        ``seed`` (an int or a Generator), when given, replaces the config's."""
        kwargs = cls._check_config(config)
        if seed is not None:
            kwargs["seed"] = seed
        return cls(**kwargs)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._config.items())
        return f"{type(self).__name__}({args})"

"""Optimizers, gradient clipping and learning-rate schedules for training
fastattn layers, with the math and defaults of ``torch.optim``.

Pure NumPy; nothing here knows a layer beyond two methods.  An optimizer's
``params`` is either

* a **model**: any object with ``named_parameters()`` and ``named_grads()``
  (e.g. a :class:`fastattn.layers.Linear`), both yielding ``(dotted name,
  live array)`` pairs with the same names.  They are walked again at every
  :meth:`Optimizer.step`, so a layer whose :meth:`load_state_dict` stored new
  arrays is still the one updated; or
* an iterable of ``(name, param, grad)`` triples of NumPy arrays (read once;
  the arrays are kept, not copied).

Parameters are updated **in place** (the layer sees the change); gradients
are read when :meth:`Optimizer.step` runs.  The per-parameter state (momentum
buffers, moment estimates) is keyed by the parameter's name and held in the
parameter's dtype: a float32 parameter stays float32, as in torch.  There is
one parameter group: the hyper-parameters apply to every parameter.

Non-finite gradients are not skipped: as in torch, a NaN or inf propagates
into the parameter (and the state) where it occurs, without a warning (check
``np.isfinite`` or use :func:`clip_grad_norm`'s ``error_if_nonfinite``).

=============================  ==================================================
name                           torch counterpart
=============================  ==================================================
:class:`SGD`                   ``torch.optim.SGD``
:class:`Adam`                  ``torch.optim.Adam``
:class:`AdamW`                 ``torch.optim.AdamW``
:func:`clip_grad_norm`         ``torch.nn.utils.clip_grad_norm_``
:class:`LambdaLR`              ``torch.optim.lr_scheduler.LambdaLR``
:class:`CosineAnnealingLR`     ``torch.optim.lr_scheduler.CosineAnnealingLR``
:class:`WarmupLinear`          linear warm-up then linear decay (``LambdaLR``)
:class:`WarmupCosine`          linear warm-up then cosine decay (``LambdaLR``)
=============================  ==================================================
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from . import _stamps
from ._optim_ops import adam_update, sum_squares

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm", "LRSchedule", "LambdaLR",
           "CosineAnnealingLR", "WarmupLinear", "WarmupCosine"]


# ================================================================ checkers
def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def _real(value, name) -> float:
    """``value`` as a Python float (a weak scalar for NumPy: float32 stays float32)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {_describe(value)}")
    return float(value)


def _nonneg(value, name) -> float:
    v = _real(value, name)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return v


def _finite(value, name) -> float:
    v = _real(value, name)
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return v


def _bool(value, name) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {_describe(value)}")
    return bool(value)


def _int(value, name, minimum=0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _betas(value, name="betas") -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name}: expected a pair (beta1, beta2), got {_describe(value)}")
    out = []
    for i, b in enumerate(value):
        v = _real(b, f"{name}[{i}]")
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{name}[{i}]: expected a number in [0, 1), got {b!r}")
        out.append(v)
    return tuple(out)


# ================================================================ parameters
def _is_model(obj) -> bool:
    # a layer class (not an instance) has the methods too, unbound
    return not isinstance(obj, type) and callable(getattr(obj, "named_parameters", None)) and callable(getattr(obj, "named_grads", None))


def _check_triple(name, param, grad, label):
    """Validate one ``(name, param, grad)``; errors start with ``label[name]``."""
    if not isinstance(name, str):
        raise TypeError(f"{label}: expected parameter names (str), got {_describe(name)}")
    where = f"{label}[{name!r}]"
    if not isinstance(param, np.ndarray):
        raise TypeError(f"{where}: expected the parameter as a NumPy array (updated in place), "
                        f"got {_describe(param)}")
    if param.dtype.kind != "f":
        raise TypeError(f"{where}: expected a floating-point parameter, got dtype {param.dtype}")
    if not isinstance(grad, np.ndarray):
        raise TypeError(f"{where}: expected the gradient as a NumPy array, got {_describe(grad)}")
    if grad.shape != param.shape:
        raise ValueError(f"{where}: expected a gradient of the parameter's shape {param.shape}, "
                         f"got {grad.shape}")
    if grad.dtype != param.dtype:
        raise TypeError(f"{where}: expected a gradient of the parameter's dtype {param.dtype}, "
                        f"got {grad.dtype}")


def _collect(source, label="params") -> list:
    """``[(name, param, grad)]`` from a model or from an iterable of triples, validated."""
    if _is_model(source):
        params = list(source.named_parameters())
        grads = list(source.named_grads())
        pnames = [n for n, _ in params]
        gnames = [n for n, _ in grads]
        if pnames != gnames:
            missing = [n for n in pnames if n not in gnames]
            extra = [n for n in gnames if n not in pnames]
            raise ValueError(f"{label}: named_grads() does not match named_parameters() (names in "
                             f"the same order): no gradient for {missing}, gradients without a "
                             f"parameter {extra}, parameters {pnames}, gradients {gnames}")
        items = [(n, p, g) for (n, p), (_, g) in zip(params, grads)]
    else:
        if isinstance(source, type):
            raise TypeError(f"{label}: expected a model (with named_parameters() and named_grads()) "
                            f"or an iterable of (name, param, grad) triples, got the class "
                            f"{source.__name__} (not an instance of it)")
        if isinstance(source, (str, bytes, np.ndarray, Mapping)) or not hasattr(source, "__iter__"):
            raise TypeError(f"{label}: expected a model (with named_parameters() and named_grads()) "
                            f"or an iterable of (name, param, grad) triples, got {type(source).__name__}")
        items = []
        for i, item in enumerate(source):
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise TypeError(f"{label}[{i}]: expected a (name, param, grad) triple, "
                                f"got {_describe(item)}")
            items.append(tuple(item))
    seen = set()
    for name, p, g in items:
        _check_triple(name, p, g, label)
        if name in seen:
            raise ValueError(f"{label}: two parameters are named {name!r}")
        seen.add(name)
    return items


# ================================================================ optimizers
class Optimizer:
    """The base of :class:`SGD`, :class:`Adam` and :class:`AdamW`: the
    parameters, the per-parameter state, ``lr``, :meth:`step`,
    :meth:`zero_grad` and the state dict.  Subclasses define ``_hyper_checks``
    (``{name: checker}`` of the hyper-parameters, in order), ``_state_keys()``
    and ``_update(param, grad, state)``."""

    _hyper_checks: dict = {}

    def __init__(self, params, **hyper):
        self._hyper = self._check_hyper(hyper, "")
        if _is_model(params):
            self._model, self._items = params, None
        else:
            self._model, self._items = None, _collect(params)
        items = self._current()
        if not items:
            raise ValueError("params: expected at least one parameter, got none")
        self.state = {}  # {name: {state key: value}}, made at a parameter's first step

    @classmethod
    def _check_hyper(cls, hyper, label) -> dict:
        out = {k: check(hyper[k], f"{label}{k}") for k, check in cls._hyper_checks.items()}
        cls._check_combination(out, label)
        return out

    @classmethod
    def _check_combination(cls, hyper, label):
        """Hook: constraints between hyper-parameters."""

    def _current(self) -> list:
        """``[(name, param, grad)]`` now: the model walked again, or the triples."""
        return _collect(self._model) if self._model is not None else self._items

    # ------------------------------------------------------------- hyper
    @property
    def lr(self) -> float:
        """The learning rate (a finite number >= 0); settable (schedules set it)."""
        return self._hyper["lr"]

    @lr.setter
    def lr(self, value):
        self._hyper["lr"] = _nonneg(value, "lr")

    @property
    def hyperparameters(self) -> dict:
        """A new dict of the hyper-parameters (``betas`` as a tuple)."""
        return dict(self._hyper)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._hyper.items())
        return f"{type(self).__name__}({args})"

    # ------------------------------------------------------------- steps
    def step(self):
        """One update of every parameter, in place, from its current gradient.
        Everything is checked (read-only parameters, state shapes) before any
        parameter changes.  Returns None."""
        items = self._current()
        for name, p, _ in items:
            if not p.flags.writeable:
                raise ValueError(f"params[{name!r}]: the parameter array is read-only "
                                 "(a frozen layer? unfreeze it to train)")
            st = self.state.get(name)
            if st:
                for k, v in st.items():
                    if isinstance(v, np.ndarray) and v.shape != p.shape:
                        raise ValueError(f"params[{name!r}]: the parameter's shape {p.shape} differs "
                                         f"from its optimizer state's ({k!r}: {v.shape})")
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # NaN / inf propagate, as torch's
            for name, p, g in items:
                st = self.state.get(name)
                if st is None:
                    st = self.state[name] = self._init_state(p)
                self._update(p, g, st)
                _stamps.bump(p)   # a layer's derived copy of p (packed weights) is now stale

    def zero_grad(self):
        """Set every gradient to zero, in place.  Returns None."""
        for _, _, g in self._current():
            g[...] = 0

    def _grads(self) -> list:
        return [g for _, _, g in self._current()]

    # ------------------------------------------------------------- state
    def _init_state(self, p) -> dict:
        raise NotImplementedError

    def _state_keys(self, hyper) -> tuple:
        """The keys of one parameter's state under ``hyper``: ``(int keys, array keys)``."""
        raise NotImplementedError

    def _update(self, p, g, st):
        raise NotImplementedError

    def state_dict(self) -> dict:
        """A new dict: ``optimizer`` (the class name), ``hyperparameters``
        (JSON-friendly: floats, bools, ``betas`` a list), ``param_names`` (in
        order) and ``state``, ``{name: {key: value}}`` with copies of the
        state arrays (and ``step`` an int) for the parameters stepped so far."""
        names = [n for n, _, _ in self._current()]
        hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in self._hyper.items()}
        state = {n: {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v
                     for k, v in self.state[n].items()}
                 for n in names if n in self.state}
        return {"optimizer": type(self).__name__, "hyperparameters": hyper,
                "param_names": names, "state": state}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`'s hyper-parameters and state (copies, cast
        to each parameter's dtype).  Everything is checked first and nothing
        changes on error: another optimizer class, unknown or missing keys, bad
        hyper-parameters, parameter names that differ from this optimizer's,
        state arrays whose shapes differ from the parameters' (all listed in
        one ``ValueError``).  Returns ``self``."""
        d = state_dict
        if not isinstance(d, Mapping):
            raise TypeError(f"state_dict: expected a mapping (from state_dict()), got {type(d).__name__}")
        if d.get("optimizer") != type(self).__name__:
            raise ValueError(f"state_dict['optimizer']: expected {type(self).__name__!r}, "
                             f"got {d.get('optimizer')!r}")
        want = {"optimizer", "hyperparameters", "param_names", "state"}
        if set(d) != want:
            raise ValueError(f"state_dict: expected the keys {sorted(want)}, got {sorted(map(str, d))}")
        hyper = d["hyperparameters"]
        if not isinstance(hyper, Mapping) or set(hyper) != set(self._hyper_checks):
            got = sorted(map(str, hyper)) if isinstance(hyper, Mapping) else type(hyper).__name__
            raise ValueError(f"state_dict['hyperparameters']: expected the keys "
                             f"{sorted(self._hyper_checks)}, got {got}")
        hyper = self._check_hyper(hyper, "state_dict['hyperparameters']: ")
        items = self._current()
        params = {n: p for n, p, _ in items}
        names = d["param_names"]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"state_dict['param_names']: expected a list of names, got {_describe(names)}")
        state = d["state"]
        if not isinstance(state, Mapping):
            raise TypeError(f"state_dict['state']: expected a mapping, got {type(state).__name__}")
        problems = []
        missing = [n for n in params if n not in names]
        unexpected = [n for n in names if n not in params]
        unexpected += [n for n in state if n not in params and n not in unexpected]
        if missing or unexpected:
            problems.append(f"parameter names differ: this optimizer's not in the state dict {missing}, "
                            f"the state dict's not in this optimizer {unexpected}")
        int_keys, array_keys = self._state_keys(hyper)
        new_state = {}
        for name, st in state.items():
            if name not in params:
                continue
            p = params[name]
            if not isinstance(st, Mapping) or set(st) != set(int_keys) | set(array_keys):
                got = sorted(map(str, st)) if isinstance(st, Mapping) else type(st).__name__
                problems.append(f"state[{name!r}]: expected the keys {sorted(int_keys + array_keys)}, got {got}")
                continue
            entry = {}
            for k in int_keys:
                v = st[k]
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0:
                    problems.append(f"state[{name!r}][{k!r}]: expected an integer >= 0, got {_describe(v)}")
                else:
                    entry[k] = int(v)
            for k in array_keys:
                try:
                    a = np.asarray(st[k])
                except Exception:  # noqa: BLE001 - ragged lists and the like
                    a = None
                if a is None or a.dtype.kind not in "fiu":
                    problems.append(f"state[{name!r}][{k!r}]: expected an array of real numbers, "
                                    f"got {_describe(st[k])}")
                elif a.shape != p.shape:
                    problems.append(f"state[{name!r}][{k!r}]: expected the parameter's shape {p.shape}, "
                                    f"got {a.shape}")
                else:
                    entry[k] = np.array(a, dtype=p.dtype, copy=True)
            new_state[name] = entry
        if problems:
            raise ValueError(f"state_dict: does not match this {type(self).__name__}: " + "; ".join(problems))
        self._hyper = hyper
        self.state = new_state
        return self


class SGD(Optimizer):
    """Stochastic gradient descent, optionally with momentum (torch.optim.SGD).

    With ``g`` the gradient (``-g`` when ``maximize``), ``θ`` the parameter,
    ``λ`` ``weight_decay``, ``μ`` ``momentum``, ``τ`` ``dampening``::

        g ← g + λ θ                                   (if λ ≠ 0)
        b ← g  (first step),  b ← μ b + (1 − τ) g     (if μ ≠ 0)
        g ← g + μ b  (nesterov)  or  g ← b
        θ ← θ − lr g

    ``nesterov`` needs ``momentum > 0`` and ``dampening == 0``.  State:
    ``momentum_buffer`` (only when ``momentum != 0``).
    """

    _hyper_checks = {"lr": _nonneg, "momentum": _nonneg, "dampening": _finite,
                     "weight_decay": _nonneg, "nesterov": _bool, "maximize": _bool}

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)

    @classmethod
    def _check_combination(cls, h, label):
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise ValueError(f"{label}nesterov: expected momentum > 0 and dampening == 0 with "
                             f"nesterov=True, got momentum={h['momentum']!r}, dampening={h['dampening']!r}")

    def _state_keys(self, hyper):
        return (), (("momentum_buffer",) if hyper["momentum"] != 0 else ())

    def _init_state(self, p):
        return {}

    def _update(self, p, g, st):
        h = self._hyper
        lr, mu, wd = h["lr"], h["momentum"], h["weight_decay"]
        d = np.negative(g) if h["maximize"] else g  # never written to when it is g
        if wd != 0:
            d = d + wd * p
        if mu != 0:
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = st["momentum_buffer"] = np.array(d, dtype=p.dtype, copy=True)
            else:
                buf *= mu
                buf += (1 - h["dampening"]) * d
            d = d + mu * buf if h["nesterov"] else buf
        p -= lr * d


class Adam(Optimizer):
    """Adam (torch.optim.Adam), with the L2 penalty added to the gradient.

    With ``g`` the gradient (``-g`` when ``maximize``), ``t`` the parameter's
    step count (from 1), ``λ`` ``weight_decay``::

        g ← g + λ θ                                   (if λ ≠ 0)
        m ← m + (1 − β₁)(g − m)
        v ← β₂ v + (1 − β₂) g²
        v̂ ← max(v̂, v)  (amsgrad; used instead of v below)
        θ ← θ − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + eps)

    State: ``step`` (an int), ``exp_avg`` (m), ``exp_avg_sq`` (v) and, with
    ``amsgrad``, ``max_exp_avg_sq`` (v̂).
    """

    _hyper_checks = {"lr": _nonneg, "betas": _betas, "eps": _nonneg, "weight_decay": _nonneg,
                     "amsgrad": _bool, "maximize": _bool}
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 *, maximize=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)

    def _state_keys(self, hyper):
        return ("step",), ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if hyper["amsgrad"] else ())

    def _init_state(self, p):
        st = {"step": 0, "exp_avg": np.zeros(p.shape, p.dtype), "exp_avg_sq": np.zeros(p.shape, p.dtype)}
        if self._hyper["amsgrad"]:
            st["max_exp_avg_sq"] = np.zeros(p.shape, p.dtype)
        return st

    def _update(self, p, g, st):
        h = self._hyper
        st["step"] += 1
        adam_update(p, g, st["exp_avg"], st["exp_avg_sq"],
                    st["max_exp_avg_sq"] if h["amsgrad"] else None,
                    step=st["step"], lr=h["lr"], betas=h["betas"], eps=h["eps"],
                    weight_decay=h["weight_decay"], decoupled=self._decoupled,
                    maximize=h["maximize"])


class AdamW(Adam):
    """AdamW (torch.optim.AdamW): Adam with decoupled weight decay,
    ``θ ← θ (1 − lr λ)`` before the moments are updated (λ is not added to
    the gradient); default ``weight_decay=1e-2``.  The rest as :class:`Adam`."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, maximize=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)


# ================================================================ clipping
def _norm_type(value) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf"):
        return math.inf
    v = _real(value, "norm_type")
    if not (v > 0):  # also NaN
        raise ValueError(f"norm_type: expected a number > 0 or inf, got {value!r}")
    return v


def _vector_norm(a, p) -> float:
    """The p-norm of ``a``'s entries in float64 (NaN propagates).

    The 2-norm is :func:`fastattn._optim_ops.sum_squares` (C on fastattn's
    threads) -- not ``np.dot``: OpenBLAS's ddot starts its own threads on long
    vectors, outside fastattn's thread setting (two processes at 1 thread
    each then ran 3x slower, measured), and a float32 gradient is never copied
    to float64 whole."""
    a = np.asarray(a)
    if a.size == 0:
        return 0.0
    if p == 2.0:
        return math.sqrt(sum_squares(a))
    a = a.astype(np.float64, copy=False).reshape(-1)
    if p == math.inf:
        return float(np.max(np.abs(a)))
    if p == 1.0:
        return float(np.sum(np.abs(a)))
    return float(np.sum(np.abs(a) ** p) ** (1.0 / p))


def clip_grad_norm(params_or_model, max_norm, norm_type=2.0, error_if_nonfinite=False) -> float:
    """Scale the gradients in place so that their total norm is at most
    ``max_norm`` (torch.nn.utils.clip_grad_norm_); returns the total norm
    before clipping, a float.

    ``params_or_model``: a model (``named_grads()``), an :class:`Optimizer`
    (its parameters' gradients) or an iterable of ``(name, param, grad)``
    triples.  The total norm is the ``norm_type``-norm of the gradients'
    norms (as if they were one vector; ``inf``: the largest ``|g|``),
    computed in float64.  Every gradient is multiplied by
    ``min(max_norm / (total + 1e-6), 1)``.

    A NaN total gives NaN gradients and an infinite one zeros (NaN where a
    gradient is inf), as in torch; with ``error_if_nonfinite`` a non-finite
    total raises ``RuntimeError`` (torch's exception type) and no gradient
    changes.
    """
    if isinstance(params_or_model, Optimizer):
        grads = params_or_model._grads()
    else:
        grads = [g for _, _, g in _collect(params_or_model, "params_or_model")]
    max_norm = _real(max_norm, "max_norm")
    if not max_norm >= 0:
        raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
    p = _norm_type(norm_type)
    error_if_nonfinite = _bool(error_if_nonfinite, "error_if_nonfinite")
    if not grads:
        return 0.0
    norms = [_vector_norm(g, p) for g in grads]
    total = _vector_norm(np.array(norms), p)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"clip_grad_norm: the total norm of order {p} of the gradients is "
                           f"non-finite ({total}), so it cannot be clipped; pass "
                           "error_if_nonfinite=False to scale the gradients by it anyway")
    coef = float(np.minimum(max_norm / (total + 1e-6), 1.0))  # NaN propagates, as torch's clamp
    if coef != 1.0:
        with np.errstate(invalid="ignore"):  # inf * 0 -> NaN, as torch's
            for g in grads:
                g *= coef
    return total


# ================================================================ schedules
class LRSchedule:
    """The base of the learning-rate schedules: ``optimizer.lr = base_lr ·
    factor(t)``, closed form, where ``base_lr`` is ``optimizer.lr`` when the
    schedule is made and ``t`` (:attr:`last_epoch`) counts the :meth:`step`
    calls since (0 at construction, which already sets ``lr = base_lr ·
    factor(0)``, as torch's schedulers do).  Call :meth:`step` after
    ``optimizer.step()``.

    Subclasses define :meth:`lr_at` (or ``factor``) and ``_config()`` (their
    JSON-friendly arguments, saved in the state dict).  One schedule per
    optimizer: a second one would take the first's lr as its base.
    """

    def __init__(self, optimizer):
        if not isinstance(getattr(optimizer, "lr", None), float):
            raise TypeError(f"optimizer: expected a fastattn.optim optimizer (with a float lr), "
                            f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.lr_at(0)

    def factor(self, t) -> float:
        raise NotImplementedError

    def lr_at(self, t) -> float:
        """The learning rate after ``t`` calls of :meth:`step`."""
        return self.base_lr * self.factor(t)

    def step(self):
        """Advance one step and set the optimizer's ``lr``.  Returns None."""
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def get_last_lr(self) -> list:
        """``[lr]``, the rate of the current step (a one-element list, as torch's
        ``get_last_lr`` with one parameter group)."""
        return [self.lr_at(self.last_epoch)]

    def _config(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """``{"schedule": class name, "last_epoch", "base_lr", **arguments}``
        (JSON-friendly).  The optimizer's lr is in the optimizer's state dict."""
        return {"schedule": type(self).__name__, "last_epoch": self.last_epoch,
                "base_lr": self.base_lr, **self._config()}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`: the step count, ``base_lr`` and the
        arguments (names and values checked first; ``ValueError`` naming what
        differs).  The optimizer is not touched (load its own state dict).
        Returns ``self``."""
        d = state_dict
        if not isinstance(d, Mapping):
            raise TypeError(f"state_dict: expected a mapping (from state_dict()), got {type(d).__name__}")
        if d.get("schedule") != type(self).__name__:
            raise ValueError(f"state_dict['schedule']: expected {type(self).__name__!r}, got {d.get('schedule')!r}")
        want = {"schedule", "last_epoch", "base_lr", *self._config()}
        if set(d) != want:
            raise ValueError(f"state_dict: expected the keys {sorted(want)}, got {sorted(map(str, d))}")
        last = _int(d["last_epoch"], "state_dict['last_epoch']")
        base = _nonneg(d["base_lr"], "state_dict['base_lr']")
        config = self._check_config({k: d[k] for k in self._config()}, "state_dict: ")
        self.last_epoch, self.base_lr = last, base
        for k, v in config.items():
            setattr(self, k, v)
        return self

    def _check_config(self, config, label) -> dict:
        return dict(config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args}{', ' if args else ''}last_epoch={self.last_epoch})"


class LambdaLR(LRSchedule):
    """``lr = base_lr · lr_lambda(t)`` (torch.optim.lr_scheduler.LambdaLR);
    ``lr_lambda`` is not saved in the state dict."""

    def __init__(self, optimizer, lr_lambda):
        if not callable(lr_lambda):
            raise TypeError(f"lr_lambda: expected a callable t -> factor, got {_describe(lr_lambda)}")
        self.lr_lambda = lr_lambda
        super().__init__(optimizer)

    def factor(self, t):
        return self.lr_lambda(t)


def _warmup_args(warmup_steps, total_steps, label=""):
    warmup_steps = _int(warmup_steps, f"{label}warmup_steps", 0)
    total_steps = _int(total_steps, f"{label}total_steps", 1)
    if warmup_steps > total_steps:
        raise ValueError(f"{label}warmup_steps: expected at most total_steps={total_steps}, "
                         f"got {warmup_steps}")
    return warmup_steps, total_steps


class CosineAnnealingLR(LRSchedule):
    """torch.optim.lr_scheduler.CosineAnnealingLR's values, in closed form::

        lr(t) = eta_min + (base_lr − eta_min) · (1 + cos(π t / T_max)) / 2

    periodic in ``t`` as torch's (back up to ``base_lr`` at ``t = 2 T_max``).
    torch computes the same curve recursively from the current lr; the two
    agree to rounding unless the lr is changed by hand in between.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = _int(T_max, "T_max", 1)
        self.eta_min = _nonneg(eta_min, "eta_min")
        super().__init__(optimizer)

    def lr_at(self, t):
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2

    def _config(self):
        return {"T_max": self.T_max, "eta_min": self.eta_min}

    def _check_config(self, c, label):
        return {"T_max": _int(c["T_max"], f"{label}T_max", 1),
                "eta_min": _nonneg(c["eta_min"], f"{label}eta_min")}


class WarmupLinear(LRSchedule):
    """Linear warm-up from 0 to ``base_lr`` over ``warmup_steps``, then linear
    decay to 0 at ``total_steps`` (and 0 after; Hugging Face's
    ``get_linear_schedule_with_warmup``)::

        factor(t) = t / warmup_steps                                    t < warmup_steps
                  = max(0, (total_steps − t) / (total_steps − warmup_steps))   otherwise

    The first step (``t = 0``) runs with ``lr = 0`` when ``warmup_steps > 0``.
    """

    def __init__(self, optimizer, warmup_steps, total_steps):
        self.warmup_steps, self.total_steps = _warmup_args(warmup_steps, total_steps)
        super().__init__(optimizer)

    def factor(self, t):
        w, n = self.warmup_steps, self.total_steps
        if t < w:
            return t / w
        return max(0.0, (n - t) / max(1, n - w))

    def _config(self):
        return {"warmup_steps": self.warmup_steps, "total_steps": self.total_steps}

    def _check_config(self, c, label):
        w, n = _warmup_args(c["warmup_steps"], c["total_steps"], label)
        return {"warmup_steps": w, "total_steps": n}


class WarmupCosine(LRSchedule):
    """Linear warm-up from 0 to ``base_lr`` over ``warmup_steps``, then a half
    cosine down to ``eta_min`` at ``total_steps`` (held there after)::

        lr(t) = base_lr · t / warmup_steps                                  t < warmup_steps
        lr(t) = eta_min + (base_lr − eta_min) · (1 + cos(π p)) / 2          otherwise,
                p = min(1, (t − warmup_steps) / (total_steps − warmup_steps))

    With ``warmup_steps=0`` these are :class:`CosineAnnealingLR`'s values
    with ``T_max=total_steps`` for ``t <= total_steps``.
    """

    def __init__(self, optimizer, warmup_steps, total_steps, eta_min=0.0):
        self.warmup_steps, self.total_steps = _warmup_args(warmup_steps, total_steps)
        self.eta_min = _nonneg(eta_min, "eta_min")
        super().__init__(optimizer)

    def lr_at(self, t):
        w, n = self.warmup_steps, self.total_steps
        if t < w:
            return self.base_lr * t / w
        p = min(1.0, (t - w) / (n - w)) if n > w else 1.0
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * p)) / 2

    def _config(self):
        return {"warmup_steps": self.warmup_steps, "total_steps": self.total_steps, "eta_min": self.eta_min}

    def _check_config(self, c, label):
        w, n = _warmup_args(c["warmup_steps"], c["total_steps"], label)
        return {"warmup_steps": w, "total_steps": n, "eta_min": _nonneg(c["eta_min"], f"{label}eta_min")}

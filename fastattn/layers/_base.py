"""The parameter container shared by the layers of issue 6.

A layer holds its parameters in ``self._params``, an ordered ``{name:
ndarray}`` dict; its constructor arguments (JSON-friendly) in
``self._config``.  This base class gives every layer ``state_dict()`` /
``load_state_dict()`` (names and shapes validated, arrays copied),
``get_config()`` / ``from_config()`` and ``parameters()``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Layer"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_dtype(dtype, name="dtype"):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected float32 or float64, got {dtype!r}") from None
    if dt not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64, got {dt}")
    return dt


def check_int(value, name, minimum=1):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


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


class Layer:
    """Base class: parameters dict, state dict, config."""

    _params: dict
    _config: dict

    # ---------------------------------------------------------------- params
    def parameters(self):
        """A new ``{name: ndarray}`` dict of this layer's own parameters (the live
        arrays, not copies; children's are in :meth:`state_dict`)."""
        return dict(self._params)

    def state_dict(self) -> dict:
        """A new ``{name: ndarray}`` dict of copies (torch's names where they exist)."""
        out = {}
        for name, a in self._params.items():
            out[name] = np.array(a, copy=True)
        for name, child in self._children().items():
            for k, a in child.state_dict().items():
                out[f"{name}.{k}"] = a
        return out

    def _children(self) -> dict:
        return {}

    def _expected_shapes(self) -> dict:
        shapes = {n: a.shape for n, a in self._params.items()}
        for name, child in self._children().items():
            for k, s in child._expected_shapes().items():
                shapes[f"{name}.{k}"] = s
        return shapes

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays from ``state_dict`` into the parameters (cast to the layer dtype).

        Names and shapes are validated first (nothing is changed on error):
        with ``strict`` missing and unexpected names raise ``ValueError``.
        Arrays may be NumPy arrays, nested lists or torch tensors.
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict: expected a mapping of name -> array, got {type(state_dict).__name__}")
        expected = self._expected_shapes()
        given = {str(k): state_dict[k] for k in state_dict.keys()}
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        if strict and (missing or unexpected):
            raise ValueError(
                f"state_dict: names do not match {type(self).__name__}: missing {missing}, "
                f"unexpected {unexpected}")
        arrays = {}
        for name, shape in expected.items():
            if name not in given:
                continue
            a = _to_numpy(given[name], name)
            if a.shape != tuple(shape):
                raise ValueError(
                    f"state_dict[{name!r}]: expected shape {tuple(shape)}, got {a.shape}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"state_dict[{name!r}]: contains NaN or infinite values")
            arrays[name] = a
        self._assign(arrays)
        return self

    def _assign(self, arrays):
        children = self._children()
        for name, a in arrays.items():
            head, _, rest = name.partition(".")
            if name in self._params:
                self._params[name] = np.array(a, dtype=self._params[name].dtype, copy=True)
            elif rest and head in children:
                children[head]._assign({rest: a})
        self._after_load()

    def _after_load(self):
        """Hook: refresh derived arrays after parameters change."""

    # ---------------------------------------------------------------- config
    def get_config(self) -> dict:
        """Constructor arguments (JSON-friendly); ``from_config(get_config())``
        builds a layer of the same architecture (parameters freshly initialised)."""
        return dict(self._config)

    @classmethod
    def from_config(cls, config):
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict, got {type(config).__name__}")
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._config.items())
        return f"{type(self).__name__}({args})"


def _to_numpy(x, name):
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except Exception as exc:
        raise TypeError(f"state_dict[{name!r}]: expected an array, got {type(x).__name__} ({exc})") from None
    if a.dtype.kind not in "fiu":
        raise TypeError(f"state_dict[{name!r}]: expected real numbers, got dtype {a.dtype}")
    return a

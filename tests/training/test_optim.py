"""fastattn.optim against torch.optim: SGD / Adam / AdamW parameter trajectories
(float64, 100 steps of random gradients, 1e-6 relative, every option that changes
the math), float32 parameters and state, state dicts mid-trajectory (also through
JSON), clip_grad_norm against torch.nn.utils.clip_grad_norm_, the schedules
against torch.optim.lr_scheduler's values, NaN / inf gradients, bad input (the
messages), and an optimizer built on a real fastattn.layers.Linear.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from fastattn import optim
from fastattn.functional import linear_backward
from fastattn.layers import Linear

torch = pytest.importorskip("torch")

SHAPES = {"w": (3, 4), "b": (5,), "s": ()}
STEPS = 100
RTOL = 1e-6


# ------------------------------------------------------------------ helpers
def _problem(seed=0, steps=STEPS, dtype=np.float64):
    """Initial parameters and a list of per-step gradients.  Each step's scale
    varies (log-normal) so that amsgrad's running max differs from v."""
    rng = np.random.default_rng(seed)
    init = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    grads = [{n: (np.exp(rng.normal()) * rng.standard_normal(s)).astype(dtype)
              for n, s in SHAPES.items()} for _ in range(steps)]
    return init, grads


def _triples(init):
    params = {n: a.copy() for n, a in init.items()}
    grads = {n: np.zeros_like(a) for n, a in init.items()}
    return params, grads, [(n, params[n], grads[n]) for n in init]


def _ours(cls, kw, init, grad_seq, schedule=None):
    """The trajectory [{name: param}] of fastattn.optim's ``cls(**kw)``."""
    params, grads, triples = _triples(init)
    opt = cls(triples, **kw)
    sched = schedule(opt) if schedule else None
    out = []
    for gs in grad_seq:
        for n, g in gs.items():
            grads[n][...] = g
        opt.step()
        if sched:
            sched.step()
        out.append({n: p.copy() for n, p in params.items()})
    return out


def _torch(cls, kw, init, grad_seq, schedule=None):
    ps = {n: torch.tensor(a.copy(), requires_grad=True) for n, a in init.items()}
    opt = cls(list(ps.values()), **kw)
    sched = schedule(opt) if schedule else None
    out = []
    for gs in grad_seq:
        for n, g in gs.items():
            ps[n].grad = torch.tensor(g.copy())
        opt.step()
        if sched:
            sched.step()
        out.append({n: p.detach().numpy().copy() for n, p in ps.items()})
    return out


def _assert_same_trajectory(ours, ref, rtol=RTOL, atol=1e-12):
    assert len(ours) == len(ref)
    for t, (a, b) in enumerate(zip(ours, ref)):
        for n in b:
            assert a[n].dtype == b[n].dtype, (t, n, a[n].dtype, b[n].dtype)
            np.testing.assert_allclose(a[n], b[n], rtol=rtol, atol=atol, equal_nan=True,
                                       err_msg=f"step {t + 1}, parameter {n!r}")


SGD_CASES = {
    "plain": dict(lr=0.05),
    "default_lr": dict(),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.5),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.05, weight_decay=0.1),
    "maximize": dict(lr=0.05, maximize=True),
    "momentum_wd_dampening_maximize": dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.05,
                                           maximize=True),
    "nesterov_wd_maximize": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True),
}
ADAM_CASES = {
    "defaults": dict(),
    "lr": dict(lr=0.05),
    "betas_eps": dict(lr=0.05, betas=(0.5, 0.8), eps=1e-3),
    "amsgrad": dict(lr=0.05, amsgrad=True),
    "weight_decay": dict(lr=0.05, weight_decay=0.1),
    "no_weight_decay": dict(lr=0.05, weight_decay=0.0),
    "maximize": dict(lr=0.05, maximize=True),
    "amsgrad_wd_maximize": dict(lr=0.05, amsgrad=True, weight_decay=0.1, maximize=True),
    "beta1_zero": dict(lr=0.05, betas=(0.0, 0.99)),
}
CASES = ([("SGD", k, kw) for k, kw in SGD_CASES.items()]
         + [(c, k, kw) for c in ("Adam", "AdamW") for k, kw in ADAM_CASES.items()])


# ------------------------------------------------------------------ trajectories
@pytest.mark.parametrize("name,case,kw", CASES, ids=[f"{c}-{k}" for c, k, _ in CASES])
def test_trajectory_matches_torch_float64(name, case, kw):
    init, grad_seq = _problem(seed=len(case))
    ours = _ours(getattr(optim, name), kw, init, grad_seq)
    ref = _torch(getattr(torch.optim, name), kw, init, grad_seq)
    # the parameters really moved (a no-op optimizer cannot pass)
    assert max(np.max(np.abs(ref[-1][n] - init[n])) for n in init) > 1e-2
    _assert_same_trajectory(ours, ref)


@pytest.mark.parametrize("name,base,options", [
    ("SGD", dict(lr=0.05, momentum=0.9),
     [dict(dampening=0.5), dict(nesterov=True), dict(weight_decay=0.1), dict(maximize=True)]),
    ("SGD", dict(lr=0.05), [dict(momentum=0.9)]),
    ("Adam", dict(lr=0.05), [dict(amsgrad=True), dict(weight_decay=0.1), dict(maximize=True),
                             dict(betas=(0.5, 0.8)), dict(eps=1e-3)]),
    ("AdamW", dict(lr=0.05), [dict(amsgrad=True), dict(weight_decay=0.0), dict(maximize=True)]),
])
def test_every_option_changes_the_trajectory(name, base, options):
    """The grid above is not vacuous: each option alone changes where torch goes
    (so matching torch with it checks its math)."""
    init, grad_seq = _problem(steps=30)
    ref = _torch(getattr(torch.optim, name), base, init, grad_seq)[-1]
    for opt in options:
        other = _torch(getattr(torch.optim, name), {**base, **opt}, init, grad_seq)[-1]
        assert any(not np.allclose(other[n], ref[n], rtol=1e-4, atol=1e-6) for n in ref), opt


def test_adamw_is_adam_with_decoupled_decay():
    init, grad_seq = _problem(steps=20)
    ours = _ours(optim.AdamW, dict(lr=0.05, weight_decay=0.2), init, grad_seq)
    ref = _torch(torch.optim.Adam, dict(lr=0.05, weight_decay=0.2, decoupled_weight_decay=True),
                 init, grad_seq)
    _assert_same_trajectory(ours, ref)


def test_defaults_are_torchs():
    p = np.zeros(2)
    triple = [("p", p, np.zeros(2))]
    assert optim.SGD(triple).hyperparameters == dict(
        lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    assert optim.Adam(triple).hyperparameters == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    assert optim.AdamW(triple).hyperparameters == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False)
    for name in ("SGD", "Adam", "AdamW"):
        d = torch.optim.__dict__[name]([torch.zeros(2, requires_grad=True)]).defaults
        ours = getattr(optim, name)(triple).hyperparameters
        assert {k: (tuple(d[k]) if k == "betas" else d[k]) for k in ours} == ours, name


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
                                     ("Adam", dict(lr=0.05, amsgrad=True, weight_decay=0.1)),
                                     ("AdamW", dict(lr=0.05))])
def test_float32_parameters_and_state_stay_float32(name, kw):
    init, grad_seq = _problem(steps=30, dtype=np.float32)
    params, grads, triples = _triples(init)
    opt = getattr(optim, name)(triples, **kw)
    for gs in grad_seq:
        for n, g in gs.items():
            grads[n][...] = g
        opt.step()
    assert all(p.dtype == np.float32 for p in params.values())
    arrays = [v for st in opt.state.values() for v in st.values() if isinstance(v, np.ndarray)]
    assert arrays and all(a.dtype == np.float32 for a in arrays)
    sd = opt.state_dict()
    assert all(v.dtype == np.float32 for st in sd["state"].values() for v in st.values()
               if isinstance(v, np.ndarray))
    # and torch's float32 run (its state is float32 too) ends at the same place
    ref = _torch(getattr(torch.optim, name), kw, init, grad_seq)[-1]
    for n in ref:
        assert ref[n].dtype == np.float32
        np.testing.assert_allclose(params[n], ref[n], rtol=2e-4, atol=2e-5)


def test_float32_layer_stays_float32():
    lin = Linear(4, 3, seed=0)  # float32
    opt = optim.Adam(lin, lr=0.01)
    for _, g in lin.named_grads():
        g[...] = 0.5
    opt.step()
    assert all(a.dtype == np.float32 for _, a in lin.named_parameters())
    assert all(v.dtype == np.float32 for st in opt.state.values() for v in st.values()
               if isinstance(v, np.ndarray))


# ------------------------------------------------------------------ state dicts
def _arrays_to_lists(sd):
    return {**sd, "state": {n: {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in st.items()}
                            for n, st in sd["state"].items()}}


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
                                     ("Adam", dict(lr=0.05, amsgrad=True, weight_decay=0.1)),
                                     ("AdamW", dict(lr=0.05, maximize=True))])
@pytest.mark.parametrize("via_json", [False, True])
def test_state_dict_round_trip_mid_trajectory(name, kw, via_json):
    init, grad_seq = _problem(steps=60)
    full = _ours(getattr(optim, name), kw, init, grad_seq)

    params, grads, triples = _triples(init)
    opt = getattr(optim, name)(triples, **kw)
    for gs in grad_seq[:30]:
        for n, g in gs.items():
            grads[n][...] = g
        opt.step()
    sd = opt.state_dict()
    before = json.dumps({k: v for k, v in sd.items() if k != "state"})  # JSON-friendly
    assert json.loads(before)["param_names"] == list(SHAPES)
    # the saved arrays are copies: stepping on does not change them
    saved = {n: {k: np.copy(v) for k, v in st.items()} for n, st in sd["state"].items()}
    for n, g in grad_seq[30].items():
        grads[n][...] = g
    opt.step()
    for n, st in saved.items():
        for k, v in st.items():
            np.testing.assert_array_equal(sd["state"][n][k], v)
    if via_json:
        sd = json.loads(json.dumps(_arrays_to_lists(sd)))

    # a new optimizer (other hyper-parameters, to be replaced) over copies of the step-30 parameters
    params2, grads2, triples2 = _triples(full[29])
    opt2 = getattr(optim, name)(triples2, lr=0.5)
    opt2.load_state_dict(sd)
    assert opt2.hyperparameters == getattr(optim, name)(triples2, **kw).hyperparameters
    for t in range(30, 60):
        for n, g in grad_seq[t].items():
            grads2[n][...] = g
        opt2.step()
        for n in SHAPES:  # exactly the uninterrupted trajectory
            np.testing.assert_array_equal(params2[n], full[t][n], err_msg=f"step {t + 1} {n}")


def test_state_dict_before_any_step_and_after_loading_it():
    init, grad_seq = _problem(steps=5)
    params, grads, triples = _triples(init)
    opt = optim.Adam(triples, lr=0.1)
    sd = opt.state_dict()
    assert sd["state"] == {} and sd["optimizer"] == "Adam"
    assert sd["hyperparameters"]["betas"] == [0.9, 0.999]
    opt.load_state_dict(sd)
    for gs in grad_seq:
        for n, g in gs.items():
            grads[n][...] = g
        opt.step()
    _assert_same_trajectory([params], [_ours(optim.Adam, dict(lr=0.1), init, grad_seq)[-1]], rtol=0, atol=0)


def test_load_state_dict_errors_list_what_differs_and_change_nothing():
    init, grad_seq = _problem(steps=3)
    params, grads, triples = _triples(init)
    opt = optim.Adam(triples, lr=0.1, amsgrad=True)
    for n, g in grad_seq[0].items():
        grads[n][...] = g
    opt.step()
    good = opt.state_dict()
    snapshot = opt.state_dict()

    renamed = {**good, "param_names": ["w", "bias", "s"],
               "state": {("bias" if n == "b" else n): st for n, st in good["state"].items()}}
    with pytest.raises(ValueError, match=r"parameter names differ: this optimizer's not in the state "
                                         r"dict \['b'\], the state dict's not in this optimizer \['bias'\]"):
        opt.load_state_dict(renamed)
    bad_shape = {**good, "state": {**good["state"], "w": {**good["state"]["w"], "exp_avg": np.zeros((4, 3))}}}
    with pytest.raises(ValueError, match=r"state\['w'\]\['exp_avg'\]: expected the parameter's shape "
                                         r"\(3, 4\), got \(4, 3\)"):
        opt.load_state_dict(bad_shape)
    # both kinds at once: one message lists every difference
    with pytest.raises(ValueError, match=r"names differ.*'bias'.*; state\['w'\]\['exp_avg'\].*\(4, 3\)"):
        opt.load_state_dict({**renamed, "state": {**renamed["state"], "w": bad_shape["state"]["w"]}})
    no_ams = {**good, "hyperparameters": {**good["hyperparameters"], "amsgrad": False}}
    with pytest.raises(ValueError, match=r"state\['b'\]: expected the keys \['exp_avg', 'exp_avg_sq', "
                                         r"'step'\], got \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]"):
        opt.load_state_dict(no_ams)
    with pytest.raises(ValueError, match=r"state_dict\['optimizer'\]: expected 'Adam', got 'AdamW'"):
        opt.load_state_dict({**good, "optimizer": "AdamW"})
    with pytest.raises(ValueError, match=r"state_dict\['hyperparameters'\]: expected the keys .*'lr'.*, got "):
        opt.load_state_dict({**good, "hyperparameters": {"lr": 0.1}})
    with pytest.raises(ValueError, match=r"state_dict\['hyperparameters'\]: betas\[1\]: expected a number in "
                                         r"\[0, 1\), got 1.5"):
        opt.load_state_dict({**good, "hyperparameters": {**good["hyperparameters"], "betas": [0.9, 1.5]}})
    with pytest.raises(ValueError, match=r"state\['s'\]\['step'\]: expected an integer >= 0, got int -1"):
        opt.load_state_dict({**good, "state": {**good["state"], "s": {**good["state"]["s"], "step": -1}}})
    with pytest.raises(ValueError, match=r"state_dict: expected the keys \['hyperparameters', 'optimizer', "
                                         r"'param_names', 'state'\], got \['optimizer', 'state'\]"):
        opt.load_state_dict({"optimizer": "Adam", "state": {}})
    with pytest.raises(TypeError, match=r"state_dict: expected a mapping"):
        opt.load_state_dict([1, 2])
    after = opt.state_dict()
    assert after["hyperparameters"] == snapshot["hyperparameters"]
    for n, st in snapshot["state"].items():
        for k, v in st.items():
            np.testing.assert_array_equal(after["state"][n][k], v)


# ------------------------------------------------------------------ a real layer
def _linear_problem(rng, steps):
    x = rng.standard_normal((steps, 8, 4))
    target = rng.standard_normal((steps, 8, 3))
    return x, target


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
                                     ("AdamW", dict(lr=0.01, amsgrad=True))])
def test_model_optimizer_trains_a_fastattn_linear_in_place(name, kw, rng):
    """A least-squares fit with fastattn.layers.Linear (gradients from
    functional.linear_backward added into layer.grads) against torch.nn.Linear."""
    steps = 25
    x, target = _linear_problem(rng, steps)
    lin = Linear(4, 3, seed=1, dtype=np.float64)
    arrays = {n: a for n, a in lin.named_parameters()}
    w0 = {n: a.copy() for n, a in arrays.items()}
    tlin = torch.nn.Linear(4, 3, dtype=torch.float64)
    with torch.no_grad():
        tlin.weight.copy_(torch.tensor(w0["weight"]))
        tlin.bias.copy_(torch.tensor(w0["bias"]))
    opt = getattr(optim, name)(lin, **kw)
    topt = getattr(torch.optim, name)(tlin.parameters(), **kw)
    for t in range(steps):
        opt.zero_grad()
        assert all(np.all(g == 0) for _, g in lin.named_grads())
        y = lin(x[t])
        _, dw, db = linear_backward(y - target[t], x[t], lin.parameters()["weight"], lin.parameters()["bias"])
        lin.grads["weight"] += dw
        lin.grads["bias"] += db
        opt.step()

        topt.zero_grad()
        (0.5 * ((tlin(torch.tensor(x[t])) - torch.tensor(target[t])) ** 2).sum()).backward()
        topt.step()
    # the very arrays the layer holds were updated (in place), and they match torch
    for n, a in lin.named_parameters():
        assert a is arrays[n]
        assert not np.allclose(a, w0[n])
    np.testing.assert_allclose(lin.parameters()["weight"], tlin.weight.detach().numpy(), rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(lin.parameters()["bias"], tlin.bias.detach().numpy(), rtol=RTOL, atol=1e-12)
    assert set(opt.state) == {"weight", "bias"}


def test_model_optimizer_follows_arrays_the_layer_replaced():
    """Layer.load_state_dict stores new arrays; the optimizer walks the model at every
    step, so it updates the new ones (and keeps its state by name)."""
    lin = Linear(2, 2, seed=0, dtype=np.float64)
    opt = optim.SGD(lin, lr=1.0)
    lin.load_state_dict({"weight": np.ones((2, 2)), "bias": np.zeros(2)})
    lin.grads["weight"][...] = 0.25
    opt.step()
    np.testing.assert_array_equal(lin.parameters()["weight"], np.full((2, 2), 0.75))
    np.testing.assert_array_equal(lin(np.array([1.0, 1.0])), [1.5, 1.5])


def test_gradients_are_read_at_step_time():
    p, g = np.ones(3), np.zeros(3)
    opt = optim.SGD([("p", p, g)], lr=0.5)
    g[...] = [1.0, 2.0, 4.0]  # written after the optimizer was made
    opt.step()
    np.testing.assert_array_equal(p, [0.5, 0.0, -1.0])
    opt.zero_grad()
    np.testing.assert_array_equal(g, 0)
    opt.step()
    np.testing.assert_array_equal(p, [0.5, 0.0, -1.0])


def test_lr_is_settable_and_used():
    p, g = np.ones(2), np.ones(2)
    opt = optim.SGD([("p", p, g)], lr=0.5)
    opt.lr = 0.25
    assert opt.lr == 0.25 and isinstance(opt.lr, float)
    opt.step()
    np.testing.assert_array_equal(p, [0.75, 0.75])
    with pytest.raises(ValueError, match=r"lr: expected a finite number >= 0, got -1"):
        opt.lr = -1
    with pytest.raises(TypeError, match=r"lr: expected a real number, got str '0.1'"):
        opt.lr = "0.1"
    assert opt.lr == 0.25


# ------------------------------------------------------------------ non-finite gradients
@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.1, momentum=0.9)), ("SGD", dict(lr=0.1)),
                                     ("Adam", dict(lr=0.1)), ("Adam", dict(lr=0.1, amsgrad=True)),
                                     ("AdamW", dict(lr=0.1))])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_propagates_like_torch(name, kw, bad):
    init, grad_seq = _problem(steps=6)
    grad_seq[2]["w"][1, 2] = bad  # not skipped: the entry goes NaN / inf as in torch
    ours = _ours(getattr(optim, name), kw, init, grad_seq)
    ref = _torch(getattr(torch.optim, name), kw, init, grad_seq)
    _assert_same_trajectory(ours, ref)
    assert not np.isfinite(ours[-1]["w"][1, 2])
    assert np.isfinite(ours[-1]["b"]).all()


# ------------------------------------------------------------------ clip_grad_norm
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, float("inf"), "inf"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, rng):
    grads = {n: np.asarray(rng.standard_normal(s) * 3) for n, s in SHAPES.items()}
    triples = [(n, np.zeros(s), grads[n]) for n, s in SHAPES.items()]
    before = {n: g.copy() for n, g in grads.items()}
    tps = []
    for n in SHAPES:
        tp = torch.zeros(SHAPES[n], dtype=torch.float64, requires_grad=True)
        tp.grad = torch.tensor(before[n])
        tps.append(tp)
    ttotal = torch.nn.utils.clip_grad_norm_(tps, max_norm, norm_type=norm_type)
    total = optim.clip_grad_norm(triples, max_norm, norm_type=norm_type)
    assert isinstance(total, float)
    np.testing.assert_allclose(total, ttotal.item(), rtol=1e-12)
    for n, tp in zip(SHAPES, tps):
        np.testing.assert_allclose(grads[n], tp.grad.numpy(), rtol=1e-12, atol=1e-15)
    if max_norm < total:  # clipped to max_norm
        new = optim.clip_grad_norm(triples, 1e9, norm_type=norm_type)
        np.testing.assert_allclose(new, max_norm * total / (total + 1e-6), rtol=1e-12)
    else:
        for n in SHAPES:
            np.testing.assert_array_equal(grads[n], before[n])


def test_clip_grad_norm_of_a_model_and_of_an_optimizer():
    lin = Linear(3, 2, seed=0, dtype=np.float64)
    lin.grads["weight"][...] = 3.0
    lin.grads["bias"][...] = 4.0
    total = optim.clip_grad_norm(lin, 1.0)
    assert total == pytest.approx(np.sqrt(6 * 9 + 2 * 16))
    np.testing.assert_allclose(np.sqrt(sum(np.sum(g ** 2) for _, g in lin.named_grads())), 1.0, rtol=1e-5)
    opt = optim.SGD(lin, lr=0.1)
    assert optim.clip_grad_norm(opt, 0.5) == pytest.approx(1.0 - 1e-6, rel=1e-6)
    assert optim.clip_grad_norm([], 1.0) == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_grad_norm_nonfinite(bad):
    g = np.array([1.0, bad, 2.0])
    trip = [("p", np.zeros(3), g)]
    with pytest.raises(RuntimeError, match=r"clip_grad_norm: the total norm of order 2.0 of the gradients "
                                           r"is non-finite \((nan|inf)\)"):
        optim.clip_grad_norm(trip, 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(g, [1.0, bad, 2.0])  # unchanged
    tp = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    tp.grad = torch.tensor(g.copy())
    ttotal = torch.nn.utils.clip_grad_norm_([tp], 1.0)
    total = optim.clip_grad_norm(trip, 1.0)
    np.testing.assert_array_equal(total, ttotal.item())
    np.testing.assert_array_equal(g, tp.grad.numpy())  # NaN everywhere / zeros and NaN, as torch


def test_clip_grad_norm_float32_gradients_stay_float32():
    g = np.full(4, 2.0, np.float32)
    total = optim.clip_grad_norm([("p", np.zeros(4, np.float32), g)], 1.0)
    assert total == pytest.approx(4.0) and g.dtype == np.float32
    np.testing.assert_allclose(g, 0.5, rtol=1e-6)


def test_clip_grad_norm_large_float32_is_the_float64_norm(rng):
    """Past one chunk the float32 2-norm is summed chunk by chunk in float64:
    the float64 norm of the float32 values, to rounding; NaN and inf in a
    late chunk still propagate."""
    g = (rng.standard_normal(3 * 65536 + 17) * 1e3).astype(np.float32)
    want = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    total = optim.clip_grad_norm([("p", np.zeros_like(g), g.copy())], 1e30)
    assert total == pytest.approx(want, rel=1e-13)
    for bad in (np.nan, np.inf):
        b = g.copy()
        b[-1] = bad
        got = optim.clip_grad_norm([("p", np.zeros_like(b), b)], 1e30)
        assert np.isnan(got) if np.isnan(bad) else got == np.inf
    from fastattn._optim_ops import sum_squares
    big = (rng.standard_normal(5 * 65536 + 3)).astype(np.float32)
    one, two = sum_squares(big, 1), sum_squares(big, 2)
    assert one == two                                          # the same bits on any thread count
    assert one == pytest.approx(float(np.sum(big.astype(np.float64) ** 2)), rel=1e-13)
    wide = np.zeros((big.size, 2), np.float32)
    wide[:, 0] = big
    assert sum_squares(wide[:, 0]) == pytest.approx(one, rel=1e-13)   # strided: the NumPy path


# ------------------------------------------------------------------ schedules
def _lrs(make_ours, make_torch, steps, base_lr=0.1):
    opt = optim.SGD([("p", np.zeros(1), np.zeros(1))], lr=base_lr)
    sched = make_ours(opt)
    ours = [opt.lr]
    assert sched.get_last_lr() == [opt.lr]
    for _ in range(steps):
        opt.step()
        sched.step()
        ours.append(opt.lr)
    topt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    tsched = make_torch(topt)
    ref = [topt.param_groups[0]["lr"]]
    for _ in range(steps):
        topt.step()
        tsched.step()
        ref.append(topt.param_groups[0]["lr"])
    return np.array(ours), np.array(ref)


@pytest.mark.parametrize("eta_min", [0.0, 0.01])
def test_cosine_annealing_matches_torch(eta_min):
    T = 10
    ours, ref = _lrs(lambda o: optim.CosineAnnealingLR(o, T, eta_min=eta_min),
                     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T, eta_min=eta_min), 3 * T + 3)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-15)
    assert ours[0] == 0.1 and ours[T] == pytest.approx(eta_min, abs=1e-15) and ours[2 * T] == pytest.approx(0.1)


def test_warmup_cosine_without_warmup_is_cosine_annealing_then_holds():
    T = 12
    ours, ref = _lrs(lambda o: optim.WarmupCosine(o, 0, T, eta_min=0.005),
                     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T, eta_min=0.005), 2 * T)
    np.testing.assert_allclose(ours[:T + 1], ref[:T + 1], rtol=1e-9, atol=1e-15)
    np.testing.assert_array_equal(ours[T:], 0.005)  # held at eta_min (torch's cosine turns back up)
    assert ref[2 * T] == pytest.approx(0.1)


def _torch_warmup_then(o, w, after):
    """torch: LambdaLR warm-up t / w, then ``after(o)`` from step w (SequentialLR)."""
    S = torch.optim.lr_scheduler
    return S.SequentialLR(o, [S.LambdaLR(o, lambda t: t / w), after(o)], milestones=[w])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_warmup_linear_matches_torch_warmup_then_linear_decay():
    w, n = 5, 20
    S = torch.optim.lr_scheduler
    ours, ref = _lrs(lambda o: optim.WarmupLinear(o, w, n),
                     lambda o: _torch_warmup_then(o, w, lambda o: S.LinearLR(o, 1.0, 0.0, total_iters=n - w)),
                     n + 5)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(ours[:w + 1], 0.1 * np.arange(w + 1) / w)
    assert ours[n] == 0 and ours[-1] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_warmup_cosine_matches_torch_warmup_then_cosine():
    w, n, eta_min = 4, 16, 0.002
    S = torch.optim.lr_scheduler
    ours, ref = _lrs(lambda o: optim.WarmupCosine(o, w, n, eta_min=eta_min),
                     lambda o: _torch_warmup_then(o, w, lambda o: S.CosineAnnealingLR(o, n - w, eta_min=eta_min)),
                     n)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-15)
    assert ours[0] == 0 and ours[w] == pytest.approx(0.1) and ours[n] == pytest.approx(eta_min)


def test_lambda_lr_matches_torch():
    ours, ref = _lrs(lambda o: optim.LambdaLR(o, lambda t: 0.9 ** t + 0.01 * (t % 3)),
                     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.9 ** t + 0.01 * (t % 3)), 30)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)


def test_schedule_drives_the_optimizer_like_torch():
    init, grad_seq = _problem(steps=40)
    kw = dict(lr=0.1, momentum=0.9)
    ours = _ours(optim.SGD, kw, init, grad_seq, schedule=lambda o: optim.CosineAnnealingLR(o, 15))
    ref = _torch(torch.optim.SGD, kw, init, grad_seq,
                 schedule=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 15))
    _assert_same_trajectory(ours, ref)
    # without the schedule the trajectory is elsewhere
    plain = _ours(optim.SGD, kw, init, grad_seq)[-1]
    assert not np.allclose(plain["w"], ours[-1]["w"], rtol=1e-3)


def test_schedule_state_dict_round_trip():
    opt = optim.Adam([("p", np.zeros(2), np.zeros(2))], lr=0.1)
    sched = optim.WarmupCosine(opt, 3, 10, eta_min=0.01)
    for _ in range(5):
        sched.step()
    sd = json.loads(json.dumps(sched.state_dict()))
    assert sd == {"schedule": "WarmupCosine", "last_epoch": 5, "base_lr": 0.1, "warmup_steps": 3,
                  "total_steps": 10, "eta_min": 0.01}
    opt2 = optim.Adam([("p", np.zeros(2), np.zeros(2))], lr=0.7)
    sched2 = optim.WarmupCosine(opt2, 1, 2).load_state_dict(sd)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.lr == opt.lr
    for _ in range(6):
        sched.step()
        sched2.step()
        assert opt2.lr == opt.lr
    with pytest.raises(ValueError, match=r"state_dict\['schedule'\]: expected 'CosineAnnealingLR', got 'WarmupCosine'"):
        optim.CosineAnnealingLR(opt2, 5).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"state_dict: warmup_steps: expected at most total_steps=10, got 11"):
        sched2.load_state_dict({**sd, "warmup_steps": 11})
    assert sched2.warmup_steps == 3


# ------------------------------------------------------------------ bad input
def _t():
    return [("p", np.zeros(3), np.zeros(3))]


@pytest.mark.parametrize("call,exc,match", [
    (lambda: optim.SGD(_t(), lr=-0.1), ValueError, r"lr: expected a finite number >= 0, got -0.1"),
    (lambda: optim.SGD(_t(), lr=float("nan")), ValueError, r"lr: expected a finite number >= 0, got nan"),
    (lambda: optim.SGD(_t(), lr="1e-3"), TypeError, r"lr: expected a real number, got str '1e-3'"),
    (lambda: optim.SGD(_t(), lr=True), TypeError, r"lr: expected a real number, got bool True"),
    (lambda: optim.SGD(_t(), momentum=-0.5), ValueError, r"momentum: expected a finite number >= 0, got -0.5"),
    (lambda: optim.SGD(_t(), weight_decay=-1), ValueError, r"weight_decay: expected a finite number >= 0, got -1"),
    (lambda: optim.SGD(_t(), dampening=float("inf")), ValueError, r"dampening: expected a finite number, got inf"),
    (lambda: optim.SGD(_t(), nesterov=True), ValueError,
     r"nesterov: expected momentum > 0 and dampening == 0 with nesterov=True, got momentum=0.0, dampening=0.0"),
    (lambda: optim.SGD(_t(), momentum=0.9, dampening=0.1, nesterov=True), ValueError,
     r"nesterov: expected momentum > 0 and dampening == 0 .* got momentum=0.9, dampening=0.1"),
    (lambda: optim.SGD(_t(), nesterov=1), TypeError, r"nesterov: expected a bool, got int 1"),
    (lambda: optim.SGD(_t(), maximize="no"), TypeError, r"maximize: expected a bool, got str 'no'"),
    (lambda: optim.Adam(_t(), betas=(1.0, 0.999)), ValueError, r"betas\[0\]: expected a number in \[0, 1\), got 1.0"),
    (lambda: optim.Adam(_t(), betas=(0.9, -0.1)), ValueError, r"betas\[1\]: expected a number in \[0, 1\), got -0.1"),
    (lambda: optim.AdamW(_t(), betas=0.9), TypeError, r"betas: expected a pair \(beta1, beta2\), got float 0.9"),
    (lambda: optim.Adam(_t(), betas=(0.9, "a")), TypeError, r"betas\[1\]: expected a real number, got str 'a'"),
    (lambda: optim.Adam(_t(), eps=-1e-8), ValueError, r"eps: expected a finite number >= 0, got -1e-08"),
    (lambda: optim.Adam(_t(), weight_decay=-0.1), ValueError, r"weight_decay: expected a finite number >= 0"),
    (lambda: optim.AdamW(_t(), lr=-1), ValueError, r"lr: expected a finite number >= 0, got -1"),
    (lambda: optim.Adam(_t(), amsgrad=None), TypeError, r"amsgrad: expected a bool, got NoneType None"),
    (lambda: optim.Adam(_t(), 1e-3, (0.9, 0.99), 1e-8, 0, False, True), TypeError, r"positional"),
    # params
    (lambda: optim.SGD([]), ValueError, r"params: expected at least one parameter, got none"),
    (lambda: optim.SGD(np.zeros(3)), TypeError,
     r"params: expected a model \(with named_parameters\(\) and named_grads\(\)\) or an iterable of "
     r"\(name, param, grad\) triples, got ndarray"),
    (lambda: optim.SGD([np.zeros(3)]), TypeError, r"params\[0\]: expected a \(name, param, grad\) triple, got array"),
    (lambda: optim.SGD([("p", [0.0], np.zeros(1))]), TypeError,
     r"params\['p'\]: expected the parameter as a NumPy array \(updated in place\), got list"),
    (lambda: optim.SGD([("p", np.zeros(2, int), np.zeros(2, int))]), TypeError,
     r"params\['p'\]: expected a floating-point parameter, got dtype int64"),
    (lambda: optim.SGD([("p", np.zeros(2), np.zeros(3))]), ValueError,
     r"params\['p'\]: expected a gradient of the parameter's shape \(2,\), got \(3,\)"),
    (lambda: optim.SGD([("p", np.zeros(2, np.float32), np.zeros(2))]), TypeError,
     r"params\['p'\]: expected a gradient of the parameter's dtype float32, got float64"),
    (lambda: optim.SGD([("p", np.zeros(2), np.zeros(2)), ("p", np.zeros(1), np.zeros(1))]), ValueError,
     r"params: two parameters are named 'p'"),
    (lambda: optim.SGD([(1, np.zeros(2), np.zeros(2))]), TypeError, r"params: expected parameter names \(str\), got int 1"),
    # clip_grad_norm
    (lambda: optim.clip_grad_norm(_t(), -1.0), ValueError, r"max_norm: expected a number >= 0, got -1.0"),
    (lambda: optim.clip_grad_norm(_t(), float("nan")), ValueError, r"max_norm: expected a number >= 0, got nan"),
    (lambda: optim.clip_grad_norm(_t(), 1.0, norm_type=0), ValueError, r"norm_type: expected a number > 0 or inf, got 0"),
    (lambda: optim.clip_grad_norm(_t(), 1.0, norm_type=-float("inf")), ValueError, r"norm_type: expected a number > 0 or inf"),
    (lambda: optim.clip_grad_norm(_t(), 1.0, norm_type="two"), TypeError, r"norm_type: expected a real number, got str 'two'"),
    (lambda: optim.clip_grad_norm(_t(), 1.0, error_if_nonfinite=1), TypeError, r"error_if_nonfinite: expected a bool"),
    (lambda: optim.clip_grad_norm("grads", 1.0), TypeError, r"params_or_model: expected a model"),
    # schedules
    (lambda: optim.CosineAnnealingLR(optim.SGD(_t()), 0), ValueError, r"T_max: expected an integer >= 1, got 0"),
    (lambda: optim.CosineAnnealingLR(optim.SGD(_t()), 10.0), TypeError, r"T_max: expected an integer, got float 10.0"),
    (lambda: optim.CosineAnnealingLR(optim.SGD(_t()), 10, eta_min=-1), ValueError, r"eta_min: expected a finite number >= 0"),
    (lambda: optim.WarmupLinear(optim.SGD(_t()), 11, 10), ValueError,
     r"warmup_steps: expected at most total_steps=10, got 11"),
    (lambda: optim.WarmupCosine(optim.SGD(_t()), -1, 10), ValueError, r"warmup_steps: expected an integer >= 0, got -1"),
    (lambda: optim.WarmupLinear(optim.SGD(_t()), 0, 0), ValueError, r"total_steps: expected an integer >= 1, got 0"),
    (lambda: optim.WarmupLinear(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 1, 5), TypeError,
     r"optimizer: expected a fastattn.optim optimizer \(with a float lr\), got SGD"),
    (lambda: optim.LambdaLR(optim.SGD(_t()), 0.5), TypeError, r"lr_lambda: expected a callable t -> factor, got float 0.5"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_read_only_parameter_refused_before_anything_changes():
    a, b = np.ones(2), np.ones(2)
    b.flags.writeable = False
    opt = optim.SGD([("a", a, np.ones(2)), ("b", b, np.ones(2))], lr=0.5)
    with pytest.raises(ValueError, match=r"params\['b'\]: the parameter array is read-only"):
        opt.step()
    np.testing.assert_array_equal(a, 1.0)  # not updated either
    assert opt.state == {}


def test_model_whose_grads_do_not_match_its_parameters():
    class Odd:
        def named_parameters(self):
            yield "w", np.zeros(2)

        def named_grads(self):
            yield "v", np.zeros(2)

    with pytest.raises(ValueError, match=r"params: named_grads\(\) does not match named_parameters\(\) .*"
                                         r"no gradient for \['w'\], gradients without a parameter \['v'\]"):
        optim.Adam(Odd())


def test_lambda_lr_whose_factor_is_negative():
    opt = optim.SGD(_t(), lr=0.1)
    with pytest.raises(ValueError, match=r"lr: expected a finite number >= 0, got -0.1"):
        optim.LambdaLR(opt, lambda t: -1.0)

"""Quick checks of the benchmark helpers in fastattn._bench (not of fastattn itself)."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

import fastattn
from fastattn import _bench
from support import REPO_ROOT

REPO = REPO_ROOT


def _ref(q, k, v, causal):
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    return _bench.numpy_sdpa(q64, k64, v64, _bench.causal_mask(q.shape[-2], k.shape[-2]) if causal else None)


def test_attention_flops():
    assert _bench.attention_flops((2, 3, 5, 7)) == 4 * 2 * 3 * 25 * 7
    assert _bench.attention_flops((2, 3, 5, 7), causal=True) == 2 * 2 * 3 * 25 * 7


def test_suite_cases():
    names = {c.name for c in _bench.SUITE_CASES}
    assert len(names) == len(_bench.SUITE_CASES) == 22
    assert "1x8x4096x64-float32-causal" in names and "1x8x2048x64-float64" in names


def test_time_samples():
    s = _bench.time_samples(lambda: None, budget=0.01, min_repeats=5)
    assert len(s) >= 5 and all(x >= 0 for x in s)


def test_onnx_model_uses_opset23_attention():
    onnx = pytest.importorskip("onnx")
    schema = onnx.defs.get_schema("Attention", 23)
    assert "is_causal" in schema.attributes
    m = onnx.load_from_string(_bench.ort_attention_model((1, 2, 8, 4), np.float32, True))
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 23)]
    (node,) = m.graph.node
    assert node.op_type == "Attention" and node.domain == ""
    assert {a.name: a.i for a in node.attribute} == {"is_causal": 1}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_ort_attention_matches_numpy(dtype, causal):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    if _bench.ort_graph_ops(dtype) is None:
        pytest.skip(f"onnxruntime cannot run Attention in {dtype}")
    q, k, v = _bench.random_qkv((2, 3, 17, 8), np.dtype(dtype), seed=3)
    run = _bench.OrtAttention(q, k, v, causal, n_threads=2)
    run.out[...] = np.nan
    out = run()
    assert out is run.out  # written in place into the bound, preallocated output
    np.testing.assert_allclose(out, _ref(q, k, v, causal), rtol=0,
                               atol=_bench.check_tolerance("ort", dtype) * 10)
    assert run() is out  # and again: the timed call is only run_with_iobinding


def test_ort_symbolic_session_and_ort_allocated_output():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    q, k, v = _bench.random_qkv((1, 2, 9, 4), np.float32, seed=4)
    run = _bench.OrtAttention(q, k, v, False, 1, symbolic=True, preallocate=False)
    run()
    np.testing.assert_allclose(run.result(), _ref(q, k, v, False), atol=1e-5)


def test_blas_threads_set_and_restored():
    libs = _bench.openblas_libraries()
    if not libs:
        pytest.skip("no OpenBLAS found")
    before = {t: lib.get_threads() for t, lib in libs.items()}
    with _bench.blas_threads(1, which=tuple(libs)) as got:
        assert set(got.values()) == {1}
    assert {t: lib.get_threads() for t, lib in libs.items()} == before


def test_gemm_callable():
    run, flops = _bench.gemm_callable("float32", n=64)
    c = run()
    assert flops == 2 * 64 ** 3 and c.flags.f_contiguous
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-3)


def test_measure_case_and_report():
    case = _bench.Case((1, 2, 16, 8), "float32", True)
    row = _bench.measure_case(case, 1, budget=0.005, impls=("fastattn", "numpy"))
    assert row["bad"] == [] and row["times"]["fastattn"] > 0
    lines = _bench.format_report([row], {"float32": 100.0})
    assert lines[1].split()[:3] == ["1x2x16x8", "yes", "float32"]
    assert " ok" in lines[1] and "MISMATCH" not in lines[1]


def test_report_from_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(REPO, "benchmarks", "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    benches = [{"extra_info": {"kind": "gemm", "dtype": "float32", "flops": 2e9}, "stats": {"median": 0.01}},
               {"extra_info": {"kind": "fma_peak", "flops": 4e9}, "stats": {"median": 0.01}}]
    for impl, t in (("fastattn", 1e-3), ("torch", 2e-3), ("ort", 4e-3), ("numpy", 5e-3)):
        benches.append({"extra_info": {"kind": "sdpa", "shape": [1, 8, 512, 64], "dtype": "float32",
                                       "causal": False, "impl": impl, "threads": 2},
                        "stats": {"median": t}})
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"benchmarks": benches}))
    assert report.main(["--json", str(path)]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("1x8x512x64")]
    cells = row[0].split()
    assert cells[3:7] == ["1,000", "2,000", "4,000", "5,000"]
    assert cells[7] == "0.50x"  # fastattn / faster peer (torch)
    gf = _bench.attention_flops((1, 8, 512, 64)) / 1e-3 / 1e9
    assert cells[8] == f"{gf:.1f}" and cells[9] == f"{100 * gf / 200:.0f}%"
    assert cells[10] == f"{100 * gf / 400:.0f}%"  # the FMA peak: 4e9 flops in 10 ms
    # without a peak in the run, the column is empty
    path.write_text(json.dumps({"benchmarks": [b for b in benches
                                               if b["extra_info"].get("kind") != "fma_peak"]}))
    assert report.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FMA peak: not in this run" in out
    row = [ln for ln in out.splitlines() if ln.strip().startswith("1x8x512x64")]
    assert row[0].split()[10] == "-"


def test_fma_probe_counts_its_flops():
    """The peak probe does 64 tasks x iters x 12 FMAs of 8 lanes (AVX2) or 16
    (AVX-512), 2 flops each, on any thread count, and nothing without SIMD code."""
    from support import SIMD_CAPABLE, _restore_simd
    from fastattn import _kernels
    if not _kernels.simd_active():
        assert _kernels.fma_probe(10, 2) == 0
        return
    per_iter = {"avx2": 192, "avx512": 384}[fastattn.simd_isa()]
    for nt in (1, 2, 3):
        assert _kernels.fma_probe(10, nt) == 64 * 10 * per_iter
    assert _kernels.fma_probe(0, 2) == 0
    run, flops = _bench.fma_peak_callable(2)
    assert flops == 64 * _bench.PEAK_ITERS * per_iter and run() == flops
    assert SIMD_CAPABLE
    try:
        _kernels.set_simd_max_level(1)
        assert _kernels.fma_probe(10, 1) == 64 * 10 * 192
        _restore_simd()
        _kernels.set_simd_disabled(True)
        assert _kernels.fma_probe(10, 2) == 0
        assert _bench.fma_peak_gflops(2) is None
    finally:
        _restore_simd()
    assert _bench.add_peak({"float32": 1.0}, 100.0) == {"float32": 1.0, "peak:float32": 100.0,
                                                       "peak:float64": 50.0}


def test_memory_probe_in_child():
    r = _bench.memory_benchmark("fastattn", (1, 2, 64, 16), "float32")
    assert r["hwm_kb"] >= r["rss_before_kb"] > 0
    assert r["out_bytes"] == 2 * 64 * 16 * 4


def test_training_memory_script_measures_a_step():
    """benchmarks/memory_training.py: one fresh process per library; its
    numbers are positive and the fastattn row is there."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "benchmarks", "memory_training.py")
    out = subprocess.run([sys.executable, script, "--case", "seq2seq"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] == ["seq2seq"]]
    assert rows and rows[0][1] == "fastattn"
    for r in rows:
        before, cached, extra, total = map(float, r[2:6])
        assert before > 0 and 0 <= cached <= before and total >= before and extra >= 0
        assert abs(extra - (total - (before - cached))) < 0.2   # the cache counted as the step's

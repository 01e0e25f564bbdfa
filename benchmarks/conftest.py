"""pytest-benchmark configuration for fastattn.

Run the suite and print the one-table report (fastattn / torch / ort /
numpy medians, fastattn ÷ fastest peer, GFLOP/s and % of the same run's
sgemm/dgemm)::

    pytest benchmarks/ --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py --json bench.json

``python benchmarks/report.py`` without ``--json`` (and ``python -m fastattn
bench``) prints the same table from its own timing loop.  The default
``pytest`` collects only ``tests/`` (``testpaths`` in pyproject).  The other
scripts here are run directly: ``python benchmarks/memory.py`` (peak extra
RSS of one call), ``python benchmarks/memory_training.py`` (peak memory of
one training step, fastattn and torch), ``python benchmarks/busy.py`` (a competing process on
one core) and ``python benchmarks/idle.py`` (CPU burned after a call).
"""
import pytest

import fastattn
from fastattn import _bench, _threads


def _torch_line(n_threads):
    torch = _bench.load_torch(n_threads)  # the test module makes the same call
    if torch is None:
        return "torch: not importable, its benchmarks are skipped"
    return f"torch {torch.__version__}: {torch.get_num_threads()} intra-op thread(s), inference_mode"


def _ort_line(n_threads):
    ort = _bench.load_ort()
    if ort is None:
        return "onnxruntime/onnx: not importable, its benchmarks are skipped"
    return (f"onnxruntime {ort.__version__}: opset-{_bench.ORT_OPSET} Attention, CPU EP, "
            f"intra_op={n_threads}, inter_op=1, IOBinding; float32: "
            f"{_bench.ort_describe('float32')}; float64: {_bench.ort_describe('float64')}")


def _blas_line():
    libs = _bench.openblas_libraries()
    return ("OpenBLAS (threadpoolctl not used; C API): "
            + ", ".join(f"{tag} {lib.get_threads()} thread(s) by default"
                        for tag, lib in libs.items())
            + "; numpy baseline and sgemm/dgemm groups held at fastattn's thread count")


def pytest_report_header(config):
    n = fastattn.get_num_threads()
    return [
        f"fastattn {fastattn.__version__}: {n} thread(s), "
        f"SIMD (AVX2/FMA) {'active' if fastattn.simd_active() else 'inactive'}, "
        f"BLAS {_threads.blas_hook_library() or 'unknown'}",
        _torch_line(n),
        _ort_line(n),
        _blas_line(),
    ]


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastattn"] = {
        "version": fastattn.__version__,
        "threads": fastattn.get_num_threads(),
        "simd_active": fastattn.simd_active(),
    }
    ort = _bench.load_ort()
    if ort is not None:
        machine_info["onnxruntime"] = {
            "version": ort.__version__,
            "float32": _bench.ort_describe("float32"),
            "float64": _bench.ort_describe("float64"),
        }


@pytest.fixture
def quiesce_after(benchmark):
    """Record how busy *other* processes kept the machine during the benchmark
    (``extra_info["other_cores"]``; report.py flags rows above 0.15), then
    rest: OpenBLAS, onnxruntime and torch workers spin for up to ~110 ms after
    a call (benchmarks/idle.py) and would slow down whatever is timed next on
    this 2-core machine."""
    load = _bench.LoadMonitor()
    yield
    benchmark.extra_info["other_cores"] = round(load.other_cores() or 0.0, 3)
    _bench.quiesce()

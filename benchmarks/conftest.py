"""pytest-benchmark configuration for fastattn.

Run with ``pytest benchmarks/ --benchmark-only``; the default
``pytest`` collects only ``tests/`` (``testpaths`` in pyproject).
"""
import fastattn
from fastattn import _bench, _threads


def _torch_line(n_threads):
    torch = _bench.load_torch(n_threads)  # the test module makes the same call
    if torch is None:
        return "torch: not importable, its benchmarks are skipped"
    return f"torch {torch.__version__}: {torch.get_num_threads()} intra-op thread(s), inference_mode"


def pytest_report_header(config):
    n = fastattn.get_num_threads()
    return [
        f"fastattn {fastattn.__version__}: {n} thread(s), "
        f"SIMD (AVX2/FMA) {'active' if fastattn.simd_active() else 'inactive'}, "
        f"BLAS {_threads.blas_hook_library() or 'unknown'}",
        _torch_line(n),
    ]


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastattn"] = {
        "version": fastattn.__version__,
        "threads": fastattn.get_num_threads(),
        "simd_active": fastattn.simd_active(),
    }

"""Type stubs for the compiled binding (fastattn/_kernels.pyx).

Private: fastattn.functional is the only caller; it validates every argument.
"""
import numpy as np

MASK_NONE: int
MASK_BOOL: int
MASK_ADD: int
PATH_SINGLE: int
PATH_STREAM: int
MAX_BATCH_DIMS: int

def set_blas_threads_hook(address: int) -> None: ...
def pool_workers() -> int: ...
def pool_last_helped() -> int: ...
def simd_compiled() -> bool: ...
def simd_active() -> bool: ...
def set_simd_disabled(disable: bool) -> None: ...
def simd_level() -> int: ...
def set_simd_max_level(level: int) -> None: ...
def simd_max_level() -> int: ...
def sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    mask_kind: int,
    out: np.ndarray,
    weights: np.ndarray | None,
    batch_shape: tuple[int, ...],
    causal: bool,
    causal_offset: int,
    scale: float,
    block_q: int,
    block_k: int,
    path: int,
    direct: bool,
    n_threads: int,
    lse: np.ndarray | None = None,
) -> int: ...
def exp(x: np.ndarray, y: np.ndarray) -> None: ...
def fma_probe(iters: int, n_threads: int) -> float: ...
def expsub(x: np.ndarray, m: float, masked: bool = False) -> float: ...
def clear_fast_plans() -> None: ...
def sdpa_plain(
    query: object,
    key: object,
    value: object,
    causal: bool,
    bottom_right: bool,
    scale: float | None,
    n_threads: int,
    planner: object,
) -> np.ndarray | int | None: ...

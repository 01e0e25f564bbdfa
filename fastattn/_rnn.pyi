"""Type stubs for the compiled RNN kernels (fastattn/_rnn.pyx).

Private: fastattn._recurrence (functional.rnn_scan / rnn_cell) is the only
caller; it validates every argument.
"""
import numpy as np

CELLS: dict[str, int]

def set_runtime(pool_run: int, hold_enter: int, hold_exit: int, simd_active: int = 0) -> None: ...
def runtime_installed() -> bool: ...
def simd_active() -> bool: ...
def set_tuning(min_block_rows: int | None = ..., blocks_per_thread: int | None = ...,
               small_m: int | None = ..., split: bool | None = ...,
               chunk_flops: float | None = ..., bwd_blocks: int | None = ...,
               packed: bool | None = ...) -> dict: ...
def scan(cell: int, xw: np.ndarray, whh: np.ndarray, bhh: np.ndarray | None, h: np.ndarray,
         c: np.ndarray | None, out: np.ndarray | None, lengths: np.ndarray | None,
         reverse: bool, n_threads: int, gates: np.ndarray | None = ...) -> int: ...
def cell(cell: int, x: np.ndarray, wih: np.ndarray, bih: np.ndarray | None, whh: np.ndarray,
         bhh: np.ndarray | None, h0: np.ndarray, c0: np.ndarray | None, h1: np.ndarray,
         c1: np.ndarray | None, n_threads: int) -> int: ...
def backward_blocks(B: int, H: int, G: int) -> tuple[int, int]: ...
def scan_backward(cell: int, xw: np.ndarray, gh: np.ndarray, bhh: np.ndarray | None,
                  hprev: np.ndarray | None, c0: np.ndarray | None, go: np.ndarray | None,
                  whh: np.ndarray, lengths: np.ndarray | None, reverse: bool, dxw: np.ndarray,
                  dgh: np.ndarray | None, dh: np.ndarray, dc: np.ndarray | None,
                  db: np.ndarray | None, n_threads: int) -> int: ...

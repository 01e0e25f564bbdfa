"""Type stubs for the compiled projection kernels (fastattn/_proj.pyx).

Private: fastattn._multihead is the only caller; it validates every argument.
"""
import numpy as np

def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray) -> None: ...

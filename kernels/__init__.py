"""LSTMem scan and decode-step operators (torch + Triton; no transformers import).

>>> import torch
>>> from lstmem_kernels import lstmem_scan
>>> B, T, H, R = 1, 5, 4, 8
>>> q, k, w = (torch.randn(B, T, H, R) for _ in range(3))
>>> f, o = (torch.rand(B, T, H, R) for _ in range(2))
>>> read, hidden, cell_T, hidden_T = lstmem_scan(q, k, w, f, o)
>>> hidden.shape
torch.Size([1, 5, 4, 8, 8])
"""

from .naive import scan_naive, step_naive
from .ops import (
    BACKENDS,
    fused_decode_step_applies,
    lstmem_decode_step,
    lstmem_scan,
    lstmem_step,
    triton_available,
)
from .parallel import scan_parallel, step_torch

__all__ = [
    "BACKENDS",
    "fused_decode_step_applies",
    "lstmem_decode_step",
    "lstmem_scan",
    "lstmem_step",
    "scan_naive",
    "scan_parallel",
    "step_naive",
    "step_torch",
    "triton_available",
]

"""LSTMem scan and decode-step operators (torch + Triton; no transformers import), as two op
families, one folder each: :mod:`.scan` (a block) and :mod:`.step` (one token), each with its
reference, PyTorch and Triton members behind one signature; :mod:`.backend` picks the member.

>>> import torch
>>> from lstmem_kernels import lstmem_scan
>>> B, T, H, R = 1, 5, 4, 8
>>> q, k, w = (torch.randn(B, T, H, R) for _ in range(3))
>>> f, o = (torch.rand(B, T, H, R) for _ in range(2))
>>> read, hidden, cell_T, hidden_T = lstmem_scan(q, k, w, f, o)
>>> hidden.shape
torch.Size([1, 5, 4, 8, 8])
"""

from .backend import BACKENDS, resolve_backend, triton_available
from .scan import lstmem_scan, scan_naive, scan_parallel
from .step import DecodeSamples, decode_backend, lstmem_decode_step, lstmem_step, step_naive, step_torch

__all__ = [
    "BACKENDS",
    "DecodeSamples",
    "decode_backend",
    "lstmem_decode_step",
    "lstmem_scan",
    "lstmem_step",
    "resolve_backend",
    "scan_naive",
    "scan_parallel",
    "step_naive",
    "step_torch",
    "triton_available",
]

"""The dtypes the PyTorch members compute in: float64 stays float64 (the references' precision),
everything else runs in float32."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it already has that dtype (the decode hot path)."""
    return t if t.dtype == dtype else t.to(dtype)

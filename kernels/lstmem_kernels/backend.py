"""Which member of an op family runs: ``backend="auto"`` picks the Triton member for CUDA tensors
(when Triton is installed) and the vectorised PyTorch member otherwise; ``"naive"``, ``"torch"`` and
``"triton"`` force one. The one place that rule is written (:func:`resolve_backend`)."""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "naive", "torch", "triton"]
BACKENDS = ("auto", "naive", "torch", "triton")


def triton_available() -> bool:
    """Whether the Triton members can run their host code: Triton is installed and the helpers they
    share import (:mod:`.triton_common`, which imports it)."""
    try:
        from . import triton_common  # noqa: F401  (importable means available)
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: Backend, tensor: torch.Tensor) -> str:
    """The member that runs for ``backend`` on ``tensor``'s device: ``"auto"`` is Triton for CUDA
    tensors when Triton is installed, else the vectorised PyTorch member; the others name
    themselves. The one place the ``"auto"`` rule is written."""
    check_backend(backend)
    if backend != "auto":
        return backend
    return "triton" if tensor.is_cuda and triton_available() else "torch"

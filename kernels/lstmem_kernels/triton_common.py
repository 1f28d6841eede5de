"""What the Triton kernels' host code shares: whether the interpreter runs, the launch guard and
tile configuration, and the input checks that raise ``ValueError`` saying what was expected."""

from __future__ import annotations

import contextlib

import torch
import triton


@triton.jit
def _probe():  # a kernel only to ask what ``triton.jit`` makes: a JITFunction, or an interpreted one
    pass


#: whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton loaded)
INTERPRETED = not isinstance(_probe, triton.JITFunction)
#: the storage dtypes the kernels take; they compute in float32
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tile_config(R: int) -> dict:
    """``BLOCK_R`` and ``num_warps`` for an ``R x R`` register tile."""
    block_r = triton.next_power_of_2(R)
    return {"BLOCK_R": block_r, "num_warps": max(1, min(8, block_r * block_r // 256))}


def device_guard(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")


def check_runtime(device: torch.device) -> None:
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got tensors on {device}; to run on CPU set "
            "TRITON_INTERPRET=1 before importing triton"
        )


def check_float(name: str, x: torch.Tensor, dtype: torch.dtype | None) -> None:
    if dtype is None:
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {x.dtype}")
    elif x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {dtype} (the dtype of q)")


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")


def validate(
    inputs: dict[str, torch.Tensor | None],
    vec_shape: tuple[int, ...],
    mat_shape: tuple[int, ...],
    state_shape: tuple[int, ...],
    valid_shape: tuple[int, ...],
    state_names: tuple[str, ...],
) -> None:
    """Check shapes, dtypes and devices of the scan / step inputs, raising ``ValueError``."""
    q = inputs["q"]
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.shape[-1] < 1:
        raise ValueError("the state rank R (last dimension of q) must be at least 1")
    check_runtime(q.device)
    for name, x in inputs.items():
        if x is None:
            continue
        check_device(name, x, q.device)
        if name in ("k", "w", "f", "o"):
            check_shape(name, x, vec_shape)
            check_float(name, x, q.dtype)
        elif name == "depth":
            check_shape(name, x, mat_shape)
            check_float(name, x, q.dtype)
        elif name == "valid":
            check_shape(name, x, valid_shape)
            if x.dtype != torch.bool:
                raise ValueError(f"valid must be a bool tensor, got {x.dtype}")
        elif name in state_names:
            check_shape(name, x, state_shape)
            check_float(name, x, None)


def contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()

"""The step family: one token of the recurrence (:func:`lstmem_step`: :mod:`.naive`, the
specification; :mod:`.pytorch`, the CPU default; the Triton step in :mod:`.fused`), and a memory
layer's whole decode step (:func:`lstmem_decode_step`, also on a serving engine's state slots:
:mod:`.decode_naive`, the float64 specification; :mod:`.decode_torch`, PyTorch operators; one Triton
launch in :mod:`.fused`), with :func:`decode_backend` saying which member a layer steps on."""

from .decode_naive import decode_step_naive
from .decode_torch import DecodeSamples, StepMaps, decode_step_torch
from .naive import step_naive
from .ops import decode_backend, lstmem_decode_step, lstmem_step
from .pytorch import step_torch

__all__ = [
    "DecodeSamples",
    "StepMaps",
    "decode_backend",
    "decode_step_naive",
    "decode_step_torch",
    "lstmem_decode_step",
    "lstmem_step",
    "step_naive",
    "step_torch",
]

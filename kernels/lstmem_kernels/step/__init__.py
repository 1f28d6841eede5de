"""The step family: one token of the recurrence (:func:`lstmem_step`: :mod:`.naive`, the
specification; :mod:`.pytorch`, the CPU default; the Triton step in :mod:`.fused`), and a memory
layer's whole decode step in one Triton launch (:func:`lstmem_decode_step`, also on a serving
engine's state slots), with :func:`fused_decode_step_applies` saying when a layer hands its step to
it."""

from .naive import step_naive
from .ops import fused_decode_step_applies, lstmem_decode_step, lstmem_step
from .pytorch import step_torch

__all__ = ["fused_decode_step_applies", "lstmem_decode_step", "lstmem_step", "step_naive", "step_torch"]

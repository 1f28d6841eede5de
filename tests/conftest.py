"""Run Triton kernels under the interpreter (CPU tensors) when no GPU is available."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

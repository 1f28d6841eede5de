"""lstmem-peft: LSTMem online memory for frozen causal language models, as a PEFT adapter.

Importing the package imports its public names and registers the ``LSTMEM`` method in PEFT's tables
(:func:`register_with_peft`), so ``get_peft_model`` and ``PeftModel.from_pretrained`` work with no
other set-up. The import costs about what ``import peft`` costs. The ``lstmem`` command answers
``--version`` and ``--help`` without importing this package (:mod:`lstmem_cli`).
"""

from __future__ import annotations

from peft import mapping as _peft_mapping

from lstmem_peft.memory.cache import LayerState, MemoryCache, MemoryLayout
from lstmem_peft.memory.engine import MemoryPass
from lstmem_peft.memory.feedback import block_feedback, feedback_gradients, sample_feedback_positions
from lstmem_peft.memory.layer import LSTMemLayer
from lstmem_peft.training.card import push_to_hub, write_model_card
from lstmem_peft.tuner.backbones import resolve_backbone, resolve_model
from lstmem_peft.tuner.config import LSTMemConfig, LSTMemPeftType, PeftLoaderConfig
from lstmem_peft.tuner.context import traceable_memory
from lstmem_peft.tuner.history import find_memory, generate, memory_layers, memory_layout, write_history
from lstmem_peft.tuner.layer import LSTMemOutputLayer, LSTMemQueryLayer
from lstmem_peft.tuner.model import LSTMemModel
from lstmem_peft.utils.version import __version__

__all__ = [
    "__version__",
    "LSTMemConfig",
    "LSTMemLayer",
    "LSTMemModel",
    "LSTMemOutputLayer",
    "LSTMemQueryLayer",
    "LayerState",
    "MemoryCache",
    "MemoryLayout",
    "MemoryPass",
    "block_feedback",
    "feedback_gradients",
    "find_memory",
    "generate",
    "memory_layers",
    "memory_layout",
    "push_to_hub",
    "resolve_backbone",
    "resolve_model",
    "sample_feedback_positions",
    "traceable_memory",
    "write_history",
    "write_model_card",
]


def register_with_peft() -> None:
    """Add LSTMem to PEFT's method tables (PEFT's own registry only accepts its closed enum). Run by
    ``import lstmem_peft``; running it again changes nothing."""
    peft_type = LSTMemPeftType.LSTMEM
    # PEFT's loaders read an adapter's config through this entry; calling it builds an LSTMemConfig
    _peft_mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = PeftLoaderConfig
    _peft_mapping.PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = LSTMemModel
    _peft_mapping.PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = LSTMemModel.prefix


register_with_peft()

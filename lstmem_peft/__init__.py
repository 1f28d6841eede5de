"""lstmem-peft: LSTMem online memory for frozen causal language models, as a PEFT adapter."""

from .cache import LayerState, MemoryCache, MemoryLayout
from .engine import MemoryPass
from .feedback import block_feedback, feedback_gradients, sample_feedback_positions
from .memory import LSTMemLayer

__version__ = "0.1.0"

__all__ = [
    "LSTMemLayer",
    "LayerState",
    "MemoryCache",
    "MemoryLayout",
    "MemoryPass",
    "block_feedback",
    "feedback_gradients",
    "sample_feedback_positions",
]

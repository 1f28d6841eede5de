"""Serving engines LSTMem plugs into: :mod:`.vllm` (the vLLM plugin)."""

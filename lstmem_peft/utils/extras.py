"""Optional dependencies: which pip extra brings each one, and the error when one is missing.

The core adapter (``import lstmem_peft``, ``get_peft_model``, ``write_history``, ``generate``)
needs only torch, transformers, peft, safetensors, huggingface-hub and tqdm. Training, evaluation,
benchmark plots and the Triton kernels import their packages where they are used, and a missing one
raises :func:`missing_extra`'s ``ImportError``, which names the extra to install::

    try:
        from trl import SFTConfig, SFTTrainer
    except ModuleNotFoundError as err:
        raise missing_extra(err, "train", "LSTMem training (lstmem_peft.training.trainer)") from err
"""

from __future__ import annotations

# The pip extra of each optional package, by distribution name (its module name has "_" for "-"), as in
# pyproject.toml's [project.optional-dependencies].
EXTRAS: dict[str, str] = {
    "trl": "train",
    "datasets": "train",
    "nltk": "eval",
    "pyarrow": "eval",
    "editdistance": "eval",
    "tiktoken": "eval",
    "matplotlib": "bench",
    "triton": "triton",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus-client": "serve",
    "vllm": "vllm",
    "openai": "data",
}


def missing_extra(err: ModuleNotFoundError, extra: str, feature: str) -> ImportError:
    """The ``ImportError`` to raise when ``feature`` could not import an optional package.

    Args:
        err: the ``ModuleNotFoundError`` of the failed import (its ``name`` is the missing module,
            which may also be a dependency of the optional package).
        extra: the pip extra that installs what ``feature`` needs (``"train"``, ``"eval"``, ...).
        feature: what the user tried to use, as they would recognise it.

    Returns:
        An ``ImportError`` whose message names the missing module and the install command,
        ``pip install "lstmem-peft[<extra>]"``; raise it ``from err``.
    """
    missing = err.name or str(err)
    return ImportError(
        f"{feature} needs the optional package {missing!r}, which is not installed. "
        f'Install it with: pip install "lstmem-peft[{extra}]"',
        name=err.name,
    )

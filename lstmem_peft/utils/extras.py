"""Optional dependencies: which pip extra brings each one, and the error when one is missing.

The core adapter (``import lstmem_peft``, ``get_peft_model``, ``write_history``, ``generate``)
needs only torch, transformers, peft, safetensors, huggingface-hub and tqdm. Training, evaluation,
benchmark plots and the Triton kernels import their packages where they are used, and a missing one
raises :func:`missing_extra`'s ``ImportError``, which names the extra to install, with the command that fits
how lstmem-peft was installed (:func:`install_command`: from the index, or from a clone)::

    try:
        from trl import SFTConfig, SFTTrainer
    except ModuleNotFoundError as err:
        raise missing_extra(err, "train", "LSTMem training (lstmem_peft.training.trainer)") from err
"""

from __future__ import annotations

import json
import os
import shlex
from functools import lru_cache
from urllib.parse import unquote, urlparse

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
    "gguf": "backbones",
}


DISTRIBUTION = "lstmem-peft"


def install_command(extra: str, direct_url: str | None = None) -> str:
    """The command that installs ``extra`` into this installation of lstmem-peft.

    From the index: ``pip install "lstmem-peft[eval]"``. From a clone (``pip install -e .`` there, as
    the README says): ``cd /path/to/clone && pip install -e ".[eval]"`` (``-e`` only for an editable
    install), since the index's release may differ from the clone's code.

    Args:
        extra: the pip extra (``"train"``, ``"eval"``, ...).
        direct_url: the text of the installation's ``direct_url.json`` (PEP 610); default: read from
            the installed distribution (absent for an install from the index).
    """
    if direct_url is None:
        folder, editable = _installed_from(_direct_url())
        if folder is None:
            folder, editable = _source_tree(), True
    else:
        folder, editable = _installed_from(direct_url)
    if folder is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"'
    return f'cd {shlex.quote(folder)} && pip install {"-e " if editable else ""}".[{extra}]"'


@lru_cache(maxsize=1)
def _direct_url() -> str:
    """The first ``direct_url.json`` among the installed distributions of lstmem-peft (at a clone's root,
    its ``lstmem_peft.egg-info`` comes first on the path and holds none)."""
    import importlib.metadata

    for dist in importlib.metadata.distributions(name=DISTRIBUTION):
        text = dist.read_text("direct_url.json")
        if text:
            return text
    return ""


def _source_tree() -> str | None:
    """The clone this package is imported from (``PYTHONPATH`` or the current folder), else ``None``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def _installed_from(direct_url: str) -> tuple[str | None, bool]:
    """(the local project folder lstmem-peft was installed from, whether editably); ``(None, False)``
    for an install from the index, an archive or VCS URL, or a folder that is no longer a project."""
    try:
        record = json.loads(direct_url) if direct_url.strip() else {}
    except json.JSONDecodeError:
        return None, False
    url = record.get("url") if isinstance(record, dict) else None
    dir_info = record.get("dir_info") if isinstance(record, dict) else None
    if not isinstance(url, str) or not isinstance(dir_info, dict) or not url.startswith("file:"):
        return None, False
    folder = unquote(urlparse(url).path)
    if not os.path.isfile(os.path.join(folder, "pyproject.toml")):
        return None, False
    return folder, bool(dir_info.get("editable"))


def missing_extra(err: ModuleNotFoundError, extra: str, feature: str) -> ImportError:
    """The ``ImportError`` to raise when ``feature`` could not import an optional package.

    Args:
        err: the ``ModuleNotFoundError`` of the failed import (its ``name`` is the missing module,
            which may also be a dependency of the optional package).
        extra: the pip extra that installs what ``feature`` needs (``"train"``, ``"eval"``, ...).
        feature: what the user tried to use, as they would recognise it.

    Returns:
        An ``ImportError`` whose message names the missing module and the install command
        (:func:`install_command`: ``pip install "lstmem-peft[<extra>]"``, or from a clone
        ``cd CLONE && pip install -e ".[<extra>]"``); raise it ``from err``.
    """
    missing = err.name or str(err)
    return ImportError(
        f"{feature} needs the optional package {missing!r}, which is not installed. "
        f"Install it with: {install_command(extra)}",
        name=err.name,
    )

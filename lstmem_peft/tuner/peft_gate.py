"""transformers' adapter methods when they refuse the installed PEFT: a clear error, named.

transformers gates its own adapter methods (``model.set_adapter``, ``active_adapters``,
``delete_adapter``, ...; ``PeftAdapterMixin``) behind a PEFT release: ``MIN_PEFT_VERSION`` in
``transformers.integrations.peft`` (5.24.0 asks for peft 0.22.0, unreleased on 2026-11-28, while
0.21.2 is the newest). Below it, each of these methods raises "The version of PEFT you are using is
not compatible", which names no fix a user can install. ``load_adapter`` is not gated and works.

When an LSTMem adapter enters a backbone that has these methods and the gate is closed for the
installed PEFT, :func:`name_the_gate` sets each gated method on that one model *instance* (the class
is untouched) to a function that raises the same kind of error (``ValueError``) naming both versions
and what works instead: PEFT's functional API on the same model, or PEFT's own model wrapper. A
method transformers would refuse anyway is the only thing replaced, so nothing that worked changes;
with an open gate (transformers 5.23, or a PEFT that meets it) nothing is set. docs/design-choices.md,
"transformers' adapter methods and PEFT".
"""

from __future__ import annotations

import functools
import importlib.metadata

from packaging.version import Version

#: The gated methods of transformers' ``PeftAdapterMixin`` and what to use instead.
GATED_DOORS = {
    "add_adapter": "peft.inject_adapter_in_model(config, model, adapter_name=name)",
    "set_adapter": "peft.functional.set_adapter(model, name)",
    "active_adapters": "lstmem_peft.tuner.hooks.MemoryHooks.of(model).active_adapter()",
    "delete_adapter": 'peft.functional.delete_adapter(model, adapter_name=name, prefix="lstmem_")',
    "disable_adapters": "the model's PEFT wrapper: PeftModel.from_pretrained(model, path).disable_adapter()",
    "enable_adapters": "the model's PEFT wrapper: PeftModel.from_pretrained(model, path)",
    "get_adapter_state_dict": "peft.get_peft_model_state_dict(model, adapter_name=name)",
}


def peft_gate() -> tuple[str, str] | None:
    """``(required, installed)`` PEFT versions when transformers' adapter methods refuse the installed
    PEFT, else ``None``."""
    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except ImportError:  # a transformers without the gate
        return None
    installed = importlib.metadata.version("peft")
    if Version(installed) >= Version(MIN_PEFT_VERSION):
        return None
    return MIN_PEFT_VERSION, installed


def gate_message(door: str, required: str, installed: str) -> str:
    """The error for ``model.<door>()`` on a backbone whose transformers refuses the installed PEFT."""
    import transformers

    return (
        f"transformers {transformers.__version__} refuses model.{door}() with peft {installed}: it requires peft >= "
        f"{required}. With these versions use {GATED_DOORS[door]}; or wrap the backbone in PEFT's own model "
        "(peft.PeftModel.from_pretrained(model, adapter_path) or get_peft_model), whose set_adapter, "
        "delete_adapter and disable_adapter work with this PEFT; or install a transformers whose adapter methods "
        f"accept peft {installed} (pip install 'transformers<5.24'), or peft >= {required} once it is released. "
        "README: 'Versions and PEFT doors'"
    )


def _refused(door: str, required: str, installed: str, *args, **kwargs):
    raise ValueError(gate_message(door, required, installed))


def name_the_gate(model) -> None:
    """Set each gated adapter method of ``model`` (a transformers backbone) to raise
    :func:`gate_message`, when the gate is closed for the installed PEFT (see the module docstring)."""
    gate = peft_gate()
    if gate is None or not hasattr(type(model), "load_adapter"):
        return
    for door in GATED_DOORS:
        if hasattr(type(model), door):
            # a partial of a module-level function: the model still pickles and deep-copies
            setattr(model, door, functools.partial(_refused, door, *gate))

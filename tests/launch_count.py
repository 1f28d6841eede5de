"""Counting what a step launches: Triton kernel launches (also under ``TRITON_INTERPRET=1``) and
the aten operators that are neither views nor allocations. Used by the decode-step tests to hold
the memory's cost per token to what a GPU would pay."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass
class Counts:
    """What ran inside :func:`count_launches_and_ops`: Triton kernel launches (kernel names) and
    the aten operators that are neither views nor allocations (``ops``)."""

    launches: list[str] = dataclasses.field(default_factory=list)
    ops: list[str] = dataclasses.field(default_factory=list)


ALLOCATIONS = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
}


def _launchers() -> list[type]:
    """The classes whose ``run`` launches a kernel: ``JITFunction`` (a GPU) and, under
    ``TRITON_INTERPRET=1``, the interpreter's ``InterpretedFunction``."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    return classes


@contextlib.contextmanager
def count_launches_and_ops():
    """Count Triton kernel launches and non-view, non-allocation aten operators while active.

    A launch is a call of ``run`` of a jit (or interpreted) function, ``kernel[grid](...)``; the
    operators a launch itself runs (the interpreter's host copies of its arguments) are not counted,
    nor are launches nested in one. Usage::

        with count_launches_and_ops() as counts:
            ...
        assert counts.launches == ["_decode_step_kernel"] and not counts.ops
    """
    counts = Counts()
    inside = [0]

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and not func.is_view and func.overloadpacket not in ALLOCATIONS:
                counts.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def counted(run):
        def wrapper(self, *args, **kwargs):
            if not inside[0] and not kwargs.get("warmup", False):
                counts.launches.append(self.fn.__name__)
            inside[0] += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                inside[0] -= 1

        return wrapper

    with contextlib.ExitStack() as stack:
        for cls in _launchers():
            stack.enter_context(mock.patch.object(cls, "run", counted(cls.run)))
        stack.enter_context(_Ops())
        yield counts

"""The capture step of the ahead-of-time compile (:mod:`lstmem_kernels.aot`): :func:`capture_launches`
records every Triton launch the host code makes (one :class:`Launch` per distinct binary: kernel,
signature, constexprs, attributes, options) through a stand-in driver for an NVIDIA target and
Triton's JIT cache hook, which stops each launch before it compiles; :func:`scenario` labels the
launches made inside it; :func:`defined_kernels` lists every ``@triton.jit`` function the package
defines. No GPU and no CUDA driver are needed; CPU tensors stand in for device ones.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

#: The ahead-of-time tool's own modules: they define no kernel, and the walk over the package skips them.
TOOL_MODULES = ("lstmem_kernels.aot", "lstmem_kernels.aot_capture", "lstmem_kernels.aot_drive")


@dataclass
class Launch:
    """One distinct kernel launch as Triton would compile it (``fn`` the ``JITFunction``)."""

    kernel: str  # "module:qualname"
    signature: dict  # parameter name -> Triton type ("*fp32", "i32", "constexpr", ...)
    constexprs: dict  # parameter index path (tuple) -> value
    attrs: dict  # parameter index path (tuple) -> [[attribute, value], ...]
    options: dict  # num_warps, num_stages, num_ctas, enable_fp_fusion
    fn: object = field(repr=False, compare=False)
    label: str = ""  # the first call (scenario) that made it
    paper: bool = False  # made at the paper's sizes
    count: int = 0  # how many launches had this key

    @property
    def key(self) -> str:
        """Everything that selects a binary."""
        return repr((self.kernel, self.spec(), sorted(self.attrs.items()), sorted(self.options.items())))

    @property
    def coarse_key(self) -> str:
        return repr((self.kernel, self.spec(), self.options["num_warps"]))

    def spec(self) -> dict:
        """Signature and constexprs by parameter name (``{"T": "i32", "HAS_DEPTH": True, ...}``)."""
        names = list(self.signature)
        out = {}
        for name, ty in self.signature.items():
            out[name] = ty
        for path, value in self.constexprs.items():
            name = ".".join([names[path[0]], *map(str, path[1:])])
            out[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
        return out

    def describe(self) -> str:
        """A short, version-independent description: pointer dtypes, true flags, other constexprs."""
        spec = self.spec()
        dtypes = sorted({ty[1:] for ty in spec.values() if isinstance(ty, str) and ty.startswith("*")})
        flags = [n for n, v in spec.items() if v is True]
        values = [f"{n}={v}" for n, v in spec.items() if n in _constexpr_names(self) and type(v) is int]
        parts = ["/".join(dtypes), *flags, *values, f"warps={self.options['num_warps']}"]
        return " ".join(p for p in parts if p)


def _constexpr_names(launch: Launch) -> set[str]:
    return {n for n, ty in launch.signature.items() if ty == "constexpr"}


class _StandInDriver:
    """The parts of Triton's driver interface that the JIT launch path asks for before it compiles
    (the launch itself never happens: the cache hook stops it)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self):
        raise RuntimeError("lstmem_kernels.aot's stand-in driver launches nothing and benchmarks nothing")


# the scenario being driven, and whether it is at the paper's sizes
_LABEL: list[tuple[str, bool]] = [("", False)]


@contextlib.contextmanager
def scenario(label: str, paper: bool) -> Iterator[None]:
    """Label the launches captured inside (``paper``: at the paper's sizes)."""
    _LABEL.append((label, paper))
    try:
        yield
    finally:
        _LABEL.pop()


def _kernel_modules() -> list:
    """Every module of ``lstmem_kernels`` (imported, subpackages included; the ahead-of-time tool's own
    modules, :data:`TOOL_MODULES`, aside): the Triton members of the op families and their shared
    helpers are among them."""
    import lstmem_kernels

    names = [m.name for m in pkgutil.walk_packages(lstmem_kernels.__path__, "lstmem_kernels.")]
    return [importlib.import_module(name) for name in names if name not in TOOL_MODULES]


def defined_kernels() -> list[str]:
    """Every ``@triton.jit`` function defined (not imported) in a module of ``lstmem_kernels``, as
    ``"module:qualname"``."""
    import triton

    found = []
    for module in _kernel_modules():
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.JITFunction) and value.fn.__module__ == module.__name__:
                found.append(f"{module.__name__}:{value.fn.__qualname__}")
    return sorted(set(found))


@contextlib.contextmanager
def capture_launches(arch: int = 90) -> Iterator[dict[str, Launch]]:
    """Within the block, Triton launches of this process are recorded (deduplicated, in the yielded
    dict keyed by :attr:`Launch.key`) instead of compiled and run, and the kernels' host code accepts
    CPU tensors as stand-ins for device tensors (module docstring).

    Raises:
        RuntimeError: when the kernels were imported under the interpreter (``TRITON_INTERPRET=1``).
    """
    import triton
    from triton.runtime.driver import driver

    from . import triton_common

    if triton_common.INTERPRETED:
        raise RuntimeError(
            "lstmem_kernels was imported under the Triton interpreter (TRITON_INTERPRET=1), so its kernels "
            "are not compilable JITFunctions; run the ahead-of-time compile in a process without "
            "TRITON_INTERPRET (python -m lstmem_kernels.aot)"
        )
    _kernel_modules()  # every kernel module loaded, so every reference to the device check is found
    launches: dict[str, Launch] = {}

    def hook(*, fn, compile, **_):
        label, paper = _LABEL[-1]
        launch = Launch(
            kernel=f"{fn.jit_function.fn.__module__}:{fn.jit_function.fn.__qualname__}",
            signature=dict(compile["signature"]),
            constexprs=dict(compile["constants"]),
            attrs=dict(compile["configs"][0]),
            options={
                "num_warps": compile["num_warps"],
                "num_stages": compile["num_stages"],
                "num_ctas": compile["num_ctas"],
                "enable_fp_fusion": compile["enable_fp_fusion"],
            },
            fn=fn.jit_function,
            label=label,
        )
        launch = launches.setdefault(launch.key, launch)
        launch.count += 1
        launch.paper |= paper
        return True  # skip the compile and the launch

    original_check = triton_common.check_runtime
    patched = [
        (module, name)
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("lstmem_kernels")
        for name, value in list(vars(module).items())
        if value is original_check
    ]
    previous_hook = triton.knobs.runtime.jit_cache_hook
    previous_driver = driver._active  # None until a driver was asked for (none can be made without a GPU)
    driver.set_active(_StandInDriver(arch))
    triton.knobs.runtime.jit_cache_hook = hook
    for module, name in patched:
        setattr(module, name, _accept_any_device)
    try:
        yield launches
    finally:
        for module, name in patched:
            setattr(module, name, original_check)
        triton.knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


def _accept_any_device(device: torch.device) -> None:
    """The capture's stand-in for ``triton_common.check_runtime``: CPU tensors stand for device ones."""

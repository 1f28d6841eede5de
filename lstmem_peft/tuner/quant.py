"""Dense views of the backbone's projections, whatever their storage (plain or quantised).

LSTMem reads two things from the projections it wraps: their sizes (to build the memory) and their
weights (to initialise the corrections ``W_dq`` / ``W_do`` from the backbone, App. C.4). A quantised
backbone stores those weights packed (bitsandbytes 4-bit keeps a ``(n / 2, 1)`` uint8 buffer for an
``(out, in)`` matrix), so slicing ``.weight`` would read packed bytes, not columns. This module asks
each quantisation library to dequantise its own weight instead:

=============================  ===============================================================
projection                     how its dense weight is obtained
=============================  ===============================================================
``torch.nn.Linear``            the weight itself (float16, bfloat16, float32 or float64)
transformers ``Conv1D``       its weight, stored ``(in, out)``, transposed (GPT-2's projections)
bitsandbytes ``Linear4bit``    ``bitsandbytes.functional.dequantize_4bit`` (NF4 and FP4), in
                               either of its CPU layouts (see :func:`bnb_4bit_layout`)
bitsandbytes ``Linear8bitLt``  ``bitsandbytes.functional.int8_vectorwise_dequant`` (row scales)
torchao-quantised Linear       the weight tensor subclass's own ``dequantize()``
optimum-quanto ``QLinear``     ``module.qweight.dequantize()``
=============================  ===============================================================

Anything else (GPTQ/AWQ/HQQ/fp8 layers, an ``nn.Linear`` whose weight is some other tensor
subclass) is refused by :func:`check_projection` with an error that names these kinds.
The libraries are imported only when a module of theirs is present (a module of a library's class
cannot exist unless that library was imported), so none of them is a dependency of this package.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from typing import NoReturn

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .attention import projection_shape

#: Dense weight dtypes a plain ``nn.Linear`` may hold (fp8 and integer weights need their scales).
DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

SUPPORTED_PROJECTIONS = (
    "torch.nn.Linear (float16/bfloat16/float32/float64 weight), transformers Conv1D (GPT-2's), "
    "bitsandbytes Linear4bit (NF4, FP4) and Linear8bitLt, torch.nn.Linear quantised by torchao (a torchao "
    "tensor-subclass weight), optimum-quanto QLinear"
)


def _bnb():
    """``bitsandbytes`` if it is imported (only then can a projection be one of its modules)."""
    return sys.modules.get("bitsandbytes")


def _torchao_tensor(weight) -> bool:
    """Whether ``weight`` is a torchao tensor subclass (a torchao-quantised Linear's weight)."""
    utils = sys.modules.get("torchao.utils")
    base = getattr(utils, "TorchAOBaseTensor", None)
    return base is not None and isinstance(weight, base)


def _quanto_linear(module: nn.Module) -> bool:
    qlinear = sys.modules.get("optimum.quanto.nn.qlinear")
    cls = getattr(qlinear, "QLinear", None)
    return cls is not None and isinstance(module, cls)


def projection_kind(module: nn.Module) -> str | None:
    """Which supported kind of projection ``module`` is, or ``None`` if it is not one.

    Returns:
        ``"linear"``, ``"conv1d"``, ``"bnb-4bit"``, ``"bnb-8bit"``, ``"torchao"``, ``"quanto"`` or ``None``.
    """
    if isinstance(module, Conv1D):
        dense = type(module.weight) in (nn.Parameter, torch.Tensor) and module.weight.dtype in DENSE_DTYPES
        return "conv1d" if dense else None
    bnb = _bnb()
    if bnb is not None:
        if isinstance(module, bnb.nn.Linear4bit):
            return "bnb-4bit"
        if isinstance(module, bnb.nn.Linear8bitLt):
            return "bnb-8bit"
    if _quanto_linear(module):
        return "quanto"
    if not isinstance(module, nn.Linear):
        return None
    weight = module.weight
    if _torchao_tensor(weight):
        return "torchao" if callable(getattr(weight, "dequantize", None)) else None
    if type(weight) in (nn.Parameter, torch.Tensor) and weight.dtype in DENSE_DTYPES:
        return "linear"
    return None


def is_supported_projection(module: nn.Module) -> bool:
    """Whether LSTMem can wrap ``module`` (see :data:`SUPPORTED_PROJECTIONS`)."""
    return projection_kind(module) is not None


def check_projection(module: nn.Module, name: str) -> None:
    """Raise ``ValueError`` naming the supported kinds unless ``module`` (called ``name``) is one."""
    if is_supported_projection(module):
        return
    weight = getattr(module, "weight", None)
    what = type(module).__name__
    if isinstance(weight, torch.Tensor):
        what += f" with a {type(weight).__name__} weight of dtype {weight.dtype}"
    raise ValueError(
        f"LSTMem cannot wrap {name}: it is a {what}. Supported projections: {SUPPORTED_PROJECTIONS}. "
        "Load the backbone unquantised or with one of these quantisations (e.g. BitsAndBytesConfig(load_in_4bit="
        "True, bnb_4bit_quant_type='nf4')), or target other modules"
    )


def _onloaded(module: nn.Module):
    """A context in which ``module``'s weights are on its execution device: accelerate's own
    ``align_module_device`` for a module whose weights a ``device_map`` offloaded (to "cpu" or
    "disk": they sit on the meta device between forwards), otherwise nothing."""
    if getattr(module, "_hf_hook", None) is None:
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device  # a module with an _hf_hook comes from accelerate

    return align_module_device(module)


@torch.no_grad()
def dense_weight(module: nn.Module) -> torch.Tensor:
    """The dense ``(out_features, in_features)`` float32 weight of a supported projection.

    Quantised weights are dequantised with their library's own function (never by slicing the
    packed storage), so the result is the matrix the projection actually multiplies by, up to
    float32 rounding. Weights that an accelerate ``device_map`` offloaded are loaded for the call
    (on the module's execution device) and offloaded again. The result is a new tensor, detached,
    on the device the projection computes on.

    Args:
        module: a projection for which :func:`is_supported_projection` holds.
    Returns:
        ``(out_features, in_features)`` float32.
    Raises:
        ValueError: ``module`` is not a supported projection, its weight is on the meta device with
            nothing to load it, its dequantised weight does not have the shape
            ``(out_features, in_features)``, or it is a bitsandbytes 4-bit weight in a storage layout
            that :func:`bnb_4bit_layout` does not know (never read as if it were a known one).
    """
    kind = projection_kind(module)
    if kind is None:
        check_projection(module, type(module).__name__)
    with _onloaded(module):
        dense = _dequantize(module, kind)
    if dense.is_meta:
        raise ValueError(
            f"the weight of this {type(module).__name__} is on the meta device and no accelerate hook loads it: "
            "LSTMem initialises its corrections from the backbone's weights. Load the weights first (from_pretrained, "
            "or load_checkpoint_and_dispatch after init_empty_weights). PeftModel.from_pretrained removes the hooks "
            "of a backbone whose device_map offloads to 'cpu' or 'disk' before it injects the adapter; for such a "
            "backbone use get_peft_model(base, LSTMemConfig.from_pretrained(path)) and then "
            "set_peft_model_state_dict(model, safetensors.torch.load_file(<path>/adapter_model.safetensors))"
        )
    expected = projection_shape(module)
    if tuple(dense.shape) != expected:
        raise ValueError(
            f"the dequantised weight of this {type(module).__name__} has shape {tuple(dense.shape)}, but the "
            f"layer has out_features x in_features = {expected}"
        )
    return dense


def _dequantize(module: nn.Module, kind: str) -> torch.Tensor:
    """``module``'s weight as a new float32 ``(out, in)`` tensor, by its library's own function."""
    weight = module.weight
    if kind == "bnb-4bit":
        state = getattr(weight, "quant_state", None)
        if state is None:
            raise ValueError(
                "this bitsandbytes Linear4bit has no quant_state: its weight was never quantised (a 4-bit layer "
                "is quantised when it is moved to its device); load the model with from_pretrained(..., "
                "quantization_config=BitsAndBytesConfig(load_in_4bit=True)) before adding the adapter"
            )
        dense = _bnb_4bit_dequantize(weight.data, state)
    elif kind == "bnb-8bit":
        if weight.dtype != torch.int8:  # has_fp16_weights=True keeps a dense weight
            dense = weight.data.clone()
        else:
            scales = getattr(weight, "SCB", None)
            if scales is None:
                scales = getattr(getattr(module, "state", None), "SCB", None)
            if scales is None:
                raise ValueError(
                    "this bitsandbytes Linear8bitLt holds int8 weights but no row scales (SCB); load the model "
                    "with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))"
                )
            dense = _bnb().functional.int8_vectorwise_dequant(weight.data, scales.to(weight.device))
    elif kind == "torchao":
        dense = weight.dequantize()
    elif kind == "quanto":
        dense = module.qweight.dequantize()
    elif kind == "conv1d":
        dense = weight.detach().t().to(torch.float32, copy=True)  # stored (in, out)
    else:
        dense = weight.detach().to(torch.float32, copy=True)  # a copy: callers may change it freely
    return dense.to(torch.float32)


#: bitsandbytes' ``block_n`` for its CPU repacking (``_convert_weight_packed_for_cpu``'s default).
BNB_CPU_BLOCK_N = 32


def _bnb_version() -> str:
    return getattr(_bnb(), "__version__", "(unknown version)")


def bnb_4bit_layout(data: torch.Tensor, state) -> str:
    """Which of bitsandbytes' storage layouts a 4-bit weight is in.

    bitsandbytes (0.50) keeps a ``Linear4bit`` weight of ``state.shape = (N, K)`` (out, in) in one of
    two layouts:

    * ``"plain"``: ``data`` holds the ``N * K`` 4-bit codes in row-major order, two to a byte (any
      storage dtype, usually ``(N * K / 2, 1)`` uint8); ``state.absmax`` holds one scale per
      ``state.blocksize`` consecutive codes, ``(N * K / blocksize,)`` (float32, or uint8 with
      ``state.state2`` when double-quantised).
    * ``"cpu-packed"``: on a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without
      gradients repacks the weight once for its native kernel (``_convert_weight_packed_for_cpu``)
      and sets ``state.packing_format_for_cpu``: ``data`` becomes ``(N, K / 2)`` uint8 with the codes
      interleaved in tiles of ``block_n = 32`` rows, ``state.absmax`` becomes ``(K / blocksize, N)``
      bfloat16 (double quantisation undone, then rounded to bfloat16) and ``state.dtype`` bfloat16.

    Args:
        data: the weight's storage (``module.weight.data``).
        state: its ``bitsandbytes.functional.QuantState``.
    Returns:
        ``"plain"`` or ``"cpu-packed"``.
    Raises:
        ValueError: the storage matches neither layout, e.g. the half-restored state that
            bitsandbytes 0.50.2's inverse repacking leaves a weight without double quantisation in
            (``state_dict()``, ``save_pretrained`` or ``.cuda()`` after an eval forward), or a layout of
            a bitsandbytes release this module does not know. The message says what to do.
    """
    shape = tuple(getattr(state, "shape", ()) or ())
    blocksize = getattr(state, "blocksize", None)
    absmax = getattr(state, "absmax", None)
    if len(shape) != 2 or not isinstance(blocksize, int) or not isinstance(absmax, torch.Tensor):
        _unknown_bnb_layout(data, state, "its quant_state has no 2-D shape, blocksize and absmax")
    n, k = shape
    fields = getattr(state, "__dict__", {})
    flags = sorted(f for f in fields if f.startswith("packing_format") and f != "packing_format_for_cpu")
    if any(getattr(state, f) for f in flags):
        _unknown_bnb_layout(data, state, f"its quant_state sets {', '.join(flags)}")
    if getattr(state, "packing_format_for_cpu", False):
        ok = (
            data.dtype == torch.uint8
            and tuple(data.shape) == (n, k // 2)
            and n % BNB_CPU_BLOCK_N == 0
            and k % blocksize == 0
            and not state.nested
            and tuple(absmax.shape) == (k // blocksize, n)
            and hasattr(state, "original_qshape")
            and hasattr(state, "original_dtype")
        )
        if not ok:
            _unknown_bnb_layout(
                data, state, "it is marked packing_format_for_cpu but is not shaped as that layout"
            )
        return "cpu-packed"
    blocks = math.ceil(n * k / blocksize)
    size = data.numel() * data.element_size()  # bytes, whatever the storage dtype (padded to it)
    ok = abs(size - math.ceil(n * k / 2)) < data.element_size() and absmax.numel() == blocks
    if ok and absmax.dim() == 1:
        return "plain"
    if ok and not state.nested and tuple(absmax.shape) == (k // blocksize, n):
        raise ValueError(
            f"this bitsandbytes Linear4bit's weight is half-restored from its CPU repacking: its scales "
            f"(quant_state.absmax) are still {tuple(absmax.shape)} = (in_features / blocksize, out_features) "
            f"bfloat16 while its codes are back in the plain layout. bitsandbytes {_bnb_version()} does this to "
            "a weight without double quantisation when state_dict(), save_pretrained() or .cuda() runs after an "
            "eval forward on a CPU with AVX512-BF16, and the layer's own forward multiplies by a wrong matrix "
            "from then on. Reload the quantised backbone (from_pretrained) and add the adapter before any such "
            "call, or quantise with BitsAndBytesConfig(bnb_4bit_use_double_quant=True), whose restore only "
            "re-quantises the scales"
        )
    _unknown_bnb_layout(data, state, "its storage matches neither the plain nor the CPU-packed layout")


def _unknown_bnb_layout(data: torch.Tensor, state, why: str) -> NoReturn:
    """Raise the ``ValueError`` for a 4-bit storage layout :func:`bnb_4bit_layout` does not know."""
    raise ValueError(
        f"LSTMem cannot read this bitsandbytes Linear4bit weight: {why} (storage {tuple(data.shape)} "
        f"{data.dtype}, quant_state.shape {tuple(getattr(state, 'shape', ()) or ())}, absmax "
        f"{tuple(getattr(getattr(state, 'absmax', None), 'shape', ()))}). lstmem_peft.tuner.quant knows bitsandbytes "
        f"0.50's plain and CPU-packed layouts; this is bitsandbytes {_bnb_version()}. Install bitsandbytes 0.50 "
        "(pip install 'bitsandbytes==0.50.2'), or add the adapter before the backbone's first forward in eval "
        "mode (where bitsandbytes repacks 4-bit weights on a CPU)"
    )


def _bnb_4bit_dequantize(data: torch.Tensor, state) -> torch.Tensor:
    """A bitsandbytes 4-bit weight dequantised by ``bitsandbytes.functional.dequantize_4bit``.

    Exact in both layouts of :func:`bnb_4bit_layout`: a plain weight is dequantised as stored; a
    CPU-packed weight's codes are put back in row-major order by bitsandbytes' own
    ``_convert_weight_packed_for_cpu_inverse`` and dequantised with the scales the packed kernel
    multiplies by (``state.absmax`` transposed back, bfloat16 values; not re-quantised, as that
    function does for a double-quantised weight). The module's storage and ``state`` are only read:
    the inverse works on a shallow copy of ``state`` and returns new tensors.

    Args:
        data: the weight's storage, plain or ``(N, K / 2)`` uint8 packed.
        state: its ``QuantState`` with ``state.shape = (N, K)``.
    Returns:
        ``(N, K)`` in ``state.dtype`` (plain) or the dtype before repacking (packed).
    """
    functional = _bnb().functional
    if bnb_4bit_layout(data, state) == "plain":
        return functional.dequantize_4bit(data, state)
    scratch = copy.copy(state)  # the inverse rebinds fields of the state it is given
    scratch.original_nested = False  # keep the packed kernel's scales; the inverse would re-quantise them
    codes, scratch = functional._convert_weight_packed_for_cpu_inverse(data, scratch)
    scratch.absmax = state.absmax.T.reshape(-1).to(torch.float32)  # (K / blocksize, N) -> row-major blocks
    return functional.dequantize_4bit(codes, scratch)

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
bitsandbytes ``Linear4bit``    ``bitsandbytes.functional.dequantize_4bit`` (NF4 and FP4)
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
import sys

import torch
from torch import nn

#: Dense weight dtypes a plain ``nn.Linear`` may hold (fp8 and integer weights need their scales).
DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

SUPPORTED_PROJECTIONS = (
    "torch.nn.Linear (float16/bfloat16/float32/float64 weight), bitsandbytes Linear4bit (NF4, FP4) and "
    "Linear8bitLt, torch.nn.Linear quantised by torchao (a torchao tensor-subclass weight), optimum-quanto QLinear"
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
        ``"linear"``, ``"bnb-4bit"``, ``"bnb-8bit"``, ``"torchao"``, ``"quanto"`` or ``None``.
    """
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
            nothing to load it, or its dequantised weight does not have the shape
            ``(out_features, in_features)``.
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
    expected = (module.out_features, module.in_features)
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
        dense = _bnb().functional.dequantize_4bit(weight.data, state)
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
    else:
        dense = weight.detach().to(torch.float32, copy=True)  # a copy: callers may change it freely
    return dense.to(torch.float32)

"""What the ``lstmem`` command keeps off the terminal (issue 48, item 4): only output a user cannot act on.

Three things, all set by the command alone (:func:`quiet_command`), never by the library, so a program
that imports ``lstmem_peft`` sees every warning transformers, PEFT and their backends give it:

* :data:`UPSTREAM_DEPRECATIONS`: deprecations that transformers' or PEFT's own code triggers, not the
  user's and not this project's. Each is filtered by its category, its message and the module that
  warns, and each names the release that removes it (README "Warnings").
* :data:`UPSTREAM_LOG_LINES`: log lines that the optional quantisation backends (the ``quant``
  extra) print while PEFT imports them, on every command, whether or not a model is quantised. Each
  is dropped by the logger that prints it, its message and the condition under which it says nothing
  the user can act on, and each names what ends it (README "Warnings").
* transformers' weight-loading progress bars (``Loading weights``): a small model loads in well under
  a second, and the command says what it loads. The Hub's download bars stay (a first download of a
  real backbone takes minutes).

The project's own warnings are fixed where they arise (``LSTMemTrainingConfig`` sets
``activation_checkpointing`` where transformers has it, and pins host memory only for an accelerator;
``lstmem serve``'s ``--max-tokens`` follows the window), so nothing of this project is filtered here.
Importing this module imports nothing heavy (tests/test_startup.py).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

#: (category, message regex, warning module regex, why, which release removes it). transformers 5.24
#: deprecates ``PreTrainedModel.is_gradient_checkpointing`` (its alias ``is_activation_checkpointing``
#: replaces it); PEFT 0.21's ``PeftModel.__init__`` still reads it (``getattr(model,
#: "is_gradient_checkpointing", True)``) on every ``get_peft_model`` and ``PeftModel.from_pretrained``.
UPSTREAM_DEPRECATIONS: tuple[tuple[type[Warning], str, str, str, str], ...] = (
    (
        FutureWarning,
        r"`is_gradient_checkpointing` is deprecated",
        r"transformers\.modeling_utils",
        "PEFT 0.21's PeftModel.__init__ reads transformers' deprecated is_gradient_checkpointing",
        "transformers 6 (which removes the property)",
    ),
)


def filter_upstream_deprecations() -> None:
    """Ignore :data:`UPSTREAM_DEPRECATIONS` (each by category, message and module) in this process."""
    for category, message, module, _why, _removed in UPSTREAM_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _torch_has_no_cuda(record: logging.LogRecord) -> bool:
    torch = sys.modules.get("torch")  # torchao imports torch before it logs
    return torch is not None and torch.version.cuda is None


def _a_torchao_enum(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    return bool(args) and getattr(args[0], "__module__", "").startswith("torchao.")


@dataclass(frozen=True)
class UpstreamLogLine:
    """A log line of an upstream package that :func:`quiet_command` drops.

    ``logger``: the logger that prints it (the record's own, not an ancestor's); ``message``: a regex
    searched in the formatted message; ``applies``: the condition on the record under which the line
    tells the user nothing they can act on (else it is shown); ``why`` and ``gone_with``: the README's
    "Warnings" table.
    """

    logger: str
    message: str
    why: str
    gone_with: str
    applies: Callable[[logging.LogRecord], bool] = lambda record: True

    def drops(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is this line (its logger, its message and its condition)."""
        return (
            record.name == self.logger
            and re.search(self.message, record.getMessage()) is not None
            and self.applies(record)
        )


#: What the ``quant`` extra's backends log while PEFT imports them (measured 2026-11-29 with torch
#: 2.13.0+cpu, torchao 0.18.0 and bitsandbytes 0.50.2, on every ``lstmem`` command).
UPSTREAM_LOG_LINES: tuple[UpstreamLogLine, ...] = (
    UpstreamLogLine(
        logger="torchao",
        message=r"^Failed to load \S*torchao\S*_C\w*\.\S*so: ",
        why="torchao's wheel holds CUDA extensions (_C_mxfp8, _C_cutlass_90a: they link libc10_cuda) that "
        "a torch built without CUDA cannot load; torchao's CPU paths do not use them",
        gone_with="a torchao release that skips its CUDA extensions under a CPU-only torch (0.18 tries them)",
        applies=_torch_has_no_cuda,
    ),
    UpstreamLogLine(
        logger="torch.utils._pytree",
        message=r"is an Enum subclass and is now natively supported by torch\.compile",
        why="torchao 0.18 registers its enums (KernelPreference, ScaleCalculationMode) as pytree constants, "
        "which torch 2.13 deprecates for enums",
        gone_with="a torchao release that stops registering its enums (0.18 does)",
        applies=_a_torchao_enum,
    ),
    UpstreamLogLine(
        logger="bitsandbytes.backends.cpu.ops",
        message=r"^Failed to load CPU gemm_4bit_forward from kernels-community",
        why="bitsandbytes 0.50, on a CPU with AVX512-BF16, looks for an optional 4-bit kernel that the "
        "Hub's `kernels` package downloads at run time, and uses its own CPU kernel without it",
        gone_with="nothing yet: `pip install kernels` (and a network) gives bitsandbytes that kernel",
    ),
)


class _DropUpstreamLines(logging.Filter):
    """On each logger of :data:`UPSTREAM_LOG_LINES`: drops its records that are one of those lines."""

    def __init__(self, lines: tuple[UpstreamLogLine, ...]) -> None:
        super().__init__()
        self.lines = lines

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(line.drops(record) for line in self.lines)


def drop_upstream_log_lines() -> None:
    """Drop :data:`UPSTREAM_LOG_LINES` in this process (a filter on each logger, set once). Loggers are
    found by name, so this works before the backends are imported, which is when they log."""
    for name in sorted({line.logger for line in UPSTREAM_LOG_LINES}):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUpstreamLines) for f in logger.filters):
            logger.addFilter(_DropUpstreamLines(tuple(x for x in UPSTREAM_LOG_LINES if x.logger == name)))


def hide_loading_bars() -> None:
    """Turn off transformers' own progress bars (``Loading weights``) and keep the Hub's download
    bars as they were (on, unless ``HF_HUB_DISABLE_PROGRESS_BARS`` or the user turned them off)."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    downloads_shown = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also turns the Hub's off: turned back on below
    if downloads_shown:
        enable_progress_bars()


def quiet_command(loads_models: bool) -> None:
    """What ``lstmem`` sets before a subcommand runs; ``loads_models``: the subcommand loads a model
    with transformers (the bars are then turned off, which imports transformers)."""
    filter_upstream_deprecations()
    drop_upstream_log_lines()
    if loads_models:
        hide_loading_bars()

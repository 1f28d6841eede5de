"""What the ``lstmem`` command keeps off the terminal (issue 48, item 4): only output a user cannot act on.

Two things, both set by the command alone (:func:`quiet_command`), never by the library, so a program
that imports ``lstmem_peft`` sees every warning transformers and PEFT give it:

* :data:`UPSTREAM_DEPRECATIONS`: deprecations that transformers' or PEFT's own code triggers, not the
  user's and not this project's. Each is filtered by its category, its message and the module that
  warns, and each names the release that removes it (README "Warnings").
* transformers' weight-loading progress bars (``Loading weights``): a small model loads in well under
  a second, and the command says what it loads. The Hub's download bars stay (a first download of a
  real backbone takes minutes).

The project's own warnings are fixed where they arise (``LSTMemTrainingConfig`` sets
``activation_checkpointing`` where transformers has it, and pins host memory only for an accelerator;
``lstmem serve``'s ``--max-tokens`` follows the window), so nothing of this project is filtered here.
Importing this module imports nothing heavy (tests/test_startup.py).
"""

from __future__ import annotations

import warnings

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
    if loads_models:
        hide_loading_bars()

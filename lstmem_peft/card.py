"""The LSTMem section of an adapter's model card (README.md next to the adapter files).

PEFT writes the card in ``PeftModel.save_pretrained`` through ``create_or_update_model_card``; on
import, lstmem-peft extends that method so that, for LSTMem adapters only, the card also says what
the adapter is, how it is configured, and cites the paper. The section is replaced, not duplicated,
when the card is written again.
"""

from __future__ import annotations

import os

from huggingface_hub import ModelCard
from peft import PeftModel

from . import constants as K

BEGIN, END = "<!-- lstmem:begin -->", "<!-- lstmem:end -->"


TRAINING_ATTR = "lstmem_training_info"


def record_training(model, **info) -> None:
    """Attach training facts (base model, data, schedule) that the model card will list."""
    current = dict(getattr(model, TRAINING_ATTR, None) or {})
    current.update({k: v for k, v in info.items() if v is not None})
    object.__setattr__(model, TRAINING_ATTR, current)


def _training_table(info: dict) -> str:
    rows = ["### Training", "", "| | |", "| --- | --- |"]
    rows += [f"| {key.replace('_', ' ')} | {value} |" for key, value in info.items()]
    return "\n".join(rows)


def lstmem_card_section(config, extra: str = "") -> str:
    """Markdown describing an LSTMem adapter and citing the paper."""
    layers = "all" if config.layers_to_transform is None else ", ".join(map(str, config.layers_to_transform))
    lines = [
        BEGIN,
        "## LSTMem adapter",
        "",
        "An online memory for a frozen causal LM ([LSTMem](#citation)): each memory layer keeps a cell",
        "state C and a hidden state D per sequence; readouts of D correct the attention queries and",
        "outputs. Load it with `import lstmem_peft` and `PeftModel.from_pretrained(base, repo_id)`, and",
        "keep the memory in a `lstmem_peft.MemoryCache` passed to `generate(..., memory_cache=cache)`.",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| memory layers | {layers} |",
        f"| heads n_h x width r | {config.num_heads} x {config.r} |",
        f"| alpha | {config.alpha} |",
        f"| depth coupling | {config.depth_coupling} |",
        f"| block feedback | {config.block_feedback} (<= {config.feedback_positions} positions per block) |",
        f"| history block size | {config.block_size} |",
        f"| state dtype | {config.state_dtype} |",
        f"| base model | {config.base_model_name_or_path or 'not recorded'} |",
        "",
    ]
    if extra:
        lines += [extra.strip(), ""]
    lines += ["### Citation", "", "```bibtex", K.PAPER_BIBTEX, "```", END]
    return "\n".join(lines)


def write_lstmem_section(output_dir: str, config, extra: str = "") -> None:
    """Insert or replace the LSTMem section of ``output_dir/README.md``."""
    path = os.path.join(output_dir, "README.md")
    card = ModelCard.load(path) if os.path.exists(path) else ModelCard("")
    text = card.text
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + text[text.index(END) + len(END) :]
    card.text = text.rstrip() + "\n\n" + lstmem_card_section(config, extra) + "\n"
    tags = set(card.data.get("tags") or []) | {"lstmem", "memory"}
    card.data["tags"] = sorted(tags)
    card.save(path)


def _lstmem_config(model):
    config = model.peft_config.get(getattr(model, "active_adapter", None) or "default")
    return config if getattr(config, "peft_type", None) == "LSTMEM" else None


def install() -> None:
    """Extend ``PeftModel``'s card writing and Hub upload once (idempotent).

    ``save_pretrained`` writes the card through ``create_or_update_model_card``; ``push_to_hub``
    then replaces README.md with the Hub's card (or a template) before ``_upload_modified_files``,
    so the section is written in both places.
    """
    if getattr(PeftModel.create_or_update_model_card, "_lstmem", False):
        return
    original_card = PeftModel.create_or_update_model_card
    original_upload = PeftModel._upload_modified_files

    def extra_of(model) -> str:
        info = getattr(model, TRAINING_ATTR, None)
        return _training_table(info) if info else ""

    def create_or_update_model_card(self, output_dir: str):
        original_card(self, output_dir)
        config = _lstmem_config(self)
        if config is not None:
            write_lstmem_section(output_dir, config, extra_of(self))

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        config = _lstmem_config(self)
        if config is not None:
            write_lstmem_section(working_dir, config, extra_of(self))
        return original_upload(self, working_dir, *args, **kwargs)

    create_or_update_model_card._lstmem = True
    create_or_update_model_card.__doc__ = original_card.__doc__
    PeftModel.create_or_update_model_card = create_or_update_model_card
    PeftModel._upload_modified_files = _upload_modified_files

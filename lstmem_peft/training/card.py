"""The LSTMem section of an adapter's model card (README.md next to the adapter files).

PEFT writes a generic card in ``PeftModel.save_pretrained``. :func:`write_model_card` adds what the
adapter is, how it is configured and trained, and the citation; :func:`push_to_hub` saves, writes the
card and uploads; :class:`~lstmem_peft.training.trainer.LSTMemTrainer` writes it whenever it saves. Nothing of
PEFT is patched. The section is replaced, not duplicated, when the card is written again.
"""

from __future__ import annotations

import os
import tempfile

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

from lstmem_peft.memory import constants as K

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
    """The active LSTMem adapter's config of a ``PeftModel`` (or any model with LSTMem layers)."""
    from lstmem_peft.tuner.history import find_memory

    return find_memory(model).config()


def write_model_card(model, output_dir: str) -> str:
    """Write (or refresh) the LSTMem section of ``output_dir/README.md`` for ``model``'s active adapter.

    ``model.save_pretrained(output_dir)`` writes PEFT's card (tags, base model, versions); call this
    after it to add what the adapter is, its settings, training facts recorded with
    :func:`record_training`, and the citation. :class:`~lstmem_peft.training.trainer.LSTMemTrainer` calls it
    whenever it saves, and :func:`push_to_hub` before it uploads. Returns the card's path.
    """
    info = getattr(model, TRAINING_ATTR, None)
    write_lstmem_section(output_dir, _lstmem_config(model), _training_table(info) if info else "")
    return os.path.join(output_dir, "README.md")


def push_to_hub(
    model, repo_id: str, *, commit_message: str = "Upload LSTMem adapter", private=None, **kwargs
):
    """Save ``model``'s adapter with its LSTMem model card and upload the folder to ``repo_id``.

    The same files as ``model.save_pretrained`` (adapter_config.json, adapter_model.safetensors) plus
    the card of :func:`write_model_card`. ``kwargs`` go to ``save_pretrained`` (e.g.
    ``selected_adapters``). Returns the ``CommitInfo`` of the upload.
    """
    api = HfApi()
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, **kwargs)
        write_model_card(model, folder)
        operations = [
            CommitOperationAdd(
                path_in_repo=os.path.relpath(os.path.join(root, name), folder),
                path_or_fileobj=os.path.join(root, name),
            )  # fmt: skip
            for root, _, names in sorted(os.walk(folder))
            for name in sorted(names)
        ]
        return api.create_commit(repo.repo_id, operations=operations, commit_message=commit_message)

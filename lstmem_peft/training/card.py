"""An LSTMem adapter's model card (README.md next to the adapter files).

PEFT's ``PeftModel.save_pretrained`` writes a generic card: some 200 lines of the Hub's template (most of
them "More Information Needed") and a ``base_model`` that is empty for a backbone built from a config.
:func:`write_model_card` writes the card instead: front matter that names the base model, then the
LSTMem section (what the adapter is, how to load it, its settings, training facts, framework versions,
the citation), then whatever text of the card's own is not PEFT's template. :func:`push_to_hub` saves,
writes the card and uploads; :class:`~lstmem_peft.training.trainer.LSTMemTrainer` writes it whenever it
saves. Nothing of PEFT is patched. The section is replaced, not duplicated, when the card is written again.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tempfile

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData

from lstmem_peft.memory import constants as K

BEGIN, END = "<!-- lstmem:begin -->", "<!-- lstmem:end -->"

TRAINING_ATTR = "lstmem_training_info"

#: A Hub model id (``name`` or ``owner/name``): what the front matter's ``base_model`` may hold (the Hub
#: refuses a local path there; the section still names it).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: The Hub's card template, which PEFT writes into a folder without a card: its title, and what every
#: field left unfilled holds (from the title to the last of these is the template; the card drops it).
TEMPLATE_TITLE, PLACEHOLDER = "# Model Card for Model ID", "[More Information Needed]"
#: The distributions whose versions the card lists.
FRAMEWORKS = {
    "lstmem-peft": "lstmem-peft",
    "peft": "PEFT",
    "transformers": "Transformers",
    "torch": "PyTorch",
}


def record_training(model, **info) -> None:
    """Attach training facts (base model, data, schedule) that the model card will list."""
    current = dict(getattr(model, TRAINING_ATTR, None) or {})
    current.update({k: v for k, v in info.items() if v is not None})
    object.__setattr__(model, TRAINING_ATTR, current)


def _training_table(info: dict) -> str:
    rows = ["### Training", "", "| | |", "| --- | --- |"]
    rows += [f"| {key.replace('_', ' ')} | {value} |" for key, value in info.items()]
    return "\n".join(rows)


def _framework_versions() -> str:
    lines = ["### Framework versions", ""]
    for dist, name in FRAMEWORKS.items():
        try:
            lines.append(f"- {name} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "\n".join(lines)


def hub_id(name: str | None) -> str | None:
    """``name`` if it reads as a Hub model id and is not a local folder, else ``None``."""
    if not name or not HUB_ID.fullmatch(name) or os.path.isdir(name):
        return None
    return name


def lstmem_card_section(config, extra: str = "", *, base_model: str | None = None, summary: str = "") -> str:
    """Markdown describing an LSTMem adapter and citing the paper: the card's first section.

    ``base_model`` (else the config's ``base_model_name_or_path``) is named in the title and the
    settings; ``summary``, a paragraph about this adapter, follows the title."""
    base = base_model or config.base_model_name_or_path
    layers = "all" if config.layers_to_transform is None else ", ".join(map(str, config.layers_to_transform))
    lines = [BEGIN, f"# LSTMem adapter for {base}" if base else "# LSTMem adapter", ""]
    if summary:
        lines += [summary.strip(), ""]
    lines += [
        "An online memory for a frozen causal LM ([LSTMem](#citation)): each memory layer keeps a cell",
        "state C and a hidden state D per sequence; readouts of D correct the attention queries and",
        "outputs. Load it with `import lstmem_peft` and `PeftModel.from_pretrained(base, repo_id)`, and",
        "keep the memory in a `lstmem_peft.MemoryCache` passed to `generate(..., memory_cache=cache)`.",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| base model | {base or 'not recorded (pass base_model= to write_model_card)'} |",
        f"| memory layers | {layers} |",
        f"| heads n_h x width r | {config.num_heads} x {config.r} |",
        f"| alpha | {config.alpha} |",
        f"| depth coupling | {config.depth_coupling} |",
        f"| block feedback | {config.block_feedback} (<= {config.feedback_positions} positions per block) |",
        f"| history block size | {config.block_size} |",
        f"| state dtype | {config.state_dtype} |",
        "",
    ]
    if extra:
        lines += [extra.strip(), ""]
    lines += [_framework_versions(), "", "### Citation", "", "```bibtex", K.PAPER_BIBTEX, "```", END]
    return "\n".join(lines)


def _own_text(text: str) -> str:
    """The card's text less the LSTMem section, PEFT's template and PEFT's framework-versions block:
    what a user (or a caller such as the demo's publisher) wrote, kept after the section."""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + text[text.index(END) + len(END) :]
    start, end = text.find(TEMPLATE_TITLE), text.rfind(PLACEHOLDER)
    if 0 <= start < end:  # the Hub's template, as PEFT writes it into a folder without a card
        text = text[:start] + text[end + len(PLACEHOLDER) :]
    text = re.sub(r"^### Framework versions\n+(- PEFT [^\n]*\n?)+", "", text, flags=re.M)
    return text.strip()


def write_lstmem_section(
    output_dir: str, config, extra: str = "", *, base_model: str | None = None, summary: str = ""
) -> None:
    """Write ``output_dir/README.md``: front matter, the LSTMem section first, then the card's own text."""
    path = os.path.join(output_dir, "README.md")
    card = ModelCard.load(path) if os.path.exists(path) else ModelCard("")
    base = base_model or config.base_model_name_or_path or None
    own = _own_text(card.text)
    section = lstmem_card_section(config, extra, base_model=base, summary=summary)
    text = "\n" + section + "\n" + (f"\n{own}\n" if own else "")
    data = {**card.data.to_dict(), "library_name": "peft", "base_model": hub_id(base)}  # None: left out
    tags = {t for t in data.get("tags") or [] if not t.startswith("base_model:")} | {"lstmem", "memory"}
    if data["base_model"]:
        tags.add(f"base_model:adapter:{data['base_model']}")
    data["tags"] = sorted(tags)
    # a fresh card, so that the front matter opens with base_model (the loaded one keeps its own order)
    card = ModelCard(f"---\n{ModelCardData(**data).to_yaml()}\n---\n{text}")
    card.save(path)


def _lstmem_config(model):
    """The active LSTMem adapter's config of a ``PeftModel`` (or any model with LSTMem layers)."""
    from lstmem_peft.tuner.history import find_memory

    return find_memory(model).config()


def _base_model_name(model) -> str | None:
    """The base model's Hub id or path as its config records it (``None``: built from a config)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_name_or_path", None) or None


def write_model_card(model, output_dir: str, *, base_model: str | None = None, summary: str = "") -> str:
    """Write (or refresh) ``output_dir/README.md``, the model card of ``model``'s active adapter.

    Call it after ``model.save_pretrained(output_dir)``, which writes PEFT's generic card: this one
    replaces PEFT's template with the LSTMem section (what the adapter is, how to load it, its settings,
    training facts recorded with :func:`record_training`, framework versions, the citation), first
    after the front matter, and keeps any text of the card's own after it. ``base_model``: the Hub id
    (or path) of the base model, named in the front matter and the section; by default the adapter
    config's ``base_model_name_or_path``, else the base model's ``name_or_path`` (none for a backbone
    built from a config: then pass it). ``summary``: a paragraph about this adapter, under the title.
    :class:`~lstmem_peft.training.trainer.LSTMemTrainer` calls it whenever it saves, and
    :func:`push_to_hub` before it uploads. Returns the card's path.
    """
    info = getattr(model, TRAINING_ATTR, None)
    config = _lstmem_config(model)
    base = base_model or config.base_model_name_or_path or _base_model_name(model)
    extra = _training_table(info) if info else ""
    write_lstmem_section(output_dir, config, extra, base_model=base, summary=summary)
    return os.path.join(output_dir, "README.md")


def push_to_hub(
    model,
    repo_id: str,
    *,
    commit_message: str = "Upload LSTMem adapter",
    private=None,
    base_model: str | None = None,
    **kwargs,
):
    """Save ``model``'s adapter with its LSTMem model card and upload the folder to ``repo_id``.

    The same files as ``model.save_pretrained`` (adapter_config.json, adapter_model.safetensors) plus
    the card of :func:`write_model_card` (``base_model`` as there). ``kwargs`` go to
    ``save_pretrained`` (e.g. ``selected_adapters``). Returns the ``CommitInfo`` of the upload.
    """
    api = HfApi()
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, **kwargs)
        write_model_card(model, folder, base_model=base_model)
        operations = [
            CommitOperationAdd(
                path_in_repo=os.path.relpath(os.path.join(root, name), folder),
                path_or_fileobj=os.path.join(root, name),
            )  # fmt: skip
            for root, _, names in sorted(os.walk(folder))
            for name in sorted(names)
        ]
        return api.create_commit(repo.repo_id, operations=operations, commit_message=commit_message)

"""A GGUF file converted once into a plain float32 safetensors folder (:func:`convert_gguf`), for
:func:`lstmem_peft.tuner.backbones.resolve_backbone`.

transformers reads the GGUF (config, tokenizer, weights; its config and tokenizer through the ``gguf``
package) and dequantises every tensor to float32. The model it returns is a plain one where
transformers can say so (``GgufConfig(dequantize=True)``); where it is still marked quantised it is
rebuilt from its config without the quantisation and given the same tensors. The folder is then
loaded back with a plain ``from_pretrained`` and checked tensor by tensor, bit for bit, against the
model read from the GGUF, and its tokenizer against the GGUF's. The weights are the dequantised
GGUF's, not the original checkpoint's: the record says so, with the source file's SHA-256.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import time
from collections import Counter
from pathlib import Path

from lstmem_peft.utils.extras import missing_extra

#: The file a converted folder holds its record in, and the record's format (a folder of another is converted again).
RECORD_NAME = "lstmem_backbone.json"
RECORD_FORMAT = 1
#: The pip extra that installs ``gguf`` (transformers reads a GGUF's config and tokenizer with it).
EXTRA = "backbones"

#: Text whose tokens and chat rendering the folder's tokenizer must give as the GGUF's does.
PROBE_TEXT = "Hello world! Memory keeps 42 facts, and <|im_end|> ends a turn."
PROBE_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
STEPS = (
    "hash the GGUF file",
    "read and dequantise the weights",
    "read the tokenizer",
    "write the safetensors folder",
    "check the folder against the GGUF",
)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(source: Path, out: Path, facts: dict, *, progress: bool = True) -> dict:
    """Convert the GGUF file ``source`` into the (empty, existing) folder ``out``; returns the record
    written there as ``lstmem_backbone.json``, last.

    Args:
        source: the GGUF file.
        out: the folder to write: ``config.json``, ``model.safetensors``, ``generation_config.json``,
            the tokenizer's files, ``README.md`` and the record.
        facts: what the record says about the source (:func:`~.backbones.source_facts`); the file's
            size, modification time, SHA-256 and tensor types are added.
        progress: show a progress bar of the steps (on stderr).

    Raises:
        ImportError: ``gguf`` is not installed (naming the ``backbones`` extra).
        RuntimeError: the folder does not load back to the same tensors or tokens.
    """
    try:
        import gguf  # noqa: F401  (transformers reads the GGUF's config and tokenizer with it)
    except ModuleNotFoundError as err:
        raise missing_extra(err, EXTRA, "Converting a GGUF backbone (lstmem models prepare)") from err
    from tqdm.auto import tqdm

    start = time.perf_counter()
    source, out = Path(source), Path(out)
    with tqdm(
        total=len(STEPS), desc=f"converting {facts.get('name', source.name)}", disable=not progress
    ) as bar:

        def step(i: int) -> None:
            bar.set_postfix_str(STEPS[i])
            if i:
                bar.update(1)

        step(0)
        stat = source.stat()
        record = copy.deepcopy(facts)
        record["source"] |= {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "sha256": file_sha256(source),
            "tensor_types": tensor_types(source),
        }
        step(1)
        model = read_model(source)
        step(2)
        tokenizer = read_tokenizer(source)
        step(3)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        step(4)
        with _quiet_transformers_bars():  # a reload of what was just written: only our bar
            check_folder(out, model, tokenizer)
        bar.update(1)
    record |= {
        "format": RECORD_FORMAT,
        "dtype": "float32",
        "config": _config_facts(model.config),
        "note": "Weights dequantised from the GGUF file's quantised blocks: close to, but not, the original "
        "checkpoint's weights.",
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "converted_with": _versions(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / "README.md").write_text(_readme(record))
    (out / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")  # last: the folder is complete
    return record


@contextlib.contextmanager
def _quiet_transformers_bars():
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def tensor_types(source: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file stores (``{"Q4_1": 210, "F32": 61, ...}``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    return dict(Counter(t.tensor_type.name for t in reader.tensors).most_common())


def read_model(source: Path):
    """The GGUF's model, dequantised to float32, as a plain (not quantised) transformers model in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    try:  # transformers >= 5.x: ask for a dense model outright
        from transformers import GgufConfig

        options = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older: the GGUF loader always dequantised
        options = {}
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True, **options
    )
    return plain_model(model).eval()


def plain_model(model):
    """``model`` without a quantisation mark: itself when it has none, else the same architecture built
    from its config without ``quantization_config`` and given its tensors (what ``Trainer`` and
    ``save_pretrained`` accept)."""
    if getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config"):
        return model
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(model.config).from_dict(settings)
    plain = type(model)(config).to(next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def read_tokenizer(source: Path):
    """The GGUF's tokenizer, as transformers builds it from the file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)


def check_folder(folder: Path, model, tokenizer) -> None:
    """The folder loads with a plain ``from_pretrained``, unquantised, to tensors equal bit for bit to
    ``model``'s, and its tokenizer gives ``tokenizer``'s tokens and chat rendering.

    Raises:
        RuntimeError: naming the first difference.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    if getattr(again, "hf_quantizer", None) is not None or hasattr(again.config, "quantization_config"):
        raise RuntimeError(f"{folder} loads as a quantised model; expected a plain float32 one")
    expected, got = model.state_dict(), again.state_dict()
    if expected.keys() != got.keys():
        raise RuntimeError(f"{folder} holds tensors {sorted(set(got) ^ set(expected))[:5]} the GGUF does not")
    for name, tensor in expected.items():
        if not torch.equal(tensor, got[name]):
            raise RuntimeError(f"{folder}: {name} differs from the GGUF's dequantised tensor")
    del again, got
    reloaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if reloaded(PROBE_TEXT)["input_ids"] != tokenizer(PROBE_TEXT)["input_ids"]:
        raise RuntimeError(f"{folder}: the saved tokenizer splits text otherwise than the GGUF's")
    if tokenizer.chat_template and _chat(reloaded) != _chat(tokenizer):
        raise RuntimeError(f"{folder}: the saved chat template renders otherwise than the GGUF's")


def _chat(tokenizer) -> str:
    return tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)


def _config_facts(config) -> dict:
    keys = (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    )
    return {key: getattr(config, key, None) for key in keys}


def _versions() -> dict:
    import importlib.metadata

    versions = {}
    for package in ("lstmem-peft", "transformers", "torch", "gguf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _readme(record: dict) -> str:
    source = record["source"]
    types = ", ".join(f"{count} {kind}" for kind, count in source["tensor_types"].items())
    package = " ".join(filter(None, (source["package"], source.get("package_version"))))
    return (
        f"# {record['name']}: converted by lstmem-peft\n\n"
        f"A plain float32 safetensors folder converted from `{source['file']}` of the pip package "
        f"{package} (SHA-256 `{source['sha256']}`, "
        f"{source['size']:,} bytes; tensors: {types}), made from `{record.get('original') or 'unknown'}` "
        f"(licence: {record.get('license') or 'unknown'}).\n\n"
        f"The weights are the GGUF's dequantised tensors ({record.get('quantisation') or 'quantised'}), "
        "not the original checkpoint's: close to them, not equal. Load the folder with "
        "`AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`; "
        f"`{RECORD_NAME}` records the conversion ({record['converted_at']}, {record['seconds']} s).\n"
    )

"""Run a benchmark protocol on a model with an LSTMem adapter, and on its plain backbone beside it.

For every independent :class:`~lstmem_peft.eval.protocol.History` (paper App. C.4, "Memory state
during evaluation"):

1. the memory is reset (a fresh :class:`~lstmem_peft.MemoryCache`);
2. the history is written in ``block_size`` (2,048) token blocks with block-end feedback after every
   block, the last included (:func:`~lstmem_peft.write_history`). When the benchmark gives the
   history as segments (LoCoMo sessions), they are replayed one after another in order, each in
   blocks of at most ``block_size`` tokens. Unless ``memory_only``, the same tokens also fill the KV
   cache, in the benchmark's official prompt format;
3. the memory state and the KV cache after the last block are the *snapshot*. Every question starts
   from a copy of the memory snapshot and from the KV cache cut back to the history, so answering
   one question never affects another and scores do not depend on question order;
4. the question is prefilled and the answer generated; both read memory and update it token by token
   (the adapter's ``update_during_generation``), with no feedback.

The plain backbone (adapter disabled) answers the same prompts from the same history KV cache (in
``memory_only`` mode it sees the questions alone: the no-history reference). Sampling follows the
paper (temperature 0.4, top-p 0.9, top-k 10); the generator is seeded with ``seed`` before every
question, so a question's answer does not depend on which questions came before it.

Outputs (``out_dir``): ``predictions.jsonl`` (one line per system and question: prediction, gold,
scores), ``summary.json`` (per-group and overall scores per system, with the settings, versions and
date) and ``results.md`` (the backbone and the adapter side by side). They are written into
``<out_dir>.partial`` and moved over ``out_dir`` only when the run completes, so a run that fails
never leaves a mix of two runs' files.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import constants as K
from ..cache import MemoryCache
from ..history import find_tuner, write_history
from .protocol import Benchmark, History, Question

SYSTEMS = ("base", "lstmem")
LONG_HISTORY_BLOCKS = 8  # histories longer than this many blocks get their own progress bar
SYSTEM_NAMES = {"base": "backbone", "lstmem": "LSTMem"}


@dataclass
class Decoding:
    """How answers are decoded. The defaults are the paper's (App. B); ``greedy=True`` for argmax."""

    greedy: bool = False
    temperature: float = K.EVAL_TEMPERATURE
    top_p: float = K.EVAL_TOP_P
    top_k: int = K.EVAL_TOP_K
    seed: int = K.EVAL_SEED

    def generate_kwargs(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


# ---------------------------------------------------------------------- prompts
class PromptBuilder:
    """Token ids of a history and of each question, in one user turn of the model's chat template.

    The model reads ``template(history.text + question.prompt)``. The template's opening and the
    history form the shared prefix (written into memory and the KV cache once per history); the
    question and the template's closing (the assistant cue) are the per-question part.

    Args:
        tokenizer: the model's tokenizer.
        chat_template: wrap the prompt in the tokenizer's chat template; default: when it has one.
        template_kwargs: extra arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self, tokenizer, chat_template: bool | None = None, template_kwargs: dict | None = None
    ) -> None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError(
                "chat_template=True but the tokenizer has no chat template; pass chat_template=False"
            )
        self.tokenizer = tokenizer
        self.chat_template = has_template if chat_template is None else chat_template
        self.template_kwargs = dict(template_kwargs or {})

    def _render(self, content: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

    def _segments(self, history: History) -> list[str]:
        segments = history.segments or [history.text]
        if "".join(segments) != history.text:
            raise ValueError(f"history {history.id!r}: its segments do not add up to its text")
        return segments

    def history_ids(self, history: History, in_prompt: bool = True) -> list[list[int]]:
        """Token ids of the history's segments (the first with the template's opening when ``in_prompt``)."""
        segments = self._segments(history)
        if in_prompt and self.chat_template:
            # a non-space character after the history, as templates that trim the message would
            # otherwise eat the history's trailing whitespace
            full = self._render(history.text + "?")
            start = full.find(history.text)
            if start < 0:
                raise ValueError(
                    "the chat template changes the history text, so the history cannot be cached as a prompt "
                    "prefix; evaluate with chat_template=False (CLI: --no-chat-template)"
                )
            segments = [full[:start] + segments[0]] + segments[1:]
            return [self._ids(s, special=False) for s in segments]
        return [self._ids(s, special=i == 0) for i, s in enumerate(segments)]

    def question_ids(self, history: History, question: Question, in_prompt: bool = True) -> list[int]:
        """Token ids that follow the history (``in_prompt``), or the question as a prompt of its own."""
        if not in_prompt:
            if self.chat_template:
                return self._ids(self._render(question.prompt.lstrip()), special=False)
            return self._ids(question.prompt.lstrip(), special=True)
        if not self.chat_template:
            return self._ids(question.prompt, special=False)
        full = self._render(history.text + question.prompt)
        start = full.find(history.text)
        if start < 0:
            raise ValueError("the chat template changes the prompt text; evaluate with chat_template=False")
        return self._ids(full[start + len(history.text) :], special=False)


# ---------------------------------------------------------------------- KV snapshot
class _KVSnapshot:
    """Restores a KV cache to its state after the history.

    Full-attention layers are cut back to the history length (cheap, exact). A cache with
    sliding-window or other bounded layers cannot be cut back, so it is deep-copied once and copied
    again for every question.
    """

    def __init__(self, cache) -> None:
        from transformers.cache_utils import DynamicLayer

        self.cache = cache
        self.length = cache.get_seq_length()
        layers = getattr(cache, "layers", [])
        self.croppable = all(type(layer) is DynamicLayer for layer in layers)
        self.copy = None if self.croppable else copy.deepcopy(cache)

    def restore(self):
        if not self.croppable:
            return copy.deepcopy(self.copy)
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:
            self.cache.crop(-extra)
        return self.cache


# ---------------------------------------------------------------------- answering
def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@dataclass
class _Run:
    model: Any
    tokenizer: Any
    builder: PromptBuilder
    decoding: Decoding
    block_size: int
    memory_only: bool
    device: torch.device
    pad_token_id: int | None
    has_adapter: bool
    progress: bool = False
    config: Any = field(default=None)


def _prefill_plain(run: _Run, ids: torch.Tensor, kv) -> None:
    for start in range(0, ids.shape[1], run.block_size):
        run.model(
            input_ids=ids[:, start : start + run.block_size],
            past_key_values=kv,
            use_cache=True,
            logits_to_keep=1,
        )


@torch.no_grad()
def _answer(run: _Run, history: History, system: str) -> Iterator[tuple[Question, str]]:
    """Answer every question of ``history`` with one system, each from the same snapshot."""
    from transformers import DynamicCache

    with_memory = system == "lstmem"
    in_prompt = not run.memory_only
    pieces = [
        torch.tensor([p], dtype=torch.long, device=run.device)
        for p in run.builder.history_ids(history, in_prompt)
    ]
    kv = DynamicCache(config=run.config) if in_prompt else None
    memory = MemoryCache() if with_memory else None  # reset before every independent history
    context = run.model.disable_adapter() if run.has_adapter and not with_memory else nullcontext()
    with context:
        for piece in pieces:
            if piece.shape[1] == 0:
                continue
            if with_memory:  # a bar of its own for long histories (MemoryAgentBench contexts)
                long = piece.shape[1] > LONG_HISTORY_BLOCKS * run.block_size
                write_history(
                    run.model,
                    piece,
                    memory,
                    block_size=run.block_size,
                    past_key_values=kv,
                    progress=run.progress and long,
                )
            elif kv is not None:
                _prefill_plain(run, piece, kv)
        snapshot = _KVSnapshot(kv) if kv is not None else None
        prefix = torch.cat(pieces, dim=1) if in_prompt else None
        for question in history.questions:
            q_ids = torch.tensor([run.builder.question_ids(history, question, in_prompt)], device=run.device)
            input_ids = q_ids if prefix is None else torch.cat([prefix, q_ids], dim=1)
            kwargs = dict(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=question.max_new_tokens,
                pad_token_id=run.pad_token_id,
                **run.decoding.generate_kwargs(),
            )
            if snapshot is not None:
                kwargs["past_key_values"] = snapshot.restore()
            if with_memory:
                kwargs["memory_cache"] = memory.clone()
            _seed(run.decoding.seed)
            output = run.model.generate(**kwargs)
            text = run.tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
            yield question, text.strip()


# ---------------------------------------------------------------------- reports
def _percent(value: float) -> str:
    return f"{100 * value:.2f}"


def markdown_table(summary: dict[str, Any]) -> str:
    """The systems side by side: one row per group (and family, when present) and overall.

    Scores are percentages; ``Δ`` is LSTMem minus the backbone.
    """
    systems = [s for s in SYSTEMS if s in summary["systems"]]
    metrics = summary["metrics"]
    header = ["", "questions"]
    for metric in metrics:
        header += [f"{SYSTEM_NAMES[s]} {metric}" for s in systems]
        if len(systems) == 2:
            header.append(f"Δ {metric}")
    first = summary["systems"][systems[0]]
    levels = [("groups", name) for name in first["groups"]]
    levels += [
        (level, name) for level, rows in first.items() if level not in ("groups", "overall") for name in rows
    ]
    levels.append(("overall", None))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level, name in levels:
        cells = [
            summary["systems"][s][level] if name is None else summary["systems"][s][level][name]
            for s in systems
        ]
        row = [
            "**overall**" if name is None else (f"*{name}*" if level != "groups" else name),
            str(cells[0]["questions"]),
        ]
        for metric in metrics:
            row += [_percent(c[metric]) for c in cells]
            if len(systems) == 2:
                row.append(f"{100 * (cells[1][metric] - cells[0][metric]):+.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _versions() -> dict[str, str]:
    import peft
    import transformers

    from .. import __version__

    return {
        "lstmem_peft": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


# ---------------------------------------------------------------------- loading
def load_model(model_id: str, adapter: str | None = None, dtype: str = "auto", device: str | None = None):
    """A causal LM (Hub id or local folder), its tokenizer, and optionally an LSTMem adapter on it.

    Returns ``(model, tokenizer)``; with ``adapter`` the model is the ``PeftModel``.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lstmem_peft  # noqa: F401  (registers the LSTMEM method with PEFT)

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch_dtype).to(device).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return model, tokenizer


# ---------------------------------------------------------------------- entry point
def evaluate(
    model,
    tokenizer,
    benchmark: Benchmark,
    out_dir: str | os.PathLike | None = None,
    *,
    memory_only: bool = False,
    decoding: Decoding | None = None,
    block_size: int | None = None,
    compare_base: bool = True,
    chat_template: bool | None = None,
    template_kwargs: dict | None = None,
    progress: bool = True,
    run_info: dict | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (with its LSTMem adapter, and its backbone with the adapter disabled).

    Args:
        model: a causal LM carrying an LSTMem adapter (a ``PeftModel``), or a plain causal LM (then
            only the backbone is evaluated).
        tokenizer: its tokenizer.
        benchmark: the protocol (:class:`~lstmem_peft.eval.locomo.LoCoMo`,
            :class:`~lstmem_peft.eval.hotpotqa.HotpotQA`, :class:`~lstmem_peft.eval.mab.MemoryAgentBench`).
        out_dir: where ``predictions.jsonl``, ``summary.json`` and ``results.md`` go (``None``: nowhere).
        memory_only: write the history into memory only; the questions are asked without it in the
            prompt (the backbone then answers with no history at all).
        decoding: :class:`Decoding` (the paper's sampling by default).
        block_size: history block length; default: the adapter's ``block_size`` (2,048).
        compare_base: also evaluate the backbone with the adapter disabled.
        chat_template, template_kwargs: see :class:`PromptBuilder`.
        progress: show progress bars.
        run_info: extra fields for ``summary.json`` (e.g. model and adapter names).

    Returns:
        The summary (also written to ``summary.json``): ``{"benchmark", "mode", "metrics",
        "systems": {"base": ..., "lstmem": ...}, ...}`` with each system's
        :meth:`Benchmark.summarize` output.
    """
    decoding = decoding or Decoding()
    try:
        tuner = find_tuner(model)
    except TypeError:
        tuner = None
    systems = (["base"] if compare_base or tuner is None else []) + (["lstmem"] if tuner is not None else [])
    if tuner is not None:
        config = tuner.peft_config[tuner._single_active_adapter()]
        block_size = block_size or config.block_size
    block_size = block_size or K.BLOCK_SIZE
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run = _Run(
        model=model,
        tokenizer=tokenizer,
        builder=PromptBuilder(tokenizer, chat_template, template_kwargs),
        decoding=decoding,
        block_size=block_size,
        memory_only=memory_only,
        device=next(model.parameters()).device,
        pad_token_id=pad,
        has_adapter=tuner is not None,
        progress=progress,
        config=getattr(model, "config", None),
    )
    out_dir = None if out_dir is None else os.fspath(out_dir).rstrip("/\\")
    sink = stage = None
    if out_dir is not None:  # written into <out>.partial, moved over <out> only when the run completes
        stage = out_dir + ".partial"
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        sink = open(os.path.join(stage, "predictions.jsonl"), "w", encoding="utf-8")
    records: dict[str, list[dict]] = {s: [] for s in systems}
    was_training = model.training
    model.eval()
    try:
        bar = tqdm(
            benchmark.histories(),
            total=len(benchmark),
            desc=f"{benchmark.name}",
            unit="history",
            disable=not progress,
        )
        for history in bar:
            for system in systems:
                for question, prediction in _answer(run, history, system):
                    record = {
                        "system": system,
                        "history": history.id,
                        "id": question.id,
                        "group": question.group,
                        "prediction": prediction,
                        "gold": question.answer,
                        "scores": benchmark.score(question, prediction),
                        "meta": question.meta,
                    }
                    records[system].append(record)
                    if sink is not None:
                        sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            if sink is not None:
                sink.flush()
            bar.set_postfix(questions=len(records[systems[0]]))
    finally:
        if sink is not None:
            sink.close()
        model.train(was_training)
    summary = {
        "benchmark": benchmark.name,
        "mode": "memory-only" if memory_only else "history+memory",
        "metrics": list(benchmark.metrics),
        "decoding": asdict(decoding),
        "block_size": block_size,
        "histories": len({r["history"] for r in records[systems[0]]}),
        "questions": len(records[systems[0]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        **(run_info or {}),
        "systems": {s: benchmark.summarize(records[s]) for s in systems},
    }
    if out_dir is not None:
        with open(os.path.join(stage, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, ensure_ascii=False)
        with open(os.path.join(stage, "results.md"), "w", encoding="utf-8") as fh:
            fh.write(f"# {benchmark.name} ({summary['mode']})\n\n{markdown_table(summary)}")
        _replace_folder(stage, out_dir)
    return summary


def _replace_folder(new: str, target: str) -> None:
    """Put folder ``new`` in place of ``target`` by renames: a run that fails before this point
    leaves the previous run's files untouched, and at no point is either set lost."""
    previous = target + ".previous"
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, previous)
    os.replace(new, target)
    shutil.rmtree(previous, ignore_errors=True)

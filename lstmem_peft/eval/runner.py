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
date, the protocol, and the same predictions scored under both protocols), ``results.md`` (the
backbone and the adapter side by side, then both protocols side by side) and ``scores.png``. They are
written into ``<out_dir>.partial`` and moved over ``out_dir`` only when the run completes, so a run
that fails never leaves a mix of two runs' files; ``resume=True`` continues an interrupted run from
the histories it finished (same settings only). :func:`rescore` re-scores a predictions file under
another protocol without generating.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.tuner.history import find_memory, write_history
from lstmem_peft.utils.errors import DataFormatError, MissingDataError, describe, read_json_object

from .protocol import Benchmark, History, Question
from .scorers import PROTOCOLS

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

    def _render(self, content: str, system: str | None = None) -> str:
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.tokenizer.apply_chat_template(
            messages,
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
            full = self._render(history.text + "?", history.system)
            start = full.find(history.text)
            if start < 0:
                raise ValueError(
                    "the chat template changes the history text, so the history cannot be cached as a prompt "
                    "prefix; evaluate with chat_template=False (CLI: --no-chat-template)"
                )
            segments = [full[:start] + segments[0]] + segments[1:]
            return [self._ids(s, special=False) for s in segments]
        if in_prompt and history.system is not None:  # no chat template: the system text opens the prompt
            segments = [history.system + "\n\n" + segments[0]] + segments[1:]
        return [self._ids(s, special=i == 0) for i, s in enumerate(segments)]

    def question_ids(self, history: History, question: Question, in_prompt: bool = True) -> list[int]:
        """Token ids that follow the history (``in_prompt``), or the question as a prompt of its own."""
        if not in_prompt:
            if self.chat_template:
                return self._ids(self._render(question.prompt.lstrip(), history.system), special=False)
            opening = "" if history.system is None else history.system + "\n\n"
            return self._ids(opening + question.prompt.lstrip(), special=True)
        if not self.chat_template:
            return self._ids(question.prompt, special=False)
        full = self._render(history.text + question.prompt, history.system)
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


def protocols_table(summary: dict[str, Any]) -> str:
    """The primary metric per group (and family) and overall, each system under each protocol.

    Reads ``summary["by_protocol"]``; scores are percentages.
    """
    by_protocol = summary["by_protocol"]
    protocols = [p for p in PROTOCOLS if p in by_protocol]
    systems = [s for s in SYSTEMS if s in by_protocol[protocols[0]]]
    metric = summary["metrics"][0]
    header = ["", "questions"] + [f"{SYSTEM_NAMES[s]} {metric} ({p})" for p in protocols for s in systems]
    first = by_protocol[protocols[0]][systems[0]]
    levels = [("groups", name) for name in first["groups"]]
    levels += [(lvl, n) for lvl, rows in first.items() if lvl not in ("groups", "overall") for n in rows]
    levels.append(("overall", None))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level, name in levels:

        def cell(p: str, s: str, level=level, name=name) -> dict:
            block = by_protocol[p][s][level]
            return block if name is None else block[name]

        label = "**overall**" if name is None else (f"*{name}*" if level != "groups" else name)
        row = [label, str(cell(protocols[0], systems[0])["questions"])]
        row += [_percent(cell(p, s)[metric]) for p in protocols for s in systems]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_scores(summary: dict[str, Any], path: str) -> str | None:
    """Bar chart of the primary metric per group (and family) and overall, one bar per system and
    protocol, written to ``path``. Returns ``path``, or ``None`` (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no scores.png (pip install matplotlib)", stacklevel=2)
        return None
    by_protocol = summary.get("by_protocol") or {summary.get("protocol") or "own": summary["systems"]}
    metric = summary["metrics"][0]
    bars = [(p, s) for p in by_protocol for s in SYSTEMS if s in by_protocol[p]]
    first = by_protocol[bars[0][0]][bars[0][1]]
    names = list(first["groups"]) + [
        n for lvl in first if lvl not in ("groups", "overall") for n in first[lvl]
    ]

    def value(block: dict, name: str | None) -> float:
        if name is None:
            return block["overall"][metric]
        for level, rows in block.items():
            if level != "overall" and name in rows:
                return rows[name][metric if metric in rows[name] else "score"]
        return float("nan")

    labels = names + ["overall"]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) * len(bars) / 2 + 2), 4))
    for i, (protocol, system) in enumerate(bars):
        heights = [100 * value(by_protocol[protocol][system], n) for n in names + [None]]
        offsets = [x + (i - (len(bars) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(offsets, heights, width, label=f"{SYSTEM_NAMES[system]} ({protocol})")
    ax.set_ylim(0, 100)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(f"{metric} (%)")
    ax.set_title(f"{summary['benchmark']}: LSTMem against its backbone")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _versions() -> dict[str, str]:
    import peft
    import transformers

    from lstmem_peft.utils.version import __version__

    return {
        "lstmem_peft": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


# ---------------------------------------------------------------------- loading
def load_model(model_id: str, adapter: str | None = None, dtype: str = "auto", device: str | None = None):
    """A causal LM (Hub id or local folder), its tokenizer, and optionally an LSTMem adapter on it
    (:func:`lstmem_peft.tuner.loading.load_model_and_adapter`). Returns ``(model, tokenizer)``; with
    ``adapter`` the model is the ``PeftModel``."""
    from lstmem_peft.tuner.loading import load_model_and_adapter

    return load_model_and_adapter(model_id, adapter, dtype=dtype, device=device)


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
    resume: bool = False,
    plot: bool = True,
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
        resume: keep the predictions an interrupted run left in ``<out_dir>.partial`` (histories whose
            every question was answered by every system) and answer only the rest; a partial run made
            with other settings is refused (ValueError naming what differs).
        plot: also write ``scores.png`` (per-group scores, backbone beside LSTMem; needs matplotlib).

    Returns:
        The summary (also written to ``summary.json``): ``{"benchmark", "protocol", "mode", "metrics",
        "systems": {"base": ..., "lstmem": ...}, "by_protocol": {"official": ..., "paper": ...}, ...}``
        with each system's :meth:`Benchmark.summarize` output; ``by_protocol`` holds the same
        predictions scored under each protocol (the prompts are ``protocol``'s).
    """
    decoding = decoding or Decoding()
    try:
        memory = find_memory(model)
    except TypeError:
        memory = None
    systems = (["base"] if compare_base or memory is None else []) + (
        ["lstmem"] if memory is not None else []
    )
    if memory is not None:
        config = memory.config()
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
        has_adapter=memory is not None,
        progress=progress,
        config=getattr(model, "config", None),
    )
    settings = {
        **benchmark.settings(),
        "mode": "memory-only" if memory_only else "history+memory",
        "systems": systems,
        "decoding": asdict(decoding),
        "block_size": block_size,
        "chat_template": run.builder.chat_template,
        "template_kwargs": run.builder.template_kwargs,
        **(run_info or {}),
    }
    settings = json.loads(json.dumps(settings))  # as it reads back from settings.json
    out_dir = None if out_dir is None else os.fspath(out_dir).rstrip("/\\")
    sink = stage = None
    kept: dict[str, list[dict]] = {}
    if out_dir is not None:  # written into <out>.partial, moved over <out> only when the run completes
        stage = out_dir + ".partial"
        kept = _resumable(stage, settings) if resume else {}
        if not kept:
            shutil.rmtree(stage, ignore_errors=True)
            os.makedirs(stage)
            with open(os.path.join(stage, SETTINGS_FILE), "w", encoding="utf-8") as fh:
                json.dump(settings, fh, indent=2, ensure_ascii=False)
        sink = open(os.path.join(stage, "predictions.jsonl"), "a" if kept else "w", encoding="utf-8")
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
            done = _complete(kept.pop(history.id, []), history, systems)
            for system in systems:
                if done is not None:
                    records[system].extend(r for r in done if r["system"] == system)
                    continue
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
        "protocol": getattr(benchmark, "protocol", None),
        "mode": settings["mode"],
        "metrics": list(benchmark.metrics),
        "decoding": asdict(decoding),
        "block_size": block_size,
        "histories": len({r["history"] for r in records[systems[0]]}),
        "questions": len(records[systems[0]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "settings": settings,
        **(run_info or {}),
        "systems": {s: benchmark.summarize(records[s]) for s in systems},
    }
    summary["by_protocol"] = _by_protocol(benchmark, records)
    if out_dir is not None:
        if resume:  # the file now holds the kept histories' lines first: write it in run order
            _write_records(os.path.join(stage, "predictions.jsonl"), records, systems)
        _write_reports(stage, summary, plot)
        os.remove(os.path.join(stage, SETTINGS_FILE))
        _replace_folder(stage, out_dir)
    return summary


SETTINGS_FILE = "settings.json"


def _resumable(stage: str, settings: dict[str, Any]) -> dict[str, list[dict]]:
    """Records an interrupted run left in ``stage``, by history id; ``{}`` when there is nothing to
    resume. Raises ValueError when that run used other settings."""
    path = os.path.join(stage, SETTINGS_FILE)
    predictions = os.path.join(stage, "predictions.jsonl")
    if not (os.path.isfile(path) and os.path.isfile(predictions)):
        return {}
    with open(path, encoding="utf-8") as fh:
        previous = json.load(fh)
    differ = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
    if differ:
        details = "; ".join(f"{k}: {previous.get(k)!r} then, {settings.get(k)!r} now" for k in differ)
        raise ValueError(
            f"cannot resume {stage}: it was started with other settings ({details}); "
            "run again with the same settings, or without --resume to start over"
        )
    kept: dict[str, list[dict]] = {}
    with open(predictions, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the interruption
                    continue
                kept.setdefault(record["history"], []).append(record)
    return kept


def _complete(records: list[dict], history: History, systems: list[str]) -> list[dict] | None:
    """``records`` when they answer every question of ``history`` for every system, else ``None``."""
    wanted = {q.id for q in history.questions}
    for system in systems:
        got = [r["id"] for r in records if r["system"] == system]
        if len(got) != len(wanted) or set(got) != wanted:
            return None
    return records


def _write_records(path: str, records: dict[str, list[dict]], systems: list[str]) -> None:
    """Per-question records in run order (history by history, system by system), atomically."""
    by_history: dict[str, list[dict]] = {}
    for system in systems:
        for record in records[system]:
            by_history.setdefault(record["history"], []).append(record)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for rows in by_history.values():
            for system in systems:
                for record in rows:
                    if record["system"] == system:
                        fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def _by_protocol(benchmark: Benchmark, records: dict[str, list[dict]]) -> dict[str, Any]:
    """Each system's summary with the same predictions scored under every protocol."""
    if getattr(benchmark, "protocol", None) is None:
        return {}
    out = {}
    for protocol in PROTOCOLS:
        scorer = benchmark if protocol == benchmark.protocol else benchmark.with_protocol(protocol)
        out[protocol] = {s: scorer.summarize(rescore_records(scorer, rows)) for s, rows in records.items()}
    return out


def rescore_records(benchmark: Benchmark, records: list[dict]) -> list[dict]:
    """The records with ``scores`` recomputed by ``benchmark`` (its protocol) from prediction and gold."""
    out = []
    for record in records:
        question = Question(record["id"], "", record["gold"], 0, record["group"], record.get("meta") or {})
        out.append({**record, "scores": benchmark.score(question, record["prediction"])})
    return out


PREDICTION_FIELDS = ("system", "history", "id", "group", "prediction", "gold")


def read_predictions(path: str) -> list[dict[str, Any]]:
    """The per-question records of an ``lstmem eval`` run's ``predictions.jsonl``; anything else raises a
    :class:`~lstmem_peft.utils.errors.DataFormatError` naming the file and the line."""
    expected = (
        "the predictions.jsonl an lstmem eval run wrote (one JSON object a line with "
        + ", ".join(PREDICTION_FIELDS)
        + ")"
    )
    fix = "Pass RUN/predictions.jsonl of a finished lstmem eval run (RUN: its --out folder)"
    if not os.path.exists(path):
        raise MissingDataError(path, expected, "no such file", fix)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "predictions.jsonl")):
            fix = f"Pass {os.path.join(path, 'predictions.jsonl')}"
        raise DataFormatError(path, expected, "a folder", fix)
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    got = f"line {n} is not JSON ({err.msg} at column {err.colno})"
                    raise DataFormatError(path, expected, got, fix) from None
                if not isinstance(row, dict):
                    raise DataFormatError(path, expected, f"line {n} is {describe(row)}", fix)
                missing = [k for k in PREDICTION_FIELDS if k not in row]
                if missing:
                    got = f"line {n} has no {missing[0]!r} field ({describe(row)})"
                    raise DataFormatError(path, expected, got, fix)
                rows.append(row)
    except UnicodeDecodeError:
        raise DataFormatError(path, expected, "not UTF-8 text", fix) from None
    if not rows:
        raise DataFormatError(path, expected, "the file is empty (no predictions)", fix)
    return rows


def rescore(
    predictions: str | os.PathLike,
    benchmark: Benchmark,
    out_dir: str | os.PathLike,
    plot: bool = True,
) -> dict[str, Any]:
    """Re-score a run's ``predictions.jsonl`` under ``benchmark``'s protocol, without generating.

    ``benchmark`` supplies the scoring rules (and, for MemoryAgentBench's ReDial, the movie
    catalogue); the predictions' gold answers and metadata are used as recorded. Writes
    ``predictions.jsonl`` (new scores), ``summary.json`` and ``results.md`` to ``out_dir`` (through
    ``<out_dir>.partial``); the run's own ``summary.json``, when next to the predictions, is kept under
    ``"generated"``.
    """
    predictions = os.fspath(predictions)
    rows = read_predictions(predictions)
    origin = os.path.join(os.path.dirname(predictions), "summary.json")
    generated = None
    if os.path.isfile(origin):
        expected = "the summary.json lstmem eval wrote beside the predictions (a JSON object)"
        fix = "Restore it, or re-score a copy of predictions.jsonl in a folder of its own"
        generated = read_json_object(origin, expected, fix)
        if generated.get("benchmark") not in (None, benchmark.name):
            got = f"a {generated['benchmark']} run (its summary.json says so)"
            fix = f"Run lstmem eval {generated['benchmark']} --rescore ..., or pass a {benchmark.name} run"
            raise DataFormatError(predictions, f"the predictions of a {benchmark.name} run", got, fix)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    records = {s: rescore_records(benchmark, [r for r in rows if r["system"] == s]) for s in systems}
    summary = {
        "benchmark": benchmark.name,
        "protocol": getattr(benchmark, "protocol", None),
        "rescored_from": predictions,
        "metrics": list(benchmark.metrics),
        "mode": (generated or {}).get("mode", "unknown"),
        "histories": len({r["history"] for r in records[systems[0]]}),
        "questions": len(records[systems[0]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "generated": None
        if generated is None
        else {k: v for k, v in generated.items() if k != "by_protocol"},
        "systems": {s: benchmark.summarize(records[s]) for s in systems},
    }
    summary["by_protocol"] = _by_protocol(benchmark, records)
    out_dir = os.fspath(out_dir).rstrip("/\\")
    stage = out_dir + ".partial"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    _write_records(os.path.join(stage, "predictions.jsonl"), records, systems)
    _write_reports(stage, summary, plot)
    _replace_folder(stage, out_dir)
    return summary


def _write_reports(folder: str, summary: dict[str, Any], plot: bool) -> None:
    """``summary.json``, ``results.md`` (both protocols side by side) and, with ``plot``, ``scores.png``."""
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, ensure_ascii=False)
    title = f"# {summary['benchmark']} ({summary['mode']}, {summary.get('protocol') or 'own'} protocol)"
    text = f"{title}\n\n{markdown_table(summary)}"
    if summary.get("by_protocol"):
        text += f"\n## Scored under both protocols\n\n{protocols_table(summary)}"
    with open(os.path.join(folder, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    if plot:
        plot_scores(summary, os.path.join(folder, "scores.png"))


def _replace_folder(new: str, target: str) -> None:
    """Put folder ``new`` in place of ``target`` by renames: a run that fails before this point
    leaves the previous run's files untouched, and at no point is either set lost."""
    previous = target + ".previous"
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, previous)
    os.replace(new, target)
    shutil.rmtree(previous, ignore_errors=True)

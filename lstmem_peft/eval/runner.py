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

Outputs (``out_dir``; written by :mod:`.outputs`): ``predictions.jsonl`` (one line per system and
question: prediction, gold, scores), ``summary.json`` (per-group and overall scores per system, with
the settings, versions and date, the protocol, and the same predictions scored under both
protocols), ``results.md`` (the backbone and the adapter side by side, then both protocols side by
side) and ``scores.png``. They are written into ``<out_dir>.partial`` and moved over ``out_dir`` only
when the run completes, so a run that fails never leaves a mix of two runs' files; ``resume=True``
continues an interrupted run from the histories it finished (same settings only). :func:`rescore`
re-scores a predictions file under another protocol without generating. The prompts' token ids
come from :class:`~lstmem_peft.eval.prompts.PromptBuilder`.
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

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.tuner.history import find_memory, write_history
from lstmem_peft.tuner.kv_argument import kv_kwargs
from lstmem_peft.utils.errors import DataFormatError, read_json_object

from .outputs import (
    SYSTEMS,
    PartialRun,
    read_predictions,
    replace_folder,
    versions,
    write_records,
    write_reports,
)
from .prompts import PromptBuilder
from .protocol import Benchmark, History, Question
from .scorers import PROTOCOLS

LONG_HISTORY_BLOCKS = 8  # histories longer than this many blocks get their own progress bar


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
    """What answering needs, resolved once per run by :func:`_setup`."""

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
            **kv_kwargs(run.model, kv),
            use_cache=True,
            logits_to_keep=1,
        )


def fill_history(run: _Run, pieces: list[torch.Tensor], memory: MemoryCache | None, kv) -> None:
    """Feed the history's pieces (``(1, n)`` token ids each): written into ``memory`` (and ``kv``, when
    given) block by block with feedback, or, without a memory, prefilled into ``kv`` alone."""
    for piece in pieces:
        if piece.shape[1] == 0:
            continue
        if memory is not None:  # a bar of its own for long histories (MemoryAgentBench contexts)
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


def generate_answer(run: _Run, question: Question, input_ids: torch.Tensor, kv, memory) -> torch.Tensor:
    """The tokens ``generate`` answers ``question`` with, from ``input_ids`` (``(1, n)``), the KV cache
    ``kv`` (restored by the caller) and a copy of ``memory`` (either may be ``None``), re-seeded first."""
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=question.max_new_tokens,
        pad_token_id=run.pad_token_id,
        **run.decoding.generate_kwargs(),
    )
    if kv is not None:
        kwargs.update(kv_kwargs(run.model, kv))
    if memory is not None:
        kwargs["memory_cache"] = memory.clone()
    _seed(run.decoding.seed)
    output = run.model.generate(**kwargs)
    return output[0, input_ids.shape[1] :]


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
        fill_history(run, pieces, memory, kv)
        snapshot = _KVSnapshot(kv) if kv is not None else None
        prefix = torch.cat(pieces, dim=1) if in_prompt else None
        for question in history.questions:
            q_ids = torch.tensor([run.builder.question_ids(history, question, in_prompt)], device=run.device)
            input_ids = q_ids if prefix is None else torch.cat([prefix, q_ids], dim=1)
            restored = snapshot.restore() if snapshot is not None else None
            new = generate_answer(run, question, input_ids, restored, memory)
            yield question, run.tokenizer.decode(new, skip_special_tokens=True).strip()


# ---------------------------------------------------------------------- entry points
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
    run, systems = _setup(
        model,
        tokenizer,
        decoding or Decoding(),
        block_size,
        memory_only=memory_only,
        compare_base=compare_base,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
        progress=progress,
    )
    settings = _settings(benchmark, run, systems, run_info)
    partial = None if out_dir is None else PartialRun(out_dir, settings, resume)
    try:
        records = _answer_all(run, benchmark, systems, partial)
    finally:
        if partial is not None:
            partial.close()
    summary = _summary(benchmark, run, settings, records, run_info)
    if partial is not None:
        partial.finish(summary, records, plot)
    return summary


def _setup(
    model,
    tokenizer,
    decoding: Decoding,
    block_size: int | None,
    *,
    memory_only: bool,
    compare_base: bool,
    chat_template: bool | None,
    template_kwargs: dict | None,
    progress: bool,
) -> tuple[_Run, list[str]]:
    """The run resolved against ``model``: what answering needs, and the systems to evaluate (the
    backbone unless it is skipped and an adapter is there, LSTMem when the model carries one)."""
    try:
        memory = find_memory(model)
    except TypeError:
        memory = None
    systems = (["base"] if compare_base or memory is None else []) + (
        ["lstmem"] if memory is not None else []
    )
    if memory is not None:
        block_size = block_size or memory.config().block_size
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
    return run, systems


def _settings(benchmark: Benchmark, run: _Run, systems: list[str], run_info: dict | None) -> dict[str, Any]:
    """The run's settings as ``summary.json`` records them and as they read back from ``settings.json``
    (a resumed run must match them)."""
    settings = {
        **benchmark.settings(),
        "mode": "memory-only" if run.memory_only else "history+memory",
        "systems": systems,
        "decoding": asdict(run.decoding),
        "block_size": run.block_size,
        "chat_template": run.builder.chat_template,
        "template_kwargs": run.builder.template_kwargs,
        **(run_info or {}),
    }
    return json.loads(json.dumps(settings))


def _answer_all(
    run: _Run, benchmark: Benchmark, systems: list[str], partial: PartialRun | None
) -> dict[str, list[dict]]:
    """Every question of every history answered by every system: ``{system: records}`` in run order.

    A history a resumed run finished for every system is taken from ``partial.kept`` as it is; each
    new record is scored by ``benchmark`` and written to ``partial`` as it is made.
    """
    kept = partial.kept if partial is not None else {}
    records: dict[str, list[dict]] = {s: [] for s in systems}
    was_training = run.model.training
    run.model.eval()
    try:
        bar = tqdm(
            benchmark.histories(),
            total=len(benchmark),
            desc=f"{benchmark.name}",
            unit="history",
            disable=not run.progress,
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
                    if partial is not None:
                        partial.write(record)
            if partial is not None:
                partial.flush()
            bar.set_postfix(questions=len(records[systems[0]]))
    finally:
        run.model.train(was_training)
    return records


def _summary(
    benchmark: Benchmark, run: _Run, settings: dict, records: dict[str, list[dict]], run_info: dict | None
) -> dict[str, Any]:
    """The run's ``summary.json``: each system's scores under the run's protocol and under every protocol."""
    systems = list(records)
    summary = {
        "benchmark": benchmark.name,
        "protocol": getattr(benchmark, "protocol", None),
        "mode": settings["mode"],
        "metrics": list(benchmark.metrics),
        "decoding": asdict(run.decoding),
        "block_size": run.block_size,
        "histories": len({r["history"] for r in records[systems[0]]}),
        "questions": len(records[systems[0]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "settings": settings,
        **(run_info or {}),
        "systems": {s: benchmark.summarize(records[s]) for s in systems},
    }
    summary["by_protocol"] = _by_protocol(benchmark, records)
    return summary


def _complete(records: list[dict], history: History, systems: list[str]) -> list[dict] | None:
    """``records`` when they answer every question of ``history`` for every system, else ``None``."""
    wanted = {q.id for q in history.questions}
    for system in systems:
        got = [r["id"] for r in records if r["system"] == system]
        if len(got) != len(wanted) or set(got) != wanted:
            return None
    return records


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
        "versions": versions(),
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
    write_records(os.path.join(stage, "predictions.jsonl"), records, systems)
    write_reports(stage, summary, plot)
    replace_folder(stage, out_dir)
    return summary

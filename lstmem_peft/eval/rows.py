"""Named rows of one evaluation run: what a reader needs beside LSTMem's score, each from the same
prompts and scorers, with its costs.

``evaluate_rows(model, tokenizer, LoCoMo(...), out, rows=["no-context", "window", "memory-only",
"paper", "bm25"])`` answers every question once per row (:data:`ROWS`):

* ``no-context``: the backbone (adapter disabled) asked the question alone: no history in the prompt,
  no memory.
* ``window``: the backbone with the newest turns that fit the window in the prompt. The window is
  ``window`` positions (``--window``; default: the model config's ``max_position_embeddings``), less
  the longest question of the history and its answer limit; turns are dropped oldest first, whole,
  and the kept ones are laid out in the protocol's own format and order.
* ``memory-only``: LSTMem with the whole history written into a fresh memory (``block_size`` blocks,
  feedback after each) and dropped: nothing of it in the prompt or the KV cache; the question is
  asked from memory alone.
* ``paper``: the paper's protocol (App. C.4) bounded by the window: the turns that do not fit the
  window are written into memory only (as ``memory-only`` writes them), then the window's turns are
  written into memory *and* the KV cache, and the question follows them in the prompt. When the
  whole history fits, this is exactly :func:`~lstmem_peft.eval.runner.evaluate`'s LSTMem system.
* ``bm25``: the backbone with the question's ``top_k`` turns by BM25
  (:class:`~lstmem_peft.eval.retrieval.TurnIndex`, bm25s) in the prompt, in their original order,
  lowest-ranked dropped first while the prompt does not fit the window.

Every question starts from the same snapshot of its history (memory copy, KV cut back), the sampler
is re-seeded before it, and question and answer tokens read and update memory (no feedback), as in
:mod:`lstmem_peft.eval.runner`. ``window``, ``paper`` and ``bm25`` need histories with turns
(LoCoMo). The outputs (:mod:`.row_report`): ``predictions.jsonl`` (one line per row and question,
with its costs), ``summary.json`` (per-group scores with bootstrap intervals and counts, under both
protocols, and per-row costs) and ``results.md``; resumable like :func:`evaluate`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from tqdm.auto import tqdm

from lstmem_peft.memory.cache import MemoryCache

from .protocol import Benchmark, History, Question
from .runner import Decoding, _complete, _KVSnapshot, _Run, _setup, fill_history, generate_answer

#: The rows, in the order the reports show them, and what each one is (``results.md`` lists them).
ROWS = {
    "no-context": "backbone, the question alone (no history, no memory)",
    "window": "backbone, the newest turns that fit the window in the prompt",
    "memory-only": "LSTMem, the whole history in memory only; the question alone in the prompt",
    "paper": "LSTMem, the history in memory and the window's turns in the prompt and KV cache (paper protocol)",
    "bm25": "backbone, the question's top-k BM25 turns in the prompt (bm25s), within the window",
}
ADAPTER_ROWS = ("memory-only", "paper")
TURN_ROWS = ("window", "paper", "bm25")
DEFAULT_TOP_K = 10


def parse_rows(text: str | Sequence[str]) -> list[str]:
    """Row names from ``"no-context,window"`` (or a list; ``all``: every row), in :data:`ROWS` order;
    an unknown name raises ValueError naming the known ones."""
    names = [n.strip() for part in ([text] if isinstance(text, str) else text) for n in part.split(",")]
    names = [n for n in names if n]
    if names == ["all"]:
        return list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        got = f"unknown row {unknown[0]!r}" if unknown else "no row"
        raise ValueError(f"{got}; expected a comma-separated list of {', '.join(ROWS)} (or all)")
    return [n for n in ROWS if n in names]


def model_window(model) -> int | None:
    """The model's window in positions (its text config's ``max_position_embeddings``), or ``None``."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in a full-attention KV cache of ``model`` (its dtype)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def kv_bytes(cache) -> int:
    """Bytes the keys and values of a transformers KV cache hold."""
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def subset(history: History, indices: Sequence[int]) -> History:
    """``history`` holding only the turns ``indices`` (in the protocol's format and order)."""
    if history.turns is None or history.select is None:
        raise ValueError(f"history {history.id!r} has no turns to select from (rows {', '.join(TURN_ROWS)})")
    segments = history.select(indices)
    return History(history.id, "".join(segments), history.questions, segments=segments, system=history.system)


# ---------------------------------------------------------------------- one history, every row
@dataclass
class _Plan:
    """What the rows read from one history, worked out once and shared between rows."""

    run: _Run
    history: History
    window: int
    top_k: int
    costs: dict[str, Any] = field(default_factory=dict)

    def ids(self, history: History, in_prompt: bool) -> list[list[int]]:
        return self.run.builder.history_ids(history, in_prompt)

    def length(self, history: History) -> int:
        return sum(map(len, self.ids(history, True)))

    @cached_property
    def history_tokens(self) -> int:
        """Tokens of the whole history in the prompt (what its KV cache would hold)."""
        return self.length(self.history)

    def fits(self, history: History) -> bool:
        """Whether ``history`` in the prompt leaves room for each question and its answer."""
        prefix = self.length(history)
        return all(
            prefix + len(self.run.builder.question_ids(history, q, True)) + q.max_new_tokens <= self.window
            for q in history.questions
        )

    @cached_property
    def window_turns(self) -> list[int]:
        """The newest turns whose prompt fits the window with every question and its answer."""
        n = len(self.history.turns or [])
        if self.history.turns is None:
            if not self.fits(self.history):
                raise ValueError(
                    f"history {self.history.id!r} does not fit the window and has no turns to drop"
                )
            return []
        newest = lambda k: list(range(n - k, n))  # noqa: E731
        if self.fits(subset(self.history, newest(n))):
            return newest(n)
        budget = (
            max(
                (len(self.run.builder.question_ids(self.history, q, True)) + q.max_new_tokens)
                for q in self.history.questions
            )
            if self.history.questions
            else 0
        )
        low, high = 0, n  # the largest k whose prefix fits the budget (prefix lengths grow with k)
        while low < high:
            mid = (low + high + 1) // 2
            if self.length(subset(self.history, newest(mid))) + budget <= self.window:
                low = mid
            else:
                high = mid - 1
        while low > 0 and not self.fits(subset(self.history, newest(low))):
            low -= 1
        if not self.fits(subset(self.history, newest(low))):
            raise ValueError(
                f"history {self.history.id!r}: the window ({self.window} positions) cannot hold even a question "
                "and its answer limit; pass a larger --window"
            )
        return newest(low)

    @cached_property
    def window_history(self) -> History:
        if self.history.turns is None:
            return self.history
        return subset(self.history, self.window_turns)

    @cached_property
    def index(self):
        from .retrieval import TurnIndex

        start = time.perf_counter()
        index = TurnIndex(self.history.turns or [])
        self.costs["index_s"] = time.perf_counter() - start
        return index

    def retrieved(self, question: Question) -> tuple[History, list[int]]:
        """The ``top_k`` BM25 turns for ``question`` (fewer when the window cannot hold them all: the
        lowest-ranked go first), as a history in the protocol's order, and their indices."""
        if self.history.turns is None:
            raise ValueError(f"history {self.history.id!r} has no turns to retrieve (row bm25)")
        query = str(question.meta.get("question") or question.prompt)
        ranked = [i for i, _ in self.index.top(query, self.top_k)]
        while True:
            kept = sorted(ranked)
            history = subset(self.history, kept)
            prefix = self.length(history)
            need = (
                prefix + len(self.run.builder.question_ids(history, question, True)) + question.max_new_tokens
            )
            if need <= self.window or not ranked:
                return history, kept
            ranked.pop()


def _clock(run: _Run) -> float:
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return time.perf_counter()


def _generate(run: _Run, question: Question, input_ids, cache, memory) -> tuple[str, dict]:
    """One answer (:func:`~lstmem_peft.eval.runner.generate_answer`); its time and token counts."""
    start = _clock(run)
    new = generate_answer(run, question, input_ids, cache, memory)
    seconds = _clock(run) - start
    text = run.tokenizer.decode(new, skip_special_tokens=True).strip()
    return text, {
        "answer_s": seconds,
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": int(new.numel()),
    }


def _tensor(run: _Run, ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=run.device)


@torch.no_grad()
def answer_row(plan: _Plan, row: str) -> Iterator[tuple[Question, str, dict]]:
    """Every question of the plan's history answered by ``row``: ``(question, reply, costs)``."""
    run, history = plan.run, plan.history
    adapter = row in ADAPTER_ROWS
    context = run.model.disable_adapter() if run.has_adapter and not adapter else nullcontext()
    with context:
        if row == "bm25":
            yield from _answer_bm25(plan)
            return
        # the token ids first, so that the write time is the model's alone
        windowed = plan.window_history if row in ("window", "paper") else None
        pieces = plan.ids(windowed, True) if windowed is not None else plan.ids(history, False)
        outside: list[list[int]] = []
        if row == "paper" and len(plan.window_turns) < len(history.turns or []):
            kept = set(plan.window_turns)  # the turns the window cannot hold: memory only, oldest first
            outside = plan.ids(
                subset(history, [i for i in range(len(history.turns)) if i not in kept]), False
            )
        start = _clock(run)
        memory = MemoryCache() if adapter else None
        kv, prompt = None, None
        if row == "memory-only":
            _fill(run, pieces, memory, None)
        elif windowed is not None:
            from transformers import DynamicCache

            _fill(run, outside, memory, None)  # the paper row's turns beyond the window: memory only
            kv = DynamicCache(config=run.config)
            _fill(run, pieces, memory, kv)  # the window: memory and KV, or (no adapter) the KV alone
            prompt = windowed
        write_s = _clock(run) - start
        snapshot = _KVSnapshot(kv) if kv is not None else None
        prefix = [i for piece in pieces for i in piece] if prompt is not None else []
        shared = {
            "write_s": write_s,
            "state_bytes": memory.nbytes if memory is not None else 0,
            "kv_bytes": kv_bytes(kv) if kv is not None else 0,
            "history_tokens": plan.history_tokens,
            "context_tokens": len(prefix),
            "context_turns": len(plan.window_turns) if prompt is not None and history.turns else 0,
        }
        for question in history.questions:
            if prompt is None:
                ids = run.builder.question_ids(history, question, False)
            else:
                ids = prefix + run.builder.question_ids(prompt, question, True)
            cache = snapshot.restore() if snapshot is not None else None
            text, cost = _generate(run, question, _tensor(run, ids), cache, memory)
            yield question, text, {**shared, **cost}


def _answer_bm25(plan: _Plan) -> Iterator[tuple[Question, str, dict]]:
    run = plan.run
    _ = plan.index  # built once per history: the row's write time
    for question in plan.history.questions:
        start = _clock(run)
        retrieved, kept = plan.retrieved(question)
        pieces = plan.ids(retrieved, True)
        prefix = [i for piece in pieces for i in piece]
        retrieve_s = _clock(run) - start
        ids = prefix + run.builder.question_ids(retrieved, question, True)
        text, cost = _generate(run, question, _tensor(run, ids), None, None)
        yield (
            question,
            text,
            {
                "write_s": plan.costs.get("index_s", 0.0),
                "state_bytes": 0,
                "kv_bytes": 0,
                "history_tokens": plan.history_tokens,
                "context_tokens": len(prefix),
                "context_turns": len(kept),
                "retrieved": kept,
                **cost,
                "answer_s": cost["answer_s"] + retrieve_s,
            },
        )


def _fill(run: _Run, pieces: list[list[int]], memory: MemoryCache | None, kv) -> None:
    """:func:`~lstmem_peft.eval.runner.fill_history` on token-id lists."""
    fill_history(run, [_tensor(run, piece) for piece in pieces], memory, kv)


# ---------------------------------------------------------------------- the run
def evaluate_rows(
    model,
    tokenizer,
    benchmark: Benchmark,
    out_dir=None,
    rows: Sequence[str] = tuple(ROWS),
    *,
    window: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    decoding: Decoding | None = None,
    block_size: int | None = None,
    chat_template: bool | None = None,
    template_kwargs: dict | None = None,
    progress: bool = True,
    run_info: dict | None = None,
    resume: bool = False,
    bootstrap: int = 1000,
    bootstrap_seed: int = 0,
    command: str | None = None,
) -> dict[str, Any]:
    """Answer every question of ``benchmark`` once per row of ``rows`` (see the module docstring).

    Args:
        model, tokenizer: a causal LM with an LSTMem adapter (a plain one for backbone rows only).
        benchmark: the protocol; ``window``, ``paper`` and ``bm25`` need histories with turns (LoCoMo).
        out_dir: where ``predictions.jsonl``, ``summary.json`` and ``results.md`` go (``None``: nowhere).
        rows: names from :data:`ROWS` (:func:`parse_rows` reads ``"no-context,window"``).
        window: positions the prompt, question and answer may take (``window``, ``paper``, ``bm25``);
            default: the model config's ``max_position_embeddings``.
        top_k: turns the ``bm25`` row retrieves per question.
        decoding, block_size, chat_template, template_kwargs, progress, run_info, resume: as in
            :func:`~lstmem_peft.eval.runner.evaluate`.
        bootstrap, bootstrap_seed: resamples of the questions for the 95% intervals, and their seed.
        command: the command line that made the run (``summary.json`` and ``results.md`` show it).

    Returns:
        The summary (also ``summary.json``): ``{"rows", "results": {row: {"groups", "overall"}},
        "by_protocol", "costs": {row: ...}, ...}``; every group and overall carries ``"ci"``.
    """
    from . import row_report
    from .outputs import PartialRun
    from .row_report import LEVEL

    rows = parse_rows(list(rows))
    run, _ = _setup(
        model,
        tokenizer,
        decoding or Decoding(),
        block_size,
        memory_only=False,
        compare_base=True,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
        progress=progress,
    )
    if not run.has_adapter and any(r in ADAPTER_ROWS for r in rows):
        raise ValueError(f"rows {', '.join(ADAPTER_ROWS)} need a model with an LSTMem adapter")
    configured = model_window(model)
    if window is None and configured is None and any(r in TURN_ROWS for r in rows):
        raise ValueError("the model config has no max_position_embeddings; pass window= (--window)")
    options = {
        "rows": rows,
        "row_notes": {r: ROWS[r] for r in rows},
        "window": window or configured,
        "window_from": "config (max_position_embeddings)" if window is None else "option",
        "top_k": top_k,
        "bootstrap": {"resamples": bootstrap, "seed": bootstrap_seed, "level": LEVEL},
    }
    window = options["window"]
    settings = row_report.settings(benchmark, run, options, run_info)
    partial = None if out_dir is None else PartialRun(out_dir, settings, resume)
    try:
        records = _answer_all(run, benchmark, rows, window, top_k, partial)
    finally:
        if partial is not None:
            partial.close()
    summary = row_report.summarize(benchmark, run, settings, records, kv_bytes_per_token(model), command)
    if partial is not None:
        row_report.finish(partial, summary, records)
    return summary


def _answer_all(run: _Run, benchmark: Benchmark, rows: list[str], window: int, top_k: int, partial):
    """Every question of every history answered by every row: ``{row: records}`` in run order."""
    kept = partial.kept if partial is not None else {}
    records: dict[str, list[dict]] = {r: [] for r in rows}
    was_training = run.model.training
    run.model.eval()
    try:
        bar = tqdm(
            benchmark.histories(),
            total=len(benchmark),
            desc=benchmark.name,
            unit="history",
            disable=not run.progress,
        )
        for history in bar:
            if any(r in TURN_ROWS for r in rows) and history.turns is None:
                raise ValueError(
                    f"rows {', '.join(TURN_ROWS)} need histories with turns (locomo); {benchmark.name} "
                    f"history {history.id!r} has none"
                )
            done = _complete(kept.pop(history.id, []), history, rows)
            plan = _Plan(run, history, window, top_k)
            for row in rows:
                if done is not None:
                    records[row].extend(r for r in done if r["system"] == row)
                    continue
                for question, prediction, cost in answer_row(plan, row):
                    record = {
                        "system": row,
                        "history": history.id,
                        "id": question.id,
                        "group": question.group,
                        "prediction": prediction,
                        "gold": question.answer,
                        "scores": benchmark.score(question, prediction),
                        "meta": question.meta,
                        "cost": cost,
                    }
                    records[row].append(record)
                    if partial is not None:
                        partial.write(record)
            if partial is not None:
                partial.flush()
            bar.set_postfix(questions=len(records[rows[0]]))
    finally:
        run.model.train(was_training)
    return records

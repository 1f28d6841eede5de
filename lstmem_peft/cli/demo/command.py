"""The offline recall demo: does a trained LSTMem adapter answer from memory alone?

Task: histories of key-value facts ``<s> k07 v19 ; k12 v03 ; ...`` (8 pairs, 32 keys, 32 values)
and the question ``<s> ? k07``, answered ``v19``. The model answers three ways:

* history in the context window, no memory (upper bound);
* no history at all (chance);
* history written only into LSTMem memory, question alone (what the adapter adds).

This module is the ``lstmem demo`` command (:func:`run`, its settings :class:`DemoSettings`): it
loads (or trains) the adapters, prints the 8-fact table and the update table, :func:`show_episodes`
(``--show``: episodes a person can read) or the sweep (``--sweep``). The parts live beside it:

* :mod:`.recall`: the task, the adapters and the measurements (:func:`evaluate`,
  :func:`evaluate_updates`: a later turn gives some keys new values; the newest wins);
* :mod:`.conversation`: recall at each question position of a conversation written into
  memory as ``lstmem serve`` writes it, for both kinds of chat client;
* :mod:`.training`: how the embedded backbone and adapters were made (:func:`train_adapter`,
  :func:`build`; ``python -m lstmem_peft.cli.demo build`` remakes the shipped files and records its
  timings and scores in ``assets/demo/build.json``);
* :mod:`.sweep`: recall against history length, from one block to many, past the backbone's
  :data:`WINDOW`, against the plain backbone cut to that window, with a plot (issue 26).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lstmem_peft.training.data import left_pad, long_recall_episodes
from lstmem_peft.tuner.loading import load_model_and_adapter
from lstmem_peft.utils.errors import UsageError
from lstmem_peft.utils.offline import DEMO_ASSETS, NUM_KEYS, NUM_VALUES, demo_tokenizer

# The demo's parts this command runs.
from .conversation import CLIENTS, evaluate_conversation, format_conversation
from .recall import (
    ADAPTERS,
    NUM_PAIRS,
    SEEDS_DOC,
    WINDOW,
    _pad_id,
    caption,
    episode_rows,
    evaluate,
    evaluate_updates,
    feedback_off,
    in_context_row,
    memory_state_size,
    standard_error,
    window_row,
    write_histories,
)
from .sweep import run_sweep
from .training import CHAT_STEPS, load_backbone, train_adapter, train_for_chat

# ---------------------------------------------------------------------- the tables
#: What the summary's ``"adapters"`` says about the adapters the run scored.
ADAPTERS_SHIPPED = "shipped (trained when the package was built)"
ADAPTERS_TRAINED = "trained in this run"


def _gap_to_full(results: dict[str, dict], key: str, full: str = "full") -> tuple[str, float] | None:
    """The row (other than ``full``) scoring highest above the full adapter on ``key``, and by how much;
    ``None`` when no row is above it."""
    above = {name: r[key] - results[full][key] for name, r in results.items() if name != full}
    name = max(above, key=above.get, default=None)
    return (name, above[name]) if name is not None and above[name] > 0 else None


def format_table(results: dict[str, dict]) -> str:
    """Rows: the full adapter and ablations; columns: the three conditions and the reference levels.
    The caption above says what each column is; the one below, why an ablation may score above the
    full adapter here."""
    first = next(iter(results.values()))
    n, pairs = first["num_episodes"], first["num_pairs"]
    header = (
        f"{'adapter':<20}{'in context':>12}{'no history':>12}{'memory only':>13}{'chance':>9}{'1/pairs':>9}"
    )
    lines = [
        caption(
            f"Recall from one block of {pairs} facts ({n} held-out episodes). in context: the plain "
            "backbone with history and question in its window (the ceiling). no history: the plain "
            "backbone with the question alone (the floor). memory only: the history written into LSTMem "
            "memory, then the question alone reads it. chance: a value drawn at random; 1/pairs: a memory "
            "that knows which values appeared but not whose."
        ),
        header,
        "-" * len(header),
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<20}{r['recall_in_context']:>12.3f}{r['recall_no_history']:>12.3f}{r['recall_memory']:>13.3f}"
            f"{r['chance']:>9.3f}{r['bag_of_values']:>9.3f}"
        )
    if "full" in results and len(results) > 1:
        se = standard_error(results["full"]["recall_memory"], n)
        gap = _gap_to_full(results, "recall_memory")
        lower = f"The full adapter scores {gap[1]:.3f} below {gap[0]} here. " if gap else ""
        lines.append(
            caption(
                f"{lower}Each row is one trained adapter: the training seed alone moves memory-only recall "
                f"by about 0.02, and one standard error of the measurement is {se:.3f} at {n} episodes. On "
                "one block the paper's components (depth coupling, block feedback) do not help: over six "
                f"seeds the three adapters score alike ({SEEDS_DOC}). They help when a later turn updates "
                "facts: the next table."
            )
        )
    return "\n".join(lines)


def format_updates(results: dict[str, dict]) -> str:
    """Rows: adapters; columns: after an update, the newest value, the superseded one, a kept key. The
    captions say what each column is and why a row scores below the full adapter."""
    n = next(iter(results.values()))["num_episodes"]
    head = f"{'after an update (memory only)':<36}{'newest value':>14}{'old value':>11}{'untouched key':>15}"
    lines = [
        caption(
            f"Updates: {NUM_PAIRS} facts in one turn, then a later turn gives 4 of the keys new values "
            f"({n} episodes); asked: an updated key (gold: the newest value) or a key left alone. newest "
            "value: the updated key answered with its new value (higher is better). old value: answered "
            "with the value the later turn replaced (lower is better). untouched key: a key the later "
            "turn left alone, answered right."
        ),
        head,
        "-" * len(head),
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<36}{r['update_newest']:>14.3f}{r['update_oldest']:>11.3f}{r['update_kept']:>15.3f}"
        )
    if "full" in results and len(results) > 1:
        full, se = results["full"]["update_newest"], standard_error(results["full"]["update_newest"], n)
        lower = [name for name, r in results.items() if name != "full" and r["update_newest"] < full]
        note = (
            f"Below the full adapter's newest value ({full:.3f}, one standard error {se:.3f}): "
            f"{'; '.join(lower)}. Each lacks a part of what lets a later write replace a fact, depth "
            "coupling or the feedback after each block, and gives the old value more often."
            if lower
            else f"No row is below the full adapter's newest value ({full:.3f}, one standard error {se:.3f})."
        )
        kept = _gap_to_full(results, "update_kept")
        if kept:
            note += (
                f" The full adapter's untouched keys score {kept[1]:.3f} below {kept[0]}: feedback after "
                "the later turn favours what that turn wrote, the price of replacing (so too over six "
                f"training seeds, {SEEDS_DOC})."
            )
        lines.append(caption(note))
    return "\n".join(lines)


# ---------------------------------------------------------------------- episodes a person can read
def _abridge(facts: list[str], asked: int, keep: int = 2) -> str:
    """The history's facts with the asked one in brackets; long runs elided as '... (n facts) ...'."""
    if len(facts) <= 10:
        keep = len(facts)
    show = set(range(min(keep, len(facts)))) | set(range(max(0, len(facts) - keep), len(facts)))
    show |= {asked - 1, asked, asked + 1}
    parts, skipped = [], 0
    for i, fact in enumerate(facts):
        if i not in show:
            skipped += 1
            continue
        if skipped:
            parts.append(f"... ({skipped} facts) ...")
            skipped = 0
        parts.append(f"[{fact}]" if i == asked else fact)
    return " ".join(parts)


@torch.no_grad()
def show_episodes(
    model, tokenizer=None, num: int = 3, num_facts: int = NUM_PAIRS, window: int = WINDOW, seed: int = 777
) -> list[dict]:
    """Episodes a person can read: history (abridged), question, gold, and the answers from memory,
    with no history and (when the history is longer than the window) from the cut window."""
    tok = tokenizer or demo_tokenizer()
    episodes = long_recall_episodes(num, num_facts, NUM_KEYS, NUM_VALUES, seed=seed)
    histories, reads, n_ans = episode_rows(tok, episodes)
    cache = write_histories(model, tok, histories)
    pad = _pad_id(tok)
    block = memory_state_size(model)["block_size"]

    def answers(rows, with_cache=None):
        ids, mask = left_pad(rows, pad)
        kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        if with_cache is None:
            logits = model(**kwargs).logits
        else:
            logits = model(**kwargs, memory_cache=with_cache, memory_write=False).logits
        probs = logits[:, :-1].softmax(-1)
        out = []
        for i, n in enumerate(n_ans):
            p, ids_ = probs[i, -n:].max(-1)
            out.append((tok.decode(ids_.tolist()).strip(), round(float(p.prod()), 3)))
        return out

    memory = answers(reads, cache)
    with model.disable_adapter():
        none = answers(reads)
        windowed = [window_row(tok, h, r, n, window) for h, r, n in zip(histories, reads, n_ans, strict=True)]
        cut = answers(windowed)
    shown = []
    for i, e in enumerate(episodes):
        facts = [f.strip() + " ;" for f in e["history"].split(";") if f.strip()]
        gold = e["answer"].strip()
        shown.append(
            {
                "history": _abridge(facts, len(facts) - 1 - e["facts_after"]),
                "pairs": [tuple(f.split()[:2]) for f in facts],
                "facts": len(facts),
                "history_tokens": len(histories[i]),
                "blocks": -(-len(histories[i]) // block),
                "facts_after": e["facts_after"],
                "question": e["prompt"],
                "gold": gold,
                "memory": memory[i][0],
                "memory_p": memory[i][1],
                "no_history": none[i][0],
                "no_history_p": none[i][1],
                "window": cut[i][0],
                "window_p": cut[i][1],
                "fits_window": len(in_context_row(tok, histories[i], reads[i])) - n_ans[i] <= window,
            }
        )
    return shown


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_episodes(shown: list[dict], window: int = WINDOW) -> str:
    """The episodes of :func:`show_episodes` as text; a wrong answer that is another fact's value
    says whose (the memory bound the wrong key) or that it was never in the history."""

    def mark(e, key):
        answer = e[key]
        if answer == e["gold"]:
            return "right"
        owners = sorted({k for k, v in e.get("pairs", []) if v == answer})
        if owners:
            return f"wrong (the value of {', '.join(owners)} in the history)"
        return "wrong (not a value in the history)" if e.get("pairs") else "wrong"

    lines = []
    for i, e in enumerate(shown, 1):
        lines += [
            f"episode {i}: {_plural(e['facts'], 'fact')}, {e['history_tokens']} tokens written into memory in "
            f"{_plural(e['blocks'], 'block')} with feedback after each; the asked fact [in brackets] has "
            f"{_plural(e['facts_after'], 'fact')} after it",
            f"  history     {e['history']}",
            f"  question    {e['question']}   (the history is gone from the context)",
            f"  gold        {e['gold']}",
            f"  memory      {e['memory']}  p={e['memory_p']:.2f}  LSTMem memory only: {mark(e, 'memory')}",
            f"  no history  {e['no_history']}  p={e['no_history_p']:.2f}  plain backbone, question alone: "
            f"{mark(e, 'no_history')}",
        ]
        if not e["fits_window"]:
            lines.append(
                f"  window      {e['window']}  p={e['window_p']:.2f}  plain backbone, history cut to its "
                f"{window}-token window: {mark(e, 'window')}"
            )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the command
def _load_models(names, train, model_id, train_steps, seed, chat_steps=CHAT_STEPS):
    """The adapters ``names`` (keys of :data:`ADAPTERS`), each on a fresh copy of the backbone: trained
    now with ``train`` (the time recorded; on the embedded backbone then ``chat_steps`` updates for
    chat, as the shipped ones were), else the shipped ones on the embedded backbone (``model_id`` is
    then ``None``). Returns ``(models, tokenizer or None for the demo's, timings)``."""
    timings, models, tokenizer = {}, {}, None
    if model_id is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_id)
        load = lambda: load_model_and_adapter(model_id, dtype="float32", device="cpu")[0]  # noqa: E731
    else:
        load = load_backbone
    for name in names:
        if train:
            start = time.perf_counter()
            model, _ = train_adapter(
                load(), ADAPTERS[name], max_steps=train_steps, seed=seed, tokenizer=tokenizer
            )
            if model_id is None and chat_steps:
                model, _ = train_for_chat(model, max_steps=chat_steps)
            timings[f"train_{name}_s"] = round(time.perf_counter() - start, 1)
            print(f"trained adapter '{name}' in {timings[f'train_{name}_s']} s")
        else:
            model = load_model_and_adapter(adapter=DEMO_ASSETS / f"adapter_{name}", device="cpu")[0]
        models[name] = model
    return models, tokenizer, timings


@dataclass(frozen=True)
class DemoSettings:
    """What one ``lstmem demo`` run does (:func:`run`'s keyword arguments; the CLI flags in brackets).

    Attributes:
        train: retrain the adapters from scratch (``--train``), the time recorded.
        model_id: Hub id or local path of a causal LM (``--model``), with ``train`` only (no toy-task
            adapter ships for another backbone; its shipped English adapter is :mod:`.english`'s);
            ``None``: the embedded backbone.
        num_episodes: held-out episodes to score, per sweep length too (``--episodes``).
        ablations: also the depth-coupling and feedback ablations (not ``--no-ablations``).
        train_steps: training steps per adapter with ``train`` (``--steps``).
        seed: the training seed.
        show: first print that many episodes (``--show``), ``show_facts`` facts each (``--facts``).
        sweep_facts: instead of the 8-fact table, the history-length sweep over these lengths
            (``--sweep``), its record and plot written into ``out`` (``--out``); ``None``: no sweep.
        window: the backbone's context window in tokens (``--window``).
        chat_steps: with ``train`` on the embedded backbone, the updates of the chat phase
            (``--chat-steps``; 0: none).
    """

    train: bool = False
    model_id: str | None = None
    num_episodes: int = 512
    ablations: bool = True
    train_steps: int = 600
    seed: int = 42
    show: int = 0
    show_facts: int = NUM_PAIRS
    sweep_facts: Sequence[int] | None = None
    window: int = WINDOW
    out: str | Path = "."
    chat_steps: int = CHAT_STEPS


def run(settings: DemoSettings | None = None, /, **options) -> dict:
    """What ``lstmem demo`` does; returns the summary printed as the last line.

    Takes :class:`DemoSettings`, or its fields as keyword arguments (``run(num_episodes=64,
    ablations=False)``), or both (the keywords replace the settings' fields).
    """
    if settings is not None and not isinstance(settings, DemoSettings):
        raise TypeError(
            f"run takes a DemoSettings or keyword arguments, got {type(settings).__name__}; "
            "pass the options by name, e.g. run(train=True)"
        )
    settings = replace(settings or DemoSettings(), **options)
    if settings.model_id is not None and not settings.train:
        raise UsageError(
            f"model_id {settings.model_id}: the toy task's adapters ship for the embedded backbone only; "
            "expected train=True (lstmem demo --model ID --train). A backbone's own shipped adapter is shown "
            "by lstmem demo --model NAME (lstmem_peft.cli.demo.english)"
        )
    threads = torch.get_num_threads()
    if settings.model_id is None and not settings.train:
        # the embedded model is tiny (hidden 128): more threads only add synchronisation, and on a
        # busy 2-core machine two threads wrote 256-fact histories 15 times slower than one
        torch.set_num_threads(1)
    try:
        return _run(settings)
    finally:
        torch.set_num_threads(threads)


def adapters_scored(s: DemoSettings) -> str:
    """The summary's ``"adapters"``: the shipped ones, or trained in this run."""
    return ADAPTERS_TRAINED if s.train else ADAPTERS_SHIPPED


def _run(s: DemoSettings) -> dict:
    """:func:`run` under its thread setting: the adapters, the episodes (``show``), then the sweep or
    the 8-fact and update tables; the summary is printed as one JSON line."""
    names = list(ADAPTERS) if s.ablations else ["full"]
    models, tokenizer, timings = _load_models(names, s.train, s.model_id, s.train_steps, s.seed, s.chat_steps)
    if s.show:
        print(
            format_episodes(
                show_episodes(models["full"], tokenizer, s.show, s.show_facts, s.window), s.window
            )
        )
    if s.sweep_facts:
        written = run_sweep(models, tokenizer, s.out, s.sweep_facts, s.num_episodes, s.window)
        summary = {"sweep": written, "adapters": adapters_scored(s), **timings}
        print(json.dumps(summary))
        return summary
    results = {
        name: evaluate(model, tokenizer, num_episodes=s.num_episodes, progress=True)
        for name, model in models.items()
    }
    print(format_table(results))
    updates = {name: evaluate_updates(model, tokenizer, s.num_episodes) for name, model in models.items()}
    with feedback_off(models["full"]):
        updates["full, feedback off while writing"] = evaluate_updates(
            models["full"], tokenizer, s.num_episodes
        )
    print(format_updates(updates))
    conversations = {}
    if s.model_id is None:  # the demo's facts and questions, in the demo's chat format
        conversations = {
            f"{name}, {client}": evaluate_conversation(
                model, tokenizer, client, num_sessions=max(1, s.num_episodes // 2)
            )
            for name, model in models.items()
            for client in CLIENTS
        }
        print(format_conversation(conversations))
    full = results["full"]
    summary = {
        "recall_memory": full["recall_memory"],
        "recall_no_history": full["recall_no_history"],
        "recall_in_context": full["recall_in_context"],
        "chance": full["chance"],
        "bag_of_values": full["bag_of_values"],
        "num_pairs": full["num_pairs"],
        "num_episodes": full["num_episodes"],
        "adapters": adapters_scored(s),
        **{f"recall_memory_{k}": v["recall_memory"] for k, v in results.items() if k != "full"},
        "update_newest": updates["full"]["update_newest"],
        "update_oldest": updates["full"]["update_oldest"],
        "update_kept": updates["full"]["update_kept"],
        "update_newest_feedback_off_while_writing": updates["full, feedback off while writing"][
            "update_newest"
        ],
        **{
            f"update_newest_{k}": v["update_newest"]
            for k, v in updates.items()
            if k in ADAPTERS and k != "full"
        },
        **{
            f"conversation_recall_{client}": conversations[f"full, {client}"]["recall_by_position"]
            for client in CLIENTS
            if conversations
        },
        **timings,
    }
    print(json.dumps(summary))
    return summary

"""``lstmem demo --model NAME``: a real backbone remembering English notes (issue 45 item 4).

With a backbone that has a shipped adapter (``smollm2-135m``: ``smollm2-135m-english-numbers``,
:func:`~lstmem_peft.tuner.shipped_adapters.default_adapter`) or an adapter given with ``--adapter``,
``lstmem demo --model NAME`` shows that adapter answering from memory alone on held-out English
notes (:func:`~lstmem_peft.training.english.english_episodes` with ``split="heldout"``: names,
sentence forms and questions its training never saw; a fixed seed, so every run shows the same
notes). Each note is written into a fresh :class:`~lstmem_peft.memory.cache.MemoryCache` with
:func:`~lstmem_peft.tuner.history.write_history`; the prompt then holds the question alone.

It prints, in order:

* :func:`format_notes`: a few notes, each with its question, the gold value and three greedy
  answers: from memory, from an empty memory (the same adapter, nothing written), and from the plain
  model with the note in its prompt (what a model without memory answers when the note still fits),
  and the forced choice's picks;
* :func:`format_scores`: over a small sample (:data:`NUM_EPISODES`), forced choice among the values
  of the asked kind (:func:`~lstmem_peft.eval.forced_choice.forced_choice`, the text layout the
  adapters are trained on) and greedy recall (exact, and the leading digit of numbers) with the own
  note in memory, an empty memory and another note of the same kind in memory
  (:func:`~lstmem_peft.eval.forced_choice.swap_histories`), beside chance;
* one JSON line, the run's record (the last line, as the toy demo ends), also written into ``out``
  as ``demo-english-<stamp>.json`` with every episode's answers when ``out`` is given.

The toy demo (:mod:`.command`) is untouched by this module; ``--model NAME --train`` still runs the
toy task on the backbone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lstmem_peft.eval.english_recall import episode_inputs, leading_digit, recall_hit
from lstmem_peft.eval.forced_choice import forced_choice, swap_histories
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import left_pad
from lstmem_peft.tuner.history import write_history

from .recall import caption, standard_error

#: The held-out sample's seed: the shipped adapter's evaluation used 1000, its slow test 3000.
SEED = 4500
#: Notes in the sample the table scores: 55 to 70 s of scoring on the project's busy 2-core CPU
#: (2026-11-29), which keeps the whole command under two minutes there.
NUM_EPISODES = 24
#: Notes printed in full before the table (the sample's first ones).
NUM_SHOWN = 3
#: Tokens of each greedy answer (a date is 3 to 4 tokens of SmolLM2's tokenizer, a number 1 per digit).
MAX_NEW_TOKENS = 6
#: Episodes per forced-choice batch (their notes written as one batch of rows).
BATCH = 8
#: The greedy conditions, and what each puts in memory and in the prompt.
CONDITIONS = {
    "memory": "the note in memory only, the question alone in the prompt",
    "empty": "empty memory (nothing written), the question alone",
    "other": "another note of the same kind in memory, the question alone",
    "prompt": "the note in the prompt, plain model (adapter off, no memory)",
}
#: The shown notes' greedy answers: what each one had (shorter than :data:`CONDITIONS`, for 100 columns).
SHOWN = {
    "memory": "(the note in memory, the question alone)",
    "empty": "(empty memory, the question alone)",
    "prompt": "(the note in the prompt, plain model)",
}
#: The table's columns: the conditions scored over the sample (``"prompt"`` is shown, not scored).
SCORED = ("memory", "empty", "other")
#: What the record's ``"adapters"`` says.
ADAPTER_SHIPPED = "shipped (trained when the package was built)"
ADAPTER_GIVEN = "given with --adapter"


@dataclass(frozen=True)
class EnglishDemo:
    """What one English run does (:func:`run_english`'s arguments).

    Attributes:
        model: the ``--model`` value as the user gave it (a short name, a folder, a Hub id).
        backbone: what the loader takes for it (a short name's converted folder; else ``model``);
            ``None``: :func:`~lstmem_peft.tuner.backbones.resolve_model` of ``model`` when the run
            starts (a short name converted then, once, with a progress bar).
        adapter: the adapter folder or Hub id (a shipped adapter already resolved to its folder).
        adapter_name: how the user knows the adapter (a shipped short name, or ``adapter``).
        shipped: whether the adapter ships in the package (the record's ``"adapters"``).
        relations: the relations of the episodes (the shipped adapter's; ``None``: all held-out ones).
        num_episodes: notes in the scored sample (``--episodes``).
        show: notes printed in full (``--show``), the sample's first ones.
        seed: the held-out sample's seed.
        out: a folder for the record file; ``None``: the JSON line only.
    """

    model: str
    backbone: str | None
    adapter: str
    adapter_name: str
    shipped: bool = True
    relations: Sequence[str] | None = None
    num_episodes: int = NUM_EPISODES
    show: int = NUM_SHOWN
    seed: int = SEED
    out: str | Path | None = None


def demo_settings(
    model: str,
    adapter: str | None = None,
    num_episodes: int | None = None,
    show: int | None = None,
    out: str | Path | None = None,
    sweep: Sequence[int] | None = None,
) -> EnglishDemo:
    """The settings of ``lstmem demo --model MODEL [--adapter ADAPTER]`` (no ``--train``): the adapter
    given, else the one shipped for ``MODEL`` (:func:`~lstmem_peft.tuner.shipped_adapters.default_adapter`),
    scored on its relations; ``None`` options take this module's defaults. Nothing loads.

    Raises:
        UsageError: no adapter given and none ships for ``model`` (the fix: ``--adapter`` or
            ``--train``), or a ``sweep`` (the toy task's, which needs ``--train`` on a ``--model``).
    """
    from lstmem_peft.tuner.shipped_adapters import default_adapter
    from lstmem_peft.utils.errors import UsageError
    from lstmem_peft.utils.shipped_adapters import resolve_adapter, shipped_adapter

    if sweep is not None:
        raise UsageError(
            f"--sweep: runs the toy task, whose adapters for --model {model} are trained in the run; "
            "expected --train with it. Add --train, or drop --sweep to see the English notes"
        )
    name = adapter or default_adapter(model)
    if name is None:
        raise UsageError(
            f"--model {model}: no trained adapter ships for it (lstmem models lists the backbones that "
            "have one, e.g. smollm2-135m); expected --adapter PATH (an LSTMem adapter trained on this "
            "backbone) or --train (trains the toy demo's adapters on it first). Pass one of them"
        )
    shipped = shipped_adapter(name)
    return EnglishDemo(
        model=model,
        backbone=None,
        adapter=resolve_adapter(name),
        adapter_name=name,
        shipped=shipped is not None,
        relations=shipped.relations if shipped is not None else None,
        num_episodes=NUM_EPISODES if num_episodes is None else num_episodes,
        show=NUM_SHOWN if show is None else show,
        out=out,
    )


def demo_episodes(num: int, seed: int = SEED, relations: Sequence[str] | None = None) -> list[dict]:
    """``num`` held-out notes of one fact each, as the shipped adapter was measured on them (notes
    style, no chatter, the other values of the asked kind as the choices)."""
    from lstmem_peft.training.english import english_episodes

    return english_episodes(
        num,
        "heldout",
        seed=seed,
        num_facts=(1, 1),
        same_relation=1.0,
        style="notes",
        relations=list(relations) if relations else None,
    )


# ---------------------------------------------------------------------- greedy answers
def _pad(tokenizer) -> int:
    return next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None), 0)


@torch.no_grad()
def greedy_answers(
    model, tokenizer, episodes: Sequence[dict], condition: str, other_histories: Sequence[str] | None = None
) -> list[str]:
    """Greedy answers of up to ``MAX_NEW_TOKENS`` tokens under ``condition`` (a key of
    :data:`CONDITIONS`), one per episode, decoded and stripped; ``"other"`` writes
    ``other_histories[i]`` instead of episode ``i``'s note.

    Shapes: the ``B`` notes are written as one left-padded ``(B, Th)`` batch (BOS first, padding
    masked); the prompts are one left-padded ``(B, Tq)`` batch: the question in the text layout
    (``"Question: ...\\nAnswer:"``), or for ``"prompt"`` the note, a newline and the question; the
    memory holds ``B`` rows, read only (``memory_write=False``).
    """
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}; expected one of {list(CONDITIONS)}")
    if condition == "other" and (other_histories is None or len(other_histories) != len(episodes)):
        raise ValueError("the other condition needs one other history per episode")
    window = model.config.max_position_embeddings
    device = next(model.parameters()).device
    pad = _pad(tokenizer)
    inputs = [episode_inputs(tokenizer, e, window, MAX_NEW_TOKENS) for e in episodes]
    rows = [i["context"] if condition == "prompt" else i["prompt"] for i in inputs]
    if any(r is None for r in rows):
        raise ValueError(f"a note and its question do not fit the model's {window}-token window")
    ids, mask = left_pad(rows, pad, device)  # (B, Tq) each
    kwargs: dict[str, Any] = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=pad
    )
    if condition == "prompt":
        with model.disable_adapter():
            out = model.generate(**kwargs)
    else:
        memory = MemoryCache()
        if condition != "empty":
            notes = [e["history"] for e in episodes] if condition == "memory" else list(other_histories)
            written = [
                episode_inputs(tokenizer, {**e, "history": note}, window, MAX_NEW_TOKENS)["history"]
                for e, note in zip(episodes, notes, strict=True)
            ]
            history, history_mask = left_pad(written, pad, device)  # (B, Th) each
            write_history(model, history, memory, attention_mask=history_mask, progress=False)
        out = model.generate(**kwargs, memory_cache=memory, memory_write=False)  # (B, Tq + new)
    return [tokenizer.decode(row[ids.shape[1] :].tolist(), skip_special_tokens=True).strip() for row in out]


def verdict(answer: str, gold: str) -> str:
    """``right`` (the answer starts with the value), ``near`` (a number's leading digit) or ``wrong``."""
    if recall_hit(answer, gold):
        return "right"
    if gold[:1].isdigit() and leading_digit(answer, gold):
        return "near (leading digit)"
    return "wrong"


# ---------------------------------------------------------------------- the sample's scores
def _shares(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` whole shares (the larger first): a progress bar's steps."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def evaluate_english(model, tokenizer, episodes: Sequence[dict], *, progress: bool = True) -> dict[str, Any]:
    """Forced choice and greedy recall over ``episodes`` under :data:`SCORED`, with a progress bar in
    notes (moved after each of a batch's five passes).

    Returns:
        ``{"num_episodes", "forced_choice": {memory, empty, other, chance}, "greedy_exact": {memory,
        empty, other}, "greedy_leading_digit": {memory, empty, other, "num_numbers"}, "episodes":
        [{"note", "question", "gold", "relation", "choices", "picked": {condition: choice}, "answers":
        {condition: text}}]}``. Each pass over a batch writes its ``B <= BATCH`` notes as one
        ``(B, Th)`` batch, then reads ``(B * choices, Tr)`` (forced choice) or generates from
        ``(B, Tq)`` (greedy).
    """
    from tqdm.auto import tqdm

    swapped = swap_histories(episodes)
    records: list[dict] = []
    bar = tqdm(
        total=len(episodes), desc="english notes", unit="note", disable=not progress, dynamic_ncols=True
    )
    for start in range(0, len(episodes), BATCH):
        chunk, others = list(episodes[start : start + BATCH]), swapped[start : start + BATCH]
        steps = iter(_shares(len(chunk), 2 + len(SCORED)))
        own = forced_choice(
            model, tokenizer, chunk, conditions=("memory", "empty"), layout="text", batch_size=BATCH
        )
        bar.update(next(steps))
        other = forced_choice(
            model, tokenizer, others, conditions=("memory",), layout="text", batch_size=BATCH
        )
        bar.update(next(steps))
        picked = {"memory": own["picked"]["memory"], "empty": own["picked"]["empty"]}
        picked["other"] = other["picked"]["memory"]  # the same question, another note in memory
        greedy = {}
        for condition in SCORED:
            greedy[condition] = greedy_answers(
                model, tokenizer, chunk, condition, [e["history"] for e in others]
            )
            bar.update(next(steps))
        for i, episode in enumerate(chunk):
            records.append(
                {
                    "note": episode["history"],
                    "question": episode["question"],
                    "gold": episode["gold"],
                    "relation": episode["relation"],
                    "choices": list(episode["choices"]),
                    "picked": {c: episode["choices"][picked[c][i]] for c in SCORED},
                    "answers": {c: greedy[c][i] for c in SCORED},
                }
            )
    bar.close()
    n = max(len(records), 1)
    numbers = [r for r in records if r["gold"][:1].isdigit()]
    return {
        "num_episodes": len(records),
        "forced_choice": {
            **{c: sum(r["picked"][c] == r["gold"] for r in records) / n for c in SCORED},
            "chance": sum(1 / len(r["choices"]) for r in records) / n,
        },
        "greedy_exact": {c: sum(recall_hit(r["answers"][c], r["gold"]) for r in records) / n for c in SCORED},
        "greedy_leading_digit": {
            **{
                c: (
                    sum(leading_digit(r["answers"][c], r["gold"]) for r in numbers) / len(numbers)
                    if numbers
                    else None
                )
                for c in SCORED
            },
            "num_numbers": len(numbers),
        },
        "episodes": records,
    }


# ---------------------------------------------------------------------- the notes shown
def show_notes(model, tokenizer, records: Sequence[dict], episodes: Sequence[dict]) -> list[dict]:
    """The first notes of :func:`evaluate_english`'s ``records`` (their ``episodes``), each with the
    greedy answer of the plain model given the note in its prompt (``"prompt"``) added to its
    answers, and the note's length in tokens: ``[{..record.., "note_tokens"}]``."""
    if not records:
        return []
    in_prompt = greedy_answers(model, tokenizer, episodes[: len(records)], "prompt")
    window = model.config.max_position_embeddings
    return [
        {
            **record,
            "note_tokens": len(episode_inputs(tokenizer, episode, window, MAX_NEW_TOKENS)["history"]),
            "answers": {**record["answers"], "prompt": in_prompt[i]},
        }
        for i, (record, episode) in enumerate(zip(records, episodes, strict=False))
    ]


def format_notes(shown: Sequence[dict]) -> str:
    """The shown notes as text: the note, question, gold and choices; the greedy answers (first line)
    from memory, from an empty memory and with the note in the prompt, each with its verdict; and the
    forced choice's picks."""
    lines = []
    for i, e in enumerate(shown, 1):
        gold = e["gold"]
        picks = ", ".join(
            f"{label} {e['picked'][c]} ({'right' if e['picked'][c] == gold else 'wrong'})"
            for c, label in (("memory", "memory"), ("empty", "empty memory"), ("other", "another note"))
        )
        lines += [
            f"note {i} of {len(shown)} (held out: a name, sentence form and question the adapter never saw)",
            f"  note        {e['note']}",
            f"              ({e['note_tokens']} tokens, written into memory with write_history; not in the prompt)",
            f"  question    {e['question']}",
            f"  gold        {gold}",
            "  greedy answers:",
        ]
        for condition, label in (("memory", "memory"), ("empty", "empty"), ("prompt", "in prompt")):
            answer = e["answers"][condition].split("\n")[0].strip()
            lines.append(
                f"  {label:<11} {answer or '(nothing)':<18} {verdict(answer, gold):<21} {SHOWN[condition]}"
            )
        lines += [
            f"  forced choice, the likeliest of {' | '.join(e['choices'])}:",
            f"    {picks}",
        ]
        lines.append("")
    return "\n".join(lines)


def format_scores(result: dict[str, Any], backbone: str) -> str:
    """The table of :func:`evaluate_english`'s scores between its captions: what each row and column
    shows (``backbone``: what the weights are, e.g. a Q4_1 GGUF dequantised) above, the noise below."""
    n, digits = result["num_episodes"], result["greedy_leading_digit"]["num_numbers"]
    fc = result["forced_choice"]
    columns = f"{'memory':>8}{'empty memory':>14}{'another note':>14}{'chance':>8}"
    head = f"{f'over {n} held-out notes':<30}{columns}"

    def row(label: str, cells: dict, chance: float | None = None) -> str:
        values = "".join(
            f"{'' if cells[c] is None else format(cells[c], '.2f'):>{w}}"
            for c, w in zip(SCORED, (8, 14, 14), strict=True)
        )
        return f"{label:<30}{values}{'' if chance is None else format(chance, '.2f'):>8}".rstrip()

    lines = [
        caption(
            f"English notes from memory, {n} held-out notes of one fact each (names, sentence forms and "
            f"questions the adapter was never trained on). The backbone: {backbone}. Columns: memory: the "
            "note written into memory, the question alone in the prompt. empty memory: the same adapter and "
            "question, nothing written (what it guesses). another note: memory holding another person's "
            "note of the same kind (what any written note adds). chance: one over the number of choices. "
            "Rows: forced choice: the likeliest of the values of the asked kind (the note's and others) as "
            "the answer. greedy, exact: the greedy answer starts with the value. greedy, leading digit: "
            f"its first digit is the number's ({digits} of the notes state a number; dates excluded)."
        ),
        head,
        "-" * len(head),
        row("forced choice", fc, fc["chance"]),
        row("greedy, exact", result["greedy_exact"]),
        row(f"greedy, leading digit (n={digits})", result["greedy_leading_digit"]),
        caption(
            f"One note is {1 / max(n, 1):.2f} of a row here, and one standard error of a figure at most "
            f"{standard_error(0.5, n):.2f} (binomial, largest at 0.5); --episodes N scores more notes (about "
            "2 s each on a busy 2-core CPU)."
        ),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the command's part
def describe_backbone(folder: str) -> str:
    """What the backbone's weights are: a converted GGUF's original and quantisation (its
    ``lstmem_backbone.json``), else the folder or Hub id."""
    from lstmem_peft.tuner.backbones import read_record

    record = read_record(Path(folder)) if Path(folder).is_dir() else None
    if not record:
        return f"{folder} (its own weights)"
    return (
        f"{record.get('original', record.get('name'))} from the {record.get('quantisation', 'quantised')} GGUF "
        f"of {record.get('source', {}).get('package', 'its package')}, dequantised to float32 (close to, "
        "not equal to, the original weights)"
    )


def _layers(model) -> str:
    config = next(iter(getattr(model, "peft_config", {}).values()), None)
    layers = sorted(getattr(config, "layers_to_transform", None) or [])
    if not layers:
        return "memory on every layer"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"memory on layers {layers[0]}-{layers[-1]}"
    return f"memory on layers {', '.join(map(str, layers))}"


def run_english(settings: EnglishDemo, *, progress: bool = True) -> dict[str, Any]:
    """Load the backbone and adapter, print the notes, the table and the record (module docstring);
    returns the record printed as the last line.

    Runs on one CPU thread (restored afterwards), as the toy demo does: its batches are small (8 notes
    of about 15 tokens, 32 reads of about 25), and on the project's busy 2-core machine two threads
    scored 8 notes 5 to 8 times slower than one (2026-11-29).
    """
    from lstmem_peft.tuner.backbones import resolve_model

    if settings.backbone is None:  # a short name is converted once, on every thread, before the run
        settings = replace(settings, backbone=resolve_model(settings.model))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_english(settings, progress)
    finally:
        torch.set_num_threads(threads)


def _run_english(s: EnglishDemo, progress: bool) -> dict[str, Any]:
    """:func:`run_english` under its thread setting."""
    from lstmem_peft.tuner.loading import load_model_and_adapter

    from ..bench.records import environment

    folder = s.backbone or s.model
    started = time.perf_counter()
    model, tokenizer = load_model_and_adapter(folder, s.adapter, dtype="float32", device="cpu")
    loaded = time.perf_counter()
    backbone = describe_backbone(folder)
    kind = ADAPTER_SHIPPED if s.shipped else ADAPTER_GIVEN
    print(
        caption(
            f"lstmem demo --model {s.model}: the adapter {s.adapter_name} "
            f"({'shipped in the package' if s.shipped else kind}; {_layers(model)}) on "
            f"{backbone}; loaded in {loaded - started:.1f} s. Each note is written into LSTMem memory and is "
            "not in the prompt: the question alone is asked."
        )
    )
    print()
    episodes = demo_episodes(s.num_episodes, s.seed, s.relations)
    result = evaluate_english(model, tokenizer, episodes, progress=progress)
    shown = show_notes(model, tokenizer, result["episodes"][: s.show], episodes)
    print(format_notes(shown))
    print(format_scores(result, backbone))
    finished = time.perf_counter()
    record = {
        "demo": "english notes from memory",
        "model": s.model,
        "backbone": backbone,
        "adapter": s.adapter_name,
        "adapters": kind,
        "num_episodes": result["num_episodes"],
        "seed": s.seed,
        "relations": list(s.relations) if s.relations else None,
        "forced_choice": result["forced_choice"],
        "greedy_exact": result["greedy_exact"],
        "greedy_leading_digit": result["greedy_leading_digit"],
        "shown": shown,
        "seconds": {
            "load": round(loaded - started, 1),
            "notes_and_table": round(finished - loaded, 1),
            "total": round(finished - started, 1),
        },
        **environment(torch.device("cpu")),
    }
    if s.out is not None:
        folder = Path(s.out)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = record["date"].replace(":", "").replace("-", "")[:15]
        path = folder / f"demo-english-{stamp}.json"
        path.write_text(json.dumps({**record, "episodes": result["episodes"]}, indent=2) + "\n")
        record["record"] = str(path)
    print(json.dumps(record))
    return record

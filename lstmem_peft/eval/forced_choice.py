"""Forced choice among the history's own values: recall, told apart from a learned prior (issue 45).

An adapter can score well on questions about memory by learning which answers are likely (a first
trial on English histories learned to answer one word whatever the history said). Here the model
does not generate: for each episode it scores each of the episode's ``choices`` (the values the
history states for the gold's kind, superseded ones included, and a few more:
:func:`lstmem_peft.training.english.english_episodes`) as the answer to the question, and picks the
likeliest. Under three conditions:

* ``"memory"``: the history written into a fresh memory (``write_history``: blocks and block-end
  feedback), then the question and the candidate read with memory read-only, the history absent
  from the prompt;
* ``"empty"``: the same adapter and read, from an empty (zero) memory;
* ``"no_adapter"``: the plain backbone (``model.disable_adapter()``), the question alone.

Recall shows as ``memory`` above both ``empty`` and ``chance`` (the mean of ``1 / len(choices)``);
a prior lifts ``empty`` and ``memory`` alike. The stricter control is ``memory`` over
:func:`swap_histories`' episodes (each history replaced by another's that states a value of the same
relation): what a written memory adds whatever the history says, which a ``memory`` vs ``empty`` gap
alone would read as recall.

Layouts: ``"chat"`` (default) is the served layout of one question
(:func:`~lstmem_peft.training.data.tokenize_conversation`: the history written as text, then the
question as a user message through the tokenizer's chat template, :class:`~lstmem_peft.utils.chat.ChatFormat`,
then the candidate and EOS); ``"text"`` is :func:`~lstmem_peft.training.data.tokenize_episode`'s
(``prompt``, then ``" " + candidate`` and EOS); ``"conversation"`` is a chat client's conversation
(:class:`~lstmem_peft.training.data.ServedConversation`, the client sending each message alone): each
line of the history a user message, written as ``lstmem serve`` writes a chat turn under its default
write policy (the message's own template tokens), then the question as ``"chat"`` asks it. A
candidate's score is the sum of the log-probabilities of its answer tokens (EOS included unless
``add_eos=False``), or their mean with ``per_token=True``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import ServedConversation, left_pad, tokenize_conversation, tokenize_episode
from lstmem_peft.tuner.history import find_memory, write_history

LAYOUTS = ("chat", "text", "conversation")
CONDITIONS = ("memory", "empty", "no_adapter")


def choice_rows(
    tokenizer,
    episode: dict[str, Any],
    layout: str = "chat",
    history_max_tokens: int = K.STAGE1_HISTORY_CAP,
    add_eos: bool = True,
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """One episode's tokens: ``(history ids, [(read ids, answer tokens) per choice])``.

    A read is the prompt followed by the candidate (and EOS); its last ``answer tokens`` ids are the
    candidate's, the ones scored. The history is the same for every choice.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if episode["gold"] not in episode["choices"]:
        raise ValueError(f"the gold {episode['gold']!r} is not among the choices {episode['choices']!r}")
    if layout == "conversation":
        history = conversation_history(tokenizer, episode["history"])[:history_max_tokens]
        _, reads = choice_rows(tokenizer, {**episode, "history": ""}, "chat", history_max_tokens, add_eos)
        return history, reads
    history, reads = [], []
    for j, choice in enumerate(episode["choices"]):
        text = episode["history"] if j == 0 else ""  # the history is tokenized once
        if layout == "chat":
            turn = {"prompt": episode["question"], "answer": choice}
            row = tokenize_conversation(
                tokenizer,
                {"history": text, "turns": [turn]},
                history_max_tokens=history_max_tokens,
            )
            if (
                not add_eos and tokenizer.eos_token_id is not None
            ):  # tokenize_conversation always ends with EOS
                row = {**row, "input_ids": row["input_ids"][:-1], "labels": row["labels"][:-1]}
        else:
            one = {"history": text, "prompt": episode["prompt"], "answer": " " + choice}
            row = tokenize_episode(tokenizer, one, history_max_tokens, add_eos=add_eos)
        n_answer = sum(1 for y in row["labels"] if y != -100)
        if n_answer == 0:
            raise ValueError(f"choice {choice!r} has no tokens")
        history = row["history_input_ids"] if j == 0 else history
        reads.append((row["input_ids"], n_answer))
    return history, reads


def conversation_history(tokenizer, history: str) -> list[int]:
    """What ``lstmem serve`` writes into a chat session's memory when a client sends each line of
    ``history`` as a user message of its own and the session writes its messages (the default
    ``write="messages"``): each message's own chat-template tokens, the template's preamble (a default
    system prompt) never. The assistant's replies in between are not written under that policy."""
    conversation, ids = ServedConversation(tokenizer), []
    for line in history.split("\n"):
        if line.strip():
            before, _ = conversation.ask(line)
            ids += before + conversation.answered("")
    return ids


def _pad_id(tokenizer) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if pad is not None:
            return pad
    return 0


def _accepts(module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def read_scores(
    model,
    reads: list[list[int]],
    n_answer: list[int],
    pad_id: int,
    cache: MemoryCache | None,
    per_token: bool = False,
) -> torch.Tensor:
    """Log-likelihood of each read's last ``n_answer[i]`` tokens given the tokens before them.

    Args:
        model: the model (with its adapter enabled when ``cache`` is given).
        reads: ``R`` token lists (left-padded here into ``(R, T)``).
        n_answer: ``R`` counts of answer tokens at the end of each read.
        pad_id: the padding id.
        cache: a :class:`MemoryCache` of ``R`` rows, read only (``memory_write=False``); ``None``:
            a plain forward (an adapter disabled by the caller).
        per_token: the mean over the answer tokens instead of their sum.

    Returns:
        ``(R,)`` float32 scores on the CPU.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(reads, pad_id, device)
    keep = min(max(n_answer) + 1, ids.shape[1])  # the logits that predict the answer tokens are the last ones
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    if _accepts(find_memory(model).model, "logits_to_keep"):
        kwargs["logits_to_keep"] = keep
    if cache is not None:
        kwargs.update(memory_cache=cache, memory_write=False)
    logits = model(**kwargs, use_cache=False).logits[:, -keep:-1].float()  # (R, keep - 1, V)
    targets = ids[:, -(keep - 1) :]  # (R, keep - 1)
    logp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (R, keep - 1)
    counts = torch.tensor(n_answer, device=device)
    positions = torch.arange(keep - 1, device=device)
    on_answer = positions.unsqueeze(0) >= (keep - 1 - counts).unsqueeze(1)  # (R, keep - 1)
    scores = (logp * on_answer).sum(-1)
    if per_token:
        scores = scores / counts
    return scores.cpu()


def _group(episodes, correct: dict[str, list[bool]], chance: list[float], field: str) -> dict:
    out: dict[str, dict] = {}
    for value in sorted({str(e.get(field)) for e in episodes}):
        idx = [i for i, e in enumerate(episodes) if str(e.get(field)) == value]
        out[value] = {"num_episodes": len(idx), "chance": sum(chance[i] for i in idx) / len(idx)}
        for condition, hits in correct.items():
            out[value][condition] = sum(hits[i] for i in idx) / len(idx)
    return out


# one loop over batches of episodes, each scored under every condition; the rest is bookkeeping
@torch.no_grad()
def forced_choice(
    model,
    tokenizer,
    episodes: Sequence[dict[str, Any]],
    *,
    conditions: Sequence[str] = ("memory", "empty"),
    layout: str = "chat",
    batch_size: int = 8,
    history_max_tokens: int = K.STAGE1_HISTORY_CAP,
    block_size: int | None = None,
    add_eos: bool = True,
    per_token: bool = False,
    groups: Sequence[str] = ("relation", "updated"),
) -> dict[str, Any]:
    """Forced-choice accuracy of ``model`` on ``episodes`` under each condition (module docstring).

    Args:
        model: a model with an LSTMem adapter (a ``PeftModel`` for ``"no_adapter"``), in eval mode.
        tokenizer: its tokenizer.
        episodes: ``N`` dicts with ``history``, ``question`` (``"chat"``) or ``prompt`` (``"text"``),
            ``choices`` (``C_i`` strings) and ``gold`` (one of them), as
            :func:`~lstmem_peft.training.english.english_episodes` makes them.
        conditions: any of ``"memory"``, ``"empty"``, ``"no_adapter"``.
        layout: ``"chat"`` or ``"text"`` (:func:`choice_rows`).
        batch_size: episodes per batch: their histories are written as ``(batch, Th)`` rows, then
            every (episode, choice) pair is read as one row of a ``(sum C_i, Tr)`` batch.
        history_max_tokens: each history keeps its first this many tokens.
        block_size: ``write_history``'s block size (default: the adapter's).
        add_eos, per_token: how a candidate is scored (:func:`read_scores`).
        groups: episode fields to break the accuracies down by (absent fields group as ``"None"``).

    Returns:
        ``{condition: accuracy, ..., "chance": mean 1 / C_i, "num_episodes": N,
        "scores": {condition: [[C_i floats] per episode]}, "picked": {condition: [index per episode]},
        "gold_index": [index per episode], "by": {field: {value: {"num_episodes", "chance",
        condition: accuracy, ...}}}}``. A pick is the first choice with the highest score.
    """
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        raise ValueError(f"conditions must be among {CONDITIONS}, got {list(conditions)}")
    if not episodes:
        raise ValueError("forced_choice needs at least one episode")
    pad = _pad_id(tokenizer)
    device = next(model.parameters()).device
    scores: dict[str, list[list[float]]] = {c: [] for c in conditions}
    for start in range(0, len(episodes), batch_size):
        laid = [
            choice_rows(tokenizer, e, layout, history_max_tokens, add_eos)
            for e in episodes[start : start + batch_size]
        ]
        reads = [ids for _, rows in laid for ids, _ in rows]
        n_answer = [n for _, rows in laid for _, n in rows]
        owner = torch.tensor([i for i, (_, rows) in enumerate(laid) for _ in rows], device=device)
        for condition in conditions:
            if condition == "memory":
                cache = MemoryCache()
                ids, mask = left_pad([h for h, _ in laid], pad, device)
                write_history(model, ids, cache, attention_mask=mask, block_size=block_size, progress=False)
                cache.batch_select_indices(owner)  # one memory row per (episode, choice) read
                flat = read_scores(model, reads, n_answer, pad, cache, per_token)
            elif condition == "empty":
                flat = read_scores(model, reads, n_answer, pad, MemoryCache(), per_token)
            else:
                with model.disable_adapter():
                    flat = read_scores(model, reads, n_answer, pad, None, per_token)
            at = 0
            for _, rows in laid:
                scores[condition].append(flat[at : at + len(rows)].tolist())
                at += len(rows)
    gold = [list(e["choices"]).index(e["gold"]) for e in episodes]
    chance = [1 / len(e["choices"]) for e in episodes]
    picked = {c: [max(range(len(s)), key=s.__getitem__) for s in scores[c]] for c in conditions}
    correct = {c: [p == g for p, g in zip(picked[c], gold, strict=True)] for c in conditions}
    result: dict[str, Any] = {c: sum(correct[c]) / len(episodes) for c in conditions}
    result.update(
        chance=sum(chance) / len(episodes),
        num_episodes=len(episodes),
        scores=scores,
        picked=picked,
        gold_index=gold,
        by={field: _group(episodes, correct, chance, field) for field in groups},
    )
    return result


def swap_histories(episodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The other-history control: each episode with its ``history`` replaced by the next one's (cyclic)
    that asks the same ``relation`` with another ``gold``, else by the next episode's.

    The question, choices and gold stay, so :func:`forced_choice`'s ``"memory"`` accuracy on the result
    is what memory scores when it holds a history of the right kind that does not state the answer.
    """
    swapped = []
    for i, episode in enumerate(episodes):
        others = list(episodes[i + 1 :]) + list(episodes[:i])
        same = [
            o for o in others if o.get("relation") == episode.get("relation") and o["gold"] != episode["gold"]
        ]
        other = same[0] if same else others[0] if others else episode
        swapped.append({**episode, "history": other["history"]})
    return swapped

"""The demo's task, its adapters, and how recall is measured.

Task: histories of key-value facts ``<s> k07 v19 ; k12 v03 ; ...`` (8 pairs, 32 keys, 32 values)
and the question ``<s> ? k07``, answered ``v19``. :func:`evaluate` scores the model three ways:

* history in the context window, no memory (upper bound);
* no history at all (chance);
* history written only into LSTMem memory, question alone (what the adapter adds).

:func:`evaluate_updates` asks again after a later turn gave some keys new values (the newest wins:
where depth coupling and block-end feedback change recall). The adapters (:data:`ADAPTERS`,
:func:`adapter_config`), the episodes as token rows and the teacher-forced scoring here are shared by
the demo's training (:mod:`.training`), its sweep (:mod:`.sweep`) and the ``lstmem demo``
command (:mod:`.demo`).
"""

from __future__ import annotations

import random
import textwrap

import torch
from tqdm.auto import tqdm

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import left_pad, synthetic_recall_episodes, tokenize_episode
from lstmem_peft.tuner.config import LSTMemConfig
from lstmem_peft.tuner.history import memory_layers, write_history
from lstmem_peft.utils.offline import NUM_KEYS, NUM_VALUES, demo_tokenizer

#: Facts per history of the 8-fact table (training sees histories of 1 to this many).
NUM_PAIRS = 8
#: The adapters ``lstmem demo`` compares: the full method and two ablations (config overrides).
ADAPTERS = {
    "full": {},
    "no_depth_coupling": {"depth_coupling": False},
    "no_feedback": {"block_feedback": False},
}

#: The demo backbone's context window, in tokens (question included). Its config allows 4,096
#: positions, but it was only ever trained on sequences of up to 50 tokens: with the whole history
#: in context its recall is 0.996 at 16 facts (51 tokens with the question), 0.600 at 32 facts and
#: 0.043 at 64 (``lstmem demo --sweep``, 2026-11-25). 64 tokens (the question and the last 20
#: facts) is where it still works, and it is also the adapters' block size.
WINDOW = 64

#: Where the seed-to-seed spread of the demo's figures was measured (six adapters per variant, each
#: trained with the shipped recipe: "Where the paper's components show"), named in the captions.
SEEDS_DOC = "docs/demo.md"


def standard_error(p: float, n: int) -> float:
    """One standard error of a recall ``p`` measured on ``n`` episodes (binomial)."""
    return (p * (1 - p) / max(n, 1)) ** 0.5


def caption(text: str, width: int = 100) -> str:
    """A printed table's caption, wrapped for a terminal (never inside a word, nor at a hyphen)."""
    return textwrap.fill(text, width, break_on_hyphens=False, break_long_words=False)


def adapter_config(**overrides) -> LSTMemConfig:
    """The paper's adapter (n_h 4, r 8, alpha 16) on every layer; one block per demo history.
    ``overrides`` may change any of them (``r=16`` for a larger state)."""
    return LSTMemConfig(**{"r": 8, "num_heads": 4, "alpha": 16.0, "block_size": 64, **overrides})


def memory_state_size(model) -> dict:
    """How many numbers the memory holds per sequence: ``n_h * r * r`` per state (C and D) and layer."""
    config = next(iter(model.peft_config.values()))
    layers = len(memory_layers(model))
    per_state = config.num_heads * config.r * config.r
    return {
        "memory_layers": layers,
        "num_heads": config.num_heads,
        "r": config.r,
        "cell_numbers_per_layer": per_state,
        "cell_numbers_total": per_state * layers,
        "state_numbers_total": 2 * per_state * layers,
        "block_size": config.block_size,
        "block_feedback": config.block_feedback,
        "depth_coupling": config.depth_coupling,
    }


# ---------------------------------------------------------------------- episodes as token rows
def episode_rows(tok, episodes: list[dict]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """``(histories, reads, answer lengths)``; a read is the question followed by its answer."""
    rows = [tokenize_episode(tok, e, history_max_tokens=1 << 30, add_eos=False) for e in episodes]
    n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
    return [r["history_input_ids"] for r in rows], [r["input_ids"] for r in rows], n_ans


def in_context_row(tok, history: list[int], read: list[int]) -> list[int]:
    """The whole history, then the question and answer (one BOS)."""
    return history + (read[1:] if tok.bos_token_id is not None else read)


def window_row(tok, history: list[int], read: list[int], n_answer: int, window: int = WINDOW) -> list[int]:
    """What the plain backbone sees when the context is capped: the last tokens of history and
    question that fit in ``window`` (the question always fits), BOS kept first; then the answer."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    question = read[len(bos) : len(read) - n_answer]
    body = history[len(bos) :]
    room = max(0, window - len(bos) - len(question))
    return bos + (body[max(0, len(body) - room) :] if room else []) + question + read[len(read) - n_answer :]


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


# ---------------------------------------------------------------------- answers, scored
def _answers_correct(
    model, rows: list[list[int]], answer_lens: list[int], pad_id: int, cache=None
) -> torch.Tensor:
    """Per row: is every answer token (the last ``answer_lens[i]`` tokens) the argmax given its prefix?"""
    ids, mask = left_pad(rows, pad_id)
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    if cache is None:
        logits = model(**kwargs).logits
    else:
        logits = model(**kwargs, memory_cache=cache, memory_write=False).logits
    pred = logits[:, :-1].argmax(-1)
    target = ids[:, 1:]
    correct = torch.ones(len(rows), dtype=torch.bool)
    for i, n in enumerate(answer_lens):
        correct[i] = bool((pred[i, -n:] == target[i, -n:]).all())
    return correct


def answers_correct(model, tok, rows, n_ans, cache=None, batch_tokens: int = 1 << 14) -> torch.Tensor:
    """Per row: is the answer right (exact match, teacher-forced argmax)? Rows batched by length."""
    width = max(len(r) for r in rows)
    step = max(1, batch_tokens // width)
    out = []
    for i in range(0, len(rows), step):
        part = None
        if cache is not None:
            part = cache.clone()
            part.batch_select_indices(torch.arange(i, min(i + step, len(rows))))
        out.append(_answers_correct(model, rows[i : i + step], n_ans[i : i + step], _pad_id(tok), part))
    return torch.cat(out)


def write_histories(model, tok, histories: list[list[int]]) -> MemoryCache:
    """A fresh memory holding each history (one row each, left-padded; blocks and feedback)."""
    cache = MemoryCache()
    ids, mask = left_pad(histories, _pad_id(tok))
    write_history(model, ids, cache, attention_mask=mask, progress=False)
    return cache


# ---------------------------------------------------------------------- the 8-fact table
@torch.no_grad()
def evaluate(
    model,
    tokenizer=None,
    num_episodes: int = 512,
    seed: int = 12345,
    batch_size: int = 128,
    num_pairs: int = NUM_PAIRS,
    progress: bool = False,
) -> dict:
    """Recall on held-out episodes: exact match of the answer tokens, argmax over the whole vocabulary.

    ``recall_in_context``: adapter disabled, history then question in the context window.
    ``recall_no_history``: adapter disabled, the question alone.
    ``recall_memory``: the history written into LSTMem memory (blocks + feedback), then the question
    alone, memory read-only.
    """
    tok = tokenizer or demo_tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    episodes = synthetic_recall_episodes(num_episodes, num_pairs, seed=seed)
    hits = {"recall_in_context": 0, "recall_no_history": 0, "recall_memory": 0}
    for start in tqdm(range(0, num_episodes, batch_size), desc="evaluating", disable=not progress):
        rows = [tokenize_episode(tok, e, add_eos=False) for e in episodes[start : start + batch_size]]
        reads = [r["input_ids"] for r in rows]
        n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
        histories = [r["history_input_ids"] for r in rows]
        in_context = [
            h + q[1:] if tok.bos_token_id is not None else h + q
            for h, q in zip(histories, reads, strict=True)
        ]
        with model.disable_adapter():
            hits["recall_in_context"] += _answers_correct(model, in_context, n_ans, pad).sum().item()
            hits["recall_no_history"] += _answers_correct(model, reads, n_ans, pad).sum().item()
        cache = MemoryCache()
        hist_ids, hist_mask = left_pad(histories, pad)
        write_history(model, hist_ids, cache, attention_mask=hist_mask, progress=False)
        hits["recall_memory"] += _answers_correct(model, reads, n_ans, pad, cache).sum().item()
    result = {k: v / num_episodes for k, v in hits.items()}
    result.update(
        chance=1 / NUM_VALUES, bag_of_values=1 / num_pairs, num_pairs=num_pairs, num_episodes=num_episodes
    )
    return result


# ---------------------------------------------------------------------- updates: the newest value wins
UPDATE_SEED = 4242


def update_episodes(
    num_episodes: int, first: int = NUM_PAIRS, updated: int = 4, seed: int = UPDATE_SEED
) -> list[dict]:
    """Two turns: ``first`` facts with distinct keys, then a later turn that gives ``updated`` of
    those keys new values. Each episode asks an updated key (``prompt``; gold ``newest``, the
    superseded value ``oldest``) and a key the later turn left alone (``kept_prompt``, ``kept``)."""
    rng = random.Random(seed)
    episodes = []
    for _ in range(num_episodes):
        keys = rng.sample(range(NUM_KEYS), first)
        old = [rng.randrange(NUM_VALUES) for _ in keys]
        again = rng.sample(range(first), updated)
        new = {i: rng.choice([v for v in range(NUM_VALUES) if v != old[i]]) for i in again}
        asked = rng.choice(again)
        kept = rng.choice([i for i in range(first) if i not in again])
        episodes.append(
            {
                "turns": [
                    " ".join(f"k{k:02d} v{v:02d} ;" for k, v in zip(keys, old, strict=True)),
                    " ".join(f"k{keys[i]:02d} v{new[i]:02d} ;" for i in again),
                ],
                "prompt": f"? k{keys[asked]:02d}",
                "newest": f" v{new[asked]:02d}",
                "oldest": f" v{old[asked]:02d}",
                "kept_prompt": f"? k{keys[kept]:02d}",
                "kept": f" v{old[kept]:02d}",
            }
        )
    return episodes


class feedback_off:
    """Within this block, ``model``'s adapter writes without block-end feedback (same weights)."""

    def __init__(self, model):
        self.config = next(iter(model.peft_config.values()))

    def __enter__(self):
        self.was, self.config.block_feedback = self.config.block_feedback, False

    def __exit__(self, *exc):
        self.config.block_feedback = self.was


@torch.no_grad()
def evaluate_updates(model, tokenizer=None, num_episodes: int = 512, seed: int = UPDATE_SEED) -> dict:
    """Recall after an update: the first turn is written (one block, feedback after it), then the
    later turn (another block, feedback after it), then each question alone reads the memory.

    ``update_newest``: an updated key answered with its newest value (gold). ``update_oldest``: the
    same question answered with the superseded value. ``update_kept``: a key the later turn left
    alone, answered with its value.
    """
    tok = tokenizer or demo_tokenizer()
    pad = _pad_id(tok)
    episodes = update_episodes(num_episodes, seed=seed)
    cache = MemoryCache()
    for turn in range(2):
        rows = [tok(e["turns"][turn], add_special_tokens=False)["input_ids"] for e in episodes]
        if turn == 0 and tok.bos_token_id is not None:
            rows = [[tok.bos_token_id] + r for r in rows]
        ids, mask = left_pad(rows, pad)
        write_history(model, ids, cache, attention_mask=mask, progress=False)

    def recall(prompt: str, answer: str) -> float:
        rows = [
            tokenize_episode(tok, {"history": "", "prompt": e[prompt], "answer": e[answer]}, add_eos=False)
            for e in episodes
        ]
        n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
        return answers_correct(model, tok, [r["input_ids"] for r in rows], n_ans, cache).float().mean().item()

    return {
        "update_newest": recall("prompt", "newest"),
        "update_oldest": recall("prompt", "oldest"),
        "update_kept": recall("kept_prompt", "kept"),
        "num_episodes": num_episodes,
    }

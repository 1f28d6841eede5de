"""Answers and log-probabilities read from memory, as a client sees them.

Runs on the scheduler's worker thread. The served model's engine (:class:`~.engine.Engine`) decodes
and scores by token id, reading each row's memory without writing it (the rows passed in are never
modified); this module turns that into what the API returns: answers cut at EOS and stop strings
(:func:`cut_answer`), ``n`` choices per prompt, and log-probabilities as text pieces
(:class:`TokenLogprobs`). What a turn writes, and when, is the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .decoding import Decoded, Sampling, Scores, find_stop
from .engine import Engine, MemoryRow

__all__ = [
    "Answer",
    "TokenLogprobs",
    "cut_answer",
    "generate_rows",
    "score_rows",
]


@dataclass
class Answer:
    """One generated choice: its token ids (after the stop cut), text and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str
    end_token: int | None = None  # the EOS token that ended it (not in ``token_ids``), if one did
    logprobs: TokenLogprobs | None = None  # with ``Sampling.logprobs``: see :func:`attach_logprobs`


def cut_answer(
    tokenizer, token_ids: list[int], eos_ids: frozenset[int], stops: tuple[str, ...], min_tokens: int = 0
) -> Answer:
    """The answer a client sees: tokens up to EOS (excluded), text cut before the first stop string.

    Args:
        eos_ids: the tokens that end an answer (empty with ``ignore_eos``: an EOS is one more token
            of the answer, without text).
        min_tokens: stop strings that end within the text of the first ``min_tokens`` tokens do not
            cut (vLLM's ``min_tokens``: stop strings are looked for once that many were generated).

    Returns:
        :class:`Answer`; ``token_ids`` are the tokens up to EOS, or the tokens whose decoding
        reaches the stop string.
    """
    ids, finish, end = [], "length", None
    for t in token_ids:
        if t in eos_ids:
            finish, end = "stop", t
            break
        ids.append(t)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stops:
        head = len(tokenizer.decode(ids[:min_tokens], skip_special_tokens=True)) if min_tokens else 0
        cut = find_stop(text, stops, head)
        if cut >= 0:
            text, finish = text[:cut], "stop"
            for k in range(len(ids) + 1):  # the shortest token prefix that decodes past the cut
                if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= cut:
                    ids = ids[:k]
                    break
            end = None
    return Answer(ids, text, finish, end)


def generate_rows(
    engine: Engine,
    tokenizer,
    eos_ids: frozenset[int],
    rows: list[MemoryRow],
    prompts: list[list[int]],
    sampling: Sampling,
    stops: list[tuple[str, ...]] | None = None,
    on_token=None,
    cancelled=None,
) -> list[list[Answer]]:
    """Answer ``prompts[i]`` from memory ``rows[i]`` with one call of the engine's ``generate``.

    Memory is only read, so every prompt and answer token reads the memory as it was, and ``rows``
    are not modified. What a turn writes, and when, is the scheduler's
    (:mod:`lstmem_peft.serve.runner`).

    Greedy decoding with ``n > 1`` decodes each prompt once and returns that answer ``n`` times (the
    choices are equal, as OpenAI's are); sampling decodes ``n`` sequences per prompt.

    Args:
        engine: what decodes (the served model's :class:`~.engine.Engine`).
        tokenizer: the served model's tokenizer (answers' text, stop strings, log-probabilities).
        eos_ids: the model's end-of-answer tokens (none are used with ``sampling.ignore_eos``).
        rows: the memories (not modified).
        prompts: prompt token ids per row (non-empty).
        sampling: the shared decoding parameters.
        stops: stop strings per row (default: ``sampling.stop``).
        on_token: ``on_token(expanded_row, token_id)`` per generated token (streaming).
        cancelled: ``cancelled(expanded_row) -> bool``: stop decoding that row.

    Returns:
        per row, ``sampling.n`` :class:`Answer` objects.
    """
    n, k = sampling.n, sampling.decoded  # choices per prompt, sequences decoded per prompt
    stops = stops or [sampling.stop] * len(rows)
    expanded_stops = [s for s in stops for _ in range(k)]
    if k < n:
        on_token, cancelled = _per_decoded_row(n, on_token, cancelled)
    decoded = engine.generate(rows, prompts, sampling, expanded_stops, on_token, cancelled)
    ends = answer_eos_ids(eos_ids, sampling)
    answers = [
        cut_answer(tokenizer, d.token_ids, ends, expanded_stops[r], sampling.min_tokens)
        for r, d in enumerate(decoded)
    ]
    per_row = [answers[i * k : (i + 1) * k] for i in range(len(rows))]
    if k < n:  # greedy: the one decoded answer is each of the ``n`` choices
        per_row = [[replace(a[0], token_ids=list(a[0].token_ids)) for _ in range(n)] for a in per_row]
    return attach_logprobs(engine, tokenizer, rows, prompts, sampling, per_row, decoded)


def answer_eos_ids(eos_ids: frozenset[int], sampling: Sampling) -> frozenset[int]:
    """The tokens that end an answer of ``sampling``: the model's EOS tokens ``eos_ids``, none with
    ``ignore_eos``."""
    return frozenset() if sampling.ignore_eos else eos_ids


def _per_decoded_row(n: int, on_token, cancelled):
    """Greedy ``n > 1``: decoded row ``r`` stands for the equal choices ``r * n .. r * n + n - 1``.
    Returns ``on_token`` and ``cancelled`` of the decoded rows: a token goes to each of the row's
    choices, and the row stops when all of them are cancelled."""
    choice_token, choice_cancelled = on_token, cancelled
    if choice_token is not None:

        def on_token(row: int, token: int) -> None:
            for c in range(n):
                choice_token(row * n + c, token)

    if choice_cancelled is not None:

        def cancelled(row: int) -> bool:
            return all(choice_cancelled(row * n + c) for c in range(n))

    return on_token, cancelled


# ---------------------------------------------------------------------- log-probabilities
@dataclass
class TokenLogprobs:
    """Log-probabilities of a run of tokens (what OpenAI's ``logprobs`` report).

    Attributes:
        ids: the tokens.
        tokens: each token's text: its piece of the decoded text.
        logprobs: each token's log-probability given the tokens before it; ``None`` for the first
            token of a prompt (nothing before it predicts it).
        top: per token, the most likely tokens at its position, ``(text, logprob)`` best first
            (``None`` where ``logprobs`` is).
    """

    ids: list[int]
    tokens: list[str]
    logprobs: list[float | None]
    top: list[list[tuple[str, float]] | None]


def _piece(tokenizer, context: list[int], head: str, token: int) -> str:
    """The text ``token`` adds after ``context`` (whose text is ``head``)."""
    full = tokenizer.decode(context + [token], skip_special_tokens=False)
    if context and full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode([token], skip_special_tokens=False)


def token_logprobs(tokenizer, seq: list[int], start: int, scores: Scores) -> TokenLogprobs:
    """The :class:`TokenLogprobs` of ``seq[start:]``, from the scores of its tokens
    ``seq[max(start, 1):]`` (the sequence's first token has no score: ``None``)."""
    first = max(start, 1)  # position 0 has nothing before it
    if len(scores) != len(seq) - first:
        raise ValueError(f"{len(scores)} scores for the {len(seq) - first} tokens {first}.. of a sequence")
    pieces, tops = [], []
    for t in range(start, len(seq)):
        context = seq[max(0, t - 4) : t]
        head = tokenizer.decode(context, skip_special_tokens=False) if context else ""
        pieces.append(_piece(tokenizer, context, head, seq[t]))
        if t >= first:
            tops.append([(_piece(tokenizer, context, head, x), v) for x, v in scores.top[t - first]])
    lead = [None] * (first - start)
    return TokenLogprobs(list(seq[start:]), pieces, lead + scores.chosen, lead + tops)


def score_rows(
    engine: Engine, tokenizer, rows: list[MemoryRow], sequences: list[list[int]], starts: list[int], top: int
) -> list[TokenLogprobs]:
    """Log-probabilities of ``sequences[i][starts[i]:]`` read from memory ``rows[i]``.

    The engine's :meth:`~.engine.Engine.score`: memory is read, never written (``rows`` are not
    modified), exactly as ``generate_rows`` reads it, so a token's log-probability here is the one
    its answer was decoded from (up to floating-point order). The values are the model's own
    distribution (log-softmax of the logits, before temperature or ``top_p``).

    Args:
        engine: what scores (the served model's :class:`~.engine.Engine`).
        tokenizer: the served model's tokenizer (each token's text piece).
        rows: the memories (not modified).
        sequences: token ids per row (the prompt in context, then the answer).
        starts: the first position reported per row (0: the whole sequence; its first token gets
            ``None``).
        top: how many most likely tokens to report per position (0: none).
    """
    out = [TokenLogprobs([], [], [], []) for _ in rows]
    todo = [i for i in range(len(rows)) if starts[i] < len(sequences[i])]
    if not todo:
        return out
    scores = engine.score(
        [rows[i] for i in todo], [sequences[i] for i in todo], [starts[i] for i in todo], top
    )
    for i, score in zip(todo, scores, strict=True):
        out[i] = token_logprobs(tokenizer, sequences[i], starts[i], score)
    return out


def attach_logprobs(
    engine: Engine,
    tokenizer,
    rows: list[MemoryRow],
    prompts: list[list[int]],
    sampling: Sampling,
    answers: list[list[Answer]],
    decoded: list[Decoded] | None = None,
) -> list[list[Answer]]:
    """With ``sampling.logprobs`` set, give each answer its :class:`TokenLogprobs`: its tokens (the
    EOS token that ended it included), after the prompt's tokens with ``sampling.echo``. They are
    the scores the engine decoded the answer with where it kept them (``decoded``:
    ``sampling.decoded`` per prompt, each with its ``scores``), else :func:`score_rows` of the memory
    the answer was generated from. Returns ``answers``."""
    if sampling.logprobs is None:
        return answers
    if decoded is not None and any(d.scores is None for d in decoded):
        decoded = None  # the engine kept no scores: score the answers from the same memory
    owners, sequences, starts, memories, known = [], [], [], [], []
    for i, choices in enumerate(answers):
        for c, answer in enumerate(choices[: sampling.decoded]):  # greedy: the choices are one answer
            ids = answer.token_ids + ([answer.end_token] if answer.end_token is not None else [])
            owners.append((i, c))
            sequences.append(list(prompts[i]) + ids)
            starts.append(0 if sampling.echo else len(prompts[i]))
            memories.append(rows[i])
            if decoded is not None:
                known.append(_decoded_scores(decoded[i * sampling.decoded + c], len(ids), sampling.echo))
    if decoded is None:
        scores = score_rows(engine, tokenizer, memories, sequences, starts, sampling.logprobs)
    else:
        scores = [
            token_logprobs(tokenizer, seq, start, s)
            for seq, start, s in zip(sequences, starts, known, strict=True)
        ]
    for (i, c), score in zip(owners, scores, strict=True):
        targets = answers[i] if sampling.decoded < sampling.n else [answers[i][c]]
        for answer in targets:
            answer.logprobs = score
    return answers


def _decoded_scores(decoded: Decoded, answered: int, echo: bool) -> Scores:
    """The scores of an answer's first ``answered`` tokens (its tokens up to the cut, and the EOS that
    ended it), after those of its prompt's tokens with ``echo``."""
    if decoded.scores is None or (echo and decoded.prompt_scores is None):
        raise RuntimeError("the engine returned no log-probabilities for a request that asked for them")
    answer = decoded.scores[:answered]
    return decoded.prompt_scores + answer if echo else answer

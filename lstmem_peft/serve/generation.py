"""Answers and log-probabilities read from memory: batched ``generate`` and scoring forwards.

Runs on the scheduler's worker thread, as :mod:`.runtime` does. Memory is only read here:
``model.generate(memory_cache=..., memory_write=False)`` (:func:`generate_rows`) and a forward with
``memory_write=False`` (:func:`score_rows`), on a batch gathered with :func:`.runtime.gather`; the
rows passed in are never modified. With ``--engine vllm`` both come from the vLLM engine, which reads
memory the same way and gives the log-probabilities of what it decodes (:class:`Decoded`). What a
turn writes, and when, is the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import left_pad

from .runtime import LoadedModel, gather


# ---------------------------------------------------------------------- decoding parameters
@dataclass(frozen=True)
class Sampling:
    """The decoding parameters of one request (requests batch together only when these agree)."""

    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None = None  # log-probabilities of the answer's tokens, with this many top tokens
    echo: bool = False  # ... and of the prompt's tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def decoded(self) -> int:
        """Sequences decoded per prompt: ``n`` when sampling; one when greedy (its ``n`` choices are
        that one answer, as OpenAI returns them: equal)."""
        return 1 if self.greedy else self.n

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one ``generate`` call; a seeded request runs alone
        (one RNG stream per call), which the scheduler enforces."""
        scored = (self.logprobs, self.echo)
        if self.greedy:
            return ("greedy", self.max_tokens, self.n, self.stop, *scored)
        return ("sample", self.max_tokens, self.temperature, self.top_p, self.n, self.stop, *scored)

    def generate_kwargs(self) -> dict:
        """Keyword arguments of ``model.generate`` for these parameters (``top_k`` off: OpenAI has none).

        Greedy decoding gets no ``num_return_sequences`` (transformers refuses it without sampling):
        :func:`generate_rows` decodes once and repeats the answer ``n`` times."""
        if self.greedy:
            kwargs = {"do_sample": False}
        else:
            kwargs = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        kwargs["max_new_tokens"] = self.max_tokens
        if self.decoded > 1:
            kwargs["num_return_sequences"] = self.decoded
        return kwargs


class _StopRows(StoppingCriteria):
    """Marks a row finished once its decoded answer contains a stop string, or when its request
    was cancelled (the client went away)."""

    def __init__(self, tokenizer, prompt_width: int, stops: list[tuple[str, ...]], cancelled) -> None:
        self.tokenizer = tokenizer
        self.width = prompt_width
        self.stops = stops
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row in range(input_ids.shape[0]):
            if self.cancelled(row):
                done[row] = True
            elif self.stops[row]:
                text = self.tokenizer.decode(input_ids[row, self.width :], skip_special_tokens=True)
                done[row] = any(s in text for s in self.stops[row])
        return done


class RowStreamer(BaseStreamer):
    """Sends each generated token to ``on_token(row, token_id)`` (rows of the expanded batch).

    transformers calls ``put`` first with the prompt, then with one ``(B,)`` tensor per step.
    """

    def __init__(self, on_token) -> None:
        self.on_token = on_token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for row, token in enumerate(value.reshape(-1).tolist()):
            self.on_token(row, token)

    def end(self) -> None:
        pass


@dataclass
class Answer:
    """One generated choice: its token ids (after the stop cut), text and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str
    end_token: int | None = None  # the EOS token that ended it (not in ``token_ids``), if one did
    logprobs: TokenLogprobs | None = None  # with ``Sampling.logprobs``: see :func:`attach_logprobs`


def cut_answer(tokenizer, token_ids: list[int], eos_ids: frozenset[int], stops: tuple[str, ...]) -> Answer:
    """The answer a client sees: tokens up to EOS (excluded), text cut before the first stop string.

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
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
            for k in range(len(ids) + 1):  # the shortest token prefix that decodes past the cut
                if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= cut:
                    ids = ids[:k]
                    break
            end = None
    return Answer(ids, text, finish, end)


def generate_rows(
    loaded: LoadedModel,
    rows: list[MemoryCache],
    prompts: list[list[int]],
    sampling: Sampling,
    stops: list[tuple[str, ...]] | None = None,
    on_token=None,
    cancelled=None,
) -> list[list[Answer]]:
    """Answer ``prompts[i]`` from memory ``rows[i]`` with one left-padded ``generate`` call.

    Memory is only read: ``model.generate(memory_cache=..., memory_write=False)``, so every prompt
    and answer token reads the memory as it was, and ``rows`` are not modified. What a turn writes,
    and when, is the scheduler's (:mod:`lstmem_peft.serve.scheduler`). (With ``--engine vllm`` the
    answer comes from vLLM, reading the row's memory the same way: ``lstmem_memory_write: false``.)

    Greedy decoding with ``n > 1`` decodes each prompt once and returns that answer ``n`` times (the
    choices are equal, as OpenAI's are); sampling decodes ``n`` sequences per prompt.

    Args:
        loaded: the served model.
        rows: one-row caches.
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
    decoded = None
    if loaded.engine is not None:
        decoding = sampling if k == n else replace(sampling, n=k)
        decoded = [
            Decoded(ids, _scores(scores), _scores(prompt_scores))
            for ids, scores, prompt_scores in loaded.engine.generate(
                rows, prompts, decoding, loaded.eos_ids, on_token
            )
        ]
        generated = [d.token_ids for d in decoded]
    else:
        generated = _generate(loaded, rows, prompts, sampling, expanded_stops, on_token, cancelled)
    answers = [
        cut_answer(loaded.tokenizer, ids, loaded.eos_ids, expanded_stops[r])
        for r, ids in enumerate(generated)
    ]
    per_row = [answers[i * k : (i + 1) * k] for i in range(len(rows))]
    if k < n:  # greedy: the one decoded answer is each of the ``n`` choices
        per_row = [[replace(a[0], token_ids=list(a[0].token_ids)) for _ in range(n)] for a in per_row]
    return attach_logprobs(loaded, rows, prompts, sampling, per_row, decoded)


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


def _generate(
    loaded: LoadedModel,
    rows: list[MemoryCache],
    prompts: list[list[int]],
    sampling: Sampling,
    stops: list[tuple[str, ...]],
    on_token,
    cancelled,
) -> list[list[int]]:
    """The model's own ``generate`` over the left-padded prompts, memory read-only; returns the
    generated token ids of each decoded row (``len(prompts) * sampling.decoded`` rows, prompt by
    prompt), uncut. ``stops``, ``on_token`` and ``cancelled`` are per decoded row."""
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = 0 if pad is None else pad
    ids, mask = left_pad(prompts, pad, loaded.device)
    kwargs = sampling.generate_kwargs()
    if any(stops) or cancelled is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [_StopRows(tok, ids.shape[1], stops, cancelled or (lambda row: False))]
        )
    if on_token is not None:
        kwargs["streamer"] = RowStreamer(on_token)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = loaded.library_model().generate(
            input_ids=ids,
            attention_mask=mask,
            memory_cache=gather(rows),
            memory_write=False,
            pad_token_id=pad,
            **kwargs,
        )
    return out[:, ids.shape[1] :].tolist()


# ---------------------------------------------------------------------- log-probabilities
#: Logits held at once while scoring (rows x positions x vocabulary): larger batches are scored in parts.
SCORE_ELEMENTS = 1 << 27


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


@dataclass
class Scores:
    """Log-probabilities of consecutive tokens of a sequence, by token id (before they become text:
    :func:`token_logprobs`). The model's own distribution: log-softmax of the logits, before
    temperature or ``top_p``.

    Attributes:
        chosen: per token, its log-probability given the tokens before it.
        top: per token, the most likely tokens at its position, ``(token_id, logprob)`` best first
            (empty lists when none were asked for).
    """

    chosen: list[float]
    top: list[list[tuple[int, float]]]

    def __add__(self, other: Scores) -> Scores:
        """The scores of these tokens followed by ``other``'s."""
        return Scores(self.chosen + other.chosen, self.top + other.top)

    def __getitem__(self, index: slice) -> Scores:
        """The scores of a slice of the tokens."""
        return Scores(self.chosen[index], self.top[index])

    def __len__(self) -> int:
        return len(self.chosen)


@dataclass
class Decoded:
    """One sequence an engine decoded (``--engine vllm``), with its log-probabilities when the
    request asked for them (:class:`Sampling` ``logprobs``).

    Attributes:
        token_ids: the generated tokens, uncut (an EOS that ended it included).
        scores: the :class:`Scores` of ``token_ids``, or ``None``.
        prompt_scores: with ``Sampling.echo``, the :class:`Scores` of the prompt's tokens after its
            first (nothing predicts the first), else ``None``.
    """

    token_ids: list[int]
    scores: Scores | None = None
    prompt_scores: Scores | None = None


def _scores(pair: tuple | None) -> Scores | None:
    """An engine's ``(chosen, top)`` log-probabilities as :class:`Scores` (``None`` stays ``None``)."""
    return None if pair is None else Scores(*pair)


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
    loaded: LoadedModel, rows: list[MemoryCache], sequences: list[list[int]], starts: list[int], top: int
) -> list[TokenLogprobs]:
    """Log-probabilities of ``sequences[i][starts[i]:]`` read from memory ``rows[i]``.

    One left-padded forward per group of rows with ``memory_write=False``: memory is read, never
    written (``rows`` are not modified), exactly as ``generate_rows`` reads it, so a token's
    log-probability here is the one its answer was decoded from (up to floating-point order). The
    values are the model's own distribution (log-softmax of the logits, before temperature or
    ``top_p``). With ``--engine vllm``, the vLLM engine scores the sequences as prompts, read-only
    (its raw prompt log-probabilities: the same distribution).

    Args:
        loaded: the served model.
        rows: one-row caches.
        sequences: token ids per row (the prompt in context, then the answer).
        starts: the first position reported per row (0: the whole sequence; its first token gets
            ``None``).
        top: how many most likely tokens to report per position (0: none).
    """
    out = [TokenLogprobs([], [], [], []) for _ in rows]
    todo = [i for i in range(len(rows)) if starts[i] < len(sequences[i])]
    if not todo:
        return out
    if loaded.engine is not None:
        whole = [
            Scores(*s)
            for s in loaded.engine.score([rows[i] for i in todo], [sequences[i] for i in todo], top)
        ]
        scores = [s[max(starts[i], 1) - 1 :] for i, s in zip(todo, whole, strict=True)]
    else:
        scores = _forward_scores(loaded, rows, sequences, starts, todo, top)
    for i, score in zip(todo, scores, strict=True):
        out[i] = token_logprobs(loaded.tokenizer, sequences[i], starts[i], score)
    return out


def _forward_scores(
    loaded: LoadedModel,
    rows: list[MemoryCache],
    sequences: list[list[int]],
    starts: list[int],
    todo: list[int],
    top: int,
) -> list[Scores]:
    """The library model's :class:`Scores` of ``sequences[i][max(starts[i], 1):]`` for each ``i`` of
    ``todo`` (in that order): left-padded forwards of as many rows as :data:`SCORE_ELEMENTS` allows."""
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = 0 if pad is None else pad
    out: dict[int, Scores] = {}
    waiting = list(todo)
    while waiting:
        group = [waiting.pop(0)]
        width = len(sequences[group[0]])
        while (
            waiting
            and (len(group) + 1) * max(width, len(sequences[waiting[0]])) * loaded.vocab_size
            <= SCORE_ELEMENTS
        ):
            group.append(waiting.pop(0))
            width = max(width, len(sequences[group[-1]]))
        ids, mask = left_pad([sequences[i] for i in group], pad, loaded.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = loaded.library_model()(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                memory_cache=gather([rows[i] for i in group]),
                memory_write=False,
                use_cache=False,
            ).logits
        for j, i in enumerate(group):
            seq = sequences[i]
            first = max(starts[i], 1)  # position 0 has nothing before it
            offset = ids.shape[1] - len(seq)  # left padding
            chosen: list[float] = []
            best: list[list[tuple[int, float]]] = []
            for a in range(first, len(seq), 512):  # log-softmax over the vocabulary, in parts
                b = min(a + 512, len(seq))
                lp = logits[j, offset + a - 1 : offset + b - 1].float().log_softmax(-1)
                target = torch.tensor(seq[a:b], device=lp.device)
                chosen += lp.gather(-1, target[:, None])[:, 0].tolist()
                if top:
                    values, index = lp.topk(min(top, lp.shape[-1]), dim=-1)
                    best += [
                        list(zip(x, v, strict=True))
                        for x, v in zip(index.tolist(), values.tolist(), strict=True)
                    ]
                else:
                    best += [[] for _ in range(b - a)]
            out[i] = Scores(chosen, best)
    return [out[i] for i in todo]


def attach_logprobs(
    loaded: LoadedModel,
    rows: list[MemoryCache],
    prompts: list[list[int]],
    sampling: Sampling,
    answers: list[list[Answer]],
    decoded: list[Decoded] | None = None,
) -> list[list[Answer]]:
    """With ``sampling.logprobs`` set, give each answer its :class:`TokenLogprobs`: its tokens (the
    EOS token that ended it included), after the prompt's tokens with ``sampling.echo``. They are
    the scores the engine decoded the answer with (``decoded``: ``sampling.decoded`` per prompt,
    from a vLLM engine), else :func:`score_rows` of the memory the answer was generated from.
    Returns ``answers``."""
    if sampling.logprobs is None:
        return answers
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
        scores = score_rows(loaded, memories, sequences, starts, sampling.logprobs)
    else:
        scores = [
            token_logprobs(loaded.tokenizer, seq, start, s)
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

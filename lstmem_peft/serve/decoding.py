"""What a request asks an engine to decode, and what comes back by token id.

:class:`Sampling` holds one request's decoding parameters; :class:`Scores` the log-probabilities
of a run of tokens, by token id; :class:`Decoded` one decoded sequence. Every engine
(:mod:`.engine`) speaks in these types; :mod:`.generation` turns them into what a client sees
(text, stop cuts, OpenAI's log-probability fields).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    #: OpenAI's ``logit_bias``: ``(token_id, bias)`` pairs, ids ascending, each bias added to that
    #: token's logit before sampling (before temperature and ``top_p``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: vLLM's ``min_tokens``: the EOS tokens are ruled out, and stop strings are not looked for, until
    #: this many tokens were generated
    min_tokens: int = 0
    #: vLLM's ``ignore_eos``: an EOS token does not end the answer (decoding goes on to ``max_tokens``
    #: or a stop string); it stays in the answer's tokens, as a special token without text
    ignore_eos: bool = False

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
        scored = (self.logprobs, self.echo, self.logit_bias, self.min_tokens, self.ignore_eos)
        if self.greedy:
            return ("greedy", self.max_tokens, self.n, self.stop, *scored)
        return ("sample", self.max_tokens, self.temperature, self.top_p, self.n, self.stop, *scored)

    def generate_kwargs(self) -> dict:
        """Keyword arguments of ``model.generate`` for these parameters (``top_k`` off: OpenAI has none).

        Greedy decoding gets no ``num_return_sequences`` (transformers refuses it without sampling):
        :func:`generate_rows` decodes once and repeats the answer ``n`` times. ``logit_bias`` is
        transformers' ``sequence_bias`` of one-token sequences (its ``SequenceBiasLogitsProcessor``,
        which runs before temperature and ``top_p``); ``ignore_eos`` is ``eos_token_id=None`` (no EOS
        stopping criterion). ``min_tokens`` needs the prompt's width and the EOS tokens: the engine
        adds its processor (:meth:`~.engine_library.LibraryEngine.generate`)."""
        if self.greedy:
            kwargs = {"do_sample": False}
        else:
            kwargs = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        kwargs["max_new_tokens"] = self.max_tokens
        if self.decoded > 1:
            kwargs["num_return_sequences"] = self.decoded
        if self.logit_bias:
            kwargs["sequence_bias"] = [[[token], float(bias)] for token, bias in self.logit_bias]
        if self.ignore_eos:
            kwargs["eos_token_id"] = None
        return kwargs


def find_stop(text: str, stops: tuple[str, ...], after: int = 0) -> int:
    """Where the answer ``text`` is cut: the start of the first stop string that ends past its first
    ``after`` characters (the text of the tokens before ``min_tokens``, where vLLM does not look for
    stop strings), or -1 when there is none."""
    cuts = []
    for stop in stops:
        at = text.find(stop, max(0, after - len(stop) + 1))
        if at >= 0:
            cuts.append(at)
    return min(cuts, default=-1)


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
    """One sequence an engine decoded, with the log-probabilities it decoded it with when the
    request asked for them (:class:`Sampling` ``logprobs``) and the engine keeps them (vLLM does;
    the library engine's are scored afterwards from the same memory: :func:`.generation.attach_logprobs`).

    Attributes:
        token_ids: the generated tokens, uncut (an EOS that ended it included).
        scores: the :class:`Scores` of ``token_ids``, or ``None`` (not asked for, or not kept).
        prompt_scores: with ``Sampling.echo``, the :class:`Scores` of the prompt's tokens after its
            first (nothing predicts the first), else ``None``.
    """

    token_ids: list[int]
    scores: Scores | None = None
    prompt_scores: Scores | None = None

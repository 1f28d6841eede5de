"""``lstmem serve --engine vllm``: the server's answers generated, and its memory written, by a vLLM engine.

The server (:mod:`lstmem_peft.serve`) keeps its API, session store and turn rules; writing a turn's
messages into memory, answering from the session's memory and scoring log-probabilities run on vLLM,
and no library model is loaded: the vLLM engine holds the only copy of the weights, and what the server
says about the model (memory layout, block size, EOS tokens, vocabulary, the adapter's fingerprint) is
read from the backbone's and the adapter's files (:meth:`lstmem_peft.serve.LoadedModel.of_files`).

Memory is written as the default engine writes it (:func:`lstmem_peft.write_history` without a KV
cache: each block of the adapter's ``block_size`` tokens a forward of its own, block-end feedback
after each): one history request (``lstmem_history``) per block, each continuing its row's session
(:meth:`VLLMAnswers.write_rows`). Each row's memory reaches vLLM as a session
(``lstmem_session_in``): a :class:`~lstmem_peft.MemoryCache` file with a random name in the session
directory, removed after use. The session directory is ``LSTMEM_SESSION_DIR`` when the operator set
it, else a temporary folder, which :class:`VLLMAnswers` sets as ``LSTMEM_SESSION_DIR`` of this process
(so of the vLLM processes it starts). Every answering row is a read-only request
(``lstmem_memory_write`` false): its prompt and answer read the memory as it was and write nothing,
as the default engine's ``generate(memory_cache=..., memory_write=False)``, so greedy answers are the
default engine's.

Log-probabilities are vLLM's own (``SamplingParams.logprobs`` for the answer's tokens,
``prompt_logprobs`` for an echoed prompt, and a read-only one-token request for a completion that only
scores its prompt): vLLM's default ``logprobs_mode`` ``raw_logprobs`` is the log-softmax of the
model's logits before temperature and ``top_p``, what the default engine reports (an engine started
with another ``logprobs_mode`` is refused).

Differences from the default engine: sampled answers come from vLLM's random streams (a seed
fixes them, but not to the library's tokens); streamed tokens arrive when the batch's generation
ends; a cancelled stream's rows are decoded to the end (nothing is committed for them either way);
memory writes report no gate statistics (``gates`` is ``None`` in the session's record).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from lstmem_peft.memory.sessions import session_file
from lstmem_peft.utils.extras import missing_extra

from . import HISTORY, MEMORY_WRITE, SESSION_DIR_ENV, SESSION_IN, SESSION_OUT, engine_args


def require_vllm() -> None:
    """Raise the ``ImportError`` that names the extra when vLLM is not installed."""
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as err:
        raise missing_extra(err, "vllm", "lstmem serve --engine vllm") from err


def check_block_fits(max_model_len: int, block_size: int) -> None:
    """Refuse an engine whose ``max_model_len`` cannot hold one history block and its one sampled
    token (vLLM refuses such a request only when the first turn writes memory)."""
    if max_model_len <= block_size:
        raise ValueError(
            f"the vLLM engine's max_model_len ({max_model_len}) must exceed the adapter's block_size "
            f"({block_size}): memory is written one block per request, plus the token each request samples; "
            f"pass --vllm-arg max_model_len={block_size + 1} or more"
        )


def check_logprob_options(options: dict, top_logprobs: int) -> None:
    """Refuse ``vllm.LLM`` options under which vLLM's log-probabilities would not be the server's:
    a ``logprobs_mode`` other than ``raw_logprobs`` (the model's log-softmax before temperature and
    ``top_p``), or a ``max_logprobs`` below ``top_logprobs``, the most a request may ask for."""
    mode = options.get("logprobs_mode", "raw_logprobs")
    if mode != "raw_logprobs":
        raise ValueError(
            f"logprobs_mode={mode!r}: lstmem serve reports the model's own log-probabilities (before temperature "
            "and top_p), vLLM's raw_logprobs; drop --vllm-arg logprobs_mode"
        )
    most = options.get("max_logprobs", top_logprobs)
    if most != -1 and most < top_logprobs:
        raise ValueError(
            f"max_logprobs={most}: requests to lstmem serve may ask for {top_logprobs} top log-probabilities per "
            f"token; drop --vllm-arg max_logprobs or set it to {top_logprobs} or more"
        )


def vllm_scores(positions, tokens, top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """vLLM's log-probabilities of consecutive tokens, by token id: ``(chosen, top)``, each token's
    log-probability and its position's ``top`` most likely ``(token_id, logprob)``, best first (the
    fields of the server's ``Scores``).

    Args:
        positions: per token, vLLM's ``{token_id: Logprob}`` at its position (``CompletionOutput.logprobs``,
            or ``RequestOutput.prompt_logprobs`` after its leading ``None``): the token's own entry
            and the ``top`` most likely tokens, ranked from 1.
        tokens: the tokens, one per position.
        top: how many most likely tokens to keep per position.
    """
    if positions is None or len(positions) != len(tokens):
        raise RuntimeError(
            f"vLLM returned log-probabilities for {0 if positions is None else len(positions)} of {len(tokens)} tokens"
        )
    chosen, best = [], []
    for position, token in zip(positions, tokens, strict=True):
        chosen.append(position[token].logprob)
        ranked = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in position.items())
        best.append([(token_id, logprob) for rank, token_id, logprob in ranked if rank <= top][:top])
    return chosen, best


class VLLMAnswers:
    """A vLLM engine over ``model`` + ``adapter`` that answers batches of session rows.

    Args:
        model, adapter: the backbone and the LSTMem adapter (local folders or Hub ids).
        dtype: the engine's dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        block_size: the adapter's history block length: one history request holds a block and
            asks for one token, so the engine's ``max_model_len`` must exceed it (checked before
            the engine starts when ``options`` sets it, else once it has started).
        options: more keyword arguments of ``vllm.LLM`` (``max_model_len``, on CPU
            ``kv_cache_memory_bytes``, ...); ``logprobs_mode`` other than ``raw_logprobs`` and
            ``max_logprobs`` below ``top_logprobs`` are refused (the server's log-probabilities are
            the model's raw ones).
        top_logprobs: the most top log-probabilities per token a request may ask for.

    Attributes:
        session_dir: the session directory the rows' memories are written to (``LSTMEM_SESSION_DIR``;
            a temporary folder, set as that variable, when it was unset).
    """

    def __init__(
        self,
        model: str,
        adapter: str,
        block_size: int,
        dtype: str = "auto",
        *,
        top_logprobs: int = 0,
        **options,
    ) -> None:
        if "max_model_len" in options:
            check_block_fits(int(options["max_model_len"]), block_size)
        check_logprob_options(options, top_logprobs)
        require_vllm()
        from vllm import LLM

        self._folder = None
        if not os.environ.get(SESSION_DIR_ENV):
            self._folder = tempfile.TemporaryDirectory(prefix="lstmem-vllm-")
            os.environ[SESSION_DIR_ENV] = self._folder.name  # read by the vLLM processes started below
        self.session_dir = os.environ[SESSION_DIR_ENV]
        self.llm = LLM(**engine_args(model, adapter, dtype=dtype, skip_tokenizer_init=True, **options))
        try:
            check_block_fits(self.llm.model_config.max_model_len, block_size)
        except ValueError:
            self.llm.llm_engine.engine_core.shutdown()  # the engine's processes end with the error
            raise

    @property
    def max_model_len(self) -> int:
        """The most tokens a request of this engine holds: its prompt and what it generates."""
        return int(self.llm.model_config.max_model_len)

    def generate(self, rows, prompts, sampling, eos_ids: frozenset[int], on_token=None) -> list:
        """Every expanded row's decoded sequence (``n`` choices per row, row-major), each from its
        row's memory read-only, with vLLM's log-probabilities when ``sampling.logprobs`` asks for them.

        Args:
            rows: one-row :class:`~lstmem_peft.MemoryCache` per prompt (not modified).
            prompts: prompt token ids per row.
            sampling: the request's :class:`~lstmem_peft.serve.generation.Sampling`: with ``logprobs``
                set, each generated token's log-probability and its ``logprobs`` most likely tokens;
                with ``echo`` too, the prompt's.
            eos_ids: tokens that end an answer.
            on_token: ``on_token(expanded_row, token_id)`` for every generated token, in order.

        Returns:
            per expanded row, ``(token_ids, scores, prompt_scores)``: the generated tokens (uncut, an
            EOS that ended them included); with ``sampling.logprobs``, their :func:`vllm_scores`
            (else ``None``); with ``sampling.echo`` too, those of the prompt's tokens after its first
            (else ``None``).
        """
        from vllm import SamplingParams

        top = sampling.logprobs
        with self._sessions(rows) as names:
            params = [
                SamplingParams(
                    n=sampling.n,
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                    top_p=1.0 if sampling.greedy else sampling.top_p,
                    seed=sampling.seed,
                    stop_token_ids=sorted(eos_ids),
                    detokenize=False,
                    logprobs=top,
                    prompt_logprobs=top if top is not None and sampling.echo else None,
                    extra_args={SESSION_IN: name, MEMORY_WRITE: False},
                )
                for name in names
            ]
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        decoded = []
        for output in outputs:
            prompt_scores = None
            if top is not None and sampling.echo:
                prompt_scores = vllm_scores(output.prompt_logprobs[1:], output.prompt_token_ids[1:], top)
            for choice in output.outputs:
                scores = None if top is None else vllm_scores(choice.logprobs, choice.token_ids, top)
                decoded.append((list(choice.token_ids), scores, prompt_scores))
        if on_token is not None:
            for row, (tokens, _, _) in enumerate(decoded):
                for token in tokens:
                    on_token(row, token)
        return decoded

    def score(self, rows, sequences: list[list[int]], top: int) -> list:
        """vLLM's log-probabilities of each sequence's tokens after its first, from its row's memory
        read-only: the sequence as a prompt (``prompt_logprobs``) of a request that samples one token
        and writes nothing, as :func:`~lstmem_peft.serve.generation.score_rows` scores with the model.

        Args:
            rows: one-row :class:`~lstmem_peft.MemoryCache` per sequence (not modified).
            sequences: token ids per row, each non-empty.
            top: how many most likely tokens to report per position (0: none).

        Returns:
            per sequence, the :func:`vllm_scores` of its tokens ``1 ..``.
        """
        from vllm import SamplingParams

        with self._sessions(rows) as names:
            params = [
                SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    detokenize=False,
                    prompt_logprobs=top,
                    extra_args={SESSION_IN: name, MEMORY_WRITE: False},
                )
                for name in names
            ]
            outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [
            vllm_scores(o.prompt_logprobs[1:], s[1:], top) for o, s in zip(outputs, sequences, strict=True)
        ]

    @contextmanager
    def _sessions(self, rows) -> Iterator[list[str]]:
        """Each row's memory saved as a session of the session directory, under a fresh name; the
        files (as the engine left them) are removed when the block ends. Yields the names."""
        batch = secrets.token_hex(8)
        names = [f"lstmem-serve-{batch}-{i}" for i in range(len(rows))]
        paths = [session_file(self.session_dir, name) for name in names]
        try:
            for memory, path in zip(rows, paths, strict=True):
                memory.save(path)
            yield names
        finally:
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)

    def write_rows(self, rows, tokens: list[list[int]], block_size: int) -> list:
        """Write ``tokens[i]`` into ``rows[i]`` as a history, as the default engine's
        :func:`~lstmem_peft.serve.runtime.write_rows` does (:func:`lstmem_peft.write_history` without a KV
        cache: block ``k`` of a row is its tokens ``[k * block_size, (k + 1) * block_size)``, a forward
        of its own, followed by block-end feedback).

        Block ``k`` of every row that has one is one vLLM batch of history requests (``lstmem_history``,
        ``max_tokens=1``), each continuing its row's session file in place.

        Args:
            rows: one-row :class:`~lstmem_peft.MemoryCache` per row (not modified).
            tokens: token ids per row, each non-empty.
            block_size: the adapter's history block length.

        Returns:
            the new one-row caches, on the CPU, in order.

        Raises:
            RuntimeError: the worker failed to read or write a row's session (see vLLM's log).
        """
        from vllm import SamplingParams

        from lstmem_peft.memory.cache import MemoryCache

        blocks = [[t[k : k + block_size] for k in range(0, len(t), block_size)] for t in tokens]
        with self._sessions(rows) as names:
            failed = self._failures()
            for k in range(max((len(b) for b in blocks), default=0)):
                todo = [i for i, b in enumerate(blocks) if k < len(b)]
                params = [
                    SamplingParams(
                        max_tokens=1,
                        temperature=0.0,
                        detokenize=False,
                        extra_args={SESSION_IN: names[i], SESSION_OUT: names[i], HISTORY: True},
                    )
                    for i in todo
                ]
                self.llm.generate([{"prompt_token_ids": blocks[i][k]} for i in todo], params, use_tqdm=False)
                if self._failures() != failed:  # a stale file would pass for the new memory
                    raise RuntimeError(
                        "the vLLM worker could not read or write a session while writing memory (see its log); "
                        "nothing was committed"
                    )
            return [
                MemoryCache.load(session_file(self.session_dir, name), row.layout)
                for name, row in zip(names, rows, strict=True)
            ]

    def _failures(self) -> int:
        """Session reads and writes that failed in the vLLM workers so far."""
        return sum(counts["failed"] for counts in self.llm.collective_rpc("lstmem_counts"))

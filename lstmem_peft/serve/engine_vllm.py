"""The vLLM engine of ``lstmem serve --engine vllm``: answers generated, and memory written, by vLLM.

The server keeps its API, session store and turn rules, and talks to this engine through the one
seam every engine implements (:class:`~.engine.Engine`): writing a turn's messages into memory,
answering from the session's memory and scoring log-probabilities run on vLLM, and no library model
is loaded: the vLLM engine holds the only copy of the weights, and what the server
says about the model (memory layout, block size, EOS tokens, vocabulary, the adapter's fingerprint) is
read from the backbone's and the adapter's files (:meth:`lstmem_peft.serve.LoadedModel.of_files`).

Memory is written as the default engine writes it (:func:`lstmem_peft.write_history` without a KV
cache: each block of the adapter's ``block_size`` tokens a forward of its own, block-end feedback
after each): one history request (``lstmem_history``) per block, each continuing its row's session
(:meth:`VLLMEngine.write`).

**Memory travels as the store's own files.** vLLM's session directory (``LSTMEM_SESSION_DIR`` of
this process, so of the vLLM processes it starts) is the session store's root, and a session name
may be a path of the store (:func:`~lstmem_peft.memory.sessions.session_file`). A row's memory
reaches vLLM as the file the store keeps it in (:attr:`~.engine.MemoryRow.file`,
``NAMESPACE/SESSION/memory-00000003``): nothing is copied to answer from a stored session. A write
starts from that file and saves the new memory as a pending file of the session's folder
(``NAMESPACE/SESSION/pending-...``), which the next call reads in turn and which the store renames
into the session's next version when the turn commits (:meth:`~.store.SessionStore.commit`), or
removes when it does not (:meth:`~.store.SessionStore.discard`). An empty memory (a session that
has written nothing yet, a request without a session) is named by no file: vLLM starts such a
request from zeros; a request without a session writes under :data:`~.engine.SCRATCH_FOLDER`. (A
non-empty memory in no file, which the server does not hand out, would be saved there for the call
and removed after it.) The new memory is also read into RAM (what the server reports of it and
exports).

Every answering row is a read-only request (``lstmem_memory_write`` false): its prompt and answer
read the memory as it was and write nothing, as the default engine's ``generate(memory_cache=...,
memory_write=False)``, so greedy answers are the default engine's.

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
from collections.abc import Iterator
from contextlib import contextmanager

from lstmem_peft.integrations.vllm import (
    HISTORY,
    MEMORY_WRITE,
    SESSION_DIR_ENV,
    SESSION_IN,
    SESSION_OUT,
    engine_args,
)
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.memory.sessions import session_file
from lstmem_peft.utils.extras import missing_extra

from .decoding import Decoded, Sampling, Scores
from .engine import PENDING_PREFIX, SCRATCH_FOLDER, MemoryRow


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


def answer_args(sampling: Sampling, eos_ids: frozenset[int]) -> dict:
    """The ``SamplingParams`` arguments of an answering request of ``sampling`` (all but its
    ``extra_args``), decoding as the library engine decodes:

    * the answer ends at ``eos_ids`` (``stop_token_ids``: the engine starts with no tokenizer, so
      vLLM knows no EOS of its own), at none with ``ignore_eos`` (vLLM's own ``ignore_eos``);
    * ``min_tokens`` and ``logit_bias`` are vLLM's own (its processors run before temperature and
      ``top_p``, as transformers' do); ``min_tokens`` rules out ``stop_token_ids`` and the EOS tokens
      vLLM knows, so with ``ignore_eos`` the caller adds ``eos_ids`` to those (what ``vllm serve``
      does with its tokenizer's EOS);
    * stop strings are cut afterwards (``detokenize`` off), as every engine's answers are.
    """
    top = sampling.logprobs
    return {
        "n": sampling.decoded,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "seed": sampling.seed,
        "stop_token_ids": [] if sampling.ignore_eos else sorted(eos_ids),
        "ignore_eos": sampling.ignore_eos,
        "min_tokens": sampling.min_tokens,
        "logit_bias": dict(sampling.logit_bias) or None,
        "detokenize": False,
        "logprobs": top,
        "prompt_logprobs": top if top is not None and sampling.echo else None,
    }


def claim_session_directory(root: str) -> str | None:
    """Make ``root`` this process's ``LSTMEM_SESSION_DIR`` (the vLLM processes started next inherit
    it); returns the value it had (``None``: unset).

    Raises:
        ValueError: it is set to another folder (an operator's setting, or another engine's that is
            still open): the store and vLLM's session directory must be one folder.
    """
    previous = os.environ.get(SESSION_DIR_ENV) or None
    if previous is not None and os.path.realpath(previous) != root:
        raise ValueError(
            f"{SESSION_DIR_ENV} is {previous!r}, but lstmem serve --engine vllm uses its session store ({root}) as "
            f"vLLM's session directory: unset {SESSION_DIR_ENV}, or serve that folder (--store {previous})"
        )
    os.environ[SESSION_DIR_ENV] = root
    return previous


class VLLMEngine:
    """The :class:`~.engine.Engine` of a vLLM engine over ``model`` + ``adapter``.

    Args:
        model, adapter: the backbone and the LSTMem adapter (local folders or Hub ids).
        session_root: the session store's root, which becomes vLLM's session directory
            (``LSTMEM_SESSION_DIR``, set for the engine's life; one the operator set to another
            folder is refused).
        block_size: the adapter's history block length: one history request holds a block and
            asks for one token, so the engine's ``max_model_len`` must exceed it (checked before
            the engine starts when ``options`` sets it, else once it has started).
        eos_ids: the tokens that end an answer (vLLM's ``stop_token_ids``).
        dtype: the engine's dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        top_logprobs: the most top log-probabilities per token a request may ask for.
        options: more keyword arguments of ``vllm.LLM`` (``max_model_len``, on CPU
            ``kv_cache_memory_bytes``, ...); ``logprobs_mode`` other than ``raw_logprobs`` and
            ``max_logprobs`` below ``top_logprobs`` are refused (the server's log-probabilities are
            the model's raw ones).

    Attributes:
        llm: the ``vllm.LLM``.
        session_root: the session directory, the store's root (real path).
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        adapter: str,
        session_root: str | os.PathLike,
        block_size: int,
        eos_ids: frozenset[int],
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

        self.block_size = block_size
        self.eos_ids = eos_ids
        os.makedirs(session_root, exist_ok=True)
        self.session_root = os.path.realpath(session_root)
        self._previous_root = claim_session_directory(self.session_root)  # read by the vLLM processes
        try:
            self.llm = LLM(**engine_args(model, adapter, dtype=dtype, skip_tokenizer_init=True, **options))
        except BaseException:
            self._release()
            raise
        try:
            check_block_fits(self.llm.model_config.max_model_len, block_size)
        except ValueError:
            self.close()  # the engine's processes end with the error
            raise

    @property
    def request_limit(self) -> int:
        """The most tokens a request of this engine holds: its prompt and what it generates
        (vLLM's ``max_model_len``)."""
        return int(self.llm.model_config.max_model_len)

    def close(self) -> None:
        """Shut the vLLM engine's processes down and give ``LSTMEM_SESSION_DIR`` back."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self._release()

    def _release(self) -> None:
        if self._previous_root is None:
            os.environ.pop(SESSION_DIR_ENV, None)
        else:
            os.environ[SESSION_DIR_ENV] = self._previous_root

    def generate(
        self,
        rows: list[MemoryRow],
        prompts: list[list[int]],
        sampling: Sampling,
        stops: list[tuple[str, ...]],
        on_token=None,
        cancelled=None,
    ) -> list[Decoded]:
        """Every prompt's ``sampling.decoded`` sequences, each from its row's memory read-only
        (``lstmem_memory_write`` false), with vLLM's log-probabilities when ``sampling.logprobs``
        asks for them (see :meth:`Engine.generate <.engine.Engine.generate>`).

        vLLM decodes each sequence to an EOS or ``max_tokens``: ``stops`` are cut afterwards, and a
        cancelled row is decoded to its end (nothing is committed for it either way); ``on_token``
        gets the tokens when the batch's generation ends. With ``sampling.echo`` too, each sequence
        carries the :func:`vllm_scores` of its prompt's tokens after the first.
        """
        from vllm import SamplingParams

        top = sampling.logprobs
        with self._inputs(rows) as names:
            params = []
            for name in names:
                request = SamplingParams(
                    **answer_args(sampling, self.eos_ids),
                    extra_args=_request_sessions(name, None, **{MEMORY_WRITE: False}),
                )
                if sampling.ignore_eos:  # what vLLM adds for its EOS, which it has no tokenizer to name
                    request._all_stop_token_ids.update(self.eos_ids)
                params.append(request)
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        decoded = []
        for output in outputs:
            prompt_scores = None
            if top is not None and sampling.echo:
                prompt_scores = Scores(
                    *vllm_scores(output.prompt_logprobs[1:], output.prompt_token_ids[1:], top)
                )
            for choice in output.outputs:
                scores = None if top is None else Scores(*vllm_scores(choice.logprobs, choice.token_ids, top))
                decoded.append(Decoded(list(choice.token_ids), scores, prompt_scores))
        if on_token is not None:
            for row, sequence in enumerate(decoded):
                for token in sequence.token_ids:
                    on_token(row, token)
        return decoded

    def score(
        self, rows: list[MemoryRow], sequences: list[list[int]], starts: list[int], top: int
    ) -> list[Scores]:
        """vLLM's log-probabilities of ``sequences[i][max(starts[i], 1):]`` from row ``i``'s memory
        read-only: the sequence as a prompt (``prompt_logprobs``) of a request that samples one token
        and writes nothing (see :meth:`Engine.score <.engine.Engine.score>`)."""
        from vllm import SamplingParams

        with self._inputs(rows) as names:
            params = [
                SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    detokenize=False,
                    prompt_logprobs=top,
                    extra_args=_request_sessions(name, None, **{MEMORY_WRITE: False}),
                )
                for name in names
            ]
            outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [
            Scores(*vllm_scores(o.prompt_logprobs[1:], s[1:], top))[max(start, 1) - 1 :]
            for o, s, start in zip(outputs, sequences, starts, strict=True)
        ]

    def _file(self, name: str) -> str:
        return session_file(self.session_root, name)

    @contextmanager
    def _inputs(self, rows: list[MemoryRow]) -> Iterator[list[str | None]]:
        """Each row's in-session for vLLM: its file in the store; ``None`` for an empty memory
        (nothing written: vLLM starts a request without an in-session from zeros, the same state);
        another memory in no file is saved under :data:`~.engine.SCRATCH_FOLDER` for the block and
        removed when it ends."""
        batch = secrets.token_hex(8)
        names, saved = [], []
        try:
            for i, row in enumerate(rows):
                if row.file is not None or _empty(row.memory):
                    names.append(row.file)
                    continue
                name = f"{SCRATCH_FOLDER}/input-{batch}-{i}"
                os.makedirs(os.path.dirname(self._file(name)), exist_ok=True)
                saved.append(self._file(name))
                row.memory.save(saved[-1])
                names.append(name)
            yield names
        finally:
            for path in saved:
                if os.path.exists(path):
                    os.remove(path)

    def write(
        self, rows: list[MemoryRow], tokens: list[list[int]]
    ) -> tuple[list[MemoryRow], list[dict | None]]:
        """Write ``tokens[i]`` into ``rows[i]`` as a history, as the library engine does
        (:func:`lstmem_peft.write_history` without a KV cache: block ``k`` of a row is its tokens
        ``[k * block_size, (k + 1) * block_size)``, a forward of its own, followed by block-end
        feedback; see :meth:`Engine.write <.engine.Engine.write>`).

        Block ``k`` of every row that has one is one vLLM batch of history requests (``lstmem_history``,
        ``max_tokens=1``): the first reads the row's file and saves a new pending file of the row's
        folder, each later one continues that file in place. The row's own file is only read. vLLM
        reports no gate statistics (``None`` per row).

        Raises:
            RuntimeError: the worker failed to read or write a row's session (see vLLM's log); the
                pending files are removed.
        """
        from vllm import SamplingParams

        size = self.block_size
        blocks = [[t[k : k + size] for k in range(0, len(t), size)] for t in tokens]
        batch = secrets.token_hex(8)
        outs = [f"{row.folder}/{PENDING_PREFIX}{batch}-{i}" for i, row in enumerate(rows)]
        for out in outs:
            os.makedirs(os.path.dirname(self._file(out)), exist_ok=True)
        try:
            with self._inputs(rows) as names:
                failed = self._failures()
                for k in range(max((len(b) for b in blocks), default=0)):
                    todo = [i for i, b in enumerate(blocks) if k < len(b)]
                    params = [
                        SamplingParams(
                            max_tokens=1,
                            temperature=0.0,
                            detokenize=False,
                            extra_args=_request_sessions(
                                names[i] if k == 0 else outs[i], outs[i], **{HISTORY: True}
                            ),
                        )
                        for i in todo
                    ]
                    self.llm.generate(
                        [{"prompt_token_ids": blocks[i][k]} for i in todo], params, use_tqdm=False
                    )
                    if self._failures() != failed:  # a stale file would pass for the new memory
                        raise RuntimeError(
                            "the vLLM worker could not read or write a session while writing memory (see its log); "
                            "nothing was committed"
                        )
            written = [
                MemoryRow(MemoryCache.load(self._file(out), row.memory.layout), out, row.folder)
                for out, row in zip(outs, rows, strict=True)
            ]
        except BaseException:
            for out in outs:
                if os.path.exists(self._file(out)):
                    os.remove(self._file(out))
            raise
        return written, [None] * len(rows)

    def _failures(self) -> int:
        """Session reads and writes that failed in the vLLM workers so far."""
        return sum(counts["failed"] for counts in self.llm.collective_rpc("lstmem_counts"))


def _request_sessions(session_in: str | None, session_out: str | None, **extra) -> dict:
    """A request's ``extra_args``: its in- and out-session where it has them, and ``extra``."""
    named = {SESSION_IN: session_in, SESSION_OUT: session_out}
    return {**{k: v for k, v in named.items() if v is not None}, **extra}


def _empty(memory: MemoryCache) -> bool:
    """Whether ``memory`` holds nothing: no token written and zero states (where vLLM starts a
    request that names no in-session)."""
    if not memory.is_initialized:
        return True
    written = memory.tokens_written
    if written is not None and bool(written.any()):
        return False
    return all(not bool(layer.cell.any()) and not bool(layer.hidden.any()) for layer in memory.layers)

"""``lstmem serve --engine vllm``: the server's answers generated, and its memory written, by a vLLM engine.

The server (:mod:`lstmem_peft.serve`) keeps its API, session store and turn rules; writing a turn's
messages into memory and answering from the session's memory run on vLLM. Memory is written as the
default engine writes it (:func:`lstmem_peft.write_history` without a KV cache: each block of the
adapter's ``block_size`` tokens a forward of its own, block-end feedback after each): one history
request (``lstmem_history``) per block, each continuing its row's session
(:meth:`VLLMAnswers.write_rows`). Each row's memory reaches vLLM as a session (``lstmem_session_in``):
a :class:`~lstmem_peft.MemoryCache` file with a random name in the session directory, removed after
use. The library model is still loaded beside the engine, for what vLLM does not give: log-probabilities
of the answers, the gate statistics of memory writes (``None`` with this engine) and the adapter's
fingerprint. The session directory is ``LSTMEM_SESSION_DIR`` when the
operator set it, else a temporary folder, which :class:`VLLMAnswers` sets as ``LSTMEM_SESSION_DIR``
of this process (so of the vLLM processes it starts). Every row is a read-only request
(``lstmem_memory_write`` false): its prompt and answer read the memory as it was and write nothing,
as the default engine's ``generate(memory_cache=..., memory_write=False)``, so greedy answers are the
default engine's.

Differences from the default engine: sampled answers come from vLLM's random streams (a seed
fixes them, but not to the library's tokens); streamed tokens arrive when the batch's generation
ends; a cancelled stream's rows are decoded to the end (nothing is committed for them either way).
"""

from __future__ import annotations

import os
import secrets
import tempfile

from lstmem_peft.utils.extras import missing_extra

from . import HISTORY, MEMORY_WRITE, SESSION_DIR_ENV, SESSION_IN, SESSION_OUT, engine_args, session_file


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


class VLLMAnswers:
    """A vLLM engine over ``model`` + ``adapter`` that answers batches of session rows.

    Args:
        model, adapter: the backbone and the LSTMem adapter (local folders or Hub ids), the same
            ones the server's library model was loaded from.
        dtype: the engine's dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        block_size: the adapter's history block length: one history request holds a block and
            asks for one token, so the engine's ``max_model_len`` must exceed it (checked before
            the engine starts when ``options`` sets it, else once it has started).
        options: more keyword arguments of ``vllm.LLM`` (``max_model_len``, on CPU
            ``kv_cache_memory_bytes``, ...).

    Attributes:
        session_dir: the session directory the rows' memories are written to (``LSTMEM_SESSION_DIR``;
            a temporary folder, set as that variable, when it was unset).
    """

    def __init__(self, model: str, adapter: str, block_size: int, dtype: str = "auto", **options) -> None:
        if "max_model_len" in options:
            check_block_fits(int(options["max_model_len"]), block_size)
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

    def generate(self, rows, prompts, sampling, eos_ids: set[int], on_token=None) -> list[list[int]]:
        """Generated token ids of every expanded row (``n`` choices per row, row-major), each from
        its row's memory read-only.

        Args:
            rows: one-row :class:`~lstmem_peft.MemoryCache` per prompt (not modified).
            prompts: prompt token ids per row.
            sampling: the request's :class:`~lstmem_peft.serve.generation.Sampling`.
            eos_ids: tokens that end an answer.
            on_token: ``on_token(expanded_row, token_id)`` for every generated token, in order.
        """
        from vllm import SamplingParams

        paths, names = [], []
        batch = secrets.token_hex(8)
        try:
            for i, memory in enumerate(rows):
                names.append(f"lstmem-serve-{batch}-{i}")
                paths.append(session_file(self.session_dir, names[-1]))
                memory.save(paths[-1])
            params = [
                SamplingParams(
                    n=sampling.n,
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                    top_p=1.0 if sampling.greedy else sampling.top_p,
                    seed=sampling.seed,
                    stop_token_ids=sorted(eos_ids),
                    detokenize=False,
                    extra_args={SESSION_IN: name, MEMORY_WRITE: False},
                )
                for name in names
            ]
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
        generated = [list(choice.token_ids) for output in outputs for choice in output.outputs]
        if on_token is not None:
            for row, tokens in enumerate(generated):
                for token in tokens:
                    on_token(row, token)
        return generated

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

        batch = secrets.token_hex(8)
        names = [f"lstmem-serve-{batch}-w{i}" for i in range(len(rows))]
        paths = [session_file(self.session_dir, name) for name in names]
        blocks = [[t[k : k + block_size] for k in range(0, len(t), block_size)] for t in tokens]
        try:
            for memory, path in zip(rows, paths, strict=True):
                memory.save(path)
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
            return [MemoryCache.load(path, rows[i].layout) for i, path in enumerate(paths)]
        finally:
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)

    def _failures(self) -> int:
        """Session reads and writes that failed in the vLLM workers so far."""
        return sum(counts["failed"] for counts in self.llm.collective_rpc("lstmem_counts"))

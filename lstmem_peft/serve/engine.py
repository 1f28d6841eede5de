"""The one seam between the server and what runs the model: :class:`Engine`.

The server (its scheduler, planning and serving classes) never asks which engine runs. It hands an
engine batches of session memories (:class:`MemoryRow`: a one-row :class:`~lstmem_peft.MemoryCache`,
never modified, and where the session store holds it) with token ids, and gets back token ids,
log-probabilities by token id and new memories:

* :meth:`Engine.generate`: answers decoded from each row's memory, read-only;
* :meth:`Engine.score`: log-probabilities of given sequences, read-only;
* :meth:`Engine.write`: each row's tokens written into memory as a history (blocks of the adapter's
  ``block_size``, block-end feedback after each), as :func:`~lstmem_peft.write_history` writes it.

What the server says about the model (memory layout, block size, EOS tokens, vocabulary, the
adapter's fingerprint, the position limit) is the :class:`~.loading.LoadedModel`'s, read from the
model or from its files; an engine adds one fact, :attr:`Engine.request_limit`.

Two engines implement it: :class:`~.engine_library.LibraryEngine` (the PeftModel's own ``generate``
and forwards, in this process, on the rows' caches) and :class:`~.engine_vllm.VLLMEngine` (``lstmem
serve --engine vllm``: a vLLM engine over the same backbone and adapter, whose session directory is
the store, so that it reads a row's memory from the store's own file and writes new memories as
pending files of the session's folder, which the store adopts as versions when the turn commits).
:class:`NoEngine` stands where the facts were read from files and nothing runs the model.

Every method runs on the scheduler's single worker thread: an engine is never entered by two threads
at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lstmem_peft.memory.cache import MemoryCache

from .decoding import Decoded, Sampling, Scores

#: The folder of the session root where memories of requests without a session are written.
SCRATCH_FOLDER = "lstmem-scratch"

#: The file name prefix of a memory an engine wrote under a session's folder, not yet a version.
PENDING_PREFIX = "pending-"


@dataclass(frozen=True)
class MemoryRow:
    """One session's memory as the server hands it to an engine, and an engine hands a new one back.

    Attributes:
        memory: the one-row :class:`~lstmem_peft.MemoryCache` (an engine never modifies it).
        file: where ``memory`` is on disk, byte for byte, as a session name under the store's root
            (:func:`~lstmem_peft.memory.sessions.session_file`: ``NAMESPACE/SESSION/memory-00000003``
            for a stored version, ``NAMESPACE/SESSION/pending-...`` for a memory an engine wrote),
            or ``None``: only in RAM.
        folder: the session's folder under the root (``NAMESPACE/SESSION``), where an engine that
            writes files puts the new memories of this row; :data:`SCRATCH_FOLDER` for a request
            without a session.
    """

    memory: MemoryCache
    file: str | None = None
    folder: str = SCRATCH_FOLDER


@runtime_checkable
class Engine(Protocol):
    """What answers, scores and writes memory for the server (see the module docstring).

    Attributes:
        name: ``hf`` (the library engine) or ``vllm``, as ``lstmem serve --engine`` names it.
        request_limit: the most tokens one request holds (its prompt and what it generates), or
            ``None`` when only the model's position limit bounds it.
        session_root: the folder whose files the engine reads and writes memories in by name
            (:attr:`MemoryRow.file`): the session store must be there; ``None``: the engine works on
            the caches in RAM.
    """

    name: str
    request_limit: int | None
    session_root: str | None

    def generate(
        self,
        rows: list[MemoryRow],
        prompts: list[list[int]],
        sampling: Sampling,
        stops: list[tuple[str, ...]],
        on_token: Callable[[int, int], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
    ) -> list[Decoded]:
        """Decode ``sampling.decoded`` sequences per prompt, prompt ``i`` reading memory ``rows[i]``
        read-only (every prompt and answer token reads the memory as it was).

        Args:
            rows: the memories, one per prompt (not modified).
            prompts: prompt token ids per row, each non-empty.
            sampling: the shared decoding parameters.
            stops: per decoded row (``len(prompts) * sampling.decoded``, prompt by prompt), stop
                strings after which the engine may stop decoding that row (the answer is cut at
                them afterwards either way: :func:`~.generation.cut_answer`).
            on_token: ``on_token(decoded_row, token_id)`` for every generated token, in order.
            cancelled: ``cancelled(decoded_row) -> bool``: the engine may stop decoding that row.

        Returns:
            per decoded row, the :class:`Decoded` sequence: the generated tokens, uncut (an EOS that
            ended them included), with the engine's own :class:`Scores` where it keeps them.
        """
        ...

    def score(
        self, rows: list[MemoryRow], sequences: list[list[int]], starts: list[int], top: int
    ) -> list[Scores]:
        """The model's log-probabilities of ``sequences[i][max(starts[i], 1):]``, reading memory
        ``rows[i]`` read-only (the log-softmax of the logits, before temperature or ``top_p``).

        Args:
            rows: the memories, one per sequence (not modified).
            sequences: token ids per row (the prompt in context, then the answer).
            starts: per row, the first position scored (position 0 has nothing before it), each
                below its sequence's length.
            top: how many most likely tokens to report per position (0: none).
        """
        ...

    def write(
        self, rows: list[MemoryRow], tokens: list[list[int]]
    ) -> tuple[list[MemoryRow], list[dict | None]]:
        """Write ``tokens[i]`` into ``rows[i]`` as a history, all rows in one batched call.

        Args:
            rows: the memories (not modified; nor are their files).
            tokens: token ids per row, each non-empty.

        Returns:
            the new memories, in order, each in its row's ``folder`` (with a ``file`` when the engine
            wrote one: a :data:`PENDING_PREFIX` file of that folder, which the store adopts at commit
            or discards), and per row the gate statistics of its write (``{"out_gate": [...],
            "depth_gate": [...]}``, a mean per memory layer) or ``None`` where the engine does not
            report them.
        """
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, devices); the server calls it once, at exit."""
        ...


class NoEngine:
    """The engine of a served model whose facts were read from its files with nothing to run it
    (:meth:`~.loading.LoadedModel.of_files` without an engine): every call names the fix."""

    name = "none"
    request_limit = None
    session_root = None

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(
            "this LoadedModel was read from the model's files with no engine to run it: pass an engine "
            "(LoadedModel.of_files(..., engine=VLLMEngine(...)), what lstmem serve --engine vllm builds) or "
            "load the library model (load_model(..., engine='hf'))"
        )

    generate = score = write = _refuse

    def close(self) -> None:
        pass

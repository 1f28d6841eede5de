"""The library engine: answers, scores and memory writes from the PeftModel in this process.

The default engine of ``lstmem serve``. A batch of session memories is gathered into one
:class:`~lstmem_peft.MemoryCache` with ``batch_repeat_interleave`` + ``update_rows`` (:func:`gather`),
used through the library's public API, and scattered back with ``clone`` + ``batch_select_indices``
(:func:`scatter`):

* answers: one left-padded ``model.generate(memory_cache=..., memory_write=False)``: every prompt
  and answer token reads the memory as it was; the rows passed in are never modified;
* scores: left-padded forwards with ``memory_write=False`` (the same reading of memory, so a token's
  log-probability is the one its answer was decoded from, up to floating-point order);
* writes: :func:`~lstmem_peft.write_history` on the padded batch, with the gate statistics of each
  row (:class:`GateProbe`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor
from transformers.generation.streamers import BaseStreamer

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import left_pad
from lstmem_peft.tuner.history import memory_layers, row_blocks, write_history

from .decoding import Decoded, Sampling, Scores, find_stop
from .engine import MemoryRow

#: Logits held at once while scoring (rows x positions x vocabulary): larger batches are scored in parts.
SCORE_ELEMENTS = 1 << 27


class LibraryEngine:
    """The :class:`~.engine.Engine` of a PeftModel with an active LSTMem adapter, in this process.

    Args:
        model: the PeftModel (eval mode).
        tokenizer: its tokenizer (pad token; stop strings are matched on decoded text).
        block_size: the adapter's history block length (``write_history`` writes in such blocks).
        vocab_size: the token ids the backbone embeds (bounds the logits a scoring forward holds).
        eos_ids: the tokens that end an answer (the server's ``LoadedModel.eos_ids``), which
            ``min_tokens`` rules out; default: the model's generation config's EOS, else the
            tokenizer's.

    Attributes:
        model: the PeftModel the server answers with (tests and tools may run it directly).
        device: where its memories live: the model's device.
    """

    name = "hf"
    request_limit = None  # the model's position limit is the only bound
    session_root = None  # works on the rows' caches in RAM

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        block_size: int,
        vocab_size: int,
        eos_ids: frozenset[int] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.vocab_size = vocab_size
        if eos_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = tokenizer.eos_token_id if eos is None else eos
            eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        self.eos_ids = eos_ids
        self.device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        # the pad of written histories: the tokenizer's, else 0; of prompts and scored sequences,
        # the tokenizer's pad, else its EOS, else 0 (padding is masked out either way)
        self._write_pad = 0 if pad is None else pad
        pad = pad if pad is not None else tokenizer.eos_token_id
        self._pad = 0 if pad is None else pad

    def generate(
        self,
        rows: list[MemoryRow],
        prompts: list[list[int]],
        sampling: Sampling,
        stops: list[tuple[str, ...]],
        on_token=None,
        cancelled=None,
    ) -> list[Decoded]:
        """The model's own ``generate`` over the left-padded prompts, memory read-only (see
        :meth:`Engine.generate <.engine.Engine.generate>`): decoding of a row stops at its stop
        strings and when it is cancelled; its tokens stream to ``on_token`` as they come. The
        answers' log-probabilities are not kept (``Decoded.scores`` ``None``): the server scores
        them from the same memory (:meth:`score`).

        ``logit_bias`` and ``ignore_eos`` are ``generate``'s own (:meth:`Sampling.generate_kwargs
        <.decoding.Sampling.generate_kwargs>`); ``min_tokens`` is transformers'
        ``MinNewTokensLengthLogitsProcessor`` over :attr:`eos_ids` (with ``ignore_eos`` too, as vLLM
        rules its EOS out for ``min_tokens``), and no stop string ends a row within its first
        ``min_tokens`` tokens."""
        tok, pad = self.tokenizer, self._pad
        ids, mask = left_pad(prompts, pad, self.device)
        kwargs = sampling.generate_kwargs()
        if sampling.min_tokens and self.eos_ids:
            kwargs["logits_processor"] = LogitsProcessorList(
                [
                    MinNewTokensLengthLogitsProcessor(
                        ids.shape[1], sampling.min_tokens, sorted(self.eos_ids), device=self.device
                    )
                ]
            )
        if any(stops) or cancelled is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [_StopRows(tok, ids.shape[1], stops, cancelled or (lambda row: False), sampling.min_tokens)]
            )
        if on_token is not None:
            kwargs["streamer"] = RowStreamer(on_token)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                memory_cache=gather([row.memory for row in rows]),
                memory_write=False,
                pad_token_id=pad,
                **kwargs,
            )
        return [Decoded(ids) for ids in out[:, ids.shape[1] :].tolist()]

    def score(
        self, rows: list[MemoryRow], sequences: list[list[int]], starts: list[int], top: int
    ) -> list[Scores]:
        """The model's :class:`Scores` of ``sequences[i][max(starts[i], 1):]`` (see
        :meth:`Engine.score <.engine.Engine.score>`): left-padded forwards with ``memory_write=False``
        of as many rows as :data:`SCORE_ELEMENTS` allows, the log-softmax in parts of 512 positions."""
        out: dict[int, Scores] = {}
        waiting = list(range(len(rows)))
        while waiting:
            group = [waiting.pop(0)]
            width = len(sequences[group[0]])
            while (
                waiting
                and (len(group) + 1) * max(width, len(sequences[waiting[0]])) * self.vocab_size
                <= SCORE_ELEMENTS
            ):
                group.append(waiting.pop(0))
                width = max(width, len(sequences[group[-1]]))
            ids, mask = left_pad([sequences[i] for i in group], self._pad, self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    memory_cache=gather([rows[i].memory for i in group]),
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
        return [out[i] for i in range(len(rows))]

    def write(
        self, rows: list[MemoryRow], tokens: list[list[int]]
    ) -> tuple[list[MemoryRow], list[dict | None]]:
        """:func:`~lstmem_peft.write_history` of the left-padded rows in one call (blocks of
        ``block_size``, block-end feedback after each; see :meth:`Engine.write
        <.engine.Engine.write>`), with each row's gate statistics (:class:`GateProbe`)."""
        ids, mask = left_pad(tokens, self._write_pad, self.device)
        batch = gather([row.memory for row in rows])
        lengths = [len(t) for t in tokens]
        with torch.no_grad(), GateProbe(self.model, lengths, self.block_size) as probe:
            write_history(
                self.model, ids, batch, attention_mask=mask, block_size=self.block_size, progress=False
            )
        written = [MemoryRow(scatter(batch, j), folder=row.folder) for j, row in enumerate(rows)]
        return written, [probe.row(j) for j in range(len(rows))]

    def close(self) -> None:
        """Nothing to release: the model belongs to whoever loaded it."""


# ---------------------------------------------------------------------- helpers
class _StopRows(StoppingCriteria):
    """Marks a row finished once its decoded answer contains a stop string that cuts it (one that
    ends past the text of its first ``min_tokens`` tokens: :func:`~.decoding.find_stop`, as
    :func:`~.generation.cut_answer` cuts), or when its request was cancelled (the client went away)."""

    def __init__(
        self, tokenizer, prompt_width: int, stops: list[tuple[str, ...]], cancelled, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.width = prompt_width
        self.stops = stops
        self.cancelled = cancelled
        self.min_tokens = min_tokens

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.width
        for row in range(input_ids.shape[0]):
            if self.cancelled(row):
                done[row] = True
            elif self.stops[row] and generated >= self.min_tokens:
                answer = input_ids[row, self.width :]
                text = self.tokenizer.decode(answer, skip_special_tokens=True)
                head = self.min_tokens and len(
                    self.tokenizer.decode(answer[: self.min_tokens], skip_special_tokens=True)
                )
                done[row] = find_stop(text, self.stops[row], head) >= 0
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


def gather(rows: list[MemoryCache]) -> MemoryCache:
    """One batch cache whose row ``i`` is ``rows[i]`` (each a one-row cache of the same layout)."""
    batch = rows[0].clone()
    batch.batch_repeat_interleave(len(rows))
    for i, row in enumerate(rows[1:], start=1):
        batch.update_rows(torch.tensor([i]), row)
    return batch


def scatter(batch: MemoryCache, index: int) -> MemoryCache:
    """Row ``index`` of a batch cache as an independent one-row cache."""
    row = batch.clone()
    row.batch_select_indices(torch.tensor([index]))
    return row


# ---------------------------------------------------------------------- gate statistics
class GateProbe:
    """Per-row means of the output gate ``o_t`` and depth gate ``g_t`` of every memory layer while
    :func:`~lstmem_peft.write_history` writes a batch (forward hooks on the memory layers; the
    memory math is untouched).

    ``write_history`` on a padded batch runs block ``k`` on the rows that still have tokens
    (:func:`~lstmem_peft.tuner.history.row_blocks`, the one definition of that rule); the probe reads
    the same rule to attribute each block's rows, and each forward's ``valid`` mask to leave padding
    out. Use as a context manager around one ``write_history`` call.

    Args:
        model: the served model.
        lengths: valid tokens of each batch row.
        block_size: the ``block_size`` passed to ``write_history``.
    """

    def __init__(self, model, lengths: list[int], block_size: int) -> None:
        self.layers = memory_layers(model)
        self.blocks = row_blocks(lengths, block_size)
        num = len(self.layers)
        self.sums = torch.zeros(len(lengths), num, 2, dtype=torch.float64)  # (rows, layers, [o, g])
        self.counts = torch.zeros(len(lengths), num, dtype=torch.float64)
        self._forward = [0] * num
        self._handles = []

    def __enter__(self) -> GateProbe:
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, kwargs, output) -> None:
            k = self._forward[index]
            self._forward[index] += 1
            if output.out_gate is None or output.depth_gate is None:
                return
            rows = self.blocks[k] if k < len(self.blocks) else []
            if len(rows) != output.out_gate.shape[0]:
                return  # not the scheme this probe follows: no statistics rather than wrong ones
            valid = kwargs.get("valid")
            o = output.out_gate.detach().double().mean(dim=(-1, -2))  # (B, T)
            g = output.depth_gate.detach().double().mean(dim=(-1, -2))
            w = torch.ones_like(o) if valid is None else valid.to(o.dtype)
            index_rows = torch.tensor(rows)
            self.sums[index_rows, index, 0] += (o * w).sum(dim=1).cpu()
            self.sums[index_rows, index, 1] += (g * w).sum(dim=1).cpu()
            self.counts[index_rows, index] += w.sum(dim=1).cpu()

        return hook

    def row(self, b: int) -> dict[str, list[float]] | None:
        """``{"out_gate": [...], "depth_gate": [...]}`` (one mean per layer) for row ``b``, or
        ``None`` when nothing was observed for it."""
        counts = self.counts[b]
        if not bool((counts > 0).all()):
            return None
        means = self.sums[b] / counts[:, None]
        return {"out_gate": means[:, 0].tolist(), "depth_gate": means[:, 1].tolist()}

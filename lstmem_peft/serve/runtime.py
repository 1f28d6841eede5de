"""The model side of the server: loading, the chat format, and batched memory operations.

Everything here runs on the scheduler's single worker thread (the model is never entered by two
threads at once). Memory is handled only through the library's public API: a batch of sessions is
gathered into one :class:`~lstmem_peft.MemoryCache` with ``batch_repeat_interleave`` +
``update_rows``, written with :func:`~lstmem_peft.write_history`, read (never written) by
``model.generate(memory_cache=..., memory_write=False)``, and scattered back with ``clone`` + ``batch_select_indices``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.training.data import left_pad
from lstmem_peft.tuner.history import memory_layers, memory_layout, write_history
from lstmem_peft.tuner.loading import load_model_and_adapter
from lstmem_peft.utils.offline import DEMO_ASSETS

DEMO_MODEL_NAME = "lstmem-demo"


# ---------------------------------------------------------------------- loading
@dataclass
class LoadedModel:
    """A model with an active LSTMem adapter, its tokenizer and what the server says about it.

    Attributes:
        model: a PeftModel (or anything :func:`~lstmem_peft.tuner.history.find_memory` accepts), eval mode.
        tokenizer: a transformers tokenizer of the backbone.
        name: the model id clients pass as ``model``.
        layout: the :class:`~lstmem_peft.MemoryLayout` every session's cache must have.
        max_positions: the backbone's position limit (``max_position_embeddings``), or ``None``.
        block_size: the adapter's history block length (``write_history`` writes in such blocks).
        engine: what generates the answers: ``None``, the model's own ``generate``; or a
            :class:`lstmem_peft.integrations.vllm.serve.VLLMAnswers` (``lstmem serve --engine vllm``).
            Memory is always written by ``model`` (history blocks with feedback).
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    layout: MemoryLayout = field(init=False)
    max_positions: int | None = field(init=False)
    block_size: int = field(init=False)
    engine: object | None = None

    def __post_init__(self) -> None:
        self.layout = memory_layout(self.model)
        self.max_positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        configs = getattr(self.model, "peft_config", None)
        adapter = getattr(self.model, "active_adapter", None)
        if not isinstance(configs, dict) or adapter not in configs:
            raise TypeError(
                f"{type(self.model).__name__} is not a PeftModel with an active LSTMem adapter; load one with "
                "PeftModel.from_pretrained(backbone, adapter_path)"
            )
        self.block_size = int(configs[adapter].block_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_model(
    model: str | None = None,
    adapter: str | None = None,
    name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    engine: str = "hf",
    vllm_options: dict | None = None,
) -> LoadedModel:
    """Load the embedded demo (no arguments) or a backbone + LSTMem adapter (local folders or Hub ids).

    Args:
        model: backbone, Hub id or local folder; ``None`` with ``adapter=None``: the embedded demo.
        adapter: LSTMem adapter folder or Hub id (required with ``model``).
        name: the model id served at ``/v1/models`` (default: ``lstmem-demo`` or the adapter's name).
        device: ``cpu`` or ``cuda`` (default: cuda when available).
        dtype: backbone dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        engine: ``hf`` (answers from the model's ``generate``) or ``vllm`` (answers from a vLLM
            engine over the same backbone and adapter; needs ``model`` and ``adapter``).
        vllm_options: more keyword arguments of ``vllm.LLM`` (``engine="vllm"``).
    """
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")
    if engine == "vllm":
        if model is None or adapter is None:
            raise ValueError(
                "--engine vllm needs --model and --adapter (a Qwen3 or Llama backbone and its LSTMem adapter); the "
                "embedded demo runs with the default engine"
            )
        from lstmem_peft.integrations.vllm.serve import VLLMAnswers, require_vllm

        require_vllm()  # before the library model loads
        loaded = load_model(model, adapter, name=name, device=device, dtype=dtype)
        loaded.engine = VLLMAnswers(model, adapter, dtype=dtype, **(vllm_options or {}))
        return loaded
    if (model is None) != (adapter is None):
        raise ValueError(
            "pass both --model and --adapter (a backbone and the LSTMem adapter trained on it), or neither "
            "for the embedded demo"
        )
    check_saved_memory_id(str(DEMO_ASSETS / "adapter_full") if adapter is None else adapter)
    peft_model, tokenizer = load_model_and_adapter(model, adapter, dtype=dtype, device=device)
    served = name or (DEMO_MODEL_NAME if adapter is None else os.path.basename(os.path.normpath(adapter)))
    return LoadedModel(peft_model, tokenizer, served)


def check_saved_memory_id(adapter: str) -> None:
    """Refuse an adapter whose saved ``adapter_config.json`` has no ``memory_id``.

    Such an adapter draws a new random ``memory_id`` at every load, so the memory a server stored
    would be refused (another layout) after a restart.
    """
    path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(path):
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(adapter, "adapter_config.json")
    with open(path) as fh:
        saved = json.load(fh)
    if not saved.get("memory_id"):
        raise ValueError(
            f"{path} has no memory_id, so the adapter gets a new identity at every load and stored session "
            "memory could not be reloaded after a restart; load it once and save it again "
            "(PeftModel.from_pretrained(...).save_pretrained(...)) to give it a fixed memory_id"
        )


# ---------------------------------------------------------------------- chat format
def message_hash(role: str, content: str) -> str:
    """The identity of a chat message in a session's record (role and exact content)."""
    return hashlib.sha256(json.dumps([role, content]).encode()).hexdigest()[:32]


class ChatFormat:
    """How chat messages become tokens, one message at a time.

    With a tokenizer that has a chat template, a message is the template applied to that message
    alone and the generation prompt is what ``add_generation_prompt=True`` adds. Without one (the
    embedded demo), a message is the BOS token (when the tokenizer has one) followed by the content,
    and the generation prompt is empty: the demo's own ``<s> k07 v19 ; ...`` / ``<s> ? k07`` format.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._generation_prompt: list[int] | None = None

    def encode_text(self, text: str) -> list[int]:
        """Plain text (memory writes, completions prompts): no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> list[int]:
        """Token ids of one message."""
        if self.templated:
            ids = self.tokenizer.apply_chat_template(
                [{"role": role, "content": content}], tokenize=True, add_generation_prompt=False
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + self.encode_text(content)

    def generation_prompt(self) -> list[int]:
        """The tokens that open the assistant's answer (empty without a chat template)."""
        if self._generation_prompt is None:
            if not self.templated:
                self._generation_prompt = []
            else:
                probe = [{"role": "user", "content": "x"}]
                bare = self.tokenizer.apply_chat_template(probe, tokenize=False)
                full = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
                self._generation_prompt = self.encode_text(full[len(bare) :]) if full.startswith(bare) else []
        return self._generation_prompt


# ---------------------------------------------------------------------- gathering and scattering rows
def fresh_memory(layout: MemoryLayout, device: torch.device) -> MemoryCache:
    """A one-row memory with zero states (a session that has written nothing yet)."""
    cache = MemoryCache(layout)
    cache.ensure(1, device)
    return cache


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

    ``write_history`` on a padded batch runs block ``k`` on the rows that still have tokens at
    ``k * block_size`` (its documented scheme); the probe follows the same rule to attribute each
    block's rows. Use as a context manager around one ``write_history`` call.

    Args:
        model: the served model.
        lengths: valid tokens of each batch row.
        block_size: the ``block_size`` passed to ``write_history``.
    """

    def __init__(self, model, lengths: list[int], block_size: int) -> None:
        self.layers = memory_layers(model)
        self.lengths = lengths
        self.block = block_size
        num = len(self.layers)
        self.sums = torch.zeros(len(lengths), num, 2, dtype=torch.float64)  # (rows, layers, [o, g])
        self.counts = torch.zeros(len(lengths), num, dtype=torch.float64)
        self._forward = [0] * num
        self._handles = []

    def __enter__(self) -> GateProbe:
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, output) -> None:
            k = self._forward[index]
            self._forward[index] += 1
            if output.out_gate is None or output.depth_gate is None:
                return
            rows = [b for b, n in enumerate(self.lengths) if n > k * self.block]
            if len(rows) != output.out_gate.shape[0]:
                return  # not the scheme this probe follows: no statistics rather than wrong ones
            valid = args[4] if len(args) > 4 else None
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


def state_norms(cache: MemoryCache) -> dict[str, list[float]]:
    """Frobenius norms of ``C`` and ``D`` of every memory layer (row 0), for the record and page."""
    if not cache.is_initialized:
        return {"cell": [], "hidden": []}
    return {
        "cell": [float(layer.cell[0].double().norm()) for layer in cache.layers],
        "hidden": [float(layer.hidden[0].double().norm()) for layer in cache.layers],
    }


def write_rows(
    loaded: LoadedModel, rows: list[MemoryCache], tokens: list[list[int]]
) -> tuple[list[MemoryCache], list[dict | None]]:
    """Write ``tokens[i]`` into ``rows[i]`` as history (blocks + feedback) in one batched call.

    Args:
        loaded: the served model.
        rows: one-row caches (not modified).
        tokens: token ids per row; rows with none are returned as they are.

    Returns:
        new one-row caches (same order) and the gate statistics of each row's write (or ``None``).
    """
    out = list(rows)
    gates: list[dict | None] = [None] * len(rows)
    active = [i for i, t in enumerate(tokens) if t]
    if not active:
        return out, gates
    pad = loaded.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    ids, mask = left_pad([tokens[i] for i in active], pad, loaded.device)
    batch = gather([rows[i] for i in active])
    lengths = [len(tokens[i]) for i in active]
    with torch.no_grad(), GateProbe(loaded.model, lengths, loaded.block_size) as probe:
        write_history(
            loaded.model, ids, batch, attention_mask=mask, block_size=loaded.block_size, progress=False
        )
    for j, i in enumerate(active):
        out[i] = scatter(batch, j)
        gates[i] = probe.row(j)
    return out, gates


# ---------------------------------------------------------------------- generation
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


def cut_answer(tokenizer, token_ids: list[int], eos_ids: set[int], stops: tuple[str, ...]) -> Answer:
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


def end_of_sequence_ids(loaded: LoadedModel) -> set[int]:
    """The token ids that end an answer: the generation config's EOS, else the tokenizer's."""
    config = getattr(loaded.model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))


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
    tok = loaded.tokenizer
    n, k = sampling.n, sampling.decoded  # choices per prompt, sequences decoded per prompt
    stops = stops or [sampling.stop] * len(rows)
    expanded_stops = [s for s in stops for _ in range(k)]
    eos_ids = end_of_sequence_ids(loaded)
    if k < n:  # greedy: decoded row ``r`` stands for the equal choices ``r * n .. r * n + n - 1``
        choice_token, choice_cancelled = on_token, cancelled
        if choice_token is not None:

            def on_token(row: int, token: int) -> None:
                for c in range(n):
                    choice_token(row * n + c, token)

        if choice_cancelled is not None:

            def cancelled(row: int) -> bool:
                return all(choice_cancelled(row * n + c) for c in range(n))

    def choices(answers: list[Answer]) -> list[list[Answer]]:
        per_row = [answers[i * k : (i + 1) * k] for i in range(len(rows))]
        if k == n:
            return per_row
        return [[replace(a[0], token_ids=list(a[0].token_ids)) for _ in range(n)] for a in per_row]

    if loaded.engine is not None:
        decoding = sampling if k == n else replace(sampling, n=k)
        answers = loaded.engine.generate(rows, prompts, decoding, eos_ids, on_token)
        answers = choices([cut_answer(tok, a, eos_ids, expanded_stops[r]) for r, a in enumerate(answers)])
        return attach_logprobs(loaded, rows, prompts, sampling, answers)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = 0 if pad is None else pad
    ids, mask = left_pad(prompts, pad, loaded.device)
    memory = gather(rows)
    kwargs = sampling.generate_kwargs()
    if any(expanded_stops) or cancelled is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [_StopRows(tok, ids.shape[1], expanded_stops, cancelled or (lambda row: False))]
        )
    if on_token is not None:
        kwargs["streamer"] = RowStreamer(on_token)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=mask,
            memory_cache=memory,
            memory_write=False,
            pad_token_id=pad,
            **kwargs,
        )
    generated = out[:, ids.shape[1] :].tolist()
    answers = choices(
        [cut_answer(tok, generated[r], eos_ids, expanded_stops[r]) for r in range(len(generated))]
    )
    return attach_logprobs(loaded, rows, prompts, sampling, answers)


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


def _piece(tokenizer, context: list[int], head: str, token: int) -> str:
    """The text ``token`` adds after ``context`` (whose text is ``head``)."""
    full = tokenizer.decode(context + [token], skip_special_tokens=False)
    if context and full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode([token], skip_special_tokens=False)


def score_rows(
    loaded: LoadedModel, rows: list[MemoryCache], sequences: list[list[int]], starts: list[int], top: int
) -> list[TokenLogprobs]:
    """Log-probabilities of ``sequences[i][starts[i]:]`` read from memory ``rows[i]``.

    One left-padded forward per group of rows with ``memory_write=False``: memory is read, never
    written (``rows`` are not modified), exactly as ``generate_rows`` reads it, so a token's
    log-probability here is the one its answer was decoded from (up to floating-point order). The
    values are the model's own distribution (log-softmax of the logits, before temperature or
    ``top_p``).

    Args:
        loaded: the served model.
        rows: one-row caches.
        sequences: token ids per row (the prompt in context, then the answer).
        starts: the first position reported per row (0: the whole sequence; its first token gets
            ``None``).
        top: how many most likely tokens to report per position (0: none).
    """
    tok = loaded.tokenizer
    out: list[TokenLogprobs | None] = [None] * len(rows)
    todo = [i for i in range(len(rows)) if starts[i] < len(sequences[i])]
    for i in range(len(rows)):
        if i not in todo:
            out[i] = TokenLogprobs([], [], [], [])
    vocab = int(getattr(getattr(loaded.model, "config", None), "vocab_size", None) or len(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = 0 if pad is None else pad
    while todo:
        group = [todo.pop(0)]
        width = len(sequences[group[0]])
        while todo and (len(group) + 1) * max(width, len(sequences[todo[0]])) * vocab <= SCORE_ELEMENTS:
            group.append(todo.pop(0))
            width = max(width, len(sequences[group[-1]]))
        ids, mask = left_pad([sequences[i] for i in group], pad, loaded.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = loaded.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                memory_cache=gather([rows[i] for i in group]),
                memory_write=False,
                use_cache=False,
            ).logits
        for j, i in enumerate(group):
            seq, start = sequences[i], starts[i]
            first = max(start, 1)  # position 0 has nothing before it
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
            pieces, tops = [], []
            for t in range(start, len(seq)):
                context = seq[max(0, t - 4) : t]
                head = tok.decode(context, skip_special_tokens=False) if context else ""
                pieces.append(_piece(tok, context, head, seq[t]))
                if t >= first:
                    tops.append([(_piece(tok, context, head, x), v) for x, v in best[t - first]])
            lead = [None] * (first - start)
            out[i] = TokenLogprobs(list(seq[start:]), pieces, lead + chosen, lead + tops)
    return out


def attach_logprobs(
    loaded: LoadedModel,
    rows: list[MemoryCache],
    prompts: list[list[int]],
    sampling: Sampling,
    answers: list[list[Answer]],
) -> list[list[Answer]]:
    """With ``sampling.logprobs`` set, give each answer its :class:`TokenLogprobs`: its tokens (the
    EOS token that ended it included), after the prompt's tokens with ``sampling.echo``, scored by
    :func:`score_rows` from the memory the answer was generated from. Returns ``answers``."""
    if sampling.logprobs is None:
        return answers
    owners, sequences, starts, memories = [], [], [], []
    for i, choices in enumerate(answers):
        for c, answer in enumerate(choices[: sampling.decoded]):  # greedy: the choices are one answer
            ids = answer.token_ids + ([answer.end_token] if answer.end_token is not None else [])
            owners.append((i, c))
            sequences.append(list(prompts[i]) + ids)
            starts.append(0 if sampling.echo else len(prompts[i]))
            memories.append(rows[i])
    scores = score_rows(loaded, memories, sequences, starts, sampling.logprobs)
    for (i, c), score in zip(owners, scores, strict=True):
        targets = answers[i] if sampling.decoded < sampling.n else [answers[i][c]]
        for answer in targets:
            answer.logprobs = score
    return answers


def tokens_after(tokenizer, ids: list[int], chars: int) -> list[int] | None:
    """The tokens of ``ids`` after its first ``chars`` characters of decoded text, or ``None`` when
    no token boundary falls exactly there (a token-id prompt that extends a text written before)."""
    lo, hi = 0, len(ids)
    while lo < hi:  # the fewest leading tokens whose text reaches ``chars``
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    if len(tokenizer.decode(ids[:lo], skip_special_tokens=False)) != chars:
        return None
    return ids[lo:]

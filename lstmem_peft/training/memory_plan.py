"""How much memory one training process needs for LSTMem's two stages (paper App. C.4), computed
from the backbone's config and the adapter's config: a planning table, and the choice of gradient
checkpointing for a memory budget.

Per process, for a micro-batch of ``B`` episodes (history ``H`` tokens, answer pass ``A`` tokens):

- **backbone weights**: every backbone parameter at the backbone's dtype (split over the processes
  when FSDP2 shards it, :func:`~lstmem_peft.training.distributed.shard_backbone`, stage 2 only);
- **adapter weights, gradients and optimizer state**: the LSTMem parameters in float32, their
  gradients, and AdamW's two float32 moments (16 bytes a parameter). Under DeepSpeed ZeRO-2 the
  gradients and moments are split over the processes and, in bf16, the model copy of the adapter is
  bf16 and a float32 master copy (split too) joins the optimizer state;
- **activations kept for backward**. Stage 1 writes the history with gradients, so every history
  token keeps its activations until the backward pass: in full in every decoder layer below the
  topmost memory layer, and the memory's share in that layer (nothing above it). The answer pass
  keeps them in every layer. Stage 2 writes the history without gradients (nothing kept), so only
  the answer pass counts, whatever the history length. Elements kept per token and decoder layer
  (``d`` hidden size, ``d_q``/``d_kv`` query/key-value widths, ``I`` MLP width, ``d_s = n_h r`` and
  ``S = n_h r^2`` the memory's widths), and per history block of ``T_b`` tokens::

      backbone layer, without checkpointing   2 d + 3 d_q + 3 d_kv + 3 I   (activation dtype)
      backbone layer, checkpointed            d                            (its input)
      memory layer (never checkpointed)       d + 9 S + 40 d_s             (float32)
      per history block                       T_b x T_b                    (float32, attention mask)

  The memory layer's share is its input and the recurrence's per-token tensors (a few ``S``-sized
  states and gates per token), which checkpointing does not cover (README, gradient checkpointing);
- **answer logits**: ``A x V`` logits at the activation dtype, their float32 copy and the
  cross-entropy's float32 softmax and gradient;
- **workspace**: one decoder layer's activations over one block (``block_size`` tokens: the
  forward of a block, or a checkpointed layer recomputed in backward) and the memory states.

How the coefficients were found and how close the estimate is: they are small integers read off
the live-heap growth (glibc ``mallinfo2``: bytes held, without the allocator's cache) of stage-1
history writes on CPU in float32 (2026-11-25, torch 2.13): the difference between 3- and 2-layer
Qwen3 models gives one middle layer's share, over eight shapes varying ``d``, ``d_q``, ``d_kv``,
``I``, ``r``, ``n_h`` and ``T_b``; the formula is 1-3% below each. The topmost memory layer keeps less
than a middle one (it feeds no layer above), which the formula does not model: it counts that layer's
whole memory share, an overestimate of one layer's worth that matters only for very shallow models.
For the shape of the checkpointing record (``benchmarks/checkpointing/``: hidden 1024, 8 layers, 4
query heads of 256, history 8,192 in blocks of 2,048, float32) the estimate of kept activations is
3.92 GiB without and 1.41 GiB with checkpointing, against 3.84 and 1.37 GiB of live heap measured
after writing that history (2,048 and 4,096 tokens measured, scaled to 8,192): 2% and 3% high. The
record itself reports the step's peak resident set (4,995 and 3,726 MiB above the start), which also
counts memory the allocator freed but kept, most of all during checkpointing's recomputation: the
estimate for the same step (activations, logits, workspace, gradients) is 0.84x and 0.43x of those
figures. Activation dtypes other than float32, GPUs and attention kernels other than torch's SDPA on
CPU were not measured: plan with headroom.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lstmem_peft.memory import constants as K

#: Bytes of the dtypes the plan knows.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: History lengths the stage-1 table lists (capped at the stage-1 cap).
STAGE1_HISTORIES = (1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class ModelDims:
    """The backbone's sizes that set memory. Build it with :meth:`from_config`.

    Attributes:
        hidden_size: ``d``.
        query_size: ``d_q`` = query heads x head dim.
        kv_size: ``d_kv`` = key-value heads x head dim.
        intermediate_size: ``I``, the MLP width.
        num_layers: decoder layers ``L``.
        vocab_size: ``V``.
        parameters: backbone parameters (tied weights counted once).
    """

    hidden_size: int
    query_size: int
    kv_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    parameters: int

    @classmethod
    def from_config(cls, config) -> ModelDims:
        """From a transformers ``PretrainedConfig`` of a decoder-only model (Qwen3, Llama, ...);
        the parameter count comes from the model built on the meta device (no memory, no download)."""
        import torch
        from transformers import AutoModelForCausalLM

        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls(
            hidden_size=config.hidden_size,
            query_size=heads * head_dim,
            kv_size=kv_heads * head_dim,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size,
            parameters=sum(p.numel() for p in model.parameters()),
        )


@dataclass(frozen=True)
class AdapterDims:
    """The adapter's sizes that set memory. Build it with :meth:`from_config`.

    Attributes:
        num_heads: ``n_h``.
        r: head width.
        memory_layers: decoder-layer indices that carry memory, ascending.
        depth_coupling: whether each memory layer but the first has a depth input (and ``W~_pred``).
    """

    num_heads: int
    r: int
    memory_layers: tuple[int, ...]
    depth_coupling: bool = True

    @classmethod
    def from_config(cls, config, num_layers: int) -> AdapterDims:
        """From an :class:`~lstmem_peft.LSTMemConfig` for a backbone of ``num_layers`` decoder layers."""
        chosen = config.layers_to_transform
        if chosen is None:
            layers = tuple(range(num_layers))
        else:
            layers = tuple(sorted({chosen} if isinstance(chosen, int) else set(chosen)))
        return cls(config.num_heads, config.r, layers, config.depth_coupling)

    @property
    def state_size(self) -> int:
        """``d_s = n_h r``."""
        return self.num_heads * self.r

    @property
    def state_elements(self) -> int:
        """``S = n_h r^2``: elements of one ``C`` or ``D`` state of one sequence."""
        return self.num_heads * self.r * self.r


def adapter_parameters(model: ModelDims, adapter: AdapterDims) -> int:
    """Parameters of the adapter: per memory layer ``W_in`` ``(4 d_s, d)``, ``W_read`` ``(d_s, 2 d_s)``,
    ``W~_gate`` ``(4 d_s, 3 d_s)``, ``W_dq`` ``(d_q, d_s)``, ``W_do`` ``(d, d_s)``, the biases
    ``b_x, b_read, b_pred`` ``(d_s)`` and ``b_gate`` ``(4 d_s)``, and ``W~_pred`` ``(d_s, d_s)`` where a
    depth input reaches the layer (App. C.2)."""
    ds, d = adapter.state_size, model.hidden_size
    per_layer = ds * (5 * d + model.query_size) + 14 * ds * ds + 7 * ds
    with_depth = len(adapter.memory_layers) - 1 if adapter.depth_coupling else 0
    return len(adapter.memory_layers) * per_layer + max(with_depth, 0) * ds * ds


@dataclass(frozen=True)
class Setting:
    """How one stage trains, as far as memory goes.

    Attributes:
        stage: ``"stage1"`` (history written with gradients) or ``"stage2"`` (without).
        history_tokens: history length ``H`` of the longest episode.
        micro_batch: episodes per forward ``B``.
        answer_tokens: read-sequence length ``A`` (at most 512).
        block_size: history tokens per block.
        checkpointing: gradient checkpointing of the decoder layers.
        backbone_dtype: dtype of the backbone weights.
        activation_dtype: dtype of the backbone's activations (``"bfloat16"`` under bf16 autocast).
        processes: data-parallel processes ``N``.
        zero2: DeepSpeed ZeRO-2 (gradients and optimizer state split over ``N``).
        fsdp2: backbone weights split over ``N`` (:func:`~lstmem_peft.training.distributed.shard_backbone`).
    """

    stage: str = "stage1"
    history_tokens: int = K.STAGE1_HISTORY_CAP
    micro_batch: int = 1
    answer_tokens: int = K.ANSWER_READ_LIMIT
    block_size: int = K.BLOCK_SIZE
    checkpointing: bool = False
    backbone_dtype: str = "bfloat16"
    activation_dtype: str = "bfloat16"
    processes: int = 1
    zero2: bool = False
    fsdp2: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one process needs, by part (see the module docstring). ``total`` is their sum."""

    backbone: int
    adapter: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    workspace: int

    @property
    def total(self) -> int:
        return (
            self.backbone
            + self.adapter
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.workspace
        )


def _backbone_per_token(model: ModelDims, checkpointing: bool, act: int) -> int:
    """Bytes one token keeps in one decoder layer's backbone part (coefficients: module docstring)."""
    if checkpointing:
        return model.hidden_size * act
    widths = 2 * model.hidden_size + 3 * model.query_size + 3 * model.kv_size + 3 * model.intermediate_size
    return widths * act


def _memory_per_token(model: ModelDims, adapter: AdapterDims) -> int:
    """Bytes one token keeps in one memory layer (float32)."""
    return (model.hidden_size + 9 * adapter.state_elements + 40 * adapter.state_size) * DTYPE_BYTES["float32"]


def estimate(model: ModelDims, adapter: AdapterDims, setting: Setting) -> MemoryEstimate:
    """Memory one process needs to train ``setting`` (bytes, by part)."""
    if setting.stage not in ("stage1", "stage2"):
        raise ValueError(f"stage must be 'stage1' or 'stage2', got {setting.stage!r}")
    if setting.fsdp2 and setting.stage == "stage1":
        raise ValueError("FSDP2 shards the backbone for stage 2 only (see LSTMemTrainer)")
    act = DTYPE_BYTES[setting.activation_dtype]
    n, batch = setting.processes, setting.micro_batch
    params = adapter_parameters(model, adapter)
    bf16 = act == 2
    if setting.zero2:
        weights = params * (2 if bf16 else 4)
        gradients = params * 4 // n
        optimizer = params * (12 if bf16 else 8) // n  # moments, and the fp32 master copy in bf16
    else:
        weights, gradients, optimizer = params * 4, params * 4, params * 8
    backbone = model.parameters * DTYPE_BYTES[setting.backbone_dtype] // (n if setting.fsdp2 else 1)
    layer = _backbone_per_token(model, setting.checkpointing, act)
    memory = _memory_per_token(model, adapter)
    memory_layers = len(adapter.memory_layers)
    answer = batch * setting.answer_tokens * (model.num_layers * layer + memory_layers * memory)
    history = 0
    if setting.stage == "stage1" and adapter.memory_layers:
        top = max(adapter.memory_layers)  # layers below it in full, its memory share, nothing above
        blocks = -(-setting.history_tokens // setting.block_size)
        masks = blocks * min(setting.block_size, setting.history_tokens) ** 2 * DTYPE_BYTES["float32"]
        history = batch * (setting.history_tokens * (top * layer + memory_layers * memory) + masks)
    states = batch * memory_layers * 2 * adapter.state_elements * DTYPE_BYTES["float32"]
    block = batch * min(setting.block_size, max(setting.history_tokens, setting.answer_tokens))
    widest = _backbone_per_token(model, False, act) + memory
    logits = batch * setting.answer_tokens * model.vocab_size * (act + 12)
    return MemoryEstimate(
        backbone=backbone,
        adapter=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=history + answer,
        logits=logits,
        workspace=block * widest + states,
    )


def parse_size(text: str) -> int:
    """Bytes of a size such as ``"24GB"`` (10^9), ``"24GiB"`` (2^30), ``"512MB"``, ``"1.5TB"``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 24GB, 24GiB or 512MB")
    number, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def memory_table(model: ModelDims, adapter: AdapterDims, setting: Setting) -> str:
    """A text table of the memory one process needs: the fixed parts, then stage 1 per history
    length (up to ``setting.history_tokens``) and stage 2, each without and with checkpointing."""
    fixed = estimate(model, adapter, setting)
    params = adapter_parameters(model, adapter)
    where = f"{setting.processes} process(es)" + (", ZeRO-2" if setting.zero2 else "")
    lines = [
        f"Memory per process (GiB), micro-batch {setting.micro_batch}, answer {setting.answer_tokens} tokens, "
        f"blocks of {setting.block_size}, {where}; estimate: lstmem_peft/training/memory_plan.py",
        f"  backbone weights ({model.parameters:,} parameters, {setting.backbone_dtype}): {_gib(fixed.backbone)}",
        f"  adapter weights ({params:,} parameters): {_gib(fixed.adapter)}",
        f"  adapter gradients: {_gib(fixed.gradients)}; AdamW state"
        + (" (with fp32 master weights)" if setting.zero2 and setting.activation_dtype != "float32" else "")
        + f": {_gib(fixed.optimizer)}",
        f"  answer logits ({model.vocab_size:,} classes): {_gib(fixed.logits)}",
        "",
        "  stage   history   activations         total",
        "                    plain   ckpt        plain   ckpt",
    ]
    histories = [h for h in STAGE1_HISTORIES if h < setting.history_tokens] + [setting.history_tokens]
    rows = [("stage1", h) for h in histories] + [("stage2", K.STAGE2_HISTORY_CAP)]
    for stage, history in rows:
        plain, ckpt = (
            estimate(
                model,
                adapter,
                Setting(
                    **{**setting.__dict__, "stage": stage, "history_tokens": history, "checkpointing": c}
                ),
            )
            for c in (False, True)
        )
        lines.append(
            f"  {stage}  {history:>7,}   {_gib(plain.activations + plain.workspace):>6}  "
            f"{_gib(ckpt.activations + ckpt.workspace):>6}      {_gib(plain.total):>6}  {_gib(ckpt.total):>6}"
        )
    lines.append(
        "  (stage 2 writes its history without gradients: its memory does not grow with the history)"
    )
    return "\n".join(lines)


def choose_checkpointing(model: ModelDims, adapter: AdapterDims, setting: Setting, budget: int) -> bool:
    """Whether ``setting`` needs gradient checkpointing to fit ``budget`` bytes per process.

    Returns:
        ``False`` when it fits without, ``True`` when only with checkpointing.

    Raises:
        ValueError: when it does not fit even with checkpointing, naming the longest history
            (stage 1) and the micro-batch that would fit, or what else to change.
    """
    plain = estimate(model, adapter, Setting(**{**setting.__dict__, "checkpointing": False}))
    if plain.total <= budget:
        return False
    ckpt = estimate(model, adapter, Setting(**{**setting.__dict__, "checkpointing": True}))
    if ckpt.total <= budget:
        return True
    advice = []
    if setting.stage == "stage1":
        step = 256
        for history in range(setting.history_tokens - step, 0, -step):
            shorter = Setting(**{**setting.__dict__, "history_tokens": history, "checkpointing": True})
            if estimate(model, adapter, shorter).total <= budget:
                advice.append(f"cap stage-1 histories at {history:,} tokens")
                break
    if setting.micro_batch > 1:
        advice.append("lower the micro-batch (and raise gradient accumulation)")
    if setting.stage == "stage2" and not setting.fsdp2 and setting.processes > 1:
        advice.append("shard the backbone with FSDP2 (shard_backbone)")
    advice.append("use a device with more memory")
    raise ValueError(
        f"{setting.stage} needs about {_gib(ckpt.total)} GiB per process even with gradient checkpointing "
        f"(budget {_gib(budget)} GiB; micro-batch {setting.micro_batch}, history {setting.history_tokens:,} "
        f"tokens): " + "; or ".join(advice)
    )

"""The GPU acceptance run's model steps (:mod:`.acceptance`): ``build-model`` (Qwen3-4B's
dimensions, random weights, the adapter moved off its initialisation), then the checks on that model:
``model-train-grads`` (a training step's adapter gradients with the Triton kernels and with the PyTorch
members, against a wider reference) and ``model-generate-exact`` (``generate`` with memory against
recomputation without a KV cache). :class:`ModelContext` carries the model from step to step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from lstmem_peft.tuner.kv_argument import kv_kwargs

from .cases import TOLERANCES, bound_case, close_case, max_error
from .step_limits import release


@dataclass
class ModelContext:
    """What the model steps share: the random model with the preset's dimensions, and its dtype."""

    model: object = None
    dtype: torch.dtype = torch.bfloat16


def build_model(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """``bench.build_model`` (random weights from the shipped config, nothing downloaded) with the adapter
    moved off its initialisation, which zeroes the gate maps, the depth predictor and the biases
    (App. C.4): until then several paths carry no signal, and a comparison of them would pass on zeros."""
    from lstmem_peft import memory_layers

    from ..bench import command as bench

    ctx.dtype = getattr(torch, s["dtype"])
    model = bench.build_model(s["preset"], device, ctx.dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in memory_layers(model):
            for p in layer.parameters():
                p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype).to(p.device))
    ctx.model = model
    config = model.get_base_model().config
    n_memory = len(memory_layers(model))
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"build-model: {s['preset']} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
        f"{n_memory} memory layers"
    )
    return dict(
        preset=s["preset"],
        dtype=s["dtype"],
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        memory_layers=n_memory,
        adapter_parameters=adapter,
        attention=config._attn_implementation,
    )


def set_backend(model, backend: str) -> None:
    """Every memory layer's kernel member (``LSTMemConfig.scan_backend`` sets it at injection)."""
    from lstmem_peft import memory_layers

    for layer in memory_layers(model):
        layer.backend = backend


@contextlib.contextmanager
def backbone_dtype(model, dtype: torch.dtype):
    """The frozen backbone's float weights in ``dtype`` for the block (the adapter's own parameters, float32
    whatever the backbone, are left alone), then back: a bfloat16 weight survives the round trip exactly."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    before = [p.dtype for p in frozen]
    for p in frozen:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, old in zip(frozen, before, strict=True):
            p.data = p.data.to(old)


def _episode(model, s: dict, device: torch.device, seed: int):
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(3, vocab, (1, s["history_tokens"]), generator=g).to(device)
    question = torch.randint(3, vocab, (1, s["question_tokens"]), generator=g).to(device)
    return history, question


def train_step_grads(model, history, question, block_size: int) -> tuple[float, dict]:
    """One training step's loss and adapter gradients: the history written into a fresh memory with
    gradients (the paper's stage 1), then the question read against it (``memory_write=False``), next-
    token cross-entropy over the question: what ``LSTMemTrainer.compute_loss`` does in stage 1."""
    from lstmem_peft import MemoryCache, write_history

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        cache = MemoryCache()
        write_history(model, history, cache, block_size=block_size, progress=False)
        logits = model(input_ids=question, memory_cache=cache, memory_write=False, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), question[:, 1:].flatten()
        )
        loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _relative(grads: dict, reference: dict) -> float:
    """``||g - g_ref|| / ||g_ref||`` over every adapter gradient together."""
    diff = sum(float((grads[n] - reference[n]).pow(2).sum()) for n in reference)
    norm = sum(float(reference[n].pow(2).sum()) for n in reference)
    return math.sqrt(diff / norm) if norm > 0 else math.inf


def check_train_grads(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """A training step's adapter gradients with the Triton kernels and with the PyTorch members.

    Derived tolerance: both run in the model's dtype and are measured against the same step with the
    backbone in float32 (float64 for a float32 model; the PyTorch members), ``rel = ||g - g_ref|| /
    ||g_ref||`` over all adapter gradients. The Triton run passes when ``rel_triton <= 2 rel_torch +
    eps`` (``eps`` = the dtype's machine epsilon, 2^-7 for bfloat16): the kernels lose no more to the
    low precision than the PyTorch members do, up to a factor of two. The gradients must not vanish
    (the check would pass on zeros)."""
    model, dtype = ctx.model, ctx.dtype
    history, question = _episode(model, s, device, seed=5)
    results = {}
    for backend in ("torch", "triton"):
        set_backend(model, backend)
        results[backend] = train_step_grads(model, history, question, s["block_size"])
        log(f"model-train-grads: {backend} members, loss {results[backend][0]:.4f}")
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    set_backend(model, "torch")
    with backbone_dtype(model, wide):
        reference_loss, reference = train_step_grads(model, history, question, s["block_size"])
    set_backend(model, "auto")
    release(device)
    rel = {b: _relative(results[b][1], reference) for b in results}
    eps = torch.finfo(dtype).eps
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in reference.values()))
    per_parameter = {
        n: _relative({n: results["triton"][1][n]}, {n: reference[n]}) for n in reference if reference[n].any()
    }
    worst = max(per_parameter, key=per_parameter.get) if per_parameter else None
    cases = [
        bound_case(
            "triton gradients vs the wide reference",
            rel["triton"],
            2 * rel["torch"] + eps,
            pytorch_member_error=rel["torch"],
        ),
        bound_case("the PyTorch members' gradients vs the wide reference (the yardstick)", rel["torch"], 1.0),
        dict(name="the gradients do not vanish", passed=norm > 0 and math.isfinite(norm), gradient_norm=norm),
    ]
    log(f"model-train-grads: relative error triton {rel['triton']:.3g}, torch {rel['torch']:.3g} (vs {wide})")
    return dict(
        cases=cases,
        metric="relative L2 error over all adapter gradients",
        reference_dtype=str(wide),
        losses={b: results[b][0] for b in results} | {"reference": reference_loss},
        worst_parameter=None if worst is None else dict(name=worst, relative_error=per_parameter[worst]),
        history_tokens=s["history_tokens"],
        question_tokens=s["question_tokens"],
    )


def _no_cache_logits(model, start, ids, memory: bool) -> torch.Tensor:
    """Last-position logits of one forward over ``ids`` without a KV cache, from a copy of the memory
    ``start`` (the oracle of tests/test_generation.py); ``memory=False``: the adapter disabled."""
    with torch.no_grad():
        if not memory:
            with model.disable_adapter():
                return model(input_ids=ids, use_cache=False).logits[:, -1].float()
        return model(input_ids=ids, memory_cache=start.clone(), use_cache=False).logits[:, -1].float()


def _logit_errors(model, start, prompt, generated, logits_per_step) -> tuple[float, float, float, float]:
    """For :func:`check_generate_exact`: the largest error of ``generate``'s logits against no-cache
    forwards from the memory ``start``, the plain backbone's own error (KV-cached steps against
    no-cache forwards on the same tokens), how far memory moves the logits, and the largest logit."""
    from transformers import DynamicCache

    memory_err, plain_err, effect, scale = 0.0, 0.0, 0.0, 0.0
    kv = DynamicCache()
    with torch.no_grad(), model.disable_adapter():
        plain_step = model(input_ids=prompt, **kv_kwargs(model, kv), use_cache=True).logits[:, -1].float()
    for j, logits in enumerate(logits_per_step):
        ids = torch.cat([prompt, generated[:, :j]], 1)
        ref = _no_cache_logits(model, start, ids, memory=True)
        plain_ref = _no_cache_logits(model, start, ids, memory=False)
        if j:  # the plain backbone's KV-cached step on the same token
            with torch.no_grad(), model.disable_adapter():
                token = generated[:, j - 1 : j]
                plain_step = (
                    model(input_ids=token, **kv_kwargs(model, kv), use_cache=True).logits[:, -1].float()
                )
        memory_err = max(memory_err, max_error(logits.float(), ref))
        plain_err = max(plain_err, max_error(plain_step, plain_ref))
        effect = max(effect, max_error(ref, plain_ref))
        scale = max(scale, float(ref.abs().max()))
    return memory_err, plain_err, effect, scale


def check_generate_exact(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """``generate`` with memory against recomputation (tests/test_generation.py's contract), greedy.

    Derived tolerance for the logits: in bfloat16 a KV-cached decode step and a full forward do not
    round alike even without memory. The plain backbone (adapter disabled) is measured on the same
    tokens, step by step with a KV cache against the same no-cache forwards; LSTMem passes when its
    largest logit error is at most twice the plain one plus two units in the last place of the largest
    logit (``2 eps max|logit|``): memory adds no more than the backbone's own path difference. The
    memory must move the logits by more than that tolerance (else the check says nothing). The final
    memory (float32 states fed bfloat16 activations) uses the kernel tests' tolerance of the model's
    dtype (:data:`TOLERANCES`)."""
    from lstmem_peft import MemoryCache, write_history

    model, dtype = ctx.model, ctx.dtype
    set_backend(model, "auto")
    history, _ = _episode(model, s, device, seed=9)
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(10)
    prompt = torch.randint(3, vocab, (1, s["prompt_tokens"]), generator=g).to(device)
    start = MemoryCache()
    with torch.no_grad():
        write_history(model, history, start, block_size=s["block_size"], progress=False)
        cache = start.clone()
        n = s["generate_tokens"]
        out = model.generate(
            input_ids=prompt, memory_cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )  # fmt: skip
    generated = out.sequences[:, prompt.shape[1] :]
    memory_err, plain_err, effect, scale = _logit_errors(model, start, prompt, generated, out.logits)
    eps = torch.finfo(dtype).eps
    tolerance = 2 * plain_err + 2 * eps * scale
    # the memory after generate: the start fed the prompt and every generated token but the last
    expected = start.clone()
    with torch.no_grad():
        model(input_ids=torch.cat([prompt, generated[:, :-1]], 1), memory_cache=expected, use_cache=False)
    cases = [
        bound_case("logits vs no-cache recomputation", memory_err, tolerance, plain_backbone_error=plain_err),
        dict(
            name="memory moves the logits past that tolerance",
            passed=effect > tolerance,
            memory_effect=effect,
            tolerance=tolerance,
        ),
        dict(
            name="tokens written",
            passed=bool(torch.equal(cache.tokens_written, expected.tokens_written)),
            got=cache.tokens_written.tolist(),
            expected=expected.tokens_written.tolist(),
        ),  # fmt: skip
    ]
    state_dtype = dtype if dtype in TOLERANCES else torch.float32
    for i, (got, want) in enumerate(zip(cache.layers, expected.layers, strict=True)):
        cases.append(close_case(f"memory layer {i}: cell", got.cell, want.cell, state_dtype))
        cases.append(close_case(f"memory layer {i}: hidden", got.hidden, want.hidden, state_dtype))
    log(
        f"model-generate-exact: logit error {memory_err:.3g} (plain backbone {plain_err:.3g}, "
        f"tolerance {tolerance:.3g})"
    )
    return dict(
        cases=cases,
        generated_tokens=n,
        history_tokens=s["history_tokens"],
        prompt_tokens=s["prompt_tokens"],
        largest_logit=scale,
    )

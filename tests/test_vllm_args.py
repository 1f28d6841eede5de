"""The vLLM plugin's engine arguments, which need no vLLM (the plugin itself: tests/test_vllm.py)."""

import importlib.util
import os
import re

import pytest
from tiny_models import tiny_model

from lstmem_peft.integrations.vllm import (
    MEMORY_LAYER_TYPE,
    SCHEDULER,
    SESSION_FILE_CHECK,
    WORKER,
    engine_args,
)
from lstmem_peft.memory.sessions import SessionIdError, check_session_id, session_file


def test_engine_args_select_the_lstmem_architecture_as_a_hybrid_model(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path)
    args = engine_args(str(tmp_path), "user/adapter", dtype="float32", hf_overrides={"max_window_layers": 3})
    overrides = args.pop("hf_overrides")
    assert args == {
        "model": str(tmp_path),
        "worker_cls": WORKER,
        "scheduler_cls": SCHEDULER,
        "logits_processors": [SESSION_FILE_CHECK],
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "dtype": "float32",
    }
    assert overrides == {
        "architectures": ["LSTMemQwen3ForCausalLM"],
        "lstmem_adapter": "user/adapter",
        "layer_types": [MEMORY_LAYER_TYPE] * 3,
        "layers_block_type": ["attention"] * 3,
        "max_window_layers": 3,  # the caller's overrides are merged in
    }


def test_prefix_caching_async_scheduling_speculative_decoding_and_other_architectures_are_refused(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="speculative decoding would write every draft token.*rejected"):
        engine_args(
            str(tmp_path / "qwen3"), "a", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="enable_prefix_caching=True would let a request skip"):
        engine_args(str(tmp_path / "qwen3"), "a", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="async_scheduling=True would run a finished request one more step"):
        engine_args(str(tmp_path / "qwen3"), "a", async_scheduling=True)
    tiny_model("mistral").save_pretrained(tmp_path / "mistral")
    with pytest.raises(ValueError, match=r"not of 'MistralForCausalLM'.*lstmem serve"):
        engine_args(str(tmp_path / "mistral"), "a")


def test_a_compilation_config_of_the_caller_is_passed_on_as_it_is(tmp_path):
    """CUDA graphs are vLLM's choice (full graphs of decode steps, piecewise graphs around the memory
    ops for the others: tests/test_vllm.py), so
    ``engine_args`` sets no compilation setting of its own."""
    tiny_model("qwen3").save_pretrained(tmp_path)
    assert "compilation_config" not in engine_args(str(tmp_path), "a")
    args = engine_args(str(tmp_path), "a", compilation_config={"mode": 3, "cudagraph_mode": "PIECEWISE"})
    assert args["compilation_config"] == {"mode": 3, "cudagraph_mode": "PIECEWISE"}


def test_pipeline_parallelism_is_refused_naming_tensor_parallelism(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not run with pipeline parallelism.*use tensor_parallel_size"):
        engine_args(str(tmp_path), "a", pipeline_parallel_size=2)
    assert (
        engine_args(str(tmp_path), "a", pipeline_parallel_size=1, tensor_parallel_size=2)[
            "tensor_parallel_size"
        ]
        == 2
    )


def test_serve_with_the_vllm_engine_needs_a_backbone_and_an_adapter():
    from lstmem_peft.serve.loading import load_model

    with pytest.raises(ValueError, match="--engine vllm needs --model and --adapter"):
        load_model(engine="vllm")
    with pytest.raises(ValueError, match="engine must be 'hf' or 'vllm'"):
        load_model(engine="tgi")


def test_serve_with_the_vllm_engine_names_the_extra_when_vllm_is_missing(tmp_path):
    pytest.importorskip("fastapi")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from lstmem_peft.serve.loading import load_model

    tiny_model("qwen3").save_pretrained(tmp_path / "base")
    from lstmem_peft.utils.extras import install_command

    # the install hint fits how the package was installed (a clone here: pip install -e from its root)
    with pytest.raises(ImportError, match=re.escape(install_command("vllm"))):
        load_model(str(tmp_path / "base"), "user/adapter", engine="vllm")


def test_a_vllm_engine_too_short_for_one_history_block_is_refused_before_it_starts():
    """One history request holds a block and samples one token: ``max_model_len`` must exceed
    ``block_size``, checked before vLLM is imported or an engine starts."""
    pytest.importorskip("fastapi")
    from lstmem_peft.serve.engine_vllm import VLLMEngine, check_block_fits

    with pytest.raises(
        ValueError,
        match=r"max_model_len \(64\) must exceed the adapter's block_size \(64\).*max_model_len=65",
    ):
        VLLMEngine("base", "adapter", "unused-store", 64, frozenset(), max_model_len=64)
    check_block_fits(65, 64)


def test_an_answers_sampling_fields_become_vllms_own():
    """``logit_bias``, ``min_tokens`` and ``ignore_eos`` reach vLLM as its ``SamplingParams`` fields
    (issue 48 item 7): the answer ends at the model's EOS (``stop_token_ids``, vLLM starting with no
    tokenizer) unless ``ignore_eos``; the bias is a dict by token id; greedy decoding's ``top_p`` is 1.
    (The engine's answers against the library engine's: tests/test_vllm.py.)"""
    pytest.importorskip("fastapi")
    from lstmem_peft.serve.decoding import Sampling
    from lstmem_peft.serve.engine_vllm import answer_args

    eos = frozenset({2, 7})
    plain = answer_args(Sampling(6, 0.0, 1.0, 3, ("x",), None), eos)
    assert plain == {
        "n": 1,  # greedy: one sequence, repeated n times by the server
        "max_tokens": 6,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop_token_ids": [2, 7],
        "ignore_eos": False,
        "min_tokens": 0,
        "logit_bias": None,
        "detokenize": False,
        "logprobs": None,
        "prompt_logprobs": None,
    }
    fields = Sampling(
        6, 0.7, 0.9, 2, (), 5, 3, True, logit_bias=((4, -100.0), (9, 2.5)), min_tokens=3, ignore_eos=True
    )
    args = answer_args(fields, eos)
    assert args["stop_token_ids"] == [] and args["ignore_eos"] is True and args["min_tokens"] == 3
    assert args["logit_bias"] == {4: -100.0, 9: 2.5}
    assert (args["n"], args["temperature"], args["top_p"], args["seed"]) == (2, 0.7, 0.9, 5)
    assert (args["logprobs"], args["prompt_logprobs"]) == (3, 3)


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "../alice",
        "/etc/passwd",
        "a/../b",
        "a/b/c/d",
        "a\\b",
        ".hidden",
        "",
        "alice\n",
        "x" * 129,
        None,
        5,
        ["a"],
    ],
)
def test_a_session_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    with pytest.raises(SessionIdError, match="invalid session id"):
        session_file(str(tmp_path), name)


def test_a_session_is_a_file_of_the_session_directory(tmp_path):
    assert check_session_id("alice-2.turn_1") == "alice-2.turn_1"
    assert session_file(str(tmp_path), "alice") == os.path.join(
        os.path.realpath(tmp_path), "alice.safetensors"
    )
    (tmp_path / "outside").mkdir()
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "link.safetensors").symlink_to(tmp_path / "outside" / "x.safetensors")
    with pytest.raises(ValueError, match="resolves outside the session directory"):
        session_file(str(tmp_path / "sessions"), "link")


def test_engine_args_refuse_another_scheduler(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="runs with its own scheduler.*leave scheduler_cls out"):
        engine_args(str(tmp_path), "a", scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")
    assert engine_args(str(tmp_path), "a", scheduler_cls=SCHEDULER)["scheduler_cls"] == SCHEDULER


def test_history_chunks_end_at_block_ends_and_find_their_feedback_samples():
    """A history request's chunks (``lstmem_history``): cut at block ends and nowhere else; over a
    block's chunks, each of the block's feedback positions is found exactly once, in the chunk and at
    the offset where it lies; the chunk that ends a block says so; a chunk across a block end is
    refused."""
    from lstmem_peft.integrations.vllm.history import cap_history_chunk
    from lstmem_peft.memory.chunks import block_samples, plan_chunk

    assert cap_history_chunk(0, 16, 100, 40) == 16
    assert cap_history_chunk(32, 16, 100, 40) == 8  # the block ends at 40
    assert cap_history_chunk(80, 64, 100, 40) == 20  # the prompt ends at 100
    assert cap_history_chunk(100, 1, 100, 40) == 1  # generated tokens are not cut
    assert block_samples(7, 32) == tuple(range(7))
    spread = block_samples(100, 32)
    assert len(set(spread)) == 32 and spread[0] == 0 and spread[-1] == 99 and list(spread) == sorted(spread)

    for length, block, step in ((100, 40, 16), (81, 40, 16), (130, 100, 7)):
        start, found = 0, {}
        while start < length:
            count = cap_history_chunk(start, step, length, block)
            plan = plan_chunk(start, count, length, block, 32)
            first = start // block * block
            assert plan.first == (start == first)
            assert plan.ends_block == (start + count == min(first + block, length))
            for slot, row in zip(plan.slots, plan.rows, strict=True):
                assert slot not in found.setdefault(first, {})
                found[first][slot] = start + row - first
            start += count
        for first, samples in found.items():
            expected = block_samples(min(block, length - first), 32)
            assert [samples[j] for j in range(len(expected))] == list(expected)
    with pytest.raises(ValueError, match=r"crosses the history block end 40 \(block_size 40\)"):
        plan_chunk(32, 16, 100, 40, 32)


#: A child process's first lines: the package's submodules without its ``__init__.py`` (the public
#: API, which imports PEFT to register LSTMem with it), so what the rest imports shows.
WITHOUT_PACKAGE_INIT = """
import importlib.util, json, sys, types
found = importlib.util.find_spec("lstmem_peft")
package = types.ModuleType("lstmem_peft")
package.__path__ = list(found.submodule_search_locations)
sys.modules["lstmem_peft"] = package
"""

#: The shipped adapter's memory layers, built as the vLLM plugin builds them (SmolLM2-135M: 30 decoder
#: layers, hidden and query width 576), then the model libraries and tuner modules loaded.
BUILD_SHIPPED_MEMORY = """
import torch
from safetensors.torch import load_file
from lstmem_peft.memory.adapter_files import adapter_weights_file, memory_weights_by_layer
from lstmem_peft.memory.spec import memory_layer, read_memory_spec
from lstmem_peft.utils.shipped_adapters import resolve_adapter
folder = resolve_adapter("smollm2-135m-english-numbers")
spec, weights_file = read_memory_spec(folder), adapter_weights_file(folder)
chosen = spec.memory_layer_indices(30)
by_layer = memory_weights_by_layer(load_file(weights_file), spec.query_module, chosen, weights_file)
for depth, layer_idx in enumerate(chosen):
    layer = memory_layer(spec, 576, 576, layer_idx, dtype=torch.float32)
    layer.set_depth_input(spec.receives_depth(depth))
    layer.load_state_dict(by_layer[layer_idx], strict=True)
print(json.dumps([len(chosen), sorted(
    m for m in sys.modules if m.partition(".")[0] in ("peft", "transformers") or m.startswith("lstmem_peft.tuner")
)]))
"""


def test_the_plugins_memory_layers_are_built_without_peft_transformers_or_the_tuner():
    """Issue 46 item 5: what the vLLM plugin builds its memory layers with (the adapter's
    :class:`~lstmem_peft.memory.spec.MemorySpec` read from its ``adapter_config.json``, its weights file,
    :func:`~lstmem_peft.memory.spec.memory_layer`) loads neither PEFT nor transformers nor the tuner.
    Only the package's ``__init__.py`` imports PEFT, which a child process skips here; the plugin's
    own modules, which need vLLM, are checked the same way in tests/test_vllm.py."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_PACKAGE_INIT + BUILD_SHIPPED_MEMORY],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [18, []]

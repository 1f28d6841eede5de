"""`lstmem serve --engine vllm` loads no library model: what the server says about the model comes
from the files, and its log-probabilities from the engine.

* :meth:`LoadedModel.of_files` (backbone config, generation config, adapter config, adapter
  safetensors) equals :meth:`LoadedModel.of_model` of the PeftModel loaded from the same folders
  (memory layout, block size, position limit, vocabulary, EOS ids, adapter fingerprint), for local
  folders and Hub ids, with a float32 or a bfloat16 adapter file;
* an adapter file whose memory weights do not match its config is refused, naming what is wrong, and
  so are vLLM options that would change the log-probabilities;
* an engine that keeps the scores it decodes with (as vLLM does) gives, through :func:`generate_rows`
  / :func:`score_rows`, the same :class:`TokenLogprobs` as the library engine, which scores its
  answers afterwards (the engine here: the library engine keeping its scores; vLLM's own are compared
  in tests/test_vllm.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")

import torch  # noqa: E402
from peft import get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import randomize_memory, tiny_model  # noqa: E402

from lstmem_peft import LSTMemConfig, memory_layers  # noqa: E402
from lstmem_peft.serve.decoding import Decoded, Sampling  # noqa: E402
from lstmem_peft.serve.engine import Engine, MemoryRow  # noqa: E402
from lstmem_peft.serve.generation import generate_rows, score_rows  # noqa: E402
from lstmem_peft.serve.loading import LoadedModel, load_model  # noqa: E402
from lstmem_peft.serve.memories import fresh_memory, write_rows  # noqa: E402
from lstmem_peft.tuner.loading import load_tokenizer  # noqa: E402
from lstmem_peft.utils.chat import ChatFormat  # noqa: E402
from lstmem_peft.utils.offline import DEMO_ASSETS, char_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

FACTS = ("layout", "block_size", "max_positions", "vocab_size", "eos_ids", "adapter_fingerprint")


def save_backbone_and_adapter(root, arch: str, adapter_dtype: torch.dtype, generation_eos) -> tuple[str, str]:
    """A tiny random backbone (with a char tokenizer) and an LSTMem adapter moved off its
    initialisation (memory on layers 0 and 2, so the second has a depth input), saved to ``root``.
    ``generation_eos``: the EOS ids of a saved ``generation_config.json``, or ``None``: no such file.
    ``adapter_dtype``: the dtype of the memory weights in the adapter file."""
    backbone = tiny_model(arch, seed=3)
    if generation_eos is not None:
        backbone.generation_config.eos_token_id = generation_eos
    backbone.save_pretrained(root / "backbone")
    if generation_eos is None:
        (root / "backbone" / "generation_config.json").unlink(missing_ok=True)
    char_tokenizer().save_pretrained(root / "backbone")
    config = LSTMemConfig(
        r=8, num_heads=4, layers_to_transform=[0, 2], block_size=24, memory_id=f"facts-{arch}"
    )
    model = get_peft_model(backbone, config)
    randomize_memory(model)
    for layer in memory_layers(model):
        layer.to(adapter_dtype)
    model.save_pretrained(root / "adapter")
    return str(root / "backbone"), str(root / "adapter")


@pytest.mark.parametrize(
    "arch, adapter_dtype, generation_eos",
    [("qwen3", torch.float32, [2, 5]), ("llama", torch.bfloat16, None)],
)
def test_the_facts_read_from_the_files_equal_those_of_the_library_model(
    tmp_path, arch, adapter_dtype, generation_eos
):
    """No model is built from the files (``model`` is ``None``, memory on the CPU), yet every fact
    equals the PeftModel's: the layout, the generation config's EOS ids (or the config's, without a
    generation_config.json), and the adapter fingerprint over float32 weights also when the file
    holds bfloat16 (PEFT loads it into float32 layers)."""
    model, adapter = save_backbone_and_adapter(tmp_path, arch, adapter_dtype, generation_eos)
    assert {t.dtype for t in load_file(os.path.join(adapter, "adapter_model.safetensors")).values()} == {
        adapter_dtype
    }
    library = load_model(model, adapter, device="cpu", dtype="float32")
    files = LoadedModel.of_files(model, adapter, load_tokenizer(model, adapter), "adapter")
    assert files.model is None and files.engine.name == "none" and files.device == torch.device("cpu")
    for fact in FACTS:
        assert getattr(files, fact) == getattr(library, fact), fact
    assert files.layout.layer_indices == (0, 2)
    assert files.eos_ids == frozenset(generation_eos or [2])
    assert files.tokenizer.encode("hello") == library.tokenizer.encode("hello")
    with pytest.raises(RuntimeError, match="no engine to run it.*engine=VLLMEngine.*engine='hf'"):
        write_rows(
            files.engine, [MemoryRow(fresh_memory(files.layout, files.device))], [[3, 4, 5]], files.device
        )
    # the fingerprint follows the weights: one changed weight changes it
    weights = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("lstmem_memory.b_x"))
    weights[key] = weights[key] + 1
    save_file(weights, os.path.join(adapter, "adapter_model.safetensors"))
    changed = LoadedModel.of_files(model, adapter, files.tokenizer, "adapter")
    assert changed.adapter_fingerprint != files.adapter_fingerprint and changed.layout == files.layout


def test_the_facts_read_by_hub_id_from_the_offline_hub_cache_equal_those_of_the_library_model(tmp_path):
    """``--model user/backbone --adapter user/adapter``: the config files and the adapter's weights
    resolve through the Hub cache, offline; a backbone without generation_config.json there too."""
    model, adapter = save_backbone_and_adapter(tmp_path / "saved", "qwen3", torch.float32, None)
    hub = tmp_path / "hub"
    for repo, folder in (("user/backbone", model), ("user/adapter", adapter)):
        root = hub / ("models--" + repo.replace("/", "--"))
        snapshot = root / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        for name in os.listdir(folder):
            (snapshot / name).write_bytes((tmp_path / "saved" / os.path.basename(folder) / name).read_bytes())
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0" * 40)
    code = (
        "import json\n"
        "from lstmem_peft.serve.loading import LoadedModel, load_model\n"
        "from lstmem_peft.tuner.loading import load_tokenizer\n"
        "library = load_model('user/backbone', 'user/adapter', device='cpu')\n"
        "tokenizer = load_tokenizer('user/backbone', 'user/adapter')\n"
        "files = LoadedModel.of_files('user/backbone', 'user/adapter', tokenizer, 'a')\n"
        f"facts = {FACTS!r}\n"
        "print(json.dumps([files.model is None] + [getattr(files, f) == getattr(library, f) for f in facts]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [True] * (1 + len(FACTS))


def test_an_adapter_file_that_does_not_match_its_config_is_refused_naming_what_is_wrong(tmp_path):
    model, adapter = save_backbone_and_adapter(tmp_path, "qwen3", torch.float32, None)
    path = os.path.join(adapter, "adapter_model.safetensors")
    tokenizer = load_tokenizer(model, adapter)
    weights = load_file(path)

    def refused(changed: dict, match: str) -> None:
        save_file(changed, path)
        with pytest.raises(ValueError, match=match):
            LoadedModel.of_files(model, adapter, tokenizer, "adapter")

    layer_two = {k: v for k, v in weights.items() if ".layers.2." not in k}
    refused(layer_two, "holds no memory weights for decoder layer 2")
    extra = {
        **weights,
        **{k.replace(".layers.2.", ".layers.1."): v.clone() for k, v in weights.items() if ".layers.2." in k},
    }
    refused(extra, r"holds memory weights for decoder layers \[1\].*layers_to_transform")
    refused(
        {**weights, "base_model.model.lm_head.weight": torch.zeros(2, 2)}, "is not an LSTMem memory weight"
    )
    narrow = {k: (v[:, :-1].contiguous() if k.endswith("w_in") else v) for k, v in weights.items()}
    refused(narrow, "do not fit this backbone.*was the adapter trained on it")
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors.*save_pretrained"):
        LoadedModel.of_files(model, adapter, tokenizer, "adapter")


def test_vllm_options_that_would_change_the_log_probabilities_are_refused_before_the_engine_starts():
    """The server reports the model's raw log-probabilities, up to 20 per token: another
    ``logprobs_mode``, or a ``max_logprobs`` below 20, is refused before vLLM is imported."""
    from lstmem_peft.serve.engine_vllm import VLLMEngine, check_logprob_options

    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs'.*drop --vllm-arg logprobs_mode"):
        VLLMEngine("base", "adapter", "unused-store", 64, frozenset(), logprobs_mode="processed_logprobs")
    with pytest.raises(ValueError, match="max_logprobs=5.*set it to 20 or more"):
        VLLMEngine("base", "adapter", "unused-store", 64, frozenset(), top_logprobs=20, max_logprobs=5)
    for fine in ({}, {"logprobs_mode": "raw_logprobs"}, {"max_logprobs": 20}, {"max_logprobs": -1}):
        check_logprob_options(fine, 20)


# ---------------------------------------------------------------------- the engine path of log-probabilities
class KeepingEngine:
    """The library engine, keeping the scores it decodes with as vLLM's engine does: each decoded
    sequence carries the :class:`Scores` of its tokens (and with ``echo`` its prompt's after the
    first), scored by the library's forward from the same memory."""

    name = "keeping"
    request_limit = None
    session_root = None

    def __init__(self, library) -> None:
        self.library = library

    def generate(self, rows, prompts, sampling, stops, on_token=None, cancelled=None):
        k = sampling.decoded
        decoded = self.library.generate(rows, prompts, sampling, [()] * (len(prompts) * k), on_token)
        if sampling.logprobs is None:
            return decoded
        owners = [r // k for r in range(len(decoded))]
        whole = self.library.score(
            [rows[i] for i in owners],
            [prompts[i] + d.token_ids for i, d in zip(owners, decoded, strict=True)],
            [1] * len(decoded),
            sampling.logprobs,
        )
        return [
            Decoded(
                d.token_ids,
                s[len(prompts[i]) - 1 :],
                s[: len(prompts[i]) - 1] if sampling.echo else None,
            )
            for i, d, s in zip(owners, decoded, whole, strict=True)
        ]

    def score(self, rows, sequences, starts, top):
        return self.library.score(rows, sequences, starts, top)

    def write(self, rows, tokens):
        return self.library.write(rows, tokens)

    def close(self) -> None:
        pass


def test_the_engines_implement_one_interface_and_bound_the_window_by_what_they_hold(loaded):
    """The server talks to one interface, which the library engine, an engine that keeps its scores
    and the facts read from files alone all implement; an engine whose requests hold ``L`` tokens
    bounds the position limit (the server's window) to ``L - 1``: a prompt and the token it samples."""
    assert isinstance(loaded.engine, Engine) and loaded.engine.name == "hf"
    assert loaded.model is loaded.engine.model and loaded.max_positions == 4096
    files = LoadedModel.of_files(
        str(DEMO_ASSETS / "backbone"), str(DEMO_ASSETS / "adapter_full"), loaded.tokenizer, "demo"
    )
    assert isinstance(files.engine, Engine) and files.max_positions == 4096
    limited = files.with_engine(type("Holds100", (KeepingEngine,), {"request_limit": 100})(loaded.engine))
    assert isinstance(limited.engine, Engine) and limited.max_positions == 99
    assert files.with_engine(KeepingEngine(loaded.engine)).max_positions == 4096  # no limit of its own


def assert_same_logprobs(got, want) -> None:
    assert (got.ids, got.tokens) == (want.ids, want.tokens)
    assert [x is None for x in got.logprobs] == [x is None for x in want.logprobs]
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a is None or abs(a - b) < 1e-5
    for a, b in zip(got.top, want.top, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert [x for x, _ in a] == [x for x, _ in b]
            assert all(abs(u - v) < 1e-5 for (_, u), (_, v) in zip(a, b, strict=True))


#: How the two answers of the test below end: the first, from memory, is a value and the
#: end-of-sequence token (the demo adapters answer so); the second, a prompt with no question, runs on.
EOS_THEN_LENGTH = [("stop", True), ("length", False)]


@pytest.mark.parametrize(
    "max_tokens, n, stop, logprobs, echo, eos, endings",
    [
        (6, 1, (), 3, False, None, EOS_THEN_LENGTH),
        (6, 2, (), 0, True, None, EOS_THEN_LENGTH),
        (
            8,
            1,
            ("k18",),
            2,
            True,
            None,
            [("stop", True), ("stop", False)],
        ),  # the second cut at the stop string
        (12, 1, (), 1, False, "v03", EOS_THEN_LENGTH),  # the first ends at this EOS token (it is scored)
    ],
)
def test_log_probabilities_an_engine_decodes_with_become_those_the_library_scores(
    loaded, max_tokens, n, stop, logprobs, echo, eos, endings
):
    """Greedy answers (``n`` equal choices), ended by EOS, cut at a stop string or running to
    ``max_tokens``, with or without the echoed prompt: the engine path (its scores by token id,
    sliced to each answer) gives the same token texts and log-probabilities as the library's scoring
    forward."""
    fmt = ChatFormat(loaded.tokenizer)
    if eos is not None:
        loaded = dataclasses.replace(loaded, eos_ids=frozenset(fmt.encode_text(eos)))
    (memory,), _ = write_rows(
        loaded.engine,
        [MemoryRow(fresh_memory(loaded.layout, loaded.device))],
        [fmt.encode_text("<s> k07 v19 ; k12 v03 ; k01 v05")],
        loaded.device,
    )
    rows = [memory, MemoryRow(fresh_memory(loaded.layout, loaded.device))]
    prompts = [fmt.encode_text("<s> ? k12"), fmt.encode_text("<s> k07 v19 ; k01")]
    sampling = Sampling(max_tokens, 0.0, 1.0, n, stop, None, logprobs, echo)
    keeping = KeepingEngine(loaded.engine)
    want = generate_rows(loaded.engine, loaded.tokenizer, loaded.eos_ids, rows, prompts, sampling)
    got = generate_rows(keeping, loaded.tokenizer, loaded.eos_ids, rows, prompts, sampling)
    assert [(a.finish_reason, a.end_token is not None) for a, *_ in want] == endings
    for choices_got, choices_want in zip(got, want, strict=True):
        assert len(choices_got) == len(choices_want) == n
        for a, b in zip(choices_got, choices_want, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.end_token) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.end_token,
            )
            assert_same_logprobs(a.logprobs, b.logprobs)


def test_prompts_an_engine_scores_become_those_the_library_scores(loaded):
    """``score_rows`` (a completion with ``max_tokens`` 0): whole prompts, a tail, and nothing."""
    fmt = ChatFormat(loaded.tokenizer)
    rows = [MemoryRow(fresh_memory(loaded.layout, loaded.device))] * 3
    sequences = [fmt.encode_text(t) for t in ("<s> k07 v19 ; ? k07", "<s> k01 v05", "<s> ? k12")]
    starts = [0, 3, len(sequences[2])]
    keeping = KeepingEngine(loaded.engine)
    want = score_rows(loaded.engine, loaded.tokenizer, rows, sequences, starts, 2)
    got = score_rows(keeping, loaded.tokenizer, rows, sequences, starts, 2)
    assert got[2].ids == [] and want[2].ids == []
    for a, b in zip(got, want, strict=True):
        assert_same_logprobs(a, b)


def test_a_context_window_over_the_position_limit_is_refused(loaded, tmp_path):
    """``max_positions`` bounds the server's window (with ``--engine vllm``: the engine's
    ``max_model_len - 1``); a larger ``--context-window`` is refused at start, naming the fix."""
    from dataclasses import replace

    from lstmem_peft.serve import create_app

    small = replace(loaded, max_positions=64)
    with pytest.raises(
        ValueError, match="--context-window 100 is over the model's position limit 64.*max_model_len"
    ):
        create_app(small, str(tmp_path / "store"), context_window=100)
    assert create_app(small, str(tmp_path / "store")).state.scheduler.window == 64  # the default window

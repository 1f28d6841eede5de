"""Multi-process training on CPU (gloo), 2 processes: DDP, DeepSpeed ZeRO-2 under accelerate launch
and FSDP2 under torchrun end where one process with the same global batch ends; the two-stage recipe
runs under ZeRO-2; and the launches that would train wrongly without any error are refused.

The slow tests start real launches (tests/scripts/dist_train.py, examples/train_two_stage.py). The
fast ones check each refusal in this process, with the launcher's environment monkeypatched.

Why the two runs may differ, and by how much. Both see the same examples in every update (the
episodes all have the same length, so nothing is padded differently) from the same initial adapter;
only the order of float32 sums differs: the global batch is split over two processes, and their
gradients meet in an all-reduce (DDP, FSDP2's replicated adapter) or a reduce-scatter (ZeRO-2). A
reordered float32 sum of ``n`` terms changes by at most ``n u`` (``u = 2^-24``) times the sum of the
terms' magnitudes, and by about ``sqrt(n) u`` in practice; the sums behind one gradient coordinate
here have up to a few hundred terms (episodes x tokens), so we take ``rho = 1e-5`` of the gradient's
scale as the bound per coordinate (``|dg_i| <= rho ||g||``, ``||g||`` the logged gradient norm, which
bounds every coordinate). The update is SGD with momentum ``beta`` at a constant learning rate
``eta``, after clipping to ``C``: ``w_N - w_0 = -eta sum_t sum_{s<=t} beta^(t-s) c_s g_s``, linear in
the gradients, so (the clipping factor ``c_s`` carries the same relative error) the adapters differ by
at most ``2 rho eta sum_t sum_{s<=t} beta^(t-s) min(||g_s||, C)``, plus the float32 rounding of the
weights at each update (``N u max|w|``); the later gradients' dependence on the tiny weight
difference is of second order. Losses and gradient norms are compared at relative ``2 rho``. The
half-batch run (what each process of a launch that silently trains alone would compute) must miss the
same bound by a wide margin, which shows the bound can fail.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from datasets import Dataset
from peft import get_peft_model
from safetensors.torch import load_file

from lstmem_peft import LSTMemConfig
from lstmem_peft.training import distributed as distributed_module
from lstmem_peft.training.data import synthetic_recall_episodes, tokenize_episode
from lstmem_peft.training.distributed import check_distributed_setup, shard_backbone
from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
from lstmem_peft.utils.offline import demo_tokenizer, tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "scripts" / "dist_train.py")
RHO = 1e-5  # float32 reduction-order error per gradient coordinate, relative to ||g|| (module docstring)
U = 2.0**-24
#: What a launcher leaves in the environment; children start without any of it.
LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


# ---------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("ACCELERATE_")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr"] + [
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]


def accelerate_launch(config: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config] + [
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        *args,
    ]


def check(result: subprocess.CompletedProcess) -> None:
    """A launch ended well; if not, the report leads with each process's own error lines (a peer's
    abort at the end of a log hides the process that failed first)."""
    if result.returncode == 0:
        return
    signs = ("Error", "error:", "terminate called", "what():", "Traceback", "Signal", "Exception")
    errors = [line for line in result.stderr.splitlines() if any(s in line for s in signs)]
    report = "\n".join(errors[:60]) + "\n--- stderr, last part ---\n" + result.stderr[-4000:]
    pytest.fail(f"launch exited with {result.returncode}:\n{report}\n--- stdout ---\n{result.stdout[-1500:]}")


def weight_bound(record: dict, weights: dict[str, torch.Tensor]) -> float:
    """The largest difference float32 summation order can make to the adapter (module docstring)."""
    beta, clip = record["momentum"], record["max_grad_norm"]
    scale = [min(n, clip) for n in record["grad_norms"]]
    bound = sum(
        lr * sum(beta ** (t - s) * 2 * RHO * scale[s] for s in range(t + 1))
        for t, lr in enumerate(record["learning_rates"])
    )
    return bound + len(scale) * U * max(w.abs().max().item() for w in weights.values())


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Reference runs in one process with the global batch (8), and with half of it, per stage."""
    runs = {}

    def get(history_mode: str) -> Path:
        if history_mode not in runs:
            out = tmp_path_factory.mktemp(f"one-{history_mode}")
            check(run([sys.executable, WORKER, str(out), "--backend", "single", "--history-mode", history_mode,
                       "--half-batch-too"]))  # fmt: skip
            runs[history_mode] = out
        return runs[history_mode]

    return get


def assert_matches_one_process(reference: Path, launched: Path, expected_type: str) -> None:
    ref = json.loads((reference / "rank0.json").read_text())
    ranks = [json.loads((launched / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["distributed_type"] == expected_type
        assert rank["losses"] == pytest.approx(ref["losses"], rel=2 * RHO, abs=0)
        assert rank["grad_norms"] == pytest.approx(ref["grad_norms"], rel=2 * RHO, abs=0)
    # every process holds the same adapter, and the saved one equals the one-process run's
    copies = [torch.load(launched / f"rank{r}.pt") for r in (0, 1)]
    assert all(torch.equal(copies[0][k], copies[1][k]) for k in copies[0])
    expected = load_file(reference / "adapter" / "adapter_model.safetensors")
    saved = load_file(launched / "adapter" / "adapter_model.safetensors")
    bound = weight_bound(ref, expected)
    assert max_difference(saved, expected) <= bound
    # the bound can fail: half the batch (one process training alone) lands far outside it
    half = load_file(reference / "half" / "adapter" / "adapter_model.safetensors")
    assert max_difference(half, expected) > 100 * bound


# ---------------------------------------------------------------------- real launches (slow)
@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(tmp_path, one_process):
    check(run(torchrun(WORKER, str(tmp_path), "--backend", "ddp", "--micro-batch", "2")))
    assert_matches_one_process(one_process("stage1"), tmp_path, "DistributedType.MULTI_CPU")


@pytest.mark.slow
def test_zero2_two_processes_equal_one_process(tmp_path, one_process):
    """accelerate launch + DeepSpeed ZeRO-2 through DeepSpeed's CPU accelerator (gloo), stage 1,
    micro-batch 2 with 2 accumulation steps: gradients and optimizer state split over the processes."""
    config = str(ROOT / "tests" / "configs" / "deepspeed_zero2_sgd.json")
    cmd = accelerate_launch(
        str(ROOT / "examples" / "accelerate_zero2_cpu.yaml"), "--deepspeed_config_file", config, WORKER
    )
    check(run(cmd + [str(tmp_path), "--backend", "deepspeed", "--micro-batch", "2"], timeout=420))
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["deepspeed"] for r in (0, 1))
    assert_matches_one_process(one_process("stage1"), tmp_path, "DistributedType.DEEPSPEED")


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one_process(tmp_path, one_process):
    """FSDP2 (``fully_shard`` through shard_backbone) under torchrun with gloo, stage 2: each process
    holds half of the backbone; the adapter is replicated and its gradients averaged."""
    cmd = torchrun(
        WORKER, str(tmp_path), "--backend", "fsdp2", "--history-mode", "stage2", "--micro-batch", "2"
    )
    check(run(cmd))
    held = [json.loads((tmp_path / f"rank{r}.json").read_text())["backbone_fraction_held"] for r in (0, 1)]
    assert all(0.45 < h < 0.55 for h in held) and sum(held) == pytest.approx(1.0)
    assert_matches_one_process(one_process("stage2"), tmp_path, "DistributedType.MULTI_CPU")


@pytest.mark.slow
def test_two_stage_recipe_on_two_processes_with_zero2(tmp_path):
    """The paper's recipe under accelerate launch + ZeRO-2 (examples/accelerate_zero2_cpu.yaml, the
    paper's DeepSpeed config) with 2 processes: a new trainer per stage on the same model, and
    --fit-memory turning checkpointing on for stage 1 only."""
    from eval_fixtures import QASPER_OFFICIAL

    from lstmem_peft.training.memory_plan import AdapterDims, ModelDims, Setting, estimate

    (tmp_path / "qasper.json").write_text(json.dumps(QASPER_OFFICIAL))
    long_qa = {
        "context": "The vault code is 1234. " * 20,
        "qas": [{"question": "Vault code?", "answer": "1234"}],
    }
    (tmp_path / "long.jsonl").write_text(json.dumps(long_qa) + "\n")
    # a budget between stage 1's estimate with and without checkpointing, for this launch
    dims = ModelDims.from_config(tiny_qwen3(99).config)  # the recipe's --tiny model (char tokenizer)
    adapter = AdapterDims.from_config(LSTMemConfig(), dims.num_layers)
    setting = dict(processes=2, zero2=True, backbone_dtype="float32", activation_dtype="float32")
    plain, ckpt = (estimate(dims, adapter, Setting(**setting, checkpointing=c)).total for c in (False, True))
    budget = (plain + ckpt) // 2
    cmd = accelerate_launch(
        str(ROOT / "examples" / "accelerate_zero2_cpu.yaml"), "examples/train_two_stage.py"
    )
    cmd += ["--tiny", "--qasper", str(tmp_path / "qasper.json"), "--long", str(tmp_path / "long.jsonl")]
    cmd += ["--output-dir", str(tmp_path / "run"), "--stage1-steps", "2", "--stage2-steps", "2"]
    cmd += ["--global-batch", "2", "--fit-memory", f"{budget}B"]
    result = run(cmd, timeout=420)
    check(result)
    assert "stage1: gradient checkpointing on" in result.stdout
    assert "stage2: gradient checkpointing off" in result.stdout
    record = json.loads((tmp_path / "run" / "adapter" / "training.json").read_text())
    assert record["processes"] == 2 and record["distributed_type"] == "DEEPSPEED"
    assert record["gradient_checkpointing"] == {"stage1": True, "stage2": False}
    losses = record["stage1_losses"] + record["stage2_losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    card = (tmp_path / "run" / "adapter" / "README.md").read_text()
    assert "### Training" in card and "qasper.json (2 episodes)" in card


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch, worker, message",
    [
        (
            "accelerate-fsdp",
            ["--backend", "ddp"],
            "accelerate's FSDP plugin cannot train an LSTMem adapter here",
        ),
        (
            "torchrun",
            ["--backend", "single", "--no-use-cpu"],
            "started 2 processes but this one trains as 1 of 1",
        ),
        ("torchrun", ["--backend", "ddp", "--no-use-cpu"], "gradients would never be averaged"),
        ("accelerate-cpu", ["--backend", "single"], "started only this one"),
    ],
    ids=["accelerate-fsdp-plugin", "torchrun-no-backend", "torchrun-gloo-without-use-cpu", "accelerate-cpu"],
)
def test_launches_that_would_train_wrongly_are_refused(tmp_path, launch, worker, message):
    """Each launch really produces the state the trainer refuses (without the refusal: every process
    alone, or gradients never averaged, or one process instead of two)."""
    worker = [WORKER, str(tmp_path), *worker]
    if launch == "accelerate-fsdp":
        cmd = accelerate_launch(str(ROOT / "tests" / "configs" / "accelerate_fsdp2_cpu.yaml"), *worker)
    elif launch == "torchrun":
        cmd = torchrun(*worker)
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
        cmd += ["--main_process_port", str(free_port()), *worker]
    result = run(cmd)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-4000:]
    assert not list(tmp_path.glob("rank*.json"))  # refused before training


# ---------------------------------------------------------------------- the refusals (fast)
def _accelerator(processes: int, kind: DistributedType):
    return SimpleNamespace(num_processes=processes, distributed_type=kind)


ARGS = SimpleNamespace(fsdp="", deepspeed=None)


@pytest.mark.parametrize(
    "environ, args, accelerator, message",
    [
        (
            {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            ARGS,
            _accelerator(1, DistributedType.NO),
            "started only this one",
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"},
            ARGS,
            _accelerator(1, DistributedType.NO),
            "FSDP plugin",
        ),
        (
            {"WORLD_SIZE": "2"},
            SimpleNamespace(fsdp="full_shard", deepspeed=None),
            _accelerator(2, DistributedType.MULTI_CPU),
            "FSDP plugin",
        ),
        ({"WORLD_SIZE": "2"}, ARGS, _accelerator(1, DistributedType.NO), "trains as 1 of 1"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, ARGS, _accelerator(1, DistributedType.NO), "started 4 processes"),
        ({"WORLD_SIZE": "2"}, ARGS, _accelerator(2, DistributedType.NO), "gradients would never be averaged"),
    ],
    ids=[
        "accelerate-cpu-one-process",
        "accelerate-fsdp-env",
        "fsdp-argument",
        "rank-alone",
        "mpi",
        "no-sync",
    ],
)
def test_check_distributed_setup_refuses(environ, args, accelerator, message):
    with pytest.raises(RuntimeError, match=message):
        check_distributed_setup(args, accelerator, environ)


@pytest.mark.parametrize(
    "environ, accelerator",
    [
        ({}, _accelerator(1, DistributedType.NO)),
        ({"WORLD_SIZE": "2"}, _accelerator(2, DistributedType.MULTI_CPU)),
        ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, _accelerator(2, DistributedType.DEEPSPEED)),
        ({"WORLD_SIZE": "8"}, _accelerator(8, DistributedType.MULTI_GPU)),
        ({"ACCELERATE_USE_CPU": "False"}, _accelerator(1, DistributedType.NO)),  # one process, as asked
    ],
    ids=["one-process", "ddp-cpu", "zero2", "ddp-gpu", "accelerate-one-process"],
)
def test_check_distributed_setup_accepts(environ, accelerator):
    check_distributed_setup(ARGS, accelerator, environ)


def _parts(tmp_path, **config):
    tok = demo_tokenizer()
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64, num_layers=2), LSTMemConfig(block_size=8))
    data = Dataset.from_list([tokenize_episode(tok, e) for e in synthetic_recall_episodes(8, 2, seed=0)])
    defaults = dict(output_dir=str(tmp_path), report_to=[], max_steps=1, per_device_train_batch_size=4)
    return model, data, tok, {**defaults, **config}


def test_trainer_refuses_a_process_that_would_train_alone(tmp_path, monkeypatch):
    """A launcher's WORLD_SIZE without a process group (what torchrun gives on a CPU-only machine
    without use_cpu=True): accelerate sets up one process, silently; the trainer refuses."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, data, tok, config = _parts(tmp_path)
    args = LSTMemTrainingConfig(**config)
    with pytest.raises(RuntimeError, match=r"started 2 processes .*use_cpu=True"):
        LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


def test_trainer_refuses_accelerates_fsdp_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "ACCELERATE_USE_FSDP", "true"
    )  # what accelerate launch sets for distributed_type: FSDP
    model, data, tok, config = _parts(tmp_path, use_cpu=True)
    args = LSTMemTrainingConfig(**config)
    with pytest.raises(RuntimeError, match="shard_backbone"):
        LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


def test_config_refuses_mixed_precision_beside_a_deepspeed_config(tmp_path, monkeypatch):
    ds = str(ROOT / "examples" / "deepspeed_zero2.json")
    # `mixed_precision:` in an accelerate config that also names deepspeed_config_file
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag,mixed_precision")
    with pytest.raises(ValueError, match="remove that line"):
        LSTMemTrainingConfig(output_dir=str(tmp_path), deepspeed=ds)
    monkeypatch.delenv("ACCELERATE_CONFIG_DS_FIELDS")
    # `accelerate launch --mixed_precision bf16` while the trainer runs float32
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match="--mixed_precision bf16` disagrees"):
        LSTMemTrainingConfig(output_dir=str(tmp_path), deepspeed=ds, bf16=False)


def test_context_dropout_draws_differ_between_processes(tmp_path, monkeypatch):
    """One seed on every process would drop the prompt in the same batch slots everywhere."""
    model, data, tok, config = _parts(tmp_path, use_cpu=True)
    trainer = LSTMemTrainer(
        model=model, args=LSTMemTrainingConfig(**config), train_dataset=data, processing_class=tok
    )
    monkeypatch.setattr(LSTMemTrainingConfig, "process_index", property(lambda self: 1))
    other = LSTMemTrainer(
        model=model, args=LSTMemTrainingConfig(**config), train_dataset=data, processing_class=tok
    )
    first, second = trainer.data_collator, other.data_collator
    assert [first._rng.random() for _ in range(8)] != [second._rng.random() for _ in range(8)]


@pytest.fixture
def process_group_of_one(tmp_path):
    """A gloo process group with this process alone (FSDP2 needs one), torn down afterwards."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_shard_backbone_shards_the_backbone_and_leaves_the_adapter(tmp_path, process_group_of_one):
    from torch.distributed.tensor import DTensor

    model, data, tok, config = _parts(tmp_path, use_cpu=True)
    shard_backbone(model)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for n, p in params.items() if "lstmem_memory" not in n)
    assert not any(isinstance(p, DTensor) for n, p in params.items() if "lstmem_memory" in n)
    assert distributed_module.fsdp2_sharded(model)
    args = LSTMemTrainingConfig(**config, history_mode="stage1")
    with pytest.raises(ValueError, match="history_mode='stage1' cannot train on an FSDP2-sharded backbone"):
        LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    args = LSTMemTrainingConfig(**config, history_mode="stage2", context_dropout=0.0)
    before = {n: p.detach().clone() for n, p in params.items() if "lstmem_memory" in n}
    trainer = LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_trainer_refuses_fsdp2_that_sharded_the_adapter(tmp_path, process_group_of_one):
    from torch.distributed.fsdp import fully_shard

    model, data, tok, config = _parts(tmp_path, use_cpu=True)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    args = LSTMemTrainingConfig(**config, history_mode="stage2")
    with pytest.raises(ValueError, match="FSDP2 sharded trainable parameters"):
        LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)

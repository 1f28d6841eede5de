"""Adapter files, reloading in a fresh process, and an offline Hub round trip."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny_models import history_then_question_logits, make

TESTS = Path(__file__).parent

# The child processes rebuild the same tiny base model; `import lstmem_peft` is their only set-up.
CHILD_PRELUDE = textwrap.dedent(
    f"""
    import sys, torch
    sys.path.insert(0, {str(TESTS)!r})
    import lstmem_peft  # registers LSTMem with PEFT; nothing else is set up
    from peft import PeftModel
    from tiny_models import history_then_question_logits as logits_of, tiny_model
    """
)


def run_child(code: str, cwd: Path, env: dict | None = None) -> None:
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_adapter_files_are_peft_format_and_cite_the_paper(tmp_path):
    model = make(layers_to_transform=[0, 2])
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LSTMEM" and config["layers_to_transform"] == [0, 2]
    keys = list(load_file(tmp_path / "adapter_model.safetensors"))
    assert keys and all(".lstmem_memory." in k and ".default." not in k for k in keys)
    assert len(keys) == 2 * 10  # two memory layers, ten parameter tensors each
    card = (tmp_path / "README.md").read_text()
    assert "LSTMem: Hierarchical Long Short-Term Online Memory" in card and "library_name: peft" in card
    model.save_pretrained(tmp_path)  # writing again replaces the section
    assert (tmp_path / "README.md").read_text().count("## LSTMem adapter") == 1


def test_reload_in_a_fresh_process_gives_identical_logits(tmp_path):
    model = make()
    model.save_pretrained(tmp_path / "adapter")
    torch.save(history_then_question_logits(model), tmp_path / "expected.pt")
    run_child(
        f"""
        model = PeftModel.from_pretrained(tiny_model(), {str(tmp_path / "adapter")!r}, adapter_name="renamed").eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        assert torch.equal(logits_of(model), expected), "logits differ after reload"
        assert not any(p.requires_grad for p in model.parameters()), "inference-mode load left weights trainable"
        """,
        cwd=tmp_path,
    )


def test_offline_hub_round_trip(tmp_path):
    """push_to_hub writes a real Hub cache snapshot; from_pretrained("user/repo") reads it offline."""
    model = make()
    torch.save(history_then_question_logits(model), tmp_path / "expected.pt")
    torch.save({k: v for k, v in model.state_dict().items() if "lstmem_memory" in k}, tmp_path / "weights.pt")
    workdir = tmp_path / "empty"  # no local folder "user/repo" may shadow the Hub id
    workdir.mkdir()
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf_home")}
    run_child(
        f"""
        import hashlib, os, shutil, types
        from huggingface_hub import HfApi, constants
        from peft import get_peft_model
        from lstmem_peft import LSTMemConfig

        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def create_commit(self, repo_id, operations, commit_message=None, **kwargs):
            sha = hashlib.sha1(repr(sorted(op.path_in_repo for op in operations)).encode()).hexdigest()
            root = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
            for op in operations:
                target = os.path.join(root, "snapshots", sha, op.path_in_repo)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(op.path_or_fileobj, target)
            os.makedirs(os.path.join(root, "refs"), exist_ok=True)
            with open(os.path.join(root, "refs", "main"), "w") as fh:
                fh.write(sha)
            return types.SimpleNamespace(oid=sha, commit_message=commit_message)

        HfApi.create_repo, HfApi.create_commit = create_repo, create_commit
        model = get_peft_model(tiny_model(), LSTMemConfig())
        model.load_state_dict(torch.load({str(tmp_path / "weights.pt")!r}), strict=False)
        model.push_to_hub("user/repo")
        """,
        cwd=workdir,
        env=env,
    )
    snapshot = next((tmp_path / "hub" / "models--user--repo" / "snapshots").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(os.listdir(snapshot))
    assert "LSTMem: Hierarchical Long Short-Term Online Memory" in (snapshot / "README.md").read_text()
    run_child(
        f"""
        model = PeftModel.from_pretrained(tiny_model(), "user/repo").eval()
        assert torch.equal(logits_of(model), torch.load({str(tmp_path / "expected.pt")!r}))
        """,
        cwd=workdir,
        env=env,
    )

"""Adapter files, reloading in a fresh process, and an offline Hub round trip."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import history_then_question_logits, make

from lstmem_peft import write_model_card

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
    write_model_card(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LSTMEM" and config["layers_to_transform"] == [0, 2]
    keys = list(load_file(tmp_path / "adapter_model.safetensors"))
    assert keys and all(".lstmem_memory." in k and ".default." not in k for k in keys)
    # two memory layers of ten parameter tensors, less the first's W~_pred (it has no depth input)
    assert len(keys) == 2 * 10 - 1
    card = (tmp_path / "README.md").read_text()
    assert "LSTMem: Hierarchical Long Short-Term Online Memory" in card and "library_name: peft" in card
    model.save_pretrained(tmp_path)  # PEFT keeps the card; writing the section again replaces it
    write_model_card(model, tmp_path)
    assert (tmp_path / "README.md").read_text().count("# LSTMem adapter") == 1


def _front_matter_and_body(card: str) -> tuple[str, str]:
    _, front, body = card.split("---\n", 2)
    return front, body


def test_the_card_opens_with_the_lstmem_section_names_the_base_model_and_leaves_nothing_unfilled(tmp_path):
    """PEFT's save_pretrained writes the Hub's template (about 200 lines, most "[More Information
    Needed]") and, for a backbone built from a config, ``base_model: ''``; the card replaces both, keeps
    what a user added to the card, and names the base model it is given."""
    model = make(layers_to_transform=[0, 2])
    model.save_pretrained(tmp_path)
    assert "[More Information Needed]" in (tmp_path / "README.md").read_text()  # PEFT's template
    with open(tmp_path / "README.md", "a") as fh:
        fh.write("\n## Notes of my own\n\nKept after the LSTMem section.\n")
    write_model_card(model, tmp_path, base_model="Qwen/Qwen3-0.6B", summary="A test adapter.")
    model.save_pretrained(tmp_path)  # again: PEFT updates the card it finds
    write_model_card(model, tmp_path, base_model="Qwen/Qwen3-0.6B", summary="A test adapter.")
    front, body = _front_matter_and_body((tmp_path / "README.md").read_text())
    assert front.startswith("base_model: Qwen/Qwen3-0.6B\nlibrary_name: peft\n"), front
    assert "- base_model:adapter:Qwen/Qwen3-0.6B\n" in front and "- lstmem\n" in front
    lines = body.strip().splitlines()
    assert lines[:4] == [
        "<!-- lstmem:begin -->",
        "# LSTMem adapter for Qwen/Qwen3-0.6B",
        "",
        "A test adapter.",
    ]
    assert "| base model | Qwen/Qwen3-0.6B |" in lines and lines.count("### Framework versions") == 1
    assert lines[-3:] == ["## Notes of my own", "", "Kept after the LSTMem section."]
    assert "More Information Needed" not in body and "Model Card for Model ID" not in body
    assert len(lines) < 80, len(lines)


def test_the_card_names_the_base_model_the_adapter_records_and_never_an_empty_one(tmp_path):
    model = make()  # built from a config: no name anywhere
    model.save_pretrained(tmp_path / "none")
    assert "base_model: ''" in (tmp_path / "none" / "README.md").read_text()  # what PEFT writes
    write_model_card(model, tmp_path / "none")
    front, body = _front_matter_and_body((tmp_path / "none" / "README.md").read_text())
    assert (
        "base_model" not in front
        and "| base model | not recorded (pass base_model= to write_model_card) |" in body
    )
    model.peft_config["default"].base_model_name_or_path = "Qwen/Qwen3-4B"  # as from_pretrained records it
    model.save_pretrained(tmp_path / "named")
    write_model_card(model, tmp_path / "named")
    front, body = _front_matter_and_body((tmp_path / "named" / "README.md").read_text())
    assert front.startswith("base_model: Qwen/Qwen3-4B\n") and "# LSTMem adapter for Qwen/Qwen3-4B\n" in body
    write_model_card(model, tmp_path / "named", base_model=str(tmp_path))  # a local folder: the body only
    front, body = _front_matter_and_body((tmp_path / "named" / "README.md").read_text())
    assert "base_model" not in front and f"| base model | {tmp_path} |" in body


def test_the_shipped_demo_cards_open_with_the_lstmem_section():
    from lstmem_peft.cli.demo.recall import ADAPTERS
    from lstmem_peft.utils.offline import DEMO_ASSETS

    for name in ADAPTERS:
        front, body = _front_matter_and_body((DEMO_ASSETS / f"adapter_{name}" / "README.md").read_text())
        assert "library_name: peft" in front and "- lstmem" in front
        assert body.strip().startswith(
            "<!-- lstmem:begin -->\n# LSTMem adapter for lstmem_peft/assets/demo/backbone"
        )
        assert f"The demo adapter `{name}`" in body and "More Information Needed" not in body


@pytest.mark.slow
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


@pytest.mark.slow
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
        import lstmem_peft
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
        lstmem_peft.push_to_hub(model, "user/repo")
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


def test_a_folder_with_a_config_but_no_weights_is_named_before_peft_fails_and_refused_by_our_loader(tmp_path):
    """PEFT would go on to read the folder as a Hub repo id; LSTMem names the folder and the file."""
    from peft import PeftModel
    from tiny_models import tiny_model

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.tuner.loading import load_model_and_adapter

    saved = LSTMemConfig(r=4, num_heads=2, layers_to_transform=[1])
    saved.save_pretrained(tmp_path / "config-only")
    saved.save_pretrained(tmp_path / "outer" / "inner")
    with pytest.warns(UserWarning, match="no adapter weights"):  # a config alone loads, with a warning
        loaded = LSTMemConfig.from_pretrained(str(tmp_path / "config-only"))
    assert loaded.to_dict() == saved.to_dict()
    loaders = {
        "PeftModel.from_pretrained": lambda: PeftModel.from_pretrained(
            tiny_model(), str(tmp_path / "config-only")
        ),
        "subfolder": lambda: PeftModel.from_pretrained(
            tiny_model(), str(tmp_path / "outer"), subfolder="inner"
        ),
        "load_adapter": lambda: make().load_adapter(str(tmp_path / "config-only"), adapter_name="other"),
    }
    for name, load in loaders.items():
        # PEFT's own loaders: a warning names the folder and what is missing before PEFT fails
        folder = tmp_path / "outer" / "inner" if name == "subfolder" else tmp_path / "config-only"
        with pytest.warns(UserWarning, match="has an adapter_config.json but no adapter weights") as caught:
            with pytest.raises(Exception):  # noqa: B017 (PEFT's own error, which varies by version)
                load()
        message = " ".join(str(w.message) for w in caught)
        assert str(folder) in message, (name, message)
        assert "adapter_model.safetensors" in message and "adapter_model.bin" in message, (name, message)
    tiny_model().save_pretrained(tmp_path / "base")
    with pytest.raises(FileNotFoundError, match="no adapter weights"):  # the project's loader refuses it
        load_model_and_adapter(str(tmp_path / "base"), str(tmp_path / "config-only"))


def test_lstmem_eval_with_an_adapter_folder_without_weights_prints_one_line(tmp_path, capsys):
    from eval_fixtures import write_hotpot

    from lstmem_cli import main
    from lstmem_peft import LSTMemConfig
    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    tiny_qwen3(len(tok), hidden_size=64).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    LSTMemConfig(r=4, num_heads=2).save_pretrained(tmp_path / "adapter")
    data = write_hotpot(tmp_path / "dev.json")
    capsys.readouterr()  # the set-up's own progress bars
    argv = [
        "eval",
        "hotpotqa",
        data,
        "--model",
        str(tmp_path / "base"),
        "--adapter",
        str(tmp_path / "adapter"),
    ]
    assert main([*argv, "--out", str(tmp_path / "out"), "--device", "cpu", "--limit", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line.strip() for line in err.splitlines()]
    messages = [line for line in lines if line and not line.startswith("Loading weights")]  # progress bar
    assert len(messages) == 1, err
    err = messages[0]
    assert err.startswith("lstmem eval: error: ") and str(tmp_path / "adapter") in err
    assert "adapter_model.safetensors" in err and "FileNotFoundError" in err
    assert not (tmp_path / "out").exists()

"""The ``lstmem`` model type in lm-evaluation-harness, offline: a tiny model and local tasks in the
harness's own YAML format (a generation task like IFEval, a multiple-choice task like GPQA)."""

import json

import pytest
import torch
from peft import PeftModel, get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "k1 v2 k3 v4 ? k1", "answer": "v2", "choices": ["v2", "v4"], "label": 0},
    {"question": "k5 v6 ? k5", "answer": "v6", "choices": ["v1", "v6"], "label": 1},
    {"question": "k7 v8 k9 v1 k2 v3 ? k9", "answer": "v1", "choices": ["v1", "v3"], "label": 0},
]

GENERATE_TASK = """task: tiny_recall_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} ="
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 4
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

CHOICE_TASK = """task: tiny_recall_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}} ="
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64), LSTMemConfig())
    model.get_base_model().save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    model.save_pretrained(root / "adapter")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_recall_gen.yaml").write_text(GENERATE_TASK.format(data=data))
    (tasks / "tiny_recall_mc.yaml").write_text(CHOICE_TASK.format(data=data))
    return root


def _run(saved, tasks, batch_size, monkeypatch):
    from lm_eval.tasks import TaskManager

    from lstmem_peft.eval.lm_eval_model import LSTMemLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = LSTMemLM(
        pretrained=str(saved / "base"), adapter=str(saved / "adapter"), block_size=8, batch_size=batch_size
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(saved / "tasks")),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return lm, results


def test_registered_model_loads_the_adapter_and_writes_each_prompt_into_a_fresh_memory(saved, monkeypatch):
    from lm_eval.api.registry import get_model

    from lstmem_peft.eval.lm_eval_model import LSTMemLM

    assert get_model("lstmem") is LSTMemLM
    lm, results = _run(saved, ["tiny_recall_gen"], 2, monkeypatch)
    assert isinstance(lm.model, PeftModel) and lm.model.peft_config["default"].peft_type == "LSTMEM"
    assert lm.requests_written == len(DOCS)  # one fresh memory per request
    assert "exact_match,none" in results["results"]["tiny_recall_gen"]
    replies = [s["resps"] for s in sorted(results["samples"]["tiny_recall_gen"], key=lambda s: s["doc_id"])]

    # a fresh memory per request: the replies do not depend on batching (padding never reaches memory)
    _, alone = _run(saved, ["tiny_recall_gen"], 1, monkeypatch)
    again = [s["resps"] for s in sorted(alone["samples"]["tiny_recall_gen"], key=lambda s: s["doc_id"])]
    assert again == replies


def test_multiple_choice_tasks_run_through_the_harness_forward(saved, monkeypatch):
    _, results = _run(saved, ["tiny_recall_mc"], 2, monkeypatch)
    assert 0.0 <= results["results"]["tiny_recall_mc"]["acc,none"] <= 1.0
    assert len(results["samples"]["tiny_recall_mc"]) == len(DOCS)


def test_the_adapter_must_be_named(saved):
    from lstmem_peft.eval.lm_eval_model import LSTMemLM

    with pytest.raises(ValueError, match="adapter="):
        LSTMemLM(pretrained=str(saved / "base"))

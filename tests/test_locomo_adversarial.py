"""LoCoMo's category 5 (adversarial) on request: asked as the official code asks it (a choice between
the trap answer and "Not mentioned in the conversation"), scored by its rule, refused under the paper's
protocol, and carried through a rows run and its re-scoring (lstmem_peft/eval/locomo.py)."""

from __future__ import annotations

import json

import pytest
import torch
from eval_fixtures import write_locomo
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.eval import Decoding, LoCoMo, rows
from lstmem_peft.eval import locomo as lc
from lstmem_peft.eval.scorers import locomo_adversarial_answer, locomo_adversarial_score
from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(write_locomo(tmp_path_factory.mktemp("locomo") / "locomo10.json"))


def adversarial(benchmark: LoCoMo) -> list:
    return [q for h in benchmark.histories() for q in h.questions if q.meta["category"] == 5]


def test_by_default_categories_1_to_4_are_asked_and_the_settings_are_unchanged(data):
    default = LoCoMo(data)
    assert default.categories == (1, 2, 3, 4) and adversarial(default) == []
    assert "categories" not in default.settings()  # records made before category 5 resume as before
    every = LoCoMo(data, categories=lc.ALL_CATEGORIES)
    assert every.settings()["categories"] == [1, 2, 3, 4, 5]


def test_a_category_5_question_offers_the_trap_and_not_mentioned_in_a_seeded_order(data):
    (first,) = adversarial(LoCoMo(data, categories=[1, 2, 3, 4, 5]))  # the fixture has one
    assert first.group == "adversarial" and first.answer == lc.NOT_MENTIONED
    assert sorted(first.meta["options"].values()) == sorted([lc.NOT_MENTIONED, "Tom"])  # adversarial_answer
    options = first.meta["options"]
    choice = lc.ADVERSARIAL_CHOICE.format(options["a"], options["b"])
    assert first.prompt == "\n\n" + lc.OFFICIAL_QA_PROMPT_ADVERSARIAL.format(first.meta["question"] + choice)
    assert "Select the correct answer: (a) " in first.prompt and first.prompt.endswith(
        ".  Short answer:\n"
    )  # the choice's trailing space
    again = adversarial(LoCoMo(data, categories=[5]))  # the same draw in another run
    assert [q.prompt for q in again] == [first.prompt]
    orders = {tuple(lc.adversarial_options("x", f"conv/{i}").values()) for i in range(40)}
    assert orders == {(lc.NOT_MENTIONED, "x"), ("x", lc.NOT_MENTIONED)}  # both orders occur


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("(a)", 1.0),  # the letter of "not mentioned"
        ("a", 1.0),
        (" (B) ", 0.0),  # the trap's letter
        ("b", 0.0),
        ("Not mentioned in the conversation", 1.0),
        ("No information available.", 1.0),
        ("Tom", 0.0),
        ("It is not mentioned.", 1.0),
    ],
)
def test_a_reply_is_read_and_scored_by_the_official_rule(reply, score):
    options = {"a": lc.NOT_MENTIONED, "b": "Tom"}
    assert locomo_adversarial_score(reply, options) == score
    assert locomo_adversarial_answer("(a)", options) == lc.NOT_MENTIONED
    assert locomo_adversarial_answer(" Tommy ", options) == "tommy"
    assert (
        locomo_adversarial_answer("Tom", options) == "Tom"
    )  # the official rule: any 3 characters name an option


def test_category_5_is_refused_under_the_paper_protocol_and_unknown_categories_are_named(data):
    with pytest.raises(ValueError, match="paper's protocol .* asks categories 1-4 only"):
        LoCoMo(data, protocol="paper", categories=[4, 5])
    with pytest.raises(ValueError, match="categories are 1-5"):
        LoCoMo(data, categories=[1, 6])
    assert lc.parse_categories("all", "official") == (1, 2, 3, 4, 5)
    assert lc.parse_categories("5,1", "official") == (1, 5)
    with pytest.raises(ValueError, match="got 'one'"):
        lc.parse_categories("one", "official")


def test_the_command_line_takes_categories_for_locomo_only(data, tmp_path, capsys):
    import lstmem_cli

    common = ["--model", "m", "--out", str(tmp_path / "out")]
    for argv, message in [
        (
            ["eval", "locomo", data, *common, "--categories", "5", "--protocol", "paper"],
            "asks categories 1-4 only",
        ),
        (["eval", "locomo", data, *common, "--categories", "1,x"], "expected categories 1-5 or all"),
        (["eval", "hotpotqa", data, *common, "--categories", "1"], "applies to locomo only"),
    ]:
        assert lstmem_cli.main(argv) == 2
        assert message in capsys.readouterr().err, argv


def test_a_rows_run_scores_the_adversarial_group_under_both_protocols(data, tmp_path):
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64), LSTMemConfig()).eval()
    benchmark = LoCoMo(data, max_new_tokens=3, categories="1,2,3,4,5".split(","))
    out = tmp_path / "out"
    summary = rows.evaluate_rows(
        model,
        tok,
        benchmark,
        out,
        rows=["no-context", "memory-only"],
        decoding=Decoding(greedy=True),
        block_size=256,
        progress=False,
    )
    for protocol in ("official", "paper"):
        groups = summary["by_protocol"][protocol]["memory-only"]["groups"]
        assert groups["adversarial"]["questions"] == 1, (protocol, groups)
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    five = [r for r in records if r["meta"]["category"] == 5]
    assert len(five) == 2 and all(set(r["meta"]["options"]) == {"a", "b"} for r in five)
    for r in five:  # the recorded score is the rule applied to the recorded reply
        assert r["scores"]["f1"] == locomo_adversarial_score(r["prediction"], r["meta"]["options"])
    assert summary["settings"]["categories"] == [1, 2, 3, 4, 5]

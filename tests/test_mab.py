"""MemoryAgentBench: scorers against hand-computed values, loader and aggregation on a tiny snapshot."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from eval_fixtures import ENTITIES, ROWS, mab_row, write_snapshot

from lstmem_peft.eval import mab
from lstmem_peft.eval.mab import ABSTAIN, MemoryAgentBench, alias_accuracy, recall_at_5, summary_f1


# ---------------------------------------------------------------------- scorers
@pytest.mark.parametrize(
    "prediction, aliases, expected",
    [
        ("Paris", ["Paris"], 1.0),
        ("The capital is Paris.", "paris", 1.0),  # containment; a bare string alias
        ("", ["Paris"], 0.0),  # empty prediction
        ("Shakespeare", [["William Shakespeare"], ["Shakespeare"]], 1.0),  # list of lists: any alias
        ("William", ["William Shakespeare"], 0.0),  # the whole alias must occur
        ("Parisian food", ["Paris"], 0.0),  # whole tokens only
        ("label: 13", ["3"], 0.0),  # numeric labels: "3" is not in "13"
        ("label: 3", ["3"], 1.0),
        ("the U.S.A.!", ["USA"], 1.0),  # punctuation and articles dropped
        ("an apple", ["The Apple"], 1.0),
        ("A", ["A"], 1.0),  # an alias that normalises to nothing keeps its articles
        ("B", ["A"], 0.0),
        ("Answer: a", ["A"], 1.0),
        ("Unanswerable.", [ABSTAIN], 1.0),  # abstention
        ("It is answerable", [ABSTAIN], 0.0),
        ("unanswerable", ["Paris"], 0.0),  # abstaining on an answerable question
    ],
)
def test_alias_accuracy(prediction, aliases, expected):
    assert alias_accuracy(prediction, aliases) == expected


def test_alias_accuracy_needs_an_alias():
    with pytest.raises(ValueError, match="alias"):
        alias_accuracy("Paris", [])


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        ("the cat sat", "a cat sat down", 0.8),  # P = 2/2, R = 2/3
        ("Cat, cat!", "cat", 2 / 3),  # P = 1/2, R = 1
        ("", "a cat", 0.0),  # empty prediction
        ("cat", ["dog", "cat"], 1.0),  # best over references
    ],
)
def test_summary_f1(prediction, reference, expected):
    assert summary_f1(prediction, reference) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction, gold, expected",
    [
        (
            "Here you go:\n1. Up (2009)\n2. Cars\n3. Toy Story\n4. Shrek\n5. Frozen\n6. Spider-Man",
            ["Up", "Spider-Man"],
            0.5,
        ),
        ("Up, Cars, Spider-Man", ["Spider-Man", "Up", "Heat"], 2 / 3),  # comma separated
        ("1. Up\n2. Up\n3. Up\n4. Up\n5. Up\n6. Heat", ["Heat"], 1.0),  # duplicates take one rank
        ("- Heat\n- Up", [["heat"]], 1.0),  # bullets; list of lists
        ("", ["Up"], 0.0),
    ],
)
def test_recall_at_5(prediction, gold, expected):
    assert recall_at_5(prediction, gold) == pytest.approx(expected)


def test_ranked_items_and_entity_titles():
    assert mab.ranked_items("1. Up (2009)\nnot an item\n2) The Matrix") == ["up", "matrix"]
    assert mab.entity_title("<http://dbpedia.org/resource/Up_(2009_film)>") == "Up"
    assert mab.entity_title("<http://dbpedia.org/resource/Am%C3%A9lie>") == "Amélie"


@pytest.mark.parametrize(
    "source, family, metric, tokens",
    [
        ("eventqa_full", "AR", "alias", 40),
        ("longmemeval_s*", "AR", "alias", 50),
        ("ruler_qa2_421K", "AR", "alias", 50),
        ("icl_banking77_5900shot_balance", "TTL", "alias", 20),
        ("recsys_redial_full", "TTL", "recall@5", 300),
        ("infbench_sum_eng_shots2", "LRU", "f1", 1200),
        ("detective_qa", "LRU", "alias", 2000),
        ("factconsolidation_mh_262k", "SF", "alias", 10),
    ],
)
def test_source_table(source, family, metric, tokens):
    spec = mab.source_spec(source)
    assert (spec.family, spec.metric, spec.max_new_tokens) == (family, metric, tokens)


def test_unknown_source_names_the_known_prefixes():
    with pytest.raises(ValueError, match="known source prefixes: eventqa, longmemeval"):
        mab.source_spec("niah_single_1")


# ---------------------------------------------------------------------- a tiny snapshot
@pytest.fixture
def snapshot(tmp_path):
    return write_snapshot(tmp_path / "mab", ROWS)


def _bench(source, **kwargs):
    return MemoryAgentBench(str(source), families=kwargs.pop("families", mab.FAMILIES), **kwargs)


def test_loader_histories_questions_and_prompts(snapshot):
    bench = _bench(snapshot)
    histories = list(bench.histories())
    assert len(bench) == 7
    assert [h.id for h in histories] == [
        "ruler_qa1_197K/0",
        "longmemeval_s*/0",
        "icl_banking77_5900shot_balance/0",
        "recsys_redial_full/0",
        "infbench_sum_eng_shots2/0",
        "detective_qa/0",
        "factconsolidation_sh_6k/0",
    ]
    assert histories[0].text.startswith("Context:\nDocument 1: Paris")
    first = histories[0].questions[0]
    assert (first.id, first.group, first.max_new_tokens) == ("ruler_qa1_197K/0/q0", "ruler_qa1_197K", 50)
    assert first.answer == ["Paris"]
    assert first.meta == {
        "family": "AR",
        "source": "ruler_qa1_197K",
        "metric": "alias",
        "qa_pair_id": "ruler_qa1_197K_no0",
    }
    assert "Question: What is the capital of France?" in first.prompt
    assert ABSTAIN in first.prompt and first.prompt.endswith("Answer:")
    assert histories[0].questions[1].answer == ["William Shakespeare", "Shakespeare"]

    abstain = histories[1].questions[2]
    assert abstain.answer == [ABSTAIN]
    assert abstain.meta["abstention"] and abstain.meta["reference"] == ["You did not mention a dog."]
    assert abstain.meta["question_type"] == "single-session-user"
    assert "abstention" not in histories[1].questions[0].meta

    recsys = histories[3].questions[0]
    assert recsys.answer == ["Spider-Man", "Up"]  # entity ids resolved through entity2id.json
    assert recsys.prompt.endswith("Recommendations:") and recsys.max_new_tokens == 300
    summary = histories[4].questions[0]
    assert "Task:" not in summary.prompt and summary.prompt.endswith("Summary:")  # empty question left out
    assert histories[2].questions[0].prompt.endswith("Text: My card is gone\n\nLabel:")
    assert [h.questions[0].max_new_tokens for h in histories] == [50, 50, 20, 300, 1200, 2000, 10]


def test_jsonl_snapshot_and_single_file_match_parquet(snapshot, tmp_path):
    parquet = list(_bench(snapshot).histories())
    assert list(_bench(write_snapshot(tmp_path / "jsonl", ROWS, fmt="jsonl")).histories()) == parquet
    single = _bench(snapshot / "data" / "Conflict_Resolution-00000-of-00001.parquet")
    assert [h.id for h in single.histories()] == ["factconsolidation_sh_6k/0"]


def test_limit_families_and_max_questions(snapshot):
    one_each = _bench(snapshot, limit=1)
    assert [h.id for h in one_each.histories()] == [
        "ruler_qa1_197K/0",
        "icl_banking77_5900shot_balance/0",
        "infbench_sum_eng_shots2/0",
        "factconsolidation_sh_6k/0",
    ]
    some = _bench(snapshot, families={"SF", "LRU"}, max_questions=1)
    assert [h.id for h in some.histories()] == [
        "infbench_sum_eng_shots2/0",
        "detective_qa/0",
        "factconsolidation_sh_6k/0",
    ]
    assert all(len(h.questions) == 1 for h in some.histories())
    with pytest.raises(ValueError, match="unknown MemoryAgentBench families"):
        _bench(snapshot, families={"CR"})


def test_full_load_is_checked_against_the_paper_counts(snapshot):
    with pytest.warns(UserWarning, match="AR 5/2000, TTL 3/700, LRU 3/171, SF 2/800"):
        assert len(MemoryAgentBench(str(snapshot))) == 7


def test_score_dispatches_on_the_source_metric(snapshot):
    bench = _bench(snapshot)
    questions = {q.id: q for h in bench.histories() for q in h.questions}
    cases = [
        ("ruler_qa1_197K/0/q0", "Paris.", 1.0),
        ("longmemeval_s*/0/q2", "Unanswerable", 1.0),
        ("longmemeval_s*/0/q2", "Rex", 0.0),
        ("icl_banking77_5900shot_balance/0/q0", "label: 12", 1.0),
        ("recsys_redial_full/0/q0", "1. Spider-Man (2002)\n2. Cars\n3. Up", 1.0),
        ("recsys_redial_full/0/q0", "1. Cars", 0.0),
        ("infbench_sum_eng_shots2/0/q0", "A dog finds home.", 0.75),  # 3 of 3 tokens, 3 of 5: P 1, R 3/5
        ("detective_qa/0/q0", '{"answer": "A. The butler"}', 1.0),
        ("detective_qa/0/q1", "B", 1.0),
        ("factconsolidation_sh_6k/0/q0", "James Joyce", 0.0),
    ]
    for qid, prediction, expected in cases:
        assert bench.score(questions[qid], prediction) == {"score": pytest.approx(expected)}, qid


def test_summarize_weights_families_by_question_count(snapshot):
    bench = _bench(snapshot)
    questions = [q for h in bench.histories() for q in h.questions]
    # AR 5 questions, TTL 3, LRU 3, SF 2
    scores = [1, 1, 1, 0, 0] + [1, 0, 0] + [0.5, 1, 1] + [1, 1]
    records = [{"group": q.group, "scores": {"score": s}} for q, s in zip(questions, scores, strict=True)]
    summary = bench.summarize(records)
    assert summary["families"] == {
        "AR": {"score": pytest.approx(0.6), "questions": 5},
        "TTL": {"score": pytest.approx(1 / 3), "questions": 3},
        "LRU": {"score": pytest.approx(2.5 / 3), "questions": 3},
        "SF": {"score": pytest.approx(1.0), "questions": 2},
    }
    assert summary["overall"] == {"score": pytest.approx(8.5 / 13), "questions": 13}
    assert summary["groups"]["longmemeval_s*"] == {"score": pytest.approx(1 / 3), "questions": 3}
    assert list(bench.summarize(records[-2:])["families"]) == ["SF"]


# ---------------------------------------------------------------------- bad data fails loudly
def test_unknown_source_in_data_fails(tmp_path):
    rows = {"Accurate_Retrieval": [mab_row("niah_single_1", "c", ["q"], [["a"]])]}
    with pytest.raises(ValueError, match="row 0.*known source prefixes"):
        _bench(write_snapshot(tmp_path / "s", rows))


def test_source_in_the_wrong_split_file_fails(tmp_path):
    rows = {"Accurate_Retrieval": [mab_row("factconsolidation_sh_6k", "c", ["q"], [["a"]])]}
    with pytest.raises(ValueError, match="'factconsolidation_sh_6k' is SF, not Accurate_Retrieval"):
        _bench(write_snapshot(tmp_path / "s", rows))


def test_bad_files_name_the_file_and_what_is_missing(tmp_path):
    no_answers = tmp_path / "Test_Time_Learning.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"context": "c", "questions": ["q"], "metadata": {"source": "icl_x"}}]),
        no_answers,
    )
    with pytest.raises(ValueError, match=r"Test_Time_Learning\.parquet: missing column\(s\) answers"):
        _bench(no_answers)

    bad = tmp_path / "rows.jsonl"
    bad.write_text(
        json.dumps({"context": "c", "questions": ["q"], "answers": [["a"]], "metadata": {}}) + "\n"
    )
    with pytest.raises(ValueError, match=r"rows\.jsonl: row 0: metadata has no 'source'"):
        _bench(bad)

    bad.write_text(json.dumps(mab_row("eventqa_full", "c", ["q1", "q2"], [["a"]])) + "\n")
    with pytest.raises(ValueError, match="2 questions but 1 answers"):
        _bench(bad)

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="named after a split"):
        _bench(tmp_path / "empty")


def test_redial_ids_need_the_entity_map(tmp_path):
    rows = {"Test_Time_Learning": ROWS["Test_Time_Learning"]}
    root = write_snapshot(tmp_path / "s", rows, entities=False)
    with pytest.raises(FileNotFoundError, match="entity2id.json"):
        _bench(root)
    (tmp_path / "map.json").write_text(json.dumps(ENTITIES))
    bench = _bench(root, entity_map=str(tmp_path / "map.json"))
    assert [q.answer for h in bench.histories() for q in h.questions][-1] == ["Spider-Man", "Up"]

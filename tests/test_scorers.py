"""LoCoMo and HotpotQA scorers against hand-computed values."""

import pytest

from lstmem_peft.eval import hotpotqa, locomo


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The cat, and the Dog!", "cat dog"),  # commas, case, punctuation, a/an/the/and, whitespace
        ("  An   apple  ", "apple"),
        ("Band and brand", "band brand"),  # 'and' only as a whole word
    ],
)
def test_locomo_normalisation(text, expected):
    assert locomo.normalize(text) == expected


@pytest.mark.parametrize(
    "prediction, answer, category, expected",
    [
        ("running dogs", "the dog ran", 4, 0.5),  # stems run/dog vs dog/ran: P = R = 1/2
        ("She studies", "she studied", 4, 1.0),  # Porter: studies, studied -> studi
        ("7 May 2023", "7 May, 2023", 2, 1.0),  # temporal: commas dropped before scoring
        ("", "Paris", 4, 0.0),  # empty prediction
        ("Paris, London", "London, Berlin", 1, 0.5),  # multi-answer: mean over gold of best F1
        ("London", "London, Berlin", 1, 0.5),
        ("summer", "in the summer; because it was warm", 3, 2 / 3),  # gold before ';' -> "in summer"
        ("summer because warm", "in the summer; because it was warm", 3, 0.4),  # P 1/3, R 1/2
    ],
)
def test_locomo_score_answer(prediction, answer, category, expected):
    assert locomo.score_answer(prediction, answer, category) == pytest.approx(expected)


def test_locomo_category_5_is_not_scored_and_aggregation_is_question_weighted():
    with pytest.raises(ValueError, match="category 5"):
        locomo.score_answer("x", "y", 5)
    bench = locomo.LoCoMo.__new__(locomo.LoCoMo)  # summarize needs no data
    records = [
        {"group": "single-hop", "scores": {"f1": 1.0}},
        {"group": "multi-hop", "scores": {"f1": 1.0}},
        {"group": "multi-hop", "scores": {"f1": 0.0}},
    ]
    summary = bench.summarize(records)
    assert list(summary["groups"]) == ["multi-hop", "single-hop"]  # category order
    assert summary["groups"]["multi-hop"] == {"f1": 0.5, "questions": 2}
    assert summary["overall"] == {"f1": pytest.approx(2 / 3), "questions": 3}


@pytest.mark.parametrize(
    "prediction, gold, em, f1",
    [
        ("The Eiffel Tower.", "eiffel tower", 1.0, 1.0),
        ("a red apple pie", "the red apple", 0.0, 0.8),  # P 2/3, R 1
        ("yes", "no", 0.0, 0.0),
        ("yes it is", "yes", 0.0, 0.0),  # yes/no answers need the exact word
        ("", "Paris", 0.0, 0.0),
    ],
)
def test_hotpotqa_scores(prediction, gold, em, f1):
    assert hotpotqa.score_answer(prediction, gold) == {"em": em, "f1": pytest.approx(f1)}

"""MemoryAgentBench: both protocols' prompts and scoring, loader and aggregation on a tiny snapshot."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from eval_fixtures import ENTITIES, ROWS, mab_row, write_snapshot

from lstmem_peft.eval import mab, mab_templates
from lstmem_peft.eval.mab import MemoryAgentBench


def words(text):
    return len(text.split())


def sentences(text):
    return [s.strip() + "." for s in text.split(".") if s.strip()]


# ---------------------------------------------------------------------- official chunking and templates
def test_official_chunking_defaults_count_with_tiktoken_and_split_with_punkt(monkeypatch):
    """The defaults of the official chunking: tiktoken's gpt-4o-mini encoding (``<|endoftext|>`` allowed
    in the text, one token) and ``nltk.sent_tokenize``. The real encoding file cannot be fetched offline,
    so a byte-level encoding built here stands in for it: one token per byte."""
    import nltk
    import tiktoken

    byte_level = tiktoken.Encoding(
        "bytes",
        pat_str=r"[\s\S]",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )
    asked = []
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: asked.append(name) or byte_level)
    monkeypatch.setattr(nltk, "sent_tokenize", lambda text: text.split("#"))
    # sentences of 4, 3 + 1 (the special token) and 5 tokens, at most 9 per chunk
    assert mab.sentence_chunks("abcd#xyz<|endoftext|>#efghi", 9) == ["abcd xyz<|endoftext|>", "efghi"]
    assert asked == ["gpt-4o-mini"]


def test_official_chunking_without_its_data_says_how_to_get_it(monkeypatch):
    import nltk
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")  # what requests raises: an OSError

    monkeypatch.setattr(tiktoken, "encoding_for_model", offline)
    with pytest.raises(OSError, match="TIKTOKEN_CACHE_DIR.*--chunk-tokenizer model"):
        mab.sentence_chunks("a. b.", 9, split_sentences=str.split)

    def no_punkt(text):
        raise LookupError("Resource punkt_tab not found")

    monkeypatch.setattr(nltk, "sent_tokenize", no_punkt)
    with pytest.raises(LookupError, match="nltk.downloader punkt_tab"):
        mab.sentence_chunks("a. b.", 9, count_tokens=len)


def test_sentence_chunks_pack_sentences_by_token_count():
    text = "one two. three four five. six. seven eight nine ten eleven."
    # sentence token counts 2, 3, 1, 5; limit 5: [2+3], then 1 (+5 would be 6 > 5) -> [1], [5]
    chunks = mab.sentence_chunks(text, 5, words, sentences)
    assert chunks == ["one two. three four five.", "six.", "seven eight nine ten eleven."]
    # a first sentence over the limit closes an empty first chunk, as the official code does
    assert mab.sentence_chunks("a b c d e f g.", 3, words, sentences) == ["", "a b c d e f g."]


def test_official_memorize_and_query_templates():
    text = mab.official_history("eventqa_full", ["first chunk", "second chunk"], "2025-01-01 00:00:00")
    parts = text.split("\n")
    # "\\n" in the official memorize template is a backslash and an n, not a line break
    opening = "Dialogue between User and Assistant 2025-01-01 00:00:00\\n<User> The following context is the "
    assert parts[0] == opening + "book excerpt: "
    assert "first chunk" in text and text.index("first chunk") < text.index("second chunk")
    assert text.count("Dialogue between User and Assistant") == 2  # one memorize template per chunk
    # the in-context classification query keeps the literal {label}: the gold label never enters the prompt
    query = mab.official_query("icl_banking77_5900shot_balance", "My card is gone")
    assert 'Only output "label: {label}" and nothing else.' in query and query.endswith("\n\n label:")


@pytest.mark.parametrize(
    "source, family, metric, tokens",
    [
        ("eventqa_full", "AR", "accuracy", 40),
        ("longmemeval_s*", "AR", "accuracy", 50),
        ("ruler_qa2_421K", "AR", "accuracy", 50),
        ("icl_banking77_5900shot_balance", "TTL", "accuracy", 20),
        ("recsys_redial_full", "TTL", "recall@5", 300),
        ("infbench_sum_eng_shots2", "LRU", "f1", 1200),
        ("detective_qa", "LRU", "accuracy", 2000),
        ("factconsolidation_mh_262k", "SF", "accuracy", 10),
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
    families = kwargs.pop("families", mab.FAMILIES)
    return MemoryAgentBench(
        str(source), families=families, count_tokens=words, split_sentences=sentences, **kwargs
    )


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
    ruler = histories[0]
    assert ruler.system == mab.OFFICIAL_SYSTEM
    assert ruler.text == mab.official_history(
        "ruler_qa1_197K",
        ["Document 1: Paris is the capital of France. Document 2: Shakespeare wrote Hamlet."],
    )  # two short sentences: one chunk
    first = ruler.questions[0]
    assert (first.id, first.group, first.max_new_tokens) == ("ruler_qa1_197K/0/q0", "ruler_qa1_197K", 50)
    assert first.answer == ["Paris"]
    assert first.meta == {
        "family": "AR",
        "source": "ruler_qa1_197K",
        "metric": "accuracy",
        "qa_pair_id": "ruler_qa1_197K_no0",
    }
    # history + "\n" + query template, as the official long-context agent sends it
    assert first.prompt == "\n" + mab.official_query("ruler_qa1_197K", "What is the capital of France?")
    assert ruler.questions[1].answer == ["William Shakespeare", "Shakespeare"]
    assert histories[1].questions[2].answer == ["You did not mention a dog."]  # gold as given
    assert histories[1].questions[2].meta["question_type"] == "single-session-user"

    recsys = histories[3].questions[0]
    assert recsys.answer == ["2", "1"]  # entity ids as given; their official titles beside them
    assert recsys.meta["gold_titles"] == ["Spider Man", "Up"]
    assert recsys.max_new_tokens == 300
    assert [h.questions[0].max_new_tokens for h in histories] == [50, 50, 20, 300, 1200, 2000, 10]


def test_paper_protocol_prompts(snapshot):
    histories = list(_bench(snapshot, protocol="paper").histories())
    ruler = histories[0]
    assert ruler.system is None
    assert ruler.text == mab.PAPER_HEAD + ROWS["Accurate_Retrieval"][0]["context"]
    assert ruler.questions[0].prompt == "\n\nQuestion: What is the capital of France?\nAnswer:"
    assert "reply exactly: I don't know." in ruler.text


# ---------------------------------------------------------------------- the paper protocol's pre-clip
# δ-Mem's clip_context_text (declare-lab/delta-Mem, deltamem/eval/benchmark_compare.py), as its suite runs
# it (--memory-agent-bench-max-context-chars 120000). The marker "\n\n[... context truncated ...]\n\n" is
# 2 + 27 + 2 = 31 characters. For N = 120,000: room N - 31 = 119,969; head 119,969 // 3 = 39,989
# (3 * 39,989 = 119,967); tail 119,969 - 39,989 = 79,980; 39,989 + 31 + 79,980 = 120,000.
MARKER = "\n\n[... context truncated ...]\n\n"


def digits(n):
    """n characters, no whitespace, no marker: position i holds str(i % 10)."""
    return "".join(str(i % 10) for i in range(n))


def test_paper_clip_constants_are_delta_mems():
    assert mab_templates.CLIP_MARKER == MARKER and len(MARKER) == 31
    assert mab.PAPER_MAX_CONTEXT_CHARS == 120_000


def test_paper_clip_under_at_and_just_over_the_limit():
    for n in (0, 1, 119_999, 120_000):  # at most the limit: unchanged
        assert mab.paper_clip(digits(n)) == digits(n)
    text = digits(120_001)  # one over: 120,001 - 79,980 = 40,021 is where the tail starts
    clipped = mab.paper_clip(text)
    assert clipped == text[:39_989] + MARKER + text[40_021:]
    assert clipped.count(MARKER) == 1 and len(clipped) == 120_000
    head, tail = clipped.split(MARKER)
    assert (len(head), len(tail)) == (39_989, 79_980)
    assert len(text) - len(head) - len(tail) == 32  # characters dropped: 120,001 - 119,969
    # far over: the same head and tail lengths; the tail starts at 200,000 - 79,980 = 120,020
    long = digits(200_000)
    assert mab.paper_clip(long) == long[:39_989] + MARKER + long[120_020:]


def test_paper_clip_strips_whitespace_at_the_cut():
    # 130,000 characters: the head is [0, 39,989), the tail [130,000 - 79,980, ...) = [50,020, ...)
    text = "a" * 39_987 + " \t" + "b" * (50_020 - 39_989) + "\n " + "c" * (130_000 - 50_022)
    assert len(text) == 130_000 and text[39_987:39_989] == " \t" and text[50_020:50_022] == "\n "
    # the head's trailing " \t" and the tail's leading "\n " are stripped: 39,987 + 31 + 79,978
    assert mab.paper_clip(text) == "a" * 39_987 + MARKER + "c" * 79_978


def test_paper_clip_small_and_disabled_limits():
    text = digits(100)
    # N = 63: room 32, too small for a marker: the last 63 characters
    assert mab.paper_clip(digits(64), 63) == digits(64)[1:]
    # N = 64: room 33, head 11, tail 22 (from 100 - 22 = 78)
    assert mab.paper_clip(text, 64) == text[:11] + MARKER + text[78:]
    # N = 100 in the end-to-end test's shape: room 69, head 23, tail 46
    assert mab.paper_clip(digits(150), 100) == digits(150)[:23] + MARKER + digits(150)[104:]
    assert mab.paper_clip(text, 0) == text and mab.paper_clip(text, -5) == text  # off
    assert mab.paper_clip(text, 100) == text


def test_paper_protocol_histories_are_pre_clipped(tmp_path):
    lengths = (119_999, 120_000, 120_001)
    rows = {
        "Accurate_Retrieval": [
            mab_row("ruler_qa1_197K", digits(n), ["Which digit?"], [["7"]]) for n in lengths
        ]
    }
    root = write_snapshot(tmp_path / "long", rows)
    paper = _bench(root, protocol="paper")
    assert paper.settings()["max_context_chars"] == 120_000
    under, at, over = (h.text for h in paper.histories())
    assert under == mab.PAPER_HEAD + digits(119_999) and at == mab.PAPER_HEAD + digits(120_000)
    assert over == mab.PAPER_HEAD + digits(120_001)[:39_989] + MARKER + digits(120_001)[40_021:]
    assert over.count(MARKER) == 1
    # the prompt after the history is unchanged
    assert next(paper.histories()).questions[0].prompt == "\n\nQuestion: Which digit?\nAnswer:"

    whole = _bench(root, protocol="paper", max_context_chars=0)
    assert whole.settings()["max_context_chars"] == 0
    assert [h.text for h in whole.histories()][2] == mab.PAPER_HEAD + digits(120_001)
    small = _bench(root, protocol="paper", max_context_chars=64)
    assert [h.text for h in small.histories()][0] == (
        mab.PAPER_HEAD + digits(119_999)[:11] + MARKER + digits(119_999)[-22:]
    )

    official = _bench(root)  # the official protocol chunks the whole context
    assert "max_context_chars" not in official.settings()
    assert all(MARKER not in h.text for h in official.histories())
    assert digits(120_001) in list(official.histories())[2].text
    with pytest.raises(ValueError, match="paper protocol only"):
        _bench(root, max_context_chars=1000)
    with pytest.raises(ValueError, match="must be >= 0"):
        _bench(root, protocol="paper", max_context_chars=-1)


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
        assert len(MemoryAgentBench(str(snapshot), count_tokens=words)) == 7


@pytest.mark.parametrize(
    "qid, prediction, official, paper",
    [
        ("ruler_qa1_197K/0/q0", "Paris.", 1.0, 1.0),
        ("longmemeval_s*/0/q2", "I don't know", 0.0, 0.0),  # gold: the dataset's explanation
        ("icl_banking77_5900shot_balance/0/q0", "label: 12", 0.0, 1.0),  # official: strict exact match
        ("icl_banking77_5900shot_balance/0/q0", "12", 1.0, 1.0),
        # catalogue Up, Spider Man, Cars: "Spider-Man" snaps to Spider Man; both gold titles in the top 5
        ("recsys_redial_full/0/q0", "1. Spider-Man (2002)\n2. Cars\n3. Up", 1.0, 1.0),
        ("recsys_redial_full/0/q0", "1. Cars", 0.0, 0.0),
        # first line "A dog finds home." vs "A dog finds its way home.": P 1, R 3/5, F1 3/4
        ("infbench_sum_eng_shots2/0/q0", "A dog finds home.", 0.75, 0.75),
        ("detective_qa/0/q0", "A. The butler", 1.0, 1.0),
        ("detective_qa/0/q0", 'It was {"answer": "A. The butler"}', 0.0, 1.0),  # exact vs contained
        ("factconsolidation_sh_6k/0/q0", "James Joyce", 0.0, 0.0),
    ],
)
def test_score_follows_the_protocol(snapshot, qid, prediction, official, paper):
    bench = _bench(snapshot)
    questions = {q.id: q for h in bench.histories() for q in h.questions}
    assert bench.score(questions[qid], prediction) == {"score": pytest.approx(official)}
    assert bench.with_protocol("paper").score(questions[qid], prediction) == {"score": pytest.approx(paper)}


def test_redial_paper_protocol_counts_a_repeated_gold_id_once(tmp_path):
    rows = {"Test_Time_Learning": [mab_row("recsys_redial_full", "c", ["q"], [["1", "1", "3"]])]}
    bench = _bench(write_snapshot(tmp_path / "s", rows))
    question = next(bench.histories()).questions[0]
    # the reply's only item snaps to Up; gold titles Up, Up, Cars (ids 1, 1, 3)
    assert bench.score(question, "1. Up") == {"score": pytest.approx(2 / 3)}  # Up, Up, Cars: 2 of 3
    assert bench.with_protocol("paper").score(question, "1. Up") == {"score": pytest.approx(1 / 2)}


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
    redial = [q for h in bench.histories() for q in h.questions if q.group == "recsys_redial_full"]
    assert redial[0].meta["gold_titles"] == ["Spider Man", "Up"]

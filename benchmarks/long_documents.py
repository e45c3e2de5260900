"""Long documents: a pretrained 512-position encoder, linearized to read whole documents, against what people do
with the teacher itself (truncate, or cut into 512-token windows and pool).

The teacher is all-MiniLM-L6-v2 (a 6 x 384 BERT, 512 learned positions; fetched as in linearization_quality.py).
The tasks are ``data/long_documents/`` (built by ``data/build_embedded_data.py`` from the Wikipedia leads and their
topic; 11 topics; 120 training and 66 validation documents of 1k, 2k, 4k and 8k tokens):

- ``majority_topic``: leads of two topics, 60% : 40%, shuffled; the label is the topic with more leads. The first
  512 tokens hold about 5 of 15 to 60 leads: a long-range counting task.
- ``dominant_topic``: 80% of the leads from one topic; any few hundred tokens show it.

Students (one per encoding and seed): ``linearize(teacher, feature_map="hedgehog", positional_encoding=E,
absolute_position_embedding="none")``, then ``--transfer_steps`` of attention transfer and ``--distill_steps`` of
hidden-state distillation (``lrpe_hf.training.distillation``) on 512-token blocks of the Wikipedia leads (or of
``--distillation_file``): lengths the teacher sees. No task data reaches a student before its probe.

Every method gives a document one vector; the same probe reads it (the encoder stays frozen: a standardised
multinomial logistic regression whose L2 strength is chosen by 4-fold cross-validation on the training documents,
folds shuffled by the seed). Methods:

- ``teacher first 512``: the first 510 tokens between [CLS] and [SEP], mean-pooled (the teacher's own pooling);
- ``teacher head+tail``: the first 128 and the last 382 tokens;
- ``teacher windows, mean`` / ``max`` / ``mean+max``: every 510-token window, each mean-pooled, then pooled;
- ``student <encoding>``: the whole document at once, mean-pooled;
- ``student <encoding>, first 512``: the same student given the teacher's first 510 tokens (what reading on adds);
- ``random <encoding>``: the student's architecture with random weights, whole document (what pretraining adds).

Accuracy per length bucket and over 1k-4k; each validation document's predicted label per method and seed; the
students against every teacher method and their own first 512 tokens, paired by seed and by document over 1k-4k
(``lrpe_hf.training.verdicts.paired_over_seeds_and_items``: the interval covers which documents were drawn as
well as the seeds); the short-text check (tweet sentiment, the same probe, teacher
against student) and the time and peak memory of one document per length go to ``--output_dir``: ``results.csv``
(per seed), ``summary.csv`` (means over seeds), ``predictions.csv`` (per document), ``comparisons.csv``,
``short_text.csv``, ``costs.csv`` (every timed round in ``costs_rounds.csv``), ``results.md`` and ``record.json``.

    python benchmarks/long_documents.py --output_dir out/long_documents --encodings lrpe_orthogonal,rope,permute \
        --seeds 0,1,2
"""

import argparse
import collections
import concurrent.futures
import csv
import json
import math
import multiprocessing
import statistics
from pathlib import Path

import numpy as np
import torch
from measure import high_water_mark_mb, resident_mb, round_rows, sample_alternately, write_csv, write_provenance
from transformers import AutoModel, AutoTokenizer, set_seed

import lrpe_hf
from lrpe_hf.training import distillation
from lrpe_hf.training.tables import markdown
from lrpe_hf.training.verdicts import paired_over_seeds_and_items

ROOT = Path(__file__).resolve().parents[1]
LEADS = ROOT / "data" / "wikipedia_leads"
TASKS = ("majority_topic", "dominant_topic")
HEAD, TAIL = 128, 382  # head + tail truncation: 510 tokens between [CLS] and [SEP]
TEACHER_METHODS = (
    "teacher first 512",
    "teacher head+tail",
    "teacher windows, mean",
    "teacher windows, max",
    "teacher windows, mean+max",
)
MEASURED_BUCKETS = (1024, 2048, 4096)  # the comparison's lengths; 8k documents are reported apart


def documents(task: str, split: str) -> list[dict]:
    """The task's documents: text (its leads joined), label and nominal length in tokens."""
    leads = (LEADS / f"{split}.txt").read_text(encoding="utf-8").splitlines()
    with open(ROOT / "data" / "long_documents" / task / f"{split}.csv", newline="") as f:
        return [
            dict(
                text=" ".join(leads[int(i)] for i in row["leads"].split()),
                label=row["label"],
                length=int(row["length"]),
            )
            for row in csv.DictReader(f)
        ]


def windows(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[start : start + size] for start in range(0, len(tokens), size)]


@torch.no_grad()
def mean_pooled(model, pieces: list[list[int]], tokenizer) -> torch.Tensor:
    """Each token list between the special tokens, through ``model``, mean-pooled over its real tokens:
    (len(pieces), hidden). Equal-length pieces go in one batch."""
    inputs = [distillation.with_special_tokens(tokenizer, piece) for piece in pieces]
    width = max(map(len, inputs))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in inputs])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in inputs])
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def teacher_vectors(teacher, tokenizer, tokens: list[int]) -> dict[str, torch.Tensor]:
    """One vector per teacher method for a document's tokens (without special tokens)."""
    window_vectors = mean_pooled(teacher, windows(tokens, 510), tokenizer)
    head_tail = tokens if len(tokens) <= HEAD + TAIL else tokens[:HEAD] + tokens[-TAIL:]
    mean, peak = window_vectors.mean(0), window_vectors.amax(0)
    return {
        "teacher first 512": window_vectors[0],  # the first window is the first 510 tokens
        "teacher head+tail": mean_pooled(teacher, [head_tail], tokenizer)[0],
        "teacher windows, mean": mean,
        "teacher windows, max": peak,
        "teacher windows, mean+max": torch.cat([mean, peak]),
    }


def embedded(path: Path, compute) -> dict:
    """``compute()``'s tensors, kept in ``path`` (a rerun reads them back)."""
    if path.exists():
        return torch.load(path)
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, path)
    return result


def probe_predictions(train_x, train_y, test_x, seed: int) -> np.ndarray:
    """The label of each test document by the probe fitted on the training documents: standardised features,
    multinomial logistic regression, L2 strength by 4-fold cross-validation."""
    # imported here, as the teacher's fetching in prepared_run: a cost's spawned child, which imports this file,
    # needs neither (seconds a child)
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import KFold, StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    smallest_class = min(collections.Counter(train_y).values())
    splitter = StratifiedKFold if smallest_class >= 4 else KFold  # tiny sets (tests): plain folds
    folds = splitter(n_splits=4, shuffle=True, random_state=seed)
    probe = make_pipeline(
        StandardScaler(), LogisticRegressionCV(Cs=[1e-3, 1e-2, 1e-1, 1.0], cv=folds, scoring="accuracy", max_iter=2000)
    )
    probe.fit(train_x, train_y)
    return probe.predict(test_x)


def make_student(teacher, tokenizer, encoding: str, seed: int, args, folder: Path, texts=None):
    """The linearized teacher after attention transfer and hidden-state distillation on 512-token blocks of
    ``texts`` (default: the Wikipedia leads) (kept in ``folder``); and its distillation losses."""
    if (folder / "losses.json").exists():  # written last
        return AutoModel.from_pretrained(folder, trust_remote_code=True), json.loads(
            (folder / "losses.json").read_text()
        )
    set_seed(seed)
    student = lrpe_hf.linearize(
        teacher, feature_map="hedgehog", positional_encoding=encoding, absolute_position_embedding="none"
    )
    if texts is None:
        texts = (LEADS / "train.txt").read_text(encoding="utf-8").splitlines()
    batches = distillation.text_blocks(tokenizer, texts, 512, args.batch_size, seed=seed)
    transfer = distillation.attention_transfer(student, teacher, batches, args.transfer_steps)
    distill = distillation.distill_hidden_states(student, teacher, batches, args.distill_steps, args.learning_rate)
    student.save_pretrained(folder)
    losses = dict(transfer_first=transfer[:10], transfer_last=transfer[-10:], distill_first=distill[:10],
                  distill_last=distill[-10:])  # fmt: skip
    (folder / "losses.json").write_text(json.dumps(losses))
    return student.eval(), losses


def tweet_vectors(model, tokenizer, train_rows: int, validation_rows: int = 2000) -> dict:
    """Mean-pooled vectors and labels of tweet sentiment: ``train_rows`` training tweets and ``validation_rows``
    validation tweets (all 2,000 by default), 64 tokens at most."""
    data = ROOT / "data" / "tweet_sentiment"
    result = {}
    for split, rows in (("train", train_rows), ("validation", validation_rows)):
        with open(data / f"{split}.csv", newline="") as f:
            table = list(csv.DictReader(f))[:rows]
        pieces = [tokenizer(r["sentence"], add_special_tokens=False)["input_ids"][:62] for r in table]
        x = torch.cat([mean_pooled(model, pieces[i : i + 64], tokenizer) for i in range(0, len(pieces), 64)])
        result[split] = (x, [r["label"] for r in table])
    return result


def short_text_accuracy(tweets: dict, seed: int) -> float:
    """The probe's accuracy on the validation tweets."""
    (train_x, train_y), (test_x, test_y) = tweets["train"], tweets["validation"]
    return float((probe_predictions(train_x.numpy(), train_y, test_x.numpy(), seed) == np.asarray(test_y)).mean())


def document_cost(model_folder: str, tokenizer_folder: str, method: str, length: int) -> dict:
    """Median time of one document of ``length`` tokens (3 rounds after a warm-up, every round under ``rounds``) and
    how far resident memory rose above the loaded model's at its peak, in this process (run it in a fresh one:
    ``costs``)."""
    model = AutoModel.from_pretrained(model_folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    vocabulary = model.config.vocab_size
    ids = torch.randint(min(1000, vocabulary // 2), vocabulary, (length,), generator=torch.Generator().manual_seed(0))
    tokens = ids.tolist()
    pieces = {"student": [tokens], "teacher windows": windows(tokens, 510)}.get(method, [tokens[:510]])
    baseline = resident_mb()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak (VmHWM) starts again from what is resident now
    (rounds,) = sample_alternately([lambda: mean_pooled(model, pieces, tokenizer)], "cpu", reps=3)
    return dict(ms=statistics.median(rounds), peak_mb=high_water_mark_mb() - baseline, rounds=rounds)


def costs(teacher_folder: Path, student_folder: Path, lengths: list[int]) -> tuple[list[dict], list[dict]]:
    """``document_cost`` of each method and length, each in a new process (spawned: its memory is its own, and no
    thread pool of this one is inherited half-used, as a fork would); and the timed rounds behind them."""
    rows, timed_rounds = [], []
    spawn = multiprocessing.get_context("spawn")
    for length in lengths:
        for method, folder in (
            ("teacher first 512", teacher_folder),
            ("teacher windows", teacher_folder),
            ("student", student_folder),
        ):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                job = pool.submit(document_cost, str(folder), str(teacher_folder), method, length)
                try:
                    measured = job.result()
                except Exception as error:  # for example out of memory: the row says so
                    measured = {"error": f"{type(error).__name__}: {str(error)[:80]}"}
            key = dict(method=method, length=length)
            timed_rounds += round_rows(key, {"document": measured.pop("rounds", [])})
            rows.append(key | measured)
    return rows, timed_rounds


def add_student_arguments(parser):
    """The teacher's, the students' distillation and the threads' flags, shared with natural_documents.py."""
    parser.add_argument("--cache_dir", default="out/teachers", help="where the teacher is fetched and unpacked")
    parser.add_argument("--teacher", default=None, help="a BERT checkpoint folder instead of all-MiniLM-L6-v2")
    parser.add_argument("--transfer_steps", type=int, default=60)
    parser.add_argument("--distill_steps", type=int, default=150)
    parser.add_argument("--learning_rate", type=float, default=2e-4, help="hidden-state distillation")
    parser.add_argument("--batch_size", type=int, default=4, help="512-token blocks per distillation step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def prepared_run(args):
    """(the output folder, made; the teacher's folder, its tokenizer and the teacher in eval mode), torch's threads
    set from ``args``."""
    from linearization_quality import fetch_teacher  # see probe_predictions

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pretrained = Path(args.teacher) if args.teacher else fetch_teacher(Path(args.cache_dir))
    return out, pretrained, AutoTokenizer.from_pretrained(pretrained), AutoModel.from_pretrained(pretrained).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="out/long_documents")
    parser.add_argument("--encodings", default="lrpe_orthogonal,rope,permute")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of every encoding's student and of the probes")
    parser.add_argument("--seeds_of", default="", help="ENCODING=SEED+SEED,...: other seeds for some encodings")
    parser.add_argument("--documents", type=int, default=0, help="use every k-th document, N per split (0: all)")
    add_student_arguments(parser)
    parser.add_argument("--cost_lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--short_text_rows", type=int, default=3000, help="training tweets of the short-text probe")
    parser.add_argument(
        "--short_text_validation_rows", type=int, default=2000, help="the first N validation tweets it is scored on"
    )
    parser.add_argument(
        "--distillation_file", type=Path, default=LEADS / "train.txt",
        help="the students' distillation text, a passage a line (default: the Wikipedia leads' training split)",
    )  # fmt: skip
    parser.add_argument(
        "--students_only", action="store_true", help="make the students and their vectors (kept), no report"
    )
    args = parser.parse_args()
    out, pretrained, tokenizer, teacher = prepared_run(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    seeds_of = {
        e: [int(s) for s in v.split("+")] for e, v in (item.split("=") for item in args.seeds_of.split(",") if item)
    }
    runs = [(encoding, seed) for encoding in args.encodings.split(",") for seed in seeds_of.get(encoding, seeds)]
    data = {(task, split): documents(task, split) for task in TASKS for split in ("train", "validation")}
    subset = f"-every-{args.documents}" if args.documents else ""  # vectors kept per document set
    if args.documents:
        data = {key: docs[:: max(1, len(docs) // args.documents)][: args.documents] for key, docs in data.items()}
    tokens = {
        key: [tokenizer(d["text"], add_special_tokens=False)["input_ids"] for d in docs] for key, docs in data.items()
    }

    vectors = {}  # (method, task, split) -> (documents, features)
    for (task, split), doc_tokens in tokens.items():
        per_doc = embedded(
            out / "vectors" / f"teacher-{task}-{split}{subset}.pt",
            lambda doc_tokens=doc_tokens: [teacher_vectors(teacher, tokenizer, t) for t in doc_tokens],
        )
        for method in TEACHER_METHODS:
            vectors[method, task, split] = torch.stack([v[method] for v in per_doc]).numpy()

    rows, short_text, losses = [], [], {}
    tweet_rows = (args.short_text_rows, args.short_text_validation_rows)
    rows_tag = f"tweets{tweet_rows[0]}" + (f"-validation{tweet_rows[1]}" if tweet_rows[1] != 2000 else "")
    teacher_tweets = embedded(
        out / "vectors" / f"teacher-{rows_tag}.pt", lambda: tweet_vectors(teacher, tokenizer, *tweet_rows)
    )
    texts = args.distillation_file.read_text(encoding="utf-8").splitlines()
    for encoding, seed in runs:
        student, losses[encoding, seed] = make_student(
            teacher, tokenizer, encoding, seed, args, out / "students" / f"{encoding}-seed{seed}", texts=texts
        )
        random_model = lrpe_hf.LinearRobertaModel(student.config).eval()
        for name, model in ((f"student {encoding}", student), (f"random {encoding}", random_model)):
            if name.startswith("random") and (args.students_only or (encoding, seed) != runs[0]):
                continue  # one random-weight model, the report's first, is enough to show what pretraining adds
            for (task, split), doc_tokens in tokens.items():
                vectors[name, task, split, seed] = embedded(
                    out / "vectors" / f"{name.replace(' ', '-')}-seed{seed}-{task}-{split}{subset}.pt",
                    lambda m=model, d=doc_tokens: torch.cat([mean_pooled(m, [t], tokenizer) for t in d]),
                ).numpy()
        for (task, split), doc_tokens in tokens.items():  # the student truncated as the teacher is: what length adds
            if not args.students_only:
                vectors[f"student {encoding}, first 512", task, split, seed] = embedded(
                    out / "vectors" / f"student-{encoding}-first512-seed{seed}-{task}-{split}{subset}.pt",
                    lambda s=student, d=doc_tokens: torch.cat([mean_pooled(s, [t[:510]], tokenizer) for t in d]),
                ).numpy()
        student_tweets = embedded(
            out / "vectors" / f"student-{encoding}-seed{seed}-{rows_tag}.pt",
            lambda student=student: tweet_vectors(student, tokenizer, *tweet_rows),
        )
        short_text.append(
            dict(seed=seed, encoding=encoding, teacher=short_text_accuracy(teacher_tweets, seed),
                 student=short_text_accuracy(student_tweets, seed))
        )  # fmt: skip
    if args.students_only:
        return

    probe_seeds = sorted({seed for _, seed in runs})  # the teacher's vectors are probed with every student's seeds
    predictions, right = [], {}  # right: (task, method, seed) -> whether each validation document is classified right
    for task in TASKS:
        labels = {split: [d["label"] for d in data[task, split]] for split in ("train", "validation")}
        lengths = np.array([d["length"] for d in data[task, "validation"]])
        methods = [(m, seed, vectors[m, task, "train"], vectors[m, task, "validation"]) for m in TEACHER_METHODS
                   for seed in probe_seeds]  # fmt: skip
        methods += [(key[0], key[3], vectors[key], vectors[key[0], task, "validation", key[3]])
                    for key in list(vectors) if len(key) == 4 and key[1:3] == (task, "train")]  # fmt: skip
        for method, seed, train_x, test_x in methods:
            predicted = probe_predictions(train_x, labels["train"], test_x, seed)
            correct = right[task, method, seed] = predicted == np.asarray(labels["validation"])
            for index, (length, label, guess) in enumerate(zip(lengths, labels["validation"], predicted)):
                predictions.append(dict(task=task, method=method, seed=seed, document=index, length=int(length),
                                        label=label, predicted=guess, correct=int(guess == label)))  # fmt: skip
            measured = np.isin(lengths, MEASURED_BUCKETS)
            row = dict(task=task, method=method, seed=seed, accuracy=float(correct[measured].mean()))
            row |= {f"accuracy_{n}": float(correct[lengths == n].mean()) for n in sorted(set(lengths))}
            rows.append(row)

    comparisons = []
    for task in TASKS:
        measured = np.isin([d["length"] for d in data[task, "validation"]], MEASURED_BUCKETS)
        for encoding in args.encodings.split(","):
            student_seeds = [
                seed for key_task, method, seed in right if (key_task, method) == (task, f"student {encoding}")
            ]
            for method in (*TEACHER_METHODS, f"student {encoding}, first 512"):
                differences = [right[task, f"student {encoding}", s][measured].astype(float)
                               - right[task, method, s][measured] for s in student_seeds]  # fmt: skip
                test = paired_over_seeds_and_items(np.stack(differences))
                verdict = {"reproduced": "better", "contradicted": "worse"}.get(test.verdict, "inconclusive")
                comparisons.append(
                    dict(task=task, student=encoding, against=method, seeds=test.pairs, documents=int(measured.sum()),
                         difference=test.mean, low=test.low, high=test.high, p_value=test.p_value, verdict=verdict)
                )  # fmt: skip

    student_folder = out / "students" / f"{runs[0][0]}-seed{runs[0][1]}"
    cost_rows, cost_rounds = costs(pretrained, student_folder, [int(n) for n in args.cost_lengths.split(",")])

    write_csv(out / "results.csv", None, rows)
    means = method_means(rows)
    write_csv(out / "summary.csv", None, means)
    write_csv(out / "comparisons.csv", None, comparisons)
    write_csv(out / "predictions.csv", None, predictions)
    write_csv(out / "short_text.csv", None, short_text)
    write_csv(out / "costs.csv", None, cost_rows)
    if cost_rounds:  # none when every cost's child failed
        write_csv(out / "costs_rounds.csv", None, cost_rounds)
    (out / "losses.json").write_text(json.dumps({f"{e}-seed{s}": v for (e, s), v in losses.items()}, indent=2))
    report = summary(means, comparisons, short_text, cost_rows)
    (out / "results.md").write_text("\n".join(report) + "\n")
    write_provenance(out / "record.json", "cpu")
    print("\n".join(report))


def method_means(rows: list[dict]) -> list[dict]:
    """Per task and method: the seeds and the mean validation accuracy (%) over them, 1k-4k and per length."""
    means = []
    for task, method in dict.fromkeys((r["task"], r["method"]) for r in rows):
        chosen = [r for r in rows if r["task"] == task and r["method"] == method]
        columns = [c for c in chosen[0] if c.startswith("accuracy")]
        cells = {c: round(100 * statistics.mean(r[c] for r in chosen), 1) for c in columns}
        means.append(dict(task=task, method=method, seeds=len(chosen), **cells))
    return means


def summary(means, comparisons, short_text, costs) -> list[str]:
    """Markdown: mean accuracy per method, task and length; the paired comparisons; short texts; costs."""
    lines = []
    for task in TASKS:
        task_rows = [r for r in means if r["task"] == task]
        columns = [c for c in task_rows[0] if c.startswith("accuracy")]
        body = [[r["method"], str(r["seeds"]), *(f"{r[c]:.1f}" for c in columns)] for r in task_rows]
        names = ["1k-4k" if c == "accuracy" else c.removeprefix("accuracy_") for c in columns]
        lines += [f"### {task}: validation accuracy (%), mean over seeds", ""]
        lines += markdown(["method", "seeds", *names], body) + [""]
    body = [
        [c["task"], c["student"], c["against"], str(c["seeds"]), f"{100 * c['difference']:+.1f}", *interval_of(c),
         c["verdict"]]
        for c in comparisons
    ]  # fmt: skip
    lines += ["### Students against the teacher's workarounds, 1k-4k, paired over seeds and documents (points)", ""]
    lines += markdown(["task", "student", "against", "seeds", "difference", "95% interval", "p", "verdict"], body)
    lines += no_interval_note(comparisons)
    body = [[r["encoding"], str(r["seed"]), f"{100 * r['teacher']:.1f}", f"{100 * r['student']:.1f}",
             f"{100 * r['student'] / r['teacher']:.1f}"] for r in short_text]  # fmt: skip
    lines += ["", "### Short texts: tweet sentiment, the same probe", ""]
    lines += markdown(["encoding", "seed", "teacher %", "student %", "kept %"], body)
    body = [[c["method"], str(c["length"]), f"{c.get('ms', float('nan')):.0f}", f"{c.get('peak_mb', float('nan')):.0f}"]
            for c in costs]  # fmt: skip
    lines += ["", "### One document's forward pass on the CPU", ""]
    lines += markdown(["method", "tokens", "ms", "peak MB"], body)
    return lines


def interval_of(comparison: dict) -> tuple[str, str]:
    """A paired comparison's 95% interval and p (in points) as the summaries print them, or "none" where the test
    gave no interval."""
    if math.isnan(comparison["low"]):
        return "none", "none"
    return f"[{100 * comparison['low']:+.1f}, {100 * comparison['high']:+.1f}]", f"{comparison['p_value']:.3f}"


def no_interval_note(comparisons: list[dict]) -> list[str]:
    """The summaries' line saying why a comparison has no interval, where one has none."""
    if not any(math.isnan(c["low"]) for c in comparisons):
        return []
    return ["", "A comparison over one seed, or whose differences do not vary, has no interval (run two seeds or "
            "more), so its verdict stays inconclusive."]  # fmt: skip


if __name__ == "__main__":
    main()

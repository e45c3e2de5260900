"""Long natural documents, fine-tuned: ``natural_documents.py``'s task (the kernel documentation's subsystems) learned
the way users learn a classifier, each method's encoder fine-tuned with a classification head on the training
documents, against tf-idf.

Every method is an encoder, the mean of its real tokens' hidden states (special tokens included, as in the probe)
and a linear layer over that vector, trained end to end with cross-entropy:

- ``teacher first 512``: the teacher on the first 510 tokens between [CLS] and [SEP];
- ``teacher head+tail``: the first 128 and the last 382 tokens;
- ``teacher windows, mean``: every 510-token window, each mean-pooled, the windows' vectors averaged (the gradient
  flows through every window);
- ``student <encoding>``: ``natural_documents.py``'s student of the same seed (distilled on the distillation files;
  read from ``--students_dir``, made there as there when missing) on the whole document at once;
- ``tf-idf``: as in ``natural_documents.py`` (nothing to fine-tune).

Training (``Trainer``): one document a forward, ``--accumulation`` documents a step, AdamW at
``--fine_tuning_learning_rate`` (``--learning_rate`` is the students' distillation's) with 10% warm-up then linear
decay and weight decay 0.01, ``--epochs`` epochs, dropout 0.1 before the head, bf16
autocast unless ``--precision fp32``; the seed sets the head, the dropout and the documents' order, and picks the
student. No validation document is seen before it is predicted. Writes what ``natural_documents.py`` writes
(``results.csv``, ``predictions.csv``, ``comparisons.csv``, ``results.md``, ``record.json``) and ``training.csv``
(each run's mean training loss and seconds) to ``--output_dir``; each run's predictions and settings are kept in its
``runs/``, so a rerun into the same folder with the same settings goes on where the last one stopped::

    python benchmarks/natural_documents_fine_tuned.py --documentation DIR --cache_dir out/teachers \\
        --students_dir out/natural_documents/students --output_dir out/natural_documents_fine_tuned
"""

import argparse
import json
import time
from pathlib import Path

import torch
from long_documents import HEAD, TAIL, add_student_arguments, make_student, prepared_run, windows
from measure import write_csv
from natural_documents import TASK, distillation_texts_for, task_splits, tfidf_of, write_report
from torch import nn
from transformers import AutoModel, Trainer, TrainingArguments, set_seed

from lrpe_hf.training.distillation import with_special_tokens

FINE_TUNED_TEACHER_METHODS = ("teacher first 512", "teacher head+tail", "teacher windows, mean")
SETTINGS = ("epochs", "fine_tuning_learning_rate", "accumulation", "precision")  # kept with each run, checked on resume


def rows_of(method: str, tokens: list[int]) -> list[list[int]]:
    """The token rows (without special tokens) that ``method``'s encoder reads of one document."""
    if method == "teacher first 512":
        return [tokens[:510]]
    if method == "teacher head+tail":
        return [tokens if len(tokens) <= HEAD + TAIL else tokens[:HEAD] + tokens[-TAIL:]]
    if method == "teacher windows, mean":
        return windows(tokens, 510)
    if method.startswith("student"):
        return [tokens]
    raise ValueError(f"{method!r}: not a fine-tuned method; the methods are {FINE_TUNED_TEACHER_METHODS} and students")


class DocumentClassifier(nn.Module):
    """An encoder and a linear layer over the mean of a document's rows' mean-pooled hidden states."""

    def __init__(self, encoder, labels: int, dropout: float = 0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, labels)

    def forward(self, input_ids, attention_mask, labels=None):
        """input_ids, attention_mask: (rows, length), one document's rows; labels: (1,). Logits: (1, labels)."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask[..., None].to(hidden.dtype)
        document = ((hidden * mask).sum(1) / mask.sum(1)).mean(0, keepdim=True)
        logits = self.classifier(self.dropout(document))
        loss = None if labels is None else nn.functional.cross_entropy(logits.float(), labels)
        return {"loss": loss, "logits": logits}


class OneDocument:
    """Trainer's collator: a batch of one document, its rows padded to the longest."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        if len(features) != 1:
            raise ValueError(f"one document a batch (per_device batch size 1), not {len(features)}")
        rows = features[0]["input_ids"]
        width = max(map(len, rows))
        return dict(
            input_ids=torch.tensor([row + [self.pad_token_id] * (width - len(row)) for row in rows]),
            attention_mask=torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
            labels=torch.tensor([features[0]["labels"]]),
        )


def fine_tuned_predictions(encoder, method: str, tokens: dict, labels: dict, tokenizer, seed: int, args, folder):
    """(each validation document's predicted label, the mean training loss, seconds): ``encoder`` with a new head,
    fine-tuned on the training documents as ``method`` reads them."""
    names = sorted(set(labels["train"]))
    examples = {
        split: [dict(input_ids=[with_special_tokens(tokenizer, row) for row in rows_of(method, t)],
                     labels=names.index(label)) for t, label in zip(tokens[split], labels[split])]
        for split in ("train", "validation")
    }  # fmt: skip
    set_seed(seed)
    model = DocumentClassifier(encoder, len(names))
    training = TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.fine_tuning_learning_rate,
        num_train_epochs=args.epochs, warmup_steps=0.1, weight_decay=0.01, bf16=args.precision == "bf16",
        seed=seed, data_seed=seed, save_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=examples["train"], data_collator=OneDocument(
        tokenizer.pad_token_id))  # fmt: skip
    started = time.perf_counter()
    loss = trainer.train().training_loss
    logits = trainer.predict(examples["validation"]).predictions
    return [names[i] for i in logits.argmax(-1)], loss, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documentation", type=Path, required=True, help="the unpacked package's Documentation/")
    parser.add_argument("--task_dir", type=Path, default=TASK, help="the task's split files (path, label, sha256)")
    parser.add_argument("--output_dir", default="out/natural_documents_fine_tuned")
    parser.add_argument("--students_dir", type=Path, default=Path("out/natural_documents/students"))
    parser.add_argument("--encodings", default="lrpe_orthogonal", help="students' encodings ('' for none)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the fine-tuning runs and of the students")
    parser.add_argument("--methods", nargs="*", default=FINE_TUNED_TEACHER_METHODS, help="the teacher's methods")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--fine_tuning_learning_rate", type=float, default=5e-5)
    parser.add_argument("--accumulation", type=int, default=8, help="documents a step")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    add_student_arguments(parser)
    args = parser.parse_args()
    out, pretrained, tokenizer, teacher = prepared_run(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    teacher_methods = list(args.methods)
    for method in teacher_methods:
        rows_of(method, [])  # an unknown method stops the run before any training
    data, labels, tokens = task_splits(args, tokenizer)
    encodings = [encoding for encoding in args.encodings.split(",") if encoding]
    texts = distillation_texts_for(encodings, args)

    def student(encoding: str, seed: int):  # the probe run's, or made there as there
        folder = args.students_dir / f"{encoding}-seed{seed}"
        return make_student(teacher, tokenizer, encoding, seed, args, folder, texts=texts)[0]

    encoders = {method: lambda seed: AutoModel.from_pretrained(pretrained) for method in teacher_methods}
    for encoding in encodings:
        encoders[f"student {encoding}"] = lambda seed, encoding=encoding: student(encoding, seed)
    predicted = {("tf-idf", seed): tfidf_of(data, seed) for seed in seeds}
    settings = {name: getattr(args, name) for name in SETTINGS}
    runs = []
    for method, encoder in encoders.items():
        for seed in seeds:
            kept = out / "runs" / f"{method.replace(' ', '_').replace(',', '')}-seed{seed}.json"
            if not kept.exists():  # a rerun with the same output folder resumes
                guesses, loss, seconds = fine_tuned_predictions(
                    encoder(seed), method, tokens, labels, tokenizer, seed, args, out / "trainer"
                )
                kept.parent.mkdir(exist_ok=True)
                kept.write_text(json.dumps(dict(predicted=guesses, training_loss=loss, seconds=round(seconds, 1),
                                                settings=settings)))  # fmt: skip
            run = json.loads(kept.read_text())
            if run.pop("settings") != settings:
                raise ValueError(f"{kept} was fine-tuned with other settings than this run's {settings}: give "
                                 "another --output_dir, or the same settings to resume")  # fmt: skip
            predicted[method, seed] = run.pop("predicted")
            runs.append(dict(method=method, seed=seed, **run))
            right = sum(g == t for g, t in zip(predicted[method, seed], labels["validation"]))
            print(f"{method}, seed {seed}: {right} of {len(labels['validation'])} right, {run}", flush=True)
    write_csv(out / "training.csv", None, runs)
    print("\n".join(write_report(out, data["validation"], predicted, "fine-tuned with a classification head")))


if __name__ == "__main__":
    main()

"""Loading and checking data for the run scripts: local files (text, csv, json, image folders) or Hub data sets.

Every check runs before training starts and stops with a message that says what is wrong.
"""

from pathlib import Path

from datasets import DatasetDict, load_dataset
from transformers import AutoTokenizer

EXTENSIONS = {".txt": "text", ".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}


def load_files_or_hub(
    dataset_name=None, dataset_config=None, train_file=None, validation_file=None, data_dir=None
) -> DatasetDict:
    """A DatasetDict with "train" and, when given, "validation", from local files or a Hub data set."""
    if dataset_name:
        return load_dataset(dataset_name, dataset_config)
    if data_dir:
        folder = Path(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"--data_dir {data_dir} is not a folder")
        return load_dataset("imagefolder", data_dir=str(folder))
    if not train_file:
        raise ValueError("Give --train_file (and --validation_file), --data_dir or --dataset_name")
    files = {"train": train_file}
    if validation_file:
        files["validation"] = validation_file
    kinds = set()
    for split, path in files.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"--{split}_file {path} does not exist")
        suffix = Path(path).suffix.lower()
        if suffix not in EXTENSIONS:
            raise ValueError(
                f"--{split}_file {path}: unsupported extension {suffix!r}; use one of {', '.join(EXTENSIONS)}"
            )
        kinds.add(EXTENSIONS[suffix])
    if len(kinds) > 1:
        raise ValueError(f"train and validation files must have the same format, got {sorted(kinds)}")
    kind = kinds.pop()
    options = {"delimiter": "\t"} if kind == "csv" and Path(train_file).suffix.lower() == ".tsv" else {}
    try:
        return load_dataset(kind, data_files=files, **options)
    except Exception as error:
        raise ValueError(f"Could not read {', '.join(files.values())} as {kind}: {error}") from None


def check_columns(dataset: DatasetDict, columns: list[str]):
    for split, part in dataset.items():
        missing = [c for c in columns if c not in part.column_names]
        if missing:
            raise ValueError(
                f"The {split} data has no column {', '.join(map(repr, missing))}; its columns are "
                f"{', '.join(part.column_names)}"
            )
        if len(part) == 0:
            raise ValueError(f"The {split} data is empty")


def select_samples(split, max_samples: int | None, shuffle_seed: int | None = None):
    """The first ``max_samples`` examples of ``split`` (after a seeded shuffle if ``shuffle_seed`` is given);
    the whole split when ``max_samples`` is None, and None stays None."""
    if split is None or not max_samples:
        return split
    if shuffle_seed is not None:
        split = split.shuffle(seed=shuffle_seed)
    return split.select(range(min(len(split), max_samples)))


def check_tokenizer_fits(tokenizer, model):
    """Stop before tokenizing where the tokenizer has more tokens than the model's embedding table: it is another
    model's, and its ids past the table would stop training at its first step."""
    vocab_size = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) has more tokens than the model's "
            f"vocabulary ({vocab_size}): it is not the tokenizer the model was trained with. Leave --tokenizer_name "
            "out to take the checkpoint's own, or give the one it was pretrained with"
        )


def load_tokenizer(model_args, needed: list[str], purpose: str):
    """The tokenizer of ``--tokenizer_name``, else of ``--model_name_or_path``, checked for the special tokens
    in ``needed`` (attribute names such as ``"mask_token"``) that ``purpose`` needs."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if not name:
        raise ValueError(
            "Give --tokenizer_name (see python -m lrpe_hf train_tokenizer) or --model_name_or_path (a checkpoint that "
            "has a tokenizer)"
        )
    tokenizer = AutoTokenizer.from_pretrained(name)
    missing = [token for token in needed if getattr(tokenizer, token, None) is None]
    if missing:
        raise ValueError(
            f"The tokenizer has no {', '.join(missing)}, which {purpose} needs; train one with "
            "python -m lrpe_hf train_tokenizer or add the special tokens"
        )
    return tokenizer

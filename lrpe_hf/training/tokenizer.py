"""Train a byte-level BPE tokenizer with `tokenizers` and save it as a Transformers fast tokenizer.

    python -m lrpe_hf train_tokenizer --train_files data/wikipedia_leads/train.txt \
        --vocab_size 8192 --output_dir out/tokenizer

The tokenizer carries the special tokens every family needs: <s> (bos/cls), </s> (eos/sep), <pad>, <unk> and
<mask>; single sentences become "<s> A </s>" and pairs "<s> A </s></s> B </s>" (RoBERTa's layout). A causal LM
wants its prompts open: ``causal_lm_tokenizer`` gives the layout run_clm.py trains with and saves, "<s> A".
"""

import copy
from dataclasses import dataclass, field
from pathlib import Path

from datasets import load_dataset
from tokenizers import ByteLevelBPETokenizer, processors
from transformers import HfArgumentParser, PreTrainedTokenizerFast

SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "cls_token": "<s>",
    "sep_token": "</s>",
}


@dataclass
class TokenizerArguments:
    _argument_group_name = "tokenizer: the text to train on and the vocabulary"

    output_dir: str = field(metadata={"help": "where to save the tokenizer"})
    train_files: list[str] = field(default_factory=list, metadata={"help": "text files, one document per line"})
    dataset_name: str | None = field(default=None, metadata={"help": "a Hub data set (online) instead of files"})
    dataset_config: str | None = field(default=None, metadata={"help": "the Hub data set's configuration"})
    text_column: str = field(default="text", metadata={"help": "the Hub data set's text column"})
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary size, special tokens included"})
    min_frequency: int = field(default=2, metadata={"help": "merges seen fewer times are not learned"})
    model_max_length: int = field(default=512, metadata={"help": "the saved tokenizer's model_max_length"})


def text_iterator(args: TokenizerArguments):
    if args.dataset_name:
        dataset = load_dataset(args.dataset_name, args.dataset_config, split="train")
        if args.text_column not in dataset.column_names:
            raise ValueError(f"The data set has no column {args.text_column!r}; columns: {dataset.column_names}")
        for start in range(0, len(dataset), 1000):
            yield dataset[start : start + 1000][args.text_column]
        return
    if not args.train_files:
        raise ValueError("Give --train_files or --dataset_name")
    for path in args.train_files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--train_files: {path} does not exist")
    for path in args.train_files:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        for start in range(0, len(lines), 1000):
            yield lines[start : start + 1000]


def train_tokenizer(args: TokenizerArguments) -> PreTrainedTokenizerFast:
    if args.vocab_size < 300:
        raise ValueError(f"--vocab_size must be at least 300 (256 bytes plus special tokens), got {args.vocab_size}")
    bpe = ByteLevelBPETokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(
        text_iterator(args), vocab_size=args.vocab_size, min_frequency=args.min_frequency, special_tokens=specials
    )
    bpe.post_processor = processors.RobertaProcessing(
        ("</s>", bpe.token_to_id("</s>")), ("<s>", bpe.token_to_id("<s>"))
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        model_max_length=args.model_max_length,
        model_input_names=["input_ids", "attention_mask"],  # one segment type, as RoBERTa
        **SPECIAL_TOKENS,
    )
    tokenizer.save_pretrained(args.output_dir)
    return tokenizer


def causal_lm_tokenizer(tokenizer):
    """``tokenizer`` laid out for a causal LM: a text becomes "<s> A", with no "</s>" after it, so that a prompt is
    continued, not closed (after "</s>" a language model starts a new document); pairs become "<s> A </s> <s> B",
    as training separates documents. A tokenizer that ends no text with its eos token (GPT-2's) is returned as it
    is; otherwise a copy, whose post-processor is replaced."""
    eos, ids = tokenizer.eos_token_id, tokenizer("a")["input_ids"]
    if eos is None or not ids or ids[-1] != eos or not tokenizer.is_fast:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    specials = [(tokenizer.eos_token, eos)]
    start = ""
    if tokenizer.bos_token_id is not None:
        specials.append((tokenizer.bos_token, tokenizer.bos_token_id))
        start = f"{tokenizer.bos_token} "
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start}$A", pair=f"{start}$A {tokenizer.eos_token} {start}$B:1", special_tokens=specials
    )
    return tokenizer


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser(TokenizerArguments)


def main():
    (args,) = argument_parser().parse_args_into_dataclasses()
    tokenizer = train_tokenizer(args)
    print(f"Saved a {len(tokenizer)}-token byte-level BPE tokenizer to {args.output_dir}")

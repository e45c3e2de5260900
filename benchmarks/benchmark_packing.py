"""Padding-free packing against padded batches: training tokens per second on the embedded Wikipedia leads.

A byte-level BPE tokenizer is trained on the corpus; each lead section is one document, truncated to
``--block-size`` tokens. The same documents, in the same batches, go through a LinearGPT training step
(forward + backward) twice: padded to the longest document of the batch (``DataCollatorForLanguageModeling``)
and flattened into one row (``DataCollatorWithFlattening``, position_ids restarting per document). Real
(non-padding) tokens per second are reported for each, measured alternately in one run.

    python benchmarks/benchmark_packing.py
    python benchmarks/benchmark_packing.py --batch-size 16 --block-size 512 --batches 20
"""

import argparse
import time
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerFast

from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

CORPUS = Path(__file__).resolve().parents[1] / "data" / "wikipedia_leads" / "train.txt"


def documents(block_size: int, count: int):
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:count]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=4096, special_tokens=["<pad>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="</s>")
    encoded = tokenizer(lines, truncation=True, max_length=block_size, return_attention_mask=False)["input_ids"]
    return tokenizer, [{"input_ids": ids} for ids in encoded if len(ids) > 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--encoding", default="lrpe_orthogonal")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer, docs = documents(args.block_size, args.batch_size * args.batches)
    config = LinearGPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        positional_encoding=args.encoding,
        hidden_dropout_prob=0.0,
    )
    model = LinearGPTForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    collators = {
        "padded": DataCollatorForLanguageModeling(tokenizer, mlm=False),
        "flattened": DataCollatorWithFlattening(),
    }
    seconds = dict.fromkeys(collators, 0.0)
    real_tokens = 0
    for start in range(0, len(docs) - args.batch_size + 1, args.batch_size):
        batch_docs = docs[start : start + args.batch_size]
        real_tokens += sum(len(d["input_ids"]) for d in batch_docs)
        for layout, collate in collators.items():  # alternate, so both see the same machine state
            batch = collate(batch_docs)
            begin = time.perf_counter()
            model(**batch).loss.backward()
            optimizer.zero_grad(set_to_none=True)
            seconds[layout] += time.perf_counter() - begin
    lengths = [len(d["input_ids"]) for d in docs]
    print(
        f"{len(docs)} documents, {sum(lengths) / len(lengths):.0f} tokens on average (at most {args.block_size}), "
        f"batches of {args.batch_size}, LinearGPT 4 x 256 with {args.encoding}"
    )
    print("| layout | real tokens/s | time |\n|---|---|---|")
    for layout, total in seconds.items():
        print(f"| {layout} | {real_tokens / total:,.0f} | {total:.1f} s |")
    print(f"flattened / padded throughput: {seconds['padded'] / seconds['flattened']:.2f}x")


if __name__ == "__main__":
    main()

"""Train a byte-level BPE tokenizer with `tokenizers` and save it as a Transformers fast tokenizer.

    python run_scripts/train_tokenizer.py --train_files data/wikipedia_leads/train.txt \
        --vocab_size 8192 --output_dir out/tokenizer

The tokenizer carries the special tokens every family needs: <s> (bos/cls), </s> (eos/sep), <pad>, <unk> and
<mask>; single sentences become "<s> A </s>" and pairs "<s> A </s></s> B </s>" (RoBERTa's layout).
"""

from lrpe_hf.training.tokenizer import main

if __name__ == "__main__":
    main()

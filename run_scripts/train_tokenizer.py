"""Train a byte-level BPE tokenizer with `tokenizers` and save it as a Transformers fast tokenizer.

Examples and options: lrpe_hf/training/tokenizer.py, or ``python run_scripts/train_tokenizer.py --help``.
"""

from lrpe_hf.training.tokenizer import main

if __name__ == "__main__":
    main()

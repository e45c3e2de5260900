"""Turn a pretrained GPT-2, RoBERTa, BERT or ViT checkpoint into a linear-attention model: convert, attention
transfer, fine-tuning.

Examples and options: lrpe_hf/training/linearization.py, or ``python run_scripts/run_linearize.py --help``.
"""

from lrpe_hf.training.linearization import main

if __name__ == "__main__":
    main()

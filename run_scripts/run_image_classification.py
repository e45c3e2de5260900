"""Train or fine-tune LinearViT on an image folder (or a Hub data set, online): top-1 accuracy.

Examples and options: lrpe_hf/training/image_classification.py, or
``python run_scripts/run_image_classification.py --help``.
"""

from lrpe_hf.training.image_classification import main

if __name__ == "__main__":
    main()

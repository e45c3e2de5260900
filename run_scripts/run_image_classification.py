"""Train or fine-tune LinearViT on an image folder (or a Hub data set, online): top-1 accuracy.

    python run_scripts/run_image_classification.py --data_dir data/fashion_mnist --image_size 32 --patch_size 4 \
        --hidden_size 128 --num_hidden_layers 4 --num_attention_heads 4 --intermediate_size 256 \
        --positional_encoding lrpe_orthogonal --output_dir out/fashion --num_train_epochs 5

``--data_dir`` holds ``train/<label>/*.png`` and ``validation/<label>/*.png`` (the ``imagefolder`` layout).
Preprocessing is a Transformers ``ViTImageProcessor`` (resize, rescale, normalise), saved with the model.
"""

from lrpe_hf.training.image_classification import main

if __name__ == "__main__":
    main()

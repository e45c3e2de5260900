"""Pretrain LinearRoberta with masked language modelling (Trainer; every TrainingArguments option works).

    python run_scripts/run_mlm.py --tokenizer_name out/tokenizer --train_file data/wikipedia_leads/train.txt \
        --validation_file data/wikipedia_leads/validation.txt --positional_encoding lrpe_orthogonal \
        --hidden_size 256 --num_hidden_layers 4 --num_attention_heads 4 --intermediate_size 1024 \
        --output_dir out/mlm --max_steps 1000

Start from a checkpoint with --model_name_or_path, or build a new model from --config_file and/or the config
fields on the command line (--positional_encoding, --feature_map, sizes, --config_overrides '{...}').
"""

from lrpe_hf.training.language_modeling import main

if __name__ == "__main__":
    main("mlm")

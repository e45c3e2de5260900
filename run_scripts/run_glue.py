"""Fine-tune a LinearRoberta (or LinearGPT) checkpoint on a GLUE task or on your own csv/json files.

    # the embedded single-sentence task (3 classes)
    python run_scripts/run_glue.py --model_name_or_path out/mlm --train_file data/tweet_sentiment/train.csv \
        --validation_file data/tweet_sentiment/validation.csv --output_dir out/tweets --num_train_epochs 1
    # the embedded sentence-pair task
    python run_scripts/run_glue.py --model_name_or_path out/mlm --train_file data/wikipedia_topic_pairs/train.csv \
        --validation_file data/wikipedia_topic_pairs/validation.csv --output_dir out/pairs
    # a GLUE task (downloads the data set, so online only); the metric is computed locally
    python run_scripts/run_glue.py --model_name_or_path out/mlm --task_name mrpc --output_dir out/mrpc

Local files: one text column (``sentence``, ``text``) or two (``sentence1``/``sentence2``, or name them with
--sentence1_key/--sentence2_key) and a ``label`` column: strings or integers for classification, floats for
regression.
"""

from lrpe_hf.training.glue import main

if __name__ == "__main__":
    main()

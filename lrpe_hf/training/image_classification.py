"""Train or fine-tune LinearViT on an image folder (or a Hub data set, online): top-1 accuracy.

    python -m lrpe_hf run_image_classification --data_dir data/fashion_mnist --image_size 32 --patch_size 4 \
        --hidden_size 128 --num_hidden_layers 4 --num_attention_heads 4 --intermediate_size 256 \
        --positional_encoding lrpe_orthogonal --output_dir out/fashion --num_train_epochs 5

``--data_dir`` holds ``train/<label>/*.png`` and ``validation/<label>/*.png`` (the ``imagefolder`` layout).
Preprocessing is a Transformers ``ViTImageProcessor`` (resize, rescale, normalise), saved with the model.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    TrainingArguments,
    ViTImageProcessorPil,
)
from transformers.utils import is_torchvision_available

from .. import LinearViTConfig, LinearViTForImageClassification
from .arguments import ModelArguments, build_config, parse_script_arguments
from .data import check_columns, load_files_or_hub, select_samples
from .metrics import load_glue_metric
from .trainer import CardTrainer, train_and_evaluate


@dataclass
class ImageDataArguments:
    _argument_group_name = "data: an image folder or a Hub data set, and the image geometry of new models"

    data_dir: str | None = field(default=None, metadata={"help": "an imagefolder tree (train/, validation/)"})
    dataset_name: str | None = field(default=None, metadata={"help": "a Hub data set (online)"})
    dataset_config: str | None = field(default=None, metadata={"help": "the Hub data set's configuration"})
    image_column: str = field(default="image", metadata={"help": "the column holding the images"})
    label_column: str = field(default="label", metadata={"help": "the column holding the class labels"})
    validation_split: float = field(default=0.1, metadata={"help": "held out of train when there is no validation"})
    image_size: int = field(default=224, metadata={"help": "images are resized to this square size (new models)"})
    patch_size: int = field(default=16, metadata={"help": "patch side in pixels (new models)"})
    num_channels: int = field(default=3, metadata={"help": "3 for RGB, 1 for grey-scale (new models)"})
    max_train_samples: int | None = field(default=None, metadata={"help": "a random subset of N training images"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only the first N evaluation images"})


def new_image_processor(**settings):
    """transformers' ViTImageProcessor, or its Pillow backend where torchvision is absent (what transformers falls
    back to, with a warning, when the default one is asked for)."""
    if is_torchvision_available():
        from transformers import ViTImageProcessor

        return ViTImageProcessor(**settings)
    return ViTImageProcessorPil(**settings)


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, ImageDataArguments, TrainingArguments))


def main(args=None):
    return run(*parse_script_arguments(argument_parser(), args))


def run(model_args, data_args, training_args, trainer_class=CardTrainer):
    """Train and evaluate with parsed arguments; ``trainer_class`` builds the trainer (as ``CardTrainer``)."""
    training_args.remove_unused_columns = False  # the transform needs the raw image column
    # the Trainer would count pixels as tokens (an image model has no tokens to count): the card counts images
    training_args.include_num_input_tokens_seen = "no"

    dataset = load_splits(data_args, training_args.seed)
    model, processor = build_model_and_processor(model_args, data_args, label_config(data_args, dataset["train"]))
    train, evaluation = transformed_splits(dataset, data_args, processor, model.config.num_channels, training_args.seed)

    metric = load_glue_metric(None)

    def compute_metrics(prediction):
        return metric.compute(predictions=np.argmax(prediction.predictions, axis=-1), references=prediction.label_ids)

    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
        processing_class=processor,
        compute_metrics=compute_metrics,
        card=model_card(data_args, model.config.image_size, len(train)),
    )
    return train_and_evaluate(trainer)


def load_splits(data_args: ImageDataArguments, seed: int):
    """The data set with its image and label columns checked, and a validation split (``validation_split`` of the
    training images, drawn with ``seed``) where it has none."""
    dataset = load_files_or_hub(data_args.dataset_name, data_args.dataset_config, data_dir=data_args.data_dir)
    check_columns(dataset, [data_args.image_column, data_args.label_column])
    if "validation" not in dataset and data_args.validation_split > 0:
        split = dataset["train"].train_test_split(data_args.validation_split, seed=seed)
        dataset["train"], dataset["validation"] = split["train"], split["test"]
    return dataset


def label_config(data_args: ImageDataArguments, train) -> dict:
    """The config fields of the class labels (``num_labels``, ``id2label``, ``label2id``), read from the label
    column's ClassLabel feature."""
    label_feature = train.features[data_args.label_column]
    if not hasattr(label_feature, "names"):
        raise ValueError(
            f"The label column {data_args.label_column!r} must hold class labels (an imagefolder's "
            "sub-folder names, or a ClassLabel feature)"
        )
    labels = label_feature.names
    return dict(
        num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)}
    )


def build_model_and_processor(model_args, data_args: ImageDataArguments, label_fields: dict):
    """The image classifier and its image processor: the checkpoint's (its head resized to the labels), or a new
    LinearViT of the data arguments' geometry with a ViTImageProcessor."""
    if model_args.model_name_or_path:
        model = AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path,
            trust_remote_code=model_args.trust_remote_code,
            ignore_mismatched_sizes=True,
            **label_fields,
        )
        return model, AutoImageProcessor.from_pretrained(model_args.model_name_or_path)
    config = build_config(
        model_args,
        LinearViTConfig,
        image_size=data_args.image_size,
        patch_size=data_args.patch_size,
        num_channels=data_args.num_channels,
        **label_fields,
    )
    model = LinearViTForImageClassification(config)
    processor = new_image_processor(
        size={"height": config.image_size, "width": config.image_size},
        image_mean=[0.5] * config.num_channels,
        image_std=[0.5] * config.num_channels,
        do_convert_rgb=config.num_channels == 3,  # called directly (not only here), grey images become RGB
    )
    return model, processor


def transformed_splits(dataset, data_args: ImageDataArguments, processor, num_channels: int, seed: int):
    """The training and evaluation splits (the evaluation one None where there is none), cut to the sample limits
    and turning their images into ``pixel_values`` (RGB, or grey for one channel) and ``labels`` as read."""
    mode = "RGB" if num_channels == 3 else "L"

    def transform(batch):
        images = [image.convert(mode) for image in batch[data_args.image_column]]
        pixels = processor(images, return_tensors="pt", input_data_format="channels_last" if mode == "RGB" else None)
        return {"pixel_values": pixels["pixel_values"], "labels": batch[data_args.label_column]}

    # imagefolder lists the classes one after another: shuffle before taking a training subset
    train = select_samples(dataset["train"], data_args.max_train_samples, shuffle_seed=seed)
    evaluation = select_samples(dataset.get("validation"), data_args.max_eval_samples)
    train = train.with_transform(transform)
    evaluation = evaluation.with_transform(transform) if evaluation is not None else None
    return train, evaluation


def collate(examples):
    """A batch of transformed examples: their ``pixel_values`` stacked and their ``labels`` as a tensor."""
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        "labels": torch.tensor([e["labels"] for e in examples]),
    }


def model_card(data_args: ImageDataArguments, image_size: int, images: int) -> dict:
    """The model card's fields: the task, the auto class, the data set, the image size and the training images."""
    source = data_args.dataset_name or data_args.data_dir
    return dict(
        task_description=f"trained for image classification on {source}",
        auto_class="AutoModelForImageClassification",
        pipeline_tag="image-classification",
        datasets=[data_args.dataset_name] if data_args.dataset_name else [],
        data_description=f"{image_size}x{image_size} images; top-1 accuracy on the validation split.",
        examples=("images", images),
    )

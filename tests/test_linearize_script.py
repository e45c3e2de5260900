"""run_linearize end to end: tiny GPT-2, RoBERTa and ViT teachers built here, converted, attention transfer, then
fine-tuning (in full or with LoRA) through the task's pipeline."""

import json

import pytest
import torch
from conftest import QUIET, ROOT
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

import lrpe_hf
from lrpe_hf.training import linearization
from lrpe_hf.training.language_modeling import main as run_language_modeling

pytestmark = pytest.mark.slow  # each test trains small models through the script

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def gpt2_teacher(workspace):
    """A random GPT-2 with the workspace's tokenizer, saved as a checkpoint folder (as a Hub model would be)."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    init = workspace / "linearize_gpt2_init"
    GPT2LMHeadModel(config).save_pretrained(init)
    tokenizer.save_pretrained(init)
    folder = workspace / "linearize_gpt2_teacher"  # trained a little with run_clm, as the softmax teachers are
    arguments = ["--model_name_or_path", str(init), "--train_file", str(workspace / "train.txt"), "--block_size", "32"]
    run_language_modeling("clm", [*arguments, "--max_steps", "2", "--output_dir", str(folder), *QUIET])
    assert "gpt2" in (folder / "README.md").read_text()  # Transformers' own card for a model of theirs
    return folder


def text_arguments(workspace, teacher, out, *extra):
    return [
        "--model_name_or_path",
        str(teacher),
        "--train_file",
        str(workspace / "train.txt"),
        "--validation_file",
        str(workspace / "validation.txt"),
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--max_eval_samples",
        "8",
        "--output_dir",
        str(out),
        *QUIET,
        *extra,
    ]


def test_gpt2_three_stages(workspace, gpt2_teacher):
    """The default student (lrpe_orthogonal) with hedgehog: attention transfer trains only the feature maps and
    encodings and lowers the transfer loss on held-out blocks; fine-tuning gives a LinearGPT that generates."""
    out = workspace / "linearize_gpt2"
    arguments = ["--feature_map", "hedgehog", "--transfer_steps", "8", "--max_steps", "2"]
    results = linearization.main(text_arguments(workspace, gpt2_teacher, out, *arguments))
    assert set(results) == {"attention_transfer", "finetune"}
    assert (
        "eval_transfer_loss" in results["attention_transfer"] and "eval_perplexity" not in results["attention_transfer"]
    )
    assert results["finetune"]["eval_perplexity"] > 1
    summary = json.loads((out / "linearize_results.json").read_text())
    assert summary["task"] == "clm" and summary["student"]["positional_encoding"] == "lrpe_orthogonal"
    for stage in ("attention_transfer", "finetune"):
        assert (out / stage / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "linear_gpt" in (out / stage / "README.md").read_text()
    assert "attention transfer (output_mse" in (out / "attention_transfer" / "README.md").read_text()

    converted = lrpe_hf.LinearGPTForCausalLM.from_pretrained(out / "linearized")
    transferred = lrpe_hf.LinearGPTForCausalLM.from_pretrained(out / "attention_transfer")
    for name, before in converted.named_parameters():
        after = transferred.get_parameter(name)
        if ".feature_map." in name:
            assert not torch.equal(before, after), f"{name} did not train"
        elif ".positional_encoding." not in name:
            assert torch.equal(before, after), f"{name} moved in attention transfer"

    teacher = GPT2LMHeadModel.from_pretrained(gpt2_teacher)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_teacher)
    text = (workspace / "validation.txt").read_text().split("\n")[:20]
    ids = torch.tensor(tokenizer(" ".join(text))["input_ids"][: 4 * 32]).view(4, 32)
    with torch.no_grad():
        hidden_states = teacher(ids, output_hidden_states=True).hidden_states
        losses = [lrpe_hf.attention_transfer_loss(m, hidden_states).item() for m in (converted, transferred)]
    assert losses[1] < losses[0]

    student = AutoModelForCausalLM.from_pretrained(out / "finetune")
    assert student.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).shape == (1, 8)


def test_roberta_to_sentence_classification_with_lora(workspace):
    """A masked-LM teacher fine-tuned for classification: the classifier is new, the encoder is converted, stage 3
    trains LoRA adapters and writes the merged model; attention_ce is the Hedgehog loss (permute keeps
    non-negative weights); the teacher's 66-row table is stretched to 130 rows."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        max_position_embeddings=66,
        pad_token_id=tokenizer.pad_token_id,
        **SMALL,
    )
    teacher = workspace / "linearize_roberta_teacher"
    RobertaForMaskedLM(config).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    out = workspace / "linearize_roberta"
    data = ROOT / "data/tweet_sentiment"
    results = linearization.main(
        [
            "--model_name_or_path",
            str(teacher),
            "--task",
            "classification",
            "--positional_encoding",
            "permute",
            "--feature_map",
            "hedgehog",
            "--transfer_loss",
            "attention_ce",
            "--train_file",
            str(data / "train.csv"),
            "--validation_file",
            str(data / "validation.csv"),
            "--max_seq_length",
            "32",
            "--max_train_samples",
            "32",
            "--max_eval_samples",
            "16",
            "--per_device_train_batch_size",
            "8",
            "--transfer_steps",
            "2",
            "--max_steps",
            "2",
            "--lora_r",
            "2",
            "--max_position_embeddings",
            "130",
            "--table_extension",
            "interpolate",
            "--output_dir",
            str(out),
            *QUIET,
        ]
    )
    assert 0 <= results["finetune"]["eval_accuracy"] <= 1
    assert (out / "finetune" / "adapter_config.json").exists()
    merged = json.loads((out / "finetune" / "merged" / "config.json").read_text())
    assert merged["architectures"] == ["LinearRobertaForSequenceClassification"]
    assert merged["positional_encoding"] == "permute" and merged["feature_map"] == "hedgehog"
    assert merged["max_position_embeddings"] == 130


def test_vit_to_linear_vit_with_a_2d_encoding(workspace):
    """ViT on the embedded Fashion-MNIST images, with the 2D orthogonal LRPE: the patches' (row, col) positions
    reach attention transfer."""
    torch.manual_seed(0)
    labels = load_dataset("imagefolder", data_dir=str(ROOT / "data/fashion_mnist"))["train"].features["label"].names
    config = ViTConfig(
        image_size=28,
        patch_size=7,
        num_channels=1,
        hidden_size=32,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        **SMALL,
    )
    teacher = workspace / "linearize_vit_teacher"
    ViTForImageClassification(config).save_pretrained(teacher)
    ViTImageProcessor(size={"height": 28, "width": 28}, image_mean=[0.5], image_std=[0.5]).save_pretrained(teacher)
    out = workspace / "linearize_vit"
    arguments = ["--model_name_or_path", str(teacher), "--data_dir", str(ROOT / "data/fashion_mnist")]
    arguments += ["--max_train_samples", "32", "--max_eval_samples", "16", "--per_device_train_batch_size", "8"]
    arguments += ["--transfer_steps", "3", "--max_steps", "2", "--output_dir", str(out), *QUIET]
    results = linearization.main(arguments)
    assert results["attention_transfer"]["eval_transfer_loss"] > 0
    assert 0 <= results["finetune"]["eval_accuracy"] <= 1
    student = AutoModelForImageClassification.from_pretrained(out / "finetune")
    assert student.config.positional_encoding == "lrpe_orthogonal" and student.config.position_dims == 2


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["--stages", "attention_transfer,distil"], "valid values: attention_transfer, finetune"),
        (["--transfer_loss", "kl"], "valid values: output_mse, attention_ce"),
        (["--task", "speech"], "valid values: clm, mlm, classification, image"),
        (["--table_extension", "wrap"], "valid values: copy, interpolate"),
    ],
)
def test_bad_arguments_are_named(workspace, gpt2_teacher, arguments, message):
    with pytest.raises(ValueError, match=message):
        linearization.main(text_arguments(workspace, gpt2_teacher, workspace / "linearize_bad", *arguments))


def test_the_teacher_is_required_and_must_be_supported(workspace):
    with pytest.raises(ValueError, match="--model_name_or_path"):
        linearization.main(["--train_file", str(workspace / "train.txt"), "--output_dir", str(workspace / "x")])
    other = workspace / "linearize_opt_teacher"
    OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=4, ffn_dim=32)).save_pretrained(
        other
    )
    with pytest.raises(ValueError, match="cannot be linearized; supported architectures: GPT2Model"):
        linearization.main(text_arguments(workspace, other, workspace / "linearize_bad"))

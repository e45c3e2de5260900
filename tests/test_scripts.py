"""The run scripts end to end on small slices of the embedded data: outputs, cards, errors, resume, 2 processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import QUIET, ROOT, TINY, copy_into_hub_cache
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, pipeline

from lrpe_hf.training import glue as run_glue
from lrpe_hf.training import image_classification as run_image_classification
from lrpe_hf.training.language_modeling import main as run_language_modeling

pytestmark = pytest.mark.slow  # each test trains a small model through a run script


def test_tokenizer_has_the_special_tokens_each_family_needs(workspace):
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "cls_token", "sep_token"):
        assert getattr(tokenizer, name) is not None, name
    encoded = tokenizer("a cat", "a dog")["input_ids"]
    assert encoded[0] == tokenizer.cls_token_id and encoded[-1] == tokenizer.sep_token_id
    assert tokenizer.decode(tokenizer("the cat sat")["input_ids"], skip_special_tokens=True) == "the cat sat"


@pytest.fixture(scope="module")
def mlm_checkpoint(workspace):
    out = workspace / "mlm"
    run_language_modeling(
        "mlm",
        [
            "--tokenizer_name",
            str(workspace / "tokenizer"),
            "--train_file",
            str(workspace / "train.txt"),
            "--validation_file",
            str(workspace / "validation.txt"),
            "--positional_encoding",
            "lrpe_orthogonal",
            *TINY,
            "--block_size",
            "64",
            "--max_steps",
            "6",
            "--per_device_train_batch_size",
            "4",
            "--logging_steps",
            "2",
            "--output_dir",
            str(out),
            *QUIET,
        ],
    )
    return out


def test_mlm_pretraining_writes_model_card_metrics_and_plot(mlm_checkpoint):
    results = json.loads((mlm_checkpoint / "eval_results.json").read_text())
    assert results["eval_perplexity"] > 1 and "eval_loss" in results
    assert (mlm_checkpoint / "loss_curves.png").stat().st_size > 1000
    card = (mlm_checkpoint / "README.md").read_text()
    header = card.split("---")[1]
    for field in ("license:", "library_name: transformers", "lrpe-hf", "pipeline_tag: fill-mask"):
        assert field in header, field
    assert "`lrpe_orthogonal`" in card and "trust_remote_code=True" in card and "eval_perplexity" in card
    assert f'pipeline("fill-mask", model="{mlm_checkpoint}"' in card  # not pushed: the folder's path, not a Hub id
    assert (mlm_checkpoint / "linear_attention.py").exists()  # the checkpoint carries its code
    model = AutoModelForMaskedLM.from_pretrained(mlm_checkpoint)
    assert model.config.positional_encoding == "lrpe_orthogonal"


def test_mlm_without_validation_data_writes_a_card_without_evaluations_or_plot(workspace):
    """As README runs it: no --validation_file, fewer steps than --logging_steps. Nothing to evaluate or plot, so no
    eval_results.json and no loss_curves.png, and the card links no image (it linked a missing one before)."""
    out = workspace / "mlm_no_validation"
    run_language_modeling(
        "mlm",
        [
            "--tokenizer_name", str(workspace / "tokenizer"), "--train_file", str(workspace / "train.txt"), *TINY,
            "--block_size", "64", "--max_steps", "2", "--per_device_train_batch_size", "4", "--output_dir", str(out),
            *QUIET,
        ],
    )  # fmt: skip
    assert not (out / "eval_results.json").exists() and not (out / "loss_curves.png").exists()
    card = (out / "README.md").read_text()
    assert "No evaluation was run." in card and "loss_curves.png" not in card and "![" not in card


def test_clm_training(workspace):
    out = workspace / "clm"
    metrics = run_language_modeling(
        "clm",
        [
            "--tokenizer_name",
            str(workspace / "tokenizer"),
            "--train_file",
            str(workspace / "train.txt"),
            "--validation_file",
            str(workspace / "validation.txt"),
            "--positional_encoding",
            "permute",
            "--feature_map",
            "relu",
            *TINY,
            "--block_size",
            "64",
            "--max_steps",
            "4",
            "--logging_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--output_dir",
            str(out),
            *QUIET,
        ],
    )
    assert metrics["eval_loss"] > 0
    check_card_against_trainer_state(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    generated = model.generate(**tokenizer("The", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert generated.shape[1] >= 2
    assert tokenizer.padding_side == "left"  # batched prompts end with their last token, where generate continues
    batch = tokenizer(["The", "The river flows"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, -1] == 1 and batch["attention_mask"][0, 0] == 0


CARD_SNIPPET = """
import sys
sys.modules["lrpe_hf"] = None  # as on a machine with transformers and torch only
sys.argv = sys.argv[:1]
"""


def card_snippet(out: Path) -> str:
    """The python block of the checkpoint's model card, which reads the checkpoint by the folder's path as given."""
    card = (out / "README.md").read_text()
    code = card.split("```python\n")[1].split("```")[0]
    assert f'.from_pretrained("{out}"' in code or f'model="{out}"' in code
    return CARD_SNIPPET + code


def test_a_briefly_trained_causal_lm_continues_its_prompt(workspace):
    """run_clm.py saves the causal layout: a prompt is "<s> The", not "<s> The </s>" (after which a language model
    starts a new document), so the text-generation pipeline and the model card's snippet continue the prompt.
    Training still separates documents with </s>: the model learns that <s> follows </s>."""
    out = workspace / "clm_prompt"
    run_language_modeling(
        "clm",
        [
            "--tokenizer_name", str(workspace / "tokenizer"), "--train_file", str(workspace / "train.txt"), *TINY,
            "--block_size", "64", "--max_steps", "300", "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
            "--do_train", "--output_dir", str(out), *QUIET,
        ],
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tokenizer("The", return_tensors="pt")
    assert prompt["input_ids"][0, 0] == tokenizer.bos_token_id and prompt["input_ids"][0, -1] != tokenizer.eos_token_id
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    with torch.no_grad():
        open_prompt = model(**prompt).logits[0, -1].softmax(-1)
        closed = torch.cat([prompt["input_ids"], torch.tensor([[tokenizer.eos_token_id]])], dim=1)
        closed_prompt = model(closed).logits[0, -1].softmax(-1)
    assert closed_prompt[tokenizer.bos_token_id] > 0.25  # what a prompt ending with </s> did: a new document (0.52)
    assert open_prompt[specials].sum() < 0.05  # (0.017)
    generated = pipeline("text-generation", model=str(out))("The", max_new_tokens=10, do_sample=False)[0]
    assert generated["generated_text"].startswith("The") and len(generated["generated_text"]) > len("The ")
    result = subprocess.run(
        [sys.executable, "-c", card_snippet(out)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.strip().splitlines()[-1]
    assert printed.startswith("The") and len(printed) > len("The ") and "<s>" not in printed


def check_card_against_trainer_state(out: Path):
    """Every figure the card states about the training equals the Trainer's own record."""
    card = (out / "README.md").read_text()
    state = json.loads((out / "trainer_state.json").read_text())
    summary = next(entry for entry in state["log_history"] if "train_loss" in entry)
    assert f"Trained for {state['global_step']} steps ({state['epoch']:.4g} epochs" in card
    assert f"{state['num_input_tokens_seen']:,} tokens seen" in card and state["num_input_tokens_seen"] > 0
    assert f"in {summary['train_runtime']:.1f} s on CPU" in card
    last = [entry for entry in state["log_history"] if "loss" in entry][-1]
    assert f"the last logged training loss {last['loss']:.4f} (step {last['step']})" in card
    assert f"the training loss averaged over the run {summary['train_loss']:.4f}" in card
    evaluations = [entry for entry in state["log_history"] if "eval_loss" in entry]
    table = card.split("### Evaluations")[1].split("![")[0]
    assert table.count("\n|") == 2 + len(evaluations)  # header, rule and one row per evaluation
    for entry in evaluations:
        assert f"{entry['eval_loss']:.4f}" in table
    for line in ("- learning_rate:", "- train_batch_size:", "- seed: 0", "- lr_scheduler_type:", "- transformers "):
        assert line in card, line
    assert "![Training and evaluation loss](loss_curves.png)" in card and (out / "loss_curves.png").exists()
    assert "epochs at learning rate" not in card  # no figure taken from the arguments instead of the run


@pytest.mark.parametrize("kind", ["clm", "mlm"])
def test_padding_free_document_layouts(workspace, kind):
    """--document_layout flattened packs each batch's documents into one row; evaluation on the same documents
    equals the padded layout's, since a packed row equals its documents run alone."""
    losses = {}
    for layout in ("padded", "flattened"):
        out = workspace / f"{kind}-{layout}"
        arguments = ["--tokenizer_name", str(workspace / "tokenizer"), "--train_file", str(workspace / "train.txt")]
        arguments += ["--validation_file", str(workspace / "validation.txt"), "--positional_encoding", "fastrpb"]
        arguments += [*TINY, "--block_size", "48", "--document_layout", layout, "--max_steps", "2"]
        arguments += ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4"]
        arguments += ["--max_eval_samples", "12", "--output_dir", str(out), "--learning_rate", "0", *QUIET]
        losses[layout] = run_language_modeling(kind, arguments)["eval_loss"]
        assert (out / "eval_results.json").exists() and (out / "README.md").exists()
    if kind == "clm":  # (masked LM draws its masks at random: its two losses differ by the draw)
        assert losses["flattened"] == pytest.approx(losses["padded"], rel=1e-4)


@pytest.mark.parametrize("task", ["tweet_sentiment", "wikipedia_topic_pairs"])
def test_glue_style_fine_tuning_on_embedded_tasks(mlm_checkpoint, workspace, task, monkeypatch):
    """Fine-tunes on the first 64 training and 32 validation rows, tokenizing only those (as Transformers' examples)."""
    out = workspace / task
    tokenized = {}
    encode = run_glue.encode

    def recording_encode(dataset, *args):
        tokenized.update({name: len(split) for name, split in dataset.items()})
        return encode(dataset, *args)

    monkeypatch.setattr(run_glue, "encode", recording_encode)
    metrics = run_glue.main(
        [
            "--model_name_or_path",
            str(mlm_checkpoint),
            "--train_file",
            str(ROOT / f"data/{task}/train.csv"),
            "--validation_file",
            str(ROOT / f"data/{task}/validation.csv"),
            "--max_train_samples",
            "64",
            "--max_eval_samples",
            "32",
            "--max_seq_length",
            "48",
            "--max_steps",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--output_dir",
            str(out),
            *QUIET,
        ]
    )
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and "eval_f1_macro" in metrics
    assert tokenized == {"train": 64, "validation": 32}
    config = json.loads((out / "config.json").read_text())
    expected = {"tweet_sentiment": {"negative", "neutral", "positive"}, "wikipedia_topic_pairs": {"0", "1"}}[task]
    assert set(config["id2label"].values()) == expected
    assert "pipeline_tag: text-classification" in (out / "README.md").read_text()


def save_with_a_bert_tokenizer(folder, model_class, **fields):
    """A random 2 x 32 sequence classifier (BERT, or a LinearRoberta) saved beside a WordPiece BERT tokenizer trained
    on the Wikipedia leads, which gives a pair's second sentence token type 1."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train(
        [str(ROOT / "data/wikipedia_leads/train.txt")], vocab_size=500,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False,
    )  # fmt: skip
    tokenizer = BertTokenizerFast(tokenizer_object=wordpiece)
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=2)
    model_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **sizes, **fields).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_a_linearized_bert_fine_tunes_on_sentence_pairs(workspace):
    """run_glue on the embedded pair task with a BERT converted by linearize (its tokenizer gives token types 0 and
    1): the segment embeddings carry over and it trains; a model without them stops before training, naming why."""
    from transformers import BertConfig, BertForSequenceClassification

    import lrpe_hf

    def make_bert(**config):
        return BertForSequenceClassification(BertConfig(**config))

    def make_linear(**config):
        return lrpe_hf.LinearRobertaForSequenceClassification(lrpe_hf.LinearRobertaConfig(**config))

    bert = save_with_a_bert_tokenizer(workspace / "bert-pairs", make_bert)
    linear = workspace / "bert-pairs-linear"
    lrpe_hf.linearize(str(bert)).save_pretrained(linear)
    AutoTokenizer.from_pretrained(bert).save_pretrained(linear)
    arguments = [
        "--train_file", str(ROOT / "data/wikipedia_topic_pairs/train.csv"),
        "--validation_file", str(ROOT / "data/wikipedia_topic_pairs/validation.csv"),
        "--max_train_samples", "32", "--max_eval_samples", "16", "--max_seq_length", "48", "--max_steps", "2",
        "--per_device_train_batch_size", "8", *QUIET,
    ]  # fmt: skip
    out = workspace / "bert-pairs-out"
    metrics = run_glue.main(["--model_name_or_path", str(linear), "--output_dir", str(out), *arguments])
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert json.loads((out / "config.json").read_text())["type_vocab_size"] == 2
    one_segment = save_with_a_bert_tokenizer(workspace / "one-segment", make_linear)
    with pytest.raises(ValueError, match="token_type_ids up to 1, and the model has type_vocab_size=1"):
        run_glue.main(["--model_name_or_path", str(one_segment), "--output_dir", str(workspace / "x"), *arguments])


def test_regression_labels(mlm_checkpoint, workspace):
    rows = ["sentence1,sentence2,label"] + [f"a cat {i},a dog {i},{i / 10}" for i in range(20)]
    (workspace / "regression.csv").write_text("\n".join(rows) + "\n")
    metrics = run_glue.main(
        [
            "--model_name_or_path",
            str(mlm_checkpoint),
            "--train_file",
            str(workspace / "regression.csv"),
            "--validation_file",
            str(workspace / "regression.csv"),
            "--max_steps",
            "2",
            "--output_dir",
            str(workspace / "regression"),
            *QUIET,
        ]
    )
    assert "eval_pearson" in metrics and "eval_spearmanr" in metrics


def test_image_classification_on_fashion_mnist(workspace):
    out = workspace / "fashion"
    metrics = run_image_classification.main(
        [
            "--data_dir",
            str(ROOT / "data/fashion_mnist"),
            "--image_size",
            "28",
            "--patch_size",
            "7",
            "--positional_encoding",
            "permute",
            *TINY,
            "--max_train_samples",
            "64",
            "--max_eval_samples",
            "40",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "16",
            "--output_dir",
            str(out),
            *QUIET,
        ]
    )
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert json.loads((out / "preprocessor_config.json").read_text())["image_processor_type"].startswith(
        "ViTImageProcessor"
    )
    config = json.loads((out / "config.json").read_text())
    assert "ankle_boot" in config["id2label"].values()
    # images counted as images: 3 steps of 16 from 64 (the Trainer alone counted each image's 784 pixels as tokens)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["num_input_tokens_seen"] == 0
    assert "about 48 images seen (64 an epoch)" in (out / "README.md").read_text()
    # the saved processor, called directly as a user would, reads the dataset's grey images for this RGB model
    import transformers
    from PIL import Image

    saved_type = json.loads((out / "preprocessor_config.json").read_text())["image_processor_type"]
    processor = getattr(transformers, saved_type).from_pretrained(out)  # older releases' Auto class needs torchvision
    grey = Image.open(next((ROOT / "data/fashion_mnist/validation/bag").iterdir()))
    assert grey.mode == "L"
    pixels = processor(grey, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 28, 28)
    assert torch.equal(pixels, processor(grey.convert("RGB"), return_tensors="pt")["pixel_values"])


def test_a_grey_scale_models_card_snippet_classifies_an_image(workspace):
    """The pipeline converts images to RGB, which a one-channel model cannot read: its card calls the image
    processor on the grey image, and the snippet runs as written (remote code, without lrpe_hf) and prints a
    label."""
    out = workspace / "fashion_grey"
    run_image_classification.main(
        [
            "--data_dir", str(ROOT / "data/fashion_mnist"), "--image_size", "28", "--patch_size", "7",
            "--num_channels", "1", *TINY, "--max_train_samples", "32", "--max_eval_samples", "16", "--max_steps", "2",
            "--per_device_train_batch_size", "16", "--output_dir", str(out), *QUIET,
        ]
    )  # fmt: skip
    image = next((ROOT / "data/fashion_mnist/validation").glob("*/*.png"))
    shutil.copy(image, workspace / "image.png")
    result = subprocess.run(
        [sys.executable, "-c", card_snippet(out)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, cwd=workspace,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    labels = json.loads((out / "config.json").read_text())["id2label"].values()
    assert result.stdout.strip().splitlines()[-1] in labels


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["--train_file", "missing.txt"], "does not exist"),
        (["--train_file", "{corpus}", "--positional_encoding", "alibi"], "valid values"),
        (["--train_file", "{corpus}", "--text_column", "body"], "no column 'body'"),
        (["--train_file", "{pairs}"], "no column 'text'"),
    ],
)
def test_bad_inputs_stop_before_training(workspace, arguments, message):
    arguments = [
        a.format(corpus=workspace / "train.txt", pairs=ROOT / "data/wikipedia_topic_pairs/train.csv") for a in arguments
    ]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run_language_modeling(
            "clm",
            [
                "--tokenizer_name",
                str(workspace / "tokenizer"),
                *TINY,
                *arguments,
                "--output_dir",
                str(workspace / "bad"),
                *QUIET,
            ],
        )
    assert not (workspace / "bad" / "model.safetensors").exists()


def test_bad_labels_and_tokenizers(workspace, mlm_checkpoint):
    with pytest.raises(ValueError, match="no column 'stars'"):
        run_glue.main(
            [
                "--model_name_or_path",
                str(mlm_checkpoint),
                "--train_file",
                str(ROOT / "data/tweet_sentiment/train.csv"),
                "--label_column",
                "stars",
                "--output_dir",
                str(workspace / "bad"),
                *QUIET,
            ]
        )
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    tokenizer.mask_token = None
    tokenizer.save_pretrained(workspace / "no_mask")
    with pytest.raises(ValueError, match="no mask_token"):
        run_language_modeling(
            "mlm",
            [
                "--tokenizer_name",
                str(workspace / "no_mask"),
                "--train_file",
                str(workspace / "train.txt"),
                *TINY,
                "--output_dir",
                str(workspace / "bad"),
                *QUIET,
            ],
        )


def clm_command(workspace, out, steps):
    return [
        sys.executable,
        str(ROOT / "run_scripts/run_clm.py"),
        "--tokenizer_name",
        str(workspace / "tokenizer"),
        "--train_file",
        str(workspace / "train.txt"),
        "--positional_encoding",
        "spe_sine",
        *TINY,
        "--block_size",
        "64",
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "4",
        "--save_steps",
        "2",
        "--save_strategy",
        "steps",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--seed",
        "0",
        "--output_dir",
        str(out),
    ]


def complete_json(path) -> bool:
    """Whether ``path`` holds a whole JSON document: a file being written exists half-written, and a run killed then
    leaves a checkpoint that cannot be resumed (what this test means to kill is a run between two checkpoints)."""
    try:
        json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return True


def test_killed_run_resumes_to_the_same_weights(workspace):
    """SIGKILL mid-way, resume from the last checkpoint: the same final weights as an uninterrupted run
    (dropout and SPE's random draws included, through the checkpointed RNG states)."""
    whole, interrupted = workspace / "whole", workspace / "interrupted"
    subprocess.run(clm_command(workspace, whole, 8), check=True, capture_output=True)
    process = subprocess.Popen(
        clm_command(workspace, interrupted, 8), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not complete_json(interrupted / "checkpoint-4" / "trainer_state.json"):  # the checkpoint's last file
        assert time.time() < deadline and process.poll() is None, "the run ended before its fourth step"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    for later in interrupted.glob("checkpoint-*"):
        if later.name not in ("checkpoint-2", "checkpoint-4"):
            shutil.rmtree(later)  # keep only what a kill at step 4 would leave
    subprocess.run(
        clm_command(workspace, interrupted, 8) + ["--resume_from_checkpoint", str(interrupted / "checkpoint-4")],
        check=True,
        capture_output=True,
    )
    expected, resumed = load_file(whole / "model.safetensors"), load_file(interrupted / "model.safetensors")
    assert expected.keys() == resumed.keys()
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], msg=name)


def test_accelerate_launch_with_two_processes(workspace):
    out = workspace / "two_processes"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "2",
        "--multi_gpu",  # torchrun's launcher: with --cpu instead, accelerate 1.15 starts one process
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "run_scripts/run_clm.py"),
        "--tokenizer_name",
        str(workspace / "tokenizer"),
        "--train_file",
        str(workspace / "train.txt"),
        "--positional_encoding",
        "lrpe_orthogonal",
        *TINY,
        "--block_size",
        "64",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        str(out),
        "--use_cpu",
        *QUIET,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert state["num_input_tokens_seen"] == 3 * 2 * 2 * 64  # steps x processes x per-device rows x tokens
    assert (out / "model.safetensors").exists()


class HubStandIn:
    """What a Hub endpoint does with ``--push_to_hub``: keep the uploaded folder as the repo's main revision,
    laid out as the Hub cache (models--org--name/refs/main, snapshots/<revision>/), so that a fresh process can
    download it offline."""

    def __init__(self, cache: Path):
        self.cache = cache

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        copy_into_hub_cache(Path(folder_path), self.cache, repo_id, ignore_patterns)
        return f"https://hub.invalid/{repo_id}"


# A user with torch and transformers alone: neither lrpe-hf nor fla-core imports in this process.
WITHOUT_OPTIONAL_PACKAGES = 'import sys\nsys.modules["lrpe_hf"] = sys.modules["fla"] = None\n'


def test_push_to_hub_then_load_by_name_in_a_fresh_process(mlm_checkpoint, workspace, monkeypatch):
    import transformers.trainer

    cache = workspace / "hf_home"
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: HubStandIn(cache))
    run_glue.main(
        [
            "--model_name_or_path",
            str(mlm_checkpoint),
            "--train_file",
            str(ROOT / "data/tweet_sentiment/train.csv"),
            "--validation_file",
            str(ROOT / "data/tweet_sentiment/validation.csv"),
            "--max_train_samples",
            "32",
            "--max_eval_samples",
            "16",
            "--max_steps",
            "2",
            "--output_dir",
            str(workspace / "pushed"),
            "--push_to_hub",
            "--hub_model_id",
            "org/tweets",
            "--hub_strategy",
            "end",
            *QUIET,
        ]
    )
    snapshot = next((cache / "hub" / "models--org--tweets" / "snapshots").iterdir())
    pushed = {p.name for p in snapshot.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "linear_attention.py",
        "modeling_linear_roberta.py",
    } <= pushed
    card = (snapshot / "README.md").read_text()
    assert "org/tweets" in card and "eval_accuracy" in card
    snippet = card.split("```python\n")[1].split("```")[0]  # the card's own usage snippet, as a reader copies it
    env = {"HF_HOME": str(cache), "HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", "")}
    command = [sys.executable, "-c", WITHOUT_OPTIONAL_PACKAGES + snippet]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workspace, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    (prediction,) = eval(result.stdout.strip().splitlines()[-1])  # the pipeline's list, as the snippet prints it
    assert prediction["label"] in ("negative", "neutral", "positive") and 0 <= prediction["score"] <= 1


def test_run_glue_refuses_another_models_tokenizer_before_tokenizing(workspace, mlm_checkpoint, tmp_path, monkeypatch):
    """A tokenizer with more tokens than the checkpoint's vocabulary (another model's) stops run_glue before it
    tokenizes anything, naming both sizes (it crashed at the first training step before)."""
    from lrpe_hf.training import tokenizer as train_tokenizer

    args = train_tokenizer.TokenizerArguments(
        output_dir=str(tmp_path / "bigger"), train_files=[str(workspace / "train.txt")], vocab_size=900
    )
    train_tokenizer.train_tokenizer(args)
    monkeypatch.setattr(run_glue, "select_samples", lambda *args: pytest.fail("tokenized before the check"))
    with pytest.raises(
        ValueError,
        match=r", 900 tokens\) has more tokens than the model.s vocabulary \(600\)",
    ):
        run_glue.main(
            [
                "--model_name_or_path", str(mlm_checkpoint), "--tokenizer_name", str(tmp_path / "bigger"),
                "--train_file", str(ROOT / "data/tweet_sentiment/train.csv"),
                "--validation_file", str(ROOT / "data/tweet_sentiment/validation.csv"),
                "--output_dir", str(tmp_path / "out"), *QUIET,
            ]
        )  # fmt: skip


def test_a_cards_evaluations_hold_each_evaluated_step_once(workspace, mlm_checkpoint, tmp_path):
    """With --eval_strategy epoch the run evaluates at its last step and once more at its end, on the same weights:
    the card's table has that step once."""
    run_glue.main(
        [
            "--model_name_or_path", str(mlm_checkpoint),
            "--train_file", str(ROOT / "data/tweet_sentiment/train.csv"),
            "--validation_file", str(ROOT / "data/tweet_sentiment/validation.csv"),
            "--max_train_samples", "32", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
            "--num_train_epochs", "2", "--eval_strategy", "epoch", "--output_dir", str(tmp_path), *QUIET,
        ]
    )  # fmt: skip
    card = (tmp_path / "README.md").read_text()
    table = card.split("### Evaluations")[1].split("![")[0]
    steps = [line.split("|")[1].strip() for line in table.strip().splitlines()[2:]]
    assert steps == ["4", "8"], table


def test_malformed_data_file_stops_with_a_clear_message(workspace, mlm_checkpoint):
    broken = workspace / "broken.json"
    broken.write_text('{"sentence": "a cat", "label": 1}\n{"sentence": "a dog", "label": \n')
    with pytest.raises(ValueError, match="Could not read .*broken.json as json"):
        run_glue.main(
            [
                "--model_name_or_path",
                str(mlm_checkpoint),
                "--train_file",
                str(broken),
                "--output_dir",
                str(workspace / "bad"),
                *QUIET,
            ]
        )


MERGED_LOAD = """
import sys
sys.modules["lrpe_hf"] = None  # a user without lrpe-hf (or peft) installed
sys.modules["peft"] = None
import torch
from transformers import AutoModelForSequenceClassification
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
inputs = torch.load(sys.argv[2])
with torch.no_grad():
    torch.testing.assert_close(model(**inputs).logits, torch.load(sys.argv[3]))
print("merged ok")
"""


def test_lora_fine_tuning_pushes_the_adapter_and_writes_a_merged_model(mlm_checkpoint, workspace, monkeypatch):
    """run_glue.py --lora_r: only the adapters (and the head) train; the adapter and its card go to the Hub;
    merged/ loads as remote code where neither lrpe-hf nor peft is installed and equals base + adapter."""
    import transformers.trainer
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    cache = workspace / "hf_home_lora"
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: HubStandIn(cache))
    out = workspace / "lora"
    arguments = ["--model_name_or_path", str(mlm_checkpoint), "--lora_r", "4", "--learning_rate", "1e-2"]
    arguments += ["--train_file", str(ROOT / "data/tweet_sentiment/train.csv"), "--max_train_samples", "32"]
    arguments += ["--validation_file", str(ROOT / "data/tweet_sentiment/validation.csv"), "--max_eval_samples", "8"]
    arguments += ["--max_steps", "3", "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "org/lora"]
    run_glue.main([*arguments, "--hub_strategy", "end", *QUIET])

    snapshot = next((cache / "hub" / "models--org--lora" / "snapshots").iterdir())
    pushed = {p.name for p in snapshot.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= pushed
    assert "model.safetensors" not in pushed  # the adapter only
    card = (snapshot / "README.md").read_text()
    assert "library_name: peft" in card and "LoRA adapter" in card and str(mlm_checkpoint) in card

    base = AutoModelForSequenceClassification.from_pretrained(mlm_checkpoint, num_labels=3)
    model = PeftModel.from_pretrained(base, out).eval()
    changed = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in changed.items())  # it trained
    inputs = AutoTokenizer.from_pretrained(out)(["a fine day", "so bad"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.save(dict(inputs), workspace / "lora_inputs.pt")
    torch.save(expected, workspace / "lora_logits.pt")
    script = [sys.executable, "-c", MERGED_LOAD, str(out / "merged")]
    result = subprocess.run(
        [*script, str(workspace / "lora_inputs.pt"), str(workspace / "lora_logits.pt")],
        capture_output=True,
        text=True,
        cwd=workspace,
    )
    assert result.returncode == 0 and "merged ok" in result.stdout, result.stderr[-3000:]


def test_lora_causal_lm(workspace):
    base = workspace / "clm_base"
    common = ["--tokenizer_name", str(workspace / "tokenizer"), "--train_file", str(workspace / "train.txt")]
    common += ["--block_size", "32", "--per_device_train_batch_size", "4", *QUIET]
    run_language_modeling("clm", [*common, *TINY, "--max_steps", "1", "--output_dir", str(base)])
    out = workspace / "clm_lora"
    run_language_modeling(
        "clm",
        [*common, "--model_name_or_path", str(base), "--lora_r", "2", "--max_steps", "2", "--output_dir", str(out)],
    )
    assert (out / "adapter_config.json").exists() and (out / "merged" / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    generated = merged.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)
    with pytest.raises(ValueError, match="no such module"):
        run_language_modeling(
            "clm",
            [
                *common,
                "--model_name_or_path",
                str(base),
                "--lora_r",
                "2",
                "--lora_target_modules",
                "query",
                "--output_dir",
                str(workspace / "bad_lora"),
            ],
        )

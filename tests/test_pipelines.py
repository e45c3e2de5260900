"""The models run inside Transformers pipelines, from checkpoints saved with their tokenizer or image processor."""

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, ViTImageProcessor, pipeline

from lrpe_hf import (
    LinearGPTConfig,
    LinearGPTForCausalLM,
    LinearRobertaConfig,
    LinearRobertaForMaskedLM,
    LinearRobertaForSequenceClassification,
    LinearViTConfig,
    LinearViTForImageClassification,
)

TEXT = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song", "we read the book today"] * 5
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    model.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=80, special_tokens=specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def saved(model, processor, path):
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def test_fill_mask(tokenizer, tmp_path):
    config = LinearRobertaConfig(**TINY, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    path = saved(LinearRobertaForMaskedLM(config), tokenizer, tmp_path)
    fill = pipeline("fill-mask", model=path)
    results = fill("the cat <mask> on the mat")
    assert len(results) == 5 and all("sequence" in r for r in results)


def test_text_classification(tokenizer, tmp_path):
    config = LinearRobertaConfig(
        **TINY,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        id2label={0: "animal", 1: "other"},
        label2id={"animal": 0, "other": 1},
    )
    path = saved(LinearRobertaForSequenceClassification(config), tokenizer, tmp_path)
    classify = pipeline("text-classification", model=path)
    results = classify(["the dog ran", "we read the book today in the park"])
    assert [r["label"] in ("animal", "other") for r in results] == [True, True]


def test_text_generation(tokenizer, tmp_path):
    config = LinearGPTConfig(
        **TINY,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        positional_encoding="permute",
    )
    path = saved(LinearGPTForCausalLM(config), tokenizer, tmp_path)
    generate = pipeline("text-generation", model=path)
    out = generate("the cat", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("the cat")


def test_image_classification(tmp_path):
    config = LinearViTConfig(
        **TINY,
        image_size=32,
        patch_size=8,
        num_labels=3,
        id2label={0: "a", 1: "b", 2: "c"},
        label2id={"a": 0, "b": 1, "c": 2},
    )
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    path = saved(LinearViTForImageClassification(config), processor, tmp_path)
    classify = pipeline("image-classification", model=path)
    image = Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8"))
    results = classify(image)
    assert {r["label"] for r in results} <= {"a", "b", "c"}
    torch.testing.assert_close(sum(r["score"] for r in results), 1.0, atol=1e-4, rtol=0)


def test_streaming_generation_with_text_iterator_streamer(tokenizer):
    """generate() in a thread feeds a TextIteratorStreamer; the streamed text is the decoded continuation."""
    from threading import Thread

    from transformers import TextIteratorStreamer

    torch.manual_seed(0)
    model = LinearGPTForCausalLM(LinearGPTConfig(vocab_size=len(tokenizer), pad_token_id=1, **TINY)).eval()
    inputs = tokenizer(["the cat"], return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = Thread(target=model.generate, kwargs=dict(**inputs, max_new_tokens=8, do_sample=False, streamer=streamer))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert len(pieces) > 1  # text arrives piece by piece
    assert "".join(pieces) == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :])

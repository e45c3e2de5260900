"""The Hugging Face calls people make every day, on each family, against transformers' own model of that kind
(GPT-2, RoBERTa, ViT) where both can make them: pipelines, generate's options, from_pretrained's loading options,
Auto classes across heads (as remote code, without lrpe_hf), PEFT and sentence-transformers.

The reference models are tiny and random; what is compared is behaviour (what a call accepts, what it returns,
where it stops), not values.
"""

import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from conftest import ROOT, copy_into_hub_cache
from PIL import Image
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
    pipeline,
)

import lrpe_hf
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD
from lrpe_hf.training.tokenizer import causal_lm_tokenizer

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
LABELS = dict(
    id2label={0: "negative", 1: "neutral", 2: "positive"}, label2id={"negative": 0, "neutral": 1, "positive": 2}
)


@pytest.fixture(scope="module")
def tokenizer(workspace):
    """The byte-level BPE tokenizer of train_tokenizer.py (RoBERTa's layout)."""
    return AutoTokenizer.from_pretrained(workspace / "tokenizer")


@pytest.fixture(scope="module")
def causal_tokenizer(tokenizer):
    return causal_lm_tokenizer(tokenizer)


def special_ids(tokenizer):
    return dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )


def gpt_pair(tokenizer, **fields):
    """(LinearGPT, GPT-2) of the same size, in eval mode."""
    torch.manual_seed(0)
    specials = special_ids(tokenizer) | {name: fields.pop(name) for name in list(fields) if name.endswith("token_id")}
    ours = lrpe_hf.LinearGPTForCausalLM(
        lrpe_hf.LinearGPTConfig(vocab_size=len(tokenizer), **SIZES, **specials, **fields)
    )
    reference = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256, **specials)
    )
    return ours.eval(), reference.eval()


def roberta_reference_config(tokenizer, **fields):
    return RobertaConfig(
        vocab_size=len(tokenizer), **SIZES, max_position_embeddings=300, **special_ids(tokenizer), **fields
    )


# --- text generation (LinearGPT against GPT-2) ---------------------------------------------------------------------


def test_a_causal_prompt_stays_open(tokenizer, causal_tokenizer):
    """train_tokenizer.py's layout closes a text with </s>; the causal layout (what run_clm.py saves) opens it with
    <s> and leaves it open, so generate continues it; pairs keep the document separator."""
    text = tokenizer("the river")["input_ids"]
    assert text[0] == tokenizer.bos_token_id and text[-1] == tokenizer.eos_token_id
    prompt = causal_tokenizer("the river")["input_ids"]
    assert prompt == text[:-1]
    first, second = causal_tokenizer("a b")["input_ids"], causal_tokenizer("c")["input_ids"]
    assert causal_tokenizer("a b", "c")["input_ids"] == first + [tokenizer.eos_token_id] + second
    assert causal_lm_tokenizer(causal_tokenizer) is causal_tokenizer  # already open: left as it is


def test_generate_options_as_gpt2(causal_tokenizer):
    """Each of generate's everyday options is accepted by both models and shapes the output the same way."""
    ours, reference = gpt_pair(causal_tokenizer, eos_token_id=None)
    inputs = causal_tokenizer(["the river flows", "a city"], return_tensors="pt", padding=True, padding_side="left")
    calls = {
        "greedy": dict(do_sample=False),
        "sampling": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8),
        "beams": dict(num_beams=3, num_return_sequences=2, do_sample=False),
        "penalties": dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4),
        "scores": dict(return_dict_in_generate=True, output_scores=True, output_logits=True),
        "no cache": dict(use_cache=False),
    }
    for name, options in calls.items():
        torch.manual_seed(0)
        got = ours.generate(**inputs, max_new_tokens=4, pad_token_id=causal_tokenizer.pad_token_id, **options)
        torch.manual_seed(0)
        expected = reference.generate(**inputs, max_new_tokens=4, pad_token_id=causal_tokenizer.pad_token_id, **options)
        if isinstance(expected, torch.Tensor):
            assert got.shape == expected.shape, name
            assert torch.equal(got[:, : inputs["input_ids"].shape[1]], expected[:, : inputs["input_ids"].shape[1]])
        else:
            assert got.sequences.shape == expected.sequences.shape
            assert len(got.scores) == len(expected.scores) == 4 and got.scores[0].shape == expected.scores[0].shape
            assert len(got.logits) == 4


def test_stop_strings_end_generation_as_with_gpt2(causal_tokenizer):
    """generate(stop_strings=..., tokenizer=...) and the text-generation pipeline with stop strings: generation
    ends at the first token that completes a stop string, for both models."""
    ours, reference = gpt_pair(causal_tokenizer, eos_token_id=None)
    inputs = causal_tokenizer(["the river"], return_tensors="pt")
    pipeline_stops = []
    for model in (ours, reference):
        free = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        new_text = causal_tokenizer.decode(free[0, inputs["input_ids"].shape[1] :])
        stop = new_text[len(new_text) // 3 : len(new_text) // 3 + 2]  # a string the free run produces
        stopped = model.generate(
            **inputs, max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=causal_tokenizer
        )
        assert stopped.shape[1] < free.shape[1]
        assert torch.equal(stopped[0], free[0, : stopped.shape[1]])
        assert stop in causal_tokenizer.decode(stopped[0, inputs["input_ids"].shape[1] :])
        generator = pipeline("text-generation", model=model, tokenizer=causal_tokenizer)
        piped = generator("the river", max_new_tokens=12, do_sample=False, stop_sequence=stop)
        # (a release's pipeline stops at the whole string, or older ones at its first token: as GPT-2 does)
        pipeline_stops.append(
            piped[0]["generated_text"] == causal_tokenizer.decode(stopped[0], skip_special_tokens=True)
        )
    assert pipeline_stops[0] == pipeline_stops[1]


def generate_with_logits(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs)


def test_generation_continues_from_a_returned_cache(repeating_gpt):
    """The multi-turn pattern: generate, then generate again from the returned sequences and cache (under every
    name the cache goes by): the tokens and every step's logits equal one generation of the whole length, and the
    cache has taken each token once. The model repeats its prompt, so its tokens depend on the context."""
    model = repeating_gpt
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(1)).repeat(1, 2)
    whole = generate_with_logits(model, ids, max_new_tokens=8)
    assert (whole.sequences[:, 12:18] == ids[:, :6]).float().mean() > 0.75  # it reads its context
    for name in sorted({"past_key_values", CACHE_OUTPUT_FIELD}):  # "cache" is generate's own name from 5.24 on
        first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        assert isinstance(cache, lrpe_hf.LinearAttentionCache)
        with warnings.catch_warnings():  # the old name still works where a release deprecates it (5.25: until 6.0)
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            then = generate_with_logits(model, first.sequences, max_new_tokens=4, **{name: cache})
        assert torch.equal(then.sequences, whole.sequences), name
        torch.testing.assert_close(torch.stack(then.logits), torch.stack(whole.logits)[4:])
        assert cache.get_seq_length() == whole.sequences.shape[1] - 1


def test_generation_continues_a_cache_with_new_text_given_whole_or_as_the_new_tokens(repeating_gpt):
    """A new turn: the returned sequences plus new tokens, given whole (the mask as long as the ids, or none) or as the
    new tokens alone with a mask over everything, continue as one generation over the joined text; fewer tokens than
    the cache has seen, with a mask as long, raise."""
    model = repeating_gpt
    ids = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(2)).repeat(1, 2)
    turn = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(3))
    first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    joined = torch.cat([first.sequences, turn, turn], dim=1)
    whole = generate_with_logits(model, joined, max_new_tokens=5)
    assert (whole.sequences[:, -5:] == turn[:, :5]).float().mean() > 0.75
    ones = torch.ones_like(joined)
    for given, mask in [(joined, None), (joined, ones), (joined[:, first.sequences.shape[1] - 1 :], ones)]:
        cache = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        cache = cache.cache if hasattr(cache, "cache") else cache.past_key_values
        mask_argument = {} if mask is None else {"attention_mask": mask}
        then = generate_with_logits(model, given, max_new_tokens=5, **{CACHE_OUTPUT_FIELD: cache}, **mask_argument)
        assert torch.equal(then.sequences[:, -5:], whole.sequences[:, -5:])
        torch.testing.assert_close(torch.stack(then.logits), torch.stack(whole.logits))
    with pytest.raises(ValueError, match=f"12 tokens with a cache that has seen {cache.get_seq_length()}:"):
        model.generate(ids, max_new_tokens=2, do_sample=False, **{CACHE_OUTPUT_FIELD: cache})


def test_text_generation_pipeline_with_a_left_padding_tokenizer(causal_tokenizer):
    """Batched pipeline generation pads on the left; each prompt's text equals its generation alone."""
    ours, _ = gpt_pair(causal_tokenizer, eos_token_id=None)
    generator = pipeline("text-generation", model=ours, tokenizer=causal_tokenizer)
    prompts = ["the river flows into", "a"]
    batched = generator(prompts, max_new_tokens=5, do_sample=False, batch_size=2)
    alone = [generator(prompt, max_new_tokens=5, do_sample=False) for prompt in prompts]
    assert [b[0]["generated_text"] for b in batched] == [a[0]["generated_text"] for a in alone]


# --- classification, fill-mask and features (LinearRoberta against RoBERTa) ----------------------------------------


def test_sequence_classification_pools_the_first_real_token_wherever_padding_stands(tokenizer):
    """A tokenizer flipped to left padding (as a text-generation pipeline leaves it) gives the same classes as
    right padding. RoBERTa pools position 0, a pad token under left padding; LinearRoberta pools <s>."""
    torch.manual_seed(0)
    ours = lrpe_hf.LinearRobertaForSequenceClassification(
        lrpe_hf.LinearRobertaConfig(vocab_size=len(tokenizer), **SIZES, **special_ids(tokenizer), **LABELS)
    ).eval()
    texts = ["the river flows into the sea", "a city"]
    logits = {}
    for side in ("right", "left"):
        batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side=side)
        logits[side] = ours(**batch).logits
    torch.testing.assert_close(logits["left"], logits["right"])
    alone = ours(**tokenizer(texts[1:], return_tensors="pt")).logits
    torch.testing.assert_close(logits["left"][1:], alone)
    classify = pipeline("text-classification", model=ours, tokenizer=tokenizer)
    tokenizer.padding_side = "left"
    try:
        scores = [r["score"] for r in classify(texts, batch_size=2)]
    finally:
        tokenizer.padding_side = "right"
    torch.testing.assert_close(torch.tensor(scores), logits["right"].softmax(-1).max(-1).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("task", ["fill-mask", "text-classification", "token-classification", "feature-extraction"])
def test_text_pipelines_answer_as_roberta(task, tokenizer):
    """Each text pipeline returns results of the same form from LinearRoberta's head as from RoBERTa's."""
    heads = {
        "fill-mask": (lrpe_hf.LinearRobertaForMaskedLM, RobertaForMaskedLM),
        "text-classification": (lrpe_hf.LinearRobertaForSequenceClassification, RobertaForSequenceClassification),
        "token-classification": (lrpe_hf.LinearRobertaForTokenClassification, None),
        "feature-extraction": (lrpe_hf.LinearRobertaModel, None),
    }
    from transformers import RobertaForTokenClassification, RobertaModel

    ours_class, reference_class = heads[task]
    reference_class = reference_class or {"token-classification": RobertaForTokenClassification}.get(task, RobertaModel)
    torch.manual_seed(0)
    ours = ours_class(
        lrpe_hf.LinearRobertaConfig(vocab_size=len(tokenizer), **SIZES, **special_ids(tokenizer), **LABELS)
    )
    reference = reference_class(roberta_reference_config(tokenizer, **LABELS))
    text = f"the river flows into the {tokenizer.mask_token}" if task == "fill-mask" else "the river flows"

    def shape_of(result):
        if isinstance(result, dict):
            return {
                key: shape_of(value)
                for key, value in result.items()
                if key not in ("score", "token", "token_str", "sequence", "word", "start", "end", "index", "entity")
            }
        if isinstance(result, list):
            return [shape_of(item) for item in result]
        return type(result).__name__

    answers = [pipeline(task, model=model.eval(), tokenizer=tokenizer)(text) for model in (ours, reference)]
    assert shape_of(answers[0]) == shape_of(answers[1])


# --- images (LinearViT against ViT) --------------------------------------------------------------------------------


def test_image_pipelines_and_other_sizes_as_vit():
    """image-classification and image-feature-extraction pipelines, and interpolate_pos_encoding=True for an image
    of another size, as with ViT."""
    fields = dict(**SIZES, image_size=32, patch_size=8, num_labels=3, **LABELS)
    torch.manual_seed(0)
    ours = lrpe_hf.LinearViTForImageClassification(
        lrpe_hf.LinearViTConfig(**fields, absolute_position_embedding="learned")
    ).eval()
    reference = ViTForImageClassification(ViTConfig(**fields)).eval()
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    image = Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8"))
    for model in (ours, reference):
        results = pipeline("image-classification", model=model, image_processor=processor)(image)
        assert {r["label"] for r in results} == set(LABELS["label2id"])
        large = torch.randn(1, 3, 48, 40)
        assert model(large, interpolate_pos_encoding=True).logits.shape == (1, 3)
        with pytest.raises(ValueError):
            model(large)
    features = pipeline("image-feature-extraction", model=ours.model, image_processor=processor)(image)
    assert np.asarray(features).shape == (1, 17, 32)


# --- from_pretrained's loading options and outputs, every family ---------------------------------------------------


def family_models(tokenizer):
    torch.manual_seed(0)
    text = dict(vocab_size=len(tokenizer), **SIZES, **special_ids(tokenizer))
    ids = tokenizer(["the river flows into the sea"], return_tensors="pt")
    return {
        "roberta": (lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(**text)), dict(ids)),
        "gpt": (lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(**text)), dict(ids)),
        "vit": (
            lrpe_hf.LinearViTForImageClassification(lrpe_hf.LinearViTConfig(**SIZES, image_size=32, patch_size=8)),
            {"pixel_values": torch.randn(1, 3, 32, 32)},
        ),
    }


@pytest.mark.parametrize("family", ["roberta", "gpt", "vit"])
def test_loading_options_and_outputs(family, tokenizer, tmp_path):
    model, inputs = family_models(tokenizer)[family]
    model.save_pretrained(tmp_path)
    auto = type(model)
    tokens = inputs.get("input_ids", torch.zeros(1, 17)).shape[1]

    loaded = auto.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu", low_cpu_mem_usage=True)
    assert loaded.dtype == torch.bfloat16 and loaded(**inputs).logits.dtype == torch.bfloat16
    # output_attentions from the config (from_pretrained's keyword) or the call: one (B, H, N, N) tensor per layer
    attentive = auto.from_pretrained(tmp_path, output_attentions=True).eval()
    attentions = attentive(**inputs).attentions
    assert len(attentions) == 2 and attentions[0].shape == (1, 4, tokens, tokens)
    plain = auto.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(plain(**inputs, output_attentions=True).attentions[1], attentions[1])
    assert plain(**inputs).attentions is None
    hidden = plain(**inputs, output_hidden_states=True).hidden_states
    assert len(hidden) == 3 and hidden[0].shape == (1, tokens, 32)
    as_tuple = plain(**inputs, return_dict=False)
    torch.testing.assert_close(as_tuple[0], plain(**inputs).logits)
    # attn_implementation: linear attention has one, its own ("eager"); anything else says what to use instead
    assert auto.from_pretrained(tmp_path, attn_implementation="eager").config._attn_implementation == "eager"
    for name in ("sdpa", "flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match="kernel_backend.*attention='softmax'"):
            auto.from_pretrained(tmp_path, attn_implementation=name)


def test_the_softmax_baseline_runs_sdpa_or_eager():
    """attention="softmax": "sdpa" by default, "eager" on request (the same maths in plain ops), both giving the
    same outputs and attention weights that are a softmax (rows summing to 1); others are refused."""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=50, **SIZES, attention="softmax", positional_encoding="rope")
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.tensor([[0, 0] + [1] * 7, [1] * 9])
    sdpa = model(ids, attention_mask=mask).logits
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    out = model(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(out.logits, sdpa, atol=1e-5, rtol=1e-5)
    weights = out.attentions[0]
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(4, 9))
    assert torch.all(weights.triu(1) == 0)  # causal
    with pytest.raises(ValueError, match="runs 'sdpa' or 'eager'"):
        model.set_attn_implementation("flash_attention_2")


def test_output_attentions_needs_the_whole_sequence(causal_tokenizer):
    ours, _ = gpt_pair(causal_tokenizer)
    ids = causal_tokenizer(["the river flows"], return_tensors="pt")["input_ids"]
    out = ours(ids, output_attentions=True)  # a new cache: every key is in this call
    with pytest.raises(ValueError, match="keeps no past tokens"):
        ours(
            ids[:, :1],
            past_key_values=out.past_key_values if hasattr(out, "past_key_values") else out.cache,
            output_attentions=True,
        )


# --- inputs that used to pass silently, and labels --------------------------------------------------------------


@pytest.mark.parametrize("family", ["roberta", "gpt"])
def test_bad_masks_positions_and_labels_stop_with_a_message(family, tokenizer):
    model, inputs = family_models(tokenizer)[family]
    ids = inputs["input_ids"]
    with pytest.raises(ValueError, match="attention_mask must hold 1 for tokens and 0 for padding"):
        model(ids, attention_mask=torch.full(ids.shape, 0.5))
    with pytest.raises(ValueError, match="position_ids must be 0 or more"):
        model(ids, position_ids=torch.arange(ids.shape[1])[None] - 1)
    with pytest.raises(ValueError, match="integer token ids .* got torch.float32"):
        model(ids, labels=ids.float())
    with pytest.raises(ValueError, match=rf"shape \(batch, tokens\) = \(1, {ids.shape[1]}\); got \(1, 3\)"):
        model(ids, labels=ids[:, :3])
    model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=ids)  # bool masks and int labels


@pytest.mark.parametrize("family", ["roberta", "gpt"])
def test_one_row_of_position_ids_stands_for_every_row_as_in_gpt2_and_roberta(family, tokenizer):
    """position_ids of shape (N,), as GPT-2 and RoBERTa take them, give the outputs of the same positions repeated
    over the batch, and not those of the default positions (these have gaps: a rotation reads them)."""
    model, inputs = family_models(tokenizer)[family]
    model.eval()
    ids = inputs["input_ids"].repeat(2, 1)
    positions = 3 * torch.arange(ids.shape[1])
    with torch.no_grad():
        one_row = model(ids, position_ids=positions).logits
        every_row = model(ids, position_ids=positions.expand(2, -1)).logits
        default = model(ids).logits
    torch.testing.assert_close(one_row, every_row, rtol=0, atol=0)
    assert (one_row - default).abs().max() > 1e-4


def test_token_and_sequence_labels_are_checked(tokenizer):
    torch.manual_seed(0)
    config = lrpe_hf.LinearRobertaConfig(vocab_size=len(tokenizer), **SIZES, **special_ids(tokenizer), **LABELS)
    ids = tokenizer(["the river flows"], return_tensors="pt")["input_ids"]
    tagger = lrpe_hf.LinearRobertaForTokenClassification(config)
    with pytest.raises(ValueError, match="integer class ids"):
        tagger(ids, labels=torch.zeros(ids.shape))
    classifier = lrpe_hf.LinearRobertaForSequenceClassification(config)
    with pytest.raises(ValueError, match=r"one label per example, labels of shape \(1,\)"):
        classifier(ids, labels=torch.tensor([0, 1]))


# --- checkpoints: every head from every saved head, as remote code; PEFT; sentence-transformers -------------------

REMOTE_HEADS = textwrap.dedent("""
    import sys, warnings
    sys.modules["lrpe_hf"] = sys.modules["fla"] = None  # torch and transformers alone: neither imports here
    import torch, transformers
    from transformers import AutoTokenizer
    heads = sys.argv[1].split(",")
    for saved in heads:
        path = f"org/{saved}"  # from the Hub's cache, where transformers checks every code file's imports
        try:
            AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # stdin is closed: no prompt
        except ImportError as error:  # older releases build any AutoImageProcessor with torchvision only
            assert "Torchvision" in str(error), error
        for head in heads:
            model = getattr(transformers, head).from_pretrained(path, trust_remote_code=True)
            assert "lrpe_hf" not in type(model).__module__ and type(model).__name__.endswith(
                {"AutoModel": "Model"}.get(head, head.removeprefix("AutoModel"))
            ), (saved, head, type(model).__name__)
    print("heads ok", len(heads) ** 2)
""")


def test_the_code_a_checkpoint_carries_imports_only_torch_and_transformers():
    """transformers asks the user of a Hub checkpoint for every package an import statement in its code files names
    (outside a ``try``): the modeling files, all of which travel with checkpoints, name torch, transformers and the
    standard library only, so that optional packages (fla-core) stay optional."""
    from transformers.dynamic_module_utils import get_imports

    for path in sorted((ROOT / "lrpe_hf" / "modeling").glob("*.py")):
        packages = set(get_imports(path)) - set(sys.stdlib_module_names)
        assert packages <= {"torch", "transformers"}, f"{path.name} imports {sorted(packages)}"


@pytest.mark.parametrize("family", ["roberta", "gpt", "vit"])
def test_every_head_loads_from_every_saved_head_as_remote_code(family, tokenizer, tmp_path):
    config_class = {
        "roberta": lrpe_hf.LinearRobertaConfig,
        "gpt": lrpe_hf.LinearGPTConfig,
        "vit": lrpe_hf.LinearViTConfig,
    }[family]
    fields = dict(**SIZES, image_size=32, patch_size=8) if family == "vit" else dict(vocab_size=len(tokenizer), **SIZES)
    processor = ViTImageProcessor(size={"height": 32, "width": 32}) if family == "vit" else tokenizer
    heads = lrpe_hf.registration.FAMILIES[config_class]
    for name, model_class in heads.items():
        model_class(config_class(**fields, **LABELS)).save_pretrained(tmp_path / name)
        processor.save_pretrained(tmp_path / name)
        copy_into_hub_cache(tmp_path / name, tmp_path / "hf_home", f"org/{name}")
    script = tmp_path / "heads.py"
    script.write_text(REMOTE_HEADS.replace("AutoTokenizer", "AutoImageProcessor") if family == "vit" else REMOTE_HEADS)
    result = subprocess.run(
        [sys.executable, str(script), ",".join(heads)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"heads ok {len(heads) ** 2}" in result.stdout
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr


def test_sentence_transformers_reads_a_masked_lm_checkpoint(tokenizer, tmp_path):
    """A pretrained (masked-LM) checkpoint is an embedding model for sentence-transformers, through AutoModel, as
    a RoBERTa checkpoint is; mean pooling over real tokens makes a padded batch equal each text alone."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    model = lrpe_hf.LinearRobertaForMaskedLM(
        lrpe_hf.LinearRobertaConfig(vocab_size=len(tokenizer), **SIZES, **special_ids(tokenizer))
    )
    model.save_pretrained(tmp_path / "ours")
    tokenizer.save_pretrained(tmp_path / "ours")
    RobertaForMaskedLM(roberta_reference_config(tokenizer)).save_pretrained(tmp_path / "roberta")
    tokenizer.save_pretrained(tmp_path / "roberta")
    texts = ["the river flows into the sea", "a city"]
    for name in ("ours", "roberta"):
        encoder = sentence_transformers.SentenceTransformer(str(tmp_path / name), trust_remote_code=True, device="cpu")
        together = encoder.encode(texts)
        assert together.shape == (2, 32)
        np.testing.assert_allclose(together[1], encoder.encode(texts[1:])[0], atol=1e-5)


@pytest.mark.parametrize("family", ["roberta", "gpt", "vit"])
def test_peft_lora_on_each_family(family, tokenizer, tmp_path):
    """LoRA on the attention's input projection (qkv_proj, named: peft has no default for these types), trained
    one step, merged, saved and reloaded: the merged model computes what the adapted one did."""
    peft = pytest.importorskip("peft")
    model, inputs = family_models(tokenizer)[family]
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv_proj"], init_lora_weights=False))
    assert adapted.get_nb_trainable_parameters()[0] == 2 * 4 * (32 + 3 * 32)  # 2 layers: A (4, 32), B (96, 4)
    adapted.eval()
    with torch.no_grad():
        expected = adapted(**inputs).logits
    merged = adapted.merge_and_unload()
    merged.save_pretrained(tmp_path)
    reloaded = type(merged).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


# --- the run scripts' flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--bf16"], ["--bf16", "true"], ["--bf16=True"]])
def test_bf16_on_a_machine_without_a_gpu_trains_on_the_cpu(flag, tmp_path):
    """transformers refuses --bf16 without a GPU unless --use_cpu is given; the scripts add it, saying so."""
    from transformers.utils import is_torch_bf16_gpu_available

    from lrpe_hf.training.arguments import parse_script_arguments
    from lrpe_hf.training.glue import argument_parser

    if is_torch_bf16_gpu_available():
        pytest.skip("this machine's GPU runs bf16")
    *_, training_args = parse_script_arguments(argument_parser(), ["--output_dir", str(tmp_path), *flag])
    assert training_args.bf16 and training_args.use_cpu
    *_, training_args = parse_script_arguments(argument_parser(), ["--output_dir", str(tmp_path)])
    assert not training_args.bf16 and not training_args.use_cpu


def test_a_checkpoint_with_q_k_and_v_projections_apart_is_refused_not_drawn_at_random(tmp_path):
    """A checkpoint saved when q, k and v had projections of their own (q_proj, k_proj, v_proj) would load with the
    joined qkv_proj drawn at random (transformers only warns of missing keys): it is refused, saying how to join
    them; the same weights joined as the error says load and compute what the model did."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=2)
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    apart = {}
    for name, tensor in weights.items():
        parts = zip("qkv", tensor.chunk(3)) if "qkv_proj" in name else [("", tensor)]
        apart |= {name.replace("qkv_proj", f"{p}_proj"): part.contiguous() for p, part in parts}
    save_file(apart, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj, k_proj and v_proj weights \(and biases\) in that order"):
        lrpe_hf.LinearGPTForCausalLM.from_pretrained(tmp_path)
    joined = {name: tensor for name, tensor in apart.items() if not re.search(r"\.[qkv]_proj\.", name)}
    for name in [name for name in apart if ".q_proj." in name]:
        joined[name.replace("q_proj", "qkv_proj")] = torch.cat([apart[name.replace("q_", f"{p}_")] for p in "qkv"])
    save_file(joined, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 50, (1, 7))
    reloaded, info = lrpe_hf.LinearGPTForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids).logits, model(ids).logits)

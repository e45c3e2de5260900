"""No host reads inside the layers: a train step and a decoding step that a GPU's host can queue without waiting.

Counted on the CPU with a dispatch mode (benchmarks/host_reads.py) for every encoding and feature map of the
registry, in the three families, on padded, left-padded and packed rows. Inside the layers (their forwards and the
whole backward) nothing may read a value on the host; a decoding step reads nothing anywhere. Checks of the inputs
that run on the device on a GPU (``positions.check_values``) are not reads there and are not counted. At the
model's entry a train step may read what only values can tell, once per call: whether given positions restart (packed
documents), and convSPE's positions' range where they are not the model's defaults (its noise grid is sized by it;
in a decoding step too, where its seeded noise is made on the host at the step's positions); each is listed here.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch

import lrpe_hf
from lrpe_hf.modeling.registry import positional_encoding_entry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
host_reads = importlib.import_module("host_reads")

ENCODINGS = list(lrpe_hf.POSITIONAL_ENCODINGS)
FEATURE_MAPS = list(lrpe_hf.FEATURE_MAPS)
TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, spe_realizations=8)
LENGTH = 24
# The entry's reads a train step may make, by where they are (the first library frame) and the rows that need them
ENTRY_READS = {
    "packed": {" document_count"},  # how many documents given positions make (one read a forward)
}
SPE_CONV_RANGE = " position_range"  # convSPE: the range of given positions, which sizes its noise grid


def counted(model, step):
    """Run ``step(reads)`` twice (the first makes what is kept between calls) and count the reads of the second."""
    step(None)
    with host_reads.HostReads().watch(model) as reads:
        step(reads)
    return reads


def describe(counter):
    return "; ".join(f"{n} x {op} at {where}" for (op, where, _), n in counter.items())


def entry_reads_allowed(counter, rows, encoding):
    allowed = set(ENTRY_READS.get(rows, ()))
    if encoding == "spe_conv" and rows in ("packed", "grid"):  # its noise grid is sized by given positions' range
        allowed.add(SPE_CONV_RANGE)
    return all(any(name in where for name in allowed) for (_, where, _) in counter)


def text_inputs(rows, batch=2):
    ids = torch.randint(3, 60, (batch, LENGTH), generator=torch.Generator().manual_seed(0))
    kwargs = {}
    if rows in ("padded", "left-padded"):
        mask = torch.ones(batch, LENGTH, dtype=torch.long)
        if rows == "padded":
            mask[0, -7:] = 0
        else:
            mask[0, :7] = 0
        kwargs["attention_mask"] = mask
    if rows == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(10), torch.arange(LENGTH - 10)]).expand(batch, -1)
    return ids, kwargs


def configurations(causal: bool, two_d: bool = False):
    """(encoding, feature map) pairs: every encoding with its default map, every map with rope."""
    pairs = []
    for encoding in ENCODINGS:
        entry = positional_encoding_entry(encoding)
        if (entry.causal_only and not causal) or (two_d and not entry.supports_2d):
            continue
        pairs.append((encoding, None))
    pairs += [("rope", feature_map) for feature_map in FEATURE_MAPS]
    return pairs


def ids_of(pairs):
    return [f"{e}-{m or 'default'}" for e, m in pairs]


def feature_map_field(feature_map):
    return {} if feature_map is None else {"feature_map": feature_map}


def train_step_reads(model, ids, kwargs, rows, encoding):
    """The host reads of one LM train step (forward and backward): none inside the layers, and outside them only
    those the model's entry may make for these rows. Returns the reads."""

    def step(reads):
        loss = model(ids, labels=ids, **kwargs).loss
        reads.backward(loss) if reads is not None else loss.backward()

    reads = counted(model, step)
    assert not reads.inside_layers(), describe(reads.inside_layers())
    assert entry_reads_allowed(reads.outside_layers(), rows, encoding), describe(reads.outside_layers())
    return reads


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
@pytest.mark.parametrize(("encoding", "feature_map"), configurations(True), ids=ids_of(configurations(True)))
def test_a_causal_lm_train_step_reads_nothing_inside_its_layers(encoding, feature_map, rows):
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=60, positional_encoding=encoding, **feature_map_field(feature_map), **TINY
    )
    model = lrpe_hf.LinearGPTForCausalLM(config).train()
    ids, kwargs = text_inputs(rows)
    reads = train_step_reads(model, ids, kwargs, rows, encoding)
    if rows != "packed":
        assert not reads.outside_layers(), describe(reads.outside_layers())


@pytest.mark.parametrize("rows", ["plain", "padded", "packed"])
@pytest.mark.parametrize(("encoding", "feature_map"), configurations(False), ids=ids_of(configurations(False)))
def test_a_masked_lm_train_step_reads_nothing_inside_its_layers(encoding, feature_map, rows):
    torch.manual_seed(0)
    config = lrpe_hf.LinearRobertaConfig(
        vocab_size=60, max_position_embeddings=64, positional_encoding=encoding, **feature_map_field(feature_map),
        **TINY,
    )  # fmt: skip
    model = lrpe_hf.LinearRobertaForMaskedLM(config).train()
    ids, kwargs = text_inputs(rows)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.3, -100)

    def step(reads):
        loss = model(ids, labels=labels, **kwargs).loss
        reads.backward(loss) if reads is not None else loss.backward()

    reads = counted(model, step)
    assert not reads.inside_layers(), describe(reads.inside_layers())
    assert entry_reads_allowed(reads.outside_layers(), rows, encoding), describe(reads.outside_layers())


@pytest.mark.parametrize(
    ("encoding", "feature_map"), configurations(False, two_d=True), ids=ids_of(configurations(False, two_d=True))
)
def test_an_image_classifier_train_step_reads_nothing_inside_its_layers(encoding, feature_map):
    torch.manual_seed(0)
    config = lrpe_hf.LinearViTConfig(
        image_size=32, patch_size=8, num_labels=3, positional_encoding=encoding, **feature_map_field(feature_map),
        **TINY,
    )  # fmt: skip
    model = lrpe_hf.LinearViTForImageClassification(config).train()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 2])

    def step(reads):
        loss = model(pixel_values=pixels, labels=labels).loss
        reads.backward(loss) if reads is not None else loss.backward()

    reads = counted(model, step)
    assert not reads.inside_layers(), describe(reads.inside_layers())
    outside = reads.outside_layers()
    if encoding == "spe_conv":  # its noise grid is sized by the (row, col) range of the patches' positions
        assert entry_reads_allowed(outside, "grid", encoding), describe(outside)
    else:
        assert not outside, describe(outside)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
@pytest.mark.parametrize(("encoding", "feature_map"), configurations(True), ids=ids_of(configurations(True)))
def test_a_decoding_step_reads_nothing(encoding, feature_map, padded):
    """A decoding step as ``generate`` makes it after a prefill (no mask: the cache counted the prompt's padding), and
    with the mask of the whole sequence, as a user's loop passes it."""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=60, positional_encoding=encoding, **feature_map_field(feature_map), **TINY
    )
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 20, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
    cache = lrpe_hf.LinearAttentionCache(config.num_hidden_layers)
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :12], past_key_values=cache, use_cache=True)
        token = ids[:, -1:]

        def step(reads):
            model(token, past_key_values=cache, use_cache=True)
            model(token, attention_mask=mask[:, : cache.seen_tokens + 1], past_key_values=cache, use_cache=True)

        reads = counted(model, step)
    everything = reads.inside_layers() + reads.outside_layers()
    if encoding == "spe_conv":  # its seeded noise is made on the host at the step's positions: one read a step
        assert sum(everything.values()) == 2 and entry_reads_allowed(everything, "grid", encoding), describe(everything)
    else:
        assert not everything, describe(everything)


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
@pytest.mark.parametrize("encoding", ["rope", "permute", "fastrpb"])
def test_a_windowed_train_step_and_decoding_step_read_nothing_inside_the_layers(encoding, rows):
    """With ``local_window`` (smaller than the sequence: both parts at work) a train step reads nothing inside its
    layers, and a decoding step nothing anywhere."""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=60, positional_encoding=encoding, local_window=5, **TINY)
    model = lrpe_hf.LinearGPTForCausalLM(config).train()
    ids, kwargs = text_inputs(rows)
    train_step_reads(model, ids, kwargs, rows, encoding)
    model.eval()
    cache = lrpe_hf.LinearAttentionCache(config.num_hidden_layers)
    with torch.no_grad():
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        reads = counted(model, lambda reads: model(ids[:, -1:], past_key_values=cache, use_cache=True))
    everything = reads.inside_layers() + reads.outside_layers()
    assert not everything, describe(everything)


def test_the_counter_sees_every_kind_of_read_and_nothing_else():
    """What the tests above rely on: each way of reading a value on the host is counted once (a value, a truth value,
    a list, a shape made from values), inside a watched layer or not, and ops that read nothing are not counted."""
    x = torch.arange(6.0)
    layer = torch.nn.Linear(6, 6)
    with host_reads.HostReads() as reads:
        x.sum().item(), bool(x.any()), int(x[0]), x.tolist(), x.nonzero(), x[x > 2], x.masked_select(x > 2)
        torch.arange(3).repeat_interleave(torch.tensor([1, 0, 2])), torch.unique(x), torch.equal(x, x)
        layer(x), x.repeat_interleave(2), torch.where(x > 2, x, 0), torch._assert_async(x.sum() > 0)
        torch.arange(3).repeat_interleave(torch.tensor([1, 0, 2]), output_size=3)
    ops = sorted(op for (op, _, _), n in reads.reads.items() for _ in range(n))
    assert ops == sorted(
        ["_local_scalar_dense"] * 3 + ["tolist", "nonzero", "index", "masked_select", "repeat_interleave"]
        + ["_unique2", "equal"]
    ), ops  # fmt: skip
    assert not reads.inside_layers() and reads.device_checks() == 0

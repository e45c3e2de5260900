"""Context parallelism (lrpe_hf/modeling/context_parallel.py) against one process: 2 and 4 CPU processes (gloo),
float64, each rank holding a contiguous slice of the same sequence, must give the whole sequence's outputs for
their tokens, its input gradients and, summed over the ranks, its parameter gradients (tests/context_parallel_worker.py
compares them, every rank against its own one-process run of the whole sequence)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lrpe_hf
from lrpe_hf.modeling.context_parallel import context_parallel

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "context_parallel_worker.py"
pytestmark = pytest.mark.slow  # each comparison launches 2 or 4 processes

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)

# an encoding that biases with every earlier value (FastRPB) is refused (test below)
SPLIT = [e for e in lrpe_hf.POSITIONAL_ENCODINGS if not lrpe_hf.LinearAttention(8, 1, positional_encoding=e,
         max_positions=8).positional_encoding.has_value_bias]  # fmt: skip
CAUSAL = [dict(positional_encoding=e, causal=True) for e in SPLIT]
CAUSAL += [dict(positional_encoding=e, causal=True, packed=True, padded=True) for e in ("rope", "permute", "none")]
CAUSAL += [dict(positional_encoding="permute", causal=True, gaps=True, padded=True)]
CAUSAL += [dict(positional_encoding="lrpe_orthogonal", causal=True, feature_map=m) for m in ("relu", "dpfp")]
BIDIRECTIONAL = [dict(positional_encoding=e, causal=False, padded=True) for e in SPLIT]
# LinearGPT made in float64 as transformers makes it (dtype=torch.float64), not by .double(): LRPE's angles too
MODELS = [dict(model="gpt", positional_encoding=e, built_in_float64=True) for e in ("lrpe_orthogonal", "lrpe_unitary")]
MODELS += [dict(model="gpt", positional_encoding=e) for e in ("permute", "spe_sine")]
MODELS += [dict(model="gpt", positional_encoding="rope", packed=True, padded=True, absolute="learned")]
MODELS += [dict(model="gpt", positional_encoding="permute", padded=True)]
MODELS += [dict(model="roberta", positional_encoding=e, padded=True) for e in ("lrpe_orthogonal", "none")]
MODELS += [dict(model="roberta", positional_encoding="rope", absolute="sinusoidal")]
CHECKPOINTED = [dict(model="gpt", positional_encoding=e, checkpointing=kind, padded=True)
                for e in ("permute", "rope") for kind in ("reentrant", "non_reentrant")]  # fmt: skip
CHECKPOINTED += [dict(model="roberta", positional_encoding="lrpe_orthogonal", checkpointing=kind, padded=True)
                 for kind in ("reentrant", "non_reentrant")]  # fmt: skip
PADDING_AT_BOUNDARIES = [
    dict(model=family, positional_encoding="rope", absolute=table, padded="at boundaries", score_padding=True)
    for family, table in (("gpt", "learned"), ("roberta", "sinusoidal"))
]
TOKEN_LABELS = [dict(model="token", positional_encoding="lrpe_orthogonal", padded=True)]
PREFILLS = [dict(prefill=True, positional_encoding=e) for e in ("lrpe_orthogonal", "spe_sine")]
PREFILLS += [dict(prefill=True, positional_encoding=e, padded=True) for e in ("permute", "none")]
PREFILLS += [dict(prefill=True, positional_encoding="rope", normalization="unrotated_denominator", padded=True)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(size: int, cases: list[dict]):
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(size)}
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(cases)],
            env={**environment, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(size)
    ]
    results = [process.communicate(timeout=900) for process in processes]
    for process, (stdout, stderr) in zip(processes, results):
        assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return results


@pytest.mark.parametrize("size", [2, 4])
def test_causal_layers_split_over_ranks_equal_one_process(size):
    """Every encoding (fastrpb refused), padded and packed rows whose documents cross rank boundaries, a decay over
    positions with gaps, and other feature maps: outputs and gradients within 1e-10 of one process."""
    run_ranks(size, CAUSAL)


def test_bidirectional_layers_split_over_ranks_equal_one_process():
    run_ranks(2, BIDIRECTIONAL)


@pytest.mark.parametrize("size", [2, 4])
def test_models_split_over_ranks_give_one_process_loss_and_gradients(size):
    """LinearGPT (causal LM, shift_labels) and LinearRoberta (masked LM): the ranks' losses add up to one process's,
    the logits of each slice are the whole sequence's, the summed gradients equal one process's (default and
    given positions, padding, packed documents across boundaries, absolute tables, SPE's shared codes in eval).
    LRPE's learnable angles' gradients within 1e-12 relative, with LinearGPT built in float64 as transformers builds
    it: made float32 there, each rank's share rounded to float32, they were 3.7e-9 (1e-7 relative) off."""
    run_ranks(size, MODELS)


@pytest.mark.parametrize("size", [2, 3])
def test_gradient_checkpointing_recomputes_each_layer_split_as_it_ran(size):
    """Training with gradient checkpointing (reentrant and not), the backward outside the ``context_parallel`` block
    as the Trainer runs it: the recomputation in backward splits the sequence again, so the summed gradients equal
    one process's (they were 0.2-0.4 off, or a CheckpointError, when it ran as one process)."""
    run_ranks(size, CHECKPOINTED)


@pytest.mark.parametrize("size", [2, 3])
def test_padding_that_starts_a_slice_and_token_labels_follow_the_one_process_rule(size):
    """Padding that starts a rank's slice takes the previous real token's absolute position, as in one process
    (scored here, so its logits reach the loss); a token classifier's loss given ``num_items_in_batch`` is each
    rank's share; and a rank holding no tokens is refused on every rank."""
    run_ranks(size, PADDING_AT_BOUNDARIES + TOKEN_LABELS + ([dict(empty_rank=True)] if size == 3 else []))


@pytest.mark.parametrize("size", [2, 4])
def test_a_prefill_split_over_ranks_leaves_one_process_cache_on_the_last_rank(size):
    """LinearGPT with use_cache=True inside context_parallel: the last rank's cache is one process's after the whole
    prompt (states, key sums, counters, token count; padding, a decay, the unrotated denominator, SPE's codes in
    eval), and decoding continued from it there gives one process's logits."""
    run_ranks(size, PREFILLS)


def test_what_context_parallelism_cannot_split_is_refused_by_name(monkeypatch):
    """One process as a group of one: the refusals come before any collective is needed."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.randn(1, 8, 32)
        cases = [
            (dict(positional_encoding="fastrpb", max_positions=64, causal=True), "biases with every earlier value"),
            (dict(attention="softmax", causal=True), "accelerate's own context parallelism splits SDPA"),
            (dict(feature_map="exp", causal=True), "running key maximum.*t2r"),
        ]
        for options, message in cases:
            layer = lrpe_hf.LinearAttention(32, 4, **options).eval()
            with context_parallel(), pytest.raises(ValueError, match=message):
                layer(x)
        spe = lrpe_hf.LinearAttention(32, 4, positional_encoding="spe_sine", causal=True).train()
        with context_parallel(), pytest.raises(ValueError, match="random codes in training"):
            spe(x)
        layer = lrpe_hf.LinearAttention(32, 4, causal=True).eval()
        used = lrpe_hf.LinearAttentionState()
        layer(x, state=used)  # a state that has seen tokens: a split call starts a sequence
        with context_parallel(), pytest.raises(ValueError, match="a split call starts a sequence"):
            layer(x, state=used)
        text = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_labels=2)
        ids = torch.tensor([[1, 2, 3]])
        model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(**text)).eval()
        with context_parallel(), pytest.raises(ValueError, match="pass shift_labels"):
            model(ids, labels=ids)
        with context_parallel(), pytest.raises(ValueError, match="causal LM's loss .* pass num_items_in_batch"):
            model(ids, labels=ids, shift_labels=ids)
        masked_lm = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(**text))
        with context_parallel(), pytest.raises(ValueError, match="masked LM's loss .* pass num_items_in_batch"):
            masked_lm(ids, labels=ids)
        cache = model(ids, use_cache=True).past_key_values
        with context_parallel(), pytest.raises(ValueError, match="a cache that has seen tokens"):
            model(ids, past_key_values=cache, use_cache=True)
        for head, message in [
            (lrpe_hf.LinearGPTForSequenceClassification(lrpe_hf.LinearGPTConfig(**text)), "sequence classification"),
            (lrpe_hf.LinearRobertaForSequenceClassification(lrpe_hf.LinearRobertaConfig(**text)), "sequence class"),
            (lrpe_hf.LinearRobertaForQuestionAnswering(lrpe_hf.LinearRobertaConfig(**text)), "question answering"),
        ]:
            with context_parallel(), pytest.raises(ValueError, match=message):
                head(ids)
        vit = lrpe_hf.LinearViTModel(lrpe_hf.LinearViTConfig(hidden_size=32, num_attention_heads=4, image_size=32))
        with context_parallel(), pytest.raises(ValueError, match="LinearViT"):
            vit(torch.randn(1, 3, 32, 32))
        with context_parallel(), pytest.raises(ValueError, match="attention weights"):
            model(ids, output_attentions=True)
        with context_parallel(), pytest.raises(ValueError, match="every rank to hold tokens"):
            model(ids[:, :0])
        tagger = lrpe_hf.LinearRobertaForTokenClassification(lrpe_hf.LinearRobertaConfig(**text))
        with context_parallel(), pytest.raises(ValueError, match="pass num_items_in_batch"):
            tagger(ids, labels=ids % 2)
        bidirectional = lrpe_hf.LinearAttention(32, 4, causal=False).eval()
        with context_parallel(), pytest.raises(ValueError, match="packed documents in bidirectional"):
            bidirectional(x, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    finally:
        torch.distributed.destroy_process_group()


def test_context_parallel_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        with context_parallel():
            pass


def test_the_collator_gives_each_rank_its_slice_and_labels_shifted_over_the_whole_sequence():
    """The slices of ranks 0..P-1 put side by side are the whole batch; shift_labels is the labels shifted by one
    over the whole sequence (rank 0's last token scored against rank 1's first), -100 after the last."""
    from lrpe_hf.training.context_parallel_training import ContextParallelCollator

    ids = torch.arange(2 * 8).view(2, 8)
    whole = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones(2, 8, dtype=torch.long))
    slices = [ContextParallelCollator(lambda f: dict(whole), r, 2, True, pad_token_id=0)(None) for r in range(2)]
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(torch.cat([s[key] for s in slices], dim=1), whole[key])
    shifted = torch.cat([s["shift_labels"] for s in slices], dim=1)
    assert torch.equal(shifted[:, :-1], ids[:, 1:]) and (shifted[:, -1] == -100).all()
    assert slices[0]["shift_labels"][0, -1] == slices[1]["input_ids"][0, 0]


def test_the_collator_pads_a_length_the_ranks_do_not_divide():
    """7 tokens over 2 ranks: padded to 8, the padding ignored by the loss; a packed row (position_ids) gets its
    padding as a document of its own; a row with neither mask nor positions gets a mask."""
    from lrpe_hf.training.context_parallel_training import ContextParallelCollator

    packed = dict(input_ids=torch.arange(1, 8)[None], labels=torch.arange(1, 8)[None],
                  position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))  # fmt: skip
    last = ContextParallelCollator(lambda f: dict(packed), 1, 2, True, pad_token_id=0)(None)
    assert last["input_ids"].tolist() == [[5, 6, 7, 0]] and last["position_ids"].tolist() == [[1, 2, 3, 0]]
    assert last["labels"].tolist() == [[5, 6, 7, -100]] and last["shift_labels"].tolist() == [[6, 7, -100, -100]]
    plain = dict(input_ids=torch.arange(1, 8)[None], labels=torch.arange(1, 8)[None])
    last = ContextParallelCollator(lambda f: dict(plain), 1, 2, False, pad_token_id=0)(None)
    assert last["attention_mask"].tolist() == [[1, 1, 1, 0]] and "shift_labels" not in last


def test_the_sampler_gives_each_batch_once_per_rank_of_a_group():
    from lrpe_hf.training.context_parallel_training import SharedBatchSampler

    order = list(range(7))
    assert list(SharedBatchSampler(order, batch_size=2, copies=3)) == [0, 1] * 3 + [2, 3] * 3 + [4, 5] * 3


def test_a_masked_lm_with_packed_rows_is_refused_before_training():
    from lrpe_hf.training.language_modeling import context_parallel_trainer
    from lrpe_hf.training.trainer import CardTrainer

    with pytest.raises(ValueError, match="--document_layout concatenated or padded"):
        context_parallel_trainer(CardTrainer, 2, "mlm", "flattened", pad_token_id=0)

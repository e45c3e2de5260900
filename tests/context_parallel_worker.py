"""One rank of tests/test_context_parallel.py: ``python context_parallel_worker.py CASES_JSON`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. For every case, every rank builds the same float64 layer and inputs, runs the whole
sequence in this one process (the reference), then its own slice under ``context_parallel``; the slice's outputs,
the input gradients of its tokens and the parameters' gradients summed over the ranks must equal the reference's.
Prints one line per case; exits non-zero at the first difference."""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from lrpe_hf import LinearAttention
from lrpe_hf.modeling.context_parallel import context_parallel

TOKENS = 48


def inputs(case, generator):
    """hidden (1 or 2, N, 32), mask (or None), position_ids (or None) of a case."""
    batch = 2
    x = torch.randn(batch, TOKENS, 32, generator=generator, dtype=torch.float64)
    mask = None
    if case.get("padded") == "at boundaries":  # row 1: padding that starts the slices of 2, 3 and 4 ranks
        mask = torch.ones(batch, TOKENS, dtype=torch.bool)
        for start in (TOKENS // 4, TOKENS // 3, TOKENS // 2, 2 * TOKENS // 3, 3 * TOKENS // 4):
            mask[1, start : start + 2] = False
    elif case.get("padded"):  # row 1: padding on both sides, inside the second rank's slice too
        mask = torch.ones(batch, TOKENS, dtype=torch.bool)
        mask[1, :5] = False
        mask[1, TOKENS // 2 + 1 : TOKENS // 2 + 4] = False
    positions = None
    if case.get("packed"):  # documents of 20, 11 and 17 tokens: the first crosses every boundary of 2 or 4 ranks
        positions = torch.cat([torch.arange(20), torch.arange(11), torch.arange(17)]).expand(batch, -1)
    elif case.get("gaps"):  # given positions with gaps: a decay and the rotations read the distances
        positions = (torch.arange(TOKENS) * 3 + 7).expand(batch, -1)
    return x, mask, positions


def gradient_errors(module, reference_grads) -> dict:
    """The largest difference of each parameter's gradient, summed over the ranks, from one process's."""
    errors = {}
    for name, p in module.named_parameters():
        if name in reference_grads:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            errors[name] = (grad - reference_grads[name]).abs().max().item()
    return errors


def angle_tolerances(reference_grads) -> dict:
    """LRPE's learnable angles' gradients within 1e-12 of their largest one-process value (relative): the sum over
    ranks rounds in float64 (measured within 1e-14 relative), while a gradient rounded to float32 on each rank, as
    angles made float32 in a float64 model took (each rank's share rounded apart), is 1e-7 off."""
    largest = {name: grad.abs().max().item() for name, grad in reference_grads.items()}
    angles = [name for name in largest if name.endswith(("angles", "rotation.frequencies")) and largest[name] > 0]
    return {name: 1e-12 * largest[name] for name in angles}


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype is ``dtype`` inside: a model built there is made in ``dtype``, as transformers'
    ``from_config(..., dtype=...)`` and ``from_pretrained(..., dtype=...)`` make it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check(errors: dict, tolerances: dict, label: str, scale: str):
    """Print the largest difference against its tolerance (1e-10 unless ``tolerances`` names another); exit non-zero
    where one is exceeded."""
    tolerance = {name: tolerances.get(name, 1e-10) for name in errors}
    worst = max(errors, key=lambda name: errors[name] / tolerance[name])
    print(f"{label}: largest difference {errors[worst]:.2e} ({worst}), {scale}")
    if errors[worst] > tolerance[worst]:
        sys.exit(f"{label}: {worst} differ by {errors[worst]:.3e}")


def run_case(case, rank, size):
    torch.manual_seed(0)
    options = {key: case[key] for key in ("positional_encoding", "feature_map", "causal") if key in case}
    layer = LinearAttention(32, 4, max_positions=256, spe_realizations=8, chunk_size=8, **options).double().eval()
    with torch.no_grad():  # the learnable parts away from their initialisation, so that they are read
        for name, param in layer.named_parameters():
            if "angles" in name or "frequencies" in name or "gate" in name:
                param.mul_(1.0 + 0.3 * torch.rand(param.shape, dtype=param.dtype))
    x, mask, positions = inputs(case, torch.Generator().manual_seed(1))
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    reference_input = x.clone().requires_grad_()
    reference = layer(reference_input, attention_mask=mask, position_ids=positions)
    (reference * weights).sum().backward()
    reference_grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)

    piece = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size)
    local_input = x[:, piece].clone().requires_grad_()
    with context_parallel():
        out = layer(
            local_input,
            attention_mask=None if mask is None else mask[:, piece],
            position_ids=None if positions is None else positions[:, piece],
        )
    (out * weights[:, piece]).sum().backward()
    errors = {"outputs": (out - reference[:, piece]).abs().max().item()}
    errors["input gradients"] = (local_input.grad - reference_input.grad[:, piece]).abs().max().item()
    errors.update(gradient_errors(layer, reference_grads))
    tolerances = angle_tolerances(reference_grads)
    check(errors, tolerances, f"rank {rank}/{size} {case}", f"outputs up to {reference.abs().max().item():.2f}")


def run_model_case(case, rank, size):
    """A 2-layer LinearGPT (causal LM), LinearRoberta (masked LM) or LinearRoberta token classifier in float64,
    its loss and every gradient: each rank's loss is its tokens' sum over the whole sequence's count of scored
    tokens, so the ranks' losses add up to one process's; the causal LM takes the labels shifted over the whole
    sequence, sliced like the inputs. ``checkpointing`` ("reentrant" or "non_reentrant"): in training mode with
    gradient checkpointing, whose recomputation runs in backward, outside the ``context_parallel`` block (as the
    Trainer runs it); ``score_padding``: padding tokens keep their labels (their logits count); ``built_in_float64``:
    made in float64 as transformers makes a model given ``dtype=torch.float64`` (torch's default dtype while it is
    built), not converted by ``.double()`` afterwards, and every parameter must come out float64."""
    import lrpe_hf

    family = case["model"]
    torch.manual_seed(0)
    fields = dict(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, classifier_dropout=0.0, max_position_embeddings=128, num_labels=3,
        positional_encoding=case["positional_encoding"], absolute_position_embedding=case.get("absolute", "none"),
        spe_realizations=8,
    )  # fmt: skip
    with default_dtype(torch.float64 if case.get("built_in_float64") else torch.get_default_dtype()):
        if family == "gpt":
            model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(**fields))
        elif family == "token":
            model = lrpe_hf.LinearRobertaForTokenClassification(lrpe_hf.LinearRobertaConfig(**fields))
        else:
            model = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(**fields))
    if case.get("built_in_float64"):  # LRPE's learnable angles were made float32 there, their gradients float32
        dtypes = {name: p.dtype for name, p in model.named_parameters() if p.dtype != torch.float64}
        assert not dtypes, f"a model built in float64 holds parameters of other dtypes: {dtypes}"
    else:
        model = model.double()
    model.eval()
    if case.get("checkpointing"):
        reentrant = case["checkpointing"] == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, TOKENS), generator=generator)
    _, mask, positions = inputs(case, generator)
    labels = torch.randint(0, 3, ids.shape, generator=generator) if family == "token" else ids.clone()
    if family != "gpt":  # a masked LM or a token classifier scores some tokens only
        labels[torch.rand(ids.shape, generator=generator) > 0.3] = -100
    if mask is not None and not case.get("score_padding"):
        labels = labels.masked_fill(~mask, -100)
    extra = {} if mask is None else {"attention_mask": mask.long()}
    if positions is not None:
        extra["position_ids"] = positions

    reference = model(input_ids=ids, labels=labels, **extra)
    reference.loss.backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    piece = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size)
    if family == "gpt":
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        scored = int((shifted != -100).sum())
        targets = {"shift_labels": shifted[:, piece].contiguous(), "labels": labels[:, piece].contiguous()}
    else:
        scored, targets = int((labels != -100).sum()), {"labels": labels[:, piece].contiguous()}
    local = {name: value[:, piece].contiguous() for name, value in extra.items()}
    with context_parallel():
        out = model(input_ids=ids[:, piece].contiguous(), num_items_in_batch=scored, **targets, **local)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    errors = {"loss": (loss - reference.loss).abs().item()}
    errors["logits"] = (out.logits - reference.logits[:, piece]).abs().max().item()
    errors.update(gradient_errors(model, reference_grads))
    # transformers' masked-LM and token-classification losses sum in float32 (they cast the logits), so their sums
    # over ranks keep float32 rounding
    tolerances = {"loss": 1e-6} if family != "gpt" else {}
    tolerances.update(angle_tolerances(reference_grads))
    check(errors, tolerances, f"rank {rank}/{size} {case}", f"loss {reference.loss:.4f}")


def state_tensors(state, prefix="") -> dict:
    """Every tensor of a (nested) state dataclass, by its path."""
    from dataclasses import fields

    found = {}
    for f in fields(state):
        value = getattr(state, f.name)
        if isinstance(value, torch.Tensor):
            found[prefix + f.name] = value
        elif value is not None and hasattr(value, "__dataclass_fields__"):
            found.update(state_tensors(value, f"{prefix}{f.name}."))
    return found


def run_prefill_case(case, rank, size):
    """A prompt's prefill split over the ranks into a new LinearGPT cache (``use_cache=True``): on the last rank the
    cache equals one process's after the whole prompt (every layer's states and counters, and its token count),
    and four greedy-free decoding steps continued from it on that process give one process's logits."""
    import lrpe_hf

    torch.manual_seed(0)
    fields = dict(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, positional_encoding=case["positional_encoding"], spe_realizations=8,
    )  # fmt: skip
    if case.get("normalization"):
        fields["normalization"] = case["normalization"]
    model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(**fields)).double().eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, TOKENS), generator=generator)
    _, mask, _ = inputs(case, generator)
    extra = {} if mask is None else {"attention_mask": mask.long()}
    piece = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size)
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=True, **extra).past_key_values
        with context_parallel():
            local = {name: value[:, piece] for name, value in extra.items()}
            split = model(input_ids=ids[:, piece], use_cache=True, **local).past_key_values
        if rank == size - 1:
            errors = {"seen tokens": abs(split.seen_tokens - reference.seen_tokens)}
            for index, (ours, theirs) in enumerate(zip(split.states, reference.states)):
                want = state_tensors(theirs)
                got = state_tensors(ours)
                assert got.keys() == want.keys(), (got.keys(), want.keys())
                for name in want:
                    errors[f"layer {index} {name}"] = (got[name].double() - want[name].double()).abs().max().item()
            more = torch.randint(3, 60, (2, 4), generator=generator)
            full_mask = (
                torch.ones(2, TOKENS + 4, dtype=torch.long)
                if mask is None
                else torch.cat([mask.long(), torch.ones(2, 4, dtype=torch.long)], dim=1)
            )
            for step in range(4):
                step_inputs = dict(input_ids=more[:, step : step + 1], attention_mask=full_mask[:, : TOKENS + step + 1])
                ours = model(**step_inputs, past_key_values=split, use_cache=True).logits
                theirs = model(**step_inputs, past_key_values=reference, use_cache=True).logits
                errors[f"step {step} logits"] = (ours - theirs).abs().max().item()
            check(errors, {}, f"rank {rank}/{size} prefill {case}", "the last rank's cache and 4 steps from it")
        else:
            print(f"rank {rank}/{size} prefill {case}: split cache made")


def run_empty_rank_case(case, rank, size):
    """Two tokens over more ranks than that: every rank refuses, naming the cause, and none waits on the others."""
    import lrpe_hf

    config = lrpe_hf.LinearGPTConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    model = lrpe_hf.LinearGPTForCausalLM(config).double()
    ids = torch.tensor([[5, 6]])
    try:
        with context_parallel():
            model(ids[:, rank * 2 // size : (rank + 1) * 2 // size])
    except ValueError as error:
        assert "every rank to hold tokens" in str(error), error
        print(f"rank {rank}/{size} empty rank: refused ({error})")
    else:
        sys.exit(f"rank {rank}/{size}: a split with a rank holding no tokens was not refused")


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for case in json.loads(sys.argv[1]):
        if case.get("prefill"):
            run_prefill_case(case, rank, size)
        elif case.get("empty_rank"):
            run_empty_rank_case(case, rank, size)
        else:
            (run_model_case if "model" in case else run_case)(case, rank, size)
    dist.barrier()
    # every rank has passed every case: leave without tearing gloo down (its teardown at exit aborts now and then,
    # "terminate called without an active exception", after the work is done)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

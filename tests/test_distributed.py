"""FSDP2 training on two CPU processes (gloo) equals single-process training with the same global batch.

Two processes with per-device batch 2 against one process with batch 4: the same seed, dropout 0, AdamW at a
learning rate of 1e-2 for 4 steps (gradient clipping at norm 1 acts on the first step), LinearGPT with SPE
(``spe_sine``: one noise draw per step, shared by every layer) and tied input/output embeddings. The runs go
through tests/distributed_clm.py (run_clm.py plus a per-process record of every step, and the switch that lets
accelerate's FSDP run on CPU: see there).

Why the two could differ, and what holds them together:
- data: accelerate gives each process alternate per-device batches of one sampler (the same seeded
  permutation on every process), so the rows of rank 0 then rank 1 at a step are the single run's batch;
  checked from the records.
- loss: CLM blocks all have ``block_size`` tokens and no padding, so the mean over 4 rows equals the mean of
  the two processes' means over 2 rows; the logged losses and gradient norms are compared too.
- RNG: dropout is 0; SPE's training draws come from torch's global RNG, seeded alike on every process and
  consumed alike (the sampler's seed, then one draw per step), so both processes draw the single run's codes;
  checked from the records (RNG state and draw fingerprints).
- arithmetic: the global batch's gradient is summed in another order (per process, then across processes)
  and AdamW divides it by its own running RMS, so an update carries the gradient's relative rounding error:
  see the tolerances below.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.training import tokenizer as train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each comparison launches two processes, then one

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
OVERRIDES = {"hidden_dropout_prob": 0.0, "spe_realizations": 8}
STEPS = 4
FSDP = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "LinearTransformerLayer",
    "--fsdp_state_dict_type",
    "FULL_STATE_DICT",
    "--fsdp_reshard_after_forward",
    "true",
]
# float64: rounding errors of ~1e-16, amplified as in float32 (below), stay far under 1e-12 (measured: 4e-15).
FLOAT64_ATOL = 1e-12
# float32: measured 3e-6 to 5e-6. Each run rounds the global batch's gradient in its own order (relative error
# ~1e-7, more for entries that are near-cancelling sums), and AdamW's update lr * m / (sqrt(v) + eps) carries
# the gradient's relative error, not its absolute one; 4 steps at lr 1e-2 and the forward passes in between
# compound it. The float64 comparison of the same pipeline shows that this gap is rounding. A real mismatch
# moves weights by about lr = 1e-2 or more (training moves them by 2.5e-2; a rank whose weights did not come
# from rank 0 ends 4.3 away; a batch of 2 instead of 4 ends 5e-2 away), two orders above this tolerance.
FLOAT32_ATOL = 1e-4
# Context parallelism sums each gradient in another order again (the slices' parts, states combined across the
# split), with absolute rounding differences of ~1e-18 in entries that are near zero. AdamW divides by
# sqrt(v) + eps (eps 1e-8), so for such an entry an absolute gradient difference moves the weight by up to
# lr / eps = 1e6 times it: measured 3e-12 (one fc2 entry; the per-step gradient norms agree to 1e-12). A real
# mismatch moves weights by about lr = 1e-2, ten orders above.
CONTEXT_PARALLEL_FLOAT64_ATOL = 1e-10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command, env_extra):
    # PYTHONFAULTHANDLER: a process that aborts prints every thread's Python stack, which says where it was.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env_extra}
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def train_pair(workspace: Path, out: Path, model_arguments, fsdp_extra, env_extra):
    """The same training under FSDP on two processes (per-device batch 2) and on one process (batch 4)."""
    common = ["--tokenizer_name", workspace / "tokenizer", "--train_file", workspace / "train.txt"]
    common += [*model_arguments, "--block_size", "64", "--max_steps", STEPS, "--learning_rate", "1e-2"]
    common += ["--do_train", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]
    common += ["--save_strategy", "no", "--seed", "0", "--use_cpu"]
    script = ROOT / "tests/distributed_clm.py"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--main_process_port", free_port(), "--mixed_precision", "no", "--dynamo_backend", "no"]
    sharded, single = out / "fsdp", out / "single"
    fsdp_run = [*launch, *FSDP, *fsdp_extra, script, *common, "--per_device_train_batch_size", "2"]
    run([*fsdp_run, "--output_dir", sharded], env_extra)
    run([sys.executable, script, *common, "--per_device_train_batch_size", "4", "--output_dir", single], env_extra)
    return sharded, single


def records(folder: Path, world_size: int):
    found = [json.loads((folder / f"record-rank{rank}.json").read_text()) for rank in range(world_size)]
    assert [r["world_size"] for r in found] == [world_size] * world_size
    assert all(len(r["steps"]) == STEPS for r in found)
    return found


def max_difference(a: dict, b: dict, names) -> float:
    return max((a[name].double() - b[name].double()).abs().max().item() for name in names)


def assert_same_training_log(sharded: Path, single: Path, grad_norm_rel: float):
    """The logged loss of every step, and the gradient norm before clipping (which would show a gradient
    scaled by the number of processes, to which AdamW's update is blind). Transformers' ForCausalLMLoss
    computes the cross-entropy in float32 (``logits.float()``) whatever the model's dtype, so the logged mean
    is a float32 sum taken in another order: 1e-6. (Its gradient is per token, and not affected.)"""
    logs = [json.loads((folder / "trainer_state.json").read_text())["log_history"] for folder in (sharded, single)]
    steps = [[entry for entry in log if "loss" in entry] for log in logs]
    assert len(steps[0]) == len(steps[1]) == STEPS
    for ours, theirs in zip(*steps):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=grad_norm_rel)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A small corpus cut from the embedded Wikipedia leads and a tokenizer trained on it."""
    folder = tmp_path_factory.mktemp("distributed")
    lines = (ROOT / "data/wikipedia_leads/train.txt").read_text(encoding="utf-8").splitlines()
    (folder / "train.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    args = train_tokenizer.TokenizerArguments(
        output_dir=str(folder / "tokenizer"), train_files=[str(folder / "train.txt")], vocab_size=600
    )
    train_tokenizer.train_tokenizer(args)
    return folder


@pytest.fixture(scope="module")
def from_scratch(workspace):
    """A new spe_sine model in float64, built by every process from the seed, trained under FSDP and alone.
    accelerate launch turns --fsdp_cpu_ram_efficient_loading on by default; off here, so that each process
    shards the model it built itself (the meta-device path has its own test)."""
    model = ["--positional_encoding", "spe_sine", "--config_overrides", json.dumps(OVERRIDES)]
    for name, value in SIZES.items():
        model += [f"--{name}", value]
    no_meta = ["--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_sync_module_states", "false"]
    return train_pair(workspace, workspace / "from_scratch", model, no_meta, {"DISTRIBUTED_CLM_DTYPE": "float64"})


def test_fsdp_shards_every_parameter_during_training(from_scratch):
    sharded, single = from_scratch
    ranks = records(sharded, 2)
    for step in range(STEPS):
        parameters = [r["steps"][step]["parameters"] for r in ranks]
        assert parameters[0].keys() == parameters[1].keys()
        for name, first in parameters[0].items():
            second = parameters[1][name]
            assert first["dtensor"] and second["dtensor"], name
            assert first["placements"] == second["placements"] == ["S(0)"], name
            # the two local shards split dimension 0 of the full parameter between them
            assert first["local_shape"][0] + second["local_shape"][0] == first["shape"][0], name
            assert first["local_shape"][1:] == second["local_shape"][1:] == first["shape"][1:], name
    embedding = ranks[0]["steps"][0]["parameters"]["model.embed_tokens.weight"]
    assert embedding["local_shape"] == [300, 32] and embedding["shape"] == [600, 32]
    alone = records(single, 1)[0]["steps"][0]["parameters"]
    assert not any(p["dtensor"] for p in alone.values())
    assert alone.keys() == ranks[0]["steps"][0]["parameters"].keys()  # lm_head is embed_tokens: listed once


def test_both_processes_see_the_single_run_s_batches_and_spe_draws(from_scratch):
    sharded, single = from_scratch
    ranks, alone = records(sharded, 2), records(single, 1)[0]
    for step in range(STEPS):
        mine = [r["steps"][step] for r in ranks]
        reference = alone["steps"][step]
        assert mine[0]["rows"] + mine[1]["rows"] == reference["rows"], f"data order differs at step {step + 1}"
        assert mine[0]["rng"] == mine[1]["rng"] == reference["rng"], f"RNG state differs at step {step + 1}"
        assert len(reference["spe_draws"]) == 2  # the sine codes and the gates' noise, once per step
        assert mine[0]["spe_draws"] == mine[1]["spe_draws"] == reference["spe_draws"]
    assert len({step["spe_draws"][0] for step in alone["steps"]}) == STEPS  # a fresh draw at every step


def test_fsdp_training_equals_single_process_training_float64(from_scratch):
    sharded, single = from_scratch
    assert_same_training_log(sharded, single, grad_norm_rel=1e-12)
    ours, theirs = load_file(sharded / "model.safetensors"), load_file(single / "model.safetensors")
    assert ours["model.norm.weight"].dtype == torch.float64
    # The full state dict gathered from FSDP also holds lm_head.weight, which save_pretrained leaves out of a
    # single process's tied model; every other entry is common.
    assert set(theirs) <= set(ours) <= set(theirs) | {"lm_head.weight"}
    assert max_difference(ours, theirs, theirs) < FLOAT64_ATOL


def test_tied_embeddings_stay_tied_through_fsdp_and_its_checkpoint(from_scratch):
    sharded, single = from_scratch
    saved = load_file(sharded / "model.safetensors")
    if "lm_head.weight" in saved:
        assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    model = LinearGPTForCausalLM.from_pretrained(sharded)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = LinearGPTForCausalLM.from_pretrained(single)
    assert (model.lm_head.weight - reference.lm_head.weight).abs().max().item() < FLOAT64_ATOL


def test_meta_device_loading_under_fsdp_trains_to_the_single_process_weights_float32(workspace):
    """From a checkpoint with --fsdp_cpu_ram_efficient_loading (accelerate launch's default): accelerate moves
    the model to the meta device, shards it there and fills the shards from rank 0's weights by broadcast.
    Rank 1's own weights are scrambled first, so agreement shows that rank 0's weights reached it (without
    that path, the same scrambled run ends 4.3 away). float32, the dtype runs train in. With lrpe_orthogonal,
    the default encoding, whose tables are buffers: they are not in the state dict (accelerate 1.15's
    fsdp2_load_full_state_dict handles only sharded entries; accelerate issue #3898) and each process re-creates
    them from the config."""
    out = workspace / "from_checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LinearGPTConfig(
        vocab_size=len(tokenizer), positional_encoding="lrpe_orthogonal", pad_token_id=tokenizer.pad_token_id,
        **special, **SIZES, **OVERRIDES
    )  # fmt: skip
    torch.manual_seed(1)
    LinearGPTForCausalLM(config).save_pretrained(out / "checkpoint")
    sharded, single = train_pair(
        workspace,
        out,
        ["--model_name_or_path", out / "checkpoint"],
        ["--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "true"],
        {"DISTRIBUTED_CLM_SCRAMBLE_OTHER_RANKS": "1"},
    )
    ranks = records(sharded, 2)
    assert [r["scrambled"] for r in ranks] == [False, True]
    assert all(p["dtensor"] for r in ranks for p in r["steps"][-1]["parameters"].values())
    assert_same_training_log(sharded, single, grad_norm_rel=1e-5)
    ours, theirs = load_file(sharded / "model.safetensors"), load_file(single / "model.safetensors")
    assert ours["model.norm.weight"].dtype == torch.float32
    assert max_difference(ours, theirs, theirs) < FLOAT32_ATOL
    start = load_file(out / "checkpoint" / "model.safetensors")
    assert max_difference(theirs, start, theirs) > 100 * FLOAT32_ATOL  # training moved the weights


def launched_and_alone(workspace, folder: str, encoding: str, processes: int, extra=()):
    """The same float64 training of ``encoding`` on ``processes`` CPU processes (accelerate launch --multi_gpu,
    per-device batch 2, the script's ``extra`` arguments) and on one process with batch 4 (the global batch of two
    data-parallel processes or groups): returns the two output folders."""
    common = ["--tokenizer_name", workspace / "tokenizer", "--train_file", workspace / "train.txt"]
    common += ["--positional_encoding", encoding, "--config_overrides", json.dumps(OVERRIDES)]
    for name, value in SIZES.items():
        common += [f"--{name}", value]
    common += ["--block_size", "64", "--max_steps", STEPS, "--learning_rate", "1e-2", "--do_train"]
    common += ["--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
    common += ["--seed", "0", "--use_cpu"]
    script = ROOT / "tests/distributed_clm.py"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", processes, "--multi_gpu"]
    launch += ["--num_machines", "1", "--main_process_port", free_port(), "--mixed_precision", "no"]
    launch += ["--dynamo_backend", "no"]
    launched, single = workspace / folder / "launched", workspace / folder / "single"
    environment = {"DISTRIBUTED_CLM_DTYPE": "float64"}
    run([*launch, script, *common, "--per_device_train_batch_size", "2", *extra, "--output_dir", launched], environment)
    run([sys.executable, script, *common, "--per_device_train_batch_size", "4", "--output_dir", single], environment)
    return launched, single


@pytest.fixture(scope="module")
def data_parallel_runs(workspace):
    """The same float64 training (rope) under DDP on two CPU processes (per-device batch 2) and on one process
    with batch 4."""
    return launched_and_alone(workspace, "data_parallel", "rope", 2)


def test_ddp_training_on_two_processes_equals_one_process_float64(data_parallel_runs):
    """DDP (what accelerate launch runs on CPU processes without FSDP): each process saw its half of the single
    run's batch, and the losses, gradient norms and weights equal one process's with the whole batch."""
    ddp, single = data_parallel_runs
    ranks, alone = records(ddp, 2), records(single, 1)[0]
    for step in range(STEPS):
        assert ranks[0]["steps"][step]["rows"] + ranks[1]["steps"][step]["rows"] == alone["steps"][step]["rows"]
    assert not any(p["dtensor"] for p in ranks[0]["steps"][0]["parameters"].values())  # DDP: whole parameters
    assert_same_training_log(ddp, single, grad_norm_rel=1e-12)
    ours, theirs = load_file(ddp / "model.safetensors"), load_file(single / "model.safetensors")
    assert ours.keys() == theirs.keys() and ours["model.norm.weight"].dtype == torch.float64
    assert max_difference(ours, theirs, theirs) < FLOAT64_ATOL


@pytest.fixture(scope="module")
def context_parallel_runs(workspace):
    """The same float64 training (permute: a decay, so the ranks' states combine with their decays) on four
    processes, 2 x 2 (``--context_parallel_size 2``: two data-parallel groups of two processes, each splitting its
    64-token blocks in halves; per-device batch 2), with reentrant gradient checkpointing (its recomputation runs
    in backward, outside the block the Trainer's forward ran in), and on one process with batch 4 without it. The
    sampler hands the two groups the batches one process of batch 4 takes, in the same order."""
    extra = ["--context_parallel_size", "2", "--gradient_checkpointing", "true"]
    extra += ["--gradient_checkpointing_kwargs", json.dumps({"use_reentrant": True})]
    return launched_and_alone(workspace, "context_parallel", "permute", 4, extra)


def test_context_parallel_training_on_2_x_2_processes_equals_one_process_float64(context_parallel_runs):
    """Each process scored half of each of its group's rows (its records hold 32-token slices) and the weights,
    losses and gradient norms equal one process's: the slices' losses and gradients add up to the whole batch's."""
    split, single = context_parallel_runs
    ranks = records(split, 4)
    assert [len(step["rows"]) for step in ranks[0]["steps"]] == [2] * STEPS
    assert_same_training_log(split, single, grad_norm_rel=1e-12)
    ours, theirs = load_file(split / "model.safetensors"), load_file(single / "model.safetensors")
    assert ours.keys() == theirs.keys() and ours["model.norm.weight"].dtype == torch.float64
    assert max_difference(ours, theirs, theirs) < CONTEXT_PARALLEL_FLOAT64_ATOL


def test_context_parallel_size_must_divide_the_processes(workspace, tmp_path):
    from lrpe_hf.training.language_modeling import main

    arguments = ["--tokenizer_name", workspace / "tokenizer", "--train_file", workspace / "train.txt"]
    arguments += ["--block_size", "64", "--max_steps", "1", "--report_to", "none", "--use_cpu"]
    arguments += ["--context_parallel_size", "2", "--output_dir", tmp_path, "--positional_encoding", "permute"]
    with pytest.raises(ValueError, match="--context_parallel_size 2 needs a number of processes that it divides"):
        main("clm", arguments)


def test_the_docs_context_parallel_snippet_run_on_two_processes_gives_one_process_loss(tmp_path):
    """docs/training.md's context-parallel snippet, as written, under torchrun on 2 processes and on 1: every rank
    builds the same weights and sequence, so the ranks' summed loss is one process's (float32)."""
    pages = (ROOT / "docs" / "training.md").read_text()
    (snippet,) = [s for s in re.findall(r"```python\n(.*?)```", pages, flags=re.S) if "context_parallel()" in s]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    losses = []
    for processes in (1, 2):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [*command, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=environment
        )
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(float(re.search(r"loss (\S+)", result.stdout).group(1)))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)

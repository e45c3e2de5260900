import shutil
from pathlib import Path

import pytest
import torch

from lrpe_hf import LinearAttention

ROOT = Path(__file__).resolve().parents[1]

# Every encoding is tested with elu and with this second map; together they cover all five maps.
# Each built-in encoding's second feature map in the sweeps (its default is elu, or its paper's); any other
# registered encoding is swept with relu.
SECOND_FEATURE_MAPS = {
    "none": "exp",
    "rope": "performer",
    "lrpe_unitary": "relu",
    "lrpe_orthogonal": "exp",
    "lrpe_permutation": "dpfp",
    "permute": "relu",
    "spe_sine": "exp",
    "spe_conv": "performer",
    "fastrpb": "exp",
}


def second_feature_map(encoding: str) -> str:
    """The feature map a sweep tries beside the default for ``encoding``."""
    return SECOND_FEATURE_MAPS.get(encoding, "relu")


SMALL = dict(spe_realizations=4, spe_sines=2, spe_kernel_size=3, max_positions=64)


def make_layer(positional_encoding="none", hidden_size=16, num_heads=2, seed=0, **options):
    """A small float64 layer in eval mode whose optional parameters are randomised (so a test sees them)."""
    torch.manual_seed(seed)
    kwargs = {**SMALL, **options}
    layer = LinearAttention(hidden_size, num_heads, positional_encoding=positional_encoding, **kwargs)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("weights") and "positional_encoding" in name:  # FastRPB starts at zero
                param.normal_(0.0, 0.3)
            elif "gate_logits" in name:
                param.normal_(0.0, 1.0)
            elif name.endswith("frequencies") or name.endswith("angles"):
                param.mul_(1.0 + 0.2 * torch.rand_like(param))
            elif "output_norm" in name:
                param.normal_(1.0, 0.2)
            elif "feature_map" in name:  # learned maps (hedgehog, t2r): away from their initialisation
                param.add_(0.3 * torch.randn_like(param))
    return layer.double().eval()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


# The run scripts' tests: a tiny model, and quiet runs that save nothing but the final model.
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--intermediate_size", "64"]
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0"]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A small corpus cut from the embedded Wikipedia leads and a tokenizer trained on it."""
    from lrpe_hf.training import tokenizer as train_tokenizer  # here: the GPU tests run without the train extra

    folder = tmp_path_factory.mktemp("scripts")
    lines = (ROOT / "data/wikipedia_leads/train.txt").read_text(encoding="utf-8").splitlines()
    (folder / "train.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    (folder / "validation.txt").write_text("\n".join(lines[300:340]) + "\n", encoding="utf-8")
    args = train_tokenizer.TokenizerArguments(
        output_dir=str(folder / "tokenizer"), train_files=[str(folder / "train.txt")], vocab_size=600
    )
    train_tokenizer.train_tokenizer(args)
    return folder


def save_tiny_bert(workspace, folder, max_position_embeddings: int):
    """A random 2 x 32 BERT with the workspace's tokenizer, saved in ``folder``: it stands in for all-MiniLM-L6-v2,
    which the benchmarks fetch and the tests never download."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(workspace / "tokenizer")
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=max_position_embeddings, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_to_repeat(model, steps: int = 300, period: int = 6, seed: int = 0):
    """Trains a causal LM in place (AdamW, 300 steps of 16 rows: about two seconds) to continue a sequence by
    repeating its last ``period`` tokens, and returns it in eval mode. An untrained model emits nearly the same tokens
    whatever its context, so a test of generation that compares tokens could not fail; this one's next tokens are
    read from its prompt."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        pattern = torch.randint(3, model.config.vocab_size, (16, period), generator=generator)
        ids = pattern.repeat(1, 3)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.fixture(scope="session")
def repeating_gpt():
    """A 2 x 32 LinearGPT (PermuteFormer, vocabulary 60, pad 0) trained to repeat its prompt's last 6 tokens."""
    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    torch.manual_seed(0)
    config = LinearGPTConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        pad_token_id=0, eos_token_id=None, positional_encoding="permute",
    )  # fmt: skip
    return train_to_repeat(LinearGPTForCausalLM(config))


def hub_cache_snapshot(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of ``repo_id``'s main revision in a Hub cache at ``cache`` ($HF_HOME), made with its
    ``refs/main``, as the Hub's download leaves it: a fresh process loads it by name offline (HF_HUB_OFFLINE=1)."""
    revision = "0" * 40
    repo = cache / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def copy_into_hub_cache(folder: Path, cache: Path, repo_id: str, ignore_patterns=()) -> Path:
    """``folder`` (a saved checkpoint) as ``repo_id`` in the Hub cache at ``cache``; returns its snapshot."""
    snapshot = hub_cache_snapshot(cache, repo_id)
    shutil.copytree(folder, snapshot, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*ignore_patterns))
    return snapshot

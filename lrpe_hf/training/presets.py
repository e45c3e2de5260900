"""The comparison tool's presets (the papers' headline comparisons at small scale) and the papers' claims each
tests.

A preset names its task, what it mirrors, its encodings, its claims and its settings per profile over the task's
profile (``compare.py``). A claim says that one encoding scores better than another on a metric, as the paper
reports; ``verdicts.py`` tests each with the one verdict rule. This module imports nothing of the comparison tool,
so the tool, the verdicts and the docs' table builder all import it and none of them each other in a circle.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """``better`` scores better than ``worse`` on ``metric``, as the paper reports (``paper``: its figures)."""

    better: str
    worse: str
    metric: str
    paper: str


# "<encoding>@authors": the encoding in the model its authors' code builds, where the library's default differs
# (docs/results.md, "Each encoding's defaults"): the config fields, given the model's hidden size. The LRPE
# authors normalise the attention output with one LayerNorm over the hidden width, scale token embeddings by
# sqrt(d) and keep sinusoidal absolute positions; the library's LRPE divides by RoFormer's unrotated denominator.
# "<encoding>@<change>" makes one of those changes alone, to tell which of them costs what.
AUTHORS_SETUP_SUFFIX = "@authors"


def lrpe_authors_changes(hidden_size: int) -> dict[str, dict]:
    """Each change of the LRPE authors' setup from the library's default, by name: its config fields."""
    return dict(
        output_layer_norm=dict(normalization="output_layer_norm"),
        embedding_multiplier=dict(embedding_multiplier=hidden_size**0.5),
        sinusoidal=dict(absolute_position_embedding="sinusoidal"),
    )


def lrpe_setup(setup: str, hidden_size: int) -> dict:
    """The config fields of ``setup``: "authors" (every change at once) or one change's name."""
    changes = lrpe_authors_changes(hidden_size)
    if setup == "authors":
        return {field: value for change in changes.values() for field, value in change.items()}
    return changes[setup]


AUTHORS_SETUPS = {name: lrpe_setup for name in ("lrpe_unitary", "lrpe_orthogonal", "lrpe_permutation")}
SETUP_NAMES = ("authors", *lrpe_authors_changes(1))


def split_setup(encoding: str) -> tuple[str, str]:
    """``"lrpe_orthogonal@authors"`` -> ``("lrpe_orthogonal", "@authors")``; a plain name -> ``(name, "")``."""
    name, at, setup = encoding.partition("@")
    return name, at + setup


def with_authors_setups(claims: list[Claim], encodings: set[str]) -> list[Claim]:
    """The claims, each followed by its form with every encoding that has an authors' setup in it, where those ran
    (the paper's figures are the authors' setup's; two LRPE types are compared in the same setup)."""
    expanded = []
    for claim in claims:
        expanded.append(claim)
        better, worse = (n + AUTHORS_SETUP_SUFFIX if n in AUTHORS_SETUPS else n for n in (claim.better, claim.worse))
        if (better, worse) != (claim.better, claim.worse) and {better, worse} <= encodings:
            expanded.append(Claim(better, worse, claim.metric, claim.paper))
    return expanded


TABLE2_ENCODINGS = [
    "none", "sinusoidal", "learned", "rope", "permute", "spe_sine", "lrpe_unitary", "lrpe_orthogonal",
    "lrpe_permutation", "fastrpb", "softmax:rope",
]  # fmt: skip
SYNTHETIC_ENCODINGS = [
    "none", "learned", "rope", "permute", "spe_sine", "lrpe_orthogonal", "fastrpb", "softmax:rope",
]  # fmt: skip

# The papers' claims each preset tests (``verdicts.py``): the better encoding, the worse, the metric, the figures.
TABLE2_CLAIMS = [
    Claim("lrpe_unitary", "rope", "perplexity", "Type 1 31.83 against RoPE 33.36"),
    Claim("lrpe_orthogonal", "rope", "perplexity", "Type 2 32.02 against RoPE 33.36"),
    Claim("lrpe_unitary", "permute", "perplexity", "Type 1 31.83 against PER 32.88"),
    Claim("lrpe_orthogonal", "permute", "perplexity", "Type 2 32.02 against PER 32.88"),
    Claim("lrpe_unitary", "lrpe_orthogonal", "perplexity", "Type 1 31.83 against Type 2 32.02"),
    Claim("lrpe_orthogonal", "lrpe_permutation", "perplexity", "Type 2 32.02 against Type 3 33.81"),
    Claim("permute", "rope", "perplexity", "PER 32.88 against RoPE 33.36"),
    Claim("rope", "none", "perplexity", "RoPE 33.36 against NoPE 35.96"),
    Claim("sinusoidal", "none", "perplexity", "Base 33.97 against NoPE 35.96"),
    Claim("none", "spe_sine", "perplexity", "NoPE 35.96 against SPE 43.36"),
]
TABLE1_CLAIMS = [
    Claim("lrpe_orthogonal", "rope", "pretrain_perplexity", "loss: Type 2 5.12 against RoPE 5.17"),
    Claim("lrpe_orthogonal", "sinusoidal", "pretrain_perplexity", "loss: Type 2 5.12 against Base 5.35"),
    Claim("rope", "sinusoidal", "pretrain_perplexity", "loss: RoPE 5.17 against Base 5.35"),
    Claim("sinusoidal", "spe_sine", "pretrain_perplexity", "loss: Base 5.35 against SPE 6.07"),
    Claim("lrpe_orthogonal", "rope", "finetune_accuracy", "SST-2: Type 2 91.90 against RoPE 90.65"),
    Claim("lrpe_orthogonal", "sinusoidal", "finetune_accuracy", "SST-2: Type 2 91.90 against Base 89.91"),
]
# LRPE Table 3 (DeiT-small on ImageNet-1k). The paper's Base is its linear transformer with sinusoidal positions
# (LRPE section 4, "Competing methods"); the claims test it against ``sinusoidal``, and again against the learned
# table (ViT's and DeiT's own) standing in for it, which the paper did not run.
IMAGE_CLAIMS = [
    Claim("lrpe_orthogonal", "rope", "accuracy", "Type 2 78.77 against RoPE 78.64"),
    Claim("lrpe_orthogonal", "learned", "accuracy", "Type 2 78.77 against Base 78.04 (learned table in Base's place)"),
    Claim("lrpe_unitary", "learned", "accuracy", "Type 1 78.60 against Base 78.04 (learned table in Base's place)"),
    Claim("rope", "learned", "accuracy", "RoPE 78.64 against Base 78.04 (learned table in Base's place)"),
    Claim("learned", "permute", "accuracy", "Base 78.04 against PER 77.81 (learned table in Base's place)"),
    Claim("learned", "lrpe_permutation", "accuracy", "Base 78.04 against Type 3 77.72 (learned table in Base's place)"),
    Claim("lrpe_orthogonal", "sinusoidal", "accuracy", "Type 2 78.77 against Base 78.04"),
    Claim("lrpe_unitary", "sinusoidal", "accuracy", "Type 1 78.60 against Base 78.04"),
    Claim("rope", "sinusoidal", "accuracy", "RoPE 78.64 against Base 78.04"),
    Claim("sinusoidal", "permute", "accuracy", "Base 78.04 against PER 77.81"),
    Claim("sinusoidal", "lrpe_permutation", "accuracy", "Base 78.04 against Type 3 77.72"),
]

# Each preset: the task, what it mirrors, its encodings, its claims, and per-profile settings over the task's
# profile.
PRESETS = {
    "lrpe_table2": dict(
        task="clm",
        mirrors="LRPE (Qin et al.) Table 2: autoregressive LM perplexity (WikiText-103); here the Wikipedia leads",
        encodings=TABLE2_ENCODINGS,
        claims=TABLE2_CLAIMS,
        quick={},
        medium={},
        full={},
    ),
    "lrpe_table1": dict(
        task="mlm",
        mirrors="LRPE Table 1: bidirectional masked-LM pretraining, then GLUE fine-tuning; here the Wikipedia leads, "
        "then tweet sentiment",
        # the paper's rows: Base (sinusoidal), RoPE, SPE, PER, Type 1, 2, 3
        encodings=["sinusoidal", "rope", "spe_sine", "permute", "lrpe_unitary", "lrpe_orthogonal", "lrpe_permutation"],
        claims=TABLE1_CLAIMS,
        quick={},
        medium={},
        full={},
    ),
    "image": dict(
        task="image",
        mirrors="LRPE Table 3 (DeiT, ImageNet-1k), PermuteFormer's and FastRPB's image results; here LinearViT on "
        "the Fashion-MNIST subset",
        encodings=[
            "none",
            "learned",
            "sinusoidal",
            "rope",
            "permute",
            "spe_sine",
            "spe_conv",
            "lrpe_unitary",
            "lrpe_orthogonal",
            "lrpe_permutation",
            "fastrpb",
            "softmax:learned",
        ],  # fmt: skip
        claims=IMAGE_CLAIMS,
        # spe_conv's 2D filters of 128 (the paper's 1D length) cost 40x those of 16, which span every offset of
        # the 8 x 8 positions (7 x 7 patches and the class token) already
        quick=dict(config_overrides='{"spe_kernel_size": 16}'),
        medium=dict(config_overrides='{"spe_kernel_size": 16}'),
        full=dict(config_overrides='{"spe_kernel_size": 16}'),
    ),
    "extrapolation": dict(
        task="clm",
        mirrors="length extrapolation (RoFormer, PermuteFormer, FastRPB discuss it): train at one length, evaluate "
        "at 1x to 16x",
        encodings=["none", "sinusoidal", "rope", "permute", "spe_sine", "lrpe_orthogonal", "fastrpb", "softmax:rope"],
        quick=dict(block_size=64, eval_lengths=[64, 128, 256, 512, 1024], max_eval_samples=160),  # 10k tokens
        medium=dict(block_size=128, eval_lengths=[128, 256, 512, 1024, 2048], max_eval_samples=160),  # 20k tokens
        full=dict(block_size=128, eval_lengths=[128, 256, 512, 1024, 2048]),
    ),
    "synthetic_copy": dict(
        task="copy",
        mirrors="a task only relative position solves: output the token 4 positions back",
        encodings=SYNTHETIC_ENCODINGS,
        quick={},
        medium={},
        full={},
    ),
    "synthetic_recall": dict(
        task="recall",
        mirrors="multi-query associative recall (Zoology, H3): find the key, read the value after it",
        encodings=SYNTHETIC_ENCODINGS,
        quick=dict(synthetic_vocab_size=16),  # 8 pairs of 16 keys and 16 values: learnable in 120 steps
        medium={},
        full={},
    ),
}

"""Run by `make test-wheel` with the interpreter of a fresh virtual environment into which the wheel built from this
checkout was installed (with its `train` extra), from a folder outside the checkout: what a user who installs the
package gets imports, builds and runs a tiny model of each family, carries its package data, and lists its scripts."""

import subprocess
import sys
from importlib import resources
from pathlib import Path

import torch

import lrpe_hf

assert "site-packages" in Path(lrpe_hf.__file__).parts, f"lrpe_hf was imported from {lrpe_hf.__file__}"
SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)

gpt = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(vocab_size=50, eos_token_id=None, **SIZES)).eval()
generated = gpt.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
assert generated.shape == (1, 7), generated.shape
roberta = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(vocab_size=50, **SIZES)).eval()
assert roberta(torch.tensor([[0, 5, 6, 2]])).logits.shape == (1, 4, 50)
vit = lrpe_hf.LinearViTForImageClassification(lrpe_hf.LinearViTConfig(image_size=16, patch_size=4, **SIZES)).eval()
assert vit(torch.randn(1, 3, 16, 16)).logits.shape == (1, 2)

training = resources.files("lrpe_hf.training")
for name in ("model_cards/linear_gpt.md", "model_cards/linear_roberta.md", "model_cards/linear_vit.md"):
    assert training.joinpath(name).is_file(), f"package data missing: {name}"
assert training.joinpath("metrics/glue/glue.py").is_file(), "package data missing: metrics/glue/glue.py"

listing = subprocess.run([sys.executable, "-m", "lrpe_hf", "--help"], capture_output=True, text=True, check=True)
assert "run_clm" in listing.stdout, listing.stdout
script = subprocess.run([sys.executable, "-m", "lrpe_hf", "run_clm", "--help"], capture_output=True, text=True)
assert script.returncode == 0 and "--positional_encoding" in script.stdout, script.stderr[-2000:]
print(f"installed lrpe_hf {lrpe_hf.__file__}: models, package data and scripts ok")

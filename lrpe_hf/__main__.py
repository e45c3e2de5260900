"""``python -m lrpe_hf``: the run scripts, from an installed package or a source checkout (``python
run_scripts/<script>.py`` runs the same code). ``python -m lrpe_hf <script> --help`` shows a script's options.
Only the chosen script's module is imported, so the list of scripts prints without the training stack."""

import importlib
import sys

# name: (what it does, module under lrpe_hf.training, its entry point, the entry point's arguments)
SCRIPTS = {
    "train_tokenizer": ("train a byte-level BPE tokenizer on text files", "tokenizer", "main", ()),
    "run_mlm": ("pretrain LinearRoberta with masked language modelling", "language_modeling", "main", ("mlm",)),
    "run_clm": ("train LinearGPT as a causal language model", "language_modeling", "main", ("clm",)),
    "run_glue": ("fine-tune for sequence classification (GLUE or csv/json)", "glue", "main", ()),
    "run_image_classification": ("train LinearViT on an image folder", "image_classification", "main", ()),
    "compare_encodings": (
        "compare positional encodings: sweeps, tables and plots (--preset NAME)",
        "compare",
        "main",
        (),
    ),
    "run_linearize": ("convert a GPT-2/RoBERTa/BERT/ViT checkpoint to linear attention", "linearization", "main", ()),
}


def usage() -> str:
    lines = ["usage: python -m lrpe_hf <script> [options]   (python -m lrpe_hf <script> --help for its options)", ""]
    lines += ["scripts:"] + [f"  {name:<26}{about}" for name, (about, *_) in SCRIPTS.items()]
    return "\n".join(lines)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(usage())
        return
    name = sys.argv[1]
    if name not in SCRIPTS:
        sys.exit(f"unknown script {name!r}\n\n{usage()}")
    _, module, function, arguments = SCRIPTS[name]
    sys.argv = [f"python -m lrpe_hf {name}", *sys.argv[2:]]
    getattr(importlib.import_module(f"lrpe_hf.training.{module}"), function)(*arguments)


if __name__ == "__main__":
    main()

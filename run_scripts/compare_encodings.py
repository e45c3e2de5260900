"""Compare positional encodings (and softmax / absolute baselines) under the same budget and seeds: tables, plots.

Examples, presets and options: lrpe_hf/training/compare.py, or ``python run_scripts/compare_encodings.py --help``.
"""

from lrpe_hf.training.compare import main

if __name__ == "__main__":
    main()

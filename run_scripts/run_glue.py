"""Fine-tune a LinearRoberta (or LinearGPT) checkpoint on a GLUE task or on your own csv/json files.

Examples and options: lrpe_hf/training/glue.py, or ``python run_scripts/run_glue.py --help``.
"""

from lrpe_hf.training.glue import main

if __name__ == "__main__":
    main()

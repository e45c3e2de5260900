"""Model code. Files here import only their siblings, so that checkpoints can carry them as remote code."""

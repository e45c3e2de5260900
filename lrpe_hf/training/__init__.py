"""Helpers for the run scripts: command-line model arguments, data loading, metrics, model cards, plots."""

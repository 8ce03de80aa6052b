"""Evaluation tasks: each runs a model with one ``AlisaConfig`` and returns plain metrics."""

"""Experiment kinds: one module per kind owns how a point of that kind runs and what its result holds."""

"""Prism's own GPU kernels and their per-GPU settings (tuning.py, configs/). Imports no model
architecture: the models choose among these, never the other way round."""

"""Prism: many LLMs on few GPUs, one process, one balloon of GPU memory."""

__version__ = "0.1.0"

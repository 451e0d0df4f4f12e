"""Blink: LLM serving whose steady state needs no host CPU."""

__version__ = "0.1.0"

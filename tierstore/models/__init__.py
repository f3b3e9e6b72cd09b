"""Small models shipped for the demo, tests and benchmarks."""

from .gpt import GPT, GPTConfig, synthetic_batches

__all__ = ["GPT", "GPTConfig", "synthetic_batches"]

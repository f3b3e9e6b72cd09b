"""Benchmarks behind ``tierstore bench`` and the scripts in ``benchmarks/``."""

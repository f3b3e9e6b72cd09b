"""Fault injection for tests and ``benchmarks/bench_faults.py``: crashes, corruption, full disks."""

"""Benchmarks: shardlang against PyTorch FSDP2 and DDP, side by side (``python -m benchmarks``).

Not tests: nothing here asserts a time. See docs/benchmarks.md, and `compare` for the entry point.
"""

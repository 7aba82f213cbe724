"""Benchmarks: scripts, not timed tests. `python -m rollout.bench --help`."""

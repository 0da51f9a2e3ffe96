"""Benchmarks: scripts run as `python bench/NAME.py`; shared parts in
`bench.common`."""

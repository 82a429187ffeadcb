"""Benchmark scripts (run them: `python bench/loader.py`) and their method, `bench.lib`. Never
imported by gpu_lab: the package holds what users call, this folder the instruments."""

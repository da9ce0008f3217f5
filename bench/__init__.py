"""Benchmarks (docs/benchmarks.md): one script per measurement, run as `python -m bench.X`.

Shared pieces: bench/common.py (the GPU benchmarks' shapes, builders, timing and environment),
bench/report.py (Markdown rendering and writing results), bench/load_results.py (the load test's
summaries and files).
"""

"""Benchmarks (docs/benchmarks.md): one script per measurement, run as `python -m bench.X`.

Shared pieces: bench/common.py (shapes, builders, timing and environment), bench/report.py
(Markdown rendering and writing results), bench/load_results.py (the load test's summaries and
files), bench/host_reads.py (counting device->host reads), bench/step_overhead_report.py and
bench/gpu_check_report.py (those benchmarks' records and reports).
"""

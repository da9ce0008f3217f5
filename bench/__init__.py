"""Benchmarks (docs/benchmarks.md): one script per measurement, run as `python -m bench.X`; the GPU
measurements are one package, bench/gpu_check/ (`python -m bench.gpu_check` is the GPU check,
`python -m bench.gpu_check.costs` the step-cost study).

Shared pieces: bench/common.py (shapes, builders, timing and environment), bench/report.py
(writing results, compact JSON, and the load test's Markdown), bench/load_results.py (the load
test's summaries and files), bench/host_reads.py (counting device->host reads),
bench/step_overhead_report.py (that benchmark's records and report).
"""

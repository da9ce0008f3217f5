"""GPU measurements at Qwen3-8B / Domino-b16 shapes (random weights; `--scale 16` runs them on a CPU).

- driver.py: the GPU check, `python -m bench.gpu_check`, one process inside the device machine's
  limits; its parts (parts.py, correctness.py) share the run's state (state.py) and write
  summary.md (summary.py);
- planted.py: the planted copy target and the oracle drafter that force acceptance to a chosen
  tau, what the check decodes with;
- costs.py: what each part of one speculative step costs, `python -m bench.gpu_check.costs` (its report:
  costs_report.py).
"""

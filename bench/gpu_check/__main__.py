"""`python -m bench.gpu_check`: the GPU check (bench/gpu_check/driver.py says what it measures)."""

from bench.gpu_check.driver import main

main()

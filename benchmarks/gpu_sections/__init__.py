"""The sections of benchmarks/gpu_check.py, one module each, and what they share."""

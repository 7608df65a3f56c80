"""Benchmark workloads behind ``dcr bench``."""

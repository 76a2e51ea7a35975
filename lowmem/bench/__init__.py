"""Benchmarks: each prints a table of figures measured in one run."""

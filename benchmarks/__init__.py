"""Benchmarks: programs that print tables (`make bench`)."""

"""Benchmarks behind `kvgate bench ...`."""

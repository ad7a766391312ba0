"""Benchmarks behind `kvserve bench`: offline throughput and an online serving load."""

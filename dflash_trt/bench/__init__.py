"""Benchmarks: the same session with drafting on and off, on the same requests, interleaved."""

"""Benchmark-only Triton kernels: instruments the experiments time beside the library's kernels."""

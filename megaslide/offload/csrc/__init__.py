"""C++ sources of the offload package's CPU kernels and the helper that builds them (build.py)."""

"""Triton kernels, each beside its torch reference (the reference is the CPU path)."""

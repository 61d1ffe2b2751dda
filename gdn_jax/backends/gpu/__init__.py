"""Kernels for NVIDIA GPUs, written in Pallas (its Triton backend), and where the steps use them."""

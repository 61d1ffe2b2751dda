"""XLA's CPU backend: compiled kernels (csrc/) and the machine's measured choices."""

"""Pallas kernels: `portable` (generic Pallas; Triton lowering on GPU, interpret mode on CPU)."""

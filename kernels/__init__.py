"""Triton kernels for the INT2 KV cache, each beside a plain-torch reference."""

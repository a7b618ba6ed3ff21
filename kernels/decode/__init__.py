"""Decode attention over the INT2/BF16 store (``reference``, ``triton_kernel``; ``bf16_baseline`` for benchmarks)."""

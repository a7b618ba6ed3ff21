"""Re-pin of the live windows of the hot side pool (``reference``: torch, ``triton_kernel``: Triton)."""

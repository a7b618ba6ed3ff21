"""Write path: rotate, clip, quantize and store new K/V rows (``reference``: torch, ``triton_kernel``: Triton)."""

"""Extend (prefill) attention: new tokens over a cached prefix from the store (``reference``, ``triton_kernel``)."""

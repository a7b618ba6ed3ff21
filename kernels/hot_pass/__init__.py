"""A decode pass of the hot side pool's bookkeeping in a few launches (``triton_kernel``; its reference is
``HotSet``'s general torch path, ``oscar_sglang/sglang/hot.py``)."""

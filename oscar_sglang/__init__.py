"""oscar-sglang: a 2-bit (INT2) KV cache for SGLang with attention-aware rotations.

The numerics (``format``, ``rotation``, ``artifacts``) are plain torch and
never import SGLang; the SGLang glue lives in ``oscar_sglang.sglang`` only.
"""

__version__ = "0.1.0"

"""Stand-in for ``sgl_kernel.kvcacheio``: SGLang imports its ``transfer_kv_*`` names
at module level on CUDA (host KV pools for hierarchical caching), but a plain
server never calls them.  Every name raises NotImplementedError when called."""

from ._standin import module_getattr

__getattr__ = module_getattr(__name__)

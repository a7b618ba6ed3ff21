"""Stand-in for ``sgl_kernel.quantization``: SGLang's GGUF quantization module imports
its ``ggml_*`` names at module level on CUDA, but a BF16 model never calls them.
Every name raises NotImplementedError when called."""

from ._standin import module_getattr

__getattr__ = module_getattr(__name__)

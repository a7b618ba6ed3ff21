"""Stand-in for ``sgl_kernel.utils``: SGLang's Triton attention backend imports
``is_arch_support_pdl`` from here on CUDA.  Every other name raises when called."""

from ._standin import module_getattr


def is_arch_support_pdl() -> bool:
    """False: programmatic dependent launch is an option of the real CUDA kernels, and none run here."""
    return False


__getattr__ = module_getattr(__name__)

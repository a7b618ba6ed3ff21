"""Session-wide test setup.

Triton decides between compiling and interpreting when it is imported, and
sglang and transformers may import it before the kernel tests do.  Without
CUDA the kernel tests run Triton through its interpreter, so the choice is
made here, before any test module is collected.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

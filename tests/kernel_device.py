"""Where the kernel tests run: compiled Triton on CUDA, Triton's interpreter on CPU.

``tests/conftest.py`` has already set ``TRITON_INTERPRET=1`` when CUDA is
absent, before anything imported Triton; this loads the kernel modules
interpreted.  Kernel test modules import ``DEVICE`` from here.
"""

import torch

from oscar_sglang.kernels import interpret

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    interpret.enable()

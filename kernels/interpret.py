"""Run the Triton kernels on CPU tensors through Triton's interpreter (tests, CPU smoke benchmark).

Triton decides between compiling and interpreting when a ``@triton.jit``
function is *defined*, its own library (``tl.max``, ``tl.cdiv``, ...)
included, and checks again lazily at the first launch.  So
``TRITON_INTERPRET=1`` must be set before anything imports ``triton`` and
stay set: :func:`enable` sets it for this process (children inherit it) and
fails clearly if Triton was already imported without it.
"""

from __future__ import annotations

import importlib
import os
import sys

# Helpers first: the kernel modules bind them at import.
MODULES = (
    "oscar_sglang.kernels.common.triton_helpers",
    "oscar_sglang.kernels.write.triton_kernel",
    "oscar_sglang.kernels.decode.triton_kernel",
    "oscar_sglang.kernels.decode.bf16_baseline",
    "oscar_sglang.kernels.extend.triton_kernel",
    "oscar_sglang.kernels.repin.triton_kernel",
    "oscar_sglang.kernels.hot_pass.triton_kernel",
)


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def active() -> bool:
    """True when the kernel modules are loaded and interpreted."""
    mod = sys.modules.get("oscar_sglang.kernels.write.triton_kernel")
    return mod is not None and _interpreted(mod._write_kernel) and os.environ.get("TRITON_INTERPRET") == "1"


def enable() -> None:
    """Set ``TRITON_INTERPRET=1`` for this process and load the kernel modules interpreted (idempotent)."""
    if active():
        return
    if "triton.language" in sys.modules and not _interpreted(sys.modules["triton.language"].standard.cdiv):
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its own library is compiled-only; "
            "set TRITON_INTERPRET=1 before anything imports triton (e.g. at the top of the test module "
            "or in the environment)")
    os.environ["TRITON_INTERPRET"] = "1"
    for name in MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)

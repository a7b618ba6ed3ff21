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
    "oscar_sglang.kernels.read.triton_kernel",
)


def interpreted(fn) -> bool:
    """Whether the ``@triton.jit`` function ``fn`` runs in the interpreter (so cannot run inline PTX)."""
    return type(fn).__name__ == "InterpretedFunction"


def active() -> bool:
    """True when the kernel modules are loaded and interpreted."""
    mod = sys.modules.get("oscar_sglang.kernels.write.triton_kernel")
    return mod is not None and interpreted(mod._write_kernel) and os.environ.get("TRITON_INTERPRET") == "1"


def _bf16_to_f32(bits):
    """bf16 bit patterns (the interpreter stores bf16 as uint16) as the float32 values they denote (exact)."""
    import numpy as np

    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_rne(x):
    """float32 -> bf16 bit patterns, round to nearest even (the GPU's ``cvt.rn.bf16.f32``); NaN stays NaN."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def _patch_interpreter() -> None:
    """Two gaps of Triton's interpreter that the bf16 dots of the extend kernel meet (idempotent).

    * ``tl.dot`` of bf16 operands multiplies their uint16 storage as integers;
      here they are widened to the float32 values they hold (exact) and
      multiplied with fp32 accumulation, as a GPU's bf16 tensor cores do;
    * an fp32 -> bf16 cast truncates; here it rounds to nearest even, as on a GPU.
    """
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_oscar_patched", False):
        return
    import numpy as np

    tl = ti.tl
    dot, cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_to_f32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data
            b_data = _bf16_to_f32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data
            out = np.matmul(a_data.astype(np.float32), b_data.astype(np.float32), dtype=np.float32)
            return ti.TensorHandle((out + d.data).astype(d.data.dtype), d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return ti.TensorHandle(_f32_to_bf16_rne(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl  # the casts' lambdas look cast_impl up per call
    builder._oscar_patched = True


def enable() -> None:
    """Set ``TRITON_INTERPRET=1`` for this process and load the kernel modules interpreted (idempotent)."""
    if not active():
        if "triton.language" in sys.modules and not interpreted(sys.modules["triton.language"].standard.cdiv):
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
    _patch_interpreter()

"""Entry point ``sglang.srt.plugins: no_cutedsl_dual_gemm = sgl_kernel_standin_plugin:register``.

Shipped with oscar-sglang's ``sgl_kernel`` stand-in.  On CUDA, Llama and Qwen2
build a ``DualGemm`` whose mode selection imports
``sglang.kernels.ops.gemm.cutedsl_dual_gemm``, which imports ``cutlass`` (the
CuTe DSL) at module level; the GPU test machine does not carry it, and the
fused path it selects runs only on SM100 (Blackwell) anyway.  The hook below
makes the selection answer None (no fused dual GEMM), which is also what it
answers on CPU, so the plugin changes nothing there.
"""

TARGET = "sglang.srt.layers.dual_gemm.DualGemm._select_mode"


def select_no_dual_gemm(self, gate_up_proj, hidden_size):
    """Replacement for ``DualGemm._select_mode``: never use the fused CuTe DSL dual GEMM."""
    return None


# (target, hook, hook type name); the hook types are SGLang's HookType members.
HOOKS = ((TARGET, select_no_dual_gemm, "REPLACE"),)

_registered = False


def register() -> None:
    """Register the hooks with SGLang's HookRegistry (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    _registered = True

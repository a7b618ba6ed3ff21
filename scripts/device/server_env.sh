# Source with the folder install_bundle.sh filled:  source scripts/device/server_env.sh /tmp/oscar-site
# The environment under which SGLang 0.5.23 serves without its CUDA kernel package (docs/GPU.md):
site=${1:-/tmp/oscar-site}
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_FORCE_FUSED_OP_BACKEND=torch            # RMSNorm, SiluAndMul, rotary: torch, not sgl_kernel/JIT
export SGLANG_CRASH_ON_JIT_COMPILE=1                   # an unguarded JIT kernel fails by name instead of compiling
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1          # the stand-in is not the sglang-kernel distribution
export SGLANG_IS_FLASHINFER_AVAILABLE=false
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python   # the slimmed wheel has no Rust radix tree
export PYTHONUNBUFFERED=1

"""Import shim for SGLang on machines without CUDA.

SGLang's CPU engine imports ``sgl_kernel`` at module level, but its
torch-native path never calls the kernels.  The real package is CUDA-only and
cannot load here, so this stand-in satisfies the import and raises loudly if
anything ever calls into it.  Installed by ``scripts/setup_env.sh`` only
where CUDA is absent; never on a GPU machine.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is the CPU import shim from "
            "oscar-sglang (scripts/cpu_shims); the real sgl_kernel needs CUDA."
        )

    _unavailable.__name__ = name
    return _unavailable

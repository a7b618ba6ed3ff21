"""The one rule every unimplemented name follows: calling it raises NotImplementedError."""

from collections.abc import Callable, Iterable


def unavailable(qualname: str) -> Callable:
    """A function that raises NotImplementedError naming ``qualname`` when called."""

    def standin(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} was called, but this sgl_kernel is oscar-sglang's stand-in "
            "(scripts/sgl_kernel_standin), which implements only the kernels SGLang calls "
            "on a plain BF16 Llama/Qwen2 path; this one needs the real CUDA sgl_kernel."
        )

    standin.__name__ = standin.__qualname__ = qualname.rsplit(".", 1)[-1]
    return standin


def module_getattr(module_name: str, absent: Iterable[str] = ()) -> Callable:
    """A module-level ``__getattr__`` that answers every missing name with :func:`unavailable`.

    Dunder names and the names in ``absent`` raise AttributeError instead, so
    ``hasattr`` and ``from module import absent_submodule`` behave as if the
    name did not exist.
    """
    absent = frozenset(absent)

    def __getattr__(name: str):
        if name.startswith("__") or name in absent:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return unavailable(f"{module_name}.{name}")

    return __getattr__

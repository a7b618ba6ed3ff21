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
    _patch_language_once_per_launch(ti)
    _memoize_np_dtype(ti)
    _skip_discarded_overflow_checks(ti)


def _skip_discarded_overflow_checks(ti) -> None:
    """Turn off the interpreter's integer-overflow check where Triton discards its verdict.

    The interpreter's options say ``sanitize_overflow=True, debug=False``: every ``+``, ``-`` and ``*`` of
    integers below 64 bits then recomputes itself in int64 and compares the result with the type's bounds
    (``binary_op_sanitize_overflow_impl``: two casts, the operation, two constants, two comparisons, an and:
    eight more interpreted operations), and hands the condition to ``device_assert``, which returns at once
    without ``debug``.  So nothing was ever checked, yet it took about half of an index-heavy kernel's
    interpreted time.  With ``debug`` set (where an overflow would fail), the check stays.
    """
    import dataclasses

    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return
    if getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _memoize_np_dtype(ti) -> None:
    """Triton's ``_get_np_dtype`` (a numpy dtype per Triton dtype, asked at nearly every interpreted operation:
    650,000 times in the hot-pass tests) builds its table of 19 dtypes at every call; this answers from a
    table filled as it is asked, the original deciding each dtype once (a pure function of the dtype; an
    unhashable one, a pointer type, is keyed by its class and name)."""
    get = getattr(ti, "_get_np_dtype", None)
    if get is None or getattr(get, "_oscar_memo", False):
        return
    memo: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return memo[tt_dtype]
        except KeyError:
            memo[tt_dtype] = found = get(tt_dtype)
            return found
        except TypeError:  # a pointer type (unhashable): its class and name (element type, constness) say it
            key = (type(tt_dtype), str(tt_dtype))
            found = memo.get(key)
            if found is None:
                memo[key] = found = get(tt_dtype)
            return found

    get_np_dtype._oscar_memo, get_np_dtype._oscar_original = True, get
    ti._get_np_dtype = get_np_dtype


def _lang_modules(fn, tl) -> frozenset:
    """The ids of the language modules (``tl``, ``tl.core``) that ``fn``'s globals hold: what Triton's
    ``_patch_lang(fn)`` patches."""
    import inspect

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _patch_language_once_per_launch(ti) -> None:
    """Patch Triton's language for the interpreter once per launch, not again at every ``@triton.jit`` helper
    call inside it.

    The interpreter's launch (``GridExecutor.__call__``) patches ``triton.language`` (``_patch_lang``: every
    builtin through ``inspect.getmembers``, the tensor's and the core's attributes) and restores it when the
    grid has run; every call of a jit helper *inside* the kernel (``InterpretedFunction.__call__``) patches it
    again and drops that scope unrestored.  A nested patch changes nothing where the launch has already
    patched the helper's language modules (the builtins it finds are the launch's wrappers, no longer builtins;
    the attributes it sets are equivalent ones, undone by the launch's restore), yet it cost about a third of
    the kernel tests' time (26,000 helper calls in one decode test, most of them Triton's own ``tl.sum``,
    ``tl.zeros``, ``tl.max``, whose module holds ``tl.core``).  So within a launch each set of language
    modules is patched once, by the launch or by the first helper call that holds it (that one's scope
    dropped, as Triton does), and later helper calls over modules already patched are skipped.  Both
    interpreters that run the tests (Triton 3.6, 3.8) have this structure; where it differs, nothing is changed.
    """
    patch, scope_type = getattr(ti, "_patch_lang", None), getattr(ti, "_LangPatchScope", None)
    if patch is None or scope_type is None or getattr(patch, "_oscar_once_per_launch", False):
        return
    active: list[set] = []  # the language modules patched within each running launch (launches do not nest)

    class _LaunchScope:
        """The launch's own scope, which also ends its entry in ``active`` when restored."""

        def __init__(self, scope, langs):
            self._scope, self._langs = scope, set(langs)
            active.append(self._langs)

        def restore(self):
            try:
                self._scope.restore()
            finally:
                active.remove(self._langs)

    held: dict = {}  # fn -> its language modules (a module's imports do not change once it has run)

    def patch_lang(fn):
        langs = held.get(fn)
        if langs is None:
            langs = held[fn] = _lang_modules(fn, ti.tl)
        if active and langs <= active[-1]:
            return scope_type()  # a helper inside the launch: its language is already the interpreter's
        scope = patch(fn)
        if _called_by_launch():
            return _LaunchScope(scope, langs)
        if active:
            active[-1].update(langs)
        return scope

    patch_lang._oscar_once_per_launch = True
    ti._patch_lang = patch_lang


def _called_by_launch() -> bool:
    """Whether the caller of our ``_patch_lang`` is the interpreter's launch (``GridExecutor.__call__``), which
    restores the scope; a helper call drops it."""
    frame = sys._getframe(2)
    return frame.f_code.co_name == "__call__" and type(frame.f_locals.get("self")).__name__ == "GridExecutor"


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

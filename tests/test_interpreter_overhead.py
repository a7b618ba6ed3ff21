"""Three of the Triton interpreter's overheads that ``kernels/interpret.py`` removes, and the kernels compute the
same: it patches its language once per launch, not at every ``@triton.jit`` helper call inside the kernel,
answers ``_get_np_dtype`` from a table, and skips the integer-overflow checks whose verdict it discards.

Checked with a kernel whose loop calls our helper and Triton's own ``tl.sum`` / ``tl.zeros`` / ``tl.maximum``
many times: its output against torch, the number of times Triton's ``_patch_builtin`` runs per launch, the
language restored after each launch (a failing one included).  CPU only (on CUDA the kernels are compiled).
"""

import pytest
import torch
from kernel_device import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs on CPU only")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402


@triton.jit
def _row_sum(x_ptr, row, N: tl.constexpr):
    """A helper that calls Triton's own helpers (``tl.sum``, ``tl.zeros``: in a module holding ``tl.core``)."""
    acc = tl.zeros([N], dtype=tl.float32)
    acc += tl.load(x_ptr + row * N + tl.arange(0, N))
    return tl.sum(acc, axis=0)


@triton.jit
def _sums_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr, FAIL_AT: tl.constexpr):
    pid = tl.program_id(0)
    best = tl.full([1], float("-inf"), tl.float32)
    for r in range(ROWS):
        if r == FAIL_AT:  # the interpreter runs this as Python: an error in the middle of the launch
            tl.static_assert(False, "failing on purpose")
        s = _row_sum(x_ptr, pid * ROWS + r, N)
        tl.store(out_ptr + pid * ROWS + r, s)
        best = tl.maximum(best, s)
    tl.store(out_ptr + 2 * ROWS + pid + tl.arange(0, 1), best)


def _run(x, fail_at=-1):
    out = torch.zeros(2 * 8 + 2)
    _sums_kernel[(2,)](x, out, ROWS=8, N=16, FAIL_AT=fail_at)
    return out


def _language_now():
    """A few of the attributes a launch patches and gives back (Triton leaves ``tl.core``'s builtins patched
    after a helper call, with or without our patch, so only ``tl``'s own are compared)."""
    return (tl.full, tl.reduce, tl.range, tl.math.exp, getattr(tl.tensor, "__index__", None), tl.tensor.__add__)


def _builtin_patches(monkeypatch) -> list:
    """What Triton's ``_patch_builtin`` is called on from now on (each call: one pass over a module's members)."""
    calls = []
    builtin = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: (calls.append(a[0]), builtin(*a))[1])
    return calls


def test_one_patch_per_language_per_launch_and_the_same_results(monkeypatch):
    calls = _builtin_patches(monkeypatch)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    want = torch.cat([x.sum(1), x.sum(1).view(2, 8).amax(1)])
    _run(x)
    before = _language_now()
    for _ in range(2):
        calls.clear()
        out = _run(x)
        assert torch.allclose(out, want, atol=1e-4), (out - want).abs().max()
        # the launch patches tl (its builtins, the tensor's, math's) and the first helper call over tl.core
        # (Triton's tl.sum and tl.zeros) patches that once: 10 _patch_builtin calls with Triton 3.8; unpatched,
        # every helper call of the 16 rows (_row_sum, zeros, sum, their own helpers) patched again: 260
        assert 3 <= len(calls) <= 16, len(calls)
        assert _language_now() == before


def test_a_failing_launch_gives_the_language_back_and_the_next_one_patches_again(monkeypatch):
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    _run(x)
    before = _language_now()
    with pytest.raises(Exception, match="failing on purpose"):
        _run(x, fail_at=3)
    assert _language_now() == before
    calls = _builtin_patches(monkeypatch)
    out = _run(x)
    assert torch.allclose(out[:16], x.sum(1), atol=1e-4) and 3 <= len(calls) <= 16, len(calls)


def test_np_dtype_answers_as_triton_s_own_for_every_dtype():
    """The memoized ``_get_np_dtype`` against Triton's own (the function it wraps) for scalars, blocks and
    pointers of every dtype, asked twice (filled, then from the table)."""
    import numpy as np

    get = ti._get_np_dtype
    assert getattr(get, "_oscar_memo", False)
    own = get._oscar_original
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    kinds = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4, 8]) for t in scalars] + \
        [tl.block_type(tl.pointer_type(tl.float32), [16])]
    for _ in range(2):
        for t in kinds:
            assert get(t) == own(t) and isinstance(get(t), np.dtype), t
    assert get(tl.block_type(tl.bfloat16, [2])) == np.dtype(np.uint16)   # bf16 stored as its bits
    assert get(tl.pointer_type(tl.float16)) == np.dtype(np.uint64)


@triton.jit
def _wrapping_kernel(x_ptr, out_ptr, N: tl.constexpr):
    """int32 products and sums that overflow (``x * 2^20 + x``), stored as they wrap."""
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, x * 1048576 + x)


def _wrapping_run(x):
    out = torch.zeros_like(x)
    _wrapping_kernel[(1,)](x, out, N=x.numel())
    return out


def test_overflow_checks_are_skipped_where_triton_discards_them_and_kept_where_it_asserts(monkeypatch):
    """The interpreter's options (``debug`` off) recomputed every int32 ``+ - *`` in int64 for a
    ``device_assert`` that returns without ``debug``: now not computed at all, the results the same; with
    ``debug`` on, the check stays and an overflow fails the launch."""
    import dataclasses

    from triton.runtime.errors import InterpreterError

    from oscar_sglang.kernels.interpret import _skip_discarded_overflow_checks

    builder = ti.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow
    x = torch.arange(-8, 8, dtype=torch.int32) * 3001
    want = (x.to(torch.int64) * 1048577 + 2**31) % 2**32 - 2**31          # int32 wrap-around
    asserts = []
    semantic = type(ti.interpreter_semantic)   # the class: Triton 3.6's launches do not call the module's instance
    device_assert = semantic.device_assert
    monkeypatch.setattr(semantic, "device_assert", lambda self, cond, msg, mask: (
        asserts.append(msg), device_assert(self, cond, msg, mask))[1])
    assert torch.equal(_wrapping_run(x), want.to(torch.int32)) and asserts == []
    # Triton's own options, as the interpreter had them: the same result, two checks computed and discarded
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    assert torch.equal(_wrapping_run(x), want.to(torch.int32)) and len(asserts) == 2, asserts
    # with debug on, the check is kept (and fails on this overflow)
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    _skip_discarded_overflow_checks(ti)
    assert builder.options.sanitize_overflow
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation mul"):
        _wrapping_run(x)
    # with debug off the skip applies
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=False))
    _skip_discarded_overflow_checks(ti)
    assert not builder.options.sanitize_overflow

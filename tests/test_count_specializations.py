"""scripts/device/count_specializations.py: kernel launches grouped by the compile key Triton gives them on a GPU."""

import torch
import triton
import triton.language as tl

from script_modules import load_script

counter = load_script("device/count_specializations.py")


@triton.jit
def _store_n(x_ptr, n, M: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, M), tl.zeros([M], dtype=tl.float32) + n)


def test_launches_run_and_group_by_triton_specialization_rules():
    buf = torch.zeros(64)
    launches = [  # (pointer, n, M, launch options), and which compile each needs by Triton's rules
        (buf, 16, 4, {}),  # A
        (buf, 32, 4, {}),  # A: another integer divisible by 16
        (buf, 17, 4, {}),  # B: an integer not divisible by 16
        (buf, 1, 4, {}),  # C: n == 1 becomes a constant
        (buf[1:], 32, 4, {}),  # D: a pointer off 16-byte alignment
        (buf.to(torch.bfloat16), 32, 4, {}),  # E: another element type
        (buf, 32, 8, {}),  # F: another constexpr
        (buf, 48, 4, {"num_warps": 8}),  # G: another launch option
        (buf, 64, 4, {"num_warps": 8}),  # G
    ]
    with counter.counting() as counts:
        for x, n, m, opts in launches:
            _store_n[(1,)](x, n, M=m, **opts)
    assert len(counts) == 7 and sum(counts.values()) == len(launches)
    assert sorted(counts.values()) == [1, 1, 1, 1, 1, 2, 2]
    assert counter.per_kernel(counts) == {"_store_n": [7, 9]}
    assert buf[:4].tolist() == [64.0] * 4  # the launches ran: the last one's n is stored
    _store_n[(1,)](buf, 5, M=4)  # outside the block: not counted, the interpreter's own launch again
    assert sum(counts.values()) == len(launches) and buf[0].item() == 5.0

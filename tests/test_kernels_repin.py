"""Re-pin kernel (Triton, under the interpreter on CPU) against the plain-torch reference, and the reference
against the window rule restated position by position (``oscar_sglang.windows``).

Integers only: the kernel's stamps must equal the reference's exactly.
"""

import random

import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang import windows
from oscar_sglang.kernels import api
from oscar_sglang.kernels.repin import reference


def _state(seed, rows=9, width=40, num_slots=120, entries=30, sink=3, recent=8):
    """Request rows of random lengths (0: no request, some < sink + recent, some full), sharing slots (a radix
    hit), a hot index with holes, stamps in every state (-1 free, 0 out of window, > 0 in window)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, num_slots, (rows, width), generator=g, dtype=torch.int32)
    req_to_token[2, :10] = req_to_token[1, :10]                       # a shared prefix
    req_len = torch.tensor([rng.choice([0, 0, 1, 5, sink + recent - 1, sink + recent, 17, width])
                            for _ in range(rows)], dtype=torch.int64)
    req_len[1] = width
    req_pass = torch.randint(1, 50, (rows,), generator=g, dtype=torch.int64)
    hot_index = torch.full((num_slots + 1,), -1, dtype=torch.int32)
    owners = torch.randperm(num_slots, generator=g)[:entries - 4]       # some entries free
    hot_index[owners] = torch.arange(entries - 4, dtype=torch.int32)
    stamp = torch.randint(-1, 25, (entries + 1,), generator=g, dtype=torch.int64)
    stamp[-1] = -1                                                    # the trash
    # row 1 is full: its first and last positions (sink / recent) hold out-of-window entries, which must rise
    hot_index[int(req_to_token[1, 0])], hot_index[int(req_to_token[1, width - 1])] = entries - 2, entries - 1
    stamp[entries - 2:entries] = 0
    return stamp, hot_index, req_len, req_pass, req_to_token, sink, recent


def _by_position(stamp, hot_index, req_len, req_pass, req_to_token, sink, recent):
    """The rule, one position at a time: an entry in a live window gets at least that row's last pass."""
    out = stamp.clone()
    for r in range(req_to_token.shape[0]):
        n = int(req_len[r])
        for pos in range(n):
            if windows.in_window(pos, n, sink, recent):
                e = int(hot_index[int(req_to_token[r, pos])])
                if e >= 0:
                    out[e] = max(int(out[e]), int(req_pass[r]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reference_follows_the_window_rule(seed):
    stamp, *rest = _state(seed)
    want = _by_position(stamp, *rest)
    reference.repin_windows(stamp, *rest)
    assert torch.equal(stamp, want)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", [dict(), dict(sink=0, recent=5), dict(sink=4, recent=0), dict(width=6)])
def test_kernel_matches_the_reference(seed, shape):
    stamp, hot_index, req_len, req_pass, req_to_token, sink, recent = _state(seed, **shape)
    req_len = torch.clamp(req_len, max=req_to_token.shape[1])
    want = stamp.clone()
    reference.repin_windows(want, hot_index, req_len, req_pass, req_to_token, sink, recent)
    got = stamp.clone().to(DEVICE)
    api.repin_windows(got, hot_index.to(DEVICE), req_len.to(DEVICE), req_pass.to(DEVICE), req_to_token.to(DEVICE),
                      sink, recent, backend="triton")
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, stamp) or sink + recent == 0          # the case changed something


def test_kernel_refuses_wrong_dtypes():
    stamp, hot_index, req_len, req_pass, req_to_token, sink, recent = _state(0)
    with pytest.raises(TypeError, match="req_to_token must be torch.int32"):
        api.repin_windows(stamp.to(DEVICE), hot_index.to(DEVICE), req_len.to(DEVICE), req_pass.to(DEVICE),
                          req_to_token.long().to(DEVICE), sink, recent, backend="triton")

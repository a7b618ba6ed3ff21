"""The window rule (``oscar_sglang/windows.py``) against its set definition, for ints and tensors."""

import torch

from oscar_sglang import windows


def test_window_rule_matches_the_set_definition():
    for length in range(0, 30):
        for sink in (0, 1, 4):
            for recent in (0, 1, 5, 40):
                want = set(range(min(sink, length))) | set(range(max(0, length - recent), length))
                got = {p for p in range(length) if windows.in_window(p, length, sink, recent)}
                assert got == want, (length, sink, recent)
                pos = torch.arange(length)
                t = windows.in_window(pos, torch.full((length,), length), sink, recent)
                assert set(pos[t].tolist()) == want
                split = windows.in_sink(pos, sink) | windows.in_recent(pos, torch.full((length,), length), sink, recent)
                assert torch.equal(split, t)
                assert not (windows.in_sink(pos, sink) & windows.in_recent(pos, length, sink, recent)).any()

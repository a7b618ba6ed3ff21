"""The decode loop timed at a server's startup (``kernels/decode/autotune.py``): every candidate really decodes
a synthetic store of the served layer's formats (Triton's interpreter here, compiled on CUDA), is checked
against the default's output, and the fastest beyond the margin is kept.  Times come from a stand-in timer
keyed by the options each call ran with, so that the choice is tested against known numbers; the decodes
themselves are real."""

import pytest
import torch

from kernel_device import DEVICE  # noqa: F401  (enables the interpreter on CPU)

from oscar_sglang.format import RowFormat
from oscar_sglang.kernels import layout, scenario
from oscar_sglang.kernels.decode import autotune

KV, D, QH = 2, 64, 8
CASES = ((1, 80), (3, 40))
CANDIDATES = (("default", {"block_n": 16}),
              ("fold", {"block_n": 16, "fold": True}),
              ("fold, 2 warps", {"block_n": 16, "fold": True, "num_warps": 2}),
              ("fold, 2 warps, whole waves", {"block_n": 16, "fold": True, "num_warps": 2, "whole_waves": True}))


def _like(k_format=None, v_format=None):
    return layout.empty_store(8, KV, D, None, 0, DEVICE, k_format=k_format, v_format=v_format), \
        scenario.random_rotation(KV, D, device=DEVICE)


class _Calls(list):
    windows: list


@pytest.fixture
def calls(monkeypatch):
    """The options of every decode the tuner runs (the real kernel still runs); ``.windows``: the ``hot_windows``
    each was given."""
    seen = _Calls()
    seen.windows = []
    real = autotune.triton_kernel.decode_attention

    def spy(*args, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k not in ("max_seq_len", "report", "hot_windows")})
        seen.windows.append(kwargs.get("hot_windows"))
        return real(*args, **kwargs)

    monkeypatch.setattr(autotune.triton_kernel, "decode_attention", spy)
    return seen


def _timer(calls, ms_by_label, per_case=None):
    """A timer that runs the call once and answers the time set for the candidate it ran (by its options)."""
    by_knob = {autotune.knob_value(dict(CANDIDATES)[label]): ms for label, ms in ms_by_label.items()}
    count = {}

    def timer(fn, device):
        fn()
        knob = autotune.knob_value(calls[-1])
        i = count.get(knob, 0)
        count[knob] = i + 1
        return by_knob[knob] * (per_case[i] if per_case else 1.0)

    return timer


def test_keeps_per_case_the_fastest_candidate_that_agrees_with_the_default(calls):
    like, rot = _like()
    ms = {"default": 1.0, "fold": 0.8, "fold, 2 warps": 0.5, "fold, 2 warps, whole waves": 0.55}
    choice = autotune.choose(like, rot, QH, cases=CASES, candidates=CANDIDATES, timer=_timer(calls, ms, [1.0, 3.0]))
    two_warps = {"block_n": 16, "fold": True, "num_warps": 2}
    assert choice.picks == [("fold, 2 warps", two_warps)] * 2
    assert choice.options_for(1) == choice.options_for(64) == two_warps
    assert set(choice.ms) == set(ms) and not choice.notes
    assert choice.ms["fold"] == pytest.approx([0.8, 2.4])
    assert choice.ratio("fold, 2 warps", 1) == pytest.approx(0.5)
    line = choice.summary()
    assert line.startswith("decode loop: b1 x 80: fold, 2 warps (block_n=16,fold=1,num_warps=2, 0.50x the "
                           "default's time); b3 x 40: fold, 2 warps (")
    assert "fold 0.80/0.80" in line
    # each candidate decoded every case twice (the agreement check, then the timing), the default first
    assert [autotune.knob_value(c) for c in calls[:4]] == ["block_n=16"] * 4
    assert len(calls) == 2 * len(CASES) * len(CANDIDATES)
    # every decode given the served windows (the default ones here), as the server decodes: splits cut by work
    assert calls.windows == [(autotune.SINK, autotune.RECENT)] * len(calls)


def test_each_batch_gets_the_pick_of_the_nearest_case(calls):
    """Batch 1 and larger batches may want different loops: the picks are per case, a batch takes the nearest."""
    like, rot = _like()
    times = {"default": [1.0, 1.0], "fold": [0.7, 1.2], "fold, 2 warps": [0.9, 0.6],
             "fold, 2 warps, whole waves": [1.0, 0.99]}
    seen = {}

    def timer(fn, device):
        fn()
        label = next(label for label, opts in CANDIDATES if opts == calls[-1])
        seen[label] = seen.get(label, -1) + 1
        return times[label][seen[label]]

    choice = autotune.choose(like, rot, QH, cases=((1, 80), (4, 40)), candidates=CANDIDATES, timer=timer)
    assert [label for label, _ in choice.picks] == ["fold", "fold, 2 warps"]
    assert choice.options_for(1) == {"block_n": 16, "fold": True}
    assert choice.options_for(2) == choice.options_for(1)         # 2 is nearer 1 than 4 (in ratio)
    assert choice.options_for(3) == choice.options_for(64) == {"block_n": 16, "fold": True, "num_warps": 2}
    assert "b1 x 80: fold (block_n=16,fold=1, 0.70x" in choice.summary()


def test_the_default_stays_within_the_margin_and_when_the_budget_is_spent(calls):
    like, rot = _like()
    near = {"default": 1.0, "fold": 0.97, "fold, 2 warps": 0.96, "fold, 2 warps, whole waves": 0.99}
    choice = autotune.choose(like, rot, QH, cases=CASES[:1], candidates=CANDIDATES, timer=_timer(calls, near))
    assert choice.picks == [("default", {"block_n": 16})] and choice.options_for(1) == {"block_n": 16}
    assert choice.summary().startswith("decode loop: b1 x 80: default (block_n=16); timed at startup on ")
    calls.clear()
    spent = autotune.choose(like, rot, QH, cases=CASES[:1], candidates=CANDIDATES, budget_s=0,
                            timer=_timer(calls, near))
    assert list(spent.ms) == ["default"] and spent.picks == [("default", {"block_n": 16})]
    assert set(spent.notes) == {label for label, _ in CANDIDATES[1:]}
    assert all("budget" in note for note in spent.notes.values())


def test_a_candidate_that_disagrees_or_fails_is_dropped_and_the_default_must_run(monkeypatch, calls):
    like, rot = _like()
    spy = autotune.triton_kernel.decode_attention

    def wrong_when_folded(*args, **kwargs):
        out = spy(*args, **kwargs)
        return out + 0.1 * out.abs().max() if kwargs.get("fold") and kwargs.get("num_warps") == 2 else out

    monkeypatch.setattr(autotune.triton_kernel, "decode_attention", wrong_when_folded)
    broken = CANDIDATES[:3] + (("prefetch 7", {"block_n": 16, "prefetch": 7}),)
    ms = {"default": 1.0, "fold": 0.9, "fold, 2 warps": 0.1}
    timer = _timer(calls, ms)
    choice = autotune.choose(like, rot, QH, cases=CASES[:1], candidates=broken, timer=timer)
    assert choice.picks == [("fold", {"block_n": 16, "fold": True})]   # the fastest, 2 warps, differs: dropped
    assert "differs from the default by" in choice.notes["fold, 2 warps"]
    assert choice.notes["prefetch 7"].startswith("dropped: ValueError")
    assert set(choice.ms) == {"default", "fold"}
    with pytest.raises(ValueError):                        # without a default there is nothing to serve
        autotune.choose(like, rot, QH, cases=CASES[:1], candidates=broken[3:] + broken[:1], timer=timer)


def test_real_timer_and_formats_of_the_served_layer():
    """The wall-clock timer on this device, over a layer of INT4 keys and grouped INT2 values (where the folded
    loop does not apply, so it is the default's loop again, within the margin of it or not)."""
    like, rot = _like(RowFormat(4), RowFormat(2, 32))
    choice = autotune.choose(like, rot, QH, cases=CASES[:1], candidates=CANDIDATES[:2], windows=(4, 16))
    assert all(t > 0 for ms in choice.ms.values() for t in ms) and set(choice.ms) == {"default", "fold"}
    assert choice.seconds > 0 and choice.device.startswith(torch.device(DEVICE).type)
    store = autotune.synthetic_store(like, 32, 4, seed=0)
    assert (store.k_format, store.v_format) == (like.k_format, like.v_format) and store.k_format.bits == 4
    assert (store.hot_index == -1).all() and store.k_scale.min() >= 0.0099 and store.v_codes.float().std() > 0


def test_whole_waves_are_served_as_the_residency_the_device_reported():
    opts = {"fold": True, "whole_waves": True, "num_warps": 2}
    assert autotune.served_options(opts, 6) == {"fold": True, "resident": 6, "num_warps": 2}
    assert autotune.served_options(opts, None) == {"fold": True, "num_warps": 2}   # no report (the interpreter)
    assert autotune.knob_value({"fold": True, "resident": 6}) == "fold=1,resident=6"
    assert autotune.knob_value({}) == ""

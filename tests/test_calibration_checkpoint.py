"""An interrupted calibration resumes from its per-layer checkpoints and writes the same artifact, bit for bit,
as a run that was never interrupted (calibration/checkpoint.py)."""

import pytest
import torch

from oscar_sglang.calibration import calibrate as cal
from oscar_sglang.calibration import checkpoint, policy
from oscar_sglang.calibration.optr import OptRConfig

from tiny_llama import tiny_llama_large_keys  # noqa: E402


class Seqs(list):
    groups = ["one", "one", "two", "two"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_large_keys()


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(1)
    return Seqs(torch.randint(0, 97, (96,), generator=g) for _ in range(4))


def _cfg(**kw):
    return cal.CalibrationConfig(method="optr", sink=4, recent=8, keep_sequences=4, clip_queries=32,
                                 decision_queries=32, bits=6.0, optr=OptRConfig(steps=3), **kw)


class Interrupt(Exception):
    pass


def _interrupting(fn, at_call: int):
    """``fn`` that raises :class:`Interrupt` on its ``at_call``-th call (0-based), as a Ctrl-C mid-layer would."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == at_call:
            raise Interrupt
        return fn(*args, **kwargs)

    return wrapped


def _same_artifacts(a, b):
    assert a.layer_formats == b.layer_formats and a.method == b.method
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in la.TENSOR_NAMES:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
    pa, pb = a.calibration["policy"], b.calibration["policy"]
    assert pa["layers"] == pb["layers"] and pa["heldout_check"] == pb["heldout_check"]


@pytest.mark.parametrize("where", ["fit", "policy"])
def test_a_run_interrupted_in_the_second_layer_resumes_to_the_same_artifact(tiny, seqs, tmp_path, monkeypatch,
                                                                             where):
    whole, whole_report = cal.calibrate(tiny, seqs, _cfg(), progress=False)
    key = checkpoint.run_key(_cfg(), tiny, [seqs])
    ckpt = checkpoint.LayerCheckpoint(tmp_path / "partial", key)
    with monkeypatch.context() as m:   # the first run stops in layer 1 of the fit, or of the policy's measure
        if where == "fit":
            m.setattr(cal, "refine_layer", _interrupting(cal.refine_layer, 1))
        else:
            m.setattr(policy, "_layer_costs", _interrupting(policy._layer_costs, 1))
        with pytest.raises(Interrupt):
            cal.calibrate(tiny, seqs, _cfg(), progress=False, checkpoint=ckpt)
    assert ckpt.resumed == {}
    again = checkpoint.LayerCheckpoint(tmp_path / "partial", key)   # the same command, run again
    resumed, report = cal.calibrate(tiny, seqs, _cfg(), progress=False, checkpoint=again)
    assert again.resumed == ({"fit-optr": 1} if where == "fit" else {"fit-optr": 2, "policy": 1})
    _same_artifacts(resumed, whole)
    assert report == whole_report


def test_other_inputs_empty_the_checkpoints_and_a_damaged_entry_is_computed_again(tiny, seqs, tmp_path):
    key = checkpoint.run_key(_cfg(), tiny, [seqs])
    ckpt = checkpoint.LayerCheckpoint(tmp_path, key)
    ckpt.put("fit-optr", 0, {"x": torch.ones(3)}, {"layer": 0})
    ckpt.put("fit-optr", 1, {"x": torch.zeros(3)}, {"layer": 1})
    (tmp_path / "fit-optr-1.safetensors").write_bytes(b"cut short")
    same = checkpoint.LayerCheckpoint(tmp_path, key)
    tensors, row = same.get("fit-optr", 0)
    assert torch.equal(tensors["x"], torch.ones(3)) and row == {"layer": 0}
    assert same.get("fit-optr", 1) is None and same.get("policy", 0) is None and same.resumed == {"fit-optr": 1}
    for other in (checkpoint.run_key(_cfg(seed=1), tiny, [seqs]),                       # another seed
                  checkpoint.run_key(_cfg(), tiny, [Seqs(s[:-1] for s in seqs)]),        # other tokens
                  checkpoint.run_key(_cfg(), tiny_llama_large_keys(seed=2), [seqs])):    # other weights
        assert other != key
        assert checkpoint.LayerCheckpoint(tmp_path, other).get("fit-optr", 0) is None
        assert [p.name for p in tmp_path.iterdir()] == [checkpoint.KEY]
        checkpoint.LayerCheckpoint(tmp_path, key).put("fit-optr", 0, {"x": torch.ones(3)}, {"layer": 0})

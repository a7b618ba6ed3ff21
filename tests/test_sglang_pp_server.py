"""Pipeline parallelism in the real SGLang server: ``--pp-size 2`` with the INT2 cache, on CPU.

A random Llama (test_architectures' family settings: 4 query / 2 KV heads, head_dim 64; 4 layers, untied word
embeddings) calibrated by ``oscar-calibrate`` (oscar-center with the precision policy, sink 4 / recent 16) and
served with those rotations by one process and by two pipeline stages: the first holds layers 0-1 of the cache,
the second layers 2-3, each in its own pool sized for its own layers (``memory._served_formats``) and reading
its own layers' rotations (``OscarInt2Pool``: ``start_layer``).

What a stage serving the wrong layers' rotations would give, to prove the comparison can see it: one process with
an artifact whose layers 2-3 hold layers 0-1's rotations (what the second stage would read if it ignored where
its layers start).  The prompt and its comparison are test_sglang_tp_server's: a ~440-token prompt of an
evaluation play prefilled in 64-token chunks, 16 tokens decoded greedily.

* Each stage says in its startup line which layers it serves (after SGLang's ``PP0`` / ``PP1`` prefix) and
  stores those layers' bytes per token, in their own formats.
* The stages give one process's prompt log-probabilities up to the noise of running the model in two processes
  (measured 2026-12-07, see ``PP_MEAN``); the wrong layers' rotations move them by far more.
* Decode: as test_sglang_tp_server's.

Models whose word embeddings are tied (the default model, Qwen2.5-Coder-0.5B) do not run with ``--pp-size 2`` on
SGLang 0.5.23's CPU engine in BF16 either (``'PPMissingLayer' object has no attribute 'quant_method'``: the last
stage's lm_head is the embedding, which only the first stage holds), so this test builds an untied one.  The
stages start with ``tests/cpu_tp_site`` on ``PYTHONPATH``, as tensor-parallel ranks do.  About 2.5 minutes on
two cores (calibration, three one-process servers of ~25 s, the two-stage one ~45 s).
"""

import subprocess
import sys
from dataclasses import replace

import pytest

from oscar_sglang import artifacts
from oscar_sglang.artifacts import LayerFormat
from oscar_sglang.format import RowFormat
from test_architectures import _build, _prompt_ids, _prompt_moves
from test_sglang_tp_server import (DECODE, INT2_FLAGS, NEAR_TIE, RECENT, SENSITIVITY, SINK, _bytes_per_token,
                                   _cores, _moved, _serve, _startup_lines)

pytestmark = [pytest.mark.server, pytest.mark.model]

LAYERS, STAGES = 4, 2
PP_MEAN = 0.02  # nats: the mean change two stages may make to one process's prompt (measured: see the docstring)
CLOSE = 1.1     # the stages' error against BF16 within this factor of one process's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _cores()
    root = tmp_path_factory.mktemp("pp")
    model = _build("llama", root / "model", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    rot = root / "rotations"
    cmd = [sys.executable, "-m", "oscar_sglang.calibration", "--model", str(model), "--out", str(rot),
           "--method", "oscar-center", "--bits", "int2", "--tokens", "2048", "--seq-len", "512",
           "--sink", str(SINK), "--recent", str(RECENT), "--threads", "2", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calibrated = artifacts.load(rot)
    assert calibrated.model.num_layers == LAYERS
    half = LAYERS // STAGES
    int4, int2 = RowFormat(4), RowFormat(2)
    mixed = calibrated.with_formats([LayerFormat(int4, int4)] * half + [LayerFormat(int2, int2)] * (LAYERS - half))
    mixed_dir = artifacts.save(mixed, root / "rotations-mixed")
    copies = [artifacts.LayerRotation(*(getattr(lr, n).clone() for n in lr.TENSOR_NAMES))
              for lr in mixed.layers[:half] * STAGES]
    wrong = replace(mixed, layers=copies)   # stage 2 reading stage 1's rotations
    wrong_dir = artifacts.save(wrong, root / "rotations-wrong")
    ids = _prompt_ids(model)
    flags = (*INT2_FLAGS, "--oscar-rotations", str(mixed_dir))
    return {"ids": ids, "artifact": artifacts.load(mixed_dir), "model": model, "root": root,
            "bf16": _serve(model, root / "bf16.log", ids),
            "int2": _serve(model, root / "int2.log", ids, *flags),
            "int2_pp": _serve(model, root / "int2-pp.log", ids, *flags, ranks=STAGES, split="--pp-size"),
            "wrong": _serve(model, root / "wrong.log", ids, *INT2_FLAGS, "--oscar-rotations", str(wrong_dir))}


def test_each_stage_serves_its_own_layers(served):
    art = served["artifact"]
    one = _startup_lines(served["int2"]["log"], "PP")
    many = _startup_lines(served["int2_pp"]["log"], "PP")
    assert list(one) == ["PP0"] and "pipeline stage" not in one["PP0"], one
    assert sorted(many) == [f"PP{s}" for s in range(STAGES)], served["int2_pp"]["log"][-3000:]
    assert _bytes_per_token(one["PP0"]) == art.bytes_per_token()
    half = LAYERS // STAGES
    formats = art.layer_formats
    d, h = art.model.head_dim, art.model.num_kv_heads
    for stage in range(STAGES):
        line, first = many[f"PP{stage}"], stage * half
        assert f", layers {first}-{first + half - 1} of {LAYERS} (this pipeline stage's share), " in line, line
        assert f"layers per format: {art.policy_summary()}" in line, line
        own = sum(h * (f.k.bytes_per_row(d) + f.v.bytes_per_row(d)) for f in formats[first:first + half])
        assert _bytes_per_token(line) == own, (stage, line, [f.to_json() for f in formats])


def test_stages_answer_like_one(served):
    pp, wrong = _moved(served["int2"], served["int2_pp"]), _moved(served["int2"], served["wrong"])
    one_err, many_err = _moved(served["bf16"], served["int2"]), _moved(served["bf16"], served["int2_pp"])
    print(f"\nprompt log-probabilities, mean change: {STAGES} stages vs one process {pp:.4f}; stage 2 reading stage "
          f"1's rotations vs the right ones {wrong:.4f}; against BF16: one process {one_err:.4f}, {STAGES} stages "
          f"{many_err:.4f}, the wrong rotations {_moved(served['bf16'], served['wrong']):.4f}; largest change, two "
          f"stages vs one: {_prompt_moves(served['int2'], served['int2_pp'])[1]:.4f}, decoded tokens "
          f"{'identical' if served['int2']['ids'] == served['int2_pp']['ids'] else 'differ'}")
    assert wrong >= SENSITIVITY * PP_MEAN, "the wrong rotations must be visible for this test to mean anything"
    assert pp < PP_MEAN, pp
    assert many_err < CLOSE * one_err, (many_err, one_err)


def test_stages_decode_like_one(served):
    ref, got = served["int2"], served["int2_pp"]
    assert len(got["ids"]) == DECODE and ref["ids"][0] == got["ids"][0], (ref["ids"], got["ids"])
    n = 0
    while n < DECODE and ref["ids"][n] == got["ids"][n]:
        assert abs(ref["decode"][n] - got["decode"][n]) < 4 * PP_MEAN, (n, ref["decode"], got["decode"])
        n += 1
    if n < DECODE:   # where the two first choose differently, one of them nearly tied
        assert min(ref["margins"][n], got["margins"][n]) < NEAR_TIE, (n, ref["margins"], got["margins"])


@pytest.mark.slow
def test_bf16_stages_are_the_noise_floor(served):
    """The same model served BF16 by two stages against one process: what splitting the model alone moves."""
    bf16_pp = _serve(served["model"], served["root"] / "bf16-pp.log", served["ids"], ranks=STAGES, split="--pp-size")
    floor, int2 = _moved(served["bf16"], bf16_pp), _moved(served["int2"], served["int2_pp"])
    print(f"\nBF16 {STAGES} stages vs one process: {floor:.4f} nats on average (INT2: {int2:.4f})")
    assert floor < PP_MEAN, (floor, int2)

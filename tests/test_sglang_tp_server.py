"""Tensor parallelism in the real SGLang server: ``--tp-size 2`` with the INT2 cache, a trained model, on CPU.

The second development model, Qwen2.5-Coder-0.5B (2 KV heads, so one per rank; keys with a large per-head mean,
docs/MODELS.md), calibrated by ``oscar-calibrate`` (oscar-center, INT2 rows everywhere, sink 4 / recent 16),
served with those rotations by one rank and by two, and by one rank with the artifact's two heads swapped, which
is what each rank of a two-rank server would serve if it took the other rank's slice.  A ~400-token prompt of an
evaluation play is prefilled in 64-token chunks (every chunk reads the earlier ones from the INT2 cache) and 16
tokens decoded greedily.

* Each rank says in its startup line which KV head it serves (SGLang's own rank prefix, ``TP0`` / ``TP1``) and
  stores half the bytes per token.
* Two ranks give one rank's prompt log-probabilities up to the noise of splitting the matmuls (measured
  2026-12-07: 0.099 nats on average; the same bf16 model served BF16 by one rank and by two differs by 0.029, and
  2-bit codes amplify such noise where a value sits on a code boundary); the swapped heads move them by 1.41,
  so a rank taking the wrong slice could not pass.  Against the BF16 server, two ranks are as close as one
  (0.483 vs 0.488 nats; swapped: 1.50).
* Decode: the same first token, the same log-probabilities along the tokens both choose, and the first
  differing token only where one rank's choice nearly tied.

SGLang 0.5.23's CPU engine cannot run two ranks as it ships (a NCCL communicator for the CPU device), so the
two-rank servers start with ``tests/cpu_tp_site`` on ``PYTHONPATH`` (one default changed, its docstring says
which) and one core bound to each rank.  Several minutes on two cores (calibration ~100 s, four servers ~40 s
each, the two-rank one ~50-100 s); ``--slow`` adds the BF16 two-rank server (the noise floor).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_sglang import artifacts
from oscar_sglang.sglang.launcher import local_server, post, server_env
from test_architectures import _prompt_ids, _prompt_moves   # the same prompt, and its comparison

pytestmark = [pytest.mark.server, pytest.mark.model]

SITE = Path(__file__).parent / "cpu_tp_site"
SINK, RECENT, CHUNK, DECODE = 4, 16, 64, 16
SERVER_FLAGS = ("--max-total-tokens", "2048", "--chunked-prefill-size", str(CHUNK))
INT2_FLAGS = ("--kv-cache-dtype", "oscar-int2", "--oscar-sink", str(SINK), "--oscar-recent", str(RECENT))
TP_MEAN = 0.25      # nats: two ranks against one, INT2 (measured 0.099)
SENSITIVITY = 3.0   # the swapped heads must move the prompt by this many TP_MEANs at least (measured 1.41 nats)
CLOSE = 1.1         # two ranks' error against BF16 within this factor of one rank's (measured 0.990)
NEAR_TIE = 1.0      # nats: the top-2 margin where a differing greedy token is noise (as in test_architectures)


def _two_cores() -> str:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two ranks need two cores")
    return f"{cores[0]}|{cores[1]}"


def _serve(model: Path, log: Path, ids: list[int], *extra: str, ranks: int = 1) -> dict:
    """The prompt's log-probabilities, ``DECODE`` greedy tokens with their log-probabilities and top-2 margins,
    and the log's text, from a CPU server with ``ranks`` tensor-parallel ranks."""
    env = server_env(cpu=True)
    if ranks > 1:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH")) if p)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = _two_cores()
        extra = (*extra, "--tp-size", str(ranks))
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": DECODE, "ignore_eos": True}}
    with local_server(model, log, *SERVER_FLAGS, *extra, cpu=True, env=env) as url:
        meta = post(url, "/generate", body)["meta_info"]
    return {"prompt": [t[0] for t in meta["input_token_logprobs"][1:]],
            "ids": [t[1] for t in meta["output_token_logprobs"]],
            "decode": [t[0] for t in meta["output_token_logprobs"]],
            "margins": [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]],
            "log": log.read_text(errors="replace")}


def _moved(a: dict, b: dict) -> float:
    return _prompt_moves(a, b)[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from oscar_sglang import assets

    _two_cores()
    root = tmp_path_factory.mktemp("tp")
    model = assets.named_model_dir("qwen2.5-coder-0.5b")
    rot = root / "rotations"
    cmd = [sys.executable, "-m", "oscar_sglang.calibration", "--model", str(model), "--out", str(rot),
           "--method", "oscar-center", "--bits", "int2", "--tokens", "2048", "--seq-len", "512",
           "--sink", str(SINK), "--recent", str(RECENT), "--threads", "2", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calibrated = artifacts.load(rot)
    assert calibrated.model.num_kv_heads == 2
    swapped = artifacts.save(calibrated.for_kv_heads([1, 0]), root / "rotations-swapped")
    ids = _prompt_ids(model)
    return {"ids": ids, "artifact": calibrated,
            "bf16": _serve(model, root / "bf16.log", ids),
            "int2": _serve(model, root / "int2.log", ids, *INT2_FLAGS, "--oscar-rotations", str(rot)),
            "int2_tp2": _serve(model, root / "int2-tp2.log", ids, *INT2_FLAGS, "--oscar-rotations", str(rot),
                               ranks=2),
            "swapped": _serve(model, root / "swapped.log", ids, *INT2_FLAGS, "--oscar-rotations", str(swapped)),
            "model": model, "root": root}


def _startup_lines(log: str) -> dict[str, str]:
    """Each rank's startup line, by SGLang's rank prefix (``TP0``, ...)."""
    lines = {}
    for line in log.splitlines():
        if "oscar-int2 KV cache:" in line:
            rank = next((w.rstrip("]") for w in line.split() if w.startswith("TP")), "TP0")
            lines.setdefault(rank, line.split("oscar-int2 KV cache:", 1)[1])
    return lines


def _bytes_per_token(line: str) -> int:
    return int(line.split(" B/token", 1)[0].rsplit(" ", 1)[1])


def test_each_rank_serves_its_own_kv_head(served):
    one, two = _startup_lines(served["int2"]["log"]), _startup_lines(served["int2_tp2"]["log"])
    assert list(one) == ["TP0"] and "tensor-parallel" not in one["TP0"], one
    assert sorted(two) == ["TP0", "TP1"], served["int2_tp2"]["log"][-3000:]
    for rank in (0, 1):
        line = two[f"TP{rank}"]
        assert f"KV head {rank} of 2 (this tensor-parallel rank's share)" in line, line
        assert f"layers per format: {served['artifact'].policy_summary()}" in line, line
        assert 2 * _bytes_per_token(line) == _bytes_per_token(one["TP0"]), (line, one["TP0"])


def test_two_ranks_answer_like_one(served):
    tp, swapped = _moved(served["int2"], served["int2_tp2"]), _moved(served["int2"], served["swapped"])
    one_err, two_err = _moved(served["bf16"], served["int2"]), _moved(served["bf16"], served["int2_tp2"])
    print(f"\nprompt log-probabilities, mean change: two ranks vs one {tp:.4f}; swapped heads vs right ones "
          f"{swapped:.4f}; against BF16: one rank {one_err:.4f}, two {two_err:.4f}, swapped "
          f"{_moved(served['bf16'], served['swapped']):.4f}")
    assert swapped >= SENSITIVITY * TP_MEAN, "the swapped heads must be visible for this test to mean anything"
    assert tp < TP_MEAN, tp
    assert two_err < CLOSE * one_err, (two_err, one_err)


def test_two_ranks_decode_like_one(served):
    ref, got = served["int2"], served["int2_tp2"]
    assert len(got["ids"]) == DECODE and ref["ids"][0] == got["ids"][0], (ref["ids"], got["ids"])
    n = 0
    while n < DECODE and ref["ids"][n] == got["ids"][n]:
        assert abs(ref["decode"][n] - got["decode"][n]) < 4 * TP_MEAN, (n, ref["decode"], got["decode"])
        n += 1
    if n < DECODE:   # where the two first choose differently, one of them nearly tied
        assert min(ref["margins"][n], got["margins"][n]) < NEAR_TIE, (n, ref["margins"], got["margins"])


@pytest.mark.slow
def test_bf16_two_ranks_are_the_noise_floor(served):
    """The same model served BF16 by two ranks against one: what splitting the matmuls alone moves."""
    bf16_tp2 = _serve(served["model"], served["root"] / "bf16-tp2.log", served["ids"], ranks=2)
    floor, int2 = _moved(served["bf16"], bf16_tp2), _moved(served["int2"], served["int2_tp2"])
    print(f"\nBF16 two ranks vs one: {floor:.4f} nats on average (INT2: {int2:.4f})")
    assert floor < TP_MEAN, (floor, int2)

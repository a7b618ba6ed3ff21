"""Tensor parallelism in the real SGLang server: ``--tp-size 2`` and ``4`` with the INT2 cache, on CPU.

Three models, each calibrated by ``oscar-calibrate`` (oscar-center, INT2 rows everywhere, sink 4 / recent 16) and
served with those rotations by one rank and by several:

* the second development model, Qwen2.5-Coder-0.5B (trained): 2 KV heads over two ranks, one each (keys with a
  large per-head mean, docs/MODELS.md);
* the default model, SmolLM2-135M (trained): 3 KV heads, which two ranks do not divide; SGLang's CPU engine then
  pads the model to 4 KV heads (12 query heads) of zero weights, so the first rank serves heads 0-1 and the second
  head 2 and a padding head, whose rotations are neutral (``settings.served_fingerprint``,
  ``ServingConfig.for_rank``);
* a random Qwen3 model (test_architectures': 2 layers, 4 query / 2 KV heads, head_dim 128) over four ranks: the
  engine pads it to 4 KV heads, so ranks 0 and 1 serve one head each and ranks 2 and 3 padding only.

What a rank serving the wrong rotations would give, to prove the comparison can see it: one rank with an artifact
whose heads are what a wrong slice would hold (the two heads swapped; SmolLM2: head 2 given the padding head's
neutral rotation).  A ~400-token prompt of an evaluation play is prefilled in 64-token chunks (every chunk reads
the earlier ones from the INT2 cache) and 16 tokens decoded greedily.

* Each rank says in its startup line which KV heads it serves (SGLang's own rank prefix, ``TP0`` ...) and stores
  its share of the bytes per token.
* The ranks give one rank's prompt log-probabilities up to the noise of splitting the matmuls (measured
  2026-12-07, nats on average: Qwen 0.099, SmolLM2 0.066, random Qwen3 on four ranks 0.017; the same bf16
  model served BF16 by one rank and by the same ranks differs by 0.029, 0.043 and 0.012, and 2-bit codes amplify
  such noise where a value sits on a code boundary); the wrong rotations move them by 1.41, 0.61 and 0.50, so a
  rank taking the wrong slice could not pass.  Against the BF16 server, the ranks are as close as one.
* Decode: the same first token, the same log-probabilities along the tokens both choose, and the first
  differing token only where one rank's choice nearly tied.

SGLang 0.5.23's CPU engine cannot run several ranks as it ships (a NCCL communicator for the CPU device), so the
tensor-parallel servers start with ``tests/cpu_tp_site`` on ``PYTHONPATH`` (one default changed, its docstring
says which) and the two cores bound to the ranks in turn.  About 3 + 2 minutes on two cores (Qwen and the random
Qwen3; per model: calibration, three one-rank servers of ~25-30 s, the tensor-parallel one ~45-100 s);
``--slow`` adds SmolLM2 (~2.5 minutes: its padding has a fast form in the default run, the pool-level ranks of
``tests/test_sglang_tp.py`` and the random Qwen3's padded ranks) and the BF16 tensor-parallel servers (the noise
floor).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_sglang import artifacts
from oscar_sglang.sglang.launcher import local_server, post, server_env
from test_architectures import _build, _prompt_ids, _prompt_moves   # the same prompt, its comparison

pytestmark = [pytest.mark.server, pytest.mark.model]

SITE = Path(__file__).parent / "cpu_tp_site"
SINK, RECENT, CHUNK, DECODE = 4, 16, 64, 16
SERVER_FLAGS = ("--max-total-tokens", "2048", "--chunked-prefill-size", str(CHUNK))
INT2_FLAGS = ("--kv-cache-dtype", "oscar-int2", "--oscar-sink", str(SINK), "--oscar-recent", str(RECENT))
SENSITIVITY = 3.0   # the wrong rotations must move the prompt by this many of the model's tp_mean at least
CLOSE = 1.1         # the ranks' error against BF16 within this factor of one rank's (measured 0.99-1.01)
NEAR_TIE = 1.0      # nats: the top-2 margin where a differing greedy token is noise (as in test_architectures)


def _cores(ranks: int = 2) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on this machine's first two cores, taken in turn."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two ranks need two cores")
    return "|".join(str(cores[rank % 2]) for rank in range(ranks))


def _serve(model: Path, log: Path, ids: list[int], *extra: str, ranks: int = 1, split: str = "--tp-size",
           environ: dict | None = None, then=None, processes: int | None = None) -> dict:
    """The prompt's log-probabilities, ``DECODE`` greedy tokens with their log-probabilities and top-2 margins,
    and the log's text, from a CPU server with ``ranks`` ranks (tensor-parallel; ``split="--pp-size"``: pipeline
    stages) and ``environ`` added to its environment; ``then(url)``, called after the prompt, gives "then".
    ``processes``: the server's processes, where ``extra`` multiplies the ranks (default ``ranks``)."""
    env = {**server_env(cpu=True), **(environ or {})}
    if ranks > 1:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH")) if p)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = _cores(processes or ranks)
        extra = (*extra, split, str(ranks))
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": DECODE, "ignore_eos": True}}
    with local_server(model, log, *SERVER_FLAGS, *extra, cpu=True, env=env) as url:
        meta = post(url, "/generate", body)["meta_info"]
        after = then(url) if then else None
    return {"prompt": [t[0] for t in meta["input_token_logprobs"][1:]],
            "ids": [t[1] for t in meta["output_token_logprobs"]],
            "decode": [t[0] for t in meta["output_token_logprobs"]],
            "margins": [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]],
            "then": after, "log": log.read_text(errors="replace")}


def _moved(a: dict, b: dict) -> float:
    return _prompt_moves(a, b)[0]


PADDED = "this tensor-parallel rank's share; SGLang's CPU engine pads the {} KV heads to 4"
# per model (its name for assets.named_model_dir, or a random model of test_architectures' family): its KV heads,
# the tensor-parallel ranks, the head order of the artifact a wrong slice would serve (None: a neutral rotation in
# the last head's place, as a padding head's), the mean change the ranks may make to one rank's prompt (nats), and
# what each rank's startup line says of its heads
MODELS = {
    "qwen2.5-coder-0.5b": dict(kv_heads=2, ranks=2, wrong=[1, 0], tp_mean=0.25,   # measured 0.099 (wrong: 1.41)
                               heads=["KV head 0 of 2 (this tensor-parallel rank's share)",
                                      "KV head 1 of 2 (this tensor-parallel rank's share)"]),
    "smollm2-135m": dict(kv_heads=3, ranks=2, wrong=None, tp_mean=0.15,           # measured 0.066 (wrong: 0.61)
                         heads=[f"KV heads 0-1 of 3 ({PADDED.format(3)})",
                                f"KV head 2 of 3 and 1 padding head ({PADDED.format(3)})"]),
    "random qwen3": dict(kv_heads=2, ranks=4, wrong=[1, 0], tp_mean=0.06,         # measured 0.017 (wrong: 0.50)
                         heads=[f"KV head 0 of 2 ({PADDED.format(2)})", f"KV head 1 of 2 ({PADDED.format(2)})",
                                *[f"1 padding head only ({PADDED.format(2)})"] * 2]),
}


def _calibrate(model: Path, out: Path) -> artifacts.RotationArtifacts:
    """``oscar-calibrate`` as a user runs it (oscar-center, INT2 rows everywhere, 2048 tokens, sink and recent
    ``SINK`` / ``RECENT``) into ``out``; the artifact it wrote."""
    cmd = [sys.executable, "-m", "oscar_sglang.calibration", "--model", str(model), "--out", str(out),
           "--method", "oscar-center", "--bits", "int2", "--tokens", "2048", "--seq-len", "512",
           "--sink", str(SINK), "--recent", str(RECENT), "--threads", "2", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return artifacts.load(out)


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name == "smollm2-135m" else name
                                        for name in MODELS])
def served(request, tmp_path_factory):
    from oscar_sglang import assets

    _cores()
    name, spec = request.param, MODELS[request.param]
    root = tmp_path_factory.mktemp("tp")
    if name.startswith("random "):   # 2 layers, 4 query / 2 KV heads: four ranks of one query head each
        model = _build(name.split()[1], root / "model")
    else:
        model = assets.named_model_dir(name)
    rot = root / "rotations"
    calibrated = _calibrate(model, rot)
    kv = calibrated.model.num_kv_heads
    assert kv == spec["kv_heads"]
    wrong = (calibrated.for_kv_heads(spec["wrong"]) if spec["wrong"] else
             calibrated.for_kv_heads(list(range(kv - 1)), padding=1))
    wrong_dir = artifacts.save(wrong, root / "rotations-wrong")
    ids = _prompt_ids(model)
    return {"ids": ids, "artifact": calibrated, "spec": spec, "name": name,
            "bf16": _serve(model, root / "bf16.log", ids),
            "int2": _serve(model, root / "int2.log", ids, *INT2_FLAGS, "--oscar-rotations", str(rot)),
            "int2_tp": _serve(model, root / "int2-tp.log", ids, *INT2_FLAGS, "--oscar-rotations", str(rot),
                              ranks=spec["ranks"]),
            "wrong": _serve(model, root / "wrong.log", ids, *INT2_FLAGS, "--oscar-rotations", str(wrong_dir)),
            "model": model, "root": root}


def _startup_lines(log: str, prefixes: tuple[str, ...] = ("TP",)) -> dict[str, str]:
    """Each rank's startup line, by SGLang's rank prefix: its words that start with one of ``prefixes``
    (``TP0``, ...; ``("PP",)``: ``PP0``, ...; ``("PP", "TP")``: ``PP0 TP1``, ...), ``<first prefix>0`` where
    there is none (one process)."""
    lines = {}
    for line in log.splitlines():
        if "oscar-int2 KV cache:" in line:
            head, text = line.split("oscar-int2 KV cache:", 1)
            words = [w.rstrip("]") for w in head.split() if w.startswith(prefixes)]
            lines.setdefault(" ".join(words) or f"{prefixes[0]}0", text)
    return lines


def _bytes_per_token(line: str) -> int:
    return int(line.split(" B/token", 1)[0].rsplit(" ", 1)[1])


def test_each_rank_serves_its_own_kv_heads(served):
    ranks = served["spec"]["ranks"]
    one, many = _startup_lines(served["int2"]["log"]), _startup_lines(served["int2_tp"]["log"])
    assert list(one) == ["TP0"] and "tensor-parallel" not in one["TP0"], one
    assert sorted(many) == [f"TP{rank}" for rank in range(ranks)], served["int2_tp"]["log"][-3000:]
    kv = served["artifact"].model.num_kv_heads
    slots = -(-kv // ranks)   # KV heads a rank holds, padding included
    for rank in range(ranks):
        line = many[f"TP{rank}"]
        assert f", {served['spec']['heads'][rank]}, " in line, line
        assert f"layers per format: {served['artifact'].policy_summary()}" in line, line
        assert kv * _bytes_per_token(line) == slots * _bytes_per_token(one["TP0"]), (line, one["TP0"])


def test_ranks_answer_like_one(served):
    bound = served["spec"]["tp_mean"]
    tp, wrong = _moved(served["int2"], served["int2_tp"]), _moved(served["int2"], served["wrong"])
    one_err, many_err = _moved(served["bf16"], served["int2"]), _moved(served["bf16"], served["int2_tp"])
    print(f"\n{served['name']}: prompt log-probabilities, mean change: {served['spec']['ranks']} ranks vs one "
          f"{tp:.4f}; a wrong slice's rotations vs the right ones {wrong:.4f}; against BF16: one rank {one_err:.4f}, "
          f"{served['spec']['ranks']} {many_err:.4f}, the wrong rotations "
          f"{_moved(served['bf16'], served['wrong']):.4f}")
    assert wrong >= SENSITIVITY * bound, "the wrong rotations must be visible for this test to mean anything"
    assert tp < bound, tp
    assert many_err < CLOSE * one_err, (many_err, one_err)


def _decodes_like(ref: dict, got: dict, bound: float) -> None:
    """``got``'s greedy tokens are ``ref``'s: the same first token, log-probabilities within ``bound`` along the
    tokens both choose, and the first differing token (if any) where one of them nearly tied."""
    assert len(got["ids"]) == DECODE and ref["ids"][0] == got["ids"][0], (ref["ids"], got["ids"])
    n = 0
    while n < DECODE and ref["ids"][n] == got["ids"][n]:
        assert abs(ref["decode"][n] - got["decode"][n]) < bound, (n, ref["decode"], got["decode"])
        n += 1
    if n < DECODE:
        assert min(ref["margins"][n], got["margins"][n]) < NEAR_TIE, (n, ref["margins"], got["margins"])


def test_ranks_decode_like_one(served):
    _decodes_like(served["int2"], served["int2_tp"], 4 * served["spec"]["tp_mean"])


@pytest.mark.slow
def test_bf16_ranks_are_the_noise_floor(served):
    """The same model served BF16 by the same ranks against one: what splitting the matmuls alone moves."""
    bf16_tp = _serve(served["model"], served["root"] / "bf16-tp.log", served["ids"], ranks=served["spec"]["ranks"])
    floor, int2 = _moved(served["bf16"], bf16_tp), _moved(served["int2"], served["int2_tp"])
    print(f"\n{served['name']}: BF16 {served['spec']['ranks']} ranks vs one: {floor:.4f} nats on average "
          f"(INT2: {int2:.4f})")
    assert floor < served["spec"]["tp_mean"], (floor, int2)

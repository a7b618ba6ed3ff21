"""The soak's short form (``scripts/soak.py``) against the real oscar-int2 server on CPU.

30 requests from 6 client threads: every kind of request (plain, streaming,
OpenAI completions and streaming chat, a client that disconnects mid-stream,
an ``/abort_request``), malformed requests mixed in, ``/flush_cache`` during
the traffic; then zero 5xx, every accepted request finished or aborted as
asked, the hot pool holding exactly one request's window after a flush, and
the probes repeating their answers.  The long form's figures are in
docs/RELIABILITY.md.  The soak itself runs with ``--slow`` only (~1
minute on two cores); in the default run, test_sglang_server.py's 16
concurrent requests and test_compat.py's refusal of an empty prompt stand
for it.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak  # noqa: E402


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_short_soak_leaves_the_server_healthy_and_unchanged(tmp_path):
    from transformers import AutoConfig

    from oscar_sglang import artifacts, assets
    from oscar_sglang.sglang.launcher import local_server

    model = assets.default_model_dir()
    rot = artifacts.save(artifacts.hadamard(artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))),
                         tmp_path / "rot")
    log = tmp_path / "server.log"
    flags = ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rot), "--oscar-sink", "4", "--oscar-recent",
             "16", "--context-length", "1024", "--max-total-tokens", "8192", "--decode-log-interval", "8"]
    with local_server(model, log, *flags) as url:
        report = soak.soak(url, log, requests=30, concurrency=6, max_prompt_tokens=200, max_minutes=15, seed=1,
                           sink=4, recent=16, context_len=1024, progress=False)
    soak.write_report(report, "tests/test_soak.py", tmp_path / "out")
    print("\n" + (tmp_path / "out" / "RELIABILITY.md").read_text())
    assert report["ran"] == 30 and report["skipped_for_time"] == 0
    assert report["errors_5xx_or_dropped"] == 0, report["examples_5xx"]
    assert report["unfinished"] == 0 and report["aborts_not_honoured"] == 0
    assert report["bad_input_not_4xx"] == 0, report["bad_input"]
    # alone, an empty prompt would be an extend of 0 tokens, which kills SGLang's scheduler: refused instead
    assert report["bad_input_alone"]["empty_prompt"][0] == 400, report["bad_input_alone"]
    assert "prompt is empty" in report["bad_input_alone"]["empty_prompt"][1]
    assert report["hot_pool_after"]["ok"], report["hot_pool_after"]
    assert all(p["ok"] for p in report["probes"]), report["probes"]
    during = report["hot_pool_during"]      # the server's own hot-pool lines over the traffic
    assert during["lines"] > 0 and during["in_window_evictions"] == 0 and 0 < during["max_in_window"] <= during["entries"]
    assert set(report["retractions"]) == {"events", "requests"}
    assert report["ok"]


def test_memory_pressure_is_read_from_the_server_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("x oscar-int2 hot pool: 40/800 entries in window, 3 out of window; in-window evictions 0, denied "
                   "window tokens 0; BF16 reads 10/20 (50.0 %) in this decode batch\n"
                   "[w] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 500\n"
                   "x oscar-int2 hot pool: 60/800 entries in window, 1 out of window; in-window evictions 2, denied "
                   "window tokens 5; BF16 reads 10/20 (50.0 %) in this decode batch\n"
                   "[w] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 90\n"
                   "[w] Testing retraction. #retracted_reqs: 7, #new_tokens_gained: 1\n")
    got = soak.memory_pressure(log)
    assert got["retractions"] == {"events": 2, "requests": 4}          # the test switch's retractions do not count
    assert got["hot_pool_during"] == {"lines": 2, "max_in_window": 60, "entries": 800, "in_window_evictions": 2,
                                      "denied_window_tokens": 5}


def test_long_outputs_are_a_share_of_the_finishing_kinds():
    import random

    work = soak.Workload(0, 300)
    plain = soak.traffic_plan(work, random.Random(3), 400)
    assert max(n for g, _, _, n in plain if g == "ok") <= 32
    plan = soak.traffic_plan(soak.Workload(0, 300), random.Random(3), 400, long_output_tokens=512, long_output_share=0.2)
    assert len(plan) == 400 and {k for g, k, _, _ in plan if g == "bad"} == set(soak.BAD)
    long = [(k, n) for g, k, _, n in plan if g == "ok" and n > 32]
    assert all(k in soak.LONG_KINDS and 256 <= n <= 512 for k, n in long)
    finishing = sum(1 for g, k, _, _ in plan if g == "ok" and k in soak.LONG_KINDS)
    assert 0.1 < len(long) / finishing < 0.3                       # ~20 % of the requests that can run long

"""The kernel benchmark's baselines (scripts/bench_baselines.py) on CPU, and the whole CPU smoke run.

FlashInfer is GPU-only; its orchestration (bounded warm-up child, plan/run calls,
page table) is exercised against a stand-in ``flashinfer`` module that computes
the same attention in torch.  What the real library does is only checked on a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_baselines as bl  # noqa: E402

from oscar_sglang.kernels import scenario  # noqa: E402


def _paged(lens, kv_heads=2, d=64, seed=0):
    paged = scenario.paged_layout(lens, bl.PAGE, seed, spare_pages=2)
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(paged.num_slots, kv_heads, d, generator=g).bfloat16()
    vb = torch.randn(paged.num_slots, kv_heads, d, generator=g).bfloat16()
    q = torch.randn(len(lens), kv_heads * 4, d, generator=g).bfloat16()
    return paged, kb, vb, q


def _direct(q, kb, vb, paged, scale):
    """Attention per request straight from its slots (no page table)."""
    outs = []
    for b in range(len(paged.seq_lens)):
        s = paged.slots(b)
        outs.append(bl.attention_ref(q[b:b + 1], kb[s].transpose(0, 1)[None], vb[s].transpose(0, 1)[None], scale))
    return torch.cat(outs)


def test_page_table_reads_the_same_rows():
    lens = [1, 16, 17, 40, 33]  # partial, full and multi-page requests
    paged, kb, vb, q = _paged(lens)
    rows = paged.req_to_token[paged.req_pool_indices]
    indptr, indices, last = bl.page_table(rows, lens)
    assert indptr.tolist() == [0, 1, 2, 4, 7, 10]
    assert last.tolist() == [1, 16, 1, 8, 1]
    assert indices.dtype == torch.int32 and int(indices.min()) >= 1  # page 0 holds the padding slot
    kp, vp = kb.view(-1, bl.PAGE, 2, 64), vb.view(-1, bl.PAGE, 2, 64)
    out = bl.paged_decode_torch(q, kp, vp, indptr, indices, last, 0.125)
    torch.testing.assert_close(out, _direct(q, kb, vb, paged, 0.125), rtol=0, atol=1e-6)


def test_page_table_refuses_tokens_off_pages():
    paged = scenario.paged_layout([20], 1, 0)  # pages of one slot: consecutive tokens on scattered slots
    rows = paged.req_to_token[paged.req_pool_indices]
    with pytest.raises(ValueError, match="whole pages"):
        bl.page_table(rows, [20])


def test_dense_cache_and_sdpa_forms():
    lens = [40, 40, 40]
    paged, kb, vb, q = _paged(lens)
    rows = paged.req_to_token[paged.req_pool_indices]
    flat_k = torch.empty(3 * 2 * 40 * 64, dtype=torch.bfloat16)
    flat_v = torch.empty_like(flat_k)
    k, v = bl.dense_cache(kb, vb, rows, lens, flat_k, flat_v)
    assert k.shape == (3, 2, 40, 64) and k.is_contiguous()
    ref = _direct(q, kb, vb, paged, 0.125)
    torch.testing.assert_close(bl.attention_ref(q, k, v, 0.125), ref, rtol=0, atol=1e-6)
    for form, run in bl.SDPA_FORMS.items():
        torch.testing.assert_close(run(q, k, v, 0.125).float(), ref, rtol=0, atol=2e-2, msg=form)


def test_sdpa_falls_back_to_a_backend_that_runs():
    paged, kb, vb, q = _paged([24, 24])
    rows = paged.req_to_token[paged.req_pool_indices]
    k, v = bl.dense_cache(kb, vb, rows, [24, 24], torch.empty(2 * 2 * 24 * 64, dtype=torch.bfloat16),
                          torch.empty(2 * 2 * 24 * 64, dtype=torch.bfloat16))
    sdpa = bl.Sdpa(False, backends=[("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)])
    backend, runs = sdpa.prepare(q, k, v, 0.125)  # no CPU efficient kernel: refused, then math
    assert backend == SDPBackend.MATH and [r[0] for r in runs] == ["math/enable_gqa", "math/packed"]
    assert [r.split(":")[0] for r in sdpa.refused] == ["efficient/enable_gqa", "efficient/packed"]
    with sdpa_kernel(backend):
        for _, fn, out in runs:
            torch.testing.assert_close(fn().float(), bl.attention_ref(q, k, v, 0.125), rtol=0, atol=2e-2)
            torch.testing.assert_close(out, fn(), rtol=0, atol=0)
    sdpa.prepare(q, k, v, 0.125)  # the kept backend is tried first: nothing new refused
    assert len(sdpa.refused) == 2


def test_copy_bandwidth_counts_read_and_write():
    r = bl.copy_bandwidth(lambda fn: (fn(), 2.0)[1], torch.device("cpu"), 1 << 20)
    assert r["copy_verified"] and r["GBps_read_plus_write"] == pytest.approx(2 * (1 << 20) / 2.0 / 1e6)


FAKE_FLASHINFER = '''
"""Stand-in for flashinfer in tests: the wrapper's API, attention computed in torch."""
import os, time
import bench_baselines as bl

__version__ = "0.0-test"
time.sleep(float(os.environ.get("FAKE_FI_SLEEP", "0")))


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD"
        self.planned = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", q_data_type=None, kv_data_type=None, sm_scale=None):
        self.planned = (indptr, indices, last_page_len, sm_scale)

    def run(self, q, paged_kv_cache):
        indptr, indices, last, scale = self.planned
        out = bl.paged_decode_torch(q, *paged_kv_cache, indptr, indices, last, scale)
        if os.environ.get("FAKE_FI_WRONG"):
            out = out + 1
        return out.to(q.dtype)
'''


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch):
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text(textwrap.dedent(FAKE_FLASHINFER))
    path = os.pathsep.join([str(tmp_path), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FAKE_FI_SLEEP", raising=False)
    monkeypatch.delenv("FAKE_FI_WRONG", raising=False)
    yield monkeypatch
    sys.modules.pop("flashinfer", None)


def test_flashinfer_orchestration(fake_flashinfer):
    fi = bl.FlashInferDecode(True, kv_heads=2, gqa=4, tensor_cores=True, timeout=120, child_device="cpu")
    assert fi.status == "ok"
    fi.start([64])
    assert fi.setup(64, torch.device("cpu")) is None, fi.reason
    assert "max rel err" in fi.warmup_log[64]
    lens = [17, 40]
    paged, kb, vb, q = _paged(lens)
    table = bl.page_table(paged.req_to_token[paged.req_pool_indices], lens)
    fn = fi.prepare(64, q, kb, vb, *table, 0.125)
    torch.testing.assert_close(fn().float(), _direct(q, kb, vb, paged, 0.125), rtol=0, atol=2e-2)
    fi.close()


def test_flashinfer_warmup_failures_become_reasons(fake_flashinfer):
    fake_flashinfer.setenv("FAKE_FI_WRONG", "1")
    fi = bl.FlashInferDecode(True, kv_heads=1, gqa=4, tensor_cores=False, timeout=120, child_device="cpu")
    assert fi.setup(64, torch.device("cpu")).startswith("not available: warm-up failed (rc 2)")
    fake_flashinfer.delenv("FAKE_FI_WRONG")
    fake_flashinfer.setenv("FAKE_FI_SLEEP", "60")
    fi = bl.FlashInferDecode(True, kv_heads=1, gqa=4, tensor_cores=False, timeout=3, child_device="cpu")
    fi.start([64, 128])
    assert "exceeded --flashinfer-timeout 3 s (killed)" in fi.setup(64, torch.device("cpu"))
    assert fi.warmup_s[64] < 30
    fi.close()  # kills the d=128 child still sleeping
    assert all(p.poll() is not None for p, _ in fi.children.values())
    assert fi.reason[128].startswith("not available: warm-up abandoned")


def test_cpu_smoke_run(tmp_path, fake_flashinfer):
    """The whole benchmark on tiny shapes under the interpreter (about 45 s on 2 cores), FlashInfer's
    path run with the stand-in module (``--flashinfer-on-cpu``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--cpu-smoke", "--out",
                        str(tmp_path), "--flashinfer-on-cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench_kernels_cpu_smoke.json").read_text())
    assert not data["problems"]
    assert len(data["decode"]) == 8 and data["copy"]["copy_verified"]
    assert not any("graph" in row for row in data["decode"])   # CUDA graphs: CUDA only
    for row in data["decode"]:
        assert row["sdpa_backend"] in ("math/enable_gqa", "math/packed")
        assert set(row["sdpa_forms"]) == {"math/enable_gqa", "math/packed"}
        assert row["flashinfer_ms"] > 0 and row["flashinfer_rel_err"] < 2e-2
        assert row["best_bf16"] in ("triton_bf16", "sdpa", "flashinfer") and row["speedup"] > 0
        assert row["smoke_page_table_vs_fp32"] < 1e-3 and row["smoke_triton_bf16_vs_fp32"] < 2e-2
        assert row["int4k_ms"] > 0 and row["int4k_MB"] > row["int2_MB"] and row["speedup_int4k"] > 0
        assert row["q_rot"] in ("kernel", "launch") and row["int2_other_q_rot_ms"] > 0
    # the INT2 columns are the loop a server's startup timing chose here (per head size), the default beside it
    served = data["meta"]["served_decode"]
    assert set(served) == {"128", "64"} and all(c["summary"].startswith("decode loop: ") for c in served.values())
    for row in data["decode"]:                   # the pick of the timed case nearest the row's batch
        c = served[str(row["d"])]
        nearest = min(range(len(c["cases"])), key=lambda i: (abs(math.log(row["batch"] / c["cases"][i][0])),
                                                              c["cases"][i][0]))
        assert row["int2_loop"] == c["knobs"][nearest]
        assert (row.get("int2_default_ms") is None) == (row["int2_loop"] == "default")
    assert "chosen by its startup timing (`kernels/decode/autotune.py`) per head size: d=64: b1 x 96 `" in \
        (tmp_path / "bench_kernels_cpu_smoke.md").read_text()
    assert set(data["check"]["per_format"]) == {"int2", "int4k"}
    assert {(r["d"], r["formats"]) for r in data["write"]} == {(d, f) for d in (64, 128) for f in ("int2", "int4k")}
    # every case with the default tile, and INT2 at d 128 with 16 channels a dot step too (the smoke's two counts)
    assert {(r["d"], r["formats"], r["tokens"]) for r in data["write"] if r["kc"] == 16} == {(128, "int2", 16),
                                                                                              (128, "int2", 64)}
    assert sum(r["kc"] == 32 for r in data["write"]) == 8 and all(r["ms"] > 0 for r in data["write"])
    assert [r["batch"] for r in data["hot_update"]] == [1, 4]
    for row in data["hot_update"]:                     # CPU: no graph; both paths and both re-pins ran
        assert row["fused_graph_ms"] is None and row["torch_graph_ms"] is None
        assert row["fused_eager_ms"] > 0 and row["torch_eager_ms"] > 0
        assert row["repin_triton_ms"] > 0 and row["repin_torch_ms"] > 0
    ext = data["extend"]                                # a 96-token prompt in chunks of 32, every kernel ran
    assert [r["prefix"] for r in ext["rows"]] == [0, 32, 64] and ext["prompt_row"]["tokens"] == 96
    for row in ext["rows"]:
        assert row["int2_bf16_ms"] > 0 and row["int2_tf32_ms"] > 0 and row["sdpa_ms"] > 0 and row["sglang_ms"] > 0
        assert row["smoke_int2_vs_reference"] < 3e-2 and row["smoke_sdpa_vs_fp32"] < 2e-2
        assert 0 < row["int2_bf16_vs_fp32"] < 3e-2 and row["sglang_vs_sdpa"] < 3e-2
        assert row["int2_sdpa_ms"] > 0 and 0 < row["int2_sdpa_vs_fp32"] < 3e-2   # the sdpa path, bf16 operands
        assert row["int2_vs_best_bf16"] > 0
    assert ext["prompt_row"]["GFLOP"] == sum(r["GFLOP"] for r in ext["rows"])
    parts = ext["sdpa_parts"]                            # the sdpa path's rotations (now and as in run 1), read
    assert (parts["prefix"], parts["tokens"], parts["read_backend"]) == (64, 32, "torch")
    assert parts["rotations_ms"] > 0 and parts["broadcast_rotations_ms"] > 0 and parts["read_ms"] > 0
    assert ext["sglang_note"] is None
    assert (tmp_path / "bench_kernels_cpu_smoke.png").stat().st_size > 0
    md = (tmp_path / "bench_kernels_cpu_smoke.md").read_text()
    assert "Copy bandwidth" in md and "d=128: ready" in md and "d=64: ready" in md and "INT4-K" in md
    assert "## Where the queries are rotated" in md and "## Hot pool update per decode step" in md
    assert "## Prefill attention per layer" in md and "| all | 96 |" in md
    assert "Parts of the sdpa path on the last chunk (32 tokens over 64 cached)" in md
    assert data["meta"]["sections_to_come"] == [] and "Written before the sections" not in md  # the final save
    from oscar_sglang.kernels.decode.triton_kernel import rotates_q_in_kernel

    for row in data["decode"]:  # the label is the choice decode_attention made (CPU: 4 "multiprocessors")
        chosen = rotates_q_in_kernel(row["batch"], row["kv_heads"], row["splits"], torch.device("cpu"))
        assert row["q_rot"] == ("kernel" if chosen else "launch")
    # the GPU-proof goals read this report's keys (scripts/device/goals.py), judged here from the longest context
    goals = load_script("device/goals.py")
    bandwidth, batch1 = goals.kernel_goals(data, long=320)
    assert bandwidth["measured"].count("d128 b") == 2 and "not measured" not in bandwidth["verdict"]
    assert batch1["measured"].startswith("d128 320: ") and "x vs " in batch1["measured"]
    assert goals.decode_tile_line(data).startswith("decode tiles (not a goal): ")  # the sweep's rows, as written


def test_prefill_section_renders_missing_kernels_and_failures():
    """The prefill section's table when SGLang's kernel is absent and a chunk failed: n/a, never a crash."""
    ext = load_script("bench_extend.py")
    rows = [ext._rates({"prefix": 0, "tokens": 8, "GFLOP": 2.0, "int2_bf16_ms": 1.0, "int2_tf32_ms": 2.0,
                        "int2_sdpa_ms": 0.7, "sdpa_ms": 0.5, "int2_bf16_vs_fp32": 1e-3}),
            ext._rates({"prefix": 8, "tokens": 8, "GFLOP": 4.0, "note": "failed: OutOfMemoryError: x"})]
    res = {"prompt": 16, "chunk": 8, "kv_heads": 8, "q_heads": 32, "d": 128, "sink": 64, "recent": 256,
           "layers": 32, "tile": ext.DEFAULT_TILE, "sglang_note": "not available: ImportError: no sglang",
           "rows": rows, "prompt_row": ext._rates(ext._prompt_sum(rows)),
           "sweep": [dict(ext.DEFAULT_TILE, block_n=64, int2_bf16_ms=0.8), dict(ext.DEFAULT_TILE, note="budget spent")]}
    assert rows[0]["int2_bf16_tflops"] == 2.0 and rows[0]["int2_vs_best_bf16"] == 2.0  # 2 GFLOP in 1 ms; vs SDPA
    assert rows[1]["int2_bf16_tflops"] is None and rows[1]["int2_vs_best_bf16"] is None
    assert res["prompt_row"]["int2_bf16_ms"] is None and res["prompt_row"]["GFLOP"] == 6.0  # a chunk missing
    md = "\n".join(ext.markdown(res))
    assert "SGLang Triton BF16: not available: ImportError" in md and "- prefix 8: failed: OutOfMemoryError" in md
    assert "| 0 | 8 | 2 | 1.000 | 2.000 | 0.700 | n/a | 0.500 |" in md and "| all | 16 | 6 | n/a |" in md
    assert "| 64 | 64 | 8 | 2 | 0.800 |" in md and "| 64 | 32 | 8 | 2 | budget spent |" in md
    assert ext.markdown(None) == []


def test_the_broadcast_rotation_timed_as_run_1s_computes_what_is_served():
    # bench_extend times torch.matmul's broadcast (how the rotations ran until 2026-12-05) beside the einsum.
    from oscar_sglang.rotation import rotate_queries

    ext = load_script("bench_extend.py")
    x, r = torch.randn(5, 8, 64), torch.linalg.qr(torch.randn(2, 64, 64))[0]
    torch.testing.assert_close(ext._broadcast_rotation(x, r), rotate_queries(x, r), rtol=1e-5, atol=1e-5)


def test_decode_graph_times_and_their_section(monkeypatch):
    # Off CUDA nothing can be recorded: each decode says why, no speedup is claimed.
    out = bl.graph_times({"int2": lambda: None, "sdpa": lambda: None}, lambda fn: 1.0)
    assert out["int2_ms"] is None and out["sdpa_ms"] is None and out["speedup"] is None
    assert out["int2_note"] and out["sdpa_note"]
    # Recorded (a stand-in graph replaying the function): speedup = the best BF16 / INT2; a failure is a note.
    from types import SimpleNamespace

    def capture(fn):
        if fn == "broken":
            raise RuntimeError("operation not permitted when stream is capturing")
        return SimpleNamespace(replay=fn), None

    monkeypatch.setattr(scenario, "capture_graph", capture)
    ms = {"a": 0.02, "b": 0.08, "c": 0.06, "d": 0.025}
    out = bl.graph_times({"int2": "a", "int2_other_q_rot": "d", "triton_bf16": "b", "sdpa": "c",
                          "flashinfer": "broken"}, ms.get)
    assert (out["int2_ms"], out["triton_bf16_ms"], out["sdpa_ms"]) == (0.02, 0.08, 0.06)
    assert out["speedup"] == pytest.approx(3.0) and out["flashinfer_ms"] is None
    assert out["flashinfer_note"].startswith("RuntimeError: operation not permitted")
    lines = bl.graph_lines([{"d": 128, "batch": 1, "context": 32768, "graph": out}, {"d": 64, "batch": 8}])
    assert "## Decode in CUDA graphs (the goals' shapes)" in lines
    assert lines[-1] == ("| 128 | 1 | 32768 | 0.0200 | 0.0250 | 0.0800 | 0.0600 | 3.00 | flashinfer: RuntimeError: "
                         "operation not permitted when stream is capturing |")
    assert bl.graph_lines([{"d": 64, "batch": 8}]) == []


def test_fit_to_memory_leaves_out_the_largest_cases_first():
    cases = [(1, 4), (8, 4), (1, 32), (8, 32), (32, 1)]  # token counts 4, 32, 32, 256, 32

    def bytes_for(kept):  # buffers sized by the largest case, as the benchmark's
        return 10 * max(b * c for b, c in kept)

    kept, out = bl.fit_to_memory(cases, bytes_for, free_bytes=10_000, headroom_bytes=0)
    assert kept == cases and out == []
    kept, out = bl.fit_to_memory(cases, bytes_for, free_bytes=2_000, headroom_bytes=0)
    assert kept == [(1, 4), (8, 4), (1, 32), (32, 1)] and out == [((8, 32), 2560)]
    # the headroom counts: 320 + 1700 > 2000, so every case of 32 tokens goes too, in one step
    kept, out = bl.fit_to_memory(cases, bytes_for, free_bytes=2_000, headroom_bytes=1_700)
    assert kept == [(1, 4)] and out == [((8, 32), 2560), ((8, 4), 320), ((1, 32), 320), ((32, 1), 320)]
    assert bl.fit_to_memory(cases, bytes_for, free_bytes=10, headroom_bytes=0)[0] == []
    assert bl.free_device_bytes(torch.device("cpu")) is None


def test_decode_buffers_are_counted_before_they_are_taken():
    """bench_kernels counts its shared decode buffers on the meta device (to leave out cases that would not fit
    an H100's memory): the count equals what it allocates, and an independent per-slot formula."""
    code = textwrap.dedent("""
        import json, sys
        sys.argv = ["bench_kernels.py", "--cpu-smoke"]
        from script_modules import load_script
        import torch
        bk = load_script("bench_kernels.py")
        fits = [(1, 96), (2, 96), (1, 320), (2, 320)]
        out = {}
        for d in (64, 128):
            meta = bk.buffer_bytes(bk.decode_buffers(fits, d, "meta"))
            real = bk.buffer_bytes(bk.decode_buffers(fits, d, torch.device("cpu")))
            out[d] = [meta, real, bk.KV_HEADS, bk.PAGE, max(bk.BATCHES)]
            bk.ARGS.device_gib, bk.ARGS.memory_headroom_gib = (meta - 1) / 2**30, 0.0
            kept, skipped = bk.cases_in_memory(d, fits)
            out[d] += [kept, [(s["batch"], s["context"]) for s in skipped], skipped[0]["reason"]]
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for d, (meta, real, kv, page, max_batch, kept, skipped, reason) in ((int(k), v) for k, v in res.items()):
        slots = (-(-640 // page) + max_batch + 1) * page       # every case's pages, as the benchmark pages them
        per_slot = 4 + kv * (2 * (d // 4 + 4) + (d // 2 + 4) + 2 * 2 * d)  # hot index, INT2 K+V, INT4 keys, BF16
        assert meta == real == slots * per_slot + 2 * 2 * 640 * kv * d  # + the largest case's dense K, V
        assert kept == [[1, 96], [2, 96], [1, 320]] and skipped == [[2, 320]]   # one byte short: the largest out
        assert reason.startswith("buffers ") and reason.endswith(" GiB free")


def test_launch_times_with_the_real_profiler_on_cpu_and_their_section():
    """``launch_times`` runs torch's real profiler (on CPU it sees operators, on a GPU kernels): per call the time
    and count of what each decode ran, the L2 flush's own work left out, a failing decode a note; the section
    lists them under the eager times."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def two_ops():
        return torch.mm(a, b).relu_()

    def broken():
        raise RuntimeError("no kernel")

    out = bl.launch_times({"int2": two_ops, "sdpa": broken}, runs=5, device="cpu")
    names = {k["kernel"] for k in out["int2"]["kernels"]}
    assert {"aten::mm", "aten::relu_"} <= names and "aten::add_" not in names   # the flush's add_ left out
    mm = next(k for k in out["int2"]["kernels"] if k["kernel"] == "aten::mm")
    assert mm["launches"] == 1 and mm["us"] > 0
    assert out["int2"]["sum_us"] == pytest.approx(sum(k["us"] for k in out["int2"]["kernels"]))
    assert out["sdpa"] == {"note": "RuntimeError: no kernel"}
    # the aggregation: per call, the flush's names skipped, longest first
    got = bl.per_call([("split", 300.0, 20), ("merge", 60.0, 20), ("flush", 999.0, 20), ("split", 100.0, 20)], 20,
                      skip={"flush"})
    assert got == [{"kernel": "split", "us": 20.0, "launches": 2.0}, {"kernel": "merge", "us": 3.0, "launches": 1.0}]
    row = {"d": 128, "batch": 1, "context": 32768, "int2_ms": 0.05, "sdpa_ms": None,
           "launches": {"int2": {"kernels": got, "sum_us": 23.0}, "sdpa": out["sdpa"]}}
    lines = bl.launch_lines([row, {"d": 64, "batch": 8}])
    assert "## Where a decode's time goes (torch profiler, eager)" in lines
    assert lines[-2:] == ["| 128 | 1 | 32768 | int2 | 0.0500 | 23.0 | split 20.0 (2); merge 3.0 (1) |",
                          "| 128 | 1 | 32768 | sdpa | n/a | n/a | RuntimeError: no kernel |"]
    assert bl.launch_lines([{"d": 64, "batch": 8}]) == []
    # no profiler: every decode says why
    def no_profiler(*args):
        raise ImportError("CUPTI")
    assert bl.launch_times({"int2": two_ops}, device="cpu", profiled=no_profiler) == \
        {"int2": {"note": "profiler: ImportError: CUPTI"}}

"""The ``oscar_int2`` attention backend, driven as SGLang drives it, through both kernel paths.

Two pools with the same random rotations serve the same passes (a prefill,
a second request extending the first one's cached prefix while the first
decodes, then decode steps): one through the plain-torch reference, one
through the Triton kernels (compiled on CUDA, Triton's interpreter on CPU).
Both must agree with each other and with an independent dense computation:
softmax attention of the *unrotated* query over the stored rows mapped back
to the model's space (``x' R^T + mu``), BF16 where hot and INT2 elsewhere,
for decode and for extend (where the new tokens attend causally over their
own exact K/V); and after every pass every position in a live request's
window (``oscar_sglang.windows``) must have its BF16 copy, so a window
shifted by one fails.
This is what proves the backend hands the kernels device tensors, lengths and
tuning arguments they accept, on the path the server takes on a GPU.  It runs
twice: every layer INT2, and a precision policy's mix (keys and values of
each layer in different formats: INT4, INT8, INT2 with small groups).
"""

import os
import re
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():                 # SGLang's CPU platform; on a GPU its CUDA one
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
pytest.importorskip("sglang")

from kernel_device import DEVICE  # noqa: E402  (enables the interpreter on CPU)

from oscar_sglang import artifacts as art  # noqa: E402
from oscar_sglang.format import RowFormat  # noqa: E402
from oscar_sglang.kernels.common.reference import read_rotated  # noqa: E402
from oscar_sglang.rotation import unrotate_kv  # noqa: E402

QH, KVH, D, G, LAYERS = 4, 2, 64, 32, 2
SINK, RECENT = 2, 5
FP = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=LAYERS, hidden_size=QH * D,
                          num_attention_heads=QH, num_kv_heads=KVH, head_dim=D, vocab_size=100,
                          rope_type="default", rope_theta=1e4)


MIXED = [art.LayerFormat(RowFormat(4), RowFormat(2, 16)), art.LayerFormat(RowFormat(2, 32), RowFormat(8))]
SYMMETRIC = [art.LayerFormat(RowFormat(2, symmetric=True), RowFormat(4, 32, True)),
             art.LayerFormat(RowFormat(4, symmetric=True), RowFormat(2))]


def _artifacts(seed: int = 1, formats=None):
    g = torch.Generator().manual_seed(seed)

    def orth():
        return torch.stack([torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
                            for _ in range(KVH)]).float()

    # per-channel key scales on the second layer: the pool folds them into the key write and the query read
    layers = [art.LayerRotation(orth(), orth(), 0.3 * torch.randn(KVH, D, generator=g), torch.tensor([0.9, 1.0]),
                                torch.tensor([1.0, 0.85]), torch.exp(0.5 * torch.randn(KVH, D, generator=g)) if i else None)
              for i in range(LAYERS)]
    return art.RotationArtifacts(FP, "unit", layers, sink=SINK, recent=RECENT, group_size=G, formats=formats)


def _backend(kernel_backend, slots: int = 128, rows: int = 4, context: int = 64, seed: int = 1, formats=None,
             runner_device=None):
    """The backend over a real INT2 pool (hot side pool for 2 requests) and a ``rows x context`` req_to_token;
    ``runner_device``: the device the model runner names (default: the pool's)."""
    from oscar_sglang.sglang.backend import OscarInt2AttnBackend
    from oscar_sglang.sglang.pool import OscarInt2Pool
    from oscar_sglang.sglang.settings import ServingConfig

    cfg = ServingConfig(_artifacts(seed, formats), SINK, RECENT, hot_requests=2)
    pool = OscarInt2Pool(slots, 1, torch.bfloat16, head_num=KVH, head_dim=D, layer_num=LAYERS, device=DEVICE,
                         config=cfg, start_layer=0, end_layer=LAYERS)
    pool.kernel_backend = kernel_backend
    req_to_token = torch.zeros(rows, context, dtype=torch.int32, device=DEVICE)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             device=runner_device or DEVICE)
    return OscarInt2AttnBackend(runner)


def _layer(i):
    from sglang.srt.layers.radix_attention import AttentionType

    return SimpleNamespace(layer_id=i, qk_head_dim=D, v_head_dim=D, tp_q_head_num=QH, tp_k_head_num=KVH,
                           tp_v_head_num=KVH, scaling=D ** -0.5, is_cross_attention=False,
                           attn_type=AttentionType.DECODER, sliding_window_size=None, logit_cap=0.0)


def _passes():
    """(mode, [(request row, prefix len, new slots)]) in the order SGLang would run them."""
    a = list(range(1, 40))
    b = list(range(60, 80))
    return [
        ("extend", [(0, 0, a[:23])]),                                  # A: prefill 23 tokens
        ("decode", [(0, 23, [a[23]])]),                                # A decodes
        ("extend", [(1, 12, b[:9]), (0, 24, [a[24]])]),               # B extends A's first 12 tokens; A decodes
        ("decode", [(0, 25, [a[25]]), (1, 21, [b[9]])]),              # both decode
        ("decode", [(0, 26, [a[26]]), (1, 22, [b[10]])]),
    ]


def _dense(backend, layer_id, q, rows, lens):
    """Independent reference: unrotated attention over the stored rows of each request (last token's query)."""
    store, rot = backend.pool.layer(layer_id)
    out = []
    for b, (row, n) in enumerate(zip(rows, lens)):
        slots = backend.req_to_token[row, :n]
        k, v = read_rotated(store, slots)
        # stored keys are (k - mean) R diag(s); the inverse of R diag(s) is (R diag(1/s))^T = q_rot^T
        k = unrotate_kv(k, rot.q_rot, rot.k_mean).float().repeat_interleave(QH // KVH, dim=1)
        v = unrotate_kv(v, rot.v_rot).float().repeat_interleave(QH // KVH, dim=1)
        logits = torch.einsum("hd,thd->ht", q[b].float(), k) * D ** -0.5
        out.append(torch.einsum("ht,thd->hd", logits.softmax(-1), v))
    return torch.stack(out)


def _dense_extend(backend, layer_id, q, k, v, reqs):
    """Independent reference for an extend pass: each new token attends over its request's cached prefix (stored
    rows, unrotated) and, causally, over the new tokens' own K/V (exact, as the backend must use them)."""
    store, rot = backend.pool.layer(layer_id)
    out, start = [], 0
    for row, n0, slots in reqs:
        m = len(slots)
        pk, pv = read_rotated(store, backend.req_to_token[row, :n0])
        pk = unrotate_kv(pk, rot.q_rot, rot.k_mean).float()
        pv = unrotate_kv(pv, rot.v_rot).float()
        keys = torch.cat([pk, k[start:start + m].float()]).repeat_interleave(QH // KVH, dim=1)
        vals = torch.cat([pv, v[start:start + m].float()]).repeat_interleave(QH // KVH, dim=1)
        for j in range(m):
            logits = torch.einsum("hd,thd->ht", q[start + j].float(), keys[:n0 + j + 1]) * D ** -0.5
            out.append(torch.einsum("ht,thd->hd", logits.softmax(-1), vals[:n0 + j + 1]))
        start += m
    return torch.stack(out)


def _windows_hot(backend, reqs):
    """Every position in a live request's window (the one rule, oscar_sglang.windows) has a BF16 copy."""
    from oscar_sglang import windows

    for row, n0, slots in reqs:
        n = n0 + len(slots)
        hot = (backend.pool.hot_index[backend.req_to_token[row, :n].long()] >= 0).cpu()
        want = windows.in_window(torch.arange(n), n, SINK, RECENT)
        assert hot[want].all(), (row, n, hot.int().tolist())


def _run(kernel_backend, seed=0, formats=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    backend = _backend(kernel_backend, formats=formats)
    g = torch.Generator().manual_seed(seed)
    outputs, dense = [], []
    for mode, reqs in _passes():
        rows = [r for r, _, _ in reqs]
        for r, n0, slots in reqs:
            backend.req_to_token[r, n0:n0 + len(slots)] = torch.tensor(slots, dtype=torch.int32)
        if reqs and mode == "extend" and reqs[0][0] == 1:            # B's cached prefix is A's first 12 slots
            backend.req_to_token[1, :12] = backend.req_to_token[0, :12]
        seq = [n0 + len(s) for _, n0, s in reqs]
        loc = torch.tensor([x for _, _, s in reqs for x in s], dtype=torch.int64, device=DEVICE)
        fb = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE,
            out_cache_loc=loc, req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=DEVICE), seq_lens_cpu=torch.tensor(seq),
            extend_prefix_lens_cpu=[n0 for _, n0, _ in reqs], extend_seq_lens_cpu=[len(s) for _, _, s in reqs])
        # device copies, int32 as SGLang makes them for extend batches
        fb.extend_prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int32, device=DEVICE)
        fb.extend_seq_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32, device=DEVICE)
        backend.init_forward_metadata(fb)
        _windows_hot(backend, reqs)
        n = loc.numel()
        for layer_id in range(LAYERS):
            q = torch.randn(n, QH * D, generator=g).to(torch.bfloat16).to(DEVICE)
            k = torch.randn(n, KVH * D, generator=g).to(torch.bfloat16).to(DEVICE)
            v = torch.randn(n, KVH * D, generator=g).to(torch.bfloat16).to(DEVICE)
            fwd = backend.forward_extend if mode == "extend" else backend.forward_decode
            o = fwd(q, k, v, _layer(layer_id), fb).float().reshape(n, QH, D)
            outputs.append(o.cpu())
            if mode == "decode":
                dense.append((o.cpu(), _dense(backend, layer_id, q.reshape(n, QH, D), rows, seq).cpu()))
            else:
                ref = _dense_extend(backend, layer_id, q.reshape(n, QH, D), k.reshape(n, KVH, D),
                                    v.reshape(n, KVH, D), reqs)
                dense.append((o.cpu(), ref.cpu()))
    return outputs, dense, backend


@pytest.mark.parametrize("formats", [None, MIXED, SYMMETRIC], ids=["int2", "mixed-formats", "symmetric-rows"])
def test_backend_triton_and_torch_paths_agree_with_dense_attention(formats):
    torch_out, torch_dense, tb = _run("torch", formats=formats)
    triton_out, triton_dense, rb = _run("triton", formats=formats)
    assert len(torch_out) == len(triton_out) == 2 * len(_passes())
    for a, b in zip(torch_out, triton_out):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)   # both cast the output to bf16
    for o, ref in torch_dense + triton_dense:
        torch.testing.assert_close(o, ref, atol=2e-2, rtol=2e-2)
    # the stores hold the same codes; hot copies exactly at sink and recent positions of live requests
    for layer_id in range(LAYERS):
        s1, _ = tb.pool.layer(layer_id)
        s2, _ = rb.pool.layer(layer_id)
        if formats:
            assert (s1.k_format, s1.v_format) == (formats[layer_id].k.resolved(D), formats[layer_id].v.resolved(D))
        for name in ("k_codes", "v_codes"):
            mismatched = (getattr(s1, name) != getattr(s2, name)).float().mean().item()
            assert mismatched <= 1e-3, name
    for row, n in ((0, 27), (1, 23)):
        slots = rb.req_to_token[row, :n].long()
        hot = (rb.pool.hot_index[slots] >= 0).cpu()
        want = (torch.arange(n) < SINK) | (torch.arange(n) >= n - RECENT)
        assert hot[want].all(), row


@pytest.mark.parametrize("kernel, env, knob, want, bad, refusal", [
    ("extend_attention", "OSCAR_SGLANG_EXTEND_KERNEL", "dots=tf32, block_rows=32,block_n=16",
     {"dots": "tf32", "block_rows": 32, "block_n": 16}, "dots=fp8", "dots='fp8', expected one of bf16, tf32"),
    ("decode_attention", "OSCAR_SGLANG_DECODE_KERNEL", "block_n=16,num_warps=2, num_stages=1",
     {"block_n": 16, "num_warps": 2, "num_stages": 1}, "block_n=8", "block_n='8', expected a power of two >= 16"),
])
def test_kernel_tile_knobs_reach_the_kernels(monkeypatch, kernel, env, knob, want, bad, refusal):
    # OSCAR_SGLANG_EXTEND_KERNEL / _DECODE_KERNEL (a tile, and the dots, a GPU benchmark found faster) reach
    # every call of that kernel on the Triton path, beside the backend's own arguments, and its outputs still
    # agree with dense attention; a bad value stops the backend at its start; the torch path takes no tuning.
    from oscar_sglang.kernels import api

    seen = []
    real = getattr(api, kernel)

    def spy(*args, **kwargs):
        seen.append(({k: kwargs.get(k) for k in want}, "max_seq_len" in kwargs or "num_splits" in kwargs))
        windows.append(kwargs.get("hot_windows"))
        return real(*args, **kwargs)

    windows = []
    monkeypatch.setattr(api, kernel, spy)
    monkeypatch.setenv(env, knob)
    _, dense, _ = _run("triton")
    assert seen and all(s == (want, kernel == "decode_attention") for s in seen)
    # every decode is given the served windows, where its splits are cut by work (kernels/decode/split_cut.py)
    assert set(windows) == ({(SINK, RECENT)} if kernel == "decode_attention" else {None})
    for o, ref in dense:
        torch.testing.assert_close(o, ref, atol=2e-2, rtol=2e-2)
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        _backend("triton")


def test_decode_graphs_split_count_follows_the_knob_residency(monkeypatch):
    # OSCAR_SGLANG_DECODE_KERNEL=resident=N: a captured batch size's split count (fixed before its capture) is
    # choose_splits' whole wave of N programs per multiprocessor, as the eager decode's; unset, the fixed rule
    from oscar_sglang.kernels.decode.triton_kernel import choose_splits

    cpu = torch.device(DEVICE)
    monkeypatch.setenv("OSCAR_SGLANG_DECODE_KERNEL", "resident=3,num_warps=2,block_n=16")
    b = _backend("triton", context=1024)
    assert [b._splits_for_graph(bs) for bs in (1, 2, 5)] == \
        [choose_splits(bs, KVH, cpu, 1024, 16, 2, resident=3) for bs in (1, 2, 5)]
    monkeypatch.delenv("OSCAR_SGLANG_DECODE_KERNEL")
    fixed = _backend("triton", context=1024)
    assert [fixed._splits_for_graph(bs) for bs in (1, 2, 5)] == \
        [choose_splits(bs, KVH, cpu, 1024) for bs in (1, 2, 5)] != [b._splits_for_graph(bs) for bs in (1, 2, 5)]
    assert _backend("torch")._splits_for_graph(1) is None  # the torch path splits nothing


def test_decode_loop_timed_at_startup_on_cuda_unless_the_knob_fixes_it(monkeypatch, caplog):
    # On CUDA with OSCAR_SGLANG_DECODE_KERNEL unset (or "auto") the backend times the decode loop's candidates
    # on the pool's most common layer formats (kernels/decode/autotune.py, here the real timing of two
    # candidates under the interpreter, the runner naming "cuda" over a pool on this machine's device), serves
    # the choice, logs it in one line, and does it once per process and shape; "default" or fixed options, a
    # CPU server or a failing timing: nothing timed, the defaults or the knob's options.
    from oscar_sglang.kernels.decode import autotune
    from oscar_sglang.sglang import backend as be

    one_group = [art.LayerFormat(RowFormat(2), RowFormat(2)),           # each once: the first layer's formats
                 art.LayerFormat(RowFormat(4), RowFormat(2, 16))]       # are timed (one group per row: folded)
    monkeypatch.setattr(autotune, "CASES", ((1, 40),))
    monkeypatch.setattr(autotune, "CANDIDATES", (("default", {"block_n": 16}),
                                                 ("fold, 2 warps", {"block_n": 16, "fold": True, "num_warps": 2})))
    monkeypatch.setattr(be, "_query_heads", lambda runner: QH)
    monkeypatch.setattr(be, "_TUNED", {})
    timed = []
    real_choose = autotune.choose

    def choose(store, rot, q_heads, **kw):
        timed.append((store.k_format.group_for(D), q_heads))
        return real_choose(store, rot, q_heads, **kw)

    monkeypatch.setattr(autotune, "choose", choose)
    monkeypatch.delenv("OSCAR_SGLANG_DECODE_KERNEL", raising=False)
    with caplog.at_level("INFO", logger="oscar_sglang.sglang.backend"):
        b = _backend("triton", formats=one_group, runner_device="cuda")
    assert timed == [(D, QH)]
    assert set(b.decode_choice.ms) == {"default", "fold, 2 warps"}
    assert b.decode_choice.picks[0][0] in b.decode_choice.ms
    assert b._decode_options_for(1) == b.decode_choice.options_for(1) == b.decode_choice.picks[0][1]
    assert any("oscar_int2 decode loop: " in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("OSCAR_SGLANG_DECODE_KERNEL", "auto")
    again = _backend("triton", formats=one_group, runner_device="cuda")           # the same shape: no new timing
    assert timed == [(D, QH)] and again.decode_choice is b.decode_choice
    for knob, want in (("default", {}), ("fold=1,num_warps=2", {"fold": True, "num_warps": 2})):
        monkeypatch.setenv("OSCAR_SGLANG_DECODE_KERNEL", knob)
        fixed = _backend("triton", formats=one_group, runner_device="cuda")
        assert (fixed.decode_choice, fixed._decode_options_for(1), fixed._decode_options_for(64)) == (None, want, want)
    monkeypatch.delenv("OSCAR_SGLANG_DECODE_KERNEL")
    assert _backend("triton", formats=one_group).decode_choice is None                  # a CPU server
    assert _backend("torch", formats=one_group, runner_device="cuda").decode_choice is None  # the torch path
    assert len(timed) == 1

    def fails(*_, **__):
        raise RuntimeError("no GPU today")

    monkeypatch.setattr(autotune, "choose", fails)
    monkeypatch.setattr(be, "_TUNED", {})
    with caplog.at_level("WARNING", logger="oscar_sglang.sglang.backend"):
        failed = _backend("triton", formats=one_group, runner_device="cuda")
    assert (failed.decode_choice, failed._decode_options_for(1)) == (None, {})
    assert any("RuntimeError: no GPU today" in r.getMessage() for r in caplog.records)


def test_the_timed_choice_is_served_per_batch_size(monkeypatch):
    # The startup timing keeps a loop per case (batch 1, batch 32): a batch gets the pick of the case nearest
    # its size, in the eager decode's kernel calls and in a CUDA graph's split count (fixed before capture);
    # the decodes still agree with dense attention.
    import sys

    from oscar_sglang.kernels import api
    from oscar_sglang.kernels.decode import autotune
    from oscar_sglang.kernels.decode.triton_kernel import choose_splits
    from oscar_sglang.sglang import backend as be

    small = {"fold": True, "num_warps": 2, "block_n": 16, "resident": 3}
    choice = autotune.Choice("a GPU", ((1, 16384), (32, 4096)), "default",
                             picks=[("fold, 2 warps, whole waves", small), ("default", {})])
    monkeypatch.setattr(be, "tuned_decode_choice", lambda pool, query_heads: choice)
    monkeypatch.delenv("OSCAR_SGLANG_DECODE_KERNEL", raising=False)
    plain = _backend

    def on_cuda_at_startup(kernel_backend, **kw):  # then the pool's device (this machine's) for the passes
        b = plain(kernel_backend, runner_device="cuda", **kw)
        b.device = DEVICE
        return b

    monkeypatch.setattr(sys.modules[__name__], "_backend", on_cuda_at_startup)
    b = _backend("triton", context=1024)
    assert b.decode_choice is choice
    assert [b._decode_options_for(bs) for bs in (1, 2, 5, 6, 32, 200)] == [small] * 3 + [{}] * 3
    cpu = torch.device(DEVICE)
    assert b._splits_for_graph(2) == choose_splits(2, KVH, cpu, 1024, 16, 2, resident=3)
    assert b._splits_for_graph(8) == choose_splits(8, KVH, cpu, 1024)
    seen = []
    real = api.decode_attention

    def spy(q, *args, **kwargs):
        seen.append((q.shape[0], {k: kwargs[k] for k in small if k in kwargs}))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(api, "decode_attention", spy)
    _, dense, _ = _run("triton")
    assert any(opts == small for _, opts in seen) and all(opts == (small if bs <= 5 else {}) for bs, opts in seen)
    for o, ref in dense:
        torch.testing.assert_close(o, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_extend_knob_sdpa_runs_every_prefill_through_the_sdpa_path(monkeypatch, kernel_backend):
    # OSCAR_SGLANG_EXTEND_KERNEL=sdpa: every extend pass of the backend goes to kernels/extend/sdpa.py (the prefix
    # dequantized, then torch SDPA), whatever the pool's kernels; decode keeps them; outputs agree with dense
    # attention and with the default path's.
    from oscar_sglang.kernels import api
    from oscar_sglang.kernels.extend import sdpa

    calls = {"sdpa": 0, "decode": 0}
    real_sdpa, real_decode = sdpa.extend_attention, api.decode_attention

    def spy_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def spy_decode(*args, **kwargs):
        assert kwargs["backend"] == kernel_backend
        calls["decode"] += 1
        return real_decode(*args, **kwargs)

    default_out, _, _ = _run(kernel_backend)
    monkeypatch.setattr(sdpa, "extend_attention", spy_sdpa)
    monkeypatch.setattr(api, "decode_attention", spy_decode)
    monkeypatch.setenv("OSCAR_SGLANG_EXTEND_KERNEL", " sdpa ")
    out, dense, _ = _run(kernel_backend)
    extends = sum(mode == "extend" and bool(reqs) for mode, reqs in _passes())
    assert calls == {"sdpa": extends * LAYERS, "decode": (len(_passes()) - extends) * LAYERS}, calls
    for o, ref in dense:
        torch.testing.assert_close(o, ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(default_out, out):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    monkeypatch.setenv("OSCAR_SGLANG_EXTEND_KERNEL", "sdpa,block_n=32")
    with pytest.raises(ValueError, match="or sdpa, or kernel"):
        _backend(kernel_backend)


def test_backend_refuses_a_foreign_pool():
    from oscar_sglang.sglang.backend import OscarInt2AttnBackend

    runner = SimpleNamespace(token_to_kv_pool=object(), req_to_token_pool=None, device="cpu")
    with pytest.raises(RuntimeError, match="needs --kv-cache-dtype oscar-int2"):
        OscarInt2AttnBackend(runner)


def test_shapes_the_triton_kernels_refuse_fall_back_by_rule():
    from oscar_sglang.kernels import api

    assert api.triton_unsupported(64, 64) is None and api.triton_unsupported(128, 32) is None
    assert "head_dim >= 64" in api.triton_unsupported(32, 32)
    assert "power-of-two head_dim" in api.triton_unsupported(96, 32)
    assert "group size" in api.triton_unsupported(64, 2)

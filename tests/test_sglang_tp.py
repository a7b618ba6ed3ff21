"""Tensor parallelism: each rank serves the rotations of the KV heads it holds (per-KV-head rotations slice exactly).

Here at the pool and kernel level: every rank's pool, fed its heads of the same
tokens, must give exactly the full pool's output for its query heads, for tp
up to 8 (more ranks than two CPU cores run as servers).  The real ``--tp-size 2``
servers of a trained model: ``tests/test_sglang_tp_server.py``.
"""

import os
from dataclasses import replace

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang.kernels import api as kernels
from oscar_sglang.sglang.settings import OscarConfigError, ServingConfig, kv_heads_of_rank, served_fingerprint

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

KV, QH, D = 4, 8, 32
FP = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=QH * D, num_attention_heads=QH,
                          num_kv_heads=KV, head_dim=D, vocab_size=100, rope_type="default", rope_theta=1e4)


def _artifacts(kv: int = KV):
    g = torch.Generator().manual_seed(0)

    def orth():
        return torch.stack([torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
                            for _ in range(kv)]).float()

    fp = replace(FP, num_kv_heads=kv, num_attention_heads=2 * kv, hidden_size=2 * kv * D)

    def clip():
        return torch.rand(kv, generator=g) * 0.2 + 0.8

    layers = [art.LayerRotation(orth(), orth(), torch.randn(kv, D, generator=g), clip(), clip(),
                                torch.rand(kv, D, generator=g) + 0.5) for _ in range(fp.num_layers)]
    return art.RotationArtifacts(fp, "unit", layers, sink=2, recent=4, group_size=16)


@pytest.mark.parametrize("total", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_rank_heads_follow_sglangs_qkv_sharding(total, tp):
    from sglang.srt.configs.model_config import ModelConfig

    if (tp < total and total % tp) or (tp >= total and tp % total):
        with pytest.raises(OscarConfigError, match="cannot"):
            kv_heads_of_rank(total, tp, 0)
        return
    ranks = [kv_heads_of_rank(total, tp, r) for r in range(tp)]
    # SGLang's own count per rank (ModelConfig.get_num_kv_heads: max(1, total // tp))
    count = ModelConfig.get_num_kv_heads(type("C", (), {"is_draft_model": False,
                                                         "get_total_num_kv_heads": lambda self: total})(), tp)
    assert all(len(h) == count for h in ranks)
    # every head is served, each by tp/total consecutive ranks when replicated, by exactly one rank otherwise
    held = [h for r in ranks for h in r]
    assert sorted(set(held)) == list(range(total))
    assert all(held.count(h) == max(1, tp // total) for h in range(total))
    assert held == sorted(held)  # rank order follows head order, as the QKV weight shards do


def test_rank_slice_of_the_artifacts_is_exact():
    a = _artifacts()
    cfg = ServingConfig(a, 2, 4)
    assert cfg.for_rank(1, 0) is cfg
    part = cfg.for_rank(2, 1).artifacts
    for full, mine in zip(a.layers, part.layers):
        for name in art.LayerRotation.TENSOR_NAMES:
            assert torch.equal(getattr(mine, name), getattr(full, name)[2:4])
    assert part.model == a.model  # still the whole model's fingerprint
    # the startup line says which heads a rank serves (the real servers' lines: tests/test_sglang_tp_server.py)
    assert (cfg.heads_note(), cfg.for_rank(2, 1).kv_heads) == ("", (2, 3))
    assert cfg.for_rank(2, 1).heads_note() == ", KV heads 2-3 of 4 (this tensor-parallel rank's share)"
    assert cfg.for_rank(8, 5).heads_note() == ", KV head 2 of 4 (this tensor-parallel rank's share)"
    with pytest.raises(OscarConfigError, match="outside a group of 2"):
        cfg.for_rank(2, 2)


def _padded_config(total_q: int, total_kv: int, tp: int, head_dim: bool = True):
    """A config as SGLang's CPU engine leaves it for ``--tp-size tp`` (``adjust_config_with_unaligned_cpu_tp``)."""
    pad = -(-total_kv // tp) * tp if total_q % tp or total_kv % tp else total_kv
    cfg = type("Config", (), dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=total_q * D,
                                  num_attention_heads=pad * (total_q // total_kv), num_key_value_heads=pad,
                                  original_num_attention_heads=total_q, original_total_num_kv_heads=total_kv,
                                  vocab_size=100, rope_theta=1e4))()
    if head_dim:
        cfg.head_dim = D
    return cfg


@pytest.mark.parametrize("head_dim", [True, False])
def test_fingerprint_of_a_model_sglangs_cpu_engine_padded(head_dim):
    fp, padded = served_fingerprint(_padded_config(6, 3, 2, head_dim))
    assert (fp.num_attention_heads, fp.num_kv_heads, fp.head_dim, fp.hidden_size, padded) == (6, 3, D, 6 * D, 4)
    assert served_fingerprint(_padded_config(8, 4, 2)) == (_artifacts(4).model, None)   # 2 ranks divide 4 heads
    assert not _artifacts(3).model.mismatches(fp)


def test_padded_rank_shares_hold_the_model_heads_then_neutral_ones():
    a = _artifacts(3)
    cfg = ServingConfig(a, 2, 4, padded_kv_heads=4)
    first, second = cfg.for_rank(2, 0), cfg.for_rank(2, 1)
    assert (first.kv_heads, first.padding_heads, second.kv_heads, second.padding_heads) == ((0, 1), 0, (2,), 1)
    for full, mine in zip(a.layers, second.artifacts.layers):
        assert torch.equal(mine.k_rotation[0], full.k_rotation[2]) and torch.equal(mine.k_scale[0], full.k_scale[2])
        assert torch.equal(mine.k_rotation[1], torch.eye(D)) and torch.equal(mine.v_rotation[1], torch.eye(D))
        assert not mine.k_mean[1].any() and (mine.k_scale[1] == 1).all() and (mine.k_clip[1] == 1).all()
    assert second.heads_note() == (", KV head 2 of 3 and 1 padding head (this tensor-parallel rank's share; "
                                   "SGLang's CPU engine pads the 3 KV heads to 4)")
    only = ServingConfig(a, 2, 4, padded_kv_heads=4).for_rank(4, 3)
    assert (only.kv_heads, only.padding_heads, only.artifacts.layers[0].k_rotation.shape) == ((), 1, (1, D, D))
    assert only.heads_note().startswith(", 1 padding head only (this tensor-parallel rank's share; ")


def _pool(cfg, heads):
    from oscar_sglang.sglang.pool import OscarInt2Pool

    return OscarInt2Pool(64, 1, torch.bfloat16, head_num=heads, head_dim=D, layer_num=2, device="cpu", config=cfg,
                         start_layer=0, end_layer=2)


@pytest.mark.parametrize("kv,tp,pad", [(4, 2, False), (4, 4, False), (4, 8, False), (3, 2, True), (3, 4, True),
                                       (3, 8, True), (4, 8, True)])
def test_each_rank_decodes_exactly_its_query_heads_of_the_full_pool(kv, tp, pad):
    """Ranks of the same tokens' heads against the full pool: split (4 heads), replicated as on a GPU (4 heads, 8
    ranks) and, with ``pad``, padded as SGLang's CPU engine pads heads that the ranks do not divide: zero weights,
    so the padding heads' keys, values and queries are zero and their output must be zero too."""
    pytest.importorskip("sglang")
    group = 2   # query heads per KV head
    slots = -(-kv // tp) * tp if pad else kv   # the KV heads SGLang serves: padded up to a multiple of tp
    full_cfg = ServingConfig(_artifacts(kv), 2, 4, hot_requests=2, padded_kv_heads=slots if slots != kv else None)
    g = torch.Generator().manual_seed(tp)
    lens = [13, 7]
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :13] = torch.arange(1, 14)
    req_to_token[1, :7] = torch.arange(20, 27)
    loc = torch.cat([req_to_token[0, :13], req_to_token[1, :7]]).long()

    def padded(x):
        return torch.cat([x, torch.zeros(x.shape[0], slots * x.shape[1] // kv - x.shape[1], D, dtype=x.dtype)], 1)

    k = padded((torch.randn(len(loc), kv, D, generator=g) * 3).to(torch.bfloat16))
    v = padded(torch.randn(len(loc), kv, D, generator=g).to(torch.bfloat16))
    q = padded(torch.randn(2, group * kv, D, generator=g).to(torch.bfloat16))
    args = (torch.tensor([0, 1]), torch.tensor([0, 0], dtype=torch.int32), torch.tensor(lens), req_to_token)

    def serve(pool, heads, q_heads):
        hot_loc = pool.begin_pass(loc, *args)
        outs = []
        for layer in range(2):
            pool.write(layer, loc, k[:, heads], v[:, heads], hot_loc)
            store, rot = pool.layer(layer)
            outs.append(kernels.decode_attention(q[:, q_heads], store, rot, req_to_token, args[0],
                                                 torch.tensor(lens), D**-0.5, backend="torch"))
        return outs

    full = [padded(out) for out in serve(_pool(full_cfg, kv), list(range(kv)), list(range(group * kv)))]
    q_per_rank = group * slots // tp
    for rank in range(tp):
        heads = kv_heads_of_rank(slots, tp, rank)
        q_heads = list(range(rank * q_per_rank, (rank + 1) * q_per_rank))
        mine_cfg = full_cfg.for_rank(tp, rank)
        assert list(range(kv) if mine_cfg.kv_heads is None else mine_cfg.kv_heads) == [h for h in heads if h < kv]
        mine = serve(_pool(mine_cfg, len(heads)), heads, q_heads)
        for layer in range(2):  # the same up to bf16 rounding: the rank's query rotation is a matmul of
            # another shape (its KV heads, not all of them), whose sums may round differently (a wrong head: O(1))
            torch.testing.assert_close(mine[layer], full[layer][:, q_heads], rtol=2**-7, atol=2**-10,
                                       msg=lambda m: f"kv {kv} tp {tp} rank {rank} layer {layer}: {m}")

"""Tensor parallelism: each rank serves the rotations of the KV heads it holds (per-KV-head rotations slice exactly).

Here at the pool and kernel level: every rank's pool, fed its heads of the same
tokens, must give exactly the full pool's output for its query heads, for tp
up to 8 (more ranks than two CPU cores run as servers).  The real ``--tp-size 2``
servers of a trained model: ``tests/test_sglang_tp_server.py``.
"""

import os

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang.kernels import api as kernels
from oscar_sglang.sglang.settings import OscarConfigError, ServingConfig, kv_heads_of_rank

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

KV, QH, D = 4, 8, 32
FP = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=QH * D, num_attention_heads=QH,
                          num_kv_heads=KV, head_dim=D, vocab_size=100, rope_type="default", rope_theta=1e4)


def _artifacts():
    g = torch.Generator().manual_seed(0)

    def orth():
        return torch.stack([torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
                            for _ in range(KV)]).float()

    layers = [art.LayerRotation(orth(), orth(), torch.randn(KV, D, generator=g), torch.rand(KV, generator=g) * 0.2 + 0.8,
                                torch.rand(KV, generator=g) * 0.2 + 0.8) for _ in range(FP.num_layers)]
    return art.RotationArtifacts(FP, "unit", layers, sink=2, recent=4, group_size=16)


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


def _pool(cfg, heads):
    from oscar_sglang.sglang.pool import OscarInt2Pool

    return OscarInt2Pool(64, 1, torch.bfloat16, head_num=heads, head_dim=D, layer_num=2, device="cpu", config=cfg,
                         start_layer=0, end_layer=2)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_rank_decodes_exactly_its_query_heads_of_the_full_pool(tp):
    pytest.importorskip("sglang")
    full_cfg = ServingConfig(_artifacts(), 2, 4, hot_requests=2)
    g = torch.Generator().manual_seed(tp)
    lens = [13, 7]
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :13] = torch.arange(1, 14)
    req_to_token[1, :7] = torch.arange(20, 27)
    loc = torch.cat([req_to_token[0, :13], req_to_token[1, :7]]).long()
    k = (torch.randn(len(loc), KV, D, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(len(loc), KV, D, generator=g).to(torch.bfloat16)
    q = torch.randn(2, QH, D, generator=g).to(torch.bfloat16)
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

    full = serve(_pool(full_cfg, KV), list(range(KV)), list(range(QH)))
    q_per_rank = QH // tp
    for rank in range(tp):
        heads = kv_heads_of_rank(KV, tp, rank)
        q_heads = list(range(rank * q_per_rank, (rank + 1) * q_per_rank))
        mine = serve(_pool(full_cfg.for_rank(tp, rank), len(heads)), heads, q_heads)
        for layer in range(2):  # the same up to bf16 rounding: the rank's query rotation is a matmul of
            # another shape (its KV heads, not all of them), whose sums may round differently (a wrong head: O(1))
            torch.testing.assert_close(mine[layer], full[layer][:, q_heads], rtol=2**-7, atol=2**-10,
                                       msg=lambda m: f"tp {tp} rank {rank} layer {layer}: {m}")

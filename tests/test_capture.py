"""The capturing attention function against a direct computation on a tiny model."""

import pytest
import torch

from oscar_sglang.calibration import capture, data


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=101, max_position_embeddings=128, rope_theta=1000.0,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float().eval()


def _direct_qkv(model, ids, layer):
    """Post-RoPE q, k and v of ``layer`` computed by hand from the layer's input hidden state."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states[layer]
        block = model.model.layers[layer]
        attn = block.self_attn
        h = block.input_layernorm(hidden)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        cos, sin = model.model.rotary_emb(hidden, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def test_captured_keys_values_match_direct_computation(tiny):
    torch.manual_seed(1)
    seqs = [torch.randint(0, 101, (12,)), torch.randint(0, 101, (7,))]
    kv = capture.capture_kv(tiny, seqs)
    assert sorted(kv) == [0, 1]
    for layer in (0, 1):
        k, v = kv[layer]
        assert k.shape == (19, 2, 16) and v.shape == (19, 2, 16)
        parts_k, parts_v = [], []
        for s in seqs:
            _, dk, dv = _direct_qkv(tiny, s.reshape(1, -1), layer)
            parts_k.append(dk[0].transpose(0, 1))
            parts_v.append(dv[0].transpose(0, 1))
        assert torch.allclose(k, torch.cat(parts_k), atol=1e-5)
        assert torch.allclose(v, torch.cat(parts_v), atol=1e-5)


def test_capture_runs_the_layers_without_the_lm_head(tiny):
    """The taps need the decoder layers only: the LM head (on SmolLM2 15% of a forward pass) is never run, and
    the keys are those of the full model's forward."""
    calls = []
    hook = tiny.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        seqs = [torch.randint(0, 101, (9,))]
        kv = capture.capture_kv(tiny, seqs)
        assert calls == []
        _, k, _ = _direct_qkv(tiny, seqs[0].reshape(1, -1), 1)   # through the whole model, head included
        assert calls == [1] and torch.allclose(kv[1][0], k[0].transpose(0, 1), atol=1e-5)
    finally:
        hook.remove()


def test_tap_sees_queries_and_leaves_the_model_unchanged(tiny):
    ids = torch.randint(0, 101, (1, 10))
    with torch.no_grad():
        ref = tiny(ids, use_cache=False).logits
    seen = {}
    with capture.tapped(tiny, lambda layer, q, k, v, out: seen.setdefault(layer, q.clone())):
        assert tiny.config._attn_implementation == capture.ATTN_NAME
        with torch.no_grad():
            out = tiny(ids, use_cache=False).logits
    assert tiny.config._attn_implementation == "sdpa"
    assert torch.allclose(out, ref, atol=1e-6)
    q, _, _ = _direct_qkv(tiny, ids, 1)
    assert torch.allclose(seen[1], q, atol=1e-5)


def test_token_sequences():
    class Tok:
        def __call__(self, text, add_special_tokens, return_tensors):
            return type("E", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})

    seqs = data.token_sequences(Tok(), "abcdefghij" * 3, seq_len=4, max_tokens=20, skip_tokens=2)
    assert len(seqs) == 5 and "".join(chr(i) for i in torch.cat(seqs).tolist()) == ("abcdefghij" * 3)[2:22]
    with pytest.raises(ValueError, match="too short"):
        data.token_sequences(Tok(), "abc", seq_len=4, max_tokens=8)

"""A tiny random Llama (2 layers, 4 query / 2 KV heads, head_dim 16) for calibration tests: no download."""

import torch

Q_HEADS, KV_HEADS, D = 4, 2, 16


def tiny_llama(seed: int = 0):
    """A float32 ``LlamaForCausalLM`` with random weights (``torch.manual_seed(seed)``), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=Q_HEADS * D, intermediate_size=96, num_attention_heads=Q_HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=2, vocab_size=97,
                      max_position_embeddings=256, rope_theta=1000.0, attn_implementation="sdpa",
                      architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(cfg).float().eval()


def tiny_llama_large_keys(seed: int = 0):
    """``tiny_llama`` in float64 with keys scaled up 3x (large key ranges, as real RoPE keys have), so
    centering, clipping and wider formats have something to act on."""
    model = tiny_llama(seed).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
    return model

"""Small models the export tests share (tests/backends/test_decompose.py, tests/integrations/test_onnx.py)."""

from __future__ import annotations

import torch
from torch import nn

import ropekit

SEQ = 8


class Attention(nn.Module):
    """q and k through a RotaryEmbedding, at explicit positions or an offset."""

    def __init__(self, rope: ropekit.RotaryEmbedding, offsets: int | None = None) -> None:
        super().__init__()
        self.rope, self.offsets = rope, offsets

    def forward(self, q, k, positions):
        if self.offsets is not None:
            return self.rope(q, k, offsets=self.offsets)
        return self.rope(q, k, positions=positions)


class LlamaBlock(nn.Module):
    """A Llama-style decoder block: RMSNorm, GQA attention with RoPE (ropekit's module, HF's bhsd layout),
    SwiGLU MLP. Attention and SiLU are written out: torch's own decompositions of scaled_dot_product_attention
    and silu round differently from their eager kernels (torch's, not ropekit's), which would hide whether
    ropekit's lowering is exact."""

    def __init__(self, dim: int = 64, heads: int = 4, kv_heads: int = 2, rope_scaling=None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        config = ropekit.RopeConfig(head_dim=self.head_dim, max_position_embeddings=128, scaling=rope_scaling)
        self.rope = ropekit.RotaryEmbedding(config, layout="bhsd")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)  # (B, S, H, D) each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        q, k = self.rope(q, k, positions=positions)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, S, S)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v  # (B, H, S, D)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(gate * torch.sigmoid(gate) * up)


def block_inputs(seq: int = SEQ):
    torch.manual_seed(0)
    return torch.randn(2, seq, 64), torch.arange(seq).expand(2, seq)


def tiny_hf_llama():
    """A 2-layer transformers Llama patched by ropekit.integrations.hf (eager attention and ReLU, as
    LlamaBlock writes its attention and SiLU out), and a wrapper returning its logits for input ids."""
    import transformers

    from ropekit.integrations import hf

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, hidden_act="relu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert hf.patch(model) > 0

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    return Logits().eval()


class Decode(nn.Module):
    """Rotation at the offset a KV cache's length gives (a symbolic int under a dynamic cache length)."""

    def __init__(self) -> None:
        super().__init__()
        self.rope = ropekit.RotaryEmbedding(head_dim=16, max_position_embeddings=64)

    def forward(self, q, k, past):
        return self.rope(q, k, offsets=past.shape[1])

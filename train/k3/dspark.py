"""The DSpark draft model (../../shared/K3.md, "DSpark draft model"), scaled down, for training.

The target's completed rows after `target_layers` (the AttnRes running prefix) are concatenated
and projected: ctx = RMSNorm(context_proj(x), context_norm). Each draft layer turns ctx rows into
its own latent cache (kv_a_proj_with_mqa without an input norm; latent = kv_a_layernorm(first
kv_lora), k_pe = YaRN RoPE(last qk_rope) at the row's position). A block is [anchor, mask x
(block-1)] at positions L..L+block-1 (L = context rows), embedded with the target's embeddings;
pre-norm layers: MLA (absorbed in the engine, expanded here) over context rows < L and the block's
own rows with no mask, then a SiLU MLP. Output: final_norm, the target's lm_head, plus the Markov
term markov_w2 . markov_w1[prev] (prev = anchor for row 0, then the previous row's token).

`block_logits` trains many blocks of one sequence at once: block b (anchor position L_b) sees the
context rows j < L_b and its own rows, exactly what the engine computes for that block alone.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import Linear, norm_weight, rmsnorm


@dataclass
class DSparkConfig:
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    q_lora: int = 128
    kv_lora: int = 64
    nope: int = 32
    rope: int = 16
    v_head: int = 32
    rms_eps: float = 1e-5
    target_layers: tuple = (1, 3, 6, 8)
    mask_token: int = 4605
    markov_rank: int = 32
    vocab: int = 4608
    block: int = 7
    rope_theta: float = 50000.0
    yarn_factor: float = 32.0
    yarn_original: int = 32768
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


def yarn_params(c: DSparkConfig):
    """(inv_freq [rope/2], cos/sin multiplier, softmax scale) as DeepSeek's YaRN defines them."""
    d, base = c.rope, c.rope_theta
    extra = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale = 1.0 / math.sqrt(c.nope + d)
    factor, orig = c.yarn_factor, c.yarn_original

    def corr_dim(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(c.beta_fast)), 0)
    high = min(math.ceil(corr_dim(c.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp
    inv = extra / factor * (1 - keep) + extra * keep

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    cs = mscale(c.mscale) / mscale(c.mscale_all_dim)
    m_all = mscale(c.mscale_all_dim)
    return inv, cs, scale * m_all * m_all


def rope(x, positions, inv_freq, cs):
    """Interleaved pairs (2i, 2i+1) of x [..., T, ..., d] rotated; positions broadcast to x[..., 0]."""
    ang = positions.double()[..., None] * inv_freq.to(positions.device)
    cos, sin = (torch.cos(ang) * cs).float(), (torch.sin(ang) * cs).float()
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig, out_std):
        super().__init__()
        H, nh = c.hidden, c.heads
        self.input_layernorm = norm_weight(H)
        self.post_attention_layernorm = norm_weight(H)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_a_proj = Linear(H, c.q_lora)
        a.q_a_layernorm = norm_weight(c.q_lora)
        a.q_b_proj = Linear(c.q_lora, nh * (c.nope + c.rope))
        a.kv_a_proj_with_mqa = Linear(H, c.kv_lora + c.rope)
        a.kv_a_layernorm = norm_weight(c.kv_lora)
        a.kv_b_proj = Linear(c.kv_lora, nh * (c.nope + c.v_head))
        a.o_proj = Linear(nh * c.v_head, H, std=out_std)
        self.mlp = nn.Module()
        self.mlp.gate_proj = Linear(H, c.intermediate)
        self.mlp.up_proj = Linear(H, c.intermediate)
        self.mlp.down_proj = Linear(c.intermediate, H, std=out_std)


class DSpark(nn.Module):
    def __init__(self, c: DSparkConfig, n_taps_hidden):
        super().__init__()
        self.c = c
        out_std = (2 * c.layers) ** -0.5 * c.hidden ** -0.5
        self.context_proj = Linear(n_taps_hidden, c.hidden)
        self.context_norm = norm_weight(c.hidden)
        self.final_norm = norm_weight(c.hidden)
        self.layers = nn.ModuleList([DraftLayer(c, out_std) for _ in range(c.layers)])
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Parameter(torch.randn(c.vocab, c.markov_rank) * 0.02)
        self.markov_head.markov_w2 = nn.Parameter(torch.zeros(c.vocab, c.markov_rank))
        inv, cs, scale = yarn_params(c)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.cs, self.scale = cs, scale

    def _kv(self, layer, x, positions):
        c = self.c
        ckv = layer.self_attn.kv_a_proj_with_mqa(x)
        lat = rmsnorm(ckv[..., : c.kv_lora], layer.self_attn.kv_a_layernorm, c.rms_eps)
        return lat, rope(ckv[..., c.kv_lora:], positions, self.inv_freq, self.cs)

    def block_logits(self, taps, ids, anchors, embed, lm_head):
        """taps [B, T, n*H] (target rows), ids [B, T] (the sequence), anchors [B, K] (anchor
        positions L; each block's rows are positions L..L+block-1), embed / lm_head the target's.
        Returns logits [B, K, block, vocab]: row r of block b predicts ids[L_b + r + 1]; the
        Markov term uses prev = ids[L_b + r] (teacher forcing)."""
        c = self.c
        B, T, _ = taps.shape
        K, R = anchors.shape[1], c.block
        dev = taps.device
        ctx = rmsnorm(self.context_proj(taps), self.context_norm, c.rms_eps)           # B, T, H
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        blk_pos = anchors[:, :, None] + torch.arange(R, device=dev)                     # B, K, R
        blk_ids = torch.full((B, K, R), c.mask_token, dtype=torch.long, device=dev)
        blk_ids[:, :, 0] = torch.gather(ids, 1, anchors)
        h = embed[blk_ids].float().reshape(B, K * R, -1)
        # Visibility: block row of block b sees context rows j < L_b and the rows of block b.
        see_ctx = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]      # B, K, T
        see_ctx = see_ctx[:, :, None, :].expand(B, K, R, T).reshape(B, K * R, T)
        bidx = torch.arange(K, device=dev).repeat_interleave(R)
        see_blk = (bidx[:, None] == bidx[None, :]).expand(B, K * R, K * R)
        mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]                          # B, 1, KR, T+KR
        nh, nope, rp, vd = c.heads, c.nope, c.rope, c.v_head
        pos_flat = blk_pos.reshape(B, K * R)
        for layer in self.layers:
            x = rmsnorm(h, layer.input_layernorm, c.rms_eps)
            a = layer.self_attn
            qa = rmsnorm(a.q_a_proj(x), a.q_a_layernorm, c.rms_eps)
            q = a.q_b_proj(qa).reshape(B, K * R, nh, nope + rp)
            q = torch.cat([q[..., :nope], rope(q[..., nope:], pos_flat[:, :, None], self.inv_freq, self.cs)], -1)
            lat_c, kpe_c = self._kv(layer, ctx, ctx_pos)
            lat_b, kpe_b = self._kv(layer, x, pos_flat)
            lat = torch.cat([lat_c, lat_b], 1)
            kpe = torch.cat([kpe_c, kpe_b], 1)
            S = lat.shape[1]
            kv = a.kv_b_proj(lat).reshape(B, S, nh, nope + vd)
            k = torch.cat([kv[..., :nope], kpe[:, :, None, :].expand(B, S, nh, rp)], -1)
            v = kv[..., nope:]
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
            ).transpose(1, 2)
            h = h + a.o_proj(att.reshape(B, K * R, nh * vd))
            x = rmsnorm(h, layer.post_attention_layernorm, c.rms_eps)
            m = layer.mlp
            h = h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        h = rmsnorm(h, self.final_norm, c.rms_eps)
        logits = F.linear(h, lm_head.float()).reshape(B, K, R, -1)
        prev = torch.gather(ids, 1, blk_pos.reshape(B, K * R).clamp(max=T - 1)).reshape(B, K, R)
        markov = self.markov_head.markov_w1[prev] @ self.markov_head.markov_w2.t()     # B, K, R, vocab
        return logits + markov


def config_json(c: DSparkConfig, target_hidden):
    return {
        "model_type": "k3_dspark",
        "architectures": ["K3DSparkModel"],
        "hidden_size": c.hidden, "intermediate_size": c.intermediate, "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads, "q_lora_rank": c.q_lora, "kv_lora_rank": c.kv_lora,
        "qk_nope_head_dim": c.nope, "qk_rope_head_dim": c.rope, "v_head_dim": c.v_head,
        "mla_use_nope": False, "rms_norm_eps": c.rms_eps, "target_layer_ids": list(c.target_layers),
        "target_hidden_size": target_hidden, "num_target_layers": len(c.target_layers),
        "mask_token_id": c.mask_token, "markov_rank": c.markov_rank, "enable_confidence_head": False,
        "vocab_size": c.vocab, "block_size": c.block, "rope_theta": c.rope_theta,
        "rope_scaling": {"type": "yarn", "factor": c.yarn_factor,
                         "original_max_position_embeddings": c.yarn_original, "beta_fast": c.beta_fast,
                         "beta_slow": c.beta_slow, "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim},
    }


def tensors(model: DSpark):
    out = {}
    for name, p in model.named_parameters():
        n = name if name.endswith(".weight") else name + ".weight"
        out[n] = p.detach().to("cpu", torch.bfloat16).contiguous()
    return out


def load(model_dir, device="cpu"):
    """A DSpark holding a checkpoint's values (the inverse of `tensors` and `config_json`)."""
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        j = json.load(f)
    rs = j["rope_scaling"]
    c = DSparkConfig(hidden=j["hidden_size"], intermediate=j["intermediate_size"], layers=j["num_hidden_layers"],
                     heads=j["num_attention_heads"], q_lora=j["q_lora_rank"], kv_lora=j["kv_lora_rank"],
                     nope=j["qk_nope_head_dim"], rope=j["qk_rope_head_dim"], v_head=j["v_head_dim"],
                     rms_eps=j["rms_norm_eps"], target_layers=tuple(j["target_layer_ids"]),
                     mask_token=j["mask_token_id"], markov_rank=j["markov_rank"], vocab=j["vocab_size"],
                     block=j.get("block_size", 7), rope_theta=j["rope_theta"], yarn_factor=rs["factor"],
                     yarn_original=rs["original_max_position_embeddings"], beta_fast=rs["beta_fast"],
                     beta_slow=rs["beta_slow"], mscale=rs["mscale"], mscale_all_dim=rs["mscale_all_dim"])
    model = DSpark(c, j["target_hidden_size"] * len(c.target_layers))
    ts = load_file(os.path.join(model_dir, "model.safetensors"))
    sd = {n: ts[n if n.endswith(".weight") else n + ".weight"].float() for n, _ in model.named_parameters()}
    model.load_state_dict(sd, strict=False)
    return model.to(device)

"""A K3-architecture language model in PyTorch: the training side of deltafin's demo model.

Every feature deltafin implements, as ../../shared/K3.md describes it: KDA layers (short conv, the
lower-bounded gate with `A_log` longer than the head count, per-head output norm and sigmoid gate),
gated MLA without RoPE, AttnRes block mixing, SiTU-GLU, a dense layer 0, latent MoE with `noaux_tc`
routing (sigmoid scores, selection by score + `e_score_correction_bias`, renormalised weights),
shared experts and an untied lm_head. Routed experts are trained quantisation-aware in MXFP4
(`mxfp4.py`): the forward pass sees exactly the packed weights that are shipped.

Parameter names are the checkpoint's own names (without the `language_model.model.` prefix), so
export and load are a rename, not a mapping. `forward(ids)` gives logits; with `taps` it also
returns the completed rows after the named layers (the AttnRes running prefix after the layer's
FFN, what DSpark reads).
"""

import math
from dataclasses import dataclass, field, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kda as kda_ops
from .mxfp4 import quantize_ste

MLA_NORM_EPS = 1e-6
KDA_L2_EPS = 1e-6


@dataclass
class K3Config:
    vocab: int = 4608
    hidden: int = 256
    layers: int = 9
    attn_res_block: int = 3
    mla_layers: tuple = (3, 7, 8)          # 0-based; the rest are KDA
    rms_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # KDA
    kda_heads: int = 4
    kda_head_dim: int = 64
    kda_alog_len: int = 8                  # longer than kda_heads, as K3 ships it (128 for 96)
    conv_width: int = 4
    gate_lower_bound: float = -5.0
    # MLA
    mla_heads: int = 4
    q_lora: int = 128
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    # MLP / MoE
    dense_layers: int = 1                  # first_k_dense_replace
    dense_inter: int = 512
    experts: int = 64
    top_k: int = 8
    expert_inter: int = 64                 # moe_intermediate_size
    expert_latent: int = 128               # routed_expert_hidden_size
    shared_experts: int = 2
    routed_scaling: float = 1.0
    # tokens (filled from the tokenizer)
    bos: int = 4352
    eos: int = 4354                        # <|end_of_msg|> (K3: n_base + 2)
    pad: int = 4607
    max_context: int = 8192

    def is_mla(self, l):
        return l in self.mla_layers

    def is_moe(self, l):
        return self.experts > 0 and l >= self.dense_layers


def rmsnorm(x, w, eps):
    xf = x.float()
    return w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def situ(g, u, beta, lbeta):
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lbeta * torch.tanh(u / lbeta))


def attn_res_mix(sources, norm_w, proj_w, eps):
    """sources: list of [B, T, H]; softmax over sources of sum_d(norm(V) * nw * pw)."""
    V = torch.stack([s.float() for s in sources])                      # S, B, T, H
    k = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    logits = (k * (norm_w.float() * proj_w.float().reshape(-1))).sum(-1)
    p = torch.softmax(logits, dim=0)
    return (p[..., None] * V).sum(0)


def compile_pointwise():
    """Replaces the pointwise helpers (chains of fp32 elementwise ops that eager mode runs as one
    kernel each) with torch.compile'd versions, for training on a GPU. The maths is unchanged."""
    global rmsnorm, situ, attn_res_mix
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    rmsnorm, situ, attn_res_mix = (torch.compile(f) for f in (rmsnorm, situ, attn_res_mix))


class Linear(nn.Module):
    """A bias-free projection whose weight is stored [out, in] like the checkpoint."""

    def __init__(self, n_in, n_out, std=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        nn.init.normal_(self.weight, std=std if std is not None else n_in ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) if x.dtype != torch.float32 else self.weight)


def norm_weight(n):
    return nn.Parameter(torch.ones(n))


class KDA(nn.Module):
    def __init__(self, c: K3Config, out_std):
        super().__init__()
        self.c = c
        H, P, W = c.hidden, c.kda_heads * c.kda_head_dim, c.conv_width
        self.q_proj, self.k_proj, self.v_proj = Linear(H, P), Linear(H, P), Linear(H, P)
        bound = 1.0 / math.sqrt(W)
        self.q_conv1d = nn.Parameter(torch.empty(P, 1, W).uniform_(-bound, bound))
        self.k_conv1d = nn.Parameter(torch.empty(P, 1, W).uniform_(-bound, bound))
        self.v_conv1d = nn.Parameter(torch.empty(P, 1, W).uniform_(-bound, bound))
        # The gate's low-rank path is head_dim wide in K3's checkpoint (f_a_proj [128, H]).
        self.f_a_proj = Linear(H, c.kda_head_dim)
        self.f_b_proj = Linear(c.kda_head_dim, P)
        self.b_proj = Linear(H, c.kda_heads)
        self.g_proj = Linear(H, P)
        # fla's KDA initialisation: A in [1, 16], dt in [1e-3, 1e-1] through softplus^-1.
        self.A_log = nn.Parameter(torch.log(torch.empty(c.kda_alog_len).uniform_(1, 16)))
        dt = torch.exp(torch.rand(P) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm = norm_weight(c.kda_head_dim)
        self.o_proj = Linear(P, H, std=out_std)

    def conv(self, y, w, tail=None):
        """Causal depthwise conv of width W over time, then SiLU. y [B, T, P]; `tail` the last
        W - 1 inputs before y (zeros when None). Returns (output, the new tail). A sum of W shifted
        products: the same map as a grouped conv1d, without cuDNN's slow deterministic depthwise
        kernels."""
        W = w.shape[-1]
        B, T, P = y.shape
        if tail is None:
            tail = y.new_zeros(B, W - 1, P)
        yp = torch.cat([tail.to(y.dtype), y], 1)                   # [B, T + W - 1, P]
        wt = w.to(y.dtype)[:, 0, :]                                # [P, W]
        out = yp[:, 0:T] * wt[:, 0]
        for i in range(1, W):
            out = out + yp[:, i:i + T] * wt[:, i]
        return F.silu(out), yp[:, T:].detach() if W > 1 else tail

    def gate(self, x):
        c = self.c
        B, T, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        a = torch.exp(self.A_log.float()[: c.kda_heads])
        return c.gate_lower_bound * torch.sigmoid(a[:, None] * f.reshape(B, T, c.kda_heads, c.kda_head_dim))

    def forward(self, x, chunked=True, cache=None):
        """x [B, T, H]. `cache` (a dict, or None): the state after earlier tokens (`S`, the conv
        tails), read and replaced, for decoding a sequence in pieces."""
        c = self.c
        B, T, _ = x.shape
        nh, dk = c.kda_heads, c.kda_head_dim
        cache = {} if cache is None else cache
        q, tq = self.conv(self.q_proj(x), self.q_conv1d, cache.get("q"))
        k, tk = self.conv(self.k_proj(x), self.k_conv1d, cache.get("k"))
        v, tv = self.conv(self.v_proj(x), self.v_conv1d, cache.get("v"))
        q, k, v = (t.float().reshape(B, T, nh, dk) for t in (q, k, v))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + KDA_L2_EPS) / math.sqrt(dk)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + KDA_L2_EPS)
        g = self.gate(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if chunked and T >= 16:
            o, S = kda_ops.chunked(q, k, v, g, beta, chunk=16, state=cache.get("S"), g_bound=c.gate_lower_bound)
        else:
            o, S = kda_ops.naive(q, k, v, g, beta, state=cache.get("S"))
        cache.update(q=tq, k=tk, v=tv, S=S.detach())
        o = rmsnorm(o, self.o_norm, c.rms_eps)
        gate = torch.sigmoid(self.g_proj(x).float()).reshape(B, T, nh, dk)
        return self.o_proj((o * gate).reshape(B, T, nh * dk).to(x.dtype))


class MLA(nn.Module):
    def __init__(self, c: K3Config, out_std):
        super().__init__()
        self.c = c
        H, nh = c.hidden, c.mla_heads
        self.q_a_proj = Linear(H, c.q_lora)
        self.q_a_layernorm = norm_weight(c.q_lora)
        self.q_b_proj = Linear(c.q_lora, nh * (c.qk_nope + c.qk_rope))
        self.kv_a_proj_with_mqa = Linear(H, c.kv_lora + c.qk_rope)
        self.kv_a_layernorm = norm_weight(c.kv_lora)
        self.kv_b_proj = Linear(c.kv_lora, nh * (c.qk_nope + c.v_head))
        self.g_proj = Linear(H, nh * c.v_head)
        self.o_proj = Linear(nh * c.v_head, H, std=out_std)

    def forward(self, x, cache=None):
        """x [B, T, H]. `cache` (a dict, or None): the keys and values of earlier tokens, read and
        extended, for decoding a sequence in pieces."""
        c = self.c
        B, T, _ = x.shape
        nh, nope, rope, vd = c.mla_heads, c.qk_nope, c.qk_rope, c.v_head
        qa = rmsnorm(self.q_a_proj(x), self.q_a_layernorm, MLA_NORM_EPS).to(x.dtype)
        q = self.q_b_proj(qa).reshape(B, T, nh, nope + rope)
        ckv = self.kv_a_proj_with_mqa(x)
        lat = rmsnorm(ckv[..., : c.kv_lora], self.kv_a_layernorm, MLA_NORM_EPS).to(x.dtype)
        kpe = ckv[..., c.kv_lora:]
        kv = self.kv_b_proj(lat).reshape(B, T, nh, nope + vd)
        k = torch.cat([kv[..., :nope], kpe[:, :, None, :].expand(B, T, nh, rope)], dim=-1)
        v = kv[..., nope:]
        mask, causal = None, True
        if cache is not None:
            if "k" in cache:
                L0 = cache["k"].shape[1]
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
                # Row i (position L0 + i) sees keys j <= L0 + i.
                mask = torch.arange(L0 + T, device=x.device)[None, :] <= (L0 + torch.arange(T, device=x.device))[:, None]
                causal = False
            cache.update(k=k.detach(), v=v.detach())
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal,
            scale=(nope + rope) ** -0.5,
        ).transpose(1, 2)
        gate = torch.sigmoid(self.g_proj(x).float()).reshape(B, T, nh, vd)
        return self.o_proj((att.float() * gate).reshape(B, T, nh * vd).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, c: K3Config, inter, out_std):
        super().__init__()
        self.c = c
        self.gate_proj = Linear(c.hidden, inter)
        self.up_proj = Linear(c.hidden, inter)
        self.down_proj = Linear(inter, c.hidden, std=out_std)

    def forward(self, x):
        c = self.c
        h = situ(self.gate_proj(x).float(), self.up_proj(x).float(), c.situ_beta, c.situ_linear_beta)
        return self.down_proj(h.to(x.dtype))


class Experts(nn.Module):
    """The routed experts of one layer as stacked master weights, quantised to MXFP4 on the fly.
    w1 (gate) and w3 (up) [E, I, Z]; w2 (down) [E, Z, I]."""

    def __init__(self, c: K3Config, out_std):
        super().__init__()
        E, I, Z = c.experts, c.expert_inter, c.expert_latent
        self.w1 = nn.Parameter(torch.randn(E, I, Z) * Z ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, Z) * Z ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, Z, I) * out_std)

    def train(self, mode=True):
        self._qkey = None             # a mode switch (scoring between steps) re-quantises
        return super().train(mode)

    def quantized(self):
        if torch.is_grad_enabled():
            return quantize_ste(self.w1), quantize_ste(self.w3), quantize_ste(self.w2)
        # Without gradients (scoring, generation) the weights stand still between optimizer steps:
        # quantise once per weight version, not once per forward (a decode step would otherwise
        # re-quantise every expert).
        key = tuple((w.data_ptr(), w._version) for w in (self.w1, self.w3, self.w2))
        if getattr(self, "_qkey", None) != key:
            self._q = tuple(quantize_ste(w).detach() for w in (self.w1, self.w3, self.w2))
            self._qkey = key
        return self._q


class MoE(nn.Module):
    def __init__(self, c: K3Config, out_std):
        super().__init__()
        self.c = c
        H, E, Z = c.hidden, c.experts, c.expert_latent
        self.gate = Linear(H, E, std=H ** -0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.routed_expert_down_proj = Linear(H, Z)
        self.routed_expert_norm = norm_weight(Z)
        self.routed_expert_up_proj = Linear(Z, H, std=out_std)
        self.experts = Experts(c, Z ** -0.5 / math.sqrt(2))
        self.shared_experts = MLP(c, c.shared_experts * c.expert_inter, out_std) if c.shared_experts else None
        self.last_load = None          # tokens per expert of the last forward (for the bias update)

    def route(self, x):
        """Returns (selected [N, k] in router order, weights [N, k]) for x [N, H]."""
        c = self.c
        s = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        choice = s + self.e_score_correction_bias.float()
        sel = torch.topk(choice, c.top_k, dim=-1, sorted=True).indices
        w = torch.gather(s, 1, sel)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling
        return sel, w

    def forward(self, x):
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(B * T, H)
        sel, w = self.route(xf)
        N, k = sel.shape
        z = self.routed_expert_down_proj(xf)                                # [N, Z]
        w1, w3, w2 = self.experts.quantized()
        flat = sel.reshape(-1)                                             # [N*k]
        load = torch.bincount(flat, minlength=c.experts)
        self.last_load = load.detach()
        # Group rows by expert into a padded [E, cap, Z] batch.
        order = torch.argsort(flat, stable=True)
        counts = load
        starts = torch.cumsum(counts, 0) - counts
        pos_in = torch.arange(N * k, device=x.device) - starts[flat[order]]
        cap = int(counts.max().item())
        rows = order // k
        buf = z.new_zeros(c.experts, cap, z.shape[-1])
        buf[flat[order], pos_in] = z[rows]
        g = torch.bmm(buf, w1.to(z.dtype).transpose(1, 2)).float()
        u = torch.bmm(buf, w3.to(z.dtype).transpose(1, 2)).float()
        h = situ(g, u, c.situ_beta, c.situ_linear_beta).to(z.dtype)
        y_e = torch.bmm(h, w2.to(z.dtype).transpose(1, 2)).float()         # [E, cap, Z]
        contrib = y_e[flat[order], pos_in] * w.reshape(-1)[order][:, None]
        y = torch.zeros(N, z.shape[-1], device=x.device, dtype=torch.float32).index_add_(0, rows, contrib)
        y = rmsnorm(y, self.routed_expert_norm, c.rms_eps).to(x.dtype)
        out = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.reshape(B, T, H)


class Layer(nn.Module):
    def __init__(self, c: K3Config, l):
        super().__init__()
        out_std = (2 * c.layers) ** -0.5 * c.hidden ** -0.5
        self.input_layernorm = norm_weight(c.hidden)
        self.post_attention_layernorm = norm_weight(c.hidden)
        self.self_attention_res_norm = norm_weight(c.hidden)
        self.self_attention_res_proj = nn.Parameter(torch.zeros(1, c.hidden))
        self.mlp_res_norm = norm_weight(c.hidden)
        self.mlp_res_proj = nn.Parameter(torch.zeros(1, c.hidden))
        self.self_attn = MLA(c, out_std) if c.is_mla(l) else KDA(c, out_std)
        if c.is_moe(l):
            self.block_sparse_moe = MoE(c, out_std)
        else:
            self.mlp = MLP(c, c.dense_inter, out_std)


class K3Model(nn.Module):
    def __init__(self, c: K3Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Parameter(torch.randn(c.vocab, c.hidden))
        self.layers = nn.ModuleList([Layer(c, l) for l in range(c.layers)])
        self.norm = norm_weight(c.hidden)
        self.output_attn_res_norm = norm_weight(c.hidden)
        self.output_attn_res_proj = nn.Parameter(torch.zeros(1, c.hidden))
        self.lm_head = nn.Parameter(torch.randn(c.vocab, c.hidden) * c.hidden ** -0.5)

    def forward(self, ids, taps=(), chunked=True, dtype=torch.float32, return_hidden=False, cache=None):
        """ids [B, T] -> logits [B, T, vocab] (float32), and {layer: prefix rows} for `taps`.
        `cache` (a dict from `new_cache()`, or None): the attention state after the tokens before
        `ids`, read and extended, so that a sequence can be fed in pieces (prompt, then tokens one
        at a time) with the logits of one whole forward."""
        c = self.c
        eps = c.rms_eps
        prefix = self.embed_tokens[ids].float()
        blocks = []
        got = {}
        for l, layer in enumerate(self.layers):
            if blocks:
                h = attn_res_mix(blocks + [prefix], layer.self_attention_res_norm, layer.self_attention_res_proj, eps)
            else:
                h = prefix
            if l % c.attn_res_block == 0:
                blocks.append(prefix)
                prefix = None
            xin = rmsnorm(h, layer.input_layernorm, eps).to(dtype)
            lc = None if cache is None else cache.setdefault(l, {})
            if isinstance(layer.self_attn, KDA):
                a = layer.self_attn(xin, chunked=chunked, cache=lc)
            else:
                a = layer.self_attn(xin, cache=lc)
            prefix = a.float() if prefix is None else prefix + a.float()
            h = attn_res_mix(blocks + [prefix], layer.mlp_res_norm, layer.mlp_res_proj, eps)
            xf = rmsnorm(h, layer.post_attention_layernorm, eps).to(dtype)
            f = layer.block_sparse_moe(xf) if c.is_moe(l) else layer.mlp(xf)
            prefix = prefix + f.float()
            if l in taps:
                got[l] = prefix
        out = attn_res_mix(blocks + [prefix], self.output_attn_res_norm, self.output_attn_res_proj, eps)
        out = rmsnorm(out, self.norm, eps)
        if return_hidden:
            return out, got
        logits = F.linear(out.to(dtype), self.lm_head.to(dtype)).float()
        return (logits, got) if taps else logits

    @staticmethod
    def new_cache():
        return {}

    def moe_layers(self):
        return [layer.block_sparse_moe for l, layer in enumerate(self.layers) if self.c.is_moe(l)]


def config_dict(c: K3Config):
    return asdict(c)

"""Independent fp64 reference of the DSpark draft model (K3.md, "DSpark draft model"), written
from the description rather than from the engine: keys and values expanded from the latents
(not absorbed), RoPE from its textbook YaRN formulas, one full block at a time.

    ref = DSparkReference(dspark_dir, Reference(k3_dir))
    taps = ref.target_taps(prompt)                  # {layer: [T, H]} from the K3 reference
    ctx = ref.context(taps, 0, L)                   # per draft layer (latent, k_pe) of rows 0..L-1
    logits, drafts = ref.block(ctx, anchor, L)      # [block, vocab] with the Markov term; drafts
"""

import json
import math
import os

import numpy as np

from k3_reference import LM_HEAD, PREFIX, load_tensors, rmsnorm, sigmoid, softmax


class DSparkReference:
    def __init__(self, model_dir, target):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.c = json.load(f)
        assert self.c["model_type"] == "k3_dspark"
        self.t = load_tensors(model_dir)
        self.target = target
        c = self.c
        self.eps = c.get("rms_norm_eps", 1e-5)
        self.taps = list(c["target_layer_ids"])
        self.block_size = c.get("block_size", 7)
        self.mask = c["mask_token_id"]
        self.embed = target.w("embed_tokens.weight")
        self.lm_head = target.t[LM_HEAD]
        self.inv_freq, self.mscale_cs, self.scale = self._rope_params()

    def _rope_params(self):
        c = self.c
        d = c["qk_rope_head_dim"]
        base = c.get("rope_theta", 10000.0)
        extra = 1.0 / base ** (np.arange(0, d, 2) / d)
        scale = 1.0 / math.sqrt(c["qk_nope_head_dim"] + d)
        rs = c.get("rope_scaling")
        if not rs:
            return extra, 1.0, scale
        factor = rs["factor"]
        orig = rs["original_max_position_embeddings"]

        def corr_dim(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(corr_dim(rs.get("beta_slow", 1))), d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
        keep = 1.0 - ramp                      # share of the extrapolated (original) frequency
        inv = extra / factor * (1 - keep) + extra * keep

        def mscale(m):
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        cs = mscale(rs.get("mscale", 1.0)) / mscale(rs.get("mscale_all_dim", 1.0))
        m_all = mscale(rs.get("mscale_all_dim", 1.0))
        return inv, cs, scale * m_all * m_all

    def rope(self, x, positions):
        """x [T, ..., d]: interleaved pairs (2i, 2i+1) rotated by position * inv_freq[i]."""
        pos = np.asarray(positions, dtype=np.float64)
        ang = pos[:, None] * self.inv_freq[None, :]                  # T, d/2
        shape = (len(pos),) + (1,) * (x.ndim - 2) + (ang.shape[1],)
        cos = (np.cos(ang) * self.mscale_cs).reshape(shape)
        sin = (np.sin(ang) * self.mscale_cs).reshape(shape)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out

    def lw(self, l, name):
        return self.t[f"layers.{l}.{name}"]

    def target_taps(self, tokens):
        taps = {l: None for l in self.taps}
        self.target.logits(tokens, taps)
        return taps

    def _kv(self, l, x, positions):
        c = self.c
        lora = c["kv_lora_rank"]
        ckv = x @ self.lw(l, "self_attn.kv_a_proj_with_mqa.weight").T
        latent = rmsnorm(ckv[:, :lora], self.lw(l, "self_attn.kv_a_layernorm.weight"), self.eps)
        return latent, self.rope(ckv[:, lora:], positions)

    def context(self, taps, start, end):
        """Per draft layer (latent [n, lora], k_pe [n, rope]) of the rows start..end-1."""
        x = np.concatenate([taps[l][start:end] for l in self.taps], axis=1)
        ctx = rmsnorm(x @ self.t["context_proj.weight"].T, self.t["context_norm.weight"], self.eps)
        pos = np.arange(start, end)
        return [self._kv(l, ctx, pos) for l in range(self.c["num_hidden_layers"])]

    def block(self, ctx, anchor, pos):
        c = self.c
        nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        B = self.block_size
        ids = [anchor] + [self.mask] * (B - 1)
        positions = np.arange(pos, pos + B)
        h = self.embed[np.asarray(ids)]
        for l in range(c["num_hidden_layers"]):
            x = rmsnorm(h, self.lw(l, "input_layernorm.weight"), self.eps)
            qa = rmsnorm(x @ self.lw(l, "self_attn.q_a_proj.weight").T, self.lw(l, "self_attn.q_a_layernorm.weight"), self.eps)
            q = (qa @ self.lw(l, "self_attn.q_b_proj.weight").T).reshape(B, nh, nope + rope)
            q = np.concatenate([q[:, :, :nope], self.rope(q[:, :, nope:], positions)], axis=-1)
            lat_b, kpe_b = self._kv(l, x, positions)
            lat = np.concatenate([ctx[l][0], lat_b], axis=0)
            kpe = np.concatenate([ctx[l][1], kpe_b], axis=0)
            S = lat.shape[0]
            kv = (lat @ self.lw(l, "self_attn.kv_b_proj.weight").T).reshape(S, nh, nope + vd)
            k = np.concatenate([kv[:, :, :nope], np.broadcast_to(kpe[:, None, :], (S, nh, rope))], axis=-1)
            scores = np.einsum("thd,shd->hts", q, k) * self.scale   # no mask
            att = np.einsum("hts,shd->thd", softmax(scores, axis=-1), kv[:, :, nope:])
            h = h + att.reshape(B, nh * vd) @ self.lw(l, "self_attn.o_proj.weight").T
            x = rmsnorm(h, self.lw(l, "post_attention_layernorm.weight"), self.eps)
            g = x @ self.lw(l, "mlp.gate_proj.weight").T
            u = x @ self.lw(l, "mlp.up_proj.weight").T
            h = h + (g * sigmoid(g) * u) @ self.lw(l, "mlp.down_proj.weight").T
        h = rmsnorm(h, self.t["final_norm.weight"], self.eps)
        logits = (h @ self.lm_head.T) * c.get("logit_scale", 1.0)
        w1, w2 = self.t["markov_head.markov_w1.weight"], self.t["markov_head.markov_w2.weight"]
        prev, drafts, margins = anchor, [], []
        for r in range(B):
            logits[r] = logits[r] + w2 @ w1[prev]
            order = np.argsort(-logits[r], kind="stable")
            margins.append(float(logits[r][order[0]] - logits[r][order[1]]))
            prev = int(order[0])
            drafts.append(prev)
        return logits, drafts, margins

"""Independent fp64 reference of the Kimi K3 forward pass, written from ../shared/K3.md.

Deliberately simple and unlike the engine: full-sequence recomputation, non-absorbed MLA
(keys/values expanded from the latent), token-by-token KDA recurrence, experts dequantised to
float64 matrices. Reads the shipped checkpoint layout (config.json with nested text_config,
safetensors shards + index, MXFP4 experts as weight_packed/weight_scale).

Dependencies: numpy (and the standard library). Safetensors files are parsed here directly
so that bf16 can be read exactly; `make_fixtures.py` cross-checks files with the `safetensors`
package.
"""

import json
import os
import struct

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)
PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
KDA_L2_EPS = 1e-6
MLA_NORM_EPS = 1e-6
KDA_CHUNK = 64


# ---------------------------------------------------------------- safetensors reading (exact)

def read_safetensors(path):
    """Returns {name: float64 or uint8 numpy array} for one file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        arr = _decode(data[base + s:base + e], info["dtype"], info["shape"], path, name)
        out[name] = arr.copy() if info["dtype"] == "U8" else arr
    return out


def _decode(raw, dt, shape, path, name):
    if dt == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        arr = bits.view(np.float32).astype(np.float64)
    elif dt == "F16":
        arr = np.frombuffer(raw, dtype="<f2").astype(np.float64)
    elif dt == "F32":
        arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif dt == "F64":
        arr = np.frombuffer(raw, dtype="<f8").astype(np.float64)
    elif dt == "U8":
        arr = np.frombuffer(raw, dtype=np.uint8)
    else:
        raise ValueError(f"{path}: unsupported dtype {dt} for {name}")
    return arr.reshape(shape)


class LazyTensors:
    """The same mapping as load_tensors, for checkpoints larger than memory: the shards are
    memory-mapped and a tensor is decoded when it is looked up (float tensors kept once decoded,
    uint8 expert bytes read from the map each time, never held)."""

    def __init__(self, model_dir, files):
        self.index, self.maps, self.done = {}, {}, {}
        for fn in files:
            path = os.path.join(model_dir, fn)
            mm = np.memmap(path, dtype=np.uint8, mode="r")
            (n,) = struct.unpack("<Q", bytes(mm[:8]))
            header = json.loads(bytes(mm[8:8 + n]))
            self.maps[path] = mm
            for name, info in header.items():
                if name != "__metadata__":
                    self.index[name] = (path, 8 + n, info)

    def __contains__(self, name):
        return name in self.index

    def __getitem__(self, name):
        if name in self.done:
            return self.done[name]
        path, base, info = self.index[name]
        s, e = info["data_offsets"]
        arr = _decode(self.maps[path][base + s:base + e], info["dtype"], info["shape"], path, name)
        if info["dtype"] != "U8":
            self.done[name] = arr
        return arr


def load_tensors(model_dir, lazy=False):
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    if lazy:
        return LazyTensors(model_dir, files)
    tensors = {}
    for fn in files:
        tensors.update(read_safetensors(os.path.join(model_dir, fn)))
    return tensors


def dequant_mxfp4(packed, scale):
    """packed [out, in/2] uint8 (element 2i = low nibble), scale [out, in/32] E8M0 -> [out, in] f64."""
    out_dim, half = packed.shape
    codes = np.empty((out_dim, half * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    vals = E2M1[codes]
    s = np.power(2.0, scale.astype(np.float64) - 127.0)
    return vals * np.repeat(s, 32, axis=1)


# ---------------------------------------------------------------- math

def rmsnorm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def situ(g, u, beta, linear_beta):
    a = beta * np.tanh(g / beta) * sigmoid(g)
    b = linear_beta * np.tanh(u / linear_beta) if linear_beta > 0 else u
    return a * b


def attn_res_mix(sources, norm_w, proj_w, eps):
    """sources: list of [T, H]. Scores from RMS-normalised sources, sum over raw ones."""
    V = np.stack(sources)                               # S, T, H
    k = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    logits = np.sum(k * (norm_w * proj_w.reshape(-1)), axis=-1)  # S, T
    p = softmax(logits, axis=0)
    return np.sum(p[:, :, None] * V, axis=0)


class Reference:
    def __init__(self, model_dir, lazy=False):
        """lazy: map the shards and dequantise each expert when it is used, keeping nothing (for
        checkpoints larger than memory)."""
        self.lazy = lazy
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        assert cfg["model_type"] == "kimi_k3"
        self.c = cfg["text_config"]
        self.t = load_tensors(model_dir, lazy)
        c = self.c
        self.L = c["num_hidden_layers"]
        lac = c["linear_attn_config"]
        self.kda_layers = set(x - 1 for x in lac["kda_layers"])
        self.mla_layers = set(x - 1 for x in lac["full_attn_layers"])
        self.eps = c["rms_norm_eps"]
        self.block = c["attn_res_block_size"]
        self.beta = c["activation_situ_beta"]
        self.lbeta = c.get("activation_situ_linear_beta", 0.0) or 0.0
        self.num_experts = c.get("num_experts") or 0
        self.first_dense = c.get("first_k_dense_replace", 0)
        self.moe_freq = c.get("moe_layer_freq", 1)
        self._experts = {}

    def w(self, name):
        return self.t[PREFIX + name]

    def lw(self, layer, name):
        return self.t[f"{PREFIX}layers.{layer}.{name}"]

    def is_moe(self, l):
        return self.num_experts > 0 and l >= self.first_dense and l % self.moe_freq == 0

    # -------------------------------------------------------- sublayers

    def kda(self, l, x):
        """x: [T, H] normalised input. Token recurrence from a zero state."""
        c = self.c
        lac = c["linear_attn_config"]
        nh, dk, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        T = x.shape[0]
        P = nh * dk
        p = lambda n: self.lw(l, "self_attn." + n)

        def conv(proj_name, conv_name):
            y = x @ p(proj_name).T                           # T, P
            taps = p(conv_name).reshape(P, W)
            pad = np.concatenate([np.zeros((W - 1, P)), y], axis=0)
            out = np.zeros_like(y)
            for j in range(W):
                out += taps[:, j] * pad[j:j + T]
            return silu(out)

        q = conv("q_proj.weight", "q_conv1d.weight").reshape(T, nh, dk)
        k = conv("k_proj.weight", "k_conv1d.weight").reshape(T, nh, dk)
        v = conv("v_proj.weight", "v_conv1d.weight").reshape(T, nh, dk)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + KDA_L2_EPS) / np.sqrt(dk)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + KDA_L2_EPS)
        f = (x @ p("f_a_proj.weight").T) @ p("f_b_proj.weight").T + p("dt_bias")   # T, P
        a = np.exp(p("A_log").reshape(-1)[:nh])                                     # per head
        g = lac["gate_lower_bound"] * sigmoid(a[None, :, None] * f.reshape(T, nh, dk))
        beta = sigmoid(x @ p("b_proj.weight").T)                                    # T, nh
        S = np.zeros((nh, dk, dk))
        o = np.zeros((T, nh, dk))
        for t in range(T):
            S = S * np.exp(g[t])[:, :, None]
            kS = np.einsum("hi,hij->hj", k[t], S)
            d = beta[t][:, None] * (v[t] - kS)
            S = S + k[t][:, :, None] * d[:, None, :]
            o[t] = np.einsum("hi,hij->hj", q[t], S)
        o = rmsnorm(o, p("o_norm.weight"), self.eps)
        gate = sigmoid(x @ p("g_proj.weight").T).reshape(T, nh, dk)
        return (o * gate).reshape(T, P) @ p("o_proj.weight").T

    def mla(self, l, x):
        c = self.c
        nh = c["num_attention_heads"]
        nope, rope, vd, lora = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        T = x.shape[0]
        p = lambda n: self.lw(l, "self_attn." + n)
        qa = rmsnorm(x @ p("q_a_proj.weight").T, p("q_a_layernorm.weight"), MLA_NORM_EPS)
        q = (qa @ p("q_b_proj.weight").T).reshape(T, nh, nope + rope)
        ckv = x @ p("kv_a_proj_with_mqa.weight").T
        lat = rmsnorm(ckv[:, :lora], p("kv_a_layernorm.weight"), MLA_NORM_EPS)
        kpe = ckv[:, lora:]                                               # T, rope (shared)
        kv = (lat @ p("kv_b_proj.weight").T).reshape(T, nh, nope + vd)
        k_nope, v = kv[:, :, :nope], kv[:, :, nope:]
        k = np.concatenate([k_nope, np.broadcast_to(kpe[:, None, :], (T, nh, rope))], axis=-1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(nope + rope)
        mask = np.triu(np.ones((T, T), dtype=bool), 1)
        scores[:, mask] = -np.inf
        att = np.einsum("hts,shd->thd", softmax(scores, axis=-1), v)
        gate = sigmoid(x @ p("g_proj.weight").T).reshape(T, nh, vd)
        return (att * gate).reshape(T, nh * vd) @ p("o_proj.weight").T

    def mlp(self, prefix_fn, x):
        g = x @ prefix_fn("gate_proj.weight").T
        u = x @ prefix_fn("up_proj.weight").T
        return situ(g, u, self.beta, self.lbeta) @ prefix_fn("down_proj.weight").T

    def expert(self, l, e):
        key = (l, e)
        if key not in self._experts:
            mats = []
            for proj in ("w1", "w3", "w2"):
                base = f"block_sparse_moe.experts.{e}.{proj}."
                mats.append(dequant_mxfp4(self.lw(l, base + "weight_packed"), self.lw(l, base + "weight_scale")))
            if self.lazy:
                return mats
            self._experts[key] = mats
        return self._experts[key]

    def route(self, l, x):
        """Returns (experts [T, k] in router order, weights [T, k])."""
        c = self.c
        k = c["num_experts_per_token"]
        s = sigmoid(x @ self.lw(l, "block_sparse_moe.gate.weight").T)
        choice = s + self.lw(l, "block_sparse_moe.gate.e_score_correction_bias")
        sel = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        ws = np.take_along_axis(s, sel, axis=-1)
        if c.get("moe_renormalize", True):
            ws = ws / (np.sum(ws, axis=-1, keepdims=True) + 1e-20)
        return sel, ws * c.get("routed_scaling_factor", 1.0)

    def moe(self, l, x):
        c = self.c
        pm = lambda n: self.lw(l, "block_sparse_moe." + n)
        sel, ws = self.route(l, x)
        z = x @ pm("routed_expert_down_proj.weight").T
        y = np.zeros_like(z)
        for e in np.unique(sel):
            rows, slots = np.nonzero(sel == e)
            w1, w3, w2 = self.expert(l, int(e))
            ze = z[rows]
            out = situ(ze @ w1.T, ze @ w3.T, self.beta, self.lbeta) @ w2.T
            y[rows] += ws[rows, slots][:, None] * out
        if c.get("latent_moe_use_norm", True):
            y = rmsnorm(y, pm("routed_expert_norm.weight"), self.eps)
        out = y @ pm("routed_expert_up_proj.weight").T
        if (c.get("num_shared_experts") or 0) > 0:
            out = out + self.mlp(lambda n: pm("shared_experts." + n), x)
        return out

    # -------------------------------------------------------- whole model

    def logits(self, tokens, taps=None):
        """Full forward over `tokens`; returns logits [T, vocab] in float64. With `taps` (a dict
        keyed by layer index), stores in taps[l] the completed rows after layer l: the AttnRes
        running prefix after the layer's FFN was added (what DSpark reads)."""
        eps = self.eps
        prefix = self.w("embed_tokens.weight")[np.asarray(tokens)]
        blocks = []
        for l in range(self.L):
            if blocks:
                h = attn_res_mix(blocks + [prefix], self.lw(l, "self_attention_res_norm.weight"),
                                 self.lw(l, "self_attention_res_proj.weight"), eps)
            else:
                h = prefix
            if l % self.block == 0:
                blocks.append(prefix)
                prefix = None
            xin = rmsnorm(h, self.lw(l, "input_layernorm.weight"), eps)
            a = self.kda(l, xin) if l in self.kda_layers else self.mla(l, xin)
            prefix = a if prefix is None else prefix + a
            h = attn_res_mix(blocks + [prefix], self.lw(l, "mlp_res_norm.weight"),
                             self.lw(l, "mlp_res_proj.weight"), eps)
            xf = rmsnorm(h, self.lw(l, "post_attention_layernorm.weight"), eps)
            if self.is_moe(l):
                f = self.moe(l, xf)
            else:
                f = self.mlp(lambda n: self.lw(l, "mlp." + n), xf)
            prefix = prefix + f
            if taps is not None and l in taps:
                taps[l] = prefix.copy()
        out = attn_res_mix(blocks + [prefix], self.w("output_attn_res_norm.weight"),
                           self.w("output_attn_res_proj.weight"), eps)
        out = rmsnorm(out, self.w("norm.weight"), eps)
        return (out @ self.t[LM_HEAD].T) * self.c.get("logit_scale", 1.0)

    def greedy(self, prompt, n_new):
        """Greedy continuation by full recomputation; returns (ids, top-2 margins)."""
        ids = list(prompt)
        out, margins = [], []
        for _ in range(n_new):
            last = self.logits(ids)[-1]
            order = np.argsort(-last, kind="stable")
            margins.append(float(last[order[0]] - last[order[1]]))
            nxt = int(order[0])
            out.append(nxt)
            ids.append(nxt)
        return out, margins

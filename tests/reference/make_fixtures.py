"""Generates the tiny random K3 checkpoints under tests/fixtures/ in the exact shipped layout,
plus their fp64 reference logits and greedy continuations (k3_reference.py).

    python3 tests/reference/make_fixtures.py            # regenerate every fixture
    python3 tests/reference/make_fixtures.py k3-tiny-a  # one fixture

Layout written: config.json (top level kimi_k3, nested text_config, compressed-tensors
quantization_config), `language_model.`-prefixed tensors, MXFP4 routed experts as
weight_packed/weight_scale, several shards + model.safetensors.index.json (or one
model.safetensors), and a vision tensor the engine must ignore. Outputs per fixture:
reference.safetensors (F32 logits [T, vocab]) and reference.json (prompt, greedy ids, margins).
"""

import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3_reference import LM_HEAD, PREFIX, Reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")
GREEDY_NEW = 32
MIN_MARGIN = 2e-3

SPECS = {
    # 3 AttnRes blocks, KDA/MLA mix with MLA last, dense layer 0, 16 experts top-4, 2 shared,
    # A_log longer than the head count, 140-token prompt (3 KDA chunks), 3 shards + index.
    "k3-tiny-a": dict(
        seed=1, hidden=64, vocab=512, layers=6, block=2, kda=[1, 2, 4, 5], mla=[3, 6],
        first_dense=1, dense_inter=96, kda_heads=4, kda_head_dim=16, conv=4, a_log_len=6,
        a_log_shape="flat", mla_heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
        experts=16, top_k=4, shared=2, expert_inter=32, latent=32, shards=3, prompt_len=140),
    # Widths that are not multiples of the SIMD width, A_log stored 4-D, one model.safetensors.
    "k3-tiny-b": dict(
        seed=2, hidden=80, vocab=300, layers=5, block=3, kda=[1, 3, 4], mla=[2, 5],
        first_dense=1, dense_inter=72, kda_heads=2, kda_head_dim=24, conv=4, a_log_len=5,
        a_log_shape="4d", mla_heads=3, q_lora=40, kv_lora=24, nope=20, rope=4, v=12,
        experts=24, top_k=6, shared=2, expert_inter=64, latent=64, shards=1, prompt_len=136),
    # Long prompt (200 tokens: 3 full chunks + a partial one), 32 experts top-8.
    "k3-tiny-c": dict(
        seed=3, hidden=48, vocab=256, layers=4, block=2, kda=[1, 2, 3], mla=[4],
        first_dense=1, dense_inter=64, kda_heads=3, kda_head_dim=16, conv=4, a_log_len=8,
        a_log_shape="flat", mla_heads=2, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
        experts=32, top_k=8, shared=2, expert_inter=32, latent=32, shards=2, prompt_len=200),
}


# DSpark drafters for a target fixture (published layout: config.json + model.safetensors).
DSPARK_SPECS = {
    "dspark-tiny-a": dict(
        seed=11, target="k3-tiny-a", layers=2, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
        inter=96, markov_rank=16, taps=[0, 2, 4], block=7, cases=[1, 40, 139]),
}


def bf16_bits(x):
    """float array -> uint16 bf16 bits, round to nearest even."""
    f = np.asarray(x, dtype=np.float32)
    b = f.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


class Tensors:
    def __init__(self):
        self.items = {}  # name -> (dtype, shape, bytes)

    def bf16(self, name, arr):
        self.items[name] = ("BF16", list(arr.shape), bf16_bits(arr).astype("<u2").tobytes())

    def f32(self, name, arr):
        self.items[name] = ("F32", list(arr.shape), np.asarray(arr, dtype="<f4").tobytes())

    def u8(self, name, arr):
        self.items[name] = ("U8", list(arr.shape), np.asarray(arr, dtype=np.uint8).tobytes())


ITEMSIZE = {"F32": 4, "BF16": 2, "U8": 1}


def write_safetensors(path, items):
    """Standard layout: tensors ordered by descending alignment then name; header padded to 8."""
    names = sorted(items, key=lambda n: (-ITEMSIZE[items[n][0]], n))
    header, off, blobs = {}, 0, []
    for n in names:
        dt, shape, data = items[n]
        header[n] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def make_checkpoint(spec, out_dir, seed):
    rng = np.random.default_rng(seed)
    H, V = spec["hidden"], spec["vocab"]
    T = Tensors()
    lin = lambda o, i, gain=1.0: rng.standard_normal((o, i)) * gain / np.sqrt(i)
    norm = lambda n: 1.0 + 0.1 * rng.standard_normal(n)
    top = lambda n: PREFIX + n
    T.bf16(top("embed_tokens.weight"), rng.standard_normal((V, H)))
    T.bf16(LM_HEAD, lin(V, H, 3.0))
    T.bf16(top("norm.weight"), norm(H))
    T.bf16(top("output_attn_res_norm.weight"), norm(H))
    T.bf16(top("output_attn_res_proj.weight"), rng.standard_normal((1, H)) / np.sqrt(H))
    # A vision tensor: present in the shipped checkpoint, ignored by the text engine.
    T.bf16("vision_tower.patch_embed.proj.weight", rng.standard_normal((8, 12)))
    nh, dk, W = spec["kda_heads"], spec["kda_head_dim"], spec["conv"]
    P = nh * dk
    layer_of = {}
    for l in range(spec["layers"]):
        ln = lambda n: f"{PREFIX}layers.{l}.{n}"
        start = len(T.items)
        T.bf16(ln("input_layernorm.weight"), norm(H))
        T.bf16(ln("post_attention_layernorm.weight"), norm(H))
        T.bf16(ln("self_attention_res_norm.weight"), norm(H))
        T.bf16(ln("mlp_res_norm.weight"), norm(H))
        T.bf16(ln("self_attention_res_proj.weight"), rng.standard_normal((1, H)) / np.sqrt(H))
        T.bf16(ln("mlp_res_proj.weight"), rng.standard_normal((1, H)) / np.sqrt(H))
        if (l + 1) in spec["kda"]:
            a = lambda n: ln("self_attn." + n)
            for q in ("q", "k", "v"):
                T.bf16(a(f"{q}_proj.weight"), lin(P, H))
                T.f32(a(f"{q}_conv1d.weight"), 0.5 * rng.standard_normal((P, 1, W)))
            T.bf16(a("f_a_proj.weight"), lin(dk, H))
            T.bf16(a("f_b_proj.weight"), lin(P, dk))
            T.bf16(a("b_proj.weight"), lin(nh, H))
            T.bf16(a("g_proj.weight"), lin(P, H))
            alog = 0.5 * rng.standard_normal(spec["a_log_len"])
            T.f32(a("A_log"), alog.reshape(1, 1, -1, 1) if spec["a_log_shape"] == "4d" else alog)
            T.f32(a("dt_bias"), rng.standard_normal(P))
            T.bf16(a("o_norm.weight"), norm(dk))
            T.bf16(a("o_proj.weight"), lin(H, P))
        else:
            a = lambda n: ln("self_attn." + n)
            mh, ql, kl, nope, rope, vd = (spec[k] for k in ("mla_heads", "q_lora", "kv_lora", "nope", "rope", "v"))
            T.bf16(a("q_a_proj.weight"), lin(ql, H))
            T.bf16(a("q_a_layernorm.weight"), norm(ql))
            T.bf16(a("q_b_proj.weight"), lin(mh * (nope + rope), ql))
            T.bf16(a("kv_a_proj_with_mqa.weight"), lin(kl + rope, H))
            T.bf16(a("kv_a_layernorm.weight"), norm(kl))
            T.bf16(a("kv_b_proj.weight"), lin(mh * (nope + vd), kl))
            T.bf16(a("g_proj.weight"), lin(mh * vd, H))
            T.bf16(a("o_proj.weight"), lin(H, mh * vd))
        if l < spec["first_dense"]:
            I = spec["dense_inter"]
            T.bf16(ln("mlp.gate_proj.weight"), lin(I, H))
            T.bf16(ln("mlp.up_proj.weight"), lin(I, H))
            T.bf16(ln("mlp.down_proj.weight"), lin(H, I))
        else:
            E, FI, LAT = spec["experts"], spec["expert_inter"], spec["latent"]
            m = lambda n: ln("block_sparse_moe." + n)
            T.bf16(m("gate.weight"), lin(E, H, 2.0))
            T.f32(m("gate.e_score_correction_bias"), 0.05 * rng.standard_normal(E))
            T.bf16(m("routed_expert_down_proj.weight"), lin(LAT, H))
            T.bf16(m("routed_expert_norm.weight"), norm(LAT))
            T.bf16(m("routed_expert_up_proj.weight"), lin(H, LAT))
            SI = spec["shared"] * FI
            T.bf16(m("shared_experts.gate_proj.weight"), lin(SI, H))
            T.bf16(m("shared_experts.up_proj.weight"), lin(SI, H))
            T.bf16(m("shared_experts.down_proj.weight"), lin(H, SI))
            for e in range(E):
                for proj, (rows, cols) in (("w1", (FI, LAT)), ("w3", (FI, LAT)), ("w2", (LAT, FI))):
                    base = m(f"experts.{e}.{proj}.")
                    T.u8(base + "weight_packed", rng.integers(0, 256, (rows, cols // 2)))
                    # rms(w) ~ 1/sqrt(cols): E2M1 codes have rms ~3.2.
                    centre = 127 - int(round(np.log2(3.2 * np.sqrt(cols))))
                    T.u8(base + "weight_scale", rng.integers(centre - 1, centre + 2, (rows, cols // 32)))
        for n in list(T.items)[start:]:
            layer_of[n] = l
    write_model(spec, out_dir, T, layer_of)


def config_json(spec):
    lac = {
        "kda_layers": spec["kda"], "full_attn_layers": spec["mla"], "num_heads": spec["kda_heads"],
        "head_dim": spec["kda_head_dim"], "short_conv_kernel_size": spec["conv"],
        "use_full_rank_gate": True, "gate_lower_bound": -5.0,
    }
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": spec["hidden"], "num_hidden_layers": spec["layers"], "vocab_size": spec["vocab"],
        "rms_norm_eps": 1e-5, "hidden_act": "situ", "intermediate_size": spec["dense_inter"],
        "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "attn_res_block_size": spec["block"],
        "linear_attn_config": lac,
        "num_attention_heads": spec["mla_heads"], "q_lora_rank": spec["q_lora"], "kv_lora_rank": spec["kv_lora"],
        "qk_nope_head_dim": spec["nope"], "qk_rope_head_dim": spec["rope"], "v_head_dim": spec["v"],
        "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": spec["experts"], "num_experts_per_token": spec["top_k"],
        "num_shared_experts": spec["shared"], "moe_intermediate_size": spec["expert_inter"],
        "routed_expert_hidden_size": spec["latent"], "latent_moe_use_norm": True, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0, "use_grouped_topk": False,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": spec["first_dense"], "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "bos_token_id": spec["vocab"] - 4, "eos_token_id": spec["vocab"] - 2, "pad_token_id": spec["vocab"] - 1,
    }
    quant = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "targets": ["re:.*block_sparse_moe\\.experts\\..*"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                        "strategy": "group", "scale_dtype": "torch.uint8"},
            "input_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"],
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text, "quantization_config": quant,
            "vision_config": {"model_type": "moonvit"}}


def write_model(spec, out_dir, T, layer_of):
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(out_dir, f))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(spec), f, indent=2)
    n = spec["shards"]
    if n == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), T.items)
        return
    # Layers are split into contiguous ranges; top-level tensors go to the first shard.
    L = spec["layers"]
    shard_of = lambda name: 0 if name not in layer_of else min(n - 1, layer_of[name] * n // L)
    weight_map, total = {}, 0
    for s in range(n):
        fn = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        items = {k: v for k, v in T.items.items() if shard_of(k) == s}
        write_safetensors(os.path.join(out_dir, fn), items)
        for k, v in items.items():
            weight_map[k] = fn
            total += len(v[2])
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def cross_check_with_safetensors(out_dir):
    """The files must open with the safetensors package (headers, offsets, sizes)."""
    try:
        from safetensors import safe_open
    except ImportError:
        print("  (safetensors package not installed: skipping cross-check)")
        return
    for fn in sorted(os.listdir(out_dir)):
        if fn.endswith(".safetensors") and fn != "reference.safetensors":
            with safe_open(os.path.join(out_dir, fn), framework="numpy") as f:
                for k in f.keys():
                    if f.get_slice(k).get_dtype() in ("U8", "F32"):
                        f.get_tensor(k)


def write_reference(out_dir, logits):
    arr = np.asarray(logits, dtype="<f4")
    write_safetensors(os.path.join(out_dir, "reference.safetensors"),
                      {"logits": ("F32", list(arr.shape), arr.tobytes())})


def build(name):
    spec = SPECS[name]
    out_dir = os.path.join(FIXTURES, name)
    for attempt in range(20):
        seed = spec["seed"] * 1000 + attempt
        make_checkpoint(spec, out_dir, seed)
        ref = Reference(out_dir)
        rng = np.random.default_rng(seed + 7)
        prompt = [int(x) for x in rng.integers(0, spec["vocab"], spec["prompt_len"])]
        logits = ref.logits(prompt)
        greedy, margins = ref.greedy(prompt, GREEDY_NEW)
        last_margin = float(np.diff(np.sort(logits[-1])[-2:])[0])
        if min(margins + [last_margin]) < MIN_MARGIN:
            print(f"  {name}: seed {seed} has a near-tie (margin {min(margins):.2e}); trying another")
            continue
        cross_check_with_safetensors(out_dir)
        write_reference(out_dir, logits)
        with open(os.path.join(out_dir, "reference.json"), "w") as f:
            json.dump({"seed": seed, "prompt_ids": prompt, "greedy_ids": greedy,
                       "greedy_margins": margins, "spec": spec}, f, indent=1)
        print(f"  {name}: seed {seed}, {len(prompt)} prompt tokens, min greedy margin {min(margins):.3f}")
        return
    raise SystemExit(f"{name}: no seed without near-ties")


def dspark_config(spec, target):
    tc = target.c
    return {
        "model_type": "k3_dspark", "architectures": ["K3DSparkModel"],
        "hidden_size": tc["hidden_size"], "intermediate_size": spec["inter"],
        "num_hidden_layers": spec["layers"], "num_attention_heads": spec["heads"],
        "q_lora_rank": spec["q_lora"], "kv_lora_rank": spec["kv_lora"], "qk_nope_head_dim": spec["nope"],
        "qk_rope_head_dim": spec["rope"], "v_head_dim": spec["v"], "mla_use_nope": False,
        "mla_use_output_gate": False, "rms_norm_eps": 1e-5, "vocab_size": tc["vocab_size"],
        "target_hidden_size": tc["hidden_size"], "target_layer_ids": spec["taps"],
        "num_target_layers": len(spec["taps"]), "mask_token_id": tc["vocab_size"] - 3,
        "markov_rank": spec["markov_rank"], "enable_confidence_head": True, "block_size": spec["block"],
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    }


def make_dspark(spec, out_dir, seed, target):
    rng = np.random.default_rng(seed)
    H, V = target.c["hidden_size"], target.c["vocab_size"]
    lin = lambda o, i, gain=1.0: rng.standard_normal((o, i)) * gain / np.sqrt(i)
    norm = lambda n: 1.0 + 0.1 * rng.standard_normal(n)
    T = Tensors()
    T.bf16("context_proj.weight", lin(H, H * len(spec["taps"])))
    T.bf16("context_norm.weight", norm(H))
    T.bf16("final_norm.weight", norm(H))
    T.bf16("markov_head.markov_w1.weight", rng.standard_normal((V, spec["markov_rank"])))
    T.bf16("markov_head.markov_w2.weight", lin(V, spec["markov_rank"], 2.0))
    T.bf16("confidence_head.proj.weight", lin(1, H + spec["markov_rank"]))
    T.bf16("confidence_head.proj.bias", rng.standard_normal(1))
    # The published checkpoint carries a copy of K3's embeddings, which runtimes do not read.
    T.bf16("embed_tokens.weight", target.w("embed_tokens.weight"))
    nh, nope, rope, vd, ql, kl, I = (spec[k] for k in ("heads", "nope", "rope", "v", "q_lora", "kv_lora", "inter"))
    for l in range(spec["layers"]):
        n = lambda x: f"layers.{l}.{x}"
        T.bf16(n("input_layernorm.weight"), norm(H))
        T.bf16(n("post_attention_layernorm.weight"), norm(H))
        T.bf16(n("self_attn.q_a_proj.weight"), lin(ql, H))
        T.bf16(n("self_attn.q_a_layernorm.weight"), norm(ql))
        T.bf16(n("self_attn.q_b_proj.weight"), lin(nh * (nope + rope), ql))
        T.bf16(n("self_attn.kv_a_proj_with_mqa.weight"), lin(kl + rope, H))
        T.bf16(n("self_attn.kv_a_layernorm.weight"), norm(kl))
        T.bf16(n("self_attn.kv_b_proj.weight"), lin(nh * (nope + vd), kl))
        T.bf16(n("self_attn.o_proj.weight"), lin(H, nh * vd))
        T.bf16(n("mlp.gate_proj.weight"), lin(I, H))
        T.bf16(n("mlp.up_proj.weight"), lin(I, H))
        T.bf16(n("mlp.down_proj.weight"), lin(H, I))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dspark_config(spec, target), f, indent=2)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), T.items)


def build_dspark(name):
    from dspark_reference import DSparkReference
    spec = DSPARK_SPECS[name]
    out_dir = os.path.join(FIXTURES, name)
    target_dir = os.path.join(FIXTURES, spec["target"])
    target = Reference(target_dir)
    with open(os.path.join(target_dir, "reference.json")) as f:
        prompt = json.load(f)["prompt_ids"]
    for attempt in range(20):
        seed = spec["seed"] * 1000 + attempt
        make_dspark(spec, out_dir, seed, target)
        ref = DSparkReference(out_dir, target)
        taps = ref.target_taps(prompt)
        cases, all_logits, worst = [], [], float("inf")
        for L in spec["cases"]:
            logits, drafts, margins = ref.block(ref.context(taps, 0, L), prompt[L], L)
            cases.append({"context_len": L, "anchor": prompt[L], "drafts": drafts, "margins": margins})
            all_logits.append(logits)
            worst = min(worst, min(margins))
        if worst < MIN_MARGIN:
            print(f"  {name}: seed {seed} has a near-tie (margin {worst:.2e}); trying another")
            continue
        cross_check_with_safetensors(out_dir)
        write_reference(out_dir, np.concatenate(all_logits, axis=0))
        with open(os.path.join(out_dir, "reference.json"), "w") as f:
            json.dump({"kind": "dspark", "seed": seed, "target": spec["target"], "prompt_ids": prompt,
                       "cases": cases, "spec": spec}, f, indent=1)
        print(f"  {name}: seed {seed}, {len(cases)} blocks, min draft margin {worst:.3f}")
        return
    raise SystemExit(f"{name}: no seed without near-ties")


if __name__ == "__main__":
    for n in (sys.argv[1:] or list(SPECS) + list(DSPARK_SPECS)):
        build_dspark(n) if n in DSPARK_SPECS else build(n)

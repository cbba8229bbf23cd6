"""Writes a trained K3Model as K3 ships its checkpoint, and reads such a checkpoint back.

Layout (../../shared/K3.md, "Checkpoint layout"): `config.json` with top level `model_type:
kimi_k3`, the language model under `text_config` and a compressed-tensors `quantization_config`;
safetensors shards named `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`;
tensor names prefixed `language_model.model.` (lm_head: `language_model.lm_head.weight`). Trunk
matrices and norms are bf16; the conv taps, `A_log`, `dt_bias` and `e_score_correction_bias` f32 as
K3 has them; routed experts `experts.E.{w1,w3,w2}.{weight_packed,weight_scale}` in MXFP4 from
`mxfp4.pack`, i.e. exactly the values the quantisation-aware forward pass used.

`load_model(dir)` builds a K3Model whose parameters hold the checkpoint's values (experts as their
dequantised MXFP4 values, which re-quantise to themselves), so the training code's own forward
pass runs on exactly the shipped bytes.
"""

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from . import mxfp4
from .model import K3Config, K3Model

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
F32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".e_score_correction_bias")


def config_json(c: K3Config):
    kda = [l + 1 for l in range(c.layers) if not c.is_mla(l)]
    mla = [l + 1 for l in range(c.layers) if c.is_mla(l)]
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {
            "model_type": "kimi_linear",
            "hidden_size": c.hidden, "num_hidden_layers": c.layers, "vocab_size": c.vocab,
            "rms_norm_eps": c.rms_eps, "hidden_act": "situ", "intermediate_size": c.dense_inter,
            "tie_word_embeddings": False, "max_position_embeddings": c.max_context,
            "activation_situ_beta": c.situ_beta, "activation_situ_linear_beta": c.situ_linear_beta,
            "attn_res_block_size": c.attn_res_block,
            "linear_attn_config": {
                "kda_layers": kda, "full_attn_layers": mla, "num_heads": c.kda_heads,
                "head_dim": c.kda_head_dim, "short_conv_kernel_size": c.conv_width,
                "use_full_rank_gate": True, "gate_lower_bound": c.gate_lower_bound,
            },
            "num_attention_heads": c.mla_heads, "q_lora_rank": c.q_lora, "kv_lora_rank": c.kv_lora,
            "qk_nope_head_dim": c.qk_nope, "qk_rope_head_dim": c.qk_rope, "v_head_dim": c.v_head,
            "mla_use_nope": True, "mla_use_output_gate": True,
            "num_experts": c.experts, "num_experts_per_token": c.top_k,
            "num_shared_experts": c.shared_experts, "moe_intermediate_size": c.expert_inter,
            "routed_expert_hidden_size": c.expert_latent, "latent_moe_use_norm": True,
            "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": c.routed_scaling,
            "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": c.dense_layers,
            "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
            "bos_token_id": c.bos, "eos_token_id": c.eos, "pad_token_id": c.pad,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["re:.*block_sparse_moe\\.experts\\..*"],
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                            "strategy": "group", "scale_dtype": "torch.uint8"},
                "input_activations": None,
            }},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"],
        },
    }


def config_from_json(cfg):
    t = cfg["text_config"]
    lac = t["linear_attn_config"]
    return K3Config(
        vocab=t["vocab_size"], hidden=t["hidden_size"], layers=t["num_hidden_layers"],
        attn_res_block=t["attn_res_block_size"], mla_layers=tuple(x - 1 for x in lac["full_attn_layers"]),
        rms_eps=t["rms_norm_eps"], situ_beta=t["activation_situ_beta"],
        situ_linear_beta=t.get("activation_situ_linear_beta", 0.0),
        kda_heads=lac["num_heads"], kda_head_dim=lac["head_dim"], conv_width=lac["short_conv_kernel_size"],
        gate_lower_bound=lac["gate_lower_bound"],
        mla_heads=t["num_attention_heads"], q_lora=t["q_lora_rank"], kv_lora=t["kv_lora_rank"],
        qk_nope=t["qk_nope_head_dim"], qk_rope=t["qk_rope_head_dim"], v_head=t["v_head_dim"],
        dense_layers=t["first_k_dense_replace"], dense_inter=t["intermediate_size"],
        experts=t["num_experts"], top_k=t["num_experts_per_token"], expert_inter=t["moe_intermediate_size"],
        expert_latent=t["routed_expert_hidden_size"], shared_experts=t["num_shared_experts"],
        routed_scaling=t.get("routed_scaling_factor", 1.0),
        bos=t["bos_token_id"], eos=t["eos_token_id"], pad=t["pad_token_id"],
        max_context=t["max_position_embeddings"],
    )


def _ckpt_name(name):
    """Checkpoint name of a K3Model state-dict entry (the stacked experts are written apart)."""
    if name == "lm_head":
        return LM_HEAD
    if name.endswith(".e_score_correction_bias"):
        return PREFIX + name.replace("block_sparse_moe.e_score", "block_sparse_moe.gate.e_score")
    if name.endswith((".A_log", ".dt_bias", ".weight")):
        return PREFIX + name
    # Norm weights, *_res_proj, embed_tokens and the conv taps are bare parameters.
    return PREFIX + name + ".weight"


def tensors(model: K3Model):
    """{checkpoint name: tensor} with the shipped dtypes."""
    out = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts.w" in name:
            continue
        ck = _ckpt_name(name)
        dt = torch.float32 if ck.endswith(F32_SUFFIXES) else torch.bfloat16
        out[ck] = p.detach().to("cpu", dt).contiguous()
    for l, layer in enumerate(model.layers):
        if not model.c.is_moe(l):
            continue
        ex = layer.block_sparse_moe.experts
        for e in range(model.c.experts):
            for proj in ("w1", "w3", "w2"):
                packed, scale = mxfp4.pack(getattr(ex, proj)[e].detach().float().cpu())
                base = f"{PREFIX}layers.{l}.block_sparse_moe.experts.{e}.{proj}."
                out[base + "weight_packed"] = packed
                out[base + "weight_scale"] = scale
    return out


def save(model: K3Model, out_dir, tokenizer_dir, shard_bytes=8 << 20, extra_files=None):
    """Writes the checkpoint into out_dir (created; must not exist or be empty)."""
    os.makedirs(out_dir, exist_ok=True)
    ts = tensors(model)
    # Shards: the trunk first, then each layer's experts contiguous (K3 keeps a layer's experts in
    # one run); a new shard when the current one would pass shard_bytes.
    names = sorted(ts, key=lambda n: (".experts." in n, _layer_of(n), _expert_key(n)))
    shards, cur, size = [], [], 0
    for n in names:
        b = ts[n].numel() * ts[n].element_size()
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    shards.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: ts[n] for n in group}, os.path.join(out_dir, fn), metadata={"format": "pt"})
        for n in group:
            weight_map[n] = fn
            total += ts[n].numel() * ts[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(model.c), f, indent=2)
    for fn in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja") if tokenizer_dir else ():
        shutil.copyfile(os.path.join(tokenizer_dir, fn), os.path.join(out_dir, fn))
    for fn, obj in (extra_files or {}).items():
        with open(os.path.join(out_dir, fn), "w") as f:
            json.dump(obj, f, indent=2)
    return total


def _layer_of(n):
    parts = n.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return -1


def _expert_key(n):
    parts = n.split(".")
    if "experts" in parts:
        i = parts.index("experts")
        return (int(parts[i + 1]), parts[i + 2], parts[i + 3])
    return (0, n, "")


def load_model(model_dir, device="cpu"):
    """A K3Model (float32 parameters) holding the checkpoint's exact values."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = config_from_json(json.load(f))
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    ts = {}
    for fn in files:
        ts.update(load_file(os.path.join(model_dir, fn)))
    alog = [t for n, t in ts.items() if n.endswith(".A_log")]
    if alog:
        c.kda_alog_len = alog[0].shape[0]
    model = K3Model(c)
    sd = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts.w" in name:
            continue
        t = ts[_ckpt_name(name)]
        if t.shape != p.shape:
            raise ValueError(f"{model_dir}: {_ckpt_name(name)} has shape {list(t.shape)}, expected {list(p.shape)}")
        sd[name] = t.float()
    for l, layer in enumerate(model.layers):
        if not c.is_moe(l):
            continue
        for proj in ("w1", "w3", "w2"):
            mats = []
            for e in range(c.experts):
                base = f"{PREFIX}layers.{l}.block_sparse_moe.experts.{e}.{proj}."
                mats.append(mxfp4.unpack(ts[base + "weight_packed"], ts[base + "weight_scale"]))
            sd[f"layers.{l}.block_sparse_moe.experts.{proj}"] = torch.stack(mats)
    model.load_state_dict(sd, strict=True)
    return model.to(device)

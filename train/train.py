#!/usr/bin/env python3
"""Trains deltafin's demo model (a small K3-architecture model) and its DSpark drafter.

    python3 train/train.py all --data train/data --tokenizer train/tokenizer/out --out OUT

Stages (each can run alone: `target`, `dspark`, `eval`):
  target  trains the K3 model (MXFP4 quantisation-aware routed experts, aux-loss-free expert
          balancing through e_score_correction_bias), writes OUT/kimi-k3-demo in K3's layout;
  eval    scores OUT/kimi-k3-demo on the held-out text exactly as `deltafin score --text` does
          (fp32, from the shipped bytes) and writes OUT/report.json;
  dspark  generates the model's own greedy continuations of training-text prompts, trains the
          drafter on them (blocks of anchor + masks over the target's tapped rows) and writes
          OUT/kimi-k3-demo-dspark.
Seeds are fixed; the step counts are arguments with the defaults that made the committed files.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

# Deterministic cuBLAS (must be set before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3 import export  # noqa: E402
from k3.dspark import DSpark, DSparkConfig  # noqa: E402
from k3.dspark import config_json as dspark_config_json  # noqa: E402
from k3.dspark import tensors as dspark_tensors  # noqa: E402
from k3.model import K3Config, K3Model  # noqa: E402

N_BASE = 4352          # 256 bytes + 4096 merges
VOCAB = N_BASE + 256   # plus K3's 256 reserved specials
BOS, EOS, END_OF_MSG, MASK, PAD = N_BASE + 0, N_BASE + 1, N_BASE + 2, N_BASE + 253, N_BASE + 255


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


TINY = False   # --tiny: a small configuration for smoke tests of the pipeline


def demo_config():
    if TINY:
        return K3Config(vocab=VOCAB, bos=BOS, eos=END_OF_MSG, pad=PAD, hidden=64, layers=5, attn_res_block=2,
                        mla_layers=(3, 4), kda_heads=2, kda_head_dim=32, mla_heads=2, q_lora=32, kv_lora=32,
                        qk_nope=16, qk_rope=8, v_head=16, dense_inter=96, experts=16, top_k=4, expert_inter=32,
                        expert_latent=64)
    return K3Config(vocab=VOCAB, bos=BOS, eos=END_OF_MSG, pad=PAD)


def tokens(path):
    return np.memmap(path, dtype="<u2", mode="r")


class Batches:
    """Random windows of T+1 tokens from a token stream, from a seeded generator."""

    def __init__(self, data, T, B, seed, device):
        self.data, self.T, self.B, self.device = data, T, B, device
        self.rng = np.random.default_rng(seed)

    def next(self):
        starts = self.rng.integers(0, len(self.data) - self.T - 1, size=self.B)
        x = np.stack([self.data[s:s + self.T + 1].astype(np.int64) for s in starts])
        x = torch.from_numpy(x).to(self.device, non_blocking=True)
        return x[:, :-1], x[:, 1:]


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n and "res_proj" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def update_bias(model, gamma):
    """Aux-loss-free balancing (DeepSeek-V3 / K3's noaux_tc): each expert's selection bias moves
    by gamma towards the mean load of the last batch."""
    for moe in model.moe_layers():
        load = moe.last_load.float()
        moe.e_score_correction_bias += gamma * torch.sign(load.mean() - load)


@torch.no_grad()
def quick_eval(model, data, T, B, n, device, dtype):
    model.eval()
    it = Batches(data, T, B, 1234, device)
    tot = 0.0
    for _ in range(n):
        x, y = it.next()
        logits = model(x, dtype=dtype)
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    model.train()
    return tot / n


def time_steps(a, c, train):
    """Seconds per training step of this configuration on this device (a throwaway model)."""
    torch.manual_seed(0)
    m = K3Model(c).to(a.device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=a.device == "cuda")
    it = Batches(train, a.seq, a.batch, 0, a.device)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for i in range(10):
        if i == 3:
            if a.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
        x, y = it.next()
        loss = F.cross_entropy(m(x, dtype=dtype).reshape(-1, c.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_bias(m, a.bias_rate)
    if a.device == "cuda":
        torch.cuda.synchronize()
    return (time.time() - t0) / 7


def train_target(a):
    dev = a.device
    c = demo_config()
    if a.steps == 0:
        per = time_steps(a, c, tokens(os.path.join(a.data, "train.bin")))
        n_train = len(tokens(os.path.join(a.data, "train.bin")))
        cap = int(a.max_epochs * n_train / (a.batch * a.seq))
        a.steps = max(100, min(int(a.budget_s / per), cap) // 50 * 50)
        log(f"{per:.3f} s per step: {a.steps} steps fit in {a.budget_s} s (rerun with --steps {a.steps})")
    torch.manual_seed(a.seed)
    model = K3Model(c).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters; {c}")
    train = tokens(os.path.join(a.data, "train.bin"))
    held = tokens(os.path.join(a.data, "heldout.bin"))
    log(f"train tokens {len(train):,}, held-out tokens {len(held):,}")
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    it = Batches(train, a.seq, a.batch, a.seed, dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    t0 = time.time()
    hist = []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        x, y = it.next()
        logits = model(x, dtype=dtype)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_bias(model, a.bias_rate)
        if step % a.log_every == 0 or step == a.steps - 1:
            loads = torch.stack([m.last_load.float() for m in model.moe_layers()])
            imb = (loads.max(1).values / loads.mean(1)).mean().item()
            el = time.time() - t0
            tok_s = (step + 1) * a.batch * a.seq / el
            rec = {"step": step, "loss": round(loss.item(), 4), "grad_norm": round(gn.item(), 3),
                   "max_load_over_mean": round(imb, 3), "elapsed_s": round(el, 1), "tok_s": round(tok_s)}
            if step % a.eval_every == 0 or step == a.steps - 1:
                rec["heldout_loss"] = round(quick_eval(model, held, a.seq, a.batch, 4, dev, dtype), 4)
            hist.append(rec)
            log(json.dumps(rec))
    out = os.path.join(a.out, "kimi-k3-demo")
    gen_cfg = {"do_sample": True, "temperature": a.demo_temperature, "top_p": a.demo_top_p,
               "bos_token_id": BOS, "eos_token_id": END_OF_MSG}
    total = export.save(model, out, a.tokenizer, extra_files={"generation_config.json": gen_cfg})
    log(f"wrote {out} ({total / 2**20:.2f} MiB of tensors)")
    with open(os.path.join(a.out, "train_target.json"), "w") as f:
        json.dump({"config": vars(c) | {"mla_layers": list(c.mla_layers)}, "args": vars(a), "parameters": n_params,
                   "history": hist, "seconds": time.time() - t0}, f, indent=1)


def score_ids(text_ids, W):
    """The windows of `deltafin score --text`: (inputs, targets) pairs covering tokens 1..N-1."""
    N = len(text_ids)
    out, s = [], 0
    while s < N - 1:
        e = min(s + W, N - 1)
        out.append((text_ids[s:e], text_ids[s + 1:e + 1]))
        s += W
    return out


@torch.no_grad()
def score_text(model, enc, text, W, device, batch=64):
    """(nll nats, predicted tokens) exactly as `deltafin score --text` defines them: fp32 logits,
    log-softmax in float64."""
    ids = [BOS] + enc.encode_ordinary(text)
    wins = score_ids(ids, W)
    nll, n = 0.0, 0
    for i in range(0, len(wins), batch):
        group = wins[i:i + batch]
        for L in sorted(set(len(w[0]) for w in group)):
            same = [w for w in group if len(w[0]) == L]
            x = torch.tensor([w[0] for w in same], device=device)
            y = torch.tensor([w[1] for w in same], device=device)
            logits = model(x, dtype=torch.float32).double()
            lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])
            nll -= lp.sum().item()
            n += y.numel()
    return nll, n


def tokenizer(tok_dir):
    import base64

    import tiktoken

    ranks = {}
    with open(os.path.join(tok_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                t, r = line.split()
                ranks[base64.b64decode(t)] = int(r)
    pat = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3", "pattern.txt")).read().strip()
    return tiktoken.Encoding("k3-demo", pat_str=pat, mergeable_ranks=ranks, special_tokens={})


def run_eval(a):
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = export.load_model(os.path.join(a.out, "kimi-k3-demo"), a.device).eval()
    enc = tokenizer(a.tokenizer)
    text = open(os.path.join(a.data, "heldout.txt"), encoding="utf-8").read()
    if a.eval_chars:
        text = text[: a.eval_chars]
    t0 = time.time()
    nll, n = score_text(model, enc, text, a.window, a.device)
    nbytes = len(text.encode("utf-8"))
    rep = {"heldout_file": "heldout.txt", "chars": len(text), "bytes": nbytes, "window": a.window, "tokens": n,
           "ppl": math.exp(nll / n), "bits_per_byte": nll / math.log(2) / nbytes, "nll": nll,
           "seconds": round(time.time() - t0, 1)}
    log("held-out:", json.dumps(rep))
    path = os.path.join(a.out, "report.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    old["heldout"] = rep
    json.dump(old, open(path, "w"), indent=1)


@torch.no_grad()
def greedy_continue(model, prompts, n_new, dtype):
    """Greedy continuations by full recomputation (no cache: simple, and cheap at this size)."""
    x = prompts
    for _ in range(n_new):
        nxt = model(x, dtype=dtype)[:, -1].argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], 1)
    return x


def dspark_config():
    if TINY:
        return DSparkConfig(vocab=VOCAB, mask_token=MASK, hidden=64, intermediate=96, layers=1, heads=2, q_lora=32,
                            kv_lora=32, nope=16, rope=8, v_head=16, target_layers=(1, 4), markov_rank=8)
    return DSparkConfig(vocab=VOCAB, mask_token=MASK)


def train_dspark(a):
    torch.manual_seed(a.seed + 1)
    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = export.load_model(os.path.join(a.out, "kimi-k3-demo"), dev).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train = tokens(os.path.join(a.data, "train.bin"))
    c = dspark_config()
    # 1. The target's own greedy continuations of training-text prompts.
    t0 = time.time()
    rng = np.random.default_rng(a.seed + 2)
    seqs = []
    for i in range(0, a.draft_seqs, a.gen_batch):
        nb = min(a.gen_batch, a.draft_seqs - i)
        starts = rng.integers(0, len(train) - a.prompt_len, size=nb)
        p = torch.from_numpy(np.stack([train[s:s + a.prompt_len].astype(np.int64) for s in starts])).to(dev)
        seqs.append(greedy_continue(target, p, a.draft_len - a.prompt_len, dtype).cpu())
        log(f"dspark data: {i + nb}/{a.draft_seqs} sequences ({time.time() - t0:.0f} s)")
    seqs = torch.cat(seqs)
    n_val = max(1, min(a.draft_seqs // 32, len(seqs) - 1))
    val, seqs = seqs[:n_val], seqs[n_val:]
    # 2. The drafter.
    model = DSpark(c, len(c.target_layers) * target.c.hidden).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"dspark: {n_params / 1e6:.2f} M parameters; {c}")
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.draft_lr, betas=(0.9, 0.95), fused=dev == "cuda")
    R = c.block
    row_w = torch.exp(-torch.arange(R, dtype=torch.float32, device=dev) / a.row_decay)
    row_w = row_w / row_w.sum()
    lo, hi = a.prompt_len - 1, a.draft_len - R - 1   # anchors whose R targets all lie inside

    def batch_loss(ids, gen):
        with torch.no_grad():
            _, taps = target(ids, taps=set(c.target_layers), dtype=dtype)
            x = torch.cat([taps[l] for l in c.target_layers], -1).float()
        K = a.blocks_per_seq
        anchors = torch.from_numpy(gen.integers(lo, hi + 1, size=(ids.shape[0], K))).to(dev)
        logits = model.block_logits(x, ids, anchors, target.embed_tokens, target.lm_head)
        tgt = torch.gather(ids, 1, (anchors[:, :, None] + 1 + torch.arange(R, device=dev)).reshape(ids.shape[0], -1))
        tgt = tgt.reshape(ids.shape[0], K, R)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="none")
        ce = ce.reshape(ids.shape[0], K, R)
        correct = logits.argmax(-1) == tgt
        # Accepted drafts of a block: the run of correct rows from the first.
        accepted = torch.cumprod(correct.int(), -1).sum(-1).float()
        return (ce * row_w).sum(-1).mean(), accepted.mean().item(), correct.float().mean().item()

    gen = np.random.default_rng(a.seed + 3)
    hist = []
    t1 = time.time()
    for step in range(a.draft_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.draft_steps, a.draft_lr, a.warmup // 2)
        idx = torch.from_numpy(gen.integers(0, len(seqs), size=a.draft_batch))
        loss, acc_len, row_acc = batch_loss(seqs[idx].to(dev), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.log_every == 0 or step == a.draft_steps - 1:
            rec = {"step": step, "loss": round(loss.item(), 4), "accepted_per_block": round(acc_len, 3),
                   "row_accuracy": round(row_acc, 4), "elapsed_s": round(time.time() - t1, 1)}
            if step % a.eval_every == 0 or step == a.draft_steps - 1:
                with torch.no_grad():
                    _, vacc, vrow = batch_loss(val.to(dev), np.random.default_rng(7))
                rec["val_accepted_per_block"], rec["val_row_accuracy"] = round(vacc, 3), round(vrow, 4)
            hist.append(rec)
            log(json.dumps(rec))
    out = os.path.join(a.out, "kimi-k3-demo-dspark")
    os.makedirs(out, exist_ok=True)
    from safetensors.torch import save_file
    save_file(dspark_tensors(model), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dspark_config_json(c, target.c.hidden), f, indent=2)
    with open(os.path.join(a.out, "train_dspark.json"), "w") as f:
        json.dump({"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(c).items()},
                   "args": vars(a), "parameters": n_params, "history": hist,
                   "generation_seconds": t1 - t0, "seconds": time.time() - t0}, f, indent=1)
    log(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["all", "target", "eval", "dspark"])
    p.add_argument("--data", default="train/data", help="directory with train.bin, heldout.bin, heldout.txt")
    p.add_argument("--tokenizer", default="train/tokenizer/out", help="tiktoken.model, tokenizer_config.json, chat_template.jinja")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=20261203)
    p.add_argument("--steps", type=int, default=650, help="training steps (0: as many as fit in --budget-s)")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--max-epochs", type=float, default=8.0, help="with --steps 0: at most this many passes over the data")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-chars", type=int, default=0, help="score only the first N characters (smoke tests)")
    p.add_argument("--window", type=int, default=512, help="score window (deltafin score --window)")
    p.add_argument("--demo-temperature", type=float, default=0.8)
    p.add_argument("--demo-top-p", type=float, default=0.95)
    p.add_argument("--draft-seqs", type=int, default=3072)
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--draft-len", type=int, default=160)
    p.add_argument("--draft-steps", type=int, default=1500)
    p.add_argument("--draft-batch", type=int, default=48)
    p.add_argument("--blocks-per-seq", type=int, default=16)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--row-decay", type=float, default=4.0)
    p.add_argument("--tiny", action="store_true", help="a small configuration, for smoke tests of the pipeline")
    a = p.parse_args()
    global TINY
    TINY = a.tiny
    os.makedirs(a.out, exist_ok=True)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # Reproducible runs: deterministic kernels where PyTorch has them (it warns where it has not).
    torch.use_deterministic_algorithms(True, warn_only=True)
    if a.stage in ("all", "target"):
        train_target(a)
    if a.stage in ("all", "eval"):
        run_eval(a)
    if a.stage in ("all", "dspark"):
        train_dspark(a)


if __name__ == "__main__":
    main()

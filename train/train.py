#!/usr/bin/env python3
"""Trains deltafin's demo model (a small K3-architecture model) and its DSpark drafter.

    python3 train/train.py all --out OUT --time-budget-s 420 --draft-time-budget-s 150

Stages (`all` runs the first three; each can run alone):
  target  trains the K3 model (MXFP4 quantisation-aware routed experts, aux-loss-free expert
          balancing through e_score_correction_bias) for a step count or a wall-clock budget
          (WSD learning rate over that budget, k3/schedule.py), scoring held-out windows at
          regular points (the curve goes into OUT/train_target.json), and writes
          OUT/kimi-k3-demo in K3's layout;
  eval    scores OUT/kimi-k3-demo on the held-out text exactly as `deltafin score --text` does
          (fp32, from the shipped bytes) and writes OUT/report.json;
  chat    tunes OUT/kimi-k3-demo on conversations in K3's chat template built from the training
          documents (k3/chat.py: questions answered from a passage, follow-ups, tool calls with
          typed arguments and their results, JSON answers), the loss on the assistant's turns,
          mixed with training-text windows so the held-out perplexity holds; writes it back
          (OUT/train_chat.json) and scores it as `eval` does;
  dspark  trains the drafter as DSpark and EAGLE drafters are trained: on the target's own rows
          (the taps) and the target's own next-token distributions (KL distillation), over
          training text and over the target's continuations of training-text prompts (sampled
          at temperatures 0.7-1.0, a quarter greedy); validates on the target's continuations of
          held-out documents, greedy and at temperature 0.7, with deltafin's accept rule
          (k3/gen.py); writes OUT/kimi-k3-demo-dspark and OUT/train_dspark.json;
  dspark-eval  the same held-out acceptance for an existing drafter (--draft-model), or its
          acceptance on deltafin's own outputs (--sequences, from bench/drafts.py
          --sequences-out), to hold against deltafin's counts on the same runs.
Seeds are fixed. A budget run records the steps it reached and where its decay began; rerunning
with `--steps N --decay-start D` (and `--draft-steps` likewise) repeats its schedule by steps.
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
from k3 import model as k3_model  # noqa: E402
from k3.gen import acceptance_report, block_acceptance, generate, repeated_4gram_share  # noqa: E402
from k3.model import K3Config, K3Model  # noqa: E402
from k3 import chat as k3_chat  # noqa: E402
from k3.schedule import Schedule  # noqa: E402

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


class Windows:
    """Windows of T+1 tokens from a token stream, in passes: each pass cuts the stream at a random
    offset into consecutive windows (T apart) and takes them in a random order, so every token is
    seen once a pass; from a seeded generator."""

    def __init__(self, data, T, B, seed, device):
        self.data, self.T, self.B, self.device = data, T, B, device
        self.rng = np.random.default_rng(seed)
        self.order, self.pos, self.passes = np.empty(0, dtype=np.int64), 0, 0

    def _refill(self):
        off = int(self.rng.integers(0, self.T))
        starts = np.arange(off, len(self.data) - self.T - 1, self.T)
        self.order = np.concatenate([self.order[self.pos:], self.rng.permutation(starts)])
        self.pos = 0
        self.passes += 1

    def next(self):
        if self.pos + self.B > len(self.order):
            self._refill()
        starts = self.order[self.pos:self.pos + self.B]
        self.pos += self.B
        x = np.stack([self.data[s:s + self.T + 1].astype(np.int64) for s in starts])
        x = torch.from_numpy(x).to(self.device, non_blocking=True)
        return x[:, :-1], x[:, 1:]


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


def heldout_windows(data, T, n):
    """n fixed windows of T+1 tokens spread evenly over the held-out stream (the curve's points
    are all scored on the same tokens)."""
    starts = np.linspace(0, len(data) - T - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([data[s:s + T + 1].astype(np.int64) for s in starts]))


@torch.no_grad()
def heldout_loss(model, windows, B, device, dtype):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), B):
        x = windows[i:i + B].to(device)
        logits = model(x[:, :-1], dtype=dtype)
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def train_target(a):
    dev = a.device
    c = demo_config()
    torch.manual_seed(a.seed)
    model = K3Model(c).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters; {c}")
    train = tokens(os.path.join(a.data, "train.bin"))
    held = tokens(os.path.join(a.data, "heldout.bin"))
    log(f"train tokens {len(train):,}, held-out tokens {len(held):,}; batch {a.batch} x {a.seq}")
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    it = Windows(train, a.seq, a.batch, a.seed, dev)
    hw = heldout_windows(held, a.seq, a.eval_windows)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    sched = Schedule(a.lr, a.warmup, decay=a.decay, floor=a.lr_floor, steps=a.steps, budget_s=a.time_budget_s,
                     decay_start=a.decay_start, max_steps=int(a.max_passes * len(train) / (a.batch * a.seq)))
    if a.compile:
        k3_model.compile_pointwise()
    hist, curve = [], []
    next_eval_t, flat = 0.0, 0
    sync(dev)
    t0 = time.time()
    step = 0
    while True:
        el = time.time() - t0
        lr, done = sched.at(step, el)
        if done or (a.steps and step >= a.steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = it.next()
        try:
            loss, gn = train_step(model, opt, x, y, dtype)
        except torch.cuda.OutOfMemoryError:
            # Only the first steps can run out (the memory a step needs does not grow): halve the
            # batch and go on; the record says so.
            if step > 2 or a.batch <= 8:
                raise
            opt.zero_grad(set_to_none=True)
            del x, y
            torch.cuda.empty_cache()
            a.batch //= 2
            sched.max_steps *= 2
            it = Windows(train, a.seq, a.batch, a.seed, dev)
            log(f"out of GPU memory: batch halved to {a.batch}")
            continue
        update_bias(model, a.bias_rate)
        step += 1
        if a.time_budget_s:
            want_eval = el >= next_eval_t or sched.decay_start == step - 1
        else:
            want_eval = (step - 1) % a.eval_every == 0
        if (step - 1) % a.log_every == 0 or want_eval:
            loads = torch.stack([m.last_load.float() for m in model.moe_layers()])
            imb = (loads.max(1).values / loads.mean(1)).mean().item()
            sync(dev)
            el = time.time() - t0
            rec = {"step": step, "lr": round(lr, 6), "loss": round(loss.item(), 4), "grad_norm": round(gn.item(), 3),
                   "max_load_over_mean": round(imb, 3), "elapsed_s": round(el, 1),
                   "tok_s": round(step * a.batch * a.seq / max(el, 1e-9)), "passes": it.passes}
            if want_eval:
                rec["heldout_loss"] = round(heldout_loss(model, hw, a.batch, dev, dtype), 4)
                best = min((p["heldout_loss"] for p in curve if p["step"] > a.warmup), default=None)
                curve.append({k: rec[k] for k in ("step", "elapsed_s", "lr", "heldout_loss")} | {"tokens": step * a.batch * a.seq})
                next_eval_t = el + (a.time_budget_s / a.curve_points if a.time_budget_s else 0)
                # Flattened in the stable phase (two curve points in a row less than --plateau nats
                # better than the best before them; one could be the noise of a high LR): begin the
                # decay now.
                flat = flat + 1 if best is not None and rec["heldout_loss"] > best - a.plateau else 0
                if flat >= 2 and sched.start_decay(step, el):
                    rec["decay_begins"] = "held-out loss flattened"
            hist.append(rec)
            log(json.dumps(rec))
    sync(dev)
    train_s = time.time() - t0
    final = round(heldout_loss(model, hw, a.batch, dev, dtype), 4)
    curve.append({"step": step, "elapsed_s": round(train_s, 1), "lr": round(lr, 6), "heldout_loss": final,
                  "tokens": step * a.batch * a.seq})
    log(f"trained {step} steps ({step * a.batch * a.seq / 1e6:.1f} M tokens, {it.passes} passes begun) in "
        f"{train_s:.0f} s; held-out loss {final} (rerun: {sched.record(step)['rerun']})")
    out = os.path.join(a.out, "kimi-k3-demo")
    gen_cfg = {"do_sample": True, "temperature": a.demo_temperature, "top_p": a.demo_top_p,
               "bos_token_id": BOS, "eos_token_id": END_OF_MSG, "chat_template_kwargs": {"thinking": False}}
    total = export.save(model, out, a.tokenizer, extra_files={"generation_config.json": gen_cfg})
    log(f"wrote {out} ({total / 2**20:.2f} MiB of tensors)")
    with open(os.path.join(a.out, "train_target.json"), "w") as f:
        json.dump({"config": vars(c) | {"mla_layers": list(c.mla_layers)}, "args": vars(a), "parameters": n_params,
                   "schedule": sched.record(step), "heldout_curve": curve,
                   "heldout_curve_windows": f"{a.eval_windows} windows of {a.seq} tokens spread over heldout.bin",
                   "history": hist, "train_seconds": round(train_s, 1), "tokens": step * a.batch * a.seq,
                   "passes": step * a.batch * a.seq / len(train), "device": device_name(dev),
                   "torch": torch.__version__}, f, indent=1)


def train_docs(data_dir):
    """The training documents (train.jsonl, or train.jsonl.gz as the device tool carries it)."""
    import gzip

    path = os.path.join(data_dir, "train.jsonl")
    f = open(path, encoding="utf-8") if os.path.exists(path) else gzip.open(path + ".gz", "rt", encoding="utf-8")
    with f:
        return [json.loads(line) for line in f if line.strip()]


def chat_rows(a, enc, T):
    """The chat tuning rows: conversations from the training documents, each its own row of T+1
    ids (cut at T+1, padded with PAD), with the loss mask of its assistant turns."""
    convs = k3_chat.build(train_docs(a.data), a.chat_convs, a.seed + 11)
    ids = np.full((len(convs), T + 1), PAD, dtype=np.int64)
    mask = np.zeros((len(convs), T + 1), dtype=bool)
    kept, cut = 0, 0
    for c in convs:
        x, m = k3_chat.encode(k3_chat.render(c), enc, N_BASE)
        if len(x) > T + 1:
            cut += 1
            continue
        ids[kept, :len(x)] = x
        mask[kept, :len(x)] = m
        kept += 1
    lengths = [int((r != PAD).sum()) for r in ids[:kept]]
    log(f"chat data: {kept} conversations ({cut} longer than {T + 1} tokens left out), median "
        f"{int(np.median(lengths))} tokens, {int(mask[:kept].sum()):,} trained tokens")
    return torch.from_numpy(ids[:kept]), torch.from_numpy(mask[:kept]), convs


def train_chat(a):
    """Chat tuning of the exported target (see the module docstring's `chat` stage)."""
    dev = a.device
    torch.manual_seed(a.seed + 7)
    model = export.load_model(os.path.join(a.out, "kimi-k3-demo"), dev)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    enc = tokenizer(a.tokenizer)
    T = a.seq
    rows, masks, _ = chat_rows(a, enc, T)
    train = tokens(os.path.join(a.data, "train.bin"))
    held = tokens(os.path.join(a.data, "heldout.bin"))
    hw = heldout_windows(held, T, a.eval_windows)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    n_text = int(round(a.batch * a.chat_text_share))
    n_chat = a.batch - n_text
    text = Windows(train, T, max(1, n_text), a.seed + 13, dev)
    rng = np.random.default_rng(a.seed + 17)
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.chat_lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    sched = Schedule(a.chat_lr, a.warmup // 4, decay=a.decay, floor=a.lr_floor, steps=a.chat_steps,
                     budget_s=a.chat_time_budget_s)
    before = round(heldout_loss(model, hw, a.batch, dev, dtype), 4)
    log(f"chat tuning: {n_chat} conversations + {n_text} text windows a step; held-out loss before {before}")
    hist, step = [], 0
    sync(dev)
    t0 = time.time()
    while True:
        el = time.time() - t0
        lr, done = sched.at(step, el)
        if done or (a.chat_steps and step >= a.chat_steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.from_numpy(rng.integers(0, len(rows), size=n_chat))
        cx, cm = rows[pick], masks[pick]
        # Only as long as the longest conversation picked (rounded up to 64): no step pays for
        # padding past it.
        L = min(T, -(-int((cx != PAD).sum(1).max()) // 64) * 64)
        cx, cm = cx[:, :L + 1].to(dev), cm[:, :L + 1].to(dev)
        x, y = cx[:, :-1], cx[:, 1:].masked_fill(~cm[:, 1:], -100)
        if n_text:
            tx, ty = text.next()
            x, y = torch.cat([x, tx[:, :L]]), torch.cat([y, ty[:, :L]])
        logits = model(x, dtype=dtype)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_bias(model, a.bias_rate)
        step += 1
        if (step - 1) % a.log_every == 0:
            sync(dev)
            rec = {"step": step, "lr": round(lr, 6), "loss": round(loss.item(), 4), "grad_norm": round(gn.item(), 3),
                   "elapsed_s": round(time.time() - t0, 1)}
            hist.append(rec)
            log(json.dumps(rec))
    sync(dev)
    train_s = time.time() - t0
    model.eval()
    after = round(heldout_loss(model, hw, a.batch, dev, dtype), 4)
    log(f"chat tuning: {step} steps in {train_s:.0f} s; held-out loss {before} -> {after}")
    out = os.path.join(a.out, "kimi-k3-demo")
    gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
    total = export.save(model, out, a.tokenizer, extra_files={"generation_config.json": gen_cfg})
    log(f"wrote {out} ({total / 2**20:.2f} MiB of tensors)")
    with open(os.path.join(a.out, "train_chat.json"), "w") as f:
        json.dump({"args": vars(a), "steps": step, "train_seconds": round(train_s, 1), "conversations": len(rows),
                   "heldout_loss_before": before, "heldout_loss_after": after, "schedule": sched.record(step),
                   "history": hist, "device": device_name(dev), "torch": torch.__version__}, f, indent=1)


def chat_prompts(a, enc, n, P, rng):
    """n prompts of P tokens ending where an assistant turn of a chat conversation begins (the
    last P tokens of the rendered conversation up to that turn's generation prompt)."""
    out = []
    for c in k3_chat.build(train_docs(a.data), 3 * n, a.seed + 23):
        turns = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
        t = turns[int(rng.integers(0, len(turns)))]
        x, _ = k3_chat.encode([(k3_chat.render(c, upto=t), False)], enc, N_BASE)
        if len(x) >= P:
            out.append(np.asarray(x[-P:], dtype=np.int64))
        if len(out) == n:
            break
    return np.stack(out)


def train_step(model, opt, x, y, dtype):
    logits = model(x, dtype=dtype)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach(), gn.detach()


def device_name(dev):
    return torch.cuda.get_device_name() if dev == "cuda" else "cpu"


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


def dspark_config():
    if TINY:
        return DSparkConfig(vocab=VOCAB, mask_token=MASK, hidden=64, intermediate=96, layers=1, heads=2, q_lora=32,
                            kv_lora=32, nope=16, rope=8, v_head=16, target_layers=(1, 4), markov_rank=8)
    return DSparkConfig(vocab=VOCAB, mask_token=MASK)


def heldout_docs(data_dir):
    """The held-out documents as token arrays (heldout.bin split at BOS), with their sources when
    heldout.jsonl is there."""
    held = np.asarray(tokens(os.path.join(data_dir, "heldout.bin")))
    cuts = np.flatnonzero(held == BOS).tolist() + [len(held)]
    docs = [held[s:e] for s, e in zip(cuts, cuts[1:])]
    src = ["?"] * len(docs)
    jl = os.path.join(data_dir, "heldout.jsonl")
    if os.path.exists(jl):
        src = [json.loads(line)["source"] for line in open(jl, encoding="utf-8") if line.strip()]
    return docs, src


def val_prompts(docs, sources, n, P, n_new):
    """About n prompts of P tokens from the held-out documents: from every document long enough,
    windows at evenly spaced starts (none inside the first token, each with room for n_new)."""
    per = max(1, -(-n // len(docs)))
    out, src = [], []
    for d, s in zip(docs, sources):
        room = len(d) - P - n_new - 1
        if room < 1:
            continue
        for st in np.linspace(1, room, per).astype(np.int64):
            out.append(d[st:st + P].astype(np.int64))
            src.append(s)
    return torch.from_numpy(np.stack(out)), src


def exact(on):
    """fp32 matrix products without TF32 (on) for what is compared with deltafin, TF32 (off) for
    training."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = not on
        torch.backends.cudnn.allow_tf32 = not on


def kl_block_loss(drafter, target, ids, anchors, taps, dtype, row_w):
    """KL(target || drafter) per block row, weighted by row_w, over the blocks at `anchors` of
    sequences `ids`: the drafter reads the target's tapped rows; row r of the block at L is
    labelled with the target's distribution for position L + r + 1."""
    R = drafter.c.block
    with torch.no_grad():
        logits_t, t = target(ids, taps=set(taps), dtype=dtype)
        x = torch.cat([t[l] for l in taps], -1).float()
        pos = (anchors[:, :, None] + torch.arange(R, device=ids.device)).reshape(len(ids), -1)
        lt = torch.gather(logits_t, 1, pos[..., None].expand(-1, -1, logits_t.shape[-1])).float()
        logp = torch.log_softmax(lt, -1).reshape(len(ids), -1, R, lt.shape[-1])
    logits = drafter.block_logits(x, ids, anchors, target.embed_tokens, target.lm_head).float()
    logq = torch.log_softmax(logits, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)                       # [B, K, R]
    agree = (logits.argmax(-1) == logp.argmax(-1)).float()
    accepted = torch.cumprod(agree, -1).sum(-1)
    return (kl * row_w).sum(-1).mean(), accepted.mean().item(), agree.mean().item()


MODES = (("greedy", 0.0), ("t0.7", 0.7))


class ValSet:
    """Held-out prompts and the target's continuations of them (greedy and at 0.7, fp32 without
    TF32: the tokens deltafin computes), val_new tokens each plus a block's worth more so that
    every one of the val_new positions anchors a full block. Prompts may differ in length."""

    def __init__(self, prompts, sources, target, a, dev, given=None):
        """`given`: {mode: [full sequences]} already made (deltafin's own outputs), instead of
        generating them."""
        self.target, self.sources, self.n_new = target, sources, a.val_new
        self.R = dspark_config().block
        self.seqs = {}
        self.plen = [len(p) for p in prompts]
        if given is not None:
            self.seqs = {k: [torch.as_tensor(s).to(dev) for s in v] for k, v in given.items()}
            self.rep = {k: torch.tensor([repeated_4gram_share(s[len(p):len(p) + a.val_new].tolist())
                                         for s, p in zip(v, prompts)]) for k, v in self.seqs.items()}
            return
        exact(True)
        by_len = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for name, t in MODES:
            g = torch.Generator(device=dev).manual_seed(a.seed + 4)
            seqs = [None] * len(prompts)
            for L, idx in sorted(by_len.items()):
                for j in range(0, len(idx), 256):
                    part = idx[j:j + 256]
                    x = torch.stack([torch.as_tensor(prompts[i]) for i in part]).to(dev)
                    out = generate(target, x, a.val_new + self.R, torch.full((len(part),), t), torch.float32, g)
                    for i, row in zip(part, out):
                        seqs[i] = row
            self.seqs[name] = seqs
        exact(False)
        self.rep = {k: torch.tensor([repeated_4gram_share(s[len(p):len(p) + a.val_new].tolist())
                                     for s, p in zip(v, prompts)]) for k, v in self.seqs.items()}

    def acceptance(self, drafter, taps, full=False):
        exact(True)
        out = {}
        for k, seqs in self.seqs.items():
            corr = [None] * len(seqs)
            by_len = {}
            for i, L in enumerate(self.plen):
                by_len.setdefault(L, []).append(i)
            soft = [None] * len(seqs)
            temp = 0.0 if k == "greedy" else float(k[1:])
            for L, idx in by_len.items():
                c, sf = block_acceptance(drafter, self.target, torch.stack([seqs[i] for i in idx]), L, taps,
                                         torch.float32, temperature=temp)
                for j, i in enumerate(idx):
                    corr[i] = c[j]
                    soft[i] = sf[j] if sf is not None else None
            corr = torch.stack(corr)
            soft = torch.stack(soft) if temp > 0 else None
            clean = self.rep[k] < 0.2
            out[k] = {"all": acceptance_report(corr, soft=soft), "no_loops": acceptance_report(corr, clean, soft)}
            if full:
                out[k]["by_source"] = {s: acceptance_report(corr, torch.tensor([x == s for x in self.sources]) & clean, soft)
                                       for s in sorted(set(self.sources))}
                out[k]["repeated_4gram_share"] = [round(x, 3) for x in self.rep[k].tolist()]
        exact(False)
        return out


def eval_dspark(a):
    """Held-out acceptance of an existing drafter (--draft-model), as the dspark stage reports it
    for the one it trains; with --sequences, on deltafin's own drafts-off outputs instead (the
    tokens deltafin emitted, so the counts can be held against deltafin's on the same runs)."""
    from k3.dspark import load as load_dspark

    dev = a.device
    target = export.load_model(os.path.join(a.out, "kimi-k3-demo") if not a.target else a.target, dev).eval()
    drafter = load_dspark(a.draft_model, dev).eval()
    taps = tuple(drafter.c.target_layers)
    rep = {"draft_model": a.draft_model, "target": a.target or os.path.join(a.out, "kimi-k3-demo")}
    if a.sequences:
        # deltafin's own drafts-off outputs (bench/drafts.py --sequences-out): the acceptance of
        # exactly the tokens deltafin emitted, to hold against its counts on the same runs.
        recs = [json.loads(x) for x in open(a.sequences, encoding="utf-8") if x.strip()]
        modes = {}
        for r in recs:
            modes.setdefault("greedy" if r["temperature"] == 0 else f"t{r['temperature']:g}", []).append(r)
        rep["sequences"] = {"file": a.sequences}
        for k, rs in modes.items():
            a.val_new = rs[0]["decode"]
            ps = [torch.tensor(r["prompt_ids"]) for r in rs]
            vs = ValSet(ps, [r["source"] for r in rs], target, a, dev,
                        given={k: [r["prompt_ids"] + r["output_ids"] for r in rs]})
            rep["sequences"].update(vs.acceptance(drafter, taps, full=True))
    else:
        docs, sources = heldout_docs(a.data)
        vp, vsrc = val_prompts(docs, sources, a.val_prompts, a.prompt_len, a.val_new)
        rep["heldout_prompts"] = ValSet(list(vp), vsrc, target, a, dev).acceptance(drafter, taps, full=True)
    path = a.eval_out or os.path.join(a.out, "eval_dspark.json")
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    for k in ("heldout_prompts", "sequences"):
        if k in rep:
            for m, x in rep[k].items():
                if isinstance(x, dict) and "all" in x:
                    log(k, m, json.dumps({q: x[q].get("policy_acceptance") for q in ("all", "no_loops")}),
                        "chain", json.dumps({q: x[q].get("chain_acceptance") for q in ("all", "no_loops")}))
    log(f"wrote {path}")


def train_dspark(a):
    torch.manual_seed(a.seed + 1)
    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    t0 = time.time()
    target = export.load_model(os.path.join(a.out, "kimi-k3-demo"), dev).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train = tokens(os.path.join(a.data, "train.bin"))
    c = dspark_config()
    taps = tuple(c.target_layers)
    R = c.block
    gen = torch.Generator(device=dev).manual_seed(a.seed + 2)
    rng = np.random.default_rng(a.seed + 3)
    S = a.prompt_len + a.gen_new
    # 1. The target's own continuations of training-text prompts, at temperatures cycling through
    #    --gen-temps (0 = greedy); generated a batch at a time through the model's cache.
    temps_all = [float(x) for x in a.gen_temps.split(",")]
    seqs, seq_t = [], []
    chat_p = None
    if a.gen_chat_share > 0:
        chat_p = chat_prompts(a, tokenizer(a.tokenizer), int(a.gen_seqs * a.gen_chat_share) + 1, a.prompt_len, rng)
        log(f"dspark data: {len(chat_p)} chat prompts")
    ci = 0
    for i in range(0, a.gen_seqs, a.gen_batch):
        nb = min(a.gen_batch, a.gen_seqs - i)
        starts = rng.integers(0, len(train) - a.prompt_len, size=nb)
        p = np.stack([train[s:s + a.prompt_len].astype(np.int64) for s in starts])
        # A share of the prompts are chat turns about to be answered (the demo's chats draft too).
        if chat_p is not None:
            k = min(len(chat_p) - ci, int(round(nb * a.gen_chat_share)))
            p[:k] = chat_p[ci:ci + k]
            ci += k
        p = torch.from_numpy(p).to(dev)
        temps = torch.tensor([temps_all[(i + j) % len(temps_all)] for j in range(nb)])
        seqs.append(generate(target, p, a.gen_new, temps, dtype, gen))
        seq_t.append(temps)
        log(f"dspark data: {i + nb}/{a.gen_seqs} continuations ({time.time() - t0:.0f} s)")
    seqs, seq_t = torch.cat(seqs), torch.cat(seq_t)
    reps = [repeated_4gram_share(s[a.prompt_len:].tolist()) for s in seqs.cpu()]
    gen_stats = {str(t): {"sequences": int((seq_t == t).sum()),
                          "repeated_4gram_share_mean": round(float(np.mean([r for r, x in zip(reps, seq_t) if x == t])), 4)}
                 for t in temps_all}
    log(f"continuations: {json.dumps(gen_stats)}")
    # 2. Validation: the target's continuations of held-out documents, greedy and at 0.7, in fp32
    #    (the tokens deltafin's greedy run gives).
    docs, sources = heldout_docs(a.data)
    vp, vsrc = val_prompts(docs, sources, a.val_prompts, a.prompt_len, a.val_new)
    vset = ValSet(list(vp), vsrc, target, a, dev)
    log(f"validation: {len(vp)} held-out prompts; share with < 20% repeated 4-grams: "
        + ", ".join(f"{k} {(r < 0.2).float().mean():.2f}" for k, r in vset.rep.items()))
    gen_s = time.time() - t0

    def validate(drafter, full=False):
        drafter.eval()
        out = vset.acceptance(drafter, taps, full)
        drafter.train()
        return out

    def brief(v):
        out = {}
        for k, x in v.items():
            y = x["no_loops"]
            out[k] = {"policy_acceptance_no_loops": y.get("policy_acceptance"),
                      "policy_per_verify_no_loops": y.get("policy_accepted_per_verify"),
                      "chain_acceptance_no_loops": y.get("chain_acceptance"),
                      "policy_acceptance_all": x["all"].get("policy_acceptance")}
            if "sampling_drafter_expected_by_position" in y:
                out[k]["sampling_drafter_position1_no_loops"] = y["sampling_drafter_expected_by_position"][0]
        return out

    # 3. The drafter: each step half training-text windows, half continuations; every row labelled
    #    with the target's distribution.
    model = DSpark(c, len(taps) * target.c.hidden).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"dspark: {n_params / 1e6:.2f} M parameters; {c}")
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.draft_lr, betas=(0.9, 0.95), fused=dev == "cuda")
    row_w = torch.exp(-torch.arange(R, dtype=torch.float32, device=dev) / a.row_decay)
    row_w = row_w / row_w.sum()
    text = Windows(train, S - 1, a.draft_batch // 2, a.seed + 5, dev)
    lo, hi = a.min_context, S - R - 1

    def anchors(n):
        return torch.from_numpy(rng.integers(lo, hi + 1, size=(n, a.blocks_per_seq))).to(dev)

    sched = Schedule(a.draft_lr, a.warmup // 2, decay=a.decay, floor=a.lr_floor, steps=a.draft_steps,
                     budget_s=a.draft_time_budget_s, decay_start=a.draft_decay_start)
    hist = []
    t1 = time.time()
    next_eval_t, step = 0.0, 0
    while True:
        el = time.time() - t1
        lr, done = sched.at(step, el)
        if done or (a.draft_steps and step >= a.draft_steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = text.next()
        gi = torch.from_numpy(rng.integers(0, len(seqs), size=a.draft_batch - len(x))).to(seqs.device)
        ids = torch.cat([torch.cat([x, y[:, -1:]], 1), seqs[gi]])
        loss, acc_len, row_acc = kl_block_loss(model, target, ids, anchors(len(ids)), taps, dtype, row_w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        want_eval = (el >= next_eval_t) if a.draft_time_budget_s else (step - 1) % a.eval_every == 0
        if (step - 1) % a.log_every == 0 or want_eval:
            rec = {"step": step, "lr": round(lr, 6), "kl": round(loss.item(), 4),
                   "argmax_run_per_block": round(acc_len, 3), "argmax_agreement": round(row_acc, 4),
                   "elapsed_s": round(time.time() - t1, 1)}
            if want_eval:
                rec["val"] = brief(validate(model))
                next_eval_t = el + (a.draft_time_budget_s / 6 if a.draft_time_budget_s else 0)
            hist.append(rec)
            log(json.dumps(rec))
    train_s = time.time() - t1
    final = validate(model, full=True)
    log("held-out acceptance (deltafin's width policy and the width-7 chain; continuations with < 20% repeated "
        "4-grams): " + json.dumps(brief(final)))
    out = os.path.join(a.out, "kimi-k3-demo-dspark")
    os.makedirs(out, exist_ok=True)
    from safetensors.torch import save_file
    save_file(dspark_tensors(model), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dspark_config_json(c, target.c.hidden), f, indent=2)
    with open(os.path.join(a.out, "train_dspark.json"), "w") as f:
        json.dump({"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(c).items()},
                   "args": vars(a), "parameters": n_params, "schedule": sched.record(step),
                   "continuations": gen_stats, "validation_prompts": len(vp),
                   "validation_sources": {s: vsrc.count(s) for s in sorted(set(vsrc))},
                   "validation_share_under_20pct_repeats": {k: round((r < 0.2).float().mean().item(), 4)
                                                            for k, r in vset.rep.items()},
                   "heldout_acceptance": final, "history": hist, "generation_seconds": round(gen_s, 1),
                   "train_seconds": round(train_s, 1), "seconds": round(time.time() - t0, 1),
                   "device": device_name(dev), "torch": torch.__version__}, f, indent=1)
    log(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["all", "target", "eval", "chat", "dspark", "dspark-eval"])
    p.add_argument("--data", default="train/data", help="directory with train.bin, heldout.bin, heldout.txt")
    p.add_argument("--tokenizer", default="train/tokenizer/out", help="tiktoken.model, tokenizer_config.json, chat_template.jinja")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=20261203)
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="target: train for this many seconds (the loop; export and scoring come after), the LR schedule "
                        "spread over it; 0: --steps")
    p.add_argument("--steps", type=int, default=0, help="target: training steps (with --time-budget-s 0)")
    p.add_argument("--decay-start", type=int, default=0, help="with --steps: the step the decay begins (0: at 1 - --decay)")
    p.add_argument("--plateau", type=float, default=0.002,
                   help="with --time-budget-s: begin the decay early when two curve points in a row improve on the best by less than this")
    p.add_argument("--max-passes", type=float, default=12.0,
                   help="with --time-budget-s: stop after this many passes over the training tokens even if time is left")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2.5e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="warmup steps (the drafter: half)")
    p.add_argument("--decay", type=float, default=0.25, help="share of the run spent in the (1 - sqrt) decay")
    p.add_argument("--lr-floor", type=float, default=0.02, help="LR at the end, as a share of the peak")
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile the pointwise helpers (norms, AttnRes mix, SiTU)")
    p.add_argument("--deterministic", action="store_true",
                   help="PyTorch's deterministic kernels where it has them (slower on CUDA)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250, help="with step counts: score held-out windows every N steps")
    p.add_argument("--curve-points", type=int, default=12, help="with a budget: held-out scores at this many even times")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq tokens the curve is scored on")
    p.add_argument("--eval-chars", type=int, default=0, help="score only the first N characters (smoke tests)")
    p.add_argument("--window", type=int, default=512, help="score window (deltafin score --window)")
    p.add_argument("--demo-temperature", type=float, default=0.8)
    p.add_argument("--demo-top-p", type=float, default=0.95)
    p.add_argument("--draft-time-budget-s", type=float, default=0.0,
                   help="dspark: train for this many seconds (after generating its data); 0: --draft-steps")
    p.add_argument("--draft-steps", type=int, default=0)
    p.add_argument("--draft-decay-start", type=int, default=0)
    p.add_argument("--gen-seqs", type=int, default=6144, help="the target's continuations to train on")
    p.add_argument("--gen-chat-share", type=float, default=0.5,
                   help="share of the continuations whose prompts are chat turns about to be answered")
    p.add_argument("--chat-convs", type=int, default=60000, help="chat: conversations built for the tuning")
    p.add_argument("--chat-time-budget-s", type=float, default=0.0, help="chat: seconds of tuning (0: --chat-steps)")
    p.add_argument("--chat-steps", type=int, default=0)
    p.add_argument("--chat-lr", type=float, default=6e-4, help="chat: peak learning rate")
    p.add_argument("--chat-text-share", type=float, default=0.25,
                   help="chat: share of each batch that is training-text windows (keeps the held-out perplexity)")
    p.add_argument("--gen-batch", type=int, default=2048)
    p.add_argument("--gen-temps", default="0,0.7,0.85,1.0", help="temperatures the continuations cycle through (0: greedy)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-new", type=int, default=128, help="tokens per continuation")
    p.add_argument("--val-prompts", type=int, default=150, help="held-out prompts (about; spread over the documents)")
    p.add_argument("--val-new", type=int, default=128)
    p.add_argument("--min-context", type=int, default=8, help="the drafter's first anchor position in a sequence")
    p.add_argument("--draft-batch", type=int, default=64, help="sequences a step: half training text, half continuations")
    p.add_argument("--blocks-per-seq", type=int, default=16)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--row-decay", type=float, default=4.0)
    p.add_argument("--draft-model", help="dspark-eval: the drafter to evaluate")
    p.add_argument("--target", help="dspark-eval: the target (default OUT/kimi-k3-demo)")
    p.add_argument("--sequences", help="dspark-eval: evaluate on these sequences (bench/drafts.py --sequences-out) "
                                       "instead of generating held-out continuations")
    p.add_argument("--eval-out", help="dspark-eval: where the report goes (default OUT/eval_dspark.json)")
    p.add_argument("--tiny", action="store_true", help="a small configuration, for smoke tests of the pipeline")
    a = p.parse_args()
    global TINY
    TINY = a.tiny
    os.makedirs(a.out, exist_ok=True)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if a.deterministic:
        # Deterministic kernels where PyTorch has them (it warns where it has not).
        torch.use_deterministic_algorithms(True, warn_only=True)
    if a.stage in ("all", "target") and not a.steps and not a.time_budget_s:
        p.error("target: give --time-budget-s or --steps")
    if a.stage in ("all", "dspark") and not a.draft_steps and not a.draft_time_budget_s:
        p.error("dspark: give --draft-time-budget-s or --draft-steps")
    if a.stage == "chat" and not a.chat_steps and not a.chat_time_budget_s:
        p.error("chat: give --chat-time-budget-s or --chat-steps")
    if a.stage in ("all", "target"):
        train_target(a)
    if a.stage == "chat" or (a.stage == "all" and (a.chat_steps or a.chat_time_budget_s)):
        train_chat(a)
    if a.stage in ("all", "eval", "chat"):
        run_eval(a)
    if a.stage in ("all", "dspark"):
        train_dspark(a)
    if a.stage == "dspark-eval":
        eval_dspark(a)


if __name__ == "__main__":
    main()

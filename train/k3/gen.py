"""Generation with the target (prompt, then one token at a time through the model's cache), the
share of repeated 4-grams in an output, and draft acceptance measured the way deltafin's verify
accepts drafts.

Acceptance: a block anchored at position L (the anchor is the pending token, the drafter sees the
target's rows before L) drafts d_1..d_7 for positions L+1..L+7; d_r is accepted while every
earlier draft was and it equals the target's token there. On a greedy continuation that token is
the target's argmax; on a sampled one it is the target's draw, which is the exact speculative-
sampling rule for a drafter that proposes deterministically (accept with probability
min(1, p(d)/q(d)) = p(d) with q a point mass, i.e. "draw x ~ p, accept iff x = d"; deltafin draws
token j from the j-th uniform number, so its output with drafts is the plain sampled output). The
drafter's Markov head reads the previous row's token, which is the previous draft exactly while
the drafts are being accepted, so teacher forcing along the continuation gives the drafts deltafin
would verify.
"""

import torch


@torch.no_grad()
def generate(model, prompts, n_new, temps, dtype, gen=None):
    """prompts [B, P] -> [B, P + n_new]: each row continued by the target, greedily where its
    temperature (temps [B]) is 0, else sampled from softmax(logits / t) (top-p 1)."""
    cache = model.new_cache()
    logits = model(prompts, dtype=dtype, cache=cache)[:, -1].float()
    temps = temps.to(prompts.device).float()[:, None]
    out = []
    for i in range(n_new):
        greedy = logits.argmax(-1)
        probs = torch.softmax(logits / temps.clamp(min=1e-6), -1)
        drawn = torch.multinomial(probs, 1, generator=gen)[:, 0]
        nxt = torch.where(temps[:, 0] > 0, drawn, greedy)
        out.append(nxt)
        if i + 1 < n_new:
            logits = model(nxt[:, None], dtype=dtype, cache=cache)[:, -1].float()
    return torch.cat([prompts, torch.stack(out, 1)], 1)


def repeated_4gram_share(ids):
    """Share of positions (from the 4th on) whose 4-gram ending there occurred earlier in `ids`."""
    ids = list(ids)
    seen, rep = set(), 0
    for i in range(3, len(ids)):
        g = tuple(ids[i - 3:i + 1])
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(ids) - 3)


@torch.no_grad()
def block_acceptance(drafter, target, seqs, start, taps, dtype, batch=16, temperature=0.0):
    """seqs [N, S] (prompt + the target's continuation from position `start`). For every anchor
    L in [start, S - block - 1]: the drafts' correct flags [N, anchors, block] (teacher forced).
    With a temperature > 0 also [N, anchors, block] of sum_v min(p_T(v), q_T(v)), p_T and q_T the
    target's and the drafter's distributions at that temperature: the chance that a drafter
    *sampling* its drafts from q_T gets each accepted under the general speculative-sampling rule
    (exact at position 1; later positions are teacher forced along the target's sample)."""
    R = drafter.c.block
    S = seqs.shape[1]
    anchors = torch.arange(start, S - R, device=seqs.device)
    out, soft = [], []
    for i in range(0, len(seqs), batch):
        ids = seqs[i:i + batch]
        lt, t = target(ids, taps=set(taps), dtype=dtype)
        x = torch.cat([t[l] for l in taps], -1).float()
        A = anchors[None].expand(len(ids), -1)
        logits = drafter.block_logits(x, ids, A, target.embed_tokens, target.lm_head)
        pos = (A[:, :, None] + torch.arange(R, device=ids.device)).reshape(len(ids), -1)
        tgt = torch.gather(ids, 1, pos + 1)
        out.append(logits.argmax(-1) == tgt.reshape(len(ids), -1, R))
        if temperature > 0:
            lp = torch.gather(lt, 1, pos[..., None].expand(-1, -1, lt.shape[-1])).reshape(logits.shape)
            p, q = torch.softmax(lp.float() / temperature, -1), torch.softmax(logits.float() / temperature, -1)
            soft.append(torch.minimum(p, q).sum(-1))
    return torch.cat(out), (torch.cat(soft) if soft else None)


# deltafin's width policy (src/spec/mod.rs, WidthPolicy::default), without the cost model.
PROBE, MAX_WIDTH, PAUSE, MAX_PAUSE, GOOD_RECORD, EWMA = 2, 7, 8, 128, 0.5, 0.3


def simulate_policy(runs, n_new):
    """The verifies deltafin's width policy makes over one continuation of n_new tokens: runs[a] is
    the accepted-run length of the full-width block anchored at the a-th generated token (drafts
    do not depend on the width, so a narrower block accepts min(run, width)). Returns
    (proposed by position, accepted by position, verifies)."""
    width, paused, next_pause, rec = PROBE, 0, PAUSE, 0.0
    prop, acc = [0] * MAX_WIDTH, [0] * MAX_WIDTH
    verifies, emitted, a = 0, 1, 0                  # the first token comes from the prompt pass
    while emitted < n_new:
        w = 0 if paused > 0 else min(width, n_new - emitted - 1)
        if w == 0:
            paused = max(0, paused - 1)
            emitted += 1
            a += 1
            continue
        j = min(int(runs[a]), w)
        verifies += 1
        for r in range(w):
            prop[r] += 1
        for r in range(j):
            acc[r] += 1
        good = rec >= GOOD_RECORD
        rec += EWMA * (j / w - rec)
        if j == 0 and good:
            width = PROBE
        elif j == 0:
            paused, next_pause, width = next_pause, min(max(next_pause * 2, 1), MAX_PAUSE), PROBE
        else:
            next_pause = PAUSE
            width = MAX_WIDTH if j >= w else min(max(2 * j, PROBE), MAX_WIDTH)
        emitted += j + 1
        a += j + 1
    return prop, acc, verifies


def acceptance_report(correct, keep=None, soft=None):
    """correct [N, anchors, R] from `block_acceptance` (anchor a at position start + a); `keep`
    [N] bool: the sequences that count. Returns, over every anchor at width R, the conditional
    acceptance at each position (blocks accepted through r / through r - 1) and the mean accepted
    per block; and over the verify chain deltafin runs at a fixed width R (anchor, verify, the
    next anchor after the accepted drafts and the bonus token) deltafin's own counters: accepted
    per verify, drafts accepted / proposed at each position and overall."""
    if keep is not None:
        correct = correct[keep]
        soft = soft[keep] if soft is not None else None
    if len(correct) == 0:
        return {"sequences": 0}
    acc = torch.cumprod(correct.int(), -1)                       # accepted through row r
    N, A, R = acc.shape
    through = acc.sum((0, 1)).double()
    reached = torch.cat([torch.tensor([N * A], dtype=torch.float64), through[:-1].cpu()])
    per_pos = (through.cpu() / reached.clamp(min=1)).tolist()
    runs = acc.sum(-1).cpu()                                     # accepted drafts per anchor
    verifies, accepted = 0, 0
    got = [0] * R                                                # verifies whose draft r+1 was accepted
    for n in range(N):
        a = 0
        while a < A:
            j = int(runs[n, a])
            verifies += 1
            accepted += j
            for r in range(j):
                got[r] += 1
            a += j + 1
    pp, pa, pv = [0] * R, [0] * R, 0
    for n in range(N):
        p, q, v = simulate_policy(runs[n].tolist() + [0] * R, A)
        pp = [x + y for x, y in zip(pp, p)]
        pa = [x + y for x, y in zip(pa, q)]
        pv += v
    return {
        "sequences": N, "anchors": N * A,
        "per_position_conditional": [round(x, 4) for x in per_pos],
        "accepted_per_block": round(runs.double().mean().item(), 4),
        # deltafin's counters at a fixed width R: drafts accepted / proposed at each position.
        "chain_verifies": verifies, "chain_accepted_per_verify": round(accepted / max(1, verifies), 4),
        "chain_acceptance_by_position": [round(g / max(1, verifies), 4) for g in got],
        "chain_acceptance": round(accepted / max(1, verifies * R), 4),
        # deltafin's width policy (probe 2, widen to 7, pause on misses), without its cost model:
        # what `run --draft dspark` counts when the cost model never pauses.
        "policy_proposed": sum(pp), "policy_accepted": sum(pa), "policy_verifies": pv,
        "policy_acceptance": round(sum(pa) / max(1, sum(pp)), 4),
        "policy_accepted_per_verify": round(sum(pa) / max(1, pv), 4),
        "policy_acceptance_by_position": [round(a / p, 4) if p else None for a, p in zip(pa, pp)],
    } | ({} if soft is None else {
        # A drafter that samples its drafts (the general rule, accept with min(1, p/q)).
        "sampling_drafter_expected_by_position": [round(x, 4) for x in soft.double().mean((0, 1)).tolist()],
        "sampling_drafter_expected_per_block": round(torch.cumprod(soft.double(), -1).sum(-1).mean().item(), 4),
    })

"""Replays an expert fetch trace (`deltafin bench run --fetch-trace FILE`) through cache policies of
the same size and prints one JSON record of their misses against the optimal (Belady) cache.
Used to choose the store's policy by measurement:  python3 bench/cache_sim.py TRACE.json [SLOTS]
`oracle_lookahead` bounds what route prediction could give: exact knowledge of the next 1/2/3
tokens' routes (then next_use beyond)."""

import json
import math
import sys


def belady(trace, cap):
    nxt_use, pos = {}, {}
    seq = [(l, e) for l, u in trace for e in u]
    nxt = [math.inf] * len(seq)
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = pos.get(seq[i], math.inf)
        pos[seq[i]] = i
    cache, misses = {}, 0
    for i, k in enumerate(seq):
        if k in cache:
            cache[k] = nxt[i]
            continue
        misses += 1
        if cap == 0:
            continue
        if len(cache) < cap:
            cache[k] = nxt[i]
            continue
        victim = max(cache, key=cache.get)
        if cache[victim] > nxt[i]:
            del cache[victim]
            cache[k] = nxt[i]
    return misses


def scored(trace, cap, score):
    """Keeps, after every pass, the `cap` experts with the highest score(key, state) among the
    cached ones and the pass's new ones (a new one can be bypassed)."""
    st = {"uses": {}, "last": {}, "t": 0, "layer_pos": {}, "cycle": None, "passes": {}}
    layers = sorted({l for l, _ in trace})
    cache, misses = set(), 0
    for t, (l, union) in enumerate(trace):
        st["t"] = t
        st["passes"][l] = st["passes"].get(l, 0) + 1
        for e in union:
            k = (l, e)
            st["uses"][k] = st["uses"].get(k, 0) + 1
            st["last"][k] = t
            if k not in cache:
                misses += 1
        st["layer"] = l
        cands = cache | {(l, e) for e in union}
        if len(cands) > cap:
            cache = set(sorted(cands, key=lambda k: score(k, st, layers), reverse=True)[:cap])
        else:
            cache = cands
    return misses


def lru(k, st, layers):
    return st["last"][k]


def lfu(k, st, layers):
    return (st["uses"][k], st["last"][k])


def next_use(k, st, layers):
    """Minus the expected passes until k is used again: its layer's next visit (decode walks the
    layers in order) plus whole cycles while it is not picked, with p = its pick rate so far."""
    l, n = k[0], len(layers)
    cur = layers.index(st["layer"])
    d = (layers.index(l) - cur - 1) % n + 1
    p = (st["uses"][k] + 0.5) / (st["passes"].get(l, 1) + 1.0)
    return -(d + n * (1 - p) / p)


def oracle_lookahead(trace, cap, window):
    """A policy that knows the next `window` passes exactly (an upper bound for any route
    predictor that sees that far) and falls back to next_use beyond them: how far ahead one must
    see to get near the optimum."""
    next_pass = [{} for _ in trace]
    upcoming = {}
    for t in range(len(trace) - 1, -1, -1):
        next_pass[t] = dict(upcoming)
        l, u = trace[t]
        for e in u:
            upcoming[(l, e)] = t

    def score(k, st, layers):
        t = st["t"]
        j = next_pass[t].get(k)
        if j is not None and j - t <= window:
            return 1e9 - j
        return next_use(k, st, layers)

    return scored(trace, cap, score)


def main():
    d = json.load(open(sys.argv[1]))
    cap = int(sys.argv[2]) if len(sys.argv) > 2 else d["cache_slots"]
    trace = [(int(l), [int(e) for e in u]) for l, u in d["trace"]]
    opt = belady(trace, cap)
    out = {"bench": "cache_sim", "trace": sys.argv[1], "cache_slots": cap, "passes": len(trace),
           "requests": sum(len(u) for _, u in trace), "belady_misses": opt}
    for name, f in [("lru", lru), ("lfu", lfu), ("next_use", next_use)]:
        m = scored(trace, cap, f)
        out[name] = {"misses": m, "vs_opt": m / opt if opt else None}
    # Decode passes per token = MoE layers; windows in tokens of exact foresight.
    n_layers = len({l for l, _ in trace})
    look = {}
    for tokens in (1, 2, 3):
        m = oracle_lookahead(trace, cap, tokens * n_layers)
        look[f"{tokens}_token"] = {"passes": tokens * n_layers, "misses": m, "vs_opt": m / opt if opt else None}
    out["oracle_lookahead"] = look
    print(json.dumps(out))


if __name__ == "__main__":
    main()

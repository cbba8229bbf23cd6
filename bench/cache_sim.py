"""Replays expert fetch traces (`deltafin bench run --fetch-trace FILE`) through cache policies of
the same size and prints one JSON record of their misses against the optimal (Belady) cache,
summed over the traces (each trace starts cold, as each `bench run` does):

    python3 bench/cache_sim.py TRACE.json [TRACE.json ...] [--slots N | --fractions 0.125,0.25,0.5]

`--fractions` sizes the cache to that share of every MoE layer's experts (the trace names the
layers; --experts gives their count, 64 on the demo model). Policies:
- `store`: the store's policy (src/store/expert_store/policy.rs with src/store/replay.rs; a miss
  that cannot take a free read slot evicts only what it outranks, within a few misses of the store
  in thousands, which decides that at the moment each read starts):
  route replay's forecast first, then weighted request counts, a prompt weighing as 8 fetches. It
  gives the store's own `cache_misses` on the same trace (the traces carry each prompt pass's
  rows per expert, `rows_of`, which the store's ranks count);
- `store_lfu`: the store's policy before route replay (LFU, a prompt's rows counted in full);
- `lru`, `lfu`, `next_use`: textbook policies (keep the best `slots` after each pass);
- `oracle_lookahead`: exact knowledge of the next 1/2/3 tokens' routes (then next_use beyond),
  and `oracle_counts`: every expert's request count of the whole run known in advance — bounds
  for what route prediction could give.
Stdlib only.
"""

import argparse
import bisect
import heapq
import json
import math

# The store's constants (src/store/expert_store/policy.rs, src/store/replay.rs).
RANK_UNIT = 256
PROMPT_PRIOR_PASSES = 8.0
VICTIM_SCAN = 64
MATCH_PASSES = 2
MIN_MATCH = 0.6
HISTORY_TOKENS = 256
HORIZON_TOKENS = 16
# Staging slots of a store on one drive at queue depth 4 without prefetch: reads in flight take
# them before the cache is touched (expert_store::staging_slots).
STAGING = 6


def belady(trace, cap):
    """store::cache::belady_misses: a fetch's experts are needed together; its misses are admitted
    in order, each evicting the cached expert needed farthest ahead if that is later than its own
    next use."""
    nxt, last = [None] * len(trace), {}
    for f in range(len(trace) - 1, -1, -1):
        l, es = trace[f]
        nxt[f] = [last.get((l, e), math.inf) for e in es]
        for e in es:
            last[(l, e)] = f
    cached, heap, misses = {}, [], 0
    for f, (l, es) in enumerate(trace):
        incoming = []
        for i, e in enumerate(es):
            k, nu = (l, e), nxt[f][i]
            if k in cached:
                cached[k] = nu
                heapq.heappush(heap, (-nu, k))
            else:
                misses += 1
                incoming.append((nu, k))
        for nu, k in incoming:
            if cap == 0 or nu == math.inf:
                continue
            if len(cached) >= cap:
                while heap and (heap[0][1] not in cached or cached[heap[0][1]] != -heap[0][0]):
                    heapq.heappop(heap)
                far, victim = -heap[0][0], heap[0][1]
                if far <= nu:
                    continue
                heapq.heappop(heap)
                del cached[victim]
            cached[k] = nu
            heapq.heappush(heap, (-nu, k))
    return misses


class Replay:
    """src/store/replay.rs: the fetch history and the forecast from its best earlier match."""

    def __init__(self, layers):
        self.layers = max(1, layers)
        self.hist, self.seen, self.matched = [], {}, None

    def record(self, l, experts):
        es = sorted(set(experts))
        now = len(self.hist)
        for e in es:
            self.seen.setdefault((l, e), []).append(now)
        self.hist.append((l, frozenset(es)))
        base = max(0, now + 1 - HISTORY_TOKENS * self.layers)
        best, self.matched = 0.0, None
        for q in range(now - 1, base, -1):
            if self.hist[q][0] != l:
                continue
            score = 0.0
            for j in range(MATCH_PASSES):
                (la, a), (lb, b) = self.hist[now - j], self.hist[q - j]
                if la == lb and a and b:
                    score += len(a & b) / max(len(a), len(b))
            if score > best:
                best, self.matched = score, q
        if best < MIN_MATCH * MATCH_PASSES:
            self.matched = None

    def next_use(self, k):
        q = self.matched
        if q is None or k not in self.seen:
            return None
        s = self.seen[k]
        i = bisect.bisect_right(s, q)
        if i == len(s):
            return None
        d = s[i] - q
        return d if s[i] < len(self.hist) and d <= HORIZON_TOKENS * self.layers else None


def store_policy(trace, rows_of, cap, replay=True):
    """The store's cache, pass by pass as `fetch` runs it: hits pinned, misses take a free slot or
    evict the victim they outrank (else wait for a read slot), then each expert (hits first, then misses in order) stays cached if there is
    room or it outranks the victim. replay=False: the policy before route replay (LFU, a prompt's
    rows counted in full, admission above the least used)."""
    layers = len({l for l, _ in trace})
    rp = Replay(layers)
    rank, order, seq, misses = {}, {}, 0, 0  # order: cached key -> (rank, seq)

    def standing(k):
        d = rp.next_use(k)
        return (d is not None, -(d or 0), rank.get(k, 0))

    def victim():
        # None when nothing is cached that could go: every slot holds an expert of this pass.
        if not order:
            return None
        if not replay:
            return min(order, key=order.get)
        last = None
        for k in sorted(order, key=order.get)[:VICTIM_SCAN]:
            d = rp.next_use(k)
            if d is None:
                return k
            if last is None or d > last[0]:
                last = (d, k)
        return last[1]

    for f, (l, es) in enumerate(trace):
        keys = [(l, e) for e in es]
        counts = rows_of[f] if rows_of else []
        if counts:
            rows = max(1, sum(counts) // TOP_K)
            for e, c in zip(es, counts):
                if replay:
                    add = math.floor(c * (PROMPT_PRIOR_PASSES * RANK_UNIT / rows) + 0.5)
                else:
                    add = math.floor(c * min(256, rows) / rows + 0.5)
                rank[(l, e)] = rank.get((l, e), 0) + add
        if replay and es:
            rp.record(l, es)
        for k in keys:
            rank[k] = rank.get(k, 0) + (RANK_UNIT if replay else 1)
            if k in order:
                order[k] = (rank[k], order[k][1])
        hits = [k for k in keys if k in order]
        for k in hits:
            del order[k]
        hit_set = set(hits)
        miss = [k for k in keys if k not in hit_set]
        misses += len(miss)
        in_use = len(hits)
        for k in miss:
            if len(order) + in_use >= cap + STAGING:
                # No free slot: a miss evicts the victim only if it outranks it (or, with no read
                # of its fetch in flight yet, to make progress); else it streams through the
                # read slots its fetch's earlier misses free (policy.rs alloc_demand_slot). The
                # policy before route replay evicted for every miss.
                v = victim()
                # No victim (the pass's union holds every slot): it streams through a read slot.
                if v is None or (replay and in_use > len(hits) and not standing(k) > standing(v)):
                    continue
                del order[v]
            in_use += 1
        for k in hits + miss:
            if len(order) < cap:
                seq += 1
                order[k] = (rank[k], seq)
            elif cap > 0:
                v = victim()
                if v is None:
                    continue
                better = standing(k) > standing(v) if replay else rank[k] > order[v][0]
                if better:
                    del order[v]
                    seq += 1
                    order[k] = (rank[k], seq)
    return misses


def scored(trace, cap, score):
    """Keeps, after every pass, the `cap` experts with the highest score(key, state) among the
    cached ones and the pass's new ones (a new one can be bypassed)."""
    st = {"uses": {}, "last": {}, "t": 0, "passes": {}}
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
            cache = set(heapq.nlargest(cap, cands, key=lambda k: score(k, st, layers)))
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
    """Knows the next `window` passes exactly and falls back to next_use beyond them."""
    next_pass, upcoming = [None] * len(trace), {}
    for t in range(len(trace) - 1, -1, -1):
        next_pass[t] = dict(upcoming)
        l, u = trace[t]
        for e in u:
            upcoming[(l, e)] = t

    def score(k, st, layers):
        j = next_pass[st["t"]].get(k)
        if j is not None and j - st["t"] <= window:
            return (1, -j)
        return (0, next_use(k, st, layers))

    return scored(trace, cap, score)


def oracle_counts(trace, cap):
    """Every expert ranked by its request count over the whole run, known in advance."""
    total = {}
    for l, u in trace:
        for e in u:
            total[(l, e)] = total.get((l, e), 0) + 1
    return scored(trace, cap, lambda k, st, layers: (total[k], st["last"][k]))


TOP_K = 8


def main():
    global TOP_K
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--slots", type=int, help="cache slots (default: each trace's own)")
    p.add_argument("--fractions", help="cache sizes as shares of each layer's experts, e.g. 0.125,0.25,0.5")
    p.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, default=8, help="experts per row (counts rows of a prompt pass)")
    p.add_argument("--quick", action="store_true", help="only the optimum, the store's policies and LRU")
    a = p.parse_args()
    TOP_K = a.top_k
    runs = []
    for path in a.traces:
        d = json.load(open(path))
        trace = [(int(l), [int(e) for e in u]) for l, u in d["trace"]]
        runs.append((trace, d.get("rows_of"), d.get("cache_slots")))
    layers = len({l for l, _ in runs[0][0]})
    if a.fractions:
        sizes = [(f, int(float(f) * a.experts) * layers) for f in a.fractions.split(",")]
    else:
        sizes = [(None, a.slots if a.slots is not None else runs[0][2])]
    out = {"bench": "cache_sim", "traces": len(runs), "passes": sum(len(t) for t, _, _ in runs),
           "requests": sum(len(u) for t, _, _ in runs for _, u in t),
           "rows_of": all(r is not None for _, r, _ in runs), "sizes": {}}
    for label, cap in sizes:
        opt = sum(belady(t, cap) for t, _, _ in runs)
        row = {"slots": cap, "belady_misses": opt}

        def put(name, m):
            row[name] = {"misses": m, "vs_opt": round(m / opt, 4) if opt else None}

        put("store", sum(store_policy(t, r, cap) for t, r, _ in runs))
        put("store_lfu", sum(store_policy(t, r, cap, replay=False) for t, r, _ in runs))
        put("lru", sum(scored(t, cap, lru) for t, _, _ in runs))
        if not a.quick:
            put("lfu", sum(scored(t, cap, lfu) for t, _, _ in runs))
            put("next_use", sum(scored(t, cap, next_use) for t, _, _ in runs))
            put("oracle_counts", sum(oracle_counts(t, cap) for t, _, _ in runs))
            for tokens in (1, 2, 3):
                put(f"oracle_lookahead_{tokens}_token", sum(oracle_lookahead(t, cap, tokens * layers) for t, _, _ in runs))
        out["sizes"][label or str(cap)] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()

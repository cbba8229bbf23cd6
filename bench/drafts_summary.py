#!/usr/bin/env python3
"""Tables of bench/drafts.py records (JSON lines): per label and setting, each drafter's median per-window tok/s
ratio to drafts off (all windows / loop-free / looping), summed ratio, acceptance, forward passes per
token, drafter forwards and context rows folded, drafts per drafter, widths, ids identical.
    python3 bench/drafts_summary.py RECORDS.jsonl
"""
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
for r in recs:
    print(f"### {r['label']} (git {r['git']}, {r['seconds']} s; start: {r['uptime_start']}; end: {r['uptime_end']})\n")
    print("| setting | windows (loop-free) | drafter | median tok/s ratio: all / loop-free / looping | summed ratio | acceptance | fwd/token | drafter forwards / context rows folded | drafts by drafter (verifies, proposed, accepted) | widths | ids identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, res in r["results"].items():
        off = res["off"]["all"]
        print(f"| {key} | {res['windows']} ({res['no_loop_windows']}) | off | median {off['decode_tok_s_median']} tok/s | | | {off['forward_passes_per_token']} | | | | |")
        for d in r["drafts"][1:]:
            x, y = res[d]["all"], res[d]["no_loops"]
            lo = (res.get("loops") or {}).get(d) or {}
            f = lambda v: "-" if v is None else f"{v:.2f}"
            bd = "; ".join(f"{k} {v['verifies']},{v['proposed']},{v['accepted']}" for k, v in x["drafts_by_drafter"].items())
            print(f"| {key} | | {d} | {f(x['tok_s_ratio_median'])} / {f(y.get('tok_s_ratio_median'))} / {f(lo.get('tok_s_ratio_median'))} "
                  f"| {f(x['tok_s_ratio_to_off'])} | {f(x['acceptance'])} ({x['drafts_accepted']}/{x['drafts_proposed']}) | {x['forward_passes_per_token']} "
                  f"| {x['drafter_forwards']} / {x['drafter_context_rows']} | {bd} | {x['draft_widths']} | {x['ids_identical_to_off']} |")
    print()

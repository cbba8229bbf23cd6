#!/usr/bin/env python3
"""Assembles bench/peer_llama.sh's one JSON record from the files of a run directory.

    peer_record.py RUN_DIR MODEL_DIR GGUF LIMIT_BYTES COMMAND LLAMA_SOURCE SYNTH_ARGS

RUN_DIR holds deltafin.out (bench run's record), llama-pp.out / llama-tg.out (llama-bench -o jsonl)
and a /proc/PID/io trace of each process (*.io.json, from bench/peer_iomon.py).

Bytes read per token, both sides: the process's read_bytes over the timed window of the phase,
divided by the phase's tokens. A window ends when the program printed its result (llama-bench
prints each test's line right after the test; deltafin prints its record right after decode) and
lasts the phase's own measured time; read_bytes is interpolated between samples.
Read amplification: prefill = bytes read / bytes of the distinct experts the prompt routes to
(deltafin's expert_bytes_unique; with 512 tokens x top-16 of 128 every expert is routed on both
sides); decode = bytes read per token / bytes one token routes to (top_k x MoE layers x expert size).
"""
from __future__ import annotations

import json
import os
import sys


def json_object(line: str):
    """The JSON object on a line, or None when the line is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def stamped_line(trace: dict, want: str) -> tuple[float, dict]:
    """(time printed, parsed) of the last stdout line that is a JSON object holding `want`."""
    for t, line in reversed(trace["lines"]):
        d = json_object(line)
        if d is not None and want in d:
            return t, d
    raise SystemExit(f"peer_record: no JSON line with {want!r} in the trace of {trace['cmd'][:3]}")


def read_at(samples: list, t: float) -> float:
    """read_bytes at time t, linear between samples."""
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, b0, _), (t1, b1, _) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return samples[-1][1]


def window(trace: dict, end: float, seconds: float) -> dict:
    s = trace["samples"]
    got = read_at(s, end) - read_at(s, end - seconds)
    return {"start_s": round(end - seconds, 3), "end_s": round(end, 3), "read_bytes": int(got)}


def peak_rss(path: str):
    """Bytes of bench/peer_rss.py's `peak_rss_kb N` line, or None when the run has no such file."""
    try:
        for line in open(path):
            if line.startswith("peak_rss_kb"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> None:
    if len(sys.argv) != 8:
        sys.exit(__doc__)
    run, model, gguf, limit, command, llama_source, synth_args = sys.argv[1:]
    limit = int(limit)
    tr = {n: json.load(open(os.path.join(run, f"{n}.io.json"))) for n in ("deltafin", "llama-pp", "llama-tg")}
    cfg = json.load(open(os.path.join(model, "config.json")))
    tc = cfg.get("text_config", cfg)

    # deltafin: its own record, and its /proc windows
    t_rec, rec = stamped_line(tr["deltafin"], "ttft_s")
    pre, dec = rec["prefill"], rec["decode"]
    steps = dec["steps"]
    decode_s = steps * dec["seconds_per_token"] if steps else 0.0
    ttft = rec["ttft_s"]
    prompt = rec["prompt_tokens"]
    moe_layers = rec["moe_layers"]
    top_k = tc["num_experts_per_token"]
    n_exp = tc["num_experts"]
    expert_bytes = rec["expert_bytes_total"] / (moe_layers * n_exp)
    routed_per_token = top_k * moe_layers * expert_bytes
    unique = pre["expert_bytes_unique"]
    phases = rec.get("phase_unix_s")
    if phases and "t0_unix" in tr["deltafin"]:
        # The record says when each phase ran (the ceiling probes lie between and after them).
        t0u = tr["deltafin"]["t0_unix"]
        (ps, pe), (ds, de) = phases["prefill"], phases["decode"]
        d_pre_w = window(tr["deltafin"], pe - t0u, pe - ps)
        d_dec_w = window(tr["deltafin"], de - t0u, de - ds)
    else:
        d_pre_w = window(tr["deltafin"], t_rec - decode_s, ttft)
        d_dec_w = window(tr["deltafin"], t_rec, decode_s)
    d_total = tr["deltafin"]["samples"][-1][1]
    deltafin = {
        "prefill_tok_s": rec["prefill_tok_s"],
        "decode_tok_s": dec["decode_tok_s"],
        "ttft_s": ttft,
        "prefill_bytes_read_per_token": d_pre_w["read_bytes"] / prompt,
        "prefill_read_amplification": d_pre_w["read_bytes"] / unique if unique else None,
        "decode_bytes_read_per_token": d_dec_w["read_bytes"] / steps if steps else None,
        "decode_read_amplification": d_dec_w["read_bytes"] / steps / routed_per_token if steps else None,
        "peak_rss_bytes": peak_rss(os.path.join(run, "deltafin.rss")),
        "own_counters": {
            "prefill_expert_bytes_read": pre["expert_bytes_read"],
            "prefill_read_amplification": pre["read_amplification"],
            "decode_bytes_read_per_token": dec["bytes_read_per_token"],
            "decode_read_amplification": dec["bytes_read_per_token"] / routed_per_token,
        },
        "proc_io": {"prefill_window": d_pre_w, "decode_window": d_dec_w, "process_read_bytes": d_total,
                    "wall_s": tr["deltafin"]["wall_s"]},
    }

    # llama.cpp: llama-bench's jsonl, one process per phase
    llama: dict = {}
    benches = []
    for phase, n_key in (("pp", "n_prompt"), ("tg", "n_gen")):
        t_end, b = stamped_line(tr[f"llama-{phase}"], "avg_ts")
        benches.append(b)
        secs = b["avg_ns"] / 1e9
        n = b[n_key]
        w = window(tr[f"llama-{phase}"], t_end, secs)
        w["process_read_bytes"] = tr[f"llama-{phase}"]["samples"][-1][1]
        w["wall_s"] = tr[f"llama-{phase}"]["wall_s"]
        w["peak_rss_bytes"] = peak_rss(os.path.join(run, f"llama-{phase}.rss"))
        if phase == "pp":
            llama["prefill_tok_s"] = b["avg_ts"]
            llama["prefill_bytes_read_per_token"] = w["read_bytes"] / n
            llama["prefill_read_amplification"] = w["read_bytes"] / unique if unique else None
        else:
            llama["decode_tok_s"] = b["avg_ts"]
            llama["decode_bytes_read_per_token"] = w["read_bytes"] / n
            llama["decode_read_amplification"] = w["read_bytes"] / n / routed_per_token
        llama.setdefault("proc_io", {})[f"{phase}_window"] = w
    llama["build_commit"] = benches[0].get("build_commit")
    llama["build_number"] = benches[0].get("build_number")
    llama["source"] = llama_source
    llama["gguf_bytes"] = os.path.getsize(gguf)
    llama["model_type"] = benches[0].get("model_type")
    llama["llama_bench"] = benches

    # Part 4: the TTFT bound as the sum (no overlap) and as the max (reads fully overlapped), with
    # the ceilings bench run measured around each phase (the engine's reads, until stable).
    ceilings = rec.get("ceilings") or {}
    ceiling = ceilings.get("prefill_gbps", rec.get("ceiling_gbps"))
    bounds = None
    if ceiling:
        read_s = unique / (ceiling * 1e9)
        compute_s = pre["compute_s"]
        bounds = {
            "ceiling_gbps": ceiling,
            "decode_ceiling_gbps": ceilings.get("decode_gbps"),
            "ceilings": ceilings,
            "read_s": read_s,
            "compute_s": compute_s,
            "ttft_bound_sum_s": read_s + compute_s,
            "ttft_bound_max_s": max(read_s, compute_s),
            "ttft_over_sum": ttft / (read_s + compute_s),
            "ttft_over_max": ttft / max(read_s, compute_s),
            "decode_bound_s_per_token": rec.get("decode_bound_s_per_token"),
            "decode_over_bound": rec.get("decode_bound_ratio"),
            "decode_sustained_gbps": rec.get("decode_sustained_gbps"),
        }

    def optional_json(name):
        """The last JSON object line of RUN/name, or None when there is none."""
        path = os.path.join(run, name)
        if not os.path.exists(path):
            return None
        objs = [d for d in map(json_object, open(path)) if d is not None]
        return objs[-1] if objs else None

    heat_rec = optional_json("deltafin-heat.out")
    cache = {
        "cache_slots": rec.get("cache_slots"),
        "cache_misses": rec.get("cache_misses"),
        "cache_misses_opt": rec.get("cache_misses_opt"),
        "cache_misses_vs_opt": rec.get("cache_misses_vs_opt"),
        "heat_runs_before": rec.get("expert_heat_runs_before"),
        "heat_run_cache_misses_vs_opt": heat_rec.get("cache_misses_vs_opt") if heat_rec else None,
        "replayed_policies": optional_json("cache-sim.json"),
    }
    fp64 = optional_json("fp64-check.json")

    model_bytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                      if os.path.isfile(os.path.join(model, f)))
    out = {
        "bench": "peer_llama",
        "status": "measured",
        "date": rec.get("date"),
        "machine": rec.get("machine"),
        "git": rec.get("git"),
        "command": command,
        "cgroup_limit_bytes": limit,
        # the 1/5/15-minute load when the record was made: other processes share these cores
        "loadavg_at_end": open("/proc/loadavg").read().split()[:3],
        "model": {
            "synth": synth_args,
            "bytes": model_bytes,
            "over_limit": model_bytes / limit,
            "moe_layers": moe_layers,
            "experts": n_exp,
            "top_k": top_k,
            "expert_bytes": expert_bytes,
            "routed_bytes_per_token": routed_per_token,
        },
        "prompt_tokens": prompt,
        "decode_tokens": steps,
        "decode_ratio": deltafin["decode_tok_s"] / llama["decode_tok_s"],
        "prefill_ratio": deltafin["prefill_tok_s"] / llama["prefill_tok_s"],
        "deltafin": deltafin,
        "llama_cpp": llama,
        "ttft_bounds": bounds,
        "cache": cache,
        "fp64_check": fp64,
        "tokens_identical_to_fp64": fp64.get("identical") if fp64 else None,
        "notes": [
            "both sides cold (page cache dropped) in the same memory cgroup; llama-bench -r 1 --no-warmup, one process per phase",
            "same prompt ids: llama-bench's unseeded rand() stream (bench/llama_bench_ids.py) given to deltafin as --prompt-ids",
            "deltafin's route heat was learned by one short run on other text (the built-in prompt) before the measured run",
            "decode: deltafin generates after its prompt (context 512..543); llama-bench tg starts from an empty context",
            "bytes per token: /proc/PID/io read_bytes over each phase's timed window (see bench/peer_record.py)",
        ],
        "deltafin_bench_run": rec,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

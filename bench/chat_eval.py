#!/usr/bin/env python3
"""Does the demo talk? Chats, forced tool calls and JSON answers through the official `openai`
client against `deltafin serve`, on passages the model never trained on (issue 53's measures).

    python3 bench/chat_eval.py [--model DIR | (the embedded demo)] [--n 100] [--out FILE.jsonl]

Needs a Python with `openai` (tests/pyenv.py makes one: target/py-venv/bin/python). Starts
`deltafin serve` on a free port (the release binary, or --bin), then:
- chats: --n prompts about held-out passages (bench/data/heldout-windows.jsonl: windows of the
  held-out documents), each a question or request in one of several phrasings (some never seen in
  training), greedy and at temperature 0.7 (seeded), no max_tokens (the server's default cap):
  the share that end by themselves (finish_reason "stop") and the median answer length in tokens;
- tool calls: --n forced calls (`tool_choice` required or a named function, alternating) of tools
  whose arguments include free `string`s with no maxLength, max_tokens 200, half of them streamed:
  the share that come back as `tool_calls` whose arguments parse and validate against the schema;
- JSON: 20 `json_schema` answers whose schema has free strings: the share that validate.
One JSON record (appended to --out) and a Markdown table on stdout. Exit status 0 whatever the
figures (they are measurements).
"""

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ASKS = [
    "What is the first sentence of this passage?\n\n{t}",
    "Summarise this in one sentence:\n\n{t}",
    "Which names appear in this passage?\n\n{t}",
    "{t}\n\nHow many sentences are above?",
    "Continue this text:\n\n{t}",
    "Quote the last sentence of this:\n\n{t}",
    # Phrasings the tuning never used.
    "Here is a passage.\n\n{t}\n\nWhat is it about?",
    "Read this and tell me who is mentioned.\n\n{t}",
    "In a few words, what happens here?\n\n{t}",
    "Give me the opening line of the following text.\n\n{t}",
]

TOOLS = [
    {"type": "function", "function": {"name": "search_library", "description": "Search the library.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "send_note", "description": "Send a note to someone.",
     "parameters": {"type": "object", "properties": {"recipient": {"type": "string"}, "message": {"type": "string"}},
                    "required": ["recipient", "message"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "add_event", "description": "Add a calendar event.",
     "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "day": {"type": "integer"},
                                                     "guests": {"type": "array", "items": {"type": "string"}}},
                    "required": ["title", "day"]}}},
]
TOOL_ASKS = {
    "search_library": ["Find me passages about {w}.", "Search for \"{w}\" in the library.", "Look up texts on {w}."],
    "send_note": ["Send {n} a note saying: {s}", "Tell {n} this: {s}", "Write to {n}: {s}"],
    "get_weather": ["What's the weather in {c}?", "Is it cold in {c} today?"],
    "add_event": ["Add \"{s}\" to my calendar on day {d}.", "Schedule {s} on the {d}th with {n}."],
}
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Bristol", "Kyoto", "Quebec", "Perth"]
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"},
                                           "people": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "summary", "people"]}


def validate(v, schema):
    """The subset of JSON schema these schemas use."""
    t = schema.get("type")
    if "enum" in schema and v not in schema["enum"]:
        return False
    if t == "object":
        if not isinstance(v, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in v for k in schema.get("required", [])):
            return False
        return all(k in props and validate(x, props[k]) for k, x in v.items())
    if t == "array":
        return isinstance(v, list) and all(validate(x, schema.get("items", {})) for x in v)
    if t == "string":
        return isinstance(v, str)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    return True


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start(args):
    port = free_port()
    cmd = [args.bin, "serve", "--port", str(port), "-q", "--memory-gb", "4"]
    cmd += ["--model", args.model] if args.model else ["--demo"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if p.poll() is not None:
                sys.exit(f"the server did not start: {p.stderr.read()}")
            time.sleep(0.3)
    sys.exit("the server did not start in 120 s")


def passages(n, seed):
    rows = [json.loads(x) for x in open(os.path.join(ROOT, "bench/data/heldout-windows.jsonl")) if x.strip()]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rows[i % len(rows)]["text"]
        sents = re.split(r"(?<=[.!?])\s+", t.strip())
        k = rng.randint(2, min(5, max(2, len(sents))))
        out.append(" ".join(sents[:k])[:700])
    return out


def chats(client, model, n, temperature, seed):
    ps = passages(n, seed)
    ended, lengths = 0, []
    for i, t in enumerate(ps):
        q = ASKS[i % len(ASKS)].format(t=t)
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                           temperature=temperature, seed=seed + i)
        ended += r.choices[0].finish_reason == "stop"
        lengths.append(r.usage.completion_tokens)
    return {"prompts": n, "temperature": temperature, "ended_share": ended / n,
            "median_tokens": statistics.median(lengths), "max_tokens_seen": max(lengths)}


def one_call(client, model, tool, q, named, stream):
    choice = {"type": "function", "function": {"name": tool["function"]["name"]}} if named else "required"
    kw = dict(model=model, messages=[{"role": "user", "content": q}], tools=[tool] + [x for x in TOOLS if x is not tool][:1],
              tool_choice=choice, max_tokens=200, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], r.choices[0].finish_reason
    names, args, finish = {}, {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for c in d.tool_calls or []:
            if c.function and c.function.name:
                names[c.index] = c.function.name
            if c.function and c.function.arguments:
                args[c.index] = args.get(c.index, "") + c.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return [(names.get(i), args.get(i, "")) for i in sorted(names)], finish


def tool_calls(client, model, n, seed):
    """Each call asked twice, plain and streamed: both must validate (and they must agree: the same
    request gives the same tokens either way)."""
    rng = random.Random(seed)
    ps = passages(n, seed + 1)
    ok = {False: 0, True: 0}
    agree = 0
    for i in range(n):
        tool = TOOLS[i % len(TOOLS)]
        name = tool["function"]["name"]
        words = re.findall(r"[A-Za-z]{4,}", ps[i]) or ["whales"]
        names = [w for w in words if w[0].isupper()] or ["Anne"]
        sent = ps[i].split(". ")[0][:160]
        q = rng.choice(TOOL_ASKS[name]).format(w=rng.choice(words).lower(), n=rng.choice(names), s=sent,
                                               c=rng.choice(CITIES), d=rng.randint(1, 28))
        got = {}
        for stream in (False, True):
            calls, finish = one_call(client, model, tool, q, named=i % 2 == 0, stream=stream)
            got[stream] = calls
            good = False
            if calls and finish == "tool_calls":
                try:
                    fn = next(t for t in TOOLS if t["function"]["name"] == calls[0][0])
                    good = validate(json.loads(calls[0][1]), fn["function"]["parameters"])
                except (StopIteration, ValueError):
                    good = False
            ok[stream] += good
        agree += got[False] == got[True]
    return {"calls": n, "valid_share": (ok[False] + ok[True]) / (2 * n), "plain_valid_share": ok[False] / n,
            "streamed_valid_share": ok[True] / n, "plain_equals_streamed": agree / n}


def json_answers(client, model, n, seed):
    ps = passages(n, seed + 2)
    ok = 0
    fmt = {"type": "json_schema", "json_schema": {"name": "passage", "schema": SCHEMA}}
    for t in ps:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe this passage as JSON.\n\n" + t}],
                                           response_format=fmt, max_tokens=400, temperature=0)
        try:
            ok += validate(json.loads(r.choices[0].message.content), SCHEMA) and r.choices[0].finish_reason == "stop"
        except ValueError:
            pass
    return {"answers": n, "valid_share": ok / n}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/deltafin"))
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--json-n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args()
    import openai

    proc, base = start(a)
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        t0 = time.time()
        rec = {"bench": "chat_eval", "date": time.strftime("%Y-%m-%d"), "model": a.model or "demo",
               "chats_greedy": chats(client, model, a.n, 0.0, a.seed),
               "chats_t07": chats(client, model, a.n, 0.7, a.seed),
               "tool_calls": tool_calls(client, model, a.n, a.seed),
               "json_schema": json_answers(client, model, a.json_n, a.seed)}
        rec["seconds"] = round(time.time() - t0, 1)
    finally:
        proc.terminate()
        proc.wait()
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    g, s = rec["chats_greedy"], rec["chats_t07"]
    print("| measure | greedy | T=0.7 | goal |\n|---|---|---|---|")
    print(f"| chats that end by themselves | {g['ended_share']:.2f} | {s['ended_share']:.2f} | >= 0.95 |")
    print(f"| median answer (tokens) | {g['median_tokens']} | {s['median_tokens']} | <= 120 |")
    tc = rec["tool_calls"]
    print(f"| forced tool calls, free strings, valid in 200 tokens | {tc['plain_valid_share']:.2f} plain | "
          f"{tc['streamed_valid_share']:.2f} streamed ({tc['plain_equals_streamed']:.2f} identical) | >= 0.95 |")
    print(f"| json_schema answers that validate | {rec['json_schema']['valid_share']:.2f} | | all 20 |")


if __name__ == "__main__":
    main()

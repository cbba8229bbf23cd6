"""Tool calls and enforced output through the official `openai` client against `deltafin serve`
on the demo model (driven by tests/tool_calls.rs).

    python tools.py BASE_URL MODEL SCENARIO

Scenarios: `enforced` asserts every enforced request (tool_choice required / named,
response_format json_object / json_schema, plain and streamed) gives a well-formed call or a
value that validates, and prints one JSON line of the answers for the Rust side to compare across
servers; `hostile` asserts the refusals (400 naming the field, with a message that says why).
"""

import json
import sys

import openai

BASE, MODEL, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time now."}}
TOOLS = [WEATHER, NOW]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


def client():
    return openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0)


def validate(v, schema=SCHEMA):
    """The checks SCHEMA (and WEATHER's parameters) need, by hand (jsonschema when installed)."""
    try:
        import jsonschema
        jsonschema.validate(v, schema)
        return
    except ImportError:
        pass
    assert isinstance(v, dict), v
    props = schema["properties"]
    assert set(schema["required"]) <= set(v) <= set(props), v
    for k, x in v.items():
        p = props[k]
        t = p.get("type")
        if t == "string":
            assert isinstance(x, str) and len(x) <= p.get("maxLength", 1 << 30), (k, x)
        elif t == "integer":
            assert isinstance(x, int) and not isinstance(x, bool), (k, x)
            assert p.get("minimum", -1 << 62) <= x <= p.get("maximum", 1 << 62), (k, x)
        elif t == "boolean":
            assert isinstance(x, bool), (k, x)
        elif t == "array":
            assert isinstance(x, list) and len(x) <= p["maxItems"] and all(i in p["items"]["enum"] for i in x), (k, x)
        elif "enum" in p:
            assert x in p["enum"], (k, x)


def check_call(call, allowed=("get_weather", "now")):
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name in allowed, call
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        validate(args, WEATHER["function"]["parameters"])
    else:
        assert args == {}, args
    return {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}


def stream(req):
    """A streamed answer put back together from its deltas (tool calls by index)."""
    text, reasoning, finish, calls = "", "", None, {}
    for ch in client().chat.completions.create(stream=True, **req):
        if not ch.choices:
            continue
        d = ch.choices[0]
        text += d.delta.content or ""
        reasoning += (d.delta.model_extra or {}).get("reasoning_content") or ""
        finish = d.finish_reason or finish
        for tc in d.delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert c["id"] is None, "a call's id comes once"
                c["id"] = tc.id
            if tc.function and tc.function.name:
                assert c["name"] is None and c["arguments"] == "", "the name comes first"
                c["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
    assert sorted(calls) == list(range(len(calls))), calls
    return text, finish, [calls[i] for i in sorted(calls)]


def enforced():
    c = client()
    out = []
    base = dict(model=MODEL, max_tokens=160, seed=5)
    for effort in ["none", "low"]:
        for temp in [0, 0.9]:
            kw = dict(base, reasoning_effort=effort, temperature=temp)
            # tool_choice required: always a call, of a given tool, with arguments of its schema.
            for parallel in [True, False]:
                r = c.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=parallel, **kw)
                ch = r.choices[0]
                if ch.finish_reason == "length":
                    out.append(["length"])
                    continue
                assert ch.finish_reason == "tool_calls", ch
                calls = ch.message.tool_calls
                assert calls and (parallel or len(calls) == 1), calls
                got = [check_call(x) for x in calls]
                assert len({x["id"] for x in got}) == len(got), got
                out.append(got)
                # Streamed: the same calls, as deltas.
                text, finish, scalls = stream(dict(messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=parallel, **kw))
                assert finish == "tool_calls" and scalls == got, (finish, scalls, got)
            # A named function: one call of it; a tool with no parameters gets {}.
            for name in ["get_weather", "now"]:
                r = c.chat.completions.create(messages=ASK, tools=TOOLS, **kw,
                                              tool_choice={"type": "function", "function": {"name": name}})
                ch = r.choices[0]
                if ch.finish_reason == "length":
                    continue
                assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
                out.append([check_call(ch.message.tool_calls[0], (name,))])
            # response_format json_schema (strict) and json_object: the content parses and validates.
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
            msgs = [{"role": "user", "content": "Describe a person as JSON."}]
            r = c.chat.completions.create(messages=msgs, response_format=fmt, **kw)
            ch = r.choices[0]
            if ch.finish_reason == "stop":
                validate(json.loads(ch.message.content))
            out.append([ch.finish_reason, ch.message.content])
            text, finish, _ = stream(dict(messages=msgs, response_format=fmt, **kw))
            assert (finish, text) == (ch.finish_reason, ch.message.content), (finish, text)
            r = c.chat.completions.create(messages=msgs, response_format={"type": "json_object"}, **kw)
            ch = r.choices[0]
            if ch.finish_reason == "stop":
                assert isinstance(json.loads(ch.message.content), dict), ch.message.content
            out.append([ch.finish_reason, ch.message.content])
    # tool_choice auto and none answer (content or calls), never fail.
    for choice in ["auto", "none"]:
        r = c.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, **base)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls"), ch
        if choice == "none":
            assert not ch.message.tool_calls, ch
    # A conversation with calls and their results in it is taken.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = c.chat.completions.create(messages=history, tools=TOOLS, **base)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The demo model thinks long and writes long strings: some answers end at max_tokens. Every
    # one that ended validated above; enough of them end.
    whole = sum(1 for o in out if o and o[0] != "length")
    assert whole >= len(out) // 3, f"too few answers ended within max_tokens: {out}"
    sys.stderr.write(f"{whole} of {len(out)} enforced answers ended within max_tokens\n")
    print(json.dumps(out))


def expect_400(param, words, **req):
    try:
        client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **req)
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("param") == param, f"param {body.get('param')!r} != {param!r}: {e}"
        msg = body.get("message", "")
        assert all(w in msg for w in words), f"{msg!r} lacks {words}"
        return
    raise AssertionError(f"expected a 400 naming {param}")


def bomb(levels):
    """`levels` of allOf over two $refs to the level below, ending in a string pattern: 2^levels
    expansions from a schema of under 2 KB."""
    defs = {"l0": {"type": "string", "pattern": "^[a-z]+$"}}
    for i in range(1, levels + 1):
        defs[f"l{i}"] = {"allOf": [{"$ref": f"#/$defs/l{i - 1}"}, {"$ref": f"#/$defs/l{i - 1}"}]}
    return {"$defs": defs, "$ref": f"#/$defs/l{levels}"}


def schema_bombs(fmt):
    """Schemas that would cost the server seconds and gigabytes (or never finish) are 400s in well
    under a second, three at once too."""
    import concurrent.futures
    import time

    cases = [(bomb(24), "expands past"), ({"$ref": "#"}, "refers back to itself"),
             ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
              "refers back to itself"),
             ({"type": "string", "minLength": 10 ** 9}, "minLength"),
             ({"type": "array", "minItems": 10 ** 9}, "minItems")]
    for schema, words in cases:
        t0 = time.time()
        expect_400("response_format", ["cannot enforce", words], response_format=fmt(schema))
        assert time.time() - t0 < 1.0, f"{words}: {time.time() - t0:.2f} s"
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        list(ex.map(lambda _: expect_400("response_format", ["expands past"], response_format=fmt(bomb(24))), range(3)))
    assert time.time() - t0 < 3.0, f"three bombs at once: {time.time() - t0:.2f} s"
    bomb_tools = [{"type": "function", "function": {"name": "f", "parameters": bomb(24)}}]
    expect_400("tool_choice", ["expands past"], tools=bomb_tools, tool_choice="required")


def hostile():
    fmt = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    expect_400("response_format", ["cannot enforce response_format"], response_format=fmt({"type": "frobnicate"}))
    expect_400("response_format", ["cannot enforce"], response_format=fmt({"$ref": "#/$defs/missing"}))
    expect_400("response_format", ["cannot enforce"], response_format=fmt({"type": "string", "pattern": "("}))
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(6000)}}
    expect_400("response_format", ["bytes of JSON", "at most"], response_format=fmt(huge))
    expect_400("response_format.json_schema.name", ["name"], response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    expect_400("response_format.type", ["not supported"], response_format={"type": "xml"})
    expect_400("response_format.json_schema", ["json_schema"], response_format={"type": "json_schema"})
    expect_400("tool_choice.function.name", ["'nope'", "not one of the tools", "get_weather"],
               tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    expect_400("tool_choice", ["needs 'tools'"], tool_choice="required")
    expect_400("tool_choice", ["unknown tool_choice"], tools=TOOLS, tool_choice="sometimes")
    expect_400("tools[0].function.name", ["must be 1 to 64"],
               tools=[{"type": "function", "function": {"name": "bad name!"}}])
    expect_400("tools[1].function.name", ["two tools"], tools=[WEATHER, WEATHER])
    expect_400("tools[0].function.parameters", ["JSON schema object"],
               tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}])
    expect_400("tools[0].type", ["not supported"], tools=[{"type": "retrieval"}])
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}
    expect_400("tool_choice", ["cannot enforce tool_choice"], tools=[bad_params], tool_choice="required")
    expect_400("response_format", ["cannot both"], tools=TOOLS, tool_choice="required",
               response_format={"type": "json_object"})
    schema_bombs(fmt)
    # Tools with no parameters and an empty tool list are fine.
    r = client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, tools=[NOW])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, tools=[])
    assert r.choices[0].finish_reason in ("stop", "length")


{"enforced": enforced, "hostile": hostile}[SCENARIO]()

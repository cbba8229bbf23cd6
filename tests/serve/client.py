"""The official `openai` client against a running `deltafin serve` (driven by tests/serve.rs).

    python client.py BASE_URL MODEL SCENARIO [KEY]

Each scenario asserts and exits non-zero on the first failure; `reuse` and `fresh` print one JSON
line for the Rust side to compare across servers.
"""

import json
import sys
import threading
import time

import httpx
import openai

BASE, MODEL, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]
KEY = sys.argv[4] if len(sys.argv) > 4 else "none"


def client(key=KEY, **kw):
    return openai.OpenAI(base_url=BASE + "/v1", api_key=key, max_retries=0, **kw)


def expect_error(cls, param, fn):
    try:
        fn()
    except cls as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("param") == param, f"param {body.get('param')!r} != {param!r}: {e}"
        return e
    raise AssertionError(f"expected {cls.__name__} naming {param}")


USER = [{"role": "user", "content": "Tell me about drives."}]


def basic():
    c = client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, reasoning_effort="none")
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("length", "stop"), r
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    ext = r.model_extra["deltafin"]
    for k in ["ttft_s", "read_amplification", "bytes_read", "cache_hits", "drafts_accepted", "prompt_tokens_reused"]:
        assert k in ext, k
    # The stream gives the same greedy text, then usage, then [DONE].
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, reasoning_effort="none",
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text, (streamed, text)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert "deltafin" in chunks[-1].model_extra
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # Completions, plain and streamed, with logprobs.
    r = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, logprobs=2)
    assert r.object == "text_completion" and len(r.choices[0].logprobs.tokens) == 5
    assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)
    s = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, stream=True))
    assert s == r.choices[0].text, (s, r.choices[0].text)
    # Chat logprobs.
    r = c.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, logprobs=True, top_logprobs=3,
                                  reasoning_effort="none")
    lp = r.choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    # A stop string cuts the text before it.
    full = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12).choices[0].text
    cut = full[3:5]
    r = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, stop=[cut])
    assert r.choices[0].text == full[: full.find(cut)] and r.choices[0].finish_reason == "stop", (full, cut, r)
    # Sampling: the same seed gives the same text; temperature 0 is greedy.
    a = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, temperature=1.0, seed=5).choices[0].text
    b = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, temperature=1.0, seed=5).choices[0].text
    assert a == b
    # Thinking on: the thinking channel is reasoning_content.
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, reasoning_effort="low")
    assert r.choices[0].message.model_extra.get("reasoning_content") or r.choices[0].message.content is not None
    # Strict input: each error names its field.
    expect_error(openai.BadRequestError, "n", lambda: c.chat.completions.create(model=MODEL, messages=USER, n=17))
    expect_error(openai.BadRequestError, "bogus",
                 lambda: c.chat.completions.create(model=MODEL, messages=USER, extra_body={"bogus": 1}))
    expect_error(openai.BadRequestError, "temperature",
                 lambda: c.chat.completions.create(model=MODEL, messages=USER, temperature=5))
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    expect_error(openai.BadRequestError, "messages[0].content[0].type",
                 lambda: c.chat.completions.create(model=MODEL, messages=img))
    expect_error(openai.BadRequestError, "messages",
                 lambda: c.chat.completions.create(model=MODEL, messages=[]))
    expect_error(openai.BadRequestError, "max_tokens",
                 lambda: c.chat.completions.create(model=MODEL, messages=USER, max_tokens=10**9))
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    expect_error(openai.BadRequestError, "tools",
                 lambda: c.chat.completions.create(model=MODEL, messages=USER, tools=tool))
    expect_error(openai.BadRequestError, "max_tokens",
                 lambda: c.chat.completions.create(model=MODEL, messages=USER, max_tokens=10**9, stream=True))
    expect_error(openai.NotFoundError, "model", lambda: c.chat.completions.create(model="gpt-4o", messages=USER))
    r = httpx.post(BASE + "/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    print("basic ok")


def auth():
    ok = client().chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="none")
    assert ok.choices[0].message.content is not None
    for bad in ["wrong", ""]:
        try:
            client(key=bad or "x" * len(KEY)).models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.body.get("code") == "invalid_api_key"
    r = httpx.get(BASE + "/v1/models")
    assert r.status_code == 401, r
    assert httpx.get(BASE + "/health").status_code == 200, "health needs no key"
    print("auth ok")


def queue():
    """--queue 1: of 6 long requests at once, one runs, one waits, the rest get 429 with Retry-After."""
    results = []

    def one():
        try:
            client().completions.create(model=MODEL, prompt="Hi", max_tokens=1500)
            results.append(200)
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after", "").isdigit(), e.response.headers
            results.append(429)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(200) == 2 and results.count(429) == 4, results
    print("queue ok", results)


def metric(name):
    for line in httpx.get(BASE + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def end_bias():
    """A logit_bias keeping the end tokens out ([EOS] ends plain text too): for long requests."""
    info = httpx.get(BASE + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    return {str(info["eos_token_id"]): -100, str(info["end_of_message_token_id"]): -100}


def disconnect():
    """A streaming client that goes away cancels its generation at the next token."""
    before = metric("deltafin_cancelled_total")
    gen_before = metric("deltafin_generated_tokens_total")
    s = client().completions.create(model=MODEL, prompt="Hi", max_tokens=5000, stream=True, logit_bias=end_bias())
    for i, _ in enumerate(s):
        if i == 2:
            break
    s.close()
    t0 = time.time()
    while metric("deltafin_cancelled_total") == before:
        assert time.time() - t0 < 20, "the generation was not cancelled"
        time.sleep(0.05)
    generated = metric("deltafin_generated_tokens_total") - gen_before
    assert generated < 5000, generated
    # A plain (not streamed) request whose connection closes is cancelled too.
    before = metric("deltafin_cancelled_total")
    try:
        httpx.post(BASE + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5000, "logit_bias": end_bias()},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
        raise AssertionError("5000 tokens in 0.3 s: make the request longer")
    except httpx.TimeoutException:
        pass
    t0 = time.time()
    while metric("deltafin_cancelled_total") == before:
        assert time.time() - t0 < 20, "the plain request was not cancelled"
        time.sleep(0.05)
    # The server is free at once for the next request.
    t0 = time.time()
    client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert time.time() - t0 < 10
    print("disconnect ok", int(generated), "tokens before the cancel")


def conversation():
    """Two chat turns; prints turn 2's answer, logprobs, cached tokens and TTFT."""
    c = client()
    first = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, reasoning_effort="none")
    history = USER + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=6, reasoning_effort="none",
                                       logprobs=True, top_logprobs=2)
    # Greedy without logprobs is memoised: the repeat costs no compute.
    plain = c.chat.completions.create(model=MODEL, messages=history, max_tokens=6, reasoning_effort="none")
    again = c.chat.completions.create(model=MODEL, messages=history, max_tokens=6, reasoning_effort="none")
    assert again.choices[0].message.content == plain.choices[0].message.content
    print(json.dumps({
        "turn1": first.choices[0].message.content,
        "turn2": second.choices[0].message.content,
        "turn2_logprobs": [t.logprob for t in second.choices[0].logprobs.content],
        "cached": second.usage.prompt_tokens_details.cached_tokens,
        "prompt_tokens": second.usage.prompt_tokens,
        "ttft_s": second.model_extra["deltafin"]["ttft_s"],
        "repeat": again.choices[0].message.content,
        "repeat_memo": again.model_extra["deltafin"]["memo_hit"],
    }))


def parallel_requests():
    """The 16 requests of `parallel` / `alone`: different prompts, greedy and seeded sampling, logprobs."""
    topics = ["drives", "caches", "experts", "batches", "queues", "reads", "tokens", "layers"]
    reqs = []
    for i in range(16):
        kw = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {"temperature": 0}
        if i % 4 == 3:
            kw["logprobs"] = True
            kw["top_logprobs"] = 2
        reqs.append(dict(model=MODEL, messages=[{"role": "user", "content": f"Tell me about {topics[i % 8]} ({i})."}],
                         max_tokens=24 + i, reasoning_effort="none", **kw))
    return reqs


def stream_one(req):
    """One streamed chat completion: its text, finish reason, log-probabilities and deltafin object."""
    text, finish, lps, ext = "", None, [], None
    for ch in client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **req):
        if ch.choices:
            d = ch.choices[0]
            text += d.delta.content or ""
            finish = d.finish_reason or finish
            if d.logprobs and d.logprobs.content:
                lps += [t.logprob for t in d.logprobs.content]
        if ch.usage is not None:
            ext = ch.model_extra.get("deltafin")
    assert finish in ("stop", "length"), finish
    ext = ext or {}
    return {"text": text, "finish": finish, "logprobs": lps, "batch": ext.get("batch", 1),
            "drafts_accepted": ext.get("drafts_accepted", 0)}


def parallel():
    """16 concurrent streams (started together): each answer well-formed; prints them in order."""
    reqs = parallel_requests()
    out = [None] * len(reqs)
    go = threading.Barrier(len(reqs))

    def one(i):
        go.wait()
        out[i] = stream_one(reqs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), out
    print(json.dumps(out))


def alone():
    """The same 16 requests one after another."""
    print(json.dumps([stream_one(r) for r in parallel_requests()]))


def demo():
    """The demo model as a newcomer meets it: a chat with nothing but a message answers in
    `content` (thinking is off for the demo), bounded by the server's default max_tokens (the
    server runs with --max-tokens-default 24); standard fields of OpenAI's API and vLLM's sampling
    extensions are taken, penalties and `n` too; values out of range are refused by name."""
    c = client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    m = r.choices[0].message
    assert m.content and m.content.strip(), r
    assert not (m.model_extra or {}).get("reasoning_content"), r
    assert r.usage.completion_tokens <= 24 and r.choices[0].finish_reason in ("length", "stop"), r
    for bad in ["<|", "[BOS]", "[EOS]"]:
        assert bad not in m.content, m.content
    # Accepted and ignored (store, metadata, service_tier, user), honoured (top_k, min_p), the same
    # answer as without the ignored ones.
    base = dict(model=MODEL, messages=[{"role": "user", "content": "The sea"}], max_tokens=12, seed=7,
                temperature=0.9)
    plain = c.chat.completions.create(**base, extra_body={"top_k": 40, "min_p": 0.05})
    extra = c.chat.completions.create(**base, store=True, metadata={"run": "test"}, service_tier="auto",
                                      user="u1", extra_body={"top_k": 40, "min_p": 0.05})
    assert plain.choices[0].message.content == extra.choices[0].message.content, (plain, extra)
    assert plain.choices[0].message.content, plain
    # Thinking on when asked: the demo never closes its thinking channel, so the text is reasoning.
    t = c.chat.completions.create(**base, reasoning_effort="high")
    assert t.model_extra.get("deltafin") is not None
    assert (t.choices[0].message.model_extra or {}).get("reasoning_content"), t
    # Penalties are honoured (n choices too); out of range they are refused by name.
    p = c.chat.completions.create(**base, frequency_penalty=0.5, n=2, extra_body={"repetition_penalty": 1.2})
    assert [ch.index for ch in p.choices] == [0, 1], p
    expect_error(openai.BadRequestError, "repetition_penalty",
                 lambda: c.chat.completions.create(**base, extra_body={"repetition_penalty": 0}))
    expect_error(openai.BadRequestError, "frequency_penalty",
                 lambda: c.chat.completions.create(**base, frequency_penalty=2.5))
    print("ok")


SCENARIOS = {"demo": demo, "parallel": parallel, "alone": alone, "basic": basic, "auth": auth, "queue": queue, "disconnect": disconnect, "conversation": conversation}

if __name__ == "__main__":
    SCENARIOS[SCENARIO]()

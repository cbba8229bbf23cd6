"""Chat data for tuning the demo target: conversations built from the corpus, rendered in Kimi K3's
chat template (thinking off, as the demo's generation_config asks) and tokenised with the loss on
the assistant's turns only.

Every conversation is about a passage of a corpus document, with answers taken from the passage
itself (no other model writes them): continue it, quote a sentence of it, summarise it by its
first sentence, name who it mentions, count its sentences, list its sentences, say whether it
mentions a word; greetings; multi-turn follow-ups; tool calls (typed schemas: free strings of
realistic lengths, integers, enums, arrays, nested objects; forced by `tool_choice=required` or
chosen freely), tool results and the answer after them; and JSON answers under a `response_format`
(`json_object` or `json_schema`). Every assistant turn ends with `<|end_of_msg|>`, as the template
closes it.

The renderer (`render`) writes exactly what `deltafin`'s template renders for these messages
(tests/chat/k3_chat_template.jinja with thinking off): tool arguments as a JSON block in the call,
JSON in the tool declaration and schemas with sorted keys and compact separators.
"""

import json
import random
import re

OPEN, SEP, CLOSE, END = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
SPECIALS = {"<|end_of_msg|>": 2, "<|open|>": 3, "<|sep|>": 4, "<|close|>": 5}


def esc(v):
    return str(v).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag, attrs=()):
    return OPEN + tag + "".join(f' {k}="{esc(v)}"' for k, v in attrs) + SEP


def close_tag(tag):
    return CLOSE + tag + SEP


def sorted_json(v):
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def system_internal(kind, body):
    return open_tag("message", [("role", "system"), ("type", kind)]) + body.strip() + close_tag("message") + END


def render(conv, upto=None):
    """The template's text of `conv` = {"messages", "tools"?, "tool_choice"?, "response_format"?},
    as pieces (text, trained): the assistant turns (after their generation prompt) are trained.
    With `upto`, only the messages before index `upto` and then the generation prompt."""
    out = []
    if conv.get("tools"):
        out.append((open_tag("message", [("role", "system"), ("type", "tool-declare")])
                    + "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
                    + sorted_json(conv["tools"]) + "\n```" + close_tag("message") + END, False))
    msgs = conv["messages"] if upto is None else conv["messages"][:upto]
    tool_index, last_calls = 0, None
    for i, m in enumerate(msgs):
        role = m["role"]
        if role in ("user", "system"):
            out.append((open_tag("message", [("role", role)]) + m["content"] + close_tag("message") + END, False))
        elif role == "assistant":
            last_calls, tool_index = m.get("tool_calls"), 0
            out.append((open_tag("message", [("role", "assistant")]) + open_tag("response"), False))
            body = m.get("content") or ""
            body += close_tag("response")
            if m.get("tool_calls"):
                body += open_tag("tools")
                for j, c in enumerate(m["tool_calls"], 1):
                    body += (open_tag("call", [("tool", c["name"]), ("index", j)])
                             + open_tag("json", [("type", "object")]) + c["arguments"] + close_tag("json")
                             + close_tag("call"))
                body += close_tag("tools")
            body += close_tag("message") + END
            out.append((body, True))
        elif role == "tool":
            tool_index += 1
            name = m.get("name") or last_calls[tool_index - 1]["name"]
            out.append((open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
                        + m["content"] + close_tag("message") + END, False))
    # The internal messages the template adds after the conversation (they describe the next turn).
    tail = []
    if conv.get("tool_choice") == "required":
        tail.append(system_internal("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                    "You MUST call tools in the next message."))
    rf = conv.get("response_format")
    if rf == "json_object":
        tail.append(system_internal("response-format", "The system is invoked with `response_format=json_object`.\n"
                                    "Your response must be raw JSON data without markdown code blocks (```json) or any "
                                    "additional formatting."))
    elif isinstance(rf, dict):
        tail.append(system_internal("response-format", "The system is invoked with `response_format=json_schema`.\n"
                                    "Your response must be raw JSON data without markdown code blocks (```json) or any "
                                    "additional formatting.\nThe JSON data must match the following schema:\n```json\n"
                                    + sorted_json(rf) + "\n```"))
    if upto is not None:
        return "".join(t for t, _ in out) + "".join(tail) + open_tag("message", [("role", "assistant")]) + open_tag("response")
    # The last assistant turn answers under the tail's instructions: they come right before it.
    if tail:
        last = max(i for i, (_, tr) in enumerate(out) if tr) - 1
        out.insert(last, ("".join(tail), False))
    return out


def encode(pieces, enc, n_base):
    """Token ids and loss mask of rendered pieces: special tags as their ids, text by `enc`."""
    ids, mask = [], []
    split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
    for text, trained in pieces:
        for part in split.split(text):
            if not part:
                continue
            new = [n_base + SPECIALS[part]] if part in SPECIALS else enc.encode_ordinary(part)
            ids += new
            mask += [trained] * len(new)
    return ids, mask


# --- passages ---------------------------------------------------------------------------------

SENT = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z\"'(])")
STOP = set("""I The A An And But Or If In On At Of To For From By With As It He She They We You His Her Their
Our Your This That These Those Then When Where What Which Who Whom Why How There Here Thus So Yet Nor Not No Yes
All Any Some Every Each Let O Oh Now Mr Mrs Miss Sir Lord God Chapter Verse Book""".split())


def sentences(p):
    return [s.strip() for s in SENT.split(p) if s.strip()]


def passages(docs, rng, n):
    """n passages of 2-6 consecutive sentences (120-600 characters) from the documents'
    paragraphs (a paragraph's sentences are split once and kept)."""
    paras = [(d, p) for d in docs for p in d["text"].split("\n\n") if len(p) >= 120]
    split = {}
    out = []
    tries = 0
    while len(out) < n and tries < n * 20 and paras:
        tries += 1
        i = rng.randrange(len(paras))
        d, para = paras[i]
        if i not in split:
            split[i] = sentences(para)
        s = split[i]
        if len(s) < 2:
            continue
        k = rng.randint(2, min(6, len(s)))
        start = rng.randrange(len(s) - k + 1)
        chosen = s[start:start + k]
        text = " ".join(chosen)
        if 120 <= len(text) <= 600:
            out.append({"text": text, "sents": chosen, "title": d.get("title") or "", "source": d.get("source", "")})
    return out


def names_in(p):
    seen, out = set(), []
    for s in p["sents"]:
        words = re.findall(r"[A-Za-z][A-Za-z'-]*", s)
        for w in words[1:]:
            if w[0].isupper() and w not in STOP and len(w) > 1 and w.lower() not in seen:
                seen.add(w.lower())
                out.append(w)
    return out


def content_words(p):
    ws = re.findall(r"\b[a-z]{5,12}\b", p["text"])
    return list(dict.fromkeys(ws))


def join_names(ns):
    return ns[0] if len(ns) == 1 else ", ".join(ns[:-1]) + " and " + ns[-1]


# --- plain tasks --------------------------------------------------------------------------------

def ask(rng, forms, **kw):
    return rng.choice(forms).format(**kw)


def task_continue(p, rng):
    cut = rng.randint(1, len(p["sents"]) - 1)
    head, rest = " ".join(p["sents"][:cut]), p["sents"][cut:cut + rng.randint(1, 2)]
    q = ask(rng, ["Continue this text:\n\n{t}", "Please continue the following passage.\n\n{t}",
                  "{t}\n\nWhat comes next?", "Write the next sentence of this:\n\n{t}",
                  "Go on from here: {t}"], t=head)
    return q, " ".join(rest)


def task_first(p, rng):
    q = ask(rng, ["What is the first sentence of this passage?\n\n{t}", "Quote the opening sentence:\n\n{t}",
                  "{t}\n\nHow does this passage begin?"], t=p["text"])
    return q, rng.choice(["The first sentence is: \"{s}\"", "{s}", "It begins: \"{s}\""]).format(s=p["sents"][0])


def task_last(p, rng):
    q = ask(rng, ["What is the last sentence of this passage?\n\n{t}", "{t}\n\nQuote the final sentence.",
                  "How does this end?\n\n{t}"], t=p["text"])
    return q, rng.choice(["The last sentence is: \"{s}\"", "{s}", "It ends: \"{s}\""]).format(s=p["sents"][-1])


def task_summary(p, rng):
    q = ask(rng, ["Summarise this in one sentence:\n\n{t}", "Give me a one-line summary.\n\n{t}",
                  "{t}\n\nWhat is this passage about, in a sentence?", "TL;DR:\n\n{t}"], t=p["text"])
    return q, rng.choice(["In short: {s}", "{s}", "The passage says: {s}"]).format(s=p["sents"][0])


def task_names(p, rng):
    ns = names_in(p)
    q = ask(rng, ["Which names appear in this passage?\n\n{t}", "{t}\n\nWho or what is named here?",
                  "List the proper names in the following text.\n\n{t}"], t=p["text"])
    if not ns:
        return q, "No names appear in the passage."
    return q, rng.choice(["The passage mentions {n}.", "Names: {n}.", "It names {n}."]).format(n=join_names(ns[:8]))


def task_count(p, rng):
    q = ask(rng, ["How many sentences are in this passage?\n\n{t}", "{t}\n\nCount the sentences above."],
            t=p["text"])
    n = len(p["sents"])
    return q, rng.choice(["There are {n} sentences.", "{n}.", "It has {n} sentences."]).format(n=n)


def task_list(p, rng):
    q = ask(rng, ["List the sentences of this passage as bullet points.\n\n{t}",
                  "{t}\n\nBreak this into a bulleted list, one sentence per line."], t=p["text"])
    return q, "\n".join("- " + s for s in p["sents"])


def task_mentions(p, rng):
    ws = content_words(p)
    if not ws:
        return task_first(p, rng)
    if rng.random() < 0.5:
        w = rng.choice(ws)
        s = next(s for s in p["sents"] if re.search(r"\b" + w + r"\b", s))
        q = ask(rng, ["Does this passage mention \"{w}\"?\n\n{t}", "{t}\n\nIs the word \"{w}\" used here?",
                      "Quote the sentence that contains the word \"{w}\".\n\n{t}"], w=w, t=p["text"])
        return q, rng.choice(["Yes: \"{s}\"", "Yes. The sentence is: \"{s}\"", "{s}"]).format(s=s)
    w = rng.choice(["whale", "railway", "telephone", "banana", "computer", "volcano", "airplane", "garden"])
    if w in p["text"].lower():
        return task_first(p, rng)
    q = ask(rng, ["Does this passage mention \"{w}\"?\n\n{t}", "{t}\n\nIs the word \"{w}\" used here?"],
            w=w, t=p["text"])
    return q, rng.choice(["No, it does not mention \"{w}\".", "No."]).format(w=w)


GREETINGS = [
    ("Hello", "Hello! Give me a passage of text and I can continue it, quote it or summarise it."),
    ("Hi!", "Hi! What would you like to read or write today?"),
    ("Who are you?", "I am a small demo model with Kimi K3's architecture, trained on public-domain English."),
    ("What can you do?", "I can continue a passage, quote or list its sentences, name who it mentions, "
                         "call tools you give me and answer in JSON."),
    ("Thanks!", "You are welcome."),
    ("Thank you, that helps.", "Glad it helped."),
    ("Good morning", "Good morning! What shall we read?"),
    ("Tell me about yourself in one line.", "A small model that reads and writes English prose."),
]

PLAIN = [task_continue, task_first, task_last, task_summary, task_names, task_count, task_list, task_mentions]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
           "You answer questions about texts.", "Be helpful and brief."]
FOLLOW = [
    ("Now quote its last sentence.", lambda p: p["sents"][-1]),
    ("And the first sentence?", lambda p: p["sents"][0]),
    ("How many sentences was that?", lambda p: f"{len(p['sents'])} sentences."),
    ("Which names does it mention?", lambda p: (f"It mentions {join_names(names_in(p)[:8])}." if names_in(p)
                                                 else "It mentions no names.")),
]


def plain_conv(p, rng):
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.08:
        q, a = rng.choice(GREETINGS)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q, a = rng.choice(PLAIN)(p, rng)
    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    for _ in range(rng.choice([0, 0, 1, 2])):
        q, f = rng.choice(FOLLOW)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f(p)}]
    return {"messages": msgs}


# --- tools --------------------------------------------------------------------------------------

def fn(name, desc, props, required):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


S = {"type": "string"}
TOOLS = {
    "get_weather": fn("get_weather", "Current weather in a city.",
                      {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "search_passages": fn("search_passages", "Search the library for passages.",
                          {"query": S, "max_results": {"type": "integer"}}, ["query"]),
    "save_note": fn("save_note", "Save a note.",
                    {"title": S, "body": S, "tags": {"type": "array", "items": S}}, ["title", "body"]),
    "lookup_word": fn("lookup_word", "Look a word up in the dictionary.", {"word": S}, ["word"]),
    "send_message": fn("send_message", "Send a message to a person.", {"to": S, "text": S}, ["to", "text"]),
    "create_event": fn("create_event", "Put an event in the calendar.",
                       {"title": S, "date": S, "attendees": {"type": "array", "items": S},
                        "location": {"type": "object", "properties": {"city": S, "country": S},
                                     "required": ["city"]}}, ["title", "date"]),
    "translate": fn("translate", "Translate text.",
                    {"text": S, "target_language": {"type": "string", "enum": ["French", "German", "Spanish",
                                                                                 "Italian"]}},
                    ["text", "target_language"]),
    "count_words": fn("count_words", "Count the words of a text.", {"text": S}, ["text"]),
}
CITIES = [("Paris", "France"), ("London", "England"), ("Boston", "USA"), ("Rome", "Italy"), ("Madrid", "Spain"),
          ("Berlin", "Germany"), ("Dublin", "Ireland"), ("Lisbon", "Portugal"), ("Vienna", "Austria"),
          ("Edinburgh", "Scotland"), ("New York", "USA"), ("Nantucket", "USA"), ("Bath", "England")]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def words_of(s, rng, lo, hi):
    w = s.split()
    k = min(len(w), rng.randint(lo, hi))
    st = rng.randrange(len(w) - k + 1)
    return " ".join(w[st:st + k]).strip(" ,;:")


def tool_call(p, rng):
    """A request for one tool, its arguments (in the schema's property order) and, for the result
    turn, a result and an answer."""
    name = rng.choice(list(TOOLS))
    s = rng.choice(p["sents"])
    ns = names_in(p) or ["Elizabeth", "Ishmael", "Anne", "Jonah"]
    if name == "get_weather":
        city, _ = rng.choice(CITIES)
        args = {"city": city}
        if rng.random() < 0.5:
            args["unit"] = rng.choice(["celsius", "fahrenheit"])
        q = ask(rng, ["What is the weather in {c}?", "Is it raining in {c}?", "Weather for {c}, please.",
                      "How warm is it in {c} right now?"], c=city)
        t = rng.randint(-5, 35)
        res = {"city": city, "temperature": t, "unit": args.get("unit", "celsius"),
               "conditions": rng.choice(["sunny", "cloudy", "raining", "windy"])}
        ans = f"It is {t} degrees {res['unit'].capitalize()} and {res['conditions']} in {city}."
    elif name == "search_passages":
        topic = words_of(s, rng, 1, 4)
        args = {"query": topic}
        if rng.random() < 0.5:
            args["max_results"] = rng.randint(1, 5)
        q = ask(rng, ["Find passages about {t}.", "Search the library for \"{t}\".", "Look for texts on {t}."],
                t=topic)
        res = {"results": [{"text": s}]}
        ans = f"I found one passage: \"{s}\""
    elif name == "save_note":
        title = words_of(s, rng, 2, 6)
        body = s if rng.random() < 0.6 else p["text"]
        args = {"title": title, "body": body}
        if rng.random() < 0.5:
            args["tags"] = rng.sample(["reading", "quotes", "history", "todo", "ideas"], rng.randint(1, 3))
        q = ask(rng, ["Save a note titled \"{a}\" with this text: {b}", "Make a note called \"{a}\": {b}",
                      "Please write this down as \"{a}\": {b}"], a=title, b=body)
        res = {"ok": True, "id": rng.randint(1, 999)}
        ans = f"Saved the note \"{title}\"."
    elif name == "lookup_word":
        w = rng.choice(content_words(p) or ["whale"])
        args = {"word": w}
        q = ask(rng, ["What does \"{w}\" mean?", "Look up the word {w}.", "Define {w}."], w=w)
        res = {"word": w, "definition": f"a word used in the passage: {words_of(s, rng, 3, 8)}"}
        ans = f"\"{w}\": {res['definition']}."
    elif name == "send_message":
        to, text = rng.choice(ns), words_of(s, rng, 4, 24)
        args = {"to": to, "text": text}
        q = ask(rng, ["Send {n} a message saying \"{t}\"", "Tell {n}: {t}", "Message {n} with: {t}"], n=to, t=text)
        res = {"sent": True}
        ans = f"Sent your message to {to}."
    elif name == "create_event":
        title, (city, country) = words_of(s, rng, 2, 5), rng.choice(CITIES)
        date = f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(1800, 2030)}"
        args = {"title": title, "date": date}
        if rng.random() < 0.6:
            args["attendees"] = rng.sample(ns, min(len(ns), rng.randint(1, 3)))
        if rng.random() < 0.6:
            args["location"] = {"city": city, "country": country} if rng.random() < 0.7 else {"city": city}
        who = f" with {join_names(args['attendees'])}" if "attendees" in args else ""
        where = f" in {city}" if "location" in args else ""
        q = f"Schedule \"{title}\" on {date}{who}{where}."
        res = {"created": True}
        ans = f"Added \"{title}\" on {date} to the calendar."
    elif name == "translate":
        text, lang = words_of(s, rng, 3, 16), rng.choice(["French", "German", "Spanish", "Italian"])
        args = {"text": text, "target_language": lang}
        q = ask(rng, ["Translate into {l}: {t}", "How do you say \"{t}\" in {l}?"], l=lang, t=text)
        res = {"translation": f"[{lang}] {text}"}
        ans = f"In {lang}: {res['translation']}"
    else:
        text = words_of(s, rng, 3, 30)
        args = {"text": text}
        q = ask(rng, ["How many words are in this: {t}", "Count the words of \"{t}\"."], t=text)
        res = {"words": len(text.split())}
        ans = f"It has {res['words']} words."
    props = list(TOOLS[name]["function"]["parameters"]["properties"])
    ordered = {k: args[k] for k in props if k in args}
    return name, ordered, q, res, ans


def tool_conv(p, rng):
    name, args, q, res, ans = tool_call(p, rng)
    others = [t for t in TOOLS if t != name]
    declared = rng.sample(others, rng.randint(0, 3)) + [name]
    rng.shuffle(declared)
    conv = {"tools": [TOOLS[t] for t in declared], "messages": []}
    if rng.random() < 0.2:
        conv["messages"].append({"role": "system", "content": rng.choice(SYSTEMS)})
    conv["messages"].append({"role": "user", "content": q})
    forced = rng.random() < 0.5
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"name": name, "arguments": json.dumps(args, ensure_ascii=False)}]}
    conv["messages"].append(call)
    if forced and rng.random() < 0.5:
        # Forced and answered by the call alone.
        conv["tool_choice"] = "required"
        return conv
    if rng.random() < 0.7:
        conv["messages"].append({"role": "tool", "name": name, "content": json.dumps(res, ensure_ascii=False)})
        conv["messages"].append({"role": "assistant", "content": ans})
    return conv


def no_tool_conv(p, rng):
    """Tools declared, a plain question: answered without a call."""
    conv = plain_conv(p, rng)
    conv["tools"] = [TOOLS[t] for t in rng.sample(list(TOOLS), rng.randint(1, 3))]
    return conv


# --- JSON answers -------------------------------------------------------------------------------

def json_conv(p, rng):
    ns = names_in(p)
    kind = rng.randrange(4)
    if kind == 0:
        schema = {"type": "object", "properties": {"title": S, "first_sentence": S}, "required": ["title", "first_sentence"]}
        ans = {"title": words_of(p["sents"][0], rng, 2, 5), "first_sentence": p["sents"][0]}
        q = "Give a short title and the first sentence of this passage as JSON.\n\n"
    elif kind == 1:
        schema = {"type": "object", "properties": {"names": {"type": "array", "items": S}}, "required": ["names"]}
        ans = {"names": ns[:8]}
        q = "Return the names this passage mentions as JSON.\n\n"
    elif kind == 2:
        schema = {"type": "object", "properties": {"sentences": {"type": "integer"}, "last_sentence": S},
                  "required": ["sentences", "last_sentence"]}
        ans = {"sentences": len(p["sents"]), "last_sentence": p["sents"][-1]}
        q = "Count the sentences and quote the last one, as JSON.\n\n"
    else:
        schema = {"type": "object", "properties": {"summary": S, "has_names": {"type": "boolean"}},
                  "required": ["summary", "has_names"]}
        ans = {"summary": p["sents"][0], "has_names": bool(ns)}
        q = "Summarise this as JSON with a summary and whether it names anyone.\n\n"
    conv = {"messages": [{"role": "user", "content": q + p["text"]},
                         {"role": "assistant", "content": json.dumps(ans, ensure_ascii=False)}]}
    conv["response_format"] = schema if rng.random() < 0.7 else "json_object"
    return conv


def build(docs, n, seed):
    """n conversations from `docs` (dicts with text, title, source), mixed: plain 55%, tools 30%
    (a fifth of them tools declared but not called), JSON 15%."""
    rng = random.Random(seed)
    ps = passages(docs, rng, n)
    out = []
    for p in ps:
        r = rng.random()
        if r < 0.55:
            out.append(plain_conv(p, rng))
        elif r < 0.79:
            out.append(tool_conv(p, rng))
        elif r < 0.85:
            out.append(no_tool_conv(p, rng))
        else:
            out.append(json_conv(p, rng))
    return out

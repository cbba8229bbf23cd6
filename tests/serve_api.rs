//! `deltafin serve`'s API as llama.cpp, vLLM and lm-evaluation-harness users reach for it, on the
//! demo model served for real over plain HTTP: `n` choices (each with its seed, the same answer as
//! asked alone, streamed too), repetition / frequency / presence penalties and `logit_bias`
//! (accepted, changing the answer, out-of-range refused), completions with `echo`, prompt
//! log-probabilities and `max_tokens: 0` (agreeing with a generation's own log-probabilities),
//! vLLM's tokenizer endpoints, response ids unique across processes and `/v1/models`' `created`,
//! the access log marking a client that left as cancelled, a bad schema refused with a short
//! reason, and no special token or template syntax in any text a user reads (a sweep of seeds over
//! `run`, `batch`, completions, chat plain and streamed, and forced tool calls cut by
//! `max_tokens`). lm-evaluation-harness's `local-completions` scoring a local multiple-choice task
//! against the server runs when the harness installs (it skips, saying why, where it cannot).

mod common;
use common::served::Served;
use common::*;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

const MODEL: &str = "m";

fn demo(extra: &[&str]) -> Served {
    let mut args = vec!["--demo", "--model-name", MODEL, "--prefill-rows", "256", "--memory-gb", "2"];
    args.extend_from_slice(extra);
    Served::start(&args)
}

/// `POST path` with `body`: the status and the JSON answer.
fn post(s: &Served, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = s.post(path, &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {status}: {e}: {text}"));
    (status, v)
}

fn ok(s: &Served, path: &str, body: &Value) -> Value {
    let (status, v) = post(s, path, body);
    assert_eq!(status, 200, "{body} -> {v}");
    v
}

/// The events of a streamed answer (chunk framing aside: each event is one chunk).
fn events(s: &Served, path: &str, body: &Value) -> Vec<Value> {
    let (status, text) = s.post(path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

fn chat(content: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}]})
}

fn with(mut v: Value, extra: Value) -> Value {
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn text_of(choice: &Value) -> String {
    choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap_or_default().to_string()
}

#[test]
fn n_choices_penalties_and_logit_bias() {
    let s = demo(&["-q"]);
    let ask = with(chat("Tell me about the sea."), json!({"temperature": 1.0, "max_tokens": 24}));
    let two = ok(&s, "/v1/chat/completions", &with(ask.clone(), json!({"n": 2, "seed": 7})));
    let choices = two["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{two}");
    assert_eq!((choices[0]["index"].clone(), choices[1]["index"].clone()), (json!(0), json!(1)));
    assert_eq!(two["deltafin"]["seeds"], json!([7, 8]), "choice i samples with the seed + i");
    for (i, c) in choices.iter().enumerate() {
        let alone = ok(&s, "/v1/chat/completions", &with(ask.clone(), json!({"seed": 7 + i})));
        assert_eq!(text_of(c), text_of(&alone["choices"][0]), "choice {i} is seed {} asked alone", 7 + i);
    }
    assert_ne!(text_of(&choices[0]), text_of(&choices[1]), "two seeds, two answers");
    let completion = two["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(completion > 24, "both choices' tokens are counted: {}", two["usage"]);
    // Streamed: each choice's chunks carry its index and add up to its answer.
    let evs = events(&s, "/v1/chat/completions", &with(ask.clone(), json!({"n": 2, "seed": 7, "stream": true})));
    for (i, c) in choices.iter().enumerate() {
        let streamed: String = evs
            .iter()
            .filter(|e| e["choices"][0]["index"] == json!(i))
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed, text_of(c), "choice {i} streamed");
        let finishes =
            evs.iter().filter(|e| e["choices"][0]["index"] == json!(i) && !e["choices"][0]["finish_reason"].is_null());
        assert_eq!(finishes.count(), 1, "one finish chunk for choice {i}");
    }
    // Penalties: accepted, and they change a greedy answer of this length.
    let greedy =
        json!({"model": MODEL, "prompt": "The sea, the sea, the sea and the", "temperature": 0, "max_tokens": 48});
    let plain = text_of(&ok(&s, "/v1/completions", &greedy)["choices"][0]);
    for pen in [json!({"repetition_penalty": 1.8}), json!({"frequency_penalty": 2.0}), json!({"presence_penalty": 2.0})]
    {
        let got = text_of(&ok(&s, "/v1/completions", &with(greedy.clone(), pen.clone()))["choices"][0]);
        assert_ne!(got, plain, "{pen} changes the answer");
    }
    // logit_bias: +100 on one token makes every token that one; -100 on the greedy first token
    // makes the first token another.
    let tok = ok(&s, "/tokenize", &json!({"prompt": " zebra"}));
    let ids = tok["tokens"].as_array().unwrap();
    let z = ids[0].as_u64().unwrap();
    let piece = ok(&s, "/detokenize", &json!({"tokens": [z]}))["prompt"].as_str().unwrap().to_string();
    let c = json!({"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 3});
    let forced = ok(&s, "/v1/completions", &with(c.clone(), json!({"logit_bias": {z.to_string(): 100}})));
    assert_eq!(text_of(&forced["choices"][0]), piece.repeat(3), "{forced}");
    let first = ok(&s, "/v1/completions", &with(c.clone(), json!({"max_tokens": 1})));
    let first_id = ok(&s, "/tokenize", &json!({"prompt": text_of(&first["choices"][0])}))["tokens"][0].clone();
    let banned = ok(
        &s,
        "/v1/completions",
        &with(c.clone(), json!({"max_tokens": 1, "logit_bias": {first_id.to_string(): -100}})),
    );
    assert_ne!(text_of(&banned["choices"][0]), text_of(&first["choices"][0]));
    // Out of range: a 400 naming the field.
    for (bad, param) in [
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"logit_bias": {"7": 101}}), "logit_bias"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"logit_bias": {"99999999": 1}}), "logit_bias"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
    ] {
        let (status, v) = post(&s, "/v1/chat/completions", &with(chat("hi"), bad.clone()));
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{bad}: {v}");
    }
}

#[test]
fn echo_prompt_logprobs_and_max_tokens_zero() {
    let s = demo(&["-q"]);
    let prompt = "Once upon a time there was a little";
    let v = ok(
        &s,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 0, "temperature": 0}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["text"], json!(prompt), "{v}");
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), prompt);
    let n = tokens.len();
    assert_eq!(v["usage"]["prompt_tokens"], json!(n));
    assert_eq!(v["usage"]["completion_tokens"], json!(0));
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    for j in 1..n {
        let x = lp["token_logprobs"][j].as_f64().unwrap();
        assert!(x <= 0.0 && x.is_finite(), "{lp}");
        let top = lp["top_logprobs"][j].as_object().unwrap();
        assert_eq!(top.len(), 1);
        assert!(top.values().next().unwrap().as_f64().unwrap() >= x);
    }
    // Each prompt token's log-probability is the one a generation reports for it: the prompt up
    // to it, one greedy token with its log-probability; then that token echoed in a prompt.
    let ids = ok(&s, "/tokenize", &json!({"prompt": prompt}))["tokens"].clone();
    let ids: Vec<u64> = ids.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(ids.len(), n);
    let generated = ok(
        &s,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": ids[..4], "max_tokens": 1, "logprobs": 2, "temperature": 0}),
    );
    let want = generated["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    let next =
        ok(&s, "/tokenize", &json!({"prompt": text_of(&generated["choices"][0])}))["tokens"][0].as_u64().unwrap();
    let mut echoed = ids[..4].to_vec();
    echoed.push(next);
    let e = ok(
        &s,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": echoed, "echo": true, "logprobs": 1, "max_tokens": 0}),
    );
    let got = e["choices"][0]["logprobs"]["token_logprobs"][4].as_f64().unwrap();
    assert!((got - want).abs() < 1e-9, "echoed {got} vs generated {want}");
    // Echo with tokens generated after it: the prompt, then the answer, logprobs for both.
    let v = ok(
        &s,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 2, "temperature": 0}),
    );
    assert!(text_of(&v["choices"][0]).starts_with(prompt), "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), n + 2);
    // max_tokens 0 without echo: nothing, finish length; echo alone: the prompt.
    let v = ok(&s, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 0}));
    assert_eq!((text_of(&v["choices"][0]), v["choices"][0]["finish_reason"].clone()), (String::new(), json!("length")));
    let v = ok(&s, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": true}));
    assert_eq!(text_of(&v["choices"][0]), prompt);
    let (status, v) =
        post(&s, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "echo": true, "stream": true}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("echo")));
    let (status, _) = post(&s, "/v1/chat/completions", &with(chat("hi"), json!({"max_tokens": 0})));
    assert_eq!(status, 400, "a chat answer has at least one token");
    // The tokenizer endpoints agree with each other and with the completions endpoint.
    let info = {
        let (status, body, _) = s.get("/tokenizer_info");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()
    };
    assert_eq!(info["eos_token"], json!("[EOS]"), "{info}");
    let back = ok(&s, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(back["prompt"], json!(prompt));
}

#[test]
fn ids_are_unique_across_processes_and_models_have_a_creation_time() {
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2 {
        let s = demo(&["-q"]);
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let body = if path.ends_with("chat/completions") {
                with(chat("hi"), json!({"max_tokens": 2}))
            } else {
                json!({"model": MODEL, "prompt": "hi", "max_tokens": 2})
            };
            for _ in 0..2 {
                let id = ok(&s, path, &body)["id"].as_str().unwrap().to_string();
                assert!(id != "chatcmpl-1" && id != "cmpl-1", "{id}");
                assert!(seen.insert(id.clone()), "{id} given twice");
            }
        }
        let (_, models, _) = s.get("/v1/models");
        let models: Value = serde_json::from_str(&models).unwrap();
        let created = models["data"][0]["created"].as_u64().unwrap();
        assert!(created > 1_600_000_000, "{models}");
        let (_, one, _) = s.get(&format!("/v1/models/{MODEL}"));
        assert_eq!(serde_json::from_str::<Value>(&one).unwrap()["created"], json!(created));
    }
}

/// Waits until the server's log has a line with every one of `parts`; the line.
fn log_line(s: &Served, parts: &[&str]) -> String {
    let t0 = Instant::now();
    loop {
        let log = s.log.lock().unwrap().clone();
        if let Some(l) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
            return l.to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no line with {parts:?} in\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_that_leaves_is_logged_as_cancelled_and_a_bad_schema_is_refused_briefly() {
    let s = demo(&[]);
    // Streamed: the client reads the first chunk, then leaves.
    let body = with(chat("Tell me a long story."), json!({"max_tokens": 2000, "stream": true, "seed": 1})).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut t = std::net::TcpStream::connect(&s.addr).unwrap();
    t.write_all(head.as_bytes()).unwrap();
    let mut buf = [0u8; 512];
    let _ = t.read(&mut buf).unwrap();
    drop(t);
    let l = log_line(&s, &["POST /v1/chat/completions 200", "finish=cancelled"]);
    assert!(l.starts_with("deltafin: request "), "{l}");
    // Not streamed: the client leaves before the answer (a continuation kept from ending).
    let (_, info, _) = s.get("/tokenizer_info");
    let info: Value = serde_json::from_str(&info).unwrap();
    let ends = json!({info["eos_token_id"].to_string(): -100, info["end_of_message_token_id"].to_string(): -100});
    let body = json!({"model": MODEL, "prompt": "Once", "max_tokens": 4000, "logit_bias": ends}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut t = std::net::TcpStream::connect(&s.addr).unwrap();
    t.write_all(head.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(t);
    log_line(&s, &["POST /v1/completions 499 finish=cancelled"]);
    // A finished answer is not cancelled.
    ok(&s, "/v1/chat/completions", &with(chat("hi"), json!({"max_tokens": 2})));
    log_line(&s, &["POST /v1/chat/completions 200 in=", "finish=length"]);
    // A schema the grammar engine refuses: a 400 with a short reason, no grammar in it.
    let bad = json!({"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "frobnicate"}}});
    let (status, v) = post(&s, "/v1/chat/completions", &with(chat("x"), json!({"response_format": bad})));
    let msg = v["error"]["message"].as_str().unwrap();
    assert_eq!(status, 400, "{v}");
    assert!(msg.len() < 300 && !msg.contains('\n') && !msg.contains("::=") && !msg.contains("%"), "{msg}");
    assert!(
        msg.contains("frobnicate") && !msg.contains(" at 3("),
        "the reason, not the internal grammar's place: {msg}"
    );
}

/// Text a user reads must hold no special token or template syntax.
fn clean(what: &str, text: &str) {
    for bad in ["<|", "[EOS]", "[BOS]", "[PAD]", "[MASK]"] {
        assert!(!text.contains(bad), "{what}: {bad} in {text:?}");
    }
}

#[test]
fn no_special_token_or_template_syntax_reaches_any_text() {
    let s = demo(&["-q"]);
    let prompts = ["The end of the chapter came at last.", "CHAPTER I\n\n", "It was a dark and stormy night;"];
    for seed in 0..6u64 {
        let prompt = prompts[seed as usize % prompts.len()];
        let c = json!({"model": MODEL, "prompt": prompt, "max_tokens": 96, "temperature": 1.0, "seed": seed});
        let v = ok(&s, "/v1/completions", &c);
        clean("completion", &text_of(&v["choices"][0]));
        let evs = events(&s, "/v1/completions", &with(c, json!({"stream": true})));
        let streamed: String = evs.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
        clean("streamed completion", &streamed);
        let q = with(chat(prompt), json!({"max_tokens": 64, "temperature": 1.0, "seed": seed}));
        let v = ok(&s, "/v1/chat/completions", &q);
        clean("chat", &v["choices"][0]["message"].to_string());
        let evs = events(&s, "/v1/chat/completions", &with(q, json!({"stream": true})));
        for e in &evs {
            clean("chat stream", &e["choices"].to_string());
        }
    }
    // A forced tool call cut by max_tokens: no raw call in content, plain or streamed.
    let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    for max in [3, 8, 16, 40] {
        let q = with(
            chat("What is the weather in Paris?"),
            json!({"tools": [weather], "tool_choice": "required", "max_tokens": max, "reasoning_effort": "none"}),
        );
        let v = ok(&s, "/v1/chat/completions", &q);
        let ch = &v["choices"][0];
        clean(&format!("forced call, max_tokens {max}"), &ch["message"].to_string());
        if ch["finish_reason"] == json!("length") {
            assert!(ch["message"]["tool_calls"].is_null(), "{v}");
            assert!(ch["message"]["content"].as_str().unwrap_or_default().is_empty(), "{v}");
        }
        for e in events(&s, "/v1/chat/completions", &with(q, json!({"stream": true}))) {
            clean(&format!("forced call streamed, max_tokens {max}"), &e["choices"].to_string());
        }
    }
    // A continuation that reaches the end of its document (main before the fix printed
    // `[EOS][BOS]` here): it stops there.
    let end =
        json!({"model": MODEL, "prompt": "and so the story ends.", "max_tokens": 600, "temperature": 1.0, "seed": 2});
    let v = ok(&s, "/v1/completions", &end);
    clean("completion to its end", &text_of(&v["choices"][0]));
    let mut c = deltafin_cmd();
    c.args(["run", "--demo", "-q", "--max-new", "600", "--temperature", "1", "--seed", "2"])
        .args(["--prompt", "and so the story ends."]);
    clean("run to its end", &run_ok(&mut c).0);
    // `run` without --chat and `batch`, over the same prompts and seeds.
    for seed in 0..3u64 {
        let mut c = deltafin_cmd();
        c.args(["run", "--demo", "-q", "--max-new", "96", "--temperature", "1", "--seed", &seed.to_string()])
            .args(["--prompt", prompts[seed as usize]]);
        let (out, _) = run_ok(&mut c);
        clean("run", &out);
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            json!({"id": i, "prompt": prompts[i % prompts.len()], "max_tokens": 96, "temperature": 1.0, "seed": i})
                .to_string()
        })
        .chain((0..2).map(|i| {
            json!({"id": 10 + i, "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 48}).to_string()
        }))
        .collect();
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let output = dir.path().join("out.jsonl");
    run_ok(deltafin_cmd().args(["batch", "--demo", "-q", "--in"]).arg(&input).arg("--out").arg(&output));
    let out = std::fs::read_to_string(&output).unwrap();
    assert_eq!(out.lines().count(), 6, "{out}");
    for l in out.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        clean("batch", &v.to_string());
    }
}

/// The tiny multiple-choice task of tests/serve/lm_eval_task, scored by lm-evaluation-harness's
/// `local-completions` model against the server (loglikelihood through `echo`, `logprobs` and the
/// tokenizer endpoints); the harness's accuracy must equal the one computed here from the
/// server's own prompt log-probabilities.
#[test]
fn lm_evaluation_harness_scores_a_local_task_against_the_server() {
    const T: &str = "lm_evaluation_harness_scores_a_local_task_against_the_server";
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().to_path_buf();
    let Some(py) = lm_eval_python(&target) else { return };
    let s = demo(&["-q"]);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/lm_eval_task");
    let tasks = tempfile::tempdir().unwrap();
    let yaml = std::fs::read_to_string(src.join("deltafin_tiny_mc.yaml")).unwrap();
    let docs_path = src.join("docs.jsonl");
    let yaml = yaml.replace("DOCS_JSONL", &docs_path.display().to_string());
    std::fs::write(tasks.path().join("deltafin_tiny_mc.yaml"), yaml).unwrap();
    let out = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let o = std::process::Command::new(&py)
        .args(["-m", "lm_eval", "--model", "local-completions", "--tasks", "deltafin_tiny_mc", "--include_path"])
        .arg(tasks.path())
        .arg("--model_args")
        .arg(format!(
            "model={MODEL},base_url=http://{}/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True,tokenizer_backend=remote",
            s.addr
        ))
        .arg("--output_path")
        .arg(out.path())
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "lm_eval failed:\n{stdout}\n{stderr}\nserver:\n{}", s.log.lock().unwrap());
    eprintln!("{T}: lm_eval took {:.1} s", t0.elapsed().as_secs_f64());
    // Its results file: the accuracy it found.
    let results = find_results(out.path()).unwrap_or_else(|| panic!("no results file:\n{stdout}\n{stderr}"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(results).unwrap()).unwrap();
    let acc = v["results"]["deltafin_tiny_mc"]["acc,none"].as_f64().unwrap_or_else(|| panic!("{v}"));
    // The same accuracy from the server directly: each choice's log-probability after its context.
    let docs = std::fs::read_to_string(&docs_path).unwrap();
    let mut right = 0;
    let mut n = 0;
    for d in docs.lines() {
        let d: Value = serde_json::from_str(d).unwrap();
        let ctx = format!("Question: {}\nAnswer:", d["question"].as_str().unwrap());
        let scores: Vec<f64> = d["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let whole = format!("{ctx} {}", c.as_str().unwrap());
                let ctx_len = ok(&s, "/tokenize", &json!({"prompt": ctx}))["tokens"].as_array().unwrap().len();
                let ids = ok(&s, "/tokenize", &json!({"prompt": whole}))["tokens"].clone();
                let v = ok(
                    &s,
                    "/v1/completions",
                    &json!({"model": MODEL, "prompt": ids, "echo": true, "logprobs": 1, "max_tokens": 0}),
                );
                let lps = v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().clone();
                lps[ctx_len..].iter().map(|x| x.as_f64().unwrap()).sum()
            })
            .collect();
        // The first of the best, as lm_eval's argmax.
        let best = (0..scores.len()).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
        right += usize::from(best as u64 == d["answer"].as_u64().unwrap());
        n += 1;
    }
    let want = right as f64 / n as f64;
    assert!((acc - want).abs() < 1e-9, "lm_eval's accuracy {acc}, the server's log-probabilities give {want}");
}

fn find_results(dir: &Path) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(r) = find_results(&p) {
                return Some(r);
            }
        } else if p.file_name()?.to_string_lossy().starts_with("results") && p.extension()? == "json" {
            return Some(p);
        }
    }
    None
}

/// A Python with lm-evaluation-harness (`lm_eval[api]`, tests/requirements-eval.txt) in its own
/// environment under the target directory, installed on first use; None (the test skipped, saying
/// why) where it cannot be installed. `DELTAFIN_REQUIRE_LM_EVAL=1` makes that a failure.
fn lm_eval_python(target: &Path) -> Option<std::path::PathBuf> {
    const T: &str = "lm_evaluation_harness_scores_a_local_task_against_the_server";
    let venv = target.join("lm-eval-venv");
    let py = venv.join("bin/python");
    let req = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/requirements-eval.txt");
    let stamp = venv.join(".requirements-ok");
    let want = std::fs::read_to_string(&req).unwrap();
    let fail = |why: String| {
        if std::env::var("DELTAFIN_REQUIRE_LM_EVAL").is_ok_and(|v| v == "1") {
            panic!("{T}: {why}");
        }
        skipped(T, &why);
        None
    };
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        let base = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
        let made = std::process::Command::new(&base).args(["-m", "venv", "--clear"]).arg(&venv).status();
        if !made.is_ok_and(|s| s.success()) {
            return fail("python3 -m venv failed (no venv module?)".into());
        }
        let o = std::process::Command::new(&py)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input", "-r"])
            .arg(&req)
            .output();
        match o {
            Ok(o) if o.status.success() => std::fs::write(&stamp, &want).unwrap(),
            Ok(o) => return fail(format!("lm_eval could not be installed: {}", String::from_utf8_lossy(&o.stderr))),
            Err(e) => return fail(format!("lm_eval could not be installed: {e}")),
        }
    }
    Some(py)
}

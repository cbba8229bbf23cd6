//! `deltafin serve` as users meet it: the real server on 127.0.0.1 (a small synth model), the
//! official `openai` Python client (chat and completions, streaming and not, logprobs, stop,
//! seeds, strict errors, auth), `curl -N` for the SSE framing, concurrent clients for the queue
//! and 429, a client that disconnects, limits and garbage that must not wedge the server,
//! conversation reuse, the memo and drafts (identical output to a server without them, counters
//! showing the reuse), 16 concurrent streams in one running batch (drafting on the demo model too), SIGTERM, and the chat page in headless Chromium. Tests that need curl or Chromium skip, saying so,
//! where the machine lacks them (`DELTAFIN_REQUIRE_CHROMIUM=1` / `DELTAFIN_REQUIRE_CURL=1` make that a
//! failure; `.ci/run` installs Chromium and sets the first).

mod common;
use common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

/// A small synth model with tokenizer and chat template, written once per target dir.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-model");
        if !dir.join("config.json").exists() {
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-model.tmp{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            synth_small(&tmp, Some("11"));
            // Another test binary may have won the race; either copy is the same model.
            let _ = std::fs::rename(&tmp, &dir);
            let _ = std::fs::remove_dir_all(&tmp);
        }
        dir
    })
}

const MODEL: &str = "serve-model";

struct Server {
    child: Child,
    base: String,
    stderr: Arc<Mutex<String>>,
    key: Option<String>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let model = ["--model".to_string(), model_dir().display().to_string()];
        Server::start_on(&model, extra)
    }

    /// A server of the trained demo model (`--demo`), named as the client expects.
    fn start_demo(extra: &[&str]) -> Server {
        Server::start_on(&["--demo".into(), "--model-name".into(), MODEL.into()], extra)
    }

    fn start_on(model: &[String], extra: &[&str]) -> Server {
        Server::start_with(model, extra, true)
    }

    /// `quiet` false: with the startup line and the access log.
    fn start_with(model: &[String], extra: &[&str], quiet: bool) -> Server {
        let mut child = deltafin_cmd()
            .arg("serve")
            .args(model)
            .args(["--port", "0", "--prefill-rows", "256", "--memory-gb", "2"])
            .args(if quiet { &["-q"][..] } else { &[] })
            // `env:NAME=VALUE` in `extra` sets the server's environment instead.
            .args(extra.iter().filter(|a| !a.starts_with("env:")))
            .envs(extra.iter().filter_map(|a| a.strip_prefix("env:")?.split_once('=')))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let (err, log) = (child.stderr.take().unwrap(), Arc::clone(&stderr));
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                // Logged before the address is sent: a test that reads the log once the server is
                // up sees the line that said so.
                log.lock().unwrap().push_str(&(line.clone() + "\n"));
                if let Some(rest) = line.split("on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            panic!("the server did not start:\n{}", stderr.lock().unwrap());
        });
        let key = extra.iter().position(|a| *a == "--api-key").and_then(|i| extra.get(i + 1)).map(|k| k.to_string());
        Server { child, base: format!("http://{addr}"), stderr, key }
    }

    /// Runs a scenario of tests/serve/client.py; returns its stdout.
    fn client(&self, scenario: &str, key: Option<&str>) -> String {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/client.py");
        let mut c = python();
        c.arg(script).args([&self.base, MODEL, scenario]);
        if let Some(k) = key {
            c.arg(k);
        }
        let o = c.output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "client scenario {scenario} failed:\n{out}\n{}\nserver log:\n{}",
            String::from_utf8_lossy(&o.stderr),
            self.stderr.lock().unwrap()
        );
        out
    }

    fn sigterm(&self) {
        // SAFETY: kill(2) on our own child's pid; no memory is shared.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    /// Waits for the process to end; None after `limit`.
    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn metric(&self, name: &str) -> f64 {
        let text = get(&self.base, "/metrics", self.key.as_deref());
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.sigterm();
        if self.wait(Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// curl's stdout; tests that call it first check that curl is there (`tool(&CURL, ..)`).
fn curl(args: &[&str]) -> String {
    let o = Command::new("curl").args(args).output().expect("curl is needed by these tests");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The body of `GET path` (with the bearer `key`), over a plain connection: the metrics the tests
/// read need no client beyond the standard library.
fn get(base: &str, path: &str, key: Option<&str>) -> String {
    let mut t = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(t, "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    t.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {out:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    body.to_string()
}

#[test]
fn openai_client_chat_completions_streaming_and_errors() {
    let s = Server::start(&[]);
    s.client("basic", None);
    assert!(s.metric("deltafin_generated_tokens_total") > 0.0);
}

#[test]
fn api_key_is_required_when_set() {
    let s = Server::start(&["--api-key", "sekret"]);
    s.client("auth", Some("sekret"));
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let s = Server::start(&["--queue", "1"]);
    s.client("queue", None);
    assert_eq!(s.metric("deltafin_rejected_total"), 4.0);
}

#[test]
fn sixteen_concurrent_streams_run_in_one_batch_each_as_if_alone() {
    let batched: serde_json::Value = {
        let s = Server::start(&["--parallel", "16", "--queue", "0"]);
        serde_json::from_str(s.client("parallel", None).trim()).unwrap()
    };
    let alone: serde_json::Value = {
        let s = Server::start(&["--no-reuse"]);
        serde_json::from_str(s.client("alone", None).trim()).unwrap()
    };
    let (b, a) = (batched.as_array().unwrap(), alone.as_array().unwrap());
    assert_eq!(b.len(), 16);
    for (i, (x, y)) in b.iter().zip(a).enumerate() {
        for k in ["text", "finish", "logprobs"] {
            assert_eq!(x[k], y[k], "request {i}: {k} differs from the request served alone");
        }
        assert_eq!(y["batch"], 1);
    }
    // Started together, they joined one running batch (each answer says the most that shared a step with it).
    let peak = b.iter().map(|x| x["batch"].as_u64().unwrap()).max().unwrap();
    assert_eq!(peak, 16, "{batched}");
}

#[test]
fn drafts_in_a_running_batch_answer_each_stream_as_alone_on_the_demo_model() {
    let alone: serde_json::Value = {
        let s = Server::start_demo(&["--no-reuse"]);
        serde_json::from_str(s.client("alone", None).trim()).unwrap()
    };
    let a = alone.as_array().unwrap();
    // 16 streams started together, 3 or 8 at a time, each drafting with the demo's DSpark drafter.
    for (n, draft) in [(3u64, "dspark"), (8, "dspark"), (3, "auto")] {
        let queue = (16 - n).to_string();
        let batched: serde_json::Value = {
            // The published width policy drafts whenever it may, so drafts really ride in the batch.
            // `auto` under its own policy.
            let policy = if draft == "dspark" { "env:DELTAFIN_DRAFT_POLICY=published" } else { "env:" };
            let s = Server::start_demo(&["--parallel", &n.to_string(), "--queue", &queue, "--draft", draft, policy]);
            serde_json::from_str(s.client("parallel", None).trim()).unwrap()
        };
        let b = batched.as_array().unwrap();
        assert_eq!(b.len(), 16);
        for (i, (x, y)) in b.iter().zip(a).enumerate() {
            for k in ["text", "finish", "logprobs"] {
                assert_eq!(
                    x[k], y[k],
                    "--parallel {n} --draft {draft}, request {i}: {k} differs from it alone without drafts"
                );
            }
        }
        let peak = b.iter().map(|x| x["batch"].as_u64().unwrap()).max().unwrap();
        assert_eq!(peak, n, "{batched}");
        let accepted: u64 = b.iter().map(|x| x["drafts_accepted"].as_u64().unwrap()).sum();
        assert!(
            accepted > 0 || draft == "auto",
            "--parallel {n} --draft {draft}: no draft accepted in the batch: {batched}"
        );
    }
}

#[test]
fn a_client_that_disconnects_cancels_its_generation() {
    let s = Server::start(&[]);
    s.client("disconnect", None);
}

#[test]
fn sse_framing_with_curl() {
    if tool(&CURL, "sse_framing_with_curl").is_none() {
        return;
    }
    let s = Server::start(&[]);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":4,"stream":true,"stream_options":{{"include_usage":true}},"reasoning_effort":"none"}}"#
    );
    let out = curl(&[
        "-sN",
        "-i",
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
        &format!("{}/v1/chat/completions", s.base),
    ]);
    let (head, events) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/event-stream"), "{head}");
    assert!(events.ends_with("data: [DONE]\n\n"), "{events:?}");
    let evs: Vec<&str> = events.trim_end().split("\n\n").collect();
    for e in &evs {
        assert!(e.starts_with("data: ") && !e.contains('\n'), "one data line per event: {e:?}");
    }
    let chunks: Vec<serde_json::Value> =
        evs[..evs.len() - 1].iter().map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert!(usage["deltafin"]["ttft_s"].as_f64().unwrap() > 0.0);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
}

/// Sends raw bytes on a fresh connection and returns what came back (within a second).
fn raw(base: &str, bytes: &[u8]) -> String {
    let mut t = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let _ = t.write_all(bytes);
    let _ = t.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = t.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn limits_and_garbage_never_wedge_the_server() {
    if tool(&CURL, "limits_and_garbage_never_wedge_the_server").is_none() {
        return;
    }
    let s = Server::start(&["--max-request-bytes", "4096"]);
    let url = format!("{}/v1/completions", s.base);
    let big = format!(r#"{{"model":"{MODEL}","prompt":"{}"}}"#, "x".repeat(8000));
    let out = curl(&["-s", "-w", "\n%{http_code}", "-d", &big, &url]);
    assert!(out.ends_with("\n413"), "{out}");
    assert!(out.contains("request_too_large"), "{out}");
    for (body, code) in [
        ("{", "400"),
        ("[]", "400"),
        (r#"{"model":"serve-model","prompt":[99999999]}"#, "400"),
        (r#"{"model":"serve-model","prompt":"a","max_tokens":-1}"#, "400"),
        (r#"{"model":"serve-model","prompt":"a","logprobs":99}"#, "400"),
        (r#"{"model":"serve-model","prompt":"a","stream_options":{"include_usage":true}}"#, "400"),
        (&format!(r#"{{"model":"serve-model","prompt":{}1{}}}"#, "[".repeat(200), "]".repeat(200)), "400"),
    ] {
        let out = curl(&["-s", "-w", "\n%{http_code}", "-d", body, &url]);
        assert!(out.ends_with(code), "{body}: {out}");
        let json = out.rsplit_once('\n').unwrap().0;
        let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|_| panic!("not JSON: {out}"));
        assert!(v["error"]["message"].is_string(), "{out}");
    }
    let mut rng = Rng(5);
    for i in 0..30 {
        let n = 1 + rng.below(2000);
        let junk = rng.bytes(n);
        let mut req = match i % 3 {
            0 => junk,
            1 => format!("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", 10_000)
                .into_bytes(),
            _ => b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        };
        let n = rng.below(100);
        req.extend_from_slice(&rng.bytes(n));
        raw(&s.base, &req);
    }
    assert!(curl(&["-s", &format!("{}/v1/nope", s.base)]).contains("not_found"));
    let health = curl(&["-s", &format!("{}/health", s.base)]);
    assert!(health.contains("\"ok\""), "{health}");
    let out = curl(&["-s", "-d", &format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":2}}"#), &url]);
    assert!(out.contains("text_completion"), "{out}");
}

/// Reads from `t` until the server closes it; the bytes and whether it closed within `limit`.
fn read_until_closed(t: &mut std::net::TcpStream, limit: Duration) -> (String, bool) {
    t.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    // A reset is the server's close too: closing a socket that holds bytes it has not read (a
    // trickler's last ones) sends RST, not FIN, and the read after what was sent fails with it.
    let closed = match t.read_to_end(&mut out) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// Writes `head`, then `trickle` one byte every 200 ms (up to 60 s) from another thread.
fn trickler(base: &str, head: &[u8], trickle: u8) -> std::net::TcpStream {
    let t = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    let mut w = t.try_clone().unwrap();
    w.write_all(head).unwrap();
    std::thread::spawn(move || {
        for _ in 0..300 {
            std::thread::sleep(Duration::from_millis(200));
            if w.write_all(&[trickle]).is_err() {
                return;
            }
        }
    });
    t
}

#[test]
fn clients_that_stall_or_trickle_are_closed_after_the_read_timeout() {
    if tool(&CURL, "clients_that_stall_or_trickle_are_closed_after_the_read_timeout").is_none() {
        return;
    }
    let s = Server::start(&["--read-timeout", "1"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    // Far above the 1 s timeout: a connection still open then was never timed out.
    let limit = Duration::from_secs(20);
    // Connects and sends nothing.
    let mut silent = std::net::TcpStream::connect(&addr).unwrap();
    // Trickles its request head a byte at a time, never finishing it.
    let mut head = trickler(&s.base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", b'a');
    // Sends its head, then trickles a body that never completes: a 408, then closed.
    let body_head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"model\":\"{MODEL}\",\"prompt\":\""
    );
    let mut body = trickler(&s.base, body_head.as_bytes(), b'b');
    // Keeps a connection open after an answer and sends nothing more.
    let mut idle = std::net::TcpStream::connect(&addr).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    for (name, t) in [("silent", &mut silent), ("head", &mut head), ("idle", &mut idle)] {
        let (out, closed) = read_until_closed(t, limit);
        assert!(closed, "the {name} connection is still open after {limit:?}: {out}");
        if name == "idle" {
            assert!(out.starts_with("HTTP/1.1 200") && out.contains("\"ok\""), "{out}");
        } else {
            assert!(out.is_empty(), "{name}: {out}");
        }
    }
    let (out, closed) = read_until_closed(&mut body, limit);
    assert!(closed, "the body trickler is still open after {limit:?}: {out}");
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(out.contains("request_timeout") && out.to_ascii_lowercase().contains("connection: close"), "{out}");
    // Answers are not timed: a stream longer than the read timeout runs to its end.
    // (5000 tokens take about 3 s here; the end tokens are kept out by `logit_bias`.)
    let info: serde_json::Value = serde_json::from_str(&curl(&["-s", &format!("{}/tokenizer_info", s.base)])).unwrap();
    let (eos, eom) = (&info["eos_token_id"], &info["end_of_message_token_id"]);
    let bias = format!(r#"{{"{eos}":-100,"{eom}":-100}}"#);
    let body = format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":5000,"stream":true,"logit_bias":{bias}}}"#);
    let t0 = Instant::now();
    let out = curl(&["-sN", "-d", &body, &format!("{}/v1/completions", s.base)]);
    let tail = &out[out.len().saturating_sub(1000)..];
    assert!(out.ends_with("data: [DONE]\n\n") && tail.contains("\"finish_reason\":\"length\""), "{tail}");
    eprintln!("a 5000-token stream took {:.2} s beside a 1 s read timeout", t0.elapsed().as_secs_f64());
    assert!(curl(&["-s", &format!("{}/health", s.base)]).contains("\"ok\""));
}

#[test]
fn a_message_too_long_for_the_context_is_refused_by_its_size() {
    if tool(&CURL, "a_message_too_long_for_the_context_is_refused_by_its_size").is_none() {
        return;
    }
    let s = Server::start(&[]);
    let tmp = tempfile::tempdir().unwrap();
    // 16 MB of text: with any tokenizer here, far more tokens than the context holds.
    let text = "lorem ipsum ".repeat((16 << 20) / 12);
    for (endpoint, body) in [
        ("completions", serde_json::json!({"model": MODEL, "prompt": text})),
        ("chat/completions", serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})),
    ] {
        let f = tmp.path().join("body.json");
        std::fs::write(&f, body.to_string()).unwrap();
        let out = curl(&[
            "-s",
            "-w",
            "\n%{http_code}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            &format!("@{}", f.display()),
            &format!("{}/v1/{endpoint}", s.base),
        ]);
        let (json, code) = out.rsplit_once('\n').unwrap();
        assert_eq!(code, "400", "{endpoint}: {out}");
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        // "at least": the count comes from the size, the text was never tokenised.
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("(at least ") && msg.contains("exceeds the context of"), "{msg}");
    }
    // The server is still there for a request that fits.
    let out = curl(&[
        "-s",
        "-d",
        &format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":2}}"#),
        &format!("{}/v1/completions", s.base),
    ]);
    assert!(out.contains("text_completion"), "{out}");
}

fn conversation(s: &Server) -> serde_json::Value {
    serde_json::from_str(s.client("conversation", None).trim()).unwrap()
}

#[test]
fn conversation_reuse_and_memo_give_identical_output_and_are_counted() {
    let reuse = Server::start(&[]);
    let fresh = Server::start(&["--no-reuse", "--memo", "0"]);
    let drafted = Server::start(&["--draft", "ngram"]);
    let auto = Server::start(&["--draft", "auto"]);
    let a = conversation(&reuse);
    let b = conversation(&fresh);
    let d = conversation(&drafted);
    let au = conversation(&auto);
    for k in ["turn1", "turn2", "turn2_logprobs", "repeat", "prompt_tokens"] {
        assert_eq!(a[k], b[k], "{k}: reuse {a} vs fresh {b}");
        assert_eq!(d[k], b[k], "{k}: drafts {d} vs none {b}");
        assert_eq!(au[k], b[k], "{k}: --draft auto {au} vs none {b}");
    }
    assert_eq!(a["turn2"], a["repeat"]);
    let cached = a["cached"].as_u64().unwrap();
    assert!(cached > 0 && cached < a["prompt_tokens"].as_u64().unwrap(), "{a}");
    assert_eq!(b["cached"], 0);
    assert_eq!((a["repeat_memo"].as_bool(), b["repeat_memo"].as_bool()), (Some(true), Some(false)));
    assert!(reuse.metric("deltafin_prompt_tokens_reused_total") >= cached as f64);
    assert_eq!(reuse.metric("deltafin_memo_hits_total"), 1.0);
    assert_eq!(fresh.metric("deltafin_prompt_tokens_reused_total"), 0.0);
    assert_eq!(fresh.metric("deltafin_memo_hits_total"), 0.0);
}

#[test]
fn sigterm_ends_the_running_generation_and_exits_cleanly() {
    if tool(&CURL, "sigterm_ends_the_running_generation_and_exits_cleanly").is_none() {
        return;
    }
    let mut s = Server::start(&[]);
    let body = format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":6000,"stream":true}}"#);
    let url = format!("{}/v1/completions", s.base);
    let mut stream = Command::new("curl").args(["-sN", "-d", &body, &url]).stdout(Stdio::piped()).spawn().unwrap();
    // Wait until tokens flow, then stop the server.
    let mut first = [0u8; 64];
    let mut out = stream.stdout.take().unwrap();
    out.read_exact(&mut first).unwrap();
    s.sigterm();
    let status = s.wait(Duration::from_secs(15)).expect("the server did not stop within 15 s");
    assert!(status.success(), "{status:?}\n{}", s.stderr.lock().unwrap());
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let _ = stream.wait();
    assert!(
        rest.ends_with("data: [DONE]\n\n"),
        "the stream ends properly: {}",
        &rest[rest.len().saturating_sub(300)..]
    );
    assert!(rest.contains("\"finish_reason\":\"cancelled\""), "{}", &rest[rest.len().saturating_sub(600)..]);
    assert!(s.stderr.lock().unwrap().contains("server stopped"));
}

#[test]
fn chat_page_streams_an_answer_in_headless_chromium() {
    const TEST: &str = "chat_page_streams_an_answer_in_headless_chromium";
    let Some(browser) = tool(&CHROMIUM, TEST) else {
        return;
    };
    if tool(&CURL, TEST).is_none() {
        return;
    }
    let s = Server::start(&["--api-key", "pagekey"]);
    let html = curl(&["-s", &format!("{}/", s.base)]);
    assert!(html.contains("<title>deltafin</title>"));
    for external in ["src=\"http", "href=\"http", "@import", "src=\"//"] {
        assert!(!html.contains(external), "the page loads nothing from elsewhere ({external})");
    }
    // Chromium's virtual clock can run out before a loaded machine has answered; the page is
    // loaded again (fresh profile, longer budget) up to three times before the test fails. Each
    // load asks its own question (a repeat would be a memo hit, generating nothing) once the
    // server has ended every earlier generation (a dropped load's, cancelled or finished): the
    // tokens generated since are the answer's alone.
    let mut dom = String::new();
    let mut generated = 0.0;
    for (attempt, budget) in [20_000, 120_000, 600_000].into_iter().enumerate() {
        let url =
            format!("{}/?q=Hello%20there{}&max_tokens=6&effort=none&key=pagekey", s.base, "%20again".repeat(attempt));
        let before = idle_metric(&s, "deltafin_generated_tokens_total");
        let profile = tempfile::tempdir().unwrap();
        let o = Command::new(&browser)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            .arg(format!("--virtual-time-budget={budget}"))
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--dump-dom", &url])
            .output()
            .unwrap();
        dom = String::from_utf8_lossy(&o.stdout).into_owned();
        let done = dom.split("id=\"answer-1\"").nth(1).is_some_and(|a| a.contains("data-done=\"1\""));
        if done {
            generated = idle_metric(&s, "deltafin_generated_tokens_total") - before;
            break;
        }
        eprintln!("the page's answer had not finished within a virtual {budget} ms; loading it again");
    }
    let answer = dom.split("id=\"answer-1\"").nth(1).unwrap_or_else(|| panic!("no answer in the page:\n{dom}"));
    assert!(answer.contains("data-done=\"1\""), "the answer finished: {dom}");
    assert!(!answer.contains("data-error"), "{dom}");
    let text = answer.split_once('>').unwrap().1.split("</div>").next().unwrap();
    assert!(!text.trim().is_empty(), "the answer has text: {dom}");
    // Under --virtual-time-budget the page's clock is virtual: any number will do.
    let ttft = dom.split("id=\"ttft\">TTFT ").nth(1).and_then(|t| t.split(' ').next());
    assert!(ttft.is_some_and(|t| t.parse::<f64>().is_ok()), "TTFT shown: {dom}");
    assert!(dom.contains("MB/s"), "per-drive read rate shown: {dom}");
    assert_eq!(generated, 6.0, "tokens generated for the answer shown");
}

/// `name`'s value once no generation is running or waiting (a load Chromium dropped may still be
/// generating until the server notices the closed connection).
fn idle_metric(s: &Server, name: &str) -> f64 {
    let t0 = Instant::now();
    while s.metric("deltafin_queue_depth") > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(120), "a generation still running after 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.metric(name)
}

/// The demo model as a newcomer meets it: through the official client (scenario `demo`: an answer
/// in `content` with no option set, bounded by the server's default `max_tokens`; standard fields
/// taken), through the README's curl example, and one access-log line per request on stderr.
#[test]
fn the_demo_answers_in_content_and_every_request_is_logged() {
    let demo = ["--demo".to_string(), "--model-name".into(), MODEL.into()];
    let s = Server::start_with(&demo, &["--max-tokens-default", "24"], false);
    s.client("demo", None);
    if tool(&CURL, "the_demo_answers_in_content_and_every_request_is_logged").is_some() {
        // The README's example, word for word but the model's name.
        let body = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"stream":true}}"#);
        let out = curl(&["-sN", &format!("{}/v1/chat/completions", s.base), "-d", &body]);
        let mut content = String::new();
        for ev in out.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]") {
            let c: serde_json::Value = serde_json::from_str(ev).unwrap();
            let delta = &c["choices"][0]["delta"];
            assert!(delta.get("reasoning_content").is_none(), "the demo does not think unless asked: {ev}");
            content.push_str(delta["content"].as_str().unwrap_or_default());
        }
        assert!(!content.trim().is_empty(), "{out}");
    }
    get(&s.base, "/health", None);
    let mut t = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
    t.write_all(b"GET /nothing-here?key=secret HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    t.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    let t0 = Instant::now();
    let log = loop {
        let log = s.stderr.lock().unwrap().clone();
        if log.contains("GET /nothing-here 404") || t0.elapsed() > Duration::from_secs(10) {
            break log;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("deltafin: request 127.0.0.1:")).collect();
    assert!(lines.iter().any(|l| l.contains(" GET /health 200 time=")), "{log}");
    assert!(!log.contains("secret"), "the query is not logged: {log}");
    assert!(lines.iter().any(|l| l.contains(" GET /nothing-here 404 time=")), "{log}");
    let chats: Vec<&&str> = lines.iter().filter(|l| l.contains(" POST /v1/chat/completions ")).collect();
    assert!(
        chats
            .iter()
            .any(|l| l.contains(" 200 in=") && l.contains(" out=") && l.contains(" ttft=") && l.contains(" finish=")),
        "{log}"
    );
    assert!(chats.iter().any(|l| l.contains(" 400 time=")), "the refused requests too: {log}");
}

#[test]
fn a_server_reachable_from_other_machines_without_a_key_is_warned_about() {
    let model = ["--model".to_string(), model_dir().display().to_string()];
    let warning = "warning: listening on 0.0.0.0 without --api-key";
    let s = Server::start_on(&model, &["--host", "0.0.0.0"]);
    // The lines after the address may still be on their way.
    let t0 = Instant::now();
    while !s.stderr.lock().unwrap().contains("listening on all interfaces") && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.stderr.lock().unwrap().contains(warning), "{}", s.stderr.lock().unwrap());
    // The address printed is one a browser on this machine opens, with a note for the others.
    assert!(s.base.starts_with("http://127.0.0.1:"), "{}", s.base);
    assert!(s.stderr.lock().unwrap().contains("listening on all interfaces (0.0.0.0:"), "{}", s.stderr.lock().unwrap());
    get(&s.base, "/health", None);
    for extra in [&["--host", "0.0.0.0", "--api-key", "k"][..], &[]] {
        let s = Server::start_on(&model, extra);
        assert!(!s.stderr.lock().unwrap().contains("warning: listening"), "{extra:?}: {}", s.stderr.lock().unwrap());
    }
}

/// The page's DOM after loading `url`, once `done` holds for it (loaded again with a longer
/// virtual-time budget, up to three times, when it does not; see the test above).
fn page_dom(browser: &Path, url: &str, done: impl Fn(&str) -> bool) -> String {
    let mut dom = String::new();
    for budget in [20_000, 120_000, 600_000] {
        let profile = tempfile::tempdir().unwrap();
        let o = Command::new(browser)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            .arg(format!("--virtual-time-budget={budget}"))
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--dump-dom", url])
            .output()
            .unwrap();
        dom = String::from_utf8_lossy(&o.stdout).into_owned();
        if done(&dom) {
            break;
        }
        eprintln!("the page had not finished within a virtual {budget} ms; loading it again");
    }
    dom
}

/// The chat page on the demo model: Stop ends an answer (the part shown stays), New chat forgets
/// the conversation, the demo answers in the answer box, and a
/// request that fails is not left in the conversation.
#[test]
fn chat_page_stop_new_chat_and_failed_requests_in_headless_chromium() {
    const TEST: &str = "chat_page_stop_new_chat_and_failed_requests_in_headless_chromium";
    let Some(browser) = tool(&CHROMIUM, TEST) else {
        return;
    };
    let s = Server::start_demo(&["--api-key", "pagekey"]);
    let body = |dom: &str| dom.split("<body").nth(1).and_then(|b| b.split('>').next()).unwrap_or_default().to_string();
    // Hi, Stop after 3 pieces, New chat, then "Hello again" answered in full (40 tokens: the page
    // polls /metrics every virtual 0.5 s, so a long answer would outlast the virtual-time budget).
    let url = format!("{}/?q=Hi&stop_at=3&then=Hello%20again&max_tokens=40&key=pagekey", s.base);
    let dom = page_dom(&browser, &url, |d| {
        body(d).contains("data-then=\"1\"")
            && d.split("id=\"answer-1\"").nth(1).is_some_and(|a| a.contains("data-done=\"1\""))
    });
    let b = body(&dom);
    assert!(b.contains("data-stopped=\"1\""), "Stop was clicked: {dom}");
    assert!(b.contains("data-history=\"2\""), "New chat left only the second exchange: {dom}");
    assert!(!dom.contains(">Hi<") && dom.contains(">Hello again<"), "the first exchange is gone from the page: {dom}");
    let answer = dom.split("id=\"answer-1\"").nth(1).unwrap();
    assert!(!answer.contains("data-error"), "{dom}");
    let text = answer.split_once('>').unwrap().1.split("</div>").next().unwrap();
    assert!(!text.trim().is_empty(), "the demo's answer is in the answer box: {dom}");
    // (The server ends a generation whose client has gone: a_client_that_disconnects_cancels_its_generation.)
    // A request that fails (max_tokens past the context) leaves the conversation empty.
    let url = format!("{}/?q=Hi&max_tokens=100000000&key=pagekey", s.base);
    let dom = page_dom(&browser, &url, |d| d.split("id=\"answer-1\"").nth(1).is_some_and(|a| a.contains("data-error")));
    assert!(dom.split("id=\"answer-1\"").nth(1).is_some_and(|a| a.contains("data-error=\"1\"")), "{dom}");
    assert!(dom.contains("context"), "the error is shown: {dom}");
    assert!(body(&dom).contains("data-history=\"0\""), "the failed request is not in the conversation: {dom}");
}

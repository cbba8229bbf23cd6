//! Hostile clients and files meet a server and an engine that hold (issue 41): request bodies
//! built to blow up the parse (millions of small values in an unknown field, under a memory
//! cgroup where the machine allows: root and cgroup v1 or v2) cost the server about their own
//! size, and `/health` answers while they are read; an oversized body's 413 reaches a client that
//! writes its whole body first (Python's http.client); a client that half-closes after its request
//! gets its answer, one that closes is cancelled, one that ends its body short gets a 400 at once;
//! a stop string in the thinking channel ends the answer there; `--expert-heat` naming a device
//! is not read (it used to be read until the OOM killer came).

mod common;
use common::served::{Served, split};
use common::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const MODEL: &str = "m";

/// A small synth model with tokenizer and chat template, written once per test process.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        synth_small(&dir, Some("11"));
        (tmp, dir)
    })
    .1
}

fn start(extra: &[&str]) -> Served {
    let mut args = vec!["--model", model_dir().to_str().unwrap(), "--model-name", MODEL];
    args.extend(["--memory-gb", "2", "-q"]);
    args.extend(extra);
    Served::start(&args)
}

/// A completions body whose unknown field `junk` holds `mib` MiB of small values.
fn junk_body(mib: usize) -> Vec<u8> {
    let mut b = format!(r#"{{"model":"{MODEL}","prompt":"Hi","junk":["#).into_bytes();
    b.extend(std::iter::repeat_n(&b"0,"[..], mib << 19).flatten());
    b.extend(b"0]}");
    b
}

fn post_bytes(s: &Served, body: &[u8]) -> (u16, String) {
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    split(&s.raw(&req, false, Duration::from_secs(120)))
}

/// A memory cgroup limited to `bytes`, where this process may make one (root, cgroup v1 or v2);
/// removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(bytes: u64) -> Result<Cgroup, String> {
        let name = format!("deltafin-test-{}", std::process::id());
        let (dir, limit) = if Path::new("/sys/fs/cgroup/memory").is_dir() {
            (Path::new("/sys/fs/cgroup/memory").join(name), "memory.limit_in_bytes")
        } else {
            (Path::new("/sys/fs/cgroup").join(name), "memory.max")
        };
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make a memory cgroup at {}: {e}", dir.display()))?;
        let cg = Cgroup(dir);
        std::fs::write(cg.0.join(limit), bytes.to_string()).map_err(|e| format!("cannot set {limit}: {e}"))?;
        Ok(cg)
    }

    fn add(&self, pid: u32) {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Empty once the server has gone.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn bodies_of_many_small_values_cost_about_their_size_and_health_answers_meanwhile() {
    let mut s = start(&[]);
    // Under a 1 GiB cap where the machine allows (the 64 MiB body alone used to take 4.9 GB).
    let cg = match Cgroup::new(1 << 30) {
        Ok(cg) => {
            cg.add(s.pid());
            Some(cg)
        }
        Err(why) => {
            skipped("the memory cgroup part of the hostile bodies test", &format!("{why} (needs root)"));
            None
        }
    };
    let before = s.peak_rss();
    let body = junk_body(64);
    let (status, answer) = post_bytes(&s, &body);
    assert_eq!(status, 400, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!((v["error"]["code"].as_str(), v["error"]["param"].as_str()), (Some("too_many_values"), Some("junk")));
    let grew = s.peak_rss().saturating_sub(before);
    eprintln!("a 64 MiB body of small values: peak RSS {} MB -> +{} MB", before >> 20, grew >> 20);
    // The body itself (64 MiB) and its buffer's growth, not a tree of its values.
    assert!(grew < 400 << 20, "the server's peak RSS grew by {} MB", grew >> 20);
    // Two at once, a third past the limit, while /health is asked over and over.
    let big = junk_body(100);
    let over = junk_body(130);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (mut healthy, mut worst) = (0, Duration::ZERO);
    std::thread::scope(|sc| {
        let srv = &s;
        let posts: Vec<_> = [&body, &big, &over].into_iter().map(|b| sc.spawn(move || post_bytes(srv, b))).collect();
        let watcher = sc.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let (status, _, took) = srv.get("/health");
                assert_eq!(status, 200);
                healthy += 1;
                worst = worst.max(took);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let codes: Vec<u16> = posts.into_iter().map(|p| p.join().unwrap().0).collect();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        watcher.join().unwrap();
        assert_eq!(codes, [400, 400, 413]);
    });
    eprintln!("/health answered {healthy} times during three large bodies, the slowest in {worst:?}");
    assert!(healthy > 0);
    assert!(s.alive(), "the server survived:\n{}", s.log.lock().unwrap());
    let (status, out) = s.post("/v1/completions", &format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":2}}"#));
    assert_eq!(status, 200, "{out}");
    drop(s);
    drop(cg);
}

#[test]
fn python_http_client_reads_the_413_of_an_oversized_body() {
    let s = start(&["--max-request-bytes", "1048576"]);
    let script = r#"
import http.client, json, sys
host, port = sys.argv[1].split(":")
c = http.client.HTTPConnection(host, int(port), timeout=60)
body = b'{"model":"m","prompt":"' + b"x" * (8 << 20) + b'"}'
c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
r = c.getresponse()
print(r.status, json.loads(r.read())["error"]["code"])
"#;
    let o = python().args(["-c", script, &s.addr]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(out.trim(), "413 request_too_large");
    // Chunked, with no length to refuse it by: read to the limit, the rest drained, then the 413.
    let mut req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        req.extend(format!("{:x}\r\n", 1 << 20).as_bytes());
        req.extend(std::iter::repeat_n(b' ', 1 << 20));
        req.extend(b"\r\n");
    }
    req.extend(b"0\r\n\r\n");
    let (status, body) = split(&s.raw(&req, false, Duration::from_secs(60)));
    assert_eq!(status, 413, "{body}");
}

#[test]
fn half_closed_clients_get_their_answer_and_closed_ones_are_cancelled() {
    let s = start(&[]);
    let request = |body: &str| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
    };
    let plain = request(&format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":8}}"#));
    let answer = s.raw(&plain, true, Duration::from_secs(60));
    let (status, body) = split(&answer);
    assert_eq!(status, 200, "{answer}");
    assert!(body.contains("\"text_completion\"") && body.contains("\"finish_reason\":\"length\""), "{body}");
    let stream = request(&format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":8,"stream":true}}"#));
    let answer = s.raw(&stream, true, Duration::from_secs(60));
    assert!(split(&answer).0 == 200 && answer.contains("data: [DONE]"), "{answer}");
    // A body that ends short, then the client's write side: a 400 at once, not a wait.
    let short = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"".to_vec();
    let answer = s.raw(&short, true, Duration::from_secs(60));
    let (status, body) = split(&answer);
    assert_eq!(status, 400, "{answer}");
    assert!(body.contains("ended after 8 of its 100 bytes"), "{body}");
    // A client that closes its socket while its (plain) answer is generated: cancelled.
    let before = s.metric("deltafin_cancelled_total");
    let bias = s.end_bias();
    let long = request(&format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":5000,"logit_bias":{bias}}}"#));
    let mut t = std::net::TcpStream::connect(&s.addr).unwrap();
    std::io::Write::write_all(&mut t, &long).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(t);
    let t0 = Instant::now();
    while s.metric("deltafin_cancelled_total") == before {
        assert!(t0.elapsed() < Duration::from_secs(30), "the closed client's generation was not cancelled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, _, _) = s.get("/health");
    assert_eq!(status, 200);
}

#[test]
fn a_stop_string_in_the_reasoning_ends_the_answer_there() {
    let s = start(&[]);
    let chat = |stop: Option<&str>| {
        let stop = stop.map(|x| format!(r#","stop":{}"#, serde_json::json!(x))).unwrap_or_default();
        let body =
            format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":24{stop}}}"#);
        let (status, out) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let c = &v["choices"][0];
        (
            c["message"]["reasoning_content"].as_str().unwrap_or_default().to_string(),
            c["message"]["content"].as_str().unwrap_or_default().to_string(),
            c["finish_reason"].as_str().unwrap().to_string(),
        )
    };
    let (reasoning, _, _) = chat(None);
    let chars: Vec<char> = reasoning.chars().collect();
    assert!(chars.len() >= 12, "the model thinks first: {reasoning:?}");
    // Three letters from the middle of the reasoning on (its first occurrence decides).
    let at = (chars.len() / 2..chars.len() - 3)
        .find(|&i| chars[i..i + 3].iter().all(char::is_ascii_alphanumeric))
        .unwrap_or_else(|| panic!("no three letters in a row in the second half of {reasoning:?}"));
    let stop: String = chars[at..at + 3].iter().collect();
    let cut = &reasoning[..reasoning.find(&stop).unwrap()];
    let (r, content, finish) = chat(Some(&stop));
    assert_eq!((r.as_str(), content.as_str(), finish.as_str()), (cut, "", "stop"), "stop {stop:?} in {reasoning:?}");
}

#[test]
fn expert_heat_naming_a_device_is_not_read() {
    let r = reference("k3-tiny-a");
    let (out, err) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(fixture("k3-tiny-a")).args([
        "--prompt-ids",
        &ids_arg(&r.prompt[..4]),
        "--max-new",
        "2",
        "--expert-heat",
        "/dev/full",
    ]));
    assert!(!out.trim().is_empty());
    assert!(err.contains("/dev/full") && err.contains("not a regular file"), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/full").unwrap().file_type().is_char_device());
}

//! A `deltafin serve` process for tests that talk HTTP with the standard library alone: started
//! on a free port, stopped with SIGTERM when dropped, requests over plain TCP.

use super::deltafin_cmd;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pub struct Served {
    pub child: Child,
    /// host:port
    pub addr: String,
    pub log: Arc<Mutex<String>>,
}

impl Served {
    /// `deltafin serve --port 0 ARGS` once it says where it listens.
    pub fn start(args: &[&str]) -> Served {
        let mut child = deltafin_cmd()
            .arg("serve")
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let (err, l) = (child.stderr.take().unwrap(), Arc::clone(&log));
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
                l.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
            panic!("the server did not start:\n{}", log.lock().unwrap());
        });
        Served { child, addr, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// A raw request (head and body as given) on a fresh connection; the whole answer, read until
    /// the server closes or `limit` passes. `half_close` shuts the write side after sending.
    pub fn raw(&self, bytes: &[u8], half_close: bool, limit: Duration) -> String {
        let mut t = TcpStream::connect(&self.addr).unwrap();
        t.set_read_timeout(Some(limit)).unwrap();
        t.write_all(bytes).unwrap();
        if half_close {
            t.shutdown(Shutdown::Write).unwrap();
        }
        let mut out = Vec::new();
        let _ = t.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `POST path` with a JSON `body` (Connection: close): the status and the answer's body.
    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        split(&self.raw(req.as_bytes(), false, Duration::from_secs(120)))
    }

    /// `GET path`: the status, the body and how long it took.
    pub fn get(&self, path: &str) -> (u16, String, Duration) {
        let t0 = Instant::now();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let (status, body) = split(&self.raw(req.as_bytes(), false, Duration::from_secs(60)));
        (status, body, t0.elapsed())
    }

    /// The value of metric `name`.
    /// A `logit_bias` that keeps the end tokens out (`[EOS]` ends plain text too): for requests
    /// that must run long.
    pub fn end_bias(&self) -> String {
        let (_, text, _) = self.get("/tokenizer_info");
        let info: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        format!(r#"{{"{}":-100,"{}":-100}}"#, info["eos_token_id"], info["end_of_message_token_id"])
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text, _) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    /// The process's peak resident memory so far (VmHWM), in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no VmHWM in\n{status}"));
        kb * 1024
    }
}

/// The status code and the body of an HTTP/1.1 answer (after any interim `100 Continue`; a
/// chunked body is returned with its chunk framing).
pub fn split(answer: &str) -> (u16, String) {
    let mut rest = answer;
    while let Some(r) = rest.strip_prefix("HTTP/1.1 100 Continue\r\n\r\n") {
        rest = r;
    }
    let status = rest.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = rest.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

impl Drop for Served {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is shared.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

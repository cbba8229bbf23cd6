//! Generated text is never broken UTF-8, on every path where token bytes become text: `run`'s
//! streamed stdout and its `--format json` text, `batch` results, and the server's whole and
//! streamed answers. A small synth model's tokenizer is rewritten (token bytes permuted, the
//! weights untouched) so that its greedy continuation is the bytes `A`, E2 | 82 | AC (a euro sign
//! split over three tokens), F0 | 9F (the start of a four-byte character that never ends): every
//! path must give exactly "A€", with nothing of the unfinished character (no U+FFFD).

mod common;
use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The bytes the continuation's six tokens are given, in order.
const PIECES: [u8; 6] = [b'A', 0xE2, 0x82, 0xAC, 0xF0, 0x9F];
const WANT: &str = "A€";

fn deltafin(cache: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_CACHE", cache);
    c
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A prompt whose greedy continuation is six distinct ordinary (non-special) tokens, and those.
fn prompt_with_distinct_continuation(cache: &Path, dir: &Path, n_base: u32) -> (Vec<u32>, Vec<u32>) {
    for start in 1..200u32 {
        let prompt = vec![start, start * 7 % 500 + 1, start * 13 % 500 + 2];
        let (out, _) = run_ok(deltafin(cache).args(["run", "--model"]).arg(dir).args([
            "--prompt-ids",
            &ids_arg(&prompt),
            "--max-new",
            "6",
            "--ignore-eos",
            "--format",
            "json",
            "-q",
        ]));
        let got = ids_of(&serde_json::from_str::<Value>(&out).unwrap()["output_ids"]);
        let mut distinct = got.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() == 6 && got.iter().all(|&t| t < n_base) {
            return (prompt, got);
        }
    }
    panic!("no prompt with six distinct ordinary tokens");
}

/// Rewrites `dir/tiktoken.model` so that token `out[i]` stands for the single byte `PIECES[i]`
/// (each swapped with the token that held that byte: still one token per byte value).
fn give_tokens_bytes(dir: &Path, out: &[u32]) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let path = dir.join("tiktoken.model");
    let mut bytes: Vec<Vec<u8>> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(rank, l)| {
            let (tok, r) = l.split_once(' ').unwrap();
            assert_eq!(r.trim().parse::<usize>().unwrap(), rank, "ranks in order");
            b64.decode(tok).unwrap()
        })
        .collect();
    for (&id, &b) in out.iter().zip(&PIECES) {
        let holder = bytes.iter().position(|t| t.as_slice() == [b]).unwrap();
        bytes.swap(id as usize, holder);
    }
    let text: String = bytes.iter().enumerate().map(|(r, t)| format!("{} {r}\n", b64.encode(t))).collect();
    std::fs::write(&path, text).unwrap();
}

/// A server on 127.0.0.1 (any free port) for `dir`; killed when dropped.
struct Server(std::process::Child, String);

impl Server {
    fn start(cache: &Path, dir: &Path) -> Server {
        let mut child = deltafin(cache)
            .args(["serve", "--model"])
            .arg(dir)
            .args(["--port", "0", "--memory-gb", "2", "--memo", "0", "-q"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(60)).expect("the server did not start");
        Server(child, format!("http://{addr}"))
    }

    fn post(&self, body: &Value) -> String {
        let o = Command::new("curl")
            .args(["-sN", "-H", "Content-Type: application/json", "-d", &body.to_string()])
            .arg(format!("{}/v1/completions", self.1))
            .output()
            .expect("curl is needed by this test");
        String::from_utf8(o.stdout).expect("the server's answer is UTF-8")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn split_and_unfinished_characters_never_print_broken() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache, dir) = (tmp.path().join("cache"), tmp.path().join("m"));
    synth_small(&dir, Some("5"));
    let n_base = deltafin::model::tokenizer::read_rank_file(&dir.join("tiktoken.model")).unwrap().len() as u32;
    let (prompt, out) = prompt_with_distinct_continuation(&cache, &dir, n_base);
    give_tokens_bytes(&dir, &out);
    // The tokenizer was changed on purpose: recorded so.
    run_ok(deltafin(&cache).args(["verify", "--rehash", "--model"]).arg(&dir));
    let run = |format: &str| {
        run_ok(deltafin(&cache).args(["run", "--model"]).arg(&dir).args([
            "--prompt-ids",
            &ids_arg(&prompt),
            "--max-new",
            "6",
            "--ignore-eos",
            "--format",
            format,
            "-q",
        ]))
        .0
    };
    // run: streamed stdout, then the JSON text (the same ids as before the tokenizer changed).
    assert_eq!(run("text"), format!("{WANT}\n"));
    let j: Value = serde_json::from_str(&run("json")).unwrap();
    assert_eq!(ids_of(&j["output_ids"]), out);
    assert_eq!(j["text"], WANT);

    // batch.
    let (input, results) = (tmp.path().join("in.jsonl"), tmp.path().join("out.jsonl"));
    std::fs::write(&input, serde_json::json!({"id": "a", "prompt": prompt, "max_tokens": 6}).to_string()).unwrap();
    run_ok(
        deltafin(&cache)
            .args(["batch", "--model"])
            .arg(&dir)
            .arg("--in")
            .arg(&input)
            .arg("--out")
            .arg(&results)
            .args(["--memory-gb", "2", "-q"]),
    );
    let r: Value = serde_json::from_str(std::fs::read_to_string(&results).unwrap().trim()).unwrap();
    assert_eq!((&r["text"], &r["usage"]["completion_tokens"]), (&Value::from(WANT), &Value::from(6)), "{r}");

    // The server: a whole answer, then a streamed one whose pieces are each whole characters.
    let s = Server::start(&cache, &dir);
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 6});
    let whole: Value = serde_json::from_str(&s.post(&body)).unwrap();
    assert_eq!(whole["choices"][0]["text"], WANT, "{whole}");
    let mut streamed = body.clone();
    streamed["stream"] = Value::Bool(true);
    let events = s.post(&streamed);
    let pieces: Vec<String> = events
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(pieces.concat(), WANT, "{events}");
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    assert!(pieces.contains(&"€".to_string()), "the euro sign arrives whole, once its last byte is there: {pieces:?}");
}

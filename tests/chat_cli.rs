//! `deltafin chat` and `run --chat` as a user meets them, with real processes: a scripted chat on
//! the demo model (one message a line on stdin; answers in order; each turn resuming the previous
//! one's session; the same seed replays the same conversation; /save writes a transcript and
//! refuses to overwrite another file); an interactive chat on a pseudo-terminal (`script`): Ctrl-C
//! stops an answer and the chat goes on, a second Ctrl-C at the prompt leaves; chat text never
//! showing a tag token, on a random-weight model that emits them all the time; the same
//! conversation with cut answers in `run --session --chat`, `chat` and `serve`; a chat at the end
//! of its context; cut answers said; one short startup line and llama.cpp's short flags.

mod common;
use common::*;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The special tokens' names a text must never show.
const TAGS: [&str; 6] = ["<|", "|>", "[BOS]", "[EOS]", "[PAD]", "[MASK]"];

/// `deltafin chat --demo ARGS` with `input` on stdin; (stdout, stderr).
fn scripted(args: &[&str], input: &str) -> (String, String) {
    let mut c = deltafin_cmd();
    c.args(["chat", "--demo", "-q"]).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = (String::from_utf8(o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "chat failed ({:?}):\n{err}", o.status);
    (out, err)
}

/// The `--stats` lines' (prompt tokens, reused prompt tokens, answer tokens), in order.
fn turns(err: &str) -> Vec<(usize, usize, usize)> {
    err.lines()
        .filter_map(|l| l.strip_prefix("deltafin: "))
        .filter(|l| l.contains(" reused), ttft "))
        .map(|l| {
            let n = |s: &str| s.trim().parse::<usize>().unwrap();
            let (tokens, rest) = l.split_once(" tokens, prompt ").unwrap();
            let (prompt, rest) = rest.split_once(" (").unwrap();
            (n(prompt), n(rest.split_once(" reused").unwrap().0), n(tokens))
        })
        .collect()
}

#[test]
fn a_scripted_chat_answers_each_line_resumes_its_session_and_replays_with_its_seed() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("chat.json");
    let other = dir.path().join("notes.txt");
    std::fs::write(&other, "precious\n").unwrap();
    let input = format!(
        "Hi\nTell me about the sea\n/save {}\n/save {}\n/bogus\nA line \\\nthat goes on\n/reset\nHi\n",
        saved.display(),
        other.display()
    );
    let args = ["--max-tokens", "16", "--seed", "11", "--stats"];
    let (out, err) = scripted(&args, &input);
    let t = turns(&err);
    assert_eq!(t.len(), 4, "four messages, four answers:\n{err}");
    // Turn 2 resumes the session turn 1 left: its whole prompt and all but the last answer token.
    assert_eq!(t[0].1, 0, "{err}");
    assert!(t[1].1 >= t[0].0 && t[1].1 <= t[0].0 + t[0].2 && t[1].1 < t[1].0, "{t:?}");
    assert!(t[2].1 >= t[1].0, "turn 3 resumes turn 2: {t:?}");
    // After /reset the conversation is the first one's prompt again.
    assert_eq!(t[3].0, t[0].0, "{t:?}");
    assert!(!out.trim().is_empty() && out.lines().count() >= 4, "{out}");
    for tag in TAGS {
        assert!(!out.contains(tag), "{tag} in the answers: {out}");
    }
    assert!(err.contains("unknown command /bogus"), "{err}");
    // The transcript: OpenAI's messages, the settings; another file is not overwritten.
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&saved).unwrap()).unwrap();
    assert_eq!(v["object"], "deltafin.chat.transcript");
    assert_eq!(v["settings"]["seed"], 11);
    assert_eq!(v["settings"]["thinking"], "off", "the demo's generation_config.json turns thinking off");
    let msgs = v["messages"].as_array().unwrap();
    assert_eq!(
        msgs.iter().map(|m| m["role"].as_str().unwrap()).collect::<Vec<_>>(),
        ["user", "assistant", "user", "assistant"]
    );
    assert_eq!(msgs[2]["content"], "Tell me about the sea");
    assert!(out.starts_with(msgs[1]["content"].as_str().unwrap()), "{out}");
    assert!(err.contains("is not a chat transcript: not overwritten"), "{err}");
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "precious\n");
    // The same seed, the same conversation; /save onto its own transcript is allowed.
    let (again, _) = scripted(&args, &input);
    assert_eq!(again, out);
}

#[test]
fn run_chat_and_chat_never_show_a_tag_token() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_small(&model, Some("5"));
    let m = model.to_str().unwrap();
    // The random model emits special tokens often: the raw ids hold some, the chat text none.
    let (out, _) = run_ok(deltafin_cmd().args([
        "run",
        "--model",
        m,
        "--chat",
        "--thinking",
        "off",
        "--prompt",
        "Hi",
        "--max-new",
        "200",
        "--ignore-eos",
        "--format",
        "json",
        "-q",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let specials = v["output_ids"].as_array().unwrap().iter().filter(|t| t.as_u64().unwrap() >= 2048 - 256).count();
    assert!(specials > 0, "the model emitted no special token: {out}");
    let text = v["text"].as_str().unwrap().to_string();
    for tag in TAGS {
        assert!(!text.contains(tag) && !v["reasoning"].as_str().unwrap().contains(tag), "{tag}: {out}");
    }
    for (args, shown) in [
        (&["--thinking", "off"][..], text.clone()),
        (&["--thinking", "high"][..], String::new()),
        (&[][..], String::new()),
    ] {
        let (out, err) =
            run_ok(deltafin_cmd().args(["run", "--model", m, "--chat", "--prompt", "Hi"]).args(args).args([
                "--max-new",
                "200",
                "--ignore-eos",
                "-q",
            ]));
        for tag in TAGS {
            assert!(!out.contains(tag) && !err.contains(tag), "{args:?}: {tag} shown:\n{out}\n{err}");
        }
        if !shown.is_empty() {
            assert_eq!(out.trim_end_matches('\n'), shown, "--format text shows the JSON's text");
        }
    }
    // Several prompts run together: the same texts.
    let (out, _) = run_ok(deltafin_cmd().args([
        "run",
        "--model",
        m,
        "--chat",
        "--thinking",
        "off",
        "--prompt",
        "Hi",
        "--prompt",
        "Hi",
        "--max-new",
        "200",
        "--ignore-eos",
        "-q",
    ]));
    assert_eq!(
        out,
        format!("--- 1/2 ---\n{text}\n\n--- 2/2 ---\n{text}\n"),
        "run with two prompts shows each answer as alone"
    );
    let (out, err) =
        run_ok(deltafin_cmd().args(["chat", "--model", m, "--max-tokens", "100", "-q"]).stdin(Stdio::null()));
    assert!(out.is_empty() && !err.contains("error"), "no input, no answer: {out} {err}");
    // A model without a chat template cannot chat: said at once, not at the first message.
    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    // Removed on purpose: recorded so (else the missing file is the error).
    run_ok(deltafin_cmd().args(["verify", "--rehash", "--model", m]));
    let o = deltafin_cmd().args(["chat", "--model", m, "-q"]).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot chat: this model has no chat template"), "{err}");
}

/// Text a child writes, collected as it comes.
struct Screen(Arc<Mutex<String>>);

impl Screen {
    fn new(mut from: impl Read + Send + 'static) -> Screen {
        let text = Arc::new(Mutex::new(String::new()));
        let t = Arc::clone(&text);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                t.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Screen(text)
    }

    /// Waits until `what` appears after byte `from`; returns where it ends.
    fn wait_for(&self, what: &str, from: usize) -> usize {
        let t0 = Instant::now();
        loop {
            let s = self.0.lock().unwrap().clone();
            if let Some(at) = s.get(from..).and_then(|rest| rest.find(what)) {
                return from + at + what.len();
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "no {what:?} after byte {from} of:\n{s}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn on_a_terminal_ctrl_c_stops_the_answer_and_a_second_one_at_the_prompt_leaves() {
    const TEST: &str = "on_a_terminal_ctrl_c_stops_the_answer_and_a_second_one_at_the_prompt_leaves";
    let util_linux = Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("util-linux"));
    if !util_linux {
        skipped(TEST, "util-linux's `script` is not installed; the pseudo-terminal test needs it");
        return;
    }
    // `script` runs the chat on a pseudo-terminal; what it is given goes to the terminal as typed.
    // A random-weight model (synth: tokenizer and template included) answers until its context
    // is full: the chat-tuned demo ends its answers before a Ctrl-C could reach them. Seed 2's
    // greedy answer to this prompt never reaches `[EOS]` or `<|end_of_msg|>` (4,000 tokens).
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_small(&model, Some("2"));
    let chat = deltafin_cmd();
    let mut line = format!(
        "{} chat --model {} -q --max-tokens 0 --temperature 0",
        chat.get_program().to_string_lossy(),
        model.display()
    );
    line.insert_str(0, "exec ");
    let mut c = Command::new("script");
    for (k, v) in chat.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    let mut child = c
        .args(["-qfec", &line, "/dev/null"])
        .env("TERM", "xterm")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let screen = Screen::new(child.stdout.take().unwrap());
    let mut keys = child.stdin.take().unwrap();
    let mut at = screen.wait_for(">>> ", 0);
    keys.write_all(b"Tell me a long story\r").unwrap();
    at = screen.wait_for("Tell me a long story", at);
    // Some of the answer (up to the context: it would run for a long while), then Ctrl-C.
    std::thread::sleep(Duration::from_millis(300));
    keys.write_all(b"\x03").unwrap();
    at = screen.wait_for("(stopped)", at);
    at = screen.wait_for(">>> ", at);
    keys.write_all(b"/help\r").unwrap();
    at = screen.wait_for("/reset", at);
    at = screen.wait_for(">>> ", at);
    keys.write_all(b"\x03").unwrap();
    at = screen.wait_for("Ctrl-C again or Ctrl-D to leave", at);
    screen.wait_for(">>> ", at);
    keys.write_all(b"\x03").unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the chat did not leave:\n{}", screen.0.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = screen.0.lock().unwrap().clone();
    assert!(status.success(), "{status:?}:\n{text}");
    let answer = text.split("Tell me a long story").nth(1).unwrap().split("(stopped)").next().unwrap();
    assert!(answer.trim().len() > 1, "some of the answer was shown before Ctrl-C: {text}");
}

/// The same greedy conversation, every answer cut by the token limit, gives the same answers from
/// the same prompts in `run --session --chat` (one process a turn), `chat` (piped) and `serve`
/// (the history sent back with each request): each closes a cut answer the way the chat template
/// renders it (`<|close|>response...<|end_of_msg|>`) before the next user message.
#[test]
fn a_conversation_with_cut_answers_is_the_same_in_run_session_chat_and_serve() {
    use common::served::Served;
    use serde_json::{Value, json};
    const MAX: usize = 10;
    let questions = ["Tell me a long story about a ship at sea.", "What did the sailors do then?", "And in the end?"];
    let tmp = tempfile::tempdir().unwrap();
    // chat, piped, its transcript saved.
    let saved = tmp.path().join("t.json");
    let input = format!("{}\n/save {}\n", questions.join("\n"), saved.display());
    let (_, err) = scripted(&["--max-tokens", &MAX.to_string(), "--temperature", "0", "--stats"], &input);
    let chat_prompts: Vec<usize> = turns(&err).iter().map(|t| t.0).collect();
    let v: Value = serde_json::from_slice(&std::fs::read(&saved).unwrap()).unwrap();
    let chat_answers: Vec<String> = v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["content"].as_str().unwrap().to_string())
        .collect();
    // run --session --chat, a process a turn; the prompt a turn runs on is what its session file
    // holds after it, less the answer (its last token is not fed).
    let file = tmp.path().join("c.dfstate");
    let (mut run_answers, mut run_prompts) = (Vec::new(), Vec::new());
    for q in questions {
        let (out, _) = run_ok(deltafin_cmd().args(["run", "--demo", "--chat", "--session"]).arg(&file).args([
            "--prompt",
            q,
            "-n",
            &MAX.to_string(),
            "--temperature",
            "0",
            "--format",
            "json",
            "-q",
        ]));
        let v: Value = serde_json::from_str(&out).unwrap();
        let held = deltafin::engine::state_file::peek(&file, false).unwrap().tokens;
        run_prompts.push(held + 1 - v["output_ids"].as_array().unwrap().len());
        run_answers.push(v["text"].as_str().unwrap().to_string());
    }
    // serve, the history sent with each request.
    let s = Served::start(&["--demo", "--model-name", "m"]);
    let (mut messages, mut serve_answers, mut serve_prompts) = (Vec::new(), Vec::new(), Vec::new());
    for q in questions {
        messages.push(json!({"role": "user", "content": q}));
        let body = json!({"model": "m", "messages": messages, "max_tokens": MAX, "temperature": 0});
        let (status, text) = s.post("/v1/chat/completions", &body.to_string());
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length", "every answer is cut: {text}");
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        serve_prompts.push(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize);
        messages.push(json!({"role": "assistant", "content": answer}));
        serve_answers.push(answer);
    }
    assert_eq!(chat_answers, serve_answers, "chat and serve");
    assert_eq!(chat_prompts, serve_prompts, "chat and serve");
    assert_eq!(run_answers, serve_answers, "run --session --chat and serve");
    assert_eq!(run_prompts, serve_prompts, "run --session --chat and serve");
}

/// `chat` at the end of its context goes on: the oldest turns stop being sent (the system
/// message kept) and a line says so; an answer the context cut says the context, not /max; a
/// message too long even alone is an error, and a piped chat with a failed turn exits 1.
#[test]
fn chat_at_the_end_of_its_context_drops_the_oldest_turns_and_says_why_answers_end() {
    let questions: Vec<String> = (0..8).map(|i| format!("Tell me something new about the sea, number {i}.")).collect();
    let input = questions.join("\n") + "\n";
    let args = ["--context", "256", "--max-tokens", "40", "--temperature", "0", "--stats", "--system", "Be kind."];
    let (out, err) = scripted(&args, &input);
    let t = turns(&err);
    assert_eq!(t.len(), 8, "every message answered:\n{err}");
    assert!(err.contains("left the model's view; the system message stays"), "{err}");
    assert!(!err.contains("exceeds the context"), "{err}");
    assert!(t.iter().all(|&(prompt, _, _)| prompt + 40 <= 256), "room for each answer: {t:?}");
    assert!(!out.trim().is_empty());
    // A random-weight model answers until the context is full: the note says the context.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_small(&model, Some("9"));
    let chat = |args: &[&str], input: &str| {
        let mut c = deltafin_cmd();
        c.args(["chat", "--model"]).arg(&model).args(["-q", "--temperature", "0"]).args(args);
        let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    let o = chat(&["--context", "128", "--max-tokens", "0"], "Hi\nHello again\n");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("the context of 128 tokens is full") && !err.contains("/max N allows more"), "{err}");
    // A message that cannot fit even alone: said, and the piped run exits 1.
    let long = "word ".repeat(400);
    let o = chat(&["--context", "64"], &format!("{long}\n"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("exceeds the context") && err.contains("got no answer"), "{err}");
}

/// A `run --chat` answer cut by `--max-new` says so on stderr: still in its reasoning (no answer
/// yet), or with its text so far; the flag to raise is named. (On a random-weight model: the
/// chat-tuned demo does not think, it ends its answers at once.)
#[test]
fn a_chat_answer_cut_by_max_new_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_small(&model, None);
    let run = |args: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(&model).args(["--chat", "--temperature", "0", "--ignore-eos", "-q"]);
        run_ok(c.args(args).arg("Why is the sky blue?"))
    };
    for hide in [&[][..], &["--hide-reasoning"]] {
        let (out, err) = run(&[&["--thinking", "high", "-n", "3"][..], hide].concat());
        assert!(out.trim().is_empty(), "{out}");
        let said = "cut by --max-new 3 while still reasoning: no answer yet (raise -n/--max-new";
        assert!(err.contains(said), "{err}");
    }
    let (out, err) = run(&["--thinking", "off", "-n", "6"]);
    assert!(!out.trim().is_empty(), "the partial answer is printed");
    assert!(err.contains("the answer was cut by --max-new 6 (raise -n/--max-new"), "{err}");
}

/// `chat` starts with one short line (the engine's long one under -v), and takes llama.cpp's
/// short flags: -m, -c, -n and -p (a first message).
#[test]
fn chat_says_one_short_line_at_start_and_takes_the_short_flags() {
    let mut c = deltafin_cmd();
    c.args(["chat", "--demo", "-c", "512", "-n", "5", "--temperature", "0", "-p", "Hi"]);
    let (out, err) = run_ok(c.stdin(Stdio::null()));
    // (The demo's first use may say it lays the demo out; nothing else is said.)
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("chatting with") || l.contains("layers (")).collect();
    assert_eq!(lines.len(), 1, "one startup line:\n{err}");
    assert!(lines[0].contains("context 512"), "{err}");
    assert!(lines[0].chars().count() < 120, "{} characters: {}", lines[0].chars().count(), lines[0]);
    assert!(!out.trim().is_empty(), "-p sent a first message: {out}");
    let (_, err) = run_ok(deltafin_cmd().args(["chat", "--demo", "-v"]).stdin(Stdio::null()));
    assert!(err.contains("layers (") && err.contains("chatting with"), "-v: the engine's line too:\n{err}");
}

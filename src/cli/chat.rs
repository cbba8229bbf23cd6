//! `deltafin chat`: a conversation in the terminal (like `llama-cli -cnv` or `ollama run`) over
//! `service::chat`: each turn resumes the session the previous one left, so it prefills only
//! its own tokens. Answers stream to stdout, the reasoning dimmed on stderr (`--hide-reasoning`:
//! not shown). On a terminal the prompt has line editing and history; Ctrl-C stops the answer
//! being written, and at the prompt a second Ctrl-C or Ctrl-D leaves. When standard input is not
//! a terminal every line is one message (or a /command; a line ending in \ continues), each answer
//! ends with a newline, and Ctrl-C ends the run (exit 130), so the command scripts.

use super::load;
use super::sampling_args::{ChatWords, SamplingArgs};
use crate::api::Delta;
use crate::draft::DraftKind;
use crate::model::chat::Thinking;
use crate::sample::SamplingSpec;
use crate::service::chat::{self as conversation, ChatSettings, Command, Conversation};
use crate::service::generator::{GenConfig, GenError};
use anyhow::Result;
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files, chat template).
    #[arg(long, short, required_unless_present = "demo", conflicts_with = "demo")]
    pub model: Option<PathBuf>,
    /// Use the built-in demo model (laid out on first use; its generation_config.json gives the
    /// sampling defaults and turns thinking off).
    #[arg(long)]
    pub demo: bool,
    /// System message (/system changes it).
    #[arg(long)]
    pub system: Option<String>,
    /// A first message, sent before any input is read (as llama-cli's -p in conversation mode).
    #[arg(long, short)]
    pub prompt: Option<String>,
    /// Thinking effort (default: the model's, from its generation_config.json, else max).
    #[arg(long, value_enum)]
    pub thinking: Option<Thinking>,
    /// Tokens an answer may take (0: up to the context bound; /max changes it; llama.cpp's -n).
    #[arg(long, short = 'n', visible_alias = "max-new", default_value_t = 2048)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs<ChatWords>,
    /// Seed: turn n samples with SEED + n, so a scripted chat replays exactly (default: fresh seeds).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Draft tokens for K3 to verify in batches (answers are identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off)]
    pub draft: DraftKind,
    /// Do not show the model's reasoning (its thinking channel).
    #[arg(long)]
    pub hide_reasoning: bool,
    /// After each answer, a line on stderr: tokens, prompt tokens reused, TTFT, tokens/s.
    #[arg(long)]
    pub stats: bool,
    /// Replace an existing --expert-heat file that deltafin did not write; without it such a file
    /// is never overwritten.
    #[arg(long, hide_short_help = true)]
    pub force: bool,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// No startup line.
    #[arg(long, short)]
    pub quiet: bool,
    /// The engine's full startup line (layers, memory plan, expert source).
    #[arg(long, short, conflicts_with = "quiet")]
    pub verbose: bool,
    #[command(flatten)]
    pub threads: super::Threads,
}

/// A generation is running: SIGINT stops it (else SIGINT ends the process).
static GENERATING: AtomicBool = AtomicBool::new(false);
/// SIGINT came while generating.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    if GENERATING.load(Ordering::SeqCst) {
        STOP.store(true, Ordering::SeqCst);
    } else {
        // SAFETY: _exit is async-signal-safe; nothing is left to flush that a kill would keep.
        unsafe { libc::_exit(130) };
    }
}

/// A chat answer's deltas on the terminal: the answer to `out`, the reasoning (unless hidden) to
/// stderr, dimmed when stderr is a terminal (and NO_COLOR is not set) and ended by a newline
/// before the answer starts.
pub(super) struct Printer {
    show_reasoning: bool,
    dim: bool,
    open: bool,
}

impl Printer {
    pub fn new(show_reasoning: bool) -> Self {
        let dim = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        Printer { show_reasoning, dim, open: false }
    }

    /// Shows one delta; an error is the answer's output failing (a closed pipe).
    pub fn delta(&mut self, out: &mut impl Write, d: &Delta) -> std::io::Result<()> {
        if self.show_reasoning && !d.reasoning.is_empty() {
            let mut e = std::io::stderr().lock();
            if !self.open && self.dim {
                let _ = e.write_all(b"\x1b[2m");
            }
            self.open = true;
            let _ = e.write_all(d.reasoning.as_bytes());
        }
        if !d.content.is_empty() {
            self.end();
            out.write_all(d.content.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    }

    /// Ends the reasoning shown so far (if any).
    pub fn end(&mut self) {
        if std::mem::take(&mut self.open) {
            let _ = std::io::stderr().lock().write_all(if self.dim { b"\x1b[0m\n" } else { b"\n" });
        }
    }
}

/// Lines in: a line editor on a terminal, else standard input as it is.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Pipe(std::io::StdinLock<'static>),
}

impl Input {
    /// The next input (continued lines joined), None at the end (Ctrl-D, a second Ctrl-C).
    fn next(&mut self) -> Result<Option<String>> {
        let mut text = String::new();
        let mut interrupted = false;
        loop {
            let line = match self {
                Input::Editor(ed) => match ed.readline(if text.is_empty() { ">>> " } else { "... " }) {
                    Ok(l) => {
                        interrupted = false;
                        l
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) if !interrupted && text.is_empty() => {
                        interrupted = true;
                        eprintln!("(Ctrl-C again or Ctrl-D to leave; /help lists the commands)");
                        continue;
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) if !text.is_empty() => {
                        text.clear();
                        continue;
                    }
                    Err(rustyline::error::ReadlineError::Interrupted | rustyline::error::ReadlineError::Eof) => {
                        return Ok(None);
                    }
                    Err(e) => return Err(e.into()),
                },
                Input::Pipe(p) => {
                    let mut l = String::new();
                    if p.read_line(&mut l)? == 0 {
                        return Ok((!text.is_empty()).then_some(text));
                    }
                    l.truncate(l.trim_end_matches(['\n', '\r']).len());
                    l
                }
            };
            match line.strip_suffix('\\') {
                Some(head) => {
                    text.push_str(head);
                    text.push('\n');
                }
                None => {
                    text.push_str(&line);
                    if let Input::Editor(ed) = self {
                        let _ = ed.add_history_entry(text.as_str());
                    }
                    return Ok(Some(text));
                }
            }
        }
    }
}

pub fn run(mut a: ChatArgs) -> Result<()> {
    super::outputs::Outputs::new(a.force).engine(&a.engine).check()?;
    // SAFETY: the handler touches only atomics and calls _exit, both async-signal-safe.
    unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let sampling = SamplingSpec { seed: a.seed, ..a.sampling.spec(&dir, a.demo)? };
    // Verify batches need k + 1 rows; prompts are chunked at --prefill-rows.
    let rows = a.engine.prefill_rows.max(8);
    let engine = load::open_engine(a.engine.config(dir.clone(), crate::engine::KdaMode::Recurrent, rows, 0))?;
    // A drafter that cannot be built is a startup error, not a silent fallback.
    engine.drafter(a.draft)?;
    if a.verbose {
        eprintln!("{}", engine.startup_line());
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }
    let model = dir
        .canonicalize()
        .unwrap_or(dir.clone())
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let max_tokens = (a.max_tokens > 0).then_some(a.max_tokens);
    let settings = ChatSettings { sampling, max_tokens, thinking: a.thinking };
    let mut chat = Conversation::new(engine, GenConfig { draft: a.draft, ..GenConfig::default() }, settings)?;
    chat.set_system(a.system.clone());
    chat.check().map_err(|e| anyhow::anyhow!("{} cannot chat: {}", dir.display(), e.message))?;
    let interactive = std::io::stdin().is_terminal();
    if !a.quiet {
        // One short line; -v adds the engine's.
        let think = conversation::thinking_name(chat.thinking());
        let keys = if interactive { "; /help, Ctrl-D to leave" } else { "" };
        let more = if a.verbose { "" } else { " (-v: details)" };
        eprintln!("deltafin: chatting with {model} (thinking {think}, context {}){keys}{more}", chat.context());
    }
    let mut input = match interactive {
        true => Input::Editor(Box::new(rustyline::DefaultEditor::new()?)),
        false => Input::Pipe(std::io::stdin().lock()),
    };
    let mut printer = Printer::new(!a.hide_reasoning);
    let mut first = a.prompt.take();
    // Turns that failed (piped: the run then exits 1).
    let mut failed = 0usize;
    while let Some(line) = first.take().map_or_else(|| input.next(), |p| Ok(Some(p)))? {
        let text = match Command::parse(&line) {
            Ok(Command::Say(t)) if t.trim().is_empty() => continue,
            Ok(Command::Say(t)) => t,
            Ok(c) => match chat.command(c, &model) {
                None => break,
                Some(note) => {
                    if !note.is_empty() {
                        eprintln!("{note}");
                    }
                    continue;
                }
            },
            Err(e) => {
                eprintln!("deltafin: {e}");
                continue;
            }
        };
        STOP.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let mut out = std::io::stdout().lock();
        let mut closed = false;
        let turn = chat.plan(&text).and_then(|plan| {
            if plan.dropped > 0 {
                eprintln!("{}", conversation::shift_note(plan.dropped, chat.context()));
            }
            chat.run(plan, &mut |d| {
                !STOP.load(Ordering::SeqCst) && printer.delta(&mut out, d).map_err(|_| closed = true).is_ok()
            })
        });
        GENERATING.store(false, Ordering::SeqCst);
        printer.end();
        if closed {
            // Whoever read the answers has gone.
            return Ok(());
        }
        let stopped = STOP.load(Ordering::SeqCst);
        match turn {
            Ok(o) => {
                let _ = writeln!(out, "{}", if interactive { "\n" } else { "" });
                drop(out);
                if let Some(note) = conversation::turn_note(&o, stopped) {
                    eprintln!("{note}");
                }
                if a.stats {
                    eprintln!("deltafin: {}", conversation::turn_stats(&o));
                }
            }
            Err(GenError::Request(e)) => {
                failed += 1;
                let alone = e.code == Some("context_length_exceeded");
                let hint = if alone { " (even alone: a shorter message, or a smaller /max)" } else { "" };
                eprintln!("deltafin: {e}{hint}");
            }
            Err(e) => {
                if !interactive {
                    return Err(e.into());
                }
                eprintln!("error: {e}");
            }
        }
        if stopped && !interactive {
            std::process::exit(130);
        }
    }
    if failed > 0 && !interactive {
        anyhow::bail!("{failed} of the chat's messages got no answer (the errors above)");
    }
    Ok(())
}

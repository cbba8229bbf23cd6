//! What `run` (and the other front ends) tell a person on stderr: a short startup line (the
//! engine's full one under `-v` or `DELTAFIN_LOG=info`), a prefill progress display, a one-line
//! summary after a run (time to first token, prefill and decode rates, bytes read), and the
//! `--stats` counters without the ones that mean nothing in this run (drafting counters without
//! drafts, hedges without a second copy, device hits without a GPU cache).

use super::progress::{Mode, Progress, fmt_bytes};
use crate::engine::{Engine, PrefillProgress, PrefillWatcher};
use crate::stats::Stats;

/// Full startup lines were asked for (`-v`, or `DELTAFIN_LOG` at info or more).
pub fn verbose(flag: bool) -> bool {
    let log = std::env::var("DELTAFIN_LOG").unwrap_or_default().to_ascii_lowercase();
    flag || ["info", "debug", "trace"].iter().any(|l| log.split([',', '=']).any(|w| w.trim() == *l))
}

/// The startup line: the engine's full one when `verbose`, else the essentials: the model, its
/// trunk, the memory budget and expert cache, the context, the backend.
pub fn startup(e: &Engine, verbose: bool) -> String {
    if verbose {
        return e.startup_line();
    }
    format!("{} (-v: details)", e.startup_brief())
}

/// A prefill watcher showing tokens, layers, expert bytes, rate and ETA (when `mode` shows
/// anything) and stopping the prefill on Ctrl-C.
pub fn prefill_watcher(mode: Mode) -> Box<PrefillWatcher> {
    let mut bar = Progress::new(mode, "prefill");
    let mut shown = false;
    Box::new(move |p: &PrefillProgress| {
        // Short prompts finish before a display would help; a first chunk's first layer is enough
        // to judge the rest.
        let done = p.tokens_equivalent();
        if mode != Mode::Off && (shown || p.tokens >= 64) {
            shown = true;
            let all = p.tokens as u64;
            bar.update((done * 1000.0) as u64, all * 1000, |_, _, rate| {
                let rate = rate.map(|r| format!(", {:.1} tok/s", r / 1000.0)).unwrap_or_default();
                format!(
                    "{:.0}/{} tokens, layer {}/{}, {} of experts{rate}",
                    done.floor(),
                    p.tokens,
                    p.layers_done,
                    p.layers,
                    fmt_bytes(p.expert_bytes as f64)
                )
            });
            if p.tokens_done + p.chunk >= p.tokens && p.layers_done >= p.layers {
                bar.finish();
            }
        }
        !super::signals::interrupted()
    })
}

/// One line after a run: "12 prompt tokens in 0.4 s (30.1 tok/s), 64 tokens at 5.2 tok/s,
/// 1.2 GB of experts read (1.02x)". `wall_s`: the whole run, when several prompts overlap.
pub fn summary(s: &Stats) -> String {
    let read = |b: u64| format!("{} of experts read", fmt_bytes(b as f64));
    if s.prompt_tokens == 0 {
        // Stopped during the prompt (Ctrl-C): its work is rolled back, only the reads remain.
        let reads = s.bytes_read().map(|b| format!(", {}", read(b))).unwrap_or_default();
        return format!("deltafin: stopped during the prompt after {:.2} s{reads}", s.ttft_s);
    }
    let mut out = format!(
        "deltafin: {} prompt tokens, first token after {:.2} s ({:.1} tok/s prefill)",
        s.prompt_tokens,
        s.ttft_s,
        s.prefill_tok_s()
    );
    if s.generated_tokens > 0 {
        let rate = s.decode_tok_s();
        let rate = if rate > 0.0 { format!(" at {rate:.1} tok/s") } else { String::new() };
        out.push_str(&format!(", {} tokens{rate}", s.generated_tokens));
    }
    if let Some(b) = s.bytes_read() {
        let amp = s.read_amplification().map(|a| format!(" ({a:.2}x the distinct experts)")).unwrap_or_default();
        out.push_str(&format!(", {}{amp}", read(b)));
    }
    out
}

/// `--stats` as text: every counter, less those that mean nothing in this run (see the module
/// contract); the prompt's read-ahead is labelled when `--prefetch` is off.
pub fn stats_text(s: &Stats, prefetch_on: bool) -> String {
    let j = s.to_json();
    let zero = |k: &str| j.get(k).is_none_or(|v| v.is_null() || v.as_f64() == Some(0.0));
    let drafting = s.drafts.drafter.is_some() || s.drafts.proposed > 0;
    let hide = |k: &str| match k {
        "drafts_proposed" | "drafts_accepted" | "drafter" | "verify_calls" | "draft_acceptance" | "verify_s"
        | "draft_s" => !drafting,
        "prefetch_issued" | "prefetch_used" | "prefetch_recall" | "prefetch_precision" => {
            !prefetch_on && zero("prefetch_issued")
        }
        "hedged_reads" | "hedge_wins" | "device_expert_hits" | "inflight_joins" => zero(k),
        _ => false,
    };
    let mut out = String::new();
    for line in s.to_text().lines() {
        let key = line.split_whitespace().next().unwrap_or("");
        if hide(key) {
            continue;
        }
        out.push_str(line);
        if key == "prefetch_issued" && !prefetch_on {
            out.push_str("   (read ahead for the prompt's rows; --prefetch is off)");
        }
        out.push('\n');
    }
    out
}

/// Why a chat answer (`run --chat`) ended before its end of message: `--max-new` cut it, with
/// the answer so far (`content`, printed) or, when it had not left its reasoning yet, no answer
/// at all; either way the flag to raise.
pub fn cut_note(max_new: usize, content: &str, reasoning: &str) -> String {
    match (content.trim().is_empty(), reasoning.trim().is_empty()) {
        (true, false) => format!(
            "deltafin: cut by --max-new {max_new} while still reasoning: no answer yet (raise -n/--max-new, or \
             --thinking low|off)"
        ),
        _ => format!("deltafin: the answer was cut by --max-new {max_new} (raise -n/--max-new for the rest)"),
    }
}

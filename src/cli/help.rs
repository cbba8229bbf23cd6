//! What `--help` and usage errors add to clap's own text: examples for each subcommand (shown
//! after its options) and tips on two common mistakes — a mistyped subcommand (clap suggests only
//! near spellings, not `rnu` for `run`) and a front end started without a model, which is pointed
//! at `--demo`.

use clap::error::{ContextKind, ContextValue, ErrorKind};

pub const RUN: &str = "Examples:
  deltafin run --demo --prompt \"Hello\"                     the built-in demo model, no download
  deltafin run --demo --prompt \"Hello\" --draft dspark      drafted by the demo's DSpark drafter (same output)
  deltafin run --model ~/models/kimi-k3 --chat --prompt \"Why is the sky blue?\" --stats";

pub const SCORE: &str = "Examples:
  deltafin score --demo --text notes.txt                   perplexity and bits per byte of a text
  deltafin score --model DIR --prompt-ids 1,2,3 --logits-out logits.safetensors
  deltafin score --model DIR --text notes.txt --compare OTHER_DIR";

pub const SYNTH: &str = "Examples:
  deltafin synth --out /tmp/k3-small                       a small random model (the demo's shape)
  deltafin synth --preset k3-experts --layers 4 --experts 24 --out /tmp/k3-synth
  deltafin synth --dspark --target /tmp/k3-small --out /tmp/k3-small-dspark";

pub const PLACE: &str = "Examples:
  deltafin place --demo --drive /tmp/d0=1 --drive /tmp/d1=1  (the drives must exist: mkdir -p first)
  deltafin place --model DIR --drive /mnt/nvme0 --drive /mnt/nvme1
  deltafin place --model DIR --drive /mnt/nvme0=6.5 --drive /mnt/nvme1=6.5 --policy mirror
  deltafin place --model DIR --verify";

pub const PACK_TRUNK: &str = "Examples:
  deltafin pack-trunk --demo                               code the demo's trunk (70.9% of bf16, same output bits)
  deltafin pack-trunk --model DIR --json --time-products 5";

pub const PLAN: &str = "Examples:
  deltafin plan --memory-gb 128                            Kimi K3 on a 128 GB machine, per trunk encoding
  deltafin plan --memory-gb 192 --context 131072 --json";

pub const BENCH: &str = "Examples:
  deltafin bench kernels                                   CPU kernels at K3's shapes
  deltafin bench run --demo --prompt-tokens 64 --decode 8  the demo model, cold
  deltafin bench run --model DIR --prompt-tokens 512 --decode 16
  deltafin bench io --model DIR --gb 2";

pub const SETUP: &str = "Examples:
  deltafin setup --full --dir ~/models/kimi-k3
  deltafin setup --stream --dir ~/models/kimi-k3 --drive /mnt/nvme0 --drive /mnt/nvme1 --draft";

pub const BATCH: &str = "Examples:
  deltafin batch --demo --in requests.jsonl --out answers.jsonl
  deltafin batch --model DIR --in - --out - < requests.jsonl
A line is a JSON object with `id` and `prompt` (or `messages`), optionally `max_tokens`.";

pub const SERVE: &str = "Examples:
  deltafin serve --demo                                    then open http://127.0.0.1:8000/
  deltafin serve --model DIR --port 8080 --api-key KEY --draft ngram";

pub const COMPLETIONS: &str = "Examples:
  deltafin completions bash > ~/.local/share/bash-completion/completions/deltafin
  deltafin completions zsh > ~/.zfunc/_deltafin              (with fpath+=~/.zfunc in ~/.zshrc)
  deltafin completions fish > ~/.config/fish/completions/deltafin.fish";

/// Adds a tip to a usage error where clap gives none that helps.
pub fn add_tips(e: &mut clap::Error, args: &[String]) {
    match e.kind() {
        ErrorKind::InvalidSubcommand => {
            let Some(ContextValue::String(typed)) = e.get(ContextKind::InvalidSubcommand) else { return };
            if e.get(ContextKind::SuggestedSubcommand).is_some() {
                return;
            }
            if let Some(near) = nearest(typed, super::SUBCOMMANDS) {
                e.insert(ContextKind::SuggestedSubcommand, ContextValue::String(near.to_string()));
            }
        }
        ErrorKind::MissingRequiredArgument => {
            let missing_model = matches!(e.get(ContextKind::InvalidArg),
                Some(ContextValue::Strings(v)) if v.iter().any(|a| a.starts_with("--model")));
            let sub = args.iter().skip(1).find(|a| !a.starts_with('-'));
            if let (true, Some(sub)) = (missing_model, sub) {
                let tip = format!(
                    "no model yet? `deltafin {sub} --demo ...` uses the built-in demo model (no download); \
                     `deltafin setup` installs K3"
                );
                e.insert(ContextKind::Suggested, ContextValue::StyledStrs(vec![tip.into()]));
            }
        }
        _ => {}
    }
}

/// The name in `names` that `typed` most likely meant: at most two edits away, a swap of two
/// neighbouring letters counting as one (`rnu` -> `run`), and the only one that near.
fn nearest<'a>(typed: &str, names: &[&'a str]) -> Option<&'a str> {
    let typed = typed.to_ascii_lowercase();
    let mut best: Option<(usize, &str)> = None;
    let mut tie = false;
    for &n in names {
        let d = edit_distance(&typed, n);
        match best {
            Some((b, _)) if d > b => {}
            Some((b, _)) if d == b => tie = true,
            _ => {
                best = Some((d, n));
                tie = false;
            }
        }
    }
    match best {
        Some((d, n)) if d <= 2.min(typed.len().saturating_sub(1)).max(1) && !tie => Some(n),
        _ => None,
    }
}

/// Optimal string alignment distance: insertions, deletions, substitutions and swaps of
/// neighbours, each one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// A usage error found after parsing: the message and exit 2, as clap's own.
pub fn usage_error(msg: &str) -> ! {
    clap::Error::raw(clap::error::ErrorKind::MissingRequiredArgument, format!("{msg}\n")).exit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misspellings_find_their_subcommand() {
        let names = super::super::SUBCOMMANDS;
        for (typed, want) in [("rnu", "run"), ("rn", "run"), ("serv", "serve"), ("sdtup", "setup"), ("bnech", "bench")]
        {
            assert_eq!(nearest(typed, names), Some(want), "{typed}");
        }
        assert_eq!(nearest("frobnicate", names), None);
        assert_eq!(nearest("x", names), None);
    }
}

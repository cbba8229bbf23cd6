//! The arguments of `deltafin run` (shared by `run` and `run_many`), under help headings with the
//! common ones first: model, prompt, generation, output, then the engine's (its tuning knobs only
//! in `--help`, not `-h`); and the prompts they give (texts, files, lines, ids, the chat template).

use super::KdaArg;
use super::sampling_args::{RunWords, SamplingArgs};
use crate::draft::DraftKind;
use crate::model::chat::{ChatOptions, ChatTemplate, Thinking};
use crate::model::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args, ValueEnum};
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Generated text streamed as it is produced (token ids if the model has no tokenizer).
    Text,
    /// One JSON object at the end: prompt_ids, output_ids, text, stats.
    Json,
}

#[derive(Args)]
#[command(group(ArgGroup::new("input").args(["words", "prompt", "prompt_file", "prompt_lines", "prompt_ids"])))]
pub struct RunArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    #[arg(long, short, required_unless_present = "demo", conflicts_with = "demo", help_heading = "Model")]
    pub model: Option<PathBuf>,
    /// Use the built-in demo model (no download).
    ///
    /// K3's architecture and layout, laid out under deltafin's cache directory on first use; its
    /// generation_config.json gives the sampling defaults.
    #[arg(long, help_heading = "Model")]
    pub demo: bool,
    /// The prompt, as words after the options (`deltafin run --demo Why is the sky blue`): joined
    /// by spaces into one prompt, as `ollama run MODEL why is the sky blue` takes it.
    #[arg(value_name = "PROMPT", help_heading = "Prompt")]
    pub words: Vec<String>,
    /// Prompt text ("-" reads standard input); repeated, several prompts run together.
    #[arg(long, short, help_heading = "Prompt")]
    pub prompt: Vec<String>,
    /// Read the prompt text from a file ("-" for standard input); repeated, one prompt a file.
    #[arg(long, help_heading = "Prompt")]
    pub prompt_file: Vec<PathBuf>,
    /// Several prompts, one a line of this file, run together.
    ///
    /// Empty lines are skipped. The prompts run as a running batch: one read of each layer's
    /// experts per step for all of them.
    #[arg(long, value_name = "FILE", help_heading = "Prompt")]
    pub prompt_lines: Option<PathBuf>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed).
    #[arg(long, value_parser = super::parse_ids, help_heading = "Prompt")]
    pub prompt_ids: Option<TokenIds>,
    /// Keep the session in FILE: created on the first run, resumed (only the new prompt is
    /// prefilled) on the next; without a prompt, generation goes on where it stopped.
    ///
    /// With --chat each run appends a user turn and its answer. The file holds the model's state
    /// (checked against the model and a checksum before it is used) and is replaced atomically.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_lines", help_heading = "Prompt")]
    pub session: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long, help_heading = "Prompt")]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat", help_heading = "Prompt")]
    pub system: Option<String>,
    /// Thinking effort for --chat (default: the model's, from its generation_config.json's
    /// chat_template_kwargs, else the template's, max; off answers directly).
    #[arg(long, value_enum, help_heading = "Prompt")]
    pub thinking: Option<Thinking>,
    /// With several prompts: how many run at once (default: all).
    ///
    /// When one finishes the next joins at the next step. Answers are identical whatever it is.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096), help_heading = "Prompt")]
    pub parallel: Option<u64>,
    /// Maximum number of tokens to generate (llama.cpp's -n).
    #[arg(long, short = 'n', visible_alias = "n-predict", default_value_t = 256, help_heading = "Generation")]
    pub max_new: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs<RunWords>,
    /// Seed of the sampler (default: a fresh one, printed).
    ///
    /// The same seed gives the same output.
    #[arg(long, help_heading = "Generation")]
    pub seed: Option<u64>,
    /// Keep generating past the end-of-message token.
    #[arg(long, help_heading = "Generation")]
    pub ignore_eos: bool,
    /// Draft tokens for K3 to verify in batches (output is identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off, help_heading = "Generation")]
    pub draft: DraftKind,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text, help_heading = "Output")]
    pub format: Format,
    /// With --chat, do not show the model's reasoning (the thinking channel; shown dimmed on
    /// stderr by default).
    #[arg(long, requires = "chat", help_heading = "Output")]
    pub hide_reasoning: bool,
    /// Print every counter to stderr at the end.
    ///
    /// Bytes read, read amplification, cache hits, phase timers, tokens/s; --stats-json writes
    /// them as JSON. Without it a one-line summary is printed (unless -q).
    #[arg(long, help_heading = "Output")]
    pub stats: bool,
    /// Write the counters as JSON to this file.
    #[arg(long, help_heading = "Output")]
    pub stats_json: Option<PathBuf>,
    /// Record how often each expert is routed (input for `place --policy hot`).
    #[arg(long, help_heading = "Output", hide_short_help = true)]
    pub trace_routes: Option<PathBuf>,
    /// Replace an existing output file (--stats-json, --trace-routes, --expert-heat) that
    /// deltafin did not write; without it such a file is never overwritten.
    #[arg(long, help_heading = "Output", hide_short_help = true)]
    pub force: bool,
    /// No startup line, progress or summary (errors and --stats still print).
    #[arg(long, short, help_heading = "Output")]
    pub quiet: bool,
    /// The full startup line (layers, memory plan, expert source).
    ///
    /// As DELTAFIN_LOG=info shows it.
    #[arg(long, short, help_heading = "Output", conflicts_with = "quiet")]
    pub verbose: bool,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// How KDA processes the prompt.
    #[arg(long, value_enum, default_value_t = KdaArg::Auto, hide = true)]
    pub kda: KdaArg,
    #[command(flatten)]
    pub threads: super::Threads,
}

impl RunArgs {
    /// `--thinking`, else the model's default (its generation_config.json, else the template's).
    pub fn thinking(&self, dir: &Path) -> Result<Thinking> {
        Ok(match self.thinking {
            Some(t) => t,
            None => crate::model::generation::default_thinking(dir)?,
        })
    }

    /// The files this run writes and reads, checked before any work (`outputs`).
    pub fn check_outputs(&self) -> Result<()> {
        use super::outputs::{Kind, Outputs};
        Outputs::new(self.force)
            .write("--stats-json", self.stats_json.as_deref(), Kind::Stats)
            .write("--trace-routes", self.trace_routes.as_deref(), Kind::Routes)
            .engine(&self.engine)
            .read_all("--prompt-file", self.prompt_file.iter().map(PathBuf::as_path))
            .read("--prompt-lines", self.prompt_lines.as_deref())
            .read("--session", self.session.as_deref())
            .read("--prompt", self.prompt.iter().any(|p| p == "-").then_some(Path::new("-")))
            .check()
    }

    /// The positional words become the prompt (`-p`/`--prompt` given another way).
    pub fn take_words(&mut self) {
        if !self.words.is_empty() {
            self.prompt = vec![std::mem::take(&mut self.words).join(" ")];
        }
    }

    /// No prompt given at all.
    pub fn no_input(&self) -> bool {
        self.prompt.is_empty()
            && self.prompt_file.is_empty()
            && self.prompt_lines.is_none()
            && self.prompt_ids.is_none()
    }

    /// The prompts' texts, in order.
    pub fn prompt_texts(&self) -> Result<Vec<String>> {
        if let Some(f) = &self.prompt_lines {
            let all = read_text(&f.to_string_lossy(), true)?;
            let lines: Vec<String> = all.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
            if lines.is_empty() {
                bail!("--prompt-lines {}: no prompt in it (one prompt a line)", f.display());
            }
            return Ok(lines);
        }
        if !self.prompt.is_empty() {
            return self.prompt.iter().map(|p| read_text(p, false)).collect();
        }
        self.prompt_file.iter().map(|f| read_text(&f.to_string_lossy(), true)).collect()
    }

    /// Prompt ids from the arguments (and the tokenizer / chat template when text is given), one
    /// list per prompt.
    pub fn prompt_ids(&self, dir: &Path, tok: Option<&Tokenizer>) -> Result<Vec<Vec<u32>>> {
        if let Some(ids) = &self.prompt_ids {
            if self.chat {
                bail!("--chat needs a text prompt (--prompt or --prompt-file), not --prompt-ids");
            }
            return Ok(vec![ids.0.clone()]);
        }
        self.prompt_texts()?.iter().map(|t| self.text_ids(dir, tok, t)).collect()
    }

    /// One text prompt's ids.
    fn text_ids(&self, dir: &Path, tok: Option<&Tokenizer>, text: &str) -> Result<Vec<u32>> {
        let tok = tok.context("text prompts need a tokenizer")?;
        let ids = if self.chat {
            let chat = ChatTemplate::load(dir, tok).context("cannot load the chat template")?;
            let mut messages = Vec::new();
            if let Some(s) = &self.system {
                messages.push(serde_json::json!({"role": "system", "content": s}));
            }
            messages.push(serde_json::json!({"role": "user", "content": text}));
            let opts = ChatOptions { thinking: self.thinking(dir)?, ..ChatOptions::default() };
            chat.encode(tok, &serde_json::Value::Array(messages), &opts)?
        } else {
            tok.encode(text)
        };
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        Ok(ids)
    }
}

/// A prompt argument's text: itself, or (`from_file`) the file it names; "-" reads standard input.
fn read_text(arg: &str, from_file: bool) -> Result<String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("cannot read the prompt from standard input")?;
        return Ok(s);
    }
    if from_file {
        return std::fs::read_to_string(arg).with_context(|| format!("cannot read the prompt file {arg}"));
    }
    Ok(arg.to_string())
}

/// Token ids given on the command line as "1,2,3".
#[derive(Clone, Debug)]
pub struct TokenIds(pub Vec<u32>);

/// Parses "1,2,3" (spaces allowed) into token ids (public for the fuzz targets).
pub fn parse_ids(s: &str) -> Result<TokenIds, String> {
    let s = s.trim().trim_end_matches(',');
    if s.is_empty() {
        return Err("the prompt is empty".to_string());
    }
    s.split(',')
        .map(str::trim)
        .map(|t| {
            if t.is_empty() {
                return Err(
                    "an empty entry between commas (expected comma-separated non-negative integers, e.g. 1,2,3)"
                        .to_string(),
                );
            }
            t.parse::<u32>()
                .map_err(|_| format!("`{t}` is not a token id (expected comma-separated non-negative integers)"))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|v| if v.is_empty() { Err("the prompt is empty".to_string()) } else { Ok(TokenIds(v)) })
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn an_empty_entry_is_an_error_not_skipped() {
        assert_eq!(parse_ids(" 1, 2 ,3").unwrap().0, vec![1, 2, 3]);
        assert_eq!(parse_ids("1,2,").unwrap().0, vec![1, 2]);
        for bad in ["1,,2", ",1", "", " , ", "1,x"] {
            assert!(parse_ids(bad).is_err(), "{bad:?}");
        }
        assert!(parse_ids("1,,2").unwrap_err().contains("empty entry"));
    }
}

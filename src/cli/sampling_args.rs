//! The sampling flags of every command that generates — `run`, `chat`, `batch`, `serve` — as one
//! [`SamplingArgs`] flattened into each: one name, value parser and default per flag. What a flag
//! sets differs (a run's sampling, a chat's turns, the default of a batch's lines or a server's
//! requests), so each command's help words it its own way ([`Words`]); the flags are the same.
//!
//! Contract: a flag not given is None. [`SamplingArgs::spec`] lays the flags given over, with
//! `--demo`, the model's generation_config.json, over greedy (`SamplingDefaults::spec`), checked as
//! a request's sampling is, with no seed: the seed is each command's (`run --seed`, `chat --seed`,
//! a request's own).

use crate::model::generation::GenerationDefaults;
use crate::sample::{SamplingDefaults, SamplingSpec};
use anyhow::Result;
use clap::Args;
use std::marker::PhantomData;
use std::path::Path;

/// The words of the sampling flags in one command's help (short help, and the long help where
/// it says more; a value's name).
pub trait Words {
    /// The heading the flags are listed under (None: the command's options).
    const HEADING: Option<&'static str> = None;
    const TEMPERATURE: &'static str;
    const TEMPERATURE_LONG: Option<&'static str> = None;
    const TOP_P: &'static str;
    const TOP_P_LONG: Option<&'static str> = None;
    const TOP_K: &'static str = "Keep only the K most likely tokens when sampling (default 0: off, or the demo's)";
    const TOP_K_VALUE: &'static str = "K";
    const MIN_P: &'static str;
    const MIN_P_LONG: Option<&'static str> = None;
    const MIN_P_VALUE: &'static str = "P";
    const REPEAT_PENALTY: &'static str = "Repeat penalty over the last 64 tokens, prompt included, as llama.cpp's \
                                          (above 0; default 1: off)";
    const FREQUENCY_PENALTY: &'static str =
        "Frequency penalty, -2 to 2, per earlier emission of a token, as OpenAI's (default 0: off)";
    const PRESENCE_PENALTY: &'static str =
        "Presence penalty, -2 to 2, for a token emitted before, as OpenAI's (default 0: off)";
}

/// The sampling flags (see the module contract).
#[derive(Args, Clone, Copy, Debug, Default)]
pub struct SamplingArgs<W: Words> {
    // Sampling temperature, 0 (greedy: K3's argmax) to 2.
    #[arg(
        long,
        help = W::TEMPERATURE,
        long_help = W::TEMPERATURE_LONG,
        help_heading = W::HEADING,
        allow_negative_numbers = true,
        value_parser = super::parse_temperature
    )]
    pub temperature: Option<f64>,
    // Nucleus sampling: the most likely tokens up to this probability mass, 0 to 1.
    #[arg(
        long,
        help = W::TOP_P,
        long_help = W::TOP_P_LONG,
        help_heading = W::HEADING,
        allow_negative_numbers = true,
        value_parser = super::parse_top_p
    )]
    pub top_p: Option<f64>,
    // The K most likely tokens only (0: off).
    #[arg(long, help = W::TOP_K, value_name = W::TOP_K_VALUE, help_heading = W::HEADING)]
    pub top_k: Option<usize>,
    // Tokens at least P times as likely as the most likely only, 0 (off) to 1.
    #[arg(
        long,
        help = W::MIN_P,
        long_help = W::MIN_P_LONG,
        value_name = W::MIN_P_VALUE,
        help_heading = W::HEADING,
        allow_negative_numbers = true,
        value_parser = super::parse_min_p
    )]
    pub min_p: Option<f64>,
    // llama.cpp's repeat penalty (1: off).
    #[arg(long, help = W::REPEAT_PENALTY, value_name = "X", help_heading = W::HEADING, value_parser = parse_repeat_penalty)]
    pub repeat_penalty: Option<f64>,
    // OpenAI's frequency penalty (0: off).
    #[arg(
        long,
        help = W::FREQUENCY_PENALTY,
        value_name = "X",
        help_heading = W::HEADING,
        allow_negative_numbers = true,
        value_parser = parse_penalty
    )]
    pub frequency_penalty: Option<f64>,
    // OpenAI's presence penalty (0: off).
    #[arg(
        long,
        help = W::PRESENCE_PENALTY,
        value_name = "X",
        help_heading = W::HEADING,
        allow_negative_numbers = true,
        value_parser = parse_penalty
    )]
    pub presence_penalty: Option<f64>,
    #[arg(skip)]
    words: PhantomData<W>,
}

/// A repeat penalty: above 0 (1 is off).
fn parse_repeat_penalty(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if p.is_finite() && p > 0.0 => Ok(p),
        _ => Err(format!("`{s}` is not a repeat penalty (expected a number above 0; 1 is off)")),
    }
}

/// A frequency or presence penalty: -2 to 2 (0 is off), as the server accepts.
fn parse_penalty(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if p.is_finite() && (-2.0..=2.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a penalty (expected a number from -2 to 2; 0 is off)")),
    }
}

impl<W: Words> SamplingArgs<W> {
    /// The flags given (None: not given).
    pub fn given(&self) -> SamplingDefaults {
        SamplingDefaults {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
        }
    }

    /// The sampling of the model in `dir` (see the module contract): each flag when given; else,
    /// with `--demo`, the demo's generation_config.json; else greedy. Checked like a request's.
    pub fn spec(&self, dir: &Path, demo: bool) -> Result<SamplingSpec> {
        let model = if demo {
            GenerationDefaults::load(dir)?.unwrap_or_default().sampling
        } else {
            SamplingDefaults::default()
        };
        let s = self.given().or(model).spec();
        s.check().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(s)
    }
}

/// The "sampling: ..." startup line (`each`: one line for several prompts; the seed where chosen),
/// None when greedy without penalties.
pub fn sampling_line(s: &SamplingSpec, each: bool) -> Option<String> {
    (!s.is_greedy() || s.adjusts()).then(|| {
        let each = if each { " (each prompt)" } else { "" };
        let mut filters = String::new();
        if s.top_k > 0 {
            filters.push_str(&format!(" top-k {}", s.top_k));
        }
        if s.min_p > 0.0 {
            filters.push_str(&format!(" min-p {}", s.min_p));
        }
        if s.repetition_penalty != 1.0 {
            filters.push_str(&format!(" repeat-penalty {}", s.repetition_penalty));
        }
        if s.frequency_penalty != 0.0 {
            filters.push_str(&format!(" frequency-penalty {}", s.frequency_penalty));
        }
        if s.presence_penalty != 0.0 {
            filters.push_str(&format!(" presence-penalty {}", s.presence_penalty));
        }
        let seed = s.seed.map_or(String::new(), |n| format!(" seed {n}"));
        format!("deltafin: sampling: temperature {} top-p {}{filters}{seed}{each}", s.temperature, s.top_p)
    })
}

/// `run`'s words.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunWords;

impl Words for RunWords {
    const HEADING: Option<&'static str> = Some("Generation");
    const TEMPERATURE: &'static str = "Sampling temperature, 0 to 2 (0 is greedy: K3's argmax)";
    const TEMPERATURE_LONG: Option<&'static str> = Some(
        "Sampling temperature, 0 to 2 (0 is greedy: K3's argmax).\n\nDefault 0, or with --demo the demo's \
         generation_config.json.",
    );
    const TOP_P: &'static str = "Nucleus sampling: keep the most likely tokens up to this probability mass (0 to 1)";
    const TOP_P_LONG: Option<&'static str> = Some(
        "Nucleus sampling: keep the most likely tokens up to this probability mass (0 to 1).\n\nDefault 1, or with \
         --demo the demo's generation_config.json.",
    );
    const MIN_P: &'static str = "Keep only tokens at least P times as likely as the most likely when sampling (0 to 1)";
    const MIN_P_LONG: Option<&'static str> = Some(
        "Keep only tokens at least P times as likely as the most likely when sampling (0 to 1).\n\nDefault 0: off, or \
         the demo's.",
    );
}

/// `chat`'s words.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatWords;

impl Words for ChatWords {
    const TEMPERATURE: &'static str =
        "Sampling temperature (0: greedy; default 0, or with --demo the demo's; /temp changes it)";
    const TOP_P: &'static str = "Nucleus sampling mass (default 1, or with --demo the demo's)";
    const MIN_P: &'static str =
        "Keep only tokens at least P times as likely as the most likely (default 0: off, or the demo's)";
}

/// `serve`'s words: the flags are the sampling of requests that set none.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServeWords;

impl Words for ServeWords {
    const TEMPERATURE: &'static str = "Temperature of requests that set none (default 0: greedy; with --demo, the \
                                       demo's generation_config.json)";
    const TOP_P: &'static str =
        "top_p of requests that set none (default 1; with --demo, the demo's generation_config.json)";
    const TOP_K: &'static str =
        "top_k of requests that set none (default 0: off; with --demo, the demo's generation_config.json)";
    const TOP_K_VALUE: &'static str = "TOP_K";
    const MIN_P: &'static str =
        "min_p of requests that set none (default 0: off; with --demo, the demo's generation_config.json)";
    const MIN_P_VALUE: &'static str = "MIN_P";
}

/// `batch`'s words: the flags are the sampling of lines that set none.
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchWords;

impl Words for BatchWords {
    const TEMPERATURE: &'static str = "Temperature of lines that set none (default 0: greedy; with --demo, the demo's \
                                       generation_config.json)";
    const TOP_P: &'static str =
        "top_p of lines that set none (default 1; with --demo, the demo's generation_config.json)";
    const TOP_K: &'static str =
        "top_k of lines that set none (default 0: off; with --demo, the demo's generation_config.json)";
    const TOP_K_VALUE: &'static str = "TOP_K";
    const MIN_P: &'static str =
        "min_p of lines that set none (default 0: off; with --demo, the demo's generation_config.json)";
    const MIN_P_VALUE: &'static str = "MIN_P";
}

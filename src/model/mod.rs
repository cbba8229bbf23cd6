//! The model directory as shipped: `config.json`, safetensors shards (+ index), and the tensor
//! roster that checks every tensor the engine will touch before any compute.
//!
//! Contract: after [`checkpoint::Checkpoint::open`] and [`roster::Roster::build`] succeed, every
//! tensor of the language model exists with the expected dtype and shape, lies inside a complete
//! shard, and every routed expert is one contiguous byte range with the same internal layout.
//! Every failure is a [`ModelError`] naming the file and the field or tensor.

pub mod bpe_train;
pub mod chat;
pub mod checkpoint;
pub mod checksums;
pub mod config;
pub mod fingerprint;
pub mod generation;
pub mod integrity;
pub mod roster;
pub mod sidecar;
pub mod synth;
pub mod tokenizer;
pub mod tool_calls;
pub mod trunk_pack;
pub mod verify;

use std::path::PathBuf;

pub use checkpoint::Checkpoint;
pub use config::K3Config;
pub use roster::Roster;

/// A model's files without an engine: its config, mapped checkpoint and checked roster (what
/// placing experts and the I/O benchmarks need).
pub struct ModelFiles {
    pub dir: PathBuf,
    pub cfg: K3Config,
    pub ck: std::sync::Arc<Checkpoint>,
    pub roster: Roster,
}

impl ModelFiles {
    /// Bytes of all routed experts on disk.
    pub fn expert_bytes_total(&self) -> u64 {
        (self.cfg.moe_layers() * self.cfg.experts * self.cfg.expert_bytes()) as u64
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: malformed JSON: {source}", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{}: field `{field}`: {msg}", path.display())]
    Config { path: PathBuf, field: String, msg: String },
    #[error("{}: {msg}", path.display())]
    Safetensors { path: PathBuf, msg: String },
    #[error("{}: truncated: the header promises {expected} bytes but the file has {actual}", path.display())]
    Truncated { path: PathBuf, expected: u64, actual: u64 },
    /// Bytes that do not hash to their recorded checksum (`checksums`).
    #[error(transparent)]
    Checksum(Box<checksums::Mismatch>),
    /// A model file (config, tokenizer, template, index) that is not what was recorded.
    #[error("{}: {what}: {hint}", path.display())]
    FileChanged { path: PathBuf, what: String, hint: String },
    /// Shards `deltafin verify` found damaged.
    #[error("{}: shard(s) found damaged by a verify: {shards}; {hint}", dir.display())]
    Damaged { dir: PathBuf, shards: String, hint: String },
    #[error("{}: no model.safetensors.index.json and no model.safetensors", dir.display())]
    NoCheckpoint { dir: PathBuf },
    #[error("tensor roster check failed for {} ({} problem{}):\n{}", dir.display(), problems.len(), if problems.len() == 1 { "" } else { "s" }, format_problems(problems))]
    Roster { dir: PathBuf, problems: Vec<String> },
}

fn format_problems(p: &[String]) -> String {
    const SHOW: usize = 20;
    let mut s: String = p.iter().take(SHOW).map(|x| format!("  - {x}\n")).collect();
    if p.len() > SHOW {
        s.push_str(&format!("  ... and {} more\n", p.len() - SHOW));
    }
    s.trim_end().to_string()
}

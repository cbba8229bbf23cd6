//! `deltafin list` and `deltafin info` (Ollama's `list` and `show`): the models this machine's
//! deltafin has seen, and what one model is.
//!
//! Contract: `list` reads only records: the directories whose checksums deltafin keeps in its cache
//! (every model it opened or installed: `model::sidecar`), the demo's copy, and the Hugging Face
//! cache's snapshots; it opens no model and hashes nothing. A directory that is gone is shown as
//! gone. `info` opens one model's files (config, checkpoint headers, records) without an engine and
//! says what it holds and how it is verified; nothing is written.

use super::load;
use crate::model::checksums::Source;
use crate::util::human_bytes;
use anyhow::Result;
use clap::Args;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ListArgs {
    /// One JSON object a line instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct InfoArgs {
    /// Model directory.
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// The built-in demo model.
    #[arg(long)]
    demo: bool,
    /// One JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

/// One model directory `list` knows of.
#[derive(serde::Serialize)]
struct Known {
    dir: String,
    /// Where it is known from.
    from: &'static str,
    exists: bool,
    bytes: u64,
    shards: usize,
    /// How its checksums were recorded.
    verified: Option<String>,
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

fn describe_sources(sources: &[Source]) -> String {
    let mut v: Vec<&str> = sources
        .iter()
        .map(|s| match s {
            Source::Download => "download (sha256 checked)",
            Source::Written => "written by deltafin",
            Source::Files => "files as found",
        })
        .collect();
    v.dedup();
    v.join(", ")
}

/// The directories the cache's checksum records name, the demo's, and the Hugging Face snapshots.
fn known() -> Vec<Known> {
    let mut out: BTreeMap<String, Known> = BTreeMap::new();
    let layouts = crate::util::cache_dir().join("checksums").join("layouts");
    for f in std::fs::read_dir(&layouts)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|l| std::fs::read_dir(l.path()).into_iter().flatten().flatten())
    {
        let Ok(text) = std::fs::read_to_string(f.path()) else { continue };
        let Ok(k) = serde_json::from_str::<crate::model::sidecar::KeptRecord>(&text) else { continue };
        let dir = PathBuf::from(&k.dir);
        // Temporary directories of earlier runs (a synth's, a demo's layout) are not models.
        if dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
            continue;
        }
        let sources: Vec<Source> = k.sidecar.shards.iter().map(|r| r.source).collect();
        out.insert(
            k.dir.clone(),
            Known {
                exists: dir.join("config.json").is_file(),
                bytes: dir_bytes(&dir),
                shards: k.sidecar.shards.len(),
                verified: Some(describe_sources(&sources)),
                dir: k.dir,
                from: "opened or installed",
            },
        );
    }
    if let Some(hub) = crate::hub::hfcache::hub_cache_dir() {
        for repo in std::fs::read_dir(&hub).into_iter().flatten().flatten() {
            let name = repo.file_name().to_string_lossy().into_owned();
            if !name.starts_with("models--") {
                continue;
            }
            for snap in std::fs::read_dir(repo.path().join("snapshots")).into_iter().flatten().flatten() {
                let p = snap.path();
                if !p.join("config.json").exists() {
                    continue;
                }
                let key = p.display().to_string();
                out.entry(key.clone()).or_insert(Known {
                    dir: key,
                    from: "Hugging Face cache",
                    exists: true,
                    bytes: dir_bytes(&p),
                    shards: 0,
                    verified: None,
                });
            }
        }
    }
    out.into_values().collect()
}

pub fn list(a: ListArgs) -> Result<()> {
    let models = known();
    let mut out = std::io::stdout().lock();
    if a.json {
        for m in &models {
            writeln!(out, "{}", serde_json::to_string(m)?)?;
        }
        return Ok(());
    }
    if models.is_empty() {
        writeln!(
            out,
            "no models seen yet: `deltafin setup --repo ORG/NAME --dir DIR` installs one; `deltafin run --demo` runs the built-in demo"
        )?;
        return Ok(());
    }
    writeln!(out, "{:<60} {:>10} {:>7}  CHECKSUMS", "MODEL DIRECTORY", "SIZE", "SHARDS")?;
    for m in &models {
        let size = if m.exists { human_bytes(m.bytes) } else { "(gone)".into() };
        let shards = if m.shards > 0 { m.shards.to_string() } else { "-".into() };
        let ver = m.verified.clone().unwrap_or_else(|| format!("none yet ({})", m.from));
        writeln!(out, "{:<60} {:>10} {:>7}  {}", m.dir, size, shards, ver)?;
    }
    Ok(())
}

pub fn info(a: InfoArgs) -> Result<()> {
    let dir = load::model_dir(&a.model, a.demo)?;
    let opened = load::open(&dir)?;
    let c = &opened.cfg;
    let v = opened.ck.verification();
    let fp = crate::model::fingerprint::fingerprint(&opened.ck);
    let defaults = crate::model::generation::GenerationDefaults::load(&dir)?;
    let files: Vec<(String, u64)> = std::fs::read_dir(&dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()) && !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().map_or(0, |m| m.len())))
        .collect();
    let rec = serde_json::json!({
        "dir": dir.display().to_string(),
        "fingerprint": fp,
        "layers": c.layers,
        "moe_layers": c.moe_layers(),
        "experts": c.experts,
        "top_k": c.top_k,
        "hidden": c.hidden,
        "vocab": c.vocab,
        "max_context": c.max_context,
        "expert_bytes": c.expert_bytes(),
        "routed_expert_bytes": opened.expert_bytes_total(),
        "bytes_on_disk": files.iter().map(|f| f.1).sum::<u64>(),
        "chat_template": dir.join("chat_template.jinja").exists(),
        "tokenizer": dir.join("tiktoken.model").exists(),
        "generation_config": defaults.is_some(),
        "placement": dir.join(crate::store::placement::MANIFEST).exists(),
        "coded_trunk": dir.join("trunk-coded").is_dir(),
        "checksums": v.describe(),
    });
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{rec}")?;
        return Ok(());
    }
    writeln!(out, "{}", dir.display())?;
    writeln!(out, "  model        Kimi K3 architecture, fingerprint {}", crate::model::fingerprint::short(&fp))?;
    writeln!(
        out,
        "  layers       {} ({} MoE), hidden {}, vocabulary {}, context up to {}",
        c.layers,
        c.moe_layers(),
        c.hidden,
        c.vocab,
        c.max_context
    )?;
    writeln!(
        out,
        "  experts      {} a layer, {} a token, {} each, {} in all",
        c.experts,
        c.top_k,
        human_bytes(c.expert_bytes() as u64),
        human_bytes(opened.expert_bytes_total())
    )?;
    writeln!(
        out,
        "  on disk      {} in {} files",
        human_bytes(rec["bytes_on_disk"].as_u64().unwrap_or(0)),
        files.len()
    )?;
    let yes = |b: bool| if b { "yes" } else { "no" };
    writeln!(
        out,
        "  files        chat template {}, tokenizer {}, generation_config.json {}, placement {}, coded trunk {}",
        yes(rec["chat_template"] == true),
        yes(rec["tokenizer"] == true),
        yes(defaults.is_some()),
        yes(rec["placement"] == true),
        yes(rec["coded_trunk"] == true)
    )?;
    writeln!(out, "  checksums    {}", v.describe())?;
    Ok(())
}

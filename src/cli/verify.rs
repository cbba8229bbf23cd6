//! `deltafin verify`: re-hashes every byte of a model's shards and compares each tensor with its
//! recorded checksum (recording the shards never seen), checks a placement's packs too, marks
//! damaged shards so `deltafin setup` fetches them again, and says what to do.

use crate::model::Checkpoint;
use crate::model::checksums::Source;
use crate::store::placement::{self, MANIFEST, Manifest};
use crate::util::human_bytes;
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Args)]
pub struct VerifyArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Take the files as they are now as their new checksums (after changing them on purpose).
    #[arg(long)]
    rehash: bool,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

fn bar() -> ProgressBar {
    let target =
        if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let b = ProgressBar::with_draw_target(Some(0), target);
    b.set_style(
        ProgressStyle::with_template("verify [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b
}

pub fn run(a: VerifyArgs) -> Result<()> {
    if !a.model.is_dir() {
        bail!("model directory {} does not exist", a.model.display());
    }
    let ck =
        Checkpoint::open(&a.model).with_context(|| format!("cannot open the checkpoint in {}", a.model.display()))?;
    let pb = bar();
    let rep = ck.verify(a.rehash, &mut |d, t| {
        pb.set_length(t);
        pb.set_position(d);
    })?;
    pb.finish_and_clear();
    // A placement's packs: every record re-read and checked against the manifest.
    let mut pack_problems = Vec::new();
    let manifest = a.model.join(MANIFEST);
    if manifest.exists() && crate::hub::stream::StreamInstall::load(&a.model)?.is_none() {
        let cfg = crate::model::K3Config::load(&a.model)?;
        let roster = crate::model::Roster::build(&cfg, &ck)?;
        let m = Manifest::load(&manifest)?;
        m.check_model(&ck, &roster)?;
        let pb = bar();
        pack_problems = placement::verify(&m, &ck, &roster, &|d, t| {
            pb.set_length(t);
            pb.set_position(d);
        });
        pb.finish_and_clear();
    }
    let v = ck.verification();
    if a.json {
        let problems: Vec<String> = pack_problems
            .iter()
            .map(|p| format!("{}: expert {} of layer {}: {}", p.drive, p.expert, p.layer, p.msg))
            .collect();
        println!("{}", serde_json::json!({"report": rep, "verification": v, "placement_problems": problems}));
    }
    eprintln!(
        "deltafin verify: {} shard(s), {} read and hashed{}",
        rep.shards,
        human_bytes(rep.bytes),
        match (a.rehash, rep.recorded_now) {
            (true, _) => "; their checksums are recorded anew (--rehash)".to_string(),
            (false, 0) => String::new(),
            (false, n) => format!("; {n} shard(s) had no checksums and were recorded as found"),
        }
    );
    if rep.damage.is_empty() && pack_problems.is_empty() {
        eprintln!("deltafin verify: every tensor matches its checksum ({})", v.describe());
        return Ok(());
    }
    for d in rep.damage.iter().take(20) {
        eprintln!("  {}: tensor `{}`: xxh3 {}, recorded {}", d.path.display(), d.tensor, d.got, d.want);
    }
    if rep.damage.len() > 20 {
        eprintln!("  ... and {} more", rep.damage.len() - 20);
    }
    for p in pack_problems.iter().take(20) {
        eprintln!("  {}: expert {} of layer {}: {}", p.drive, p.expert, p.layer, p.msg);
    }
    let mut files: Vec<&PathBuf> = rep.damage.iter().map(|d| &d.path).collect();
    files.dedup();
    if !files.is_empty() {
        let downloaded =
            ck.shard_sums().iter().filter_map(|x| x.record.as_ref()).any(|r| r.source == Source::Download && r.damaged);
        eprintln!(
            "deltafin verify: {} damaged shard(s), marked so: {}",
            files.len(),
            if downloaded {
                format!(
                    "`deltafin setup --dir {} --repo ORG/NAME --revision REV` (as installed) downloads them again",
                    a.model.display()
                )
            } else {
                "restore them from a good copy (or, if you changed them on purpose, run `deltafin verify --rehash`)"
                    .to_string()
            }
        );
    }
    if !pack_problems.is_empty() {
        eprintln!("deltafin verify: re-run `deltafin place` for this model to rewrite the damaged pack records");
    }
    bail!(
        "{} damaged tensor(s), {} damaged placement record(s) in {}",
        rep.damage.len(),
        pack_problems.len(),
        a.model.display()
    )
}

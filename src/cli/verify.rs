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
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Verify the built-in demo model (its copy in deltafin's cache).
    #[arg(long)]
    demo: bool,
    /// Take the files as they are now as their new checksums (after changing them on purpose):
    /// the shards and the model files (config, tokenizer, chat template, index).
    #[arg(long, conflicts_with = "against_hub")]
    rehash: bool,
    /// Check each shard's sha256 against the hub's: its download record, the Hugging Face cache
    /// blob it links to, or (with --repo and --revision) the hub's listing. A match is recorded
    /// as verified; a mismatch is marked damaged.
    #[arg(long)]
    against_hub: bool,
    /// The hub repository the model came from (ORG/NAME), for --against-hub.
    #[arg(long, requires = "against_hub")]
    repo: Option<String>,
    /// The revision (branch, tag or commit) of --repo.
    #[arg(long, default_value = "main", requires = "repo")]
    revision: String,
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

pub fn run(mut a: VerifyArgs) -> Result<()> {
    let dir = super::load::model_dir(&a.model, a.demo)?;
    a.model = Some(dir.clone());
    run_on(&a, &dir)
}

fn run_on(a: &VerifyArgs, dir: &std::path::Path) -> Result<()> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let ck =
        Checkpoint::open_for_verify(dir).with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    if a.against_hub {
        return against_hub(a, dir, &ck);
    }
    let pb = bar();
    let rep = ck.verify(a.rehash, &mut |d, t| {
        pb.set_length(t);
        pb.set_position(d);
    })?;
    pb.finish_and_clear();
    // A placement's packs: every record re-read and checked against the manifest.
    let mut pack_problems = Vec::new();
    let manifest = dir.join(MANIFEST);
    if manifest.exists() && crate::hub::stream::StreamInstall::load(dir)?.is_none() {
        let cfg = crate::model::K3Config::load(dir)?;
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
    for p in &rep.changed_files {
        eprintln!("  {p}");
    }
    if !rep.unchecked.is_empty() {
        eprintln!(
            "deltafin verify: {} tensor(s) are not covered by a record (their shard's header changed since it was recorded), e.g. {}; `deltafin verify --rehash` records them as they are now",
            rep.unchecked.len(),
            rep.unchecked[0]
        );
    }
    if v.sources.contains(&Source::Files) {
        eprintln!(
            "deltafin verify: checksums recorded from the files as found: damage already present then cannot be found that way; `deltafin verify --against-hub` checks the files against the hub's sha256"
        );
    }
    if rep.damage.is_empty() && pack_problems.is_empty() && rep.changed_files.is_empty() {
        if rep.unchecked.is_empty() {
            eprintln!("deltafin verify: every tensor matches its checksum ({})", v.describe());
            return Ok(());
        }
        bail!("{} tensor(s) unchecked in {}", rep.unchecked.len(), dir.display());
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
                    dir.display()
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
    if !rep.changed_files.is_empty() {
        eprintln!(
            "deltafin verify: restore the changed model file(s), or, if they were changed on purpose, `deltafin verify --rehash` records them"
        );
    }
    bail!(
        "{} damaged tensor(s), {} changed model file(s), {} damaged placement record(s) in {}",
        rep.damage.len(),
        rep.changed_files.len(),
        pack_problems.len(),
        dir.display()
    )
}

/// `verify --against-hub`: every shard's sha256 against the hub's (hub::against).
fn against_hub(a: &VerifyArgs, dir: &std::path::Path, ck: &Checkpoint) -> Result<()> {
    let listing = match &a.repo {
        Some(repo) => Some(
            crate::hub::hfcache::list(&crate::hub::Hub::from_env(), repo, &a.revision)
                .with_context(|| format!("cannot list {repo} at {} on the hub", a.revision))?,
        ),
        None => None,
    };
    let check = crate::hub::against::verify_against_hub(ck, listing.as_ref(), &mut |name, ok| match ok {
        Some(true) => eprintln!("  {name}: sha256 matches the hub's"),
        Some(false) => eprintln!("  {name}: sha256 DIFFERS from the hub's: damaged"),
        None => eprintln!("  {name}: the hub's sha256 is not known here"),
    })?;
    if a.json {
        println!("{}", serde_json::json!({ "against_hub": check }));
    }
    if !check.relearned.is_empty() {
        eprintln!(
            "deltafin verify: {} shard(s) had checksums recorded from other bytes than the hub's (now replaced): {}",
            check.relearned.len(),
            check.relearned.join(", ")
        );
    }
    if !check.unknown.is_empty() {
        eprintln!(
            "deltafin verify: {} shard(s) have no known hub sha256: give --repo ORG/NAME --revision REV (the repository the model came from)",
            check.unknown.len()
        );
    }
    if !check.mismatched.is_empty() {
        bail!(
            "{} shard(s) differ from the hub's files in {}: {} (marked damaged; `deltafin setup` downloads them again)",
            check.mismatched.len(),
            dir.display(),
            check.mismatched.join(", ")
        );
    }
    if !check.unknown.is_empty() {
        bail!("{} of {} shard(s) could not be checked against the hub", check.unknown.len(), ck.shards.len());
    }
    eprintln!(
        "deltafin verify: every shard matches the hub's sha256 ({} shard(s)); recorded as verified",
        check.matched.len()
    );
    Ok(())
}

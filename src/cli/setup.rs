//! `deltafin setup`: installs a model from a Hugging Face-compatible hub — `--full` (every file,
//! verified) or `--stream` (everything but the routed experts, which are fetched on demand), the
//! choice made by free disk space when neither is given — plus the DSpark draft with `--draft`,
//! and `--fetch-routes` to stream ahead the experts a route trace used. `HF_HUB_OFFLINE=1`
//! installs from the Hugging Face cache only (full mode; nothing is requested). See docs/setup.md.

use crate::hub::client::{Hub, RepoInfo};
use crate::hub::download::{self, DownloadOptions, Job};
use crate::hub::hfcache::{HfRepoCache, hub_cache_dir};
use crate::hub::layout::{self, StreamOptions};
use crate::hub::stream::StreamInstall;
use crate::util::human_bytes;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::IsTerminal;
use std::io::Write as _;
use std::path::{Path, PathBuf};

pub const DEFAULT_REPO: &str = "moonshotai/Kimi-K3";
pub const DRAFT_REPO: &str = "Inferact/Kimi-K3-DSpark";
/// Where `--draft` puts the DSpark checkpoint, under `--dir`.
pub const DRAFT_DIR: &str = "dspark";
/// The DSpark files installed.
const DRAFT_FILES: [&str; 2] = ["config.json", "model.safetensors"];

#[derive(Args)]
pub struct SetupArgs {
    /// Download every file of the checkpoint.
    #[arg(long, conflicts_with = "stream")]
    full: bool,
    /// Download everything but the routed experts; they are fetched from the hub the first time a
    /// route needs them and kept on --drive.
    #[arg(long)]
    stream: bool,
    /// The model repo on the hub (HF_ENDPOINT chooses the hub, HF_TOKEN authenticates).
    #[arg(long, default_value = DEFAULT_REPO)]
    repo: String,
    /// Branch, tag or commit; resolved to a commit first, and every file is taken from it.
    #[arg(long, default_value = "main")]
    revision: String,
    /// The model directory to install into (it is then `--model DIR` of run/score/place).
    #[arg(long)]
    dir: PathBuf,
    /// Where stream mode keeps fetched experts (default: DIR); repeat to spread layers over drives.
    #[arg(long = "drive", value_name = "PATH")]
    drives: Vec<PathBuf>,
    /// Also install the DSpark draft checkpoint into DIR/dspark.
    #[arg(long)]
    draft: bool,
    /// The draft's repo.
    #[arg(long, default_value = DRAFT_REPO)]
    draft_repo: String,
    /// The draft's branch, tag or commit (resolved to a commit, like --revision).
    #[arg(long, default_value = "main")]
    draft_revision: String,
    /// Files (or trunk ranges) downloaded in parallel.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// Stream install only: fetch now every expert this route trace (`run --trace-routes`) used.
    #[arg(long, value_name = "ROUTES")]
    fetch_routes: Option<PathBuf>,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
    /// Skip the up-front free-space check (for testing a disk that fills mid-way).
    #[arg(long, hide = true)]
    skip_space_check: bool,
}

pub fn run(a: SetupArgs) -> Result<()> {
    let json = a.json;
    let r = run_setup(a);
    // With --json a failure is JSON too (on stdout, where the report would have been), so a
    // script reading the report sees why; the message goes to stderr and the exit status is 1 as
    // always.
    if let (true, Err(e)) = (json, &r) {
        let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
        let msg = super::error_text(e);
        writeln!(std::io::stdout(), "{}", serde_json::json!({"error": {"message": msg, "causes": chain}}))?;
    }
    r
}

fn run_setup(a: SetupArgs) -> Result<()> {
    if let Some(trace) = &a.fetch_routes {
        return super::setup_routes::fetch_routes(&a.dir, trace, a.json);
    }
    let hub = Hub::from_env();
    if hub.offline {
        if a.stream {
            bail!(
                "--stream fetches routed experts from the hub when routes first need them, and HF_HUB_OFFLINE is set: \
                 install --full from the Hugging Face cache, or unset HF_HUB_OFFLINE"
            );
        }
        let cache = hub_cache_dir().map_or_else(|| "none found".into(), |c| c.display().to_string());
        eprintln!("deltafin setup: HF_HUB_OFFLINE is set: installing from the Hugging Face cache only ({cache})");
    } else {
        eprintln!("deltafin setup: asking {} for {} at {} ...", hub.endpoint, a.repo, a.revision);
    }
    let info = crate::hub::hfcache::list(&hub, &a.repo, &a.revision)
        .with_context(|| format!("cannot list {} at revision {} on {}", a.repo, a.revision, hub.endpoint))?;
    let total: u64 = info.files.iter().map(|f| f.size).sum();
    eprintln!(
        "deltafin setup: {} at {} is commit {}: {} files, {}",
        a.repo,
        a.revision,
        info.commit,
        info.files.len(),
        human_bytes(total)
    );
    let stream = choose_mode(&a, &info)?;
    let cache = hub_cache_dir().and_then(|h| HfRepoCache::open(&h, &a.repo));
    if let Some(c) = &cache {
        eprintln!("deltafin setup: reusing verified files of the Hugging Face cache {}", c.root.display());
    }
    let dl = DownloadOptions {
        workers: a.workers as usize,
        progress: std::io::stderr().is_terminal(),
        skip_space_check: a.skip_space_check,
    };
    let mut out = serde_json::Map::new();
    out.insert("repo".into(), a.repo.clone().into());
    out.insert("commit".into(), info.commit.clone().into());
    out.insert("mode".into(), if stream { "stream" } else { "full" }.into());
    if stream {
        out.insert("stream".into(), stream_install(&hub, &a, &info, cache.as_ref(), &dl)?);
    } else {
        if StreamInstall::load(&a.dir)?.is_some() {
            bail!("{} is a stream install; give `setup --full` another --dir", a.dir.display());
        }
        // A repo's own checksum sidecar is another directory's record, never this one's.
        let jobs = info
            .files
            .iter()
            .filter(|f| f.path != crate::model::checksums::SIDECAR)
            .map(|f| Job { file: f.clone(), dest: a.dir.join(&f.path) })
            .collect();
        let partial = a.dir.join(download::PARTIAL_DIR);
        let r = download::download_all(&hub, &a.repo, &info.commit, jobs, &partial, cache.as_ref(), &dl)?;
        let _ = std::fs::remove_dir(&partial);
        report_download("", &a.dir, &r);
        out.insert("download".into(), serde_json::to_value(&r)?);
        if !a.drives.is_empty() {
            let drives: Vec<String> = a.drives.iter().map(|d| format!("--drive {}", d.display())).collect();
            eprintln!(
                "deltafin setup: to spread the experts over the drives: deltafin place --model {} {}",
                a.dir.display(),
                drives.join(" ")
            );
        }
    }
    if a.draft {
        let r = install_draft(&hub, &a, &dl)?;
        out.insert("draft".into(), serde_json::to_value(&r)?);
    }
    if a.json {
        writeln!(std::io::stdout(), "{}", serde_json::Value::Object(out))?;
    }
    Ok(())
}

/// `--stream`: the drives made absolute, the stream install, a note when the routed experts cannot
/// all fit the drives; its report for `--json`.
fn stream_install(
    hub: &Hub,
    a: &SetupArgs,
    info: &RepoInfo,
    cache: Option<&HfRepoCache>,
    dl: &DownloadOptions,
) -> Result<serde_json::Value> {
    let drives = if a.drives.is_empty() { vec![a.dir.clone()] } else { a.drives.clone() };
    // Recorded absolute: later runs may start anywhere.
    let mut abs = Vec::with_capacity(drives.len());
    for d in &drives {
        std::fs::create_dir_all(d).with_context(|| format!("--drive {}", d.display()))?;
        abs.push(std::fs::canonicalize(d).with_context(|| format!("--drive {}", d.display()))?);
    }
    let drives = abs;
    let r = layout::install_stream(
        hub,
        info,
        &a.dir,
        cache,
        &StreamOptions { download: dl.clone(), drives: drives.clone() },
    )?;
    eprintln!(
        "deltafin setup: stream install in {}: {} small files ({} downloaded), {} shards ({} already done) with {} of trunk in {} requests; {} of routed experts stream on demand",
        a.dir.display(),
        r.small_files.files,
        human_bytes(r.small_files.bytes_downloaded),
        r.shards,
        r.shards_skipped,
        human_bytes(r.trunk_bytes),
        r.requests,
        human_bytes(r.expert_bytes)
    );
    // Streamed experts accumulate on the drives: say early if they cannot all fit.
    let free: u64 = {
        let mut seen = Vec::new();
        let mut sum = 0;
        for d in &drives {
            let dev = std::os::unix::fs::MetadataExt::dev(&std::fs::metadata(d)?);
            if !seen.contains(&dev) {
                seen.push(dev);
                sum += download::free_bytes(d).unwrap_or(0);
            }
        }
        sum
    };
    if r.expert_bytes > free {
        eprintln!(
            "deltafin setup: note: all routed experts take {} but the --drive file systems have {} free; runs stop with a clear error once they fill",
            human_bytes(r.expert_bytes),
            human_bytes(free)
        );
    }
    Ok(serde_json::to_value(&r)?)
}

fn report_download(what: &str, dir: &Path, r: &download::DownloadReport) {
    eprintln!(
        "deltafin setup: {what}{} files in {}: {} already there, {} from the Hugging Face cache, {} downloaded ({} resumed) in {:.1} s{}",
        r.files,
        dir.display(),
        r.skipped,
        r.from_hf_cache,
        human_bytes(r.bytes_downloaded),
        human_bytes(r.bytes_resumed),
        r.seconds,
        if r.checksum_failures > 0 {
            format!("; {} corrupted downloads were fetched again", r.checksum_failures)
        } else {
            String::new()
        }
    );
}

/// Full or stream: the flags, else full when the disk holds the rest of the checkpoint with
/// headroom (5%, at least 1 GiB), else stream. Says why.
fn choose_mode(a: &SetupArgs, info: &RepoInfo) -> Result<bool> {
    if a.full || a.stream {
        return Ok(a.stream);
    }
    // Offline, every file comes from the Hugging Face cache: a full install.
    if Hub::from_env().offline {
        return Ok(false);
    }
    if StreamInstall::load(&a.dir)?.is_some() {
        eprintln!("deltafin setup: {} is a stream install; continuing it (--stream)", a.dir.display());
        return Ok(true);
    }
    let have = |p: &str| std::fs::metadata(a.dir.join(p)).map_or(0, |m| m.len());
    let need: u64 = info.files.iter().map(|f| f.size.saturating_sub(have(&f.path))).sum();
    let free = download::free_bytes(&a.dir).with_context(|| format!("free space of {}", a.dir.display()))?;
    let headroom = (need / 20).max(1 << 30);
    if need + headroom <= free {
        eprintln!(
            "deltafin setup: choosing --full: the checkpoint needs {} more and {} has {} free (headroom kept: {})",
            human_bytes(need),
            a.dir.display(),
            human_bytes(free),
            human_bytes(headroom)
        );
        Ok(false)
    } else {
        eprintln!(
            "deltafin setup: choosing --stream: the full checkpoint needs {} (+{} headroom) but {} has {} free; the trunk is installed now and routed experts are fetched when first used",
            human_bytes(need),
            human_bytes(headroom),
            a.dir.display(),
            human_bytes(free)
        );
        Ok(true)
    }
}

/// The DSpark checkpoint (`config.json`, `model.safetensors`) into DIR/dspark.
fn install_draft(hub: &Hub, a: &SetupArgs, dl: &DownloadOptions) -> Result<download::DownloadReport> {
    let info = crate::hub::hfcache::list(hub, &a.draft_repo, &a.draft_revision)
        .with_context(|| format!("cannot list the draft {} at {}", a.draft_repo, a.draft_revision))?;
    let dir = a.dir.join(DRAFT_DIR);
    let mut jobs = Vec::new();
    for name in DRAFT_FILES {
        let f = info
            .file(name)
            .with_context(|| format!("the draft repo {} at commit {} has no {name}", a.draft_repo, info.commit))?;
        jobs.push(Job { file: f.clone(), dest: dir.join(name) });
    }
    let cache = hub_cache_dir().and_then(|h| HfRepoCache::open(&h, &a.draft_repo));
    let partial = dir.join(download::PARTIAL_DIR);
    let r = download::download_all(hub, &a.draft_repo, &info.commit, jobs, &partial, cache.as_ref(), dl)?;
    let _ = std::fs::remove_dir(&partial);
    report_download("draft: ", &dir, &r);
    Ok(r)
}

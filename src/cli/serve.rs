//! `deltafin serve`: the OpenAI-compatible server over one engine (see `crate::serve`). The
//! listening line goes to stderr once the socket is bound (tests wait for it); Ctrl-C or SIGTERM
//! stops it cleanly.

use super::load;
use super::sampling_args::{SamplingArgs, ServeWords, sampling_line};
use crate::draft::DraftKind;
use crate::serve::ServeOptions;
use crate::service::generator::GenConfig;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// A chat request's `max_tokens` when it gives none: enough for a long answer, bounded so that a
/// model that never ends its message (or a long thinking channel) stops within minutes.
const DEFAULT_MAX_TOKENS: usize = 2048;

#[derive(Args)]
pub struct ServeArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    #[arg(long, short, required_unless_present = "demo", conflicts_with = "demo")]
    pub model: Option<PathBuf>,
    /// Use the built-in demo model (K3 layout, laid out on first use; its generation_config.json
    /// gives the sampling defaults).
    #[arg(long)]
    pub demo: bool,
    /// Address to listen on (loopback by default: nothing leaves the machine).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the listening line says which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 and /metrics (also from DELTAFIN_API_KEY).
    #[arg(long, env = "DELTAFIN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait while one runs; more get a 429 with Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Requests generated together: up to N run in one batch (each layer's experts read once for
    /// all of them per step), each answer identical to the request served alone; their sequence
    /// states must fit the memory budget together.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub parallel: u64,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = 128 << 20)]
    pub max_request_bytes: usize,
    /// Seconds a client may take to send a request's head (counted from its connection, or from
    /// its previous answer) and then its body; a slower one is disconnected (the body: 408).
    #[arg(long, default_value_t = 30.0, value_parser = super::parse_seconds)]
    pub read_timeout: f64,
    /// The model id clients name (default: the model directory's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Draft tokens for K3 to verify in batches (output is identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off)]
    pub draft: DraftKind,
    /// Do not keep sessions between requests (no conversation reuse; saves one sequence state).
    #[arg(long)]
    pub no_reuse: bool,
    /// Keep conversations and shared prompt prefixes in DIR too, so that they survive a restart
    /// (a follow-up request prefills only its new tokens and reports the rest as cached_tokens).
    ///
    /// Files are checked against the model and a checksum before use; the least recently used
    /// go when the directory passes --state-dir-gb.
    #[arg(long, value_name = "DIR", conflicts_with = "no_reuse")]
    pub state_dir: Option<std::path::PathBuf>,
    /// Size cap of --state-dir in GB (least recently used files are removed past it).
    #[arg(long, default_value_t = 32.0, requires = "state_dir", value_parser = super::parse_gb)]
    pub state_dir_gb: f64,
    /// Entries of the exact-response memo for repeated greedy requests (0: off).
    #[arg(long, default_value_t = 64)]
    pub memo: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs<ServeWords>,
    /// Most tokens a chat request that sets no max_tokens gets (fewer when the context has less
    /// room; 0: up to the context bound, as vLLM and llama-server; llama-server's -n).
    #[arg(long, short = 'n', default_value_t = DEFAULT_MAX_TOKENS)]
    pub max_tokens_default: usize,
    /// Replace an existing --expert-heat file that deltafin did not write; without it such a file
    /// is never overwritten.
    #[arg(long, hide_short_help = true)]
    pub force: bool,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// No startup line and no access log (one line per request on stderr).
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub threads: super::Threads,
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    if a.parallel > 1 && a.state_dir.is_some() {
        anyhow::bail!(
            "--state-dir keeps the sessions of a server that answers one request at a time; with --parallel {} nothing would be saved: drop one of the two",
            a.parallel
        );
    }
    super::outputs::Outputs::new(a.force).engine(&a.engine).check()?;
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let sampling = a.sampling.spec(&dir, a.demo)?;
    // Verify batches need k + 1 rows; prompts are chunked at --prefill-rows.
    let rows = a.engine.prefill_rows.max(8);
    let mut config = a.engine.config(dir.clone(), crate::engine::KdaMode::Recurrent, rows, 0);
    config.sequences = a.parallel as usize;
    let engine = load::open_engine(config)?;
    // N sequence states must fit beside the rest of the plan (each request's tokens are checked
    // when it is admitted).
    engine.sequences_fit(&vec![1; a.parallel as usize])?;
    // A drafter that cannot be built is a startup error, not a silent fallback.
    engine.drafter(a.draft)?;
    let model_id = a.model_name.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .unwrap_or(dir.clone())
            .file_name()
            .map_or("deltafin".into(), |n| n.to_string_lossy().into_owned())
    });
    if !a.quiet {
        eprintln!("{}", super::report::startup(&engine, super::report::verbose(false)));
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }
    if let Some(line) = sampling_line(&sampling, false) {
        let line = line.replace("sampling:", "requests that set no sampling use");
        eprintln!("{line} (a request's own seed, else a fresh one per request)");
    }
    let opts = ServeOptions {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        queue: a.queue,
        parallel: a.parallel as usize,
        max_request_bytes: a.max_request_bytes,
        read_timeout: std::time::Duration::from_secs_f64(a.read_timeout),
        model_id: model_id.clone(),
        generation: GenConfig {
            draft: a.draft,
            reuse: !a.no_reuse,
            memo_entries: a.memo,
            state_dir: a.state_dir.clone().map(|d| (d, (a.state_dir_gb * 1e9) as u64)),
        },
        sampling,
        max_tokens: (a.max_tokens_default > 0).then_some(a.max_tokens_default),
        access_log: !a.quiet,
    };
    if opts.api_key.is_none() && !crate::serve::access::is_loopback(&a.host) {
        eprintln!(
            "deltafin: warning: listening on {} without --api-key: anyone who can reach this machine can use the model; give --api-key KEY (or DELTAFIN_API_KEY)",
            a.host
        );
    }
    let auth = if opts.api_key.is_some() { "API key required" } else { "no API key" };
    crate::serve::serve(engine, opts, |addr| {
        let (url, note) = crate::serve::browser_address(addr);
        let note = note.map_or(String::new(), |n| format!("; {n}"));
        eprintln!("deltafin: serving {model_id} on http://{url} (OpenAI API at /v1, chat page at /, {auth}{note})");
    })?;
    eprintln!("deltafin: server stopped");
    Ok(())
}

//! Command-line interface: clap definitions and one file per subcommand. Errors are `anyhow` with
//! context here at the edge; exit codes: 0 success, 1 runtime error (also a batch with failed
//! lines), 2 usage error, 130 interrupted by Ctrl-C; a closed output pipe ends the process by
//! SIGPIPE, quietly (`signals`).

mod batch;
mod batch_io;
mod batch_results;
mod bench;
mod bench_run;
mod chat;
mod engine;
mod help;
mod load;
mod log;
mod models;
mod names;
mod outputs;
mod pack_trunk;
mod parse;
mod place;
mod plan;
mod plot;
mod progress;
mod report;
mod run;
mod run_args;
mod run_many;
mod sampling_args;
mod score;
mod serve;
mod session;
mod setup;
mod setup_routes;
mod signals;
mod synth;
mod verify;
mod version;

pub use run_args::{TokenIds, parse_ids};

use clap::{Parser, Subcommand};
pub(crate) use parse::{
    parse_gb, parse_gb_positive, parse_min_p, parse_qd, parse_seconds, parse_temperature, parse_threads, parse_top_p,
};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "deltafin",
    version = version::SHORT,
    about = "Runs Kimi K3 exactly on one machine by streaming its MXFP4 experts from SSDs"
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// The subcommands' names (for the tip on a mistyped one).
const SUBCOMMANDS: &[&str] = &[
    "run",
    "chat",
    "score",
    "synth",
    "place",
    "pack-trunk",
    "plan",
    "bench",
    "setup",
    "batch",
    "serve",
    "verify",
    "list",
    "info",
    "completions",
];

/// `--threads`, on the subcommands whose kernels run on the thread pool.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Threads {
    /// Worker threads for the kernels (default: all cores, or RAYON_NUM_THREADS). Results do not
    /// depend on it.
    #[arg(long = "threads", value_parser = parse_threads, help_heading = "Engine")]
    pub threads: Option<usize>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate from a prompt (greedy, or sampled with --temperature).
    #[command(after_help = help::RUN)]
    Run(run::RunArgs),
    /// Chat with the model in the terminal (history, /commands; reads stdin when it is not a terminal).
    Chat(chat::ChatArgs),
    /// Compute logits at every position of a prompt and write them to a safetensors file.
    #[command(after_help = help::SCORE)]
    Score(score::ScoreArgs),
    /// Write a random-weight checkpoint in the exact shipped layout (any size).
    #[command(after_help = help::SYNTH)]
    Synth(synth::SynthArgs),
    /// Place experts on drives: pack files + placement.json (or --verify an existing placement).
    #[command(after_help = help::PLACE)]
    Place(place::PlaceArgs),
    /// Code the trunk losslessly into MODEL/trunk-coded/ (used by --trunk coded, the default when present).
    #[command(after_help = help::PACK_TRUNK)]
    PackTrunk(pack_trunk::PackTrunkArgs),
    /// Kimi K3's memory plan on a machine of --memory-gb: trunk per encoding, expert cache, decode bound.
    #[command(after_help = help::PLAN)]
    Plan(plan::PlanArgs),
    /// Benchmarks printing one JSON record per run.
    #[command(after_help = help::BENCH)]
    Bench(bench::BenchArgs),
    /// Install a model from a Hugging Face-compatible hub (--full, or --stream experts on demand).
    #[command(after_help = help::SETUP)]
    Setup(setup::SetupArgs),
    /// Run a JSONL file of requests (resumable: ids already in the output are skipped).
    #[command(after_help = help::BATCH)]
    Batch(batch::BatchArgs),
    /// OpenAI-compatible HTTP server (chat, completions, streaming, metrics, a chat page at /).
    #[command(after_help = help::SERVE)]
    Serve(serve::ServeArgs),
    /// Check every byte of a model's files against their recorded checksums (records them first if none).
    Verify(verify::VerifyArgs),
    /// The models deltafin has seen on this machine (opened, installed, in the Hugging Face cache).
    List(models::ListArgs),
    /// What a model is: architecture, size, files, how its bytes are verified.
    Info(models::InfoArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(after_help = help::COMPLETIONS)]
    Completions(version::CompletionsArgs),
}

impl Cmd {
    /// `--threads` of the subcommands that take it.
    fn threads(&self) -> Option<usize> {
        match self {
            Cmd::Run(a) => a.threads.threads,
            Cmd::Chat(a) => a.threads.threads,
            Cmd::Score(a) => a.threads.threads,
            Cmd::Synth(a) => a.threads.threads,
            Cmd::Bench(a) => a.threads(),
            Cmd::Batch(a) => a.threads.threads,
            Cmd::Serve(a) => a.threads.threads,
            Cmd::Place(_)
            | Cmd::Setup(_)
            | Cmd::PackTrunk(_)
            | Cmd::Plan(_)
            | Cmd::Verify(_)
            | Cmd::List(_)
            | Cmd::Info(_)
            | Cmd::Completions(_) => None,
        }
    }
}

/// How KDA evaluates a prompt (hidden option for tests and comparisons).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KdaArg {
    /// The recurrence (the engine's choice).
    Auto,
    Chunked,
    Recurrent,
}

impl From<KdaArg> for crate::engine::KdaMode {
    fn from(k: KdaArg) -> Self {
        match k {
            KdaArg::Auto | KdaArg::Recurrent => crate::engine::KdaMode::Recurrent,
            KdaArg::Chunked => crate::engine::KdaMode::Chunked,
        }
    }
}

/// Parses arguments, runs the subcommand and maps errors to exit codes.
pub fn main() -> ExitCode {
    // Library messages name settings by the flags that set them.
    names::install();
    let args: Vec<String> = std::env::args().collect();
    use clap::{CommandFactory, FromArgMatches};
    // `--version` says more than `-V` (built only when asked: it looks at the machine).
    let mut cmd = Cli::command();
    if args.iter().any(|a| a == "--version") {
        cmd = cmd.long_version(&*Box::leak(version::long().into_boxed_str()));
    }
    let parsed = cmd.try_get_matches().and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(mut e) => {
            help::add_tips(&mut e, &args);
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    log::init();
    // rayon reads RAYON_NUM_THREADS itself when --threads is absent; hold it to the same bound so a
    // stray value is a clear usage error, not a panic when the pool first starts.
    let threads = match (cli.cmd.threads(), std::env::var("RAYON_NUM_THREADS")) {
        (Some(n), _) => Some(n),
        (None, Ok(v)) if !v.trim().is_empty() => match parse_threads(v.trim()) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("error: RAYON_NUM_THREADS={v}: {e}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    if let Some(n) = threads
        && let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global()
    {
        eprintln!("error: cannot set up {n} threads: {e}");
        return ExitCode::from(1);
    }
    let result = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Chat(a) => chat::run(a),
        Cmd::Score(a) => score::run(a),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Place(a) => place::run(a),
        Cmd::PackTrunk(a) => pack_trunk::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Setup(a) => setup::run(a),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Batch(a) => batch::run(a),
        Cmd::Verify(a) => verify::run(a),
        Cmd::List(a) => models::list(a),
        Cmd::Info(a) => models::info(a),
        Cmd::Completions(a) => version::completions(a),
    };
    match result {
        // The reader of our output closed the pipe (`| head`): end quietly, as `cat` does.
        Err(e) if signals::is_broken_pipe(&e) => signals::die_of_sigpipe(),
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::from(if signals::interrupted() { signals::INTERRUPTED } else { 1 })
        }
        Ok(()) if signals::interrupted() => ExitCode::from(signals::INTERRUPTED),
        Ok(()) => ExitCode::SUCCESS,
    }
}

/// The error and its causes, each once: library errors embed their source in their own message
/// (so they read well alone), and anyhow's chain would print that source a second time.
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if !out.contains(&t) {
            let sep = if out.is_empty() { "" } else { ": " };
            out = format!("{out}{sep}{t}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// clap's own checks of the definitions (no short flag taken twice in a command, groups and
    /// conflicts naming real arguments), which release builds skip unless asked.
    #[test]
    fn the_command_line_definitions_are_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}

//! Benchmarks: each measures one thing and returns one JSON record (`stats::bench_record`:
//! machine, command, git revision, then its own fields); the CLI (`cli/bench.rs`,
//! `cli/bench_run.rs`) parses arguments, prints the records and keeps them.
//!
//! Contract: these modules parse no arguments and print no records; files they write are the
//! ones a caller names (a fetch trace). Errors are [`BenchError`], naming the file, setting or
//! phase that failed. `io` times the expert store's reads against fio replaying the same reads;
//! `kernels` the CPU kernels at K3's shapes (`kernels_gpu`: the GPU's, development only); `run`
//! one cold prompt and its decode steps against the disk ceiling that `ceiling` measures on the
//! run's own expert holders; `batch` N prompts run together (`bench run --batch N`); `prompt` the
//! prompts they use; `cold` empties the page cache and labels whether a run's reads were cold
//! (never a warm macOS run: F_NOCACHE serves cached pages).

pub mod batch;
pub mod ceiling;
pub mod cold;
pub mod io;
pub mod kernels;
pub mod kernels_gpu;
pub mod prompt;
pub mod run;

use crate::setting::{Action, Setting};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Placement(#[from] crate::store::placement::PlacementError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// Settings that conflict with each other (the model is not at fault).
    #[error(transparent)]
    Engine(Box<crate::engine::EngineError>),
    #[error("cannot open the model in {}: {source}", dir.display())]
    Open { dir: PathBuf, source: Box<crate::engine::EngineError> },
    #[error(transparent)]
    Draft(#[from] crate::draft::DraftError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[cfg(feature = "gpu")]
    #[error(transparent)]
    Gpu(#[from] crate::backend::gpu::GpuError),
    /// The prompt (`phase` "prefill") or the decode steps (`phase` "decode") failed.
    #[error("{phase} failed: {source}")]
    Forward { phase: &'static str, source: crate::engine::ForwardError },
    #[error("measuring the disk ceiling: {0}")]
    Ceiling(#[from] crate::store::probe::ProbeError),
    /// A ladder runs over drive subsets of a placement, and there is none.
    #[error("{} needs a placement ({})", Setting::Ladder, Action::Place)]
    LadderNeedsPlacement,
    /// The GPU's kernel timings were asked for from a build without them (they are a development
    /// tool, not in the shipped binary).
    #[error("the GPU kernel microbench is not in this build: build deltafin with the cargo feature gpu-bench")]
    GpuMicrobenchNotBuilt,
    /// The model has no routed experts, and the benchmark reads experts.
    #[error("{}: the model has no routed experts", .0.display())]
    NoRoutedExperts(PathBuf),
    /// A file of token ids that does not hold token ids (`problem` says what it holds).
    #[error("{}: {problem}", path.display())]
    PromptIds { path: PathBuf, problem: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// Handing a record to the caller's sink (printing it, appending it to a file) failed.
    #[error("cannot write a record: {0}")]
    Sink(std::io::Error),
    #[error("{}: {source}", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
}

impl From<crate::engine::EngineError> for BenchError {
    fn from(e: crate::engine::EngineError) -> Self {
        BenchError::Engine(Box::new(e))
    }
}

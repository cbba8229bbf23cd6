//! The settings a user chooses and the actions a message may suggest, as the library names them in
//! its errors and warnings.
//!
//! Contract: library code never spells a front end's syntax (a CLI flag or command line); a message
//! about a setting holds a [`Setting`] (or an [`Action`]) and shows it through `Display`: by its
//! library name — the field of `EngineConfig`, `SynthSpec` or the options it belongs to, in
//! backticks — unless a front end installed its own names with [`use_names`] once at start (the CLI
//! shows `--memory-gb` and `` `deltafin place` ``; its table is in `cli/names.rs`). Messages are
//! formed when an error is made, so the names in force then are the ones shown.

use std::fmt;
use std::sync::OnceLock;

/// A setting a user chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Setting {
    MemoryGb,
    /// Tokens of context reserved for each sequence.
    Context,
    ExpertCacheGb,
    GpuCacheGb,
    Backend,
    UseDrives,
    Placement,
    ExpertsFrom,
    Model,
    PromptIds,
    Draft,
    DraftModel,
    TraceRoutes,
    /// `synth`'s output replaces an existing one.
    Force,
    /// The directory a server keeps sessions in.
    StateDir,
    Layers,
    Experts,
    DenseLayers,
    Vocab,
    TopK,
    ExpertInter,
    ExpertLatent,
    ConvWidth,
    AttnResBlock,
    MlaEvery,
    /// The install directory of a hub setup.
    Dir,
    Repo,
    /// A drive directory (of a placement or a stream install).
    Drive,
    /// `bench run` over drive subsets of the placement.
    Ladder,
    /// A benchmark's page cache was purged just before it (macOS: `sudo purge`).
    AssumePurged,
}

/// An action a message may suggest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Place the model's experts on drives and write its manifest.
    Place,
    /// Install a model in stream mode (trunk now, experts on first use).
    SetupStream,
    /// Install a model from the hub (resuming where a previous install stopped).
    Setup,
    /// Record a run's routes on a model (for a `hot` placement).
    RecordRoutes,
    /// Check every byte of a model's files against their recorded checksums.
    Verify,
    /// Take a model's files as they are now as their new checksums (changed on purpose).
    Rehash,
    /// Check a model's files against the hub's own sha256.
    VerifyAgainstHub,
}

impl Setting {
    /// The library's name: the field that holds the setting.
    pub fn field(self) -> &'static str {
        use Setting::*;
        match self {
            MemoryGb => "memory_gb",
            Context => "context",
            ExpertCacheGb => "expert_cache_gb",
            GpuCacheGb => "gpu_cache_gb",
            Backend => "backend",
            UseDrives => "use_drives",
            Placement => "placement",
            ExpertsFrom => "experts_from",
            Model => "model",
            PromptIds => "prompt_ids",
            Draft => "draft",
            DraftModel => "draft_model",
            TraceRoutes => "trace_routes",
            Force => "force",
            StateDir => "state_dir",
            Layers => "layers",
            Experts => "experts",
            DenseLayers => "dense_layers",
            Vocab => "vocab",
            TopK => "top_k",
            ExpertInter => "expert_inter",
            ExpertLatent => "expert_latent",
            ConvWidth => "conv_width",
            AttnResBlock => "attn_res_block",
            MlaEvery => "mla_every",
            Dir => "dir",
            Repo => "repo",
            Drive => "drives",
            Ladder => "ladder",
            AssumePurged => "assume_purged",
        }
    }
}

impl Action {
    /// The library's name: the function that does it.
    pub fn function(self) -> &'static str {
        match self {
            Action::Place => "store::placement::place",
            Action::SetupStream => "hub::setup in stream mode",
            Action::Setup => "hub::setup",
            Action::RecordRoutes => "a run with `trace_routes`",
            Action::Verify => "model::Checkpoint::verify",
            Action::Rehash => "model::Checkpoint::verify with `rehash`",
            Action::VerifyAgainstHub => "model::Checkpoint::verify_against_hub",
        }
    }
}

/// A front end's names for settings and actions.
#[derive(Clone, Copy)]
pub struct Names {
    pub setting: fn(Setting) -> &'static str,
    pub action: fn(Action) -> &'static str,
}

static NAMES: OnceLock<Names> = OnceLock::new();

/// Shows settings and actions by `names` from now on (the first call wins; later ones are ignored,
/// so the names never change under a running program).
pub fn use_names(names: Names) {
    let _ = NAMES.set(names);
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match NAMES.get() {
            Some(n) => f.write_str((n.setting)(*self)),
            None => write!(f, "`{}`", self.field()),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match NAMES.get() {
            Some(n) => f.write_str((n.action)(*self)),
            None => write!(f, "`{}`", self.function()),
        }
    }
}

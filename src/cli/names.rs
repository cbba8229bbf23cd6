//! The CLI's names for the settings and actions library messages mention ([`crate::setting`]):
//! the flags and commands a user types. Installed once at start by [`crate::cli::main`].

use crate::setting::{Action, Names, Setting};

/// The flag that sets `s` (the setting's field where no flag sets it).
pub fn flag(s: Setting) -> &'static str {
    use Setting::*;
    match s {
        MemoryGb => "--memory-gb",
        Context => "--context",
        ExpertCacheGb => "--expert-cache-gb",
        GpuCacheGb => "--gpu-cache-gb",
        Backend => "--backend",
        UseDrives => "--use-drives",
        Placement => "--placement",
        ExpertsFrom => "--experts-from",
        Model => "--model",
        PromptIds => "--prompt-ids",
        Draft => "--draft",
        DraftModel => "--draft-model",
        TraceRoutes => "--trace-routes",
        Force => "--force",
        StateDir => "--state-dir",
        Layers => "--layers",
        Experts => "--experts",
        DenseLayers => "--dense-layers",
        Vocab => "--vocab",
        TopK => "--top-k",
        ExpertInter => "--expert-inter",
        ExpertLatent => "--expert-latent",
        // No flag: the preset's value (a config.json of another source could hold any).
        ConvWidth => "the conv width",
        AttnResBlock => "--block",
        MlaEvery => "--mla-every",
        Dir => "--dir",
        Repo => "--repo",
        Drive => "--drive",
        Ladder => "--ladder",
        AssumePurged => "--assume-purged",
    }
}

/// The command that does `a`.
pub fn command(a: Action) -> &'static str {
    match a {
        Action::Place => "`deltafin place`",
        Action::SetupStream => "`deltafin setup --stream`",
        Action::Setup => "`deltafin setup`",
        Action::RecordRoutes => "`deltafin run --model DIR --trace-routes FILE`",
        Action::Verify => "`deltafin verify --model DIR`",
        Action::Rehash => "`deltafin verify --rehash --model DIR`",
        Action::VerifyAgainstHub => "`deltafin verify --against-hub --model DIR`",
    }
}

/// Library messages name settings by these flags from now on.
pub fn install() {
    crate::setting::use_names(Names { setting: flag, action: command });
}

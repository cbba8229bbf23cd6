//! What `--version` says (the release, the commit it was built from, the features compiled in,
//! the instruction set the CPU kernels use here) and `deltafin completions SHELL`.

use anyhow::Result;
use clap::CommandFactory;

/// `-V`: the release and the commit (`build.rs` embeds it; "unknown" outside a git checkout).
pub const SHORT: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("DELTAFIN_GIT_REV"), ")");

/// `--version`: [`SHORT`], then the features, the CPU kernels' instruction set on this machine and
/// the ones it supports, and the target.
pub fn long() -> String {
    let mut features = Vec::new();
    if cfg!(feature = "gpu") {
        features.push("gpu (Vulkan, Metal)");
    }
    if cfg!(feature = "gpu-bench") {
        features.push("gpu-bench");
    }
    let features = if features.is_empty() { "none (CPU only)".to_string() } else { features.join(", ") };
    // The instruction set the kernels chose here (the best this CPU has, or DELTAFIN_ISA's).
    let machine = crate::stats::machine_info();
    let isa = machine["isa"].as_str().unwrap_or("unknown");
    format!(
        "{SHORT}\nfeatures: {features}\ncpu kernels: {isa} (DELTAFIN_ISA=scalar|avx2|avx512|neon chooses another)\ntarget: {}-{}",
        std::env::consts::ARCH,
        std::env::consts::OS,
    )
}

#[derive(clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

/// Prints the completion script for the shell on stdout.
pub fn completions(a: CompletionsArgs) -> Result<()> {
    let mut cmd = super::Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, "deltafin", &mut out);
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&out)?;
    stdout.flush()?;
    Ok(())
}

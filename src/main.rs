// No function over 120 lines (clippy.toml's `too-many-lines-threshold`), as in the library.
#![warn(clippy::too_many_lines)]

fn main() -> std::process::ExitCode {
    deltafin::cli::main()
}

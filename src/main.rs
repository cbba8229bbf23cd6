fn main() -> std::process::ExitCode {
    deltafin::cli::main()
}

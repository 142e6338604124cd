//! The `tailgate` binary: parse arguments, build, run. Everything else lives in the
//! `tailgate` (gateway) and `tailgate-bench` (load generator) libraries.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

// mimalloc: the gateway allocates small, short-lived objects per request on every worker;
// mimalloc's per-thread free lists take fewer instructions per request than glibc's malloc
// (measured with callgrind, see CHANGELOG).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `tailgate --version`: the version, the commit built, and `profile-guided build` when the
/// binary was compiled with a profile (`-Cprofile-use`, as `scripts/pgo.sh` builds it;
/// `build.rs` looks at the flags), so a benchmark report can say which build it measured.
const VERSION: &str = if option_env!("TAILGATE_PROFILE_GUIDED").is_some() {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (",
        env!("TAILGATE_COMMIT"),
        ", profile-guided build)"
    )
} else {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (",
        env!("TAILGATE_COMMIT"),
        ")"
    )
};

#[derive(Parser)]
#[command(
    name = "tailgate",
    version = VERSION,
    about = "A multi-tenant API gateway built for the tail."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// The TOML config file.
        #[arg(long, short)]
        config: PathBuf,
        /// Notify systemd (Type=notify) and feed its watchdog (WatchdogSec=) only while
        /// every data-plane worker is responsive.
        #[arg(long)]
        watchdog: bool,
    },
    /// Validate a config file; print every error as file:line:col and exit non-zero.
    Check {
        /// The TOML config file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run a built-in demo upstream (answers every request itself).
    DemoUpstream {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: String,
    },
    /// Load generator and benchmark scenarios (`tailgate bench --help`).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve { config, watchdog } => report(tailgate::cli::serve(&config, watchdog)),
        Command::Check { config } => report(tailgate::cli::check(&config)),
        Command::DemoUpstream { listen } => report(tailgate::cli::demo_upstream(&listen)),
        Command::Bench { args } => {
            let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("tailgate"));
            tailgate_bench::cli::main(args, exe)
        }
    }
}

fn report(result: Result<(), tailgate::cli::CliError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(e.exit_code())
        }
    }
}

//! `tailgate-bench`: the bench commands without the gateway, for tests and for machines where
//! only this crate is built. `tailgate-bench ARGS` = `tailgate bench ARGS` (a leading `bench`
//! is accepted too, so scenarios can start `tailgate-bench bench upstream ...`); there is no
//! `serve`, so scenarios run through this binary skip tailgate with a note.
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == "bench") {
        args.remove(0);
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("tailgate-bench"));
    tailgate_bench::cli::main(args, exe)
}

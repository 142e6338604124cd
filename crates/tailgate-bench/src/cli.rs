//! `tailgate bench ...` argument handling.
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

/// Entry point for `tailgate bench ARGS...`; `tailgate_exe` is the path of the running
/// `tailgate` binary, used by scenarios to start the gateway (`tailgate serve --config F`).
pub fn main(_args: Vec<OsString>, _tailgate_exe: PathBuf) -> ExitCode {
    eprintln!("tailgate bench: not built yet");
    ExitCode::from(2)
}

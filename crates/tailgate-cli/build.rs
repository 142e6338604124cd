//! Tells `tailgate --version` the commit built, and whether this build was compiled with a
//! profile (`-Cprofile-use`, `scripts/pgo.sh`): from the flags rustc is given, not from a
//! variable someone could leave set. A change of flags rebuilds everything, this script
//! included.

fn main() {
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    if flags
        .split('\x1f')
        .any(|f| f.starts_with("-Cprofile-use") || f.starts_with("profile-use"))
    {
        println!("cargo::rustc-env=TAILGATE_PROFILE_GUIDED=1");
    }
    println!("cargo::rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
    // The commit built, so that a benchmark report says which code it measured: from git
    // where the source is a checkout, `unknown commit` elsewhere (a source archive).
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown commit".to_owned());
    println!("cargo::rustc-env=TAILGATE_COMMIT={commit}");
    // A new commit or checkout moves HEAD's log; the build script runs again then.
    if let Some(git) = std::process::Command::new("git")
        .args(["rev-parse", "--absolute-git-dir"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
    {
        let git = git.trim();
        println!("cargo::rerun-if-changed={git}/HEAD");
        println!("cargo::rerun-if-changed={git}/logs/HEAD");
    }
}

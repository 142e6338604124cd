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
    // where the source is this workspace's own checkout (not a repository it was unpacked
    // into), `unknown commit` elsewhere (a source archive). Uncommitted edits are not
    // shown.
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let ours = git(&["rev-parse", "--show-toplevel"])
        .is_some_and(|top| std::fs::canonicalize(&top).ok() == std::fs::canonicalize(&root).ok());
    let commit = ours
        .then(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .flatten()
        .filter(|s| s.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown commit".to_owned());
    println!("cargo::rustc-env=TAILGATE_COMMIT={commit}");
    // Runs again when HEAD moves: its file (a checkout), its log and its branch's ref (a
    // commit), the packed refs. Only files that exist: cargo reruns a script for a missing
    // one.
    if ours {
        let mut watch = Vec::new();
        for path in ["HEAD", "logs/HEAD", "packed-refs"] {
            watch.extend(git(&["rev-parse", "--git-path", path]));
        }
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.extend(git(&["rev-parse", "--git-path", &branch]));
        }
        for path in watch {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
            if path.exists() {
                println!("cargo::rerun-if-changed={}", path.display());
            }
        }
    }
}

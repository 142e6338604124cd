//! Tells `tailgate --version` whether this build was compiled with a profile
//! (`-Cprofile-use`, `scripts/pgo.sh`): from the flags rustc is given, not from a variable
//! someone could leave set. A change of flags rebuilds everything, this script included.

fn main() {
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    if flags
        .split('\x1f')
        .any(|f| f.starts_with("-Cprofile-use") || f.starts_with("profile-use"))
    {
        println!("cargo::rustc-env=TAILGATE_PROFILE_GUIDED=1");
    }
    println!("cargo::rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
}

//! The runtime each of the gateway's own threads runs (workers, admin, scrapes, DNS, demo).

/// A current-thread runtime with I/O and timers for the calling thread. `None` when the OS
/// refuses one (out of file descriptors or memory): logged as an error naming the thread's
/// `job` and, in `without`, what goes missing because of it.
pub(crate) fn for_thread(job: &str, without: &str) -> Option<tokio::runtime::Runtime> {
    match build() {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!(error = %e, "cannot build the {job} runtime{without}");
            None
        }
    }
}

/// A current-thread runtime with I/O and timers, built on the calling thread to be run on
/// another. The gateway builds its workers' and its admin plane's this way before anything
/// listens: a runtime needs file descriptors, and once connections come they may take them
/// all (a runtime built later, on its own thread, could fail, and its thread with it).
pub(crate) fn build() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

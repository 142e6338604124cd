//! The runtime each of the gateway's own threads runs (workers, admin, scrapes, DNS, demo).

/// A current-thread runtime with I/O and timers for the calling thread. `None` when the OS
/// refuses one (out of file descriptors or memory): logged as an error naming the thread's
/// `job` and, in `without`, what goes missing because of it.
pub(crate) fn for_thread(job: &str, without: &str) -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!(error = %e, "cannot build the {job} runtime{without}");
            None
        }
    }
}

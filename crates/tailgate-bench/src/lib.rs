//! tailgate's load generator (`tailgate bench run`), its fast upstream
//! (`tailgate bench upstream`) and the reproducible benchmark scenarios
//! (`tailgate bench scenario`, `tailgate bench report`), and the training workload of the
//! profile-guided release build (`tailgate bench train`).
//!
//! Layout: [`load`] sends requests and records into [`stats`]; [`output`] prints tables, JSON
//! and SVG; [`upstream`] is the fixed-answer server; [`scenario`] starts the processes under
//! test and compares them side by side; [`train`] runs a gateway under the traffic a
//! profile-guided build is optimized for; [`cli`] parses `tailgate bench ...`.
pub mod cli;
pub mod load;
pub mod output;
pub mod pin;
pub mod scenario;
pub mod stats;
pub mod train;
pub mod upstream;

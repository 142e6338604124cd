//! tailgate's load generator and benchmark scenarios.
pub mod cli;

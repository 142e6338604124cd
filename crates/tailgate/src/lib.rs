//! tailgate: a multi-tenant API gateway built for the tail.
//!
//! The modules follow a request: [`listener`] accepts, [`server`] speaks HTTP/1.1 and
//! HTTP/2 to the client, [`pipeline`] routes and forwards, [`upstream`] holds the pools,
//! [`observe`] records each exchange and [`admin`] serves metrics and health from its own
//! thread. [`config`] reads the TOML file, [`gateway`] runs it.

pub mod admin;
pub mod cli;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod listener;
pub mod logging;
pub mod observe;
pub(crate) mod pace;
pub mod pipeline;
pub mod runtime;
pub mod server;
pub mod upstream;

pub use config::Config;
pub use gateway::Gateway;

//! How results leave the generator: a human table, JSON, SVG charts.
pub mod json;
pub mod svg;
pub mod text;

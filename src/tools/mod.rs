//! Offline tools over an engine or a model's files, run by a subcommand and done: no part of the
//! runtime (the engine runs sequences; these measure or prepare).
//!
//! Contract: each tool drives an `Engine` only through its public API (`Session::score`, the
//! engine's facts) or works on a model's files; results depend only on their inputs (fixed-order
//! sums, the logits' bits whatever the threads, cache or backend). `perplexity` (`score --text`),
//! `compare` (`score --compare`: KL, top-1 agreement against a base), `pack_trunk`
//! (`pack-trunk`: the coded trunk's files and the timing of its products).

pub mod compare;
pub mod pack_trunk;
pub mod perplexity;

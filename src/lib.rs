//! deltafin: runs Kimi K3 exactly on one machine by streaming its routed experts from SSDs.
//! Module map (see docs/architecture.md): `engine` (Engine and Session, what every front end
//! drives; its request scheduler `engine::scheduler`), `forward` (one forward over the rows of one
//! or several sessions, and its MoE expert schedule), `k3` (the model's math), `backend` (the
//! operations the forward pass calls; `backend::cpu` the CPU kernels), `model` (config, checkpoint,
//! roster, tokenizer, chat template, synth), `store` (where experts are read: every expert source),
//! `draft` (drafters for speculative decoding, width policy, cost model; the engine verifies), `hub`
//! (Hugging Face-compatible downloads and stream installs), `bench` (measurements, one JSON record
//! each), `tools` (offline tools: perplexity, distribution comparison, trunk packing), `demo` (the
//! built-in demo model the binary carries), `api` (the OpenAI protocol's requests and answers),
//! `service` (the generation service every front end shares), `serve` (the HTTP server), `cli`
//! (subcommands).

// No function over 120 lines (clippy.toml's `too-many-lines-threshold`): a long one is split at
// its phases.
#![warn(clippy::too_many_lines)]

pub mod api;
pub mod backend;
pub mod bench;
pub mod cli;
pub mod constrain;
pub mod demo;
pub mod draft;
pub mod engine;
pub mod forward;
pub mod hub;
pub mod k3;
pub mod memory;
pub mod model;
pub mod sample;

pub mod serve;
pub mod service;
pub mod setting;
pub mod stats;
pub mod store;
pub mod tools;
pub mod util;

/// The CPU kernels (also reachable as `backend::cpu`).
pub use backend::cpu;

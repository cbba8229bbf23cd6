//! The generation service every front end shares — `run --chat`'s answers, `deltafin chat`,
//! `batch` and the HTTP server: a request (`crate::api::GenRequest`) in, its answer's text and
//! counters (`crate::api::Output`) out, over one engine.
//!
//! Contract: [`generator::Generator`] runs requests one at a time — prompts encoded and checked
//! before they run ([`encoder`]), enforced output on the sampler ([`constrained`]), the text cut
//! into channels, stop strings and tool calls as tokens come ([`answer`]), kept sessions resumed
//! and the memo asked first, sessions spilled to a state directory ([`state_dir`]), a shared prompt
//! prefix prefilled once ([`prefix`]) — or as lanes of the engine's running batch ([`parallel`]),
//! with the same answers either way. [`batch`] is `deltafin batch`'s records and lane host,
//! [`chat`] a terminal conversation. Nothing here speaks HTTP or parses a command line; the model
//! is reached only through `Engine` / `Session`.

pub mod answer;
pub mod batch;
pub mod chat;
pub mod constrained;
pub mod encoder;
pub mod generator;
pub mod parallel;
pub mod prefix;
pub mod state_dir;

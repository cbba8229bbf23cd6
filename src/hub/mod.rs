//! Hugging Face-compatible hub: the client (`client`), resumable verified downloads (`download`),
//! Hugging Face's own cache (`hfcache`), the local layout of a stream install (`layout`) and the
//! expert source that streams routed experts on demand (`stream`). `deltafin setup` drives them;
//! the engine opens a stream install through [`stream::StreamSource`]. See docs/setup.md.

pub mod against;
pub mod client;
pub mod download;
pub mod hfcache;
pub mod layout;
pub mod net;
pub mod stream;

pub use client::{Hub, HubError, HubOptions, RepoFile, RepoInfo};

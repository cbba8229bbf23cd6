//! Hugging Face-compatible hub: the client (`client`), resumable verified downloads (`download`),
//! Hugging Face's own cache (`hfcache`), the local layout of a stream install (`layout`) and its
//! records and origin (`stream`: where the expert source of a stream install,
//! `store::stream::StreamSource`, streams routed experts from on demand). `deltafin setup` drives
//! them; the engine opens a stream install's source through [`stream::source`]. See docs/setup.md.

pub mod against;
pub mod client;
pub mod download;
pub mod hfcache;
pub mod layout;
pub mod net;
pub mod stream;

pub use client::{Hub, HubError, HubOptions, RepoFile, RepoInfo};

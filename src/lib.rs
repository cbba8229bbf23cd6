//! deltafin: runs Kimi K3 exactly on one machine by streaming its routed experts from SSDs.
//! Module map (see DESIGN.md): `model` (config, checkpoint, roster), `k3` (forward pass),
//! `cpu` (kernels), `store` (expert sources), `cli` (subcommands).

pub mod cli;
pub mod cpu;
pub mod k3;
pub mod memory;
pub mod model;
pub mod stats;
pub mod store;
pub mod util;

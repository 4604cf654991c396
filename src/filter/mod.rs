//! The filter's request and root logic over a small `Host` trait, with no proxy-wasm import:
//! it builds and is unit-tested natively (`testing::FakeHost`), and `wasm` binds it to
//! proxy-wasm. `http` is one stream, `root` the configuration and the poller tick, `vm` what
//! one VM keeps between requests, `stats` the Envoy stats, `memory` the VMs' memory gauges, `peering` whom `peers` asks, `usage` reads response
//! usage, `opening` finds a Responses stream's first token, `bare` the yardstick of overhead runs.

pub mod bare;
pub mod host;
pub mod http;
pub mod memory;
mod opening;
mod peering;
pub mod root;
pub mod stats;
pub mod usage;
pub mod vm;

#[cfg(test)]
pub mod testing;
#[cfg(test)]
mod tests;

pub use bare::BareFilter;
pub use host::{Host, HostError, Level, MetricKind, VmMemory};
pub use http::{Action, HttpFilter};
pub use root::Root;

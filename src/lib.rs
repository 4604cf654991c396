//! tokenaware: routes LLM inference requests to the endpoint whose KV cache holds their
//! prefix, until that endpoint is saturated. The core (parsing, hashing, index, ledger,
//! policies, config, metrics text) is plain Rust with no proxy-wasm import; `filter` is the
//! host-independent request logic over a small `Host` trait, and `wasm` (wasm32 only) binds
//! it to proxy-wasm.
#![forbid(unsafe_code)]

pub mod config;
pub mod endpoints;
pub mod estimator;
pub mod filter;
pub mod index;
pub mod ledger;
pub mod peers;
pub mod policy;
pub mod prefix;
pub mod prometheus;
pub mod request;
pub mod router;
pub mod shared_prefixes;
pub mod store;
// The proxy-wasm binding; never in test binaries (their runner has no proxy-wasm host).
#[cfg(all(target_arch = "wasm32", not(test)))]
mod wasm;

/// Crate version and git hash, logged at VM start.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "+", env!("TOKENAWARE_GIT_HASH"));

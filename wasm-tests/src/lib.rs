//! Test support for tokenaware: a simulated vLLM fleet ([`fleet`]), an Envoy harness
//! ([`envoy`]), the load generator ([`loadgen`]), benchmark plots ([`plot`]), the OCI image
//! writer ([`oci`]), free loopback ports ([`ports`]), the paired added-latency
//! measurement ([`paired`]) and learned rates watched during a run ([`ratewatch`]).
//!
//! Typical end-to-end test:
//!
//! ```no_run
//! use wasm_tests::{envoy::{Envoy, GatewayConfig}, fleet::{Fleet, FleetConfig, Timing}};
//! let timing = Timing { time_factor: 0.01, ..Default::default() };
//! let fleet = Fleet::start_on_free_ports(FleetConfig { endpoints: 3, timing, ..Default::default() })?;
//! let gw = GatewayConfig::new(fleet.endpoints()).with_wasm("target/wasm32-wasip1/release/tokenaware.wasm", "{}");
//! let envoy = Envoy::start(gw)?;           // waits for admin /ready, killed on drop
//! let url = envoy.url("/v1/completions");  // http://127.0.0.1:LISTEN/v1/completions
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod envoy;
pub mod fleet;
pub mod host;
pub mod instant;
pub mod loadgen;
pub mod oci;
pub mod paired;
pub mod plot;
pub mod ports;
pub mod ratewatch;
pub mod replicas;

//! The host calls the filter makes, and nothing more: request/response headers and body,
//! shared data (through `SharedStore`), metrics, time, logging, local replies and outbound
//! HTTP calls. `wasm::host` implements it over proxy-wasm; `testing::FakeHost` in memory.
//! Errors are one small `Copy` enum, so a host status never turns into a panic here.

use crate::store::{SharedStore, StoreError};

/// A host call failed. Mirrors the proxy-wasm statuses the filter can meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostError {
    NotFound,
    /// Wrong phase (e.g. request headers after they were forwarded) or a bad argument.
    BadArgument,
    CasMismatch,
    ParseFailure,
    SerializationFailure,
    Empty,
    Internal,
}

impl HostError {
    pub const fn as_str(self) -> &'static str {
        match self {
            HostError::NotFound => "not_found",
            HostError::BadArgument => "bad_argument",
            HostError::CasMismatch => "cas_mismatch",
            HostError::ParseFailure => "parse_failure",
            HostError::SerializationFailure => "serialization_failure",
            HostError::Empty => "empty",
            HostError::Internal => "internal",
        }
    }
}

impl From<HostError> for StoreError {
    fn from(e: HostError) -> Self {
        match e {
            HostError::CasMismatch => StoreError::CasMismatch,
            _ => StoreError::Host,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One VM's linear memory, as the VM itself reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmMemory {
    /// Differs between VM instances and is the same for every root context in one instance
    /// (a reconfiguration can start a second root in a VM that already has one).
    pub instance: u64,
    /// Pages × 64 KiB. Linear memory never shrinks, so this is the VM's high-water mark.
    pub bytes: u64,
}

/// What the filter needs from its host. Header names are lowercase.
pub trait Host: SharedStore {
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError>;
    /// Removes every value of the header.
    fn remove_request_header(&self, name: &str) -> Result<(), HostError>;
    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostError>;
    /// The `ip:port` of the upstream host that answered (Envoy's `upstream.address`).
    fn upstream_address(&self) -> Result<Option<Vec<u8>>, HostError>;
    /// Bytes `start..start + len` of the request body the host holds (buffered so far).
    fn request_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError>;
    /// Bytes of the current response body chunk.
    fn response_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError>;
    /// Answers the request locally (the upstream is never contacted).
    fn send_response(
        &self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError>;
    /// Wall-clock time, ms since the Unix epoch.
    fn now_ms(&self) -> Result<u64, HostError>;
    fn log(&self, level: Level, msg: &str);
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError>;
    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostError>;
    /// Sets a gauge, records a histogram sample.
    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError>;
    /// Starts an HTTP call to an Envoy cluster; the answer comes to the root context under
    /// the returned token.
    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, HostError>;
    /// Inside the call-response callback: a header of the answer.
    fn call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// Inside the call-response callback: the first `len` bytes of the answer's body.
    fn call_response_body(&self, len: usize) -> Result<Vec<u8>, HostError>;
    /// This VM's linear memory; `None` where there is none to read (native tests).
    fn vm_memory(&self) -> Option<VmMemory>;
}

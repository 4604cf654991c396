//! `Host` over `proxy_wasm::hostcalls`. Each call returns the host's status as a
//! `HostError`. Note: `hostcalls` itself still panics on statuses the ABI does not document
//! for a call (e.g. `BadArgument` from a header write outside its phase); the filter only
//! touches headers and bodies in the phases that own them.

use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};

use crate::filter::{Host, HostError, Level, MetricKind, VmMemory};
use crate::store::{Bytes, Cas, SharedStore, StoreError};

pub struct WasmHost;

/// Bytes per wasm page.
const PAGE: u64 = 65_536;

/// A random id for this VM instance, drawn once: statics are per instance, so every root
/// context in the instance reads the same id.
fn instance_id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let nanos = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), nanos)
            .max(1)
    })
}

fn err(s: Status) -> HostError {
    match s {
        Status::NotFound => HostError::NotFound,
        Status::BadArgument => HostError::BadArgument,
        Status::SerializationFailure => HostError::SerializationFailure,
        Status::ParseFailure => HostError::ParseFailure,
        Status::Empty => HostError::Empty,
        Status::CasMismatch => HostError::CasMismatch,
        _ => HostError::Internal,
    }
}

impl SharedStore for WasmHost {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        let (value, cas) = hostcalls::get_shared_data(key).map_err(|s| StoreError::from(err(s)))?;
        Ok((value.map(Bytes::from), cas))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|s| err(s).into())
    }
}

impl Host for WasmHost {
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).map_err(err)
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).map_err(err)
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        hostcalls::remove_map_value(MapType::HttpRequestHeaders, name).map_err(err)
    }

    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name).map_err(err)
    }

    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)).map_err(err)
    }

    fn upstream_address(&self) -> Result<Option<Vec<u8>>, HostError> {
        hostcalls::get_property(vec!["upstream", "address"]).map_err(err)
    }

    fn request_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, start, len)
            .map(Option::unwrap_or_default)
            .map_err(err)
    }

    fn response_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, start, len)
            .map(Option::unwrap_or_default)
            .map_err(err)
    }

    fn send_response(
        &self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError> {
        hostcalls::send_http_response(status, headers.to_vec(), Some(body)).map_err(err)
    }

    fn now_ms(&self) -> Result<u64, HostError> {
        let t = hostcalls::get_current_time().map_err(err)?;
        let d = t
            .duration_since(UNIX_EPOCH)
            .map_err(|_| HostError::Internal)?;
        Ok(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    fn log(&self, level: Level, msg: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
            Level::Critical => LogLevel::Critical,
        };
        let _ = hostcalls::log(level, msg);
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).map_err(err)
    }

    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostError> {
        hostcalls::increment_metric(id, delta).map_err(err)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError> {
        hostcalls::record_metric(id, value).map_err(err)
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, HostError> {
        hostcalls::dispatch_http_call(
            cluster,
            headers.to_vec(),
            None,
            Vec::new(),
            Duration::from_millis(timeout_ms),
        )
        .map_err(err)
    }

    fn call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name).map_err(err)
    }

    fn call_response_body(&self, len: usize) -> Result<Vec<u8>, HostError> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, len)
            .map(Option::unwrap_or_default)
            .map_err(err)
    }

    fn vm_memory(&self) -> Option<VmMemory> {
        let pages = core::arch::wasm32::memory_size::<0>() as u64;
        Some(VmMemory {
            instance: instance_id(),
            bytes: pages.saturating_mul(PAGE),
        })
    }
}

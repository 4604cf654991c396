//! An in-memory `Host` for unit tests: header maps, bodies, a clock, metrics by name, logs,
//! local replies and outbound calls, over a `MemStore`. Several filters (several "VMs") can
//! share one `FakeHost`, as Envoy's workers share shared data.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use super::host::{Host, HostError, Level, MetricKind, VmMemory};
use crate::store::{Bytes, Cas, MemStore, SharedStore, StoreError};

#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub timeout_ms: u64,
}

/// (kind, name, counter/gauge value, histogram samples)
type Metric = (MetricKind, String, i64, Vec<u64>);

#[derive(Default)]
pub struct FakeHost {
    pub store: MemStore,
    pub request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub request_body: RefCell<Vec<u8>>,
    pub response_body: RefCell<Vec<u8>>,
    pub now: Cell<u64>,
    /// `upstream.address` of the answer, when set.
    pub upstream: RefCell<Option<String>>,
    pub logs: RefCell<Vec<(Level, String)>>,
    metrics: RefCell<Vec<Metric>>,
    pub sent: RefCell<Vec<(u32, Vec<u8>)>>,
    pub dispatched: RefCell<Vec<Dispatched>>,
    next_token: Cell<u32>,
    /// Answer of the call being delivered: headers and body.
    pub call_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub call_body: RefCell<Vec<u8>>,
    /// Make header mutations fail as in the wrong phase.
    pub headers_locked: Cell<bool>,
    /// Make every shared-data access fail.
    pub store_down: Cell<bool>,
    /// Clusters this "Envoy" does not have: calls to them fail at once, as Envoy's do.
    pub unknown_clusters: RefCell<Vec<String>>,
    /// What `vm_memory` answers (set it before each "VM"'s tick).
    pub vm_memory: Cell<Option<VmMemory>>,
    /// Every hostcall made, by name (shared-data reads and writes as `get` and `set`).
    pub calls: RefCell<BTreeMap<&'static str, u64>>,
}

impl FakeHost {
    pub fn new() -> FakeHost {
        let h = FakeHost::default();
        h.now.set(1_000_000);
        h
    }

    pub fn with_request_header(self, name: &str, value: &str) -> Self {
        self.request_headers
            .borrow_mut()
            .push((name.to_string(), value.as_bytes().to_vec()));
        self
    }

    /// A POST to `path` (resets the request headers).
    pub fn with_path(self, path: &str) -> Self {
        self.request_headers.borrow_mut().clear();
        self.with_request_header(":method", "POST")
            .with_request_header(":path", path)
    }

    pub fn with_request_body(self, body: &[u8]) -> Self {
        *self.request_body.borrow_mut() = body.to_vec();
        self
    }

    pub fn with_time(self, ms: u64) -> Self {
        self.now.set(ms);
        self
    }

    /// Starts a new request on the same host (shared data, metrics kept).
    pub fn new_request(&self, path: &str, body: &[u8]) {
        let mut h = self.request_headers.borrow_mut();
        h.clear();
        h.push((":method".into(), b"POST".to_vec()));
        h.push((":path".into(), path.as_bytes().to_vec()));
        *self.request_body.borrow_mut() = body.to_vec();
        self.response_headers.borrow_mut().clear();
        self.response_body.borrow_mut().clear();
    }

    pub fn set_response_status(&self, status: u32) {
        let mut h = self.response_headers.borrow_mut();
        h.retain(|(k, _)| k != ":status");
        h.push((":status".into(), status.to_string().into_bytes()));
    }

    pub fn header_values(&self, name: &str) -> Vec<String> {
        self.request_headers
            .borrow()
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    }

    pub fn response_header_value(&self, name: &str) -> Option<String> {
        self.response_headers
            .borrow()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// A counter's or gauge's value, by name (0 when never defined).
    pub fn metric(&self, name: &str) -> i64 {
        self.metrics
            .borrow()
            .iter()
            .find(|(_, n, _, _)| n == name)
            .map_or(0, |m| m.2)
    }

    pub fn histogram(&self, name: &str) -> Vec<u64> {
        self.metrics
            .borrow()
            .iter()
            .find(|(_, n, _, _)| n == name)
            .map_or_else(Vec::new, |m| m.3.clone())
    }

    pub fn set_call_answer(&self, status: Option<u32>, body: &[u8]) {
        let mut h = self.call_headers.borrow_mut();
        h.clear();
        if let Some(s) = status {
            h.push((":status".into(), s.to_string().into_bytes()));
        }
        *self.call_body.borrow_mut() = body.to_vec();
    }

    pub fn take_dispatched(&self) -> Vec<Dispatched> {
        std::mem::take(&mut *self.dispatched.borrow_mut())
    }

    fn count(&self, call: &'static str) {
        *self.calls.borrow_mut().entry(call).or_default() += 1;
    }

    /// Hostcalls made since `before` (a copy of `calls`), by name.
    pub fn calls_since(&self, before: &BTreeMap<&'static str, u64>) -> BTreeMap<&'static str, u64> {
        self.calls
            .borrow()
            .iter()
            .map(|(k, v)| (*k, v - before.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect()
    }

    fn find(map: &RefCell<Vec<(String, Vec<u8>)>>, name: &str) -> Option<Vec<u8>> {
        map.borrow()
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    fn put(&self, map: &RefCell<Vec<(String, Vec<u8>)>>, name: &str, value: &str) {
        let mut m = map.borrow_mut();
        m.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        m.push((name.to_string(), value.as_bytes().to_vec()));
    }
}

impl SharedStore for FakeHost {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        self.count("get");
        if self.store_down.get() {
            return Err(StoreError::Host);
        }
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        self.count("set");
        if self.store_down.get() {
            return Err(StoreError::Host);
        }
        self.store.set(key, value, cas)
    }
}

impl Host for FakeHost {
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.count("request_header");
        Ok(Self::find(&self.request_headers, name))
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        self.count("set_request_header");
        if self.headers_locked.get() {
            return Err(HostError::BadArgument);
        }
        self.put(&self.request_headers, name, value);
        Ok(())
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        self.count("remove_request_header");
        if self.headers_locked.get() {
            return Err(HostError::BadArgument);
        }
        self.request_headers
            .borrow_mut()
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        Ok(())
    }

    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.count("response_header");
        Ok(Self::find(&self.response_headers, name))
    }

    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        self.count("set_response_header");
        self.put(&self.response_headers, name, value);
        Ok(())
    }

    fn upstream_address(&self) -> Result<Option<Vec<u8>>, HostError> {
        self.count("upstream_address");
        Ok(self
            .upstream
            .borrow()
            .as_ref()
            .map(|u| u.as_bytes().to_vec()))
    }

    fn request_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError> {
        self.count("request_body");
        let b = self.request_body.borrow();
        let end = start.saturating_add(len).min(b.len());
        Ok(b.get(start..end).unwrap_or_default().to_vec())
    }

    fn response_body(&self, start: usize, len: usize) -> Result<Vec<u8>, HostError> {
        self.count("response_body");
        let b = self.response_body.borrow();
        let end = start.saturating_add(len).min(b.len());
        Ok(b.get(start..end).unwrap_or_default().to_vec())
    }

    fn send_response(
        &self,
        status: u32,
        _headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError> {
        self.count("send_response");
        self.sent.borrow_mut().push((status, body.to_vec()));
        Ok(())
    }

    fn now_ms(&self) -> Result<u64, HostError> {
        self.count("now_ms");
        Ok(self.now.get())
    }

    fn log(&self, level: Level, msg: &str) {
        self.count("log");
        self.logs.borrow_mut().push((level, msg.to_string()));
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError> {
        self.count("define_metric");
        let mut m = self.metrics.borrow_mut();
        if let Some(i) = m.iter().position(|(_, n, _, _)| n == name) {
            return Ok(i as u32);
        }
        m.push((kind, name.to_string(), 0, Vec::new()));
        Ok(m.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostError> {
        self.count("increment_metric");
        let mut m = self.metrics.borrow_mut();
        let e = m.get_mut(id as usize).ok_or(HostError::NotFound)?;
        if e.0 == MetricKind::Counter && delta <= 0 {
            return Err(HostError::BadArgument);
        }
        e.2 += delta;
        Ok(())
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError> {
        self.count("record_metric");
        let mut m = self.metrics.borrow_mut();
        let e = m.get_mut(id as usize).ok_or(HostError::NotFound)?;
        match e.0 {
            MetricKind::Counter => e.2 += value as i64,
            MetricKind::Gauge => e.2 = value as i64,
            MetricKind::Histogram => e.3.push(value),
        }
        Ok(())
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, HostError> {
        self.count("dispatch");
        if self.unknown_clusters.borrow().iter().any(|c| c == cluster) {
            return Err(HostError::BadArgument);
        }
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        self.dispatched.borrow_mut().push(Dispatched {
            token,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            timeout_ms,
        });
        Ok(token)
    }

    fn call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.count("call_response_header");
        Ok(Self::find(&self.call_headers, name))
    }

    fn call_response_body(&self, len: usize) -> Result<Vec<u8>, HostError> {
        self.count("call_response_body");
        let b = self.call_body.borrow();
        Ok(b.get(..len.min(b.len())).unwrap_or_default().to_vec())
    }

    fn vm_memory(&self) -> Option<VmMemory> {
        self.count("vm_memory");
        self.vm_memory.get()
    }
}

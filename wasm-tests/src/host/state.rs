//! Per-VM state kept in the wasmtime `Store`: contexts, per-stream header maps and body
//! buffers, pending HTTP calls, logs and recorded no-op hostcalls. The hostcalls in
//! [`imports`](super::imports) read and write it; the [`Vm`](super::Vm) API inspects it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::abi::{LogLevel, MapType, Pairs, Status, StreamType};
use super::shared::SharedState;

/// One `proxy_log` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub level: LogLevel,
    /// The effective context when the module logged.
    pub context_id: u32,
    pub message: String,
}

/// A `proxy_http_call` the module dispatched and the test has not completed yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpCall {
    pub token: u32,
    /// The context that dispatched it; the response is delivered there.
    pub context_id: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, String)>,
    pub timeout_ms: u32,
}

impl HttpCall {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A `proxy_send_local_response`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub grpc_status: i32,
}

/// Hostcalls the host only records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    ContinueStream {
        context_id: u32,
        stream: StreamType,
    },
    CloseStream {
        context_id: u32,
        stream: StreamType,
    },
    Done {
        context_id: u32,
    },
    ForeignFunction {
        context_id: u32,
        name: String,
    },
    SetProperty {
        path: Vec<String>,
        value: Vec<u8>,
    },
    /// An import the host does not implement was called (module, name).
    Unimplemented {
        module: String,
        name: String,
    },
}

/// Which HTTP callback an [`Action`](super::abi::Action) came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    RequestHeaders,
    RequestBody,
    RequestTrailers,
    ResponseHeaders,
    ResponseBody,
    ResponseTrailers,
}

/// One direction (request or response) of an HTTP stream.
#[derive(Debug, Default)]
pub(crate) struct Direction {
    pub headers: Pairs,
    /// Envoy keeps its header-map pointer only while the headers callback has not
    /// returned Continue (`if (result == Continue) request_headers_ = nullptr`).
    pub headers_live: bool,
    pub trailers: Pairs,
    pub trailers_live: bool,
    /// Body the filter can see: the buffered chunks plus the current one.
    pub body: Vec<u8>,
    /// Set while the filter returned Pause from the body callback (StopIterationAndBuffer).
    pub buffering: bool,
    /// What went past the filter (to the upstream or the client).
    pub forwarded: Vec<u8>,
}

impl Direction {
    pub fn flush(&mut self) {
        let body = std::mem::take(&mut self.body);
        self.forwarded.extend_from_slice(&body);
        self.buffering = false;
    }
}

#[derive(Debug, Default)]
pub(crate) struct StreamState {
    pub root_id: u32,
    pub created: bool,
    pub request: Direction,
    pub response: Direction,
    /// During `proxy_on_log` every map is readable and none writable (Envoy's access-log phase).
    pub in_log: bool,
    pub actions: Vec<(Phase, super::abi::Action)>,
    pub local_response: Option<LocalResponse>,
    pub properties: HashMap<Vec<String>, Vec<u8>>,
}

#[derive(Debug, Default)]
pub(crate) struct CallResponse {
    pub headers: Pairs,
    pub body: Vec<u8>,
    pub trailers: Pairs,
}

/// Everything a module instance can reach through its imports.
pub(crate) struct VmState {
    pub shared: Arc<Mutex<SharedState>>,
    /// Context whose callback is running; `proxy_set_effective_context` changes `effective`.
    pub active: u32,
    pub effective: u32,
    /// Root context id -> tick period in milliseconds (0 = off).
    pub roots: BTreeMap<u32, u32>,
    pub streams: HashMap<u32, StreamState>,
    /// Streams after `proxy_on_delete`, kept for inspection; invisible to the module.
    pub finished: HashMap<u32, StreamState>,
    pub next_context_id: u32,
    pub plugin_config: Option<Vec<u8>>,
    pub vm_config: Vec<u8>,
    pub in_vm_start: bool,
    pub call_response: Option<CallResponse>,
    pub pending_calls: Vec<HttpCall>,
    pub next_token: u32,
    pub http_call_status: Option<Status>,
    pub clusters: Option<Vec<String>>,
    /// Metric id (per VM) -> name (shared by the host).
    pub metric_names: Vec<String>,
    pub logs: Vec<LogEntry>,
    pub log_level: LogLevel,
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    pub events: Vec<Event>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub env: Vec<(String, String)>,
    pub rng: u64,
}

impl VmState {
    pub fn new(shared: Arc<Mutex<SharedState>>, seed: u64) -> Self {
        let mut properties = HashMap::new();
        for (k, v) in [
            ("plugin_name", "wasm-tests"),
            ("plugin_root_id", ""),
            ("plugin_vm_id", "wasm-tests"),
        ] {
            properties.insert(vec![k.to_string()], v.as_bytes().to_vec());
        }
        VmState {
            shared,
            active: 0,
            effective: 0,
            roots: BTreeMap::new(),
            streams: HashMap::new(),
            finished: HashMap::new(),
            next_context_id: 1,
            plugin_config: None,
            vm_config: Vec::new(),
            in_vm_start: false,
            call_response: None,
            pending_calls: Vec::new(),
            next_token: 1,
            http_call_status: None,
            clusters: None,
            metric_names: Vec::new(),
            logs: Vec::new(),
            log_level: LogLevel::Trace,
            properties,
            events: Vec::new(),
            stdout: Vec::new(),
            stderr: Vec::new(),
            env: Vec::new(),
            rng: seed | 1,
        }
    }

    /// The shared state; a poisoned lock (a test thread panicked) is still usable.
    pub fn shared(&self) -> MutexGuard<'_, SharedState> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn alloc_context_id(&mut self) -> u32 {
        while self.roots.contains_key(&self.next_context_id)
            || self.streams.contains_key(&self.next_context_id)
        {
            self.next_context_id += 1;
        }
        let id = self.next_context_id;
        self.next_context_id += 1;
        id
    }

    /// xorshift64*: deterministic `random_get`.
    pub fn next_random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The map a hostcall addresses, for reading. Envoy returns BadArgument for a map
    /// that does not exist in the current phase.
    pub fn map(&self, map: MapType) -> Result<&Pairs, Status> {
        if let Some(resp) = &self.call_response {
            match map {
                MapType::HttpCallResponseHeaders => return Ok(&resp.headers),
                MapType::HttpCallResponseTrailers => return Ok(&resp.trailers),
                _ => {}
            }
        }
        let stream = self
            .streams
            .get(&self.effective)
            .ok_or(Status::BadArgument)?;
        let (dir, trailers) = match map {
            MapType::HttpRequestHeaders => (&stream.request, false),
            MapType::HttpRequestTrailers => (&stream.request, true),
            MapType::HttpResponseHeaders => (&stream.response, false),
            MapType::HttpResponseTrailers => (&stream.response, true),
            _ => return Err(Status::BadArgument),
        };
        let live = if trailers {
            dir.trailers_live
        } else {
            dir.headers_live
        };
        match (live || stream.in_log, trailers) {
            (true, false) => Ok(&dir.headers),
            (true, true) => Ok(&dir.trailers),
            (false, _) => Err(Status::BadArgument),
        }
    }

    /// The map a hostcall addresses, for writing (never during `proxy_on_log`).
    pub fn map_mut(&mut self, map: MapType) -> Result<&mut Pairs, Status> {
        let stream = self
            .streams
            .get_mut(&self.effective)
            .ok_or(Status::BadArgument)?;
        if stream.in_log {
            return Err(Status::BadArgument);
        }
        let (dir, trailers) = match map {
            MapType::HttpRequestHeaders => (&mut stream.request, false),
            MapType::HttpRequestTrailers => (&mut stream.request, true),
            MapType::HttpResponseHeaders => (&mut stream.response, false),
            MapType::HttpResponseTrailers => (&mut stream.response, true),
            _ => return Err(Status::BadArgument),
        };
        match (trailers, dir.headers_live, dir.trailers_live) {
            (false, true, _) => Ok(&mut dir.headers),
            (true, _, true) => Ok(&mut dir.trailers),
            _ => Err(Status::BadArgument),
        }
    }

    pub fn property(&self, path: &[String]) -> Option<&Vec<u8>> {
        self.streams
            .get(&self.effective)
            .and_then(|s| s.properties.get(path))
            .or_else(|| self.properties.get(path))
    }
}

/// Header lookup as Envoy does it: keys are compared lower-cased.
pub(crate) fn find<'a>(pairs: &'a Pairs, key: &str) -> Option<&'a [u8]> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| v.as_slice())
}

pub(crate) fn to_pairs(headers: &[(&str, &str)]) -> Pairs {
    headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect()
}

pub(crate) fn to_strings(pairs: &Pairs) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
        .collect()
}

//! proxy-wasm ABI 0.2.1 constants and the pairs encoding, checked against the Rust SDK
//! 0.2.5 (`src/types.rs`, `src/hostcalls.rs`). Only what the host needs; no behaviour.

/// Return status of every `proxy_*` hostcall.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    BadExpression = 5,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    ResultMismatch = 9,
    InternalFailure = 10,
    BrokenConnection = 11,
    Unimplemented = 12,
}

impl Status {
    pub(crate) fn code(self) -> i32 {
        self as i32
    }
}

/// What an HTTP callback returned. The SDK only returns 0 or 1; anything else is kept raw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Continue,
    Pause,
    Other(u32),
}

impl Action {
    pub(crate) fn from_code(code: u64) -> Self {
        match code {
            0 => Action::Continue,
            1 => Action::Pause,
            // Truncation is fine: the ABI return type is a 32-bit integer.
            n => Action::Other(n as u32),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub(crate) fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapType {
    HttpRequestHeaders = 0,
    HttpRequestTrailers = 1,
    HttpResponseHeaders = 2,
    HttpResponseTrailers = 3,
    GrpcReceiveInitialMetadata = 4,
    GrpcReceiveTrailingMetadata = 5,
    HttpCallResponseHeaders = 6,
    HttpCallResponseTrailers = 7,
}

impl MapType {
    pub(crate) fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => MapType::HttpRequestHeaders,
            1 => MapType::HttpRequestTrailers,
            2 => MapType::HttpResponseHeaders,
            3 => MapType::HttpResponseTrailers,
            4 => MapType::GrpcReceiveInitialMetadata,
            5 => MapType::GrpcReceiveTrailingMetadata,
            6 => MapType::HttpCallResponseHeaders,
            7 => MapType::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferType {
    HttpRequestBody = 0,
    HttpResponseBody = 1,
    DownstreamData = 2,
    UpstreamData = 3,
    HttpCallResponseBody = 4,
    GrpcReceiveBuffer = 5,
    VmConfiguration = 6,
    PluginConfiguration = 7,
    CallData = 8,
}

impl BufferType {
    pub(crate) fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => BufferType::HttpRequestBody,
            1 => BufferType::HttpResponseBody,
            2 => BufferType::DownstreamData,
            3 => BufferType::UpstreamData,
            4 => BufferType::HttpCallResponseBody,
            5 => BufferType::GrpcReceiveBuffer,
            6 => BufferType::VmConfiguration,
            7 => BufferType::PluginConfiguration,
            8 => BufferType::CallData,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetricType {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

impl MetricType {
    pub(crate) fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => MetricType::Counter,
            1 => MetricType::Gauge,
            2 => MetricType::Histogram,
            _ => return None,
        })
    }
}

/// `proxy_continue_stream` / `proxy_close_stream` argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamType {
    HttpRequest,
    HttpResponse,
    Downstream,
    Upstream,
    Other(u32),
}

impl StreamType {
    pub(crate) fn from_code(code: i32) -> Self {
        match code {
            0 => StreamType::HttpRequest,
            1 => StreamType::HttpResponse,
            2 => StreamType::Downstream,
            3 => StreamType::Upstream,
            n => StreamType::Other(n as u32),
        }
    }
}

/// A header map as the host keeps it: ordered, repeated keys allowed, values are bytes.
pub type Pairs = Vec<(String, Vec<u8>)>;

/// Serializes pairs as the ABI does: `count:u32`, then `(key_len:u32, value_len:u32)` per
/// pair, then `key\0value\0` per pair; all little-endian. An empty map is an empty buffer.
pub fn serialize_pairs(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    if pairs.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Inverse of [`serialize_pairs`]; `None` on any truncation or length mismatch.
pub fn deserialize_pairs(bytes: &[u8]) -> Option<Pairs> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = word(0)?;
    let mut p = 4usize.checked_add(count.checked_mul(8)?)?;
    let mut out = Vec::with_capacity(count.min(1024));
    for n in 0..count {
        let (klen, vlen) = (word(4 + n * 8)?, word(8 + n * 8)?);
        let key = bytes.get(p..p + klen)?;
        p += klen + 1;
        let value = bytes.get(p..p + vlen)?;
        p += vlen + 1;
        if p > bytes.len() {
            return None;
        }
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_roundtrip_matches_sdk_layout() {
        let pairs: Pairs = vec![("a".into(), b"1".to_vec()), ("bc".into(), Vec::new())];
        let bytes = serialize_pairs(&pairs);
        // Same bytes as the SDK's `serialize_map` test fixture layout.
        let expected: &[u8] = &[
            2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, b'a', 0, b'1', 0, b'b',
            b'c', 0, 0,
        ];
        assert_eq!(bytes, expected);
        assert_eq!(deserialize_pairs(&bytes), Some(pairs));
        assert_eq!(deserialize_pairs(&bytes[..bytes.len() - 1]), None);
        assert_eq!(deserialize_pairs(&[]), Some(Vec::new()));
    }
}

//! Shared by the end-to-end, fault, bad-input and security tests: a fleet and a real Envoy
//! with the release `tokenaware.wasm`, a bounded HTTP client, the filter's stats and debug
//! view, and a small concurrent load runner. Every wait is bounded.

#![allow(dead_code)] // each test file uses a different part

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use wasm_tests::envoy::{repo_root, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, MODEL};

pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";
pub const DEBUG: &str = "/debug/tokenaware";
pub const DEST: &str = "x-gateway-destination-endpoint";
pub const DEST_SERVED: &str = "x-gateway-destination-endpoint-served";
pub const DECISION: &str = "x-tokenaware-decision";
/// Every client call is bounded: a hang fails the test instead of stalling it.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);
pub const POLL: &str =
    r#""metrics":{"cluster":"models","intervalMs":100,"timeoutMs":500,"staleAfterMs":3000}"#;

pub fn wasm_path() -> PathBuf {
    let p = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build -p tokenaware --release --target wasm32-wasip1` first",
        p.display()
    );
    p
}

/// The release module built with the `fault-injection` feature (its own target dir, so the
/// release artifact stays trigger-free). Built here when missing.
pub fn fault_wasm_path() -> PathBuf {
    let dir = repo_root().join("target/fault-injection");
    let p = dir.join("wasm32-wasip1/release/tokenaware.wasm");
    let status = std::process::Command::new(env!("CARGO"))
        .current_dir(repo_root())
        .args([
            "build",
            "-p",
            "tokenaware",
            "--release",
            "--target",
            "wasm32-wasip1",
            "--features",
            "fault-injection",
            "--target-dir",
        ])
        .arg(&dir)
        .status()
        .expect("run cargo");
    assert!(
        status.success(),
        "building the fault-injection module failed"
    );
    assert!(p.is_file(), "{} missing after the build", p.display());
    p
}

/// Plugin config: the static endpoint list, decision header and debug path, stats sent at
/// once (`statsFlushMs` 0, so a test reads them right after a request), plus `extra`
/// top-level fields (a JSON object's inner text, may be empty).
pub fn plugin_config(eps: &[String], extra: &str) -> String {
    let list: Vec<Value> = eps.iter().map(|a| json!({ "address": a })).collect();
    let mut v =
        json!({ "endpoints": list, "decisionHeader": true, "debugPath": DEBUG, "statsFlushMs": 0 });
    merge(&mut v, extra);
    v.to_string()
}

/// Adds the fields of `{extra}` to `v`.
pub fn merge(v: &mut Value, extra: &str) {
    if extra.is_empty() {
        return;
    }
    let more: Value = serde_json::from_str(&format!("{{{extra}}}")).unwrap();
    for (k, x) in more.as_object().unwrap() {
        v[k] = x.clone();
    }
}

pub fn chat(system: &str, question: &str) -> String {
    json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4
    })
    .to_string()
}

/// A long shared system prompt, distinct per `group`.
pub fn system(group: usize, bytes: usize) -> String {
    let unit = format!("Group {group}: you are a meticulous coding assistant. ");
    unit.repeat(bytes / unit.len() + 1)
}

pub struct Gateway {
    pub fleet: Fleet,
    pub envoy: Envoy,
    pub http: reqwest::Client,
}

#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub endpoint: String,
    pub decision: String,
    pub body: String,
    pub started: Instant,
    pub elapsed: Duration,
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .unwrap()
}

/// Starts the fleet and Envoy; `gw` adjusts the gateway config, `config` makes the plugin
/// config from the endpoint list.
pub async fn start_with(
    fleet: FleetConfig,
    wasm: PathBuf,
    gw: impl FnOnce(GatewayConfig) -> GatewayConfig,
    config: impl FnOnce(&[String]) -> String,
) -> Gateway {
    let fleet = Fleet::start_on_free_ports(fleet).unwrap();
    let eps = fleet.endpoints();
    let cfg = gw(GatewayConfig::new(eps.clone()).with_wasm(wasm, config(&eps)));
    Gateway {
        fleet,
        envoy: spawn_envoy(cfg).await,
        http: client(),
    }
}

/// Starts an Envoy off the async runtime's threads (its start waits for the admin port).
pub async fn spawn_envoy(cfg: GatewayConfig) -> Envoy {
    tokio::task::spawn_blocking(move || Envoy::start(cfg))
        .await
        .unwrap()
        .unwrap()
}

pub async fn start(fleet: FleetConfig, config: impl FnOnce(&[String]) -> String) -> Gateway {
    start_with(fleet, wasm_path(), |g| g, config).await
}

pub async fn answer(r: reqwest::Response, t0: Instant) -> Answer {
    let status = r.status().as_u16();
    let h = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (endpoint, decision) = (h("x-fleet-endpoint"), h(DECISION));
    let body = r.text().await.unwrap_or_default();
    Answer {
        status,
        endpoint,
        decision,
        body,
        started: t0,
        elapsed: t0.elapsed(),
    }
}

impl Gateway {
    pub async fn post(&self, path: &str, body: String) -> Answer {
        self.post_with(path, body, &[]).await
    }

    pub async fn post_with(&self, path: &str, body: String, headers: &[(&str, &str)]) -> Answer {
        let t0 = Instant::now();
        let mut rb = self
            .http
            .post(self.envoy.url(path))
            .header("content-type", "application/json");
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        let r = rb.body(body).send().await.unwrap();
        answer(r, t0).await
    }

    pub fn stat(&self, name: &str) -> i64 {
        self.envoy
            .stat(&format!("wasmcustom.{name}"))
            .unwrap()
            .unwrap_or_else(|| panic!("stat {name} not found"))
    }

    pub fn envoy_stat(&self, name: &str) -> i64 {
        self.envoy.stat(name).unwrap().unwrap_or(0)
    }

    pub async fn debug(&self) -> Value {
        let r = self.http.get(self.envoy.url(DEBUG)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    /// Polls the debug view until `ok` holds (bounded by `secs`).
    pub async fn debug_until_for(
        &self,
        what: &str,
        secs: u64,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let d = self.debug().await;
            if ok(&d) {
                return d;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {d:#}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn debug_until(&self, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        self.debug_until_for(what, 10, ok).await
    }

    /// Waits until a filter stat reaches `min` (bounded).
    pub async fn stat_at_least(&self, name: &str, min: i64, secs: u64) -> i64 {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self
                .envoy
                .stat(&format!("wasmcustom.{name}"))
                .unwrap()
                .unwrap_or(0);
            if v >= min {
                return v;
            }
            assert!(Instant::now() < deadline, "{name} = {v}, wanted >= {min}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The ledger back to zero and every routed request released (bounded wait).
    pub async fn assert_settled(&self) {
        self.debug_until("the ledger back to zero", ledger_is_zero)
            .await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (routed, released) = (
                self.stat("tokenaware_requests_routed"),
                self.stat("tokenaware_requests_released"),
            );
            if routed == released {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "routed {routed} != released {released}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(self.stat("tokenaware_release_errors"), 0);
        // The per-endpoint in-flight gauges (set by the poller's tick) read zero too.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, body) = self
                .envoy
                .admin_get("/stats?filter=tokenaware_endpoint_.*_inflight_tokens")
                .unwrap();
            let busy: Vec<&str> = body.lines().filter(|l| !l.ends_with(": 0")).collect();
            if busy.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "in-flight gauges: {busy:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn fleet_control(&self, endpoint: &str, what: &str, body: &str) {
        let r = self
            .http
            .post(format!("http://{endpoint}/fleet/{what}"))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{what}: {}", r.status());
    }

    pub async fn fleet_counters(&self, endpoint: &str) -> Value {
        self.http
            .get(format!("http://{endpoint}/fleet/counters"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

pub fn endpoint_of(d: &Value, address: &str) -> Value {
    d["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["address"] == address)
        .cloned()
        .unwrap_or_else(|| panic!("{address} not in {d:#}"))
}

pub fn ledger_is_zero(d: &Value) -> bool {
    d["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["inflightTokens"] == 0 && e["activeRequests"] == 0 && e["prefilling"] == 0)
}

/// What a load run saw.
#[derive(Debug, Default)]
pub struct LoadResult {
    pub answers: Vec<Answer>,
    /// Transport errors (connection reset, client timeout).
    pub errors: Vec<String>,
}

impl LoadResult {
    pub fn count(&self, f: impl Fn(&Answer) -> bool) -> usize {
        self.answers.iter().filter(|a| f(a)).count()
    }
}

/// `workers` closed-loop clients, each sending `body(worker, i)` until `stop` is set or
/// `max_per_worker` requests are done (bounded either way).
pub async fn closed_loop(
    url: String,
    workers: usize,
    max_per_worker: usize,
    stop: Arc<AtomicBool>,
    body: impl Fn(usize, usize) -> String + Send + Sync + 'static,
) -> LoadResult {
    let body = Arc::new(body);
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (url, stop, body) = (url.clone(), stop.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let http = client();
            let mut out = LoadResult::default();
            for i in 0..max_per_worker {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let t0 = Instant::now();
                let r = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body(w, i))
                    .send()
                    .await;
                match r {
                    Ok(r) => out.answers.push(answer(r, t0).await),
                    Err(e) => out.errors.push(format!("{e:?}")),
                }
            }
            out
        }));
    }
    let mut all = LoadResult::default();
    for t in tasks {
        let r = t.await.unwrap();
        all.answers.extend(r.answers);
        all.errors.extend(r.errors);
    }
    all
}

/// One raw HTTP/1.1 exchange on a fresh connection (header names keep their case and may
/// repeat); `request` is everything after the request line's CRLF up to and including the
/// body. Returns the status, the response head and body.
pub fn raw_exchange(port: u16, request_line: &str, rest: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
    s.write_all(format!("{request_line}\r\n").as_bytes())
        .unwrap();
    s.write_all(rest).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, _) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let at = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |i| i + 4);
    (status, head.to_string(), out[at..].to_vec())
}

/// A response header's value from a raw head (case-insensitive name).
pub fn head_value(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

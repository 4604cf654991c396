//! A simulated vLLM fleet: N OpenAI-compatible endpoints on consecutive loopback ports, each
//! with its own prefix cache, a vLLM-like step scheduler (chunked prefill within a token budget,
//! decode steps that grow with the batch, `max-num-seqs` with a waiting queue) and Prometheus
//! metrics.
//!
//! Use it in-process from tests:
//!
//! ```no_run
//! use wasm_tests::fleet::{Fleet, FleetConfig, Timing};
//! let timing = Timing { time_factor: 0.01, ..Default::default() };
//! let fleet = Fleet::start_on_free_ports(FleetConfig { endpoints: 3, timing, ..Default::default() })?;
//! let urls: Vec<String> = fleet.endpoints(); // ["127.0.0.1:P", "127.0.0.1:P+1", ...]
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! or as a process: `cargo run -p wasm-tests --release --bin fleet -- --endpoints 4 --base-port 8000`.
//!
//! Each endpoint serves `POST /v1/completions`, `POST /v1/chat/completions` (stream or not;
//! `usage` with `prompt_tokens_details.cached_tokens` in the final JSON / last chunk),
//! `POST /v1/responses` (streamed as vLLM does: `response.created` and `response.in_progress`
//! at once, an event a token, `usage` in `response.completed`),
//! `GET /metrics`, `GET /health`, `GET /v1/models`, and the test controls
//! `POST /fleet/metrics-override` (body replaces `/metrics` output; empty body clears),
//! `POST /fleet/metrics-fault` (`garbage`, `500`, `slow` (answers after 10 s) or empty: how
//! `/metrics` misbehaves) and `GET /fleet/counters` (requests seen per kind, JSON).
//! Every response carries `x-fleet-endpoint: 127.0.0.1:PORT`.
//!
//! A [`Fleet`] can also [`kill`](Fleet::kill) an endpoint (listener and open connections
//! dropped at once, like a crash) and [`restart`](Fleet::restart) it cold (empty cache,
//! counters from zero).

pub mod cache;
mod control;
pub mod openai;
pub mod sched;
mod server;
pub mod timing;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

pub use server::{MetricsFault, SLOW_METRICS};
pub use timing::Timing;

/// The model name the endpoints advertise.
pub const MODEL: &str = "sim-model";

/// Which metric names `/metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsNames {
    #[default]
    Vllm,
    Sglang,
}

#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Number of endpoints.
    pub endpoints: usize,
    /// First port; endpoint i listens on `base_port + i`. 0 is invalid for [`Fleet::start`];
    /// [`Fleet::start_on_free_ports`] ignores it.
    pub base_port: u16,
    pub timing: Timing,
    /// KV cache capacity per endpoint, in 16-token blocks.
    pub kv_blocks: usize,
    pub metrics_names: MetricsNames,
    /// Ports in the range that do not listen at all (simulated dead endpoints).
    pub dead: Vec<u16>,
    /// The first this many endpoints prefill at [`SLOW_PREFILL_FACTOR`] of
    /// `timing.prefill_rate` (a heterogeneous fleet).
    pub slow_endpoints: usize,
    /// `vllm:cache_config_info` reports this multiple of `kv_blocks`: a server that keeps
    /// less than it says (the index correction's test case). 1 is honest.
    pub kv_report_factor: f64,
}

/// What a slow endpoint's prefill rate is of the fleet's.
pub const SLOW_PREFILL_FACTOR: f64 = 0.5;

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            endpoints: 1,
            base_port: 0,
            timing: Timing::default(),
            kv_blocks: 32768,
            metrics_names: MetricsNames::Vllm,
            dead: Vec::new(),
            slow_endpoints: 0,
            kv_report_factor: 1.0,
        }
    }
}

impl FleetConfig {
    /// `endpoints` honest endpoints at the default timing, every duration times `time_factor`
    /// (0.01 runs 100x faster than real time).
    pub fn scaled(endpoints: usize, time_factor: f64) -> Self {
        Self {
            endpoints,
            timing: Timing {
                time_factor,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The timing of the endpoint on `port`: the fleet's, with the prefill rate lowered for
    /// the first `slow_endpoints`.
    pub fn timing_for(&self, port: u16) -> Timing {
        let mut t = self.timing;
        let index = usize::from(port.saturating_sub(self.base_port));
        if index < self.slow_endpoints {
            t.prefill_rate *= SLOW_PREFILL_FACTOR;
        }
        t
    }
}

/// Binds the listeners for `cfg` (all ports in the range except the dead ones).
pub fn bind(cfg: &FleetConfig) -> anyhow::Result<Vec<StdListener>> {
    anyhow::ensure!(cfg.endpoints > 0, "need at least one endpoint");
    anyhow::ensure!(cfg.base_port > 0, "base port must be > 0");
    let mut out = Vec::new();
    for i in 0..cfg.endpoints {
        let port = u16::try_from(usize::from(cfg.base_port) + i).context("port range overflows")?;
        if cfg.dead.contains(&port) {
            continue;
        }
        let l = StdListener::bind((Ipv4Addr::LOCALHOST, port))
            .with_context(|| format!("bind 127.0.0.1:{port}"))?;
        l.set_nonblocking(true)?;
        out.push(l);
    }
    Ok(out)
}

/// Serves already-bound listeners until `shutdown` resolves, then shuts down gracefully
/// (in-flight requests get `grace` to finish). Must run inside a tokio runtime.
pub async fn serve(
    cfg: FleetConfig,
    listeners: Vec<StdListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for l in listeners {
        let port = l.local_addr()?.port();
        let listener = tokio::net::TcpListener::from_std(l)?;
        let app = server::Endpoint::new(port, cfg.clone()).router();
        let mut rx = stop_rx.clone();
        tasks.spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
        });
    }
    shutdown.await;
    let _ = stop_tx.send(true);
    let drain = async {
        while let Some(r) = tasks.join_next().await {
            if let Ok(Err(e)) = r {
                eprintln!("fleet: server error: {e}");
            }
        }
    };
    if tokio::time::timeout(grace, drain).await.is_err() {
        eprintln!("fleet: grace period over, dropping in-flight requests");
    }
    Ok(())
}

/// A fleet running in a background thread (its own tokio runtime); stopped on drop.
pub struct Fleet {
    base_port: u16,
    ports: Vec<u16>,
    commands: tokio::sync::mpsc::UnboundedSender<control::Command>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Fleet {
    /// Starts the fleet on `cfg.base_port ..`; returns once every live port is listening.
    pub fn start(cfg: FleetConfig) -> anyhow::Result<Fleet> {
        let listeners = bind(&cfg)?;
        Self::run(cfg, listeners)
    }

    /// Starts the fleet on a free range of consecutive ports (retries other ranges if a bind
    /// fails; bounded). `cfg.base_port` is ignored; `cfg.dead` is taken as offsets from the
    /// base (0 = first endpoint) here.
    pub fn start_on_free_ports(mut cfg: FleetConfig) -> anyhow::Result<Fleet> {
        let offsets = std::mem::take(&mut cfg.dead);
        let mut last_err = None;
        for _ in 0..50 {
            let base = crate::ports::free_port_range(cfg.endpoints)?;
            cfg.base_port = base;
            cfg.dead = offsets.iter().map(|o| base + o).collect();
            match bind(&cfg) {
                Ok(listeners) => return Self::run(cfg, listeners),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("no free port range")))
    }

    fn run(cfg: FleetConfig, listeners: Vec<StdListener>) -> anyhow::Result<Fleet> {
        let base_port = cfg.base_port;
        let ports = (0..cfg.endpoints).map(|i| base_port + i as u16).collect();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("fleet")
            .build()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (commands, command_rx) = tokio::sync::mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("fleet".into())
            .spawn(move || {
                let grace = Duration::from_millis(500);
                if let Err(e) = rt.block_on(control::run(cfg, listeners, command_rx, rx, grace)) {
                    eprintln!("fleet: {e:#}");
                }
                rt.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Fleet {
            base_port,
            ports,
            commands,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    fn command(&self, c: impl FnOnce(control::Reply) -> control::Command) -> anyhow::Result<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.commands
            .send(c(tx))
            .map_err(|_| anyhow::anyhow!("fleet stopped"))?;
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| anyhow::anyhow!("fleet did not answer"))?
    }

    fn port_of(&self, i: usize) -> anyhow::Result<u16> {
        self.ports
            .get(i)
            .copied()
            .with_context(|| format!("no endpoint {i}"))
    }

    /// Kills endpoint `i` (0-based) at once: its port stops listening and its open
    /// connections, with any request in flight, are dropped. Blocks until done.
    pub fn kill(&self, i: usize) -> anyhow::Result<()> {
        let port = self.port_of(i)?;
        self.command(|r| control::Command::Kill(port, r))
    }

    /// Starts endpoint `i` again, cold: an empty prefix cache, metrics counters from zero.
    /// Also starts an endpoint configured dead. Blocks until it listens.
    pub fn restart(&self, i: usize) -> anyhow::Result<()> {
        let port = self.port_of(i)?;
        self.command(|r| control::Command::Restart(port, r))
    }

    pub fn base_port(&self) -> u16 {
        self.base_port
    }

    /// All endpoint ports, dead ones included, in order.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `127.0.0.1:PORT` for every endpoint (the form `x-gateway-destination-endpoint` and
    /// `x-fleet-endpoint` use).
    pub fn endpoints(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.ports
            .iter()
            .map(|&p| SocketAddr::from((Ipv4Addr::LOCALHOST, p)))
            .collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

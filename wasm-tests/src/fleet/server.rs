//! One simulated endpoint: HTTP handlers, the FIFO prefill server, gauges and /metrics.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc;

use super::cache::{approx_tokens, block_hashes, PrefixCache, BLOCK_TOKENS};
use super::openai::{self, Api, Parsed, Usage};
use super::{FleetConfig, MetricsNames, MODEL};

/// Largest request body accepted (the filter is tested with multi-MiB prompts).
const MAX_BODY_BYTES: usize = 64 << 20;
/// Sleeps shorter than this are skipped and carried over (tokio timers have 1 ms resolution).
const PACE_SLACK: Duration = Duration::from_millis(1);

struct PrefillQueue {
    /// Virtual time at which the prefill server is free again.
    busy_until: Instant,
}

pub(crate) struct Endpoint {
    port: u16,
    cfg: Arc<FleetConfig>,
    endpoint_header: HeaderValue,
    cache: Mutex<PrefixCache>,
    prefill: tokio::sync::Mutex<PrefillQueue>,
    waiting: AtomicI64,
    running: AtomicI64,
    kv_used_blocks: AtomicI64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    requests: AtomicU64,
    next_id: AtomicU64,
    metrics_override: Mutex<Option<String>>,
}

/// Increments a gauge for its lifetime (decrements on drop, also on cancellation).
struct Gauge<'a> {
    g: &'a AtomicI64,
    n: i64,
}

impl<'a> Gauge<'a> {
    fn add(g: &'a AtomicI64, n: i64) -> Self {
        g.fetch_add(n, Ordering::Relaxed);
        Self { g, n }
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.g.fetch_sub(self.n, Ordering::Relaxed);
    }
}

async fn pace_until(deadline: Instant) {
    if deadline > Instant::now() + PACE_SLACK {
        tokio::time::sleep_until(deadline.into()).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Prefilled {
    prompt_tokens: usize,
    cached_tokens: usize,
    first_token_at: Instant,
}

impl Endpoint {
    pub(crate) fn new(port: u16, cfg: Arc<FleetConfig>) -> Arc<Self> {
        let endpoint_header = HeaderValue::from_str(&format!("127.0.0.1:{port}"))
            .unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        Arc::new(Self {
            port,
            cache: Mutex::new(PrefixCache::new(cfg.kv_blocks)),
            cfg,
            endpoint_header,
            prefill: tokio::sync::Mutex::new(PrefillQueue {
                busy_until: Instant::now(),
            }),
            waiting: AtomicI64::new(0),
            running: AtomicI64::new(0),
            kv_used_blocks: AtomicI64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            metrics_override: Mutex::new(None),
        })
    }

    pub(crate) fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/metrics", get(metrics))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/v1/models", get(models))
            .route("/fleet/metrics-override", post(metrics_override))
            .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
            .layer(middleware::from_fn_with_state(self.clone(), tag_endpoint))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
    }

    /// Waits for this endpoint's FIFO prefill server, prefills the uncached tokens, updates
    /// the cache. The returned gauge marks the request as running until it is dropped.
    async fn prefill(&self, p: &Parsed) -> (Prefilled, Gauge<'_>, Gauge<'_>) {
        let hashes = block_hashes(&p.model, &p.prompt);
        let tokens = approx_tokens(&p.prompt);
        let waiting = Gauge::add(&self.waiting, 1);
        let mut q = self.prefill.lock().await;
        drop(waiting);
        let running = Gauge::add(&self.running, 1);
        let now = Instant::now();
        // Continue in virtual time if the server was busy until (about) now.
        let start = if now.saturating_duration_since(q.busy_until) <= PACE_SLACK {
            q.busy_until
        } else {
            now
        };
        pace_until(start).await;
        let cached = lock(&self.cache).cached_tokens(&hashes, tokens);
        let kv_blocks = (tokens + p.max_tokens).div_ceil(BLOCK_TOKENS) as i64;
        let kv = Gauge::add(&self.kv_used_blocks, kv_blocks);
        let end = start + self.cfg.timing.prefill(tokens - cached);
        q.busy_until = end;
        pace_until(end).await;
        lock(&self.cache).insert(&hashes);
        drop(q);
        self.prefix_queries
            .fetch_add(tokens as u64, Ordering::Relaxed);
        self.prefix_hits.fetch_add(cached as u64, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        let pre = Prefilled {
            prompt_tokens: tokens,
            cached_tokens: cached,
            first_token_at: end,
        };
        (pre, running, kv)
    }

    fn render_metrics(&self) -> String {
        if let Some(text) = lock(&self.metrics_override).clone() {
            return text;
        }
        let running = self.running.load(Ordering::Relaxed).max(0);
        let waiting = self.waiting.load(Ordering::Relaxed).max(0);
        let cap = self.cfg.kv_blocks.max(1) as f64;
        let usage = (self.kv_used_blocks.load(Ordering::Relaxed).max(0) as f64 / cap).min(1.0);
        let l = format!("model_name=\"{MODEL}\"");
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, sample: String| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{sample}\n"
            ));
        };
        match self.cfg.metrics_names {
            MetricsNames::Vllm => {
                metric(
                    "vllm:num_requests_running",
                    "gauge",
                    "Number of requests in model execution batches.",
                    format!("vllm:num_requests_running{{{l}}} {running}.0"),
                );
                metric(
                    "vllm:num_requests_waiting",
                    "gauge",
                    "Number of requests waiting to be processed.",
                    format!("vllm:num_requests_waiting{{{l}}} {waiting}.0"),
                );
                metric(
                    "vllm:kv_cache_usage_perc",
                    "gauge",
                    "KV-cache usage. 1 means 100 percent usage.",
                    format!("vllm:kv_cache_usage_perc{{{l}}} {usage:?}"),
                );
                let q = self.prefix_queries.load(Ordering::Relaxed);
                let h = self.prefix_hits.load(Ordering::Relaxed);
                metric(
                    "vllm:prefix_cache_queries",
                    "counter",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    format!("vllm:prefix_cache_queries_total{{{l}}} {q}.0"),
                );
                metric(
                    "vllm:prefix_cache_hits",
                    "counter",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    format!("vllm:prefix_cache_hits_total{{{l}}} {h}.0"),
                );
                let pt = self.prompt_tokens.load(Ordering::Relaxed);
                let gt = self.generation_tokens.load(Ordering::Relaxed);
                let rq = self.requests.load(Ordering::Relaxed);
                metric(
                    "vllm:prompt_tokens",
                    "counter",
                    "Number of prefill tokens processed.",
                    format!("vllm:prompt_tokens_total{{{l}}} {pt}.0"),
                );
                metric(
                    "vllm:generation_tokens",
                    "counter",
                    "Number of generation tokens processed.",
                    format!("vllm:generation_tokens_total{{{l}}} {gt}.0"),
                );
                metric(
                    "vllm:request_success",
                    "counter",
                    "Count of successfully processed requests.",
                    format!("vllm:request_success_total{{finished_reason=\"length\",{l}}} {rq}.0"),
                );
                metric(
                    "vllm:cache_config_info",
                    "gauge",
                    "Information of the LLMEngine CacheConfig",
                    format!(
                        "vllm:cache_config_info{{block_size=\"{BLOCK_TOKENS}\",cache_dtype=\"auto\",\
                         enable_prefix_caching=\"True\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{}\",{l}}} 1.0",
                        self.cfg.kv_blocks
                    ),
                );
            }
            MetricsNames::Sglang => {
                metric(
                    "sglang:num_running_reqs",
                    "gauge",
                    "The number of running requests.",
                    format!("sglang:num_running_reqs{{{l}}} {running}.0"),
                );
                metric(
                    "sglang:num_queue_reqs",
                    "gauge",
                    "The number of requests in the waiting queue.",
                    format!("sglang:num_queue_reqs{{{l}}} {waiting}.0"),
                );
                metric(
                    "sglang:token_usage",
                    "gauge",
                    "The token usage.",
                    format!("sglang:token_usage{{{l}}} {usage:?}"),
                );
            }
        }
        out
    }

    fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("cmpl-{}-{n}", self.port)
    }
}

/// Adds `x-fleet-endpoint: 127.0.0.1:PORT` to every response.
async fn tag_endpoint(State(ep): State<Arc<Endpoint>>, req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    resp.headers_mut()
        .insert("x-fleet-endpoint", ep.endpoint_header.clone());
    resp
}

async fn completions(State(ep): State<Arc<Endpoint>>, body: Bytes) -> Response {
    generate(ep, Api::Completions, body).await
}

async fn chat_completions(State(ep): State<Arc<Endpoint>>, body: Bytes) -> Response {
    generate(ep, Api::Chat, body).await
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn generate(ep: Arc<Endpoint>, api: Api, body: Bytes) -> Response {
    let p = match openai::parse(api, &body, MODEL) {
        Ok(p) => p,
        Err(e) => {
            let body = openai::error_body(&e, "BadRequestError");
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    drop(body);
    let id = ep.new_id();
    let created = unix_now();
    if !p.stream {
        let (pre, _running, _kv) = ep.prefill(&p).await;
        pace_until(pre.first_token_at + ep.cfg.timing.decode(p.max_tokens)).await;
        ep.generation_tokens
            .fetch_add(p.max_tokens as u64, Ordering::Relaxed);
        ep.requests.fetch_add(1, Ordering::Relaxed);
        let usage = Usage {
            prompt_tokens: pre.prompt_tokens,
            completion_tokens: p.max_tokens,
            cached_tokens: pre.cached_tokens,
        };
        return Json(openai::full_response(&p, &id, created, usage)).into_response();
    }
    // Streaming: like vLLM, headers go out at once; chunks follow prefill and decode.
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    tokio::spawn(async move {
        let work = async {
            let (pre, _running, _kv) = ep.prefill(&p).await;
            for i in 0..p.max_tokens {
                pace_until(pre.first_token_at + ep.cfg.timing.token_offset(i)).await;
                let last = (i + 1 == p.max_tokens).then_some(Usage {
                    prompt_tokens: pre.prompt_tokens,
                    completion_tokens: p.max_tokens,
                    cached_tokens: pre.cached_tokens,
                });
                let chunk = openai::stream_chunk(&p, &id, created, i, last);
                let frame = Bytes::from(format!("data: {chunk}\n\n"));
                if tx.send(Ok(frame)).await.is_err() {
                    return;
                }
                ep.generation_tokens.fetch_add(1, Ordering::Relaxed);
            }
            ep.requests.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        };
        // A client that goes away aborts the request, also while it is queued.
        tokio::select! {
            _ = work => {}
            _ = tx.closed() => {}
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn metrics(State(ep): State<Arc<Endpoint>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        ep.render_metrics(),
    )
        .into_response()
}

async fn models() -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fleet",
                  "root": MODEL, "max_model_len": 131072}],
    }))
}

async fn metrics_override(State(ep): State<Arc<Endpoint>>, body: Bytes) -> StatusCode {
    let text = String::from_utf8_lossy(&body).into_owned();
    *lock(&ep.metrics_override) = (!text.is_empty()).then_some(text);
    StatusCode::NO_CONTENT
}

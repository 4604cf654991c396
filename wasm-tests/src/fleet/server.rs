//! One simulated endpoint: HTTP handlers, gauges and /metrics; the step scheduler is in
//! [`super::sched`].

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

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
use super::openai::{self, Api, Usage};
use super::sched::{Event, Scheduler, Seq};
use super::{FleetConfig, MetricsNames, MODEL};

/// Largest request body accepted (the filter is tested with multi-MiB prompts).
const MAX_BODY_BYTES: usize = 64 << 20;

pub(crate) struct Endpoint {
    pub(crate) port: u16,
    pub(crate) cfg: Arc<FleetConfig>,
    endpoint_header: HeaderValue,
    pub(crate) cache: Mutex<PrefixCache>,
    pub(crate) sched: Scheduler,
    pub(crate) waiting: AtomicI64,
    pub(crate) running: AtomicI64,
    pub(crate) kv_used_blocks: AtomicI64,
    pub(crate) prefix_queries: AtomicU64,
    pub(crate) prefix_hits: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) requests: AtomicU64,
    next_id: AtomicU64,
    metrics_override: Mutex<Option<String>>,
    metrics_fault: Mutex<MetricsFault>,
    /// `GET /metrics` requests seen (polls).
    metrics_requests: AtomicU64,
    /// Inference requests seen (`POST /v1/...`, parsed or not).
    inference_requests: AtomicU64,
}

/// How `/metrics` misbehaves (`POST /fleet/metrics-fault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsFault {
    #[default]
    None,
    /// 200 with bytes that are not Prometheus text (binary, invalid UTF-8, huge numbers).
    Garbage,
    /// 500 Internal Server Error.
    Error500,
    /// The normal answer, after 10 s (real time, not scaled).
    Slow,
}

impl MetricsFault {
    pub fn parse(s: &str) -> Option<MetricsFault> {
        Some(match s.trim() {
            "" | "none" => MetricsFault::None,
            "garbage" => MetricsFault::Garbage,
            "500" => MetricsFault::Error500,
            "slow" => MetricsFault::Slow,
            _ => return None,
        })
    }
}

/// How long a [`MetricsFault::Slow`] `/metrics` takes.
pub const SLOW_METRICS: std::time::Duration = std::time::Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
            sched: Scheduler::default(),
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
            metrics_fault: Mutex::new(MetricsFault::None),
            metrics_requests: AtomicU64::new(0),
            inference_requests: AtomicU64::new(0),
        })
    }

    pub(crate) fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/responses", post(responses))
            .route("/metrics", get(metrics))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/v1/models", get(models))
            .route("/fleet/metrics-override", post(metrics_override))
            .route("/fleet/metrics-fault", post(metrics_fault))
            .route("/fleet/counters", get(counters))
            .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
            .layer(middleware::from_fn_with_state(self.clone(), tag_endpoint))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
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
                        (self.cfg.kv_blocks as f64 * self.cfg.kv_report_factor).round() as u64
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

async fn responses(State(ep): State<Arc<Endpoint>>, body: Bytes) -> Response {
    generate(ep, Api::Responses, body).await
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn generate(ep: Arc<Endpoint>, api: Api, body: Bytes) -> Response {
    ep.inference_requests.fetch_add(1, Ordering::Relaxed);
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
    let hashes = block_hashes(&p.model, &p.prompt);
    let tokens = approx_tokens(&p.prompt);
    let (tx, mut events) = mpsc::unbounded_channel();
    ep.sched
        .submit(&ep, Seq::new(hashes, tokens, p.max_tokens, tx));
    if !p.stream {
        let mut usage = Usage {
            prompt_tokens: tokens,
            completion_tokens: p.max_tokens,
            cached_tokens: 0,
        };
        let mut got = 0;
        while got < p.max_tokens {
            match events.recv().await {
                Some(Event::First { cached_tokens, .. }) => {
                    usage.cached_tokens = cached_tokens;
                    got += 1;
                }
                Some(Event::Token) => got += 1,
                None => break,
            }
        }
        return Json(openai::full_response(&p, &id, created, usage)).into_response();
    }
    // Streaming: like vLLM, headers go out at once; a chunk follows each generated token.
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    if p.api == Api::Responses {
        let opening = openai::responses_opening(&p, &id, created);
        let _ = tx.try_send(Ok(Bytes::from(opening)));
    }
    tokio::spawn(async move {
        let mut cached = 0;
        let mut i = 0;
        while i < p.max_tokens {
            match events.recv().await {
                Some(Event::First { cached_tokens, .. }) => cached = cached_tokens,
                Some(Event::Token) => {}
                None => return,
            }
            let last = (i + 1 == p.max_tokens).then_some(Usage {
                prompt_tokens: tokens,
                completion_tokens: p.max_tokens,
                cached_tokens: cached,
            });
            let frame = match p.api {
                Api::Responses => openai::responses_token(&p, &id, created, i, last),
                _ => format!(
                    "data: {}\n\n",
                    openai::stream_chunk(&p, &id, created, i, last)
                ),
            };
            let frame = Bytes::from(frame);
            // A client that goes away drops `events`, which takes the request out of the
            // scheduler (also while it is queued).
            if tx.send(Ok(frame)).await.is_err() {
                return;
            }
            i += 1;
        }
        if p.api != Api::Responses {
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
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
    ep.metrics_requests.fetch_add(1, Ordering::Relaxed);
    let fault = *lock(&ep.metrics_fault);
    match fault {
        MetricsFault::None => {}
        MetricsFault::Error500 => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "metrics broken\n").into_response()
        }
        MetricsFault::Garbage => {
            let mut junk =
                b"\xff\xfe\x00garbage{{{ vllm:num_requests_waiting{model_name=\"".to_vec();
            junk.extend_from_slice(b"\nvllm:num_requests_running 1e999999\n\x00\x01\x02 ]]]\n");
            junk.extend(std::iter::repeat_n(b'}', 4096));
            return (StatusCode::OK, junk).into_response();
        }
        MetricsFault::Slow => tokio::time::sleep(SLOW_METRICS).await,
    }
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

async fn metrics_fault(State(ep): State<Arc<Endpoint>>, body: Bytes) -> StatusCode {
    match MetricsFault::parse(&String::from_utf8_lossy(&body)) {
        Some(f) => {
            *lock(&ep.metrics_fault) = f;
            StatusCode::NO_CONTENT
        }
        None => StatusCode::BAD_REQUEST,
    }
}

async fn counters(State(ep): State<Arc<Endpoint>>) -> Json<serde_json::Value> {
    Json(json!({
        "metricsRequests": ep.metrics_requests.load(Ordering::Relaxed),
        "inferenceRequests": ep.inference_requests.load(Ordering::Relaxed),
    }))
}

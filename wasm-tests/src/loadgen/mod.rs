//! Load generator: seeded arrivals (open-loop Poisson, closed-loop concurrency, rate
//! ladders) of a [`workload::Workload`]'s requests, sent as streaming OpenAI chat/completions
//! to one URL, measured per request (TTFT at the first body byte, end-to-end latency, usage)
//! and summarised ([`Summary`]).
//!
//! Time is in *model seconds*: with a time factor `f` (the fleet's), a rate of `r` req/s is
//! sent at `r / f` per wall second and every measured duration is divided by `f`. Token
//! counts are reported in model tokens (served tokens divided by the workload's scale), so
//! figures compare with unscaled ones.
//!
//! [`calibrate`] measures a server's peak prefill throughput (R_peak) the way llm-d does.

pub mod calibrate;
pub mod workload;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

pub use workload::{Item, Workload, WorkloadKind, SEED_GROUPS};

/// Mixed into the arrival seed (the plan uses another constant).
const ARRIVAL_SEED_MIX: u64 = 0xa771_7a15_0000_0002;

/// Arrival offsets (model seconds from the start) of a Poisson process at `rate` req/s over
/// `duration` seconds, at most `max` of them. Depends only on the arguments.
pub fn poisson_arrivals(seed: u64, rate: f64, duration: f64, max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    if !(rate > 0.0 && duration > 0.0) {
        return out;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ARRIVAL_SEED_MIX);
    let mut t = 0.0;
    while out.len() < max {
        let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        t += -u.ln() / rate;
        if t >= duration {
            break;
        }
        out.push(t);
    }
    out
}

/// Where and how to send.
#[derive(Debug, Clone)]
pub struct Target {
    /// Full URL of `/v1/chat/completions`.
    pub url: String,
    pub model: String,
    /// Send `x-prefix-group` (for a ring hash on that header).
    pub prefix_group_header: bool,
    /// Per-request bound, wall time.
    pub timeout: Duration,
}

/// One request's outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    pub index: usize,
    pub group: String,
    /// Scheduled start, model seconds from the run's start.
    pub scheduled_s: f64,
    pub ok: bool,
    pub status: u16,
    pub error: Option<String>,
    /// Model seconds from send to the first response body byte.
    pub ttft_s: Option<f64>,
    /// Model seconds from send to the end of the stream.
    pub e2e_s: Option<f64>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// `x-fleet-endpoint` of the response, if any.
    pub endpoint: Option<String>,
    /// `x-tokenaware-decision` of the response, if the filter sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
}

/// How one run is paced.
#[derive(Debug, Clone)]
pub enum Pace {
    /// Open loop: these arrival offsets (model seconds).
    Open(Vec<f64>),
    /// Closed loop: `concurrency` clients, `requests` requests in all.
    Closed { concurrency: usize, requests: usize },
}

/// Sends `items` (one per arrival / closed-loop slot, in order) to `target`. `time_factor`
/// converts model seconds to wall seconds. Bounded: every request has the target's timeout.
pub async fn run(
    client: &reqwest::Client,
    target: &Target,
    items: &[Item],
    pace: &Pace,
    time_factor: f64,
    progress: Option<&ProgressBar>,
) -> Vec<Record> {
    let tf = if time_factor > 0.0 { time_factor } else { 1.0 };
    let start = Instant::now();
    match pace {
        Pace::Open(arrivals) => {
            let n = arrivals.len().min(items.len());
            let mut tasks = tokio::task::JoinSet::new();
            for (item, &at) in items[..n].iter().zip(arrivals) {
                let when = start + Duration::from_secs_f64(at * tf);
                tokio::time::sleep_until(when.into()).await;
                let (client, target, item) = (client.clone(), target.clone(), item.clone());
                let pb = progress.cloned();
                tasks.spawn(async move {
                    let mut r = send(&client, &target, &item, tf).await;
                    r.scheduled_s = at;
                    if let Some(pb) = pb {
                        pb.inc(1);
                    }
                    r
                });
            }
            let mut out = Vec::with_capacity(n);
            while let Some(r) = tasks.join_next().await {
                if let Ok(r) = r {
                    out.push(r);
                }
            }
            out.sort_by_key(|r| r.index);
            out
        }
        Pace::Closed {
            concurrency,
            requests,
        } => {
            let n = (*requests).min(items.len());
            let next = Arc::new(AtomicUsize::new(0));
            let items: Arc<[Item]> = items[..n].to_vec().into();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..(*concurrency).max(1) {
                let (client, target, items, next) =
                    (client.clone(), target.clone(), items.clone(), next.clone());
                let pb = progress.cloned();
                tasks.spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        let at = start.elapsed().as_secs_f64() / tf;
                        let mut r = send(&client, &target, item, tf).await;
                        r.scheduled_s = at;
                        if let Some(pb) = &pb {
                            pb.inc(1);
                        }
                        out.push(r);
                    }
                    out
                });
            }
            let mut out = Vec::with_capacity(n);
            while let Some(r) = tasks.join_next().await {
                if let Ok(r) = r {
                    out.extend(r);
                }
            }
            out.sort_by_key(|r| r.index);
            out
        }
    }
}

/// One stage of a rate ladder.
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    pub rate: f64,
    pub summary: Summary,
    #[serde(skip)]
    pub records: Vec<Record>,
}

/// A rate ladder: for each rate in order, Poisson arrivals over `stage_duration` model
/// seconds (seed `seed + stage`), each stage drained before the next; the plan continues
/// across stages. Stops early (remaining stages not run) after a stage for which `stop`
/// returns true. The same arguments give the same arrivals and requests against any target.
#[allow(clippy::too_many_arguments)]
pub async fn ladder(
    client: &reqwest::Client,
    target: &Target,
    workload: &Workload,
    rates: &[f64],
    stage_duration: f64,
    max_per_stage: usize,
    time_factor: f64,
    label: &str,
    stop: impl Fn(&Summary) -> bool,
) -> Vec<Stage> {
    crate::replicas::ladder(
        client,
        std::slice::from_ref(target),
        workload,
        rates,
        stage_duration,
        max_per_stage,
        time_factor,
        label,
        crate::replicas::Deal::Alternate,
        stop,
    )
    .await
}

/// Sends one streaming request and reads the whole stream.
pub async fn send(client: &reqwest::Client, target: &Target, item: &Item, tf: f64) -> Record {
    let mut rec = Record {
        index: item.index,
        group: item.group.clone(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let fut = async {
        let mut req = client
            .post(&target.url)
            .header("content-type", "application/json")
            .body(item.body(&target.model));
        if target.prefix_group_header {
            req = req.header("x-prefix-group", &item.group);
        }
        let resp = req.send().await.map_err(|e| format!("send: {e}"))?;
        rec.status = resp.status().as_u16();
        rec.endpoint = resp
            .headers()
            .get("x-fleet-endpoint")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        rec.decision = resp
            .headers()
            .get("x-tokenaware-decision")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if !resp.status().is_success() {
            return Err(format!("status {}", rec.status));
        }
        let mut stream = resp.bytes_stream();
        // Only the tail is kept: the usage chunk is the last data line before [DONE].
        let mut tail: Vec<u8> = Vec::new();
        let mut done = false;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("stream: {e}"))?;
            if chunk.is_empty() {
                continue;
            }
            if rec.ttft_s.is_none() {
                rec.ttft_s = Some(t0.elapsed().as_secs_f64() / tf);
            }
            tail.extend_from_slice(&chunk);
            if let Some(u) = find_usage(&tail) {
                rec.prompt_tokens = u.0;
                rec.cached_tokens = u.1;
                rec.completion_tokens = u.2;
            }
            if tail.windows(12).any(|w| w == b"data: [DONE]") {
                done = true;
            }
            // Keep the last incomplete line only.
            if let Some(p) = tail.iter().rposition(|&b| b == b'\n') {
                tail.drain(..=p);
            }
        }
        if !done {
            return Err("stream ended without [DONE]".to_string());
        }
        Ok(())
    };
    match tokio::time::timeout(target.timeout, fut).await {
        Ok(Ok(())) => rec.ok = true,
        Ok(Err(e)) => rec.error = Some(e),
        Err(_) => rec.error = Some("timeout".into()),
    }
    rec.e2e_s = Some(t0.elapsed().as_secs_f64() / tf);
    rec
}

/// (prompt, cached, completion) tokens from a complete `data: {...usage...}` line in `buf`.
fn find_usage(buf: &[u8]) -> Option<(usize, usize, usize)> {
    let text = std::str::from_utf8(buf).ok()?;
    for line in text.lines().rev() {
        let Some(json) = line.strip_prefix("data: ") else {
            continue;
        };
        if !json.contains("\"usage\"") {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let u = v.get("usage")?;
        if u.is_null() {
            continue;
        }
        let n = |k: &str| u.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
        let cached = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0) as usize;
        return Some((n("prompt_tokens"), cached, n("completion_tokens")));
    }
    None
}

/// A run's figures (model seconds, model tokens).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub requests: usize,
    pub completed: usize,
    pub errors: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p90_s: f64,
    /// cached / prompt tokens over completed requests.
    pub hit_rate: f64,
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub completed_rps: f64,
    /// Model seconds from the first send to the last completion.
    pub span_s: f64,
    /// Requests served per endpoint (from `x-fleet-endpoint`).
    pub per_endpoint: std::collections::BTreeMap<String, usize>,
    /// The first few distinct error messages.
    pub error_kinds: Vec<String>,
}

/// Nearest-rank percentile of sorted values (0 if empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises records; `scale` converts served tokens back to model tokens.
pub fn summarize(records: &[Record], scale: f64) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    let mut e2e: Vec<f64> = ok.iter().filter_map(|r| r.e2e_s).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let prompt: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|r| r.cached_tokens).sum();
    let output: usize = ok.iter().map(|r| r.completion_tokens).sum();
    let first = records
        .iter()
        .map(|r| r.scheduled_s)
        .fold(f64::INFINITY, f64::min);
    let last = records
        .iter()
        .map(|r| r.scheduled_s + r.e2e_s.unwrap_or(0.0))
        .fold(0.0, f64::max);
    let span = if first.is_finite() && last > first {
        last - first
    } else {
        0.0
    };
    let s = if scale > 0.0 { scale } else { 1.0 };
    let per_s = |x: f64| if span > 0.0 { x / span } else { 0.0 };
    let mut per_endpoint = std::collections::BTreeMap::new();
    for r in &ok {
        if let Some(e) = &r.endpoint {
            *per_endpoint.entry(e.clone()).or_insert(0) += 1;
        }
    }
    let mut error_kinds: Vec<String> = Vec::new();
    for r in records.iter().filter(|r| !r.ok) {
        let e = r.error.clone().unwrap_or_default();
        if error_kinds.len() < 5 && !error_kinds.contains(&e) {
            error_kinds.push(e);
        }
    }
    Summary {
        requests: records.len(),
        completed: ok.len(),
        errors: records.len() - ok.len(),
        ttft_p50_s: percentile(&ttft, 50.0),
        ttft_p90_s: percentile(&ttft, 90.0),
        ttft_p99_s: percentile(&ttft, 99.0),
        e2e_p50_s: percentile(&e2e, 50.0),
        e2e_p90_s: percentile(&e2e, 90.0),
        hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        input_tok_s: per_s(prompt as f64 / s),
        output_tok_s: per_s(output as f64 / s),
        completed_rps: per_s(ok.len() as f64),
        span_s: span,
        per_endpoint,
        error_kinds,
    }
}

/// A progress bar for `n` requests labelled `label` (hidden when stderr is not a terminal).
pub fn progress_bar(n: usize, label: &str) -> ProgressBar {
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>32} [{bar:30}] {pos}/{len} {elapsed_precise}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(label.to_string());
    pb
}

/// An HTTP client for load: no proxy, no pool limit, connections kept alive.
pub fn client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_are_deterministic_and_at_rate() {
        let a = poisson_arrivals(42, 10.0, 1_000.0, 100_000);
        assert_eq!(a, poisson_arrivals(42, 10.0, 1_000.0, 100_000));
        assert_ne!(a, poisson_arrivals(43, 10.0, 1_000.0, 100_000));
        // ≈ 10,000 arrivals (sd 100), increasing, inside the window.
        assert!((9_600..10_400).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a.iter().all(|&t| (0.0..1_000.0).contains(&t)));
        // Inter-arrival times are exponential: mean 0.1 s, P(gap > 0.1) ≈ e^-1.
        let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((0.095..0.105).contains(&mean), "{mean}");
        let over = gaps.iter().filter(|&&g| g > 0.1).count() as f64 / gaps.len() as f64;
        assert!((0.34..0.40).contains(&over), "{over}");
        // The bound on count and the degenerate cases.
        assert_eq!(poisson_arrivals(42, 10.0, 1_000.0, 5), a[..5]);
        assert!(poisson_arrivals(1, 0.0, 10.0, 10).is_empty());
    }

    #[test]
    fn finds_usage_in_last_chunk() {
        let buf = b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";
        assert_eq!(find_usage(buf), Some((10, 8, 2)));
        assert_eq!(find_usage(b"data: {\"usage\":null}\n"), None);
        assert_eq!(find_usage(b"data: {\"choices\":[]}\n"), None);
    }

    #[test]
    fn summary_figures() {
        let rec = |i: usize, ok: bool, ttft: f64, cached: usize| Record {
            index: i,
            ok,
            scheduled_s: i as f64,
            ttft_s: Some(ttft),
            e2e_s: Some(1.0),
            prompt_tokens: 100,
            cached_tokens: cached,
            completion_tokens: 10,
            error: (!ok).then(|| "timeout".into()),
            ..Default::default()
        };
        let rs: Vec<Record> = (0..10)
            .map(|i| rec(i, i != 9, i as f64 / 10.0, if i % 2 == 0 { 100 } else { 0 }))
            .collect();
        let s = summarize(&rs, 0.5);
        assert_eq!((s.completed, s.errors), (9, 1));
        assert_eq!(s.ttft_p50_s, 0.4);
        assert_eq!(s.ttft_p90_s, 0.8);
        assert!((s.hit_rate - 5.0 / 9.0).abs() < 1e-9);
        // span 0..10 s; 9 × 100 tokens / 0.5 scale / 10 s.
        assert!((s.input_tok_s - 180.0).abs() < 1e-9, "{}", s.input_tok_s);
        assert_eq!(s.error_kinds, vec!["timeout".to_string()]);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}

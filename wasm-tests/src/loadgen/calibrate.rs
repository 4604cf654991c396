//! Calibration of R_peak (`peakPrefillThroughput`), following llm-d's recipe: send, one at a
//! time, `warmup` and then `requests` streaming `/v1/completions` requests whose prompt is
//! exactly `chunk` random token ids (`max_tokens` 1), so every request is a full cold prefill
//! of one scheduler chunk; R_peak = chunk / median TTFT. τ = R_peak × the TTFT tolerance.
//!
//! The prompt is a token-id array (ids 100..10000, as llm-d's job uses), which vLLM and SGLang
//! take as-is, so "chunk tokens" is exact without knowing the model's tokenizer (the simulated
//! fleet counts 4 bytes per id: one token each). The ids come from a generator seeded from
//! the clock and the process id and drawn afresh for every request: two requests share a
//! 16-token block with probability about 9,900^-16, so the server's prefix cache never hits,
//! in this run or against an earlier one. `chunk` should equal the server's
//! `--max-num-batched-tokens`, so one request is one prefill step.
//!
//! TTFT is measured, as in [`super::send`], at the first response body byte (with
//! `max_tokens` 1 that is the chunk carrying the only token).

use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::json;

/// Token ids are drawn from this range (llm-d's calibration job uses the same).
pub const TOKEN_IDS: std::ops::Range<u32> = 100..10_000;

/// What to send.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Full `/v1/completions` URL.
    pub url: String,
    pub model: String,
    /// Prompt tokens per request (the server's `--max-num-batched-tokens`).
    pub chunk: usize,
    pub warmup: usize,
    pub requests: usize,
    /// The TTFT degradation the operator accepts (T_max), ms: τ = R_peak × T_max.
    pub ttft_tolerance_ms: f64,
    /// Wall seconds per model second (the simulated fleet's time factor; 1 for a real server).
    pub time_factor: f64,
    /// Per-request bound, wall time.
    pub timeout: Duration,
    /// Seed of the token ids (None: from the clock and process id).
    pub seed: Option<u64>,
}

impl Settings {
    /// The recipe's defaults for `url` and `model`: 8,192-token chunks, 5 warm-up and 20
    /// measured requests, T_max 18 s.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            model: model.into(),
            chunk: 8192,
            warmup: 5,
            requests: 20,
            ttft_tolerance_ms: 18_000.0,
            time_factor: 1.0,
            timeout: Duration::from_secs(120),
            seed: None,
        }
    }
}

/// The measurement and what follows from it.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    pub chunk: usize,
    /// Measured TTFTs (model seconds), warm-up excluded, in order.
    pub ttft_s: Vec<f64>,
    pub median_ttft_s: f64,
    /// chunk / median TTFT, tokens per second (rounded).
    pub peak_prefill_throughput: f64,
    pub ttft_tolerance_ms: f64,
    /// R_peak × T_max, tokens (rounded down).
    pub tau: u64,
    /// `usage.prompt_tokens` the server reported, when it did (should equal `chunk`).
    pub reported_prompt_tokens: Option<usize>,
    /// Largest `usage.prompt_tokens_details.cached_tokens` seen (should be 0).
    pub max_cached_tokens: usize,
}

impl Calibration {
    /// From measured TTFTs (model seconds).
    pub fn from_ttfts(chunk: usize, ttft_s: Vec<f64>, ttft_tolerance_ms: f64) -> Self {
        let median_ttft_s = median(&ttft_s);
        let peak = if median_ttft_s > 0.0 {
            (chunk as f64 / median_ttft_s).round()
        } else {
            0.0
        };
        Self {
            chunk,
            ttft_s,
            median_ttft_s,
            peak_prefill_throughput: peak,
            ttft_tolerance_ms,
            tau: (peak * ttft_tolerance_ms / 1000.0).floor() as u64,
            reported_prompt_tokens: None,
            max_cached_tokens: 0,
        }
    }

    /// The plugin configuration fields this calibration sets.
    pub fn config_snippet(&self) -> serde_json::Value {
        // Whole numbers print without a fraction.
        let num = |v: f64| {
            if v.fract() == 0.0 && v.abs() < 9e15 {
                json!(v as i64)
            } else {
                json!(v)
            }
        };
        json!({
            "peakPrefillThroughput": num(self.peak_prefill_throughput),
            "maxTTFTPenaltyMs": num(self.ttft_tolerance_ms),
        })
    }

    /// The human-readable result.
    pub fn report(&self) -> String {
        let (lo, hi) = self
            .ttft_s
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &t| {
                (lo.min(t), hi.max(t))
            });
        let mut out = format!(
            "median TTFT   {:.4} s  (min {:.4}, max {:.4}, {} requests of {} tokens)\n\
             R_peak        {} tokens/s  (= {} / median TTFT)\n\
             tau           {} tokens  (= R_peak x {} ms)\n",
            self.median_ttft_s,
            lo,
            hi,
            self.ttft_s.len(),
            self.chunk,
            self.peak_prefill_throughput,
            self.chunk,
            self.tau,
            self.ttft_tolerance_ms,
        );
        if let Some(p) = self.reported_prompt_tokens.filter(|&p| p != self.chunk) {
            out.push_str(&format!(
                "warning: the server counted {p} prompt tokens, not {}: R_peak is off by that ratio\n",
                self.chunk
            ));
        }
        if self.max_cached_tokens > 0 {
            out.push_str(&format!(
                "warning: the server reported up to {} cached tokens: the prompts were not cold\n",
                self.max_cached_tokens
            ));
        }
        let snippet =
            serde_json::to_string_pretty(&self.config_snippet()).unwrap_or_else(|_| "{}".into());
        out.push_str("plugin configuration:\n");
        out.push_str(&snippet);
        out.push('\n');
        out
    }
}

/// Median (mean of the middle two for an even count; 0 if empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// A request body: `chunk` random token ids, one output token, streamed with usage.
pub fn body(model: &str, rng: &mut impl Rng, chunk: usize) -> String {
    let ids: Vec<u32> = (0..chunk).map(|_| rng.gen_range(TOKEN_IDS)).collect();
    json!({
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// One request's outcome: TTFT in wall seconds and the reported usage (prompt, cached).
struct Sample {
    ttft: Duration,
    usage: Option<(usize, usize)>,
}

async fn send_one(client: &reqwest::Client, s: &Settings, body: String) -> anyhow::Result<Sample> {
    let fut = async {
        let t0 = Instant::now();
        let resp = client
            .post(&s.url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .with_context(|| format!("POST {}", s.url))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let text: String = text.chars().take(300).collect();
            anyhow::bail!("{} answered {status}: {text}", s.url);
        }
        let mut stream = resp.bytes_stream();
        let mut ttft = None;
        let mut all = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.context("reading the stream")?;
            if chunk.is_empty() {
                continue;
            }
            ttft.get_or_insert_with(|| t0.elapsed());
            all.extend_from_slice(&chunk);
        }
        let ttft = ttft.context("empty response")?;
        Ok(Sample {
            ttft,
            usage: usage(&all),
        })
    };
    tokio::time::timeout(s.timeout, fut)
        .await
        .with_context(|| format!("no complete answer within {:?}", s.timeout))?
}

/// (prompt_tokens, cached_tokens) from the stream's usage chunk, if any.
fn usage(stream: &[u8]) -> Option<(usize, usize)> {
    let text = std::str::from_utf8(stream).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|j| j.contains("\"usage\""))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .filter_map(|v| {
            let u = v.get("usage")?;
            let prompt = u.get("prompt_tokens")?.as_u64()? as usize;
            let cached = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0) as usize;
            Some((prompt, cached))
        })
        .next()
}

/// Runs the calibration (requests one at a time). `progress` is called after each request
/// with (done, total, TTFT in model seconds).
pub async fn run(
    client: &reqwest::Client,
    s: &Settings,
    mut progress: impl FnMut(usize, usize, f64),
) -> anyhow::Result<Calibration> {
    anyhow::ensure!(s.chunk > 0, "chunk must be > 0");
    anyhow::ensure!(s.requests > 0, "at least one measured request");
    anyhow::ensure!(
        s.ttft_tolerance_ms.is_finite() && s.ttft_tolerance_ms >= 0.0,
        "TTFT tolerance must be ≥ 0"
    );
    let tf = if s.time_factor > 0.0 {
        s.time_factor
    } else {
        1.0
    };
    let seed = s.seed.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos ^ (u64::from(std::process::id()) << 32)
    });
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let total = s.warmup + s.requests;
    let mut ttfts = Vec::with_capacity(s.requests);
    let mut reported = None;
    let mut max_cached = 0;
    for i in 0..total {
        let sample = send_one(client, s, body(&s.model, &mut rng, s.chunk))
            .await
            .with_context(|| format!("request {} of {total}", i + 1))?;
        let t = sample.ttft.as_secs_f64() / tf;
        if i >= s.warmup {
            ttfts.push(t);
            if let Some((p, c)) = sample.usage {
                reported = Some(p);
                max_cached = max_cached.max(c);
            }
        }
        progress(i + 1, total, t);
    }
    let mut c = Calibration::from_ttfts(s.chunk, ttfts, s.ttft_tolerance_ms);
    c.reported_prompt_tokens = reported;
    c.max_cached_tokens = max_cached;
    Ok(c)
}

/// The first model a server lists at `GET <base>/v1/models`.
pub async fn first_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let url = format!("{}/v1/models", base.trim_end_matches('/'));
    let v: serde_json::Value = client
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .with_context(|| format!("GET {url}"))?
        .error_for_status()?
        .json()
        .await
        .with_context(|| format!("GET {url}: not JSON"))?;
    v.pointer("/data/0/id")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("GET {url}: no model listed (pass --model)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r_peak_and_tau_from_the_median() {
        // Median of 0.40, 0.41, 0.39, 0.60 (an outlier) is 0.405.
        let c = Calibration::from_ttfts(8192, vec![0.40, 0.41, 0.39, 0.60], 18_000.0);
        assert!((c.median_ttft_s - 0.405).abs() < 1e-12);
        assert_eq!(c.peak_prefill_throughput, 20_227.0);
        assert_eq!(c.tau, 364_086);
        assert_eq!(c.config_snippet()["peakPrefillThroughput"], 20_227);
        assert_eq!(c.config_snippet()["maxTTFTPenaltyMs"], 18_000);
        let r = c.report();
        assert!(r.contains("R_peak        20227 tokens/s"), "{r}");
        assert!(r.contains("\"maxTTFTPenaltyMs\": 18000"), "{r}");
        assert!(!r.contains("warning"));
        // llm-d's published calibration: 8192 / 0.5143 s ≈ 15,928 tok/s, τ ≈ 286,704.
        let c = Calibration::from_ttfts(8192, vec![8192.0 / 15_928.0], 18_000.0);
        assert_eq!((c.peak_prefill_throughput, c.tau), (15_928.0, 286_704));
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn bodies_are_exact_and_never_share_a_block() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let a: serde_json::Value = serde_json::from_str(&body("m", &mut rng, 8192)).unwrap();
        let b: serde_json::Value = serde_json::from_str(&body("m", &mut rng, 8192)).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u64> {
            v["prompt"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect()
        };
        let (ia, ib) = (ids(&a), ids(&b));
        assert_eq!(ia.len(), 8192);
        assert!(ia.iter().all(|&t| (100..10_000).contains(&t)));
        assert_ne!(ia[..16], ib[..16]);
        assert_eq!(a["max_tokens"], 1);
        assert_eq!(a["stream"], true);
    }

    #[test]
    fn reads_usage_and_warns() {
        let s = b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":8193,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage(s), Some((8193, 16)));
        assert_eq!(usage(b"data: [DONE]\n"), None);
        let mut c = Calibration::from_ttfts(8192, vec![0.4], 1000.0);
        c.reported_prompt_tokens = Some(8193);
        c.max_cached_tokens = 16;
        let r = c.report();
        assert!(r.contains("counted 8193 prompt tokens") && r.contains("16 cached tokens"));
    }
}

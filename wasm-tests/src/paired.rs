//! Added latency measured the way it holds up on a shared machine: one request at a time to
//! each of two gateways, alternating request by request (the first gateway first in even
//! pairs, the second first in odd ones), each over its own kept-alive connection. Both then
//! see the same moments of the machine's background load; back-to-back runs against one
//! gateway and then the other saw plain Envoy's own median move 2× between runs.

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

/// One gateway's one-request-at-a-time latency.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    pub requests: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Requests that failed or did not answer 200.
    pub errors: u64,
}

/// Both gateways' latency, and the median of the per-pair differences (second − first).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Paired {
    pub first: Latency,
    pub second: Latency,
    pub diff_p50_ms: f64,
}

impl Paired {
    /// Second's median less first's: the figure "added median" means.
    pub fn added_p50_ms(&self) -> f64 {
        self.second.p50_ms - self.first.p50_ms
    }

    pub fn added_p99_ms(&self) -> f64 {
        self.second.p99_ms - self.first.p99_ms
    }
}

/// Quantile `q` of sorted `v` (0 when empty).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    match v.len() {
        0 => 0.0,
        n => v[((n as f64 - 1.0) * q).round() as usize],
    }
}

/// POSTs `body(i)` of pair `i` to both `urls`, `warmup` pairs unmeasured (V8 compiles the
/// module in its baseline tier first and optimises hot functions in the background), then
/// `pairs` measured ones. Timed from send to the end of the response body.
pub async fn measure(
    urls: [&str; 2],
    body: impl Fn(usize) -> Bytes,
    warmup: usize,
    pairs: usize,
) -> anyhow::Result<Paired> {
    let client = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
    };
    let clients = [client()?, client()?];
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut errors = [0u64; 2];
    let mut diffs = Vec::new();
    for i in 0..warmup + pairs {
        let b = body(i);
        let mut got = [None, None];
        for g in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            got[g] = post(&clients[g], urls[g], b.clone()).await;
        }
        if i < warmup {
            continue;
        }
        for (g, ms) in got.iter().enumerate() {
            match ms {
                Some(ms) => times[g].push(*ms),
                None => errors[g] += 1,
            }
        }
        if let [Some(a), Some(b)] = got {
            diffs.push(b - a);
        }
    }
    for v in times.iter_mut().chain([&mut diffs]) {
        v.sort_by(f64::total_cmp);
    }
    let lat = |g: usize| Latency {
        requests: times[g].len(),
        p50_ms: quantile(&times[g], 0.5),
        p99_ms: quantile(&times[g], 0.99),
        errors: errors[g],
    };
    Ok(Paired {
        first: lat(0),
        second: lat(1),
        diff_p50_ms: quantile(&diffs, 0.5),
    })
}

/// One POST in milliseconds; `None` on a failure or a status other than 200.
async fn post(client: &reqwest::Client, url: &str, body: Bytes) -> Option<f64> {
    let t = Instant::now();
    let resp = client.post(url).body(body).send().await.ok()?;
    let ok = resp.status() == reqwest::StatusCode::OK;
    resp.bytes().await.ok()?;
    ok.then(|| t.elapsed().as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_round_to_the_nearest_rank() {
        let v: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 51.0);
        assert_eq!(quantile(&v, 0.99), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}

//! Added latency of the filter: the same Envoy (one worker) with and without tokenaware in
//! front of an instant fleet (time factor 0), one keep-alive connection each, requests
//! alternating between the two gateways; median and p99 per body size. Not part of the test
//! run (it measures, it does not check); run it with
//!
//!     cargo test --release -p wasm-tests --test latency -- --ignored --nocapture
//!
//! `TOKENAWARE_LATENCY_EXTRA='{"routes":["/none"]}'` adds plugin-config fields, e.g. to
//! measure the filter present but not routing.

use std::time::{Duration, Instant};

use serde_json::json;
use wasm_tests::envoy::{repo_root, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, Timing, MODEL};

const N: usize = 2_000;
/// Requests before measuring: V8 first runs the module in its baseline compiler and tiers
/// hot functions up to the optimising one in the background, so early requests are slower.
const WARMUP: usize = 2_000;

fn body(bytes: usize, i: usize) -> String {
    let unit = "Shared system prompt for the latency run. ";
    json!({
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": unit.repeat(bytes / unit.len())},
            {"role": "user", "content": format!("question {i}")}
        ]
    })
    .to_string()
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, run by hand"]
async fn added_latency() {
    let wasm = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    assert!(wasm.is_file(), "build the release .wasm first");
    let fleet = Fleet::start_on_free_ports(FleetConfig {
        endpoints: 3,
        timing: Timing {
            time_factor: 0.0,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let eps = fleet.endpoints();
    let list: Vec<_> = eps.iter().map(|a| json!({ "address": a })).collect();
    // TOKENAWARE_LATENCY_EXTRA: extra plugin-config fields (a JSON object) to measure variants.
    let mut cfg = json!({ "endpoints": list });
    if let Ok(extra) = std::env::var("TOKENAWARE_LATENCY_EXTRA") {
        if let (Some(c), Ok(serde_json::Value::Object(e))) =
            (cfg.as_object_mut(), serde_json::from_str(&extra))
        {
            c.extend(e);
        }
    }
    let cfg = cfg.to_string();
    let mut plain = GatewayConfig::new(eps.clone());
    plain.concurrency = 1;
    let mut filtered = GatewayConfig::new(eps.clone()).with_wasm(wasm, cfg);
    filtered.concurrency = 1;
    let plain = tokio::task::spawn_blocking(move || Envoy::start(plain))
        .await
        .unwrap()
        .unwrap();
    let filtered = tokio::task::spawn_blocking(move || Envoy::start(filtered))
        .await
        .unwrap()
        .unwrap();
    let client = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
    };
    let (cp, cf) = (client(), client());
    for size in [4 * 1024, 220 * 1024] {
        let (mut tp, mut tf) = (Vec::new(), Vec::new());
        for i in 0..N + WARMUP {
            let b = body(size, i);
            for (c, url, out) in [
                (&cp, plain.url("/v1/chat/completions"), &mut tp),
                (&cf, filtered.url("/v1/chat/completions"), &mut tf),
            ] {
                let t = Instant::now();
                let r = c.post(url).body(b.clone()).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let _ = r.bytes().await.unwrap();
                if i >= WARMUP {
                    out.push(t.elapsed());
                }
            }
        }
        let (p50, f50) = (pct(&mut tp, 0.5), pct(&mut tf, 0.5));
        let (p99, f99) = (pct(&mut tp, 0.99), pct(&mut tf, 0.99));
        println!(
            "{:>4} KB body, {N} requests each: plain p50 {p50:.3} ms p99 {p99:.3} ms | filter p50 {f50:.3} ms p99 {f99:.3} ms | added p50 {:.3} ms p99 {:.3} ms",
            size / 1024,
            f50 - p50,
            f99 - p99
        );
    }
    let routed = filtered
        .stat("wasmcustom.tokenaware_requests_routed")
        .unwrap()
        .unwrap_or(0);
    assert_eq!(routed as usize, 2 * (N + WARMUP));
}

//! Added latency of the filter: the same Envoy (one worker) with and without tokenaware in
//! front of an instant fleet (time factor 0), one keep-alive connection each, requests
//! alternating between the two gateways; median and p99 per body size. Not part of the test
//! run (it measures, it does not check); run it with
//!
//!     cargo test --release -p wasm-tests --test latency -- --ignored --nocapture
//!
//! `TOKENAWARE_LATENCY_EXTRA='{"routes":["/none"]}'` adds plugin-config fields, e.g. to
//! measure the filter present but not routing. `TOKENAWARE_LATENCY_BASELINE_WASM=PATH` loads
//! that build (same plugin config) into the first gateway instead of none, e.g. the
//! yardstick filter (`--features overhead-baseline`, `filter::bare`);
//! `TOKENAWARE_LATENCY_WASM=PATH` measures that build instead of the release `.wasm`.
//!
//! Requests alternate between the gateways ([`wasm_tests::paired`]).

use bytes::Bytes;
use serde_json::json;
use wasm_tests::envoy::{repo_root, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, MODEL};
use wasm_tests::paired;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, run by hand"]
async fn added_latency() {
    let variant = ["TOKENAWARE_LATENCY_WASM", "TOKENAWARE_LATENCY_EXTRA"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    let wasm = std::env::var("TOKENAWARE_LATENCY_WASM")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm"));
    assert!(wasm.is_file(), "build the release .wasm first");
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(3, 0.0)).unwrap();
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
    let mut plain = match std::env::var("TOKENAWARE_LATENCY_BASELINE_WASM") {
        Ok(base) => GatewayConfig::new(eps.clone()).with_wasm(base, cfg.clone()),
        Err(_) => GatewayConfig::new(eps.clone()),
    };
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
    let urls = [
        plain.url("/v1/chat/completions"),
        filtered.url("/v1/chat/completions"),
    ];
    for size in [4 * 1024, 220 * 1024] {
        let body = |i| Bytes::from(body(size, i));
        let m = paired::measure([&urls[0], &urls[1]], body, WARMUP, N)
            .await
            .unwrap();
        assert_eq!((m.first.errors, m.second.errors), (0, 0));
        println!(
            "{:>4} KB body, {N} requests each: plain p50 {:.3} ms p99 {:.3} ms | filter p50 {:.3} ms p99 {:.3} ms | added p50 {:.3} ms p99 {:.3} ms (median of pair differences {:.3} ms)",
            size / 1024,
            m.first.p50_ms,
            m.first.p99_ms,
            m.second.p50_ms,
            m.second.p99_ms,
            m.added_p50_ms(),
            m.added_p99_ms(),
            m.diff_p50_ms,
        );
    }
    // The release filter with its default routes routed every request it was sent.
    // Stats reach Envoy on a tick (`statsFlushMs`, 1 s by default).
    let routed = || {
        filtered
            .stat("wasmcustom.tokenaware_requests_routed")
            .unwrap()
            .unwrap_or(0) as usize
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !variant && routed() < 2 * (N + WARMUP) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(variant || routed() == 2 * (N + WARMUP));
}

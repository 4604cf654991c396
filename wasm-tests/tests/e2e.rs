//! End to end: a real Envoy (`--concurrency 2`) with the release `tokenaware.wasm` in front
//! of the simulated fleet. Each test starts its own fleet and Envoy on free ports and checks
//! outcomes only: which endpoint served (`x-fleet-endpoint`), the filter's stats in admin
//! `/stats` (`wasmcustom.tokenaware_*`) and its debug path.
//!
//! Needs the release module (`cargo build -p tokenaware --release --target wasm32-wasip1`;
//! scripts/test.sh builds it first) and Envoy (scripts/setup.sh). Without Envoy the tests
//! are skipped unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use serde_json::{json, Value};
use wasm_tests::envoy::{have_envoy, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, MODEL};

mod support;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_prefix_lands_on_one_endpoint() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let mut by_group: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for q in 0..6 {
        for g in 0..3 {
            let a = gw
                .post(CHAT, chat(&system(g, 40_000), &format!("q{q}")))
                .await;
            assert_eq!(a.status, 200);
            if q > 0 {
                assert!(a.decision.contains("reason=sticky"), "{}", a.decision);
            }
            by_group.entry(g).or_default().insert(a.endpoint);
        }
    }
    for (g, eps) in &by_group {
        assert_eq!(eps.len(), 1, "group {g} spread over {eps:?}");
    }
    assert_eq!(gw.stat("tokenaware_decisions_sticky"), 15);
    // Streaming: usage comes in the last chunk and is counted.
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": system(0, 40_000)}]});
    let a = gw.post(CHAT, body.to_string()).await;
    assert_eq!(a.status, 200);
    let d = gw.debug_until("released", ledger_is_zero).await;
    assert_eq!(d["endpoints"].as_array().unwrap().len(), 3);
    assert!(gw.stat("tokenaware_usage_prompt_tokens") > 10_000 * 18);
    assert!(gw.stat("tokenaware_usage_cached_tokens") > 0);
    assert_eq!(
        gw.stat("tokenaware_requests_routed"),
        gw.stat("tokenaware_requests_released")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_tau_spills_concurrent_load() {
    if !have_envoy() {
        return;
    }
    // τ of 300 tokens; each request brings ~500 uncached tokens (its own question) on top
    // of the shared prefix, so a second request in flight on the warm endpoint breaks it.
    // Sticky-until-saturated takes τ as given (tokenaware would hold it to at least four
    // prompts' worth, which nine requests in flight do not reach); with the absolute gate a
    // broken gate goes to the least queued endpoint (the relative gate's lookahead would
    // still pick the warm one, whose cache discount outweighs its queue).
    let gw = start(FleetConfig::scaled(3, 1.0), |eps| {
        plugin_config(
            eps,
            r#""tau":300,"policy":"sticky-until-saturated","gate":"absolute""#,
        )
    })
    .await;
    let sys = system(7, 32_000);
    let question = |q: usize| format!("question {q}: ").repeat(150);
    let first = gw.post(CHAT, chat(&sys, &question(100))).await;
    assert_eq!(first.status, 200);
    let answers = join_all((0..9).map(|q| gw.post(CHAT, chat(&sys, &question(q))))).await;
    let served: BTreeSet<&str> = answers.iter().map(|a| a.endpoint.as_str()).collect();
    assert!(answers.iter().all(|a| a.status == 200));
    assert!(served.len() >= 2, "no spill: {served:?}");
    assert!(gw.stat("tokenaware_decisions_spill") >= 1);
    assert!(gw.stat("tokenaware_tau_breaks") >= 1);
    gw.debug_until("released", ledger_is_zero).await;
}

/// A streamed `/v1/responses` answer opens, as vLLM's does, with `response.created` and
/// `response.in_progress` before any prefill: learned from its first token (not its first
/// byte), the prefill rate comes out near the fleet's, not at the estimate's cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_responses_stream_is_timed_from_its_first_token() {
    if !have_envoy() {
        return;
    }
    // At the fleet's 20,480 tokens/s, a 5,000-token prompt prefills in about 0.25 s.
    let fleet = FleetConfig::scaled(2, 1.0);
    let truth = fleet.timing.prefill_rate;
    let gw = start(fleet, |eps| {
        plugin_config(eps, r#""peakPrefillThroughput":"auto""#)
    })
    .await;
    // A dozen samples an endpoint: past the eight before an estimate counts as learned.
    for i in 0..24 {
        let body = json!({"model": MODEL, "stream": true, "max_output_tokens": 2,
            "input": [{"role": "user", "content": system(100 + i, 20_000)}]});
        let a = gw.post("/v1/responses", body.to_string()).await;
        assert_eq!(a.status, 200);
        assert!(a.body.starts_with("event: response.created"), "{}", a.body);
        assert!(a.body.contains("event: response.completed"), "{}", a.body);
    }
    let d = gw.debug_until("released", ledger_is_zero).await;
    let rates: Vec<f64> = d["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["estimate"]["learned"] == true)
        .filter_map(|e| e["estimate"]["prefillTokensPerS"].as_f64())
        .collect();
    assert!(!rates.is_empty(), "no endpoint learned: {d}");
    // Timed from the opening events, every sample read as a whole prefill in a millisecond
    // or two, and the rate ran to its cap (16 times the default 15,928).
    assert!(
        rates.iter().all(|&r| r < 2.0 * truth),
        "learned {rates:?} against the fleet's {truth}"
    );
    assert!(gw.stat("tokenaware_usage_prompt_tokens") > 24 * 4_000);
    assert_eq!(
        gw.stat("tokenaware_requests_routed"),
        gw.stat("tokenaware_requests_released")
    );
}

/// One raw HTTP/1.1 request (so header names keep their case and can repeat).
fn raw(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let served = text
        .lines()
        .find_map(|l| l.strip_prefix("x-fleet-endpoint: "))
        .unwrap_or("")
        .trim()
        .to_string();
    (status, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_destination_header_is_ignored() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let eps = gw.fleet.endpoints();
    let sys = system(3, 20_000);
    let pick = gw.post(CHAT, chat(&sys, "warm")).await.endpoint;
    let other = eps.iter().find(|e| **e != pick).unwrap().clone();
    let port = gw.envoy.listen_port();
    let body = chat(&sys, "again");
    let tries: [&[(&str, &str)]; 3] = [
        &[(DEST, &other)],
        &[(DEST, &other), (DEST, &other)],
        &[
            ("X-Gateway-Destination-Endpoint", &other),
            ("x-GATEWAY-destination-endpoint", &other),
        ],
    ];
    for headers in tries {
        let (status, served) = tokio::task::spawn_blocking({
            let (h, b): (Vec<(String, String)>, String) = (
                headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                body.clone(),
            );
            move || {
                let h: Vec<(&str, &str)> =
                    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                raw(port, "POST", CHAT, &h, &b)
            }
        })
        .await
        .unwrap();
        assert_eq!(status, 200);
        assert_eq!(served, pick, "client header {headers:?} chose the upstream");
    }
    // Not an inference route: still stripped, so Envoy's round robin picks, not the client.
    let mut served = BTreeSet::new();
    for _ in 0..6 {
        let other = other.clone();
        let (status, ep) = tokio::task::spawn_blocking(move || {
            raw(port, "GET", "/v1/models", &[(DEST, &other)], "")
        })
        .await
        .unwrap();
        assert_eq!(status, 200);
        served.insert(ep);
    }
    assert!(
        served.len() > 1,
        "GET /v1/models followed the client header: {served:?}"
    );
    assert_eq!(gw.stat("tokenaware_client_header_stripped"), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_and_huge_bodies_are_served_through_the_fallback() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| {
        plugin_config(eps, r#""maxBodyBytes":65536"#)
    })
    .await;
    // Bodies the filter cannot route but the server serves.
    let no_model = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let a = gw.post(CHAT, no_model.to_string()).await;
    assert_eq!(
        (a.status, a.decision.as_str()),
        (200, "reason=fallback; why=no_model")
    );
    let bad_stream =
        json!({"model": MODEL, "stream": "yes", "messages": [{"role": "user", "content": "hi"}]});
    let a = gw.post(CHAT, bad_stream.to_string()).await;
    assert_eq!(
        (a.status, a.decision.as_str()),
        (200, "reason=fallback; why=wrong_type")
    );
    // Not JSON at all: the server's own 400 comes back (it was reached), no 5xx, no hang.
    let a = gw.post(CHAT, "{this is not json".into()).await;
    assert_eq!(a.status, 400);
    assert!(!a.endpoint.is_empty());
    assert_eq!(a.decision, "reason=fallback; why=not_json");
    // Over maxBodyBytes, under Envoy's 8 MiB buffer: with a content-length ...
    let huge = chat(&system(1, 300_000), "q");
    let a = gw.post(CHAT, huge.clone()).await;
    assert_eq!(
        (a.status, a.decision.as_str()),
        (200, "reason=fallback; why=too_large")
    );
    // ... and chunked, so the limit trips while buffering.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = huge
        .as_bytes()
        .chunks(16 * 1024)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let t0 = Instant::now();
    let r = gw
        .http
        .post(gw.envoy.url(CHAT))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    let a = answer(r, t0).await;
    assert_eq!(
        (a.status, a.decision.as_str()),
        (200, "reason=fallback; why=too_large")
    );
    for (name, n) in [
        ("tokenaware_fallback_no_model", 1),
        ("tokenaware_fallback_wrong_type", 1),
        ("tokenaware_fallback_not_json", 1),
        ("tokenaware_fallback_too_large", 2),
        ("tokenaware_requests_routed", 0),
    ] {
        assert_eq!(gw.stat(name), n, "{name}");
    }
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_endpoint_is_avoided() {
    if !have_envoy() {
        return;
    }
    let dead_fleet = || {
        let mut f = FleetConfig::scaled(3, 0.01);
        f.dead = vec![1];
        f
    };
    // Without polls the filter cannot know: its picks of the dead endpoint fail over to the
    // fallbacks it lists in the header (Envoy retries connect failures).
    let gw = start(dead_fleet(), |eps| plugin_config(eps, "")).await;
    let dead = gw.fleet.endpoints()[1].clone();
    let mut picked_dead = 0;
    for g in 0..20 {
        let a = gw.post(CHAT, chat(&system(10 + g, 4_000), "q")).await;
        assert_eq!(a.status, 200);
        assert_ne!(a.endpoint, dead);
        picked_dead += usize::from(a.decision.contains(&dead));
    }
    assert!(
        picked_dead > 0,
        "cold placement never picked the dead endpoint"
    );
    assert!(gw.envoy_stat("cluster.models.upstream_rq_retry") >= picked_dead as i64);
    // The filter saw who answered and did not record the dead endpoint as warm.
    assert_eq!(gw.stat("tokenaware_served_by_fallback"), picked_dead as i64);
    drop(gw);
    // With polls it is taken out of rotation.
    let gw = start(dead_fleet(), |eps| plugin_config(eps, POLL)).await;
    let dead = gw.fleet.endpoints()[1].clone();
    gw.debug_until("the dead endpoint out of rotation", |d| {
        endpoint_of(d, &dead)["healthy"] == false
    })
    .await;
    // Polls keep probing the dead endpoint (connect failures), but no request retries.
    let retries = gw.envoy_stat("cluster.models.upstream_rq_retry");
    for g in 0..12 {
        let a = gw.post(CHAT, chat(&system(100 + g, 4_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(!a.decision.contains(&dead), "{}", a.decision);
    }
    assert_eq!(
        gw.envoy_stat("cluster.models.upstream_rq_retry"),
        retries,
        "a request was sent to the dead endpoint and retried"
    );
    assert!(gw.stat("tokenaware_polls_failed") >= 2);
    assert!(gw.stat("tokenaware_polls_ok") >= 4);
}

fn waiting(n: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{MODEL}\"}} {n}.0\nvllm:num_requests_running{{model_name=\"{MODEL}\"}} 1.0\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polls_reach_each_endpoint_through_override_host() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, POLL)).await;
    let eps = gw.fleet.endpoints();
    // Each endpoint reports its own queue length; the poll of endpoint X, sent to the
    // `models` cluster with `x-gateway-destination-endpoint: X`, must read X's number.
    for (i, ep) in eps.iter().enumerate() {
        gw.fleet_control(ep, "metrics-override", &waiting(11 * (i as u32 + 1)))
            .await;
    }
    let d = gw
        .debug_until("every endpoint's own scrape", |d| {
            eps.iter().enumerate().all(|(i, ep)| {
                endpoint_of(d, ep)["waiting"].as_f64() == Some(11.0 * (i as f64 + 1.0))
            })
        })
        .await;
    for ep in &eps {
        assert!(endpoint_of(&d, ep)["scrapedAtMs"].as_u64().unwrap() > 0);
    }
    // One poller per Envoy process, not one per VM: three VMs tick (main + 2 workers), but
    // polls grow by about one per endpoint and interval.
    let before = gw.stat("tokenaware_polls_ok");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let per_second = gw.stat("tokenaware_polls_ok") - before;
    assert!(
        (15..=40).contains(&per_second),
        "{per_second} polls in 1 s for 3 endpoints every 100 ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polled_metrics_move_load_off_a_busy_endpoint() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| {
        plugin_config(eps, &format!("{POLL},\"tau\":50000"))
    })
    .await;
    let sys = system(5, 40_000);
    let warm = gw.post(CHAT, chat(&sys, "warm")).await.endpoint;
    let a = gw.post(CHAT, chat(&sys, "again")).await;
    assert_eq!(a.endpoint, warm);
    assert!(a.decision.contains("reason=sticky"));
    // The warm endpoint reports a long queue (as if other gateways filled it).
    gw.fleet_control(&warm, "metrics-override", &waiting(500))
        .await;
    gw.debug_until("the queue scraped", |d| {
        endpoint_of(d, &warm)["waiting"].as_f64() == Some(500.0)
    })
    .await;
    let a = gw.post(CHAT, chat(&sys, "busy")).await;
    assert_eq!(a.status, 200);
    assert_ne!(
        a.endpoint, warm,
        "still sent to the busy endpoint: {}",
        a.decision
    );
    assert!(a.decision.contains("reason=spill"), "{}", a.decision);
    // Queue gone: back to the warm endpoint.
    gw.fleet_control(&warm, "metrics-override", "").await;
    gw.debug_until("the queue cleared", |d| {
        endpoint_of(d, &warm)["waiting"].as_f64() == Some(0.0)
    })
    .await;
    // The spill made a second warm replica: the prefix now sticks to one of the two.
    let spilled = a.endpoint;
    let a = gw.post(CHAT, chat(&sys, "calm")).await;
    assert!(a.decision.contains("reason=sticky"), "{}", a.decision);
    assert!(
        a.endpoint == warm || a.endpoint == spilled,
        "{}",
        a.decision
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_workers_share_the_tables() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.05), |eps| plugin_config(eps, "")).await;
    assert_eq!(gw.envoy.config().concurrency, 2);
    // A new connection per request, so both workers serve requests.
    let fresh = reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let url = gw.envoy.url(CHAT);
    let groups = 4;
    for g in 0..groups {
        assert_eq!(
            gw.post(CHAT, chat(&system(20 + g, 24_000), "warm"))
                .await
                .status,
            200
        );
    }
    let reqs = (0..groups * 10).map(|i| {
        let (fresh, url) = (fresh.clone(), url.clone());
        let body = chat(&system(20 + i % groups, 24_000), &format!("q{i}"));
        async move {
            let t0 = Instant::now();
            let r = fresh.post(url).body(body).send().await.unwrap();
            (i % groups, answer(r, t0).await)
        }
    });
    let handles: Vec<_> = reqs.map(tokio::spawn).collect();
    let mut by_group: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for h in handles {
        let (g, a) = h.await.unwrap();
        assert_eq!(a.status, 200);
        by_group.entry(g).or_default().insert(a.endpoint);
    }
    for (g, eps) in &by_group {
        assert_eq!(eps.len(), 1, "group {g} spread over {eps:?}");
    }
    // Both workers took part, and every dispatch was released.
    let workers = (0..2)
        .map(|w| {
            gw.envoy_stat(&format!(
                "listener.127.0.0.1_{}.worker_{w}.downstream_cx_total",
                gw.envoy.listen_port()
            ))
        })
        .collect::<Vec<_>>();
    assert!(
        workers.iter().all(|n| *n > 0),
        "connections per worker: {workers:?}"
    );
    gw.debug_until("the ledger back to zero", ledger_is_zero)
        .await;
    assert_eq!(gw.stat("tokenaware_requests_routed"), 44);
    assert_eq!(gw.stat("tokenaware_requests_released"), 44);
    assert_eq!(gw.stat("tokenaware_release_errors"), 0);
    // Each VM (both workers and the main thread) reports its linear memory on its tick, and
    // the gauges show them summed once each.
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw.stat("tokenaware_vms") < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (vms, total, max) = (
        gw.stat("tokenaware_vms"),
        gw.stat("tokenaware_vm_memory_bytes"),
        gw.stat("tokenaware_vm_memory_max_bytes"),
    );
    assert_eq!(vms, 3, "VMs reporting");
    assert!(
        max > 0 && max % 65_536 == 0 && total >= max && total <= vms * max,
        "linear memory: total {total}, largest {max}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_resets_release_the_ledger() {
    if !have_envoy() {
        return;
    }
    // Half real time: a 40k-token cold prompt prefills for ~1 s, 400 tokens decode for 1 s.
    let gw = start(FleetConfig::scaled(3, 0.5), |eps| plugin_config(eps, "")).await;
    let port = gw.envoy.listen_port();
    let stream = |g: usize, max_tokens: u32| {
        json!({"model": MODEL, "stream": true, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": system(40 + g, 160_000)}]})
        .to_string()
    };
    // Gone while the prompt is still queued or prefilling (before any response byte), and
    // gone in the middle of the streamed answer.
    let (early, late) = (stream(0, 400), stream(1, 400));
    let warm = gw.post(CHAT, stream(1, 1)).await;
    assert_eq!(warm.status, 200);
    tokio::task::spawn_blocking(move || {
        let send = |body: &str| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
            let req = format!(
                "POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).unwrap();
            s
        };
        let s = send(&early);
        std::thread::sleep(Duration::from_millis(300));
        drop(s);
        let mut s = send(&late);
        let mut buf = [0u8; 4096];
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "closed before the first chunk");
            seen.extend_from_slice(&buf[..n]);
        }
        drop(s);
    })
    .await
    .unwrap();
    let d = gw
        .debug_until("the ledger back to zero", ledger_is_zero)
        .await;
    assert!(d["endpoints"].as_array().unwrap().len() == 3);
    assert_eq!(gw.stat("tokenaware_requests_routed"), 3);
    assert_eq!(gw.stat("tokenaware_requests_released"), 3);
    // The one reset before its first byte rolled its index insert back.
    assert_eq!(gw.stat("tokenaware_requests_failed_early"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn discovery_from_envoy_admin() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |_| {
        json!({
            "discovery": {"adminCluster": "admin", "modelCluster": "models", "intervalMs": 200},
            "decisionHeader": true,
            "debugPath": DEBUG,
            "statsFlushMs": 0,
        })
        .to_string()
    })
    .await;
    let eps: BTreeSet<String> = gw.fleet.endpoints().into_iter().collect();
    let d = gw
        .debug_until("three endpoints discovered", |d| {
            d["endpoints"].as_array().unwrap().len() == 3
        })
        .await;
    let found: BTreeSet<String> = d["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["address"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(found, eps);
    let sys = system(30, 20_000);
    let first = gw.post(CHAT, chat(&sys, "a")).await;
    assert!(first.decision.contains("reason=cold"), "{}", first.decision);
    let again = gw.post(CHAT, chat(&sys, "b")).await;
    assert_eq!(again.endpoint, first.endpoint);
    assert!(gw.stat("tokenaware_discovery_ok") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn invalid_plugin_config_is_refused_and_the_log_names_the_field() {
    if !have_envoy() {
        return;
    }
    let wasm = wasm_path();
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(1, 0.01)).unwrap();
    let cfg = GatewayConfig::new(fleet.endpoints()).with_wasm(
        wasm,
        r#"{"endpoints":[{"address":"127.0.0.1:1"}],"affinityThreshold":7}"#,
    );
    let r = tokio::task::spawn_blocking(move || Envoy::start(cfg))
        .await
        .unwrap();
    let Err(e) = r else {
        panic!("Envoy started with an invalid plugin config");
    };
    let e = format!("{e:#}");
    assert!(e.contains("exited early"), "{e}");
    assert!(e.contains("field `affinityThreshold`"), "{e}");
}

/// Two replicas named to each other as `peers`: a prefix placed through one is warm on the
/// other before it first sends it, on the same endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_named_as_peers_send_a_prefix_where_the_other_placed_it() {
    if !have_envoy() {
        return;
    }
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(4, 0.01)).unwrap();
    let eps = fleet.endpoints();
    let ports = wasm_tests::ports::free_ports(2).unwrap();
    let mut envoys = Vec::new();
    // One replica has the token inline, the other reads it from its VM's environment.
    let token = "e2e-replicas-token-7c1d";
    let inline = format!(r#""peers":{{"clusters":["peer"],"intervalMs":100,"token":"{token}"}}"#);
    let by_env = r#""peers":{"clusters":["peer"],"intervalMs":100,"tokenEnv":"PEER_TOKEN"}"#;
    for (me, other, peers) in [
        (ports[0], ports[1], &inline[..]),
        (ports[1], ports[0], by_env),
    ] {
        let mut cfg =
            GatewayConfig::new(eps.clone()).with_wasm(wasm_path(), plugin_config(&eps, peers));
        cfg.listen_port = me;
        cfg.peer_clusters = vec![("peer".into(), format!("127.0.0.1:{other}"))];
        cfg.vm_env = vec![("PEER_TOKEN".into(), token.into())];
        envoys.push(spawn_envoy(cfg).await);
    }
    let http = client();
    let (a, b) = (&envoys[0], &envoys[1]);
    for g in 0..4 {
        let first = post_chat(&http, a, chat(&system(g, 40_000), "q0")).await;
        assert_eq!(first.status, 200);
        assert!(first.decision.contains("reason=cold"), "{}", first.decision);
        wait_for_stat(b, "peer_placements_learned", g as i64 + 1).await;
        let second = post_chat(&http, b, chat(&system(g, 40_000), "q1")).await;
        assert_eq!(second.status, 200);
        assert!(
            second.decision.contains("reason=sticky"),
            "{}",
            second.decision
        );
        assert_eq!(second.endpoint, first.endpoint, "group {g}");
    }
    // A client without the token reads nothing.
    let refused = http
        .get(a.url("/tokenaware/peers?since=0"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    assert!(!refused.text().await.unwrap().contains("placements"));
    assert_eq!(
        a.stat("wasmcustom.tokenaware_peer_requests_refused")
            .unwrap()
            .unwrap_or(0),
        1
    );
    // What a peer reads: addresses and hashes, never prompt text.
    let text = http
        .get(a.url("/tokenaware/peers?since=0"))
        .header("x-tokenaware-peer-token", token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["next"], 4);
    let d = get_json(&http, a.url(DEBUG), &[]).await;
    assert_eq!(d["placementsShared"], 4);
    assert!(!text.contains("meticulous"));
    assert_eq!(
        b.stat("wasmcustom.tokenaware_peer_polls_failed")
            .unwrap()
            .unwrap_or(0),
        0
    );
    drop(envoys);
    drop(fleet);
}

/// Posts a chat body to `e`.
async fn post_chat(http: &reqwest::Client, e: &Envoy, body: String) -> Answer {
    let req = http
        .post(e.url(CHAT))
        .header("content-type", "application/json")
        .body(body);
    let t0 = Instant::now();
    answer(req.send().await.unwrap(), t0).await
}

/// GETs `url` with `headers` and reads the answer as JSON.
async fn get_json(http: &reqwest::Client, url: String, headers: &[(&str, &str)]) -> Value {
    let mut req = http.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap().json().await.unwrap()
}

/// Waits, at most 15 s, until `e`'s counter `tokenaware_{name}` reaches `at_least`.
async fn wait_for_stat(e: &Envoy, name: &str, at_least: i64) {
    let full = format!("wasmcustom.tokenaware_{name}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while e.stat(&full).unwrap().unwrap_or(0) < at_least {
        assert!(Instant::now() < deadline, "{full} never reached {at_least}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Replicas named as the hosts of one cluster (as DNS of a headless Service gives them):
/// each reads the hosts from its admin, asks the others pinned by the override header,
/// and leaves itself out once its own ring comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_read_from_one_cluster_learn_each_others_placements() {
    if !have_envoy() {
        return;
    }
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(4, 0.01)).unwrap();
    let eps = fleet.endpoints();
    let ports = wasm_tests::ports::free_ports(2).unwrap();
    let replicas: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let peers = r#""peers":{"cluster":"replicas","adminCluster":"admin","intervalMs":100,"token":"e2e-replicas-token-7c1d"}"#;
    let mut envoys = Vec::new();
    for &me in &ports {
        let mut cfg =
            GatewayConfig::new(eps.clone()).with_wasm(wasm_path(), plugin_config(&eps, peers));
        cfg.listen_port = me;
        cfg.peer_group = Some(("replicas".into(), replicas.clone()));
        envoys.push(spawn_envoy(cfg).await);
    }
    let http = client();
    let stat = |e: &Envoy, n: &str| {
        e.stat(&format!("wasmcustom.tokenaware_{n}"))
            .unwrap()
            .unwrap_or(0)
    };
    let (a, b) = (&envoys[0], &envoys[1]);
    for (g, (from, to)) in [(a, b), (b, a)].into_iter().enumerate() {
        // The second group's first request is streamed: its placement is told to the peer
        // once the endpoint's answer begins, not at the decision.
        let mut body: Value = serde_json::from_str(&chat(&system(g, 40_000), "q0")).unwrap();
        body["stream"] = json!(g == 1);
        let first = post_chat(&http, from, body.to_string()).await;
        assert!(first.decision.contains("reason=cold"), "{}", first.decision);
        wait_for_stat(to, "peer_placements_learned", 1).await;
        let second = post_chat(&http, to, chat(&system(g, 40_000), "q1")).await;
        assert!(
            second.decision.contains("reason=sticky"),
            "{}",
            second.decision
        );
        assert_eq!(second.endpoint, first.endpoint, "group {g}");
    }
    // Each has placed a prefix of its own, so each has found itself among the hosts.
    let deadline = Instant::now() + Duration::from_secs(15);
    while stat(a, "peers") != 1 || stat(b, "peers") != 1 {
        assert!(Instant::now() < deadline, "a replica still asks itself");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Polls fail only while the other replica was still starting.
    let failed = |e| stat(e, "peer_polls_failed");
    let before = failed(a) + failed(b);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(failed(a) + failed(b), before);
    assert!(stat(a, "peer_polls_ok") + stat(b, "peer_polls_ok") >= 10);
    drop(envoys);
    drop(fleet);
}

/// A peer that is down costs nothing but counted failed polls: requests route as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_that_is_down_only_counts_failed_polls() {
    if !have_envoy() {
        return;
    }
    let dead = wasm_tests::ports::free_ports(1).unwrap()[0];
    let peers = r#""peers":{"clusters":["peer"],"intervalMs":50,"timeoutMs":200,"token":"e2e-replicas-token-7c1d"}"#;
    let gw = start_with(
        FleetConfig::scaled(3, 0.01),
        wasm_path(),
        |mut cfg| {
            cfg.peer_clusters = vec![("peer".into(), format!("127.0.0.1:{dead}"))];
            cfg
        },
        |eps| plugin_config(eps, peers),
    )
    .await;
    let stat = |n: &str| gw.envoy_stat(&format!("wasmcustom.tokenaware_{n}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while stat("peer_polls_failed") < 3 {
        assert!(Instant::now() < deadline, "no failed peer poll counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut served = BTreeSet::new();
    for q in 0..4 {
        let a = gw
            .post(CHAT, chat(&system(7, 20_000), &format!("q{q}")))
            .await;
        assert_eq!(a.status, 200);
        served.insert(a.endpoint);
    }
    assert_eq!(
        served.len(),
        1,
        "the prefix stays on one endpoint: {served:?}"
    );
    assert_eq!(stat("decisions_sticky"), 3);
    assert_eq!(stat("peer_polls_ok"), 0);
    assert_eq!(stat("peer_placements_shared"), 1);
}

/// A placement told to the peers at the decision (an answer not streamed) whose request the
/// picked endpoint never saw (dead: Envoy retried it on a fallback) is taken back before a
/// peer reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_placement_served_by_a_fallback_is_taken_back_from_the_peers() {
    if !have_envoy() {
        return;
    }
    let mut f = FleetConfig::scaled(3, 0.01);
    f.dead = vec![1];
    let token = "e2e-replicas-token-7c1d";
    // The peer is never there and is polled once a minute: only this replica's ring matters.
    let nobody = wasm_tests::ports::free_ports(1).unwrap()[0];
    let peers = format!(r#""peers":{{"clusters":["peer"],"intervalMs":60000,"token":"{token}"}}"#);
    let gw = start_with(
        f,
        wasm_path(),
        |mut cfg| {
            cfg.peer_clusters = vec![("peer".into(), format!("127.0.0.1:{nobody}"))];
            cfg
        },
        |eps| plugin_config(eps, &peers),
    )
    .await;
    let dead = gw.fleet.endpoints()[1].clone();
    let mut picked_dead = 0;
    for g in 0..12 {
        let a = gw.post(CHAT, chat(&system(40 + g, 4_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(a.decision.contains("reason=cold"), "{}", a.decision);
        picked_dead += usize::from(a.decision.contains(&dead));
    }
    assert!(
        picked_dead > 0,
        "cold placement never picked the dead endpoint"
    );
    let stat = |n: &str| gw.envoy_stat(&format!("wasmcustom.tokenaware_{n}"));
    assert_eq!(stat("served_by_fallback"), picked_dead as i64);
    assert_eq!(stat("peer_placements_shared"), 12);
    assert_eq!(stat("peer_placements_withdrawn"), picked_dead as i64);
    // What a peer reads: the placements on live endpoints alone.
    let url = gw.envoy.url("/tokenaware/peers?since=0");
    let v = get_json(&gw.http, url, &[("x-tokenaware-peer-token", token)]).await;
    let told = v["placements"].as_array().unwrap();
    assert_eq!(told.len(), 12 - picked_dead, "{v}");
    assert!(told.iter().all(|p| p["endpoint"] != dead.as_str()), "{v}");
    assert_eq!(v["next"], 12);
}

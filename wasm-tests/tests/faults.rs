//! Faults under load, through a real Envoy (`--concurrency 2` unless said) in front of the
//! simulated fleet, with the release `tokenaware.wasm`. The bar for each: no request lost
//! beyond those in flight on a killed endpoint, no 5xx caused by the filter, and the ledger
//! back to zero afterwards (debug view and `routed == released` in admin `/stats`).
//!
//! Needs the release module and Envoy (see e2e.rs); the trap test builds its own module with
//! the `fault-injection` feature into target/fault-injection.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;
use wasm_tests::envoy::{have_envoy, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, MODEL};
use wasm_tests::ports::free_port;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_endpoint_loses_only_its_in_flight_requests_and_traffic_moves_away() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.05), |eps| plugin_config(eps, POLL)).await;
    let eps = gw.fleet.endpoints();
    // Six workers; the last two stream (a stream cut after its first byte cannot be retried).
    let workers = 6;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(closed_loop(
        gw.envoy.url(CHAT),
        workers,
        500,
        stop.clone(),
        |w, i| {
            if w < 4 {
                chat(&system(w, 12_000), &format!("q{i}"))
            } else {
                json!({"model": MODEL, "stream": true, "max_tokens": 40,
                    "messages": [{"role": "system", "content": system(w, 12_000)},
                                 {"role": "user", "content": format!("q{i}")}]})
                .to_string()
            }
        },
    ));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // Kill the endpoint that served most so far (it holds warm prefixes).
    let dead = eps[1].clone();
    let killed_at = Instant::now();
    gw.fleet.kill(1).unwrap();
    gw.debug_until("the killed endpoint out of rotation", |d| {
        endpoint_of(d, &dead)["healthy"] == false
    })
    .await;
    let detected = killed_at.elapsed();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, Ordering::Relaxed);
    let r = load.await.unwrap();
    let total = r.answers.len() + r.errors.len();
    // Lost: an error status, or a body cut short (no usage / no [DONE]).
    let complete = |a: &Answer| {
        a.body.contains("\"usage\"") && (!a.body.starts_with("data:") || a.body.contains("[DONE]"))
    };
    let bad: Vec<_> = r
        .answers
        .iter()
        .filter(|a| a.status != 200 || !complete(a))
        .collect();
    let streams = r.count(|a| a.body.starts_with("data:"));
    assert!(streams > 5, "{streams} streams");
    eprintln!(
        "{total} requests, {} lost (error status or cut stream), {} transport errors; dead detected after {detected:?}",
        bad.len(),
        r.errors.len()
    );
    assert!(total > 50, "too little load: {total}");
    // At most the requests in flight on the killed endpoint (one per worker) may be lost;
    // Envoy retries resets on the fallbacks the filter listed, so usually none are.
    assert!(
        bad.len() + r.errors.len() <= workers,
        "lost {bad:?} {:?}",
        r.errors
    );
    // After detection, nothing is routed to the dead endpoint.
    let after: Vec<_> = r
        .answers
        .iter()
        .filter(|a| a.started > killed_at + detected + Duration::from_millis(100))
        .collect();
    assert!(after.len() > 10, "{} answers after detection", after.len());
    for a in &after {
        assert_eq!(a.status, 200);
        assert!(!a.decision.contains(&dead), "{}", a.decision);
    }
    let served: BTreeSet<&str> = after.iter().map(|a| a.endpoint.as_str()).collect();
    assert!(!served.contains(dead.as_str()));
    assert_eq!(
        gw.envoy_stat("http.gateway.downstream_rq_5xx") as usize,
        bad.iter().filter(|a| a.status >= 500).count()
    );
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_restart_drops_the_index_and_affinity_rebuilds() {
    if !have_envoy() {
        return;
    }
    let poll = r#""metrics":{"cluster":"models","intervalMs":300,"timeoutMs":200}"#;
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, poll)).await;
    let eps = gw.fleet.endpoints();
    let sys = system(1, 40_000);
    let first = gw.post(CHAT, chat(&sys, "a")).await;
    assert!(first.decision.contains("reason=cold"), "{}", first.decision);
    let warm = first.endpoint.clone();
    let i = eps.iter().position(|e| *e == warm).unwrap();
    let again = gw.post(CHAT, chat(&sys, "b")).await;
    assert!(
        again.decision.contains("reason=sticky"),
        "{}",
        again.decision
    );
    assert_eq!(again.endpoint, warm);
    // Let a poll see the warm endpoint's prefix-cache counters after those requests.
    let ok = gw.stat("tokenaware_polls_ok");
    gw.stat_at_least("tokenaware_polls_ok", ok + 6, 10).await;
    assert_eq!(gw.stat("tokenaware_endpoint_resets"), 0);
    // Restarted within one poll interval: never out of rotation, but its counters restart.
    gw.fleet.kill(i).unwrap();
    gw.fleet.restart(i).unwrap();
    gw.stat_at_least("tokenaware_endpoint_resets", 1, 10).await;
    let d = gw.debug().await;
    assert_eq!(endpoint_of(&d, &warm)["healthy"], true);
    // The prefix is cold everywhere now; the next request rebuilds affinity.
    let cold = gw.post(CHAT, chat(&sys, "c")).await;
    assert_eq!(cold.status, 200);
    assert!(cold.decision.contains("reason=cold"), "{}", cold.decision);
    let sticky = gw.post(CHAT, chat(&sys, "d")).await;
    assert!(
        sticky.decision.contains("reason=sticky"),
        "{}",
        sticky.decision
    );
    assert_eq!(sticky.endpoint, cold.endpoint);
    // Down long enough to leave rotation, then back cold: reset again, traffic returns.
    gw.fleet.kill(i).unwrap();
    gw.debug_until("out of rotation", |d| {
        endpoint_of(d, &warm)["healthy"] == false
    })
    .await;
    gw.fleet.restart(i).unwrap();
    gw.debug_until("back in rotation", |d| {
        endpoint_of(d, &warm)["healthy"] == true
    })
    .await;
    gw.stat_at_least("tokenaware_endpoint_resets", 2, 10).await;
    let mut served = BTreeSet::new();
    for g in 0..12 {
        let a = gw.post(CHAT, chat(&system(100 + g, 8_000), "q")).await;
        assert_eq!(a.status, 200);
        served.insert(a.endpoint);
    }
    assert!(
        served.contains(&warm),
        "never routed to the restarted endpoint"
    );
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_that_are_garbage_fail_or_hang_do_not_hang_routing() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, POLL)).await;
    let eps = gw.fleet.endpoints();
    for (ep, fault) in eps.iter().zip(["garbage", "500", "slow"]) {
        gw.fleet_control(ep, "metrics-fault", fault).await;
    }
    gw.debug_until("the 500 and slow endpoints out of rotation", |d| {
        endpoint_of(d, &eps[1])["healthy"] == false && endpoint_of(d, &eps[2])["healthy"] == false
    })
    .await;
    let d = gw.debug().await;
    assert_eq!(
        endpoint_of(&d, &eps[0])["healthy"],
        true,
        "garbage is not a failure"
    );
    for q in 0..20 {
        let a = gw.post(CHAT, chat(&system(q, 8_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(a.elapsed < Duration::from_secs(2), "{:?}", a.elapsed);
        assert_eq!(a.endpoint, eps[0], "{}", a.decision);
    }
    assert!(gw.stat("tokenaware_polls_failed") >= 4);
    // Slow polls end at the poll timeout: one in flight per endpoint, never piling up.
    let slow = gw.fleet_counters(&eps[2]).await["metricsRequests"]
        .as_u64()
        .unwrap();
    let fast = gw.fleet_counters(&eps[1]).await["metricsRequests"]
        .as_u64()
        .unwrap();
    assert!(slow >= 2 && slow < fast, "slow {slow} fast {fast}");
    // Faults cleared: all back.
    for ep in &eps {
        gw.fleet_control(ep, "metrics-fault", "").await;
    }
    gw.debug_until("all back in rotation", |d| {
        eps.iter().all(|e| endpoint_of(d, e)["healthy"] == true)
    })
    .await;
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_admin_cluster_falls_back_without_hanging() {
    if !have_envoy() {
        return;
    }
    let dead = free_port().unwrap();
    let discovery = json!({"adminCluster": "admin", "modelCluster": "models", "intervalMs": 100});
    // Discovery only: nothing known, every request goes to Envoy's round robin.
    let gw = start_with(
        FleetConfig::scaled(3, 0.01),
        wasm_path(),
        |g| GatewayConfig {
            admin_cluster_port: Some(dead),
            ..g
        },
        |_| json!({"discovery": discovery, "decisionHeader": true, "debugPath": DEBUG, "statsFlushMs": 0}).to_string(),
    )
    .await;
    gw.stat_at_least("tokenaware_discovery_failed", 3, 10).await;
    let mut served = BTreeSet::new();
    for q in 0..9 {
        let a = gw.post(CHAT, chat(&system(q, 4_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(a.elapsed < Duration::from_secs(2), "{:?}", a.elapsed);
        assert_eq!(a.decision, "reason=fallback; why=no_endpoints");
        served.insert(a.endpoint);
    }
    assert_eq!(served.len(), 3, "round robin: {served:?}");
    assert_eq!(gw.stat("tokenaware_discovery_ok"), 0);
    // Envoy's log says why, naming the admin cluster.
    let log = gw.envoy.log();
    assert!(
        log.lines()
            .any(|l| l.contains("tokenaware: discovery failed")
                && l.contains("discovery.adminCluster `admin`")),
        "{log}"
    );
    drop(gw);
    // A static list as well: routed from it while discovery keeps failing.
    let gw = start_with(
        FleetConfig::scaled(3, 0.01),
        wasm_path(),
        |g| GatewayConfig {
            admin_cluster_port: Some(dead),
            ..g
        },
        |eps| plugin_config(eps, &format!("\"discovery\":{discovery}")),
    )
    .await;
    gw.stat_at_least("tokenaware_discovery_failed", 3, 10).await;
    let sys = system(50, 20_000);
    let a = gw.post(CHAT, chat(&sys, "a")).await;
    let b = gw.post(CHAT, chat(&sys, "b")).await;
    assert!(a.decision.contains("reason=cold"), "{}", a.decision);
    assert!(b.decision.contains("reason=sticky"), "{}", b.decision);
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_endpoint_set_changes_while_requests_are_in_flight() {
    if !have_envoy() {
        return;
    }
    // Four endpoints, three in the cluster at first. Streams last about a second.
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(4, 0.5)).unwrap();
    let all = fleet.endpoints();
    let mut cfg = GatewayConfig::new(all[..3].to_vec()).with_wasm(
        wasm_path(),
        json!({"discovery": {"adminCluster": "admin", "modelCluster": "models", "intervalMs": 100},
               "decisionHeader": true, "debugPath": DEBUG, "statsFlushMs": 0})
        .to_string(),
    );
    cfg.dynamic_endpoints = true;
    let envoy = spawn_envoy(cfg).await;
    let mut gw = Gateway {
        fleet,
        envoy,
        http: client(),
    };
    let set = |d: &serde_json::Value| -> BTreeSet<String> {
        d["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["address"].as_str().unwrap().to_string())
            .collect()
    };
    let first: BTreeSet<String> = all[..3].iter().cloned().collect();
    gw.debug_until("three endpoints discovered", |d| set(d) == first)
        .await;
    let stream = |g: usize| {
        json!({"model": MODEL, "stream": true, "max_tokens": 150,
            "messages": [{"role": "user", "content": system(200 + g, 40_000)}]})
        .to_string()
    };
    let url = gw.envoy.url(CHAT);
    let in_flight: Vec<_> = (0..9)
        .map(|g| {
            let (url, body) = (url.clone(), stream(g));
            tokio::spawn(async move {
                let t0 = Instant::now();
                let r = client().post(url).body(body).send().await.unwrap();
                answer(r, t0).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Endpoint 0 leaves, endpoint 3 joins, while the streams run.
    let second: BTreeSet<String> = all[1..].iter().cloned().collect();
    let next = all[1..].to_vec();
    gw.envoy.set_endpoints(&next).unwrap();
    gw.debug_until("the new set discovered", |d| set(d) == second)
        .await;
    let mut removed_served = 0;
    for t in in_flight {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        assert!(a.body.contains("[DONE]"), "stream cut: {}", a.endpoint);
        removed_served += usize::from(a.endpoint == all[0]);
    }
    eprintln!("{removed_served} streams finished on the removed endpoint");
    let mut served = BTreeSet::new();
    for g in 0..9 {
        let a = gw.post(CHAT, chat(&system(300 + g, 8_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(!a.decision.contains(&all[0]), "{}", a.decision);
        served.insert(a.endpoint);
    }
    assert!(
        served.contains(&all[3]),
        "the new endpoint got nothing: {served:?}"
    );
    assert!(!served.contains(&all[0]));
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

fn tau_config(eps: &[String], tau: u64) -> String {
    plugin_config(eps, &format!("{POLL},\"tau\":{tau}"))
}

/// Three endpoints behind a listener whose plugin config can be replaced at runtime.
async fn start_reconfigurable(config: impl FnOnce(&[String]) -> String) -> Gateway {
    let dynamic = |g: GatewayConfig| GatewayConfig {
        dynamic_listener: true,
        ..g
    };
    start_with(FleetConfig::scaled(3, 0.01), wasm_path(), dynamic, config).await
}

/// Pushes a new plugin config; true when Envoy took it. New connections then get the new
/// filter chain (the old listener drains), so the client stops reusing its connections.
fn reconfigure(gw: &mut Gateway, cfg: &str) -> bool {
    let envoy = &mut gw.envoy;
    let accepted = tokio::task::block_in_place(|| envoy.set_plugin_config(cfg)).unwrap();
    if accepted {
        gw.http = reqwest::Client::builder()
            .timeout(CLIENT_TIMEOUT)
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
    }
    accepted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_reconfiguration_uses_the_new_tau_and_keeps_the_tables() {
    if !have_envoy() {
        return;
    }
    let mut gw = start_reconfigurable(|eps| tau_config(eps, 300_000)).await;
    let eps = gw.fleet.endpoints();
    let before = gw.debug().await;
    assert_eq!(before["tau"], 300_000.0);
    let sys = system(9, 40_000);
    let warm = gw.post(CHAT, chat(&sys, "a")).await.endpoint;
    let a = gw.post(CHAT, chat(&sys, "b")).await;
    assert!(a.decision.contains("reason=sticky"), "{}", a.decision);
    let routed = gw.stat("tokenaware_requests_routed");
    // The new configuration also polls ten times less often.
    let slow_poll =
        r#""metrics":{"cluster":"models","intervalMs":1000,"timeoutMs":500,"staleAfterMs":3000}"#;
    let cfg = plugin_config(&eps, &format!("{slow_poll},\"tau\":1234"));
    assert!(reconfigure(&mut gw, &cfg), "the new config was rejected");
    let after = gw.debug_until("the new τ", |d| d["tau"] == 1_234.0).await;
    assert_ne!(
        after["vm"], before["vm"],
        "a new root context (per-VM state is new)"
    );
    // Shared data survived: the prefix is still warm where it was.
    let b = gw.post(CHAT, chat(&sys, "c")).await;
    assert!(b.decision.contains("reason=sticky"), "{}", b.decision);
    assert_eq!(b.endpoint, warm);
    // Stats are Envoy's: the counters go on.
    assert_eq!(gw.stat("tokenaware_requests_routed"), routed + 1);
    // The poller moves to the new configuration (its lease expires within a second; 3 s
    // allowed): 3 endpoints every second, not every 100 ms as the old listener's roots would.
    // Polls are counted whether they succeed or not: on a busy machine some time out, and
    // the question is which configuration polls, not how the endpoints answer.
    let polls = |gw: &Gateway| gw.stat("tokenaware_polls_ok") + gw.stat("tokenaware_polls_failed");
    // On a loaded machine (the suite runs tests in parallel) the new poller's lease can come
    // a round late: the lower bound only asks that it polls at all, the upper one that the
    // old configuration (30 polls/s) stopped.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let before = polls(&gw);
    tokio::time::sleep(Duration::from_millis(5_000)).await;
    let per_s = (polls(&gw) - before) as f64 / 5.0;
    assert!(
        (0.5..=6.0).contains(&per_s),
        "{per_s} polls/s: the new configuration should poll 3 endpoints a second, the old 30"
    );
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalid_runtime_config_is_rejected_and_the_old_one_keeps_serving() {
    if !have_envoy() {
        return;
    }
    let mut gw = start_reconfigurable(|eps| tau_config(eps, 300_000)).await;
    let eps = gw.fleet.endpoints();
    let bad = plugin_config(&eps, r#""affinityThreshold":7"#);
    assert!(
        !reconfigure(&mut gw, &bad),
        "Envoy took an invalid plugin config"
    );
    let log = gw.envoy.log();
    assert!(
        log.contains("invalid tokenaware config: field `affinityThreshold`"),
        "the log does not name the field"
    );
    let a = gw.post(CHAT, chat(&system(2, 8_000), "q")).await;
    assert_eq!(a.status, 200);
    assert!(a.decision.contains("reason=cold"), "{}", a.decision);
    assert_eq!(gw.debug().await["tau"], 300_000.0);
    gw.assert_settled().await;
    drop(gw);
    // At startup no failure_policy makes an invalid config acceptable: Envoy refuses to
    // start, with FAIL_CLOSED as with FAIL_OPEN (e2e.rs checks FAIL_OPEN).
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(1, 0.01)).unwrap();
    let mut cfg = GatewayConfig::new(fleet.endpoints()).with_wasm(
        wasm_path(),
        plugin_config(&fleet.endpoints(), r#""bytesPerToken":0"#),
    );
    cfg.failure_policy = "FAIL_CLOSED".into();
    let r = tokio::task::spawn_blocking(move || Envoy::start(cfg))
        .await
        .unwrap();
    let e = format!(
        "{:#}",
        r.err().expect("Envoy started with an invalid config")
    );
    assert!(e.contains("field `bytesPerToken`"), "{e}");
}

/// What the requests after a trap got, per failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "builds a second module with the fault-injection feature (about 2 min from cold)"]
async fn a_trap_in_the_filter_recovers_per_failure_policy() {
    if !have_envoy() {
        return;
    }
    let wasm = tokio::task::spawn_blocking(fault_wasm_path).await.unwrap();
    for policy in ["FAIL_OPEN", "FAIL_CLOSED", "FAIL_RELOAD"] {
        let gw = start_with(
            FleetConfig::scaled(3, 0.01),
            wasm.clone(),
            |g| GatewayConfig {
                failure_policy: policy.into(),
                concurrency: 1,
                ..g
            },
            |eps| plugin_config(eps, ""),
        )
        .await;
        let ok = gw.post(CHAT, chat(&system(1, 4_000), "q")).await;
        assert_eq!(ok.status, 200);
        assert!(ok.decision.contains("reason="), "{policy}: {}", ok.decision);
        let trap = gw
            .post_with(
                CHAT,
                chat(&system(1, 4_000), "q"),
                &[("x-tokenaware-fault", "trap")],
            )
            .await;
        let mut after = Vec::new();
        for q in 0..4 {
            after.push(
                gw.post(CHAT, chat(&system(2, 4_000), &format!("q{q}")))
                    .await,
            );
        }
        let log = gw.envoy.log();
        assert!(
            log.contains("tokenaware panic"),
            "{policy}: panic not logged"
        );
        eprintln!(
            "{policy}: trap request {}; after: {:?}",
            trap.status,
            after
                .iter()
                .map(|a| (a.status, a.decision.as_str()))
                .collect::<Vec<_>>()
        );
        match policy {
            // The dead VM is skipped: Envoy's round robin serves, unrouted.
            // (The stream that trapped is failed with a 503 whatever the policy: Envoy
            // cannot tell how far the filter got.)
            "FAIL_OPEN" => {
                assert_eq!(trap.status, 503, "{policy}");
                assert!(after
                    .iter()
                    .all(|a| a.status == 200 && a.decision.is_empty()));
            }
            // Every request through the dead VM fails.
            "FAIL_CLOSED" => {
                assert_eq!(trap.status, 503, "{policy}");
                assert!(after.iter().all(|a| a.status == 503));
            }
            // Fails closed until the reload backoff (1 s by default) has passed, then a new
            // VM routes again.
            _ => {
                let t0 = Instant::now();
                let recovered = loop {
                    let a = gw.post(CHAT, chat(&system(3, 4_000), "q")).await;
                    if a.status == 200 && a.decision.contains("reason=") {
                        break t0.elapsed();
                    }
                    assert!(a.status == 200 || a.status == 503, "{a:?}");
                    assert!(t0.elapsed() < Duration::from_secs(15), "never reloaded");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                eprintln!("{policy}: routed again {recovered:?} later");
                let d = gw.debug().await;
                assert!(ledger_is_zero(&d), "{d:#}");
            }
        }
    }
}

/// The fleet's own fault modes, without Envoy: what the tests above rely on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_kills_restarts_cold_and_breaks_its_metrics() {
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(2, 0.01)).unwrap();
    let ep = fleet.endpoints()[0].clone();
    let http = client();
    let body = json!({"model": MODEL, "prompt": "warm me up ".repeat(2_000), "max_tokens": 2});
    let cached =
        |v: serde_json::Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let post = || {
        http.post(format!("http://{ep}/v1/completions"))
            .json(&body)
            .send()
    };
    post().await.unwrap();
    let v: serde_json::Value = post().await.unwrap().json().await.unwrap();
    assert!(cached(v).unwrap() > 0);
    fleet.kill(0).unwrap();
    assert!(post().await.is_err(), "a killed endpoint still answers");
    assert!(fleet.kill(0).is_err());
    fleet.restart(0).unwrap();
    assert!(fleet.restart(0).is_err());
    let v: serde_json::Value = post().await.unwrap().json().await.unwrap();
    assert_eq!(cached(v), Some(0), "restarted warm");
    let metrics = |ep: String| {
        let http = http.clone();
        async move {
            let r = http
                .get(format!("http://{ep}/metrics"))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            match r {
                Ok(r) => Some((r.status().as_u16(), r.bytes().await.unwrap().to_vec())),
                Err(_) => None,
            }
        }
    };
    let (status, text) = metrics(ep.clone()).await.unwrap();
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&text).contains("vllm:prefix_cache_queries_total"));
    let set = |fault: &'static str| {
        let (http, ep) = (http.clone(), ep.clone());
        async move {
            http.post(format!("http://{ep}/fleet/metrics-fault"))
                .body(fault)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(set("garbage").await, 204);
    let (status, text) = metrics(ep.clone()).await.unwrap();
    assert!(status == 200 && std::str::from_utf8(&text).is_err());
    assert_eq!(set("500").await, 204);
    assert_eq!(metrics(ep.clone()).await.unwrap().0, 500);
    assert_eq!(set("slow").await, 204);
    assert!(
        metrics(ep.clone()).await.is_none(),
        "slow metrics answered within 1 s"
    );
    assert_eq!(set("bogus").await, 400);
    assert_eq!(set("").await, 204);
    assert_eq!(metrics(ep.clone()).await.unwrap().0, 200);
    let c = http
        .get(format!("http://{ep}/fleet/counters"))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    assert_eq!(c["metricsRequests"], 5);
    assert_eq!(c["inferenceRequests"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_reconfiguration_with_a_new_endpoint_list_takes_effect() {
    if !have_envoy() {
        return;
    }
    let mut gw = start_reconfigurable(|eps| plugin_config(eps, POLL)).await;
    let eps = gw.fleet.endpoints();
    // Polls have written the table to shared data.
    gw.stat_at_least("tokenaware_polls_ok", 6, 10).await;
    // The operator drops the first endpoint from the list.
    let cfg = plugin_config(&eps[1..], POLL);
    assert!(reconfigure(&mut gw, &cfg));
    let d = gw
        .debug_until("the new list", |d| {
            d["endpoints"].as_array().unwrap().len() == 2
        })
        .await;
    assert!(d["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["address"] != eps[0].as_str()));
    for g in 0..9 {
        let a = gw.post(CHAT, chat(&system(400 + g, 4_000), "q")).await;
        assert_eq!(a.status, 200);
        assert!(!a.decision.contains(&eps[0]), "{}", a.decision);
    }
    // The dropped endpoint is no longer polled.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before = gw.fleet_counters(&eps[0]).await["metricsRequests"]
        .as_u64()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let after = gw.fleet_counters(&eps[0]).await["metricsRequests"]
        .as_u64()
        .unwrap();
    assert_eq!(after, before, "the dropped endpoint is still polled");
    gw.assert_settled().await;
}

/// A VM that traps cannot release what its requests hold: those charges expire after
/// `requestTTLSeconds` (here 3 s), so the ledger still comes back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "builds a second module with the fault-injection feature (about 2 min from cold)"]
async fn a_trapped_vms_charges_expire_after_the_request_ttl() {
    if !have_envoy() {
        return;
    }
    let wasm = tokio::task::spawn_blocking(fault_wasm_path).await.unwrap();
    let gw = start_with(
        FleetConfig::scaled(3, 1.0),
        wasm,
        |g| GatewayConfig {
            failure_policy: "FAIL_RELOAD".into(),
            concurrency: 1,
            ..g
        },
        |eps| plugin_config(eps, r#""requestTTLSeconds":3"#),
    )
    .await;
    // A long stream holds a charge in the only worker VM ...
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 2000,
        "messages": [{"role": "user", "content": system(7, 8_000)}]})
    .to_string();
    let url = gw.envoy.url(CHAT);
    let stream = tokio::spawn(async move {
        let t0 = Instant::now();
        let r = client().post(url).body(body).send().await;
        match r {
            Ok(r) => Some(answer(r, t0).await),
            Err(_) => None,
        }
    });
    gw.debug_until("the stream charged", |d| !ledger_is_zero(d))
        .await;
    // ... when the VM traps.
    let trap = gw
        .post_with(
            CHAT,
            chat(&system(1, 4_000), "q"),
            &[("x-tokenaware-fault", "trap")],
        )
        .await;
    assert_eq!(trap.status, 503);
    let t0 = Instant::now();
    // The reloaded VM reads the shared ledger: the charge is there, then expires.
    let d = loop {
        let r = gw.http.get(gw.envoy.url(DEBUG)).send().await.unwrap();
        if r.status() == 200 {
            break r.json::<serde_json::Value>().await.unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no VM reloaded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("after reload: ledger zero = {}", ledger_is_zero(&d));
    gw.debug_until_for("the charge expired", 10, ledger_is_zero)
        .await;
    eprintln!("ledger zero {:?} after the trap", t0.elapsed());
    let s = stream.await.unwrap();
    eprintln!("the stream: {:?}", s.map(|a| (a.status, a.body.len())));
}

//! Security through a real Envoy with the release `tokenaware.wasm`: a client can never pick
//! its upstream (every way the destination header can arrive, on every path the filter takes),
//! the debug path and decision header are off unless configured, no prompt text reaches
//! Envoy's log below trace, and metric polls only reach the configured or discovered
//! endpoints. e2e.rs already checks a duplicated and a mixed-case header on a routed request
//! and on a non-inference path; this extends it.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;
use support::*;
use wasm_tests::envoy::{have_envoy, GatewayConfig};
use wasm_tests::fleet::{FleetConfig, MODEL};

/// A raw HTTP/1.1 POST with `headers` (verbatim lines) and `body`, chunked with `trailers`
/// when given. Returns (status, served-by endpoint, decision).
fn raw_post(
    port: u16,
    path: &str,
    headers: &[String],
    body: &str,
    trailers: Option<&str>,
) -> (u16, String, String) {
    let mut req =
        String::from("Host: gw\r\nConnection: close\r\nContent-Type: application/json\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    match trailers {
        None => req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len())),
        Some(t) => {
            req.push_str("Transfer-Encoding: chunked\r\n\r\n");
            for c in body.as_bytes().chunks(4_096) {
                req.push_str(&format!(
                    "{:x}\r\n{}\r\n",
                    c.len(),
                    String::from_utf8_lossy(c)
                ));
            }
            req.push_str(&format!("0\r\n{t}\r\n\r\n"));
        }
    }
    let (status, head, _) = raw_exchange(port, &format!("POST {path} HTTP/1.1"), req.as_bytes());
    (
        status,
        head_value(&head, "x-fleet-endpoint").unwrap_or_default(),
        head_value(&head, DECISION).unwrap_or_default(),
    )
}

async fn raw_post_async(
    port: u16,
    path: &str,
    headers: Vec<String>,
    body: String,
    trailers: Option<String>,
) -> (u16, String, String) {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || raw_post(port, &path, &headers, &body, trailers.as_deref()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_never_chooses_the_upstream() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| {
        plugin_config(eps, r#""maxBodyBytes":65536"#)
    })
    .await;
    let eps = gw.fleet.endpoints();
    let port = gw.envoy.listen_port();
    let sys = system(11, 20_000);
    let pick = gw.post(CHAT, chat(&sys, "warm")).await.endpoint;
    let other = eps.iter().find(|e| **e != pick).unwrap().clone();
    // Routed requests: always the filter's pick, however the client's header comes.
    let tries: Vec<(Vec<String>, Option<String>)> = vec![
        (vec![format!("{DEST_SERVED}: {other}")], None),
        (
            vec![
                format!("{DEST}: {other}"),
                format!("{DEST_SERVED}: {other}"),
            ],
            None,
        ),
        (
            vec![format!("X-Gateway-Destination-Endpoint-Served: {other}")],
            None,
        ),
        (vec![format!("{DEST}: {other},{other},{other}")], None),
        (vec![format!("{DEST}:{other}")], None),
        (
            vec![format!("{DEST}: {other}")],
            Some(format!("{DEST}: {other}")),
        ),
        (
            vec!["Trailer: x-gateway-destination-endpoint".into()],
            Some(format!("{DEST}: {other}")),
        ),
    ];
    for (headers, trailers) in tries {
        let what = format!("{headers:?} trailers {trailers:?}");
        let (status, served, decision) =
            raw_post_async(port, CHAT, headers, chat(&sys, "again"), trailers).await;
        assert_eq!(status, 200, "{what}");
        assert_eq!(served, pick, "{what} chose the upstream ({decision})");
        assert!(decision.contains("reason=sticky"), "{what}: {decision}");
    }
    // Requests the filter does not route (unparsable, too large, no body, not an inference
    // path): the header is gone, so Envoy's round robin picks, never the client.
    let too_large = chat(&system(12, 100_000), "q");
    let unrouted: [(&str, String); 4] = [
        (CHAT, "{not json".into()),
        (CHAT, too_large),
        (CHAT, String::new()),
        ("/v1/models", String::new()),
    ];
    for (path, body) in unrouted {
        let mut served = BTreeSet::new();
        for _ in 0..6 {
            let h = vec![
                format!("{DEST}: {other}"),
                format!("{DEST_SERVED}: {other}"),
            ];
            let (status, ep, _) = raw_post_async(port, path, h, body.clone(), None).await;
            assert!(status < 500, "{path}: {status}");
            served.insert(ep);
        }
        assert!(
            served.len() > 1,
            "{path} ({} bytes) followed the client header: {served:?}",
            body.len()
        );
    }
    // HTTP/2 (h2c): header names arrive lowercase; same result.
    let body = gw.envoy.dir().join("sec-h2.json");
    std::fs::write(&body, chat(&sys, "h2")).unwrap();
    let url = gw.envoy.url(CHAT);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .args([
                "15",
                "nghttp",
                "-v",
                "-n",
                "-H",
                &format!("{DEST}: {other}"),
                "-d",
            ])
            .arg(&body)
            .arg(&url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains(&format!("x-fleet-endpoint: {pick}")), "{out}");
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_debug_path_and_decision_header_are_off_unless_configured() {
    if !have_envoy() {
        return;
    }
    let marker = "SECRET-MARKER-7f3a9c";
    // Off: the debug path is an ordinary request (the model server's 404), no decision header.
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| {
        let list: Vec<_> = eps.iter().map(|a| json!({ "address": a })).collect();
        json!({ "endpoints": list, "statsFlushMs": 0 }).to_string()
    })
    .await;
    // The peers' path too, without `peers`.
    for path in [DEBUG, "/tokenaware/peers?since=0"] {
        let r = gw.http.get(gw.envoy.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        assert!(
            r.headers().contains_key("x-fleet-endpoint"),
            "{path} not passed upstream"
        );
    }
    let a = gw
        .post(CHAT, chat(&format!("{marker} {}", system(1, 8_000)), "q"))
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.decision, "", "decision header without decisionHeader");
    assert_eq!(gw.stat("tokenaware_requests_routed"), 1);
    drop(gw);
    // On: answered locally, only at the exact path, and never with prompt text.
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let a = gw
        .post(CHAT, chat(&format!("{marker} {}", system(1, 8_000)), "q"))
        .await;
    assert!(a.decision.starts_with("endpoint="));
    assert!(!a.decision.contains(marker));
    for path in [DEBUG.to_string(), format!("{DEBUG}?x=1")] {
        let r = gw.http.get(gw.envoy.url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert!(
            !r.headers().contains_key("x-fleet-endpoint"),
            "{path} reached upstream"
        );
        let text = r.text().await.unwrap();
        assert!(
            !text.contains(marker) && !text.contains("meticulous"),
            "{path}: prompt text"
        );
    }
    for path in [
        format!("{DEBUG}/x"),
        format!("{DEBUG}x"),
        "/debug".to_string(),
    ] {
        let r = gw.http.get(gw.envoy.url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path} answered by the filter");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_prompt_text_in_envoys_debug_log() {
    if !have_envoy() {
        return;
    }
    let marker = "PROMPT-MARKER-b41d2e";
    let gw = start_with(
        FleetConfig::scaled(3, 0.01),
        wasm_path(),
        |g| GatewayConfig {
            log_level: "debug".into(),
            component_log_level: Some("wasm:debug".into()),
            ..g
        },
        |eps| plugin_config(eps, &format!("{POLL},\"maxBodyBytes\":65536")),
    )
    .await;
    let with_marker =
        |extra: usize| chat(&format!("{marker} {}", system(2, 8_000 + extra)), marker);
    // Routed, sticky, streamed, unparsable, too large, and through the debug path.
    for body in [
        with_marker(0),
        with_marker(0),
        json!({"model": MODEL, "stream": true, "max_tokens": 3,
               "messages": [{"role": "user", "content": format!("{marker} stream")}]})
        .to_string(),
        format!("{{\"model\": \"{marker}\", broken"),
        with_marker(100_000),
    ] {
        let a = gw.post(CHAT, body).await;
        assert!(a.status < 500, "{}", a.status);
    }
    let r = gw.http.get(gw.envoy.url(DEBUG)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = gw.envoy.log();
    assert!(log.contains("[debug]"), "Envoy did not log at debug");
    assert!(log.contains("tokenaware"), "no filter log lines");
    assert!(!log.contains(marker), "prompt text in Envoy's log");
    assert!(
        !gw.envoy.access_log().contains(marker),
        "prompt text in the access log"
    );
    gw.assert_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metric_polls_reach_only_configured_or_discovered_endpoints() {
    if !have_envoy() {
        return;
    }
    // Four endpoints in the Envoy cluster, three in the plugin's static list.
    let gw = start(FleetConfig::scaled(4, 0.01), |eps| {
        plugin_config(&eps[..3], POLL)
    })
    .await;
    let eps = gw.fleet.endpoints();
    gw.stat_at_least("tokenaware_polls_ok", 30, 10).await;
    for (i, ep) in eps.iter().enumerate() {
        let n = gw.fleet_counters(ep).await["metricsRequests"]
            .as_u64()
            .unwrap();
        if i < 3 {
            assert!(n >= 5, "{ep}: {n} polls");
        } else {
            assert_eq!(n, 0, "{ep} is not configured but was polled");
        }
    }
    drop(gw);
    // Discovery: exactly the cluster's hosts; a server outside the cluster is never polled.
    let gw = start_with(
        FleetConfig::scaled(4, 0.01),
        wasm_path(),
        |mut g| {
            g.endpoints.truncate(3);
            g
        },
        |_| {
            json!({"discovery": {"adminCluster": "admin", "modelCluster": "models", "intervalMs": 100},
                   "metrics": {"cluster": "models", "intervalMs": 100, "timeoutMs": 500},
                   "debugPath": DEBUG, "statsFlushMs": 0})
            .to_string()
        },
    )
    .await;
    let eps = gw.fleet.endpoints();
    gw.stat_at_least("tokenaware_polls_ok", 30, 10).await;
    for (i, ep) in eps.iter().enumerate() {
        let n = gw.fleet_counters(ep).await["metricsRequests"]
            .as_u64()
            .unwrap();
        if i < 3 {
            assert!(n >= 5, "{ep}: {n} polls");
        } else {
            assert_eq!(n, 0, "{ep} is outside the cluster but was polled");
        }
    }
}

/// With FAIL_OPEN a trapped VM is skipped, and with it the filter's own stripping: the demo
/// config's header_mutation filter keeps the client from choosing the upstream then.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "builds a second module with the fault-injection feature (about 2 min from cold)"]
async fn a_trapped_filter_does_not_hand_the_upstream_to_the_client() {
    if !have_envoy() {
        return;
    }
    let wasm = tokio::task::spawn_blocking(fault_wasm_path).await.unwrap();
    for strip in [false, true] {
        let gw = start_with(
            FleetConfig::scaled(3, 0.01),
            wasm.clone(),
            |g| GatewayConfig {
                concurrency: 1,
                strip_client_destination: strip,
                ..g
            },
            |eps| plugin_config(eps, ""),
        )
        .await;
        let other = gw.fleet.endpoints()[2].clone();
        let trap = gw
            .post_with(
                CHAT,
                chat(&system(1, 4_000), "q"),
                &[("x-tokenaware-fault", "trap")],
            )
            .await;
        assert_eq!(trap.status, 503);
        let mut served = BTreeSet::new();
        for q in 0..6 {
            let a = gw
                .post_with(
                    CHAT,
                    chat(&system(q, 4_000), "q"),
                    &[(DEST, other.as_str())],
                )
                .await;
            assert_eq!(a.status, 200);
            assert_eq!(a.decision, "", "the filter ran");
            served.insert(a.endpoint);
        }
        eprintln!("strip={strip}: served by {served:?}");
        if strip {
            assert!(served.len() > 1, "the client chose {served:?}");
        } else {
            // Without the strip filter the failed-open filter lets the client choose.
            assert_eq!(served, BTreeSet::from([other.clone()]));
        }
    }
}

/// The demo config (render.sh) strips client copies ahead of the filter; routing is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_strip_filter_in_front_keeps_routing_intact() {
    if !have_envoy() {
        return;
    }
    let gw = start_with(
        FleetConfig::scaled(3, 0.01),
        wasm_path(),
        |g| GatewayConfig {
            strip_client_destination: true,
            ..g
        },
        |eps| plugin_config(eps, ""),
    )
    .await;
    let sys = system(21, 20_000);
    let pick = gw.post(CHAT, chat(&sys, "warm")).await.endpoint;
    let other = gw
        .fleet
        .endpoints()
        .into_iter()
        .find(|e| *e != pick)
        .unwrap();
    for q in 0..3 {
        let a = gw
            .post_with(
                CHAT,
                chat(&sys, &format!("q{q}")),
                &[(DEST, other.as_str())],
            )
            .await;
        assert_eq!(a.endpoint, pick);
        assert!(a.decision.contains("reason=sticky"), "{}", a.decision);
    }
    // Removed before the filter saw it.
    assert_eq!(gw.stat("tokenaware_client_header_stripped"), 0);
    gw.assert_settled().await;
}

/// The trap trigger exists only in `fault-injection` builds.
#[test]
fn the_release_module_has_no_trap_trigger() {
    let wasm = std::fs::read(wasm_path()).unwrap();
    let has = |needle: &[u8]| wasm.windows(needle.len()).any(|w| w == needle);
    assert!(
        has(b"x-gateway-destination-endpoint"),
        "not the filter module"
    );
    assert!(
        !has(b"x-tokenaware-fault"),
        "release module carries the trap trigger"
    );
}

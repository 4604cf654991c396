//! The release `tokenaware.wasm` in the test host: routing decisions, header hygiene,
//! fallbacks, the ledger's release, tables shared by two worker VMs, CAS conflicts,
//! configuration errors and metrics polls. Outcomes only (headers, stats, the debug JSON),
//! never hostcall order.
//!
//! Needs `cargo build -p tokenaware --release --target wasm32-wasip1` (scripts/test.sh runs
//! it first).

use std::path::PathBuf;

use serde_json::{json, Value};
use wasm_tests::host::{fixture, Action, Host, Stream, Vm};

const DEST: &str = "x-gateway-destination-endpoint";
const DEBUG: &str = "/debug/tokenaware";
const EPS: [&str; 3] = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"];

fn wasm() -> PathBuf {
    let p = fixture::workspace_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build -p tokenaware --release --target wasm32-wasip1` first \
         (scripts/test.sh does)",
        p.display()
    );
    p
}

/// The static 3-endpoint config (stats sent at once) plus `extra` top-level fields.
fn config(extra: Value) -> Vec<u8> {
    let mut v = json!({
        "endpoints": EPS.iter().map(|a| json!({ "address": a })).collect::<Vec<_>>(),
        "debugPath": DEBUG,
        "statsFlushMs": 0,
    });
    if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        v.extend(extra.clone());
    }
    serde_json::to_vec(&v).unwrap()
}

fn vm(host: &Host) -> Vm {
    let vm = host.load(wasm()).unwrap();
    assert!(
        vm.configure(1, &config(json!({}))).unwrap(),
        "{}",
        vm.log_text()
    );
    // Each VM derives its id from the clock: keep two VMs of one host apart.
    host.advance_ms(1);
    vm
}

/// About 2,000 tokens of system prompt shared by the requests of one "conversation".
fn system_prompt(topic: &str) -> String {
    (0..400)
        .map(|i| format!("rule {i} about {topic}: be precise."))
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat_body(system: &str, user: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "m",
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": user },
        ],
    }))
    .unwrap()
}

/// Sends a chat request, the body in `chunks` pieces; returns the open stream.
fn send(vm: &Vm, body: &[u8], chunks: usize) -> Stream {
    let s = vm.stream();
    let len = body.len().to_string();
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    assert_eq!(s.request_headers(&headers, false).unwrap(), Action::Pause);
    let pieces: Vec<&[u8]> = body.chunks(body.len().div_ceil(chunks)).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        let action = s.request_body(piece, last).unwrap();
        assert_eq!(
            action,
            if last {
                Action::Continue
            } else {
                Action::Pause
            }
        );
    }
    s
}

/// Response and end of stream: releases the request's ledger entry.
fn finish(s: &Stream) {
    s.response_headers(&[(":status", "200")], false).unwrap();
    s.response_body(br#"{"choices":[]}"#, true).unwrap();
    s.end().unwrap();
}

fn primary(s: &Stream) -> Option<String> {
    let v = s.request_header(DEST)?;
    v.split(',').next().map(str::to_string)
}

/// The debug JSON (a local reply on the debug path).
fn debug(vm: &Vm) -> Value {
    let s = vm.stream();
    s.request_headers(&[(":method", "GET"), (":path", DEBUG)], true)
        .unwrap();
    let reply = s.local_response().expect("debug path answers locally");
    s.end().unwrap();
    serde_json::from_slice(&reply.body).unwrap()
}

fn inflight(vm: &Vm) -> (u64, u64) {
    let d = debug(vm);
    let eps = d["endpoints"].as_array().cloned().unwrap_or_default();
    assert_eq!(eps.len(), 3, "{d}");
    eps.iter().fold((0, 0), |(t, r), e| {
        (
            t + e["inflightTokens"].as_u64().unwrap_or(0),
            r + e["activeRequests"].as_u64().unwrap_or(0),
        )
    })
}

#[test]
fn a_shared_system_prompt_sticks_to_one_endpoint() {
    let host = Host::new();
    let vm = vm(&host);
    let system = system_prompt("billing");
    let mut picks = Vec::new();
    for (i, chunks) in [1, 3, 7, 2].into_iter().enumerate() {
        let s = send(&vm, &chat_body(&system, &format!("question {i}")), chunks);
        let dest = s.request_header(DEST).expect("a destination");
        assert!(dest.split(',').all(|a| EPS.contains(&a)), "{dest}");
        picks.push(primary(&s).unwrap());
        finish(&s);
        host.advance_ms(50);
    }
    assert!(picks.iter().all(|p| *p == picks[0]), "{picks:?}");
    assert_eq!(vm.metric("tokenaware_requests_routed"), Some(4));
    assert!(
        !vm.log_text().contains("be precise"),
        "prompt text leaked into logs"
    );
}

#[test]
fn client_sent_destination_is_stripped() {
    let host = Host::new();
    let vm = vm(&host);
    let body = chat_body(&system_prompt("x"), "hi");
    let s = vm.stream();
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (DEST, "6.6.6.6:1"),
        (DEST, "7.7.7.7:1"),
    ];
    assert_eq!(s.request_headers(&headers, false).unwrap(), Action::Pause);
    s.request_body(&body, true).unwrap();
    let copies: Vec<String> = s
        .request_header_map()
        .into_iter()
        .filter(|(k, _)| k == DEST)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert!(EPS.contains(&primary(&s).unwrap().as_str()));
    assert_eq!(vm.metric("tokenaware_client_header_stripped"), Some(1));

    // Not an inference route: stripped, nothing set.
    let t = vm.stream();
    let other = [
        (":method", "GET"),
        (":path", "/healthz"),
        (DEST, "6.6.6.6:1"),
    ];
    assert_eq!(t.request_headers(&other, true).unwrap(), Action::Continue);
    assert_eq!(t.request_header(DEST), None);
}

#[test]
fn a_malformed_body_continues_without_a_destination() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    s.request_headers(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        false,
    )
    .unwrap();
    assert_eq!(
        s.request_body(b"{\"model\": \"m\", \"messa", false)
            .unwrap(),
        Action::Pause
    );
    assert_eq!(
        s.request_body(b"ges\": [ nope", true).unwrap(),
        Action::Continue
    );
    assert_eq!(s.request_header(DEST), None);
    assert_eq!(vm.metric("tokenaware_fallback_not_json"), Some(1));
    assert_eq!(vm.metric("tokenaware_requests_routed"), Some(0));
    finish(&s);
    assert!(vm.failure().is_none());
}

#[test]
fn the_ledger_returns_to_zero_after_the_response() {
    let host = Host::new();
    let vm = vm(&host);
    let a = send(&vm, &chat_body(&system_prompt("a"), "one"), 2);
    let b = send(&vm, &chat_body(&system_prompt("b"), "two"), 2);
    let (tokens, requests) = inflight(&vm);
    assert!(tokens > 0, "two requests in flight");
    assert_eq!(requests, 2);
    finish(&a);
    assert_eq!(inflight(&vm).1, 1);
    finish(&b);
    assert_eq!(inflight(&vm), (0, 0));
    assert_eq!(vm.metric("tokenaware_requests_released"), Some(2));
}

#[test]
fn two_vms_share_the_tables() {
    let host = Host::new();
    let (vm1, vm2) = (vm(&host), vm(&host));
    let system = system_prompt("shared");
    let first = send(&vm1, &chat_body(&system, "from worker 1"), 3);
    let pick = primary(&first).unwrap();
    finish(&first);
    host.advance_ms(20);
    for i in 0..3 {
        let s = send(&vm2, &chat_body(&system, &format!("from worker 2, {i}")), 2);
        assert_eq!(primary(&s).unwrap(), pick);
        finish(&s);
    }
    // Requests in flight on one VM show in the other's view of the ledger.
    let open = send(&vm1, &chat_body(&system_prompt("other"), "x"), 1);
    assert_eq!(inflight(&vm2).1, 1);
    finish(&open);
    assert_eq!(inflight(&vm2), (0, 0));
}

#[test]
fn injected_cas_conflicts_are_survived() {
    let host = Host::new();
    let vm = vm(&host);
    let system = system_prompt("cas");
    let warm = send(&vm, &chat_body(&system, "warm up"), 1);
    let pick = primary(&warm).unwrap();
    finish(&warm);
    // Fewer conflicts than one update's retry budget: routed as usual.
    for n in [1, 3, 7] {
        host.inject_cas_conflicts(n);
        let s = send(
            &vm,
            &chat_body(&system, &format!("under contention {n}")),
            2,
        );
        assert_eq!(primary(&s).as_deref(), Some(pick.as_str()), "{n} conflicts");
        assert_eq!(host.cas_conflicts_left(), 0);
        finish(&s);
    }
    // Endless contention: the request goes on without a destination (fail-open).
    host.inject_cas_conflicts(1_000);
    let s = send(&vm, &chat_body(&system, "hopeless"), 2);
    assert_eq!(s.request_header(DEST), None);
    assert_eq!(vm.metric("tokenaware_fallback_store"), Some(1));
    host.inject_cas_conflicts(0);
    finish(&s);
    assert_eq!(inflight(&vm), (0, 0));
    assert!(vm.failure().is_none());
}

#[test]
fn an_invalid_config_is_rejected() {
    let host = Host::new();
    for bad in [
        &br#"{"endpoints": "nope"}"#[..],
        br#"{"affinityThreshold": 7}"#,
        br#"{"noSuchField": 1}"#,
        b"not json",
    ] {
        let vm = host.load(wasm()).unwrap();
        assert!(
            !vm.configure(1, bad).unwrap(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn a_tick_polls_every_endpoint_when_metrics_are_configured() {
    let host = Host::new();
    let vm = host.load(wasm()).unwrap();
    let metrics = json!({ "metrics": { "cluster": "models", "intervalMs": 500 } });
    assert!(
        vm.configure(1, &config(metrics)).unwrap(),
        "{}",
        vm.log_text()
    );
    assert_eq!(vm.tick_period_ms(1), Some(500));
    host.advance_ms(500);
    vm.tick().unwrap();
    let calls = vm.pending_calls();
    assert_eq!(calls.len(), 3, "{calls:?}");
    let mut targets: Vec<&str> = calls.iter().map(|c| c.header(DEST).unwrap()).collect();
    targets.sort();
    assert_eq!(targets, EPS);
    for c in &calls {
        assert_eq!(
            (c.cluster.as_str(), c.header(":path")),
            ("models", Some("/metrics"))
        );
        assert!(c.timeout_ms > 0);
    }
    let text = b"vllm:num_requests_running{model_name=\"m\"} 1\nvllm:num_requests_waiting{model_name=\"m\"} 0\n";
    vm.complete_call(calls[0].token, 200, &[], text).unwrap();
    vm.complete_call(calls[1].token, 503, &[], b"").unwrap();
    vm.fail_call(calls[2].token).unwrap();
    assert_eq!(vm.metric("tokenaware_polls_ok"), Some(1));
    assert_eq!(vm.metric("tokenaware_polls_failed"), Some(2));
    // No second poll of an endpoint while one is in flight; all answered, so all again.
    host.advance_ms(500);
    vm.tick().unwrap();
    assert_eq!(vm.pending_calls().len(), 3);
}

/// Shared-data reads of `n` requests for one prompt, `gap_ms` apart, after a first one.
fn reads_per_request(extra: Value, gap_ms: u64, n: u64) -> f64 {
    let host = Host::new();
    let vm = host.load(wasm()).unwrap();
    assert!(
        vm.configure(1, &config(extra)).unwrap(),
        "{}",
        vm.log_text()
    );
    let body = chat_body(&system_prompt("reads"), "q");
    finish(&send(&vm, &body, 1));
    let before = host.shared_reads();
    for _ in 0..n {
        host.advance_ms(gap_ms);
        finish(&send(&vm, &body, 1));
    }
    (host.shared_reads() - before) as f64 / n as f64
}

#[test]
fn back_to_back_decisions_reuse_their_reads_in_the_built_filter() {
    // One request per ms: within `sharedReadMaxAgeMs` (5) a decision reuses the last
    // one's reads of the endpoints it did not write; a second apart it reads them all.
    let kept = reads_per_request(json!({}), 1, 20);
    let spaced = reads_per_request(json!({}), 1_000, 20);
    let never = reads_per_request(json!({ "sharedReadMaxAgeMs": 0 }), 1, 20);
    eprintln!("reads per request: kept {kept}, spaced {spaced}, never {never}");
    assert!(kept <= 5.0, "{kept} reads per request");
    assert!(spaced >= 9.0 && never >= 9.0, "{spaced} / {never}");
}

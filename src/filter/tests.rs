//! The filter through `FakeHost`: request and response paths, fallbacks, the ledger's
//! return to zero on every path, the poller lease, metric polls and discovery.

use std::rc::Rc;

use super::host::Level;
use super::http::{DECISION, DESTINATION, DESTINATION_SERVED, PEER_TOKEN};
use super::stats::endpoint_gauge_name;
use super::testing::{Dispatched, FakeHost};
use super::vm::Vm;
use super::{Action, HttpFilter, Root};
use crate::ledger::Load;
use crate::store::SharedStore;

const EPS: &str = r#""endpoints":[{"address":"127.0.0.1:8001"},{"address":"127.0.0.1:8002"},{"address":"127.0.0.1:8003"}]"#;
const CHAT: &str = "/v1/chat/completions";

/// Stats go out at once (`statsFlushMs` 0) unless `extra` says otherwise, so a test reads
/// them right after a request.
fn root(h: &FakeHost, extra: &str, id: u64) -> Root {
    let flush = if extra.contains("statsFlushMs") {
        ""
    } else {
        r#","statsFlushMs":0"#
    };
    configured(h, &format!("{{{EPS}{flush}{extra}}}"), id)
}

/// A root configured from `json` as VM `id`.
fn configured(h: &FakeHost, json: &str, id: u64) -> Root {
    match Root::configure(h, json.as_bytes(), id) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

/// Discovery only, every 100 ms, stats sent at once.
const DISCOVERY: &str = r#"{"discovery":{"adminCluster":"admin","modelCluster":"models","intervalMs":100},"statsFlushMs":0}"#;

fn vm(h: &FakeHost, extra: &str) -> Rc<Vm> {
    root(h, extra, 7).vm()
}

fn chat(system: &str, q: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        "max_tokens": 4
    })
    .to_string()
    .into_bytes()
}

/// `body` (a JSON object) asking for a streamed answer.
fn streamed(body: &[u8]) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["stream"] = serde_json::Value::Bool(true);
    v.to_string().into_bytes()
}

fn secret_prompt() -> Vec<u8> {
    chat(&"TOP-SECRET-PROMPT ".repeat(300), "question")
}

/// Runs the request side: headers, the body in two chunks, end of stream.
fn send(h: &FakeHost, vm: &Rc<Vm>, path: &str, body: &[u8]) -> (HttpFilter, Vec<Action>) {
    h.new_request(path, body);
    let mut f = HttpFilter::new(Some(vm.clone()));
    let mut acts = vec![f.on_request_headers(h, body.is_empty())];
    if !body.is_empty() && acts[0] == Action::Pause {
        let half = body.len() / 2;
        acts.push(f.on_request_body(h, half, false));
        acts.push(f.on_request_body(h, body.len(), true));
    }
    (f, acts)
}

/// Streams `chunks` as the answer's body (its headers already seen), then the stream ends.
fn stream_then_end(h: &FakeHost, f: &mut HttpFilter, chunks: &[&[u8]]) {
    for c in chunks {
        *h.response_body.borrow_mut() = c.to_vec();
        f.on_response_body(h, c.len(), false);
    }
    f.on_log(h);
}

/// Runs a successful response: 200 headers, one body chunk, end of stream.
fn respond(h: &FakeHost, f: &mut HttpFilter, body: &[u8]) {
    h.set_response_status(200);
    assert_eq!(f.on_response_headers(h, false), Action::Continue);
    *h.response_body.borrow_mut() = body.to_vec();
    assert_eq!(f.on_response_body(h, body.len(), true), Action::Continue);
    f.on_log(h);
}

/// The warnings logged so far that contain `text`.
fn warnings_with(h: &FakeHost, text: &str) -> Vec<String> {
    let logs = h.logs.borrow();
    logs.iter()
        .filter(|(l, m)| *l == Level::Warn && m.contains(text))
        .map(|(_, m)| m.clone())
        .collect()
}

fn loads(h: &FakeHost, vm: &Vm) -> Vec<Load> {
    let router = vm.router.borrow();
    (0..3)
        .map(|s| router.ledger.load(h, s, h.now.get()).unwrap())
        .collect()
}

fn assert_ledger_zero(h: &FakeHost, vm: &Vm) {
    assert!(
        loads(h, vm).iter().all(|l| *l == Load::default()),
        "{:?}",
        loads(h, vm)
    );
}

#[test]
fn routed_chat_request_sets_the_destination() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, acts) = send(&h, &vm, CHAT, &chat("system prompt", "hi"));
    assert_eq!(acts, vec![Action::Pause, Action::Pause, Action::Continue]);
    let dest = h.header_values(DESTINATION);
    assert_eq!(dest.len(), 1);
    let addrs: Vec<&str> = dest[0].split(',').collect();
    assert_eq!(addrs.len(), 3, "primary and two fallbacks: {dest:?}");
    assert!(addrs.iter().all(|a| a.starts_with("127.0.0.1:800")));
    assert_eq!(h.metric("tokenaware_requests_routed"), 1);
    assert_eq!(h.metric("tokenaware_decisions_cold"), 1);
    respond(&h, &mut f, b"{}");
    assert_eq!(h.metric("tokenaware_requests_released"), 1);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn shared_prefix_sticks() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let sys = "You are a careful assistant. ".repeat(200);
    let mut first = None;
    for q in 0..5 {
        let (mut f, _) = send(&h, &vm, CHAT, &chat(&sys, &format!("q{q}")));
        let d = h.header_values(DESTINATION)[0].clone();
        let primary = d.split(',').next().unwrap().to_string();
        assert_eq!(first.get_or_insert(primary.clone()), &primary);
        respond(&h, &mut f, b"x");
    }
    assert_eq!(h.metric("tokenaware_decisions_sticky"), 4);
    assert_eq!(h.histogram("tokenaware_hit_ratio_pct").len(), 5);
}

#[test]
fn client_destination_headers_are_stripped_on_every_request() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    for (path, body) in [
        (CHAT, chat("s", "q")),
        ("/v1/models", Vec::new()),
        (CHAT, b"not json".to_vec()),
    ] {
        h.new_request(path, &body);
        for (k, v) in [
            (DESTINATION, "10.9.9.9:1"),
            ("X-Gateway-Destination-Endpoint", "10.9.9.9:2"),
            (DESTINATION, "10.9.9.9:3"),
            (DESTINATION_SERVED, "10.9.9.9:4"),
        ] {
            h.request_headers
                .borrow_mut()
                .push((k.to_string(), v.as_bytes().to_vec()));
        }
        let mut f = HttpFilter::new(Some(vm.clone()));
        if f.on_request_headers(&h, body.is_empty()) == Action::Pause {
            f.on_request_body(&h, body.len(), true);
        }
        assert!(h.header_values(DESTINATION_SERVED).is_empty());
        let dest = h.header_values(DESTINATION);
        assert!(dest.iter().all(|d| !d.contains("10.9.9.9")), "{dest:?}");
        f.on_log(&h);
    }
    assert_eq!(h.metric("tokenaware_client_header_stripped"), 3);
    // Without a configured VM the headers still go.
    h.new_request(CHAT, b"{}");
    h.request_headers
        .borrow_mut()
        .push((DESTINATION.into(), b"10.9.9.9:1".to_vec()));
    let mut f = HttpFilter::new(None);
    assert_eq!(f.on_request_headers(&h, false), Action::Continue);
    assert!(h.header_values(DESTINATION).is_empty());
}

#[test]
fn absent_client_headers_are_not_removed() {
    // Envoy clears the route cache on every request-header removal: a request without the
    // headers must not pay for it.
    let h = FakeHost::new();
    let vm = vm(&h, "");
    h.new_request(CHAT, &chat("s", "q"));
    let before = h.calls.borrow().clone();
    let mut f = HttpFilter::new(Some(vm.clone()));
    assert_eq!(f.on_request_headers(&h, false), Action::Pause);
    let calls = h.calls_since(&before);
    assert_eq!(calls.get("remove_request_header"), None, "{calls:?}");
    f.on_request_body(&h, chat("s", "q").len(), true);
    f.on_log(&h);
    // Only the served header, in capitals: still removed, and counted as not the
    // destination header itself.
    h.new_request(CHAT, &chat("s", "q"));
    h.request_headers.borrow_mut().push((
        "X-Gateway-Destination-Endpoint-Served".into(),
        b"10.9.9.9:4".to_vec(),
    ));
    let mut f = HttpFilter::new(Some(vm.clone()));
    f.on_request_headers(&h, false);
    assert!(h.header_values(DESTINATION_SERVED).is_empty());
    assert_eq!(h.metric("tokenaware_client_header_stripped"), 0);
}

#[test]
fn other_paths_pass_untouched() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, acts) = send(&h, &vm, "/v1/models", b"{\"model\":\"m\"}");
    assert_eq!(acts, vec![Action::Continue]);
    assert!(h.header_values(DESTINATION).is_empty());
    assert_eq!(f.on_request_body(&h, 13, true), Action::Continue);
    respond(&h, &mut f, b"{}");
    assert_eq!(h.metric("tokenaware_requests_routed"), 0);
    assert_eq!(h.metric("tokenaware_fallback_no_body"), 0);
}

#[test]
fn parse_failures_fall_back_and_are_counted() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","decisionHeader":true"#);
    let cases: [(&[u8], &str); 4] = [
        (b"{not json", "tokenaware_fallback_not_json"),
        (b"[1,2]", "tokenaware_fallback_not_object"),
        (br#"{"messages":[]}"#, "tokenaware_fallback_no_model"),
        (
            br#"{"model":"m","stream":"yes","messages":[]}"#,
            "tokenaware_fallback_wrong_type",
        ),
    ];
    for (body, metric) in cases {
        let (mut f, acts) = send(&h, &vm, CHAT, body);
        assert_eq!(acts.last(), Some(&Action::Continue));
        assert!(h.header_values(DESTINATION).is_empty());
        assert_eq!(h.metric(metric), 1, "{metric}");
        respond(&h, &mut f, b"{}");
        let note = h.response_header_value(DECISION).unwrap();
        assert!(note.starts_with("reason=fallback"), "{note}");
    }
    // An inference path without a body.
    let (_, acts) = send(&h, &vm, CHAT, b"");
    assert_eq!(acts, vec![Action::Continue]);
    assert_eq!(h.metric("tokenaware_fallback_no_body"), 1);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn bodies_over_the_limit_pass_unrouted() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","maxBodyBytes":1000"#);
    let big = chat(&"x".repeat(5_000), "q");
    // Growing past the limit while buffering: stop buffering, continue.
    h.new_request(CHAT, &big);
    let mut f = HttpFilter::new(Some(vm.clone()));
    assert_eq!(f.on_request_headers(&h, false), Action::Pause);
    assert_eq!(f.on_request_body(&h, 600, false), Action::Pause);
    assert_eq!(f.on_request_body(&h, 1_200, false), Action::Continue);
    assert_eq!(f.on_request_body(&h, big.len(), true), Action::Continue);
    assert!(h.header_values(DESTINATION).is_empty());
    assert_eq!(h.metric("tokenaware_fallback_too_large"), 1);
    // A declared content-length over the limit: never paused.
    h.new_request(CHAT, &big);
    h.request_headers
        .borrow_mut()
        .push(("content-length".into(), big.len().to_string().into_bytes()));
    let mut f = HttpFilter::new(Some(vm.clone()));
    assert_eq!(f.on_request_headers(&h, false), Action::Continue);
    assert_eq!(f.on_request_body(&h, big.len(), true), Action::Continue);
    assert_eq!(h.metric("tokenaware_fallback_too_large"), 2);
    f.on_log(&h);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn first_body_byte_releases_prefill_and_the_end_releases_the_request() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, _) = send(&h, &vm, CHAT, &streamed(&chat(&"p".repeat(4_000), "q")));
    let l = loads(&h, &vm);
    let charged: Vec<&Load> = l.iter().filter(|l| l.requests == 1).collect();
    assert_eq!(charged.len(), 1);
    assert!(charged[0].tokens > 0);
    // Headers are not the first byte: vLLM sends them before prefill ends.
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    assert!(loads(&h, &vm).iter().any(|l| l.tokens > 0));
    *h.response_body.borrow_mut() = b"data: {}\n\n".to_vec();
    f.on_response_body(&h, 10, false);
    let l = loads(&h, &vm);
    assert!(l.iter().all(|l| l.tokens == 0 && l.prefilling == 0));
    assert_eq!(l.iter().map(|l| l.requests).sum::<u64>(), 1);
    f.on_log(&h);
    f.on_log(&h); // exactly once
    assert_ledger_zero(&h, &vm);
    assert_eq!(h.metric("tokenaware_requests_released"), 1);
    assert_eq!(h.metric("tokenaware_requests_failed_early"), 0);
}

#[test]
fn an_answer_not_streamed_is_released_once_at_its_end() {
    // It comes whole after its decode: its first body byte is no earlier news than its end,
    // so the prefill stays charged until `on_log`, which returns everything in one update.
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, _) = send(&h, &vm, CHAT, &chat(&"p".repeat(4_000), "q"));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    let before = h.calls.borrow().clone();
    *h.response_body.borrow_mut() = br#"{"choices":[],"usage":{"prompt_tokens":1000}}"#.to_vec();
    f.on_response_body(&h, 45, false);
    assert!(loads(&h, &vm)
        .iter()
        .any(|l| l.tokens > 0 && l.prefilling == 1));
    f.on_response_body(&h, 0, true);
    f.on_log(&h);
    assert_eq!(h.calls_since(&before).get("set"), Some(&1));
    assert_ledger_zero(&h, &vm);
    assert_eq!(h.metric("tokenaware_requests_released"), 1);
    assert_eq!(h.metric("tokenaware_requests_failed_early"), 0);
    // A streamed answer updates the ledger at its first byte and at its end.
    let (mut f, _) = send(&h, &vm, CHAT, &streamed(&chat(&"p".repeat(4_000), "q")));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    let before = h.calls.borrow().clone();
    f.on_response_body(&h, 45, false);
    f.on_log(&h);
    assert_eq!(h.calls_since(&before).get("set"), Some(&2));
    assert_ledger_zero(&h, &vm);
}

#[test]
fn a_request_the_endpoint_refuses_leaves_nothing_there() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","decisionHeader":true"#);
    let body = chat(&"shared ".repeat(2_000), "q");
    for status in [400, 429] {
        let (mut f, _) = send(&h, &vm, CHAT, &body);
        h.set_response_status(status);
        f.on_response_headers(&h, false);
        *h.response_body.borrow_mut() = b"{\"error\":\"maximum context length\"}".to_vec();
        f.on_response_body(&h, 34, true);
        f.on_log(&h);
        nothing_stayed(&h, &vm, &body, &status.to_string());
    }
    assert_eq!(h.metric("tokenaware_requests_refused"), 2);
    assert_eq!(h.metric("tokenaware_requests_failed_early"), 0);
    assert_eq!(h.metric("tokenaware_requests_released"), 4);
}

#[test]
fn failures_before_the_first_byte_roll_back_the_index() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","decisionHeader":true"#);
    let body = chat(&"shared ".repeat(2_000), "q");
    for early in ["reset", "5xx"] {
        let (mut f, _) = send(&h, &vm, CHAT, &body);
        assert!(h.response_header_value(DECISION).is_none());
        if early == "5xx" {
            h.set_response_status(503);
            f.on_response_headers(&h, false);
            *h.response_body.borrow_mut() = b"upstream connect error".to_vec();
            f.on_response_body(&h, 22, true);
        }
        f.on_log(&h);
        nothing_stayed(&h, &vm, &body, early);
    }
    assert_eq!(h.metric("tokenaware_requests_failed_early"), 2);
}

/// After a request that ended before the picked endpoint took it (`case`): nothing stays
/// charged, and nothing in the index (the same prompt is cold again). Then forgets that
/// one's placement too, for the next case.
fn nothing_stayed(h: &FakeHost, vm: &Rc<Vm>, body: &[u8], case: &str) {
    assert_ledger_zero(h, vm);
    let (mut g, _) = send(h, vm, CHAT, body);
    respond(h, &mut g, b"{}");
    let note = h.response_header_value(DECISION).unwrap();
    assert!(note.contains("reason=cold"), "{case}: {note}");
    let r = vm.router.borrow();
    for s in 0..3 {
        r.clear_slot(h, s).unwrap();
    }
}

#[test]
fn trailers_end_the_request() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let body = chat("s", "q");
    h.new_request(CHAT, &body);
    let mut f = HttpFilter::new(Some(vm.clone()));
    assert_eq!(f.on_request_headers(&h, false), Action::Pause);
    assert_eq!(f.on_request_body(&h, body.len(), false), Action::Pause);
    assert_eq!(f.on_request_trailers(&h), Action::Continue);
    assert_eq!(h.header_values(DESTINATION).len(), 1);
    respond(&h, &mut f, b"{}");
    assert_ledger_zero(&h, &vm);
}

#[test]
fn host_and_store_failures_fall_back() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let body = chat(&"z".repeat(3_000), "q");
    // The destination cannot be set: charge returned, counted, logged without the prompt.
    h.new_request(CHAT, &secret_prompt());
    let mut f = HttpFilter::new(Some(vm.clone()));
    f.on_request_headers(&h, false);
    h.headers_locked.set(true);
    assert_eq!(
        f.on_request_body(&h, secret_prompt().len(), true),
        Action::Continue
    );
    h.headers_locked.set(false);
    assert_eq!(h.metric("tokenaware_fallback_internal"), 1);
    f.on_log(&h);
    assert_ledger_zero(&h, &vm);
    // Shared data down.
    h.new_request(CHAT, &body);
    let mut f = HttpFilter::new(Some(vm.clone()));
    f.on_request_headers(&h, false);
    h.store_down.set(true);
    assert_eq!(f.on_request_body(&h, body.len(), true), Action::Continue);
    h.store_down.set(false);
    assert!(h.header_values(DESTINATION).is_empty());
    assert_eq!(h.metric("tokenaware_fallback_store"), 1);
    f.on_log(&h);
    assert_ledger_zero(&h, &vm);
    let logs = h.logs.borrow();
    assert!(!logs.is_empty());
    assert!(logs.iter().all(|(_, m)| !m.contains("TOP-SECRET")));
}

#[test]
fn usage_is_counted_from_the_response_tail() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q"));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    let chunks: [&[u8]; 3] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n",
        b"data: [DONE]\n\n",
    ];
    stream_then_end(&h, &mut f, &chunks);
    assert_eq!(h.metric("tokenaware_usage_prompt_tokens"), 120);
    assert_eq!(h.metric("tokenaware_usage_cached_tokens"), 64);
    let ratio = h.histogram("tokenaware_prompt_tokens_per_100_estimated");
    assert_eq!(ratio.len(), 1);
    assert!(
        ratio[0] > 100,
        "120 served for a ~20-token estimate: {ratio:?}"
    );
}

#[test]
fn debug_path_answers_locally_without_prompt_text() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","debugPath":"/debug/tokenaware""#);
    let (mut f, _) = send(&h, &vm, CHAT, &secret_prompt());
    h.new_request("/debug/tokenaware", b"");
    let mut d = HttpFilter::new(Some(vm.clone()));
    assert_eq!(d.on_request_headers(&h, true), Action::Pause);
    let sent = h.sent.borrow().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, 200);
    let v: serde_json::Value = serde_json::from_slice(&sent[0].1).unwrap();
    let eps = v["endpoints"].as_array().unwrap();
    assert_eq!(eps.len(), 3);
    let active: u64 = eps
        .iter()
        .map(|e| e["activeRequests"].as_u64().unwrap())
        .sum();
    assert_eq!(active, 1);
    assert!(!String::from_utf8_lossy(&sent[0].1).contains("TOP-SECRET"));
    f.on_log(&h);
    // Off by default: the path is proxied like any other.
    let vm2 = self::vm(&h, "");
    h.new_request("/debug/tokenaware", b"");
    let mut d = HttpFilter::new(Some(vm2));
    assert_eq!(d.on_request_headers(&h, true), Action::Continue);
}

#[test]
fn invalid_config_names_the_field() {
    let h = FakeHost::new();
    for (json, field) in [
        (
            r#"{"endpoints":[{"address":"nope"}]}"#,
            "endpoints[0].address",
        ),
        (r#"{"affinityThreshold":3}"#, "affinityThreshold"),
        (
            r#"{"endpoints":[],"metrics":{"cluster":""}}"#,
            "metrics.cluster",
        ),
    ] {
        match Root::configure(&h, json.as_bytes(), 1) {
            Ok(_) => panic!("{json} accepted"),
            Err(e) => assert!(e.to_string().contains(field), "{e}"),
        }
    }
}

const METRICS: &str = r#","metrics":{"cluster":"models","intervalMs":100,"timeoutMs":50}"#;

#[test]
fn every_vm_reports_its_linear_memory_once() {
    use super::host::VmMemory;
    use super::stats::{VMS, VM_MEMORY, VM_MEMORY_MAX};
    let h = FakeHost::new();
    let (mut a, mut a2, mut b) = (root(&h, "", 1), root(&h, "", 2), root(&h, "", 3));
    let mem = |instance: u64, mib: u64| {
        Some(VmMemory {
            instance,
            bytes: mib << 20,
        })
    };
    // Roots a and a2 live in one VM instance (a reconfiguration), b in another; only one
    // of them holds the poller lease, all report.
    h.vm_memory.set(mem(10, 2));
    a.on_tick(&h);
    a2.on_tick(&h);
    h.vm_memory.set(mem(20, 3));
    b.on_tick(&h);
    assert_eq!(h.metric(VM_MEMORY), 5 << 20);
    assert_eq!(h.metric(VM_MEMORY_MAX), 3 << 20);
    assert_eq!(h.metric(VMS), 2);
    // VM 20 is gone; VM 10 grew.
    h.now.set(h.now.get() + 20_000);
    h.vm_memory.set(mem(10, 4));
    a.on_tick(&h);
    assert_eq!(h.metric(VM_MEMORY), 4 << 20);
    assert_eq!(h.metric(VMS), 1);
}

#[test]
fn one_poller_per_process_and_polls_reach_each_endpoint() {
    let h = FakeHost::new();
    let mut a = root(&h, METRICS, 1);
    let mut b = root(&h, METRICS, 2);
    a.on_tick(&h);
    b.on_tick(&h);
    let calls = h.take_dispatched();
    assert_eq!(calls.len(), 3, "only the lease holder polls");
    for (c, port) in calls.iter().zip(["8001", "8002", "8003"]) {
        assert_eq!(c.cluster, "models");
        assert_eq!(c.timeout_ms, 50);
        let dest = c.headers.iter().find(|(k, _)| k == DESTINATION).unwrap();
        assert_eq!(dest.1, format!("127.0.0.1:{port}"));
    }
    // Answers: each endpoint reports its own queue; the other VM sees the table.
    for (c, waiting) in calls.iter().zip([3, 5, 7]) {
        let text = format!(
            "vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.{waiting}\nvllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"4096\"}} 1\n"
        );
        h.set_call_answer(Some(200), text.as_bytes());
        a.on_call_response(&h, c.token, 3, text.len());
    }
    let t = b.vm().table(&h);
    let waiting: Vec<Option<f64>> = t.endpoints.iter().map(|e| e.waiting).collect();
    assert_eq!(waiting, vec![Some(3.0), Some(5.0), Some(7.0)]);
    let kv: Vec<Option<f64>> = t.endpoints.iter().map(|e| e.kv_usage).collect();
    assert_eq!(kv, vec![Some(0.3), Some(0.5), Some(0.7)]);
    assert!(t
        .endpoints
        .iter()
        .all(|e| e.capacity_blocks == 4096 * 16 / 64));
    assert_eq!(h.metric("tokenaware_polls_ok"), 3);
    // Still in flight: no second poll of the same endpoint.
    h.now.set(h.now.get() + 200);
    a.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 3);
    a.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 0, "polls still in flight");
    // The lease expires when its holder stops ticking; then b takes over.
    h.now.set(h.now.get() + 10_000);
    b.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 3);
    a.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 0);
    assert!(h.metric(&endpoint_gauge_name(2)) >= 0);
}

#[test]
fn failed_polls_take_an_endpoint_out_of_rotation() {
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    let vm = r.vm();
    for round in 0..2 {
        h.now.set(h.now.get() + 1_000);
        r.on_tick(&h);
        for c in h.take_dispatched() {
            let dead = c
                .headers
                .iter()
                .any(|(k, v)| k == DESTINATION && v.ends_with("8002"));
            if dead {
                h.set_call_answer(None, b"");
                r.on_call_response(&h, c.token, 0, 0);
            } else {
                h.set_call_answer(Some(200), b"vllm:num_requests_waiting 0\n");
                r.on_call_response(&h, c.token, 2, 27);
            }
        }
        let healthy = vm.table(&h).endpoints[1].healthy;
        assert_eq!(healthy, round == 0, "round {round}");
    }
    assert_eq!(h.metric("tokenaware_polls_failed"), 2);
    // The log names the endpoint and what its polls met.
    assert!(
        h.logs.borrow().iter().any(|(l, m)| *l == Level::Warn
            && m.contains("8002 failed 2 polls (no answer); out of rotation")),
        "{:?}",
        h.logs.borrow()
    );
    for q in 0..10 {
        let (mut f, _) = send(&h, &vm, CHAT, &chat(&format!("s{q}"), "q"));
        assert!(!h.header_values(DESTINATION)[0].contains("8002"));
        respond(&h, &mut f, b"{}");
    }
}

#[test]
fn discovery_reconciles_the_table() {
    let h = FakeHost::new();
    let mut r = configured(&h, DISCOVERY, 1);
    let vm = r.vm();
    let (_, acts) = send(&h, &vm, CHAT, &chat("s", "q"));
    assert_eq!(acts.last(), Some(&Action::Continue));
    assert_eq!(h.metric("tokenaware_fallback_no_endpoints"), 1);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].cluster, "admin");
    let host = |port: u16, hs: serde_json::Value| serde_json::json!({"address":{"socket_address":{"address":"10.0.0.1","port_value":port}},"health_status":hs});
    let clusters = serde_json::json!({"cluster_statuses":[
        {"name":"admin","host_statuses":[host(9901, serde_json::json!({}))]},
        {"name":"models","host_statuses":[
            host(80, serde_json::json!({"eds_health_status":"HEALTHY"})),
            host(81, serde_json::json!({"eds_health_status":"HEALTHY","failed_outlier_check":true})),
            host(82, serde_json::json!({"eds_health_status":"UNHEALTHY"})),
            host(83, serde_json::json!({"eds_health_status":"HEALTHY"})),
        ]}
    ]})
    .to_string();
    h.set_call_answer(Some(200), clusters.as_bytes());
    r.on_call_response(&h, calls[0].token, 4, clusters.len());
    assert_eq!(h.metric("tokenaware_discovery_ok"), 1);
    let t = vm.table(&h);
    let seen: Vec<(&str, bool)> = t
        .endpoints
        .iter()
        .map(|e| (e.address.as_str(), e.healthy))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("10.0.0.1:80", true),
            ("10.0.0.1:81", false),
            ("10.0.0.1:82", false),
            ("10.0.0.1:83", true)
        ]
    );
    for _ in 0..6 {
        let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q"));
        let d = &h.header_values(DESTINATION)[0];
        assert!(
            d.starts_with("10.0.0.1:80") || d.starts_with("10.0.0.1:83"),
            "{d}"
        );
        assert!(!d.contains(":81") && !d.contains(":82"));
        respond(&h, &mut f, b"{}");
    }
    // A failed discovery keeps the table.
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    h.set_call_answer(Some(503), b"");
    r.on_call_response(&h, calls[0].token, 1, 0);
    assert_eq!(h.metric("tokenaware_discovery_failed"), 1);
    assert_eq!(vm.table(&h).endpoints.len(), 4);
}

#[test]
fn two_vms_share_the_tables_and_the_ledger_returns_to_zero() {
    let h = FakeHost::new();
    let a = vm(&h, "");
    let b = root(&h, "", 99).vm();
    let sys = "Shared system prompt. ".repeat(300);
    let mut open = Vec::new();
    let mut primaries = std::collections::BTreeSet::new();
    for q in 0..8 {
        let which = if q % 2 == 0 { &a } else { &b };
        let (f, _) = send(&h, which, CHAT, &chat(&sys, &format!("q{q}")));
        let d = h.header_values(DESTINATION)[0].clone();
        primaries.insert(d.split(',').next().unwrap().to_string());
        open.push(f);
    }
    assert_eq!(primaries.len(), 1, "{primaries:?}");
    for mut f in open {
        respond(&h, &mut f, b"{}");
    }
    assert_eq!(
        h.metric("tokenaware_requests_routed"),
        h.metric("tokenaware_requests_released")
    );
    assert_ledger_zero(&h, &a);
}

#[test]
fn an_answer_from_a_fallback_undoes_the_pick() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","decisionHeader":true"#);
    let body = chat(&"prefix ".repeat(2_000), "q");
    let (mut f, _) = send(&h, &vm, CHAT, &body);
    let dest = h.header_values(DESTINATION)[0].clone();
    let fallback = dest.split(',').nth(1).unwrap().to_string();
    *h.upstream.borrow_mut() = Some(fallback);
    // In the first attempt: override_host passed over a host Envoy holds unhealthy.
    h.set_response_status(200);
    h.response_headers
        .borrow_mut()
        .push(("x-envoy-attempt-count".into(), b"1".to_vec()));
    assert_eq!(f.on_response_headers(&h, false), Action::Continue);
    *h.response_body.borrow_mut() = b"{}".to_vec();
    f.on_response_body(&h, 2, true);
    f.on_log(&h);
    assert_eq!(h.metric("tokenaware_served_by_fallback"), 1);
    assert_eq!(h.metric("tokenaware_requests_released"), 1);
    assert_ledger_zero(&h, &vm);
    // The picked endpoint was not recorded as holding the prefix.
    *h.upstream.borrow_mut() = None;
    let (mut g, _) = send(&h, &vm, CHAT, &body);
    respond(&h, &mut g, b"{}");
    let note = h.response_header_value(DECISION).unwrap();
    assert!(note.contains("reason=cold"), "{note}");
    // Answered by the picked endpoint: nothing undone.
    let (mut k, _) = send(&h, &vm, CHAT, &body);
    let picked = h.header_values(DESTINATION)[0]
        .split(',')
        .next()
        .unwrap()
        .to_string();
    *h.upstream.borrow_mut() = Some(picked);
    respond(&h, &mut k, b"{}");
    assert!(h
        .response_header_value(DECISION)
        .unwrap()
        .contains("reason=sticky"));
    assert_eq!(h.metric("tokenaware_served_by_fallback"), 1);
}

/// One poll round: every endpoint answers with `text(port)` (or fails when it is `None`).
fn poll_round(h: &FakeHost, r: &mut Root, text: impl Fn(&str) -> Option<String>) {
    h.now.set(h.now.get() + 1_000);
    r.on_tick(h);
    for c in h.take_dispatched() {
        let dest = c.headers.iter().find(|(k, _)| k == DESTINATION).unwrap();
        let port = dest.1.rsplit(':').next().unwrap().to_string();
        match text(&port) {
            Some(t) => {
                h.set_call_answer(Some(200), t.as_bytes());
                r.on_call_response(h, c.token, 2, t.len());
            }
            None => {
                h.set_call_answer(None, b"");
                r.on_call_response(h, c.token, 0, 0);
            }
        }
    }
}

fn queries(n: u64) -> Option<String> {
    Some(format!(
        "vllm:prefix_cache_queries_total{{model_name=\"m\"}} {n}.0\n"
    ))
}

/// The decision reason of a request for `body` (answered by the picked endpoint).
fn reason_of(h: &FakeHost, vm: &Rc<Vm>, body: &[u8]) -> (String, String) {
    let (mut f, _) = send(h, vm, CHAT, body);
    let picked = h.header_values(DESTINATION)[0]
        .split(',')
        .next()
        .unwrap()
        .to_string();
    respond(h, &mut f, b"{}");
    let note = h.response_header_value(DECISION).unwrap();
    let reason = note
        .split("reason=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap();
    (picked, reason.to_string())
}

#[test]
fn requests_another_sender_put_on_the_servers_narrow_cold_placement() {
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    let vm = r.vm();
    let running = |n: u32| move |_: &str| Some(format!("vllm:num_requests_running {n}\n"));
    let choices = |vm: &Rc<Vm>| vm.router.borrow().params.cold_choices;
    // Servers that count no more than this gateway sent: any endpoint.
    poll_round(&h, &mut r, running(0));
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q0"));
    respond(&h, &mut f, b"{}");
    assert_eq!(choices(&vm), 0);
    // Four requests on each server, none of them ours: another gateway (after a few rounds;
    // one scrape decides nothing).
    poll_round(&h, &mut r, running(4));
    assert!(!vm.table(&h).foreign.seen);
    for _ in 0..3 {
        poll_round(&h, &mut r, running(4));
    }
    assert!(vm.table(&h).foreign.seen);
    poll_round(&h, &mut r, running(4)); // its tick sends the gauges of the round before
    assert_eq!(h.metric("tokenaware_foreign_requests_pct"), 100);
    assert_eq!(h.metric("tokenaware_other_senders_seen"), 1);
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q1"));
    respond(&h, &mut f, b"{}");
    assert_eq!(choices(&vm), crate::router::REPLICA_COLD_CHOICES);
    // The other gateway stops sending: back to any endpoint once the servers go quiet.
    for _ in 0..10 {
        poll_round(&h, &mut r, running(0));
    }
    assert!(!vm.table(&h).foreign.seen);
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q2"));
    respond(&h, &mut f, b"{}");
    assert_eq!(choices(&vm), 0);
    // A configured number stands whatever the servers count.
    let h = FakeHost::new();
    let mut r = root(&h, &format!(r#"{METRICS},"coldPlacementChoices":3"#), 1);
    let vm = r.vm();
    for _ in 0..4 {
        poll_round(&h, &mut r, running(4));
    }
    assert!(vm.table(&h).foreign.seen);
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q1"));
    respond(&h, &mut f, b"{}");
    assert_eq!(choices(&vm), 3);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn replicas_whose_cold_prompts_come_back_cached_lean_to_the_first_choice() {
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    let vm = r.vm();
    let running = |n: u32| move |_: &str| Some(format!("vllm:num_requests_running {n}\n"));
    let shared = |vm: &Rc<Vm>| vm.router.borrow().params.shared_prefixes;
    for _ in 0..4 {
        poll_round(&h, &mut r, running(4));
    }
    assert!(vm.table(&h).foreign.seen);
    // Prompts new to this gateway (each its own system prompt) that the servers had cached:
    // another replica sent them first.
    let usage =
        br#"{"usage":{"prompt_tokens":1200,"prompt_tokens_details":{"cached_tokens":1200}}}"#;
    for i in 0..12 {
        let system = format!("{i} {}", "s".repeat(4_800));
        let (mut f, _) = send(&h, &vm, CHAT, &chat(&system, "q"));
        // Ten placements before one is enough to tell.
        assert_eq!(shared(&vm), i >= 10, "request {i}");
        respond(&h, &mut f, usage);
    }
    let (mut f, _) = send(&h, &vm, CHAT, &chat("another", "q"));
    respond(&h, &mut f, b"{}");
    assert!(shared(&vm));
    poll_round(&h, &mut r, running(4));
    poll_round(&h, &mut r, running(4));
    assert_eq!(h.metric("tokenaware_cache_prefixes_kept"), 12);
    assert_eq!(h.metric("tokenaware_cold_found_cached_pct"), 100);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn a_cold_restart_clears_the_endpoints_index() {
    let h = FakeHost::new();
    let mut r = root(&h, &format!("{METRICS},\"decisionHeader\":true"), 1);
    let vm = r.vm();
    let body = chat(&"restart me ".repeat(2_000), "q");
    let (warm, reason) = reason_of(&h, &vm, &body);
    assert_eq!(reason, "cold");
    let warm_port = warm.rsplit(':').next().unwrap().to_string();
    poll_round(&h, &mut r, |_| queries(5_000));
    // Counters that grow: nothing happens.
    poll_round(&h, &mut r, |_| queries(6_000));
    assert_eq!(reason_of(&h, &vm, &body), (warm.clone(), "sticky".into()));
    assert_eq!(h.metric("tokenaware_endpoint_resets"), 0);
    // The warm endpoint's counter went back: it restarted between two polls.
    poll_round(&h, &mut r, |p| {
        queries(if p == warm_port { 12 } else { 7_000 })
    });
    assert_eq!(h.metric("tokenaware_endpoint_resets"), 1);
    let (_, reason) = reason_of(&h, &vm, &body);
    assert_eq!(
        reason, "cold",
        "the restarted endpoint still counted as warm"
    );
    assert_ledger_zero(&h, &vm);
}

#[test]
fn an_endpoint_back_from_failed_polls_is_cold() {
    let h = FakeHost::new();
    let mut r = root(&h, &format!("{METRICS},\"decisionHeader\":true"), 1);
    let vm = r.vm();
    let body = chat(&"down and up ".repeat(2_000), "q");
    let (warm, _) = reason_of(&h, &vm, &body);
    let warm_port = warm.rsplit(':').next().unwrap().to_string();
    let plain = || Some("vllm:num_requests_waiting 0\n".to_string());
    poll_round(&h, &mut r, |_| plain());
    // One failed poll is not enough to call it down; it comes back warm.
    poll_round(&h, &mut r, |p| if p == warm_port { None } else { plain() });
    poll_round(&h, &mut r, |_| plain());
    assert_eq!(h.metric("tokenaware_endpoint_resets"), 0);
    assert_eq!(reason_of(&h, &vm, &body), (warm.clone(), "sticky".into()));
    // Out of rotation, then back: cold.
    for _ in 0..2 {
        poll_round(&h, &mut r, |p| if p == warm_port { None } else { plain() });
    }
    assert!(!vm.table(&h).get(&warm).unwrap().healthy);
    poll_round(&h, &mut r, |_| plain());
    assert!(vm.table(&h).get(&warm).unwrap().healthy);
    assert_eq!(h.metric("tokenaware_endpoint_resets"), 1);
    let (_, reason) = reason_of(&h, &vm, &body);
    assert_eq!(reason, "cold");
}

/// Answers the pending discovery call with hosts `10.0.0.1:{ports}`, all healthy.
fn discover(h: &FakeHost, r: &mut Root, ports: &[u16]) {
    h.now.set(h.now.get() + 1_000);
    r.on_tick(h);
    let calls = h.take_dispatched();
    let body = discovery_answer(ports);
    h.set_call_answer(Some(200), body.as_bytes());
    r.on_call_response(h, calls[0].token, 4, body.len());
}

/// Admin's `/clusters` answer listing hosts `10.0.0.1:{ports}` in the models cluster.
fn discovery_answer(ports: &[u16]) -> String {
    let hosts: Vec<serde_json::Value> = ports
        .iter()
        .map(|p| serde_json::json!({"address":{"socket_address":{"address":"10.0.0.1","port_value":p}}}))
        .collect();
    serde_json::json!({"cluster_statuses":[{"name":"models","host_statuses":hosts}]}).to_string()
}

#[test]
fn a_request_on_a_departed_endpoint_does_not_release_its_successor() {
    let h = FakeHost::new();
    let mut r = configured(&h, DISCOVERY, 1);
    let vm = r.vm();
    discover(&h, &mut r, &[80]);
    let (mut old, _) = send(&h, &vm, CHAT, &chat("on the old endpoint", "q"));
    assert!(h.header_values(DESTINATION)[0].starts_with("10.0.0.1:80"));
    // 80 leaves while its request is in flight; 81 joins and takes its slot.
    discover(&h, &mut r, &[81]);
    let t = vm.table(&h);
    assert_eq!(
        (t.endpoints[0].address.as_str(), t.endpoints[0].slot),
        ("10.0.0.1:81", 0)
    );
    let (mut new, _) = send(&h, &vm, CHAT, &chat("on the new endpoint", "q"));
    assert!(h.header_values(DESTINATION)[0].starts_with("10.0.0.1:81"));
    let load = |h: &FakeHost| vm.router.borrow().ledger.load(h, 0, h.now.get()).unwrap();
    assert_eq!(load(&h).requests, 1);
    // The old request ends: the new endpoint's request is still counted.
    h.set_response_status(200);
    old.on_response_headers(&h, false);
    *h.response_body.borrow_mut() = b"{}".to_vec();
    old.on_response_body(&h, 2, false);
    old.on_log(&h);
    assert_eq!(
        load(&h).requests,
        1,
        "the old request released the new one's charge"
    );
    assert!(load(&h).tokens > 0);
    respond(&h, &mut new, b"{}");
    assert_eq!(load(&h), Load::default());
    assert_eq!(h.metric("tokenaware_requests_released"), 2);
    assert_eq!(h.metric("tokenaware_release_errors"), 0);
}

#[test]
fn a_charge_made_on_a_table_from_before_a_clear_is_returned() {
    // A worker's kept read of the table (`sharedReadMaxAgeMs`) can predate a discovery, on
    // another worker, that gave the slot to a new endpoint: it charges the departed one on
    // the cleared slot, and must return that at the end all the same.
    let h = FakeHost::new();
    let mut poller = configured(&h, DISCOVERY, 1);
    let worker = configured(&h, DISCOVERY, 2).vm();
    discover(&h, &mut poller, &[80]);
    h.now.set(h.now.get() + 1_000);
    poller.on_tick(&h);
    let calls = h.take_dispatched();
    // The worker reads the table now and keeps the read.
    let (mut before, _) = send(&h, &worker, CHAT, &chat("before", "q"));
    respond(&h, &mut before, b"{}");
    // 1 ms later the poller's discovery swaps 80 for 81 on slot 0.
    let body = discovery_answer(&[81]);
    h.set_call_answer(Some(200), body.as_bytes());
    h.now.set(h.now.get() + 1);
    poller.on_call_response(&h, calls[0].token, 4, body.len());
    assert_eq!(worker.table(&h).endpoints[0].address, "10.0.0.1:81");
    // 1 ms after that the worker decides on its kept read: 80, on slot 0.
    h.now.set(h.now.get() + 1);
    let (mut stale, _) = send(&h, &worker, CHAT, &chat("stale", "q"));
    assert!(h.header_values(DESTINATION)[0].starts_with("10.0.0.1:80"));
    let load = |h: &FakeHost| {
        worker
            .router
            .borrow()
            .ledger
            .load(h, 0, h.now.get())
            .unwrap()
    };
    assert_eq!(load(&h).requests, 1);
    h.now.set(h.now.get() + 10);
    respond(&h, &mut stale, b"{}");
    assert_eq!(load(&h), Load::default(), "left on 81's slot");
    assert_eq!(h.metric("tokenaware_release_errors"), 0);
}

#[test]
fn an_endpoint_back_on_its_old_slot_keeps_its_new_charges() {
    // 80 leaves and comes back to slot 0 while a request on it is in flight: that request's
    // end must not take back what the new requests on 80 hold.
    let h = FakeHost::new();
    let mut r = configured(&h, DISCOVERY, 1);
    let vm = r.vm();
    discover(&h, &mut r, &[80]);
    let (mut old, _) = send(&h, &vm, CHAT, &chat("old", "q"));
    discover(&h, &mut r, &[]);
    discover(&h, &mut r, &[80]);
    assert_eq!(vm.table(&h).endpoints[0].slot, 0);
    h.now.set(h.now.get() + 10);
    let (mut new, _) = send(&h, &vm, CHAT, &chat("new", "q"));
    let load = |h: &FakeHost| vm.router.borrow().ledger.load(h, 0, h.now.get()).unwrap();
    let with_new = load(&h);
    assert_eq!(with_new.requests, 1);
    respond(&h, &mut old, b"{}");
    assert_eq!(
        load(&h),
        with_new,
        "the old request took back the new one's charge"
    );
    respond(&h, &mut new, b"{}");
    assert_eq!(load(&h), Load::default());
}

#[test]
fn a_new_configuration_takes_the_poller_lease() {
    let h = FakeHost::new();
    let mut old = root(&h, METRICS, 1);
    let mut old_peer = root(&h, METRICS, 2);
    old.on_tick(&h);
    old_peer.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 3, "one poller");
    // Same endpoints, a new τ: new roots while the old ones still tick.
    let mut new = root(&h, &format!("{METRICS},\"tau\":1234"), 3);
    for _ in 0..5 {
        h.now.set(h.now.get() + 1_000);
        old.on_tick(&h);
        old_peer.on_tick(&h);
        new.on_tick(&h);
        for c in h.take_dispatched() {
            h.set_call_answer(Some(200), b"vllm:num_requests_waiting 0\n");
            new.on_call_response(&h, c.token, 2, 27);
            old.on_call_response(&h, c.token, 2, 27);
        }
    }
    let lease = |h: &FakeHost| {
        let (v, _) = crate::store::SharedStore::get(h, "tokenaware/lease").unwrap();
        super::root::Lease::decode(&v.unwrap()).unwrap().owner
    };
    assert_eq!(lease(&h), 3, "the old configuration kept polling");
    // The old configuration again (a rollback) is newest once more.
    let mut back = root(&h, METRICS, 4);
    for _ in 0..5 {
        h.now.set(h.now.get() + 1_000);
        new.on_tick(&h);
        back.on_tick(&h);
        h.take_dispatched();
    }
    assert_eq!(lease(&h), 4);
}

#[test]
fn a_new_static_list_replaces_the_stored_table_and_keeps_slots() {
    let h = FakeHost::new();
    let mut a = root(&h, &format!("{METRICS},\"decisionHeader\":true"), 1);
    poll_round(&h, &mut a, |_| queries(1));
    let vm_a = a.vm();
    // Warm a prefix somewhere other than 8001.
    let mut body = Vec::new();
    let mut warm = String::new();
    for g in 0..20 {
        body = chat(&format!("keep me {g} ").repeat(500), "q");
        warm = reason_of(&h, &vm_a, &body).0;
        if !warm.ends_with("8001") {
            break;
        }
    }
    let slot = vm_a.table(&h).get(&warm).unwrap().slot;
    let json = r#"{"endpoints":[{"address":"127.0.0.1:8002"},{"address":"127.0.0.1:8003"},{"address":"127.0.0.1:8004"}],"decisionHeader":true,"statsFlushMs":0}"#;
    let b = configured(&h, json, 2);
    let vm_b = b.vm();
    let t = vm_b.table(&h);
    let seen: Vec<(&str, u16)> = t
        .endpoints
        .iter()
        .map(|e| (e.address.as_str(), e.slot))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("127.0.0.1:8002", 1),
            ("127.0.0.1:8003", 2),
            ("127.0.0.1:8004", 0)
        ]
    );
    assert_eq!(t.get(&warm).unwrap().slot, slot);
    assert_eq!(reason_of(&h, &vm_b, &body), (warm, "sticky".into()));
    for q in 0..6 {
        let (mut f, _) = send(&h, &vm_b, CHAT, &chat(&format!("s{q}"), "q"));
        assert!(!h.header_values(DESTINATION)[0].contains("8001"));
        respond(&h, &mut f, b"{}");
    }
}

#[test]
fn a_request_in_flight_across_a_reload_leaves_its_old_slots_new_owner_alone() {
    let h = FakeHost::new();
    let a = root(&h, "", 1);
    let vm_a = a.vm();
    // In flight on 8001 (slot 0) under the first configuration.
    let in_flight = |vm: &Rc<Vm>, want: &str| -> HttpFilter {
        for q in 0..50 {
            let (mut f, _) = send(
                &h,
                vm,
                CHAT,
                &chat(&format!("prompt {q} ").repeat(300), "q"),
            );
            if h.header_values(DESTINATION)[0].starts_with(want) {
                return f;
            }
            respond(&h, &mut f, b"{}");
        }
        panic!("never routed to {want}");
    };
    let mut old = in_flight(&vm_a, "127.0.0.1:8001,");
    // A reload drops 8001 and adds 8004, which takes its slot; a request is charged there.
    let json = r#"{"endpoints":[{"address":"127.0.0.1:8002"},{"address":"127.0.0.1:8003"},{"address":"127.0.0.1:8004"}],"statsFlushMs":0}"#;
    let vm_b = configured(&h, json, 2).vm();
    assert_eq!(vm_b.table(&h).get("127.0.0.1:8004").unwrap().slot, 0);
    let mut new = in_flight(&vm_b, "127.0.0.1:8004,");
    let charged = loads(&h, &vm_b)[0];
    assert_eq!(charged.requests, 1);
    // The old request ends (past `sharedReadMaxAgeMs`, its VM's kept reads of the table's
    // version are too old): its charge left with 8001, so 8004's stays as it was.
    h.now.set(h.now.get() + 10);
    respond(&h, &mut old, b"{}");
    assert_eq!(loads(&h, &vm_b)[0], charged);
    respond(&h, &mut new, b"{}");
    assert_ledger_zero(&h, &vm_b);
}

/// One request with a streamed (or not) answer whose first body byte comes `ttft_ms` after
/// the decision, and a final chunk carrying `usage`.
fn answer(h: &FakeHost, vm: &Rc<Vm>, stream: bool, ttft_ms: u64) {
    answer_then_wait(h, vm, stream, ttft_ms, 1_000);
}

/// `answer`, with `gap_ms` before the next request.
fn answer_then_wait(h: &FakeHost, vm: &Rc<Vm>, stream: bool, ttft_ms: u64, gap_ms: u64) {
    let body = serde_json::json!({
        "model": "m",
        "stream": stream,
        "messages": [{"role": "system", "content": "p".repeat(8_000)}, {"role": "user", "content": "q"}],
    })
    .to_string();
    let (mut f, _) = send(h, vm, CHAT, body.as_bytes());
    h.set_response_status(200);
    f.on_response_headers(h, false);
    h.now.set(h.now.get() + ttft_ms);
    let chunks: [&[u8]; 2] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2700}}\n\ndata: [DONE]\n\n",
    ];
    stream_then_end(h, &mut f, &chunks);
    h.now.set(h.now.get() + gap_ms);
}

/// TTFT samples the estimates hold, over every endpoint.
fn ttft_samples(h: &FakeHost, vm: &Vm) -> u64 {
    let r = vm.router.borrow();
    let table = vm.table(h);
    table
        .endpoints
        .iter()
        .map(|e| r.estimator.read(h, e.slot).map(|x| x.total).unwrap_or(0))
        .sum()
}

#[test]
fn streamed_first_bytes_and_usage_feed_the_estimates() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","peakPrefillThroughput":"auto""#);
    let samples = |h: &FakeHost| ttft_samples(h, &vm);
    answer(&h, &vm, false, 300);
    assert_eq!(
        samples(&h),
        0,
        "a non-streamed first byte is no TTFT sample"
    );
    for _ in 0..3 {
        answer(&h, &vm, true, 300);
    }
    assert_eq!(samples(&h), 3);
    assert_ledger_zero(&h, &vm);
    let bpt = vm
        .router
        .borrow()
        .estimator
        .bytes_per_token(&h, "m")
        .unwrap();
    assert!(
        bpt < 4.0,
        "2,700 served tokens for ~8 KB teach < 4 bytes/token: {bpt}"
    );
}

#[test]
fn an_answer_from_a_fallback_teaches_the_picked_endpoint_nothing() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","peakPrefillThroughput":"auto""#);
    let samples = |h: &FakeHost| ttft_samples(h, &vm);
    // Warm: the picked endpoint answers, one TTFT sample.
    answer(&h, &vm, true, 300);
    assert_eq!(samples(&h), 1);
    // The same prompt, a predicted hit; Envoy's fallback answers it, without the prefix.
    let body = serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [{"role": "system", "content": "p".repeat(8_000)}, {"role": "user", "content": "q"}],
    })
    .to_string();
    let (mut f, _) = send(&h, &vm, CHAT, body.as_bytes());
    let fallback = h.header_values(DESTINATION)[0]
        .split(',')
        .nth(1)
        .unwrap()
        .to_string();
    *h.upstream.borrow_mut() = Some(fallback);
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    h.now.set(h.now.get() + 300);
    let chunks: [&[u8]; 2] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2700,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n",
    ];
    stream_then_end(&h, &mut f, &chunks);
    assert_eq!(h.metric("tokenaware_served_by_fallback"), 1);
    // Neither its first byte nor its cache miss is the picked endpoint's.
    assert_eq!(samples(&h), 1);
    assert_eq!(h.metric("tokenaware_cache_predictions_missed"), 0);
    assert_eq!(h.metric("tokenaware_usage_prompt_tokens"), 2 * 2_700);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn without_learning_the_estimates_cost_no_shared_data() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    answer(&h, &vm, true, 300);
    let keys = h.store.len();
    for _ in 0..3 {
        answer(&h, &vm, true, 300);
    }
    // The same keys as after the first request: no estimate record was created.
    assert_eq!(h.store.len(), keys);
    // A warm request against three endpoints: what it costs in shared-data hostcalls.
    let before = h.calls.borrow().clone();
    answer(&h, &vm, true, 300);
    let calls = h.calls_since(&before);
    let count = |call| calls.get(call).copied().unwrap_or(0);
    let (reads, writes) = (count("get"), count("set"));
    // The table version, each endpoint's index header, ledger and a bucket or two, and the
    // charge, first byte and end as one CAS each (a hot prefix is not rewritten; its last use
    // is, at most once a second, and these requests are a second apart).
    assert!(reads <= 16 && writes <= 4, "{reads} reads, {writes} writes");
    let r = vm.router.borrow();
    for e in &vm.table(&h).endpoints {
        assert_eq!(r.estimator.read(&h, e.slot).unwrap().total, 0);
    }
    assert_eq!(
        r.estimator.bytes_per_token(&h, "m").unwrap(),
        r.cfg.bytes_per_token
    );
    drop(r);
    assert_ledger_zero(&h, &vm);
}

#[test]
fn back_to_back_decisions_reuse_recent_reads() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    answer(&h, &vm, true, 300);
    // Requests 1 ms apart (0 ms to first byte): within `sharedReadMaxAgeMs` (5) of each
    // other, a decision reuses the last one's reads of the endpoints it did not write.
    let before = h.calls.borrow().clone();
    for _ in 0..10 {
        answer_then_wait(&h, &vm, true, 0, 1);
    }
    let calls = h.calls_since(&before);
    let gets = calls.get("get").copied().unwrap_or(0);
    // Alone, each request reads the table version, three index headers, three first
    // buckets, a deeper bucket and three ledgers, and the picked ledger twice more (13).
    // Kept, only the picked ledger (written by the last request; then read again by the
    // first byte's and the end's updates) and each 5th decision's refresh are read.
    assert!(
        gets <= 10 * 6,
        "{gets} shared-data reads for 10 requests: {calls:?}"
    );
    assert_ledger_zero(&h, &vm);
    // Reading every time (`sharedReadMaxAgeMs` 0) costs the full count.
    let h = FakeHost::new();
    let vm = self::vm(&h, r#","sharedReadMaxAgeMs":0"#);
    answer(&h, &vm, true, 300);
    let before = h.calls.borrow().clone();
    for _ in 0..10 {
        answer_then_wait(&h, &vm, true, 0, 1);
    }
    let gets_fresh = h.calls_since(&before).get("get").copied().unwrap_or(0);
    assert!(gets_fresh >= 10 * 12, "{gets_fresh}");
}

#[test]
fn stats_are_held_until_a_tick_past_stats_flush_ms() {
    // The default holds updates: a request makes no stats hostcalls.
    let h = FakeHost::new();
    let mut r = root(&h, r#","statsFlushMs":1000"#, 7);
    let vm = r.vm();
    r.on_tick(&h);
    let before = h.calls.borrow().clone();
    for q in 0..3 {
        let (mut f, _) = send(&h, &vm, CHAT, &chat("s", &format!("q{q}")));
        respond(&h, &mut f, br#"{"usage":{"prompt_tokens":9}}"#);
    }
    let calls = h.calls_since(&before);
    assert!(!calls.contains_key("increment_metric"), "{calls:?}");
    assert!(!calls.contains_key("record_metric"), "{calls:?}");
    assert_eq!(h.metric("tokenaware_requests_routed"), 0);
    assert!(vm.stats.held_updates() > 0);
    // A tick before statsFlushMs keeps them; the first one after sends them, summed.
    h.now.set(h.now.get() + 500);
    r.on_tick(&h);
    assert_eq!(h.metric("tokenaware_requests_routed"), 0);
    h.now.set(h.now.get() + 500);
    r.on_tick(&h);
    assert_eq!(h.metric("tokenaware_requests_routed"), 3);
    assert_eq!(h.metric("tokenaware_usage_prompt_tokens"), 27);
    assert_eq!(h.histogram(super::stats::HIT_RATIO).len(), 3);
    assert_eq!(vm.stats.held_updates(), 0);
    // A VM being removed sends what it holds at once.
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q9"));
    respond(&h, &mut f, b"{}");
    assert_eq!(h.metric("tokenaware_requests_routed"), 3);
    r.on_done(&h);
    assert_eq!(h.metric("tokenaware_requests_routed"), 4);
    assert_eq!(vm.stats.held_updates(), 0);
}

#[test]
fn held_histogram_samples_are_bounded() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","statsFlushMs":60000"#);
    let n = super::stats::MAX_HELD_SAMPLES + 10;
    for _ in 0..n {
        vm.stats.hit_ratio(&h, 0.5);
    }
    // The bound sent the first MAX_HELD_SAMPLES at once; the rest wait.
    assert_eq!(
        h.histogram(super::stats::HIT_RATIO).len(),
        super::stats::MAX_HELD_SAMPLES
    );
    assert_eq!(vm.stats.held_updates(), 10);
}

#[test]
fn the_poller_caps_learned_capacities_by_the_fleet_share() {
    use crate::estimator::CacheCheck;
    let h = FakeHost::new();
    let mut r = root(&h, r#","peakPrefillThroughput":"auto""#, 1);
    let vm = r.vm();
    let reported = vm.table(&h).endpoints[0].capacity_blocks;
    let share = |slot| {
        let router = vm.router.borrow();
        let c = router.index.matched(&h, slot, &[]).unwrap().capacity;
        c as f64 / reported as f64
    };
    // Two endpoints learn that they keep half of what they report, the third holds.
    for _ in 0..40 {
        let router = vm.router.borrow();
        for (slot, check, depth) in [
            (0, CacheCheck::Missed, 0.5),
            (1, CacheCheck::Missed, 0.5),
            (2, CacheCheck::Held, 0.9),
        ] {
            router
                .estimator
                .observe_cache(&h, slot, check, Some(depth))
                .unwrap();
        }
    }
    assert_eq!(share(2), 1.0);
    r.on_tick(&h);
    for slot in 0..3 {
        assert!(
            (share(slot) - 0.5).abs() < 0.01,
            "slot {slot}: {}",
            share(slot)
        );
    }
}

#[test]
fn poll_records_of_departed_endpoints_are_dropped() {
    // Pods come and go under new addresses: what the poller keeps per endpoint must not
    // outlive the endpoint, or it grows for as long as the VM runs.
    let h = FakeHost::new();
    let json = format!(
        r#"{{"discovery":{{"adminCluster":"admin","modelCluster":"models","intervalMs":100}}{METRICS}}}"#
    );
    let mut r = configured(&h, &json, 1);
    for round in 0..40u16 {
        // Two endpoints a round, both new: one answers its polls with counters, the other
        // fails them.
        let ports = [1_000 + 2 * round, 1_001 + 2 * round];
        for _ in 0..2 {
            h.now.set(h.now.get() + 500);
            r.on_tick(&h);
            for c in h.take_dispatched() {
                answer_call(&h, &mut r, &c, &ports, u64::from(round));
            }
        }
        assert_eq!(r.poll_records(), 2, "round {round}");
    }
}

/// Answers a discovery call with hosts `10.0.0.1:{ports}`, a poll of the first port with a
/// query counter, and fails the others.
fn answer_call(h: &FakeHost, r: &mut Root, c: &Dispatched, ports: &[u16], counter: u64) {
    let text = match c.headers.iter().find(|(k, _)| k == DESTINATION) {
        None => {
            let hosts: Vec<serde_json::Value> = ports
                .iter()
                .map(|p| serde_json::json!({"address":{"socket_address":{"address":"10.0.0.1","port_value":p}}}))
                .collect();
            serde_json::json!({"cluster_statuses":[{"name":"models","host_statuses":hosts}]})
                .to_string()
        }
        Some((_, d)) if d.ends_with(&format!(":{}", ports[0])) => {
            queries(counter).unwrap_or_default()
        }
        Some(_) => {
            h.set_call_answer(None, b"");
            r.on_call_response(h, c.token, 0, 0);
            return;
        }
    };
    h.set_call_answer(Some(200), text.as_bytes());
    r.on_call_response(h, c.token, 2, text.len());
}

#[test]
fn the_poller_keeps_each_servers_own_prefill_rate() {
    // What the servers prefilled for every sender (queries less hits), for replicas to read
    // alike: 2,000 tokens a second here.
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    let vm = r.vm();
    let counters = |round: u64| {
        move |_: &str| {
            Some(format!(
                "vllm:prefix_cache_queries_total{{model_name=\"m\"}} {}.0\nvllm:prefix_cache_hits_total{{model_name=\"m\"}} {}.0\n",
                round * 3_000,
                round * 1_000
            ))
        }
    };
    let rates = |vm: &Rc<Vm>| -> Vec<Option<u64>> {
        let t = vm.table(&h);
        t.endpoints.iter().map(|e| e.served_work_per_s).collect()
    };
    poll_round(&h, &mut r, counters(0));
    assert!(rates(&vm).iter().all(|r| r.is_none()));
    // A second in, the work so far counts as a window's worth (as the ledger's own does).
    poll_round(&h, &mut r, counters(1));
    assert!(
        rates(&vm).iter().all(|r| *r == Some(200)),
        "{:?}",
        rates(&vm)
    );
    for round in 2..13 {
        poll_round(&h, &mut r, counters(round));
    }
    assert!(
        rates(&vm).iter().all(|r| *r == Some(2_000)),
        "{:?}",
        rates(&vm)
    );
    let debug: serde_json::Value = serde_json::from_slice(&vm.debug_json(&h)).unwrap();
    assert_eq!(debug["endpoints"][0]["serverPrefillTokensPerS"], 2_000);
}

const PEER_SECRET: &str = "replicas-secret-0123";
const PEERS: &str =
    r#","peers":{"clusters":["gateway_b"],"intervalMs":100,"token":"replicas-secret-0123"}"#;

/// A header of a dispatched call.
fn header_of<'a>(c: &'a Dispatched, name: &str) -> &'a str {
    &c.headers.iter().find(|(k, _)| k == name).unwrap().1
}

/// The `:path` of a dispatched call.
fn path_of(c: &Dispatched) -> &str {
    header_of(c, ":path")
}

/// The peer path of `vm`'s process, asked from `since` as a replica does: (status, body).
fn ask_peer(h: &FakeHost, vm: &Rc<Vm>, since: u64) -> (u32, Vec<u8>) {
    ask_peer_with(h, vm, since, Some(PEER_SECRET))
}

fn ask_peer_with(h: &FakeHost, vm: &Rc<Vm>, since: u64, token: Option<&str>) -> (u32, Vec<u8>) {
    ask_peer_at(h, vm, &format!("/tokenaware/peers?since={since}"), token)
}

/// The peer path of `vm`'s process at `path` (a poll's own path, with its ring).
fn ask_peer_at(h: &FakeHost, vm: &Rc<Vm>, path: &str, token: Option<&str>) -> (u32, Vec<u8>) {
    h.sent.borrow_mut().clear();
    h.new_request(path, b"");
    if let Some(t) = token {
        h.request_headers
            .borrow_mut()
            .push((PEER_TOKEN.into(), t.as_bytes().to_vec()));
    }
    let mut f = HttpFilter::new(Some(vm.clone()));
    assert_eq!(f.on_request_headers(h, true), Action::Pause);
    let sent = h.sent.borrow_mut().pop().unwrap();
    h.sent.borrow_mut().clear();
    sent
}

#[test]
fn a_replica_learns_where_its_peer_placed_a_prefix() {
    // Two Envoy processes: their own shared data, one fleet.
    let (ha, hb) = (FakeHost::new(), FakeHost::new());
    let a = vm(&ha, PEERS);
    let mut rb = root(&hb, PEERS, 2);
    let b = rb.vm();
    let sys = "You are the assistant of one tenant. ".repeat(100);
    let (mut f, _) = send(&ha, &a, CHAT, &chat(&sys, "first question"));
    let placed = ha.header_values(DESTINATION)[0]
        .split(',')
        .next()
        .unwrap()
        .to_string();
    respond(&ha, &mut f, b"{}");
    assert_eq!(ha.metric("tokenaware_peer_placements_shared"), 1);
    // B's poller asks A from the start.
    rb.on_tick(&hb);
    let calls = hb.take_dispatched();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].cluster, "gateway_b");
    let path = path_of(&calls[0]);
    assert_eq!(path, "/tokenaware/peers?since=0&ring=0");
    assert_eq!(header_of(&calls[0], PEER_TOKEN), PEER_SECRET);
    let (status, body) = ask_peer(&ha, &a, 0);
    assert_eq!(status, 200);
    assert!(!String::from_utf8_lossy(&body).contains("tenant"));
    hb.set_call_answer(Some(200), &body);
    rb.on_call_response(&hb, calls[0].token, 3, body.len());
    assert_eq!(hb.metric("tokenaware_peer_placements_learned"), 1);
    // B's first request of the prefix finds it warm where A put it.
    let (mut g, _) = send(&hb, &b, CHAT, &chat(&sys, "another question"));
    let dest = hb.header_values(DESTINATION)[0].clone();
    assert_eq!(dest.split(',').next().unwrap(), placed);
    assert_eq!(hb.metric("tokenaware_decisions_sticky"), 1);
    assert_eq!(hb.metric("tokenaware_decisions_cold"), 0);
    respond(&hb, &mut g, b"{}");
    // A warm pick is no new copy: nothing for A to learn back.
    assert_eq!(hb.metric("tokenaware_peer_placements_shared"), 0);
    // The next poll asks from where the answer ended.
    hb.now.set(hb.now.get() + 200);
    rb.on_tick(&hb);
    let calls = hb.take_dispatched();
    let path = path_of(&calls[0]);
    let ring = crate::peers::PlacementLog::new("tokenaware")
        .end(&ha.store)
        .unwrap()
        .ring;
    assert_ne!(ring, 0);
    assert_eq!(path, format!("/tokenaware/peers?since=1&ring={ring}"));
    // So does a poller that takes the lease over (another worker of B's process).
    let mut rb2 = root(&hb, PEERS, 3);
    hb.now.set(hb.now.get() + 10_000);
    rb2.on_tick(&hb);
    let calls = hb.take_dispatched();
    let path = path_of(&calls[0]);
    assert_eq!(path, format!("/tokenaware/peers?since=1&ring={ring}"));
}

#[test]
fn a_peer_answer_that_is_not_one_teaches_nothing() {
    let h = FakeHost::new();
    let mut r = root(&h, PEERS, 2);
    for (status, body) in [
        (Some(200), &b"<html>"[..]),
        (Some(500), &br#"{"next":1,"placements":[]}"#[..]),
        (None, &b""[..]),
    ] {
        h.now.set(h.now.get() + 200);
        r.on_tick(&h);
        let calls = h.take_dispatched();
        assert_eq!(calls.len(), 1);
        h.set_call_answer(status, body);
        r.on_call_response(
            &h,
            calls[0].token,
            usize::from(status.is_some()) * 3,
            body.len(),
        );
    }
    assert_eq!(h.metric("tokenaware_peer_polls_failed"), 3);
    assert_eq!(h.metric("tokenaware_peer_polls_ok"), 0);
    // A placement on an endpoint this gateway does not know is skipped.
    let unknown =
        br#"{"next":4,"placements":[{"endpoint":"10.9.9.9:1","blocks":"00000000000000ff"}]}"#;
    h.now.set(h.now.get() + 200);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    h.set_call_answer(Some(200), unknown);
    r.on_call_response(&h, calls[0].token, 3, unknown.len());
    assert_eq!(h.metric("tokenaware_peer_polls_ok"), 1);
    assert_eq!(h.metric("tokenaware_peer_placements_learned"), 0);
}

#[test]
fn only_a_replica_with_the_token_reads_the_placements() {
    let h = FakeHost::new();
    let a = vm(&h, PEERS);
    let sys = "You are the assistant of one tenant. ".repeat(100);
    let (mut f, _) = send(&h, &a, CHAT, &chat(&sys, "first question"));
    respond(&h, &mut f, b"{}");
    assert_eq!(h.metric("tokenaware_peer_placements_shared"), 1);
    let wrong = "replicas-secret-0124";
    for token in [None, Some(wrong), Some(""), Some("replicas-secret-01234")] {
        let (status, body) = ask_peer_with(&h, &a, 0, token);
        assert_eq!(status, 403, "{token:?}");
        assert!(!String::from_utf8_lossy(&body).contains("placements"));
    }
    assert_eq!(h.metric("tokenaware_peer_requests_refused"), 4);
    let (status, body) = ask_peer(&h, &a, 0);
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("placements"));
    // The token never reaches the log.
    assert!(h
        .logs
        .borrow()
        .iter()
        .all(|(_, m)| !m.contains(PEER_SECRET)));
}

#[test]
fn the_peer_token_goes_no_further_than_a_replica_that_answers_its_poll() {
    // A poll of a replica without `peers` (a rollout), a request on another path, or one
    // to a filter with no configuration: the token is removed before the request goes on.
    let h = FakeHost::new();
    let with_peers = vm(&h, PEERS);
    let without = vm(&FakeHost::new(), "");
    let cases = [
        (Some(without), "/tokenaware/peers?since=0&ring=0"),
        (Some(with_peers.clone()), CHAT),
        (Some(with_peers), "/healthz"),
        (None, "/tokenaware/peers?since=0&ring=0"),
    ];
    for (vm, path) in cases {
        h.new_request(path, b"");
        h.request_headers
            .borrow_mut()
            .push((PEER_TOKEN.into(), PEER_SECRET.as_bytes().to_vec()));
        let mut f = HttpFilter::new(vm);
        f.on_request_headers(&h, true);
        assert!(
            h.request_headers
                .borrow()
                .iter()
                .all(|(k, _)| !k.eq_ignore_ascii_case(PEER_TOKEN)),
            "{path}"
        );
    }
}

#[test]
fn a_peer_that_refuses_the_token_is_named_in_the_log() {
    let h = FakeHost::new();
    let mut r = root(&h, PEERS, 2);
    for _ in 0..3 {
        h.now.set(h.now.get() + 200);
        r.on_tick(&h);
        let calls = h.take_dispatched();
        h.set_call_answer(Some(403), br#"{"error":"forbidden"}"#);
        r.on_call_response(&h, calls[0].token, 3, 21);
    }
    assert_eq!(h.metric("tokenaware_peer_polls_failed"), 3);
    let warned = warnings_with(&h, "gateway_b");
    // The first refusal and the second (powers of two), not the third.
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(warned[0].contains("peers.token"));
    assert!(!warned[0].contains(PEER_SECRET));
}

/// `peers` as the hosts of one cluster, `gateways`, read through `admin`, plus `more` fields.
/// Admin's `/clusters` answer listing replicas `10.1.0.{i}:10000` in cluster `gateways`.
fn gateways_answer(hosts: &[u8]) -> String {
    let hosts: Vec<serde_json::Value> = hosts
        .iter()
        .map(|i| serde_json::json!({"address":{"socket_address":{"address":format!("10.1.0.{i}"),"port_value":10000}}}))
        .collect();
    serde_json::json!({"cluster_statuses":[{"name":"gateways","host_statuses":hosts}]}).to_string()
}

fn one_cluster_peers(more: &str) -> String {
    format!(
        r#","peers":{{"cluster":"gateways","adminCluster":"admin",{more},"token":"{PEER_SECRET}"}}"#
    )
}

#[test]
fn replicas_read_from_one_cluster_are_each_asked_and_this_one_is_left_out() {
    let peers = one_cluster_peers(r#""intervalMs":100"#);
    let (ha, hb) = (FakeHost::new(), FakeHost::new());
    let mut ra = root(&ha, &peers, 2);
    let a = ra.vm();
    let b = vm(&hb, &peers);
    // B places a prefix; A has placed nothing, yet its ring is named from the start.
    let sys = |who: &str| format!("You are the assistant of tenant {who}. ").repeat(100);
    let (mut f, _) = send(&hb, &b, CHAT, &chat(&sys("b"), "q"));
    respond(&hb, &mut f, b"{}");
    // First tick: the cluster's hosts are read from admin; no replica is known yet.
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].cluster.as_str(), path_of(&calls[0])),
        ("admin", "/clusters?format=json&filter=%5Egateways%24")
    );
    let body = gateways_answer(&[1, 2]);
    ha.set_call_answer(Some(200), body.as_bytes());
    ra.on_call_response(&ha, calls[0].token, 4, body.len());
    // Next tick: each host is asked through the one cluster, pinned by the override header.
    ha.now.set(ha.now.get() + 200);
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    assert_eq!(calls.len(), 2);
    let pinned: Vec<&str> = calls.iter().map(|c| header_of(c, DESTINATION)).collect();
    assert_eq!(pinned, ["10.1.0.1:10000", "10.1.0.2:10000"]);
    assert!(calls.iter().all(|c| c.cluster == "gateways"));
    assert!(calls
        .iter()
        .all(|c| header_of(c, PEER_TOKEN) == PEER_SECRET));
    // 10.1.0.1 is A itself (its own ring comes back); 10.1.0.2 is B.
    let (_, own) = ask_peer(&ha, &a, 0);
    let (_, theirs) = ask_peer(&hb, &b, 0);
    for (c, answer) in calls.iter().zip([own, theirs]) {
        ha.set_call_answer(Some(200), &answer);
        ra.on_call_response(&ha, c.token, 3, answer.len());
    }
    assert_eq!(ha.metric("tokenaware_peer_placements_learned"), 1);
    // From now on only B is asked, from where its answer ended.
    ha.now.set(ha.now.get() + 200);
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    assert_eq!(calls.len(), 1);
    assert_eq!(header_of(&calls[0], DESTINATION), "10.1.0.2:10000");
    assert!(
        path_of(&calls[0]).contains("since=1&"),
        "{}",
        path_of(&calls[0])
    );
    assert_eq!(ha.metric("tokenaware_peers"), 1);
    // B's prefix is warm on A where B put it.
    let (mut f, _) = send(&ha, &a, CHAT, &chat(&sys("b"), "another"));
    assert_eq!(ha.metric("tokenaware_decisions_sticky"), 1);
    respond(&ha, &mut f, b"{}");
    // A replica joins, sorted ahead of B: B is still asked from where it was (its poll in
    // flight fails, which leaves its cursor as it was).
    ha.set_call_answer(Some(503), b"");
    ra.on_call_response(&ha, calls[0].token, 3, 0);
    ha.now
        .set(ha.now.get() + crate::config::DEFAULT_MEMBERS_INTERVAL_MS);
    ra.on_tick(&ha);
    for c in ha.take_dispatched() {
        if c.cluster == "admin" {
            let body = gateways_answer(&[0, 1, 2]);
            ha.set_call_answer(Some(200), body.as_bytes());
            ra.on_call_response(&ha, c.token, 4, body.len());
        } else {
            ha.set_call_answer(Some(503), b"");
            ra.on_call_response(&ha, c.token, 3, 0);
        }
    }
    ha.now.set(ha.now.get() + 200);
    ra.on_tick(&ha);
    let asked: Vec<(String, String)> = ha
        .take_dispatched()
        .iter()
        .map(|c| {
            (
                header_of(c, DESTINATION).to_string(),
                path_of(c).to_string(),
            )
        })
        .collect();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(asked[0].0, "10.1.0.0:10000");
    assert!(asked[0].1.contains("since=0&"), "{asked:?}");
    assert_eq!(asked[1].0, "10.1.0.2:10000");
    assert!(asked[1].1.contains("since=1&"), "{asked:?}");
}

#[test]
fn a_placement_numbered_but_never_written_is_stepped_over() {
    let (ha, hb) = (FakeHost::new(), FakeHost::new());
    let a = vm(&ha, PEERS);
    let mut rb = root(&hb, PEERS, 2);
    let place = |who: &str| {
        let sys = format!("You are the assistant of tenant {who}. ").repeat(100);
        let (mut f, _) = send(&ha, &a, CHAT, &chat(&sys, "q"));
        respond(&ha, &mut f, b"{}");
    };
    place("one");
    // A VM of A numbers placement 1 and dies before writing it.
    let key = "tokenaware/pl/n";
    let (v, _) = ha.store.get(key).unwrap();
    let mut v = v.unwrap().to_vec();
    let n = u64::from_le_bytes(v[..8].try_into().unwrap());
    v[..8].copy_from_slice(&(n + 1).to_le_bytes());
    ha.store.set(key, &v, None).unwrap();
    place("two");
    // B's polls: the first brings placement 0 and stops at 1; two more stop there; then
    // B steps over it and gets placement 2.
    let mut asked = Vec::new();
    for _ in 0..4 {
        hb.now.set(hb.now.get() + 200);
        rb.on_tick(&hb);
        let calls = hb.take_dispatched();
        let path = path_of(&calls[0]).to_string();
        let (status, body) = ask_peer_at(&ha, &a, &path, Some(PEER_SECRET));
        assert_eq!(status, 200);
        hb.set_call_answer(Some(200), &body);
        rb.on_call_response(&hb, calls[0].token, 3, body.len());
        asked.push(path.split('&').next().unwrap_or("").to_string());
    }
    assert_eq!(
        asked,
        [
            "/tokenaware/peers?since=0",
            "/tokenaware/peers?since=1",
            "/tokenaware/peers?since=1",
            "/tokenaware/peers?since=2"
        ]
    );
    assert_eq!(hb.metric("tokenaware_peer_gaps_skipped"), 1);
    assert_eq!(hb.metric("tokenaware_peer_placements_learned"), 2);
}

#[test]
fn the_peer_path_is_off_unless_configured() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    h.new_request("/tokenaware/peers?since=0", b"");
    let mut f = HttpFilter::new(Some(vm));
    assert_eq!(f.on_request_headers(&h, true), Action::Continue);
    assert!(h.sent.borrow().is_empty());
}

/// How many placements `vm`'s process offers a peer that asks from the start.
fn placements_offered(h: &FakeHost, vm: &Rc<Vm>) -> usize {
    let (_, body) = ask_peer(h, vm, 0);
    crate::peers::PlacementBatch::from_json(&body)
        .unwrap()
        .placements
        .len()
}

#[test]
fn a_streamed_placement_is_shared_once_the_picked_endpoint_answers() {
    let h = FakeHost::new();
    let a = vm(&h, PEERS);
    let streamed = |who: &str| {
        serde_json::json!({
            "model": "m",
            "stream": true,
            "messages": [
                {"role": "system", "content": format!("You are the assistant of tenant {who}. ").repeat(100)},
                {"role": "user", "content": "q"},
            ],
        })
        .to_string()
        .into_bytes()
    };
    let shared = |h: &FakeHost| placements_offered(h, &a);
    // Refused (503): the placement is never told.
    let (mut f, _) = send(&h, &a, CHAT, &streamed("one"));
    assert_eq!(h.metric("tokenaware_decisions_cold"), 1);
    assert_eq!(shared(&h), 0, "told before the answer");
    h.set_response_status(503);
    f.on_response_headers(&h, true);
    f.on_log(&h);
    assert_eq!(shared(&h), 0);
    // Served by a fallback after a retry: the picked endpoint never saw it.
    let (mut f, _) = send(&h, &a, CHAT, &streamed("two"));
    *h.upstream.borrow_mut() = Some("10.9.9.9:1".into());
    respond(&h, &mut f, b"data: [DONE]\n\n");
    assert_eq!(shared(&h), 0);
    // The picked endpoint answers: told at its headers.
    *h.upstream.borrow_mut() = None;
    let (mut f, _) = send(&h, &a, CHAT, &streamed("three"));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    assert_eq!(shared(&h), 1);
    let chunk = b"data: {}\n\n";
    *h.response_body.borrow_mut() = chunk.to_vec();
    f.on_response_body(&h, chunk.len(), true);
    f.on_log(&h);
    assert_eq!(h.metric("tokenaware_peer_placements_shared"), 1);
    // Not streamed: told at once, since its answer comes whole at the end.
    let (mut f, _) = send(
        &h,
        &a,
        CHAT,
        &chat("You are a tenant of four. ".repeat(100).as_str(), "q"),
    );
    assert_eq!(shared(&h), 2);
    respond(&h, &mut f, b"{}");
}

#[test]
fn a_placement_told_before_its_answer_is_taken_back_when_the_request_fails() {
    let h = FakeHost::new();
    let a = vm(&h, PEERS);
    let shared = |h: &FakeHost| placements_offered(h, &a);
    let tenant = |who: &str| {
        chat(
            &format!("You are the assistant of tenant {who}. ").repeat(100),
            "q",
        )
    };
    // Not streamed: told at the decision. Refused (503): taken back.
    let (mut f, _) = send(&h, &a, CHAT, &tenant("one"));
    assert_eq!(shared(&h), 1);
    h.set_response_status(503);
    f.on_response_headers(&h, true);
    f.on_log(&h);
    assert_eq!(shared(&h), 0, "a refused placement is still offered");
    assert_eq!(h.metric("tokenaware_peer_placements_withdrawn"), 1);
    // Served by a fallback after a retry: the picked endpoint never saw it.
    let (mut f, _) = send(&h, &a, CHAT, &tenant("two"));
    *h.upstream.borrow_mut() = Some("10.9.9.9:1".into());
    respond(&h, &mut f, b"{}");
    assert_eq!(shared(&h), 0);
    assert_eq!(h.metric("tokenaware_peer_placements_withdrawn"), 2);
    // Reset before any answer: `on_log` alone.
    *h.upstream.borrow_mut() = None;
    let (mut f, _) = send(&h, &a, CHAT, &tenant("three"));
    f.on_log(&h);
    assert_eq!(shared(&h), 0);
    // Answered: it stays.
    let (mut f, _) = send(&h, &a, CHAT, &tenant("four"));
    respond(&h, &mut f, b"{}");
    assert_eq!(shared(&h), 1);
    // Streamed, told at its answer's headers, then reset before its first byte.
    let (mut f, _) = send(&h, &a, CHAT, &streamed(&tenant("five")));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    assert_eq!(shared(&h), 2);
    f.on_log(&h);
    assert_eq!(shared(&h), 1);
    assert_eq!(h.metric("tokenaware_peer_placements_withdrawn"), 4);
    assert_eq!(h.metric("tokenaware_peer_placements_shared"), 5);
}

#[test]
fn admin_is_asked_for_the_one_cluster_wanted() {
    use super::root::clusters_path;
    // Regex metacharacters escaped, the whole anchored, then percent-encoded.
    assert_eq!(
        clusters_path("outbound|8000||vllm.models.svc.cluster.local"),
        "/clusters?format=json&filter=%5Eoutbound%5C%7C8000%5C%7C%5C%7Cvllm%5C.models%5C.svc%5C.cluster%5C.local%24"
    );
    assert_eq!(
        clusters_path("httproute/models/llm/rule/0"),
        "/clusters?format=json&filter=%5Ehttproute%2Fmodels%2Fllm%2Frule%2F0%24"
    );
    assert_eq!(
        clusters_path("a+b(c)*"),
        "/clusters?format=json&filter=%5Ea%5C%2Bb%5C%28c%5C%29%5C%2A%24"
    );
    // Discovery asks for the model cluster alone.
    let h = FakeHost::new();
    let cfg = r#"{"discovery":{"adminCluster":"admin","modelCluster":"outbound|8000||m"}}"#;
    let mut r = configured(&h, cfg, 1);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].cluster, "admin");
    assert_eq!(
        path_of(&calls[0]),
        "/clusters?format=json&filter=%5Eoutbound%5C%7C8000%5C%7C%5C%7Cm%24"
    );
}

#[test]
fn a_discovery_that_keeps_failing_says_why_in_the_log() {
    let h = FakeHost::new();
    let mut r = configured(&h, DISCOVERY, 1);
    let warnings = |h: &FakeHost| warnings_with(h, "discovery failed");
    // Admin lists other clusters only (a misspelled modelCluster), five times in a row:
    // logged the first, second and fourth time, naming the field and the name looked for.
    let others = r#"{"cluster_statuses":[{"name":"modelz","host_statuses":[]}]}"#;
    for _ in 0..5 {
        h.now.set(h.now.get() + 200);
        r.on_tick(&h);
        let calls = h.take_dispatched();
        assert_eq!(calls.len(), 1);
        h.set_call_answer(Some(200), others.as_bytes());
        r.on_call_response(&h, calls[0].token, 4, others.len());
    }
    let w = warnings(&h);
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(
        w[0].contains("`models`") && w[0].contains("discovery.modelCluster"),
        "{w:?}"
    );
    assert!(w[2].contains("4 in a row"), "{w:?}");
    // Found: the count starts again. Then admin answers 503, and the admin cluster goes.
    let found = r#"{"cluster_statuses":[{"name":"models","host_statuses":[]}]}"#;
    h.now.set(h.now.get() + 200);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    h.set_call_answer(Some(200), found.as_bytes());
    r.on_call_response(&h, calls[0].token, 4, found.len());
    assert_eq!(h.metric("tokenaware_discovery_ok"), 1);
    h.now.set(h.now.get() + 200);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    h.set_call_answer(Some(503), b"");
    r.on_call_response(&h, calls[0].token, 1, 0);
    let w = warnings(&h);
    assert_eq!(w.len(), 4, "{w:?}");
    assert!(
        w[3].contains("1 in a row") && w[3].contains("answered 503"),
        "{w:?}"
    );
    h.unknown_clusters.borrow_mut().push("admin".into());
    h.now.set(h.now.get() + 200);
    r.on_tick(&h);
    let w = warnings(&h);
    assert_eq!(w.len(), 5, "{w:?}");
    assert!(w[4].contains("discovery.adminCluster `admin`"), "{w:?}");
    assert_eq!(h.metric("tokenaware_discovery_failed"), 7);
}

#[test]
fn a_peer_whose_polls_keep_failing_is_named_in_the_log_now_and_then() {
    let h = FakeHost::new();
    let mut r = root(&h, PEERS, 2);
    let warned = |h: &FakeHost| warnings_with(h, "peer gateway_b: poll failed");
    let poll = |h: &FakeHost, r: &mut Root, answer: Option<(u32, &[u8])>| {
        h.now.set(h.now.get() + 200);
        r.on_tick(h);
        let calls = h.take_dispatched();
        assert_eq!(calls.len(), 1);
        match answer {
            Some((status, body)) => {
                h.set_call_answer(Some(status), body);
                r.on_call_response(h, calls[0].token, 3, body.len());
            }
            None => {
                h.set_call_answer(None, b"");
                r.on_call_response(h, calls[0].token, 0, 0);
            }
        }
    };
    // Five failures in a row: logged at the first, second and fourth.
    for _ in 0..5 {
        poll(&h, &mut r, Some((503, b"upstream connect error")));
    }
    let w = warned(&h);
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(
        w[0].contains("status 503") && w[0].contains("1 in a row"),
        "{w:?}"
    );
    assert!(w[2].contains("4 in a row"), "{w:?}");
    // An answer starts the count again; the next failure is logged at once.
    poll(
        &h,
        &mut r,
        Some((200, br#"{"next":0,"ring":7,"placements":[]}"#)),
    );
    poll(&h, &mut r, None);
    let w = warned(&h);
    assert_eq!(w.len(), 4, "{w:?}");
    assert!(
        w[3].contains("no answer") && w[3].contains("1 in a row"),
        "{w:?}"
    );
    assert_eq!(h.metric("tokenaware_peer_polls_failed"), 6);
}

#[test]
fn the_replicas_are_read_from_admin_as_often_as_configured() {
    let peers = one_cluster_peers(r#""membersIntervalMs":1000"#);
    let h = FakeHost::new();
    let mut r = root(&h, &peers, 2);
    let none = r#"{"cluster_statuses":[{"name":"gateways","host_statuses":[]}]}"#;
    let mut asked = Vec::new();
    for _ in 0..8 {
        r.on_tick(&h);
        for c in h.take_dispatched() {
            asked.push(h.now.get());
            h.set_call_answer(Some(200), none.as_bytes());
            r.on_call_response(&h, c.token, 4, none.len());
        }
        h.now.set(h.now.get() + 500);
    }
    let t0 = asked[0];
    let at: Vec<u64> = asked.iter().map(|t| t - t0).collect();
    assert_eq!(at, [0, 1000, 2000, 3000]);
}

#[test]
fn replicas_that_cannot_be_read_from_admin_are_named_in_the_log() {
    let peers = one_cluster_peers(r#""intervalMs":100"#);
    let h = FakeHost::new();
    let mut r = root(&h, &peers, 2);
    let warned = |h: &FakeHost| warnings_with(h, "reading the replicas failed");
    // Admin lists no cluster of that name (a misspelled peers.cluster), three times.
    let others = r#"{"cluster_statuses":[{"name":"gateway","host_statuses":[]}]}"#;
    for _ in 0..3 {
        r.on_tick(&h);
        let calls = h.take_dispatched();
        assert_eq!(calls.len(), 1, "{calls:?}");
        h.set_call_answer(Some(200), others.as_bytes());
        r.on_call_response(&h, calls[0].token, 4, others.len());
        h.now
            .set(h.now.get() + crate::config::DEFAULT_MEMBERS_INTERVAL_MS);
    }
    let w = warned(&h);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains("no cluster named `gateways` (peers.cluster)") && w[0].contains("`admin`"),
        "{w:?}"
    );
    assert!(w[1].contains("2 in a row"), "{w:?}");
    // An admin cluster Envoy does not have: said at the fourth failure in a row.
    h.unknown_clusters.borrow_mut().push("admin".into());
    r.on_tick(&h);
    let w = warned(&h);
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(
        w[2].contains("could not call peers.adminCluster `admin`"),
        "{w:?}"
    );
    assert_eq!(h.metric("tokenaware_peers"), 0);
}

#[test]
fn polling_goes_on_after_the_wall_clock_steps_back() {
    let h = FakeHost::new().with_time(10_000_000);
    let mut r = root(&h, METRICS, 1);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    assert_eq!(calls.len(), 3);
    for c in &calls {
        h.set_call_answer(Some(200), b"vllm:num_requests_waiting 9\n");
        r.on_call_response(&h, c.token, 2, 28);
    }
    // An hour back (an NTP step): the next polls are not an hour away.
    h.now.set(10_000_000 - 3_600_000);
    let mut sent = 0;
    for _ in 0..5 {
        h.now.set(h.now.get() + 1_000);
        r.on_tick(&h);
        sent += h.take_dispatched().len();
    }
    assert!(sent >= 3, "{sent} polls");
    // A scrape from what is now the future is not taken for a fresh one.
    let t = r.vm().table(&h);
    assert!(t.endpoints[0].scraped(h.now.get(), 5_000).is_none());
}

#[test]
fn a_metrics_body_past_the_limit_loses_its_cut_line() {
    let cap = super::root::MAX_METRICS_BYTES;
    let head = "vllm:num_requests_waiting 1\n";
    let line = "vllm:prefix_cache_queries_total{model_name=\"m\"} 123456789\n";
    // A comment sized so the limit falls 5 bytes before the counter line's end.
    let comment = format!("#{}\n", "x".repeat(cap + 5 - head.len() - line.len() - 2));
    let text = format!("{head}{comment}{line}");
    assert_eq!(text.len(), cap + 5);
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    poll_round(&h, &mut r, |_| Some(line.to_string()));
    // Read cut, the counter would be 12345: a drop, taken for a restart of every endpoint.
    poll_round(&h, &mut r, |_| Some(text.clone()));
    assert_eq!(h.metric("tokenaware_endpoint_resets"), 0);
}

#[test]
fn a_newer_configuration_that_went_away_leaves_the_polling_to_the_older() {
    let h = FakeHost::new();
    let mut old = root(&h, METRICS, 1);
    poll_round(&h, &mut old, |_| {
        Some("vllm:num_requests_waiting 0\n".into())
    });
    {
        // Configured (its generation claimed), then gone before its first tick: a listener
        // update Envoy rejected after the plugin had started.
        let _gone = root(&h, &format!("{METRICS},\"tau\":1234"), 2);
    }
    let mut sent = 0;
    for _ in 0..10 {
        h.now.set(h.now.get() + 1_000);
        old.on_tick(&h);
        for c in h.take_dispatched() {
            h.set_call_answer(Some(200), b"vllm:num_requests_waiting 0\n");
            old.on_call_response(&h, c.token, 2, 27);
            sent += 1;
        }
    }
    assert!(sent >= 3, "{sent} polls");
    // A newer configuration whose roots do tick takes the polling over at once.
    let mut new = root(&h, &format!("{METRICS},\"tau\":4321"), 3);
    h.now.set(h.now.get() + 1_000);
    new.on_tick(&h);
    assert!(!h.take_dispatched().is_empty());
    for _ in 0..10 {
        h.now.set(h.now.get() + 1_000);
        old.on_tick(&h);
        assert!(h.take_dispatched().is_empty(), "the older one polled again");
        new.on_tick(&h);
        h.take_dispatched();
    }
}

#[test]
fn a_replica_taken_for_this_process_is_asked_again_later() {
    let peers = one_cluster_peers(r#""intervalMs":100"#);
    let ha = FakeHost::new();
    let mut ra = root(&ha, &peers, 2);
    let a = ra.vm();
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    let body = gateways_answer(&[1, 2]);
    ha.set_call_answer(Some(200), body.as_bytes());
    ra.on_call_response(&ha, calls[0].token, 4, body.len());
    ha.now.set(ha.now.get() + 200);
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    assert_eq!(calls.len(), 2);
    let (_, own) = ask_peer(&ha, &a, 0);
    for c in &calls {
        // Both answered by this process: 10.1.0.1 truly, 10.1.0.2 through Envoy's fallback
        // (it held 10.1.0.2 unhealthy for a moment and could not pin the poll there).
        ha.set_call_answer(Some(200), &own);
        ra.on_call_response(&ha, c.token, 3, own.len());
    }
    let mut asked = 0;
    for _ in 0..400 {
        ha.now.set(ha.now.get() + 200);
        ra.on_tick(&ha);
        for c in ha.take_dispatched() {
            if c.cluster == "admin" {
                ha.set_call_answer(Some(200), body.as_bytes());
                ra.on_call_response(&ha, c.token, 4, body.len());
            } else {
                asked += 1;
                ha.set_call_answer(Some(200), &own);
                ra.on_call_response(&ha, c.token, 3, own.len());
            }
        }
    }
    // 80 s: each host asked again once a minute, never every poll.
    assert!((2..=4).contains(&asked), "{asked} polls");
}

#[test]
fn a_round_of_polls_writes_the_table_once() {
    let h = FakeHost::new();
    let mut r = root(&h, METRICS, 1);
    poll_round(&h, &mut r, |_| queries(10));
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    assert_eq!(calls.len(), 3);
    let before = h.calls.borrow().clone();
    for (i, c) in calls.iter().enumerate() {
        let text = format!("vllm:num_requests_waiting {}\n", i + 1);
        h.set_call_answer(Some(200), text.as_bytes());
        r.on_call_response(&h, c.token, 2, text.len());
        // Nothing is written until the round's last answer.
        let sets = h.calls_since(&before).get("set").copied().unwrap_or(0);
        assert_eq!(sets, if i < 2 { 0 } else { 2 }, "after answer {i}");
    }
    // The table and its version, and every answer in it.
    let t = r.vm().table(&h);
    let mut waiting: Vec<f64> = t.endpoints.iter().filter_map(|e| e.waiting).collect();
    waiting.sort_by(f64::total_cmp);
    assert_eq!(waiting, vec![1.0, 2.0, 3.0]);
    // A slow server holds the others' readings back 50 ms at most.
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    let before = h.calls.borrow().clone();
    for (i, c) in calls.iter().take(2).enumerate() {
        let text = format!("vllm:num_requests_waiting {}\n", 11 + i);
        h.set_call_answer(Some(200), text.as_bytes());
        r.on_call_response(&h, c.token, 2, text.len());
        h.now.set(h.now.get() + 60);
    }
    assert_eq!(h.calls_since(&before).get("set").copied(), Some(2));
    let t = r.vm().table(&h);
    assert!(t.endpoints.iter().any(|e| e.waiting == Some(12.0)));
    let last = calls.last().unwrap();
    h.set_call_answer(Some(200), b"vllm:num_requests_waiting 0\n");
    r.on_call_response(&h, last.token, 2, 27);
    // A round whose last poll never answers: what came goes in at the next tick.
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let calls = h.take_dispatched();
    let text = "vllm:num_requests_waiting 7\n";
    h.set_call_answer(Some(200), text.as_bytes());
    r.on_call_response(&h, calls[0].token, 2, text.len());
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let t = r.vm().table(&h);
    assert!(t.endpoints.iter().any(|e| e.waiting == Some(7.0)));
}

/// A streamed Responses answer opens with `response.created` and `response.in_progress`
/// before the server has prefilled anything: its first token, not its first byte, ends the
/// prefill and times the sample.
#[test]
fn a_responses_stream_ends_its_prefill_at_its_first_token() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","peakPrefillThroughput":"auto""#);
    let created = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\",\"metadata\":{\"type\":\"response.output_text.delta\"},\"usage\":null}}\n\nevent: response.in_progress\ndata: {\"type\":\"response.in_progress\"}\n\n";
    let chunks: [&[u8]; 2] = [
        b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n",
        b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":10000,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":1}}}\n\n",
    ];
    for i in 0..40 {
        // Distinct 40,000-byte prompts (about 10,000 tokens), each a cold fill.
        let body = serde_json::json!({
            "model": "m", "stream": true,
            "input": format!("{i:05}{}", "p".repeat(40_000)),
        })
        .to_string();
        let (mut f, _) = send(&h, &vm, "/v1/responses", body.as_bytes());
        h.set_response_status(200);
        f.on_response_headers(&h, false);
        h.now.set(h.now.get() + 2);
        *h.response_body.borrow_mut() = created.to_vec();
        f.on_response_body(&h, created.len(), false);
        let held: u64 = loads(&h, &vm).iter().map(|l| l.tokens).sum();
        assert!(
            held > 9_000,
            "request {i}: {held} tokens held after the opening"
        );
        // The server prefills 10,000 tokens at 10,000 tokens/s: its first token a second on.
        h.now.set(h.now.get() + 1_000);
        *h.response_body.borrow_mut() = chunks[0].to_vec();
        f.on_response_body(&h, chunks[0].len(), false);
        let held: u64 = loads(&h, &vm).iter().map(|l| l.tokens).sum();
        assert_eq!(held, 0, "request {i}: the first token released the prefill");
        stream_then_end(&h, &mut f, &chunks[1..]);
        h.now.set(h.now.get() + 2_000);
    }
    assert_ledger_zero(&h, &vm);
    let r = vm.router.borrow();
    let estimates: Vec<_> = vm
        .table(&h)
        .endpoints
        .iter()
        .map(|e| r.estimator.read(&h, e.slot).unwrap())
        .collect();
    assert!(estimates.iter().any(|e| e.learned), "{estimates:?}");
    // Timed from the first byte, the rate ran to its cap (16x the prior, 25x this).
    assert!(
        estimates
            .iter()
            .all(|e| !e.learned || (5_000.0..20_000.0).contains(&e.rate)),
        "{estimates:?}"
    );
}

/// A `metrics.cluster` this Envoy does not have is its own failure, not the fleet's: every
/// endpoint stays in rotation, the polls are counted failed, and the log says why now and
/// then rather than every round.
#[test]
fn a_metrics_cluster_that_is_not_there_takes_no_endpoint_out_of_rotation() {
    let h = FakeHost::new();
    h.unknown_clusters.borrow_mut().push("models".into());
    let mut r = root(&h, METRICS, 1);
    for _ in 0..8 {
        h.now.set(h.now.get() + 100);
        r.on_tick(&h);
    }
    let t = r.vm().table(&h);
    assert!(t.endpoints.iter().all(|e| e.healthy), "{:?}", t.endpoints);
    assert!(h.metric("tokenaware_polls_failed") >= 3 * 7);
    let w = warnings_with(&h, "could not call metrics.cluster `models`");
    assert!((3..=4).contains(&w.len()), "{w:?}");
    assert!(warnings_with(&h, "out of rotation").is_empty());
    // Once the cluster is there, polls go out again.
    h.unknown_clusters.borrow_mut().clear();
    h.now.set(h.now.get() + 100);
    r.on_tick(&h);
    assert_eq!(h.take_dispatched().len(), 3);
}

/// An image part is a short placeholder in the canonical prompt, but the server counts its
/// hundreds of tokens in `usage.prompt_tokens`: learned from, it would make every text
/// request of the model look longer than it is.
#[test]
fn a_prompt_with_an_image_teaches_bytes_per_token_nothing() {
    let h = FakeHost::new();
    let vm = vm(&h, r#","peakPrefillThroughput":"auto""#);
    let ask = |i: usize, image: bool| {
        let mut content = vec![
            serde_json::json!({"type": "text", "text": format!("{i:05}{}", "t".repeat(8_000))}),
        ];
        if image {
            content.push(serde_json::json!({"type": "image_url", "image_url": {"url": format!("https://img/{i}.png")}}));
        }
        let body =
            serde_json::json!({"model": "vl", "messages": [{"role": "user", "content": content}]});
        let (mut f, _) = send(&h, &vm, CHAT, body.to_string().as_bytes());
        // With the image: 2,000 text tokens (4 bytes each) and 1,500 for the image. Alone,
        // the text counts 2 bytes a token (another tokenizer's count).
        let tokens = if image { 3_500 } else { 4_000 };
        let answer = format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":{tokens},"completion_tokens":1}}}}"#
        );
        respond(&h, &mut f, answer.as_bytes());
        h.now.set(h.now.get() + 1_000);
    };
    let bpt = |h: &FakeHost| {
        vm.router
            .borrow()
            .estimator
            .bytes_per_token(h, "vl")
            .unwrap()
    };
    let prior = bpt(&h);
    for i in 0..8 {
        ask(i, true);
    }
    assert_eq!(bpt(&h), prior, "learned from prompts with images");
    // Text alone still teaches.
    for i in 8..16 {
        ask(i, false);
    }
    assert!(bpt(&h) < 3.0, "{} (prior {prior})", bpt(&h));
}

/// A discovery answer that reaches a root after a reload gave the table to a newer
/// configuration is the old one's (its model cluster): it leaves the new table alone.
#[test]
fn an_answer_to_a_call_made_before_a_reload_leaves_the_new_table_alone() {
    let h = FakeHost::new();
    let new = DISCOVERY.replace(r#""modelCluster":"models""#, r#""modelCluster":"models2""#);
    let mut old_root = configured(&h, DISCOVERY, 1);
    old_root.on_tick(&h);
    let pending = h.take_dispatched();
    let mut new_root = configured(&h, &new, 2);
    h.now.set(h.now.get() + 200);
    new_root.on_tick(&h);
    let calls = h.take_dispatched();
    let host = |ip: &str| serde_json::json!({"address": {"socket_address": {"address": ip, "port_value": 80}}});
    let answer = serde_json::json!({"cluster_statuses": [
        {"name": "models", "host_statuses": [host("10.0.0.1")]},
        {"name": "models2", "host_statuses": [host("10.9.0.1")]},
    ]})
    .to_string();
    h.set_call_answer(Some(200), answer.as_bytes());
    new_root.on_call_response(&h, calls[0].token, 4, answer.len());
    old_root.on_call_response(&h, pending[0].token, 4, answer.len());
    let t = new_root.vm().table(&h);
    let addresses: Vec<&str> = t.endpoints.iter().map(|e| e.address.as_str()).collect();
    assert_eq!(addresses, ["10.9.0.1:80"]);
}

/// After a reload that changes the static list, the new list sits in the slots one worker
/// gave it: a worker configured after it sizes each endpoint's index by those slots, not by
/// the list's order.
#[test]
fn a_reload_sizes_each_index_by_its_endpoints_slot() {
    let h = FakeHost::new();
    let ep = |p: u16, kv: u64| format!(r#"{{"address":"127.0.0.1:{p}","kvCapacityTokens":{kv}}}"#);
    let list = |eps: [String; 3]| format!(r#"{{"endpoints":[{}]}}"#, eps.join(","));
    let one = list([ep(8001, 64_000), ep(8002, 128_000), ep(8003, 192_000)]);
    configured(&h, &one, 1).on_tick(&h);
    // 8002 leaves, 8004 (a larger GPU) joins, in the slot 8002 left.
    let two = list([ep(8001, 64_000), ep(8003, 192_000), ep(8004, 256_000)]);
    let adopter = configured(&h, &two, 2);
    let _follower = configured(&h, &two, 3);
    let vm = adopter.vm();
    let router = vm.router.borrow();
    let t = vm.table(&h);
    assert_eq!(t.get("127.0.0.1:8004").map(|e| e.slot), Some(1));
    for e in &t.endpoints {
        let index = router.index.matched(&h, e.slot, &[]).unwrap().capacity;
        assert_eq!(index, e.capacity_blocks, "{} in slot {}", e.address, e.slot);
    }
}

/// A metrics interval that is no whole number of seconds comes round on time: its samples
/// stay fresh (`staleAfterMs` at its least, interval + timeout) up to the next poll.
#[test]
fn a_poll_interval_off_the_second_keeps_its_samples_fresh() {
    let h = FakeHost::new();
    let m =
        r#","metrics":{"cluster":"models","intervalMs":1500,"timeoutMs":300,"staleAfterMs":1800}"#;
    let mut r = root(&h, m, 1);
    let vm = r.vm();
    let period = r.tick_period_ms();
    assert_eq!(period, 500);
    let mut polls = 0;
    for tick in 0..40 {
        h.now.set(h.now.get() + period);
        r.on_tick(&h);
        for c in h.take_dispatched() {
            polls += 1;
            let text = "vllm:num_requests_waiting 3\n";
            h.set_call_answer(Some(200), text.as_bytes());
            r.on_call_response(&h, c.token, 2, text.len());
        }
        // What a request sees just before the next tick.
        let now = h.now.get() + period - 1;
        let t = vm.table(&h);
        assert!(
            t.endpoints[0].scraped(now, 1_800).is_some(),
            "stale after tick {tick}"
        );
    }
    // 20 s at 1.5 s: 13 or 14 rounds of 3 polls (at a one-second tick it was 10).
    assert!((39..=42).contains(&polls), "{polls} polls");
}

/// Intervals with no common divisor of 100 ms tick at 100 ms, and each keeps its average.
#[test]
fn an_odd_interval_keeps_its_average_period() {
    let h = FakeHost::new();
    let m =
        r#","metrics":{"cluster":"models","intervalMs":1001,"timeoutMs":300,"staleAfterMs":1400}"#;
    let mut r = root(&h, m, 1);
    assert_eq!(r.tick_period_ms(), 100);
    let mut rounds = 0;
    for _ in 0..1_000 {
        h.now.set(h.now.get() + 100);
        r.on_tick(&h);
        let calls = h.take_dispatched();
        rounds += usize::from(!calls.is_empty());
        for c in calls {
            h.set_call_answer(Some(200), b"");
            r.on_call_response(&h, c.token, 2, 0);
        }
    }
    // 100 s at 1.001 s: 99 or 100 rounds (one from now at the first tick).
    assert!((99..=100).contains(&rounds), "{rounds} rounds");
}

/// A rollout's surge past `maxEndpoints`: the draining old pods give their slots to the new
/// ready one, and hosts left out for want of a slot are counted and named in the log.
#[test]
fn discovery_past_max_endpoints_makes_room_for_the_healthy_and_says_what_it_left_out() {
    let h = FakeHost::new();
    let cfg = DISCOVERY.replace(
        r#""statsFlushMs":0"#,
        r#""statsFlushMs":0,"maxEndpoints":2"#,
    );
    let mut r = configured(&h, &cfg, 1);
    let vm = r.vm();
    discover(&h, &mut r, &[80, 81]);
    let host = |port: u16, hs: serde_json::Value| serde_json::json!({"address":{"socket_address":{"address":"10.0.0.1","port_value":port}},"health_status":hs});
    let draining = serde_json::json!({"pending_dynamic_removal": true});
    let ready = serde_json::json!({"eds_health_status": "HEALTHY"});
    let body = serde_json::json!({"cluster_statuses":[{"name":"models","host_statuses":[
        host(80, draining.clone()), host(81, draining), host(82, ready.clone()), host(83, ready),
    ]}]})
    .to_string();
    h.now.set(h.now.get() + 1_000);
    r.on_tick(&h);
    let c = h.take_dispatched();
    h.set_call_answer(Some(200), body.as_bytes());
    r.on_call_response(&h, c[0].token, 4, body.len());
    let t = vm.table(&h);
    let mut seen: Vec<(&str, bool)> = t
        .endpoints
        .iter()
        .map(|e| (e.address.as_str(), e.healthy))
        .collect();
    seen.sort();
    assert_eq!(seen, [("10.0.0.1:82", true), ("10.0.0.1:83", true)]);
    assert_eq!(h.metric("tokenaware_discovery_hosts_dropped"), 2);
    let w = warnings_with(&h, "discovery found 4 hosts, 2 left out: maxEndpoints is 2");
    assert_eq!(w.len(), 1, "{w:?}");
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q"));
    assert!(h.header_values(DESTINATION)[0].contains("10.0.0.1:8"));
    respond(&h, &mut f, b"{}");
}

/// A poll Envoy could not pin to its replica (held unhealthy a moment) is answered by
/// another: that answer is not taken as the replica's, so its cursor keeps its place and its
/// next answer brings only what is new.
#[test]
fn a_peer_poll_answered_by_another_replica_keeps_the_replicas_place() {
    let peers = one_cluster_peers(r#""intervalMs":100"#);
    let (ha, hb, hc) = (FakeHost::new(), FakeHost::new(), FakeHost::new());
    let mut ra = root(&ha, &peers, 1);
    // Processes of their own: rings of their own.
    let (b, c) = (root(&hb, &peers, 2).vm(), root(&hc, &peers, 3).vm());
    let sys = |who: &str| format!("You are the assistant of tenant {who}. ").repeat(100);
    for i in 0..3 {
        let (mut f, _) = send(&hb, &b, CHAT, &chat(&sys(&format!("b{i}")), "q"));
        respond(&hb, &mut f, b"{}");
    }
    let (mut f, _) = send(&hc, &c, CHAT, &chat(&sys("c"), "q"));
    respond(&hc, &mut f, b"{}");
    // A's replicas: B (10.1.0.2) and C (10.1.0.3).
    ra.on_tick(&ha);
    let calls = ha.take_dispatched();
    let body = gateways_answer(&[2, 3]);
    ha.set_call_answer(Some(200), body.as_bytes());
    ra.on_call_response(&ha, calls[0].token, 4, body.len());
    let from_b = |p: &str| ask_peer_at(&hb, &b, p, Some(PEER_SECRET)).1;
    let from_c = |p: &str| ask_peer_at(&hc, &c, p, Some(PEER_SECRET)).1;
    let mut poll = |for_b: &dyn Fn(&str) -> Vec<u8>| {
        ha.now.set(ha.now.get() + 200);
        ra.on_tick(&ha);
        for call in ha.take_dispatched() {
            let to_b = header_of(&call, DESTINATION) == "10.1.0.2:10000";
            let answer = if to_b {
                for_b(path_of(&call))
            } else {
                from_c(path_of(&call))
            };
            ha.set_call_answer(Some(200), &answer);
            ra.on_call_response(&ha, call.token, 3, answer.len());
        }
    };
    poll(&from_b);
    assert_eq!(ha.metric("tokenaware_peer_placements_learned"), 4);
    // The poll pinned to B is served by C, then B is back.
    poll(&from_c);
    assert_eq!(ha.metric("tokenaware_peer_polls_failed"), 1);
    poll(&from_b);
    assert_eq!(
        ha.metric("tokenaware_peer_placements_learned"),
        4,
        "B's ring replayed"
    );
    assert_eq!(warnings_with(&ha, "answered by another replica").len(), 1);
}

/// An answer that ended well with no `usage` (a stream asked without
/// `stream_options.include_usage`) teaches nothing, and is counted as such; one with
/// `usage`, or a failed one, is not.
#[test]
fn answers_without_usage_are_counted() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let (mut f, _) = send(&h, &vm, CHAT, &streamed(&chat("s", "q")));
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    stream_then_end(
        &h,
        &mut f,
        &[b"data: {\"choices\":[]}\n\n", b"data: [DONE]\n\n"],
    );
    assert_eq!(h.metric("tokenaware_answers_without_usage"), 1);
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q"));
    respond(&h, &mut f, br#"{"choices":[],"usage":{"prompt_tokens":9}}"#);
    let (mut f, _) = send(&h, &vm, CHAT, &chat("s", "q"));
    h.set_response_status(503);
    f.on_response_headers(&h, true);
    f.on_log(&h);
    assert_eq!(h.metric("tokenaware_answers_without_usage"), 1);
    assert_ledger_zero(&h, &vm);
}

/// A Responses stream without `event:` lines gives no first token to time: it still is a
/// whole answer when it ends (its last chunk empty, as Envoy often delivers the end), not a
/// request that failed before its first byte (which would undo its placement).
#[test]
fn a_responses_stream_without_event_lines_is_an_answer() {
    let h = FakeHost::new();
    let vm = vm(&h, "");
    let body = serde_json::json!({"model": "m", "stream": true, "input": "p".repeat(4_000)});
    let (mut f, _) = send(&h, &vm, "/v1/responses", body.to_string().as_bytes());
    h.set_response_status(200);
    f.on_response_headers(&h, false);
    for chunk in [
        &b"data: {\"type\":\"response.created\"}\n\n"[..],
        b"data: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n",
        b"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1000}}}\n\n",
    ] {
        *h.response_body.borrow_mut() = chunk.to_vec();
        f.on_response_body(&h, chunk.len(), false);
    }
    h.response_body.borrow_mut().clear();
    f.on_response_body(&h, 0, true);
    f.on_log(&h);
    assert_eq!(h.metric("tokenaware_requests_failed_early"), 0);
    assert_eq!(h.metric("tokenaware_requests_released"), 1);
    assert_eq!(h.metric("tokenaware_usage_prompt_tokens"), 1_000);
    assert_ledger_zero(&h, &vm);
}

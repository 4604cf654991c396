//! The test host driving HTTP streams through the echo-filter fixture: body buffering,
//! header maps, trailers, responses, local replies, stream-level HTTP calls, end of stream.

use wasm_tests::host::{fixture, Action, Event, Host, Phase, StreamType, Vm};

fn vm(host: &Host) -> Vm {
    let vm = host.load(fixture::echo_filter().unwrap()).unwrap();
    assert!(vm.configure(1, b"").unwrap());
    vm
}

const CHAT: &[(&str, &str)] = &[
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gateway"),
    ("x-echo-destination", "forged-by-client"),
];

#[test]
fn buffered_body_is_seen_whole_and_sets_a_header() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    assert_eq!(s.request_headers(CHAT, false).unwrap(), Action::Pause);
    // The first line spans two chunks: only a buffering host shows it whole.
    assert_eq!(s.request_body(b"10.0.0.", false).unwrap(), Action::Pause);
    assert_eq!(
        s.request_body(b"7:8000\nrest", false).unwrap(),
        Action::Pause
    );
    assert_eq!(s.request_body(b" of body", true).unwrap(), Action::Continue);

    assert_eq!(
        s.request_header("x-echo-destination").as_deref(),
        Some("10.0.0.7:8000")
    );
    let copies = s
        .request_header_map()
        .iter()
        .filter(|(k, _)| k == "x-echo-destination")
        .count();
    assert_eq!(copies, 1, "the client's copy is removed");
    assert_eq!(s.request_header("x-echo-body-size").as_deref(), Some("26"));
    assert_eq!(s.request_header("x-echo-seen").as_deref(), Some("1"));
    assert_eq!(s.request_body_forwarded(), b"10.0.0.7:8000\nrest of body");
    let phases: Vec<(Phase, Action)> = s.actions();
    assert_eq!(
        phases,
        vec![
            (Phase::RequestHeaders, Action::Pause),
            (Phase::RequestBody, Action::Pause),
            (Phase::RequestBody, Action::Pause),
            (Phase::RequestBody, Action::Continue),
        ]
    );
    assert_eq!(vm.histogram("echo_body_bytes"), Some(vec![26]));
    assert_eq!(vm.metric("echo_requests"), Some(1));
    assert!(vm.events().iter().any(
        |e| matches!(e, Event::ForeignFunction { name, context_id } if name == "clear_route_cache" && *context_id == s.id())
    ));
}

#[test]
fn trailers_end_the_request() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    s.request_headers(CHAT, false).unwrap();
    assert_eq!(s.request_body(b"dest-a\n", false).unwrap(), Action::Pause);
    assert_eq!(
        s.request_trailers(&[("x-echo-trailer", "t1")]).unwrap(),
        Action::Continue
    );
    assert_eq!(
        s.request_header("x-echo-destination").as_deref(),
        Some("dest-a")
    );
    assert_eq!(s.request_header("x-echo-trailer").as_deref(), Some("t1"));
    assert_eq!(s.request_body_forwarded(), b"dest-a\n");
}

#[test]
fn header_pairs_roundtrip_through_get_and_set_map() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    let mut headers = CHAT.to_vec();
    headers.push(("x-echo-rewrite", "yes"));
    headers.push(("x-multi", "a"));
    headers.push(("x-multi", "b"));
    s.request_headers(&headers, false).unwrap();
    s.request_body(b"dest", true).unwrap();
    let map = s.request_header_map();
    assert!(map.iter().all(|(k, _)| k != "x-echo-rewrite"));
    assert_eq!(s.request_header("x-echo-rewritten").as_deref(), Some("1"));
    assert_eq!(
        s.request_header(":path").as_deref(),
        Some("/v1/chat/completions")
    );
    let multi: Vec<&str> = map
        .iter()
        .filter(|(k, _)| k == "x-multi")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(multi, ["a", "b"]);
}

#[test]
fn headers_only_request_is_decided_in_the_headers_phase() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    assert_eq!(s.request_headers(CHAT, true).unwrap(), Action::Continue);
    assert_eq!(s.request_header("x-echo-destination").as_deref(), Some(""));
    assert_eq!(s.request_header("x-echo-body-size").as_deref(), Some("0"));
}

#[test]
fn writing_request_headers_after_continue_traps_like_envoy() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    let late = [(":method", "POST"), (":path", "/late")];
    assert_eq!(s.request_headers(&late, false).unwrap(), Action::Continue);
    let err = s.request_body(b"x", true).unwrap_err();
    let trapped = err
        .downcast_ref::<wasm_tests::host::Trapped>()
        .expect("a trap");
    assert_eq!(trapped.callback, "proxy_on_request_body");
    // proxy_get/replace_header_map_value returned BadArgument (2); the SDK panics on it.
    assert!(
        trapped.message.contains("unexpected status: 2"),
        "{trapped}"
    );
}

#[test]
fn response_headers_and_buffered_response_body() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    s.request_headers(CHAT, true).unwrap();
    let resp = [(":status", "200"), ("content-type", "text/plain")];
    assert_eq!(s.response_headers(&resp, false).unwrap(), Action::Continue);
    assert_eq!(
        s.response_header("x-echo-response-headers").as_deref(),
        Some("2")
    );
    assert_eq!(s.response_body(b"hello ", false).unwrap(), Action::Pause);
    assert_eq!(s.response_body(b"world", true).unwrap(), Action::Continue);
    assert_eq!(s.response_body_forwarded(), b"HELLO WORLD");
    assert_eq!(s.response_header_map().len(), 3);
}

#[test]
fn end_runs_log_done_delete_and_keeps_state_readable() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    s.set_property(&["upstream", "address"], b"10.0.0.1:8000");
    s.request_headers(CHAT, false).unwrap();
    assert_eq!(vm.metric("echo_inflight"), Some(1));
    s.request_body(b"d", true).unwrap();
    s.response_headers(&[(":status", "200")], true).unwrap();
    s.end().unwrap();
    assert_eq!(vm.metric("echo_logged"), Some(1));
    assert_eq!(vm.metric("echo_inflight"), Some(0), "on_done ran");
    assert!(vm.log_text().contains("log: upstream 10.0.0.1:8000"));
    assert_eq!(s.request_header("x-echo-destination").as_deref(), Some("d"));
    // A second stream sees no property: unknown paths are NotFound.
    let t = vm.stream();
    t.request_headers(CHAT, true).unwrap();
    t.end().unwrap();
    assert!(vm.log_text().lines().any(|l| l == "log: upstream "));
}

#[test]
fn local_response_is_recorded() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    let local = [(":method", "GET"), (":path", "/local")];
    assert_eq!(s.request_headers(&local, true).unwrap(), Action::Pause);
    let r = s.local_response().expect("a local reply");
    assert_eq!(r.status, 429);
    assert_eq!(r.body, b"slow down");
    assert_eq!(
        r.headers,
        vec![("x-echo-local".to_string(), "1".to_string())]
    );
    assert_eq!(r.grpc_status, -1);
}

#[test]
fn stream_http_call_resumes_the_request() {
    let host = Host::new();
    let vm = vm(&host);
    let s = vm.stream();
    let call = [(":method", "GET"), (":path", "/call")];
    assert_eq!(s.request_headers(&call, true).unwrap(), Action::Pause);
    let calls = s.pending_calls();
    assert_eq!(calls.len(), 1);
    let c = &calls[0];
    assert_eq!(
        (c.cluster.as_str(), c.body.as_slice(), c.timeout_ms),
        ("auth", &b"ping"[..], 500)
    );
    assert_eq!(c.header(":path"), Some("/auth"));
    vm.complete_call(c.token, 201, &[("x-a", "b")], b"ok")
        .unwrap();
    assert_eq!(
        s.request_header("x-echo-call-status").as_deref(),
        Some("201")
    );
    assert_eq!(s.request_header("x-echo-call-body").as_deref(), Some("ok"));
    assert_eq!(
        s.request_header("x-echo-call-headers").as_deref(),
        Some("2")
    );
    assert!(vm.events().contains(&Event::ContinueStream {
        context_id: s.id(),
        stream: StreamType::HttpRequest
    }));
    assert!(vm.pending_calls().is_empty());

    // A failed call (0 headers) and a call cancelled by the end of its stream.
    let f = vm.stream();
    f.request_headers(&call, true).unwrap();
    vm.fail_call(f.pending_calls()[0].token).unwrap();
    assert_eq!(
        f.request_header("x-echo-call-status").as_deref(),
        Some("failed")
    );
    let g = vm.stream();
    g.request_headers(&call, true).unwrap();
    let token = g.pending_calls()[0].token;
    g.end().unwrap();
    assert!(
        vm.pending_calls().is_empty(),
        "Envoy cancels a deleted stream's calls"
    );
    assert!(vm.complete_call(token, 200, &[], b"").is_err());
}

#[test]
fn rejected_dispatch_is_reported_to_the_module() {
    let host = Host::new();
    let vm = vm(&host);
    vm.set_http_call_status(Some(wasm_tests::host::Status::BadArgument));
    let s = vm.stream();
    let call = [(":method", "GET"), (":path", "/call")];
    assert_eq!(s.request_headers(&call, true).unwrap(), Action::Continue);
    assert_eq!(
        s.request_header("x-echo-call-status").as_deref(),
        Some("dispatch-error")
    );
    assert!(vm.pending_calls().is_empty());
}

#[test]
fn concurrent_streams_are_independent() {
    let host = Host::new();
    let vm = vm(&host);
    let (a, b) = (vm.stream(), vm.stream());
    a.request_headers(CHAT, false).unwrap();
    b.request_headers(CHAT, false).unwrap();
    a.request_body(b"first-", false).unwrap();
    b.request_body(b"second", true).unwrap();
    a.request_body(b"a", true).unwrap();
    assert_eq!(
        a.request_header("x-echo-destination").as_deref(),
        Some("first-a")
    );
    assert_eq!(
        b.request_header("x-echo-destination").as_deref(),
        Some("second")
    );
    assert_ne!(a.id(), b.id());
    assert_eq!(vm.metric("echo_inflight"), Some(2));
}

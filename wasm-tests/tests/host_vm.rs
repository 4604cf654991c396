//! The test host's VM-level features through the echo-filter fixture: configuration,
//! shared data across VMs and CAS conflicts, ticks and the clock, root HTTP calls, metrics,
//! logs, traps, and stubs for imports the host does not implement.

use wasm_tests::host::{fixture, Host, LogLevel, Status, Trapped, Vm, EPOCH_NANOS};

fn load(host: &Host) -> Vm {
    host.load(fixture::echo_filter().unwrap()).unwrap()
}

fn request(vm: &Vm, body: &[u8]) -> Option<String> {
    let s = vm.stream();
    s.request_headers(&[(":method", "POST"), (":path", "/")], false)
        .unwrap();
    s.request_body(body, true).unwrap();
    s.end().unwrap();
    s.request_header("x-echo-count")
}

#[test]
fn configure_sees_plugin_and_vm_configuration() {
    let host = Host::new();
    let vm = load(&host);
    vm.set_vm_config(b"abc");
    vm.set_log_level(LogLevel::Warn);
    vm.set_property(&["plugin_name"], b"echo");
    assert!(vm.configure(1, b"tick_ms=250").unwrap());
    assert_eq!(vm.tick_period_ms(1), Some(250));
    let text = vm.log_text();
    assert!(
        text.contains("vm start: 3 config bytes, host log level 3"),
        "{text}"
    );
    assert!(text.contains("configuring plugin echo"), "{text}");
    // Reconfiguring the same root runs only on_configure; a bad config is rejected.
    assert!(!vm.configure(1, b"fail").unwrap());
    assert!(!vm.configure(1, b"bogus=1").unwrap());
    assert!(!load(&host).configure(7, b"tick_ms=soon").unwrap());
    assert_eq!(vm.log_text().matches("vm start").count(), 1);
}

#[test]
fn shared_data_is_shared_by_the_vms_of_one_host_only() {
    let host = Host::new();
    let (vm1, vm2) = (load(&host), load(&host));
    for vm in [&vm1, &vm2] {
        assert!(vm.configure(1, b"").unwrap());
    }
    assert_eq!(request(&vm1, b"a").as_deref(), Some("1"));
    assert_eq!(request(&vm2, b"b").as_deref(), Some("2"));
    assert_eq!(request(&vm1, b"c").as_deref(), Some("3"));
    assert_eq!(
        host.shared_get("echo/requests"),
        Some(3u64.to_le_bytes().to_vec())
    );
    assert!(host.shared_keys().contains(&"echo/requests".to_string()));
    // Counters are shared by name too, as Envoy stats are.
    assert_eq!(host.metric("echo_requests"), Some(3));

    let other = Host::new();
    let vm3 = load(&other);
    assert!(vm3.configure(1, b"").unwrap());
    assert_eq!(request(&vm3, b"d").as_deref(), Some("1"));
}

#[test]
fn injected_cas_conflicts_are_retried_by_the_module() {
    let host = Host::new();
    let vm = load(&host);
    assert!(vm.configure(1, b"").unwrap());
    // The first write creates the key unconditionally: conflicts can't hit it.
    host.inject_cas_conflicts(2);
    assert_eq!(request(&vm, b"a").as_deref(), Some("1"));
    assert_eq!(host.cas_conflicts_left(), 2);
    let (_, cas_before) = host.shared_entry("echo/requests").unwrap();
    assert_eq!(request(&vm, b"b").as_deref(), Some("2"));
    assert_eq!(host.cas_conflicts_left(), 0);
    assert_eq!(vm.metric("echo_cas_retries"), Some(2));
    let (value, cas_after) = host.shared_entry("echo/requests").unwrap();
    assert_eq!(value, 2u64.to_le_bytes());
    assert!(cas_after > cas_before);
}

#[test]
fn ticks_use_the_virtual_clock_and_dispatch_calls() {
    let host = Host::new();
    let vm = load(&host);
    assert_eq!(vm.tick().unwrap(), 0, "no root context yet");
    assert!(vm.configure(1, b"tick_ms=1000\ncluster=fleet").unwrap());
    host.advance_ms(1500);
    assert_eq!(vm.tick().unwrap(), 1);
    let stamp = host.shared_get("echo/last_tick_ns").unwrap();
    assert_eq!(stamp, (EPOCH_NANOS + 1_500_000_000).to_le_bytes());

    let calls = vm.pending_calls();
    assert_eq!(calls.len(), 1);
    let c = &calls[0];
    assert_eq!(
        (c.cluster.as_str(), c.context_id, c.timeout_ms),
        ("fleet", 1, 1000)
    );
    assert_eq!(c.header(":path"), Some("/metrics"));
    vm.complete_call(c.token, 200, &[("content-type", "text/plain")], b"up 1")
        .unwrap();
    assert_eq!(
        host.shared_get("echo/last_poll").as_deref(),
        Some(&b"200 up 1"[..])
    );
    assert_eq!(vm.metric("echo_polls_ok"), Some(1));

    vm.tick().unwrap();
    let token = vm.pending_calls()[0].token;
    assert_ne!(token, c.token);
    vm.fail_call(token).unwrap();
    assert_eq!(vm.metric("echo_polls_failed"), Some(1));
    assert!(
        vm.complete_call(token, 200, &[], b"").is_err(),
        "already completed"
    );
}

#[test]
fn dispatch_errors_unknown_clusters_and_forced_statuses() {
    let host = Host::new();
    let vm = load(&host);
    assert!(vm.configure(1, b"tick_ms=10\ncluster=fleet").unwrap());
    vm.set_clusters(&["other"]);
    vm.tick().unwrap();
    assert_eq!(vm.metric("echo_dispatch_errors"), Some(1));
    vm.set_clusters(&["fleet"]);
    vm.set_http_call_status(Some(Status::BadArgument));
    vm.tick().unwrap();
    assert_eq!(vm.metric("echo_dispatch_errors"), Some(2));
    assert!(vm.pending_calls().is_empty());
    vm.set_http_call_status(None);
    vm.tick().unwrap();
    assert_eq!(vm.pending_calls().len(), 1);
}

#[test]
fn logs_are_captured_with_level_and_context() {
    let host = Host::new();
    let vm = load(&host);
    assert!(vm.configure(1, b"").unwrap());
    let s = vm.stream();
    s.request_headers(&[(":method", "POST"), (":path", "/")], false)
        .unwrap();
    s.request_body(b"dest\nSECRET PROMPT TEXT", true).unwrap();
    let logs = vm.logs();
    let routed = logs
        .iter()
        .find(|l| l.message.starts_with("routed request"))
        .unwrap();
    assert_eq!((routed.level, routed.context_id), (LogLevel::Info, s.id()));
    assert!(!vm.log_text().contains("SECRET"));
}

#[test]
fn a_trap_fails_only_its_vm() {
    let host = Host::new();
    let (bad, good) = (load(&host), load(&host));
    assert!(bad.configure(1, b"").unwrap());
    assert!(good.configure(1, b"").unwrap());
    let s = bad.stream();
    s.request_headers(&[(":method", "POST"), (":path", "/")], false)
        .unwrap();
    let err = s.request_body(b"trap now", true).unwrap_err();
    let trapped = err.downcast_ref::<Trapped>().expect("a Trapped error");
    assert_eq!(trapped.callback, "proxy_on_request_body");
    assert!(
        trapped.message.contains("body asked for a trap"),
        "{trapped}"
    );
    assert_eq!(bad.failure().as_ref(), Some(trapped));
    let again = request_result(&bad);
    assert!(again.unwrap_err().to_string().contains("VM failed earlier"));

    assert_eq!(request(&good, b"fine").as_deref(), Some("1"));
    assert!(good.failure().is_none());

    let headers_trap = load(&host);
    assert!(headers_trap.configure(1, b"").unwrap());
    let err = headers_trap
        .stream()
        .request_headers(&[(":method", "GET"), (":path", "/trap")], true)
        .unwrap_err();
    assert!(err.to_string().contains("path asked for a trap"), "{err}");
    let err = load(&host).configure(1, b"trap").unwrap_err();
    assert!(
        err.to_string().contains("proxy_on_configure trapped"),
        "{err}"
    );
}

fn request_result(vm: &Vm) -> anyhow::Result<()> {
    vm.stream()
        .request_headers(&[(":method", "GET")], true)
        .map(|_| ())
}

#[test]
fn metrics_follow_envoy_rules() {
    let host = Host::new();
    let vm = load(&host);
    assert!(vm.configure(1, b"").unwrap());
    assert_eq!(vm.metric("echo_requests"), Some(0));
    assert_eq!(
        vm.metric("echo_body_bytes"),
        None,
        "histograms have no value"
    );
    assert_eq!(vm.histogram("echo_body_bytes"), Some(vec![]));
    assert_eq!(vm.metric("nope"), None);
    request(&vm, b"abc");
    request(&vm, b"de");
    assert_eq!(host.metric("echo_requests"), Some(2));
    assert_eq!(vm.histogram("echo_body_bytes"), Some(vec![3, 2]));
    assert_eq!(host.metrics().len(), 8);
}

/// A module that imports things no host implements still instantiates: `env.*` stubs return
/// Unimplemented (12), WASI stubs ENOSYS (52), other modules trap when called.
#[test]
fn unknown_imports_link_as_stubs() {
    let wasm = wat::parse_str(
        r#"(module
            (import "env" "proxy_from_the_future" (func $future (param i32) (result i32)))
            (import "wasi_snapshot_preview1" "fd_readdir" (func $readdir (param i32 i32 i32 i64 i32) (result i32)))
            (import "elsewhere" "thing" (func $thing))
            (memory (export "memory") 1)
            (func (export "_initialize"))
            (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 1024)
            (func (export "proxy_on_context_create") (param i32 i32))
            (func (export "proxy_on_vm_start") (param i32 i32) (result i32)
                (i32.and
                    (i32.eq (call $future (i32.const 0)) (i32.const 12))
                    (i32.eq (call $readdir (i32.const 0) (i32.const 0) (i32.const 0) (i64.const 0) (i32.const 0)) (i32.const 52))))
            (func (export "proxy_on_configure") (param i32 i32) (result i32)
                call $thing
                i32.const 1))"#,
    )
    .unwrap();
    let host = Host::new();
    let vm = host.load_bytes(&wasm).unwrap();
    let err = vm.configure(1, b"").unwrap_err();
    assert!(
        format!("{err}").contains("unknown import elsewhere.thing"),
        "{err}"
    );
    let names: Vec<String> = vm
        .events()
        .into_iter()
        .filter_map(|e| match e {
            wasm_tests::host::Event::Unimplemented { name, .. } => Some(name),
            _ => None,
        })
        .collect();
    assert_eq!(names, ["proxy_from_the_future", "fd_readdir", "thing"]);
}

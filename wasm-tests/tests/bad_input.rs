//! Bad input end to end, through a real Envoy with the release `tokenaware.wasm` in front of
//! the simulated fleet. Each request gets correct routing, fallback routing, or a clear 4xx:
//! never a 5xx, a hang (every client call is bounded) or a panic (the filter's stats keep
//! counting afterwards, and the ledger is back to zero).
//!
//! Needs the release module and Envoy (see e2e.rs); the HTTP/2 test needs nghttp2-client
//! (`nghttp`, `h2load`).

mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use support::*;
use wasm_tests::envoy::have_envoy;
use wasm_tests::fleet::{FleetConfig, MODEL};

/// Posts raw bytes with a content type (and optionally a content encoding).
async fn post_bytes(
    gw: &Gateway,
    path: &str,
    ctype: &str,
    enc: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let t0 = std::time::Instant::now();
    let mut rb = gw
        .http
        .post(gw.envoy.url(path))
        .header("content-type", ctype);
    if let Some(e) = enc {
        rb = rb.header("content-encoding", e);
    }
    let r = rb.body(body).send().await.unwrap();
    answer(r, t0).await
}

/// gzip of `data` with stored (uncompressed) deflate blocks: a valid gzip stream without a
/// compression library.
fn gzip_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    let chunks: Vec<&[u8]> = data.chunks(65_535).collect();
    for (i, c) in chunks.iter().enumerate() {
        out.push(u8::from(i + 1 == chunks.len()));
        let n = c.len() as u16;
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(!n).to_le_bytes());
        out.extend_from_slice(c);
    }
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    out.extend_from_slice(&(!crc).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

fn reason(a: &Answer) -> &str {
    a.decision
        .split("reason=")
        .nth(1)
        .map_or("", |r| r.split(';').next().unwrap_or(""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_bodies_are_routed_fall_back_or_get_a_clear_4xx() {
    if !have_envoy() {
        return;
    }
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let good = chat(&system(1, 8_000), "q");
    // (name, answer, expected status, expected decision prefix)
    let mut seen: Vec<(&str, Answer, u16, &str)> = Vec::new();

    let truncated = good[..good.len() / 2].to_string();
    let a = gw.post(CHAT, truncated).await;
    seen.push(("truncated JSON", a, 400, "reason=fallback; why=not_json"));

    let a = post_bytes(&gw, CHAT, "text/plain", None, good.clone().into_bytes()).await;
    seen.push(("text/plain JSON", a, 200, "endpoint="));
    let a = post_bytes(
        &gw,
        CHAT,
        "application/x-www-form-urlencoded",
        None,
        b"model=x&q=1".to_vec(),
    )
    .await;
    seen.push(("form body", a, 400, "reason=fallback; why=not_json"));

    let gz = gzip_stored(good.as_bytes());
    let a = post_bytes(&gw, CHAT, "application/json", Some("gzip"), gz).await;
    seen.push(("gzip body", a, 400, "reason=fallback; why=not_json"));

    let mut bad_utf8 =
        br#"{"model":"sim-model","messages":[{"role":"user","content":"caf"#.to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    bad_utf8.extend_from_slice(br#""}],"max_tokens":2}"#);
    let a = post_bytes(&gw, CHAT, "application/json", None, bad_utf8).await;
    seen.push(("invalid UTF-8", a, 400, "reason=fallback; why=not_json"));

    let messages: Vec<Value> = (0..50_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i}")}))
        .collect();
    let many = json!({"model": MODEL, "messages": messages, "max_tokens": 2}).to_string();
    assert!(many.len() < 4 << 20, "{} bytes", many.len());
    let a = gw.post(CHAT, many).await;
    seen.push(("50,000 messages", a, 200, "endpoint="));

    let deep = format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"hi","x":{}{}}}],"max_tokens":2}}"#,
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let a = gw.post(CHAT, deep).await;
    seen.push((
        "nesting 10,000 deep",
        a,
        400,
        "reason=fallback; why=too_deep",
    ));

    let a = post_bytes(&gw, CHAT, "application/json", None, Vec::new()).await;
    seen.push((
        "empty body, content-length 0",
        a,
        400,
        "reason=fallback; why=no_body",
    ));

    let a = gw
        .post(CHAT, json!({"model": "no-such-model", "messages": [{"role": "user", "content": system(2, 4_000)}], "max_tokens": 2}).to_string())
        .await;
    seen.push(("unknown model", a, 200, "endpoint="));

    let ids: Vec<u32> = (0..3_000).map(|i| i * 7 % 50_000).collect();
    let a = gw
        .post(
            COMPLETIONS,
            json!({"model": MODEL, "prompt": ids, "max_tokens": 2}).to_string(),
        )
        .await;
    let token_ids = a.decision.clone();
    seen.push(("prompt of token ids", a, 200, "endpoint="));

    for (name, a, status, decision) in &seen {
        eprintln!("{name}: {} {:?} in {:?}", a.status, a.decision, a.elapsed);
        assert_eq!(a.status, *status, "{name}: {}", a.body);
        assert!(a.decision.starts_with(decision), "{name}: {}", a.decision);
        assert!(!a.endpoint.is_empty(), "{name}: no model server reached");
        assert!(
            a.elapsed < Duration::from_secs(5),
            "{name}: {:?}",
            a.elapsed
        );
    }
    // Token ids are counted exactly: 3,000 tokens, not bytes / 4.
    assert!(token_ids.contains("tokens=3000"), "{token_ids}");
    // The same bodies again: still answered (no VM died), and a normal request routes.
    let a = gw.post(CHAT, good.clone()).await;
    assert_eq!((a.status, reason(&a)), (200, "sticky"), "{}", a.decision);
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

/// Sends `body` with a content-length, then chunked (256 KiB chunks).
async fn both_ways(gw: &Gateway, body: &str) -> Vec<Answer> {
    let mut out = vec![gw.post(CHAT, body.to_string()).await];
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = body
        .as_bytes()
        .chunks(256 * 1024)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let t0 = std::time::Instant::now();
    let r = gw
        .http
        .post(gw.envoy.url(CHAT))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await;
    match r {
        Ok(r) => out.push(answer(r, t0).await),
        // Envoy may answer and close before the client has sent it all.
        Err(e) => eprintln!("chunked 10 MB: {e}"),
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_megabytes_pass_unrouted_or_get_a_413_and_chunked_bodies_are_routed() {
    if !have_envoy() {
        return;
    }
    let huge = chat(&system(3, 10 << 20), "q");
    // maxBodyBytes (16 MiB) above Envoy's 8 MiB buffer: the filter keeps buffering, Envoy
    // answers 413 itself; no hang.
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| {
        plugin_config(eps, r#""maxBodyBytes":16777216"#)
    })
    .await;
    for a in both_ways(&gw, &huge).await {
        assert_eq!(a.status, 413, "{}", a.body);
        assert!(a.elapsed < Duration::from_secs(10));
    }
    assert_eq!(gw.stat("tokenaware_requests_routed"), 0);
    drop(gw);
    // The default 4 MiB: over the limit, the filter lets go and the body streams on unrouted.
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let port = gw.envoy.listen_port();
    for a in both_ways(&gw, &huge).await {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.decision, "reason=fallback; why=too_large");
    }
    // Small chunks, and chunks that end in trailers: routed like any body.
    let body = chat(&system(4, 20_000), "chunked");
    let mut chunked = Vec::new();
    for c in body.as_bytes().chunks(1_000) {
        chunked.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        chunked.extend_from_slice(c);
        chunked.extend_from_slice(b"\r\n");
    }
    let head = "Host: gw\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n";
    for trailers in ["", "x-trailer: 1\r\n"] {
        let mut req = head.as_bytes().to_vec();
        if !trailers.is_empty() {
            req.extend_from_slice(b"Trailer: x-trailer\r\n");
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(&chunked);
        req.extend_from_slice(format!("0\r\n{trailers}\r\n").as_bytes());
        let (status, h, _) = tokio::task::spawn_blocking(move || {
            raw_exchange(port, &format!("POST {CHAT} HTTP/1.1"), &req)
        })
        .await
        .unwrap();
        let decision = head_value(&h, DECISION).unwrap_or_default();
        assert_eq!(status, 200, "trailers {trailers:?}: {h}");
        assert!(decision.contains("reason="), "{decision}");
        assert!(!decision.contains("fallback"), "{decision}");
    }
    assert_eq!(gw.stat("tokenaware_decisions_sticky"), 1);
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http2_cleartext_requests_are_routed() {
    if !have_envoy() {
        return;
    }
    assert!(
        have("nghttp") && have("h2load"),
        "install nghttp2-client (scripts/setup.sh)"
    );
    let gw = start(FleetConfig::scaled(3, 0.01), |eps| plugin_config(eps, "")).await;
    let dir = gw.envoy.dir().to_path_buf();
    let url = gw.envoy.url(CHAT);
    let body = dir.join("h2-body.json");
    std::fs::write(&body, chat(&system(5, 20_000), "over h2")).unwrap();
    // nghttp speaks h2c with prior knowledge; -v prints the response headers.
    let nghttp = |url: String, body: std::path::PathBuf| {
        let out = Command::new("timeout")
            .args([
                "15",
                "nghttp",
                "-v",
                "-n",
                "-H",
                "content-type: application/json",
                "-d",
            ])
            .arg(&body)
            .arg(&url)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mut served = Vec::new();
    for _ in 0..2 {
        let (u, b) = (url.clone(), body.clone());
        let out = tokio::task::spawn_blocking(move || nghttp(u, b))
            .await
            .unwrap();
        assert!(out.contains(":status: 200"), "{out}");
        let header = |name: &str| {
            out.lines()
                .find_map(|l| {
                    l.split_once(&format!("{name}: "))
                        .map(|(_, v)| v.trim().to_string())
                })
                .unwrap_or_default()
        };
        served.push((header("x-fleet-endpoint"), header(DECISION)));
    }
    assert!(served[0].1.contains("reason=cold"), "{served:?}");
    assert!(served[1].1.contains("reason=sticky"), "{served:?}");
    assert_eq!(served[0].0, served[1].0);
    // Many streams on few connections.
    let (u, b) = (url.clone(), body.clone());
    let out = tokio::task::spawn_blocking(move || {
        Command::new("timeout")
            .args([
                "30",
                "h2load",
                "-n",
                "60",
                "-c",
                "2",
                "-m",
                "8",
                "-H",
                "content-type: application/json",
                "-d",
            ])
            .arg(&b)
            .arg(&u)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("60 succeeded, 0 failed, 0 errored"), "{text}");
    assert!(text.contains("status codes: 60 2xx"), "{text}");
    assert_eq!(gw.stat("tokenaware_decisions_sticky"), 61);
    assert_eq!(gw.envoy_stat("http.gateway.downstream_rq_5xx"), 0);
    gw.assert_settled().await;
}

//! `hostprofile`: the filter's own compiled code, function by function. Loads a `.wasm` into
//! the test host ([`wasm_tests::host`]) compiled by Cranelift, which writes
//! `/tmp/perf-PID.map`, and drives the request `overhead` sends (the same 4 KB chat body,
//! the same three endpoints and plugin config) through the whole stream again and again:
//! headers, body, the answer with its `usage`, the end. Run under `perf record`, the samples
//! in the filter's code are named by function; `scripts/host-profile.sh` does that and sums
//! them by part. What the test host costs itself is outside the filter's functions and left
//! out of those sums.
//!
//! ```sh
//! CARGO_PROFILE_RELEASE_STRIP=false cargo build --release --target wasm32-wasip1 -p tokenaware \
//!     --target-dir target/hostprofile
//! cargo run -p wasm-tests --release --bin hostprofile -- --requests 60000
//! ```
//!
//! The code runs warm here, request after request with nothing else on the core, so its
//! time is less than inside Envoy; the shares between its parts are what this shows.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::json;
use wasm_tests::envoy::repo_root;
use wasm_tests::host::{Action, Compiler, Host};
use wasm_tests::instant::{chat_body, whole_json};

#[derive(Debug, Parser)]
#[command(about = "The filter's steady-state request in the test host, for perf")]
struct Args {
    /// The filter, built with its name section (not stripped) so perf can name functions.
    #[arg(
        long,
        default_value = "target/hostprofile/wasm32-wasip1/release/tokenaware.wasm"
    )]
    wasm: PathBuf,
    /// Requests after the first.
    #[arg(long, default_value_t = 60_000)]
    requests: usize,
    /// Chat body size in bytes.
    #[arg(long, default_value_t = 4096)]
    size: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let wasm = repo_root().join(&args.wasm);
    let host = Host::new();
    let vm = host.load_with(&wasm, Compiler::Profiled)?;
    let endpoints: Vec<_> = (1..=3)
        .map(|i| json!({ "address": format!("127.0.0.1:800{i}") }))
        .collect();
    let config = json!({ "endpoints": endpoints }).to_string();
    if !vm.configure(1, config.as_bytes())? {
        bail!("the filter refused its config: {}", vm.log_text());
    }
    let body = chat_body(args.size, false);
    let answer = whole_json(body.len() / 4);
    let len = body.len().to_string();
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    let first = one_request(&vm, &headers, body.as_bytes(), answer.as_bytes())?;
    let start = Instant::now();
    for i in 0..args.requests {
        // About 8,000 requests a second on this VM, as on each worker in `overhead`, so kept
        // shared-data reads expire as often as they do there.
        if i % 8 == 0 {
            host.advance_ms(1);
            vm.forget_finished();
        }
        let to = one_request(&vm, &headers, body.as_bytes(), answer.as_bytes())?;
        if to != first {
            bail!("the request went to {to}, the first to {first}: not the steady state");
        }
    }
    let took = start.elapsed();
    println!(
        "{} requests of {} B to {first}: {:.2} µs a request, test host included",
        args.requests,
        body.len(),
        took.as_secs_f64() * 1e6 / args.requests.max(1) as f64
    );
    Ok(())
}

/// One whole stream; returns the endpoint the filter picked.
fn one_request(
    vm: &wasm_tests::host::Vm,
    headers: &[(&str, &str)],
    body: &[u8],
    answer: &[u8],
) -> anyhow::Result<String> {
    let s = vm.stream();
    if s.request_headers(headers, false)? != Action::Pause {
        bail!("the filter did not hold the request");
    }
    s.request_body(body, true)?;
    let dest = s
        .request_header("x-gateway-destination-endpoint")
        .context("no destination header: the request fell back")?;
    let picked = dest.split(',').next().unwrap_or_default().to_string();
    s.set_property(&["upstream", "address"], picked.as_bytes());
    s.response_headers(
        &[(":status", "200"), ("content-type", "application/json")],
        false,
    )?;
    s.response_body(answer, true)?;
    s.end()?;
    Ok(picked)
}

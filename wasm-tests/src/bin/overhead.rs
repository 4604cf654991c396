//! `overhead`: what the filter costs inside Envoy. Two Envoys (`--concurrency 2`, or
//! `--concurrency N`), one plain
//! and one with tokenaware, run side by side in front of the same instant upstream
//! ([`wasm_tests::instant`]: three loopback endpoints that answer every POST at once), and
//! `wrk` (or, with `--client h2load`, h2load over HTTP/2) drives each in turn with one chat
//! body, rounds alternating which goes first:
//!
//! - throughput: `wrk -t2 -c<connections>` closed loop, requests/s and Envoy CPU time per
//!   request (utime + stime of the Envoy process from `/proc/PID/stat`, over the run);
//! - latency: [`wasm_tests::paired`], one request at a time to each gateway, alternating
//!   (`--pairs` a round after 200 unmeasured), p50 and p99 (no queueing in the figure).
//!
//! ```sh
//! cargo build --release --target wasm32-wasip1 -p tokenaware
//! cargo run -p wasm-tests --release --bin overhead -- [--secs 10] [--rounds 3]
//! ```
//!
//! `--baseline-wasm OTHER.wasm` loads another build into the first Envoy, so two builds
//! are compared in one run (then "plain" below means that build).
//!
//! The same body is sent every time, so after the first request the filter's path is the hot
//! one: parse, hash, index hit, sticky pick. Writes `target/overhead/results.json`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::Parser;
use serde::Serialize;
use serde_json::json;
use wasm_tests::envoy::{repo_root, Envoy, GatewayConfig};
use wasm_tests::instant::chat_body;
use wasm_tests::paired::{self, Latency};

#[derive(Debug, Parser)]
#[command(about = "Envoy with and without tokenaware: requests/s, added p99, CPU per request")]
struct Args {
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 10)]
    secs: u32,
    /// Rounds (each runs both gateways for every size).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Connections of the throughput runs.
    #[arg(long, default_value_t = 32)]
    connections: u32,
    /// Upstream endpoints (each decision reads every endpoint's index and ledger).
    #[arg(long, default_value_t = 3)]
    endpoints: usize,
    /// Chat body sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [4096, 225_280])]
    sizes: Vec<usize>,
    /// Extra plugin-config fields (a JSON object), e.g. `{"routes":["/none"]}` to measure the
    /// filter loaded but not routing.
    #[arg(long)]
    extra: Option<String>,
    /// Load this `.wasm` (same plugin config) into the "plain" Envoy: the figures then
    /// compare two builds of the filter instead of the filter against none.
    #[arg(long)]
    baseline_wasm: Option<PathBuf>,
    /// Load this `.wasm` into the filter Envoy instead of the release build (e.g. the
    /// `overhead-baseline` yardstick, to see what buffering and parsing alone cost).
    #[arg(long)]
    wasm: Option<PathBuf>,
    /// Extra plugin-config fields for the baseline build (default: `--extra`).
    #[arg(long)]
    baseline_extra: Option<String>,
    /// Envoy worker threads of both gateways (issue 5's throughput figures use 2; its
    /// latency figure, like the filter's own added-latency figure, one).
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Request pairs (one to each gateway) of a round's latency measurement, after 200
    /// unmeasured ones.
    #[arg(long, default_value_t = 3000)]
    pairs: usize,
    /// Ask for streamed answers (`"stream": true`): the filter then returns a request's
    /// prefill at the first body byte, one ledger update more than for an answer not
    /// streamed (without `--events` the stub answers with the same JSON either way).
    #[arg(long)]
    stream: bool,
    /// With `--stream`: the stub answers with this many token events, one write each,
    /// `--event-gap-ms` apart, then `usage` and `[DONE]`, as a model server streams (each
    /// event reaches the filter as its own body chunk). 0: the JSON in one piece.
    #[arg(long, default_value_t = 0)]
    events: usize,
    #[arg(long, default_value_t = 1.0)]
    event_gap_ms: f64,
    /// The load tool of the throughput runs: `wrk` (HTTP/1.1, a request at a time on each
    /// connection) or `h2load` (HTTP/2 over cleartext, `--streams` requests in flight on
    /// each connection, as a client multiplexing over one connection sends them).
    #[arg(long, value_enum, default_value_t = Client::Wrk)]
    client: Client,
    /// With `--client h2load`: concurrent streams per connection (`h2load -m`).
    #[arg(long, default_value_t = 1)]
    streams: u32,
    #[arg(long, default_value = "target/overhead")]
    out_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Client {
    Wrk,
    H2load,
}

/// Prints every request's latency distribution summary on one line wrk's `done` writes.
const LUA: &str = r#"
function init(args)
  local f = assert(io.open(args[1], "rb"))
  wrk.body = f:read("*a")
  f:close()
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"#;

/// One wrk run's figures.
#[derive(Debug, Clone, Copy, Serialize)]
struct Run {
    requests: u64,
    secs: f64,
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// Envoy CPU time per request, µs.
    cpu_us_per_req: f64,
}

impl Run {
    /// A run's figures from its count, length, latencies (ms), errors and the Envoy
    /// process's CPU ticks over it.
    fn new(requests: u64, secs: f64, (p50_ms, p99_ms): (f64, f64), errors: u64, ticks: u64) -> Run {
        Run {
            requests,
            secs,
            rps: requests as f64 / secs,
            p50_ms,
            p99_ms,
            errors,
            cpu_us_per_req: ticks as f64 / clock_ticks_per_sec() * 1e6 / requests.max(1) as f64,
        }
    }
}

#[derive(Debug, Serialize)]
struct Row {
    round: usize,
    size: usize,
    plain_tput: Run,
    filter_tput: Run,
    plain_lat: Latency,
    filter_lat: Latency,
    /// Median over pairs of (filter − plain) latency.
    paired_p50_ms: f64,
    rps_ratio: f64,
    added_p50_ms: f64,
    added_p99_ms: f64,
    added_cpu_us: f64,
}

/// Clock ticks of user + system time of a process (`/proc/PID/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces; count fields after its closing paren.
    let rest = stat.rsplit_once(')').context("stat format")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime) = (f.get(11), f.get(12));
    Ok(utime.context("utime")?.parse::<u64>()? + stime.context("stime")?.parse::<u64>()?)
}

fn clock_ticks_per_sec() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Runs wrk against `url` and reads the `RESULT` line; CPU from `pid` over the run.
fn wrk(
    url: &str,
    pid: u32,
    threads: u32,
    conns: u32,
    secs: u32,
    lua: &Path,
    body: &Path,
) -> anyhow::Result<Run> {
    let before = cpu_ticks(pid)?;
    let out = Command::new("wrk")
        .args(["-t", &threads.to_string(), "-c", &conns.to_string()])
        .args(["-d", &format!("{secs}s"), "--timeout", "10s", "-s"])
        .arg(lua)
        .arg(url)
        .arg("--")
        .arg(body)
        .output()
        .context("running wrk (apt-get install wrk, or scripts/setup.sh)")?;
    let ticks = cpu_ticks(pid)? - before;
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
        bail!(
            "wrk gave no result: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let [requests, dur_us, p50, p99, sock, status] = v[..] else {
        bail!("bad wrk result line {line:?}");
    };
    let (p50_ms, p99_ms) = (p50 as f64 / 1e3, p99 as f64 / 1e3);
    let secs = dur_us as f64 / 1e6;
    Ok(Run::new(
        requests,
        secs,
        (p50_ms, p99_ms),
        sock + status,
        ticks,
    ))
}

/// Runs h2load (HTTP/2, prior knowledge) against `url`; CPU from `pid` over the run. h2load
/// reports no percentiles, so the run's p50 and p99 are left out (the latency figures come
/// from the paired measurement either way).
fn h2load(
    url: &str,
    pid: u32,
    conns: u32,
    streams: u32,
    secs: u32,
    body: &Path,
) -> anyhow::Result<Run> {
    let before = cpu_ticks(pid)?;
    let out = Command::new("h2load")
        .args([
            "-t",
            "2",
            "-c",
            &conns.to_string(),
            "-m",
            &streams.to_string(),
        ])
        .args([
            "-D",
            &secs.to_string(),
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(body)
        .arg(url)
        .output()
        .context("running h2load (apt-get install nghttp2-client, or scripts/setup.sh)")?;
    let ticks = cpu_ticks(pid)? - before;
    let text = String::from_utf8_lossy(&out.stdout);
    let (secs, requests, errors) = parse_h2load(&text).with_context(|| {
        format!(
            "h2load gave no result: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok(Run::new(
        requests,
        secs,
        (f64::NAN, f64::NAN),
        errors,
        ticks,
    ))
}

/// From h2load's report: the run's seconds, its 2xx answers, and the requests that failed or
/// ended in another status.
fn parse_h2load(text: &str) -> Option<(f64, u64, u64)> {
    let line = |prefix: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix).map(str::to_owned))
    };
    let secs = duration_secs(line("finished in ")?.split(',').next()?)?;
    // "requests: 10 total, 10 started, 10 done, 9 succeeded, 1 failed, 0 errored, 0 timeout"
    let requests = line("requests: ")?;
    let count = |what: &str| -> Option<u64> {
        requests
            .split(", ")
            .find_map(|p| p.strip_suffix(what))
            .and_then(|n| n.trim().parse().ok())
    };
    let codes = line("status codes: ")?;
    let ok: u64 = codes.split(" 2xx").next()?.trim().parse().ok()?;
    // `failed` takes in those that errored or timed out; a 3xx "succeeded" but is no answer.
    let failed = count(" failed")? + count(" succeeded")?.saturating_sub(ok);
    Some((secs, ok, failed))
}

/// h2load's duration: a number and `s`, `ms` or `us`.
fn duration_secs(d: &str) -> Option<f64> {
    let d = d.trim();
    let (n, scale) = if let Some(n) = d.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = d.strip_suffix("ms") {
        (n, 1e-3)
    } else {
        (d.strip_suffix('s')?, 1.0)
    };
    Some(n.parse::<f64>().ok()? * scale)
}

/// min / median / max.
fn spread(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => "-".into(),
        n => format!("{:.2} / {:.2} / {:.2}", v[0], v[n / 2], v[n - 1]),
    }
}

/// The plugin config with `extra`'s fields (a JSON object) merged in, as a string.
fn with_extra(mut plugin: serde_json::Value, extra: Option<&str>) -> anyhow::Result<String> {
    if let Some(extra) = extra {
        let serde_json::Value::Object(extra) = serde_json::from_str(extra)? else {
            bail!("--extra must be a JSON object");
        };
        if let Some(p) = plugin.as_object_mut() {
            p.extend(extra);
        }
    }
    Ok(plugin.to_string())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let wasm = args
        .wasm
        .clone()
        .unwrap_or_else(|| repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm"));
    anyhow::ensure!(
        wasm.is_file(),
        "build the filter first: cargo build --release --target wasm32-wasip1 -p tokenaware"
    );
    let streaming = wasm_tests::instant::Streaming {
        events: args.events,
        gap: std::time::Duration::from_secs_f64(args.event_gap_ms.max(0.0) / 1000.0),
    };
    let eps = wasm_tests::instant::start_with(args.endpoints, streaming).await?;
    let list: Vec<_> = eps.iter().map(|a| json!({ "address": a })).collect();
    let plugin = with_extra(json!({ "endpoints": list }), args.extra.as_deref())?;
    let plain = match &args.baseline_wasm {
        Some(base) => {
            let extra = args.baseline_extra.as_deref().or(args.extra.as_deref());
            let config = with_extra(json!({ "endpoints": list }), extra)?;
            GatewayConfig::new(eps.clone()).with_wasm(base, config)
        }
        None => GatewayConfig::new(eps.clone()),
    };
    let mut filtered = GatewayConfig::new(eps.clone()).with_wasm(&wasm, plugin);
    let mut plain = plain;
    plain.concurrency = args.concurrency;
    filtered.concurrency = args.concurrency;
    let (plain, filtered) = tokio::task::spawn_blocking(move || {
        anyhow::Ok((Envoy::start(plain)?, Envoy::start(filtered)?))
    })
    .await??;
    println!(
        "upstream: instant stub on {}; Envoy --concurrency {} plain pid {} / filter pid {}; load: {:?}",
        eps.join(","),
        args.concurrency,
        plain.pid(),
        filtered.pid(),
        args.client,
    );

    std::fs::create_dir_all(&args.out_dir)?;
    let dir = std::env::temp_dir().join(format!("tokenaware-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let lua = dir.join("post.lua");
    std::fs::write(&lua, LUA)?;

    let mut rows = Vec::new();
    for size in args.sizes.clone() {
        let body = dir.join(format!("body-{size}.json"));
        let body_text = chat_body(size, args.stream);
        std::fs::write(&body, &body_text)?;
        for round in 0..args.rounds {
            // Alternate which gateway runs first, so drift in the machine's load is shared.
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            let mut tput = [None, None];
            for with_filter in order {
                let e = if with_filter { &filtered } else { &plain };
                let url = e.url("/v1/chat/completions");
                let (pid, secs, conns) = (e.pid(), args.secs, args.connections);
                let (lua, body) = (lua.clone(), body.clone());
                let (client, streams) = (args.client, args.streams);
                let t = tokio::task::spawn_blocking(move || match client {
                    Client::Wrk => wrk(&url, pid, 2, conns, secs, &lua, &body),
                    Client::H2load => h2load(&url, pid, conns, streams, secs, &body),
                })
                .await??;
                tput[usize::from(with_filter)] = Some(t);
            }
            let [Some(pt), Some(ft)] = tput else {
                bail!("missing run")
            };
            let urls = [
                plain.url("/v1/chat/completions"),
                filtered.url("/v1/chat/completions"),
            ];
            let text = bytes::Bytes::from(body_text.clone());
            let lat =
                paired::measure([&urls[0], &urls[1]], |_| text.clone(), 200, args.pairs).await?;
            let (pl, fl, paired) = (lat.first, lat.second, lat.diff_p50_ms);
            let row = Row {
                round,
                size,
                rps_ratio: ft.rps / pt.rps,
                added_p50_ms: fl.p50_ms - pl.p50_ms,
                added_p99_ms: fl.p99_ms - pl.p99_ms,
                added_cpu_us: ft.cpu_us_per_req - pt.cpu_us_per_req,
                paired_p50_ms: paired,
                plain_tput: pt,
                filter_tput: ft,
                plain_lat: pl,
                filter_lat: fl,
            };
            println!(
                "{:>6} B round {round}: rps plain {:.0} filter {:.0} ({:.1} %) | 1-conn p50 {:.3}/{:.3} ms p99 {:.3}/{:.3} ms (added p50 {:+.3}, paired {:+.3}, p99 {:+.3}; {} pairs) | CPU/req {:.0}/{:.0} µs | errors {}/{}",
                size,
                pt.rps,
                ft.rps,
                100.0 * row.rps_ratio,
                pl.p50_ms,
                fl.p50_ms,
                pl.p99_ms,
                fl.p99_ms,
                row.added_p50_ms,
                row.paired_p50_ms,
                row.added_p99_ms,
                fl.requests,
                pt.cpu_us_per_req,
                ft.cpu_us_per_req,
                pt.errors + pl.errors,
                ft.errors + fl.errors,
            );
            rows.push(row);
        }
    }

    println!("\nsummary (min / median / max over rounds)");
    println!("| body | rps plain | rps filter | filter/plain | added p50 ms | paired p50 ms | added p99 ms | CPU µs/req plain | CPU µs/req filter |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for size in &args.sizes {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.size == *size).collect();
        let col = |f: &dyn Fn(&Row) -> f64| spread(rs.iter().map(|r| f(r)).collect());
        println!(
            "| {} B | {} | {} | {} | {} | {} | {} | {} | {} |",
            size,
            col(&|r| r.plain_tput.rps),
            col(&|r| r.filter_tput.rps),
            col(&|r| r.rps_ratio),
            col(&|r| r.added_p50_ms),
            col(&|r| r.paired_p50_ms),
            col(&|r| r.added_p99_ms),
            col(&|r| r.plain_tput.cpu_us_per_req),
            col(&|r| r.filter_tput.cpu_us_per_req),
        );
    }
    for (name, e) in [("plain", &plain), ("filter", &filtered)] {
        let status = std::fs::read_to_string(format!("/proc/{}/status", e.pid()))?;
        let rss = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .unwrap_or("");
        println!(
            "{name} Envoy after the runs: {}",
            rss.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
    let routed = filtered
        .stat("wasmcustom.tokenaware_requests_routed")?
        .unwrap_or(0);
    println!("filter: tokenaware_requests_routed = {routed}");
    let out = args.out_dir.join("results.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows)?)?;
    println!("wrote {}", out.display());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "starting benchmark...
spawning thread #0: 16 total client(s). Timing-based test with 0s of warm-up time and 6s of main duration for measurements.
Application protocol: h2c

finished in 6.00s, 16483.33 req/s, 6.38MB/s
requests: 98900 total, 98916 started, 98900 done, 98897 succeeded, 3 failed, 2 errored, 1 timeout
status codes: 98897 2xx, 0 3xx, 0 4xx, 3 5xx
traffic: 38.27MB (40130045) total, 1.51MB (1582400) headers (space savings 95.51%)
";

    #[test]
    fn h2load_reports_give_seconds_answers_and_failures() {
        let (secs, ok, errors) = parse_h2load(REPORT).unwrap();
        assert_eq!((secs, ok), (6.0, 98_897));
        assert_eq!(errors, 3);
        let redirected = REPORT
            .replace("98897 succeeded", "98899 succeeded")
            .replace("98897 2xx, 0 3xx", "98897 2xx, 2 3xx");
        assert_eq!(parse_h2load(&redirected).unwrap().2, 5);
        let short = REPORT.replace("finished in 6.00s", "finished in 250.5ms");
        assert_eq!(parse_h2load(&short).unwrap().0, 0.2505);
        assert!(parse_h2load("starting benchmark...\n").is_none());
    }
}

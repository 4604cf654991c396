//! `memory`: what the filter holds in Envoy with the affinity index full, and whether it
//! grows over time. One Envoy (`--concurrency 2`) with tokenaware in front of 100 instant
//! endpoints ([`wasm_tests::instant`]), each configured with 500,000 KV tokens in 16-token
//! blocks (31,250 index blocks; 3,125,000 in all). The tool
//!
//! 1. reads Envoy's memory (VmRSS from `/proc/PID/status`; `server.memory_allocated` and
//!    `server.memory_heap_size` from admin `/stats`, and the filter VMs' own linear memory
//!    from the filter's `tokenaware_vm_memory_bytes` / `_max_bytes` / `tokenaware_vms`
//!    gauges) after a few warm-up requests, and the same of a plain Envoy (no filter) with
//!    the same endpoints, for the filter's baseline;
//! 2. fills the index: distinct completions prompts of 2,048 blocks (the most the filter
//!    hashes), `--fill` times the fleet's total capacity in blocks, and reads memory again;
//!    the access log tells how many of them each endpoint got (at least its capacity);
//! 3. with `--soak-secs`, keeps a mixed load going (a quarter distinct long prompts, the rest
//!    a shared 64 KiB prefix from a pool of 64 plus a distinct question) at `--rate`
//!    requests/s and samples memory every `--sample-secs`.
//!
//! ```sh
//! cargo build --release --target wasm32-wasip1 -p tokenaware
//! cargo run -p wasm-tests --release --bin memory -- [--soak-secs 1800]
//! ```
//!
//! The upstream answers at once, so a request never fails before its first byte and no
//! index insert is rolled back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use tokio::sync::Semaphore;
use wasm_tests::envoy::{repo_root, Envoy, GatewayConfig};
use wasm_tests::fleet::MODEL;

#[derive(Debug, Parser)]
#[command(about = "Envoy + tokenaware memory with the index full, and over a soak")]
struct Args {
    #[arg(long, default_value_t = 100)]
    endpoints: usize,
    /// KV capacity per endpoint, tokens (index blocks = this / 16).
    #[arg(long, default_value_t = 500_000)]
    kv_capacity_tokens: u64,
    /// Prompt blocks sent during the fill, as a multiple of the total index capacity.
    #[arg(long, default_value_t = 3.0)]
    fill: f64,
    /// Requests in flight.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Soak length after the fill (0: no soak).
    #[arg(long, default_value_t = 0)]
    soak_secs: u64,
    /// Soak request rate, requests/s.
    #[arg(long, default_value_t = 40.0)]
    rate: f64,
    /// Memory sample period during the soak.
    #[arg(long, default_value_t = 30)]
    sample_secs: u64,
    /// Turn `peers` on with a second filter Envoy as the other replica, sent as many
    /// distinct prompts as the measured one: the measured Envoy's ring fills, it answers the
    /// other's polls and reads the other's answers (the most `peers` holds in one process).
    #[arg(long)]
    peers: bool,
}

const BLOCK_TOKENS: u64 = 16;
const BLOCK_BYTES: usize = 64;
const MAX_BLOCKS: usize = 2048;
/// Longer than Envoy's default stats flush interval (5 s).
const FLUSH: Duration = Duration::from_secs(6);

#[derive(Debug, Clone, Copy)]
struct Sample {
    rss_kib: u64,
    hwm_kib: u64,
    allocated: i64,
    heap: i64,
    /// The filter VMs' linear memory, summed and largest, and how many VMs (None: plain).
    vm: Option<(i64, i64, i64)>,
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

fn status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("{field} in /proc/{pid}/status"))
}

fn sample(e: &Envoy) -> anyhow::Result<Sample> {
    Ok(Sample {
        rss_kib: status_kib(e.pid(), "VmRSS:")?,
        hwm_kib: status_kib(e.pid(), "VmHWM:")?,
        allocated: e.stat("server.memory_allocated")?.unwrap_or(-1),
        heap: e.stat("server.memory_heap_size")?.unwrap_or(-1),
        vm: match e.stat("wasmcustom.tokenaware_vm_memory_bytes")? {
            Some(total) => Some((
                total,
                e.stat("wasmcustom.tokenaware_vm_memory_max_bytes")?
                    .unwrap_or(-1),
                e.stat("wasmcustom.tokenaware_vms")?.unwrap_or(-1),
            )),
            None => None,
        },
    })
}

fn show(label: &str, s: Sample) {
    let vm = match s.vm {
        Some((total, max, n)) => format!(
            " | VMs' linear memory {:5.1} MiB ({n} VMs, largest {:.1} MiB)",
            mib(total as f64),
            mib(max as f64)
        ),
        None => String::new(),
    };
    println!(
        "{label:<28} RSS {:7.1} MiB (peak {:7.1}) | memory_allocated {:7.1} MiB | heap_size {:7.1} MiB{vm}",
        s.rss_kib as f64 / 1024.0,
        s.hwm_kib as f64 / 1024.0,
        mib(s.allocated as f64),
        mib(s.heap as f64)
    );
}

/// A prompt whose first block is unique to `id`, `bytes` long.
fn distinct_prompt(id: u64, bytes: usize, filler: &str) -> String {
    let mut p = format!("request {id:016x} ");
    p.push_str(&filler[..bytes.saturating_sub(p.len()).min(filler.len())]);
    p
}

async fn post(c: &reqwest::Client, url: &str, prompt: String) -> bool {
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 }).to_string();
    match c.post(url).body(body).send().await {
        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
        Err(_) => false,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let wasm = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    anyhow::ensure!(
        wasm.is_file(),
        "build the filter first: cargo build --release --target wasm32-wasip1 -p tokenaware"
    );
    let eps = wasm_tests::instant::start(args.endpoints).await?;
    let list: Vec<_> = eps.iter().map(|a| json!({ "address": a })).collect();
    let mut plugin = json!({
        "endpoints": list,
        "maxEndpoints": args.endpoints.max(64),
        "blockSizeTokens": BLOCK_TOKENS,
        "maxPrefixBlocks": MAX_BLOCKS,
        "kvCapacityTokens": args.kv_capacity_tokens,
    });
    let ports = wasm_tests::ports::free_ports(2)?;
    if args.peers {
        plugin["peers"] = json!({
            "clusters": ["other_replica"],
            "intervalMs": 100,
            "token": "memory-replicas-token",
        });
    }
    let replica = |me: u16, other: u16| {
        let mut cfg = GatewayConfig::new(eps.clone()).with_wasm(&wasm, plugin.to_string());
        cfg.listen_port = me;
        if args.peers {
            cfg.peer_clusters = vec![("other_replica".into(), format!("127.0.0.1:{other}"))];
        }
        cfg
    };
    let (cfg, other) = (replica(ports[0], ports[1]), replica(ports[1], ports[0]));
    let plain = GatewayConfig::new(eps.clone());
    let with_other = args.peers;
    let (envoy, plain, other) = tokio::task::spawn_blocking(move || {
        let other = match with_other {
            true => Some(Envoy::start(other)?),
            false => None,
        };
        anyhow::Ok((Envoy::start(cfg)?, Envoy::start(plain)?, other))
    })
    .await??;
    let per_ep = args.kv_capacity_tokens / BLOCK_TOKENS;
    let total_blocks = per_ep * args.endpoints as u64;
    println!(
        "Envoy pid {} --concurrency 2, filter with {} endpoints x {per_ep} blocks = {total_blocks} index blocks",
        envoy.pid(),
        args.endpoints
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let url = envoy.url("/v1/completions");
    // With `--peers`, the other replica gets distinct prompts of its own, one for each of
    // the measured one's.
    let other_url: Option<Arc<str>> = other.as_ref().map(|e| e.url("/v1/completions").into());
    let filler: Arc<str> = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. "
        .repeat(MAX_BLOCKS * BLOCK_BYTES / 50 + 2)
        .into();
    let prompt_bytes = MAX_BLOCKS * BLOCK_BYTES + 64;

    let plain_url = plain.url("/v1/completions");
    for i in 0..20 {
        post(&client, &url, format!("warm-up {i}")).await;
        post(&client, &plain_url, format!("warm-up {i}")).await;
    }
    // Envoy refreshes its server.memory_* gauges on the stats flush (every 5 s).
    tokio::time::sleep(FLUSH).await;
    let base = sample(&plain)?;
    show("plain Envoy, same endpoints", base);
    drop(plain);
    let before = sample(&envoy)?;
    show("filter, after start", before);

    // Fill: distinct prompts of MAX_BLOCKS blocks each, `concurrency` in flight.
    let n = ((total_blocks as f64 * args.fill) / MAX_BLOCKS as f64).ceil() as u64;
    let t0 = Instant::now();
    let sem = Arc::new(Semaphore::new(args.concurrency));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for id in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let (c, url, filler, failed) =
            (client.clone(), url.clone(), filler.clone(), failed.clone());
        let other_url = other_url.clone();
        tasks.push(tokio::spawn(async move {
            if !post(&c, &url, distinct_prompt(id, prompt_bytes, &filler)).await {
                failed.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(o) = other_url {
                let prompt = distinct_prompt(id | 1 << 40, prompt_bytes, &filler);
                if !post(&c, &o, prompt).await {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(permit);
        }));
    }
    for t in tasks {
        t.await?;
    }
    println!(
        "fill: {n} distinct prompts of {MAX_BLOCKS} blocks ({:.1}x capacity) in {:.1} s, {} failed",
        args.fill,
        t0.elapsed().as_secs_f64(),
        failed.load(Ordering::Relaxed)
    );
    // Blocks each endpoint was sent during the fill, from the access log's upstream host.
    let log = envoy.access_log();
    let mut per: std::collections::HashMap<&str, u64> =
        eps.iter().map(|e| (e.as_str(), 0)).collect();
    let fill_line = |l: &&str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix("bytes_in="))
            .and_then(|b| b.parse::<usize>().ok())
            .is_some_and(|b| b > prompt_bytes)
    };
    for l in log.lines().filter(fill_line) {
        if let Some(c) = l
            .split_whitespace()
            .find_map(|w| w.strip_prefix("upstream="))
            .and_then(|u| per.get_mut(u))
        {
            *c += 1;
        }
    }
    let (lo, hi) = (
        per.values().copied().min().unwrap_or(0),
        per.values().copied().max().unwrap_or(0),
    );
    println!(
        "requests per endpoint: min {lo} max {hi}, i.e. at least {} blocks sent to each (capacity {per_ep})",
        lo * MAX_BLOCKS as u64
    );
    // Also past the filter's own `statsFlushMs` (1 s): its counters are complete.
    tokio::time::sleep(FLUSH).await;
    let (_, stats) = envoy.admin_get("/stats?filter=tokenaware")?;
    let per_endpoint = |l: &str| l.contains("tokenaware_endpoint_");
    for l in stats
        .lines()
        .filter(|l| !l.ends_with(": 0") && !per_endpoint(l))
    {
        println!("  {l}");
    }
    let full = sample(&envoy)?;
    show("index full", full);
    println!(
        "delta: RSS {:+.1} MiB, memory_allocated {:+.1} MiB, heap_size {:+.1} MiB",
        (full.rss_kib as f64 - before.rss_kib as f64) / 1024.0,
        mib((full.allocated - before.allocated) as f64),
        mib((full.heap - before.heap) as f64)
    );
    let over_plain = mib((full.allocated - base.allocated) as f64);
    let vms = full.vm.map_or(0.0, |(total, _, _)| mib(total as f64));
    println!(
        "filter - plain, index full: RSS {:+.1} MiB, memory_allocated {over_plain:+.1} MiB \
         (shared data and the filter's other Envoy-side allocations); with the VMs' linear \
         memory ({vms:.1} MiB): {:.1} MiB",
        (full.rss_kib as f64 - base.rss_kib as f64) / 1024.0,
        over_plain + vms
    );

    if args.soak_secs == 0 {
        return Ok(());
    }
    println!(
        "soak: {} s at {} req/s, sample every {} s",
        args.soak_secs, args.rate, args.sample_secs
    );
    let shared: Arc<Vec<String>> = Arc::new(
        (0..64u64)
            .map(|k| distinct_prompt(u64::MAX - k, 64 * 1024, &filler))
            .collect(),
    );
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + Duration::from_secs(args.soak_secs);
    let driver = {
        let (c, url, sent, failed, sem) = (
            client.clone(),
            url.clone(),
            sent.clone(),
            failed.clone(),
            sem.clone(),
        );
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
        let (other_url, filler) = (other_url.clone(), filler.clone());
        tokio::spawn(async move {
            let mut i = n;
            while Instant::now() < end {
                tick.tick().await;
                let Ok(permit) = sem.clone().acquire_owned().await else {
                    break;
                };
                i += 1;
                let prompt = if i.is_multiple_of(4) {
                    // The other replica places as many new prefixes as this one.
                    if let Some(o) = other_url.clone() {
                        let (c, p) = (
                            c.clone(),
                            distinct_prompt(i | 1 << 40, prompt_bytes, &filler),
                        );
                        tokio::spawn(async move { post(&c, &o, p).await });
                    }
                    distinct_prompt(i, prompt_bytes, &filler)
                } else {
                    format!("{}\nquestion {i}", shared[(i as usize * 7) % shared.len()])
                };
                let (c, url, sent, failed) = (c.clone(), url.clone(), sent.clone(), failed.clone());
                tokio::spawn(async move {
                    if !post(&c, &url, prompt).await {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                    drop(permit);
                });
            }
        })
    };
    let mut samples = vec![(0u64, sample(&envoy)?)];
    println!("| t (s) | requests | RSS MiB | memory_allocated MiB | heap_size MiB |");
    println!("|---|---|---|---|---|");
    let row = |t: u64, s: Sample, sent: u64| {
        println!(
            "| {t} | {sent} | {:.1} | {:.1} | {:.1} |",
            s.rss_kib as f64 / 1024.0,
            mib(s.allocated as f64),
            mib(s.heap as f64)
        );
    };
    row(0, samples[0].1, 0);
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(args.sample_secs)).await;
        let t = start.elapsed().as_secs();
        let s = sample(&envoy)?;
        row(t, s, sent.load(Ordering::Relaxed));
        samples.push((t, s));
    }
    driver.await?;
    // Warm-up: the first third of the soak; growth is measured from there to the end.
    let warm = samples.len() / 3;
    let (tw, sw) = samples[warm];
    let (tl, sl) = samples[samples.len() - 1];
    let max_rss = samples.iter().map(|(_, s)| s.rss_kib).max().unwrap_or(0);
    println!(
        "soak: {} requests, {} failed; from t={tw} s to t={tl} s: RSS {:+.1} MiB, memory_allocated {:+.1} MiB; max RSS {:.1} MiB",
        sent.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        (sl.rss_kib as f64 - sw.rss_kib as f64) / 1024.0,
        mib((sl.allocated - sw.allocated) as f64),
        max_rss as f64 / 1024.0
    );
    Ok(())
}

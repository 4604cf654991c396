//! `bench`: the side-by-side benchmark. For each workload and target it starts a fresh
//! simulated fleet (cold caches), starts the target in front of it, and sends the same seeded
//! rate ladder through it with the load generator.
//!
//! ```sh
//! cargo build --release --target wasm32-wasip1 -p tokenaware
//! cargo run -p wasm-tests --release --bin bench -- [--quick] [--workload NAME]...
//! ```
//!
//! Targets: `envoy-round-robin`, `envoy-least-request`, `envoy-ring-hash` (on
//! `x-prefix-group`), `smg-cache-aware` (PyPI `smg`, installed into `.venv` with pip if
//! missing; skipped with a message if that fails), `tokenaware-prefill`,
//! `tokenaware-decode` (`scorer: active-request`). Writes `target/bench/results.json`,
//! `target/bench/report.md` and one SVG per workload in `target/bench/plots/` (TTFT p90,
//! input tokens/s and hit rate against the rate; `--docs-plots` also writes `docs/plots/`).
//! `--plot-only [--results FILE]...` redraws the plots from existing results without running.
//!
//! `--gateways 1,2` runs each target once per count; with N > 1 there are N gateway
//! processes in front of the one fleet and the arrivals are dealt round-robin over them.
//!
//! Fidelity knobs, the same for every target: `--scale` multiplies every token count of the
//! workload *and* the fleet's R_peak and KV capacity (and divides its per-token decode time),
//! so prefill and decode take the same model time as unscaled; the time factor runs model
//! time faster or slower than the wall clock. Rates, times and tokens are reported in model
//! units.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde::Serialize;
use serde_json::json;
use wasm_tests::envoy::{repo_root, Envoy, FallbackLb, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, Timing, MODEL};
use wasm_tests::loadgen::{self, Stage, Summary, Target, Workload, WorkloadKind, SEED_GROUPS};
use wasm_tests::ratewatch::{Poll, RateWatch, Reached};
use wasm_tests::replicas::Deal;

const TARGETS: [&str; 6] = [
    "envoy-round-robin",
    "envoy-least-request",
    "envoy-ring-hash",
    "smg-cache-aware",
    "tokenaware-prefill",
    "tokenaware-decode",
];

/// Opt-in tokenaware configurations for the learning claims (`--targets`): R_peak learned
/// from a start 4× too high or too low, the same wrong R_peak fixed, and the latency
/// configuration (learned predictor, latency scorer, weighted-random picker);
/// `tokenaware-auto` learns from the right start (for `--slow-endpoints`, where one global
/// R_peak cannot be right). `tokenaware-fixed` is the correctly calibrated run the learning
/// targets are held against: the fleet's R_peak and T_max in real time, as they are told
/// (`tokenaware-prefill` is told both in model time, so its τ is the same but T_max, where
/// it counts alone, is 1 / time factor as long).
const LEARNING_TARGETS: [&str; 6] = [
    "tokenaware-auto",
    "tokenaware-auto-high",
    "tokenaware-auto-low",
    "tokenaware-fixed",
    "tokenaware-fixed-high",
    "tokenaware-latency",
];

/// Learning targets that do not learn R_peak (no rates to watch).
const FIXED_TARGETS: [&str; 2] = ["tokenaware-fixed", "tokenaware-fixed-high"];

/// Unscaled fleet timing: R_peak (tokens/s) and decode time per output token (ms).
const R_PEAK: f64 = 20_480.0;
const DECODE_MS: f64 = 5.0;

#[derive(Debug, Parser)]
#[command(about = "Side-by-side benchmark: Envoy balancers, smg cache_aware, tokenaware")]
struct Args {
    /// Short ladders (one workload unless --workload is given): a few minutes in all.
    #[arg(long)]
    quick: bool,
    /// Workloads to run (repeatable; default: all four, or b2b-saas with --quick; `mixed` is
    /// opt-in).
    #[arg(long)]
    workload: Vec<String>,
    /// Targets to run (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// Override the ladder (model req/s, comma-separated).
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Override the stage length (model seconds).
    #[arg(long)]
    stage_duration: Option<f64>,
    /// Override the token scale.
    #[arg(long)]
    scale: Option<f64>,
    /// Override the time factor (wall seconds per model second).
    #[arg(long)]
    time_factor: Option<f64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Gateway replicas per target (comma-separated counts, each a separate run): N > 1
    /// starts N gateways in front of the one fleet and deals the arrivals round-robin over
    /// them (`wasm_tests::replicas`); rows are labelled `TARGET xN`.
    #[arg(long, value_delimiter = ',', default_values_t = [1])]
    gateways: Vec<usize>,
    /// How arrivals are dealt over several gateways: `alternate` (round-robin, every prefix
    /// reaches every gateway) or `by-group` (a hash of the prefix group, as a balancer with
    /// affinity by tenant would).
    #[arg(long, value_enum, default_value_t = Deal::Alternate)]
    deal: Deal,
    /// With several gateways, each tokenaware gateway polls the others' new placements
    /// (the filter's `peers`, one cluster per other gateway, every `--peers-interval-ms`).
    #[arg(long)]
    peers: bool,
    #[arg(long, default_value_t = 250)]
    peers_interval_ms: u64,
    /// With `--peers`: name the gateways as the hosts of one cluster of all of them
    /// (`peers.cluster`, read from Envoy's admin; each finds itself among them) instead of
    /// one cluster per other gateway.
    #[arg(long)]
    peers_one_cluster: bool,
    /// Output directory.
    #[arg(long, default_value = "target/bench")]
    out_dir: PathBuf,
    /// A JSON object merged into every tokenaware target's plugin configuration, e.g.
    /// '{"coldPlacementChoices":2}' (reported with the profile in results.json).
    #[arg(long)]
    plugin_extra: Option<String>,
    /// Also write every request's record (endpoint, TTFT, hits) to
    /// OUT_DIR/records/WORKLOAD/TARGET.json, one array per stage, and a learning target's
    /// rates polled during the run to TARGET.rates.json beside it.
    #[arg(long)]
    records: bool,
    /// Only draw the plots from existing results (`--results`, default
    /// `<out-dir>/results.json`); runs nothing.
    #[arg(long)]
    plot_only: bool,
    /// Results to plot with --plot-only (repeatable; a workload in a later file replaces it
    /// in earlier ones).
    #[arg(long)]
    results: Vec<PathBuf>,
    /// Also write the plots to docs/plots/ (the figures docs/benchmarks.md shows).
    #[arg(long)]
    docs_plots: bool,
    /// A heterogeneous fleet: the first N endpoints prefill at half R_peak (every target
    /// is still told the fleet's full R_peak).
    #[arg(long, default_value_t = 0)]
    slow_endpoints: usize,
    /// The fleet's metrics report this multiple of its real KV capacity (the index is told
    /// too much: the cache correction's case).
    #[arg(long, default_value_t = 1.0)]
    kv_report_factor: f64,
    /// seed-sim's prefix groups (default 40, what the fleet's cache just holds; 60 is more
    /// than it holds).
    #[arg(long)]
    groups: Option<usize>,
}

/// Draws `<workload>.svg` into `<out-dir>/plots` (and docs/plots with --docs-plots).
fn write_plots(a: &Args, results: &[PathBuf]) -> anyhow::Result<()> {
    let set = wasm_tests::plot::ResultSet::load(results)?;
    let mut dirs = vec![a.out_dir.join("plots")];
    if a.docs_plots {
        dirs.push(repo_root().join("docs/plots"));
    }
    for f in set.write_svgs(&dirs)? {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

/// A workload's run parameters.
#[derive(Debug, Clone, Serialize)]
struct Profile {
    workload: &'static str,
    scale: f64,
    time_factor: f64,
    rates: Vec<f64>,
    stage_duration: f64,
    /// TTFT p90 SLO, model seconds: twice the cold fill of the mean prompt (reasoning: 2 s).
    slo_s: f64,
    /// Fields merged into every tokenaware target's plugin configuration (`--plugin-extra`).
    plugin_extra: serde_json::Value,
    /// Endpoints at half R_peak (`--slow-endpoints`).
    slow_endpoints: usize,
    /// KV capacity the fleet reports over its real one (`--kv-report-factor`).
    kv_report_factor: f64,
    /// seed-sim's prefix groups (`--groups`).
    groups: usize,
    /// How arrivals are dealt over several gateways (`--deal`).
    deal: Deal,
    /// `--peers`: the gateways' poll interval of each other's placements, ms.
    peers_interval_ms: Option<u64>,
    /// `--peers-one-cluster`.
    peers_one_cluster: bool,
}

fn profile(kind: WorkloadKind, quick: bool) -> Profile {
    // Default SLO: twice the cold fill of the mean prompt. Reasoning's (0.12 s) is shorter
    // than one decode step of the scaled fleet (a scaled token stands for 1 / scale tokens),
    // so a request joining a batch misses it whatever the router does; it uses the llm-d
    // catalog's TTFT SLO of 2 s instead.
    // Mixed's p90 falls in its code-generation half (its mean prompt, 32k tokens, is no
    // request's size), so it takes that half's SLO.
    let slo_s = match kind {
        WorkloadKind::Reasoning => 2.0,
        WorkloadKind::Mixed => 2.0 * WorkloadKind::CodeGeneration.mean_prompt_tokens() / R_PEAK,
        _ => 2.0 * kind.mean_prompt_tokens() / R_PEAK,
    };
    use WorkloadKind::*;
    // (scale, time factor, full ladder, quick ladder); stages last 14 model seconds (12 quick),
    // so the full run fits 25 minutes on two cores. On this fleet the cache-aware policies
    // part between 60 and 90 req/s on b2b-saas (the KV pool runs out), so its ladder steps by
    // 30 there and ends at 90: every router missed 120 by seconds in every run (p90 9-30 s
    // against 0.70), and that stage drains slowest. Code-generation's steps are fine from 2
    // to 6 req/s, where they part. A reasoning stage drains only when its longest output (up
    // to 160 model seconds) is done, so its full ladder is its top stage, 8 req/s: every
    // target met 2, 4 and 8 in earlier runs (TTFT p90 0.32-0.38 s at 8 against the 2 s SLO).
    let (scale, time_factor, full, short): (f64, f64, &[f64], &[f64]) = match kind {
        SeedSim => (0.1, 0.5, &[4.0, 8.0, 16.0, 32.0, 48.0], &[5.0, 20.0, 40.0]),
        CodeGeneration => (0.1, 0.5, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2.0, 6.0, 12.0]),
        // 8,000-token outputs: a smaller scale keeps the streamed chunks per second low.
        Reasoning => (0.02, 0.25, &[8.0], &[2.0, 6.0]),
        B2bSaas => (0.1, 0.5, &[10.0, 30.0, 60.0, 90.0], &[10.0, 25.0, 45.0]),
        // Reasoning's scale and time factor: its outputs at code-generation's would stream
        // too many chunks for two cores, and a stage drains only when its longest output
        // (160 model seconds) is done.
        Mixed => (
            0.02,
            0.25,
            &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0],
            &[2.0, 4.0, 6.0],
        ),
    };
    let (rates, stage) = if quick {
        (short.to_vec(), 12.0)
    } else {
        (full.to_vec(), 14.0)
    };
    Profile {
        workload: kind.name(),
        scale,
        time_factor,
        rates,
        stage_duration: stage,
        slo_s,
        plugin_extra: serde_json::Value::Null,
        slow_endpoints: 0,
        kv_report_factor: 1.0,
        groups: SEED_GROUPS,
        deal: Deal::Alternate,
        peers_interval_ms: None,
        peers_one_cluster: false,
    }
}

fn fleet_config(kind: WorkloadKind, p: &Profile) -> FleetConfig {
    FleetConfig {
        endpoints: kind.endpoints(),
        timing: Timing {
            prefill_rate: R_PEAK * p.scale,
            decode_ms_per_token: DECODE_MS / p.scale,
            time_factor: p.time_factor,
            // vLLM's budget per step, scaled like the tokens (same number of steps).
            max_num_batched_tokens: ((8192.0 * p.scale) as usize).max(16),
            token_scale: p.scale,
            ..Default::default()
        },
        kv_blocks: ((kind.kv_tokens() as f64 * p.scale) / 16.0)
            .round()
            .max(1.0) as usize,
        slow_endpoints: p.slow_endpoints,
        kv_report_factor: p.kv_report_factor,
        ..Default::default()
    }
}

/// The tokenaware plugin configuration for the fleet (R_peak and block size scaled like the
/// workload; metrics polled every 200 ms wall).
fn tokenaware_config(eps: &[String], p: &Profile, decode: bool) -> String {
    let list: Vec<serde_json::Value> = eps.iter().map(|a| json!({"address": a})).collect();
    let block = ((64.0 * p.scale).round() as u64).max(16);
    let mut v = json!({
        "endpoints": list,
        "peakPrefillThroughput": R_PEAK * p.scale,
        "blockSizeTokens": block,
        "metrics": {"cluster": "models", "intervalMs": 200, "timeoutMs": 500, "staleAfterMs": 3000},
        // Each record keeps its decision (reason, predicted hit): the reasons behind a
        // figure can be read back from `--records`.
        "decisionHeader": true,
    });
    if decode {
        v["scorer"] = json!("active-request");
    }
    if let (Some(v), Some(extra)) = (v.as_object_mut(), p.plugin_extra.as_object()) {
        v.extend(extra.clone());
    }
    v.to_string()
}

/// The learning targets' plugin configurations. Learned rates and T_max are in real time:
/// the fleet's real R_peak is the model one over the time factor, and T_max is the default
/// 18 s (5 s for the latency configuration, as llm-d's) of model time.
fn learning_config(target: &str, eps: &[String], p: &Profile) -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&tokenaware_config(eps, p, false)).unwrap_or_default();
    let real = R_PEAK * p.scale / p.time_factor;
    let t_max = |ms: f64| json!(ms * p.time_factor);
    match target {
        "tokenaware-auto" => {
            v["peakPrefillThroughput"] = json!({"auto": real});
            v["maxTTFTPenaltyMs"] = t_max(18_000.0);
        }
        "tokenaware-auto-high" => {
            v["peakPrefillThroughput"] = json!({"auto": 4.0 * real});
            v["maxTTFTPenaltyMs"] = t_max(18_000.0);
        }
        "tokenaware-auto-low" => {
            v["peakPrefillThroughput"] = json!({"auto": real / 4.0});
            v["maxTTFTPenaltyMs"] = t_max(18_000.0);
        }
        "tokenaware-fixed" => {
            v["peakPrefillThroughput"] = json!(real);
            v["maxTTFTPenaltyMs"] = t_max(18_000.0);
        }
        "tokenaware-fixed-high" => {
            v["peakPrefillThroughput"] = json!(4.0 * real);
            v["maxTTFTPenaltyMs"] = t_max(18_000.0);
        }
        _ => {
            v["peakPrefillThroughput"] = json!({"auto": real});
            v["maxTTFTPenaltyMs"] = t_max(5_000.0);
            v["ttftSource"] = json!("latencyPredictor");
            v["scorer"] = json!("latency");
            v["picker"] = json!("weighted-random");
        }
    }
    v.to_string()
}

/// The learned prefill rates (gauges) over the fleet's real R_peak, after a run.
fn report_learned(gw: &Gateway, p: &Profile, endpoints: usize, target: &str) {
    let Gateway::Envoy(e) = gw else { return };
    let fast = R_PEAK * p.scale / p.time_factor;
    let mut any_samples = false;
    let reals = real_rates(p, endpoints);
    let learned: Vec<String> = (0..endpoints)
        .filter_map(|slot| {
            let real = reals[slot];
            let name = format!("wasmcustom.tokenaware_endpoint_{slot}_prefill_tokens_per_s");
            let rate = e.stat(&name).ok().flatten()?;
            let samples = e
                .stat(&format!(
                    "wasmcustom.tokenaware_endpoint_{slot}_ttft_samples"
                ))
                .ok()
                .flatten()
                .unwrap_or(0);
            any_samples |= samples > 0;
            Some(format!(
                "{:+.1}% ({samples} samples)",
                (rate as f64 / real - 1.0) * 100.0
            ))
        })
        .collect();
    // A target that does not learn reports its prior with no samples: nothing to show.
    if !any_samples {
        return;
    }
    eprintln!(
        "{target}: learned R_peak vs the fleet's {fast:.0} tok/s ({} at half): {}",
        p.slow_endpoints,
        learned.join(", ")
    );
    let shares: Vec<String> = (0..endpoints)
        .filter_map(|slot| {
            let name = format!("wasmcustom.tokenaware_endpoint_{slot}_kv_capacity_share_pct");
            e.stat(&name).ok().flatten().map(|pct| format!("{pct} %"))
        })
        .collect();
    eprintln!(
        "{target}: KV capacity share the index assumes (the fleet keeps {:.0} % of what it reports): {}",
        100.0 / p.kv_report_factor,
        shares.join(", ")
    );
}

/// Each slot's real prefill rate in real time (the gauges' units). Slots follow the
/// configured endpoint order, which is the fleet's.
fn real_rates(p: &Profile, endpoints: usize) -> Vec<f64> {
    let fast = R_PEAK * p.scale / p.time_factor;
    (0..endpoints)
        .map(|slot| match slot < p.slow_endpoints {
            true => fast * wasm_tests::fleet::SLOW_PREFILL_FACTOR,
            false => fast,
        })
        .collect()
}

/// Samples per endpoint the issue gives the estimate to come within 15 %.
const CONVERGE_SAMPLES: i64 = 200;

/// Watches a learning target's estimates during its ladder (see `wasm_tests::ratewatch`).
fn watch_rates(gw: &Gateway, p: &Profile, endpoints: usize, target: &str) -> Option<RateWatch> {
    let Gateway::Envoy(e) = gw else { return None };
    if !LEARNING_TARGETS.contains(&target) || FIXED_TARGETS.contains(&target) {
        return None;
    }
    Some(RateWatch::start(
        e.admin_port(),
        real_rates(p, endpoints),
        CONVERGE_SAMPLES,
        Duration::from_millis(500),
        Duration::from_secs(4 * 3600),
    ))
}

fn report_watched(reached: &[Option<Reached>], target: &str) {
    let cells: Vec<String> = reached
        .iter()
        .map(|r| match r {
            Some(r) => format!(
                "{:+.1}% ({} samples; worst after {:+.1}%)",
                r.err * 100.0,
                r.samples,
                r.worst_after * 100.0
            ),
            None => format!("under {CONVERGE_SAMPLES} samples"),
        })
        .collect();
    let within = reached
        .iter()
        .flatten()
        .filter(|r| r.worst_after.abs() <= 0.15)
        .count();
    eprintln!(
        "{target}: learned R_peak when an endpoint reached {CONVERGE_SAMPLES} samples: {}; \
         within 15 % from then on: {within} of {}",
        cells.join(", "),
        reached.iter().flatten().count()
    );
}

/// tokenaware's decisions by reason over the whole ladder (what the policy did, for the
/// report's explanations).
fn report_decisions(gw: &Gateway, target: &str) {
    let Gateway::Envoy(e) = gw else { return };
    if !target.starts_with("tokenaware") {
        return;
    }
    // The filter's counters reach Envoy on a tick, up to `statsFlushMs` (1 s) and one tick
    // after the last request.
    std::thread::sleep(std::time::Duration::from_millis(2_100));
    let count = |name: &str| {
        e.stat(&format!("wasmcustom.tokenaware_{name}"))
            .ok()
            .flatten()
    };
    let names = [
        "decisions_sticky",
        "decisions_spill",
        "decisions_cold",
        "decisions_all_saturated",
        "decisions_balanced",
        "decisions_promote",
        "tau_breaks",
        "other_senders_seen",
        "foreign_requests_pct",
        "cold_found_cached_pct",
        "peer_placements_shared",
        "peer_placements_withdrawn",
        "peer_placements_learned",
        "peer_polls_failed",
    ];
    let seen: Vec<String> = names
        .iter()
        .filter_map(|n| count(n).map(|c| format!("{n} {c}")))
        .collect();
    if !seen.is_empty() {
        eprintln!("{target}: {}", seen.join(", "));
    }
}

/// A running target, stopped on drop.
enum Gateway {
    Envoy(Box<Envoy>),
    Smg(SmgProcess),
}

struct SmgProcess {
    child: Child,
    port: u16,
}

impl Drop for SmgProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway {
    fn url(&self) -> String {
        match self {
            Gateway::Envoy(e) => e.url("/v1/chat/completions"),
            Gateway::Smg(s) => format!("http://127.0.0.1:{}/v1/chat/completions", s.port),
        }
    }
}

/// `.venv/bin/smg`, installed with pip into `.venv` if missing.
fn smg_binary() -> anyhow::Result<PathBuf> {
    let root = repo_root();
    let bin = root.join(".venv/bin/smg");
    if bin.is_file() {
        return Ok(bin);
    }
    let pip = root.join(".venv/bin/pip");
    anyhow::ensure!(pip.is_file(), "no .venv (run scripts/setup.sh)");
    eprintln!("bench: installing smg into .venv (pip install smg)");
    let st = Command::new(&pip)
        .args(["install", "--quiet", "smg"])
        .status()
        .context("pip install smg")?;
    anyhow::ensure!(
        st.success() && bin.is_file(),
        "pip install smg failed ({st})"
    );
    Ok(bin)
}

fn start_smg(eps: &[String]) -> anyhow::Result<SmgProcess> {
    let bin = smg_binary()?;
    let ports = wasm_tests::ports::free_ports(2)?;
    let urls: Vec<String> = eps.iter().map(|e| format!("http://{e}")).collect();
    let log = std::fs::File::create(std::env::temp_dir().join("tokenaware-bench-smg.log"))?;
    let child = Command::new(bin)
        .args([
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            &ports[0].to_string(),
        ])
        .arg("--worker-urls")
        .args(&urls)
        .args(["--policy", "cache_aware", "--prometheus-host", "127.0.0.1"])
        .args(["--prometheus-port", &ports[1].to_string()])
        .args(["--log-level", "warn", "--queue-size", "100000"])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("spawn smg")?;
    let mut s = SmgProcess {
        child,
        port: ports[0],
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(st) = s.child.try_wait()? {
            anyhow::bail!(
                "smg exited early ({st}); see {}",
                std::env::temp_dir()
                    .join("tokenaware-bench-smg.log")
                    .display()
            );
        }
        if matches!(wasm_tests::envoy::http_get(s.port, "/health"), Ok((200, _))) {
            // Workers are activated asynchronously after the HTTP server is up.
            std::thread::sleep(Duration::from_secs(2));
            return Ok(s);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = s.child.kill();
    anyhow::bail!("smg not healthy after 30 s")
}

/// One gateway's place among peers: its own listener port and the other gateways'.
struct PeerMesh {
    listen_port: u16,
    others: Vec<u16>,
    /// The replicas' shared secret (`peers.tokenEnv`): one per mesh.
    token: String,
}

impl PeerMesh {
    fn of(ports: &[u16], i: usize) -> Option<PeerMesh> {
        Some(PeerMesh {
            listen_port: *ports.get(i)?,
            others: ports
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, &p)| p)
                .collect(),
            token: format!(
                "bench-mesh-{}",
                ports
                    .iter()
                    .map(u16::to_string)
                    .collect::<Vec<_>>()
                    .join("-")
            ),
        })
    }

    /// Every gateway's address, this one's among them.
    fn all(&self) -> Vec<String> {
        let mut ports: Vec<u16> = self.others.clone();
        ports.push(self.listen_port);
        ports.sort_unstable();
        ports.iter().map(|p| format!("127.0.0.1:{p}")).collect()
    }

    fn clusters(&self) -> Vec<(String, String)> {
        self.others
            .iter()
            .map(|p| (format!("peer_{p}"), format!("127.0.0.1:{p}")))
            .collect()
    }
}

/// The filter's `peers` section for `mesh`, merged into a plugin configuration.
fn with_peers(cfg: String, mesh: &PeerMesh, interval_ms: u64) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&cfg) else {
        return cfg;
    };
    let clusters: Vec<String> = mesh.clusters().into_iter().map(|(n, _)| n).collect();
    v["peers"] = json!({
        "clusters": clusters,
        "intervalMs": interval_ms,
        "tokenEnv": PEER_TOKEN_ENV,
    });
    v.to_string()
}

/// The one cluster of all gateways (`--peers-one-cluster`).
const PEER_GROUP: &str = "gateways";

/// The filter's `peers` section naming the gateways as the hosts of [`PEER_GROUP`].
fn with_peer_group(cfg: String, interval_ms: u64) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&cfg) else {
        return cfg;
    };
    v["peers"] = json!({
        "cluster": PEER_GROUP,
        "adminCluster": "admin",
        "intervalMs": interval_ms,
        "tokenEnv": PEER_TOKEN_ENV,
    });
    v.to_string()
}

/// The variable that holds the replicas' shared secret, as a deployment would pass it.
const PEER_TOKEN_ENV: &str = "TOKENAWARE_PEER_TOKEN";

fn start_target(
    name: &str,
    eps: &[String],
    p: &Profile,
    mesh: Option<&PeerMesh>,
) -> anyhow::Result<Gateway> {
    let wasm = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    let envoy = |mut cfg: GatewayConfig| {
        if let (Some(m), Some(w), Some(ms)) = (mesh, cfg.wasm.as_mut(), p.peers_interval_ms) {
            cfg.listen_port = m.listen_port;
            let conf = std::mem::take(&mut w.configuration);
            if p.peers_one_cluster {
                cfg.peer_group = Some((PEER_GROUP.into(), m.all()));
                w.configuration = with_peer_group(conf, ms);
            } else {
                cfg.peer_clusters = m.clusters();
                w.configuration = with_peers(conf, m, ms);
            }
            cfg.vm_env = vec![(PEER_TOKEN_ENV.into(), m.token.clone())];
        }
        Envoy::start(cfg).map(|e| Gateway::Envoy(Box::new(e)))
    };
    let gw = GatewayConfig::new(eps.to_vec());
    match name {
        "envoy-round-robin" => envoy(gw),
        "envoy-least-request" => envoy(gw.with_lb(FallbackLb::LeastRequest)),
        "envoy-ring-hash" => envoy(gw.with_lb(FallbackLb::RingHashPrefixGroup)),
        "tokenaware-prefill" | "tokenaware-decode" => {
            anyhow::ensure!(
                wasm.is_file(),
                "{} missing: cargo build --release --target wasm32-wasip1 -p tokenaware",
                wasm.display()
            );
            let cfg = tokenaware_config(eps, p, name == "tokenaware-decode");
            envoy(gw.with_wasm(wasm, cfg))
        }
        "smg-cache-aware" => start_smg(eps).map(Gateway::Smg),
        t if LEARNING_TARGETS.contains(&t) => {
            anyhow::ensure!(wasm.is_file(), "{} missing", wasm.display());
            envoy(gw.with_wasm(wasm, learning_config(t, eps, p)))
        }
        other => anyhow::bail!("unknown target {other}"),
    }
}

/// (target, capacity at SLO, per-stage rate and summary).
type TargetResult = (String, f64, Vec<(f64, Summary)>);

#[derive(Debug, Clone, Serialize)]
struct RunRow {
    target: String,
    workload: String,
    rate: f64,
    completed: usize,
    errors: usize,
    /// Up to five distinct error texts (`timeout`, `status 503`, ...).
    error_kinds: Vec<String>,
    ttft_p50_s: f64,
    ttft_p90_s: f64,
    hit_rate: f64,
    input_tok_s: f64,
    output_tok_s: f64,
    e2e_p50_s: f64,
    per_endpoint: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
struct CapacityRow {
    target: String,
    workload: String,
    capacity_rps: f64,
}

/// Whether a stage meets the SLO: ≥ 99 % of requests succeed and TTFT p90 < SLO.
fn meets_slo(s: &Summary, slo_s: f64) -> bool {
    s.requests > 0 && s.completed as f64 >= 0.99 * s.requests as f64 && s.ttft_p90_s < slo_s
}

/// Capacity at SLO: the highest ladder rate whose stage meets the SLO (0 if none).
fn capacity(stages: &[(f64, Summary)], slo_s: f64) -> f64 {
    stages
        .iter()
        .filter(|(_, s)| meets_slo(s, slo_s))
        .map(|(r, _)| *r)
        .fold(0.0, f64::max)
}

/// Stop the ladder once a stage is far past saturation (bounded run time; the same rule for
/// every target).
fn far_past(s: &Summary, slo_s: f64) -> bool {
    s.errors as f64 > 0.1 * s.requests.max(1) as f64 || s.ttft_p90_s > 4.0 * slo_s
}

/// When a target's ladder ends: after a stage far past saturation, or, once a stage has met
/// the SLO, after two stages in a row that miss it. One miss does not end it: a stage of a few
/// dozen requests can miss by chance (code-generation's p90 moves by seconds between
/// neighbouring stages), and the capacity is the highest rate that meets the SLO. Misses
/// before the first stage that meets it do not count: the first stages fill cold caches, and
/// in stored runs nine targets missed their first two stages and met a later one (two gateway
/// replicas on b2b-saas met 60-120 req/s after missing 10 and 30).
struct LadderEnd {
    slo_s: f64,
    met_once: std::cell::Cell<bool>,
    misses_in_a_row: std::cell::Cell<u32>,
}

impl LadderEnd {
    fn new(slo_s: f64) -> Self {
        LadderEnd {
            slo_s,
            met_once: std::cell::Cell::new(false),
            misses_in_a_row: std::cell::Cell::new(0),
        }
    }

    fn after(&self, s: &Summary) -> bool {
        if meets_slo(s, self.slo_s) {
            self.met_once.set(true);
            self.misses_in_a_row.set(0);
        } else if self.met_once.get() {
            self.misses_in_a_row.set(self.misses_in_a_row.get() + 1);
        }
        self.misses_in_a_row.get() >= 2 || far_past(s, self.slo_s)
    }
}

/// Writes `value` as OUT_DIR/records/WORKLOAD/TARGET{suffix}.
fn write_record_file(
    out: &Path,
    workload: &str,
    target: &str,
    suffix: &str,
    value: &impl serde::Serialize,
) -> anyhow::Result<()> {
    let dir = out.join("records").join(workload);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}{suffix}", target.replace(' ', "_")));
    std::fs::write(&path, serde_json::to_vec(value)?)?;
    Ok(())
}

/// The learned rates polled during a target's ladder: TARGET.rates.json.
fn write_rate_trace(
    out: &Path,
    workload: &str,
    target: &str,
    trace: &[Poll],
) -> anyhow::Result<()> {
    write_record_file(out, workload, target, ".rates.json", &trace)
}

/// Every request's record, one array per stage: TARGET.json.
fn write_records(out: &Path, workload: &str, target: &str, stages: &[Stage]) -> anyhow::Result<()> {
    let v: Vec<serde_json::Value> = stages
        .iter()
        .map(|s| json!({"rate": s.rate, "records": s.records}))
        .collect();
    write_record_file(out, workload, target, ".json", &v)
}

async fn run_one(
    kind: WorkloadKind,
    p: &Profile,
    target: &str,
    seed: u64,
    gateways: usize,
    trace_dir: Option<&Path>,
) -> anyhow::Result<Vec<Stage>> {
    let fleet = Fleet::start_on_free_ports(fleet_config(kind, p))?;
    let eps = fleet.endpoints();
    let mut gws = Vec::new();
    let n = gateways.max(1);
    // With peers, each gateway's listener port is known before any starts.
    let ports = match (p.peers_interval_ms, n > 1) {
        (Some(_), true) => wasm_tests::ports::free_ports(n)?,
        _ => Vec::new(),
    };
    for i in 0..n {
        let (eps, p, t) = (eps.clone(), p.clone(), target.to_string());
        let mesh = PeerMesh::of(&ports, i);
        gws.push(
            tokio::task::spawn_blocking(move || start_target(&t, &eps, &p, mesh.as_ref()))
                .await??,
        );
    }
    let targets: Vec<Target> = gws
        .iter()
        .map(|gw| Target {
            url: gw.url(),
            model: MODEL.into(),
            prefix_group_header: target == "envoy-ring-hash",
            timeout: Duration::from_secs_f64((8.0 * p.slo_s + 120.0) * p.time_factor + 10.0),
        })
        .collect();
    let client = loadgen::client()?;
    let w = Workload::new(kind, p.scale, seed).with_groups(p.groups);
    let end = LadderEnd::new(p.slo_s);
    let label = format!("{}/{target} x{}", kind.name(), targets.len());
    let watch = gws
        .first()
        .and_then(|gw| watch_rates(gw, p, eps.len(), target));
    let stages = wasm_tests::replicas::ladder(
        &client,
        &targets,
        &w,
        &p.rates,
        p.stage_duration,
        20_000,
        p.time_factor,
        &label,
        p.deal,
        |s| end.after(s),
    )
    .await;
    if let Some(w) = watch {
        let seen = w.finish();
        report_watched(&seen.reached, target);
        // The ladder's results stand without the trace.
        if let Some(Err(e)) =
            trace_dir.map(|d| write_rate_trace(d, kind.name(), target, &seen.trace))
        {
            eprintln!("bench: {target}: the rate trace was not written: {e:#}");
        }
    }
    for gw in &gws {
        report_learned(gw, p, eps.len(), target);
        report_decisions(gw, target);
    }
    drop(gws);
    drop(fleet);
    let _ = eps;
    Ok(stages)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.plot_only {
        let results = if a.results.is_empty() {
            vec![a.out_dir.join("results.json")]
        } else {
            a.results.clone()
        };
        return write_plots(&a, &results);
    }
    let kinds: Vec<WorkloadKind> = if a.workload.is_empty() {
        if a.quick {
            vec![WorkloadKind::B2bSaas]
        } else {
            WorkloadKind::ALL.to_vec()
        }
    } else {
        a.workload
            .iter()
            .map(|w| WorkloadKind::parse(w).with_context(|| format!("unknown workload {w:?}")))
            .collect::<anyhow::Result<_>>()?
    };
    let targets: Vec<String> = if a.targets.is_empty() {
        TARGETS.iter().map(|s| s.to_string()).collect()
    } else {
        for t in &a.targets {
            anyhow::ensure!(
                TARGETS.contains(&t.as_str()) || LEARNING_TARGETS.contains(&t.as_str()),
                "unknown target {t:?} ({TARGETS:?}, {LEARNING_TARGETS:?})"
            );
        }
        a.targets.clone()
    };
    std::fs::create_dir_all(&a.out_dir)?;
    let started = Instant::now();
    let mut runs: Vec<RunRow> = Vec::new();
    let mut caps: Vec<CapacityRow> = Vec::new();
    let mut profiles = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut report = String::new();
    for kind in kinds {
        let mut p = profile(kind, a.quick);
        if !a.rates.is_empty() {
            p.rates = a.rates.clone();
        }
        if let Some(d) = a.stage_duration {
            p.stage_duration = d;
        }
        if let Some(s) = a.scale {
            p.scale = s;
        }
        if let Some(f) = a.time_factor {
            p.time_factor = f;
        }
        p.slow_endpoints = a.slow_endpoints;
        p.kv_report_factor = a.kv_report_factor;
        p.deal = a.deal;
        p.peers_interval_ms = a.peers.then_some(a.peers_interval_ms);
        p.peers_one_cluster = a.peers_one_cluster;
        if let Some(g) = a.groups {
            anyhow::ensure!(g > 0, "--groups: at least one group");
            p.groups = g;
        }
        if let Some(extra) = &a.plugin_extra {
            p.plugin_extra = serde_json::from_str(extra).context("--plugin-extra: not JSON")?;
            anyhow::ensure!(
                p.plugin_extra.is_object(),
                "--plugin-extra: not a JSON object"
            );
        }
        eprintln!(
            "== {}: ladder {:?} req/s × {} s, scale {}, time factor {}, TTFT p90 SLO {:.2} s",
            kind, p.rates, p.stage_duration, p.scale, p.time_factor, p.slo_s
        );
        let mut table: Vec<TargetResult> = Vec::new();
        let trace_dir = a.records.then_some(a.out_dir.as_path());
        let jobs: Vec<(String, usize)> = targets
            .iter()
            .flat_map(|t| a.gateways.iter().map(move |&g| (t.clone(), g)))
            .collect();
        for (name, gateways) in &jobs {
            let target = &if *gateways > 1 {
                format!("{name} x{gateways}")
            } else {
                name.clone()
            };
            let t0 = Instant::now();
            let stages = match run_one(kind, &p, name, a.seed, *gateways, trace_dir).await {
                Ok(s) => s,
                Err(e) => {
                    let msg = format!("{kind}/{target}: skipped: {e:#}");
                    eprintln!("bench: {msg}");
                    skipped.push(msg);
                    continue;
                }
            };
            if a.records {
                write_records(&a.out_dir, kind.name(), target, &stages)?;
            }
            let rows: Vec<(f64, Summary)> =
                stages.iter().map(|s| (s.rate, s.summary.clone())).collect();
            let cap = capacity(&rows, p.slo_s);
            eprintln!(
                "   {target}: capacity {cap} req/s ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
            for (rate, s) in &rows {
                runs.push(RunRow {
                    target: target.clone(),
                    workload: kind.name().into(),
                    rate: *rate,
                    completed: s.completed,
                    errors: s.errors,
                    error_kinds: s.error_kinds.clone(),
                    ttft_p50_s: s.ttft_p50_s,
                    ttft_p90_s: s.ttft_p90_s,
                    hit_rate: s.hit_rate,
                    input_tok_s: s.input_tok_s,
                    output_tok_s: s.output_tok_s,
                    e2e_p50_s: s.e2e_p50_s,
                    per_endpoint: s.per_endpoint.values().copied().collect(),
                });
            }
            caps.push(CapacityRow {
                target: target.clone(),
                workload: kind.name().into(),
                capacity_rps: cap,
            });
            table.push((target.clone(), cap, rows));
        }
        let section = render_table(kind, &p, &table);
        println!("{section}");
        report.push_str(&section);
        profiles.push(p);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let results = json!({
        "runs": runs,
        "capacity": caps,
        "profiles": profiles,
        "skipped": skipped,
        "seed": a.seed,
        "quick": a.quick,
        "elapsed_s": elapsed,
    });
    let rpath = a.out_dir.join("results.json");
    std::fs::write(&rpath, serde_json::to_string_pretty(&results)?)?;
    if !skipped.is_empty() {
        report.push_str("\nSkipped:\n");
        for s in &skipped {
            report.push_str(&format!("- {s}\n"));
        }
    }
    report.push_str(&format!("\nWall time: {elapsed:.0} s\n"));
    let mpath = a.out_dir.join("report.md");
    std::fs::write(&mpath, &report)?;
    eprintln!(
        "wrote {} and {} ({elapsed:.0} s)",
        rpath.display(),
        mpath.display()
    );
    write_plots(&a, &[rpath])
}

/// A markdown section: per target and rate, then capacity and ratios to round robin.
fn render_table(kind: WorkloadKind, p: &Profile, table: &[TargetResult]) -> String {
    let mut out = format!(
        "\n### {kind}\n\nscale {}, time factor {}, ladder {:?} req/s × {} s (model time), \
         TTFT p90 SLO {:.2} s\n\n\
         | target | rate | done | err | TTFT p50 s | TTFT p90 s | hit | in tok/s | out tok/s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        p.scale, p.time_factor, p.rates, p.stage_duration, p.slo_s
    );
    for (t, _, rows) in table {
        for (rate, s) in rows {
            out.push_str(&format!(
                "| {t} | {rate} | {} | {} | {:.3} | {:.3} | {:.1} % | {:.0} | {:.0} |\n",
                s.completed,
                s.errors,
                s.ttft_p50_s,
                s.ttft_p90_s,
                s.hit_rate * 100.0,
                s.input_tok_s,
                s.output_tok_s
            ));
        }
    }
    out.push_str(&error_lines(table));
    let rr = table
        .iter()
        .find(|(t, _, _)| t == "envoy-round-robin")
        .map(|(_, c, _)| *c);
    out.push_str("\n| target | capacity at SLO (req/s) | × round robin |\n|---|---:|---:|\n");
    for (t, cap, _) in table {
        let ratio = match rr {
            Some(r) if r > 0.0 => format!("{:.2}", cap / r),
            _ => "–".into(),
        };
        out.push_str(&format!("| {t} | {cap} | {ratio} |\n"));
    }
    out
}

/// One line per stage with errors, naming their kinds, so a report tells a client-side
/// timeout from an answer the gateway gave.
fn error_lines(table: &[TargetResult]) -> String {
    let mut out = String::new();
    for (t, _, rows) in table {
        for (rate, s) in rows.iter().filter(|(_, s)| s.errors > 0) {
            out.push_str(&format!(
                "\n{t} at {rate} req/s: {} errors ({})",
                s.errors,
                s.error_kinds.join(", ")
            ));
        }
    }
    if !out.is_empty() {
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(requests: usize, completed: usize, p90: f64) -> Summary {
        Summary {
            requests,
            completed,
            errors: requests - completed,
            ttft_p90_s: p90,
            ..Default::default()
        }
    }

    #[test]
    fn the_report_names_each_stages_error_kinds() {
        let mut bad = s(10, 8, 1.0);
        bad.error_kinds = vec!["timeout".into(), "status 503".into()];
        let table = vec![("t".to_string(), 1.0, vec![(1.0, s(5, 5, 1.0)), (2.0, bad)])];
        assert_eq!(
            error_lines(&table),
            "\nt at 2 req/s: 2 errors (timeout, status 503)\n"
        );
        let clean = vec![("t".to_string(), 1.0, vec![(1.0, s(5, 5, 1.0))])];
        assert_eq!(error_lines(&clean), "");
    }

    #[test]
    fn capacity_is_the_highest_rate_meeting_the_slo() {
        let stages = vec![
            (5.0, s(100, 100, 0.5)),
            (10.0, s(200, 199, 0.9)),
            (20.0, s(400, 380, 0.5)), // 95 % success
            (30.0, s(600, 600, 2.0)), // over the SLO
        ];
        assert_eq!(capacity(&stages, 1.0), 10.0);
        assert_eq!(capacity(&stages[2..], 1.0), 0.0);
        assert!(far_past(&s(100, 80, 0.1), 1.0));
        assert!(far_past(&s(100, 100, 4.5), 1.0));
        assert!(!far_past(&s(100, 100, 3.0), 1.0));
    }

    #[test]
    fn a_ladder_ends_far_past_the_slo_or_after_two_misses_in_a_row() {
        let end = LadderEnd::new(1.0);
        assert!(!end.after(&s(100, 100, 0.5)));
        assert!(!end.after(&s(100, 100, 1.5))); // one miss
        assert!(!end.after(&s(100, 100, 0.9))); // met again: the count restarts
        assert!(!end.after(&s(100, 100, 2.0)));
        assert!(end.after(&s(100, 100, 1.2))); // the second miss in a row
        assert!(LadderEnd::new(1.0).after(&s(100, 100, 4.5)));
        assert!(LadderEnd::new(1.0).after(&s(100, 70, 0.5)));
        // Cold first stages: misses before the SLO was ever met do not count.
        let cold = LadderEnd::new(1.0);
        assert!(!cold.after(&s(100, 100, 1.1)));
        assert!(!cold.after(&s(100, 100, 1.2)));
        assert!(!cold.after(&s(100, 100, 3.0)));
        assert!(!cold.after(&s(100, 100, 0.4)));
        assert!(!cold.after(&s(100, 100, 1.3)));
        assert!(cold.after(&s(100, 100, 1.4)));
    }

    #[test]
    fn profiles_scale_the_fleet_with_the_workload() {
        for k in WorkloadKind::ALL {
            for quick in [false, true] {
                let p = profile(k, quick);
                let f = fleet_config(k, &p);
                // Prefill of a scaled prompt takes the unscaled model time.
                let model = k.mean_prompt_tokens() / R_PEAK;
                let scaled = f
                    .timing
                    .prefill((k.mean_prompt_tokens() * p.scale) as usize);
                let want = model * p.time_factor;
                assert!(
                    (scaled.as_secs_f64() - want).abs() < 0.01 * want + 1e-3,
                    "{k}"
                );
                assert!(p.rates.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }
}

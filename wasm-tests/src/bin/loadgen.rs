//! `loadgen`: seeded streaming chat/completions load against one URL.
//!
//! ```sh
//! # open loop, Poisson at 5 req/s for 60 model seconds
//! cargo run -p wasm-tests --release --bin loadgen -- --url http://127.0.0.1:10000 \
//!     --workload b2b-saas --scale 0.1 --mode poisson --rate 5 --duration 60 --out /tmp/r.json
//! # closed loop, 8 clients, 200 requests
//! cargo run -p wasm-tests --release --bin loadgen -- --url http://127.0.0.1:10000 \
//!     --workload reasoning --mode closed --concurrency 8 --requests 200
//! # rate ladder, 30 model seconds per stage
//! cargo run -p wasm-tests --release --bin loadgen -- --url http://127.0.0.1:10000 \
//!     --workload seed-sim --mode ladder --rates 3,5,10,20 --stage-duration 30
//! # calibrate R_peak and τ (llm-d's recipe: 5 + 20 cold 8,192-token prefills, one at a time)
//! cargo run -p wasm-tests --release --bin loadgen -- calibrate --url http://127.0.0.1:8000 --chunk 8192
//! ```
//!
//! With `--time-factor F` (the fleet's), rates and durations are in model time: requests go
//! out at rate / F per wall second and measured times are divided by F. Token figures are in
//! model tokens (served tokens / `--scale`). The same `--seed` gives the same arrivals and
//! requests against every URL.

use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use serde_json::json;
use wasm_tests::loadgen::{self, calibrate, Pace, Target, Workload, WorkloadKind};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    Poisson,
    Closed,
    Ladder,
}

#[derive(Debug, Parser)]
#[command(
    name = "loadgen",
    version,
    about = "Seeded streaming OpenAI load (open loop, closed loop, rate ladder); `calibrate` measures R_peak",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Base URL (http://127.0.0.1:PORT) or the full chat/completions URL (required).
    #[arg(long)]
    url: Option<String>,
    /// seed-sim, code-generation, reasoning, b2b-saas or mixed.
    #[arg(long, default_value = "b2b-saas")]
    workload: String,
    /// Multiplier on every token count (prompt parts and outputs).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Model-to-wall time factor (the fleet's --time-factor).
    #[arg(long, default_value_t = 1.0)]
    time_factor: f64,
    #[arg(long, value_enum, default_value_t = Mode::Poisson)]
    mode: Mode,
    /// Poisson rate, req/s (model time).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Poisson window, model seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Closed loop: clients.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Closed loop: requests in all.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Ladder rates, req/s (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1.0, 2.0, 4.0])]
    rates: Vec<f64>,
    /// Ladder stage length, model seconds.
    #[arg(long, default_value_t = 30.0)]
    stage_duration: f64,
    /// Upper bound on requests per run / stage.
    #[arg(long, default_value_t = 20_000)]
    max_requests: usize,
    /// Send x-prefix-group (the request's group) for a header-hash balancer.
    #[arg(long)]
    prefix_group_header: bool,
    /// Per-request timeout, wall seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Write the JSON results here (default: stdout only).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Include every request's record in the JSON.
    #[arg(long)]
    records: bool,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure the server's peak prefill throughput (R_peak = chunk / median TTFT of cold,
    /// one-token requests of exactly `chunk` random token ids, sent one at a time) and print
    /// τ and the plugin configuration.
    Calibrate(CalibrateArgs),
}

#[derive(Debug, clap::Args)]
struct CalibrateArgs {
    /// Base URL (http://HOST:PORT; /v1/completions is added) or the full completions URL. The
    /// gateway's URL measures what the filter sees; a model server's measures it alone.
    #[arg(long)]
    url: String,
    /// Prompt tokens per request: the server's --max-num-batched-tokens.
    #[arg(long, default_value_t = 8192)]
    chunk: usize,
    /// Requests sent first and not measured.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Measured requests.
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Acceptable TTFT degradation T_max, ms (the plugin's maxTTFTPenaltyMs): τ = R_peak × T_max.
    #[arg(long, default_value_t = 18_000.0)]
    ttft_tolerance_ms: f64,
    /// Model name (default: the first one GET /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Wall seconds per model second (the simulated fleet's --time-factor; 1 for a real server).
    #[arg(long, default_value_t = 1.0)]
    time_factor: f64,
    /// Per-request timeout, wall seconds.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Seed of the random token ids (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Print the result as JSON instead.
    #[arg(long)]
    json: bool,
}

async fn calibrate(a: CalibrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.time_factor > 0.0, "--time-factor must be > 0");
    anyhow::ensure!(a.timeout > 0.0, "--timeout must be > 0");
    let trimmed = a.url.trim_end_matches('/');
    let (base, url) = if trimmed.matches('/').count() <= 2 {
        (trimmed.to_string(), format!("{trimmed}/v1/completions"))
    } else {
        let base = trimmed.split("/v1/").next().unwrap_or(trimmed).to_string();
        (base, a.url.clone())
    };
    let client = loadgen::client()?;
    let model = match a.model {
        Some(m) => m,
        None => calibrate::first_model(&client, &base).await?,
    };
    let mut s = calibrate::Settings::new(url, model);
    s.chunk = a.chunk;
    s.warmup = a.warmup;
    s.requests = a.requests;
    s.ttft_tolerance_ms = a.ttft_tolerance_ms;
    s.time_factor = a.time_factor;
    s.timeout = Duration::from_secs_f64(a.timeout);
    s.seed = a.seed;
    eprintln!(
        "calibrate: {} warm-up + {} measured requests of {} random token ids (max_tokens 1, \
         streaming, one at a time) to {} (model {})",
        s.warmup, s.requests, s.chunk, s.url, s.model
    );
    let warmup = s.warmup;
    let c = calibrate::run(&client, &s, |i, n, t| {
        let what = if i <= warmup { "warm-up" } else { "measured" };
        eprintln!("  {i:>3}/{n} {what:<8} TTFT {t:.4} s");
    })
    .await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        print!("{}", c.report());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if let Some(Cmd::Calibrate(c)) = a.command {
        return calibrate(c).await;
    }
    let Some(url_arg) = a.url.clone() else {
        Args::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "--url is required (or the `calibrate` subcommand)",
            )
            .exit()
    };
    let kind = WorkloadKind::parse(&a.workload)
        .with_context(|| format!("unknown workload {:?}", a.workload))?;
    anyhow::ensure!(a.scale > 0.0 && a.scale <= 1.0, "--scale must be in (0, 1]");
    anyhow::ensure!(a.time_factor > 0.0, "--time-factor must be > 0");
    let url = if url_arg.trim_end_matches('/').matches('/').count() <= 2 {
        format!("{}/v1/chat/completions", url_arg.trim_end_matches('/'))
    } else {
        url_arg
    };
    let target = Target {
        url,
        model: a.model.clone(),
        prefix_group_header: a.prefix_group_header,
        timeout: Duration::from_secs_f64(a.timeout),
    };
    let w = Workload::new(kind, a.scale, a.seed);
    let client = loadgen::client()?;
    let stages: Vec<(f64, Vec<loadgen::Record>)> = match a.mode {
        Mode::Poisson | Mode::Closed => {
            let pace = match a.mode {
                Mode::Poisson => Pace::Open(loadgen::poisson_arrivals(
                    a.seed,
                    a.rate,
                    a.duration,
                    a.max_requests,
                )),
                _ => Pace::Closed {
                    concurrency: a.concurrency,
                    requests: a.requests.min(a.max_requests),
                },
            };
            let n = match &pace {
                Pace::Open(v) => v.len(),
                Pace::Closed { requests, .. } => *requests,
            };
            let items = w.plan(n);
            let pb = loadgen::progress_bar(n, kind.name());
            let recs =
                loadgen::run(&client, &target, &items, &pace, a.time_factor, Some(&pb)).await;
            pb.finish_and_clear();
            vec![(a.rate, recs)]
        }
        Mode::Ladder => loadgen::ladder(
            &client,
            &target,
            &w,
            &a.rates,
            a.stage_duration,
            a.max_requests,
            a.time_factor,
            kind.name(),
            |_| false,
        )
        .await
        .into_iter()
        .map(|s| (s.rate, s.records))
        .collect(),
    };
    let mut runs = Vec::new();
    println!(
        "{:>8} {:>6} {:>6} {:>9} {:>9} {:>9} {:>6} {:>12} {:>12}",
        "rate", "done", "errors", "ttft_p50", "ttft_p90", "e2e_p50", "hit", "in_tok/s", "out_tok/s"
    );
    for (rate, recs) in &stages {
        let s = loadgen::summarize(recs, a.scale);
        println!(
            "{:>8} {:>6} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>5.1}% {:>12.0} {:>12.0}",
            if matches!(a.mode, Mode::Closed) {
                "closed".to_string()
            } else {
                format!("{rate}")
            },
            s.completed,
            s.errors,
            s.ttft_p50_s,
            s.ttft_p90_s,
            s.e2e_p50_s,
            s.hit_rate * 100.0,
            s.input_tok_s,
            s.output_tok_s
        );
        let mut v = json!({"rate": rate, "summary": s});
        if a.records {
            v["records"] = serde_json::to_value(recs)?;
        }
        runs.push(v);
    }
    let out = json!({
        "workload": kind.name(),
        "scale": a.scale,
        "seed": a.seed,
        "time_factor": a.time_factor,
        "url": target.url,
        "mode": format!("{:?}", a.mode).to_lowercase(),
        "concurrency": matches!(a.mode, Mode::Closed).then_some(a.concurrency),
        "runs": runs,
    });
    if let Some(p) = &a.out {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("write {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

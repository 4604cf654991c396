//! `fleet`: N simulated vLLM endpoints on consecutive loopback ports.
//!
//! cargo run -p wasm-tests --release --bin fleet -- --endpoints 4 --base-port 8000 --time-factor 0.1

use std::time::Duration;

use clap::{Parser, ValueEnum};
use wasm_tests::fleet::{self, FleetConfig, MetricsNames, Timing};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Names {
    Vllm,
    Sglang,
}

/// Simulated vLLM fleet: OpenAI endpoints with prefix caching and a vLLM-like step scheduler.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Number of endpoints.
    #[arg(long, default_value_t = 4)]
    endpoints: usize,
    /// First port; endpoint i listens on 127.0.0.1:(base_port + i).
    #[arg(long, default_value_t = 8000)]
    base_port: u16,
    /// Prefill throughput per endpoint, tokens/s.
    #[arg(long, default_value_t = 20480.0)]
    prefill_rate: f64,
    /// Decode time per output token, ms.
    #[arg(long, default_value_t = 5.0)]
    decode_ms_per_token: f64,
    /// Multiplies every simulated duration (0.01 = 100x faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_factor: f64,
    /// Scheduler token budget per step (vLLM max-num-batched-tokens).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Requests running at once (vLLM max-num-seqs); more wait in a queue.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Decode step time growth per extra decoding request.
    #[arg(long, default_value_t = 0.005)]
    decode_batch_slope: f64,
    /// Model tokens per simulated token (a scaled run's token scale; see `Timing`).
    #[arg(long, default_value_t = 1.0)]
    token_scale: f64,
    /// KV cache capacity per endpoint, in 16-token blocks.
    #[arg(long, default_value_t = 32768)]
    kv_blocks: usize,
    /// Metric names on /metrics.
    #[arg(long, value_enum, default_value_t = Names::Vllm)]
    metrics_names: Names,
    /// A port in the range that does not listen (repeatable).
    #[arg(long = "dead")]
    dead: Vec<u16>,
    /// The first N endpoints prefill at half `--prefill-rate` (a heterogeneous fleet).
    #[arg(long, default_value_t = 0)]
    slow_endpoints: usize,
    /// `vllm:cache_config_info` reports this multiple of the real KV capacity.
    #[arg(long, default_value_t = 1.0)]
    kv_report_factor: f64,
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("fleet: shutting down");
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(a.time_factor >= 0.0, "--time-factor must be >= 0");
    anyhow::ensure!(a.prefill_rate > 0.0, "--prefill-rate must be > 0");
    anyhow::ensure!(
        a.token_scale > 0.0 && a.token_scale <= 1.0,
        "--token-scale must be in (0, 1]"
    );
    let cfg = FleetConfig {
        endpoints: a.endpoints,
        base_port: a.base_port,
        timing: Timing {
            prefill_rate: a.prefill_rate,
            decode_ms_per_token: a.decode_ms_per_token,
            time_factor: a.time_factor,
            max_num_batched_tokens: a.max_num_batched_tokens,
            max_num_seqs: a.max_num_seqs,
            decode_batch_slope: a.decode_batch_slope,
            token_scale: a.token_scale,
        },
        kv_blocks: a.kv_blocks,
        metrics_names: match a.metrics_names {
            Names::Vllm => MetricsNames::Vllm,
            Names::Sglang => MetricsNames::Sglang,
        },
        dead: a.dead,
        slow_endpoints: a.slow_endpoints,
        kv_report_factor: a.kv_report_factor,
    };
    let listeners = fleet::bind(&cfg)?;
    let last = usize::from(cfg.base_port) + cfg.endpoints - 1;
    println!("fleet ready: 127.0.0.1:{}..{last}", cfg.base_port);
    if !cfg.dead.is_empty() {
        println!("fleet dead ports: {:?}", cfg.dead);
    }
    fleet::serve(cfg, listeners, shutdown_signal(), Duration::from_secs(5)).await
}

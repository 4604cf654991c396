//! Discrete-event simulation of the seeds' workload, routed by the real core.
//!
//! Each endpoint is a FIFO prefill server at R_peak with an LRU KV cache of whole prefixes
//! (the truth). The router sees only what the filter would: its own approximate affinity
//! index and load ledger, updated at dispatch and at the first byte (here: end of prefill).
//! A request costs its question tokens when its prefix is cached at the moment its prefill
//! starts, else prefix + question; its TTFT is queueing plus its own prefill.
//!
//!     cargo run --release --example simulate -- --policy tokenaware --rate 60
//!     cargo run --release --example simulate -- --tau-sweep 25000:1000000:25000 --rate 60
//!     cargo run --release --example simulate -- --policy tokenaware --router-prefill-rate 81920 --learn on
//!
//! `--mixed` adds decode and a KV pool the running requests hold: prefix-group requests and
//! reasoning requests (short prompt, long output) alternate in phases, a request waits for
//! room in the pool, and the prefix cache keeps what the running requests leave.
//!
//!     cargo run --release --example simulate -- --policy tokenaware --rate 4,5,6,7,8 --mixed --seeds 3
//!
//! With `--router-prefill-rate`, `--learn on` or `--ttft-source latency` the router is
//! configured as an operator would: R_peak (what it is told, or `"auto"` starting there) and
//! T_max = τ / the fleet's R_peak (14 s by default), instead of τ directly.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Mutex;

use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use tokenaware::config::{
    Config, EndpointConfig, GateForm, PeakPrefill, Picker, PolicyName, Scorer, TtftSource,
};
use tokenaware::endpoints::EndpointTable;
use tokenaware::policy::Reason;
use tokenaware::prefix::{chain_seed, BlockHasher};
use tokenaware::router::{Outcome, Routed, Router};
use tokenaware::store::MemStore;

#[derive(Parser, Debug, Clone)]
#[command(about = "Seed-sim workload through the tokenaware core")]
struct Args {
    /// Policies, comma separated: round-robin, least-load, always-sticky,
    /// sticky-until-saturated, tokenaware; or "all".
    #[arg(long, default_value = "all")]
    policy: String,
    /// Saturation gate of sticky-until-saturated and tokenaware.
    #[arg(long, default_value = "absolute")]
    gate: String,
    /// Arrival rates, req/s (repeat the flag or separate with commas).
    #[arg(long, value_delimiter = ',', default_values_t = vec![3.0, 5.0, 6.0, 10.0, 20.0, 40.0, 60.0, 80.0])]
    rate: Vec<f64>,
    /// τ in tokens.
    #[arg(long, default_value_t = 286_720)]
    tau: u64,
    /// τ sweep A:B:STEP (tokens); replaces --tau.
    #[arg(long)]
    tau_sweep: Option<String>,
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    #[arg(long, default_value_t = 40)]
    groups: usize,
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    #[arg(long, default_value_t = 55_000)]
    prefix_tokens: u64,
    #[arg(long, default_value_t = 1_500)]
    question_tokens: u64,
    /// KV capacity per endpoint as the seed sizes it: K × 16 GiB at 256 KiB per token
    /// (K × 65,536 tokens; 4 ⇒ 64 GiB ⇒ four whole 55k-token prefixes).
    #[arg(long, default_value_t = 4)]
    kv_prefixes: u64,
    /// KV capacity per endpoint in tokens (overrides --kv-prefixes). An endpoint holds
    /// ⌊kv / prefix⌋ whole prefixes.
    #[arg(long)]
    kv_tokens: Option<u64>,
    /// KV capacity per endpoint the router is told, tokens (default: the fleet's).
    #[arg(long)]
    index_kv_tokens: Option<u64>,
    /// R_peak per endpoint, tokens/s.
    #[arg(long, default_value_t = 20_480.0)]
    prefill_rate: f64,
    /// Arrival window, seconds; the simulation then drains the queues.
    #[arg(long, default_value_t = 600.0)]
    duration: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runs seeds seed..seed+N and reports the mean of each figure (less noise at the knees).
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// R_peak the router is told, tokens/s (default: the fleet's --prefill-rate).
    #[arg(long)]
    router_prefill_rate: Option<f64>,
    /// Learn R_peak per endpoint from observed TTFTs (`peakPrefillThroughput: "auto"`,
    /// starting from --router-prefill-rate), and correct the index from cached tokens.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    learn: String,
    /// Source of the gate's TTFT: prefill (queued tokens / R_peak) or latency (the learned
    /// predictor, with the latency scorer and the weighted-random picker).
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "latency"])]
    ttft_source: String,
    /// Half the fleet (the first half) prefills at half --prefill-rate.
    #[arg(long)]
    slow_half: bool,
    /// Mixed workload: requests alternate in phases of `--mix-phase` between 80 % the prefix
    /// groups and 80 % reasoning requests (a short prompt whose first 250 tokens they all
    /// share, and a long output), and every request holds KV from the start of its prefill to the end of
    /// its decode: a request waits in the queue until the endpoint's pool has room for it,
    /// and the prefix cache keeps only what the running requests leave (as in vLLM).
    #[arg(long)]
    mixed: bool,
    /// The KV pool of `--mixed` for the prefix groups alone, with the benchmark fleet's
    /// admission (vLLM's): waiting requests are admitted while their blocks fit, each looks up
    /// the cache when admitted, and a prefix it must prefill is held beside the cache until
    /// its prefill ends (prefills then run oldest first). Requests admitted while their prefix
    /// is being refilled miss it too. With `--output-tokens 16` it is the benchmark's seed-sim.
    #[arg(long)]
    pool: bool,
    /// With `--pool`: a prefill's blocks join the cache as they are scheduled, as vLLM v1
    /// caches them (`allocate_slots`) and the benchmark's fleet does since 496a5f6, rather
    /// than when it ends; a request admitted during its prefix's cold fill finds what was
    /// computed so far.
    #[arg(long)]
    cache_scheduled: bool,
    /// Seconds of arrivals at `--warmup-rate` before the run's rate (the benchmark's ladder
    /// warms the caches at 2 req/s first); the figures count every request.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    #[arg(long, default_value_t = 2.0)]
    warmup_rate: f64,
    /// Requests per phase of `--mixed`.
    #[arg(long, default_value_t = 32)]
    mix_phase: usize,
    /// Output tokens of a prefix-group request (decoded only with `--mixed`).
    #[arg(long, default_value_t = 200)]
    output_tokens: u64,
    #[arg(long, default_value_t = 1_000)]
    reasoning_prompt_tokens: u64,
    #[arg(long, default_value_t = 8_000)]
    reasoning_output_tokens: u64,
    /// Spread of reasoning outputs: each request's output is drawn from a lognormal with
    /// mean `--reasoning-output-tokens` and this sigma (0: every output that long), cut at
    /// four times the mean as a `max_tokens` would cut it (the cut lowers the mean: about
    /// 0.93 of it at sigma 1, 0.76 at 1.5).
    #[arg(long, default_value_t = 0.0)]
    reasoning_output_sigma: f64,
    /// With `--mixed`: a prefill runs slower in proportion to the KV the running requests
    /// hold (each chunked-prefill step also reads every decoding request's context): at a
    /// full pool it takes `1 + this` times as long (0: decode never slows a prefill).
    #[arg(long, default_value_t = 0.0)]
    decode_drag: f64,
    /// Time per output token of a decoding request, ms.
    #[arg(long, default_value_t = 5.0)]
    tpot_ms: f64,
    /// Scorer (token-load, active-request, latency); default: latency with
    /// `--ttft-source latency`, else token-load.
    #[arg(long, value_parser = ["token-load", "active-request", "latency"])]
    scorer: Option<String>,
    /// Picker (max-score, weighted-random); default: weighted-random with
    /// `--ttft-source latency`, else max-score.
    #[arg(long, value_parser = ["max-score", "weighted-random"])]
    picker: Option<String>,
    /// After each run, one line per endpoint on stderr: its speed, requests, TTFT median
    /// and p90, prefix-group requests that missed their prefix (with `--pool`: did not find
    /// it whole), and its busiest prefix groups.
    #[arg(long)]
    per_endpoint: bool,
    /// TTFT p90 SLO, seconds: after the table, each policy's capacity at SLO per seed (the
    /// highest rate whose p90 and every lower rate's p90 are within it), for fine ladders
    /// that resolve a few percent (the seed-sim SLO is 5.52 s: twice a cold 56.5k-token fill).
    #[arg(long)]
    slo: Option<f64>,
}

impl Args {
    /// The router is configured by R_peak and T_max rather than by τ.
    fn operator_config(&self) -> bool {
        self.router_prefill_rate.is_some() || self.learn == "on" || self.ttft_source == "latency"
    }

    /// Running requests hold KV in a pool they share with the prefix cache.
    fn pooled(&self) -> bool {
        self.mixed || self.pool
    }

    fn endpoint_rate(&self, e: usize) -> f64 {
        if self.slow_half && e < self.endpoints / 2 {
            self.prefill_rate / 2.0
        } else {
            self.prefill_rate
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Run {
    policy: PolicyName,
    rate: f64,
    tau: u64,
    seed: u64,
}

#[derive(Debug, Clone, Default)]
struct Outcomes {
    ttft: Vec<f64>,
    /// TTFTs of the reasoning requests alone (`--mixed`).
    reasoning_ttft: Vec<f64>,
    hits: u64,
    last_done: f64,
    reasons: [u64; Reason::ALL.len()],
    /// Per endpoint: |R̂ − R| / R after its 200th TTFT sample, and at the end.
    rate_err_at_200: Vec<f64>,
    rate_err_end: Vec<f64>,
}

/// One endpoint's truth: a FIFO of waiting requests and an LRU of whole prefixes; with
/// `--mixed` also the KV its running requests hold.
#[derive(Default)]
struct Server {
    queue: VecDeque<usize>,
    /// With `--pool`: admitted requests waiting for their prefill, oldest first, and the
    /// cache in tokens per prefix, most recent first (a prefix loses its tail first, as
    /// vLLM's blocks do).
    admitted: VecDeque<usize>,
    held_prefixes: VecDeque<(usize, u64)>,
    /// With `--pool`: the prefill running and the time it started.
    prefilling: Option<(usize, f64)>,
    busy: bool,
    cache: VecDeque<usize>,
    /// KV tokens held by running requests (their own tokens and outputs), and how many run.
    held: u64,
    running: usize,
    /// It has served a reasoning request: their shared system prompt is cached there (it is
    /// small and hot, so it is never the LRU victim).
    reasoning_warm: bool,
}

/// The system prompt every reasoning request starts with, tokens (the seeds' reasoning
/// workload). The simulator's config keeps the default block size, so the cache holds its
/// full blocks.
const REASONING_SHARED_TOKENS: u64 = 250;

/// What a request asks for: a prompt on one of the shared prefixes, or a reasoning prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Group(usize),
    Reasoning,
}

struct Request {
    arrival: f64,
    kind: Kind,
    routed: Option<Routed>,
    endpoint: usize,
    /// Its prefix was in the endpoint's cache when its prefill started (with `--pool`: when
    /// it was admitted).
    hit: bool,
    /// Tokens of its shared prefix found cached: a reasoning request's system prompt, or
    /// with `--pool` a group's prefix (whole or in part).
    shared_cached: u64,
    /// Arrival to first token, once prefilled.
    ttft: Option<f64>,
    /// Output tokens (decoded only with `--mixed`; a reasoning request's are drawn with
    /// `--reasoning-output-sigma`).
    output: u64,
}

/// Events ordered by time (then sequence, for determinism).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    PrefillDone(usize),
    DecodeDone(usize),
}

struct Workload {
    arrivals: Vec<(f64, Kind)>,
    groups: Vec<BlockHasher>,
    question_bytes: usize,
    /// Reasoning prompts: a 250-token system prompt they all share, then their own bytes.
    reasoning: BlockHasher,
    reasoning_bytes: usize,
}

fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x / total;
            acc
        })
        .collect()
}

fn workload(a: &Args, cfg: &Config, rate: f64, seed: u64) -> Workload {
    // Arrivals depend only on the seed and the rate: every policy sees the same sequence.
    let mut rng = SmallRng::seed_from_u64(seed ^ rate.to_bits());
    let cdf = zipf_cdf(a.groups, a.zipf);
    let mut t = 0.0;
    let mut arrivals = Vec::new();
    loop {
        let now_rate = if t < a.warmup { a.warmup_rate } else { rate };
        t += -(1.0 - rng.gen::<f64>()).ln() / now_rate;
        if t >= a.warmup + a.duration {
            break;
        }
        let u: f64 = rng.gen();
        let g = cdf.partition_point(|&c| c < u).min(a.groups - 1);
        // Drawn only with --mixed: the other runs keep their arrival sequence.
        let reasoning = a.mixed && {
            let major = (arrivals.len() / a.mix_phase.max(1)) % 2 == 1;
            rng.gen::<f64>() < if major { 0.8 } else { 0.2 }
        };
        arrivals.push((
            t,
            if reasoning {
                Kind::Reasoning
            } else {
                Kind::Group(g)
            },
        ));
    }
    let seed = chain_seed("sim-model", None);
    let prefix_bytes = (a.prefix_tokens as f64 * cfg.bytes_per_token) as usize;
    let groups = (0..a.groups)
        .map(|g| {
            let mut bytes = vec![0u8; prefix_bytes];
            SmallRng::seed_from_u64(0xC0FFEE + g as u64).fill_bytes(&mut bytes);
            let mut h = BlockHasher::new(seed, cfg.block_bytes(), cfg.max_prefix_blocks as usize);
            h.feed(&bytes);
            h
        })
        .collect();
    let shared = REASONING_SHARED_TOKENS.min(a.reasoning_prompt_tokens);
    let mut reasoning = BlockHasher::new(seed, cfg.block_bytes(), cfg.max_prefix_blocks as usize);
    let mut system = vec![0u8; (shared as f64 * cfg.bytes_per_token) as usize];
    SmallRng::seed_from_u64(0xBEEF).fill_bytes(&mut system);
    reasoning.feed(&system);
    Workload {
        arrivals,
        groups,
        question_bytes: (a.question_tokens as f64 * cfg.bytes_per_token) as usize,
        reasoning,
        reasoning_bytes: ((a.reasoning_prompt_tokens - shared) as f64 * cfg.bytes_per_token)
            as usize,
    }
}

/// Prompt tokens, tokens the request holds in KV besides a shared prefix (with --mixed), and
/// output tokens.
fn shape(a: &Args, r: &Request) -> (u64, u64, u64) {
    match (r.kind, a.pooled()) {
        (Kind::Group(_), false) => (a.prefix_tokens + a.question_tokens, 0, 0),
        (Kind::Group(_), true) => (
            a.prefix_tokens + a.question_tokens,
            a.question_tokens + r.output,
            r.output,
        ),
        (Kind::Reasoning, _) => (
            a.reasoning_prompt_tokens,
            a.reasoning_prompt_tokens + r.output,
            r.output,
        ),
    }
}

/// A reasoning request's output tokens: the configured length, or with a sigma a lognormal
/// draw of that mean, cut at four times it.
fn reasoning_output(a: &Args, rng: &mut SmallRng) -> u64 {
    let mean = a.reasoning_output_tokens as f64;
    let s = a.reasoning_output_sigma;
    if s <= 0.0 {
        return a.reasoning_output_tokens;
    }
    // Box-Muller: one standard normal from two uniforms.
    let (u1, u2): (f64, f64) = (1.0 - rng.gen::<f64>(), rng.gen());
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    (mean * (s * z - s * s / 2.0).exp()).clamp(1.0, 4.0 * mean) as u64
}

fn kv_tokens(a: &Args) -> u64 {
    a.kv_tokens.unwrap_or(a.kv_prefixes * 65_536)
}

fn config(a: &Args, r: Run) -> Config {
    let kv = a.index_kv_tokens.unwrap_or(kv_tokens(a));
    let told = a.router_prefill_rate.unwrap_or(a.prefill_rate);
    let latency = a.ttft_source == "latency";
    let (tau, peak, t_max_ms) = if a.operator_config() {
        let peak = if a.learn == "on" {
            PeakPrefill::Auto {
                initial: Some(told),
            }
        } else {
            PeakPrefill::TokensPerSecond(told)
        };
        (None, Some(peak), r.tau as f64 / a.prefill_rate * 1000.0)
    } else {
        (Some(r.tau), None, Config::default().max_ttft_penalty_ms)
    };
    Config {
        peak_prefill_throughput: peak,
        max_ttft_penalty_ms: t_max_ms,
        ttft_source: if latency {
            TtftSource::LatencyPredictor
        } else {
            TtftSource::PrefillThroughput
        },
        scorer: match (a.scorer.as_deref(), latency) {
            (Some("latency"), _) | (None, true) => Scorer::Latency,
            (Some("active-request"), _) => Scorer::ActiveRequest,
            _ => Scorer::TokenLoad,
        },
        picker: match (a.picker.as_deref(), latency) {
            (Some("weighted-random"), _) | (None, true) => Picker::WeightedRandom,
            _ => Picker::MaxScore,
        },
        policy: r.policy,
        gate: if a.gate == "relative" {
            GateForm::Relative
        } else {
            GateForm::Absolute
        },
        tau,
        kv_capacity_tokens: kv,
        max_endpoints: a.endpoints as u32,
        endpoints: (0..a.endpoints)
            .map(|i| EndpointConfig {
                address: format!("10.0.0.{}:8000", i + 1),
                kv_capacity_tokens: None,
            })
            .collect(),
        request_ttl_seconds: 86_400,
        ..Config::default()
    }
}

/// The filter's tick with metrics polled every 200 ms (the benchmark's setting).
const TICK_MS: u64 = 200;

fn simulate(a: &Args, r: Run) -> Outcomes {
    let cfg = config(a, r);
    let w = workload(a, &cfg, r.rate, r.seed);
    let mut table = EndpointTable::from_config(&cfg);
    let store = MemStore::new();
    let mut router = Router::new(cfg);
    let _ = router.sync_capacities(&store, &table.endpoints);
    let mut next_sync_ms = TICK_MS;
    let mut servers: Vec<Server> = (0..a.endpoints).map(|_| Server::default()).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(w.arrivals.len());
    let mut events = BinaryHeap::new();
    // Its own stream, so runs without a sigma keep every other draw.
    let mut orng = SmallRng::seed_from_u64(r.seed.wrapping_mul(0x9E37_79B9) ^ r.rate.to_bits());
    for (i, &(t, kind)) in w.arrivals.iter().enumerate() {
        let output = match kind {
            Kind::Reasoning => reasoning_output(a, &mut orng),
            Kind::Group(_) => a.output_tokens,
        };
        reqs.push(Request {
            output,
            arrival: t,
            kind,
            routed: None,
            endpoint: 0,
            hit: false,
            shared_cached: 0,
            ttft: None,
        });
        events.push(Reverse((Time(t), Event::Arrival(i))));
    }
    let mut out = Outcomes {
        rate_err_at_200: vec![f64::NAN; a.endpoints],
        ..Outcomes::default()
    };
    let mut qrng = SmallRng::seed_from_u64(r.seed.wrapping_mul(31));
    let mut question = vec![0u8; w.question_bytes];
    let mut own = vec![0u8; w.reasoning_bytes];
    while let Some(Reverse((Time(now), ev))) = events.pop() {
        let now_ms = (now * 1000.0) as u64;
        match ev {
            Event::Arrival(i) => {
                let (tokens, _, _) = shape(a, &reqs[i]);
                let h = match reqs[i].kind {
                    Kind::Group(g) => {
                        qrng.fill_bytes(&mut question);
                        let mut h = w.groups[g].clone();
                        h.feed(&question);
                        h
                    }
                    Kind::Reasoning => {
                        qrng.fill_bytes(&mut own);
                        let mut h = w.reasoning.clone();
                        h.feed(&own);
                        h
                    }
                };
                let chain = h.finish();
                if now_ms >= next_sync_ms {
                    // The filter's tick: learned capacities and the fleet's share.
                    let _ = router.sync_capacities(&store, &table.endpoints);
                    next_sync_ms = now_ms + TICK_MS;
                }
                if a.pooled() {
                    scrape(&mut table, &servers, kv_tokens(a), now_ms);
                }
                let Ok(routed) = router.route(&store, &table.endpoints, &chain, tokens, now_ms)
                else {
                    continue;
                };
                let e = table
                    .endpoints
                    .iter()
                    .position(|x| x.address == routed.addresses[0])
                    .unwrap_or(0);
                if let Some(k) = Reason::ALL
                    .iter()
                    .position(|x| *x == routed.decision.reason)
                {
                    out.reasons[k] += 1;
                }
                reqs[i].routed = Some(routed);
                reqs[i].endpoint = e;
                servers[e].queue.push_back(i);
                start_next(a, &mut servers[e], &mut reqs, &mut events, &mut out, now);
            }
            Event::PrefillDone(i) => {
                out.ttft.push(now - reqs[i].arrival);
                reqs[i].ttft = Some(now - reqs[i].arrival);
                if reqs[i].kind == Kind::Reasoning {
                    out.reasoning_ttft.push(now - reqs[i].arrival);
                }
                out.last_done = now;
                let e = reqs[i].endpoint;
                if let (true, false, Kind::Group(g)) = (a.pool, reqs[i].hit, reqs[i].kind) {
                    prefix_computed(a, &mut servers[e], g, reqs[i].shared_cached);
                }
                let (tokens, _, output) = shape(a, &reqs[i]);
                let cached = match reqs[i].kind {
                    Kind::Group(_) if a.pool => reqs[i].shared_cached,
                    Kind::Group(_) if reqs[i].hit => a.prefix_tokens,
                    Kind::Group(_) => 0,
                    Kind::Reasoning => reqs[i].shared_cached,
                };
                if let Some(r) = reqs[i].routed.as_mut() {
                    let _ = router.first_byte(&store, r, now_ms);
                    let _ = router.observe_usage(&store, r, ("", 0), tokens, Some(cached));
                    let slot = table.endpoints[e].slot;
                    if let Ok(est) = router.estimator.read(&store, slot) {
                        if est.total == 200 {
                            out.rate_err_at_200[e] = rate_error(a, e, est.rate);
                        }
                    }
                }
                // The answer streams for its output; the request stays active (and holds
                // its KV) until the last token.
                let done = now + output as f64 * a.tpot_ms / 1000.0;
                events.push(Reverse((Time(done), Event::DecodeDone(i))));
                servers[e].busy = false;
                servers[e].prefilling = None;
                start_next(a, &mut servers[e], &mut reqs, &mut events, &mut out, now);
            }
            Event::DecodeDone(i) => {
                let e = reqs[i].endpoint;
                if let Some(mut r) = reqs[i].routed.take() {
                    let _ = router.finish(&store, &mut r, Outcome::Done);
                }
                let (_, held, _) = shape(a, &reqs[i]);
                let s = &mut servers[e];
                s.held = s.held.saturating_sub(held);
                s.running = s.running.saturating_sub(1);
                start_next(a, s, &mut reqs, &mut events, &mut out, now);
            }
        }
    }
    if a.per_endpoint {
        print_endpoints(a, &reqs);
        print_estimates(&router, &store, &table);
    }
    out.rate_err_end = table
        .endpoints
        .iter()
        .enumerate()
        .filter_map(|(e, x)| {
            let est = router.estimator.read(&store, x.slot).ok()?;
            Some(rate_error(a, e, est.rate))
        })
        .collect();
    out
}

/// `--per-endpoint` with learning: what the router learned of each endpoint.
fn print_estimates(router: &Router, store: &MemStore, table: &EndpointTable) {
    if !router.cfg.learns() {
        return;
    }
    for (e, x) in table.endpoints.iter().enumerate() {
        let Ok(est) = router.estimator.read(store, x.slot) else {
            continue;
        };
        eprintln!(
            "endpoint {e} learned: {:.0} tok/s, capacity share {:.2}, {} cache checks, {} missed",
            est.rate, est.capacity_share, est.cache_checks, est.cache_misses
        );
    }
}

/// `--per-endpoint`: where the requests went and how they fared there.
fn print_endpoints(a: &Args, reqs: &[Request]) {
    for e in 0..a.endpoints {
        let mine: Vec<&Request> = reqs
            .iter()
            .filter(|r| r.routed.is_some() || r.ttft.is_some())
            .filter(|r| r.endpoint == e)
            .collect();
        let mut ttft: Vec<f64> = mine.iter().filter_map(|r| r.ttft).collect();
        ttft.sort_by(f64::total_cmp);
        // Reasoning requests have no group prefix to miss.
        let missed = mine
            .iter()
            .filter(|r| matches!(r.kind, Kind::Group(_)) && !r.hit)
            .count();
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for r in &mine {
            if let Kind::Group(g) = r.kind {
                match groups.iter_mut().find(|x| x.0 == g) {
                    Some(x) => x.1 += 1,
                    None => groups.push((g, 1)),
                }
            }
        }
        groups.sort_by_key(|x| std::cmp::Reverse(x.1));
        groups.truncate(8);
        let groups: Vec<String> = groups.iter().map(|(g, n)| format!("g{g}:{n}")).collect();
        eprintln!(
            "endpoint {e} ({:.0} tok/s): {} requests, TTFT p50 {:.2} s p90 {:.2} s, {missed} missed, {}",
            a.endpoint_rate(e),
            mine.len(),
            quantile(&ttft, 0.5),
            quantile(&ttft, 0.9),
            groups.join(" ")
        );
    }
}

/// What the router would read from the servers' metrics at `now_ms`: the share of each
/// pool the running requests hold (vLLM's `kv_cache_usage_perc`).
fn scrape(table: &mut EndpointTable, servers: &[Server], pool: u64, now_ms: u64) {
    for (e, s) in table.endpoints.iter_mut().zip(servers) {
        e.kv_usage = Some(s.held as f64 / pool.max(1) as f64);
        e.scraped_at_ms = now_ms.max(1);
    }
}

fn rate_error(a: &Args, e: usize, estimate: f64) -> f64 {
    let truth = a.endpoint_rate(e);
    (estimate - truth).abs() / truth
}

/// Starts the next queued prefill: the cache is consulted (and updated) when prefill starts.
/// With `--mixed` the head of the queue starts only when the pool has room for what it holds
/// (its prefix included) next to the running requests, unless it would run alone.
fn start_next(
    a: &Args,
    s: &mut Server,
    reqs: &mut [Request],
    events: &mut BinaryHeap<Reverse<(Time, Event)>>,
    out: &mut Outcomes,
    now: f64,
) {
    if a.pool {
        return start_pooled(a, s, reqs, events, out, now);
    }
    if s.busy {
        return;
    }
    let Some(&i) = s.queue.front() else { return };
    let (_, held, _) = shape(a, &reqs[i]);
    let pool = kv_tokens(a);
    let prefix = match reqs[i].kind {
        Kind::Group(_) => a.prefix_tokens,
        Kind::Reasoning => 0,
    };
    if a.pooled() && s.running > 0 && s.held + held + prefix > pool {
        return;
    }
    s.queue.pop_front();
    s.held += held;
    s.running += 1;
    // The prefix cache keeps whole prefixes in what the running requests leave.
    let kv = (pool.saturating_sub(s.held) / a.prefix_tokens.max(1)) as usize;
    let (hit, work) = match reqs[i].kind {
        Kind::Group(g) => {
            let hit = if let Some(pos) = s.cache.iter().position(|&x| x == g) {
                s.cache.remove(pos);
                true
            } else {
                false
            };
            s.cache.push_front(g);
            s.cache.truncate(kv.max(1));
            let work = a.question_tokens + if hit { 0 } else { a.prefix_tokens };
            out.hits += u64::from(hit);
            (hit, work)
        }
        Kind::Reasoning => {
            s.cache.truncate(kv);
            // The shared system prompt's full blocks, once it has been there.
            let shared = REASONING_SHARED_TOKENS.min(a.reasoning_prompt_tokens);
            let block = u64::from(Config::default().block_size_tokens).max(1);
            reqs[i].shared_cached = if s.reasoning_warm {
                shared / block * block
            } else {
                0
            };
            s.reasoning_warm = true;
            (false, a.reasoning_prompt_tokens - reqs[i].shared_cached)
        }
    };
    reqs[i].hit = hit;
    s.busy = true;
    let drag = 1.0 + a.decode_drag * s.held as f64 / pool.max(1) as f64;
    events.push(Reverse((
        Time(now + work as f64 / a.endpoint_rate(reqs[i].endpoint) * drag),
        Event::PrefillDone(i),
    )));
}

/// `--pool`: admits waiting requests while the pool has room for what they hold beside the
/// cache (a request alone runs anyway), each looking up the cache as it is admitted, then
/// starts the oldest admitted prefill.
fn start_pooled(
    a: &Args,
    s: &mut Server,
    reqs: &mut [Request],
    events: &mut BinaryHeap<Reverse<(Time, Event)>>,
    out: &mut Outcomes,
    now: f64,
) {
    let pool = kv_tokens(a);
    while let Some(&i) = s.queue.front() {
        let (_, held, _) = shape(a, &reqs[i]);
        let cached = match reqs[i].kind {
            Kind::Group(g) => s
                .held_prefixes
                .iter()
                .find(|x| x.0 == g)
                .map_or(0, |x| x.1)
                .max(scheduled(a, s, reqs, g, now)),
            Kind::Reasoning => 0,
        };
        let beside = match reqs[i].kind {
            Kind::Group(_) => held + a.prefix_tokens - cached,
            Kind::Reasoning => held,
        };
        if s.running > 0 && s.held + beside > pool {
            break;
        }
        s.queue.pop_front();
        s.held += beside;
        s.running += 1;
        if let Kind::Group(g) = reqs[i].kind {
            // A use moves what is cached of the prefix to the front.
            if let Some(pos) = s.held_prefixes.iter().position(|x| x.0 == g) {
                s.held_prefixes.remove(pos);
                s.held_prefixes.push_front((g, cached));
            }
            out.hits += u64::from(cached == a.prefix_tokens);
        }
        trim(&mut s.held_prefixes, pool.saturating_sub(s.held));
        reqs[i].hit = cached == a.prefix_tokens;
        reqs[i].shared_cached = cached;
        s.admitted.push_back(i);
    }
    if s.busy {
        return;
    }
    let Some(i) = s.admitted.pop_front() else {
        return;
    };
    let work = match reqs[i].kind {
        Kind::Group(_) => a.question_tokens + a.prefix_tokens - reqs[i].shared_cached,
        Kind::Reasoning => a.reasoning_prompt_tokens,
    };
    s.busy = true;
    s.prefilling = Some((i, now));
    events.push(Reverse((
        Time(now + work as f64 / a.endpoint_rate(reqs[i].endpoint)),
        Event::PrefillDone(i),
    )));
}

/// `--pool --cache-scheduled`: prefix tokens of group `g` the running prefill has computed
/// by `now` (whole engine steps of 8,192 tokens are scheduled at once; 0 for another group).
fn scheduled(a: &Args, s: &Server, reqs: &[Request], g: usize, now: f64) -> u64 {
    let Some((i, start)) = s.prefilling.filter(|_| a.cache_scheduled) else {
        return 0;
    };
    if reqs[i].kind != Kind::Group(g) {
        return 0;
    }
    const STEP: u64 = 8_192;
    let done = ((now - start).max(0.0) * a.endpoint_rate(reqs[i].endpoint)) as u64;
    let scheduled = (done / STEP + 1) * STEP;
    (reqs[i].shared_cached + scheduled).min(a.prefix_tokens)
}

/// `--pool`: a prefill of prefix `g`, of which `cached` tokens were found cached, ended;
/// the blocks it computed join the cache.
fn prefix_computed(a: &Args, s: &mut Server, g: usize, cached: u64) {
    s.held = s.held.saturating_sub(a.prefix_tokens - cached);
    s.held_prefixes.retain(|x| x.0 != g);
    s.held_prefixes.push_front((g, a.prefix_tokens));
    let room = kv_tokens(a).saturating_sub(s.held).max(a.prefix_tokens);
    trim(&mut s.held_prefixes, room);
}

/// Keeps `room` tokens of cached prefixes, most recent first; the one at the edge keeps its
/// head.
fn trim(prefixes: &mut VecDeque<(usize, u64)>, room: u64) {
    let mut left = room;
    prefixes.retain_mut(|x| {
        x.1 = x.1.min(left);
        left -= x.1;
        x.1 > 0
    });
}

#[derive(Clone, Copy)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let k = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[k - 1]
}

fn parse_sweep(s: &str) -> Vec<u64> {
    let f: Vec<u64> = s.split(':').filter_map(|x| x.parse().ok()).collect();
    match f.as_slice() {
        [a, b, step] if *step > 0 && a <= b => (*a..=*b).step_by(*step as usize).collect(),
        _ => {
            eprintln!("--tau-sweep wants A:B:STEP");
            std::process::exit(2);
        }
    }
}

fn main() {
    let a = Args::parse();
    let policies: Vec<PolicyName> = if a.policy == "all" {
        PolicyName::ALL.to_vec()
    } else {
        a.policy
            .split(',')
            .map(|p| {
                PolicyName::parse(p.trim()).unwrap_or_else(|| {
                    eprintln!("unknown policy {p:?}");
                    std::process::exit(2)
                })
            })
            .collect()
    };
    let taus = a
        .tau_sweep
        .as_deref()
        .map(parse_sweep)
        .unwrap_or_else(|| vec![a.tau]);
    let mut runs = Vec::new();
    for &policy in &policies {
        for &tau in &taus {
            for &rate in &a.rate {
                for seed in a.seed..a.seed + a.seeds.max(1) {
                    runs.push(Run {
                        policy,
                        rate,
                        tau,
                        seed,
                    });
                }
            }
        }
    }
    let results = Mutex::new(vec![None; runs.len()]);
    let next = Mutex::new(0usize);
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    std::thread::scope(|sc| {
        for _ in 0..workers {
            sc.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap_or_else(|e| e.into_inner());
                    *n += 1;
                    *n - 1
                };
                let Some(&run) = runs.get(i) else { break };
                let o = simulate(&a, run);
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(o);
            });
        }
    });
    if !a.json {
        println!(
            "{:<32} {:>6} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8}  reasons",
            "policy", "rate", "tau", "hit", "p50_s", "p90_s", "p99_s", "done", "rps"
        );
    }
    let results: Vec<Summary> = results
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .map(|o| o.map(summarize).unwrap_or_default())
        .collect();
    for (runs, sums) in runs
        .chunks(a.seeds.max(1) as usize)
        .zip(results.chunks(a.seeds.max(1) as usize))
    {
        report(&a, &runs[0], &mean(sums));
    }
    if let Some(slo) = a.slo {
        report_capacity(&a, &runs, &results, slo);
    }
}

/// Capacity at SLO per seed: the highest rate below the first one whose p90 missed.
fn capacity_at_slo(points: &mut [(f64, f64)], slo: f64) -> f64 {
    points.sort_by(|x, y| x.0.total_cmp(&y.0));
    points
        .iter()
        .take_while(|(_, p90)| *p90 <= slo)
        .last()
        .map_or(0.0, |(rate, _)| *rate)
}

fn report_capacity(a: &Args, runs: &[Run], results: &[Summary], slo: f64) {
    let mut groups: Vec<(PolicyName, u64)> = Vec::new();
    for r in runs {
        if !groups.contains(&(r.policy, r.tau)) {
            groups.push((r.policy, r.tau));
        }
    }
    for (policy, tau) in groups {
        let mut caps: Vec<(u64, f64)> = Vec::new();
        for seed in a.seed..a.seed + a.seeds.max(1) {
            let mut points: Vec<(f64, f64)> = runs
                .iter()
                .zip(results)
                .filter(|(r, _)| r.policy == policy && r.tau == tau && r.seed == seed)
                .map(|(r, s)| (r.rate, s.p90))
                .collect();
            caps.push((seed, capacity_at_slo(&mut points, slo)));
        }
        let mut sorted: Vec<f64> = caps.iter().map(|c| c.1).collect();
        sorted.sort_by(f64::total_cmp);
        let median = quantile(&sorted, 0.5);
        let list: Vec<String> = caps.iter().map(|(s, c)| format!("{s}:{c}")).collect();
        if a.json {
            let per_seed: Vec<String> = caps.iter().map(|c| c.1.to_string()).collect();
            println!(
                "{{\"policy\":\"{}\",\"tau\":{tau},\"slo_s\":{slo},\"capacity_rps\":[{}],\"capacity_median_rps\":{median}}}",
                policy.as_str(),
                per_seed.join(",")
            );
        } else {
            println!(
                "capacity at p90 <= {slo} s: {} tau {tau}: median {median} req/s; per seed {}",
                policy.as_str(),
                list.join(" ")
            );
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Summary {
    hit: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    /// p90 TTFT of the reasoning requests (`--mixed`; NaN without).
    reasoning_p90: f64,
    completed: f64,
    rps: f64,
    reasons: [f64; Reason::ALL.len()],
    /// Worst |R̂ − R| / R over endpoints after their 200th sample (NaN: none got 200), and
    /// at the end of the run.
    rate_err_200: f64,
    rate_err_end: f64,
}

fn summarize(mut o: Outcomes) -> Summary {
    o.ttft.sort_by(f64::total_cmp);
    o.reasoning_ttft.sort_by(f64::total_cmp);
    let n = o.ttft.len();
    // The hit rate is over the requests that have a prefix to hit.
    let groups = n - o.reasoning_ttft.len();
    let mut reasons = [0.0; Reason::ALL.len()];
    for (r, c) in reasons.iter_mut().zip(o.reasons) {
        *r = c as f64;
    }
    Summary {
        hit: o.hits as f64 / groups.max(1) as f64,
        p50: quantile(&o.ttft, 0.5),
        p90: quantile(&o.ttft, 0.9),
        p99: quantile(&o.ttft, 0.99),
        reasoning_p90: quantile(&o.reasoning_ttft, 0.9),
        completed: n as f64,
        rps: n as f64 / o.last_done.max(f64::MIN_POSITIVE),
        reasons,
        rate_err_200: worst(&o.rate_err_at_200),
        rate_err_end: worst(&o.rate_err_end),
    }
}

fn worst(v: &[f64]) -> f64 {
    v.iter()
        .copied()
        .filter(|x| x.is_finite())
        .reduce(f64::max)
        .unwrap_or(f64::NAN)
}

fn mean(s: &[Summary]) -> Summary {
    let k = s.len().max(1) as f64;
    let avg = |f: fn(&Summary) -> f64| s.iter().map(f).sum::<f64>() / k;
    let mut reasons = [0.0; Reason::ALL.len()];
    for (i, r) in reasons.iter_mut().enumerate() {
        *r = s.iter().map(|x| x.reasons[i]).sum::<f64>() / k;
    }
    Summary {
        hit: avg(|x| x.hit),
        p50: avg(|x| x.p50),
        p90: avg(|x| x.p90),
        p99: avg(|x| x.p99),
        reasoning_p90: avg(|x| x.reasoning_p90),
        completed: avg(|x| x.completed),
        rps: avg(|x| x.rps),
        reasons,
        rate_err_200: avg(|x| x.rate_err_200),
        rate_err_end: avg(|x| x.rate_err_end),
    }
}

fn report(a: &Args, run: &Run, o: &Summary) {
    let name = run.policy.as_str();
    let gate = match run.policy {
        PolicyName::StickyUntilSaturated | PolicyName::Tokenaware => a.gate.as_str(),
        _ => "-",
    };
    let (hit, p50, p90, p99, n, rps) = (o.hit, o.p50, o.p90, o.p99, o.completed, o.rps);
    if a.json {
        println!(
            "{{\"policy\":\"{name}\",\"gate\":\"{gate}\",\"rate\":{},\"tau\":{},\"seeds\":{},\"hit_rate\":{hit:.4},\"ttft_p50_s\":{p50:.3},\"ttft_p90_s\":{p90:.3},\"ttft_p99_s\":{p99:.3},\"completed\":{n:.0},\"throughput_rps\":{rps:.3},\"rate_err_at_200\":{},\"rate_err_end\":{},\"reasoning_ttft_p90_s\":{}}}",
            run.rate, run.tau, a.seeds.max(1), json_num(o.rate_err_200), json_num(o.rate_err_end),
            json_num(o.reasoning_p90)
        );
        return;
    }
    let reasons: Vec<String> = Reason::ALL
        .iter()
        .zip(o.reasons)
        .filter(|(_, c)| *c > 0.0)
        .map(|(r, c)| format!("{}={c:.0}", r.as_str()))
        .collect();
    let label = if gate == "-" {
        name.to_string()
    } else {
        format!("{name}/{gate}")
    };
    let reasoning = if a.mixed {
        format!("  reasoning p90 {:.3}", o.reasoning_p90)
    } else {
        String::new()
    };
    let learned = if a.learn == "on" || a.ttft_source == "latency" {
        format!(
            "  R̂ err@200 {:.1}% end {:.1}%",
            o.rate_err_200 * 100.0,
            o.rate_err_end * 100.0
        )
    } else {
        String::new()
    };
    println!(
        "{label:<32} {:>6} {:>9} {:>6.1}% {p50:>9.3} {p90:>9.3} {p99:>9.3} {n:>9.0} {rps:>8.2}  {}{reasoning}{learned}",
        run.rate,
        run.tau,
        hit * 100.0,
        reasons.join(" ")
    );
}

fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "null".into()
    }
}

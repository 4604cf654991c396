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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Mutex;

use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use tokenaware::config::{Config, EndpointConfig, GateForm, PolicyName};
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
    hits: u64,
    last_done: f64,
    reasons: [u64; Reason::ALL.len()],
}

/// One endpoint's truth: a FIFO of waiting requests and an LRU of whole prefixes.
#[derive(Default)]
struct Server {
    queue: VecDeque<usize>,
    busy: bool,
    cache: VecDeque<usize>,
}

struct Request {
    arrival: f64,
    group: usize,
    routed: Option<Routed>,
    endpoint: usize,
}

/// Events ordered by time (then sequence, for determinism).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    PrefillDone(usize),
}

struct Workload {
    arrivals: Vec<(f64, usize)>,
    groups: Vec<BlockHasher>,
    question_bytes: usize,
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
        t += -(1.0 - rng.gen::<f64>()).ln() / rate;
        if t >= a.duration {
            break;
        }
        let u: f64 = rng.gen();
        let g = cdf.partition_point(|&c| c < u).min(a.groups - 1);
        arrivals.push((t, g));
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
    Workload {
        arrivals,
        groups,
        question_bytes: (a.question_tokens as f64 * cfg.bytes_per_token) as usize,
    }
}

fn kv_tokens(a: &Args) -> u64 {
    a.kv_tokens.unwrap_or(a.kv_prefixes * 65_536)
}

fn config(a: &Args, r: Run) -> Config {
    let kv = a.index_kv_tokens.unwrap_or(kv_tokens(a));
    Config {
        policy: r.policy,
        gate: if a.gate == "relative" {
            GateForm::Relative
        } else {
            GateForm::Absolute
        },
        tau: Some(r.tau),
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

fn simulate(a: &Args, r: Run) -> Outcomes {
    let cfg = config(a, r);
    let w = workload(a, &cfg, r.rate, r.seed);
    let table = EndpointTable::from_config(&cfg);
    let store = MemStore::new();
    let mut router = Router::new(cfg);
    let _ = router.sync_capacities(&store, &table.endpoints);
    let mut servers: Vec<Server> = (0..a.endpoints).map(|_| Server::default()).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(w.arrivals.len());
    let mut events = BinaryHeap::new();
    for (i, &(t, g)) in w.arrivals.iter().enumerate() {
        reqs.push(Request {
            arrival: t,
            group: g,
            routed: None,
            endpoint: 0,
        });
        events.push(Reverse((Time(t), Event::Arrival(i))));
    }
    let mut out = Outcomes::default();
    let mut qrng = SmallRng::seed_from_u64(r.seed.wrapping_mul(31));
    let mut question = vec![0u8; w.question_bytes];
    let tokens = a.prefix_tokens + a.question_tokens;
    while let Some(Reverse((Time(now), ev))) = events.pop() {
        let now_ms = (now * 1000.0) as u64;
        match ev {
            Event::Arrival(i) => {
                qrng.fill_bytes(&mut question);
                let mut h = w.groups[reqs[i].group].clone();
                h.feed(&question);
                let chain = h.finish();
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
                out.last_done = now;
                if let Some(mut r) = reqs[i].routed.take() {
                    let _ = router.first_byte(&store, &mut r);
                    let _ = router.finish(&store, &mut r, Outcome::Done);
                }
                let e = reqs[i].endpoint;
                servers[e].busy = false;
                start_next(a, &mut servers[e], &mut reqs, &mut events, &mut out, now);
            }
        }
    }
    out
}

/// Starts the next queued prefill: the cache is consulted (and updated) when prefill starts.
fn start_next(
    a: &Args,
    s: &mut Server,
    reqs: &mut [Request],
    events: &mut BinaryHeap<Reverse<(Time, Event)>>,
    out: &mut Outcomes,
    now: f64,
) {
    if s.busy {
        return;
    }
    let Some(i) = s.queue.pop_front() else { return };
    let g = reqs[i].group;
    let hit = if let Some(pos) = s.cache.iter().position(|&x| x == g) {
        s.cache.remove(pos);
        true
    } else {
        false
    };
    s.cache.push_front(g);
    let kv = (kv_tokens(a) / a.prefix_tokens.max(1)).max(1) as usize;
    s.cache.truncate(kv);
    out.hits += u64::from(hit);
    let work = a.question_tokens + if hit { 0 } else { a.prefix_tokens };
    s.busy = true;
    events.push(Reverse((
        Time(now + work as f64 / a.prefill_rate),
        Event::PrefillDone(i),
    )));
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
}

#[derive(Debug, Clone, Copy, Default)]
struct Summary {
    hit: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    completed: f64,
    rps: f64,
    reasons: [f64; Reason::ALL.len()],
}

fn summarize(mut o: Outcomes) -> Summary {
    o.ttft.sort_by(f64::total_cmp);
    let n = o.ttft.len();
    let mut reasons = [0.0; Reason::ALL.len()];
    for (r, c) in reasons.iter_mut().zip(o.reasons) {
        *r = c as f64;
    }
    Summary {
        hit: o.hits as f64 / n.max(1) as f64,
        p50: quantile(&o.ttft, 0.5),
        p90: quantile(&o.ttft, 0.9),
        p99: quantile(&o.ttft, 0.99),
        completed: n as f64,
        rps: n as f64 / o.last_done.max(f64::MIN_POSITIVE),
        reasons,
    }
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
        completed: avg(|x| x.completed),
        rps: avg(|x| x.rps),
        reasons,
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
            "{{\"policy\":\"{name}\",\"gate\":\"{gate}\",\"rate\":{},\"tau\":{},\"seeds\":{},\"hit_rate\":{hit:.4},\"ttft_p50_s\":{p50:.3},\"ttft_p90_s\":{p90:.3},\"ttft_p99_s\":{p99:.3},\"completed\":{n:.0},\"throughput_rps\":{rps:.3}}}",
            run.rate, run.tau, a.seeds.max(1)
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
    println!(
        "{label:<32} {:>6} {:>9} {:>6.1}% {p50:>9.3} {p90:>9.3} {p99:>9.3} {n:>9.0} {rps:>8.2}  {}",
        run.rate,
        run.tau,
        hit * 100.0,
        reasons.join(" ")
    );
}

//! Decision cost, natively: parse + hash + match + pick (+ ledger charge and index insert,
//! which the filter also does on the request path) for a chat body, against 10 endpoints
//! whose tables are warm. Prints median and p99 per decision, the medians of its parts
//! (parse, hash, route), and the store reads and writes per request (route, first byte,
//! finish): in Envoy each is a shared-data hostcall. Built for `wasm32-wasip1` and run under
//! a WASI runtime it shows the same code compiled to wasm (docs/benchmarks.md).
//!
//!     cargo run --release --example decision_cost

use std::time::Instant;

use std::cell::Cell;
use tokenaware::config::{Config, EndpointConfig};
use tokenaware::endpoints::EndpointTable;
use tokenaware::request::{parse, ApiKind, ParseLimits};
use tokenaware::router::{Outcome, Router};

use tokenaware::store::{Bytes, Cas, MemStore, SharedStore, StoreError};

/// Counts the store operations the router makes.
struct Counting {
    inner: MemStore,
    reads: Cell<u64>,
    writes: Cell<u64>,
}

impl SharedStore for Counting {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        self.reads.set(self.reads.get() + 1);
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        self.writes.set(self.writes.get() + 1);
        self.inner.set(key, value, cas)
    }
}

fn chat_body(system_bytes: usize, question: usize) -> Vec<u8> {
    // Word-like text, so JSON escaping and UTF-8 checks see realistic input.
    let words = ["alpha ", "beta ", "gamma ", "delta ", "epsilon ", "zeta "];
    let mut system = String::with_capacity(system_bytes);
    let mut i = 0;
    while system.len() < system_bytes {
        system.push_str(words[i % words.len()]);
        i += 7;
    }
    serde_json::json!({
        "model": "sim-model",
        "stream": true,
        "max_tokens": 800,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("question number {question}: what changed?")}
        ]
    })
    .to_string()
    .into_bytes()
}

fn measure(label: &str, system_bytes: usize, iterations: usize) {
    let cfg = Config {
        endpoints: (0..10)
            .map(|i| EndpointConfig {
                address: format!("10.0.0.{}:8000", i + 1),
                kv_capacity_tokens: None,
            })
            .collect(),
        max_endpoints: 10,
        ..Config::default()
    };
    let table = EndpointTable::from_config(&cfg);
    let store = Counting {
        inner: MemStore::new(),
        reads: Cell::new(0),
        writes: Cell::new(0),
    };
    let mut router = Router::new(cfg);
    let _ = router.sync_capacities(&store, &table.endpoints);
    let limits = ParseLimits::default();
    // Bodies differ in their question, as real traffic does; built before timing.
    let bodies: Vec<Vec<u8>> = (0..64).map(|q| chat_body(system_bytes, q)).collect();
    let mut times = Vec::with_capacity(iterations);
    // The same decisions split: parse, hash (with the token estimate), route.
    let mut parts: [Vec<f64>; 3] = Default::default();
    for i in 0..iterations + 200 {
        let body = &bodies[i % bodies.len()];
        let t = Instant::now();
        let Ok(req) = parse(ApiKind::ChatCompletions, body, &limits) else {
            eprintln!("parse failed");
            return;
        };
        let parsed = t.elapsed();
        let chain = router.hash(&req);
        let tokens = router.prompt_tokens(&req);
        let hashed = t.elapsed();
        let routed = router.route(&store, &table.endpoints, &chain, tokens, i as u64);
        let elapsed = t.elapsed();
        if let Ok(mut r) = routed {
            let _ = router.first_byte(&store, &mut r, 0);
            let _ = router.finish(&store, &mut r, Outcome::Done);
        }
        if i == 199 {
            store.reads.set(0);
            store.writes.set(0);
        }
        if i >= 200 {
            times.push(elapsed.as_secs_f64() * 1e6);
            let [p, h, r] = &mut parts;
            p.push(parsed.as_secs_f64() * 1e6);
            h.push((hashed - parsed).as_secs_f64() * 1e6);
            r.push((elapsed - hashed).as_secs_f64() * 1e6);
        }
    }
    for v in parts.iter_mut().chain([&mut times]) {
        v.sort_by(f64::total_cmp);
    }
    let at = |v: &[f64], p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
    let q = |p: f64| at(&times, p);
    let per = |n: u64| n as f64 / times.len() as f64;
    println!(
        "{label:<24} body {:>7} B  decisions {:>6}  median {:>8.1} µs  p99 {:>8.1} µs  \
         store reads {:.1} writes {:.1} per request",
        bodies[0].len(),
        times.len(),
        q(0.5),
        q(0.99),
        per(store.reads.get()),
        per(store.writes.get())
    );
    println!(
        "{:<24} medians: parse {:.1} µs, hash {:.1} µs, route {:.1} µs",
        "",
        at(&parts[0], 0.5),
        at(&parts[1], 0.5),
        at(&parts[2], 0.5)
    );
}

fn main() {
    measure("4 KB chat, 10 eps", 3_900, 20_000);
    measure("220 KB chat, 10 eps", 220_000, 2_000);
}

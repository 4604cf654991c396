//! Replays a benchmark's request records (`bench --records`) through the estimator, so a
//! change to how it learns R_peak can be tried on a recorded run without running it again:
//!
//!     cargo run --release --example replay_estimates -- \
//!         target/bench-x/records/seed-sim/tokenaware-auto-low.json --prior 512 --truth 2048
//!
//! Each record gives a dispatch (its scheduled start), a first byte and a stream end (model
//! seconds), the endpoint, the tokens the server prefilled and the decision (`tokens=`,
//! `hit=`), from which the first byte's prediction is rebuilt. Samples reach the estimator
//! as they would reach the filter: first bytes in time order, `usage` when the stream ends.
//! What the filter also had and the records do not is rebuilt from them: the tokens queued
//! ahead (requests sent earlier whose first byte came later) and the requests active there.
//! No KV-pool reading (every sample counts as without pressure). Rates are in the records'
//! units: model tokens per model second, at the bench's scale.
//!
//! Prints, per endpoint (slots in address order), the learned rate's error at its 200th
//! sample, the largest error from then on, and at the end; `--trace SLOT` prints every
//! sample of one endpoint.

use std::error::Error;

use clap::Parser;
use serde_json::Value;
use tokenaware::estimator::{Estimator, TtftSample};
use tokenaware::store::{MemStore, StoreError};

#[derive(Debug, Parser)]
struct Args {
    /// `records/WORKLOAD/TARGET.json` of a bench run.
    records: std::path::PathBuf,
    /// The rate the estimator starts from (the target's preset).
    #[arg(long)]
    prior: f64,
    /// The fleet's real rate, for the errors.
    #[arg(long)]
    truth: f64,
    /// Print every sample of this slot.
    #[arg(long)]
    trace: Option<u16>,
}

/// One request, in model milliseconds.
struct Request {
    slot: u16,
    dispatch: u64,
    first_byte: u64,
    end: u64,
    /// What the index predicted the server would prefill, and what it did.
    predicted: u64,
    served: u64,
    /// The whole prompt (what a predicted hit prefills if the server had evicted it).
    tokens: u64,
}

fn ms(s: f64) -> u64 {
    (s * 1000.0).round().max(0.0) as u64
}

/// A `key=value` field of an `x-tokenaware-decision` note.
fn note_field(note: &str, key: &str) -> Option<f64> {
    note.split("; ")
        .find_map(|p| p.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// The stages' records on one time line (each stage starts 5 s after the last one ended).
fn requests(stages: &Value) -> Vec<Request> {
    let records = |st: &Value| st["records"].as_array().cloned().unwrap_or_default();
    let mut endpoints: Vec<String> = stages
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(records)
        .filter_map(|r| r["endpoint"].as_str().map(String::from))
        .collect();
    endpoints.sort();
    endpoints.dedup();
    let mut out = Vec::new();
    let mut offset = 0.0f64;
    for st in stages.as_array().into_iter().flatten() {
        let mut last = offset;
        for r in records(st) {
            let (Some(ttft), Some(e2e), Some(ep)) = (
                r["ttft_s"].as_f64(),
                r["e2e_s"].as_f64(),
                r["endpoint"].as_str(),
            ) else {
                continue;
            };
            let Some(slot) = endpoints.iter().position(|e| e == ep) else {
                continue;
            };
            let t0 = offset + r["scheduled_s"].as_f64().unwrap_or(0.0);
            let note = r["decision"].as_str().unwrap_or("");
            let tokens = note_field(note, "tokens").unwrap_or(0.0);
            let hit = note_field(note, "hit").unwrap_or(0.0);
            let prompt = r["prompt_tokens"].as_u64().unwrap_or(0);
            let cached = r["cached_tokens"].as_u64().unwrap_or(0);
            out.push(Request {
                slot: slot as u16,
                dispatch: ms(t0),
                first_byte: ms(t0 + ttft),
                end: ms(t0 + e2e.max(ttft)),
                predicted: (tokens * (1.0 - hit)).round() as u64,
                served: prompt.saturating_sub(cached),
                tokens: tokens as u64,
            });
            last = last.max(t0 + e2e);
        }
        offset = last + 5.0;
    }
    out
}

fn store_error(e: StoreError) -> String {
    format!("the in-memory store failed: {e:?}")
}

fn main() -> Result<(), Box<dyn Error>> {
    let a = Args::parse();
    let stages: Value = serde_json::from_slice(&std::fs::read(&a.records)?)?;
    let reqs = requests(&stages);
    // (time, usage after first byte, request)
    let mut events: Vec<(u64, bool, usize)> = (0..reqs.len())
        .flat_map(|i| [(reqs[i].first_byte, false, i), (reqs[i].end, true, i)])
        .collect();
    events.sort();
    let store = MemStore::new();
    let est = Estimator::new("replay", a.prior, 4.0);
    let mut counted = vec![None; reqs.len()];
    let slots = reqs.iter().map(|r| r.slot as usize + 1).max().unwrap_or(0);
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); slots];
    for (_, usage, i) in events {
        let r = &reqs[i];
        let here = || {
            reqs.iter()
                .filter(|o| o.slot == r.slot && o.dispatch < r.dispatch)
        };
        let sample = TtftSample {
            dispatch_ms: r.dispatch,
            first_byte_ms: r.first_byte,
            ahead: here()
                .filter(|o| o.first_byte > r.dispatch)
                .map(|o| o.predicted)
                .sum(),
            uncached: r.predicted,
            active: here().filter(|o| o.end > r.dispatch).count() as u64,
            kv_usage: 0.0,
        };
        if usage {
            let served = TtftSample {
                uncached: r.served,
                ..sample
            };
            est.observe_ttft(&store, r.slot, &served, counted[i])
                .map_err(store_error)?;
            continue;
        }
        counted[i] = est
            .observe_first_byte(&store, r.slot, &sample, r.tokens)
            .map_err(store_error)?;
        let rate = est.read(&store, r.slot).map_err(store_error)?.rate;
        if let Some(v) = rates.get_mut(r.slot as usize) {
            v.push(rate);
        }
        if a.trace == Some(r.slot) {
            println!(
                "t {:.2} s  interval {} ms  predicted {}  ahead {}  counted {:?}  rate {:.0}",
                r.first_byte as f64 / 1000.0,
                r.first_byte - r.dispatch,
                r.predicted,
                sample.ahead,
                counted[i],
                rate
            );
        }
    }
    let err = |x: f64| x / a.truth - 1.0;
    for (slot, v) in rates.iter().enumerate() {
        let worst =
            v.iter()
                .skip(199)
                .map(|&x| err(x))
                .fold(0.0f64, |w, e| if e.abs() > w.abs() { e } else { w });
        let at = v
            .get(199)
            .map_or("-".into(), |&x| format!("{:+.1} %", 100.0 * err(x)));
        let end = v
            .last()
            .map_or("-".into(), |&x| format!("{:+.1} %", 100.0 * err(x)));
        let after = match v.len() {
            n if n >= 200 => format!("{:+.1} %", 100.0 * worst),
            _ => "-".into(),
        };
        println!(
            "slot {slot}: {} samples, at the 200th {at}, worst after {after}, at the end {end}",
            v.len()
        );
    }
    Ok(())
}

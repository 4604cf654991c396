//! Routing policies: given one request and the fleet as the tables see it, pick an endpoint
//! and say why. One policy per file behind `Policy`; all are pure functions of their inputs
//! (time and tie-breaking come in as arguments), so the simulator, the unit tests and the
//! filter run the same decisions.

mod always_sticky;
mod least_load;
mod round_robin;
mod sticky_until_saturated;
#[cfg(test)]
pub(crate) mod testing;
mod tokenaware;

pub use always_sticky::AlwaysSticky;
pub use least_load::LeastLoad;
pub use round_robin::RoundRobin;
pub use sticky_until_saturated::StickyUntilSaturated;
pub use tokenaware::Tokenaware;

use crate::config::{Config, GateForm, Picker, PolicyName, Scorer};
use crate::ledger::Load;

/// One endpoint as the tables see it at decision time.
///
/// With learned estimates, `load.tokens` is in reference tokens: the endpoint's predicted
/// wait × the configured R_peak, so one τ fits endpoints of different speeds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Stable identity (hash of the address), for rendezvous hashing.
    pub id: u64,
    /// Leading blocks of this request the endpoint is believed to hold.
    pub matched_blocks: usize,
    pub load: Load,
    /// Blocks stamped on the endpoint so far (index clock): how much cache churn it took.
    pub clock: u64,
    /// KV capacity in blocks.
    pub capacity: u64,
    /// Uncached tokens sent to it per second, recently (its prefill utilisation × R_peak).
    pub work_per_s: u64,
    /// It held this prompt's prefix recently, though the index has aged it out.
    pub recalled: bool,
    /// Blocks it is believed to hold (at most `capacity`).
    pub held: u64,
    /// Seconds since the prefix a prompt of this size would push out there (by the
    /// whole-prompt LRU view of `index::Match`) was last used; `None` while there is room.
    pub victim_idle_s: Option<u32>,
    /// This prompt's rank by last use among the endpoint's recent prefixes.
    pub rank: Option<u32>,
    /// Seconds since this prompt's prefix was last sent there, if it is among them.
    pub idle_s: Option<u32>,
    /// Learned prefill rate over the configured one (1 without learning): this request's
    /// uncached tokens cost `1 / speed` reference tokens each there.
    pub speed: f64,
    /// Prefixes this gateway placed there lately (decaying cold placements; read only when
    /// other replicas send this gateway's prefixes, else 0).
    pub placed: f64,
}

impl Candidate {
    /// `speed`, or 1 when it is not a usable number.
    pub fn speed(&self) -> f64 {
        if self.speed > 0.0 && self.speed.is_finite() {
            self.speed
        } else {
            1.0
        }
    }
}

impl Default for Candidate {
    fn default() -> Self {
        Candidate {
            id: 0,
            matched_blocks: 0,
            load: Load::default(),
            clock: 0,
            capacity: 0,
            work_per_s: 0,
            recalled: false,
            held: 0,
            victim_idle_s: None,
            rank: None,
            idle_s: None,
            speed: 1.0,
            placed: 0.0,
        }
    }
}

/// The request as the policies see it.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Prompt tokens `T`.
    pub tokens: u64,
    /// Block hashes of the prompt.
    pub chain: &'a [u64],
    /// Tokens per block.
    pub block_tokens: u64,
}

impl Ask<'_> {
    /// The share of the prompt's tokens the endpoint holds. By tokens, not blocks: a
    /// partial last block (never cached) and a tail past `maxPrefixBlocks` (never hashed)
    /// count as the misses they are. By blocks, a repeated prompt of three blocks and a bit
    /// was never warm at 0.8 (3 of 4), and one cut at `maxPrefixBlocks` was warm at 1.0
    /// however much of it went unhashed.
    pub fn hit(&self, c: &Candidate) -> f64 {
        match (self.chain.len(), self.tokens) {
            (0, _) | (_, 0) => 0.0,
            (_, t) => 1.0 - self.uncached(c) as f64 / t as f64,
        }
    }

    /// This request's tokens the endpoint would have to prefill (llm-d's uncached tokens:
    /// unmatched blocks plus any tail beyond the hashed blocks).
    pub fn uncached(&self, c: &Candidate) -> u64 {
        self.tokens
            .saturating_sub((c.matched_blocks as u64).saturating_mul(self.block_tokens))
    }

    /// Token-load cost: what is queued there plus what this request adds (in reference
    /// tokens: a slower endpoint's tokens cost more).
    pub fn cost(&self, c: &Candidate) -> u64 {
        let own = match c.speed() {
            1.0 => self.uncached(c),
            speed => (self.uncached(c) as f64 / speed) as u64,
        };
        c.load.tokens.saturating_add(own)
    }
}

/// Why an endpoint was picked; also a stats label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A warm endpoint, under the saturation gate.
    Sticky,
    /// The gate broke: load moved off the warm set.
    Spill,
    /// No endpoint warm for this prefix.
    Cold,
    /// The gate broke but every endpoint is past τ: stay warm rather than cold-fill.
    AllSaturated,
    /// A policy that ignores affinity (round robin, least load).
    Balanced,
    /// A hot prefix held only on slow endpoints, copied to a much faster idle one.
    Promote,
}

impl Reason {
    pub const ALL: [Reason; 6] = [
        Reason::Sticky,
        Reason::Spill,
        Reason::Cold,
        Reason::AllSaturated,
        Reason::Balanced,
        Reason::Promote,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Sticky => "sticky",
            Reason::Spill => "spill",
            Reason::Cold => "cold",
            Reason::AllSaturated => "all_saturated",
            Reason::Balanced => "balanced",
            Reason::Promote => "promote",
        }
    }
}

/// A pick: candidate indices, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub endpoint: usize,
    /// Next-best endpoints, for override_host to try if the first fails.
    pub fallbacks: Vec<usize>,
    pub reason: Reason,
    /// The picked endpoint's match ratio.
    pub hit: f64,
    /// The picked endpoint's token cost (queued plus this request's uncached tokens).
    pub cost: u64,
    /// The saturation gate broke for this request.
    pub tau_broken: bool,
}

/// Knobs every affinity policy shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub tau: f64,
    pub affinity_threshold: f64,
    pub gate: GateForm,
    pub scorer: Scorer,
    pub picker: Picker,
    pub fallbacks: usize,
    /// Endpoints a cold prefix may go to, by rendezvous on its first block (0: all).
    pub cold_choices: usize,
    /// Other gateway replicas send this one's prefixes (`shared_prefixes`): with
    /// `cold_choices`, a cold prefix leans to the first of its choices.
    pub shared_prefixes: bool,
}

impl Params {
    pub fn from_config(c: &Config) -> Params {
        Params {
            tau: c.tau_tokens(),
            affinity_threshold: c.affinity_threshold,
            gate: c.gate,
            scorer: c.scorer,
            picker: c.picker,
            fallbacks: c.fallbacks as usize,
            cold_choices: c.cold_placement_choices.unwrap_or(0) as usize,
            shared_prefixes: false,
        }
    }
}

pub trait Policy {
    fn name(&self) -> &'static str;
    /// `seq` is a per-gateway request counter: it rotates ties and drives round robin.
    /// `None` only when there are no candidates.
    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision>;
}

pub fn build(name: PolicyName, p: Params) -> Box<dyn Policy> {
    match name {
        PolicyName::RoundRobin => Box::new(RoundRobin { p }),
        PolicyName::LeastLoad => Box::new(LeastLoad { p }),
        PolicyName::AlwaysSticky => Box::new(AlwaysSticky { p }),
        PolicyName::StickyUntilSaturated => Box::new(StickyUntilSaturated { p }),
        PolicyName::Tokenaware => Box::new(Tokenaware { p }),
    }
}

// === shared pieces ===

/// Indices of warm endpoints (match ratio at or above the threshold).
fn warm(ask: &Ask, fleet: &[Candidate], threshold: f64) -> Vec<usize> {
    if threshold <= 0.0 || ask.chain.is_empty() {
        return Vec::new();
    }
    (0..fleet.len())
        .filter(|&i| ask.hit(&fleet[i]) >= threshold)
        .collect()
}

/// The index in `among` minimising `key`; equal keys rotate with `seq`, so a burst of equal
/// requests spreads instead of landing on the first endpoint.
fn argmin<K: PartialOrd + Copy>(
    among: &[usize],
    seq: u64,
    key: impl Fn(usize) -> K,
) -> Option<usize> {
    let best = among
        .iter()
        .map(|&i| key(i))
        .reduce(|a, b| if b < a { b } else { a })?;
    let ties: Vec<usize> = among.iter().copied().filter(|&i| key(i) <= best).collect();
    ties.get((seq % ties.len().max(1) as u64) as usize).copied()
}

/// Pick by the configured scorer and picker: token cost, active requests then token cost,
/// or predicted TTFT (the cost, when candidates carry the learned predictor's wait).
fn score_pick(
    ask: &Ask,
    fleet: &[Candidate],
    among: &[usize],
    p: &Params,
    seq: u64,
) -> Option<usize> {
    match (p.scorer, p.picker) {
        (Scorer::ActiveRequest, Picker::MaxScore) => argmin(among, seq, |i| {
            (fleet[i].load.requests, ask.cost(&fleet[i]))
        }),
        (_, Picker::MaxScore) => argmin(among, seq, |i| ask.cost(&fleet[i])),
        (Scorer::ActiveRequest, Picker::WeightedRandom) => {
            weighted_random(fleet, among, seq, |i| {
                fleet[i].load.requests.saturating_add(1)
            })
        }
        (_, Picker::WeightedRandom) => {
            weighted_random(fleet, among, seq, |i| ask.cost(&fleet[i]).saturating_add(1))
        }
    }
}

/// Weighted random pick (A-Res: the largest `u^(1/w)`), with weight `best / cost`: the
/// cheapest endpoint has weight 1, one twice as costly 1/2. `u` comes from the request
/// counter and the endpoint id, so the policy stays a pure function.
fn weighted_random(
    fleet: &[Candidate],
    among: &[usize],
    seq: u64,
    cost: impl Fn(usize) -> u64,
) -> Option<usize> {
    let best = among.iter().map(|&i| cost(i)).min()? as f64;
    among.iter().copied().max_by(|&a, &b| {
        let key = |i: usize| {
            let u = (rendezvous(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15), fleet[i].id) >> 11) as f64
                / (1u64 << 53) as f64;
            let w = best / cost(i).max(1) as f64;
            u.max(f64::MIN_POSITIVE).powf(1.0 / w.max(1e-9))
        };
        key(a).total_cmp(&key(b))
    })
}

/// Rendezvous (highest random weight) score of an endpoint for a key: every gateway that
/// sees the same candidates and key ranks them the same way.
fn rendezvous(key: u64, id: u64) -> u64 {
    let mut x = key ^ id.rotate_left(17) ^ 0xA076_1D64_78BD_642F;
    x = (x ^ (x >> 32)).wrapping_mul(0xE703_7ED1_A0B4_28DB);
    x ^ (x >> 29)
}

fn all(fleet: &[Candidate]) -> Vec<usize> {
    (0..fleet.len()).collect()
}

/// Builds the decision: the picked endpoint, then the others by ascending cost.
fn decide(
    ask: &Ask,
    fleet: &[Candidate],
    pick: usize,
    reason: Reason,
    tau_broken: bool,
    p: &Params,
) -> Decision {
    let mut rest: Vec<usize> = (0..fleet.len()).filter(|&i| i != pick).collect();
    rest.sort_by_key(|&i| ask.cost(&fleet[i]));
    rest.truncate(p.fallbacks);
    let c = fleet.get(pick).copied().unwrap_or_default();
    Decision {
        endpoint: pick,
        fallbacks: rest,
        reason,
        hit: ask.hit(&c),
        cost: ask.cost(&c),
        tau_broken,
    }
}

//! tokenaware: sticky until saturated, with three changes that remove its two failures in
//! the seeds' simulation (a cliff when τ is low, and cold fills when the whole fleet is short
//! of capacity).
//!
//! - Spills of one prefix go to a stable secondary: the rendezvous winner, keyed by the
//!   deepest block the warm endpoint holds, among the endpoints whose cost is within half a τ
//!   of the cheapest. Repeated spills build a second warm replica instead of cold-filling a
//!   different endpoint each time (and evicting its warm prefixes).
//! - Cold prefixes go to the rendezvous winner, keyed by the first block, among the endpoints
//!   near the least cost that hold the fewest distinct prefixes. New prefixes spread over the
//!   caches evenly (an endpoint given a fifth prefix evicts one of its four), and gateway
//!   replicas that share no state still tend to agree.
//! - When every endpoint is past τ, spilling cannot create headroom, it only turns capacity
//!   into cold fills: stay sticky.
//!
//! Why not least-loaded spills (llm-d): each spill then lands wherever load is momentarily
//! lowest, so a hot prefix ends up cold-filled on many endpoints, which is the cliff.

use super::sticky_until_saturated::gate_breaks;
use super::{
    all, decide, rendezvous, score_pick, warm, Ask, Candidate, Decision, Params, Policy, Reason,
};

pub struct Tokenaware {
    pub p: Params,
}

/// Share of τ within which an endpoint counts as "least loaded" for a spill.
const SPILL_BAND: f64 = 0.05;
/// Share of one cold prefill within which cold-placement keys count as tied.
/// Seconds of an endpoint's recent work rate a cold placement counts as queue: a cold fill
/// delays everything that arrives behind it.
const WORK_HORIZON_S: u64 = 20;
const COLD_BAND: f64 = 0.2;

impl Tokenaware {
    fn band(&self, ask: &Ask, fleet: &[Candidate], among: &[usize], share: f64) -> Vec<usize> {
        let min = among
            .iter()
            .map(|&i| ask.cost(&fleet[i]))
            .min()
            .unwrap_or(0);
        let limit = min as f64 + self.p.tau * share;
        among
            .iter()
            .copied()
            .filter(|&i| ask.cost(&fleet[i]) as f64 <= limit)
            .collect()
    }

    fn rendezvous_pick(fleet: &[Candidate], among: &[usize], key: u64) -> Option<usize> {
        among
            .iter()
            .copied()
            .max_by_key(|&i| rendezvous(key, fleet[i].id))
    }

    /// Cold placement trades cache room against queue: each prefix an endpoint already
    /// holds counts as one prefill of this request, since placing one more there evicts one.
    fn cold(&self, ask: &Ask, fleet: &[Candidate]) -> Option<usize> {
        // Recent work is real tokens: on a slower endpoint it is more time (`speed` is 1
        // unless rates are learned). Held prefixes are cache room, the same on every
        // endpoint whatever its speed.
        let key = |i: usize| {
            let c = &fleet[i];
            let work = (c.work_per_s as f64 * WORK_HORIZON_S as f64 / c.speed()) as u64;
            ask.cost(c) + u64::from(c.heads) * ask.tokens + work
        };
        let min = (0..fleet.len()).map(key).min().unwrap_or(0);
        let slack = (ask.tokens as f64 * COLD_BAND) as u64;
        // An endpoint that held this prefix recently probably still has it: going back costs
        // at most one more held prefix than the best fresh choice.
        let recalled = (0..fleet.len())
            .filter(|&i| fleet[i].recalled && key(i) <= min + slack + ask.tokens / 2)
            .min_by_key(|&i| key(i));
        if recalled.is_some() {
            return recalled;
        }
        let near: Vec<usize> = (0..fleet.len())
            .filter(|&i| key(i) <= min + slack)
            .collect();
        Self::rendezvous_pick(fleet, &near, ask.chain.first().copied().unwrap_or(0))
    }

    /// Spill target: not a warm endpoint that is itself past the gate (its cache discount
    /// would often win on cost and undo the spill).
    fn spill(&self, ask: &Ask, fleet: &[Candidate], w: &[usize]) -> Option<usize> {
        let depth = w
            .iter()
            .map(|&i| fleet[i].matched_blocks)
            .max()
            .unwrap_or(0);
        let key = ask.chain.get(depth.saturating_sub(1)).copied().unwrap_or(0);
        let open: Vec<usize> = (0..fleet.len())
            .filter(|i| !w.contains(i) || !gate_breaks(fleet, &[*i], &self.p))
            .collect();
        let open = if open.is_empty() { all(fleet) } else { open };
        let near = self.band(ask, fleet, &open, SPILL_BAND);
        Self::rendezvous_pick(fleet, &near, key)
    }

    fn saturated(&self, fleet: &[Candidate]) -> bool {
        fleet.iter().all(|c| c.load.tokens as f64 > self.p.tau)
    }
}

impl Policy for Tokenaware {
    fn name(&self) -> &'static str {
        "tokenaware"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        if fleet.is_empty() {
            return None;
        }
        let w = warm(ask, fleet, self.p.affinity_threshold);
        if w.is_empty() {
            let pick = self.cold(ask, fleet)?;
            return Some(decide(ask, fleet, pick, Reason::Cold, false, &self.p));
        }
        if !gate_breaks(fleet, &w, &self.p) {
            let pick = score_pick(ask, fleet, &w, &self.p, seq)?;
            return Some(decide(ask, fleet, pick, Reason::Sticky, false, &self.p));
        }
        if self.saturated(fleet) {
            let pick = score_pick(ask, fleet, &w, &self.p, seq)?;
            return Some(decide(
                ask,
                fleet,
                pick,
                Reason::AllSaturated,
                true,
                &self.p,
            ));
        }
        let pick = self.spill(ask, fleet, &w)?;
        Some(decide(ask, fleet, pick, Reason::Spill, true, &self.p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GateForm;
    use crate::policy::testing::{ask, fleet, params};

    fn ta() -> Tokenaware {
        Tokenaware { p: params() }
    }

    #[test]
    fn warm_under_tau_sticks() {
        let chain = [3u64; 10];
        let d = ta()
            .pick(&ask(&chain), &fleet(&[(0, 0), (10, 60_000), (0, 0)]), 0)
            .unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Sticky));
        assert_eq!(d.hit, 1.0);
    }

    #[test]
    fn spills_of_one_prefix_go_to_one_secondary() {
        let chain: Vec<u64> = (1..=10).collect();
        let spec = [
            (10, 500_000),
            (0, 1_000),
            (0, 2_000),
            (0, 1_500),
            (0, 3_000),
        ];
        let picks: Vec<usize> = (0..20)
            .map(|seq| {
                let mut f = fleet(&spec);
                // Loads shift a little between requests; the secondary must not.
                f[1 + seq % 4].load.tokens += 1_000;
                ta().pick(&ask(&chain), &f, seq as u64).unwrap()
            })
            .inspect(|d| assert_eq!((d.reason, d.tau_broken), (Reason::Spill, true)))
            .map(|d| d.endpoint)
            .collect();
        assert!(picks.iter().all(|&p| p == picks[0] && p != 0), "{picks:?}");
    }

    #[test]
    fn all_saturated_stays_sticky() {
        let chain = [3u64; 10];
        let f = fleet(&[(0, 200_000), (10, 400_000), (0, 150_000)]);
        let d = ta().pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!(
            (d.endpoint, d.reason, d.tau_broken),
            (1, Reason::AllSaturated, true)
        );
    }

    #[test]
    fn cold_placement_is_stable_and_avoids_full() {
        let chain: Vec<u64> = (40..50).collect();
        let mut f = fleet(&[(0, 0), (0, 0), (0, 0), (0, 0)]);
        let first = ta().pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!(first.reason, Reason::Cold);
        for seq in 1..10 {
            assert_eq!(
                ta().pick(&ask(&chain), &f, seq).unwrap().endpoint,
                first.endpoint
            );
        }
        // The same endpoint, holding more prefixes than the others, is avoided.
        f[first.endpoint].heads = 3;
        assert_ne!(
            ta().pick(&ask(&chain), &f, 0).unwrap().endpoint,
            first.endpoint
        );
    }

    #[test]
    fn one_endpoint_and_absolute_gate() {
        let chain = [3u64; 10];
        let p = Tokenaware {
            p: Params {
                gate: GateForm::Absolute,
                ..params()
            },
        };
        let d = p.pick(&ask(&chain), &fleet(&[(10, 900_000)]), 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (0, Reason::AllSaturated));
        let d = p.pick(&ask(&chain), &fleet(&[(0, 0)]), 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (0, Reason::Cold));
        assert!(p.pick(&ask(&chain), &[], 0).is_none());
    }
}

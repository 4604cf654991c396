//! Sticky until saturated (llm-d's prefix-cache-affinity filter with a load scorer): keep the
//! warm endpoints unless the saturation gate breaks, then choose among all by load.
//!
//! Gate `relative` (llm-d today): break when the least-loaded warm endpoint's queued tokens
//! exceed the least-loaded cold endpoint's by more than τ; then pick by the scorer over the
//! candidates (token load with llm-d's lookahead: queued plus this request's uncached tokens).
//! Gate `absolute` (the seeds' simulation, exactly): take the warm endpoint with the least
//! queued tokens; stick if its queue ≤ τ, else go to the endpoint with the least queued tokens.
//! The gate, like llm-d's, ignores the request being scheduled.

use super::{
    all, argmin, decide, score_pick, warm, Ask, Candidate, Decision, Params, Policy, Reason,
};
use crate::config::{GateForm, Scorer};

pub struct StickyUntilSaturated {
    pub p: Params,
}

/// Whether the gate breaks for this warm set.
pub(super) fn gate_breaks(fleet: &[Candidate], warm: &[usize], p: &Params) -> bool {
    let min_tokens =
        |among: &mut dyn Iterator<Item = usize>| among.map(|i| fleet[i].load.tokens).min();
    let Some(best_warm) = min_tokens(&mut warm.iter().copied()) else {
        return false;
    };
    match p.gate {
        GateForm::Absolute => best_warm as f64 > p.tau,
        GateForm::Relative => {
            let mut cold = (0..fleet.len()).filter(|i| !warm.contains(i));
            match min_tokens(&mut cold) {
                Some(best_cold) => best_warm.saturating_sub(best_cold) as f64 > p.tau,
                None => false,
            }
        }
    }
}

impl StickyUntilSaturated {
    fn absolute(&self, ask: &Ask, fleet: &[Candidate], w: &[usize], seq: u64) -> Option<Decision> {
        let queued = |i: usize| match self.p.scorer {
            Scorer::TokenLoad | Scorer::Latency => (fleet[i].load.tokens, 0),
            Scorer::ActiveRequest => (fleet[i].load.requests, fleet[i].load.tokens),
        };
        if let Some(best_warm) = argmin(w, seq, queued) {
            if fleet[best_warm].load.tokens as f64 <= self.p.tau {
                return Some(decide(
                    ask,
                    fleet,
                    best_warm,
                    Reason::Sticky,
                    false,
                    &self.p,
                ));
            }
            let least = argmin(&all(fleet), seq, queued)?;
            return Some(decide(ask, fleet, least, Reason::Spill, true, &self.p));
        }
        let least = argmin(&all(fleet), seq, queued)?;
        Some(decide(ask, fleet, least, Reason::Cold, false, &self.p))
    }

    fn relative(
        &self,
        ask: &Ask,
        fleet: &[Candidate],
        w: Vec<usize>,
        seq: u64,
    ) -> Option<Decision> {
        let (among, reason, broken) = if w.is_empty() {
            (all(fleet), Reason::Cold, false)
        } else if gate_breaks(fleet, &w, &self.p) {
            (all(fleet), Reason::Spill, true)
        } else {
            (w, Reason::Sticky, false)
        };
        let pick = score_pick(ask, fleet, &among, &self.p, seq)?;
        Some(decide(ask, fleet, pick, reason, broken, &self.p))
    }
}

impl Policy for StickyUntilSaturated {
    fn name(&self) -> &'static str {
        "sticky-until-saturated"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        if fleet.is_empty() {
            return None;
        }
        let w = warm(ask, fleet, self.p.affinity_threshold);
        match self.p.gate {
            GateForm::Absolute => self.absolute(ask, fleet, &w, seq),
            GateForm::Relative => self.relative(ask, fleet, w, seq),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{ask, fleet, params};

    fn pick(gate: GateForm, spec: &[(usize, u64)]) -> Decision {
        let chain = [7u64; 10];
        let p = StickyUntilSaturated {
            p: Params { gate, ..params() },
        };
        p.pick(&ask(&chain), &fleet(spec), 0).unwrap()
    }

    #[test]
    fn warm_under_tau_sticks() {
        for gate in [GateForm::Relative, GateForm::Absolute] {
            let d = pick(gate, &[(0, 0), (10, 50_000), (9, 60_000)]);
            assert_eq!(
                (d.endpoint, d.reason, d.tau_broken),
                (1, Reason::Sticky, false),
                "{gate:?}"
            );
        }
    }

    #[test]
    fn saturated_warm_spills_to_least_loaded() {
        for gate in [GateForm::Relative, GateForm::Absolute] {
            let d = pick(gate, &[(0, 20_000), (10, 150_000), (0, 5_000)]);
            assert_eq!(
                (d.endpoint, d.reason, d.tau_broken),
                (2, Reason::Spill, true),
                "{gate:?}"
            );
        }
    }

    #[test]
    fn gates_differ_when_everything_is_loaded() {
        // Warm at 250k, cold at 200k: the gap (50k) is under τ, the absolute load is not.
        let spec = [(10, 250_000), (0, 200_000)];
        assert_eq!(pick(GateForm::Relative, &spec).reason, Reason::Sticky);
        assert_eq!(pick(GateForm::Absolute, &spec).reason, Reason::Spill);
    }

    #[test]
    fn no_warm_endpoint_is_cold() {
        let d = pick(GateForm::Relative, &[(1, 30_000), (0, 10_000), (5, 20_000)]);
        assert_eq!(d.reason, Reason::Cold);
        // Lookahead: cost 10,000 + 10,000 = 20,000 beats 20,000 + 5,000 = 25,000.
        assert_eq!(d.endpoint, 1);
    }

    #[test]
    fn one_endpoint() {
        for gate in [GateForm::Relative, GateForm::Absolute] {
            let d = pick(gate, &[(10, 900_000)]);
            assert_eq!(d.endpoint, 0);
            assert!(d.fallbacks.is_empty());
        }
    }

    #[test]
    fn active_request_scorer_counts_requests() {
        let chain = [7u64; 10];
        let p = StickyUntilSaturated {
            p: Params {
                scorer: Scorer::ActiveRequest,
                ..params()
            },
        };
        let mut f = fleet(&[(10, 50_000), (10, 10_000)]);
        f[0].load.requests = 1;
        f[1].load.requests = 30;
        assert_eq!(p.pick(&ask(&chain), &f, 0).unwrap().endpoint, 0);
    }

    #[test]
    fn weighted_random_takes_a_saturated_request_count() {
        // A server's /metrics can report any finite count; the blend saturates it at
        // u64::MAX, and the weight must not overflow on it.
        use crate::config::Picker;
        let chain = [7u64; 10];
        let p = StickyUntilSaturated {
            p: Params {
                scorer: Scorer::ActiveRequest,
                picker: Picker::WeightedRandom,
                ..params()
            },
        };
        let mut f = fleet(&[(0, 0), (0, 0)]);
        f[0].load.requests = u64::MAX;
        f[1].load.requests = 3;
        for seq in 0..64 {
            assert_eq!(p.pick(&ask(&chain), &f, seq).unwrap().endpoint, 1);
        }
    }
}

//! Round robin: the baseline that ignores caches and load. Every endpoint sees every prefix,
//! so on long shared prompts its hit rate is what the fleet's caches hold by chance.

use super::{decide, Ask, Candidate, Decision, Params, Policy, Reason};

pub struct RoundRobin {
    pub p: Params,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        if fleet.is_empty() {
            return None;
        }
        let pick = (seq % fleet.len() as u64) as usize;
        Some(decide(ask, fleet, pick, Reason::Balanced, false, &self.p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{ask, fleet, params};

    #[test]
    fn cycles_through_every_endpoint() {
        let f = fleet(&[(0, 0), (0, 0), (0, 0)]);
        let chain = [1u64; 4];
        let rr = RoundRobin { p: params() };
        let picks: Vec<usize> = (0..6)
            .map(|s| rr.pick(&ask(&chain), &f, s).unwrap().endpoint)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert!(rr.pick(&ask(&chain), &[], 0).is_none());
    }
}

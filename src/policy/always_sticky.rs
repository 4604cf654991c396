//! Always sticky: the warm endpoint with the least queued tokens, whatever its load; the
//! least-loaded endpoint only when nothing is warm. Maximal reuse, and hot spots: the endpoint
//! owning the most popular prefix becomes a queue.

use super::{all, argmin, decide, warm, Ask, Candidate, Decision, Params, Policy, Reason};

pub struct AlwaysSticky {
    pub p: Params,
}

impl Policy for AlwaysSticky {
    fn name(&self) -> &'static str {
        "always-sticky"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        let w = warm(ask, fleet, self.p.affinity_threshold);
        let (among, reason) = if w.is_empty() {
            (all(fleet), Reason::Cold)
        } else {
            (w, Reason::Sticky)
        };
        let pick = argmin(&among, seq, |i| fleet[i].load.tokens)?;
        Some(decide(ask, fleet, pick, reason, false, &self.p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{ask, fleet, params};

    #[test]
    fn sticks_however_loaded() {
        let f = fleet(&[(10, 0), (10, 9_000_000), (0, 0)]);
        let chain = [1u64; 10];
        let p = AlwaysSticky { p: params() };
        // Both 0 and 1 warm: least loaded warm.
        assert_eq!(p.pick(&ask(&chain), &f, 0).unwrap().endpoint, 0);
        let f = fleet(&[(0, 0), (10, 9_000_000), (0, 0)]);
        let d = p.pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Sticky));
        let f = fleet(&[(0, 50), (0, 10), (0, 70)]);
        let d = p.pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Cold));
    }
}

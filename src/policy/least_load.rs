//! Least load: the endpoint with the fewest uncached tokens in flight, blind to caches. The
//! token-denominated cousin of Envoy's least-request balancer.

use super::{all, argmin, decide, Ask, Candidate, Decision, Params, Policy, Reason};

pub struct LeastLoad {
    pub p: Params,
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least-load"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        let pick = argmin(&all(fleet), seq, |i| fleet[i].load.tokens)?;
        Some(decide(ask, fleet, pick, Reason::Balanced, false, &self.p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{ask, fleet, params};

    #[test]
    fn picks_least_tokens_ignoring_cache() {
        // (matched blocks, queued tokens)
        let f = fleet(&[(10, 5_000), (0, 100), (0, 900)]);
        let chain = [1u64; 10];
        let d = LeastLoad { p: params() }.pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!(d.endpoint, 1);
        assert_eq!(d.reason, Reason::Balanced);
    }
}

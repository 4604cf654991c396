//! tokenaware: sticky until saturated, with four changes that remove its failures in the
//! seeds' simulation (a cliff when τ is low, long queues when τ is high, repeated cold fills
//! while the caches hold the working set, and cold fills when the whole fleet is short of
//! capacity), and one for fleets whose endpoints differ in speed.
//!
//! - τ is bounded by the prompt's own prefill: at least `TAU_MIN_PROMPTS` and at most
//!   `TAU_MAX_PROMPTS` prompts' worth of tokens (at the slowest warm endpoint's learned
//!   speed, when rates are learned). A spill costs a cold fill here and the refill of
//!   whatever it evicts, so it never pays for a queue of a prompt or two; a queue of many
//!   prompts costs more than building a second replica does.
//! - Spills of one prefix go to a stable secondary: the rendezvous winner, keyed by the
//!   deepest block the warm endpoint holds, among the endpoints whose cost is within a twentieth
//!   of τ of the cheapest. Repeated spills build a second warm replica instead of cold-filling a
//!   different endpoint each time (and evicting its warm prefixes).
//! - Cold prefixes first go back to an endpoint that still holds them by the whole-prompt LRU
//!   view (the index counts every block, the questions too, and forgets a prefix the server
//!   still holds). Otherwise to the endpoint where queue, recent work and what the prompt would
//!   evict cost least: evicting a prefix idle for a minute costs little, one used a second ago
//!   comes back as a cold fill. Near-ties go to the rendezvous winner keyed by the first block,
//!   so gateway replicas that share no state still tend to agree.
//! - When every endpoint is past τ, spilling cannot create headroom, it only turns capacity
//!   into cold fills: stay sticky.
//! - With learned rates, a hot prefix warm only on slow endpoints is promoted to a much
//!   faster endpoint with little queued whose eviction victim is far colder, and whose
//!   speed another endpoint reads too (one reading alone is likely noise). Prefixes stay
//!   where their first placement put them, before any rate was learned; the hottest ones
//!   are most of the traffic, and on a half-speed endpoint each of their questions takes
//!   twice as long.
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

/// τ in prompts' worth of tokens: the bounds (see the module comment).
const TAU_MIN_PROMPTS: f64 = 4.0;
const TAU_MAX_PROMPTS: f64 = 8.0;
/// Share of τ within which an endpoint counts as "least loaded" for a spill.
const SPILL_BAND: f64 = 0.05;
/// Seconds of an endpoint's recent work rate a cold placement counts as queue: a cold fill
/// delays everything that arrives behind it.
const WORK_HORIZON_S: u64 = 20;
/// Share of one cold prefill within which cold-placement keys count as tied.
const COLD_BAND: f64 = 0.2;
/// With `cold_choices` (gateway replicas), the share of the cheapest cold key within which
/// the choices count as tied.
const REPLICA_BAND: f64 = 0.25;
/// When other replicas send this gateway's prefixes (replicas dealt round robin), a cold
/// prefix is most often one another replica already placed, by its view of load seconds
/// earlier; a choice by this gateway's view now agrees with it little better than a coin.
/// So the first of its choices takes it unless that one took this many more prefixes
/// lately than the other (each replica counts the prefixes it placed, and dealt round robin
/// each sees nearly all of them, so the counts agree far longer than loads do) ...
const PLACED_SLACK: f64 = 4.0;
/// ... or its cost is more than twice the cheaper one's plus a prompt.
const SHARED_COST_FACTOR: u64 = 2;
/// An evicted prefix last used `idle` seconds ago is asked for again soon with weight
/// `EVICT_HORIZON_S / (EVICT_HORIZON_S + idle)`; a likely refill counts as this share of a
/// prompt's prefill (the refill lands on whichever endpoint is free then).
const EVICT_HORIZON_S: f64 = 10.0;
const EVICT_WEIGHT: f64 = 0.5;
/// Promotion: a target at least this many times faster than every warm endpoint ...
const PROMOTE_SPEEDUP: f64 = 1.5;
/// ... whose eviction victim has been idle this many times longer than the prefix's last
/// gap (plus a second: last use is kept in whole seconds). One gap is a noisy reading of a
/// prefix's rate; at 8x the simulator swapped prefixes back and forth, at 100x it moved only
/// the hottest few, once ...
const PROMOTE_HOTTER: u32 = 100;
/// ... and with at most this share of a prompt queued there.
const PROMOTE_QUEUE: f64 = 0.125;
/// A speed counts for promotion only when another endpoint reads it too, within this share:
/// fleets are built from a few kinds of machine, and a speed one endpoint alone reads is
/// more likely its estimate's transient than a machine of its own kind. Through Envoy, on a
/// fleet of equal endpoints, one read 2.5x the truth for a while and the busiest 0.75x, and
/// promotions piled the hottest prefixes onto two endpoints. Both the target's speed and
/// the warm endpoint's are checked; the cost is a later first promotion while few
/// endpoints of a kind are learned (docs/benchmarks.md).
const PEER_BAND: f64 = 0.15;

impl Tokenaware {
    /// This request's τ: the configured one within the prompt bounds. The bounds count the
    /// prompt's prefill on the slowest warm endpoint: with learned rates, load is in
    /// reference tokens, and a prompt there costs `1 / speed` of them per token.
    fn tau(&self, ask: &Ask, fleet: &[Candidate], w: &[usize]) -> f64 {
        let slowest = w
            .iter()
            .map(|&i| fleet[i].speed())
            .fold(f64::INFINITY, f64::min);
        let slowest = if slowest.is_finite() { slowest } else { 1.0 };
        let t = ask.tokens.max(1) as f64 / slowest;
        self.p.tau.clamp(TAU_MIN_PROMPTS * t, TAU_MAX_PROMPTS * t)
    }

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

    /// An endpoint under τ that still holds the prompt by the whole-prompt LRU view, the
    /// cheapest if several. Only when the index matches none of the prompt anywhere: the
    /// records know prompts by their first block, which prompts that share a system prompt
    /// but not the rest also share (they would all be sent to its holder).
    fn still_held(&self, ask: &Ask, fleet: &[Candidate]) -> Option<usize> {
        if fleet.iter().any(|c| c.matched_blocks > 0) {
            return None;
        }
        // Prompts of this size the endpoint's cache holds.
        let fit = |c: &Candidate| c.capacity / ask.chain.len().max(1) as u64;
        (0..fleet.len())
            .filter(|&i| {
                let c = &fleet[i];
                c.rank.is_some_and(|r| u64::from(r) < fit(c)) && c.load.tokens as f64 <= self.p.tau
            })
            .min_by_key(|&i| ask.cost(&fleet[i]))
    }

    /// What placing the prompt costs in the cache, in tokens: nothing while it fits in the
    /// endpoint's free room; else the likely refill of the prefix it pushes out.
    fn eviction(ask: &Ask, c: &Candidate) -> u64 {
        let room = c.capacity.saturating_sub(c.held);
        if c.capacity == 0 || ask.chain.len() as u64 <= room {
            return 0;
        }
        let Some(idle) = c.victim_idle_s else {
            return 0;
        };
        let soon = EVICT_HORIZON_S / (EVICT_HORIZON_S + f64::from(idle));
        (ask.tokens as f64 * soon * EVICT_WEIGHT) as u64
    }

    /// The endpoints a cold prefix may go to: all, or with `cold_choices` the first few by
    /// rendezvous on its first block. Gateway replicas share no tables, and each places a
    /// prefix it has not seen by its own view of load; limited to the same few, they
    /// mostly agree, and a prefix is not cold-filled once per replica.
    fn cold_pool(&self, head: u64, fleet: &[Candidate]) -> Vec<usize> {
        let mut pool = all(fleet);
        let n = self.p.cold_choices;
        if n > 0 && n < pool.len() {
            pool.sort_by_key(|&i| std::cmp::Reverse(rendezvous(head, fleet[i].id)));
            pool.truncate(n);
        }
        pool
    }

    /// The first of `pool` by rendezvous on `head` that has placed at most `PLACED_SLACK`
    /// more prefixes lately than the pool's fewest, and that `fits`.
    fn first_not_ahead(
        fleet: &[Candidate],
        pool: &[usize],
        head: u64,
        fits: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let fewest = pool
            .iter()
            .map(|&i| fleet[i].placed)
            .fold(f64::INFINITY, f64::min);
        let mut order = pool.to_vec();
        order.sort_by_key(|&i| std::cmp::Reverse(rendezvous(head, fleet[i].id)));
        order
            .into_iter()
            .find(|&i| fleet[i].placed <= fewest + PLACED_SLACK && fits(i))
    }

    /// Cold placement trades queue and recent work against what the prompt would evict.
    fn cold(&self, ask: &Ask, fleet: &[Candidate]) -> Option<usize> {
        if let Some(i) = self.still_held(ask, fleet) {
            return Some(i);
        }
        let head = ask.chain.first().copied().unwrap_or(0);
        let pool = self.cold_pool(head, fleet);
        // Recent work is real tokens: on a slower endpoint it is more time (`speed` is 1
        // unless rates are learned). The prompt's own prefill is counted in tokens, not
        // time: every endpoint's cache is the same size, and sending every cold prompt to
        // the fast ones filled their caches and evicted warm prefixes there (through
        // Envoy, with half the fleet at half speed, 40-50 % more cold placements).
        let key = |i: usize| {
            let c = &fleet[i];
            let work = (c.work_per_s as f64 * WORK_HORIZON_S as f64 / c.speed()) as u64;
            c.load
                .tokens
                .saturating_add(ask.uncached(c))
                .saturating_add(work)
                .saturating_add(Self::eviction(ask, c))
        };
        let min = pool.iter().map(|&i| key(i)).min().unwrap_or(0);
        let mut slack = (ask.tokens as f64 * COLD_BAND) as u64;
        if self.p.cold_choices > 0 {
            // Replicas each count only their own requests: differences within this share of
            // the cost are each one's noise, so they go to the rendezvous order both share.
            slack = slack.max((min as f64 * REPLICA_BAND) as u64);
        }
        // An endpoint that held this prefix recently may still have it: going back may cost
        // half a prefill more than the best fresh choice.
        let recalled = pool
            .iter()
            .copied()
            .filter(|&i| {
                fleet[i].recalled
                    && key(i) <= min.saturating_add(slack).saturating_add(ask.tokens / 2)
            })
            .min_by_key(|&i| key(i));
        if recalled.is_some() {
            return recalled;
        }
        if self.p.cold_choices > 0 && self.p.shared_prefixes {
            let limit = min
                .saturating_mul(SHARED_COST_FACTOR)
                .saturating_add(ask.tokens);
            if let Some(i) = Self::first_not_ahead(fleet, &pool, head, |i| key(i) <= limit) {
                return Some(i);
            }
        }
        let near: Vec<usize> = pool
            .iter()
            .copied()
            .filter(|&i| key(i) <= min.saturating_add(slack))
            .collect();
        Self::rendezvous_pick(fleet, &near, head)
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

    /// A hot prefix whose only warm endpoints are slow, copied to a much faster endpoint
    /// with little queued whose eviction victim is far colder (or with room). Rates learned
    /// after a prefix was first placed do not move it otherwise: every later request finds
    /// it warm where it is. Hotness is read from last use: the prefix's previous request
    /// there against the victim's; once the fast endpoints hold the hottest prefixes, their
    /// victims are hot too and promotions stop.
    fn promote(&self, ask: &Ask, fleet: &[Candidate], w: &[usize], pick: usize) -> Option<usize> {
        let idle = fleet.get(pick)?.idle_s?;
        let fastest_warm = w.iter().map(|&i| fleet[i].speed()).fold(0.0, f64::max);
        let queue = ask.tokens as f64 * PROMOTE_QUEUE;
        // Speed first: without learned rates no endpoint passes it, and the sticky
        // decision pays for nothing else.
        (0..fleet.len())
            .filter(|&i| fleet[i].speed() >= PROMOTE_SPEEDUP * fastest_warm)
            .filter(|&i| Self::corroborated(fleet, fleet[i].speed()))
            .filter(|_| Self::corroborated(fleet, fastest_warm))
            .filter(|i| !w.contains(i))
            .filter(|&i| fleet[i].load.tokens as f64 <= queue)
            .filter(|&i| Self::colder_victim(ask, &fleet[i], idle))
            .min_by_key(|&i| ask.cost(&fleet[i]))
    }

    /// Whether at least two endpoints read `speed`, within `PEER_BAND`.
    fn corroborated(fleet: &[Candidate], speed: f64) -> bool {
        let near = |c: &&Candidate| (c.speed() / speed - 1.0).abs() <= PEER_BAND;
        fleet.iter().filter(near).count() >= 2
    }

    /// Whether the prompt fits in the endpoint's free room, or what it would evict has been
    /// idle `PROMOTE_HOTTER` times longer than the prefix's last gap `idle`.
    fn colder_victim(ask: &Ask, c: &Candidate, idle: u32) -> bool {
        match c.victim_idle_s {
            Some(v) => v >= PROMOTE_HOTTER.saturating_mul(idle.saturating_add(1)),
            None => c.held.saturating_add(ask.chain.len() as u64) <= c.capacity,
        }
    }

    fn saturated(&self, fleet: &[Candidate]) -> bool {
        fleet.iter().all(|c| c.load.tokens as f64 > self.p.tau)
    }

    fn pick_at_tau(
        &self,
        ask: &Ask,
        fleet: &[Candidate],
        w: Vec<usize>,
        seq: u64,
    ) -> Option<Decision> {
        if fleet.is_empty() {
            return None;
        }
        if w.is_empty() {
            let pick = self.cold(ask, fleet)?;
            return Some(decide(ask, fleet, pick, Reason::Cold, false, &self.p));
        }
        if !gate_breaks(fleet, &w, &self.p) {
            let pick = score_pick(ask, fleet, &w, &self.p, seq)?;
            if let Some(fast) = self.promote(ask, fleet, &w, pick) {
                return Some(decide(ask, fleet, fast, Reason::Promote, false, &self.p));
            }
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

impl Policy for Tokenaware {
    fn name(&self) -> &'static str {
        "tokenaware"
    }

    fn pick(&self, ask: &Ask, fleet: &[Candidate], seq: u64) -> Option<Decision> {
        let w = warm(ask, fleet, self.p.affinity_threshold);
        let p = Params {
            tau: self.tau(ask, fleet, &w),
            ..self.p
        };
        Tokenaware { p }.pick_at_tau(ask, fleet, w, seq)
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
        // Every cache full: the endpoint whose placement would evict a prefix used a second
        // ago is avoided; the others' victims have been idle for ten minutes.
        for (i, c) in f.iter_mut().enumerate() {
            c.held = c.capacity;
            c.victim_idle_s = Some(if i == first.endpoint { 1 } else { 600 });
        }
        assert_ne!(
            ta().pick(&ask(&chain), &f, 0).unwrap().endpoint,
            first.endpoint
        );
        // With room left there, nothing is evicted and it is the first choice again.
        f[first.endpoint].held = 0;
        assert_eq!(
            ta().pick(&ask(&chain), &f, 0).unwrap().endpoint,
            first.endpoint
        );
    }

    #[test]
    fn a_cold_prompt_does_not_evict_on_a_fast_endpoint_to_save_its_own_prefill() {
        let chain: Vec<u64> = (80..90).collect();
        // Both idle. Endpoint 0 is learned 2x fast, its cache full with a prefix used a
        // second ago; endpoint 1 is at half speed with room.
        let mut f = fleet(&[(0, 0), (0, 0)]);
        f[0].speed = 2.0;
        f[0].held = f[0].capacity;
        f[0].victim_idle_s = Some(1);
        f[1].speed = 0.5;
        let d = ta().pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Cold));
        // With room on both, queue decides: the slow one's queued tokens are more time.
        f[0].held = 0;
        f[1].load.tokens = 8_000;
        assert_eq!(ta().pick(&ask(&chain), &f, 0).unwrap().endpoint, 0);
    }

    #[test]
    fn a_prefix_the_index_forgot_goes_back_where_it_is_still_held() {
        let chain: Vec<u64> = (60..70).collect();
        let mut f = fleet(&[(0, 0), (0, 30_000), (0, 0), (0, 0)]);
        // Endpoint 1 used this prefix third most recently and holds four such prompts.
        f[1].rank = Some(2);
        f[1].capacity = 40;
        let d = ta().pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Cold));
        // Another endpoint holds the prompt's first blocks (a shared system prompt, say): the
        // records cannot tell this prompt from others that start the same way.
        f[2].matched_blocks = 3;
        assert_ne!(ta().pick(&ask(&chain), &f, 0).unwrap().endpoint, 1);
        f[2].matched_blocks = 0;
        // Fifth most recent: pushed out by now, placed like any cold prefix.
        f[1].rank = Some(4);
        assert_ne!(ta().pick(&ask(&chain), &f, 0).unwrap().endpoint, 1);
        // Still held but past τ: not worth the queue.
        f[1].rank = Some(0);
        f[1].load.tokens = 90_000;
        assert_ne!(ta().pick(&ask(&chain), &f, 0).unwrap().endpoint, 1);
    }

    #[test]
    fn limited_cold_choices_keep_replicas_on_the_same_few_endpoints() {
        let two = Tokenaware {
            p: Params {
                cold_choices: 2,
                ..params()
            },
        };
        // Two gateways that see different loads (each knows only its own requests) place
        // each cold prompt within the same two endpoints; with every choice open they
        // spread over more.
        let (mut limited, mut open) = (Vec::new(), Vec::new());
        for p in 0..40u64 {
            let chain: Vec<u64> = (p * 100..p * 100 + 10).collect();
            let a = fleet(&[(0, 0), (0, 5_000), (0, 9_000), (0, 2_000), (0, 7_000)]);
            let b = fleet(&[(0, 8_000), (0, 1_000), (0, 3_000), (0, 6_000), (0, 0)]);
            let pick = |t: &Tokenaware, f: &[Candidate]| t.pick(&ask(&chain), f, 0).unwrap();
            let (la, lb) = (pick(&two, &a), pick(&two, &b));
            assert_eq!((la.reason, lb.reason), (Reason::Cold, Reason::Cold));
            let pool = two.cold_pool(chain[0], &a);
            assert_eq!(pool.len(), 2);
            assert!(pool.contains(&la.endpoint) && pool.contains(&lb.endpoint));
            limited.push(la.endpoint == lb.endpoint);
            open.push(pick(&ta(), &a).endpoint == pick(&ta(), &b).endpoint);
        }
        let agree = |v: &[bool]| v.iter().filter(|&&x| x).count();
        assert!(agree(&limited) > agree(&open), "{limited:?} vs {open:?}");
    }

    #[test]
    fn replicas_that_share_prefixes_lean_to_the_first_choice() {
        let two = |shared| Tokenaware {
            p: Params {
                cold_choices: 2,
                shared_prefixes: shared,
                ..params()
            },
        };
        // Two gateways' views of the same fleet, each endpoint's queue within 2x of the
        // others' but ranked differently: by their own view they often pick apart; leaning
        // to the first choice, they agree on every prompt.
        let a = fleet(&[(0, 4_000), (0, 12_000), (0, 6_000), (0, 10_000), (0, 8_000)]);
        let b = fleet(&[(0, 12_000), (0, 4_000), (0, 10_000), (0, 6_000), (0, 8_000)]);
        let (mut shared, mut own) = (0, 0);
        for p in 0..40u64 {
            let chain: Vec<u64> = (p * 100..p * 100 + 10).collect();
            let pick = |t: &Tokenaware, f: &[Candidate]| t.pick(&ask(&chain), f, 0).unwrap();
            let (sa, sb) = (pick(&two(true), &a), pick(&two(true), &b));
            assert_eq!((sa.reason, sb.reason), (Reason::Cold, Reason::Cold));
            shared += usize::from(sa.endpoint == sb.endpoint);
            own += usize::from(pick(&two(false), &a).endpoint == pick(&two(false), &b).endpoint);
        }
        assert_eq!(shared, 40);
        assert!(own < 30, "{own} of 40 agree by their own views");
        // A first choice that placed more than `PLACED_SLACK` prefixes more than the other
        // lately is passed over: the shared order bends to balance.
        let chain: Vec<u64> = (0..10).collect();
        let pool = two(true).cold_pool(chain[0], &a);
        let mut f = a.clone();
        let pick = |f: &[Candidate]| two(true).pick(&ask(&chain), f, 0).unwrap().endpoint;
        assert_eq!(pick(&f), pool[0]);
        f[pool[1]].placed = 1.0;
        f[pool[0]].placed = 1.0 + PLACED_SLACK;
        assert_eq!(pick(&f), pool[0]);
        f[pool[0]].placed = 1.5 + PLACED_SLACK;
        assert_eq!(pick(&f), pool[1]);
        // Nor is a first choice taken whose cost is more than twice the other's plus a
        // prompt (10,000 tokens here).
        let mut f = a.clone();
        let other = f[pool[1]].load.tokens + 10_000;
        f[pool[0]].load.tokens = 2 * other;
        assert_eq!(pick(&f), pool[0]);
        f[pool[0]].load.tokens = 2 * other + 1;
        assert_eq!(pick(&f), pool[1]);
    }

    /// A hot prefix (last sent a second ago) warm only on a half-speed endpoint; endpoints 1
    /// and 2 are learned 2x faster with full caches, 1's victim idle ten minutes, 2's ten
    /// seconds; endpoint 3 is half-speed too, and busy.
    fn promotion_fleet() -> Vec<Candidate> {
        let mut f = fleet(&[(10, 3_000), (0, 0), (0, 0), (0, 50_000)]);
        f[0].speed = 0.5;
        f[0].idle_s = Some(1);
        f[3].speed = 0.5;
        for (c, idle) in f[1..3].iter_mut().zip([600, 10]) {
            c.speed = 1.0;
            c.held = c.capacity;
            c.victim_idle_s = Some(idle);
        }
        f
    }

    #[test]
    fn a_hot_prefix_on_a_slow_endpoint_moves_to_a_fast_one_with_a_cold_victim() {
        let chain = [3u64; 10];
        let d = ta().pick(&ask(&chain), &promotion_fleet(), 0).unwrap();
        assert_eq!((d.endpoint, d.reason, d.hit), (1, Reason::Promote, 0.0));
        // Once the fast endpoint also holds it, the two are warm and the cheaper one serves.
        let mut f = promotion_fleet();
        f[1].matched_blocks = 10;
        let d = ta().pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Sticky));
    }

    #[test]
    fn promotion_needs_a_much_faster_idle_endpoint_and_a_far_colder_victim() {
        let chain = [3u64; 10];
        let sticky = |f: &[Candidate]| {
            let d = ta().pick(&ask(&chain), f, 0).unwrap();
            (d.endpoint, d.reason)
        };
        // The victim was used 150 s ago: not a hundred times the prefix's 2 s.
        let mut f = promotion_fleet();
        f[1].victim_idle_s = Some(150);
        assert_eq!(sticky(&f), (0, Reason::Sticky));
        // A prompt's eighth queued there already.
        let mut f = promotion_fleet();
        f[1].load.tokens = 1_500;
        assert_eq!(sticky(&f), (0, Reason::Sticky));
        // Under 1.5x faster than the warm endpoint (rates the same within noise do nothing).
        let mut f = promotion_fleet();
        f[0].speed = 0.8;
        assert_eq!(sticky(&f), (0, Reason::Sticky));
        // The prefix's own last use there is unknown: no sign it is hot.
        let mut f = promotion_fleet();
        f[0].idle_s = None;
        assert_eq!(sticky(&f), (0, Reason::Sticky));
        // With room instead of a victim, nothing is evicted: it moves.
        let mut f = promotion_fleet();
        f[1].victim_idle_s = Some(150);
        f[2].victim_idle_s = None;
        f[2].held = 0;
        assert_eq!(sticky(&f), (2, Reason::Promote));
        // Nothing learned (every speed 1): never.
        let mut f = promotion_fleet();
        f.iter_mut().for_each(|c| c.speed = 1.0);
        assert_eq!(sticky(&f), (0, Reason::Sticky));
    }

    #[test]
    fn promotion_trusts_only_speeds_two_endpoints_read() {
        let chain = [3u64; 10];
        let pick = |f: &[Candidate]| {
            let d = ta().pick(&ask(&chain), f, 0).unwrap();
            (d.endpoint, d.reason)
        };
        // Endpoint 2 reads 1.25 (its victim is hot), so endpoint 1, the one with a cold
        // victim, reads a speed no other endpoint does.
        let mut f = promotion_fleet();
        f[2].speed = 1.25;
        f[2].victim_idle_s = Some(10);
        assert_eq!(pick(&f), (0, Reason::Sticky));
        // Within a sixth of each other, the two fast readings are one kind of machine.
        f[2].speed = 1.1;
        assert_eq!(pick(&f), (1, Reason::Promote));
        // The warm endpoint alone reads slow (endpoint 3 as fast as the rest).
        let mut f = promotion_fleet();
        f[3].speed = 1.0;
        assert_eq!(pick(&f), (0, Reason::Sticky));
    }

    #[test]
    fn tau_is_bounded_by_the_prompt() {
        // A 10,000-token prompt: τ counts as at least 40,000 and at most 80,000 tokens.
        let chain = [3u64; 10];
        let with_tau = |tau: f64| Tokenaware {
            p: Params { tau, ..params() },
        };
        let f = fleet(&[(0, 0), (10, 30_000), (0, 0)]);
        let d = with_tau(5_000.0).pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Sticky));
        let f = fleet(&[(0, 0), (10, 90_000), (0, 0)]);
        let d = with_tau(10_000_000.0).pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.reason, d.tau_broken), (Reason::Spill, true));
        let d = with_tau(100_000.0).pick(&ask(&chain), &fleet(&[(10, 70_000)]), 0);
        assert_eq!(d.unwrap().reason, Reason::Sticky);
    }

    #[test]
    fn tau_bounds_count_the_prompt_at_the_warm_endpoints_speed() {
        // A 10,000-token prompt warm on endpoint 1, whose queue is 60,000 reference tokens.
        let chain = [3u64; 10];
        let low_tau = Tokenaware {
            p: Params {
                tau: 5_000.0,
                ..params()
            },
        };
        let mut f = fleet(&[(0, 0), (10, 60_000), (0, 0)]);
        // At reference speed that is six prompts: past the lower bound of four, so it spills.
        let d = low_tau.pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!(d.reason, Reason::Spill);
        // Learned at half speed, the prompt costs 20,000 there: three prompts, under four.
        f[1].speed = 0.5;
        let d = low_tau.pick(&ask(&chain), &f, 0).unwrap();
        assert_eq!((d.endpoint, d.reason), (1, Reason::Sticky));
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

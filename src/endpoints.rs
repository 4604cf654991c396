//! The endpoint table: every model-server endpoint the router may pick, with a stable slot
//! number (the key of its index and ledger entries), health, capacity and the last scraped
//! metrics. Built from the static config list or from discovery; reconciled, never rebuilt,
//! so an endpoint keeps its slot (and its warm index entries) while it stays.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::ledger::Scraped;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    /// `ip:port`.
    pub address: String,
    pub slot: u16,
    pub healthy: bool,
    /// KV capacity in index blocks.
    pub capacity_blocks: u64,
    /// Last scrape (waiting, running, the share of the KV pool running requests hold) and
    /// when it was taken.
    #[serde(default)]
    pub waiting: Option<f64>,
    #[serde(default)]
    pub running: Option<f64>,
    #[serde(default)]
    pub kv_usage: Option<f64>,
    #[serde(default)]
    pub scraped_at_ms: u64,
    /// Uncached prompt tokens per second the server itself counts (see `ServedWork`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_work_per_s: Option<u64>,
}

impl Endpoint {
    /// Identity for rendezvous hashing: the address, so every gateway agrees.
    pub fn id(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.address.as_bytes())
    }

    /// The scrape, if it is younger than `stale_ms`.
    pub fn scraped(&self, now_ms: u64, stale_ms: u64) -> Option<Scraped> {
        // A scrape from the future: the wall clock stepped back since; its age is unknown.
        let ahead = self.scraped_at_ms > now_ms.saturating_add(stale_ms);
        if self.scraped_at_ms == 0 || ahead || now_ms.saturating_sub(self.scraped_at_ms) > stale_ms
        {
            return None;
        }
        Some(Scraped {
            waiting: self.waiting.unwrap_or(0.0),
            running: self.running.unwrap_or(0.0),
            kv_usage: self.kv_usage.unwrap_or(0.0),
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointTable {
    pub endpoints: Vec<Endpoint>,
    /// Requests the model servers count that this gateway did not send.
    #[serde(default)]
    pub foreign: ForeignLoad,
}

/// Requests the model servers report (waiting + running) that this gateway's ledger does not
/// hold: another gateway replica in front of the same fleet, or traffic sent past the
/// gateway. A lone gateway reads about none: a server counts a request only after it
/// arrives, and drops it before its answer ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ForeignLoad {
    /// Moving means over polls of (the server's requests less ours, the server's requests)
    /// per endpoint. The difference keeps its sign: a scrape and a ledger read a moment apart
    /// differ either way by chance, and only another sender moves its mean up.
    foreign: f64,
    total: f64,
    /// Whether another sender is seen (with hysteresis, so it does not flap).
    pub seen: bool,
}

impl ForeignLoad {
    /// A round of polls (one answer per endpoint) moves the means about this part of the way:
    /// they span some eight rounds, so one scrape that caught a request on its way out
    /// decides nothing.
    const ROUND_WEIGHT: f64 = 1.0 / 8.0;
    /// Another sender is seen from this share of the requests on, and unseen below the lower.
    const SEEN_FROM: f64 = 0.25;
    const UNSEEN_BELOW: f64 = 0.10;
    /// Too few requests on the servers (per endpoint) to tell.
    const MIN_TOTAL: f64 = 1.0;

    /// One endpoint's poll, of `endpoints`: the requests its server counts and the ones our
    /// ledger holds.
    pub fn observe(&mut self, server_requests: f64, ours: u64, endpoints: usize) {
        let server = if server_requests.is_finite() {
            server_requests.max(0.0)
        } else {
            0.0
        };
        let w = Self::ROUND_WEIGHT / endpoints.max(1) as f64;
        let foreign = server - ours as f64;
        self.foreign += (foreign - self.foreign) * w;
        self.total += (server - self.total) * w;
        let share = self.share();
        if share >= Self::SEEN_FROM {
            self.seen = true;
        } else if share < Self::UNSEEN_BELOW {
            self.seen = false;
        }
    }

    /// The share of the servers' requests this gateway did not send (0 while they are idle).
    pub fn share(&self) -> f64 {
        if self.total < Self::MIN_TOTAL {
            return 0.0;
        }
        (self.foreign / self.total).clamp(0.0, 1.0)
    }
}

/// The prompt tokens a server prefilled (`prefix_cache_queries - prefix_cache_hits`: what its
/// cache did not hold) per second, from the counters it exports. Every sender's work is in
/// them, and gateway replicas read the same counters, where each one's ledger counts only
/// its own. The rate is over one to two windows, as the ledger's own is: until a window has
/// passed, what was done so far is divided by a whole window. A rate over the few seconds
/// since the first scrape, times the placement's 20 s horizon, made each cold fill another
/// gateway sent weigh ten of this one's own (which the ledger spreads over a window).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServedWork {
    /// (time ms, prefilled tokens) at the start of the current window and of the one before.
    start: Option<(u64, f64)>,
    before: Option<(u64, f64)>,
    /// The last query counter read: a drop means the server restarted.
    queries: f64,
}

impl ServedWork {
    const WINDOW_MS: u64 = 10_000;

    /// One scrape's counters at `now_ms`. Returns whether the server restarted (its
    /// query counter went back), and the rate when one can be told.
    pub fn observe(&mut self, now_ms: u64, queries: f64, hits: Option<f64>) -> (bool, Option<u64>) {
        if !queries.is_finite() {
            return (false, None);
        }
        let restarted = queries < self.queries;
        if restarted {
            *self = ServedWork::default();
        }
        self.queries = queries;
        let Some(hits) = hits.filter(|h| h.is_finite()) else {
            return (restarted, None);
        };
        let done = (queries - hits).max(0.0);
        match self.start {
            Some((t, _)) if now_ms.saturating_sub(t) < Self::WINDOW_MS => {}
            _ => {
                self.before = self.start;
                self.start = Some((now_ms, done));
            }
        }
        let rate = self.before.or(self.start).and_then(|(t, v)| {
            let span = now_ms.saturating_sub(t);
            if span == 0 {
                return None;
            }
            let span = span.max(Self::WINDOW_MS);
            Some(((done - v).max(0.0) * 1000.0 / span as f64) as u64)
        });
        (restarted, rate)
    }
}

/// What a reconcile changed: slots whose index and ledger entries must be cleared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub removed: Vec<u16>,
    pub added: Vec<u16>,
    /// Hosts found but not in the table after: it was full.
    pub dropped: usize,
}

impl EndpointTable {
    /// The static list from the config, slots in order.
    pub fn from_config(cfg: &Config) -> EndpointTable {
        let endpoints = cfg
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| Endpoint {
                address: e.address.clone(),
                slot: i as u16,
                healthy: true,
                capacity_blocks: cfg
                    .capacity_blocks(e.kv_capacity_tokens.unwrap_or(cfg.kv_capacity_tokens)),
                waiting: None,
                kv_usage: None,
                running: None,
                scraped_at_ms: 0,
                served_work_per_s: None,
            })
            .collect();
        EndpointTable {
            endpoints,
            foreign: ForeignLoad::default(),
        }
    }

    pub fn get(&self, address: &str) -> Option<&Endpoint> {
        self.endpoints.iter().find(|e| e.address == address)
    }

    pub fn get_mut(&mut self, address: &str) -> Option<&mut Endpoint> {
        self.endpoints.iter_mut().find(|e| e.address == address)
    }

    /// Makes the table match a discovered `(address, healthy)` list: known endpoints keep
    /// their slot, new ones take the lowest free slot (up to `max`), missing ones go. With
    /// more hosts than `max`, a healthy newcomer takes the slot of an endpoint that is not
    /// (a rollout's surge: the old pods draining must not keep the new ones out); what is
    /// left out is counted in `dropped`.
    pub fn reconcile(
        &mut self,
        found: &[(String, bool)],
        max: usize,
        capacity_blocks: u64,
    ) -> Changes {
        // Sets and maps, not scans: a discovery of thousands of hosts stays linear-ish (it
        // runs in a tick, inside a CAS retry loop).
        let mut changes = Changes::default();
        let wanted: BTreeSet<&str> = found.iter().map(|(a, _)| a.as_str()).collect();
        self.endpoints.retain(|e| {
            let keep = wanted.contains(e.address.as_str());
            if !keep {
                changes.removed.push(e.slot);
            }
            keep
        });
        let mut at = self.positions();
        let mut used: BTreeSet<u16> = self.endpoints.iter().map(|e| e.slot).collect();
        // Named twice, a host has its later entry's health (as a kept one has).
        let mut newcomers: Vec<(&String, bool)> = Vec::new();
        let mut listed: BTreeMap<&str, usize> = BTreeMap::new();
        for (address, healthy) in found {
            if let Some(e) = at.get(address).and_then(|&i| self.endpoints.get_mut(i)) {
                e.healthy = *healthy;
            } else if let Some(n) = listed
                .get(address.as_str())
                .and_then(|&i| newcomers.get_mut(i))
            {
                n.1 = *healthy;
            } else {
                listed.insert(address, newcomers.len());
                newcomers.push((address, *healthy));
            }
        }
        if self.endpoints.len() + newcomers.len() > max {
            // Not all fit: healthy newcomers first, as they may take an unhealthy one's slot.
            newcomers.sort_by_key(|(_, healthy)| !healthy);
        }
        // New endpoints take the lowest free slots in turn, so the search only moves up.
        let mut next_free: u16 = 0;
        for (address, healthy) in newcomers {
            let slot = if self.endpoints.len() < max {
                while used.contains(&next_free) && next_free < u16::MAX {
                    next_free += 1;
                }
                used.insert(next_free);
                next_free
            } else {
                let unhealthy = self.endpoints.iter().position(|e| !e.healthy);
                let Some(i) = unhealthy.filter(|_| healthy) else {
                    changes.dropped += 1;
                    continue;
                };
                let gone = self.endpoints.remove(i);
                at = self.positions();
                changes.removed.push(gone.slot);
                changes.dropped += 1;
                gone.slot
            };
            at.insert(address.clone(), self.endpoints.len());
            changes.added.push(slot);
            self.endpoints.push(Endpoint {
                address: address.clone(),
                slot,
                healthy,
                capacity_blocks,
                waiting: None,
                kv_usage: None,
                running: None,
                scraped_at_ms: 0,
                served_work_per_s: None,
            });
        }
        changes
    }

    /// Each endpoint's place in `endpoints`, by address.
    fn positions(&self) -> BTreeMap<String, usize> {
        let places = self.endpoints.iter().enumerate();
        places.map(|(i, e)| (e.address.clone(), i)).collect()
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_json(bytes: &[u8]) -> Option<EndpointTable> {
        serde_json::from_slice(bytes).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(list: &[(&str, bool)]) -> Vec<(String, bool)> {
        list.iter().map(|(a, h)| (a.to_string(), *h)).collect()
    }

    #[test]
    fn reconcile_keeps_slots() {
        let mut t = EndpointTable::default();
        let c = t.reconcile(
            &found(&[("10.0.0.1:80", true), ("10.0.0.2:80", true)]),
            8,
            100,
        );
        assert_eq!(c.added, vec![0, 1]);
        let c = t.reconcile(
            &found(&[("10.0.0.2:80", false), ("10.0.0.3:80", true)]),
            8,
            100,
        );
        assert_eq!(c.removed, vec![0]);
        assert_eq!(c.added, vec![0]);
        assert_eq!(t.get("10.0.0.2:80").unwrap().slot, 1);
        assert!(!t.get("10.0.0.2:80").unwrap().healthy);
        assert_eq!(t.get("10.0.0.3:80").unwrap().slot, 0);
        let c = t.reconcile(
            &found(&[("a:1", true), ("b:1", true), ("c:1", true)]),
            2,
            100,
        );
        assert_eq!(t.endpoints.len(), 2);
        assert_eq!(c.removed.len(), 2);
    }

    #[test]
    fn a_full_table_gives_an_unhealthy_endpoints_slot_to_a_healthy_newcomer() {
        let mut t = EndpointTable::default();
        t.reconcile(&found(&[("old-a:80", true), ("old-b:80", true)]), 2, 100);
        // A rollout's surge: both old pods draining, two new ones ready, one not yet.
        let surge = found(&[
            ("old-a:80", false),
            ("new-c:80", false),
            ("old-b:80", false),
            ("new-d:80", true),
            ("new-e:80", true),
        ]);
        let c = t.reconcile(&surge, 2, 100);
        let mut held: Vec<(&str, u16, bool)> = t
            .endpoints
            .iter()
            .map(|e| (e.address.as_str(), e.slot, e.healthy))
            .collect();
        held.sort();
        assert_eq!(held, [("new-d:80", 0, true), ("new-e:80", 1, true)]);
        // Left out: the two old pods and the new one not ready.
        assert_eq!((c.removed, c.added, c.dropped), (vec![0, 1], vec![0, 1], 3));
        // Full of healthy endpoints: a newcomer is left out, healthy or not, and counted.
        let c = t.reconcile(
            &found(&[("new-d:80", true), ("new-e:80", true), ("f:80", true)]),
            2,
            100,
        );
        assert_eq!((c.removed.len(), c.added.len(), c.dropped), (0, 0, 1));
    }

    #[test]
    fn a_large_discovery_fills_the_lowest_free_slots_once_each() {
        let mut t = EndpointTable::default();
        let hosts: Vec<(String, bool)> = (0..4_096)
            .map(|i| (format!("10.0.{}.{}:80", i / 256, i % 256), true))
            .collect();
        let c = t.reconcile(&hosts, 4_096, 100);
        assert_eq!(c.added, (0..4_096).collect::<Vec<u16>>());
        // Every tenth host leaves and new ones come (one of them named twice): they take the
        // freed slots, lowest first, and the named-twice one takes one.
        let mut next: Vec<(String, bool)> = hosts
            .iter()
            .filter(|(a, _)| !a.ends_with("0:80"))
            .cloned()
            .collect();
        let freed: Vec<u16> = t
            .endpoints
            .iter()
            .filter(|e| e.address.ends_with("0:80"))
            .map(|e| e.slot)
            .collect();
        next.extend((0..3).map(|i| (format!("new-{i}:80"), true)));
        next.push(("new-0:80".into(), false));
        let c = t.reconcile(&next, 4_096, 100);
        assert_eq!(c.removed, freed);
        assert_eq!(c.added, freed[..3].to_vec());
        assert!(
            !t.get("new-0:80").unwrap().healthy,
            "the later entry wins, as for a kept one"
        );
        let slots: BTreeSet<u16> = t.endpoints.iter().map(|e| e.slot).collect();
        assert_eq!(slots.len(), t.endpoints.len());
    }

    #[test]
    fn served_work_is_a_rate_over_one_to_two_windows() {
        let mut w = ServedWork::default();
        // Queries less hits: 0, then 1,000 more prefilled tokens a second.
        assert_eq!(w.observe(0, 0.0, Some(0.0)), (false, None));
        // Within the first window, what was done so far spread over a whole window: a
        // burst reads as a window's worth of work, not as a rate over its few seconds.
        assert_eq!(w.observe(1_000, 1_500.0, Some(500.0)), (false, Some(100)));
        assert_eq!(w.observe(4_000, 6_000.0, Some(2_000.0)), (false, Some(400)));
        // Past a window the rate spans from the window before's start: a burst moves it
        // by its share of the span, and it is forgotten two windows on.
        assert_eq!(
            w.observe(10_000, 12_000.0, Some(2_000.0)),
            (false, Some(1_000))
        );
        assert_eq!(
            w.observe(15_000, 57_000.0, Some(2_000.0)),
            (false, Some(3_666))
        );
        assert_eq!(
            w.observe(20_000, 62_000.0, Some(2_000.0)),
            (false, Some(5_000))
        );
        assert_eq!(
            w.observe(30_000, 72_000.0, Some(2_000.0)),
            (false, Some(1_000))
        );
        // Hits only ever lag queries here, but a rate never goes below zero.
        assert_eq!(
            w.observe(31_000, 72_000.0, Some(13_000.0)),
            (false, Some(0))
        );
    }

    #[test]
    fn served_work_starts_over_when_the_server_restarts() {
        let mut w = ServedWork::default();
        w.observe(0, 0.0, Some(0.0));
        assert_eq!(w.observe(5_000, 50_000.0, Some(0.0)), (false, Some(5_000)));
        // The counter went back: a restart, and the rate starts over from that scrape.
        assert_eq!(w.observe(6_000, 100.0, Some(0.0)), (true, None));
        assert_eq!(w.observe(9_000, 3_100.0, Some(0.0)), (false, Some(300)));
        // Without a hits counter: restarts still show, no rate.
        let mut w = ServedWork::default();
        assert_eq!(w.observe(0, 500.0, None), (false, None));
        assert_eq!(w.observe(9_000, 100.0, None), (true, None));
        assert_eq!(w.observe(9_500, f64::NAN, Some(0.0)), (false, None));
        assert_eq!(w.observe(10_000, 50.0, None), (true, None));
    }

    #[test]
    fn foreign_load_is_seen_from_a_quarter_of_the_requests() {
        let mut f = ForeignLoad::default();
        // A lone gateway: the servers count what it sent, give or take a request or two
        // (a scrape and a ledger read a moment apart).
        for i in 0..200u32 {
            let ours = 6 + i % 3;
            f.observe(f64::from(ours - 1 + 2 * (i % 2)), u64::from(ours), 1);
        }
        assert!(!f.seen && f.share() < 0.02, "{f:?}");
        // A second gateway sends as much: half of every server's requests are not ours.
        for _ in 0..10 {
            f.observe(8.0, 4, 1);
        }
        assert!(f.seen, "{f:?}");
        assert!((f.share() - 0.5).abs() < 0.2, "{f:?}");
        // Between the thresholds it stays as it was.
        for _ in 0..200 {
            f.observe(10.0, 8, 1);
        }
        assert!(f.seen && (f.share() - 0.2).abs() < 0.01, "{f:?}");
        // The other gateway left.
        for _ in 0..40 {
            f.observe(6.0, 6, 1);
        }
        assert!(!f.seen, "{f:?}");
        // Idle servers tell nothing; garbage counts as none.
        let mut idle = ForeignLoad::default();
        for _ in 0..50 {
            idle.observe(f64::NAN, 0, 1);
            idle.observe(0.2, 0, 1);
        }
        assert!(!idle.seen && idle.share() == 0.0, "{idle:?}");
    }

    #[test]
    fn json_round_trip_and_staleness() {
        let mut t = EndpointTable::default();
        t.reconcile(&found(&[("127.0.0.1:8001", true)]), 8, 100);
        t.endpoints[0].waiting = Some(3.0);
        t.endpoints[0].scraped_at_ms = 1_000;
        let back = EndpointTable::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
        assert!(back.endpoints[0].scraped(2_000, 5_000).is_some());
        assert!(back.endpoints[0].scraped(9_000, 5_000).is_none());
        assert!(EndpointTable::from_json(b"garbage").is_none());
    }
}

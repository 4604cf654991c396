//! The endpoint table: every model-server endpoint the router may pick, with a stable slot
//! number (the key of its index and ledger entries), health, capacity and the last scraped
//! metrics. Built from the static config list or from discovery; reconciled, never rebuilt,
//! so an endpoint keeps its slot (and its warm index entries) while it stays.

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
}

impl Endpoint {
    /// Identity for rendezvous hashing: the address, so every gateway agrees.
    pub fn id(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.address.as_bytes())
    }

    /// The scrape, if it is younger than `stale_ms`.
    pub fn scraped(&self, now_ms: u64, stale_ms: u64) -> Option<Scraped> {
        if self.scraped_at_ms == 0 || now_ms.saturating_sub(self.scraped_at_ms) > stale_ms {
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
}

/// What a reconcile changed: slots whose index and ledger entries must be cleared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub removed: Vec<u16>,
    pub added: Vec<u16>,
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
            })
            .collect();
        EndpointTable { endpoints }
    }

    pub fn get(&self, address: &str) -> Option<&Endpoint> {
        self.endpoints.iter().find(|e| e.address == address)
    }

    pub fn get_mut(&mut self, address: &str) -> Option<&mut Endpoint> {
        self.endpoints.iter_mut().find(|e| e.address == address)
    }

    /// Makes the table match a discovered `(address, healthy)` list: known endpoints keep
    /// their slot, new ones take the lowest free slot (up to `max`), missing ones go.
    pub fn reconcile(
        &mut self,
        found: &[(String, bool)],
        max: usize,
        capacity_blocks: u64,
    ) -> Changes {
        let mut changes = Changes::default();
        self.endpoints.retain(|e| {
            let keep = found.iter().any(|(a, _)| *a == e.address);
            if !keep {
                changes.removed.push(e.slot);
            }
            keep
        });
        for (address, healthy) in found {
            if let Some(e) = self.get_mut(address) {
                e.healthy = *healthy;
                continue;
            }
            if self.endpoints.len() >= max {
                continue;
            }
            let slot = (0..=u16::MAX)
                .find(|s| self.endpoints.iter().all(|e| e.slot != *s))
                .unwrap_or(u16::MAX);
            changes.added.push(slot);
            self.endpoints.push(Endpoint {
                address: address.clone(),
                slot,
                healthy: *healthy,
                capacity_blocks,
                waiting: None,
                kv_usage: None,
                running: None,
                scraped_at_ms: 0,
            });
        }
        changes
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

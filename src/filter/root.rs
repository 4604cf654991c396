//! The VM's root: configuration, and the tick that keeps the endpoint table fresh.
//!
//! The tick fires in every VM (each worker and the main thread), so a lease in shared data
//! (`{namespace}/lease`: owner and expiry, renewed with CAS) picks one poller per Envoy
//! process. The poller (a) fetches Envoy's admin `/clusters?format=json` (for the model
//! cluster alone, `clusters_path`) when `discovery` is set and reconciles the table, (b) fetches each endpoint's `/metrics` through the model
//! cluster with `x-gateway-destination-endpoint: ip:port`, so override_host sends the poll to
//! that one endpoint, at most one poll in flight per endpoint, (c) with learning, writes each
//! endpoint's learned KV capacity into the index (its share, capped by the fleet's), (d)
//! with `peers`, asks the other gateway replicas for their new placements (see `peering`),
//! and (e) publishes each endpoint's in-flight tokens as a gauge. The table goes to shared data as
//! JSON with CAS; every VM re-reads it when its version changes (see `vm`). Every VM, poller
//! or not, also records its own linear memory on each tick (see `memory`).
//!
//! Cold restarts. A restarted model server has an empty prefix cache, so its index entries
//! must go. The poller takes a restart to have happened when the endpoint's prefix-cache
//! query counter (`vllm:prefix_cache_queries_total`, a counter) went down between two
//! scrapes (a restart between polls), when a poll succeeds again after the endpoint was
//! taken out of rotation (down, maybe restarted: one cold fill is the price of being wrong),
//! and (discovery) when Envoy reports a host healthy again after it was not. Then the
//! endpoint's index entries are dropped (its ledger stays: requests still in flight release
//! their own charges) and `tokenaware_endpoint_resets` counts it.
//!
//! Reconfiguration. A new plugin configuration makes new root contexts, while the old ones
//! live on until their listener has drained (minutes). Each configuration takes a generation
//! in shared data (`{namespace}/config`: hash of its bytes, generation); a root whose
//! generation is older than the newest stops taking the lease, so the poller moves to the new
//! configuration within a lease TTL. Tables in shared data carry over (a new static endpoint
//! list is reconciled into the stored table, keeping the slots of endpoints that stay);
//! per-VM state does not. So one namespace should serve one configuration at a time: two
//! listeners with different configurations in one namespace leave polling to the newer.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use super::host::{Host, HostError, Level, MetricKind};
use super::http::DESTINATION;
use super::memory;
use super::peering::{PeerPoller, PeerTarget};
use super::stats::{endpoint_gauge_name, Counter, FOREIGN_REQUESTS, PEERS, SHARED_PREFIXES};
use super::vm::Vm;
use crate::config::{Config, ConfigError};
use crate::endpoints::{Changes, EndpointTable, ServedWork};
use crate::estimator::Estimate;
use crate::prometheus::{parse_metrics, ServerMetrics};
use crate::store::{read_u64, update, write_u64, SharedStore, StoreError};

/// Largest `/metrics` body read (vLLM's can be hundreds of KiB of histograms).
pub const MAX_METRICS_BYTES: usize = 1 << 20;
/// Largest admin `/clusters?format=json` body read.
pub const MAX_CLUSTERS_BYTES: usize = 4 << 20;
/// Largest peer answer read (one answer holds about `peers::MAX_ANSWER_BYTES` of
/// placements, written as JSON).
pub const MAX_PEER_BYTES: usize = 4 << 20;
/// Consecutive failed polls after which an endpoint is taken out of rotation (until a poll
/// succeeds again).
pub const UNHEALTHY_AFTER: u32 = 2;

/// The poller lease, 24 bytes: owner id, expiry (ms), the owner's configuration generation,
/// little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub owner: u64,
    pub expires_ms: u64,
    pub generation: u64,
}

impl Lease {
    pub fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.owner.to_le_bytes());
        b[8..16].copy_from_slice(&self.expires_ms.to_le_bytes());
        b[16..].copy_from_slice(&self.generation.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Lease> {
        Some(Lease {
            owner: u64::from_le_bytes(b.get(..8)?.try_into().ok()?),
            expires_ms: u64::from_le_bytes(b.get(8..16)?.try_into().ok()?),
            // A lease written before generations were kept: the oldest.
            generation: match b.get(16..24) {
                Some(g) => u64::from_le_bytes(g.try_into().ok()?),
                None => 0,
            },
        })
    }
}

/// Lease periods a newer configuration's roots may leave the lease unrenewed before an older
/// one takes it back: they renew it every tick while they live, and a configuration whose
/// roots went away before they took over (a listener update Envoy rejected after the plugin
/// had started) must not stop the polling for good.
const ORPHANED_AFTER_TTLS: u64 = 3;
/// The longest a successful poll's reading waits for the rest of its round before the table
/// is written.
const READINGS_HELD_MS: u64 = 50;
/// The longest lease period of any configuration (three ticks of at most a second).
const LEASE_TTL_MAX_MS: u64 = 3_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Discovery,
    Metrics(String),
    /// A peer replica's placements.
    Peer(PeerTarget),
    /// Admin's `/clusters`, for the hosts of `peers.cluster`.
    PeerMembers,
}

/// One endpoint's successful metrics poll, held for the round's one table write.
struct Reading {
    address: String,
    m: ServerMetrics,
    at_ms: u64,
    served_work: Option<u64>,
    healthy: bool,
    capacity: Option<u64>,
    /// The server's running and waiting requests, and this gateway's ledger's there.
    server: Option<f64>,
    ours: Option<u64>,
}

pub struct Root {
    vm: Rc<Vm>,
    calls: HashMap<u32, (Call, u64)>,
    /// Endpoints with a poll in flight.
    polling: HashSet<String>,
    /// Polls answered since the last table write: the table is written once a round (when
    /// the last poll of it is answered, when the first reading held is `READINGS_HELD_MS`
    /// old, or at the next tick), not once an answer. Each write parses and re-serializes
    /// the whole table, and each makes every worker decode it again: per answer that was
    /// quadratic in the endpoints.
    readings: Vec<Reading>,
    /// The latest round's polls not answered yet.
    round: HashSet<String>,
    next_discovery_ms: u64,
    next_metrics_ms: u64,
    /// Consecutive failed polls per endpoint (of the table; pruned at discovery).
    failures: HashMap<String, u32>,
    /// Endpoints Envoy reports unhealthy (discovery).
    envoy_down: HashSet<String>,
    /// Prefix-cache counters per endpoint: restart detection and the server's own prefill
    /// rate. Entries of endpoints that left are dropped at discovery.
    served: HashMap<String, ServedWork>,
    /// Gauge ids by metric name.
    gauges: HashMap<String, u32>,
    /// This configuration's generation (see the module docs).
    generation: u64,
    /// Whom `peers` asks, and from where (in shared data: see `peers::PeerCursors`).
    peers: PeerPoller,
    /// Discovery calls failed in a row (for the log's rate limit).
    discovery_failures: u64,
    /// Rounds of metrics polls that could not be sent, in a row (the same).
    metrics_dispatch_failures: u64,
    /// Discovery rounds in a row that found more hosts than the table holds (the same).
    dropping_rounds: u64,
}

impl Root {
    /// Per-endpoint poll records held (failures, counters), for the bounded-memory tests.
    #[cfg(test)]
    pub(crate) fn poll_records(&self) -> usize {
        self.failures.len() + self.served.len()
    }

    /// Parses and validates the plugin configuration and sets up this VM. `id` must differ
    /// between VMs (it is the lease owner).
    pub fn configure<H: Host>(h: &H, bytes: &[u8], id: u64) -> Result<Root, ConfigError> {
        let cfg = Config::from_json(bytes)?;
        // Once per VM at plugin start: which build runs, with what in effect.
        h.log(
            Level::Info,
            &format!(
                "tokenaware {} configured: policy {}, R_peak {} tok/s, tau {} tokens, \
                 {} static endpoints, discovery {}, metrics {}",
                crate::VERSION,
                cfg.policy.as_str(),
                cfg.peak_prefill(),
                cfg.tau_tokens().round(),
                cfg.endpoints.len(),
                if cfg.discovery.is_some() { "on" } else { "off" },
                if cfg.metrics.is_some() { "on" } else { "off" },
            ),
        );
        let vm = Rc::new(Vm::new(h, cfg, id));
        let (generation, newest) =
            claim_generation(h, &vm.keys.config, xxhash_rust::xxh3::xxh3_64(bytes));
        let root = Root {
            peers: PeerPoller::new(&vm.cfg.namespace),
            discovery_failures: 0,
            metrics_dispatch_failures: 0,
            dropping_rounds: 0,
            generation,
            vm,
            calls: HashMap::new(),
            polling: HashSet::new(),
            readings: Vec::new(),
            round: HashSet::new(),
            next_discovery_ms: 0,
            next_metrics_ms: 0,
            failures: HashMap::new(),
            envoy_down: HashSet::new(),
            served: HashMap::new(),
            gauges: HashMap::new(),
        };
        if let Ok(r) = root.vm.router.try_borrow() {
            // The ring is named before any placement, so this process knows itself among
            // the replicas it polls from its first poll; failing that, its first placement
            // names it.
            let seed = xxhash_rust::xxh64::xxh64(&id.to_le_bytes(), h.now_ms().unwrap_or(0));
            if let Some(Err(_)) = r.placements.as_ref().map(|l| l.claim_ring(h, seed)) {
                root.vm.stats.inc(h, Counter::PeerErrors);
            }
        }
        if newest && root.vm.cfg.discovery.is_none() {
            root.adopt_static_list(h);
        }
        Ok(root)
    }

    /// A new configuration's static endpoint list replaces the one in shared data (written by
    /// an earlier configuration's poller): endpoints that stay keep their slot, health and
    /// index entries; removed and added slots are cleared.
    fn adopt_static_list<H: Host>(&self, h: &H) {
        let list = self.vm.static_table().clone();
        let max = self.vm.cfg.max_endpoints as usize;
        let r = self.update_table(h, |t| {
            let found: Vec<(String, bool)> = list
                .endpoints
                .iter()
                .map(|e| {
                    (
                        e.address.clone(),
                        t.get(&e.address).is_none_or(|x| x.healthy),
                    )
                })
                .collect();
            let changes = t.reconcile(&found, max, 1);
            for e in &mut t.endpoints {
                if let Some(c) = list.get(&e.address) {
                    e.capacity_blocks = c.capacity_blocks;
                }
            }
            (changes, t.clone())
        });
        let Ok((changes, table)) = r else { return };
        if let Ok(router) = self.vm.router.try_borrow() {
            for slot in changes.removed.iter().chain(changes.added.iter()) {
                let _ = router.clear_slot(h, *slot);
            }
            let _ = router.sync_capacities(h, &table.endpoints);
        }
    }

    pub fn vm(&self) -> Rc<Vm> {
        self.vm.clone()
    }

    /// The VM is being removed: what its stats hold goes out now.
    pub fn on_done<H: Host>(&self, h: &H) {
        self.vm.stats.flush_all(h);
    }

    /// The tick period: the largest that divides a second and every configured interval, so
    /// that each comes round on time (at a one-second tick a 1.5 s interval was 2 s, and its
    /// samples went stale before the next poll). Intervals with no such divisor of 100 ms or
    /// more tick at 100 ms (or the shortest interval, if shorter), and `due` keeps their
    /// average on time.
    pub fn tick_period_ms(&self) -> u64 {
        let c = &self.vm.cfg;
        let intervals = [
            c.metrics.as_ref().map(|m| m.interval_ms),
            c.discovery.as_ref().map(|d| d.interval_ms),
            c.peers.as_ref().map(|x| x.interval_ms),
        ];
        let intervals = intervals.into_iter().flatten().map(|i| i.max(1));
        let shortest = intervals.clone().min().unwrap_or(1_000);
        let p = intervals.fold(1_000, gcd);
        match p >= 100 {
            true => p,
            false => shortest.min(100),
        }
        .max(10)
    }

    pub fn on_tick<H: Host>(&mut self, h: &H) {
        // The tick may write the tables; decisions re-read them after it.
        self.vm.recent.clear();
        let Ok(now) = h.now_ms() else { return };
        // Every VM sends its own held stats (requests ran on each).
        self.vm.stats.flush(h, now);
        // Every VM, poller or not: its own linear memory into the process-wide gauges.
        if let Some(me) = h.vm_memory() {
            if let Ok(sum) = memory::record(h, &self.vm.keys.vms, me, now) {
                self.vm.stats.vm_memory(h, sum);
            }
        }
        if !self.hold_lease(h, now) {
            // Another root polls now: what this one read is older than what it will write.
            self.readings.clear();
            return;
        }
        self.expire_calls(now);
        self.discover(h, now);
        // A round whose last poll is still out: what it read so far goes in now.
        self.write_readings(h);
        self.poll_metrics(h, now);
        self.peers.poll(h, &self.vm, now, &mut self.calls);
        self.sync_learned_capacities(h);
        self.record_gauges(h, now);
    }

    /// With learning, the fleet's capacity share moves with every endpoint's, and requests
    /// sync only their own endpoint: the poller recomputes it and every capacity each tick.
    fn sync_learned_capacities<H: Host>(&self, h: &H) {
        if !self.vm.cfg.learns() {
            return;
        }
        if let Ok(router) = self.vm.router.try_borrow() {
            if router
                .sync_capacities(h, &self.vm.table(h).endpoints)
                .is_err()
            {
                self.vm.stats.inc(h, Counter::EstimateErrors);
            }
        }
    }

    /// Asks Envoy's admin for the model cluster's hosts, when due and none is in flight.
    fn discover<H: Host>(&mut self, h: &H, now: u64) {
        let Some(d) = self.vm.cfg.discovery.as_ref() else {
            return;
        };
        let busy = self.calls.values().any(|(c, _)| *c == Call::Discovery);
        if busy || !due(&mut self.next_discovery_ms, now, d.interval_ms) {
            return;
        }
        let path = clusters_path(&d.model_cluster);
        let hdrs = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", "envoy-admin"),
        ];
        match h.dispatch(&d.admin_cluster, &hdrs, d.interval_ms.clamp(100, 5_000)) {
            Ok(token) => {
                self.calls.insert(token, (Call::Discovery, now));
            }
            Err(e) => {
                let why = format!(
                    "could not call discovery.adminCluster `{}` ({}): is it a cluster of this Envoy?",
                    d.admin_cluster,
                    e.as_str()
                );
                self.discovery_failed(h, &why);
            }
        }
    }

    /// Polls every endpoint's metrics through the model cluster, pinned to that endpoint by
    /// the override_host header; at most one poll in flight per endpoint.
    fn poll_metrics<H: Host>(&mut self, h: &H, now: u64) {
        let Some(m) = self.vm.cfg.metrics.clone() else {
            return;
        };
        if !due(&mut self.next_metrics_ms, now, m.interval_ms) {
            return;
        }
        self.round.clear();
        let table = self.vm.table(h);
        let mut dispatch_failed = None;
        for e in &table.endpoints {
            if self.polling.contains(&e.address) {
                continue;
            }
            let hdrs = [
                (":method", "GET"),
                (":path", m.path.as_str()),
                (":authority", e.address.as_str()),
                (DESTINATION, e.address.as_str()),
            ];
            match h.dispatch(&m.cluster, &hdrs, m.timeout_ms) {
                Ok(token) => {
                    self.calls
                        .insert(token, (Call::Metrics(e.address.clone()), now));
                    self.polling.insert(e.address.clone());
                    self.round.insert(e.address.clone());
                }
                Err(err) => {
                    // This Envoy's failure, not the endpoint's: a `metrics.cluster` that is
                    // not there (a typo, a rename) says nothing of the fleet's health, and
                    // counted against each endpoint it took the whole fleet out of rotation.
                    self.vm.stats.inc(h, Counter::PollsFailed);
                    dispatch_failed = Some(err);
                }
            }
        }
        self.metrics_dispatch_failed(h, &m.cluster, dispatch_failed);
    }

    /// Warns of a round whose polls could not be sent, at the first and at 2, 4, 8… in a row.
    fn metrics_dispatch_failed<H: Host>(&mut self, h: &H, cluster: &str, err: Option<HostError>) {
        let Some(err) = err else {
            self.metrics_dispatch_failures = 0;
            return;
        };
        self.metrics_dispatch_failures = self.metrics_dispatch_failures.saturating_add(1);
        if self.metrics_dispatch_failures.is_power_of_two() {
            let n = self.metrics_dispatch_failures;
            h.log(
                Level::Warn,
                &format!(
                    "tokenaware: could not call metrics.cluster `{cluster}` ({}; {n} rounds in \
                     a row): is it a cluster of this Envoy? Endpoints keep their health",
                    err.as_str()
                ),
            );
        }
    }

    /// The answer to a call this root made; `num_headers == 0` means it failed (timeout,
    /// reset, connect failure).
    pub fn on_call_response<H: Host>(
        &mut self,
        h: &H,
        token: u32,
        num_headers: usize,
        body: usize,
    ) {
        let Some((call, _)) = self.calls.remove(&token) else {
            return;
        };
        // What follows may rewrite the table or clear an endpoint's index.
        self.vm.recent.clear();
        let status = match num_headers {
            0 => 0,
            _ => call_status(h),
        };
        let ok = status == 200;
        // An answer to a call made before a reload is read by the old configuration (its
        // model cluster, its limits): the table is the new one's now.
        let stale = matches!(call, Call::Metrics(_) | Call::Discovery) && self.superseded(h);
        match call {
            Call::Metrics(address) => {
                self.polling.remove(&address);
                self.round.remove(&address);
                if !stale {
                    self.metrics_answered(h, &address, ok, status, body);
                }
            }
            Call::Peer(target) => {
                let body = match ok {
                    true => h.call_response_body(body.min(MAX_PEER_BYTES)).ok(),
                    false => None,
                };
                self.peers.answered(h, &self.vm, target, status, body);
            }
            Call::PeerMembers => {
                let body = match ok {
                    true => h.call_response_body(body.min(MAX_CLUSTERS_BYTES)).ok(),
                    false => None,
                };
                if let Some(p) = self.vm.cfg.peers.as_ref() {
                    self.peers.members_answered(h, p, status, body.as_deref());
                }
            }
            Call::Discovery if stale => {}
            Call::Discovery => match self.discovery_answer(h, status, body) {
                Ok(found) => self.discovered(h, found),
                Err(why) => self.discovery_failed(h, &why),
            },
        }
    }

    /// A newer configuration exists (its roots poll now).
    fn superseded<H: Host>(&self, h: &H) -> bool {
        match h.get(&self.vm.keys.config) {
            Ok((Some(v), _)) => read_u64(&v, 8) > self.generation,
            _ => false,
        }
    }

    fn hold_lease<H: Host>(&self, h: &H, now: u64) -> bool {
        let newer = self.superseded(h);
        // 1-3 s: the tick period is at most a second.
        let ttl = (3 * self.tick_period_ms()).clamp(1_000, LEASE_TTL_MAX_MS);
        let Ok((v, cas)) = h.get(&self.vm.keys.lease) else {
            return false;
        };
        let held = v.as_deref().and_then(Lease::decode);
        // Expiring later than any configuration's lease period can reach: the wall clock
        // stepped back since it was written.
        let stepped_back = |l: &Lease| l.expires_ms > now.saturating_add(2 * LEASE_TTL_MAX_MS);
        let orphaned = |l: &Lease| {
            l.expires_ms.saturating_add(ORPHANED_AFTER_TTLS * ttl) <= now || stepped_back(l)
        };
        // A newer configuration exists: leave polling to its roots, unless they have left
        // the lease unrenewed for several periods (gone). A root of a newer configuration
        // takes the lease from an older one's at once.
        let free = match held {
            None => true,
            Some(l) if newer => l.owner == self.vm.id || orphaned(&l),
            Some(l) => {
                l.owner == self.vm.id
                    || l.expires_ms <= now
                    || l.generation < self.generation
                    || stepped_back(&l)
            }
        };
        if !free {
            return false;
        }
        let mine = Lease {
            owner: self.vm.id,
            expires_ms: now + ttl,
            generation: self.generation,
        };
        if h.set(&self.vm.keys.lease, &mine.encode(), cas).is_err() {
            return false;
        }
        // Creating a key ignores the CAS, so two first writers can both succeed: read back.
        matches!(h.get(&self.vm.keys.lease),
            Ok((Some(v), _)) if Lease::decode(&v).is_some_and(|l| l.owner == self.vm.id))
    }

    /// Forgets calls whose answer never came (the host should always answer; be safe).
    fn expire_calls(&mut self, now: u64) {
        // Past the longest timeout any call was sent with (a peer poll's may be a minute).
        let cfg = &self.vm.cfg;
        let metrics = cfg.metrics.as_ref().map_or(0, |m| m.timeout_ms);
        let peers = cfg.peers.as_ref().map_or(0, |p| p.timeout_ms.max(1_000));
        let limit = metrics.max(peers).max(5_000) + 5_000;
        let stale: Vec<u32> = self
            .calls
            .iter()
            .filter(|(_, (_, at))| now.saturating_sub(*at) > limit)
            .map(|(t, _)| *t)
            .collect();
        for t in stale {
            if let Some((Call::Metrics(a), _)) = self.calls.remove(&t) {
                self.polling.remove(&a);
            }
        }
    }

    /// A metrics poll's answer (`status` 0 when none came); the round's readings go into the
    /// table once its last poll is answered, or once the first reading held has waited
    /// `READINGS_HELD_MS` (a slow server holds the others' back that long at most).
    fn metrics_answered<H: Host>(
        &mut self,
        h: &H,
        address: &str,
        ok: bool,
        status: u32,
        body: usize,
    ) {
        if !ok {
            let why = match status {
                0 => "no answer".to_string(),
                s => format!("status {s}"),
            };
            self.poll_failed(h, address, &why);
        } else {
            // One byte past the limit: `parse_metrics` then sees the cut and drops the last
            // line rather than read `12345` of `123456789`.
            match h.call_response_body(body.min(MAX_METRICS_BYTES + 1)) {
                Ok(text) => self.poll_ok(h, address, parse_metrics(&text, MAX_METRICS_BYTES)),
                Err(e) => self.poll_failed(h, address, e.as_str()),
            }
        }
        let now = h.now_ms().unwrap_or(0);
        let held_ms = self.readings.first().map(|r| now.saturating_sub(r.at_ms));
        if self.round.is_empty() || held_ms.is_some_and(|ms| ms >= READINGS_HELD_MS) {
            self.write_readings(h);
        }
    }

    fn poll_ok<H: Host>(&mut self, h: &H, address: &str, m: ServerMetrics) {
        self.vm.stats.inc(h, Counter::PollsOk);
        let was_down = self
            .failures
            .remove(address)
            .is_some_and(|n| n >= UNHEALTHY_AFTER);
        let now = h.now_ms().unwrap_or(0);
        let (counter_reset, served_work) = match m.prefix_queries {
            Some(q) => {
                self.served
                    .entry(address.to_string())
                    .or_default()
                    .observe(now, q, m.prefix_hits)
            }
            None => (false, None),
        };
        if was_down || counter_reset {
            // At once, not with the round's write: the next request must not stick there.
            if let Some(e) = self.vm.table(h).get(address) {
                self.endpoint_reset(h, address, e.slot);
            }
        }
        let capacity = match (m.num_gpu_blocks, m.block_size) {
            (Some(n), Some(b)) if n >= 1.0 && b >= 1.0 => {
                Some(self.vm.cfg.scraped_capacity_blocks((n * b) as u64))
            }
            _ => None,
        };
        let server = match (m.waiting, m.running) {
            (None, None) => None,
            (w, r) => Some(w.unwrap_or(0.0) + r.unwrap_or(0.0)),
        };
        self.readings.push(Reading {
            address: address.to_string(),
            at_ms: now,
            served_work,
            healthy: !self.envoy_down.contains(address),
            capacity,
            server,
            ours: self.our_requests(h, address, now),
            m,
        });
    }

    /// The round's readings into the table, in one write.
    fn write_readings<H: Host>(&mut self, h: &H) {
        let readings = std::mem::take(&mut self.readings);
        if readings.is_empty() {
            return;
        }
        let mut newly_seen = false;
        let resized = self.update_table(h, |t| {
            let was = t.foreign.seen;
            let mut resized = false;
            for x in &readings {
                if let (Some(server), Some(ours)) = (x.server, x.ours) {
                    t.foreign.observe(server, ours, t.endpoints.len());
                }
                let Some(e) = t.get_mut(&x.address) else {
                    continue;
                };
                e.waiting = x.m.waiting;
                e.running = x.m.running;
                e.kv_usage = x.m.kv_usage;
                e.scraped_at_ms = x.at_ms;
                e.served_work_per_s = x.served_work;
                e.healthy = x.healthy;
                if let Some(c) = x.capacity.filter(|c| *c != e.capacity_blocks) {
                    e.capacity_blocks = c;
                    resized = true;
                }
            }
            newly_seen = t.foreign.seen && !was;
            resized
        });
        if newly_seen {
            self.vm.stats.inc(h, Counter::OtherSendersSeen);
        }
        // A new size goes through the learned share (and the fleet's), as at start.
        if let (Ok(true), Ok(router)) = (resized, self.vm.router.try_borrow()) {
            let _ = router.sync_capacities(h, &self.vm.table(h).endpoints);
        }
    }

    /// The requests this gateway's ledger holds on `address` (`None`: not known).
    fn our_requests<H: Host>(&self, h: &H, address: &str, now: u64) -> Option<u64> {
        let slot = self.vm.table(h).get(address)?.slot;
        let router = self.vm.router.try_borrow().ok()?;
        router.ledger.load(h, slot, now).ok().map(|l| l.requests)
    }

    /// A cold restart: the endpoint's cache is empty, so its index entries go.
    fn endpoint_reset<H: Host>(&self, h: &H, address: &str, slot: u16) {
        let cleared = match self.vm.router.try_borrow() {
            Ok(router) => router.index.clear_endpoint(h, slot).is_ok(),
            Err(_) => false,
        };
        if cleared {
            self.vm.stats.inc(h, Counter::EndpointResets);
            h.log(
                Level::Info,
                &format!("tokenaware: {address} restarted (cold); its prefix index is cleared"),
            );
        }
    }

    /// A failed metrics poll (`why`: what the last one met, for the log).
    fn poll_failed<H: Host>(&mut self, h: &H, address: &str, why: &str) {
        self.vm.stats.inc(h, Counter::PollsFailed);
        let n = self.failures.entry(address.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        if *n < UNHEALTHY_AFTER {
            return;
        }
        if *n == UNHEALTHY_AFTER {
            h.log(
                Level::Warn,
                &format!(
                    "tokenaware: {address} failed {UNHEALTHY_AFTER} polls ({why}); out of rotation"
                ),
            );
        }
        // Checked on every failure past the limit: a table write that failed (CAS races, a
        // host error) is made again at the next one.
        if self.vm.table(h).get(address).is_some_and(|e| e.healthy) {
            let _ = self.update_table(h, |t| {
                if let Some(e) = t.get_mut(address) {
                    e.healthy = false;
                }
            });
        }
    }

    /// The hosts of `discovery.modelCluster` in admin's answer, or what went wrong.
    fn discovery_answer<H: Host>(
        &self,
        h: &H,
        status: u32,
        body: usize,
    ) -> Result<Vec<(String, bool)>, String> {
        let Some(d) = self.vm.cfg.discovery.as_ref() else {
            return Err("discovery is off".into());
        };
        if status != 200 {
            return Err(match status {
                0 => format!(
                    "discovery.adminCluster `{}` did not answer",
                    d.admin_cluster
                ),
                s => format!("discovery.adminCluster `{}` answered {s}", d.admin_cluster),
            });
        }
        let text = h
            .call_response_body(body.min(MAX_CLUSTERS_BYTES))
            .map_err(|e| format!("admin's /clusters answer unreadable ({})", e.as_str()))?;
        cluster_hosts(&text, &d.model_cluster).ok_or_else(|| {
            format!(
                "admin's /clusters lists no cluster named `{}` (discovery.modelCluster), or is not JSON",
                d.model_cluster
            )
        })
    }

    /// Counts a failed discovery, and says why in the log: the first time, then every
    /// power of two in a row (a wrong cluster name fails every interval, and only the
    /// operator can mend it). Requests meanwhile route among the endpoints last known.
    fn discovery_failed<H: Host>(&mut self, h: &H, why: &str) {
        self.vm.stats.inc(h, Counter::DiscoveryFailed);
        self.discovery_failures = self.discovery_failures.saturating_add(1);
        if self.discovery_failures.is_power_of_two() {
            let n = self.discovery_failures;
            h.log(
                Level::Warn,
                &format!("tokenaware: discovery failed ({n} in a row): {why}"),
            );
        }
    }

    fn discovered<H: Host>(&mut self, h: &H, found: Vec<(String, bool)>) {
        self.vm.stats.inc(h, Counter::DiscoveryOk);
        self.discovery_failures = 0;
        let down: HashSet<String> = found
            .iter()
            .filter(|(_, ok)| !ok)
            .map(|(a, _)| a.clone())
            .collect();
        let back: Vec<String> = self.envoy_down.difference(&down).cloned().collect();
        self.envoy_down = down;
        let found: Vec<(String, bool)> = found
            .into_iter()
            .map(|(a, ok)| {
                let polled_ok = self.failures.get(&a).copied().unwrap_or(0) < UNHEALTHY_AFTER;
                (a, ok && polled_ok)
            })
            .collect();
        let cfg = &self.vm.cfg;
        let (max, cap) = (
            cfg.max_endpoints as usize,
            cfg.capacity_blocks(cfg.kv_capacity_tokens),
        );
        let r = self.update_table(h, |t| {
            let c = t.reconcile(&found, max, cap);
            (c, t.clone())
        });
        let Ok((changes, table)) = r else { return };
        // Endpoints that left take their poll history along: with pods coming and going
        // under new addresses these would otherwise grow for as long as the VM lives.
        self.failures.retain(|a, _| table.get(a).is_some());
        self.served.retain(|a, _| table.get(a).is_some());
        for address in &back {
            if let Some(e) = table.get(address) {
                self.endpoint_reset(h, address, e.slot);
            }
        }
        let Changes {
            removed,
            added,
            dropped,
        } = changes;
        self.hosts_dropped(h, found.len(), dropped);
        if removed.is_empty() && added.is_empty() {
            return;
        }
        h.log(
            Level::Info,
            &format!(
                "tokenaware: discovery: {} endpoints ({} added, {} removed)",
                table.endpoints.len(),
                added.len(),
                removed.len()
            ),
        );
        if let Ok(router) = self.vm.router.try_borrow() {
            for slot in removed.iter().chain(added.iter()) {
                let _ = router.clear_slot(h, *slot);
            }
            let _ = router.sync_capacities(h, &table.endpoints);
        }
        for slot in removed {
            if let Some(id) = self.gauges.get(&endpoint_gauge_name(slot)) {
                let _ = h.record_metric(*id, 0);
            }
        }
    }

    /// Hosts discovery found that the table had no slot for: counted every round, warned of
    /// at the first round and at 2, 4, 8… in a row (they get no traffic from the filter).
    fn hosts_dropped<H: Host>(&mut self, h: &H, found: usize, dropped: usize) {
        if dropped == 0 {
            self.dropping_rounds = 0;
            return;
        }
        self.vm
            .stats
            .add(h, Counter::DiscoveryHostsDropped, dropped as u64);
        self.dropping_rounds = self.dropping_rounds.saturating_add(1);
        if self.dropping_rounds.is_power_of_two() {
            let max = self.vm.cfg.max_endpoints;
            h.log(
                Level::Warn,
                &format!(
                    "tokenaware: discovery found {found} hosts, {dropped} left out: maxEndpoints \
                     is {max} ({} rounds in a row)",
                    self.dropping_rounds
                ),
            );
        }
    }

    /// Read-modify-write of the shared table (CAS), then a version bump so VMs re-read it.
    fn update_table<H: Host, T>(
        &self,
        h: &H,
        mut f: impl FnMut(&mut EndpointTable) -> T,
    ) -> Result<T, StoreError> {
        let base = self.vm.static_table();
        let out = update(h, &self.vm.keys.eps, |old| {
            let mut t = EndpointTable::from_json(old).unwrap_or_else(|| base.clone());
            let r = f(&mut t);
            Some((t.to_json(), r))
        })?
        .ok_or(StoreError::Host)?;
        h.set(&self.vm.keys.eps_version, &[1], None)?;
        Ok(out)
    }

    fn gauge<H: Host>(&mut self, h: &H, name: String) -> Option<u32> {
        if let Some(id) = self.gauges.get(&name) {
            return Some(*id);
        }
        let id = h.define_metric(MetricKind::Gauge, &name).ok()?;
        self.gauges.insert(name, id);
        Some(id)
    }

    fn record_gauges<H: Host>(&mut self, h: &H, now: u64) {
        let table = self.vm.table(h);
        let vm = self.vm.clone();
        let Ok(router) = vm.router.try_borrow() else {
            return;
        };
        let asked = vm
            .cfg
            .peers
            .as_ref()
            .map(|p| self.peers.targets(p, now).len());
        if let (Some(n), Some(id)) = (asked, self.gauge(h, PEERS.into())) {
            let _ = h.record_metric(id, n as u64);
        }
        let foreign = (table.foreign.share() * 100.0).round() as u64;
        if let Some(id) = self.gauge(h, FOREIGN_REQUESTS.into()) {
            let _ = h.record_metric(id, foreign);
        }
        if let (Some(id), Ok(shared)) = (
            self.gauge(h, SHARED_PREFIXES.into()),
            router.shared_prefixes(h),
        ) {
            let _ = h.record_metric(id, (shared.share() * 100.0).round() as u64);
        }
        for e in &table.endpoints {
            if let (Some(id), Ok(load)) = (
                self.gauge(h, endpoint_gauge_name(e.slot)),
                router.ledger.load(h, e.slot, now),
            ) {
                let _ = h.record_metric(id, load.tokens);
            }
            let Ok(est) = router.estimator.read(h, e.slot) else {
                continue;
            };
            for (what, value) in estimate_gauges(&est) {
                if let Some(id) = self.gauge(h, format!("tokenaware_endpoint_{}_{what}", e.slot)) {
                    let _ = h.record_metric(id, value);
                }
            }
        }
    }
}

/// What the estimator believes about an endpoint, and on how much data, as gauges.
fn estimate_gauges(est: &Estimate) -> [(&'static str, u64); 4] {
    [
        ("prefill_tokens_per_s", est.rate.round() as u64),
        ("ttft_overhead_ms", (est.overhead_s * 1000.0).round() as u64),
        ("ttft_samples", est.total),
        (
            "kv_capacity_share_pct",
            (est.capacity_share * 100.0).round() as u64,
        ),
    ]
}

/// Whether a poll due at `next` is due `now`; if so, the next one is `interval` later. A
/// `next` more than an interval away means the wall clock stepped back: due now (else nothing
/// would be polled for as long as the step).
pub(super) fn due(next: &mut u64, now: u64, interval: u64) -> bool {
    if now < *next && *next <= now.saturating_add(interval) {
        return false;
    }
    // The next an interval after this one was due, so a tick that lands late does not
    // stretch the period; from now when behind by more than an interval (the first time, a
    // stall) or when the clock stepped back (`next` past `now + interval`).
    let on_time = next.saturating_add(interval);
    *next = match *next <= now && on_time > now {
        true => on_time,
        false => now.saturating_add(interval),
    };
    true
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The generation of the configuration with this hash: the stored one when it is the newest,
/// else the next (this configuration becomes the newest; then the flag is true). 0 when shared
/// data fails.
fn claim_generation<S: SharedStore + ?Sized>(s: &S, key: &str, hash: u64) -> (u64, bool) {
    let claimed = update(s, key, |old| {
        if old.len() >= 16 && read_u64(old, 0) == hash {
            return None;
        }
        let generation = read_u64(old, 8).saturating_add(1);
        let mut b = vec![0u8; 16];
        write_u64(&mut b, 0, hash);
        write_u64(&mut b, 8, generation);
        Some((b, generation))
    });
    match claimed {
        Ok(Some(g)) => (g, true),
        Ok(None) => match s.get(key) {
            Ok((Some(v), _)) => (read_u64(&v, 8), false),
            _ => (0, false),
        },
        Err(_) => (0, false),
    }
}

/// The HTTP status of a call's answer; 0 when it has none or it does not parse.
fn call_status<H: Host>(h: &H) -> u32 {
    h.call_response_header(":status")
        .ok()
        .flatten()
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// Admin's `/clusters?format=json` for cluster `name` alone: its `filter` parameter (an RE2
/// regex on cluster names) is the name, anchored and escaped. A mesh gateway holds a
/// cluster for every service it can reach, and the whole list runs to megabytes: more
/// than `MAX_CLUSTERS_BYTES`, and a large tree to parse in the VM each time. An Envoy
/// without `filter` ignores it and answers the whole list, which `cluster_hosts` reads as
/// well.
pub(super) fn clusters_path(name: &str) -> String {
    let mut regex = String::from("^");
    for c in name.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            regex.push('\\');
        }
        regex.push(c);
    }
    regex.push('$');
    let mut path = String::from("/clusters?format=json&filter=");
    for b in regex.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            path.push(char::from(b));
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    path
}

/// Hosts of cluster `want` in admin `/clusters?format=json`, with Envoy's health.
pub(super) fn cluster_hosts(body: &[u8], want: &str) -> Option<Vec<(String, bool)>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let cluster = v
        .get("cluster_statuses")?
        .as_array()?
        .iter()
        .find(|c| c.get("name").and_then(|n| n.as_str()) == Some(want))?;
    let Some(hosts) = cluster.get("host_statuses").and_then(|h| h.as_array()) else {
        return Some(Vec::new());
    };
    Some(
        hosts
            .iter()
            .filter_map(|h| {
                let a = h.get("address")?.get("socket_address")?;
                let ip = a.get("address")?.as_str()?;
                let port = a.get("port_value")?.as_u64()?;
                let addr = if ip.contains(':') {
                    format!("[{ip}]:{port}")
                } else {
                    format!("{ip}:{port}")
                };
                Some((addr, host_healthy(h.get("health_status"))))
            })
            .collect(),
    )
}

/// Envoy's view of one host (`health_status` in admin `/clusters?format=json`).
fn host_healthy(hs: Option<&serde_json::Value>) -> bool {
    let Some(hs) = hs else { return true };
    const FAILED: [&str; 6] = [
        "failed_active_health_check",
        "failed_outlier_check",
        "failed_active_degraded_check",
        "pending_dynamic_removal",
        "excluded_via_immediate_hc_fail",
        "active_hc_timeout",
    ];
    if FAILED
        .iter()
        .any(|k| hs.get(*k).and_then(|v| v.as_bool()) == Some(true))
    {
        return false;
    }
    !matches!(
        hs.get("eds_health_status").and_then(|v| v.as_str()),
        Some("UNHEALTHY" | "DRAINING" | "TIMEOUT")
    )
}

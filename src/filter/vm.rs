//! What one VM (one Envoy worker, or the main thread) keeps between requests: the config,
//! the router, its stats ids, and a decoded copy of the endpoint table from shared data,
//! re-read only when the table's version key changes. Also the debug view of the tables.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use serde_json::json;

use super::host::{Host, Level};
use super::stats::Stats;
use crate::config::Config;
use crate::endpoints::EndpointTable;
use crate::router::Router;
use crate::store::{Cas, RecentReads, SharedStore};

/// Shared-data keys (all under the configured namespace).
#[derive(Debug, Clone)]
pub struct Keys {
    /// The endpoint table, JSON.
    pub eps: String,
    /// Bumped after every table write; its CAS is the table's version.
    pub eps_version: String,
    /// The poller lease: owner id and expiry.
    pub lease: String,
    /// The newest plugin configuration: its hash and generation (see `root`).
    pub config: String,
    /// Each live VM's linear memory (see `memory`).
    pub vms: String,
}

impl Keys {
    pub fn new(namespace: &str) -> Keys {
        Keys {
            eps: format!("{namespace}/eps"),
            eps_version: format!("{namespace}/epsv"),
            lease: format!("{namespace}/lease"),
            config: format!("{namespace}/config"),
            vms: format!("{namespace}/vms"),
        }
    }
}

struct Cached {
    version: Option<Cas>,
    table: Rc<EndpointTable>,
}

pub struct Vm {
    pub cfg: Config,
    pub router: RefCell<Router>,
    pub stats: Stats,
    pub keys: Keys,
    /// This VM's id (lease owner, tie rotation seed).
    pub id: u64,
    static_table: Rc<EndpointTable>,
    cached: RefCell<Cached>,
    /// Shared-data reads decisions may reuse for `sharedReadMaxAgeMs`.
    pub recent: RecentReads,
    errors: Cell<u64>,
}

/// What a VM keeps of recent shared-data reads: a decision over 100 endpoints reads about
/// 250 KB (index headers, first buckets, ledgers).
const RECENT_READS_BYTES: usize = 512 * 1024;

impl Vm {
    pub fn new<H: Host + ?Sized>(h: &H, cfg: Config, id: u64) -> Vm {
        let static_table = Rc::new(EndpointTable::from_config(&cfg));
        let mut router = Router::new(cfg.clone());
        router.set_seq(id);
        let stats = Stats::define(h, cfg.stats_flush_ms);
        let vm = Vm {
            keys: Keys::new(&cfg.namespace),
            recent: RecentReads::new(cfg.shared_read_max_age_ms, RECENT_READS_BYTES),
            cfg,
            router: RefCell::new(router),
            stats,
            id,
            cached: RefCell::new(Cached {
                version: None,
                table: static_table.clone(),
            }),
            static_table,
            errors: Cell::new(0),
        };
        // By the table in shared data, whose slots may not be the static list's order: after
        // a reload one worker adopts the new list into free slots, and the others follow it.
        if let Ok(router) = vm.router.try_borrow() {
            let _ = router.sync_capacities(h, &vm.table(h).endpoints);
        }
        vm
    }

    /// The endpoint table as last written to shared data (the static list until then).
    /// Decodes only when the version changed.
    pub fn table<S: SharedStore + ?Sized>(&self, h: &S) -> Rc<EndpointTable> {
        let Ok(mut cached) = self.cached.try_borrow_mut() else {
            return self.static_table.clone();
        };
        let version = match h.get(&self.keys.eps_version) {
            Ok((_, v)) => v,
            Err(_) => return cached.table.clone(),
        };
        if version.is_none() || version == cached.version {
            return cached.table.clone();
        }
        if let Some(t) = self.stored_table(h) {
            cached.table = Rc::new(t);
            cached.version = version;
        }
        cached.table.clone()
    }

    /// The table in shared data, if any was written.
    pub fn stored_table<S: SharedStore + ?Sized>(&self, s: &S) -> Option<EndpointTable> {
        match s.get(&self.keys.eps) {
            Ok((Some(v), _)) if !v.is_empty() => EndpointTable::from_json(&v),
            _ => None,
        }
    }

    pub fn static_table(&self) -> &EndpointTable {
        &self.static_table
    }

    /// Logs an internal error on the request path: the first, then every power of two, so
    /// a persistent fault cannot flood the log. Never pass request content.
    pub fn log_error<H: Host + ?Sized>(&self, h: &H, what: &str) {
        let n = self.errors.get().wrapping_add(1);
        self.errors.set(n);
        if n.is_power_of_two() {
            h.log(
                Level::Error,
                &format!("tokenaware: {what} (error #{n} in this VM); request passed unrouted"),
            );
        }
    }

    /// The tables as JSON for the debug path: endpoints, their load and index clock.
    /// No request content is ever stored, so none can appear here.
    pub fn debug_json<H: Host + ?Sized>(&self, h: &H) -> Vec<u8> {
        let now = h.now_ms().unwrap_or(0);
        let table = self.table(h);
        let Ok(router) = self.router.try_borrow() else {
            return b"{\"error\":\"busy\"}".to_vec();
        };
        let eps: Vec<serde_json::Value> = table
            .endpoints
            .iter()
            .map(|e| {
                let (load, _, missed) = router.ledger.read_all(h, e.slot, now).unwrap_or_default();
                let m = router.index.matched(h, e.slot, &[]).unwrap_or_default();
                let est = router.estimator.read(h, e.slot).ok();
                json!({
                    "slot": e.slot,
                    "address": e.address,
                    "healthy": e.healthy,
                    "capacityBlocks": e.capacity_blocks,
                    "waiting": e.waiting,
                    "running": e.running,
                    "scrapedAtMs": e.scraped_at_ms,
                    "serverPrefillTokensPerS": e.served_work_per_s,
                    "inflightTokens": load.tokens,
                    "activeRequests": load.requests,
                    "prefilling": load.prefilling,
                    "predictedHitsMissedShare": (missed * 1000.0).round() / 1000.0,
                    "indexClock": m.clock,
                    "indexCapacity": m.capacity,
                    "estimate": est.map(|x| json!({
                        "prefillTokensPerS": x.rate.round(),
                        "overheadMs": (x.overhead_s * 1000.0).round(),
                        "perActiveRequestShare": (x.per_active * 1e4).round() / 1e4,
                        "learned": x.learned,
                        "ttftSamplesEffective": (x.observations * 10.0).round() / 10.0,
                        "ttftSamplesTotal": x.total,
                        "capacityShare": (x.capacity_share * 1000.0).round() / 1000.0,
                        "cacheChecks": x.cache_checks,
                        "cacheMisses": x.cache_misses,
                        "tauTokens": (x.rate * router.cfg.max_ttft_penalty_ms / 1000.0).round(),
                    })),
                })
            })
            .collect();
        let lease = match h.get(&self.keys.lease) {
            Ok((Some(v), _)) => super::root::Lease::decode(&v),
            _ => None,
        };
        let out = json!({
            "version": crate::VERSION,
            "policy": router.policy_name(),
            "tau": router.params.tau,
            "learning": router.cfg.learns(),
            "nowMs": now,
            "vm": format!("{:016x}", self.id),
            "poller": lease.map(|l| format!("{:016x}", l.owner)),
            "foreignRequestsShare": (table.foreign.share() * 1000.0).round() / 1000.0,
            "otherSendersSeen": table.foreign.seen,
            "coldPlacementChoices": router.params.cold_choices,
            "sharedPrefixes": router.params.shared_prefixes,
            // With `peers`: new placements this process has kept for the peers so far.
            "placementsShared": router.placements.as_ref().and_then(|l| l.end(h).ok()).map(|c| c.next),
            "endpoints": eps,
        });
        serde_json::to_vec_pretty(&out).unwrap_or_default()
    }
}

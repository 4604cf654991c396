//! The poller's side of `peers`: which replicas to ask, from where, and what their answers
//! teach. Replicas are named either one cluster each (`peers.clusters`) or as the hosts of
//! one cluster of all replicas (`peers.cluster`, read from Envoy's admin `/clusters`), each
//! polled pinned by the override_host header. A host that answers with this process's own
//! ring is this process, and is not asked again.

use std::collections::{HashMap, HashSet};

use super::host::{Host, HostError, Level};
use super::http::{DESTINATION, PEER_TOKEN};
use super::root::{cluster_hosts, clusters_path, due, Call};
use super::stats::Counter;
use super::vm::Vm;
use crate::config::{PeersConfig, MAX_PEERS};
use crate::peers::{Cursor, PeerCursors, PlacementBatch};

/// One replica to ask, by its name (the cluster, or the host's address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTarget {
    pub name: String,
}

/// How long a host that answered with this process's own ring goes unasked.
const SELF_RECHECK_MS: u64 = 60_000;

pub struct PeerPoller {
    cursors: PeerCursors,
    next_poll_ms: u64,
    next_members_ms: u64,
    /// With `peers.cluster`: its hosts as last read, sorted, at most `MAX_PEERS`.
    members: Vec<String>,
    /// Hosts that answered with this process's own ring, and until when they are not asked.
    selves: HashMap<String, u64>,
    /// Polls refused for a token that differs (for the log's rate limit).
    refusals: u64,
    /// Replicas whose last answer stopped at an entry numbered but not written.
    gaps: HashSet<String>,
    /// Polls failed in a row, per replica (for the log's rate limit).
    failing: HashMap<String, u64>,
    /// Reads of `peers.cluster`'s hosts failed in a row (likewise).
    members_failures: u64,
}

impl PeerPoller {
    pub fn new(namespace: &str) -> PeerPoller {
        PeerPoller {
            cursors: PeerCursors::new(namespace),
            next_poll_ms: 0,
            next_members_ms: 0,
            members: Vec::new(),
            selves: HashMap::new(),
            refusals: 0,
            gaps: HashSet::new(),
            failing: HashMap::new(),
            members_failures: 0,
        }
    }

    /// The replicas asked at `now` (this process left out).
    pub fn targets(&self, p: &PeersConfig, now: u64) -> Vec<PeerTarget> {
        let names = match p.cluster {
            None => &p.clusters,
            Some(_) => &self.members,
        };
        names
            .iter()
            .filter(|n| self.selves.get(*n).is_none_or(|&until| until <= now))
            .map(|n| PeerTarget { name: n.clone() })
            .collect()
    }

    /// When due: reads the cluster's hosts (if due too), then asks each replica for the
    /// placements it made since the last answer; at most one call in flight per replica.
    pub fn poll<H: Host>(
        &mut self,
        h: &H,
        vm: &Vm,
        now: u64,
        calls: &mut HashMap<u32, (Call, u64)>,
    ) {
        let Some(p) = vm.cfg.peers.as_ref() else {
            return;
        };
        if !due(&mut self.next_poll_ms, now, p.interval_ms) {
            return;
        }
        self.read_members(h, p, now, calls);
        for t in self.targets(p, now) {
            if calls
                .values()
                .any(|(c, _)| matches!(c, Call::Peer(x) if x.name == t.name))
            {
                continue;
            }
            let Ok(from) = self.cursors.get(h, &t.name) else {
                vm.stats.inc(h, Counter::PeerErrors);
                continue;
            };
            match ask(h, p, &t, from) {
                Ok(token) => {
                    calls.insert(token, (Call::Peer(t), now));
                }
                Err(_) => vm.stats.inc(h, Counter::PeerPollsFailed),
            }
        }
    }

    fn read_members<H: Host>(
        &mut self,
        h: &H,
        p: &PeersConfig,
        now: u64,
        calls: &mut HashMap<u32, (Call, u64)>,
    ) {
        let (Some(admin), Some(cluster)) = (p.admin_cluster.as_deref(), p.cluster.as_deref())
        else {
            return;
        };
        let busy = calls.values().any(|(c, _)| *c == Call::PeerMembers);
        if busy || !due(&mut self.next_members_ms, now, p.members_interval_ms()) {
            return;
        }
        let path = clusters_path(cluster);
        let hdrs = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", "envoy-admin"),
        ];
        match h.dispatch(admin, &hdrs, p.timeout_ms.max(1_000)) {
            Ok(token) => {
                calls.insert(token, (Call::PeerMembers, now));
            }
            Err(e) => {
                let why = format!(
                    "could not call peers.adminCluster `{admin}` ({})",
                    e.as_str()
                );
                self.members_failed(h, &why);
            }
        }
    }

    /// The replicas could not be read (the last ones known are still asked): say why in
    /// the log, the first time and at every power of two in a row.
    fn members_failed<H: Host>(&mut self, h: &H, why: &str) {
        self.members_failures = self.members_failures.saturating_add(1);
        let n = self.members_failures;
        if n.is_power_of_two() {
            h.log(
                Level::Warn,
                &format!("tokenaware: peers: reading the replicas failed ({n} in a row): {why}"),
            );
        }
    }

    /// Admin's `/clusters` (`status` 0 when it did not answer): the hosts of `peers.cluster`
    /// become the replicas asked. When they cannot be read, the last ones are kept and the
    /// log says why, the first time and at every power of two in a row.
    pub fn members_answered<H: Host>(
        &mut self,
        h: &H,
        p: &PeersConfig,
        status: u32,
        body: Option<&[u8]>,
    ) {
        let (Some(cluster), Some(admin)) = (p.cluster.as_deref(), p.admin_cluster.as_deref())
        else {
            return;
        };
        let Some(hosts) = body.and_then(|b| cluster_hosts(b, cluster)) else {
            let why = match status {
                200 => format!("lists no cluster named `{cluster}` (peers.cluster)"),
                0 => "did not answer".to_string(),
                s => format!("answered {s}"),
            };
            return self.members_failed(h, &format!("peers.adminCluster `{admin}` {why}"));
        };
        self.members_failures = 0;
        let mut members: Vec<String> = hosts.into_iter().map(|(a, _)| a).collect();
        members.sort();
        members.dedup();
        members.truncate(MAX_PEERS);
        self.selves.retain(|s, _| members.contains(s));
        self.gaps.retain(|s| members.contains(s));
        self.failing.retain(|s, _| members.contains(s));
        self.members = members;
    }

    /// A replica's answer (`status` 0 when there was none): its placements go into this
    /// gateway's index, and the next poll asks from where this one ended.
    pub fn answered<H: Host>(
        &mut self,
        h: &H,
        vm: &Vm,
        t: PeerTarget,
        status: u32,
        body: Option<Vec<u8>>,
    ) {
        if status == 403 {
            self.refused(h, &t);
        }
        let Some(batch) = body.as_deref().and_then(PlacementBatch::from_json) else {
            let why = match status {
                0 => "no answer".to_string(),
                200 => "an answer that is not one".to_string(),
                s => format!("status {s}"),
            };
            self.failed(h, &t, status, &why);
            return vm.stats.inc(h, Counter::PeerPollsFailed);
        };
        let asked = self.cursors.get(h, &t.name).unwrap_or_default();
        let Ok(r) = vm.router.try_borrow() else {
            return;
        };
        let own = r.placements.as_ref().and_then(|l| l.end(h).ok());
        let own = own.map(|c| c.ring).filter(|&ring| ring != 0);
        let now = h.now_ms().unwrap_or(0);
        if batch.ring != 0 && own == Some(batch.ring) && [0, batch.ring].contains(&asked.ring) {
            // This process, through the cluster of all replicas: nothing to learn. Asked
            // again later all the same: a poll Envoy could not pin to its host (one it
            // held unhealthy for a moment) was answered by another, this one among them.
            self.failing.remove(&t.name);
            vm.stats.inc(h, Counter::PeerPollsOk);
            self.selves
                .insert(t.name, now.saturating_add(SELF_RECHECK_MS));
            return;
        }
        let another = |ring| self.ring_of_another(h, vm, &t, ring);
        let known = asked.ring != 0 && batch.ring != 0;
        if own == Some(batch.ring) || (known && batch.ring != asked.ring && another(batch.ring)) {
            // Envoy could not pin the poll to `t` (it held it unhealthy a moment) and another
            // replica answered: its placements are its own cursor's to learn, and taken as
            // `t`'s they would replay its whole ring here and lose `t`'s place in its own.
            // (At the first answer `t`'s ring is not known yet; a restart of `t` is a new
            // ring that is no other replica's.)
            self.failed(h, &t, status, "answered by another replica");
            return vm.stats.inc(h, Counter::PeerPollsFailed);
        }
        self.failing.remove(&t.name);
        vm.stats.inc(h, Counter::PeerPollsOk);
        match r.learn_placements(h, &vm.table(h).endpoints, &batch, now) {
            Ok(n) => vm.stats.add(h, Counter::PeerPlacementsLearned, n as u64),
            Err(_) => return vm.stats.inc(h, Counter::PeerErrors),
        }
        let next = self.past_a_dead_gap(h, vm, &t, &batch);
        if self.cursors.set(h, &t.name, next).is_err() {
            vm.stats.inc(h, Counter::PeerErrors);
        }
    }

    /// Whether `ring` is where another replica than `t` was last asked from.
    fn ring_of_another<H: Host>(&self, h: &H, vm: &Vm, t: &PeerTarget, ring: u64) -> bool {
        let Some(p) = vm.cfg.peers.as_ref() else {
            return false;
        };
        let names = match p.cluster {
            None => &p.clusters,
            Some(_) => &self.members,
        };
        names
            .iter()
            .filter(|n| **n != t.name)
            .any(|n| self.cursors.get(h, n).is_ok_and(|c| c.ring == ring))
    }

    /// Where to ask `t` from next. An answer that stops at the same unwritten entry twice in
    /// a row has found one its writer will never fill: step over it, or every placement
    /// after it would wait until the ring laps.
    fn past_a_dead_gap<H: Host>(
        &mut self,
        h: &H,
        vm: &Vm,
        t: &PeerTarget,
        batch: &PlacementBatch,
    ) -> Cursor {
        let mut next = batch.cursor();
        let asked = self.cursors.get(h, &t.name).unwrap_or_default();
        if !batch.stopped_at_a_gap(asked) {
            self.gaps.remove(&t.name);
        } else if !self.gaps.insert(t.name.clone()) {
            self.gaps.remove(&t.name);
            next.next += 1;
            vm.stats.inc(h, Counter::PeerGapsSkipped);
        }
        next
    }

    /// A poll of `t` that brought no placements: say so in the log the first time, then at
    /// every power of two in a row (a replica starting, or gone for good, is a line or two,
    /// not one each poll). A refusal has its own line (`refused`).
    fn failed<H: Host>(&mut self, h: &H, t: &PeerTarget, status: u32, why: &str) {
        let n = self.failing.entry(t.name.clone()).or_insert(0);
        *n = n.saturating_add(1);
        if status == 403 || !n.is_power_of_two() {
            return;
        }
        h.log(
            Level::Warn,
            &format!(
                "tokenaware: peer {}: poll failed ({why}), {n} in a row; its placements are not learned meanwhile",
                t.name
            ),
        );
    }

    /// A replica that refuses the poll (403) holds another token: say so in the log (the
    /// first time, then every power of two), since only the operator can mend it.
    fn refused<H: Host>(&mut self, h: &H, t: &PeerTarget) {
        self.refusals = self.refusals.wrapping_add(1);
        if !self.refusals.is_power_of_two() {
            return;
        }
        h.log(
            Level::Warn,
            &format!(
                "tokenaware: peer {} refused a poll (403, #{}): its peers.token is not this gateway's",
                t.name, self.refusals
            ),
        );
    }
}

/// Asks replica `t` for its placements from `from` on.
fn ask<H: Host>(h: &H, p: &PeersConfig, t: &PeerTarget, from: Cursor) -> Result<u32, HostError> {
    let path = format!("{}?since={}&ring={}", p.path, from.next, from.ring);
    let token = p.token.as_ref().map_or("", |t| t.as_str());
    let mut hdrs = vec![
        (":method", "GET"),
        (":path", path.as_str()),
        (":authority", "tokenaware-peer"),
        (PEER_TOKEN, token),
    ];
    let cluster = match &p.cluster {
        None => t.name.as_str(),
        Some(c) => {
            hdrs.push((DESTINATION, t.name.as_str()));
            c.as_str()
        }
    };
    h.dispatch(cluster, &hdrs, p.timeout_ms)
}

//! The filter's Envoy stats, defined once per VM. Envoy prefixes each name with
//! `wasmcustom.` in admin `/stats` (Prometheus drops the prefix); counters add up across
//! worker VMs, gauges are last-writer-wins (so the VM memory gauges are summed through
//! shared data first, see `memory`). A metric that fails to define or update is
//! skipped: stats never fail a request.
//!
//! With `statsFlushMs` > 0 (the default) counter and histogram updates are held in the VM
//! and go out on a tick: each update is a hostcall, and six a request cost about 20 µs of
//! added latency in Envoy. Counters add up while held; histogram samples are kept one by
//! one, at most `MAX_HELD_SAMPLES` (then they go out at once).

use std::cell::{RefCell, RefMut};

use super::host::{Host, MetricKind};
use super::memory::Summary;
use crate::policy::Reason;
use crate::request::ParseError;

/// Why a request went on without a destination (to the cluster's fallback policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Body over `maxBodyBytes` (or the parser's own limit).
    TooLarge,
    NotJson,
    TooDeep,
    NotObject,
    NoModel,
    NoPrompt,
    WrongType,
    /// An inference path with no body at all.
    NoBody,
    NoEndpoints,
    Store,
    Internal,
}

impl Fallback {
    pub const ALL: [Fallback; 11] = [
        Fallback::TooLarge,
        Fallback::NotJson,
        Fallback::TooDeep,
        Fallback::NotObject,
        Fallback::NoModel,
        Fallback::NoPrompt,
        Fallback::WrongType,
        Fallback::NoBody,
        Fallback::NoEndpoints,
        Fallback::Store,
        Fallback::Internal,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Fallback::TooLarge => "too_large",
            Fallback::NotJson => "not_json",
            Fallback::TooDeep => "too_deep",
            Fallback::NotObject => "not_object",
            Fallback::NoModel => "no_model",
            Fallback::NoPrompt => "no_prompt",
            Fallback::WrongType => "wrong_type",
            Fallback::NoBody => "no_body",
            Fallback::NoEndpoints => "no_endpoints",
            Fallback::Store => "store",
            Fallback::Internal => "internal",
        }
    }

    pub const fn from_parse(e: ParseError) -> Fallback {
        match e {
            ParseError::TooLarge => Fallback::TooLarge,
            ParseError::NotJson => Fallback::NotJson,
            ParseError::TooDeep => Fallback::TooDeep,
            ParseError::NotObject => Fallback::NotObject,
            ParseError::NoModel => Fallback::NoModel,
            ParseError::NoPrompt => Fallback::NoPrompt,
            ParseError::WrongType(_) => Fallback::WrongType,
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// Plain counters (besides decisions and fallbacks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Requests that got a destination (and a ledger charge).
    Routed,
    /// Routed requests whose charge was returned at stream end.
    Released,
    /// Routed requests that failed before the first response byte (index insert undone).
    FailedEarly,
    TauBreaks,
    /// Routed requests answered by another endpoint than the picked one (Envoy retried on a
    /// fallback): the pick's index insert is undone.
    ServedByFallback,
    /// Requests that came with a client-sent destination header (removed).
    ClientHeaderStripped,
    PollsOk,
    PollsFailed,
    DiscoveryOk,
    DiscoveryFailed,
    /// Hosts discovery found and the table had no slot for (`maxEndpoints`).
    DiscoveryHostsDropped,
    UsagePromptTokens,
    UsageCachedTokens,
    /// Answers that ended well with no `usage` in their tail: nothing learned from them.
    UsageMissing,
    /// A ledger or index update at first byte / stream end failed.
    ReleaseErrors,
    /// `cached_tokens` confirmed the index's predicted hit.
    CacheHeld,
    /// `cached_tokens` fell short of the predicted hit: the endpoint evicted more than the
    /// index assumed (its capacity share is lowered).
    CacheMisses,
    /// Nothing was predicted, yet `cached_tokens` covered most of the prompt: the endpoint
    /// kept a prefix the index had let go of (its capacity share is raised), or, with other
    /// senders seen, a cold placement found another replica's prefix there.
    CacheKept,
    /// Endpoints seen to restart cold (their index entries dropped).
    EndpointResets,
    /// A TTFT sample or a `usage` observation could not be stored in the shared estimates,
    /// or the shared-prefix mark (`shared_prefixes`) could not be read or written.
    EstimateErrors,
    /// The model servers began to count requests another sender put there (another gateway
    /// replica): cold placement narrows to two endpoints, unless configured.
    OtherSendersSeen,
    /// Polls of a peer replica answered with a placement list (`peers`).
    PeerPollsOk,
    /// Polls of a peer replica that failed (no answer, not 200, not a placement list).
    PeerPollsFailed,
    /// New placements kept for the peers' polls.
    PeerPlacementsShared,
    /// Placements kept for the peers and taken back: the request failed before the picked
    /// endpoint answered.
    PeerPlacementsWithdrawn,
    /// Peers' placements inserted into this gateway's index.
    PeerPlacementsLearned,
    /// A placement could not be kept for the peers, or a peer's could not be inserted.
    PeerErrors,
    /// Asks on `peers.path` refused: no token, or not the replicas' (`peers.token`).
    PeerRequestsRefused,
    /// A peer's placement numbered but never written (its VM died), stepped over.
    PeerGapsSkipped,
    /// Routed requests the endpoint answered 4xx (a bad request, a prompt over its context,
    /// a rate limit): it took no prompt, so the charge and the index insert are undone.
    Refused,
}

impl Counter {
    pub const ALL: [Counter; 30] = [
        Counter::Routed,
        Counter::Released,
        Counter::FailedEarly,
        Counter::TauBreaks,
        Counter::ServedByFallback,
        Counter::ClientHeaderStripped,
        Counter::PollsOk,
        Counter::PollsFailed,
        Counter::DiscoveryOk,
        Counter::DiscoveryFailed,
        Counter::DiscoveryHostsDropped,
        Counter::UsagePromptTokens,
        Counter::UsageCachedTokens,
        Counter::UsageMissing,
        Counter::ReleaseErrors,
        Counter::CacheHeld,
        Counter::CacheMisses,
        Counter::CacheKept,
        Counter::EndpointResets,
        Counter::EstimateErrors,
        Counter::OtherSendersSeen,
        Counter::PeerPollsOk,
        Counter::PeerPollsFailed,
        Counter::PeerPlacementsShared,
        Counter::PeerPlacementsWithdrawn,
        Counter::PeerPlacementsLearned,
        Counter::PeerErrors,
        Counter::PeerRequestsRefused,
        Counter::PeerGapsSkipped,
        Counter::Refused,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Counter::Routed => "tokenaware_requests_routed",
            Counter::Released => "tokenaware_requests_released",
            Counter::FailedEarly => "tokenaware_requests_failed_early",
            Counter::TauBreaks => "tokenaware_tau_breaks",
            Counter::ServedByFallback => "tokenaware_served_by_fallback",
            Counter::ClientHeaderStripped => "tokenaware_client_header_stripped",
            Counter::PollsOk => "tokenaware_polls_ok",
            Counter::PollsFailed => "tokenaware_polls_failed",
            Counter::DiscoveryOk => "tokenaware_discovery_ok",
            Counter::DiscoveryFailed => "tokenaware_discovery_failed",
            Counter::DiscoveryHostsDropped => "tokenaware_discovery_hosts_dropped",
            Counter::UsagePromptTokens => "tokenaware_usage_prompt_tokens",
            Counter::UsageCachedTokens => "tokenaware_usage_cached_tokens",
            Counter::UsageMissing => "tokenaware_answers_without_usage",
            Counter::ReleaseErrors => "tokenaware_release_errors",
            Counter::CacheHeld => "tokenaware_cache_predictions_held",
            Counter::CacheMisses => "tokenaware_cache_predictions_missed",
            Counter::CacheKept => "tokenaware_cache_prefixes_kept",
            Counter::EndpointResets => "tokenaware_endpoint_resets",
            Counter::EstimateErrors => "tokenaware_estimate_errors",
            Counter::OtherSendersSeen => "tokenaware_other_senders_seen",
            Counter::PeerPollsOk => "tokenaware_peer_polls_ok",
            Counter::PeerPollsFailed => "tokenaware_peer_polls_failed",
            Counter::PeerPlacementsShared => "tokenaware_peer_placements_shared",
            Counter::PeerPlacementsWithdrawn => "tokenaware_peer_placements_withdrawn",
            Counter::PeerPlacementsLearned => "tokenaware_peer_placements_learned",
            Counter::PeerErrors => "tokenaware_peer_errors",
            Counter::PeerRequestsRefused => "tokenaware_peer_requests_refused",
            Counter::PeerGapsSkipped => "tokenaware_peer_gaps_skipped",
            Counter::Refused => "tokenaware_requests_refused",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

pub const HIT_RATIO: &str = "tokenaware_hit_ratio_pct";
/// Served prompt tokens (`usage.prompt_tokens`) per 100 estimated ones: how far
/// `bytesPerToken` is off for this traffic (100 = exact; 125 = the estimate is 20 % short).
pub const TOKEN_ESTIMATE: &str = "tokenaware_prompt_tokens_per_100_estimated";

/// Linear memory of this Envoy process's live filter VMs, summed (see `memory`).
pub const VM_MEMORY: &str = "tokenaware_vm_memory_bytes";
/// The largest one VM's linear memory.
pub const VM_MEMORY_MAX: &str = "tokenaware_vm_memory_max_bytes";
/// Live filter VMs in this Envoy process (workers and main thread).
pub const VMS: &str = "tokenaware_vms";
/// The share of the model servers' requests this gateway did not send, in per cent.
pub const FOREIGN_REQUESTS: &str = "tokenaware_foreign_requests_pct";
/// The share of recent cold placements whose answer found the prompt cached (another
/// replica had placed it), in per cent; counted only while other senders are seen.
pub const SHARED_PREFIXES: &str = "tokenaware_cold_found_cached_pct";
/// With `peers`: the replicas this gateway asks now (itself left out).
pub const PEERS: &str = "tokenaware_peers";

/// Name of the per-endpoint in-flight tokens gauge.
pub fn endpoint_gauge_name(slot: u16) -> String {
    format!("tokenaware_endpoint_{slot}_inflight_tokens")
}

/// Histogram samples held between flushes, at most (one request records two).
pub const MAX_HELD_SAMPLES: usize = 1_024;

/// Updates not yet sent to Envoy.
#[derive(Debug, Clone, Default)]
struct Updates {
    /// (metric id, sum); one entry per counter updated since the last flush.
    counters: Vec<(u32, u64)>,
    /// (metric id, value), in order.
    samples: Vec<(u32, u64)>,
}

#[derive(Debug, Clone, Default)]
struct Held {
    updates: Updates,
    last_flush_ms: u64,
}

/// Metric ids of one VM, and the updates it holds.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    decisions: [Option<u32>; Reason::ALL.len()],
    fallbacks: [Option<u32>; Fallback::ALL.len()],
    counters: [Option<u32>; Counter::ALL.len()],
    hit_ratio: Option<u32>,
    token_estimate: Option<u32>,
    /// Gauges: VM memory summed, the largest VM's, VM count.
    vm_memory: [Option<u32>; 3],
    /// `statsFlushMs`: 0 sends every update at once.
    flush_every_ms: u64,
    held: RefCell<Held>,
}

impl Stats {
    /// Defines every metric; updates are held `flush_every_ms` (0: none).
    pub fn define<H: Host + ?Sized>(h: &H, flush_every_ms: u64) -> Stats {
        let mut s = Stats {
            flush_every_ms,
            ..Stats::default()
        };
        for (slot, r) in s.decisions.iter_mut().zip(Reason::ALL) {
            *slot = h
                .define_metric(
                    MetricKind::Counter,
                    &format!("tokenaware_decisions_{}", r.as_str()),
                )
                .ok();
        }
        for (slot, f) in s.fallbacks.iter_mut().zip(Fallback::ALL) {
            *slot = h
                .define_metric(
                    MetricKind::Counter,
                    &format!("tokenaware_fallback_{}", f.as_str()),
                )
                .ok();
        }
        for (slot, c) in s.counters.iter_mut().zip(Counter::ALL) {
            *slot = h.define_metric(MetricKind::Counter, c.name()).ok();
        }
        s.hit_ratio = h.define_metric(MetricKind::Histogram, HIT_RATIO).ok();
        s.token_estimate = h.define_metric(MetricKind::Histogram, TOKEN_ESTIMATE).ok();
        for (slot, name) in s.vm_memory.iter_mut().zip([VM_MEMORY, VM_MEMORY_MAX, VMS]) {
            *slot = h.define_metric(MetricKind::Gauge, name).ok();
        }
        s
    }

    /// Sets the VM memory gauges.
    pub fn vm_memory<H: Host + ?Sized>(&self, h: &H, m: Summary) {
        for (id, v) in self
            .vm_memory
            .iter()
            .zip([m.total_bytes, m.max_bytes, m.vms])
        {
            if let Some(id) = id {
                let _ = h.record_metric(*id, v);
            }
        }
    }

    /// Sends the held updates when `now_ms` is `statsFlushMs` past the last flush.
    pub fn flush<H: Host + ?Sized>(&self, h: &H, now_ms: u64) {
        let updates = match self.held.try_borrow_mut() {
            Ok(mut held) if now_ms >= held.last_flush_ms.saturating_add(self.flush_every_ms) => {
                held.last_flush_ms = now_ms;
                std::mem::take(&mut held.updates)
            }
            _ => return,
        };
        send(h, updates);
    }

    /// Sends every held update, however recent.
    pub fn flush_all<H: Host + ?Sized>(&self, h: &H) {
        let updates = match self.held.try_borrow_mut() {
            Ok(mut held) => std::mem::take(&mut held.updates),
            Err(_) => return,
        };
        send(h, updates);
    }

    /// Updates held now.
    pub fn held_updates(&self) -> usize {
        self.held.try_borrow().map_or(0, |held| {
            held.updates.counters.len() + held.updates.samples.len()
        })
    }

    /// The held updates, when updates are held (and not already borrowed).
    fn holding(&self) -> Option<RefMut<'_, Held>> {
        (self.flush_every_ms > 0)
            .then(|| self.held.try_borrow_mut().ok())
            .flatten()
    }

    fn count<H: Host + ?Sized>(&self, h: &H, id: Option<u32>, n: u64) {
        let Some(id) = id else { return };
        let Some(mut held) = self.holding() else {
            let _ = h.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
            return;
        };
        let counters = &mut held.updates.counters;
        match counters.iter_mut().find(|(i, _)| *i == id) {
            Some((_, sum)) => *sum = sum.saturating_add(n),
            None => counters.push((id, n)),
        }
    }

    fn sample<H: Host + ?Sized>(&self, h: &H, id: Option<u32>, v: u64) {
        let Some(id) = id else { return };
        let Some(mut held) = self.holding() else {
            let _ = h.record_metric(id, v);
            return;
        };
        held.updates.samples.push((id, v));
        if held.updates.samples.len() >= MAX_HELD_SAMPLES {
            let samples = std::mem::take(&mut held.updates.samples);
            drop(held);
            let counters = Vec::new();
            send(h, Updates { counters, samples });
        }
    }

    pub fn add<H: Host + ?Sized>(&self, h: &H, c: Counter, n: u64) {
        if n > 0 {
            self.count(h, self.counters.get(c.index()).copied().flatten(), n);
        }
    }

    pub fn inc<H: Host + ?Sized>(&self, h: &H, c: Counter) {
        self.add(h, c, 1);
    }

    pub fn decision<H: Host + ?Sized>(&self, h: &H, r: Reason) {
        let i = Reason::ALL.iter().position(|x| *x == r);
        self.count(
            h,
            i.and_then(|i| self.decisions.get(i).copied().flatten()),
            1,
        );
    }

    pub fn fallback<H: Host + ?Sized>(&self, h: &H, f: Fallback) {
        self.count(h, self.fallbacks.get(f.index()).copied().flatten(), 1);
    }

    pub fn token_estimate<H: Host + ?Sized>(&self, h: &H, served: u64, estimated: u64) {
        if let Some(per_100) = served.saturating_mul(100).checked_div(estimated) {
            self.sample(h, self.token_estimate, per_100);
        }
    }

    pub fn hit_ratio<H: Host + ?Sized>(&self, h: &H, hit: f64) {
        let pct = (hit.clamp(0.0, 1.0) * 100.0).round() as u64;
        self.sample(h, self.hit_ratio, pct);
    }
}

fn send<H: Host + ?Sized>(h: &H, updates: Updates) {
    for (id, n) in updates.counters {
        let _ = h.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
    for (id, v) in updates.samples {
        let _ = h.record_metric(id, v);
    }
}

//! The decision for one request, end to end over the shared tables: match the prefix against
//! every healthy endpoint, read their load, let the policy pick, then charge the ledger and
//! record the prefix in the index at pick time. Also the request's later life: first byte,
//! end, failure. The simulator and the filter both call this; neither has its own policy.

use crate::config::{Config, PolicyName, TtftSource};
use crate::endpoints::Endpoint;
use crate::estimator::{
    cache_check, CacheCheck, Estimate, Estimator, ModelId, TtftSample, POOL_PRESSURE,
};
use crate::index::{AffinityIndex, InsertReceipt};
use crate::ledger::{blend, Charge, Load, LoadLedger, WORK_WINDOW_MS};
use crate::peers::{PlacementBatch, PlacementLog};
use crate::policy::{self, Ask, Candidate, Decision, Params, Policy, Reason};
use crate::prefix::{chain_seed, hash_prompt, BlockChain};
use crate::request::InferenceRequest;
use crate::shared_prefixes::SharedPrefixes;
use crate::store::{ReadCache, SharedStore, StoreError};

/// Why a request could not be routed; the caller lets Envoy's own balancing take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteError {
    NoEndpoints,
    Store,
}

impl RouteError {
    pub const fn as_str(self) -> &'static str {
        match self {
            RouteError::NoEndpoints => "no_endpoints",
            RouteError::Store => "store",
        }
    }
}

impl From<StoreError> for RouteError {
    fn from(_: StoreError) -> Self {
        RouteError::Store
    }
}

/// A routed request: where it went, and what it holds in the tables until it ends.
#[derive(Debug, Clone)]
pub struct Routed {
    pub decision: Decision,
    /// Picked endpoint first, then the fallbacks.
    pub addresses: Vec<String>,
    pub charge: Charge,
    pub receipt: InsertReceipt,
    /// Prompt tokens and the ones the picked endpoint must prefill.
    pub tokens: u64,
    pub uncached: u64,
    /// The picked endpoint's load at dispatch (real tokens), for the TTFT estimate.
    pub ahead: Load,
    /// The share of its KV pool running requests held at dispatch, as last scraped.
    pub kv_usage: f64,
    pub dispatch_ms: u64,
    /// Capacity of the picked endpoint in blocks before the cache correction.
    pub capacity_blocks: u64,
    /// LRU stack distance there of the prefix the index predicted cached, in blocks (none
    /// when it was first written there within T_max: it may still have been prefilling, or
    /// when running requests held past [`POOL_PRESSURE`] of the pool), over the share of
    /// the KV pool running requests left free at dispatch (see [`free_distance`]).
    pub distance_blocks: Option<u64>,
    /// Its first byte is its first token (a streamed answer): a TTFT sample. A
    /// non-streamed answer's first byte comes after the whole generation.
    pub ttft_sample: bool,
    /// What the answer's `usage` said of the index's prediction, once it came.
    pub cache_check: Option<CacheCheck>,
    first_byte_seen: bool,
    /// The TTFT sample, held from the first byte until `usage` says how many prompt tokens
    /// the server really had to prefill (or the request ends without it).
    pending_ttft: Option<TtftSample>,
    /// The uncached tokens the rate counted at the first byte (the index's prediction, or
    /// the whole prompt when the time said a miss), when it counted the sample: `usage`
    /// corrects them.
    rate_counted: Option<u64>,
}

/// What failed at a request's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstByteError {
    /// The ledger could not release the prefill tokens.
    Release(StoreError),
    /// The TTFT sample's busy time could not be stored (the release happened).
    Estimate(StoreError),
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Completed, or failed after the endpoint started answering.
    Done,
    /// Failed before any response byte (reset, connect failure, timeout, 5xx headers):
    /// the endpoint never cached the prompt, so the index insert is undone.
    FailedEarly,
}

/// An endpoint's load at dispatch (real tokens), the stack distance of its match, and the
/// share of its KV pool running requests held (as last scraped; 0 without a scrape).
type Seen = (Load, Option<u64>, f64);

/// A prefix's LRU stack distance as the cache correction weighs a miss: the blocks stamped
/// since its use, over the share of the KV pool the running requests left to the prefix
/// cache (vLLM's `kv_cache_usage_perc` counts the blocks they hold). A miss at distance `d`
/// while they hold a share `u` says the cache keeps fewer than `d / (1 - u)` blocks, not
/// fewer than `d`: a batch of long decodes shrinks the room for prefixes for a while, and
/// that is not a smaller cache. Past [`POOL_PRESSURE`] a miss teaches nothing (the router
/// drops its distance), so the share counts at most that.
pub fn free_distance(blocks: u64, kv_usage: f64) -> u64 {
    let used = if kv_usage.is_finite() {
        kv_usage.clamp(0.0, POOL_PRESSURE)
    } else {
        0.0
    };
    (blocks as f64 / (1.0 - used)) as u64
}

/// Cache checks an endpoint's share must rest on before it speaks for the fleet's.
const FLEET_SHARE_CHECKS: u64 = 32;

/// The share of its reported KV capacity the fleet keeps: the median over endpoints with at
/// least [`FLEET_SHARE_CHECKS`] cache checks (1 when none has). What an engine keeps of what
/// it reports is a setting of the deployment, alike on its endpoints, but each endpoint's
/// own share comes down only through misses it can explain, and the busiest one (its misses
/// under pool pressure, its hot prefixes held) may never see them: with its share high,
/// cold placement finds room there that is not, and it thrashes. So no endpoint's index
/// counts more than the fleet's share; one that keeps less still counts its own.
fn fleet_share(shares: impl Iterator<Item = (f64, u64)>) -> f64 {
    let mut known: Vec<f64> = shares
        .filter(|&(share, checks)| checks >= FLEET_SHARE_CHECKS && share.is_finite())
        .map(|(share, _)| share)
        .collect();
    if known.is_empty() {
        return 1.0;
    }
    known.sort_by(f64::total_cmp);
    // The middle one, or the mean of the middle two (the same index when the count is odd).
    let n = known.len();
    let at = |i: usize| known.get(i).copied().unwrap_or(1.0);
    ((at((n - 1) / 2) + at(n / 2)) / 2.0).clamp(0.0, 1.0)
}

/// Learned rates this much apart (as a share of the lower) or less count as one kind of
/// machine. The promotion rule's `PEER_BAND` reads speeds the same way.
const SPEED_CLASS_GAP: f64 = 0.15;

/// Each learned rate replaced by the mean of its class: the rates sorted, and a class ends
/// where the next is more than `SPEED_CLASS_GAP` (15 %) faster. Fleets are built from a few kinds
/// of machine; within a kind the estimates differ by their noise, and the busiest endpoints
/// (whose prefills share steps with the most decodes) read a few percent slow. Counted one
/// by one, a spread of −10 … +6 % (through Envoy, on a fleet of equal endpoints) placed cold
/// prefixes by noise; counted by kind, a fleet of one kind is routed as a calibrated run
/// routes it (docs/benchmarks.md, "Learned rates counted by kind of machine"). Kinds twice
/// apart stay apart.
pub fn speed_classes(rates: &[f64]) -> Vec<f64> {
    let kinds = machine_kinds(rates);
    let mut out = rates.to_vec();
    for kind in &kinds {
        let mean = kind.iter().map(|&i| rates[i]).sum::<f64>() / kind.len() as f64;
        for &i in kind {
            out[i] = mean;
        }
    }
    out
}

/// The indices of `rates` grouped by kind of machine, as `speed_classes` groups them.
fn machine_kinds(rates: &[f64]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..rates.len()).collect();
    order.sort_by(|&a, &b| rates[a].total_cmp(&rates[b]));
    let same_kind = |&lo: &usize, &hi: &usize| rates[hi] <= rates[lo] * (1.0 + SPEED_CLASS_GAP);
    order.chunk_by(same_kind).map(<[usize]>::to_vec).collect()
}

/// Learned estimates counted by kind of machine: each one's rate, fixed overhead and
/// per-request share replaced by its kind's means. The overhead fits of equal endpoints
/// differ by their noise too, and with the latency predictor an idle endpoint's predicted
/// wait is its overhead alone: counted one by one, the least-loaded pick sent every cold
/// placement to the endpoint whose fit came out lowest (simulator, mixed workload,
/// sticky-until-saturated: capacity at SLO 6 req/s against 8 for the fixed configurations).
fn pool_by_kind(estimates: &mut [&mut Estimate]) {
    let rates: Vec<f64> = estimates.iter().map(|e| e.rate).collect();
    for kind in machine_kinds(&rates) {
        let n = kind.len() as f64;
        let mean = |f: fn(&Estimate) -> f64| kind.iter().map(|&i| f(estimates[i])).sum::<f64>() / n;
        let (rate, overhead_s, per_active) = (
            mean(|e| e.rate),
            mean(|e| e.overhead_s),
            mean(|e| e.per_active),
        );
        for &i in &kind {
            let e = &mut *estimates[i];
            (e.rate, e.overhead_s, e.per_active) = (rate, overhead_s, per_active);
        }
    }
}

/// Until an endpoint's rate is learned, the tokenaware policy's τ counts R_peak as this many
/// times the prior (the range of error a preset is expected to have; the policy's bound of
/// eight prompts' worth still applies).
const PRIOR_DOUBT: f64 = 4.0;

/// The recent share of an endpoint's predicted hits that missed from which its queue counts
/// at what those misses cost.
const RUNAWAY_MISSED: f64 = 0.75;

/// An endpoint where most predicted hits miss is refilling what it evicts, in turn: most
/// requests queued there prefill their whole prompt, while the ledger holds only what the
/// index predicted (their questions). Through Envoy, one such endpoint took TTFT past 100 s
/// with every decision there sticky, told the truth about its cache or not. Its queue then
/// counts as its requests times this request's prompt times the missed share, so the gate
/// breaks and cold placements go elsewhere until holds bring the share down. Sporadic misses
/// (a busy fleet's, or a pool the running requests squeeze) stay under three quarters: at a
/// half, the simulator's pool model lost its p90 at 16 req/s (0.32 → 13.3 s); at three
/// quarters it kept it, and the endpoint that thrashed there with the index told twice the
/// cache no longer did (60 groups, 6 req/s: p90 5.64 → 2.45 s).
fn runaway(mut load: Load, missed: f64, prompt_tokens: u64) -> Load {
    if missed >= RUNAWAY_MISSED {
        let queued = load.prefilling as f64 * prompt_tokens as f64 * missed;
        load.tokens = load.tokens.max(queued as u64);
    }
    load
}

/// Cold-placement choices while other senders are seen and the config names none: two
/// replicas then place a new prefix on the same endpoint, or on its runner-up, where each
/// alone would pick its own least-loaded one (docs/benchmarks.md, "Several gateways").
pub const REPLICA_COLD_CHOICES: usize = 2;

pub struct Router {
    pub cfg: Config,
    pub params: Params,
    policy: Box<dyn Policy>,
    pub index: AffinityIndex,
    pub ledger: LoadLedger,
    pub estimator: Estimator,
    /// Params with τ from the learned rates, when they moved enough to matter.
    relearned: Option<Params>,
    /// Other senders are seen on the servers: each endpoint's recent work is then read from
    /// its own counters too, where every sender's is.
    replicas_seen: bool,
    /// Shared-data key of [`SharedPrefixes`] (built once).
    shared_key: String,
    /// This process's new placements, for peer replicas to poll (`peers` configured).
    pub placements: Option<PlacementLog>,
    seq: u64,
}

impl Router {
    pub fn new(cfg: Config) -> Router {
        let params = Params::from_config(&cfg);
        let per_endpoint = cfg.capacity_blocks(cfg.kv_capacity_tokens);
        let index = AffinityIndex::new(
            &cfg.namespace,
            per_endpoint.saturating_mul(u64::from(cfg.max_endpoints)),
            cfg.index_headroom,
        );
        let ledger = LoadLedger::new(&cfg.namespace, cfg.request_ttl_seconds);
        let estimator = Estimator::new(&cfg.namespace, cfg.peak_prefill(), cfg.bytes_per_token);
        Router {
            estimator,
            relearned: None,
            replicas_seen: false,
            shared_key: format!("{}/sp", cfg.namespace),
            placements: cfg
                .peers
                .as_ref()
                .map(|_| PlacementLog::new(&cfg.namespace)),
            policy: policy::build(cfg.policy, params),
            params,
            index,
            ledger,
            seq: 0,
            cfg,
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Seeds the per-request counter (rotation of ties), e.g. with a per-VM random value so
    /// worker VMs do not rotate in step.
    pub fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }

    /// Writes each endpoint's capacity into the index headers: the reported capacity, with
    /// learning times the share of it the endpoint keeps, never more than the fleet's share
    /// (`fleet_share`). Call on table changes and, when learning, now and then (the root's
    /// tick): the fleet's share moves with every endpoint's, and a request's `usage` syncs
    /// only its own endpoint.
    pub fn sync_capacities<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        eps: &[Endpoint],
    ) -> Result<(), StoreError> {
        if !self.cfg.learns() {
            for e in eps {
                self.index.set_capacity(s, e.slot, e.capacity_blocks)?;
            }
            return Ok(());
        }
        let est = eps
            .iter()
            .map(|e| self.estimator.read(s, e.slot))
            .collect::<Result<Vec<_>, _>>()?;
        let fleet = fleet_share(est.iter().map(|x| (x.capacity_share, x.cache_checks)));
        self.estimator.set_fleet_share(s, fleet)?;
        for (e, x) in eps.iter().zip(&est) {
            self.set_learned_capacity(s, e.slot, e.capacity_blocks, x.capacity_share.min(fleet))?;
        }
        Ok(())
    }

    /// Whether the model servers count requests another sender put there (the poller's
    /// `ForeignLoad`). Without `coldPlacementChoices` in the config, a cold prefix then may
    /// go only to its first two endpoints by rendezvous, so that replicas, which share no
    /// tables, mostly agree where it goes; a lone gateway places it anywhere.
    pub fn set_replicas_seen(&mut self, seen: bool) {
        self.replicas_seen = seen;
        if self.cfg.cold_placement_choices.is_some() {
            return;
        }
        // Peers tell each other where new prefixes went: no need to narrow the choice.
        let choices = match seen && self.placements.is_none() {
            true => REPLICA_COLD_CHOICES,
            false => 0,
        };
        if self.params.cold_choices != choices {
            self.params.cold_choices = choices;
            self.policy = policy::build(self.cfg.policy, self.params);
        }
    }

    /// The process-wide [`SharedPrefixes`] mark, as stored.
    pub fn shared_prefixes<S: SharedStore + ?Sized>(
        &self,
        s: &S,
    ) -> Result<SharedPrefixes, StoreError> {
        SharedPrefixes::read(s, &self.shared_key)
    }

    /// With other senders seen, reads whether they send this gateway's prefixes
    /// ([`SharedPrefixes`], counted per process): cold placement then leans to the first
    /// of a prefix's choices. A failed read keeps what was known.
    pub fn sync_shared_prefixes<S: SharedStore + ?Sized>(
        &mut self,
        s: &S,
    ) -> Result<(), StoreError> {
        let on = match self.replicas_seen {
            true => self.shared_prefixes(s)?.on,
            false => false,
        };
        if self.params.shared_prefixes != on {
            self.params.shared_prefixes = on;
            self.policy = policy::build(self.cfg.policy, self.params);
        }
        Ok(())
    }

    /// One endpoint's capacity after its share moved, capped by the fleet's share as the
    /// last full sync left it: a request's `usage` pays for one write, not a read of every
    /// endpoint (the root's tick does the full sync).
    fn sync_capacity<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        reported_blocks: u64,
        share: f64,
    ) -> Result<(), StoreError> {
        let fleet = self.estimator.fleet_share(s)?;
        self.set_learned_capacity(s, slot, reported_blocks, share.min(fleet))
    }

    fn set_learned_capacity<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        reported_blocks: u64,
        share: f64,
    ) -> Result<(), StoreError> {
        let blocks = ((reported_blocks as f64 * share) as u64).max(1);
        self.index.set_capacity(s, slot, blocks)
    }

    /// With `peers`, keeps a new copy of a prefix (a cold placement, a spill, a promotion)
    /// for the peers' next poll. Returns its sequence number when one was kept.
    pub fn share_placement<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        routed: &Routed,
        blocks: &[u64],
    ) -> Result<Option<u64>, StoreError> {
        let (Some(log), Some(address)) = (&self.placements, routed.addresses.first()) else {
            return Ok(None);
        };
        if !self.shares(routed) || blocks.is_empty() {
            return Ok(None);
        }
        // The ring is named at plugin start (`Root::configure`); should that have failed,
        // the first placement names it, and the name must still differ between processes
        // (a replica that reads its own ring takes it for itself): the time and this VM's
        // random sequence.
        let ring_seed = xxhash_rust::xxh64::xxh64(&self.seq.to_le_bytes(), routed.dispatch_ms);
        log.record(s, address, blocks, ring_seed).map(Some)
    }

    /// Takes back the placement `share_placement` numbered `seq`: its request failed before
    /// the endpoint answered, as its index insert here is rolled back. Peers that read it
    /// already keep it. Returns whether it was still held.
    pub fn withdraw_placement<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        seq: u64,
    ) -> Result<bool, StoreError> {
        match &self.placements {
            Some(log) => log.withdraw(s, seq),
            None => Ok(false),
        }
    }

    /// Whether `routed` is a placement `peers` are told of: a new copy of its prefix (cold,
    /// spill, promotion), with `peers` on.
    pub fn shares(&self, routed: &Routed) -> bool {
        self.placements.is_some()
            && matches!(
                routed.decision.reason,
                Reason::Cold | Reason::Spill | Reason::Promote
            )
    }

    /// Inserts what peer replicas placed into this gateway's index, under the endpoint with
    /// the same address (unknown addresses are skipped): the next request of such a prefix
    /// finds it warm where it already is. Returns how many placements were learned.
    pub fn learn_placements<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        eps: &[Endpoint],
        batch: &PlacementBatch,
        now_ms: u64,
    ) -> Result<usize, StoreError> {
        let mut learned = 0;
        let max = self.cfg.max_prefix_blocks as usize;
        for p in &batch.placements {
            let Some(e) = eps.iter().find(|e| e.address == p.address) else {
                continue;
            };
            let blocks = &p.blocks[..p.blocks.len().min(max)];
            self.index
                .insert(s, e.slot, blocks, (now_ms / 1000) as u32)?;
            learned += 1;
        }
        Ok(learned)
    }

    /// Forgets a removed (or cold-restarted) endpoint's index entries and load.
    pub fn clear_slot<S: SharedStore + ?Sized>(&self, s: &S, slot: u16) -> Result<(), StoreError> {
        self.index.clear_endpoint(s, slot)?;
        self.estimator.clear(s, slot)?;
        self.ledger.clear(s, slot)
    }

    /// Prompt tokens: exact when the client sent token ids, else estimated from bytes.
    pub fn prompt_tokens(&self, req: &InferenceRequest) -> u64 {
        match req.prompt_token_ids {
            Some(n) => n,
            None => (req.prompt.len() as f64 / self.cfg.bytes_per_token).ceil() as u64,
        }
    }

    /// Prompt tokens with the learned bytes per token of `model`, the request's (when the
    /// configuration learns), else as `prompt_tokens`. The caller hashes the model once and
    /// keeps it for what the answer teaches.
    pub fn estimate_tokens<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        req: &InferenceRequest,
        model: ModelId,
    ) -> u64 {
        if let (None, true) = (req.prompt_token_ids, self.cfg.learns()) {
            if let Ok(bpt) = self.estimator.bytes_per_token(s, model) {
                return (req.prompt.len() as f64 / bpt).ceil() as u64;
            }
        }
        self.prompt_tokens(req)
    }

    pub fn hash(&self, req: &InferenceRequest) -> BlockChain {
        let seed = chain_seed(&req.model, req.cache_salt.as_deref());
        hash_prompt(
            seed,
            &req.prompt,
            self.cfg.block_bytes(),
            self.cfg.max_prefix_blocks as usize,
        )
    }

    /// Picks an endpoint for a hashed prompt of `tokens` tokens and takes its place in the
    /// ledger and the index.
    pub fn route<S: SharedStore + ?Sized>(
        &mut self,
        s: &S,
        eps: &[Endpoint],
        chain: &BlockChain,
        tokens: u64,
        now_ms: u64,
    ) -> Result<Routed, RouteError> {
        let healthy: Vec<&Endpoint> = eps.iter().filter(|e| e.healthy).collect();
        if healthy.is_empty() {
            return Err(RouteError::NoEndpoints);
        }
        // The decision reads several keys twice (match, then charge and insert): keep them
        // for its span, unless the store already does.
        match s.keeps_reads() {
            true => self.route_healthy(s, &healthy, chain, tokens, now_ms),
            false => self.route_healthy(&ReadCache::new(s), &healthy, chain, tokens, now_ms),
        }
    }

    fn route_healthy<S: SharedStore + ?Sized>(
        &mut self,
        s: &S,
        healthy: &[&Endpoint],
        chain: &BlockChain,
        tokens: u64,
        now_ms: u64,
    ) -> Result<Routed, RouteError> {
        let (fleet, seen) = self.candidates(s, healthy, chain, tokens, now_ms)?;
        let ask = Ask {
            tokens,
            chain: &chain.hashes,
            block_tokens: self.block_tokens(chain, tokens),
        };
        self.seq = self.seq.wrapping_add(1);
        let decision = self
            .policy
            .pick(&ask, &fleet, self.seq)
            .ok_or(RouteError::NoEndpoints)?;
        if let Some(p) = self.relearned.take() {
            // τ moved with the learned rate: the next decision uses it.
            self.params = Params {
                cold_choices: self.params.cold_choices,
                shared_prefixes: self.params.shared_prefixes,
                ..p
            };
            self.policy = policy::build(self.cfg.policy, self.params);
        }
        let picked = healthy
            .get(decision.endpoint)
            .ok_or(RouteError::NoEndpoints)?;
        let uncached = fleet
            .get(decision.endpoint)
            .map(|c| ask.uncached(c))
            .unwrap_or(tokens);
        let cold = decision.reason == Reason::Cold;
        let mut charge = self
            .ledger
            .charge_placed(s, picked.slot, uncached, now_ms, cold)?;
        let receipt =
            match self
                .index
                .insert(s, picked.slot, chain.full_blocks(), (now_ms / 1000) as u32)
            {
                Ok(r) => r,
                Err(e) => {
                    // Never leave load behind on a path that does not return the charge.
                    let _ = self.ledger.release(s, &mut charge);
                    return Err(e.into());
                }
            };
        let addresses = std::iter::once(decision.endpoint)
            .chain(decision.fallbacks.iter().copied())
            .filter_map(|i| healthy.get(i).map(|e| e.address.clone()))
            .collect();
        let (ahead, distance_blocks, kv_usage) =
            seen.get(decision.endpoint).copied().unwrap_or_default();
        Ok(Routed {
            ahead,
            kv_usage,
            distance_blocks,
            decision,
            addresses,
            charge,
            receipt,
            tokens,
            uncached,
            dispatch_ms: now_ms,
            capacity_blocks: picked.capacity_blocks,
            ttft_sample: true,
            first_byte_seen: false,
            pending_ttft: None,
            rate_counted: None,
            cache_check: None,
        })
    }

    /// Tokens a block of this prompt holds. Blocks are a fixed number of bytes
    /// (`blockSizeTokens` × the configured bytes per token); the prompt's tokens may come
    /// from a learned bytes per token or be counted token ids (4 bytes each), and a block
    /// then holds as many tokens as the prompt has per byte: counted in configured tokens,
    /// a warm prompt's matched blocks would leave part of it looking uncached.
    fn block_tokens(&self, chain: &BlockChain, tokens: u64) -> u64 {
        match chain.bytes {
            0 => u64::from(self.cfg.block_size_tokens),
            b => ((self.cfg.block_bytes() as f64 * tokens as f64 / b as f64).round() as u64).max(1),
        }
    }

    /// The candidates as the policy sees them, and each one's load in real tokens and the
    /// stack distance of its match.
    fn candidates<S: SharedStore + ?Sized>(
        &mut self,
        s: &S,
        healthy: &[&Endpoint],
        chain: &BlockChain,
        tokens: u64,
        now_ms: u64,
    ) -> Result<(Vec<Candidate>, Vec<Seen>), StoreError> {
        // A match first written within T_max may be a prompt still prefilling there: its
        // miss would not be evidence about the cache's size.
        let settled_s = (self.cfg.max_ttft_penalty_ms / 1000.0).ceil() as u32;
        let now_s = (now_ms / 1000) as u32;
        let stale = self
            .cfg
            .metrics
            .as_ref()
            .map(|m| m.stale_after_ms)
            .unwrap_or(0);
        healthy
            .iter()
            .map(|e| {
                let m = self.index.matched(s, e.slot, &chain.hashes)?;
                let (local, own_work, missed) = self.ledger.read_all(s, e.slot, now_ms)?;
                let scraped = e.scraped(now_ms, stale);
                let work_per_s = match (self.replicas_seen, scraped) {
                    (true, Some(_)) => {
                        // The servers' counters show a request once it is scheduled there
                        // (vLLM) and a poll has read them: what this gateway sent since the
                        // last poll is in its ledger alone, and counts on top, as a window's
                        // worth of work. (Counting all its tokens in flight counted each
                        // prefill twice, and steered this gateway away from its own fills
                        // more than from the other's.)
                        let since =
                            self.ledger
                                .charged_since(s, e.slot, now_ms, e.scraped_at_ms)?;
                        let pending = since.saturating_mul(1000) / WORK_WINDOW_MS;
                        let served = e.served_work_per_s.unwrap_or(0);
                        own_work.max(served.saturating_add(pending))
                    }
                    _ => own_work,
                };
                let raw = runaway(blend(local, scraped, tokens), missed, tokens);
                let est = match self.cfg.learns() {
                    true => Some(self.estimator.read(s, e.slot)?),
                    false => None,
                };
                let placed = match self.replicas_seen && self.params.shared_prefixes {
                    true => self.ledger.placed(s, e.slot, now_ms)?,
                    false => 0.0,
                };
                let c = Candidate {
                    id: e.id(),
                    matched_blocks: m.blocks,
                    load: raw,
                    clock: m.clock,
                    capacity: m.capacity,
                    work_per_s,
                    recalled: m.recalled,
                    held: m.held,
                    victim_idle_s: m
                        .victim_used_s
                        .map(|t| ((now_ms / 1000) as u32).saturating_sub(t)),
                    rank: m.rank,
                    idle_s: m.used_s.map(|t| ((now_ms / 1000) as u32).saturating_sub(t)),
                    speed: 1.0,
                    placed,
                };
                let settled = m
                    .written_s
                    .is_some_and(|w| now_s.saturating_sub(w) >= settled_s);
                let kv_usage = scraped.map_or(0.0, |m| m.kv_usage);
                // Past POOL_PRESSURE the running requests squeeze the prefix cache: a miss
                // there is about the batch, not the cache's size.
                let distance = m
                    .distance
                    .filter(|_| settled && kv_usage < POOL_PRESSURE)
                    .map(|d| free_distance(d, kv_usage));
                Ok(((c, est), (raw, distance, kv_usage)))
            })
            .collect::<Result<Vec<_>, StoreError>>()
            .map(|v| {
                let (with_est, seen): (Vec<_>, Vec<_>) = v.into_iter().unzip();
                (self.in_reference_tokens(with_est), seen)
            })
    }

    /// With learned estimates, an endpoint's queue counts as its predicted wait times the
    /// reference rate: the mean learned R̂ of the candidates (self-calibrating τ =
    /// mean R̂ × T_max), or the configured R_peak when `tau` is given directly. τ then means
    /// "T_max of predicted wait" on every endpoint, fast or slow; with the latency predictor
    /// the wait includes the fixed overhead and what the running batch adds.
    fn in_reference_tokens(
        &mut self,
        mut with_est: Vec<(Candidate, Option<Estimate>)>,
    ) -> Vec<Candidate> {
        if with_est.iter().all(|(_, e)| e.is_none()) {
            return with_est.into_iter().map(|(c, _)| c).collect();
        }
        // Endpoints still on the prior count at the learned mean: an endpoint made to look
        // slow by a wrong prior would get no traffic and so never learn.
        let learned: Vec<f64> = with_est
            .iter()
            .filter_map(|(_, e)| e.filter(|e| e.learned).map(|e| e.rate))
            .collect();
        // Each endpoint counts at its kind's estimates (`pool_by_kind`).
        let mut kinds: Vec<&mut Estimate> = with_est
            .iter_mut()
            .filter_map(|(_, e)| e.as_mut().filter(|e| e.learned))
            .collect();
        pool_by_kind(&mut kinds);
        let mean = match learned.len() {
            0 => self.estimator.prior_rate,
            n => learned.iter().sum::<f64>() / n as f64,
        };
        let reference = match self.cfg.tau {
            Some(_) => self.estimator.prior_rate,
            None => mean,
        };
        // Before any rate is learned τ rests on the prior alone, which may be far off, and
        // the two errors are not alike: a τ too low spills hot prefixes into cold fills
        // across the fleet, a state that outlasts the learning (simulator, a prior 4x too
        // low: capacity at SLO under 54 req/s in six seeds of ten, against 63 calibrated),
        // while one too high only queues a little longer for the first few seconds. So
        // until then τ leans sticky, where the policy bounds τ by the prompt (tokenaware:
        // eight prompts' worth at most); sticky-until-saturated has no such bound and keeps
        // llm-d's τ from the prior.
        let unsure = learned.is_empty() && self.cfg.tau.is_none();
        let doubt = match unsure && self.cfg.policy == PolicyName::Tokenaware {
            true => PRIOR_DOUBT,
            false => 1.0,
        };
        let tau = reference * self.cfg.max_ttft_penalty_ms / 1000.0 * doubt;
        if self.cfg.tau.is_none() && (tau - self.params.tau).abs() > 0.01 * self.params.tau {
            self.relearned = Some(Params { tau, ..self.params });
        }
        let latency = self.cfg.ttft_source == TtftSource::LatencyPredictor;
        with_est
            .into_iter()
            .map(|(c, est)| {
                let Some(mut est) = est else { return c };
                if !est.learned {
                    est.rate = mean;
                }
                let wait_s = if latency {
                    est.ttft_s(c.load.tokens, c.load.requests)
                } else {
                    c.load.tokens as f64 / est.rate
                };
                Candidate {
                    load: Load {
                        tokens: (wait_s * reference) as u64,
                        ..c.load
                    },
                    speed: est.rate / reference,
                    ..c
                }
            })
            .collect()
    }

    /// The first response byte: the prompt is prefilled, its tokens leave the ledger. A
    /// streamed answer's first byte is also a TTFT sample, held until `usage` (or the end).
    pub fn first_byte<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        r: &mut Routed,
        now_ms: u64,
    ) -> Result<(), FirstByteError> {
        if r.first_byte_seen {
            return Ok(());
        }
        r.first_byte_seen = true;
        let released = self
            .ledger
            .release_prefill(s, &mut r.charge)
            .map_err(FirstByteError::Release);
        // Without learning nothing reads the estimates: no store work for them.
        if !(r.ttft_sample && self.cfg.learns()) {
            return released;
        }
        let sample = TtftSample {
            dispatch_ms: r.dispatch_ms,
            first_byte_ms: now_ms,
            ahead: r.ahead.tokens,
            uncached: r.uncached,
            active: r.ahead.requests,
            kv_usage: r.kv_usage,
        };
        r.pending_ttft = Some(sample);
        let counted = self
            .estimator
            .observe_first_byte(s, r.charge.slot, &sample, r.tokens);
        r.rate_counted = counted.as_ref().ok().copied().flatten();
        released.and(counted.map(|_| ()).map_err(FirstByteError::Estimate))
    }

    /// The held TTFT sample, with the tokens the server prefilled when `usage` told them
    /// (prompt − cached), else the ones the rate counted, else the index's prediction (a
    /// hit the index predicted but the server had evicted would otherwise teach a rate far
    /// too low), and the uncached tokens the rate counted at the first byte. Taken once.
    fn take_ttft(
        r: &mut Routed,
        served_uncached: Option<u64>,
    ) -> Option<(TtftSample, Option<u64>)> {
        let mut sample = r.pending_ttft.take()?;
        let counted = r.rate_counted.take();
        // Without usage, the tokens the rate counted stand (a predicted hit counted as a
        // miss stays one).
        if let Some(u) = served_uncached.or(counted) {
            sample.uncached = u;
        }
        Some((sample, counted))
    }

    /// `usage` of the answer: the served prompt tokens (against the request's model and
    /// bytes of canonical prompt, 0 when the client sent token ids) and the tokens the server
    /// found cached. A predicted hit that missed lowers the capacity the index assumes for
    /// the endpoint (the fleet's share, which caps it, moves at the next full sync).
    pub fn observe_usage<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        r: &mut Routed,
        (model, prompt_bytes): (impl Into<ModelId>, u64),
        prompt_tokens: u64,
        cached_tokens: Option<u64>,
    ) -> Result<CacheCheck, StoreError> {
        if !plausible_usage(r.tokens, prompt_bytes, prompt_tokens, cached_tokens) {
            // About something else (a broken server, a proxy between): it teaches nothing,
            // and the TTFT sample counts with the tokens predicted (at `finish`).
            return Ok(CacheCheck::NotPredicted);
        }
        let predicted = r.tokens.saturating_sub(r.uncached);
        let block_tokens = u64::from(self.cfg.block_size_tokens);
        let prompt = prompt_tokens.max(r.tokens);
        let check = cached_tokens.map_or(CacheCheck::NotPredicted, |c| {
            cache_check(predicted, c, prompt, block_tokens)
        });
        r.cache_check = Some(check);
        // A cold placement found cached, while other senders are seen, is another replica's
        // prefix (`SharedPrefixes`), not one the index forgot: it says nothing about the
        // endpoint's cache size.
        let cold = r.decision.reason == Reason::Cold && self.replicas_seen;
        let learned_check = match (cold, check) {
            (true, CacheCheck::Kept) => CacheCheck::NotPredicted,
            _ => check,
        };
        // Only placements with nothing predicted tell (`Kept` or `NotPredicted`).
        let unpredicted = matches!(check, CacheCheck::Kept | CacheCheck::NotPredicted);
        let recorded = match cold && cached_tokens.is_some() && unpredicted {
            true => SharedPrefixes::record(s, &self.shared_key, check == CacheCheck::Kept)
                .map(|_| check),
            false => Ok(check),
        };
        // The check still counts in the stats; only learning needs the shared estimates.
        if !self.cfg.learns() {
            return recorded;
        }
        self.estimator
            .observe_bytes_per_token(s, model, prompt_bytes, prompt_tokens)?;
        let served = cached_tokens.map(|c| prompt_tokens.saturating_sub(c));
        let ttft = Self::take_ttft(r, served.filter(|_| prompt_tokens > 0));
        let ttft = ttft.as_ref().map(|(sample, counted)| (sample, *counted));
        let depth = r
            .distance_blocks
            .map(|d| d as f64 / r.capacity_blocks.max(1) as f64);
        let share = self
            .estimator
            .observe_served(s, r.charge.slot, ttft, learned_check, depth)?;
        if let Some(share) = share {
            self.sync_capacity(s, r.charge.slot, r.capacity_blocks, share)?;
        }
        recorded
    }

    /// The end of a request whose endpoint no longer holds the slot it was charged on (it
    /// left; the slot may have a new owner): only the charge goes back, and the ledger's
    /// tenure says whether it is still there to return. What the answer would teach, or
    /// undo in the index, belongs to no endpoint routed to now.
    pub fn finish_departed<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        r: &mut Routed,
    ) -> Result<(), StoreError> {
        self.ledger.release(s, &mut r.charge)
    }

    /// The request ended. Idempotent.
    pub fn finish<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        r: &mut Routed,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        // No `usage` came: the sample counts with the predicted uncached tokens. Best effort:
        // a lost sample only slows the learning, and must not fail the release.
        if let Some((sample, counted)) = Self::take_ttft(r, None) {
            let _ = self
                .estimator
                .observe_ttft(s, r.charge.slot, &sample, counted);
        }
        // The rollback is tried once (its receipt is taken); whatever it comes to, the charge
        // is returned: a rollback that lost its CAS races must not keep the load on.
        let rolled_back = if outcome == Outcome::FailedEarly
            && !r.first_byte_seen
            && !r.receipt.written.is_empty()
        {
            let receipt = std::mem::take(&mut r.receipt);
            self.index.rollback(s, &receipt)
        } else {
            Ok(())
        };
        let missed = match r.cache_check {
            Some(CacheCheck::Missed) => Some(true),
            Some(CacheCheck::Held) => Some(false),
            _ => None,
        };
        let released = self.ledger.release_checked(s, &mut r.charge, missed);
        released.and(rolled_back)
    }
}

/// Tokens a chat template may add to a prompt (roles, special tokens, tool schemas).
const TEMPLATE_TOKENS: u64 = 4_096;

/// Whether `usage.prompt_tokens` could be this prompt's: no tokenizer makes more than two
/// tokens of a byte (the learned bytes per token stop at 0.5), and token ids are counted
/// exactly; a chat template adds some on top. No more of them can be cached than there are.
fn plausible_usage(
    estimated: u64,
    prompt_bytes: u64,
    prompt_tokens: u64,
    cached_tokens: Option<u64>,
) -> bool {
    let most = match prompt_bytes {
        0 => estimated,
        b => b.saturating_mul(2),
    };
    prompt_tokens <= most.saturating_add(TEMPLATE_TOKENS)
        && cached_tokens.is_none_or(|c| c <= prompt_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::EndpointTable;
    use crate::request::{parse, ApiKind, ParseLimits};
    use crate::store::MemStore;

    fn router(extra: &str) -> (Router, EndpointTable, MemStore) {
        let json = format!(
            r#"{{"endpoints":[{{"address":"127.0.0.1:8001"}},{{"address":"127.0.0.1:8002"}},{{"address":"127.0.0.1:8003"}}],"maxEndpoints":4{extra}}}"#
        );
        let cfg = Config::from_json(json.as_bytes()).unwrap();
        let table = EndpointTable::from_config(&cfg);
        let r = Router::new(cfg);
        let s = MemStore::new();
        r.sync_capacities(&s, &table.endpoints).unwrap();
        (r, table, s)
    }

    #[test]
    fn replicas_count_the_servers_own_prefill_work() {
        // Another gateway's cold fills are in a server's counters, not in this ledger: while
        // other senders are seen, an endpoint busy with them is not taken for an idle one.
        let now = 5_000;
        let (_, mut t, _) = router("");
        for e in &mut t.endpoints {
            e.scraped_at_ms = now;
        }
        // Each pick on fresh tables, so the prompt is cold every time.
        let pick = |t: &EndpointTable, replicas: bool| {
            let (mut r, _, s) = router(r#","coldPlacementChoices":3"#);
            r.set_replicas_seen(replicas);
            let chain = r.hash(&chat(&"x".repeat(4_000), "q"));
            let routed = r.route(&s, &t.endpoints, &chain, 1_000, now).unwrap();
            assert_eq!(routed.decision.reason, crate::policy::Reason::Cold);
            routed.addresses[0].clone()
        };
        let first = pick(&t, true);
        let busy = t.endpoints.iter().position(|e| e.address == first).unwrap();
        t.endpoints[busy].served_work_per_s = Some(5_000);
        assert_ne!(pick(&t, true), first);
        // A lone gateway's ledger has all the work there is: the counters are not read.
        assert_eq!(pick(&t, false), first);
        // Nor are they from a stale scrape.
        t.endpoints[busy].scraped_at_ms = 0;
        assert_eq!(pick(&t, true), first);
    }

    #[test]
    fn cold_placements_found_cached_mark_shared_prefixes() {
        // Replicas dealt round robin: this gateway's cold placements come back cached
        // (another replica placed the prefix there first). Past the mark, cold placement
        // leans to a prefix's first choice. Replicas behind affinity, whose cold placements
        // come back uncached, and a lone gateway, which records nothing, are not marked.
        let run = |replicas: bool, cached: u64| {
            let (mut r, t, s) = router("");
            r.set_replicas_seen(replicas);
            for p in 0..40u64 {
                let chain = r.hash(&chat(&format!("{p:04}{}", "x".repeat(4_000)), "q"));
                let mut routed = r.route(&s, &t.endpoints, &chain, 1_000, p * 100).unwrap();
                assert_eq!(routed.decision.reason, Reason::Cold);
                r.observe_usage(&s, &mut routed, ("m", 4_000), 1_000, Some(cached))
                    .unwrap();
                r.finish(&s, &mut routed, Outcome::Done).unwrap();
            }
            r.sync_shared_prefixes(&s).unwrap();
            (
                r.params.shared_prefixes,
                r.shared_prefixes(&s).unwrap().share(),
            )
        };
        let (on, share) = run(true, 900);
        assert!(on && share > 0.99, "{on} {share}");
        assert_eq!(run(true, 0), (false, 0.0));
        assert_eq!(run(false, 900), (false, 0.0));
    }

    #[test]
    fn a_replicas_own_fills_count_on_top_of_what_the_servers_counted() {
        // The servers' counters show a cold fill only once it is scheduled and polled. Until
        // then it is in this gateway's ledger alone, and must add to the servers' rate, not
        // hide under it:
        // taking the larger of the two let one gateway put five cold fills in a row on the
        // endpoint whose counters read least (through Envoy, two gateways by tenant).
        let now = 5_000;
        let (mut r, mut t, s) = router("");
        for e in &mut t.endpoints {
            e.scraped_at_ms = now;
            e.served_work_per_s = Some(1_000);
        }
        r.set_replicas_seen(true);
        let healthy: Vec<&Endpoint> = t.endpoints.iter().collect();
        let chain = r.hash(&chat(&"x".repeat(4_000), "q"));
        let routed = r.route(&s, &t.endpoints, &chain, 1_000, now).unwrap();
        assert_eq!(routed.decision.reason, crate::policy::Reason::Cold);
        let (fleet, _) = r.candidates(&s, &healthy, &chain, 1_000, now).unwrap();
        let pending = routed.uncached * 1_000 / WORK_WINDOW_MS;
        assert!(pending > 0);
        for (c, e) in fleet.iter().zip(&t.endpoints) {
            let expected = match e.address == routed.addresses[0] {
                true => 1_000 + pending,
                false => 1_000,
            };
            assert_eq!(c.work_per_s, expected, "{}", e.address);
        }
        // Once a poll after the charge has read the servers' counters, they show it (a
        // poll at the very moment: this config has no metrics, so any older one is stale).
        let later = now + 600;
        for e in &mut t.endpoints {
            e.scraped_at_ms = later;
        }
        let healthy: Vec<&Endpoint> = t.endpoints.iter().collect();
        let (fleet, _) = r.candidates(&s, &healthy, &chain, 1_000, later).unwrap();
        let works: Vec<u64> = fleet.iter().map(|c| c.work_per_s).collect();
        assert!(works.iter().all(|&w| w == 1_000), "{works:?}");
        // A lone gateway counts its own work only.
        r.set_replicas_seen(false);
        let (fleet, _) = r.candidates(&s, &healthy, &chain, 1_000, now).unwrap();
        assert!(fleet.iter().all(|c| c.work_per_s < 1_000));
    }

    #[test]
    fn a_warm_prompt_counts_its_blocks_at_the_learned_bytes_per_token() {
        let (mut r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        // This model's prompts run 2 bytes a token, against the configured 4.
        for _ in 0..10 {
            r.estimator
                .observe_bytes_per_token(&s, "m", 2_000, 1_000)
                .unwrap();
        }
        let req = chat(&"x".repeat(40_000), "q");
        let chain = r.hash(&req);
        let tokens = r.estimate_tokens(&s, &req, ModelId::from(req.model.as_str()));
        let mut first = r.route(&s, &t.endpoints, &chain, tokens, 1_000).unwrap();
        r.first_byte(&s, &mut first, 1_100).unwrap();
        r.finish(&s, &mut first, Outcome::Done).unwrap();
        let second = r.route(&s, &t.endpoints, &chain, tokens, 2_000).unwrap();
        assert!(second.decision.hit > 0.99);
        // Only the partial last block is uncached: under a block's 128 tokens.
        assert!(second.uncached < 128, "{} of {tokens}", second.uncached);
    }

    fn chat(system: &str, question: &str) -> InferenceRequest {
        let body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]
        });
        parse(
            ApiKind::ChatCompletions,
            body.to_string().as_bytes(),
            &ParseLimits::default(),
        )
        .unwrap()
    }

    /// Requests refused before their first byte (a model the servers do not serve, a 429
    /// storm) were never prefilled: rolled back, they push no warm prefix out of the index.
    #[test]
    fn refused_requests_leave_a_warm_prefix_warm() {
        let (mut r, t, s) = router("");
        let hot = chat(&"S".repeat(40_000), "q");
        let (chain, tokens) = (r.hash(&hot), r.prompt_tokens(&hot));
        let mut first = r.route(&s, &t.endpoints, &chain, tokens, 1_000).unwrap();
        r.first_byte(&s, &mut first, 1_100).unwrap();
        r.finish(&s, &mut first, Outcome::Done).unwrap();
        for i in 0..60 {
            let refused = chat(&format!("{i:06}{}", "j".repeat(600_000)), "x");
            let c = r.hash(&refused);
            let tokens = r.prompt_tokens(&refused);
            let mut j = r.route(&s, &t.endpoints, &c, tokens, 2_000 + i).unwrap();
            r.finish(&s, &mut j, Outcome::FailedEarly).unwrap();
        }
        let after = r.route(&s, &t.endpoints, &chain, tokens, 10_000).unwrap();
        assert_eq!(
            after.decision.reason,
            Reason::Sticky,
            "{:?}",
            after.decision
        );
        assert_eq!(after.addresses[0], first.addresses[0]);
    }

    /// A repeated prompt of three blocks and a bit is warm at the default threshold: its
    /// partial last block counts by its size, not as a whole missed block (3 of 4, 0.75).
    #[test]
    fn a_short_repeated_prompt_is_warm() {
        let (mut r, t, s) = router("");
        let block = r.cfg.block_bytes();
        let short = chat(&"s".repeat(3 * block + block / 8), "");
        let (chain, tokens) = (r.hash(&short), r.prompt_tokens(&short));
        assert_eq!(chain.full_blocks().len() + 1, chain.len());
        let mut first = r.route(&s, &t.endpoints, &chain, tokens, 1_000).unwrap();
        r.finish(&s, &mut first, Outcome::Done).unwrap();
        let again = r.route(&s, &t.endpoints, &chain, tokens, 2_000).unwrap();
        assert_eq!(
            again.decision.reason,
            Reason::Sticky,
            "{:?}",
            again.decision
        );
        assert!(again.decision.hit > 0.8 && again.decision.hit < 1.0);
    }

    #[test]
    fn shared_prefix_sticks_then_releases() {
        let (mut r, t, s) = router("");
        let sys = "You are a careful assistant. ".repeat(400);
        let mut open = Vec::new();
        for q in 0..6 {
            let req = chat(&sys, &format!("question {q}"));
            let chain = r.hash(&req);
            let routed = r
                .route(&s, &t.endpoints, &chain, r.prompt_tokens(&req), q)
                .unwrap();
            open.push(routed);
        }
        let first = &open[0].addresses[0];
        assert!(open.iter().all(|o| &o.addresses[0] == first));
        assert_eq!(open[1].decision.reason, policy::Reason::Sticky);
        assert_eq!(open[0].addresses.len(), 3);
        for o in open.iter_mut() {
            r.first_byte(&s, o, 10).unwrap();
            r.finish(&s, o, Outcome::Done).unwrap();
        }
        for e in &t.endpoints {
            assert_eq!(r.ledger.load(&s, e.slot, 100).unwrap(), Default::default());
        }
    }

    /// Predicted hits of one prefix whose answers say `cached` tokens were found, then nine
    /// more queued there without an answer: the next request of the prefix, and where the
    /// prefix is warm.
    fn after_answers(cached: &[u64]) -> (Routed, String) {
        let (mut r, t, s) = router("");
        let chain = r.hash(&chat(&"x".repeat(40_000), "q"));
        let mut first = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
        r.first_byte(&s, &mut first, 500).unwrap();
        r.finish(&s, &mut first, Outcome::Done).unwrap();
        let warm = first.addresses[0].clone();
        for (i, &c) in cached.iter().enumerate() {
            let now = 60_000 + i as u64 * 1_000;
            let mut answered = r.route(&s, &t.endpoints, &chain, 10_000, now).unwrap();
            assert_eq!(answered.addresses[0], warm);
            r.first_byte(&s, &mut answered, now + 500).unwrap();
            r.observe_usage(&s, &mut answered, ("m", 40_000), 10_000, Some(c))
                .unwrap();
            r.finish(&s, &mut answered, Outcome::Done).unwrap();
        }
        for i in 0..9 {
            let queued = r
                .route(&s, &t.endpoints, &chain, 10_000, 90_000 + i)
                .unwrap();
            assert_eq!(queued.addresses[0], warm);
            assert!(queued.uncached < 1_000, "charged as a hit");
        }
        let next = r.route(&s, &t.endpoints, &chain, 10_000, 90_010).unwrap();
        (next, warm)
    }

    #[test]
    fn an_endpoint_whose_predicted_hits_keep_missing_counts_whole_prompts() {
        // Twenty misses: nearly every request queued there is a whole prefill, and nine of
        // them are past τ (eight prompts' worth at most).
        let (next, warm) = after_answers(&[0; 20]);
        assert_eq!(next.decision.reason, policy::Reason::Spill);
        assert_ne!(next.addresses[0], warm);
        // A few misses, or one in four: the queue counts as the questions it was charged.
        let sporadic: Vec<u64> = (0..20)
            .map(|i| if i % 4 == 0 { 0 } else { 9_900 })
            .collect();
        for cached in [&[0; 4][..], &sporadic] {
            let (next, warm) = after_answers(cached);
            assert_eq!(next.decision.reason, policy::Reason::Sticky);
            assert_eq!(next.addresses[0], warm);
        }
    }

    #[test]
    fn early_failure_rolls_back_the_index() {
        let (mut r, t, s) = router("");
        let req = chat(&"x".repeat(20_000), "q");
        let chain = r.hash(&req);
        let mut routed = r.route(&s, &t.endpoints, &chain, 5_000, 0).unwrap();
        let slot = routed.charge.slot;
        assert!(r.index.matched(&s, slot, &chain.hashes).unwrap().blocks > 0);
        r.finish(&s, &mut routed, Outcome::FailedEarly).unwrap();
        assert_eq!(r.index.matched(&s, slot, &chain.hashes).unwrap().blocks, 0);
        assert_eq!(r.ledger.load(&s, slot, 1).unwrap(), Default::default());
    }

    #[test]
    fn a_rollback_that_loses_its_races_still_returns_the_charge() {
        let (mut r, t, s) = router("");
        let chain = r.hash(&chat(&"x".repeat(20_000), "q"));
        let mut routed = r.route(&s, &t.endpoints, &chain, 5_000, 0).unwrap();
        let slot = routed.charge.slot;
        // Another worker wins every CAS race of the rollback's first bucket.
        s.inject_conflicts.set(crate::store::CAS_RETRIES as u32);
        let failed = r.finish(&s, &mut routed, Outcome::FailedEarly);
        assert_eq!(failed, Err(StoreError::CasMismatch));
        assert_eq!(r.ledger.load(&s, slot, 1).unwrap(), Default::default());
        // The other buckets were rolled back all the same.
        let left = r.index.matched(&s, slot, &chain.hashes).unwrap().blocks;
        assert!(left < chain.full_blocks().len(), "{left} blocks left");
    }

    #[test]
    fn unhealthy_and_empty_fleets() {
        let (mut r, mut t, s) = router("");
        let chain = r.hash(&chat("a", "b"));
        for e in t.endpoints.iter_mut() {
            e.healthy = false;
        }
        assert_eq!(
            r.route(&s, &t.endpoints, &chain, 10, 0).unwrap_err(),
            RouteError::NoEndpoints
        );
        t.endpoints[2].healthy = true;
        let routed = r.route(&s, &t.endpoints, &chain, 10, 0).unwrap();
        assert_eq!(routed.addresses, vec!["127.0.0.1:8003".to_string()]);
    }

    #[test]
    fn learning_samples_first_bytes_and_shrinks_capacity_on_misses() {
        let (mut r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        let req = chat(&"x".repeat(40_000), "q");
        let chain = r.hash(&req);
        let mut first = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
        let slot = first.charge.slot;
        r.first_byte(&s, &mut first, 500).unwrap();
        r.first_byte(&s, &mut first, 900).unwrap(); // a second call is no second sample
        r.finish(&s, &mut first, Outcome::Done).unwrap();
        assert_eq!(r.estimator.read(&s, slot).unwrap().total, 1);
        let capacity = |r: &Router| r.index.matched(&s, slot, &[]).unwrap().capacity;
        let before = capacity(&r);
        // A second second later, the server had not cached the prefix: it may still have
        // been prefilling the first, so the miss says nothing about the cache's size.
        let mut second = r.route(&s, &t.endpoints, &chain, 10_000, 1_000).unwrap();
        assert_eq!(second.charge.slot, slot);
        assert!(second.tokens > second.uncached, "a predicted hit");
        let check = r
            .observe_usage(&s, &mut second, ("m", 40_000), 10_000, Some(0))
            .unwrap();
        assert_eq!(check, CacheCheck::Missed);
        assert_eq!(capacity(&r), before);
        second.ttft_sample = false; // a non-streamed answer: its first byte is no TTFT
        r.first_byte(&s, &mut second, 5_000).unwrap();
        assert_eq!(r.estimator.read(&s, slot).unwrap().total, 1);
        r.finish(&s, &mut second, Outcome::Done).unwrap();
        assert_eq!(r.ledger.load(&s, slot, 6_000).unwrap(), Default::default());
        // Past T_max (18 s), the same miss is evidence: the index assumes less capacity.
        let mut third = r.route(&s, &t.endpoints, &chain, 10_000, 30_000).unwrap();
        assert_eq!(third.charge.slot, slot);
        r.observe_usage(&s, &mut third, ("m", 40_000), 10_000, Some(0))
            .unwrap();
        assert!(capacity(&r) < before);
        r.finish(&s, &mut third, Outcome::Done).unwrap();
    }

    #[test]
    fn a_hot_prefix_miss_counts_once_its_first_fill_is_t_max_old() {
        // A prefix asked about every two seconds, each time with a new question: every
        // request rewrites the segment where the prefix ends. Its miss at 40 s is still
        // evidence: the prefix was filled at 0 s, not at 38 s.
        let (mut r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        let system = "x".repeat(40_000);
        // Questions of a few blocks, so that the prefix's last segment holds some of them.
        let question = |i: u64| format!("question {i} {}", "y".repeat(1_000));
        let mut slot = None;
        for i in 0..20u64 {
            let chain = r.hash(&chat(&system, &question(i)));
            let mut a = r
                .route(&s, &t.endpoints, &chain, 10_000, i * 2_000)
                .unwrap();
            assert!(slot.is_none() || slot == Some(a.charge.slot));
            slot = Some(a.charge.slot);
            r.finish(&s, &mut a, Outcome::Done).unwrap();
        }
        let slot = slot.unwrap();
        let capacity = |r: &Router| r.index.matched(&s, slot, &[]).unwrap().capacity;
        let before = capacity(&r);
        let chain = r.hash(&chat(&system, &question(99)));
        let mut last = r.route(&s, &t.endpoints, &chain, 10_000, 40_000).unwrap();
        assert_eq!(last.charge.slot, slot);
        let check = r
            .observe_usage(&s, &mut last, ("m", 40_000), 10_000, Some(0))
            .unwrap();
        assert_eq!(check, CacheCheck::Missed);
        assert!(capacity(&r) < before, "{} < {before}", capacity(&r));
        r.finish(&s, &mut last, Outcome::Done).unwrap();
    }

    #[test]
    fn a_miss_while_running_requests_hold_the_pool_moves_the_share_less() {
        // The same miss, once with no scrape, once with running requests holding three
        // quarters of the endpoint's pool, once with them past POOL_PRESSURE: the second says
        // the cache keeps fewer than four times the distance, and the capacity the index
        // assumes drops less; the third says nothing about the cache.
        let capacity_after_miss = |kv_usage: Option<f64>| {
            let (mut r, mut t, s) = router(r#","peakPrefillThroughput":"auto""#);
            t.endpoints.truncate(1);
            let chain = r.hash(&chat(&"x".repeat(40_000), "q"));
            let mut first = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
            r.finish(&s, &mut first, Outcome::Done).unwrap();
            for i in 0..4u64 {
                let other = r.hash(&chat(&i.to_string().repeat(20_000), "q"));
                let mut o = r.route(&s, &t.endpoints, &other, 5_000, 1_000 + i).unwrap();
                r.finish(&s, &mut o, Outcome::Done).unwrap();
            }
            t.endpoints[0].kv_usage = kv_usage;
            t.endpoints[0].scraped_at_ms = 30_000;
            let mut again = r.route(&s, &t.endpoints, &chain, 10_000, 30_000).unwrap();
            let check = r
                .observe_usage(&s, &mut again, ("m", 40_000), 10_000, Some(0))
                .unwrap();
            assert_eq!(check, CacheCheck::Missed);
            let capacity = r.index.matched(&s, 0, &[]).unwrap().capacity;
            (again.distance_blocks, capacity)
        };
        let configured = {
            let (r, t, s) = router("");
            r.index
                .matched(&s, t.endpoints[0].slot, &[])
                .unwrap()
                .capacity
        };
        let ((d_free, free), (d_held, held)) =
            (capacity_after_miss(None), capacity_after_miss(Some(0.75)));
        assert!(
            d_free.is_some_and(|d| d > 0) && d_held > d_free,
            "{d_free:?} {d_held:?}"
        );
        assert!(free < configured, "{free} < {configured}");
        assert!(
            free < held && held < configured,
            "{free} < {held} < {configured}"
        );
        // Past POOL_PRESSURE the batch explains the miss: the capacity stays.
        assert_eq!(capacity_after_miss(Some(0.85)), (None, configured));
    }

    #[test]
    fn no_endpoint_counts_more_cache_than_the_fleet_keeps() {
        let share = |v: &[(f64, u64)]| fleet_share(v.iter().copied());
        assert_eq!(share(&[]), 1.0);
        assert_eq!(
            share(&[(0.5, FLEET_SHARE_CHECKS - 1)]),
            1.0,
            "too few checks"
        );
        assert_eq!(share(&[(0.4, 40), (0.6, 40), (0.9, 40), (0.2, 3)]), 0.6);
        assert_eq!(share(&[(0.4, 40), (0.6, 40)]), 0.5);
        // Two endpoints learn that they keep half of what they report; the third, whose
        // predictions all held, still believes in all of it.
        let (r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        let reported = t.endpoints[0].capacity_blocks;
        let capacity = |slot| r.index.matched(&s, slot, &[]).unwrap().capacity;
        for _ in 0..40 {
            for slot in [0, 1] {
                r.estimator
                    .observe_cache(&s, slot, CacheCheck::Missed, Some(0.5))
                    .unwrap();
            }
            r.estimator
                .observe_cache(&s, 2, CacheCheck::Held, Some(0.9))
                .unwrap();
        }
        assert_eq!(r.estimator.read(&s, 2).unwrap().capacity_share, 1.0);
        assert_eq!(capacity(2), reported, "not synced yet");
        r.sync_capacities(&s, &t.endpoints).unwrap();
        // The fleet's share (the median, 0.5) bounds the third; the two count their own.
        for slot in 0..3 {
            let c = capacity(slot) as f64 / reported as f64;
            assert!((c - 0.5).abs() < 0.01, "slot {slot}: {c}");
        }
        // Between full syncs a request's `usage` moves its own endpoint alone, still under
        // the fleet's share as the last full sync left it.
        r.sync_capacity(&s, 2, reported, 0.9).unwrap();
        assert!((capacity(2) as f64 / reported as f64 - 0.5).abs() < 0.01);
        r.sync_capacity(&s, 0, reported, 0.25).unwrap();
        assert!((capacity(0) as f64 / reported as f64 - 0.25).abs() < 0.01);
        // Without learning the reported capacity stands whatever the records say.
        let (plain, t2, s2) = router("");
        for _ in 0..40 {
            plain
                .estimator
                .observe_cache(&s2, 0, CacheCheck::Missed, Some(0.5))
                .unwrap();
        }
        plain.sync_capacities(&s2, &t2.endpoints).unwrap();
        assert_eq!(plain.index.matched(&s2, 0, &[]).unwrap().capacity, reported);
    }

    #[test]
    fn free_distance_counts_the_share_running_requests_leave() {
        assert_eq!(free_distance(100, 0.0), 100);
        assert_eq!(free_distance(100, 0.5), 200);
        // At most POOL_PRESSURE counts as held; garbage counts as nothing held.
        assert_eq!(free_distance(100, 1.0), free_distance(100, 0.9));
        assert_eq!(free_distance(100, f64::NAN), 100);
        assert_eq!(free_distance(100, -3.0), 100);
    }

    #[test]
    fn a_ttft_sample_waits_for_usage() {
        // A streamed request's TTFT is recorded when `usage` says what the server prefilled
        // (a predicted hit it had evicted is a whole prefill), not at the first byte.
        let (mut r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        let chain = r.hash(&chat(&"x".repeat(40_000), "q"));
        let mut routed = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
        let slot = routed.charge.slot;
        r.first_byte(&s, &mut routed, 2_000).unwrap();
        assert_eq!(r.estimator.read(&s, slot).unwrap().total, 0);
        r.observe_usage(&s, &mut routed, ("m", 40_000), 10_000, Some(0))
            .unwrap();
        assert_eq!(r.estimator.read(&s, slot).unwrap().total, 1);
        r.finish(&s, &mut routed, Outcome::Done).unwrap();
        assert_eq!(r.estimator.read(&s, slot).unwrap().total, 1, "one sample");
        assert_eq!(r.ledger.load(&s, slot, 3_000).unwrap(), Default::default());
    }

    #[test]
    fn a_usage_no_tokenizer_could_give_teaches_nothing() {
        let (mut r, t, s) = router(r#","peakPrefillThroughput":"auto""#);
        let chain = r.hash(&chat(&"x".repeat(40_000), "q"));
        let mut routed = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
        let slot = routed.charge.slot;
        r.first_byte(&s, &mut routed, 2_000).unwrap();
        let before = r.estimator.bytes_per_token(&s, "m").unwrap();
        // 10^12 prompt tokens for 40 KB, none cached.
        let check = r
            .observe_usage(&s, &mut routed, ("m", 40_000), 1_000_000_000_000, Some(0))
            .unwrap();
        assert_eq!(check, CacheCheck::NotPredicted);
        r.finish(&s, &mut routed, Outcome::Done).unwrap();
        // The sample counted with the tokens the index predicted (10,000 in 2 s), once.
        let est = r.estimator.read(&s, slot).unwrap();
        assert_eq!(est.total, 1);
        assert_eq!(r.estimator.bytes_per_token(&s, "m").unwrap(), before);
        assert!(plausible_usage(10_000, 40_000, 84_096, None));
        assert!(!plausible_usage(10_000, 40_000, 84_097, None));
        assert!(plausible_usage(10_000, 0, 14_096, Some(14_096)));
        assert!(!plausible_usage(10_000, 0, 14_097, None));
        // More cached than the prompt has (a broken server): nothing to learn from.
        let mut routed = r.route(&s, &t.endpoints, &chain, 10_000, 4_000).unwrap();
        r.first_byte(&s, &mut routed, 6_000).unwrap();
        let check = r
            .observe_usage(&s, &mut routed, ("m", 40_000), 20_000, Some(20_001))
            .unwrap();
        assert_eq!(check, CacheCheck::NotPredicted);
        r.finish(&s, &mut routed, Outcome::Done).unwrap();
        assert_eq!(r.estimator.bytes_per_token(&s, "m").unwrap(), before);
        assert!(!plausible_usage(10_000, 40_000, 10_000, Some(10_001)));
    }

    /// A store whose learned-estimate keys cannot be written.
    struct EstimatesDown(MemStore);

    impl SharedStore for EstimatesDown {
        fn get(
            &self,
            key: &str,
        ) -> Result<(Option<crate::store::Bytes>, Option<crate::store::Cas>), StoreError> {
            self.0.get(key)
        }
        fn set(
            &self,
            key: &str,
            value: &[u8],
            cas: Option<crate::store::Cas>,
        ) -> Result<(), StoreError> {
            match key.contains("/est/") {
                true => Err(StoreError::Host),
                false => self.0.set(key, value, cas),
            }
        }
    }

    #[test]
    fn a_predicted_hit_that_took_a_whole_prefill_counts_as_one_without_usage() {
        // One endpoint, cold prompts of 10,000 tokens each answered after a prefill at the
        // prior rate; then the last prompt again, which the index predicts cached, answered
        // after a whole prefill and ending with no `usage`: it counts as a miss at its first
        // byte, the count stands when the stream ends, and the rate holds.
        let (mut r, mut t, s) = router(r#","peakPrefillThroughput":"auto""#);
        t.endpoints.truncate(1);
        let prior = r.estimator.read(&s, 0).unwrap().rate;
        let prefill_ms = (10_000.0 / prior * 1_000.0) as u64;
        let chains: Vec<_> = (0..12u64)
            .map(|i| r.hash(&chat(&i.to_string().repeat(40_000), "q")))
            .collect();
        let mut now = 0;
        for chain in &chains {
            let mut cold = r.route(&s, &t.endpoints, chain, 10_000, now).unwrap();
            r.first_byte(&s, &mut cold, now + prefill_ms).unwrap();
            r.observe_usage(&s, &mut cold, ("m", 40_000), 10_000, Some(0))
                .unwrap();
            r.finish(&s, &mut cold, Outcome::Done).unwrap();
            now += 2 * prefill_ms;
        }
        let mut again = r.route(&s, &t.endpoints, &chains[11], 10_000, now).unwrap();
        assert!(again.uncached < again.tokens / 2, "a predicted hit");
        r.first_byte(&s, &mut again, now + prefill_ms).unwrap();
        assert_eq!(again.rate_counted, Some(again.tokens));
        r.finish(&s, &mut again, Outcome::Done).unwrap();
        let rate = r.estimator.read(&s, 0).unwrap().rate;
        assert!(
            (rate - prior).abs() / prior < 0.02,
            "{rate} against {prior}"
        );
    }

    #[test]
    fn a_lost_ttft_sample_still_releases_the_prefill() {
        let (mut r, t, _) = router(r#","peakPrefillThroughput":"auto""#);
        let s = EstimatesDown(MemStore::new());
        let chain = r.hash(&chat(&"x".repeat(40_000), "q"));
        let mut routed = r.route(&s, &t.endpoints, &chain, 10_000, 0).unwrap();
        let slot = routed.charge.slot;
        assert_eq!(
            r.first_byte(&s, &mut routed, 500),
            Err(FirstByteError::Estimate(StoreError::Host))
        );
        assert_eq!(r.ledger.load(&s, slot, 600).unwrap().prefilling, 0);
        assert_eq!(r.ledger.load(&s, slot, 600).unwrap().requests, 1);
        // The held sample cannot be stored: lost, and the release still happens.
        r.finish(&s, &mut routed, Outcome::Done).unwrap();
        assert_eq!(r.ledger.load(&s, slot, 600).unwrap(), Default::default());
    }

    #[test]
    fn learned_rates_count_by_kind_of_machine() {
        let close = |a: &[f64], b: &[f64]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
        };
        // One kind read with noise: every endpoint at the mean.
        let one = speed_classes(&[3_700.0, 4_000.0, 4_300.0, 3_900.0]);
        assert!(close(&one, &[3_975.0; 4]), "{one:?}");
        // Two kinds twice apart stay apart, whatever the order.
        let two = speed_classes(&[4_100.0, 2_000.0, 3_900.0, 2_200.0]);
        assert!(
            close(&two, &[4_000.0, 2_100.0, 4_000.0, 2_100.0]),
            "{two:?}"
        );
        // One endpoint alone keeps its own reading; none is fine.
        assert!(close(
            &speed_classes(&[1_000.0, 5_000.0]),
            &[1_000.0, 5_000.0]
        ));
        assert!(speed_classes(&[]).is_empty());
    }

    #[test]
    fn a_fleet_of_one_kind_is_routed_at_one_speed() {
        let (mut r, _, _) = router(r#","peakPrefillThroughput":{"auto":1000}"#);
        let est = |rate: f64, learned: bool| Estimate {
            rate,
            overhead_s: 0.0,
            per_active: 0.0,
            observations: 300.0,
            total: 300,
            learned,
            capacity_share: 1.0,
            cache_checks: 0,
            cache_misses: 0,
        };
        let queued = |tokens: u64| Candidate {
            load: Load {
                tokens,
                ..Default::default()
            },
            ..Default::default()
        };
        // Three equal machines read 5 % apart, one not learned yet, and one twice as slow.
        let view = |slow: bool| {
            let mut v = vec![
                (queued(1_900), Some(est(1_900.0, true))),
                (queued(2_000), Some(est(2_000.0, true))),
                (queued(2_100), Some(est(2_100.0, true))),
                (queued(2_000), Some(est(1_000.0, false))),
            ];
            if slow {
                v.push((queued(1_000), Some(est(1_000.0, true))));
            }
            v
        };
        let c = r.in_reference_tokens(view(false));
        assert!(c.iter().all(|c| (c.speed() - 1.0).abs() < 1e-9), "{c:?}");
        // Each queue counts as its tokens: the same wait on every endpoint of the kind.
        let tokens: Vec<u64> = c.iter().map(|c| c.load.tokens).collect();
        assert!(tokens
            .iter()
            .zip([1_900, 2_000, 2_100, 2_000])
            .all(|(a, b)| a.abs_diff(b) <= 1));
        // A machine twice as slow is a kind of its own (the endpoint not learned yet counts
        // at the fleet's mean).
        let c = r.in_reference_tokens(view(true));
        let speeds: Vec<f64> = c.iter().map(|c| c.speed()).collect();
        assert!(
            speeds[..3].iter().all(|s| (s - speeds[0]).abs() < 1e-9),
            "{speeds:?}"
        );
        assert!((speeds[3] - 1.0).abs() < 1e-9, "{speeds:?}");
        assert!((speeds[0] / speeds[4] - 2.0).abs() < 1e-9, "{speeds:?}");
    }

    #[test]
    fn the_latency_predictor_counts_by_kind_of_machine() {
        let (mut r, _, _) = router(
            r#","peakPrefillThroughput":{"auto":2000},"ttftSource":"latencyPredictor","scorer":"latency""#,
        );
        let est = |rate: f64, overhead_s: f64, per_active: f64| Estimate {
            rate,
            overhead_s,
            per_active,
            observations: 300.0,
            total: 300,
            learned: true,
            capacity_share: 1.0,
            cache_checks: 0,
            cache_misses: 0,
        };
        let idle = Candidate::default;
        // Three equal machines whose fits came out apart, and one twice as slow whose fixed
        // overhead is truly larger.
        let c = r.in_reference_tokens(vec![
            (idle(), Some(est(1_950.0, 0.02, 0.010))),
            (idle(), Some(est(2_000.0, 0.06, 0.030))),
            (idle(), Some(est(2_050.0, 0.04, 0.020))),
            (idle(), Some(est(1_000.0, 0.50, 0.020))),
        ]);
        let waits: Vec<u64> = c.iter().map(|c| c.load.tokens).collect();
        // Idle, the wait is the overhead alone: the same on every machine of a kind (not
        // the lowest fit winning every cold placement), and the slow kind's stays its own.
        assert_eq!(waits[0], waits[1], "{waits:?}");
        assert_eq!(waits[1], waits[2], "{waits:?}");
        assert!(waits[0] > 0 && waits[3] > 5 * waits[0], "{waits:?}");
        // With work queued, the share running requests add is the kind's too.
        let busy = |requests: u64| Candidate {
            load: Load {
                tokens: 4_000,
                requests,
                ..Default::default()
            },
            ..Default::default()
        };
        let c = r.in_reference_tokens(vec![
            (busy(10), Some(est(2_000.0, 0.04, 0.0))),
            (busy(10), Some(est(2_000.0, 0.04, 0.04))),
        ]);
        assert_eq!(c[0].load.tokens, c[1].load.tokens, "{c:?}");
    }

    #[test]
    fn tau_leans_sticky_until_a_rate_is_learned() {
        // Told R_peak 1,000 tok/s and T_max 1 s (τ 1,000); every endpoint really prefills
        // 2,000 tok/s. Until one is learned the prior may be far off, and a τ too low does
        // lasting harm: tokenaware's τ counts R_peak at four times the prior (its prompt
        // bounds then apply). Then it is R̂ × T_max.
        let (mut r, t, s) =
            router(r#","peakPrefillThroughput":{"auto":1000},"maxTTFTPenaltyMs":1000"#);
        let mut learned_tau = None;
        for i in 0..40u64 {
            let chain = r.hash(&chat(&format!("{i} ").repeat(2_000), "q"));
            let now = i * 2_000;
            let mut routed = r.route(&s, &t.endpoints, &chain, 2_000, now).unwrap();
            let learned = t
                .endpoints
                .iter()
                .any(|e| r.estimator.read(&s, e.slot).unwrap().learned);
            if i == 1 {
                assert_eq!(r.params.tau, 4_000.0, "nothing learned yet");
            }
            if learned {
                learned_tau = Some(r.params.tau);
            }
            r.first_byte(&s, &mut routed, now + 1_000).unwrap();
            r.observe_usage(&s, &mut routed, ("m", 8_000), 2_000, Some(0))
                .unwrap();
            r.finish(&s, &mut routed, Outcome::Done).unwrap();
        }
        let tau = learned_tau.expect("an endpoint learned its rate");
        assert!((tau - 2_000.0).abs() < 300.0, "τ {tau}");
        // sticky-until-saturated does not bound τ by the prompt: it keeps the prior's.
        let (mut r, t, s) = router(
            r#","peakPrefillThroughput":{"auto":1000},"maxTTFTPenaltyMs":1000,"policy":"sticky-until-saturated""#,
        );
        for i in 0..2 {
            let chain = r.hash(&chat(&format!("{i} ").repeat(2_000), "q"));
            let mut routed = r.route(&s, &t.endpoints, &chain, 2_000, i).unwrap();
            r.finish(&s, &mut routed, Outcome::Done).unwrap();
        }
        assert_eq!(r.params.tau, 1_000.0);
    }

    #[test]
    fn small_tau_spills() {
        // tokenaware holds τ to at least four prompts' worth; the policy it refines does not.
        let (mut r, t, s) = router(r#","tau":1000,"policy":"sticky-until-saturated""#);
        let sys = "shared ".repeat(4_000);
        let picks: std::collections::HashSet<String> = (0..10)
            .map(|q| {
                let req = chat(&sys, &format!("q{q}"));
                let chain = r.hash(&req);
                r.route(&s, &t.endpoints, &chain, r.prompt_tokens(&req), 0)
                    .unwrap()
                    .addresses[0]
                    .clone()
            })
            .collect();
        assert!(picks.len() >= 2, "{picks:?}");
    }
}

//! One HTTP stream through the filter.
//!
//! Request: strip client-sent destination headers (always); on an inference route pause at
//! headers and buffer the body; at end of stream (or in the trailers) parse, route and set
//! `x-gateway-destination-endpoint: ip:port,fallback,…`. A body over `maxBodyBytes`, a parse
//! failure, no endpoint or an internal error: no header, counted, and Envoy's fallback
//! policy picks. Response: a streamed answer's first body byte releases the prefill tokens
//! (an answer not streamed holds them to its end, which follows at once), a 4xx or 5xx
//! before it marks an early failure, and the stream's end (`on_log`, which also runs on resets)
//! releases the request exactly once. Prompt text never leaves this module.

use std::rc::Rc;

use super::host::{Host, HostError};
use super::opening::OpeningEvents;
use super::stats::{Counter, Fallback};
use super::usage;
use super::vm::Vm;
use crate::estimator::{CacheCheck, ModelId};
use crate::request::{parse, ApiKind, ParseLimits};
use crate::router::{FirstByteError, Outcome, RouteError, Routed};
use crate::store::StoreError;

pub const DESTINATION: &str = "x-gateway-destination-endpoint";
pub const DESTINATION_SERVED: &str = "x-gateway-destination-endpoint-served";
pub const DECISION: &str = "x-tokenaware-decision";
/// The replicas' shared secret on a peer poll (`peers.token`).
pub const PEER_TOKEN: &str = "x-tokenaware-peer-token";

/// The largest chunk read whole for a Responses stream's opening events (they echo the
/// request's instructions and tools, a few KiB).
const OPENING_READ_BYTES: usize = 1 << 20;

/// What the host should do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not an inference route, or already decided.
    Pass,
    /// Buffering the request body.
    Buffering(ApiKind),
}

pub struct HttpFilter {
    vm: Option<Rc<Vm>>,
    phase: Phase,
    /// Request body bytes the host holds (the last `body_size` seen).
    body_size: usize,
    routed: Option<Routed>,
    /// `x-tokenaware-decision` value, when enabled.
    note: Option<String>,
    first_byte: bool,
    failed_early: bool,
    /// The request asked for a streamed answer.
    streamed: bool,
    /// A streamed Responses answer: its first token is the first event past these.
    opening: Option<OpeningEvents>,
    /// Last bytes of the response body, for `usage`.
    tail: Vec<u8>,
    /// The request's model (its hash) and canonical prompt bytes (0 for token ids), for
    /// what `usage` teaches about bytes per token.
    prompt_shape: (ModelId, u64),
    /// A streamed request's new placement (its block hashes), told to `peers` only once the
    /// picked endpoint has answered.
    unshared: Option<Vec<u64>>,
    /// The sequence number of the placement told to `peers`, taken back should the request
    /// fail before the picked endpoint answers.
    told: Option<u64>,
    /// Envoy's retry or `override_host` fallback answered, not the picked endpoint: what the
    /// answer teaches (its first byte, its `usage`) is another server's.
    served_elsewhere: bool,
    /// Answered 4xx: the endpoint did not take the prompt.
    refused: bool,
}

impl HttpFilter {
    pub fn new(vm: Option<Rc<Vm>>) -> HttpFilter {
        HttpFilter {
            vm,
            phase: Phase::Pass,
            body_size: 0,
            routed: None,
            note: None,
            first_byte: false,
            failed_early: false,
            streamed: false,
            opening: None,
            tail: Vec::new(),
            prompt_shape: (ModelId::default(), 0),
            unshared: None,
            told: None,
            served_elsewhere: false,
            refused: false,
        }
    }

    pub fn on_request_headers<H: Host>(&mut self, h: &H, end_of_stream: bool) -> Action {
        let had = strip_request_header(h, DESTINATION);
        strip_request_header(h, DESTINATION_SERVED);
        let Some(vm) = self.vm.clone() else {
            strip_request_header(h, PEER_TOKEN);
            return Action::Continue;
        };
        if had {
            vm.stats.inc(h, Counter::ClientHeaderStripped);
        }
        let path = match h.request_header(":path") {
            Ok(Some(p)) => p,
            _ => {
                strip_request_header(h, PEER_TOKEN);
                return Action::Continue;
            }
        };
        let path = String::from_utf8_lossy(&path);
        let peer_path = vm
            .cfg
            .peers
            .as_ref()
            .is_some_and(|p| path_is(&path, &p.path));
        if !peer_path {
            // The replicas' secret goes no further than a replica that answers its poll: a
            // poll of one without `peers` (during a rollout, or on another `peers.path`)
            // would take it on to a model server.
            strip_request_header(h, PEER_TOKEN);
        }
        if vm
            .cfg
            .debug_path
            .as_deref()
            .is_some_and(|d| path_is(&path, d))
        {
            let body = vm.debug_json(h);
            let hdrs = [("content-type", "application/json")];
            return match h.send_response(200, &hdrs, &body) {
                Ok(()) => Action::Pause,
                Err(_) => Action::Continue,
            };
        }
        if peer_path {
            return answer_peer(h, &vm, &path);
        }
        if !vm.cfg.is_routed_path(&path) {
            return Action::Continue;
        }
        let kind = api_kind(&path);
        if end_of_stream {
            return self.fallback(h, &vm, Fallback::NoBody);
        }
        let declared = h
            .request_header("content-length")
            .ok()
            .flatten()
            .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > vm.cfg.max_body_bytes) {
            return self.fallback(h, &vm, Fallback::TooLarge);
        }
        self.phase = Phase::Buffering(kind);
        Action::Pause
    }

    pub fn on_request_body<H: Host>(
        &mut self,
        h: &H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let (Phase::Buffering(kind), Some(vm)) = (self.phase, self.vm.clone()) else {
            return Action::Continue;
        };
        self.body_size = body_size;
        if body_size as u64 > vm.cfg.max_body_bytes {
            return self.fallback(h, &vm, Fallback::TooLarge);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide(h, &vm, kind)
    }

    /// A request that ends in trailers: the body is complete here.
    pub fn on_request_trailers<H: Host>(&mut self, h: &H) -> Action {
        match (self.phase, self.vm.clone()) {
            (Phase::Buffering(kind), Some(vm)) => self.decide(h, &vm, kind),
            _ => Action::Continue,
        }
    }

    pub fn on_response_headers<H: Host>(&mut self, h: &H, end_of_stream: bool) -> Action {
        if let Some(note) = &self.note {
            let _ = h.set_response_header(DECISION, note);
        }
        if self.routed.is_none() || self.first_byte {
            return Action::Continue;
        }
        let status = h
            .response_header(":status")
            .ok()
            .flatten()
            .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u32>().ok())
            .unwrap_or(0);
        let unshared = self.unshared.take();
        if status >= 500 || status == 0 {
            self.failed_early = true;
        } else if status >= 400 {
            // A bad request, a prompt over the context, a rate limit: the endpoint took
            // nothing, so nothing stays charged or indexed there. Counted apart from the
            // failures: a client's bad requests are no server in trouble.
            self.failed_early = true;
            self.refused = true;
        } else {
            if self.check_served_by(h) {
                self.share_placement(h, unshared.as_deref());
            } else if let Some(vm) = self.vm.clone() {
                self.withdraw_placement(h, &vm);
            }
            if end_of_stream {
                // The whole response is here: `on_log` releases prefill and request together.
                self.first_byte = true;
            }
        }
        Action::Continue
    }

    /// When another endpoint answered (Envoy retried on a fallback, or `override_host` passed
    /// over the picked host because Envoy holds it unhealthy, in the same attempt), the picked
    /// endpoint never saw the prompt: undo its index insert and return the charge now (the
    /// request is not counted against the endpoint that did answer; its prefix is learned
    /// when it is picked). Returns whether the picked endpoint answered (as far as Envoy
    /// says). The upstream address is read on every answer: an attempt count of one does
    /// not tell, and the read measured no cost (docs/benchmarks.md).
    fn check_served_by<H: Host>(&mut self, h: &H) -> bool {
        let (Some(routed), Some(vm)) = (self.routed.as_mut(), self.vm.as_ref()) else {
            return false;
        };
        let Ok(Some(served)) = h.upstream_address() else {
            return true;
        };
        let picked = routed.addresses.first().map(String::as_bytes);
        if picked.is_none() || picked == Some(served.as_slice()) {
            return true;
        }
        self.served_elsewhere = true;
        vm.stats.inc(h, Counter::ServedByFallback);
        let ours = slot_is_ours(h, vm, routed);
        if let Ok(r) = vm.router.try_borrow() {
            let s = &vm.recent.fresh(h);
            let released = match ours {
                true => r.finish(s, routed, Outcome::FailedEarly),
                false => r.finish_departed(s, routed),
            };
            if released.is_err() {
                vm.stats.inc(h, Counter::ReleaseErrors);
            }
        }
        false
    }

    /// Tells `peers` of a new placement (`blocks`, when there is one to tell).
    fn share_placement<H: Host>(&mut self, h: &H, blocks: Option<&[u64]>) {
        let (Some(blocks), Some(routed), Some(vm)) = (blocks, &self.routed, &self.vm) else {
            return;
        };
        let Ok(r) = vm.router.try_borrow() else {
            return vm.stats.inc(h, Counter::PeerErrors);
        };
        self.told = tell_peers(
            h,
            vm,
            r.share_placement(&vm.recent.fresh(h), routed, blocks),
        );
    }

    /// The request failed before the picked endpoint answered: the placement told to
    /// `peers` is taken back, as the index insert here is (peers that read it keep it).
    fn withdraw_placement<H: Host>(&mut self, h: &H, vm: &Vm) {
        let Some(seq) = self.told.take() else {
            return;
        };
        match vm
            .router
            .try_borrow()
            .map(|r| r.withdraw_placement(&vm.recent.fresh(h), seq))
        {
            Ok(Ok(true)) => vm.stats.inc(h, Counter::PeerPlacementsWithdrawn),
            Ok(Ok(false)) => {}
            Ok(Err(_)) | Err(_) => vm.stats.inc(h, Counter::PeerErrors),
        }
    }

    pub fn on_response_body<H: Host>(
        &mut self,
        h: &H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.routed.is_none() {
            return Action::Continue;
        }
        let awaited = !self.first_byte && !self.failed_early;
        if awaited && (end_of_stream || !self.streamed) {
            // An answer not streamed comes whole after its decode, its end right behind:
            // `on_log` releases prefill and request together, one ledger update, not two.
            // So is a stream that ends (its last chunk may be empty) before its first token
            // was seen: a Responses stream without `event:` lines.
            self.first_byte = true;
        } else if body_size == 0 {
            return Action::Continue;
        } else if awaited && self.opening.is_some() && body_size <= OPENING_READ_BYTES {
            return self.opening_body(h, body_size);
        } else if awaited {
            // A streamed answer's first byte ends its prefill (and is a TTFT sample); so
            // does a Responses chunk past any opening event's size (the first token is
            // taken to be in it).
            self.first_byte(h);
        }
        let want = body_size.min(usage::TAIL_BYTES);
        if want == 0 {
            return Action::Continue;
        }
        if let Ok(chunk) = h.response_body(body_size - want, want) {
            usage::keep_tail(&mut self.tail, &chunk);
        }
        Action::Continue
    }

    /// A chunk of a streamed Responses answer before its first token: read whole (the
    /// opening events are a few KiB), and its first token's event ends the prefill.
    fn opening_body<H: Host>(&mut self, h: &H, body_size: usize) -> Action {
        let Ok(chunk) = h.response_body(0, body_size) else {
            // Unreadable: the prefill is held to the stream's end, as one not streamed.
            return Action::Continue;
        };
        if self
            .opening
            .as_mut()
            .is_some_and(|o| o.past_opening(&chunk))
        {
            self.opening = None;
            self.first_byte(h);
        }
        usage::keep_tail(&mut self.tail, &chunk);
        Action::Continue
    }

    /// End of the stream, whatever happened (also resets and local replies): release what
    /// the request still holds. Runs once per stream.
    pub fn on_log<H: Host>(&mut self, h: &H) {
        let (Some(mut routed), Some(vm)) = (self.routed.take(), self.vm.clone()) else {
            return;
        };
        let outcome = if self.first_byte && !self.failed_early {
            Outcome::Done
        } else {
            let why = match self.refused {
                true => Counter::Refused,
                false => Counter::FailedEarly,
            };
            vm.stats.inc(h, why);
            self.withdraw_placement(h, &vm);
            Outcome::FailedEarly
        };
        // What the answer of an endpoint that left teaches belongs to no endpoint we still
        // route to; its charge goes back if it is still there (`finish_departed`).
        let ours = slot_is_ours(h, &vm, &routed);
        // `usage` first: it completes the TTFT sample held since the first byte.
        if let Some(u) = usage::scan(&self.tail) {
            vm.stats.add(h, Counter::UsagePromptTokens, u.prompt_tokens);
            vm.stats
                .add(h, Counter::UsageCachedTokens, u.cached_tokens.unwrap_or(0));
            vm.stats.token_estimate(h, u.prompt_tokens, routed.tokens);
            if ours && !self.served_elsewhere {
                self.learn_from_usage(h, &vm, &mut routed, u);
            }
        } else if outcome == Outcome::Done {
            // A stream asked without `stream_options.include_usage`, a compressed answer,
            // `usage` pushed out of the tail: the answer teaches nothing, and this says so.
            vm.stats.inc(h, Counter::UsageMissing);
        }
        let released = match vm.router.try_borrow() {
            Ok(r) if ours => r.finish(&vm.recent.fresh(h), &mut routed, outcome).is_ok(),
            Ok(r) => r.finish_departed(&vm.recent.fresh(h), &mut routed).is_ok(),
            Err(_) => false,
        };
        if released {
            vm.stats.inc(h, Counter::Released);
        } else {
            vm.stats.inc(h, Counter::ReleaseErrors);
        }
    }

    /// Feeds `usage` to the estimates (bytes per token, the cache check).
    fn learn_from_usage<H: Host>(&self, h: &H, vm: &Vm, routed: &mut Routed, u: usage::Usage) {
        let Ok(r) = vm.router.try_borrow() else {
            return;
        };
        let s = &vm.recent.fresh(h);
        match r.observe_usage(
            s,
            routed,
            self.prompt_shape,
            u.prompt_tokens,
            u.cached_tokens,
        ) {
            Ok(CacheCheck::Missed) => vm.stats.inc(h, Counter::CacheMisses),
            Ok(CacheCheck::Held) => vm.stats.inc(h, Counter::CacheHeld),
            Ok(CacheCheck::Kept) => vm.stats.inc(h, Counter::CacheKept),
            Ok(CacheCheck::NotPredicted) => {}
            Err(_) => vm.stats.inc(h, Counter::EstimateErrors),
        }
    }

    fn first_byte<H: Host>(&mut self, h: &H) {
        self.first_byte = true;
        let (Some(routed), Some(vm)) = (self.routed.as_mut(), self.vm.as_ref()) else {
            return;
        };
        if self.served_elsewhere {
            // The charge went back when the fallback was seen; this byte is not the picked
            // endpoint's time to first token.
            return;
        }
        // Without a clock reading the prefill is still released; it just is no TTFT sample.
        let now = match h.now_ms() {
            Ok(now) => now,
            Err(_) => {
                routed.ttft_sample = false;
                routed.dispatch_ms
            }
        };
        if !slot_is_ours(h, vm, routed) {
            // Its endpoint left: the prefill goes back if still charged, no TTFT sample.
            routed.ttft_sample = false;
        }
        let s = &vm.recent.fresh(h);
        match vm.router.try_borrow().map(|r| r.first_byte(s, routed, now)) {
            Ok(Ok(())) => {}
            Ok(Err(FirstByteError::Estimate(_))) => vm.stats.inc(h, Counter::EstimateErrors),
            Ok(Err(FirstByteError::Release(_))) | Err(_) => vm.stats.inc(h, Counter::ReleaseErrors),
        }
    }

    /// End of the request body: parse, route, set the destination.
    fn decide<H: Host>(&mut self, h: &H, vm: &Vm, kind: ApiKind) -> Action {
        self.phase = Phase::Pass;
        let routed = match self.route(h, vm, kind) {
            Ok(r) => r,
            Err(why) => return self.fallback(h, vm, why),
        };
        let d = &routed.decision;
        vm.stats.inc(h, Counter::Routed);
        vm.stats.decision(h, d.reason);
        vm.stats.hit_ratio(h, d.hit);
        if d.tau_broken {
            vm.stats.inc(h, Counter::TauBreaks);
        }
        if vm.cfg.decision_header {
            self.note = Some(format!(
                "endpoint={}; reason={}; hit={:.2}; cost={}; tokens={}",
                routed.addresses.first().map(String::as_str).unwrap_or(""),
                d.reason.as_str(),
                d.hit,
                d.cost,
                routed.tokens,
            ));
        }
        self.routed = Some(routed);
        Action::Continue
    }

    /// Reads and parses the body, picks, charges the tables and sets the header; on any
    /// failure nothing stays charged.
    fn route<H: Host>(&mut self, h: &H, vm: &Vm, kind: ApiKind) -> Result<Routed, Fallback> {
        if self.body_size == 0 {
            return Err(Fallback::NoBody);
        }
        let internal = |what: &str, e: HostError| {
            vm.log_error(h, &format!("{what}: {}", e.as_str()));
            Fallback::Internal
        };
        let body = h
            .request_body(0, self.body_size)
            .map_err(|e| internal("reading the request body", e))?;
        let limits = ParseLimits {
            max_body_bytes: usize::try_from(vm.cfg.max_body_bytes).unwrap_or(usize::MAX),
            ..ParseLimits::default()
        };
        let req = parse(kind, &body, &limits).map_err(Fallback::from_parse)?;
        drop(body);
        let now = h.now_ms().map_err(|e| internal("reading the clock", e))?;
        let s = &vm.recent.at(h, now);
        let table = vm.table(s);
        let mut router = vm
            .router
            .try_borrow_mut()
            .map_err(|_| internal("router", HostError::Internal))?;
        router.set_replicas_seen(table.foreign.seen);
        if router.sync_shared_prefixes(s).is_err() {
            vm.stats.inc(h, Counter::EstimateErrors);
        }
        let chain = router.hash(&req);
        let model = ModelId::from(req.model.as_str());
        let tokens = router.estimate_tokens(s, &req, model);
        // Token ids, or placeholders for images and other media: the bytes do not tell the
        // tokens `usage` counts, and teach bytes per token nothing.
        let bytes = match (req.prompt_token_ids, req.media) {
            (None, false) => req.prompt.len() as u64,
            _ => 0,
        };
        let stream = req.stream;
        self.prompt_shape = (model, bytes);
        drop(req);
        let mut routed = router
            .route(s, &table.endpoints, &chain, tokens, now)
            .map_err(|e| match e {
                RouteError::NoEndpoints => Fallback::NoEndpoints,
                RouteError::Store => Fallback::Store,
            })?;
        routed.ttft_sample = stream;
        self.streamed = stream;
        if stream && kind == ApiKind::Responses {
            self.opening = Some(OpeningEvents::default());
        }
        if let Err(e) = h.set_request_header(DESTINATION, &routed.addresses.join(",")) {
            let _ = router.finish(&vm.recent.fresh(h), &mut routed, Outcome::FailedEarly);
            return Err(internal("setting the destination", e));
        }
        if stream {
            // A streamed answer's headers come as soon as the server takes the request: the
            // placement is told to the peers then, so one refused, failed or served by a
            // fallback never is. An answer not streamed comes whole, too late to wait for.
            if router.shares(&routed) {
                self.unshared = Some(chain.full_blocks().to_vec());
            }
        } else {
            self.told = tell_peers(
                h,
                vm,
                router.share_placement(s, &routed, chain.full_blocks()),
            );
        }
        Ok(routed)
    }

    fn fallback<H: Host>(&mut self, h: &H, vm: &Vm, why: Fallback) -> Action {
        self.phase = Phase::Pass;
        vm.stats.fallback(h, why);
        if vm.cfg.decision_header {
            self.note = Some(format!("reason=fallback; why={}", why.as_str()));
        }
        Action::Continue
    }
}

/// A peer replica's poll: this process's new placements from its `since` on, as JSON
/// (block hashes and endpoint addresses, never prompt text). A store error answers 503, and
/// the peer asks again on its next poll.
fn answer_peer<H: Host>(h: &H, vm: &Vm, path: &str) -> Action {
    let hdrs = [("content-type", "application/json")];
    let token = vm.cfg.peers.as_ref().and_then(|p| p.token.as_ref());
    let given = h.request_header(PEER_TOKEN).ok().flatten();
    if !token.is_some_and(|t| given.is_some_and(|g| t.admits(&g))) {
        // Placements are addresses and prompt-prefix hashes: only a replica may read them.
        vm.stats.inc(h, Counter::PeerRequestsRefused);
        return match h.send_response(403, &hdrs, b"{\"error\":\"forbidden\"}") {
            Ok(()) => Action::Pause,
            Err(_) => Action::Continue,
        };
    }
    let from = crate::peers::cursor_in_path(path);
    let batch = match vm.router.try_borrow() {
        Ok(r) => r
            .placements
            .as_ref()
            .map(|l| l.since(&vm.recent.fresh(h), from)),
        Err(_) => None,
    };
    let sent = match batch {
        Some(Ok(b)) => h.send_response(200, &hdrs, &b.to_json()),
        _ => h.send_response(503, &hdrs, b"{\"error\":\"placements unavailable\"}"),
    };
    match sent {
        Ok(()) => Action::Pause,
        Err(_) => Action::Continue,
    }
}

/// Counts what keeping a placement for `peers` came to; its sequence number if one was kept.
fn tell_peers<H: Host>(h: &H, vm: &Vm, kept: Result<Option<u64>, StoreError>) -> Option<u64> {
    match kept {
        Ok(Some(seq)) => {
            vm.stats.inc(h, Counter::PeerPlacementsShared);
            Some(seq)
        }
        Ok(None) => None,
        Err(_) => {
            vm.stats.inc(h, Counter::PeerErrors);
            None
        }
    }
}

/// Whether the picked endpoint still holds the slot it was charged on. Discovery clears a
/// departed endpoint's slot and may give it to a new endpoint at once, and so does a reload
/// whose static list drops one endpoint and adds another: a request still in flight on the
/// old one must not undo its index insert there, nor teach the estimates there what its
/// answer says. (Its charge is another matter: the ledger's tenure guards it.)
fn slot_is_ours<H: Host>(h: &H, vm: &Vm, routed: &Routed) -> bool {
    let Some(picked) = routed.addresses.first() else {
        return false;
    };
    // With discovery the table changes hands any poll: read its version fresh. A static list
    // changes only on a reload: the kept read (`sharedReadMaxAgeMs`) the decision just before
    // has most often made will do, a new table showing here at most that late.
    let table = match (vm.cfg.discovery.is_some(), h.now_ms()) {
        (false, Ok(now)) => vm.table(&vm.recent.at(h, now)),
        _ => vm.table(&vm.recent.fresh(h)),
    };
    table
        .endpoints
        .iter()
        .any(|e| e.slot == routed.charge.slot && e.address == *picked)
}

/// Removes a client-sent header; true when it was there. Envoy clears the route cache on
/// every request-header removal, present or not (its route is matched again), so a header
/// seen absent is left alone; one that cannot be read is removed all the same.
fn strip_request_header<H: Host>(h: &H, name: &str) -> bool {
    if matches!(h.request_header(name), Ok(None)) {
        return false;
    }
    let _ = h.remove_request_header(name);
    true
}

fn path_is(path: &str, want: &str) -> bool {
    path.split('?').next().unwrap_or(path) == want
}

/// The API a routed path speaks: the standard paths, else by suffix (for prefixed routes),
/// else chat.
pub(super) fn api_kind(path: &str) -> ApiKind {
    if let Some(k) = ApiKind::from_path(path) {
        return k;
    }
    let p = path.split(['?', '#']).next().unwrap_or(path);
    let p = p.strip_suffix('/').unwrap_or(p);
    if p.ends_with("/chat/completions") {
        ApiKind::ChatCompletions
    } else if p.ends_with("/completions") {
        ApiKind::Completions
    } else if p.ends_with("/responses") {
        ApiKind::Responses
    } else {
        ApiKind::ChatCompletions
    }
}

//! A vLLM-like per-endpoint scheduler: continuous batching in steps.
//!
//! Requests enter a FIFO waiting queue; up to `max_num_seqs` run at once. Each step spends a
//! token budget of `max_num_batched_tokens`: first one token for every running request that
//! is decoding, then the rest as prefill chunks for the running requests still prefilling,
//! oldest first (chunked prefill). A step lasts
//! `prefill_tokens / R_peak + (n_decode > 0) · share · decode_ms · (1 + decode_batch_slope · (n_decode − 1))`
//! (times the time factor), so a lone prompt prefills at R_peak and decode steps slow down as
//! the batch grows. `share` is 1 in a decode-only step and `token_scale` in a step that
//! also prefills: with scaled tokens, a decode-only step of one simulated token stands for
//! `1 / token_scale` engine steps, but a prefill chunk is one engine step, during which each
//! decoding request makes one model token (`token_scale` of a simulated one). Charging a
//! whole simulated token there would slow prefill `1 / token_scale` times more than the
//! engine does when prompts and long outputs share an endpoint. For the same reason a
//! decode-only step ends at the next engine-step boundary when a request arrives during it
//! (vLLM admits waiting requests at every engine step).
//!
//! The prefix cache is looked up when a request is admitted (at least one prompt token is
//! always computed, as in vLLM). A prompt's full blocks join it as their chunks are
//! scheduled, as vLLM v1 caches them when it allocates their slots, so a request admitted
//! during a cold fill of its prefix finds the chunks scheduled so far; the first output token
//! comes with the end of prefill, each further one from decode steps.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};

use super::cache::BLOCK_TOKENS;
use super::server::Endpoint;
use super::timing::Timing;

/// What the scheduler tells a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// Prefill done: the first output token.
    First {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// One more output token.
    Token,
}

pub(crate) struct Seq {
    pub hashes: Vec<u64>,
    pub tokens: usize,
    pub max_tokens: usize,
    pub tx: mpsc::UnboundedSender<Event>,
    cached: usize,
    computed: usize,
    generated: usize,
    /// Decode progress towards the next simulated token (steps that also prefill advance
    /// it by `token_scale`).
    progress: f64,
}

impl Seq {
    pub(crate) fn new(
        hashes: Vec<u64>,
        tokens: usize,
        max_tokens: usize,
        tx: mpsc::UnboundedSender<Event>,
    ) -> Self {
        Self {
            hashes,
            tokens,
            max_tokens: max_tokens.max(1),
            tx,
            cached: 0,
            computed: 0,
            generated: 0,
            progress: 0.0,
        }
    }

    fn decoding(&self) -> bool {
        self.generated > 0
    }

    fn kv_blocks(&self) -> i64 {
        (self.tokens + self.max_tokens).div_ceil(BLOCK_TOKENS) as i64
    }

    /// Blocks of the pool this request holds outside the prefix cache: its whole output
    /// (reserved at admission: the fleet knows it, vLLM would preempt instead) and, until
    /// its prefill completes, the prompt blocks not in the cache (neither found there nor
    /// scheduled yet).
    fn reserved_blocks(&self, cached: usize) -> usize {
        let prompt = if self.decoding() {
            0
        } else {
            self.tokens
                .saturating_sub(cached.max(self.scheduled_tokens()))
        };
        (prompt + self.max_tokens).div_ceil(BLOCK_TOKENS)
    }

    /// Full blocks of the prompt scheduled so far.
    fn scheduled_blocks(&self) -> usize {
        (self.computed / BLOCK_TOKENS).min(self.hashes.len())
    }

    fn scheduled_tokens(&self) -> usize {
        self.scheduled_blocks() * BLOCK_TOKENS
    }
}

/// Blocks the running requests hold outside the prefix cache.
fn reserved(running: &[Seq]) -> usize {
    running.iter().map(|s| s.reserved_blocks(s.cached)).sum()
}

#[derive(Default)]
pub(crate) struct Queues {
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
}

/// The scheduler's shared state: queues and a wake-up for the step loop.
#[derive(Default)]
pub(crate) struct Scheduler {
    queues: Mutex<Queues>,
    wake: Notify,
    started: std::sync::atomic::AtomicBool,
}

/// Share of a simulated token each decoding request makes in a step: a whole one in a
/// decode-only step, `token_scale` of one in a step that also prefills.
pub fn decode_share(t: &Timing, prefill_tokens: usize) -> f64 {
    if prefill_tokens > 0 {
        t.token_scale.clamp(f64::MIN_POSITIVE, 1.0)
    } else {
        1.0
    }
}

/// Duration of one step in model time.
pub fn step_duration(t: &Timing, prefill_tokens: usize, n_decode: usize) -> f64 {
    let prefill = if t.prefill_rate > 0.0 {
        prefill_tokens as f64 / t.prefill_rate
    } else {
        0.0
    };
    let decode = if n_decode > 0 {
        decode_share(t, prefill_tokens) * t.decode_ms_per_token / 1000.0
            * (1.0 + t.decode_batch_slope * (n_decode - 1) as f64)
    } else {
        0.0
    };
    prefill + decode
}

/// Prefill tokens left in a step's budget once each decoding request took its share (one
/// model token: `token_scale` of a simulated one, rounded up over the batch).
fn prefill_budget(t: &Timing, n_decode: usize) -> usize {
    let decode = (n_decode as f64 * t.token_scale.clamp(0.0, 1.0)).ceil() as usize;
    t.max_num_batched_tokens.max(1).saturating_sub(decode)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sleeps shorter than this are skipped (the virtual clock carries them).
const SLACK: Duration = Duration::from_millis(1);

impl Scheduler {
    /// Queues a request; starts the endpoint's step loop on first use.
    pub(crate) fn submit(&self, ep: &Arc<Endpoint>, seq: Seq) {
        lock(&self.queues).waiting.push_back(seq);
        ep.waiting.fetch_add(1, Ordering::Relaxed);
        if !self.started.swap(true, Ordering::AcqRel) {
            let ep = ep.clone();
            tokio::spawn(async move { run(ep).await });
        }
        self.wake.notify_one();
    }
}

async fn run(ep: Arc<Endpoint>) {
    let sched = &ep.sched;
    let t = ep.cfg.timing_for(ep.port);
    let tf = t.time_factor.max(0.0);
    let mut clock = Instant::now();
    loop {
        // Plan one step under the lock; no await while holding it.
        let plan = {
            let mut q = lock(&sched.queues);
            // Requests whose client went away leave the batch.
            q.running.retain(|s| {
                let keep = !s.tx.is_closed();
                if !keep {
                    ep.kv_used_blocks
                        .fetch_sub(s.kv_blocks(), Ordering::Relaxed);
                }
                keep
            });
            let before = q.waiting.len();
            q.waiting.retain(|s| !s.tx.is_closed());
            let mut admitted = before - q.waiting.len();
            let mut held = reserved(&q.running);
            let pool = ep.cfg.kv_blocks;
            while q.running.len() < t.max_num_seqs.max(1) {
                let Some(front) = q.waiting.front() else {
                    break;
                };
                let cached = lock(&ep.cache)
                    .cached_tokens(&front.hashes, front.tokens)
                    .min(front.tokens.saturating_sub(1));
                // vLLM admits the head of the queue only when the pool has room for it
                // (prefix-cache blocks are evictable room); a request alone runs anyway.
                let need = front.reserved_blocks(cached);
                if !q.running.is_empty() && held + need > pool {
                    break;
                }
                let Some(mut s) = q.waiting.pop_front() else {
                    break;
                };
                held += need;
                admitted += 1;
                s.cached = cached;
                s.computed = cached;
                // vLLM counts the prefix-cache lookup when it schedules a request
                // (`get_computed_blocks`), before its prefill.
                ep.prefix_queries
                    .fetch_add(s.tokens as u64, Ordering::Relaxed);
                ep.prefix_hits.fetch_add(cached as u64, Ordering::Relaxed);
                ep.kv_used_blocks
                    .fetch_add(s.kv_blocks(), Ordering::Relaxed);
                q.running.push(s);
            }
            ep.waiting.fetch_sub(admitted as i64, Ordering::Relaxed);
            ep.running.store(q.running.len() as i64, Ordering::Relaxed);
            lock(&ep.cache).set_limit(pool.saturating_sub(held));
            if q.running.is_empty() {
                None
            } else {
                let n_decode = q.running.iter().filter(|s| s.decoding()).count();
                let mut budget = prefill_budget(&t, n_decode);
                let mut prefill = 0;
                let mut spans = Vec::new();
                for s in q.running.iter_mut().filter(|s| !s.decoding()) {
                    if budget == 0 {
                        break;
                    }
                    // Its first chunk also touches the blocks it found cached, which vLLM
                    // pins while the request runs.
                    let before = match s.computed == s.cached {
                        true => 0,
                        false => s.scheduled_blocks(),
                    };
                    let take = budget.min(s.tokens - s.computed);
                    s.computed += take;
                    budget -= take;
                    prefill += take;
                    spans.push(before..s.scheduled_blocks());
                }
                // Scheduled blocks join the cache and no longer count as reserved: first the
                // room they leave, then the blocks. Only the new ones (a 10 MB prompt has
                // 160,000 blocks): vLLM pins them while the request runs, here they are the
                // newest; the whole prompt is stamped again, head newest, when it ends.
                let mut cache = lock(&ep.cache);
                cache.set_limit(pool.saturating_sub(reserved(&q.running)));
                let prefilling = q.running.iter().filter(|s| !s.decoding());
                for (s, span) in prefilling.zip(spans) {
                    cache.insert(&s.hashes[span]);
                }
                Some((prefill, n_decode))
            }
        };
        let Some((prefill_tokens, n_decode)) = plan else {
            // Idle: wait for work; the clock restarts from now.
            sched.wake.notified().await;
            clock = Instant::now();
            continue;
        };
        let now = Instant::now();
        if now.saturating_duration_since(clock) > SLACK {
            clock = now;
        }
        let step = step_duration(&t, prefill_tokens, n_decode) * tf;
        let mut share = decode_share(&t, prefill_tokens);
        if prefill_tokens == 0 && step.is_finite() && step > 0.0 {
            (clock, share) = decode_only_step(&sched.wake, clock, step, t.token_scale).await;
        } else {
            if step.is_finite() && step > 0.0 {
                clock += Duration::from_secs_f64(step);
            }
            sleep_until_due(clock).await;
        }
        // Deliver the step's tokens.
        let mut q = lock(&sched.queues);
        let mut filled = Vec::new();
        q.running.retain_mut(|s| {
            if s.decoding() {
                s.progress += share;
                // A float sum of shares may land a hair under 1.
                if s.progress >= 1.0 - 1e-9 {
                    s.progress = (s.progress - 1.0).max(0.0);
                    s.generated += 1;
                    let _ = s.tx.send(Event::Token);
                    ep.generation_tokens.fetch_add(1, Ordering::Relaxed);
                }
            } else if s.computed >= s.tokens {
                filled.push(std::mem::take(&mut s.hashes));
                ep.prompt_tokens
                    .fetch_add(s.tokens as u64, Ordering::Relaxed);
                s.generated = 1;
                let _ = s.tx.send(Event::First {
                    prompt_tokens: s.tokens,
                    cached_tokens: s.cached,
                });
                ep.generation_tokens.fetch_add(1, Ordering::Relaxed);
            }
            let done = s.generated >= s.max_tokens;
            if done {
                ep.requests.fetch_add(1, Ordering::Relaxed);
                ep.kv_used_blocks
                    .fetch_sub(s.kv_blocks(), Ordering::Relaxed);
            }
            !done
        });
        // Finished prompts join the cache, whose room grew by what they and the finished
        // requests no longer reserve.
        let mut cache = lock(&ep.cache);
        cache.set_limit(ep.cfg.kv_blocks.saturating_sub(reserved(&q.running)));
        for hashes in &filled {
            cache.insert(hashes);
        }
        drop(cache);
        ep.running.store(q.running.len() as i64, Ordering::Relaxed);
    }
}

/// A decode-only step from `start`, `step_s` long: returns its end and the share of a
/// simulated token each decoder made. Scaled, the step stands for `1 / token_scale` engine
/// steps, and vLLM admits waiting requests at every engine step: a request that arrives
/// during it ends it at the next engine-step boundary, with the decoders credited the engine
/// steps done. (Run whole, it made a short prompt that arrived just after it began wait ten
/// engine steps, which the learned prefill rate counted as prefill time.)
async fn decode_only_step(
    wake: &Notify,
    start: Instant,
    step_s: f64,
    token_scale: f64,
) -> (Instant, f64) {
    let full = start + Duration::from_secs_f64(step_s);
    let scale = token_scale.clamp(f64::MIN_POSITIVE, 1.0);
    if scale >= 1.0 || full <= Instant::now() + SLACK {
        sleep_until_due(full).await;
        return (full, 1.0);
    }
    tokio::select! {
        _ = tokio::time::sleep_until(full.into()) => (full, 1.0),
        _ = wake.notified() => {
            let engine_s = step_s * scale;
            let done = Instant::now().saturating_duration_since(start).as_secs_f64();
            let steps = (done / engine_s).ceil().max(1.0);
            let end = start + Duration::from_secs_f64((steps * engine_s).min(step_s));
            sleep_until_due(end).await;
            (end, (steps * scale).min(1.0))
        }
    }
}

/// Sleeps until `at`, unless it is within `SLACK` of now (the step clock may run behind).
async fn sleep_until_due(at: Instant) {
    if at > Instant::now() + SLACK {
        tokio::time::sleep_until(at.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_time_grows_with_the_batch() {
        let t = Timing::default();
        assert!((step_duration(&t, 8192, 0) - 8192.0 / 20480.0).abs() < 1e-12);
        let one = step_duration(&t, 0, 1);
        assert!((one - 0.005).abs() < 1e-12);
        assert!(step_duration(&t, 0, 101) > one * 1.2);
        assert!(step_duration(&t, 100, 10) > step_duration(&t, 0, 10));
    }

    /// Scaled to 0.02, a step that prefills a full budget costs what the unscaled engine's
    /// step does (0.4 s + one 5 ms decode step), not 0.4 s + a 250 ms simulated token, and
    /// its decoders make a fiftieth of a token.
    #[test]
    fn a_scaled_prefill_step_carries_one_model_decode_step() {
        let scale = 0.02;
        let t = Timing {
            prefill_rate: 20480.0 * scale,
            decode_ms_per_token: 5.0 / scale,
            max_num_batched_tokens: (8192.0 * scale) as usize,
            token_scale: scale,
            ..Timing::default()
        };
        let unscaled = Timing::default();
        let full = t.max_num_batched_tokens;
        let scaled = step_duration(&t, full, 1);
        let engine = step_duration(&unscaled, unscaled.max_num_batched_tokens, 1);
        assert!((scaled - engine).abs() < 0.01, "{scaled} vs {engine}");
        assert!((decode_share(&t, full) - scale).abs() < 1e-12);
        // Decode-only steps are whole simulated tokens, as before.
        assert_eq!(decode_share(&t, 0), 1.0);
        assert!((step_duration(&t, 0, 1) - 0.25).abs() < 1e-12);
        // Ten decoders take one budget token (10 × 0.02 rounded up), not ten.
        assert_eq!(prefill_budget(&t, 10), full - 1);
        assert_eq!(prefill_budget(&unscaled, 10), 8192 - 10);
    }
}

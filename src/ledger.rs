//! Load ledger: per endpoint, the uncached prompt tokens this gateway has sent that are not
//! yet prefilled (`U`), and its requests not yet finished (`A`). Charged at pick time (so a
//! burst sees its own load), prefill released at the first response byte, the request at end
//! of stream, reset, error or timeout. Releases are idempotent: a `Charge` remembers what it
//! still holds. Clearing a slot (its endpoint left) starts the slot's next tenure, and a
//! release returns only what its own tenure holds: a request in flight across the clear
//! neither leaks onto the slot's next owner nor takes back what was charged there since.
//!
//! Missed predictions. A predicted hit is charged at its uncached tokens, so an endpoint
//! whose cache has started to lose what the index says it holds keeps a small ledger while
//! most requests there prefill their whole prompt. The ledger also keeps, per endpoint, the
//! recent share of predicted hits whose `usage` said they missed (each answer weighs 1/8;
//! written with the request's final release, so it costs no store call of its own).
//!
//! Expiry. Charges are kept in a ring of time buckets per endpoint; a bucket older than the
//! request TTL is dropped whole, so a charge that is never released (a crashed worker VM)
//! stops counting after at most TTL + one bucket, with no per-request key in the store.

use std::rc::Rc;

use crate::store::{
    read_u32, read_u64, update, write_u32, write_u64, SharedStore, SlotKeys, StoreError,
};

const RING: usize = 8;
const SLOT_BYTES: usize = 24;
/// After the ring: the recent work window (start ms, tokens this window, tokens last window).
const WORK_AT: usize = RING * SLOT_BYTES;
/// Then the recent share of predicted hits that missed, in 1/65,536ths.
const MISSED_AT: usize = WORK_AT + 24;
/// Then the uncached tokens charged in each of the last `RECENT` quarter seconds:
/// (quarter-second number, tokens), for what the servers' counters cannot show yet.
const RECENT_AT: usize = MISSED_AT + 8;
const RECENT: usize = 8;
const RECENT_MS: u64 = 250;
/// Then the cold placements this gateway made there, decaying with `PLACED_HALF_LIFE_S`:
/// (count as f32, second of the last update).
const PLACED_AT: usize = RECENT_AT + RECENT * 8;
const PLACED_HALF_LIFE_S: f32 = 120.0;
/// Then the slot's tenure, which every clear moves on: a release returns only what was
/// charged in the same tenure, so a request in flight across a clear (its endpoint left,
/// or left and came back to the same slot) leaves what was charged after it alone.
const TENURE_AT: usize = PLACED_AT + 8;
const VALUE: usize = TENURE_AT + 4;
const SHARE_ONE: u32 = 1 << 16;
/// Each checked prediction moves the missed share this part of the way to 0 or 1.
const MISSED_WEIGHT: u32 = 8;
/// Length of one work-rate window.
pub const WORK_WINDOW_MS: u64 = 10_000;

/// One endpoint's load as this gateway knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Uncached prompt tokens sent and not yet prefilled.
    pub tokens: u64,
    /// Requests sent and not yet finished.
    pub requests: u64,
    /// Requests sent and not yet answered (still queued or prefilling).
    pub prefilling: u64,
}

/// What one request holds in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub slot: u16,
    epoch: u32,
    tenure: u32,
    pub tokens: u64,
    prefill_held: bool,
    request_held: bool,
}

impl Charge {
    pub fn is_released(&self) -> bool {
        !self.prefill_held && !self.request_held
    }
}

#[derive(Debug, Clone)]
pub struct LoadLedger {
    keys: SlotKeys,
    bucket_ms: u64,
}

impl LoadLedger {
    pub fn new(namespace: &str, ttl_s: u64) -> Self {
        LoadLedger {
            keys: SlotKeys::new(&format!("{namespace}/ld/"), None),
            bucket_ms: (ttl_s.max(1) * 1000).div_ceil(RING as u64 - 1),
        }
    }

    fn key(&self, slot: u16) -> Rc<str> {
        self.keys.get(slot)
    }

    fn epoch(&self, now_ms: u64) -> u32 {
        (now_ms / self.bucket_ms) as u32
    }

    /// Adds a request and its uncached tokens to `slot`.
    pub fn charge<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        tokens: u64,
        now_ms: u64,
    ) -> Result<Charge, StoreError> {
        self.charge_placed(s, slot, tokens, now_ms, false)
    }

    /// `charge`; `placed`: the request places a prefix cold there (counted in `placed`).
    pub fn charge_placed<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        tokens: u64,
        now_ms: u64,
        placed: bool,
    ) -> Result<Charge, StoreError> {
        let epoch = self.epoch(now_ms);
        let work = Some((now_ms, tokens, placed));
        let u = Update {
            epoch,
            tenure: None,
            work,
            missed: None,
        };
        let tenure = self.apply_with(s, slot, u, |b| {
            b.requests = b.requests.saturating_add(1);
            b.prefilling = b.prefilling.saturating_add(1);
            b.tokens = b.tokens.saturating_add(tokens);
        })?;
        Ok(Charge {
            slot,
            epoch,
            tenure: tenure.unwrap_or(0),
            tokens,
            prefill_held: true,
            request_held: true,
        })
    }

    /// First response byte: the prompt is prefilled.
    pub fn release_prefill<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        c: &mut Charge,
    ) -> Result<(), StoreError> {
        if !c.prefill_held {
            return Ok(());
        }
        let tokens = c.tokens;
        self.apply_with(s, c.slot, Update::release(c, None), |b| {
            b.tokens = b.tokens.saturating_sub(tokens);
            b.prefilling = b.prefilling.saturating_sub(1);
        })?;
        c.prefill_held = false;
        Ok(())
    }

    /// End of stream, reset, error or timeout: everything the request still holds.
    pub fn release<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        c: &mut Charge,
    ) -> Result<(), StoreError> {
        self.release_checked(s, c, None)
    }

    /// `release`, with what the answer said of a predicted hit (`Some(true)`: it missed,
    /// `Some(false)`: it held; `None`: no prediction, or no `usage`).
    pub fn release_checked<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        c: &mut Charge,
        missed: Option<bool>,
    ) -> Result<(), StoreError> {
        if !c.request_held {
            return self.release_prefill(s, c);
        }
        // One update for whatever is still held.
        let (prefill, tokens) = (c.prefill_held, c.tokens);
        let apply = |b: &mut Bucket| {
            if prefill {
                b.tokens = b.tokens.saturating_sub(tokens);
                b.prefilling = b.prefilling.saturating_sub(1);
            }
            b.requests = b.requests.saturating_sub(1);
        };
        self.apply_with(s, c.slot, Update::release(c, missed), apply)?;
        c.prefill_held = false;
        c.request_held = false;
        Ok(())
    }

    /// The endpoint's load, counting only buckets younger than the TTL.
    pub fn load<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        now_ms: u64,
    ) -> Result<Load, StoreError> {
        self.read(s, slot, now_ms).map(|(load, _)| load)
    }

    /// The load, and the uncached tokens charged per second over the last 10–20 s: the
    /// endpoint's prefill utilisation times R_peak, steadier than the instantaneous queue.
    pub fn read<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        now_ms: u64,
    ) -> Result<(Load, u64), StoreError> {
        self.read_all(s, slot, now_ms)
            .map(|(load, work, _)| (load, work))
    }

    /// `read`, and the recent share of predicted hits there whose answers missed.
    pub fn read_all<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        now_ms: u64,
    ) -> Result<(Load, u64, f64), StoreError> {
        let (v, _) = s.get(&self.key(slot))?;
        let v = v.unwrap_or_default();
        let now = self.epoch(now_ms);
        let mut load = Load::default();
        for i in 0..RING {
            let b = Bucket::read(&v, i);
            if now.wrapping_sub(b.epoch) < RING as u32 && b.epoch <= now {
                load.tokens = load.tokens.saturating_add(b.tokens);
                load.requests = load.requests.saturating_add(u64::from(b.requests));
                load.prefilling = load.prefilling.saturating_add(u64::from(b.prefilling));
            }
        }
        let w = Work::read(&v).rolled(now_ms);
        let span = WORK_WINDOW_MS + now_ms.saturating_sub(w.start);
        let work = (w.cur + w.prev).saturating_mul(1000) / span.max(1);
        let missed = f64::from(read_u32(&v, MISSED_AT).min(SHARE_ONE)) / f64::from(SHARE_ONE);
        Ok((load, work, missed))
    }

    /// Uncached tokens charged since `since_ms` (to a quarter second, and at most the last
    /// two seconds): what a poll of the server's counters at `since_ms` cannot have shown.
    pub fn charged_since<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        now_ms: u64,
        since_ms: u64,
    ) -> Result<u64, StoreError> {
        let (v, _) = s.get(&self.key(slot))?;
        let v = v.unwrap_or_default();
        // Quarter seconds are kept in 32 bits; ages are told by wrapping differences.
        let now_q = (now_ms / RECENT_MS) as u32;
        let since_age = now_q.wrapping_sub((since_ms / RECENT_MS) as u32);
        let total = (0..RECENT)
            .map(|i| RECENT_AT + i * 8)
            .filter(|&at| {
                let age = now_q.wrapping_sub(read_u32(&v, at));
                age < RECENT as u32 && age <= since_age
            })
            .map(|at| u64::from(read_u32(&v, at + 4)))
            .sum();
        Ok(total)
    }

    /// Cold placements this gateway made on the endpoint, each counting less as it ages
    /// (half after `PLACED_HALF_LIFE_S`): roughly how many prefixes it placed there lately.
    pub fn placed<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        now_ms: u64,
    ) -> Result<f64, StoreError> {
        let (v, _) = s.get(&self.key(slot))?;
        Ok(f64::from(placed_at(&v.unwrap_or_default(), now_ms)))
    }

    /// Drops an endpoint's load (removed from the fleet) and starts the slot's next tenure.
    /// Only clears move the tenure, so the version read need not guard the write: a charge
    /// or release racing it lands on either side, and either is right.
    pub fn clear<S: SharedStore + ?Sized>(&self, s: &S, slot: u16) -> Result<(), StoreError> {
        let key = self.key(slot);
        let (old, _) = s.get_fresh(&key)?;
        let tenure = read_u32(old.as_deref().unwrap_or(&[]), TENURE_AT).wrapping_add(1);
        let mut v = [0u8; VALUE];
        write_u32(&mut v, TENURE_AT, tenure);
        s.set(&key, &v, None)
    }

    /// Read-modify-write of the bucket for `epoch`, counting a checked prediction into the
    /// missed share (whatever the bucket: the share is the endpoint's, not a charge's). A
    /// charge (`work`: its time and tokens) claims a stale bucket (resetting it: that is the
    /// expiry) and adds to the work window; a release (`tenure`: its charge's) only touches
    /// a value still in that tenure and a bucket still on its own epoch. Returns the tenure
    /// written in (`None`: nothing written).
    fn apply_with<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        u: Update,
        f: impl Fn(&mut Bucket),
    ) -> Result<Option<u32>, StoreError> {
        let Update {
            epoch,
            tenure,
            work,
            missed,
        } = u;
        let claim = work.is_some();
        update(s, &self.key(slot), |old| {
            let mut v = vec![0u8; VALUE];
            let n = old.len().min(v.len());
            v[..n].copy_from_slice(&old[..n]);
            let now_tenure = read_u32(&v, TENURE_AT);
            if tenure.is_some_and(|t| t != now_tenure) {
                return None;
            }
            let i = epoch as usize % RING;
            let mut b = Bucket::read(&v, i);
            if let Some(missed) = missed {
                let old = read_u32(&v, MISSED_AT).min(SHARE_ONE);
                let to = if missed { SHARE_ONE } else { 0 };
                let moved = old - old / MISSED_WEIGHT + to / MISSED_WEIGHT;
                write_u32(&mut v, MISSED_AT, moved);
            }
            if b.epoch != epoch {
                if !claim && missed.is_none() {
                    return None;
                }
                if !claim {
                    // An expired charge: its bucket is gone, but its answer still counts.
                    return Some((v, now_tenure));
                }
                b = Bucket {
                    epoch,
                    ..Bucket::default()
                };
            }
            f(&mut b);
            b.write(&mut v, i);
            if let Some((now_ms, tokens, placed)) = work {
                let mut w = Work::read(&v).rolled(now_ms);
                w.cur = w.cur.saturating_add(tokens);
                w.write(&mut v);
                add_recent(&mut v, now_ms, tokens);
                if placed {
                    let count = placed_at(&v, now_ms) + 1.0;
                    write_u32(&mut v, PLACED_AT, count.to_bits());
                    write_u32(&mut v, PLACED_AT + 4, (now_ms / 1000) as u32);
                }
            }
            Some((v, now_tenure))
        })
    }
}

/// One ledger update beside its bucket change: the bucket's `epoch`; for a release, the
/// charge's `tenure`; for a charge, its `work` (time, tokens, whether it places cold); and
/// what an answer said of a predicted hit (`missed`).
#[derive(Debug, Clone, Copy)]
struct Update {
    epoch: u32,
    tenure: Option<u32>,
    work: Option<(u64, u64, bool)>,
    missed: Option<bool>,
}

impl Update {
    fn release(c: &Charge, missed: Option<bool>) -> Update {
        Update {
            epoch: c.epoch,
            tenure: Some(c.tenure),
            work: None,
            missed,
        }
    }
}

/// The decayed placement count of a value at `now_ms` (0 for anything not a count).
fn placed_at(v: &[u8], now_ms: u64) -> f32 {
    let count = f32::from_bits(read_u32(v, PLACED_AT));
    if !count.is_finite() || count <= 0.0 {
        return 0.0;
    }
    let age_s = ((now_ms / 1000) as u32).wrapping_sub(read_u32(v, PLACED_AT + 4));
    // A wrapped age (a clock that went back) counts as fresh.
    let age_s = if age_s > u32::MAX / 2 { 0 } else { age_s };
    count * 0.5f32.powf(age_s as f32 / PLACED_HALF_LIFE_S)
}

/// Adds a charge to its quarter second's slot, claiming the slot from an older quarter.
fn add_recent(v: &mut [u8], now_ms: u64, tokens: u64) {
    let q = (now_ms / RECENT_MS) as u32;
    let at = RECENT_AT + (q as usize % RECENT) * 8;
    let held = match read_u32(v, at) == q {
        true => read_u32(v, at + 4),
        false => 0,
    };
    write_u32(v, at, q);
    write_u32(
        v,
        at + 4,
        held.saturating_add(tokens.min(u64::from(u32::MAX)) as u32),
    );
}

/// Uncached tokens charged in the current and the previous window.
#[derive(Debug, Clone, Copy, Default)]
struct Work {
    start: u64,
    cur: u64,
    prev: u64,
}

impl Work {
    fn read(v: &[u8]) -> Work {
        Work {
            start: read_u64(v, WORK_AT),
            cur: read_u64(v, WORK_AT + 8),
            prev: read_u64(v, WORK_AT + 16),
        }
    }

    fn write(&self, v: &mut [u8]) {
        write_u64(v, WORK_AT, self.start);
        write_u64(v, WORK_AT + 8, self.cur);
        write_u64(v, WORK_AT + 16, self.prev);
    }

    /// The window as it stands at `now_ms`.
    fn rolled(self, now_ms: u64) -> Work {
        let aligned = now_ms - now_ms % WORK_WINDOW_MS;
        match now_ms.saturating_sub(self.start) {
            d if d < WORK_WINDOW_MS => self,
            d if d < 2 * WORK_WINDOW_MS => Work {
                start: aligned,
                cur: 0,
                prev: self.cur,
            },
            _ => Work {
                start: aligned,
                cur: 0,
                prev: 0,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    epoch: u32,
    requests: u32,
    prefilling: u32,
    tokens: u64,
}

impl Bucket {
    fn read(v: &[u8], i: usize) -> Bucket {
        let at = i * SLOT_BYTES;
        Bucket {
            epoch: read_u32(v, at),
            requests: read_u32(v, at + 4),
            prefilling: read_u32(v, at + 8),
            tokens: read_u64(v, at + 16),
        }
    }

    fn write(&self, v: &mut [u8], i: usize) {
        let at = i * SLOT_BYTES;
        write_u32(v, at, self.epoch);
        write_u32(v, at + 4, self.requests);
        write_u32(v, at + 8, self.prefilling);
        write_u64(v, at + 16, self.tokens);
    }
}

/// Model-server metrics for one endpoint, as last scraped.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Scraped {
    pub waiting: f64,
    pub running: f64,
    /// Share of the KV pool the running requests hold (0 when not reported).
    pub kv_usage: f64,
}

/// Blends this gateway's load with what the model server reports, to see load other gateway
/// replicas put there:
///
/// - requests others queued ≈ `max(0, waiting − our prefilling)`; each is assumed to carry
///   the mean uncached tokens of our own prefilling requests (or `fallback_tokens` when we
///   have none in flight), so `U' = U + others × mean`;
/// - `A' = max(A, waiting + running)`.
///
/// A scrape is a snapshot taken up to one poll interval ago, so it only adds load that our
/// own ledger cannot see; it never subtracts.
pub fn blend(local: Load, scraped: Option<Scraped>, fallback_tokens: u64) -> Load {
    let Some(m) = scraped else { return local };
    let finite = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let waiting = finite(m.waiting).round() as u64;
    let running = finite(m.running).round() as u64;
    let others = waiting.saturating_sub(local.prefilling);
    let mean = match local.prefilling {
        0 => fallback_tokens,
        n => local.tokens / n,
    };
    Load {
        tokens: local.tokens.saturating_add(others.saturating_mul(mean)),
        requests: local.requests.max(waiting.saturating_add(running)),
        prefilling: local.prefilling.max(waiting),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn cold_placements_are_counted_and_fade() {
        let s = MemStore::new();
        let l = LoadLedger::new("ns", 600);
        for t in 0..3 {
            let mut c = l.charge_placed(&s, 1, 100, 1_000 + t, true).unwrap();
            l.release(&s, &mut c).unwrap();
        }
        l.charge(&s, 1, 100, 1_500).unwrap();
        assert_eq!(l.placed(&s, 1, 1_500).unwrap(), 3.0);
        assert_eq!(l.placed(&s, 0, 1_500).unwrap(), 0.0);
        // Half after the half-life; a clock read before the last update counts it fresh.
        let half = l.placed(&s, 1, 1_000 + 120_000).unwrap();
        assert!((half - 1.5).abs() < 1e-3, "{half}");
        assert_eq!(l.placed(&s, 1, 0).unwrap(), 3.0);
        // Garbage where the count is reads as none.
        let mut v = s.get("ns/ld/1").unwrap().0.unwrap().to_vec();
        write_u32(&mut v, PLACED_AT, f32::NAN.to_bits());
        s.set("ns/ld/1", &v, None).unwrap();
        assert_eq!(l.placed(&s, 1, 1_500).unwrap(), 0.0);
    }
    #[test]
    fn charge_and_release_paths() {
        let s = MemStore::new();
        let l = LoadLedger::new("t", 600);
        let mut a = l.charge(&s, 0, 1000, 0).unwrap();
        let mut b = l.charge(&s, 0, 500, 10).unwrap();
        let (at10, work) = l.read(&s, 0, 10).unwrap();
        assert_eq!((at10.tokens, at10.requests, at10.prefilling), (1500, 2, 2));
        assert_eq!(work, 1500 * 1000 / 10_010);
        l.release_prefill(&s, &mut a).unwrap();
        l.release_prefill(&s, &mut a).unwrap();
        let at20 = l.load(&s, 0, 20).unwrap();
        assert_eq!((at20.tokens, at20.requests, at20.prefilling), (500, 2, 1));
        l.release(&s, &mut b).unwrap();
        l.release(&s, &mut a).unwrap();
        l.release(&s, &mut a).unwrap();
        assert!(a.is_released() && b.is_released());
        assert_eq!(l.load(&s, 0, 30).unwrap(), Load::default());
        // The work rate forgets after two windows.
        assert_eq!(l.read(&s, 0, 30_000).unwrap().1, 0);
    }

    #[test]
    fn a_release_across_a_clear_leaves_the_next_tenure_alone() {
        let s = MemStore::new();
        let l = LoadLedger::new("t", 600);
        let load = || l.load(&s, 0, 1_500).unwrap();
        // In flight when its endpoint left the slot (and came back to it, or another took it).
        let mut before = l.charge(&s, 0, 700, 1_000).unwrap();
        let mut streamed = l.charge(&s, 0, 300, 1_000).unwrap();
        l.clear(&s, 0).unwrap();
        l.clear(&s, 0).unwrap();
        let mut after = l.charge(&s, 0, 100, 1_200).unwrap();
        l.release_prefill(&s, &mut streamed).unwrap();
        l.release(&s, &mut before).unwrap();
        l.release(&s, &mut streamed).unwrap();
        let only_after = Load {
            tokens: 100,
            requests: 1,
            prefilling: 1,
        };
        assert_eq!(load(), only_after);
        // Charged after the clear (a decision on a table read before it): returned in full.
        l.release(&s, &mut after).unwrap();
        assert_eq!(load(), Load::default());
    }

    #[test]
    fn a_value_from_before_tenures_keeps_its_charges() {
        // A ledger written without a tenure (a value of the older, shorter layout) reads as
        // tenure 0, so its charges are still returned.
        let s = MemStore::new();
        let l = LoadLedger::new("t", 600);
        let mut c = l.charge(&s, 2, 500, 1_000).unwrap();
        let key = "t/ld/2";
        let v = s.get(key).unwrap().0.unwrap();
        s.set(key, &v[..TENURE_AT], None).unwrap();
        l.release(&s, &mut c).unwrap();
        assert_eq!(l.load(&s, 2, 1_000).unwrap(), Load::default());
    }

    #[test]
    fn stale_charges_expire() {
        let s = MemStore::new();
        let l = LoadLedger::new("t", 70);
        l.charge(&s, 3, 1000, 0).unwrap();
        assert_eq!(l.load(&s, 3, 69_000).unwrap().tokens, 1000);
        assert_eq!(l.load(&s, 3, 81_000).unwrap().tokens, 0);
        // A new charge reuses the expired bucket; the late release of the old one is ignored.
        let mut late = Charge {
            slot: 3,
            epoch: 0,
            tenure: 0,
            tokens: 1000,
            prefill_held: true,
            request_held: true,
        };
        let _fresh = l.charge(&s, 3, 200, 80_000 + 8 * 10_000).unwrap();
        l.release(&s, &mut late).unwrap();
        assert_eq!(l.load(&s, 3, 80_000 + 8 * 10_000).unwrap().tokens, 200);
    }

    #[test]
    fn the_missed_share_follows_the_recent_checked_predictions() {
        let s = MemStore::new();
        let l = LoadLedger::new("t", 70);
        let share = |now| l.read_all(&s, 0, now).unwrap().2;
        let answer = |now, missed| {
            let mut c = l.charge(&s, 0, 100, now).unwrap();
            l.release_checked(&s, &mut c, missed).unwrap();
            // A second release counts nothing more.
            l.release_checked(&s, &mut c, missed).unwrap();
        };
        answer(0, Some(true));
        assert!((share(1) - 0.125).abs() < 1e-4);
        answer(1, None); // no prediction: nothing moves
        assert!((share(2) - 0.125).abs() < 1e-4);
        for i in 0..40 {
            answer(2 + i, Some(true));
        }
        assert!(share(50) > 0.99);
        // Holds bring it down the same way; sporadic misses keep it low.
        for i in 0..40 {
            answer(50 + i, Some(i % 5 == 0));
        }
        assert!(share(100) < 0.35, "{}", share(100));
        // The answer of a charge whose bucket expired still counts; its load does not.
        let before = share(100);
        let mut old = l.charge(&s, 0, 100, 100).unwrap();
        let later = 300_000;
        l.charge(&s, 0, 7, later).unwrap();
        l.release_checked(&s, &mut old, Some(true)).unwrap();
        assert!(share(later) > before);
        assert_eq!(l.load(&s, 0, later).unwrap().tokens, 7);
    }

    #[test]
    fn charged_since_counts_what_a_poll_then_could_not_have_shown() {
        let s = MemStore::new();
        let l = LoadLedger::new("t", 600);
        let mut c = l.charge(&s, 0, 100, 10_000).unwrap();
        l.charge(&s, 0, 200, 10_300).unwrap();
        l.charge(&s, 0, 400, 10_600).unwrap();
        // A first byte does not take a charge back out: the servers counted it or not.
        l.release_prefill(&s, &mut c).unwrap();
        // Polled at 10,250 ms: the charges from that quarter second on (a poll's counters
        // may predate its answer a little).
        assert_eq!(l.charged_since(&s, 0, 10_700, 10_250).unwrap(), 600);
        assert_eq!(l.charged_since(&s, 0, 10_700, 10_700).unwrap(), 400);
        // A poll older than the ring: the last two seconds.
        assert_eq!(l.charged_since(&s, 0, 10_700, 0).unwrap(), 700);
        assert_eq!(l.charged_since(&s, 0, 12_100, 0).unwrap(), 600);
        assert_eq!(l.charged_since(&s, 0, 13_000, 0).unwrap(), 0);
        // A new quarter second claims the slot of one two seconds older.
        l.charge(&s, 0, 50, 12_000).unwrap();
        assert_eq!(l.charged_since(&s, 0, 12_100, 0).unwrap(), 650);
        // Milliseconds since 1970 overflow 32 bits of quarter seconds: ages still count.
        let t = 1_800_000_000_000;
        l.charge(&s, 1, 30, t).unwrap();
        assert_eq!(l.charged_since(&s, 1, t + 10, t - 1_000).unwrap(), 30);
        assert_eq!(l.charged_since(&s, 1, t + 3_000, t - 1_000).unwrap(), 0);
    }

    #[test]
    fn blend_adds_others_load() {
        let local = Load {
            tokens: 3000,
            requests: 4,
            prefilling: 3,
        };
        let b = blend(
            local,
            Some(Scraped {
                waiting: 5.0,
                running: 6.0,
                kv_usage: 0.5,
            }),
            700,
        );
        assert_eq!(b.tokens, 3000 + 2 * 1000);
        assert_eq!(b.requests, 11);
        assert_eq!(blend(local, None, 1), local);
        let idle = blend(
            Load::default(),
            Some(Scraped {
                waiting: 2.0,
                running: f64::NAN,
                kv_usage: 0.0,
            }),
            700,
        );
        assert_eq!(idle.tokens, 1400);
        assert_eq!(idle.requests, 2);
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod props {
    use super::*;
    use crate::store::MemStore;
    use proptest::prelude::*;

    proptest! {
        /// Any interleaving of dispatch, first byte, completion, error and reset leaves the
        /// ledger at zero once every request has ended, and never below zero on the way.
        #[test]
        fn returns_to_zero(ops in proptest::collection::vec((0u8..5, 0usize..16, 1u64..100_000), 1..200)) {
            let s = MemStore::new();
            let l = LoadLedger::new("p", 600);
            let mut open: Vec<Charge> = Vec::new();
            let mut now = 0;
            for (op, pick, tokens) in ops {
                now += 7;
                match op {
                    0 | 1 => open.push(l.charge(&s, (pick % 3) as u16, tokens, now).unwrap()),
                    2 => {
                        let n = open.len().max(1);
                        if let Some(c) = open.get_mut(pick % n) { l.release_prefill(&s, c).unwrap() }
                    }
                    _ => {
                        let n = open.len().max(1);
                        if let Some(c) = open.get_mut(pick % n) { l.release(&s, c).unwrap() }
                    }
                }
                let expect: u64 = open.iter().filter(|c| c.prefill_held).map(|c| c.tokens).sum();
                let total: u64 = (0..3).map(|e| l.load(&s, e, now).unwrap().tokens).sum();
                prop_assert_eq!(total, expect);
            }
            for c in open.iter_mut() {
                l.release(&s, c).unwrap();
            }
            for e in 0..3 {
                prop_assert_eq!(l.load(&s, e, now).unwrap(), Load::default());
            }
        }
    }
}

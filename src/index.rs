//! Affinity index: which prefix blocks each endpoint is believed to hold. An approximate
//! model of the model servers' KV caches, bounded per endpoint by its capacity in blocks and
//! evicted least-recently-used first; it knows nothing about load.
//!
//! Algorithm. The chain of block hashes is cut into segments of `SEGMENT` blocks. One entry
//! per (endpoint, segment) is keyed by the chain hash of the segment's first block, which
//! stands for the whole prefix before it, and holds 32-bit fingerprints of the segment's other
//! blocks. Entries are stamped with their endpoint's current epoch. Each endpoint keeps a
//! histogram of the blocks it holds per epoch (a touch moves a block's count to the current
//! epoch), and the epoch advances when the current one has taken 1/`EPOCH_SHARE` of the
//! capacity. The live epochs are the newest ones whose counts sum to at most the capacity:
//! an exact LRU over distinct blocks, at epoch granularity, with no per-block ordering.
//!
//! Complexity. Matching one endpoint reads its header and O(log segments) buckets (binary
//! search: held segments form a prefix of the chain, since a prompt's segments share an
//! epoch and die together); inserting reads and writes each touched segment's bucket once.
//! Every read or write is one fixed-size value in the store.
//!
//! Refresh. A segment already stamped in the current or previous epoch is not rewritten, so a
//! hot prefix costs reads, not writes; only its head record's last use (below) is written, at
//! most once a second.
//!
//! Head records. Each endpoint's header also keeps its 16 most recent prefixes (first-block
//! hash, epoch, last use in seconds). Ranked by last use they are a whole-prompt LRU view that
//! does not count the prompts' unique tails: which prompts a server that evicts whole prefixes
//! still holds, and what a new one would push out (`Match::rank`, `Match::victim_used_s`).

use std::cmp::Reverse;
use std::rc::Rc;

use crate::store::{
    key, read_u32, read_u64, update, write_u32, write_u64, Bytes, SharedStore, SlotKeys, StoreError,
};

/// Blocks per index entry.
pub const SEGMENT: usize = 16;
/// Entries per bucket (one store value). 16 rather than 8: at the same memory, a bucket
/// overflows far less often (see `default_headroom_loses_under_half_a_percent`).
pub const WAYS: usize = 16;
/// An entry: tag (u64, 0 when empty), epoch stamp (u32, see `stamp_of`), when its blocks
/// were first written (u32, seconds; a new stamp on a live entry keeps it), endpoint slot
/// (u16), a spare byte, segment length in blocks (u8), then 32-bit fingerprints of the
/// segment's blocks after the first.
const ENTRY: usize = 8 + 4 + 4 + 2 + 1 + 1 + 4 * (SEGMENT - 1);
const STAMP_AT: usize = 8;
const TOUCHED_AT: usize = 12;
const SLOT_AT: usize = 16;
const LEN_AT: usize = 19;
const PRINTS_AT: usize = 20;
/// Epochs in the per-endpoint histogram ring.
const EPOCHS: usize = 64;
/// The epoch advances after taking this share of the capacity: 1/32.
const EPOCH_SHARE: u64 = 32;
/// Heads (first-block hashes) of the prefixes most recently stamped per endpoint, each with
/// the low 32 bits of its epoch and its last use (seconds).
const HEADS: usize = 16;
const COUNTS_AT: usize = 16;
const HEADS_AT: usize = COUNTS_AT + 4 * EPOCHS;
const HEADER: usize = HEADS_AT + 16 * HEADS;

/// Where an entry lives, so an insert can be rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    bucket: u64,
    tag: u64,
    stamp: u64,
    previous: Option<Vec<u8>>,
    /// Its blocks counted in `stamp`.
    counted: Counted,
}

/// Blocks counted in an epoch, and the epoch and count they moved from, if any.
type Counted = (u64, Option<(u64, u64)>);

/// The head record an insert wrote: where, and the bytes it replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HeadNote {
    head: u64,
    at: usize,
    epoch: u64,
    previous: [u8; 16],
}

/// What one insert changed; hand it back to `rollback` if the request fails before its
/// first byte.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertReceipt {
    pub slot: u16,
    pub written: Vec<Written>,
    head: Option<HeadNote>,
}

/// An endpoint's view: matched blocks, its current epoch and capacity, what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Match {
    pub blocks: usize,
    pub clock: u64,
    pub capacity: u64,
    /// The prompt's first block is among the endpoint's recent prefix heads, live or not: a
    /// prefix the index has aged out may still sit in the server's cache.
    pub recalled: bool,
    /// Blocks the endpoint is believed to hold (at most `capacity`).
    pub held: u64,
    /// Whole-prompt LRU view from the head records: this prompt's rank by last use among the
    /// endpoint's recent prefixes (0 = most recent), if it is among them ...
    pub rank: Option<u32>,
    /// ... and the last use of the prefix at the rank a new prompt of this size pushes out
    /// (`capacity / prompt blocks` prompts fit), if the records reach that deep.
    pub victim_used_s: Option<u32>,
    /// ... and the last use of this prompt's own head record there, if it has one.
    pub used_s: Option<u32>,
    /// Blocks stamped on the endpoint since the deepest matched segment was (its LRU stack
    /// distance, at epoch grain), when anything matched: a server whose cache is smaller
    /// than this has evicted it.
    pub distance: Option<u64>,
    /// When that segment's entry was last written (seconds): a prefix sent there moments
    /// ago may still be prefilling, so a miss on it says nothing about the cache's size.
    pub written_s: Option<u32>,
}

/// One held segment: its matching blocks (≥ 1), epoch stamp and last write.
#[derive(Debug, Clone, Copy)]
struct Held {
    blocks: usize,
    stamp: u64,
    written_s: u32,
}

#[derive(Debug, Clone)]
pub struct AffinityIndex {
    prefix: String,
    headers: SlotKeys,
    buckets: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Header {
    /// Current epoch.
    clock: u64,
    capacity: u64,
    /// Oldest live epoch.
    oldest: u64,
    held: u64,
}

impl AffinityIndex {
    /// `total_capacity_blocks`: the sum over endpoints of their capacity; the bucket table is
    /// sized to hold it `headroom` times over (hash collisions evict early otherwise).
    pub fn new(namespace: &str, total_capacity_blocks: u64, headroom: f64) -> Self {
        let entries = (total_capacity_blocks as f64 * headroom / SEGMENT as f64).ceil() as u64;
        let prefix = format!("{namespace}/ix/");
        AffinityIndex {
            headers: SlotKeys::new(&prefix, Some('h')),
            prefix,
            buckets: (entries / WAYS as u64).max(16),
        }
    }

    /// Upper bound on the bytes the index can occupy in the store.
    pub fn max_bytes(&self, endpoints: u64) -> u64 {
        let key = self.prefix.len() as u64 + 18;
        self.buckets * (key + (WAYS * ENTRY) as u64) + endpoints * (key + HEADER as u64)
    }

    fn header_key(&self, slot: u16) -> Rc<str> {
        self.headers.get(slot)
    }

    fn bucket_key(&self, bucket: u64) -> String {
        key(&self.prefix, Some('b'), bucket)
    }

    /// A bucket's ways as stored (see `ways`).
    fn bucket<S: SharedStore + ?Sized>(&self, s: &S, bucket: u64) -> Result<Bytes, StoreError> {
        let (v, _) = s.get(&self.bucket_key(bucket))?;
        Ok(v.filter(|v| ways(v).len() == v.len()).unwrap_or_default())
    }

    fn header<S: SharedStore + ?Sized>(&self, s: &S, slot: u16) -> Result<Header, StoreError> {
        let (v, _) = s.get(&self.header_key(slot))?;
        let v = v.unwrap_or_default();
        Ok(parse_header(&v))
    }

    /// Sets an endpoint's capacity in blocks (from config, or from its scraped cache size).
    pub fn set_capacity<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        blocks: u64,
    ) -> Result<(), StoreError> {
        update(s, &self.header_key(slot), |old| {
            if read_u64(old, 8) == blocks && old.len() >= HEADER {
                return None;
            }
            let mut b = header_buf(old);
            write_u64(&mut b, 8, blocks);
            Some((b, ()))
        })
        .map(|_| ())
    }

    /// Forgets everything an endpoint holds (removed, or restarted with a cold cache), in one
    /// write: its clock jumps past every stamp.
    pub fn clear_endpoint<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
    ) -> Result<(), StoreError> {
        update(s, &self.header_key(slot), |old| {
            let mut b = vec![0u8; HEADER];
            write_u64(
                &mut b,
                0,
                read_u64(old, 0).saturating_add(EPOCHS as u64 + 2),
            );
            write_u64(&mut b, 8, read_u64(old, 8));
            Some((b, ()))
        })
        .map(|_| ())
    }

    /// How many leading blocks of `chain` the endpoint holds.
    pub fn matched<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        chain: &[u64],
    ) -> Result<Match, StoreError> {
        let (v, _) = s.get(&self.header_key(slot))?;
        let v = v.unwrap_or_default();
        let h = parse_header(&v);
        let mut m = Match {
            blocks: 0,
            clock: h.clock,
            capacity: h.capacity,
            recalled: chain.first().is_some_and(|&head| recalls(&v, head)),
            held: h.held,
            rank: None,
            victim_used_s: None,
            used_s: None,
            distance: None,
            written_s: None,
        };
        if chain.is_empty() || h.capacity == 0 {
            return Ok(m);
        }
        let fit = usize::try_from((h.capacity / chain.len() as u64).max(1)).unwrap_or(usize::MAX);
        (m.rank, m.victim_used_s, m.used_s) = recency(&v, chain[0], fit);
        let segments = chain.len().div_ceil(SEGMENT);
        // A prefix cache only serves a prompt from its first block on: an endpoint without
        // the first segment matches nothing (one read for most endpoints, where a search
        // would take log2 of the segments). The insert reads this segment anyway.
        let Some(first) = self.segment_held(s, slot, chain, 0, h)? else {
            return Ok(m);
        };
        // Largest j whose segment is held: binary search over [lo, hi).
        let (mut lo, mut hi) = (1usize, segments);
        if first.blocks < segment(chain, 0).len() {
            hi = lo;
        }
        let (mut j, mut best) = (0, first);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.segment_held(s, slot, chain, mid, h)? {
                Some(held) => {
                    (j, best) = (mid, held);
                    lo = mid + 1;
                }
                None => hi = mid,
            }
        }
        m.blocks = j * SEGMENT + best.blocks;
        m.distance = Some(stamped_since(&v, h.clock, best.stamp));
        m.written_s = Some(best.written_s);
        Ok(m)
    }

    /// What the endpoint holds of segment `j`, or `None` when the segment is absent.
    fn segment_held<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        chain: &[u64],
        j: usize,
        h: Header,
    ) -> Result<Option<Held>, StoreError> {
        let seg = segment(chain, j);
        let tag = tag(seg.first().copied().unwrap_or(0), slot);
        let v = self.bucket(s, tag % self.buckets)?;
        Ok(find(&v, tag).and_then(|at| {
            let e = entry(&v, at);
            live(e, h).then(|| Held {
                blocks: matching_blocks(e, seg),
                stamp: stamp_of(e, h.clock),
                written_s: read_u32(e, TOUCHED_AT),
            })
        }))
    }

    /// Records that `slot` now holds `chain` (whole blocks only), at dispatch.
    pub fn insert<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        chain: &[u64],
        now_s: u32,
    ) -> Result<InsertReceipt, StoreError> {
        let mut receipt = InsertReceipt {
            slot,
            ..InsertReceipt::default()
        };
        let h = self.header(s, slot)?;
        if chain.is_empty() || h.capacity == 0 {
            return Ok(receipt);
        }
        // First pass: which segments need a (re)stamp, and where their blocks were counted.
        let mut touch: Vec<(usize, Option<(u64, u64)>)> = Vec::new();
        for j in 0..chain.len().div_ceil(SEGMENT) {
            let seg = segment(chain, j);
            let t = tag(seg.first().copied().unwrap_or(0), slot);
            let v = self.bucket(s, t % self.buckets)?;
            let held = find(&v, t).map(|at| entry(&v, at)).filter(|e| live(e, h));
            match held {
                Some(e)
                    if stamp_of(e, h.clock) + 1 >= h.clock
                        && matching_blocks(e, seg) == seg.len() => {}
                Some(e) => touch.push((j, Some((stamp_of(e, h.clock), len_of(e))))),
                None => touch.push((j, None)),
            }
        }
        let head = chain.first().copied().unwrap_or(0);
        if touch.first().map(|t| t.0) != Some(0) {
            // A warm hit writes no entry; its prefix's last use still moves, once a second.
            self.note_use(s, slot, head, now_s)?;
        }
        if touch.is_empty() {
            return Ok(receipt);
        }
        let moves: Vec<(u64, Option<(u64, u64)>)> = touch
            .iter()
            .map(|&(j, old)| (segment(chain, j).len() as u64, old))
            .collect();
        let head = (touch.first().map(|t| t.0) == Some(0)).then_some(head);
        let (stamp, note) = self.count_touches(s, slot, &moves, head, now_s)?;
        receipt.head = note;
        let mut headers = vec![(
            slot,
            Header {
                clock: stamp.max(h.clock),
                ..h
            },
        )];
        for (&(j, _), &counted) in touch.iter().zip(&moves) {
            let seg = segment(chain, j);
            let t = tag(seg.first().copied().unwrap_or(0), slot);
            let written = self
                .load_headers(s, t % self.buckets, &mut headers)
                .and_then(|()| self.write_entry(s, t, stamp, slot, seg, now_s, &headers));
            match written {
                Ok(Some(w)) => receipt.written.push(Written { counted, ..w }),
                Ok(None) => {}
                Err(e) => {
                    // The request falls back unrouted: the segments written so far go too,
                    // or the next request would stick to a prompt this endpoint never saw.
                    let _ = self.rollback(s, &receipt);
                    return Err(e);
                }
            }
        }
        Ok(receipt)
    }

    /// Moves the touched blocks' counts to the current epoch (advancing it when full) and
    /// returns the epoch to stamp them with, and the head record written. `head` is the
    /// prompt's first block when its first segment is touched.
    fn count_touches<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        moves: &[(u64, Option<(u64, u64)>)],
        head: Option<u64>,
        now_s: u32,
    ) -> Result<(u64, Option<HeadNote>), StoreError> {
        let stamp = update(s, &self.header_key(slot), |old| {
            let mut b = header_buf(old);
            let epoch = read_u64(&b, 0);
            for &(len, from) in moves {
                if let Some((e, n)) = from {
                    if epoch.saturating_sub(e) < EPOCHS as u64 {
                        add_count(&mut b, e, -(n as i64));
                    }
                }
                add_count(&mut b, epoch, len as i64);
            }
            let note = head.map(|h| note_head(&mut b, h, epoch, now_s));
            let cap = read_u64(&b, 8);
            if u64::from(count(&b, epoch)) >= (cap / EPOCH_SHARE).max(1) {
                // Next epoch: its ring slot held an epoch long dead.
                write_u64(&mut b, 0, epoch + 1);
                set_count(&mut b, epoch + 1, 0);
            }
            Some((b, (epoch, note)))
        })?;
        Ok(stamp.unwrap_or((0, None)))
    }

    /// Moves the last use of a held prefix to `now_s`, when it is a second or more behind.
    fn note_use<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
        head: u64,
        now_s: u32,
    ) -> Result<(), StoreError> {
        update(s, &self.header_key(slot), |old| {
            if head_used(old, head).is_some_and(|t| t >= now_s) {
                return None;
            }
            let mut b = header_buf(old);
            let epoch = read_u64(&b, 0);
            note_head(&mut b, head, epoch, now_s);
            Some((b, ()))
        })
        .map(|_| ())
    }

    /// Headers of the endpoints whose entries share a bucket, so eviction can prefer expired
    /// entries; read once per endpoint per insert.
    fn load_headers<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        bucket: u64,
        headers: &mut Vec<(u16, Header)>,
    ) -> Result<(), StoreError> {
        let v = self.bucket(s, bucket)?;
        for w in 0..WAYS {
            let e = entry(&v, w * ENTRY);
            let other = entry_slot(e);
            if read_u64(e, 0) != 0 && headers.iter().all(|(x, _)| *x != other) {
                headers.push((other, self.header(s, other)?));
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn write_entry<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        t: u64,
        stamp: u64,
        slot: u16,
        seg: &[u64],
        now_s: u32,
        headers: &[(u16, Header)],
    ) -> Result<Option<Written>, StoreError> {
        let bucket = t % self.buckets;
        update(s, &self.bucket_key(bucket), |old| {
            let mut b = bucket_buf(old);
            let at = find(&b, t).unwrap_or_else(|| victim(&b, headers));
            let previous = (read_u64(&b, at) != 0).then(|| b[at..at + ENTRY].to_vec());
            let filled_s = previous
                .as_deref()
                .and_then(|e| restamped_fill(e, t, headers))
                .unwrap_or(now_s);
            fill_entry(&mut b[at..at + ENTRY], t, stamp, slot, seg, filled_s);
            Some((
                b,
                Written {
                    bucket,
                    tag: t,
                    stamp,
                    previous,
                    counted: (0, None),
                },
            ))
        })
    }

    /// Undoes an insert whose request failed before its first byte: each entry it wrote goes
    /// back to what it was, unless someone has written it since, and so do the header's
    /// counts of those entries' blocks and the head record it wrote. Left in, the counts
    /// of a prompt the endpoint never took would age out prefixes it holds (a client's
    /// requests for a model the servers refuse could empty an endpoint's index).
    pub fn rollback<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        receipt: &InsertReceipt,
    ) -> Result<(), StoreError> {
        // Every entry is tried, the first error returned: one bucket that lost its CAS races
        // leaves the others rolled back.
        let mut first_error = Ok(());
        let mut undone_counts = Vec::new();
        for w in receipt.written.iter().rev() {
            let undone = update(s, &self.bucket_key(w.bucket), |old| {
                let at = find(ways(old), w.tag)?;
                if read_u32(old, at + STAMP_AT) != w.stamp as u32 {
                    return None;
                }
                let mut b = bucket_buf(old);
                match &w.previous {
                    Some(p) if p.len() == ENTRY => b[at..at + ENTRY].copy_from_slice(p),
                    _ => b[at..at + ENTRY].fill(0),
                }
                Some((b, ()))
            });
            if let Ok(Some(())) = undone {
                undone_counts.push((w.stamp, w.counted));
            }
            if first_error.is_ok() {
                first_error = undone.map(|_| ());
            }
        }
        let header = self.uncount(s, receipt, &undone_counts);
        first_error.and(header)
    }

    /// The header's side of `rollback`: the undone entries' blocks go back to the epochs
    /// they came from (deltas, so other requests' counts since are kept), and the head
    /// record to what it replaced, if it is still this insert's.
    fn uncount<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        receipt: &InsertReceipt,
        undone: &[(u64, Counted)],
    ) -> Result<(), StoreError> {
        let note = receipt.head.as_ref();
        if undone.is_empty() && note.is_none() {
            return Ok(());
        }
        update(s, &self.header_key(receipt.slot), |old| {
            let mut b = header_buf(old);
            let epoch = read_u64(&b, 0);
            let in_ring = |e: u64| epoch.saturating_sub(e) < EPOCHS as u64;
            for &(stamp, (len, from)) in undone {
                if in_ring(stamp) {
                    add_count(&mut b, stamp, -(len as i64));
                }
                if let Some((e, n)) = from.filter(|&(e, _)| in_ring(e)) {
                    add_count(&mut b, e, n as i64);
                }
            }
            if let Some(n) = note {
                let at = head_at(n.at);
                let ours = read_u64(&b, at) == n.head && read_u32(&b, at + 8) == n.epoch as u32;
                if let (true, Some(record)) = (ours, b.get_mut(at..at + 16)) {
                    record.copy_from_slice(&n.previous);
                }
            }
            Some((b, ()))
        })
        .map(|_| ())
    }

    /// Blocks the endpoint holds according to the index (for tests and the debug path):
    /// scans every bucket, so never call it per request.
    pub fn held_blocks<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        slot: u16,
    ) -> Result<u64, StoreError> {
        let h = self.header(s, slot)?;
        let mut n = 0;
        for bucket in 0..self.buckets {
            let v = self.bucket(s, bucket)?;
            for w in 0..WAYS {
                let e = entry(&v, w * ENTRY);
                if entry_slot(e) == slot && live(e, h) {
                    n += len_of(e);
                }
            }
        }
        Ok(n)
    }
}

/// A header value of the full size, whatever was stored.
fn header_buf(old: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; HEADER];
    let n = old.len().min(b.len());
    b[..n].copy_from_slice(&old[..n]);
    b
}

fn count(b: &[u8], epoch: u64) -> u32 {
    read_u32(b, COUNTS_AT + 4 * (epoch as usize % EPOCHS))
}

fn set_count(b: &mut [u8], epoch: u64, n: u32) {
    write_u32(b, COUNTS_AT + 4 * (epoch as usize % EPOCHS), n);
}

fn add_count(b: &mut [u8], epoch: u64, delta: i64) {
    let n = (i64::from(count(b, epoch)) + delta).clamp(0, i64::from(u32::MAX));
    set_count(b, epoch, n as u32);
}

/// Blocks counted in the epochs after `stamp` up to `clock`: what the endpoint took since.
fn stamped_since(b: &[u8], clock: u64, stamp: u64) -> u64 {
    let newer = clock.saturating_sub(stamp).min(EPOCHS as u64);
    (0..newer).map(|k| u64::from(count(b, clock - k))).sum()
}

fn parse_header(b: &[u8]) -> Header {
    let clock = read_u64(b, 0);
    let capacity = read_u64(b, 8);
    // Newest epochs first, while their blocks fit in the capacity.
    let mut oldest = clock;
    let mut held = 0u64;
    for k in 0..EPOCHS as u64 {
        let Some(e) = clock.checked_sub(k) else { break };
        let with = held + u64::from(count(b, e));
        if with > capacity && k > 0 {
            break;
        }
        (held, oldest) = (with, e);
    }
    Header {
        clock,
        capacity,
        oldest,
        held: held.min(capacity),
    }
}

fn head_at(i: usize) -> usize {
    HEADS_AT + 16 * i
}

/// A head record's epoch, rebuilt from its low 32 bits as `stamp_of` does for entries.
fn head_epoch(b: &[u8], i: usize, clock: u64) -> u64 {
    let delta = read_u32(b, head_at(i) + 8).wrapping_sub(clock as u32) as i32;
    clock.wrapping_add_signed(i64::from(delta))
}

/// `head`'s rank among the head records by last use (then epoch), newest first, the last
/// use of the record at rank `fit - 1`, and `head`'s own last use. On the stack: this runs
/// for every endpoint of every decision.
fn recency(b: &[u8], head: u64, fit: usize) -> (Option<u32>, Option<u32>, Option<u32>) {
    let mut order = [(0u32, 0u32, 0u64); HEADS];
    let mut n = 0;
    for i in 0..HEADS {
        let h = read_u64(b, head_at(i));
        if h != 0 {
            order[n] = (read_u32(b, head_at(i) + 12), read_u32(b, head_at(i) + 8), h);
            n += 1;
        }
    }
    let order = &mut order[..n];
    order.sort_unstable_by(|x, y| y.cmp(x));
    let at = order.iter().position(|r| r.2 == head);
    let used = at.and_then(|i| order.get(i)).map(|r| r.0);
    let victim = order.get(fit.saturating_sub(1)).map(|r| r.0);
    (at.map(|r| r as u32), victim, used)
}

fn recalls(b: &[u8], head: u64) -> bool {
    (0..HEADS).any(|i| read_u64(b, head_at(i)) == head)
}

/// Records that prefix `head` was stamped in `epoch` and used at `now_s`: its own record,
/// else an empty one, else the one stamped longest ago. Returns where, and what was there.
fn note_head(b: &mut [u8], head: u64, epoch: u64, now_s: u32) -> HeadNote {
    let i = (0..HEADS)
        .find(|&i| read_u64(b, head_at(i)) == head)
        .or_else(|| (0..HEADS).find(|&i| read_u64(b, head_at(i)) == 0))
        .or_else(|| (0..HEADS).min_by_key(|&i| head_epoch(b, i, epoch)))
        .unwrap_or(0);
    let mut previous = [0u8; 16];
    if let Some(old) = b.get(head_at(i)..head_at(i) + 16) {
        previous.copy_from_slice(old);
    }
    write_u64(b, head_at(i), head);
    write_u32(b, head_at(i) + 8, epoch as u32);
    write_u32(b, head_at(i) + 12, now_s);
    HeadNote {
        head,
        at: i,
        epoch,
        previous,
    }
}

/// The last use of `head` as its record has it, if it has one.
fn head_used(b: &[u8], head: u64) -> Option<u32> {
    (0..HEADS)
        .find(|&i| read_u64(b, head_at(i)) == head)
        .map(|i| read_u32(b, head_at(i) + 12))
}

/// A bucket value as stored, when it has this layout's size; else (a foreign value, or one
/// an older build with another entry size left in the same process) no ways at all.
fn ways(v: &[u8]) -> &[u8] {
    if v.len() == WAYS * ENTRY {
        v
    } else {
        &[]
    }
}

/// A bucket value to write: the stored one, or empty ways (see `ways`).
fn bucket_buf(old: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; WAYS * ENTRY];
    let old = ways(old);
    b[..old.len()].copy_from_slice(old);
    b
}

fn segment(chain: &[u64], j: usize) -> &[u64] {
    let start = (j * SEGMENT).min(chain.len());
    let end = (start + SEGMENT).min(chain.len());
    chain.get(start..end).unwrap_or(&[])
}

/// Entry key: the segment's head hash mixed with the endpoint, never 0 (0 marks empty).
fn tag(head: u64, slot: u16) -> u64 {
    let t = head ^ (u64::from(slot) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    t.max(1)
}

fn entry(b: &[u8], at: usize) -> &[u8] {
    b.get(at..at + ENTRY).unwrap_or(&[])
}

fn entry_slot(e: &[u8]) -> u16 {
    e.get(SLOT_AT..SLOT_AT + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .unwrap_or(u16::MAX)
}

fn find(b: &[u8], t: u64) -> Option<usize> {
    (0..WAYS)
        .map(|w| w * ENTRY)
        .find(|&at| read_u64(b, at) == t)
}

/// The way to overwrite: an empty one, else an expired one, else the live entry closest to
/// expiry (largest share of its endpoint's capacity), else the one filled longest ago.
fn victim(b: &[u8], headers: &[(u16, Header)]) -> usize {
    let rank = |at: usize| -> (u8, Reverse<u64>, u32) {
        let e = entry(b, at);
        if read_u64(e, 0) == 0 {
            return (0, Reverse(0), 0);
        }
        let touched = read_u32(e, TOUCHED_AT);
        match headers.iter().find(|(x, _)| *x == entry_slot(e)) {
            Some((_, h)) if !live(e, *h) => (1, Reverse(0), touched),
            Some((_, h)) => {
                let span = h.clock.saturating_sub(h.oldest) + 1;
                let age = h.clock.saturating_sub(stamp_of(e, h.clock));
                (2, Reverse(age.saturating_mul(1 << 16) / span), touched)
            }
            None => (3, Reverse(0), touched),
        }
    };
    (0..WAYS)
        .map(|w| w * ENTRY)
        .min_by_key(|&at| rank(at))
        .unwrap_or(0)
}

/// The entry's epoch. Entries keep its low 32 bits; the rest comes from the endpoint's
/// current epoch `clock`, exact for any stamp within 2^31 epochs of it (live ones are within
/// `EPOCHS`), so nothing is lost against a full 64-bit stamp.
fn stamp_of(e: &[u8], clock: u64) -> u64 {
    let delta = read_u32(e, STAMP_AT).wrapping_sub(clock as u32) as i32;
    clock.wrapping_add_signed(i64::from(delta))
}

fn len_of(e: &[u8]) -> u64 {
    u64::from(e.get(LEN_AT).copied().unwrap_or(0))
}

/// The entry is set and stamped in one of its endpoint's live epochs.
fn live(e: &[u8], h: Header) -> bool {
    let stamp = stamp_of(e, h.clock);
    read_u64(e, 0) != 0 && stamp >= h.oldest && stamp <= h.clock && h.capacity > 0
}

/// Leading blocks of `seg` the entry holds: the head matched by the tag, then fingerprints.
fn matching_blocks(e: &[u8], seg: &[u64]) -> usize {
    let len = (len_of(e) as usize).min(seg.len());
    let mut n = 1;
    while n < len && read_u32(e, PRINTS_AT + 4 * (n - 1)) == seg[n] as u32 {
        n += 1;
    }
    n.min(len.max(1))
}

/// When `e` is a live entry of the same tag (the same first block on the same endpoint),
/// the time its blocks were first written: a new stamp on a held prefix (a use, or a new
/// question after it in the segment) is no prefill of the prefix, and keeps that time, so a
/// miss on a hot prefix counts as evidence once its fill is T_max old.
fn restamped_fill(e: &[u8], t: u64, headers: &[(u16, Header)]) -> Option<u32> {
    let slot = entry_slot(e);
    let live_here = headers.iter().any(|(x, h)| *x == slot && live(e, *h));
    (read_u64(e, 0) == t && live_here).then(|| read_u32(e, TOUCHED_AT))
}

fn fill_entry(e: &mut [u8], t: u64, stamp: u64, slot: u16, seg: &[u64], now_s: u32) {
    e.fill(0);
    write_u64(e, 0, t);
    write_u32(e, STAMP_AT, stamp as u32);
    write_u32(e, TOUCHED_AT, now_s);
    if let Some(s) = e.get_mut(SLOT_AT..SLOT_AT + 2) {
        s.copy_from_slice(&slot.to_le_bytes());
    }
    if let Some(l) = e.get_mut(LEN_AT) {
        *l = seg.len().min(SEGMENT) as u8;
    }
    for (i, h) in seg.iter().skip(1).enumerate() {
        write_u32(e, PRINTS_AT + 4 * i, *h as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Cas, MemStore};

    fn chain(seed: u64, n: usize) -> Vec<u64> {
        let mut h = seed;
        (0..n)
            .map(|i| {
                h = xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), h);
                h
            })
            .collect()
    }

    fn index(cap: u64, slots: u16) -> (AffinityIndex, MemStore) {
        let s = MemStore::new();
        let ix = AffinityIndex::new("t", cap * u64::from(slots), 4.0);
        for slot in 0..slots {
            ix.set_capacity(&s, slot, cap).unwrap();
        }
        (ix, s)
    }

    #[test]
    fn insert_then_match_prefixes() {
        let (ix, s) = index(10_000, 2);
        let a = chain(1, 100);
        ix.insert(&s, 0, &a, 0).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 100);
        assert_eq!(ix.matched(&s, 1, &a).unwrap().blocks, 0);
        // A request sharing 37 blocks then diverging.
        let mut b = a[..37].to_vec();
        b.extend(chain(99, 50).iter().map(|h| h ^ 7));
        assert_eq!(ix.matched(&s, 0, &b).unwrap().blocks, 37);
        assert_eq!(ix.matched(&s, 0, &a[..5]).unwrap().blocks, 5);
    }

    /// Counts reads, to check what a lookup costs in shared-data calls.
    struct Counted<'a>(&'a MemStore, std::cell::Cell<usize>);

    impl SharedStore for Counted<'_> {
        fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
            self.1.set(self.1.get() + 1);
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }

    /// Fails its `n`-th write (counting from 1) as the host would; every other goes through.
    struct FailsWrite<'a>(&'a MemStore, std::cell::Cell<u32>, u32);

    impl SharedStore for FailsWrite<'_> {
        fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            self.1.set(self.1.get() + 1);
            match self.1.get() == self.2 {
                true => Err(StoreError::Host),
                false => self.0.set(key, value, cas),
            }
        }
    }

    #[test]
    fn an_insert_that_fails_midway_leaves_nothing_behind() {
        let a = chain(1, 3 * SEGMENT);
        // How many writes a whole insert makes; its last is the last segment's entry.
        let (ix, s) = index(10_000, 1);
        let all = FailsWrite(&s, Default::default(), 0);
        assert_eq!(ix.insert(&all, 0, &a, 0).unwrap().written.len(), 3);
        let (ix, s) = index(10_000, 1);
        let last = FailsWrite(&s, Default::default(), all.1.get());
        assert_eq!(ix.insert(&last, 0, &a, 0).unwrap_err(), StoreError::Host);
        // The two segments written before it are gone: the prompt matches nothing.
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 0);
    }

    #[test]
    fn a_prompt_matches_from_its_first_segment_only() {
        let (ix, s) = index(10_000, 2);
        let a = chain(1, 100);
        // Every segment of `a` but the first is held on slot 0, under another first segment.
        let mut c = chain(5, SEGMENT);
        c.extend_from_slice(&a[SEGMENT..]);
        ix.insert(&s, 0, &c, 0).unwrap();
        let counted = Counted(&s, Default::default());
        assert_eq!(ix.matched(&counted, 0, &a).unwrap().blocks, 0);
        // The header and the first segment's bucket: no search over the rest.
        assert_eq!(counted.1.get(), 2);
        assert_eq!(ix.matched(&counted, 1, &a).unwrap().blocks, 0);
        assert_eq!(counted.1.get(), 4);
        assert_eq!(ix.matched(&s, 0, &c).unwrap().blocks, 100);
    }

    #[test]
    fn never_exceeds_capacity_and_evicts_oldest() {
        let cap = 320;
        let (ix, s) = index(cap, 1);
        let prompts: Vec<Vec<u64>> = (0..10).map(|i| chain(i + 10, 160)).collect();
        for (i, p) in prompts.iter().enumerate() {
            ix.insert(&s, 0, p, i as u32).unwrap();
            assert!(ix.held_blocks(&s, 0).unwrap() <= cap);
        }
        // Only the last two fit.
        assert_eq!(ix.matched(&s, 0, &prompts[9]).unwrap().blocks, 160);
        assert_eq!(ix.matched(&s, 0, &prompts[8]).unwrap().blocks, 160);
        assert_eq!(ix.matched(&s, 0, &prompts[7]).unwrap().blocks, 0);
    }

    #[test]
    fn a_match_knows_how_many_blocks_were_stamped_since() {
        // Epochs of 3,200 / 32 = 100 blocks: prompts of 100 blocks fill one each.
        let (ix, s) = index(3_200, 1);
        let p: Vec<Vec<u64>> = (0..5).map(|i| chain(i + 50, 100)).collect();
        for (t, q) in p.iter().enumerate() {
            ix.insert(&s, 0, q, t as u32).unwrap();
        }
        let distance = |q: &[u64]| ix.matched(&s, 0, q).unwrap().distance;
        // p0 went in first: the four prompts after it stand between it and now (within an
        // epoch's grain); the newest has nothing after it beyond its own epoch's fill.
        let d0 = distance(&p[0]).unwrap();
        assert!((300..=500).contains(&d0), "{d0}");
        assert!(distance(&p[4]).unwrap() < d0);
        assert!(
            distance(&p[2]).unwrap() < d0 && distance(&p[2]).unwrap() > distance(&p[4]).unwrap()
        );
        // Touching p0 again makes it the newest.
        ix.insert(&s, 0, &p[0], 9).unwrap();
        assert!(distance(&p[0]).unwrap() <= 100);
        assert_eq!(distance(&chain(999, 20)), None);
    }

    #[test]
    fn a_new_stamp_on_a_held_prefix_keeps_its_fill_time() {
        // Epochs of 100 blocks (3,200 / 32).
        let (ix, s) = index(3_200, 1);
        let prefix = chain(7, 40);
        // The prefix ends inside its third segment, which each question then rewrites.
        let ask = |q: u64| {
            let mut c = prefix.clone();
            c.extend(chain(q, 20));
            c
        };
        ix.insert(&s, 0, &ask(1), 10).unwrap();
        for i in 0..3 {
            ix.insert(&s, 0, &chain(100 + i, 100), 20 + i as u32)
                .unwrap();
        }
        ix.insert(&s, 0, &ask(2), 30).unwrap();
        let m = ix.matched(&s, 0, &ask(3)).unwrap();
        assert_eq!((m.blocks, m.written_s), (40, Some(10)));
        // Pushed out of the index by 32 prompts, the prefix is filled again: a new time.
        for i in 0..32 {
            ix.insert(&s, 0, &chain(200 + i, 100), 40 + i as u32)
                .unwrap();
        }
        assert_eq!(ix.matched(&s, 0, &ask(3)).unwrap().blocks, 0);
        ix.insert(&s, 0, &ask(4), 90).unwrap();
        assert_eq!(ix.matched(&s, 0, &ask(5)).unwrap().written_s, Some(90));
    }

    #[test]
    fn recency_ranks_whole_prompts_by_last_use() {
        // Room for four 80-block prompts.
        let (ix, s) = index(320, 1);
        let p: Vec<Vec<u64>> = (0..6).map(|i| chain(i + 30, 80)).collect();
        for (t, q) in p.iter().enumerate().take(4) {
            ix.insert(&s, 0, q, t as u32 * 10).unwrap();
        }
        // p0 used again at 50 s: a warm hit, which only moves its last use.
        let before = s.get(&ix.header_key(0)).unwrap().1;
        ix.insert(&s, 0, &p[0], 50).unwrap();
        let m = ix.matched(&s, 0, &p[0]).unwrap();
        assert_eq!(m.rank, Some(0));
        assert_ne!(s.get(&ix.header_key(0)).unwrap().1, before);
        // ... at most once a second.
        let again = s.get(&ix.header_key(0)).unwrap().1;
        ix.insert(&s, 0, &p[0], 50).unwrap();
        assert_eq!(s.get(&ix.header_key(0)).unwrap().1, again);
        // By last use: p0 (50 s), p3, p2, p1 (10 s): a new prompt would push out p1.
        assert_eq!(ix.matched(&s, 0, &p[1]).unwrap().rank, Some(3));
        let used = |q: &[u64]| ix.matched(&s, 0, q).unwrap().used_s;
        assert_eq!(
            (used(&p[0]), used(&p[1]), used(&p[4])),
            (Some(50), Some(10), None)
        );
        assert_eq!(ix.matched(&s, 0, &p[4]).unwrap().rank, None);
        assert_eq!(ix.matched(&s, 0, &p[4]).unwrap().victim_used_s, Some(10));
        // A prompt half the size fits eight times: the records do not reach that deep.
        assert_eq!(ix.matched(&s, 0, &p[4][..40]).unwrap().victim_used_s, None);
        // p4 and p5 arrive: p1 and p2 are out of the four most recent.
        ix.insert(&s, 0, &p[4], 60).unwrap();
        ix.insert(&s, 0, &p[5], 70).unwrap();
        let rank = |q: &[u64]| ix.matched(&s, 0, q).unwrap().rank;
        assert_eq!(
            (rank(&p[5]), rank(&p[0]), rank(&p[1])),
            (Some(0), Some(2), Some(5))
        );
    }

    #[test]
    fn eviction_leaves_no_holes() {
        let (ix, s) = index(240, 1);
        let a = chain(1, 160);
        ix.insert(&s, 0, &a, 0).unwrap();
        ix.insert(&s, 0, &chain(2, 160), 1).unwrap();
        let m = ix.matched(&s, 0, &a).unwrap().blocks;
        assert!(
            m == 0 || m == 160,
            "a prompt is held whole or not at all: {m}"
        );
    }

    #[test]
    fn hot_prefix_does_not_age_others() {
        // Capacity for three prompts; touching one over and over keeps the other two.
        let (ix, s) = index(480, 1);
        let (a, b, c) = (chain(1, 160), chain(2, 160), chain(3, 160));
        for p in [&a, &b, &c] {
            ix.insert(&s, 0, p, 0).unwrap();
        }
        for i in 0..50 {
            ix.insert(&s, 0, &a, i).unwrap();
        }
        for p in [&a, &b, &c] {
            assert_eq!(ix.matched(&s, 0, p).unwrap().blocks, 160);
        }
        assert_eq!(ix.matched(&s, 0, &b).unwrap().held, 480);
    }

    #[test]
    fn fresh_prefix_is_not_restamped() {
        let (ix, s) = index(1_000, 1);
        let a = chain(1, 160);
        ix.insert(&s, 0, &a, 0).unwrap();
        let c0 = ix.matched(&s, 0, &a).unwrap().clock;
        ix.insert(&s, 0, &a, 1).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().clock, c0);
    }

    #[test]
    fn rollback_restores() {
        let (ix, s) = index(10_000, 1);
        let a = chain(1, 40);
        let r = ix.insert(&s, 0, &a, 0).unwrap();
        assert_eq!(r.written.len(), 3);
        ix.rollback(&s, &r).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 0);
    }

    /// A rolled-back prompt was never sent: its blocks leave the endpoint's counts too, or
    /// they would age out prefixes it holds (a few refused 2,048-block prompts emptied it).
    #[test]
    fn rolled_back_inserts_push_nothing_out() {
        let (ix, s) = index(7_812, 1);
        let hot = chain(1, 200);
        ix.insert(&s, 0, &hot, 0).unwrap();
        let before = ix.matched(&s, 0, &hot).unwrap();
        for i in 0..8u64 {
            let refused = chain(1_000 + i, 2_048);
            let r = ix.insert(&s, 0, &refused, 1).unwrap();
            ix.rollback(&s, &r).unwrap();
            assert_eq!(ix.matched(&s, 0, &refused).unwrap().blocks, 0);
        }
        let after = ix.matched(&s, 0, &hot).unwrap();
        assert_eq!(after.blocks, 200, "{after:?}");
        assert_eq!(after.held, before.held);
        // Its head record is back too: the hot prompt is still the most recent.
        assert_eq!(after.rank, Some(0), "{after:?}");
    }

    /// A rollback after others have written moves back only its own counts.
    #[test]
    fn a_rollback_keeps_what_others_counted_since() {
        let (ix, s) = index(10_000, 1);
        let a = chain(1, 40);
        let r = ix.insert(&s, 0, &a, 0).unwrap();
        let b = chain(2, 40);
        ix.insert(&s, 0, &b, 0).unwrap();
        ix.rollback(&s, &r).unwrap();
        let m = ix.matched(&s, 0, &b).unwrap();
        assert_eq!((m.blocks, m.held), (40, 40));
    }

    #[test]
    fn clear_endpoint_forgets() {
        let (ix, s) = index(10_000, 2);
        let a = chain(1, 40);
        ix.insert(&s, 0, &a, 0).unwrap();
        ix.insert(&s, 1, &a, 0).unwrap();
        ix.clear_endpoint(&s, 0).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 0);
        assert_eq!(ix.matched(&s, 1, &a).unwrap().blocks, 40);
    }

    #[test]
    fn store_is_bounded() {
        let (ix, s) = index(1_000, 4);
        for i in 0..400u64 {
            ix.insert(&s, (i % 4) as u16, &chain(i, 64), i as u32)
                .unwrap();
        }
        assert!(s.bytes() as u64 <= ix.max_bytes(4));
    }

    /// Blocks matched of the prompts the LRU keeps, after `endpoints` × `fill` capacities of
    /// distinct `prompt`-block prompts sent round-robin: the blocks matched of each endpoint's
    /// last prompts, more of them than its capacity holds.
    fn kept_after_fill(
        headroom: f64,
        endpoints: u16,
        cap: u64,
        prompt: usize,
        fill: u64,
    ) -> Vec<usize> {
        let s = MemStore::new();
        let ix = AffinityIndex::new("t", cap * u64::from(endpoints), headroom);
        for slot in 0..endpoints {
            ix.set_capacity(&s, slot, cap).unwrap();
        }
        let rounds = (cap * fill).div_ceil(prompt as u64);
        let n = rounds * u64::from(endpoints);
        for k in 0..n {
            ix.insert(&s, (k % u64::from(endpoints)) as u16, &chain(k, prompt), 0)
                .unwrap();
        }
        // The last prompts of every endpoint: more than its capacity holds.
        let look_back = (cap as usize).div_ceil(prompt) as u64 + 1;
        (n - look_back * u64::from(endpoints)..n)
            .map(|k| {
                let slot = (k % u64::from(endpoints)) as u16;
                ix.matched(&s, slot, &chain(k, prompt)).unwrap().blocks
            })
            .collect()
    }

    /// Why `indexHeadroom` defaults to 2: a bucket holds `WAYS` entries, and when more live
    /// entries hash to it than that, the one nearest expiry is overwritten early and its
    /// prompt stops matching from there. Filled to capacity (and three times over, so expired
    /// entries sit in the buckets too), the share of the blocks the LRU keeps that are no
    /// longer matched, against a headroom of 16 where no bucket overflows, is 1.4–2.7 % at
    /// 1.25, 0.3–0.9 % at 1.5, 0.1–0.2 % at 1.75 and 0.01–0.15 % at 2 with 16 ways
    /// (`cargo run --release --example index_headroom`: 100 endpoints × 31,250 blocks,
    /// prompts of 32 to 2,048 blocks). With 8 ways it was 0.3–0.9 % at 2, and a long prompt
    /// that loses one segment stops matching from there, which the simulator felt.
    #[test]
    fn default_headroom_loses_under_half_a_percent() {
        let (endpoints, cap, prompt, fill) = (40, 3_125, 256, 2);
        let want = kept_after_fill(16.0, endpoints, cap, prompt, fill);
        let kept: usize = want.iter().sum();
        assert!(kept as u64 >= u64::from(endpoints) * cap * 9 / 10, "{kept}");
        let lost = |headroom: f64| {
            let got = kept_after_fill(headroom, endpoints, cap, prompt, fill);
            let held: usize = got.iter().zip(&want).map(|(g, w)| (*g).min(*w)).sum();
            1.0 - held as f64 / kept as f64
        };
        let default = crate::config::Config::default().index_headroom;
        assert!(lost(default) < 0.005, "{}", lost(default));
        assert!(lost(1.25) > 0.01, "{}", lost(1.25));
    }

    #[test]
    fn stamps_keep_their_epoch_across_32_bits() {
        let mut e = vec![0u8; ENTRY];
        for clock in [
            0u64,
            5,
            70,
            u64::from(u32::MAX) - 2,
            u64::from(u32::MAX) + 40,
            1 << 40,
        ] {
            for stamp in [
                clock.saturating_sub(63),
                clock.saturating_sub(1),
                clock,
                clock + 2,
            ] {
                fill_entry(&mut e, 1, stamp, 0, &[1, 2], 0);
                assert_eq!(stamp_of(&e, clock), stamp, "clock {clock}");
            }
        }
    }

    #[test]
    fn bucket_of_another_layout_reads_empty() {
        let (ix, s) = index(10_000, 1);
        let a = chain(1, 16);
        ix.insert(&s, 0, &a, 0).unwrap();
        let key = ix.bucket_key(tag(a[0], 0) % ix.buckets);
        let (v, _) = s.get(&key).unwrap();
        let mut longer = v.unwrap().to_vec();
        longer.extend_from_slice(&[0u8; 32]);
        s.set(&key, &longer, None).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 0);
        ix.insert(&s, 0, &a, 1).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 16);
        assert_eq!(s.get(&key).unwrap().0.unwrap().len(), WAYS * ENTRY);
    }

    #[test]
    fn survives_cas_conflicts() {
        let (ix, s) = index(1_000, 1);
        s.inject_conflicts.set(5);
        let a = chain(3, 20);
        ix.insert(&s, 0, &a, 0).unwrap();
        assert_eq!(ix.matched(&s, 0, &a).unwrap().blocks, 20);
    }
}

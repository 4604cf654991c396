//! Placements exchanged between gateway replicas.
//!
//! Replicas dealt requests round robin each see every prefix, and each places a prefix new
//! to it by its own view of load. A second replica usually meets a prefix seconds or tens
//! of seconds after the first placed it, when two views of load agree no better than a
//! coin: the prefix ends up held twice, each copy at half its traffic. The model servers'
//! metrics cannot say where a prefix went; the replica that placed it can.
//!
//! So each process keeps its recent new placements (a new copy of a prefix: a cold
//! placement, a spill, a promotion) in a ring in shared data, `PlacementLog`, and answers a peer's poll with those
//! after the sequence number the peer asks from. The poller of each replica inserts what
//! its peers placed into its own index, under the endpoint with the same address: the next
//! request of that prefix finds it warm where it already is. What is sent are block hashes
//! (seeded by model and salt) and endpoint addresses, never prompt text.

use serde::{Deserialize, Serialize};

use xxhash_rust::xxh64::xxh64;

use crate::store::{read_u64, update, write_u64, SharedStore, StoreError};

/// Placements the ring holds; a peer polling less often than this many new placements
/// misses the oldest.
pub const LOG_ENTRIES: u64 = 256;
/// Blocks of one placement kept, at most (the prompt's first ones).
pub const MAX_SHARED_BLOCKS: usize = 1_024;
/// Bytes of placements one answer carries, about; the rest follow in the next poll.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;
/// Longest endpoint address kept.
const MAX_ADDRESS: usize = 255;

/// One new placement: the endpoint's address and the prompt's block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub seq: u64,
    pub address: String,
    pub blocks: Vec<u64>,
}

/// What a peer's poll answers: placements from its `since`, where the next poll starts, and
/// which ring they came from (a restarted process starts a new ring, numbered from 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementBatch {
    pub next: u64,
    pub ring: u64,
    pub placements: Vec<Placement>,
    /// The ring's next sequence number when it answered (0 from a peer that does not say).
    pub end: u64,
}

impl PlacementBatch {
    /// Where the poll after this answer asks from.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            next: self.next,
            ring: self.ring,
        }
    }

    /// Nothing came back from a place before the ring's end: the entry there was numbered
    /// but not written. A writer numbers and writes in one callback, so one still missing
    /// a poll later belongs to a VM that died in between.
    pub fn stopped_at_a_gap(&self, asked: Cursor) -> bool {
        self.placements.is_empty() && self.cursor() == asked && self.next < self.end
    }
}

/// Where a poll asks from: a sequence number in one ring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    pub next: u64,
    pub ring: u64,
}

/// The ring of this process's recent new placements: `{ns}/pl/n` (the next sequence
/// number, and the ring's identity, claimed when the plugin starts or else by the process's
/// first placement) and `{ns}/pl/{seq % LOG_ENTRIES}`.
#[derive(Debug, Clone)]
pub struct PlacementLog {
    prefix: String,
    count_key: String,
}

impl PlacementLog {
    pub fn new(namespace: &str) -> PlacementLog {
        PlacementLog {
            prefix: format!("{namespace}/pl/"),
            count_key: format!("{namespace}/pl/n"),
        }
    }

    fn entry_key(&self, seq: u64) -> String {
        format!("{}{}", self.prefix, seq % LOG_ENTRIES)
    }

    /// Adds a placement; returns its sequence number. `ring_seed` names the ring when this
    /// is the process's first placement (any value that differs between processes and
    /// restarts).
    pub fn record<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        address: &str,
        blocks: &[u64],
        ring_seed: u64,
    ) -> Result<u64, StoreError> {
        let seq = update(s, &self.count_key, |old| {
            let n = read_u64(old, 0);
            let ring = match read_u64(old, 8) {
                0 => ring_seed | 1,
                r => r,
            };
            let mut b = vec![0u8; 16];
            write_u64(&mut b, 0, n.wrapping_add(1));
            write_u64(&mut b, 8, ring);
            Some((b, n))
        })?
        .unwrap_or(0);
        let blocks = &blocks[..blocks.len().min(MAX_SHARED_BLOCKS)];
        s.set(&self.entry_key(seq), &encode(seq, address, blocks), None)?;
        Ok(seq)
    }

    /// Takes back the placement numbered `seq` (its request failed before the endpoint
    /// answered): its entry keeps its number and address but loses its blocks, so a peer
    /// that has not read it yet learns nothing from it. One a peer already read stays
    /// learned there, as any placement the endpoint later evicts does. Returns whether it
    /// was still held.
    pub fn withdraw<S: SharedStore + ?Sized>(&self, s: &S, seq: u64) -> Result<bool, StoreError> {
        let done = update(s, &self.entry_key(seq), |old| match decode(old) {
            Some(p) if p.seq == seq && !p.blocks.is_empty() => {
                Some((encode(seq, &p.address, &[]), ()))
            }
            _ => None,
        })?;
        Ok(done.is_some())
    }

    /// Names the ring now, if no VM of this process has (`seed`: any value that differs
    /// between processes and restarts). A process that has placed nothing yet then already
    /// answers with its own ring, so a replica polling itself knows itself at once.
    pub fn claim_ring<S: SharedStore + ?Sized>(&self, s: &S, seed: u64) -> Result<(), StoreError> {
        update(s, &self.count_key, |old| {
            if read_u64(old, 8) != 0 {
                return None;
            }
            let mut b = vec![0u8; 16];
            write_u64(&mut b, 0, read_u64(old, 0));
            write_u64(&mut b, 8, seed | 1);
            Some((b, ()))
        })?;
        Ok(())
    }

    /// The next sequence number (placements recorded so far) and the ring's identity.
    pub fn end<S: SharedStore + ?Sized>(&self, s: &S) -> Result<Cursor, StoreError> {
        let (v, _) = s.get(&self.count_key)?;
        Ok(v.map_or(Cursor::default(), |v| Cursor {
            next: read_u64(&v, 0),
            ring: read_u64(&v, 8),
        }))
    }

    /// Placements from `from.next` on, up to about `MAX_ANSWER_BYTES`. A cursor of another
    /// ring, or past the end, answers from the oldest held: this process restarted since,
    /// and its numbers began again.
    pub fn since<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        from: Cursor,
    ) -> Result<PlacementBatch, StoreError> {
        let Cursor { next: end, ring } = self.end(s)?;
        let oldest = end.saturating_sub(LOG_ENTRIES);
        let mut seq = match from.ring == ring && from.next <= end {
            true => from.next.max(oldest),
            false => oldest,
        };
        let (mut out, mut bytes) = (Vec::new(), 0);
        while seq < end && bytes < MAX_ANSWER_BYTES {
            let (v, _) = s.get(&self.entry_key(seq))?;
            match v.as_deref().map(decode) {
                // Withdrawn (`withdraw`): nothing to learn.
                Some(Some(p)) if p.seq == seq && p.blocks.is_empty() => {}
                Some(Some(p)) if p.seq == seq => {
                    bytes += 32 + p.address.len() + 17 * p.blocks.len();
                    out.push(p);
                }
                // Numbered but not written yet (the slot is empty or holds the lap before):
                // the next poll asks again from here.
                None => break,
                Some(Some(p)) if p.seq < seq => break,
                // Written over by a later lap, or unreadable: this one is gone.
                Some(_) => {}
            }
            seq += 1;
        }
        Ok(PlacementBatch {
            next: seq,
            ring,
            placements: out,
            end,
        })
    }
}

/// Where the poller asks each peer from next, in shared data, so a poller that takes the
/// lease over goes on where the last one stopped instead of inserting the peer's whole ring
/// again (old placements an endpoint may have evicted since). One value, `{ns}/pc`, holds
/// one entry per peer *by name* (hash of the name, next sequence number, ring; 24 bytes
/// each), so a replica keeps its place when others join or leave the cluster. Entries are
/// kept in the order they were last written; past `MAX_CURSORS` the least recently written
/// goes (a replica that left: the ones still asked are written at every answer).
#[derive(Debug, Clone)]
pub struct PeerCursors {
    key: String,
}

/// Cursors kept, at most: twice the replicas asked, so the ones that left make room.
pub const MAX_CURSORS: usize = 2 * crate::config::MAX_PEERS;
const CURSOR_BYTES: usize = 24;

impl PeerCursors {
    pub fn new(namespace: &str) -> PeerCursors {
        PeerCursors {
            key: format!("{namespace}/pc"),
        }
    }

    /// Where to ask the peer named `name` from; the start of no ring when unknown.
    pub fn get<S: SharedStore + ?Sized>(&self, s: &S, name: &str) -> Result<Cursor, StoreError> {
        let (v, _) = s.get(&self.key)?;
        let id = xxh64(name.as_bytes(), 0);
        Ok(v.as_deref()
            .and_then(|b| entries(b).find(|e| e.0 == id))
            .map_or_else(Cursor::default, |e| e.1))
    }

    /// Records where to ask `name` from next (its entry becomes the most recent).
    pub fn set<S: SharedStore + ?Sized>(
        &self,
        s: &S,
        name: &str,
        at: Cursor,
    ) -> Result<(), StoreError> {
        let id = xxh64(name.as_bytes(), 0);
        update(s, &self.key, |old| {
            let mut kept: Vec<(u64, Cursor)> = entries(old).filter(|e| e.0 != id).collect();
            kept.push((id, at));
            let skip = kept.len().saturating_sub(MAX_CURSORS);
            let mut b = Vec::with_capacity(CURSOR_BYTES * (kept.len() - skip));
            for (id, c) in &kept[skip..] {
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&c.next.to_le_bytes());
                b.extend_from_slice(&c.ring.to_le_bytes());
            }
            Some((b, ()))
        })
        .map(|_| ())
    }
}

/// The (name hash, cursor) entries of a `PeerCursors` value, oldest first.
fn entries(b: &[u8]) -> impl Iterator<Item = (u64, Cursor)> + '_ {
    b.chunks_exact(CURSOR_BYTES).map(|e| {
        let c = Cursor {
            next: read_u64(e, 8),
            ring: read_u64(e, 16),
        };
        (read_u64(e, 0), c)
    })
}

/// seq (8) | address length (1) | address | blocks (8 each), little-endian.
fn encode(seq: u64, address: &str, blocks: &[u64]) -> Vec<u8> {
    let address = &address.as_bytes()[..address.len().min(MAX_ADDRESS)];
    let mut b = Vec::with_capacity(9 + address.len() + 8 * blocks.len());
    b.extend_from_slice(&seq.to_le_bytes());
    b.push(address.len() as u8);
    b.extend_from_slice(address);
    for h in blocks {
        b.extend_from_slice(&h.to_le_bytes());
    }
    b
}

fn decode(b: &[u8]) -> Option<Placement> {
    let seq = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let n = usize::from(*b.get(8)?);
    let address = std::str::from_utf8(b.get(9..9 + n)?).ok()?.to_string();
    let rest = b.get(9 + n..)?;
    if !rest.len().is_multiple_of(8) {
        return None;
    }
    let blocks = rest
        .chunks_exact(8)
        .map(|c| c.try_into().map(u64::from_le_bytes).unwrap_or(0))
        .collect();
    Some(Placement {
        seq,
        address,
        blocks,
    })
}

/// A placement as written: borrows the decoded one, and writes its hashes straight into the
/// JSON (an answer is up to about 1 MiB; no second copy of it is built first).
#[derive(Serialize)]
struct WirePlacementOut<'a> {
    endpoint: &'a str,
    blocks: HexBlocks<'a>,
}

/// Block hashes, 16 hex digits each, as one string.
struct HexBlocks<'a>(&'a [u64]);

impl std::fmt::Display for HexBlocks<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|h| write!(f, "{h:016x}"))
    }
}

impl Serialize for HexBlocks<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Serialize)]
struct WireBatchOut<'a> {
    next: u64,
    ring: u64,
    end: u64,
    placements: Vec<WirePlacementOut<'a>>,
}

/// A placement as read: the hashes borrowed from the answer's bytes when they can be (a
/// peer writes them unescaped).
#[derive(Deserialize)]
struct WirePlacementIn<'a> {
    endpoint: String,
    #[serde(borrow)]
    blocks: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct WireBatchIn<'a> {
    next: u64,
    #[serde(default)]
    ring: u64,
    #[serde(default)]
    end: u64,
    #[serde(borrow)]
    placements: Vec<WirePlacementIn<'a>>,
}

impl PlacementBatch {
    /// The answer to a peer's poll, as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        let wire = WireBatchOut {
            next: self.next,
            ring: self.ring,
            end: self.end,
            placements: self
                .placements
                .iter()
                .map(|p| WirePlacementOut {
                    endpoint: &p.address,
                    blocks: HexBlocks(&p.blocks),
                })
                .collect(),
        };
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// A peer's answer; `None` when it is not one: a ring holds `LOG_ENTRIES` placements, so
    /// an answer with more (each one index insert here, all in one callback) is refused.
    /// Placements whose hashes do not parse are dropped, and each keeps at most
    /// `MAX_SHARED_BLOCKS` blocks.
    pub fn from_json(body: &[u8]) -> Option<PlacementBatch> {
        let wire: WireBatchIn = serde_json::from_slice(body).ok()?;
        if wire.placements.len() as u64 > LOG_ENTRIES {
            return None;
        }
        let placements = wire
            .placements
            .into_iter()
            .filter_map(|p| {
                let blocks = parse_hex_blocks(&p.blocks)?;
                (p.endpoint.len() <= MAX_ADDRESS).then_some(Placement {
                    seq: 0,
                    address: p.endpoint,
                    blocks,
                })
            })
            .collect();
        Some(PlacementBatch {
            next: wire.next,
            ring: wire.ring,
            placements,
            end: wire.end,
        })
    }
}

fn parse_hex_blocks(s: &str) -> Option<Vec<u64>> {
    if !s.len().is_multiple_of(16) || !s.is_ascii() {
        return None;
    }
    s.as_bytes()
        .chunks_exact(16)
        .take(MAX_SHARED_BLOCKS)
        .map(|c| u64::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect()
}

/// The cursor a poll asks from: `since=N&ring=R` in the path's query (0 for what is absent
/// or not a number).
pub fn cursor_in_path(path: &str) -> Cursor {
    let query = path.split_once('?').map_or("", |(_, q)| q);
    let field = |name: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Cursor {
        next: field("since"),
        ring: field("ring"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    /// Sequence number `next` of the log's own ring.
    fn at(log: &PlacementLog, s: &MemStore, next: u64) -> Cursor {
        Cursor {
            next,
            ring: log.end(s).unwrap().ring,
        }
    }

    fn log_with(n: u64) -> (PlacementLog, MemStore) {
        let (log, s) = (PlacementLog::new("t"), MemStore::new());
        for i in 0..n {
            log.record(&s, "10.0.0.1:8000", &[i, i + 1, i + 2], 1_000)
                .unwrap();
        }
        (log, s)
    }

    #[test]
    fn a_peer_reads_what_was_placed_after_its_last_poll() {
        let (log, s) = log_with(5);
        let b = log.since(&s, at(&log, &s, 3)).unwrap();
        assert_eq!(b.next, 5);
        let seqs: Vec<u64> = b.placements.iter().map(|p| p.seq).collect();
        assert_eq!(seqs, [3, 4]);
        assert_eq!(b.placements[0].blocks, [3, 4, 5]);
        assert_eq!(b.placements[0].address, "10.0.0.1:8000");
        assert!(log
            .since(&s, at(&log, &s, 5))
            .unwrap()
            .placements
            .is_empty());
    }

    #[test]
    fn the_ring_keeps_the_newest_and_a_restart_answers_from_the_oldest() {
        let (log, s) = log_with(LOG_ENTRIES + 10);
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        assert_eq!(b.placements.len() as u64, LOG_ENTRIES);
        assert_eq!(b.placements[0].seq, 10);
        assert_eq!(b.next, LOG_ENTRIES + 10);
        // A poller that asks past the end (this process restarted) gets the ring again.
        let again = log.since(&s, at(&log, &s, 10_000)).unwrap();
        assert_eq!(again.placements.len() as u64, LOG_ENTRIES);
        assert_eq!(s.len() as u64, LOG_ENTRIES + 1, "bounded key set");
        // So does one that asks a ring this process no longer has (it restarted, and has
        // placed more since than the poller had read before).
        let other = Cursor {
            next: 20,
            ring: log.end(&s).unwrap().ring + 2,
        };
        let b = log.since(&s, other).unwrap();
        assert_eq!(b.placements[0].seq, 10);
        assert_eq!(b.cursor(), log.end(&s).unwrap());
    }

    #[test]
    fn a_numbered_placement_not_yet_written_is_asked_for_again() {
        let (log, s) = log_with(2);
        // A VM took number 2 and has not written it yet.
        update(&s, "t/pl/n", |_| {
            let mut b = vec![0u8; 8];
            write_u64(&mut b, 0, 3);
            Some((b, ()))
        })
        .unwrap();
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        assert_eq!(b.placements.len(), 2);
        assert_eq!(b.next, 2, "the next poll starts at the missing one");
    }

    #[test]
    fn a_withdrawn_placement_is_stepped_over() {
        let (log, s) = log_with(3);
        assert!(log.withdraw(&s, 1).unwrap());
        assert!(!log.withdraw(&s, 1).unwrap(), "withdrawn once");
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        let seqs: Vec<u64> = b.placements.iter().map(|p| p.seq).collect();
        assert_eq!(seqs, [0, 2]);
        assert_eq!(b.next, 3);
        // A lap later the slot holds another placement: that one is not taken back.
        let (log, s) = log_with(LOG_ENTRIES + 2);
        assert!(!log.withdraw(&s, 1).unwrap());
        let b = log.since(&s, at(&log, &s, LOG_ENTRIES + 1)).unwrap();
        assert_eq!(b.placements[0].blocks.len(), 3);
    }

    #[test]
    fn an_unreadable_entry_is_skipped_not_waited_for() {
        let (log, s) = log_with(3);
        s.set("t/pl/1", b"garbage", None).unwrap();
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        let seqs: Vec<u64> = b.placements.iter().map(|p| p.seq).collect();
        assert_eq!(seqs, [0, 2]);
        assert_eq!(b.next, 3);
    }

    #[test]
    fn answers_round_trip_as_json_and_garbage_is_refused() {
        let (log, s) = log_with(3);
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        let back = PlacementBatch::from_json(&b.to_json()).unwrap();
        assert_eq!(back.next, 3);
        assert_eq!(back.placements.len(), 3);
        assert_eq!(back.placements[2].blocks, [2, 3, 4]);
        assert_eq!(back.placements[2].address, "10.0.0.1:8000");
        assert!(PlacementBatch::from_json(b"not json").is_none());
        assert!(PlacementBatch::from_json(b"{\"next\":1}").is_none());
        let odd = br#"{"next":1,"placements":[{"endpoint":"a:1","blocks":"abc"},
            {"endpoint":"a:1","blocks":"zzzzzzzzzzzzzzzz"},
            {"endpoint":"a:1","blocks":"00000000000000ff"}]}"#;
        let b = PlacementBatch::from_json(odd).unwrap();
        assert_eq!(
            b.placements.len(),
            1,
            "only the well-formed placement stays"
        );
        assert_eq!(b.placements[0].blocks, [255]);
        // More placements than a ring holds: no peer's answer.
        let many = |n: u64| {
            let one = r#"{"endpoint":"a:1","blocks":"00000000000000ff"}"#;
            let list = vec![one; n as usize].join(",");
            format!(r#"{{"next":{n},"placements":[{list}]}}"#).into_bytes()
        };
        assert!(PlacementBatch::from_json(&many(LOG_ENTRIES)).is_some());
        assert!(PlacementBatch::from_json(&many(LOG_ENTRIES + 1)).is_none());
        // Hashes written with escapes still read (they cannot be borrowed as they stand).
        let escaped =
            br#"{"next":1,"placements":[{"endpoint":"a:1","blocks":"\u00300000000000000ff"}]}"#;
        let b = PlacementBatch::from_json(escaped).unwrap();
        assert_eq!(b.placements[0].blocks, [255]);
        // The wire form is what it was: hashes as one string of 16 hex digits each.
        let one = PlacementBatch {
            next: 2,
            ring: 7,
            end: 2,
            placements: vec![Placement {
                seq: 1,
                address: "a:1".into(),
                blocks: vec![1, u64::MAX],
            }],
        };
        assert_eq!(
            String::from_utf8(one.to_json()).unwrap(),
            r#"{"next":2,"ring":7,"end":2,"placements":[{"endpoint":"a:1","blocks":"0000000000000001ffffffffffffffff"}]}"#
        );
    }

    #[test]
    fn long_prompts_keep_their_first_blocks_and_answers_are_bounded() {
        let (log, s) = (PlacementLog::new("t"), MemStore::new());
        let long: Vec<u64> = (0..5_000).collect();
        for _ in 0..200 {
            log.record(&s, "10.0.0.1:8000", &long, 1_000).unwrap();
        }
        let b = log.since(&s, at(&log, &s, 0)).unwrap();
        assert_eq!(b.placements[0].blocks.len(), MAX_SHARED_BLOCKS);
        assert!(
            b.placements.len() < 200,
            "one answer stops near its byte bound"
        );
        assert!(b.to_json().len() < 2 * MAX_ANSWER_BYTES);
        let rest = log.since(&s, at(&log, &s, b.next)).unwrap();
        assert_eq!(rest.placements[0].seq, b.next);
    }

    #[test]
    fn cursors_are_kept_per_peer_by_name_and_the_least_recent_make_room() {
        let (c, s) = (PeerCursors::new("t"), MemStore::new());
        let (b, x) = (Cursor { next: 42, ring: 5 }, Cursor { next: 7, ring: 9 });
        assert_eq!(c.get(&s, "gw_b").unwrap(), Cursor::default());
        c.set(&s, "gw_b", b).unwrap();
        c.set(&s, "gw_c", x).unwrap();
        assert_eq!(c.get(&s, "gw_b").unwrap(), b);
        assert_eq!(c.get(&s, "gw_c").unwrap(), x);
        assert_eq!(c.get(&s, "gw_x").unwrap(), Cursor::default());
        // Written again, a peer's entry is replaced, not added.
        let b2 = Cursor { next: 50, ring: 5 };
        c.set(&s, "gw_b", b2).unwrap();
        assert_eq!(c.get(&s, "gw_b").unwrap(), b2);
        // Many peers come and go: the value stays bounded, and a peer still written at
        // every answer keeps its place while the ones that left go first.
        for i in 0..3 * MAX_CURSORS {
            c.set(&s, &format!("10.0.0.{i}:80"), Cursor { next: 1, ring: 1 })
                .unwrap();
            c.set(&s, "gw_c", x).unwrap();
        }
        assert_eq!(c.get(&s, "gw_c").unwrap(), x);
        assert_eq!(c.get(&s, "gw_b").unwrap(), Cursor::default());
        assert_eq!(c.get(&s, "10.0.0.0:80").unwrap(), Cursor::default());
        let last = format!("10.0.0.{}:80", 3 * MAX_CURSORS - 1);
        assert_eq!(c.get(&s, &last).unwrap(), Cursor { next: 1, ring: 1 });
        assert_eq!(s.get("t/pc").unwrap().0.unwrap().len(), 24 * MAX_CURSORS);
    }

    #[test]
    fn the_cursor_is_read_from_the_query() {
        let c = |next, ring| Cursor { next, ring };
        assert_eq!(
            cursor_in_path("/tokenaware/peers?since=42&ring=3"),
            c(42, 3)
        );
        assert_eq!(cursor_in_path("/tokenaware/peers?x=1&since=7"), c(7, 0));
        assert_eq!(cursor_in_path("/tokenaware/peers"), c(0, 0));
        assert_eq!(
            cursor_in_path("/tokenaware/peers?since=-1&rings=4"),
            c(0, 0)
        );
    }
}

//! The key-value store the shared tables live in: get with a version, set guarded by that
//! version (compare-and-swap). In Envoy it is proxy-wasm shared data, visible to every worker
//! VM; natively (tests, simulator) it is `MemStore`. Every table keeps a fixed key set, since
//! proxy-wasm shared data cannot delete a key.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh64::xxh64;

/// Hashes store keys for the in-VM maps and caches: one-shot XXH64 of the key's bytes.
/// Not XXH3, whose short-input path multiplies 64×64→128 bits (emulated in wasm), and not
/// a streaming hasher, whose buffering costs more than hashing a 20-byte key.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh64(bytes, self.0);
    }
    /// `str` hashing ends with a 0xff marker byte: folded in without another pass.
    fn write_u8(&mut self, b: u8) {
        self.0 = self.0.rotate_left(8) ^ u64::from(b);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyHashes = BuildHasherDefault<KeyHasher>;

fn key_hash(key: &str) -> u64 {
    xxh64(key.as_bytes(), 0)
}

/// Version of a stored value, as proxy-wasm's `cas`.
pub type Cas = u32;

/// A stored value as read. Shared, so the read caches below hand out the same bytes again
/// without copying them: a decision reads some thirty values of up to 1.3 KB, and in the
/// VM each copy is an allocation too.
pub type Bytes = Rc<[u8]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read: read again and retry.
    CasMismatch,
    /// The host refused or failed; the caller falls back.
    Host,
}

pub trait SharedStore {
    /// The value and its version; `(None, None)` when the key was never set.
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError>;
    /// Sets `value` if the stored version still equals `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError>;
    /// Whether a key read twice in a row is read from the store only once.
    fn keeps_reads(&self) -> bool {
        false
    }
    /// The value as stored now, past any read this store keeps.
    fn get_fresh(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        self.get(key)
    }
}

/// The version a write names to create a key that is absent. proxy-wasm's shared data
/// (cpp-host `SharedData::set`) creates an absent key whatever the version, and refuses a
/// write to a present key whose version differs: so this write creates the key, or fails
/// with `CasMismatch` when another worker created it between the read and the write (an
/// unconditional write there would drop that worker's update). Versions come from one
/// counter from 1 up, so a present key has this one only once in 2^32 writes.
pub const CREATE_CAS: Cas = Cas::MAX;

/// How often a CAS update is retried before the caller gives up and counts an error.
pub const CAS_RETRIES: usize = 8;

/// Read-modify-write with CAS retries. `f` gets the current bytes (empty when unset) and
/// returns the new bytes, or `None` to leave the value as it is.
pub fn update<S: SharedStore + ?Sized, T>(
    store: &S,
    key: &str,
    mut f: impl FnMut(&[u8]) -> Option<(Vec<u8>, T)>,
) -> Result<Option<T>, StoreError> {
    for _ in 0..CAS_RETRIES {
        let (mut value, mut cas) = store.get(key)?;
        if value.is_none() {
            // A key seen absent has no version to write against: the write below would
            // overwrite whatever another worker created since a kept read. Look again now.
            (value, cas) = store.get_fresh(key)?;
        }
        let Some((new, out)) = f(value.as_deref().unwrap_or(&[])) else {
            return Ok(None);
        };
        // Still absent: create it, unless another worker did since (then retry on theirs).
        match store.set(key, &new, cas.or(Some(CREATE_CAS))) {
            Ok(()) => return Ok(Some(out)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// In-process store with proxy-wasm's semantics (versions start at 1, bump on every set).
#[derive(Debug, Default)]
pub struct MemStore {
    map: RefCell<HashMap<String, (Bytes, Cas), KeyHashes>>,
    /// Test hook: fail this many upcoming sets with `CasMismatch`, as a racing worker would.
    pub inject_conflicts: std::cell::Cell<u32>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.map.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.borrow().is_empty()
    }

    /// Total bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.map
            .borrow()
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        Ok(match self.map.borrow().get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        let pending = self.inject_conflicts.get();
        if pending > 0 {
            self.inject_conflicts.set(pending - 1);
            return Err(StoreError::CasMismatch);
        }
        let mut map = self.map.borrow_mut();
        match map.get_mut(key) {
            Some((v, c)) => {
                if cas.is_some_and(|want| want != 0 && want != *c) {
                    return Err(StoreError::CasMismatch);
                }
                *v = Bytes::from(value);
                *c = c.wrapping_add(1).max(1);
            }
            None => {
                map.insert(key.to_string(), (Bytes::from(value), 1));
            }
        }
        Ok(())
    }
}

/// A read cache over a store for the span of one decision: matching reads each endpoint's
/// index header, ledger and buckets, and the insert and charge that follow read several of
/// them again. A cached version is still checked by the inner store's CAS on write; a write
/// (or a conflict) drops the key, so a retry reads fresh.
pub struct ReadCache<'a, S: SharedStore + ?Sized> {
    inner: &'a S,
    cache: RefCell<Vec<Cached>>,
}

/// A key's hash (compared first: a decision reads some thirty keys that share a long prefix),
/// the key, its value and version as read.
type Cached = (u64, String, Option<Bytes>, Option<Cas>);

impl<'a, S: SharedStore + ?Sized> ReadCache<'a, S> {
    pub fn new(inner: &'a S) -> Self {
        ReadCache {
            inner,
            cache: RefCell::new(Vec::with_capacity(32)),
        }
    }
}

impl<S: SharedStore + ?Sized> SharedStore for ReadCache<'_, S> {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        let h = key_hash(key);
        let hit = |(kh, k, _, _): &&Cached| *kh == h && k == key;
        if let Some((_, _, v, c)) = self.cache.borrow().iter().find(hit) {
            return Ok((v.clone(), *c));
        }
        let (v, c) = self.inner.get(key)?;
        self.cache
            .borrow_mut()
            .push((h, key.to_string(), v.clone(), c));
        Ok((v, c))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        self.cache.borrow_mut().retain(|(_, k, _, _)| k != key);
        self.inner.set(key, value, cas)
    }

    fn get_fresh(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        self.cache.borrow_mut().retain(|(_, k, _, _)| k != key);
        self.inner.get_fresh(key)
    }
}

/// Shared-data reads kept across decisions, each for at most `max_age_ms`.
///
/// In Envoy every read is a hostcall that copies the value into the VM (through a call back
/// into the VM to allocate it), and a decision reads every endpoint's index header, first
/// bucket and ledger: with 32 endpoints that cost more than the rest of the decision. At a
/// high request rate most of those were read by the decision just before. What a kept read risks is bounded: another worker's writes show
/// up at most `max_age_ms` late; this VM's own writes drop the key, so they show at once; and
/// a write made from a kept read is still checked by the store's CAS, whose conflict drops
/// the key and retries fresh. Bounded by `max_bytes` of values: when full, expired reads go,
/// then everything.
#[derive(Debug)]
pub struct RecentReads {
    max_age_ms: u64,
    max_bytes: usize,
    map: RefCell<HashMap<String, Recent, KeyHashes>>,
    bytes: Cell<usize>,
}

#[derive(Debug)]
struct Recent {
    value: Option<Bytes>,
    cas: Option<Cas>,
    read_ms: u64,
}

impl RecentReads {
    pub fn new(max_age_ms: u64, max_bytes: usize) -> Self {
        RecentReads {
            max_age_ms,
            max_bytes,
            map: RefCell::new(HashMap::default()),
            bytes: Cell::new(0),
        }
    }

    /// The store as a decision made at `now_ms` sees it.
    pub fn at<'a, S: SharedStore + ?Sized>(
        &'a self,
        inner: &'a S,
        now_ms: u64,
    ) -> RecentView<'a, S> {
        RecentView {
            inner,
            reads: self,
            now_ms: Some(now_ms),
        }
    }

    /// The store for a release or update: reads fresh, and writes drop what is kept.
    pub fn fresh<'a, S: SharedStore + ?Sized>(&'a self, inner: &'a S) -> RecentView<'a, S> {
        RecentView {
            inner,
            reads: self,
            now_ms: None,
        }
    }

    /// Forgets every kept read.
    pub fn clear(&self) {
        if let Ok(mut map) = self.map.try_borrow_mut() {
            map.clear();
            self.bytes.set(0);
        }
    }

    /// Values held, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes.get()
    }

    fn kept(&self, key: &str, now_ms: u64) -> Option<(Option<Bytes>, Option<Cas>)> {
        let map = self.map.try_borrow().ok()?;
        let r = map.get(key)?;
        let age = now_ms.checked_sub(r.read_ms)?;
        (age < self.max_age_ms).then(|| (r.value.clone(), r.cas))
    }

    fn keep(&self, key: &str, value: &Option<Bytes>, cas: Option<Cas>, now_ms: u64) {
        let Ok(mut map) = self.map.try_borrow_mut() else {
            return;
        };
        let size = held_bytes;
        if size(value) > self.max_bytes {
            return;
        }
        if self.bytes.get() + size(value) > self.max_bytes {
            let max_age = self.max_age_ms;
            map.retain(|_, r| now_ms.saturating_sub(r.read_ms) < max_age);
            let mut held: usize = map.values().map(|r| size(&r.value)).sum();
            if held + size(value) > self.max_bytes {
                map.clear();
                held = 0;
            }
            self.bytes.set(held);
        }
        let old = map.insert(
            key.to_string(),
            Recent {
                value: value.clone(),
                cas,
                read_ms: now_ms,
            },
        );
        let freed = old.map_or(0, |r| size(&r.value));
        self.bytes.set(self.bytes.get() + size(value) - freed);
    }

    fn forget(&self, key: &str) {
        if let Ok(mut map) = self.map.try_borrow_mut() {
            if let Some(r) = map.remove(key) {
                self.bytes
                    .set(self.bytes.get().saturating_sub(held_bytes(&r.value)));
            }
        }
    }
}

/// What a kept read counts against the bound: its value and about what the map spends on it.
fn held_bytes(value: &Option<Bytes>) -> usize {
    value.as_ref().map_or(0, |v| v.len()) + 64
}

/// A store seen through [`RecentReads`].
pub struct RecentView<'a, S: SharedStore + ?Sized> {
    inner: &'a S,
    reads: &'a RecentReads,
    /// When the decision is made; `None` reads fresh and keeps nothing.
    now_ms: Option<u64>,
}

impl<S: SharedStore + ?Sized> SharedStore for RecentView<'_, S> {
    fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        let Some(now) = self.now_ms.filter(|_| self.reads.max_age_ms > 0) else {
            return self.inner.get(key);
        };
        if let Some(kept) = self.reads.kept(key, now) {
            return Ok(kept);
        }
        let (v, c) = self.inner.get(key)?;
        self.reads.keep(key, &v, c, now);
        Ok((v, c))
    }

    fn get_fresh(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
        self.reads.forget(key);
        self.inner.get_fresh(key)
    }

    fn keeps_reads(&self) -> bool {
        self.now_ms.is_some() && self.reads.max_age_ms > 0
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        // Whatever the outcome: after a write the stored version is unknown here.
        self.reads.forget(key);
        self.inner.set(key, value, cas)
    }
}

/// The keys of a table's per-endpoint values (`prefix`, a tag, the slot in hex), each built
/// once: a decision reads several per endpoint, and building one is an allocation.
#[derive(Debug, Clone)]
pub(crate) struct SlotKeys {
    prefix: String,
    tag: Option<char>,
    built: RefCell<Vec<Rc<str>>>,
}

/// Slots whose keys are kept (`maxEndpoints` is at most 4,096); above, keys are built.
const KEPT_SLOT_KEYS: usize = 4_096;

impl SlotKeys {
    pub(crate) fn new(prefix: &str, tag: Option<char>) -> SlotKeys {
        SlotKeys {
            prefix: prefix.to_string(),
            tag,
            built: RefCell::new(Vec::new()),
        }
    }

    pub(crate) fn get(&self, slot: u16) -> Rc<str> {
        let slot = usize::from(slot);
        let build = |n: usize| Rc::from(key(&self.prefix, self.tag, n as u64));
        let Ok(mut built) = self.built.try_borrow_mut() else {
            return build(slot);
        };
        while built.len() <= slot && built.len() < KEPT_SLOT_KEYS {
            let next = build(built.len());
            built.push(next);
        }
        built.get(slot).cloned().unwrap_or_else(|| build(slot))
    }
}

/// A store key: `prefix`, a tag character and `n` in lower-case hex (what `format!` would
/// write, without its machinery: keys are built for every store access of every decision).
pub(crate) fn key(prefix: &str, tag: Option<char>, n: u64) -> String {
    let mut k = String::with_capacity(prefix.len() + 17);
    k.push_str(prefix);
    if let Some(t) = tag {
        k.push(t);
    }
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        let d = ((n >> (4 * i)) & 0xf) as u32;
        k.push(char::from_digit(d, 16).unwrap_or('0'));
    }
    k
}

/// Little-endian field access for fixed-layout records; out-of-range reads give 0 so a short
/// or foreign value reads as empty instead of panicking.
pub(crate) fn read_u64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

pub(crate) fn read_u32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .unwrap_or(0)
}

pub(crate) fn write_u64(b: &mut [u8], at: usize, v: u64) {
    if let Some(s) = b.get_mut(at..at + 8) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn write_u32(b: &mut [u8], at: usize, v: u32) {
    if let Some(s) = b.get_mut(at..at + 4) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that counts its reads.
    #[derive(Default)]
    struct Counted {
        store: MemStore,
        reads: Cell<u32>,
    }

    impl SharedStore for Counted {
        fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
            self.reads.set(self.reads.get() + 1);
            self.store.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            self.store.set(key, value, cas)
        }
    }

    #[test]
    fn recent_reads_are_reused_until_they_are_too_old() {
        let s = Counted::default();
        s.store.set("k", b"1", None).unwrap();
        let recent = RecentReads::new(5, 1 << 20);
        assert_eq!(
            recent.at(&s, 100).get("k").unwrap().0.as_deref().unwrap(),
            b"1"
        );
        // Another worker writes: a decision within 5 ms still sees the kept read.
        s.store.set("k", b"2", None).unwrap();
        assert_eq!(
            recent.at(&s, 104).get("k").unwrap().0.as_deref().unwrap(),
            b"1"
        );
        assert_eq!(s.reads.get(), 1);
        // 5 ms after the read it is read again.
        assert_eq!(
            recent.at(&s, 105).get("k").unwrap().0.as_deref().unwrap(),
            b"2"
        );
        assert_eq!(s.reads.get(), 2);
        // A clock that went back never trusts the kept read.
        assert_eq!(
            recent.at(&s, 90).get("k").unwrap().0.as_deref().unwrap(),
            b"2"
        );
        assert_eq!(s.reads.get(), 3);
        // A fresh view always reads.
        recent.fresh(&s).get("k").unwrap();
        assert_eq!(s.reads.get(), 4);
        // Zero max age: every read goes to the store.
        let never = RecentReads::new(0, 1 << 20);
        never.at(&s, 100).get("k").unwrap();
        never.at(&s, 100).get("k").unwrap();
        assert_eq!(s.reads.get(), 6);
    }

    #[test]
    fn own_writes_show_at_once_and_stale_cas_retries_fresh() {
        let s = MemStore::new();
        s.set("k", b"a", None).unwrap();
        let recent = RecentReads::new(1_000, 1 << 20);
        let view = recent.at(&s, 10);
        view.get("k").unwrap();
        // Our own write, then a read at the same instant: the write, not the kept read.
        update(&view, "k", |old| Some(([old, b"b"].concat(), ()))).unwrap();
        assert_eq!(view.get("k").unwrap().0.as_deref().unwrap(), b"ab");
        // Another worker writes behind the kept read; an update from it conflicts once,
        // drops it and lands on the fresh value.
        s.set("k", b"X", None).unwrap();
        assert_eq!(view.get("k").unwrap().0.as_deref().unwrap(), b"ab");
        update(&view, "k", |old| Some(([old, b"c"].concat(), ()))).unwrap();
        assert_eq!(s.get("k").unwrap().0.as_deref().unwrap(), b"Xc");
        recent.clear();
        assert_eq!(recent.bytes(), 0);
    }

    #[test]
    fn an_absent_key_is_read_again_before_it_is_written() {
        let s = MemStore::new();
        let recent = RecentReads::new(1_000, 1 << 20);
        let view = recent.at(&s, 10);
        assert_eq!(view.get("k").unwrap(), (None, None));
        // Another worker creates the key; an update here must build on its value, not on
        // the absence read a moment ago (a write to an absent key has no version to check).
        s.set("k", b"X", None).unwrap();
        update(&view, "k", |old| Some(([old, b"y"].concat(), ()))).unwrap();
        assert_eq!(s.get("k").unwrap().0.as_deref().unwrap(), b"Xy");
    }

    /// A store where another worker creates each key between this worker's (fresh) read
    /// and its first write.
    #[derive(Default)]
    struct CreatedMeanwhile {
        store: MemStore,
        raced: Cell<bool>,
    }

    impl SharedStore for CreatedMeanwhile {
        fn get(&self, key: &str) -> Result<(Option<Bytes>, Option<Cas>), StoreError> {
            self.store.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            if !self.raced.replace(true) {
                self.store.set(key, b"X", None)?;
            }
            self.store.set(key, value, cas)
        }
    }

    #[test]
    fn a_key_created_between_the_read_and_the_write_is_built_on() {
        let s = CreatedMeanwhile::default();
        let mut seen = Vec::new();
        update(&s, "k", |old| {
            seen.push(old.to_vec());
            Some(([old, b"y"].concat(), ()))
        })
        .unwrap();
        // The first write (naming no version) conflicts with the other worker's creation;
        // the retry builds on it.
        assert_eq!(seen, [b"".to_vec(), b"X".to_vec()]);
        assert_eq!(s.get("k").unwrap().0.as_deref().unwrap(), b"Xy");
    }

    #[test]
    fn recent_reads_stay_within_their_bytes() {
        let s = MemStore::new();
        for i in 0..100 {
            s.set(&format!("k{i}"), &[7u8; 1_000], None).unwrap();
        }
        let recent = RecentReads::new(1_000, 10_000);
        for i in 0..100 {
            recent.at(&s, 1).get(&format!("k{i}")).unwrap();
            assert!(recent.bytes() <= 10_000, "{} bytes", recent.bytes());
        }
        assert!(recent.bytes() > 0);
        // A value larger than the whole bound is read, never kept.
        s.set("big", &[0u8; 20_000], None).unwrap();
        assert_eq!(
            recent
                .at(&s, 1)
                .get("big")
                .unwrap()
                .0
                .as_deref()
                .unwrap()
                .len(),
            20_000
        );
        assert!(recent.bytes() <= 10_000);
    }

    #[test]
    fn cas_guards_writes() {
        let s = MemStore::new();
        assert_eq!(s.get("k").unwrap(), (None, None));
        s.set("k", b"a", None).unwrap();
        let (_, c) = s.get("k").unwrap();
        s.set("k", b"b", c).unwrap();
        assert_eq!(s.set("k", b"c", c), Err(StoreError::CasMismatch));
        assert_eq!(s.get("k").unwrap().0.as_deref().unwrap(), b"b");
    }

    #[test]
    fn keys_are_written_as_format_would() {
        for n in [0u64, 1, 9, 10, 15, 16, 255, 4096, 0xdead_beef, u64::MAX] {
            assert_eq!(key("ns/ix/", Some('b'), n), format!("ns/ix/b{n:x}"));
            assert_eq!(key("ns/ld/", None, n), format!("ns/ld/{n:x}"));
        }
    }

    #[test]
    fn slot_keys_are_the_keys_built_each_time() {
        let keys = SlotKeys::new("ns/ix/", Some('h'));
        for slot in [3u16, 0, 17, 3] {
            assert_eq!(&*keys.get(slot), key("ns/ix/", Some('h'), u64::from(slot)));
        }
        assert_eq!(keys.built.borrow().len(), 18);
        // Kept up to the bound only: a slot past it is built, not stored.
        assert_eq!(&*keys.get(u16::MAX), key("ns/ix/", Some('h'), 0xffff));
        assert_eq!(keys.built.borrow().len(), KEPT_SLOT_KEYS);
    }

    #[test]
    fn update_retries_conflicts() {
        let s = MemStore::new();
        s.inject_conflicts.set(3);
        let r = update(&s, "n", |old| Some((vec![old.len() as u8 + 1], ()))).unwrap();
        assert_eq!(r, Some(()));
        assert_eq!(s.get("n").unwrap().0.as_deref().unwrap(), vec![1]);
        s.inject_conflicts.set(CAS_RETRIES as u32);
        assert_eq!(
            update(&s, "n", |_| Some((vec![9], ()))),
            Err(StoreError::CasMismatch)
        );
    }

    #[test]
    fn read_cache_serves_repeats_and_stays_correct_under_conflicts() {
        let s = MemStore::new();
        s.set("k", b"1", None).unwrap();
        let c = ReadCache::new(&s);
        assert_eq!(c.get("k").unwrap().0.as_deref().unwrap(), b"1");
        // Another worker writes behind the cache's back.
        s.set("k", b"2", None).unwrap();
        assert_eq!(c.get("k").unwrap().0.as_deref().unwrap(), b"1");
        // A CAS update through the cache sees the conflict, drops the entry and retries fresh.
        update(&c, "k", |old| Some(([old, b"+"].concat(), ()))).unwrap();
        assert_eq!(s.get("k").unwrap().0.as_deref().unwrap(), b"2+");
    }

    #[test]
    fn short_values_read_as_zero() {
        assert_eq!(read_u64(&[1, 2, 3], 0), 0);
        assert_eq!(read_u32(&[1, 0, 0, 0], 0), 1);
        let mut b = [0u8; 4];
        write_u64(&mut b, 0, 5);
        assert_eq!(b, [0; 4]);
    }
}

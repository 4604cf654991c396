//! The key-value store the shared tables live in: get with a version, set guarded by that
//! version (compare-and-swap). In Envoy it is proxy-wasm shared data, visible to every worker
//! VM; natively (tests, simulator) it is `MemStore`. Every table keeps a fixed key set, since
//! proxy-wasm shared data cannot delete a key.

use std::cell::RefCell;
use std::collections::HashMap;

use xxhash_rust::xxh3::{xxh3_64, Xxh3DefaultBuilder};

/// Version of a stored value, as proxy-wasm's `cas`.
pub type Cas = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read: read again and retry.
    CasMismatch,
    /// The host refused or failed; the caller falls back.
    Host,
}

pub trait SharedStore {
    /// The value and its version; `(None, None)` when the key was never set.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), StoreError>;
    /// Sets `value` if the stored version still equals `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError>;
}

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
        let (value, cas) = store.get(key)?;
        let Some((new, out)) = f(value.as_deref().unwrap_or(&[])) else {
            return Ok(None);
        };
        match store.set(key, &new, cas) {
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
    map: RefCell<HashMap<String, (Vec<u8>, Cas), Xxh3DefaultBuilder>>,
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
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), StoreError> {
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
                v.clear();
                v.extend_from_slice(value);
                *c = c.wrapping_add(1).max(1);
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), 1));
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
type Cached = (u64, String, Option<Vec<u8>>, Option<Cas>);

impl<'a, S: SharedStore + ?Sized> ReadCache<'a, S> {
    pub fn new(inner: &'a S) -> Self {
        ReadCache {
            inner,
            cache: RefCell::new(Vec::with_capacity(32)),
        }
    }
}

impl<S: SharedStore + ?Sized> SharedStore for ReadCache<'_, S> {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), StoreError> {
        let h = xxh3_64(key.as_bytes());
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

    #[test]
    fn cas_guards_writes() {
        let s = MemStore::new();
        assert_eq!(s.get("k").unwrap(), (None, None));
        s.set("k", b"a", None).unwrap();
        let (_, c) = s.get("k").unwrap();
        s.set("k", b"b", c).unwrap();
        assert_eq!(s.set("k", b"c", c), Err(StoreError::CasMismatch));
        assert_eq!(s.get("k").unwrap().0.unwrap(), b"b");
    }

    #[test]
    fn keys_are_written_as_format_would() {
        for n in [0u64, 1, 9, 10, 15, 16, 255, 4096, 0xdead_beef, u64::MAX] {
            assert_eq!(key("ns/ix/", Some('b'), n), format!("ns/ix/b{n:x}"));
            assert_eq!(key("ns/ld/", None, n), format!("ns/ld/{n:x}"));
        }
    }

    #[test]
    fn update_retries_conflicts() {
        let s = MemStore::new();
        s.inject_conflicts.set(3);
        let r = update(&s, "n", |old| Some((vec![old.len() as u8 + 1], ()))).unwrap();
        assert_eq!(r, Some(()));
        assert_eq!(s.get("n").unwrap().0.unwrap(), vec![1]);
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
        assert_eq!(c.get("k").unwrap().0.unwrap(), b"1");
        // Another worker writes behind the cache's back.
        s.set("k", b"2", None).unwrap();
        assert_eq!(c.get("k").unwrap().0.unwrap(), b"1");
        // A CAS update through the cache sees the conflict, drops the entry and retries fresh.
        update(&c, "k", |old| Some(([old, b"+"].concat(), ()))).unwrap();
        assert_eq!(s.get("k").unwrap().0.unwrap(), b"2+");
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

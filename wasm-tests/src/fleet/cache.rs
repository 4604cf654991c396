//! The simulated endpoint's own prefix cache (vLLM-like automatic prefix caching).
//!
//! Tokens are approximated as `ceil(bytes / 4)`; a block is 16 tokens = 64 bytes of prompt
//! text; only full blocks are cached. Block `k` is identified by a chained hash
//! `h_k = H(h_{k-1}, block_k)` with `h_0 = H(model)`, using std's `DefaultHasher` (SipHash with
//! fixed keys). This is deliberately *not* the router's hashing (xxh3): the router has to
//! route from its own approximation.
//!
//! Eviction is LRU over blocks with a fixed capacity. When a prompt's blocks are touched, the
//! tail is given the oldest stamp, so under pressure a prompt loses its tail first and its
//! shared prefix last (vLLM frees a request's blocks in reverse order for the same reason).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Bytes per approximate token.
pub const BYTES_PER_TOKEN: usize = 4;
/// Tokens per KV block (vLLM's default block size).
pub const BLOCK_TOKENS: usize = 16;
/// Bytes of prompt text per block.
pub const BLOCK_BYTES: usize = BLOCK_TOKENS * BYTES_PER_TOKEN;

/// Approximate token count of a prompt: `ceil(bytes / 4)`.
pub fn approx_tokens(prompt: &[u8]) -> usize {
    prompt.len().div_ceil(BYTES_PER_TOKEN)
}

/// Chained hashes of the full 64-byte blocks of `prompt`.
pub fn block_hashes(model: &str, prompt: &[u8]) -> Vec<u64> {
    let mut h = DefaultHasher::new();
    model.hash(&mut h);
    let mut prev = h.finish();
    prompt
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

/// LRU set of block hashes with a fixed capacity in blocks. As in vLLM, the cache holds
/// only the blocks running requests do not need: its `limit` is the capacity less their
/// reservations (see `sched`), and lowering it evicts.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    limit: usize,
    clock: u64,
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            capacity: capacity_blocks,
            limit: capacity_blocks,
            clock: 0,
            stamp_of: HashMap::new(),
            by_stamp: BTreeMap::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Number of leading blocks of `hashes` present in the cache (no LRU update).
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamp_of.contains_key(h))
            .count()
    }

    /// Cached prompt tokens for a prompt of `prompt_tokens` tokens with these block hashes,
    /// as vLLM reports them: matched leading blocks × 16, but at least one token is always
    /// computed, so a full hit backs off to the last block boundary below `prompt_tokens`.
    pub fn cached_tokens(&self, hashes: &[u64], prompt_tokens: usize) -> usize {
        let max_blocks = prompt_tokens.saturating_sub(1) / BLOCK_TOKENS;
        self.matched_blocks(hashes).min(max_blocks) * BLOCK_TOKENS
    }

    /// Blocks the cache may hold now: the capacity less what running requests reserve.
    /// Evicts least recently used blocks beyond it.
    pub fn set_limit(&mut self, blocks: usize) {
        self.limit = blocks.min(self.capacity);
        self.evict();
    }

    /// Insert/refresh all blocks of a prompt (called when its prefill completes), evicting
    /// least recently used blocks beyond the limit.
    pub fn insert(&mut self, hashes: &[u64]) {
        if self.limit == 0 {
            return;
        }
        // Tail first, so the head gets the newest stamps and is evicted last.
        for &h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(h, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, h);
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.stamp_of.len() > self.limit {
            let Some((_, h)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u8, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|i| b'a' + ((i as u8) ^ seed) % 26).collect()
    }

    #[test]
    fn tokens_and_blocks() {
        assert_eq!(approx_tokens(b""), 0);
        assert_eq!(approx_tokens(b"abcde"), 2);
        let p = prompt(1, 64 * 3 + 10);
        assert_eq!(block_hashes("m", &p).len(), 3);
        assert_ne!(block_hashes("m", &p), block_hashes("other", &p));
    }

    #[test]
    fn prefix_property() {
        let a = prompt(1, 64 * 10);
        let mut b = a[..64 * 6].to_vec();
        b.extend(prompt(2, 64 * 4));
        let (ha, hb) = (block_hashes("m", &a), block_hashes("m", &b));
        assert_eq!(ha[..6], hb[..6]);
        assert_ne!(ha[6], hb[6]);
        let mut c = PrefixCache::new(100);
        c.insert(&ha);
        assert_eq!(c.matched_blocks(&hb), 6);
        assert_eq!(c.cached_tokens(&hb, approx_tokens(&b)), 96);
    }

    #[test]
    fn full_hit_backs_off_one_block() {
        let a = prompt(3, 64 * 4);
        let h = block_hashes("m", &a);
        let mut c = PrefixCache::new(100);
        assert_eq!(c.cached_tokens(&h, 64), 0);
        c.insert(&h);
        assert_eq!(c.cached_tokens(&h, 64), 48);
        // 64 tokens + a partial block: all 4 blocks count.
        assert_eq!(c.cached_tokens(&h, 65), 64);
    }

    #[test]
    fn lru_evicts_oldest_prompt_tail_first() {
        let (a, b) = (prompt(1, 64 * 4), prompt(9, 64 * 4));
        let (ha, hb) = (block_hashes("m", &a), block_hashes("m", &b));
        let mut c = PrefixCache::new(6);
        c.insert(&ha);
        c.insert(&hb);
        assert_eq!(c.len(), 6);
        // a was oldest: its tail (2 blocks) went, its head stays.
        assert_eq!(c.matched_blocks(&ha), 2);
        assert_eq!(c.matched_blocks(&hb), 4);
        // Touching a makes b the victim.
        c.insert(&ha);
        assert_eq!(c.matched_blocks(&ha), 4);
        assert_eq!(c.matched_blocks(&hb), 2);
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let h = block_hashes("m", &prompt(1, 640));
        let mut c = PrefixCache::new(0);
        c.insert(&h);
        assert!(c.is_empty());
        assert_eq!(c.capacity(), 0);
    }

    #[test]
    fn a_lower_limit_evicts_the_oldest_and_caps_inserts() {
        let (a, b) = (prompt(1, 64 * 4), prompt(9, 64 * 4));
        let (ha, hb) = (block_hashes("m", &a), block_hashes("m", &b));
        let mut c = PrefixCache::new(8);
        c.insert(&ha);
        c.insert(&hb);
        c.set_limit(5);
        assert_eq!((c.matched_blocks(&ha), c.matched_blocks(&hb)), (1, 4));
        c.insert(&ha);
        assert_eq!(c.len(), 5);
        c.set_limit(100);
        c.insert(&hb);
        assert_eq!(c.len(), 8);
    }
}

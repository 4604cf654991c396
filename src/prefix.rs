//! Prefix hashing: the canonical prompt cut into fixed-size blocks, each hashed with xxh3-64
//! seeded by the previous block's hash, so a block's hash stands for the whole prefix up to
//! it. Two prompts share their first k hashes exactly when they share their first k blocks.
//! Knows nothing of endpoints or caches.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The chain's start: model and cache salt, so different models never share entries.
pub fn chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        None => xxh3_64(model.as_bytes()),
        Some(salt) => {
            let mut buf = Vec::with_capacity(model.len() + salt.len() + 1);
            buf.extend_from_slice(model.as_bytes());
            buf.push(0);
            buf.extend_from_slice(salt.as_bytes());
            xxh3_64(&buf)
        }
    }
}

/// The block hashes of one prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockChain {
    pub seed: u64,
    /// `hashes[k]` covers blocks `0..=k`.
    pub hashes: Vec<u64>,
    /// The last hash covers a block shorter than the block size.
    pub last_partial: bool,
    /// The prompt had more blocks than `max_blocks`; the rest is not hashed.
    pub truncated: bool,
    /// Prompt bytes fed, hashed or not.
    pub bytes: u64,
}

impl BlockChain {
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Hashes of whole blocks only: a partial tail block is never cached by a model server,
    /// so it is not worth remembering.
    pub fn full_blocks(&self) -> &[u64] {
        let n = self.hashes.len() - usize::from(self.last_partial && !self.hashes.is_empty());
        self.hashes.get(..n).unwrap_or(&[])
    }
}

/// Incremental hasher, so a caller holding a shared prefix (the simulator) can hash it once
/// and continue from a clone.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_bytes: usize,
    max_blocks: usize,
    chain: BlockChain,
    pending: Vec<u8>,
}

impl BlockHasher {
    pub fn new(seed: u64, block_bytes: usize, max_blocks: usize) -> Self {
        BlockHasher {
            block_bytes: block_bytes.max(1),
            max_blocks,
            chain: BlockChain {
                seed,
                ..BlockChain::default()
            },
            pending: Vec::new(),
        }
    }

    fn prev(&self) -> u64 {
        self.chain.hashes.last().copied().unwrap_or(self.chain.seed)
    }

    fn push_block(&mut self, block: &[u8]) -> bool {
        if self.chain.hashes.len() >= self.max_blocks {
            self.chain.truncated = true;
            return false;
        }
        let h = xxh3_64_with_seed(block, self.prev());
        self.chain.hashes.push(h);
        true
    }

    pub fn feed(&mut self, mut bytes: &[u8]) {
        self.chain.bytes = self.chain.bytes.saturating_add(bytes.len() as u64);
        if self.chain.truncated {
            return;
        }
        if !self.pending.is_empty() {
            let take = (self.block_bytes - self.pending.len()).min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.pending.extend_from_slice(head);
            bytes = rest;
            if self.pending.len() < self.block_bytes {
                return;
            }
            let block = std::mem::take(&mut self.pending);
            if !self.push_block(&block) {
                return;
            }
        }
        let mut blocks = bytes.chunks_exact(self.block_bytes);
        for block in blocks.by_ref() {
            if !self.push_block(block) {
                return;
            }
        }
        self.pending.extend_from_slice(blocks.remainder());
    }

    pub fn finish(mut self) -> BlockChain {
        if !self.pending.is_empty() && !self.chain.truncated {
            let block = std::mem::take(&mut self.pending);
            if self.push_block(&block) {
                self.chain.last_partial = true;
            }
        }
        self.chain
    }
}

/// Hashes a whole prompt at once.
pub fn hash_prompt(seed: u64, prompt: &[u8], block_bytes: usize, max_blocks: usize) -> BlockChain {
    let mut h = BlockHasher::new(seed, block_bytes, max_blocks);
    h.feed(prompt);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed inputs and their hashes. These must never change: the same values are checked
    /// inside a wasm runtime, and an index shared between gateway versions depends on them.
    #[test]
    fn golden_vectors() {
        let seed = chain_seed("sim-model", None);
        assert_eq!(seed, GOLDEN_SEED);
        let prompt: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let c = hash_prompt(seed, &prompt, 256, 64);
        assert_eq!(c.len(), 4);
        assert!(c.last_partial);
        assert!(!c.truncated);
        assert_eq!(c.hashes, GOLDEN_HASHES.to_vec());
        let salted = chain_seed("sim-model", Some("tenant-a"));
        assert_ne!(salted, seed);
        assert_eq!(salted, GOLDEN_SALTED_SEED);
    }

    const GOLDEN_SEED: u64 = 0x787d_e8de_15ae_a755;
    const GOLDEN_HASHES: [u64; 4] = [
        0xd5fc_c99b_f99a_4a72,
        0xda08_a0c2_3dea_5ad1,
        0x0a38_27e4_a512_ab0a,
        0xf3cf_988d_8e36_4972,
    ];
    const GOLDEN_SALTED_SEED: u64 = 0xb20e_3d30_e6ca_1e76;

    #[test]
    fn shared_prefix_shares_hashes() {
        let seed = chain_seed("m", None);
        let a: Vec<u8> = (0..2000u32).map(|i| i as u8).collect();
        let mut b = a[..1024].to_vec();
        b.extend_from_slice(b"something else entirely, diverging at byte 1024 ..........");
        let ca = hash_prompt(seed, &a, 256, 100);
        let cb = hash_prompt(seed, &b, 256, 100);
        assert_eq!(ca.hashes[..4], cb.hashes[..4]);
        assert_ne!(ca.hashes[4], cb.hashes[4]);
    }

    #[test]
    fn incremental_equals_whole() {
        let seed = 42;
        let p: Vec<u8> = (0..5000u32).map(|i| (i % 13) as u8).collect();
        let whole = hash_prompt(seed, &p, 100, 1000);
        for cut in [0, 1, 99, 100, 101, 2500, 4999, 5000] {
            let mut h = BlockHasher::new(seed, 100, 1000);
            h.feed(&p[..cut]);
            let mut h2 = h.clone();
            h2.feed(&p[cut..]);
            assert_eq!(h2.finish(), whole, "cut at {cut}");
        }
    }

    #[test]
    fn cap_and_partial() {
        let c = hash_prompt(1, &[7u8; 1000], 100, 5);
        assert_eq!(c.len(), 5);
        assert!(c.truncated);
        assert!(!c.last_partial);
        assert_eq!(c.full_blocks().len(), 5);
        let c = hash_prompt(1, &[7u8; 150], 100, 5);
        assert_eq!(c.len(), 2);
        assert!(c.last_partial);
        assert_eq!(c.full_blocks().len(), 1);
        let c = hash_prompt(1, &[], 100, 5);
        assert!(c.is_empty());
        assert!(c.full_blocks().is_empty());
    }

    #[test]
    fn model_changes_everything() {
        let p = [1u8; 600];
        let a = hash_prompt(chain_seed("a", None), &p, 256, 10);
        let b = hash_prompt(chain_seed("b", None), &p, 256, 10);
        assert!(a.hashes.iter().zip(&b.hashes).all(|(x, y)| x != y));
    }
}

//! Prefix hasher: the incremental hasher fed in arbitrary pieces equals the one-shot hash,
//! the chain has the prefix property (a prompt's prefix shares its whole-block hashes), and
//! the block count and flags match the lengths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenaware::prefix::{hash_prompt, BlockHasher};

fuzz_target!(|data: &[u8]| {
    // Header: block size (1..=64), max blocks (0..=63), cut point, then the prompt.
    let [b, m, c, ref prompt @ ..] = *data else {
        return;
    };
    let block = usize::from(b % 64) + 1;
    let max_blocks = usize::from(m % 64);
    let seed = u64::from(b) << 8 | u64::from(m);

    let whole = hash_prompt(seed, prompt, block, max_blocks);
    let blocks = prompt.len().div_ceil(block);
    assert_eq!(whole.len(), blocks.min(max_blocks));
    assert_eq!(whole.truncated, blocks > max_blocks);
    assert_eq!(
        whole.last_partial,
        blocks <= max_blocks && prompt.len() % block != 0
    );
    assert!(whole.full_blocks().len() <= whole.len());

    // Fed in pieces whose sizes come from the prompt bytes themselves.
    let mut h = BlockHasher::new(seed, block, max_blocks);
    let mut rest = prompt;
    let mut step = usize::from(c);
    while !rest.is_empty() {
        let (head, tail) = rest.split_at(step.min(rest.len()));
        h.feed(head);
        rest = tail;
        step = usize::from(head.first().copied().unwrap_or(1)) % 97;
    }
    assert_eq!(h.finish(), whole);

    // Prefix property: the first `cut` bytes share every whole block with the full prompt.
    let cut = usize::from(c).min(prompt.len());
    let part = hash_prompt(seed, &prompt[..cut], block, max_blocks);
    let shared = part.full_blocks();
    assert_eq!(shared, &whole.hashes[..shared.len()]);
});

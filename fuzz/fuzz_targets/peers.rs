//! A peer replica's answer (`peers`): any bytes either parse to a bounded batch that writes
//! back to itself, or are refused; and the placement ring read over arbitrary stored values
//! never panics and only moves forward.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenaware::peers::{Cursor, PlacementBatch, PlacementLog, MAX_SHARED_BLOCKS};
use tokenaware::store::{MemStore, SharedStore};

fuzz_target!(|data: &[u8]| {
    if let Some(b) = PlacementBatch::from_json(data) {
        for p in &b.placements {
            assert!(p.blocks.len() <= MAX_SHARED_BLOCKS && p.address.len() <= 255);
        }
        let again = PlacementBatch::from_json(&b.to_json()).expect("an answer written here parses");
        assert_eq!(again, b);
    }
    // The ring: the first byte is the next sequence number, the rest four stored entries.
    let [n, ref rest @ ..] = *data else {
        return;
    };
    let (log, s) = (PlacementLog::new("f"), MemStore::new());
    let _ = s.set("f/pl/n", &u64::from(n).to_le_bytes(), None);
    for (i, chunk) in rest.chunks(rest.len().div_ceil(4).max(1)).enumerate() {
        let _ = s.set(&format!("f/pl/{i}"), chunk, None);
    }
    let ring = log.end(&s).expect("a memory store does not fail").ring;
    for (since, ring) in [
        (0, ring),
        (2, ring),
        (u64::from(n), ring),
        (1_000, ring),
        (1, ring ^ 1),
    ] {
        let b = log
            .since(&s, Cursor { next: since, ring })
            .expect("a memory store does not fail");
        assert!(b.next <= u64::from(n).max(since));
        assert!(b.placements.windows(2).all(|w| w[0].seq < w[1].seq));
    }
});

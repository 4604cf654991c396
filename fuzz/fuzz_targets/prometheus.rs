//! Prometheus text reader: never panics on any bytes or window size, and reading a window
//! equals reading the complete lines inside it (a line cut by the window is never seen).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenaware::prometheus::parse_metrics;

fuzz_target!(|data: &[u8]| {
    let [w, ref text @ ..] = *data else {
        return;
    };
    let max = usize::from(w) * 16;
    let got = parse_metrics(text, max);
    let complete = match text.get(..max) {
        None => text,
        Some(head) if head.len() == text.len() => head,
        Some(head) if text.get(max) == Some(&b'\n') => head,
        Some(head) => match head.iter().rposition(|&b| b == b'\n') {
            Some(i) => &head[..i],
            None => &[],
        },
    };
    let want = parse_metrics(complete, usize::MAX);
    // Debug text, so NaN-free f64 fields compare exactly and a NaN shows up as a mismatch.
    assert_eq!(format!("{got:?}"), format!("{want:?}"));
    for v in [got.running, got.waiting, got.kv_usage, got.block_size] {
        assert!(v.is_none_or(|v| v.is_finite() && v >= 0.0), "{got:?}");
    }
});

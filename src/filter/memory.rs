//! The VMs' own memory, per Envoy process. A VM can read only its own linear memory, and
//! Envoy keeps one gauge per name per process, so each VM's figure goes into shared data
//! (`{namespace}/vms`) and the gauges show the sum over the process's live VMs, their count
//! and the largest. Every VM refreshes its record on every tick; a record left alone for
//! `TTL_MS` belongs to a VM that is gone (a drained configuration) and is dropped.
//!
//! The value is a list of 24-byte records: VM instance id, linear memory bytes, last
//! refresh (ms), little-endian. Several root contexts in one VM instance share one record.

use super::host::VmMemory;
use crate::store::{read_u64, update, write_u64, SharedStore, StoreError};

/// A record not refreshed for this long is dropped. Every VM ticks at least once a second.
pub const TTL_MS: u64 = 10_000;
/// Records kept at most (Envoy's workers plus its main thread, with room for a drain).
pub const MAX_VMS: usize = 512;
const RECORD: usize = 24;

/// The live VMs of this Envoy process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    pub vms: u64,
    pub total_bytes: u64,
    pub max_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Record {
    instance: u64,
    bytes: u64,
    seen_ms: u64,
}

fn decode(b: &[u8]) -> impl Iterator<Item = Record> + '_ {
    b.chunks_exact(RECORD).map(|c| Record {
        instance: read_u64(c, 0),
        bytes: read_u64(c, 8),
        seen_ms: read_u64(c, 16),
    })
}

/// Writes this VM's record (dropping expired ones) and sums the live ones.
pub fn record<S: SharedStore + ?Sized>(
    s: &S,
    key: &str,
    me: VmMemory,
    now_ms: u64,
) -> Result<Summary, StoreError> {
    let summary = update(s, key, |old| {
        let mut live: Vec<Record> = decode(old)
            .filter(|r| r.instance != me.instance && now_ms.saturating_sub(r.seen_ms) <= TTL_MS)
            .take(MAX_VMS - 1)
            .collect();
        live.push(Record {
            instance: me.instance,
            bytes: me.bytes,
            seen_ms: now_ms,
        });
        let mut b = vec![0u8; live.len() * RECORD];
        let mut sum = Summary::default();
        for (i, r) in live.iter().enumerate() {
            write_u64(&mut b, i * RECORD, r.instance);
            write_u64(&mut b, i * RECORD + 8, r.bytes);
            write_u64(&mut b, i * RECORD + 16, r.seen_ms);
            sum.vms += 1;
            sum.total_bytes = sum.total_bytes.saturating_add(r.bytes);
            sum.max_bytes = sum.max_bytes.max(r.bytes);
        }
        Some((b, sum))
    })?;
    Ok(summary.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn vm(instance: u64, mib: u64) -> VmMemory {
        VmMemory {
            instance,
            bytes: mib << 20,
        }
    }

    #[test]
    fn sums_live_vms_once_each_and_forgets_gone_ones() {
        let s = MemStore::new();
        record(&s, "k", vm(1, 2), 1_000).unwrap();
        record(&s, "k", vm(2, 3), 1_100).unwrap();
        // A second root in VM 1 (or VM 1's next tick) replaces its record.
        let sum = record(&s, "k", vm(1, 4), 1_200).unwrap();
        assert_eq!(
            sum,
            Summary {
                vms: 2,
                total_bytes: 7 << 20,
                max_bytes: 4 << 20
            }
        );
        // VM 2 stops ticking.
        let sum = record(&s, "k", vm(1, 4), 1_100 + TTL_MS + 1).unwrap();
        assert_eq!(sum.vms, 1);
        assert_eq!(sum.total_bytes, 4 << 20);
        assert_eq!(s.get("k").unwrap().0.unwrap().len(), RECORD);
    }

    #[test]
    fn bounded_and_tolerates_foreign_bytes() {
        let s = MemStore::new();
        s.set("k", &[7u8; 30], None).unwrap();
        let sum = record(&s, "k", vm(9, 1), 0).unwrap();
        // The stray full record decodes as one VM; the 6 trailing bytes are dropped.
        assert!(sum.vms <= 2);
        for i in 0..(MAX_VMS as u64 + 10) {
            record(&s, "k", vm(100 + i, 1), 5).unwrap();
        }
        assert!(s.get("k").unwrap().0.unwrap().len() <= MAX_VMS * RECORD);
    }
}

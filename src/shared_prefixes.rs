//! Whether other gateway replicas send this gateway's prefixes.
//!
//! Replicas behind a balancer with affinity (by tenant, by session) each see prefixes of
//! their own; replicas dealt requests round robin all see every prefix. They want different
//! cold placement. With affinity, each replica spreads its own prefixes by its own view of
//! load. Dealt round robin, a replica's cold prefix is most often one another replica has
//! already placed (on one of the two endpoints the rendezvous order gives it), and a choice
//! by load made seconds apart on two views of the fleet agrees little better than a coin:
//! the prefix ends up held twice, each copy at half its traffic.
//!
//! The mark of the second case is a cold placement (the index matched nothing, anywhere)
//! whose answer found most of the prompt cached: `CacheCheck::Kept` on a cold decision. A
//! lone gateway or replicas behind affinity see almost none; replicas dealt round robin see
//! one for about every second prefix they place. The mark is counted per Envoy process in
//! shared data, over the last few dozen cold placements.

use crate::store::{self, SharedStore, StoreError};

/// The share of recent cold placements that came back cached, and whether it has crossed
/// the threshold (with hysteresis, so it does not flap).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SharedPrefixes {
    kept: f32,
    total: f32,
    pub on: bool,
}

impl SharedPrefixes {
    /// Each placement moves the means this part of the way: they span some 32 placements.
    const WEIGHT: f32 = 1.0 / 32.0;
    /// Too few placements to tell.
    const MIN_TOTAL: f32 = 0.25;
    /// On from this share of cold placements found cached, off below the lower. Through
    /// Envoy, two replicas dealt round robin found 11 % of their first 123 cold placements
    /// cached, 43 % of the next 144; behind affinity by tenant, none of 150.
    const ON_FROM: f32 = 0.10;
    const OFF_BELOW: f32 = 0.03;
    const BYTES: usize = 9;

    /// After one more cold placement, `kept` if its answer found the prompt cached.
    pub fn observe(self, kept: bool) -> SharedPrefixes {
        let w = Self::WEIGHT;
        let kept_mean = self.kept * (1.0 - w) + if kept { w } else { 0.0 };
        let total = self.total * (1.0 - w) + w;
        let share = kept_mean / total;
        let on = match self.on {
            _ if total < Self::MIN_TOTAL => false,
            true => share >= Self::OFF_BELOW,
            false => share >= Self::ON_FROM,
        };
        SharedPrefixes {
            kept: kept_mean,
            total,
            on,
        }
    }

    /// The share of recent cold placements found cached.
    pub fn share(&self) -> f64 {
        match self.total > 0.0 {
            true => f64::from(self.kept / self.total),
            false => 0.0,
        }
    }

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..4].copy_from_slice(&self.kept.to_le_bytes());
        b[4..8].copy_from_slice(&self.total.to_le_bytes());
        b[8] = u8::from(self.on);
        b
    }

    /// Anything not written by `encode` (absent, short, not finite) reads as nothing seen.
    fn decode(b: &[u8]) -> SharedPrefixes {
        let f = |r: &[u8]| {
            <[u8; 4]>::try_from(r)
                .map(f32::from_le_bytes)
                .ok()
                .filter(|x| x.is_finite() && (0.0..=1.0).contains(x))
        };
        match (b.get(..4).and_then(f), b.get(4..8).and_then(f), b.get(8)) {
            (Some(kept), Some(total), Some(&on)) if kept <= total => SharedPrefixes {
                kept,
                total,
                on: on == 1,
            },
            _ => SharedPrefixes::default(),
        }
    }

    pub fn read<S: SharedStore + ?Sized>(s: &S, key: &str) -> Result<Self, StoreError> {
        Ok(s.get(key)?
            .0
            .map_or_else(SharedPrefixes::default, |b| Self::decode(&b)))
    }

    /// Counts one cold placement in the process-wide value; returns it as written.
    pub fn record<S: SharedStore + ?Sized>(
        s: &S,
        key: &str,
        kept: bool,
    ) -> Result<Option<Self>, StoreError> {
        store::update(s, key, |old| {
            let next = Self::decode(old).observe(kept);
            Some((next.encode().to_vec(), next))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn after(seq: impl IntoIterator<Item = bool>) -> SharedPrefixes {
        seq.into_iter()
            .fold(SharedPrefixes::default(), SharedPrefixes::observe)
    }

    #[test]
    fn cold_placements_never_found_cached_stay_off() {
        assert!(!after(std::iter::repeat_n(false, 500)).on);
    }

    #[test]
    fn one_in_five_found_cached_turns_it_on_and_it_holds() {
        let mut s = after((0..40).map(|i| i % 5 == 0));
        assert!(s.on, "share {}", s.share());
        // A quieter spell (one in twenty) keeps it on: hysteresis.
        for i in 0..60 {
            s = s.observe(i % 20 == 0);
        }
        assert!(s.on, "share {}", s.share());
        // Nothing found cached for long: off again.
        for _ in 0..200 {
            s = s.observe(false);
        }
        assert!(!s.on, "share {}", s.share());
    }

    #[test]
    fn a_few_early_hits_decide_nothing() {
        // One of the first few placements found cached (a prefix another sender shares by
        // chance) is not a fleet of replicas dealt round robin.
        assert!(!after([true, false, false]).on);
    }

    #[test]
    fn stored_values_round_trip_and_garbage_reads_as_nothing() {
        let s = MemStore::new();
        for i in 0..40 {
            SharedPrefixes::record(&s, "ns/sp", i % 3 == 0).unwrap();
        }
        let read = SharedPrefixes::read(&s, "ns/sp").unwrap();
        assert_eq!(read, after((0..40).map(|i| i % 3 == 0)));
        assert!(read.on);
        for junk in [&b""[..], &[0xff; 9][..], &[1, 2, 3][..], &[0; 4][..]] {
            s.set("ns/sp", junk, None).unwrap();
            assert_eq!(
                SharedPrefixes::read(&s, "ns/sp").unwrap(),
                SharedPrefixes::default()
            );
        }
        assert_eq!(
            SharedPrefixes::read(&s, "ns/none").unwrap(),
            SharedPrefixes::default()
        );
    }
}

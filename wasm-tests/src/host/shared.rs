//! State one [`Host`](super::Host) shares between its VMs, as Envoy shares it between
//! worker VMs: shared data (with CAS), metrics by name, and the virtual clock.
//! Shared queues are not modelled.

use std::collections::BTreeMap;

use super::abi::{MetricType, Status};

/// Virtual wall clock at host creation: 2023-11-14T22:13:20Z, in nanoseconds.
pub const EPOCH_NANOS: u64 = 1_700_000_000_000_000_000;

#[derive(Debug)]
pub(crate) struct SharedState {
    pub now_nanos: u64,
    data: BTreeMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    injected_conflicts: u32,
    pub metrics: BTreeMap<String, Metric>,
    /// `proxy_get_shared_data` calls made.
    pub reads: u64,
}

/// A metric as the host keeps it, shared by name across VMs (Envoy's `wasmcustom.<name>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Metric {
    Counter(u64),
    Gauge(i64),
    Histogram(Vec<u64>),
}

impl Metric {
    pub fn kind(&self) -> MetricType {
        match self {
            Metric::Counter(_) => MetricType::Counter,
            Metric::Gauge(_) => MetricType::Gauge,
            Metric::Histogram(_) => MetricType::Histogram,
        }
    }

    /// Counter or gauge value; `None` for a histogram.
    pub fn value(&self) -> Option<i64> {
        match self {
            Metric::Counter(v) => Some(i64::try_from(*v).unwrap_or(i64::MAX)),
            Metric::Gauge(v) => Some(*v),
            Metric::Histogram(_) => None,
        }
    }
}

impl Default for SharedState {
    fn default() -> Self {
        SharedState {
            now_nanos: EPOCH_NANOS,
            data: BTreeMap::new(),
            next_cas: 1,
            injected_conflicts: 0,
            metrics: BTreeMap::new(),
            reads: 0,
        }
    }
}

impl SharedState {
    fn bump_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        // cpp-host skips 0 on wrap: 0 means "no CAS" on the wire.
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        cas
    }

    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.data.get(key).cloned()
    }

    /// cpp-host `SharedData::set`: a conditional write (`cas != 0`) to an existing key fails
    /// on a stale CAS; a write to a missing key always succeeds. An injected conflict acts
    /// like another worker's write: it bumps the stored CAS and fails this one.
    pub fn set(&mut self, key: &str, value: Vec<u8>, cas: u32) -> Status {
        if let Some(stored_cas) = self.data.get(key).map(|(_, c)| *c) {
            if cas != 0 && self.injected_conflicts > 0 {
                self.injected_conflicts -= 1;
                let bumped = self.bump_cas();
                if let Some(entry) = self.data.get_mut(key) {
                    entry.1 = bumped;
                }
                return Status::CasMismatch;
            }
            if cas != 0 && cas != stored_cas {
                return Status::CasMismatch;
            }
        }
        let new_cas = self.bump_cas();
        self.data.insert(key.to_string(), (value, new_cas));
        Status::Ok
    }

    pub fn keys(&self) -> Vec<String> {
        self.data.keys().cloned().collect()
    }

    pub fn inject_conflicts(&mut self, n: u32) {
        self.injected_conflicts = n;
    }

    pub fn injected_conflicts_left(&self) -> u32 {
        self.injected_conflicts
    }

    /// Creates the metric on first definition; a later definition with another type keeps
    /// the first one (Envoy would create a second stat of the other type; tests don't).
    pub fn define_metric(&mut self, name: &str, kind: MetricType) {
        self.metrics
            .entry(name.to_string())
            .or_insert_with(|| match kind {
                MetricType::Counter => Metric::Counter(0),
                MetricType::Gauge => Metric::Gauge(0),
                MetricType::Histogram => Metric::Histogram(Vec::new()),
            });
    }

    /// Envoy `incrementMetric`: counters take only positive offsets, gauges any,
    /// histograms none.
    pub fn increment_metric(&mut self, name: &str, offset: i64) -> Status {
        match self.metrics.get_mut(name) {
            None => Status::NotFound,
            Some(Metric::Counter(v)) if offset > 0 => {
                *v = v.saturating_add(offset.unsigned_abs());
                Status::Ok
            }
            Some(Metric::Gauge(v)) => {
                *v = v.saturating_add(offset);
                Status::Ok
            }
            Some(_) => Status::BadArgument,
        }
    }

    /// Envoy `recordMetric`: adds to a counter, sets a gauge, records a histogram sample.
    pub fn record_metric(&mut self, name: &str, value: u64) -> Status {
        match self.metrics.get_mut(name) {
            None => Status::NotFound,
            Some(Metric::Counter(v)) => {
                *v = v.saturating_add(value);
                Status::Ok
            }
            Some(Metric::Gauge(v)) => {
                *v = i64::try_from(value).unwrap_or(i64::MAX);
                Status::Ok
            }
            Some(Metric::Histogram(samples)) => {
                samples.push(value);
                Status::Ok
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_semantics_follow_cpp_host() {
        let mut s = SharedState::default();
        // Missing key: any CAS succeeds.
        assert_eq!(s.set("k", b"a".to_vec(), 77), Status::Ok);
        let (_, cas) = s.get("k").unwrap();
        assert_eq!(s.set("k", b"b".to_vec(), cas + 1), Status::CasMismatch);
        assert_eq!(s.set("k", b"b".to_vec(), cas), Status::Ok);
        let (v, cas2) = s.get("k").unwrap();
        assert_eq!((v.as_slice(), cas2 > cas), (&b"b"[..], true));
        // Stale CAS fails, CAS 0 always wins.
        assert_eq!(s.set("k", b"c".to_vec(), cas), Status::CasMismatch);
        assert_eq!(s.set("k", b"c".to_vec(), 0), Status::Ok);
        // Injected conflicts hit conditional writes only and bump the stored CAS.
        s.inject_conflicts(1);
        let (_, cas3) = s.get("k").unwrap();
        assert_eq!(s.set("k", b"d".to_vec(), 0), Status::Ok);
        assert_eq!(s.injected_conflicts_left(), 1);
        let (_, cas4) = s.get("k").unwrap();
        assert!(cas4 > cas3);
        assert_eq!(s.set("k", b"e".to_vec(), cas4), Status::CasMismatch);
        assert_ne!(s.get("k").unwrap().1, cas4);
        let (_, cas5) = s.get("k").unwrap();
        assert_eq!(s.set("k", b"e".to_vec(), cas5), Status::Ok);
    }

    #[test]
    fn metric_rules_follow_envoy() {
        let mut s = SharedState::default();
        s.define_metric("c", MetricType::Counter);
        s.define_metric("g", MetricType::Gauge);
        s.define_metric("h", MetricType::Histogram);
        assert_eq!(s.increment_metric("c", 0), Status::BadArgument);
        assert_eq!(s.increment_metric("c", 2), Status::Ok);
        assert_eq!(s.record_metric("c", 3), Status::Ok);
        assert_eq!(s.increment_metric("g", -4), Status::Ok);
        assert_eq!(s.increment_metric("h", 1), Status::BadArgument);
        assert_eq!(s.record_metric("h", 9), Status::Ok);
        assert_eq!(s.increment_metric("nope", 1), Status::NotFound);
        assert_eq!(s.metrics["c"].value(), Some(5));
        assert_eq!(s.metrics["g"].value(), Some(-4));
        assert_eq!(s.metrics["h"], Metric::Histogram(vec![9]));
    }
}

//! Learned prefill rates while a run goes on. The convergence claim is about the
//! estimate "within 200 requests per endpoint", but the gauges read after a run show it after
//! however many samples that run gave each endpoint. [`RateWatch`] polls a gateway's admin
//! stats in a thread and keeps, per endpoint, the estimate when its TTFT samples first reach
//! a count, and the largest error from then on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

use crate::envoy::http_get;

const PREFIX: &str = "wasmcustom.tokenaware_endpoint_";

/// One endpoint's estimate from the poll where its samples first reached the count on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Reached {
    /// Samples at that poll (at least the count; polls are apart).
    pub samples: i64,
    /// Relative error then: learned / true − 1.
    pub err: f64,
    /// The largest |error| of any poll from then on, with its sign.
    pub worst_after: f64,
}

/// Per slot: (learned rate, TTFT samples), from an admin `/stats` text body.
pub fn parse_rates(body: &str, endpoints: usize) -> Vec<(Option<i64>, Option<i64>)> {
    let mut out = vec![(None, None); endpoints];
    for line in body.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some((slot, field)) = rest.split_once('_') else {
            continue;
        };
        let (Ok(slot), Ok(value)) = (slot.parse::<usize>(), value.trim().parse::<i64>()) else {
            continue;
        };
        let Some(entry) = out.get_mut(slot) else {
            continue;
        };
        match field {
            "prefill_tokens_per_s" => entry.0 = Some(value),
            "ttft_samples" => entry.1 = Some(value),
            _ => {}
        }
    }
    out
}

/// Folds one poll into the per-slot results.
pub fn observe(
    reached: &mut [Option<Reached>],
    poll: &[(Option<i64>, Option<i64>)],
    truth: &[f64],
    at_samples: i64,
) {
    for ((r, &(rate, samples)), &real) in reached.iter_mut().zip(poll).zip(truth) {
        let (Some(rate), Some(samples)) = (rate, samples) else {
            continue;
        };
        if samples < at_samples || real <= 0.0 {
            continue;
        }
        let err = rate as f64 / real - 1.0;
        match r {
            None => {
                *r = Some(Reached {
                    samples,
                    err,
                    worst_after: err,
                })
            }
            Some(r) if err.abs() > r.worst_after.abs() => r.worst_after = err,
            Some(_) => {}
        }
    }
}

/// One poll of every endpoint's estimate, for a trace of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Poll {
    /// Seconds (wall) since the watch started.
    pub t_s: f64,
    /// Per slot: the learned rate and the TTFT samples behind it.
    pub rates: Vec<(Option<i64>, Option<i64>)>,
}

/// What a watch saw: per slot the estimate at the count and the worst after it, and
/// every poll.
#[derive(Debug, Clone, Default)]
pub struct Watched {
    pub reached: Vec<Option<Reached>>,
    pub trace: Vec<Poll>,
}

/// Polls until [`RateWatch::finish`]; stops by itself after `max` in any case.
pub struct RateWatch {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Watched>>,
}

impl RateWatch {
    /// `truth[slot]`: each endpoint's real rate, in the gauge's units.
    pub fn start(
        admin_port: u16,
        truth: Vec<f64>,
        at_samples: i64,
        every: Duration,
        max: Duration,
    ) -> RateWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut seen = Watched {
                reached: vec![None; truth.len()],
                trace: Vec::new(),
            };
            let start = std::time::Instant::now();
            let deadline = start + max;
            let path = format!("/stats?filter=^{PREFIX}");
            while !flag.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                if let Ok((200, body)) = http_get(admin_port, &path) {
                    let poll = parse_rates(&body, truth.len());
                    observe(&mut seen.reached, &poll, &truth, at_samples);
                    let t_s = start.elapsed().as_secs_f64();
                    seen.trace.push(Poll { t_s, rates: poll });
                }
                std::thread::sleep(every);
            }
            seen
        });
        RateWatch {
            stop,
            handle: Some(handle),
        }
    }

    pub fn finish(mut self) -> Watched {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for RateWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_and_samples_per_slot() {
        let body = "wasmcustom.tokenaware_endpoint_0_prefill_tokens_per_s: 4000\n\
                    wasmcustom.tokenaware_endpoint_0_ttft_samples: 12\n\
                    wasmcustom.tokenaware_endpoint_1_kv_capacity_share_pct: 100\n\
                    wasmcustom.tokenaware_endpoint_1_ttft_samples: 3\n\
                    wasmcustom.tokenaware_endpoint_7_ttft_samples: 9\n\
                    wasmcustom.tokenaware_decisions_cold: 5\n";
        assert_eq!(
            parse_rates(body, 2),
            vec![(Some(4000), Some(12)), (None, Some(3))]
        );
    }

    #[test]
    fn keeps_the_first_poll_past_the_count_and_the_worst_after() {
        let truth = [1000.0, 2000.0];
        let mut r = vec![None; 2];
        observe(
            &mut r,
            &[(Some(4000), Some(150)), (Some(2000), Some(10))],
            &truth,
            200,
        );
        assert_eq!(r, vec![None, None], "under the count: nothing yet");
        observe(
            &mut r,
            &[(Some(1100), Some(205)), (None, Some(300))],
            &truth,
            200,
        );
        observe(
            &mut r,
            &[(Some(850), Some(260)), (Some(2100), Some(320))],
            &truth,
            200,
        );
        observe(
            &mut r,
            &[(Some(1050), Some(300)), (Some(1900), Some(330))],
            &truth,
            200,
        );
        let a = r[0].expect("slot 0 reached");
        assert_eq!(a.samples, 205);
        assert!((a.err - 0.10).abs() < 1e-9);
        assert!((a.worst_after + 0.15).abs() < 1e-9, "{a:?}");
        let b = r[1].expect("slot 1 reached");
        assert_eq!(b.samples, 320, "the first poll with a rate");
        assert!((b.worst_after - 0.05).abs() < 1e-9, "{b:?}");
    }
}

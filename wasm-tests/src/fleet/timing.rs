//! The simulated endpoint's timing model.
//!
//! Per endpoint, a vLLM-like step scheduler ([`super::sched`]) runs continuous batching:
//! chunked prefill of the *uncached* prompt tokens at `prefill_rate` tokens/s within a token
//! budget per step, decode steps of `decode_ms_per_token` that grow with the batch, and at
//! most `max_num_seqs` running requests with a FIFO waiting queue. The end of prefill yields
//! the first output token (TTFT = queueing + prefill). The helpers below give the unloaded
//! times. Every duration is multiplied by `time_factor`.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Prefill throughput per endpoint, tokens per second (R_peak).
    pub prefill_rate: f64,
    /// Decode time per output token, milliseconds.
    pub decode_ms_per_token: f64,
    /// Multiplier applied to every duration (0.01 = 100× faster than real time).
    pub time_factor: f64,
    /// Token budget of one scheduler step (vLLM `max-num-batched-tokens`): decode tokens
    /// first, the rest as prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Requests running at once (vLLM `max-num-seqs`); more wait in a FIFO queue.
    pub max_num_seqs: usize,
    /// Growth of a decode step's time per extra decoding request: a step with `n` decoding
    /// requests takes `decode_ms_per_token · (1 + slope · (n − 1))`.
    pub decode_batch_slope: f64,
    /// Model tokens per simulated token (the bench's scale; 1 = unscaled). A simulated
    /// token stands for `1 / token_scale` model tokens, so one decode step of the simulated
    /// token is that many model steps. A step that also prefills is one model step: its
    /// decoding requests advance `token_scale` of a token and it costs that share of a
    /// decode step (see `sched`), as in the unscaled engine.
    pub token_scale: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            prefill_rate: 20480.0,
            decode_ms_per_token: 5.0,
            time_factor: 1.0,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            decode_batch_slope: 0.005,
            token_scale: 1.0,
        }
    }
}

impl Timing {
    /// Time to prefill `uncached_tokens` tokens.
    pub fn prefill(&self, uncached_tokens: usize) -> Duration {
        if self.prefill_rate <= 0.0 {
            return Duration::ZERO;
        }
        secs(uncached_tokens as f64 / self.prefill_rate * self.time_factor)
    }

    /// Time from the first output token (end of prefill) to output token `i` (0-based).
    pub fn token_offset(&self, i: usize) -> Duration {
        secs(i as f64 * self.decode_ms_per_token / 1000.0 * self.time_factor)
    }

    /// Time from the end of prefill to the last of `output_tokens` tokens.
    pub fn decode(&self, output_tokens: usize) -> Duration {
        self.token_offset(output_tokens.saturating_sub(1))
    }

    /// Unloaded service time of a request: prefill of the uncached tokens plus decode.
    pub fn service(
        &self,
        prompt_tokens: usize,
        cached_tokens: usize,
        output_tokens: usize,
    ) -> Duration {
        self.prefill(prompt_tokens.saturating_sub(cached_tokens)) + self.decode(output_tokens)
    }
}

fn secs(s: f64) -> Duration {
    if s.is_finite() && s > 0.0 {
        Duration::from_secs_f64(s)
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cold_55k_prefill_at_default_rate() {
        let t = Timing::default();
        // 55,000 / 20,480 = 2.685546875 s
        let d = t.prefill(55_000);
        assert!((d.as_secs_f64() - 2.685_546_875).abs() < 1e-6, "{d:?}");
        // time factor scales it: 0.01 -> ~27 ms
        let fast = Timing {
            time_factor: 0.01,
            ..t
        };
        assert!((fast.prefill(55_000).as_secs_f64() - 0.026_855_468_75).abs() < 1e-6);
    }

    #[test]
    fn warm_repeat_costs_only_the_tail() {
        let t = Timing::default();
        // 55,000 tokens of which 54,992 cached (3,437 full blocks): 8 tokens to prefill.
        let warm = t.service(55_000, 54_992, 1);
        assert!(
            (warm.as_secs_f64() - 8.0 / 20480.0).abs() < 1e-9,
            "{warm:?}"
        );
        // 55k shared prefix + 1,500-token question: only the question is prefilled.
        let q = t.prefill(56_500 - 55_000);
        assert!((q.as_secs_f64() - 1500.0 / 20480.0).abs() < 1e-9);
        assert!(t.service(56_500, 55_000, 16) < t.service(56_500, 0, 16));
    }

    #[test]
    fn decode_arithmetic() {
        let t = Timing::default();
        assert_eq!(t.decode(0), Duration::ZERO);
        assert_eq!(t.decode(1), Duration::ZERO);
        assert!((t.decode(16).as_secs_f64() - 0.075).abs() < 1e-9);
        assert!((t.token_offset(4).as_secs_f64() - 0.020).abs() < 1e-9);
        let z = Timing {
            prefill_rate: 0.0,
            ..t
        };
        assert_eq!(z.prefill(1000), Duration::ZERO);
    }
}

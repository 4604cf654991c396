//! Shared fixtures for policy tests: a fleet from (matched blocks, queued tokens) pairs and a
//! request over a given chain.

use super::{Ask, Candidate, Params};
use crate::config::{GateForm, Picker, Scorer};
use crate::ledger::Load;

pub fn params() -> Params {
    Params {
        tau: 100_000.0,
        affinity_threshold: 0.8,
        gate: GateForm::Relative,
        scorer: Scorer::TokenLoad,
        picker: Picker::MaxScore,
        fallbacks: 2,
        cold_choices: 0,
        shared_prefixes: false,
    }
}

/// 1,000 tokens per block, so a 10-block chain is a 10,000-token prompt.
pub fn ask(chain: &[u64]) -> Ask<'_> {
    Ask {
        tokens: chain.len() as u64 * 1_000,
        chain,
        block_tokens: 1_000,
    }
}

pub fn fleet(spec: &[(usize, u64)]) -> Vec<Candidate> {
    spec.iter()
        .enumerate()
        .map(|(i, &(matched, tokens))| Candidate {
            id: 1000 + i as u64,
            matched_blocks: matched,
            load: Load {
                tokens,
                requests: tokens / 1_000,
                prefilling: tokens / 1_000,
            },
            work_per_s: 0,
            recalled: false,
            clock: 0,
            capacity: 1_000,
            held: 0,
            victim_idle_s: None,
            rank: None,
            idle_s: None,
            speed: 1.0,
            placed: 0.0,
        })
        .collect()
}

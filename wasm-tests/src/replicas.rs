//! Several gateways in front of one fleet: the bench's rate ladder with each stage's arrivals
//! dealt over N targets, as a balancer in front of gateway replicas would: round-robin
//! (arrival k goes to gateway k mod N) or by prefix group ([`Deal`]). The plan, the arrivals
//! and the summaries are the same as [`loadgen::ladder`]'s, so a run against N gateways
//! compares directly with a run against one.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde::Serialize;

use crate::loadgen::{self, Pace, Record, Stage, Summary, Target, Workload};

/// How a stage's arrivals are dealt over the gateways.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Deal {
    /// Arrival k to gateway k mod N: a balancer that spreads requests, so every prefix
    /// reaches every gateway.
    #[default]
    Alternate,
    /// By a hash of the arrival's prefix group: a balancer with affinity by tenant or
    /// session (a consistent hash on a header, or clients that keep their connections), so
    /// each prefix reaches one gateway.
    ByGroup,
}

impl Deal {
    /// The arrivals of a stage (by position) that gateway `g` of `n` gets.
    fn mine(self, items: &[loadgen::Item], g: usize, n: usize) -> Vec<usize> {
        match self {
            Deal::Alternate => (g..items.len()).step_by(n).collect(),
            Deal::ByGroup => (0..items.len())
                .filter(|&k| group_gateway(&items[k].group, n) == g)
                .collect(),
        }
    }
}

/// A group's gateway: the same in every run (the hasher has fixed keys).
fn group_gateway(group: &str, n: usize) -> usize {
    let mut h = DefaultHasher::new();
    group.hash(&mut h);
    (h.finish() % n.max(1) as u64) as usize
}

/// [`loadgen::ladder`] over `targets` (one per gateway), the arrivals split between them.
#[allow(clippy::too_many_arguments)]
pub async fn ladder(
    client: &reqwest::Client,
    targets: &[Target],
    workload: &Workload,
    rates: &[f64],
    stage_duration: f64,
    max_per_stage: usize,
    time_factor: f64,
    label: &str,
    deal: Deal,
    stop: impl Fn(&Summary) -> bool,
) -> Vec<Stage> {
    let arrivals: Vec<Vec<f64>> = rates
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            loadgen::poisson_arrivals(workload.seed + i as u64, r, stage_duration, max_per_stage)
        })
        .collect();
    let total: usize = arrivals.iter().map(Vec::len).sum();
    let plan = workload.plan(total);
    let n = targets.len().max(1);
    let mut out = Vec::new();
    let mut offset = 0;
    for (&rate, arr) in rates.iter().zip(&arrivals) {
        let items = &plan[offset..offset + arr.len()];
        offset += arr.len();
        let pb = loadgen::progress_bar(arr.len(), &format!("{label} @{rate}/s"));
        let runs = targets.iter().enumerate().map(|(g, target)| {
            let mine = deal.mine(items, g, n);
            let items: Vec<_> = mine.iter().map(|&k| items[k].clone()).collect();
            let pace = Pace::Open(mine.iter().map(|&k| arr[k]).collect());
            let pb = pb.clone();
            async move { loadgen::run(client, target, &items, &pace, time_factor, Some(&pb)).await }
        });
        let mut records: Vec<Record> = futures_util::future::join_all(runs)
            .await
            .into_iter()
            .flatten()
            .collect();
        records.sort_by_key(|r| r.index);
        pb.finish_and_clear();
        let summary = loadgen::summarize(&records, workload.scale);
        let halt = stop(&summary);
        out.push(Stage {
            rate,
            summary,
            records,
        });
        if halt {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::WorkloadKind;

    #[test]
    fn each_arrival_goes_to_one_gateway_and_by_group_each_group_too() {
        let items = Workload::new(WorkloadKind::B2bSaas, 0.1, 1).plan(400);
        for deal in [Deal::Alternate, Deal::ByGroup] {
            let dealt: Vec<Vec<usize>> = (0..2).map(|g| deal.mine(&items, g, 2)).collect();
            let mut all: Vec<usize> = dealt.concat();
            all.sort_unstable();
            assert_eq!(all, (0..items.len()).collect::<Vec<_>>(), "{deal:?}");
            let groups = |g: usize| -> std::collections::HashSet<&str> {
                dealt[g].iter().map(|&k| items[k].group.as_str()).collect()
            };
            let shared = groups(0).intersection(&groups(1)).count();
            match deal {
                // Round-robin: busy groups reach both gateways.
                Deal::Alternate => assert!(shared > 10, "{shared}"),
                // By group: none does, and both gateways get traffic.
                Deal::ByGroup => {
                    assert_eq!(shared, 0);
                    let sizes: Vec<usize> = dealt.iter().map(Vec::len).collect();
                    assert!(sizes.iter().all(|&n| n > 50), "{sizes:?}");
                }
            }
        }
    }
}

//! Several gateways in front of one fleet: the bench's rate ladder with each stage's arrivals
//! dealt round-robin over N targets (arrival k goes to gateway k mod N), as a client-side
//! balancer in front of gateway replicas would. The plan, the arrivals and the summaries are
//! the same as [`loadgen::ladder`]'s, so a run against N gateways compares directly with a
//! run against one.

use crate::loadgen::{self, Pace, Record, Stage, Summary, Target, Workload};

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
            let mine: Vec<usize> = (g..arr.len()).step_by(n).collect();
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

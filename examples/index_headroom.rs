//! What `indexHeadroom` buys: the affinity index filled to every endpoint's capacity with
//! distinct prompts, then asked which of the prompts it should still hold it does hold.
//! A bucket has `WAYS` entries; when a bucket's live entries outnumber its ways, one is
//! overwritten early, and the prompt it belonged to stops matching from that segment on.
//!
//! Each endpoint is sent distinct prompts of `--prompt-blocks` blocks, round-robin, until it
//! has received `--fill` times its capacity. Then every endpoint is asked about the prompts
//! the index keeps at headroom 16, the most the config allows, where a bucket practically
//! never overflows (what is left is the LRU's own choice, the same at every headroom): the
//! table shows the share of those prompts' blocks still matched at each headroom, the share
//! of the prompts still matched whole, and the index's size bound (`max_bytes`).
//!
//!     cargo run --release --example index_headroom        # the table in docs/benchmarks.md (~1 min)
//!     cargo run --release --example index_headroom -- --endpoints 20 --capacity 3125 --prompt-blocks 256 --headroom 2

use clap::Parser;
use tokenaware::index::{AffinityIndex, SEGMENT};
use tokenaware::store::MemStore;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 100)]
    endpoints: u16,
    /// Capacity per endpoint, blocks (500,000 tokens in 16-token blocks).
    #[arg(long, default_value_t = 31_250)]
    capacity: u64,
    /// Prompt lengths to try, blocks.
    #[arg(long, value_delimiter = ',', default_value = "2048,256,32")]
    prompt_blocks: Vec<usize>,
    /// Blocks sent to each endpoint, as multiples of its capacity (1: a fresh fill; more:
    /// the steady state, with expired entries in the buckets).
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    fill: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_value = "1.25,1.5,1.75,2,3")]
    headroom: Vec<f64>,
}

/// The chain hashes of prompt `id` (`n` blocks): distinct per prompt, like real ones.
fn chain(id: u64, n: usize) -> Vec<u64> {
    let mut h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            h = xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), h);
            h
        })
        .collect()
}

struct Outcome {
    /// Per endpoint, the (prompt id, matched blocks) of its last prompts.
    matched: Vec<Vec<(u64, usize)>>,
    bytes: u64,
}

/// Fills an index of `headroom` and asks each endpoint about its last `look_back` prompts.
fn run(a: &Args, prompt: usize, fill: f64, headroom: f64, look_back: usize) -> Outcome {
    let s = MemStore::new();
    let total = a.capacity * u64::from(a.endpoints);
    let ix = AffinityIndex::new("tokenaware", total, headroom);
    for slot in 0..a.endpoints {
        ix.set_capacity(&s, slot, a.capacity).ok();
    }
    let per_endpoint = ((a.capacity as f64 * fill) / prompt as f64).ceil() as u64;
    let eps = u64::from(a.endpoints);
    for k in 0..per_endpoint * eps {
        let slot = (k % eps) as u16;
        ix.insert(&s, slot, &chain(k, prompt), k as u32).ok();
    }
    let mut matched = Vec::new();
    for slot in 0..a.endpoints {
        let mut mine = Vec::new();
        for r in 0..(look_back as u64).min(per_endpoint) {
            let id = (per_endpoint - 1 - r) * eps + u64::from(slot);
            let m = ix
                .matched(&s, slot, &chain(id, prompt))
                .map(|m| m.blocks)
                .unwrap_or(0);
            mine.push((id, m));
        }
        matched.push(mine);
    }
    Outcome {
        matched,
        bytes: ix.max_bytes(u64::from(a.endpoints)),
    }
}

fn main() {
    let a = Args::parse();
    println!(
        "{} endpoints x {} blocks, {} ways per bucket, {SEGMENT}-block segments",
        a.endpoints,
        a.capacity,
        tokenaware::index::WAYS
    );
    println!("| prompt blocks | fill | headroom | index MiB | prompts checked | blocks matched | prompts whole | blocks lost |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &prompt in &a.prompt_blocks {
        let look_back = (a.capacity as usize).div_ceil(prompt) + 1;
        for &fill in &a.fill {
            // The reference: at the largest headroom the config allows, a bucket overflows
            // with odds around 1e-9.
            let reference = run(&a, prompt, fill, 16.0, look_back);
            let expected: Vec<Vec<(u64, usize)>> = reference
                .matched
                .iter()
                .map(|v| v.iter().copied().filter(|&(_, m)| m > 0).collect())
                .collect();
            let want: u64 = expected.iter().flatten().map(|&(_, m)| m as u64).sum();
            let checked = expected.iter().map(Vec::len).sum::<usize>();
            for &h in &a.headroom {
                let o = run(&a, prompt, fill, h, look_back);
                let mut got = 0u64;
                let mut whole = 0usize;
                for (exp, act) in expected.iter().zip(&o.matched) {
                    for &(id, m) in exp {
                        let n = act
                            .iter()
                            .find(|(x, _)| *x == id)
                            .map_or(0, |&(_, n)| n.min(m));
                        got += n as u64;
                        whole += usize::from(n == m);
                    }
                }
                println!(
                    "| {prompt} | {fill} | {h} | {:.1} | {checked} | {:.2} % | {:.2} % | {:.2} % |",
                    o.bytes as f64 / (1024.0 * 1024.0),
                    100.0 * got as f64 / want.max(1) as f64,
                    100.0 * whole as f64 / checked.max(1) as f64,
                    100.0 * (want - got) as f64 / want.max(1) as f64,
                );
            }
        }
    }
}

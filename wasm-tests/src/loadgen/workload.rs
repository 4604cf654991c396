//! Workload shapes (DESIGN.md "Workloads", llm-d's inference-perf configs) and the seeded,
//! deterministic request plan each one yields.
//!
//! Token counts are model tokens; [`Workload::scale`] multiplies every one of them (prompt
//! parts and outputs) so a run fits a small machine. Prompt text is 4 bytes per token (the
//! fleet and the filter both estimate tokens as bytes / 4), made of seeded pseudo-words, and
//! every distinct part (a group's system prompt, a question) starts with its own tag, so two
//! parts share no 16-token block by accident.

use std::collections::HashMap;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bytes of prompt text per model token (what the fleet and the filter assume).
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkloadKind {
    /// The seed's simulation: 40 groups, Zipf(1.1), 55,000-token prefix + 1,500-token question.
    SeedSim,
    /// Multi-turn coding sessions: 3k–100k-token system prompts (mean ≈55k), context grows by
    /// turn (≈1,500 in / 800 out per turn).
    CodeGeneration,
    /// Decode-bound: 250-token shared prompt, ≈1,000 in, ≈8,000 out.
    Reasoning,
    /// llm-d's shared_prefix: 150 system prompts of 6,000 tokens × 5 questions of 1,200,
    /// 1,000 out, shuffled once and cycled.
    B2bSaas,
    /// Code-generation and reasoning interleaved, the mix shifting every [`MIX_PHASE`]
    /// requests between mostly one and mostly the other (issue 7's unknown bottleneck).
    /// Opt-in: not in [`WorkloadKind::ALL`], the full benchmark's set.
    Mixed,
}

impl WorkloadKind {
    /// The full benchmark's workloads.
    pub const ALL: [WorkloadKind; 4] = [
        WorkloadKind::SeedSim,
        WorkloadKind::CodeGeneration,
        WorkloadKind::Reasoning,
        WorkloadKind::B2bSaas,
    ];
    /// Every workload, the opt-in ones included.
    pub const EVERY: [WorkloadKind; 5] = [
        WorkloadKind::SeedSim,
        WorkloadKind::CodeGeneration,
        WorkloadKind::Reasoning,
        WorkloadKind::B2bSaas,
        WorkloadKind::Mixed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SeedSim => "seed-sim",
            WorkloadKind::CodeGeneration => "code-generation",
            WorkloadKind::Reasoning => "reasoning",
            WorkloadKind::B2bSaas => "b2b-saas",
            WorkloadKind::Mixed => "mixed",
        }
    }

    pub fn parse(s: &str) -> Option<WorkloadKind> {
        Self::EVERY.into_iter().find(|k| k.name() == s)
    }

    /// Endpoints the workload is defined for.
    pub fn endpoints(self) -> usize {
        match self {
            WorkloadKind::SeedSim => 10,
            _ => 8,
        }
    }

    /// KV capacity per endpoint in model tokens: the seed's 4 × 65,536 for seed-sim, llm-d's
    /// 307,328 tokens per pod for the others.
    pub fn kv_tokens(self) -> usize {
        match self {
            WorkloadKind::SeedSim => 4 * 65_536,
            _ => 307_328,
        }
    }

    /// Mean prompt length in model tokens (for the SLO: twice its cold fill).
    pub fn mean_prompt_tokens(self) -> f64 {
        match self {
            WorkloadKind::SeedSim => 56_500.0,
            // mean system 55k + on average ~3 turns of history (1,500 + 800) + the question
            WorkloadKind::CodeGeneration => 55_000.0 + 2.5 * 2_300.0 + 1_500.0,
            WorkloadKind::Reasoning => 1_250.0,
            WorkloadKind::B2bSaas => 7_200.0,
            // Half of each over a whole number of phase pairs.
            WorkloadKind::Mixed => {
                0.5 * (WorkloadKind::CodeGeneration.mean_prompt_tokens()
                    + WorkloadKind::Reasoning.mean_prompt_tokens())
            }
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One request of a plan.
#[derive(Debug, Clone)]
pub struct Item {
    /// Position in the plan.
    pub index: usize,
    /// Value of `x-prefix-group` (the naive affinity key a user would configure).
    pub group: String,
    /// Chat messages (role, content); contents are shared between items where the workload
    /// shares them.
    pub messages: Vec<(&'static str, Arc<str>)>,
    /// Output tokens requested (scaled, at least 1).
    pub max_tokens: usize,
    /// Prompt tokens as the fleet estimates them (bytes / 4, roles included).
    pub prompt_tokens: usize,
}

impl Item {
    /// The streaming chat/completions body.
    pub fn body(&self, model: &str) -> String {
        let msgs: Vec<serde_json::Value> = self
            .messages
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": &**c}))
            .collect();
        serde_json::json!({
            "model": model,
            "messages": msgs,
            "max_tokens": self.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        })
        .to_string()
    }
}

/// A workload with its scale and seed; [`Workload::plan`] yields its request sequence.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub kind: WorkloadKind,
    /// Multiplier on every token count (0 < scale ≤ 1).
    pub scale: f64,
    pub seed: u64,
    /// seed-sim: prefix groups (default [`SEED_GROUPS`]; more than the fleet's cache holds
    /// is the cache correction's hard case).
    pub groups: usize,
}

/// Largest output the fleet generates (its `max_tokens` cap).
pub const MAX_OUTPUT_TOKENS: usize = crate::fleet::openai::MAX_TOKENS_CAP;

impl Workload {
    pub fn new(kind: WorkloadKind, scale: f64, seed: u64) -> Self {
        Self {
            kind,
            scale,
            seed,
            groups: SEED_GROUPS,
        }
    }

    /// The same workload over `groups` seed-sim prefix groups (at least one).
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups.max(1);
        self
    }

    fn tokens(&self, model_tokens: f64) -> usize {
        ((model_tokens * self.scale).round() as usize).max(1)
    }

    /// The first `n` requests. Item i is the same for every `n > i` (a prefix-stable plan),
    /// and depends only on the kind, scale and seed.
    pub fn plan(&self, n: usize) -> Vec<Item> {
        let mut g = Gen::new(*self);
        (0..n).map(|i| g.next(i)).collect()
    }
}

/// The plan's generator state.
struct Gen {
    w: Workload,
    rng: ChaCha8Rng,
    texts: HashMap<String, Arc<str>>,
    /// seed-sim: cumulative Zipf weights.
    zipf_cdf: Vec<f64>,
    /// b2b-saas: the shuffled (group, question) order.
    order: Vec<(usize, usize)>,
    /// code-generation: the active conversations.
    convs: Vec<Conv>,
    next_conv: usize,
}

struct Conv {
    id: usize,
    system: Arc<str>,
    history: Vec<(&'static str, Arc<str>)>,
    turn: usize,
    turns: usize,
}

/// mixed: requests per phase; phases alternate between [`MIX_MAJOR`] code-generation and
/// [`MIX_MAJOR`] reasoning.
pub const MIX_PHASE: usize = 32;
/// mixed: the majority kind's share within a phase.
pub const MIX_MAJOR: f64 = 0.8;

/// Active conversations of code-generation (inference-perf's catalog: 20).
pub const CODEGEN_CONVERSATIONS: usize = 20;
/// seed-sim groups and Zipf exponent.
pub const SEED_GROUPS: usize = 40;
pub const SEED_ZIPF: f64 = 1.1;
/// Output tokens of a seed-sim request (the seed's simulation ignores decode).
pub const SEED_OUTPUT_TOKENS: f64 = 16.0;

impl Gen {
    fn new(w: Workload) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed ^ PLAN_SEED_MIX);
        let weights: Vec<f64> = (1..=w.groups)
            .map(|k| 1.0 / (k as f64).powf(SEED_ZIPF))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let zipf_cdf = weights
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        let mut order = Vec::new();
        if w.kind == WorkloadKind::B2bSaas {
            order = (0..150).flat_map(|g| (0..5).map(move |q| (g, q))).collect();
            // Fisher–Yates with the seeded stream (shuffled once, then cycled).
            for i in (1..order.len()).rev() {
                let j = rng.gen_range(0..=i);
                order.swap(i, j);
            }
        }
        Self {
            w,
            rng,
            texts: HashMap::new(),
            zipf_cdf,
            order,
            convs: Vec::new(),
            next_conv: 0,
        }
    }

    /// A cached text part of `tokens` (scaled) tokens named `tag`.
    fn text(&mut self, tag: &str, tokens: usize) -> Arc<str> {
        let seed = self.w.seed;
        self.texts
            .entry(tag.to_string())
            .or_insert_with(|| text(seed, tag, tokens).into())
            .clone()
    }

    /// The kind of request `index` is: the workload's own, or for mixed a draw weighted by
    /// the phase `index` falls in.
    fn kind_of(&mut self, index: usize) -> WorkloadKind {
        if self.w.kind != WorkloadKind::Mixed {
            return self.w.kind;
        }
        let code_phase = (index / MIX_PHASE).is_multiple_of(2);
        let major = self.rng.gen_bool(MIX_MAJOR);
        if code_phase == major {
            WorkloadKind::CodeGeneration
        } else {
            WorkloadKind::Reasoning
        }
    }

    fn next(&mut self, index: usize) -> Item {
        let (group, messages, out) = match self.kind_of(index) {
            WorkloadKind::SeedSim => {
                let u: f64 = self.rng.gen();
                let g = self
                    .zipf_cdf
                    .iter()
                    .position(|&c| u < c)
                    .unwrap_or(self.w.groups - 1);
                let sys = self.text(&format!("seed-group-{g}"), self.w.tokens(55_000.0));
                let q = text(
                    self.w.seed,
                    &format!("seed-q-{index}"),
                    self.w.tokens(1_500.0),
                );
                (
                    format!("g{g}"),
                    vec![("system", sys), ("user", q.into())],
                    self.w.tokens(SEED_OUTPUT_TOKENS),
                )
            }
            WorkloadKind::B2bSaas => {
                let (g, q) = self.order[index % self.order.len()];
                let sys = self.text(&format!("b2b-sys-{g}"), self.w.tokens(6_000.0));
                let qt = self.text(&format!("b2b-q-{g}-{q}"), self.w.tokens(1_200.0));
                (
                    format!("g{g}"),
                    vec![("system", sys), ("user", qt)],
                    self.w.tokens(1_000.0),
                )
            }
            WorkloadKind::Reasoning => {
                let sys = self.text("reasoning-shared", self.w.tokens(250.0));
                let n_in = lognormal(&mut self.rng, 1_000.0, 800.0).clamp(100.0, 5_000.0);
                let n_out = lognormal(&mut self.rng, 8_000.0, 6_500.0).clamp(500.0, 32_000.0);
                let q = text(
                    self.w.seed,
                    &format!("reasoning-q-{index}"),
                    self.w.tokens(n_in),
                );
                (
                    format!("r{index}"),
                    vec![("system", sys), ("user", q.into())],
                    self.w.tokens(n_out),
                )
            }
            WorkloadKind::CodeGeneration | WorkloadKind::Mixed => self.codegen_turn(),
        };
        let max_tokens = out.clamp(1, MAX_OUTPUT_TOKENS);
        let prompt_bytes: usize = messages.iter().map(|(r, c)| r.len() + c.len() + 2).sum();
        Item {
            index,
            group,
            messages,
            max_tokens,
            prompt_tokens: prompt_bytes.div_ceil(BYTES_PER_TOKEN),
        }
    }

    fn new_conv(&mut self) -> Conv {
        let id = self.next_conv;
        self.next_conv += 1;
        // 3,000 tokens shared by every conversation, then its own part: 3k–100k in all.
        let total = self.rng.gen_range(10_000.0..100_000.0f64);
        let shared = self.text("codegen-shared", self.w.tokens(3_000.0));
        let own = text(
            self.w.seed,
            &format!("codegen-sys-{id}"),
            self.w.tokens(total - 3_000.0),
        );
        let turns = normal(&mut self.rng, 6.0, 3.5).round().clamp(2.0, 20.0) as usize;
        let mut system = String::with_capacity(shared.len() + own.len());
        system.push_str(&shared);
        system.push_str(&own);
        Conv {
            id,
            system: system.into(),
            history: Vec::new(),
            turn: 0,
            turns,
        }
    }

    fn codegen_turn(&mut self) -> (String, Vec<(&'static str, Arc<str>)>, usize) {
        while self.convs.len() < CODEGEN_CONVERSATIONS {
            let c = self.new_conv();
            self.convs.push(c);
        }
        let k = self.rng.gen_range(0..self.convs.len());
        let n_in = lognormal(&mut self.rng, 1_500.0, 1_200.0).clamp(100.0, 10_000.0);
        let n_out = lognormal(&mut self.rng, 800.0, 600.0).clamp(50.0, 4_000.0);
        let (seed, scale) = (self.w.seed, self.w);
        let c = &mut self.convs[k];
        let q: Arc<str> = text(
            seed,
            &format!("codegen-q-{}-{}", c.id, c.turn),
            scale.tokens(n_in),
        )
        .into();
        let out = scale.tokens(n_out).clamp(1, MAX_OUTPUT_TOKENS);
        let mut messages = vec![("system", c.system.clone())];
        messages.extend(c.history.iter().cloned());
        messages.push(("user", q.clone()));
        // The next turn sees this question and an answer of the requested length (its own
        // deterministic text: the cache keys on what the client sends back).
        let a: Arc<str> = text(seed, &format!("codegen-a-{}-{}", c.id, c.turn), out).into();
        c.history.push(("user", q));
        c.history.push(("assistant", a));
        c.turn += 1;
        let group = format!("c{}", c.id);
        if c.turn >= c.turns {
            self.convs.swap_remove(k);
        }
        (group, messages, out)
    }
}

/// A fixed constant mixed into the plan's seed (the arrivals use another).
const PLAN_SEED_MIX: u64 = 0x5eed_0f91_a000_0001;

const WORDS: [&str; 16] = [
    "fn ", "let ", "mut ", "impl ", "trait ", "self ", "match ", "loop ", "data ", "user ",
    "cache ", "token ", "route ", "model ", "query ", "value ",
];

/// Deterministic text of exactly `tokens × 4` bytes for (`seed`, `tag`): `[tag] ` then seeded
/// pseudo-words.
pub fn text(seed: u64, tag: &str, tokens: usize) -> String {
    let len = tokens * BYTES_PER_TOKEN;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(seed, tag), &mut h);
    let mut rng = ChaCha8Rng::seed_from_u64(std::hash::Hasher::finish(&h));
    let mut s = String::with_capacity(len + 8);
    s.push('[');
    s.push_str(tag);
    s.push_str("] ");
    while s.len() < len {
        let r: u64 = rng.gen();
        for i in 0..8 {
            s.push_str(WORDS[((r >> (i * 4)) & 15) as usize]);
        }
        s.push_str(&format!("{:x} ", r >> 32));
    }
    s.truncate(len);
    s
}

/// Normal sample (Box–Muller).
pub fn normal(rng: &mut impl Rng, mean: f64, sd: f64) -> f64 {
    let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.gen();
    mean + sd * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Lognormal sample with the given mean and standard deviation (of the variable itself).
pub fn lognormal(rng: &mut impl Rng, mean: f64, sd: f64) -> f64 {
    let s2 = (1.0 + (sd * sd) / (mean * mean)).ln();
    let mu = mean.ln() - s2 / 2.0;
    normal(rng, mu, s2.sqrt()).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(items: &[Item]) -> Vec<String> {
        items.iter().map(|i| i.group.clone()).collect()
    }

    #[test]
    fn plans_are_deterministic_and_prefix_stable() {
        for kind in WorkloadKind::EVERY {
            let w = Workload::new(kind, 0.01, 7);
            let a = w.plan(40);
            let b = w.plan(60);
            assert_eq!(groups(&a), groups(&b[..40]), "{kind}");
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.body("m"), y.body("m"), "{kind}");
            }
            let other = Workload::new(kind, 0.01, 8).plan(40);
            assert_ne!(
                a.iter().map(|i| i.body("m")).collect::<Vec<_>>(),
                other.iter().map(|i| i.body("m")).collect::<Vec<_>>(),
                "{kind}: another seed gives another plan"
            );
        }
    }

    #[test]
    fn text_has_exact_length_and_tag() {
        let t = text(1, "x", 100);
        assert_eq!(t.len(), 400);
        assert!(t.starts_with("[x] "));
        assert_eq!(t, text(1, "x", 100));
        assert_ne!(t, text(1, "y", 100));
    }

    #[test]
    fn seed_sim_shape() {
        let items = Workload::new(WorkloadKind::SeedSim, 0.1, 1).plan(4000);
        // 5,500 + 150 tokens of text (scaled 0.1) plus role names.
        let t = items[0].prompt_tokens;
        assert!((5_650..5_660).contains(&t), "{t}");
        // Zipf(1.1) over 40 groups: the hottest ≈ 27.2 %.
        let hot = items.iter().filter(|i| i.group == "g0").count() as f64 / 4000.0;
        assert!((0.25..0.295).contains(&hot), "hottest group share {hot}");
        let distinct: std::collections::BTreeSet<_> = items.iter().map(|i| &i.group).collect();
        assert!(distinct.len() >= 35);
        // Same group, same system prompt; questions differ.
        let g0: Vec<&Item> = items.iter().filter(|i| i.group == "g0").take(2).collect();
        assert!(Arc::ptr_eq(&g0[0].messages[0].1, &g0[1].messages[0].1));
        assert_ne!(g0[0].messages[1].1, g0[1].messages[1].1);
        // Over 60 groups the hottest share falls (≈ 25.3 %) and the tail reaches past 40.
        let items = Workload::new(WorkloadKind::SeedSim, 0.1, 1)
            .with_groups(60)
            .plan(4000);
        let hot = items.iter().filter(|i| i.group == "g0").count() as f64 / 4000.0;
        assert!((0.23..0.275).contains(&hot), "hottest group share {hot}");
        let past_40 = items
            .iter()
            .filter(|i| i.group[1..].parse::<usize>().is_ok_and(|g| g >= 40))
            .count();
        assert!(past_40 > 150, "{past_40} requests in groups 40-59");
    }

    #[test]
    fn b2b_saas_shape() {
        let items = Workload::new(WorkloadKind::B2bSaas, 1.0, 3).plan(1500);
        assert_eq!(items[0].max_tokens, 1_000);
        assert_eq!(items[0].messages[0].1.len(), 24_000);
        assert_eq!(items[0].messages[1].1.len(), 4_800);
        // 750 distinct prompts, each once per cycle, then the same order again.
        let first: std::collections::BTreeSet<String> =
            items[..750].iter().map(|i| i.body("m")).collect();
        assert_eq!(first.len(), 750);
        assert_eq!(items[3].body("m"), items[753].body("m"));
        let g: std::collections::BTreeSet<_> = items[..750].iter().map(|i| &i.group).collect();
        assert_eq!(g.len(), 150);
    }

    #[test]
    fn code_generation_context_grows_by_turn() {
        let items = Workload::new(WorkloadKind::CodeGeneration, 0.1, 5).plan(400);
        let mut by_conv: HashMap<&str, Vec<&Item>> = HashMap::new();
        for i in &items {
            by_conv.entry(&i.group).or_default().push(i);
        }
        let mut multi = 0;
        for turns in by_conv.values() {
            assert!(turns.len() <= 20);
            for w in turns.windows(2) {
                // The later turn's messages extend the earlier one's (prefix property).
                let (a, b) = (w[0], w[1]);
                assert_eq!(b.messages.len(), a.messages.len() + 2);
                assert_eq!(&b.messages[..a.messages.len()], &a.messages[..]);
                assert!(b.prompt_tokens > a.prompt_tokens);
                multi += 1;
            }
            // System prompt 3k–100k tokens (scaled 0.1).
            let sys = turns[0].messages[0].1.len() / BYTES_PER_TOKEN;
            assert!((1_000..=10_000).contains(&sys), "{sys}");
        }
        assert!(multi > 100);
        let mean_sys: f64 = by_conv
            .values()
            .map(|t| t[0].messages[0].1.len() as f64 / 4.0)
            .sum::<f64>()
            / by_conv.len() as f64;
        assert!(
            (4_000.0..7_000.0).contains(&mean_sys),
            "mean system {mean_sys}"
        );
    }

    #[test]
    fn reasoning_shape() {
        let items = Workload::new(WorkloadKind::Reasoning, 0.1, 2).plan(2000);
        let mean_out = items.iter().map(|i| i.max_tokens as f64).sum::<f64>() / items.len() as f64;
        let mean_in = items.iter().map(|i| i.prompt_tokens as f64).sum::<f64>() / 2000.0;
        assert!((650.0..900.0).contains(&mean_out), "mean out {mean_out}");
        assert!((90.0..140.0).contains(&mean_in), "mean in {mean_in}");
        assert!(Arc::ptr_eq(
            &items[0].messages[0].1,
            &items[1].messages[0].1
        ));
    }

    #[test]
    fn mixed_interleaves_and_shifts_by_phase() {
        let items = Workload::new(WorkloadKind::Mixed, 0.05, 4).plan(8 * MIX_PHASE);
        let reasoning = |i: &Item| i.group.starts_with('r');
        for (p, phase) in items.chunks(MIX_PHASE).enumerate() {
            let r = phase.iter().filter(|i| reasoning(i)).count();
            // Each phase holds both kinds, mostly the phase's own.
            if p.is_multiple_of(2) {
                assert!(r > 0 && r < MIX_PHASE / 2, "phase {p}: {r} reasoning");
            } else {
                assert!(
                    r > MIX_PHASE / 2 && r < MIX_PHASE,
                    "phase {p}: {r} reasoning"
                );
            }
        }
        // The code-generation part still grows its conversations turn by turn.
        let mut last: HashMap<&str, usize> = HashMap::new();
        for i in items.iter().filter(|i| !reasoning(i)) {
            if let Some(prev) = last.insert(&i.group, i.prompt_tokens) {
                assert!(i.prompt_tokens > prev, "{}", i.group);
            }
        }
        assert!(items.iter().any(|i| reasoning(i) && i.max_tokens >= 100));
    }

    #[test]
    fn names_round_trip() {
        for k in WorkloadKind::EVERY {
            assert_eq!(WorkloadKind::parse(k.name()), Some(k));
        }
        assert_eq!(WorkloadKind::parse("nope"), None);
    }
}

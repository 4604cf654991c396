//! Tolerant Prometheus text-format reader for the few vLLM / SGLang `/metrics` series the router
//! uses: queue depth, running requests, KV usage, KV geometry and prefix-cache counters.
//! It is not a general exposition parser: it ignores types, HELP text, timestamps and every
//! other metric; lines it cannot read are skipped. It never panics and never allocates.

/// Load and cache signals scraped from one model server. `None` means "not reported".
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerMetrics {
    /// `vllm:num_requests_running` | `sglang:num_running_reqs` (summed over series).
    pub running: Option<f64>,
    /// `vllm:num_requests_waiting` | `sglang:num_queue_reqs` (summed over series).
    pub waiting: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (or `vllm:gpu_cache_usage_perc`) | `sglang:token_usage`;
    /// fraction in 0..=1, max over series.
    pub kv_usage: Option<f64>,
    /// `block_size` label of `vllm:cache_config_info` | `sglang:page_size`.
    pub block_size: Option<f64>,
    /// `num_gpu_blocks` label of `vllm:cache_config_info` | `sglang:num_pages`, else
    /// `sglang:max_total_num_tokens / sglang:page_size`.
    pub num_gpu_blocks: Option<f64>,
    /// `vllm:prefix_cache_queries_total` (older: `vllm:gpu_prefix_cache_queries_total`).
    pub prefix_queries: Option<f64>,
    /// `vllm:prefix_cache_hits_total` (older: `vllm:gpu_prefix_cache_hits_total`).
    pub prefix_hits: Option<f64>,
}

/// Reads at most `max_bytes` of `text`; when that cuts the input, the partial last line is dropped.
pub fn parse_metrics(text: &[u8], max_bytes: usize) -> ServerMetrics {
    let mut acc = Acc::default();
    for line in window(text, max_bytes).split(|&b| b == b'\n') {
        if let Some(sample) = parse_line(line) {
            acc.add(&sample);
        }
    }
    acc.finish()
}

/// The complete lines within the first `max_bytes`.
fn window(text: &[u8], max_bytes: usize) -> &[u8] {
    let Some(head) = text.get(..max_bytes) else {
        return text;
    };
    if text.get(max_bytes) == Some(&b'\n') || head.len() == text.len() {
        return head;
    }
    // A cut line could turn `12` into `1`: better to not see it at all.
    match head.iter().rposition(|&b| b == b'\n') {
        Some(i) => head.get(..i).unwrap_or_default(),
        None => &[],
    }
}

/// One sample line: metric name, the raw text between `{` and `}`, and a finite value ≥ 0.
struct Sample<'a> {
    name: &'a [u8],
    labels: &'a [u8],
    value: f64,
}

fn parse_line(line: &[u8]) -> Option<Sample<'_>> {
    let line = trim_start(line.strip_suffix(b"\r").unwrap_or(line));
    if line.first().is_none_or(|&b| b == b'#') {
        return None;
    }
    let name_len = line
        .iter()
        .position(|&b| b == b'{' || b == b' ' || b == b'\t')?;
    let (name, rest) = line.split_at(name_len);
    let (labels, rest) = match rest.strip_prefix(b"{") {
        Some(inner) => {
            let close = closing_brace(inner)?;
            let (labels, after) = inner.split_at(close);
            (labels, after.get(1..)?)
        }
        None => (&[][..], rest),
    };
    let rest = trim_start(rest);
    let token_len = rest
        .iter()
        .position(|&b| b == b' ' || b == b'\t')
        .unwrap_or(rest.len());
    let value = parse_f64(rest.get(..token_len)?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    s.get(n..).unwrap_or_default()
}

/// Finite, non-negative numbers only: NaN, ±Inf and negatives carry no usable load signal.
fn parse_f64(token: &[u8]) -> Option<f64> {
    let v: f64 = std::str::from_utf8(token).ok()?.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// Index of the `}` that closes a label set, skipping quoted values with escapes.
fn closing_brace(s: &[u8]) -> Option<usize> {
    let (mut in_quotes, mut escaped) = (false, false);
    for (i, &b) in s.iter().enumerate() {
        match (in_quotes, escaped, b) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => in_quotes = false,
            (false, _, b'"') => in_quotes = true,
            (false, _, b'}') => return Some(i),
            _ => {}
        }
    }
    None
}

/// Raw (still escaped) value of label `want` in a label set, if present.
fn label<'a>(labels: &'a [u8], want: &[u8]) -> Option<&'a [u8]> {
    let mut rest = labels;
    loop {
        rest = trim_start(rest);
        rest = rest.strip_prefix(b",").map_or(rest, trim_start);
        let eq = rest.iter().position(|&b| b == b'=')?;
        let (name, after) = rest.split_at(eq);
        let after = trim_start(after.get(1..)?).strip_prefix(b"\"")?;
        let end = closing_quote(after)?;
        let (value, tail) = after.split_at(end);
        if trim_end(name) == want {
            return Some(value);
        }
        rest = tail.get(1..)?;
    }
}

fn trim_end(s: &[u8]) -> &[u8] {
    let n = s
        .iter()
        .rev()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count();
    s.get(..s.len() - n).unwrap_or_default()
}

fn closing_quote(s: &[u8]) -> Option<usize> {
    let mut escaped = false;
    for (i, &b) in s.iter().enumerate() {
        match (escaped, b) {
            (true, _) => escaped = false,
            (false, b'\\') => escaped = true,
            (false, b'"') => return Some(i),
            _ => {}
        }
    }
    None
}

/// Running aggregation; old vLLM counter names are kept apart so a server exporting both
/// names during a deprecation window is not counted twice.
#[derive(Default)]
struct Acc {
    m: ServerMetrics,
    old_queries: Option<f64>,
    old_hits: Option<f64>,
    sglang_max_tokens: Option<f64>,
}

fn sum(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.unwrap_or(0.0) + v);
}

fn max(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.map_or(v, |s| s.max(v)));
}

/// KV geometry: zero is "not known yet", and would divide by zero downstream.
fn max_positive(slot: &mut Option<f64>, v: f64) {
    if v > 0.0 {
        max(slot, v);
    }
}

impl Acc {
    fn add(&mut self, s: &Sample<'_>) {
        let m = &mut self.m;
        match s.name {
            b"vllm:num_requests_running" | b"sglang:num_running_reqs" => {
                sum(&mut m.running, s.value)
            }
            b"vllm:num_requests_waiting" | b"sglang:num_queue_reqs" => sum(&mut m.waiting, s.value),
            b"vllm:kv_cache_usage_perc" | b"vllm:gpu_cache_usage_perc" | b"sglang:token_usage" => {
                max(&mut m.kv_usage, s.value.min(1.0))
            }
            b"vllm:cache_config_info" => self.cache_config(s.labels),
            b"sglang:page_size" => max_positive(&mut m.block_size, s.value),
            b"sglang:num_pages" => max_positive(&mut m.num_gpu_blocks, s.value),
            b"sglang:max_total_num_tokens" => max_positive(&mut self.sglang_max_tokens, s.value),
            b"vllm:prefix_cache_queries_total" => sum(&mut m.prefix_queries, s.value),
            b"vllm:prefix_cache_hits_total" => sum(&mut m.prefix_hits, s.value),
            b"vllm:gpu_prefix_cache_queries_total" => sum(&mut self.old_queries, s.value),
            b"vllm:gpu_prefix_cache_hits_total" => sum(&mut self.old_hits, s.value),
            _ => {}
        }
    }

    /// vLLM reports its cache geometry as labels of an info gauge whose value is always 1.
    fn cache_config(&mut self, labels: &[u8]) {
        if let Some(v) = label(labels, b"block_size").and_then(parse_f64) {
            max_positive(&mut self.m.block_size, v);
        }
        if let Some(v) = label(labels, b"num_gpu_blocks").and_then(parse_f64) {
            max_positive(&mut self.m.num_gpu_blocks, v);
        }
    }

    fn finish(self) -> ServerMetrics {
        let mut m = self.m;
        m.prefix_queries = m.prefix_queries.or(self.old_queries);
        m.prefix_hits = m.prefix_hits.or(self.old_hits);
        if m.num_gpu_blocks.is_none() {
            if let (Some(tokens), Some(page)) = (self.sglang_max_tokens, m.block_size) {
                m.num_gpu_blocks = Some((tokens / page).floor());
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0 1712345678000
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.2e+06
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 600000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.5
# HELP vllm:cache_config_info Information of the LLMCache
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27298",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"#;

    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B",tp_rank="0"} 0.61
sglang:cache_hit_rate{model_name="Qwen/Qwen3-8B",tp_rank="0"} 0.33
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="Qwen/Qwen3-8B",tp_rank="0"} 471264.0
# TYPE sglang:page_size gauge
sglang:page_size{model_name="Qwen/Qwen3-8B",tp_rank="0"} 16.0
"#;

    #[test]
    fn vllm_sample() {
        let m = parse_metrics(VLLM.as_bytes(), usize::MAX);
        assert_eq!(m.running, Some(5.0));
        assert_eq!(m.waiting, Some(5.0));
        assert_eq!(m.kv_usage, Some(0.5));
        assert_eq!(m.block_size, Some(16.0));
        assert_eq!(m.num_gpu_blocks, Some(27298.0));
        assert_eq!(m.prefix_queries, Some(1.2e6));
        assert_eq!(m.prefix_hits, Some(600000.0));
    }

    #[test]
    fn sglang_sample() {
        let m = parse_metrics(SGLANG.as_bytes(), usize::MAX);
        assert_eq!(m.running, Some(7.0));
        assert_eq!(m.waiting, Some(2.0));
        assert_eq!(m.kv_usage, Some(0.61));
        assert_eq!(m.block_size, Some(16.0));
        assert_eq!(m.num_gpu_blocks, Some(29454.0));
        assert_eq!(m.prefix_queries, None);
        let with_pages = format!("{SGLANG}sglang:num_pages{{tp_rank=\"0\"}} 29000\n");
        assert_eq!(
            parse_metrics(with_pages.as_bytes(), usize::MAX).num_gpu_blocks,
            Some(29000.0)
        );
    }

    #[test]
    fn old_names_and_no_double_count() {
        let text = "vllm:gpu_cache_usage_perc 0.3\nvllm:gpu_prefix_cache_queries_total 10\n\
                    vllm:gpu_prefix_cache_hits_total 4\n";
        let m = parse_metrics(text.as_bytes(), usize::MAX);
        assert_eq!(
            (m.kv_usage, m.prefix_queries, m.prefix_hits),
            (Some(0.3), Some(10.0), Some(4.0))
        );
        let both = format!("{text}vllm:prefix_cache_queries_total 10\n");
        assert_eq!(
            parse_metrics(both.as_bytes(), usize::MAX).prefix_queries,
            Some(10.0)
        );
    }

    #[test]
    fn escaped_labels_and_odd_spacing() {
        let text = "vllm:cache_config_info{note=\"a \\\"}\\\", b=\\\\\",block_size = \"32\" , \
                    num_gpu_blocks=\"100\",} 1\r\n  vllm:num_requests_running\t 2 123\n";
        let m = parse_metrics(text.as_bytes(), usize::MAX);
        assert_eq!(m.block_size, Some(32.0));
        assert_eq!(m.num_gpu_blocks, Some(100.0));
        assert_eq!(m.running, Some(2.0));
    }

    #[test]
    fn bad_values_ignored() {
        let text = "vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n\
                    vllm:kv_cache_usage_perc -0.5\nvllm:num_requests_running -Inf\n\
                    vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"None\"} 1\n";
        assert_eq!(
            parse_metrics(text.as_bytes(), usize::MAX),
            ServerMetrics::default()
        );
    }

    #[test]
    fn garbage_is_skipped() {
        let text = b"\xff\xfe{{{\n}}} 1\nvllm:num_requests_running{a=\"x 3\n\
                     vllm:num_requests_waiting 2\n# vllm:num_requests_running 9\nnovalue\n";
        let m = parse_metrics(text, usize::MAX);
        assert_eq!((m.running, m.waiting), (None, Some(2.0)));
        assert_eq!(parse_metrics(b"", 10), ServerMetrics::default());
    }

    #[test]
    fn truncation_drops_partial_line() {
        let text = b"vllm:num_requests_waiting 2\nvllm:num_requests_running 12\n";
        let cut = text.len() - 2; // "...running 1"
        let m = parse_metrics(text, cut);
        assert_eq!((m.running, m.waiting), (None, Some(2.0)));
        assert_eq!(parse_metrics(text, text.len() - 1).running, Some(12.0));
        assert_eq!(parse_metrics(text, 5), ServerMetrics::default());
        assert_eq!(parse_metrics(&text[..cut], usize::MAX).running, Some(1.0));
    }

    #[test]
    fn huge_input_is_bounded() {
        let mut text = b"vllm:num_requests_running 1\n".to_vec();
        while text.len() < 5 * 1024 * 1024 {
            text.extend_from_slice(b"vllm:num_requests_waiting{x=\"y\"} 1\n");
        }
        let m = parse_metrics(&text, 1024);
        assert_eq!(m.running, Some(1.0));
        assert!(m.waiting.unwrap_or(0.0) < 40.0);
        let all = parse_metrics(&text, usize::MAX).waiting.unwrap_or(0.0);
        assert!(all > 100_000.0);
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(
                text in proptest::collection::vec(any::<u8>(), 0..1024), max in 0usize..2048
            ) {
                let m = parse_metrics(&text, max);
                prop_assert!(m.kv_usage.is_none_or(|v| (0.0..=1.0).contains(&v)));
            }

            #[test]
            fn mutated_samples_never_panic(at in any::<prop::sample::Index>(), byte in any::<u8>()) {
                let mut text = VLLM.as_bytes().to_vec();
                let i = at.index(text.len());
                text[i] = byte;
                let _ = parse_metrics(&text, usize::MAX);
                text.truncate(i);
                let _ = parse_metrics(&text, i / 2);
            }
        }
    }
}

//! Plugin configuration: the JSON an operator writes, its defaults (llm-d's where llm-d has
//! one), and validation whose errors name the field and its allowed range. Knows nothing of
//! Envoy; the wasm layer hands it the plugin configuration bytes.

use serde::Deserialize;

include!(concat!(env!("OUT_DIR"), "/presets.rs"));

/// A calibrated peak prefill throughput for one model on one accelerator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub model: &'static str,
    pub accelerator: &'static str,
    pub engine: &'static str,
    pub tensor_parallel: u32,
    pub peak_prefill_tokens_per_s: f64,
    pub chunk_tokens: u32,
}

pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    RoundRobin,
    LeastLoad,
    AlwaysSticky,
    StickyUntilSaturated,
    Tokenaware,
}

impl PolicyName {
    pub const ALL: [PolicyName; 5] = [
        PolicyName::RoundRobin,
        PolicyName::LeastLoad,
        PolicyName::AlwaysSticky,
        PolicyName::StickyUntilSaturated,
        PolicyName::Tokenaware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::RoundRobin => "round-robin",
            PolicyName::LeastLoad => "least-load",
            PolicyName::AlwaysSticky => "always-sticky",
            PolicyName::StickyUntilSaturated => "sticky-until-saturated",
            PolicyName::Tokenaware => "tokenaware",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyName> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// Which saturation test breaks stickiness (see `policy::gate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GateForm {
    /// llm-d today: least-loaded warm minus least-loaded cold exceeds τ.
    Relative,
    /// The seeds' simulation: least-loaded warm exceeds τ.
    Absolute,
}

/// What the final pick minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scorer {
    /// Prefill-bound traffic: uncached tokens in flight plus this request's uncached tokens.
    TokenLoad,
    /// Decode-bound traffic: active requests, then token cost.
    ActiveRequest,
    /// Unknown or shifting bottleneck: predicted TTFT (the learned predictor's).
    Latency,
}

/// How the final pick is made among the scored endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Picker {
    /// The best score (llm-d's max-score-picker); ties rotate.
    MaxScore,
    /// Weighted random by score (llm-d's weighted-random-picker): spreads load within the set.
    WeightedRandom,
}

/// Where the affinity gate's TTFT comes from (llm-d's `ttftSource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TtftSource {
    /// Queued uncached tokens over R_peak.
    PrefillThroughput,
    /// The TTFT predictor learned in-line from observed first-byte times.
    LatencyPredictor,
}

/// `peakPrefillThroughput`: tokens per second; or `"auto"` to learn it per endpoint,
/// starting from the preset (or llm-d's default); or `{"auto": 20480}` to learn it starting
/// from the given value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PeakPrefill {
    TokensPerSecond(f64),
    Auto { initial: Option<f64> },
}

impl<'de> Deserialize<'de> for PeakPrefill {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct AutoFrom {
            auto: f64,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
            Object(AutoFrom),
        }
        match Raw::deserialize(d)? {
            Raw::Number(x) => Ok(PeakPrefill::TokensPerSecond(x)),
            Raw::Object(a) => Ok(PeakPrefill::Auto {
                initial: Some(a.auto),
            }),
            Raw::Text(t) if t == "auto" => Ok(PeakPrefill::Auto { initial: None }),
            Raw::Text(t) => Err(serde::de::Error::custom(format!(
                "{t:?}: expected tokens per second or \"auto\""
            ))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` as Envoy's override_host expects it.
    pub address: String,
    /// KV capacity in tokens; defaults to the global `kvCapacityTokens`.
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Envoy cluster that reaches Envoy's own admin interface.
    pub admin_cluster: String,
    /// Name of the model-server cluster in `/clusters?format=json`.
    pub model_cluster: String,
    #[serde(default = "default_discovery_interval_ms")]
    pub interval_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetricsConfig {
    /// Cluster the poll goes through (the model-server cluster, with override_host).
    pub cluster: String,
    #[serde(default = "default_metrics_path")]
    pub path: String,
    #[serde(default = "default_metrics_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "default_metrics_timeout_ms")]
    pub timeout_ms: u64,
    /// Scraped samples older than this are ignored.
    #[serde(default = "default_metrics_stale_ms")]
    pub stale_after_ms: u64,
}

/// Other gateway replicas whose new placements this one learns (see `peers`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PeersConfig {
    /// One Envoy cluster per peer replica; each is polled at `path`. Or, instead:
    #[serde(default)]
    pub clusters: Vec<String>,
    /// One Envoy cluster whose hosts are all the replicas (this one among them), e.g. DNS
    /// of a headless Service: its hosts are read from Envoy's admin `/clusters` through
    /// `adminCluster`, and each is polled pinned by the override_host header.
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default)]
    pub admin_cluster: Option<String>,
    /// With `cluster`: how often its hosts are read from admin (default
    /// `DEFAULT_MEMBERS_INTERVAL_MS`).
    #[serde(default)]
    pub members_interval_ms: Option<u64>,
    /// The path this gateway answers peers' polls on, and polls them at.
    #[serde(default = "default_peers_path")]
    pub path: String,
    #[serde(default = "default_peers_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "default_peers_timeout_ms")]
    pub timeout_ms: u64,
    /// The replicas' shared secret: sent with every poll, and asked of every poll answered.
    /// After parsing it is always set (from `tokenEnv` when that is given instead).
    #[serde(default)]
    pub token: Option<PeerToken>,
    /// The name of an environment variable of the VM (Envoy's
    /// `vm_config.environment_variables`) that holds the token, so it can come from a secret.
    #[serde(default)]
    pub token_env: Option<String>,
}

/// The peers' shared secret. Never printed: `Debug` shows only its length.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct PeerToken(String);

/// Shortest and longest token accepted, in bytes.
pub const PEER_TOKEN_LEN: (usize, usize) = (16, 256);

impl PeerToken {
    /// A token of 16-256 visible ASCII characters (it travels as a header value).
    pub fn new(s: &str) -> Option<PeerToken> {
        let (lo, hi) = PEER_TOKEN_LEN;
        let ok = (lo..=hi).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic());
        ok.then(|| PeerToken(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this token. Takes the same time wherever the two differ, so an
    /// asker cannot find the token a byte at a time.
    pub fn admits(&self, given: &[u8]) -> bool {
        let want = self.0.as_bytes();
        given.len() == want.len()
            && given
                .iter()
                .zip(want)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for PeerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerToken(<{} bytes>)", self.0.len())
    }
}

impl PeersConfig {
    /// Sets `token` from `tokenEnv`'s variable, when that is how it was given.
    fn resolve_token(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let Some(name) = &self.token_env else {
            return Ok(());
        };
        let value = env(name).ok_or_else(|| {
            err(
                "peers.tokenEnv",
                format!(
                    "`{name}` is not set in the VM's environment (vm_config.environment_variables)"
                ),
            )
        })?;
        let token = PeerToken::new(value.trim())
            .ok_or_else(|| err("peers.tokenEnv", format!("`{name}`: {}", token_form())))?;
        self.token = Some(token);
        Ok(())
    }
}

fn token_form() -> String {
    let (lo, hi) = PEER_TOKEN_LEN;
    format!("must be {lo} to {hi} visible ASCII characters (no spaces)")
}

/// Most peer clusters polled.
pub const MAX_PEERS: usize = 16;

/// The whole plugin configuration. Field names are camelCase in JSON.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Config {
    pub policy: PolicyName,
    pub gate: GateForm,
    pub scorer: Scorer,
    /// Match ratio at or above which an endpoint is warm.
    pub affinity_threshold: f64,
    /// R_peak, prefill tokens per second per endpoint, or `"auto"` (learned per endpoint).
    pub peak_prefill_throughput: Option<PeakPrefill>,
    /// Source of the affinity gate's TTFT.
    pub ttft_source: TtftSource,
    pub picker: Picker,
    /// Name of a calibrated preset supplying R_peak when it is not given.
    pub preset: Option<String>,
    /// T_max: tolerated TTFT penalty, ms. τ = R_peak × T_max.
    #[serde(rename = "maxTTFTPenaltyMs")]
    pub max_ttft_penalty_ms: f64,
    /// τ in tokens, given directly; overrides R_peak × T_max.
    pub tau: Option<u64>,
    pub bytes_per_token: f64,
    pub block_size_tokens: u32,
    pub max_prefix_blocks: u32,
    /// Default KV capacity per endpoint, tokens.
    pub kv_capacity_tokens: u64,
    pub max_endpoints: u32,
    pub endpoints: Vec<EndpointConfig>,
    pub discovery: Option<DiscoveryConfig>,
    pub metrics: Option<MetricsConfig>,
    /// Replicas of this gateway to exchange new placements with; off when absent.
    pub peers: Option<PeersConfig>,
    /// Request paths that are routed; others pass untouched.
    pub routes: Vec<String>,
    pub max_body_bytes: u64,
    /// Next-best endpoints handed to override_host after the pick.
    pub fallbacks: u32,
    /// How many endpoints a cold prefix may be placed on: the first N by rendezvous on its
    /// first block, so gateway replicas, which share no tables, tend to agree. Absent: two
    /// while the servers show other senders and `peers` is not set, else any endpoint (the
    /// best balance for one gateway).
    pub cold_placement_choices: Option<u32>,
    /// Adds `x-tokenaware-decision` to responses.
    pub decision_header: bool,
    /// Path answering with the tables as JSON; off when absent.
    pub debug_path: Option<String>,
    /// A ledger entry never released (a crashed VM) expires after this long.
    #[serde(rename = "requestTTLSeconds")]
    pub request_ttl_seconds: u64,
    /// Prefix of every shared-data key (Istio leaves vm_id empty, so VMs of different
    /// plugins could otherwise meet).
    pub namespace: String,
    /// Index slots per bucket × buckets are sized from capacity × this headroom. The default,
    /// 2, is the smallest that loses under 1 % of the blocks held to bucket collisions (see
    /// `index::tests::default_headroom_loses_under_one_percent`).
    pub index_headroom: f64,
    /// How old a shared-data read may be when a decision uses it again, ms (0: read every
    /// time). Other workers' writes show this much late; this VM's own at once.
    pub shared_read_max_age_ms: u64,
    /// How long stats updates are held before they reach Envoy, ms (0: every update at
    /// once). Held updates go out on the first tick this long after the last flush, so a
    /// request makes no stats hostcalls (about 20 µs a request in Envoy).
    pub stats_flush_ms: u64,
}

fn default_discovery_interval_ms() -> u64 {
    2_000
}
fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_metrics_interval_ms() -> u64 {
    500
}
fn default_metrics_timeout_ms() -> u64 {
    300
}
fn default_metrics_stale_ms() -> u64 {
    5_000
}
fn default_peers_path() -> String {
    "/tokenaware/peers".into()
}
/// How often `peers.cluster`'s hosts are read from admin, unless configured.
pub const DEFAULT_MEMBERS_INTERVAL_MS: u64 = 5_000;

impl PeersConfig {
    /// How often `cluster`'s hosts are read from admin.
    pub fn members_interval_ms(&self) -> u64 {
        self.members_interval_ms
            .unwrap_or(DEFAULT_MEMBERS_INTERVAL_MS)
    }
}

fn default_peers_interval_ms() -> u64 {
    500
}
fn default_peers_timeout_ms() -> u64 {
    1_000
}

pub const DEFAULT_PEAK_PREFILL: f64 = 15_928.0;

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: PolicyName::Tokenaware,
            gate: GateForm::Relative,
            scorer: Scorer::TokenLoad,
            affinity_threshold: 0.8,
            peak_prefill_throughput: None,
            ttft_source: TtftSource::PrefillThroughput,
            picker: Picker::MaxScore,
            preset: None,
            max_ttft_penalty_ms: 18_000.0,
            tau: None,
            bytes_per_token: 4.0,
            block_size_tokens: 64,
            max_prefix_blocks: 2_048,
            kv_capacity_tokens: 500_000,
            max_endpoints: 64,
            endpoints: Vec::new(),
            discovery: None,
            metrics: None,
            peers: None,
            routes: vec![
                "/v1/completions".into(),
                "/v1/chat/completions".into(),
                "/v1/responses".into(),
            ],
            max_body_bytes: 4 * 1024 * 1024,
            fallbacks: 2,
            cold_placement_choices: None,
            decision_header: false,
            debug_path: None,
            request_ttl_seconds: 600,
            namespace: "tokenaware".into(),
            index_headroom: 2.0,
            shared_read_max_age_ms: 5,
            stats_flush_ms: 1_000,
        }
    }
}

/// A configuration error: the field (JSON name) and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid tokenaware config: field `{}`: {}",
            self.field, self.problem
        )
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

fn check_range(field: &str, v: f64, lo: f64, hi: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        Err(err(field, format!("{v} is outside [{lo}, {hi}]")))
    }
}

impl Config {
    /// Parses and validates, reading `peers.tokenEnv` from the process (the VM's)
    /// environment. Empty input means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        Config::from_json_in(bytes, &|name| std::env::var(name).ok())
    }

    /// [`Config::from_json`] with the environment given as a lookup.
    pub fn from_json_in(
        bytes: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut cfg: Config = if bytes.iter().all(u8::is_ascii_whitespace) {
            Config::default()
        } else {
            serde_json::from_slice(bytes).map_err(|e| serde_field_error(bytes, &e))?
        };
        cfg.canonical_addresses();
        cfg.validate()?;
        if let Some(p) = cfg.peers.as_mut() {
            p.resolve_token(env)?;
        }
        Ok(cfg)
    }

    /// Static addresses as Envoy writes `upstream.address` (IPv6 lowercase, zeros compressed:
    /// `[FE80:0::1]:80` is `[fe80::1]:80`), so that an answer is known for the endpoint's.
    /// What is no address is left for `validate` to name.
    fn canonical_addresses(&mut self) {
        for e in &mut self.endpoints {
            if let Ok(a) = e.address.parse::<std::net::SocketAddr>() {
                e.address = a.to_string();
            }
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        check_range("affinityThreshold", self.affinity_threshold, 0.0, 1.0)?;
        if let Some(n) = self.cold_placement_choices {
            check_range("coldPlacementChoices", n.into(), 1.0, 65_536.0)?;
        }
        check_range("maxTTFTPenaltyMs", self.max_ttft_penalty_ms, 0.0, 3.6e6)?;
        check_range("bytesPerToken", self.bytes_per_token, 0.5, 64.0)?;
        check_range(
            "blockSizeTokens",
            self.block_size_tokens.into(),
            1.0,
            65_536.0,
        )?;
        check_range(
            "maxPrefixBlocks",
            self.max_prefix_blocks.into(),
            1.0,
            65_536.0,
        )?;
        check_range(
            "kvCapacityTokens",
            self.kv_capacity_tokens as f64,
            1.0,
            1e12,
        )?;
        check_range("maxEndpoints", self.max_endpoints.into(), 1.0, 4_096.0)?;
        // 64 MiB is some 16M tokens, past any model's context. The VM holds the body and
        // the prompt read from it (about as much again), in memory it never gives back.
        check_range(
            "maxBodyBytes",
            self.max_body_bytes as f64,
            1.0,
            67_108_864.0,
        )?;
        check_range("fallbacks", self.fallbacks.into(), 0.0, 8.0)?;
        check_range(
            "requestTTLSeconds",
            self.request_ttl_seconds as f64,
            1.0,
            86_400.0,
        )?;
        check_range("indexHeadroom", self.index_headroom, 1.0, 16.0)?;
        check_range(
            "sharedReadMaxAgeMs",
            self.shared_read_max_age_ms as f64,
            0.0,
            1_000.0,
        )?;
        check_range("statsFlushMs", self.stats_flush_ms as f64, 0.0, 60_000.0)?;
        if let Some(
            PeakPrefill::TokensPerSecond(r)
            | PeakPrefill::Auto {
                initial: Some(r), ..
            },
        ) = self.peak_prefill_throughput
        {
            check_range("peakPrefillThroughput", r, 1.0, 1e9)?;
        }
        if let Some(t) = self.tau {
            check_range("tau", t as f64, 0.0, 1e12)?;
        }
        if let Some(p) = &self.preset {
            if preset(p).is_none() {
                let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
                return Err(err(
                    "preset",
                    format!("unknown preset {p:?}; known: {}", names.join(", ")),
                ));
            }
        }
        if self.namespace.is_empty() || self.namespace.len() > 64 {
            return Err(err("namespace", "must be 1 to 64 characters"));
        }
        if self.endpoints.len() > self.max_endpoints as usize {
            return Err(err(
                "endpoints",
                format!("more than maxEndpoints ({})", self.max_endpoints),
            ));
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            if !is_host_port(&e.address) {
                return Err(err(
                    &format!("endpoints[{i}].address"),
                    format!("{:?} is not ip:port", e.address),
                ));
            }
            if let Some(c) = e.kv_capacity_tokens {
                check_range(
                    &format!("endpoints[{i}].kvCapacityTokens"),
                    c as f64,
                    1.0,
                    1e12,
                )?;
            }
        }
        if self.routes.iter().any(|r| !r.starts_with('/')) {
            return Err(err("routes", "every route must start with '/'"));
        }
        if let Some(m) = &self.metrics {
            check_range("metrics.intervalMs", m.interval_ms as f64, 10.0, 3.6e6)?;
            check_range("metrics.timeoutMs", m.timeout_ms as f64, 1.0, 60_000.0)?;
            if m.cluster.is_empty() {
                return Err(err("metrics.cluster", "must not be empty"));
            }
            if !m.path.starts_with('/') {
                return Err(err("metrics.path", "must start with '/'"));
            }
            // A sample must stay fresh until the next poll has had its time to answer, or the
            // scraped load (and what reads it) switches off for part of every interval.
            let fresh_for = (m.interval_ms + m.timeout_ms) as f64;
            check_range(
                "metrics.staleAfterMs",
                m.stale_after_ms as f64,
                fresh_for,
                fresh_for.max(3.6e6),
            )?;
        }
        if let Some(d) = &self.discovery {
            check_range("discovery.intervalMs", d.interval_ms as f64, 10.0, 3.6e6)?;
            if d.admin_cluster.is_empty() || d.model_cluster.is_empty() {
                return Err(err(
                    "discovery",
                    "adminCluster and modelCluster must not be empty",
                ));
            }
        }
        if self.endpoints.is_empty() && self.discovery.is_none() {
            return Err(err(
                "endpoints",
                "give a static list of endpoints or a `discovery` section",
            ));
        }
        if self
            .debug_path
            .as_deref()
            .is_some_and(|p| !p.starts_with('/'))
        {
            return Err(err("debugPath", "must start with '/'"));
        }
        if self
            .debug_path
            .as_deref()
            .is_some_and(|p| self.is_routed_path(p))
        {
            // It is answered before routing: every inference request would get the tables.
            return Err(err("debugPath", "must differ from the routed paths"));
        }
        if self.scorer == Scorer::Latency && self.ttft_source != TtftSource::LatencyPredictor {
            return Err(err(
                "scorer",
                "`latency` scores by the learned TTFT predictor: set ttftSource to latencyPredictor",
            ));
        }
        if let Some(p) = &self.peers {
            self.validate_peers(p)?;
        }
        Ok(())
    }

    /// Either a list of clusters, one a replica, or one cluster of all replicas read
    /// through Envoy's admin.
    fn validate_peer_clusters(&self, p: &PeersConfig) -> Result<(), ConfigError> {
        match &p.cluster {
            None if p.clusters.is_empty() || p.clusters.len() > MAX_PEERS => Err(err(
                "peers.clusters",
                format!("give 1 to {MAX_PEERS} clusters, or one `cluster` of all replicas"),
            )),
            None if p.clusters.iter().any(|c| c.is_empty()) => {
                Err(err("peers.clusters", "a cluster name is empty"))
            }
            None if p.admin_cluster.is_some() => Err(err(
                "peers.adminCluster",
                "only with `cluster` (the hosts of `clusters` are not read)",
            )),
            None if p.members_interval_ms.is_some() => Err(err(
                "peers.membersIntervalMs",
                "only with `cluster` (the hosts of `clusters` are not read)",
            )),
            None => Ok(()),
            Some(_) if !p.clusters.is_empty() => Err(err(
                "peers.cluster",
                "give `clusters` or `cluster`, not both",
            )),
            Some(c) if c.is_empty() => Err(err("peers.cluster", "is empty")),
            Some(_) if p.admin_cluster.as_deref().is_none_or(str::is_empty) => Err(err(
                "peers.adminCluster",
                "name the cluster that reaches Envoy's admin (to read `cluster`'s hosts)",
            )),
            Some(_) => Ok(()),
        }
    }

    fn validate_peers(&self, p: &PeersConfig) -> Result<(), ConfigError> {
        check_range("peers.intervalMs", p.interval_ms as f64, 10.0, 3.6e6)?;
        check_range("peers.timeoutMs", p.timeout_ms as f64, 1.0, 60_000.0)?;
        let members = p.members_interval_ms() as f64;
        check_range("peers.membersIntervalMs", members, 100.0, 3.6e6)?;
        self.validate_peer_clusters(p)?;
        if !p.path.starts_with('/') || p.path.contains('?') {
            return Err(err("peers.path", "must start with '/' and have no query"));
        }
        if self.debug_path.as_deref() == Some(p.path.as_str()) || self.is_routed_path(&p.path) {
            return Err(err(
                "peers.path",
                "must differ from debugPath and the routed paths",
            ));
        }
        match (&p.token, &p.token_env) {
            (None, None) | (Some(_), Some(_)) => Err(err(
                "peers.token",
                "give the replicas' shared secret as `token` or name its variable in `tokenEnv` (one of the two)",
            )),
            (Some(t), None) if PeerToken::new(t.as_str()).is_none() => {
                Err(err("peers.token", token_form()))
            }
            (None, Some(v)) if v.is_empty() => Err(err("peers.tokenEnv", "is empty")),
            _ => Ok(()),
        }
    }

    /// R_peak in tokens/s: explicit value, else the preset's, else llm-d's default. With
    /// `"auto"` this is the starting point the estimator learns from.
    pub fn peak_prefill(&self) -> f64 {
        let explicit = match self.peak_prefill_throughput {
            Some(PeakPrefill::TokensPerSecond(r) | PeakPrefill::Auto { initial: Some(r) }) => {
                Some(r)
            }
            _ => None,
        };
        explicit
            .or_else(|| {
                self.preset
                    .as_deref()
                    .and_then(preset)
                    .map(|p| p.peak_prefill_tokens_per_s)
            })
            .unwrap_or(DEFAULT_PEAK_PREFILL)
    }

    /// Routing uses per-endpoint learned estimates (R_peak `"auto"`, or the latency
    /// predictor as the TTFT source).
    pub fn learns(&self) -> bool {
        matches!(self.peak_prefill_throughput, Some(PeakPrefill::Auto { .. }))
            || self.ttft_source == TtftSource::LatencyPredictor
    }

    /// τ in tokens: given directly, or R_peak × T_max.
    pub fn tau_tokens(&self) -> f64 {
        match self.tau {
            Some(t) => t as f64,
            None => self.peak_prefill() * self.max_ttft_penalty_ms / 1000.0,
        }
    }

    /// Bytes of canonical prompt per hashed block.
    pub fn block_bytes(&self) -> usize {
        ((self.block_size_tokens as f64 * self.bytes_per_token).round() as usize).max(1)
    }

    /// KV capacity in index blocks for a capacity in tokens.
    pub fn capacity_blocks(&self, kv_tokens: u64) -> u64 {
        (kv_tokens / u64::from(self.block_size_tokens.max(1))).max(1)
    }

    /// A server's own KV capacity (from its metrics) in index blocks, counted up to what the
    /// whole index was sized for (`kvCapacityTokens` × `maxEndpoints`): a server that reports
    /// more cannot hold entries the bucket table has no room for.
    pub fn scraped_capacity_blocks(&self, kv_tokens: u64) -> u64 {
        let room = self
            .capacity_blocks(self.kv_capacity_tokens)
            .saturating_mul(u64::from(self.max_endpoints));
        self.capacity_blocks(kv_tokens).min(room)
    }

    pub fn is_routed_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.routes.iter().any(|r| r == path)
    }
}

fn is_host_port(s: &str) -> bool {
    s.parse::<std::net::SocketAddr>().is_ok()
}

/// serde does not say which field a type error is in: find it by deserializing each top-level
/// field alone (config time only, never per request).
fn serde_field_error(bytes: &[u8], e: &serde_json::Error) -> ConfigError {
    let fallback = || err("(json)", e.to_string());
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(bytes)
    else {
        return fallback();
    };
    for (k, v) in map {
        let mut one = serde_json::Map::new();
        one.insert(k.clone(), v);
        if let Err(inner) = serde_json::from_value::<Config>(serde_json::Value::Object(one)) {
            return err(&k, inner.to_string());
        }
    }
    fallback()
}
#[cfg(test)]
mod tests {
    use super::*;

    fn with_endpoints(extra: &str) -> String {
        format!(r#"{{"endpoints":[{{"address":"127.0.0.1:8001"}}]{extra}}}"#)
    }

    #[test]
    fn static_addresses_are_written_as_envoy_writes_them() {
        let json = r#"{"endpoints":[{"address":"[FE80:0:0::1]:8000"},{"address":"10.0.0.1:80"}]}"#;
        let c = Config::from_json(json.as_bytes()).unwrap();
        let addresses: Vec<&str> = c.endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["[fe80::1]:8000", "10.0.0.1:80"]);
    }

    #[test]
    fn defaults_give_llm_d_tau() {
        let c = Config::from_json(with_endpoints("").as_bytes()).unwrap();
        assert_eq!(c.tau_tokens().round() as u64, 286_704);
        assert_eq!(c.affinity_threshold, 0.8);
        assert_eq!(c.policy, PolicyName::Tokenaware);
        assert_eq!(c.block_bytes(), 256);
    }

    #[test]
    fn a_servers_reported_capacity_counts_up_to_the_indexs_room() {
        let c = Config::from_json(
            with_endpoints(r#","kvCapacityTokens":100000,"maxEndpoints":4,"blockSizeTokens":64"#)
                .as_bytes(),
        )
        .unwrap();
        // 1,562 blocks an endpoint, four endpoints.
        assert_eq!(c.scraped_capacity_blocks(320_000), 5_000);
        // More than four endpoints' worth, or a nonsense figure: the whole index, no more.
        assert_eq!(c.scraped_capacity_blocks(10_000_000), 6_248);
        assert_eq!(c.scraped_capacity_blocks(f64::INFINITY as u64), 6_248);
        assert_eq!(c.scraped_capacity_blocks(6_400), 100);
    }

    #[test]
    fn explicit_tau_and_preset() {
        let c = Config::from_json(with_endpoints(r#","tau":50000"#).as_bytes()).unwrap();
        assert_eq!(c.tau_tokens(), 50_000.0);
        let c = Config::from_json(
            with_endpoints(r#","preset":"qwen3-32b-h100-tp2-blog","maxTTFTPenaltyMs":14000"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(c.tau_tokens().round() as u64, 286_720);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#","affinityThreshold":1.5"#, "affinityThreshold"),
            (r#","debugPath":"/v1/chat/completions""#, "debugPath"),
            (r#","scorer":"latency""#, "scorer"),
            (
                r#","metrics":{"cluster":"m","path":"metrics"}"#,
                "metrics.path",
            ),
            (
                r#","metrics":{"cluster":"m","intervalMs":10000}"#,
                "metrics.staleAfterMs",
            ),
            (
                r#","metrics":{"cluster":"m","staleAfterMs":0}"#,
                "metrics.staleAfterMs",
            ),
            (r#","maxBodyBytes":67108865"#, "maxBodyBytes"),
            (r#","preset":"nope""#, "preset"),
            (r#","bogus":1"#, "bogus"),
            (r#","policy":"fastest""#, "policy"),
            (r#","maxTTFTPenaltyMs":-1"#, "maxTTFTPenaltyMs"),
            (r#","coldPlacementChoices":0"#, "coldPlacementChoices"),
            (r#","peers":{"clusters":[]}"#, "peers.clusters"),
            (r#","peers":{}"#, "peers.clusters"),
            (
                r#","peers":{"clusters":["b"],"cluster":"all"}"#,
                "peers.cluster",
            ),
            (r#","peers":{"cluster":"all"}"#, "peers.adminCluster"),
            (
                r#","peers":{"clusters":["b"],"adminCluster":"admin"}"#,
                "peers.adminCluster",
            ),
            (r#","peers":{"clusters":[""]}"#, "peers.clusters"),
            (
                r#","peers":{"clusters":["b"],"intervalMs":0}"#,
                "peers.intervalMs",
            ),
            (
                r#","peers":{"clusters":["b"],"membersIntervalMs":1000}"#,
                "peers.membersIntervalMs",
            ),
            (
                r#","peers":{"cluster":"all","adminCluster":"admin","token":"0123456789abcdef","membersIntervalMs":50}"#,
                "peers.membersIntervalMs",
            ),
            (
                r#","peers":{"clusters":["b"],"path":"peers"}"#,
                "peers.path",
            ),
            (
                r#","peers":{"clusters":["b"],"path":"/v1/chat/completions"}"#,
                "peers.path",
            ),
            (
                r#","debugPath":"/d","peers":{"clusters":["b"],"path":"/d"}"#,
                "peers.path",
            ),
            (r#","peers":{"clusters":["b"]}"#, "peers.token"),
            (
                r#","peers":{"clusters":["b"],"token":"too-short"}"#,
                "peers.token",
            ),
            (
                r#","peers":{"clusters":["b"],"token":"sixteen chars or more"}"#,
                "peers.token",
            ),
            (
                r#","peers":{"clusters":["b"],"token":"0123456789abcdef","tokenEnv":"T"}"#,
                "peers.token",
            ),
            (
                r#","peers":{"clusters":["b"],"tokenEnv":""}"#,
                "peers.tokenEnv",
            ),
        ];
        for (extra, field) in cases {
            let e = Config::from_json(with_endpoints(extra).as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{extra}: {e}");
        }
        let e = Config::from_json(br#"{"endpoints":[{"address":"nohost"}]}"#).unwrap_err();
        assert_eq!(e.field, "endpoints[0].address");
        let e = Config::from_json(b"").unwrap_err();
        assert_eq!(e.field, "endpoints");
    }

    #[test]
    fn the_peer_token_comes_inline_or_from_the_environment() {
        let inline = with_endpoints(r#","peers":{"clusters":["b"],"token":"0123456789abcdef"}"#);
        let c = Config::from_json(inline.as_bytes()).unwrap();
        let t = c.peers.as_ref().and_then(|p| p.token.clone()).unwrap();
        assert!(t.admits(b"0123456789abcdef"));
        assert!(!t.admits(b"0123456789abcdeF"));
        assert!(!t.admits(b"0123456789abcdef0"));
        assert!(!t.admits(b""));
        // Never printed, whatever prints the config.
        assert!(!format!("{c:?}").contains("0123456789abcdef"));
        let by_env = with_endpoints(r#","peers":{"clusters":["b"],"tokenEnv":"PEER_SECRET"}"#);
        let env = |k: &str| (k == "PEER_SECRET").then(|| " fedcba9876543210\n".to_string());
        let c = Config::from_json_in(by_env.as_bytes(), &env).unwrap();
        let t = c.peers.and_then(|p| p.token).unwrap();
        assert!(t.admits(b"fedcba9876543210"));
        let e = Config::from_json_in(by_env.as_bytes(), &|_| None).unwrap_err();
        assert_eq!(e.field, "peers.tokenEnv");
        assert!(e.problem.contains("PEER_SECRET"), "{e}");
        let e = Config::from_json_in(by_env.as_bytes(), &|_| Some("short".into())).unwrap_err();
        assert_eq!(e.field, "peers.tokenEnv");
        assert!(!e.problem.contains("short"), "the value is not echoed: {e}");
    }

    #[test]
    fn auto_rate_and_latency_configuration() {
        let c = Config::from_json(
            with_endpoints(
                r#","peakPrefillThroughput":"auto","preset":"qwen3-32b-h100-tp2","ttftSource":"latencyPredictor","scorer":"latency","picker":"weighted-random""#,
            )
            .as_bytes(),
        )
        .unwrap();
        assert!(c.learns());
        assert_eq!(c.peak_prefill(), 15_928.0);
        assert_eq!(c.picker, Picker::WeightedRandom);
        let e = Config::from_json(with_endpoints(r#","peakPrefillThroughput":"fast""#).as_bytes())
            .unwrap_err();
        assert_eq!(e.field, "peakPrefillThroughput");
        let c = Config::from_json(
            with_endpoints(r#","peakPrefillThroughput":{"auto":5000}"#).as_bytes(),
        )
        .unwrap();
        assert!(c.learns());
        assert_eq!(c.peak_prefill(), 5_000.0);
        assert!(!Config::from_json(with_endpoints("").as_bytes())
            .unwrap()
            .learns());
    }

    #[test]
    fn presets_compiled_in() {
        assert!(PRESETS.len() >= 8);
        assert_eq!(
            preset("qwen3-32b-h100-tp2")
                .unwrap()
                .peak_prefill_tokens_per_s,
            15_928.0
        );
    }

    #[test]
    fn routed_paths_ignore_query() {
        let c = Config::from_json(with_endpoints("").as_bytes()).unwrap();
        assert!(c.is_routed_path("/v1/chat/completions?x=1"));
        assert!(!c.is_routed_path("/v1/models"));
    }
}

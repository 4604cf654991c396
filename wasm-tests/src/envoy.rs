//! Envoy harness: render `envoy/gateway.yaml.tmpl`, run Envoy as a child process, wait for
//! its admin `/ready`, kill it on drop.
//!
//! ```no_run
//! use wasm_tests::envoy::{Envoy, GatewayConfig};
//! let cfg = GatewayConfig::new(["127.0.0.1:8000", "127.0.0.1:8001"])
//!     .with_wasm("target/wasm32-wasip1/release/tokenaware.wasm", r#"{"endpoints":[]}"#);
//! let envoy = Envoy::start(cfg)?;          // free ports picked, bounded wait for /ready
//! let (status, body) = envoy.admin_get("/clusters?format=json")?;
//! println!("{}", envoy.url("/v1/completions"));
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! The Envoy binary is `$ENVOY_BIN`, else the one `scripts/setup.sh` installs under
//! `.venv` (see [`envoy_binary`]).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The gateway template (`envoy/gateway.yaml.tmpl`), compiled in.
pub const TEMPLATE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../envoy/gateway.yaml.tmpl"
));

/// How long [`Envoy::start`] waits for admin `/ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The repository root (parent of `wasm-tests/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Whether tests that need Envoy can run: false (with a message) when it is not installed,
/// unless `TOKENAWARE_REQUIRE_ENVOY` is set (as `scripts/test.sh` does), then a panic.
pub fn have_envoy() -> bool {
    match envoy_binary() {
        Ok(_) => true,
        Err(e) if std::env::var_os("TOKENAWARE_REQUIRE_ENVOY").is_none() => {
            eprintln!("skipping: {e}");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

/// The Envoy binary: `$ENVOY_BIN` if set, else `.venv/lib/python3*/site-packages/envoy/_bin/envoy`
/// under the repo (installed by `scripts/setup.sh`).
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        anyhow::ensure!(p.is_file(), "ENVOY_BIN={} is not a file", p.display());
        return Ok(p);
    }
    let lib = repo_root().join(".venv/lib");
    if let Ok(dir) = std::fs::read_dir(&lib) {
        for e in dir.flatten() {
            let p = e.path().join("site-packages/envoy/_bin/envoy");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!("envoy binary not found: run scripts/setup.sh or set ENVOY_BIN")
}

/// The wasm filter to insert before the router.
#[derive(Debug, Clone)]
pub struct WasmFilter {
    /// Path of the `.wasm` (made absolute when rendering).
    pub path: PathBuf,
    /// Plugin configuration (JSON text, handed to `on_configure`).
    pub configuration: String,
}

/// The `models` cluster's fallback load balancer (what picks when no filter names an
/// endpoint): the baselines a user would configure instead of the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FallbackLb {
    /// The template's round robin.
    #[default]
    RoundRobin,
    /// Envoy's least request (power of two choices over active requests).
    LeastRequest,
    /// Ring hash on the `x-prefix-group` request header (naive prefix affinity).
    RingHashPrefixGroup,
}

/// The header [`FallbackLb::RingHashPrefixGroup`] hashes.
pub const PREFIX_GROUP_HEADER: &str = "x-prefix-group";

/// Parameters of `envoy/gateway.yaml.tmpl`.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Listener port on 127.0.0.1; 0 = pick a free one at start.
    pub listen_port: u16,
    /// Admin port on 127.0.0.1; 0 = pick a free one at start.
    pub admin_port: u16,
    /// `ip:port` of every endpoint of the `models` cluster.
    pub endpoints: Vec<String>,
    /// `None` renders plain Envoy (round robin unless the client sends the header itself).
    pub wasm: Option<WasmFilter>,
    /// Envoy `--concurrency` (worker threads).
    pub concurrency: u32,
    /// Envoy `-l` log level (`info`, `debug`, ...).
    pub log_level: String,
    /// Extra `--component-log-level`, e.g. `wasm:debug`.
    pub component_log_level: Option<String>,
    /// The cluster's fallback balancer (round robin in the template).
    pub lb: FallbackLb,
    /// The wasm filter's `failure_policy` (`FAIL_OPEN` in the template; `FAIL_CLOSED`,
    /// `FAIL_RELOAD`).
    pub failure_policy: String,
    /// Port the `admin` cluster points at instead of the admin port (e.g. a dead one).
    pub admin_cluster_port: Option<u16>,
    /// Serve the listener from a watched LDS file instead of static resources, so
    /// [`Envoy::set_plugin_config`] can reconfigure the filter at runtime.
    pub dynamic_listener: bool,
    /// Serve the `models` cluster's endpoints from a watched EDS file, so
    /// [`Envoy::set_endpoints`] can change them at runtime.
    pub dynamic_endpoints: bool,
    /// Keep the template's `header_mutation` filter that removes client-sent destination
    /// headers before the wasm filter (render.sh keeps it; off here by default so tests see
    /// the filter's own stripping).
    pub strip_client_destination: bool,
    /// Extra STATIC clusters of one host each, (name, `ip:port`): the filter's `peers`
    /// (other gateway replicas).
    pub peer_clusters: Vec<(String, String)>,
    /// Environment variables the wasm VM sees, (name, value)
    /// (`vm_config.environment_variables.key_values`), e.g. the variable `peers.tokenEnv` names.
    pub vm_env: Vec<(String, String)>,
    /// One STATIC cluster of several hosts, (name, `ip:port`s), balanced by override_host
    /// on `x-gateway-destination-endpoint`: the filter's `peers.cluster` (all replicas).
    pub peer_group: Option<(String, Vec<String>)>,
}

impl GatewayConfig {
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            listen_port: 0,
            admin_port: 0,
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            wasm: None,
            concurrency: 2,
            log_level: "info".into(),
            component_log_level: None,
            lb: FallbackLb::RoundRobin,
            failure_policy: "FAIL_OPEN".into(),
            admin_cluster_port: None,
            dynamic_listener: false,
            dynamic_endpoints: false,
            strip_client_destination: false,
            peer_clusters: Vec::new(),
            vm_env: Vec::new(),
            peer_group: None,
        }
    }

    pub fn with_lb(mut self, lb: FallbackLb) -> Self {
        self.lb = lb;
        self
    }

    pub fn with_wasm(mut self, path: impl Into<PathBuf>, configuration: impl Into<String>) -> Self {
        self.wasm = Some(WasmFilter {
            path: path.into(),
            configuration: configuration.into(),
        });
        self
    }

    /// Renders the YAML. Ports must be set (non-zero); `Envoy::start` does that.
    pub fn render(&self) -> anyhow::Result<String> {
        anyhow::ensure!(
            self.listen_port != 0 && self.admin_port != 0,
            "ports not set"
        );
        anyhow::ensure!(!self.endpoints.is_empty(), "no endpoints");
        let mut eps = Vec::new();
        for ep in &self.endpoints {
            let (ip, port) = ep
                .rsplit_once(':')
                .with_context(|| format!("endpoint {ep:?} is not ip:port"))?;
            let port: u16 = port.parse().with_context(|| format!("port in {ep:?}"))?;
            eps.push(format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}"
            ));
        }
        let mut out = String::new();
        let mut skipping = false;
        for line in TEMPLATE.lines() {
            let t = line.trim();
            if t == "#@wasm-begin" {
                skipping = self.wasm.is_none();
                continue;
            }
            if t == "#@wasm-end" || t == "#@strip-end" {
                skipping = false;
                continue;
            }
            if t == "#@strip-begin" {
                skipping = !self.strip_client_destination;
                continue;
            }
            if !skipping {
                out.push_str(line);
                out.push('\n');
            }
        }
        let (wasm_file, plugin_config) = match &self.wasm {
            Some(w) => {
                let p = std::path::absolute(&w.path)?;
                anyhow::ensure!(p.is_file(), "wasm file {} not found", p.display());
                (p.display().to_string(), w.configuration.replace('\'', "''"))
            }
            None => (String::new(), String::new()),
        };
        let out = apply_lb(out, self.lb)?;
        let out = apply_failure_policy(out, &self.failure_policy)?;
        let out = apply_vm_env(out, &self.vm_env)?;
        let out = match self.admin_cluster_port {
            Some(p) => {
                let (head, cluster) = out
                    .split_once("  - name: admin\n")
                    .context("template: no admin cluster")?;
                format!(
                    "{head}  - name: admin\n{}",
                    cluster.replace("${ADMIN_PORT}", &p.to_string())
                )
            }
            None => out,
        };
        let mut out = out;
        for (name, address) in &self.peer_clusters {
            out.push_str(&format!(
                "  - name: {name}\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n{}",
                lb_endpoints(std::slice::from_ref(address), 8)?
            ));
        }
        if let Some((name, hosts)) = &self.peer_group {
            out.push_str(&format!(
                "  - name: {name}\n    type: STATIC\n    connect_timeout: 1s\n{OVERRIDE_HOST_LB}    load_assignment:\n      cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n{}",
                lb_endpoints(hosts, 8)?
            ));
        }
        Ok(out
            .replace("${LISTEN_PORT}", &self.listen_port.to_string())
            .replace("${ADMIN_PORT}", &self.admin_port.to_string())
            .replace("${ENDPOINTS}", &eps.join("\n"))
            .replace("${WASM_FILE}", &wasm_file)
            .replace("${PLUGIN_CONFIG}", &plugin_config))
    }
}

/// A cluster's load balancing by the host named in `x-gateway-destination-endpoint`, round
/// robin when none is named (as the template's `models` cluster).
const OVERRIDE_HOST_LB: &str = r#"    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"#;

/// Gives the wasm VM `env` as environment variables.
fn apply_vm_env(yaml: String, env: &[(String, String)]) -> anyhow::Result<String> {
    const RUNTIME: &str = "                  runtime: envoy.wasm.runtime.v8\n";
    if env.is_empty() || !yaml.contains(RUNTIME) {
        return Ok(yaml);
    }
    let mut block = format!(
        "{RUNTIME}                  environment_variables:\n                    key_values:\n"
    );
    for (k, v) in env {
        anyhow::ensure!(
            !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "environment variable name {k:?}"
        );
        block.push_str(&format!(
            "                      {k}: '{}'\n",
            v.replace('\'', "''")
        ));
    }
    Ok(yaml.replacen(RUNTIME, &block, 1))
}

/// Rewrites the template's round-robin fallback into `lb` (and, for the ring hash, adds a
/// route hash policy on [`PREFIX_GROUP_HEADER`]).
fn apply_lb(yaml: String, lb: FallbackLb) -> anyhow::Result<String> {
    const RR_NAME: &str = "envoy.load_balancing_policies.round_robin";
    const RR_TYPE: &str = "load_balancing_policies.round_robin.v3.RoundRobin";
    const ROUTE: &str = "                  cluster: models\n";
    let (name, ty) = match lb {
        FallbackLb::RoundRobin => return Ok(yaml),
        FallbackLb::LeastRequest => (
            "envoy.load_balancing_policies.least_request",
            "load_balancing_policies.least_request.v3.LeastRequest",
        ),
        FallbackLb::RingHashPrefixGroup => (
            "envoy.load_balancing_policies.ring_hash",
            "load_balancing_policies.ring_hash.v3.RingHash",
        ),
    };
    anyhow::ensure!(
        yaml.matches(RR_NAME).count() == 1 && yaml.matches(RR_TYPE).count() == 1,
        "template: expected one round_robin fallback policy"
    );
    let mut out = yaml.replace(RR_NAME, name).replace(RR_TYPE, ty);
    if lb == FallbackLb::RingHashPrefixGroup {
        anyhow::ensure!(
            out.matches(ROUTE).count() == 1,
            "template: expected one `cluster: models` route"
        );
        out = out.replace(
            ROUTE,
            &format!(
                "{ROUTE}                  hash_policy:\n                  - header: {{ header_name: {PREFIX_GROUP_HEADER} }}\n"
            ),
        );
    }
    Ok(out)
}

fn apply_failure_policy(yaml: String, policy: &str) -> anyhow::Result<String> {
    const LINE: &str = "failure_policy: FAIL_OPEN";
    anyhow::ensure!(
        policy.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
        "failure policy {policy:?}"
    );
    if yaml.matches(LINE).count() == 0 {
        return Ok(yaml); // plain Envoy: no filter
    }
    anyhow::ensure!(yaml.matches(LINE).count() == 1, "template: one {LINE}");
    Ok(yaml.replace(LINE, &format!("failure_policy: {policy}")))
}

/// The `lb_endpoints` entries of `endpoints` at `indent` spaces.
fn lb_endpoints(endpoints: &[String], indent: usize) -> anyhow::Result<String> {
    let mut out = String::new();
    for ep in endpoints {
        let (ip, port) = ep
            .rsplit_once(':')
            .with_context(|| format!("endpoint {ep:?} is not ip:port"))?;
        let port: u16 = port.parse().with_context(|| format!("port in {ep:?}"))?;
        out.push_str(&format!(
            "{:indent$}- endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}\n",
            ""
        ));
    }
    Ok(out)
}

/// An EDS file (`ClusterLoadAssignment` for `models`).
fn eds_file(endpoints: &[String]) -> anyhow::Result<String> {
    Ok(format!(
        "resources:\n- \"@type\": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\n  cluster_name: models\n  endpoints:\n  - lb_endpoints:\n{}",
        lb_endpoints(endpoints, 4)?
    ))
}

/// Splits a rendered bootstrap into one whose listener comes from `dir/lds.yaml` and that
/// file's text.
fn split_listener(yaml: &str, dir: &Path) -> anyhow::Result<(String, String)> {
    let (head, rest) = yaml
        .split_once("  listeners:\n")
        .context("template: no listeners")?;
    let (listener, clusters) = rest
        .split_once("  clusters:\n")
        .context("template: no clusters")?;
    let mut lds = String::from("resources:\n");
    for (i, line) in listener.lines().enumerate() {
        let line = line.strip_prefix("  ").unwrap_or(line);
        if i == 0 {
            let name = line.strip_prefix("- ").context("listener list item")?;
            lds.push_str("- \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n");
            lds.push_str(&format!("  {name}\n"));
        } else {
            lds.push_str(line);
            lds.push('\n');
        }
    }
    let d = dir.display();
    let boot = format!(
        "{head}  clusters:\n{clusters}dynamic_resources:\n  lds_config:\n    path_config_source:\n      path: {d}/lds.yaml\n      watched_directory: {{ path: {d} }}\n"
    );
    Ok((boot, lds))
}

/// Makes the `models` cluster read its endpoints from `dir/eds.yaml`.
fn models_from_eds(yaml: &str, dir: &Path) -> anyhow::Result<String> {
    let (head, rest) = yaml
        .split_once("  - name: models\n")
        .context("template: no models cluster")?;
    let (models, tail) = rest
        .split_once("  - name: admin\n")
        .context("template: no admin cluster")?;
    let (before, _) = models
        .split_once("    load_assignment:\n")
        .context("template: no load_assignment")?;
    anyhow::ensure!(
        before.contains("    type: STATIC\n"),
        "template: models not STATIC"
    );
    let d = dir.display();
    let before = before.replace(
        "    type: STATIC\n",
        &format!(
            "    type: EDS\n    eds_cluster_config:\n      service_name: models\n      eds_config:\n        path_config_source:\n          path: {d}/eds.yaml\n          watched_directory: {{ path: {d} }}\n"
        ),
    );
    Ok(format!(
        "{head}  - name: models\n{before}  - name: admin\n{tail}"
    ))
}

/// Writes `name` in `dir` atomically (write aside, then move in: what a watched directory
/// reacts to).
fn move_into(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{name}.{}", SEQ.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A running Envoy (child process), killed on drop. Its config, stdout (access log) and
/// stderr (Envoy log) live in [`Envoy::dir`]; the directory is removed on drop unless the
/// thread is panicking (a failed test keeps its logs; the path is printed) or
/// `TOKENAWARE_KEEP_ENVOY_DIR` is set.
pub struct Envoy {
    child: Child,
    config: GatewayConfig,
    dir: PathBuf,
}

impl Envoy {
    /// Renders the config (picking free ports for zeros), starts Envoy and waits (bounded by
    /// [`READY_TIMEOUT`]) until admin `/ready` answers 200.
    pub fn start(mut config: GatewayConfig) -> anyhow::Result<Envoy> {
        if config.listen_port == 0 || config.admin_port == 0 {
            let ports = crate::ports::free_ports(2)?;
            if config.listen_port == 0 {
                config.listen_port = ports[0];
            }
            if config.admin_port == 0 {
                config.admin_port = ports[1];
            }
        }
        let mut yaml = config.render()?;
        let bin = envoy_binary()?;
        let dir = std::env::temp_dir().join(format!(
            "tokenaware-envoy-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let xds = dir.join("xds");
        if config.dynamic_endpoints {
            std::fs::create_dir_all(&xds)?;
            yaml = models_from_eds(&yaml, &xds)?;
            move_into(&xds, "eds.yaml", &eds_file(&config.endpoints)?)?;
        }
        if config.dynamic_listener {
            std::fs::create_dir_all(&xds)?;
            let (boot, lds) = split_listener(&yaml, &xds)?;
            yaml = boot;
            move_into(&xds, "lds.yaml", &lds)?;
        }
        if config.dynamic_endpoints || config.dynamic_listener {
            // File-based xDS needs a node identity.
            yaml =
                format!("node: {{ id: tokenaware-gateway, cluster: tokenaware-gateway }}\n{yaml}");
        }
        let cfg_path = dir.join("envoy.yaml");
        std::fs::write(&cfg_path, yaml)?;
        let stdout = std::fs::File::create(dir.join("access.log"))?;
        let stderr = std::fs::File::create(dir.join("envoy.log"))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c")
            .arg(&cfg_path)
            .args(["--concurrency", &config.concurrency.to_string()])
            .args(["-l", &config.log_level])
            .arg("--disable-hot-restart")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        if let Some(c) = &config.component_log_level {
            cmd.args(["--component-log-level", c]);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let mut envoy = Envoy { child, config, dir };
        envoy.wait_ready(READY_TIMEOUT)?;
        Ok(envoy)
    }

    /// Runs `envoy --mode validate` on the rendered config (ports default to 10000/9901).
    pub fn validate(mut config: GatewayConfig) -> anyhow::Result<()> {
        if config.listen_port == 0 {
            config.listen_port = 10000;
        }
        if config.admin_port == 0 {
            config.admin_port = 9901;
        }
        let dir = std::env::temp_dir().join(format!(
            "tokenaware-envoy-validate-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("envoy.yaml");
        std::fs::write(&path, config.render()?)?;
        let out = Command::new(envoy_binary()?)
            .args(["--mode", "validate", "--disable-hot-restart", "-c"])
            .arg(&path)
            .output()?;
        let _ = std::fs::remove_dir_all(&dir);
        anyhow::ensure!(
            out.status.success(),
            "envoy validate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "envoy exited early ({status}); log tail:\n{}",
                    tail(&self.log(), 30)
                );
            }
            if matches!(self.admin_get("/ready"), Ok((200, _))) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "envoy not ready after {timeout:?}; log tail:\n{}",
            tail(&self.log(), 30)
        )
    }

    /// The Envoy process id (for CPU and memory readings from /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn listen_port(&self) -> u16 {
        self.config.listen_port
    }

    pub fn admin_port(&self) -> u16 {
        self.config.admin_port
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// `http://127.0.0.1:LISTEN{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.config.listen_port)
    }

    /// `http://127.0.0.1:ADMIN{path}`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.config.admin_port)
    }

    /// GET on the admin port: (status, body).
    pub fn admin_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        http_get(self.config.admin_port, path)
    }

    /// Value of an admin counter/gauge (`/stats?filter=^NAME$`), if present.
    pub fn stat(&self, name: &str) -> anyhow::Result<Option<i64>> {
        let (_, body) = self.admin_get(&format!("/stats?filter=^{name}$"))?;
        Ok(body.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        }))
    }

    /// Replaces the filter's plugin configuration at runtime (needs `dynamic_listener`):
    /// writes a new LDS file and waits (bounded) until Envoy accepted or rejected it.
    /// Returns whether it was accepted.
    pub fn set_plugin_config(&mut self, configuration: &str) -> anyhow::Result<bool> {
        anyhow::ensure!(self.config.dynamic_listener, "needs dynamic_listener");
        let wasm = self.config.wasm.as_mut().context("no wasm filter")?;
        wasm.configuration = configuration.to_string();
        let xds = self.dir.join("xds");
        let yaml = self.config.render()?;
        let yaml = if self.config.dynamic_endpoints {
            models_from_eds(&yaml, &xds)?
        } else {
            yaml
        };
        let (_, lds) = split_listener(&yaml, &xds)?;
        let stat = |n: &str| {
            self.stat(&format!("listener_manager.lds.{n}"))
                .ok()
                .flatten()
                .unwrap_or(0)
        };
        let (ok0, bad0) = (stat("update_success"), stat("update_rejected"));
        move_into(&xds, "lds.yaml", &lds)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if stat("update_rejected") > bad0 {
                return Ok(false);
            }
            if stat("update_success") > ok0 {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("envoy neither accepted nor rejected the listener update in 20 s")
    }

    /// Replaces the `models` cluster's endpoints at runtime (needs `dynamic_endpoints`) and
    /// waits (bounded) until Envoy applied the update.
    pub fn set_endpoints(&mut self, endpoints: &[String]) -> anyhow::Result<()> {
        anyhow::ensure!(self.config.dynamic_endpoints, "needs dynamic_endpoints");
        let name = "cluster.models.update_success";
        let before = self.stat(name)?.unwrap_or(0);
        move_into(&self.dir.join("xds"), "eds.yaml", &eds_file(endpoints)?)?;
        self.config.endpoints = endpoints.to_vec();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.stat(name)?.unwrap_or(0) > before {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("envoy did not apply the EDS update in 20 s")
    }

    /// Directory with `envoy.yaml`, `envoy.log`, `access.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Envoy's own log (stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// The access log (one line per request, with `upstream=` and `dest=`) so far.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() || std::env::var_os("TOKENAWARE_KEEP_ENVOY_DIR").is_some() {
            eprintln!("envoy logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Minimal blocking HTTP/1.1 GET to 127.0.0.1:`port` (2 s timeouts; handles chunked bodies).
pub fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    let addr = (Ipv4Addr::LOCALHOST, port).into();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("no header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("bad status line")?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").context("bad chunk")?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
        if n == 0 {
            return Ok(out);
        }
        anyhow::ensure!(rest.len() >= n, "short chunk");
        out.push_str(rest.get(..n).context("chunk boundary")?);
        s = rest.get(n..).unwrap_or("").trim_start_matches("\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_plain_and_wasm_variants() {
        let mut c = GatewayConfig::new(["127.0.0.1:8000", "127.0.0.1:8001"]);
        c.listen_port = 10000;
        c.admin_port = 9901;
        let plain = c.render().unwrap();
        assert!(!plain.contains("envoy.filters.http.wasm"));
        assert!(plain
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .all(|l| !l.contains("${")));
        assert!(plain.contains("port_value: 8001"));
        let wasm = std::env::current_exe().unwrap(); // any existing file will do for rendering
        let base = c.clone();
        let w = c.with_wasm(&wasm, r#"{"a":"it's"}"#).render().unwrap();
        assert!(w.contains("envoy.filters.http.wasm"));
        assert!(w.contains(r#"value: '{"a":"it''s"}'"#));
        assert!(w.contains("allow_on_headers_stop_iteration: true"));
        assert!(!w.contains("environment_variables"));
        let mut e = base.clone().with_wasm(&wasm, "{}");
        e.vm_env = vec![("PEER_TOKEN".into(), "it's-a-secret".into())];
        let e = e.render().unwrap();
        assert!(e.contains("environment_variables:\n                    key_values:\n                      PEER_TOKEN: 'it''s-a-secret'\n"));
        assert!(!w.contains("header_mutation") && !w.contains("#@"));
        let mut strip = base.with_wasm(&wasm, "{}");
        strip.strip_client_destination = true;
        assert!(strip
            .render()
            .unwrap()
            .contains("- remove: x-gateway-destination-endpoint\n"));
    }

    #[test]
    fn renders_fallback_balancers() {
        let mut c = GatewayConfig::new(["127.0.0.1:8000"]);
        c.listen_port = 10000;
        c.admin_port = 9901;
        let rr = c.render().unwrap();
        assert!(rr.contains("round_robin.v3.RoundRobin") && !rr.contains("hash_policy"));
        let lr = c
            .clone()
            .with_lb(FallbackLb::LeastRequest)
            .render()
            .unwrap();
        assert!(lr.contains("least_request.v3.LeastRequest") && !lr.contains("round_robin"));
        let rh = c.with_lb(FallbackLb::RingHashPrefixGroup).render().unwrap();
        assert!(rh.contains("ring_hash.v3.RingHash"));
        assert!(rh.contains("header_name: x-prefix-group"));
    }

    #[test]
    fn dechunks() {
        assert_eq!(
            dechunk("4\r\nLIVE\r\n1\r\n\n\r\n0\r\n\r\n").unwrap(),
            "LIVE\n"
        );
    }
}

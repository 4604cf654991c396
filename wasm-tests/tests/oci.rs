//! The OCI image end to end: `oci-image`'s layout is reproducible; pushed with skopeo to a
//! loopback Debian `docker-registry` and pulled back, it keeps its manifest digest and its
//! `plugin.wasm` is the built module byte for byte; and that extracted module, loaded by a
//! real Envoy in front of the simulated fleet, routes requests.
//!
//! Needs the release module (`cargo build -p tokenaware --release --target wasm32-wasip1`).
//! The registry test also needs skopeo, docker-registry and Envoy (scripts/setup.sh
//! installs them); without them it is skipped, unless TOKENAWARE_REQUIRE_ENVOY is set, when
//! a missing tool fails it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::json;
use wasm_tests::envoy::{have_envoy, http_get, repo_root, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig, MODEL};
use wasm_tests::{oci, ports};

const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
/// Bound on every skopeo run and on the registry's start.
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);
const REGISTRY_READY: Duration = Duration::from_secs(15);

fn wasm_path() -> PathBuf {
    let p = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build -p tokenaware --release --target wasm32-wasip1` first",
        p.display()
    );
    p
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A fresh temporary directory, removed on drop unless the test failed.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "tokenaware-{what}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn in_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()))
}

/// skopeo, docker-registry and Envoy are all there; else skip (or fail when required).
fn have_tools() -> bool {
    let mut missing = Vec::new();
    if !in_path("skopeo") {
        missing.push("skopeo");
    }
    if !Path::new(REGISTRY_BIN).is_file() {
        missing.push(REGISTRY_BIN);
    }
    if missing.is_empty() {
        return have_envoy();
    }
    let msg = format!(
        "{} not installed (run scripts/setup.sh)",
        missing.join(", ")
    );
    assert!(
        std::env::var_os("TOKENAWARE_REQUIRE_ENVOY").is_none(),
        "{msg}"
    );
    eprintln!("skipping: {msg}");
    false
}

/// Runs `cmd` to completion within `timeout` (killed after it); returns stdout.
fn run_bounded(mut cmd: Command, timeout: Duration) -> anyhow::Result<String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {shown}"))?;
    let deadline = Instant::now() + timeout;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{shown} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{shown} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A Debian `docker-registry` on 127.0.0.1 with filesystem storage in a temp dir; killed on
/// drop.
struct Registry {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl Registry {
    fn start() -> anyhow::Result<Registry> {
        let mut last = None;
        // A probed port can be taken before the registry binds it: try a few.
        for _ in 0..3 {
            match Self::start_once() {
                Ok(r) => return Ok(r),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("registry did not start")))
    }

    fn start_once() -> anyhow::Result<Registry> {
        let dir = TempDir::new("registry");
        let port = ports::free_port()?;
        let config = dir.0.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                dir.0.join("data").display()
            ),
        )?;
        let log = std::fs::File::create(dir.0.join("registry.log"))?;
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawn docker-registry")?;
        let mut reg = Registry { child, port, dir };
        let deadline = Instant::now() + REGISTRY_READY;
        loop {
            if let Some(status) = reg.child.try_wait()? {
                bail!("docker-registry exited ({status}):\n{}", reg.log());
            }
            if matches!(http_get(port, "/v2/"), Ok((200, _))) {
                return Ok(reg);
            }
            ensure!(
                Instant::now() < deadline,
                "docker-registry not ready after {REGISTRY_READY:?}:\n{}",
                reg.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("registry.log")).unwrap_or_default()
    }

    fn reference(&self, repo_tag: &str) -> String {
        format!("docker://127.0.0.1:{}/{repo_tag}", self.port)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `skopeo copy` with a permissive signature policy of its own (the host's
/// /etc/containers/policy.json is not assumed), plain HTTP to the loopback registry, and
/// `--preserve-digests` so a copy that would rewrite the manifest fails instead.
fn skopeo_copy(dir: &Path, from: &str, to: &str) -> anyhow::Result<()> {
    let policy = dir.join("policy.json");
    std::fs::write(
        &policy,
        r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
    )?;
    let mut cmd = Command::new("skopeo");
    cmd.arg("--policy")
        .arg(&policy)
        .args(["--command-timeout", "60s", "copy", "--preserve-digests"])
        .args([
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            from,
            to,
        ]);
    run_bounded(cmd, TOOL_TIMEOUT).map(drop)
}

#[test]
fn image_digest_is_reproducible() {
    let wasm = std::fs::read(wasm_path()).unwrap();
    let tmp = TempDir::new("oci-repro");
    let a = oci::write_layout(&wasm, &tmp.0.join("a"), "v1").unwrap();
    let b = oci::write_layout(&wasm, &tmp.0.join("b"), "v1").unwrap();
    assert_eq!(a.manifest_digest, b.manifest_digest);
    assert_eq!(a.layer_digest, b.layer_digest);
    for name in ["index.json", "oci-layout"] {
        assert_eq!(
            std::fs::read(tmp.0.join("a").join(name)).unwrap(),
            std::fs::read(tmp.0.join("b").join(name)).unwrap(),
            "{name}"
        );
    }
    // The digest follows the module: one changed byte (in a custom section appended at the
    // end, so it stays a valid module) gives another image.
    let mut other = wasm.clone();
    other.extend_from_slice(&[0, 2, 1, b'x']);
    let c = oci::write_layout(&other, &tmp.0.join("c"), "v1").unwrap();
    assert_ne!(a.manifest_digest, c.manifest_digest);
    let (_, back) = oci::extract_plugin(&tmp.0.join("a"), Some("v1")).unwrap();
    assert!(back == wasm, "plugin.wasm differs from the module");
}

/// The `oci-image` binary itself prints the same digest as the library.
#[test]
fn binary_prints_the_manifest_digest() {
    let tmp = TempDir::new("oci-bin");
    let out = tmp.0.join("layout");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oci-image"));
    cmd.arg("--out").arg(&out).args(["--tag", "t"]);
    cmd.arg("--wasm").arg(wasm_path());
    let printed = run_bounded(cmd, TOOL_TIMEOUT).unwrap();
    let wasm = std::fs::read(wasm_path()).unwrap();
    let again = oci::write_layout(&wasm, &tmp.0.join("again"), "t").unwrap();
    assert_eq!(printed.trim(), again.manifest_digest);
    assert_eq!(
        oci::manifest_descriptor(&out, Some("t")).unwrap().digest,
        again.manifest_digest
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pushed_image_pulls_back_and_routes_in_envoy() {
    if !have_tools() {
        return;
    }
    let wasm = std::fs::read(wasm_path()).unwrap();
    let tmp = TempDir::new("oci-e2e");
    let built_dir = tmp.0.join("built");
    let pulled_dir = tmp.0.join("pulled");
    let built = oci::write_layout(&wasm, &built_dir, "0.1.0").unwrap();

    let (pulled, plugin) = tokio::task::spawn_blocking({
        let (tmp_dir, built_dir, pulled_dir) =
            (tmp.0.clone(), built_dir.clone(), pulled_dir.clone());
        let digest = built.manifest_digest.clone();
        move || -> anyhow::Result<(oci::Descriptor, Vec<u8>)> {
            let registry = Registry::start()?;
            let remote = registry.reference("tokenaware:0.1.0");
            let src = format!("oci:{}:0.1.0", built_dir.display());
            skopeo_copy(&tmp_dir, &src, &remote)?;
            // The registry serves the manifest under the digest we computed, byte for byte.
            let mut inspect = Command::new("skopeo");
            inspect
                .args([
                    "--command-timeout",
                    "60s",
                    "inspect",
                    "--raw",
                    "--tls-verify=false",
                ])
                .arg(registry.reference(&format!("tokenaware@{digest}")));
            let raw = run_bounded(inspect, TOOL_TIMEOUT)?;
            ensure!(
                oci::digest(raw.as_bytes()) == digest,
                "registry manifest differs:\n{raw}"
            );
            let dst = format!("oci:{}:pulled", pulled_dir.display());
            skopeo_copy(&tmp_dir, &remote, &dst)?;
            let desc = oci::manifest_descriptor(&pulled_dir, Some("pulled"))?;
            let (_, plugin) = oci::extract_plugin(&pulled_dir, Some("pulled"))?;
            Ok((desc, plugin))
        }
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        pulled.digest, built.manifest_digest,
        "digest changed in transit"
    );
    assert!(
        plugin == wasm,
        "pulled plugin.wasm differs from the built module"
    );

    // The module as a gateway would get it from the registry, loaded by Envoy.
    let plugin_path = tmp.0.join("plugin.wasm");
    std::fs::write(&plugin_path, &plugin).unwrap();
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(3, 0.01)).unwrap();
    let eps = fleet.endpoints();
    let list: Vec<_> = eps.iter().map(|a| json!({ "address": a })).collect();
    let config =
        json!({ "endpoints": list, "decisionHeader": true, "statsFlushMs": 0 }).to_string();
    let envoy = tokio::task::spawn_blocking(move || {
        Envoy::start(GatewayConfig::new(eps).with_wasm(plugin_path, config))
    })
    .await
    .unwrap()
    .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let system = "You review Rust code for a proxy-wasm filter. ".repeat(800);
    let mut served = Vec::new();
    for q in 0..3 {
        let body = json!({
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": format!("question {q}")}],
        });
        let r = http
            .post(envoy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let header = |n: &str| {
            r.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let (endpoint, decision) = (header("x-fleet-endpoint"), header("x-tokenaware-decision"));
        let _ = r.bytes().await.unwrap();
        assert!(
            !decision.is_empty(),
            "no decision header: the filter did not run"
        );
        if q > 0 {
            assert!(decision.contains("reason=sticky"), "{decision}");
        }
        served.push(endpoint);
    }
    assert!(
        served.iter().all(|e| e == &served[0]),
        "shared prefix spread over {served:?}"
    );
    let routed = envoy
        .stat("wasmcustom.tokenaware_requests_routed")
        .unwrap()
        .unwrap_or(0);
    assert_eq!(routed, 3);
    drop(fleet);
}

//! The deployment examples hold together:
//! - every plugin configuration under `examples/config/` (and the ones embedded in the
//!   Istio and Envoy Gateway examples) is accepted by the filter's own config parser, and
//!   every calibrated preset has an example;
//! - the Istio and Envoy Gateway resources use only field names (and enum values) their
//!   CRDs' OpenAPI schemas define (vendored under `wasm-tests/fixtures/crds/`, trimmed, with
//!   source and licence noted); a misspelled field is caught;
//! - the Envoy parts of the patches, applied the way istiod / Envoy Gateway would apply them
//!   to a representative generated listener and cluster, give a bootstrap that
//!   `envoy --mode validate` accepts. Validation loads the module in V8 and runs its
//!   `on_configure` (the filters are switched to fail closed for this), so a broken plugin
//!   configuration fails it, as does a misspelled Envoy field;
//! - in those assembled configs the route to the models buffers at least `maxBodyBytes` plus
//!   one listener read, so Envoy never answers 413 to a body the filter still holds; run for
//!   real on loopback (with the fleet), a prompt over the platform's listener limit gets 200
//!   with the patch and Envoy's 413 without it.
//!
//! `deploy_examples/crd.rs` holds the schema checker, `deploy_examples/patch.rs` the merge
//! and JSON-patch helpers, `deploy_examples/live.rs` the loopback run.
//!
//! The Envoy checks need Envoy (scripts/setup.sh) and the release module; without Envoy
//! they are skipped unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokenaware::config::{Config, PRESETS};
use wasm_tests::envoy::{envoy_binary, have_envoy, repo_root};

#[path = "deploy_examples/crd.rs"]
mod crd;
#[path = "deploy_examples/live.rs"]
mod live;
#[path = "deploy_examples/patch.rs"]
mod patch;
mod support;

use crd::{crd_specs, resource_errors};
use patch::{json_path, pointer_add, pointer_remove, proto_merge};

const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HCM: &str = "envoy.filters.network.http_connection_manager";
const ROUTER: &str = "envoy.filters.http.router";
const ISTIO_MODEL_CLUSTER: &str = "outbound|8000||vllm.models.svc.cluster.local";
const EG_MODEL_CLUSTER: &str = "httproute/models/llm/rule/0";
const EG_LISTENER: &str = "models/eg/http";
const ISTIO_VHOST: &str = "llm.example.com:80";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const ROUTE_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
/// Envoy's per-connection buffer limit where a listener sets none (1 MiB).
const ENVOY_DEFAULT_CONNECTION_BUFFER: u64 = 1 << 20;

// === files ===

fn examples() -> PathBuf {
    repo_root().join("examples")
}

fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

/// Every YAML document in `path`, as JSON values.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    yaml_docs_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml_docs_str(text: &str) -> Result<Vec<Value>, serde_norway::Error> {
    serde_norway::Deserializer::from_str(text)
        .map(Value::deserialize)
        .filter(|d| !matches!(d, Ok(Value::Null)))
        .collect()
}

fn one_doc(path: &Path, kind: &str) -> Value {
    let docs = yaml_docs(path);
    assert_eq!(docs.len(), 1, "{}: expected one document", path.display());
    assert_eq!(docs[0]["kind"], kind, "{}", path.display());
    docs.into_iter().next().unwrap()
}

fn wasm_path() -> PathBuf {
    let p = repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build -p tokenaware --release --target wasm32-wasip1` first",
        p.display()
    );
    p
}

// === (a) plugin configurations ===

fn parse_config(what: &str, text: &str) -> Config {
    Config::from_json(text.as_bytes()).unwrap_or_else(|e| panic!("{what}: {e}"))
}

#[test]
fn example_configs_parse() {
    let dir = examples().join("config");
    let mut n = 0;
    for p in json_files(&dir) {
        let c = parse_config(
            &p.display().to_string(),
            &std::fs::read_to_string(&p).unwrap(),
        );
        assert!(c.tau_tokens() > 0.0, "{}", p.display());
        n += 1;
    }
    assert!(
        n >= 3,
        "prefill-bound, decode-bound and multimodal configs expected"
    );
    // One preset example per calibrated preset, named after it.
    let presets = json_files(&dir.join("presets"));
    for p in &presets {
        let c = parse_config(
            &p.display().to_string(),
            &std::fs::read_to_string(p).unwrap(),
        );
        let stem = p.file_stem().unwrap().to_str().unwrap();
        assert_eq!(c.preset.as_deref(), Some(stem), "{}", p.display());
        let preset = tokenaware::config::preset(stem).unwrap();
        assert_eq!(c.peak_prefill(), preset.peak_prefill_tokens_per_s);
    }
    for preset in PRESETS {
        assert!(
            presets
                .iter()
                .any(|p| p.file_stem().unwrap() == preset.name),
            "no examples/config/presets/{}.json",
            preset.name
        );
    }
    // The seeds' τ from its preset.
    let blog = std::fs::read_to_string(dir.join("presets/qwen3-32b-h100-tp2-blog.json")).unwrap();
    assert_eq!(parse_config("blog", &blog).tau_tokens().round(), 286_720.0);
    // The parser is strict: a misspelled field fails, naming it.
    let bad = std::fs::read_to_string(dir.join("prefill-bound.json"))
        .unwrap()
        .replace("\"affinityThreshold\"", "\"affinityTreshold\"");
    let e = Config::from_json(bad.as_bytes()).unwrap_err();
    assert_eq!(e.field, "affinityTreshold", "{e}");
}

/// The configurations embedded in the Istio and Envoy Gateway examples parse too.
#[test]
fn embedded_configs_parse() {
    let filter = istio_filter();
    let ext = extension_configs(&filter);
    let wasm = &ext["tokenaware"];
    let text = wasm["config"]["configuration"]["value"].as_str().unwrap();
    let c = parse_config("istio/filter.yaml", text);
    assert_eq!(c.discovery.unwrap().model_cluster, ISTIO_MODEL_CLUSTER);

    let plugin = one_doc(&examples().join("istio/wasmplugin.yaml"), "WasmPlugin");
    let c = parse_config(
        "istio/wasmplugin.yaml",
        &plugin["spec"]["pluginConfig"].to_string(),
    );
    assert_eq!(c.metrics.unwrap().cluster, ISTIO_MODEL_CLUSTER);

    let eep = eg_extension_policy();
    let c = parse_config(
        "envoy-gateway",
        &eep["spec"]["wasm"][0]["config"].to_string(),
    );
    assert_eq!(c.discovery.unwrap().model_cluster, EG_MODEL_CLUSTER);
}

// === (c) CRD schemas ===

fn example_resources() -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    for dir in ["istio", "envoy-gateway"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(examples().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        for p in files {
            for d in yaml_docs(&p) {
                out.push((p.clone(), d));
            }
        }
    }
    out
}

#[test]
fn examples_match_the_crd_schemas() {
    let crds = crd_specs();
    let resources = example_resources();
    let kinds: Vec<&str> = resources
        .iter()
        .filter_map(|(_, d)| d["kind"].as_str())
        .collect();
    for k in [
        "EnvoyFilter",
        "WasmPlugin",
        "EnvoyExtensionPolicy",
        "EnvoyPatchPolicy",
    ] {
        assert!(kinds.contains(&k), "no {k} among the examples");
    }
    for (p, d) in &resources {
        let errs = resource_errors(&crds, d);
        assert!(errs.is_empty(), "{}:\n{}", p.display(), errs.join("\n"));
    }
}

#[test]
fn misspelled_fields_are_rejected() {
    let crds = crd_specs();
    let resources = example_resources();
    // The first example of `kind` that contains `text`, as JSON text.
    let find = |kind: &str, text: &str| {
        resources
            .iter()
            .filter(|(_, d)| d["kind"] == kind)
            .map(|(_, d)| serde_json::to_string(d).unwrap())
            .find(|t| t.contains(text))
            .unwrap_or_else(|| panic!("no {kind} example contains {text}"))
    };
    // (kind, original text, misspelling, expected error path fragment)
    let cases = [
        (
            "WasmPlugin",
            "\"failStrategy\"",
            "\"failStratgy\"",
            "WasmPlugin.spec.failStratgy",
        ),
        (
            "WasmPlugin",
            "\"UNSPECIFIED_PHASE\"",
            "\"BEFORE_ROUTER\"",
            "WasmPlugin.spec.phase",
        ),
        (
            "EnvoyFilter",
            "\"workloadSelector\"",
            "\"workloadSelecter\"",
            "spec.workloadSelecter",
        ),
        (
            "EnvoyFilter",
            "\"subFilter\"",
            "\"sub_filter\"",
            "filter.sub_filter",
        ),
        (
            "EnvoyExtensionPolicy",
            "\"rootID\"",
            "\"rootId\"",
            "wasm[0].rootId",
        ),
        ("EnvoyExtensionPolicy", "\"Image\"", "\"OCI\"", "code.type"),
        (
            "EnvoyPatchPolicy",
            "\"jsonPath\"",
            "\"jsonpath\"",
            "operation.jsonpath",
        ),
    ];
    for (kind, from, to, want) in cases {
        let text = find(kind, from);
        let bad: Value = serde_json::from_str(&text.replacen(from, to, 1)).unwrap();
        let errs = resource_errors(&crds, &bad);
        assert!(
            errs.iter().any(|e| e.contains(want)),
            "{kind}: {from} -> {to} not caught (errors: {errs:?})"
        );
    }
    // A missing required field is caught as well.
    let mut plugin: Value = serde_json::from_str(&find("WasmPlugin", "url")).unwrap();
    plugin["spec"].as_object_mut().unwrap().remove("url");
    let errs = resource_errors(&crds, &plugin);
    assert!(errs.iter().any(|e| e.contains("`url` missing")), "{errs:?}");
}

// === (b) Envoy: the patches applied to representative generated config ===

fn istio_filter() -> Value {
    one_doc(&examples().join("istio/filter.yaml"), "EnvoyFilter")
}

fn eg_extension_policy() -> Value {
    one_doc(
        &examples().join("envoy-gateway/extension-policy.yaml"),
        "EnvoyExtensionPolicy",
    )
}

fn patches(filter: &Value) -> &Vec<Value> {
    filter["spec"]["configPatches"].as_array().unwrap()
}

/// EXTENSION_CONFIG ADD patches: name → typed_config.
fn extension_configs(filter: &Value) -> BTreeMap<String, Value> {
    patches(filter)
        .iter()
        .filter(|p| p["applyTo"] == "EXTENSION_CONFIG")
        .map(|p| {
            assert_eq!(p["patch"]["operation"], "ADD");
            let v = &p["patch"]["value"];
            (
                v["name"].as_str().unwrap().to_string(),
                v["typed_config"].clone(),
            )
        })
        .collect()
}

/// What istio-agent does to an ECDS Wasm config before Envoy sees it: the remote (oci://)
/// code source becomes a local file.
fn localize(mut wasm: Value, file: &Path) -> Value {
    let code = &mut wasm["config"]["vm_config"]["code"];
    assert!(
        code["remote"]["http_uri"]["uri"]
            .as_str()
            .is_some_and(|u| u.starts_with("oci://")),
        "expected an oci:// remote code source: {code}"
    );
    *code = json!({ "local": { "filename": file.display().to_string() } });
    wasm
}

fn endpoint(ip: &str, port: u16) -> Value {
    json!({ "endpoint": { "address": { "socket_address": { "address": ip, "port_value": port } } } })
}

fn hcm(stat_prefix: &str, route_config: Value, filters: Vec<Value>) -> Value {
    json!({
        "name": HCM,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "route_config": route_config,
            "http_filters": filters,
        }
    })
}

/// The HCM of a listener shaped as these tests build them.
fn hcm_config(listener: &Value) -> &Value {
    listener
        .pointer("/filter_chains/0/filters/0/typed_config")
        .or_else(|| listener.pointer("/default_filter_chain/filters/0/typed_config"))
        .unwrap()
}

fn hcm_config_mut(listener: &mut Value) -> &mut Value {
    let at = if listener.pointer("/filter_chains/0").is_some() {
        "/filter_chains/0/filters/0/typed_config"
    } else {
        "/default_filter_chain/filters/0/typed_config"
    };
    listener.pointer_mut(at).unwrap()
}

fn router() -> Value {
    json!({ "name": ROUTER, "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" } })
}

/// A listener and model cluster shaped like the ones istiod generates for an ingress gateway
/// serving VirtualService host `llm.example.com` on Gateway server port 80 (EDS replaced by
/// static endpoints, RDS by the same route configuration inline, mTLS left out: validate
/// mode has no SDS). No per_connection_buffer_limit_bytes: Istio sets none unless the
/// ConnectionSettings EDGE profile (32 KiB) or an explicit value asks for it.
fn istio_generated() -> (Value, Vec<Value>) {
    let routes = json!({
        "name": "http.8080",
        "virtual_hosts": [{
            "name": ISTIO_VHOST,
            "domains": ["llm.example.com", "llm.example.com:*"],
            "include_request_attempt_count": true,
            "routes": [{
                "name": "llm",
                "match": { "prefix": "/" },
                "route": {
                    "cluster": ISTIO_MODEL_CLUSTER,
                    "timeout": "300s",
                    "retry_policy": {
                        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                        "num_retries": 2
                    }
                }
            }]
        }]
    });
    let listener = json!({
        "name": "0.0.0.0_8080",
        "address": { "socket_address": { "address": "0.0.0.0", "port_value": 8080 } },
        "filter_chains": [{ "filters": [hcm("outbound_0.0.0.0_8080", routes, vec![router()])] }],
    });
    let cluster = json!({
        "name": ISTIO_MODEL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": { "thresholds": [{
            "max_connections": 4294967295u64, "max_pending_requests": 4294967295u64,
            "max_requests": 4294967295u64, "max_retries": 4294967295u64, "track_remaining": true }] },
        "metadata": { "filter_metadata": { "istio": { "services": [
            { "host": "vllm.models.svc.cluster.local", "name": "vllm", "namespace": "models" }] } } },
        "load_assignment": { "cluster_name": ISTIO_MODEL_CLUSTER, "endpoints": [{ "lb_endpoints": [
            endpoint("10.0.0.5", 8000), endpoint("10.0.0.6", 8000)] }] },
    });
    (listener, vec![cluster])
}

fn http_filters(listener: &mut Value) -> &mut Vec<Value> {
    hcm_config_mut(listener)["http_filters"]
        .as_array_mut()
        .unwrap()
}

/// Applies the examples' EnvoyFilter patches (both files) the way istiod would for the
/// GATEWAY context, checking that each one finds its target.
fn istio_bootstrap(filter: &Value, clusters: &Value, wasm: &Path) -> Value {
    let (mut listener, mut cluster_list) = istio_generated();
    let ext = extension_configs(filter);
    for p in patches(filter).iter().chain(patches(clusters)) {
        let (apply, op, value) = (
            &p["applyTo"],
            &p["patch"]["operation"],
            &p["patch"]["value"],
        );
        if apply != "EXTENSION_CONFIG" {
            assert_eq!(p["match"]["context"], "GATEWAY", "{p}");
        }
        match (apply.as_str().unwrap(), op.as_str().unwrap()) {
            ("EXTENSION_CONFIG", "ADD") => {}
            ("HTTP_FILTER", "INSERT_FIRST") => {
                let value = value.clone();
                assert!(value["typed_config"].is_object(), "{p}");
                http_filters(&mut listener).insert(0, value);
            }
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                let m = &p["match"]["listener"]["filterChain"]["filter"];
                assert_eq!(m["name"], HCM);
                let before = m["subFilter"]["name"].as_str().unwrap();
                let name = value["name"].as_str().unwrap();
                let typed = match value.get("typed_config") {
                    Some(inline) => inline.clone(),
                    None => {
                        // Resolved through ECDS: the EXTENSION_CONFIG of the same name,
                        // localised.
                        assert_eq!(value["config_discovery"]["type_urls"][0], WASM_TYPE);
                        localize(ext[name].clone(), wasm)
                    }
                };
                let filters = http_filters(&mut listener);
                let at = filters
                    .iter()
                    .position(|f| f["name"] == before)
                    .unwrap_or_else(|| panic!("no {before} to insert before"));
                filters.insert(at, json!({ "name": name, "typed_config": typed }));
            }
            ("CLUSTER", "MERGE") => {
                let m = &p["match"]["cluster"];
                let name = format!(
                    "outbound|{}||{}",
                    m["portNumber"],
                    m["service"].as_str().unwrap()
                );
                let c = cluster_list
                    .iter_mut()
                    .find(|c| c["name"] == name.as_str())
                    .unwrap_or_else(|| panic!("MERGE matches no cluster ({name})"));
                proto_merge(c, value);
            }
            ("CLUSTER", "ADD") => cluster_list.push(value.clone()),
            ("VIRTUAL_HOST", "MERGE") => {
                let m = &p["match"]["routeConfiguration"];
                let keys: Vec<&String> = m.as_object().unwrap().keys().collect();
                assert_eq!(keys, ["vhost"], "only a vhost name match is modelled: {p}");
                let want = m["vhost"]["name"].as_str().unwrap();
                let vhosts = hcm_config_mut(&mut listener)["route_config"]["virtual_hosts"]
                    .as_array_mut()
                    .unwrap();
                let vh = vhosts
                    .iter_mut()
                    .find(|v| v["name"] == want)
                    .unwrap_or_else(|| panic!("MERGE matches no virtual host ({want})"));
                proto_merge(vh, value);
            }
            other => panic!("patch {other:?} not modelled by this test"),
        }
    }
    json!({
        "admin": { "address": { "socket_address": { "address": "127.0.0.1", "port_value": 15000 } } },
        "static_resources": { "listeners": [listener], "clusters": cluster_list },
    })
}

/// The wasm filter Envoy Gateway generates from an EnvoyExtensionPolicy entry
/// (internal/xds/translator/wasm.go: v8, vm_id = name, config as a JSON string); the code
/// it serves over its HTTP server is a local file here.
fn eg_wasm_filter(entry: &Value, wasm: &Path) -> Value {
    assert_eq!(entry["code"]["type"], "Image");
    let name = entry["name"].as_str().unwrap();
    json!({
        "name": format!("envoy.filters.http.wasm/envoyextensionpolicy/models/tokenaware/{name}"),
        "typed_config": {
            "@type": WASM_TYPE,
            "config": {
                "name": name,
                "root_id": entry["rootID"],
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": wasm.display().to_string() } }
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": entry["config"].to_string()
                },
                "fail_open": entry["failOpen"] == true,
            }
        }
    })
}

/// A listener and cluster shaped like Envoy Gateway's for HTTPRoute `models/llm` on Gateway
/// `models/eg` (internal/xds/translator/cluster.go: locality-weighted, least request,
/// outlier detection; EDS replaced by static endpoints), with the EnvoyExtensionPolicy's
/// wasm filter, then the EnvoyPatchPolicy's patches applied in order.
fn eg_bootstrap(eep: &Value, epp: &Value, wasm: &Path) -> Value {
    let mut filters: Vec<Value> = eep["spec"]["wasm"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| eg_wasm_filter(w, wasm))
        .collect();
    filters.push(router());
    // internal/xds/translator: the route configuration is named as the listener, one virtual
    // host per hostname (`*` here), routes named httproute/NS/NAME/rule/R/match/M/HOST.
    let routes = json!({
        "name": EG_LISTENER,
        "virtual_hosts": [{
            "name": format!("{EG_LISTENER}/*"),
            "domains": ["*"],
            "routes": [{
                "name": "httproute/models/llm/rule/0/match/0/*",
                "match": { "prefix": "/" },
                "route": { "cluster": EG_MODEL_CLUSTER, "upgrade_configs": [{ "upgrade_type": "websocket" }] }
            }]
        }]
    });
    // 32 KiB per connection: tcpListenerPerConnectionBufferLimitBytes in
    // internal/xds/translator/listener.go.
    let mut listeners = vec![json!({
        "name": EG_LISTENER,
        "address": { "socket_address": { "address": "0.0.0.0", "port_value": 10080 } },
        "per_connection_buffer_limit_bytes": 32768,
        "default_filter_chain": { "filters": [hcm("http-10080", routes, filters)] },
    })];
    let mut clusters = vec![json!({
        "name": EG_MODEL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "per_connection_buffer_limit_bytes": 32768,
        "common_lb_config": { "locality_weighted_lb_config": {} },
        "outlier_detection": {},
        "circuit_breakers": { "thresholds": [{ "max_retries": 1024 }] },
        "load_assignment": { "cluster_name": EG_MODEL_CLUSTER, "endpoints": [{ "lb_endpoints": [
            endpoint("10.0.0.5", 8000), endpoint("10.0.0.6", 8000)] }] },
    })];
    for p in epp["spec"]["jsonPatches"].as_array().unwrap() {
        let op = &p["operation"];
        let (ty, name) = (p["type"].as_str().unwrap(), p["name"].as_str().unwrap());
        let path = op["path"].as_str().unwrap_or_default();
        if op["op"] == "add" && path.is_empty() && op["jsonPath"].is_null() {
            assert_eq!(
                op["value"]["name"], name,
                "added resource is named as the patch"
            );
            match ty {
                LISTENER_TYPE => listeners.push(op["value"].clone()),
                CLUSTER_TYPE => clusters.push(op["value"].clone()),
                other => panic!("adding a {other} is not modelled"),
            }
            continue;
        }
        let target = match ty {
            LISTENER_TYPE => listeners.iter_mut().find(|r| r["name"] == name),
            CLUSTER_TYPE => clusters.iter_mut().find(|r| r["name"] == name),
            // Served over RDS under the listener's name; inline in the listener here.
            ROUTE_TYPE => listeners
                .iter_mut()
                .map(|l| &mut hcm_config_mut(l)["route_config"])
                .find(|r| r["name"] == name),
            other => panic!("patch type {other} not modelled"),
        }
        .unwrap_or_else(|| panic!("patch names no generated resource: {ty} {name}"));
        if op["op"] == "remove" {
            pointer_remove(target, path).unwrap_or_else(|| panic!("nothing to remove: {p}"));
            continue;
        }
        assert_eq!(op["op"], "add", "only add and remove are modelled: {p}");
        let pointers = match op["jsonPath"].as_str() {
            Some(expr) => json_path(target, expr),
            None => vec![String::new()],
        };
        assert!(!pointers.is_empty(), "jsonPath matches nothing: {p}");
        for base in pointers {
            pointer_add(target, &format!("{base}{path}"), op["value"].clone());
        }
    }
    json!({
        "admin": { "address": { "socket_address": { "address": "127.0.0.1", "port_value": 19000 } } },
        "static_resources": { "listeners": listeners, "clusters": clusters },
    })
}

/// `envoy --mode validate` on `bootstrap`: Ok or Envoy's complaint.
fn envoy_validate(name: &str, bootstrap: &Value) -> Result<(), String> {
    envoy_validate_env(name, bootstrap, &[])
}

/// `envoy_validate` with `env` set in Envoy's environment (`(name, None)` removes one).
fn envoy_validate_env(
    name: &str,
    bootstrap: &Value,
    env: &[(&str, Option<&str>)],
) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("tokenaware-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(bootstrap).unwrap()).unwrap();
    let mut cmd = Command::new(envoy_binary().unwrap());
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-l",
            "warn",
            "-c",
        ])
        .arg(&path)
        .output()
        .unwrap();
    if out.status.success() {
        let _ = std::fs::remove_file(&path);
        Ok(())
    } else {
        Err(format!(
            "{}: {}{}",
            path.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Makes every wasm filter fail closed, so that `--mode validate` (which loads the module
/// and runs its `on_configure` in V8) fails on a plugin configuration the filter refuses;
/// the examples themselves fail open.
fn fail_closed(v: &mut Value) {
    match v {
        Value::Object(o) => {
            if o.get("@type").and_then(Value::as_str) == Some(WASM_TYPE) {
                let c = o["config"].as_object_mut().unwrap();
                let open = c.remove("fail_open") == Some(json!(true))
                    || c.get("failure_policy") == Some(&json!("FAIL_OPEN"));
                assert!(open, "example filters should fail open: {c:?}");
                c.insert("failure_policy".into(), json!("FAIL_CLOSED"));
            }
            o.values_mut().for_each(fail_closed);
        }
        Value::Array(a) => a.iter_mut().for_each(fail_closed),
        _ => {}
    }
}

/// The same bootstrap with the tokenaware plugin configuration broken (an unknown field).
fn with_bad_plugin_config(boot: &Value) -> Value {
    let text = serde_json::to_string(boot).unwrap();
    let (from, to) = (r#"\"preset\""#, r#"\"presett\""#);
    assert!(text.contains(from), "no preset in the plugin configuration");
    serde_json::from_str(&text.replace(from, to)).unwrap()
}

fn filter_named<'a>(listener: &'a Value, root_id: &str) -> &'a Value {
    let filters = hcm_config(listener)["http_filters"].as_array().unwrap();
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names.last(),
        Some(&ROUTER),
        "router must stay last: {names:?}"
    );
    filters
        .iter()
        .find(|f| f["typed_config"]["config"]["root_id"] == root_id)
        .unwrap_or_else(|| panic!("no wasm filter with root_id {root_id} in {names:?}"))
}

/// A header_mutation filter that removes both destination headers comes before the wasm
/// filter with `root_id`.
fn strips_destination_before(listener: &Value, root_id: &str) {
    let filters = hcm_config(listener)["http_filters"].as_array().unwrap();
    let wasm_at = filters
        .iter()
        .position(|f| f["typed_config"]["config"]["root_id"] == root_id)
        .expect("the wasm filter");
    let strips = |f: &Value| {
        let removed: Vec<&str> = f["typed_config"]["mutations"]["request_mutations"]
            .as_array()
            .map(|m| m.iter().filter_map(|x| x["remove"].as_str()).collect())
            .unwrap_or_default();
        f["typed_config"]["@type"]
            == "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
            && removed.contains(&"x-gateway-destination-endpoint")
            && removed.contains(&"x-gateway-destination-endpoint-served")
    };
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    assert!(
        filters[..wasm_at].iter().any(strips),
        "no strip of the destination headers before the filter: {names:?}"
    );
}

fn as_u64(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str()?.parse().ok())
}

/// What bounds a request body on the route to `cluster`: (the stream's buffer limit, the
/// listener's per-connection limit, which is also the most one socket read hands the filter
/// chain). The stream limit is the route's `request_body_buffer_limit`, else its virtual
/// host's, else the listener's (Envoy >= 1.37 applies it once the route is matched, so it
/// holds while the filter buffers).
fn body_buffer_limits(listener: &Value, cluster: &str) -> (u64, u64) {
    let read = listener
        .get("per_connection_buffer_limit_bytes")
        .map_or(ENVOY_DEFAULT_CONNECTION_BUFFER, |v| as_u64(v).unwrap());
    let mut limits = Vec::new();
    let vhosts = hcm_config(listener)["route_config"]["virtual_hosts"]
        .as_array()
        .unwrap();
    for vh in vhosts {
        for r in vh["routes"].as_array().unwrap() {
            if r["route"]["cluster"] == cluster {
                let own = r
                    .get("request_body_buffer_limit")
                    .or_else(|| vh.get("request_body_buffer_limit"));
                limits.push(own.map_or(read, |v| as_u64(v).unwrap()));
            }
        }
    }
    (
        limits.into_iter().min().expect("no route to the models"),
        read,
    )
}

/// Whether Envoy leaves a body the filter still holds alone: the route buffers at least the
/// plugin's `maxBodyBytes` plus one listener read (the most a chunked body can grow past
/// `maxBodyBytes` before the filter lets it go unrouted).
fn body_buffer_fits(boot: &Value, cluster: &str) -> Result<(), String> {
    let listener = &boot["static_resources"]["listeners"][0];
    let plugin = &filter_named(listener, "tokenaware")["typed_config"]["config"]["configuration"];
    let max = parse_config(
        "assembled plugin configuration",
        plugin["value"].as_str().unwrap(),
    )
    .max_body_bytes;
    let (stream, read) = body_buffer_limits(listener, cluster);
    if stream >= max + read {
        Ok(())
    } else {
        Err(format!(
            "body buffer {stream} < maxBodyBytes {max} + listener {read}"
        ))
    }
}

/// `filter` without the patches `keep` refuses.
fn without_patches(filter: &Value, list: &str, keep: impl Fn(&Value) -> bool) -> Value {
    let mut f = filter.clone();
    let patches = f["spec"][list].as_array_mut().unwrap();
    let before = patches.len();
    patches.retain(keep);
    assert!(patches.len() < before, "nothing removed");
    f
}

fn istio_clusters() -> Value {
    one_doc(&examples().join("istio/clusters.yaml"), "EnvoyFilter")
}

fn eg_patch_policy() -> Value {
    one_doc(
        &examples().join("envoy-gateway/patch-policy.yaml"),
        "EnvoyPatchPolicy",
    )
}

/// Installed as a WasmPlugin (UNSPECIFIED_PHASE), the filter is placed by istiod before the
/// router ahead of any EnvoyFilter patch; filter.yaml's strip patch, applied after, must
/// still land ahead of it (else it would remove the endpoint the filter sets).
#[test]
fn the_strip_patch_runs_ahead_of_a_wasmplugin_too() {
    let (mut listener, _) = istio_generated();
    let plugin = one_doc(&examples().join("istio/wasmplugin.yaml"), "WasmPlugin");
    assert_eq!(plugin["spec"]["phase"], "UNSPECIFIED_PHASE");
    let root_id = plugin["spec"]["pluginName"].as_str().unwrap();
    let wasm = json!({"name": "istio.wasm.tokenaware", "typed_config": {
        "@type": WASM_TYPE, "config": {"root_id": root_id}}});
    let filters = http_filters(&mut listener);
    let router_at = filters.len() - 1;
    filters.insert(router_at, wasm);
    let strip = patches(&istio_filter())
        .iter()
        .find(|p| p["patch"]["value"]["name"] == "tokenaware-strip-destination")
        .unwrap()
        .clone();
    let filters = http_filters(&mut listener);
    match strip["patch"]["operation"].as_str().unwrap() {
        "INSERT_FIRST" => filters.insert(0, strip["patch"]["value"].clone()),
        "INSERT_BEFORE" => filters.insert(filters.len() - 1, strip["patch"]["value"].clone()),
        op => panic!("unexpected operation {op}"),
    }
    strips_destination_before(&listener, root_id);
}

#[test]
fn istio_patches_give_a_valid_envoy_config() {
    if !have_envoy() {
        return;
    }
    let clusters = istio_clusters();
    let boot = istio_bootstrap(&istio_filter(), &clusters, &wasm_path());
    let listener = &boot["static_resources"]["listeners"][0];
    let f = filter_named(listener, "tokenaware");
    assert_eq!(
        f["typed_config"]["config"]["allow_on_headers_stop_iteration"],
        true
    );
    // Client-sent destination headers go before the filter runs (or is skipped, failed open).
    strips_destination_before(listener, "tokenaware");
    let cs = boot["static_resources"]["clusters"].as_array().unwrap();
    let model = cs
        .iter()
        .find(|c| c["name"] == ISTIO_MODEL_CLUSTER)
        .unwrap();
    // Istio's own fields survive the merge.
    assert_eq!(model["lb_policy"], "LEAST_REQUEST");
    assert!(model["circuit_breakers"].is_object() && model["metadata"].is_object());
    assert_eq!(
        model["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"],
        "envoy.load_balancing_policies.override_host"
    );
    assert!(cs.iter().any(|c| c["name"] == "tokenaware_admin"));
    // The models' virtual host buffers a whole body; Istio's default listener alone would not.
    body_buffer_fits(&boot, ISTIO_MODEL_CLUSTER).unwrap();
    let plain = without_patches(&clusters, "configPatches", |p| {
        p["applyTo"] != "VIRTUAL_HOST"
    });
    let e = body_buffer_fits(
        &istio_bootstrap(&istio_filter(), &plain, &wasm_path()),
        ISTIO_MODEL_CLUSTER,
    )
    .unwrap_err();
    assert!(
        e.contains(&format!("body buffer {ENVOY_DEFAULT_CONNECTION_BUFFER} <")),
        "{e}"
    );
    let mut boot = boot;
    fail_closed(&mut boot);
    envoy_validate("istio", &boot).unwrap();
    // The module really checks the embedded configuration during validation.
    let e = envoy_validate("istio-bad-config", &with_bad_plugin_config(&boot)).unwrap_err();
    assert!(e.contains("Wasm"), "{e}");

    // Envoy itself rejects a misspelled field in the merged cluster.
    let text = serde_json::to_string(&boot).unwrap();
    assert!(text.contains("override_host_sources"));
    let bad: Value =
        serde_json::from_str(&text.replace("override_host_sources", "override_host_source"))
            .unwrap();
    let e = envoy_validate("istio-bad", &bad).unwrap_err();
    assert!(e.contains("override_host_source"), "{e}");
}

/// The `peers` section examples/istio/README.md adds to the plugin configuration (its one
/// JSON block).
fn istio_peers_section() -> Value {
    let text = std::fs::read_to_string(examples().join("istio/README.md")).unwrap();
    let blocks: Vec<&str> = text.split("```json\n").skip(1).collect();
    assert_eq!(
        blocks.len(),
        1,
        "one JSON block expected in istio/README.md"
    );
    let block = blocks[0].split("```").next().unwrap();
    serde_json::from_str(&format!("{{{block}}}")).unwrap()
}

/// filter.yaml with what examples/istio/README.md adds for `peers`: the section in the
/// plugin configuration, and `host_env_keys` for the token's variable.
fn istio_filter_with_peers(peers: &Value) -> Value {
    let mut filter = istio_filter();
    let patch = filter["spec"]["configPatches"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["applyTo"] == "EXTENSION_CONFIG")
        .unwrap();
    let config = &mut patch["patch"]["value"]["typed_config"]["config"];
    let value = &mut config["configuration"]["value"];
    let mut plugin: Value = serde_json::from_str(value.as_str().unwrap()).unwrap();
    plugin["peers"] = peers["peers"].clone();
    *value = Value::String(plugin.to_string());
    let key = peers["peers"]["tokenEnv"].clone();
    config["vm_config"]["environment_variables"] = json!({ "host_env_keys": [key] });
    filter
}

#[test]
fn istio_peers_give_a_valid_envoy_config() {
    if !have_envoy() {
        return;
    }
    let section = istio_peers_section();
    let peers = &section["peers"];
    let mut clusters = istio_clusters();
    let peer_patches = patches(&one_doc(
        &examples().join("istio/peers.yaml"),
        "EnvoyFilter",
    ))
    .clone();
    clusters["spec"]["configPatches"]
        .as_array_mut()
        .unwrap()
        .extend(peer_patches);
    let mut boot = istio_bootstrap(&istio_filter_with_peers(&section), &clusters, &wasm_path());
    // The section names the cluster peers.yaml adds and the admin cluster of clusters.yaml;
    // polls are pinned to one pod by the header the filter sets.
    let cs = boot["static_resources"]["clusters"].as_array().unwrap();
    let named = |n: &Value| cs.iter().find(|c| c["name"] == *n);
    let group = named(&peers["cluster"]).expect("the peers cluster");
    assert_eq!(group["type"], "STRICT_DNS");
    let lb = &group["load_balancing_policy"]["policies"][0]["typed_extension_config"];
    assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
    assert_eq!(
        lb["typed_config"]["override_host_sources"][0]["header"],
        tokenaware::filter::http::DESTINATION
    );
    assert!(named(&peers["adminCluster"]).is_some());
    fail_closed(&mut boot);
    let var = peers["tokenEnv"].as_str().unwrap();
    envoy_validate_env(
        "istio-peers",
        &boot,
        &[(var, Some("a-shared-secret-0123456789"))],
    )
    .unwrap();
    // A pod without the variable: the module refuses the configuration, naming the field.
    let e = envoy_validate_env("istio-peers-no-token", &boot, &[(var, None)]).unwrap_err();
    assert!(e.contains("peers.tokenEnv"), "{e}");
}

#[test]
fn envoy_gateway_patches_give_a_valid_envoy_config() {
    if !have_envoy() {
        return;
    }
    let epp = eg_patch_policy();
    let boot = eg_bootstrap(&eg_extension_policy(), &epp, &wasm_path());
    let listener = &boot["static_resources"]["listeners"][0];
    let f = filter_named(listener, "tokenaware");
    assert_eq!(
        f["typed_config"]["config"]["allow_on_headers_stop_iteration"],
        true
    );
    // Client-sent destination headers go before the filter runs (or is skipped, failed open).
    strips_destination_before(listener, "tokenaware");
    let cs = boot["static_resources"]["clusters"].as_array().unwrap();
    let model = cs.iter().find(|c| c["name"] == EG_MODEL_CLUSTER).unwrap();
    assert_eq!(
        model["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"],
        "envoy.load_balancing_policies.override_host"
    );
    assert!(cs.iter().any(|c| c["name"] == "tokenaware_admin"));
    assert!(model["common_lb_config"]
        .get("locality_weighted_lb_config")
        .is_none());
    // The route to the models buffers a whole body; Envoy Gateway's 32 KiB listener alone
    // would not.
    body_buffer_fits(&boot, EG_MODEL_CLUSTER).unwrap();
    let plain = without_patches(&epp, "jsonPatches", |p| p["type"] != ROUTE_TYPE);
    let e = body_buffer_fits(
        &eg_bootstrap(&eg_extension_policy(), &plain, &wasm_path()),
        EG_MODEL_CLUSTER,
    )
    .unwrap_err();
    assert!(e.contains("body buffer 32768 <"), "{e}");
    let mut boot = boot;
    fail_closed(&mut boot);
    envoy_validate("envoy-gateway", &boot).unwrap();
    let e = envoy_validate("eg-bad-config", &with_bad_plugin_config(&boot)).unwrap_err();
    assert!(e.contains("Wasm"), "{e}");

    // Without the `remove` patch Envoy refuses the cluster Envoy Gateway generates.
    let partial = without_patches(&epp, "jsonPatches", |p| p["operation"]["op"] != "remove");
    let mut boot = eg_bootstrap(&eg_extension_policy(), &partial, &wasm_path());
    fail_closed(&mut boot);
    let e = envoy_validate("envoy-gateway-no-remove", &boot).unwrap_err();
    assert!(e.contains("cannot be combined"), "{e}");
}

// === (d) the assembled configs, run: a prompt over the listener limit is served ===

/// Runs `boot` (fail closed, so a VM that failed to load cannot pass requests untouched) on
/// loopback in front of a two-endpoint fleet and POSTs a chat body of about `bytes`:
/// its status, and whether the filter routed it or Envoy answered 413.
fn serve_prompt(mut boot: Value, model_cluster: &str, bytes: usize) -> (Option<u16>, u64, u64) {
    fail_closed(&mut boot);
    let fleet = wasm_tests::fleet::Fleet::start_on_free_ports(
        wasm_tests::fleet::FleetConfig::scaled(2, 0.001),
    )
    .unwrap();
    let envoy = live::Live::start(&boot, model_cluster, &fleet.endpoints());
    // Endpoints come from admin /clusters (every 2 s); route only once they are known.
    envoy.wait_stat("tokenaware_discovery_ok", 1, Duration::from_secs(15));
    let body = support::chat(&support::system(0, bytes), "Summarise.");
    assert!(body.len() >= bytes);
    let status = envoy.post("llm.example.com", support::CHAT, &body);
    // The examples keep the default `statsFlushMs`: the count reaches Envoy on a tick.
    if status == Some(200) {
        envoy.wait_stat("tokenaware_requests_routed", 1, Duration::from_secs(5));
    }
    (
        status,
        envoy.stat("tokenaware_requests_routed"),
        envoy.stat("downstream_rq_too_large"),
    )
}

/// Envoy Gateway reads 32 KiB per connection: a 200 KB prompt (about 50k tokens) gets Envoy's
/// 413 while the filter holds it, unless the route's body buffer is raised.
#[test]
fn envoy_gateway_example_serves_a_200_kb_prompt() {
    if !have_envoy() {
        return;
    }
    let (eep, epp) = (eg_extension_policy(), eg_patch_policy());
    let boot = eg_bootstrap(&eep, &epp, &wasm_path());
    let (status, routed, too_large) = serve_prompt(boot, EG_MODEL_CLUSTER, 200_000);
    assert_eq!((status, routed, too_large), (Some(200), 1, 0));

    let plain = without_patches(&epp, "jsonPatches", |p| p["type"] != ROUTE_TYPE);
    let boot = eg_bootstrap(&eep, &plain, &wasm_path());
    let (status, routed, too_large) = serve_prompt(boot, EG_MODEL_CLUSTER, 200_000);
    assert_eq!((routed, too_large), (0, 1), "status {status:?}");
    // The 413, unless Envoy reset the connection while the body was still being sent.
    assert!(matches!(status, Some(413) | None), "{status:?}");
}

/// Istio's gateway listeners keep Envoy's 1 MiB per connection (unless the EDGE profile
/// lowers it): a 1.5 MB prompt gets Envoy's 413 unless the virtual host's body buffer is
/// raised.
/// A mesh gateway holds a cluster for every service it can reach: with 4,000 of them,
/// admin's whole `/clusters?format=json` runs past the 4 MiB the filter reads. Discovery
/// asks for the model cluster alone, so it still finds its endpoints and routes.
#[test]
fn istio_discovery_finds_its_cluster_among_thousands() {
    if !have_envoy() {
        return;
    }
    let mut boot = istio_bootstrap(&istio_filter(), &istio_clusters(), &wasm_path());
    let clusters = boot["static_resources"]["clusters"].as_array_mut().unwrap();
    for i in 0..4_000u16 {
        let name = format!("outbound|8080||svc-{i}.ns-{}.svc.cluster.local", i % 40);
        clusters.push(json!({
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": { "cluster_name": name, "endpoints": [{ "lb_endpoints": [
                endpoint(&format!("10.{}.{}.{}", i / 250, i % 250, 7), 8080)] }] },
        }));
    }
    let (status, routed, too_large) = serve_prompt(boot, ISTIO_MODEL_CLUSTER, 10_000);
    assert_eq!((status, routed, too_large), (Some(200), 1, 0));
}

#[test]
fn istio_example_serves_a_1_5_mb_prompt() {
    if !have_envoy() {
        return;
    }
    let clusters = istio_clusters();
    let boot = istio_bootstrap(&istio_filter(), &clusters, &wasm_path());
    let (status, routed, too_large) = serve_prompt(boot, ISTIO_MODEL_CLUSTER, 1_500_000);
    assert_eq!((status, routed, too_large), (Some(200), 1, 0));

    let plain = without_patches(&clusters, "configPatches", |p| {
        p["applyTo"] != "VIRTUAL_HOST"
    });
    let boot = istio_bootstrap(&istio_filter(), &plain, &wasm_path());
    let (status, routed, too_large) = serve_prompt(boot, ISTIO_MODEL_CLUSTER, 1_500_000);
    assert_eq!((routed, too_large), (0, 1), "status {status:?}");
    // The 413, unless Envoy reset the connection while the body was still being sent.
    assert!(matches!(status, Some(413) | None), "{status:?}");
}

//! The monitoring examples hold together:
//! - `examples/prometheus/alerts.yaml`: every rule has an alert name, an expression, a
//!   severity and a summary, and a unit test; `promtool check rules` accepts them and
//!   `promtool test rules` passes their tests (`alerts.test.yaml`: each alert fires for a
//!   gateway in trouble, not for a healthy one);
//! - `examples/grafana/tokenaware.json`: every panel has a title, a place and queries, and
//!   each query (Grafana's variables filled in) is PromQL that promtool accepts;
//! - every metric either names is one a real Envoy with the filter exports on admin
//!   `/stats/prometheus`, and each name pattern (`__name__=~"…"`) matches one: a renamed stat
//!   would break them silently otherwise.
//!
//! Envoy and promtool (under `.tools/bin`) come from scripts/setup.sh; without them the
//! checks that need them are skipped unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use wasm_tests::envoy::{have_envoy, repo_root};

mod support;

fn examples() -> PathBuf {
    repo_root().join("examples")
}

fn rules() -> Value {
    let text = std::fs::read_to_string(examples().join("prometheus/alerts.yaml")).unwrap();
    serde_norway::from_str(&text).unwrap()
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(examples().join("grafana/tokenaware.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every rule of every group.
fn each_rule(doc: &Value) -> Vec<&Value> {
    let groups = doc["groups"].as_array().expect("groups");
    groups
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .collect()
}

/// Every query of every panel but rows, with Grafana's variables filled in.
fn dashboard_queries(d: &Value) -> Vec<String> {
    let panels = d["panels"].as_array().expect("panels");
    panels
        .iter()
        .filter(|p| p["type"] != "row")
        .flat_map(|p| p["targets"].as_array().expect("targets").iter())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("expr")
                .replace("$__rate_interval", "5m")
                .replace("$instance", ".*")
        })
        .collect()
}

/// The metric names in `text` (a histogram's series named by its metric), and the name
/// patterns (`__name__=~"…"`).
fn metric_names(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut patterns = BTreeSet::new();
    let mut rest = String::new();
    let mut tail = text;
    while let Some(i) = tail.find("__name__=~\"") {
        rest.push_str(&tail[..i]);
        let after = &tail[i + 11..];
        let end = after.find('"').expect("a closed pattern");
        patterns.insert(after[..end].to_string());
        tail = &after[end..];
    }
    rest.push_str(tail);
    // Label matchers (`{prefix!="admin"}`) name labels, not metrics.
    let mut depth = 0usize;
    let rest: String = rest
        .chars()
        .filter(|&c| {
            match c {
                '{' => depth += 1,
                '}' => depth = depth.saturating_sub(1),
                _ => return depth == 0,
            }
            false
        })
        .collect();
    let names = rest
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tokenaware_") || w.starts_with("envoy_"))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| w.strip_suffix(s))
                .unwrap_or(w)
                .to_string()
        })
        .collect();
    (names, patterns)
}

#[test]
fn every_rule_is_complete() {
    let doc = rules();
    let rules = each_rule(&doc);
    assert!(rules.len() >= 6, "{} rules", rules.len());
    let mut names = BTreeSet::new();
    for r in rules {
        let name = r["alert"].as_str().expect("alert name");
        assert!(names.insert(name.to_string()), "{name} twice");
        assert!(r["expr"].as_str().is_some_and(|e| !e.trim().is_empty()));
        let severity = r["labels"]["severity"].as_str().unwrap_or("");
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        assert!(r["annotations"]["summary"].is_string(), "{name}: summary");
    }
    // Every alert has a unit test.
    let tests = std::fs::read_to_string(examples().join("prometheus/alerts.test.yaml")).unwrap();
    for name in &names {
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "{name} has no test"
        );
    }
}

#[test]
fn every_panel_is_complete() {
    let d = dashboard();
    assert_eq!(d["uid"], "tokenaware");
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().expect("title");
        assert!(
            ids.insert(p["id"].as_u64().expect("id")),
            "{title}: id twice"
        );
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
        assert!(x + w <= 24 && g["h"].as_u64().unwrap() > 0, "{title}: {g}");
        if p["type"] != "row" {
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{title}: no query");
            assert!(p["description"].is_string(), "{title}: description");
        }
    }
    assert!(dashboard_queries(&d).len() >= 20);
}

#[test]
fn the_metric_names_are_the_ones_envoy_exports() {
    if !require(have_envoy(), "Envoy") {
        return;
    }
    let exported = exported_names();
    let doc = rules();
    let mut texts = Vec::new();
    for r in each_rule(&doc) {
        strings(r, &mut texts);
    }
    texts.extend(dashboard_queries(&dashboard()));
    let (mut names, mut patterns) = (BTreeSet::new(), BTreeSet::new());
    for t in &texts {
        let (n, p) = metric_names(t);
        names.extend(n);
        patterns.extend(p);
    }
    assert!(
        names.len() >= 20 && patterns.len() >= 4,
        "{names:?} {patterns:?}"
    );
    let missing: Vec<_> = names.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "not exported by Envoy: {missing:?}\nexported: {:?}",
        exported
            .iter()
            .filter(|t| t.contains("tokenaware") || t.starts_with("envoy_http_downstream"))
            .collect::<Vec<_>>()
    );
    for p in &patterns {
        assert!(
            exported.iter().any(|n| matches_pattern(n, p)),
            "no exported metric matches {p}"
        );
    }
}

/// Every string in `v` (a rule's expression and annotations).
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(m) => m.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

/// The names a real Envoy with the filter exports (`# TYPE name kind` lines name every
/// metric, zero or not), once its per-endpoint gauges are there. With `peers` and learning
/// on, every stat the filter has is defined.
fn exported_names() -> BTreeSet<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let nobody = wasm_tests::ports::free_ports(1).unwrap()[0];
        let extra = r#""peakPrefillThroughput":"auto","peers":{"clusters":["peer"],"intervalMs":60000,"token":"monitoring-test-token"}"#;
        let gw = support::start_with(
            wasm_tests::fleet::FleetConfig::scaled(1, 1.0),
            support::wasm_path(),
            |mut g| {
                g.peer_clusters = vec![("peer".into(), format!("127.0.0.1:{nobody}"))];
                g
            },
            |eps| support::plugin_config(eps, extra),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let (status, text) = gw.envoy.admin_get("/stats/prometheus").unwrap();
            assert_eq!(status, 200);
            let names: BTreeSet<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("# TYPE "))
                .filter_map(|l| l.split_whitespace().next())
                .map(String::from)
                .collect();
            if names.contains("tokenaware_endpoint_0_inflight_tokens") {
                return names;
            }
            assert!(Instant::now() < deadline, "no per-endpoint gauge: {names:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Whether `name` matches a `__name__` pattern of the forms used here: literal text, `.+`
/// and `[0-9]+`, anchored at both ends as PromQL anchors it.
fn matches_pattern(name: &str, pattern: &str) -> bool {
    fn at(name: &[u8], pat: &[u8]) -> bool {
        if pat.is_empty() {
            return name.is_empty();
        }
        let (class, rest): (fn(u8) -> bool, &[u8]) = if let Some(r) = pat.strip_prefix(b".+") {
            (|_| true, r)
        } else if let Some(r) = pat.strip_prefix(b"[0-9]+") {
            (|c| c.is_ascii_digit(), r)
        } else {
            return name.first() == pat.first() && at(&name[1..], &pat[1..]);
        };
        (1..=name.len())
            .take_while(|&k| class(name[k - 1]))
            .any(|k| at(&name[k..], rest))
    }
    at(name.as_bytes(), pattern.as_bytes())
}

#[test]
fn name_patterns_match_as_promql_does() {
    assert!(matches_pattern(
        "tokenaware_endpoint_12_inflight_tokens",
        "tokenaware_endpoint_[0-9]+_inflight_tokens"
    ));
    assert!(!matches_pattern(
        "tokenaware_endpoint__inflight_tokens",
        "tokenaware_endpoint_[0-9]+_inflight_tokens"
    ));
    assert!(!matches_pattern(
        "tokenaware_endpoint_1_inflight_tokens_x",
        "tokenaware_endpoint_[0-9]+_inflight_tokens"
    ));
    assert!(matches_pattern(
        "tokenaware_fallback_store",
        "tokenaware_fallback_.+"
    ));
    assert!(!matches_pattern(
        "tokenaware_fallback_",
        "tokenaware_fallback_.+"
    ));
}

#[test]
fn promtool_accepts_the_rules_and_the_queries_and_the_tests_pass() {
    let Some(promtool) = promtool() else {
        require(false, "promtool (scripts/setup.sh)");
        return;
    };
    let dir = examples().join("prometheus");
    let run = |args: &[&str], dir: &Path| {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["check", "rules", "alerts.yaml"], &dir);
    run(&["test", "rules", "alerts.test.yaml"], &dir);
    // The dashboard's queries, each as a recording rule: promtool parses every one.
    let tmp = std::env::temp_dir().join(format!("tokenaware-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let rules: Vec<Value> = dashboard_queries(&dashboard())
        .into_iter()
        .enumerate()
        .map(|(i, q)| serde_json::json!({"record": format!("tokenaware:panel_query_{i}"), "expr": q}))
        .collect();
    let doc = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    // JSON is YAML.
    std::fs::write(tmp.join("dashboard.yaml"), doc.to_string()).unwrap();
    run(&["check", "rules", "dashboard.yaml"], &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// promtool where scripts/setup.sh puts it, else on the PATH.
fn promtool() -> Option<PathBuf> {
    let tools = repo_root().join(".tools/bin/promtool");
    if tools.is_file() {
        return Some(tools);
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|d| d.join("promtool"))
        .find(|p| Path::new(p).is_file())
}

/// Whether a tool is there; a missing one fails the test when tools are required.
fn require(present: bool, what: &str) -> bool {
    if !present {
        assert!(
            std::env::var_os("TOKENAWARE_REQUIRE_ENVOY").is_none(),
            "{what} not installed (run scripts/setup.sh)"
        );
        eprintln!("skipping: {what} not installed");
    }
    present
}

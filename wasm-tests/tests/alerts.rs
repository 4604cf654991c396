//! The Prometheus alerting rules in `examples/prometheus/` hold together:
//! - every rule has an alert name, an expression, a severity and a summary;
//! - every `tokenaware_*` metric they name is one a real Envoy with the filter exports on
//!   admin `/stats/prometheus` (a renamed stat breaks the rules silently otherwise);
//! - `promtool check rules` accepts them and `promtool test rules` passes their unit tests
//!   (`alerts.test.yaml`: each alert fires for a gateway in trouble, not for a healthy one).
//!
//! Envoy and promtool (under `.tools/bin`) come from scripts/setup.sh; without them the checks that need them
//! are skipped unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use wasm_tests::envoy::{have_envoy, repo_root};

mod support;

fn rules_dir() -> PathBuf {
    repo_root().join("examples/prometheus")
}

fn rules() -> Value {
    let text = std::fs::read_to_string(rules_dir().join("alerts.yaml")).unwrap();
    serde_norway::from_str(&text).unwrap()
}

/// Every rule of every group.
fn each_rule(doc: &Value) -> Vec<&Value> {
    let groups = doc["groups"].as_array().expect("groups");
    groups
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .collect()
}

/// The metric names in `text`: identifiers starting `tokenaware_` or `envoy_` (a
/// histogram's series named by its metric).
fn metric_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tokenaware_") || w.starts_with("envoy_"))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| w.strip_suffix(s))
                .unwrap_or(w)
                .to_string()
        })
        .collect()
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
    let tests = std::fs::read_to_string(rules_dir().join("alerts.test.yaml")).unwrap();
    for name in &names {
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "{name} has no test"
        );
    }
}

#[test]
fn the_metric_names_are_the_ones_envoy_exports() {
    if !require(have_envoy(), "Envoy") {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let exported = rt.block_on(async {
        let gw = support::start(support::fleet(1, 1.0), |eps| {
            support::plugin_config(eps, "")
        })
        .await;
        let (status, text) = gw.envoy.admin_get("/stats/prometheus").unwrap();
        assert_eq!(status, 200);
        text
    });
    // `# TYPE name kind` lines name every metric, zero or not.
    let types: BTreeSet<String> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect();
    let doc = rules();
    let named: BTreeSet<String> = each_rule(&doc)
        .iter()
        .flat_map(|r| metric_names(&serde_json::to_string(r).unwrap()))
        .collect();
    assert!(named.len() >= 10, "{named:?}");
    let missing: Vec<_> = named.difference(&types).collect();
    assert!(
        missing.is_empty(),
        "not exported by Envoy: {missing:?}\nexported: {:?}",
        types
            .iter()
            .filter(|t| t.contains("tokenaware") || t.starts_with("envoy_http_downstream"))
            .collect::<Vec<_>>()
    );
}

#[test]
fn promtool_accepts_the_rules_and_their_tests_pass() {
    if !require(promtool().is_some(), "promtool (Debian prometheus)") {
        return;
    }
    let dir = rules_dir();
    for args in [
        ["check", "rules", "alerts.yaml"],
        ["test", "rules", "alerts.test.yaml"],
    ] {
        let out = Command::new(promtool().unwrap_or_default())
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
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

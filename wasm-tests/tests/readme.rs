//! The README's reference tables against the code: every configuration field the parser
//! accepts (top level and nested), every policy, gate, scorer and preset name, and every stat
//! the filter defines must appear in README.md. The lists come from the code itself: field
//! and variant names from serde's "expected one of" errors (the config denies unknown
//! fields), stat names from the filter's stat enums, plus a scan of the filter's sources for
//! `"tokenaware_…"` literals so a stat defined elsewhere is caught too.

use std::path::PathBuf;

use tokenaware::config::{Config, PRESETS};
use tokenaware::filter::stats::{
    endpoint_gauge_name, Counter, Fallback, FOREIGN_REQUESTS, HIT_RATIO, PEERS, SHARED_PREFIXES,
    TOKEN_ESTIMATE, VMS, VM_MEMORY, VM_MEMORY_MAX,
};
use tokenaware::policy::Reason;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("README.md")
}

/// First cells of every markdown table row.
fn first_cells(md: &str) -> Vec<String> {
    md.lines()
        .filter_map(|l| l.trim().strip_prefix('|'))
        .filter_map(|l| l.split('|').next())
        .map(|c| c.trim().to_string())
        .collect()
}

/// The names serde lists after "expected one of" (or "expected" for a single one) when it
/// rejects `json`.
fn expected_names(json: &str) -> Vec<String> {
    let e = Config::from_json(json.as_bytes()).expect_err("the probe must be rejected");
    let msg = e.problem;
    let tail = msg
        .split_once("expected one of")
        .or_else(|| msg.split_once("expected"))
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("no expected names in {msg:?}"));
    let tail = tail.split(" at line").next().unwrap_or(tail);
    let names: Vec<String> = tail
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    assert!(!names.is_empty(), "no names in {msg:?}");
    names
}

#[test]
fn every_config_field_is_in_the_reference_table() {
    let md = readme();
    let cells = first_cells(&md);
    let probe = r#""__probe__":1"#;
    let mut fields: Vec<String> = expected_names(&format!("{{{probe}}}"));
    assert!(fields.len() >= 20, "{fields:?}");
    assert!(fields.contains(&"maxTTFTPenaltyMs".to_string()));
    for (parent, json) in [
        ("discovery", format!(r#"{{"discovery":{{{probe}}}}}"#)),
        ("metrics", format!(r#"{{"metrics":{{{probe}}}}}"#)),
        ("peers", format!(r#"{{"peers":{{{probe}}}}}"#)),
        ("endpoints[]", format!(r#"{{"endpoints":[{{{probe}}}]}}"#)),
    ] {
        let nested = expected_names(&json);
        assert!(nested.len() >= 2, "{parent}: {nested:?}");
        fields.extend(nested.into_iter().map(|f| format!("{parent}.{f}")));
    }
    let missing: Vec<&String> = fields
        .iter()
        .filter(|f| !cells.contains(&format!("`{f}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's configuration table has no row for {missing:?}"
    );
}

#[test]
fn every_enum_value_and_preset_is_documented() {
    let md = readme();
    for field in ["policy", "gate", "scorer"] {
        for v in expected_names(&format!(r#"{{"{field}":"__probe__"}}"#)) {
            assert!(
                md.contains(&format!("`{v}`")),
                "{field} value `{v}` not in README.md"
            );
        }
    }
    let cells = first_cells(&md);
    for p in PRESETS {
        assert!(
            cells.contains(&format!("`{}`", p.name)),
            "preset `{}` has no row in README.md's preset table",
            p.name
        );
    }
}

#[test]
fn every_stat_is_in_the_stats_table() {
    let md = readme();
    let cells = first_cells(&md);
    let mut names: Vec<String> = Vec::new();
    names.extend(
        Reason::ALL
            .iter()
            .map(|r| format!("tokenaware_decisions_{}", r.as_str())),
    );
    names.extend(
        Fallback::ALL
            .iter()
            .map(|f| format!("tokenaware_fallback_{}", f.as_str())),
    );
    names.extend(Counter::ALL.iter().map(|c| c.name().to_string()));
    names.push(HIT_RATIO.to_string());
    names.push(TOKEN_ESTIMATE.to_string());
    names.extend(
        [
            VM_MEMORY,
            VM_MEMORY_MAX,
            VMS,
            FOREIGN_REQUESTS,
            SHARED_PREFIXES,
            PEERS,
        ]
        .map(str::to_string),
    );
    let gauge = endpoint_gauge_name(7);
    assert_eq!(gauge, "tokenaware_endpoint_7_inflight_tokens");
    names.push(gauge.replace("_7_", "_<slot>_"));
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !cells.contains(&format!("`wasmcustom.{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's stats table has no row for {missing:?}"
    );

    // Any other "tokenaware_…" name literal in the filter (a stat defined outside the enums)
    // must be covered by a documented name: a format string's fixed prefix must start one.
    let dir = root().join("src/filter");
    for entry in std::fs::read_dir(&dir).expect("src/filter") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "rs")
            || path
                .file_name()
                .is_some_and(|n| n == "tests.rs" || n == "testing.rs")
        {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("source");
        for lit in src.split("\"tokenaware_").skip(1) {
            let Some(end) = lit.find('"') else { continue };
            let name = format!("tokenaware_{}", &lit[..end]);
            let fixed = name.split('{').next().unwrap_or(&name);
            assert!(
                names.iter().any(|n| n.starts_with(fixed)),
                "{}: stat {name:?} is not in README.md's stats table",
                path.display()
            );
        }
    }
}

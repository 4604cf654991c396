//! The vendored CRDs and a checker for the structural OpenAPI subset they use.

use std::collections::BTreeMap;

use serde_json::Value;
use wasm_tests::envoy::repo_root;

use super::yaml_docs;

/// (apiVersion, kind) → the `spec` schema of the vendored CRD.
pub fn crd_specs() -> BTreeMap<(String, String), Value> {
    let dir = repo_root().join("wasm-tests/fixtures/crds");
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        for crd in yaml_docs(&p) {
            let group = crd["spec"]["group"].as_str().unwrap().to_string();
            let kind = crd["spec"]["names"]["kind"].as_str().unwrap().to_string();
            for v in crd["spec"]["versions"].as_array().unwrap() {
                let api = format!("{group}/{}", v["name"].as_str().unwrap());
                let spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"].clone();
                assert!(spec.is_object(), "{}: no spec schema", p.display());
                out.insert((api, kind.clone()), spec);
            }
        }
    }
    out
}

/// Checks `v` against a structural OpenAPI schema (the subset CRDs use): unknown object
/// fields are errors unless `x-kubernetes-preserve-unknown-fields` is set; types, enums,
/// `required`, `items`, `additionalProperties` and `allOf` are checked.
pub fn check(schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    if v.is_null() && schema["nullable"] == true {
        return;
    }
    let ty_ok = match schema["type"].as_str() {
        None => true,
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => {
            v.is_string() || (schema["x-kubernetes-int-or-string"] == true && v.is_i64())
        }
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some(other) => {
            errs.push(format!("{path}: schema type {other} not understood"));
            true
        }
    };
    if !ty_ok {
        errs.push(format!("{path}: expected {}, got {v}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(v) {
            errs.push(format!("{path}: {v} is not one of {allowed:?}"));
        }
    }
    for sub in schema["allOf"].as_array().into_iter().flatten() {
        check(sub, v, path, errs);
    }
    match v {
        Value::Object(obj) => {
            for r in schema["required"].as_array().into_iter().flatten() {
                let r = r.as_str().unwrap_or_default();
                if !obj.contains_key(r) {
                    errs.push(format!("{path}: required field `{r}` missing"));
                }
            }
            let preserve = schema["x-kubernetes-preserve-unknown-fields"] == true;
            let props = schema["properties"].as_object();
            let extra = schema.get("additionalProperties").filter(|a| a.is_object());
            for (k, x) in obj {
                let here = format!("{path}.{k}");
                // Kubernetes prunes (strict decoding rejects) fields the schema does not
                // list, unless the node preserves unknown fields.
                match props.and_then(|p| p.get(k)).or(extra) {
                    Some(s) => check(s, x, &here, errs),
                    None if preserve => {}
                    None => errs.push(format!("{here}: unknown field")),
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, x) in items.iter().enumerate() {
                    check(s, x, &format!("{path}[{i}]"), errs);
                }
            }
        }
        _ => {}
    }
}

/// Errors of one Kubernetes resource against the vendored CRDs.
pub fn resource_errors(crds: &BTreeMap<(String, String), Value>, doc: &Value) -> Vec<String> {
    let api = doc["apiVersion"].as_str().unwrap_or_default().to_string();
    let kind = doc["kind"].as_str().unwrap_or_default().to_string();
    let Some(schema) = crds.get(&(api.clone(), kind.clone())) else {
        return vec![format!("no vendored CRD for {api} {kind}")];
    };
    let mut errs = Vec::new();
    for k in doc.as_object().into_iter().flat_map(|o| o.keys()) {
        if !["apiVersion", "kind", "metadata", "spec"].contains(&k.as_str()) {
            errs.push(format!("{kind}.{k}: unknown top-level field"));
        }
    }
    if doc["metadata"]["name"].as_str().is_none_or(str::is_empty) {
        errs.push(format!("{kind}: metadata.name missing"));
    }
    check(schema, &doc["spec"], &format!("{kind}.spec"), &mut errs);
    errs
}

//! What istiod and Envoy Gateway do to generated xDS, for the subset the examples use:
//! protobuf merge (EnvoyFilter MERGE), RFC 6902 add/remove (EnvoyPatchPolicy) and its
//! JSONPath selector.

use serde_json::{Map, Value};

/// Protobuf merge as Istio's MERGE applies it: messages merge field by field, repeated
/// fields append, scalars replace.
pub fn proto_merge(dst: &mut Value, src: &Value) {
    match (dst, src) {
        (Value::Object(d), Value::Object(s)) => {
            for (k, v) in s {
                match d.get_mut(k) {
                    Some(x) => proto_merge(x, v),
                    None => {
                        d.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(d), Value::Array(s)) => d.extend(s.iter().cloned()),
        (d, s) => *d = s.clone(),
    }
}

/// `$..KEY[?(@.A.B=='V')]`: JSON pointers of the elements of every `KEY` array whose
/// dotted field equals V (the JSONPath subset the example uses).
pub fn json_path(doc: &Value, expr: &str) -> Vec<String> {
    let rest = expr
        .strip_prefix("$..")
        .expect("only $.. paths are modelled");
    let (key, filter) = rest
        .split_once("[?(@.")
        .expect("only [?(@.x=='v')] filters");
    let filter = filter.strip_suffix(")]").unwrap();
    let (field, want) = filter.split_once("==").unwrap();
    let want = want.trim().trim_matches('\'');
    let mut out = Vec::new();
    fn walk(v: &Value, at: String, key: &str, field: &str, want: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    let here = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                    if k == key {
                        for (i, e) in x.as_array().into_iter().flatten().enumerate() {
                            let got = field.split('.').try_fold(e, |e, f| e.get(f));
                            if got.and_then(Value::as_str) == Some(want) {
                                out.push(format!("{here}/{i}"));
                            }
                        }
                    }
                    walk(x, here, key, field, want, out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, format!("{at}/{i}"), key, field, want, out);
                }
            }
            _ => {}
        }
    }
    walk(doc, String::new(), key, field.trim(), want, &mut out);
    out
}

/// RFC 6902 `add` creating missing objects on the way (Envoy Gateway applies patches with
/// EnsurePathExistsOnAdd).
pub fn pointer_add(doc: &mut Value, pointer: &str, value: Value) {
    let tokens: Vec<String> = pointer
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, parents) = tokens.split_last().expect("empty pointer");
    let mut at = doc;
    for t in parents {
        at = match at {
            Value::Array(a) => &mut a[t.parse::<usize>().unwrap()],
            Value::Object(o) => o
                .entry(t.clone())
                .or_insert_with(|| Value::Object(Map::new())),
            other => panic!("cannot descend into {other}"),
        };
    }
    match at {
        Value::Object(o) => {
            o.insert(last.clone(), value);
        }
        Value::Array(a) if last == "-" => a.push(value),
        Value::Array(a) => a.insert(last.parse().unwrap(), value),
        other => panic!("cannot add to {other}"),
    }
}

/// RFC 6902 `remove` (an absent target is an error, as in Envoy Gateway).
pub fn pointer_remove(doc: &mut Value, pointer: &str) -> Option<Value> {
    let (parent, last) = pointer.rsplit_once('/')?;
    let last = last.replace("~1", "/").replace("~0", "~");
    match doc.pointer_mut(parent)? {
        Value::Object(o) => o.remove(&last),
        Value::Array(a) => {
            let i: usize = last.parse().ok()?;
            (i < a.len()).then(|| a.remove(i))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_path_and_pointer_helpers() {
        let mut doc = json!({"a": {"http_filters": [{"x": {"id": "no"}}, {"x": {"id": "yes"}}]}});
        let found = json_path(&doc, "$..http_filters[?(@.x.id=='yes')]");
        assert_eq!(found, vec!["/a/http_filters/1".to_string()]);
        pointer_add(&mut doc, "/a/http_filters/1/x/deep/flag", json!(true));
        assert_eq!(doc["a"]["http_filters"][1]["x"]["deep"]["flag"], true);
        assert_eq!(
            pointer_remove(&mut doc, "/a/http_filters/0"),
            Some(json!({"x": {"id": "no"}}))
        );
        assert_eq!(pointer_remove(&mut doc, "/a/nothing"), None);
        let mut m = json!({"l": [1], "o": {"k": 1}});
        proto_merge(&mut m, &json!({"l": [2], "o": {"j": 2}}));
        assert_eq!(m, json!({"l": [1, 2], "o": {"k": 1, "j": 2}}));
    }
}

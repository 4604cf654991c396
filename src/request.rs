//! OpenAI request parsing: turns a completions, chat-completions or responses body into the
//! model, a few scheduling fields and the canonical prompt bytes the prefix hash runs over.
//! It leaves out tokenization, chat templates and validation the router does not need
//! (unknown fields are ignored), and never logs anything from the prompt.

use serde_json::{Map, Value};
use std::io::Write;
use xxhash_rust::xxh3::Xxh3;

mod borrowed;

const US: u8 = 0x1F;
const RS: u8 = 0x1E;

/// Which OpenAI endpoint a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    ChatCompletions,
    Responses,
}

impl ApiKind {
    /// Maps a request path (query string ignored) to a kind: "/v1/completions",
    /// "/v1/chat/completions", "/v1/responses". One trailing `/` is tolerated.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/completions" => Some(ApiKind::Completions),
            "/v1/chat/completions" => Some(ApiKind::ChatCompletions),
            "/v1/responses" => Some(ApiKind::Responses),
            _ => None,
        }
    }

    /// Stable snake_case label for stats and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::Completions => "completions",
            ApiKind::ChatCompletions => "chat_completions",
            ApiKind::Responses => "responses",
        }
    }
}

/// Bounds applied before any JSON parsing happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    pub max_body_bytes: usize,
    pub max_depth: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        ParseLimits {
            max_body_bytes: 8 * 1024 * 1024,
            max_depth: 64,
        }
    }
}

/// What the router needs from one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceRequest {
    pub model: String,
    /// Canonical prompt bytes (the only copy of the prompt kept).
    pub prompt: Vec<u8>,
    /// `Some(n)` when the prompt was given as token ids (exact token count).
    pub prompt_token_ids: Option<u64>,
    pub stream: bool,
    /// `max_tokens`, or `max_completion_tokens`, or `max_output_tokens`.
    pub max_tokens: Option<u64>,
    pub cache_salt: Option<String>,
    /// The prompt has parts that are not text (an image, audio, a file), each a short
    /// placeholder here: its bytes do not tell its tokens.
    pub media: bool,
}

/// Why a body was not routable by prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    TooLarge,
    NotJson,
    TooDeep,
    NotObject,
    NoModel,
    NoPrompt,
    /// The named field has a type the API does not allow.
    WrongType(&'static str),
}

impl ParseError {
    /// Stable snake_case label for stats.
    pub fn as_str(self) -> &'static str {
        match self {
            ParseError::TooLarge => "too_large",
            ParseError::NotJson => "not_json",
            ParseError::TooDeep => "too_deep",
            ParseError::NotObject => "not_object",
            ParseError::NoModel => "no_model",
            ParseError::NoPrompt => "no_prompt",
            ParseError::WrongType(_) => "wrong_type",
        }
    }
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::WrongType(field) => write!(f, "wrong_type: field `{field}`"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// Parses one request body of the given kind.
///
/// Canonical bytes (`US` = 0x1F, `RS` = 0x1E); appending a message only appends bytes:
/// - completions: a string is its UTF-8 bytes; a string array is joined with `RS` (so a
///   one-element array equals the plain string); token ids, flat or nested, are 4 little-endian
///   bytes each, concatenated, with `prompt_token_ids = Some(count)`.
/// - chat: compact JSON of a non-empty `tools` + `RS`, then per message `role US content`
///   `[US "tool_calls=" json][US "name=" name][US "tool_call_id=" id] RS`. Content is the string
///   or the text parts concatenated; other parts become `<type:xxh3_64 hex of payload JSON>`.
/// - responses: tools as in chat, `instructions` as a `system` record, then `input`: a string
///   as raw bytes, or items like chat messages (other items: `type US json RS`).
pub fn parse(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
) -> Result<InferenceRequest, ParseError> {
    if body.len() > limits.max_body_bytes {
        return Err(ParseError::TooLarge);
    }
    match kind {
        ApiKind::ChatCompletions => {
            if let Some((fields, prompt, media)) = borrowed::chat(body, limits.max_depth) {
                return Ok(request(fields, prompt, None, media));
            }
        }
        ApiKind::Completions => {
            if let Some((fields, prompt, ids)) = borrowed::completions(body, limits.max_depth) {
                return Ok(request(fields, prompt, ids, false));
            }
        }
        // No one-pass reader: a large body is read as a tree only when its shape keeps the
        // tree near the body's size (a long `input` string does; a flood of tiny values not).
        ApiKind::Responses if body.len() <= TREE_FALLBACK_BYTES || sparse(body) => {
            return parse_tree(kind, body, limits)
        }
        ApiKind::Responses => {}
    }
    if body.len() > TREE_FALLBACK_BYTES {
        // Valid JSON no one-pass reader took: an unusual shape, too large to build a tree
        // of. Checked for JSON without one, so the stats still tell garbage apart.
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                Ok(_) => ParseError::TooLarge,
                Err(e) if e.to_string().starts_with("recursion limit exceeded") => {
                    ParseError::TooDeep
                }
                Err(_) => ParseError::NotJson,
            },
        );
    }
    parse_tree(kind, body, limits)
}

/// The largest chat or completions body read as a JSON tree when the one-pass reader
/// refused it, and the largest responses body read as one whatever its shape: a tree takes
/// several times the body (a `Value` per token id) in the VM's linear memory, which never
/// shrinks, and any client can send an odd shape.
pub const TREE_FALLBACK_BYTES: usize = 1 << 20;

/// Bytes of tree charged per object and per other value, for [`sparse`]: more than the VM
/// (32-bit) spends on a small map's node and on a `Value`, so the estimate errs high.
const TREE_OBJECT_BYTES: usize = 512;
const TREE_VALUE_BYTES: usize = 32;

/// Whether a body's JSON tree, by an estimate that errs high, takes at most the body's size
/// beside its strings' bytes. Counts the `{`, `[` and `,` outside strings (each starts an
/// object or another value) in one pass; nothing allocated.
fn sparse(body: &[u8]) -> bool {
    let (mut objects, mut values) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => objects += 1,
            b',' | b'[' => values += 1,
            _ => {}
        }
    }
    let tree = objects
        .saturating_mul(TREE_OBJECT_BYTES)
        .saturating_add(values.saturating_mul(TREE_VALUE_BYTES));
    tree <= body.len()
}

/// `parse` by walking a JSON tree: every kind, every shape, and the error when there is one.
/// The reference reading: for a body within `limits.max_body_bytes` and at most
/// [`TREE_FALLBACK_BYTES`], `parse` gives exactly this, its one-pass readers included (the
/// `request` fuzz target checks it). It applies no size limit itself.
pub fn parse_tree(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
) -> Result<InferenceRequest, ParseError> {
    // serde_json stops at 128 levels with an error (no stack overflow); the tree walk then
    // applies the configured depth. Both cost nothing per byte, unlike a pre-scan.
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        if e.to_string().starts_with("recursion limit exceeded") {
            ParseError::TooDeep
        } else {
            ParseError::NotJson
        }
    })?;
    if deeper_than(&value, limits.max_depth) {
        return Err(ParseError::TooDeep);
    }
    let Value::Object(obj) = value else {
        return Err(ParseError::NotObject);
    };
    let model = opt_str(&obj, "model")?.filter(|m| !m.is_empty());
    let model = model.ok_or(ParseError::NoModel)?.to_owned();
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ParseError::WrongType("stream")),
    };
    let max_tokens = max_tokens(&obj)?;
    let cache_salt = opt_str(&obj, "cache_salt")?.map(str::to_owned);
    let mut out = Vec::with_capacity(body.len());
    let (prompt_token_ids, media) = match kind {
        ApiKind::Completions => (completions(&obj, &mut out)?, false),
        ApiKind::ChatCompletions => (None, chat(&obj, &mut out)?),
        ApiKind::Responses => (None, responses(&obj, &mut out)?),
    };
    let fields = Fields {
        model,
        stream,
        max_tokens,
        cache_salt,
    };
    Ok(request(fields, out, prompt_token_ids, media))
}

/// The scheduling fields, however the body was read.
struct Fields {
    model: String,
    stream: bool,
    max_tokens: Option<u64>,
    cache_salt: Option<String>,
}

fn request(
    f: Fields,
    mut prompt: Vec<u8>,
    prompt_token_ids: Option<u64>,
    media: bool,
) -> InferenceRequest {
    // Bodies that are mostly base64 media shrink a lot; do not hold the reservation.
    if prompt.capacity() > 2 * prompt.len() + 4096 {
        prompt.shrink_to_fit();
    }
    InferenceRequest {
        model: f.model,
        prompt,
        prompt_token_ids,
        stream: f.stream,
        max_tokens: f.max_tokens,
        cache_salt: f.cache_salt,
        media,
    }
}

/// True when arrays and objects nest more than `max_depth` levels.
fn deeper_than(v: &Value, max_depth: usize) -> bool {
    let below = |c: &Value| max_depth == 0 || deeper_than(c, max_depth - 1);
    match v {
        Value::Array(a) => a.iter().any(below),
        Value::Object(o) => o.values().any(below),
        _ => false,
    }
}

/// A string field; null counts as absent.
fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    field: &'static str,
) -> Result<Option<&'a str>, ParseError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ParseError::WrongType(field)),
    }
}

/// First present of the three output-length fields; null counts as absent.
fn max_tokens(obj: &Map<String, Value>) -> Result<Option<u64>, ParseError> {
    for field in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
        match obj.get(field) {
            None | Some(Value::Null) => continue,
            Some(v) => return v.as_u64().map(Some).ok_or(ParseError::WrongType(field)),
        }
    }
    Ok(None)
}

/// Completions `prompt`; returns the token count when the prompt was token ids.
fn completions(obj: &Map<String, Value>, out: &mut Vec<u8>) -> Result<Option<u64>, ParseError> {
    const WRONG: ParseError = ParseError::WrongType("prompt");
    let items = match obj.get("prompt") {
        None | Some(Value::Null) => return Err(ParseError::NoPrompt),
        Some(Value::String(s)) if s.is_empty() => return Err(ParseError::NoPrompt),
        Some(Value::String(s)) => {
            out.extend_from_slice(s.as_bytes());
            return Ok(None);
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(WRONG),
    };
    match items.first() {
        None => Err(ParseError::NoPrompt),
        Some(Value::String(_)) => {
            for (i, item) in items.iter().enumerate() {
                let s = item.as_str().ok_or(WRONG)?;
                if i > 0 {
                    out.push(RS);
                }
                out.extend_from_slice(s.as_bytes());
            }
            Ok(None)
        }
        Some(Value::Array(_)) => {
            let mut count = 0;
            for item in items {
                count += push_token_ids(item.as_array().ok_or(WRONG)?, out)?;
            }
            nonzero(count)
        }
        Some(_) => nonzero(push_token_ids(items, out)?),
    }
}

fn nonzero(count: u64) -> Result<Option<u64>, ParseError> {
    if count == 0 {
        Err(ParseError::NoPrompt)
    } else {
        Ok(Some(count))
    }
}

/// Appends each id as 4 little-endian bytes, so one token is one 4-byte unit of the hash.
fn push_token_ids(ids: &[Value], out: &mut Vec<u8>) -> Result<u64, ParseError> {
    for id in ids {
        let id = id
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or(ParseError::WrongType("prompt"))?;
        out.extend_from_slice(&id.to_le_bytes());
    }
    Ok(ids.len() as u64)
}

/// The prompt into `out`; whether it has parts that are not text.
fn chat(obj: &Map<String, Value>, out: &mut Vec<u8>) -> Result<bool, ParseError> {
    let messages = match obj.get("messages") {
        None | Some(Value::Null) => return Err(ParseError::NoPrompt),
        Some(Value::Array(m)) if m.is_empty() => return Err(ParseError::NoPrompt),
        Some(Value::Array(m)) => m,
        Some(_) => return Err(ParseError::WrongType("messages")),
    };
    push_tools(obj.get("tools"), out)?;
    let mut media = false;
    for message in messages {
        let message = message
            .as_object()
            .ok_or(ParseError::WrongType("messages"))?;
        media |= push_message(&Message::of(message)?, out)?;
    }
    Ok(media)
}

/// The prompt into `out`; whether it has parts that are not text.
fn responses(obj: &Map<String, Value>, out: &mut Vec<u8>) -> Result<bool, ParseError> {
    let input = match obj.get("input") {
        None | Some(Value::Null) => return Err(ParseError::NoPrompt),
        Some(Value::String(s)) if s.is_empty() => return Err(ParseError::NoPrompt),
        Some(Value::Array(a)) if a.is_empty() => return Err(ParseError::NoPrompt),
        Some(v @ (Value::String(_) | Value::Array(_))) => v,
        Some(_) => return Err(ParseError::WrongType("input")),
    };
    push_tools(obj.get("tools"), out)?;
    if let Some(text) = opt_str(obj, "instructions")? {
        out.extend_from_slice(b"system\x1f");
        out.extend_from_slice(text.as_bytes());
        out.push(RS);
    }
    let items = match input {
        Value::Array(items) => items,
        other => {
            out.extend_from_slice(other.as_str().unwrap_or_default().as_bytes());
            return Ok(false);
        }
    };
    let mut media = false;
    for item in items {
        let item = item.as_object().ok_or(ParseError::WrongType("input"))?;
        if item.contains_key("role") || item.contains_key("content") {
            media |= push_message(&Message::of(item)?, out)?;
        } else {
            // function_call, function_call_output, reasoning, ...: keep them whole.
            let kind = item.get("type").and_then(Value::as_str).unwrap_or("item");
            out.extend_from_slice(kind.as_bytes());
            out.push(US);
            write_json(item, out)?;
            out.push(RS);
        }
    }
    Ok(media)
}

/// Tools go first: they precede the conversation in every chat template.
fn push_tools(tools: Option<&Value>, out: &mut Vec<u8>) -> Result<(), ParseError> {
    match tools {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(tools) => {
            write_json(tools, out)?;
            out.push(RS);
            Ok(())
        }
    }
}

/// Compact JSON: deterministic, so equal input gives equal bytes.
fn write_json<T: serde::Serialize>(value: &T, out: &mut Vec<u8>) -> Result<(), ParseError> {
    serde_json::to_writer(out, value).map_err(|_| ParseError::NotJson)
}

/// What a chat message (or responses message item) contributes, however it was read.
struct Message<'v> {
    role: &'v str,
    content: Content<'v>,
    /// `tool_calls`, `name`, `tool_call_id` (in that order), when set and not null.
    extras: [Option<&'v Value>; 3],
}

enum Content<'v> {
    Absent,
    Text(&'v str),
    Parts(&'v [Value]),
}

const EXTRAS: [&str; 3] = ["tool_calls", "name", "tool_call_id"];

impl<'v> Message<'v> {
    fn of(message: &'v Map<String, Value>) -> Result<Message<'v>, ParseError> {
        let role = opt_str(message, "role")?.unwrap_or_default();
        let content = match message.get("content") {
            None | Some(Value::Null) => Content::Absent,
            Some(Value::String(s)) => Content::Text(s),
            Some(Value::Array(parts)) => Content::Parts(parts),
            Some(_) => return Err(ParseError::WrongType("content")),
        };
        let extras = EXTRAS.map(|field| message.get(field).filter(|v| !v.is_null()));
        Ok(Message {
            role,
            content,
            extras,
        })
    }
}

/// One message as one `RS`-terminated record; whether it has parts that are not text.
fn push_message(message: &Message, out: &mut Vec<u8>) -> Result<bool, ParseError> {
    out.extend_from_slice(message.role.as_bytes());
    out.push(US);
    let mut media = false;
    match message.content {
        Content::Absent => {}
        Content::Text(s) => out.extend_from_slice(s.as_bytes()),
        Content::Parts(parts) => {
            for part in parts {
                media |= push_part(part, out)?;
            }
        }
    }
    for (field, value) in EXTRAS.iter().zip(message.extras) {
        let Some(value) = value else { continue };
        out.push(US);
        out.extend_from_slice(field.as_bytes());
        out.push(b'=');
        match value {
            Value::String(s) => out.extend_from_slice(s.as_bytes()),
            other => write_json(other, out)?,
        }
    }
    out.push(RS);
    Ok(media)
}

/// Text parts contribute their text; anything else a short hash placeholder (and `true`).
fn push_part(part: &Value, out: &mut Vec<u8>) -> Result<bool, ParseError> {
    const WRONG: ParseError = ParseError::WrongType("content");
    let part = match part {
        Value::String(s) => {
            out.extend_from_slice(s.as_bytes());
            return Ok(false);
        }
        Value::Object(p) => p,
        _ => return Err(WRONG),
    };
    let kind = part.get("type").and_then(Value::as_str).unwrap_or("part");
    if matches!(kind, "text" | "input_text" | "output_text") {
        let text = part.get("text").and_then(Value::as_str).ok_or(WRONG)?;
        out.extend_from_slice(text.as_bytes());
        return Ok(false);
    }
    // Hash the payload (e.g. the `image_url` object), else the whole part.
    let mut hasher = HashWriter(Xxh3::new());
    let hashed = match part.get(kind) {
        Some(payload) => serde_json::to_writer(&mut hasher, payload),
        None => serde_json::to_writer(&mut hasher, part),
    };
    hashed.map_err(|_| ParseError::NotJson)?;
    write!(out, "<{kind}:{:016x}>", hasher.0.digest()).map_err(|_| ParseError::NotJson)?;
    Ok(true)
}

/// Streams serialized JSON into the hasher, so a large base64 image is never copied.
struct HashWriter(Xxh3);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ApiKind::{ChatCompletions as Chat, Completions as Comp, Responses as Resp};
    use ParseError::*;

    fn p(kind: ApiKind, body: &str) -> Result<InferenceRequest, ParseError> {
        parse(kind, body.as_bytes(), &ParseLimits::default())
    }

    fn chat_body(messages: &[(&str, &str)], tools: bool) -> String {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        let mut body = serde_json::json!({"model": "m", "messages": msgs});
        if tools {
            body["tools"] = serde_json::json!([{"type":"function","function":{"name":"f"}}]);
        }
        body.to_string()
    }

    #[test]
    fn paths() {
        assert_eq!(ApiKind::from_path("/v1/chat/completions?x=1"), Some(Chat));
        assert_eq!(ApiKind::from_path("/v1/completions"), Some(Comp));
        assert_eq!(ApiKind::from_path("/v1/responses/"), Some(Resp));
        assert_eq!(ApiKind::from_path("/v1/models"), None);
        assert_eq!(ApiKind::from_path(""), None);
        assert_eq!(Resp.as_str(), "responses");
    }

    #[test]
    fn completions_string_and_fields() {
        let body = r#"{"model":"m","prompt":"hi","stream":true,"max_tokens":7,"cache_salt":"s"}"#;
        let r = p(Comp, body).unwrap();
        assert_eq!((r.model.as_str(), r.prompt.as_slice()), ("m", &b"hi"[..]));
        assert_eq!(
            (r.prompt_token_ids, r.stream, r.max_tokens),
            (None, true, Some(7))
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        let r = p(Comp, r#"{"model":"m","prompt":["ab","c"]}"#).unwrap();
        assert_eq!(r.prompt, b"ab\x1ec");
        let one = p(Comp, r#"{"model":"m","prompt":["ab"]}"#).unwrap();
        assert_eq!(one.prompt, b"ab");
    }

    #[test]
    fn completions_token_ids() {
        let r = p(Comp, r#"{"model":"m","prompt":[1,258]}"#).unwrap();
        assert_eq!(r.prompt, [1, 0, 0, 0, 2, 1, 0, 0]);
        assert_eq!(r.prompt_token_ids, Some(2));
        let nested = p(Comp, r#"{"model":"m","prompt":[[1],[2,3]]}"#).unwrap();
        assert_eq!(
            (nested.prompt.len(), nested.prompt_token_ids),
            (12, Some(3))
        );
        let wrong = WrongType("prompt");
        assert_eq!(
            p(Comp, r#"{"model":"m","prompt":[4294967296]}"#),
            Err(wrong)
        );
        assert_eq!(p(Comp, r#"{"model":"m","prompt":[1,"a"]}"#), Err(wrong));
        assert_eq!(p(Comp, r#"{"model":"m","prompt":[[]]}"#), Err(NoPrompt));
    }

    #[test]
    fn max_tokens_variants() {
        let c =
            r#"{"model":"m","messages":[{"role":"u","content":"x"}],"max_completion_tokens":9}"#;
        assert_eq!(p(Chat, c).unwrap().max_tokens, Some(9));
        let r = r#"{"model":"m","input":"x","max_output_tokens":5}"#;
        assert_eq!(p(Resp, r).unwrap().max_tokens, Some(5));
        let bad = r#"{"model":"m","input":"x","max_output_tokens":-5}"#;
        assert_eq!(p(Resp, bad), Err(WrongType("max_output_tokens")));
    }

    #[test]
    fn chat_strings_and_tools() {
        let r = p(Chat, &chat_body(&[("user", "hi")], false)).unwrap();
        assert_eq!(r.prompt, b"user\x1fhi\x1e");
        let t = p(Chat, &chat_body(&[("user", "hi")], true)).unwrap();
        assert!(t
            .prompt
            .starts_with(br#"[{"function":{"name":"f"},"type":"function"}]"#));
        assert!(t.prompt.ends_with(b"\x1euser\x1fhi\x1e"));
        // The model seeds the hash elsewhere; it must not be part of the prompt bytes.
        let named = chat_body(&[("user", "hi")], false).replace("\"m\"", "\"MODELNAME\"");
        let named = p(Chat, &named).unwrap();
        assert_eq!(
            (named.model.as_str(), &named.prompt),
            ("MODELNAME", &r.prompt)
        );
    }

    #[test]
    fn chat_parts_and_tool_calls() {
        let body = r#"{"model":"m","messages":[
            {"role":"user","content":[{"type":"text","text":"a"},
                {"type":"image_url","image_url":{"url":"data:xyz"}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},
            {"role":"tool","content":"r","tool_call_id":"1"}]}"#;
        let r = p(Chat, body).unwrap();
        let s = String::from_utf8(r.prompt.clone()).unwrap();
        assert!(s.starts_with("user\x1fa<image_url:"), "{s:?}");
        assert!(s.contains(">b\x1eassistant\x1f\x1ftool_calls=[{\"id\":\"1\"}]\x1e"));
        assert!(s.ends_with("tool\x1fr\x1ftool_call_id=1\x1e"));
        assert_eq!(p(Chat, body).unwrap().prompt, r.prompt);
        let other = body.replace("data:xyz", "data:xyw");
        assert_ne!(p(Chat, &other).unwrap().prompt, r.prompt);
    }

    #[test]
    fn a_prompt_with_media_parts_says_so() {
        let image = r#"{"type":"image_url","image_url":{"url":"u"}}"#;
        let text = r#"{"type":"text","text":"a"}"#;
        let chat = |parts: &str| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{parts}]}}]}}"#)
        };
        // Both readers: the one-pass one for this shape, the tree walk for any.
        for parse in [p, |k, b: &str| {
            parse_tree(k, b.as_bytes(), &ParseLimits::default())
        }] {
            assert!(
                parse(Chat, &chat(&format!("{text},{image}")))
                    .unwrap()
                    .media
            );
            assert!(!parse(Chat, &chat(text)).unwrap().media);
            assert!(
                !parse(Chat, &chat_body(&[("user", "hi")], true))
                    .unwrap()
                    .media
            );
        }
        let input = |content: &str| {
            format!(r#"{{"model":"m","input":[{{"role":"user","content":[{content}]}}]}}"#)
        };
        let input_image = r#"{"type":"input_image","image_url":"u"}"#;
        let input_text = r#"{"type":"input_text","text":"a"}"#;
        assert!(p(Resp, &input(input_image)).unwrap().media);
        assert!(!p(Resp, &input(input_text)).unwrap().media);
        assert!(!p(Comp, r#"{"model":"m","prompt":"a"}"#).unwrap().media);
    }

    #[test]
    fn chat_prefix_property() {
        let turns = [
            ("system", "s"),
            ("user", "u"),
            ("assistant", "a"),
            ("user", "v"),
        ];
        for tools in [false, true] {
            for n in 1..turns.len() {
                let short = p(Chat, &chat_body(&turns[..n], tools)).unwrap().prompt;
                let long = p(Chat, &chat_body(&turns[..=n], tools)).unwrap().prompt;
                assert!(long.starts_with(&short) && long.len() > short.len());
            }
        }
    }

    #[test]
    fn responses_shapes_and_prefix() {
        let s = p(Resp, r#"{"model":"m","input":"hey","instructions":"be"}"#).unwrap();
        assert_eq!(s.prompt, b"system\x1fbe\x1ehey");
        let item = |t: &str| {
            format!(r#"{{"role":"user","content":[{{"type":"input_text","text":"{t}"}}]}}"#)
        };
        let call = r#"{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}"#;
        let body =
            |items: &str| format!(r#"{{"model":"m","instructions":"be","input":[{items}]}}"#);
        let short = p(Resp, &body(&item("a"))).unwrap().prompt;
        let long = p(Resp, &body(&format!("{},{call},{}", item("a"), item("b")))).unwrap();
        assert_eq!(short, b"system\x1fbe\x1euser\x1fa\x1e");
        assert!(long.prompt.starts_with(&short));
        assert!(long.prompt.ends_with(b"user\x1fb\x1e"));
    }

    #[test]
    fn errors() {
        let small = ParseLimits {
            max_body_bytes: 4,
            ..ParseLimits::default()
        };
        assert_eq!(parse(Comp, b"{\"a\":1}", &small), Err(TooLarge));
        let bad_utf8 = b"{\"model\":\"\xff\",\"prompt\":\"x\"}";
        assert_eq!(parse(Comp, bad_utf8, &ParseLimits::default()), Err(NotJson));
        let w = WrongType;
        let cases = [
            (Comp, "{nope", NotJson),
            (Comp, "[1]", NotObject),
            (Comp, r#"{"prompt":"x"}"#, NoModel),
            (Comp, r#"{"model":""}"#, NoModel),
            (Comp, r#"{"model":"m"}"#, NoPrompt),
            (Chat, r#"{"model":"m","messages":[]}"#, NoPrompt),
            (Resp, r#"{"model":"m","input":""}"#, NoPrompt),
            (Comp, r#"{"model":1}"#, w("model")),
            (Comp, r#"{"model":"m","stream":"y"}"#, w("stream")),
            (Comp, r#"{"model":"m","max_tokens":1.5}"#, w("max_tokens")),
            (Comp, r#"{"model":"m","prompt":{}}"#, w("prompt")),
            (Chat, r#"{"model":"m","messages":"x"}"#, w("messages")),
            (Chat, r#"{"model":"m","messages":[1]}"#, w("messages")),
            (
                Chat,
                r#"{"model":"m","messages":[{"content":5}]}"#,
                w("content"),
            ),
            (Resp, r#"{"model":"m","input":5}"#, w("input")),
        ];
        for (kind, body, err) in cases {
            assert_eq!(p(kind, body), Err(err), "{body}");
        }
        assert_eq!(WrongType("x").as_str(), "wrong_type");
        assert_eq!(WrongType("x").to_string(), "wrong_type: field `x`");
    }

    #[test]
    fn deep_nesting_is_rejected_before_serde() {
        let body = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(p(Comp, &body), Err(TooDeep));
        let quoted = format!(r#"{{"model":"m","prompt":"{}\"{}"}}"#, "[".repeat(100), "{");
        assert!(p(Comp, &quoted).is_ok());
    }

    #[test]
    fn common_chat_bodies_are_read_without_a_tree() {
        let limits = ParseLimits::default();
        let bodies = [
            chat_body(&[("system", "s"), ("user", "q \"quoted\" \u{e9}\n")], true),
            r#"{"model":"m","stream":true,"max_tokens":3,"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"r"}],"temperature":0.2,"metadata":{"a":[1]}}"#.to_string(),
        ];
        for body in bodies {
            let (f, prompt, media) = borrowed::chat(body.as_bytes(), limits.max_depth).unwrap();
            let tree = parse_tree(Chat, body.as_bytes(), &limits).unwrap();
            assert_eq!(request(f, prompt, None, media), tree);
        }
    }

    #[test]
    fn many_messages() {
        let turns = vec![("user", "hello there"); 50_000];
        let r = p(Chat, &chat_body(&turns, true)).unwrap();
        assert!(r.prompt.len() > 50_000 * 16);
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        const SEEDS: [(ApiKind, &str); 3] = [
            (Comp, r#"{"model":"m","prompt":[[1,2],[3]],"max_tokens":3}"#),
            (
                Chat,
                r#"{"model":"m","tools":[{"a":1}],"messages":[{"role":"user","content":[{"type":"text","text":"a\"b"},{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
            ),
            (
                Resp,
                r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"x"},{"type":"t"}]}"#,
            ),
        ];

        fn all_kinds(body: &[u8]) {
            for kind in [Comp, Chat, Resp] {
                let _ = parse(kind, body, &ParseLimits::default());
            }
        }

        /// JSON text of a value nested `depth` levels (arrays and objects alternating).
        fn nested(depth: usize) -> String {
            (0..depth).fold("1".to_string(), |inner, i| match i % 2 {
                0 => format!("[{inner}]"),
                _ => format!(r#"{{"k":{inner}}}"#),
            })
        }

        fn one_of(options: &'static [&'static str]) -> impl Strategy<Value = String> {
            prop::sample::select(options).prop_map(str::to_string)
        }

        fn part() -> impl Strategy<Value = String> {
            one_of(&[
                r#""plain""#,
                r#"{"type":"text","text":"t\u00e9"}"#,
                r#"{"type":"input_text","text":"u"}"#,
                r#"{"type":"image_url","image_url":{"url":"u","b":[1,{"c":2}]}}"#,
                r#"{"type":"text"}"#,
                r#"{"text":"no type"}"#,
                "3",
            ])
        }

        fn content() -> impl Strategy<Value = String> {
            prop_oneof![
                one_of(&[
                    r#""hello""#,
                    r#""esc\"aped\n\u00e9""#,
                    "null",
                    r#""""#,
                    "{}",
                    "5"
                ]),
                prop::collection::vec(part(), 0..4).prop_map(|p| format!("[{}]", p.join(","))),
            ]
        }

        fn message() -> impl Strategy<Value = String> {
            let field = prop_oneof![
                one_of(&[
                    r#""role":"user""#,
                    r#""role":null"#,
                    r#""role":3"#,
                    r#""role":"a\tb""#
                ]),
                content().prop_map(|c| format!(r#""content":{c}"#)),
                one_of(&[
                    r#""tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]"#,
                    r#""tool_calls":null"#,
                    r#""name":"n""#,
                    r#""name":7"#,
                    r#""tool_call_id":"c""#,
                    r#""weight":1.5"#,
                ]),
                (0usize..70).prop_map(|d| format!(r#""deep":{}"#, nested(d))),
            ];
            prop_oneof![
                prop::collection::vec(field, 0..6).prop_map(|f| format!("{{{}}}", f.join(","))),
                one_of(&[r#""text""#, "null", "[]"]),
            ]
        }

        fn top_field() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => one_of(&[r#""model":"m""#, r#""model":"""#, r#""model":null"#, r#""model":5"#, r#""m\u006fdel":"e""#]),
                2 => one_of(&[r#""stream":true"#, r#""stream":null"#, r#""stream":"x""#]),
                2 => one_of(&[
                    r#""max_tokens":7"#, r#""max_tokens":null"#, r#""max_tokens":5.0"#,
                    r#""max_completion_tokens":9"#, r#""max_output_tokens":-1"#, r#""max_tokens":"3""#,
                ]),
                1 => one_of(&[r#""cache_salt":"s""#, r#""cache_salt":"""#, r#""cache_salt":1"#]),
                2 => one_of(&[r#""tools":[]"#, r#""tools":null"#, r#""tools":[{"b":1,"a":[2]}]"#, r#""tools":{"x":1}"#]),
                6 => prop::collection::vec(message(), 0..4)
                    .prop_map(|m| format!(r#""messages":[{}]"#, m.join(","))),
                1 => one_of(&[r#""messages":null"#, r#""messages":"x""#, r#""prompt":"p""#]),
                2 => (0usize..70).prop_map(|d| format!(r#""extra":{}"#, nested(d))),
                1 => (0usize..66).prop_map(|d| format!(r#""tools":{}"#, nested(d))),
            ]
        }

        /// A value nested about as deep as `max_depth` allows at one of the places the
        /// borrowed read handles differently (skipped, kept as a `Value`, a part).
        fn near_the_limit(max_depth: usize, place: usize, delta: isize) -> (String, String) {
            // Where the value sits: the body is depth 0.
            let at = [1, 1, 3, 4, 3][place % 5];
            let d = (max_depth as isize - at as isize + delta).max(0) as usize;
            let v = nested(d);
            let (top, message) = match place % 5 {
                0 => (
                    format!(r#""extra":{v}"#),
                    r#"{"role":"user","content":"x"}"#.to_string(),
                ),
                1 => (
                    format!(r#""tools":{v}"#),
                    r#"{"role":"user","content":"x"}"#.to_string(),
                ),
                2 => (
                    String::new(),
                    format!(r#"{{"role":"user","content":"x","meta":{v}}}"#),
                ),
                3 => (
                    String::new(),
                    format!(r#"{{"role":"user","content":["a",{v}]}}"#),
                ),
                _ => (
                    String::new(),
                    format!(r#"{{"role":"assistant","tool_calls":{v}}}"#),
                ),
            };
            (top, message)
        }

        fn check_against_tree(body: &str, max_depth: usize) -> Result<(), TestCaseError> {
            let limits = ParseLimits {
                max_depth,
                ..ParseLimits::default()
            };
            let tree = parse_tree(Chat, body.as_bytes(), &limits);
            prop_assert_eq!(parse(Chat, body.as_bytes(), &limits), tree.clone());
            if let Some((f, prompt, media)) = borrowed::chat(body.as_bytes(), max_depth) {
                prop_assert_eq!(Ok(request(f, prompt, None, media)), tree);
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]
            /// Whatever the borrowed read accepts, it reads as the tree walk does; for what
            /// it declines, `parse` gives the tree walk's answer.
            #[test]
            fn borrowed_chat_reads_as_the_tree(
                fields in prop::collection::vec(top_field(), 0..8),
                messages in prop::collection::vec(message(), 0..4),
                max_depth in prop_oneof![Just(64usize), 8usize..12, 0usize..8],
            ) {
                let body = format!("{{{}}}", fields.join(","));
                check_against_tree(&body, max_depth)?;
                // The same fields before a model and messages that read.
                let tail = format!(r#""model":"m","messages":[{}]"#, messages.join(","));
                let body = format!("{{{}}}", fields.into_iter().chain([tail]).collect::<Vec<_>>().join(","));
                check_against_tree(&body, max_depth)?;
            }

            /// Around the depth limit, at each place the borrowed read counts depth itself.
            #[test]
            fn borrowed_chat_keeps_the_depth_rule(
                place in 0usize..5,
                delta in -2isize..3,
                max_depth in prop_oneof![Just(64usize), 8usize..12],
                extra in prop::collection::vec(message(), 0..2),
            ) {
                let (top, message) = near_the_limit(max_depth, place, delta);
                let messages = std::iter::once(message).chain(extra).collect::<Vec<_>>().join(",");
                let mut fields = vec![r#""model":"m""#.to_string(), format!(r#""messages":[{messages}]"#)];
                if !top.is_empty() {
                    fields.insert(1, top);
                }
                check_against_tree(&format!("{{{}}}", fields.join(",")), max_depth)?;
            }
        }

        fn token_id() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => (0u64..100_000).prop_map(|n| n.to_string()),
                1 => one_of(&["4294967295", "4294967296", "-1", "-0", "1.0", "1e3", "\"7\"", "null", "true"]),
            ]
        }

        fn token_ids() -> impl Strategy<Value = String> {
            prop::collection::vec(token_id(), 0..5).prop_map(|v| format!("[{}]", v.join(",")))
        }

        fn prompt_string() -> impl Strategy<Value = String> {
            one_of(&[r#""p""#, r#""""#, r#""a\nb\u00e9""#, r#""x\"y""#])
        }

        fn prompt_field() -> impl Strategy<Value = String> {
            let item = prop_oneof![
                token_id(),
                prompt_string(),
                token_ids(),
                one_of(&["null", "{}", "[[1]]"])
            ];
            prop_oneof![
                2 => prompt_string().prop_map(|s| format!(r#""prompt":{s}"#)),
                3 => token_ids().prop_map(|s| format!(r#""prompt":{s}"#)),
                3 => prop::collection::vec(item, 0..4).prop_map(|v| format!(r#""prompt":[{}]"#, v.join(","))),
                1 => one_of(&[r#""prompt":null"#, r#""prompt":5"#, r#""prompt":{}"#]),
            ]
        }

        fn check_completions_against_tree(
            body: &str,
            max_depth: usize,
        ) -> Result<(), TestCaseError> {
            let limits = ParseLimits {
                max_depth,
                ..ParseLimits::default()
            };
            let tree = parse_tree(Comp, body.as_bytes(), &limits);
            prop_assert_eq!(parse(Comp, body.as_bytes(), &limits), tree.clone());
            if let Some((f, prompt, ids)) = borrowed::completions(body.as_bytes(), max_depth) {
                prop_assert_eq!(Ok(request(f, prompt, ids, false)), tree);
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]
            /// As for chat: what the borrowed read accepts reads as the tree walk does.
            #[test]
            fn borrowed_completions_read_as_the_tree(
                fields in prop::collection::vec(prop_oneof![3 => top_field(), 2 => prompt_field()], 0..6),
                prompt in prompt_field(),
                max_depth in prop_oneof![Just(64usize), 8usize..12, 0usize..8],
            ) {
                let body = format!("{{{}}}", fields.join(","));
                check_completions_against_tree(&body, max_depth)?;
                let tail = [r#""model":"m""#.to_string(), prompt];
                let body = format!("{{{}}}", fields.into_iter().chain(tail).collect::<Vec<_>>().join(","));
                check_completions_against_tree(&body, max_depth)?;
            }
        }

        #[test]
        fn completions_of_token_ids_are_read_without_a_tree() {
            let ids: Vec<String> = (0..1_000).map(|i| i.to_string()).collect();
            let body = format!(
                r#"{{"model":"m","prompt":[{}],"stream":true}}"#,
                ids.join(",")
            );
            let (f, prompt, n) = borrowed::completions(body.as_bytes(), 64).unwrap();
            assert_eq!((f.model.as_str(), f.stream, n), ("m", true, Some(1_000)));
            assert_eq!(prompt.len(), 4_000);
            assert_eq!(&prompt[4..8], &1u32.to_le_bytes());
            let nested = r#"{"model":"m","prompt":[[1,2],[3]]}"#;
            assert_eq!(
                borrowed::completions(nested.as_bytes(), 64).unwrap().2,
                Some(3)
            );
            let texts = r#"{"model":"m","prompt":["a","b"]}"#;
            assert_eq!(
                borrowed::completions(texts.as_bytes(), 64).unwrap().1,
                b"a\x1eb"
            );
            // A duplicate prompt: its last value, as in the tree, still without one.
            let twice = r#"{"model":"m","prompt":[1,2,3],"prompt":"b"}"#;
            let (_, prompt, n) = borrowed::completions(twice.as_bytes(), 64).unwrap();
            assert_eq!((prompt.as_slice(), n), (&b"b"[..], None));
            let tree = parse_tree(
                ApiKind::Completions,
                twice.as_bytes(),
                &ParseLimits::default(),
            );
            assert_eq!(tree.map(|r| r.prompt), Ok(b"b".to_vec()));
        }

        #[test]
        fn a_large_body_of_an_odd_shape_is_not_read_as_a_tree() {
            let limits = ParseLimits::default();
            let odd = |content: &str| {
                format!(
                    r#"{{"model":"m","stream":"yes","messages":[{{"role":"user","content":"{content}"}}]}}"#
                )
            };
            let small = odd("q");
            assert_eq!(
                parse(ApiKind::ChatCompletions, small.as_bytes(), &limits).err(),
                Some(ParseError::WrongType("stream"))
            );
            let large = odd(&"x".repeat(2 << 20));
            assert_eq!(
                parse(ApiKind::ChatCompletions, large.as_bytes(), &limits).err(),
                Some(ParseError::TooLarge)
            );
            let garbage = format!("{}!", &large[..large.len() - 2]);
            assert_eq!(
                parse(ApiKind::ChatCompletions, garbage.as_bytes(), &limits).err(),
                Some(ParseError::NotJson)
            );
        }

        #[test]
        fn a_large_responses_body_is_a_tree_only_when_its_values_are_few() {
            let limits = ParseLimits::default();
            let resp = |input: &str| {
                let body = format!(r#"{{"model":"m","input":{input}}}"#);
                parse(ApiKind::Responses, body.as_bytes(), &limits).map(|r| r.prompt.len())
            };
            // A long text, marks inside it (escaped quotes too) not counted as values.
            let text = r#"f(a[i], {k: \"[,{\"}); "#.repeat(100_000);
            assert!(text.len() > TREE_FALLBACK_BYTES);
            assert!(resp(&format!(r#""{text}""#)).is_ok());
            let item = |n: usize| format!(r#"{{"role":"user","content":"{}"}}"#, "a".repeat(n));
            let items = |n: usize, count: usize| format!("[{}]", vec![item(n); count].join(","));
            assert!(resp(&items(1_000, 1_500)).is_ok());
            // The same bytes in short items, or in token ids: too many values to build.
            assert_eq!(resp(&items(40, 30_000)), Err(ParseError::TooLarge));
            assert_eq!(
                resp(&format!("[{}0]", "0,".repeat(600_000))),
                Err(ParseError::TooLarge)
            );
            // Under the tree limit every shape is read.
            assert!(resp(&items(40, 10_000)).is_ok());
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
                all_kinds(&body);
            }

            #[test]
            fn mutations_never_panic(
                seed in 0usize..3, op in 0u8..3, at in any::<prop::sample::Index>(), byte in any::<u8>()
            ) {
                let (kind, text) = SEEDS[seed % 3];
                let mut body = text.as_bytes().to_vec();
                prop_assert!(parse(kind, &body, &ParseLimits::default()).is_ok());
                let i = at.index(body.len());
                match op {
                    0 => body[i] ^= byte | 1,
                    1 => body.truncate(i),
                    _ => body.insert(i, byte),
                }
                all_kinds(&body);
            }
        }
    }
}

//! OpenAI request parsing and response bodies for the simulated endpoint.

use serde_json::{json, Value};

/// Default `max_tokens` when the request has none.
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Upper bound on generated tokens per request.
pub const MAX_TOKENS_CAP: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
    /// `/v1/responses`: streamed as vLLM does, `response.created` and `response.in_progress`
    /// at once (before any prefill), then an event per token, then `response.completed`.
    Responses,
}

#[derive(Debug, Clone)]
pub struct Parsed {
    pub api: Api,
    pub model: String,
    /// The text the endpoint "tokenizes" and caches.
    pub prompt: Vec<u8>,
    pub stream: bool,
    pub max_tokens: usize,
}

/// Parses a completions or chat request body. Prompt text: completions `prompt` (string,
/// array of strings concatenated, or token ids as 4 bytes each); chat: for each message its
/// role and content (string or text parts), then `tools` as JSON.
pub fn parse(api: Api, body: &[u8], default_model: &str) -> Result<Parsed, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let obj = v.as_object().ok_or("body must be a JSON object")?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(default_model)
        .to_string();
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let max_tokens = obj
        .get("max_tokens")
        .or_else(|| obj.get("max_completion_tokens"))
        .or_else(|| obj.get("max_output_tokens"))
        .and_then(Value::as_u64)
        .map_or(DEFAULT_MAX_TOKENS, |n| n as usize)
        .clamp(1, MAX_TOKENS_CAP);
    let mut prompt = Vec::new();
    match api {
        Api::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => prompt.extend_from_slice(s.as_bytes()),
            Some(Value::Array(items)) => {
                for it in items {
                    match it {
                        Value::String(s) => prompt.extend_from_slice(s.as_bytes()),
                        Value::Number(n) => {
                            let id = n.as_u64().unwrap_or(0) as u32;
                            prompt.extend_from_slice(&id.to_le_bytes());
                        }
                        _ => return Err("prompt array items must be strings or token ids".into()),
                    }
                }
            }
            _ => return Err("missing `prompt`".into()),
        },
        Api::Responses => {
            if let Some(s) = obj.get("instructions").and_then(Value::as_str) {
                prompt.extend_from_slice(b"system\n");
                prompt.extend_from_slice(s.as_bytes());
                prompt.push(b'\n');
            }
            match obj.get("input") {
                Some(Value::String(s)) => prompt.extend_from_slice(s.as_bytes()),
                Some(Value::Array(items)) => push_messages(items, &mut prompt),
                _ => return Err("missing `input`".into()),
            }
        }
        Api::Chat => {
            let msgs = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("missing `messages`")?;
            push_messages(msgs, &mut prompt);
            if let Some(tools) = obj.get("tools") {
                prompt.extend_from_slice(tools.to_string().as_bytes());
            }
        }
    }
    Ok(Parsed {
        api,
        model,
        prompt,
        stream,
        max_tokens,
    })
}

/// Each message's role and content (a string, or text parts), a line each.
fn push_messages(msgs: &[Value], prompt: &mut Vec<u8>) {
    for m in msgs {
        if let Some(role) = m.get("role").and_then(Value::as_str) {
            prompt.extend_from_slice(role.as_bytes());
            prompt.push(b'\n');
        }
        match m.get("content") {
            Some(Value::String(s)) => prompt.extend_from_slice(s.as_bytes()),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        prompt.extend_from_slice(t.as_bytes());
                    }
                }
            }
            _ => {}
        }
        prompt.push(b'\n');
    }
}

/// Text of generated token `i` (4 bytes = one approximate token).
pub fn token_text(i: usize) -> String {
    format!("t{:02} ", i % 100)
}

#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }

    /// The Responses API's form.
    pub fn to_responses_json(self) -> Value {
        json!({
            "input_tokens": self.prompt_tokens,
            "output_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "input_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }
}

/// A Responses API `response` object; `usage` once completed.
fn response_object(p: &Parsed, id: &str, created: u64, text: &str, usage: Option<Usage>) -> Value {
    let status = if usage.is_some() {
        "completed"
    } else {
        "in_progress"
    };
    json!({
        "id": id, "object": "response", "created_at": created, "model": p.model, "status": status,
        "output": [{"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]}],
        "usage": usage.map(Usage::to_responses_json),
    })
}

/// An SSE event of a streamed Responses answer.
pub fn responses_event(event_type: &str, mut data: Value) -> String {
    if let Some(o) = data.as_object_mut() {
        o.insert("type".into(), json!(event_type));
    }
    format!("event: {event_type}\ndata: {data}\n\n")
}

/// The events a streamed Responses answer opens with, before any token.
pub fn responses_opening(p: &Parsed, id: &str, created: u64) -> String {
    let response = response_object(p, id, created, "", None);
    let created_event = responses_event("response.created", json!({"response": response}));
    let in_progress = responses_event("response.in_progress", json!({"response": response}));
    created_event + &in_progress
}

/// Token `i` of a streamed Responses answer; the last is followed by `response.completed`.
pub fn responses_token(
    p: &Parsed,
    id: &str,
    created: u64,
    i: usize,
    last: Option<Usage>,
) -> String {
    let mut out = responses_event(
        "response.output_text.delta",
        json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": token_text(i)}),
    );
    if let Some(u) = last {
        let text: String = (0..u.completion_tokens).map(token_text).collect();
        let response = response_object(p, id, created, &text, Some(u));
        out.push_str(&responses_event(
            "response.completed",
            json!({"response": response}),
        ));
    }
    out
}

/// Non-streaming response body.
pub fn full_response(p: &Parsed, id: &str, created: u64, usage: Usage) -> Value {
    let text: String = (0..usage.completion_tokens).map(token_text).collect();
    match p.api {
        Api::Responses => response_object(p, id, created, &text, Some(usage)),
        Api::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": p.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage.to_json(),
        }),
        Api::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": p.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": usage.to_json(),
        }),
    }
}

/// One streaming chunk carrying token `i`; the last one has `finish_reason` and `usage`.
pub fn stream_chunk(p: &Parsed, id: &str, created: u64, i: usize, last: Option<Usage>) -> Value {
    let finish = if last.is_some() {
        json!("length")
    } else {
        Value::Null
    };
    let mut chunk = match p.api {
        Api::Completions | Api::Responses => json!({
            "id": id, "object": "text_completion", "created": created, "model": p.model,
            "choices": [{"index": 0, "text": token_text(i), "logprobs": null, "finish_reason": finish}],
        }),
        Api::Chat => {
            let delta = if i == 0 {
                json!({"role": "assistant", "content": token_text(i)})
            } else {
                json!({"content": token_text(i)})
            };
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": p.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        }
    };
    if let (Some(u), Some(o)) = (last, chunk.as_object_mut()) {
        o.insert("usage".into(), u.to_json());
    }
    chunk
}

/// OpenAI-style error body.
pub fn error_body(msg: &str, kind: &str) -> Value {
    json!({"error": {"message": msg, "type": kind, "code": null}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_prompt_has_prefix_property() {
        let a = br#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"}]}"#;
        let b = br#"{"model":"m","stream":true,"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"Q2"}]}],"max_tokens":99999}"#;
        let (pa, pb) = (
            parse(Api::Chat, a, "d").unwrap(),
            parse(Api::Chat, b, "d").unwrap(),
        );
        assert_eq!(pa.prompt, b"system\nS\nuser\nQ1\n");
        assert_eq!(pb.prompt, b"system\nS\nuser\nQ2\n");
        assert!(pb.stream && !pa.stream);
        assert_eq!(pb.max_tokens, MAX_TOKENS_CAP);
        assert_eq!(pa.max_tokens, DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn completions_prompt_forms() {
        let p = parse(Api::Completions, br#"{"prompt":["ab","cd"]}"#, "sim-model").unwrap();
        assert_eq!(p.prompt, b"abcd");
        assert_eq!(p.model, "sim-model");
        let p = parse(Api::Completions, br#"{"prompt":[1,2,3]}"#, "m").unwrap();
        assert_eq!(p.prompt.len(), 12);
        assert!(parse(Api::Completions, br#"{"messages":[]}"#, "m").is_err());
        assert!(parse(Api::Chat, b"not json", "m").is_err());
    }

    #[test]
    fn a_responses_stream_opens_before_its_first_token() {
        let body = br#"{"instructions":"S","input":[{"role":"user","content":[{"type":"input_text","text":"Q"}]}],"max_output_tokens":2,"stream":true}"#;
        let p = parse(Api::Responses, body, "m").unwrap();
        assert_eq!(
            (p.prompt.as_slice(), p.max_tokens),
            (&b"system\nS\nuser\nQ\n"[..], 2)
        );
        let opening = responses_opening(&p, "id", 0);
        assert!(opening.starts_with("event: response.created\ndata: {"));
        assert!(opening.contains("\n\nevent: response.in_progress\n"));
        assert!(!opening.contains("output_text.delta"));
        let u = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 4,
        };
        let last = responses_token(&p, "id", 0, 1, Some(u));
        assert!(last.starts_with("event: response.output_text.delta\n"));
        assert!(
            last.contains(r#""input_tokens_details":{"cached_tokens":4}"#),
            "{last}"
        );
        assert!(responses_token(&p, "id", 0, 0, None).ends_with("\n\n"));
    }

    #[test]
    fn last_chunk_carries_usage() {
        let p = parse(Api::Chat, br#"{"messages":[]}"#, "m").unwrap();
        let u = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 0,
        };
        let c = stream_chunk(&p, "id", 0, 1, Some(u));
        assert_eq!(c["usage"]["total_tokens"], 12);
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert!(stream_chunk(&p, "id", 0, 0, None).get("usage").is_none());
        assert_eq!(token_text(7).len(), 4);
    }
}

//! An instant upstream for the overhead and memory tools: every POST gets, at once, a small
//! chat-completion JSON whose `usage` counts the request body at 4 bytes per token, all of it
//! cached. It reads the whole body and does nothing else: no cache model, no scheduler, no
//! metrics, so what a gateway in front of it costs is what the measurement sees. With
//! [`Streaming`] events, a request that asks for a stream gets them as server-sent events,
//! one write each, a gap apart (as a model server sends its tokens), then `usage` and
//! `[DONE]`.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::{
    body::{Body, Bytes},
    http::header,
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use futures_util::StreamExt;

/// How the stub answers a request that asks for a stream (`"stream":true`): `events` token
/// events `gap` apart. With none it answers the JSON, streamed or not.
#[derive(Debug, Clone, Copy, Default)]
pub struct Streaming {
    pub events: usize,
    pub gap: Duration,
}

const TOKEN_EVENT: &str = concat!(
    r#"data: {"id":"x","object":"chat.completion.chunk","model":"sim-model","#,
    r#""choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}"#,
    "\n\n"
);

async fn answer(body: Bytes, streaming: Streaming) -> Response {
    let asks_stream = body.windows(13).any(|w| w == br#""stream":true"#);
    if streaming.events == 0 || !asks_stream {
        return (
            [(header::CONTENT_TYPE, "application/json")],
            whole_json(body.len() / 4),
        )
            .into_response();
    }
    let tokens = body.len() / 4;
    let usage = Bytes::from(format!(
        concat!(
            r#"data: {{"id":"x","object":"chat.completion.chunk","model":"sim-model","choices":[],"#,
            r#""usage":{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}}}}}}"#,
            "\n\ndata: [DONE]\n\n"
        ),
        tokens,
        streaming.events,
        tokens + streaming.events,
        tokens
    ));
    let events = futures_util::stream::iter(0..=streaming.events).then(move |i| {
        let usage = usage.clone();
        async move {
            tokio::time::sleep(streaming.gap).await;
            let event = match i < streaming.events {
                true => Bytes::from_static(TOKEN_EVENT.as_bytes()),
                false => usage,
            };
            Ok::<_, Infallible>(event)
        }
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(events),
    )
        .into_response()
}

/// The answer to a request not streamed of `tokens` prompt tokens, all of them cached.
pub fn whole_json(tokens: usize) -> String {
    format!(
        concat!(
            r#"{{"id":"x","object":"chat.completion","model":"sim-model","#,
            r#""choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"length"}}],"#,
            r#""usage":{{"prompt_tokens":{},"completion_tokens":1,"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}}}}}}"#
        ),
        tokens,
        tokens + 1,
        tokens
    )
}

/// The overhead tools' request: one chat body of about `bytes` bytes, a shared system
/// prompt and a short question.
pub fn chat_body(bytes: usize, stream: bool) -> String {
    let unit = "Shared system prompt for the overhead run. ";
    serde_json::json!({
        "model": crate::fleet::MODEL,
        "max_tokens": 1,
        "stream": stream,
        "messages": [
            {"role": "system", "content": unit.repeat(bytes.saturating_sub(120) / unit.len())},
            {"role": "user", "content": "question 1"}
        ]
    })
    .to_string()
}

/// Binds `n` consecutive free loopback ports and serves them on the current tokio runtime
/// until it shuts down; returns their `ip:port`.
pub async fn start(n: usize) -> anyhow::Result<Vec<String>> {
    start_with(n, Streaming::default()).await
}

/// [`start`], answering requests for a stream as `streaming` says.
pub async fn start_with(n: usize, streaming: Streaming) -> anyhow::Result<Vec<String>> {
    let base = crate::ports::free_port_range(n)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n as u16 {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, base + i));
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = Router::new().fallback(post(move |body: Bytes| answer(body, streaming)));
        tokio::spawn(async move { axum::serve(listener, app).await });
        out.push(addr.to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stream_comes_event_by_event_then_usage() {
        let streaming = Streaming {
            events: 3,
            gap: Duration::from_millis(20),
        };
        let eps = start_with(1, streaming).await.unwrap();
        let url = format!("http://{}/v1/chat/completions", eps[0]);
        let client = reqwest::Client::new();
        let mut resp = client
            .post(&url)
            .body(r#"{"stream":true,"messages":[]}"#)
            .send()
            .await
            .unwrap();
        let mut chunks = Vec::new();
        while let Some(c) = resp.chunk().await.unwrap() {
            chunks.push(String::from_utf8(c.to_vec()).unwrap());
        }
        // Each event is its own write, a gap apart: the client reads them in pieces (one by
        // one unless it was kept from reading for a whole gap).
        assert!(chunks.len() >= 2, "{chunks:?}");
        let all = chunks.concat();
        assert_eq!(all.matches(TOKEN_EVENT).count(), 3, "{all}");
        assert!(all.contains(r#""usage":{"prompt_tokens":7,"completion_tokens":3"#));
        assert!(all.ends_with("data: [DONE]\n\n"));
        // A request that does not ask for a stream gets the JSON.
        let json: serde_json::Value = client
            .post(&url)
            .body(r#"{"messages":[]}"#)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(json["usage"]["prompt_tokens"], 3);
    }
}

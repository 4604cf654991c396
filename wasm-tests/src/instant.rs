//! An instant upstream for the overhead and memory tools: every POST gets, at once, a small
//! chat-completion JSON whose `usage` counts the request body at 4 bytes per token, all of it
//! cached. It reads the whole body and does nothing else: no cache model, no scheduler, no
//! metrics, so what a gateway in front of it costs is what the measurement sees.

use std::net::{Ipv4Addr, SocketAddr};

use axum::{body::Bytes, http::header, response::IntoResponse, routing::post, Router};

async fn answer(body: Bytes) -> impl IntoResponse {
    let tokens = body.len() / 4;
    let json = format!(
        concat!(
            r#"{{"id":"x","object":"chat.completion","model":"sim-model","#,
            r#""choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"length"}}],"#,
            r#""usage":{{"prompt_tokens":{},"completion_tokens":1,"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}}}}}}"#
        ),
        tokens,
        tokens + 1,
        tokens
    );
    ([(header::CONTENT_TYPE, "application/json")], json)
}

/// Binds `n` consecutive free loopback ports and serves them on the current tokio runtime
/// until it shuts down; returns their `ip:port`.
pub async fn start(n: usize) -> anyhow::Result<Vec<String>> {
    let base = crate::ports::free_port_range(n)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n as u16 {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, base + i));
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = Router::new().fallback(post(answer));
        tokio::spawn(async move { axum::serve(listener, app).await });
        out.push(addr.to_string());
    }
    Ok(out)
}

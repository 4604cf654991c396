//! `usage` from a response, read from the last few KiB of the body only: in a JSON answer
//! it is the last object, in a stream the chunk before `data: [DONE]`. A scan for the last
//! `"usage"` key and two numbers after it; no JSON parse of the whole body, no buffering.

/// Bytes of the response tail kept per stream.
pub const TAIL_BYTES: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// Absent when the server does not report cached tokens (so no cache check is made).
    pub cached_tokens: Option<u64>,
}

/// Appends `chunk` to `tail`, keeping only the last `TAIL_BYTES`.
pub fn keep_tail(tail: &mut Vec<u8>, chunk: &[u8]) {
    if chunk.len() >= TAIL_BYTES {
        tail.clear();
        tail.extend_from_slice(&chunk[chunk.len() - TAIL_BYTES..]);
        return;
    }
    let overflow = (tail.len() + chunk.len()).saturating_sub(TAIL_BYTES);
    tail.drain(..overflow.min(tail.len()));
    tail.extend_from_slice(chunk);
}

/// `prompt_tokens` and `prompt_tokens_details.cached_tokens` of the last `usage` object
/// (chat and completions), or `input_tokens` and `input_tokens_details.cached_tokens` (the
/// Responses API).
pub fn scan(tail: &[u8]) -> Option<Usage> {
    let at = rfind(tail, b"\"usage\"")?;
    let rest = tail.get(at..)?;
    // The usage object ends at its matching brace; numbers are looked up inside it only.
    let obj = object(rest)?;
    let prompt_tokens = number_after(obj, b"\"prompt_tokens\"")
        .or_else(|| number_after(obj, b"\"input_tokens\""))?;
    Some(Usage {
        prompt_tokens,
        cached_tokens: number_after(obj, b"\"cached_tokens\""),
    })
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// From `"usage": {…}` the bytes of the braces' content.
fn object(s: &[u8]) -> Option<&[u8]> {
    let open = s.iter().position(|&b| b == b'{')?;
    let mut depth = 0usize;
    for (i, &b) in s.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return s.get(open..=i);
                }
            }
            _ => {}
        }
    }
    None
}

fn number_after(s: &[u8], key: &[u8]) -> Option<u64> {
    let at = find(s, key)? + key.len();
    let rest = s.get(at..)?;
    let start = rest.iter().position(|b| b.is_ascii_digit())?;
    if rest[..start]
        .iter()
        .any(|&b| b != b':' && !b.is_ascii_whitespace())
    {
        return None;
    }
    let digits = &rest[start..];
    let end = digits
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_body_and_stream_tail() {
        let body = br#"{"choices":[],"usage":{"completion_tokens":4,"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":64},"total_tokens":124}}"#;
        assert_eq!(
            scan(body),
            Some(Usage {
                prompt_tokens: 120,
                cached_tokens: Some(64)
            })
        );
        let sse = b"data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\": 7,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            scan(sse),
            Some(Usage {
                prompt_tokens: 7,
                cached_tokens: None
            })
        );
        assert_eq!(scan(b"data: {\"usage\":null}\n\ndata: [DONE]"), None);
        assert_eq!(scan(b"no usage here"), None);
    }

    #[test]
    fn responses_api_usage_counts_input_tokens() {
        let body = br#"{"object":"response","output":[],"usage":{"input_tokens":328,"input_tokens_details":{"cached_tokens":256},"output_tokens":52,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":380},"user":null}"#;
        assert_eq!(
            scan(body),
            Some(Usage {
                prompt_tokens: 328,
                cached_tokens: Some(256)
            })
        );
        let event = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":3}}}\n\n";
        assert_eq!(
            scan(event),
            Some(Usage {
                prompt_tokens: 9,
                cached_tokens: None
            })
        );
    }

    #[test]
    fn tail_is_bounded() {
        let mut t = Vec::new();
        keep_tail(&mut t, &[1u8; 3000]);
        keep_tail(&mut t, &[2u8; 3000]);
        assert_eq!(t.len(), TAIL_BYTES);
        assert_eq!(*t.last().unwrap(), 2);
        keep_tail(&mut t, &[3u8; 10_000]);
        assert_eq!(t, vec![3u8; TAIL_BYTES]);
    }
}

//! Where a streamed Responses answer's first token is. Unlike a chat stream, whose first
//! chunk carries the first token, a Responses stream opens with `response.created` and
//! `response.in_progress` (vLLM sends both before it waits on the engine; OpenAI's background
//! mode adds `response.queued`): its first body byte says nothing about the prefill. The
//! first event past these is the one that ends it.
//!
//! An event's type is read from its `event:` line, which vLLM and OpenAI send with every
//! Responses event. Only a line start can begin one: the data is JSON on one
//! line, its newlines escaped, so no prompt, metadata or tool schema the server echoes
//! back can forge a type (a `"type"` key inside the data could: `metadata` and tool
//! schemas are the client's). A stream without `event:` lines gives no first token, and its
//! prefill is held to its end, as an answer not streamed holds it.

/// Opening events: the server has the request, the model has produced nothing. A failed or
/// incomplete answer ends without a first token (`on_log` then releases it as failed).
const OPENING: [&[u8]; 5] = [
    b"created",
    b"in_progress",
    b"queued",
    b"failed",
    b"incomplete",
];

/// The longest `\nevent: response.…\n` read across a chunk boundary: the longest event
/// name is under 50 bytes.
const CARRY_BYTES: usize = 96;

/// The end of the last chunk, so that a line split between two chunks is still read.
#[derive(Debug, Default)]
pub struct OpeningEvents {
    carry: Vec<u8>,
    /// Bytes have been read: the carry's first byte is no line start.
    started: bool,
}

impl OpeningEvents {
    /// Whether `chunk`, the next bytes of the stream, holds an event past the opening ones.
    pub fn past_opening(&mut self, chunk: &[u8]) -> bool {
        let mut bytes = std::mem::take(&mut self.carry);
        bytes.extend_from_slice(chunk);
        // A name read again from the carry was an opening one (else the stream was past).
        let past = event_names(&bytes, !self.started).any(|t| !is_opening(t));
        let keep = bytes.len().saturating_sub(CARRY_BYTES);
        self.started |= keep > 0;
        bytes.drain(..keep);
        self.carry = bytes;
        past
    }
}

fn is_opening(name: &[u8]) -> bool {
    OPENING.contains(&name)
}

/// The names after `response.` of every whole `event:` line in `bytes` (its first byte a
/// line start when `at_line_start`).
fn event_names(bytes: &[u8], at_line_start: bool) -> impl Iterator<Item = &[u8]> {
    let first = at_line_start.then_some(bytes);
    let after_newlines = bytes
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b == b'\n' || b == b'\r')
        .filter_map(move |(i, _)| bytes.get(i + 1..));
    first
        .into_iter()
        .chain(after_newlines)
        .filter_map(response_event_name)
}

/// A line `event: response.NAME` (the space optional, as in SSE) ended by CR or LF.
fn response_event_name(line: &[u8]) -> Option<&[u8]> {
    let value = line.strip_prefix(b"event:")?;
    let value = value.strip_prefix(b" ").unwrap_or(value);
    let name = value.strip_prefix(b"response.")?;
    let end = name.iter().position(|&b| b == b'\n' || b == b'\r')?;
    name.get(..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
        hay.windows(needle.len()).position(|w| w == needle)
    }

    const CREATED: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\",\"instructions\":\"say \\\"type\\\":\\\"response.output_text.delta\\\"\",\"tools\":[{\"type\":\"function\"}]}}\n\n";
    const IN_PROGRESS: &[u8] =
        b"event: response.in_progress\ndata: {\"type\": \"response.in_progress\"}\n\n";
    const DELTA: &[u8] = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n";

    #[test]
    fn the_opening_events_are_not_the_first_token() {
        let mut o = OpeningEvents::default();
        assert!(!o.past_opening(CREATED));
        assert!(!o.past_opening(IN_PROGRESS));
        assert!(o.past_opening(DELTA));
    }

    #[test]
    fn opening_and_first_token_in_one_chunk_is_past() {
        let mut o = OpeningEvents::default();
        assert!(o.past_opening(&[CREATED, IN_PROGRESS, DELTA].concat()));
    }

    #[test]
    fn a_type_split_at_any_byte_is_read() {
        let stream = [CREATED, IN_PROGRESS, DELTA].concat();
        let delta_line = b"event: response.output_text.delta\n";
        // Past once the delta's event line has arrived whole, not before.
        let whole_at = find(&stream, delta_line).unwrap() + delta_line.len();
        for cut in 1..stream.len() {
            let mut o = OpeningEvents::default();
            let (a, b) = stream.split_at(cut);
            let early = o.past_opening(a);
            assert_eq!(early, cut >= whole_at, "cut at {cut}");
            assert!(early || o.past_opening(b), "cut at {cut}");
        }
    }

    #[test]
    fn one_byte_at_a_time_is_past_only_at_the_delta() {
        let stream = [CREATED, IN_PROGRESS, DELTA].concat();
        let mut o = OpeningEvents::default();
        let at = stream
            .iter()
            .position(|&b| o.past_opening(&[b]))
            .expect("the delta is read");
        assert!(at >= CREATED.len() + IN_PROGRESS.len(), "{at}");
        assert!(at < stream.len());
    }

    #[test]
    fn a_failed_answer_has_no_first_token() {
        let mut o = OpeningEvents::default();
        assert!(!o.past_opening(CREATED));
        assert!(
            !o.past_opening(b"event: response.failed\ndata: {\"type\":\"response.failed\"}\n\n")
        );
        assert!(!o.past_opening(b"event: error\ndata: {\"type\":\"error\"}\n\n"));
    }

    #[test]
    fn a_type_in_the_data_is_no_event() {
        // `metadata` and tool schemas are the client's, echoed in `response.created`.
        let mut o = OpeningEvents::default();
        let forged = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"metadata\":{\"type\":\"response.output_text.delta\"},\"note\":\"a\\nevent: response.output_text.delta\\n\"}}\n\n";
        assert!(!o.past_opening(forged));
        // A stream without `event:` lines gives no first token.
        let mut o = OpeningEvents::default();
        assert!(!o.past_opening(b"data: {\"type\":\"response.output_text.delta\"}\n\n"));
    }

    #[test]
    fn crlf_lines_and_no_space_after_the_colon_are_read() {
        let mut o = OpeningEvents::default();
        assert!(!o.past_opening(b"event:response.created\r\ndata: {}\r\n\r\n"));
        assert!(o.past_opening(b"event:response.output_item.added\r\ndata: {}\r\n\r\n"));
    }
}

//! One HTTP stream (an HTTP context) driven like Envoy drives a filter: header maps the
//! test supplies, bodies delivered in chunks with StopIterationAndBuffer semantics, and
//! log/done/delete at the end. Each callback's returned action is recorded.

use anyhow::Context as _;

use super::abi::Action;
use super::state::{find, to_pairs, to_strings, Direction, HttpCall, LocalResponse, Phase};
use super::vm::{Inner, Vm};

/// Handle to one HTTP context of a [`Vm`]; several can be open at once.
pub struct Stream {
    pub(crate) vm: Vm,
    pub(crate) id: u32,
}

const REQUEST: bool = true;
const RESPONSE: bool = false;

fn dir(inner: &mut Inner, id: u32, request: bool) -> anyhow::Result<&mut Direction> {
    let s = inner.stream_mut(id)?;
    Ok(if request {
        &mut s.request
    } else {
        &mut s.response
    })
}

impl Stream {
    /// The context id the module sees.
    pub fn id(&self) -> u32 {
        self.id
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> anyhow::Result<R>) -> anyhow::Result<R> {
        f(&mut self.vm.inner.borrow_mut())
    }

    fn callback(
        &self,
        inner: &mut Inner,
        phase: Phase,
        name: &str,
        args: &[u64],
    ) -> anyhow::Result<Action> {
        let id = self.id;
        let code = inner.call(id, name, &[&[u64::from(id)], args].concat())?;
        // A module without this callback lets the stream continue.
        let action = Action::from_code(code.unwrap_or(0));
        inner.stream_mut(id)?.actions.push((phase, action));
        Ok(action)
    }

    fn headers(
        &self,
        request: bool,
        headers: &[(&str, &str)],
        eos: bool,
    ) -> anyhow::Result<Action> {
        let (phase, name) = if request {
            (Phase::RequestHeaders, "proxy_on_request_headers")
        } else {
            (Phase::ResponseHeaders, "proxy_on_response_headers")
        };
        self.with(|i| {
            i.ensure_created(self.id)?;
            let d = dir(i, self.id, request)?;
            d.headers = to_pairs(headers);
            d.headers_live = true;
            let action = self.callback(i, phase, name, &[headers.len() as u64, eos.into()])?;
            if action == Action::Continue {
                // Envoy drops its pointer to the map: later access is BadArgument.
                dir(i, self.id, request)?.headers_live = false;
            }
            Ok(action)
        })
    }

    /// Envoy `decodeData`/`encodeData`: the filter sees the buffered body plus this chunk;
    /// Pause keeps buffering, Continue forwards everything buffered.
    fn body(&self, request: bool, chunk: &[u8], eos: bool) -> anyhow::Result<Action> {
        let (phase, name) = if request {
            (Phase::RequestBody, "proxy_on_request_body")
        } else {
            (Phase::ResponseBody, "proxy_on_response_body")
        };
        self.with(|i| {
            i.ensure_created(self.id)?;
            let d = dir(i, self.id, request)?;
            d.body.extend_from_slice(chunk);
            let size = d.body.len() as u64;
            let action = self.callback(i, phase, name, &[size, eos.into()])?;
            let d = dir(i, self.id, request)?;
            match action {
                Action::Continue => d.flush(),
                _ => d.buffering = true,
            }
            Ok(action)
        })
    }

    fn trailers(&self, request: bool, trailers: &[(&str, &str)]) -> anyhow::Result<Action> {
        let (phase, name) = if request {
            (Phase::RequestTrailers, "proxy_on_request_trailers")
        } else {
            (Phase::ResponseTrailers, "proxy_on_response_trailers")
        };
        self.with(|i| {
            i.ensure_created(self.id)?;
            let d = dir(i, self.id, request)?;
            d.trailers = to_pairs(trailers);
            d.trailers_live = true;
            let action = self.callback(i, phase, name, &[trailers.len() as u64])?;
            if action == Action::Continue {
                let d = dir(i, self.id, request)?;
                d.trailers_live = false;
                d.flush();
            }
            Ok(action)
        })
    }

    /// `proxy_on_request_headers(ctx, n, end_of_stream)` with exactly these headers.
    pub fn request_headers(
        &self,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> anyhow::Result<Action> {
        self.headers(REQUEST, headers, end_of_stream)
    }

    /// `proxy_on_request_body` for one more chunk.
    pub fn request_body(&self, chunk: &[u8], end_of_stream: bool) -> anyhow::Result<Action> {
        self.body(REQUEST, chunk, end_of_stream)
    }

    /// `proxy_on_request_trailers`; ends the request.
    pub fn request_trailers(&self, trailers: &[(&str, &str)]) -> anyhow::Result<Action> {
        self.trailers(REQUEST, trailers)
    }

    pub fn response_headers(
        &self,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> anyhow::Result<Action> {
        self.headers(RESPONSE, headers, end_of_stream)
    }

    pub fn response_body(&self, chunk: &[u8], end_of_stream: bool) -> anyhow::Result<Action> {
        self.body(RESPONSE, chunk, end_of_stream)
    }

    pub fn response_trailers(&self, trailers: &[(&str, &str)]) -> anyhow::Result<Action> {
        self.trailers(RESPONSE, trailers)
    }

    /// Ends the stream as Envoy does: `proxy_on_log` (maps readable, not writable),
    /// `proxy_on_done`, `proxy_on_delete`; its pending HTTP calls are cancelled.
    pub fn end(&self) -> anyhow::Result<()> {
        let id = self.id;
        self.with(|i| {
            if !i.stream_mut(id)?.created {
                return Ok(());
            }
            i.stream_mut(id)?.in_log = true;
            let logged = i.call(id, "proxy_on_log", &[id.into()]);
            i.stream_mut(id)?.in_log = false;
            logged?;
            i.call(id, "proxy_on_done", &[id.into()])?;
            i.call(id, "proxy_on_delete", &[id.into()])?;
            let st = i.state();
            st.pending_calls.retain(|c| c.context_id != id);
            let done = st.streams.remove(&id).context("stream vanished")?;
            st.finished.insert(id, done);
            Ok(())
        })
    }

    fn read<R>(&self, f: impl FnOnce(&super::state::StreamState) -> R) -> Option<R> {
        let mut inner = self.vm.inner.borrow_mut();
        let st = inner.state();
        st.streams
            .get(&self.id)
            .or_else(|| st.finished.get(&self.id))
            .map(f)
    }

    /// The first value of request header `name` as the filter left it.
    pub fn request_header(&self, name: &str) -> Option<String> {
        self.read(|s| {
            find(&s.request.headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .flatten()
    }

    /// Every request header as the filter left it, in order.
    pub fn request_header_map(&self) -> Vec<(String, String)> {
        self.read(|s| to_strings(&s.request.headers))
            .unwrap_or_default()
    }

    pub fn response_header(&self, name: &str) -> Option<String> {
        self.read(|s| {
            find(&s.response.headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .flatten()
    }

    pub fn response_header_map(&self) -> Vec<(String, String)> {
        self.read(|s| to_strings(&s.response.headers))
            .unwrap_or_default()
    }

    /// Request body that went past the filter so far (to the upstream).
    pub fn request_body_forwarded(&self) -> Vec<u8> {
        self.read(|s| s.request.forwarded.clone())
            .unwrap_or_default()
    }

    /// Response body that went past the filter so far (to the client).
    pub fn response_body_forwarded(&self) -> Vec<u8> {
        self.read(|s| s.response.forwarded.clone())
            .unwrap_or_default()
    }

    /// Every action the module returned on this stream, in order.
    pub fn actions(&self) -> Vec<(Phase, Action)> {
        self.read(|s| s.actions.clone()).unwrap_or_default()
    }

    pub fn local_response(&self) -> Option<LocalResponse> {
        self.read(|s| s.local_response.clone()).flatten()
    }

    /// Pending HTTP calls this stream dispatched.
    pub fn pending_calls(&self) -> Vec<HttpCall> {
        let id = self.id;
        self.vm
            .pending_calls()
            .into_iter()
            .filter(|c| c.context_id == id)
            .collect()
    }

    /// A property only this stream sees (e.g. `upstream.address` for `proxy_on_log`).
    pub fn set_property(&self, path: &[&str], value: &[u8]) {
        let path = path.iter().map(|p| p.to_string()).collect();
        let mut inner = self.vm.inner.borrow_mut();
        if let Some(s) = inner.state().streams.get_mut(&self.id) {
            s.properties.insert(path, value.to_vec());
        }
    }
}

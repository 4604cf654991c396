//! The proxy-wasm binding (wasm32 only): the entry point, a `Host` over `hostcalls::*`, and
//! root/HTTP contexts that only forward to `filter`. Every host status becomes a
//! `HostError`; the SDK's unwrapping trait helpers are never called.

mod host;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel};

use std::rc::Rc;

use crate::filter::vm::Vm;
use crate::filter::{self, HttpFilter, Root};
use host::WasmHost;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("tokenaware panic: {info}"));
    }));
    proxy_wasm::set_root_context(|id| Box::new(RootCtx { id, root: None }));
}}

struct RootCtx {
    id: u32,
    root: Option<Root>,
}

impl Context for RootCtx {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body: usize, _: usize) {
        if let Some(r) = self.root.as_mut() {
            r.on_call_response(&WasmHost, token, headers, body);
        }
    }

    /// The plugin is being removed (reconfigured or Envoy draining): send held stats.
    fn on_done(&mut self) -> bool {
        if let Some(r) = self.root.as_ref() {
            r.on_done(&WasmHost);
        }
        true
    }
}

impl RootContext for RootCtx {
    fn on_vm_start(&mut self, _: usize) -> bool {
        let _ = hostcalls::log(
            LogLevel::Info,
            &format!("tokenaware {} VM started", crate::VERSION),
        );
        true
    }

    fn on_configure(&mut self, _: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        // Random per VM: std seeds RandomState from WASI random_get, so two VMs started at
        // the same instant still get different lease-owner ids.
        let nanos = filter::Host::now_ms(&WasmHost).unwrap_or(0);
        let id = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            (nanos, self.id),
        );
        match Root::configure(&WasmHost, &bytes, id) {
            Ok(root) => {
                let period = std::time::Duration::from_millis(root.tick_period_ms());
                let _ = hostcalls::set_tick_period(period);
                self.root = Some(root);
                true
            }
            Err(e) => {
                let _ = hostcalls::log(LogLevel::Critical, &e.to_string());
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(r) = self.root.as_mut() {
            r.on_tick(&WasmHost);
        }
    }

    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(http_context(self.root.as_ref().map(Root::vm)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

#[cfg(not(any(feature = "overhead-baseline", feature = "overhead-noop")))]
fn http_context(vm: Option<Rc<Vm>>) -> Box<dyn HttpContext> {
    Box::new(HttpCtx(HttpFilter::new(vm)))
}

#[cfg(feature = "overhead-baseline")]
fn http_context(vm: Option<Rc<Vm>>) -> Box<dyn HttpContext> {
    Box::new(BareCtx(filter::BareFilter::new(vm)))
}

#[cfg(all(feature = "overhead-noop", not(feature = "overhead-baseline")))]
fn http_context(_: Option<Rc<Vm>>) -> Box<dyn HttpContext> {
    Box::new(NoopCtx)
}

#[cfg_attr(
    any(feature = "overhead-baseline", feature = "overhead-noop"),
    allow(dead_code)
)]
struct HttpCtx(HttpFilter);

#[cfg_attr(
    all(feature = "overhead-noop", not(feature = "overhead-baseline")),
    allow(dead_code)
)]
fn action(a: filter::Action) -> Action {
    match a {
        filter::Action::Continue => Action::Continue,
        filter::Action::Pause => Action::Pause,
    }
}

impl Context for HttpCtx {}

impl HttpContext for HttpCtx {
    fn on_http_request_headers(&mut self, _: usize, eos: bool) -> Action {
        #[cfg(feature = "fault-injection")]
        fault_injection();
        action(self.0.on_request_headers(&WasmHost, eos))
    }

    fn on_http_request_body(&mut self, size: usize, eos: bool) -> Action {
        action(self.0.on_request_body(&WasmHost, size, eos))
    }

    fn on_http_request_trailers(&mut self, _: usize) -> Action {
        action(self.0.on_request_trailers(&WasmHost))
    }

    fn on_http_response_headers(&mut self, _: usize, eos: bool) -> Action {
        action(self.0.on_response_headers(&WasmHost, eos))
    }

    fn on_http_response_body(&mut self, size: usize, eos: bool) -> Action {
        action(self.0.on_response_body(&WasmHost, size, eos))
    }

    fn on_log(&mut self) {
        self.0.on_log(&WasmHost);
    }
}

/// `overhead-baseline` builds only: the yardstick filter (`filter::bare`).
#[cfg(feature = "overhead-baseline")]
struct BareCtx(filter::BareFilter);

#[cfg(feature = "overhead-baseline")]
impl Context for BareCtx {}

#[cfg(feature = "overhead-baseline")]
impl HttpContext for BareCtx {
    fn on_http_request_headers(&mut self, _: usize, eos: bool) -> Action {
        action(self.0.on_request_headers(&WasmHost, eos))
    }

    fn on_http_request_body(&mut self, size: usize, eos: bool) -> Action {
        action(self.0.on_request_body(&WasmHost, size, eos))
    }
}

/// `overhead-noop` builds only: a stream context that holds the request until its body is
/// complete and reads nothing, the floor of any filter that must see the whole body.
#[cfg(feature = "overhead-noop")]
struct NoopCtx;

#[cfg(feature = "overhead-noop")]
impl Context for NoopCtx {}

#[cfg(feature = "overhead-noop")]
impl HttpContext for NoopCtx {
    fn on_http_request_headers(&mut self, _: usize, eos: bool) -> Action {
        if eos {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, _: usize, eos: bool) -> Action {
        if eos {
            Action::Continue
        } else {
            Action::Pause
        }
    }
}

/// `fault-injection` builds only: `x-tokenaware-fault: trap` on a request traps the VM.
#[cfg(feature = "fault-injection")]
fn fault_injection() {
    use proxy_wasm::types::MapType;
    let v = hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-tokenaware-fault");
    if matches!(v, Ok(Some(v)) if v == "trap") {
        #[expect(
            clippy::panic,
            reason = "test-only trap trigger, compiled out by default"
        )]
        {
            panic!("fault injection: trap requested");
        }
    }
}

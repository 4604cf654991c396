//! One module instance (an Envoy worker VM): root-context lifecycle, ticks, HTTP calls and
//! what the module recorded. A trap marks the VM failed, as Envoy's `FailState::RuntimeError`
//! does: later calls on it return an error without running wasm.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use wasmtime::{Instance, Module, Store, Val, ValType};

use super::abi::{LogLevel, Status};
use super::imports;
use super::shared::SharedState;
use super::state::{to_pairs, CallResponse, Event, HttpCall, LogEntry, StreamState, VmState};
use super::stream::Stream;

/// Fuel for one callback: a module stuck in a loop traps instead of hanging the test.
const FUEL_PER_CALL: u64 = 20_000_000_000;

/// The error a callback returns when the module trapped (a Rust panic is a trap).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trapped {
    /// The export that was running, e.g. `proxy_on_request_body`.
    pub callback: String,
    /// The trap, plus any Critical log line the SDK's panic hook wrote just before it.
    pub message: String,
}

impl fmt::Display for Trapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} trapped: {}", self.callback, self.message)
    }
}

impl std::error::Error for Trapped {}

pub(crate) struct Inner {
    pub store: Store<VmState>,
    instance: Instance,
    failure: Option<Trapped>,
    default_root: Option<u32>,
}

impl Inner {
    pub fn state(&mut self) -> &mut VmState {
        self.store.data_mut()
    }

    /// Calls an export with `args` converted to its parameter types. A missing export is
    /// skipped (`Ok(None)`), as Envoy skips callbacks a module does not define.
    pub fn call(&mut self, ctx: u32, name: &str, args: &[u64]) -> anyhow::Result<Option<u64>> {
        if let Some(failed) = &self.failure {
            return Err(anyhow!("VM failed earlier ({failed}); {name} not called"));
        }
        let Some(func) = self.instance.get_func(&mut self.store, name) else {
            return Ok(None);
        };
        let ty = func.ty(&self.store);
        let params: Vec<Val> = ty
            .params()
            .zip(args.iter().chain(std::iter::repeat(&0)))
            .map(|(t, a)| match t {
                ValType::I64 => Val::I64(*a as i64),
                _ => Val::I32(*a as i32),
            })
            .collect();
        let mut results: Vec<Val> = ty.results().map(|_| Val::I32(0)).collect();
        let st = self.store.data_mut();
        st.active = ctx;
        st.effective = ctx;
        let logs_before = st.logs.len();
        // Fuel bounds each call where the engine meters it (not the profiling one).
        if self.store.get_fuel().is_ok() {
            self.store.set_fuel(FUEL_PER_CALL)?;
        }
        match func.call(&mut self.store, &params, &mut results) {
            Ok(()) => Ok(results.first().map(|v| match v {
                Val::I64(x) => *x as u64,
                Val::I32(x) => *x as u32 as u64,
                _ => 0,
            })),
            Err(e) => {
                let panic_lines: Vec<String> = self.store.data().logs[logs_before..]
                    .iter()
                    .filter(|l| l.level == LogLevel::Critical)
                    .map(|l| l.message.clone())
                    .collect();
                let mut message = format!("{e:?}");
                if !panic_lines.is_empty() {
                    message = format!("{} ({message})", panic_lines.join("; "));
                }
                let trapped = Trapped {
                    callback: name.to_string(),
                    message,
                };
                self.failure = Some(trapped.clone());
                Err(trapped.into())
            }
        }
    }

    pub fn stream_mut(&mut self, id: u32) -> anyhow::Result<&mut StreamState> {
        self.state()
            .streams
            .get_mut(&id)
            .ok_or_else(|| anyhow!("no stream {id}"))
    }

    /// Envoy creates the HTTP context lazily, on the first stream event.
    pub fn ensure_created(&mut self, id: u32) -> anyhow::Result<()> {
        let s = self.stream_mut(id)?;
        if s.created {
            return Ok(());
        }
        s.created = true;
        let root = s.root_id;
        self.call(id, "proxy_on_context_create", &[id.into(), root.into()])?;
        Ok(())
    }
}

/// A module instance. Cheap to clone (a handle); not `Send`.
#[derive(Clone)]
pub struct Vm {
    pub(crate) inner: Rc<RefCell<Inner>>,
}

impl Vm {
    pub(crate) fn instantiate(
        module: &Module,
        shared: Arc<Mutex<SharedState>>,
        seed: u64,
    ) -> anyhow::Result<Vm> {
        let mut store = Store::new(module.engine(), VmState::new(shared, seed));
        if store.get_fuel().is_ok() {
            store.set_fuel(FUEL_PER_CALL)?;
        }
        let linker = imports::linker(&mut store, module)?;
        let instance = linker
            .instantiate(&mut store, module)
            .map_err(|e| anyhow!("instantiating module: {e:?}"))?;
        let mut inner = Inner {
            store,
            instance,
            failure: None,
            default_root: None,
        };
        // Reactor modules (the SDK's `main!`) run their constructors and `main!` block here.
        inner.call(0, "_initialize", &[])?;
        Ok(Vm {
            inner: Rc::new(RefCell::new(inner)),
        })
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.borrow_mut())
    }

    fn state<R>(&self, f: impl FnOnce(&mut VmState) -> R) -> R {
        self.with(|i| f(i.state()))
    }

    /// Creates root context `root_id` (first time: `proxy_on_context_create(root, 0)` and
    /// `proxy_on_vm_start`) and calls `proxy_on_configure` with `config` readable as the
    /// PluginConfiguration buffer. Returns what the module returned (`false` = rejected).
    pub fn configure(&self, root_id: u32, config: &[u8]) -> anyhow::Result<bool> {
        self.with(|i| {
            if let std::collections::btree_map::Entry::Vacant(e) = i.state().roots.entry(root_id) {
                e.insert(0);
                i.default_root.get_or_insert(root_id);
                i.call(root_id, "proxy_on_context_create", &[root_id.into(), 0])?;
                let size = i.state().vm_config.len() as u64;
                i.state().in_vm_start = true;
                let started = i.call(root_id, "proxy_on_vm_start", &[root_id.into(), size]);
                i.state().in_vm_start = false;
                if started? == Some(0) {
                    return Ok(false);
                }
            }
            i.state().plugin_config = Some(config.to_vec());
            let r = i.call(
                root_id,
                "proxy_on_configure",
                &[root_id.into(), config.len() as u64],
            );
            i.state().plugin_config = None;
            Ok(r? != Some(0))
        })
    }

    /// Bytes `proxy_on_vm_start` can read as the VmConfiguration buffer.
    pub fn set_vm_config(&self, config: &[u8]) {
        self.state(|s| s.vm_config = config.to_vec());
    }

    /// A new HTTP stream on the first configured root context. The module sees it when the
    /// first event (usually [`Stream::request_headers`]) arrives.
    pub fn stream(&self) -> Stream {
        let root = self.with(|i| i.default_root.unwrap_or(1));
        self.stream_on(root)
    }

    /// A new HTTP stream on root context `root_id`.
    pub fn stream_on(&self, root_id: u32) -> Stream {
        let id = self.state(|s| {
            let id = s.alloc_context_id();
            s.streams.insert(
                id,
                StreamState {
                    root_id,
                    ..Default::default()
                },
            );
            id
        });
        Stream {
            vm: self.clone(),
            id,
        }
    }

    /// Fires `proxy_on_tick` on every root context with a tick period set; returns how many.
    pub fn tick(&self) -> anyhow::Result<usize> {
        self.with(|i| {
            let roots: Vec<u32> = i
                .state()
                .roots
                .iter()
                .filter(|(_, ms)| **ms > 0)
                .map(|(id, _)| *id)
                .collect();
            for &root in &roots {
                i.call(root, "proxy_on_tick", &[root.into()])?;
            }
            Ok(roots.len())
        })
    }

    /// The tick period root context `root_id` asked for, in milliseconds (0 = off).
    pub fn tick_period_ms(&self, root_id: u32) -> Option<u32> {
        self.state(|s| s.roots.get(&root_id).copied())
    }

    /// HTTP calls dispatched and not yet completed, oldest first.
    pub fn pending_calls(&self) -> Vec<HttpCall> {
        self.state(|s| s.pending_calls.clone())
    }

    /// Completes call `token` with HTTP `status` (sent as `:status`), `headers` and `body`.
    pub fn complete_call(
        &self,
        token: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> anyhow::Result<()> {
        let status = status.to_string();
        let mut all = vec![(":status", status.as_str())];
        all.extend_from_slice(headers);
        self.respond(
            token,
            Some(CallResponse {
                headers: to_pairs(&all),
                body: body.to_vec(),
                trailers: Vec::new(),
            }),
        )
    }

    /// Completes call `token` as failed (reset, timeout): Envoy passes 0 headers, 0 body.
    pub fn fail_call(&self, token: u32) -> anyhow::Result<()> {
        self.respond(token, None)
    }

    fn respond(&self, token: u32, resp: Option<CallResponse>) -> anyhow::Result<()> {
        self.with(|i| {
            let st = i.state();
            let at = st
                .pending_calls
                .iter()
                .position(|c| c.token == token)
                .ok_or_else(|| anyhow!("no pending call with token {token}"))?;
            let call = st.pending_calls.remove(at);
            let sizes = resp.as_ref().map_or([0, 0, 0], |r| {
                [
                    r.headers.len() as u64,
                    r.body.len() as u64,
                    r.trailers.len() as u64,
                ]
            });
            st.call_response = resp;
            let ctx = call.context_id;
            let args = [ctx.into(), token.into(), sizes[0], sizes[1], sizes[2]];
            let r = i.call(ctx, "proxy_on_http_call_response", &args);
            i.state().call_response = None;
            r.map(|_| ())
        })
    }

    /// Makes every later `proxy_http_call` return `status` (e.g. BadArgument); `None` undoes it.
    pub fn set_http_call_status(&self, status: Option<Status>) {
        self.state(|s| s.http_call_status = status);
    }

    /// Known upstream clusters: a call to any other returns BadArgument, as in Envoy.
    /// By default every cluster is known.
    pub fn set_clusters(&self, clusters: &[&str]) {
        self.state(|s| s.clusters = Some(clusters.iter().map(|c| c.to_string()).collect()));
    }

    /// Counter or gauge value by name (shared by all VMs of the host, as in Envoy).
    pub fn metric(&self, name: &str) -> Option<i64> {
        self.state(|s| s.shared().metrics.get(name).and_then(|m| m.value()))
    }

    /// Samples recorded into histogram `name`.
    pub fn histogram(&self, name: &str) -> Option<Vec<u64>> {
        self.state(|s| match s.shared().metrics.get(name) {
            Some(super::Metric::Histogram(v)) => Some(v.clone()),
            _ => None,
        })
    }

    pub fn logs(&self) -> Vec<LogEntry> {
        self.state(|s| s.logs.clone())
    }

    /// Every log message, one per line (for `contains` checks).
    pub fn log_text(&self) -> String {
        self.state(|s| {
            s.logs
                .iter()
                .map(|l| l.message.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
    }

    /// What `proxy_get_log_level` returns (default Trace).
    pub fn set_log_level(&self, level: LogLevel) {
        self.state(|s| s.log_level = level);
    }

    /// A property for `proxy_get_property` on every context of this VM (a stream's own
    /// properties win). Unknown paths are NotFound.
    pub fn set_property(&self, path: &[&str], value: &[u8]) {
        let path = path.iter().map(|p| p.to_string()).collect();
        self.state(|s| s.properties.insert(path, value.to_vec()));
    }

    /// An environment variable the module sees through WASI `environ_get`.
    pub fn set_env(&self, key: &str, value: &str) {
        self.state(|s| s.env.push((key.to_string(), value.to_string())));
    }

    /// Hostcalls that were only recorded, in order.
    pub fn events(&self) -> Vec<Event> {
        self.state(|s| s.events.clone())
    }

    /// Drops what ended streams left for inspection, so a long run's memory stays flat.
    pub fn forget_finished(&self) {
        self.state(|s| s.finished.clear());
    }

    /// What the module wrote to WASI stdout and stderr.
    pub fn stdio(&self) -> (String, String) {
        self.state(|s| {
            (
                String::from_utf8_lossy(&s.stdout).into_owned(),
                String::from_utf8_lossy(&s.stderr).into_owned(),
            )
        })
    }

    /// The trap that failed this VM, if any.
    pub fn failure(&self) -> Option<Trapped> {
        self.with(|i| i.failure.clone())
    }
}

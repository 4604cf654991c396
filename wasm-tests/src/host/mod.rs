//! A proxy-wasm test host on wasmtime: loads a real `.wasm` filter (ABI 0.2.1, Rust SDK
//! 0.2.5) and drives it deterministically, with Envoy's semantics where they matter
//! (body buffering, header-map lifetime, shared-data CAS, metric rules, HTTP-call checks).
//!
//! ```no_run
//! use wasm_tests::host::{Action, Host};
//! let host = Host::new(); // shared data, metrics, clock
//! let vm = host.load("target/wasm32-wasip1/release/tokenaware.wasm")?;
//! assert!(vm.configure(1, br#"{"endpoints":[]}"#)?);
//! let s = vm.stream();
//! assert_eq!(s.request_headers(&[(":method", "POST"), (":path", "/v1/completions")], false)?, Action::Pause);
//! s.request_body(br#"{"prompt":"hi"}"#, true)?;
//! let dest = s.request_header("x-gateway-destination-endpoint");
//! s.end()?;
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! Each [`Host`] owns its state (no globals besides a compiled-module cache), so tests run in
//! parallel. Several [`Vm`]s of one host share data and metrics, like Envoy's worker VMs.
//! Not modelled: shared queues, gRPC calls, TCP streams, foreign functions other than
//! `clear_route_cache`; their imports link and return a status.

mod abi;
pub mod fixture;
mod imports;
mod shared;
mod state;
mod stream;
mod vm;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use wasmtime::{Config, Engine, Module, ProfilingStrategy, Strategy};

pub use abi::{Action, BufferType, LogLevel, MapType, MetricType, Status, StreamType};
pub use shared::{Metric, EPOCH_NANOS};
pub use state::{Event, HttpCall, LocalResponse, LogEntry, Phase};
pub use stream::Stream;
pub use vm::{Trapped, Vm};

use shared::SharedState;

/// Which wasmtime compiler turns the filter into machine code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compiler {
    /// Winch, the baseline compiler, because the tests run a debug build of the compiler:
    /// it compiled the 490 KB filter in 5 s where Cranelift took 32 s.
    Baseline,
    /// Cranelift, the optimizing compiler, with no fuel metering, writing
    /// `/tmp/perf-PID.map` so `perf report` names the filter's functions (`hostprofile`:
    /// where the filter's own code spends).
    Profiled,
}

/// Compiled code is immutable, so one engine per compiler and one module per content hash
/// are shared by every host in the process.
fn engine(compiler: Compiler) -> anyhow::Result<&'static Engine> {
    static BASELINE: OnceLock<Result<Engine, String>> = OnceLock::new();
    static PROFILED: OnceLock<Result<Engine, String>> = OnceLock::new();
    let cell = match compiler {
        Compiler::Baseline => &BASELINE,
        Compiler::Profiled => &PROFILED,
    };
    let engine = cell.get_or_init(|| {
        let mut config = Config::new();
        // Fuel stops a runaway test call; metering every block would skew a profile.
        config.consume_fuel(compiler == Compiler::Baseline);
        match compiler {
            Compiler::Baseline => config.strategy(Strategy::Winch),
            Compiler::Profiled => config
                .strategy(Strategy::Cranelift)
                .profiler(ProfilingStrategy::PerfMap),
        };
        Engine::new(&config).map_err(|e| format!("{e:?}"))
    });
    engine
        .as_ref()
        .map_err(|e| anyhow::anyhow!("wasmtime engine: {e}"))
}

fn compile(bytes: &[u8], compiler: Compiler) -> anyhow::Result<Module> {
    static MODULES: OnceLock<Mutex<HashMap<(u64, Compiler), Module>>> = OnceLock::new();
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    let key = (hasher.finish(), compiler);
    // Held while compiling, so parallel tests wait for one compilation instead of each
    // compiling the same module.
    let mut cache = MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(m) = cache.get(&key) {
        return Ok(m.clone());
    }
    let module = Module::new(engine(compiler)?, bytes)?;
    cache.insert(key, module.clone());
    Ok(module)
}

/// The proxy: owns what Envoy shares between worker VMs and the virtual clock.
pub struct Host {
    shared: Arc<Mutex<SharedState>>,
    next_seed: AtomicU64,
}

impl Default for Host {
    fn default() -> Self {
        Host::new()
    }
}

impl Host {
    pub fn new() -> Host {
        Host {
            shared: Arc::default(),
            next_seed: AtomicU64::new(0x5eed),
        }
    }

    fn shared(&self) -> MutexGuard<'_, SharedState> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads, instantiates and initializes (`_initialize`) one VM from a `.wasm` file.
    pub fn load(&self, path: impl AsRef<Path>) -> anyhow::Result<Vm> {
        self.load_with(path, Compiler::Baseline)
    }

    /// Like [`Host::load`], compiled by `compiler`.
    pub fn load_with(&self, path: impl AsRef<Path>, compiler: Compiler) -> anyhow::Result<Vm> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        self.instantiate(&bytes, compiler)
            .with_context(|| format!("loading {}", path.display()))
    }

    /// Like [`Host::load`] from bytes (binary wasm).
    pub fn load_bytes(&self, wasm: &[u8]) -> anyhow::Result<Vm> {
        self.instantiate(wasm, Compiler::Baseline)
    }

    fn instantiate(&self, wasm: &[u8], compiler: Compiler) -> anyhow::Result<Vm> {
        let module = compile(wasm, compiler)?;
        let seed = self.next_seed.fetch_add(1, Ordering::Relaxed);
        Vm::instantiate(&module, self.shared.clone(), seed)
    }

    /// Advances the virtual clock (`proxy_get_current_time_nanoseconds`, WASI clocks).
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let mut s = self.shared();
        s.now_nanos = s.now_nanos.saturating_add(nanos);
    }

    /// Advances the virtual clock by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms));
    }

    pub fn now_nanos(&self) -> u64 {
        self.shared().now_nanos
    }

    /// Shared-data value of `key`.
    pub fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        self.shared().get(key).map(|(v, _)| v)
    }

    /// `proxy_get_shared_data` calls made so far, by every VM of this host.
    pub fn shared_reads(&self) -> u64 {
        self.shared().reads
    }

    /// Shared-data value and CAS of `key`.
    pub fn shared_entry(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared().get(key)
    }

    /// Unconditional write, as another worker would do.
    pub fn shared_set(&self, key: &str, value: &[u8]) {
        self.shared().set(key, value.to_vec(), 0);
    }

    pub fn shared_keys(&self) -> Vec<String> {
        self.shared().keys()
    }

    /// The next `n` conditional writes (CAS != 0) to existing keys fail with CasMismatch, as
    /// if another worker had written first (the stored CAS is bumped each time).
    pub fn inject_cas_conflicts(&self, n: u32) {
        self.shared().inject_conflicts(n);
    }

    /// Injected conflicts not yet consumed.
    pub fn cas_conflicts_left(&self) -> u32 {
        self.shared().injected_conflicts_left()
    }

    /// Counter or gauge value by name; `None` if undefined or a histogram.
    pub fn metric(&self, name: &str) -> Option<i64> {
        self.shared().metrics.get(name).and_then(Metric::value)
    }

    pub fn metrics(&self) -> BTreeMap<String, Metric> {
        self.shared().metrics.clone()
    }
}

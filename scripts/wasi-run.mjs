#!/usr/bin/env node
// Runs a wasm32-wasip1 program (e.g. a `cargo test` binary) under node:wasi (preview1).
//
//   CARGO_TARGET_WASM32_WASIP1_RUNNER="node /abs/path/scripts/wasi-run.mjs" \
//     cargo test --target wasm32-wasip1
//
// argv is passed through (argv[0] = the .wasm path, as cargo does), the environment is passed
// through, the current directory is preopened as "." (and as its absolute path), and the
// process exits with the program's exit code. A trap (e.g. a Rust panic, which is an abort on
// wasm32-wasip1) prints the error and exits with 134, like SIGABRT natively; note that with
// panic=abort the first failing #[test] ends the whole test binary.
import { readFile } from 'node:fs/promises';
import process from 'node:process';

// node:wasi prints an ExperimentalWarning on load; keep test output clean.
process.removeAllListeners('warning');
const { WASI } = await import('node:wasi');

const [, , wasmPath, ...args] = process.argv;
if (!wasmPath) {
  console.error('usage: node wasi-run.mjs PROGRAM.wasm [ARGS...]');
  process.exit(2);
}

const cwd = process.cwd();
const wasi = new WASI({
  version: 'preview1',
  args: [wasmPath, ...args],
  env: process.env,
  preopens: { '.': cwd, [cwd]: cwd },
  returnOnExit: true,
});

let code;
try {
  const module = await WebAssembly.compile(await readFile(wasmPath));
  const imports = wasi.getImportObject();
  // A program that links the whole crate (e.g. `examples/decision_cost`) imports the
  // proxy-wasm hostcalls (`env.*`) without calling them: stubs let it instantiate.
  const env = {};
  for (const imp of WebAssembly.Module.imports(module)) {
    if (imp.module === 'env' && imp.kind === 'function') env[imp.name] = () => 0;
  }
  if (Object.keys(env).length > 0) imports.env = env;
  const instance = await WebAssembly.instantiate(module, imports);
  // Such a program also exports the reactor's `_initialize`, which node:wasi refuses beside
  // `_start`: start it through a view without it.
  const { memory, _start } = instance.exports;
  code = wasi.start(instance.exports._initialize ? { exports: { memory, _start } } : instance);
} catch (err) {
  // Rust panics are aborts here: the test harness's captured panic message is lost with the
  // process, so rerun with `-- --nocapture` to see it; WASI_RUN_STACK=1 prints the wasm stack.
  const detail = process.env.WASI_RUN_STACK && err && err.stack ? err.stack : String(err);
  console.error(`wasi-run: ${wasmPath}: ${detail} (rerun with -- --nocapture to see a panic message)`);
  code = 134;
}
process.exitCode = typeof code === 'number' ? code : 0;

//! The module's imports: the `env.proxy_*` hostcalls of ABI 0.2.1 as Envoy implements them,
//! a deterministic WASI preview1 subset (virtual clock, seeded random, captured stdout), and
//! status-returning stubs for every other import so that instantiation never fails.
//!
//! Returning bytes follows cpp-host `copyToPointerSize`: empty data writes a null pointer and
//! size 0; otherwise the host calls the module's `proxy_on_memory_allocate` (or `malloc`),
//! copies the bytes there and writes pointer and size into the module's return slots.

use wasmtime::{Caller, Extern, ExternType, Linker, Module, Store, Val, ValType};

use super::abi::{
    deserialize_pairs, serialize_pairs, BufferType, LogLevel, MapType, MetricType, Status,
    StreamType,
};
use super::state::{find, to_strings, Event, HttpCall, LocalResponse, LogEntry, VmState};

type C<'a> = Caller<'a, VmState>;

/// A hostcall fails either with a status for the module or with a trap.
enum Fail {
    Status(Status),
    Trap(wasmtime::Error),
}

impl From<Status> for Fail {
    fn from(s: Status) -> Self {
        Fail::Status(s)
    }
}

impl From<wasmtime::Error> for Fail {
    fn from(e: wasmtime::Error) -> Self {
        Fail::Trap(e)
    }
}

type Res<T> = Result<T, Fail>;

fn ret(r: Res<()>) -> wasmtime::Result<i32> {
    match r {
        Ok(()) => Ok(Status::Ok.code()),
        Err(Fail::Status(s)) => Ok(s.code()),
        Err(Fail::Trap(e)) => Err(e),
    }
}

/// WASI errno values used here.
const ERRNO_BADF: i32 = 8;
const ERRNO_NOSYS: i32 = 52;

fn wasi(r: Res<()>) -> wasmtime::Result<i32> {
    match r {
        Ok(()) => Ok(0),
        Err(Fail::Status(_)) => Ok(21), // EFAULT
        Err(Fail::Trap(e)) => Err(e),
    }
}

// === memory helpers ===

fn memory(c: &mut C) -> Res<wasmtime::Memory> {
    c.get_export("memory")
        .and_then(Extern::into_memory)
        .ok_or(Fail::Status(Status::InvalidMemoryAccess))
}

fn read(c: &mut C, ptr: i32, len: i32) -> Res<Vec<u8>> {
    let mem = memory(c)?;
    let (p, l) = (ptr as u32 as usize, len as u32 as usize);
    let end = p.checked_add(l).ok_or(Status::InvalidMemoryAccess)?;
    Ok(mem
        .data(&c)
        .get(p..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .to_vec())
}

fn read_string(c: &mut C, ptr: i32, len: i32) -> Res<String> {
    Ok(String::from_utf8_lossy(&read(c, ptr, len)?).into_owned())
}

fn write(c: &mut C, ptr: i32, bytes: &[u8]) -> Res<()> {
    let mem = memory(c)?;
    let p = ptr as u32 as usize;
    let end = p
        .checked_add(bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    mem.data_mut(&mut *c)
        .get_mut(p..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

fn write_u32(c: &mut C, ptr: i32, v: u32) -> Res<()> {
    write(c, ptr, &v.to_le_bytes())
}

fn write_u64(c: &mut C, ptr: i32, v: u64) -> Res<()> {
    write(c, ptr, &v.to_le_bytes())
}

/// Hands `bytes` to the module: allocates in its memory and fills the two return slots.
fn copy_out(c: &mut C, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> Res<()> {
    if bytes.is_empty() {
        write_u32(c, ptr_ptr, 0)?;
        return write_u32(c, size_ptr, 0);
    }
    let alloc = c
        .get_export("proxy_on_memory_allocate")
        .or_else(|| c.get_export("malloc"))
        .and_then(Extern::into_func)
        .ok_or(Status::InvalidMemoryAccess)?;
    let len = i32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let ptr = alloc.typed::<i32, i32>(&*c)?.call(&mut *c, len)?;
    if ptr == 0 {
        return Err(Status::InvalidMemoryAccess.into());
    }
    write(c, ptr, bytes)?;
    write_u32(c, ptr_ptr, ptr as u32)?;
    write_u32(c, size_ptr, len as u32)
}

fn map_type(code: i32) -> Res<MapType> {
    Ok(MapType::from_code(code).ok_or(Status::BadArgument)?)
}

fn read_pairs(c: &mut C, ptr: i32, len: i32) -> Res<Vec<(String, String)>> {
    let bytes = read(c, ptr, len)?;
    let pairs = deserialize_pairs(&bytes).ok_or(Status::BadArgument)?;
    Ok(to_strings(&pairs))
}

// === hostcalls ===

fn get_buffer_bytes(c: &mut C, kind: i32, start: i32, max: i32, pp: i32, sp: i32) -> Res<()> {
    let st = c.data();
    let stream = st.streams.get(&st.effective);
    let buf: &[u8] = match BufferType::from_code(kind) {
        Some(BufferType::HttpRequestBody) => &stream.ok_or(Status::NotFound)?.request.body,
        Some(BufferType::HttpResponseBody) => &stream.ok_or(Status::NotFound)?.response.body,
        Some(BufferType::HttpCallResponseBody) => {
            &st.call_response.as_ref().ok_or(Status::NotFound)?.body
        }
        Some(BufferType::PluginConfiguration) => {
            st.plugin_config.as_deref().ok_or(Status::NotFound)?
        }
        Some(BufferType::VmConfiguration) if st.in_vm_start => &st.vm_config,
        _ => return Err(Status::NotFound.into()),
    };
    let start = (start as u32 as usize).min(buf.len());
    let end = start.saturating_add(max as u32 as usize).min(buf.len());
    let bytes = buf[start..end].to_vec();
    copy_out(c, &bytes, pp, sp)
}

/// Envoy `Buffer::copyFrom`: start 0 drains `len` bytes then prepends; start at or past
/// the end appends; anything else is BadArgument.
fn set_buffer_bytes(c: &mut C, kind: i32, start: i32, len: i32, ptr: i32, size: i32) -> Res<()> {
    let data = read(c, ptr, size)?;
    let st = c.data_mut();
    let stream = st.streams.get_mut(&st.effective).ok_or(Status::NotFound)?;
    let body = match BufferType::from_code(kind) {
        Some(BufferType::HttpRequestBody) => &mut stream.request.body,
        Some(BufferType::HttpResponseBody) => &mut stream.response.body,
        _ => return Err(Status::NotFound.into()),
    };
    let (start, len) = (start as u32 as usize, len as u32 as usize);
    if start == 0 {
        body.drain(..len.min(body.len()));
        body.splice(0..0, data);
    } else if start >= body.len() {
        body.extend_from_slice(&data);
    } else {
        return Err(Status::BadArgument.into());
    }
    Ok(())
}

fn get_map_pairs(c: &mut C, map: i32, pp: i32, sp: i32) -> Res<()> {
    let bytes = serialize_pairs(c.data().map(map_type(map)?)?);
    copy_out(c, &bytes, pp, sp)
}

fn set_map_pairs(c: &mut C, map: i32, ptr: i32, len: i32) -> Res<()> {
    let pairs = read_pairs(c, ptr, len)?;
    let target = c.data_mut().map_mut(map_type(map)?)?;
    *target = pairs
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.into_bytes()))
        .collect();
    Ok(())
}

fn get_map_value(c: &mut C, map: i32, kp: i32, kl: i32, pp: i32, sp: i32) -> Res<()> {
    let key = read_string(c, kp, kl)?;
    let pairs = c.data().map(map_type(map)?)?;
    let value = find(pairs, &key).ok_or(Status::NotFound)?.to_vec();
    copy_out(c, &value, pp, sp)
}

fn edit_map(
    c: &mut C,
    map: i32,
    kp: i32,
    kl: i32,
    value: Option<(i32, i32)>,
    add: bool,
) -> Res<()> {
    let key = read_string(c, kp, kl)?.to_ascii_lowercase();
    let value = match value {
        Some((vp, vl)) => Some(read(c, vp, vl)?),
        None => None,
    };
    let pairs = c.data_mut().map_mut(map_type(map)?)?;
    if !add {
        pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
    }
    if let Some(v) = value {
        pairs.push((key, v));
    }
    Ok(())
}

fn split_path(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn get_property(c: &mut C, pp: i32, pl: i32, rp: i32, rs: i32) -> Res<()> {
    let path = split_path(&read(c, pp, pl)?);
    let value = c.data().property(&path).ok_or(Status::NotFound)?.clone();
    copy_out(c, &value, rp, rs)
}

fn set_property(c: &mut C, pp: i32, pl: i32, vp: i32, vl: i32) -> Res<()> {
    let path = split_path(&read(c, pp, pl)?);
    let value = read(c, vp, vl)?;
    let st = c.data_mut();
    st.events.push(Event::SetProperty {
        path: path.clone(),
        value: value.clone(),
    });
    let effective = st.effective;
    match st.streams.get_mut(&effective) {
        Some(stream) => stream.properties.insert(path, value),
        None => st.properties.insert(path, value),
    };
    Ok(())
}

fn get_shared_data(c: &mut C, kp: i32, kl: i32, pp: i32, sp: i32, cas_ptr: i32) -> Res<()> {
    let key = read_string(c, kp, kl)?;
    let (value, cas) = {
        let mut shared = c.data().shared();
        shared.reads += 1;
        shared.get(&key).ok_or(Status::NotFound)?
    };
    copy_out(c, &value, pp, sp)?;
    write_u32(c, cas_ptr, cas)
}

fn set_shared_data(c: &mut C, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32) -> Res<()> {
    let key = read_string(c, kp, kl)?;
    let value = read(c, vp, vl)?;
    match c.data().shared().set(&key, value, cas as u32) {
        Status::Ok => Ok(()),
        s => Err(s.into()),
    }
}

fn send_local_response(c: &mut C, args: [i32; 8]) -> Res<()> {
    let [status, dp, dl, bp, bl, hp, hl, grpc_status] = args;
    let details = read_string(c, dp, dl)?;
    let body = read(c, bp, bl)?;
    let headers = read_pairs(c, hp, hl)?;
    let st = c.data_mut();
    let stream = st
        .streams
        .get_mut(&st.effective)
        .ok_or(Status::BadArgument)?;
    stream.local_response = Some(LocalResponse {
        status: status as u32,
        details,
        body,
        headers,
        grpc_status,
    });
    Ok(())
}

/// Envoy `Context::httpCall`: `:method`, `:path` and `:authority` are required and an
/// unknown cluster is BadArgument.
fn http_call(c: &mut C, args: [i32; 10]) -> Res<()> {
    let [up, ul, hp, hl, bp, bl, tp, tl, timeout, token_ptr] = args;
    let cluster = read_string(c, up, ul)?;
    let headers = read_pairs(c, hp, hl)?;
    let body = read(c, bp, bl)?;
    let trailers = read_pairs(c, tp, tl)?;
    let st = c.data_mut();
    if let Some(status) = st.http_call_status {
        return Err(status.into());
    }
    let has = |name: &str| headers.iter().any(|(k, _)| k == name);
    if !(has(":method") && has(":path") && has(":authority")) {
        return Err(Status::BadArgument.into());
    }
    if let Some(known) = &st.clusters {
        if !known.contains(&cluster) {
            return Err(Status::BadArgument.into());
        }
    }
    let token = st.next_token;
    st.next_token += 1;
    let context_id = st.effective;
    st.pending_calls.push(HttpCall {
        token,
        context_id,
        cluster,
        headers,
        body,
        trailers,
        timeout_ms: timeout as u32,
    });
    write_u32(c, token_ptr, token)
}

fn set_tick_period(c: &mut C, period: i32) -> Res<()> {
    let st = c.data_mut();
    let root = match st.streams.get(&st.effective) {
        Some(stream) => stream.root_id,
        None => st.effective,
    };
    let slot = st.roots.get_mut(&root).ok_or(Status::BadArgument)?;
    *slot = period as u32;
    Ok(())
}

fn log(c: &mut C, level: i32, ptr: i32, len: i32) -> Res<()> {
    let message = read_string(c, ptr, len)?;
    let level = LogLevel::from_code(level).ok_or(Status::BadArgument)?;
    let st = c.data_mut();
    let context_id = st.effective;
    st.logs.push(LogEntry {
        level,
        context_id,
        message,
    });
    Ok(())
}

fn set_effective_context(c: &mut C, id: i32) -> Res<()> {
    let st = c.data_mut();
    let id = id as u32;
    if !(st.roots.contains_key(&id) || st.streams.contains_key(&id)) {
        return Err(Status::BadArgument.into());
    }
    st.effective = id;
    Ok(())
}

fn continue_or_close(c: &mut C, stream: i32, close: bool) -> Res<()> {
    let st = c.data_mut();
    let context_id = st.effective;
    let stream = StreamType::from_code(stream);
    if close {
        st.events.push(Event::CloseStream { context_id, stream });
        return Ok(());
    }
    st.events.push(Event::ContinueStream { context_id, stream });
    // Envoy continueDecoding/continueEncoding: whatever was buffered goes on.
    if let Some(s) = st.streams.get_mut(&context_id) {
        match stream {
            StreamType::HttpRequest => s.request.flush(),
            StreamType::HttpResponse => s.response.flush(),
            _ => {}
        }
    }
    Ok(())
}

fn call_foreign_function(c: &mut C, np: i32, nl: i32, rp: i32, rs: i32) -> Res<()> {
    let name = read_string(c, np, nl)?;
    if name != "clear_route_cache" {
        return Err(Status::NotFound.into());
    }
    let st = c.data_mut();
    let context_id = st.effective;
    st.events.push(Event::ForeignFunction { context_id, name });
    copy_out(c, &[], rp, rs)
}

fn define_metric(c: &mut C, kind: i32, np: i32, nl: i32, id_ptr: i32) -> Res<()> {
    let name = read_string(c, np, nl)?;
    let kind = MetricType::from_code(kind).ok_or(Status::BadArgument)?;
    let st = c.data_mut();
    st.shared().define_metric(&name, kind);
    st.metric_names.push(name);
    let id = st.metric_names.len() as u32;
    write_u32(c, id_ptr, id)
}

fn metric_name(c: &C, id: i32) -> Res<String> {
    let index = (id as u32 as usize)
        .checked_sub(1)
        .ok_or(Status::NotFound)?;
    Ok(c.data()
        .metric_names
        .get(index)
        .ok_or(Status::NotFound)?
        .clone())
}

fn get_metric(c: &mut C, id: i32, ret_ptr: i32) -> Res<()> {
    let name = metric_name(c, id)?;
    let value = c.data().shared().metrics.get(&name).map(|m| m.value());
    match value {
        None => Err(Status::NotFound.into()),
        Some(None) => Err(Status::BadArgument.into()),
        Some(Some(v)) => write_u64(c, ret_ptr, v as u64),
    }
}

fn status_of(s: Status) -> Res<()> {
    match s {
        Status::Ok => Ok(()),
        s => Err(s.into()),
    }
}

// === WASI preview1 subset ===

fn fd_write(c: &mut C, fd: i32, iovs: i32, n: i32, written_ptr: i32) -> Res<()> {
    let mut out = Vec::new();
    for i in 0..n {
        let iov = read(c, iovs.wrapping_add(i * 8), 8)?;
        let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
        let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
        out.extend(read(c, ptr, len)?);
    }
    let st = c.data_mut();
    match fd {
        1 => st.stdout.extend_from_slice(&out),
        2 => st.stderr.extend_from_slice(&out),
        _ => return Err(Status::BadArgument.into()),
    }
    write_u32(c, written_ptr, out.len() as u32)
}

fn environ_sizes(c: &mut C, count_ptr: i32, size_ptr: i32) -> Res<()> {
    let env = &c.data().env;
    let count = env.len() as u32;
    let size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    write_u32(c, count_ptr, count)?;
    write_u32(c, size_ptr, size as u32)
}

fn environ_get(c: &mut C, environ: i32, buf: i32) -> Res<()> {
    let env = c.data().env.clone();
    let mut at = buf;
    for (i, (k, v)) in env.iter().enumerate() {
        let entry = format!("{k}={v}\0");
        write_u32(c, environ + 4 * i as i32, at as u32)?;
        write(c, at, entry.as_bytes())?;
        at += entry.len() as i32;
    }
    Ok(())
}

fn random_get(c: &mut C, buf: i32, len: i32) -> Res<()> {
    let mut bytes = Vec::with_capacity(len as u32 as usize);
    while bytes.len() < len as u32 as usize {
        bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
    }
    bytes.truncate(len as u32 as usize);
    write(c, buf, &bytes)
}

/// Builds the linker for one instance: every hostcall above, then a stub for each import
/// of `module` that is still undefined.
pub(crate) fn linker(
    store: &mut Store<VmState>,
    module: &Module,
) -> wasmtime::Result<Linker<VmState>> {
    let mut l = Linker::new(store.engine());
    add_proxy(&mut l)?;
    add_wasi(&mut l)?;
    for import in module.imports() {
        let ExternType::Func(ty) = import.ty() else {
            continue;
        };
        if l.get(&mut *store, import.module(), import.name()).is_ok() {
            continue;
        }
        let (m, n) = (import.module().to_string(), import.name().to_string());
        let code = match m.as_str() {
            "env" => Some(Status::Unimplemented.code()),
            "wasi_snapshot_preview1" => Some(ERRNO_NOSYS),
            _ => None,
        };
        let result_types: Vec<ValType> = ty.results().collect();
        l.func_new(
            import.module(),
            import.name(),
            ty,
            move |mut c, _params, results| {
                c.data_mut().events.push(Event::Unimplemented {
                    module: m.clone(),
                    name: n.clone(),
                });
                let Some(code) = code else {
                    return Err(wasmtime::Error::msg(format!(
                        "unknown import {m}.{n} called"
                    )));
                };
                for (i, (r, t)) in results.iter_mut().zip(&result_types).enumerate() {
                    *r = match t {
                        ValType::I32 if i == 0 => Val::I32(code),
                        ValType::I64 => Val::I64(0),
                        _ => Val::I32(0),
                    };
                }
                Ok(())
            },
        )?;
    }
    Ok(l)
}

fn add_proxy(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let e = "env";
    l.func_wrap(e, "proxy_log", |mut c: C, lv: i32, p: i32, n: i32| {
        ret(log(&mut c, lv, p, n))
    })?;
    l.func_wrap(e, "proxy_get_log_level", |mut c: C, p: i32| {
        let level = c.data().log_level as u32;
        ret(write_u32(&mut c, p, level))
    })?;
    l.func_wrap(
        e,
        "proxy_get_current_time_nanoseconds",
        |mut c: C, p: i32| {
            let now = c.data().shared().now_nanos;
            ret(write_u64(&mut c, p, now))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_set_tick_period_milliseconds",
        |mut c: C, ms: i32| ret(set_tick_period(&mut c, ms)),
    )?;
    l.func_wrap(
        e,
        "proxy_get_buffer_bytes",
        |mut c: C, t: i32, s: i32, m: i32, pp: i32, sp: i32| {
            ret(get_buffer_bytes(&mut c, t, s, m, pp, sp))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_set_buffer_bytes",
        |mut c: C, t: i32, s: i32, n: i32, p: i32, sz: i32| {
            ret(set_buffer_bytes(&mut c, t, s, n, p, sz))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_get_header_map_pairs",
        |mut c: C, m: i32, pp: i32, sp: i32| ret(get_map_pairs(&mut c, m, pp, sp)),
    )?;
    l.func_wrap(
        e,
        "proxy_set_header_map_pairs",
        |mut c: C, m: i32, p: i32, n: i32| ret(set_map_pairs(&mut c, m, p, n)),
    )?;
    l.func_wrap(
        e,
        "proxy_get_header_map_value",
        |mut c: C, m: i32, kp: i32, kl: i32, pp: i32, sp: i32| {
            ret(get_map_value(&mut c, m, kp, kl, pp, sp))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_replace_header_map_value",
        |mut c: C, m: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            ret(edit_map(&mut c, m, kp, kl, Some((vp, vl)), false))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_add_header_map_value",
        |mut c: C, m: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            ret(edit_map(&mut c, m, kp, kl, Some((vp, vl)), true))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_remove_header_map_value",
        |mut c: C, m: i32, kp: i32, kl: i32| ret(edit_map(&mut c, m, kp, kl, None, false)),
    )?;
    l.func_wrap(
        e,
        "proxy_get_property",
        |mut c: C, pp: i32, pl: i32, rp: i32, rs: i32| ret(get_property(&mut c, pp, pl, rp, rs)),
    )?;
    l.func_wrap(
        e,
        "proxy_set_property",
        |mut c: C, pp: i32, pl: i32, vp: i32, vl: i32| ret(set_property(&mut c, pp, pl, vp, vl)),
    )?;
    l.func_wrap(
        e,
        "proxy_get_shared_data",
        |mut c: C, kp: i32, kl: i32, pp: i32, sp: i32, cp: i32| {
            ret(get_shared_data(&mut c, kp, kl, pp, sp, cp))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_set_shared_data",
        |mut c: C, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| {
            ret(set_shared_data(&mut c, kp, kl, vp, vl, cas))
        },
    )?;
    l.func_wrap(e, "proxy_continue_stream", |mut c: C, s: i32| {
        ret(continue_or_close(&mut c, s, false))
    })?;
    l.func_wrap(e, "proxy_close_stream", |mut c: C, s: i32| {
        ret(continue_or_close(&mut c, s, true))
    })?;
    l.func_wrap(
        e,
        "proxy_send_local_response",
        |mut c: C, s: i32, dp: i32, dl: i32, bp: i32, bl: i32, hp: i32, hl: i32, g: i32| {
            ret(send_local_response(&mut c, [s, dp, dl, bp, bl, hp, hl, g]))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_http_call",
        |mut c: C,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         tp: i32,
         tl: i32,
         to: i32,
         rt: i32| { ret(http_call(&mut c, [up, ul, hp, hl, bp, bl, tp, tl, to, rt])) },
    )?;
    l.func_wrap(e, "proxy_set_effective_context", |mut c: C, id: i32| {
        ret(set_effective_context(&mut c, id))
    })?;
    l.func_wrap(e, "proxy_done", |mut c: C| {
        let context_id = c.data().effective;
        c.data_mut().events.push(Event::Done { context_id });
        ret(Ok(()))
    })?;
    l.func_wrap(
        e,
        "proxy_call_foreign_function",
        |mut c: C, np: i32, nl: i32, _ap: i32, _al: i32, rp: i32, rs: i32| {
            ret(call_foreign_function(&mut c, np, nl, rp, rs))
        },
    )?;
    l.func_wrap(
        e,
        "proxy_define_metric",
        |mut c: C, t: i32, np: i32, nl: i32, ip: i32| ret(define_metric(&mut c, t, np, nl, ip)),
    )?;
    l.func_wrap(e, "proxy_increment_metric", |c: C, id: i32, by: i64| {
        ret(metric_name(&c, id).and_then(|n| status_of(c.data().shared().increment_metric(&n, by))))
    })?;
    l.func_wrap(e, "proxy_record_metric", |c: C, id: i32, v: i64| {
        ret(metric_name(&c, id)
            .and_then(|n| status_of(c.data().shared().record_metric(&n, v as u64))))
    })?;
    l.func_wrap(e, "proxy_get_metric", |mut c: C, id: i32, p: i32| {
        ret(get_metric(&mut c, id, p))
    })?;
    Ok(())
}

fn add_wasi(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let w = "wasi_snapshot_preview1";
    l.func_wrap(
        w,
        "fd_write",
        |mut c: C, fd: i32, iovs: i32, n: i32, wp: i32| wasi(fd_write(&mut c, fd, iovs, n, wp)),
    )?;
    l.func_wrap(w, "environ_sizes_get", |mut c: C, cp: i32, sp: i32| {
        wasi(environ_sizes(&mut c, cp, sp))
    })?;
    l.func_wrap(w, "environ_get", |mut c: C, ep: i32, bp: i32| {
        wasi(environ_get(&mut c, ep, bp))
    })?;
    l.func_wrap(w, "args_sizes_get", |mut c: C, cp: i32, sp: i32| {
        wasi(write_u32(&mut c, cp, 0).and_then(|()| write_u32(&mut c, sp, 0)))
    })?;
    l.func_wrap(w, "args_get", |_c: C, _a: i32, _b: i32| Ok(0i32))?;
    l.func_wrap(
        w,
        "clock_time_get",
        |mut c: C, _id: i32, _precision: i64, p: i32| {
            let now = c.data().shared().now_nanos;
            wasi(write_u64(&mut c, p, now))
        },
    )?;
    l.func_wrap(w, "clock_res_get", |mut c: C, _id: i32, p: i32| {
        wasi(write_u64(&mut c, p, 1))
    })?;
    l.func_wrap(w, "random_get", |mut c: C, p: i32, n: i32| {
        wasi(random_get(&mut c, p, n))
    })?;
    l.func_wrap(w, "sched_yield", |_c: C| Ok(0i32))?;
    l.func_wrap(w, "fd_prestat_get", |_c: C, _fd: i32, _p: i32| {
        Ok(ERRNO_BADF)
    })?;
    l.func_wrap(w, "proc_exit", |_c: C, code: i32| -> wasmtime::Result<()> {
        Err(wasmtime::Error::msg(format!("proc_exit({code})")))
    })?;
    Ok(())
}

//! The least a filter of this shape does, as a yardstick for overhead runs: pause at the
//! headers of a routed path, buffer the body, parse it, hash the prompt (the same core code
//! as the real filter) and set the destination header to the endpoint the first block's
//! hash falls on. No shared tables, no decision, no response path, no stats. Only builds
//! with the `overhead-baseline` feature put it into the `.wasm` (in place of the real
//! filter); `overhead --baseline-wasm` then compares the two, so the difference is what the
//! tables, the decision and the response path cost inside Envoy. Never for traffic: a
//! client-sent destination header survives any request it does not route.

use std::rc::Rc;

use super::host::Host;
use super::http::{api_kind, Action, DESTINATION};
use super::vm::Vm;
use crate::request::{parse, ApiKind, ParseLimits};

pub struct BareFilter {
    vm: Option<Rc<Vm>>,
    buffering: Option<ApiKind>,
}

impl BareFilter {
    pub fn new(vm: Option<Rc<Vm>>) -> BareFilter {
        BareFilter {
            vm,
            buffering: None,
        }
    }

    pub fn on_request_headers<H: Host>(&mut self, h: &H, end_of_stream: bool) -> Action {
        let (Some(vm), Ok(Some(path))) = (&self.vm, h.request_header(":path")) else {
            return Action::Continue;
        };
        let path = String::from_utf8_lossy(&path);
        if end_of_stream || !vm.cfg.is_routed_path(&path) {
            return Action::Continue;
        }
        self.buffering = Some(api_kind(&path));
        Action::Pause
    }

    pub fn on_request_body<H: Host>(&mut self, h: &H, size: usize, end: bool) -> Action {
        let (Some(kind), Some(vm)) = (self.buffering, &self.vm) else {
            return Action::Continue;
        };
        if !end {
            return Action::Pause;
        }
        self.buffering = None;
        if let Some(address) = pick(h, vm, kind, size) {
            let _ = h.set_request_header(DESTINATION, address);
        }
        Action::Continue
    }
}

/// The configured endpoint the prompt's first block hash falls on.
fn pick<'a, H: Host>(h: &H, vm: &'a Vm, kind: ApiKind, size: usize) -> Option<&'a str> {
    let body = h.request_body(0, size).ok()?;
    let req = parse(kind, &body, &ParseLimits::default()).ok()?;
    let first = *vm.router.try_borrow().ok()?.hash(&req).hashes.first()?;
    let eps = &vm.cfg.endpoints;
    let i = usize::try_from(first % eps.len().max(1) as u64).ok()?;
    eps.get(i).map(|e| e.address.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::testing::FakeHost;
    use crate::filter::Root;

    fn vm(h: &FakeHost) -> Rc<Vm> {
        let cfg = br#"{"endpoints":[{"address":"127.0.0.1:8001"},{"address":"127.0.0.1:8002"}]}"#;
        match Root::configure(h, cfg, 1) {
            Ok(r) => r.vm(),
            Err(e) => panic!("{e}"),
        }
    }

    fn send(h: &FakeHost, vm: &Rc<Vm>, path: &str, body: &[u8]) -> Vec<Action> {
        h.new_request(path, body);
        let mut f = BareFilter::new(Some(vm.clone()));
        let mut acts = vec![f.on_request_headers(h, false)];
        acts.push(f.on_request_body(h, body.len() / 2, false));
        acts.push(f.on_request_body(h, body.len(), true));
        acts
    }

    #[test]
    fn same_prompt_same_endpoint_and_nothing_else_touched() {
        let h = FakeHost::new();
        let vm = vm(&h);
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
        let before = h.calls.borrow().clone();
        let acts = send(&h, &vm, "/v1/chat/completions", body);
        assert_eq!(acts, [Action::Pause, Action::Pause, Action::Continue]);
        let first = h.header_values(DESTINATION);
        assert_eq!(first.len(), 1);
        assert!(first[0].starts_with("127.0.0.1:800"), "{first:?}");
        send(&h, &vm, "/v1/chat/completions", body);
        assert_eq!(h.header_values(DESTINATION), first);
        let calls = h.calls_since(&before);
        assert!(
            !calls.contains_key("get") && !calls.contains_key("set"),
            "{calls:?}"
        );
    }

    #[test]
    fn unparsable_bodies_and_other_paths_get_no_header() {
        let h = FakeHost::new();
        let vm = vm(&h);
        assert_eq!(
            send(&h, &vm, "/v1/chat/completions", b"{not json"),
            [Action::Pause, Action::Pause, Action::Continue]
        );
        assert!(h.header_values(DESTINATION).is_empty());
        let acts = send(&h, &vm, "/healthz", b"{}");
        assert_eq!(acts[0], Action::Continue);
        assert!(h.header_values(DESTINATION).is_empty());
    }
}

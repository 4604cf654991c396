//! An assembled example bootstrap run for real: moved to loopback (listener and admin on
//! free 127.0.0.1 ports, the admin cluster pointed at that admin port, the model cluster's
//! endpoints replaced by the fleet's), Envoy started as a child process, every wait bounded,
//! the process killed on drop.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use wasm_tests::envoy::{envoy_binary, http_get};
use wasm_tests::ports::free_ports;

use super::support::CLIENT_TIMEOUT;

const READY: Duration = Duration::from_secs(30);

pub struct Live {
    child: Child,
    dir: PathBuf,
    port: u16,
    admin: u16,
}

/// `boot` with every address on loopback: the first listener on `port`, admin on `admin`,
/// the `tokenaware_admin` cluster on `admin`, `model_cluster`'s endpoints `endpoints`.
fn on_loopback(
    mut boot: Value,
    model_cluster: &str,
    endpoints: &[String],
    port: u16,
    admin: u16,
) -> Value {
    let addr = |p: u16| json!({ "socket_address": { "address": "127.0.0.1", "port_value": p } });
    boot["admin"]["address"] = addr(admin);
    boot["static_resources"]["listeners"][0]["address"] = addr(port);
    let lb: Vec<Value> = endpoints
        .iter()
        .map(|e| {
            let (ip, p) = e.rsplit_once(':').unwrap();
            let p: u16 = p.parse().unwrap();
            json!({ "endpoint": { "address": { "socket_address": { "address": ip, "port_value": p } } } })
        })
        .collect();
    let clusters = boot["static_resources"]["clusters"].as_array_mut().unwrap();
    let mut seen = 0;
    for c in clusters {
        let eps = if c["name"] == "tokenaware_admin" {
            json!([{ "endpoint": { "address": addr(admin) } }])
        } else if c["name"] == model_cluster {
            json!(lb)
        } else {
            continue;
        };
        c["load_assignment"]["endpoints"][0]["lb_endpoints"] = eps;
        seen += 1;
    }
    assert_eq!(seen, 2, "admin and model clusters expected");
    boot
}

impl Live {
    /// Starts Envoy on `boot` moved to loopback and waits (bounded) for admin `/ready`.
    pub fn start(boot: &Value, model_cluster: &str, endpoints: &[String]) -> Live {
        let ports = free_ports(2).unwrap();
        let (port, admin) = (ports[0], ports[1]);
        let boot = on_loopback(boot.clone(), model_cluster, endpoints, port, admin);
        let dir = std::env::temp_dir().join(format!(
            "tokenaware-deploy-live-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("envoy.json");
        std::fs::write(&cfg, serde_json::to_vec_pretty(&boot).unwrap()).unwrap();
        let child = Command::new(envoy_binary().unwrap())
            .arg("-c")
            .arg(&cfg)
            .args(["--concurrency", "1", "-l", "warn", "--disable-hot-restart"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.join("access.log")).unwrap())
            .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
            .spawn()
            .unwrap();
        let mut live = Live {
            child,
            dir,
            port,
            admin,
        };
        let deadline = Instant::now() + READY;
        loop {
            if let Some(status) = live.child.try_wait().unwrap() {
                panic!("envoy exited ({status}):\n{}", live.log());
            }
            if matches!(http_get(admin, "/ready"), Ok((200, _))) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "envoy not ready:\n{}",
                live.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        live
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// Sum of the admin stats named exactly `name` or ending in `.name`.
    pub fn stat(&self, name: &str) -> u64 {
        let (_, body) = http_get(self.admin, &format!("/stats?filter={name}$")).unwrap();
        body.lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| *k == name || k.ends_with(&format!(".{name}")))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }

    /// Waits (bounded) until `stat(name) >= min`.
    pub fn wait_stat(&self, name: &str, min: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while self.stat(name) < min {
            assert!(Instant::now() < deadline, "{name} < {min} after {within:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// POSTs `body` to `path` with `Host: host`; the response status, or None when the
    /// connection broke first (Envoy may close while the body is still being sent).
    pub fn post(&self, host: &str, path: &str, body: &str) -> Option<u16> {
        let addr = (Ipv4Addr::LOCALHOST, self.port).into();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
        s.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(CLIENT_TIMEOUT)).unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let sent = s
            .write_all(head.as_bytes())
            .and_then(|()| s.write_all(body.as_bytes()));
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok());
        if status.is_none() {
            eprintln!("no response (send: {sent:?})");
        }
        status
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("envoy config and logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

//! Free loopback ports for tests.
//!
//! Ports are probed by binding 127.0.0.1 and releasing them, so another process can still
//! take one before the caller binds it (rare; callers that bind themselves should retry).
//! Ranges are picked below Linux's default ephemeral range (32768–60999), so outgoing
//! connections do not steal them.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU16, Ordering};

const LOW: u16 = 20000;
const HIGH: u16 = 32000;

/// Per-process cursor, seeded by the pid so parallel test processes start apart.
static NEXT: AtomicU16 = AtomicU16::new(0);

fn is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// First port of `n` consecutive free ports.
pub fn free_port_range(n: usize) -> anyhow::Result<u16> {
    anyhow::ensure!(n > 0 && n < 1000, "bad port count {n}");
    let span = HIGH - LOW;
    let _ = NEXT.compare_exchange(
        0,
        (std::process::id() % u32::from(span)) as u16 + 1,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..200 {
        let off = NEXT.fetch_add(n as u16 + 1, Ordering::Relaxed) % span;
        let base = LOW + off;
        if usize::from(base) + n > usize::from(HIGH) {
            continue;
        }
        if (0..n as u16).all(|i| is_free(base + i)) {
            return Ok(base);
        }
    }
    anyhow::bail!("no {n} consecutive free ports found")
}

/// One free port.
pub fn free_port() -> anyhow::Result<u16> {
    free_port_range(1)
}

/// `k` distinct free ports (not necessarily consecutive).
pub fn free_ports(k: usize) -> anyhow::Result<Vec<u16>> {
    let base = free_port_range(k)?;
    Ok((0..k as u16).map(|i| base + i).collect())
}

//! Fault control for an in-process [`Fleet`](super::Fleet): each endpoint runs its own accept
//! loop and owns its connections, so one endpoint can be killed (listener closed, open
//! connections and in-flight requests dropped, like a crashed process) and restarted cold
//! (a fresh endpoint on the same port: empty prefix cache, counters from zero).
//!
//! The standalone `fleet` binary keeps using [`super::serve`]; this is for tests and tools
//! that hold a `Fleet`.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener as StdListener};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::server::Endpoint;
use super::FleetConfig;

pub(crate) type Reply = std::sync::mpsc::Sender<anyhow::Result<()>>;

/// What a [`Fleet`](super::Fleet) asks of its runtime thread.
pub(crate) enum Command {
    /// Drop the endpoint on this port at once: listener and connections.
    Kill(u16, Reply),
    /// Start a fresh endpoint on this port (it must not be running).
    Restart(u16, Reply),
}

struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

fn spawn(port: u16, listener: StdListener, cfg: Arc<FleetConfig>) -> anyhow::Result<Running> {
    let listener = TcpListener::from_std(listener)?;
    let app = Endpoint::new(port, cfg).router();
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(serve_endpoint(listener, app, rx));
    Ok(Running { stop, task })
}

/// Accepts until stopped; connections live in a `JoinSet` owned by this future, so aborting
/// the task drops every connection with it. A graceful stop lets open requests finish.
async fn serve_endpoint(listener: TcpListener, app: axum::Router, stop: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    let stopped = until_stopped(stop.clone());
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let svc = TowerToHyperService::new(app.clone());
                    let stop = until_stopped(stop.clone());
                    conns.spawn(async move {
                        let builder = Builder::new(TokioExecutor::new());
                        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                        tokio::pin!(conn);
                        tokio::select! {
                            _ = conn.as_mut() => return,
                            _ = stop => conn.as_mut().graceful_shutdown(),
                        }
                        let _ = conn.await;
                    });
                }
                // e.g. out of file descriptors: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            _ = &mut stopped => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

async fn until_stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await.is_ok();
}

/// Binds `127.0.0.1:port` again after a kill (bounded retries: the old socket may still be
/// closing).
fn rebind(port: u16) -> anyhow::Result<StdListener> {
    let mut last = None;
    for _ in 0..50 {
        match StdListener::bind((Ipv4Addr::LOCALHOST, port)) {
            Ok(l) => {
                l.set_nonblocking(true)?;
                return Ok(l);
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(anyhow::anyhow!("rebind 127.0.0.1:{port}: {last:?}"))
}

/// Runs the fleet until `shutdown`, serving kill/restart commands.
pub(crate) async fn run(
    cfg: FleetConfig,
    listeners: Vec<StdListener>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut shutdown: oneshot::Receiver<()>,
    grace: Duration,
) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    let mut running = BTreeMap::new();
    for l in listeners {
        let port = l.local_addr()?.port();
        running.insert(port, spawn(port, l, cfg.clone())?);
    }
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            c = commands.recv() => match c {
                None => break,
                Some(Command::Kill(port, reply)) => {
                    let r = match running.remove(&port) {
                        Some(ep) => {
                            ep.task.abort();
                            let _ = ep.task.await;
                            Ok(())
                        }
                        None => Err(anyhow::anyhow!("endpoint {port} is not running")),
                    };
                    let _ = reply.send(r);
                }
                Some(Command::Restart(port, reply)) => {
                    let r = match running.entry(port) {
                        Entry::Occupied(_) => {
                            Err(anyhow::anyhow!("endpoint {port} is already running"))
                        }
                        Entry::Vacant(slot) => rebind(port)
                            .and_then(|l| spawn(port, l, cfg.clone()))
                            .map(|ep| {
                                slot.insert(ep);
                            }),
                    };
                    let _ = reply.send(r);
                }
            },
        }
    }
    for ep in running.values() {
        let _ = ep.stop.send(true);
    }
    let drain = async {
        for (_, ep) in running {
            let _ = ep.task.await;
        }
    };
    if tokio::time::timeout(grace, drain).await.is_err() {
        eprintln!("fleet: grace period over, dropping in-flight requests");
    }
    Ok(())
}

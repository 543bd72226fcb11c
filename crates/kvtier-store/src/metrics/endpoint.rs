//! The metrics HTTP endpoint of every kvtier process: `GET /metrics`, `/healthz`, `/readyz`.
//!
//! Owns the listener threads, the per-connection handlers, their deadlines and the connection
//! bound, and the process's readiness registry ([`Readiness`], [`ReadyGate`]).
//!
//! Hardening (issue 26 §3): the endpoint is reachable by anyone who reaches its port, so no
//! client may hold it up for others.
//! - Each connection has its own handler thread, so a slow client never delays another
//!   scrape (one thread used to answer every connection in turn).
//! - Whole-request deadline: the request line and headers must arrive within
//!   [`REQUEST_DEADLINE`] of the accept, however the bytes are spread (a per-read timeout let
//!   a client sending one byte every 4 s hold the endpoint forever). A request body is never
//!   read: every answer closes the connection. Rendering and writing the answer have their
//!   own bound ([`RESPONSE_DEADLINE`]), so a client that stops reading is cut too.
//! - At most [`MAX_CONNECTIONS`] connections are open at once; when a new one arrives at the
//!   bound, the oldest connection still sending its request is cut for it (else the oldest
//!   being answered): a client that opens many connections and dribbles, or stops reading,
//!   cannot lock out a scraper, whose request arrives in one packet and is answered in
//!   milliseconds.
//! - The listener binds the address the operator gave; a bare port means loopback
//!   (`9100` = `127.0.0.1:9100`), and no listener exists unless one is configured.
//!
//! `/healthz` answers 200 while the process answers at all (liveness). `/readyz` answers 200
//! when every registered [`Readiness`] is ready and 503 with the reasons otherwise: `kvtier
//! serve` is ready once its arena is mapped, its SSD tier recovered and, in cluster mode, the
//! node is registered with a master that still answers; `kvtier master` once it leads or
//! follows a known leader; an embedded store once it is open.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{global, parse_addr, render, MetricsError};

/// Largest HTTP request head the endpoint reads.
const MAX_REQUEST_HEAD: usize = 8 << 10;
/// The request line and headers must be complete this long after the accept.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// Bound of answering one request (readiness checks, rendering, writing).
pub const RESPONSE_DEADLINE: Duration = Duration::from_secs(10);
/// Connections open at once on one endpoint (each has a handler thread).
pub const MAX_CONNECTIONS: usize = 64;
/// Stack of a handler thread (rendering needs little; 64 of them stay small).
const HANDLER_STACK: usize = 256 << 10;

/// Counter `{reason}`: connections the endpoint cut: `deadline` (the request was not complete
/// in time), `shed` (cut for a newer connection at the bound).
pub const HTTP_REFUSED: &str = "kvtier_metrics_http_refused_total";

/// A source of readiness: `None` when ready, otherwise why not.
pub trait Readiness: Send + Sync {
    fn not_ready(&self) -> Option<String>;
}

static READINESS: Mutex<Vec<Weak<dyn Readiness>>> = Mutex::new(Vec::new());

/// Add a readiness check to this process's `/readyz`; it is dropped once `check` is gone.
pub fn register_readiness(check: Weak<dyn Readiness>) {
    let mut list = READINESS.lock();
    list.retain(|c| c.strong_count() > 0);
    list.push(check);
}

/// This process's readiness: `Ok` when every live check is ready, else every reason.
pub fn readiness() -> Result<(), Vec<String>> {
    let live: Vec<Arc<dyn Readiness>> = {
        let mut list = READINESS.lock();
        list.retain(|c| c.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    };
    let reasons: Vec<String> = live.iter().filter_map(|c| c.not_ready()).collect();
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons)
    }
}

/// A readiness flag a component sets as it starts and stops (registered on creation; keep
/// the `Arc` for as long as it should count).
#[derive(Debug)]
pub struct ReadyGate {
    state: Mutex<Option<String>>,
}

impl ReadyGate {
    /// A gate not ready for `reason`, registered with `/readyz`.
    pub fn new(reason: &str) -> Arc<ReadyGate> {
        let gate = Arc::new(ReadyGate {
            state: Mutex::new(Some(reason.to_string())),
        });
        let weak: Weak<dyn Readiness> = Arc::downgrade(&(Arc::clone(&gate) as Arc<dyn Readiness>));
        register_readiness(weak);
        gate
    }

    pub fn set_ready(&self) {
        *self.state.lock() = None;
    }

    pub fn set_not_ready(&self, reason: &str) {
        *self.state.lock() = Some(reason.to_string());
    }
}

impl Readiness for ReadyGate {
    fn not_ready(&self) -> Option<String> {
        self.state.lock().clone()
    }
}

/// A running metrics listener.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
}

impl Endpoint {
    /// The address it listens on (the real port when `:0` was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/metrics`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }
}

/// Serve `/metrics`, `/healthz` and `/readyz` on `addr` (`HOST:PORT`, or a bare `PORT` for
/// loopback; port 0 picks a free one) for the rest of the process. Asking again for an
/// address already served returns the same endpoint; the first call installs the process's
/// metrics recorder.
pub fn serve(addr: &str) -> Result<Arc<Endpoint>, MetricsError> {
    let sock = parse_addr(addr).map_err(|reason| MetricsError::InvalidAddr {
        addr: addr.to_string(),
        reason,
    })?;
    let g = global()?;
    let mut endpoints = g.endpoints.lock();
    if sock.port() != 0 {
        if let Some(e) = endpoints.get(addr) {
            return Ok(Arc::clone(e));
        }
    }
    let bind_err = |source| MetricsError::Bind {
        addr: addr.to_string(),
        source,
    };
    let listener = TcpListener::bind(sock).map_err(bind_err)?;
    let local = listener.local_addr().map_err(bind_err)?;
    let table = Arc::new(Table::default());
    std::thread::Builder::new()
        .name("kvtier-metrics".into())
        .spawn(move || accept_loop(&listener, &table))
        .map_err(bind_err)?;
    let endpoint = Arc::new(Endpoint { addr: local });
    endpoints.insert(addr.to_string(), Arc::clone(&endpoint));
    if sock.port() == 0 {
        endpoints.insert(local.to_string(), Arc::clone(&endpoint));
    }
    Ok(endpoint)
}

/// One open connection, as the accept loop sees it.
struct Conn {
    id: u64,
    /// A handle on the socket, to cut it when it is shed.
    socket: TcpStream,
    /// Still sending its request (may be shed); false once it is being answered.
    reading: bool,
}

/// The open connections of one endpoint, oldest first.
#[derive(Default)]
struct Table {
    conns: Mutex<Vec<Conn>>,
    next: AtomicU64,
}

impl Table {
    fn answering(&self, id: u64) {
        if let Some(c) = self.conns.lock().iter_mut().find(|c| c.id == id) {
            c.reading = false;
        }
    }

    fn closed(&self, id: u64) {
        self.conns.lock().retain(|c| c.id != id);
    }
}

fn refused(reason: &'static str) {
    metrics::counter!(HTTP_REFUSED, "reason" => reason).increment(1);
}

fn accept_loop(listener: &TcpListener, table: &Arc<Table>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::debug!(error = %e, "kvtier metrics: accept failed");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let accepted = Instant::now();
        let Ok(socket) = stream.try_clone() else {
            continue;
        };
        let id = table.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = table.conns.lock();
            if conns.len() >= MAX_CONNECTIONS {
                // The oldest still sending its request, else the oldest of all (one being
                // answered to a client that does not read): a new connection always gets in.
                let oldest = conns.iter().position(|c| c.reading).unwrap_or(0);
                let old = conns.remove(oldest);
                let _ = old.socket.shutdown(Shutdown::Both);
                refused("shed");
            }
            conns.push(Conn {
                id,
                socket,
                reading: true,
            });
        }
        let handler_table = Arc::clone(table);
        let spawned = std::thread::Builder::new()
            .name("kvtier-metrics-conn".into())
            .stack_size(HANDLER_STACK)
            .spawn(move || {
                if let Err(e) = answer(stream, accepted, id, &handler_table) {
                    tracing::debug!(error = %e, "kvtier metrics: scrape connection failed");
                }
                handler_table.closed(id);
            });
        if spawned.is_err() {
            table.closed(id);
        }
    }
}

/// Read the request head by `deadline`: `Ok(None)` when the deadline passed first.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST_HEAD {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(head))
}

/// Answer one HTTP/1.x request and close the connection.
fn answer(mut stream: TcpStream, accepted: Instant, id: u64, table: &Table) -> io::Result<()> {
    let head = read_head(&mut stream, accepted + REQUEST_DEADLINE)?;
    table.answering(id);
    let respond_by = Instant::now() + RESPONSE_DEADLINE;
    let Some(head) = head else {
        refused("deadline");
        write_by(
            &mut stream,
            Instant::now() + Duration::from_secs(1),
            "408 Request Timeout",
            "text/plain",
            "the request did not arrive in time\n",
            false,
        )?;
        linger(&mut stream);
        return Ok(());
    };
    if !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() < MAX_REQUEST_HEAD {
            return Ok(()); // closed before its request was complete (a port check, or shed)
        }
        write_by(
            &mut stream,
            respond_by,
            "431 Request Header Fields Too Large",
            "text/plain",
            "request head over 8 KiB\n",
            false,
        )?;
        linger(&mut stream);
        return Ok(());
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => match render() {
            Ok(text) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", text),
            Err(e) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
        },
        ("GET" | "HEAD", "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        ("GET" | "HEAD", "/readyz") => match readiness() {
            Ok(()) => ("200 OK", "text/plain", "ready\n".to_string()),
            Err(reasons) => (
                "503 Service Unavailable",
                "text/plain",
                format!("not ready: {}\n", reasons.join("; ")),
            ),
        },
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain",
            "kvtier serves /metrics, /healthz and /readyz\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics, /healthz or /readyz\n".to_string(),
        ),
    };
    write_by(
        &mut stream,
        respond_by,
        status,
        content_type,
        &body,
        method == "HEAD",
    )
}

/// After an error answer to a client still sending: close our side and read what it sends for
/// up to a second, so the close does not reset the connection before the client has read the
/// answer (closing with unread input sends RST, which can discard the answer in flight).
fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let until = Instant::now() + Duration::from_secs(1);
    let mut buf = [0u8; 1024];
    let mut drained = 0usize;
    while drained < (64 << 10) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => drained += n,
        }
    }
}

/// Write a whole response by `deadline` (a client reading slowly is cut at it).
fn write_by(
    stream: &mut TcpStream,
    deadline: Instant,
    status: &str,
    content_type: &str,
    body: &str,
    head_only: bool,
) -> io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    let mut rest = out.as_slice();
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

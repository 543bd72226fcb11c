//! The local-server store (server mode): the store lives in a local `kvtier serve` process,
//! reached over a Unix socket. Formerly `remote.rs`; `kvtier_client::remote` still names it.
//!
//! - One *session* per client: opened by a keeper connection that is never used for requests
//!   (so the session, and the server's mappings of this process's memory, live exactly as long
//!   as this [`LocalServerStore`]), with request connections attached to it by ticket. Concurrent
//!   callers each check out their own connection (pool, created on demand), so calls from
//!   SGLang's prefetch and backup threads never wait for each other.
//! - Zero copy: memory registered with [`LocalServerStore::register_memfd`] (a pool buffer allocated
//!   from a memfd, e.g. SGLang's `ShmHostTensorAllocator`) is sent once as a file descriptor
//!   with `SCM_RIGHTS`; page buffers inside it travel as (region, offset, length) and the server
//!   copies straight between its tiers and this process's pages.
//! - Fallback: every other registered buffer (plain anonymous memory) is copied through the
//!   connection's staging ring, a sealed memfd of `server_staging_bytes`, in chunks.
//! - `server_auto_start` (issue 27): the started `kvtier serve` gets this client's engine
//!   settings as `--engine KEY=VALUE` flags (no secret is among them) and appends its output
//!   to `server_log_file` (default `<socket>.log`, 0600).
//! - Failures: a broken connection fails its call cleanly (every item `false`, typed
//!   [`ItemFailure::Unavailable`], with the reason) and is dropped; an item the server failed
//!   arrives with the server's typed failure (issue 28: its status byte, mapped back once
//!   here, never read from the message); if the session itself is gone (server restarted), the next call opens a new
//!   one and registers every memfd again.

use std::io::{IoSlice, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtier_proto::frame::{FLAG_ERROR, FLAG_RESPONSE, PROTOCOL_VERSION};
use kvtier_proto::server::{
    Count, ObjectLens, OpenSession, PageIo, PageKeys, RegionGrant, RegisterRegion, SessionTicket,
    ShmRef, TextReply,
};
use kvtier_proto::{
    encode_frame, read_frame, BatchResult as WireResult, Decode, Encode, ErrorReply,
    ExistsV2Answer, ExistsV2Query, Handshake, KeyBatch, Opcode,
};
use parking_lot::{Mutex, RwLock};

use crate::batch::{BatchResult, MemRef};
use crate::config::KvtierConfig;
use crate::error::{ClientError, ItemFailure};
use crate::memory::{RegionId, RegionRegistry, StagingMap};

/// Most objects one wire request carries; bigger batches are split.
const MAX_OBJECTS_PER_REQUEST: usize = 16_384;

/// `(start, end, server region)` of every memfd region, sorted by start.
type ShmTable = Vec<(usize, usize, u64)>;

/// A memfd-backed region this process registered with the server.
#[derive(Debug)]
struct MemfdRegion {
    local: RegionId,
    start: usize,
    len: usize,
    fd: OwnedFd,
    fd_offset: u64,
    label: String,
    /// The server's id for it in the current session.
    server: u64,
}

#[derive(Debug, Default)]
struct SessionState {
    /// Bumped each time a new session is opened; connections of older ones are dropped.
    generation: u64,
    ticket: Option<SessionTicket>,
    keeper: Option<Conn>,
    memfds: Vec<MemfdRegion>,
}

/// Where one buffer's bytes are for the server.
#[derive(Clone, Copy)]
enum Placement {
    Shm(ShmRef),
    /// Not in server-mapped memory: copy through the staging ring.
    Staged,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    generation: u64,
    staging: Option<(StagingMap, u64)>,
    out: Vec<u8>,
    body: Vec<u8>,
}

/// The server-mode store of a `Client` (kvtier-client).
#[derive(Debug)]
pub struct LocalServerStore {
    socket: PathBuf,
    tenant: String,
    client_name: String,
    staging_bytes: usize,
    auto_start: bool,
    server_bin: String,
    /// `--engine KEY=VALUE` flags of an auto-started server: this client's engine settings.
    server_engine_flags: Vec<String>,
    /// Where an auto-started server's stdout and stderr go.
    server_log_file: PathBuf,
    startup_timeout: Duration,
    /// This process's uid, and the other uid a server may run as (`server_uid`).
    own_uid: u32,
    server_uid: Option<u32>,
    state: Mutex<SessionState>,
    /// `(start, end, server region)` of the memfd regions, for pointer translation; rebuilt
    /// with every session. Paired with its generation.
    shm_table: RwLock<(u64, ShmTable)>,
    idle: Mutex<Vec<Conn>>,
    next_request: AtomicU64,
    /// Bytes that went through staging rings (fallback traffic), for stats.
    staged_bytes: AtomicU64,
    zero_copy_bytes: AtomicU64,
}

/// Issue 27: the `--engine KEY=VALUE` flags that give an auto-started `kvtier serve` this
/// client's engine settings (the `[engine]` keys; none is a secret). Flags win over the
/// `KVTIER_*` variables the child inherits, as the client's own extra_config did. A default
/// `ssd_storage_dir` is not passed, so the server may still fall back from it (issue 26).
fn engine_flags(config: &KvtierConfig) -> Vec<String> {
    let Ok(serde_json::Value::Object(engine)) = serde_json::to_value(&config.engine) else {
        return Vec::new();
    };
    let mut flags = Vec::new();
    for (key, value) in engine {
        if key == "ssd_storage_dir" && !config.engine.ssd_storage_dir_explicit.0 {
            continue;
        }
        let text = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        flags.push(format!("{key}={text}"));
    }
    flags.push(format!("copy_threads={}", config.copy_threads));
    flags
}

/// Open (create 0600, append) an auto-started server's log; refuses a symlink and a file of
/// another user (whose reader would get the server's log).
fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)?;
    let meta = file.metadata()?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != uid {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "not a regular file of this user (owner uid {}, this uid {uid})",
                meta.uid()
            ),
        ));
    }
    Ok(file)
}

fn remote_err(socket: &Path, reason: impl std::fmt::Display) -> ClientError {
    ClientError::Server {
        socket: socket.display().to_string(),
        reason: reason.to_string(),
    }
}

impl Conn {
    fn call<M: Encode + ?Sized>(
        &mut self,
        socket: &Path,
        request_id: u64,
        opcode: Opcode,
        message: &M,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<&[u8], ClientError> {
        self.out.clear();
        encode_frame(&mut self.out, opcode, request_id, 0, message)
            .map_err(|e| remote_err(socket, format!("cannot encode {opcode:?}: {e}")))?;
        let io = |e: std::io::Error| remote_err(socket, format!("{opcode:?}: {e}"));
        match fd {
            None => self.stream.write_all(&self.out).map_err(io)?,
            Some(fd) => {
                use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                let fds = [fd];
                if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                    return Err(remote_err(socket, "cannot attach the memfd"));
                }
                let sent = sendmsg(
                    &self.stream,
                    &[IoSlice::new(&self.out)],
                    &mut control,
                    SendFlags::NOSIGNAL,
                )
                .map_err(|e| io(e.into()))?;
                self.stream.write_all(&self.out[sent..]).map_err(io)?;
            }
        }
        let header = read_frame(&mut self.stream, &mut self.body)
            .map_err(|e| remote_err(socket, format!("{opcode:?} reply: {e}")))?;
        if header.request_id != request_id || header.flags & FLAG_RESPONSE == 0 {
            return Err(remote_err(
                socket,
                format!(
                    "out-of-sync reply (id {} for request {request_id})",
                    header.request_id
                ),
            ));
        }
        if header.flags & FLAG_ERROR != 0 {
            let reply = ErrorReply::decode(&self.body)
                .map_err(|e| remote_err(socket, format!("bad error reply: {e}")))?;
            return Err(ClientError::ServerRefused {
                code: reply.code,
                message: reply.message,
            });
        }
        Ok(&self.body)
    }
}

fn decode<T: Decode>(socket: &Path, body: &[u8]) -> Result<T, ClientError> {
    T::decode(body).map_err(|e| remote_err(socket, format!("bad reply: {e}")))
}

impl LocalServerStore {
    /// A store that talks to `config.server_socket`. Connects (and, with `server_auto_start`,
    /// starts the server) right away so that a wrong socket fails at construction.
    pub fn connect(config: &KvtierConfig) -> Result<LocalServerStore, ClientError> {
        let socket = PathBuf::from(config.server_socket.clone().unwrap_or_default());
        let store = LocalServerStore {
            socket,
            tenant: config.extra_backend_tag.clone().unwrap_or_default(),
            client_name: format!("pid{}", std::process::id()),
            staging_bytes: usize::try_from(config.server_staging_bytes).unwrap_or(32 << 20),
            auto_start: config.server_auto_start,
            server_bin: config.server_bin.clone().unwrap_or_else(|| "kvtier".into()),
            server_engine_flags: engine_flags(config),
            server_log_file: config.server_log_file.as_ref().map_or_else(
                || {
                    let mut log = config.server_socket.clone().unwrap_or_default();
                    log.push_str(".log");
                    PathBuf::from(log)
                },
                PathBuf::from,
            ),
            startup_timeout: Duration::from_millis(config.server_startup_timeout_ms),
            own_uid: rustix::process::geteuid().as_raw(),
            server_uid: config
                .server_uid
                .as_deref()
                .and_then(|u| u.trim().parse().ok()),
            state: Mutex::new(SessionState::default()),
            shm_table: RwLock::new((0, Vec::new())),
            idle: Mutex::new(Vec::new()),
            next_request: AtomicU64::new(1),
            staged_bytes: AtomicU64::new(0),
            zero_copy_bytes: AtomicU64::new(0),
        };
        {
            let mut state = store.state.lock();
            store.ensure_session(&mut state)?;
        }
        Ok(store)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Connect, then check who listens: the server must run as this process's uid, root, or
    /// the configured `server_uid` (`SO_PEERCRED` of the listener, taken at its `listen`).
    /// Nothing, in particular no memfd, is sent before this check passes: a process of
    /// another user that took the socket path would otherwise receive the host pools.
    fn dial(&self) -> Result<UnixStream, ClientError> {
        let stream = self.dial_unchecked()?;
        let credentials = rustix::net::sockopt::socket_peercred(&stream).map_err(|e| {
            remote_err(
                &self.socket,
                format!("cannot read the server's credentials: {e}"),
            )
        })?;
        let uid = credentials.uid.as_raw();
        if uid != self.own_uid && uid != 0 && Some(uid) != self.server_uid {
            return Err(remote_err(
                &self.socket,
                format!(
                    "refusing a server running as uid {uid} (allowed: this process's uid {}, \
                     root{}); set server_uid to trust another uid",
                    self.own_uid,
                    self.server_uid
                        .map_or(String::new(), |u| format!(", server_uid {u}"))
                ),
            ));
        }
        Ok(stream)
    }

    fn dial_unchecked(&self) -> Result<UnixStream, ClientError> {
        match UnixStream::connect(&self.socket) {
            Ok(stream) => Ok(stream),
            Err(first) if self.auto_start => {
                self.spawn_server()?;
                let deadline = Instant::now() + self.startup_timeout;
                loop {
                    match UnixStream::connect(&self.socket) {
                        Ok(stream) => return Ok(stream),
                        Err(e) if Instant::now() >= deadline => {
                            return Err(remote_err(
                                &self.socket,
                                format!(
                                    "auto-started server did not listen within {:?}: {e} \
                                     (first attempt: {first})",
                                    self.startup_timeout
                                ),
                            ))
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }
            Err(e) => Err(remote_err(
                &self.socket,
                format!("cannot connect: {e} (is `kvtier serve --socket` running?)"),
            )),
        }
    }

    /// `kvtier serve --socket <socket> --engine KEY=VALUE...` (this client's engine settings)
    /// as a detached process (its own session and process group, so it outlives this one and
    /// its signals), its stdout and stderr appended to `server_log_file`.
    fn spawn_server(&self) -> Result<(), ClientError> {
        let bin = &self.server_bin;
        let log = open_log(&self.server_log_file).map_err(|e| {
            remote_err(
                &self.socket,
                format!(
                    "server_auto_start: server_log_file {}: {e}",
                    self.server_log_file.display()
                ),
            )
        })?;
        let log_err = log
            .try_clone()
            .map_err(|e| remote_err(&self.socket, format!("server_auto_start: log file: {e}")))?;
        let mut command = Command::new(bin);
        command.arg("serve").arg("--socket").arg(&self.socket);
        for flag in &self.server_engine_flags {
            command.arg("--engine").arg(flag);
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        {
            use std::os::unix::process::CommandExt;
            command.process_group(0);
        }
        command.spawn().map(drop).map_err(|e| {
            remote_err(
                &self.socket,
                format!(
                    "server_auto_start: cannot run {:?} serve: {e} (set server_bin)",
                    bin
                ),
            )
        })
    }

    /// The log file of an auto-started server (for errors and tests).
    pub fn server_log_file(&self) -> &Path {
        &self.server_log_file
    }

    fn open_conn(
        &self,
        join: Option<SessionTicket>,
        generation: u64,
    ) -> Result<(Conn, SessionTicket), ClientError> {
        let stream = self.dial()?;
        let mut conn = Conn {
            stream,
            generation,
            staging: None,
            out: Vec::new(),
            body: Vec::new(),
        };
        let hello = Handshake {
            version: PROTOCOL_VERSION,
            client_name: self.client_name.clone(),
        };
        conn.call(
            &self.socket,
            self.request_id(),
            Opcode::Handshake,
            &hello,
            None,
        )?;
        let open = OpenSession {
            tenant: self.tenant.clone(),
            client_name: self.client_name.clone(),
            join,
        };
        let body = conn.call(
            &self.socket,
            self.request_id(),
            Opcode::OpenSession,
            &open,
            None,
        )?;
        let ticket: SessionTicket = decode(&self.socket, body)?;
        Ok((conn, ticket))
    }

    /// Make sure a live session exists (opening one and re-registering every memfd if not).
    fn ensure_session(&self, state: &mut SessionState) -> Result<(), ClientError> {
        if state.keeper.is_some() && state.ticket.is_some() {
            return Ok(());
        }
        let generation = state.generation + 1;
        let (mut keeper, ticket) = self.open_conn(None, generation)?;
        for region in &mut state.memfds {
            let request = RegisterRegion {
                label: region.label.clone(),
                fd_offset: region.fd_offset,
                len: region.len as u64,
            };
            let body = keeper.call(
                &self.socket,
                self.request_id(),
                Opcode::RegisterRegion,
                &request,
                Some(region.fd.as_fd()),
            )?;
            let grant: RegionGrant = decode(&self.socket, body)?;
            region.server = grant.region;
        }
        state.generation = generation;
        state.ticket = Some(ticket);
        state.keeper = Some(keeper);
        self.rebuild_table(state);
        self.idle.lock().clear();
        Ok(())
    }

    fn rebuild_table(&self, state: &SessionState) {
        let mut table: Vec<(usize, usize, u64)> = state
            .memfds
            .iter()
            .map(|r| (r.start, r.start + r.len, r.server))
            .collect();
        table.sort_unstable();
        *self.shm_table.write() = (state.generation, table);
    }

    fn checkout(&self) -> Result<Conn, ClientError> {
        let generation = self.shm_table.read().0;
        {
            let mut idle = self.idle.lock();
            while let Some(conn) = idle.pop() {
                if conn.generation == generation {
                    return Ok(conn);
                }
            }
        }
        let mut state = self.state.lock();
        self.ensure_session(&mut state)?;
        let ticket = state
            .ticket
            .ok_or_else(|| remote_err(&self.socket, "no session"))?;
        let generation = state.generation;
        drop(state);
        match self.open_conn(Some(ticket), generation) {
            Ok((conn, _)) => Ok(conn),
            Err(e) => {
                self.forget_session_if_dead();
                Err(e)
            }
        }
    }

    fn checkin(&self, conn: Conn) {
        if conn.generation == self.shm_table.read().0 {
            self.idle.lock().push(conn);
        }
    }

    /// After a failure: if the keeper no longer answers, the session is gone (server restart).
    fn forget_session_if_dead(&self) {
        let mut state = self.state.lock();
        let id = self.request_id();
        let alive = match state.keeper.as_mut() {
            Some(keeper) => keeper
                .call(&self.socket, id, Opcode::Ping, &EmptyBody, None)
                .is_ok(),
            None => false,
        };
        if !alive {
            state.keeper = None;
            state.ticket = None;
        }
    }

    /// Run one request on a pooled connection. A transport failure drops the connection and
    /// the request is tried once more on a fresh one (after opening a new session if the old
    /// one is gone, e.g. the server restarted): every request is idempotent (puts are
    /// put-if-absent), so a retry never does anything twice that matters.
    fn with_conn<R>(
        &self,
        mut f: impl FnMut(&mut Conn) -> Result<R, ClientError>,
    ) -> Result<R, ClientError> {
        let mut attempt = 0;
        loop {
            let mut conn = self.checkout()?;
            match f(&mut conn) {
                Ok(value) => {
                    self.checkin(conn);
                    return Ok(value);
                }
                Err(e @ ClientError::ServerRefused { .. }) => {
                    self.checkin(conn);
                    return Err(e);
                }
                Err(e) => {
                    drop(conn);
                    self.forget_session_if_dead();
                    attempt += 1;
                    if attempt >= 2 {
                        return Err(e);
                    }
                }
            }
        }
    }

    fn simple<M: Encode, T: Decode>(&self, opcode: Opcode, message: &M) -> Result<T, ClientError> {
        self.with_conn(|conn| {
            let body = conn.call(&self.socket, self.request_id(), opcode, message, None)?;
            decode(&self.socket, body)
        })
    }

    // ----------------------------------------------------------------------------- regions

    /// Register `[ptr, ptr+len)` of this process, which is `[fd_offset, fd_offset+len)` of the
    /// memfd `fd`, with the server (zero copy). `local` is its id in the client's registry.
    pub fn register_memfd(
        &self,
        local: RegionId,
        ptr: usize,
        len: usize,
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        label: &str,
    ) -> Result<(), ClientError> {
        let fd = fd
            .try_clone_to_owned()
            .map_err(|e| remote_err(&self.socket, format!("cannot dup the memfd: {e}")))?;
        let mut state = self.state.lock();
        self.ensure_session(&mut state)?;
        let request = RegisterRegion {
            label: label.to_string(),
            fd_offset,
            len: len as u64,
        };
        let id = self.request_id();
        let keeper = state
            .keeper
            .as_mut()
            .ok_or_else(|| remote_err(&self.socket, "no session"))?;
        let body = keeper.call(
            &self.socket,
            id,
            Opcode::RegisterRegion,
            &request,
            Some(fd.as_fd()),
        )?;
        let grant: RegionGrant = decode(&self.socket, body)?;
        state.memfds.push(MemfdRegion {
            local,
            start: ptr,
            len,
            fd,
            fd_offset,
            label: label.to_string(),
            server: grant.region,
        });
        self.rebuild_table(&state);
        Ok(())
    }

    /// Forget a region (memfd-backed or not); the server unmaps it.
    pub fn unregister(&self, local: RegionId) {
        let mut state = self.state.lock();
        let Some(at) = state.memfds.iter().position(|r| r.local == local) else {
            return;
        };
        let region = state.memfds.remove(at);
        let id = self.request_id();
        if let Some(keeper) = state.keeper.as_mut() {
            let _ = keeper.call(
                &self.socket,
                id,
                Opcode::UnregisterRegion,
                &RegionGrant {
                    region: region.server,
                },
                None,
            );
        }
        self.rebuild_table(&state);
    }

    pub fn zero_copy_regions(&self) -> usize {
        self.state.lock().memfds.len()
    }

    fn place(&self, table: &[(usize, usize, u64)], buf: MemRef) -> Placement {
        let Some(end) = buf.ptr.checked_add(buf.len) else {
            return Placement::Staged;
        };
        let upto = table.partition_point(|r| r.0 <= buf.ptr);
        for &(start, stop, region) in table[..upto].iter().rev() {
            if stop >= end {
                return Placement::Shm(ShmRef {
                    region,
                    offset: (buf.ptr - start) as u64,
                    len: buf.len as u64,
                });
            }
        }
        Placement::Staged
    }

    fn staging<'c>(&self, conn: &'c mut Conn) -> Result<&'c mut (StagingMap, u64), ClientError> {
        if conn.staging.is_none() {
            let map = StagingMap::create(self.staging_bytes, "kvtier-staging").map_err(|e| {
                remote_err(&self.socket, format!("cannot create the staging ring: {e}"))
            })?;
            let request = RegisterRegion {
                label: "staging".into(),
                fd_offset: 0,
                len: map.len() as u64,
            };
            let body = conn.call(
                &self.socket,
                self.request_id(),
                Opcode::RegisterRegion,
                &request,
                Some(map.fd()),
            )?;
            let grant: RegionGrant = decode(&self.socket, body)?;
            conn.staging = Some((map, grant.region));
        }
        conn.staging
            .as_mut()
            .ok_or_else(|| remote_err(&self.socket, "no staging ring"))
    }

    // ----------------------------------------------------------------------------- page I/O

    /// Put or get `pages x comps` objects. `bufs[i*C+j]` is validated against `regions` when
    /// it must be staged (the server validates the zero-copy ones against its mappings).
    /// Every failed page says why, typed (issue 28): as the server's reply said, a refused
    /// buffer as [`ItemFailure::BadBuffer`], a broken connection as
    /// [`ItemFailure::Unavailable`].
    #[allow(clippy::too_many_arguments)]
    fn page_io<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        regions: &RegionRegistry,
        is_put: bool,
        prefix: &[u8],
        page_keys: &[K],
        suffixes: &[S],
        bufs: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        let pages = page_keys.len();
        let comps = suffixes.len();
        let mut result = BatchResult {
            ok: vec![false; pages],
            ..Default::default()
        };
        if pages == 0 {
            return result;
        }
        let outcome = self.with_conn(|conn| {
            let table = self.shm_table.read().1.clone();
            let suffix_list: Vec<Vec<u8>> = suffixes.iter().map(|s| s.as_ref().to_vec()).collect();
            let pages_per_request = (MAX_OBJECTS_PER_REQUEST / comps.max(1)).max(1);
            let mut chunk = Chunk::default();
            for (i, page_key) in page_keys.iter().enumerate() {
                let page_bufs = &bufs[i * comps..(i + 1) * comps];
                let placements: Vec<Placement> =
                    page_bufs.iter().map(|b| self.place(&table, *b)).collect();
                let staged: usize = page_bufs
                    .iter()
                    .zip(&placements)
                    .filter(|(_, p)| matches!(p, Placement::Staged))
                    .map(|(b, _)| b.len)
                    .sum();
                if staged > self.staging_bytes {
                    self.refuse_oversized(&mut result, i, page_key.as_ref(), staged);
                    continue;
                }
                if chunk.pages.len() >= pages_per_request
                    || chunk.staged + staged > self.staging_bytes
                {
                    self.flush_chunk(
                        conn,
                        regions,
                        is_put,
                        prefix,
                        &suffix_list,
                        &mut chunk,
                        &mut result,
                    )?;
                }
                // Stage this page's unregistered components.
                let mut refs = Vec::with_capacity(comps);
                let mut page_ok = true;
                for (buf, placement) in page_bufs.iter().zip(&placements) {
                    match placement {
                        Placement::Shm(r) => refs.push(*r),
                        Placement::Staged => {
                            let offset = chunk.staged;
                            if is_put {
                                let (map, _) = self.staging(conn)?;
                                let copied = regions
                                    .with_source(buf.ptr, buf.len, |src| map.write(offset, src));
                                match copied {
                                    Ok(Ok(())) => {}
                                    Ok(Err(e)) | Err(e) => {
                                        result.set_failed(i, e.item_failure());
                                        result.note_error(format!(
                                            "{}: {e}",
                                            String::from_utf8_lossy(page_key.as_ref())
                                        ));
                                        page_ok = false;
                                        break;
                                    }
                                }
                            } else {
                                self.staging(conn)?;
                                if !regions.contains(buf.ptr, buf.len) {
                                    result.set_failed(i, ItemFailure::BadBuffer);
                                    result.note_error(format!(
                                        "{}: {}",
                                        String::from_utf8_lossy(page_key.as_ref()),
                                        ClientError::OutsideRegisteredMemory {
                                            ptr: buf.ptr,
                                            len: buf.len
                                        }
                                    ));
                                    page_ok = false;
                                    break;
                                }
                            }
                            let region = conn.staging.as_ref().map_or(0, |s| s.1);
                            refs.push(ShmRef {
                                region,
                                offset: offset as u64,
                                len: buf.len as u64,
                            });
                            chunk.staged += buf.len;
                            chunk.staged_copies.push((chunk.pages.len(), *buf, offset));
                        }
                    }
                }
                if !page_ok {
                    // Roll back this page's staged entries; its bytes in the ring are ignored.
                    let at = chunk.pages.len();
                    chunk.staged_copies.retain(|(p, _, _)| *p != at);
                    continue;
                }
                chunk.pages.push(i);
                chunk.page_keys.push(page_key.as_ref().to_vec());
                chunk.refs.extend(refs);
                if let Some(d) = depths {
                    chunk.depths.push(d[i]);
                }
            }
            self.flush_chunk(
                conn,
                regions,
                is_put,
                prefix,
                &suffix_list,
                &mut chunk,
                &mut result,
            )?;
            Ok(())
        });
        if let Err(e) = outcome {
            // The connection broke (or the server refused the request): every page fails so.
            let failure = e.item_failure();
            (0..pages).for_each(|i| result.set_failed(i, failure));
            result.note_error(e.to_string());
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn flush_chunk(
        &self,
        conn: &mut Conn,
        regions: &RegionRegistry,
        is_put: bool,
        prefix: &[u8],
        suffixes: &[Vec<u8>],
        chunk: &mut Chunk,
        result: &mut BatchResult,
    ) -> Result<(), ClientError> {
        if chunk.pages.is_empty() {
            *chunk = Chunk::default();
            return Ok(());
        }
        let io = PageIo {
            keys: PageKeys {
                prefix: prefix.to_vec(),
                page_keys: std::mem::take(&mut chunk.page_keys),
                suffixes: suffixes.to_vec(),
            },
            buffers: std::mem::take(&mut chunk.refs),
            depths: (is_put && chunk.depths.len() == chunk.pages.len())
                .then(|| std::mem::take(&mut chunk.depths)),
        };
        let opcode = if is_put {
            Opcode::PutPages
        } else {
            Opcode::GetPages
        };
        let body = conn.call(&self.socket, self.request_id(), opcode, &io, None)?;
        let reply: WireResult = decode(&self.socket, body)?;
        if reply.ok.len() != chunk.pages.len() {
            return Err(remote_err(
                &self.socket,
                format!("{} results for {} pages", reply.ok.len(), chunk.pages.len()),
            ));
        }
        result.suppressed_errors += reply.suppressed_errors;
        for error in &reply.errors {
            result.note_error(error.clone());
        }
        let total: u64 = io.buffers.iter().map(|b| b.len).sum();
        let staged = chunk.staged as u64;
        self.staged_bytes.fetch_add(staged, Ordering::Relaxed);
        self.zero_copy_bytes
            .fetch_add(total.saturating_sub(staged), Ordering::Relaxed);
        // The server's typed outcome per page (issue 28), then the copies out of the ring.
        let mut outcome: Vec<Option<ItemFailure>> =
            (0..chunk.pages.len()).map(|k| reply.failure(k)).collect();
        if !is_put {
            self.copy_out_staged(conn, regions, chunk, &mut outcome, result);
        }
        for (slot, failure) in chunk.pages.iter().zip(outcome) {
            match failure {
                None => result.ok[*slot] = true,
                Some(failure) => result.set_failed(*slot, failure),
            }
        }
        *chunk = Chunk::default();
        Ok(())
    }

    /// Fail page `i` whose unregistered components do not fit the staging ring.
    fn refuse_oversized(&self, result: &mut BatchResult, i: usize, page_key: &[u8], staged: usize) {
        result.set_failed(i, ItemFailure::BadBuffer);
        result.note_error(format!(
            "{}: page of {staged} bytes in unregistered memory exceeds the {} byte staging ring \
             (register the pool from a memfd, or raise server_staging_bytes)",
            String::from_utf8_lossy(page_key),
            self.staging_bytes
        ));
    }

    /// Copy a get's staged components out of the ring into caller memory (pages the server
    /// answered); a copy that fails fails its page, typed.
    fn copy_out_staged(
        &self,
        conn: &Conn,
        regions: &RegionRegistry,
        chunk: &Chunk,
        outcome: &mut [Option<ItemFailure>],
        result: &mut BatchResult,
    ) {
        let map = conn.staging.as_ref().map(|s| &s.0);
        for &(page, buf, offset) in &chunk.staged_copies {
            if outcome[page].is_some() {
                continue;
            }
            let copied = match map {
                Some(map) => regions
                    .with_destination(buf.ptr, buf.len, |dst| map.read(offset, dst))
                    .and_then(|r| r),
                None => Err(remote_err(&self.socket, "no staging ring")),
            };
            if let Err(e) = copied {
                result.note_error(e.to_string());
                outcome[page] = Some(e.item_failure());
            }
        }
    }

    /// The server's stats document (JSON).
    pub fn server_stats(&self) -> Result<serde_json::Value, ClientError> {
        let reply: TextReply = self.simple(Opcode::Stats, &EmptyBody)?;
        serde_json::from_str(&reply.text)
            .map_err(|e| remote_err(&self.socket, format!("stats are not JSON: {e}")))
    }

    /// This client's own counters.
    pub fn local_stats(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut map = serde_json::Map::new();
        let state = self.state.lock();
        map.insert(
            "server_session".into(),
            state.ticket.map(|t| t.session_id).into(),
        );
        map.insert(
            "zero_copy_regions".into(),
            (state.memfds.len() as u64).into(),
        );
        map.insert(
            "zero_copy_bytes".into(),
            self.zero_copy_bytes.load(Ordering::Relaxed).into(),
        );
        map.insert(
            "staged_bytes".into(),
            self.staged_bytes.load(Ordering::Relaxed).into(),
        );
        map
    }
}

/// Pages collected for one wire request.
#[derive(Default)]
struct Chunk {
    /// Index of each page in the caller's batch.
    pages: Vec<usize>,
    page_keys: Vec<Vec<u8>>,
    refs: Vec<ShmRef>,
    depths: Vec<u32>,
    /// Bytes used in the staging ring.
    staged: usize,
    /// `(page in chunk, caller buffer, ring offset)` of every staged component.
    staged_copies: Vec<(usize, MemRef, usize)>,
}

/// An empty request or reply body.
#[derive(Clone, Copy, Debug, Default)]
pub struct EmptyBody;

impl Encode for EmptyBody {
    fn encode_fields(&self, _out: &mut Vec<u8>) -> Result<(), kvtier_proto::ProtoError> {
        Ok(())
    }
}

impl Decode for EmptyBody {
    fn read_from(_reader: &mut kvtier_proto::Reader<'_>) -> Result<Self, kvtier_proto::ProtoError> {
        Ok(EmptyBody)
    }
}

// ----------------------------------------------------------------------------- the seam

impl LocalServerStore {
    /// One single-object page request through the staging ring (the slice calls): `key`'s
    /// outcome as the server typed it, its message kept for the log.
    fn slice_request(
        &self,
        conn: &mut Conn,
        opcode: Opcode,
        key: &[u8],
        len: usize,
        depth: Option<u32>,
    ) -> Result<Result<(), ClientError>, ClientError> {
        let region = self.staging(conn)?.1;
        let io = PageIo {
            keys: PageKeys {
                prefix: Vec::new(),
                page_keys: vec![key.to_vec()],
                suffixes: vec![Vec::new()],
            },
            buffers: vec![ShmRef {
                region,
                offset: 0,
                len: len as u64,
            }],
            depths: depth.map(|d| vec![d]),
        };
        let body = conn.call(&self.socket, self.request_id(), opcode, &io, None)?;
        let reply: WireResult = decode(&self.socket, body)?;
        if reply.ok.len() != 1 {
            return Err(remote_err(
                &self.socket,
                "a slice reply of the wrong length",
            ));
        }
        Ok(match reply.failure(0) {
            None => Ok(()),
            Some(failure) => Err(ClientError::Item {
                key: String::from_utf8_lossy(key).into_owned(),
                failure,
                detail: reply.errors.first().cloned().unwrap_or_default(),
            }),
        })
    }

    /// A slice larger than the staging ring is refused before any request.
    fn check_slice(&self, len: usize) -> Result<(), ClientError> {
        if len > self.staging_bytes {
            return Err(remote_err(
                &self.socket,
                format!(
                    "object of {len} bytes exceeds the {} byte staging ring (raise \
                     server_staging_bytes)",
                    self.staging_bytes
                ),
            ));
        }
        Ok(())
    }
}

impl super::Store for LocalServerStore {
    fn mode(&self) -> &'static str {
        "server"
    }

    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &crate::batch::PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.page_io(
            regions,
            true,
            batch.prefix,
            batch.page_keys,
            batch.suffixes,
            buffers,
            depths,
        )
    }

    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &crate::batch::PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        self.page_io(
            regions,
            false,
            batch.prefix,
            batch.page_keys,
            batch.suffixes,
            buffers,
            None,
        )
    }

    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<kvtier_engine::PutOutcome, ClientError> {
        self.check_slice(value.len())?;
        self.with_conn(|conn| {
            let (map, _) = self.staging(conn)?;
            map.write(0, value)?;
            self.slice_request(conn, Opcode::PutPages, key, value.len(), depth)
        })??;
        self.staged_bytes
            .fetch_add(value.len() as u64, Ordering::Relaxed);
        // The server does not say whether the key was new; both count as stored.
        Ok(kvtier_engine::PutOutcome::Stored)
    }

    /// A miss is [`ItemFailure::Miss`] as the server typed it (issue 28).
    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        self.check_slice(dst.len())?;
        self.with_conn(|conn| {
            let outcome = self.slice_request(conn, Opcode::GetPages, key, dst.len(), None)?;
            if outcome.is_ok() {
                // A hit without the staging ring would leave `dst` unfilled: never counted.
                let (map, _) = conn.staging.as_ref().ok_or_else(|| {
                    remote_err(&self.socket, "a get was answered without a staging ring")
                })?;
                map.read(0, dst)?;
            }
            Ok(outcome)
        })??;
        self.staged_bytes
            .fetch_add(dst.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn object_len(&self, key: &[u8]) -> Option<u64> {
        let keys = KeyBatch {
            keys: vec![key.to_vec()],
        };
        let reply: Result<ObjectLens, _> = self.simple(Opcode::ObjectLen, &keys);
        reply.ok()?.lens.first().copied().flatten()
    }

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        let request = KeyBatch {
            keys: super::owned_keys(keys),
        };
        match self.simple::<_, WireResult>(Opcode::BatchExists, &request) {
            Ok(reply) if reply.ok.len() == keys.len() => reply.ok,
            _ => vec![false; keys.len()],
        }
    }

    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &crate::batch::PageBatch<'_, K, S>,
    ) -> usize {
        let pages = batch.pages();
        let reply: Result<Count, _> =
            self.simple(Opcode::ExistsPagesPrefix, &super::page_keys_message(batch));
        // A count beyond the batch is a broken reply: no page is known to exist.
        reply
            .ok()
            .and_then(|c| usize::try_from(c.value).ok())
            .filter(|&v| v <= pages)
            .unwrap_or(0)
    }

    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &crate::batch::PageBatch<'_, K, S>,
    ) -> usize {
        let most = batch.pages() * batch.components();
        let reply: Result<Count, _> =
            self.simple(Opcode::DemotePages, &super::page_keys_message(batch));
        match reply {
            Ok(c) => usize::try_from(c.value)
                .ok()
                .filter(|&v| v <= most)
                .unwrap_or(0),
            Err(e) => {
                tracing::warn!(error = %e, "kvtier: demote hint not delivered");
                0
            }
        }
    }

    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        match self.simple::<_, ExistsV2Answer>(Opcode::ExistsV2, query) {
            // A hit beyond the query is a broken reply: a miss.
            Ok(answer) if answer.kv_hit_pages as usize <= query.page_keys.len() => answer,
            _ => ExistsV2Answer::default(),
        }
    }

    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        let request = KeyBatch {
            keys: super::owned_keys(keys),
        };
        self.simple::<_, WireResult>(Opcode::BatchDelete, &request)
            .map_or(0, |reply| reply.succeeded())
    }

    fn clear(&self) {
        let _ = self.simple::<_, EmptyBody>(Opcode::Clear, &EmptyBody);
    }

    fn flush(&self) -> Result<(), ClientError> {
        self.simple::<_, EmptyBody>(Opcode::Flush, &EmptyBody)
            .map(drop)
    }

    /// Close every connection (the server then drops the session and its mappings).
    fn close(&self) {
        self.idle.lock().clear();
        let mut state = self.state.lock();
        state.keeper = None;
        state.ticket = None;
        state.memfds.clear();
    }
}

//! One connection: reading frames (and the descriptors that come with them), answering each.
//!
//! Owns: the connection's socket halves, its queue of received descriptors, its peer's
//! credentials (`SO_PEERCRED`), whether it has shaken hands, the session it belongs to, and
//! its reusable frame buffers. Dispatch of every opcode lives here; what a request touches
//! belongs to the session ([`super::session`]), the tenant store ([`super::tenant`]), the page
//! path ([`super::page_io`]) or the documents ([`super::documents`]).
//!
//! Robustness rules:
//! - A frame whose header is bad in a way that loses stream sync (bad magic, unsupported
//!   version) gets an error reply and the connection is closed; every other bad frame
//!   (oversized body: skipped; unknown opcode; undecodable body; request before a session) gets
//!   an error reply and the connection stays open. Nothing a client sends can stop the server.
//! - Until it has a session, every read waits at most until `handshake_timeout_ms` after the
//!   connection was accepted; pre-handshake bodies are bounded by [`PRE_HANDSHAKE_MAX_BODY`].
//! - At most [`MAX_QUEUED_FDS`] descriptors wait for their `RegisterRegion` frames, none before
//!   a session, and each within its uid's cap ([`super::ledger`], issue 26); buffers
//!   larger than [`KEPT_BUFFER_BYTES`] are released after the request that needed them.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::frame::{
    FrameHeader, FLAG_ERROR, FLAG_RESPONSE, HEADER_LEN, MAX_FRAME_BODY, PROTOCOL_VERSION,
};
use kvtier_proto::server::{
    error_code, Count, InspectQuery, ObjectLens, OpenSession, PageIo, PageKeys, RegionGrant,
    RegisterRegion, SessionTicket, TextReply,
};
use kvtier_proto::{
    encode_frame, BatchResult as WireResult, Decode, Encode, ErrorReply, ExistsV2Query, Handshake,
    KeyBatch, Opcode, ProtoError,
};
use kvtier_store::store::Store;
use kvtier_store::PageBatch;

use super::documents::{inspect_document, stats_document};
use super::ledger::Kind;
use super::page_io::{page_io, wire_result};
use super::refusal::Refusal;
use super::session::{Opener, Session};
use super::Shared;

/// Largest body accepted before the handshake.
const PRE_HANDSHAKE_MAX_BODY: u32 = 4 << 10;
/// An oversized body up to this size is read and dropped to keep the stream in sync; larger
/// ones close the connection.
const MAX_SKIPPED_BODY: u32 = 1 << 30;
/// Most descriptors queued on one connection ahead of their `RegisterRegion` frames.
const MAX_QUEUED_FDS: usize = crate::limits::MAX_QUEUED_FDS as usize;

/// Largest frame-body buffer a connection keeps between requests; a larger one (after a big
/// frame) is released, so idle connections do not hold memory.
const KEPT_BUFFER_BYTES: usize = 1 << 20;

pub(super) fn send_error(
    stream: &mut UnixStream,
    opcode: Opcode,
    request_id: u64,
    code: u16,
    message: &str,
) -> io::Result<()> {
    let mut out = Vec::new();
    let mut message = message.to_string();
    message.truncate(kvtier_proto::limits::MAX_MESSAGE_LEN);
    while !message.is_char_boundary(message.len()) {
        message.pop();
    }
    let reply = ErrorReply { code, message };
    if encode_frame(
        &mut out,
        opcode,
        request_id,
        FLAG_RESPONSE | FLAG_ERROR,
        &reply,
    )
    .is_ok()
    {
        stream.write_all(&out)?;
    }
    Ok(())
}

/// A connection's reading side: `recvmsg`, queuing any descriptors that arrive.
struct FdReader {
    stream: UnixStream,
    fds: VecDeque<OwnedFd>,
    truncated_fds: bool,
    /// Until the connection has a session: when it must have one (`handshake_timeout_ms`).
    /// Every read waits at most until then, so a slow or silent peer is closed in time.
    deadline: Option<Instant>,
    /// Issue 26: the uid's account of passed descriptors; `None` until a session opens (no
    /// descriptor is taken before: the kernel drops them).
    quota: Option<FdQuota>,
}

/// One connection's share of its uid's passed-descriptor cap ([`super::ledger`]).
struct FdQuota {
    shared: Arc<Shared>,
    uid: u32,
    operator: bool,
    /// Whether a slot is held for the next descriptor to arrive (reads offer the kernel room
    /// for descriptors only then).
    slot: bool,
}

impl FdQuota {
    fn take(&self) -> bool {
        self.shared
            .ledger
            .take(self.uid, self.operator, Kind::PassedFds, 1)
            .is_ok()
    }

    fn give(&self, n: usize) {
        if n > 0 {
            self.shared
                .ledger
                .give(self.uid, self.operator, Kind::PassedFds, n as u64);
        }
    }
}

impl FdReader {
    /// Hold a slot for the next descriptor if the queue and the uid's caps have room.
    fn refill(&mut self) {
        let queued = self.fds.len();
        if let Some(q) = &mut self.quota {
            if !q.slot && queued < MAX_QUEUED_FDS && q.take() {
                q.slot = true;
            }
        }
    }

    /// A descriptor taken off the queue was consumed (closed): its share goes back.
    fn consumed(&mut self) {
        if let Some(q) = &self.quota {
            q.give(1);
        }
        self.refill();
    }
}

impl Drop for FdReader {
    fn drop(&mut self) {
        if let Some(q) = &self.quota {
            q.give(self.fds.len() + usize::from(q.slot));
        }
    }
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        // Room for a descriptor only while a slot is held for it: otherwise the kernel drops
        // what comes (MSG_CTRUNC) and nothing enters this process's table.
        let room = if self.quota.as_ref().is_some_and(|q| q.slot) {
            space.len()
        } else {
            0
        };
        let mut control = RecvAncillaryBuffer::new(&mut space[..room]);
        let mut iov = [IoSliceMut::new(buf)];
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no session within handshake_timeout_ms",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        let got = loop {
            match recvmsg(
                &self.stream,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(got) => break got,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            self.truncated_fds = true;
        }
        let mut arrived = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                arrived.extend(fds);
            }
        }
        for fd in arrived {
            // The slot pays for the first; one more (the kernel's rounding) only if the caps
            // give it a slot now, else it is closed here.
            let paid = match &mut self.quota {
                Some(q) if q.slot => {
                    q.slot = false;
                    true
                }
                Some(q) => q.take(),
                None => false,
            };
            if paid && self.fds.len() < MAX_QUEUED_FDS {
                self.fds.push_back(fd);
            } else {
                if paid {
                    if let Some(q) = &self.quota {
                        q.give(1);
                    }
                }
                self.truncated_fds = true;
            }
        }
        self.refill();
        Ok(got.bytes)
    }
}

pub(super) struct Connection<'a> {
    shared: &'a Arc<Shared>,
    reader: FdReader,
    writer: UnixStream,
    peer_pid: i32,
    /// `SO_PEERCRED` uid and gid of the peer (tenant binding, operator identity).
    peer_uid: u32,
    peer_gid: u32,
    handshaken: bool,
    session: Option<Arc<Session>>,
    body: Vec<u8>,
    out: Vec<u8>,
}

enum Next {
    Continue,
    Close,
}

impl<'a> Connection<'a> {
    /// `None` when the process is out of descriptors (the connection is then just closed).
    pub(super) fn new(shared: &'a Arc<Shared>, stream: UnixStream) -> Option<Self> {
        let credentials = rustix::net::sockopt::socket_peercred(&stream).ok()?;
        let peer_pid = credentials.pid.as_raw_nonzero().get();
        let peer_uid = credentials.uid.as_raw();
        let peer_gid = credentials.gid.as_raw();
        let writer = stream.try_clone().ok()?;
        Some(Connection {
            shared,
            reader: FdReader {
                stream,
                fds: VecDeque::new(),
                truncated_fds: false,
                deadline: Some(
                    Instant::now()
                        + Duration::from_millis(shared.config.settings.handshake_timeout_ms),
                ),
                quota: None,
            },
            writer,
            peer_pid,
            peer_uid,
            peer_gid,
            handshaken: false,
            session: None,
            body: Vec::new(),
            out: Vec::new(),
        })
    }

    pub(super) fn run(&mut self) {
        while let Ok(Next::Continue) = self.serve_one() {
            if self.shared.shutting_down.load(Ordering::SeqCst) {
                // Replies already written; stop reading new requests.
                break;
            }
        }
    }

    pub(super) fn close(&mut self) {
        if let Some(session) = self.session.take() {
            session.release(self.shared.session_env());
        }
    }

    fn reply_error(
        &mut self,
        opcode: u16,
        request_id: u64,
        code: u16,
        message: &str,
    ) -> io::Result<()> {
        self.shared
            .counters
            .refused_requests
            .fetch_add(1, Ordering::Relaxed);
        if let Some(s) = &self.session {
            s.counters.refused_requests.fetch_add(1, Ordering::Relaxed);
        }
        let opcode = Opcode::try_from(opcode).unwrap_or(Opcode::Ping);
        send_error(&mut self.writer, opcode, request_id, code, message)
    }

    /// Read and answer one frame.
    fn serve_one(&mut self) -> io::Result<Next> {
        let mut raw = [0u8; HEADER_LEN];
        let mut filled = 0;
        while filled < HEADER_LEN {
            match self.reader.read(&mut raw[filled..]) {
                Ok(0) => return Ok(Next::Close),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let request_id = u64::from_le_bytes(raw[8..16].try_into().unwrap_or([0; 8]));
        let raw_opcode = u16::from_le_bytes([raw[6], raw[7]]);
        let limit = if self.handshaken {
            MAX_FRAME_BODY
        } else {
            PRE_HANDSHAKE_MAX_BODY
        };
        let header = match FrameHeader::decode_with_limit(&raw, limit) {
            Ok(header) => header,
            Err(ProtoError::BodyTooLarge { len, max }) => {
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                let message = format!("frame body of {len} bytes exceeds the limit of {max}");
                if len > u64::from(MAX_SKIPPED_BODY) {
                    self.reply_error(raw_opcode, request_id, error_code::MALFORMED, &message)?;
                    return Ok(Next::Close);
                }
                // Skip the body to stay in sync, then answer.
                io::copy(&mut (&mut self.reader).take(len), &mut io::sink())?;
                self.reply_error(raw_opcode, request_id, error_code::MALFORMED, &message)?;
                return Ok(Next::Continue);
            }
            Err(ProtoError::UnknownFlags { bits }) => {
                // The length is still trustworthy: skip the body and answer.
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                let len = u32::from_le_bytes(raw[20..24].try_into().unwrap_or([0; 4]));
                if len > limit {
                    self.reply_error(
                        raw_opcode,
                        request_id,
                        error_code::MALFORMED,
                        "oversized frame with unknown flags",
                    )?;
                    return Ok(Next::Close);
                }
                io::copy(
                    &mut (&mut self.reader).take(u64::from(len)),
                    &mut io::sink(),
                )?;
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::MALFORMED,
                    &format!("unknown frame flag bits {bits:#x}"),
                )?;
                return Ok(Next::Continue);
            }
            Err(e) => {
                // Bad magic or version: the stream cannot be trusted any more.
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::MALFORMED,
                    &e.to_string(),
                )?;
                return Ok(Next::Close);
            }
        };
        self.body.clear();
        // Grow with what arrives, not with what the header claims.
        self.body
            .reserve((header.body_len as usize).min(KEPT_BUFFER_BYTES));
        let read = (&mut self.reader)
            .take(u64::from(header.body_len))
            .read_to_end(&mut self.body)?;
        if read < header.body_len as usize {
            return Ok(Next::Close);
        }
        if header.is_response() {
            self.shared
                .counters
                .malformed_frames
                .fetch_add(1, Ordering::Relaxed);
            self.reply_error(
                raw_opcode,
                request_id,
                error_code::MALFORMED,
                "a client sent a response frame",
            )?;
            return Ok(Next::Continue);
        }
        let opcode = match header.opcode() {
            Ok(op) => op,
            Err(e) => {
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::UNSUPPORTED,
                    &e.to_string(),
                )?;
                return Ok(Next::Continue);
            }
        };
        self.shared
            .counters
            .requests
            .fetch_add(1, Ordering::Relaxed);
        let mut body = std::mem::take(&mut self.body);
        let result = self.dispatch(opcode, &body);
        if body.capacity() > KEPT_BUFFER_BYTES {
            body = Vec::new();
        }
        self.body = body;
        match result {
            Ok(reply) => {
                self.out.clear();
                let written = encode_frame(
                    &mut self.out,
                    opcode,
                    request_id,
                    FLAG_RESPONSE,
                    &RawBody(&reply),
                );
                let sent = match written {
                    Ok(()) => self.writer.write_all(&self.out),
                    Err(e) => self.reply_error(
                        raw_opcode,
                        request_id,
                        error_code::INTERNAL,
                        &e.to_string(),
                    ),
                };
                if self.out.capacity() > KEPT_BUFFER_BYTES {
                    self.out = Vec::new();
                }
                sent?;
            }
            Err(refusal) => {
                if refusal.code == error_code::MALFORMED {
                    self.shared
                        .counters
                        .malformed_frames
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.reply_error(raw_opcode, request_id, refusal.code, &refusal.message)?;
                if refusal.code == error_code::VERSION {
                    return Ok(Next::Close);
                }
            }
        }
        Ok(Next::Continue)
    }

    fn session(&self) -> Result<&Arc<Session>, Refusal> {
        self.session.as_ref().ok_or_else(|| {
            Refusal::new(error_code::NO_SESSION, "open a session first (OpenSession)")
        })
    }

    fn dispatch(&mut self, opcode: Opcode, body: &[u8]) -> Result<Vec<u8>, Refusal> {
        if !self.handshaken && opcode != Opcode::Handshake {
            return Err(Refusal::new(error_code::NO_SESSION, "handshake first"));
        }
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(Refusal::new(
                error_code::SHUTTING_DOWN,
                "the server is shutting down",
            ));
        }
        if let Some(s) = &self.session {
            s.counters.requests.fetch_add(1, Ordering::Relaxed);
        }
        match opcode {
            Opcode::Handshake => {
                let hello = Handshake::decode(body)?;
                if hello.version < kvtier_proto::frame::MIN_PROTOCOL_VERSION {
                    return Err(Refusal::new(
                        error_code::VERSION,
                        format!("protocol version {} is not spoken here", hello.version),
                    ));
                }
                self.handshaken = true;
                encode(&Handshake {
                    version: PROTOCOL_VERSION.min(hello.version),
                    client_name: format!("kvtier-serve {}", env!("CARGO_PKG_VERSION")),
                })
            }
            Opcode::Ping => {
                if !body.is_empty() {
                    return Err(ProtoError::TrailingBytes {
                        what: "ping",
                        count: body.len(),
                    }
                    .into());
                }
                Ok(Vec::new())
            }
            Opcode::OpenSession => self.open_session(OpenSession::decode(body)?),
            Opcode::Stats => {
                let operator = self.shared.config.is_operator(self.peer_uid);
                let mut doc = stats_document(self.shared, self.session.as_deref());
                if !operator {
                    // Other tenants' sessions (their names, pids, traffic) are an operator's.
                    let own = self.session.as_ref().map(|s| s.tenant.clone());
                    if let Some(list) = doc["sessions"].as_array_mut() {
                        list.retain(|s| own.as_deref().is_some_and(|t| s["tenant"] == t));
                    }
                    // Which uids use the server is an operator's to see.
                    if let Some(server) = doc["server"].as_object_mut() {
                        server.remove("uids");
                    }
                }
                encode(&TextReply {
                    text: doc.to_string(),
                })
            }
            Opcode::RegisterRegion => {
                let request = RegisterRegion::decode(body)?;
                self.register_region(request)
            }
            Opcode::UnregisterRegion => {
                let grant = RegionGrant::decode(body)?;
                let session = self.session()?;
                session.unmap_region(self.shared.session_env(), grant.region)?;
                Ok(Vec::new())
            }
            Opcode::PutPages | Opcode::GetPages => {
                let io = PageIo::decode(body)?;
                let session = self.session()?;
                let result = page_io(session, &io, opcode == Opcode::PutPages);
                encode(&wire_result(result))
            }
            Opcode::ExistsPagesPrefix | Opcode::DemotePages => {
                let keys = PageKeys::decode(body)?;
                let session = self.session()?;
                let prefix = session.ns(&keys.prefix);
                let batch = PageBatch {
                    prefix: &prefix,
                    page_keys: &keys.page_keys,
                    suffixes: &keys.suffixes,
                };
                let store = &session.store;
                let value = if opcode == Opcode::DemotePages {
                    store.demote_pages(&batch)
                } else {
                    store.exists_pages_prefix(&batch)
                } as u64;
                encode(&Count { value })
            }
            Opcode::ExistsV2 => {
                let mut query = ExistsV2Query::decode(body)?;
                let session = self.session()?;
                query.key_prefix = session.ns(&query.key_prefix);
                encode(&session.store.exists_v2(&query))
            }
            Opcode::BatchExists => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let keys: Vec<Vec<u8>> = keys.keys.iter().map(|k| session.ns(k)).collect();
                encode(&WireResult::flags(session.store.exists_keys(&keys)))
            }
            Opcode::ObjectLen => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let lens = keys
                    .keys
                    .iter()
                    .map(|k| session.store.object_len(&session.ns(k)))
                    .collect();
                encode(&ObjectLens { lens })
            }
            Opcode::BatchDelete => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let ok = keys
                    .keys
                    .iter()
                    .map(|k| session.store.remove_keys(&[session.ns(k)]) == 1)
                    .collect();
                encode(&WireResult::flags(ok))
            }
            Opcode::Clear => {
                empty(body, "clear")?;
                let session = self.session()?;
                session.clear_namespace();
                Ok(Vec::new())
            }
            Opcode::PeerHello
            | Opcode::PeerPut
            | Opcode::PeerGet
            | Opcode::PeerRemove
            | Opcode::PeerDemote
            | Opcode::PeerClear
            // Issue 17: the UCX data plane's control messages.
            | Opcode::PeerUcxHello
            | Opcode::PeerUcxLease
            | Opcode::PeerUcxRelease
            | Opcode::PeerUcxPutHello
            | Opcode::PeerUcxReserve
            | Opcode::PeerUcxCommit
            | Opcode::PeerUcxAbort => Err(Refusal::new(
                error_code::UNSUPPORTED,
                "peer opcodes are served on the cluster data port, not the local socket",
            )),
            Opcode::Flush => {
                empty(body, "flush")?;
                let session = self.session()?;
                session
                    .store
                    .flush()
                    .map_err(|e| Refusal::new(error_code::INTERNAL, e.to_string()))?;
                Ok(Vec::new())
            }
            Opcode::Inspect => {
                let query = InspectQuery::decode(body)?;
                if !self.shared.config.is_operator(self.peer_uid) {
                    return Err(Refusal::new(
                        error_code::REGISTRATION,
                        format!(
                            "Inspect lists every tenant's keys: only an operator (the server's \
                             uid, root or operator_uids) may ask; uid {} is not one",
                            self.peer_uid
                        ),
                    ));
                }
                encode(&TextReply {
                    text: inspect_document(self.shared, &query).to_string(),
                })
            }
            Opcode::BatchGet | Opcode::BatchPut => Err(Refusal::new(
                error_code::UNSUPPORTED,
                format!("{opcode:?} is not served by kvtier serve; use PutPages/GetPages"),
            )),
        }
    }

    fn open_session(&mut self, open: OpenSession) -> Result<Vec<u8>, Refusal> {
        if self.session.is_some() {
            return Err(Refusal::new(
                error_code::NO_SESSION,
                "this connection already belongs to a session",
            ));
        }
        let session = match open.join {
            Some(ticket) => {
                let sessions = self.shared.sessions.table();
                let session = sessions
                    .get(&ticket.session_id)
                    .filter(|s| {
                        s.token == ticket.token
                            && (s.uid == self.peer_uid
                                || self.shared.config.is_operator(self.peer_uid))
                    })
                    .cloned()
                    .ok_or_else(|| {
                        Refusal::new(
                            error_code::NO_SESSION,
                            format!("no session {} with that token", ticket.session_id),
                        )
                    })?;
                session.connections.fetch_add(1, Ordering::SeqCst);
                session
            }
            None => self.new_session(open)?,
        };
        let ticket = SessionTicket {
            session_id: session.id,
            token: session.token,
        };
        self.session = Some(session);
        // Descriptors may come from now on, within the uid's caps.
        self.reader.quota = Some(FdQuota {
            shared: Arc::clone(self.shared),
            uid: self.peer_uid,
            operator: self.shared.config.is_operator(self.peer_uid),
            slot: false,
        });
        self.reader.refill();
        // A connection with a session may idle (a client's keeper connection does).
        self.reader.deadline = None;
        let _ = self.reader.stream.set_read_timeout(None);
        encode(&ticket)
    }

    /// A new session of `open.tenant` for this peer, when its credentials may open it.
    fn new_session(&self, open: OpenSession) -> Result<Arc<Session>, Refusal> {
        if !self
            .shared
            .config
            .may_open_tenant(&open.tenant, self.peer_uid, self.peer_gid)
        {
            return Err(Refusal::new(
                error_code::NO_SESSION,
                format!(
                    "tenant {:?} is bound to other credentials (tenant_access); \
                     uid {} gid {} may not open it",
                    open.tenant, self.peer_uid, self.peer_gid
                ),
            ));
        }
        // No NUL (the cluster namespace's marker) and no 0x1f (the separator).
        if !kvtier_proto::namespace::is_valid_name(&open.tenant) {
            return Err(Refusal::new(
                error_code::MALFORMED,
                "tenant names may not contain NUL or 0x1f or exceed 128 bytes",
            ));
        }
        let store = Arc::clone(self.shared.tenants.for_tenant(&open.tenant));
        let own_partition = self.shared.tenants.is_partition_of(&open.tenant, &store);
        let opener = Opener {
            tenant: open.tenant,
            client_name: open.client_name,
            pid: self.peer_pid,
            uid: self.peer_uid,
            operator: self.shared.config.is_operator(self.peer_uid),
            store,
            own_partition,
        };
        Session::open(&self.shared.sessions, opener)
    }

    fn register_region(&mut self, request: RegisterRegion) -> Result<Vec<u8>, Refusal> {
        let fd = self.reader.fds.pop_front();
        if fd.is_some() && self.session.is_none() {
            self.reader.consumed();
        }
        let session = self.session()?.clone();
        let Some(fd) = fd else {
            let why = if self.reader.truncated_fds {
                "the descriptor was dropped (control message truncated)"
            } else {
                "no memfd came with the frame (send it as SCM_RIGHTS)"
            };
            return Err(Refusal::new(error_code::REGISTRATION, why));
        };
        let region = session.map_region(self.shared.session_env(), fd, &request);
        // The descriptor is closed by now (mapped or refused): its share goes back.
        self.reader.consumed();
        encode(&RegionGrant { region: region? })
    }
}

fn empty(body: &[u8], what: &'static str) -> Result<(), Refusal> {
    if body.is_empty() {
        Ok(())
    } else {
        Err(ProtoError::TrailingBytes {
            what,
            count: body.len(),
        }
        .into())
    }
}

fn encode<M: Encode>(message: &M) -> Result<Vec<u8>, Refusal> {
    message
        .encode_to_vec()
        .map_err(|e| Refusal::new(error_code::INTERNAL, e.to_string()))
}

/// A body that is already encoded.
struct RawBody<'a>(&'a [u8]);

impl Encode for RawBody<'_> {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        out.extend_from_slice(self.0);
        Ok(())
    }
}

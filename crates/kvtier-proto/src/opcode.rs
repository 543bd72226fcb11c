//! Request opcodes: what a frame asks for, and therefore which message its body holds.
//!
//! A response reuses its request's opcode and request id and sets
//! [`crate::frame::FLAG_RESPONSE`]; a failed request is answered with
//! [`crate::frame::FLAG_ERROR`] as well and an [`crate::ErrorReply`] body. Value 0 is never an
//! opcode, so an all-zero header is rejected. Numbers are wire values: never reuse one.

use crate::error::ProtoError;

/// What a frame asks for. The request and response bodies are listed per variant.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Request: [`crate::Handshake`]. Response: [`crate::Handshake`] with the version the
    /// server will speak and its own name.
    Handshake = 1,
    /// Request and response: empty body. Liveness check.
    Ping = 2,
    /// Request: [`crate::ExistsV2Query`]. Response: [`crate::ExistsV2Answer`]. The whole v2
    /// existence query in one round trip.
    ExistsV2 = 3,
    /// Request: [`crate::KeyBatch`]. Response: [`crate::BatchResult`], one `ok` per key.
    BatchExists = 4,
    /// Request: [`crate::KeyBatch`]. Response: [`crate::BatchResult`]; page bytes move out of
    /// band (shared memory or the peer data port).
    BatchGet = 5,
    /// Request: [`crate::PutBatchHeader`]. Response: [`crate::BatchResult`]; page bytes move out
    /// of band.
    BatchPut = 6,
    /// Request: [`crate::KeyBatch`]. Response: [`crate::BatchResult`].
    BatchDelete = 7,
    /// Request: [`crate::server::OpenSession`]. Response: [`crate::server::SessionTicket`].
    /// Opens a session (tenant, regions, accounting) or attaches this connection to one.
    OpenSession = 8,
    /// Request: [`crate::server::RegisterRegion`] with one memfd as `SCM_RIGHTS` ancillary
    /// data. Response: [`crate::server::RegionGrant`].
    RegisterRegion = 9,
    /// Request: [`crate::server::RegionGrant`]. Response: empty body.
    UnregisterRegion = 10,
    /// Request: [`crate::server::PageIo`]. Response: [`crate::BatchResult`], one `ok` per page.
    PutPages = 11,
    /// Request: [`crate::server::PageIo`]. Response: [`crate::BatchResult`], one `ok` per page.
    GetPages = 12,
    /// Request: [`crate::server::PageKeys`]. Response: [`crate::server::Count`], the leading
    /// pages whose every component exists.
    ExistsPagesPrefix = 13,
    /// Request: [`crate::KeyBatch`]. Response: [`crate::server::ObjectLens`].
    ObjectLen = 14,
    /// Request: empty. Response: [`crate::server::TextReply`] holding a JSON document.
    Stats = 15,
    /// Request and response: empty body. Drops this session's tenant's objects.
    Clear = 16,
    /// Request and response: empty body. Makes acknowledged puts as durable as configured.
    Flush = 17,
    /// Request: [`crate::server::InspectQuery`]. Response: [`crate::server::TextReply`] holding
    /// a JSON document: per store, which tiers hold each key (`kvtier inspect`). Needs no
    /// session: it is the operator's view of every store, keys as stored (tenant prefixes
    /// included).
    Inspect = 18,
    /// Peer data port, the challenge-response that opens a connection ([`crate::peer`]):
    /// first request [`crate::peer::PeerHello`], answered [`crate::peer::PeerChallenge`];
    /// second request [`crate::peer::PeerAuth`], answered with an empty body. A peer that does
    /// not prove the cluster token is answered with an error and the connection is closed.
    PeerHello = 19,
    /// Peer data port. Request: [`crate::peer::PeerPutMeta`] followed by the object's bytes up
    /// to the end of the body. Response: empty body, or an error.
    PeerPut = 20,
    /// Peer data port. Request: [`crate::peer::PeerGet`]. Response: the object's bytes as the
    /// whole body, or an error (not found, size mismatch).
    PeerGet = 21,
    /// Peer data port. Request: [`crate::KeyBatch`]. Response: [`crate::BatchResult`].
    PeerRemove = 22,
    /// Request: [`crate::server::PageKeys`]. Response: [`crate::server::Count`], the objects
    /// marked. Marks every component of the pages as superseded window state, an eviction
    /// hint (`Engine::demote`).
    DemotePages = 23,
    /// Peer data port. Request: [`crate::KeyBatch`] of whole keys. Response:
    /// [`crate::BatchResult`], whether each key was stored there and is now marked superseded
    /// window state (the cluster form of `DemotePages`).
    PeerDemote = 24,
    /// Peer data port. Request: [`crate::KeyBatch`] holding one key prefix (empty: every key).
    /// Response: [`crate::KeyBatch`], the keys with that prefix the node removed, at most
    /// [`crate::peer::MAX_CLEARED_KEYS`] of them (fewer: none is left). The cluster form of
    /// `Clear`: the caller forgets the keys at the master and asks again until none is left.
    PeerClear = 25,
    /// Issue 17, peer data port (UCX data plane, [`crate::peer_ucx`]). Request: empty.
    /// Response: [`crate::peer_ucx::UcxOffer`], or `UNSUPPORTED` on a node without UCX.
    /// Numbered apart from the dense range so other new opcodes do not collide.
    PeerUcxHello = 40,
    /// Peer data port. Request: [`crate::peer_ucx::UcxLeaseRequest`]. Response:
    /// [`crate::peer_ucx::UcxLeaseReply`]: the objects pinned for a one-sided read.
    PeerUcxLease = 41,
    /// Peer data port. Request: [`crate::peer_ucx::UcxRelease`]. Response: empty body.
    PeerUcxRelease = 42,
    /// Issue 17, one-sided puts. Request: empty. Response: [`crate::peer_ucx::UcxLanding`]
    /// (the remote key of the node's put landing area and its bounds), or `UNSUPPORTED`.
    PeerUcxPutHello = 43,
    /// Request: [`crate::peer_ucx::UcxReserveRequest`]. Response:
    /// [`crate::peer_ucx::UcxReserveReply`]: per object an extent of the landing area or a
    /// refusal.
    PeerUcxReserve = 44,
    /// Request: [`crate::peer_ucx::UcxCommit`]. Response: [`crate::peer_ucx::UcxCommitReply`]:
    /// per reservation, stored (checksum verified) or why not.
    PeerUcxCommit = 45,
    /// Request: [`crate::peer_ucx::UcxCommit`] (the reservations to free unstored). Response:
    /// empty body.
    PeerUcxAbort = 46,
}

impl Opcode {
    /// Every opcode, in wire-value order.
    pub const ALL: [Opcode; 32] = [
        Opcode::Handshake,
        Opcode::Ping,
        Opcode::ExistsV2,
        Opcode::BatchExists,
        Opcode::BatchGet,
        Opcode::BatchPut,
        Opcode::BatchDelete,
        Opcode::OpenSession,
        Opcode::RegisterRegion,
        Opcode::UnregisterRegion,
        Opcode::PutPages,
        Opcode::GetPages,
        Opcode::ExistsPagesPrefix,
        Opcode::ObjectLen,
        Opcode::Stats,
        Opcode::Clear,
        Opcode::Flush,
        Opcode::Inspect,
        Opcode::PeerHello,
        Opcode::PeerPut,
        Opcode::PeerGet,
        Opcode::PeerRemove,
        Opcode::DemotePages,
        Opcode::PeerDemote,
        Opcode::PeerClear,
        Opcode::PeerUcxHello,
        Opcode::PeerUcxLease,
        Opcode::PeerUcxRelease,
        Opcode::PeerUcxPutHello,
        Opcode::PeerUcxReserve,
        Opcode::PeerUcxCommit,
        Opcode::PeerUcxAbort,
    ];

    /// The wire value.
    pub const fn as_u16(self) -> u16 {
        self as u16
    }
}

impl From<Opcode> for u16 {
    fn from(opcode: Opcode) -> u16 {
        opcode.as_u16()
    }
}

impl TryFrom<u16> for Opcode {
    type Error = ProtoError;

    fn try_from(value: u16) -> Result<Self, ProtoError> {
        Ok(match value {
            1 => Opcode::Handshake,
            2 => Opcode::Ping,
            3 => Opcode::ExistsV2,
            4 => Opcode::BatchExists,
            5 => Opcode::BatchGet,
            6 => Opcode::BatchPut,
            7 => Opcode::BatchDelete,
            8 => Opcode::OpenSession,
            9 => Opcode::RegisterRegion,
            10 => Opcode::UnregisterRegion,
            11 => Opcode::PutPages,
            12 => Opcode::GetPages,
            13 => Opcode::ExistsPagesPrefix,
            14 => Opcode::ObjectLen,
            15 => Opcode::Stats,
            16 => Opcode::Clear,
            17 => Opcode::Flush,
            18 => Opcode::Inspect,
            19 => Opcode::PeerHello,
            20 => Opcode::PeerPut,
            21 => Opcode::PeerGet,
            22 => Opcode::PeerRemove,
            23 => Opcode::DemotePages,
            24 => Opcode::PeerDemote,
            25 => Opcode::PeerClear,
            40 => Opcode::PeerUcxHello,
            41 => Opcode::PeerUcxLease,
            42 => Opcode::PeerUcxRelease,
            43 => Opcode::PeerUcxPutHello,
            44 => Opcode::PeerUcxReserve,
            45 => Opcode::PeerUcxCommit,
            46 => Opcode::PeerUcxAbort,
            other => return Err(ProtoError::UnknownOpcode(other)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_opcode_round_trips_through_its_wire_value() {
        for opcode in Opcode::ALL {
            let wire: u16 = opcode.into();
            assert_eq!(Opcode::try_from(wire).ok(), Some(opcode));
        }
    }

    #[test]
    fn wire_values_are_dense_from_one() {
        // Dense from one up to PeerClear; the UCX opcodes (issue 17) are numbered from 40.
        for (i, opcode) in Opcode::ALL.iter().enumerate() {
            let expected = if i < 25 { i + 1 } else { 40 + (i - 25) };
            assert_eq!(opcode.as_u16() as usize, expected);
        }
    }

    #[test]
    fn unknown_values_are_rejected_by_name() {
        for value in [0, 26, 39, 47, 0x0100, u16::MAX] {
            let err = Opcode::try_from(value).unwrap_err();
            assert!(matches!(err, ProtoError::UnknownOpcode(v) if v == value));
            assert!(err.to_string().contains(&value.to_string()));
        }
    }
}

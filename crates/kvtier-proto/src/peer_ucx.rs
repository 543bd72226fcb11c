//! Bodies of the UCX data plane's control messages on the peer data port (issue 17).
//!
//! They travel on an authenticated data-port connection ([`crate::peer`]), so a node hands its
//! UCX worker address and its remote keys only to peers that proved the cluster token. Page
//! bytes then move one-sided (UCP get) straight between the node's arena and the client's
//! buffer; these messages only pin and release what is read:
//!
//! 1. `PeerUcxHello` (client -> node, empty body): the node answers [`UcxOffer`] (its worker
//!    address and the lease bounds), or `UNSUPPORTED` when it runs without UCX. No key: the
//!    arena as a whole is never registered for remote access (issue 26).
//! 2. `PeerUcxLease` ([`UcxLeaseRequest`]): the node pins each object found with the expected
//!    length and answers [`UcxLeaseReply`]: one lease id for the batch and, per object, its
//!    extents in the arena (address, length, in order), each with the packed remote key of a
//!    registration of exactly that extent (whole DRAM blocks of that object), made for this
//!    lease and unmapped when it ends. A pinned object cannot be evicted or its memory reused
//!    until the lease is released or expires (`lease_ms`); at most `max_leases` leases are held
//!    per node (a new one beyond that is refused, `BUSY`).
//! 3. `PeerUcxRelease` ([`UcxRelease`]): drops the pins and the lease's registrations;
//!    answered with an empty body. A lease released twice or unknown is not an error (it may
//!    have expired).
//!
//! The reader still verifies each object's end-to-end checksum trailer after the read: a lease
//! that expired mid-read (a stalled client) can never yield wrong bytes as a hit.
//!
//! One-sided puts (the node's put landing area, separate from its arena):
//!
//! 4. `PeerUcxPutHello` (empty body): the node answers [`UcxLanding`] (the remote key of its
//!    landing area, registered for remote write, and the reservation bounds), or `UNSUPPORTED`.
//! 5. `PeerUcxReserve` ([`UcxReserveRequest`]: keys, lengths including the 8-byte checksum
//!    trailer, depths): per object a [`ReserveItem`]: an extent of the landing area (its
//!    reservation id and remote address) or a refusal (full, too big, already present).
//! 6. The client writes each object and its trailer into its extent (UCP put) and flushes.
//! 7. `PeerUcxCommit` ([`UcxCommit`]: reservation ids): the node copies each extent out of the
//!    landing area, verifies the trailer on that copy, stores the copy put-if-absent and frees
//!    the extent; [`UcxCommitReply`] gives one [`CommitItem`] per id.
//! 8. `PeerUcxAbort` ([`UcxCommit`]): frees the extents without storing; empty answer.
//!
//! Reservations belong to the data-port connection that made them (only it commits or aborts;
//! they are freed when it ends) and expire after `reservation_ms`.
//!
//! Wire forms (same primitives as [`crate::codec`]):
//! ```text
//! UcxOffer        := bytes(worker_address) varint(max_leases) varint(lease_ms)
//!                    str(transports) str(host)
//! UcxLeaseRequest := varint(n) n*( bytes(key) varint(expected_len) )
//! UcxLeaseReply   := varint(lease_id) varint(n) n*( u8 status
//!                    [status 0: varint(m) m*(varint(addr) varint(len) bytes(rkey))] )
//! UcxRelease      := varint(lease_id)
//! UcxLanding      := bytes(rkey) varint(size) varint(max_connection_bytes) varint(reservation_ms)
//! UcxReserveRequest := varint(n) n*( bytes(key) varint(len) varint(depth + 1, 0: none) )
//! UcxReserveReply := varint(n) n*( u8 status [status 0: varint(id) varint(addr)] )
//! UcxCommit       := varint(n) n*varint(id)
//! UcxCommitReply  := varint(n) n*( u8 status )
//! ```

use crate::codec::{put_bytes, put_len, put_varint, Decode, Encode, Reader};
use crate::error::ProtoError;
use crate::limits::MAX_KEY_LEN;

/// Longest UCX worker address accepted (UCX 1.13 addresses over many transports stay within a
/// few KiB).
pub const MAX_UCX_ADDRESS_LEN: usize = 64 << 10;
/// Longest packed remote key accepted.
pub const MAX_UCX_RKEY_LEN: usize = 64 << 10;
/// Most objects in one lease request.
pub const MAX_LEASE_OBJECTS: usize = 1024;
/// Most extents per leased object (an object fragmented further is served over frames).
pub const MAX_LEASE_EXTENTS: usize = 4096;
/// Most objects in one reserve request (and ids in one commit or abort).
pub const MAX_RESERVE_OBJECTS: usize = 1024;
/// Most bytes one reserve request asks for in total (a node bounds it further by its landing
/// area and per-connection share).
pub const MAX_RESERVE_BYTES: u64 = 1 << 30;
/// Longest transport description.
const MAX_TRANSPORTS_LEN: usize = 1024;

/// Why a client refuses the extents a node leased for one object (issue 26: a hostile node's
/// reply made a client loop and abort on a 2 GiB allocation). Every variant names the sizes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseExtentError {
    #[error("the node leased no extent for an object of {object} bytes")]
    NoExtents { object: u64 },
    #[error("the node leased {count} extents for one object (at most {MAX_LEASE_EXTENTS})")]
    TooManyExtents { count: usize },
    #[error(
        "the node leased an empty extent (#{index} at {addr:#x}) for an object of {object} bytes"
    )]
    Empty {
        index: usize,
        addr: u64,
        object: u64,
    },
    #[error("the node leased extent #{index} at {addr:#x} of {len} bytes, which wraps the address space")]
    Wraps { index: usize, addr: u64, len: u64 },
    #[error("the node leased extent #{index} of {len} bytes, more than the {object}-byte object it belongs to")]
    ExceedsObject { index: usize, len: u64, object: u64 },
    #[error("the node leased {leased} bytes for an object of {object} bytes")]
    SizeDiffers { leased: u64, object: u64 },
}

/// Check a node's extents for one object of `object` bytes (its value and checksum trailer:
/// the destination the client reads into): a non-empty list of at most
/// [`MAX_LEASE_EXTENTS`] extents, none empty, none wrapping, each within the object, adding
/// up to exactly `object` bytes (no sum overflows). A reader splits the extents over its
/// destination only after this, so a hostile reply can neither spin it nor make it write
/// past its buffer.
pub fn check_lease_extents(extents: &[(u64, u64)], object: u64) -> Result<(), LeaseExtentError> {
    if extents.is_empty() {
        return Err(LeaseExtentError::NoExtents { object });
    }
    if extents.len() > MAX_LEASE_EXTENTS {
        return Err(LeaseExtentError::TooManyExtents {
            count: extents.len(),
        });
    }
    let mut leased = 0u64;
    for (index, &(addr, len)) in extents.iter().enumerate() {
        if len == 0 {
            return Err(LeaseExtentError::Empty {
                index,
                addr,
                object,
            });
        }
        if addr.checked_add(len).is_none() {
            return Err(LeaseExtentError::Wraps { index, addr, len });
        }
        if len > object {
            return Err(LeaseExtentError::ExceedsObject { index, len, object });
        }
        leased = leased.saturating_add(len);
        if leased > object {
            return Err(LeaseExtentError::SizeDiffers { leased, object });
        }
    }
    if leased != object {
        return Err(LeaseExtentError::SizeDiffers { leased, object });
    }
    Ok(())
}

/// What the node found for one object of a lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseItem {
    /// Pinned: the object's extents in the node's arena, in order, and for each the packed
    /// remote key of a registration covering exactly that extent, for this lease only.
    Extents {
        extents: Vec<(u64, u64)>,
        keys: Vec<Vec<u8>>,
    },
    /// Not stored on the node.
    NotFound,
    /// Stored with another length.
    SizeMismatch,
    /// Stored, but not in registered memory (read from the SSD tier for this pin, or too
    /// fragmented): read it over frames.
    NotRemote,
}

/// The body of `PeerUcxHello`: empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxHello;

impl Encode for UcxHello {
    fn encode_fields(&self, _out: &mut Vec<u8>) -> Result<(), ProtoError> {
        Ok(())
    }
}

impl Decode for UcxHello {
    fn read_from(_reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(UcxHello)
    }
}

/// The node's answer to `PeerUcxHello`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxOffer {
    pub worker_address: Vec<u8>,
    pub max_leases: u64,
    pub lease_ms: u64,
    /// The node's UCX transport configuration as it sees it (for logs).
    pub transports: String,
    /// The node's host identity (boot id): a client on the same host can reach it over
    /// shared memory.
    pub host: String,
}

/// Pin these objects for a one-sided read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxLeaseRequest {
    pub objects: Vec<(Vec<u8>, u64)>,
}

/// The pins of one lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxLeaseReply {
    pub lease_id: u64,
    pub items: Vec<LeaseItem>,
}

/// Drop a lease's pins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxRelease {
    pub lease_id: u64,
}

impl Encode for UcxOffer {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(
            out,
            "worker address",
            &self.worker_address,
            MAX_UCX_ADDRESS_LEN,
        )?;
        put_varint(out, self.max_leases);
        put_varint(out, self.lease_ms);
        put_bytes(
            out,
            "transports",
            self.transports.as_bytes(),
            MAX_TRANSPORTS_LEN,
        )?;
        put_bytes(out, "host", self.host.as_bytes(), MAX_TRANSPORTS_LEN)
    }
}

impl Decode for UcxOffer {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(UcxOffer {
            worker_address: reader
                .read_bytes("worker address", MAX_UCX_ADDRESS_LEN)?
                .to_vec(),
            max_leases: reader.read_varint("max leases")?,
            lease_ms: reader.read_varint("lease ms")?,
            transports: reader.read_string("transports", MAX_TRANSPORTS_LEN)?,
            host: reader.read_string("host", MAX_TRANSPORTS_LEN)?,
        })
    }
}

impl Encode for UcxLeaseRequest {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "lease objects", self.objects.len(), MAX_LEASE_OBJECTS)?;
        for (key, len) in &self.objects {
            put_bytes(out, "key", key, MAX_KEY_LEN)?;
            put_varint(out, *len);
        }
        Ok(())
    }
}

impl Decode for UcxLeaseRequest {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = reader.read_count("lease objects", MAX_LEASE_OBJECTS, 2)?;
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            let key = reader.read_bytes("key", MAX_KEY_LEN)?.to_vec();
            let len = reader.read_varint("expected length")?;
            objects.push((key, len));
        }
        Ok(UcxLeaseRequest { objects })
    }
}

impl Encode for UcxLeaseReply {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.lease_id);
        put_len(out, "lease items", self.items.len(), MAX_LEASE_OBJECTS)?;
        for item in &self.items {
            match item {
                LeaseItem::Extents { extents, keys } => {
                    if keys.len() != extents.len() {
                        return Err(ProtoError::LengthMismatch {
                            what: "a leased object's remote keys",
                            expected: extents.len(),
                            found: keys.len(),
                        });
                    }
                    out.push(0);
                    put_len(out, "extents", extents.len(), MAX_LEASE_EXTENTS)?;
                    for ((addr, len), key) in extents.iter().zip(keys) {
                        put_varint(out, *addr);
                        put_varint(out, *len);
                        put_bytes(out, "extent key", key, MAX_UCX_RKEY_LEN)?;
                    }
                }
                LeaseItem::NotFound => out.push(1),
                LeaseItem::SizeMismatch => out.push(2),
                LeaseItem::NotRemote => out.push(3),
            }
        }
        Ok(())
    }
}

impl Decode for UcxLeaseReply {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let lease_id = reader.read_varint("lease id")?;
        let n = reader.read_count("lease items", MAX_LEASE_OBJECTS, 1)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(match reader.read_u8("lease item")? {
                0 => {
                    let m = reader.read_count("extents", MAX_LEASE_EXTENTS, 3)?;
                    let mut extents = Vec::with_capacity(m);
                    let mut keys = Vec::with_capacity(m);
                    for _ in 0..m {
                        let addr = reader.read_varint("extent address")?;
                        let len = reader.read_varint("extent length")?;
                        extents.push((addr, len));
                        keys.push(reader.read_bytes("extent key", MAX_UCX_RKEY_LEN)?.to_vec());
                    }
                    LeaseItem::Extents { extents, keys }
                }
                1 => LeaseItem::NotFound,
                2 => LeaseItem::SizeMismatch,
                3 => LeaseItem::NotRemote,
                tag => {
                    return Err(ProtoError::InvalidTag {
                        what: "lease item",
                        tag,
                    })
                }
            });
        }
        Ok(UcxLeaseReply { lease_id, items })
    }
}

impl Encode for UcxRelease {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.lease_id);
        Ok(())
    }
}

impl Decode for UcxRelease {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(UcxRelease {
            lease_id: reader.read_varint("lease id")?,
        })
    }
}

/// The node's answer to `PeerUcxPutHello`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxLanding {
    /// Packed remote key of the landing area (remote write).
    pub rkey: Vec<u8>,
    /// The landing area's size in bytes.
    pub size: u64,
    /// Most bytes one connection may hold reserved at once.
    pub max_connection_bytes: u64,
    /// How long a reservation lives unless committed or aborted first.
    pub reservation_ms: u64,
}

/// Reserve landing extents for these objects: (key, length including the checksum trailer,
/// depth).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxReserveRequest {
    pub objects: Vec<(Vec<u8>, u64, Option<u32>)>,
}

/// What the node reserved for one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReserveItem {
    /// Write the object (and its trailer) at `addr` in the landing area, then commit `id`.
    Extent { id: u64, addr: u64 },
    /// No room now (the landing area, this connection's share or the reservation table is
    /// full): send it over frames.
    Full,
    /// Larger than the landing area, empty, or the node cannot store it: send it over frames.
    TooBig,
    /// The node already stores the key: nothing to send (put-if-absent).
    Present,
}

/// The extents of one reserve request, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxReserveReply {
    pub items: Vec<ReserveItem>,
}

/// Reservation ids to commit (or abort).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxCommit {
    pub ids: Vec<u64>,
}

/// What the commit did with one reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitItem {
    /// Verified and stored.
    Stored,
    /// The key was stored meanwhile: nothing changed (put-if-absent).
    Present,
    /// The bytes in the extent do not match their checksum trailer: nothing stored.
    Checksum,
    /// Not a live reservation of this connection (expired, never made, another's).
    Unknown,
    /// The store refused the object (no space with everything pinned, ...): nothing stored.
    StoreFailed,
}

/// Per reservation of a commit, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxCommitReply {
    pub items: Vec<CommitItem>,
}

impl Encode for UcxLanding {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "landing key", &self.rkey, MAX_UCX_RKEY_LEN)?;
        put_varint(out, self.size);
        put_varint(out, self.max_connection_bytes);
        put_varint(out, self.reservation_ms);
        Ok(())
    }
}

impl Decode for UcxLanding {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(UcxLanding {
            rkey: reader.read_bytes("landing key", MAX_UCX_RKEY_LEN)?.to_vec(),
            size: reader.read_varint("landing size")?,
            max_connection_bytes: reader.read_varint("connection bytes")?,
            reservation_ms: reader.read_varint("reservation ms")?,
        })
    }
}

impl Encode for UcxReserveRequest {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(
            out,
            "reserve objects",
            self.objects.len(),
            MAX_RESERVE_OBJECTS,
        )?;
        let mut total = 0u64;
        for (key, len, depth) in &self.objects {
            total = total.saturating_add(*len);
            put_bytes(out, "key", key, MAX_KEY_LEN)?;
            put_varint(out, *len);
            put_varint(out, depth.map_or(0, |d| u64::from(d) + 1));
        }
        if total > MAX_RESERVE_BYTES {
            return Err(ProtoError::LimitExceeded {
                what: "reserved bytes",
                value: total,
                limit: MAX_RESERVE_BYTES,
            });
        }
        Ok(())
    }
}

impl Decode for UcxReserveRequest {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = reader.read_count("reserve objects", MAX_RESERVE_OBJECTS, 3)?;
        let mut objects = Vec::with_capacity(n);
        let mut total = 0u64;
        for _ in 0..n {
            let key = reader.read_bytes("key", MAX_KEY_LEN)?.to_vec();
            let len = reader.read_varint("object length")?;
            total = total.saturating_add(len);
            if total > MAX_RESERVE_BYTES {
                return Err(ProtoError::LimitExceeded {
                    what: "reserved bytes",
                    value: total,
                    limit: MAX_RESERVE_BYTES,
                });
            }
            let depth = match reader.read_varint("depth")? {
                0 => None,
                d => Some(u32::try_from(d - 1).map_err(|_| ProtoError::LimitExceeded {
                    what: "depth",
                    value: d,
                    limit: u64::from(u32::MAX),
                })?),
            };
            objects.push((key, len, depth));
        }
        Ok(UcxReserveRequest { objects })
    }
}

impl Encode for UcxReserveReply {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "reserve items", self.items.len(), MAX_RESERVE_OBJECTS)?;
        for item in &self.items {
            match item {
                ReserveItem::Extent { id, addr } => {
                    out.push(0);
                    put_varint(out, *id);
                    put_varint(out, *addr);
                }
                ReserveItem::Full => out.push(1),
                ReserveItem::TooBig => out.push(2),
                ReserveItem::Present => out.push(3),
            }
        }
        Ok(())
    }
}

impl Decode for UcxReserveReply {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = reader.read_count("reserve items", MAX_RESERVE_OBJECTS, 1)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(match reader.read_u8("reserve item")? {
                0 => ReserveItem::Extent {
                    id: reader.read_varint("reservation id")?,
                    addr: reader.read_varint("extent address")?,
                },
                1 => ReserveItem::Full,
                2 => ReserveItem::TooBig,
                3 => ReserveItem::Present,
                tag => {
                    return Err(ProtoError::InvalidTag {
                        what: "reserve item",
                        tag,
                    })
                }
            });
        }
        Ok(UcxReserveReply { items })
    }
}

impl Encode for UcxCommit {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "reservation ids", self.ids.len(), MAX_RESERVE_OBJECTS)?;
        for id in &self.ids {
            put_varint(out, *id);
        }
        Ok(())
    }
}

impl Decode for UcxCommit {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = reader.read_count("reservation ids", MAX_RESERVE_OBJECTS, 1)?;
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(reader.read_varint("reservation id")?);
        }
        Ok(UcxCommit { ids })
    }
}

impl Encode for UcxCommitReply {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "commit items", self.items.len(), MAX_RESERVE_OBJECTS)?;
        for item in &self.items {
            out.push(match item {
                CommitItem::Stored => 0,
                CommitItem::Present => 1,
                CommitItem::Checksum => 2,
                CommitItem::Unknown => 3,
                CommitItem::StoreFailed => 4,
            });
        }
        Ok(())
    }
}

impl Decode for UcxCommitReply {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = reader.read_count("commit items", MAX_RESERVE_OBJECTS, 1)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(match reader.read_u8("commit item")? {
                0 => CommitItem::Stored,
                1 => CommitItem::Present,
                2 => CommitItem::Checksum,
                3 => CommitItem::Unknown,
                4 => CommitItem::StoreFailed,
                tag => {
                    return Err(ProtoError::InvalidTag {
                        what: "commit item",
                        tag,
                    })
                }
            });
        }
        Ok(UcxCommitReply { items })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lease_extents_are_checked_before_a_reader_uses_them() {
        use super::{check_lease_extents as check, LeaseExtentError as E};
        assert_eq!(check(&[(0x1000, 24)], 24), Ok(()));
        assert_eq!(check(&[(0x1000, 16), (0x9000, 8)], 24), Ok(()));
        assert_eq!(check(&[], 24), Err(E::NoExtents { object: 24 }));
        assert_eq!(
            check(&[(0x1000, 0), (0x1000, 24)], 24),
            Err(E::Empty {
                index: 0,
                addr: 0x1000,
                object: 24
            })
        );
        assert_eq!(
            check(&[(u64::MAX - 3, 8), (0, 16)], 24),
            Err(E::Wraps {
                index: 0,
                addr: u64::MAX - 3,
                len: 8
            })
        );
        // Lengths whose sum wraps to the object's size (the old reader summed with `+`).
        assert_eq!(
            check(&[(0x1000, u64::MAX), (0x2000, 25)], 24),
            Err(E::Wraps {
                index: 0,
                addr: 0x1000,
                len: u64::MAX
            })
        );
        assert_eq!(
            check(&[(0x1000, 1 << 31)], 24),
            Err(E::ExceedsObject {
                index: 0,
                len: 1 << 31,
                object: 24
            })
        );
        assert_eq!(
            check(&[(0x1000, 16), (0x2000, 16)], 24),
            Err(E::SizeDiffers {
                leased: 32,
                object: 24
            })
        );
        assert_eq!(
            check(&[(0x1000, 16)], 24),
            Err(E::SizeDiffers {
                leased: 16,
                object: 24
            })
        );
        let many = vec![(0x1000u64, 1u64); super::MAX_LEASE_EXTENTS + 1];
        assert_eq!(
            check(&many, many.len() as u64),
            Err(E::TooManyExtents {
                count: super::MAX_LEASE_EXTENTS + 1
            })
        );
        let text = check(&[(0x1000, 1 << 31)], 24).unwrap_err().to_string();
        assert!(
            text.contains("2147483648") && text.contains("24-byte"),
            "{text}"
        );
    }

    use super::*;

    #[test]
    fn bodies_round_trip_and_reject_garbage() {
        let offer = UcxOffer {
            worker_address: vec![1; 300],
            max_leases: 256,
            lease_ms: 5000,
            transports: "posix,cma,self".into(),
            host: "boot-id".into(),
        };
        assert_eq!(
            UcxOffer::decode(&offer.encode_to_vec().unwrap()).unwrap(),
            offer
        );
        let request = UcxLeaseRequest {
            objects: vec![(b"a".to_vec(), 10), (b"bb".to_vec(), 1 << 20)],
        };
        assert_eq!(
            UcxLeaseRequest::decode(&request.encode_to_vec().unwrap()).unwrap(),
            request
        );
        let reply = UcxLeaseReply {
            lease_id: 7,
            items: vec![
                LeaseItem::Extents {
                    extents: vec![(0x7f00_0000_0000, 4096), (0x7f00_0001_0000, 10)],
                    keys: vec![vec![2; 40], vec![5; 3]],
                },
                LeaseItem::NotFound,
                LeaseItem::SizeMismatch,
                LeaseItem::NotRemote,
            ],
        };
        let bytes = reply.encode_to_vec().unwrap();
        assert_eq!(UcxLeaseReply::decode(&bytes).unwrap(), reply);
        let mut bad = bytes.clone();
        bad[2] = 9; // the first item's tag
        assert!(UcxLeaseReply::decode(&bad).is_err());
        // A count larger than the bytes left is refused before any allocation.
        assert!(UcxLeaseRequest::decode(&[0x80, 0x08]).is_err());
        let release = UcxRelease { lease_id: 99 };
        assert_eq!(
            UcxRelease::decode(&release.encode_to_vec().unwrap()).unwrap(),
            release
        );
    }

    #[test]
    fn put_bodies_round_trip_and_reject_garbage() {
        let landing = UcxLanding {
            rkey: vec![3; 50],
            size: 64 << 20,
            max_connection_bytes: 32 << 20,
            reservation_ms: 5000,
        };
        assert_eq!(
            UcxLanding::decode(&landing.encode_to_vec().unwrap()).unwrap(),
            landing
        );
        let request = UcxReserveRequest {
            objects: vec![(b"k".to_vec(), 4104, Some(3)), (b"kk".to_vec(), 9, None)],
        };
        assert_eq!(
            UcxReserveRequest::decode(&request.encode_to_vec().unwrap()).unwrap(),
            request
        );
        // More bytes than one request may reserve: refused both ways.
        let greedy = UcxReserveRequest {
            objects: vec![
                (b"a".to_vec(), MAX_RESERVE_BYTES, None),
                (b"b".to_vec(), 1, None),
            ],
        };
        assert!(greedy.encode_to_vec().is_err());
        let mut forged = vec![2u8, 1, b'a'];
        put_varint(&mut forged, MAX_RESERVE_BYTES);
        forged.extend([0, 1, b'b', 1, 0]);
        assert!(UcxReserveRequest::decode(&forged).is_err());
        // A depth beyond u32 is refused.
        let mut deep = vec![1u8, 1, b'a', 9];
        put_varint(&mut deep, u64::from(u32::MAX) + 2);
        assert!(UcxReserveRequest::decode(&deep).is_err());
        let reply = UcxReserveReply {
            items: vec![
                ReserveItem::Extent {
                    id: 5,
                    addr: 0x7f00_0000_0000,
                },
                ReserveItem::Full,
                ReserveItem::TooBig,
                ReserveItem::Present,
            ],
        };
        let bytes = reply.encode_to_vec().unwrap();
        assert_eq!(UcxReserveReply::decode(&bytes).unwrap(), reply);
        assert!(UcxReserveReply::decode(&[1, 7]).is_err());
        let commit = UcxCommit {
            ids: vec![1, 2, 300],
        };
        assert_eq!(
            UcxCommit::decode(&commit.encode_to_vec().unwrap()).unwrap(),
            commit
        );
        let done = UcxCommitReply {
            items: vec![
                CommitItem::Stored,
                CommitItem::Present,
                CommitItem::Checksum,
                CommitItem::Unknown,
                CommitItem::StoreFailed,
            ],
        };
        assert_eq!(
            UcxCommitReply::decode(&done.encode_to_vec().unwrap()).unwrap(),
            done
        );
        assert!(UcxCommitReply::decode(&[1, 5]).is_err());
        // Counts beyond the bytes left are refused before any allocation.
        assert!(UcxCommit::decode(&[0x80, 0x08]).is_err());
    }
}

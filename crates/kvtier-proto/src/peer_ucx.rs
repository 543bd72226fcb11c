//! Bodies of the UCX data plane's control messages on the peer data port (issue 17).
//!
//! They travel on an authenticated data-port connection ([`crate::peer`]), so a node hands its
//! UCX worker address and the remote key of its DRAM arena only to peers that proved the
//! cluster token. Page bytes then move one-sided (UCP get) straight between the node's arena
//! and the client's buffer; these messages only pin and release what is read:
//!
//! 1. `PeerUcxHello` (client -> node, empty body): the node answers [`UcxOffer`] (its worker
//!    address, the packed remote key of its arena, the lease bounds), or `UNSUPPORTED` when it
//!    runs without UCX.
//! 2. `PeerUcxLease` ([`UcxLeaseRequest`]): the node pins each object found with the expected
//!    length and answers [`UcxLeaseReply`]: one lease id for the batch and, per object, its
//!    extents in the arena (address, length, in order). A pinned object cannot be evicted or
//!    its memory reused until the lease is released or expires (`lease_ms`); at most
//!    `max_leases` leases are held per node (a new one beyond that is refused, `BUSY`).
//! 3. `PeerUcxRelease` ([`UcxRelease`]): drops the pins; answered with an empty body. A lease
//!    released twice or unknown is not an error (it may have expired).
//!
//! The reader still verifies each object's end-to-end checksum trailer after the read: a lease
//! that expired mid-read (a stalled client) can never yield wrong bytes as a hit.
//!
//! Wire forms (same primitives as [`crate::codec`]):
//! ```text
//! UcxOffer        := bytes(worker_address) bytes(rkey) varint(max_leases) varint(lease_ms)
//!                    str(transports)
//! UcxLeaseRequest := varint(n) n*( bytes(key) varint(expected_len) )
//! UcxLeaseReply   := varint(lease_id) varint(n) n*( u8 status [status 0: varint(m) m*(varint(addr) varint(len))] )
//! UcxRelease      := varint(lease_id)
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
/// Longest transport description.
const MAX_TRANSPORTS_LEN: usize = 1024;

/// What the node found for one object of a lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseItem {
    /// Pinned: the object's extents in the node's arena, in order.
    Extents(Vec<(u64, u64)>),
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
    pub rkey: Vec<u8>,
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
        put_bytes(out, "remote key", &self.rkey, MAX_UCX_RKEY_LEN)?;
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
            rkey: reader.read_bytes("remote key", MAX_UCX_RKEY_LEN)?.to_vec(),
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
                LeaseItem::Extents(extents) => {
                    out.push(0);
                    put_len(out, "extents", extents.len(), MAX_LEASE_EXTENTS)?;
                    for (addr, len) in extents {
                        put_varint(out, *addr);
                        put_varint(out, *len);
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
                    let m = reader.read_count("extents", MAX_LEASE_EXTENTS, 2)?;
                    let mut extents = Vec::with_capacity(m);
                    for _ in 0..m {
                        let addr = reader.read_varint("extent address")?;
                        let len = reader.read_varint("extent length")?;
                        extents.push((addr, len));
                    }
                    LeaseItem::Extents(extents)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_and_reject_garbage() {
        let offer = UcxOffer {
            worker_address: vec![1; 300],
            rkey: vec![2; 40],
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
                LeaseItem::Extents(vec![(0x7f00_0000_0000, 4096), (0x7f00_0001_0000, 10)]),
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
}

//! Property tests of the frame layer: streams of frames round-trip, and no header or stream,
//! however corrupt, panics the reader or makes it reserve more than the limit in force.
#![allow(clippy::unwrap_used)]

use std::io::Cursor;

use kvtier_proto::frame::{FrameHeader, HEADER_LEN, KNOWN_FLAGS};
use kvtier_proto::{
    encode_frame, read_frame, read_frame_limited, write_frame, Decode, ExistsV2Query, Opcode,
    ProtoError,
};
use proptest::collection::vec;
use proptest::prelude::*;

mod common;

fn opcode() -> impl Strategy<Value = Opcode> {
    proptest::sample::select(Opcode::ALL.to_vec())
}

fn frame() -> impl Strategy<Value = (Opcode, u64, u32, Vec<u8>)> {
    (
        opcode(),
        any::<u64>(),
        (0..=KNOWN_FLAGS),
        prop_oneof![vec(any::<u8>(), 0..64), vec(any::<u8>(), 4000..4200)],
    )
}

proptest! {
    #[test]
    fn streams_of_frames_round_trip(frames in vec(frame(), 1..6)) {
        let mut wire = Vec::new();
        for (opcode, id, flags, body) in &frames {
            write_frame(&mut wire, *opcode, *id, *flags, body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let mut reader = Cursor::new(wire);
        let mut body = Vec::new();
        for (opcode, id, flags, expected) in &frames {
            let header = read_frame(&mut reader, &mut body).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(header.opcode().ok(), Some(*opcode));
            prop_assert_eq!(header.request_id, *id);
            prop_assert_eq!(header.flags, *flags);
            prop_assert_eq!(&body, expected);
        }
        prop_assert!(matches!(read_frame(&mut reader, &mut body), Err(ProtoError::ConnectionClosed)));
    }

    #[test]
    fn a_query_is_one_frame_end_to_end(query in common::exists_query(), id in any::<u64>()) {
        let mut wire = Vec::new();
        encode_frame(&mut wire, Opcode::ExistsV2, id, 0, &query).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut body = Vec::new();
        let header = read_frame(&mut Cursor::new(&wire), &mut body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(header.opcode().ok(), Some(Opcode::ExistsV2));
        prop_assert_eq!(header.request_id, id);
        prop_assert_eq!(HEADER_LEN + body.len(), wire.len());
        prop_assert_eq!(ExistsV2Query::decode(&body).ok(), Some(query));
    }

    #[test]
    fn random_headers_never_panic_and_reencode_exactly(bytes in vec(any::<u8>(), 0..40)) {
        if let Ok(header) = FrameHeader::decode(&bytes) {
            prop_assert_eq!(&header.encode()[..], &bytes[..HEADER_LEN]);
        }
    }

    #[test]
    fn mutated_headers_never_panic(
        (opcode, id, flags, _) in frame(),
        body_len in any::<u32>(),
        at in 0..HEADER_LEN,
        byte in any::<u8>(),
    ) {
        let mut bytes = FrameHeader::new(opcode, id, flags, body_len).encode();
        bytes[at] = byte;
        if let Ok(header) = FrameHeader::decode(&bytes) {
            prop_assert_eq!(header.encode(), bytes);
        }
    }

    #[test]
    fn corrupt_streams_never_overreserve(
        (opcode, id, flags, body) in frame(),
        mutations in vec((any::<usize>(), any::<u8>()), 0..4),
        cut in any::<usize>(),
    ) {
        let mut wire = Vec::new();
        write_frame(&mut wire, opcode, id, flags, &body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (at, byte) in mutations {
            let len = wire.len();
            wire[at % len] = byte;
        }
        wire.truncate(cut % (wire.len() + 1));
        let limit = 8 << 10;
        let mut buffer = Vec::new();
        let result = read_frame_limited(&mut Cursor::new(&wire), &mut buffer, limit);
        prop_assert!(buffer.capacity() <= limit as usize, "reserved {}", buffer.capacity());
        if let Ok(header) = result {
            prop_assert_eq!(buffer.len(), header.body_len as usize);
            prop_assert!(HEADER_LEN + buffer.len() <= wire.len());
        }
    }

    #[test]
    fn every_cut_of_a_frame_is_rejected((opcode, id, flags, body) in frame()) {
        let mut wire = Vec::new();
        write_frame(&mut wire, opcode, id, flags, &body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut buffer = Vec::new();
        for cut in 0..wire.len() {
            let result = read_frame(&mut Cursor::new(&wire[..cut]), &mut buffer);
            match (cut, result) {
                (0, Err(ProtoError::ConnectionClosed)) => {}
                (_, Err(ProtoError::Truncated { .. })) if cut > 0 => {}
                (cut, other) => prop_assert!(false, "cut at {}: {:?}", cut, other.map(|_| ())),
            }
        }
    }
}

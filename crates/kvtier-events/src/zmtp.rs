//! The server side of ZeroMQ's wire protocol (ZMTP 3.0/3.1, NULL mechanism) for the two socket
//! kinds the KV-event stream needs: PUB (peers SUB / XSUB) and ROUTER (peers DEALER / REQ).
//!
//! Owns: the greeting and READY exchange ([`handshake`]), frame reading with a size bound
//! ([`read_frame`]) and multipart writing ([`write_message`]). Nothing else of ZeroMQ is
//! implemented: no CURVE/PLAIN security (the stream is bound only where the operator says,
//! see docs/security.md), no heartbeats (a PING from a peer is ignored), no other socket kinds.
//!
//! Why hand-rolled: the stream must bound everything a remote peer can make the server hold
//! (frame sizes, subscriptions, connections, queued batches per subscriber), and at this
//! size the protocol is ~200 lines; libzmq would need a C library and gives no per-peer caps.
//!
//! Every input is a hostile peer's: lengths are checked before allocation, a greeting or READY
//! that is not ZMTP 3 NULL from an accepted socket type is an error naming what was wrong.

use std::io::{self, Read, Write};

/// Length of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;
/// Flag bits of a frame's first byte.
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Why a peer's bytes are not acceptable ZMTP.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("not a ZMTP 3 greeting: {0}")]
    Greeting(String),
    #[error("security mechanism {0:?} is not NULL (the only one served)")]
    Mechanism(String),
    #[error("peer socket type {got:?} cannot talk to a {ours} socket (accepted: {accepted})")]
    PeerType {
        got: String,
        ours: &'static str,
        accepted: String,
    },
    #[error("frame of {size} bytes is above the {max}-byte bound")]
    FrameTooLarge { size: u64, max: usize },
    #[error("protocol: {0}")]
    Protocol(String),
}

/// One frame as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub more: bool,
    pub command: bool,
    pub body: Vec<u8>,
}

/// Our greeting: ZMTP 3.0, NULL, as-server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3; // major
    g[11] = 0; // minor: 3.0 (a 3.1 peer speaks 3.0 to us)
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1; // as-server
    g
}

/// Check a peer's greeting: signature, major version 3 or above, NULL mechanism.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] & 0x01 != 0x01 {
        return Err(ZmtpError::Greeting(format!(
            "signature bytes {:#04x}..{:#04x}",
            g[0], g[9]
        )));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting(format!("version {}.{}", g[10], g[11])));
    }
    let mech = &g[12..32];
    let name_len = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..name_len] != b"NULL" {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mech[..name_len]).into_owned(),
        ));
    }
    Ok(())
}

/// Encode a command frame `name` + `body`.
fn command(name: &str, body: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(1 + name.len() + body.len());
    payload.push(name.len() as u8);
    payload.extend_from_slice(name.as_bytes());
    payload.extend_from_slice(body);
    let mut out = Vec::with_capacity(payload.len() + 9);
    push_header(&mut out, FLAG_COMMAND, payload.len());
    out.extend_from_slice(&payload);
    out
}

fn push_header(out: &mut Vec<u8>, flags: u8, len: usize) {
    if len <= 255 {
        out.push(flags);
        out.push(len as u8);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

/// The READY command naming our socket type.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    let name = b"Socket-Type";
    props.push(name.len() as u8);
    props.extend_from_slice(name);
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    command("READY", &props)
}

/// Split a command frame's body into its name and data.
pub fn parse_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let n = *body
        .first()
        .ok_or_else(|| ZmtpError::Protocol("empty command frame".into()))? as usize;
    if body.len() < 1 + n {
        return Err(ZmtpError::Protocol(
            "command name longer than its frame".into(),
        ));
    }
    Ok((&body[1..1 + n], &body[1 + n..]))
}

/// The `Socket-Type` property of a READY command's data.
fn socket_type_of(mut props: &[u8]) -> Result<String, ZmtpError> {
    let bad = || ZmtpError::Protocol("malformed READY properties".into());
    while !props.is_empty() {
        let n = props[0] as usize;
        let name = props.get(1..1 + n).ok_or_else(bad)?;
        let len_bytes: [u8; 4] = props
            .get(1 + n..5 + n)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(bad)?;
        let len = u32::from_be_bytes(len_bytes) as usize;
        let value = props.get(5 + n..5 + n + len).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
        props = &props[5 + n + len..];
    }
    Err(ZmtpError::Protocol("READY without Socket-Type".into()))
}

/// Read one frame whose body is at most `max` bytes.
pub fn read_frame<R: Read>(r: &mut R, max: usize) -> Result<Frame, ZmtpError> {
    let mut flags = [0u8; 1];
    r.read_exact(&mut flags)?;
    let flags = flags[0];
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Protocol(format!(
            "reserved flag bits in {flags:#04x}"
        )));
    }
    let size = if flags & FLAG_LONG != 0 {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        u64::from_be_bytes(b)
    } else {
        let mut b = [0u8; 1];
        r.read_exact(&mut b)?;
        u64::from(b[0])
    };
    if size > max as u64 {
        return Err(ZmtpError::FrameTooLarge { size, max });
    }
    let mut body = vec![0u8; size as usize];
    r.read_exact(&mut body)?;
    Ok(Frame {
        more: flags & FLAG_MORE != 0,
        command: flags & FLAG_COMMAND != 0,
        body,
    })
}

/// Encode a multipart message (one buffer, written with one `write_all` by the caller).
pub fn encode_message(parts: &[&[u8]]) -> Vec<u8> {
    let total: usize = parts.iter().map(|p| p.len() + 9).sum();
    let mut out = Vec::with_capacity(total);
    for (i, part) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
        push_header(&mut out, more, part.len());
        out.extend_from_slice(part);
    }
    out
}

/// Write a multipart message.
pub fn write_message<W: Write>(w: &mut W, parts: &[&[u8]]) -> io::Result<()> {
    w.write_all(&encode_message(parts))
}

/// Greeting and READY exchange as a `ours` socket; the peer's type must be in `accepted`.
pub fn handshake<S: Read + Write>(
    s: &mut S,
    ours: &'static str,
    accepted: &[&str],
) -> Result<(), ZmtpError> {
    s.write_all(&greeting())?;
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g)?;
    check_greeting(&g)?;
    s.write_all(&ready(ours))?;
    let frame = read_frame(s, 4096)?;
    if !frame.command {
        return Err(ZmtpError::Protocol("expected the READY command".into()));
    }
    let (name, data) = parse_command(&frame.body)?;
    if name == b"ERROR" {
        return Err(ZmtpError::Protocol(format!(
            "peer sent ERROR {:?}",
            String::from_utf8_lossy(data)
        )));
    }
    if name != b"READY" {
        return Err(ZmtpError::Protocol(format!(
            "expected READY, got {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    let peer = socket_type_of(data)?;
    if !accepted.iter().any(|a| a.eq_ignore_ascii_case(&peer)) {
        let _ = s.write_all(&command("ERROR", b"\x14invalid socket type"));
        return Err(ZmtpError::PeerType {
            got: peer,
            ours,
            accepted: accepted.join(", "),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_short_and_long() {
        let long = vec![7u8; 300];
        let bytes = encode_message(&[b"topic", &long]);
        let mut r = &bytes[..];
        let a = read_frame(&mut r, 1024).unwrap();
        assert_eq!(
            (a.more, a.command, &a.body[..]),
            (true, false, &b"topic"[..])
        );
        let b = read_frame(&mut r, 1024).unwrap();
        assert_eq!((b.more, b.body.len()), (false, 300));
        let mut r = &bytes[7..];
        assert!(matches!(
            read_frame(&mut r, 100),
            Err(ZmtpError::FrameTooLarge {
                size: 300,
                max: 100
            })
        ));
    }

    #[test]
    fn greeting_and_ready_are_checked() {
        check_greeting(&greeting()).unwrap();
        let mut g = greeting();
        g[12..16].copy_from_slice(b"CURV");
        assert!(matches!(check_greeting(&g), Err(ZmtpError::Mechanism(_))));
        let mut g = greeting();
        g[10] = 2;
        assert!(matches!(check_greeting(&g), Err(ZmtpError::Greeting(_))));
        let r = ready("SUB");
        let mut rd = &r[..];
        let f = read_frame(&mut rd, 4096).unwrap();
        let (name, data) = parse_command(&f.body).unwrap();
        assert_eq!(name, b"READY");
        assert_eq!(socket_type_of(data).unwrap(), "SUB");
        assert!(socket_type_of(&[11, b'S']).is_err());
    }
}

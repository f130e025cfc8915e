//! Byte formats on the wire: length-prefixed JSON control messages (rendezvous and the
//! arrival tracking that names missing ranks), and fixed-header data frames for the ring.
//!
//! Data travels as raw little-endian f32/f64: every host we target (x86-64, aarch64) is
//! little-endian, and a conversion would cost more than the copy.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Guards against reading a huge length from a stray connection.
const MAX_CONTROL_BYTES: u32 = 16 << 20;

/// Messages between a rank and rank 0's rendezvous / coordinator service.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "msg")]
pub enum Control {
    /// First message of a joining rank.
    /// `job`: the launcher's identity of the job ("" when none), so a process of another job
    /// that reaches this port is refused.
    Hello {
        version: u32,
        rank: usize,
        world_size: usize,
        config_hash: String,
        data_port: u16,
        #[serde(default)]
        job: String,
    },
    /// Rendezvous complete: everyone's ring address, the session nonce, rank 0's blob.
    Welcome { world_size: usize, peers: Vec<String>, session: u64, blob: Vec<u8> },
    /// Rendezvous failed; the reason is rank 0's error text.
    Reject { reason: String },
    /// This rank entered collective number `seq` (of the TCP ring, or with `device` of the
    /// device communicator, whose collectives are numbered apart).
    Arrive {
        seq: u64,
        #[serde(default)]
        device: bool,
    },
    /// Which ranks have entered collective `seq` (of the ring, or of the device)?
    Query {
        seq: u64,
        #[serde(default)]
        device: bool,
    },
    /// Per rank: last collective entered (0 = none yet) and whether its connection closed.
    Status {
        last: Vec<u64>,
        gone: Vec<bool>,
        /// Milliseconds since rank 0 last heard from each rank.
        #[serde(default)]
        silent_ms: Vec<u64>,
    },
    /// This rank's process is alive (sent every second by a thread that runs even while the
    /// rank waits on its device).
    Alive,
}

pub const PROTOCOL_VERSION: u32 = 1;

pub fn write_control(w: &mut impl Write, m: &Control) -> io::Result<()> {
    let body = serde_json::to_vec(m).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()
}

pub fn read_control(r: &mut impl Read) -> io::Result<Control> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_CONTROL_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("control message of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Magic at the start of every data frame ("VSCR").
const MAGIC: u32 = 0x5643_5352;
pub const HEADER_BYTES: usize = 32;

/// Header of one data frame: which collective (op code and sequence number), which step of
/// it, how many elements follow. The receiver checks all of it, so ranks that issue
/// different collectives fail with a clear error instead of adding unrelated data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub op: u8,
    pub elem_bytes: u8,
    pub seq: u64,
    pub step: u32,
    pub count: u64,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.elem_bytes;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[20..28].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_BYTES]) -> Option<FrameHeader> {
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        if word(0..4) as u32 != MAGIC {
            return None;
        }
        Some(FrameHeader { op: b[4], elem_bytes: b[5], seq: word(8..16), step: word(16..20) as u32, count: word(20..28) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = FrameHeader { op: 3, elem_bytes: 4, seq: 1 << 40, step: 7, count: 123_456_789 };
        assert_eq!(FrameHeader::decode(&h.encode()), Some(h));
        assert_eq!(FrameHeader::decode(&[0u8; HEADER_BYTES]), None);
    }

    #[test]
    fn control_round_trip_and_length_guard() {
        let m = Control::Status { last: vec![3, 4], gone: vec![false, true], silent_ms: vec![0, 1500] };
        let mut buf = Vec::new();
        write_control(&mut buf, &m).unwrap();
        assert_eq!(read_control(&mut buf.as_slice()).unwrap(), m);
        let huge = u32::MAX.to_le_bytes();
        assert!(read_control(&mut huge.as_slice()).is_err());
    }
}

//! Versioned byte encoding for saved object state: a magic tag, a format version, the payload as
//! little-endian fields, and a trailing checksum. Readers reject anything they do not recognise
//! before touching the object, so a failed load leaves it as it was.

use crate::error::{Error, ErrorKind, Result};

const HEADER_LEN: usize = 8; // magic (4) + version (4)
const CHECKSUM_LEN: usize = 8;

/// Builds a state blob field by field.
pub struct Writer {
    bytes: Vec<u8>,
}

impl Writer {
    pub fn new(magic: [u8; 4], version: u32) -> Self {
        let mut bytes = Vec::with_capacity(64);
        bytes.extend_from_slice(&magic);
        bytes.extend_from_slice(&version.to_le_bytes());
        Writer { bytes }
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_bits().to_le_bytes());
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.bytes.push(v as u8);
        self
    }

    pub fn f32s(&mut self, values: &[f32]) -> &mut Self {
        self.u64(values.len() as u64);
        self.bytes.reserve(values.len() * 4);
        for v in values {
            self.bytes.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        self
    }

    pub fn u16s(&mut self, values: &[u16]) -> &mut Self {
        self.u64(values.len() as u64);
        self.bytes.reserve(values.len() * 2);
        for v in values {
            self.bytes.extend_from_slice(&v.to_le_bytes());
        }
        self
    }

    pub fn u8s(&mut self, values: &[u8]) -> &mut Self {
        self.u64(values.len() as u64);
        self.bytes.extend_from_slice(values);
        self
    }

    pub fn finish(mut self) -> Vec<u8> {
        let sum = checksum(&self.bytes);
        self.bytes.extend_from_slice(&sum.to_le_bytes());
        self.bytes
    }
}

/// Reads a state blob written by [`Writer`], checking magic, version and checksum up front.
pub struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn open(what: &'static str, bytes: &'a [u8], magic: [u8; 4], version: u32) -> Result<Self> {
        Self::open_versions(what, bytes, magic, version..=version).map(|(r, _)| r)
    }

    /// As [`Reader::open`], accepting any format version in `versions`; returns the one found.
    pub fn open_versions(
        what: &'static str,
        bytes: &'a [u8],
        magic: [u8; 4],
        versions: std::ops::RangeInclusive<u32>,
    ) -> Result<(Self, u32)> {
        if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
            return Err(corrupt(what, format!("{} bytes is too short", bytes.len())));
        }
        if bytes[..4] != magic {
            return Err(corrupt(
                what,
                "magic tag does not match (not a saved state of this object)",
            ));
        }
        let found = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
        if !versions.contains(&found) {
            let expected = if versions.start() == versions.end() {
                versions.start().to_string()
            } else {
                format!("{versions:?}")
            };
            return Err(corrupt(
                what,
                format!("format version {found} is not supported (expected {expected})"),
            ));
        }
        let (body, tail) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        if checksum(body).to_le_bytes() != tail {
            return Err(corrupt(what, "checksum mismatch (bytes corrupted or truncated)"));
        }
        Ok((Reader { what, bytes: body, pos: HEADER_LEN }, found))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() - self.pos < n {
            return Err(corrupt(self.what, "payload ends early"));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    pub fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_bits(u32::from_le_bytes(self.take(4)?.try_into().unwrap())))
    }

    pub fn bool(&mut self) -> Result<bool> {
        match self.take(1)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(corrupt(self.what, format!("boolean field holds {b}"))),
        }
    }

    /// The bytes of an array of `width`-byte values whose length must be `expected_len`.
    fn array(&mut self, expected_len: usize, width: usize) -> Result<&'a [u8]> {
        let n = self.u64()?;
        if n != expected_len as u64 {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "{}: saved buffer holds {n} elements, this object has {expected_len}",
                    self.what
                ),
            ));
        }
        self.take(expected_len * width)
    }

    /// Reads an f32 array whose length must be `expected_len`.
    pub fn f32s_into(&mut self, out: &mut Vec<f32>, expected_len: usize) -> Result<()> {
        let raw = self.array(expected_len, 4)?;
        out.clear();
        out.extend(
            raw.chunks_exact(4).map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().unwrap()))),
        );
        Ok(())
    }

    /// Reads a u16 array whose length must be `expected_len`.
    pub fn u16s_into(&mut self, out: &mut Vec<u16>, expected_len: usize) -> Result<()> {
        let raw = self.array(expected_len, 2)?;
        out.clear();
        out.extend(raw.chunks_exact(2).map(|c| u16::from_le_bytes(c.try_into().unwrap())));
        Ok(())
    }

    /// Reads a byte array whose length must be `expected_len`.
    pub fn u8s_into(&mut self, out: &mut Vec<u8>, expected_len: usize) -> Result<()> {
        let raw = self.array(expected_len, 1)?;
        out.clear();
        out.extend_from_slice(raw);
        Ok(())
    }

    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<()> {
        if self.pos != self.bytes.len() {
            return Err(corrupt(
                self.what,
                format!("{} unexpected trailing bytes", self.bytes.len() - self.pos),
            ));
        }
        Ok(())
    }
}

/// Whether values read from saved bytes hold a NaN or an infinity. Loading re-derives what it can
/// check from the values instead of trusting a saved flag beside them: the checksum catches
/// damage, not a blob rewritten with a fresh checksum, so a NaN saved as "no overflow" must still
/// count as an overflow.
pub fn holds_non_finite(values: &[f32]) -> bool {
    values.iter().any(|v| !v.is_finite())
}

fn corrupt(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::CorruptState, format!("{what}: {detail}"))
}

/// FNV-1a, 64-bit: catches truncation and bit flips; saved state is not an adversarial format.
/// Also fingerprints an accumulator's layout.
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let mut w = Writer::new(*b"TEST", 3);
        w.u64(7).f32(1.5).bool(true).f32s(&[1.0, -2.0]);
        let bytes = w.finish();
        let mut r = Reader::open("t", &bytes, *b"TEST", 3).unwrap();
        assert_eq!(r.u64().unwrap(), 7);
        assert_eq!(r.f32().unwrap(), 1.5);
        assert!(r.bool().unwrap());
        let mut v = Vec::new();
        r.f32s_into(&mut v, 2).unwrap();
        assert_eq!(v, [1.0, -2.0]);
        r.finish().unwrap();

        assert!(Reader::open("t", &bytes, *b"TEST", 4).is_err());
        assert!(Reader::open("t", &bytes, *b"NOPE", 3).is_err());
        assert!(Reader::open("t", &bytes[..bytes.len() - 1], *b"TEST", 3).is_err());
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(Reader::open("t", &bad, *b"TEST", 3).is_err(), "flip at byte {i} accepted");
        }
    }
}

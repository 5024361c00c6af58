//! 8-bit blockwise moments: each block of [`BLOCK`] elements keeps one f32 scale, its largest
//! magnitude, and one byte per element, the index of the entry of a dynamic quantisation map
//! nearest to the element over the scale (the scheme of Dettmers et al., "8-bit Optimizers via
//! Block-wise Quantization"). The first moment takes the signed map, the second (never
//! negative) the unsigned one, whose entries are twice as dense. The signed map holds 1 but not
//! -1, so a block's largest magnitude is kept exactly when it is positive, and else coded as the
//! map's most negative entry, (1 - 0.45 / 64) times it.
//!
//! A block is [`BLOCK`] consecutive elements of one tensor counted from the tensor's start.
//! Every tensor starts at a multiple of `MASTER_ALIGN` bytes of the flat layout, that is of
//! [`BLOCK`] f32 elements, and every shard at a multiple of `NORM_BLOCK` (4096) elements, so no
//! shard boundary splits a block: each block is stepped whole by one rank and the blocks are the
//! same at every shard count, which keeps sharded runs bitwise the unsharded one and lets saved
//! state re-cut onto any shard count. A tensor's last block is shorter when its length is not a
//! multiple of [`BLOCK`]. The cost is 4 / [`BLOCK`] bytes of scale per moment; a larger block
//! (the paper's 2048) could straddle two tensors' starts or a tensor's start and a shard's
//! boundary, and a smaller one costs more scale for a smaller quantisation error.

use std::sync::OnceLock;

use super::pass::Master;
use super::update::Scalars;

/// Elements per block: `MASTER_ALIGN` / 4, the largest block that every tensor start and shard
/// boundary respects.
pub const BLOCK: usize = crate::accumulator::MASTER_ALIGN / 4;

/// The decades of the map: its entries' magnitudes run from 10^-6 to 1.
const DECADES: usize = 7;

/// A dynamic quantisation map: 256 entries in increasing order and the 255 thresholds between
/// neighbours (the f32 nearest their midpoint).
pub(crate) struct Map {
    pub entries: [f32; 256],
    thresholds: [f32; 255],
    /// The index of the entry 0.
    pub zero: u8,
}

impl Map {
    /// The map of `signed` values (a sign bit, then 7 bits) or non-negative ones (8 bits). Decade
    /// d (0..7) holds 2^d entries per sign (2^(d+1) unsigned): the midpoints of that many equal
    /// steps of [0.1, 1], times 10^(d-6). Then 0 and 1. Signed: 2·127 + 2 = 256 entries;
    /// unsigned: 254 + 2.
    fn new(signed: bool) -> Map {
        const POWERS: [f64; DECADES] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
        let mut v: Vec<f64> = vec![0.0, 1.0];
        for (d, p) in POWERS.iter().enumerate() {
            let count = if signed { 1usize << d } else { 2usize << d };
            for j in 0..count {
                let e = p * (0.1 + 0.9 * (j as f64 + 0.5) / count as f64);
                v.push(e);
                if signed {
                    v.push(-e);
                }
            }
        }
        v.sort_by(f64::total_cmp);
        assert_eq!(v.len(), 256, "a map has 256 entries");
        let entries: [f32; 256] = std::array::from_fn(|i| v[i] as f32);
        let thresholds = std::array::from_fn(|i| ((v[i] + v[i + 1]) / 2.0) as f32);
        let zero = entries.iter().position(|&e| e == 0.0).unwrap() as u8;
        Map { entries, thresholds, zero }
    }

    /// The signed map of first moments.
    pub(crate) fn signed() -> &'static Map {
        static MAP: OnceLock<Map> = OnceLock::new();
        MAP.get_or_init(|| Map::new(true))
    }

    /// The unsigned map of second moments.
    pub(crate) fn unsigned() -> &'static Map {
        static MAP: OnceLock<Map> = OnceLock::new();
        MAP.get_or_init(|| Map::new(false))
    }

    /// The code of `q` (in [-1, 1]): the number of thresholds at or below it, so the nearest
    /// entry, a tie at a threshold going up. NaN codes as the first entry.
    #[inline(always)]
    pub(crate) fn code(&self, q: f32) -> u8 {
        // Branch-free binary search: 255 thresholds, 8 halvings.
        let mut lo = 0usize;
        let mut step = 128usize;
        while step > 0 {
            let probe = lo + step - 1;
            if probe < 255 && self.thresholds[probe] <= q {
                lo += step;
            }
            step /= 2;
        }
        lo as u8
    }

    /// Codes `values` into `codes`, returning the block's scale: its largest magnitude (0 for a
    /// block of zeros, whose codes are all the zero entry).
    #[inline(always)]
    pub(crate) fn quantise(&self, values: &[f32], codes: &mut [u8]) -> f32 {
        let scale = values.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        if scale == 0.0 {
            codes.fill(self.zero);
            return 0.0;
        }
        for (c, v) in codes.iter_mut().zip(values) {
            *c = self.code(v / scale);
        }
        scale
    }

    /// The value of `code` in a block of `scale`.
    #[inline(always)]
    pub(crate) fn value(&self, code: u8, scale: f32) -> f32 {
        self.entries[code as usize] * scale
    }
}

/// The map of moment `slot` (0: first, 1: second).
pub(crate) fn map(slot: usize) -> &'static Map {
    if slot == 0 {
        Map::signed()
    } else {
        Map::unsigned()
    }
}

/// Blocks of `len` elements: one scale per [`BLOCK`] started.
pub(crate) fn blocks(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

/// `values` (a tensor's elements from a block boundary) quantised block by block with `map`.
pub(crate) fn quantise_all(map: &Map, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0; values.len()];
    let scales = (values.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)))
        .map(|(v, c)| map.quantise(v, c))
        .collect();
    (codes, scales)
}

/// The values of `codes` (from a block boundary) with their blocks' `scales`.
pub(crate) fn dequantise_all(map: &Map, codes: &[u8], scales: &[f32]) -> Vec<f32> {
    codes.iter().enumerate().map(|(i, &c)| map.value(c, scales[i / BLOCK])).collect()
}

/// One moment column in blocks: a code per element, a scale per block.
pub(crate) struct Blocks<'a> {
    pub codes: &'a mut [u8],
    pub scales: &'a mut [f32],
}

/// The step over a piece (starting at a block boundary) with blockwise moments: per block, the
/// moments decoded, every element stepped in f32 by the FP32 loop's rule and kept on the stack,
/// then the block's new scales found and its moments coded. `second` is empty for SGD.
pub(super) fn step<X: Master>(k: &Scalars, grad: &[f32], mut x: X, first: Blocks, second: Blocks) {
    let n = grad.len();
    assert!(first.codes.len() == n && x.len() == n, "a piece's slices");
    let (signed, unsigned) = (Map::signed(), Map::unsigned());
    let (mut m, mut v) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
    for (b, start) in (0..n).step_by(BLOCK).enumerate() {
        let len = BLOCK.min(n - start);
        let (m, v) = (&mut m[..len], &mut v[..len]);
        let mc = &mut first.codes[start..start + len];
        match k {
            Scalars::AdamW(a) => {
                let vc = &mut second.codes[start..start + len];
                let (ms, vs) = (first.scales[b], second.scales[b]);
                for i in 0..len {
                    let mut w = x.get(start + i);
                    (m[i], v[i]) = (signed.value(mc[i], ms), unsigned.value(vc[i], vs));
                    a.step(grad[start + i], &mut w, &mut m[i], &mut v[i]);
                    x.set(start + i, w);
                }
                first.scales[b] = signed.quantise(m, mc);
                second.scales[b] = unsigned.quantise(v, vc);
            }
            Scalars::Sgd(s) => {
                let ms = first.scales[b];
                for i in 0..len {
                    let mut w = x.get(start + i);
                    m[i] = signed.value(mc[i], ms);
                    s.step(grad[start + i], &mut w, &mut m[i]);
                    x.set(start + i, w);
                }
                first.scales[b] = signed.quantise(m, mc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both maps: 256 increasing entries from -1 (signed) or 0 to 1, and every code the nearest
    /// entry, against a search in f64 on random values.
    #[test]
    fn maps_code_to_the_nearest_entry() {
        for (signed, map) in [(true, Map::signed()), (false, Map::unsigned())] {
            assert!(map.entries.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(map.entries[255], 1.0);
            assert_eq!(map.entries[map.zero as usize], 0.0);
            let smallest = map.entries[map.zero as usize + 1];
            assert!((3e-7..6e-7).contains(&smallest), "{smallest}");
            assert_eq!(map.zero, if signed { 127 } else { 0 });
            let mut s = 0x1234_5678_9abc_def1u64;
            for _ in 0..20_000 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32;
                // Magnitudes spread over the decades.
                let q = u.powi(((s >> 8) % 12) as i32 + 1)
                    * if signed && s & 1 == 1 { -1.0 } else { 1.0 };
                let c = map.code(q) as usize;
                let d = (map.entries[c] as f64 - q as f64).abs();
                let best = map
                    .entries
                    .iter()
                    .map(|&e| (e as f64 - q as f64).abs())
                    .fold(f64::MAX, f64::min);
                assert!(d <= best * (1.0 + 1e-6) + 1e-12, "{q}: code {c}");
            }
            assert_eq!(map.code(1.0), 255);
        }
    }

    #[test]
    fn a_block_keeps_its_largest_positive_value_exactly() {
        let values: Vec<f32> = (0..BLOCK + 7).map(|i| (i as f32 - 30.0) * 0.37).collect();
        let (codes, scales) = quantise_all(Map::signed(), &values);
        assert_eq!(scales.len(), 2);
        let back = dequantise_all(Map::signed(), &codes, &scales);
        // The largest magnitude, 63 · 0.37 - 30 · 0.37, is positive: kept exactly.
        assert_eq!(back[63], values[63]);
        let zeros = quantise_all(Map::unsigned(), &[0.0; 5]);
        assert_eq!((zeros.0, zeros.1), (vec![0; 5], vec![0.0]));
    }
}

//! Where each tensor lives in the flat FP32 master and how the master is cut into communication
//! buckets: the part of an accumulator that every backend and every rank must agree on.
//!
//! Every tensor starts at a multiple of [`MASTER_ALIGN`] bytes, and the padding after it (up to
//! the next start, or the aligned end of the master) holds zeros that no pass ever writes
//! otherwise: so each tensor's master takes the kernels' vector path, each bucket handed to NCCL
//! starts aligned, and the padding adds nothing to any sum or norm.

use std::ops::Range;

use super::TensorDesc;
use crate::error::{Error, Result};
use crate::state;

/// Bytes to which every tensor's master (and the master's end) is aligned. 256: what `cudaMalloc`
/// guarantees a standalone tensor, so a master slice is as aligned as its own allocation would be;
/// a multiple of the 16-byte vector loads of the CUDA kernels and NCCL's packs, of the GPU's
/// 128-byte cache line and 32-byte sectors, and of the CPU's 64-byte cache line and AVX-512
/// vectors, so no two tensors share a line (threads adding neighbouring tensors never write the
/// same one). It costs at most 63 elements per tensor.
pub const MASTER_ALIGN: usize = 256;

/// [`MASTER_ALIGN`] in f32 elements.
pub(crate) const ALIGN_ELEMS: usize = MASTER_ALIGN / 4;

/// Tensor offsets, buckets and the layout's fingerprint.
#[derive(Debug)]
pub(crate) struct Layout {
    /// Start of each tensor in the master, plus the total length at the end.
    offsets: Vec<usize>,
    /// Each tensor's element count (the rest of its slot, up to the next offset, is padding).
    numels: Vec<usize>,
    /// Element ranges reduced one at a time at the boundary; each holds whole tensors.
    buckets: Vec<Range<usize>>,
    /// Identifies the layout, so ranks with different layouts fail instead of mixing.
    hash: u64,
}

impl Layout {
    /// Lays `tensors` out one after another, each starting at a multiple of [`MASTER_ALIGN`]
    /// bytes, and groups them into buckets of about `bucket_numel` elements. Fails on an empty
    /// list, an empty tensor, or a total too large.
    pub(crate) fn new(tensors: &[TensorDesc], bucket_numel: usize) -> Result<Self> {
        Self::aligned_to(tensors, bucket_numel, ALIGN_ELEMS)
    }

    /// The layout of 0.2, tensors packed back to back: what windows saved by 0.2 hold.
    pub(crate) fn packed(tensors: &[TensorDesc], bucket_numel: usize) -> Result<Self> {
        Self::aligned_to(tensors, bucket_numel, 1)
    }

    fn aligned_to(tensors: &[TensorDesc], bucket_numel: usize, align: usize) -> Result<Self> {
        if tensors.is_empty() {
            return Err(Error::invalid("the tensor list is empty"));
        }
        let mut offsets = Vec::with_capacity(tensors.len() + 1);
        let mut total = 0usize;
        for (i, t) in tensors.iter().enumerate() {
            if t.numel == 0 {
                return Err(Error::invalid(format!("tensors[{i}].numel is 0")));
            }
            offsets.push(total);
            total = total
                .checked_add(t.numel)
                .and_then(|n| n.checked_next_multiple_of(align))
                .filter(|&n| n <= isize::MAX as usize / 4)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "total element count overflows at tensors[{i}] (numel {})",
                        t.numel
                    ))
                })?;
        }
        offsets.push(total);
        let buckets = plan_buckets(&offsets, bucket_numel);
        // Every tensor's start, length and dtype, then the buckets: two ranks (or a saved window
        // and an accumulator) agree only if they hold the same tensors in the same places. A
        // layout with no padding hashes as 0.2's did.
        let mut bytes = Vec::with_capacity(17 * tensors.len() + 16 * buckets.len());
        for (t, &start) in tensors.iter().zip(&offsets) {
            bytes.extend((start as u64).to_le_bytes());
            bytes.extend((t.numel as u64).to_le_bytes());
            bytes.push(t.dtype.code() as u8);
        }
        for b in &buckets {
            bytes.extend((b.start as u64).to_le_bytes());
            bytes.extend((b.end as u64).to_le_bytes());
        }
        let numels = tensors.iter().map(|t| t.numel).collect();
        Ok(Layout { hash: state::checksum(&bytes), offsets, numels, buckets })
    }

    /// Total elements of the master, padding included.
    pub(crate) fn len(&self) -> usize {
        *self.offsets.last().expect("offsets end with the total")
    }

    /// Tensor `index`'s element range in the master.
    pub(crate) fn range(&self, index: usize) -> Range<usize> {
        self.offsets[index]..self.offsets[index] + self.numels[index]
    }

    /// The zeros after tensor `index`, up to the next tensor's start (or the master's end).
    pub(crate) fn padding(&self, index: usize) -> Range<usize> {
        self.range(index).end..self.offsets[index + 1]
    }

    /// Tensor `index`'s range and its padding.
    pub(crate) fn slot(&self, index: usize) -> Range<usize> {
        self.offsets[index]..self.offsets[index + 1]
    }

    pub(crate) fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Fails unless `index` names a tensor.
    pub(crate) fn check_index(&self, index: usize) -> Result<()> {
        let n = self.offsets.len() - 1;
        if index >= n {
            return Err(Error::invalid(format!(
                "index {index} is out of range (the accumulator has {n} tensors)"
            )));
        }
        Ok(())
    }

    /// The tensor whose slot (range and padding) holds element `pos` of the master.
    pub(crate) fn tensor_at(&self, pos: usize) -> usize {
        self.offsets.partition_point(|&o| o <= pos) - 1
    }

    /// The bucket holding tensor `index`.
    pub(crate) fn bucket_of(&self, index: usize) -> usize {
        self.buckets.partition_point(|b| b.end <= self.offsets[index])
    }
}

/// Groups consecutive whole tensors into buckets of at least `target` elements (the last may be
/// smaller); a tensor larger than `target` forms its own bucket.
fn plan_buckets(offsets: &[usize], target: usize) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let mut start = 0;
    for &end in &offsets[1..] {
        if end - start >= target {
            buckets.push(start..end);
            start = end;
        }
    }
    let total = *offsets.last().unwrap();
    if start < total {
        buckets.push(start..total);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    #[test]
    fn buckets_hold_whole_tensors() {
        assert_eq!(plan_buckets(&[0, 3, 5, 12, 13], 4), vec![0..5, 5..12, 12..13]);
        assert_eq!(plan_buckets(&[0, 10], 4), vec![0..10]);
        assert_eq!(plan_buckets(&[0, 1, 2, 3], 100), vec![0..3]);
    }

    #[test]
    fn the_fingerprint_tells_tensor_orders_dtypes_and_buckets_apart() {
        let layout = |numels: &[usize], dtype: Dtype, bucket: usize| {
            let t: Vec<TensorDesc> =
                numels.iter().map(|&numel| TensorDesc { numel, dtype }).collect();
            Layout::new(&t, bucket).unwrap().hash()
        };
        let base = layout(&[3, 2], Dtype::F32, 100);
        assert_eq!(base, layout(&[3, 2], Dtype::F32, 100));
        assert_ne!(base, layout(&[2, 3], Dtype::F32, 100), "same total, tensors swapped");
        assert_ne!(base, layout(&[3, 2], Dtype::F16, 100), "same shapes, another dtype");
        assert_ne!(base, layout(&[3, 2], Dtype::F32, 1), "same tensors, other buckets");
    }

    #[test]
    fn every_tensor_starts_aligned_and_its_padding_reaches_the_next() {
        let numels = [3, 64, 1, 65, 128, 7];
        let tensors: Vec<TensorDesc> =
            numels.iter().map(|&numel| TensorDesc { numel, dtype: Dtype::F16 }).collect();
        let l = Layout::new(&tensors, 100).unwrap();
        assert_eq!(ALIGN_ELEMS * 4, MASTER_ALIGN);
        let mut end = 0;
        for (i, &numel) in numels.iter().enumerate() {
            let r = l.range(i);
            assert_eq!(r.start % ALIGN_ELEMS, 0, "tensor {i} starts at {}", r.start);
            assert_eq!(r.start, end, "tensor {i} starts right after the previous slot");
            assert_eq!(r.len(), numel);
            assert_eq!(l.padding(i).start, r.end);
            assert!(l.padding(i).len() < ALIGN_ELEMS);
            assert_eq!(l.slot(i), r.start..l.padding(i).end);
            for pos in l.slot(i) {
                assert_eq!(l.tensor_at(pos), i, "element {pos}");
            }
            end = l.slot(i).end;
        }
        assert_eq!(l.len(), end);
        assert_eq!(l.len(), 64 + 64 + 64 + 128 + 128 + 64);
        for b in l.buckets() {
            assert_eq!((b.start % ALIGN_ELEMS, b.end % ALIGN_ELEMS), (0, 0), "bucket {b:?}");
        }
    }

    #[test]
    fn a_layout_without_padding_is_the_packed_one() {
        let desc = |numel| TensorDesc { numel, dtype: Dtype::Bf16 };
        let even = [desc(64), desc(128), desc(4096)];
        let (a, p) = (Layout::new(&even, 100).unwrap(), Layout::packed(&even, 100).unwrap());
        assert_eq!((a.hash(), a.len(), a.buckets()), (p.hash(), p.len(), p.buckets()));
        let odd = [desc(3), desc(128)];
        let (a, p) = (Layout::new(&odd, 100).unwrap(), Layout::packed(&odd, 100).unwrap());
        assert_ne!(a.hash(), p.hash(), "the padding moves tensor 1");
        assert_eq!((p.range(1), p.len()), (3..131, 131));
        assert_eq!((a.range(1), a.len()), (64..192, 192));
    }

    #[test]
    fn every_tensor_lies_in_the_bucket_it_is_assigned() {
        let tensors: Vec<TensorDesc> = [3, 2, 7, 1, 9, 4]
            .iter()
            .map(|&numel| TensorDesc { numel, dtype: Dtype::F32 })
            .collect();
        for target in 1..30 {
            let l = Layout::new(&tensors, target).unwrap();
            for i in 0..tensors.len() {
                let b = &l.buckets()[l.bucket_of(i)];
                assert!(
                    b.start <= l.range(i).start && l.range(i).end <= b.end,
                    "target {target} tensor {i}"
                );
            }
        }
    }
}

//! Where each tensor lives in the flat FP32 master and how the master is cut into communication
//! buckets: the part of an accumulator that every backend and every rank must agree on.

use std::ops::Range;

use super::TensorDesc;
use crate::error::{Error, Result};
use crate::state;

/// Tensor offsets, buckets and the layout's fingerprint.
#[derive(Debug)]
pub(crate) struct Layout {
    /// Start of each tensor in the master, plus the total length at the end.
    offsets: Vec<usize>,
    /// Element ranges reduced one at a time at the boundary; each holds whole tensors.
    buckets: Vec<Range<usize>>,
    /// Identifies the layout, so ranks with different layouts fail instead of mixing.
    hash: u64,
}

impl Layout {
    /// Lays `tensors` out one after another and groups them into buckets of about
    /// `bucket_numel` elements. Fails on an empty list, an empty tensor, or a total too large.
    pub(crate) fn new(tensors: &[TensorDesc], bucket_numel: usize) -> Result<Self> {
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
        // and an accumulator) agree only if they hold the same tensors in the same places.
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
        Ok(Layout { hash: state::checksum(&bytes), offsets, buckets })
    }

    /// Total elements of the master.
    pub(crate) fn len(&self) -> usize {
        *self.offsets.last().expect("offsets end with the total")
    }

    /// Tensor `index`'s element range in the master.
    pub(crate) fn range(&self, index: usize) -> Range<usize> {
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

    /// The tensor holding element `pos` of the master.
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

//! The buffers a copying transport keeps of its own: the workspace, placed half a page past a
//! page boundary, and FP32 values viewed as the 16-bit words they travel as.

/// The memory a copying transport hands its collectives: its outbox, the other ranks' copies of
/// this rank's piece, and the block values. The caller's buffer is never handed over; it is
/// copied into the outbox before a collective and out of it after one completed. A transport
/// between processes keeps the workspace for as long as a collective it abandoned (a timeout, an
/// abort) may still read or write it, instead of freeing it when the call returns.
#[derive(Debug, Default)]
pub(crate) struct Workspace {
    /// One step's pieces, packed in rank order: the pieces this rank sends in the exchange, then
    /// the gather's in-place buffer.
    pub stage: Vec<f32>,
    /// The other ranks' copies of this rank's piece, one slot per other rank, in rank order.
    pub scratch: Vec<f32>,
    pub mine: Vec<f64>,
    pub all: Vec<f64>,
}

/// Where a transport's own buffers start within a page: half a page past a boundary. Copies
/// between such a buffer and the caller's run at half speed when the two addresses agree in their
/// low 12 bits, or nearly (a load waits for an unrelated store that looks like the same address:
/// "4K aliasing"), and the caller's buffers usually start on a page boundary or a few bytes past
/// one (malloc's header). Measured at 2 processes, 16M elements, on a loaded machine: the
/// shared-memory sync took 43.8 ms with page-aligned outboxes and 23.8 ms with these (39.3 and
/// 40.9 ms as MPI messages in the same runs).
pub(crate) const SKEW: usize = 2048;

/// Bytes in a page.
pub(crate) const PAGE: usize = 4096;

/// Values from `p` to the next address [`SKEW`] past a page boundary.
fn skew_of(p: *const f32) -> usize {
    (SKEW + PAGE - p as usize % PAGE) % PAGE / 4
}

/// `n` values of `v` (grown as needed) that start [`SKEW`] past a page boundary.
pub(crate) fn skewed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n + PAGE / 4 {
        v.resize(n + PAGE / 4, 0.0);
    }
    let at = skew_of(v.as_ptr());
    &mut v[at..at + n]
}

/// The values of `v` from where [`skewed`] starts them.
pub(crate) fn skewed_ref(v: &[f32]) -> &[f32] {
    &v[skew_of(v.as_ptr()).min(v.len())..]
}

/// The 16-bit words an FP32 buffer travels as: two per value, bit for bit.
pub(crate) fn words(v: &[f32]) -> &[u16] {
    // SAFETY: the same bytes viewed as u16 (alignment 2 divides f32's 4, every bit pattern is a
    // valid u16), borrowed for as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

/// [`words`], writable: any words written make valid f32 bit patterns.
pub(crate) fn words_mut(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `words`, and every pattern written through the view is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2) }
}

/// FP32 values travelling as [`words`]: the words must start on a 4-byte boundary and come in
/// pairs (every outbox and every range of FP32 values in one does).
pub(crate) fn values(w: &[u16]) -> &[f32] {
    assert!(
        w.as_ptr().cast::<f32>().is_aligned() && w.len().is_multiple_of(2),
        "FP32 values travel as aligned pairs of words"
    );
    // SAFETY: the assertion makes the pointer f32-aligned and the length whole values; every bit
    // pattern is a valid f32; borrowed for as long as `w`.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), w.len() / 2) }
}

/// [`values`], writable.
pub(crate) fn values_mut(w: &mut [u16]) -> &mut [f32] {
    assert!(
        w.as_ptr().cast::<f32>().is_aligned() && w.len().is_multiple_of(2),
        "FP32 values travel as aligned pairs of words"
    );
    // SAFETY: as in `values`; any f32 written makes valid u16 words.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast(), w.len() / 2) }
}

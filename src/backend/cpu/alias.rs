//! Where an f32 pass would stall on its own stores ("4K aliasing"), and when the SIMD loops visit
//! their vectors backward to avoid it. The AVX2 and AVX-512 fused passes share this rule through
//! `accumulate_in_direction`; see `docs/kernels.md`, "Where the buffers lie".

/// Bytes within which a store to the master can stall a later load of an f32 gradient: the cores
/// measured match a load against older stores by the low 12 address bits, so when the gradient
/// lies 1..`ALIAS_WINDOW` bytes below the master modulo 4 KiB, loads running ahead of the last
/// stores can wait on them. `cargo bench --bench add` measures it (the placement rows: 16, 48 and
/// 144 bytes stall, 1024 and 4048 do not; the edge at 256 is not pinned down).
const ALIAS_WINDOW: usize = 256;

/// Longest f32 piece worth turning around (one call's: a thread's part of a tensor; 8 MiB of
/// master and gradient together): once the two streams come from DRAM the stall hides behind its
/// latency, and a descending pass runs slower than an ascending one. On the Xeon measured that
/// starts between 2M and 3M elements (6-11% slower at 3M and 4M), on the EPYC past 4M.
const REVERSE_MAX: usize = 1 << 20;

/// Whether an f32 pass over `master` and `grad` should visit its vectors backward: a forward loop
/// would stall on its own stores (a backward one meets that only when the gradient lies just above
/// the master instead), and the piece is at most `REVERSE_MAX` elements long.
pub(super) fn visit_backward(master: &[f32], grad: &[f32]) -> bool {
    let distance = (master.as_ptr() as usize).wrapping_sub(grad.as_ptr() as usize) % 4096;
    (1..ALIAS_WINDOW).contains(&distance) && master.len() <= REVERSE_MAX
}

/// The body of a SIMD path's fused pass: `accumulate_f32`, `accumulate_f16` and
/// `accumulate_bf16`, the path's loops generic over `<ASSIGN, BACKWARD>`, called in the direction
/// `visit_backward` picks for f32 gradients. 16-bit gradients advance at half the master's pace, so
/// no placement keeps them in the stall for long: they always run forward.
macro_rules! accumulate_in_direction {
    ($master:ident, $grad:ident, $factor:ident, $assign:ident) => {
        match ($grad, $assign) {
            (Grad::F32(g), assign) => match (assign, super::alias::visit_backward($master, g)) {
                (false, false) => accumulate_f32::<false, false>($master, g, $factor),
                (false, true) => accumulate_f32::<false, true>($master, g, $factor),
                (true, false) => accumulate_f32::<true, false>($master, g, $factor),
                (true, true) => accumulate_f32::<true, true>($master, g, $factor),
            },
            (Grad::F16(g), false) => accumulate_f16::<false, false>($master, g, $factor),
            (Grad::F16(g), true) => accumulate_f16::<true, false>($master, g, $factor),
            (Grad::Bf16(g), false) => accumulate_bf16::<false, false>($master, g, $factor),
            (Grad::Bf16(g), true) => accumulate_bf16::<true, false>($master, g, $factor),
        }
    };
}
pub(super) use accumulate_in_direction;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_gradient_just_below_the_master_modulo_4_kib_turns_the_loop_around() {
        let buf = vec![0.0f32; 4096];
        let master = &buf[2048..2048 + 64];
        for (bytes, backward) in
            [(0, false), (4, true), (48, true), (252, true), (256, false), (2048, false), (4092, false), (4096, false), (4096 + 48, true)]
        {
            let grad = &buf[2048 - bytes / 4..][..64];
            assert_eq!(visit_backward(master, grad), backward, "gradient {bytes} bytes below the master");
        }
        let long = vec![0.0f32; REVERSE_MAX + 16];
        assert!(visit_backward(&long[12..12 + REVERSE_MAX], &long[..64]), "REVERSE_MAX elements");
        assert!(!visit_backward(&long[12..13 + REVERSE_MAX], &long[..64]), "longer than REVERSE_MAX");
    }
}

//! Where an f32 pass would stall on its own stores ("4K aliasing"), and when the SIMD loops visit
//! their vectors backward to avoid it. The AVX2 and AVX-512 fused passes share this rule, and the
//! loop that can run either way (`accumulate_loop`, `accumulate_in_direction`); see
//! `docs/kernels.md`, "Where the buffers lie".

/// Bytes within which a store to the master can stall a later load of an f32 gradient: the cores
/// measured match a load against older stores by the low 12 address bits, so when the gradient
/// lies 1..`ALIAS_WINDOW` bytes below the master modulo 4 KiB, loads running ahead of the last
/// stores can wait on them. `cargo bench --bench add` measures it (the placement rows: 16, 48 and
/// 144 bytes stall, 1024 and 4048 do not; the edge at 256 is not pinned down).
const ALIAS_WINDOW: usize = 256;

/// Longest f32 piece worth turning around (one call's: a thread's part of a tensor; 8 MiB of
/// master and gradient together). In longer pieces a descending pass ran slower than the
/// ascending one it replaces on the Xeon measured (1.01-1.04x at 2M elements, 1.06-1.11x at 3M
/// and 4M), while the EPYC still gained at 4M; 1M keeps both at or below the forward loop.
const REVERSE_MAX: usize = 1 << 20;

/// Whether an f32 pass over `master` and `grad` should visit its vectors backward: a forward loop
/// would stall on its own stores (a backward one meets that only when the gradient lies just above
/// the master instead), and the piece is at most `REVERSE_MAX` elements long.
pub(super) fn visit_backward(master: &[f32], grad: &[f32]) -> bool {
    let distance = (master.as_ptr() as usize).wrapping_sub(grad.as_ptr() as usize) % 4096;
    (1..ALIAS_WINDOW).contains(&distance) && master.len() <= REVERSE_MAX
}

/// Defines a SIMD path's fused loop for one gradient type, generic over `<ASSIGN, BACKWARD>`: a
/// scalar head up to the path's store alignment (`$align` bytes), `UNROLL` vectors at a time, then
/// single vectors, then a scalar tail; with `BACKWARD` the vectors are visited from the last to the
/// first. Every element's arithmetic, and so every bit of the result, is the same either way. The
/// path supplies `LANES`, `UNROLL`, `scalar`, `step` and, over its own vector types, `splat`,
/// `nothing_seen` and `seen_non_finite`.
macro_rules! accumulate_loop {
    ($features:literal, $align:literal, $name:ident, $elem:ty, $load:ident, $decode:expr) => {
        #[target_feature(enable = $features)]
        fn $name<const ASSIGN: bool, const BACKWARD: bool>(
            master: &mut [f32],
            grad: &[$elem],
            factor: f32,
        ) -> bool {
            let n = master.len().min(grad.len());
            let head = master.as_ptr().align_offset($align).min(n);
            let body = (n - head) / LANES * LANES;
            let mut bad = scalar::accumulate_with::<ASSIGN, _>(
                &mut master[..head],
                &grad[..head],
                factor,
                $decode,
            );
            let (m, g) = (master.as_mut_ptr(), grad.as_ptr());
            let f = splat(factor);
            let mut seen = nothing_seen();
            // Start of the `at`-th vector visited: counted from the body's start going forward,
            // from its end going backward.
            let vector = |at: usize| {
                if BACKWARD {
                    head + body - (at + 1) * LANES
                } else {
                    head + at * LANES
                }
            };
            let mut done = 0;
            while (done + UNROLL) * LANES <= body {
                for k in 0..UNROLL {
                    let j = vector(done + k);
                    // SAFETY: head <= j and j + LANES <= head + body <= n (both ends of `vector`,
                    // with (done + UNROLL) * LANES <= body from the loop condition), and n is the
                    // shorter slice's length, so both LANES-element runs at j are in bounds; no
                    // reference to `master` is live while `m` writes; the CPU features are this
                    // function's own, which the caller checked.
                    unsafe { step::<ASSIGN>(m.add(j), $load(g.add(j)), f, &mut seen) };
                }
                done += UNROLL;
            }
            while (done + 1) * LANES <= body {
                let j = vector(done);
                // SAFETY: as in the loop above, with (done + 1) * LANES <= body from this loop's
                // condition.
                unsafe { step::<ASSIGN>(m.add(j), $load(g.add(j)), f, &mut seen) };
                done += 1;
            }
            let i = head + body;
            bad |= scalar::accumulate_with::<ASSIGN, _>(
                &mut master[i..n],
                &grad[i..n],
                factor,
                $decode,
            );
            bad | seen_non_finite(seen)
        }
    };
}
pub(super) use accumulate_loop;

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
            (Grad::F16(g), assign) => {
                let g = half::slice::HalfFloatSliceExt::reinterpret_cast(g);
                if assign {
                    accumulate_f16::<true, false>($master, g, $factor)
                } else {
                    accumulate_f16::<false, false>($master, g, $factor)
                }
            }
            (Grad::Bf16(g), assign) => {
                let g = half::slice::HalfFloatSliceExt::reinterpret_cast(g);
                if assign {
                    accumulate_bf16::<true, false>($master, g, $factor)
                } else {
                    accumulate_bf16::<false, false>($master, g, $factor)
                }
            }
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
        for (bytes, backward) in [
            (0, false),
            (4, true),
            (48, true),
            (252, true),
            (256, false),
            (2048, false),
            (4092, false),
            (4096, false),
            (4096 + 48, true),
        ] {
            let grad = &buf[2048 - bytes / 4..][..64];
            assert_eq!(
                visit_backward(master, grad),
                backward,
                "gradient {bytes} bytes below the master"
            );
        }
        let long = vec![0.0f32; REVERSE_MAX + 16];
        assert!(visit_backward(&long[12..12 + REVERSE_MAX], &long[..64]), "REVERSE_MAX elements");
        assert!(
            !visit_backward(&long[12..13 + REVERSE_MAX], &long[..64]),
            "longer than REVERSE_MAX"
        );
    }
}

//! The per-element contract of the optimizer step: AdamW and SGD on one FP32 master weight,
//! in the operation order of `torch.optim.AdamW` / `torch.optim.SGD`'s single-tensor path, in
//! f32 arithmetic with no fused multiply-add, its scalars computed once per tensor in f64 and
//! rounded to f32 as PyTorch hands a Python float to a float kernel.

use super::config::Algorithm;

/// One tensor's scalars for one step of AdamW.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamW {
    /// `1 - lr * weight_decay`; exactly 1 without decay.
    decay: f32,
    /// `1 - beta1`, the weight of `lerp(m, g, 1 - beta1)`.
    lerp: f32,
    beta2: f32,
    /// `1 - beta2`.
    one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    correction2_sqrt: f32,
    eps: f32,
    /// `-lr / (1 - beta1^t)`.
    neg_step: f32,
    /// What each gradient is multiplied by first: a boundary's pending clipping factor, else 1
    /// (exact).
    grad: f32,
}

/// One tensor's scalars for one step of SGD.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sgd {
    weight_decay: f32,
    momentum: f32,
    /// `1 - dampening`.
    keep: f32,
    nesterov: bool,
    /// No momentum buffer yet: it starts as the gradient.
    first: bool,
    neg_lr: f32,
    /// As [`AdamW`]'s.
    grad: f32,
}

/// One tensor's scalars for one step.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scalars {
    AdamW(AdamW),
    Sgd(Sgd),
}

impl Scalars {
    /// The scalars of step `t` (1 for the first step taken) at learning rate `lr`, with weight
    /// decay or not.
    pub(crate) fn new(algorithm: &Algorithm, lr: f64, decays: bool, t: u64) -> Scalars {
        match *algorithm {
            Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
                let (beta1, beta2) = (beta1 as f64, beta2 as f64);
                let wd = if decays { weight_decay as f64 } else { 0.0 };
                let t = t.min(i32::MAX as u64) as u32;
                Scalars::AdamW(AdamW {
                    decay: (1.0 - lr * wd) as f32,
                    lerp: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    correction2_sqrt: (1.0 - powi_steps(beta2, t)).sqrt() as f32,
                    eps,
                    neg_step: (-lr / (1.0 - powi_steps(beta1, t))) as f32,
                    grad: 1.0,
                })
            }
            Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => Scalars::Sgd(Sgd {
                weight_decay: if decays { weight_decay } else { 0.0 },
                momentum,
                keep: (1.0 - dampening as f64) as f32,
                nesterov,
                first: t == 1,
                neg_lr: (-lr) as f32,
                grad: 1.0,
            }),
        }
    }

    /// These scalars with each gradient multiplied by `factor` before it is used, rounded to
    /// f32: the product the boundary's clipping would have stored ([`crate::simd::scale`]'s
    /// bits), formed in the step's pass instead.
    pub(crate) fn grad_factor(mut self, factor: f32) -> Scalars {
        match &mut self {
            Scalars::AdamW(a) => a.grad = factor,
            Scalars::Sgd(s) => s.grad = factor,
        }
        self
    }
}

/// `a^t` by binary powering, each multiply rounded: the arithmetic of compiler-rt's `__powidf2`,
/// which `f64::powi` calls, written out so that the CUDA kernels' `ga_powi` (kernels/math.cuh)
/// repeats it bit for bit.
#[inline]
pub(crate) fn powi_steps(mut a: f64, mut t: u32) -> f64 {
    let mut r = 1.0;
    loop {
        if t & 1 != 0 {
            r *= a;
        }
        t >>= 1;
        if t == 0 {
            return r;
        }
        a *= a;
    }
}

/// `torch.lerp(start, end, weight)` on the CPU: from the nearer end, so that weight 1 gives `end`.
#[inline(always)]
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

impl AdamW {
    /// Steps one element: its master weight `w`, first moment `m` and second moment `v`, from
    /// its gradient `g`.
    #[inline(always)]
    pub(crate) fn step(&self, g: f32, w: &mut f32, m: &mut f32, v: &mut f32) {
        let g = g * self.grad;
        if self.decay != 1.0 {
            *w *= self.decay;
        }
        *m = lerp(*m, g, self.lerp);
        *v = *v * self.beta2 + self.one_minus_beta2 * g * g;
        let denom = v.sqrt() / self.correction2_sqrt + self.eps;
        *w += self.neg_step * *m / denom;
    }
}

impl Sgd {
    /// Steps one element: its master weight `w` and momentum buffer `b`, from its gradient `g`.
    /// Straight-line (selects, every value stored), so the loop over a piece vectorizes.
    #[inline(always)]
    pub(crate) fn step(&self, g: f32, w: &mut f32, b: &mut f32) {
        let g = g * self.grad;
        let d = if self.weight_decay != 0.0 { g + self.weight_decay * *w } else { g };
        let moved = if self.first { d } else { *b * self.momentum + self.keep * d };
        let with_momentum = self.momentum != 0.0;
        *b = if with_momentum { moved } else { *b };
        let d = match (with_momentum, self.nesterov) {
            (false, _) => d,
            (true, true) => d + self.momentum * *b,
            (true, false) => *b,
        };
        *w += self.neg_lr * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Torch's AdamW on one element, written out: the first step from zero moments moves a
    /// weight by lr * g / (|g| + eps), whatever the betas.
    #[test]
    fn first_adamw_step_moves_by_lr_times_the_sign() {
        let a = Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let Scalars::AdamW(k) = Scalars::new(&a, 0.01, true, 1) else { unreachable!() };
        let (mut w, mut m, mut v) = (1.0f32, 0.0, 0.0);
        k.step(0.5, &mut w, &mut m, &mut v);
        assert!((w - 0.99).abs() < 1e-7, "{w}");
    }

    /// The written-out powering is `powi`'s, bit for bit.
    #[test]
    fn powi_steps_is_powi() {
        for base in [0.9f64, 0.999, 0.95, 0.5, 0.123_456_789] {
            for t in (0..200).chain([1000, 4095, 65_537, 1 << 20, i32::MAX as u32]) {
                assert_eq!(
                    powi_steps(base, t).to_bits(),
                    std::hint::black_box(base).powi(std::hint::black_box(t as i32)).to_bits(),
                    "{base}^{t}"
                );
            }
        }
    }

    #[test]
    fn sgd_momentum_starts_from_the_gradient() {
        let a =
            Algorithm::Sgd { momentum: 0.9, dampening: 0.5, nesterov: false, weight_decay: 0.0 };
        let sgd = |t| match Scalars::new(&a, 0.1, true, t) {
            Scalars::Sgd(k) => k,
            _ => unreachable!(),
        };
        let (mut w, mut b) = (1.0f32, 123.0);
        sgd(1).step(2.0, &mut w, &mut b);
        assert_eq!((w, b), (1.0 - 0.2, 2.0));
        sgd(2).step(2.0, &mut w, &mut b);
        assert_eq!(b, 2.0 * 0.9 + 0.5 * 2.0);
    }
}

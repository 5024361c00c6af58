//! The exact (f64) optimizer step of one element from the state it started from, and the bound
//! each f32 step meets: the independent reference of the optimizer's tests.

use gradacc::Algorithm;

/// One unit of f32 rounding.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// How far `got` is from `exact`, in units of f32 rounding of `magnitude`.
pub fn ulps(got: f32, exact: f64, magnitude: f64) -> f64 {
    if got as f64 == exact {
        return 0.0;
    }
    (got as f64 - exact).abs() / (U * magnitude.max(f64::MIN_POSITIVE))
}

/// The bound each step meets, per element and quantity: within this many f32 roundings of the
/// magnitudes of the quantity's terms, from the state the step started from.
pub const BOUND: f64 = 8.0;

/// Checks one step of one element against exact arithmetic; returns the worst distance seen.
#[allow(clippy::too_many_arguments)]
pub fn check_element(
    algorithm: Algorithm,
    lr: f64,
    decays: bool,
    t: i32,
    g: f64,
    before: (f64, f64, f64),
    after: (f32, f32, f32),
) -> f64 {
    let (w, m, v) = before;
    let (w1, m1, v1) = after;
    match algorithm {
        Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
            let (b1, b2, eps) = (beta1 as f64, beta2 as f64, eps as f64);
            let wd = if decays { weight_decay as f64 } else { 0.0 };
            let m_exact = m + (1.0 - b1) * (g - m);
            let v_exact = b2 * v + (1.0 - b2) * g * g;
            // The weight from the step's own moments: each quantity's rounding on its own.
            let denom = (v1 as f64).sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            let update = lr / (1.0 - b1.powi(t)) * m1 as f64 / denom;
            let w_exact = w * (1.0 - lr * wd) - update;
            ulps(m1, m_exact, m.abs() + g.abs())
                .max(ulps(v1, v_exact, b2 * v + (1.0 - b2) * g * g))
                .max(ulps(w1, w_exact, w.abs() + update.abs()))
        }
        Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => {
            let wd = if decays { weight_decay as f64 } else { 0.0 };
            let (mo, keep) = (momentum as f64, 1.0 - dampening as f64);
            let d = g + wd * w;
            let mut worst = 0.0f64;
            let step = if momentum == 0.0 {
                d
            } else {
                let m_exact = if t == 1 { d } else { m * mo + keep * d };
                worst = ulps(m1, m_exact, (m * mo).abs() + keep * (g.abs() + (wd * w).abs()));
                if nesterov {
                    d + mo * m1 as f64
                } else {
                    m1 as f64
                }
            };
            let w_exact = w - lr * step;
            // The terms of the step: the gradient, the decay and (Nesterov) the momentum.
            let terms =
                g.abs() + (wd * w).abs() + if nesterov { mo * (m1 as f64).abs() } else { 0.0 };
            let terms = if momentum == 0.0 || nesterov { terms } else { (m1 as f64).abs() };
            worst.max(ulps(w1, w_exact, w.abs() + lr * terms))
        }
    }
}
